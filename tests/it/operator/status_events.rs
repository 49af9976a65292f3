//! A Proxy's page on the status page in operator mode, on a real API server: its status
//! conditions from the reconciler and its Kubernetes Events, read with the operator's own
//! RBAC (list on core `events`), by the Proxy's name and UID.

use crate::support;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, PostParams};
use reqwest::{Method, StatusCode};
use serde_json::Value;
use support::Squid;
use support::world::{World, eventually};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_page_shows_its_conditions_and_events() {
    let Some(world) = World::new("status-events").await else {
        return;
    };
    let squid = Squid::start();
    world
        .create("edge", world.external_spec(&squid, "1s"))
        .await
        .expect("create the Proxy");
    let operator = world.operator(&[]).await;
    world.wait_ready("edge").await;
    let proxy = world.proxies().get("edge").await.expect("read the Proxy");

    // An Event about it, as the reconciler's recorder writes them (events.k8s.io/v1), and
    // one about another object of the same name and kind but another UID (a Proxy deleted
    // and re-created): only the first is this Proxy's.
    let events: Api<Event> = Api::namespaced(world.client.clone(), &world.ns);
    for (name, uid, note) in [
        ("edge.first", proxy.metadata.uid.clone(), "about this proxy"),
        (
            "edge.other",
            Some("another-uid".to_owned()),
            "about an earlier proxy",
        ),
    ] {
        let event = Event {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                ..ObjectMeta::default()
            },
            regarding: Some(ObjectReference {
                api_version: Some("crawl.example.com/v1alpha1".to_owned()),
                kind: Some("Proxy".to_owned()),
                name: Some("edge".to_owned()),
                namespace: Some(world.ns.clone()),
                uid,
                ..ObjectReference::default()
            }),
            reason: Some("Tested".to_owned()),
            note: Some(note.to_owned()),
            type_: Some("Warning".to_owned()),
            action: Some("Test".to_owned()),
            event_time: Some(MicroTime(jiff::Timestamp::now())),
            reporting_controller: Some("tests.example.com/status".to_owned()),
            reporting_instance: Some("status-events".to_owned()),
            ..Event::default()
        };
        events
            .create(&PostParams::default(), &event)
            .await
            .expect("create the Event");
    }

    let path = format!("/v1/status/proxies/{}/edge", world.ns);
    // The page reads the Proxy from the operator's watch, which sees the status a moment
    // after the API server has it (and a new External proxy's status is written once its
    // first probe answered, so its health can say Ready before its conditions are there).
    let detail: Value = eventually(
        "the proxy's page to list its Event and conditions",
        || async {
            let (status, body) = operator.call(Method::GET, &path, None).await;
            assert_eq!(status, StatusCode::OK, "{body}");
            let listed = body["events"]
                .as_array()
                .is_some_and(|e| e.iter().any(|e| e["reason"] == "Tested"));
            let conditions = body["conditions"].as_array().is_some_and(|c| !c.is_empty());
            (listed && conditions && body["proxy"]["phase"] == "Ready").then_some(body)
        },
    )
    .await;
    let tested: Vec<&Value> = detail["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["reason"] == "Tested")
        .collect();
    assert_eq!(tested.len(), 1, "only this UID's: {detail}");
    assert_eq!(tested[0]["message"], "about this proxy", "{detail}");
    assert_eq!(tested[0]["type"], "Warning", "{detail}");
    assert_eq!(detail["proxy"]["phase"], "Ready", "{detail}");
    let conditions: Vec<&str> = detail["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["type"].as_str())
        .collect();
    assert!(
        conditions.contains(&"Provisioned") && conditions.contains(&"Healthy"),
        "{detail}"
    );
}
