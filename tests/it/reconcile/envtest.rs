//! The reconciler's writes on a real Kubernetes API server, driven in process where the point is
//! a situation the binary cannot be made to hit on cue: a reconcile handed a stale copy of a
//! Proxy (the watch cache lags a write), one handed the copy of a Proxy deleted meanwhile, and
//! an Event whose note is longer than the Events API takes.
//!
//! Needs `KUBEBUILDER_ASSETS`, like `operator::lifecycle`.

use crate::support;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::events::v1::Event as EventObject;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action as Requeue;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Client, Resource, ResourceExt};
use proxy_operator::controllers::proxy::{Context, ReconcilerConfig, ReconcilerMetrics, reconcile};
use proxy_operator::events::{NOTE_LIMIT, event};
use proxy_operator::ledger::{LedgerConfig, SqliteLedger, SqliteOptions, SystemClock};
use proxy_operator::resources::proxy::{Proxy, ProxySpec};
use serde_json::json;
use support::envtest::ControlPlane;

/// A fresh namespace on the shared control plane and the admin client, or `None` (skipped).
async fn namespace(prefix: &str) -> Option<(String, Client)> {
    let cp = ControlPlane::shared()?;
    cp.apply_crd().await;
    Some((cp.new_namespace(prefix).await, cp.admin_client()))
}

/// A reconcile context with no providers and a real ledger (kept by the returned guard).
fn context(client: Client) -> (Arc<Context>, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let ledger = SqliteLedger::open(
        &dir.path().join("ledger.db"),
        SqliteOptions::default(),
        LedgerConfig::default(),
        Arc::new(SystemClock),
    )
    .expect("open the ledger");
    let ctx = Context::new(
        client,
        HashMap::new(),
        "reconcile-envtest".to_owned(),
        ReconcilerConfig::default(),
        Arc::new(ledger),
        ReconcilerMetrics::register(&prometheus::Registry::new()).expect("fleet metrics"),
    );
    (Arc::new(ctx), dir)
}

fn external(name: &str, host: &str) -> Proxy {
    let spec: ProxySpec = serde_json::from_value(json!({
        "mode": "External",
        "endpoint": {"host": host, "port": 3128},
    }))
    .expect("an External spec");
    Proxy::new(name, spec)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconcile_of_a_stale_copy_never_writes_its_status() {
    let Some((ns, client)) = namespace("stale").await else {
        return;
    };
    let proxies: Api<Proxy> = Api::namespaced(client.clone(), &ns);
    let stale = proxies
        .create(&PostParams::default(), &external("p", "10.0.0.1"))
        .await
        .expect("create the Proxy");
    // The object moves on (a user edits the endpoint); the copy the reconcile gets does not.
    proxies
        .patch(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"endpoint": {"host": "10.0.0.2"}}})),
        )
        .await
        .expect("edit the endpoint");
    let (ctx, _ledger) = context(client);

    let requeue = reconcile(Arc::new(stale), ctx.clone())
        .await
        .expect("a stale write is a requeue, not an error");
    assert_eq!(
        requeue,
        Requeue::requeue(Duration::ZERO),
        "requeued at once"
    );
    let stored = proxies.get("p").await.expect("read the Proxy");
    assert_eq!(
        stored.status.as_ref().and_then(|s| s.ip.clone()),
        None,
        "the stale endpoint must not be written: {:?}",
        stored.status
    );

    // The reconcile that the requeue brings, from the current object, writes the new address.
    let requeue = reconcile(Arc::new(stored), ctx)
        .await
        .expect("reconcile the current copy");
    assert_eq!(requeue, Requeue::await_change());
    let stored = proxies.get("p").await.expect("read the Proxy");
    assert_eq!(
        stored.status.and_then(|s| s.ip).as_deref(),
        Some("10.0.0.2")
    );
}

/// The API server's NotFound for the Proxy itself ends the reconcile as done, not as a failure
/// to log and retry: a Proxy without a finalizer is gone the moment it is deleted, while the
/// store may still hand out its last copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconcile_of_a_proxy_deleted_meanwhile_is_no_failure() {
    let Some((ns, client)) = namespace("gone").await else {
        return;
    };
    let proxies: Api<Proxy> = Api::namespaced(client.clone(), &ns);
    let copy = proxies
        .create(&PostParams::default(), &external("p", "10.0.0.1"))
        .await
        .expect("create the Proxy");
    proxies
        .delete("p", &Default::default())
        .await
        .expect("delete the Proxy");
    assert!(
        proxies.get_opt("p").await.expect("read").is_none(),
        "an External Proxy has no finalizer: gone at once"
    );
    let (ctx, _ledger) = context(client);
    let requeue = reconcile(Arc::new(copy), ctx)
        .await
        .unwrap_or_else(|e| panic!("a deleted Proxy's reconcile is no failure: {e}"));
    assert_eq!(requeue, Requeue::await_change());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_notes_are_cut_to_what_the_events_api_takes() {
    let Some((ns, client)) = namespace("notes").await else {
        return;
    };
    let proxies: Api<Proxy> = Api::namespaced(client.clone(), &ns);
    let proxy = proxies
        .create(&PostParams::default(), &external("p", "10.0.0.1"))
        .await
        .expect("create the Proxy");
    let reference = proxy.object_ref(&());
    let recorder = Recorder::new(client.clone(), "proxy-operator".into());
    // A provider's refusal can run to kilobytes (a PodSecurity verdict lists every violation).
    let long = format!(
        "pods \"proxy-x\" is forbidden: {}",
        "violation; ".repeat(500)
    );
    assert!(long.len() > 4 * NOTE_LIMIT);

    let uncut = Event {
        type_: EventType::Warning,
        reason: "Uncut".to_owned(),
        note: Some(long.clone()),
        action: "Provision".to_owned(),
        secondary: None,
    };
    assert!(
        recorder.publish(&uncut, &reference).await.is_err(),
        "the server takes notes over {NOTE_LIMIT} bytes, so cutting them would not be needed"
    );
    recorder
        .publish(
            &event(EventType::Warning, "Refused", "Provision", long.clone()),
            &reference,
        )
        .await
        .expect("a cut note is accepted");

    let events: Api<EventObject> = Api::namespaced(client, &ns);
    let stored = events
        .list(&ListParams::default())
        .await
        .expect("list Events");
    let refused: Vec<&EventObject> = stored
        .items
        .iter()
        .filter(|e| e.reason.as_deref() == Some("Refused"))
        .collect();
    assert_eq!(refused.len(), 1, "{:?}", stored.items);
    let note = refused[0].note.as_deref().unwrap_or_default();
    assert!(note.len() <= NOTE_LIMIT && note.ends_with("..."), "{note}");
    assert!(long.starts_with(note.trim_end_matches("...")));
    assert_eq!(
        refused[0].regarding.as_ref().and_then(|r| r.name.clone()),
        Some(proxy.name_any())
    );
}
