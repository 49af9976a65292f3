//! Building providers from the config through an explicit constructor map, and the metering
//! decorator every built provider is wrapped in. Kubernetes API calls go to kube's mock service.

use std::path::Path;
use std::sync::Arc;

use prometheus::Registry;
use proxy_operator::provider::kubernetes::KubernetesProvider;
use proxy_operator::provider::registry::{
    Constructors, RegistryError, build_providers, validate_install_id,
};
use proxy_operator::provider::squid_conf::{PortRange, SquidEgress};
use proxy_operator::provider::{
    CreateRequest, ErrorClass, Provider, ProviderType, ProvidersConfig, machine_labels,
};
use serde_json::json;

use crate::support::mock_api::{ApiHandle, Call, mock_client, status};

fn config(text: &str) -> ProvidersConfig {
    ProvidersConfig::parse(text, Path::new("providers.yaml")).unwrap()
}

/// Answers the next request with `code` and a Pod or Status body, returning the request path.
async fn answer(handle: &mut ApiHandle, code: u16) -> String {
    let call = Call::next(handle).await;
    let path = call.path.clone();
    let body = if code < 300 {
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "proxy-aaaaaaaaaaaaaaaa", "namespace": "crawl"},
            "status": {"phase": "Pending"},
        })
    } else {
        status(code, "Whatever", "canned")
    };
    call.respond(code, body);
    path
}

fn counter(registry: &Registry, provider: &str, op: &str, result: &str) -> u64 {
    registry
        .gather()
        .iter()
        .filter(|family| family.name() == "proxy_operator_provider_requests_total")
        .flat_map(|family| family.get_metric())
        .filter(|metric| {
            let labels: Vec<(&str, &str)> = metric
                .get_label()
                .iter()
                .map(|l| (l.name(), l.value()))
                .collect();
            labels == [("op", op), ("provider", provider), ("result", result)]
        })
        .map(|metric| metric.get_counter().value() as u64)
        .sum()
}

type Seen = Arc<std::sync::Mutex<Vec<(String, String)>>>;

/// Constructors for kubernetes only, recording the (entry name, install id) of every call.
fn kubernetes_only(client: kube::Client) -> (Constructors, Seen) {
    let seen = Seen::default();
    let record = Arc::clone(&seen);
    let constructors = Constructors::new().with(ProviderType::Kubernetes, move |entry, id| {
        record
            .lock()
            .unwrap()
            .push((entry.name.clone(), id.clone()));
        let client = client.clone();
        async move {
            let config = entry.kubernetes.clone().ok_or("no kubernetes block")?;
            let provider = KubernetesProvider::new(&entry.name, &config, id, client);
            Ok(Arc::new(provider) as Arc<dyn Provider>)
        }
    });
    (constructors, seen)
}

const TWO_CLUSTERS: &str = "providers:\n\
    - {name: local, type: kubernetes, kubernetes: {}}\n\
    - {name: other, type: kubernetes, kubernetes: {image: example/squid}}\n";

#[tokio::test]
async fn every_entry_is_built_and_metered() {
    let (client, mut handle) = mock_client();
    let registry = Registry::new();
    let providers = build_providers(
        &config(TWO_CLUSTERS),
        &Constructors::standard(client, SquidEgress::default()),
        "prod",
        &registry,
    )
    .await
    .unwrap();
    assert_eq!(
        providers.keys().map(String::as_str).collect::<Vec<_>>(),
        ["local", "other"]
    );
    let local = Arc::clone(&providers["local"]);
    assert_eq!(local.name(), "local");
    assert_eq!(providers["other"].name(), "other");

    let server = tokio::spawn(async move {
        assert_eq!(
            answer(&mut handle, 404).await,
            "/api/v1/namespaces/crawl/pods/proxy-aaaaaaaaaaaaaaaa"
        );
        answer(&mut handle, 200).await;
        answer(&mut handle, 500).await;
        answer(&mut handle, 404).await;
    });
    let id = "crawl/proxy-aaaaaaaaaaaaaaaa";
    let err = local.get(id).await.unwrap_err();
    assert_eq!(err.class, ErrorClass::NotFound);
    local.get(id).await.unwrap();
    assert_eq!(
        local.get(id).await.unwrap_err().class,
        ErrorClass::Transient
    );
    local.delete(id).await.unwrap();
    server.await.unwrap();

    assert_eq!(counter(&registry, "local", "get", "not_found"), 1);
    assert_eq!(counter(&registry, "local", "get", "ok"), 1);
    assert_eq!(counter(&registry, "local", "get", "transient"), 1);
    assert_eq!(counter(&registry, "local", "delete", "ok"), 1);
    assert_eq!(counter(&registry, "other", "get", "ok"), 0);
}

#[tokio::test]
async fn a_type_without_constructor_is_refused_by_entry_name() {
    let (client, _handle) = mock_client();
    let (constructors, _) = kubernetes_only(client);
    let err = build_providers(
        &config("providers:\n- {name: gcp-eu, type: gcp, gcp: {project: p}}\n"),
        &constructors,
        "prod",
        &Registry::new(),
    )
    .await
    .err()
    .unwrap();
    assert!(
        matches!(&err, RegistryError::NoConstructor { name, type_ } if name == "gcp-eu" && type_ == "gcp"),
        "{err}"
    );
    assert!(err.to_string().contains("`gcp` feature"), "{err}");
}

#[tokio::test]
async fn a_failing_constructor_stops_the_build_naming_the_entry() {
    let constructors = Constructors::new().with(ProviderType::Kubernetes, |_, _| async {
        Err::<Arc<dyn Provider>, _>("no kubeconfig found".into())
    });
    let err = build_providers(
        &config(TWO_CLUSTERS),
        &constructors,
        "prod",
        &Registry::new(),
    )
    .await
    .err()
    .unwrap();
    assert!(
        matches!(&err, RegistryError::Build { name, .. } if name == "local"),
        "{err}"
    );
    assert!(err.to_string().contains("no kubeconfig found"), "{err}");
}

#[tokio::test]
async fn the_install_id_is_passed_to_every_constructor() {
    let (client, _handle) = mock_client();
    let (constructors, seen) = kubernetes_only(client);
    build_providers(
        &config(TWO_CLUSTERS),
        &constructors,
        "eu-2",
        &Registry::new(),
    )
    .await
    .unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        [
            ("local".to_owned(), "eu-2".to_owned()),
            ("other".to_owned(), "eu-2".to_owned())
        ]
    );
}

#[tokio::test]
async fn an_invalid_install_id_is_refused_before_anything_is_built() {
    let (client, _handle) = mock_client();
    let (constructors, seen) = kubernetes_only(client);
    let err = build_providers(
        &config(TWO_CLUSTERS),
        &constructors,
        "Prod",
        &Registry::new(),
    )
    .await
    .err()
    .unwrap();
    assert!(matches!(err, RegistryError::InvalidInstallId(ref id) if id == "Prod"));
    assert!(seen.lock().unwrap().is_empty());
}

#[test]
fn install_id_rules() {
    for ok in ["prod", "a", "eu-west-2", "0abc9", &"a".repeat(63)] {
        assert!(validate_install_id(ok).is_ok(), "{ok}");
    }
    for bad in [
        "",
        "Prod",
        "-prod",
        "prod-",
        "prod_1",
        "prod.eu",
        "prod/eu",
        &"a".repeat(64),
    ] {
        assert!(validate_install_id(bad).is_err(), "{bad:?}");
    }
}

#[tokio::test]
async fn a_registry_that_already_counts_provider_calls_is_refused() {
    let (client, _handle) = mock_client();
    let registry = Registry::new();
    let constructors = Constructors::standard(client, SquidEgress::default());
    build_providers(&config(TWO_CLUSTERS), &constructors, "prod", &registry)
        .await
        .unwrap();
    let err = build_providers(&config(TWO_CLUSTERS), &constructors, "prod", &registry)
        .await
        .err()
        .unwrap();
    assert!(matches!(err, RegistryError::Metrics(_)), "{err}");
}

#[tokio::test]
async fn the_standard_kubernetes_provider_gives_its_squids_the_egress() {
    let (client, mut handle) = mock_client();
    let egress = SquidEgress {
        destinations: vec!["10.20.0.0/16".parse().unwrap()],
        ports: vec![PortRange::parse("8000-8100").unwrap()],
    };
    let providers = build_providers(
        &config(TWO_CLUSTERS),
        &Constructors::standard(client, egress),
        "prod",
        &Registry::new(),
    )
    .await
    .unwrap();
    let uid = "6a1f4c9e-2b7d-4e8a-b1c3-d5e6f7a8b9c0";
    let request = CreateRequest {
        namespace: "crawl".to_owned(),
        proxy_name: "eu-1".to_owned(),
        proxy_uid: uid.to_owned(),
        machine_name: "proxy-aaaaaaaaaaaaaaaa".to_owned(),
        port: 3128,
        placement: None,
        cloud_init: None,
        labels: machine_labels(uid, "prod"),
        credentials: None,
    };
    let server = tokio::spawn(async move {
        let call = Call::next(&mut handle).await;
        let config = call.body["spec"]["containers"][0]["env"][0]["value"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        call.respond(
            201,
            json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "proxy-aaaaaaaaaaaaaaaa", "namespace": "crawl"},
                "status": {"phase": "Pending"},
            }),
        );
        config
    });
    providers["other"].create(&request).await.unwrap();
    let config = server.await.unwrap();
    let lines: Vec<&str> = config.lines().collect();
    for wanted in [
        "# Opened: 10.20.0.0/16",
        "acl Safe_ports port 8000-8100",
        "http_access deny proxy_operator_denied",
    ] {
        assert!(lines.contains(&wanted), "no {wanted:?} in:\n{config}");
    }
    // The opened range is cut out of the refused ones; its neighbours stay refused.
    assert!(!config.contains(" 10.0.0.0/8"), "{config}");
    assert!(config.contains(" 10.21.0.0/16"), "{config}");
}
