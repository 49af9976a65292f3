//! Scale check of operator mode on a real API server: the release binary `proxy-operator run`
//! (cluster-wide, with the identity and RBAC of `manifests/`) while 1,000 External Proxies are
//! created at 32 requests at a time, timed from the first create until every one is `Ready`,
//! then a second 1,000 with the first 1,000 still present. Probes go through three real squids
//! to a loopback HTTPS target (30 s interval). Reports both times and the operator's peak
//! resident memory (the kernel's `VmHWM`), and exits non-zero past the targets: all Ready in
//! under 30 s, under 60 s with 1,000 others present, peak RSS under 100 MiB.
//!
//! Run with `KUBEBUILDER_ASSETS=<kube-apiserver + etcd dir> cargo bench --bench cluster_scale`
//! (everything shares the machine: the API server, etcd, the operator, squids and this client).

#[path = "../tests/support/mod.rs"]
mod support;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use kube::api::{Api, ApiResource, DynamicObject, ListParams, PostParams};
use proxy_operator::resources::proxy::Proxy;
use serde_json::json;
use support::envtest::ControlPlane;
use support::operator::OperatorProcess;
use support::{Squid, Target};

const BATCH: usize = 1_000;
const SQUIDS: usize = 3;
const CONCURRENT_CREATES: usize = 32;
const READY_LIMIT: Duration = Duration::from_secs(30);
const READY_WITH_OTHERS_LIMIT: Duration = Duration::from_secs(60);
const RSS_LIMIT_KIB: u64 = 100 * 1024;
/// Give up waiting long after the targets, so a slow run still reports its figures.
const GIVE_UP: Duration = Duration::from_secs(300);

fn main() -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("cannot start a runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(bench())
}

async fn bench() -> ExitCode {
    let Some(cp) = ControlPlane::shared() else {
        return ExitCode::SUCCESS;
    };
    cp.apply_crd().await;
    let squids: Vec<Squid> = (0..SQUIDS).map(|_| Squid::start()).collect();
    let target = Target::start();
    let dir = tempfile::tempdir().expect("a temp dir");
    let operator =
        OperatorProcess::start_ready(cp, dir.path(), &target, "cluster-scale", None, &[]).await;

    let client = cp.admin_client();
    let first = create_and_time(&client, cp, "scale-a", &squids, &target).await;
    let second = create_and_time(&client, cp, "scale-b", &squids, &target).await;
    let peak_kib = operator
        .pid()
        .and_then(peak_rss_kib)
        .expect("the operator's VmHWM");

    println!("operator mode on a real API server, {BATCH} External Proxies per batch");
    println!("| measure | value | target |");
    println!("| --- | --- | --- |");
    println!(
        "| all Ready, empty cluster | {} | < {READY_LIMIT:?} |",
        shown(first)
    );
    println!(
        "| all Ready, {BATCH} others present | {} | < {READY_WITH_OTHERS_LIMIT:?} |",
        shown(second)
    );
    println!(
        "| operator peak RSS | {} MiB | < {} MiB |",
        peak_kib / 1024,
        RSS_LIMIT_KIB / 1024
    );
    let met = first.is_some_and(|t| t < READY_LIMIT)
        && second.is_some_and(|t| t < READY_WITH_OTHERS_LIMIT)
        && peak_kib < RSS_LIMIT_KIB;
    if met {
        ExitCode::SUCCESS
    } else {
        eprintln!("cluster scale check: a target was missed");
        ExitCode::FAILURE
    }
}

fn shown(elapsed: Option<Duration>) -> String {
    elapsed.map_or_else(
        || format!("not all Ready within {GIVE_UP:?}"),
        |t| format!("{:.1} s", t.as_secs_f64()),
    )
}

/// Creates [`BATCH`] External Proxies in a new namespace and returns the time from the first
/// create until all of them are `Ready` (None past [`GIVE_UP`]).
async fn create_and_time(
    client: &kube::Client,
    cp: &ControlPlane,
    prefix: &str,
    squids: &[Squid],
    target: &Target,
) -> Option<Duration> {
    let ns = cp.new_namespace(prefix).await;
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &ns, &ApiResource::erase::<Proxy>(&()));
    let probe_url = target.https_url();
    let started = Instant::now();
    futures::stream::iter(0..BATCH)
        .map(|i| {
            let api = api.clone();
            let object: DynamicObject = serde_json::from_value(json!({
                "apiVersion": "crawl.example.com/v1alpha1",
                "kind": "Proxy",
                "metadata": {"name": format!("px-{i:04}"), "labels": {"pool": "scale"}},
                "spec": {
                    "mode": "External",
                    "endpoint": {"host": "127.0.0.1", "port": squids[i % squids.len()].port()},
                    "healthCheck": {"probeURL": probe_url, "interval": "30s", "timeout": "5s"},
                },
            }))
            .expect("a Proxy object");
            async move { api.create(&PostParams::default(), &object).await }
        })
        .buffer_unordered(CONCURRENT_CREATES)
        .try_collect::<Vec<_>>()
        .await
        .expect("create the Proxies");
    loop {
        let list = api
            .list(&ListParams::default())
            .await
            .expect("list the Proxies");
        let ready = list
            .items
            .iter()
            .filter(|p| p.data["status"]["phase"] == "Ready")
            .count();
        if ready == BATCH {
            return Some(started.elapsed());
        }
        if started.elapsed() > GIVE_UP {
            eprintln!("{ns}: {ready}/{BATCH} Ready after {GIVE_UP:?}");
            return None;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The kernel's record of the process's peak resident memory, in KiB.
fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}
