//! What counting an outcome costs the gateway per request: [`Outcomes::record`] for a proxy
//! and a target already counted (the common case: two hash lookups under two short locks, the
//! clock read, an increment), against the same two keys' plain `HashMap` updates, and a
//! plain `HashMap` insert of the proxy's identity (which clones the key), in the same run.
//! The keys cycle through 100 proxies and 100 targets so the lookups are not all one entry.
//!
//! Run with `cargo bench --bench outcomes`.

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use proxy_operator::ledger::SystemClock;
use proxy_operator::resources::proxy::ProxyId;
use proxy_operator::serving::outcomes::{Outcome, Outcomes};

const KEYS: usize = 100;

fn keys() -> Vec<(ProxyId, String)> {
    (0..KEYS)
        .map(|i| {
            let proxy = ProxyId {
                namespace: "crawl".into(),
                name: format!("px-{i:03}"),
                uid: format!("00000000-0000-4000-8000-{i:012}"),
            };
            (proxy, format!("site-{i:03}.example.com"))
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let keys = keys();
    let ok = Outcome::Http {
        status: 200,
        banned: false,
    };
    let outcomes = Outcomes::new(Arc::new(SystemClock));
    let mut by_proxy: HashMap<ProxyId, u64> = HashMap::new();
    let mut by_target: HashMap<String, u64> = HashMap::new();
    for (proxy, target) in &keys {
        outcomes.record("default", proxy, Some(target), ok);
        by_proxy.insert(proxy.clone(), 0);
        by_target.insert(target.clone(), 0);
    }
    let mut group = c.benchmark_group("outcomes");
    let mut i = 0;
    group.bench_function("record", |b| {
        b.iter(|| {
            let (proxy, target) = &keys[i % KEYS];
            i += 1;
            outcomes.record(
                black_box("default"),
                black_box(proxy),
                Some(black_box(target)),
                black_box(ok),
            );
        })
    });
    group.bench_function("hashmap get_mut (proxy + target)", |b| {
        b.iter(|| {
            let (proxy, target) = &keys[i % KEYS];
            i += 1;
            if let Some(n) = by_proxy.get_mut(black_box(proxy)) {
                *n += 1;
            }
            if let Some(n) = by_target.get_mut(black_box(target.as_str())) {
                *n += 1;
            }
        })
    });
    group.bench_function("hashmap insert (proxy)", |b| {
        b.iter(|| {
            let (proxy, _) = &keys[i % KEYS];
            i += 1;
            black_box(by_proxy.insert(black_box(proxy).clone(), 1));
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
