//! Acknowledged leases survive `kill -9` of the real binary under load: `proxy-operator
//! standalone` over real squids, 32 concurrent crawlers acquiring, swapping and releasing
//! leases, the process killed with SIGKILL mid-load, restarted on the same ledger file — five
//! times. After each restart every lease a crawler was answered 201 for is in the ledger (by
//! the API and by the `sqlite3` CLI), every release answered 204 is released, and no proxy
//! ever held more leases than its `maxLeases`, neither at any grant in the history nor now.

use crate::support;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};
use support::{DEADLINE, Squid, Target, free_port, sqlite3};

const TOKEN: &str = "durability-test-token-0123456789";
const RUNS: usize = 5;
const CRAWLERS: usize = 32;
const PROXIES: usize = 8;
const MAX_LEASES: u64 = 3;
/// Grants before the kill, growing per run so the kill lands at different moments.
const GRANTS_BEFORE_KILL: usize = 120;
/// Upper bound of each crawler's requests, so a crawler stops by itself whatever happens.
const MAX_REQUESTS_PER_CRAWLER: usize = 5_000;

fn inventory(squids: &[Squid], probe_url: &str) -> String {
    (0..PROXIES)
        .map(|i| {
            format!(
                "apiVersion: crawl.example.com/v1alpha1
kind: Proxy
metadata:
  name: durable-{i}
  labels: {{pool: durable}}
spec:
  mode: External
  endpoint: {{host: 127.0.0.1, port: {port}}}
  maxLeases: {MAX_LEASES}
  healthCheck:
    probeURL: {probe_url}
    interval: 500ms
    timeout: 500ms
---
",
                port = squids[i % squids.len()].port()
            )
        })
        .collect()
}

/// The running binary; killed (SIGKILL) on drop.
struct Operator {
    child: Child,
    api: String,
}

impl Operator {
    fn start(dir: &Path, inventory: &Path) -> Operator {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("operator.log"))
            .unwrap();
        let api_port = free_port();
        let child = Command::new(env!("CARGO_BIN_EXE_proxy-operator"))
            .args(["standalone", "--inventory"])
            .arg(inventory)
            .arg("--ledger")
            .arg(dir.join("ledger.db"))
            .args(["--discovery-addr", &format!("127.0.0.1:{api_port}")])
            .args(["--metrics-addr", &format!("127.0.0.1:{}", free_port())])
            .args(["--gateway-addr", &format!("127.0.0.1:{}", free_port())])
            .args(["--ledger-durability", "normal"])
            .env("DISCOVERY_TOKEN", TOKEN)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        Operator {
            child,
            api: format!("http://127.0.0.1:{api_port}"),
        }
    }

    fn kill_9(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn eventually<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !condition().await {
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn get_json(http: &reqwest::Client, url: &str) -> Option<(StatusCode, Value)> {
    let response = http.get(url).bearer_auth(TOKEN).send().await.ok()?;
    let status = response.status();
    Some((status, response.json().await.ok()?))
}

async fn wait_all_healthy(http: &reqwest::Client, api: &str, dir: &Path) {
    let url = format!("{api}/v1/proxies?healthy=true&selector=pool=durable");
    let start = Instant::now();
    loop {
        let healthy = get_json(http, &url)
            .await
            .and_then(|(_, v)| v["count"].as_u64())
            .unwrap_or(0);
        if healthy == PROXIES as u64 {
            return;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "{healthy} of {PROXIES} proxies healthy after {DEADLINE:?}; operator log:\n{}",
            std::fs::read_to_string(dir.join("operator.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What the crawlers were told, as they were told it.
#[derive(Default)]
struct Acknowledged {
    /// Leases answered 201.
    granted: Vec<String>,
    /// Leases whose release was answered 204.
    released: Vec<String>,
    /// Answers that are neither a grant, a release, nor a refusal the API documents.
    unexpected: Vec<String>,
    refused: usize,
}

/// One crawler: acquires, keeps at most one lease (releasing the one it held when it gets a
/// new one, or when nothing is free so others can go on), until `stop` or the process dies.
async fn crawler(
    http: reqwest::Client,
    api: String,
    acknowledged: Arc<Mutex<Acknowledged>>,
    stop: Arc<AtomicBool>,
) {
    let mut held: Option<String> = None;
    for _ in 0..MAX_REQUESTS_PER_CRAWLER {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let answer = http
            .post(format!("{api}/v1/leases"))
            .bearer_auth(TOKEN)
            .json(&json!({"selector": {"pool": "durable"}, "ttlSeconds": 300}))
            .send()
            .await;
        let Ok(response) = answer else { return };
        let status = response.status();
        let Ok(body) = response.json::<Value>().await else {
            return;
        };
        let give_back = match status {
            StatusCode::CREATED => {
                let Some(id) = body["leaseID"].as_str() else {
                    acknowledged
                        .lock()
                        .unwrap()
                        .unexpected
                        .push(body.to_string());
                    return;
                };
                acknowledged.lock().unwrap().granted.push(id.to_owned());
                held.replace(id.to_owned())
            }
            StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE => {
                acknowledged.lock().unwrap().refused += 1;
                held.take()
            }
            other => {
                acknowledged
                    .lock()
                    .unwrap()
                    .unexpected
                    .push(format!("{other}: {body}"));
                return;
            }
        };
        if let Some(id) = give_back {
            let Ok(response) = http
                .delete(format!("{api}/v1/leases/{id}"))
                .bearer_auth(TOKEN)
                .send()
                .await
            else {
                return;
            };
            match response.status() {
                StatusCode::NO_CONTENT => acknowledged.lock().unwrap().released.push(id),
                // Not acknowledged: the lease may or may not be released.
                StatusCode::SERVICE_UNAVAILABLE => {}
                other => {
                    acknowledged
                        .lock()
                        .unwrap()
                        .unexpected
                        .push(format!("release {other}"));
                    return;
                }
            }
        }
    }
}

/// The largest number of leases any proxy held at the moment of any grant, from the history:
/// at each `acquired` event, the leases of that proxy acquired up to it (in decision order),
/// not yet expired at its time and not released before it.
fn most_held_at_any_grant(db: &Path) -> (String, u64) {
    let row = sqlite3(
        db,
        "SELECT a.proxy_name, (
             SELECT count(*) FROM lease_events m
             WHERE m.kind = 'acquired' AND m.proxy_uid = a.proxy_uid AND m.seq <= a.seq
               AND m.expires_at > a.at
               AND NOT EXISTS (SELECT 1 FROM lease_events r WHERE r.lease_id = m.lease_id
                               AND r.kind = 'released' AND r.seq < a.seq)
         ) AS held
         FROM lease_events a WHERE a.kind = 'acquired' ORDER BY held DESC LIMIT 1;",
    );
    let (name, held) = row.split_once('|').unwrap_or(("", "0"));
    (name.to_owned(), held.parse().unwrap_or(0))
}

async fn one_run(run: usize, squids: &[Squid], probe_url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let inventory_path = dir.path().join("inventory.yaml");
    std::fs::write(&inventory_path, inventory(squids, probe_url)).unwrap();
    let db = dir.path().join("ledger.db");
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .pool_max_idle_per_host(CRAWLERS)
        .build()
        .unwrap();

    let mut operator = Operator::start(dir.path(), &inventory_path);
    wait_all_healthy(&http, &operator.api, dir.path()).await;

    let acknowledged = Arc::new(Mutex::new(Acknowledged::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let crawlers: Vec<_> = (0..CRAWLERS)
        .map(|_| {
            tokio::spawn(crawler(
                http.clone(),
                operator.api.clone(),
                acknowledged.clone(),
                stop.clone(),
            ))
        })
        .collect();
    let kill_after = GRANTS_BEFORE_KILL * (run + 1);
    eventually(&format!("{kill_after} grants"), || async {
        acknowledged.lock().unwrap().granted.len() >= kill_after
    })
    .await;
    operator.kill_9();
    stop.store(true, Ordering::Relaxed);
    for crawler in crawlers {
        crawler.await.unwrap();
    }
    let acknowledged = std::mem::take(&mut *acknowledged.lock().unwrap());
    assert!(
        acknowledged.unexpected.is_empty(),
        "run {run}: {:?}",
        acknowledged.unexpected
    );
    assert!(acknowledged.refused > 0, "run {run}: no contention at all");
    assert_eq!(sqlite3(&db, "PRAGMA integrity_check"), "ok", "run {run}");

    // Restart on the same file.
    drop(operator);
    let operator = Operator::start(dir.path(), &inventory_path);
    eventually("the restarted API", || async {
        http.get(format!("{}/readyz", operator.api))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
    })
    .await;

    // Every acknowledged lease is in the file, in the state the crawlers were told.
    let in_file: HashMap<String, String> = sqlite3(&db, "SELECT id, state FROM leases")
        .lines()
        .filter_map(|l| l.split_once('|'))
        .map(|(id, state)| (id.to_owned(), state.to_owned()))
        .collect();
    let released: std::collections::HashSet<&String> = acknowledged.released.iter().collect();
    for id in &acknowledged.granted {
        let state = in_file.get(id).map(String::as_str);
        let expected = if released.contains(id) {
            "released"
        } else {
            "active"
        };
        // A release the crawler was not answered for may or may not have been recorded.
        assert!(
            state == Some(expected) || (expected == "active" && state == Some("released")),
            "run {run}: lease {id} acknowledged ({expected}) but the file says {state:?}"
        );
    }
    // ... and the restarted API serves each of them.
    for id in &acknowledged.granted {
        let (status, lease) = get_json(&http, &format!("{}/v1/leases/{id}", operator.api))
            .await
            .unwrap_or_else(|| panic!("run {run}: GET lease {id} failed"));
        assert_eq!(status, StatusCode::OK, "run {run}: lease {id}: {lease}");
        if released.contains(id) {
            assert_eq!(lease["state"], "released", "run {run}: {lease}");
        }
    }

    // Capacity: never exceeded at any grant, and not now (file and API agree).
    let (proxy, most) = most_held_at_any_grant(&db);
    assert!(
        most <= MAX_LEASES,
        "run {run}: {proxy} held {most} leases, maxLeases is {MAX_LEASES}"
    );
    assert_eq!(most, MAX_LEASES, "run {run}: the load never filled a proxy");
    let per_proxy: BTreeMap<String, u64> = sqlite3(
        &db,
        "SELECT proxy, leases FROM active_leases_per_proxy ORDER BY proxy",
    )
    .lines()
    .filter_map(|l| l.split_once('|'))
    .map(|(proxy, n)| (proxy.to_owned(), n.parse().unwrap_or(u64::MAX)))
    .collect();
    assert!(
        per_proxy.values().all(|&n| n <= MAX_LEASES),
        "run {run}: {per_proxy:?}"
    );
    let (_, list) = get_json(
        &http,
        &format!("{}/v1/proxies?selector=pool=durable", operator.api),
    )
    .await
    .unwrap();
    let listed: BTreeMap<String, u64> = list["proxies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                format!("default/{}", p["name"].as_str().unwrap_or_default()),
                p["activeLeases"].as_u64().unwrap_or(u64::MAX),
            )
        })
        .filter(|(_, n)| *n > 0)
        .collect();
    assert_eq!(listed, per_proxy, "run {run}");
    eprintln!(
        "run {run}: {} granted ({} released, {} refused) before kill -9; all found after restart; \
         at most {most} leases per proxy at any grant, {} active now",
        acknowledged.granted.len(),
        acknowledged.released.len(),
        acknowledged.refused,
        per_proxy.values().sum::<u64>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_leases_survive_kill_9_under_load() {
    let target = Target::start();
    let probe_url = target.http_url();
    let squids = [Squid::start(), Squid::start()];
    for run in 0..RUNS {
        one_run(run, &squids, &probe_url).await;
    }
}
