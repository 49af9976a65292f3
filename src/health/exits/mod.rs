//! Exit checks: which address targets see through each proxy, asked of an echo URL through
//! the proxy at the proxy's own interval (`spec.exitCheck`), with the country and network of
//! that address when `--geoip-database` files are given.
//!
//! Like the health engine, the [`ExitChecker`] never writes status: it records a change in
//! the ledger (once, however many checks or replicas see it), publishes the [`ExitTable`] the
//! API, the status page and the metrics read, and pushes an [`ExitReport`] to the reconciler
//! when what status shows of a proxy's exit changes.

pub mod answer;
pub mod engine;
pub mod metrics;
pub mod schedule;
pub mod shared;
pub mod table;

pub use engine::{ExitChecker, ExitCheckerConfig};
pub use metrics::ExitMetrics;
pub use schedule::ExitSchedule;
pub use table::{ExitReport, ExitTable, ExitView};
