//! The reconciler's exact Kubernetes API traffic, checked request by request against a mock API
//! server (tower-test), with an in-test provider stub recording every provider call.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use http::Method;
use kube::Client;
use kube::runtime::controller::Action as Requeue;
use serde_json::{Value, json};

use crate::support::mock_api::{Call, mock_client, status};
use crate::support::stub_provider::StubProvider;

use proxy_operator::controllers::proxy::{
    Context, HealthStates, ReconcilerConfig, ReconcilerMetrics, reconcile,
};
use proxy_operator::credentials::machine_secret_name;
use proxy_operator::health::HealthTransition;
use proxy_operator::ledger::{LedgerConfig, SqliteLedger, SqliteOptions, SystemClock};
use proxy_operator::provider::{ErrorClass, INSTALL_LABEL, Instance, InstanceState, Provider};
use proxy_operator::resources::proxy::{Proxy, ProxyId};
use proxy_operator::resources::spec_hash::{SPEC_HASH_VERSION, SpecHashInput};

const NS: &str = "crawl";
const NAME: &str = "p1";
const UID: &str = "7d0f9a1e-2c44-4b59-9a4f-0e5b1f3c2d10";
const PROXY_PATH: &str = "/apis/crawl.example.com/v1alpha1/namespaces/crawl/proxies/p1";
const STATUS_PATH: &str = "/apis/crawl.example.com/v1alpha1/namespaces/crawl/proxies/p1/status";
const EVENTS_PATH: &str = "/apis/events.k8s.io/v1/namespaces/crawl/events";
const SECRETS_PATH: &str = "/api/v1/namespaces/crawl/secrets";
const CLOUD_INIT: &str = "#cloud-config\n";
const NOW: &str = "2023-11-14T22:13:20Z";

fn now() -> jiff::Timestamp {
    jiff::Timestamp::from_second(1_700_000_000).unwrap()
}

fn instance(state: InstanceState, ip: Option<&str>) -> Instance {
    Instance {
        provider_id: "crawl/proxy-abc".into(),
        name: "proxy-abc".into(),
        state,
        ip: ip.map(str::to_owned),
        uid: Some(UID.into()),
        created_at: None,
        waiting: None,
        deletion_deadline: None,
    }
}

/// One expected request: method, path, a check of its JSON body, and the answer (by default
/// 200 with the stored Proxy, or the Event echoed).
struct Expect {
    method: Method,
    path: String,
    body: Box<dyn Fn(&Value) + Send>,
    reply: Option<(u16, Value)>,
}

fn expect(
    method: Method,
    path: impl Into<String>,
    body: impl Fn(&Value) + Send + 'static,
) -> Expect {
    Expect {
        method,
        path: path.into(),
        body: Box::new(body),
        reply: None,
    }
}

impl Expect {
    fn answered(self, code: u16, reply: Value) -> Expect {
        Expect {
            reply: Some((code, reply)),
            ..self
        }
    }
}

/// The path of the credentials Secret of the Proxy's machines.
fn secret_path() -> String {
    format!("{SECRETS_PATH}/{}", machine_secret_name(UID))
}

/// The read of the machines' credentials Secret before a create, finding it.
fn existing_credentials() -> Expect {
    let secret = json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": machine_secret_name(UID), "namespace": NS},
        // base64 of `u:$6$salt$hash`
        "data": {"username": "dQ==", "password": "cA==", "htpasswd": "dTokNiRzYWx0JGhhc2g="},
    });
    expect(Method::GET, secret_path(), |_| {}).answered(200, secret)
}

fn body_eq(expected: Value) -> impl Fn(&Value) + Send + 'static {
    move |actual| assert_eq!(actual, &expected)
}

/// A reconcile context on the test clock, with a real ledger in a temporary directory (kept
/// alive by the returned guard).
fn context(
    client: Client,
    providers: HashMap<String, Arc<dyn Provider>>,
    config: ReconcilerConfig,
) -> (Context, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let ledger = SqliteLedger::open(
        &dir.path().join("ledger.db"),
        SqliteOptions::default(),
        LedgerConfig::default(),
        Arc::new(SystemClock),
    )
    .unwrap();
    // An empty fleet view, as after the controller's first list.
    let (store, mut writer) = kube::runtime::reflector::store::<Proxy>();
    writer.apply_watcher_event(&kube::runtime::watcher::Event::Init);
    writer.apply_watcher_event(&kube::runtime::watcher::Event::InitDone);
    let ctx = Context {
        clock: now,
        fleet: std::sync::OnceLock::from(store),
        ..Context::new(
            client,
            providers,
            "test-install".into(),
            config,
            Arc::new(ledger),
            ReconcilerMetrics::register(&prometheus::Registry::new()).expect("fleet metrics"),
        )
    };
    (ctx, dir)
}

/// Runs one reconcile of `proxy` against the scripted requests; returns its requeue action.
/// Fails on any request out of order, any extra request, and any expected request not made.
async fn run(
    proxy: Value,
    stub: Option<Arc<StubProvider>>,
    health: Option<HealthTransition>,
    script: Vec<Expect>,
) -> Requeue {
    run_in(proxy, stub, health, script, true).await
}

/// [`run`], with the controller's first list of Proxies in (`listed`) or not yet.
async fn run_in(
    proxy: Value,
    stub: Option<Arc<StubProvider>>,
    health: Option<HealthTransition>,
    script: Vec<Expect>,
    listed: bool,
) -> Requeue {
    let (client, mut handle) = mock_client();
    let stored = proxy.clone();
    let proxy: Proxy = serde_json::from_value(proxy).unwrap();
    let mut providers: HashMap<String, Arc<dyn Provider>> = HashMap::new();
    if let Some(stub) = stub {
        providers.insert("local".into(), stub);
    }
    let states = HealthStates::default();
    if let Some(signal) = health {
        states.record(signal);
    }
    let config = ReconcilerConfig {
        provisioning_poll: Duration::from_secs(1),
        drift_poll: Duration::from_secs(2),
        deletion_poll: Duration::from_secs(3),
        quota_requeue: Duration::from_secs(300),
        error_requeue: Duration::from_secs(4),
        ..ReconcilerConfig::default()
    };
    let (ctx, _ledger_dir) = context(client, providers, config);
    let fleet = if listed {
        ctx.fleet
    } else {
        std::sync::OnceLock::new()
    };
    let ctx = Arc::new(Context {
        health: states,
        fleet,
        ..ctx
    });
    let verifier = tokio::spawn(async move {
        for (i, step) in script.into_iter().enumerate() {
            let call = Call::next(&mut handle).await;
            assert_eq!(call.method, step.method, "request {i}");
            assert_eq!(call.path, step.path, "request {i}");
            let mut body = call.body.clone();
            if step.path == STATUS_PATH {
                // Every status write is guarded by the resourceVersion the reconcile knows.
                let guard = body.as_object_mut().and_then(|b| b.remove("metadata"));
                assert_eq!(guard, Some(json!({"resourceVersion": "41"})), "request {i}");
            }
            (step.body)(&body);
            // Patches get the stored Proxy back; an Event is echoed.
            let (code, reply) = match step.reply {
                Some(reply) => reply,
                None if step.path == EVENTS_PATH => (200, call.body.clone()),
                None => (200, stored.clone()),
            };
            call.respond(code, reply);
        }
        // Dropping the handle makes any further request fail the reconcile.
    });
    let result = tokio::time::timeout(Duration::from_secs(30), reconcile(Arc::new(proxy), ctx))
        .await
        .expect("reconcile hung");
    tokio::time::timeout(Duration::from_secs(30), verifier)
        .await
        .expect("expected requests were not made")
        .unwrap();
    result.expect("reconcile failed")
}

fn managed(extra_metadata: Value, status: Value) -> Value {
    let mut metadata = json!({
        "name": NAME, "namespace": NS, "uid": UID, "generation": 2, "resourceVersion": "41",
    });
    for (k, v) in extra_metadata.as_object().unwrap() {
        metadata[k] = v.clone();
    }
    json!({
        "apiVersion": "crawl.example.com/v1alpha1",
        "kind": "Proxy",
        "metadata": metadata,
        "spec": {"mode": "Managed", "provider": "local", "cloudInit": {"inline": CLOUD_INIT}},
        "status": status,
    })
}

fn desired_hash() -> String {
    let proxy: Proxy = serde_json::from_value(managed(json!({}), json!({}))).unwrap();
    SpecHashInput::new(&proxy.spec, Some(CLOUD_INIT)).hash()
}

fn recorded(hash: &str) -> Value {
    json!({
        "crawl.example.com/spec-hash": hash,
        "crawl.example.com/spec-hash-version": SPEC_HASH_VERSION,
    })
}

fn event_with_reason(reason: &'static str) -> impl Fn(&Value) + Send + 'static {
    move |body| {
        assert_eq!(body["reason"], reason);
        assert_eq!(body["regarding"]["name"], NAME);
        assert_eq!(body["regarding"]["kind"], "Proxy");
    }
}

fn provisioned(status: &str, reason: &str, message: &str) -> Value {
    json!({"type": "Provisioned", "status": status, "reason": reason, "message": message,
           "lastTransitionTime": NOW, "observedGeneration": 2})
}

fn not_probed() -> Value {
    json!({"type": "Healthy", "status": "Unknown", "reason": "NotProbed",
           "message": "no probe result yet", "lastTransitionTime": NOW, "observedGeneration": 2})
}

#[tokio::test]
async fn first_reconcile_adds_the_finalizer_and_nothing_else() {
    let stub = Arc::new(StubProvider::new("local"));
    let requeue = run(
        managed(json!({}), json!(null)),
        Some(stub.clone()),
        None,
        vec![expect(
            Method::PATCH,
            PROXY_PATH,
            body_eq(json!({"metadata": {"finalizers": ["crawl.example.com/finalizer"], "resourceVersion": "41"}})),
        )],
    )
    .await;
    assert_eq!(requeue, Requeue::await_change());
    assert!(stub.calls().is_empty(), "{:?}", stub.calls());
}

#[tokio::test]
async fn create_marks_pending_creates_records_status_then_hash() {
    let stub = Arc::new(StubProvider::new("local"));
    *stub.create.lock().unwrap() = Some(Ok(instance(InstanceState::Provisioning, None)));
    let hash = desired_hash();
    let requeue = run(
        managed(json!({"finalizers": ["crawl.example.com/finalizer"]}), json!(null)),
        Some(stub.clone()),
        None,
        vec![
            expect(
                Method::PATCH,
                PROXY_PATH,
                body_eq(json!({"metadata": {"annotations": {"crawl.example.com/create-pending": hash}}})),
            ),
            expect(Method::GET, secret_path(), |_| {}).answered(
                404,
                json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                       "reason": "NotFound", "code": 404, "message": "not found"}),
            ),
            expect(Method::POST, SECRETS_PATH, |secret| {
                let metadata = &secret["metadata"];
                assert_eq!(metadata["name"], machine_secret_name(UID));
                assert_eq!(metadata["labels"]["crawl.example.com/proxy-credentials"], "true");
                assert_eq!(metadata["ownerReferences"][0]["uid"], UID);
                assert_eq!(metadata["ownerReferences"][0]["controller"], true);
                let data = &secret["stringData"];
                let user = data["username"].as_str().unwrap();
                assert_eq!(data["password"].as_str().unwrap().len(), 32);
                let line = data["htpasswd"].as_str().unwrap();
                assert!(line.starts_with(&format!("{user}:$6$")), "{line}");
            })
            .answered(201, json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "x"}})),
            expect(
                Method::PATCH,
                STATUS_PATH,
                body_eq(json!({"status": {
                    "phase": "Provisioning",
                    "providerID": "crawl/proxy-abc",
                    "ip": null,
                    "observedGeneration": 2,
                    "conditions": [provisioned("False", "Provisioning", "machine is being created"), not_probed()],
                    "latencyMs": null,
                    "lastHealthCheckTime": null,
                    "port": 3128,
                    "machineCreatedAt": null,
                    "exitIP": null,
                    "exitIPChangedAt": null,
                    "exitCountry": null,
                    "exitASN": null,
                    "exitOrganization": null,
                    "disruption": null,
                }})),
            ),
            expect(
                Method::PATCH,
                PROXY_PATH,
                body_eq(json!({"metadata": {"annotations": {
                    "crawl.example.com/spec-hash": hash,
                    "crawl.example.com/spec-hash-version": SPEC_HASH_VERSION,
                    "crawl.example.com/create-pending": null,
                    "crawl.example.com/rotated": null,
                }}})),
            ),
            expect(Method::POST, EVENTS_PATH, event_with_reason("Created")),
        ],
    )
    .await;
    assert_eq!(requeue, Requeue::requeue(Duration::from_secs(1)));
    let request = stub.created.lock().unwrap().clone().unwrap();
    assert_eq!(
        request.machine_name,
        proxy_operator::resources::naming::machine_name(UID)
    );
    assert_eq!(request.cloud_init.as_deref(), Some(CLOUD_INIT));
    assert_eq!(request.labels["crawl.example.com/managed"], "true");
    assert_eq!(request.labels["crawl.example.com/proxy-uid"], UID);
    assert_eq!(request.labels[INSTALL_LABEL], "test-install");
    let credentials = request.credentials.expect("the machine gets credentials");
    assert_eq!(credentials.secret_name, machine_secret_name(UID));
    assert!(
        credentials.htpasswd.contains(":$6$"),
        "{}",
        credentials.htpasswd
    );
}

#[tokio::test]
async fn interrupted_create_is_recovered_by_name_without_a_second_create() {
    // The stub lists nothing, so recovery falls through to create (idempotent by name).
    let stub = Arc::new(StubProvider::new("local"));
    *stub.create.lock().unwrap() = Some(Ok(instance(InstanceState::Provisioning, None)));
    let hash = desired_hash();
    let metadata = json!({
        "finalizers": ["crawl.example.com/finalizer"],
        "annotations": {"crawl.example.com/create-pending": hash},
    });
    run(
        managed(metadata, json!(null)),
        Some(stub.clone()),
        None,
        vec![
            expect(Method::PATCH, PROXY_PATH, |_| {}),
            existing_credentials(),
            expect(Method::PATCH, STATUS_PATH, |b| {
                assert_eq!(b["status"]["providerID"], "crawl/proxy-abc")
            }),
            expect(Method::PATCH, PROXY_PATH, |_| {}),
            expect(Method::POST, EVENTS_PATH, event_with_reason("Created")),
        ],
    )
    .await;
    let name = proxy_operator::resources::naming::machine_name(UID);
    assert_eq!(stub.calls(), ["list".to_owned(), format!("create {name}")]);
}

#[tokio::test]
async fn running_sets_the_ip_once_and_then_writes_nothing() {
    let stub = Arc::new(StubProvider::new("local"));
    *stub.get.lock().unwrap() = Some(Ok(instance(InstanceState::Running, Some("10.1.2.3"))));
    let hash = desired_hash();
    let metadata =
        json!({"finalizers": ["crawl.example.com/finalizer"], "annotations": recorded(&hash)});
    let health = HealthTransition {
        id: ProxyId {
            namespace: NS.into(),
            name: NAME.into(),
            uid: UID.into(),
        },
        healthy: true,
        latency: Duration::from_millis(37),
        at: now(),
        message: "HTTP 204".into(),
        proxy_url: "http://10.1.2.3:3128".into(),
    };
    let expected_status = json!({
        "phase": "Ready",
        "providerID": "crawl/proxy-abc",
        "ip": "10.1.2.3",
        "observedGeneration": 2,
        "conditions": [
            provisioned("True", "Running", "machine is running"),
            {"type": "Healthy", "status": "True", "reason": "ProbeSucceeded", "message": "HTTP 204",
             "lastTransitionTime": NOW, "observedGeneration": 2},
        ],
        "latencyMs": 37,
        "lastHealthCheckTime": NOW,
        "port": 3128,
        "machineCreatedAt": null,
        "exitIP": null,
        "exitIPChangedAt": null,
        "exitCountry": null,
        "exitASN": null,
        "exitOrganization": null,
        "disruption": null,
    });
    let before = json!({
        "phase": "Provisioning",
        "providerID": "crawl/proxy-abc",
        "observedGeneration": 2,
        "conditions": [provisioned("False", "Provisioning", "machine is being created"), not_probed()],
    });
    let requeue = run(
        managed(metadata.clone(), before),
        Some(stub.clone()),
        Some(health.clone()),
        vec![expect(
            Method::PATCH,
            STATUS_PATH,
            body_eq(json!({"status": expected_status})),
        )],
    )
    .await;
    assert_eq!(requeue, Requeue::requeue(Duration::from_secs(2)));

    // Next pass with that status stored: a provider get, and no API request at all.
    let requeue = run(
        managed(metadata, expected_status),
        Some(stub.clone()),
        Some(health),
        vec![],
    )
    .await;
    assert_eq!(requeue, Requeue::requeue(Duration::from_secs(2)));
    assert_eq!(stub.calls(), ["get crawl/proxy-abc", "get crawl/proxy-abc"]);
}

fn running_status() -> Value {
    json!({
        "phase": "Ready",
        "providerID": "crawl/proxy-abc",
        "ip": "10.1.2.3",
        "observedGeneration": 1,
        "conditions": [
            {"type": "Provisioned", "status": "True", "reason": "Running", "message": "machine is running",
             "lastTransitionTime": "2023-01-01T00:00:00Z", "observedGeneration": 1},
            {"type": "Healthy", "status": "True", "reason": "ProbeSucceeded", "message": "",
             "lastTransitionTime": "2023-01-01T00:00:00Z", "observedGeneration": 1},
        ],
    })
}

#[tokio::test]
async fn spec_change_drains_replaces_and_waits_for_not_found() {
    let stub = Arc::new(StubProvider::new("local"));
    *stub.get.lock().unwrap() = Some(Ok(instance(InstanceState::Running, Some("10.1.2.3"))));
    let metadata =
        json!({"finalizers": ["crawl.example.com/finalizer"], "annotations": recorded("old-hash")});

    // The spec changed under a serving machine: a slot of the budget, then a drain, no delete.
    let requeue = run(
        managed(metadata.clone(), running_status()),
        Some(stub.clone()),
        None,
        vec![
            expect(Method::PATCH, STATUS_PATH, |b: &Value| {
                let s = &b["status"];
                assert_eq!(s["phase"], "Replacing");
                assert_eq!(s["ip"], "10.1.2.3", "a draining machine keeps serving");
                assert_eq!(s["conditions"][0]["reason"], "Draining");
                assert_eq!(s["disruption"]["reason"], "SpecChange");
                assert_eq!(s["disruption"]["since"], NOW);
                assert_eq!(s["disruption"]["replacedAt"], Value::Null);
            }),
            expect(Method::POST, EVENTS_PATH, event_with_reason("Draining")),
        ],
    )
    .await;
    assert_eq!(requeue, Requeue::requeue(Duration::from_secs(3)));
    assert_eq!(stub.calls(), ["get crawl/proxy-abc"]);

    // Drained (no lease): delete the machine.
    let mut draining = running_status();
    draining["phase"] = json!("Replacing");
    draining["conditions"][0] = provisioned("False", "Draining", "draining");
    draining["disruption"] = json!({"reason": "SpecChange", "since": NOW});
    let replacing = |b: &Value| {
        let s = &b["status"];
        assert_eq!(s["phase"], "Replacing");
        assert_eq!(s["providerID"], "crawl/proxy-abc");
        assert_eq!(s["ip"], Value::Null);
        assert_eq!(s["conditions"][0]["reason"], "Replacing");
        assert_eq!(s["conditions"][0]["status"], "False");
        assert_eq!(s["conditions"][0]["lastTransitionTime"], NOW);
        // The old machine's verdict goes with it: nothing to probe until the new one runs.
        assert_eq!(s["conditions"][1]["status"], "Unknown");
        assert_eq!(s["conditions"][1]["reason"], "NotProbed");
        assert_eq!(s["conditions"][1]["message"], "no address to probe");
        assert_eq!(s["conditions"][1]["lastTransitionTime"], NOW);
    };
    let requeue = run(
        managed(metadata.clone(), draining.clone()),
        Some(stub.clone()),
        None,
        vec![
            expect(Method::PATCH, STATUS_PATH, replacing),
            expect(Method::POST, EVENTS_PATH, event_with_reason("Replacing")),
        ],
    )
    .await;
    assert_eq!(requeue, Requeue::requeue(Duration::from_secs(3)));
    assert_eq!(
        stub.calls()[1..],
        ["get crawl/proxy-abc", "delete crawl/proxy-abc"]
    );

    // Still there (terminating): delete again, no create, no second event.
    *stub.get.lock().unwrap() = Some(Ok(instance(InstanceState::Terminated, None)));
    let mut status = draining;
    status["ip"] = Value::Null;
    status["observedGeneration"] = json!(2);
    status["conditions"][0] = provisioned(
        "False",
        "Replacing",
        "spec changed; deleting the machine to create a new one",
    );
    status["conditions"][1]["observedGeneration"] = json!(1);
    run(
        managed(metadata.clone(), status.clone()),
        Some(stub.clone()),
        None,
        vec![],
    )
    .await;
    assert_eq!(
        stub.calls()[3..],
        ["get crawl/proxy-abc", "delete crawl/proxy-abc"]
    );

    // NotFound: forget the ID and IP, record the new hash; the next pass creates.
    *stub.get.lock().unwrap() = Some(Err(ErrorClass::NotFound));
    let hash = desired_hash();
    let requeue = run(
        managed(metadata, status),
        Some(stub.clone()),
        None,
        vec![
            expect(Method::PATCH, STATUS_PATH, |b| {
                assert_eq!(b["status"]["providerID"], Value::Null);
                assert_eq!(b["status"]["phase"], "Provisioning");
                assert_eq!(b["status"]["conditions"][0]["reason"], "MachineGone");
                // The old machine is gone: what comes next is its replacement.
                assert_eq!(b["status"]["disruption"]["reason"], "SpecChange");
                assert_eq!(b["status"]["disruption"]["replacedAt"], NOW);
            }),
            expect(
                Method::PATCH,
                PROXY_PATH,
                body_eq(json!({"metadata": {"annotations": {
                    "crawl.example.com/spec-hash": hash,
                    "crawl.example.com/spec-hash-version": SPEC_HASH_VERSION,
                    "crawl.example.com/create-pending": null,
                }}})),
            ),
        ],
    )
    .await;
    assert_eq!(requeue, Requeue::requeue(Duration::ZERO));
    assert!(
        !stub.calls().iter().any(|c| c.starts_with("create")),
        "{:?}",
        stub.calls()
    );
}

#[tokio::test]
async fn no_drain_starts_before_the_first_list_of_proxies() {
    // Right after start-up the budget's holders are unknown: the spec change waits, writing
    // nothing, and is looked at again after the provisioning poll.
    let stub = Arc::new(StubProvider::new("local"));
    *stub.get.lock().unwrap() = Some(Ok(instance(InstanceState::Running, Some("10.1.2.3"))));
    let metadata =
        json!({"finalizers": ["crawl.example.com/finalizer"], "annotations": recorded("old-hash")});
    let requeue = run_in(
        managed(metadata, running_status()),
        Some(stub.clone()),
        None,
        vec![],
        false,
    )
    .await;
    assert_eq!(requeue, Requeue::requeue(Duration::from_secs(1)));
    assert_eq!(stub.calls(), ["get crawl/proxy-abc"]);
}

#[tokio::test]
async fn empty_hash_annotation_is_adopted_not_replaced() {
    let stub = Arc::new(StubProvider::new("local"));
    *stub.get.lock().unwrap() = Some(Ok(instance(InstanceState::Running, Some("10.1.2.3"))));
    let hash = desired_hash();
    run(
        managed(
            json!({"finalizers": ["crawl.example.com/finalizer"]}),
            running_status(),
        ),
        Some(stub.clone()),
        None,
        vec![expect(
            Method::PATCH,
            PROXY_PATH,
            body_eq(json!({"metadata": {"annotations": {
                "crawl.example.com/spec-hash": hash,
                "crawl.example.com/spec-hash-version": SPEC_HASH_VERSION,
                "crawl.example.com/create-pending": null,
            }}})),
        )],
    )
    .await;
    assert_eq!(stub.calls(), ["get crawl/proxy-abc"]);
}

#[tokio::test]
async fn deletion_deletes_the_machine_then_removes_the_finalizer() {
    let stub = Arc::new(StubProvider::new("local"));
    *stub.get.lock().unwrap() = Some(Ok(instance(InstanceState::Running, Some("10.1.2.3"))));
    let metadata = json!({
        "finalizers": ["other.example.com/keep", "crawl.example.com/finalizer"],
        "deletionTimestamp": "2023-11-14T22:00:00Z",
        "annotations": recorded(&desired_hash()),
    });
    let requeue = run(
        managed(metadata.clone(), running_status()),
        Some(stub.clone()),
        None,
        vec![
            expect(Method::PATCH, STATUS_PATH, |b| {
                assert_eq!(b["status"]["phase"], "Deleting");
                assert_eq!(b["status"]["conditions"][0]["reason"], "Deleting");
            }),
            expect(Method::POST, EVENTS_PATH, event_with_reason("Deleting")),
        ],
    )
    .await;
    assert_eq!(requeue, Requeue::requeue(Duration::from_secs(3)));
    assert_eq!(
        stub.calls(),
        ["get crawl/proxy-abc", "delete crawl/proxy-abc"]
    );

    *stub.get.lock().unwrap() = Some(Err(ErrorClass::NotFound));
    let requeue = run(
        managed(metadata, running_status()),
        Some(stub.clone()),
        None,
        vec![expect(
            Method::PATCH,
            PROXY_PATH,
            body_eq(json!({"metadata": {"finalizers": ["other.example.com/keep"], "resourceVersion": "41"}})),
        )],
    )
    .await;
    assert_eq!(requeue, Requeue::await_change());
    assert_eq!(stub.calls().len(), 3, "only a get: {:?}", stub.calls());
}

#[tokio::test]
async fn external_gets_status_without_finalizer_or_provider() {
    let proxy = json!({
        "apiVersion": "crawl.example.com/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": NAME, "namespace": NS, "uid": UID, "generation": 2, "resourceVersion": "41"},
        "spec": {"mode": "External", "endpoint": {"host": "proxy.example.net", "port": 8080}},
    });
    let requeue = run(
        proxy,
        None,
        None,
        vec![expect(
            Method::PATCH,
            STATUS_PATH,
            body_eq(json!({"status": {
                "phase": "Provisioning",
                "providerID": null,
                "ip": "proxy.example.net",
                "observedGeneration": 2,
                "conditions": [provisioned("True", "ExternalEndpoint", "external endpoint"), not_probed()],
                "latencyMs": null,
                "lastHealthCheckTime": null,
                "port": null,
                "machineCreatedAt": null,
                "exitIP": null,
                "exitIPChangedAt": null,
                "exitCountry": null,
                "exitASN": null,
                "exitOrganization": null,
                "disruption": null,
            }})),
        )],
    )
    .await;
    assert_eq!(requeue, Requeue::await_change());
}

#[tokio::test]
async fn permanent_failure_marks_failed_and_is_retried_on_a_slow_timer() {
    let stub = Arc::new(StubProvider::new("local"));
    *stub.create.lock().unwrap() = Some(Err(ErrorClass::Permanent));
    let metadata = json!({"finalizers": ["crawl.example.com/finalizer"]});
    let mut stored = Value::Null;
    run(
        managed(metadata.clone(), json!(null)),
        Some(stub.clone()),
        None,
        vec![
            expect(Method::PATCH, PROXY_PATH, |_| {}),
            existing_credentials(),
            expect(Method::PATCH, STATUS_PATH, |b| {
                assert_eq!(b["status"]["phase"], "Failed");
                assert_eq!(b["status"]["conditions"][0]["reason"], "ProviderFailed");
                assert_eq!(b["status"]["conditions"][0]["observedGeneration"], 2);
            }),
            expect(
                Method::POST,
                EVENTS_PATH,
                event_with_reason("ProviderFailed"),
            ),
        ],
    )
    .await;
    assert_eq!(stub.calls().len(), 1);
    // A restart forgets the slow timer: the create is tried once more, and the condition says
    // when the next try is.
    stored["phase"] = json!("Failed");
    stored["observedGeneration"] = json!(2);
    stored["conditions"] = json!([provisioned("False", "ProviderFailed", "x"), not_probed()]);
    let requeue = run(
        managed(metadata, stored),
        Some(stub.clone()),
        None,
        vec![
            expect(Method::PATCH, PROXY_PATH, |_| {}),
            existing_credentials(),
            expect(Method::PATCH, STATUS_PATH, |b| {
                assert_eq!(b["status"]["phase"], "Failed");
                let message = b["status"]["conditions"][0]["message"].as_str().unwrap();
                assert!(
                    message.ends_with("; next attempt at 2023-11-14T22:43:20Z"),
                    "{message}"
                );
            }),
        ],
    )
    .await;
    assert_eq!(requeue, Requeue::requeue(Duration::from_secs(1800)));
    assert_eq!(stub.calls().len(), 2, "{:?}", stub.calls());
}

#[tokio::test]
async fn quota_sets_the_condition_and_requeues_in_minutes() {
    let stub = Arc::new(StubProvider::new("local"));
    *stub.create.lock().unwrap() = Some(Err(ErrorClass::QuotaExceeded));
    let requeue = run(
        managed(
            json!({"finalizers": ["crawl.example.com/finalizer"]}),
            json!(null),
        ),
        Some(stub.clone()),
        None,
        vec![
            expect(Method::PATCH, PROXY_PATH, |_| {}),
            existing_credentials(),
            expect(Method::PATCH, STATUS_PATH, |b| {
                assert_eq!(b["status"]["phase"], "Pending");
                assert_eq!(b["status"]["conditions"][0]["reason"], "QuotaExceeded");
            }),
            expect(
                Method::POST,
                EVENTS_PATH,
                event_with_reason("QuotaExceeded"),
            ),
        ],
    )
    .await;
    assert_eq!(requeue, Requeue::requeue(Duration::from_secs(300)));
}

#[tokio::test]
async fn missing_cloud_init_secret_is_a_condition_not_a_crash() {
    let stub = Arc::new(StubProvider::new("local"));
    let mut proxy = managed(
        json!({"finalizers": ["crawl.example.com/finalizer"]}),
        json!(null),
    );
    proxy["spec"]["cloudInit"] = json!({"secretRef": {"name": "ci", "key": "user-data"}});
    let (client, mut handle) = mock_client();
    let providers = HashMap::from([("local".to_owned(), stub.clone() as Arc<dyn Provider>)]);
    let (ctx, _ledger_dir) = context(client, providers, ReconcilerConfig::default());
    let ctx = Arc::new(ctx);
    let stored = proxy.clone();
    let proxy: Proxy = serde_json::from_value(proxy).unwrap();
    let task = tokio::spawn(reconcile(Arc::new(proxy), ctx));
    let call = Call::next(&mut handle).await;
    assert_eq!(call.method, Method::GET);
    assert_eq!(call.path, "/api/v1/namespaces/crawl/secrets/ci");
    call.respond(404, status(404, "NotFound", "secrets \"ci\" not found"));
    let call = Call::next(&mut handle).await;
    assert_eq!(call.path, STATUS_PATH);
    let body = &call.body;
    assert_eq!(body["status"]["phase"], "Pending");
    assert_eq!(
        body["status"]["conditions"][0]["reason"],
        "CloudInitUnavailable"
    );
    assert_eq!(
        body["status"]["conditions"][0]["message"],
        "Secret crawl/ci not found"
    );
    call.respond(200, stored);
    let requeue = task.await.unwrap().unwrap();
    assert_eq!(
        requeue,
        Requeue::requeue(ReconcilerConfig::default().provisioning_poll)
    );
    assert!(stub.calls().is_empty());
}

#[tokio::test]
async fn interrupted_create_finds_the_machine_by_name_and_records_the_pending_hash() {
    let stub = Arc::new(StubProvider::new("local"));
    let mut machine = instance(InstanceState::Provisioning, None);
    machine.name = proxy_operator::resources::naming::machine_name(UID);
    *stub.machines.lock().unwrap() = vec![instance(InstanceState::Running, None), machine];
    stub.machines.lock().unwrap()[0].name = "proxy-someoneelse".into();
    stub.machines.lock().unwrap()[0].provider_id = "crawl/proxy-someoneelse".into();
    let metadata = json!({
        "finalizers": ["crawl.example.com/finalizer"],
        "annotations": {"crawl.example.com/create-pending": "hash-at-create"},
    });
    run(
        managed(metadata, json!(null)),
        Some(stub.clone()),
        None,
        vec![
            expect(Method::PATCH, STATUS_PATH, |b| {
                assert_eq!(b["status"]["providerID"], "crawl/proxy-abc");
            }),
            expect(
                Method::PATCH,
                PROXY_PATH,
                body_eq(json!({"metadata": {"annotations": {
                    "crawl.example.com/spec-hash": "hash-at-create",
                    "crawl.example.com/spec-hash-version": SPEC_HASH_VERSION,
                    "crawl.example.com/create-pending": null,
                    "crawl.example.com/rotated": null,
                }}})),
            ),
        ],
    )
    .await;
    assert_eq!(stub.calls(), ["list"]);
}
