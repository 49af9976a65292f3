//! End to end: the real `proxy-operator standalone` binary, three real squids (one refusing
//! every CONNECT), a loopback HTTPS probe target, a real ledger file — driven only through
//! the API, the metrics endpoint, signals and the `sqlite3` CLI, as an operator would.

use crate::support;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};
use support::standalone::{ExternalProxy, Standalone};
use support::{DEADLINE, Squid, SquidOptions, Target, free_port, sqlite3};

const TOKEN: &str = "e2e-secret-0123456789abcdef";

fn proxy_doc(name: &str, port: u16, max_leases: u32, probe_url: &str) -> String {
    format!(
        "apiVersion: crawl.example.com/v1alpha1
kind: Proxy
metadata:
  name: {name}
  labels: {{pool: e2e}}
spec:
  mode: External
  endpoint: {{host: 127.0.0.1, port: {port}}}
  maxLeases: {max_leases}
  healthCheck:
    probeURL: {probe_url}
    interval: 500ms
    timeout: 500ms
    failureThreshold: 2
---
"
    )
}

/// The running binary, killed on drop.
struct Operator {
    child: Child,
    api: String,
    metrics: String,
}

impl Operator {
    fn start(
        dir: &Path,
        inventory: &Path,
        ca: &Path,
        api_port: u16,
        metrics_port: u16,
    ) -> Operator {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("operator.log"))
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_proxy-operator"))
            .args(["standalone", "--inventory"])
            .arg(inventory)
            .arg("--ledger")
            .arg(dir.join("ledger.db"))
            .arg("--probe-ca-file")
            .arg(ca)
            .args(["--discovery-addr", &format!("127.0.0.1:{api_port}")])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            .args(["--gateway-addr", &format!("127.0.0.1:{}", free_port())])
            .args(["--inventory-poll", "100ms", "--lease-cooldown", "10m"])
            .env("DISCOVERY_TOKEN", TOKEN)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        Operator {
            child,
            api: format!("http://127.0.0.1:{api_port}"),
            metrics: format!("http://127.0.0.1:{metrics_port}/metrics"),
        }
    }

    fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).unwrap()
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Client {
    http: reqwest::Client,
    base: String,
}

impl Client {
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, reqwest::header::HeaderMap, Value) {
        let mut request = self
            .http
            .request(method, format!("{}{}", self.base, path))
            .bearer_auth(TOKEN);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.unwrap();
        let (status, headers) = (response.status(), response.headers().clone());
        let text = response.text().await.unwrap();
        let value = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap()
        };
        (status, headers, value)
    }

    async fn healthy_names(&self) -> Vec<String> {
        let (_, _, v) = self
            .call(
                reqwest::Method::GET,
                "/v1/proxies?healthy=true&selector=pool=e2e",
                None,
            )
            .await;
        v["proxies"]
            .as_array()
            .map(|ps| {
                ps.iter()
                    .map(|p| p["name"].as_str().unwrap_or_default().to_owned())
                    .collect()
            })
            .unwrap_or_default()
    }

    async fn acquire(&self, body: Value) -> (StatusCode, reqwest::header::HeaderMap, Value) {
        self.call(reqwest::Method::POST, "/v1/leases", Some(body))
            .await
    }
}

/// Polls an async condition until it holds.
async fn eventually<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !condition().await {
        assert!(
            start.elapsed() < DEADLINE * 2,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn wait_ready(client: &Client) {
    eventually("the API to be ready", || async {
        match client
            .http
            .get(format!("{}/readyz", client.base))
            .send()
            .await
        {
            Ok(r) => r.status() == StatusCode::OK,
            Err(_) => false,
        }
    })
    .await;
}

fn metric_lines_are_valid(text: &str) {
    let sample = regex::Regex::new(
        r#"^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*",?)*\})? (-?[0-9.eE+-]+|NaN|\+Inf|-Inf)$"#,
    )
    .unwrap();
    for line in text.lines().filter(|l| !l.is_empty()) {
        if line.starts_with("# HELP ") || line.starts_with("# TYPE ") {
            continue;
        }
        assert!(
            sample.is_match(line),
            "not valid exposition format: {line:?}"
        );
    }
}

fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.strip_prefix(' '))
        })
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let target = Target::start();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, target.ca_cert_pem()).unwrap();
    let probe = target.https_url();
    let mut alpha = Squid::start();
    let beta = Squid::start();
    let refusing = Squid::start_with(SquidOptions {
        deny_connect: true,
        ..Default::default()
    });
    let inventory = dir.path().join("inventory.yaml");
    let base_inventory = format!(
        "{}{}{}",
        proxy_doc("alpha", alpha.port(), 2, &probe),
        proxy_doc("beta", beta.port(), 1, &probe),
        proxy_doc("refusing", refusing.port(), 2, &probe),
    );
    std::fs::write(&inventory, &base_inventory).unwrap();
    let (api_port, metrics_port) = (free_port(), free_port());
    let mut operator = Operator::start(dir.path(), &inventory, &ca, api_port, metrics_port);
    let client = Client {
        http: crate::support::http::client(),
        base: operator.api.clone(),
    };
    wait_ready(&client).await;

    // Exactly the two permissive squids become healthy.
    eventually("alpha and beta healthy", || async {
        client.healthy_names().await == ["alpha", "beta"]
    })
    .await;
    let (_, _, unhealthy) = client
        .call(reqwest::Method::GET, "/v1/proxies?healthy=false", None)
        .await;
    assert_eq!(unhealthy["count"], 1);
    assert_eq!(unhealthy["proxies"][0]["name"], "refusing");

    // No token, no API.
    let r = client
        .http
        .get(format!("{}/v1/proxies", client.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);

    // Acquire until the pool is full: alpha 2 + beta 1.
    let mut held = Vec::new();
    for _ in 0..3 {
        let (s, _, lease) = client
            .acquire(json!({"selector": {"pool": "e2e"}, "ttlSeconds": 120}))
            .await;
        assert_eq!(s, StatusCode::CREATED, "{lease}");
        held.push(lease);
    }
    let (s, headers, body) = client.acquire(json!({"selector": {"pool": "e2e"}})).await;
    assert_eq!(s, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["error"], "no_match");
    assert_eq!(
        (
            body["considered"].as_u64(),
            body["atCapacity"].as_u64(),
            body["unhealthy"].as_u64()
        ),
        (Some(3), Some(2), Some(1))
    );
    let retry_after: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=120).contains(&retry_after), "{retry_after}");

    // Free one alpha slot; a rate_limited report on it sends example.com elsewhere.
    let alpha_lease = held
        .iter()
        .position(|l| l["proxy"]["name"] == "alpha")
        .unwrap();
    let alpha_lease = held.remove(alpha_lease);
    let alpha_id = alpha_lease["leaseID"].as_str().unwrap();
    let (s, _, _) = client
        .call(
            reqwest::Method::POST,
            &format!("/v1/leases/{alpha_id}/report"),
            Some(json!({"result": "rate_limited", "target": "example.com"})),
        )
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, _, _) = client
        .call(
            reqwest::Method::DELETE,
            &format!("/v1/leases/{alpha_id}"),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, _, body) = client
        .acquire(json!({"selector": {"pool": "e2e"}, "target": "example.com"}))
        .await;
    assert_eq!(
        s,
        StatusCode::CONFLICT,
        "alpha is cooling down for example.com and beta is full: {body}"
    );
    assert_eq!(body["inCooldown"], 1);
    let (s, _, lease) = client
        .acquire(json!({"selector": {"pool": "e2e"}, "target": "other.org", "ttlSeconds": 120}))
        .await;
    assert_eq!(s, StatusCode::CREATED);
    assert_eq!(lease["proxy"]["name"], "alpha");
    held.push(lease);

    // Kill alpha: it goes unhealthy and leaves the candidate set.
    alpha.kill();
    eventually("alpha unhealthy", || async {
        client.healthy_names().await == ["beta"]
    })
    .await;

    // kill -9 the operator, restart it on the same ledger: every acknowledged lease is there
    // and capacity is still enforced (beta's one slot is held).
    let status = Command::new("kill")
        .args(["-9", &operator.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    drop(operator);
    operator = Operator::start(dir.path(), &inventory, &ca, api_port, metrics_port);
    wait_ready(&client).await;
    for lease in &held {
        let id = lease["leaseID"].as_str().unwrap();
        let (s, _, got) = client
            .call(reqwest::Method::GET, &format!("/v1/leases/{id}"), None)
            .await;
        assert_eq!(s, StatusCode::OK, "lease {id} lost");
        assert_eq!(got["state"], "active", "{got}");
    }
    eventually("beta healthy after restart", || async {
        client.healthy_names().await == ["beta"]
    })
    .await;
    let (s, _, body) = client.acquire(json!({"selector": {"pool": "e2e"}})).await;
    assert_eq!(s, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["atCapacity"], 1, "{body}");

    // Edit the inventory: beta takes two leases now, no restart needed.
    std::fs::write(
        &inventory,
        base_inventory.replace(
            &proxy_doc("beta", beta.port(), 1, &probe),
            &proxy_doc("beta", beta.port(), 2, &probe),
        ),
    )
    .unwrap();
    eventually("beta's new capacity", || async {
        let (_, _, v) = client
            .call(reqwest::Method::GET, "/v1/proxies?selector=pool=e2e", None)
            .await;
        v["proxies"].as_array().is_some_and(|ps| {
            ps.iter()
                .any(|p| p["name"] == "beta" && p["maxLeases"] == 2)
        })
    })
    .await;
    let (s, _, lease) = client.acquire(json!({"selector": {"pool": "e2e"}})).await;
    assert_eq!(s, StatusCode::CREATED);
    assert_eq!(lease["proxy"]["name"], "beta");

    // Metrics: valid exposition format and the fleet's series.
    let text = client
        .http
        .get(&operator.metrics)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    metric_lines_are_valid(&text);
    assert_eq!(
        metric(&text, "proxy_operator_leases_active"),
        Some(4.0),
        "{text}"
    );
    assert_eq!(metric(&text, "proxy_operator_cooldowns_active"), Some(1.0));
    assert_eq!(
        metric(&text, r#"proxy_operator_proxies{phase="Ready"}"#),
        Some(1.0)
    );
    // alpha and refusing are Provisioning (no verdict yet since the restart) or Unhealthy.
    let not_ready = metric(&text, r#"proxy_operator_proxies{phase="Unhealthy"}"#).unwrap()
        + metric(&text, r#"proxy_operator_proxies{phase="Provisioning"}"#).unwrap();
    assert_eq!(not_ready, 2.0);
    assert_eq!(
        metric(&text, "proxy_operator_leases_granted_total"),
        Some(1.0)
    );
    assert!(
        text.contains("proxy_operator_probe_duration_seconds_bucket"),
        "{text}"
    );
    assert!(text.contains("proxy_operator_probes_total{"), "{text}");
    assert!(text.contains("process_resident_memory_bytes"));

    // The history is in the ledger file, readable with the sqlite3 CLI.
    let db = dir.path().join("ledger.db");
    let acquired: u32 = sqlite3(
        &db,
        "SELECT count(*) FROM lease_events WHERE kind = 'acquired'",
    )
    .parse()
    .unwrap();
    assert_eq!(acquired, 5);
    assert_eq!(
        sqlite3(
            &db,
            "SELECT result FROM lease_events WHERE kind = 'reported'"
        ),
        "rate_limited"
    );
    assert_eq!(sqlite3(&db, "SELECT count(*) FROM active_leases"), "4");

    // SIGTERM stops it cleanly.
    let status = Command::new("kill")
        .args(["-TERM", &operator.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let start = Instant::now();
    let exit = loop {
        if let Some(exit) = operator.child.try_wait().unwrap() {
            break exit;
        }
        assert!(start.elapsed() < DEADLINE, "no exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        exit.success(),
        "{exit:?}\n{}",
        std::fs::read_to_string(dir.path().join("operator.log")).unwrap_or_default()
    );
}

/// A directory with a one-proxy inventory (nothing listens behind it: these tests are about
/// start-up and the API's authentication, not health).
fn auth_dir() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let inventory = dir.path().join("inventory.yaml");
    std::fs::write(
        &inventory,
        proxy_doc("auth", free_port(), 1, "http://127.0.0.1:9/"),
    )
    .unwrap();
    (dir, inventory)
}

/// The binary in standalone mode on free loopback ports, with `DISCOVERY_TOKEN` removed from
/// its environment; `configure` adds flags and variables. Its log goes to `dir/operator.log`.
fn standalone(
    dir: &Path,
    inventory: &Path,
    configure: impl FnOnce(&mut Command),
) -> (Child, String) {
    let log = std::fs::File::create(dir.join("operator.log")).unwrap();
    let api_port = free_port();
    let mut command = Command::new(env!("CARGO_BIN_EXE_proxy-operator"));
    command
        .args(["standalone", "--inventory"])
        .arg(inventory)
        .arg("--ledger")
        .arg(dir.join("ledger.db"))
        .args(["--discovery-addr", &format!("127.0.0.1:{api_port}")])
        .args(["--metrics-addr", &format!("127.0.0.1:{}", free_port())])
        .args(["--gateway-addr", &format!("127.0.0.1:{}", free_port())])
        .env_remove("DISCOVERY_TOKEN")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log);
    configure(&mut command);
    let child = command.spawn().unwrap();
    (child, format!("http://127.0.0.1:{api_port}"))
}

fn log_of(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("operator.log")).unwrap_or_default()
}

/// Waits (with a deadline) for the child to exit on its own.
fn exit_of(child: &mut Child) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > DEADLINE {
            let _ = child.kill();
            panic!("the binary did not exit within {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The gateway's files are checked before anything is opened: an interception CA that is
/// unreadable, not a CA, not its key's or readable by others, and a rules file with an error,
/// each stop start-up with exit code 2 and a message naming the flag (and the rules file's
/// line).
#[test]
fn start_up_refuses_a_bad_interception_ca_or_rules_file() {
    use std::os::unix::fs::PermissionsExt;
    let (dir, inventory) = auth_dir();
    let good = support::gateway_ca::GatewayCa::write(dir.path());
    let other_dir = dir.path().join("other");
    std::fs::create_dir(&other_dir).unwrap();
    let other = support::gateway_ca::GatewayCa::write(&other_dir);
    let leaf = rcgen::generate_simple_self_signed(vec!["not-a-ca.test".to_owned()]).unwrap();
    let leaf_cert = dir.path().join("leaf.crt");
    let leaf_key = dir.path().join("leaf.key");
    std::fs::write(&leaf_cert, leaf.cert.pem()).unwrap();
    std::fs::write(&leaf_key, leaf.signing_key.serialize_pem()).unwrap();
    std::fs::set_permissions(&leaf_key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let open_key = dir.path().join("open.key");
    std::fs::copy(&good.key, &open_key).unwrap();
    std::fs::set_permissions(&open_key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let rules = dir.path().join("rules.yaml");
    std::fs::write(&rules, "rules:\n  - name: x\n    hosts: [\"*\"]\n    bans:\n      - body: \"(unclosed\"\n        result: blocked\n").unwrap();
    let path = |p: &Path| p.display().to_string();
    let cases: Vec<(&str, Vec<String>, Vec<&str>)> = vec![
        (
            "unreadable certificate",
            vec![
                "--gateway-ca-cert".into(),
                "/nonexistent/ca.crt".into(),
                "--gateway-ca-key".into(),
                path(&good.key),
            ],
            vec!["--gateway-ca-cert /nonexistent/ca.crt: cannot read"],
        ),
        (
            "another CA's key",
            vec![
                "--gateway-ca-cert".into(),
                path(&good.cert),
                "--gateway-ca-key".into(),
                path(&other.key),
            ],
            vec!["--gateway-ca-key", "is not the key of the certificate"],
        ),
        (
            "not a CA",
            vec![
                "--gateway-ca-cert".into(),
                path(&leaf_cert),
                "--gateway-ca-key".into(),
                path(&leaf_key),
            ],
            vec!["--gateway-ca-cert", "is not a CA certificate"],
        ),
        (
            "a key others may read",
            vec![
                "--gateway-ca-cert".into(),
                path(&good.cert),
                "--gateway-ca-key".into(),
                path(&open_key),
            ],
            vec!["--gateway-ca-key", "readable by others"],
        ),
        (
            "a rules file with an error",
            vec!["--gateway-rules-file".into(), path(&rules)],
            vec!["--gateway-rules-file", "line 5", "rules[0].bans[0].body"],
        ),
    ];
    for (name, args, expected) in cases {
        let (mut child, _) = standalone(dir.path(), &inventory, |c| {
            c.args(&args).env("DISCOVERY_TOKEN", "0123456789abcdef0123");
        });
        let status = exit_of(&mut child);
        let log = log_of(dir.path());
        assert_eq!(status.code(), Some(2), "{name}: {status:?}\n{log}");
        for text in expected {
            assert!(log.contains(text), "{name}: {text:?} missing from\n{log}");
        }
    }
    assert!(
        !dir.path().join("ledger.db").exists(),
        "the ledger was opened"
    );
}

#[test]
fn start_up_refuses_to_serve_without_a_usable_token() {
    use std::os::unix::ffi::OsStrExt;
    let (dir, inventory) = auth_dir();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, "0123456789abcdef0123\n\n  short \n").unwrap();
    let empty = dir.path().join("empty");
    std::fs::write(&empty, "\n \n").unwrap();
    type Setup = Box<dyn FnOnce(&mut Command)>;
    let cases: Vec<(&str, Setup, Vec<&str>)> = vec![
        (
            "missing",
            Box::new(|_| {}),
            vec![
                "DISCOVERY_TOKEN",
                "--discovery-token-file",
                "--insecure-no-auth",
            ],
        ),
        (
            "empty",
            Box::new(|c| {
                c.env("DISCOVERY_TOKEN", "");
            }),
            vec!["DISCOVERY_TOKEN is empty"],
        ),
        (
            "whitespace",
            Box::new(|c| {
                c.env("DISCOVERY_TOKEN", " \t ");
            }),
            vec!["DISCOVERY_TOKEN is empty"],
        ),
        (
            "non-UTF-8",
            Box::new(|c| {
                c.env(
                    "DISCOVERY_TOKEN",
                    std::ffi::OsStr::from_bytes(b"0123456789abcdef\xff"),
                );
            }),
            vec!["DISCOVERY_TOKEN is not UTF-8"],
        ),
        (
            "short",
            Box::new(|c| {
                c.env("DISCOVERY_TOKEN", "change-me");
            }),
            vec!["DISCOVERY_TOKEN is 9 bytes long", "at least 16"],
        ),
        (
            "bad line in the file",
            Box::new({
                let tokens = tokens.clone();
                move |c| {
                    c.arg("--discovery-token-file").arg(tokens);
                }
            }),
            vec!["--discovery-token-file", "tokens: line 3:", "5 bytes long"],
        ),
        (
            "file without tokens",
            Box::new({
                let empty = empty.clone();
                move |c| {
                    c.arg("--discovery-token-file").arg(empty);
                }
            }),
            vec!["--discovery-token-file", "holds no token"],
        ),
        (
            "missing file",
            Box::new(|c| {
                c.args(["--discovery-token-file", "/nonexistent/tokens"]);
            }),
            vec!["--discovery-token-file /nonexistent/tokens: cannot read"],
        ),
        (
            "insecure with a token",
            Box::new(|c| {
                c.arg("--insecure-no-auth")
                    .env("DISCOVERY_TOKEN", "0123456789abcdef0123");
            }),
            vec!["--insecure-no-auth cannot be combined with DISCOVERY_TOKEN"],
        ),
        (
            "zero default TTL",
            Box::new(|c| {
                c.args(["--default-lease-ttl", "0s"])
                    .env("DISCOVERY_TOKEN", "0123456789abcdef0123");
            }),
            vec!["--default-lease-ttl", "must be above zero"],
        ),
    ];
    for (name, setup, expected) in cases {
        let (mut child, _) = standalone(dir.path(), &inventory, setup);
        let status = exit_of(&mut child);
        let log = log_of(dir.path());
        assert_eq!(status.code(), Some(2), "{name}: {status:?}\n{log}");
        for text in expected {
            assert!(log.contains(text), "{name}: {text:?} missing from\n{log}");
        }
    }
    // Refused before anything was opened.
    assert!(!dir.path().join("ledger.db").exists());
}

/// The status of `GET /v1/proxies` with the token (none: no `Authorization`).
async fn proxies_status(http: &reqwest::Client, api: &str, token: Option<&str>) -> StatusCode {
    let mut request = http.get(format!("{api}/v1/proxies"));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    match request.send().await {
        Ok(response) => response.status(),
        Err(_) => StatusCode::SERVICE_UNAVAILABLE,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_rotate_through_the_token_file_without_a_restart() {
    const OLD: &str = "old-token-0123456789abcdef";
    const NEW: &str = "new-token-0123456789abcdef";
    const ENV: &str = "env-token-0123456789abcdef";
    let (dir, inventory) = auth_dir();
    let tokens = dir.path().join("tokens");
    // Written next to the file and renamed over it, as a Secret volume swaps its content.
    let swap = |content: &str| {
        let next = dir.path().join("tokens.next");
        std::fs::write(&next, content).unwrap();
        std::fs::rename(&next, &tokens).unwrap();
    };
    swap(&format!("{OLD}\n"));
    let (child, api) = standalone(dir.path(), &inventory, |c| {
        c.arg("--discovery-token-file")
            .arg(&tokens)
            .args(["--discovery-token-poll", "50ms"])
            .env("DISCOVERY_TOKEN", ENV);
    });
    let _operator = Operator {
        child,
        api: api.clone(),
        metrics: String::new(),
    };
    let http = crate::support::http::client();
    eventually("the API to serve the file's token", || {
        let (http, api) = (&http, &api);
        async move { proxies_status(http, api, Some(OLD)).await == StatusCode::OK }
    })
    .await;
    // Both sources' tokens are valid.
    assert_eq!(proxies_status(&http, &api, Some(ENV)).await, StatusCode::OK);
    for token in [None, Some(NEW)] {
        assert_eq!(
            proxies_status(&http, &api, token).await,
            StatusCode::UNAUTHORIZED
        );
    }

    // Add the new token: both work.
    swap(&format!("{OLD}\n\n  {NEW}  \n"));
    eventually("the new token to be accepted", || {
        let (http, api) = (&http, &api);
        async move { proxies_status(http, api, Some(NEW)).await == StatusCode::OK }
    })
    .await;
    assert_eq!(proxies_status(&http, &api, Some(OLD)).await, StatusCode::OK);

    // Drop the old one.
    swap(&format!("{NEW}\n"));
    eventually("the old token to be refused", || {
        let (http, api) = (&http, &api);
        async move { proxies_status(http, api, Some(OLD)).await == StatusCode::UNAUTHORIZED }
    })
    .await;
    assert_eq!(proxies_status(&http, &api, Some(NEW)).await, StatusCode::OK);
    assert_eq!(proxies_status(&http, &api, Some(ENV)).await, StatusCode::OK);

    // A broken file keeps the previous tokens (it never opens the API).
    swap("short\n");
    eventually("the broken file to be reported", || {
        let dir = dir.path().to_owned();
        async move { log_of(&dir).contains("keeping the previous API tokens") }
    })
    .await;
    let log = log_of(dir.path());
    assert!(log.contains("line 1:"), "{log}");
    assert_eq!(proxies_status(&http, &api, Some(NEW)).await, StatusCode::OK);
    for token in [None, Some("short"), Some(OLD)] {
        assert_eq!(
            proxies_status(&http, &api, token).await,
            StatusCode::UNAUTHORIZED,
            "{token:?}"
        );
    }
    // So does a vanished one.
    std::fs::remove_file(&tokens).unwrap();
    eventually("the missing file to be reported", || {
        let dir = dir.path().to_owned();
        async move { log_of(&dir).contains("cannot read") }
    })
    .await;
    assert_eq!(proxies_status(&http, &api, Some(NEW)).await, StatusCode::OK);
    assert_eq!(
        proxies_status(&http, &api, None).await,
        StatusCode::UNAUTHORIZED
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn insecure_no_auth_serves_without_a_token_and_says_so() {
    let (dir, inventory) = auth_dir();
    let (child, api) = standalone(dir.path(), &inventory, |c| {
        c.arg("--insecure-no-auth");
    });
    let _operator = Operator {
        child,
        api: api.clone(),
        metrics: String::new(),
    };
    let http = crate::support::http::client();
    eventually("the open API to answer", || {
        let (http, api) = (&http, &api);
        async move { proxies_status(http, api, None).await == StatusCode::OK }
    })
    .await;
    let log = log_of(dir.path());
    assert!(
        log.contains("--insecure-no-auth: the lease API on 127.0.0.1:")
            && log.contains("accepts requests from anyone"),
        "{log}"
    );
}

/// Names and `cordoned` flags of the listed proxies of `pool=cordon`, with their health.
async fn cordon_states(client: &Client) -> Vec<(String, bool, bool)> {
    let (_, _, list) = client
        .call(
            reqwest::Method::GET,
            "/v1/proxies?selector=pool=cordon",
            None,
        )
        .await;
    list["proxies"]
        .as_array()
        .map(|ps| {
            ps.iter()
                .map(|p| {
                    (
                        p["name"].as_str().unwrap_or_default().to_owned(),
                        p["cordoned"].as_bool().unwrap_or_default(),
                        p["healthy"].as_bool().unwrap_or_default(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Cordoning through the inventory file: new leases stop landing on the proxy while the lease
/// it holds renews and takes reports, and it stays listed (cordoned) and probed — its squid
/// going down shows as unhealthy, coming back as healthy. Uncordoning makes it leasable again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cordon_in_the_inventory_file_stops_new_leases_only() {
    let dir = tempfile::tempdir().unwrap();
    let target = Target::start();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, target.ca_cert_pem()).unwrap();
    let mut squids = [Squid::start(), Squid::start()];
    let mut proxies: Vec<ExternalProxy> = ["cordon-a", "cordon-b"]
        .iter()
        .zip(&squids)
        .map(|(name, squid)| ExternalProxy {
            name: (*name).to_owned(),
            labels: vec![("pool".into(), "cordon".into())],
            host: "127.0.0.1".into(),
            port: squid.port(),
            max_leases: 3,
            probe_url: target.https_url(),
            interval: "500ms",
            cordoned: false,
            socks5: false,
            credentials: None,
            cost: None,
        })
        .collect();
    let mut operator = Standalone::start(
        dir.path(),
        &proxies,
        &ca,
        TOKEN,
        &["--inventory-poll", "100ms"],
    );
    operator.wait_healthy(TOKEN, 2, DEADLINE * 2).await;
    let client = Client {
        http: crate::support::http::client(),
        base: operator.api().to_owned(),
    };
    let pool = json!({"selector": {"pool": "cordon"}, "ttlSeconds": 60});

    // A lease before the cordon, on whichever proxy is chosen: that one gets cordoned.
    let (s, _, held) = client.acquire(pool.clone()).await;
    assert_eq!(s, StatusCode::CREATED, "{held}");
    let held_id = held["leaseID"].as_str().unwrap().to_owned();
    let cordoned = held["proxy"]["name"].as_str().unwrap().to_owned();
    let p = proxies.iter().position(|x| x.name == cordoned).unwrap();
    let other = proxies[1 - p].name.clone();
    assert!(
        cordon_states(&client).await.iter().all(|(_, c, _)| !c),
        "nothing is cordoned yet"
    );

    proxies[p].cordoned = true;
    operator.rewrite_inventory(&proxies);
    let mut expected = vec![(cordoned.clone(), true, true), (other.clone(), false, true)];
    expected.sort();
    eventually("the cordon to be listed", || async {
        cordon_states(&client).await == expected
    })
    .await;

    // New leases land on the other proxy only, until it is full.
    let mut url = String::new();
    for _ in 0..3 {
        let (s, _, lease) = client.acquire(pool.clone()).await;
        assert_eq!(s, StatusCode::CREATED, "{lease}");
        assert_eq!(lease["proxy"]["name"], other.as_str(), "{lease}");
        url = lease["proxy"]["url"].as_str().unwrap().to_owned();
    }
    // A lease on it works: a request through the leased squid reaches the target.
    assert_eq!(url, squids[1 - p].url());
    let through = reqwest::Client::builder()
        .proxy(reqwest::Proxy::all(&url).unwrap())
        .build()
        .unwrap();
    let answer = through.get(target.http_url()).send().await.unwrap();
    assert_eq!(answer.status(), StatusCode::NO_CONTENT);
    let (s, headers, body) = client.acquire(pool.clone()).await;
    assert_eq!(s, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["considered"], 2, "{body}");
    assert_eq!(body["cordoned"], 1, "{body}");
    assert_eq!(body["atCapacity"], 1, "{body}");
    assert_eq!(body["unhealthy"], 0, "{body}");
    assert!(headers.contains_key("retry-after"), "{headers:?}");

    // The lease held on the cordoned proxy renews and takes reports.
    let (s, _, renewed) = client
        .call(
            reqwest::Method::POST,
            &format!("/v1/leases/{held_id}/renew"),
            Some(json!({"ttlSeconds": 120})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{renewed}");
    assert_eq!(renewed["state"], "active");
    assert_eq!(renewed["ttlSeconds"], 120);
    assert_eq!(renewed["proxy"]["name"], cordoned.as_str());
    let (s, _, v) = client
        .call(
            reqwest::Method::POST,
            &format!("/v1/leases/{held_id}/report"),
            Some(json!({"result": "ok"})),
        )
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");

    // Still probed: its squid going down and coming back shows.
    squids[p].kill();
    eventually("the cordoned proxy to turn unhealthy", || async {
        cordon_states(&client)
            .await
            .contains(&(cordoned.clone(), true, false))
    })
    .await;
    squids[p].restart();
    eventually("the cordoned proxy to recover", || async {
        cordon_states(&client)
            .await
            .contains(&(cordoned.clone(), true, true))
    })
    .await;

    // Uncordoned, it takes new leases again.
    proxies[p].cordoned = false;
    operator.rewrite_inventory(&proxies);
    eventually("the uncordon to be listed", || async {
        let states = cordon_states(&client).await;
        states.len() == proxies.len() && states.iter().all(|(_, c, _)| !c)
    })
    .await;
    let (s, _, lease) = client.acquire(pool.clone()).await;
    assert_eq!(s, StatusCode::CREATED, "{lease}");
    assert_eq!(lease["proxy"]["name"], cordoned.as_str(), "{lease}");
    drop(operator);
}
