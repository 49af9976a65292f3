//! Scale check of standalone mode: the release binary with 10,000 External proxies (30 s probe
//! interval) spread over three real squids, probing a loopback HTTPS target. Once most proxies
//! are healthy it samples the process's resident memory and times `GET /v1/proxies` (the full
//! list and a healthy+selector query) back to back for a minute while scraping `/metrics` once a
//! second as Prometheus would, then times acquires over all 10,000 proxies (each followed by
//! its release) while probes keep changing health. Prints a table and exits non-zero when
//! resident memory reaches 160 MiB, the p99 of either list query reaches 50 ms, the p95 of
//! the scrapes reaches 50 ms or a page reaches 3 MiB, or the p99 of the acquires reaches 1 ms.
//!
//! Run with `cargo bench --bench scale` (everything shares the machine: the operator, the
//! squids, the target and this client). `PROXY_OPERATOR_BENCH_BINARY` points it at another
//! binary (e.g. one built from an older commit) to compare.

#[path = "../tests/support/mod.rs"]
mod support;

use std::fmt::Write as _;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde::Deserialize;
use support::{Squid, Target};

const PROXIES: usize = 10_000;
const SQUIDS: usize = 3;
/// Share of the fleet that must be healthy before measuring ("most": the first probes are
/// spread over one 30 s interval).
const HEALTHY_SHARE: f64 = 0.95;
/// Start-up (validating 10,000 documents) plus one probe interval, with room for a loaded
/// machine.
const WARM_UP_DEADLINE: Duration = Duration::from_secs(240);
const MEASURE: Duration = Duration::from_secs(60);
/// Acquire+release pairs timed one after the other over the whole fleet.
const ACQUIRES: usize = 1_000;
const ACQUIRE_P99_LIMIT: Duration = Duration::from_millis(1);
const RSS_SAMPLE_EVERY: Duration = Duration::from_millis(200);
const RSS_LIMIT_KIB: u64 = 160 * 1024;
const LIST_P99_LIMIT: Duration = Duration::from_millis(50);
/// How often `/metrics` is scraped while the lists are timed (a common Prometheus interval
/// is 15 s; once a second puts 15 times the load on it).
const SCRAPE_EVERY: Duration = Duration::from_secs(1);
const SCRAPE_P95_LIMIT: Duration = Duration::from_millis(50);
const SCRAPE_SIZE_LIMIT: usize = 3 * 1024 * 1024;
const TOKEN: &str = "scale-token-0123456789abcdef";
/// The filtered query: healthy proxies of one geo and one shard (1/30 of the fleet).
const FILTERED: &str = "/v1/proxies?healthy=true&selector=geo=eu,shard=s3";
const GEOS: [&str; 3] = ["eu", "us", "ap"];
const SHARDS: usize = 10;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// The inventory: proxy `i` points at squid `i % SQUIDS` and carries `pool`, `geo` and
/// `shard` labels.
fn inventory(squid_ports: &[u16], probe_url: &str) -> String {
    let mut yaml = String::with_capacity(PROXIES * 400);
    for i in 0..PROXIES {
        let port = squid_ports[i % squid_ports.len()];
        let geo = GEOS[i % GEOS.len()];
        let shard = i % SHARDS;
        write!(
            yaml,
            "apiVersion: crawl.example.com/v1alpha1
kind: Proxy
metadata:
  name: px-{i:05}
  labels: {{pool: scale, geo: {geo}, shard: s{shard}}}
spec:
  mode: External
  endpoint: {{host: 127.0.0.1, port: {port}}}
  maxLeases: 5
  healthCheck:
    probeURL: {probe_url}
    interval: 30s
    timeout: 5s
---
"
        )
        .expect("writing to a String");
    }
    yaml
}

/// The running release binary, killed on drop.
struct Operator {
    child: Child,
    api: String,
    metrics: String,
}

impl Operator {
    fn start(dir: &Path, inventory: &Path, ca: &Path) -> Operator {
        let (api_port, metrics_port) = (free_port(), free_port());
        let log = std::fs::File::create(dir.join("operator.log")).expect("operator log");
        let binary = std::env::var_os("PROXY_OPERATOR_BENCH_BINARY")
            .filter(|b| !b.is_empty())
            .unwrap_or_else(|| env!("CARGO_BIN_EXE_proxy-operator").into());
        let child = Command::new(binary)
            .args(["standalone", "--inventory"])
            .arg(inventory)
            .arg("--ledger")
            .arg(dir.join("ledger.db"))
            .arg("--probe-ca-file")
            .arg(ca)
            .args(["--discovery-addr", &format!("127.0.0.1:{api_port}")])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            // The environment, not the flag: a baseline binary from before the gateway
            // ignores it.
            .env("PROXY_OPERATOR_GATEWAY_ADDR", "off")
            .env("DISCOVERY_TOKEN", TOKEN)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start the proxy-operator binary");
        Operator {
            child,
            api: format!("http://127.0.0.1:{api_port}"),
            metrics: format!("http://127.0.0.1:{metrics_port}/metrics"),
        }
    }

    /// `VmRSS` and `VmHWM` (peak resident set since start) of the process, in KiB.
    fn memory_kib(pid: u32) -> Option<(u64, u64)> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        };
        Some((field("VmRSS:")?, field("VmHWM:")?))
    }

    fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Deserialize)]
struct Count {
    count: usize,
}

/// One timed request: the status, the time until the whole body arrived, the body.
async fn timed(request: reqwest::RequestBuilder) -> (StatusCode, Duration, Vec<u8>) {
    let start = Instant::now();
    let response = request.send().await.expect("request to the operator");
    let status = response.status();
    let body = response.bytes().await.expect("response body");
    let took = start.elapsed();
    (status, took, body.to_vec())
}

/// `count` of a `GET /v1/proxies` answer.
async fn list_count(http: &reqwest::Client, api: &str, path: &str) -> Option<usize> {
    let response = http
        .get(format!("{api}{path}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .ok()?;
    if response.status() != StatusCode::OK {
        return None;
    }
    serde_json::from_slice::<Count>(&response.bytes().await.ok()?)
        .ok()
        .map(|c| c.count)
}

/// Sum of `proxy_operator_probes_total` over every series.
async fn probes_total(http: &reqwest::Client, metrics: &str) -> f64 {
    let (status, _, body) = timed(http.get(metrics)).await;
    assert_eq!(status, StatusCode::OK, "metrics endpoint");
    let text = String::from_utf8_lossy(&body);
    text.lines()
        .filter(|l| l.starts_with("proxy_operator_probes_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Scrapes `/metrics` every [`SCRAPE_EVERY`] until `until`.
async fn scrape_metrics(http: reqwest::Client, metrics: String, until: Instant) -> Series {
    let mut scrapes = Series::new("GET /metrics (once a second)");
    scrapes.count = PROXIES;
    let mut ticker = tokio::time::interval(SCRAPE_EVERY);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        if Instant::now() >= until {
            return scrapes;
        }
        let (status, took, body) = timed(http.get(&metrics)).await;
        assert_eq!(status, StatusCode::OK, "metrics endpoint");
        scrapes.latencies.push(took);
        scrapes.bytes = scrapes.bytes.max(body.len());
    }
}

/// Nearest-rank percentile of sorted durations.
fn percentile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

/// Latencies of one query, and its answer's size.
struct Series {
    name: &'static str,
    latencies: Vec<Duration>,
    bytes: usize,
    count: usize,
}

impl Series {
    fn new(name: &'static str) -> Series {
        Series {
            name,
            latencies: Vec::new(),
            bytes: 0,
            count: 0,
        }
    }

    fn percentile(&self, q: f64) -> Duration {
        let mut sorted = self.latencies.clone();
        sorted.sort();
        percentile(&sorted, q)
    }

    fn row(&self) -> String {
        let mut sorted = self.latencies.clone();
        sorted.sort();
        format!(
            "{:<44} {:>6} {:>11} {:>11} {:>11} {:>11}   {} proxies, {:.1} KiB",
            self.name,
            sorted.len(),
            ms(percentile(&sorted, 0.50)),
            ms(percentile(&sorted, 0.95)),
            ms(percentile(&sorted, 0.99)),
            ms(sorted.last().copied().unwrap_or_default()),
            self.count,
            self.bytes as f64 / 1024.0,
        )
    }
}

/// What the run measured.
struct Report {
    peak_rss_kib: u64,
    hwm_kib: u64,
    rss_at_end_kib: u64,
    lists: [Series; 2],
    /// `/metrics` scraped during the list timing; `bytes` is the largest page.
    scrapes: Series,
    /// Acquires over the whole fleet and their releases (reported, no limit).
    leases: [Series; 2],
}

async fn run() -> Report {
    let dir = tempfile::tempdir().expect("temp dir");
    let target = Target::start();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, target.ca_cert_pem()).expect("write the CA");
    let squids: Vec<Squid> = (0..SQUIDS).map(|_| Squid::start()).collect();
    let ports: Vec<u16> = squids.iter().map(Squid::port).collect();
    let inventory_path = dir.path().join("inventory.yaml");
    let yaml = inventory(&ports, &target.https_url());
    std::fs::write(&inventory_path, &yaml).expect("write the inventory");
    println!(
        "inventory: {PROXIES} External proxies over squids on ports {ports:?}, {:.1} MiB of YAML",
        yaml.len() as f64 / (1024.0 * 1024.0)
    );

    let started = Instant::now();
    let mut operator = Operator::start(dir.path(), &inventory_path, &ca);
    let pid = operator.child.id();
    let http = reqwest::Client::new();

    // Resident memory is sampled from start-up on; the kernel's high-water mark covers the
    // moments between samples.
    let peak_rss = Arc::new(AtomicU64::new(0));
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let (peak_rss, sampling) = (peak_rss.clone(), sampling.clone());
        std::thread::spawn(move || {
            while sampling.load(Ordering::SeqCst) {
                if let Some((rss, _)) = Operator::memory_kib(pid) {
                    peak_rss.fetch_max(rss, Ordering::SeqCst);
                }
                std::thread::sleep(RSS_SAMPLE_EVERY);
            }
        })
    };

    let log = || std::fs::read_to_string(dir.path().join("operator.log")).unwrap_or_default();
    loop {
        let ready = http
            .get(format!("{}/readyz", operator.api))
            .send()
            .await
            .is_ok_and(|r| r.status() == StatusCode::OK);
        if ready {
            break;
        }
        assert!(!operator.exited(), "the operator exited:\n{}", log());
        assert!(
            started.elapsed() < WARM_UP_DEADLINE,
            "not ready after {WARM_UP_DEADLINE:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rss_now = || Operator::memory_kib(pid).map_or(0, |(rss, _)| rss);
    println!(
        "operator pid {pid} ready after {:.1} s, resident {}",
        started.elapsed().as_secs_f64(),
        mib(rss_now())
    );

    let wanted = (PROXIES as f64 * HEALTHY_SHARE).ceil() as usize;
    let mut last_report = Instant::now();
    loop {
        let healthy = list_count(&http, &operator.api, "/v1/proxies?healthy=true")
            .await
            .unwrap_or(0);
        if healthy >= wanted {
            println!(
                "{healthy} of {PROXIES} healthy after {:.1} s, resident {}",
                started.elapsed().as_secs_f64(),
                mib(rss_now())
            );
            break;
        }
        assert!(!operator.exited(), "the operator exited:\n{}", log());
        assert!(
            started.elapsed() < WARM_UP_DEADLINE,
            "only {healthy} of {PROXIES} healthy after {WARM_UP_DEADLINE:?}"
        );
        if last_report.elapsed() > Duration::from_secs(5) {
            println!("  {healthy} healthy...");
            last_report = Instant::now();
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }

    let probes_before = probes_total(&http, &operator.metrics).await;
    let measure_start = Instant::now();
    let scraper = tokio::spawn(scrape_metrics(
        http.clone(),
        operator.metrics.clone(),
        measure_start + MEASURE,
    ));
    let mut lists = [
        Series::new("GET /v1/proxies (full list)"),
        Series::new("GET /v1/proxies?healthy=true&selector=geo=eu,shard=s3"),
    ];
    let paths = ["/v1/proxies", FILTERED];
    let mut turn = 0;
    while measure_start.elapsed() < MEASURE {
        let series = &mut lists[turn % 2];
        let path = paths[turn % 2];
        let (status, took, body) = timed(
            http.get(format!("{}{path}", operator.api))
                .bearer_auth(TOKEN),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{path}");
        let count = serde_json::from_slice::<Count>(&body)
            .expect("a proxy list")
            .count;
        series.latencies.push(took);
        series.bytes = body.len();
        series.count = count;
        turn += 1;
    }
    let measured = measure_start.elapsed();
    assert_eq!(lists[0].count, PROXIES, "the full list lists every proxy");
    let probes_after = probes_total(&http, &operator.metrics).await;
    let scrapes = scraper.await.expect("the metrics scraper");

    let mut acquires = Series::new("POST /v1/leases (all 10,000 are candidates)");
    let mut releases = Series::new("DELETE /v1/leases/{id}");
    for _ in 0..ACQUIRES {
        let (status, took, lease) = timed(
            http.post(format!("{}/v1/leases", operator.api))
                .bearer_auth(TOKEN)
                .json(&serde_json::json!({
                    "selector": {"pool": "scale"},
                    "target": "example.com",
                    "ttlSeconds": 60
                })),
        )
        .await;
        assert_eq!(
            status,
            StatusCode::CREATED,
            "{}",
            String::from_utf8_lossy(&lease)
        );
        acquires.latencies.push(took);
        acquires.bytes = lease.len();
        acquires.count = PROXIES;
        let lease: serde_json::Value = serde_json::from_slice(&lease).expect("a lease");
        let lease_id = lease["leaseID"].as_str().expect("a lease ID");
        let (status, took, _) = timed(
            http.delete(format!("{}/v1/leases/{lease_id}", operator.api))
                .bearer_auth(TOKEN),
        )
        .await;
        assert_eq!(status, StatusCode::NO_CONTENT);
        releases.latencies.push(took);
        releases.count = 1;
    }

    sampling.store(false, Ordering::SeqCst);
    sampler.join().expect("RSS sampler");
    let (rss_at_end_kib, hwm_kib) =
        Operator::memory_kib(pid).expect("the operator is still running");
    assert!(!operator.exited(), "the operator exited:\n{}", log());

    println!();
    println!(
        "probes: {:.0}/s during the measurement ({PROXIES} proxies / 30 s = {:.0}/s due)",
        (probes_after - probes_before) / measured.as_secs_f64(),
        PROXIES as f64 / 30.0
    );
    Report {
        peak_rss_kib: peak_rss.load(Ordering::SeqCst),
        hwm_kib,
        rss_at_end_kib,
        lists,
        scrapes,
        leases: [acquires, releases],
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let report = run().await;
    println!();
    println!(
        "{:<44} {:>6} {:>11} {:>11} {:>11} {:>11}",
        "query", "n", "p50", "p95", "p99", "max"
    );
    for series in report
        .lists
        .iter()
        .chain([&report.scrapes])
        .chain(&report.leases)
    {
        println!("{}", series.row());
    }
    println!(
        "/metrics page: {} bytes ({:.2} MiB, limit {:.0} MiB)",
        report.scrapes.bytes,
        report.scrapes.bytes as f64 / (1024.0 * 1024.0),
        SCRAPE_SIZE_LIMIT as f64 / (1024.0 * 1024.0)
    );
    println!();
    println!(
        "resident memory: peak sampled {}, kernel high-water mark {}, at the end {} (limit {})",
        mib(report.peak_rss_kib),
        mib(report.hwm_kib),
        mib(report.rss_at_end_kib),
        mib(RSS_LIMIT_KIB)
    );

    let mut failed = false;
    let peak = report.peak_rss_kib.max(report.hwm_kib);
    if peak >= RSS_LIMIT_KIB {
        println!(
            "FAIL: resident memory {} >= {}",
            mib(peak),
            mib(RSS_LIMIT_KIB)
        );
        failed = true;
    }
    let limits = report
        .lists
        .iter()
        .map(|series| (series, 0.99, LIST_P99_LIMIT))
        .chain([
            (&report.scrapes, 0.95, SCRAPE_P95_LIMIT),
            (&report.leases[0], 0.99, ACQUIRE_P99_LIMIT),
        ]);
    for (series, q, limit) in limits {
        let took = series.percentile(q);
        if took >= limit {
            println!(
                "FAIL: {} p{:.0} {} >= {}",
                series.name,
                q * 100.0,
                ms(took),
                ms(limit)
            );
            failed = true;
        }
    }
    if report.scrapes.latencies.is_empty() || report.scrapes.bytes >= SCRAPE_SIZE_LIMIT {
        println!(
            "FAIL: {} scrapes, largest /metrics page {} bytes (limit {SCRAPE_SIZE_LIMIT})",
            report.scrapes.latencies.len(),
            report.scrapes.bytes
        );
        failed = true;
    }
    if failed {
        ExitCode::FAILURE
    } else {
        println!("PASS");
        ExitCode::SUCCESS
    }
}
