//! Acquire+release pairs per second on a ledger file in a temporary directory, with 10 and
//! 1,000 candidates, next to a raw-rusqlite baseline doing the least the same work needs: one
//! INSERT and one UPDATE per pair, each its own transaction, on one connection with the same
//! schema, PRAGMAs (including the writer's page cache size) and file system.
//!
//! Criterion measures the three one after the other; on a shared machine the load can change
//! between them, so the run ends with an interleaved comparison (alternating blocks of ledger
//! and baseline pairs) whose ratio both sides measured under the same load.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group};
use proxy_operator::ledger::{AcquireOutcome, Candidate, Ledger, LedgerConfig, SystemClock};
use proxy_operator::proxy::ProxyId;
use tempfile::TempDir;

const TTL: Duration = Duration::from_secs(300);

/// A ledger on a fresh file and the candidates its acquires choose from.
struct LedgerPairs {
    _dir: TempDir,
    ledger: Ledger,
    candidates: Vec<Candidate>,
}

impl LedgerPairs {
    fn new(candidates: usize) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(
            &dir.path().join("ledger.db"),
            LedgerConfig::default(),
            Arc::new(SystemClock),
        )
        .unwrap();
        let candidates = (0..candidates)
            .map(|i| Candidate {
                proxy: ProxyId {
                    namespace: "crawl".into(),
                    name: format!("proxy-{i:05}"),
                    uid: format!("00000000-0000-4000-8000-{i:012}"),
                },
                max_leases: 5,
                healthy: true,
                latency: Some(Duration::from_millis(20 + (i as u64 * 7) % 50)),
            })
            .collect();
        Self {
            _dir: dir,
            ledger,
            candidates,
        }
    }

    fn pair(&self) {
        let AcquireOutcome::Granted(lease) = self
            .ledger
            .acquire(black_box(&self.candidates), None, TTL)
            .unwrap()
        else {
            panic!("no lease granted");
        };
        self.ledger.release(&lease.id).unwrap();
    }
}

/// A bare connection to a fresh file with the ledger's schema and PRAGMAs.
struct BaselinePairs {
    _dir: TempDir,
    conn: rusqlite::Connection,
    next: u64,
}

impl BaselinePairs {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let conn = rusqlite::Connection::open(dir.path().join("baseline.db")).unwrap();
        conn.pragma_update(None, "journal_mode", "WAL").unwrap();
        conn.pragma_update(None, "synchronous", "NORMAL").unwrap();
        conn.pragma_update(None, "foreign_keys", true).unwrap();
        conn.pragma_update(None, "cache_size", -32 * 1024).unwrap();
        conn.busy_timeout(Duration::from_secs(5)).unwrap();
        conn.execute_batch(include_str!("../migrations/0001_lease_ledger.sql"))
            .unwrap();
        Self {
            _dir: dir,
            conn,
            next: 0,
        }
    }

    fn pair(&mut self) {
        self.next += 1;
        let id = format!("lease-{:020}", self.next);
        let now = jiff::Timestamp::now().as_millisecond();
        self.conn
            .prepare_cached(
                "INSERT INTO leases (id, proxy_namespace, proxy_name, proxy_uid, state, \
                 acquired_at, expires_at, ttl_ms) \
                 VALUES (?1, 'crawl', 'proxy-00000', 'uid', 'active', ?2, ?3, 300000)",
            )
            .unwrap()
            .execute(rusqlite::params![id, now, now + 300_000])
            .unwrap();
        self.conn
            .prepare_cached("UPDATE leases SET state = 'released', released_at = ?2 WHERE id = ?1")
            .unwrap()
            .execute(rusqlite::params![id, now])
            .unwrap();
    }
}

fn acquire_release(c: &mut Criterion) {
    let mut group = c.benchmark_group("acquire_release");
    group.throughput(Throughput::Elements(1));
    for n in [10, 1_000] {
        let pairs = LedgerPairs::new(n);
        group.bench_function(BenchmarkId::new("ledger", n), |b| b.iter(|| pairs.pair()));
    }
    let mut baseline = BaselinePairs::new();
    group.bench_function("raw_rusqlite_baseline", |b| b.iter(|| baseline.pair()));
    group.finish();
}

/// Alternates blocks of ledger pairs (1,000 candidates) and baseline pairs and prints both
/// throughputs and their ratio.
fn interleaved_ratio() {
    const BLOCKS: u32 = 40;
    const PER_BLOCK: u32 = 100;
    let ledger = LedgerPairs::new(1_000);
    let mut baseline = BaselinePairs::new();
    for _ in 0..PER_BLOCK * 5 {
        ledger.pair();
        baseline.pair();
    }
    let (mut ledger_time, mut baseline_time) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..BLOCKS {
        let started = Instant::now();
        (0..PER_BLOCK).for_each(|_| ledger.pair());
        ledger_time += started.elapsed();
        let started = Instant::now();
        (0..PER_BLOCK).for_each(|_| baseline.pair());
        baseline_time += started.elapsed();
    }
    let pairs = f64::from(BLOCKS * PER_BLOCK);
    let ledger_rate = pairs / ledger_time.as_secs_f64();
    let baseline_rate = pairs / baseline_time.as_secs_f64();
    println!(
        "interleaved acquire+release pairs/s: ledger (1000 candidates) {ledger_rate:.0}, \
         raw rusqlite baseline {baseline_rate:.0}, ratio {:.2}",
        ledger_rate / baseline_rate
    );
}

criterion_group!(benches, acquire_release);

fn main() {
    benches();
    interleaved_ratio();
    Criterion::default().configure_from_args().final_summary();
}
