//! External proxies through `proxy-operator run` on a real API server: a new one gets one
//! status write (its first probe's verdict included) and no finalizer; the finalizer an older
//! install or a copied manifest left on one is removed, also from one whose deletion it blocks;
//! the leases of a deleted one end, whether the operator saw the deletion or was down for it.

use crate::support;

use futures::StreamExt;
use kube::api::{DeleteParams, DynamicObject, PostParams};
use kube::runtime::watcher;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use support::Squid;
use support::operator::{OperatorProcess, lease_id};
use support::world::{SLOW, World, eventually, wait_gone};

use proxy_operator::controllers::proxy::deleted::LEASES_PROXY_DELETED;
use proxy_operator::resources::proxy::FINALIZER;

/// An External spec on `squid` probing the world's target. The first status write waits up
/// to the 30 s interval, the 20 s probe timeout and 5 s for the first probe: a loaded
/// machine's first probe through a loopback squid comes well within that, even when the
/// operator's health engine had not listed its first inventory yet and spread the probe over
/// one interval.
fn spec(world: &World, squid: &Squid) -> Value {
    json!({
        "mode": "External",
        "endpoint": {"host": "127.0.0.1", "port": squid.port()},
        "healthCheck": {
            "probeURL": world.target.https_url(),
            "interval": "30s",
            "timeout": "20s",
        },
    })
}

/// Creates the External Proxy `name` carrying `finalizers`, as a manifest copied off an
/// object an older install had finalized would.
async fn create_with_finalizers(world: &World, name: &str, spec: Value, finalizers: &[&str]) {
    let object: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "crawl.example.com/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": name, "labels": {"pool": "envtest"}, "finalizers": finalizers},
        "spec": spec,
    }))
    .expect("a Proxy object");
    world
        .raw_proxies()
        .create(&PostParams::default(), &object)
        .await
        .unwrap_or_else(|e| panic!("create {name}: {e}"));
}

fn finalizers(proxy: &Value) -> Vec<String> {
    serde_json::from_value(proxy["metadata"]["finalizers"].clone()).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_external_proxy_is_written_once_with_its_health_and_no_finalizer() {
    let Some(world) = World::new("external-once").await else {
        return;
    };
    let squid = Squid::start();
    let _operator = world.operator(&[]).await;
    // Every version of the object, from its create on, as a watch from before it sees them.
    let mut versions = Box::pin(watcher(
        world.raw_proxies(),
        watcher::Config::default().fields("metadata.name=ext"),
    ));
    loop {
        match versions.next().await {
            Some(Ok(watcher::Event::InitDone)) => break,
            Some(Ok(_)) => {}
            other => panic!("the test's watch did not list: {other:?}"),
        }
    }
    world
        .create("ext", spec(&world, &squid))
        .await
        .expect("create the External Proxy");

    let mut seen: Vec<Value> = Vec::new();
    let waiting = async {
        while let Some(event) = versions.next().await {
            if let Ok(watcher::Event::Apply(object)) = event {
                let object = serde_json::to_value(&object).expect("a Proxy as JSON");
                let ready = object["status"]["phase"] == "Ready";
                seen.push(object);
                if ready {
                    return;
                }
            }
        }
    };
    tokio::time::timeout(SLOW, waiting)
        .await
        .unwrap_or_else(|_| panic!("ext not Ready within {SLOW:?}; versions seen: {seen:#?}"));

    // The create, then one write that is already Ready.
    let statuses: Vec<&Value> = seen.iter().map(|o| &o["status"]).collect();
    assert_eq!(
        seen.len(),
        2,
        "the create and one status write, no other: {statuses:#?}"
    );
    assert!(statuses[0].is_null(), "{statuses:#?}");
    let ready = &seen[1];
    assert_eq!(ready["status"]["ip"], "127.0.0.1", "{ready}");
    let conditions = ready["status"]["conditions"]
        .as_array()
        .expect("conditions");
    let condition = |kind: &str| {
        conditions
            .iter()
            .find(|c| c["type"] == kind)
            .unwrap_or_else(|| panic!("no {kind} condition: {ready}"))
    };
    assert_eq!(condition("Provisioned")["reason"], "ExternalEndpoint");
    assert_eq!(condition("Healthy")["status"], "True");
    assert!(ready["status"]["latencyMs"].is_i64(), "{ready}");
    assert!(
        finalizers(ready).is_empty(),
        "an External Proxy gets no finalizer: {ready}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_external_proxy_loses_the_old_finalizer_and_deletes_without_delay() {
    let Some(world) = World::new("external-finalizer").await else {
        return;
    };
    let squid = Squid::start();
    // Before any operator runs: one that carries our finalizer, and one that carries it and
    // was deleted meanwhile, so its deletion waits on it; another party's finalizer stays.
    create_with_finalizers(&world, "kept", spec(&world, &squid), &[FINALIZER]).await;
    create_with_finalizers(
        &world,
        "shared",
        spec(&world, &squid),
        &[FINALIZER, "example.com/other"],
    )
    .await;
    create_with_finalizers(&world, "deleted", spec(&world, &squid), &[FINALIZER]).await;
    world
        .raw_proxies()
        .delete("deleted", &DeleteParams::default())
        .await
        .expect("delete the finalized Proxy");
    let stuck = world
        .raw_proxies()
        .get("deleted")
        .await
        .expect("the deleted Proxy waits on its finalizer");
    assert!(stuck.metadata.deletion_timestamp.is_some());

    let _operator = world.operator(&[]).await;
    wait_gone(&world.proxies(), "deleted").await;
    world.wait_ready("kept").await;
    let kept = eventually("kept without our finalizer", || async {
        let object = world.raw_proxies().get("kept").await.ok()?;
        let value = serde_json::to_value(object).ok()?;
        finalizers(&value).is_empty().then_some(value)
    })
    .await;
    assert_eq!(kept["status"]["phase"], "Ready", "{kept}");
    let shared = eventually("shared without our finalizer", || async {
        let object = world.raw_proxies().get("shared").await.ok()?;
        let value = serde_json::to_value(object).ok()?;
        (!finalizers(&value).iter().any(|f| f == FINALIZER)).then_some(value)
    })
    .await;
    assert_eq!(finalizers(&shared), ["example.com/other"], "{shared}");

    // Nothing holds a deletion any more.
    world
        .raw_proxies()
        .delete("kept", &DeleteParams::default())
        .await
        .expect("delete kept");
    wait_gone(&world.proxies(), "kept").await;
}

/// Takes a lease on the proxy `name` (the only one labelled `proxy=<name>`), waiting until
/// the operator's inventory has it healthy.
async fn lease_on(operator: &OperatorProcess, name: &str) -> String {
    let lease = operator
        .acquire_retrying(
            &json!({"selector": {"proxy": name}, "ttlSeconds": 3600}),
            &format!("a lease on {name}"),
        )
        .await;
    assert_eq!(lease["proxy"]["name"], name, "{lease}");
    lease_id(&lease)
}

/// Waits until the ledger shows lease `id` ended because its Proxy was deleted, and checks
/// that the API says so too.
async fn wait_ended_by_deletion(operator: &OperatorProcess, id: &str) {
    let ledger = operator.ledger();
    let expected = format!("released|{LEASES_PROXY_DELETED}");
    eventually("the lease ended because its Proxy was deleted", || async {
        let row = support::sqlite3(
            &ledger,
            &format!("SELECT state, release_reason FROM leases WHERE id = '{id}'"),
        );
        (row == expected).then_some(())
    })
    .await;
    let (status, view) = operator
        .call(Method::GET, &format!("/v1/leases/{id}"), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{view}");
    assert_eq!(view["state"], "released", "{view}");
    let (status, renewed) = operator.renew(id, 60).await;
    assert_eq!(
        status,
        StatusCode::CONFLICT,
        "a crawler's renew moves it on: {renewed}"
    );
}

/// An External spec whose selection label names it, so a lease lands on it.
fn labelled(world: &World, name: &str, squid: &Squid) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "crawl.example.com/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": name, "labels": {"pool": "envtest", "proxy": name}},
        "spec": spec(world, squid),
    }))
    .expect("a Proxy object")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_external_proxys_leases_end_seen_or_missed() {
    let Some(world) = World::new("external-delete").await else {
        return;
    };
    let squid = Squid::start();
    let mut operator = world.operator(&[]).await;
    let proxies = world.raw_proxies();
    for name in ["seen", "missed"] {
        proxies
            .create(&PostParams::default(), &labelled(&world, name, &squid))
            .await
            .unwrap_or_else(|e| panic!("create {name}: {e}"));
    }

    // Deleted while the operator runs: the watch's delete event ends the lease.
    let seen = lease_on(&operator, "seen").await;
    proxies
        .delete("seen", &DeleteParams::default())
        .await
        .expect("delete seen");
    wait_gone(&world.proxies(), "seen").await;
    wait_ended_by_deletion(&operator, &seen).await;

    // Deleted while no operator runs (no finalizer waits for one): the sweep of the next
    // leader finds the lease of a proxy the API server no longer has.
    let missed = lease_on(&operator, "missed").await;
    operator.kill_9();
    proxies
        .delete("missed", &DeleteParams::default())
        .await
        .expect("delete missed");
    wait_gone(&world.proxies(), "missed").await;
    operator.restart();
    operator.wait_ready(SLOW).await;
    wait_ended_by_deletion(&operator, &missed).await;
    assert!(
        operator.log_text().contains("ended 1 active leases"),
        "the log names the ended leases"
    );
}
