//! `GET /v1/proxies` says why an unhealthy proxy is unhealthy (the failure's kind, and the status
//! the probe URL answered): the real health engine probes through real squids to real loopback
//! targets, and the real API serves its snapshot.

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use proxy_operator::api::ApiState;
use proxy_operator::api::LeaseMetrics;
use proxy_operator::fixtures;
use proxy_operator::health::{EngineConfig, HealthEngine, HealthSnapshot, ProbeMetrics};
use proxy_operator::inventory::Inventory;
use proxy_operator::ledger::{Clock, LedgerConfig, SqliteLedger, SqliteOptions, SystemClock};
use proxy_operator::resources::proxy::Proxy;
use proxy_operator::serving::Fleet;
use reqwest::StatusCode;
use serde_json::{Value, json};
use support::{DEADLINE, Squid, Target};
use tokio_util::sync::CancellationToken;

const TOKEN: &str = "api-health-view-token-0123456789";

/// An External proxy through `port` probing `probe_url` with `check` overrides.
fn proxy(name: &str, port: u16, probe_url: &str, check: Value) -> Proxy {
    let mut health_check = json!({"probeURL": probe_url, "interval": "100ms", "timeout": "5s"});
    if let (Some(base), Some(overrides)) = (health_check.as_object_mut(), check.as_object()) {
        base.extend(overrides.clone());
    }
    fixtures::external(name, "127.0.0.1", port)
        .max_leases(2)
        .spec("healthCheck", health_check)
        .build()
}

async fn list(client: &reqwest::Client, base: &str, query: &str) -> Value {
    let response = client
        .get(format!("{base}/v1/proxies{query}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    response.json().await.unwrap()
}

fn entry<'a>(list: &'a Value, name: &str) -> &'a Value {
    list["proxies"]
        .as_array()
        .and_then(|all| all.iter().find(|p| p["name"] == name))
        .unwrap_or_else(|| panic!("{name} not listed: {list}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unhealthy_proxy_lists_its_last_failure_kind_and_time() {
    let alive = Squid::start();
    let denying = Squid::start_with(support::SquidOptions {
        deny_connect: true,
        ..Default::default()
    });
    let mut dead = Squid::start();
    dead.kill();
    let target = Target::start();
    let url = target.https_url();
    let erroring = Target::start();
    erroring.set_status(503);
    let started = jiff::Timestamp::now();

    let inventory = Inventory::new();
    inventory.replace([
        proxy("healthy", alive.port(), &url, json!({})),
        proxy("refused", dead.port(), &url, json!({"failureThreshold": 2})),
        proxy(
            "denied",
            denying.port(),
            &url,
            json!({"failureThreshold": 1}),
        ),
        // Its probe URL answers 503.
        proxy(
            "erroring",
            alive.port(),
            &erroring.http_url(),
            json!({"failureThreshold": 1}),
        ),
        // Fails every probe but never reaches its threshold: unknown, not unhealthy.
        proxy(
            "undecided",
            dead.port(),
            &url,
            json!({"failureThreshold": 1000000}),
        ),
    ]);
    let health = HealthSnapshot::new();
    let registry = prometheus::Registry::new();
    let (transitions, _keep) = tokio::sync::mpsc::channel(64);
    let engine = HealthEngine::new(
        EngineConfig {
            credentials: Default::default(),
            workers: 4,
            tick: Duration::from_millis(20),
            extra_root_certs: vec![target.ca_cert_der()],
        },
        inventory.clone(),
        health.clone(),
        ProbeMetrics::register(&registry).unwrap(),
        transitions,
    );
    let shutdown = CancellationToken::new();
    let engine = tokio::spawn(engine.run(shutdown.clone()));

    let dir = tempfile::tempdir().unwrap();
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let ledger = SqliteLedger::open(
        &dir.path().join("ledger.db"),
        SqliteOptions::default(),
        LedgerConfig::default(),
        clock.clone(),
    )
    .unwrap();
    let state = ApiState::new(
        Fleet::new(
            inventory.clone(),
            health.clone(),
            Arc::new(ledger.clone()),
            clock,
        ),
        LeaseMetrics::register(&registry).unwrap(),
        Duration::from_secs(120),
    );
    let (base, handle) = support::serve_api(state, TOKEN);
    let client = crate::support::http::client();

    // Poll until every proxy has its verdict (and the undecided one has failed a few times).
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let body = loop {
        let body = list(&client, &base, "").await;
        let settled = entry(&body, "healthy")["healthy"] == true
            && entry(&body, "refused").get("lastFailure").is_some()
            && entry(&body, "denied").get("lastFailure").is_some()
            && entry(&body, "erroring").get("lastFailure").is_some();
        if settled {
            break body;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not settled: {body}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(body["count"], 5, "{body}");
    // (name, expected kind, and status; None: no lastFailure field at all)
    let cases = [
        ("healthy", None, None),
        ("refused", Some("connect_refused"), None),
        ("denied", Some("connect_tunnel_refused"), None),
        ("erroring", Some("unexpected_status"), Some(503)),
        ("undecided", None, None),
    ];
    for (name, kind, status) in cases {
        let p = entry(&body, name);
        let Some(kind) = kind else {
            assert!(p.get("lastFailure").is_none(), "{name}: {p}");
            continue;
        };
        assert_eq!(p["healthy"], false, "{name}: {p}");
        let failure = &p["lastFailure"];
        assert_eq!(failure["kind"], kind, "{name}: {p}");
        let at: jiff::Timestamp = failure["at"]
            .as_str()
            .and_then(|at| at.parse().ok())
            .unwrap_or_else(|| panic!("{name}: `at` is not RFC 3339: {p}"));
        assert!(at >= started && at <= jiff::Timestamp::now(), "{name}: {p}");
        assert_eq!(
            failure.get("status").and_then(Value::as_u64),
            status,
            "{name}: {p}"
        );
        let fields = 2 + usize::from(status.is_some());
        assert_eq!(
            failure.as_object().map(|o| o.len()),
            Some(fields),
            "{name}: {p}"
        );
    }
    // The filter sees the same entries.
    let unhealthy = list(&client, &base, "?healthy=false").await;
    assert_eq!(unhealthy["count"], 4, "{unhealthy}");
    assert_eq!(
        entry(&unhealthy, "refused")["lastFailure"]["kind"],
        "connect_refused"
    );

    // The OpenAPI document describes the field and its kinds.
    let response = client
        .get(format!("{base}/v1/openapi.json"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let doc: Value = response.json().await.unwrap();
    let schemas = &doc["components"]["schemas"];
    let view = &schemas["ProxyView"]["properties"]["lastFailure"];
    assert!(!view.is_null(), "{}", schemas["ProxyView"]);
    let failure = &schemas["LastFailureView"];
    assert_eq!(failure["required"], json!(["kind", "at"]), "{failure}");
    assert!(!failure["properties"]["status"].is_null(), "{failure}");
    // The status page's rows say the same.
    let row = &schemas["ProxyRow"]["properties"]["lastFailure"];
    assert!(!row.is_null(), "{}", schemas["ProxyRow"]);
    let kinds: Vec<&str> = schemas["ProbeFailureKind"]["enum"]
        .as_array()
        .map(|all| all.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    assert_eq!(
        kinds,
        [
            "connect_refused",
            "connect_tunnel_refused",
            "timeout",
            "tls",
            "unexpected_status",
            "invalid_config",
            "other"
        ],
        "{}",
        schemas["ProbeFailureKind"]
    );

    handle.stop(true).await;
    shutdown.cancel();
    tokio::time::timeout(DEADLINE, engine)
        .await
        .unwrap()
        .unwrap();
    tokio::task::spawn_blocking(move || ledger.shutdown())
        .await
        .unwrap();
}
