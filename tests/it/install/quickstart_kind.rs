//! The kind install of docs/install.md, driven through `kubectl` against a real cluster. These tests
//! need a cluster, so they are `#[ignore]`d; everything they check without a cluster is also
//! covered by the mock-API and manifest tests.
//!
//! Run them against kind (docker, kind and kubectl on the PATH):
//!
//! ```sh
//! kind create cluster --name proxy-operator
//! docker build -t proxy-operator:dev .
//! kind load docker-image proxy-operator:dev --name proxy-operator
//! cargo test --test it quickstart_kind -- --ignored --test-threads=1
//! kind delete cluster --name proxy-operator
//! ```
//!
//! They install `manifests/` themselves (`kubectl apply -k`), use the current kubectl context,
//! and refuse to run unless its name starts with `kind-` (they restart the operator and create
//! and delete Proxies); set `QUICKSTART_ANY_CONTEXT=1` to run them on another disposable
//! cluster. The cluster needs egress to the probe URL of `samples/proxy_kubernetes.yaml`.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};

use proxy_operator::resources::naming::machine_name;

const NAMESPACE: &str = "proxy-operator";
const SAMPLE: &str = "samples/proxy_kubernetes.yaml";
const SAMPLE_NAMESPACE: &str = "default";
const SAMPLE_NAME: &str = "squid-eu-1";
/// Pulling `ubuntu/squid` on a fresh kind node and the first probes take a while.
const READY_DEADLINE: Duration = Duration::from_secs(300);
const DEADLINE: Duration = Duration::from_secs(120);

/// The tests share one cluster and one operator: run them one at a time.
static CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn kubectl(args: &[&str]) -> Result<String, String> {
    let output = Command::new("kubectl")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .map_err(|e| format!("cannot run kubectl: {e}"))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
    } else {
        Err(format!(
            "kubectl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

fn must(args: &[&str]) -> String {
    kubectl(args).unwrap_or_else(|e| panic!("{e}"))
}

/// Polls `check` until it returns `Some`, failing with `what` after `deadline`.
fn wait_for<T>(what: &str, deadline: Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(start.elapsed() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_secs(2));
    }
}

/// Checks the context, installs the operator and waits for its rollout.
fn install() {
    let context = must(&["config", "current-context"]);
    assert!(
        context.starts_with("kind-") || std::env::var_os("QUICKSTART_ANY_CONTEXT").is_some(),
        "refusing to run against context {context}: not a kind cluster (QUICKSTART_ANY_CONTEXT=1 overrides)"
    );
    // Step 2 of the kind install: the kustomization generates the token Secret from this file.
    let tokens =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("manifests/discovery-tokens");
    if !tokens.exists() {
        let token = format!(
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        );
        std::fs::write(&tokens, format!("{token}\n")).unwrap();
    }
    must(&["apply", "-k", "manifests/"]);
    must(&[
        "-n",
        NAMESPACE,
        "rollout",
        "status",
        "deployment/proxy-operator",
        "--timeout=180s",
    ]);
}

fn token() -> String {
    must(&[
        "-n",
        NAMESPACE,
        "get",
        "secret",
        "proxy-operator-api",
        "-o",
        "go-template={{.data.tokens | base64decode}}",
    ])
    .lines()
    .map(str::trim)
    .find(|l| !l.is_empty())
    .unwrap_or_default()
    .to_owned()
}

/// Applies the sample and waits until it is Ready with an IP; returns its UID and IP.
fn sample_ready() -> (String, String) {
    must(&["apply", "-f", SAMPLE]);
    wait_for(
        "the sample Proxy to be Ready with an IP",
        READY_DEADLINE,
        || {
            let out = kubectl(&[
                "-n",
                SAMPLE_NAMESPACE,
                "get",
                "proxy",
                SAMPLE_NAME,
                "-o",
                "jsonpath={.metadata.uid} {.status.phase} {.status.ip}",
            ])
            .ok()?;
            match out.split(' ').collect::<Vec<_>>().as_slice() {
                [uid, "Ready", ip] if !ip.is_empty() => Some(((*uid).to_owned(), (*ip).to_owned())),
                _ => None,
            }
        },
    )
}

/// Deletes the sample and waits until both the Proxy and its Pod are gone.
fn delete_sample(pod: &str) {
    must(&["delete", "-f", SAMPLE, "--wait=false"]);
    wait_for("the sample's Pod to be deleted", DEADLINE, || {
        kubectl(&[
            "-n",
            SAMPLE_NAMESPACE,
            "get",
            "pod",
            pod,
            "--ignore-not-found",
            "-o",
            "name",
        ])
        .ok()
        .filter(String::is_empty)
    });
    wait_for("the sample Proxy to be deleted", DEADLINE, || {
        kubectl(&[
            "-n",
            SAMPLE_NAMESPACE,
            "get",
            "proxy",
            SAMPLE_NAME,
            "--ignore-not-found",
            "-o",
            "name",
        ])
        .ok()
        .filter(String::is_empty)
    });
}

/// `kubectl port-forward svc/proxy-operator :8090`, stopped on drop.
struct PortForward {
    child: Child,
    base: String,
}

impl PortForward {
    fn start() -> PortForward {
        let mut child = Command::new("kubectl")
            .args([
                "-n",
                NAMESPACE,
                "port-forward",
                "svc/proxy-operator",
                ":8090",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("cannot run kubectl port-forward");
        let stdout = child.stdout.take().expect("piped stdout");
        // "Forwarding from 127.0.0.1:PORT -> 8090"
        let mut lines = BufReader::new(stdout).lines();
        let line = lines
            .next()
            .expect("port-forward printed nothing")
            .expect("port-forward output");
        // It prints a line per connection; keep reading so it never writes to a closed pipe.
        std::thread::spawn(move || lines.for_each(drop));
        let port = line
            .split("127.0.0.1:")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("unexpected port-forward output: {line}"))
            .to_owned();
        PortForward {
            child,
            base: format!("http://127.0.0.1:{port}"),
        }
    }
}

impl Drop for PortForward {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Api {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl Api {
    fn new(forward: &PortForward) -> Api {
        Api {
            http: crate::support::http::client(),
            base: forward.base.clone(),
            token: token(),
        }
    }

    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .timeout(Duration::from_secs(10));
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request
            .send()
            .await
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        let status = response.status();
        let bytes = response.bytes().await.unwrap();
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{path}: {e}"))
        };
        (status, body)
    }

    /// Polls until the healthy list names the sample (the health engine probes it first).
    async fn wait_listed_healthy(&self) -> Value {
        let start = Instant::now();
        loop {
            let (status, body) = self
                .call(
                    reqwest::Method::GET,
                    "/v1/proxies?healthy=true&selector=geo=eu",
                    None,
                )
                .await;
            assert_eq!(status, StatusCode::OK, "{body}");
            if let Some(proxy) = body["proxies"]
                .as_array()
                .and_then(|list| list.iter().find(|p| p["name"] == SAMPLE_NAME))
            {
                return proxy.clone();
            }
            assert!(
                start.elapsed() < DEADLINE,
                "sample never listed healthy: {body}"
            );
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
    }
}

#[tokio::test]
#[ignore = "needs a kind cluster; see the top of this file"]
async fn quickstart_managed_proxy_from_apply_to_delete() {
    let _cluster = CLUSTER.lock().await;
    install();
    let (uid, ip) = sample_ready();
    let pod = machine_name(&uid);
    let pod_ip = must(&[
        "-n",
        SAMPLE_NAMESPACE,
        "get",
        "pod",
        &pod,
        "-o",
        "jsonpath={.status.podIP}",
    ]);
    assert_eq!(ip, pod_ip, "status.ip is the squid Pod's IP");

    let forward = PortForward::start();
    let api = Api::new(&forward);
    let listed = api.wait_listed_healthy().await;
    assert_eq!(listed["host"], ip.as_str());
    assert_eq!(listed["port"], 3128);

    let (status, lease) = api
        .call(
            reqwest::Method::POST,
            "/v1/leases",
            Some(json!({"selector": {"geo": "eu"}, "target": "example.com", "ttlSeconds": 300})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{lease}");
    assert_eq!(lease["proxy"]["name"], SAMPLE_NAME);
    assert_eq!(lease["proxy"]["url"], format!("http://{ip}:3128"));
    let id = lease["leaseID"].as_str().expect("leaseID").to_owned();

    let (status, body) = api
        .call(
            reqwest::Method::POST,
            &format!("/v1/leases/{id}/report"),
            Some(json!({"result": "ok", "target": "example.com"})),
        )
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    for _ in 0..2 {
        let (status, body) = api
            .call(reqwest::Method::DELETE, &format!("/v1/leases/{id}"), None)
            .await;
        assert_eq!(
            status,
            StatusCode::NO_CONTENT,
            "release is idempotent: {body}"
        );
    }
    let (status, _) = api.call(reqwest::Method::GET, "/v1/proxies", None).await;
    assert_eq!(status, StatusCode::OK);

    delete_sample(&pod);
}

#[tokio::test]
#[ignore = "needs a kind cluster; see the top of this file"]
async fn quickstart_lease_survives_an_operator_restart() {
    let _cluster = CLUSTER.lock().await;
    install();
    let (uid, _) = sample_ready();

    let id = {
        let forward = PortForward::start();
        let api = Api::new(&forward);
        api.wait_listed_healthy().await;
        let (status, lease) = api
            .call(
                reqwest::Method::POST,
                "/v1/leases",
                Some(json!({"selector": {"geo": "eu"}, "ttlSeconds": 600})),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "{lease}");
        lease["leaseID"].as_str().expect("leaseID").to_owned()
    };

    // Recreate the operator Pod: the ledger is on the PVC, so the lease is still there.
    must(&[
        "-n",
        NAMESPACE,
        "delete",
        "pod",
        "-l",
        "app.kubernetes.io/name=proxy-operator",
        "--wait=true",
    ]);
    must(&[
        "-n",
        NAMESPACE,
        "rollout",
        "status",
        "deployment/proxy-operator",
        "--timeout=180s",
    ]);
    wait_for("the new operator Pod to be Ready", DEADLINE, || {
        kubectl(&[
            "-n",
            NAMESPACE,
            "get",
            "pods",
            "-l",
            "app.kubernetes.io/name=proxy-operator",
            "-o",
            "jsonpath={.items[*].status.conditions[?(@.type==\"Ready\")].status}",
        ])
        .ok()
        .filter(|s| s == "True")
    });

    let forward = PortForward::start();
    let api = Api::new(&forward);
    let (status, lease) = api
        .call(reqwest::Method::GET, &format!("/v1/leases/{id}"), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{lease}");
    assert_eq!(lease["state"], "active");
    let (status, _) = api
        .call(reqwest::Method::DELETE, &format!("/v1/leases/{id}"), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);

    delete_sample(&machine_name(&uid));
}
