//! Every sample in `samples/` parses into the Rust types and passes the CRD's rules; the
//! ProxyPool sample on a real API server, where it must decode back to what the file says.

use crate::support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use proxy_operator::provider::ProvidersConfig;
use proxy_operator::resources::crd::{Kind, schema_of};
use proxy_operator::resources::pool::ProxyPool;
use proxy_operator::resources::proxy::{Mode, Proxy};
use proxy_operator::resources::validation::ProxyValidator;
use serde_json::{Value, json};

fn samples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("samples")
}

/// The `Proxy` documents of a sample (a Secret beside them is skipped).
fn proxies_in(file: &str) -> Vec<Proxy> {
    let text = std::fs::read_to_string(samples_dir().join(file)).unwrap();
    let documents: Vec<Value> =
        serde_saphyr::from_multiple(&text).unwrap_or_else(|e| panic!("{file}: {e}"));
    documents
        .into_iter()
        .filter(|document| document["kind"] == "Proxy")
        .map(|document| serde_json::from_value(document).unwrap_or_else(|e| panic!("{file}: {e}")))
        .collect()
}

fn assert_valid(file: &str, proxies: &[Proxy]) {
    let validator = ProxyValidator::new().unwrap();
    assert!(!proxies.is_empty(), "{file} holds no Proxy");
    for proxy in proxies {
        let json = serde_json::to_value(proxy).unwrap();
        if let Err(violations) = validator.validate_create(&json) {
            panic!("{file}: {}: {violations:?}", proxy.key());
        }
    }
}

#[test]
fn kubernetes_sample() {
    let proxies = proxies_in("proxy_kubernetes.yaml");
    assert_valid("proxy_kubernetes.yaml", &proxies);
    assert_eq!(proxies[0].spec.mode, Mode::Managed);
    assert_eq!(proxies[0].spec.provider.as_deref(), Some("local"));
}

#[test]
fn gcp_sample() {
    let proxies = proxies_in("proxy_gcp.yaml");
    assert_valid("proxy_gcp.yaml", &proxies);
    let placement = proxies[0].spec.placement.as_ref().unwrap();
    assert_eq!(placement.zone.as_deref(), Some("europe-west1-b"));
    assert!(
        proxies[0]
            .spec
            .cloud_init
            .as_ref()
            .unwrap()
            .inline
            .is_some()
    );
}

#[test]
fn external_sample() {
    let proxies = proxies_in("proxy_external.yaml");
    assert_valid("proxy_external.yaml", &proxies);
    assert_eq!(proxies[0].spec.mode, Mode::External);
    assert_eq!(proxies[0].spec.effective_port(None), 8080);
}

#[test]
fn rotating_sample() {
    let proxies = proxies_in("proxy_rotating.yaml");
    assert_valid("proxy_rotating.yaml", &proxies);
    let rotating = proxies[0].spec.rotating().expect("a rotating endpoint");
    assert_eq!(rotating.selector_fields(), ["geo"]);
    assert_eq!(
        proxies[0].spec.max_leases(),
        1000,
        "maxSessions is the capacity"
    );
}

#[test]
fn standalone_sample_loads_as_an_inventory() {
    let file =
        proxy_operator::inventory::file::InventoryFile::new(samples_dir().join("standalone.yaml"))
            .unwrap();
    let proxies = file.load().unwrap().proxies;
    assert_eq!(proxies.len(), 3);
    assert!(proxies.iter().all(|p| p.spec.mode == Mode::External));
    assert_eq!(proxies[2].key(), "partners/partner-eu-1");
}

/// The one ProxyPool of `samples/proxypool.yaml`, as JSON.
fn pool_sample_json() -> Value {
    let text = std::fs::read_to_string(samples_dir().join("proxypool.yaml")).unwrap();
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("proxypool.yaml: {e}"))
}

/// What docs/pools.md says the sample is: pool `eu` of squid Pods labelled `geo: eu`, 3 to
/// start, autoscaled 0..10 at 0.7, down after 10m, waking for at most 60s.
fn assert_is_the_documented_pool(pool: &ProxyPool) {
    assert_eq!(pool.metadata.name.as_deref(), Some("eu"));
    let spec = &pool.spec;
    assert_eq!(spec.replicas, 3);
    assert_eq!(
        spec.template.metadata.labels.get("geo").map(String::as_str),
        Some("eu")
    );
    assert_eq!(spec.template.spec.mode, Mode::Managed);
    assert_eq!(spec.template.spec.provider.as_deref(), Some("local"));
    assert_eq!(spec.strategy.surge(3), Ok(1));
    assert_eq!(spec.strategy.unavailable(3), Ok(0));
    let autoscaling = spec.autoscaling.as_ref().expect("the sample autoscales");
    assert_eq!(
        (autoscaling.min_replicas, autoscaling.max_replicas),
        (0, 10)
    );
    assert!((autoscaling.target_utilization - 0.7).abs() < f64::EPSILON);
    assert_eq!(autoscaling.scale_down_after(), Duration::from_secs(600));
    assert_eq!(autoscaling.wake_timeout(), Duration::from_secs(60));
}

#[test]
fn pool_sample_is_the_documented_pool_and_passes_the_crd() {
    let json = pool_sample_json();
    let pool: ProxyPool = serde_json::from_value(json.clone()).expect("a ProxyPool");
    assert_is_the_documented_pool(&pool);
    // The CRD's value constraints, read from the generated schema. Its CEL rules are the
    // API server's to judge (below): kube-cel cannot evaluate the `type()` of the strategy's.
    let schema = schema_of(Kind::ProxyPool);
    let constraints = jsonschema::validator_for(&schema).expect("the schema compiles");
    let errors: Vec<String> = constraints
        .iter_errors(&json)
        .map(|e| e.to_string())
        .collect();
    assert!(errors.is_empty(), "proxypool.yaml: {errors:?}");
    // Its template is a valid Managed Proxy, CEL rules included.
    let member = json!({
        "apiVersion": "crawl.example.com/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": "eu-member", "namespace": "default"},
        "spec": json["spec"]["template"]["spec"],
    });
    if let Err(violations) = ProxyValidator::new().unwrap().validate_create(&member) {
        panic!("proxypool.yaml's template: {violations:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_server_accepts_the_pool_sample_as_written() {
    let Some(plane) = support::ControlPlane::shared() else {
        return;
    };
    plane.apply_crd().await;
    let namespace = plane.new_namespace("pool-sample").await;
    let pools: Api<DynamicObject> = Api::namespaced_with(
        plane.admin_client(),
        &namespace,
        &ApiResource::erase::<ProxyPool>(&()),
    );
    let mut object = pool_sample_json();
    object["metadata"]["namespace"] = json!(namespace);
    let object: DynamicObject = serde_json::from_value(object).expect("an object");
    let created = pools
        .create(&PostParams::default(), &object)
        .await
        .unwrap_or_else(|e| panic!("the API server refused samples/proxypool.yaml: {e}"));
    let stored: ProxyPool = serde_json::from_value(serde_json::to_value(&created).unwrap())
        .expect("the operator decodes what the server stored");
    assert_is_the_documented_pool(&stored);
    assert_eq!(
        created.data["spec"]["autoscaling"]["scaleDownAfter"], "10m",
        "stored as written"
    );
}

#[test]
fn managed_samples_name_providers_in_the_providers_config() {
    let config = ProvidersConfig::load(&samples_dir().join("providers-config.yaml")).unwrap();
    for file in ["proxy_kubernetes.yaml", "proxy_gcp.yaml"] {
        for proxy in proxies_in(file) {
            let provider = proxy.spec.provider.as_deref().unwrap();
            assert!(
                config.get(provider).is_some(),
                "{file}: unknown provider {provider}"
            );
        }
    }
    let pool: ProxyPool = serde_json::from_value(pool_sample_json()).unwrap();
    let provider = pool.spec.template.spec.provider.as_deref().unwrap();
    assert!(
        config.get(provider).is_some(),
        "proxypool.yaml: unknown provider {provider}"
    );
}

#[test]
fn the_providers_config_sample_s_commented_egress_block_loads_once_uncommented() {
    let path = samples_dir().join("providers-config.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    // The `# egress:` line and the indented comment lines after it, uncommented.
    let mut inside = false;
    let uncommented: String = text
        .lines()
        .map(|line| {
            inside = line == "# egress:" || (inside && line.starts_with("#   "));
            let line = if inside { &line[2..] } else { line };
            format!("{line}\n")
        })
        .collect();
    assert_ne!(uncommented, text, "no commented egress block in the sample");
    let config = ProvidersConfig::parse(&uncommented, &path).unwrap();
    let ranges: Vec<String> = config
        .egress
        .allowed_destinations
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(ranges, ["10.20.0.5/32"]);
    let ports: Vec<String> = config
        .egress
        .allowed_ports
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(ports, ["8080", "8000-8100"]);
    assert_eq!(
        config.providers,
        ProvidersConfig::load(&path).unwrap().providers
    );
}

#[test]
fn the_gateway_rules_sample_loads() {
    let file =
        proxy_operator::gateway::rules::RulesFile::new(samples_dir().join("gateway-rules.yaml"));
    let (rules, _) = file.load().unwrap_or_else(|e| panic!("{e}"));
    assert!(!rules.rules.is_empty(), "the sample names no rule");
    assert!(
        !rules.chains.is_empty(),
        "the sample names no fallback chain"
    );
}

#[test]
fn every_yaml_sample_is_covered() {
    let covered = [
        "proxy_kubernetes.yaml",
        "proxy_gcp.yaml",
        "proxy_external.yaml",
        "providers-config.yaml",
        "standalone.yaml",
        "proxypool.yaml",
        "gateway-rules.yaml",
        "proxy_rotating.yaml",
    ];
    for entry in std::fs::read_dir(samples_dir()).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        assert!(
            covered.contains(&name.as_str()),
            "samples/{name} has no test"
        );
    }
}
