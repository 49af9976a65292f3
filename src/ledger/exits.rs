//! Proxies' exit addresses in the ledger: the exit each proxy was last seen with
//! (`proxy_exits`) and the history of changes (`exit_changes`), so a change is recorded once
//! however many checks (or replicas) see it, and a restart keeps when each exit last changed.
//! The statements are the same text on both backends where they can be (`$n` parameters).

use serde::Serialize;

use crate::resources::proxy::ProxyId;

/// The most exit changes one read returns.
pub const MAX_EXIT_CHANGES: usize = 100;

/// Refresh a proxy's `confirmed_at` when it is older than this share of the history
/// retention (1/2), so a stable exit's row outlives the sweep without a write per check.
pub const CONFIRM_DIVISOR: u32 = 2;

/// What an exit check found, to record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitRecord {
    /// The proxy.
    pub proxy: ProxyId,
    /// Its exit address, as text.
    pub exit_ip: String,
    /// The exit's country, when a database knows it.
    pub country: Option<String>,
    /// The exit's autonomous system, when a database knows it.
    pub asn: Option<i64>,
}

/// What the ledger knows of a proxy's exit after recording one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitSeen {
    /// When the exit recorded last changed (first seen), in ms since the Unix epoch.
    pub changed_at_ms: i64,
    /// Whether this record changed it (and appended a history row).
    pub changed: bool,
}

/// One change of a proxy's exit, as the status page lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExitChange {
    /// Position in the history (newer is larger).
    pub seq: i64,
    /// When the new exit was first seen, in milliseconds since the Unix epoch.
    pub at_ms: i64,
    /// The proxy's namespace.
    pub namespace: String,
    /// The proxy's name.
    pub name: String,
    /// The exit before (absent for the first one seen).
    #[serde(rename = "previousIP", skip_serializing_if = "Option::is_none")]
    pub previous_ip: Option<String>,
    /// The new exit.
    #[serde(rename = "exitIP")]
    pub exit_ip: String,
    /// Its country, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub country: Option<String>,
    /// Its autonomous system, when known.
    #[serde(rename = "asn", skip_serializing_if = "Option::is_none")]
    pub asn: Option<i64>,
}

/// What a recorded row says, and what to do: the pure decision both backends make after
/// reading (and, on PostgreSQL, locking) the proxy's row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExitWrite {
    /// Same exit, confirmed recently enough: nothing to write.
    Keep { changed_at: i64 },
    /// Same exit: refresh `confirmed_at` only.
    Confirm { changed_at: i64 },
    /// A new exit (or the first): write the row and a history row.
    Change,
}

/// Decides the write for `record` at `now`, given the proxy's row (`(exit_ip, changed_at,
/// confirmed_at)`) if any.
pub(crate) fn exit_write(
    row: Option<(&str, i64, i64)>,
    exit_ip: &str,
    now: i64,
    confirm_after_ms: i64,
) -> ExitWrite {
    match row {
        Some((ip, changed_at, confirmed_at)) if ip == exit_ip => {
            if now.saturating_sub(confirmed_at) < confirm_after_ms {
                ExitWrite::Keep { changed_at }
            } else {
                ExitWrite::Confirm { changed_at }
            }
        }
        _ => ExitWrite::Change,
    }
}

/// The proxy's row.
pub(crate) const SELECT_EXIT_SQL: &str =
    "SELECT exit_ip, changed_at, confirmed_at FROM proxy_exits WHERE proxy_uid = $1";

/// Sets the proxy's row: `$1` uid, `$2` exit, `$3` changed at, `$4` confirmed at.
pub(crate) const UPSERT_EXIT_SQL: &str = "INSERT INTO proxy_exits (proxy_uid, exit_ip, changed_at, confirmed_at) \
     VALUES ($1, $2, $3, $4) ON CONFLICT (proxy_uid) DO UPDATE \
     SET exit_ip = excluded.exit_ip, changed_at = excluded.changed_at, \
     confirmed_at = excluded.confirmed_at";

/// Appends a change: `$1` at, `$2` namespace, `$3` name, `$4` uid, `$5` previous, `$6` exit,
/// `$7` country, `$8` asn.
pub(crate) const INSERT_CHANGE_SQL: &str = "INSERT INTO exit_changes (at, proxy_namespace, proxy_name, proxy_uid, previous_ip, \
     exit_ip, country, asn) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)";

/// The columns of an [`ExitChange`], in its order.
macro_rules! change_columns {
    () => {
        "SELECT seq, at, proxy_namespace, proxy_name, previous_ip, exit_ip, country, asn \
         FROM exit_changes"
    };
}

/// The newest `$1` changes.
pub(crate) const CHANGES_SQL: &str = concat!(change_columns!(), " ORDER BY seq DESC LIMIT $1");

/// The newest `$3` changes of proxy `$1`/`$2`.
pub(crate) const PROXY_CHANGES_SQL: &str = concat!(
    change_columns!(),
    " WHERE proxy_namespace = $1 AND proxy_name = $2 ORDER BY seq DESC LIMIT $3"
);

/// Prunes history before `$1`.
pub(crate) const PRUNE_CHANGES_SQL: &str = "DELETE FROM exit_changes WHERE at < $1";

/// Prunes the rows of proxies not confirmed since `$1` (gone).
pub(crate) const PRUNE_EXITS_SQL: &str = "DELETE FROM proxy_exits WHERE confirmed_at < $1";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_is_written_once_and_confirmations_are_rare() {
        let day = 86_400_000;
        let cases = [
            ("first exit", None, "192.0.2.1", 10, ExitWrite::Change),
            (
                "same exit, confirmed lately",
                Some(("192.0.2.1", 5, 8)),
                "192.0.2.1",
                10,
                ExitWrite::Keep { changed_at: 5 },
            ),
            (
                "same exit, confirmed long ago",
                Some(("192.0.2.1", 5, 8)),
                "192.0.2.1",
                8 + day,
                ExitWrite::Confirm { changed_at: 5 },
            ),
            (
                "another exit",
                Some(("192.0.2.1", 5, 8)),
                "192.0.2.2",
                10,
                ExitWrite::Change,
            ),
        ];
        for (case, row, ip, now, want) in cases {
            assert_eq!(exit_write(row, ip, now, day), want, "{case}");
        }
    }
}
