//! ProxyPools: replicated, autoscaled sets of Managed Proxies.
//!
//! Data flows one way: the ledger (active leases, unmet demand) and the pool's members feed the
//! pure [`autoscale`](autoscale::autoscale) rule and the pure [`plan`](plan::plan); the
//! `controller` carries the plan out and writes the status built in `status`. `members` names
//! and builds the member Proxies; `watch` keeps every replica's view of the pools, which the
//! `directory` turns into what the API and the gateway need (which pools a request would wake,
//! and the recording of refusals as demand).

pub mod autoscale;
pub mod controller;
pub mod members;
pub mod metrics;
pub mod plan;
pub mod status;

pub use controller::{PoolContext, PoolIntervals};
pub use metrics::PoolMetrics;
