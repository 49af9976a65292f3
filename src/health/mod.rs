//! The health engine: probes every proxy through the proxy and decides healthy/unhealthy.

pub mod engine;
pub mod exits;
pub mod metrics;
pub mod probe;
pub mod snapshot;
pub mod thresholds;

pub use engine::{EngineConfig, HealthEngine, HealthTransition};
pub use metrics::{PerProxyGauge, ProbeMetrics, label_pair, scraped_family};
pub use probe::{ProbeClient, ProbeError, ProbeErrorKind, ProbeResult, ProbeSettings, ProbeTls};
pub use snapshot::{HealthSnapshot, HealthTable, LastFailure, ProxyHealth};
