//! What every replica knows of the ProxyPools: the `watch` that keeps the pools (and feeds the
//! pool controller on the leader), and the `directory` the API and the gateway read (which
//! pools a request would wake, and the recording of refusals as the pools' demand).

pub mod directory;
pub mod watch;

pub use directory::{PoolDirectory, PoolEntry, Waking};
