//! `/metrics` as Prometheus scrapes it: a real metrics server over the registry the binary
//! builds, fed by the real health engine probing through a real squid, checked by
//! `promtool check metrics` (required when `CI` is set), and its size at 10,000 proxies.

mod support;

use std::io::Write as _;
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use prometheus::{Encoder, Registry, TextEncoder};
use proxy_operator::health::{
    EngineConfig, HealthEngine, HealthSnapshot, ProbeErrorKind, ProbeMetrics, ProbeResult,
    ProxyHealth,
};
use proxy_operator::inventory::Inventory;
use proxy_operator::ledger::{
    AcquireOutcome, AcquireRequest, Candidate, Clock, Ledger, LedgerConfig, SystemClock,
};
use proxy_operator::metrics::{self, FleetCollector, LeaseMetrics};
use proxy_operator::proxy::{Proxy, ProxyId};
use support::{DEADLINE, Squid, Target};
use tokio_util::sync::CancellationToken;

/// An External proxy `name` at `port` probing `probe_url`.
fn proxy(name: &str, port: u16, probe_url: &str) -> Proxy {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "crawl.example.com/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": name, "namespace": "crawl", "uid": format!("uid-{name}")},
        "spec": {
            "mode": "External",
            "endpoint": {"host": "127.0.0.1", "port": port},
            "maxLeases": 2,
            "healthCheck": {
                "probeURL": probe_url, "interval": "100ms", "timeout": "5s",
                "successThreshold": 1, "failureThreshold": 1,
            },
        },
    }))
    .unwrap()
}

/// The registry the process builds: probe, lease and fleet metrics plus the process collector.
fn registry(
    inventory: &Inventory,
    health: &HealthSnapshot,
    ledger: &Ledger,
) -> (Registry, ProbeMetrics) {
    let registry = Registry::new();
    let probes = ProbeMetrics::register(&registry).unwrap();
    LeaseMetrics::register(&registry).unwrap();
    let fleet = FleetCollector::new(inventory.clone(), health.clone(), ledger.clone()).unwrap();
    registry.register(Box::new(fleet)).unwrap();
    registry
        .register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))
        .unwrap();
    (registry, probes)
}

fn open_ledger(dir: &tempfile::TempDir) -> Ledger {
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    Ledger::open(
        &dir.path().join("ledger.db"),
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
            assert!(
                std::env::var_os("CI").is_none(),
                "promtool is not on PATH (apt-get install prometheus)"
            );
            eprintln!("promtool not found: skipping `promtool check metrics`");
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
            candidates: vec![Candidate {
                proxy: Arc::new(ProxyId {
                    namespace: "crawl".into(),
                    name: "up".into(),
                    uid: "uid-up".into(),
                }),
                max_leases: 2,
                healthy: true,
                cordoned: false,
                latency: None,
            }]
            .into(),
            target: None,
            ttl: Duration::from_secs(60),
            request: None,
        })
        .await
        .unwrap();
    assert!(matches!(outcome, AcquireOutcome::Granted(_)));

    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/metrics", listener.local_addr().unwrap());
    let server = metrics::serve(listener, registry).unwrap();
    let handle = server.handle();
    tokio::spawn(server);
    let client = reqwest::Client::new();
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
            ) == Some(0.0);
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
        (r#"proxy_operator_proxies{phase="Ready"}"#, Some(1.0)),
        (r#"proxy_operator_proxies{phase="Unhealthy"}"#, Some(1.0)),
        ("proxy_operator_ledger_full_total", Some(0.0)),
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
