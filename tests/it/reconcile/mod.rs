//! The operator's controllers in process: each reconcile's exact Kubernetes requests against
//! a scripted API, a stale copy on a real API server, orphan GC as a task, and leader election.

mod envtest;
mod gc;
mod leader;
mod scripted_api;
