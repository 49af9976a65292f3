//! The `Proxy` resource: its generated CRD against the committed copies, its CEL rules and
//! defaults on the real API server, the duration syntax on every parser, and the samples.

mod cel_rules;
mod crd;
mod durations;
mod samples;
