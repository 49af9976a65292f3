//! What the operator's log holds at the default level, the one an install that sets no
//! `RUST_LOG` gets: a fleet of 1,000 External Proxies on a real API server is created and made
//! Ready without a line per reconcile, and once it is steady the log grows by at most a few
//! lines a minute.
//!
//! Needs `KUBEBUILDER_ASSETS`, like `operator::lifecycle`.

use crate::support;

use std::time::{Duration, Instant};

use kube::api::ListParams;
use support::Squid;
use support::operator::{OperatorOptions, OperatorProcess, metric_sum, this_build};
use support::world::{World, create_numbered, within};

/// Proxies in the fleet.
const FLEET: usize = 1_000;
/// Squids the fleet's endpoints share.
const SQUIDS: usize = 2;
/// Creates in flight at once.
const CONCURRENT_CREATES: usize = 32;
/// How long the whole fleet may take to be Ready on a loaded machine.
const READY_DEADLINE: Duration = Duration::from_secs(240);
/// How long the steady fleet's log is watched.
const WINDOW: Duration = Duration::from_secs(20);
/// The most lines a minute a steady fleet may write.
const LINES_PER_MINUTE: usize = 4;

/// The log of `operator` from byte `from` on, line by line.
fn lines_since(operator: &OperatorProcess, from: usize) -> Vec<String> {
    let text = operator.log_text();
    text.get(from..)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Reconciles the operator has finished, from its `/metrics`.
async fn reconciles(operator: &OperatorProcess) -> f64 {
    metric_sum(
        &operator.metrics().await,
        "proxy_operator_reconcile_duration_seconds_count",
        &[],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steady_fleet_of_a_thousand_proxies_writes_a_few_lines_a_minute() {
    let Some(world) = World::new("logs").await else {
        return;
    };
    let squids: Vec<Squid> = (0..SQUIDS).map(|_| Squid::start()).collect();
    let mut options = OperatorOptions::prepared(
        world.cp,
        world.dir.path(),
        &world.target,
        &world.ns,
        Some(&world.ns),
        &[],
    )
    .await;
    options.log_filter = None;
    let operator = OperatorProcess::start_ready_with(options, this_build()).await;

    let probe_url = world.target.https_url();
    let started = Instant::now();
    create_numbered(
        &world.raw_proxies(),
        FLEET,
        "logs",
        CONCURRENT_CREATES,
        |i| {
            serde_json::json!({
                "mode": "External",
                "endpoint": {"host": "127.0.0.1", "port": squids[i % SQUIDS].port()},
                "healthCheck": {"probeURL": probe_url, "interval": "30s", "timeout": "5s"},
            })
        },
    )
    .await;
    let api = world.raw_proxies();
    within(
        READY_DEADLINE,
        &format!("all {FLEET} Proxies Ready"),
        || async {
            let list = api.list(&ListParams::default()).await.ok()?;
            let ready = list
                .items
                .iter()
                .filter(|p| p.data["status"]["phase"] == "Ready")
                .count();
            (ready == FLEET).then_some(())
        },
    )
    .await;
    let ready_after = started.elapsed();

    // Every Proxy was reconciled on its way to Ready, none of it logged line by line.
    let made_ready = reconciles(&operator).await;
    let log = operator.log_text();
    let per_reconcile = log
        .lines()
        .filter(|l| l.contains("kube_runtime") && l.contains("reconciling object"))
        .count();
    assert!(made_ready >= FLEET as f64, "{made_ready} reconciles");
    assert_eq!(
        per_reconcile, 0,
        "kube-runtime logs every reconcile:\n{log}"
    );
    let creation_lines = log.lines().count();

    // Steady: every Proxy Ready, probed every 30 s. Nothing calls the API meanwhile (each
    // request is a line of its own).
    let from = log.len();
    let before = reconciles(&operator).await;
    tokio::time::sleep(WINDOW).await;
    let lines = lines_since(&operator, from);
    let during = reconciles(&operator).await - before;
    let per_minute = lines.len() as f64 * 60.0 / WINDOW.as_secs_f64();
    println!(
        "{FLEET} Proxies Ready after {:.1} s ({made_ready} reconciles, {creation_lines} log \
         lines); steady for {WINDOW:?}: {} lines ({per_minute:.1} a minute), {during} reconciles",
        ready_after.as_secs_f64(),
        lines.len(),
    );
    let allowed = LINES_PER_MINUTE * WINDOW.as_secs() as usize / 60;
    assert!(
        lines.len() <= allowed,
        "{} lines in {WINDOW:?} (at most {LINES_PER_MINUTE} a minute):\n{}",
        lines.len(),
        lines.join("\n")
    );
}
