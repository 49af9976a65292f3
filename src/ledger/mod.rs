//! The lease ledger: leases, cooldowns, reports and their history, kept where they survive a
//! restart, so an acknowledged lease is never lost and an engineer can read what happened.
//!
//! This module holds what every backend shares: the [`Ledger`] trait the API, the metrics
//! collector, the reconciler and the process wiring use; the values it takes and hands out,
//! and the decoding of a lease row (`lease`); the pure selection of a proxy for an acquire
//! (`selection::select`) and the per-target limits it is held to (`target_hold`); the view of
//! the counts ([`LedgerCounts`], `counts`); the history rows (`history`); the buckets of
//! ProxyPools' unmet demand (`demand`); the ranking of cooldowns per target (`targets`); the
//! bounded reads of recent activity for the status page (`activity`); the
//! clock, the configuration every backend keeps and the errors. A backend decides every write against its own record of the leases, and calls the
//! same `select` and `TargetHold` so both backends choose alike. [`SqliteLedger`] (`sqlite/`, the default): one file, one writer thread, group
//! commit, one replica. [`PostgresLedger`] (`postgres/`): one database any number of replicas
//! share, the database deciding each write in a transaction of its own.
//!
//! # Rules every backend keeps
//!
//! - **Capacity**: an acquire never makes a proxy hold more than its `maxLeases` leases that
//!   count (`expires_at > now`), however many acquires race; capacity is counted by time, so an
//!   expired lease stops counting before any sweep marks it. The per-target limits
//!   (`max_leases_per_target`, `max_leases_per_proxy_target`) are counted the same way.
//! - **Acknowledged means recorded**: a write is answered only once it is durable, so a lease a
//!   caller was given survives a crash of the process.
//! - **Retention**: a finished lease is kept for the cooldown window, so a late `rate_limited`
//!   report still lands and a request ID still replays.
//! - **Tenants**: every lease belongs to the tenant that acquired it. Reads, renews, reports
//!   and releases name their tenant, and another tenant's lease is answered exactly as an
//!   unknown one. An acquire is held to its tenant's quotas (`quota`) where capacity is
//!   decided; a refusal for a quota looks at no candidate.
//! - **Idempotent acquire**: an acquire may carry a request ID (one tenant's IDs are apart
//!   from another's) and a fingerprint of the request (computed by the API). While the lease that ID got is within its window — until the lease's
//!   `expires_at`, which a renew moves and a release does not shorten — the same ID with the
//!   same fingerprint answers [`AcquireOutcome::Replayed`] with that lease as it is now (possibly
//!   released), and with a different fingerprint [`LedgerError::RequestIdReused`]. After the
//!   window the ID is free: a new acquire with it is decided afresh and the ID names the newer
//!   lease.
//! - **History**: every acquire, renew, release, expiry and report is appended to the history,
//!   pruned after the retention period.
//! - **Demand**: a refused request a ProxyPool's member would have served counts once per
//!   distinct pool in the [`DEMAND_BUCKET`] holding the ledger's clock's time (`demand`),
//!   acknowledged once durable like any write and kept where the leader reads it (the one
//!   SQLite file, the database every replica shares); the sweep deletes the buckets that end
//!   before the last [`DEMAND_RETENTION`].
//! - **Traffic**: bytes through the gateway are added, a gateway's batch at a time, to one
//!   row per UTC hour (of the ledger's clock), tenant, proxy, pool and target (`traffic`),
//!   acknowledged once durable; the sweep deletes the rows whose hour ended before the
//!   history's retention. A tenant's bytes of the current UTC day count towards its
//!   `bytesPerDay` quota where its other quotas are decided.

mod activity;
mod batch_counters;
mod candidates;
mod clock;
mod config;
mod counts;
mod demand;
mod error;
mod history;
mod lease;
mod location;
mod migration;
mod postgres;
mod quota;
mod selection;
mod sqlite;
mod target_hold;
mod targets;
mod traffic;

use std::collections::HashMap;
use std::time::Duration;

pub use activity::{
    ActiveCooldown, Activity, EventEntry, EventsQuery, MAX_COOLDOWNS, MAX_EVENTS, ReportCounts,
    SCAN_EVENTS, TargetCounts,
};
pub use candidates::{Candidate, Candidates};
pub use clock::{Clock, ManualClock, SystemClock};
pub use config::LedgerConfig;
pub use counts::LedgerCounts;
pub use error::LedgerError;
pub use lease::{
    AcquireOutcome, AcquireRequest, Lease, LeaseReport, LeaseState, NoMatch, NoMatchReason,
    ReportResult, RequestKey, SweepStats, UnknownValue, cooldown_key,
};
pub use location::LedgerLocation;
pub use postgres::{
    COUNTS_REFRESH, POSTGRES_SCHEMA_VERSION, PostgresLedger, PostgresLedgerCollector,
    PostgresOptions,
};
pub use quota::{
    Bucket, DEFAULT_TENANT, QuotaExceeded, QuotaKind, Quotas, Rate, Tenancy, TenantUsage,
};
pub use sqlite::{
    DEFAULT_MAX_SIZE, Durability, MIN_MAX_SIZE, SCHEMA_VERSION, SqliteLedger,
    SqliteLedgerCollector, SqliteOptions, WriterStats,
};
pub use targets::{NAMED_TARGETS, OTHER_TARGETS, TargetCooldowns, rank_targets};
pub use traffic::{
    DAY_MS, HOUR_MS, TrafficBytes, TrafficHour, day_start, hour_start, until_next_day,
};

/// The length of one bucket of ProxyPools' unmet demand: a refusal counts in the bucket
/// (aligned to the Unix epoch) holding the ledger's clock's time, and a window of
/// [`Ledger::recent_demand`] reads the buckets overlapping it.
pub const DEMAND_BUCKET: Duration = Duration::from_secs(10);

/// How long unmet demand is kept: [`Ledger::sweep`] deletes the buckets that end before the
/// last `DEMAND_RETENTION`, so a window up to this long reads complete buckets.
pub const DEMAND_RETENTION: Duration = Duration::from_secs(600);

/// Whether a ledger's database answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatabaseStatus {
    /// The last statement (or the periodic check) reached it.
    pub up: bool,
    /// Why it could not, while it cannot.
    pub error: Option<String>,
}

/// A lease ledger, whichever backend keeps it.
///
/// Writes and lease reads are `async`: a backend may wait for a writer, a disk or a database.
/// The [`counts`](Ledger::counts) are synchronous snapshots, read on hot paths (every proxy
/// list, every metrics scrape, every reconcile) without a round trip; each backend says how
/// stale they may be.
#[async_trait::async_trait]
pub trait Ledger: std::fmt::Debug + Send + Sync {
    /// Grants a lease on the best candidate (in the order of `selection::select`) or says why
    /// none could be granted.
    /// Concurrent acquires never exceed a proxy's `max_leases`. With a target, proxies cooling
    /// down for it are skipped; the TTL is capped by `max_ttl`. With a request ID whose window
    /// is open, answers with that lease as it is now, or refuses a different request.
    /// [`LedgerError::Overloaded`] means nothing was decided: retry.
    async fn acquire(&self, request: AcquireRequest) -> Result<AcquireOutcome, LedgerError>;

    /// Extends `tenant`'s active lease to `ttl` from now (capped), for sticky sessions.
    /// Released and expired leases cannot be renewed ([`LedgerError::NotActive`]); another
    /// tenant's is [`LedgerError::UnknownLease`].
    async fn renew(&self, id: &str, tenant: &str, ttl: Duration) -> Result<Lease, LedgerError>;

    /// Gives `tenant`'s lease back. Idempotent: releasing a released, expired or unknown
    /// lease, or another tenant's, does nothing and succeeds.
    async fn release(&self, id: &str, tenant: &str) -> Result<(), LedgerError>;

    /// Ends at once every lease of the proxy with UID `proxy_uid` that counts towards its
    /// capacity, because the operator lost, stopped or deleted its machine: each becomes
    /// `released` now with `release_reason = reason` and one `released` history event carrying
    /// `reason`, so the replacement starts with the proxy's full capacity and the history says
    /// why the leases ended. Returns how many were ended; idempotent (again, 0).
    ///
    /// An active lease already past its expiry is not counted: it stopped counting when it
    /// expired, and the sweep marks it `expired` as usual. For its crawler an ended lease is
    /// like any released one: renew answers [`LedgerError::NotActive`], release succeeds,
    /// reports still land, and its request ID replays it until the window closes.
    ///
    /// `reason` is a machine code (`machine_lost`, `machine_stopped`, `machine_gone`; 1-64 of
    /// `a-z 0-9 _ - .`), else [`LedgerError::InvalidReason`].
    async fn end_leases(&self, proxy_uid: &str, reason: &str) -> Result<u64, LedgerError>;

    /// Records what a crawler observed on `tenant`'s lease, in any state as long as it is
    /// retained (another tenant's is [`LedgerError::UnknownLease`]).
    /// `rate_limited` and `blocked` put (proxy, target) into cooldown, for as long as the report
    /// asks (at most `max_cooldown`) or `cooldown`; the target defaults to the lease's target,
    /// and without either no cooldown can be keyed, so only the report is recorded. Returns the
    /// lease.
    async fn report(
        &self,
        id: &str,
        tenant: &str,
        report: LeaseReport,
    ) -> Result<Lease, LedgerError>;

    /// Marks leases past their expiry as expired (one `expired` event each, timed at the
    /// expiry), deletes finished leases whose expiry is older than the cooldown window (their
    /// request IDs go with them), ended cooldowns, history older than the retention period,
    /// demand buckets that end before the last [`DEMAND_RETENTION`], and traffic rows whose
    /// hour ended before the retention period.
    async fn sweep(&self) -> Result<SweepStats, LedgerError>;

    /// Records one refused request (an acquire or a gateway connection refused for capacity,
    /// or because no member was Ready) that a member of each pool in `pools` would have
    /// served: the pools' unmet demand, counted per pool per [`DEMAND_BUCKET`] at the ledger's
    /// clock, so a refusal on any replica reaches the leader. Pools are `namespace/name` keys;
    /// a pool named more than once counts once, and an empty slice records nothing. Answered
    /// once durable, like any write, with the same errors (`Overloaded`, `Full`,
    /// `Unavailable`, …: retry or drop it). Counted at least once: a PostgreSQL statement
    /// tried again after a lost connection may have committed the first time.
    async fn record_demand(&self, pools: &[String]) -> Result<(), LedgerError>;

    /// Unmet demand per pool (`namespace/name`) recorded in the buckets that overlap the last
    /// `window` at the ledger's clock (the bucket holding now always does); pools without any
    /// are absent. Buckets older than [`DEMAND_RETENTION`] may be swept, so a longer window
    /// reads only what is left.
    async fn recent_demand(&self, window: Duration) -> Result<HashMap<String, u64>, LedgerError>;

    /// Adds the bytes a gateway relayed since its last call to the rows of the UTC hour
    /// holding the ledger's clock (one row per tenant, proxy, pool and target; bytes for one
    /// row are added up first, empty ones dropped), in one write: the SQLite writer's batch,
    /// or one PostgreSQL transaction. Answered once durable, like any write, with the same
    /// errors (`Overloaded`, `Full`, `Unavailable`, …: keep the bytes and try again). Returns
    /// the bytes of the current UTC day of each tenant it named, this call's included, as the
    /// quotas count them. Counted at least once: a PostgreSQL transaction tried again after a
    /// lost connection may have committed the first time.
    async fn record_traffic(
        &self,
        traffic: Vec<TrafficBytes>,
    ) -> Result<HashMap<String, u64>, LedgerError>;

    /// Hourly rows whose hour starts at or after `since_ms`, oldest first; a read, on any
    /// replica.
    async fn traffic(&self, since_ms: i64) -> Result<Vec<TrafficHour>, LedgerError>;

    /// Acquires and reports per target over the last `window` at the ledger's clock (among
    /// the newest [`SCAN_EVENTS`] events), of `tenant` (`None`: every tenant), and the
    /// cooldowns in force (at most [`MAX_COOLDOWNS`]; every tenant's: a ban is shared): what
    /// the status page shows per target. A read, on any replica.
    async fn activity(
        &self,
        window: Duration,
        tenant: Option<String>,
    ) -> Result<Activity, LedgerError>;

    /// The newest history events, of every proxy or of one, newest first.
    async fn events(&self, query: EventsQuery) -> Result<Vec<EventEntry>, LedgerError>;

    /// `tenant`'s lease with this ID, if it is still retained, as recorded (`None` for
    /// another tenant's). A lease past its expiry reads as expired even before the sweep marks
    /// it.
    async fn get(&self, id: &str, tenant: &str) -> Result<Option<Lease>, LedgerError>;

    /// Whether this replica can serve leases (`/readyz` answers 503 on an error).
    ///
    /// - SQLite: the writer thread runs (not shut down, not died) and a read of a lease on a
    ///   pooled connection answers; [`LedgerError::Closed`] or the read's error otherwise.
    /// - PostgreSQL: always `Ok`, without asking the database: one that does not answer
    ///   fails every replica alike, so taking this one out of the Service would help no
    ///   crawler. Whether it answers is [`database`](Ledger::database)'s: down after a
    ///   statement (or the refresh of the counts, every [`COUNTS_REFRESH`]) could not reach
    ///   it, up again after one that did, with the last failure's reason.
    async fn check(&self) -> Result<(), LedgerError>;

    /// The state of the database behind the ledger, for `/readyz` and the metrics; `None`
    /// for an embedded ledger, which has none apart from itself.
    fn database(&self) -> Option<DatabaseStatus> {
        None
    }

    /// The counts (active leases, cooldowns) at this moment, from memory: a short-lived view
    /// to read and drop at once (see [`LedgerCounts`]).
    fn counts(&self) -> LedgerCounts<'_>;
}
