//! The gcp provider through the real Compute SDK, against a loopback HTTP server that answers
//! like the Compute REST API (the cloud itself cannot run here). Each test scripts the
//! server's answers and asserts the requests the SDK sent: method, path, query and body.
#![cfg(feature = "gcp")]

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use actix_web::{App, HttpRequest, HttpResponse, HttpServer, web};
use google_cloud_compute_v1::client::Instances;
use google_cloud_gax::retry_policy::NeverRetry;
use proxy_operator::provider::config::GcpConfig;
use proxy_operator::provider::gcp::GcpProvider;
use proxy_operator::provider::{
    CreateRequest, ErrorClass, InstanceState, Provider, machine_labels,
};
use serde_json::{Value, json};

const UID: &str = "6a1f4c9e-2b7d-4e8a-b1c3-d5e6f7a8b9c0";
const ZONE: &str = "europe-west1-b";
const INSTANCES: &str = "/compute/v1/projects/my-project/zones/europe-west1-b/instances";

/// A request the server received.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    query: HashMap<String, String>,
    body: Value,
}

#[derive(Default)]
struct Script {
    replies: Mutex<VecDeque<(u16, Value)>>,
    seen: Mutex<Vec<Seen>>,
}

async fn answer(
    request: HttpRequest,
    query: web::Query<HashMap<String, String>>,
    body: web::Bytes,
    script: web::Data<Script>,
) -> HttpResponse {
    script.seen.lock().unwrap().push(Seen {
        method: request.method().to_string(),
        path: request.path().to_owned(),
        query: query.into_inner(),
        body: serde_json::from_slice(&body).unwrap_or(Value::Null),
    });
    let reply = script.replies.lock().unwrap().pop_front();
    match reply {
        Some((code, body)) => {
            HttpResponse::build(actix_web::http::StatusCode::from_u16(code).unwrap()).json(body)
        }
        None => HttpResponse::InternalServerError().json(error(500, "backendError", "unscripted")),
    }
}

/// A loopback "Compute API" and a provider whose SDK client points at it.
struct Fake {
    script: web::Data<Script>,
    server: actix_web::dev::ServerHandle,
    provider: GcpProvider,
}

impl Fake {
    async fn start(replies: Vec<(u16, Value)>) -> Fake {
        Self::start_with_default_zone(replies, Some(ZONE)).await
    }

    async fn start_with_default_zone(replies: Vec<(u16, Value)>, zone: Option<&str>) -> Fake {
        let script = web::Data::new(Script {
            replies: Mutex::new(replies.into()),
            seen: Mutex::default(),
        });
        let data = script.clone();
        let server = HttpServer::new(move || {
            App::new()
                .app_data(data.clone())
                .default_service(web::to(answer))
        })
        .workers(1)
        .bind(("127.0.0.1", 0))
        .unwrap();
        let addr = server.addrs()[0];
        let server = server.run();
        let handle = server.handle();
        tokio::spawn(server);
        let provider = provider_at(&format!("http://{addr}"), zone).await;
        Fake {
            script,
            server: handle,
            provider,
        }
    }

    fn seen(&self) -> Vec<Seen> {
        self.script.seen.lock().unwrap().clone()
    }

    async fn stop(self) -> Vec<Seen> {
        let seen = self.seen();
        self.server.stop(false).await;
        seen
    }
}

/// A provider whose client talks to `endpoint` with anonymous credentials (never Application
/// Default Credentials, whose lookup may reach the cloud metadata address) and no retries.
async fn provider_at(endpoint: &str, default_zone: Option<&str>) -> GcpProvider {
    let client = Instances::builder()
        .with_endpoint(endpoint)
        .with_credentials(google_cloud_auth::credentials::anonymous::Builder::new().build())
        .with_retry_policy(NeverRetry)
        .build()
        .await
        .unwrap();
    let config = GcpConfig {
        project: "my-project".to_owned(),
        default_zone: default_zone.map(str::to_owned),
        default_machine_type: None,
        default_image: None,
        service_account: None,
    };
    GcpProvider::new("gcp-eu", &config, "prod", client)
}

fn machine() -> String {
    proxy_operator::resources::naming::machine_name(UID)
}

fn request() -> CreateRequest {
    CreateRequest {
        namespace: "crawl".to_owned(),
        proxy_name: "eu-1".to_owned(),
        proxy_uid: UID.to_owned(),
        machine_name: machine(),
        port: 3128,
        placement: None,
        cloud_init: Some("#cloud-config\n".to_owned()),
        labels: machine_labels(UID, "prod"),
        credentials: None,
    }
}

/// A Compute error body, in the shape the REST API sends.
fn error(code: u16, reason: &str, message: &str) -> Value {
    json!({"error": {
        "code": code,
        "message": message,
        "errors": [{"message": message, "domain": "global", "reason": reason}],
    }})
}

fn operation(status: &str) -> Value {
    json!({
        "kind": "compute#operation",
        "name": "operation-1700000000000-abc",
        "operationType": "insert",
        "status": status,
        "zone": format!("https://www.googleapis.com/compute/v1/projects/my-project/zones/{ZONE}"),
    })
}

fn vm(zone: &str, name: &str, status: &str, nat_ip: Option<&str>, install: &str) -> Value {
    let mut access = json!({"type": "ONE_TO_ONE_NAT", "name": "External NAT"});
    if let Some(ip) = nat_ip {
        access["natIP"] = json!(ip);
    }
    json!({
        "kind": "compute#instance",
        "name": name,
        "zone": format!("https://www.googleapis.com/compute/v1/projects/my-project/zones/{zone}"),
        "status": status,
        "creationTimestamp": "2026-03-04T05:06:07.123-08:00",
        "labels": {
            "crawl-example-com_managed": "true",
            "crawl-example-com_proxy-uid": UID,
            "crawl-example-com_install": install,
        },
        "networkInterfaces": [{"networkIP": "10.132.0.5", "accessConfigs": [access]}],
    })
}

#[tokio::test]
async fn create_inserts_the_vm_and_does_not_wait_for_the_operation() {
    let fake = Fake::start(vec![(200, operation("RUNNING"))]).await;
    let instance = fake.provider.create(&request()).await.unwrap();
    assert_eq!(
        instance.provider_id,
        format!("zones/{ZONE}/instances/{}", machine())
    );
    assert_eq!(instance.name, machine());
    assert_eq!(instance.state, InstanceState::Provisioning);
    assert_eq!(instance.ip, None);
    assert_eq!(instance.uid.as_deref(), Some(UID));

    let seen = fake.stop().await;
    assert_eq!(
        seen.len(),
        1,
        "create must not poll the operation: {seen:?}"
    );
    let call = &seen[0];
    assert_eq!(call.method, "POST");
    assert_eq!(call.path, INSTANCES);
    let body = &call.body;
    assert_eq!(body["name"], machine());
    assert_eq!(
        body["machineType"],
        format!("zones/{ZONE}/machineTypes/e2-small")
    );
    assert_eq!(body["disks"][0]["boot"], true);
    assert_eq!(body["disks"][0]["autoDelete"], true);
    assert_eq!(
        body["disks"][0]["initializeParams"]["sourceImage"],
        "projects/ubuntu-os-cloud/global/images/family/ubuntu-2404-lts-amd64"
    );
    assert_eq!(body["disks"][0]["initializeParams"]["diskSizeGb"], "10");
    assert_eq!(
        body["networkInterfaces"][0]["accessConfigs"][0],
        json!({"name": "External NAT", "type": "ONE_TO_ONE_NAT"})
    );
    assert_eq!(
        body["metadata"]["items"],
        json!([{"key": "user-data", "value": "#cloud-config\n"}])
    );
    assert_eq!(body["labels"]["crawl-example-com_managed"], "true");
    assert_eq!(body["labels"]["crawl-example-com_proxy-uid"], UID);
    assert_eq!(body["labels"]["crawl-example-com_install"], "prod");
    assert_eq!(body["tags"]["items"], json!(["proxy-operator"]));
}

#[tokio::test]
async fn create_that_already_exists_succeeds_with_the_deterministic_id() {
    let fake = Fake::start(vec![(
        409,
        error(409, "alreadyExists", "The resource already exists"),
    )])
    .await;
    let instance = fake.provider.create(&request()).await.unwrap();
    assert_eq!(
        instance.provider_id,
        format!("zones/{ZONE}/instances/{}", machine())
    );
    assert_eq!(instance.state, InstanceState::Provisioning);
    assert_eq!(fake.stop().await.len(), 1);
}

#[tokio::test]
async fn create_over_quota_is_quota_exceeded() {
    let fake = Fake::start(vec![(
        403,
        error(
            403,
            "quotaExceeded",
            "Quota 'CPUS' exceeded. Limit: 8.0 in region europe-west1.",
        ),
    )])
    .await;
    let err = fake.provider.create(&request()).await.unwrap_err();
    assert_eq!(err.class, ErrorClass::QuotaExceeded);
    assert_eq!(err.op, "create");
    assert_eq!(err.provider, "gcp-eu");
    assert!(err.to_string().contains("Quota 'CPUS' exceeded"), "{err}");
    fake.stop().await;
}

#[tokio::test]
async fn create_answered_with_a_failed_operation_is_an_error() {
    let mut failed = operation("DONE");
    failed["error"] = json!({"errors": [{"code": "QUOTA_EXCEEDED", "message": "Quota 'IN_USE_ADDRESSES' exceeded."}]});
    let fake = Fake::start(vec![(200, failed)]).await;
    let err = fake.provider.create(&request()).await.unwrap_err();
    assert_eq!(err.class, ErrorClass::QuotaExceeded);
    assert!(err.to_string().contains("IN_USE_ADDRESSES"), "{err}");
    fake.stop().await;
}

#[tokio::test]
async fn create_without_a_zone_is_permanent_and_calls_nothing() {
    let fake = Fake::start_with_default_zone(vec![], None).await;
    let err = fake.provider.create(&request()).await.unwrap_err();
    assert_eq!(err.class, ErrorClass::Permanent);
    assert!(err.to_string().contains("no zone"), "{err}");
    assert!(fake.stop().await.is_empty());
}

#[tokio::test]
async fn get_reads_the_vm_by_zone_and_name() {
    let fake = Fake::start(vec![
        (
            200,
            vm(ZONE, &machine(), "RUNNING", Some("34.77.1.2"), "prod"),
        ),
        (200, vm(ZONE, &machine(), "RUNNING", None, "prod")),
        (200, vm(ZONE, &machine(), "TERMINATED", None, "prod")),
    ])
    .await;
    let id = format!("zones/{ZONE}/instances/{}", machine());
    let running = fake.provider.get(&id).await.unwrap();
    assert_eq!(running.provider_id, id);
    assert_eq!(running.state, InstanceState::Running);
    assert_eq!(running.ip.as_deref(), Some("34.77.1.2"));
    assert_eq!(running.uid.as_deref(), Some(UID));
    assert_eq!(
        running.created_at,
        Some("2026-03-04T13:06:07.123Z".parse().unwrap())
    );
    let no_ip = fake.provider.get(&id).await.unwrap();
    assert_eq!(no_ip.state, InstanceState::Provisioning);
    assert_eq!(no_ip.ip, None);
    let stopped = fake.provider.get(&id).await.unwrap();
    assert_eq!(stopped.state, InstanceState::Terminated);

    let seen = fake.stop().await;
    assert_eq!(seen.len(), 3);
    for call in seen {
        assert_eq!(call.method, "GET");
        assert_eq!(call.path, format!("{INSTANCES}/{}", machine()));
    }
}

#[tokio::test]
async fn errors_from_the_api_are_classified() {
    let cases = [
        (404, "notFound", ErrorClass::NotFound),
        (429, "rateLimitExceeded", ErrorClass::QuotaExceeded),
        (403, "rateLimitExceeded", ErrorClass::QuotaExceeded),
        (403, "forbidden", ErrorClass::Permanent),
        (400, "invalid", ErrorClass::Permanent),
        (401, "authError", ErrorClass::Permanent),
        (500, "backendError", ErrorClass::Transient),
        (503, "serviceUnavailable", ErrorClass::Transient),
    ];
    let replies = cases
        .iter()
        .map(|(code, reason, _)| (*code, error(*code, reason, "canned")))
        .collect();
    let fake = Fake::start(replies).await;
    let id = format!("zones/{ZONE}/instances/{}", machine());
    for (code, reason, want) in cases {
        let err = fake.provider.get(&id).await.unwrap_err();
        assert_eq!(err.class, want, "{code} {reason}: {err}");
        assert_eq!(err.op, "get");
        assert_eq!(err.id, id);
    }
    // NeverRetry: exactly one request per call, even for 5xx.
    assert_eq!(fake.stop().await.len(), cases.len());
}

#[tokio::test]
async fn an_unreachable_endpoint_is_transient() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let provider = provider_at(&format!("http://127.0.0.1:{port}"), Some(ZONE)).await;
    let err = provider
        .get("zones/europe-west1-b/instances/proxy-x")
        .await
        .unwrap_err();
    assert_eq!(err.class, ErrorClass::Transient, "{err}");
}

#[tokio::test]
async fn delete_deletes_and_tolerates_a_missing_vm() {
    let fake = Fake::start(vec![
        (200, operation("RUNNING")),
        (404, error(404, "notFound", "The resource was not found")),
        (500, error(500, "backendError", "boom")),
    ])
    .await;
    let id = format!("zones/{ZONE}/instances/{}", machine());
    fake.provider.delete(&id).await.unwrap();
    fake.provider.delete(&id).await.unwrap();
    let err = fake.provider.delete(&id).await.unwrap_err();
    assert_eq!(err.class, ErrorClass::Transient);
    assert_eq!(err.op, "delete");
    let seen = fake.stop().await;
    assert_eq!(seen.len(), 3, "delete must not poll the operation");
    for call in seen {
        assert_eq!(call.method, "DELETE");
        assert_eq!(call.path, format!("{INSTANCES}/{}", machine()));
    }
}

#[tokio::test]
async fn malformed_provider_ids_are_permanent_and_call_nothing() {
    let fake = Fake::start(vec![]).await;
    for id in ["crawl/proxy-x", "zones/z/instances/", "instances/proxy-x"] {
        let err = fake.provider.get(id).await.unwrap_err();
        assert_eq!(err.class, ErrorClass::Permanent, "{id}");
        let err = fake.provider.delete(id).await.unwrap_err();
        assert_eq!(err.class, ErrorClass::Permanent, "{id}");
    }
    assert!(fake.stop().await.is_empty());
}

#[tokio::test]
async fn list_managed_reads_every_zone_and_page_and_skips_unreachable_scopes() {
    let page_1 = json!({
        "kind": "compute#instanceAggregatedList",
        "nextPageToken": "page-2",
        "unreachables": ["zones/me-central2-a"],
        "items": {
            "zones/europe-west1-b": {"instances": [
                vm("europe-west1-b", "proxy-aaaaaaaaaaaaaaaa", "RUNNING", Some("34.77.1.2"), "prod"),
                vm("europe-west1-b", "proxy-otherinstall0000", "RUNNING", Some("34.77.1.3"), "staging"),
            ]},
            "zones/us-east1-c": {"warning": {"code": "UNREACHABLE", "message": "zone unreachable"}},
            "zones/asia-east1-a": {"warning": {"code": "NO_RESULTS_ON_PAGE", "message": "none"}},
        },
    });
    let page_2 = json!({
        "kind": "compute#instanceAggregatedList",
        "items": {
            "zones/us-central1-a": {"instances": [
                vm("us-central1-a", "proxy-bbbbbbbbbbbbbbbb", "STAGING", None, "prod"),
            ]},
        },
    });
    let fake = Fake::start(vec![(200, page_1), (200, page_2)]).await;
    let mut instances = fake.provider.list_managed().await.unwrap();
    instances.sort_by(|a, b| a.provider_id.cmp(&b.provider_id));
    let summary: Vec<(&str, InstanceState)> = instances
        .iter()
        .map(|i| (i.provider_id.as_str(), i.state))
        .collect();
    assert_eq!(
        summary,
        [
            (
                "zones/europe-west1-b/instances/proxy-aaaaaaaaaaaaaaaa",
                InstanceState::Running
            ),
            (
                "zones/us-central1-a/instances/proxy-bbbbbbbbbbbbbbbb",
                InstanceState::Provisioning
            ),
        ]
    );
    assert!(instances.iter().all(|i| i.uid.as_deref() == Some(UID)));

    let seen = fake.stop().await;
    assert_eq!(seen.len(), 2);
    let filter = "(labels.crawl-example-com_managed = \"true\") AND (labels.crawl-example-com_install = \"prod\")";
    for call in &seen {
        assert_eq!(call.method, "GET");
        assert_eq!(
            call.path,
            "/compute/v1/projects/my-project/aggregated/instances"
        );
        assert_eq!(call.query["filter"], filter);
    }
    assert_eq!(seen[1].query["pageToken"], "page-2");
}

#[tokio::test]
async fn list_managed_failure_is_classified() {
    let fake = Fake::start(vec![(503, error(503, "backendError", "try later"))]).await;
    let err = fake.provider.list_managed().await.unwrap_err();
    assert_eq!(err.class, ErrorClass::Transient);
    assert_eq!(err.op, "list");
    fake.stop().await;
}
