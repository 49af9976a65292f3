//! The Grafana dashboard (`charts/proxy-operator/dashboards/proxy-operator.json`, the one copy
//! the chart and `manifests/monitoring/` both ship): every panel sits in a row, every row
//! belongs to a mode of the binary, and every target expression of every panel returns at
//! least one series from a real Prometheus scraping the real binary in its row's mode, with
//! traffic through the gateway and the lease API so that counters and histograms have data.
//! Grafana's variables are replaced by the values of [`VARIABLES`], the set the dashboard's
//! description names. Prometheus scrapes the binary as the shipped ServiceMonitor says
//! (`honorLabels`, and the target labels its service discovery gives), so the per-proxy and
//! per-pool series keep their own `namespace`, which the panels group by.

use crate::support;

use std::collections::BTreeSet;

use serde_json::{Value, json};
use support::DEADLINE;
use support::curl::curl;
use support::fleet::{GatewayFleet, TOKEN};
use support::pools::pool_object;
use support::postgres::Postgres;
use support::prometheus::{Prometheus, ScrapeJob};
use support::render::{parse_objects, repo};
use support::world::{SLOW, World};

/// The dashboard's JSON, relative to the repository.
const DASHBOARD: &str = "charts/proxy-operator/dashboards/proxy-operator.json";
/// The scrape job of every test's Prometheus, what `$job` is replaced by.
const JOB: &str = "proxy-operator";
/// A second job scraping the same target as the ServiceMonitor would without `honorLabels`.
const UNHONOURED: &str = "unhonoured";
/// The shipped ServiceMonitor.
const SERVICE_MONITOR: &str = "manifests/monitoring/servicemonitor.yaml";
/// Grafana's variables in expressions and what the test puts in their place: a rate window
/// holding many 1 s scrapes, a range, and the job (a regex matcher that matches it).
const VARIABLES: [(&str, &str); 3] = [
    ("$__rate_interval", "1m"),
    ("$__range", "5m"),
    ("$job", JOB),
];

/// How the binary runs for a row's panels to have data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// `proxy-operator standalone` on its SQLite ledger.
    Standalone,
    /// `proxy-operator standalone` on a PostgreSQL ledger.
    Postgres,
    /// `proxy-operator run` against an API server, with a ProxyPool.
    Operator,
}

/// Every row of the dashboard and the mode its panels are checked in.
const ROWS: [(&str, Mode); 7] = [
    ("Fleet", Mode::Standalone),
    ("Gateway", Mode::Standalone),
    ("Ledger", Mode::Standalone),
    ("Ledger (PostgreSQL)", Mode::Postgres),
    ("Pools", Mode::Operator),
    ("Operator", Mode::Operator),
    ("Cost", Mode::Standalone),
];

/// One target expression of one panel, its variables replaced.
#[derive(Debug, Clone)]
struct Query {
    mode: Mode,
    row: String,
    panel: String,
    expr: String,
}

impl Query {
    fn name(&self) -> String {
        format!("{} / {}: {}", self.row, self.panel, self.expr)
    }
}

fn dashboard() -> Value {
    let text = std::fs::read_to_string(repo().join(DASHBOARD))
        .unwrap_or_else(|e| panic!("{DASHBOARD}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{DASHBOARD} is not JSON: {e}"))
}

/// Every target expression of `dashboard` with its row's mode, or what is wrong: a panel in no
/// row, a row of no known mode or without panels, a panel without an expression, or a
/// variable left that [`VARIABLES`] does not replace.
fn queries(dashboard: &Value) -> Result<Vec<Query>, String> {
    let mut queries = Vec::new();
    let mut row: Option<(String, Mode)> = None;
    let mut rows_seen = Vec::new();
    let mut in_row = 0;
    let title = |panel: &Value| panel["title"].as_str().unwrap_or_default().to_owned();
    let top = dashboard["panels"].as_array().ok_or("no panels")?;
    // A collapsed row holds its panels itself; an open one is followed by them.
    let flat = top.iter().flat_map(|panel| {
        std::iter::once(panel).chain(panel["panels"].as_array().into_iter().flatten())
    });
    for panel in flat {
        if panel["type"] == "row" {
            if let Some((title, _)) = &row
                && in_row == 0
            {
                return Err(format!("row {title:?} has no panels"));
            }
            let name = title(panel);
            let mode = ROWS
                .iter()
                .find(|(known, _)| *known == name)
                .map(|(_, mode)| *mode)
                .ok_or_else(|| format!("row {name:?} has no mode"))?;
            rows_seen.push(name.clone());
            row = Some((name, mode));
            in_row = 0;
            continue;
        }
        let name = title(panel);
        let (row_name, mode) = row
            .clone()
            .ok_or_else(|| format!("panel {name:?} sits in no known row"))?;
        in_row += 1;
        let targets = panel["targets"].as_array().cloned().unwrap_or_default();
        if targets.is_empty() {
            return Err(format!("panel {name:?} has no targets"));
        }
        for target in targets {
            let raw = target["expr"].as_str().unwrap_or_default();
            if raw.trim().is_empty() {
                return Err(format!("panel {name:?} has a target without an expression"));
            }
            let expr = VARIABLES
                .iter()
                .fold(raw.to_owned(), |expr, (variable, value)| {
                    expr.replace(variable, value)
                });
            if expr.contains('$') {
                return Err(format!(
                    "panel {name:?}: a variable in {raw:?} is not one of {VARIABLES:?}"
                ));
            }
            queries.push(Query {
                mode,
                row: row_name.clone(),
                panel: name.clone(),
                expr,
            });
        }
    }
    if let Some((title, _)) = &row
        && in_row == 0
    {
        return Err(format!("row {title:?} has no panels"));
    }
    Ok(queries)
}

/// The queries of `mode`'s rows; panics when the dashboard is malformed.
fn queries_of(mode: Mode) -> Vec<Query> {
    let all = queries(&dashboard()).unwrap_or_else(|e| panic!("{DASHBOARD}: {e}"));
    let of_mode: Vec<Query> = all.into_iter().filter(|q| q.mode == mode).collect();
    assert!(!of_mode.is_empty(), "no panel is checked in {mode:?}");
    of_mode
}

/// The queries that return no series now; panics naming one Prometheus refuses.
async fn empty(prometheus: &Prometheus, queries: &[Query]) -> Vec<String> {
    let mut empty = Vec::new();
    for query in queries {
        match prometheus.try_query(&query.expr).await {
            Ok(series) if series.is_empty() => empty.push(query.name()),
            Ok(_) => {}
            Err(e) => panic!("Prometheus refuses {}: {e}", query.name()),
        }
    }
    empty
}

/// Waits until every query of `mode` returns a series, failing with those that still do not.
async fn assert_every_panel_answers(prometheus: &Prometheus, mode: Mode) {
    let queries = queries_of(mode);
    prometheus
        .eventually(
            &format!("every {mode:?} panel's queries to return a series"),
            2 * DEADLINE,
            || async {
                let empty = empty(prometheus, &queries).await;
                if empty.is_empty() {
                    Ok(())
                } else {
                    Err(format!("no series for:\n{}", empty.join("\n")))
                }
            },
        )
        .await;
}

/// The job the Prometheus Operator makes of the shipped ServiceMonitor for `target`, the
/// operator's Service: its endpoint's `honorLabels`, and the labels service discovery gives
/// the target (the Service's namespace and name, the endpoint's port name).
fn as_the_service_monitor_says(target: &str) -> ScrapeJob {
    let text = std::fs::read_to_string(repo().join(SERVICE_MONITOR))
        .unwrap_or_else(|e| panic!("{SERVICE_MONITOR}: {e}"));
    let monitor = parse_objects(&text).remove(0);
    let endpoint = &monitor["spec"]["endpoints"][0];
    let label = |value: &Value| value.as_str().expect("a string").to_owned();
    ScrapeJob {
        name: JOB.to_owned(),
        target: target.to_owned(),
        labels: [
            (
                "namespace",
                label(&monitor["spec"]["namespaceSelector"]["matchNames"][0]),
            ),
            ("service", label(&monitor["metadata"]["name"])),
            ("endpoint", label(&endpoint["port"])),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect(),
        honor_labels: endpoint["honorLabels"].as_bool().unwrap_or(false),
    }
}

/// A Prometheus scraping `target` as the ServiceMonitor says ([`JOB`]) and, as a control, the
/// same without `honorLabels` ([`UNHONOURED`]), with no rules.
async fn prometheus(target: &str) -> Option<Prometheus> {
    let shipped = as_the_service_monitor_says(target);
    let unhonoured = ScrapeJob {
        name: UNHONOURED.to_owned(),
        honor_labels: false,
        ..shipped.clone()
    };
    Prometheus::start_jobs(&[shipped, unhonoured], r#"{"groups": []}"#).await
}

/// Every series of `metric` keeps its own `namespace`, `own`, through the ServiceMonitor's
/// scrape; without `honorLabels` the same series would have the operator's and `own` as
/// `exported_namespace`, so the check cannot pass by accident.
async fn assert_own_namespace_kept(prometheus: &Prometheus, metric: &str, own: &str) {
    let operators = as_the_service_monitor_says("-").labels["namespace"].clone();
    assert_ne!(operators, own, "the check needs two namespaces");
    let namespaces = |job: &'static str| async move {
        let series = prometheus
            .query(&format!("{metric}{{job=\"{job}\"}}"))
            .await;
        let found: BTreeSet<(String, String)> = series
            .iter()
            .map(|(labels, _, _)| {
                let get = |name: &str| labels[name].as_str().unwrap_or_default().to_owned();
                (get("namespace"), get("exported_namespace"))
            })
            .collect();
        found
    };
    let shipped = prometheus
        .eventually(
            &format!("{metric} scraped by both jobs"),
            DEADLINE,
            || async {
                let shipped = namespaces(JOB).await;
                let unhonoured = namespaces(UNHONOURED).await;
                if shipped.is_empty() || unhonoured.is_empty() {
                    return Err(format!("{shipped:?} {unhonoured:?}"));
                }
                assert_eq!(
                    unhonoured,
                    BTreeSet::from([(operators.clone(), own.to_owned())]),
                    "{metric} without honorLabels"
                );
                Ok(shipped)
            },
        )
        .await;
    assert_eq!(
        shipped,
        BTreeSet::from([(own.to_owned(), String::new())]),
        "{metric} through the ServiceMonitor"
    );
}

#[test]
fn every_panel_sits_in_a_row_of_a_mode_and_uses_the_datasource_variable() {
    let dashboard = dashboard();
    let queries = queries(&dashboard).unwrap_or_else(|e| panic!("{DASHBOARD}: {e}"));
    let rows: BTreeSet<&str> = queries.iter().map(|q| q.row.as_str()).collect();
    let known: BTreeSet<&str> = ROWS.iter().map(|(row, _)| *row).collect();
    assert_eq!(rows, known, "rows with panels");
    // Every panel and target on the `datasource` variable, of type prometheus.
    let variables = dashboard["templating"]["list"]
        .as_array()
        .expect("variables");
    let datasource = variables
        .iter()
        .find(|v| v["name"] == "datasource")
        .expect("a datasource variable");
    assert_eq!(datasource["type"], "datasource");
    assert_eq!(datasource["query"], "prometheus");
    let variable = json!({"type": "prometheus", "uid": "${datasource}"});
    let top = dashboard["panels"].as_array().unwrap();
    let mut ids = BTreeSet::new();
    for panel in top.iter().chain(
        top.iter()
            .flat_map(|p| p["panels"].as_array().into_iter().flatten()),
    ) {
        assert!(
            ids.insert(panel["id"].to_string()),
            "id {} twice",
            panel["id"]
        );
        if panel["type"] == "row" {
            continue;
        }
        assert_eq!(panel["datasource"], variable, "{}", panel["title"]);
        for target in panel["targets"].as_array().unwrap() {
            assert_eq!(target["datasource"], variable, "{}", panel["title"]);
        }
    }
    // The variables the test replaces are the ones the description tells users of.
    let description = dashboard["description"].as_str().expect("a description");
    for (variable, _) in VARIABLES {
        assert!(description.contains(variable), "{variable}: {description}");
    }
}

/// The checks of [`queries`] fail on what they look for.
#[test]
fn a_panel_outside_the_rows_or_a_row_of_no_mode_is_refused() {
    let panel = |title: &str, expr: &str| {
        json!({"type": "timeseries", "title": title,
                                                 "targets": [{"expr": expr}]})
    };
    let row = |title: &str| json!({"type": "row", "title": title, "panels": []});
    for (panels, expected) in [
        (
            json!([panel("stray", "up")]),
            r#"panel "stray" sits in no known row"#,
        ),
        (
            json!([row("Fleet"), panel("a", "up"), row("Billing")]),
            r#"row "Billing" has no mode"#,
        ),
        (json!([row("Fleet")]), r#"row "Fleet" has no panels"#),
        (
            json!([row("Fleet"), panel("a", "rate(up[$__interval])")]),
            "is not one of",
        ),
        (
            json!([row("Fleet"), panel("a", " ")]),
            "without an expression",
        ),
    ] {
        let error = queries(&json!({ "panels": panels })).expect_err(expected);
        assert!(error.contains(expected), "{error}");
    }
    // A collapsed row's own panels count as its.
    let collapsed = json!({"panels": [
        {"type": "row", "title": "Pools", "collapsed": true,
         "panels": [panel("members", "up{job=~\"$job\"}")]},
    ]});
    let queries = queries(&collapsed).expect("a collapsed row with a panel");
    assert_eq!(queries[0].mode, Mode::Operator);
    assert_eq!(queries[0].expr, format!("up{{job=~\"{JOB}\"}}"));
}

/// Plain HTTP through the gateway and a lease taken, reported `rate_limited` for a target (a
/// cooldown) and released through the API.
async fn traffic(fleet: &GatewayFleet) {
    let proxy = fleet.proxy_url("dashboard");
    for _ in 0..3 {
        let (code, out, err) = curl(
            DEADLINE,
            &["-sS", "-D", "-", "-x", &proxy, &fleet.site.http("/ip")],
        )
        .await;
        assert_eq!(code, 0, "{err}");
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    }
    let client = crate::support::http::client();
    let api = fleet.operator.api();
    let response = client
        .post(format!("{api}/v1/leases"))
        .bearer_auth(TOKEN)
        .json(
            &json!({"selector": {"pool": "gateway"}, "target": "example.com",
                      "ttlSeconds": 60}),
        )
        .send()
        .await
        .expect("acquire");
    assert_eq!(response.status(), reqwest::StatusCode::CREATED);
    let lease: Value = response.json().await.expect("a lease");
    let id = lease["leaseID"].as_str().expect("a lease ID");
    let reported = client
        .post(format!("{api}/v1/leases/{id}/report"))
        .bearer_auth(TOKEN)
        .json(&json!({"result": "rate_limited", "target": "example.com"}))
        .send()
        .await
        .expect("report");
    assert_eq!(reported.status(), reqwest::StatusCode::NO_CONTENT);
    let released = client
        .delete(format!("{api}/v1/leases/{id}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("release");
    assert_eq!(released.status(), reqwest::StatusCode::NO_CONTENT);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_standalone_panel_answers_from_a_real_prometheus() {
    let dir = tempfile::tempdir().expect("a temp dir");
    // A tenant with a daily byte budget, for the budget's panel.
    let tenants = dir.path().join("tenants.yaml");
    std::fs::write(
        &tenants,
        format!(
            "tenants:\n  - name: team-a\n    tokens: [\"{}\"]\n    quotas: {{bytesPerDay: 1GiB}}\n",
            support::token_digest("dashboard-team-a-token-0123456789")
        ),
    )
    .expect("write the tenants file");
    let fleet = GatewayFleet::start(
        dir.path(),
        2,
        &["--tenants-file", tenants.to_str().expect("a UTF-8 path")],
    )
    .await;
    let Some(prometheus) = prometheus(fleet.operator.metrics_address()).await else {
        return;
    };
    traffic(&fleet).await;
    assert_every_panel_answers(&prometheus, Mode::Standalone).await;
    // A proxy's series keeps the proxy's namespace; a fleet series takes the operator's.
    assert_own_namespace_kept(&prometheus, "proxy_operator_proxy_up", "default").await;
    let operators = as_the_service_monitor_says("-").labels["namespace"].clone();
    let fleet_series = prometheus
        .query(&format!("proxy_operator_proxies{{job=\"{JOB}\"}}"))
        .await;
    assert!(
        !fleet_series.is_empty()
            && fleet_series
                .iter()
                .all(|(labels, _, _)| labels["namespace"] == operators.as_str()),
        "{fleet_series:?}"
    );
    // Capacity is the two Ready proxies' maxLeases (16 each).
    let capacity = prometheus.query("max(proxy_operator_lease_capacity)").await;
    assert_eq!(capacity.first().map(|s| s.2), Some(32.0), "{capacity:?}");
    // The check can fail: a series the binary does not export is reported by its panel.
    let missing = Query {
        mode: Mode::Standalone,
        row: "Fleet".into(),
        panel: "missing".into(),
        expr: "proxy_operator_no_such_series".into(),
    };
    assert_eq!(
        empty(&prometheus, &[missing]).await,
        ["Fleet / missing: proxy_operator_no_such_series"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_postgresql_panel_answers_from_a_real_prometheus() {
    let Some(postgres) = Postgres::shared() else {
        return;
    };
    let database = postgres.database();
    let url = database.url();
    let dir = tempfile::tempdir().expect("a temp dir");
    let fleet = GatewayFleet::start(dir.path(), 1, &["--ledger", &url]).await;
    let Some(prometheus) = prometheus(fleet.operator.metrics_address()).await else {
        return;
    };
    traffic(&fleet).await;
    assert_every_panel_answers(&prometheus, Mode::Postgres).await;
    let up = prometheus.query("proxy_operator_ledger_database_up").await;
    assert_eq!(up.first().map(|s| s.2), Some(1.0), "{up:?}");
    // The Ledger row's batch panels read a PostgreSQL ledger's batches as well.
    let carried = prometheus
        .query("proxy_operator_ledger_batched_writes_total")
        .await;
    assert!(carried.first().is_some_and(|s| s.2 > 0.0), "{carried:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_pool_and_operator_panel_answers_from_a_real_prometheus() {
    let Some(world) = World::new("dashboard").await else {
        return;
    };
    let operator = world.operator(&[]).await;
    // Created at the default one replica under a floor of two: the autoscaler scales it up,
    // a scale event.
    world
        .raw_pools()
        .create(
            &Default::default(),
            &pool_object(
                "dash",
                json!({"template": world.pool_template("dash", 2),
                       "autoscaling": {"minReplicas": 2, "maxReplicas": 3}}),
            ),
        )
        .await
        .expect("create the pool");
    let Some(prometheus) = prometheus(&operator.metrics_address()).await else {
        return;
    };
    world.wait_pool_settled("dash", 2, SLOW).await;
    assert_every_panel_answers(&prometheus, Mode::Operator).await;
    assert_own_namespace_kept(
        &prometheus,
        "proxy_operator_pool_desired_replicas",
        &world.ns,
    )
    .await;
    let up = prometheus
        .query(r#"proxy_operator_pool_scale_events_total{direction="up"}"#)
        .await;
    assert_eq!(up.first().map(|s| s.2), Some(1.0), "{up:?}");
}
