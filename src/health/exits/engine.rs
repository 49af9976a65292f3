//! The exit checker: a long-lived task that checks every proxy with a `spec.exitCheck` at its
//! slot of the [`ExitSchedule`], through a bounded set of workers, and publishes what it
//! finds.
//!
//! One loop owns all state, as in the health engine. It syncs with the inventory when the
//! inventory changes; a proxy is first checked at its next slot (never at once: a restart or
//! a pool scaling up never bursts), and a proxy that is queued or in flight is never queued
//! again. A check fetches the URL through the proxy on a fresh connection (a rotating
//! upstream: through a fresh vendor session each time), reads the address, looks up its
//! country and network, and — unless it is a rotating upstream's sample — records it in the
//! ledger when it differs from the last one this process knows (or is the first), which
//! answers when the exit last changed. Each tick the shared exits are decided again over
//! every known exit and the health snapshot, and every proxy whose reported exit changed is
//! pushed to the reconciler with `try_send` (a full channel leaves it pending for the next
//! tick).

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio::task::{AbortHandle, Id as TaskId, JoinSet};
use tokio_util::sync::CancellationToken;

use super::answer::{MAX_ANSWER_BYTES, exit_address};
use super::metrics::ExitMetrics;
use super::schedule::ExitSchedule;
use super::shared::{KnownExit, shared_exits};
use super::table::{ExitReport, ExitTable, ExitView};
use crate::credentials::CredentialStore;
use crate::geoip::{ExitNetwork, GeoIp};
use crate::health::probe::{ProbeClient, ProbeSettings, ProbeTls};
use crate::health::snapshot::HealthSnapshot;
use crate::inventory::{Inventory, InventorySnapshot};
use crate::ledger::{ExitRecord, Ledger};
use crate::resources::proxy::{Proxy, ProxyId};
use crate::resources::rotating::vendor_session;

/// How the exit checker runs.
#[derive(Debug, Clone)]
pub struct ExitCheckerConfig {
    /// Most checks in flight at once (at least 1).
    pub workers: usize,
    /// How often due checks are looked for.
    pub tick: Duration,
    /// Extra trusted roots (DER) for `https://` URLs, as for probes.
    pub extra_root_certs: Vec<Vec<u8>>,
    /// Upstream credentials, as for probes.
    pub credentials: CredentialStore,
}

/// What the checker shares with the rest of the process.
pub struct ExitChecker {
    config: ExitCheckerConfig,
    inventory: Inventory,
    health: HealthSnapshot,
    ledger: Arc<dyn Ledger>,
    geoip: Arc<GeoIp>,
    table: ExitTable,
    metrics: ExitMetrics,
    reports: mpsc::Sender<ExitReport>,
}

/// What one check found.
#[derive(Debug, Clone)]
struct Found {
    ip: IpAddr,
    network: ExitNetwork,
    /// When the exit last changed, as the ledger says (`None`: a sample, or the ledger did
    /// not answer: recorded again at the next check).
    changed_at: Option<jiff::Timestamp>,
    /// Whether the ledger recorded it (so the next same exit needs no write).
    recorded: bool,
    /// Whether this check recorded a change.
    changed: bool,
}

type Outcome = (ProxyId, Result<Found, String>);

/// One proxy the checker follows.
struct Tracked {
    source: Arc<Proxy>,
    client: ProbeClient,
    schedule: ExitSchedule,
    sampled: bool,
    next_due: Instant,
    queued: bool,
    in_flight: Option<AbortHandle>,
    /// The exit last recorded in the ledger, and when it changed.
    recorded: Option<(IpAddr, jiff::Timestamp)>,
    /// What was last pushed to the reconciler.
    reported: Option<ExitReport>,
}

impl ExitChecker {
    /// Prepares the checker.
    #[expect(clippy::too_many_arguments, reason = "wiring: each is one shared part")]
    pub fn new(
        config: ExitCheckerConfig,
        inventory: Inventory,
        health: HealthSnapshot,
        ledger: Arc<dyn Ledger>,
        geoip: Arc<GeoIp>,
        table: ExitTable,
        metrics: ExitMetrics,
        reports: mpsc::Sender<ExitReport>,
    ) -> Self {
        ExitChecker {
            config,
            inventory,
            health,
            ledger,
            geoip,
            table,
            metrics,
            reports,
        }
    }

    /// Checks until `shutdown` is cancelled.
    pub async fn run(self, shutdown: CancellationToken) {
        let workers = self.config.workers.max(1);
        let mut ticker = tokio::time::interval(self.config.tick.max(Duration::from_millis(1)));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut state = State {
            tls: ProbeTls::new(&self.config.extra_root_certs),
            clock: SlotClock::now(),
            tracked: HashMap::new(),
            ready: VecDeque::new(),
        };
        let mut checks: JoinSet<Outcome> = JoinSet::new();
        let mut changes = self.inventory.subscribe();
        changes.mark_changed();
        loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                Ok(()) = changes.changed() => {
                    let current = changes.borrow_and_update().clone();
                    state.sync(&current, Instant::now());
                    self.table.retain(|id| state.tracked.contains_key(id));
                }
                _ = ticker.tick() => {
                    state.queue_due(Instant::now());
                    self.publish(&mut state);
                }
                Some(joined) = checks.join_next_with_id(), if !checks.is_empty() => match joined {
                    Ok((task, outcome)) => self.record(&mut state, task, outcome),
                    Err(e) if e.is_cancelled() => {}
                    Err(e) => log::error!("an exit check task failed: {e}"),
                },
            }
            self.dispatch(&mut state, &mut checks, workers, Instant::now());
        }
        checks.abort_all();
    }

    fn dispatch(
        &self,
        state: &mut State,
        checks: &mut JoinSet<Outcome>,
        workers: usize,
        now: Instant,
    ) {
        while checks.len() < workers {
            let Some(id) = state.ready.pop_front() else {
                return;
            };
            let Some(tracked) = state.tracked.get_mut(&id) else {
                continue;
            };
            if !tracked.queued || tracked.in_flight.is_some() {
                continue;
            }
            tracked.queued = false;
            tracked.next_due = state.clock.next_slot(&tracked.schedule, now);
            let settings = fresh_session(tracked.client.settings(), tracked.sampled);
            let credentials = settings.upstream_credentials(&self.config.credentials);
            let client = tracked.client.clone();
            let ledger = self.ledger.clone();
            let geoip = self.geoip.clone();
            let sampled = tracked.sampled;
            let recorded = tracked.recorded;
            let task_id = id.clone();
            let handle = checks.spawn(async move {
                let found = async {
                    let body = client
                        .fetch(credentials.as_ref(), MAX_ANSWER_BYTES)
                        .await
                        .map_err(|e| e.to_string())?;
                    let ip = exit_address(&body)?;
                    Ok(
                        check_found(&task_id, ip, geoip.lookup(ip), sampled, recorded, &*ledger)
                            .await,
                    )
                }
                .await;
                (task_id, found)
            });
            tracked.in_flight = Some(handle);
        }
    }

    fn record(&self, state: &mut State, task: TaskId, (id, outcome): Outcome) {
        let Some(tracked) = state.tracked.get_mut(&id) else {
            return;
        };
        if tracked.in_flight.as_ref().map(AbortHandle::id) != Some(task) {
            return;
        }
        tracked.in_flight = None;
        self.metrics.checked(outcome.is_ok());
        let at = jiff::Timestamp::now();
        match outcome {
            Ok(found) => {
                if found.changed {
                    self.metrics.changed();
                    log::info!("{id} exits from {} now", found.ip);
                }
                if found.recorded {
                    tracked.recorded = found.changed_at.map(|t| (found.ip, t));
                }
                let shared_with = self
                    .table
                    .get(&id)
                    .filter(|v| v.ip == found.ip)
                    .map(|v| v.shared_with)
                    .unwrap_or_default();
                self.table.set(
                    id,
                    ExitView {
                        ip: found.ip,
                        changed_at: found.changed_at,
                        sampled: tracked.sampled,
                        network: found.network,
                        shared_with,
                        checked_at: at,
                        last_error: None,
                    },
                );
            }
            Err(error) => {
                log::debug!("exit check of {id} failed: {error}");
                if let Some(mut view) = self.table.get(&id) {
                    view.checked_at = at;
                    view.last_error = Some(error);
                    self.table.set(id, view);
                }
            }
        }
    }

    /// Decides the shared exits again and pushes every report that changed.
    fn publish(&self, state: &mut State) {
        let mut exits = self.table.all();
        let health = self.health.read();
        let shared = shared_exits(exits.iter().map(|(id, view)| KnownExit {
            id,
            ip: view.ip,
            ready: health.get(id).and_then(|h| h.healthy) == Some(true),
            sampled: view.sampled,
        }));
        drop(health);
        for (id, view) in &mut exits {
            let others = shared.get(id).cloned().unwrap_or_default();
            if view.shared_with != others {
                if !others.is_empty() {
                    log::info!("{id} exits from {} like {}", view.ip, others.join(", "));
                }
                view.shared_with = others;
                self.table.set(id.clone(), view.clone());
            }
            let Some(tracked) = state.tracked.get_mut(id) else {
                continue;
            };
            let report = view.report(id);
            if tracked.reported.as_ref() == Some(&report) {
                continue;
            }
            match self.reports.try_send(report.clone()) {
                Ok(()) => tracked.reported = Some(report),
                Err(e) => log::debug!("exit report of {id} stays pending: {e}"),
            }
        }
    }
}

/// Settings for one check: a rotating upstream's with a vendor session of its own, so each
/// check samples another exit.
fn fresh_session(settings: &ProbeSettings, sampled: bool) -> ProbeSettings {
    let mut settings = settings.clone();
    if sampled && let Some(vendor) = settings.vendor.as_mut() {
        vendor.session = vendor_session(&vendor.session, &rand::random::<u64>().to_string());
    }
    settings
}

/// Records `ip` in the ledger unless it is a sample or the one already recorded.
async fn check_found(
    id: &ProxyId,
    ip: IpAddr,
    network: ExitNetwork,
    sampled: bool,
    recorded: Option<(IpAddr, jiff::Timestamp)>,
    ledger: &dyn Ledger,
) -> Found {
    let unrecorded = Found {
        ip,
        network: network.clone(),
        changed_at: None,
        recorded: false,
        changed: false,
    };
    if sampled {
        return unrecorded;
    }
    if let Some((known, changed_at)) = recorded
        && known == ip
    {
        return Found {
            changed_at: Some(changed_at),
            ..unrecorded
        };
    }
    let record = ExitRecord {
        proxy: id.clone(),
        exit_ip: ip.to_string(),
        country: network.country.clone(),
        asn: network.asn.map(i64::from),
    };
    match ledger.record_exit(record).await {
        Ok(seen) => Found {
            changed_at: jiff::Timestamp::from_millisecond(seen.changed_at_ms).ok(),
            recorded: true,
            changed: seen.changed,
            ..unrecorded
        },
        Err(e) => {
            log::warn!("cannot record the exit of {id} (tried again at its next check): {e}");
            Found {
                changed_at: Some(jiff::Timestamp::now()),
                ..unrecorded
            }
        }
    }
}

/// Maps the schedule's slots (time since the Unix epoch) to the monotonic clock.
#[derive(Debug, Clone, Copy)]
struct SlotClock {
    started: Instant,
    started_since_epoch: Duration,
}

impl SlotClock {
    fn now() -> SlotClock {
        SlotClock {
            started: Instant::now(),
            started_since_epoch: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default(),
        }
    }

    /// The instant of `schedule`'s first slot strictly after `now`.
    fn next_slot(&self, schedule: &ExitSchedule, now: Instant) -> Instant {
        let since_epoch = self.started_since_epoch + now.saturating_duration_since(self.started);
        let slot = schedule.next_after(since_epoch);
        now + slot.saturating_sub(since_epoch)
    }
}

/// The loop's state.
struct State {
    tls: ProbeTls,
    clock: SlotClock,
    tracked: HashMap<ProxyId, Tracked>,
    ready: VecDeque<ProxyId>,
}

impl State {
    /// Follows new proxies with an exit check, rebuilds the client of changed ones, forgets
    /// the others.
    fn sync(&mut self, inventory: &InventorySnapshot, now: Instant) {
        let mut live = HashSet::with_capacity(inventory.len());
        for (id, proxy) in inventory.entries() {
            if let Some(tracked) = self.tracked.get(id)
                && Arc::ptr_eq(&tracked.source, proxy)
            {
                live.insert(id.clone());
                continue;
            }
            let Some((settings, interval)) = exit_settings(proxy) else {
                continue;
            };
            live.insert(id.clone());
            let schedule = ExitSchedule::new(&id.uid, interval);
            let sampled = proxy.spec.rotating().is_some();
            match self.tracked.get_mut(id) {
                Some(tracked) => {
                    tracked.source = proxy.clone();
                    tracked.sampled = sampled;
                    if tracked.client.settings() != &settings {
                        tracked.client = ProbeClient::new(settings, &self.tls);
                    }
                    if tracked.schedule != schedule {
                        tracked.schedule = schedule;
                        tracked.next_due = self.clock.next_slot(&schedule, now);
                    }
                }
                None => {
                    let tracked = Tracked {
                        source: proxy.clone(),
                        client: ProbeClient::new(settings, &self.tls),
                        schedule,
                        sampled,
                        next_due: self.clock.next_slot(&schedule, now),
                        queued: false,
                        in_flight: None,
                        recorded: None,
                        reported: None,
                    };
                    self.tracked.insert(id.clone(), tracked);
                }
            }
        }
        self.tracked.retain(|id, tracked| {
            let keep = live.contains(id);
            if !keep && let Some(check) = &tracked.in_flight {
                check.abort();
            }
            keep
        });
        self.ready.retain(|id| live.contains(id));
    }

    fn queue_due(&mut self, now: Instant) {
        for (id, tracked) in &mut self.tracked {
            if tracked.next_due <= now && !tracked.queued && tracked.in_flight.is_none() {
                tracked.queued = true;
                self.ready.push_back(id.clone());
            }
        }
    }
}

/// The check of a proxy as probe settings (the exit URL through the proxy, `200` expected)
/// and its interval; `None` without an exit check or an address.
fn exit_settings(proxy: &Proxy) -> Option<(ProbeSettings, Duration)> {
    let check = proxy.spec.exit_check.as_ref()?;
    let probe = ProbeSettings::for_proxy(proxy)?;
    Some((
        ProbeSettings {
            probe_url: check.url.clone(),
            timeout: check.timeout(),
            expected_status_codes: vec![200],
            ..probe
        },
        check.interval(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_map_to_the_monotonic_clock() {
        let interval = Duration::from_secs(600);
        let schedule = ExitSchedule::new("uid-a", interval);
        let started = Instant::now();
        let clock = SlotClock {
            started,
            started_since_epoch: Duration::from_secs(1_765_000_000),
        };
        let due = clock.next_slot(&schedule, started);
        assert!(due > started && due <= started + interval);
        let slot = clock.started_since_epoch + (due - started);
        assert_eq!(
            slot.as_nanos() % interval.as_nanos(),
            schedule.phase().as_nanos()
        );
        // The slot after it is one interval later.
        assert_eq!(clock.next_slot(&schedule, due), due + interval);
    }

    #[test]
    fn a_rotating_check_asks_for_a_fresh_vendor_session() {
        let proxy: Proxy = serde_json::from_value(serde_json::json!({
            "apiVersion": "crawl.example.com/v1alpha1", "kind": "Proxy",
            "metadata": {"name": "vendor", "namespace": "crawl", "uid": "u-1"},
            "spec": {"mode": "External", "endpoint": {"host": "127.0.0.1", "port": 8000,
                     "rotating": {"usernameTemplate": "user-session-{session}", "maxSessions": 10}},
                     "exitCheck": {"url": "http://127.0.0.1:9/"}},
        }))
        .unwrap();
        let (settings, interval) = exit_settings(&proxy).unwrap();
        assert_eq!(interval, Duration::from_secs(600));
        assert_eq!(settings.expected_status_codes, vec![200]);
        let session = |s: &ProbeSettings| s.vendor.as_ref().unwrap().session.clone();
        let a = fresh_session(&settings, true);
        let b = fresh_session(&settings, true);
        assert_ne!(session(&a), session(&b));
        assert_ne!(session(&a), session(&settings));
        assert_eq!(
            session(&fresh_session(&settings, false)),
            session(&settings)
        );
    }
}
