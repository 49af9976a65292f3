//! ProxyPools at zero and back, and the member bound across `kill -9`, end to end on a real
//! Kubernetes API server: the `proxy-operator run` binary with its gateway, the test kubelet
//! running each member's squid Pod with real squid, and real crawlers (curl, Scrapy, the
//! Python client) that start against a pool with no member at all.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ResourceQuota;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use proxy_operator::controllers::pool::members::template_hash;
use proxy_operator::resources::pool::{POOL_LABEL, TEMPLATE_HASH_LABEL};
use proxy_operator::resources::proxy::Proxy;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use support::curl::{curl, header_value};
use support::kubelet::Behaviour;
use support::operator::{API_TOKEN, OperatorProcess, READY_DEADLINE, metric_sum};
use support::pools::pool_object;
use support::python::{python_with, script};
use support::site::{PAGES, Site};
use support::world::{World, within};

/// How long a pool may take to fall asleep: the autoscaler counts the refusals of the last
/// minute (and the 10 s bucket they fall in) as demand, then waits `scaleDownAfter`, and the
/// member drains and its Pod goes.
const FALLING_ASLEEP: Duration = Duration::from_secs(180);

/// Waits until pool `name` sleeps: `spec.replicas` and `status.replicas` 0, no member, and no
/// Pod left in the namespace, and none of its members listed by `operator`. Returns how long
/// that took.
async fn wait_asleep(world: &World, operator: &OperatorProcess, name: &str, geo: &str) -> Duration {
    let start = Instant::now();
    let listed = format!("/v1/proxies?selector=geo={geo}");
    within(
        FALLING_ASLEEP,
        &format!("pool {name} asleep: no member, no Pod, none listed by the operator"),
        || async {
            let pool = world.pools().get(name).await.ok()?;
            let replicas = pool.status.as_ref().map(|s| s.replicas);
            if pool.spec.replicas != 0 || replicas != Some(0) {
                return None;
            }
            if !world.members(name).await.is_empty() {
                return None;
            }
            let pods = world.pods().list(&ListParams::default()).await.ok()?;
            if !pods.items.is_empty() {
                return None;
            }
            // The operator serves from its own watch, which may trail the API server by a
            // moment: asleep means it has seen the last member go too.
            let (status, list) = operator.call(Method::GET, &listed, None).await;
            (status == StatusCode::OK && list["proxies"].as_array().is_some_and(Vec::is_empty))
                .then_some(())
        },
    )
    .await;
    start.elapsed()
}

/// The port of `url`.
fn port_of(url: &str) -> u16 {
    reqwest::Url::parse(url)
        .ok()
        .and_then(|u| u.port())
        .unwrap_or_else(|| panic!("{url} names no port"))
}

/// The gateway's count and sum of requests held while a pool woke that were then relayed.
async fn held_relayed(operator: &OperatorProcess) -> (f64, f64) {
    let metrics = operator.metrics().await;
    let relayed = ["outcome=\"relayed\""];
    (
        metric_sum(
            &metrics,
            "proxy_operator_gateway_held_seconds_count",
            &relayed,
        ),
        metric_sum(
            &metrics,
            "proxy_operator_gateway_held_seconds_sum",
            &relayed,
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sleeping_pool_wakes_for_curl_scrapy_and_the_python_client() {
    let Some(world) = World::new("pool-wake").await else {
        return;
    };
    let Some(scrapy_python) = python_with(&["scrapy"]) else {
        return;
    };
    let Some(client_python) = python_with(&["httpx"]) else {
        return;
    };
    let (pool, geo) = ("sleepy", "wake");
    let selector = format!("{}/{pool}", world.ns);
    let site = Site::start();
    let ports = format!(
        "{},{}",
        port_of(&world.target.https_url()),
        site.http_port()
    );
    let operator = world
        .operator(&[
            "--gateway-allowed-ports",
            &ports,
            "--gateway-allowed-destinations",
            "127.0.0.0/8",
        ])
        .await;
    // Room for Scrapy's eight connections on one member, each holding a lease.
    world
        .raw_pools()
        .create(
            &PostParams::default(),
            &pool_object(
                pool,
                json!({
                    "template": world.pool_template(geo, 16),
                    "autoscaling": {"minReplicas": 0, "maxReplicas": 2,
                                    "scaleDownAfter": "2s", "wakeTimeout": "60s"},
                }),
            ),
        )
        .await
        .expect("create the pool");

    // Idle from the start (one member by default): it goes to sleep.
    let slept = wait_asleep(&world, &operator, pool, geo).await;
    eprintln!("pool-wake: idle pool asleep after {slept:?}");
    assert!(
        !world
            .events_with_reason(pool, "ScaledDown")
            .await
            .is_empty(),
        "an idle pool scales down to 0"
    );

    // a. curl through the gateway, HTTPS to the target: the CONNECT is held until a member is
    // Ready, then tunnelled; curl sees one answer to it, 200.
    let ca = world.dir.path().join("target-ca.pem");
    std::fs::write(&ca, world.target.ca_cert_pem()).expect("write the target's CA");
    let proxy = format!(
        "http://crawler;geo={geo}:{API_TOKEN}@{}",
        operator.gateway()
    );
    let asked = Instant::now();
    let (code, out, err) = curl(
        Duration::from_secs(120),
        &[
            "-sS",
            "-D",
            "-",
            "-o",
            "/dev/null",
            "--cacert",
            ca.to_str().unwrap(),
            "-x",
            &proxy,
            &world.target.https_url(),
        ],
    )
    .await;
    let curl_held = asked.elapsed();
    eprintln!("pool-wake: curl held {curl_held:?}");
    assert_eq!(code, 0, "curl failed: {err}\n{out}");
    let heads: Vec<&str> = out
        .split("\r\n\r\n")
        .filter(|h| !h.trim().is_empty())
        .collect();
    assert_eq!(heads.len(), 2, "the CONNECT answer and the target's: {out}");
    assert!(heads[0].starts_with("HTTP/1.1 200"), "{out}");
    assert!(heads[1].starts_with("HTTP/1.1 204"), "{out}");
    assert!(!out.contains(" 503"), "{out}");
    let through = header_value(heads[0], "x-proxy-name").expect("the member named");
    assert!(
        through.starts_with(&format!("{}/{pool}-", world.ns)),
        "{through}"
    );
    assert!(
        curl_held < Duration::from_secs(60),
        "held {curl_held:?}, past the wakeTimeout"
    );
    let (held, held_seconds) = held_relayed(&operator).await;
    assert!(held >= 1.0, "held requests relayed: {held}");
    eprintln!("pool-wake: gateway held {held} request(s) for {held_seconds:.2} s");
    assert!(
        !world.events_with_reason(pool, "ScaledUp").await.is_empty(),
        "a woken pool says so"
    );

    // b. A Scrapy crawl started against the sleeping pool: every page, no 503.
    let slept = wait_asleep(&world, &operator, pool, geo).await;
    eprintln!("pool-wake: asleep again after {slept:?}");
    let items = world.dir.path().join("items.jsonl");
    let asked = Instant::now();
    let output = tokio::time::timeout(
        Duration::from_secs(150),
        tokio::process::Command::new(scrapy_python)
            .arg(script("spider.py"))
            .arg(format!(
                "http://scrapy;geo={geo}:{API_TOKEN}@{}",
                operator.gateway()
            ))
            .arg(site.http("/"))
            .arg(&items)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the crawl finished")
    .expect("run python3");
    eprintln!("pool-wake: Scrapy crawl took {:?}", asked.elapsed());
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    // Retries are off: a 503 would be one more response, and one page fewer.
    assert!(
        stdout.contains(&format!("responses {} errors 0", PAGES + 1)),
        "{stdout}\n{stderr}"
    );
    assert!(!stderr.contains("<503 "), "{stderr}");
    let items: Vec<Value> = std::fs::read_to_string(&items)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(items.len(), PAGES, "{stdout}");
    for item in &items {
        assert_eq!(item["status"], 200, "{item}");
        let upstream = item["upstream"].as_str().unwrap_or_default();
        assert!(
            upstream.starts_with(&format!("{}/{pool}-", world.ns)),
            "{item}"
        );
    }
    let (held_after_scrapy, seconds_after_scrapy) = held_relayed(&operator).await;
    assert!(held_after_scrapy > held, "Scrapy's first request was held");
    eprintln!(
        "pool-wake: gateway held {} Scrapy request(s) for {:.2} s",
        held_after_scrapy - held,
        seconds_after_scrapy - held_seconds
    );

    // c. The API's answer for a sleeping pool, then the Python client waiting through it. The
    // kubelet leaves the woken member's Pod unscheduled until the client has been answered
    // `pool_waking` once (a slow scheduler), so the client's first ask cannot find it Ready.
    let slept = wait_asleep(&world, &operator, pool, geo).await;
    eprintln!("pool-wake: asleep a third time after {slept:?}");
    world
        .kubelet
        .set_default_behaviour(Behaviour::Unschedulable);
    let rejections = || async {
        metric_sum(
            &operator.metrics().await,
            "proxy_operator_lease_rejections_total",
            &[],
        )
    };
    let rejected_before = rejections().await;
    let response = crate::support::http::client()
        .post(operator.api_url("/v1/leases"))
        .bearer_auth(API_TOKEN)
        .json(&json!({"selector": {"geo": geo}}))
        .send()
        .await
        .expect("call the lease API");
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let retry_after = response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    assert!(
        retry_after.is_some_and(|s| s >= 1),
        "Retry-After: {retry_after:?}"
    );
    let body: Value = response.json().await.expect("a JSON body");
    assert_eq!(body["error"], "pool_waking", "{body}");
    assert_eq!(body["pools"], json!([selector]), "{body}");
    assert_eq!(body["wakeTimeoutSeconds"], 60, "{body}");

    let asked = Instant::now();
    let mut client = tokio::process::Command::new(client_python)
        .arg(
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("clients/python/tests/acquire_waiting.py"),
        )
        .arg(operator.api_url(""))
        .arg(API_TOKEN)
        .arg(json!({"geo": geo}).to_string())
        .arg("90")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("run python3");
    while rejections().await < rejected_before + 2.0 {
        if let Some(status) = client.try_wait().expect("poll the Python client") {
            let output = client.wait_with_output().await.expect("its output");
            panic!(
                "the Python client exited ({status}) before it was answered pool_waking:\n{}\n{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        assert!(
            asked.elapsed() < Duration::from_secs(60),
            "the Python client was not answered pool_waking within a minute"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    world.kubelet.set_default_behaviour(Behaviour::Healthy);
    let output = tokio::time::timeout(Duration::from_secs(120), client.wait_with_output())
        .await
        .expect("the Python client finished")
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let answer: Value = serde_json::from_str(stdout.trim()).expect("one JSON line");
    eprintln!(
        "pool-wake: Python client took {:?}: {answer}",
        asked.elapsed()
    );
    assert!(
        answer["poolWakingAnswers"].as_u64().is_some_and(|n| n >= 1),
        "{answer}"
    );
    assert!(
        answer["proxy"]
            .as_str()
            .is_some_and(|p| p.starts_with(&format!("{}/{pool}-", world.ns))),
        "{answer}"
    );
    assert!(answer["leaseID"].as_str().is_some_and(|id| !id.is_empty()));
}

/// Lists the members of a pool every ~50 ms in the background, keeping the most that existed
/// at once and every name seen.
struct Sampler {
    most: Arc<AtomicUsize>,
    names: Arc<Mutex<BTreeSet<String>>>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Sampler {
    fn start(world: &World, pool: &str) -> Sampler {
        let most = Arc::new(AtomicUsize::new(0));
        let names = Arc::new(Mutex::new(BTreeSet::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let api = world.proxies();
        let params = ListParams::default().labels(&format!("{POOL_LABEL}={pool}"));
        let task = {
            let (most, names, stop) = (most.clone(), names.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    if let Ok(list) = api.list(&params).await {
                        most.fetch_max(list.items.len(), Ordering::SeqCst);
                        names
                            .lock()
                            .unwrap()
                            .extend(list.items.iter().map(ResourceExt::name_any));
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
        };
        Sampler {
            most,
            names,
            stop,
            task,
        }
    }

    fn most(&self) -> usize {
        self.most.load(Ordering::SeqCst)
    }

    fn names(&self) -> BTreeSet<String> {
        self.names.lock().unwrap().clone()
    }

    async fn finish(self) -> (usize, BTreeSet<String>) {
        self.stop.store(true, Ordering::SeqCst);
        let (most, names) = (self.most(), self.names());
        self.task.await.expect("the sampler");
        (most, names)
    }
}

/// `<pool>-<hash>-0` .. `<pool>-<hash>-<count - 1>`.
fn indexed(pool: &str, hash: &str, count: usize) -> BTreeSet<String> {
    (0..count).map(|i| format!("{pool}-{hash}-{i}")).collect()
}

/// The template hash every member of `all` carries (asserting they share one).
fn one_hash(all: &BTreeMap<String, Proxy>) -> String {
    let hashes: BTreeSet<String> = all
        .values()
        .filter_map(|p| p.labels().get(TEMPLATE_HASH_LABEL).cloned())
        .collect();
    assert_eq!(hashes.len(), 1, "one template hash: {hashes:?}");
    hashes.into_iter().next().unwrap()
}

/// Kills the operator with SIGKILL once `ready` holds for the members (polled every 20 ms),
/// then starts it again and waits until it is ready; returns the members seen at the kill.
async fn kill_when(
    world: &World,
    operator: &mut OperatorProcess,
    pool: &str,
    what: &str,
    ready: impl Fn(&BTreeMap<String, Proxy>) -> bool,
    before_restart: impl AsyncFnOnce(),
) -> BTreeMap<String, Proxy> {
    let start = Instant::now();
    let seen = loop {
        let all = world.members(pool).await;
        if ready(&all) {
            break all;
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "timed out waiting for {what}: {:?}",
            all.keys()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    operator.kill_9();
    eprintln!(
        "pool-kill: killed at {what}, {} members: {:?}",
        seen.len(),
        seen.keys()
    );
    before_restart().await;
    operator.restart();
    operator.wait_ready(READY_DEADLINE).await;
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_operator_mid_scale_up_creates_no_member_beyond_the_bound() {
    let Some(world) = World::new("pool-kill").await else {
        return;
    };
    let pool = "kill";
    let (desired, surge) = (8_usize, 1_usize);
    // A quota of three Proxies holds the scale-up part-way, so there is always a moment with
    // some members but not all to kill the operator in, however fast it creates them.
    let quotas: Api<ResourceQuota> = Api::namespaced(world.client.clone(), &world.ns);
    let counted = "count/proxies.crawl.example.com";
    let quota: ResourceQuota = serde_json::from_value(json!({
        "metadata": {"name": "members"},
        "spec": {"hard": {counted: "3"}},
    }))
    .expect("a ResourceQuota");
    quotas
        .create(&PostParams::default(), &quota)
        .await
        .expect("create the quota");
    // No controller-manager here: the server enforces a quota once its status exists.
    quotas
        .patch_status(
            "members",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"hard": {counted: "3"}, "used": {counted: "0"}}})),
        )
        .await
        .expect("publish the quota's status");

    let mut operator = world.operator(&[]).await;
    world
        .raw_pools()
        .create(
            &PostParams::default(),
            &pool_object(
                pool,
                json!({"replicas": 0, "strategy": {"maxSurge": surge},
                       "template": world.pool_template(pool, 5)}),
            ),
        )
        .await
        .expect("create the pool");
    within(support::world::SLOW, "the pool's first status", || async {
        let status = world.pools().get(pool).await.ok()?.status?;
        (status.replicas == 0 && !status.selector.is_empty()).then_some(())
    })
    .await;
    let sampler = Sampler::start(&world, pool);

    // Scale to 8 and kill the operator while the members are being created.
    world
        .pools()
        .patch_scale(
            pool,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": desired}})),
        )
        .await
        .expect("scale the pool");
    let seen = kill_when(
        &world,
        &mut operator,
        pool,
        "the scale-up under way",
        |all| !all.is_empty() && all.len() < desired,
        async || {
            // The server counted the members against it: the quota was in force.
            let used = quotas
                .get_status("members")
                .await
                .expect("the quota")
                .status
                .and_then(|s| s.used)
                .and_then(|used| used.get(counted).map(|q| q.0.clone()));
            assert!(
                used.as_deref().is_some_and(|n| n != "0"),
                "quota used: {used:?}"
            );
            quotas
                .delete("members", &DeleteParams::default())
                .await
                .expect("delete the quota");
        },
    )
    .await;
    assert!(seen.len() <= 3, "the quota held: {:?}", seen.keys());
    let scaled = world
        .wait_pool_settled(pool, desired, Duration::from_secs(180))
        .await;
    let hash = one_hash(&scaled);
    let pool_now = world.pools().get(pool).await.expect("the pool");
    assert_eq!(hash, template_hash(&pool_now.spec.template));
    let names: BTreeSet<String> = scaled.keys().cloned().collect();
    assert_eq!(names, indexed(pool, &hash, desired), "deterministic names");
    assert!(
        seen.keys().all(|name| names.contains(name)),
        "the members made before the kill were kept: {:?}",
        seen.keys()
    );
    assert!(
        sampler.most() <= desired + surge,
        "{} members at once",
        sampler.most()
    );
    assert_eq!(
        sampler.names(),
        names,
        "no member beyond indexes 0..{desired} ever existed"
    );
    eprintln!(
        "pool-kill: scale-up done, at most {} members at once",
        sampler.most()
    );

    // A template change rolls the pool; kill the operator again half-way through.
    world
        .pools()
        .patch(
            pool,
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"template": {"metadata": {"annotations": {"rev": "2"}}}}}),
            ),
        )
        .await
        .expect("change the template");
    let old = hash.clone();
    let seen = kill_when(
        &world,
        &mut operator,
        pool,
        "the roll-out half-way",
        |all| {
            let new = all
                .values()
                .filter(|p| p.labels().get(TEMPLATE_HASH_LABEL) != Some(&old))
                .count();
            let old_live = all
                .values()
                .filter(|p| {
                    p.labels().get(TEMPLATE_HASH_LABEL) == Some(&old)
                        && p.metadata.deletion_timestamp.is_none()
                })
                .count();
            new >= 3 && old_live >= 3
        },
        async || {},
    )
    .await;
    assert!(seen.len() <= desired + surge, "{:?}", seen.keys());
    let rolled = world
        .wait_pool_settled(pool, desired, Duration::from_secs(240))
        .await;
    let new_hash = one_hash(&rolled);
    assert_ne!(new_hash, hash, "every member on the new template");
    let new_names: BTreeSet<String> = rolled.keys().cloned().collect();
    assert_eq!(new_names, indexed(pool, &new_hash, desired));
    assert!(
        rolled
            .values()
            .all(|p| p.annotations().get("rev").map(String::as_str) == Some("2"))
    );
    let (most, all_names) = sampler.finish().await;
    eprintln!("pool-kill: roll-out done, at most {most} members at once");
    assert!(
        most <= desired + surge,
        "{most} members at once, more than replicas + maxSurge"
    );
    let expected: BTreeSet<String> = names.union(&new_names).cloned().collect();
    assert_eq!(all_names, expected, "only the two hashes' indexes 0..8");
    drop(operator);
}
