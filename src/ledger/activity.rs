//! What the ledger says of recent activity, for the status page: leases and reports per
//! target over a window, the cooldowns in force, and the latest history events.
//!
//! Each read is bounded whatever the history holds: the window's counts read at most the
//! last [`SCAN_EVENTS`] events (by `seq`, the history's primary key, so the bound is a range
//! of the key), the cooldowns at most [`MAX_COOLDOWNS`], and the events asked for at most
//! [`MAX_EVENTS`]. A read may be one tenant's only (its leases, reports and events; `NULL`:
//! every tenant's). The statements are the same text on both backends (`$n` parameters, which
//! SQLite numbers in the order they first appear, so each statement names them in ascending
//! order), so the two cannot drift.

use std::collections::BTreeMap;

use serde::Serialize;

/// The most history events one read of the window's counts looks at (the newest ones).
pub const SCAN_EVENTS: i64 = 100_000;

/// The most cooldowns one read returns (those ending last first).
pub const MAX_COOLDOWNS: i64 = 1_000;

/// The most history events one read returns.
pub const MAX_EVENTS: usize = 500;

/// Acquires and reports per target among the newest `$1` events at or after `$2` (ms), of
/// tenant `$3` (`NULL`: every tenant).
pub(crate) const TARGET_COUNTS_SQL: &str = "SELECT target, kind, result, COUNT(*) FROM lease_events \
     WHERE seq > (SELECT COALESCE(MAX(seq), 0) FROM lease_events) - $1 AND at >= $2 \
     AND target IS NOT NULL AND kind IN ('acquired', 'reported') \
     AND (CAST($3 AS TEXT) IS NULL OR tenant = $3) \
     GROUP BY target, kind, result";

/// The cooldowns in force at `$1` (ms), ending last first, at most `$2`.
pub(crate) const COOLDOWNS_SQL: &str = "SELECT target, proxy_namespace, proxy_name, until, result \
     FROM cooldowns WHERE until > $1 ORDER BY until DESC, target LIMIT $2";

/// The columns of an [`EventEntry`], in its order.
macro_rules! event_columns {
    () => {
        "SELECT seq, at, lease_id, kind, proxy_namespace, proxy_name, target, result, reason, \
         client, tenant FROM lease_events"
    };
}

/// The newest `$1` events.
pub(crate) const EVENTS_SQL: &str = concat!(event_columns!(), " ORDER BY seq DESC LIMIT $1");

/// The newest `$3` events of tenant `$1` among the newest `$2`.
pub(crate) const TENANT_EVENTS_SQL: &str = concat!(
    event_columns!(),
    " WHERE tenant = $1 AND seq > (SELECT COALESCE(MAX(seq), 0) FROM lease_events) - $2 \
     ORDER BY seq DESC LIMIT $3"
);

/// The newest `$5` events of proxy `$1`/`$2` among the newest `$3`, of tenant `$4` (`NULL`:
/// every tenant).
pub(crate) const PROXY_EVENTS_SQL: &str = concat!(
    event_columns!(),
    " WHERE proxy_namespace = $1 AND proxy_name = $2 \
     AND seq > (SELECT COALESCE(MAX(seq), 0) FROM lease_events) - $3 \
     AND (CAST($4 AS TEXT) IS NULL OR tenant = $4) \
     ORDER BY seq DESC LIMIT $5"
);

/// Which history events to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventsQuery {
    /// Only this proxy's (`namespace`, `name`), among the newest [`SCAN_EVENTS`]; all when `None`.
    pub proxy: Option<(String, String)>,
    /// Only this tenant's (among the newest [`SCAN_EVENTS`]); every tenant's when `None`.
    pub tenant: Option<String>,
    /// How many, newest first (capped at [`MAX_EVENTS`]).
    pub limit: usize,
}

impl EventsQuery {
    /// The limit as the statements bind it.
    pub(crate) fn bound(&self) -> i64 {
        i64::try_from(self.limit.min(MAX_EVENTS)).unwrap_or(0)
    }
}

/// One history event, as the status page lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct EventEntry {
    /// Position in the history (newer is larger).
    pub seq: i64,
    /// When, in milliseconds since the Unix epoch.
    pub at_ms: i64,
    /// The lease.
    #[serde(rename = "leaseID")]
    pub lease_id: String,
    /// `acquired`, `renewed`, `released`, `expired` or `reported`.
    pub kind: String,
    /// The proxy's namespace.
    pub namespace: String,
    /// The proxy's name.
    pub name: String,
    /// The lease's target.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// What a report said.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    /// Why the operator released the lease.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The crawler that took the lease (`acquired` events).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client: Option<String>,
    /// The tenant that holds the lease.
    pub tenant: String,
}

/// Reports on a target, by result.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReportCounts {
    /// `ok` reports.
    pub ok: u64,
    /// `rate_limited` reports.
    pub rate_limited: u64,
    /// `blocked` reports.
    pub blocked: u64,
    /// `error` reports.
    pub error: u64,
}

impl ReportCounts {
    /// Every report.
    pub fn total(&self) -> u64 {
        self.ok + self.rate_limited + self.blocked + self.error
    }

    fn add(&mut self, result: &str, count: u64) {
        match result {
            "ok" => self.ok += count,
            "rate_limited" => self.rate_limited += count,
            "blocked" => self.blocked += count,
            _ => self.error += count,
        }
    }
}

/// A (proxy, target) pair in cooldown.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ActiveCooldown {
    /// The target acquires skip the proxy for.
    pub target: String,
    /// The proxy's namespace.
    pub namespace: String,
    /// The proxy's name.
    pub name: String,
    /// When it ends, in milliseconds since the Unix epoch.
    pub until_ms: i64,
    /// `rate_limited` or `blocked`.
    pub result: String,
}

/// One target's leases and reports over the window.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TargetCounts {
    /// Leases acquired for it.
    pub leases: u64,
    /// Reports on it, by result.
    pub reports: ReportCounts,
}

/// What the ledger recorded over a window.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Activity {
    /// Per target (by name).
    pub targets: BTreeMap<String, TargetCounts>,
    /// The cooldowns in force now, ending last first.
    pub cooldowns: Vec<ActiveCooldown>,
}

impl Activity {
    /// Adds one row of [`TARGET_COUNTS_SQL`]: `count` events of `kind` (with `result`, for
    /// reports) on `target`.
    pub(crate) fn add(&mut self, target: String, kind: &str, result: Option<&str>, count: u64) {
        let counts = self.targets.entry(target).or_default();
        match (kind, result) {
            ("acquired", _) => counts.leases += count,
            ("reported", Some(result)) => counts.reports.add(result, count),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_fold_into_counts_per_target() {
        let mut activity = Activity::default();
        let rows = [
            ("a.example", "acquired", None, 5),
            ("a.example", "reported", Some("ok"), 3),
            ("a.example", "reported", Some("rate_limited"), 2),
            ("b.example", "reported", Some("blocked"), 1),
            ("b.example", "reported", Some("error"), 4),
            ("b.example", "acquired", None, 1),
        ];
        for (target, kind, result, count) in rows {
            activity.add(target.to_owned(), kind, result, count);
        }
        let a = &activity.targets["a.example"];
        assert_eq!(a.leases, 5);
        assert_eq!(
            a.reports,
            ReportCounts {
                ok: 3,
                rate_limited: 2,
                blocked: 0,
                error: 0
            }
        );
        let b = &activity.targets["b.example"];
        assert_eq!((b.leases, b.reports.blocked, b.reports.error), (1, 1, 4));
        assert_eq!(b.reports.total(), 5);
    }

    #[test]
    fn every_statement_names_its_parameters_in_ascending_order() {
        // SQLite numbers `$n` by first appearance: out of order, a positional binding lands
        // on the wrong parameter there while PostgreSQL reads it right.
        for sql in [
            TARGET_COUNTS_SQL,
            COOLDOWNS_SQL,
            EVENTS_SQL,
            TENANT_EVENTS_SQL,
            PROXY_EVENTS_SQL,
        ] {
            let mut seen: Vec<u32> = Vec::new();
            for part in sql.split('$').skip(1) {
                let digits: String = part.chars().take_while(char::is_ascii_digit).collect();
                let n: u32 = digits.parse().unwrap();
                if !seen.contains(&n) {
                    seen.push(n);
                }
            }
            let ascending: Vec<u32> = (1..=u32::try_from(seen.len()).unwrap()).collect();
            assert_eq!(seen, ascending, "{sql}");
        }
    }

    #[test]
    fn the_limit_is_capped() {
        for (asked, bound) in [(0, 0), (100, 100), (MAX_EVENTS + 1, MAX_EVENTS as i64)] {
            let query = EventsQuery {
                proxy: None,
                tenant: None,
                limit: asked,
            };
            assert_eq!(query.bound(), bound, "{asked}");
        }
    }
}
