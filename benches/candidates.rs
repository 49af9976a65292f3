//! The candidate side of an acquire at fleet scale: 10,000 proxies, every one matching the
//! selector. Measures
//! - `copying`: what acquire did before candidates were shared — scan every Proxy, match its
//!   labels, look its health up by hashing its identity, copy the identity (3 strings);
//! - `assemble`: [`CandidateIndex::candidates`] right after a verdict or latency changed (the
//!   list is assembled from the cached matches and health positions);
//! - `unchanged health`: the same call when nothing changed since the last one (the list is
//!   handed out again);
//! - `assemble + acquire + release`: assembly after a health change, then a real acquire and
//!   release on a ledger file in a temporary directory — candidate assembly plus selection
//!   by the writer, plus its two commits.
//!
//! Run with `cargo bench --bench candidates`.

use proxy_operator::ledger::DEFAULT_TENANT;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use proxy_operator::fixtures;
use proxy_operator::health::{HealthSnapshot, ProxyHealth};
use proxy_operator::inventory::Inventory;
use proxy_operator::ledger::{
    AcquireOutcome, AcquireRequest, Candidate, Ledger, LedgerConfig, SqliteLedger, SqliteOptions,
    SystemClock,
};
use proxy_operator::resources::proxy::Proxy;
use proxy_operator::serving::candidates::{CandidateIndex, Selector};

const PROXIES: usize = 10_000;

fn fleet() -> (Inventory, HealthSnapshot) {
    let inventory = Inventory::new();
    let health = HealthSnapshot::new();
    let proxies: Vec<Proxy> = (0..PROXIES)
        .map(|i| {
            let port = u16::try_from(10_000 + i).expect("a port");
            let p = fixtures::external(&format!("px-{i:05}"), "127.0.0.1", port)
                .uid(Some(&format!("00000000-0000-4000-8000-{i:012}")))
                .max_leases(1_000_000)
                .labels(&[("pool", "scale"), ("geo", ["eu", "us", "ap"][i % 3])])
                .build();
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

/// The acquire path before this cache existed, for comparison.
fn copying(inventory: &Inventory, health: &HealthSnapshot, selector: &Selector) -> Vec<Candidate> {
    let snapshot = inventory.snapshot();
    let health = health.read();
    snapshot
        .entries()
        .filter(|(id, p)| selector.matches(&id.namespace, p.metadata.labels.as_ref()))
        .map(|(id, p)| {
            let h = health.get(id);
            Candidate {
                healthy: p.spec.effective_host(p.status.as_ref()).is_some()
                    && h.and_then(|h| h.healthy) == Some(true),
                latency: h.and_then(|h| h.latency),
                max_leases: p.spec.max_leases(),
                cordoned: p.spec.cordoned,
                draining: p.is_draining(),
                proxy: Arc::new(id.clone()),
            }
        })
        .collect()
}

/// Changes one proxy's latency, as a probe would, so the next assembly cannot reuse a list
/// (run before every iteration: `BatchSize::PerIteration`).
fn probe(health: &HealthSnapshot, inventory: &Inventory, round: &mut u64) {
    *round += 1;
    let snapshot = inventory.snapshot();
    let id = snapshot.leasable()[0].id.as_ref().clone();
    health.set(
        id,
        ProxyHealth {
            healthy: Some(true),
            latency: Some(Duration::from_micros(5_000 + *round % 1_000)),
            ..Default::default()
        },
    );
}

fn bench(c: &mut Criterion) {
    let (inventory, health) = fleet();
    let selector = Selector::parse("pool=scale").expect("selector");
    let index = CandidateIndex::default();
    let mut group = c.benchmark_group("candidates of 10,000 proxies");
    group.sample_size(30);
    group.bench_function("copying (before)", |b| {
        b.iter(|| black_box(copying(&inventory, &health, black_box(&selector))))
    });
    let mut round = 0;
    group.bench_function("assemble", |b| {
        b.iter_batched(
            || probe(&health, &inventory, &mut round),
            |()| black_box(index.candidates(&inventory.snapshot(), &health, &selector)),
            criterion::BatchSize::PerIteration,
        )
    });
    group.bench_function("unchanged health", |b| {
        b.iter(|| black_box(index.candidates(&inventory.snapshot(), &health, &selector)))
    });

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let dir = tempfile::tempdir().expect("temp dir");
    let ledger = SqliteLedger::open(
        &dir.path().join("ledger.db"),
        SqliteOptions::default(),
        LedgerConfig::default(),
        Arc::new(SystemClock),
    )
    .expect("ledger");
    group.bench_function("assemble + acquire + release", |b| {
        b.iter_batched(
            || probe(&health, &inventory, &mut round),
            |()| {
                let candidates = index.candidates(&inventory.snapshot(), &health, &selector);
                runtime.block_on(async {
                    let outcome = ledger
                        .acquire(AcquireRequest {
                            candidates,
                            target: None,
                            ttl: Duration::from_secs(300),
                            request: None,
                            client: None,
                            tenant: proxy_operator::ledger::Tenancy::unrestricted(),
                            session: None,
                        })
                        .await
                        .expect("acquire");
                    let AcquireOutcome::Granted(lease) = outcome else {
                        panic!("not granted: {outcome:?}");
                    };
                    ledger
                        .release(&lease.id, DEFAULT_TENANT)
                        .await
                        .expect("release");
                })
            },
            criterion::BatchSize::PerIteration,
        )
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
