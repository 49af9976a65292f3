//! Crawl load on the real binary: `proxy-operator standalone` processes over one inventory of
//! External proxies in front of real squids, concurrent crawlers acquiring, swapping and
//! releasing leases, a record of what each crawler was answered, and the queries that check
//! the ledger against that record — with the `sqlite3` CLI or psql, as an engineer would.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::{Value, json};

use super::postgres::Database;
use super::{DEADLINE, Squid, free_port, sqlite3};

/// The `DISCOVERY_TOKEN` of every process.
pub const TOKEN: &str = "crawl-load-test-token-0123456789";
/// Proxies in the inventory, spread over the squids.
pub const PROXIES: usize = 8;
/// Each proxy's `maxLeases`.
pub const MAX_LEASES: u64 = 3;
/// The `pool` label every proxy of the inventory carries, and every crawler selects.
pub const POOL: &str = "load";
/// Upper bound of each crawler's requests, so a crawler stops by itself whatever happens.
pub const MAX_REQUESTS_PER_CRAWLER: usize = 5_000;
/// The TTL every crawler asks for: longer than any test, so no lease expires during one.
pub const TTL_SECONDS: u64 = 300;

/// [`PROXIES`] External proxies labelled `pool: load`, each with [`MAX_LEASES`], spread over
/// `squids`, probed through them at `probe_url` every 500 ms.
pub fn inventory(squids: &[Squid], probe_url: &str) -> String {
    (0..PROXIES)
        .map(|i| {
            format!(
                "apiVersion: crawl.example.com/v1alpha1
kind: Proxy
metadata:
  name: load-{i}
  labels: {{pool: {POOL}}}
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

/// A running `proxy-operator standalone` on free loopback ports; killed (SIGKILL) on drop.
pub struct Operator {
    child: Child,
    api: String,
    log: PathBuf,
}

impl Operator {
    /// Starts the binary on `inventory` with `--ledger ledger` (an SQLite path or a
    /// `postgres://` URL) and `extra_args`, appending its stderr to `log`. Not ready yet: wait
    /// with [`wait_all_healthy`].
    pub fn start(log: &Path, inventory: &Path, ledger: &str, extra_args: &[&str]) -> Operator {
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .expect("open the operator log");
        let api_port = free_port();
        let child = Command::new(env!("CARGO_BIN_EXE_proxy-operator"))
            .args(["standalone", "--inventory"])
            .arg(inventory)
            .args(["--ledger", ledger])
            .args(["--discovery-addr", &format!("127.0.0.1:{api_port}")])
            .args(["--metrics-addr", &format!("127.0.0.1:{}", free_port())])
            .args(["--gateway-addr", &format!("127.0.0.1:{}", free_port())])
            .args(extra_args)
            .env("DISCOVERY_TOKEN", TOKEN)
            // A PostgreSQL ledger's connections may take more than the default 2 s to open on
            // a loaded test machine; a replica that cannot open one at start stops.
            .env("PGCONNECT_TIMEOUT", "10")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("start proxy-operator standalone");
        Operator {
            child,
            api: format!("http://127.0.0.1:{api_port}"),
            log: log.to_owned(),
        }
    }

    /// `http://127.0.0.1:<port>`, the lease API's base URL.
    pub fn api(&self) -> &str {
        &self.api
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process has not exited.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Kills the process with SIGKILL and reaps it.
    pub fn kill_9(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Its log so far (every process started with this log file).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- proxy-operator log ({}) ---\n{}", self.api, self.log());
        }
    }
}

/// Polls `condition` every 50 ms until it holds, panicking with `what` after [`DEADLINE`].
pub async fn eventually<F, Fut>(what: &str, condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    eventually_within(DEADLINE, what, condition).await;
}

/// [`eventually`] with a deadline of its own, for conditions several processes must meet.
pub async fn eventually_within<F, Fut>(deadline: Duration, what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !condition().await {
        assert!(
            start.elapsed() < deadline,
            "timed out after {deadline:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The client of every crawler and check: `timeout` per request (a request not answered by
/// then counts as unanswered), enough idle connections for `crawlers` crawlers on one host.
/// Idle connections are dropped before the server closes them ([`super::http::POOL_IDLE`]).
pub fn http_client(crawlers: usize, timeout: Duration) -> reqwest::Client {
    super::http::builder()
        .timeout(timeout)
        .pool_max_idle_per_host(crawlers)
        .build()
        .unwrap()
}

/// An authenticated GET's status and JSON body; the error when it fails or the body is not
/// JSON. Asked again (for up to [`DEADLINE`]) when answered 408: the server did not read the
/// request within its client request timeout, as on a starved machine, so it did nothing.
pub async fn get_json(http: &reqwest::Client, url: &str) -> Result<(StatusCode, Value), String> {
    let start = Instant::now();
    loop {
        let response = http
            .get(url)
            .bearer_auth(TOKEN)
            .send()
            .await
            .map_err(|e| format!("GET {url}: {e:?}"))?;
        let status = response.status();
        if status != StatusCode::REQUEST_TIMEOUT || start.elapsed() > DEADLINE {
            let body = response
                .json()
                .await
                .map_err(|e| format!("GET {url}: {status}, body not JSON: {e}"))?;
            return Ok((status, body));
        }
    }
}

/// Polls until `operator` lists all [`PROXIES`] healthy, panicking with its log after
/// `deadline`.
pub async fn wait_all_healthy(http: &reqwest::Client, operator: &Operator, deadline: Duration) {
    let url = format!(
        "{}/v1/proxies?healthy=true&selector=pool={POOL}",
        operator.api()
    );
    let start = Instant::now();
    loop {
        let healthy = get_json(http, &url)
            .await
            .ok()
            .and_then(|(_, v)| v["count"].as_u64())
            .unwrap_or(0);
        if healthy == PROXIES as u64 {
            return;
        }
        assert!(
            start.elapsed() < deadline,
            "{healthy} of {PROXIES} proxies healthy on {} after {deadline:?}; operator log:\n{}",
            operator.api(),
            operator.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What the crawlers were told, as they were told it.
#[derive(Debug, Default, Clone)]
pub struct Acknowledged {
    /// Leases answered 201.
    pub granted: Vec<String>,
    /// Leases whose release was answered 204.
    pub released: Vec<String>,
    /// Answers that are neither a grant, a release, nor a refusal the API documents.
    pub unexpected: Vec<String>,
    /// Acquires answered 409 or 503.
    pub refused: usize,
    /// 503 answers (acquires and releases) by their `error` code.
    pub unavailable: BTreeMap<String, usize>,
    /// 503 answers without a `Retry-After` of at least one second.
    pub unavailable_without_retry_after: Vec<String>,
    /// Requests that got no answer (a connection refused or cut, a body cut short): the
    /// crawler stopped there.
    pub unanswered: Vec<String>,
    /// Requests the server did not read within its client request timeout (408: nothing was
    /// done) that the crawler went on after ([`Retries::UnansweredWrites`]).
    pub request_timeouts: usize,
}

impl Acknowledged {
    /// 503 answers in all.
    pub fn unavailable_total(&self) -> usize {
        self.unavailable.values().sum()
    }

    /// The leases whose release was answered 204.
    pub fn released_set(&self) -> HashSet<&String> {
        self.released.iter().collect()
    }
}

/// What a crawler does after a write that did nothing: a 503, or a 408 (the server did not
/// read the request within its client request timeout, as on a starved machine).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retries {
    /// A lease whose release was answered 503 is left to its TTL; a 408 is an answer the
    /// crawler does not expect.
    Never,
    /// A lease whose release was answered 503 or 408 is released again after the next
    /// acquire, until a release is answered 204; an acquire answered 408 is given up like a
    /// refused one, and the crawler goes on.
    UnansweredWrites,
}

/// Records a 503: its code, and whether it carried a usable `Retry-After`.
fn record_unavailable(
    acknowledged: &Mutex<Acknowledged>,
    what: &str,
    retry_after: Option<&reqwest::header::HeaderValue>,
    body: &Value,
) {
    let code = body["error"].as_str().unwrap_or("(no code)").to_owned();
    let retry_after = retry_after
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let mut acknowledged = acknowledged.lock().unwrap();
    if retry_after.is_none_or(|seconds| seconds < 1) {
        acknowledged
            .unavailable_without_retry_after
            .push(format!("{what}: {retry_after:?} {body}"));
    }
    *acknowledged.unavailable.entry(code).or_default() += 1;
}

/// One crawler: acquires, keeps at most one lease (releasing the one it held when it gets a
/// new one, or when nothing is free so others can go on), until `stop`, an unanswered
/// request (the process died), an answer it does not expect, or [`MAX_REQUESTS_PER_CRAWLER`]
/// acquires.
pub async fn crawler(
    http: reqwest::Client,
    api: String,
    acknowledged: Arc<Mutex<Acknowledged>>,
    stop: Arc<AtomicBool>,
    retries: Retries,
) {
    let retrying = retries == Retries::UnansweredWrites;
    let unanswered = |what: String| acknowledged.lock().unwrap().unanswered.push(what);
    let unexpected = |what: String| acknowledged.lock().unwrap().unexpected.push(what);
    let mut held: Option<String> = None;
    let mut to_release: Vec<String> = Vec::new();
    for _ in 0..MAX_REQUESTS_PER_CRAWLER {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let answer = http
            .post(format!("{api}/v1/leases"))
            .bearer_auth(TOKEN)
            .json(&json!({"selector": {"pool": POOL}, "ttlSeconds": TTL_SECONDS}))
            .send()
            .await;
        let response = match answer {
            Ok(response) => response,
            Err(e) => return unanswered(format!("acquire: {e}")),
        };
        let status = response.status();
        if status == StatusCode::REQUEST_TIMEOUT && retrying {
            acknowledged.lock().unwrap().request_timeouts += 1;
            to_release.extend(held.take());
        } else {
            let retry_after = response
                .headers()
                .get(reqwest::header::RETRY_AFTER)
                .cloned();
            let body = match response.json::<Value>().await {
                Ok(body) => body,
                Err(e) => return unanswered(format!("acquire {status}: {e}")),
            };
            match status {
                StatusCode::CREATED => {
                    let Some(id) = body["leaseID"].as_str() else {
                        return unexpected(body.to_string());
                    };
                    acknowledged.lock().unwrap().granted.push(id.to_owned());
                    to_release.extend(held.replace(id.to_owned()));
                }
                StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE => {
                    acknowledged.lock().unwrap().refused += 1;
                    if status == StatusCode::SERVICE_UNAVAILABLE {
                        record_unavailable(&acknowledged, "acquire", retry_after.as_ref(), &body);
                    }
                    to_release.extend(held.take());
                }
                other => return unexpected(format!("{other}: {body}")),
            }
        }
        let mut not_released = Vec::new();
        for id in to_release.drain(..) {
            let response = match http
                .delete(format!("{api}/v1/leases/{id}"))
                .bearer_auth(TOKEN)
                .send()
                .await
            {
                Ok(response) => response,
                Err(e) => return unanswered(format!("release: {e}")),
            };
            match response.status() {
                StatusCode::NO_CONTENT => acknowledged.lock().unwrap().released.push(id),
                // Not acknowledged: the lease may or may not be released.
                StatusCode::SERVICE_UNAVAILABLE => {
                    let retry_after = response
                        .headers()
                        .get(reqwest::header::RETRY_AFTER)
                        .cloned();
                    let body = response.json::<Value>().await.unwrap_or_default();
                    record_unavailable(&acknowledged, "release", retry_after.as_ref(), &body);
                    if retrying {
                        not_released.push(id);
                    }
                }
                // Not read by the server: nothing was done.
                StatusCode::REQUEST_TIMEOUT if retrying => {
                    acknowledged.lock().unwrap().request_timeouts += 1;
                    not_released.push(id);
                }
                other => return unexpected(format!("release {other}")),
            }
        }
        to_release = not_released;
    }
}

/// The crawlers' load: `count` [`crawler`]s, crawler `i` on `apis[i % apis.len()]` and
/// recording into `acknowledged[i % apis.len()]`, each stopping at its API's flag in `stops`.
pub fn spawn_crawlers(
    http: &reqwest::Client,
    count: usize,
    apis: &[String],
    acknowledged: &[Arc<Mutex<Acknowledged>>],
    stops: &[Arc<AtomicBool>],
    retries: Retries,
) -> Vec<Vec<tokio::task::JoinHandle<()>>> {
    let mut handles: Vec<Vec<_>> = apis.iter().map(|_| Vec::new()).collect();
    for i in 0..count {
        let at = i % apis.len();
        handles[at].push(tokio::spawn(crawler(
            http.clone(),
            apis[at].clone(),
            acknowledged[at].clone(),
            stops[at].clone(),
            retries,
        )));
    }
    handles
}

/// Where a test reads the ledger, with the tool an engineer would use.
#[derive(Debug, Clone, Copy)]
pub enum LedgerDb<'a> {
    /// An SQLite file, read with the `sqlite3` CLI.
    Sqlite(&'a Path),
    /// A PostgreSQL database, read with psql.
    Postgres(&'a Database),
}

impl LedgerDb<'_> {
    /// `sql`'s trimmed output, a row a line, columns separated by `|`.
    pub fn query(&self, sql: &str) -> String {
        match self {
            LedgerDb::Sqlite(path) => sqlite3(path, sql),
            LedgerDb::Postgres(database) => database.psql(sql),
        }
    }

    /// How a failure message names it.
    pub fn name(&self) -> &'static str {
        match self {
            LedgerDb::Sqlite(_) => "the file",
            LedgerDb::Postgres(_) => "the database",
        }
    }

    /// Every lease row's state, by lease ID.
    pub fn lease_states(&self) -> HashMap<String, String> {
        self.query("SELECT id, state FROM leases")
            .lines()
            .filter_map(|l| l.split_once('|'))
            .map(|(id, state)| (id.to_owned(), state.to_owned()))
            .collect()
    }

    /// Active leases per proxy (`namespace/name`) now, from the `active_leases_per_proxy`
    /// view; proxies without any are absent.
    pub fn active_per_proxy(&self) -> BTreeMap<String, u64> {
        self.query("SELECT proxy, leases FROM active_leases_per_proxy ORDER BY proxy")
            .lines()
            .filter_map(|l| l.split_once('|'))
            .map(|(proxy, n)| (proxy.to_owned(), n.parse().unwrap_or(u64::MAX)))
            .collect()
    }

    /// The largest number of leases any proxy held at the moment of any grant, from the
    /// history: at each `acquired` event, the leases of that proxy acquired up to it (in
    /// decision order), not yet expired at its time and not released before it.
    ///
    /// `seq` is decision order on PostgreSQL too, where it is drawn at insert rather than at
    /// commit: acquires of one proxy hold its `proxy_locks` row from their check to their
    /// commit, so they draw their `seq` one after another; and a release an acquire saw
    /// committed drew its `seq` before that commit, so before the acquire drew its own.
    pub fn most_held_at_any_grant(&self) -> (String, u64) {
        let row = self.query(
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
}

/// Asserts that every lease in `granted` is in `in_db` (lease ID → state) in the state the
/// crawlers were told: released when its release was answered 204 (`released`); active, or
/// released by a release the crawler was not answered for, otherwise.
pub fn assert_recorded(
    context: &str,
    db_name: &str,
    granted: &[String],
    released: &HashSet<&String>,
    in_db: &HashMap<String, String>,
) {
    for id in granted {
        let state = in_db.get(id).map(String::as_str);
        let expected = if released.contains(id) {
            "released"
        } else {
            "active"
        };
        // A release the crawler was not answered for may or may not have been recorded.
        assert!(
            state == Some(expected) || (expected == "active" && state == Some("released")),
            "{context}: lease {id} acknowledged ({expected}) but {db_name} says {state:?}"
        );
    }
}

/// Asserts that `api` serves every lease in `granted` (200), as released when its release
/// was answered 204.
pub async fn assert_served(
    http: &reqwest::Client,
    api: &str,
    context: &str,
    granted: &[String],
    released: &HashSet<&String>,
) {
    let answers: Vec<_> = futures::stream::iter(granted)
        .map(|id| async move {
            let answer = get_json(http, &format!("{api}/v1/leases/{id}")).await;
            (id, answer)
        })
        .buffer_unordered(8)
        .collect()
        .await;
    for (id, answer) in answers {
        let (status, lease) = answer.unwrap_or_else(|e| panic!("{context}: {e}"));
        assert_eq!(
            status,
            StatusCode::OK,
            "{context}: lease {id} on {api}: {lease}"
        );
        if released.contains(id) {
            assert_eq!(lease["state"], "released", "{context}: {api}: {lease}");
        }
    }
}

/// Active leases per proxy (`default/<name>`) as `api` lists them; proxies without any are
/// absent.
pub async fn listed_active(http: &reqwest::Client, api: &str) -> BTreeMap<String, u64> {
    let (_, list) = get_json(http, &format!("{api}/v1/proxies?selector=pool={POOL}"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    list["proxies"]
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
        .collect()
}
