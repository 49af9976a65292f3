//! The reconciler: the only writer of Proxy status, and the only caller of providers'
//! `create`/`delete` for live Proxies.
//!
//! Data flows one way through one reconcile ([`controller::reconcile`]): `observe` gathers the
//! object, the provider's answer and the rest of [`Inputs`]; the pure [`decide`] turns them into
//! one [`Action`]; `execute` carries it out (provider calls, metadata needed before them) and
//! returns a step; `write` builds the status from it with the pure [`status::desired_status`]
//! and writes it at most once, then the annotations and the Event. `context` holds what every
//! reconcile shares, `controller` the streams that trigger them.

mod context;
pub mod controller;
pub mod decide;
pub mod deleted;
mod error;
mod execute;
mod exit_status;
pub mod first_write;
pub mod health_transitions;
mod leading;
pub mod metrics;
mod observe;
pub mod pacing;
pub mod remediation;
pub mod rotation;
pub mod status;
mod time;
mod write;

pub use crate::controllers::budget::Share;
pub use context::{Context, ReconcilerConfig, TimeSource};
pub use controller::{reconcile, run_controller};
pub use decide::{Action, Inputs, Limits, Loss, Observation, decide, on_provider_error};
pub use error::Error;
pub use execute::{
    LEASES_DRAIN_TIMEOUT, LEASES_MACHINE_GONE, LEASES_MACHINE_LOST, LEASES_MACHINE_REPLACED,
    REASON_DRAIN_TIMED_OUT,
};
pub use health_transitions::{ExitStates, HealthStates, LastReports, ProxyReport, health_triggers};
pub use leading::run_while_leading;
pub use metrics::ReconcilerMetrics;
pub use pacing::Pacing;
