//! Orphan GC as a task: sweeps only while leader, lists live Proxies from the API (mock API
//! server), survives a failing provider, and refuses a namespaced install.

use std::sync::Arc;
use std::time::Duration;

use http::Method;
use kube::Api;
use serde_json::json;
use tokio::sync::watch;

use crate::support::mock_api::{Call, mock_client};
use crate::support::stub_provider::StubProvider;

use proxy_operator::controllers::gc::{GcConfig, GcError, run_gc, sweep};
use proxy_operator::provider::{Instance, InstanceState, Provider};
use proxy_operator::resources::proxy::Proxy;

fn machine(id: &str, uid: &str) -> Instance {
    Instance {
        provider_id: id.into(),
        name: format!("proxy-{id}"),
        state: InstanceState::Running,
        ip: None,
        uid: Some(uid.into()),
        created_at: Some(jiff::Timestamp::UNIX_EPOCH),
        waiting: None,
        deletion_deadline: None,
    }
}

fn stub(name: &str, machines: Vec<Instance>, list_fails: bool) -> Arc<StubProvider> {
    let stub = StubProvider::holding(name, machines);
    Arc::new(if list_fails {
        stub.failing_lists()
    } else {
        stub
    })
}

#[tokio::test]
async fn one_failing_provider_does_not_stop_the_sweep() {
    let broken = stub("broken", vec![], true);
    let local = stub(
        "local",
        vec![machine("orphan", "gone"), machine("kept", "live")],
        false,
    );
    let providers: Vec<Arc<dyn Provider>> = vec![broken, local.clone()];
    let live = ["live".to_owned()].into();
    let report = sweep(
        &providers,
        &live,
        jiff::Timestamp::now(),
        Duration::from_secs(600),
    )
    .await;
    assert_eq!(report.failures, 1);
    assert_eq!(
        report.deleted,
        vec![("local".to_owned(), "orphan".to_owned())]
    );
    assert_eq!(local.ids(), ["kept"]);
}

#[tokio::test]
async fn sweeps_only_while_leader_and_keeps_proxies_being_deleted() {
    let (client, mut handle) = mock_client();
    let api: Api<Proxy> = Api::all(client);
    let local = stub(
        "local",
        vec![
            machine("orphan", "gone"),
            machine("live", "uid-live"),
            machine("deleting", "uid-deleting"),
        ],
        false,
    );
    let (leader_tx, leader_rx) = watch::channel(false);
    let config = GcConfig {
        interval: Duration::from_millis(10),
        min_age: Duration::from_secs(600),
        ..Default::default()
    };
    let task = tokio::spawn(run_gc(api, vec![local.clone()], config, leader_rx));

    // Not leader: no API call, nothing deleted.
    let early = tokio::time::timeout(Duration::from_millis(200), handle.next_request()).await;
    assert!(
        early.is_err(),
        "GC called the API without holding the Lease"
    );
    assert_eq!(local.ids().len(), 3);

    leader_tx.send(true).unwrap();
    let call = Call::next(&mut handle).await;
    assert_eq!(call.method, Method::GET);
    assert_eq!(call.path, "/apis/crawl.example.com/v1alpha1/proxies");
    let list = json!({
        "apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList",
        "metadata": {"resourceVersion": "9"},
        "items": [
            {"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
             "metadata": {"name": "a", "namespace": "x", "uid": "uid-live"}},
            {"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
             "metadata": {"name": "b", "namespace": "y", "uid": "uid-deleting",
                          "deletionTimestamp": "2024-01-01T00:00:00Z",
                          "finalizers": ["crawl.example.com/finalizer"]}},
        ],
    });
    call.respond(200, list);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while local.ids().len() == 3 {
        assert!(tokio::time::Instant::now() < deadline, "orphan not deleted");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(local.ids(), ["live", "deleting"]);

    // Losing the election ends the task (later sweeps fail fast on the closed API).
    drop(handle);
    leader_tx.send(false).unwrap();
    drop(leader_tx);
    let result = tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("GC did not stop")
        .unwrap();
    assert_eq!(result, Ok(()));
}

#[tokio::test]
async fn refuses_a_namespaced_install_unless_allowed() {
    let (client, _handle) = mock_client();
    let api: Api<Proxy> = Api::namespaced(client, "crawl");
    let (_tx, rx) = watch::channel(true);
    let config = GcConfig {
        namespace: Some("crawl".into()),
        ..Default::default()
    };
    let result = run_gc(api, vec![], config, rx).await;
    assert_eq!(result, Err(GcError::Namespaced("crawl".into())));
}
