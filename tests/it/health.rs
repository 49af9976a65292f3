//! The probe and the health engine against a real squid and a real loopback target.

use crate::support;

use std::time::{Duration, Instant};

use prometheus::Registry;
use proxy_operator::health::{
    EngineConfig, HealthEngine, HealthSnapshot, HealthTransition, ProbeClient, ProbeErrorKind,
    ProbeMetrics, ProbeSettings, ProbeTls,
};
use proxy_operator::inventory::Inventory;
use proxy_operator::resources::proxy::{Proxy, ProxyId};
use support::{DEADLINE, Squid, SquidOptions, Target, wait_until};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

fn settings(squid: &Squid, probe_url: String, timeout: Duration) -> ProbeSettings {
    ProbeSettings {
        credentials: None,
        vendor: None,
        proxy_url: squid.url(),
        probe_url,
        timeout,
        expected_status_codes: vec![200, 204],
    }
}

/// A probe client through `squid` that trusts the target's CA.
fn client(squid: &Squid, target: &Target, probe_url: String) -> ProbeClient {
    let tls = ProbeTls::new(&[target.ca_cert_der()]);
    ProbeClient::new(settings(squid, probe_url, Duration::from_secs(10)), &tls)
}

fn error_kind(result: &proxy_operator::health::ProbeResult) -> ProbeErrorKind {
    result
        .outcome
        .as_ref()
        .expect_err("the probe must fail")
        .kind
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_probe_tunnels_through_squid_on_a_fresh_connection_every_time() {
    let squid = Squid::start();
    let target = Target::start();
    let client = client(&squid, &target, target.https_url());
    for _ in 0..3 {
        let result = client.probe(None).await;
        assert_eq!(result.outcome, Ok(204));
        assert!(result.latency > Duration::ZERO);
    }
    assert_eq!(target.connections(), 3, "one connection per probe");
    wait_until("three CONNECT tunnels in squid's access log", || {
        squid.access_log().matches(" CONNECT ").count() == 3
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_probe_is_forwarded_and_any_expected_status_succeeds() {
    let squid = Squid::start();
    let target = Target::start();
    target.set_status(200);
    let client = client(&squid, &target, target.http_url());
    assert_eq!(client.probe(None).await.outcome, Ok(200));
    wait_until("the forwarded GET in squid's access log", || {
        squid
            .access_log()
            .contains(&format!(" GET {}", target.http_url()))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unexpected_status_fails_with_the_status() {
    let squid = Squid::start();
    let target = Target::start();
    target.set_status(500);
    for url in [target.http_url(), target.https_url()] {
        let err = client(&squid, &target, url.clone())
            .probe(None)
            .await
            .outcome
            .unwrap_err();
        assert_eq!(err.kind, ProbeErrorKind::UnexpectedStatus, "{url}: {err}");
        assert_eq!(err.status, Some(500), "{url}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_proxy_is_connect_refused() {
    let mut squid = Squid::start();
    let target = Target::start();
    squid.kill();
    for url in [target.http_url(), target.https_url()] {
        let result = client(&squid, &target, url.clone()).probe(None).await;
        assert_eq!(error_kind(&result), ProbeErrorKind::ConnectRefused, "{url}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connect_is_an_error_not_a_response() {
    let squid = Squid::start_with(SquidOptions {
        deny_connect: true,
        ..Default::default()
    });
    let target = Target::start();
    let result = client(&squid, &target, target.https_url())
        .probe(None)
        .await;
    let err = result.outcome.unwrap_err();
    assert_eq!(err.kind, ProbeErrorKind::ConnectTunnelRefused, "{err}");
    assert_eq!(err.status, None);
    // The same proxy still forwards plain HTTP: only CONNECT is denied.
    let plain = client(&squid, &target, target.http_url()).probe(None).await;
    assert_eq!(plain.outcome, Ok(204));
    assert_eq!(
        target.connections(),
        1,
        "the tunnel never reached the target"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_that_cannot_reach_the_target_fails_both_ways() {
    let squid = Squid::start();
    let target = Target::start();
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let https = client(&squid, &target, format!("https://127.0.0.1:{closed}/"))
        .probe(None)
        .await;
    assert_eq!(error_kind(&https), ProbeErrorKind::ConnectTunnelRefused);
    // For http:// URLs the proxy's failure arrives as its own response.
    let http = client(&squid, &target, format!("http://127.0.0.1:{closed}/"))
        .probe(None)
        .await;
    let err = http.outcome.unwrap_err();
    assert_eq!(err.kind, ProbeErrorKind::UnexpectedStatus);
    assert_eq!(err.status, Some(503));
    assert!(err.message.contains("proxy error"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_target_times_out_at_the_probe_timeout() {
    let squid = Squid::start();
    let target = Target::start();
    target.set_delay(Duration::from_secs(10));
    let tls = ProbeTls::new(&[target.ca_cert_der()]);
    let timeout = Duration::from_millis(400);
    let client = ProbeClient::new(settings(&squid, target.https_url(), timeout), &tls);
    let result = client.probe(None).await;
    assert_eq!(error_kind(&result), ProbeErrorKind::Timeout);
    assert!(result.latency >= timeout, "{:?}", result.latency);
    assert!(
        result.latency < Duration::from_secs(5),
        "{:?}",
        result.latency
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_certificate_is_a_tls_error() {
    let squid = Squid::start();
    let target = Target::start();
    let client = ProbeClient::new(
        settings(&squid, target.https_url(), Duration::from_secs(10)),
        &ProbeTls::new(&[]),
    );
    let result = client.probe(None).await;
    assert_eq!(error_kind(&result), ProbeErrorKind::Tls, "{result:?}");
}

// ---- the engine ----

/// An External proxy through `squid_port` probing `probe_url`, with `health_check` overrides.
fn proxy(
    name: &str,
    uid: &str,
    squid_port: u16,
    probe_url: &str,
    health_check: serde_json::Value,
) -> Proxy {
    let mut check =
        serde_json::json!({"probeURL": probe_url, "interval": "100ms", "timeout": "5s"});
    if let (Some(check), Some(overrides)) = (check.as_object_mut(), health_check.as_object()) {
        check.extend(overrides.clone());
    }
    serde_json::from_value(serde_json::json!({
        "apiVersion": "crawl.example.com/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": name, "namespace": "crawl", "uid": uid},
        "spec": {
            "mode": "External",
            "endpoint": {"host": "127.0.0.1", "port": squid_port},
            "healthCheck": check,
        },
    }))
    .unwrap()
}

struct Running {
    inventory: Inventory,
    snapshot: HealthSnapshot,
    registry: Registry,
    transitions: mpsc::Receiver<HealthTransition>,
    sender: mpsc::Sender<HealthTransition>,
    shutdown: CancellationToken,
    task: JoinHandle<()>,
}

impl Running {
    fn start(target: &Target, proxies: Vec<Proxy>, channel: usize) -> Running {
        Running::start_ticking(target, proxies, channel, Duration::from_millis(20))
    }

    /// [`Running::start`] with the scheduler's `tick`.
    fn start_ticking(
        target: &Target,
        proxies: Vec<Proxy>,
        channel: usize,
        tick: Duration,
    ) -> Running {
        let inventory = Inventory::new();
        inventory.replace(proxies);
        let snapshot = HealthSnapshot::new();
        let registry = Registry::new();
        let metrics = ProbeMetrics::register(&registry).unwrap();
        let (sender, transitions) = mpsc::channel(channel);
        let config = EngineConfig {
            credentials: Default::default(),
            workers: 4,
            tick,
            extra_root_certs: vec![target.ca_cert_der()],
        };
        let engine = HealthEngine::new(
            config,
            inventory.clone(),
            snapshot.clone(),
            metrics,
            sender.clone(),
        );
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(engine.run(shutdown.clone()));
        Running {
            inventory,
            snapshot,
            registry,
            transitions,
            sender,
            shutdown,
            task,
        }
    }

    async fn next_transition(&mut self) -> HealthTransition {
        tokio::time::timeout(DEADLINE, self.transitions.recv())
            .await
            .expect("a transition within the deadline")
            .expect("the engine keeps the channel open")
    }

    /// `proxy_operator_probes_total{result}`, fleet-level (each test runs its own engine).
    fn probes(&self, result: &str) -> u64 {
        self.probes_where(|r| r == result)
    }

    /// Probes that failed, whatever their result.
    fn failed_probes(&self) -> u64 {
        self.probes_where(|r| r != "ok")
    }

    /// `proxy_operator_probes_total` summed over the results `keep` takes.
    fn probes_where(&self, keep: impl Fn(&str) -> bool) -> u64 {
        self.registry
            .gather()
            .iter()
            .filter(|family| family.name() == "proxy_operator_probes_total")
            .flat_map(|family| family.get_metric())
            .filter(|metric| {
                metric
                    .get_label()
                    .iter()
                    .any(|l| l.name() == "result" && keep(l.value()))
            })
            .map(|metric| metric.get_counter().value() as u64)
            .sum()
    }

    /// Number of per-proxy series labelled `name`.
    fn series(&self, name: &str) -> usize {
        self.registry
            .gather()
            .iter()
            .flat_map(|family| family.get_metric())
            .filter(|metric| {
                metric
                    .get_label()
                    .iter()
                    .any(|l| l.name() == "name" && l.value() == name)
            })
            .count()
    }

    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(DEADLINE, self.task)
            .await
            .expect("the engine stops on shutdown")
            .unwrap();
    }
}

fn id(name: &str, uid: &str) -> ProxyId {
    ProxyId {
        namespace: "crawl".into(),
        name: name.into(),
        uid: uid.into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_proxy_turns_healthy_after_the_success_threshold() {
    let squid = Squid::start();
    let target = Target::start();
    let p = proxy(
        "a",
        "uid-a",
        squid.port(),
        &target.https_url(),
        serde_json::json!({
            "interval": "200ms", "successThreshold": 3
        }),
    );
    let mut engine = Running::start(&target, vec![p], 16);
    let transition = engine.next_transition().await;
    assert_eq!(transition.id, id("a", "uid-a"));
    assert!(transition.healthy, "{transition:?}");
    assert!(transition.message.contains("204"), "{}", transition.message);
    assert_eq!(transition.proxy_url, squid.url(), "the address probed");
    assert!(engine.probes("ok") >= 3, "three successes before the flip");
    let health = engine.snapshot.get(&id("a", "uid-a")).unwrap();
    assert_eq!(health.healthy, Some(true));
    assert!(health.latency.is_some() && health.last_probe.is_some());
    assert_eq!(health.last_error, None);
    engine.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_squid_turns_unhealthy_and_recovers_after_restart() {
    let mut squid = Squid::start();
    let target = Target::start();
    let p = proxy(
        "a",
        "uid-a",
        squid.port(),
        &target.https_url(),
        serde_json::json!({
            "failureThreshold": 2
        }),
    );
    let mut engine = Running::start(&target, vec![p], 16);
    assert!(engine.next_transition().await.healthy);

    squid.kill();
    let down = engine.next_transition().await;
    assert!(!down.healthy, "{down:?}");
    assert!(
        down.message.starts_with("connect_refused"),
        "{}",
        down.message
    );
    // The probe in flight when squid died may fail another way (a reset tunnel); the one
    // that flips it is refused, as the message says.
    assert!(engine.failed_probes() >= 2, "two failures before the flip");
    let health = engine.snapshot.get(&id("a", "uid-a")).unwrap();
    assert_eq!(health.healthy, Some(false));
    assert!(health.last_error.unwrap().starts_with("connect_refused"));

    squid.restart();
    let up = engine.next_transition().await;
    assert!(up.healthy, "{up:?}");
    engine.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_denying_connect_is_unhealthy_with_the_connect_refused_kind() {
    let squid = Squid::start_with(SquidOptions {
        deny_connect: true,
        ..Default::default()
    });
    let target = Target::start();
    let p = proxy(
        "a",
        "uid-a",
        squid.port(),
        &target.https_url(),
        serde_json::json!({
            "failureThreshold": 1
        }),
    );
    let mut engine = Running::start(&target, vec![p], 16);
    let transition = engine.next_transition().await;
    assert!(!transition.healthy);
    assert!(
        transition.message.starts_with("connect_tunnel_refused"),
        "{}",
        transition.message
    );
    assert!(engine.probes("connect_tunnel_refused") >= 1);
    engine.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_answering_500_makes_the_proxy_unhealthy() {
    let squid = Squid::start();
    let target = Target::start();
    target.set_status(500);
    let p = proxy(
        "a",
        "uid-a",
        squid.port(),
        &target.https_url(),
        serde_json::json!({
            "failureThreshold": 2
        }),
    );
    let mut engine = Running::start(&target, vec![p], 16);
    let transition = engine.next_transition().await;
    assert!(!transition.healthy);
    assert!(
        transition.message.starts_with("unexpected_status"),
        "{}",
        transition.message
    );
    assert!(transition.message.contains("500"), "{}", transition.message);
    // Why, as the API and the status page show it: the kind and the status.
    let health = engine.snapshot.get(&id("a", "uid-a")).unwrap();
    let failure = health.unhealthy_because().expect("a last failure");
    assert_eq!(
        (failure.kind, failure.status),
        (ProbeErrorKind::UnexpectedStatus, Some(500))
    );
    engine.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_timeout_is_unhealthy_within_timeout_plus_scheduling_slack() {
    let squid = Squid::start();
    let target = Target::start();
    target.set_delay(Duration::from_secs(20));
    let p = proxy(
        "a",
        "uid-a",
        squid.port(),
        &target.https_url(),
        serde_json::json!({
            "interval": "200ms", "timeout": "500ms", "failureThreshold": 1
        }),
    );
    let started = Instant::now();
    let mut engine = Running::start(&target, vec![p], 16);
    let transition = engine.next_transition().await;
    let elapsed = started.elapsed();
    assert!(!transition.healthy);
    assert!(
        transition.message.starts_with("timeout"),
        "{}",
        transition.message
    );
    assert!(transition.latency >= Duration::from_millis(500));
    // First probe within one interval (jitter), then the 500 ms timeout, plus slack for a
    // loaded machine.
    assert!(
        elapsed < Duration::from_millis(200 + 500) + Duration::from_secs(3),
        "{elapsed:?}"
    );
    engine.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_name_different_uid_keeps_separate_counters_and_vanished_state_is_pruned() {
    let live = Squid::start();
    let mut dead = Squid::start();
    dead.kill();
    let target = Target::start();
    let thresholds = serde_json::json!({"failureThreshold": 1, "successThreshold": 1});
    let old = proxy(
        "p",
        "uid-old",
        dead.port(),
        &target.https_url(),
        thresholds.clone(),
    );
    let new = proxy("p", "uid-new", live.port(), &target.https_url(), thresholds);
    let mut engine = Running::start(&target, vec![old, new.clone()], 64);

    let mut seen = Vec::new();
    while seen.len() < 2 {
        let t = engine.next_transition().await;
        seen.retain(|s: &HealthTransition| s.id != t.id);
        seen.push(t);
    }
    seen.sort_by(|a, b| a.id.cmp(&b.id));
    assert_eq!(
        (seen[0].id.uid.as_str(), seen[0].healthy),
        ("uid-new", true)
    );
    assert_eq!(
        (seen[1].id.uid.as_str(), seen[1].healthy),
        ("uid-old", false)
    );
    // Shared counters would flip both back and forth on every probe.
    let probes_before = engine.probes("ok") + engine.probes("connect_refused");
    wait_until("ten more probes", || {
        engine.probes("ok") + engine.probes("connect_refused") >= probes_before + 10
    })
    .await;
    assert!(
        engine.transitions.try_recv().is_err(),
        "no flapping between the two objects"
    );
    assert_eq!(
        engine.snapshot.get(&id("p", "uid-old")).unwrap().healthy,
        Some(false)
    );
    assert_eq!(
        engine.snapshot.get(&id("p", "uid-new")).unwrap().healthy,
        Some(true)
    );

    // The old object goes away: its state goes, the name's metrics stay for the new one.
    engine.inventory.replace(vec![new]);
    wait_until("the old UID pruned from the snapshot", || {
        engine.snapshot.get(&id("p", "uid-old")).is_none()
    })
    .await;
    assert_eq!(
        engine.snapshot.get(&id("p", "uid-new")).unwrap().healthy,
        Some(true)
    );
    assert!(engine.probes("ok") > 0);
    assert_eq!(engine.series("p"), 2, "up and last latency");

    // The last one goes too: snapshot and metric series are gone.
    engine.inventory.replace(Vec::new());
    wait_until("the snapshot emptied", || engine.snapshot.read().is_empty()).await;
    wait_until("the series removed", || engine.series("p") == 0).await;
    engine.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_healthy_condition_seeds_the_state_with_zero_counters() {
    let mut squid = Squid::start();
    squid.kill();
    let target = Target::start();
    let mut p = proxy(
        "a",
        "uid-a",
        squid.port(),
        &target.https_url(),
        serde_json::json!({
            "failureThreshold": 3
        }),
    );
    p.status = Some(
        serde_json::from_value(serde_json::json!({
            "conditions": [{"type": "Healthy", "status": "True", "reason": "ProbeSucceeded",
                            "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]
        }))
        .unwrap(),
    );
    let mut engine = Running::start(&target, vec![p], 16);
    wait_until("the proxy in the snapshot", || {
        engine.snapshot.get(&id("a", "uid-a")).is_some()
    })
    .await;
    assert_eq!(
        engine.snapshot.get(&id("a", "uid-a")).unwrap().healthy,
        Some(true)
    );
    // The first result reports the seeded state, not a flap.
    let first = engine.next_transition().await;
    assert!(first.healthy, "{first:?}");
    // A full run of failures is still needed to flip.
    let flip = engine.next_transition().await;
    assert!(!flip.healthy);
    assert!(engine.probes("connect_refused") >= 3);
    engine.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_transition_channel_never_stalls_probing_and_the_transition_stays_pending() {
    let squid = Squid::start();
    let target = Target::start();
    let p = proxy(
        "a",
        "uid-a",
        squid.port(),
        &target.https_url(),
        serde_json::json!({}),
    );
    let mut engine = Running::start(&target, vec![p], 1);
    let filler = HealthTransition {
        id: id("filler", "uid-filler"),
        healthy: false,
        latency: Duration::ZERO,
        at: jiff::Timestamp::UNIX_EPOCH,
        message: "fills the channel".into(),
        proxy_url: "http://127.0.0.1:1".into(),
    };
    engine.sender.try_send(filler.clone()).unwrap();
    wait_until("five probes with the channel full", || {
        engine.probes("ok") >= 5
    })
    .await;
    assert_eq!(
        engine.snapshot.get(&id("a", "uid-a")).unwrap().healthy,
        Some(true)
    );

    assert_eq!(engine.next_transition().await, filler);
    let pending = engine.next_transition().await;
    assert_eq!(pending.id, id("a", "uid-a"));
    assert!(pending.healthy);
    engine.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_abandons_probes_in_flight() {
    let squid = Squid::start();
    let target = Target::start();
    target.set_delay(Duration::from_secs(60));
    let p = proxy(
        "a",
        "uid-a",
        squid.port(),
        &target.https_url(),
        serde_json::json!({
            "timeout": "60s"
        }),
    );
    let engine = Running::start(&target, vec![p], 16);
    wait_until("a probe in flight", || target.connections() >= 1).await;
    let started = Instant::now();
    engine.stop().await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_added_after_start_is_probed_at_once_not_jittered() {
    let squid = Squid::start();
    let target = Target::start();
    let early = proxy(
        "early",
        "uid-early",
        squid.port(),
        &target.https_url(),
        serde_json::json!({"interval": "100ms"}),
    );
    let mut engine = Running::start(&target, vec![early.clone()], 16);
    // The first transition proves the engine has synced the start-up inventory.
    assert_eq!(engine.next_transition().await.id, id("early", "uid-early"));
    // With a one-hour interval a jittered first probe would almost surely miss the deadline.
    let late = proxy(
        "late",
        "uid-late",
        squid.port(),
        &target.https_url(),
        serde_json::json!({"interval": "1h"}),
    );
    engine.inventory.replace(vec![early, late]);
    let transition = engine.next_transition().await;
    assert_eq!(transition.id, id("late", "uid-late"));
    assert!(transition.healthy, "{}", transition.message);
    engine.stop().await;
}

/// The inventory's change notification, not the tick, brings a new proxy and a moved address
/// to the engine. With an hour's tick (its first at start) and an hour's probe interval, each
/// is probed within the transition deadline of the change (and in milliseconds, printed); an
/// engine that looked at the inventory on its tick would wait the hour.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_proxies_and_addresses_are_probed_when_written_not_on_the_tick() {
    let first = Squid::start();
    let second = Squid::start();
    let target = Target::start();
    let url = target.https_url();
    let check = serde_json::json!({"interval": "1h"});
    let early = proxy("early", "uid-early", first.port(), &url, check.clone());
    let hour = Duration::from_secs(3600);
    let mut engine = Running::start_ticking(&target, vec![early.clone()], 16, hour);
    // Tracked (its first probe jittered over the hour, as at every start): the engine has
    // synced the start-up inventory, so what comes next is new to it.
    let early_id = id("early", "uid-early");
    wait_until("the start-up inventory synced", || {
        engine.snapshot.get(&early_id).is_some()
    })
    .await;

    let late = proxy("late", "uid-late", second.port(), &url, check.clone());
    let written = Instant::now();
    engine.inventory.replace(vec![early, late.clone()]);
    let added = engine.next_transition().await;
    let new_proxy = written.elapsed();
    assert_eq!(added.id, id("late", "uid-late"));
    assert!(added.healthy, "{}", added.message);

    let moved = proxy("early", "uid-early", second.port(), &url, check);
    let written = Instant::now();
    engine.inventory.replace(vec![moved, late]);
    let readdressed = engine.next_transition().await;
    let new_address = written.elapsed();
    assert_eq!(readdressed.id, early_id);
    assert_eq!(readdressed.proxy_url, second.url(), "{readdressed:?}");
    assert!(readdressed.healthy, "{}", readdressed.message);
    println!(
        "probed after the inventory changed: a new proxy in {:.1} ms, a new address in {:.1} \
         ms (tick and interval {hour:?})",
        new_proxy.as_secs_f64() * 1000.0,
        new_address.as_secs_f64() * 1000.0
    );
    assert!(
        engine.transitions.try_recv().is_err(),
        "nothing else probed"
    );
    engine.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_endpoint_starts_unknown_and_the_old_address_probe_is_discarded() {
    let old = Squid::start();
    let mut new = Squid::start();
    new.kill();
    let target = Target::start();
    let check = serde_json::json!({
        "interval": "300ms", "successThreshold": 1, "failureThreshold": 3
    });
    let url = target.https_url();
    let mut engine = Running::start(
        &target,
        vec![proxy("a", "uid-a", old.port(), &url, check.clone())],
        16,
    );
    assert!(engine.next_transition().await.healthy);
    let a = id("a", "uid-a");

    // A probe through the old squid that would succeed, held in flight by a slow target.
    let delay = Duration::from_secs(2);
    target.set_delay(delay);
    let before = target.connections();
    wait_until("a probe of the old address in flight", || {
        target.connections() > before
    })
    .await;
    engine
        .inventory
        .replace([proxy("a", "uid-a", new.port(), &url, check)]);
    let moved = Instant::now();
    wait_until("the snapshot forgets the old address's health", || {
        engine.snapshot.get(&a).is_some_and(|h| h.healthy.is_none())
    })
    .await;
    // Whatever is known by now comes from the new address (a probe runs at once).
    let health = engine.snapshot.get(&a).unwrap();
    if let Some(failure) = health.last_failure {
        assert_eq!(failure.kind, ProbeErrorKind::ConnectRefused, "{health:?}");
    }

    // Until well after the old probe has answered, the proxy is never healthy again: the
    // new address is dead, and the old address's success is dropped.
    let mut seen_unhealthy = false;
    while moved.elapsed() < delay + Duration::from_secs(1) || !seen_unhealthy {
        assert!(moved.elapsed() < DEADLINE, "never turned unhealthy");
        let health = engine.snapshot.get(&a).unwrap();
        assert_ne!(health.healthy, Some(true), "healthy at the dead address");
        seen_unhealthy |= health.healthy == Some(false);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let health = engine.snapshot.get(&a).unwrap();
    let failure = health.last_failure.unwrap();
    assert_eq!(failure.kind, ProbeErrorKind::ConnectRefused);
    // The first transition after the move is the flip to unhealthy at the new address.
    let down = engine.next_transition().await;
    assert!(!down.healthy, "{down:?}");
    assert!(down.message.starts_with("connect_refused"), "{down:?}");
    assert!(engine.transitions.try_recv().is_err());
    engine.stop().await;
}
