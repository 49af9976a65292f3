//! The health engine: a long-lived task that probes every proxy of the inventory on its own
//! interval, applies the thresholds, publishes the [`HealthSnapshot`] and pushes health
//! *transitions* to the reconciler (the only status writer).
//!
//! One scheduler loop owns all state. It syncs with the inventory as soon as the inventory
//! changes, woken by its change notification rather than the tick, so a new proxy or a new
//! address (a pool's member waking up) is probed at once (the proxies of the first complete
//! inventory get a first probe time jittered over one interval, so a restart does not probe
//! the whole fleet at once; vanished ones are pruned together with their snapshot entry and
//! metric series); on every tick it queues the proxies whose re-probe is due. At most
//! `workers` probes run at once, and a proxy that is queued or in flight is never queued
//! again. A proxy not yet probed at its address (new, or moved) is queued ahead of the
//! re-probes: with a large fleet the workers can be busy with re-probes for a while, and a new
//! proxy's first verdict is what makes it Ready (and what an External proxy's first status
//! write waits for).
//! Transitions are sent with `try_send`: a full channel never stalls probing, and the transition
//! stays pending (not marked as reported) so the next probe of that proxy retries it.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::Rng;
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;
use tokio::task::Id as TaskId;
use tokio::task::{AbortHandle, JoinSet};
use tokio_util::sync::CancellationToken;

use super::metrics::ProbeMetrics;
use super::probe::{ProbeClient, ProbeResult, ProbeSettings, ProbeTls};
use super::snapshot::{HealthSnapshot, LastFailure, ProxyHealth};
use super::thresholds::{HealthState, Thresholds};
use crate::credentials::CredentialStore;
use crate::inventory::{Inventory, InventorySnapshot};
use crate::resources::proxy::{Proxy, ProxyId};

/// Default number of concurrent probes (`--health-workers`).
pub const DEFAULT_WORKERS: usize = 8;
/// Default scheduler tick: how often due re-probes are looked for.
pub const DEFAULT_TICK: Duration = Duration::from_secs(1);

/// How the engine runs.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Maximum number of probes in flight at once (`--health-workers`; at least 1).
    pub workers: usize,
    /// How often the scheduler looks for proxies due a re-probe (at least 1 ms). Inventory
    /// changes do not wait for it.
    pub tick: Duration,
    /// Extra trusted root certificates (DER) for `https://` probe URLs, on top of the system
    /// roots.
    pub extra_root_certs: Vec<Vec<u8>>,
    /// The upstream credentials probes send to proxies that ask for them, read at each probe.
    pub credentials: CredentialStore,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            workers: DEFAULT_WORKERS,
            tick: DEFAULT_TICK,
            extra_root_certs: Vec::new(),
            credentials: CredentialStore::default(),
        }
    }
}

/// A health change worth a status write, pushed to the reconciler.
#[derive(Debug, Clone, PartialEq)]
pub struct HealthTransition {
    /// The proxy.
    pub id: ProxyId,
    /// Thresholded health.
    pub healthy: bool,
    /// Latency of the probe that caused the transition.
    pub latency: Duration,
    /// When that probe finished.
    pub at: jiff::Timestamp,
    /// Human-readable outcome of that probe (the failure, or the status and latency).
    pub message: String,
    /// `http://host:port` the probe went through: a verdict is about one address, not about
    /// whichever machine the proxy has by the time it is written.
    pub proxy_url: String,
}

/// The engine task; build it with [`HealthEngine::new`] and drive it with [`HealthEngine::run`].
#[derive(Debug)]
pub struct HealthEngine {
    workers: usize,
    tick: Duration,
    inventory: Inventory,
    scheduler: Scheduler,
}

impl HealthEngine {
    /// Prepares the engine. The TLS roots are loaded here, once for all probes.
    pub fn new(
        config: EngineConfig,
        inventory: Inventory,
        snapshot: HealthSnapshot,
        metrics: ProbeMetrics,
        transitions: mpsc::Sender<HealthTransition>,
    ) -> Self {
        HealthEngine {
            workers: config.workers.max(1),
            // A zero period would make the ticker panic.
            tick: config.tick.max(Duration::from_millis(1)),
            inventory,
            scheduler: Scheduler {
                tls: ProbeTls::new(&config.extra_root_certs),
                credentials: config.credentials,
                tracked: HashMap::new(),
                started: false,
                first: VecDeque::new(),
                ready: VecDeque::new(),
                snapshot,
                metrics,
                transitions,
            },
        }
    }

    /// Probes until `shutdown` is cancelled; probes still in flight are then abandoned.
    pub async fn run(self, shutdown: CancellationToken) {
        let HealthEngine {
            workers,
            tick,
            inventory,
            mut scheduler,
        } = self;
        let mut ticker = tokio::time::interval(tick);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut probes: JoinSet<(ProxyId, ProbeResult)> = JoinSet::new();
        let mut changes = inventory.subscribe();
        // The set as it is now is synced first.
        changes.mark_changed();
        log::info!("health engine started with {workers} workers");
        loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                // Never an error: `inventory` keeps the sender.
                Ok(()) = changes.changed() => {
                    let now = Instant::now();
                    let current = changes.borrow_and_update().clone();
                    scheduler.sync(&current, now);
                    scheduler.queue_due(now);
                }
                _ = ticker.tick() => scheduler.queue_due(Instant::now()),
                Some(joined) = probes.join_next_with_id(), if !probes.is_empty() => match joined {
                    Ok((task, (id, result))) => scheduler.record(task, &id, &result, Instant::now()),
                    Err(e) if e.is_cancelled() => {}
                    Err(e) => log::error!("a health probe task failed: {e}"),
                },
            }
            scheduler.dispatch(&mut probes, workers, Instant::now());
        }
        probes.abort_all();
        log::info!("health engine stopped");
    }
}

/// One proxy the engine probes.
#[derive(Debug)]
struct Tracked {
    /// The object it was last synced from: the inventory hands the same `Arc` again while the
    /// Proxy is unchanged, so a sync skips it.
    source: Arc<Proxy>,
    client: ProbeClient,
    thresholds: Thresholds,
    interval: Duration,
    state: HealthState,
    next_due: Instant,
    queued: bool,
    /// Whether a probe of the current address has finished (a first probe jumps the queue).
    probed: bool,
    in_flight: Option<AbortHandle>,
    /// The most recent failure at the current address.
    last_failure: Option<LastFailure>,
}

/// What a spec change means for a tracked proxy's probe client and health.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refresh {
    /// Same probe settings: keep the client.
    Keep,
    /// Same address, other probe settings (URL, timeout, statuses): rebuild the client, keep
    /// the health.
    Rebuild,
    /// The probe address changed (endpoint host or port, a Managed proxy's IP): rebuild the
    /// client, forget the health of the old address and probe the new one at once.
    Readdress,
}

impl Refresh {
    fn plan(old: &ProbeSettings, new: &ProbeSettings) -> Refresh {
        if old.proxy_url != new.proxy_url {
            Refresh::Readdress
        } else if old != new {
            Refresh::Rebuild
        } else {
            Refresh::Keep
        }
    }
}

impl Tracked {
    /// Picks up spec changes; the client is rebuilt only when its settings changed. Returns
    /// whether the probe address changed, in which case the state is reset to unknown, the
    /// probe in flight (of the old address) is abandoned and the proxy is due at `now`.
    fn refresh(
        &mut self,
        proxy: &Proxy,
        settings: ProbeSettings,
        tls: &ProbeTls,
        now: Instant,
    ) -> bool {
        let check = proxy.spec.health_check();
        self.thresholds = Thresholds::of(check);
        self.interval = check.interval();
        let plan = Refresh::plan(self.client.settings(), &settings);
        if plan != Refresh::Keep {
            self.client = ProbeClient::new(settings, tls);
        }
        if plan != Refresh::Readdress {
            return false;
        }
        self.state = HealthState::seeded(None);
        self.last_failure = None;
        self.probed = false;
        // Its result is dropped by `record`, which only accepts the task in `in_flight`.
        if let Some(probe) = self.in_flight.take() {
            probe.abort();
        }
        self.next_due = now;
        true
    }
}

/// The engine's state, owned by the scheduler loop.
#[derive(Debug)]
struct Scheduler {
    tls: ProbeTls,
    credentials: CredentialStore,
    tracked: HashMap<ProxyId, Tracked>,
    /// Whether a complete inventory has been synced: proxies tracked after that are new to the
    /// fleet and probed at once rather than jittered.
    started: bool,
    /// Due proxies not yet probed at their address, dispatched before `ready`.
    first: VecDeque<ProxyId>,
    /// Due proxies to probe again.
    ready: VecDeque<ProxyId>,
    snapshot: HealthSnapshot,
    metrics: ProbeMetrics,
    transitions: mpsc::Sender<HealthTransition>,
}

impl Scheduler {
    /// Starts tracking new proxies, refreshes changed ones and prunes vanished ones.
    fn sync(&mut self, inventory: &InventorySnapshot, now: Instant) {
        let mut live = HashSet::with_capacity(inventory.len());
        for (id, proxy) in inventory.entries() {
            if let Some(tracked) = self.tracked.get(id)
                && Arc::ptr_eq(&tracked.source, proxy)
            {
                live.insert(id.clone());
                continue;
            }
            let Some(settings) = ProbeSettings::for_proxy(proxy) else {
                continue;
            };
            live.insert(id.clone());
            match self.tracked.get_mut(id) {
                Some(tracked) => {
                    tracked.source = proxy.clone();
                    if tracked.refresh(proxy, settings, &self.tls, now) {
                        log::info!("{id} has a new address; its health starts as unknown");
                        self.metrics.remove(&id.namespace, &id.name);
                        self.snapshot.set(id.clone(), ProxyHealth::default());
                    }
                }
                None => self.track(id.clone(), proxy, settings, now),
            }
        }
        self.prune(&live);
        self.started |= inventory.is_synced();
    }

    fn track(&mut self, id: ProxyId, proxy: &Arc<Proxy>, settings: ProbeSettings, now: Instant) {
        let check = proxy.spec.health_check();
        let interval = check.interval();
        let seed = proxy.status.as_ref().and_then(|s| s.healthy());
        let jitter = if interval.is_zero() || self.started {
            Duration::ZERO
        } else {
            rand::rng().random_range(Duration::ZERO..interval)
        };
        self.snapshot.set(
            id.clone(),
            ProxyHealth {
                healthy: seed,
                ..ProxyHealth::default()
            },
        );
        self.tracked.insert(
            id,
            Tracked {
                source: proxy.clone(),
                client: ProbeClient::new(settings, &self.tls),
                thresholds: Thresholds::of(check),
                interval,
                state: HealthState::seeded(seed),
                next_due: now + jitter,
                queued: false,
                probed: false,
                in_flight: None,
                last_failure: None,
            },
        );
    }

    fn prune(&mut self, live: &HashSet<ProxyId>) {
        let gone: Vec<ProxyId> = self
            .tracked
            .keys()
            .filter(|id| !live.contains(*id))
            .cloned()
            .collect();
        for id in &gone {
            if let Some(Tracked {
                in_flight: Some(probe),
                ..
            }) = self.tracked.remove(id)
            {
                probe.abort();
            }
            // A re-created Proxy (same name, new UID) keeps using the name's series.
            let name_still_used = live
                .iter()
                .any(|other| other.namespace == id.namespace && other.name == id.name);
            if !name_still_used {
                self.metrics.remove(&id.namespace, &id.name);
            }
        }
        if !gone.is_empty() {
            self.first.retain(|id| live.contains(id));
            self.ready.retain(|id| live.contains(id));
            self.snapshot.retain(|id| live.contains(id));
        }
    }

    /// Queues every proxy that is due and neither queued nor in flight: first probes in
    /// `first`, the others in `ready`.
    fn queue_due(&mut self, now: Instant) {
        for (id, tracked) in &mut self.tracked {
            if tracked.next_due <= now && !tracked.queued && tracked.in_flight.is_none() {
                tracked.queued = true;
                let queue = if tracked.probed {
                    &mut self.ready
                } else {
                    &mut self.first
                };
                queue.push_back(id.clone());
            }
        }
    }

    /// The queued proxy to probe next: first probes before re-probes.
    fn next_queued(&mut self) -> Option<ProxyId> {
        self.first.pop_front().or_else(|| self.ready.pop_front())
    }

    /// Starts queued probes while fewer than `workers` are in flight.
    fn dispatch(
        &mut self,
        probes: &mut JoinSet<(ProxyId, ProbeResult)>,
        workers: usize,
        now: Instant,
    ) {
        while probes.len() < workers {
            let Some(id) = self.next_queued() else {
                return;
            };
            let Some(tracked) = self.tracked.get_mut(&id) else {
                continue;
            };
            if !tracked.queued || tracked.in_flight.is_some() {
                continue;
            }
            tracked.queued = false;
            tracked.next_due += tracked.interval;
            if tracked.next_due <= now {
                // Fell behind (saturated pool): skip the missed slots instead of bursting.
                tracked.next_due = now + tracked.interval;
            }
            let client = tracked.client.clone();
            let credentials = client.settings().upstream_credentials(&self.credentials);
            let handle =
                probes.spawn(async move { (id, client.probe(credentials.as_ref()).await) });
            tracked.in_flight = Some(handle);
        }
    }

    /// Applies one probe result: metrics, thresholds, snapshot, and a transition if one is due.
    /// A result of a probe the proxy no longer waits for (it vanished meanwhile) is dropped.
    fn record(&mut self, task: TaskId, id: &ProxyId, result: &ProbeResult, now: Instant) {
        let Some(tracked) = self.tracked.get_mut(id) else {
            return;
        };
        if tracked.in_flight.as_ref().map(AbortHandle::id) != Some(task) {
            return;
        }
        tracked.in_flight = None;
        tracked.probed = true;
        let at = jiff::Timestamp::now();
        let report =
            tracked
                .state
                .observe(result.is_success(), result.latency, now, tracked.thresholds);
        self.metrics.observe(id, result, tracked.state.healthy());
        if let Err(e) = &result.outcome {
            tracked.last_failure = Some(LastFailure {
                kind: e.kind,
                status: e.status,
                at,
            });
        }
        self.snapshot.set(
            id.clone(),
            ProxyHealth {
                healthy: tracked.state.healthy(),
                latency: Some(result.latency),
                last_probe: Some(at),
                last_error: result.outcome.as_ref().err().map(ToString::to_string),
                last_failure: tracked.last_failure,
            },
        );
        let Some(report) = report else {
            return;
        };
        let message = match &result.outcome {
            Ok(status) => format!(
                "probe answered {status} in {} ms",
                result.latency.as_millis()
            ),
            Err(e) => e.to_string(),
        };
        let transition = HealthTransition {
            id: id.clone(),
            healthy: report.healthy,
            latency: result.latency,
            at,
            message,
            proxy_url: tracked.client.settings().proxy_url.clone(),
        };
        match self.transitions.try_send(transition) {
            Ok(()) => tracked.state.mark_reported(result.latency, now),
            Err(TrySendError::Full(t)) => {
                log::debug!("transition channel full, {} stays pending", t.id);
            }
            Err(TrySendError::Closed(t)) => {
                log::debug!("no transition receiver, {} stays pending", t.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use prometheus::Registry;

    use super::*;
    use crate::health::probe::{ProbeError, ProbeErrorKind};

    fn settings(proxy_url: &str, probe_url: &str, timeout_ms: u64) -> ProbeSettings {
        ProbeSettings {
            proxy_url: proxy_url.into(),
            probe_url: probe_url.into(),
            timeout: Duration::from_millis(timeout_ms),
            expected_status_codes: vec![204],
            credentials: None,
            vendor: None,
        }
    }

    #[test]
    fn only_an_address_change_resets_the_health() {
        let base = settings("http://10.0.0.1:3128", "https://t/", 5000);
        let cases = [
            ("same settings", base.clone(), Refresh::Keep),
            (
                "other port",
                settings("http://10.0.0.1:3129", "https://t/", 5000),
                Refresh::Readdress,
            ),
            (
                "other host",
                settings("http://10.0.0.2:3128", "https://t/", 5000),
                Refresh::Readdress,
            ),
            (
                "other host and probe URL",
                settings("http://10.0.0.2:3128", "https://u/", 5000),
                Refresh::Readdress,
            ),
            (
                "other probe URL",
                settings("http://10.0.0.1:3128", "https://u/", 5000),
                Refresh::Rebuild,
            ),
            (
                "other timeout",
                settings("http://10.0.0.1:3128", "https://t/", 100),
                Refresh::Rebuild,
            ),
            (
                "other statuses",
                ProbeSettings {
                    expected_status_codes: vec![200],
                    ..base.clone()
                },
                Refresh::Rebuild,
            ),
        ];
        for (name, new, want) in cases {
            assert_eq!(Refresh::plan(&base, &new), want, "{name}");
        }
    }

    /// An External proxy at `host:port`, or a Managed one whose status has `ip`.
    fn proxy(endpoint: Option<(&str, u16)>, managed_ip: Option<&str>, timeout: &str) -> Proxy {
        let check =
            serde_json::json!({"probeURL": "https://t/", "interval": "1h", "timeout": timeout});
        let mut value = match endpoint {
            Some((host, port)) => serde_json::json!({
                "spec": {"mode": "External", "endpoint": {"host": host, "port": port}, "healthCheck": check},
            }),
            None => serde_json::json!({
                "spec": {"mode": "Managed", "provider": "local", "healthCheck": check},
                "status": {"ip": managed_ip},
            }),
        };
        if let Some(object) = value.as_object_mut() {
            object.insert("apiVersion".into(), "crawl.example.com/v1alpha1".into());
            object.insert("kind".into(), "Proxy".into());
            object.insert(
                "metadata".into(),
                serde_json::json!({"name": "p", "namespace": "crawl", "uid": "uid-p"}),
            );
        }
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn first_probes_go_ahead_of_re_probes() {
        let named = |name: &str| {
            let mut proxy = proxy(Some(("127.0.0.1", 3128)), None, "5s");
            proxy.metadata.name = Some(name.to_owned());
            proxy.metadata.uid = Some(format!("uid-{name}"));
            proxy
        };
        let mut scheduler = scheduler();
        let t0 = Instant::now();
        let inventory = Inventory::new();
        inventory.replace([named("a-probed"), named("b-probed")]);
        scheduler.sync(&inventory.snapshot(), t0);
        for tracked in scheduler.tracked.values_mut() {
            tracked.probed = true;
        }
        inventory.replace([named("a-probed"), named("b-probed"), named("c-new")]);
        scheduler.sync(&inventory.snapshot(), t0);
        scheduler.queue_due(t0);
        let mut order = Vec::new();
        while let Some(id) = scheduler.next_queued() {
            order.push(id.name);
        }
        let (first, rest) = order.split_first().unwrap();
        assert_eq!(first, "c-new", "the new proxy is probed first: {order:?}");
        let mut rest = rest.to_vec();
        rest.sort();
        assert_eq!(rest, ["a-probed", "b-probed"]);
    }

    fn scheduler() -> Scheduler {
        let (transitions, _) = mpsc::channel(8);
        Scheduler {
            credentials: Default::default(),
            tls: ProbeTls::new(&[]),
            tracked: HashMap::new(),
            started: true,
            first: VecDeque::new(),
            ready: VecDeque::new(),
            snapshot: HealthSnapshot::new(),
            metrics: ProbeMetrics::register(&Registry::new()).unwrap(),
            transitions,
        }
    }

    fn failure(kind: ProbeErrorKind) -> ProbeResult {
        ProbeResult {
            outcome: Err(ProbeError {
                kind,
                status: None,
                message: "down".into(),
            }),
            latency: Duration::from_millis(3),
        }
    }

    /// (name, proxy before, proxy after, whether the health starts over).
    #[tokio::test]
    async fn a_changed_address_starts_unknown_and_drops_the_old_probe() {
        let cases = [
            (
                "external port",
                proxy(Some(("127.0.0.1", 3128)), None, "5s"),
                proxy(Some(("127.0.0.1", 3129)), None, "5s"),
                true,
            ),
            (
                "external host",
                proxy(Some(("127.0.0.1", 3128)), None, "5s"),
                proxy(Some(("127.0.0.2", 3128)), None, "5s"),
                true,
            ),
            (
                "managed IP",
                proxy(None, Some("10.0.0.1"), "5s"),
                proxy(None, Some("10.0.0.2"), "5s"),
                true,
            ),
            (
                "timeout only",
                proxy(Some(("127.0.0.1", 3128)), None, "5s"),
                proxy(Some(("127.0.0.1", 3128)), None, "2s"),
                false,
            ),
        ];
        for (name, before, after, reset) in cases {
            let mut scheduler = scheduler();
            let id = before.id();
            let t0 = Instant::now();
            let inventory = Inventory::new();
            inventory.replace([before]);
            scheduler.sync(&inventory.snapshot(), t0);
            // Healthy after two successes, then a probe of the old address in flight.
            let mut probes: JoinSet<(ProxyId, ProbeResult)> = JoinSet::new();
            let pending = id.clone();
            let handle = probes.spawn(async move {
                std::future::pending::<()>().await;
                (pending, failure(ProbeErrorKind::Other))
            });
            let old_task = handle.id();
            let tracked = scheduler.tracked.get_mut(&id).unwrap();
            tracked.state = HealthState::seeded(Some(true));
            tracked.next_due = t0 + Duration::from_secs(3600);
            tracked.in_flight = Some(handle);
            tracked.last_failure = Some(LastFailure {
                kind: ProbeErrorKind::Timeout,
                status: None,
                at: jiff::Timestamp::now(),
            });
            let healthy = ProxyHealth {
                healthy: Some(true),
                latency: Some(Duration::from_millis(12)),
                ..ProxyHealth::default()
            };
            scheduler.snapshot.set(id.clone(), healthy.clone());

            let t1 = t0 + Duration::from_secs(1);
            inventory.replace([after]);
            scheduler.sync(&inventory.snapshot(), t1);
            let tracked = &scheduler.tracked[&id];
            if !reset {
                assert_eq!(tracked.state.healthy(), Some(true), "{name}");
                assert!(tracked.in_flight.is_some(), "{name}");
                assert_eq!(scheduler.snapshot.get(&id), Some(healthy), "{name}");
                continue;
            }
            assert_eq!(tracked.state, HealthState::seeded(None), "{name}");
            assert_eq!(tracked.last_failure, None, "{name}");
            assert!(tracked.in_flight.is_none(), "{name}");
            assert_eq!(tracked.next_due, t1, "{name}: probed at once");
            assert_eq!(
                scheduler.snapshot.get(&id),
                Some(ProxyHealth::default()),
                "{name}"
            );
            // The old probe was aborted, and a result of it is ignored anyway.
            let joined = probes.join_next().await.unwrap();
            assert!(joined.is_err_and(|e| e.is_cancelled()), "{name}");
            scheduler.record(old_task, &id, &failure(ProbeErrorKind::ConnectRefused), t1);
            assert_eq!(
                scheduler.snapshot.get(&id),
                Some(ProxyHealth::default()),
                "{name}"
            );
            scheduler.queue_due(t1);
            assert_eq!(scheduler.first, VecDeque::from([id.clone()]), "{name}");
        }
    }
}
