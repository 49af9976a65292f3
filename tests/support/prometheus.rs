//! A real Prometheus server (Debian package `prometheus`, installed by `.ci/run`) on a free
//! loopback port, scraping its jobs and evaluating one rule file every second, with its
//! config, TSDB and log in a temp dir. Killed on drop, and by the kernel if the test process
//! dies first (spawned through [`spawn_tied`]); its log is printed when the test is failing.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tempfile::TempDir;

use super::envtest::spawn_tied;
use super::free_port;

/// `name` (`promtool`, `prometheus`, both from Debian's `prometheus`) when it runs; see
/// [`required_tool`](super::required_tool).
pub fn tool(name: &'static str) -> Option<&'static str> {
    super::required_tool(name, &["--version"], "apt-get install prometheus")
}

/// One scrape job of one target.
#[derive(Debug, Clone)]
pub struct ScrapeJob {
    /// `job_name`.
    pub name: String,
    /// `host:port`, scraped at `/metrics`.
    pub target: String,
    /// The target's own labels, as service discovery gives them (a ServiceMonitor's target
    /// has `namespace`, `service`, `endpoint`, ...).
    pub labels: BTreeMap<String, String>,
    /// `honor_labels`: a series' own label wins over the target's of the same name, which is
    /// otherwise kept and the series' renamed `exported_<name>`.
    pub honor_labels: bool,
}

impl ScrapeJob {
    /// `target` as job `name`, with no target labels.
    pub fn plain(name: &str, target: &str) -> ScrapeJob {
        ScrapeJob {
            name: name.to_owned(),
            target: target.to_owned(),
            labels: BTreeMap::new(),
            honor_labels: false,
        }
    }

    fn config(&self) -> Value {
        json!({
            "job_name": self.name,
            "honor_labels": self.honor_labels,
            "static_configs": [{"targets": [self.target], "labels": self.labels}],
        })
    }
}

/// A running Prometheus.
pub struct Prometheus {
    child: Child,
    dir: TempDir,
    base: String,
    http: reqwest::Client,
}

impl Prometheus {
    /// Starts Prometheus scraping `target` (`host:port`, at `/metrics`) as job `job`, with
    /// `rules` (a rule file, YAML or JSON) loaded, and waits until it is ready. `None` when
    /// the binary is missing outside CI.
    pub async fn start(target: &str, job: &str, rules: &str) -> Option<Prometheus> {
        Prometheus::start_jobs(&[ScrapeJob::plain(job, target)], rules).await
    }

    /// Starts Prometheus scraping `jobs` with `rules` loaded, as [`Prometheus::start`] does.
    pub async fn start_jobs(jobs: &[ScrapeJob], rules: &str) -> Option<Prometheus> {
        let binary = tool("prometheus")?;
        let mut dir = tempfile::Builder::new()
            .prefix("prometheus-")
            .tempdir()
            .expect("create a temp dir for Prometheus");
        std::fs::write(dir.path().join("rules.yaml"), rules).expect("write the rule file");
        // JSON is YAML: no quoting to get wrong.
        let config = json!({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": ["rules.yaml"],
            "scrape_configs": jobs.iter().map(ScrapeJob::config).collect::<Vec<_>>(),
        });
        std::fs::write(dir.path().join("prometheus.yml"), config.to_string())
            .expect("write prometheus.yml");
        let mut last_log = String::new();
        // A port found free can be taken before Prometheus binds it: retry on another.
        for _ in 0..3 {
            let port = free_port();
            let child = spawn(binary, dir.path(), port);
            let mut started = Prometheus {
                child,
                dir,
                base: format!("http://127.0.0.1:{port}"),
                http: super::http::client(),
            };
            if started.ready().await {
                return Some(started);
            }
            let _ = started.child.kill();
            let _ = started.child.wait();
            let log = started.log();
            assert!(
                log.contains("address already in use"),
                "Prometheus did not start:\n{log}"
            );
            dir = started.into_dir();
            last_log = log;
        }
        panic!("Prometheus found no free port:\n{last_log}");
    }

    /// Polls `/-/ready` until 200 (true) or the process exits (false).
    async fn ready(&mut self) -> bool {
        let url = format!("{}/-/ready", self.base);
        let start = Instant::now();
        loop {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            if let Ok(response) = self.http.get(&url).send().await
                && response.status().is_success()
            {
                return true;
            }
            assert!(
                start.elapsed() < 2 * super::DEADLINE,
                "Prometheus not ready after {:?}:\n{}",
                2 * super::DEADLINE,
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `data` of a GET of the HTTP API's `path` (e.g. `/api/v1/alerts`) with `query`.
    pub async fn api(&self, path: &str, query: &[(&str, &str)]) -> Value {
        let url = url::Url::parse_with_params(&format!("{}{path}", self.base), query)
            .expect("a valid Prometheus API URL");
        let response = self
            .http
            .get(url)
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}\n{}", self.log()));
        let body: Value = response
            .json()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: not JSON: {e}"));
        assert_eq!(body["status"], "success", "GET {path}: {body}");
        body["data"].clone()
    }

    /// The alerts pending or firing now (resolved ones are not listed).
    pub async fn alerts(&self) -> Vec<Value> {
        let data = self.api("/api/v1/alerts", &[]).await;
        data["alerts"].as_array().cloned().unwrap_or_default()
    }

    /// The rule named `name` as the rule manager last evaluated it (`state`,
    /// `lastEvaluation`, `health`, ...).
    pub async fn rule(&self, name: &str) -> Value {
        let data = self.api("/api/v1/rules", &[]).await;
        data["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|group| group["rules"].as_array().cloned().unwrap_or_default())
            .find(|rule| rule["name"] == name)
            .unwrap_or_else(|| panic!("no rule {name} loaded: {data}"))
    }

    /// The series an instant query of `promql` returns, or the error Prometheus refused it
    /// with (a query that does not parse, say), for checks that must name the query.
    pub async fn try_query(&self, promql: &str) -> Result<Vec<Value>, String> {
        let url = url::Url::parse_with_params(
            &format!("{}/api/v1/query", self.base),
            [("query", promql)],
        )
        .expect("a valid Prometheus API URL");
        let body: Value = self
            .http
            .get(url)
            .send()
            .await
            .map_err(|e| e.to_string())?
            .json()
            .await
            .map_err(|e| format!("not JSON: {e}"))?;
        if body["status"] != "success" {
            return Err(body.to_string());
        }
        Ok(body["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    /// The samples of an instant query: `(labels, timestamp in seconds, value)`.
    pub async fn query(&self, promql: &str) -> Vec<(Value, f64, f64)> {
        let data = self.api("/api/v1/query", &[("query", promql)]).await;
        data["result"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|sample| {
                let value = &sample["value"];
                (
                    sample["metric"].clone(),
                    value[0].as_f64().unwrap_or(f64::NAN),
                    value[1]
                        .as_str()
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(f64::NAN),
                )
            })
            .collect()
    }

    /// Polls `check` every 250 ms until it returns `Some`, panicking with `what`, the last
    /// `Err` it explained itself with and Prometheus' log after `deadline`.
    pub async fn eventually<T, F, Fut>(&self, what: &str, deadline: Duration, mut check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, String>>,
    {
        let start = Instant::now();
        loop {
            let last = match check().await {
                Ok(done) => return done,
                Err(last) => last,
            };
            assert!(
                start.elapsed() < deadline,
                "timed out after {deadline:?} waiting for {what}; last: {last}\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Prometheus' log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    fn into_dir(mut self) -> TempDir {
        let placeholder = tempfile::tempdir().expect("create a temp dir");
        std::mem::replace(&mut self.dir, placeholder)
    }
}

/// Starts `binary` on `port` with the config and TSDB in `dir`, logging to `prometheus.log`.
fn spawn(binary: &str, dir: &Path, port: u16) -> Child {
    let log = std::fs::File::create(dir.join("prometheus.log")).expect("create prometheus.log");
    let mut command = Command::new(binary);
    command
        .arg(format!(
            "--config.file={}",
            dir.join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    spawn_tied(command).unwrap_or_else(|e| panic!("start {binary}: {e}"))
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- Prometheus log ---\n{}", self.log());
        }
    }
}
