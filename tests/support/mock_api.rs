//! A Kubernetes API server played by the test (kube's tower-test mock service): a client whose
//! every request reaches the test as a [`Call`] to check and answer, each checked against the
//! install's RBAC (`rbac::API_CALLS`, which `manifests/` grants). For the exact request sequence
//! of one reconcile or one provider call; behaviour is tested on the real API server.

use std::collections::BTreeMap;
use std::future::Future;

use http::{Method, Request, Response};
use kube::client::Body;
use serde_json::{Value, json};
use tower_test::mock::{Handle, SendResponse};

use super::DEADLINE;

/// The test's end of the mock service.
pub type ApiHandle = Handle<Request<Body>, Response<Body>>;

/// A kube client whose requests go to the returned handle.
pub fn mock_client() -> (kube::Client, ApiHandle) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    (kube::Client::new(service, "default"), handle)
}

/// One request the code under test made, read whole, and the way to answer it.
pub struct Call {
    pub method: Method,
    /// The path without the query.
    pub path: String,
    /// The query parameters.
    pub query: BTreeMap<String, String>,
    /// Path and query, as RBAC judges it.
    pub target: String,
    /// The JSON body (`Null` when empty).
    pub body: Value,
    reply: SendResponse<Response<Body>>,
}

impl Call {
    /// The next request, within [`DEADLINE`]; panics when none comes.
    pub async fn next(handle: &mut ApiHandle) -> Call {
        tokio::time::timeout(DEADLINE, Call::next_or_end(handle))
            .await
            .expect("no request within the deadline")
            .expect("the client went away without a request")
    }

    /// The next request, or `None` once the client is gone (for a server that answers until
    /// the code under test stops).
    pub async fn next_or_end(handle: &mut ApiHandle) -> Option<Call> {
        let (request, reply) = handle.next_request().await?;
        let method = request.method().clone();
        let path = request.uri().path().to_owned();
        let target = request
            .uri()
            .path_and_query()
            .map_or_else(|| path.clone(), |p| p.as_str().to_owned());
        assert!(
            proxy_operator::rbac::permits(method.as_str(), &target),
            "{method} {target} is not granted by rbac::API_CALLS"
        );
        let query = url::form_urlencoded::parse(request.uri().query().unwrap_or("").as_bytes())
            .into_owned()
            .collect();
        let bytes = request
            .into_body()
            .collect_bytes()
            .await
            .expect("read the request body");
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).expect("a JSON request body")
        };
        Some(Call {
            method,
            path,
            query,
            target,
            body,
            reply,
        })
    }

    /// Whether the request opens a watch.
    pub fn is_watch(&self) -> bool {
        self.query.get("watch").is_some_and(|w| w == "true")
    }

    /// Answers with `code` and the JSON `body`.
    pub fn respond(self, code: u16, body: Value) {
        let response = Response::builder()
            .status(code)
            .header("content-type", "application/json")
            .body(Body::from(
                serde_json::to_vec(&body).expect("serialize the answer"),
            ))
            .expect("a response");
        self.reply.send_response(response);
    }

    /// Keeps the request unanswered (an open watch of a quiet cluster): the returned handle
    /// must live as long as the request should stay open.
    pub fn hold(self) -> SendResponse<Response<Body>> {
        self.reply
    }
}

/// A `Status` failure body, as the API server sends with a 4xx or 5xx.
pub fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Status",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

/// Runs `scenario` as the API server while `call` runs; both must end within [`DEADLINE`].
pub async fn with_server<T, S, F, C>(handle: ApiHandle, scenario: S, call: C) -> T
where
    S: FnOnce(ApiHandle) -> F,
    F: Future<Output = ()> + Send + 'static,
    C: Future<Output = T>,
{
    let server = tokio::spawn(scenario(handle));
    let result = tokio::time::timeout(DEADLINE, call)
        .await
        .expect("the call under test timed out");
    tokio::time::timeout(DEADLINE, server)
        .await
        .expect("the API scenario timed out")
        .expect("the API scenario failed");
    result
}

/// One Lease as an API server keeps it: GET is 404 until a POST creates it, PATCH merges the
/// sent `spec`, each write bumps the resourceVersion.
#[derive(Debug, Default)]
pub struct MockLease {
    lease: Option<Value>,
    revision: u64,
}

impl MockLease {
    /// The answer (status code, body) to `method` with `body` on the Lease.
    pub fn answer(&mut self, method: &str, body: &Value) -> (u16, Value) {
        self.revision += 1;
        let revision = self.revision.to_string();
        match (method, &mut self.lease) {
            ("GET", None) => (404, status(404, "NotFound", "leases not found")),
            ("GET", Some(current)) => (200, current.clone()),
            ("POST", _) => {
                let mut created = body.clone();
                created["apiVersion"] = json!("coordination.k8s.io/v1");
                created["kind"] = json!("Lease");
                created["metadata"]["resourceVersion"] = json!(revision);
                self.lease = Some(created.clone());
                (201, created)
            }
            ("PATCH", Some(current)) => {
                if current["spec"].is_null() {
                    current["spec"] = json!({});
                }
                for (key, value) in body["spec"].as_object().into_iter().flatten() {
                    if value.is_null() {
                        if let Some(spec) = current["spec"].as_object_mut() {
                            spec.remove(key);
                        }
                    } else {
                        current["spec"][key] = value.clone();
                    }
                }
                current["metadata"]["resourceVersion"] = json!(revision);
                (200, current.clone())
            }
            (other, _) => panic!("unexpected {other} on the Lease"),
        }
    }
}
