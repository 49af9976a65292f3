//! Two replicas of `proxy-operator run` on one Lease (one install ID) and one PostgreSQL
//! ledger, as the PostgreSQL install runs them: only the Lease holder reconciles; the follower
//! probes by itself, so its list and acquires follow a proxy going unhealthy, and a lease taken
//! on one replica is the other's too; when the holder is killed the follower takes the Lease and
//! reconciles, its API answering throughout.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::json;

use crate::support::Squid;
use crate::support::operator::{OperatorProcess, metric_sum};
use crate::support::postgres::{Database, Postgres};
use crate::support::world::{SLOW, World, within};

/// Short, so the failover takes seconds: the follower takes the Lease this long after the
/// holder's last renewal.
const LEASE_DURATION: &str = "3s";

async fn replica(world: &World, name: &str, ledger: &Database) -> OperatorProcess {
    let dir = world.dir.path().join(name);
    std::fs::create_dir_all(&dir).expect("a replica's dir");
    let url = ledger.url();
    let args = ["--leader-lease-duration", LEASE_DURATION, "--ledger", &url];
    OperatorProcess::start_ready(
        world.cp,
        &dir,
        &world.target,
        &world.ns,
        Some(&world.ns),
        &args,
    )
    .await
}

async fn gauge(operator: &OperatorProcess, metric: &str) -> f64 {
    metric_sum(&operator.metrics().await, metric, &[])
}

async fn wait_leader(operator: &OperatorProcess, what: &str) {
    within(SLOW, what, || async {
        (gauge(operator, "proxy_operator_leader").await == 1.0).then_some(())
    })
    .await;
}

/// Whether an acquire for `proxy` (by its name label) is granted; the lease is given back.
async fn acquires(operator: &OperatorProcess, proxy: &str) -> bool {
    let body = json!({"selector": {"name": proxy}, "ttlSeconds": 60});
    let (status, lease) = operator.call(Method::POST, "/v1/leases", Some(body)).await;
    if status == StatusCode::CREATED {
        operator
            .release(lease["leaseID"].as_str().expect("a lease ID"))
            .await;
    }
    status == StatusCode::CREATED
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_lease_holder_reconciles_and_a_follower_takes_over_when_it_dies() {
    let Some(world) = World::new("leadership").await else {
        return;
    };
    let Some(postgres) = Postgres::shared() else {
        return;
    };
    let ledger = postgres.database();
    let mut squid = Squid::start();
    let mut spec = world.external_spec(&squid, "500ms");
    spec["maxLeases"] = json!(10);
    world
        .create("first", spec.clone())
        .await
        .expect("create Proxy first");
    world
        .raw_proxies()
        .patch(
            "first",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"metadata": {"labels": {"name": "first"}}})),
        )
        .await
        .expect("label Proxy first");

    let mut holder = replica(&world, "a", &ledger).await;
    wait_leader(&holder, "the first replica holding the Lease").await;
    world.wait_ready("first").await;
    let follower = replica(&world, "b", &ledger).await;
    assert_eq!(gauge(&follower, "proxy_operator_leader").await, 0.0);

    // The follower probes by itself: its list and its acquires follow the proxy's health.
    follower
        .wait_listed("envtest", "first", "healthy", true)
        .await;
    assert!(acquires(&follower, "first").await);
    // One ledger: a lease taken on the holder is read, and given back, on the follower.
    let (status, lease) = holder
        .call(
            Method::POST,
            "/v1/leases",
            Some(json!({"selector": {"name": "first"}, "ttlSeconds": 60})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{lease}");
    let id = lease["leaseID"].as_str().expect("a lease ID");
    let (status, seen) = follower
        .call(Method::GET, &format!("/v1/leases/{id}"), None)
        .await;
    assert_eq!(
        (status, &seen["state"]),
        (StatusCode::OK, &json!("active")),
        "{seen}"
    );
    follower.release(id).await;
    let (_, seen) = holder
        .call(Method::GET, &format!("/v1/leases/{id}"), None)
        .await;
    assert_eq!(seen["state"], "released", "{seen}");
    squid.kill();
    follower
        .wait_listed("envtest", "first", "healthy", false)
        .await;
    assert!(
        !acquires(&follower, "first").await,
        "a lease on an unhealthy proxy"
    );
    squid.restart();
    follower
        .wait_listed("envtest", "first", "healthy", true)
        .await;
    assert!(acquires(&follower, "first").await);
    // ... while only the holder reconciled.
    assert_eq!(
        gauge(&follower, "proxy_operator_reconcile_duration_seconds_count").await,
        0.0,
        "the follower reconciled"
    );
    assert!(gauge(&holder, "proxy_operator_reconcile_duration_seconds_count").await > 0.0);

    // The holder dies; the follower's API answers every call while it takes over.
    let answering = Arc::new(AtomicBool::new(true));
    let calls = Arc::new(AtomicU64::new(0));
    let failures = Arc::new(std::sync::Mutex::new(Vec::new()));
    let poller = {
        let (answering, calls, failures) = (answering.clone(), calls.clone(), failures.clone());
        let url = follower.api_url("/v1/proxies?selector=pool=envtest");
        tokio::spawn(async move {
            let http = crate::support::http::client();
            while answering.load(Ordering::Relaxed) {
                let answer = http
                    .get(&url)
                    .bearer_auth(crate::support::operator::API_TOKEN)
                    .timeout(Duration::from_secs(5))
                    .send()
                    .await;
                calls.fetch_add(1, Ordering::Relaxed);
                match answer {
                    Ok(response) if response.status() == StatusCode::OK => {}
                    other => failures
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(format!("{other:?}")),
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let killed = Instant::now();
    holder.kill_9();
    world
        .create("second", spec)
        .await
        .expect("create Proxy second");
    wait_leader(&follower, "the follower taking the Lease").await;
    world.wait_ready("second").await;
    let took_over = killed.elapsed();
    answering.store(false, Ordering::Relaxed);
    poller.await.expect("the poller");
    let failures = failures.lock().unwrap_or_else(|e| e.into_inner()).clone();
    assert!(
        failures.is_empty(),
        "the follower's API failed {} of {} calls during the failover: {failures:?}",
        failures.len(),
        calls.load(Ordering::Relaxed)
    );
    assert!(gauge(&follower, "proxy_operator_reconcile_duration_seconds_count").await > 0.0);
    eprintln!(
        "failover: second Proxy Ready {took_over:?} after the holder was killed, {} API calls",
        calls.load(Ordering::Relaxed)
    );
}
