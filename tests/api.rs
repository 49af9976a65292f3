//! The discovery and lease API over a real actix server on loopback, with a real SQLite ledger
//! in a temp dir and an injected clock.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use actix_web::dev::ServerHandle;
use proxy_operator::api::{self, ApiState, ApiToken, ProxyListCache};
use proxy_operator::health::{HealthSnapshot, ProxyHealth};
use proxy_operator::inventory::Inventory;
use proxy_operator::ledger::{Clock, Ledger, LedgerConfig, ManualClock};
use proxy_operator::metrics::LeaseMetrics;
use proxy_operator::proxy::{Proxy, ProxySpec};
use reqwest::StatusCode;
use serde_json::{Value, json};

const TOKEN: &str = "t0ken";

struct Harness {
    base: String,
    client: reqwest::Client,
    inventory: Inventory,
    health: HealthSnapshot,
    clock: Arc<ManualClock>,
    handle: ServerHandle,
    _dir: tempfile::TempDir,
}

fn proxy(name: &str, port: i32, labels: &[(&str, &str)], max_leases: i32) -> Proxy {
    let spec: ProxySpec = serde_json::from_value(json!({
        "mode": "External",
        "endpoint": {"host": "127.0.0.1", "port": port},
        "maxLeases": max_leases,
    }))
    .unwrap();
    let mut p = Proxy::new(name, spec);
    p.metadata.namespace = Some("crawl".into());
    p.metadata.uid = Some(format!("uid-{name}"));
    p.metadata.labels = Some(
        labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect::<BTreeMap<_, _>>(),
    );
    p
}

impl Harness {
    async fn start() -> Harness {
        Self::start_with(|_| {}).await
    }

    /// Starts the API; `extra` may add routes (used to install a panicking handler).
    async fn start_with(extra: fn(&mut actix_web::web::ServiceConfig)) -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let clock = Arc::new(ManualClock::new("2026-11-30T12:00:00Z".parse().unwrap()));
        let dyn_clock: Arc<dyn Clock> = clock.clone();
        let config = LedgerConfig {
            max_ttl: Duration::from_secs(600),
            cooldown: Duration::from_secs(300),
            ..LedgerConfig::default()
        };
        let ledger =
            Ledger::open(&dir.path().join("ledger.db"), config, dyn_clock.clone()).unwrap();
        let inventory = Inventory::new();
        let health = HealthSnapshot::new();
        let registry = prometheus::Registry::new();
        let state = ApiState {
            inventory: inventory.clone(),
            health: health.clone(),
            ledger,
            clock: dyn_clock,
            metrics: LeaseMetrics::register(&registry).unwrap(),
            default_ttl: Duration::from_secs(120),
            proxy_list: ProxyListCache::default(),
        };
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let token = ApiToken::new(TOKEN);
        let server = actix_web::HttpServer::new(move || {
            actix_web::App::new()
                .wrap(actix_web::middleware::from_fn(api::observe))
                .configure(extra)
                .configure(api::configure(state.clone(), token.clone()))
        })
        .workers(2)
        .listen(listener)
        .unwrap()
        .disable_signals()
        .run();
        let handle = server.handle();
        tokio::spawn(server);
        Harness {
            base,
            client: reqwest::Client::new(),
            inventory,
            health,
            clock,
            handle,
            _dir: dir,
        }
    }

    /// Loads proxies and marks every one healthy with the given latency (ms).
    fn load(&self, proxies: Vec<(Proxy, Option<u64>)>) {
        for (p, latency) in &proxies {
            self.health.set(
                p.id(),
                ProxyHealth {
                    healthy: Some(latency.is_some()),
                    latency: latency.map(Duration::from_millis),
                    ..Default::default()
                },
            );
        }
        self.inventory.replace(proxies.into_iter().map(|(p, _)| p));
    }

    fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, reqwest::header::HeaderMap, Value) {
        let mut request = self
            .client
            .request(method, self.url(path))
            .bearer_auth(TOKEN);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.unwrap();
        let status = response.status();
        let headers = response.headers().clone();
        let text = response.text().await.unwrap();
        let value = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("{path}: non-JSON body {text:?}: {e}"))
        };
        (status, headers, value)
    }

    async fn get(&self, path: &str) -> (StatusCode, Value) {
        let (s, _, v) = self.send(reqwest::Method::GET, path, None).await;
        (s, v)
    }

    async fn post(&self, path: &str, body: Value) -> (StatusCode, Value) {
        let (s, _, v) = self.send(reqwest::Method::POST, path, Some(body)).await;
        (s, v)
    }

    async fn acquire(&self, body: Value) -> (StatusCode, Value) {
        self.post("/v1/leases", body).await
    }

    async fn stop(self) {
        self.handle.stop(true).await;
    }
}

fn assert_error(value: &Value, code: &str) {
    assert_eq!(value["error"], code, "{value}");
    assert!(
        value["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{value}"
    );
}

#[tokio::test]
async fn healthz_and_readyz_are_unauthenticated() {
    let h = Harness::start().await;
    let r = h.client.get(h.url("/healthz")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let r = h.client.get(h.url("/readyz")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_error(&r.json().await.unwrap(), "not_ready");
    h.load(vec![]);
    let r = h.client.get(h.url("/readyz")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    h.stop().await;
}

#[tokio::test]
async fn every_v1_route_needs_the_token() {
    let h = Harness::start().await;
    h.load(vec![(proxy("a", 3128, &[], 5), Some(10))]);
    let routes = [
        (reqwest::Method::GET, "/v1/proxies"),
        (reqwest::Method::POST, "/v1/leases"),
        (reqwest::Method::GET, "/v1/leases/x"),
        (reqwest::Method::DELETE, "/v1/leases/x"),
        (reqwest::Method::POST, "/v1/leases/x/renew"),
        (reqwest::Method::POST, "/v1/leases/x/report"),
        (reqwest::Method::GET, "/v1/openapi.json"),
        (reqwest::Method::GET, "/v1/nope"),
    ];
    for (method, path) in routes {
        for auth in [None, Some("Bearer wrong"), Some("t0ken")] {
            let mut request = h
                .client
                .request(method.clone(), h.url(path))
                .json(&json!({}));
            if let Some(value) = auth {
                request = request.header("authorization", value);
            }
            let response = request.send().await.unwrap();
            assert_eq!(
                response.status(),
                StatusCode::UNAUTHORIZED,
                "{method} {path} {auth:?}"
            );
            assert!(response.headers().contains_key("www-authenticate"));
            assert_error(&response.json().await.unwrap(), "unauthorized");
        }
    }
    let (status, _) = h.get("/v1/proxies").await;
    assert_eq!(status, StatusCode::OK);
    h.stop().await;
}

#[tokio::test]
async fn list_filters_by_health_and_selector() {
    let h = Harness::start().await;
    h.load(vec![
        (
            proxy("eu-a", 3001, &[("geo", "eu"), ("tier", "a")], 5),
            Some(20),
        ),
        (
            proxy("eu-b", 3002, &[("geo", "eu"), ("tier", "b")], 0),
            Some(10),
        ),
        (
            proxy("us-a", 3003, &[("geo", "us"), ("tier", "a")], 5),
            None,
        ),
    ]);
    let names = |v: &Value| -> Vec<String> {
        v["proxies"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["name"].as_str().unwrap().to_owned())
            .collect()
    };
    let (s, all) = h.get("/v1/proxies").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(all["count"], 3);
    assert_eq!(names(&all), ["eu-a", "eu-b", "us-a"]);
    let first = &all["proxies"][0];
    assert_eq!(first["namespace"], "crawl");
    assert_eq!(first["host"], "127.0.0.1");
    assert_eq!(first["port"], 3001);
    assert_eq!(first["url"], "http://127.0.0.1:3001");
    assert_eq!(first["healthy"], true);
    assert_eq!(first["latencyMs"], 20);
    assert_eq!(first["activeLeases"], 0);
    assert_eq!(first["maxLeases"], 5);
    assert_eq!(first["labels"], json!({"geo": "eu", "tier": "a"}));
    let cases = [
        ("/v1/proxies?healthy=true", vec!["eu-a", "eu-b"]),
        ("/v1/proxies?healthy=false", vec!["us-a"]),
        ("/v1/proxies?selector=geo=eu", vec!["eu-a", "eu-b"]),
        (
            "/v1/proxies?healthy=true&selector=geo=eu,tier=a",
            vec!["eu-a"],
        ),
        ("/v1/proxies?selector=geo=mars", vec![]),
    ];
    for (path, expected) in cases {
        let (s, v) = h.get(path).await;
        assert_eq!(s, StatusCode::OK, "{path}");
        assert_eq!(names(&v), expected, "{path}");
        assert_eq!(v["count"], expected.len(), "{path}");
    }
    for path in ["/v1/proxies?healthy=yes", "/v1/proxies?selector=geo"] {
        let (s, v) = h.get(path).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{path}");
        assert_error(&v, "invalid_query");
    }
    h.stop().await;
}

#[tokio::test]
async fn acquire_picks_least_loaded_then_fastest_and_refuses_when_full() {
    let h = Harness::start().await;
    h.load(vec![
        (proxy("slow", 3001, &[("geo", "eu")], 2), Some(50)),
        (proxy("fast", 3002, &[("geo", "eu")], 2), Some(5)),
        (proxy("never", 3003, &[("geo", "eu")], 0), Some(1)),
        (proxy("sick", 3004, &[("geo", "eu")], 2), None),
    ]);
    let mut order = Vec::new();
    for _ in 0..4 {
        let (s, lease) = h
            .acquire(json!({"selector": {"geo": "eu"}, "ttlSeconds": 60}))
            .await;
        assert_eq!(s, StatusCode::CREATED, "{lease}");
        assert_eq!(lease["ttlSeconds"], 60);
        assert!(lease["leaseID"].as_str().unwrap().len() >= 32);
        assert!(
            lease["expiresAt"]
                .as_str()
                .unwrap()
                .starts_with("2026-11-30T12:01:00")
        );
        order.push(lease["proxy"]["name"].as_str().unwrap().to_owned());
    }
    assert_eq!(order, ["fast", "slow", "fast", "slow"]);
    let (s, headers, body) = h
        .send(
            reqwest::Method::POST,
            "/v1/leases",
            Some(json!({"selector": {"geo": "eu"}})),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_error(&body, "no_match");
    assert_eq!(body["considered"], 4);
    assert_eq!(body["atCapacity"], 3);
    assert_eq!(body["unhealthy"], 1);
    assert_eq!(body["inCooldown"], 0);
    assert_eq!(body["retryAfterSeconds"], 60);
    assert_eq!(headers["retry-after"], "60");

    // Once the leases expire, capacity is back.
    h.clock.advance(Duration::from_secs(61));
    let (s, _) = h.acquire(json!({"selector": {"geo": "eu"}})).await;
    assert_eq!(s, StatusCode::CREATED);
    h.stop().await;
}

#[tokio::test]
async fn ttl_is_defaulted_and_capped() {
    let h = Harness::start().await;
    h.load(vec![(proxy("a", 3001, &[], 5), Some(5))]);
    let (_, lease) = h.acquire(json!({})).await;
    assert_eq!(lease["ttlSeconds"], 120);
    let (_, lease) = h.acquire(json!({"ttlSeconds": 86400})).await;
    assert_eq!(lease["ttlSeconds"], 600);
    let (s, body) = h.acquire(json!({"ttlSeconds": 0})).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(body["message"].as_str().unwrap().contains("ttlSeconds"));
    h.stop().await;
}

#[tokio::test]
async fn lease_lifecycle_get_renew_report_release() {
    let h = Harness::start().await;
    h.load(vec![
        (proxy("a", 3001, &[], 5), Some(5)),
        (proxy("b", 3002, &[], 5), Some(50)),
    ]);
    let (_, lease) = h
        .acquire(json!({"target": "Example.COM", "ttlSeconds": 100}))
        .await;
    let id = lease["leaseID"].as_str().unwrap().to_owned();
    assert_eq!(lease["target"], "example.com");
    assert_eq!(lease["proxy"]["name"], "a");

    let (s, got) = h.get(&format!("/v1/leases/{id}")).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(got["state"], "active");
    assert_eq!(got["leaseID"], id.as_str());

    h.clock.advance(Duration::from_secs(50));
    let (s, renewed) = h
        .post(
            &format!("/v1/leases/{id}/renew"),
            json!({"ttlSeconds": 100}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{renewed}");
    assert!(
        renewed["expiresAt"]
            .as_str()
            .unwrap()
            .starts_with("2026-11-30T12:02:30"),
        "{renewed}"
    );

    // A rate_limited report puts (a, example.com) into cooldown: the next lease for that
    // target goes to b, while other targets still get a.
    let (s, v) = h
        .post(
            &format!("/v1/leases/{id}/report"),
            json!({"result": "rate_limited"}),
        )
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    let (_, next) = h.acquire(json!({"target": "example.com"})).await;
    assert_eq!(next["proxy"]["name"], "b");
    let (_, other) = h.acquire(json!({"target": "other.org"})).await;
    assert_eq!(other["proxy"]["name"], "a");

    for _ in 0..2 {
        let (s, _, body) = h
            .send(reqwest::Method::DELETE, &format!("/v1/leases/{id}"), None)
            .await;
        assert_eq!(s, StatusCode::NO_CONTENT);
        assert_eq!(body, Value::Null);
    }
    let (s, _, _) = h
        .send(reqwest::Method::DELETE, "/v1/leases/never-issued", None)
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, got) = h.get(&format!("/v1/leases/{id}")).await;
    assert_eq!(got["state"], "released", "{got}");
    assert_eq!(s, StatusCode::OK);
    let (s, v) = h.post(&format!("/v1/leases/{id}/renew"), json!({})).await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_error(&v, "lease_not_active");
    // Reports on a released (retained) lease still land.
    let (s, _) = h
        .post(&format!("/v1/leases/{id}/report"), json!({"result": "ok"}))
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    h.stop().await;
}

#[tokio::test]
async fn lease_errors() {
    let h = Harness::start().await;
    h.load(vec![(proxy("a", 3001, &[], 5), Some(5))]);
    let (_, lease) = h.acquire(json!({})).await;
    let id = lease["leaseID"].as_str().unwrap().to_owned();
    let cases = [
        (
            format!("/v1/leases/{id}/report"),
            json!({"result": "meh"}),
            StatusCode::BAD_REQUEST,
            "unknown_result",
        ),
        (
            "/v1/leases/nope/report".to_owned(),
            json!({"result": "ok"}),
            StatusCode::NOT_FOUND,
            "unknown_lease",
        ),
        (
            "/v1/leases/nope/renew".to_owned(),
            json!({"ttlSeconds": 5}),
            StatusCode::NOT_FOUND,
            "unknown_lease",
        ),
        (
            "/v1/leases".to_owned(),
            json!({"ttlSeconds": "long"}),
            StatusCode::BAD_REQUEST,
            "invalid_body",
        ),
        (
            "/v1/leases".to_owned(),
            json!({"selector": "geo=eu"}),
            StatusCode::BAD_REQUEST,
            "invalid_body",
        ),
        (
            "/v1/leases".to_owned(),
            json!({"ttl": 5}),
            StatusCode::BAD_REQUEST,
            "invalid_body",
        ),
        (
            "/v1/leases".to_owned(),
            json!({"target": " "}),
            StatusCode::BAD_REQUEST,
            "invalid_body",
        ),
    ];
    for (path, body, status, code) in cases {
        let (s, v) = h.post(&path, body.clone()).await;
        assert_eq!(s, status, "{path} {body}: {v}");
        assert_error(&v, code);
    }
    let (s, v) = h.get("/v1/leases/nope").await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_error(&v, "unknown_lease");
    let (_, v) = h.post("/v1/leases", json!({"ttlSeconds": "long"})).await;
    assert!(
        v["message"].as_str().unwrap().contains("`ttlSeconds`"),
        "{v}"
    );
    h.stop().await;
}

#[tokio::test]
async fn framework_errors_are_json_too() {
    let h = Harness::start().await;
    h.load(vec![(proxy("a", 3001, &[], 5), Some(5))]);
    let raw = |method: reqwest::Method, path: &str| {
        h.client.request(method, h.url(path)).bearer_auth(TOKEN)
    };
    let cases: Vec<(reqwest::RequestBuilder, StatusCode, &str)> = vec![
        (
            raw(reqwest::Method::POST, "/v1/leases")
                .header("content-type", "application/json")
                .body("{\"selector\":"),
            StatusCode::BAD_REQUEST,
            "invalid_body",
        ),
        (
            raw(reqwest::Method::POST, "/v1/leases")
                .header("content-type", "application/json")
                .body(""),
            StatusCode::BAD_REQUEST,
            "invalid_body",
        ),
        (
            raw(reqwest::Method::POST, "/v1/leases")
                .header("content-type", "text/plain")
                .body("{}"),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        ),
        (
            raw(reqwest::Method::POST, "/v1/leases")
                .header("content-type", "application/json")
                .body(format!("{{\"target\":\"{}\"}}", "x".repeat(70 * 1024))),
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
        ),
        (
            raw(reqwest::Method::GET, "/v1/nope"),
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            raw(reqwest::Method::GET, "/nope"),
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            raw(reqwest::Method::GET, "/v1/leases"),
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
        ),
        (
            raw(reqwest::Method::PUT, "/v1/leases/x"),
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
        ),
    ];
    for (request, status, code) in cases {
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), status, "{code}");
        assert!(
            response.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("application/json")
        );
        assert_error(&response.json().await.unwrap(), code);
    }
    // curl's -d default content type is accepted and parsed as JSON.
    let response = raw(reqwest::Method::POST, "/v1/leases")
        .header("content-type", "application/x-www-form-urlencoded")
        .body("{\"ttlSeconds\":30}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    h.stop().await;
}

fn boom(cfg: &mut actix_web::web::ServiceConfig) {
    cfg.route(
        "/boom",
        actix_web::web::get().to(|| async {
            let v: Vec<u8> = Vec::new();
            #[allow(clippy::indexing_slicing)]
            let _ = v[1];
            actix_web::HttpResponse::Ok().finish()
        }),
    );
}

#[tokio::test]
async fn a_panicking_handler_answers_500_and_the_server_keeps_serving() {
    let h = Harness::start_with(boom).await;
    for _ in 0..3 {
        let response = h.client.get(h.url("/boom")).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_error(&response.json().await.unwrap(), "internal");
        let response = h.client.get(h.url("/healthz")).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_acquires_never_exceed_capacity() {
    let h = Arc::new(Harness::start().await);
    h.load(
        (0..5)
            .map(|i| {
                (
                    proxy(&format!("p{i}"), 3000 + i, &[("pool", "x")], 3),
                    Some(10 + i as u64),
                )
            })
            .collect(),
    );
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let h = h.clone();
        tasks.push(tokio::spawn(async move {
            let mut granted = Vec::new();
            for _ in 0..4 {
                let (s, v) = h
                    .acquire(json!({"selector": {"pool": "x"}, "ttlSeconds": 300}))
                    .await;
                match s {
                    StatusCode::CREATED => {
                        granted.push(v["proxy"]["name"].as_str().unwrap().to_owned())
                    }
                    StatusCode::CONFLICT => {}
                    other => panic!("unexpected {other}: {v}"),
                }
            }
            granted
        }));
    }
    let mut per_proxy: BTreeMap<String, u32> = BTreeMap::new();
    for task in tasks {
        for name in task.await.unwrap() {
            *per_proxy.entry(name).or_default() += 1;
        }
    }
    assert_eq!(per_proxy.values().sum::<u32>(), 15, "{per_proxy:?}");
    assert!(per_proxy.values().all(|&n| n == 3), "{per_proxy:?}");
    let (_, list) = h.get("/v1/proxies").await;
    for p in list["proxies"].as_array().unwrap() {
        assert_eq!(p["activeLeases"], 3);
    }
}

#[tokio::test]
async fn openapi_document_lists_every_route() {
    let h = Harness::start().await;
    let (s, doc) = h.get("/v1/openapi.json").await;
    assert_eq!(s, StatusCode::OK);
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    let paths = doc["paths"].as_object().unwrap();
    let expected = [
        ("/v1/proxies", "get"),
        ("/v1/leases", "post"),
        ("/v1/leases/{id}", "get"),
        ("/v1/leases/{id}", "delete"),
        ("/v1/leases/{id}/renew", "post"),
        ("/v1/leases/{id}/report", "post"),
        ("/v1/openapi.json", "get"),
        ("/healthz", "get"),
        ("/readyz", "get"),
    ];
    for (path, method) in expected {
        assert!(
            paths.get(path).and_then(|p| p.get(method)).is_some(),
            "{method} {path} missing"
        );
    }
    assert_eq!(paths.len(), 8, "{:?}", paths.keys().collect::<Vec<_>>());
    // Every documented route answers something other than 404 on the real server.
    for (path, method) in expected {
        let path = path.replace("{id}", "x");
        let m: reqwest::Method = method.to_uppercase().parse().unwrap();
        let (s, _, _) = h.send(m, &path, Some(json!({"result": "ok"}))).await;
        assert!(
            s != StatusCode::NOT_FOUND || path.contains("/leases/x"),
            "{method} {path}: {s}"
        );
    }
    let schemas = doc["components"]["schemas"].as_object().unwrap();
    for schema in [
        "ErrorBody",
        "NoMatchBody",
        "LeaseView",
        "ProxyList",
        "AcquireRequest",
        "ReportRequest",
        "RenewRequest",
    ] {
        assert!(schemas.contains_key(schema), "{schema}");
    }
    h.stop().await;
}
