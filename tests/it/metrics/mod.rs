//! `/metrics` as Prometheus scrapes it: a real metrics server over the registry the binary
//! builds, fed by the real health engine probing through a real squid, checked by
//! `promtool check metrics` (required when `CI` is set), and its size at 10,000 proxies; and
//! the per-target cooldown gauge fed by reports through the real lease API; and the
//! reconciler's fleet-lifecycle counters and remediation gauge, also through promtool.

mod dashboard;
mod monitoring;

use crate::support;

use std::io::Write as _;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use prometheus::{Encoder, Registry, TextEncoder};
use proxy_operator::api::ApiState;
use proxy_operator::api::LeaseMetrics;
use proxy_operator::fixtures;
use proxy_operator::health::{
    EngineConfig, HealthEngine, HealthSnapshot, ProbeErrorKind, ProbeMetrics, ProbeResult,
    ProxyHealth,
};
use proxy_operator::inventory::Inventory;
use proxy_operator::ledger::{
    AcquireOutcome, AcquireRequest, Candidate, Clock, Ledger, LedgerConfig, ManualClock,
    SqliteLedger, SqliteLedgerCollector, SqliteOptions, SystemClock,
};
use proxy_operator::metrics::{self, FleetCollector};
use proxy_operator::resources::proxy::{Proxy, ProxyId};
use proxy_operator::serving::Fleet;
use proxy_operator::serving::traffic::Traffic;
use support::skip::skip;
use support::{DEADLINE, Squid, Target};
use tokio_util::sync::CancellationToken;

/// An External proxy `name` at `port` probing `probe_url`.
fn proxy(name: &str, port: u16, probe_url: &str) -> Proxy {
    fixtures::external(name, "127.0.0.1", port)
        .max_leases(2)
        .probed(probe_url, "100ms")
        .build()
}

/// The registry the process builds: probe, lease, fleet and ledger-file metrics plus the
/// process collector.
fn registry(
    inventory: &Inventory,
    health: &HealthSnapshot,
    ledger: &SqliteLedger,
) -> (Registry, ProbeMetrics) {
    let registry = Registry::new();
    let probes = ProbeMetrics::register(&registry).unwrap();
    LeaseMetrics::register(&registry).unwrap();
    let fleet = FleetCollector::new(
        inventory.clone(),
        health.clone(),
        Arc::new(ledger.clone()),
        Traffic::default(),
        "USD",
        Arc::new(proxy_operator::ledger::SystemClock),
    )
    .unwrap();
    registry.register(Box::new(fleet)).unwrap();
    let file = SqliteLedgerCollector::new(ledger.clone()).unwrap();
    registry.register(Box::new(file)).unwrap();
    registry
        .register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))
        .unwrap();
    (registry, probes)
}

fn open_ledger(dir: &tempfile::TempDir) -> SqliteLedger {
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    SqliteLedger::open(
        &dir.path().join("ledger.db"),
        SqliteOptions::default(),
        LedgerConfig::default(),
        clock,
    )
    .unwrap()
}

/// Runs `promtool check metrics` on `text`. Without promtool on PATH the check is skipped,
/// unless `CI` is set (`.ci/run` installs it).
fn promtool_check(text: &str) {
    let child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(child) => child,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            skip(
                "promtool is not on PATH (apt-get install prometheus), so `promtool check \
                 metrics` did not run",
            );
            return;
        }
        Err(e) => panic!("cannot run promtool: {e}"),
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "promtool check metrics failed:\n{}{}\n{text}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

fn line_value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_scrape_passes_promtool_and_per_proxy_series_go_with_the_proxy() {
    let alive = Squid::start();
    let mut dead = Squid::start();
    dead.kill();
    let target = Target::start();
    let url = target.https_url();
    let inventory = Inventory::new();
    inventory.replace([
        proxy("up", alive.port(), &url),
        proxy("down", dead.port(), &url),
    ]);
    let health = HealthSnapshot::new();
    let dir = tempfile::tempdir().unwrap();
    let ledger = open_ledger(&dir);
    let (registry, probes) = registry(&inventory, &health, &ledger);
    let (sender, mut transitions) = tokio::sync::mpsc::channel(64);
    let drain = tokio::spawn(async move { while transitions.recv().await.is_some() {} });
    let engine = HealthEngine::new(
        EngineConfig {
            credentials: Default::default(),
            workers: 2,
            tick: Duration::from_millis(20),
            extra_root_certs: vec![target.ca_cert_der()],
        },
        inventory.clone(),
        health.clone(),
        probes,
        sender,
    );
    let shutdown = CancellationToken::new();
    let engine = tokio::spawn(engine.run(shutdown.clone()));

    let outcome = ledger
        .acquire(AcquireRequest {
            client: None,
            candidates: vec![Candidate {
                proxy: Arc::new(ProxyId {
                    namespace: "crawl".into(),
                    name: "up".into(),
                    uid: "uid-up".into(),
                }),
                max_leases: 2,
                healthy: true,
                cordoned: false,
                draining: false,
                latency: None,
            }]
            .into(),
            target: None,
            ttl: Duration::from_secs(60),
            request: None,
            tenant: proxy_operator::ledger::Tenancy::unrestricted(),
            session: None,
            fallback_step: None,
        })
        .await
        .unwrap();
    assert!(matches!(outcome, AcquireOutcome::Granted(_)));

    let listener = support::loopback_listener();
    let url = format!("http://{}/metrics", listener.local_addr().unwrap());
    let server = metrics::serve(listener, registry).unwrap();
    let handle = server.handle();
    tokio::spawn(server);
    let client = crate::support::http::client();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let text = loop {
        let text = client.get(&url).send().await.unwrap().text().await.unwrap();
        let settled = line_value(
            &text,
            r#"proxy_operator_proxy_up{name="up",namespace="crawl"}"#,
        ) == Some(1.0)
            && line_value(
                &text,
                r#"proxy_operator_proxy_up{name="down",namespace="crawl"}"#,
            ) == Some(0.0)
            // The engine observes a probe's metrics just before it publishes the verdict, and
            // `down` reads 0 before its first probe too (unprobed: Provisioning, not Unhealthy).
            && line_value(&text, r#"proxy_operator_proxies{phase="Ready"}"#) == Some(1.0)
            && line_value(&text, r#"proxy_operator_proxies{phase="Unhealthy"}"#) == Some(1.0);
        if settled {
            break text;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not settled: {text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    promtool_check(&text);
    for (series, want) in [
        (
            r#"proxy_operator_proxy_leases_active{name="up",namespace="crawl"}"#,
            Some(1.0),
        ),
        (
            r#"proxy_operator_proxy_leases_active{name="down",namespace="crawl"}"#,
            Some(0.0),
        ),
        ("proxy_operator_leases_active", Some(1.0)),
        // maxLeases of the Ready proxy only: the Unhealthy one offers nothing.
        ("proxy_operator_lease_capacity", Some(2.0)),
        (r#"proxy_operator_proxies{phase="Ready"}"#, Some(1.0)),
        (r#"proxy_operator_proxies{phase="Unhealthy"}"#, Some(1.0)),
        ("proxy_operator_ledger_full_total", Some(0.0)),
        // The bound beside the size, for the size alert.
        (
            "proxy_operator_ledger_max_bytes",
            Some(SqliteOptions::default().max_size as f64),
        ),
    ] {
        assert_eq!(line_value(&text, series), want, "{series} in {text}");
    }
    for series in [
        r#"proxy_operator_probes_total{result="ok"}"#,
        r#"proxy_operator_probes_total{result="connect_refused"}"#,
        "proxy_operator_probe_duration_seconds_count",
        r#"proxy_operator_proxy_probe_latency_seconds{name="up",namespace="crawl"}"#,
        // The ledger's file plus WAL, read at scrape time.
        "proxy_operator_ledger_bytes",
        // The acquire's transaction and the write it carried.
        "proxy_operator_ledger_batches_total",
        "proxy_operator_ledger_batched_writes_total",
        "proxy_operator_ledger_batch_seconds_count",
        "proxy_operator_ledger_commit_seconds_count",
    ] {
        assert!(
            line_value(&text, series).is_some_and(|v| v > 0.0),
            "{series} in {text}"
        );
    }
    // No per-proxy label on the fleet-level series.
    for line in text.lines().filter(|l| {
        l.starts_with("proxy_operator_probe_duration_seconds")
            || l.starts_with("proxy_operator_probes_total")
    }) {
        assert!(!line.contains("name="), "{line}");
    }

    // A proxy that goes takes its series with it.
    inventory.replace([proxy("up", alive.port(), &target.https_url())]);
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let text = client.get(&url).send().await.unwrap().text().await.unwrap();
        if !text.contains(r#"name="down""#) {
            promtool_check(&text);
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "series of `down` stay: {text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    handle.stop(true).await;
    shutdown.cancel();
    tokio::time::timeout(DEADLINE, engine)
        .await
        .unwrap()
        .unwrap();
    let _ = drain.await;
    tokio::task::spawn_blocking(move || ledger.shutdown())
        .await
        .unwrap();
}

/// /metrics at 10,000 probed proxies stays under 3 MiB (it was 13 MiB with per-proxy
/// histograms).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_proxies_fit_in_3_mib() {
    const PROXIES: usize = 10_000;
    let proxies: Vec<Proxy> = (0..PROXIES)
        .map(|i| {
            proxy(
                &format!("proxy-{i:05}"),
                3128,
                "https://example.com/generate_204",
            )
        })
        .collect();
    let ids: Vec<ProxyId> = proxies.iter().map(Proxy::id).collect();
    let inventory = Inventory::new();
    inventory.replace(proxies);
    let health = HealthSnapshot::new();
    let dir = tempfile::tempdir().unwrap();
    let ledger = open_ledger(&dir);
    let (registry, probes) = registry(&inventory, &health, &ledger);
    for (i, id) in ids.iter().enumerate() {
        let outcome = if i % 10 == 0 {
            Err(proxy_operator::health::ProbeError {
                kind: ProbeErrorKind::ConnectRefused,
                status: None,
                message: "refused".into(),
            })
        } else {
            Ok(204)
        };
        let result = ProbeResult {
            outcome,
            latency: Duration::from_micros(12_345 + i as u64),
        };
        let healthy = result.is_success();
        probes.observe(id, &result, Some(healthy));
        health.set(
            id.clone(),
            ProxyHealth {
                healthy: Some(healthy),
                latency: Some(result.latency),
                ..ProxyHealth::default()
            },
        );
    }
    let mut text = Vec::new();
    TextEncoder::new()
        .encode(&registry.gather(), &mut text)
        .unwrap();
    let per_proxy = text.len() / PROXIES;
    eprintln!(
        "/metrics at {PROXIES} proxies: {} bytes ({per_proxy} bytes per proxy)",
        text.len()
    );
    assert!(text.len() < 3 * 1024 * 1024, "{} bytes", text.len());
    let text = String::from_utf8(text).unwrap();
    for per_proxy_series in [
        "proxy_operator_proxy_up{",
        "proxy_operator_proxy_probe_latency_seconds{",
        "proxy_operator_proxy_leases_active{",
    ] {
        let count = text
            .lines()
            .filter(|l| l.starts_with(per_proxy_series))
            .count();
        assert_eq!(count, PROXIES, "{per_proxy_series}");
    }
    promtool_check(&text);
    tokio::task::spawn_blocking(move || ledger.shutdown())
        .await
        .unwrap();
}

/// The lease API and a metrics server over one ledger on a `ManualClock`, with `proxies`
/// healthy External proxies (`p0`, `p1`, ...), as the binary wires them.
struct CooldownWorld {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
    clock: Arc<ManualClock>,
    ledger: SqliteLedger,
    api: String,
    api_server: actix_web::dev::ServerHandle,
    metrics: String,
    metrics_server: actix_web::dev::ServerHandle,
    http: reqwest::Client,
}

const TOKEN: &str = "metrics-test-token";
const COOLDOWN: Duration = Duration::from_secs(600);

impl CooldownWorld {
    fn start(proxies: usize) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.db");
        let clock = Arc::new(ManualClock::new("2026-01-01T00:00:00Z".parse().unwrap()));
        let dyn_clock: Arc<dyn Clock> = clock.clone();
        let ledger = SqliteLedger::open(
            &path,
            SqliteOptions::default(),
            LedgerConfig {
                cooldown: COOLDOWN,
                ..LedgerConfig::default()
            },
            dyn_clock.clone(),
        )
        .unwrap();
        let inventory = Inventory::new();
        let health = HealthSnapshot::new();
        let proxies: Vec<Proxy> = (0..proxies)
            .map(|i| proxy(&format!("p{i}"), 3128, "https://example.com/"))
            .collect();
        for proxy in &proxies {
            health.set(
                proxy.id(),
                ProxyHealth {
                    healthy: Some(true),
                    latency: Some(Duration::from_millis(5)),
                    ..ProxyHealth::default()
                },
            );
        }
        inventory.replace(proxies);
        let registry = Registry::new();
        let fleet = FleetCollector::new(
            inventory.clone(),
            health.clone(),
            Arc::new(ledger.clone()),
            Traffic::default(),
            "USD",
            Arc::new(proxy_operator::ledger::SystemClock),
        )
        .unwrap();
        registry.register(Box::new(fleet)).unwrap();
        let state = ApiState::new(
            Fleet::new(inventory, health, Arc::new(ledger.clone()), dyn_clock),
            LeaseMetrics::register(&registry).unwrap(),
            Duration::from_secs(60),
        );
        let (api, api_server) = support::serve_api(state, TOKEN);
        let listener = support::loopback_listener();
        let metrics = format!("http://{}/metrics", listener.local_addr().unwrap());
        let server = metrics::serve(listener, registry).unwrap();
        let metrics_server = server.handle();
        tokio::spawn(server);
        CooldownWorld {
            _dir: dir,
            path,
            clock,
            ledger,
            api,
            api_server,
            metrics,
            metrics_server,
            http: crate::support::http::client(),
        }
    }

    /// `count` leases for `target`, each reported `result` and released: `count` proxies
    /// cooling down for it (an acquire for `target` skips the ones already cooling down).
    async fn cool_down(&self, target: &str, count: usize, result: &str) {
        for _ in 0..count {
            let response = self
                .http
                .post(format!("{}/v1/leases", self.api))
                .bearer_auth(TOKEN)
                .json(&serde_json::json!({"selector": {}, "target": target, "ttlSeconds": 60}))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), reqwest::StatusCode::CREATED, "{target}");
            let lease: serde_json::Value = response.json().await.unwrap();
            let id = lease["leaseID"].as_str().unwrap();
            let response = self
                .http
                .post(format!("{}/v1/leases/{id}/report", self.api))
                .bearer_auth(TOKEN)
                .json(&serde_json::json!({"result": result}))
                .send()
                .await
                .unwrap();
            assert_eq!(
                response.status(),
                reqwest::StatusCode::NO_CONTENT,
                "{target}"
            );
            let response = self
                .http
                .delete(format!("{}/v1/leases/{id}", self.api))
                .bearer_auth(TOKEN)
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), reqwest::StatusCode::NO_CONTENT);
        }
    }

    /// One scrape, checked by promtool.
    async fn scrape(&self) -> String {
        let text = self.fetch().await;
        promtool_check(&text);
        text
    }

    /// One scrape as served, unchecked (what a timing measures).
    async fn fetch(&self) -> String {
        self.http
            .get(&self.metrics)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    async fn stop(self) {
        self.api_server.stop(true).await;
        self.metrics_server.stop(true).await;
        let ledger = self.ledger;
        tokio::task::spawn_blocking(move || ledger.shutdown())
            .await
            .unwrap();
    }
}

/// The `proxy_operator_target_cooldowns` series of a scrape, by target, in page order.
fn target_cooldowns(text: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter_map(|l| l.strip_prefix("proxy_operator_target_cooldowns{target=\""))
        .map(|rest| {
            let (target, value) = rest.rsplit_once("\"} ").unwrap();
            (target.to_owned(), value.parse().unwrap())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_cooldowns_follow_reports_and_go_when_the_cooldowns_end() {
    let world = CooldownWorld::start(4);
    let text = world.scrape().await;
    assert!(
        !text.contains("proxy_operator_target_cooldowns"),
        "no series (nor HELP) while nothing cools down: {text}"
    );

    world.cool_down("shop.example", 3, "rate_limited").await;
    world.cool_down("news.example", 1, "blocked").await;
    world.clock.advance(Duration::from_secs(300));
    world.cool_down("api.example", 2, "rate_limited").await;
    let text = world.scrape().await;
    assert_eq!(
        target_cooldowns(&text),
        [
            ("api.example".to_owned(), 2.0),
            ("news.example".to_owned(), 1.0),
            ("shop.example".to_owned(), 3.0),
        ],
        "{text}"
    );
    assert!(
        text.contains(
            "# HELP proxy_operator_target_cooldowns (proxy, target) cooldowns in force per target"
        ),
        "{text}"
    );
    assert!(text.contains("# TYPE proxy_operator_target_cooldowns gauge"));
    assert_eq!(
        line_value(&text, "proxy_operator_cooldowns_active"),
        Some(6.0)
    );

    // The first two targets' cooldowns end (no sweep yet): their series are gone at once.
    world.clock.advance(COOLDOWN - Duration::from_secs(300));
    let text = world.scrape().await;
    assert_eq!(
        target_cooldowns(&text),
        [("api.example".to_owned(), 2.0)],
        "{text}"
    );
    assert_eq!(
        line_value(&text, "proxy_operator_cooldowns_active"),
        Some(2.0)
    );

    // The sweep removes the ended ones; then the last target's end too.
    world.ledger.sweep().await.unwrap();
    assert_eq!(
        target_cooldowns(&world.scrape().await),
        [("api.example".to_owned(), 2.0)]
    );
    world.clock.advance(Duration::from_secs(300));
    let text = world.scrape().await;
    assert!(target_cooldowns(&text).is_empty(), "{text}");
    assert!(!text.contains("proxy_operator_target_cooldowns"), "{text}");
    world.ledger.sweep().await.unwrap();
    assert!(target_cooldowns(&world.scrape().await).is_empty());

    // Which targets ban which proxies, as docs/ledger.md shows it.
    let banned = support::sqlite3(
        &world.path,
        "SELECT target, proxy_namespace || '/' || proxy_name AS proxy, result, COUNT(*) AS reports
         FROM lease_events WHERE kind = 'reported' AND result IN ('rate_limited', 'blocked')
         GROUP BY target, proxy_uid, result ORDER BY target, proxy;",
    );
    let lines: Vec<&str> = banned.lines().collect();
    assert_eq!(lines.len(), 6, "{banned}");
    assert!(
        lines.contains(&"news.example|crawl/p0|blocked|1"),
        "{banned}"
    );
    world.stop().await;
}

/// 60 targets in cooldown: exactly 50 named series, the most cooldowns first (ties by name),
/// and `_other` with the sum of the other 10.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_targets_show_fifty_series_and_other() {
    let world = CooldownWorld::start(3);
    // t00..t59: 1, 2 or 3 cooldowns.
    let targets: Vec<(String, usize)> = (0..60)
        .map(|i| (format!("t{i:02}.example"), 1 + i % 3))
        .collect();
    for (target, count) in &targets {
        world.cool_down(target, *count, "rate_limited").await;
    }
    let mut ranked = targets.clone();
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let other: usize = ranked[50..].iter().map(|(_, count)| count).sum();
    assert_eq!(other, 10, "the ten left out count one each");

    let text = world.scrape().await;
    let series = target_cooldowns(&text);
    assert_eq!(series.len(), 51, "{text}");
    let mut named: Vec<(String, f64)> = ranked[..50]
        .iter()
        .map(|(target, count)| (target.clone(), *count as f64))
        .collect();
    named.push(("_other".to_owned(), other as f64));
    // The page is sorted by label value.
    named.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(series, named);
    assert_eq!(
        line_value(&text, "proxy_operator_cooldowns_active"),
        Some(120.0)
    );

    // Timed: the scrape copies 51 numbers from the ledger's memory.
    let mut times: Vec<Duration> = Vec::new();
    for _ in 0..50 {
        let start = std::time::Instant::now();
        let _ = world.fetch().await;
        times.push(start.elapsed());
    }
    times.sort();
    eprintln!(
        "/metrics with 60 targets in cooldown: p50 {:?}, p95 {:?}",
        times[times.len() / 2],
        times[times.len() * 95 / 100]
    );

    world.clock.advance(COOLDOWN);
    let text = world.scrape().await;
    assert!(target_cooldowns(&text).is_empty(), "{text}");
    world.stop().await;
}

/// A Managed proxy of `provider` whose `Healthy` condition is `healthy`.
fn managed(name: &str, provider: &str, healthy: bool) -> Proxy {
    let status = serde_json::from_value(serde_json::json!({"conditions": [{
        "type": "Healthy", "status": if healthy { "True" } else { "False" },
        "reason": "Probe", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z",
    }]}))
    .unwrap();
    fixtures::managed(name, provider).status(status).build()
}

#[test]
fn reconciler_metrics_pass_promtool_and_the_pause_follows_the_unhealthy_share() {
    use kube::runtime::watcher::Event;
    use proxy_operator::controllers::proxy::metrics::RemediationGauge;
    use proxy_operator::controllers::proxy::{ReconcilerMetrics, Share};

    let (store, mut writer) = kube::runtime::reflector::store::<Proxy>();
    writer.apply_watcher_event(&Event::Init);
    for proxy in [
        managed("a", "local", false),
        managed("b", "local", false),
        managed("c", "local", true),
        managed("d", "gcp-eu", true),
    ] {
        writer.apply_watcher_event(&Event::InitApply(proxy));
    }
    writer.apply_watcher_event(&Event::InitDone);
    let registry = Registry::new();
    let fleet = ReconcilerMetrics::register(&registry).unwrap();
    RemediationGauge::register(
        &registry,
        store,
        vec!["local".to_owned(), "gcp-eu".to_owned()],
        Share::Percent(40),
    )
    .unwrap();
    fleet.disruption_started("spec_change");
    fleet.disruption_started("deleted");
    fleet.drain_timed_out();
    drop(fleet.reconcile_timer());
    fleet.action_decided("running");
    fleet.reconcile_failed("kube");
    let scrape = || {
        let mut buffer = Vec::new();
        TextEncoder::new()
            .encode(&registry.gather(), &mut buffer)
            .unwrap();
        let text = String::from_utf8(buffer).unwrap();
        promtool_check(&text);
        text
    };

    // 2 of 3 is more than 40 %: remediation of `local` is paused; `gcp-eu` is not.
    let text = scrape();
    let value = |series: &str| line_value(&text, series);
    assert_eq!(
        value(r#"proxy_operator_remediation_paused{provider="local"}"#),
        Some(1.0)
    );
    assert_eq!(
        value(r#"proxy_operator_remediation_paused{provider="gcp-eu"}"#),
        Some(0.0)
    );
    assert_eq!(
        value(r#"proxy_operator_disruptions_total{reason="spec_change"}"#),
        Some(1.0)
    );
    assert_eq!(
        value(r#"proxy_operator_disruptions_total{reason="deleted"}"#),
        Some(1.0)
    );
    assert_eq!(
        value(r#"proxy_operator_disruptions_total{reason="unhealthy"}"#),
        Some(0.0),
        "every reason is exported from the start"
    );
    assert_eq!(value("proxy_operator_drain_timeouts_total"), Some(1.0));
    assert_eq!(
        value("proxy_operator_reconcile_duration_seconds_count"),
        Some(1.0)
    );
    assert_eq!(
        value(r#"proxy_operator_reconcile_actions_total{action="running"}"#),
        Some(1.0)
    );
    assert_eq!(
        value(r#"proxy_operator_reconcile_actions_total{action="add_finalizer"}"#),
        Some(0.0),
        "every action is exported from the start"
    );
    assert_eq!(
        value(r#"proxy_operator_reconcile_errors_total{kind="kube"}"#),
        Some(1.0)
    );
    assert_eq!(
        value(r#"proxy_operator_reconcile_errors_total{kind="missing_field"}"#),
        Some(0.0)
    );

    // One recovers: 1 of 3 is not more than 40 %, and the next scrape says so.
    writer.apply_watcher_event(&Event::Apply(managed("b", "local", true)));
    let text = scrape();
    assert_eq!(
        line_value(
            &text,
            r#"proxy_operator_remediation_paused{provider="local"}"#
        ),
        Some(0.0)
    );
}
