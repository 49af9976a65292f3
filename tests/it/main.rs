//! The integration tests, in one binary: a module per area, one copy of the fixtures in
//! `tests/support/`, one shared Kubernetes control plane (plus the dedicated ones a few tests
//! ask for by name), so a change in `src/` relinks one test binary instead of one per file.
//!
//! Run one area with `cargo test --test it ledger::`, one test with its module path.
//!
//! A test that cannot run here for want of a tool or a privilege passes as skipped (outside
//! CI), and the binary lists every such test when it exits, also in `target/skipped-tests.txt`.

#[path = "../support/mod.rs"]
mod support;

/// Before any test: drops the last run's skipped-test list and has this run's written at exit
/// (libtest ends with `process::exit`, which runs `atexit` handlers).
#[ctor::ctor(unsafe)]
fn list_skips_at_exit() {
    support::skip::forget_previous();
    // SAFETY: registers a plain function that does not unwind; it touches only a static, stderr
    // and one file.
    if unsafe { libc::atexit(report_skips) } != 0 {
        eprintln!("atexit failed: the skipped tests are not listed at exit");
    }
}

extern "C" fn report_skips() {
    support::skip::report();
}

mod api;
mod browser;
mod docs;
mod e2e_standalone;
mod envtest_harness;
mod exits;
mod external;
mod gateway;
mod health;
mod house;
mod import;
mod install;
mod ledger;
mod metrics;
mod operator;
mod postgres;
mod providers;
mod reconcile;
mod resources;
mod status_page;
mod tenants;
