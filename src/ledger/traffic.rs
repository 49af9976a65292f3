//! Bytes through the gateway kept in the ledger, per UTC hour, tenant, proxy and target
//! (`traffic_hours`), so an engineer can ask what a team used yesterday and a tenant's
//! `bytesPerDay` budget is decided where its other quotas are. What both backends share: the
//! rows, the hour and day arithmetic at the ledger's clock, and how one batch of a gateway's
//! bytes is merged before it is written.

use std::collections::HashMap;
use std::time::Duration;

use serde::Serialize;

/// Milliseconds in an hour.
pub const HOUR_MS: i64 = 3_600_000;
/// Milliseconds in a (UTC) day.
pub const DAY_MS: i64 = 24 * HOUR_MS;

/// One UTC hour of bytes through the gateway for one tenant, proxy and target: a row of
/// `traffic_hours`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TrafficHour {
    /// Start of the UTC hour, ms since the Unix epoch.
    pub hour_ms: i64,
    /// Whose bytes, through which proxy, to which target, and how many.
    #[serde(flatten)]
    pub bytes: TrafficBytes,
}

/// Bytes a gateway relayed for one tenant through one proxy to one target since its last
/// flush: [`Ledger::record_traffic`](super::Ledger::record_traffic) adds them to the hour
/// holding the ledger's clock.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TrafficBytes {
    /// The tenant whose requests carried the bytes.
    pub tenant: String,
    /// The proxy's namespace.
    pub namespace: String,
    /// The proxy's name.
    pub name: String,
    /// The proxy's ProxyPool, if any.
    pub pool: Option<String>,
    /// The target (host).
    pub target: String,
    /// Bytes to the target.
    pub up: u64,
    /// Bytes to the crawler.
    pub down: u64,
}

impl TrafficBytes {
    /// Bytes both ways.
    pub fn total(&self) -> u64 {
        self.up.saturating_add(self.down)
    }
}

/// The start of the UTC hour holding `now_ms`.
pub fn hour_start(now_ms: i64) -> i64 {
    now_ms.saturating_sub(now_ms.rem_euclid(HOUR_MS))
}

/// The start of the UTC day holding `now_ms`.
pub fn day_start(now_ms: i64) -> i64 {
    now_ms.saturating_sub(now_ms.rem_euclid(DAY_MS))
}

/// How long from `now_ms` until the next UTC day begins (at least 1 ms).
pub fn until_next_day(now_ms: i64) -> Duration {
    let next = day_start(now_ms).saturating_add(DAY_MS);
    Duration::from_millis(next.saturating_sub(now_ms).max(1).unsigned_abs())
}

/// The hour start before which the sweep deletes rows at `now_ms`: those whose hour ended
/// before the last `retention` began.
pub(crate) fn retention_cutoff(now_ms: i64, retention_ms: i64) -> i64 {
    now_ms.saturating_sub(retention_ms).saturating_sub(HOUR_MS)
}

/// The key of a row within one hour.
pub(crate) type RowKey<'a> = (&'a str, &'a str, &'a str, &'a str, &'a str);

/// `bytes` merged by row (tenant, namespace, name, pool, target), rows with no byte dropped,
/// sorted by key, so a write touches each row once and every writer takes the rows' locks in
/// the same order. The pool is stored as `''` for none.
pub(crate) fn merged(bytes: &[TrafficBytes]) -> Vec<(RowKey<'_>, u64, u64)> {
    let mut rows: HashMap<RowKey<'_>, (u64, u64)> = HashMap::new();
    for b in bytes.iter().filter(|b| b.up > 0 || b.down > 0) {
        let key = (
            b.tenant.as_str(),
            b.namespace.as_str(),
            b.name.as_str(),
            b.pool.as_deref().unwrap_or(""),
            b.target.as_str(),
        );
        let row = rows.entry(key).or_default();
        row.0 = row.0.saturating_add(b.up);
        row.1 = row.1.saturating_add(b.down);
    }
    let mut rows: Vec<_> = rows.into_iter().map(|(k, (u, d))| (k, u, d)).collect();
    rows.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    rows
}

/// Bytes per tenant in `rows` (up and down).
pub(crate) fn per_tenant<'a>(rows: &[(RowKey<'a>, u64, u64)]) -> HashMap<&'a str, u64> {
    let mut tenants: HashMap<&str, u64> = HashMap::new();
    for ((tenant, ..), up, down) in rows {
        let sum = tenants.entry(tenant).or_default();
        *sum = sum.saturating_add(up.saturating_add(*down));
    }
    tenants
}

/// A stored pool (`''` for none) as the rows read it.
pub(crate) fn pool_of(stored: String) -> Option<String> {
    Some(stored).filter(|p| !p.is_empty())
}

/// A byte count as an SQL integer (saturating: 8 EiB per row per hour is out of reach).
pub(crate) fn to_sql(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

/// An SQL byte count (never negative) as a count.
pub(crate) fn from_sql(bytes: i64) -> u64 {
    u64::try_from(bytes).unwrap_or(0)
}

/// A tenant's bytes of one UTC day, as the SQLite writer keeps it in memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct DayBytes {
    /// Start of the day counted.
    pub day_ms: i64,
    /// Bytes up and down in it.
    pub bytes: u64,
}

impl DayBytes {
    /// The bytes counted on the day holding `now_ms` (0 once that day is over).
    pub fn at(self, now_ms: i64) -> u64 {
        if self.day_ms == day_start(now_ms) {
            self.bytes
        } else {
            0
        }
    }

    /// With `bytes` more counted at `now_ms`: a new day starts from them.
    pub fn added(self, bytes: u64, now_ms: i64) -> Self {
        DayBytes {
            day_ms: day_start(now_ms),
            bytes: self.at(now_ms).saturating_add(bytes),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hours_and_days_are_utc_and_aligned_to_the_epoch() {
        // 2026-12-07T13:45:10.5Z
        let now = 1_796_651_110_500;
        assert_eq!(hour_start(now), 1_796_648_400_000);
        assert_eq!(day_start(now), 1_796_601_600_000);
        assert_eq!(
            until_next_day(now),
            Duration::from_millis((1_796_601_600_000 + DAY_MS - now) as u64)
        );
        assert_eq!(until_next_day(day_start(now)), Duration::from_secs(86_400));
        assert_eq!(until_next_day(day_start(now) - 1), Duration::from_millis(1));
        assert_eq!(hour_start(-1), -HOUR_MS);
        assert_eq!(retention_cutoff(10 * HOUR_MS, 2 * HOUR_MS), 7 * HOUR_MS);
    }

    #[test]
    fn a_days_bytes_count_until_the_days_turn() {
        let day = 20 * DAY_MS;
        let counted = DayBytes::default().added(100, day + 5);
        assert_eq!(
            counted,
            DayBytes {
                day_ms: day,
                bytes: 100
            }
        );
        assert_eq!(counted.added(50, day + HOUR_MS).at(day + DAY_MS - 1), 150);
        assert_eq!(counted.at(day + DAY_MS), 0);
        assert_eq!(
            counted.added(7, day + DAY_MS),
            DayBytes {
                day_ms: day + DAY_MS,
                bytes: 7
            }
        );
    }

    #[test]
    fn bytes_merge_by_row_sorted_without_empty_rows() {
        let bytes = |tenant: &str, target: &str, pool: Option<&str>, up, down| TrafficBytes {
            tenant: tenant.into(),
            namespace: "crawl".into(),
            name: "p".into(),
            pool: pool.map(str::to_owned),
            target: target.into(),
            up,
            down,
        };
        let batch = [
            bytes("b", "x.example", None, 1, 2),
            bytes("a", "y.example", Some("pool"), 10, 20),
            bytes("b", "x.example", None, 3, 4),
            bytes("a", "z.example", None, 0, 0),
        ];
        let rows = merged(&batch);
        assert_eq!(
            rows,
            [
                (("a", "crawl", "p", "pool", "y.example"), 10, 20),
                (("b", "crawl", "p", "", "x.example"), 4, 6),
            ]
        );
        let tenants = per_tenant(&rows);
        assert_eq!(tenants.get("a"), Some(&30));
        assert_eq!(tenants.get("b"), Some(&10));
        assert_eq!(pool_of(String::new()), None);
        assert_eq!(pool_of("p".into()), Some("p".into()));
    }
}
