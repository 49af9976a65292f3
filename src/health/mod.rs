//! The health engine: probes every proxy through the proxy and decides healthy/unhealthy.

pub mod snapshot;

pub use snapshot::{HealthSnapshot, ProxyHealth};
