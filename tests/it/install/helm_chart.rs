//! The Helm chart `charts/proxy-operator/`: lint-clean; with its defaults (release and
//! namespace `proxy-operator`) the same objects as `kubectl kustomize manifests/`, and with
//! the monitoring toggles on also those of `manifests/monitoring/` (the Grafana dashboard's
//! ConfigMap too, from the one copy of its JSON in the chart); its copies of the CRD and the
//! alerts match their sources; the values users set take effect; and on a real API server
//! an upgrade keeps the generated API token.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::Path;

use base64::Engine as _;
use clap::Parser;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use proxy_operator::cli::{Cli, Command, RunArgs};
use proxy_operator::serving::tokens::TokenSet;

use super::tenants::{self, Layout};
use crate::support::ControlPlane;
use crate::support::render::{
    Manifests, chart, helm, helm_template, helm_template_error, repo, run,
};

const RELEASE: &str = "proxy-operator";
const NAMESPACE: &str = "proxy-operator";
const TOGGLES: [&str; 6] = [
    "--set",
    "monitoring.serviceMonitor.enabled=true",
    "--set",
    "monitoring.prometheusRule.enabled=true",
    "--set",
    "monitoring.grafanaDashboard.enabled=true",
];
/// The label Grafana's dashboard sidecar loads ConfigMaps by.
const SIDECAR_LABEL: (&str, &str) = ("grafana_dashboard", "1");
/// The dashboard's ConfigMap with the default release name.
const DASHBOARD: &str = "proxy-operator-grafana-dashboard";
/// The chart's tenants, in the Secret `overlays/tenants` mounts (docs/tenants.md).
const TENANTS: [&str; 2] = ["--set", "tenants.existingSecret=proxy-operator-tenants"];
/// The token the kustomize side is rendered with (the chart generates its own).
const TOKEN: &str = "0123456789abcdef0123456789abcdef";

/// Labels only Helm sets, ignored wherever labels are compared (object labels and selectors):
/// `instance` keeps two releases in one namespace from selecting each other's Pod.
/// [`helm_labels_are_on_every_object`] checks their values.
const HELM_LABELS: [&str; 3] = [
    "helm.sh/chart",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/instance",
];
/// The Pod annotation that restarts the operator on `helm upgrade` when its providers config
/// changed (kustomize users restart it themselves); checked in
/// [`default_values_render_the_kustomize_install`].
const CHECKSUM: &str = "checksum/providers";

type Key = (String, String, String);

fn key(object: &Value) -> Key {
    let field = |value: &Value| value.as_str().unwrap_or_default().to_owned();
    (
        field(&object["kind"]),
        field(&object["metadata"]["namespace"]),
        field(&object["metadata"]["name"]),
    )
}

fn by_key(objects: Vec<Value>) -> BTreeMap<Key, Value> {
    let mut map = BTreeMap::new();
    for object in objects {
        let key = key(&object);
        assert!(map.insert(key.clone(), object).is_none(), "{key:?} twice");
    }
    map
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} rendered"))
}

/// Removes [`HELM_LABELS`] from every map of labels (`labels`, `matchLabels`, a Service's
/// `selector`) in `value`.
fn strip_helm_labels(value: &mut Value) {
    match value {
        Value::Object(map) => {
            for (field, inner) in map.iter_mut() {
                if matches!(field.as_str(), "labels" | "matchLabels" | "selector")
                    && let Value::Object(labels) = inner
                {
                    for label in HELM_LABELS {
                        labels.remove(label);
                    }
                }
                strip_helm_labels(inner);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(strip_helm_labels),
        _ => {}
    }
}

/// The token lines of an API token Secret, removed from it (the two sides' tokens differ by
/// design); the binary must accept them.
fn take_tokens(secret: &mut Value) -> String {
    let data = secret["data"]
        .as_object_mut()
        .expect("the token Secret has data");
    let encoded = data
        .remove("tokens")
        .expect("the Secret has the key tokens");
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(encoded.as_str().expect("base64 text"))
        .expect("valid base64");
    TokenSet::from_file_content(&bytes, "tokens".as_ref())
        .unwrap_or_else(|e| panic!("the operator refuses the Secret's tokens: {e}"));
    String::from_utf8(bytes).expect("UTF-8 tokens")
}

/// The path and both sides of the first difference between `chart` and `kustomize`.
fn first_difference(path: &str, chart: &Value, kustomize: &Value) -> Option<String> {
    match (chart, kustomize) {
        (Value::Object(a), Value::Object(b)) => a
            .keys()
            .chain(b.keys())
            .find_map(|k| first_difference(&format!("{path}.{k}"), &chart[k], &kustomize[k])),
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            (0..a.len()).find_map(|i| first_difference(&format!("{path}[{i}]"), &a[i], &b[i]))
        }
        // kustomize prints the CRD's `65535.0` as `65535`; helm copies crds/ verbatim.
        (Value::Number(a), Value::Number(b)) if a.as_f64() == b.as_f64() => None,
        _ if chart == kustomize => None,
        _ => Some(format!("{path}: chart {chart}, kustomize {kustomize}")),
    }
}

/// Renders the chart with `args` and asserts that it holds exactly the objects of `expected`
/// (kustomize output), equal as JSON but for the documented differences: [`HELM_LABELS`],
/// the Namespace (Helm's `--create-namespace` makes the release namespace), the token in the
/// API token Secret and the [`CHECKSUM`] annotation. Returns the chart's objects.
fn assert_chart_renders(args: &[&str], expected: Vec<Value>) -> Vec<Value> {
    let rendered = helm_template(RELEASE, NAMESPACE, args).expect("helm is installed");
    let mut chart = by_key(rendered.clone());
    let mut kustomize = by_key(expected);
    kustomize
        .remove(&("Namespace".into(), String::new(), NAMESPACE.into()))
        .expect("manifests/ holds the Namespace");
    let secret = (
        "Secret".into(),
        NAMESPACE.into(),
        "proxy-operator-api".into(),
    );
    for side in [&mut chart, &mut kustomize] {
        take_tokens(side.get_mut(&secret).expect("a token Secret"));
        let deployment = (
            "Deployment".into(),
            NAMESPACE.into(),
            "proxy-operator".into(),
        );
        let template = &mut side.get_mut(&deployment).expect("a Deployment")["spec"]["template"];
        if let Some(annotations) = template["metadata"]["annotations"].as_object_mut() {
            annotations.remove(CHECKSUM);
            if annotations.is_empty() {
                template["metadata"]
                    .as_object_mut()
                    .unwrap()
                    .remove("annotations");
            }
        }
        side.values_mut().for_each(strip_helm_labels);
    }
    let chart_keys: Vec<_> = chart.keys().collect();
    let kustomize_keys: Vec<_> = kustomize.keys().collect();
    assert_eq!(
        chart_keys, kustomize_keys,
        "the chart renders other objects"
    );
    for (key, object) in &chart {
        if let Some(difference) = first_difference("", object, &kustomize[key]) {
            panic!("{key:?} differs at {difference}");
        }
    }
    rendered
}

#[test]
fn default_values_render_the_kustomize_install() {
    let Some(expected) = Manifests::copy(TOKEN).kustomize() else {
        return;
    };
    let chart = assert_chart_renders(&[], expected);
    // The checksum is the providers config's: a config change rolls the Pod.
    let config = find(&chart, "ConfigMap", "proxy-operator-providers")["data"]["providers.yaml"]
        .as_str()
        .unwrap();
    let digest: String = Sha256::digest(config.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let pod = &find(&chart, "Deployment", "proxy-operator")["spec"]["template"];
    assert_eq!(pod["metadata"]["annotations"][CHECKSUM], digest.as_str());
}

/// The message of the panic of `assert_chart_renders(args, expected)`; panics when it passes.
fn mismatch(args: &[&str], expected: Vec<Value>) -> String {
    let result = std::panic::catch_unwind(|| assert_chart_renders(args, expected));
    let payload = result.expect_err("the chart and the kustomize install still compare equal");
    payload
        .downcast_ref::<String>()
        .cloned()
        .expect("a formatted panic message")
}

/// The comparison is not vacuous: a change on either side fails it, naming the difference.
#[test]
fn comparison_fails_when_either_side_drifts() {
    let manifests = Manifests::copy(TOKEN);
    let Some(expected) = manifests.kustomize() else {
        return;
    };
    let message = mismatch(&["--set", "logLevel=debug"], expected);
    assert!(
        message.contains(r#"env[2].value: chart "debug", kustomize "info""#),
        "{message}"
    );

    let pvc = manifests.dir().join("pvc.yaml");
    let text = std::fs::read_to_string(&pvc).unwrap();
    assert!(text.contains("storage: 1Gi"), "{text}");
    std::fs::write(&pvc, text.replace("storage: 1Gi", "storage: 2Gi")).unwrap();
    let message = mismatch(&[], manifests.kustomize().unwrap());
    assert!(
        message.contains(r#"storage: chart "1Gi", kustomize "2Gi""#),
        "{message}"
    );
}

#[test]
fn monitoring_toggles_render_manifests_monitoring() {
    let manifests = Manifests::copy(TOKEN);
    let (Some(mut expected), Some(monitoring)) =
        (manifests.kustomize(), manifests.kustomize_at("monitoring"))
    else {
        return;
    };
    assert_eq!(
        monitoring.len(),
        3,
        "a ServiceMonitor, a PrometheusRule and the dashboard's ConfigMap"
    );
    expected.extend(monitoring);
    let chart = assert_chart_renders(&TOGGLES, expected);
    // The dashboard itself, byte for byte the chart's one copy of it.
    let json = std::fs::read_to_string(
        repo().join("charts/proxy-operator/dashboards/proxy-operator.json"),
    )
    .expect("the dashboard's JSON");
    let dashboard = find(&chart, "ConfigMap", DASHBOARD);
    assert_eq!(dashboard["data"]["proxy-operator.json"], json.as_str());
    assert_eq!(
        dashboard["metadata"]["labels"][SIDECAR_LABEL.0],
        SIDECAR_LABEL.1
    );
}

/// Off by default; on, in the release namespace or the one given, with the extra labels
/// beside the sidecar's.
#[test]
fn grafana_dashboard_toggle_namespace_and_labels_take_effect() {
    let Some(defaults) = helm_template(RELEASE, NAMESPACE, &[]) else {
        return;
    };
    assert!(
        !defaults.iter().any(|o| o["metadata"]["name"] == DASHBOARD),
        "the dashboard is rendered by default"
    );
    let Some(objects) = helm_template(
        "crawl",
        "crawling",
        &[
            "--set",
            "monitoring.grafanaDashboard.enabled=true",
            "--set",
            "monitoring.grafanaDashboard.namespace=grafana",
            "--set",
            "monitoring.grafanaDashboard.labels.team=crawl",
        ],
    ) else {
        return;
    };
    let dashboard = find(
        &objects,
        "ConfigMap",
        "crawl-proxy-operator-grafana-dashboard",
    );
    assert_eq!(dashboard["metadata"]["namespace"], "grafana");
    let labels = &dashboard["metadata"]["labels"];
    assert_eq!(labels[SIDECAR_LABEL.0], SIDECAR_LABEL.1, "{labels}");
    assert_eq!(labels["team"], "crawl", "{labels}");
    assert_eq!(labels["app.kubernetes.io/instance"], "crawl", "{labels}");
    let Some(elsewhere) = helm_template(
        "crawl",
        "crawling",
        &["--set", "monitoring.grafanaDashboard.enabled=true"],
    ) else {
        return;
    };
    let dashboard = find(
        &elsewhere,
        "ConfigMap",
        "crawl-proxy-operator-grafana-dashboard",
    );
    assert_eq!(dashboard["metadata"]["namespace"], "crawling");
}

#[test]
fn chart_copies_match_their_sources() {
    for (copy, source) in [
        ("charts/proxy-operator/crds/proxy.yaml", "crd/proxy.yaml"),
        (
            "charts/proxy-operator/crds/proxypool.yaml",
            "crd/proxypool.yaml",
        ),
        (
            "charts/proxy-operator/files/prometheusrule.yaml",
            "manifests/monitoring/prometheusrule.yaml",
        ),
    ] {
        let read =
            |path| std::fs::read(repo().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(
            read(copy) == read(source),
            "{copy} differs from {source}; run: cp {source} {copy}"
        );
    }
}

#[test]
fn chart_lints_clean_with_defaults_with_the_toggles_and_with_tenants() {
    let chart = chart();
    for values in [&[][..], &TOGGLES[..], &TENANTS[..]] {
        for strict in [&[][..], &["--strict"][..]] {
            let mut args: Vec<&OsStr> = vec!["lint".as_ref(), chart.as_os_str()];
            args.extend(values.iter().chain(strict).map(OsStr::new));
            let Some(output) = helm(&args) else {
                return;
            };
            assert!(
                output.contains("1 chart(s) linted, 0 chart(s) failed"),
                "{args:?}: {output}"
            );
            assert!(!output.contains("[WARNING]"), "{args:?}: {output}");
        }
    }
}

#[test]
fn helm_labels_are_on_every_object() {
    let Some(objects) = helm_template("crawl", "crawling", &TOGGLES) else {
        return;
    };
    for object in objects {
        let labels = &object["metadata"]["labels"];
        if object["kind"] == "CustomResourceDefinition" {
            // crds/ is applied as it is, like crd/proxy.yaml.
            assert!(labels.is_null(), "{labels}");
            continue;
        }
        let mut expected = json!({
            "helm.sh/chart": "proxy-operator-0.1.0",
            "app.kubernetes.io/managed-by": "Helm",
            "app.kubernetes.io/instance": "crawl",
            "app.kubernetes.io/name": "proxy-operator",
        });
        // The dashboard's ConfigMap also carries the label the Grafana sidecar loads it by.
        if object["metadata"]["name"] == "crawl-proxy-operator-grafana-dashboard" {
            expected[SIDECAR_LABEL.0] = json!(SIDECAR_LABEL.1);
        }
        assert_eq!(labels, &expected, "{:?}", key(&object));
    }
}

/// The chart's version and appVersion are the crate's.
#[test]
fn chart_version_is_the_crate_version() {
    let text = std::fs::read_to_string(chart().join("Chart.yaml")).unwrap();
    let chart: Value = serde_saphyr::from_str(&text).unwrap();
    assert_eq!(chart["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(chart["appVersion"], env!("CARGO_PKG_VERSION"));
}

fn container(objects: &[Value], deployment: &str) -> Value {
    let pod = &find(objects, "Deployment", deployment)["spec"]["template"]["spec"];
    pod["containers"][0].clone()
}

fn run_args(container: &Value) -> RunArgs {
    let mut argv = vec!["proxy-operator".to_owned()];
    argv.extend(
        container["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_owned()),
    );
    let cli = Cli::try_parse_from(&argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    let Command::Run(run) = cli.command else {
        panic!("the Deployment does not start `run`");
    };
    run
}

#[test]
fn image_extra_args_and_ledger_size_take_effect() {
    let Some(objects) = helm_template(
        RELEASE,
        NAMESPACE,
        &[
            "--set",
            "image.repository=registry.example.com/proxy-operator,image.tag=1.2.3",
            "--set-json",
            r#"extraArgs=["--watch-namespace","crawlers","--health-workers","16"]"#,
            "--set",
            "ledger.size=4Gi,logLevel=debug,installId=eu",
            "--set-json",
            r#"gateway.allowedDestinations=["10.20.0.0/16","127.0.0.1"]"#,
        ],
    ) else {
        return;
    };
    let container = container(&objects, "proxy-operator");
    assert_eq!(
        container["image"],
        "registry.example.com/proxy-operator:1.2.3"
    );
    let run = run_args(&container);
    assert_eq!(run.watch_namespace.as_deref(), Some("crawlers"));
    assert_eq!(run.common.health_workers, 16);
    assert_eq!(run.install_id, "eu");
    assert_eq!(
        run.common.gateway.gateway_allowed_destinations,
        proxy_operator::egress::AllowedRanges::parse("10.20.0.0/16,127.0.0.1").unwrap()
    );
    // Half the volume, as with the default 1Gi and 512MiB.
    assert_eq!(run.common.ledger_max_size, 2 << 30);
    let pvc = find(&objects, "PersistentVolumeClaim", "proxy-operator-ledger");
    assert_eq!(pvc["spec"]["resources"]["requests"]["storage"], "4Gi");
    let env = container["env"].as_array().unwrap();
    let log = env.iter().find(|e| e["name"] == "RUST_LOG").unwrap();
    assert_eq!(log["value"], "debug");
}

/// `gateway.ca.existingSecret` and `gateway.rules`: the CA Secret mounted readable by the Pod's
/// group only (as the operator asks of a CA key) and named by the flags, the rules in a
/// ConfigMap the flag names, mounted as a directory so an edit reaches the file.
#[test]
fn the_gateway_ca_and_rules_values_reach_the_flags_and_mounts() {
    let rules = repo().join("samples/gateway-rules.yaml");
    let Some(objects) = helm_template(
        RELEASE,
        NAMESPACE,
        &[
            "--set",
            "gateway.ca.existingSecret=gateway-ca",
            "--set-file",
            &format!("gateway.rules={}", rules.display()),
        ],
    ) else {
        return;
    };
    let container = container(&objects, "proxy-operator");
    let run = run_args(&container);
    let gateway = &run.common.gateway;
    assert_eq!(
        gateway.gateway_ca_cert.as_deref(),
        Some(Path::new("/etc/proxy-operator-gateway-ca/tls.crt"))
    );
    assert_eq!(
        gateway.gateway_ca_key.as_deref(),
        Some(Path::new("/etc/proxy-operator-gateway-ca/tls.key"))
    );
    assert_eq!(
        gateway.gateway_rules_file.as_deref(),
        Some(Path::new("/etc/proxy-operator-gateway-rules/rules.yaml"))
    );
    let pod = &find(&objects, "Deployment", "proxy-operator")["spec"]["template"]["spec"];
    let volume = |name: &str| {
        pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no volume {name}"))
            .clone()
    };
    assert_eq!(volume("gateway-ca")["secret"]["secretName"], "gateway-ca");
    assert_eq!(volume("gateway-ca")["secret"]["defaultMode"], 0o440);
    assert_eq!(
        volume("gateway-rules")["configMap"]["name"],
        "proxy-operator-gateway-rules"
    );
    let config = find(&objects, "ConfigMap", "proxy-operator-gateway-rules");
    assert_eq!(
        config["data"]["rules.yaml"].as_str(),
        Some(std::fs::read_to_string(&rules).unwrap().as_str())
    );
}

#[test]
fn existing_secret_replaces_the_generated_one() {
    let Some(objects) = helm_template(
        RELEASE,
        NAMESPACE,
        &["--set", "apiToken.existingSecret=crawler-tokens"],
    ) else {
        return;
    };
    assert!(
        objects.iter().all(|o| o["kind"] != "Secret"),
        "a Secret is still generated"
    );
    let pod = &find(&objects, "Deployment", "proxy-operator")["spec"]["template"]["spec"];
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "api-token")
        .expect("the api-token volume");
    assert_eq!(volume["secret"]["secretName"], "crawler-tokens");
    let run = run_args(&pod["containers"][0]);
    assert_eq!(
        run.common.discovery_token_file.as_deref(),
        Some("/etc/proxy-operator-api/tokens".as_ref())
    );
}

#[test]
fn another_release_keeps_every_reference_inside_it() {
    let Some(objects) = helm_template(
        "crawl",
        "crawling",
        &["--set", "serviceAccount.annotations.team=crawl"],
    ) else {
        return;
    };
    let full = "crawl-proxy-operator";
    let pod = &find(&objects, "Deployment", full)["spec"]["template"];
    let spec = &pod["spec"];
    let account = find(&objects, "ServiceAccount", full);
    assert_eq!(account["metadata"]["annotations"]["team"], "crawl");
    assert_eq!(spec["serviceAccountName"], full);
    for (binding, role) in [
        ("ClusterRoleBinding", "ClusterRole"),
        ("RoleBinding", "Role"),
    ] {
        let name = if role == "Role" {
            format!("{full}-leader-election")
        } else {
            full.to_owned()
        };
        let binding = find(&objects, binding, &name);
        find(&objects, role, binding["roleRef"]["name"].as_str().unwrap());
        assert_eq!(
            binding["subjects"],
            json!([{"kind": "ServiceAccount", "name": full, "namespace": "crawling"}])
        );
    }
    let volumes = spec["volumes"].as_array().unwrap();
    let volume = |name: &str| volumes.iter().find(|v| v["name"] == name).unwrap().clone();
    find(
        &objects,
        "ConfigMap",
        volume("providers")["configMap"]["name"].as_str().unwrap(),
    );
    find(
        &objects,
        "Secret",
        volume("api-token")["secret"]["secretName"]
            .as_str()
            .unwrap(),
    );
    find(
        &objects,
        "PersistentVolumeClaim",
        volume("ledger")["persistentVolumeClaim"]["claimName"]
            .as_str()
            .unwrap(),
    );
    // The Service and the Deployment select this release's Pod, not another release's.
    let labels = &pod["metadata"]["labels"];
    assert_eq!(labels["app.kubernetes.io/instance"], "crawl");
    let deployment = find(&objects, "Deployment", full);
    for selector in [
        &find(&objects, "Service", full)["spec"]["selector"],
        &deployment["spec"]["selector"]["matchLabels"],
    ] {
        assert_eq!(selector, labels);
    }
    for object in &objects {
        if object["kind"] != "CustomResourceDefinition" {
            let name = object["metadata"]["name"].as_str().unwrap();
            assert!(name.starts_with(full), "{:?}", key(object));
        }
    }
}

#[test]
fn values_the_chart_does_not_offer_are_refused() {
    // One replica only: the ledger is one SQLite file with one writer.
    for (value, message) in [
        ("replicaCount=2", "Additional property replicaCount"),
        ("ledger.size=1G", "ledger.size"),
        ("imgae.tag=1.2.3", "Additional property imgae"),
    ] {
        let Some(error) = helm_template_error(RELEASE, NAMESPACE, &["--set", value]) else {
            return;
        };
        assert!(error.contains(message), "--set {value}: {error}");
    }
    let Some(objects) = helm_template(RELEASE, NAMESPACE, &[]) else {
        return;
    };
    let deployment = find(&objects, "Deployment", "proxy-operator");
    assert_eq!(deployment["spec"]["replicas"], 1);
    assert_eq!(deployment["spec"]["strategy"]["type"], "Recreate");
}

/// `tenants.existingSecret` set: the same objects as `kubectl kustomize overlays/tenants`, as
/// the defaults render `manifests/` (the flag, the mount and the volume alike, in order).
#[test]
fn tenants_value_renders_the_tenants_overlay() {
    let Some(expected) = Layout::copy().kustomize(tenants::OVERLAY) else {
        return;
    };
    let chart = assert_chart_renders(&TENANTS, expected);
    let pod = &find(&chart, "Deployment", "proxy-operator")["spec"]["template"]["spec"];
    let run = tenants::run_args(&pod["containers"][0]);
    assert_eq!(
        run.common.tenants_file.as_deref(),
        Some("/etc/proxy-operator-tenants/tenants.yaml".as_ref())
    );
}

/// `helm template` with `args` and the generated token taken out (it differs between two
/// renders by design).
fn without_tokens(args: &[&str]) -> Option<Vec<Value>> {
    let mut objects = helm_template(RELEASE, NAMESPACE, args)?;
    for secret in objects.iter_mut().filter(|o| o["kind"] == "Secret") {
        take_tokens(secret);
    }
    Some(objects)
}

/// With `tenants.existingSecret` the chart renders what it renders without, plus exactly the
/// flag, the read-only mount and the volume of that Secret's key (`tenants.key`); without it,
/// `tenants.key` changes nothing. The chart never renders the tenants' Secret itself.
#[test]
fn tenants_values_add_exactly_the_mount_and_the_flag() {
    let Some(unset) = without_tokens(&[]) else {
        return;
    };
    for (values, secret, key) in [
        (TENANTS[1], tenants::SECRET, tenants::KEY),
        (
            "tenants.existingSecret=crawl-teams,tenants.key=teams.yaml",
            "crawl-teams",
            "teams.yaml",
        ),
    ] {
        let set = without_tokens(&["--set", values]).expect("helm is installed");
        if let Err(difference) = tenants::tenants_added(&unset, &set, secret, key) {
            panic!("--set {values}: not the defaults plus the tenants: {difference}");
        }
        assert!(
            set.iter().all(|o| o["metadata"]["name"] != secret),
            "--set {values}: the chart renders {secret}"
        );
    }
    let key_only = without_tokens(&["--set", "tenants.key=teams.yaml"]).expect("helm is installed");
    assert_eq!(key_only, unset, "tenants.key alone changed the rendering");
    // Not vacuous: the comparison sees the wrong key, and the wrong Secret.
    let set = without_tokens(&["--set", "tenants.existingSecret=crawl-teams"]).expect("helm");
    let wrong_key = tenants::tenants_added(&unset, &set, "crawl-teams", "teams.yaml");
    assert!(
        wrong_key
            .as_ref()
            .is_err_and(|e| e.contains("is not the Secret's key teams.yaml")),
        "{wrong_key:?}"
    );
    let wrong_secret = tenants::tenants_added(&unset, &set, tenants::SECRET, tenants::KEY);
    assert!(
        wrong_secret
            .as_ref()
            .is_err_and(|e| e.contains("is not Secret proxy-operator-tenants")),
        "{wrong_secret:?}"
    );
}

/// Tenants values the chart does not offer, or that Kubernetes would refuse, fail the render.
#[test]
fn tenants_values_the_chart_does_not_offer_are_refused() {
    for (value, message) in [
        ("tenants.secret=crawl-teams", "Additional property secret"),
        (
            "tenants.existingSecret=Crawl_Teams",
            "tenants.existingSecret",
        ),
        ("tenants.key=teams/a.yaml", "tenants.key"),
    ] {
        let Some(error) = helm_template_error(RELEASE, NAMESPACE, &["--set", value]) else {
            return;
        };
        assert!(error.contains(message), "--set {value}: {error}");
    }
}

/// The generated token is read by the command the install notes print, survives `helm upgrade`
/// (the chart looks it up), and so does a token added to the Secret by hand: on a real API
/// server, since `helm template` never looks anything up.
#[tokio::test]
async fn upgrade_keeps_the_generated_token() {
    let Some(plane) = ControlPlane::shared() else {
        return;
    };
    let namespace = plane.new_namespace("helm-token").await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("admin.kubeconfig");
    plane.write_admin_kubeconfig(&kubeconfig);
    // Its own release name: cluster-scoped names (ClusterRole) are then its own.
    let release = format!("token-{}", &namespace[namespace.len() - 10..]);
    let helm_in_namespace = |command: &str| {
        let chart = chart();
        let args: [&OsStr; 8] = [
            command.as_ref(),
            release.as_ref(),
            chart.as_os_str(),
            "--namespace".as_ref(),
            namespace.as_ref(),
            "--kubeconfig".as_ref(),
            kubeconfig.as_os_str(),
            "--skip-crds".as_ref(),
        ];
        helm(args).expect("helm is installed")
    };
    let notes = helm_in_namespace("install");

    let secrets = Api::<Secret>::namespaced(plane.admin_client(), &namespace);
    let name = format!("{release}-proxy-operator-api");
    let tokens = |secret: Secret| {
        let mut value = serde_json::to_value(secret).unwrap();
        take_tokens(&mut value)
    };
    let installed = tokens(secrets.get(&name).await.expect("the chart made the Secret"));
    assert_eq!(installed.lines().count(), 1, "{installed:?}");
    // The command the install's notes give for reading the token reads it.
    let command = notes
        .lines()
        .find(|line| line.contains("export TOKEN="))
        .unwrap_or_else(|| panic!("no token command in the notes:\n{notes}"));
    let printed = run(std::process::Command::new("sh")
        .args(["-c", &format!("{command} && printf '%s\\n' \"$TOKEN\"")])
        .env("KUBECONFIG", &kubeconfig));
    assert_eq!(printed, installed);

    helm_in_namespace("upgrade");
    let upgraded = tokens(secrets.get(&name).await.unwrap());
    assert_eq!(upgraded, installed, "helm upgrade rotated the token");

    // A rotation: a second token added by hand stays through an upgrade.
    let rotated = format!("{installed}{TOKEN}\n");
    let patch = json!({"stringData": {"tokens": rotated}});
    secrets
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("add a token");
    helm_in_namespace("upgrade");
    assert_eq!(tokens(secrets.get(&name).await.unwrap()), rotated);
}
