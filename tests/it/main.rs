//! The integration tests, in one binary: a module per area, one copy of the fixtures in
//! `tests/support/`, one shared Kubernetes control plane (plus the dedicated ones a few tests
//! ask for by name), so a change in `src/` relinks one test binary instead of one per file.
//!
//! Run one area with `cargo test --test it ledger::`, one test with its module path.

#[path = "../support/mod.rs"]
mod support;

mod api;
mod api_health_view;
mod cel_rules;
mod crd;
mod durations;
mod e2e_standalone;
mod envtest_harness;
mod gateway;
mod gc_task;
mod gcp_provider;
mod health;
mod helm_chart;
mod install;
mod kubernetes_provider;
mod leader_api;
mod lease_durability;
mod ledger;
mod manifests;
mod metrics;
mod monitoring;
mod operator;
mod overlay_postgres;
mod postgres_support;
mod postgres_tls;
mod provider_registry;
mod python_client;
mod quickstart_kind;
mod reconcile_api;
mod reconcile_envtest;
mod replicas;
mod samples;
mod schemathesis;
