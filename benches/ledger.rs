//! Acquire+release pairs per second through the ledger, next to a raw-rusqlite baseline that
//! writes the same rows in transactions of the same sizes.
//!
//! The ledger side: `callers` tokio tasks each loop acquire → release on a ledger file in a
//! temporary directory, so the writer commits whatever is queued together (group commit). The
//! ledger reports the sizes of the batches it committed; the baseline then replays exactly
//! those sizes on one bare connection to another fresh file with the same schema, PRAGMAs
//! (WAL, `synchronous = NORMAL`, the writer's page cache) and file system: per acquire one
//! INSERT into `leases` and one `acquired` history row, per release one UPDATE and one
//! `released` history row, a transaction per batch. That is the least the same work needs —
//! no queue, no selection, no answers — so the ratio says what the ledger's own machinery
//! costs. Rounds alternate between the two sides, so both are measured under the same load
//! on a shared machine.
//!
//! A second part times acquire+release pairs of a tenant with a lease quota while it holds 10
//! leases and while it holds 10,000 (in interleaved rounds on one ledger): the quota is read
//! from counts kept as leases come and go, so the two should cost the same.
//!
//! Run with `cargo bench --bench ledger`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use proxy_operator::ledger::{
    AcquireOutcome, AcquireRequest, Candidate, Candidates, Ledger, LedgerConfig, Quotas,
    SqliteLedger, SqliteOptions, SystemClock, Tenancy, WriterStats,
};
use proxy_operator::resources::proxy::ProxyId;
use tempfile::TempDir;

const TTL: Duration = Duration::from_secs(300);
/// Rounds per scenario, alternating ledger and baseline.
const ROUNDS: usize = 6;
/// Acquire+release pairs per ledger round.
const ROUND_PAIRS: usize = 8_000;

/// A ledger on a fresh file and the candidates its acquires choose from.
struct LedgerSide {
    _dir: TempDir,
    ledger: SqliteLedger,
    candidates: Candidates,
}

impl LedgerSide {
    fn new(candidates: usize) -> Self {
        Self::with_capacity(candidates, 5)
    }

    /// A ledger whose `candidates` proxies take `max_leases` each.
    fn with_capacity(candidates: usize, max_leases: u32) -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let ledger = SqliteLedger::open(
            &dir.path().join("ledger.db"),
            SqliteOptions::default(),
            LedgerConfig::default(),
            Arc::new(SystemClock),
        )
        .expect("ledger");
        let candidates = (0..candidates)
            .map(|i| Candidate {
                proxy: Arc::new(ProxyId {
                    namespace: "crawl".into(),
                    name: format!("proxy-{i:05}"),
                    uid: format!("00000000-0000-4000-8000-{i:012}"),
                }),
                max_leases,
                healthy: true,
                cordoned: false,
                draining: false,
                latency: Some(Duration::from_millis(20 + (i as u64 * 7) % 50)),
            })
            .collect();
        Self {
            _dir: dir,
            ledger,
            candidates,
        }
    }

    /// `pairs` acquire+release pairs spread over `callers` concurrent tasks; returns the wall
    /// time and the batch sizes the writer used meanwhile.
    fn run(
        &self,
        runtime: &tokio::runtime::Runtime,
        callers: usize,
        pairs: usize,
    ) -> (Duration, Vec<u64>) {
        self.run_as(runtime, callers, pairs, &Tenancy::unrestricted())
    }

    /// [`LedgerSide::run`] for `tenant`.
    fn run_as(
        &self,
        runtime: &tokio::runtime::Runtime,
        callers: usize,
        pairs: usize,
        tenant: &Tenancy,
    ) -> (Duration, Vec<u64>) {
        let before = self.ledger.writer_stats();
        let started = Instant::now();
        runtime.block_on(async {
            let tasks: Vec<_> = (0..callers)
                .map(|caller| {
                    let ledger = self.ledger.clone();
                    let candidates = self.candidates.clone();
                    let mine = pairs / callers + usize::from(caller < pairs % callers);
                    let tenant = tenant.clone();
                    tokio::spawn(async move {
                        for _ in 0..mine {
                            let request = acquire_request(&candidates, &tenant);
                            let Ok(AcquireOutcome::Granted(lease)) = ledger.acquire(request).await
                            else {
                                panic!("no lease granted");
                            };
                            ledger
                                .release(&lease.id, &tenant.name)
                                .await
                                .expect("release");
                        }
                    })
                })
                .collect();
            for task in tasks {
                task.await.expect("caller");
            }
        });
        let elapsed = started.elapsed();
        (elapsed, batch_sizes(&before, &self.ledger.writer_stats()))
    }
}

/// An acquire of `tenant` among `candidates`, with no target, request ID or session.
fn acquire_request(candidates: &Candidates, tenant: &Tenancy) -> AcquireRequest {
    AcquireRequest {
        candidates: candidates.clone(),
        target: None,
        ttl: TTL,
        request: None,
        client: None,
        tenant: tenant.clone(),
        session: None,
        fallback_step: None,
    }
}

/// Batches of each size committed between two snapshots of the writer's statistics.
fn batch_sizes(before: &WriterStats, after: &WriterStats) -> Vec<u64> {
    after
        .batch_sizes
        .iter()
        .enumerate()
        .map(|(size, n)| n - before.batch_sizes.get(size).copied().unwrap_or(0))
        .collect()
}

/// A bare connection to a fresh file with the ledger's schema and PRAGMAs.
struct Baseline {
    _dir: TempDir,
    conn: rusqlite::Connection,
    /// Leases inserted and not yet released, oldest first.
    held: std::collections::VecDeque<String>,
    ops: u64,
}

impl Baseline {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let conn = rusqlite::Connection::open(dir.path().join("baseline.db")).expect("open");
        conn.pragma_update(None, "journal_mode", "WAL")
            .expect("wal");
        conn.pragma_update(None, "synchronous", "NORMAL")
            .expect("pragma");
        conn.pragma_update(None, "foreign_keys", true)
            .expect("pragma");
        conn.pragma_update(None, "cache_size", -32 * 1024)
            .expect("pragma");
        conn.busy_timeout(Duration::from_secs(5)).expect("pragma");
        for sql in [
            include_str!("../migrations/0001_lease_ledger.sql"),
            include_str!("../migrations/0002_acquire_request_ids.sql"),
        ] {
            conn.execute_batch(sql).expect("schema");
        }
        Self {
            _dir: dir,
            conn,
            held: std::collections::VecDeque::new(),
            ops: 0,
        }
    }

    /// Replays `sizes` (batches of each size): one transaction per batch, alternating
    /// acquires and releases of the oldest held lease, with their history rows.
    fn run(&mut self, sizes: &[u64]) -> Duration {
        let started = Instant::now();
        for (size, &batches) in sizes.iter().enumerate() {
            for _ in 0..batches {
                let tx = self.conn.transaction().expect("begin");
                for _ in 0..size {
                    let now = jiff::Timestamp::now().as_millisecond();
                    let release = self.ops % 2 == 1;
                    self.ops += 1;
                    match self.held.pop_front().filter(|_| release) {
                        Some(id) => {
                            tx.prepare_cached(
                                "UPDATE leases SET state = 'released', released_at = ?2 \
                                 WHERE id = ?1",
                            )
                            .and_then(|mut s| s.execute(rusqlite::params![id, now]))
                            .expect("update");
                            record(&tx, &id, "released", now);
                        }
                        None => {
                            let id = format!("{now:012x}{:032x}", rand::random::<u128>());
                            tx.prepare_cached(
                                "INSERT INTO leases (id, proxy_namespace, proxy_name, \
                                 proxy_uid, target, state, acquired_at, expires_at, ttl_ms, \
                                 request_id, request_fingerprint) VALUES (?1, 'crawl', \
                                 'proxy-00042', '00000000-0000-4000-8000-000000000042', NULL, \
                                 'active', ?2, ?3, 300000, NULL, NULL)",
                            )
                            .and_then(|mut s| s.execute(rusqlite::params![id, now, now + 300_000]))
                            .expect("insert");
                            record(&tx, &id, "acquired", now);
                            self.held.push_back(id);
                        }
                    }
                }
                tx.commit().expect("commit");
            }
        }
        started.elapsed()
    }
}

fn record(tx: &rusqlite::Transaction<'_>, id: &str, kind: &str, now: i64) {
    tx.prepare_cached(
        "INSERT INTO lease_events (at, lease_id, kind, proxy_namespace, proxy_name, proxy_uid, \
         target, result, expires_at) VALUES (?1, ?2, ?3, 'crawl', 'proxy-00042', \
         '00000000-0000-4000-8000-000000000042', NULL, NULL, ?4)",
    )
    .and_then(|mut s| s.execute(rusqlite::params![now, id, kind, now + 300_000]))
    .expect("event");
}

/// Alternates ledger and baseline rounds and prints both throughputs, their ratio and the
/// batch sizes.
fn compare(runtime: &tokio::runtime::Runtime, callers: usize, candidates: usize) {
    let ledger = LedgerSide::new(candidates);
    let mut baseline = Baseline::new();
    // Warm-up: page caches, prepared statements, the runtime's threads.
    let (_, warm) = ledger.run(runtime, callers, ROUND_PAIRS / 4);
    baseline.run(&warm);
    let (mut ledger_time, mut baseline_time) = (Duration::ZERO, Duration::ZERO);
    let mut sizes: Vec<u64> = Vec::new();
    for _ in 0..ROUNDS {
        let (elapsed, round) = ledger.run(runtime, callers, ROUND_PAIRS);
        ledger_time += elapsed;
        baseline_time += baseline.run(&round);
        if sizes.len() < round.len() {
            sizes.resize(round.len(), 0);
        }
        for (total, n) in sizes.iter_mut().zip(&round) {
            *total += n;
        }
    }
    let pairs = (ROUNDS * ROUND_PAIRS) as f64;
    let ledger_rate = pairs / ledger_time.as_secs_f64();
    let baseline_rate = pairs / baseline_time.as_secs_f64();
    let batches: u64 = sizes.iter().sum();
    let writes: u64 = (0u64..).zip(&sizes).map(|(size, n)| size * n).sum();
    let largest = sizes.iter().rposition(|&n| n > 0).unwrap_or(0);
    println!(
        "{callers:>2} callers, {candidates:>4} candidates: ledger {ledger_rate:>7.0} pairs/s, \
         batched baseline {baseline_rate:>7.0} pairs/s, ratio {:.2}; {batches} batches, mean \
         {:.1} writes, largest {largest}",
        ledger_rate / baseline_rate,
        writes as f64 / batches.max(1) as f64,
    );
}

/// Pairs/s of a tenant with a lease quota holding 10 leases and holding 10,000, in
/// interleaved rounds on one ledger; prints both and their ratio.
fn quota_at_size(runtime: &tokio::runtime::Runtime) {
    const HELD: [usize; 2] = [10, 10_000];
    const PAIRS: usize = 4_000;
    let ledger = LedgerSide::with_capacity(1_000, 20);
    let tenants = HELD.map(|held| Tenancy {
        name: format!("holds-{held}").into(),
        quotas: Quotas {
            leases: Some(20_000),
            ..Quotas::default()
        },
    });
    for (held, tenant) in HELD.iter().zip(&tenants) {
        runtime.block_on(async {
            for _ in 0..*held {
                let request = acquire_request(&ledger.candidates, tenant);
                let Ok(AcquireOutcome::Granted(_)) = ledger.ledger.acquire(request).await else {
                    panic!("no lease granted");
                };
            }
        });
    }
    let mut times = [Duration::ZERO; 2];
    for tenant in &tenants {
        ledger.run_as(runtime, 32, PAIRS / 4, tenant);
    }
    for _ in 0..ROUNDS {
        for (time, tenant) in times.iter_mut().zip(&tenants) {
            *time += ledger.run_as(runtime, 32, PAIRS, tenant).0;
        }
    }
    let rate = |time: Duration| (ROUNDS * PAIRS) as f64 / time.as_secs_f64();
    println!(
        "a tenant with a lease quota: holding {} leases {:>7.0} pairs/s, holding {} {:>7.0} \
         pairs/s; time per pair {:.2} x",
        HELD[0],
        rate(times[0]),
        HELD[1],
        rate(times[1]),
        times[1].as_secs_f64() / times[0].as_secs_f64()
    );
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    println!(
        "acquire+release pairs/s, {ROUNDS} interleaved rounds of {ROUND_PAIRS} pairs per side"
    );
    compare(&runtime, 32, 1_000);
    compare(&runtime, 32, 10);
    compare(&runtime, 1, 1_000);
    quota_at_size(&runtime);
}
