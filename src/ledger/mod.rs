//! The lease ledger: leases, cooldowns, reports and their history in one on-disk SQLite file
//! (WAL, migrations from `migrations/`), so acknowledged leases survive restarts and an
//! engineer can read what happened with `sqlite3`.
//!
//! # One writer
//!
//! Every write (acquire, renew, release, the end of a proxy's leases, report, sweep) is
//! decided by one writer thread that owns the write connection and the lease state in memory
//! (`state.rs`): the leases whose row says active with their expiry times (a lease counts
//! while `expires_at > now`, so capacity is counted by time, not by a counter), the cooldowns
//! per (proxy UID, target), and the request-ID index. The state is rebuilt from the file at
//! open. Writes are decided one after the other in arrival order against that state, so
//! concurrent acquires can never exceed a proxy's `maxLeases`, and no acquire scans the leases
//! table or copies the candidates. A dedicated thread rather than a tokio task: SQLite calls
//! block, the connection stays on one thread, the ledger works without (and never starves) an
//! async runtime, and callers only enqueue and await a oneshot answer.
//!
//! # Group commit
//!
//! The writer takes the first queued write, begins a transaction (`BEGIN IMMEDIATE`, which
//! also keeps another process off the file), then takes everything else queued at that moment
//! (at most `max_batch`), decides each in order, and commits them in one transaction. Every
//! caller is answered only after the COMMIT that holds its row, so an answered lease survives
//! `kill -9`; the cost of a commit is shared by the batch instead of paid per call.
//!
//! # Rollback
//!
//! The state journals every change of the batch. If a statement or the COMMIT fails, the
//! transaction is rolled back, the journal undoes the batch in memory, and every caller of the
//! batch gets [`LedgerError::BatchFailed`] — memory matches the file again, and nothing of the
//! batch was acknowledged; when the failure is SQLITE_FULL (the disk, or the file's page
//! limit) they get [`LedgerError::Full`] instead, which says when to retry. Readers never see
//! a batch before its commit: the counts they read ([`Ledger::active_counts`],
//! [`Ledger::active_total`], [`Ledger::cooldowns_active`], [`Ledger::target_cooldowns`]) are
//! a view the writer refreshes after each COMMIT (only for what the batch touched) and before
//! answering; a lease is read through a pool of WAL readers. No read waits for a write.
//!
//! # Size bound
//!
//! The file and its WAL stay within `max_size` (`bound.rs` has the arithmetic): SQLite caps
//! the file's pages (`max_page_count`), the writer prunes the oldest history between batches
//! once the file nears the cap (`space.rs`), and housekeeping may use pages kept back from
//! client writes, so the sweep can free space when writes no longer fit.
//!
//! # Bounded waiting
//!
//! actix-web does not cancel a handler whose client went away, so a write queued behind a
//! slow writer would still be granted long after its client gave up, and a retrying client
//! would hold two leases. The queue therefore has a size (`queue_capacity`): a write that
//! does not fit is refused at once with [`LedgerError::Overloaded`]. Each write carries a
//! deadline (`queue_deadline` on the clock's monotonic time): one whose deadline passed before
//! the writer reached it is refused with `Overloaded` and not decided. An acquire whose caller
//! dropped its future before its turn is skipped, never granted.
//!
//! # Idempotent acquire
//!
//! An acquire may carry a request ID and a fingerprint of the request (computed by the API).
//! While the lease that ID got is within its window — until the lease's `expires_at`, which a
//! renew moves and a release does not shorten — the same ID with the same fingerprint answers
//! [`AcquireOutcome::Replayed`] with that lease as it is now (possibly released), and with a
//! different fingerprint [`LedgerError::RequestIdReused`]. After the window the ID is free: a
//! new acquire with it is decided afresh and the ID names the newer lease. The ID and
//! fingerprint are columns of the lease row (kept as long as the row is retained), so replays
//! work after a restart.

mod bound;
mod clock;
mod config;
mod counts;
mod error;
mod handle;
mod lease;
mod schema;
mod selection;
mod space;
mod state;
mod store;
mod writer;

pub use bound::{DEFAULT_MAX_SIZE, MIN_MAX_SIZE};
pub use clock::{Clock, ManualClock, SystemClock};
pub use config::{Durability, LedgerConfig};
pub use counts::{NAMED_TARGETS, OTHER_TARGETS, TargetCooldowns, rank_targets};
pub use error::LedgerError;
pub use handle::Ledger;
pub use lease::{
    AcquireOutcome, AcquireRequest, Candidate, Lease, LeaseState, NoMatch, ReportResult,
    RequestKey, SweepStats, UnknownValue,
};
pub use schema::SCHEMA_VERSION;
pub use writer::WriterStats;
