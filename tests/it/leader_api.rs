//! Leader election's Kubernetes API traffic against a mock API server (tower-test): the process
//! creates its Lease, takes it, and every request it sends is granted by `rbac::API_CALLS`,
//! whose Lease entry lists exactly the verbs used.

use std::collections::BTreeSet;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use kube::Client;
use kube::client::Body;
use serde_json::{Value, json};
use tower_test::mock;

use proxy_operator::leader::{LeaderConfig, watch_leadership};
use proxy_operator::rbac::{self, API_CALLS};

const LEASE_PATH: &str = "/apis/coordination.k8s.io/v1/namespaces/proxy-operator/leases";

/// Answers Lease requests like an API server holding at most one Lease: GET is 404 until a
/// POST creates it, PATCH merges the sent `spec`. Returns the RBAC verbs seen.
async fn serve_lease(
    mut handle: mock::Handle<Request<Body>, Response<Body>>,
) -> BTreeSet<&'static str> {
    let mut lease: Option<Value> = None;
    let mut verbs = BTreeSet::new();
    let mut revision = 0;
    while let Some((request, send)) = handle.next_request().await {
        let method = request.method().as_str().to_owned();
        let target = request
            .uri()
            .path_and_query()
            .map_or(String::new(), |p| p.as_str().to_owned());
        assert!(
            rbac::permits(&method, &target),
            "{method} {target} is not granted by rbac::API_CALLS"
        );
        let attributes = rbac::request_attributes(&method, &target).unwrap();
        assert_eq!(attributes.resource, "leases");
        verbs.insert(attributes.verb);
        assert!(request.uri().path().starts_with(LEASE_PATH), "{target}");

        let bytes = request.into_body().collect_bytes().await.unwrap();
        let body: Value = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap()
        };
        revision += 1;
        let reply = match (method.as_str(), &mut lease) {
            ("GET", None) => {
                let status = json!({
                    "apiVersion": "v1", "kind": "Status", "status": "Failure",
                    "reason": "NotFound", "code": 404, "message": "leases not found",
                });
                send.send_response(
                    Response::builder()
                        .status(StatusCode::NOT_FOUND)
                        .body(Body::from(serde_json::to_vec(&status).unwrap()))
                        .unwrap(),
                );
                continue;
            }
            ("GET", Some(current)) => current.clone(),
            ("POST", _) => {
                let mut created = body;
                created["apiVersion"] = json!("coordination.k8s.io/v1");
                created["kind"] = json!("Lease");
                created["metadata"]["namespace"] = json!("proxy-operator");
                created["metadata"]["resourceVersion"] = json!(revision.to_string());
                lease = Some(created.clone());
                created
            }
            ("PATCH", Some(current)) => {
                if current["spec"].is_null() {
                    current["spec"] = json!({});
                }
                for (key, value) in body["spec"].as_object().unwrap() {
                    if value.is_null() {
                        current["spec"].as_object_mut().unwrap().remove(key);
                    } else {
                        current["spec"][key] = value.clone();
                    }
                }
                current["metadata"]["resourceVersion"] = json!(revision.to_string());
                current.clone()
            }
            (other, _) => panic!("unexpected {other} {target}"),
        };
        send.send_response(
            Response::builder()
                .body(Body::from(serde_json::to_vec(&reply).unwrap()))
                .unwrap(),
        );
    }
    verbs
}

#[tokio::test]
async fn takes_the_lease_with_exactly_the_granted_calls() {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(service, "default");
    let server = tokio::spawn(serve_lease(handle));

    let config = LeaderConfig::new("proxy-operator", "proxy-operator-7d9f");
    let mut leader =
        tokio::time::timeout(Duration::from_secs(30), watch_leadership(client, &config))
            .await
            .expect("leader election did not start")
            .expect("leader election failed to start");
    tokio::time::timeout(Duration::from_secs(30), leader.wait_for(|l| *l))
        .await
        .expect("never became leader")
        .unwrap();

    // Stop contending: the manager releases the Lease and the mock's client side goes away.
    drop(leader);
    let verbs = tokio::time::timeout(Duration::from_secs(30), server)
        .await
        .expect("leader election kept calling the API")
        .unwrap();
    let listed: BTreeSet<&str> = API_CALLS
        .iter()
        .find(|call| call.resource == "leases")
        .unwrap()
        .verbs
        .iter()
        .copied()
        .collect();
    assert_eq!(verbs, listed, "verbs used on Leases vs rbac::API_CALLS");
}
