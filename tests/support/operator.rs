//! The real `proxy-operator run` binary as a child process against a test control plane, and
//! a small client for its lease API and metrics. Killed on drop; its log is printed when a
//! test fails so the failure explains itself.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::Value;

use super::envtest::ControlPlane;
use super::world::{SLOW, eventually, within};
use super::{Target, free_port};

/// How long a start-up may take on a loaded machine.
pub const READY_DEADLINE: Duration = Duration::from_secs(90);

/// `RUST_LOG` of the operators these tests start.
pub const TEST_LOG: &str = "info,kube_lease_manager=warn";

/// Bearer token of the lease API in these tests.
pub const API_TOKEN: &str = "operator-test-token-0123456789";

/// Delays shrunk so the tests run in seconds; every one is a flag of `run`.
pub const FAST_FLAGS: &[&str] = &[
    "--provisioning-poll",
    "200ms",
    "--drift-poll",
    "2s",
    "--deletion-poll",
    "200ms",
    "--error-requeue",
    "500ms",
    "--error-requeue-max",
    "2s",
    "--quota-requeue",
    "2s",
];

/// The [`FAST_FLAGS`] pairs whose flag `extra_args` does not set itself.
fn fast_flags_not_in(extra_args: &[String]) -> Vec<&'static str> {
    FAST_FLAGS
        .chunks(2)
        .filter(|pair| !extra_args.iter().any(|a| a == pair[0]))
        .flatten()
        .copied()
        .collect()
}

/// The `egress:` block of these tests' providers configs: probe targets and origins are
/// loopback servers on random ports, which the generated squids refuse unless opened.
pub const LOOPBACK_EGRESS: &str = loopback_egress!();

/// The text of [`LOOPBACK_EGRESS`], for `concat!`.
macro_rules! loopback_egress {
    () => {
        "egress:\n  allowedDestinations: [127.0.0.0/8]\n  allowedPorts: [\"1024-65535\"]\n"
    };
}
use loopback_egress;

/// The providers config of these tests: one kubernetes provider `local`, its squids reaching
/// loopback ([`LOOPBACK_EGRESS`]).
pub const LOOPBACK_PROVIDERS: &str = concat!(
    loopback_egress!(),
    "providers:\n  - name: local\n    type: kubernetes\n    kubernetes:\n      image: ubuntu/squid\n"
);

/// How to start one operator process.
#[derive(Debug, Clone)]
pub struct OperatorOptions {
    /// Kubeconfig of the operator's identity.
    pub kubeconfig: PathBuf,
    /// Working directory: ledger, providers config, log.
    pub dir: PathBuf,
    /// `--install-id`, also used to name the leader Lease, so tests never share either.
    pub install_id: String,
    /// `--watch-namespace`, when cluster-wide behaviour is not the point.
    pub watch_namespace: Option<String>,
    /// Extra flags; one that [`FAST_FLAGS`] also sets replaces it there (the binary refuses a
    /// flag given twice).
    pub extra_args: Vec<String>,
    /// PEM bundle trusted for probe URLs.
    pub probe_ca: Option<PathBuf>,
    /// `RUST_LOG`; `None` runs the binary with its default filter, as an install that sets
    /// none does.
    pub log_filter: Option<String>,
}

impl OperatorOptions {
    /// The options of an operator against `cp` with the operator's identity from
    /// `manifests/`, trusting `target`'s CA for probes, logging at [`TEST_LOG`]. With a
    /// `watch_namespace`, orphan GC is allowed too: the install ID already keeps it to this
    /// process's own machines.
    pub async fn prepared(
        cp: &ControlPlane,
        dir: &Path,
        target: &Target,
        install_id: &str,
        watch_namespace: Option<&str>,
        extra_args: &[&str],
    ) -> OperatorOptions {
        let kubeconfig = dir.join("operator.kubeconfig");
        cp.operator_kubeconfig(&kubeconfig).await;
        let probe_ca = write_file(dir, "probe-ca.pem", target.ca_cert_pem());
        let mut args: Vec<String> = watch_namespace
            .map(|_| "--gc-allow-namespaced".to_owned())
            .into_iter()
            .collect();
        args.extend(extra_args.iter().map(|a| (*a).to_owned()));
        OperatorOptions {
            kubeconfig,
            dir: dir.to_owned(),
            install_id: install_id.to_owned(),
            watch_namespace: watch_namespace.map(str::to_owned),
            extra_args: args,
            probe_ca: Some(probe_ca),
            log_filter: Some(TEST_LOG.to_owned()),
        }
    }
}

/// A running `proxy-operator run`.
pub struct OperatorProcess {
    child: Option<Child>,
    options: OperatorOptions,
    /// The `proxy-operator` executable: this build's, or another build a bench compares.
    binary: PathBuf,
    api_port: u16,
    metrics_port: u16,
    gateway_port: u16,
    log: PathBuf,
    http: reqwest::Client,
}

impl OperatorProcess {
    /// Starts the binary with `options` on fresh loopback ports (not yet ready: see
    /// [`OperatorProcess::wait_ready`]).
    pub fn start(options: OperatorOptions) -> OperatorProcess {
        OperatorProcess::start_binary(options, this_build())
    }

    /// Starts `binary` (a `proxy-operator` of another build, for a bench comparing builds)
    /// with `options`, as [`OperatorProcess::start`] starts this build's.
    pub fn start_binary(options: OperatorOptions, binary: PathBuf) -> OperatorProcess {
        let mut process = OperatorProcess {
            child: None,
            binary,
            api_port: free_port(),
            metrics_port: free_port(),
            gateway_port: free_port(),
            log: options.dir.join("operator.log"),
            options,
            http: super::http::client(),
        };
        process.spawn();
        process
    }

    /// Starts `run` against `cp` ([`OperatorOptions::prepared`]) and waits until it is ready.
    pub async fn start_ready(
        cp: &ControlPlane,
        dir: &Path,
        target: &Target,
        install_id: &str,
        watch_namespace: Option<&str>,
        extra_args: &[&str],
    ) -> OperatorProcess {
        OperatorProcess::start_ready_binary(
            cp,
            dir,
            target,
            install_id,
            watch_namespace,
            extra_args,
            this_build(),
        )
        .await
    }

    /// [`OperatorProcess::start_ready`] with `binary` instead of this build's executable.
    pub async fn start_ready_binary(
        cp: &ControlPlane,
        dir: &Path,
        target: &Target,
        install_id: &str,
        watch_namespace: Option<&str>,
        extra_args: &[&str],
        binary: PathBuf,
    ) -> OperatorProcess {
        let options =
            OperatorOptions::prepared(cp, dir, target, install_id, watch_namespace, extra_args)
                .await;
        OperatorProcess::start_ready_with(options, binary).await
    }

    /// Starts `binary` with `options` and waits until it is ready.
    pub async fn start_ready_with(options: OperatorOptions, binary: PathBuf) -> OperatorProcess {
        let mut operator = OperatorProcess::start_binary(options, binary);
        operator.wait_ready(READY_DEADLINE).await;
        operator
    }

    fn spawn(&mut self) {
        let providers = self.options.dir.join("providers.yaml");
        if !providers.exists() {
            std::fs::write(&providers, LOOPBACK_PROVIDERS).expect("write the providers config");
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("open the operator log");
        let mut command = Command::new(&self.binary);
        command.arg("run").arg("--providers-config").arg(&providers);
        // An SQLite file of its own, unless the test shares a ledger among processes.
        if !self.options.extra_args.iter().any(|a| a == "--ledger") {
            command
                .arg("--ledger")
                .arg(self.options.dir.join("ledger.db"));
        }
        command
            .args(["--discovery-addr", &format!("127.0.0.1:{}", self.api_port)])
            .args([
                "--metrics-addr",
                &format!("127.0.0.1:{}", self.metrics_port),
            ])
            .args([
                "--gateway-addr",
                &format!("127.0.0.1:{}", self.gateway_port),
            ])
            .args(["--install-id", &self.options.install_id])
            .args([
                "--leader-lease",
                &format!("leader-{}", self.options.install_id),
            ])
            .args(["--leader-namespace", "proxy-operator"])
            .args(fast_flags_not_in(&self.options.extra_args));
        if let Some(ns) = &self.options.watch_namespace {
            command.args(["--watch-namespace", ns]);
        }
        if let Some(ca) = &self.options.probe_ca {
            command.arg("--probe-ca-file").arg(ca);
        }
        match &self.options.log_filter {
            Some(filter) => command.env("RUST_LOG", filter),
            None => command.env_remove("RUST_LOG"),
        };
        command
            .args(&self.options.extra_args)
            .env("KUBECONFIG", &self.options.kubeconfig)
            .env("DISCOVERY_TOKEN", API_TOKEN)
            .env("POD_NAME", self.identity())
            .env_remove("KUBERNETES_SERVICE_HOST")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        self.child = Some(command.spawn().expect("spawn proxy-operator run"));
    }

    /// Polls `/readyz` until it answers 200 (the Proxy list has arrived), panicking with the
    /// log if the process exits or the deadline passes.
    pub async fn wait_ready(&mut self, deadline: Duration) {
        let url = format!("http://127.0.0.1:{}/readyz", self.api_port);
        let start = Instant::now();
        loop {
            if let Some(status) = self.exit_status() {
                panic!(
                    "the operator exited ({status}) before it was ready:\n{}",
                    self.log_text()
                );
            }
            let ready = self.http.get(&url).send().await;
            if ready.is_ok_and(|r| r.status() == StatusCode::OK) {
                return;
            }
            assert!(
                start.elapsed() < deadline,
                "/readyz not 200 after {deadline:?}; log:\n{}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The process ID, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The exit status, if the process has ended.
    pub fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Kills the process with SIGKILL (no shutdown code runs) and reaps it.
    pub fn kill_9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the binary again with the same options, ports and ledger.
    pub fn restart(&mut self) {
        self.kill_9();
        self.spawn();
    }

    /// Sends SIGTERM and waits for a clean exit.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("the operator is running");
        let pid = i32::try_from(child.id()).expect("pid fits i32");
        // SAFETY: kill(2) with a pid this process spawned and has not reaped.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let start = Instant::now();
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return status;
            }
            assert!(start.elapsed() < super::DEADLINE, "no exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// What the process logged so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `127.0.0.1:<port>` of the metrics endpoint, as a Prometheus scrape target.
    pub fn metrics_address(&self) -> String {
        format!("127.0.0.1:{}", self.metrics_port)
    }

    /// `127.0.0.1:<port>`, the gateway's address.
    pub fn gateway(&self) -> String {
        format!("127.0.0.1:{}", self.gateway_port)
    }

    /// The ledger file.
    pub fn ledger(&self) -> PathBuf {
        self.options.dir.join("ledger.db")
    }

    /// Its identity in the leader Lease (`POD_NAME`): one per process object, so replicas of
    /// one install, which share its Lease, are told apart.
    pub fn identity(&self) -> String {
        format!("operator-{}-{}", self.options.install_id, self.api_port)
    }

    /// The URL of `path` on the lease API.
    pub fn api_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.api_port)
    }

    /// Calls the lease API with the token; returns the status and the JSON body (Null if empty).
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut request = self
            .http
            .request(method, self.api_url(path))
            .bearer_auth(API_TOKEN);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.expect("call the lease API");
        let status = response.status();
        let text = response.text().await.expect("read the API answer");
        let value = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
        };
        (status, value)
    }

    /// Acquires a lease with the request `body`, retrying while the answer is 409 (no proxy
    /// leasable yet) and panicking with `what` after [`SLOW`]; returns the lease.
    pub async fn acquire_retrying(&self, body: &Value, what: &str) -> Value {
        within(SLOW, what, || async {
            let (status, lease) = self
                .call(Method::POST, "/v1/leases", Some(body.clone()))
                .await;
            match status {
                StatusCode::CREATED => Some(lease),
                StatusCode::CONFLICT => None,
                other => panic!("{what}: acquire {body} answered {other}: {lease}"),
            }
        })
        .await
    }

    /// Asks to renew the lease `id` for `ttl_seconds`; returns the status and the answer.
    pub async fn renew(&self, id: &str, ttl_seconds: u64) -> (StatusCode, Value) {
        let body = serde_json::json!({ "ttlSeconds": ttl_seconds });
        self.call(Method::POST, &format!("/v1/leases/{id}/renew"), Some(body))
            .await
    }

    /// Releases the lease `id`, asserting the API answers 204.
    pub async fn release(&self, id: &str) {
        let (status, body) = self
            .call(Method::DELETE, &format!("/v1/leases/{id}"), None)
            .await;
        assert_eq!(status, StatusCode::NO_CONTENT, "release {id}: {body}");
    }

    /// Reports `report` on the lease `id`, asserting the API answers 204.
    pub async fn report(&self, id: &str, report: Value) {
        let (status, body) = self
            .call(
                Method::POST,
                &format!("/v1/leases/{id}/report"),
                Some(report),
            )
            .await;
        assert_eq!(status, StatusCode::NO_CONTENT, "report on {id}: {body}");
    }

    /// The lease `id` as the API shows it, asserting it answers 200.
    pub async fn lease(&self, id: &str) -> Value {
        let (status, view) = self
            .call(Method::GET, &format!("/v1/leases/{id}"), None)
            .await;
        assert_eq!(status, StatusCode::OK, "{view}");
        view
    }

    /// The proxy `name` as `GET /v1/proxies?selector=pool=<pool>` lists it, once its boolean
    /// `field` (`cordoned`, `draining`) shows `value`.
    pub async fn wait_listed(&self, pool: &str, name: &str, field: &str, value: bool) -> Value {
        eventually(
            &format!("{name} listed by the API with {field}: {value}"),
            || async {
                let (status, list) = self
                    .call(
                        Method::GET,
                        &format!("/v1/proxies?selector=pool={pool}"),
                        None,
                    )
                    .await;
                assert_eq!(status, StatusCode::OK, "{list}");
                list["proxies"]
                    .as_array()?
                    .iter()
                    .find(|p| p["name"] == name && p[field] == value)
                    .cloned()
            },
        )
        .await
    }

    /// The `/metrics` text.
    pub async fn metrics(&self) -> String {
        self.http
            .get(format!("http://127.0.0.1:{}/metrics", self.metrics_port))
            .send()
            .await
            .expect("scrape /metrics")
            .text()
            .await
            .expect("read /metrics")
    }
}

impl Drop for OperatorProcess {
    fn drop(&mut self) {
        self.kill_9();
        if std::thread::panicking() {
            eprintln!(
                "--- operator log ({}) ---\n{}",
                self.log.display(),
                tail(&self.log_text(), 200)
            );
        }
    }
}

/// The last `lines` lines of `text`.
fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// This build's `proxy-operator` executable.
pub fn this_build() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_proxy-operator"))
}

/// The `leaseID` of a lease the API answered with.
pub fn lease_id(lease: &Value) -> String {
    lease["leaseID"].as_str().expect("a lease ID").to_owned()
}

/// The sum of the samples of `metric` whose labels contain every `label="value"` pair given.
pub fn metric_sum(metrics: &str, metric: &str, labels: &[&str]) -> f64 {
    metrics
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(metric)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|l| labels.iter().all(|pair| l.contains(pair)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Writes `pem` to `dir/name` and returns the path.
pub fn write_file(dir: &Path, name: &str, contents: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, contents).expect("write a test file");
    path
}
