//! Scale check of operator mode on a real API server, in two parts.
//!
//! **1,000 Proxies.** The release binary `proxy-operator run` (cluster-wide, with the identity
//! and RBAC of `manifests/`) while 1,000 External Proxies are created at 32 requests at a time,
//! timed from the first create until every one is `Ready`, then a second 1,000 with the first
//! 1,000 still present. Targets: all Ready in under 30 s, under 60 s with 1,000 others present,
//! peak RSS under 100 MiB.
//!
//! **10,000 Proxies against no operator.** The same 10,000 External Proxies are created twice
//! by the same client, 8 `kubectl create -f` processes of 1,250 documents each: first with no
//! operator running (the baseline: how long the API server takes to accept them), then in a
//! namespace a fresh operator watches (`--watch-namespace`), timed until every one is `Ready`.
//! A watch of this bench follows each run, so the API server serves the same watchers in both.
//! Then 200 single changes (`spec.maxLeases`, one Proxy at a time among the 10,000) are each
//! timed from the patch until the status shows the new `observedGeneration`. Targets: all
//! Ready within 2.5 times the baseline; at most 2 API-server writes per Proxy after its create,
//! counted from the API server's own `apiserver_request_total` (every mutating request of the
//! run but the creates); p99 of a change under 1 s; peak RSS under 200 MiB. It also prints the
//! API server's requests per verb and resource and the CPU time each process spent in each run,
//! which say where the time went.
//!
//! Probes go through three real squids to a loopback HTTPS target (30 s interval). Exits
//! non-zero past any target.
//!
//! Run with `KUBEBUILDER_ASSETS=<kube-apiserver + etcd dir> cargo bench --bench cluster_scale`
//! (everything shares the machine: the API server, etcd, the operator, squids and this client).
//! The 10,000 part needs `kubectl` on the PATH. Environment:
//! - `PROXY_OPERATOR_BENCH_BINARY`: the binary to measure (default: this build's), e.g. one
//!   built from an older commit.
//! - `PROXY_OPERATOR_BENCH_FLEET`: `1000` or `10000` runs that part only (default: both).

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams};
use kube::runtime::watcher;
use proxy_operator::resources::proxy::Proxy;
use serde_json::json;
use support::envtest::ControlPlane;
use support::operator::{OperatorProcess, this_build};
use support::world::create_numbered;
use support::{Squid, Target};
use tokio::sync::Notify;

const BATCH: usize = 1_000;
const SQUIDS: usize = 3;
const CONCURRENT_CREATES: usize = 32;
const READY_LIMIT: Duration = Duration::from_secs(30);
const READY_WITH_OTHERS_LIMIT: Duration = Duration::from_secs(60);
const RSS_LIMIT_KIB: u64 = 100 * 1024;
/// Give up waiting long after the targets, so a slow run still reports its figures.
const GIVE_UP: Duration = Duration::from_secs(300);

/// The large fleet.
const FLEET: usize = 10_000;
/// `kubectl create` processes creating the large fleet at once, each from its own file.
const CREATORS: usize = 8;
/// Longest wait for the large fleet to be Ready (an operator writing each External Proxy's
/// status twice took 243 s here).
const FLEET_GIVE_UP: Duration = Duration::from_secs(900);
/// Ready time of the large fleet, as a multiple of the creates with no operator.
const FLEET_RATIO_LIMIT: f64 = 2.5;
/// API-server writes per Proxy after its create, on average.
const WRITES_PER_PROXY_LIMIT: f64 = 2.0;
const FLEET_RSS_LIMIT_KIB: u64 = 200 * 1024;
/// Single changes timed among the large fleet.
const CHANGES: usize = 200;
const CHANGE_P99_LIMIT: Duration = Duration::from_secs(1);
/// Longest wait for one change; a change not reconciled by then counts as this long.
const CHANGE_GIVE_UP: Duration = Duration::from_secs(30);

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
    let binary = std::env::var_os("PROXY_OPERATOR_BENCH_BINARY")
        .filter(|b| !b.is_empty())
        .map_or_else(this_build, PathBuf::from);
    let part = std::env::var("PROXY_OPERATOR_BENCH_FLEET").unwrap_or_default();
    println!("measuring {}", binary.display());
    let mut met = true;
    if part.is_empty() || part == "1000" {
        met &= small_fleet(cp, &squids, &target, &binary).await;
    }
    if part.is_empty() || part == "10000" {
        met &= large_fleet(cp, &squids, &target, &binary).await;
    }
    if met {
        ExitCode::SUCCESS
    } else {
        eprintln!("cluster scale check: a target was missed");
        ExitCode::FAILURE
    }
}

/// Two batches of [`BATCH`] Proxies created through the API; whether the targets were met.
async fn small_fleet(cp: &ControlPlane, squids: &[Squid], target: &Target, binary: &Path) -> bool {
    let dir = tempfile::tempdir().expect("a temp dir");
    let operator = OperatorProcess::start_ready_binary(
        cp,
        dir.path(),
        target,
        "cluster-scale",
        None,
        &[],
        binary.to_owned(),
    )
    .await;

    let client = cp.admin_client();
    let first = create_and_time(&client, cp, "scale-a", squids, target).await;
    let second = create_and_time(&client, cp, "scale-b", squids, target).await;
    let peak_kib = operator
        .pid()
        .and_then(peak_rss_kib)
        .expect("the operator's VmHWM");

    println!("operator mode on a real API server, {BATCH} External Proxies per batch");
    println!("| measure | value | target |");
    println!("| --- | --- | --- |");
    println!(
        "| all Ready, empty cluster | {} | < {READY_LIMIT:?} |",
        shown(first, GIVE_UP)
    );
    println!(
        "| all Ready, {BATCH} others present | {} | < {READY_WITH_OTHERS_LIMIT:?} |",
        shown(second, GIVE_UP)
    );
    println!(
        "| operator peak RSS | {} MiB | < {} MiB |",
        peak_kib / 1024,
        RSS_LIMIT_KIB / 1024
    );
    first.is_some_and(|t| t < READY_LIMIT)
        && second.is_some_and(|t| t < READY_WITH_OTHERS_LIMIT)
        && peak_kib < RSS_LIMIT_KIB
}

fn shown(elapsed: Option<Duration>, gave_up: Duration) -> String {
    elapsed.map_or_else(
        || format!("not all Ready within {gave_up:?}"),
        |t| format!("{:.1} s", t.as_secs_f64()),
    )
}

/// The spec of the `i`-th bench Proxy: an External endpoint on one of the squids.
fn proxy_spec(i: usize, squids: &[Squid], target: &Target) -> serde_json::Value {
    json!({
        "mode": "External",
        "endpoint": {"host": "127.0.0.1", "port": squids[i % squids.len()].port()},
        "healthCheck": {"probeURL": target.https_url(), "interval": "30s", "timeout": "5s"},
    })
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
    let started = Instant::now();
    create_numbered(&api, BATCH, "scale", CONCURRENT_CREATES, |i| {
        proxy_spec(i, squids, target)
    })
    .await;
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

/// What the large-fleet run measured.
struct FleetRun {
    baseline: Duration,
    /// The API server's requests and the CPU time of each process during the baseline.
    baseline_window: Measured,
    /// The creates of the operator run (the operator's load slows them too).
    creates: Duration,
    ready: Option<Duration>,
    /// The same from the first create until all Ready.
    window: Measured,
    changes: Vec<Duration>,
    peak_kib: u64,
}

/// [`FLEET`] Proxies created by `kubectl` with no operator, then with one; whether the targets
/// were met.
async fn large_fleet(cp: &ControlPlane, squids: &[Squid], target: &Target, binary: &Path) -> bool {
    let ran = std::process::Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ran {
        eprintln!("the {FLEET}-Proxy part needs kubectl on the PATH; not measured");
        return false;
    }
    let dir = tempfile::tempdir().expect("a temp dir");
    let kubeconfig = dir.path().join("admin.kubeconfig");
    cp.write_admin_kubeconfig(&kubeconfig);
    let files = fleet_files(dir.path(), squids, target);
    let client = cp.admin_client();
    let mut processes: Vec<(String, u32)> = cp
        .process_ids()
        .into_iter()
        .map(|pid| (process_name(pid), pid))
        .collect();
    processes.push(("this bench (its watch)".to_owned(), std::process::id()));

    // The baseline: the same creates, nobody acting on them.
    let baseline_ns = cp.new_namespace("fleet-baseline").await;
    let seen = Fleet::watch(&client, &baseline_ns);
    let window = Window::open(&client, &processes).await;
    let baseline = kubectl_create(&kubeconfig, dir.path(), &baseline_ns, &files).await;
    let all_seen = seen
        .wait(FLEET_GIVE_UP, |f| f.present == FLEET)
        .await
        .is_some();
    assert!(all_seen, "the baseline's {FLEET} Proxies were all created");
    let baseline_window = window.close(&client).await;
    drop(seen);

    let ns = cp.new_namespace("fleet").await;
    let operator = OperatorProcess::start_ready_binary(
        cp,
        dir.path(),
        target,
        "cluster-scale-fleet",
        Some(&ns),
        &[],
        binary.to_owned(),
    )
    .await;
    let fleet = Fleet::watch(&client, &ns);
    processes.extend(operator.pid().map(|pid| ("proxy-operator".to_owned(), pid)));
    let window = Window::open(&client, &processes).await;
    let started = Instant::now();
    let creating = kubectl_create(&kubeconfig, dir.path(), &ns, &files);
    let ready = fleet.wait(FLEET_GIVE_UP, |f| f.ready == FLEET);
    let (creates, ready) = futures::join!(creating, ready);
    let ready = ready.map(|at| at.duration_since(started));
    let window = window.close(&client).await;
    if ready.is_none() {
        eprintln!(
            "{ns}: {}/{FLEET} Ready after {FLEET_GIVE_UP:?}",
            fleet.ready()
        );
    }
    let changes = time_changes(&client, &ns, &fleet).await;
    let peak_kib = operator
        .pid()
        .and_then(peak_rss_kib)
        .expect("the operator's VmHWM");
    report(&FleetRun {
        baseline,
        baseline_window,
        creates,
        ready,
        window,
        changes,
        peak_kib,
    })
}

/// Prints the large fleet's table; whether every target was met.
fn report(run: &FleetRun) -> bool {
    let ratio = run
        .ready
        .map(|ready| ready.as_secs_f64() / run.baseline.as_secs_f64());
    let writes = run.window.requests.writes_after_create(FLEET);
    let p99 = percentile(&run.changes, 0.99);
    println!();
    println!(
        "operator mode on a real API server, {FLEET} External Proxies created by {CREATORS} \
         kubectl processes"
    );
    println!("| measure | value | target |");
    println!("| --- | --- | --- |");
    println!(
        "| creates with no operator (baseline) | {:.1} s | |",
        run.baseline.as_secs_f64()
    );
    println!(
        "| creates with the operator | {:.1} s | |",
        run.creates.as_secs_f64()
    );
    println!(
        "| all Ready with the operator | {} | |",
        shown(run.ready, FLEET_GIVE_UP)
    );
    println!(
        "| all Ready ÷ baseline | {} | ≤ {FLEET_RATIO_LIMIT} |",
        ratio.map_or_else(|| "-".to_owned(), |r| format!("{r:.2}"))
    );
    println!(
        "| API-server writes per Proxy after its create | {writes:.2} | ≤ {WRITES_PER_PROXY_LIMIT} |"
    );
    println!(
        "| one change among {FLEET} reconciled, p50 / p99 / max ({} changes) | {} / {} / {} | p99 < {CHANGE_P99_LIMIT:?} |",
        run.changes.len(),
        millis(percentile(&run.changes, 0.5)),
        millis(p99),
        millis(percentile(&run.changes, 1.0)),
    );
    println!(
        "| operator peak RSS | {} MiB | < {} MiB |",
        run.peak_kib / 1024,
        FLEET_RSS_LIMIT_KIB / 1024
    );
    println!();
    println!("API-server requests, baseline (creates until all seen):");
    println!("{}", run.baseline_window.requests.table());
    println!("API-server requests, operator run (first create until all Ready):");
    println!("{}", run.window.requests.table());
    println!("CPU time, baseline / operator run:");
    for (name, time) in &run.window.cpu {
        let before = run
            .baseline_window
            .cpu
            .iter()
            .find(|(other, _)| other == name)
            .map_or_else(
                || "-".to_owned(),
                |(_, t)| format!("{:.1} s", t.as_secs_f64()),
            );
        println!("- {name}: {before} / {:.1} s", time.as_secs_f64());
    }
    ratio.is_some_and(|r| r <= FLEET_RATIO_LIMIT)
        && writes <= WRITES_PER_PROXY_LIMIT
        && p99 < CHANGE_P99_LIMIT
        && run.peak_kib < FLEET_RSS_LIMIT_KIB
}

/// The API server's request counts and the processes' CPU time at the start of a measurement.
struct Window {
    requests: Requests,
    processes: Vec<(String, u32, Duration)>,
}

/// What happened during a [`Window`].
struct Measured {
    requests: Requests,
    cpu: Vec<(String, Duration)>,
}

impl Window {
    async fn open(client: &kube::Client, processes: &[(String, u32)]) -> Window {
        Window {
            processes: processes
                .iter()
                .map(|(name, pid)| (name.clone(), *pid, cpu_time(*pid)))
                .collect(),
            requests: Requests::scrape(client).await,
        }
    }

    async fn close(self, client: &kube::Client) -> Measured {
        let cpu = self
            .processes
            .into_iter()
            .map(|(name, pid, before)| (name, cpu_time(pid).saturating_sub(before)))
            .collect();
        Measured {
            requests: Requests::scrape(client).await.since(&self.requests),
            cpu,
        }
    }
}

fn millis(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}

/// The value at quantile `q` (0..=1) of `samples`, zero for none.
fn percentile(samples: &[Duration], q: f64) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort();
    let Some(last) = sorted.len().checked_sub(1) else {
        return Duration::ZERO;
    };
    // Nearest rank: the smallest sample with at least q of them at or below it.
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.saturating_sub(1).min(last)]
}

/// Writes the [`CREATORS`] manifests of the large fleet: [`FLEET`] Proxies, dealt out in turn.
fn fleet_files(dir: &Path, squids: &[Squid], target: &Target) -> Vec<PathBuf> {
    (0..CREATORS)
        .map(|file| {
            let mut text = String::new();
            for i in (file..FLEET).step_by(CREATORS) {
                let object = json!({
                    "apiVersion": "crawl.example.com/v1alpha1",
                    "kind": "Proxy",
                    "metadata": {"name": format!("px-{i:05}"), "labels": {"pool": "fleet"}},
                    "spec": proxy_spec(i, squids, target),
                });
                // JSON is YAML: one document per object.
                let _ = writeln!(text, "---\n{object}");
            }
            let path = dir.join(format!("fleet-{file}.yaml"));
            std::fs::write(&path, text).expect("write a fleet manifest");
            path
        })
        .collect()
}

/// Runs one `kubectl create -f` per file in `namespace` at once; the time until all exited.
async fn kubectl_create(
    kubeconfig: &Path,
    dir: &Path,
    namespace: &str,
    files: &[PathBuf],
) -> Duration {
    let started = Instant::now();
    let runs = files.iter().map(|file| {
        tokio::process::Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(kubeconfig)
            // Discovery is cached per run, the same way in both runs.
            .arg("--cache-dir")
            .arg(dir.join(format!("kubectl-cache-{namespace}")))
            .args(["create", "--namespace", namespace, "-o", "name", "-f"])
            .arg(file)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .output()
    });
    for output in futures::future::join_all(runs).await {
        let output = output.expect("run kubectl");
        assert!(
            output.status.success(),
            "kubectl create failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    started.elapsed()
}

/// One Proxy as the bench's watch last saw it.
#[derive(Debug, Clone, Default)]
struct Seen {
    ready: bool,
    generation: i64,
    observed: i64,
}

/// What the watch has seen of a namespace.
#[derive(Debug, Default)]
struct FleetState {
    proxies: HashMap<String, Seen>,
    present: usize,
    ready: usize,
}

impl FleetState {
    fn apply(&mut self, object: &DynamicObject) {
        let Some(name) = object.metadata.name.clone() else {
            return;
        };
        let seen = Seen {
            ready: object.data["status"]["phase"] == "Ready",
            generation: object.metadata.generation.unwrap_or(0),
            observed: object.data["status"]["observedGeneration"]
                .as_i64()
                .unwrap_or(0),
        };
        let was_ready = seen.ready;
        match self.proxies.insert(name, seen) {
            Some(old) => {
                self.ready = self.ready + usize::from(was_ready) - usize::from(old.ready);
            }
            None => {
                self.present += 1;
                self.ready += usize::from(was_ready);
            }
        }
    }

    fn remove(&mut self, object: &DynamicObject) {
        let old = object
            .metadata
            .name
            .as_ref()
            .and_then(|name| self.proxies.remove(name));
        if let Some(old) = old {
            self.present -= 1;
            self.ready -= usize::from(old.ready);
        }
    }
}

/// A watch of the Proxies of one namespace, kept by a task until dropped.
struct Fleet {
    state: Arc<Mutex<FleetState>>,
    changed: Arc<Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl Fleet {
    fn watch(client: &kube::Client, namespace: &str) -> Fleet {
        let api: Api<DynamicObject> =
            Api::namespaced_with(client.clone(), namespace, &ApiResource::erase::<Proxy>(&()));
        let state = Arc::new(Mutex::new(FleetState::default()));
        let changed = Arc::new(Notify::new());
        let (task_state, task_changed) = (state.clone(), changed.clone());
        let task = tokio::spawn(async move {
            let mut events = std::pin::pin!(watcher(api, watcher::Config::default()));
            while let Some(event) = events.next().await {
                let event = match event {
                    Ok(event) => event,
                    Err(e) => {
                        eprintln!("bench watch: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                {
                    let mut state = task_state.lock().unwrap_or_else(PoisonError::into_inner);
                    match &event {
                        watcher::Event::Apply(object) | watcher::Event::InitApply(object) => {
                            state.apply(object)
                        }
                        watcher::Event::Delete(object) => state.remove(object),
                        watcher::Event::Init | watcher::Event::InitDone => {}
                    }
                }
                task_changed.notify_waiters();
            }
        });
        Fleet {
            state,
            changed,
            task,
        }
    }

    /// How many are Ready now.
    fn ready(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .ready
    }

    /// The moment `condition` held, or `None` after `deadline`.
    async fn wait(
        &self,
        deadline: Duration,
        condition: impl Fn(&FleetState) -> bool,
    ) -> Option<Instant> {
        let until = Instant::now() + deadline;
        loop {
            let changed = self.changed.notified();
            if condition(&self.state.lock().unwrap_or_else(PoisonError::into_inner)) {
                return Some(Instant::now());
            }
            let left = until.checked_duration_since(Instant::now())?;
            // A timeout only means: look again.
            let _ = tokio::time::timeout(left, changed).await;
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Changes [`CHANGES`] Proxies one at a time and times each from its patch until the status
/// shows its new generation.
async fn time_changes(client: &kube::Client, namespace: &str, fleet: &Fleet) -> Vec<Duration> {
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), namespace, &ApiResource::erase::<Proxy>(&()));
    let mut times = Vec::with_capacity(CHANGES);
    for i in 0..CHANGES {
        let name = format!("px-{:05}", (i * 7919) % FLEET);
        let started = Instant::now();
        let patch = json!({"spec": {"maxLeases": 100 + i}});
        let changed = api
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .expect("change a Proxy");
        let generation = changed.metadata.generation.unwrap_or(0);
        let seen = fleet
            .wait(CHANGE_GIVE_UP, |f| {
                f.proxies
                    .get(&name)
                    .is_some_and(|p| p.generation >= generation && p.observed >= generation)
            })
            .await;
        times.push(seen.map_or(CHANGE_GIVE_UP, |at| at.duration_since(started)));
    }
    times
}

/// `apiserver_request_total` summed by (verb, resource, subresource).
#[derive(Debug, Default)]
struct Requests(BTreeMap<(String, String, String), f64>);

/// Verbs that change something.
const WRITE_VERBS: [&str; 5] = ["POST", "PUT", "PATCH", "DELETE", "APPLY"];

impl Requests {
    async fn scrape(client: &kube::Client) -> Requests {
        let request = http::Request::get("/metrics")
            .body(Vec::new())
            .expect("a metrics request");
        let text = client
            .request_text(request)
            .await
            .expect("scrape the API server's /metrics");
        let mut sums = BTreeMap::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
                continue;
            };
            let Some((labels, value)) = rest.rsplit_once("} ") else {
                continue;
            };
            let Ok(value) = value.trim().parse::<f64>() else {
                continue;
            };
            let label = |name: &str| {
                labels
                    .split(',')
                    .find_map(|pair| pair.strip_prefix(&format!("{name}=\"")))
                    .map(|v| v.trim_end_matches('"').to_owned())
                    .unwrap_or_default()
            };
            *sums
                .entry((label("verb"), label("resource"), label("subresource")))
                .or_insert(0.0) += value;
        }
        Requests(sums)
    }

    fn since(&self, before: &Requests) -> Requests {
        Requests(
            self.0
                .iter()
                .map(|(key, value)| (key.clone(), value - before.0.get(key).unwrap_or(&0.0)))
                .filter(|(_, value)| *value > 0.0)
                .collect(),
        )
    }

    /// Every write but the `creates` of Proxies, per Proxy created.
    fn writes_after_create(&self, creates: usize) -> f64 {
        let writes: f64 = self
            .0
            .iter()
            .filter(|((verb, _, _), _)| WRITE_VERBS.contains(&verb.as_str()))
            .map(|(_, value)| value)
            .sum();
        (writes - creates as f64).max(0.0) / creates as f64
    }

    fn table(&self) -> String {
        let mut text = String::from("| verb | resource | count |\n| --- | --- | --- |\n");
        for ((verb, resource, subresource), value) in &self.0 {
            let resource = if subresource.is_empty() {
                resource.clone()
            } else {
                format!("{resource}/{subresource}")
            };
            let _ = writeln!(text, "| {verb} | {resource} | {value} |");
        }
        text
    }
}

/// The command name of a process.
fn process_name(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|name| name.trim().to_owned())
        .unwrap_or_else(|_| format!("pid {pid}"))
}

/// User plus system CPU time a process has spent (zero if it cannot be read).
fn cpu_time(pid: u32) -> Duration {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return Duration::ZERO;
    };
    // The fields after the command name (which ends with the last ')') start at field 3
    // (state); utime is field 14, stime field 15.
    let Some((_, fields)) = stat.rsplit_once(')') else {
        return Duration::ZERO;
    };
    let fields: Vec<&str> = fields.split_whitespace().collect();
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|&i| fields.get(i).and_then(|v| v.parse::<u64>().ok()))
        .sum();
    // SAFETY: sysconf with a valid name has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let per_second = u64::try_from(per_second).unwrap_or(100).max(1);
    Duration::from_millis(ticks * 1000 / per_second)
}

/// The kernel's record of the process's peak resident memory, in KiB.
fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}
