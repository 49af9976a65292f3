//! The kubernetes provider's API calls, against kube's mock service: each scenario asserts the
//! requests in order (method, path, query, body) and answers with canned objects or Status
//! errors, the way an API server would.

use http::Method;
use proxy_operator::provider::config::KubernetesConfig;
use proxy_operator::provider::kubernetes::KubernetesProvider;
use proxy_operator::provider::{
    CreateRequest, ErrorClass, INSTALL_LABEL, InstanceState, Provider, machine_labels,
};
use proxy_operator::resources::proxy::{MANAGED_LABEL, PROXY_UID_LABEL};
use serde_json::{Value, json};

use crate::support::mock_api::{ApiHandle, Call, mock_client, status, with_server};

const UID: &str = "6a1f4c9e-2b7d-4e8a-b1c3-d5e6f7a8b9c0";

fn provider() -> (KubernetesProvider, ApiHandle) {
    let (client, handle) = mock_client();
    let config = KubernetesConfig {
        image: "ubuntu/squid".to_owned(),
        ..KubernetesConfig::default()
    };
    (
        KubernetesProvider::new("local", &config, "prod", client),
        handle,
    )
}

fn machine() -> String {
    proxy_operator::resources::naming::machine_name(UID)
}

fn request() -> CreateRequest {
    CreateRequest {
        namespace: "crawl".to_owned(),
        proxy_name: "eu-1".to_owned(),
        proxy_uid: UID.to_owned(),
        machine_name: machine(),
        port: 3129,
        placement: None,
        cloud_init: None,
        labels: machine_labels(UID, "prod"),
        credentials: None,
    }
}

/// A Pod as the API server returns it.
fn pod(namespace: &str, name: &str, phase: &str, ip: Option<&str>) -> Value {
    let mut status = json!({"phase": phase});
    if let Some(ip) = ip {
        status["podIP"] = json!(ip);
    }
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": "pod-uid",
            "creationTimestamp": "2026-01-02T03:04:05Z",
            "labels": {
                MANAGED_LABEL: "true",
                PROXY_UID_LABEL: UID,
                INSTALL_LABEL: "prod",
            },
        },
        "spec": {"containers": [{"name": "squid", "image": "ubuntu/squid"}]},
        "status": status,
    })
}

#[tokio::test]
async fn create_posts_one_pod_and_returns_it_provisioning() {
    let (provider, handle) = provider();
    let instance = with_server(
        handle,
        |mut handle| async move {
            let call = Call::next(&mut handle).await;
            assert_eq!(call.method, Method::POST);
            assert_eq!(call.path, "/api/v1/namespaces/crawl/pods");
            let body = &call.body;
            assert_eq!(body["metadata"]["name"], machine());
            assert_eq!(body["metadata"]["namespace"], "crawl");
            assert_eq!(body["metadata"]["labels"][MANAGED_LABEL], "true");
            assert_eq!(body["metadata"]["labels"][PROXY_UID_LABEL], UID);
            assert_eq!(body["metadata"]["labels"][INSTALL_LABEL], "prod");
            let container = &body["spec"]["containers"][0];
            assert_eq!(container["image"], "ubuntu/squid");
            assert_eq!(container["env"][0]["name"], "SQUID_CONFIG");
            let config = container["env"][0]["value"].as_str().unwrap();
            assert!(config.contains("\nhttp_port 3129\n"), "{config}");
            assert_eq!(container["ports"][0]["containerPort"], 3129);
            assert_eq!(
                container["readinessProbe"]["tcpSocket"]["port"],
                json!(3129)
            );
            call.respond(201, pod("crawl", &machine(), "Pending", None));
        },
        provider.create(&request()),
    )
    .await
    .unwrap();
    assert_eq!(instance.provider_id, format!("crawl/{}", machine()));
    assert_eq!(instance.name, machine());
    assert_eq!(instance.state, InstanceState::Provisioning);
    assert_eq!(instance.ip, None);
    assert_eq!(instance.uid.as_deref(), Some(UID));
    assert_eq!(
        instance.created_at,
        Some("2026-01-02T03:04:05Z".parse().unwrap())
    );
}

#[tokio::test]
async fn create_that_already_exists_reads_the_existing_pod() {
    let (provider, handle) = provider();
    let instance = with_server(
        handle,
        |mut handle| async move {
            let call = Call::next(&mut handle).await;
            assert_eq!(call.method, Method::POST);
            let message = format!("pods \"{}\" already exists", machine());
            call.respond(409, status(409, "AlreadyExists", &message));
            let call = Call::next(&mut handle).await;
            assert_eq!(call.method, Method::GET);
            assert_eq!(
                call.path,
                format!("/api/v1/namespaces/crawl/pods/{}", machine())
            );
            call.respond(200, pod("crawl", &machine(), "Running", Some("10.244.0.7")));
        },
        provider.create(&request()),
    )
    .await
    .unwrap();
    assert_eq!(instance.provider_id, format!("crawl/{}", machine()));
    assert_eq!(instance.state, InstanceState::Running);
    assert_eq!(instance.ip.as_deref(), Some("10.244.0.7"));
}

#[tokio::test]
async fn create_refused_by_a_resource_quota_is_quota_exceeded() {
    let (provider, handle) = provider();
    let err = with_server(
        handle,
        |mut handle| async move {
            let message = "pods \"x\" is forbidden: exceeded quota: crawl-quota, requested: pods=1, used: pods=10, limited: pods=10";
            Call::next(&mut handle)
                .await
                .respond(403, status(403, "Forbidden", message));
        },
        provider.create(&request()),
    )
    .await
    .unwrap_err();
    assert_eq!(err.class, ErrorClass::QuotaExceeded);
}

#[tokio::test]
async fn create_server_error_is_transient_and_names_the_call() {
    let (provider, handle) = provider();
    let err = with_server(
        handle,
        |mut handle| async move {
            Call::next(&mut handle)
                .await
                .respond(500, status(500, "InternalError", "etcdserver: timeout"));
        },
        provider.create(&request()),
    )
    .await
    .unwrap_err();
    assert_eq!(err.class, ErrorClass::Transient);
    assert_eq!(err.op, "create");
    assert_eq!(err.provider, "local");
    assert_eq!(err.id, format!("crawl/{}", machine()));
    assert!(err.to_string().contains("etcdserver: timeout"), "{err}");
}

#[tokio::test]
async fn get_reads_the_pod_by_namespace_and_name() {
    let (provider, handle) = provider();
    let id = format!("crawl/{}", machine());
    let instance = with_server(
        handle,
        |mut handle| async move {
            let call = Call::next(&mut handle).await;
            assert_eq!(call.method, Method::GET);
            assert_eq!(
                call.path,
                format!("/api/v1/namespaces/crawl/pods/{}", machine())
            );
            call.respond(200, pod("crawl", &machine(), "Running", Some("10.244.1.9")));
        },
        provider.get(&id),
    )
    .await
    .unwrap();
    assert_eq!(instance.provider_id, id);
    assert_eq!(instance.state, InstanceState::Running);
    assert_eq!(instance.ip.as_deref(), Some("10.244.1.9"));
}

#[tokio::test]
async fn get_of_a_missing_pod_is_not_found() {
    let (provider, handle) = provider();
    let err = with_server(
        handle,
        |mut handle| async move {
            Call::next(&mut handle)
                .await
                .respond(404, status(404, "NotFound", "pods \"x\" not found"));
        },
        provider.get("crawl/proxy-aaaaaaaaaaaaaaaa"),
    )
    .await
    .unwrap_err();
    assert_eq!(err.class, ErrorClass::NotFound);
    assert!(err.is_not_found());
}

#[tokio::test]
async fn get_server_error_is_transient() {
    let (provider, handle) = provider();
    let err = with_server(
        handle,
        |mut handle| async move {
            Call::next(&mut handle)
                .await
                .respond(503, status(503, "ServiceUnavailable", "try later"));
        },
        provider.get("crawl/proxy-aaaaaaaaaaaaaaaa"),
    )
    .await
    .unwrap_err();
    assert_eq!(err.class, ErrorClass::Transient);
    assert_eq!(err.op, "get");
}

#[tokio::test]
async fn malformed_provider_id_is_permanent_and_calls_nothing() {
    let (provider, mut handle) = provider();
    for id in ["no-slash", "/name", "ns/", "a/b/c"] {
        let err = provider.get(id).await.unwrap_err();
        assert_eq!(err.class, ErrorClass::Permanent, "{id}");
        assert!(err.to_string().contains("<namespace>/<pod>"), "{err}");
        let err = provider.delete(id).await.unwrap_err();
        assert_eq!(err.class, ErrorClass::Permanent, "{id}");
    }
    drop(provider);
    assert!(handle.next_request().await.is_none());
}

#[tokio::test]
async fn delete_deletes_the_pod() {
    let (provider, handle) = provider();
    with_server(
        handle,
        |mut handle| async move {
            let call = Call::next(&mut handle).await;
            assert_eq!(call.method, Method::DELETE);
            assert_eq!(
                call.path,
                format!("/api/v1/namespaces/crawl/pods/{}", machine())
            );
            call.respond(200, pod("crawl", &machine(), "Running", Some("10.0.0.1")));
        },
        provider.delete(&format!("crawl/{}", machine())),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn delete_of_a_missing_pod_succeeds() {
    let (provider, handle) = provider();
    with_server(
        handle,
        |mut handle| async move {
            let call = Call::next(&mut handle).await;
            assert_eq!(call.method, Method::DELETE);
            call.respond(404, status(404, "NotFound", "pods \"x\" not found"));
        },
        provider.delete("crawl/proxy-aaaaaaaaaaaaaaaa"),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn delete_server_error_is_transient() {
    let (provider, handle) = provider();
    let err = with_server(
        handle,
        |mut handle| async move {
            Call::next(&mut handle)
                .await
                .respond(500, status(500, "InternalError", "boom"));
        },
        provider.delete("crawl/proxy-aaaaaaaaaaaaaaaa"),
    )
    .await
    .unwrap_err();
    assert_eq!(err.class, ErrorClass::Transient);
    assert_eq!(err.op, "delete");
}

#[tokio::test]
async fn list_managed_selects_by_label_across_namespaces_and_pages() {
    let (provider, handle) = provider();
    let instances = with_server(
        handle,
        |mut handle| async move {
            let selector = "crawl.example.com/managed=true,crawl.example.com/install=prod";
            let call = Call::next(&mut handle).await;
            assert_eq!(call.method, Method::GET);
            assert_eq!(call.path, "/api/v1/pods");
            assert_eq!(call.query["labelSelector"], selector);
            assert_eq!(call.query["limit"], "500");
            assert!(!call.query.contains_key("continue"));
            call.respond(
                200,
                json!({
                    "apiVersion": "v1", "kind": "PodList",
                    "metadata": {"continue": "page-2"},
                    "items": [
                        pod("crawl", "proxy-aaaaaaaaaaaaaaaa", "Running", Some("10.0.0.1")),
                        pod("team-b", "proxy-bbbbbbbbbbbbbbbb", "Pending", None),
                    ],
                }),
            );
            let call = Call::next(&mut handle).await;
            assert_eq!(call.path, "/api/v1/pods");
            assert_eq!(call.query["labelSelector"], selector);
            assert_eq!(call.query["continue"], "page-2");
            call.respond(
                200,
                json!({
                    "apiVersion": "v1", "kind": "PodList", "metadata": {},
                    "items": [pod("team-c", "proxy-cccccccccccccccc", "Failed", None)],
                }),
            );
        },
        provider.list_managed(),
    )
    .await
    .unwrap();
    let summary: Vec<(&str, InstanceState)> = instances
        .iter()
        .map(|i| (i.provider_id.as_str(), i.state))
        .collect();
    assert_eq!(
        summary,
        [
            ("crawl/proxy-aaaaaaaaaaaaaaaa", InstanceState::Running),
            ("team-b/proxy-bbbbbbbbbbbbbbbb", InstanceState::Provisioning),
            ("team-c/proxy-cccccccccccccccc", InstanceState::Terminated),
        ]
    );
    assert!(instances.iter().all(|i| i.uid.as_deref() == Some(UID)));
}

#[tokio::test]
async fn list_managed_error_is_classified() {
    let (provider, handle) = provider();
    let err = with_server(
        handle,
        |mut handle| async move {
            Call::next(&mut handle).await.respond(
                403,
                status(
                    403,
                    "Forbidden",
                    "pods is forbidden: cannot list pods at the cluster scope",
                ),
            );
        },
        provider.list_managed(),
    )
    .await
    .unwrap_err();
    assert_eq!(err.class, ErrorClass::Refused);
    assert_eq!(err.op, "list");
    assert!(
        err.to_string()
            .ends_with("pods is forbidden: cannot list pods at the cluster scope (403 Forbidden)"),
        "{err}"
    );
}

#[tokio::test]
async fn force_delete_deletes_the_pod_without_a_grace_period() {
    let (provider, handle) = provider();
    with_server(
        handle,
        |mut handle| async move {
            let call = Call::next(&mut handle).await;
            assert_eq!(call.method, Method::DELETE);
            assert_eq!(
                call.path,
                format!("/api/v1/namespaces/crawl/pods/{}", machine())
            );
            assert_eq!(call.body["gracePeriodSeconds"], 0, "{}", call.body);
            call.respond(200, pod("crawl", &machine(), "Running", Some("10.0.0.1")));
            let call = Call::next(&mut handle).await;
            call.respond(404, status(404, "NotFound", "pods \"x\" not found"));
        },
        async {
            let id = format!("crawl/{}", machine());
            provider.force_delete(&id).await?;
            // Gone already: a second force-delete succeeds too.
            provider.force_delete(&id).await
        },
    )
    .await
    .unwrap();
}
