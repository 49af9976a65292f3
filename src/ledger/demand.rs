//! Unmet demand of ProxyPools: requests refused (for capacity, or because no member was
//! Ready) that a member of a pool would have served, counted per pool per [`DEMAND_BUCKET`]
//! in the ledger's `pool_demand` table, so the leader scales pools from every replica's
//! refusals. What both backends share: the bucket arithmetic, at the ledger's clock, and the
//! pools one refusal counts for.

use std::time::Duration;

use super::config::millis;
use super::{DEMAND_BUCKET, DEMAND_RETENTION};

/// [`DEMAND_BUCKET`] in milliseconds (never 0).
fn bucket_ms() -> i64 {
    millis(DEMAND_BUCKET).max(1)
}

/// The start (ms since the epoch) of the bucket holding `now_ms`: buckets are aligned to the
/// epoch, so every replica puts the same instant in the same bucket.
pub(crate) fn bucket_start(now_ms: i64) -> i64 {
    now_ms.saturating_sub(now_ms.rem_euclid(bucket_ms()))
}

/// The buckets overlapping the last `window` at `now_ms`, as the bounds of their starts:
/// `(after, until)` selects `after < bucket_start_ms <= until`. A bucket overlaps when it
/// ends after the window's start and starts no later than `now_ms`, so the bucket holding
/// `now_ms` always counts, even for an empty window, and a bucket that starts in the future
/// (written by a clock ahead of this one) does not.
pub(crate) fn window_bounds(now_ms: i64, window: Duration) -> (i64, i64) {
    let after = now_ms
        .saturating_sub(millis(window))
        .saturating_sub(bucket_ms());
    (after, now_ms)
}

/// The bucket start at or before which the sweep deletes demand at `now_ms`: the buckets that
/// ended before the last [`DEMAND_RETENTION`] began (those `recent_demand(DEMAND_RETENTION)`
/// no longer counts).
pub(crate) fn retention_cutoff(now_ms: i64) -> i64 {
    window_bounds(now_ms, DEMAND_RETENTION).0
}

/// The pools one refusal counts for: each once (one request is one request, however often
/// its pool is named), sorted, so every write takes the rows' locks in the same order.
pub(crate) fn distinct_pools(pools: &[String]) -> Vec<&str> {
    let mut distinct: Vec<&str> = pools.iter().map(String::as_str).collect();
    distinct.sort_unstable();
    distinct.dedup();
    distinct
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_aligned_to_the_epoch() {
        assert_eq!(bucket_start(0), 0);
        assert_eq!(bucket_start(9_999), 0);
        assert_eq!(bucket_start(10_000), 10_000);
        assert_eq!(bucket_start(1_767_225_612_345), 1_767_225_610_000);
        // Before the epoch too (a clock far off), never a bucket after the instant.
        assert_eq!(bucket_start(-1), -10_000);
        assert_eq!(bucket_start(-10_000), -10_000);
    }

    #[test]
    fn a_window_selects_the_buckets_overlapping_it() {
        let overlapping = |now: i64, window: Duration| -> Vec<i64> {
            let (after, until) = window_bounds(now, window);
            (-3..=3)
                .map(|i| bucket_start(now) + i * 10_000)
                .filter(|start| *start > after && *start <= until)
                .collect()
        };
        // At 125 s: a 20 s window [105 s, 125 s] overlaps the buckets at 100, 110 and 120 s.
        assert_eq!(
            overlapping(125_000, Duration::from_secs(20)),
            [100_000, 110_000, 120_000]
        );
        // A window starting on a bucket boundary does not reach into the bucket before it.
        assert_eq!(
            overlapping(130_000, Duration::from_secs(20)),
            [110_000, 120_000, 130_000]
        );
        // An empty window is the bucket holding now.
        assert_eq!(overlapping(125_000, Duration::ZERO), [120_000]);
        // Saturates instead of overflowing.
        assert_eq!(
            window_bounds(i64::MIN + 5, Duration::from_secs(60)).0,
            i64::MIN
        );
        assert_eq!(window_bounds(0, Duration::MAX).0, i64::MIN);
    }

    #[test]
    fn the_sweep_keeps_the_buckets_the_retention_window_overlaps() {
        // At 1005 s the retention window [405 s, 1005 s] overlaps the bucket at 400 s: the
        // sweep deletes the buckets starting at or before 395 s, the one at 390 s the last.
        assert_eq!(retention_cutoff(1_005_000), 395_000);
        // At 1010 s the window starts where the bucket at 400 s ends: that one goes too.
        assert_eq!(retention_cutoff(1_010_000), 400_000);
    }

    #[test]
    fn a_refusal_counts_once_per_distinct_pool_in_a_fixed_order() {
        let pools = ["crawl/b", "crawl/a", "crawl/b", "other/a"].map(String::from);
        assert_eq!(distinct_pools(&pools), ["crawl/a", "crawl/b", "other/a"]);
        assert!(distinct_pools(&[]).is_empty());
    }
}
