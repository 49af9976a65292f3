//! Bytes through the gateway in the ledger's hourly traffic rows, each behaviour test run on
//! both backends (a real SQLite file, a fresh database on the real PostgreSQL server): bytes
//! added up per (hour, tenant, proxy, pool, target), read back since an hour, each tenant's
//! bytes of the UTC day answered, swept after the retention, kept across a restart. Time
//! only moves through the ledger's `ManualClock`.

use crate::support;

use std::collections::HashMap;
use std::time::Duration;

use proxy_operator::ledger::{
    HOUR_MS, LedgerConfig, SweepStats, TrafficBytes, TrafficHour, day_start,
};
use support::ledger::{Backend, Fixture, start};

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
        tenant: b.tenant.clone(),
        namespace: b.namespace.clone(),
        name: b.name.clone(),
        pool: b.pool.clone(),
        target: b.target.clone(),
        up: b.up,
        down: b.down,
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

crate::on_both_backends!(
    bytes_add_up_per_hour_and_row_and_read_back_oldest_first,
    a_tenants_day_starts_again_at_midnight_utc_and_survives_a_restart,
    sweep_drops_traffic_rows_whose_hour_ended_before_the_retention,
);
