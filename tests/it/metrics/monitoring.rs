//! The opt-in monitoring assets (`manifests/monitoring/`): the kustomization renders exactly the
//! ServiceMonitor, the PrometheusRule and the Grafana dashboard's ConfigMap, and the install
//! leaves them out; the ServiceMonitor
//! selects the operator's Service and its `metrics` port; `promtool test rules`
//! (`tests/data/monitoring/alerts.test.yaml`) fires and quiets every alert; and a real
//! Prometheus scraping the standalone binary fires `ProxyOperatorNoHealthyProxy` when the only
//! squid dies and resolves it when squid is back.

use crate::support;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use serde_json::Value;
use support::prometheus::{self, Prometheus};
use support::render::{self, repo};
use support::standalone::{ExternalProxy, Standalone};
use support::{DEADLINE, Squid, Target};

const TOKEN: &str = "monitoring-test-token";

/// The one document of `manifests/monitoring/<file>`.
fn asset(file: &str) -> Value {
    let path = repo().join("manifests/monitoring").join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{file}: {e}"));
    let mut docs = render::parse_objects(&text);
    assert_eq!(docs.len(), 1, "{file} holds one object");
    docs.remove(0)
}

/// The PrometheusRule's `spec.groups` as a rule file, each rule passed through `edit` first.
fn rule_file(edit: impl Fn(&mut serde_json::Map<String, Value>)) -> String {
    let mut rule = asset("prometheusrule.yaml");
    let groups = rule["spec"]["groups"].as_array_mut().expect("spec.groups");
    for group in groups.iter_mut() {
        let rules = group["rules"].as_array_mut().expect("each group has rules");
        for rule in rules {
            edit(rule.as_object_mut().expect("a rule is a mapping"));
        }
    }
    serde_json::json!({ "groups": groups }).to_string()
}

/// Every alert's name, in file order.
fn alert_names() -> Vec<String> {
    let rule = asset("prometheusrule.yaml");
    rule["spec"]["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|group| group["rules"].as_array().cloned().unwrap_or_default())
        .filter_map(|rule| rule["alert"].as_str().map(str::to_owned))
        .collect()
}

/// Runs `promtool` with `args` in `dir`, panicking with its output when it fails.
fn promtool(promtool: &str, dir: &Path, args: &[&str]) {
    let output = Command::new(promtool)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("run promtool: {e}"));
    assert!(
        output.status.success(),
        "promtool {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn the_kustomization_renders_the_three_objects_and_the_install_leaves_them_out() {
    let kustomization = asset("kustomization.yaml");
    assert_eq!(
        kustomization["resources"],
        serde_json::json!([
            "servicemonitor.yaml",
            "prometheusrule.yaml",
            "../../charts/proxy-operator/dashboards"
        ])
    );
    // Opt-in: `kubectl apply -k manifests/` must work without the Prometheus Operator's CRDs.
    let install = std::fs::read_to_string(repo().join("manifests/kustomization.yaml"))
        .expect("manifests/kustomization.yaml");
    assert!(!install.contains("monitoring"), "{install}");

    let Some(kubectl) = render::tool("kubectl") else {
        return;
    };
    let yaml = render::run(
        Command::new(kubectl)
            .arg("kustomize")
            .arg(repo().join("manifests/monitoring")),
    );
    let mut rendered = render::parse_objects(&yaml);
    rendered.sort_by_key(|object| object["kind"].to_string());
    let dashboard = std::fs::read_to_string(
        repo().join("charts/proxy-operator/dashboards/proxy-operator.json"),
    )
    .expect("the dashboard's JSON");
    let config_map = serde_json::json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "proxy-operator-grafana-dashboard",
            "namespace": "proxy-operator",
            "labels": {"app.kubernetes.io/name": "proxy-operator", "grafana_dashboard": "1"},
        },
        "data": {"proxy-operator.json": dashboard},
    });
    assert_eq!(
        rendered,
        [
            config_map,
            asset("prometheusrule.yaml"),
            asset("servicemonitor.yaml")
        ]
    );
}

#[test]
fn the_servicemonitor_scrapes_the_operator_services_metrics_port() {
    let monitor = asset("servicemonitor.yaml");
    let service = render::parse_objects(
        &std::fs::read_to_string(repo().join("manifests/service.yaml")).expect("service.yaml"),
    )
    .remove(0);
    let namespace = &service["metadata"]["namespace"];
    assert_eq!(&monitor["metadata"]["namespace"], namespace);
    assert_eq!(
        monitor["spec"]["namespaceSelector"]["matchNames"],
        serde_json::json!([namespace])
    );
    let selector = monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .expect("matchLabels");
    assert!(!selector.is_empty());
    for (key, value) in selector {
        assert_eq!(
            &service["metadata"]["labels"][key], value,
            "the Service lacks label {key}"
        );
    }
    let ports: BTreeSet<&str> = service["spec"]["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|port| port["name"].as_str())
        .collect();
    let endpoints = monitor["spec"]["endpoints"].as_array().expect("endpoints");
    assert_eq!(endpoints.len(), 1);
    assert_eq!(endpoints[0]["port"], "metrics");
    assert_eq!(endpoints[0]["path"], "/metrics");
    // The proxies' and pools' own namespace labels are kept (`dashboard` shows it on a real
    // Prometheus).
    assert_eq!(endpoints[0]["honorLabels"], true);
    assert!(ports.contains("metrics"), "{ports:?}");
}

/// `promtool test rules` of every alert, firing and quiet. The static `description`
/// annotations are left out (prose, no templates); the templated `summary` is checked.
#[test]
fn promtool_unit_tests_fire_and_quiet_every_alert() {
    let Some(promtool_bin) = prometheus::tool("promtool") else {
        return;
    };
    let dir = tempfile::tempdir().expect("a temp dir");
    std::fs::write(
        dir.path().join("rules.json"),
        rule_file(|rule| {
            if let Some(Value::Object(annotations)) = rule.get_mut("annotations") {
                annotations.remove("description");
            }
        }),
    )
    .expect("write rules.json");
    let tests = repo().join("tests/data/monitoring/alerts.test.yaml");
    std::fs::copy(&tests, dir.path().join("alerts.test.yaml")).expect("copy the tests");
    promtool(promtool_bin, dir.path(), &["check", "rules", "rules.json"]);
    promtool(
        promtool_bin,
        dir.path(),
        &["test", "rules", "alerts.test.yaml"],
    );

    // Every alert has a case where it fires and one where it does not, and every case names
    // an alert that exists.
    let text = std::fs::read_to_string(&tests).expect("alerts.test.yaml");
    let cases: Value = serde_saphyr::from_str(&text).expect("alerts.test.yaml parses");
    let (mut fires, mut quiet) = (BTreeSet::new(), BTreeSet::new());
    for test in cases["tests"].as_array().expect("tests") {
        for case in test["alert_rule_test"].as_array().expect("alert_rule_test") {
            let name = case["alertname"].as_str().expect("alertname").to_owned();
            let expected = case["exp_alerts"].as_array().map_or(0, Vec::len);
            let cases = if expected == 0 {
                &mut quiet
            } else {
                &mut fires
            };
            cases.insert(name);
        }
    }
    let alerts: BTreeSet<String> = alert_names().into_iter().collect();
    assert_eq!(alerts.len(), 13, "{alerts:?}");
    assert_eq!(fires, alerts, "alerts with a firing case");
    assert_eq!(quiet, alerts, "alerts with a quiet case");
}

/// Whether `alerts` holds `name` in `state`.
fn has_alert(alerts: &[Value], name: &str, state: &str) -> bool {
    alerts
        .iter()
        .any(|alert| alert["labels"]["alertname"] == name && alert["state"] == state)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_fires_no_healthy_proxy_when_the_only_squid_dies_and_resolves_it() {
    const ALERT: &str = "ProxyOperatorNoHealthyProxy";
    const JOB: &str = "proxy-operator";
    let dir = tempfile::tempdir().expect("a temp dir");
    let target = Target::start();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, target.ca_cert_pem()).expect("write ca.pem");
    let mut squid = Squid::start();
    let proxies = [ExternalProxy {
        name: "only".into(),
        labels: vec![("pool".into(), "monitoring".into())],
        host: "127.0.0.1".into(),
        port: squid.port(),
        max_leases: 1,
        probe_url: target.https_url(),
        interval: "500ms",
        cordoned: false,
        socks5: false,
        credentials: None,
        cost: None,
    }];
    let mut operator = Standalone::start(dir.path(), &proxies, &ca, TOKEN, &[]);
    operator.wait_healthy(TOKEN, 1, 2 * DEADLINE).await;
    let scrape_target = operator.metrics_address().to_owned();
    // The real rules with every `for:` cut to 2 s (Prometheus evaluates every second).
    let rules = rule_file(|rule| {
        rule.insert("for".into(), "2s".into());
    });
    let Some(prometheus) = Prometheus::start(&scrape_target, JOB, &rules).await else {
        return;
    };
    let deadline = 3 * DEADLINE;

    // Scraped while healthy, then evaluated on that sample: quiet.
    let seen_at = prometheus
        .eventually("a scrape with the proxy Ready", deadline, || async {
            let samples = prometheus
                .query(r#"proxy_operator_proxies{phase="Ready"}"#)
                .await;
            match samples.as_slice() {
                [(labels, at, value)] if *value == 1.0 && labels["job"] == JOB => Ok(*at),
                other => Err(format!("{other:?}")),
            }
        })
        .await;
    prometheus
        .eventually(
            "an evaluation of the rule after that scrape",
            deadline,
            || async {
                let rule = prometheus.rule(ALERT).await;
                let evaluated = rule["lastEvaluation"]
                    .as_str()
                    .and_then(|at| at.parse::<jiff::Timestamp>().ok())
                    .map_or(0.0, |at| at.as_millisecond() as f64 / 1000.0);
                if evaluated > seen_at + 1.0 && rule["health"] == "ok" {
                    Ok(())
                } else {
                    Err(rule.to_string())
                }
            },
        )
        .await;
    let rule = prometheus.rule(ALERT).await;
    assert_eq!(rule["state"], "inactive", "{rule}");
    assert!(
        !prometheus
            .alerts()
            .await
            .iter()
            .any(|alert| alert["labels"]["alertname"] == ALERT)
    );

    // The only squid dies: its probes fail, the proxy turns Unhealthy, the alert fires.
    squid.kill();
    let firing = prometheus
        .eventually(&format!("{ALERT} firing"), deadline, || async {
            let alerts = prometheus.alerts().await;
            if has_alert(&alerts, ALERT, "firing") {
                Ok(alerts)
            } else {
                Err(Value::from(alerts).to_string())
            }
        })
        .await;
    let alert = firing
        .iter()
        .find(|alert| alert["labels"]["alertname"] == ALERT)
        .expect("the firing alert");
    assert_eq!(alert["labels"]["severity"], "critical", "{alert}");
    assert_eq!(alert["labels"]["job"], JOB, "{alert}");

    // Squid is back: the proxy turns Ready, the alert resolves (leaves the list) while the
    // operator is still scraped.
    squid.restart();
    prometheus
        .eventually(&format!("{ALERT} resolved"), deadline, || async {
            let alerts = prometheus.alerts().await;
            if alerts
                .iter()
                .any(|alert| alert["labels"]["alertname"] == ALERT)
            {
                Err(Value::from(alerts).to_string())
            } else {
                Ok(())
            }
        })
        .await;
    let ready = prometheus
        .query(r#"proxy_operator_proxies{phase="Ready"} == 1 and on (job) up == 1"#)
        .await;
    assert_eq!(ready.len(), 1, "{ready:?}\n{}", operator.log());
}
