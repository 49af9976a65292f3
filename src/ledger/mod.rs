//! The lease ledger: leases, cooldowns, reports and their history in one on-disk SQLite file
//! (WAL, migrations from `migrations/`), so acknowledged leases survive restarts and an
//! engineer can read what happened with `sqlite3`.
//!
//! Every operation is one short transaction; acquire counts and inserts in the same
//! `BEGIN IMMEDIATE` transaction, so concurrent acquires never exceed a proxy's capacity. A
//! lease counts towards capacity while `state = 'active' AND expires_at > now`.

mod clock;
mod error;
mod lease;
mod schema;
mod selection;
mod store;

pub use clock::{Clock, ManualClock, SystemClock};
pub use error::LedgerError;
pub use lease::{
    AcquireOutcome, Candidate, Lease, LeaseState, NoMatch, ReportResult, SweepStats, UnknownValue,
};
pub use schema::SCHEMA_VERSION;
pub use store::{Durability, Ledger, LedgerConfig};
