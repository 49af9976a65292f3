//! `proxy-operator run` in-process against a mock Kubernetes API server (tower-test): start-up
//! lists and watches Proxies, `/readyz` turns ready once the watch has synced, and an External
//! proxy backed by a real squid is reconciled to `Ready` with one status write — no finalizer,
//! no provider call. A Proxy that does not decode is skipped (Warning Event, gauge) without
//! holding up the others. Every request must be granted by the install's RBAC
//! (`rbac::API_CALLS`).

use crate::support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use proxy_operator::cli::{Cli, Command};
use proxy_operator::process::{Exit, operator};
use serde_json::{Value, json};
use support::mock_api::{ApiHandle, Call, MockLease, mock_client, status};
use support::{DEADLINE, Squid, Target, free_port};

type Requests = Arc<Mutex<Vec<(String, String, Value)>>>;

fn proxy(squid_port: u16, probe_url: &str) -> Value {
    json!({
        "apiVersion": "crawl.example.com/v1alpha1",
        "kind": "Proxy",
        "metadata": {
            "name": "ext", "namespace": "crawl", "uid": "5d0c1c1e-0000-4000-8000-000000000001",
            "resourceVersion": "7", "generation": 1,
            "creationTimestamp": "2026-11-30T00:00:00Z",
            "labels": {"geo": "eu"}
        },
        "spec": {
            "mode": "External",
            "endpoint": {"host": "127.0.0.1", "port": squid_port},
            "maxLeases": 2,
            "healthCheck": {"probeURL": probe_url, "interval": "300ms", "timeout": "2s"}
        }
    })
}

/// A Proxy stored before the CRD validated durations: `interval: "30"` has no unit.
fn undecodable_proxy() -> Value {
    json!({
        "apiVersion": "crawl.example.com/v1alpha1",
        "kind": "Proxy",
        "metadata": {
            "name": "typo", "namespace": "crawl", "uid": "5d0c1c1e-0000-4000-8000-000000000002",
            "resourceVersion": "6", "generation": 1,
            "creationTimestamp": "2026-11-30T00:00:00Z"
        },
        "spec": {
            "mode": "External",
            "endpoint": {"host": "127.0.0.1", "port": 3128},
            "healthCheck": {"interval": "30"}
        }
    })
}

/// Answers like an API server holding these Proxies (status writes only for `ext`) and
/// nothing else. Watches are held open without events, as a quiet cluster's are. The first
/// status write fails (500), as one does when etcd changes leader: the reconcile fails, is
/// counted, and is retried.
async fn api_server(mut handle: ApiHandle, proxies: Vec<Value>, requests: Requests) {
    let proxy = proxies[0].clone();
    let mut open_watches = Vec::new();
    let mut status_writes = 0;
    let mut lease = MockLease::default();
    while let Some(call) = Call::next_or_end(&mut handle).await {
        requests.lock().unwrap().push((
            call.method.as_str().to_owned(),
            call.target.clone(),
            call.body.clone(),
        ));
        if call.is_watch() {
            open_watches.push(call.hold());
            continue;
        }
        let method = call.method.as_str().to_owned();
        let (code, body) = match (method.as_str(), call.path.as_str()) {
            ("GET", "/apis/crawl.example.com/v1alpha1/proxies") => (
                200,
                json!({"apiVersion": "crawl.example.com/v1alpha1", "kind": "ProxyList",
                        "metadata": {"resourceVersion": "7"}, "items": proxies}),
            ),
            // Every replica's watch of ProxyPools (none here).
            ("GET", "/apis/crawl.example.com/v1alpha1/proxypools") => (
                200,
                json!({"apiVersion": "crawl.example.com/v1alpha1", "kind": "ProxyPoolList",
                        "metadata": {"resourceVersion": "7"}, "items": []}),
            ),
            ("GET", "/api/v1/secrets") => (
                200,
                json!({"apiVersion": "v1", "kind": "SecretList", "metadata": {"resourceVersion": "7"}, "items": []}),
            ),
            // The reconciler's watch of this install's machine Pods (none: External only).
            ("GET", "/api/v1/pods") => (
                200,
                json!({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "7"}, "items": []}),
            ),
            ("PATCH", "/apis/crawl.example.com/v1alpha1/namespaces/crawl/proxies/ext/status") => {
                status_writes += 1;
                if status_writes == 1 {
                    (
                        500,
                        status(500, "InternalError", "etcdserver: leader changed"),
                    )
                } else {
                    let mut updated = proxy.clone();
                    updated["status"] = call.body["status"].clone();
                    (200, updated)
                }
            }
            // The leader Lease: the reconciler runs once this process holds it.
            (_, p) if p.contains("/leases") => lease.answer(&method, &call.body),
            ("POST" | "PATCH" | "PUT", p) if p.contains("/events") => {
                let mut created = call.body.clone();
                created["metadata"]["resourceVersion"] = json!("1");
                (if method == "POST" { 201 } else { 200 }, created)
            }
            _ => panic!("unexpected request {method} {}", call.target),
        };
        call.respond(code, body);
    }
}

fn status_writes(requests: &Requests) -> Vec<Value> {
    requests
        .lock()
        .unwrap()
        .iter()
        .filter(|(m, t, _)| m == "PATCH" && t.contains("/proxies/ext/status"))
        .map(|(_, _, b)| b["status"].clone())
        .collect()
}

/// The API token, from a `--discovery-token-file`.
const API_TOKEN: &str = "operator-run-token-0123456789";

/// The operator running in-process against the mock API server.
struct Running {
    requests: Requests,
    api: String,
    metrics: String,
    http: reqwest::Client,
    stop: tokio::sync::oneshot::Sender<()>,
    operator: tokio::task::JoinHandle<Result<Exit, proxy_operator::process::StartError>>,
    server: tokio::task::JoinHandle<()>,
    _squid: Squid,
    _target: Target,
    _dir: tempfile::TempDir,
}

/// Starts the operator against an API server holding `ext` (an External proxy backed by a real
/// squid) and then `others`, and waits for `/readyz`.
async fn start(others: Vec<Value>) -> Running {
    let dir = tempfile::tempdir().unwrap();
    let target = Target::start();
    let squid = Squid::start();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, target.ca_cert_pem()).unwrap();
    let providers = dir.path().join("providers.yaml");
    std::fs::write(&providers, "providers: []\n").unwrap();
    let api_port = free_port();
    let metrics_port = free_port();
    let ledger = dir.path().join("ledger.db");
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, format!("{API_TOKEN}\n")).unwrap();
    let cli = Cli::try_parse_from([
        "proxy-operator",
        "run",
        "--discovery-token-file",
        tokens.to_str().unwrap(),
        "--providers-config",
        providers.to_str().unwrap(),
        "--ledger",
        ledger.to_str().unwrap(),
        "--probe-ca-file",
        ca.to_str().unwrap(),
        "--discovery-addr",
        &format!("127.0.0.1:{api_port}"),
        "--metrics-addr",
        &format!("127.0.0.1:{metrics_port}"),
        "--gateway-addr",
        &format!("127.0.0.1:{}", free_port()),
        "--leader-namespace",
        "proxy-operator",
    ])
    .unwrap();
    let Command::Run(args) = cli.command else {
        panic!("not run")
    };

    let (client, handle) = mock_client();
    let requests: Requests = Arc::default();
    let mut proxies = vec![proxy(squid.port(), &target.https_url())];
    proxies.extend(others);
    let server = tokio::spawn(api_server(handle, proxies, requests.clone()));
    let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let operator = tokio::spawn(operator::run_with_client(args, client, async move {
        let _ = stop_rx.await;
    }));
    let running = Running {
        requests,
        api: format!("http://127.0.0.1:{api_port}"),
        metrics: format!("http://127.0.0.1:{metrics_port}/metrics"),
        http: crate::support::http::client(),
        stop,
        operator,
        server,
        _squid: squid,
        _target: target,
        _dir: dir,
    };

    // Ready once the Proxy watch has listed.
    let start = Instant::now();
    loop {
        let ready = running
            .http
            .get(format!("{}/readyz", running.api))
            .send()
            .await;
        if ready.is_ok_and(|r| r.status() == reqwest::StatusCode::OK) {
            break;
        }
        assert!(start.elapsed() < DEADLINE, "/readyz never became ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    running
}

impl Running {
    /// Waits for the status write that makes `ext` Ready, and returns it.
    async fn ready_status(&self) -> Value {
        let start = Instant::now();
        loop {
            if let Some(status) = status_writes(&self.requests)
                .into_iter()
                .find(|s| s["phase"] == "Ready")
            {
                return status;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "no Ready status write; requests: {:#?}",
                self.requests.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn get_json(&self, path: &str) -> Value {
        self.http
            .get(format!("{}{path}", self.api))
            .bearer_auth(API_TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    async fn metrics(&self) -> String {
        self.http
            .get(&self.metrics)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    async fn stop(self) {
        self.stop.send(()).unwrap();
        let exit = tokio::time::timeout(DEADLINE, self.operator)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(exit, Exit::Clean);
        self.server.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_reconciles_an_external_proxy_to_ready() {
    let running = start(Vec::new()).await;

    // The probe through the real squid makes it healthy; the reconciler writes Ready.
    let ready = running.ready_status().await;
    assert_eq!(ready["ip"], "127.0.0.1");
    assert_eq!(ready["observedGeneration"], 1);
    let condition = |t: &str| {
        ready["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == t)
            .cloned()
            .unwrap()
    };
    assert_eq!(condition("Provisioned")["status"], "True");
    assert_eq!(condition("Provisioned")["reason"], "ExternalEndpoint");
    assert_eq!(condition("Healthy")["status"], "True");
    assert!(ready.get("providerID").is_none_or(Value::is_null));

    // The API serves it as a healthy candidate.
    let list = running.get_json("/v1/proxies?healthy=true").await;
    assert_eq!(list["count"], 1);
    assert_eq!(list["proxies"][0]["name"], "ext");

    // An External proxy never gets a finalizer, and no Pod is touched: Pods are only listed and
    // watched (the reconciler's watch of this install's machines).
    for (method, target, _) in running.requests.lock().unwrap().iter() {
        assert!(
            !(method == "PATCH"
                && target
                    .starts_with("/apis/crawl.example.com/v1alpha1/namespaces/crawl/proxies/ext?")),
            "metadata patch on an External proxy: {target}"
        );
        assert!(
            !target.contains("/pods") || (method == "GET" && target.starts_with("/api/v1/pods?")),
            "{method} {target}"
        );
    }

    // One Proxy watch serves the reconciler and the inventory: one list, one watch.
    let proxy_requests = |watch: bool| {
        running
            .requests
            .lock()
            .unwrap()
            .iter()
            .filter(|(m, t, _)| {
                m == "GET"
                    && t.starts_with("/apis/crawl.example.com/v1alpha1/proxies?")
                    && t.contains("watch=true") == watch
            })
            .count()
    };
    assert_eq!(proxy_requests(false), 1, "Proxy lists");
    assert_eq!(proxy_requests(true), 1, "Proxy watches");
    let metrics = running.metrics().await;
    assert!(
        metrics.contains("\nproxy_operator_proxies_undecodable 0\n"),
        "{metrics}"
    );
    // The reconciler's own figures: the failed status write is one kube error, every reconcile
    // of `ext` decided `external`, and each was timed.
    let value = |series: &str| {
        metrics
            .lines()
            .find_map(|l| {
                l.strip_prefix(series)?
                    .strip_prefix(' ')?
                    .parse::<f64>()
                    .ok()
            })
            .unwrap_or_else(|| panic!("no {series} in {metrics}"))
    };
    assert_eq!(
        value(r#"proxy_operator_reconcile_errors_total{kind="kube"}"#),
        1.0
    );
    assert_eq!(
        value(r#"proxy_operator_reconcile_errors_total{kind="provider"}"#),
        0.0
    );
    let externals = value(r#"proxy_operator_reconcile_actions_total{action="external"}"#);
    assert!(
        externals >= 2.0,
        "the failed reconcile and its retry: {externals}"
    );
    assert_eq!(
        value(r#"proxy_operator_reconcile_actions_total{action="create"}"#),
        0.0
    );
    assert!(value("proxy_operator_reconcile_duration_seconds_count") >= externals);
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_proxy_is_skipped_and_reported_while_the_others_run() {
    // `/readyz` turning ready inside `start` is the first half of the point: a typed watch
    // failed its whole list on this one object and never got there.
    let running = start(vec![undecodable_proxy()]).await;
    running.ready_status().await;

    // Only the good Proxy is served.
    let list = running.get_json("/v1/proxies").await;
    assert_eq!(list["count"], 1, "{list}");
    assert_eq!(list["proxies"][0]["name"], "ext");

    // Counted on the metrics endpoint.
    let metrics = running.metrics().await;
    assert!(
        metrics.contains("\nproxy_operator_proxies_undecodable 1\n"),
        "{metrics}"
    );

    // One Warning Event on the object, naming the field and the reason.
    let start = Instant::now();
    let events = loop {
        let events: Vec<Value> = running
            .requests
            .lock()
            .unwrap()
            .iter()
            .filter(|(m, t, b)| {
                m == "POST"
                    && t.starts_with("/apis/events.k8s.io/v1/namespaces/crawl/events")
                    && b["reason"] == "InvalidSpec"
            })
            .map(|(_, _, b)| b.clone())
            .collect();
        if !events.is_empty() {
            break events;
        }
        assert!(start.elapsed() < DEADLINE, "no InvalidSpec Event");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(events.len(), 1, "{events:#?}");
    let event = &events[0];
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["action"], "Decode");
    assert_eq!(event["regarding"]["kind"], "Proxy");
    assert_eq!(event["regarding"]["name"], "typo");
    assert_eq!(event["regarding"]["resourceVersion"], "6");
    let note = event["note"].as_str().unwrap();
    assert!(
        note.contains("spec.healthCheck.interval: \"30\" is not a duration"),
        "{note}"
    );

    // Nothing is written to it: no status, no metadata.
    for (method, target, _) in running.requests.lock().unwrap().iter() {
        assert!(
            !(method == "PATCH" && target.contains("/proxies/typo")),
            "{method} {target}"
        );
    }
    running.stop().await;
}
