//! Orphan GC: deletes machines carrying this install's labels whose Proxy no longer exists
//! (a crash between a Proxy's deletion and its finalizer, a finalizer removed by hand).
//!
//! The selection is a pure function; the sweep runs on a timer and only while this process
//! holds the leader Lease, because deleting machines needs a single writer.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use kube::Api;
use kube::api::ListParams;
use tokio::sync::watch;

use crate::leader::until_leader;
use crate::provider::{Instance, Provider};
use crate::resources::proxy::Proxy;

/// How orphan GC runs.
#[derive(Debug, Clone, PartialEq)]
pub struct GcConfig {
    /// Time between sweeps (`--gc-interval`); the first sweep is one interval after start.
    pub interval: Duration,
    /// Machines younger than this are never deleted (`--gc-min-age`): their Proxy may not be
    /// visible yet.
    pub min_age: Duration,
    /// The single namespace the operator watches, if it watches only one.
    pub namespace: Option<String>,
    /// Run even when watching one namespace (`--gc-allow-namespaced`).
    pub allow_namespaced: bool,
}

impl Default for GcConfig {
    fn default() -> Self {
        GcConfig {
            interval: Duration::from_secs(600),
            min_age: Duration::from_secs(600),
            namespace: None,
            allow_namespaced: false,
        }
    }
}

/// Why GC cannot run.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum GcError {
    /// Proxies in other namespaces would look like orphans.
    #[error(
        "orphan GC refuses to run while watching only namespace {0:?}: machines of Proxies in \
         other namespaces would look orphaned; pass --gc-allow-namespaced if this install owns \
         every machine with its labels"
    )]
    Namespaced(String),
}

impl GcConfig {
    /// Refuses a namespaced install unless explicitly allowed.
    pub fn check_scope(&self) -> Result<(), GcError> {
        match &self.namespace {
            Some(ns) if !self.allow_namespaced => Err(GcError::Namespaced(ns.clone())),
            _ => Ok(()),
        }
    }
}

/// The machines to delete: carrying a Proxy UID label that matches no live Proxy, and older than
/// `min_age`. A machine without a UID label or creation time is never selected.
pub fn select_orphans<'a>(
    instances: &'a [Instance],
    live_uids: &HashSet<String>,
    now: jiff::Timestamp,
    min_age: Duration,
) -> Vec<&'a Instance> {
    instances
        .iter()
        .filter(|i| {
            i.uid
                .as_deref()
                .is_some_and(|uid| !uid.is_empty() && !live_uids.contains(uid))
        })
        .filter(|i| {
            i.created_at.is_some_and(|created| {
                now.duration_since(created)
                    .try_into()
                    .is_ok_and(|age: Duration| age >= min_age)
            })
        })
        .collect()
}

/// What one sweep did.
#[derive(Debug, Default, PartialEq)]
pub struct SweepReport {
    /// `(provider, provider ID)` of every machine deleted.
    pub deleted: Vec<(String, String)>,
    /// Providers or deletes that failed (logged; the sweep went on).
    pub failures: usize,
}

/// One sweep over every provider. One provider's failure never stops the others.
pub async fn sweep(
    providers: &[Arc<dyn Provider>],
    live_uids: &HashSet<String>,
    now: jiff::Timestamp,
    min_age: Duration,
) -> SweepReport {
    let mut report = SweepReport::default();
    for provider in providers {
        let instances = match provider.list_managed().await {
            Ok(instances) => instances,
            Err(e) => {
                log::error!(
                    "orphan GC: cannot list machines of {}: {e}",
                    provider.name()
                );
                report.failures += 1;
                continue;
            }
        };
        for orphan in select_orphans(&instances, live_uids, now, min_age) {
            let uid = orphan.uid.as_deref().unwrap_or_default();
            match provider.delete(&orphan.provider_id).await {
                Ok(()) => {
                    log::warn!(
                        "orphan GC: deleted machine provider={} id={} uid={uid}",
                        provider.name(),
                        orphan.provider_id
                    );
                    report
                        .deleted
                        .push((provider.name().to_owned(), orphan.provider_id.clone()));
                }
                Err(e) => {
                    log::error!(
                        "orphan GC: cannot delete machine provider={} id={} uid={uid}: {e}",
                        provider.name(),
                        orphan.provider_id
                    );
                    report.failures += 1;
                }
            }
        }
    }
    report
}

/// UIDs of every Proxy the API server still has, including those being deleted (their
/// finalizer owns the machine's deletion).
pub async fn live_proxy_uids(api: &Api<Proxy>) -> Result<HashSet<String>, kube::Error> {
    let list = api.list_metadata(&ListParams::default()).await?;
    Ok(list
        .items
        .into_iter()
        .filter_map(|p| p.metadata.uid)
        .collect())
}

/// Runs sweeps every `config.interval` while `leader` reads `true`, until the election ends.
pub async fn run_gc(
    api: Api<Proxy>,
    providers: Vec<Arc<dyn Provider>>,
    config: GcConfig,
    mut leader: watch::Receiver<bool>,
) -> Result<(), GcError> {
    config.check_scope()?;
    let mut ticker = tokio::time::interval_at(
        tokio::time::Instant::now() + config.interval,
        config.interval,
    );
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        if !until_leader(&mut leader).await {
            log::info!("orphan GC: leader election ended; stopping");
            return Ok(());
        }
        ticker.tick().await;
        if !*leader.borrow() {
            continue;
        }
        let live = match live_proxy_uids(&api).await {
            Ok(live) => live,
            Err(e) => {
                log::error!("orphan GC: cannot list Proxies, skipping this sweep: {e}");
                continue;
            }
        };
        let report = sweep(&providers, &live, jiff::Timestamp::now(), config.min_age).await;
        log::info!(
            "orphan GC: sweep deleted {} machines, {} failures",
            report.deleted.len(),
            report.failures
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::InstanceState;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const MIN_AGE: Duration = Duration::from_secs(600);

    fn ts(seconds: i64) -> jiff::Timestamp {
        jiff::Timestamp::from_second(seconds).unwrap()
    }

    fn instance(id: &str, uid: Option<&str>, created: Option<i64>) -> Instance {
        Instance {
            provider_id: id.into(),
            name: format!("proxy-{id}"),
            state: InstanceState::Running,
            ip: None,
            uid: uid.map(str::to_owned),
            created_at: created.map(ts),
            waiting: None,
            deletion_deadline: None,
        }
    }

    fn live(uids: &[&str]) -> HashSet<String> {
        uids.iter().map(|u| (*u).to_owned()).collect()
    }

    #[test]
    fn selection_table() {
        let now = ts(10_000);
        let cases = [
            (
                "orphan, old",
                instance("a", Some("gone"), Some(1_000)),
                true,
            ),
            (
                "orphan, exactly min age",
                instance("b", Some("gone"), Some(9_400)),
                true,
            ),
            (
                "orphan, too young",
                instance("c", Some("gone"), Some(9_500)),
                false,
            ),
            ("live UID", instance("d", Some("live"), Some(1_000)), false),
            (
                "live UID of a Proxy being deleted",
                instance("e", Some("deleting"), Some(1_000)),
                false,
            ),
            ("no UID label", instance("f", None, Some(1_000)), false),
            (
                "empty UID label",
                instance("g", Some(""), Some(1_000)),
                false,
            ),
            (
                "unknown creation time",
                instance("h", Some("gone"), None),
                false,
            ),
            (
                "created in the future (clock skew)",
                instance("i", Some("gone"), Some(20_000)),
                false,
            ),
        ];
        let instances: Vec<Instance> = cases.iter().map(|c| c.1.clone()).collect();
        let selected = select_orphans(&instances, &live(&["live", "deleting"]), now, MIN_AGE);
        for (name, inst, expected) in &cases {
            let got = selected.iter().any(|s| s.provider_id == inst.provider_id);
            assert_eq!(got, *expected, "{name}");
        }
    }

    #[test]
    fn randomized_never_selects_a_live_uid() {
        let mut rng = StdRng::seed_from_u64(0x5eed);
        for _ in 0..500 {
            let uids: Vec<String> = (0..rng.random_range(1..12))
                .map(|i| format!("uid-{i}"))
                .collect();
            let live_set: HashSet<String> = uids
                .iter()
                .filter(|_| rng.random_bool(0.5))
                .cloned()
                .collect();
            let now = rng.random_range(0..100_000);
            let instances: Vec<Instance> = (0..rng.random_range(0..30))
                .map(|i| {
                    let uid = rng
                        .random_bool(0.9)
                        .then(|| uids[rng.random_range(0..uids.len())].clone());
                    let created = rng
                        .random_bool(0.9)
                        .then(|| rng.random_range(0..now + 1_000));
                    instance(&format!("m{i}"), uid.as_deref(), created)
                })
                .collect();
            let selected = select_orphans(&instances, &live_set, ts(now), MIN_AGE);
            for s in &selected {
                let uid = s.uid.as_deref().unwrap();
                assert!(!live_set.contains(uid), "selected live uid {uid}");
                let age = now - s.created_at.unwrap().as_second();
                assert!(age >= 600, "selected a machine aged {age}s");
            }
            // And everything eligible is selected.
            let expected = instances
                .iter()
                .filter(|i| {
                    i.uid.as_ref().is_some_and(|u| !live_set.contains(u))
                        && i.created_at.is_some_and(|c| now - c.as_second() >= 600)
                })
                .count();
            assert_eq!(selected.len(), expected);
        }
    }

    #[test]
    fn namespaced_installs_need_explicit_permission() {
        let mut config = GcConfig {
            namespace: Some("crawl".into()),
            ..Default::default()
        };
        assert_eq!(
            config.check_scope(),
            Err(GcError::Namespaced("crawl".into()))
        );
        assert!(
            config
                .check_scope()
                .unwrap_err()
                .to_string()
                .contains("--gc-allow-namespaced")
        );
        config.allow_namespaced = true;
        assert_eq!(config.check_scope(), Ok(()));
        assert_eq!(GcConfig::default().check_scope(), Ok(()));
    }
}
