//! The ledger's size bound against real SQLite files: a long run of lease cycles stays within
//! `max_size` (the database file plus its WAL) by pruning the oldest history, and a full
//! ledger — at its page limit, or on a full file system (a small tmpfs) — refuses the writes
//! of the batch with `LedgerError::Full` (the API's 503 `ledger_full`), keeps its memory equal
//! to the file, loses nothing acknowledged, and takes writes again by itself once there is
//! room. The API side runs a real actix server on loopback.

use crate::support;
use proxy_operator::ledger::DEFAULT_TENANT;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use actix_web::dev::ServerHandle;
use proxy_operator::api::ApiState;
use proxy_operator::api::LeaseMetrics;
use proxy_operator::health::{HealthSnapshot, ProxyHealth};
use proxy_operator::inventory::Inventory;
use proxy_operator::ledger::{
    AcquireOutcome, AcquireRequest, Candidates, Clock, Lease, LeaseReport, Ledger, LedgerConfig,
    LedgerError, ManualClock, ReportResult, RequestKey, SqliteLedger, SqliteLedgerCollector,
    SqliteOptions,
};
use proxy_operator::resources::proxy::{Proxy, ProxySpec};
use proxy_operator::serving::Fleet;
use reqwest::StatusCode;
use serde_json::{Value, json};
use support::ledger::{candidates, count, granted, request, start};
use support::skip::skip;
use support::{FileLock, queue, sqlite3, wait_until, wait_until_within};
use tempfile::TempDir;

const MIB: u64 = 1 << 20;
const MINUTE: Duration = Duration::from_secs(60);

/// Checkpoints the ledger's metrics count `by` the writer or in the background.
fn checkpoints(ledger: &SqliteLedger, by: &str) -> u64 {
    let collector = SqliteLedgerCollector::new(ledger.clone()).unwrap();
    prometheus::core::Collector::collect(&collector)
        .iter()
        .filter(|family| family.name() == "proxy_operator_ledger_checkpoint_seconds")
        .flat_map(|family| family.get_metric())
        .filter(|metric| metric.get_label().iter().any(|l| l.value() == by))
        .map(|metric| metric.get_histogram().get_sample_count())
        .sum()
}

fn full<T: std::fmt::Debug>(answer: Result<T, LedgerError>) -> Duration {
    match answer {
        Err(LedgerError::Full { retry_after }) => retry_after,
        other => panic!("expected the ledger to be full, got {other:?}"),
    }
}

/// Lease cycles (acquire, release, a new target each time so every cycle adds history and a
/// cooldown window) through the ledger handle, 64 callers at once so group commit batches, on
/// three ledgers at once (4, 8 and 16 MiB bounds, as a loaded machine runs them): the file
/// plus its WAL, sampled after every write, never exceed the bound; no prune step writes more
/// than half the WAL's allowance (a step takes half the room left in it); the oldest
/// history is pruned and the recent history kept; nothing is refused. The WAL was checkpointed
/// both in the background and by the writer (which starts it over).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_cycles_under_load_stay_within_4_8_and_16_mib_bounds_at_once() {
    let began = Instant::now();
    let runs = [(4, 50_000), (8, 80_000), (16, 160_000)]
        .map(|(mib, cycles)| tokio::spawn(cycles_within_bound(mib * MIB, cycles)));
    let mut report = Vec::new();
    for run in runs {
        report.push(run.await.unwrap());
    }
    eprintln!("three bounded ledgers at once in {:.1?}:", began.elapsed());
    for line in report {
        eprintln!("  {line}");
    }
}

/// Runs `cycles` lease cycles on a ledger bounded to `bound` bytes and checks what
/// [`lease_cycles_under_load_stay_within_4_8_and_16_mib_bounds_at_once`] promises; returns a
/// line saying how close it came.
async fn cycles_within_bound(bound: u64, cycles: u64) -> String {
    const CALLERS: usize = 64;
    /// Ledger time per cycle: 160,000 cycles span about 13 minutes.
    const TICK: Duration = Duration::from_millis(5);
    /// Cycles between sweeps: 10 s of ledger time, the production interval.
    const SWEEP_EVERY: u64 = 2_000;
    /// Bytes of a WAL frame: a 4 KiB page and its header.
    const FRAME: u64 = 4096 + 24;
    let began = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let clock = Arc::new(ManualClock::new(start()));
    let options = SqliteOptions {
        max_size: bound,
        ..SqliteOptions::default()
    };
    // Finished leases are kept for their cooldown window: a short one, so that history is
    // what a 4 MiB file is pruned of.
    let config = LedgerConfig {
        cooldown: Duration::from_secs(10),
        ..LedgerConfig::default()
    };
    let ledger = SqliteLedger::open(&path, options, config, clock.clone()).unwrap();
    let pool = candidates(8, 1_000);
    let next = Arc::new(AtomicU64::new(0));
    let largest = Arc::new(AtomicU64::new(0));
    let mut callers = tokio::task::JoinSet::new();
    for _ in 0..CALLERS {
        let (ledger, pool, next, largest, clock) = (
            ledger.clone(),
            pool.clone(),
            next.clone(),
            largest.clone(),
            clock.clone(),
        );
        callers.spawn(async move {
            loop {
                let cycle = next.fetch_add(1, Ordering::Relaxed);
                if cycle >= cycles {
                    return;
                }
                let target = format!("site-{}.example", cycle % 50);
                let lease = granted(ledger.acquire(request(pool.clone(), &target, MINUTE)).await);
                largest.fetch_max(ledger.disk_bytes(), Ordering::Relaxed);
                ledger.release(&lease.id, DEFAULT_TENANT).await.unwrap();
                largest.fetch_max(ledger.disk_bytes(), Ordering::Relaxed);
                clock.advance(TICK);
                if cycle % SWEEP_EVERY == 0 {
                    ledger.sweep().await.unwrap();
                }
            }
        });
    }
    while let Some(done) = callers.join_next().await {
        done.unwrap();
    }
    let elapsed = began.elapsed();
    let largest = largest.load(Ordering::Relaxed);
    let stats = ledger.writer_stats();
    let mib = bound / MIB;
    // A step's most: half the WAL's allowance, an eighth of the bound.
    let step_frames = bound / 8 / FRAME / 2;
    assert!(largest > 0);
    assert!(
        largest <= bound,
        "{mib} MiB: file + WAL reached {largest} bytes, over the bound"
    );
    assert_eq!(
        stats.full_batches, 0,
        "{mib} MiB: pruning kept up: {stats:?}"
    );
    assert!(
        stats.prune_steps > 0 && stats.pruned_events > 0,
        "{mib} MiB: {stats:?}"
    );
    assert!(
        stats.largest_prune_frames <= step_frames,
        "{mib} MiB: a prune step wrote {} WAL frames, over its {step_frames}: {stats:?}",
        stats.largest_prune_frames
    );
    // Finished leases kept for their cooldown window outgrow a 4 MiB file's history: they go
    // too, once it has run out; at 16 MiB the history suffices.
    assert!(
        mib < 16 || stats.pruned_leases == 0,
        "{mib} MiB: history sufficed: {stats:?}"
    );
    for by in ["background", "writer"] {
        assert!(
            checkpoints(&ledger, by) > 0,
            "{mib} MiB: no checkpoint by the {by}"
        );
    }
    assert_eq!(ledger.counts().active_total(), 0);
    ledger.self_check().await.unwrap();
    tokio::task::spawn_blocking(move || ledger.shutdown())
        .await
        .unwrap();

    // The oldest history is gone, the newest is all there: the last leases' rows, and a long
    // unbroken run of recent history (pruning stops at the low-water mark).
    let events = count(&path, "SELECT COUNT(*) FROM lease_events");
    if stats.pruned_leases == 0 {
        let first_kept = count(&path, "SELECT min(at) FROM lease_events");
        assert!(
            first_kept > start().as_millisecond(),
            "{mib} MiB: the first cycles' history is pruned"
        );
        let span = count(&path, "SELECT max(seq) - min(seq) + 1 FROM lease_events");
        assert_eq!(
            events, span,
            "{mib} MiB: history is pruned from its start only"
        );
        assert_eq!(
            count(&path, "SELECT max(seq) FROM lease_events"),
            2 * cycles as i64,
            "{mib} MiB: the newest row is kept"
        );
        let kept_at_least = i64::try_from(mib).unwrap() * 1_000;
        assert!(
            events >= kept_at_least && events < 2 * cycles as i64,
            "{mib} MiB: {events} history rows kept"
        );
    }
    format!(
        "{mib} MiB: {cycles} cycles in {elapsed:.1?}, largest file + WAL {largest} bytes \
         ({:.1} % under the bound), largest prune step {} of {step_frames} WAL frames, {} \
         steps, mean batch {:.1}; pruned {} history rows and {} finished leases, kept \
         {events} history rows",
        100.0 * (bound - largest) as f64 / bound as f64,
        stats.largest_prune_frames,
        stats.prune_steps,
        stats.mean_batch_size(),
        stats.pruned_events,
        stats.pruned_leases
    )
}

/// A tmpfs on a fresh directory, unmounted when dropped: a file system that really fills up.
struct Tmpfs {
    dir: TempDir,
}

impl Tmpfs {
    /// Mounts a tmpfs of `size` (mount(8) syntax). Mounting needs root; without it the test
    /// is skipped, unless `CI` is set (CI runs as root).
    fn mount(size: &str) -> Option<Tmpfs> {
        let dir = tempfile::tempdir().unwrap();
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .output();
        match mounted {
            Ok(output) if output.status.success() => Some(Tmpfs { dir }),
            Ok(output) => {
                skip(format!(
                    "cannot mount a tmpfs (the full-disk tests need root): mount {}: {}",
                    output.status,
                    String::from_utf8_lossy(&output.stderr).trim()
                ));
                None
            }
            Err(e) => {
                skip(format!(
                    "cannot mount a tmpfs (the full-disk tests need root): mount: {e}"
                ));
                None
            }
        }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Fills the file system with a filler file, then gives `leave` bytes back.
    fn fill(&self, leave: u64) -> PathBuf {
        use std::io::Write as _;
        let filler = self.path().join("filler");
        let mut file = std::fs::File::create(&filler).unwrap();
        let chunk = vec![0u8; 4096];
        loop {
            match file.write_all(&chunk) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::StorageFull => break,
                Err(e) => panic!("filling {}: {e}", filler.display()),
            }
        }
        let written = file.metadata().unwrap().len();
        file.set_len(written.saturating_sub(leave)).unwrap();
        filler
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // Lazy: whatever still has a file open there lets go when it closes it.
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

/// What the file holds of leases and cooldowns, row by row.
fn file_leases(path: &Path) -> Vec<(String, String, i64)> {
    let conn = rusqlite::Connection::open(path).unwrap();
    let mut statement = conn
        .prepare("SELECT id, state, expires_at FROM leases ORDER BY id")
        .unwrap();
    statement
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

/// A ledger that is full (at its page limit, or on a full disk), with `held`, a lease with a
/// request ID and a cooldown, granted before it filled.
struct Full {
    path: PathBuf,
    clock: Arc<ManualClock>,
    ledger: SqliteLedger,
    pool: Candidates,
    held: Lease,
    granted: Vec<Lease>,
}

impl Full {
    /// Opens the ledger at `path`, takes `held`, runs `fill`, then acquires until the ledger
    /// answers `Full` with the `Retry-After` of nothing freed: from then on no write fits.
    async fn open(
        path: PathBuf,
        options: SqliteOptions,
        config: LedgerConfig,
        fill: impl FnOnce(),
    ) -> Full {
        let clock = Arc::new(ManualClock::new(start()));
        let ledger = SqliteLedger::open(&path, options, config, clock.clone()).unwrap();
        let pool = candidates(4, 100_000);
        let held = granted(ledger.acquire(keyed(&pool, "held")).await);
        ledger
            .report(
                &held.id,
                DEFAULT_TENANT,
                LeaseReport::new(ReportResult::RateLimited, Some("cool.example")),
            )
            .await
            .unwrap();
        fill();
        let mut granted_leases = Vec::new();
        loop {
            match ledger
                .acquire(request(pool.clone(), "t.example", 10 * MINUTE))
                .await
            {
                Ok(AcquireOutcome::Granted(lease)) => granted_leases.push(lease),
                Err(LedgerError::Full { retry_after }) if retry_after > Duration::from_secs(1) => {
                    break;
                }
                Err(LedgerError::Full { .. }) => {}
                other => panic!("acquire while filling: {other:?}"),
            }
            assert!(granted_leases.len() < 100_000, "the ledger never filled");
        }
        Full {
            path,
            clock,
            ledger,
            pool,
            held,
            granted: granted_leases,
        }
    }

    /// Queues, behind another connection's write lock, one batch that releases, renews and
    /// reports on `held` (which fit) and then grants 64 leases (which do not), and checks that
    /// every write of the batch is refused as full and that neither memory nor the file kept
    /// anything of it: no phantom lease counted, no lease lost.
    async fn refuses_a_mixed_batch_whole(&self) {
        let ledger = &self.ledger;
        let counts = ledger.counts().active_counts();
        let total = ledger.counts().active_total();
        assert_eq!(total, 1 + self.granted.len() as u64);
        assert_eq!(ledger.counts().cooldowns_active(), 1);
        let rows = file_leases(&self.path);
        assert_eq!(
            rows.len() as u64,
            total,
            "every granted lease is in the file"
        );

        let lock = FileLock::take(&self.path);
        let mut first = Box::pin(ledger.release(&self.held.id, DEFAULT_TENANT));
        assert!(queue(&mut first).await.is_none());
        wait_until("the writer takes the first write", || {
            ledger.queue_depth() == 0
        })
        .await;
        let mut renew = Box::pin(ledger.renew(&self.held.id, DEFAULT_TENANT, 20 * MINUTE));
        let mut report = Box::pin(ledger.report(
            &self.held.id,
            DEFAULT_TENANT,
            LeaseReport::new(ReportResult::Blocked, Some("new.example")),
        ));
        let mut fresh = Box::pin(ledger.acquire(keyed(&self.pool, "fresh")));
        assert!(queue(&mut renew).await.is_none());
        assert!(queue(&mut report).await.is_none());
        assert!(queue(&mut fresh).await.is_none());
        let mut acquires: Vec<_> = (0..64)
            .map(|_| Box::pin(ledger.acquire(request(self.pool.clone(), "t.example", MINUTE))))
            .collect();
        for acquire in &mut acquires {
            assert!(queue(acquire).await.is_none());
        }
        lock.release();
        full(first.await);
        full(renew.await);
        full(report.await);
        full(fresh.await);
        for acquire in acquires {
            full(acquire.await);
        }

        assert_eq!(
            ledger.counts().active_counts(),
            counts,
            "no phantom lease is counted"
        );
        assert_eq!(ledger.counts().active_total(), total);
        assert_eq!(
            ledger.counts().cooldowns_active(),
            1,
            "the batch's cooldown is gone"
        );
        assert_eq!(file_leases(&self.path), rows, "the file kept nothing of it");
        let held = ledger
            .get(&self.held.id, DEFAULT_TENANT)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(held, self.held, "released and renewed in neither");
        ledger.self_check().await.unwrap();
    }

    /// After the ledger has room again: the request ID of the refused batch was never given
    /// out, the held lease replays, and memory matches the file.
    async fn writes_again(&self) {
        let fresh = self.ledger.acquire(keyed(&self.pool, "fresh")).await;
        assert!(matches!(fresh, Ok(AcquireOutcome::Granted(_))), "{fresh:?}");
        self.ledger.self_check().await.unwrap();
        let stats = self.ledger.writer_stats();
        assert!(stats.full_batches >= 2, "{stats:?}");
    }
}

fn keyed(pool: &Candidates, request_id: &str) -> AcquireRequest {
    AcquireRequest {
        request: Some(RequestKey {
            id: request_id.into(),
            fingerprint: "fp".into(),
        }),
        tenant: proxy_operator::ledger::Tenancy::unrestricted(),
        session: None,
        fallback_step: None,
        ..request(pool.clone(), "t.example", 10 * MINUTE)
    }
}

/// At its page limit (`max_page_count`): a batch that does not fit is refused whole with
/// memory rolled back, and once the leases filling the ledger have expired, the sweep (which
/// may use the pages kept back from clients) and pruning make room without a restart.
#[tokio::test]
async fn a_full_batch_at_the_page_limit_is_refused_whole_and_the_sweep_makes_room() {
    let dir = tempfile::tempdir().unwrap();
    let options = SqliteOptions {
        max_size: proxy_operator::ledger::MIN_MAX_SIZE,
        ..SqliteOptions::default()
    };
    let config = LedgerConfig {
        cooldown: MINUTE,
        ..LedgerConfig::default()
    };
    let f = Full::open(dir.path().join("ledger.db"), options, config, || {}).await;
    assert!(f.granted.len() > 1_000, "{} leases fit", f.granted.len());
    f.refuses_a_mixed_batch_whole().await;
    assert!(f.ledger.disk_bytes() <= proxy_operator::ledger::MIN_MAX_SIZE + MIB);

    // Releasing needs room too; the leases' end does not.
    f.clock.advance(11 * MINUTE);
    let swept = f.ledger.sweep().await.unwrap();
    assert_eq!(swept.expired, 1 + f.granted.len() as u64);
    assert_eq!(f.ledger.counts().active_total(), 0);
    f.writes_again().await;
}

/// On a full file system the COMMIT fails (SQLite cannot grow the WAL): the batch is refused
/// whole with memory rolled back, reads go on, and once space is back the next write
/// succeeds without a restart.
#[tokio::test]
async fn a_full_disk_fails_the_commit_and_writes_resume_when_space_is_back() {
    let Some(tmpfs) = Tmpfs::mount("2m") else {
        return;
    };
    let mut filler = None;
    let f = Full::open(
        tmpfs.path().join("ledger.db"),
        SqliteOptions::default(),
        LedgerConfig::default(),
        || {
            filler = Some(tmpfs.fill(0));
        },
    )
    .await;
    f.refuses_a_mixed_batch_whole().await;
    for lease in &f.granted {
        assert_eq!(
            f.ledger
                .get(&lease.id, DEFAULT_TENANT)
                .await
                .unwrap()
                .as_ref(),
            Some(lease)
        );
    }
    std::fs::remove_file(filler.unwrap()).unwrap();
    f.writes_again().await;
    let replay = f.ledger.acquire(keyed(&f.pool, "held")).await.unwrap();
    assert_eq!(replay, AcquireOutcome::Replayed(f.held.clone()));
    let ledger = f.ledger.clone();
    drop(f);
    tokio::task::spawn_blocking(move || ledger.shutdown())
        .await
        .unwrap();
}

const TOKEN: &str = "ledger-bound-test-token-0123456789";

/// The lease API over a real actix server on loopback, on a ledger file at `path`, with four
/// healthy External proxies of 100,000 lease slots each.
struct Api {
    base: String,
    http: reqwest::Client,
    clock: Arc<ManualClock>,
    ledger: SqliteLedger,
    /// The registry the API's lease metrics are registered in.
    registry: prometheus::Registry,
    server: ServerHandle,
}

impl Api {
    fn start(path: &Path, options: SqliteOptions, config: LedgerConfig) -> Api {
        let clock = Arc::new(ManualClock::new(start()));
        let dyn_clock: Arc<dyn Clock> = clock.clone();
        let ledger = SqliteLedger::open(path, options, config, dyn_clock.clone()).unwrap();
        let inventory = Inventory::new();
        let health = HealthSnapshot::new();
        let proxies: Vec<Proxy> = (0..4)
            .map(|i| {
                let spec: ProxySpec = serde_json::from_value(json!({
                    "mode": "External",
                    "endpoint": {"host": "127.0.0.1", "port": 3128 + i},
                    "maxLeases": 100_000,
                }))
                .unwrap();
                let mut proxy = Proxy::new(&format!("p{i}"), spec);
                proxy.metadata.namespace = Some("crawl".into());
                proxy.metadata.uid = Some(format!("uid-p{i}"));
                proxy.metadata.labels = Some(BTreeMap::from([("pool".into(), "a".into())]));
                proxy
            })
            .collect();
        for proxy in &proxies {
            health.set(
                proxy.id(),
                ProxyHealth {
                    healthy: Some(true),
                    latency: Some(Duration::from_millis(5)),
                    ..ProxyHealth::default()
                },
            );
        }
        inventory.replace(proxies);
        let registry = prometheus::Registry::new();
        let state = ApiState::new(
            Fleet::new(inventory, health, Arc::new(ledger.clone()), dyn_clock),
            LeaseMetrics::register(&registry).unwrap(),
            Duration::from_secs(300),
        );
        let (base, handle) = support::serve_api(state, TOKEN);
        Api {
            base,
            http: crate::support::http::client(),
            clock,
            ledger,
            registry,
            server: handle,
        }
    }

    /// Writes the API answered 503 `ledger_full`, as counted in its metrics.
    fn refused_full(&self) -> f64 {
        self.registry
            .gather()
            .iter()
            .find(|family| family.name() == "proxy_operator_ledger_full_total")
            .map(|family| family.get_metric()[0].get_counter().value())
            .expect("proxy_operator_ledger_full_total is registered")
    }

    async fn send(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Answer {
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(TOKEN);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.unwrap();
        let status = response.status();
        let retry_after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .map(|v| v.to_str().unwrap().parse::<u64>().unwrap());
        let text = response.text().await.unwrap();
        let body = serde_json::from_str(&text).unwrap_or(Value::Null);
        Answer {
            status,
            retry_after,
            body,
        }
    }

    async fn acquire(&self) -> Answer {
        let body = json!({"selector": {"pool": "a"}, "target": "shop.example", "ttlSeconds": 600});
        self.send(reqwest::Method::POST, "/v1/leases", Some(body))
            .await
    }

    /// Acquires, `parallel` at a time, until the API answers 503 `ledger_full`; returns the
    /// leases answered 201 and the first `ledger_full` answer.
    async fn acquire_until_full(&self, parallel: usize) -> (Vec<String>, Answer) {
        let mut granted = Vec::new();
        loop {
            let answers = futures::future::join_all((0..parallel).map(|_| self.acquire())).await;
            let mut full = None;
            for answer in answers {
                match answer.status {
                    StatusCode::CREATED => {
                        granted.push(answer.body["leaseID"].as_str().unwrap().to_owned())
                    }
                    StatusCode::SERVICE_UNAVAILABLE if answer.body["error"] == "ledger_full" => {
                        full.get_or_insert(answer);
                    }
                    _ => panic!("unexpected answer while filling: {answer:?}"),
                }
            }
            if let Some(full) = full {
                return (granted, full);
            }
            assert!(granted.len() < 100_000, "the ledger never filled");
        }
    }

    /// Reads still answer while the ledger is full, and every lease answered 201 is there: by
    /// the API, and in the file as the `sqlite3` shell reads it.
    async fn every_granted_lease_is_there(&self, granted: &[String]) {
        for id in granted {
            let answer = self
                .send(reqwest::Method::GET, &format!("/v1/leases/{id}"), None)
                .await;
            assert_eq!(answer.status, StatusCode::OK, "{id}: {answer:?}");
            assert_eq!(answer.body["state"], "active", "{id}: {answer:?}");
        }
        let list = self
            .send(reqwest::Method::GET, "/v1/proxies?healthy=true", None)
            .await;
        assert_eq!(list.status, StatusCode::OK, "{list:?}");
        assert_eq!(list.body["count"], 4);
        let in_file = sqlite3(
            self.ledger.path(),
            "SELECT id FROM leases WHERE state = 'active' ORDER BY id",
        );
        let mut expected = granted.to_vec();
        expected.sort();
        assert_eq!(in_file.lines().collect::<Vec<_>>(), expected);
        assert_eq!(self.ledger.counts().active_total(), granted.len() as u64);
        self.ledger.self_check().await.unwrap();
    }

    async fn stop(self) {
        self.server.stop(true).await;
        tokio::task::spawn_blocking(move || self.ledger.shutdown())
            .await
            .unwrap();
    }
}

#[derive(Debug)]
struct Answer {
    status: StatusCode,
    retry_after: Option<u64>,
    body: Value,
}

fn is_ledger_full(answer: &Answer) {
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE, "{answer:?}");
    assert_eq!(answer.body["error"], "ledger_full", "{answer:?}");
    assert!(
        answer.retry_after.is_some_and(|s| s >= 1),
        "Retry-After: {answer:?}"
    );
}

/// The reported failure, reproduced on a small file system: acquires answer 201 until the
/// disk is full, then 503 `ledger_full` with `Retry-After` (not 500); reads go on, nothing
/// answered 201 is lost, and the first acquire after space comes back is granted, without a
/// restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_answers_503_ledger_full_on_a_full_disk_and_recovers_when_space_is_back() {
    let Some(tmpfs) = Tmpfs::mount("1m") else {
        return;
    };
    let api = Api::start(
        &tmpfs.path().join("ledger.db"),
        SqliteOptions::default(),
        LedgerConfig::default(),
    );
    let filler = tmpfs.fill(64 * 1024);
    let (granted, full) = api.acquire_until_full(1).await;
    assert!(!granted.is_empty(), "some acquires fit in the space left");
    is_ledger_full(&full);
    is_ledger_full(&api.acquire().await);
    api.every_granted_lease_is_there(&granted).await;

    std::fs::remove_file(filler).unwrap();
    let answer = api.acquire().await;
    assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
    api.ledger.self_check().await.unwrap();
    assert_eq!(api.ledger.counts().active_total(), granted.len() as u64 + 1);
    api.stop().await;
}

/// At the size bound (`max_page_count`) with nothing left to prune, because active leases
/// fill it: 503 `ledger_full` with `Retry-After`, reads go on, nothing answered 201 is lost;
/// once the leases have expired, the sweep makes room and acquires are granted again
/// without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_answers_503_ledger_full_at_the_size_bound_and_recovers_when_leases_end() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let options = SqliteOptions {
        max_size: proxy_operator::ledger::MIN_MAX_SIZE,
        ..SqliteOptions::default()
    };
    let api = Api::start(&path, options, LedgerConfig::default());
    let (granted, full) = api.acquire_until_full(8).await;
    assert!(granted.len() > 1_000, "{} leases fit", granted.len());
    is_ledger_full(&full);
    assert!(api.refused_full() >= 1.0, "ledger_full answers are counted");
    api.every_granted_lease_is_there(&granted).await;
    assert!(std::fs::metadata(&path).unwrap().len() <= proxy_operator::ledger::MIN_MAX_SIZE);

    api.clock.advance(11 * MINUTE);
    let swept = api.ledger.sweep().await.unwrap();
    assert_eq!(swept.expired, granted.len() as u64);
    let answer = api.acquire().await;
    assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
    api.ledger.self_check().await.unwrap();
    api.stop().await;
}

/// Used pages of the database file, as a fresh connection sees them.
fn used_pages(path: &Path) -> i64 {
    count(
        path,
        "SELECT (SELECT page_count FROM pragma_page_count()) \
         - (SELECT freelist_count FROM pragma_freelist_count())",
    )
}

/// Bytes of the ledger's write-ahead log now (0 when there is none).
fn wal_bytes(path: &Path) -> u64 {
    let mut wal = path.as_os_str().to_owned();
    wal.push("-wal");
    std::fs::metadata(wal).map_or(0, |metadata| metadata.len())
}

/// Runs `cycles` acquire+release cycles (64 callers at once) on a ledger at `path` bounded to
/// 16 MiB, which stays within it without pruning, and shuts it down: a file for reopening
/// with a lower bound. Returns the candidates it leased from.
async fn cycled_ledger(
    path: &Path,
    config: &LedgerConfig,
    clock: &Arc<ManualClock>,
    cycles: usize,
) -> Candidates {
    let options = SqliteOptions {
        max_size: 16 * MIB,
        ..SqliteOptions::default()
    };
    let ledger = SqliteLedger::open(path, options, config.clone(), clock.clone()).unwrap();
    let pool = candidates(8, 1_000);
    let mut callers = tokio::task::JoinSet::new();
    for caller in 0..64 {
        let (ledger, pool) = (ledger.clone(), pool.clone());
        callers.spawn(async move {
            for _ in (caller..cycles).step_by(64) {
                let lease = granted(
                    ledger
                        .acquire(request(pool.clone(), "t.example", MINUTE))
                        .await,
                );
                ledger.release(&lease.id, DEFAULT_TENANT).await.unwrap();
            }
        });
    }
    while let Some(done) = callers.join_next().await {
        done.unwrap();
    }
    assert_eq!(ledger.writer_stats().prune_steps, 0, "within 16 MiB");
    tokio::task::spawn_blocking(move || ledger.shutdown())
        .await
        .unwrap();
    pool
}

/// A ledger reopened with a bound lower than its file: the writer prunes it down while idle —
/// all the history, then the oldest finished leases, as the history is not enough — without
/// shrinking the file (no VACUUM), with the WAL kept within its allowance; and writes go on in
/// the freed pages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_reopened_with_a_lower_bound_is_pruned_to_it_while_idle() {
    const CYCLES: usize = 20_000;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let clock = Arc::new(ManualClock::new(start()));
    let config = LedgerConfig {
        cooldown: MINUTE,
        ..LedgerConfig::default()
    };
    let pool = cycled_ledger(&path, &config, &clock, CYCLES).await;
    let file = std::fs::metadata(&path).unwrap().len();
    assert!(file > 4 * MIB, "{file} bytes");

    let reopened = Instant::now();
    let ledger = SqliteLedger::open(&path, four_mib(), config, clock.clone()).unwrap();
    let mut wal = 0;
    // Pruning is paced by the checkpoint after each step (an fsync each): 7.5 s alone, several
    // times that beside the other ledger tests on a loaded machine.
    let paced = Duration::from_secs(180);
    wait_until_within(
        "the writer prunes the file down to the new bound",
        paced,
        || {
            wal = wal.max(wal_bytes(&path));
            used_pages(&path) <= 672
        },
    )
    .await;
    // Checkpoints run between the steps: without them the WAL took every step, 89 MB. (One
    // step of scattered index pages can still outgrow the 512 KiB allowance of a bound this
    // small.)
    assert!(
        wal <= 4 * MIB,
        "the WAL is checkpointed while pruning: {wal} bytes"
    );
    eprintln!(
        "pruned {file} bytes of ledger down to the 4 MiB bound in {:.1?}",
        reopened.elapsed()
    );
    // Every finished lease not pruned is kept, and the writer counted the pruned ones (it counts
    // a prune step just after its COMMIT, which this test may see first).
    wait_until("the leases kept and the pruned ones counted add up", || {
        count(&path, "SELECT COUNT(*) FROM leases") as u64
            == CYCLES as u64 - ledger.writer_stats().pruned_leases
    })
    .await;
    let stats = ledger.writer_stats();
    assert_eq!(stats.batches, 0, "pruned while idle: {stats:?}");
    assert_eq!(stats.pruned_events, 2 * CYCLES as u64, "{stats:?}");
    assert!(stats.pruned_leases > 0, "{stats:?}");
    assert!(std::fs::metadata(&path).unwrap().len() >= file, "no VACUUM");
    let lease = granted(
        ledger
            .acquire(request(pool.clone(), "t.example", MINUTE))
            .await,
    );
    assert_eq!(
        ledger
            .get(&lease.id, DEFAULT_TENANT)
            .await
            .unwrap()
            .as_ref(),
        Some(&lease)
    );
    ledger.self_check().await.unwrap();
    tokio::task::spawn_blocking(move || ledger.shutdown())
        .await
        .unwrap();
}

/// The same on a disk that is full when the ledger reopens: the first prune step fails (its
/// WAL frames find no room) and the idle writer tries again until one fits, so the file is
/// pruned once space is back, with no batch to try again after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prune_step_that_fails_on_a_full_disk_is_tried_again_while_idle() {
    let Some(tmpfs) = Tmpfs::mount("8m") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(start()));
    let config = LedgerConfig::default();
    cycled_ledger(&dir.path().join("ledger.db"), &config, &clock, 8_000).await;
    let path = tmpfs.path().join("ledger.db");
    std::fs::copy(dir.path().join("ledger.db"), &path).unwrap();
    assert!(used_pages(&path) > 896, "over the 4 MiB bound's pages");
    // Room for the shared-memory index (32 KiB) and a few WAL frames, not for a prune step.
    let filler = tmpfs.fill(48 * 1024);

    let ledger = SqliteLedger::open(&path, four_mib(), config, clock).unwrap();
    wait_until("a prune step fails on the full disk", || {
        ledger.writer_stats().failed_prune_steps > 0
    })
    .await;
    std::fs::remove_file(filler).unwrap();
    wait_until("the writer prunes the file down to the new bound", || {
        used_pages(&path) <= 672
    })
    .await;
    let stats = ledger.writer_stats();
    assert_eq!(stats.batches, 0, "pruned while idle: {stats:?}");
    ledger.self_check().await.unwrap();
    tokio::task::spawn_blocking(move || ledger.shutdown())
        .await
        .unwrap();
}

/// A 4 MiB bound: 512 KiB of WAL, 896 pages for the file, pruned down to 672 used pages.
fn four_mib() -> SqliteOptions {
    SqliteOptions {
        max_size: 4 * MIB,
        ..SqliteOptions::default()
    }
}
