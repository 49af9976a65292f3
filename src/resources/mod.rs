//! The custom resources this operator serves, as Rust types (`Proxy`, `ProxyPool`), and what belongs to
//! them alone: the CRD generated from the types, its schema transform and client-side checks,
//! the duration syntax of their fields, what a proxy costs, the spec hash that decides a replacement, and the
//! deterministic names of their machines.

pub mod cost;
pub mod crd;
pub mod duration;
pub mod exit_check;
pub mod naming;
pub mod phase;
pub mod pool;
pub mod proxy;
pub mod rotating;
pub mod schema;
pub mod spec_hash;
pub mod validation;
