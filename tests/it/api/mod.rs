//! The discovery and lease API over a real actix server on loopback, with a real lease ledger
//! (an SQLite file in a temp dir, or a database of its own on the test binary's PostgreSQL
//! server) and an injected clock. Each behaviour test runs on both backends
//! (`sqlite::<name>`, `postgres::<name>`); the tests of the SQLite writer's queue are
//! SQLite-only.

mod health_view;
mod python_client;
mod schemathesis;

use std::collections::BTreeMap;
use std::convert::identity;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use actix_web::dev::ServerHandle;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use proxy_operator::api::LeaseMetrics;
use proxy_operator::api::{self, ApiState};
use proxy_operator::fixtures;
use proxy_operator::health::{HealthSnapshot, ProxyHealth};
use proxy_operator::inventory::Inventory;
use proxy_operator::ledger::{
    Clock, Ledger, LedgerConfig, ManualClock, PostgresLedger, PostgresOptions, SqliteLedger,
    SqliteOptions,
};
use proxy_operator::resources::proxy::{
    CONDITION_PROVISIONED, Condition, ConditionStatus, Proxy, ProxyStatus, REASON_DRAINING,
};
use proxy_operator::serving::Fleet;
use proxy_operator::serving::outcomes::Outcomes;
use proxy_operator::serving::tokens::{ApiToken, TokenSet};
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::support::FileLock;
use crate::support::ledger::Backend;
use crate::support::postgres::{Database, Postgres};

const TOKEN: &str = "api-test-token-0123456789";

struct Harness {
    base: String,
    client: reqwest::Client,
    inventory: Inventory,
    health: HealthSnapshot,
    clock: Arc<ManualClock>,
    ledger: Arc<dyn Ledger>,
    /// The same ledger when it is an SQLite one, whose writer a restart stops.
    sqlite: Option<SqliteLedger>,
    store: Store,
    /// The ledger settings it was opened with, which a restart opens it with again.
    config: LedgerConfig,
    handle: ServerHandle,
    token: ApiToken,
    /// What the report routes counted.
    outcomes: Outcomes,
}

/// Where the ledger keeps its leases: what a restart keeps and opens again.
enum Store {
    /// The file `ledger.db` in a temp dir.
    Sqlite(tempfile::TempDir),
    /// A database of its own on the shared PostgreSQL server.
    Postgres(Database),
}

impl Store {
    /// A new, empty store on `backend`; `None` when PostgreSQL cannot run here (not installed,
    /// outside CI).
    fn new(backend: Backend) -> Option<Store> {
        Some(match backend {
            Backend::Sqlite => Store::Sqlite(tempfile::tempdir().unwrap()),
            Backend::Postgres => Store::Postgres(Postgres::shared()?.database()),
        })
    }

    /// Opens the ledger it keeps, with `config` and `clock`; the SQLite ledger also as itself.
    async fn open(
        &self,
        config: LedgerConfig,
        clock: Arc<dyn Clock>,
    ) -> (Arc<dyn Ledger>, Option<SqliteLedger>) {
        match self {
            Store::Sqlite(dir) => {
                let ledger = SqliteLedger::open(
                    &dir.path().join("ledger.db"),
                    SqliteOptions::default(),
                    config,
                    clock,
                )
                .unwrap();
                (Arc::new(ledger.clone()), Some(ledger))
            }
            Store::Postgres(database) => {
                let options = PostgresOptions {
                    password: None,
                    pool_size: 8,
                };
                let ledger = PostgresLedger::open(&database.url(), options, config, clock)
                    .await
                    .unwrap();
                (Arc::new(ledger), None)
            }
        }
    }
}

fn proxy(name: &str, port: i32, labels: &[(&str, &str)], max_leases: i32) -> Proxy {
    let port = u16::try_from(port).expect("a port");
    fixtures::external(name, "127.0.0.1", port)
        .labels(labels)
        .max_leases(max_leases)
        .build()
}

impl Harness {
    /// Starts the API over a new ledger on `backend`; `None` when that backend cannot run
    /// here (PostgreSQL not installed, outside CI).
    async fn start(backend: Backend) -> Option<Harness> {
        Self::start_with(backend, |_| {}).await
    }

    /// Starts the API; `extra` may add routes (used to install a panicking handler).
    async fn start_with(
        backend: Backend,
        extra: fn(&mut actix_web::web::ServiceConfig),
    ) -> Option<Harness> {
        Self::start_on(backend, LedgerConfig::default(), extra).await
    }

    /// Starts the API with ledger settings on top of the harness's TTL and cooldown.
    async fn start_with_ledger(backend: Backend, config: LedgerConfig) -> Option<Harness> {
        Self::start_on(backend, config, |_| {}).await
    }

    async fn start_on(
        backend: Backend,
        config: LedgerConfig,
        extra: fn(&mut actix_web::web::ServiceConfig),
    ) -> Option<Harness> {
        let store = Store::new(backend)?;
        let clock = Arc::new(ManualClock::new("2026-11-30T12:00:00Z".parse().unwrap()));
        let config = LedgerConfig {
            max_ttl: Duration::from_secs(600),
            cooldown: Duration::from_secs(300),
            ..config
        };
        Some(
            Self::serve(
                store,
                clock,
                Inventory::new(),
                HealthSnapshot::new(),
                config,
                extra,
            )
            .await,
        )
    }

    /// Stops the server and the ledger (on SQLite, its writer), then opens the same ledger
    /// file or database again and serves it with the same inventory, health, clock and ledger
    /// settings (what a restart keeps).
    async fn restart(self) -> Harness {
        let Harness {
            inventory,
            health,
            clock,
            ledger,
            sqlite,
            store,
            config,
            handle,
            ..
        } = self;
        handle.stop(true).await;
        drop(ledger);
        if let Some(sqlite) = sqlite {
            tokio::task::spawn_blocking(move || sqlite.shutdown())
                .await
                .unwrap();
        }
        Self::serve(store, clock, inventory, health, config, |_| {}).await
    }

    async fn serve(
        store: Store,
        clock: Arc<ManualClock>,
        inventory: Inventory,
        health: HealthSnapshot,
        config: LedgerConfig,
        extra: fn(&mut actix_web::web::ServiceConfig),
    ) -> Harness {
        let dyn_clock: Arc<dyn Clock> = clock.clone();
        let (ledger, sqlite) = store.open(config.clone(), dyn_clock.clone()).await;
        let registry = prometheus::Registry::new();
        let outcomes = Outcomes::new(dyn_clock.clone());
        let state = ApiState::new(
            Fleet {
                outcomes: outcomes.clone(),
                ..Fleet::new(inventory.clone(), health.clone(), ledger.clone(), dyn_clock)
            },
            LeaseMetrics::register(&registry).unwrap(),
            Duration::from_secs(120),
        );
        let listener = crate::support::loopback_listener();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let token = ApiToken::new(TokenSet::single(TOKEN.as_bytes(), "TOKEN").unwrap());
        let served = token.clone();
        let server = actix_web::HttpServer::new(move || {
            actix_web::App::new()
                .wrap(actix_web::middleware::from_fn(api::observe))
                .configure(extra)
                .configure(api::configure(state.clone(), served.clone()))
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
            client: crate::support::http::client(),
            inventory,
            health,
            clock,
            ledger,
            sqlite,
            store,
            config,
            handle,
            token,
            outcomes,
        }
    }

    /// The SQLite ledger's file, for the tests of what only it has.
    fn sqlite_file(&self) -> PathBuf {
        match &self.store {
            Store::Sqlite(dir) => dir.path().join("ledger.db"),
            Store::Postgres(_) => panic!("an SQLite-only test runs on the SQLite backend"),
        }
    }

    /// The single value `sql` selects, as text, read behind the ledger's back on a connection
    /// of its own (so only what the ledger committed): with rusqlite from the SQLite file, with
    /// psql from the PostgreSQL database. Both schemas have the same tables and columns, with
    /// times as BIGINT milliseconds.
    fn value(&self, sql: &str) -> String {
        match &self.store {
            Store::Sqlite(dir) => {
                use rusqlite::types::Value as Sql;
                let value: Sql = rusqlite::Connection::open(dir.path().join("ledger.db"))
                    .unwrap()
                    .query_row(sql, [], |row| row.get(0))
                    .unwrap_or_else(|e| panic!("{sql}: {e}"));
                match value {
                    Sql::Null => String::new(),
                    Sql::Integer(n) => n.to_string(),
                    Sql::Real(x) => x.to_string(),
                    Sql::Text(text) => text,
                    Sql::Blob(_) => panic!("{sql}: a blob"),
                }
            }
            Store::Postgres(database) => database.psql(sql),
        }
    }

    /// The number `sql` selects (see [`Harness::value`]).
    fn count(&self, sql: &str) -> i64 {
        let value = self.value(sql);
        value
            .parse()
            .unwrap_or_else(|_| panic!("{sql}: not a number: {value:?}"))
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

async fn healthz_and_readyz_are_unauthenticated(backend: Backend) {
    let Some(h) = Harness::start(backend).await else {
        return;
    };
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

async fn every_v1_route_needs_the_token(backend: Backend) {
    let Some(h) = Harness::start(backend).await else {
        return;
    };
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
        let short = format!("Bearer {}", &TOKEN[..TOKEN.len() - 1]);
        for auth in [
            None,
            Some("Bearer wrong"),
            Some(TOKEN),
            Some(short.as_str()),
        ] {
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

/// The status of `GET /v1/proxies` with `Authorization: Bearer <token>`.
async fn list_status(h: &Harness, token: &str) -> StatusCode {
    h.client
        .get(h.url("/v1/proxies"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .status()
}

async fn several_tokens_are_valid_and_a_new_set_applies_to_the_running_server(backend: Backend) {
    const NEXT: &str = "next-token-0123456789abcdef";
    let Some(h) = Harness::start(backend).await else {
        return;
    };
    h.load(vec![]);
    assert_eq!(list_status(&h, TOKEN).await, StatusCode::OK);
    assert_eq!(list_status(&h, NEXT).await, StatusCode::UNAUTHORIZED);

    // Rotation: both valid while clients move over...
    let both = format!("{TOKEN}\n{NEXT}\n");
    h.token.replace(
        TokenSet::from_file_content(both.as_bytes(), std::path::Path::new("tokens")).unwrap(),
    );
    assert_eq!(list_status(&h, TOKEN).await, StatusCode::OK);
    assert_eq!(list_status(&h, NEXT).await, StatusCode::OK);

    // ...then the old one is gone.
    h.token
        .replace(TokenSet::single(NEXT.as_bytes(), "NEXT").unwrap());
    assert_eq!(list_status(&h, TOKEN).await, StatusCode::UNAUTHORIZED);
    assert_eq!(list_status(&h, NEXT).await, StatusCode::OK);
    h.stop().await;
}

async fn an_empty_body_on_acquire_and_renew_means_every_default(backend: Backend) {
    let Some(h) = Harness::start(backend).await else {
        return;
    };
    h.load(vec![(proxy("a", 3001, &[], 5), Some(5))]);
    let post = |path: &str, content_type: Option<&str>| {
        let mut request = h.client.post(h.url(path)).bearer_auth(TOKEN);
        if let Some(content_type) = content_type {
            request = request.header("content-type", content_type);
        }
        request.send()
    };
    let mut ids = Vec::new();
    for content_type in [None, Some("application/json")] {
        let response = post("/v1/leases", content_type).await.unwrap();
        assert_eq!(response.status(), StatusCode::CREATED, "{content_type:?}");
        let lease: Value = response.json().await.unwrap();
        assert_eq!(lease["ttlSeconds"], 120, "{content_type:?}");
        ids.push(lease["leaseID"].as_str().unwrap().to_owned());
    }
    for (id, content_type) in ids.iter().zip([None, Some("application/json")]) {
        h.clock.advance(Duration::from_secs(30));
        let response = post(&format!("/v1/leases/{id}/renew"), content_type)
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK, "{content_type:?}");
        let lease: Value = response.json().await.unwrap();
        assert_eq!(lease["ttlSeconds"], 120);
        let (_, now) = h.get(&format!("/v1/leases/{id}")).await;
        assert_eq!(now["expiresAt"], lease["expiresAt"]);
    }
    // The served document says so, so clients (and schemathesis) may send none.
    let (_, doc) = h.get("/v1/openapi.json").await;
    for path in ["/v1/leases", "/v1/leases/{id}/renew"] {
        let body = &doc["paths"][path]["post"]["requestBody"];
        assert!(body.is_object(), "{path}: {body}");
        assert_ne!(body["required"], true, "{path}: {body}");
    }
    assert_eq!(
        doc["paths"]["/v1/leases/{id}/report"]["post"]["requestBody"]["required"],
        true
    );
    // A report has a required field: an empty body is still a 400 naming it.
    let response = post(&format!("/v1/leases/{}/report", ids[0]), None)
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    let body: Value = response.json().await.unwrap();
    assert_error(&body, "invalid_body");
    // The document gives these bodies the schema "null or the object": `null` is `{}` too.
    let post_null = |path: String| {
        h.client
            .post(h.url(&path))
            .bearer_auth(TOKEN)
            .header("content-type", "application/json")
            .body("null")
            .send()
    };
    let response = post_null("/v1/leases".into()).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let lease: Value = response.json().await.unwrap();
    assert_eq!(lease["ttlSeconds"], 120);
    let renew = format!("/v1/leases/{}/renew", lease["leaseID"].as_str().unwrap());
    let response = post_null(renew).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    for path in ["/v1/leases", "/v1/leases/{id}/renew"] {
        let schema =
            &doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"];
        assert!(
            schema.to_string().contains(r#"{"type":"null"}"#),
            "{path}: {schema}"
        );
    }
    // A body that is there must still be JSON; whitespace alone is not "no body".
    for body in ["nope", " "] {
        let response = h
            .client
            .post(h.url("/v1/leases"))
            .bearer_auth(TOKEN)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{body:?}");
        let error: Value = response.json().await.unwrap();
        assert_eq!(error["error"], "invalid_body", "{body:?}");
    }
    h.stop().await;
}

async fn list_filters_by_health_and_selector(backend: Backend) {
    let Some(h) = Harness::start(backend).await else {
        return;
    };
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
        // Every pair must match: a key named twice with one value is that pair, with two
        // values nothing matches.
        ("/v1/proxies?selector=geo=eu,geo=eu", vec!["eu-a", "eu-b"]),
        ("/v1/proxies?selector=geo=eu,geo=us", vec![]),
        (
            "/v1/proxies?healthy=&selector=",
            vec!["eu-a", "eu-b", "us-a"],
        ),
    ];
    for (path, expected) in cases {
        let (s, v) = h.get(path).await;
        assert_eq!(s, StatusCode::OK, "{path}");
        assert_eq!(names(&v), expected, "{path}");
        assert_eq!(v["count"], expected.len(), "{path}");
    }
    for path in [
        "/v1/proxies?healthy=yes",
        "/v1/proxies?selector=geo",
        "/v1/proxies?selector=geo=eu,%20=x",
    ] {
        let (s, v) = h.get(path).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{path}");
        assert_error(&v, "invalid_query");
    }
    h.stop().await;
}

async fn acquire_picks_least_loaded_then_fastest_and_refuses_when_full(backend: Backend) {
    let Some(h) = Harness::start(backend).await else {
        return;
    };
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

async fn ttl_is_defaulted_and_capped(backend: Backend) {
    let Some(h) = Harness::start(backend).await else {
        return;
    };
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

async fn lease_lifecycle_get_renew_report_release(backend: Backend) {
    let Some(h) = Harness::start(backend).await else {
        return;
    };
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

    // Every accepted report counted for the lease's proxy, and for the target it names (the
    // lease's own when it names none); a refused one counts nowhere.
    let (s, v) = h
        .post(
            &format!("/v1/leases/{id}/report"),
            json!({"result": "blocked", "target": "Other.ORG"}),
        )
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    let (s, _) = h
        .post("/v1/leases/never-issued/report", json!({"result": "error"}))
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let proxies: Vec<(String, u64, u64, u64, u64)> = h
        .outcomes
        .proxies()
        .into_iter()
        .map(|(id, c)| {
            let reports = (c.reports_ok, c.reports_rate_limited, c.reports_blocked);
            (id.name, reports.0, reports.1, reports.2, c.total())
        })
        .collect();
    assert_eq!(proxies, [("a".to_owned(), 1, 1, 1, 3)]);
    let targets: Vec<(String, u64)> = h
        .outcomes
        .targets()
        .into_iter()
        .map(|(target, c)| (target, c.total()))
        .collect();
    assert_eq!(
        targets,
        [("example.com".to_owned(), 2), ("other.org".to_owned(), 1)]
    );
    h.stop().await;
}

fn cordoned(mut p: Proxy) -> Proxy {
    p.spec.cordoned = true;
    p
}

/// `(name, <first>, <second>, activeLeases)` of every listed proxy, for two of its boolean
/// fields.
type Listed = Vec<(String, bool, bool, u64)>;

/// [`Listed`]: the proxies of `list` with the boolean fields `first` and `second`.
fn listed_flags(list: &Value, first: &str, second: &str) -> Listed {
    list["proxies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap().to_owned(),
                p[first].as_bool().expect("the field is always listed"),
                p[second].as_bool().expect("the field is always listed"),
                p["activeLeases"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// `(name, cordoned, healthy, activeLeases)` of every listed proxy.
fn cordon_view(list: &Value) -> Listed {
    listed_flags(list, "cordoned", "healthy")
}

/// Loads the fast proxy `a` (5 ms) and the slow `b` (50 ms), both healthy in `geo: eu`, each
/// as its `make_*` function leaves it (`identity`: as it is).
fn load_a_and_b(h: &Harness, make_a: fn(Proxy) -> Proxy, make_b: fn(Proxy) -> Proxy) {
    let eu = [("geo", "eu")];
    h.load(vec![
        (make_a(proxy("a", 3001, &eu, 5)), Some(5)),
        (make_b(proxy("b", 3002, &eu, 5)), Some(50)),
    ]);
}

/// A lease granted for a request with a request ID, which a retried acquire replays.
struct Granted {
    request: Value,
    lease: Value,
    id: String,
}

/// Asserts `view` shows the proxies of `list` as `expected`.
fn assert_listed(list: &Value, view: fn(&Value) -> Listed, expected: [(&str, bool, bool, u64); 2]) {
    assert_eq!(
        view(list),
        expected.map(|(n, x, y, c)| (n.to_owned(), x, y, c))
    );
}

/// Loads `a` and `b` as they are (`view` shows them as `listed`, not leased yet) and takes the
/// first lease on `geo: eu`, asked for with the request ID `request_id`: it goes to the fast
/// proxy `a`.
async fn lease_on_fast_a(
    h: &Harness,
    request_id: &str,
    view: fn(&Value) -> Listed,
    listed: [(&str, bool, bool, u64); 2],
) -> Granted {
    load_a_and_b(h, identity, identity);
    let (_, list) = h.get("/v1/proxies").await;
    assert_listed(&list, view, listed);
    let request = json!({"selector": {"geo": "eu"}, "ttlSeconds": 100, "requestID": request_id});
    let (s, lease) = h.acquire(request.clone()).await;
    assert_eq!(s, StatusCode::CREATED, "{lease}");
    assert_eq!(lease["proxy"]["name"], "a");
    let id = lease["leaseID"].as_str().unwrap().to_owned();
    Granted { request, lease, id }
}

/// Makes `a`, which holds the lease `granted`, unleasable with `make_unleasable` (the inventory
/// changes, as the watch or the file would make it); then `view` shows the healthy proxies as
/// `listed`, every new lease goes to `b` though `a` is faster, the granted request replays its
/// lease (still active on `a`), and 50 s later a renewal of it for 100 s answers
/// `renew_status`. Returns the renewal's answer.
async fn make_a_unleasable(
    h: &Harness,
    granted: &Granted,
    make_unleasable: fn(Proxy) -> Proxy,
    view: fn(&Value) -> Listed,
    listed: [(&str, bool, bool, u64); 2],
    renew_status: StatusCode,
) -> Value {
    load_a_and_b(h, make_unleasable, identity);
    let (_, list) = h.get("/v1/proxies?healthy=true").await;
    assert_listed(&list, view, listed);
    for _ in 0..3 {
        let (s, lease) = h.acquire(json!({"selector": {"geo": "eu"}})).await;
        assert_eq!(s, StatusCode::CREATED, "{lease}");
        assert_eq!(lease["proxy"]["name"], "b", "{lease}");
    }
    let id = &granted.id;
    let (s, replay) = h.acquire(granted.request.clone()).await;
    assert_eq!(s, StatusCode::OK, "{replay}");
    assert_eq!(
        lease_summary(&replay),
        (id.clone(), "a".into(), "active".into())
    );
    h.clock.advance(Duration::from_secs(50));
    let (s, renewed) = h
        .post(
            &format!("/v1/leases/{id}/renew"),
            json!({"ttlSeconds": 100}),
        )
        .await;
    assert_eq!(s, renew_status, "{renewed}");
    renewed
}

/// Asserts an acquire on `geo: eu` is refused as `no_match` with these `counts` of the
/// proxies it considered, with no hint to retry (body or header), and a message that contains
/// `summary`.
async fn assert_no_match_without_retry(h: &Harness, counts: &[(&str, u64)], summary: &str) {
    let (s, headers, body) = h
        .send(
            reqwest::Method::POST,
            "/v1/leases",
            Some(json!({"selector": {"geo": "eu"}})),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{body}");
    assert_error(&body, "no_match");
    for (field, count) in counts {
        assert_eq!(body[*field], *count, "{field}: {body}");
    }
    assert!(body.get("retryAfterSeconds").is_none(), "{body}");
    assert!(headers.get("retry-after").is_none(), "{headers:?}");
    assert!(
        body["message"].as_str().unwrap().contains(summary),
        "{body}"
    );
}

/// Releases the lease `id`, asserting the answer is 204.
async fn release(h: &Harness, id: &str) {
    let (s, _, body) = h
        .send(reqwest::Method::DELETE, &format!("/v1/leases/{id}"), None)
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{body}");
}

/// Asserts the OpenAPI document `doc` says `field` is always sent: a required integer of a
/// 409's body and a required boolean of a listed proxy.
fn assert_always_sent(doc: &Value, field: &str) {
    for (schema, kind) in [("NoMatchBody", "integer"), ("ProxyView", "boolean")] {
        let schema = &doc["components"]["schemas"][schema];
        assert_eq!(schema["properties"][field]["type"], kind, "{schema}");
        let required = schema["required"].as_array().unwrap();
        assert!(required.contains(&json!(field)), "{schema}");
    }
}

async fn a_cordoned_proxy_gets_no_new_leases_and_keeps_the_ones_it_has(backend: Backend) {
    let Some(h) = Harness::start(backend).await else {
        return;
    };
    let eu = [("geo", "eu")];
    // A lease on the fast proxy, granted before the cordon, with a request ID.
    let granted = lease_on_fast_a(
        &h,
        "pre-cordon",
        cordon_view,
        [("a", false, true, 0), ("b", false, true, 0)],
    )
    .await;
    let id = &granted.id;

    // Cordon a: new leases go to b (also once a is less loaded, after the first), while the
    // lease granted before the cordon replays, renews and takes reports.
    let renewed = make_a_unleasable(
        &h,
        &granted,
        cordoned,
        cordon_view,
        [("a", true, true, 1), ("b", false, true, 0)],
        StatusCode::OK,
    )
    .await;
    assert!(
        renewed["expiresAt"]
            .as_str()
            .unwrap()
            .starts_with("2026-11-30T12:02:30"),
        "{renewed}"
    );
    let (s, v) = h
        .post(&format!("/v1/leases/{id}/report"), json!({"result": "ok"}))
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");

    // With b cordoned too and an unhealthy c, the 409 counts the cordoned proxies as cordoned
    // only (healthy or not), and a's lease expiry is no reason to retry.
    h.load(vec![
        (cordoned(proxy("a", 3001, &eu, 5)), Some(5)),
        (cordoned(proxy("b", 3002, &eu, 5)), Some(50)),
        (proxy("c", 3003, &eu, 5), None),
        (cordoned(proxy("d", 3004, &eu, 5)), None),
    ]);
    assert_no_match_without_retry(
        &h,
        &[
            ("considered", 4),
            ("cordoned", 3),
            ("unhealthy", 1),
            ("atCapacity", 0),
            ("inCooldown", 0),
        ],
        "3 cordoned",
    )
    .await;

    // Releasing works on a cordoned proxy; uncordoning makes it leasable again.
    release(&h, id).await;
    load_a_and_b(&h, identity, cordoned);
    let (s, lease) = h.acquire(json!({"selector": {"geo": "eu"}})).await;
    assert_eq!(s, StatusCode::CREATED, "{lease}");
    assert_eq!(lease["proxy"]["name"], "a");

    // The document says so: both fields are always sent.
    let (_, doc) = h.get("/v1/openapi.json").await;
    assert_always_sent(&doc, "cordoned");
    h.stop().await;
}

/// `p` with the Provisioned condition the reconciler writes when it starts draining the proxy
/// for a replacement (`reason: Draining`).
fn replacing(mut p: Proxy) -> Proxy {
    p.status = Some(ProxyStatus {
        conditions: vec![Condition {
            type_: CONDITION_PROVISIONED.into(),
            status: ConditionStatus::False,
            reason: REASON_DRAINING.into(),
            message: "draining before replacement: 1 active lease".into(),
            last_transition_time: "2026-11-30T12:00:00Z".parse().unwrap(),
            observed_generation: Some(1),
        }],
        ..ProxyStatus::default()
    });
    p
}

/// `p` being deleted (`kubectl delete` set its deletionTimestamp; the finalizer holds it).
fn deleted(mut p: Proxy) -> Proxy {
    p.metadata.deletion_timestamp = Some(Time("2026-11-30T12:00:00Z".parse().unwrap()));
    p
}

/// `(name, draining, cordoned, activeLeases)` of every listed proxy.
fn drain_view(list: &Value) -> Listed {
    listed_flags(list, "draining", "cordoned")
}

async fn a_draining_proxy_gets_no_new_leases_and_its_leases_are_not_renewed(backend: Backend) {
    let Some(h) = Harness::start(backend).await else {
        return;
    };
    let eu = [("geo", "eu")];
    // A lease on the fast proxy, granted before the drain, with a request ID; one on b.
    let granted = lease_on_fast_a(
        &h,
        "pre-drain",
        drain_view,
        [("a", false, false, 0), ("b", false, false, 0)],
    )
    .await;
    let id = &granted.id;
    let (s, on_b) = h.acquire(json!({"selector": {"geo": "eu"}})).await;
    assert_eq!(s, StatusCode::CREATED, "{on_b}");
    assert_eq!(on_b["proxy"]["name"], "b");
    let on_b = on_b["leaseID"].as_str().unwrap().to_owned();

    // a starts draining for a replacement (the reconciler's condition, as the watch delivers
    // it): listed as draining, still healthy and holding its lease. New leases go to b (a is
    // as loaded); the lease granted before the drain replays and can be read, but is not
    // renewed: the crawler is told to release it and acquire another proxy.
    let refused = make_a_unleasable(
        &h,
        &granted,
        replacing,
        drain_view,
        [("a", true, false, 1), ("b", false, false, 1)],
        StatusCode::CONFLICT,
    )
    .await;
    assert_error(&refused, "proxy_draining");
    let message = refused["message"].as_str().unwrap();
    for part in [
        "crawl/a is draining",
        "release",
        "acquire another proxy",
        id,
    ] {
        assert!(message.contains(part), "{part:?} not in {message:?}");
    }
    assert_eq!(refused.as_object().unwrap().len(), 2, "{refused}");
    // Nothing was renewed.
    let (s, got) = h.get(&format!("/v1/leases/{id}")).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(got["expiresAt"], granted.lease["expiresAt"], "{got}");
    assert_eq!(got["state"], "active", "{got}");
    // Leases on other proxies renew as before, and unknown leases are still unknown.
    let (s, renewed) = h.post(&format!("/v1/leases/{on_b}/renew"), json!({})).await;
    assert_eq!(s, StatusCode::OK, "{renewed}");
    let (s, v) = h.post("/v1/leases/never-issued/renew", json!({})).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    assert_error(&v, "unknown_lease");
    // Reports and the release still land on the draining proxy's lease.
    let (s, v) = h
        .post(
            &format!("/v1/leases/{id}/report"),
            json!({"result": "ok", "target": "example.com"}),
        )
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    release(&h, id).await;
    // Once released, a renew gets today's answer for a lease that is over.
    let (s, v) = h.post(&format!("/v1/leases/{id}/renew"), json!({})).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_error(&v, "lease_not_active");
    // The replay still answers, with the lease as it is now.
    let (s, replay) = h.acquire(granted.request.clone()).await;
    assert_eq!(s, StatusCode::OK, "{replay}");
    assert_eq!(
        lease_summary(&replay),
        (id.clone(), "a".into(), "released".into())
    );

    // Draining for a replacement (a, with leases), being deleted (b, with leases), cordoned
    // and deleted at once (c) and unhealthy (d): the 409 counts each proxy in one bucket, in
    // the order cordoned, draining, unhealthy; the draining proxies' lease expiries are no
    // reason to retry. (First a takes a lease while it is not draining.)
    load_a_and_b(&h, identity, identity);
    let (s, on_a) = h.acquire(json!({"selector": {"geo": "eu"}})).await;
    assert_eq!(s, StatusCode::CREATED, "{on_a}");
    assert_eq!(on_a["proxy"]["name"], "a", "{on_a}");
    h.load(vec![
        (replacing(proxy("a", 3001, &eu, 5)), Some(5)),
        (deleted(proxy("b", 3002, &eu, 5)), Some(50)),
        (deleted(cordoned(proxy("c", 3003, &eu, 5))), Some(1)),
        (proxy("d", 3004, &eu, 5), None),
    ]);
    assert_no_match_without_retry(
        &h,
        &[
            ("considered", 4),
            ("cordoned", 1),
            ("draining", 2),
            ("unhealthy", 1),
            ("atCapacity", 0),
            ("inCooldown", 0),
        ],
        "1 cordoned, 2 draining, 1 unhealthy",
    )
    .await;
    let (_, list) = h.get("/v1/proxies").await;
    assert_eq!(
        drain_view(&list),
        [
            ("a".to_owned(), true, false, 1),
            ("b".to_owned(), true, false, 4),
            ("c".to_owned(), true, true, 0),
            ("d".to_owned(), false, false, 0),
        ]
    );
    // The proxy being deleted refuses renewals too; its leases can still be released.
    let (s, v) = h.post(&format!("/v1/leases/{on_b}/renew"), json!({})).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_error(&v, "proxy_draining");
    assert!(v["message"].as_str().unwrap().contains("crawl/b"), "{v}");
    release(&h, &on_b).await;

    // A proxy that is back (its new machine runs, the condition no longer says Draining)
    // renews and takes leases again.
    let on_a = on_a["leaseID"].as_str().unwrap().to_owned();
    load_a_and_b(&h, identity, deleted);
    let (s, renewed) = h.post(&format!("/v1/leases/{on_a}/renew"), json!({})).await;
    assert_eq!(s, StatusCode::OK, "{renewed}");
    let (s, lease) = h.acquire(json!({"selector": {"geo": "eu"}})).await;
    assert_eq!(s, StatusCode::CREATED, "{lease}");
    assert_eq!(lease["proxy"]["name"], "a");

    // The document says so: the fields are always sent, and renew documents the code.
    let (_, doc) = h.get("/v1/openapi.json").await;
    assert_always_sent(&doc, "draining");
    let conflict = &doc["paths"]["/v1/leases/{id}/renew"]["post"]["responses"]["409"];
    assert!(
        conflict["description"]
            .as_str()
            .unwrap()
            .contains("`proxy_draining`"),
        "{conflict}"
    );
    h.stop().await;
}

async fn lease_errors(backend: Backend) {
    let Some(h) = Harness::start(backend).await else {
        return;
    };
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
            "invalid_target",
        ),
        (
            format!("/v1/leases/{id}/report"),
            json!({"result": "ok", "target": "x".repeat(254)}),
            StatusCode::BAD_REQUEST,
            "invalid_target",
        ),
        // serde would read a struct from an array of its fields; the API takes objects only.
        (
            "/v1/leases".to_owned(),
            json!([{}, null, 300]),
            StatusCode::BAD_REQUEST,
            "invalid_body",
        ),
        (
            format!("/v1/leases/{id}/renew"),
            json!([]),
            StatusCode::BAD_REQUEST,
            "invalid_body",
        ),
        (
            format!("/v1/leases/{id}/report"),
            json!(["ok"]),
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

async fn framework_errors_are_json_too(backend: Backend) {
    let Some(h) = Harness::start(backend).await else {
        return;
    };
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
            // Acquire and renew read an empty body as `{}`; a report needs `result`.
            raw(reqwest::Method::POST, "/v1/leases/nope/report")
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

async fn a_panicking_handler_answers_500_and_the_server_keeps_serving(backend: Backend) {
    let Some(h) = Harness::start_with(backend, boom).await else {
        return;
    };
    for _ in 0..3 {
        let response = h.client.get(h.url("/boom")).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_error(&response.json().await.unwrap(), "internal");
        let response = h.client.get(h.url("/healthz")).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    h.stop().await;
}

async fn concurrent_acquires_never_exceed_capacity(backend: Backend) {
    let Some(h) = Harness::start(backend).await else {
        return;
    };
    let h = Arc::new(h);
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
                // A write the ledger could not take in time is refused (503 `overloaded`,
                // nothing granted) and the crawler asks again, as its Retry-After invites: a
                // PostgreSQL ledger's pool may still be connecting when the burst comes.
                let asked = std::time::Instant::now();
                loop {
                    let (s, headers, v) = h
                        .send(
                            reqwest::Method::POST,
                            "/v1/leases",
                            Some(json!({"selector": {"pool": "x"}, "ttlSeconds": 300})),
                        )
                        .await;
                    match s {
                        StatusCode::CREATED => {
                            granted.push(v["proxy"]["name"].as_str().unwrap().to_owned());
                        }
                        StatusCode::CONFLICT => assert_error(&v, "no_match"),
                        StatusCode::SERVICE_UNAVAILABLE => {
                            assert_error(&v, "overloaded");
                            assert!(headers.contains_key("retry-after"), "{headers:?}");
                            assert!(
                                asked.elapsed() < crate::support::DEADLINE,
                                "still overloaded after {:?}: {v}",
                                asked.elapsed()
                            );
                            continue;
                        }
                        other => panic!("unexpected {other}: {v}"),
                    }
                    break;
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
    // The store holds exactly the granted leases, three per proxy.
    assert_eq!(
        h.count("SELECT count(*) FROM leases WHERE state = 'active'"),
        15
    );
    assert_eq!(
        h.count(
            "SELECT count(*) FROM (SELECT proxy_uid FROM leases WHERE state = 'active' \
             GROUP BY proxy_uid HAVING count(*) = 3) AS full_proxies"
        ),
        5
    );
}

async fn openapi_document_lists_every_route(backend: Backend) {
    let Some(h) = Harness::start(backend).await else {
        return;
    };
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
        ("/v1/sessions/{name}", "delete"),
        ("/v1/sessions/{name}/report", "post"),
        ("/v1/openapi.json", "get"),
        ("/healthz", "get"),
        ("/readyz", "get"),
        ("/v1/status/fleet", "get"),
        ("/v1/status/proxies", "get"),
        ("/v1/status/proxies/{namespace}/{name}", "get"),
        ("/v1/status/targets", "get"),
        ("/v1/status/events", "get"),
        ("/v1/status/spend", "get"),
        ("/v1/status/charts", "get"),
    ];
    for (path, method) in expected {
        assert!(
            paths.get(path).and_then(|p| p.get(method)).is_some(),
            "{method} {path} missing"
        );
    }
    assert_eq!(paths.len(), 17, "{:?}", paths.keys().collect::<Vec<_>>());
    // Every documented route answers something other than 404 on the real server.
    for (path, method) in expected {
        let path = path
            .replace("{id}", "x")
            .replace("{name}", "x")
            .replace("{namespace}", "x");
        let m: reqwest::Method = method.to_uppercase().parse().unwrap();
        let (s, _, _) = h.send(m, &path, Some(json!({"result": "ok"}))).await;
        assert!(
            s != StatusCode::NOT_FOUND
                || path.contains("/leases/x")
                || path.contains("/sessions/x")
                || path.contains("/status/proxies/x"),
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
    // The idempotency key and the answers it brings are part of the contract.
    let request_id = &schemas["AcquireRequest"]["properties"]["requestID"];
    assert_eq!(
        request_id["pattern"],
        api::REQUEST_ID_PATTERN,
        "{request_id}"
    );
    assert_eq!(request_id["minLength"], 1, "{request_id}");
    assert_eq!(
        request_id["maxLength"],
        api::MAX_REQUEST_ID_LEN,
        "{request_id}"
    );
    let acquire = &paths["/v1/leases"]["post"]["responses"];
    for status in ["200", "201", "409", "422", "503"] {
        assert!(acquire.get(status).is_some(), "acquire {status}: {acquire}");
    }
    for (path, method) in [
        ("/v1/leases", "post"),
        ("/v1/leases/{id}", "delete"),
        ("/v1/leases/{id}/renew", "post"),
        ("/v1/leases/{id}/report", "post"),
    ] {
        let overloaded = &paths[path][method]["responses"]["503"];
        assert!(
            overloaded["headers"].get("Retry-After").is_some(),
            "{method} {path}: {overloaded}"
        );
    }
    h.stop().await;
}

/// The lease ID, proxy and state of a lease answer.
fn lease_summary(lease: &Value) -> (String, String, String) {
    (
        lease["leaseID"].as_str().unwrap_or_default().to_owned(),
        lease["proxy"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        lease["state"].as_str().unwrap_or_default().to_owned(),
    )
}

async fn a_request_id_replays_its_lease_also_after_a_restart(backend: Backend) {
    let Some(h) = Harness::start(backend).await else {
        return;
    };
    h.load(vec![
        (proxy("a", 3001, &[("geo", "eu")], 5), Some(5)),
        (proxy("b", 3002, &[("geo", "eu")], 5), Some(9)),
    ]);
    let body = json!({
        "selector": {"geo": "eu"}, "target": "Example.com", "ttlSeconds": 60,
        "requestID": "crawl-42/attempt",
    });
    let (s, first) = h.acquire(body.clone()).await;
    assert_eq!(s, StatusCode::CREATED, "{first}");
    let (id, proxy_name, _) = lease_summary(&first);
    assert_eq!(proxy_name, "a");
    // The ledger says what the ID was first used for, readably (the ID is hex digits).
    assert!(id.chars().all(|c| c.is_ascii_hexdigit()), "{id}");
    let stored = |column: &str| h.value(&format!("SELECT {column} FROM leases WHERE id = '{id}'"));
    assert_eq!(stored("request_id"), "crawl-42/attempt");
    assert_eq!(
        stored("request_fingerprint"),
        r#"{"selector":{"geo":"eu"},"target":"example.com","ttlSeconds":60}"#
    );

    // A retry gets the same lease (200, not 201), and no second lease is granted: the next
    // acquire without an ID goes to b, the less loaded proxy.
    let (s, replay) = h.acquire(body.clone()).await;
    assert_eq!(s, StatusCode::OK, "{replay}");
    assert_eq!(replay, first);
    let (_, other) = h.acquire(json!({"selector": {"geo": "eu"}})).await;
    assert_eq!(other["proxy"]["name"], "b");

    // The same ID for another question is refused; the target is compared after the API
    // normalises it, the TTL as asked.
    let same_after_normalising = json!({
        "selector": {"geo": "eu"}, "target": " EXAMPLE.COM ", "ttlSeconds": 60,
        "requestID": "crawl-42/attempt",
    });
    let (s, v) = h.acquire(same_after_normalising).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    for (what, changed) in [
        (
            "target",
            json!({"selector": {"geo": "eu"}, "target": "example.org", "ttlSeconds": 60}),
        ),
        (
            "selector",
            json!({"selector": {"geo": "us"}, "target": "example.com", "ttlSeconds": 60}),
        ),
        (
            "ttlSeconds",
            json!({"selector": {"geo": "eu"}, "target": "example.com", "ttlSeconds": 61}),
        ),
        (
            "default TTL",
            json!({"selector": {"geo": "eu"}, "target": "example.com"}),
        ),
    ] {
        let mut changed = changed;
        changed["requestID"] = json!("crawl-42/attempt");
        let (s, v) = h.acquire(changed).await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{what}: {v}");
        assert_error(&v, "request_id_reused");
    }

    // The replay shows the lease as it is now: released.
    let (s, _, _) = h
        .send(reqwest::Method::DELETE, &format!("/v1/leases/{id}"), None)
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, replay) = h.acquire(body.clone()).await;
    assert_eq!(s, StatusCode::OK, "{replay}");
    assert_eq!(
        lease_summary(&replay),
        (id.clone(), "a".into(), "released".into())
    );

    // The ledger remembers the ID across a restart.
    let h = h.restart().await;
    let (s, replay) = h.acquire(body.clone()).await;
    assert_eq!(s, StatusCode::OK, "{replay}");
    assert_eq!(
        lease_summary(&replay),
        (id.clone(), "a".into(), "released".into())
    );
    let (s, v) = h
        .acquire(json!({"selector": {"geo": "eu"}, "requestID": "crawl-42/attempt"}))
        .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    // And the lease still active on b, which the restarted ledger counts.
    let (s, kept) = h
        .get(&format!(
            "/v1/leases/{}",
            other["leaseID"].as_str().unwrap()
        ))
        .await;
    assert_eq!(s, StatusCode::OK, "{kept}");
    assert_eq!(kept["state"], "active", "{kept}");
    let (_, list) = h.get("/v1/proxies").await;
    let held: Vec<(&str, u64)> = list["proxies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap(),
                p["activeLeases"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(held, [("a", 0), ("b", 1)]);

    // A new ID is a new acquire.
    let mut fresh = body.clone();
    fresh["requestID"] = json!("crawl-43");
    let (s, v) = h.acquire(fresh).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_ne!(v["leaseID"], id.as_str());
    h.stop().await;
}

async fn invalid_request_ids_are_refused_naming_the_field(backend: Backend) {
    let Some(h) = Harness::start(backend).await else {
        return;
    };
    h.load(vec![(proxy("a", 3001, &[], 5), Some(5))]);
    for request_id in [
        json!(""),
        json!("x".repeat(129)),
        json!("tab\there"),
        json!("line\nbreak"),
        json!("caf\u{e9}"),
        json!("\u{7f}"),
        json!(42),
    ] {
        let (s, v) = h.acquire(json!({"requestID": request_id})).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{request_id}: {v}");
        assert_error(&v, "invalid_body");
        assert!(
            v["message"].as_str().unwrap().contains("requestID"),
            "{request_id}: {v}"
        );
    }
    // Nothing was granted by the refused ones; the limits themselves are accepted.
    let (_, list) = h.get("/v1/proxies").await;
    assert_eq!(list["proxies"][0]["activeLeases"], 0);
    for request_id in ["x".repeat(128), " ".to_owned(), "~".to_owned()] {
        let (s, v) = h.acquire(json!({"requestID": request_id})).await;
        assert_eq!(s, StatusCode::CREATED, "{request_id:?}: {v}");
    }
    h.stop().await;
}

/// SQLite-only: the writer's bounded queue, filled while another connection holds the
/// file's write lock ([`FileLock`]; the writer waits for it up to SQLite's busy timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_over_the_queue_gets_fast_503s_and_none_of_them_is_granted() {
    const QUEUE: usize = 2;
    const BURST: usize = 24;
    let h = Harness::start_with_ledger(
        Backend::Sqlite,
        LedgerConfig {
            queue_capacity: QUEUE,
            // The harness's clock does not move, so no write waits past this.
            queue_deadline: Duration::from_secs(60),
            ..LedgerConfig::default()
        },
    )
    .await
    .expect("SQLite always runs");
    let h = Arc::new(h);
    h.load(vec![
        (proxy("a", 3001, &[], 1000), Some(5)),
        (proxy("b", 3002, &[], 1000), Some(9)),
    ]);
    let lock = FileLock::take(&h.sqlite_file());
    let held_since = std::time::Instant::now();
    let answers = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..BURST {
        let (h, answers) = (h.clone(), answers.clone());
        tasks.push(tokio::spawn(async move {
            let request_id = format!("burst-{i}");
            let (s, headers, v) = h
                .send(
                    reqwest::Method::POST,
                    "/v1/leases",
                    Some(json!({"requestID": request_id, "ttlSeconds": 60})),
                )
                .await;
            answers
                .lock()
                .unwrap()
                .push((request_id, s, headers, v, held_since.elapsed()));
        }));
    }
    // The writer holds at most one write and the queue QUEUE more; every other one is refused
    // at once, while the file is still locked.
    let refused_at_least = BURST - QUEUE - 1;
    // Well within SQLite's busy timeout (5 s), after which the waiting writer would give up.
    let started = std::time::Instant::now();
    while answers.lock().unwrap().len() < refused_at_least {
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "only {} of the burst answered while the file was locked",
            answers.lock().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let refused_while_locked = answers.lock().unwrap().len();
    lock.release();
    for task in tasks {
        task.await.unwrap();
    }
    let answers = std::mem::take(&mut *answers.lock().unwrap());
    assert_eq!(answers.len(), BURST);
    let mut granted = Vec::new();
    let mut refused = Vec::new();
    for (request_id, status, headers, body, _) in &answers {
        match *status {
            StatusCode::CREATED => granted.push(body["leaseID"].as_str().unwrap().to_owned()),
            StatusCode::SERVICE_UNAVAILABLE => {
                assert_error(body, "overloaded");
                let retry_after: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
                assert!(retry_after >= 1, "{retry_after}");
                refused.push(request_id.clone());
            }
            other => panic!("{request_id}: unexpected {other}: {body}"),
        }
    }
    assert!(
        refused.len() >= refused_at_least && refused_while_locked >= refused_at_least,
        "{} refused, {refused_while_locked} before the file was unlocked",
        refused.len()
    );
    assert!(
        !granted.is_empty() && granted.len() <= QUEUE + 1,
        "{granted:?}"
    );

    // Exactly the 201s hold leases: in the ledger's counts, in the file, and by ID.
    assert_eq!(h.ledger.counts().active_total(), granted.len() as u64);
    let (_, list) = h.get("/v1/proxies").await;
    let listed: u64 = list["proxies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["activeLeases"].as_u64().unwrap())
        .sum();
    assert_eq!(listed, granted.len() as u64);
    assert_eq!(h.count("SELECT count(*) FROM leases"), granted.len() as i64);
    for id in &granted {
        let (s, v) = h.get(&format!("/v1/leases/{id}")).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v["state"], "active");
    }
    // A refused request ID was never used: retrying it is a fresh grant (201), not a replay.
    for request_id in refused.iter().take(3) {
        let (s, v) = h
            .acquire(json!({"requestID": request_id, "ttlSeconds": 60}))
            .await;
        assert_eq!(s, StatusCode::CREATED, "{request_id}: {v}");
    }
}

/// The methods the document gives `path`, upper-cased and sorted.
fn documented_methods(doc: &Value, path: &str) -> Vec<String> {
    let mut methods: Vec<String> = doc["paths"][path]
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| {
            [
                "get", "head", "post", "put", "patch", "delete", "options", "trace",
            ]
            .contains(&k.as_str())
        })
        .map(|k| k.to_uppercase())
        .collect();
    methods.sort();
    methods
}

async fn every_route_answers_other_methods_405_with_an_allow_header_of_its_documented_methods(
    backend: Backend,
) {
    let Some(h) = Harness::start(backend).await else {
        return;
    };
    h.load(vec![(proxy("a", 3001, &[], 5), Some(5))]);
    let (_, doc) = h.get("/v1/openapi.json").await;
    let paths: Vec<String> = doc["paths"].as_object().unwrap().keys().cloned().collect();
    assert_eq!(paths.len(), 17, "{paths:?}");
    let methods = [
        "GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "QUERY",
    ];
    for path in &paths {
        let documented = documented_methods(&doc, path);
        let url = h.url(&path.replace("{id}", "x"));
        for method in methods {
            let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
            let response = h
                .client
                .request(method.clone(), &url)
                .bearer_auth(TOKEN)
                .send()
                .await
                .unwrap();
            if documented.contains(&method.to_string()) {
                assert_ne!(
                    response.status(),
                    StatusCode::METHOD_NOT_ALLOWED,
                    "{method} {path}"
                );
                continue;
            }
            assert_eq!(
                response.status(),
                StatusCode::METHOD_NOT_ALLOWED,
                "{method} {path}"
            );
            let allow = response.headers()["allow"].to_str().unwrap().to_owned();
            let mut allowed: Vec<String> = allow.split(", ").map(str::to_owned).collect();
            allowed.sort();
            assert_eq!(allowed, documented, "{method} {path}: Allow: {allow}");
            assert_error(&response.json().await.unwrap(), "method_not_allowed");
        }
    }
    // Authentication comes first: without the token a /v1 route answers 401 to any method.
    let response = h
        .client
        .request(reqwest::Method::PUT, h.url("/v1/proxies"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    h.stop().await;
}

/// A validator for one schema of the served document (schemathesis judges with the same
/// engine, jsonschema-rs).
fn validator(schema: &Value) -> jsonschema::Validator {
    jsonschema::validator_for(schema).unwrap_or_else(|e| panic!("{schema}: {e}"))
}

/// The schema of a query parameter of `GET /v1/proxies`.
fn list_parameter(doc: &Value, name: &str) -> Value {
    doc["paths"]["/v1/proxies"]["get"]["parameters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("parameter {name}"))["schema"]
        .clone()
}

async fn the_list_query_schema_accepts_exactly_what_the_server_accepts(backend: Backend) {
    let Some(h) = Harness::start(backend).await else {
        return;
    };
    h.load(vec![(proxy("a", 3001, &[("geo", "eu")], 5), Some(5))]);
    let (_, doc) = h.get("/v1/openapi.json").await;
    let cases = [
        (
            "selector",
            vec![
                "",
                "geo=eu",
                " geo = eu ,",
                ",,",
                "\t",
                "a=b=c",
                "geo=eu,geo=us",
                "k=",
                "\u{a0}=x",
                "é=ü",
                "k\n=v",
                "geo",
                "=eu",
                " \t=eu",
                "geo=eu,tier",
                "geo=eu,,=x",
            ],
        ),
        (
            "healthy",
            vec!["true", "false", "", "yes", "TRUE", "1", " true", "true\n"],
        ),
    ];
    for (name, values) in cases {
        let schema = validator(&list_parameter(&doc, name));
        for value in values {
            let query = url::form_urlencoded::Serializer::new(String::new())
                .append_pair(name, value)
                .finish();
            let response = h
                .client
                .get(h.url(&format!("/v1/proxies?{query}")))
                .bearer_auth(TOKEN)
                .send()
                .await
                .unwrap();
            let status = response.status();
            assert_eq!(
                schema.is_valid(&json!(value)),
                status == StatusCode::OK,
                "{name}={value:?}: {status}"
            );
            if status != StatusCode::OK {
                assert_eq!(status, StatusCode::BAD_REQUEST, "{name}={value:?}");
                assert_error(&response.json().await.unwrap(), "invalid_query");
            }
        }
    }
    h.stop().await;
}

async fn the_body_schemas_accept_exactly_what_the_server_accepts(backend: Backend) {
    let Some(h) = Harness::start(backend).await else {
        return;
    };
    h.load(vec![(proxy("a", 3001, &[], 100_000), Some(5))]);
    let (_, doc) = h.get("/v1/openapi.json").await;
    let schemas = &doc["components"]["schemas"];
    let (_, lease) = h.acquire(json!({"ttlSeconds": 60})).await;
    let id = lease["leaseID"].as_str().unwrap().to_owned();
    let renew = format!("/v1/leases/{id}/renew");
    let report = format!("/v1/leases/{id}/report");

    // `target`: 1 to 253 printable ASCII characters, not only spaces.
    let targets = [
        json!("example.com"),
        json!(" Example.COM "),
        json!("a".repeat(253)),
        json!(format!("{}a", " ".repeat(252))),
        json!(null),
        json!("a".repeat(254)),
        json!(""),
        json!("   "),
        json!("bücher.de"),
        json!("tab\there"),
        json!("x\u{7f}"),
    ];
    for (path, schema, base) in [
        ("/v1/leases", &schemas["AcquireRequest"], json!({})),
        (
            report.as_str(),
            &schemas["ReportRequest"],
            json!({"result": "ok"}),
        ),
    ] {
        let target_schema = &schema["properties"]["target"];
        assert_eq!(target_schema["maxLength"], 253, "{path}: {target_schema}");
        assert_eq!(target_schema["minLength"], 1, "{path}: {target_schema}");
        let target_schema = validator(target_schema);
        for target in &targets {
            let mut body = base.clone();
            body["target"] = target.clone();
            let (s, v) = h.post(path, body).await;
            if target_schema.is_valid(target) {
                assert!(s.is_success(), "{path} {target}: {s} {v}");
            } else {
                assert_eq!(s, StatusCode::BAD_REQUEST, "{path} {target}: {v}");
                assert_error(&v, "invalid_target");
            }
        }
    }

    // `ttlSeconds`: a whole number from 1 to 2^53 - 1; JSON Schema counts 4897.0 as an
    // integer, and so does the server.
    let ttls = [
        (json!(1), Some(1)),
        (json!(60), Some(60)),
        (json!(4897), Some(600)),
        (json!(4897.0), Some(600)),
        (json!(4.8e2), Some(480)),
        (json!(9_007_199_254_740_991_u64), Some(600)),
        (json!(null), Some(120)),
        (json!(0), None),
        (json!(-1), None),
        (json!(4897.5), None),
        (json!(0.5), None),
        (json!(9_007_199_254_740_992_u64), None),
        (json!(1e300), None),
        (json!("60"), None),
        (json!(true), None),
    ];
    for (path, schema) in [
        ("/v1/leases", &schemas["AcquireRequest"]),
        (renew.as_str(), &schemas["RenewRequest"]),
    ] {
        let ttl_schema = validator(&schema["properties"]["ttlSeconds"]);
        for (ttl, granted) in &ttls {
            let (s, v) = h.post(path, json!({"ttlSeconds": ttl})).await;
            assert_eq!(ttl_schema.is_valid(ttl), granted.is_some(), "{path} {ttl}");
            match granted {
                Some(granted) => {
                    assert!(s.is_success(), "{path} {ttl}: {s} {v}");
                    assert_eq!(v["ttlSeconds"], *granted, "{path} {ttl}: {v}");
                }
                None => {
                    assert_eq!(s, StatusCode::BAD_REQUEST, "{path} {ttl}: {v}");
                    assert_error(&v, "invalid_body");
                    assert!(v["message"].as_str().unwrap().contains("ttlSeconds"), "{v}");
                }
            }
        }
    }

    // `result`: the enumeration the ledger knows, nothing else.
    let result_schema = &schemas["ReportRequest"]["properties"]["result"];
    assert_eq!(
        result_schema["enum"],
        json!(["ok", "rate_limited", "blocked", "error"])
    );
    let result_schema = validator(result_schema);
    for result in ["ok", "rate_limited", "blocked", "error", "meh", "", "OK"] {
        let (s, v) = h.post(&report, json!({"result": result})).await;
        if result_schema.is_valid(&json!(result)) {
            assert_eq!(s, StatusCode::NO_CONTENT, "{result}: {v}");
        } else {
            assert_eq!(s, StatusCode::BAD_REQUEST, "{result}: {v}");
            assert_error(&v, "unknown_result");
        }
    }
    h.stop().await;
}

/// Resolves a `$response.body#/pointer` runtime expression against a JSON body.
fn runtime_expression<'a>(expression: &str, body: &'a Value) -> &'a Value {
    let pointer = expression
        .strip_prefix("$response.body#")
        .unwrap_or_else(|| panic!("unsupported expression {expression}"));
    body.pointer(pointer)
        .unwrap_or_else(|| panic!("{expression} not in {body}"))
}

/// The (method, path) of the operation with `operation_id`.
fn operation(doc: &Value, operation_id: &str) -> (reqwest::Method, String) {
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            if op["operationId"] == operation_id {
                return (method.to_uppercase().parse().unwrap(), path.clone());
            }
        }
    }
    panic!("no operation {operation_id}");
}

async fn lease_answers_link_to_the_operations_on_that_lease_and_the_links_work(backend: Backend) {
    let Some(h) = Harness::start(backend).await else {
        return;
    };
    h.load(vec![(proxy("a", 3001, &[], 5), Some(5))]);
    let (_, doc) = h.get("/v1/openapi.json").await;
    for (path, method, status) in [
        ("/v1/leases", "post", "201"),
        ("/v1/leases", "post", "200"),
        ("/v1/leases/{id}", "get", "200"),
        ("/v1/leases/{id}/renew", "post", "200"),
    ] {
        let links = &doc["paths"][path][method]["responses"][status]["links"];
        let mut targets: Vec<&str> = links
            .as_object()
            .unwrap_or_else(|| panic!("{method} {path} {status}: no links"))
            .values()
            .map(|l| l["operationId"].as_str().unwrap())
            .collect();
        targets.sort_unstable();
        assert_eq!(
            targets,
            ["get_lease", "release", "renew", "report"],
            "{path}"
        );
    }

    // Follow every link of a granted lease, as a client (or schemathesis) would.
    let (s, lease) = h.acquire(json!({"ttlSeconds": 60})).await;
    assert_eq!(s, StatusCode::CREATED);
    let links = doc["paths"]["/v1/leases"]["post"]["responses"]["201"]["links"]
        .as_object()
        .unwrap();
    let order = ["GetLease", "RenewLease", "ReportResult", "ReleaseLease"];
    assert_eq!(links.len(), order.len());
    for name in order {
        let link = &links[name];
        let (method, path) = operation(&doc, link["operationId"].as_str().unwrap());
        let parameters = link["parameters"].as_object().unwrap();
        assert_eq!(parameters.len(), 1, "{name}: {link}");
        let id = runtime_expression(parameters["id"].as_str().unwrap(), &lease);
        let path = path.replace("{id}", id.as_str().unwrap());
        let body = (name == "ReportResult").then(|| json!({"result": "ok"}));
        let (s, _, v) = h.send(method.clone(), &path, body).await;
        assert!(s.is_success(), "{name}: {method} {path}: {s} {v}");
    }
    let (_, now) = h
        .get(&format!(
            "/v1/leases/{}",
            lease["leaseID"].as_str().unwrap()
        ))
        .await;
    assert_eq!(now["state"], "released");
    h.stop().await;
}

crate::on_both_backends!(
    healthz_and_readyz_are_unauthenticated,
    every_v1_route_needs_the_token,
    several_tokens_are_valid_and_a_new_set_applies_to_the_running_server,
    an_empty_body_on_acquire_and_renew_means_every_default,
    list_filters_by_health_and_selector,
    acquire_picks_least_loaded_then_fastest_and_refuses_when_full,
    ttl_is_defaulted_and_capped,
    lease_lifecycle_get_renew_report_release,
    a_cordoned_proxy_gets_no_new_leases_and_keeps_the_ones_it_has,
    a_draining_proxy_gets_no_new_leases_and_its_leases_are_not_renewed,
    lease_errors,
    framework_errors_are_json_too,
    a_panicking_handler_answers_500_and_the_server_keeps_serving,
    concurrent_acquires_never_exceed_capacity,
    openapi_document_lists_every_route,
    a_request_id_replays_its_lease_also_after_a_restart,
    invalid_request_ids_are_refused_naming_the_field,
    every_route_answers_other_methods_405_with_an_allow_header_of_its_documented_methods,
    the_list_query_schema_accepts_exactly_what_the_server_accepts,
    the_body_schemas_accept_exactly_what_the_server_accepts,
    lease_answers_link_to_the_operations_on_that_lease_and_the_links_work,
);
