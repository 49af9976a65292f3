//! The `proxy-operator run` binary end to end on a real Kubernetes API server (and, in `run`,
//! in process against a mock one).

mod admission;
mod cordon;
mod egress;
mod fleet;
mod leadership;
mod lifecycle;
mod logs;
mod pod_security;
mod pool_replicas;
mod pool_wake;
mod pools;
mod run;
mod self_healing;
mod status_events;
mod undecodable;
