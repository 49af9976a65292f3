//! Every sample in `samples/` parses into the Rust types and passes the CRD's rules.

use std::path::{Path, PathBuf};

use proxy_operator::provider::ProvidersConfig;
use proxy_operator::resources::proxy::{Mode, Proxy};
use proxy_operator::resources::validation::ProxyValidator;

fn samples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("samples")
}

fn proxies_in(file: &str) -> Vec<Proxy> {
    let text = std::fs::read_to_string(samples_dir().join(file)).unwrap();
    serde_saphyr::from_multiple(&text).unwrap_or_else(|e| panic!("{file}: {e}"))
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
fn standalone_sample_loads_as_an_inventory() {
    let file =
        proxy_operator::inventory::file::InventoryFile::new(samples_dir().join("standalone.yaml"))
            .unwrap();
    let proxies = file.load().unwrap().proxies;
    assert_eq!(proxies.len(), 3);
    assert!(proxies.iter().all(|p| p.spec.mode == Mode::External));
    assert_eq!(proxies[2].key(), "partners/partner-eu-1");
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
}

#[test]
fn every_yaml_sample_is_covered() {
    let covered = [
        "proxy_kubernetes.yaml",
        "proxy_gcp.yaml",
        "proxy_external.yaml",
        "providers-config.yaml",
        "standalone.yaml",
    ];
    for entry in std::fs::read_dir(samples_dir()).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        assert!(
            covered.contains(&name.as_str()),
            "samples/{name} has no test"
        );
    }
}
