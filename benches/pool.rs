//! ProxyPool check of operator mode on a real API server: the release binary `proxy-operator
//! run` (cluster-wide, with the identity and RBAC of `manifests/`) and a test kubelet per
//! namespace running every member's squid Pod with real squid, probing a loopback HTTPS target
//! every 2 s. In one run, each part in a namespace of its own:
//!
//! - **direct**: 50 Managed Proxies created one after the other (as `kubectl apply -f` of a
//!   50-document file sends them), timed from the first create until all 50 are `Ready`;
//! - **pool**: a ProxyPool with the same spec as its template, at `replicas: 0`, scaled to 50
//!   through `/scale` (as `kubectl scale` does), timed from the scale until
//!   `status.readyReplicas` is 50 and its 50 members are `Ready`;
//! - **held**: a ProxyPool with `autoscaling: {minReplicas: 0, maxReplicas: 1, wakeTimeout:
//!   120s}` asleep at 0, and one HTTPS request through the gateway (curl, CONNECT, the pool's
//!   labels in the user part): the whole time it is held, and the time from the member's Pod
//!   turning `Running` (as the kubelet reports it) to the relayed response. The refusal the
//!   request meets on the leader wakes the pool controller at once, so the whole time is the
//!   member's start-up and first probe.
//!
//! An untimed warm-up (10 Proxies, then a pool of 10) goes first: the first Managed Proxies of
//! a new API server and operator are slower, which would favour the part that runs second.
//! Each part's Proxies are deleted (and gone, Pods too) before the next part starts, so each
//! part has the machine to itself. Every milestone is the moment this
//! process's watch saw it. Prints a table and the milestones, writes the figures to
//! `target/bench-pool.json` (and the operator's log to `target/bench-pool-operator.log`), and
//! exits non-zero past the targets: pool ÷ direct at most 1.2, held after the Pod is Running
//! under one probe interval.
//!
//! Run with `KUBEBUILDER_ASSETS=<kube-apiserver + etcd dir> cargo bench --bench pool`
//! (everything shares the machine: the API server, etcd, the operator, squids and this client).

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Resource, ResourceExt};
use proxy_operator::resources::pool::{POOL_FINALIZER, POOL_LABEL, ProxyPool};
use proxy_operator::resources::proxy::{MANAGED_LABEL, Phase, Proxy};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use support::envtest::ControlPlane;
use support::operator::{API_TOKEN, OperatorProcess};
use support::{Kubelet, Target};
use tokio::task::JoinHandle;

/// Proxies of the direct part; members of the pool part.
const MEMBERS: usize = 50;
/// Proxies, then members, of the untimed warm-up.
const WARM_UP: usize = 10;
/// The members' `healthCheck.interval` (and timeout), in both parts.
const PROBE_INTERVAL: Duration = Duration::from_secs(2);
const PROBE_INTERVAL_TEXT: &str = "2s";
/// Pool ÷ direct, at most.
const RATIO_LIMIT: f64 = 1.2;
/// The held pool's `wakeTimeout`.
const WAKE_TIMEOUT_TEXT: &str = "120s";
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

/// When each milestone of a part was first seen, from the part's start.
type Milestones = Vec<(&'static str, Option<Duration>)>;

async fn bench() -> ExitCode {
    let Some(cp) = ControlPlane::shared() else {
        return ExitCode::SUCCESS;
    };
    cp.apply_crd().await;
    let target = Target::start();
    let target_port = port_of(&target.https_url());
    let dir = tempfile::tempdir().expect("a temp dir");
    let operator = OperatorProcess::start_ready(
        cp,
        dir.path(),
        &target,
        "pool-bench",
        None,
        &[
            "--gateway-allowed-ports",
            &target_port.to_string(),
            "--gateway-allowed-destinations",
            "127.0.0.0/8",
        ],
    )
    .await;
    let spec = json!({
        "mode": "Managed",
        "provider": "local",
        "port": 3128,
        "healthCheck": {
            "probeURL": target.https_url(),
            "interval": PROBE_INTERVAL_TEXT,
            "timeout": PROBE_INTERVAL_TEXT,
            "failureThreshold": 2,
        },
    });

    // Warm-up, untimed: the first Managed Proxies on a new API server and operator take longer
    // (measured: 50 creates in 3.4 s first, 1.4 s after a pool had gone before), which would
    // favour whichever part ran second.
    direct_part(cp, &spec, WARM_UP, "pool-bench-warm-direct").await;
    pool_part(cp, &spec, WARM_UP, "pool-bench-warm-pool").await;
    let (direct, direct_steps) = direct_part(cp, &spec, MEMBERS, "pool-bench-direct").await;
    let (pool, pool_steps) = pool_part(cp, &spec, MEMBERS, "pool-bench-pool").await;
    let ca = dir.path().join("target-ca.pem");
    std::fs::write(&ca, target.ca_cert_pem()).expect("write the target's CA");
    let held = held_part(cp, &spec, &operator, &target, &ca).await;

    let ratio = match (direct, pool) {
        (Some(d), Some(p)) => Some(p.as_secs_f64() / d.as_secs_f64()),
        _ => None,
    };
    let after_running = held
        .total
        .zip(held.pod_running)
        .map(|(total, running)| total.saturating_sub(running));
    println!(
        "ProxyPools on a real API server, {MEMBERS} Managed squid Proxies, probed every {PROBE_INTERVAL_TEXT}"
    );
    println!("| measure | value | target |");
    println!("| --- | --- | --- |");
    println!(
        "| direct: {MEMBERS} Proxies created, all Ready | {} | |",
        secs(direct)
    );
    println!(
        "| pool: /scale 0 → {MEMBERS}, readyReplicas {MEMBERS} | {} | |",
        secs(pool)
    );
    println!(
        "| ratio pool ÷ direct | {} | ≤ {RATIO_LIMIT} |",
        ratio.map_or_else(|| "—".to_owned(), |r| format!("{r:.2}"))
    );
    println!(
        "| held: total | {} | < {WAKE_TIMEOUT_TEXT} |",
        secs(held.total)
    );
    println!(
        "| held: after the Pod is Running | {} | < {PROBE_INTERVAL_TEXT} |",
        secs(after_running)
    );
    println!("| probe interval | {PROBE_INTERVAL_TEXT} | |");
    for (part, steps) in [
        ("direct", &direct_steps),
        ("pool", &pool_steps),
        ("held", &held.steps),
    ] {
        let shown: Vec<String> = steps
            .iter()
            .map(|(what, at)| format!("{what} {}", secs(*at)))
            .collect();
        println!("{part} milestones: {}", shown.join(", "));
    }
    if let Some(answer) = &held.answer {
        println!("held request: curl answered {answer}");
    }

    let figures = json!({
        "members": MEMBERS,
        "probe_interval_s": PROBE_INTERVAL.as_secs_f64(),
        "direct_s": direct.map(|d| d.as_secs_f64()),
        "pool_s": pool.map(|d| d.as_secs_f64()),
        "ratio": ratio,
        "held_total_s": held.total.map(|d| d.as_secs_f64()),
        "held_after_pod_running_s": after_running.map(|d| d.as_secs_f64()),
        "milestones": {
            "direct": milestones_json(&direct_steps),
            "pool": milestones_json(&pool_steps),
            "held": milestones_json(&held.steps),
        },
    });
    let out = target_dir();
    let json_path = out.join("bench-pool.json");
    std::fs::write(
        &json_path,
        serde_json::to_string_pretty(&figures).expect("JSON"),
    )
    .unwrap_or_else(|e| panic!("write {}: {e}", json_path.display()));
    let log_path = out.join("bench-pool-operator.log");
    let _ = std::fs::write(&log_path, operator.log_text());
    println!(
        "figures in {}, the operator's log in {}",
        json_path.display(),
        log_path.display()
    );

    let met = ratio.is_some_and(|r| r <= RATIO_LIMIT)
        && after_running.is_some_and(|t| t < PROBE_INTERVAL)
        && held
            .answer
            .as_deref()
            .is_some_and(|a| a.starts_with("200 204"));
    drop(operator);
    if met {
        ExitCode::SUCCESS
    } else {
        eprintln!("pool check: a target was missed");
        ExitCode::FAILURE
    }
}

/// `count` Proxies created one after the other in a new namespace named after `prefix`; the
/// time from the first create until all are Ready.
async fn direct_part(
    cp: &ControlPlane,
    spec: &Value,
    count: usize,
    prefix: &str,
) -> (Option<Duration>, Milestones) {
    let client = cp.admin_client();
    let ns = cp.new_namespace(prefix).await;
    let kubelet = Kubelet::start(cp.admin_client(), Some(&ns));
    let proxies: Api<Proxy> = Api::namespaced(client.clone(), &ns);
    let raw: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &ns, &ApiResource::erase::<Proxy>(&()));
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let all_running = first_time(pods.clone(), Some(MANAGED_LABEL), move |pods| {
        running_pods(pods) == count
    })
    .await;
    let all_ready = first_time(proxies.clone(), None, move |proxies| {
        ready_proxies(proxies) == count
    })
    .await;

    let started = Instant::now();
    for i in 0..count {
        let object: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "crawl.example.com/v1alpha1",
            "kind": "Proxy",
            "metadata": {"name": format!("direct-{i:02}"), "labels": {"geo": "direct"}},
            "spec": spec,
        }))
        .expect("a Proxy object");
        raw.create(&PostParams::default(), &object)
            .await
            .unwrap_or_else(|e| panic!("create Proxy direct-{i:02}: {e}"));
    }
    let created = started.elapsed();
    let running = since(started, all_running.await);
    let ready = since(started, all_ready.await);
    if ready.is_none() {
        eprintln!(
            "{ns}: {}/{count} Ready after {GIVE_UP:?}",
            count_ready(&proxies).await
        );
    }

    delete_all(&proxies, &pods, &ns).await;
    drop(kubelet);
    (
        ready,
        vec![
            ("all created", Some(created)),
            ("all Pods Running", running),
            ("all Ready", ready),
        ],
    )
}

/// A pool at 0 in a new namespace named after `prefix`, scaled to `count` through /scale; the
/// time until readyReplicas is `count` and its `count` members are Ready.
async fn pool_part(
    cp: &ControlPlane,
    spec: &Value,
    count: usize,
    prefix: &str,
) -> (Option<Duration>, Milestones) {
    let client = cp.admin_client();
    let ns = cp.new_namespace(prefix).await;
    let kubelet = Kubelet::start(cp.admin_client(), Some(&ns));
    let pools: Api<ProxyPool> = Api::namespaced(client.clone(), &ns);
    let proxies: Api<Proxy> = Api::namespaced(client.clone(), &ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let name = "bench";
    create_pool(
        &client,
        &ns,
        name,
        json!({"replicas": 0, "template": {"metadata": {"labels": {"geo": "pool"}}, "spec": spec}}),
    )
    .await;
    wait_pool_at_rest(&pools, name).await;

    let members = format!("{POOL_LABEL}={name}");
    let all_created = first_time(proxies.clone(), Some(&members), move |members| {
        members.len() == count
    })
    .await;
    let all_running = first_time(pods.clone(), Some(MANAGED_LABEL), move |pods| {
        running_pods(pods) == count
    })
    .await;
    let all_ready = first_time(proxies.clone(), Some(&members), move |members| {
        ready_proxies(members) == count
    })
    .await;
    let status_ready = first_time(pools.clone(), None, move |pools| {
        pools.values().any(|p| {
            p.status
                .as_ref()
                .is_some_and(|s| usize::try_from(s.ready_replicas).ok() == Some(count))
        })
    })
    .await;

    let started = Instant::now();
    pools
        .patch_scale(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": count}})),
        )
        .await
        .expect("scale the pool through /scale");
    let created = since(started, all_created.await);
    let running = since(started, all_running.await);
    let ready = since(started, all_ready.await);
    let status = since(started, status_ready.await);
    let done = ready.zip(status).map(|(a, b)| a.max(b));
    if done.is_none() {
        eprintln!(
            "{ns}: {}/{count} members Ready after {GIVE_UP:?}",
            count_ready(&proxies).await
        );
    }

    pools
        .delete(name, &DeleteParams::default())
        .await
        .expect("delete the pool");
    wait_empty(&pools, &ns, "ProxyPools").await;
    wait_empty(&pods, &ns, "Pods").await;
    drop(kubelet);
    (
        done,
        vec![
            ("all members created", created),
            ("all Pods Running", running),
            ("all members Ready", ready),
            ("status.readyReplicas reached", status),
        ],
    )
}

/// What the held request measured.
struct Held {
    /// From sending the request to its relayed answer.
    total: Option<Duration>,
    /// From sending the request until the member's Pod was Running.
    pod_running: Option<Duration>,
    /// curl's `%{http_connect} %{http_code} %{time_total}`.
    answer: Option<String>,
    steps: Milestones,
}

/// One request through the gateway for a pool asleep at 0.
async fn held_part(
    cp: &ControlPlane,
    spec: &Value,
    operator: &OperatorProcess,
    target: &Target,
    ca: &Path,
) -> Held {
    let client = cp.admin_client();
    let ns = cp.new_namespace("pool-bench-held").await;
    let _kubelet = Kubelet::start(cp.admin_client(), Some(&ns));
    let pools: Api<ProxyPool> = Api::namespaced(client.clone(), &ns);
    let proxies: Api<Proxy> = Api::namespaced(client.clone(), &ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let name = "held";
    create_pool(
        &client,
        &ns,
        name,
        json!({
            "replicas": 0,
            "autoscaling": {"minReplicas": 0, "maxReplicas": 1, "wakeTimeout": WAKE_TIMEOUT_TEXT},
            "template": {"metadata": {"labels": {"geo": "held"}}, "spec": spec},
        }),
    )
    .await;
    wait_pool_at_rest(&pools, name).await;

    let scaled = first_time(pools.clone(), None, |pools| {
        pools.values().any(|p| p.spec.replicas >= 1)
    })
    .await;
    let member = first_time(proxies.clone(), None, |members| !members.is_empty()).await;
    let pod_created = first_time(pods.clone(), Some(MANAGED_LABEL), |pods| !pods.is_empty()).await;
    let pod_running = first_time(pods.clone(), Some(MANAGED_LABEL), |pods| {
        running_pods(pods) >= 1
    })
    .await;
    let addressed = first_time(proxies.clone(), None, |members| {
        members.values().any(|p| {
            p.status
                .as_ref()
                .and_then(|s| s.ip.as_deref())
                .is_some_and(|ip| !ip.is_empty())
        })
    })
    .await;
    let ready = first_time(proxies.clone(), None, |members| ready_proxies(members) >= 1).await;

    let url = target.https_url();
    let started = Instant::now();
    let output = tokio::process::Command::new("curl")
        .args(["-sS", "-o", "/dev/null", "--max-time", "180"])
        .args(["-w", "%{http_connect} %{http_code} %{time_total}"])
        .arg("--cacert")
        .arg(ca)
        .args(["-x", &format!("http://{}", operator.gateway())])
        .args(["--proxy-basic", "--proxy-user"])
        .arg(format!("crawler;geo=held:{API_TOKEN}"))
        .arg(&url)
        .output()
        .await;
    let total = started.elapsed();
    let answer = match output {
        Ok(output) if output.status.success() => {
            Some(String::from_utf8_lossy(&output.stdout).into_owned())
        }
        Ok(output) => {
            eprintln!(
                "curl through the gateway failed ({}): {} {}",
                output.status,
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
            None
        }
        Err(e) => {
            eprintln!("cannot run curl ({e}); install it: apt-get install -y curl");
            None
        }
    };
    let total = answer.as_ref().map(|_| total);
    let running = since(started, pod_running.await);
    let steps = vec![
        ("pool scaled to 1", since(started, scaled.await)),
        ("member created", since(started, member.await)),
        ("Pod created", since(started, pod_created.await)),
        ("Pod Running", running),
        ("member has its IP", since(started, addressed.await)),
        ("member Ready", since(started, ready.await)),
        ("answer relayed", total),
    ];
    Held {
        total,
        pod_running: running,
        answer,
        steps,
    }
}

/// Creates the ProxyPool `name` in `ns` with `spec`.
async fn create_pool(client: &kube::Client, ns: &str, name: &str, spec: Value) {
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), ns, &ApiResource::erase::<ProxyPool>(&()));
    let object: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "crawl.example.com/v1alpha1",
        "kind": "ProxyPool",
        "metadata": {"name": name},
        "spec": spec,
    }))
    .expect("a ProxyPool object");
    api.create(&PostParams::default(), &object)
        .await
        .unwrap_or_else(|e| panic!("create ProxyPool {ns}/{name}: {e}"));
}

/// Waits until the operator has taken the pool on (its finalizer) and written its status at
/// 0 members.
async fn wait_pool_at_rest(pools: &Api<ProxyPool>, name: &str) {
    let deadline = Instant::now() + GIVE_UP;
    loop {
        if let Ok(pool) = pools.get(name).await {
            let taken = pool.finalizers().iter().any(|f| f == POOL_FINALIZER);
            let at_rest = pool.status.as_ref().is_some_and(|s| {
                s.replicas == 0 && s.observed_generation == pool.metadata.generation
            });
            if taken && at_rest {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "ProxyPool {name} not at rest at 0 after {GIVE_UP:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Deletes every Proxy of `ns` and waits until they and their Pods are gone.
async fn delete_all(proxies: &Api<Proxy>, pods: &Api<Pod>, ns: &str) {
    proxies
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await
        .expect("delete the Proxies");
    wait_empty(proxies, ns, "Proxies").await;
    wait_empty(pods, ns, "Pods").await;
}

/// Waits until `api` lists nothing (giving up, with a warning, after [`GIVE_UP`]).
async fn wait_empty<K>(api: &Api<K>, ns: &str, what: &str)
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    let deadline = Instant::now() + GIVE_UP;
    while Instant::now() < deadline {
        match api.list(&ListParams::default()).await {
            Ok(list) if list.items.is_empty() => return,
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    eprintln!("{ns}: {what} still there after {GIVE_UP:?}; going on");
}

/// Watches `api` (the objects carrying the label `label`, if given) from now on, and returns
/// once its first list is in: the task ends with the moment `done` first held for the objects
/// seen (by name), or `None` after [`GIVE_UP`].
async fn first_time<K, F>(api: Api<K>, label: Option<&str>, done: F) -> JoinHandle<Option<Instant>>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    F: Fn(&BTreeMap<String, K>) -> bool + Send + 'static,
{
    let mut config = watcher::Config::default();
    if let Some(label) = label {
        config = config.labels(label);
    }
    let (listed, was_listed) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let mut listed = Some(listed);
        let mut events = watcher::watcher(api, config).default_backoff().boxed();
        let mut objects: BTreeMap<String, K> = BTreeMap::new();
        let mut relist: Option<BTreeMap<String, K>> = None;
        let deadline = tokio::time::Instant::now() + GIVE_UP;
        loop {
            let event = match tokio::time::timeout_at(deadline, events.next()).await {
                Ok(Some(Ok(event))) => event,
                Ok(Some(Err(e))) => {
                    eprintln!("watch error (retrying): {e}");
                    continue;
                }
                Ok(None) | Err(_) => return None,
            };
            match event {
                Event::Init => {
                    relist = Some(BTreeMap::new());
                    continue;
                }
                Event::InitApply(object) => {
                    relist
                        .get_or_insert_with(BTreeMap::new)
                        .insert(object.name_any(), object);
                    continue;
                }
                Event::InitDone => {
                    objects = relist.take().unwrap_or_default();
                    if let Some(listed) = listed.take() {
                        let _ = listed.send(());
                    }
                }
                Event::Apply(object) => {
                    objects.insert(object.name_any(), object);
                }
                Event::Delete(object) => {
                    objects.remove(&object.name_any());
                }
            }
            if done(&objects) {
                return Some(Instant::now());
            }
        }
    });
    let _ = was_listed.await;
    task
}

fn running_pods(pods: &BTreeMap<String, Pod>) -> usize {
    pods.values()
        .filter(|p| {
            p.metadata.deletion_timestamp.is_none()
                && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
        })
        .count()
}

fn ready_proxies(proxies: &BTreeMap<String, Proxy>) -> usize {
    proxies.values().filter(|p| is_ready(p)).count()
}

fn is_ready(proxy: &Proxy) -> bool {
    proxy.metadata.deletion_timestamp.is_none()
        && proxy.status.as_ref().and_then(|s| s.phase) == Some(Phase::Ready)
}

async fn count_ready(proxies: &Api<Proxy>) -> usize {
    proxies
        .list(&ListParams::default())
        .await
        .map_or(0, |list| list.items.iter().filter(|p| is_ready(p)).count())
}

/// The time from `started` to what a [`first_time`] task saw.
fn since(
    started: Instant,
    seen: Result<Option<Instant>, tokio::task::JoinError>,
) -> Option<Duration> {
    seen.ok()
        .flatten()
        .map(|at| at.saturating_duration_since(started))
}

fn secs(elapsed: Option<Duration>) -> String {
    elapsed.map_or_else(
        || format!("not within {GIVE_UP:?}"),
        |t| format!("{:.2} s", t.as_secs_f64()),
    )
}

fn milestones_json(steps: &Milestones) -> Value {
    Value::Object(
        steps
            .iter()
            .map(|(what, at)| ((*what).to_owned(), json!(at.map(|t| t.as_secs_f64()))))
            .collect(),
    )
}

fn port_of(url: &str) -> u16 {
    url.rsplit_once(':')
        .and_then(|(_, rest)| rest.split('/').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {url}"))
}

/// The target directory (the parent of this build's `CARGO_TARGET_TMPDIR`).
fn target_dir() -> PathBuf {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    tmp.parent().unwrap_or(tmp).to_owned()
}
