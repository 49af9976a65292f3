//! Lease API throughput: acquire+release pairs per second over HTTP at 32 concurrent
//! keep-alive connections against 1,000 inventory proxies, with `GET /healthz` at the same
//! concurrency through the same client as the framework floor. Prints both, their ratio and
//! the acquire latency percentiles.
//!
//! Run with `cargo bench --bench api` (the server, its ledger and the client share the machine).

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use proxy_operator::api::{self, ApiState, ApiToken, ProxyListCache};
use proxy_operator::health::{HealthSnapshot, ProxyHealth};
use proxy_operator::inventory::Inventory;
use proxy_operator::ledger::{Clock, Ledger, LedgerConfig, SystemClock};
use proxy_operator::metrics::LeaseMetrics;
use proxy_operator::proxy::{Proxy, ProxySpec};

const CONCURRENCY: usize = 32;
const PROXIES: usize = 1_000;
const RUN: Duration = Duration::from_secs(8);
const TOKEN: &str = "bench";

fn inventory() -> (Inventory, HealthSnapshot) {
    let inventory = Inventory::new();
    let health = HealthSnapshot::new();
    let proxies: Vec<Proxy> = (0..PROXIES)
        .map(|i| {
            let spec: ProxySpec = serde_json::from_value(serde_json::json!({
                "mode": "External",
                "endpoint": {"host": "127.0.0.1", "port": 10_000 + i},
                "maxLeases": 5,
            }))
            .expect("valid spec");
            let mut p = Proxy::new(&format!("p{i:04}"), spec);
            p.metadata.labels = Some(BTreeMap::from([("pool".to_owned(), "bench".to_owned())]));
            health.set(
                p.id(),
                ProxyHealth {
                    healthy: Some(true),
                    latency: Some(Duration::from_millis(5 + (i % 50) as u64)),
                    ..Default::default()
                },
            );
            p
        })
        .collect();
    inventory.replace(proxies);
    (inventory, health)
}

/// Runs `CONCURRENCY` loops of `op` for [`RUN`]; returns completed operations and latencies.
async fn load<F, Fut>(op: F) -> (usize, Vec<Duration>)
where
    F: Fn(reqwest::Client) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Duration> + Send,
{
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(CONCURRENCY)
        .build()
        .expect("client");
    let deadline = Instant::now() + RUN;
    let mut tasks = Vec::new();
    for _ in 0..CONCURRENCY {
        let (client, op) = (client.clone(), op.clone());
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            while Instant::now() < deadline {
                latencies.push(op(client.clone()).await);
            }
            latencies
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.expect("load task"));
    }
    (all.len(), all)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(index).copied().unwrap_or_default()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let dir = tempfile::tempdir().expect("temp dir");
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let ledger = Ledger::open(
        &dir.path().join("ledger.db"),
        LedgerConfig::default(),
        clock.clone(),
    )
    .expect("ledger");
    let (inventory, health) = inventory();
    let state = ApiState {
        inventory,
        health,
        ledger,
        clock,
        metrics: LeaseMetrics::register(&prometheus::Registry::new()).expect("metrics"),
        default_ttl: Duration::from_secs(300),
        proxy_list: ProxyListCache::default(),
    };
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let server = api::serve(listener, state, ApiToken::new(TOKEN)).expect("server");
    let handle = server.handle();
    tokio::spawn(server);

    let healthz_url = format!("{base}/healthz");
    let (healthz, _) = load(move |client| {
        let url = healthz_url.clone();
        async move {
            let started = Instant::now();
            let response = client.get(&url).send().await.expect("healthz");
            assert!(response.status().is_success());
            started.elapsed()
        }
    })
    .await;

    let leases_url = format!("{base}/v1/leases");
    let (pairs, mut acquire_latencies) = load(move |client| {
        let url = leases_url.clone();
        async move {
            let started = Instant::now();
            let response = client
                .post(&url)
                .bearer_auth(TOKEN)
                .json(&serde_json::json!({"selector": {"pool": "bench"}, "ttlSeconds": 60}))
                .send()
                .await
                .expect("acquire");
            assert_eq!(response.status(), reqwest::StatusCode::CREATED);
            let lease: serde_json::Value = response.json().await.expect("lease body");
            let latency = started.elapsed();
            let id = lease["leaseID"].as_str().expect("lease id").to_owned();
            let released = client
                .delete(format!("{url}/{id}"))
                .bearer_auth(TOKEN)
                .send()
                .await
                .expect("release");
            assert_eq!(released.status(), reqwest::StatusCode::NO_CONTENT);
            latency
        }
    })
    .await;
    handle.stop(true).await;

    acquire_latencies.sort();
    let seconds = RUN.as_secs_f64();
    let pairs_per_s = pairs as f64 / seconds;
    let healthz_per_s = healthz as f64 / seconds;
    println!("concurrency {CONCURRENCY}, {PROXIES} proxies, {seconds:.0} s per run");
    println!("GET /healthz:            {healthz_per_s:>9.0} req/s");
    println!("acquire+release pairs:   {pairs_per_s:>9.0} pairs/s");
    println!(
        "ratio pairs/healthz:     {:>9.3} (target >= 0.3)",
        pairs_per_s / healthz_per_s
    );
    println!(
        "acquire latency p50 {:.2} ms, p99 {:.2} ms (target p99 < 10 ms)",
        percentile(&acquire_latencies, 0.50).as_secs_f64() * 1000.0,
        percentile(&acquire_latencies, 0.99).as_secs_f64() * 1000.0
    );
}
