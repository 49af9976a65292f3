//! ProxyPools with more than one operator replica, and pools whose provider refuses machines:
//! a refusal answered by a follower reaches the Lease holder's autoscaler through the shared
//! PostgreSQL ledger and wakes a pool at zero; a provider that refuses every machine for quota
//! shows as `ScalingLimited` on the pool, which neither adds members nor retries faster than
//! `--quota-requeue`.
//!
//! The quota test uses the kubernetes provider refused by a real ResourceQuota: operator mode
//! cannot point the gcp provider at a loopback fake of the Compute API. `proxy-operator run`
//! builds it with `GcpProvider::connect` (Application Default Credentials, the SDK's default
//! endpoint) from `Constructors::standard`, `GcpConfig` has no endpoint field (and denies
//! unknown ones), and the in-process `run_with_client` takes no constructors of its own; the
//! SDK reads no endpoint from the environment (only `GOOGLE_CLOUD_UNIVERSE_DOMAIN`, which keeps
//! `https://compute.<domain>`).

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, ResourceQuota};
use kube::api::{Api, Patch, PatchParams, PostParams};
use proxy_operator::resources::proxy::ConditionStatus;
use reqwest::StatusCode;
use serde_json::{Value, json};
use support::envtest::ControlPlane;
use support::operator::{API_TOKEN, OperatorProcess, metric_sum};
use support::postgres::{Database, Postgres};
use support::world::{SLOW, World, eventually, within};

/// The condition `type_` of pool `name` as `(status, reason)`, once the pool has it.
async fn pool_condition(
    world: &World,
    name: &str,
    type_: &str,
) -> Option<(ConditionStatus, String)> {
    let pool = world.pools().get(name).await.ok()?;
    let condition = pool.status?.condition(type_).cloned()?;
    Some((condition.status, condition.reason))
}

// ---------------------------------------------------------------------------------------------
// Demand on a follower.

/// One replica of the install of `world` (its namespace is the install ID, so both replicas
/// share the leader Lease `leader-<ns>`) on the PostgreSQL ledger `ledger`, in a directory of
/// its own.
async fn replica(world: &World, name: &str, ledger: &Database) -> OperatorProcess {
    let dir = world.dir.path().join(name);
    std::fs::create_dir_all(&dir).expect("a replica's dir");
    let url = ledger.url();
    OperatorProcess::start_ready(
        world.cp,
        &dir,
        &world.target,
        &world.ns,
        Some(&world.ns),
        &["--ledger", &url],
    )
    .await
}

async fn gauge(operator: &OperatorProcess, metric: &str, labels: &[&str]) -> f64 {
    metric_sum(&operator.metrics().await, metric, labels)
}

/// An acquire on `operator`'s lease API with `body`: the status, the `Retry-After` header (in
/// seconds) and the JSON answer.
async fn acquire(operator: &OperatorProcess, body: &Value) -> (StatusCode, Option<u64>, Value) {
    let response = crate::support::http::client()
        .post(operator.api_url("/v1/leases"))
        .bearer_auth(API_TOKEN)
        .json(body)
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .expect("call the follower's lease API");
    let status = response.status();
    let retry_after = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .map(|v| {
            v.to_str()
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| panic!("Retry-After {v:?} is not a number of seconds"))
        });
    let text = response.text().await.expect("read the API answer");
    let value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"));
    (status, retry_after, value)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demand_refused_on_a_follower_wakes_the_pool() {
    let Some(world) = World::new("pool-follower").await else {
        return;
    };
    let Some(postgres) = Postgres::shared() else {
        return;
    };
    let ledger = postgres.database();

    // Two replicas of one install: the first takes the Lease, the second follows.
    let leader = replica(&world, "a", &ledger).await;
    within(SLOW, "the first replica holding the Lease", || async {
        (gauge(&leader, "proxy_operator_leader", &[]).await == 1.0).then_some(())
    })
    .await;
    let follower = replica(&world, "b", &ledger).await;
    assert_eq!(gauge(&follower, "proxy_operator_leader", &[]).await, 0.0);
    let lease: Api<Lease> = Api::namespaced(world.client.clone(), "proxy-operator");
    let holder = lease
        .get(&format!("leader-{}", world.ns))
        .await
        .expect("the install's leader Lease")
        .spec
        .and_then(|s| s.holder_identity);
    assert_eq!(
        holder.as_deref(),
        Some(leader.identity().as_str()),
        "the first replica holds the Lease, not {}",
        follower.identity()
    );

    // A pool at zero that autoscaling may wake.
    world
        .create_pool(
            "wake",
            json!({
                "replicas": 0,
                "template": world.pool_template("wake", 5),
                "autoscaling": {"minReplicas": 0, "maxReplicas": 2, "wakeTimeout": "60s"},
            }),
        )
        .await;
    eventually(
        "the leader's first look at pool wake: 0 members",
        || async {
            let pool = world.pools().get("wake").await.ok()?;
            let status = pool.status?;
            (status.observed_generation.is_some()
                && status.replicas == 0
                && status.desired_replicas == Some(0)
                && status.desired_reason.as_deref() == Some("AtTarget"))
            .then_some(())
        },
    )
    .await;
    assert!(world.members("wake").await.is_empty());
    assert_eq!(world.pools().get("wake").await.unwrap().spec.replicas, 0);

    // A crawler asks the follower, retrying with one request ID as a client following
    // Retry-After does. Until the follower's pool watch has the pool, nothing matches (409,
    // and no demand: no pool is named); then the pool is waking.
    let pool_key = format!("{}/wake", world.ns);
    let body = json!({"selector": {"geo": "wake"}, "ttlSeconds": 600,
                      "requestID": "follower-wakes-the-pool-1"});
    let (first, retry_after, waking) = within(SLOW, "the follower knowing the pool", || async {
        let answer = acquire(&follower, &body).await;
        match answer.0 {
            StatusCode::CONFLICT => None,
            _ => Some(answer),
        }
    })
    .await;
    let refused_at = Instant::now();
    assert_eq!(first, StatusCode::SERVICE_UNAVAILABLE, "{waking}");
    assert_eq!(waking["error"], "pool_waking", "{waking}");
    assert_eq!(waking["pools"], json!([pool_key]), "{waking}");
    assert_eq!(waking["wakeTimeoutSeconds"], 60, "{waking}");
    let retry_after = retry_after.expect("a 503 pool_waking has Retry-After");
    assert!(retry_after >= 1, "Retry-After {retry_after}");

    let mut asked = 1;
    let granted = loop {
        assert!(
            refused_at.elapsed() < Duration::from_secs(60),
            "no lease within the pool's wakeTimeout (60 s) after {asked} acquires"
        );
        tokio::time::sleep(Duration::from_secs(retry_after)).await;
        let (status, retry, answer) = acquire(&follower, &body).await;
        asked += 1;
        match status {
            StatusCode::CREATED => break answer,
            StatusCode::SERVICE_UNAVAILABLE => {
                assert_eq!(answer["error"], "pool_waking", "{answer}");
                assert_eq!(retry, Some(retry_after), "{answer}");
            }
            other => panic!("acquire #{asked} on the follower answered {other}: {answer}"),
        }
    };
    let woke_in = refused_at.elapsed();
    let member = granted["proxy"]["name"]
        .as_str()
        .expect("the lease names its proxy")
        .to_owned();
    let all = world.members("wake").await;
    assert!(
        all.contains_key(&member),
        "the lease is on {member}, not a member of pool wake ({:?})",
        all.keys()
    );

    // The leader scaled the pool, for the follower's one refused request.
    let pool = world.pools().get("wake").await.unwrap();
    assert_eq!(
        pool.spec.replicas, 1,
        "one refused request asks for one member"
    );
    assert_eq!(
        world.events_with_reason("wake", "ScaledUp").await,
        [(
            "Normal".to_owned(),
            "scaled from 0 to 1 (ScaleUp)".to_owned()
        )]
    );
    assert_eq!(
        ledger.psql(&format!(
            "SELECT sum(requests) FROM pool_demand WHERE pool = '{pool_key}'"
        )),
        "1",
        "the follower's refusals under one request ID are one request of demand"
    );
    let scaled_up = ["direction=\"up\""];
    assert_eq!(
        gauge(
            &leader,
            "proxy_operator_pool_scale_events_total",
            &scaled_up
        )
        .await,
        1.0
    );
    assert_eq!(
        gauge(
            &follower,
            "proxy_operator_pool_scale_events_total",
            &scaled_up
        )
        .await,
        0.0,
        "the follower scaled"
    );
    // Only the follower's API was asked: the leader granted and refused nothing.
    let leader_metrics = leader.metrics().await;
    for counter in [
        "proxy_operator_leases_granted_total",
        "proxy_operator_leases_replayed_total",
        "proxy_operator_lease_rejections_total",
    ] {
        assert_eq!(
            metric_sum(&leader_metrics, counter, &[]),
            0.0,
            "the leader's lease API was called: {counter}"
        );
    }
    let follower_metrics = follower.metrics().await;
    assert_eq!(
        metric_sum(
            &follower_metrics,
            "proxy_operator_leases_granted_total",
            &[]
        ),
        1.0
    );
    eprintln!(
        "follower wake: granted {woke_in:?} after the first 503 pool_waking, {asked} acquires \
         {retry_after} s apart"
    );
    follower.release(granted["leaseID"].as_str().unwrap()).await;
}

// ---------------------------------------------------------------------------------------------
// Provider quota.

/// A control plane of its own that writes an audit log of every Pod create (the request and
/// the answer): what the API server was asked, as the quota test's outside count. Its files
/// sit in a temp dir named like the harness's roots, which a later test process removes once
/// this one has exited.
fn audited_control_plane() -> Option<(&'static ControlPlane, PathBuf)> {
    static FILES: OnceLock<(PathBuf, PathBuf, Vec<String>)> = OnceLock::new();
    let (policy, log, args) = FILES.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!(
            "proxy-operator-envtest-{}-audit",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).expect("the audit dir");
        let policy = dir.join("policy.yaml");
        std::fs::write(
            &policy,
            "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n\
             - level: Request\n  verbs: [create]\n  resources: [{group: \"\", resources: [pods]}]\n\
             - level: None\n",
        )
        .expect("write the audit policy");
        let log = dir.join("audit.log");
        let args = vec![
            format!("--audit-policy-file={}", policy.display()),
            format!("--audit-log-path={}", log.display()),
            "--audit-log-mode=blocking".to_owned(),
        ];
        (policy, log, args)
    });
    assert!(policy.exists());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Some((
        ControlPlane::dedicated("pod-create-audit", &args)?,
        log.clone(),
    ))
}

/// Pod creates in `ns` by a ServiceAccount (the operator), from the audit log `log`: the
/// Pod's name and the answer's code and message, in order.
fn pod_creates(log: &std::path::Path, ns: &str) -> Vec<(String, i64, String)> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|e| {
            e["stage"] == "ResponseComplete"
                && e["verb"] == "create"
                && e["objectRef"]["resource"] == "pods"
                && e["objectRef"]["namespace"] == ns
                && e["user"]["username"]
                    .as_str()
                    .is_some_and(|u| u.starts_with("system:serviceaccount:"))
        })
        .map(|e| {
            let name = e["requestObject"]["metadata"]["name"]
                .as_str()
                .or(e["objectRef"]["name"].as_str())
                .unwrap_or_default()
                .to_owned();
            let code = e["responseStatus"]["code"].as_i64().unwrap_or_default();
            let message = e["responseStatus"]["message"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            (name, code, message)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_quota_refusal_shows_as_scaling_limited_without_a_retry_storm() {
    let Some((cp, audit)) = audited_control_plane() else {
        return;
    };
    let world = World::on(cp, "pool-quota").await;

    // A ResourceQuota of no Pods at all, enforced: there is no kube-controller-manager to
    // publish its status, so the test does.
    let quotas: Api<ResourceQuota> = Api::namespaced(world.client.clone(), &world.ns);
    let quota: ResourceQuota = serde_json::from_value(json!({
        "metadata": {"name": "no-pods"},
        "spec": {"hard": {"pods": "0"}},
    }))
    .unwrap();
    quotas
        .create(&PostParams::default(), &quota)
        .await
        .expect("create the ResourceQuota");
    quotas
        .patch_status(
            "no-pods",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"hard": {"pods": "0"}, "used": {"pods": "0"}}})),
        )
        .await
        .expect("publish the ResourceQuota's status");
    // Enforced once the server's quota admission has seen that status (a dry run, by the
    // admin: not in the count below).
    let probe: Pod = serde_json::from_value(json!({
        "metadata": {"name": "quota-probe"},
        "spec": {"containers": [{"name": "c", "image": "ubuntu/squid"}]},
    }))
    .unwrap();
    eventually("the ResourceQuota enforced", || async {
        let dry_run = PostParams {
            dry_run: true,
            ..PostParams::default()
        };
        match world.pods().create(&dry_run, &probe).await {
            Err(kube::Error::Api(status))
                if status.code == 403 && status.message.contains("exceeded quota") =>
            {
                Some(())
            }
            _ => None,
        }
    })
    .await;

    let operator = world.operator(&[]).await;
    let started = Instant::now();
    world
        .create_pool(
            "capped",
            json!({"replicas": 3, "template": world.pool_template("capped", 5)}),
        )
        .await;

    // Every member is refused for quota, and the pool says why it has no machines.
    let three: BTreeSet<String> = eventually("three members refused for quota", || async {
        let all = world.members("capped").await;
        let refused = all.values().all(|p| {
            p.status
                .as_ref()
                .and_then(|s| s.condition("Provisioned"))
                .is_some_and(|c| c.status == ConditionStatus::False && c.reason == "QuotaExceeded")
        });
        (all.len() == 3 && refused).then(|| all.into_keys().collect())
    })
    .await;
    eventually("ScalingLimited ProviderQuota on the pool", || async {
        (pool_condition(&world, "capped", "ScalingLimited").await?
            == (ConditionStatus::True, "ProviderQuota".to_owned()))
            .then_some(())
    })
    .await;

    // For 10 s more: still those three members, still limited, still refused.
    let watched = Instant::now();
    while watched.elapsed() < Duration::from_secs(10) {
        let now: BTreeSet<String> = world.members("capped").await.into_keys().collect();
        assert_eq!(now, three, "the pool changed its members while refused");
        assert_eq!(
            pool_condition(&world, "capped", "ScalingLimited").await,
            Some((ConditionStatus::True, "ProviderQuota".to_owned()))
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let elapsed = started.elapsed();
    let creates = pod_creates(&audit, &world.ns);
    let metrics = operator.metrics().await;

    // What the API server was asked: only refusals for quota, at most one per member per
    // --quota-requeue (2 s in these tests) and a little slack, and retried.
    assert!(
        creates
            .iter()
            .all(|(_, code, message)| *code == 403 && message.contains("exceeded quota")),
        "{creates:?}"
    );
    let mut per_pod: BTreeMap<&str, usize> = BTreeMap::new();
    for (name, _, _) in &creates {
        *per_pod.entry(name.as_str()).or_default() += 1;
    }
    assert_eq!(per_pod.len(), 3, "one machine name per member: {per_pod:?}");
    let quota_requeue = 2.0;
    let bound = 3.0 * (elapsed.as_secs_f64() / quota_requeue + 2.0);
    assert!(
        creates.len() as f64 <= bound,
        "{} Pod creates in {elapsed:?}: more than {bound:.1} (3 members × (elapsed / 2 s + 2)): \
         {per_pod:?}",
        creates.len()
    );
    assert!(
        per_pod.values().all(|&n| n >= 2),
        "a refused member is tried again after --quota-requeue: {per_pod:?}"
    );
    assert_eq!(world.members("capped").await.len(), 3);
    let counted = metric_sum(
        &metrics,
        "proxy_operator_provider_requests_total",
        &["op=\"create\""],
    );
    eprintln!(
        "quota: {} Pod creates refused over {elapsed:?} (bound {bound:.1}), per member \
         {per_pod:?}; the operator counted {counted} creates",
        creates.len()
    );
    drop(operator);
}
