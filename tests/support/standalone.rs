//! The real `proxy-operator standalone` binary as a child process on free loopback ports, with
//! an inventory of External proxies in a temp dir. Killed on drop; its log is printed when the
//! test is failing, so a failure explains itself.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::free_port;

/// One External `Proxy` document of an inventory file.
#[derive(Debug, Clone)]
pub struct ExternalProxy {
    /// `metadata.name`.
    pub name: String,
    /// `metadata.labels`.
    pub labels: Vec<(String, String)>,
    /// The proxy's address.
    pub host: String,
    /// The proxy's port.
    pub port: u16,
    /// `spec.maxLeases`.
    pub max_leases: i32,
    /// `spec.healthCheck.probeURL`.
    pub probe_url: String,
    /// `spec.healthCheck.interval` and `timeout` (e.g. `1s`).
    pub interval: &'static str,
    /// `spec.cordoned`.
    pub cordoned: bool,
    /// `spec.endpoint.protocol: socks5` (a SOCKS5 proxy); otherwise the default, `http`.
    pub socks5: bool,
    /// The `(username, password)` it asks for: a `kind: Secret` document goes beside it and
    /// its `credentialsSecretRef` names it.
    pub credentials: Option<(String, String)>,
    /// `spec.cost` as a YAML flow mapping, e.g. `{perGB: "2"}`.
    pub cost: Option<&'static str>,
}

impl ExternalProxy {
    /// The proxy as one YAML document (with its `---` separator).
    pub fn to_yaml(&self) -> String {
        let labels: Vec<String> = self
            .labels
            .iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect();
        let (secret, reference) = match &self.credentials {
            Some((username, password)) => (
                format!(
                    "apiVersion: v1
kind: Secret
metadata: {{name: {name}-credentials}}
stringData: {{username: {username}, password: {password}}}
---
",
                    name = self.name
                ),
                format!(
                    ", credentialsSecretRef: {{name: {}-credentials}}",
                    self.name
                ),
            ),
            None => (String::new(), String::new()),
        };
        let protocol = if self.socks5 {
            ", protocol: socks5"
        } else {
            ""
        };
        format!(
            "{secret}apiVersion: crawl.example.com/v1alpha1
kind: Proxy
metadata:
  name: {name}
  labels: {{{labels}}}
spec:
  mode: External
  endpoint: {{host: {host}, port: {port}{reference}{protocol}}}
  maxLeases: {max_leases}
  cordoned: {cordoned}{cost}
  healthCheck:
    probeURL: {probe_url}
    interval: {interval}
    timeout: {interval}
---
",
            name = self.name,
            host = self.host,
            labels = labels.join(", "),
            port = self.port,
            max_leases = self.max_leases,
            cordoned = self.cordoned,
            probe_url = self.probe_url,
            interval = self.interval,
            cost = self
                .cost
                .map(|c| format!("\n  cost: {c}"))
                .unwrap_or_default(),
        )
    }
}

/// A running `proxy-operator standalone`.
pub struct Standalone {
    child: Child,
    api: String,
    gateway: String,
    metrics: String,
    log: PathBuf,
    inventory: PathBuf,
}

impl Standalone {
    /// Writes `proxies` as the inventory in `dir` and starts the binary on it with the ledger
    /// in `dir` (unless `extra_args` name a `--ledger`), `token` as `DISCOVERY_TOKEN`, probes trusting the PEM bundle `probe_ca`, and
    /// `extra_args` last. Not ready yet: poll [`Standalone::api`].
    pub fn start(
        dir: &Path,
        proxies: &[ExternalProxy],
        probe_ca: &Path,
        token: &str,
        extra_args: &[&str],
    ) -> Standalone {
        let yaml: String = proxies.iter().map(ExternalProxy::to_yaml).collect();
        Standalone::start_inventory(dir, &yaml, probe_ca, token, extra_args)
    }

    /// [`start`](Self::start) on the inventory `yaml`, written by the caller.
    pub fn start_inventory(
        dir: &Path,
        yaml: &str,
        probe_ca: &Path,
        token: &str,
        extra_args: &[&str],
    ) -> Standalone {
        let inventory = dir.join("inventory.yaml");
        std::fs::write(&inventory, yaml).expect("write the inventory");
        Standalone::start_on(dir, inventory, probe_ca, token, extra_args)
    }

    /// Starts the binary on the inventory file `inventory` as it is, otherwise as
    /// [`Standalone::start`] does.
    pub fn start_on(
        dir: &Path,
        inventory: PathBuf,
        probe_ca: &Path,
        token: &str,
        extra_args: &[&str],
    ) -> Standalone {
        let log = dir.join("operator.log");
        let log_file = std::fs::File::create(&log).expect("create the operator log");
        let api_port = free_port();
        let gateway_port = free_port();
        let metrics_port = free_port();
        let mut command = Command::new(env!("CARGO_BIN_EXE_proxy-operator"));
        command.args(["standalone", "--inventory"]).arg(&inventory);
        // `ledger.db` in `dir`, unless the test shares a ledger among processes.
        if !extra_args.contains(&"--ledger") {
            command.arg("--ledger").arg(dir.join("ledger.db"));
        }
        let child = command
            .arg("--probe-ca-file")
            .arg(probe_ca)
            .args(["--discovery-addr", &format!("127.0.0.1:{api_port}")])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            .args(["--gateway-addr", &format!("127.0.0.1:{gateway_port}")])
            .args(extra_args)
            .env("DISCOVERY_TOKEN", token)
            // See `crawl_load::Operator::start`: a loaded test machine may open a PostgreSQL
            // connection more slowly than the default 2 s.
            .env("PGCONNECT_TIMEOUT", "10")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("start proxy-operator standalone");
        Standalone {
            child,
            api: format!("http://127.0.0.1:{api_port}"),
            gateway: format!("127.0.0.1:{gateway_port}"),
            metrics: format!("http://127.0.0.1:{metrics_port}/metrics"),
            log,
            inventory,
        }
    }

    /// Rewrites the inventory file with `proxies`, as a deployment tool would: a new file
    /// renamed over the old one, so the binary, which picks the change up at its next
    /// `--inventory-poll`, never reads a half-written file.
    pub fn rewrite_inventory(&self, proxies: &[ExternalProxy]) {
        let yaml: String = proxies.iter().map(ExternalProxy::to_yaml).collect();
        let next = self.inventory.with_extension("yaml.next");
        std::fs::write(&next, yaml).expect("write the new inventory");
        std::fs::rename(&next, &self.inventory).expect("replace the inventory");
    }

    /// `http://127.0.0.1:<port>`, the API's base URL.
    pub fn api(&self) -> &str {
        &self.api
    }

    /// `127.0.0.1:<port>`, the gateway's address.
    pub fn gateway(&self) -> &str {
        &self.gateway
    }

    /// The metrics endpoint's URL.
    pub fn metrics_url(&self) -> &str {
        &self.metrics
    }

    /// `127.0.0.1:<port>` of the metrics endpoint, as a Prometheus scrape target.
    pub fn metrics_address(&self) -> &str {
        self.metrics
            .trim_start_matches("http://")
            .trim_end_matches("/metrics")
    }

    /// The ledger file (`ledger.db` in the directory it was started in).
    pub fn ledger(&self) -> PathBuf {
        self.inventory.with_file_name("ledger.db")
    }

    /// Polls `GET /v1/proxies?healthy=true` until at least `count` proxies are healthy,
    /// panicking after `deadline` (or when the process has exited) with the log.
    pub async fn wait_healthy(&mut self, token: &str, count: usize, deadline: Duration) {
        let client = super::http::client();
        let url = format!("{}/v1/proxies?healthy=true", self.api);
        let start = Instant::now();
        let mut last: String;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("proxy-operator exited ({status}):\n{}", self.log());
            }
            match client.get(&url).bearer_auth(token).send().await {
                Ok(response) => {
                    let body: serde_json::Value = response.json().await.unwrap_or_default();
                    let healthy = body["count"].as_u64().unwrap_or(0);
                    if usize::try_from(healthy).is_ok_and(|n| n >= count) {
                        return;
                    }
                    last = format!("{healthy} healthy");
                }
                Err(e) => last = e.to_string(),
            }
            assert!(
                start.elapsed() < deadline,
                "fewer than {count} proxies healthy after {deadline:?} ({last}); log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The process ID.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills the process (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The process's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Standalone {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- proxy-operator log ---\n{}", self.log());
        }
    }
}
