//! The values the ledger hands out and takes in: leases, their states, report results,
//! acquire candidates and outcomes.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use jiff::Timestamp;

use super::candidates::Candidates;
use super::quota::{QuotaExceeded, Tenancy};
use crate::resources::proxy::ProxyId;

/// Where a lease is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LeaseState {
    /// Held by a crawler and counting towards its proxy's capacity.
    Active,
    /// Given back by the crawler before it expired.
    Released,
    /// Its TTL ran out.
    Expired,
}

impl LeaseState {
    /// The state as stored in the `leases.state` column.
    pub fn as_str(self) -> &'static str {
        match self {
            LeaseState::Active => "active",
            LeaseState::Released => "released",
            LeaseState::Expired => "expired",
        }
    }
}

impl fmt::Display for LeaseState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for LeaseState {
    type Err = UnknownValue;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "active" => Ok(LeaseState::Active),
            "released" => Ok(LeaseState::Released),
            "expired" => Ok(LeaseState::Expired),
            other => Err(UnknownValue::new("lease state", other)),
        }
    }
}

/// What a crawler observed while using a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReportResult {
    /// Requests went through.
    Ok,
    /// The target rate-limited the proxy: puts (proxy, target) into cooldown.
    RateLimited,
    /// The target blocked the proxy: puts (proxy, target) into cooldown.
    Blocked,
    /// Something else went wrong (recorded only).
    Error,
}

impl ReportResult {
    /// Every result, in the order the API documents them.
    pub const ALL: [ReportResult; 4] = [
        ReportResult::Ok,
        ReportResult::RateLimited,
        ReportResult::Blocked,
        ReportResult::Error,
    ];

    /// The result as the API and the `lease_events.result` column spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            ReportResult::Ok => "ok",
            ReportResult::RateLimited => "rate_limited",
            ReportResult::Blocked => "blocked",
            ReportResult::Error => "error",
        }
    }

    /// Whether this result puts the (proxy, target) pair into cooldown.
    pub fn starts_cooldown(self) -> bool {
        matches!(self, ReportResult::RateLimited | ReportResult::Blocked)
    }
}

impl fmt::Display for ReportResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ReportResult {
    type Err = UnknownValue;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ReportResult::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| UnknownValue::new("report result", s))
    }
}

/// A string that names none of the values of an enumeration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} {value:?}")]
pub struct UnknownValue {
    what: &'static str,
    value: String,
}

impl UnknownValue {
    fn new(what: &'static str, value: &str) -> Self {
        Self {
            what,
            value: value.to_owned(),
        }
    }
}

/// Longest release reason the ledger records, in bytes.
pub(crate) const MAX_RELEASE_REASON: usize = 64;

/// Whether `reason` can be recorded as a release reason: a machine code of 1 to
/// [`MAX_RELEASE_REASON`] lowercase ASCII letters, digits, `_`, `-` or `.`. Codes rather than
/// free text, so the history can be grouped and filtered by reason.
pub(crate) fn is_release_reason(reason: &str) -> bool {
    (1..=MAX_RELEASE_REASON).contains(&reason.len())
        && reason
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_-.".contains(&b))
}

/// A new lease ID: 12 hex digits of the acquisition time in milliseconds followed by 32 hex
/// digits of a 128-bit random number from a cryptographically secure generator seeded by the
/// OS. The random part makes it unguessable (it is a capability); the time prefix makes IDs
/// of consecutive leases neighbours in the ledger's indexes, so inserts stay cheap.
pub(crate) fn new_lease_id(acquired_at_ms: i64) -> String {
    let time = acquired_at_ms.clamp(0, 0xffff_ffff_ffff);
    format!("{time:012x}{:032x}", rand::random::<u128>())
}

/// A lease on one proxy. Its ID is a capability: whoever holds it, within its tenant, may
/// renew, release and report on the lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// Unguessable lease ID (time prefix and 128 random bits, 44 hex digits).
    pub id: String,
    /// The leased proxy.
    pub proxy: ProxyId,
    /// The target the crawler named when acquiring, if any.
    pub target: Option<String>,
    /// Where the lease is in its life, as of the moment it was read.
    pub state: LeaseState,
    /// When the lease was granted.
    pub acquired_at: Timestamp,
    /// When the lease stops (or stopped) counting towards capacity.
    pub expires_at: Timestamp,
    /// The TTL granted by the last acquire or renew (after the cap).
    pub ttl: Duration,
    /// When the lease was released, if it was.
    pub released_at: Option<Timestamp>,
    /// Why the operator ended the lease (e.g. `machine_lost`), if it did; `None` for leases
    /// a crawler released and for every other state.
    pub release_reason: Option<String>,
    /// The crawler that took it, when it said (free text).
    pub client: Option<String>,
    /// The tenant that holds it: only that tenant's tokens see or change it.
    pub tenant: String,
    /// The gateway session it serves, if it does.
    pub session: Option<String>,
}

/// A lease row's columns as a backend read them, turned into a [`Lease`] by one rule
/// whichever database they came from.
#[derive(Debug)]
pub(crate) struct LeaseRow<'a> {
    pub id: String,
    pub proxy: ProxyId,
    pub target: Option<String>,
    /// The `state` column, as stored.
    pub state: &'a str,
    /// Times in milliseconds since the epoch, as stored.
    pub acquired_at: i64,
    pub expires_at: i64,
    pub ttl_ms: i64,
    pub released_at: Option<i64>,
    pub release_reason: Option<String>,
    pub client: Option<String>,
    pub tenant: String,
    pub session: Option<String>,
}

/// A lease row that names no [`Lease`]: a state or a time no binary of ours wrote.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LeaseRowError {
    #[error("lease row: {0}")]
    State(#[from] UnknownValue),
    #[error("time {ms} ms: {source}")]
    Time { ms: i64, source: jiff::Error },
}

impl LeaseRow<'_> {
    /// The lease as of `now`: an active lease past its expiry reads as expired even before
    /// the sweep marks it, since a lease stops counting by time alone.
    pub fn decode(self, now: i64) -> Result<Lease, LeaseRowError> {
        let mut state: LeaseState = self.state.parse()?;
        if state == LeaseState::Active && self.expires_at <= now {
            state = LeaseState::Expired;
        }
        Ok(Lease {
            id: self.id,
            proxy: self.proxy,
            target: self.target,
            state,
            acquired_at: timestamp(self.acquired_at)?,
            expires_at: timestamp(self.expires_at)?,
            ttl: Duration::from_millis(self.ttl_ms.unsigned_abs()),
            released_at: self.released_at.map(timestamp).transpose()?,
            release_reason: self.release_reason,
            client: self.client,
            tenant: self.tenant,
            session: self.session,
        })
    }
}

/// A stored time (milliseconds since the epoch) as a timestamp.
pub(crate) fn timestamp(ms: i64) -> Result<Timestamp, LeaseRowError> {
    Timestamp::from_millisecond(ms).map_err(|source| LeaseRowError::Time { ms, source })
}

/// One acquire, as the API hands it to the ledger.
#[derive(Debug, Clone)]
pub struct AcquireRequest {
    /// Every proxy matching the selector, healthy or not. Shared: the ledger reads it in
    /// place and never copies it.
    pub candidates: Candidates,
    /// The target the crawler names (already normalised by the API); an empty one is none.
    pub target: Option<String>,
    /// The requested TTL; the ledger caps it at `max_ttl`.
    pub ttl: Duration,
    /// Makes a retried acquire return the lease the first attempt got.
    pub request: Option<RequestKey>,
    /// The crawler asking, when it says (recorded with the lease; free text).
    pub client: Option<String>,
    /// The tenant asking: the lease is its, its request ID is looked up among its own, and
    /// its quotas are checked.
    pub tenant: Tenancy,
    /// The gateway session the lease is for (its name), counted by the sessions quota.
    pub session: Option<String>,
    /// Which step of a fallback chain this acquire is (1: the first), recorded on the lease's
    /// `acquired` event; `None`: the acquire names no chain.
    pub fallback_step: Option<u32>,
}

/// What a crawler observed on a lease, for [`Ledger::report`](super::Ledger::report).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseReport {
    /// The outcome.
    pub result: ReportResult,
    /// The target it is about (already normalised); `None`: the lease's own target.
    pub target: Option<String>,
    /// How long the target asked to be left alone (a `Retry-After`): the length of the
    /// cooldown a `rate_limited` or `blocked` report starts, capped by the ledger's
    /// `max_cooldown`; `None`: its `cooldown`.
    pub cooldown: Option<Duration>,
    /// The exit of the proxy the lease went through, when the proxy has many (a rotating
    /// upstream's vendor session): a cooldown then lands on that exit and the target, never on
    /// the whole proxy. `None`: the proxy is one exit.
    pub exit: Option<String>,
}

/// The key of the cooldowns of a proxy (`exit` `None`), or of one exit of a proxy with many:
/// `UID/exit`.
pub fn cooldown_key<'a>(proxy_uid: &'a str, exit: Option<&str>) -> std::borrow::Cow<'a, str> {
    match exit {
        Some(exit) => format!("{proxy_uid}/{exit}").into(),
        None => proxy_uid.into(),
    }
}

impl LeaseReport {
    /// A report of `result` about `target` (`None`: the lease's own) asking for no particular
    /// cooldown length.
    pub fn new(result: ReportResult, target: Option<&str>) -> Self {
        LeaseReport {
            result,
            target: target.map(str::to_owned),
            cooldown: None,
            exit: None,
        }
    }

    /// The key a cooldown this report starts is kept under: the proxy's UID, or for one exit
    /// of a proxy with many, `UID/exit` (which no candidate's UID ever equals, so the proxy
    /// stays choosable for the target).
    pub fn cooled<'a>(&self, proxy_uid: &'a str) -> std::borrow::Cow<'a, str> {
        cooldown_key(proxy_uid, self.exit.as_deref())
    }
}

/// The idempotency key of an acquire: a client-chosen request ID and a fingerprint of what
/// was asked for.
///
/// The caller computes the fingerprint as a canonical string of the selector, target and TTL;
/// the ledger only compares it, so an ID reused for a different request is refused instead of
/// silently answered with an unrelated lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestKey {
    /// The client's request ID (the API accepts 1–128 printable ASCII characters).
    pub id: String,
    /// Canonical form of the request the ID was first used for.
    pub fingerprint: String,
}

/// The result of an acquire.
#[derive(Debug, Clone, PartialEq)]
pub enum AcquireOutcome {
    /// A lease was granted and recorded.
    Granted(Lease),
    /// The request ID was already used for the same request within the lease's window (until
    /// its `expires_at`): the lease it got, as it is now (possibly released).
    Replayed(Lease),
    /// No candidate could take a lease; why not.
    NoMatch(NoMatch),
    /// The tenant is at one of its quotas: nothing was looked at.
    QuotaExceeded(QuotaExceeded),
}

/// Why an acquire granted nothing. Every candidate is counted in exactly one bucket, in the
/// order cordoned, draining, unhealthy, at capacity, at the target limit, in cooldown.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NoMatch {
    /// Candidates offered.
    pub considered: u32,
    /// Cordoned candidates (`spec.cordoned: true`), healthy or not.
    pub cordoned: u32,
    /// Uncordoned draining candidates (being deleted or replaced), healthy or not.
    pub draining: u32,
    /// Healthy candidates with every lease slot taken (or `maxLeases: 0`).
    pub at_capacity: u32,
    /// Healthy candidates with a free slot whose (proxy, target) pair is cooling down.
    pub in_cooldown: u32,
    /// Candidates neither cordoned nor draining that the health engine considers unhealthy.
    pub unhealthy: u32,
    /// Healthy candidates with a free slot that hold as many leases for the target as the
    /// per-target limits allow (per proxy and target, or the whole fleet's for the target).
    pub at_target_limit: u32,
    /// The earliest moment a healthy candidate frees up (a lease expiry or a cooldown end);
    /// `None` when nothing will free up by itself.
    pub retry_after: Option<Timestamp>,
}

/// The main reason an acquire found nothing: what the API's and the gateway's refusals and
/// their metrics name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoMatchReason {
    /// No proxy matches the selector.
    NoProxies,
    /// Every matching proxy is cordoned.
    Cordoned,
    /// Every matching proxy is draining or cordoned, at least one draining.
    Draining,
    /// Every matching proxy that is neither cordoned nor draining is unhealthy.
    Unhealthy,
    /// Healthy proxies exist but every one is full.
    Capacity,
    /// Healthy proxies with free slots exist, none full, but some hold as many leases for the
    /// target as the per-target limits allow (and the rest cool down for it).
    TargetLimit,
    /// Healthy proxies with free slots exist, but all are cooling down for the target.
    Cooldown,
}

impl NoMatchReason {
    /// Every reason.
    pub const ALL: [NoMatchReason; 7] = [
        NoMatchReason::NoProxies,
        NoMatchReason::Cordoned,
        NoMatchReason::Draining,
        NoMatchReason::Unhealthy,
        NoMatchReason::Capacity,
        NoMatchReason::TargetLimit,
        NoMatchReason::Cooldown,
    ];

    /// The reason for a refused acquire: the first that explains it wholly (see
    /// [`NoMatch::reason`]). Cordoned and
    /// draining proxies are set aside on purpose, so they are the reason only when every
    /// matching proxy is set aside (`cordoned` when all are cordoned, `draining` when some
    /// drain: their replacements will come back by themselves); otherwise the reason is about
    /// the others.
    pub fn of(no_match: &NoMatch) -> Self {
        let uncordoned = no_match.considered.saturating_sub(no_match.cordoned);
        let available = uncordoned.saturating_sub(no_match.draining);
        if no_match.considered == 0 {
            NoMatchReason::NoProxies
        } else if uncordoned == 0 {
            NoMatchReason::Cordoned
        } else if available == 0 {
            NoMatchReason::Draining
        } else if no_match.unhealthy == available {
            NoMatchReason::Unhealthy
        } else if no_match.at_capacity > 0 {
            NoMatchReason::Capacity
        } else if no_match.at_target_limit > 0 {
            NoMatchReason::TargetLimit
        } else {
            NoMatchReason::Cooldown
        }
    }

    /// The reason as a metric label and API value.
    pub fn as_str(self) -> &'static str {
        match self {
            NoMatchReason::NoProxies => "no_proxies",
            NoMatchReason::Cordoned => "cordoned",
            NoMatchReason::Draining => "draining",
            NoMatchReason::Unhealthy => "unhealthy",
            NoMatchReason::Capacity => "capacity",
            NoMatchReason::TargetLimit => "target_limit",
            NoMatchReason::Cooldown => "cooldown",
        }
    }
}

impl NoMatch {
    /// The refusal of two selections that both found nothing (the steps of a fallback chain):
    /// every count summed, and the earlier moment something frees up.
    pub fn and(self, other: NoMatch) -> NoMatch {
        NoMatch {
            considered: self.considered + other.considered,
            cordoned: self.cordoned + other.cordoned,
            draining: self.draining + other.draining,
            at_capacity: self.at_capacity + other.at_capacity,
            in_cooldown: self.in_cooldown + other.in_cooldown,
            unhealthy: self.unhealthy + other.unhealthy,
            at_target_limit: self.at_target_limit + other.at_target_limit,
            retry_after: match (self.retry_after, other.retry_after) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            },
        }
    }

    /// The main reason nothing was granted.
    pub fn reason(&self) -> NoMatchReason {
        NoMatchReason::of(self)
    }

    /// Why nothing was granted, for people: every count.
    pub fn message(&self) -> String {
        format!(
            "no proxy can take a lease: {} match the selector, {} cordoned, {} draining, {} \
             unhealthy, {} at capacity, {} at the per-target limit, {} cooling down for the \
             target",
            self.considered,
            self.cordoned,
            self.draining,
            self.unhealthy,
            self.at_capacity,
            self.at_target_limit,
            self.in_cooldown
        )
    }
}

/// What one sweep did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepStats {
    /// Active leases whose TTL had run out, now marked expired.
    pub expired: u64,
    /// Released or expired leases deleted after the cooldown window.
    pub leases_pruned: u64,
    /// Cooldowns that had ended, deleted.
    pub cooldowns_pruned: u64,
    /// History rows older than the retention period, deleted.
    pub events_pruned: u64,
    /// Buckets of unmet demand (one per pool each) that ended before the last
    /// [`DEMAND_RETENTION`](super::DEMAND_RETENTION), deleted.
    pub demand_pruned: u64,
    /// Hourly traffic rows whose hour ended before the retention period, deleted.
    pub traffic_pruned: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_refusals_of_two_steps_add_up_and_free_up_at_the_earlier_moment() {
        let at = |s: i64| Timestamp::from_second(s).ok();
        let a = NoMatch {
            considered: 2,
            in_cooldown: 2,
            retry_after: at(200),
            ..NoMatch::default()
        };
        let b = NoMatch {
            considered: 3,
            at_capacity: 1,
            unhealthy: 2,
            retry_after: at(100),
            ..NoMatch::default()
        };
        let none = NoMatch::default();
        let cases = [
            (a, b, (5, 2, 1, 2, at(100))),
            (a, none, (2, 2, 0, 0, at(200))),
            (none, b, (3, 0, 1, 2, at(100))),
            (none, none, (0, 0, 0, 0, None)),
        ];
        for (x, y, (considered, in_cooldown, at_capacity, unhealthy, retry_after)) in cases {
            let got = x.and(y);
            assert_eq!(
                (
                    got.considered,
                    got.in_cooldown,
                    got.at_capacity,
                    got.unhealthy,
                    got.retry_after
                ),
                (considered, in_cooldown, at_capacity, unhealthy, retry_after)
            );
            assert_eq!(got, y.and(x), "order does not matter");
        }
    }

    #[test]
    fn report_results_round_trip_through_their_names() {
        for (name, result, cooldown) in [
            ("ok", ReportResult::Ok, false),
            ("rate_limited", ReportResult::RateLimited, true),
            ("blocked", ReportResult::Blocked, true),
            ("error", ReportResult::Error, false),
        ] {
            assert_eq!(name.parse::<ReportResult>(), Ok(result));
            assert_eq!(result.as_str(), name);
            assert_eq!(result.starts_cooldown(), cooldown, "{name}");
        }
        let err = "RateLimited".parse::<ReportResult>().unwrap_err();
        assert_eq!(err.to_string(), "unknown report result \"RateLimited\"");
    }

    #[test]
    fn lease_ids_sort_by_time_and_differ_in_their_random_part() {
        let ids: Vec<String> = (0..1000).map(|_| new_lease_id(1_767_225_600_000)).collect();
        let distinct: std::collections::HashSet<&str> = ids.iter().map(|id| &id[12..]).collect();
        assert_eq!(distinct.len(), ids.len());
        for id in &ids {
            assert_eq!(id.len(), 44, "{id}");
            assert!(id.starts_with("019b76daa800"), "{id}");
            assert!(
                id.bytes()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
            );
        }
        assert!(new_lease_id(1) < new_lease_id(2));
        assert!(new_lease_id(-5).starts_with("000000000000"));
    }

    #[test]
    fn release_reasons_are_short_machine_codes() {
        for ok in [
            "machine_lost",
            "machine_stopped",
            "machine_gone",
            "a",
            "v1.node-gone",
        ] {
            assert!(is_release_reason(ok), "{ok}");
        }
        let long = "x".repeat(MAX_RELEASE_REASON + 1);
        for bad in [
            "",
            "Machine_Lost",
            "machine lost",
            "lost\n",
            "é",
            long.as_str(),
        ] {
            assert!(!is_release_reason(bad), "{bad:?}");
        }
        assert!(is_release_reason(&long[1..]));
    }

    #[test]
    fn the_rejection_reason_is_the_first_that_explains_the_refusal_wholly() {
        let no_match =
            |considered, cordoned, draining, unhealthy, at_capacity, in_cooldown| NoMatch {
                considered,
                cordoned,
                draining,
                unhealthy,
                at_capacity,
                in_cooldown,
                ..NoMatch::default()
            };
        let cases = [
            ("nothing matches", no_match(0, 0, 0, 0, 0, 0), "no_proxies"),
            ("all cordoned", no_match(3, 3, 0, 0, 0, 0), "cordoned"),
            ("all draining", no_match(2, 0, 2, 0, 0, 0), "draining"),
            (
                "cordoned or draining",
                no_match(3, 2, 1, 0, 0, 0),
                "draining",
            ),
            ("all unhealthy", no_match(2, 0, 0, 2, 0, 0), "unhealthy"),
            (
                "the uncordoned are unhealthy",
                no_match(3, 1, 0, 2, 0, 0),
                "unhealthy",
            ),
            (
                "the others than the cordoned and draining are unhealthy",
                no_match(4, 1, 1, 2, 0, 0),
                "unhealthy",
            ),
            ("some full", no_match(4, 1, 0, 1, 1, 1), "capacity"),
            (
                "some full, some draining",
                no_match(3, 0, 2, 0, 1, 0),
                "capacity",
            ),
            ("all full", no_match(2, 0, 0, 0, 2, 0), "capacity"),
            ("cooling down", no_match(3, 1, 0, 1, 0, 1), "cooldown"),
            (
                "cooling down, some draining",
                no_match(2, 0, 1, 0, 0, 1),
                "cooldown",
            ),
        ];
        for (name, stats, reason) in cases {
            assert_eq!(stats.reason().as_str(), reason, "{name}");
        }
        let limited = |at_capacity, at_target_limit, in_cooldown| NoMatch {
            considered: 3,
            at_capacity,
            at_target_limit,
            in_cooldown,
            ..NoMatch::default()
        };
        assert_eq!(limited(0, 3, 0).reason(), NoMatchReason::TargetLimit);
        assert_eq!(limited(0, 1, 2).reason(), NoMatchReason::TargetLimit);
        assert_eq!(limited(1, 2, 0).reason(), NoMatchReason::Capacity);
    }

    #[test]
    fn a_lease_row_reads_as_of_now() {
        let row = |state, expires_at, released_at| LeaseRow {
            id: "l".into(),
            proxy: ProxyId {
                namespace: "crawl".into(),
                name: "a".into(),
                uid: "uid-a".into(),
            },
            target: None,
            state,
            acquired_at: 0,
            expires_at,
            ttl_ms: expires_at,
            released_at,
            release_reason: None,
            client: None,
            tenant: "default".into(),
            session: None,
        };
        let cases = [
            (
                "active before its expiry",
                row("active", 100, None),
                Some(LeaseState::Active),
            ),
            (
                "active at its expiry",
                row("active", 50, None),
                Some(LeaseState::Expired),
            ),
            (
                "released",
                row("released", 100, Some(10)),
                Some(LeaseState::Released),
            ),
            (
                "expired",
                row("expired", 100, None),
                Some(LeaseState::Expired),
            ),
            ("a state no binary wrote", row("gone", 100, None), None),
            ("a time out of range", row("active", i64::MAX, None), None),
        ];
        for (name, row, state) in cases {
            let lease = row.decode(50);
            assert_eq!(lease.as_ref().ok().map(|l| l.state), state, "{name}");
        }
        let lease = row("released", 100, Some(10)).decode(50).unwrap();
        assert_eq!(lease.ttl, Duration::from_millis(100));
        assert_eq!(lease.released_at, Timestamp::from_millisecond(10).ok());
        assert_eq!(
            row("gone", 100, None).decode(0).unwrap_err().to_string(),
            "lease row: unknown lease state \"gone\""
        );
    }

    #[test]
    fn lease_states_round_trip_through_their_names() {
        for state in [
            LeaseState::Active,
            LeaseState::Released,
            LeaseState::Expired,
        ] {
            assert_eq!(state.as_str().parse::<LeaseState>(), Ok(state));
        }
        assert!("gone".parse::<LeaseState>().is_err());
    }
}
