//! Bytes through the gateway in the ledger's hourly traffic rows, each behaviour test run on
//! both backends (a real SQLite file, a fresh database on the real PostgreSQL server): bytes
//! added up per (hour, tenant, proxy, pool, target), read back since an hour, each tenant's
//! bytes of the UTC day answered, swept after the retention, kept across a restart; and a
//! tenant's `bytesPerDay` quota refusing its acquires once the day's bytes reach it, until
//! midnight UTC. Time only moves through the ledger's `ManualClock`.

use crate::support;

use std::collections::HashMap;
use std::time::Duration;

use proxy_operator::ledger::{
    AcquireOutcome, AcquireRequest, HOUR_MS, LedgerConfig, QuotaKind, Quotas, SweepStats, Tenancy,
    TrafficBytes, TrafficHour, day_start,
};
use support::ledger::{Backend, Fixture, candidates, granted, start};

fn config() -> LedgerConfig {
    LedgerConfig {
        max_ttl: Duration::from_secs(3600),
        history_retention: Duration::from_secs(24 * 3600),
        ..LedgerConfig::default()
    }
}

/// Bytes for `tenant` through `crawl/<proxy>` (in `pool`) to `target`.
fn bytes(
    tenant: &str,
    proxy: &str,
    pool: Option<&str>,
    target: &str,
    up: u64,
    down: u64,
) -> TrafficBytes {
    TrafficBytes {
        tenant: tenant.into(),
        namespace: "crawl".into(),
        name: proxy.into(),
        pool: pool.map(str::to_owned),
        target: target.into(),
        up,
        down,
    }
}

/// The row [`bytes`] adds to in the hour starting `hour_ms`.
fn row(hour_ms: i64, b: &TrafficBytes) -> TrafficHour {
    TrafficHour {
        hour_ms,
        bytes: b.clone(),
    }
}

fn today(counts: &[(&str, u64)]) -> HashMap<String, u64> {
    counts.iter().map(|(t, n)| ((*t).to_owned(), *n)).collect()
}

/// Milliseconds after [`start`] (midnight UTC).
fn at(ms: i64) -> i64 {
    start().as_millisecond() + ms
}

impl Fixture {
    fn clock_to(&self, ms: i64) {
        self.clock
            .set(jiff::Timestamp::from_millisecond(at(ms)).unwrap());
    }

    async fn record(&self, batch: Vec<TrafficBytes>) -> HashMap<String, u64> {
        self.ledger.record_traffic(batch).await.unwrap()
    }
}

async fn bytes_add_up_per_hour_and_row_and_read_back_oldest_first(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    let a1 = bytes("team-a", "p1", Some("pool"), "example.com", 100, 10_000);
    let b1 = bytes("team-b", "p1", Some("pool"), "example.com", 7, 70);
    let a2 = bytes("team-a", "p2", None, "example.org", 1, 2);
    f.clock_to(60_000);
    // One batch: rows for one key added up first.
    assert_eq!(
        f.record(vec![a1.clone(), b1.clone(), a1.clone()]).await,
        today(&[("team-a", 20_200), ("team-b", 77)])
    );
    f.clock_to(HOUR_MS - 1);
    assert_eq!(
        f.record(vec![a2.clone()]).await,
        today(&[("team-a", 20_203)])
    );
    f.clock_to(HOUR_MS + 5);
    assert_eq!(
        f.record(vec![a1.clone(), bytes("team-b", "p3", None, "x", 0, 0)])
            .await,
        today(&[("team-a", 30_303)]),
        "an empty row is dropped, its tenant not named"
    );
    let doubled = TrafficBytes {
        up: 200,
        down: 20_000,
        ..a1.clone()
    };
    let all = vec![
        row(at(0), &doubled),
        row(at(0), &a2),
        row(at(0), &b1),
        row(at(HOUR_MS), &a1),
    ];
    assert_eq!(f.ledger.traffic(at(0)).await.unwrap(), all);
    assert_eq!(f.ledger.traffic(at(1)).await.unwrap(), all[3..]);
    assert_eq!(f.ledger.traffic(at(2 * HOUR_MS)).await.unwrap(), []);
    assert_eq!(f.count("SELECT COUNT(*) FROM traffic_hours"), 4);
    // A batch of nothing writes nothing.
    assert_eq!(f.record(vec![]).await, HashMap::new());
    assert_eq!(f.count("SELECT COUNT(*) FROM traffic_hours"), 4);
    // Bytes are no lease: the counts do not move.
    assert_eq!(f.ledger.counts().active_total(), 0);
    f.self_check().await;
}

async fn a_tenants_day_starts_again_at_midnight_utc_and_survives_a_restart(backend: Backend) {
    let Some(mut f) = Fixture::on(backend, config()).await else {
        return;
    };
    let a = bytes("team-a", "p1", None, "example.com", 10, 90);
    f.clock_to(23 * HOUR_MS);
    assert_eq!(f.record(vec![a.clone()]).await, today(&[("team-a", 100)]));
    f.reopen().await;
    f.clock_to(24 * HOUR_MS - 1);
    assert_eq!(
        f.record(vec![a.clone()]).await,
        today(&[("team-a", 200)]),
        "the day's bytes are kept across a restart"
    );
    f.clock_to(24 * HOUR_MS);
    assert_eq!(
        f.record(vec![a.clone()]).await,
        today(&[("team-a", 100)]),
        "a new UTC day starts from nothing"
    );
    assert_eq!(day_start(at(24 * HOUR_MS)), at(24 * HOUR_MS));
    f.reopen().await;
    assert_eq!(f.record(vec![a]).await, today(&[("team-a", 200)]));
    assert_eq!(f.ledger.traffic(at(0)).await.unwrap().len(), 2);
}

async fn sweep_drops_traffic_rows_whose_hour_ended_before_the_retention(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    let a = bytes("team-a", "p1", None, "example.com", 1, 1);
    f.record(vec![a.clone()]).await;
    f.clock_to(HOUR_MS);
    f.record(vec![a.clone()]).await;
    // The first hour ends at 1 h; with 24 h of retention it goes at 25 h, not before.
    f.clock_to(25 * HOUR_MS - 1);
    assert_eq!(f.ledger.sweep().await.unwrap(), SweepStats::default());
    f.clock_to(25 * HOUR_MS);
    assert_eq!(
        f.ledger.sweep().await.unwrap(),
        SweepStats {
            traffic_pruned: 1,
            ..SweepStats::default()
        }
    );
    assert_eq!(f.ledger.traffic(0).await.unwrap(), [row(at(HOUR_MS), &a)]);
    f.clock_to(26 * HOUR_MS);
    assert_eq!(f.ledger.sweep().await.unwrap().traffic_pruned, 1);
    assert_eq!(f.count("SELECT COUNT(*) FROM traffic_hours"), 0);
}

/// An acquire of `tenant` (with a `bytesPerDay` budget of `budget`) on one of two proxies.
fn acquire(tenant: &str, budget: Option<u64>) -> AcquireRequest {
    AcquireRequest {
        candidates: candidates(2, 100),
        target: Some("example.com".into()),
        ttl: Duration::from_secs(60),
        request: None,
        client: None,
        tenant: Tenancy {
            name: tenant.into(),
            quotas: Quotas {
                bytes_per_day: budget,
                ..Quotas::default()
            },
        },
        session: None,
        fallback_step: None,
    }
}

async fn a_budget_refuses_once_the_days_bytes_reach_it_until_midnight_utc(backend: Backend) {
    let Some(mut f) = Fixture::on(backend, config()).await else {
        return;
    };
    const BUDGET: u64 = 1_000;
    let spend = |n: u64| bytes("team-a", "p1", None, "example.com", n / 4, n - n / 4);
    f.clock_to(22 * HOUR_MS);
    // Work under way: leases granted while under the budget stay, whatever they carry.
    let under_way = granted(f.ledger.acquire(acquire("team-a", Some(BUDGET))).await);
    f.record(vec![spend(600)]).await;
    granted(f.ledger.acquire(acquire("team-a", Some(BUDGET))).await);
    f.record(vec![spend(399)]).await;
    granted(f.ledger.acquire(acquire("team-a", Some(BUDGET))).await);
    // The byte that reaches the budget, and what the leases under way carry after it.
    assert_eq!(
        f.record(vec![spend(1), spend(500)]).await,
        today(&[("team-a", 1_500)])
    );
    let refusal = |outcome| match outcome {
        Ok(AcquireOutcome::QuotaExceeded(refused)) => refused,
        other => panic!("expected a refusal for the budget, got {other:?}"),
    };
    f.clock_to(23 * HOUR_MS);
    let refused = refusal(f.ledger.acquire(acquire("team-a", Some(BUDGET))).await);
    assert_eq!(refused.quota, QuotaKind::BytesPerDay);
    assert_eq!(refused.limit, 1_000.0);
    assert_eq!(
        refused.retry_after,
        Duration::from_secs(3600),
        "it frees at midnight UTC"
    );
    // The lease under way is still the tenant's; other tenants and a larger budget go on.
    assert!(
        f.ledger
            .get(&under_way.id, "team-a")
            .await
            .unwrap()
            .is_some()
    );
    granted(f.ledger.acquire(acquire("team-b", Some(BUDGET))).await);
    granted(f.ledger.acquire(acquire("team-a", Some(2_000))).await);
    granted(f.ledger.acquire(acquire("team-a", None)).await);
    // Across a restart the day's bytes still refuse.
    f.reopen().await;
    refusal(f.ledger.acquire(acquire("team-a", Some(BUDGET))).await);
    f.clock_to(24 * HOUR_MS - 1);
    refusal(f.ledger.acquire(acquire("team-a", Some(BUDGET))).await);
    // The day's turn frees it.
    f.clock_to(24 * HOUR_MS);
    granted(f.ledger.acquire(acquire("team-a", Some(BUDGET))).await);
    assert_eq!(f.record(vec![spend(10)]).await, today(&[("team-a", 10)]));
    f.self_check().await;
}

crate::on_both_backends!(
    a_budget_refuses_once_the_days_bytes_reach_it_until_midnight_utc,
    bytes_add_up_per_hour_and_row_and_read_back_oldest_first,
    a_tenants_day_starts_again_at_midnight_utc_and_survives_a_restart,
    sweep_drops_traffic_rows_whose_hour_ended_before_the_retention,
);
