//! Acquire+release pairs per second on a ledger file in a temporary directory, with 10 and
//! 1,000 candidates, next to a raw-rusqlite baseline doing the least the same work needs: one
//! INSERT and one UPDATE per pair, each its own transaction, on one connection with the same
//! schema, PRAGMAs (including the writer's page cache size) and file system.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use proxy_operator::ledger::{AcquireOutcome, Candidate, Ledger, LedgerConfig, SystemClock};
use proxy_operator::proxy::ProxyId;

const TTL: Duration = Duration::from_secs(300);

fn candidates(n: usize) -> Vec<Candidate> {
    (0..n)
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
        .collect()
}

fn ledger_pairs(c: &mut Criterion) {
    let mut group = c.benchmark_group("acquire_release");
    group.throughput(Throughput::Elements(1));
    for n in [10, 1_000] {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(
            &dir.path().join("ledger.db"),
            LedgerConfig::default(),
            Arc::new(SystemClock),
        )
        .unwrap();
        let candidates = candidates(n);
        group.bench_with_input(
            BenchmarkId::new("ledger", n),
            &candidates,
            |b, candidates| {
                b.iter(|| {
                    let AcquireOutcome::Granted(lease) =
                        ledger.acquire(black_box(candidates), None, TTL).unwrap()
                    else {
                        panic!("no lease granted");
                    };
                    ledger.release(&lease.id).unwrap();
                })
            },
        );
    }

    let dir = tempfile::tempdir().unwrap();
    let conn = rusqlite::Connection::open(dir.path().join("baseline.db")).unwrap();
    conn.pragma_update(None, "journal_mode", "WAL").unwrap();
    conn.pragma_update(None, "synchronous", "NORMAL").unwrap();
    conn.pragma_update(None, "foreign_keys", true).unwrap();
    conn.pragma_update(None, "cache_size", -32 * 1024).unwrap();
    conn.busy_timeout(Duration::from_secs(5)).unwrap();
    conn.execute_batch(include_str!("../migrations/0001_lease_ledger.sql"))
        .unwrap();
    let mut next = 0u64;
    group.bench_function("raw_rusqlite_baseline", |b| {
        b.iter(|| {
            next += 1;
            let id = format!("lease-{next}");
            let now = jiff::Timestamp::now().as_millisecond();
            conn.prepare_cached(
                "INSERT INTO leases (id, proxy_namespace, proxy_name, proxy_uid, state, \
                 acquired_at, expires_at, ttl_ms) \
                 VALUES (?1, 'crawl', 'proxy-00000', 'uid', 'active', ?2, ?3, 300000)",
            )
            .unwrap()
            .execute(rusqlite::params![id, now, now + 300_000])
            .unwrap();
            conn.prepare_cached(
                "UPDATE leases SET state = 'released', released_at = ?2 WHERE id = ?1",
            )
            .unwrap()
            .execute(rusqlite::params![id, now])
            .unwrap();
        })
    });
    group.finish();
}

criterion_group!(benches, ledger_pairs);
criterion_main!(benches);
