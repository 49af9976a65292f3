//! What every replica knows of the pools, for the lease API and the gateway: which pools a
//! request's selector would have been served by, whether such a pool is waking (a request may
//! wait for it), and the recording of refused requests as the pools' unmet demand.
//!
//! A refusal is demand for every pool whose template labels the (non-empty) selector matches,
//! when it was refused for capacity or because no member was healthy. It goes to the ledger, so
//! a refusal on a follower reaches the leader's autoscaler. An acquire retried under the same
//! request ID counts once per replica within [`DEMAND_WINDOW`].

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use tokio::sync::broadcast;

use crate::ledger::{Ledger, NoMatch};
use crate::resources::pool::{DEFAULT_WAKE_TIMEOUT, ProxyPool, ProxyPoolStatus};
use crate::serving::candidates::Selector;

/// How far back the autoscaler reads unmet demand.
pub const DEMAND_WINDOW: Duration = Duration::from_secs(60);

/// Demand notices buffered for the pool controller; a slower one misses the oldest (its next
/// evaluation reads the ledger anyway).
const DEMAND_NOTICES: usize = 256;

/// Request IDs remembered per replica to count a retried acquire once; beyond that the oldest
/// half is forgotten.
const REMEMBERED_REQUESTS: usize = 10_000;

/// One pool as the serving side sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolEntry {
    /// `namespace/name`.
    pub key: String,
    /// The template's labels: what a selector must match.
    pub labels: BTreeMap<String, String>,
    /// Whether a member can come: the pool asks for members, or autoscaling can add them.
    pub wakeable: bool,
    /// How long a request may wait for a member.
    pub wake_timeout: Duration,
    /// `spec.replicas`, for the status page.
    pub replicas: i32,
    /// The pool's status as last seen (empty before the controller wrote one).
    pub status: ProxyPoolStatus,
}

impl PoolEntry {
    /// The pool's namespace (the first part of its key): its members are created there.
    pub fn namespace(&self) -> &str {
        self.key
            .split_once('/')
            .map_or("", |(namespace, _)| namespace)
    }

    /// The entry of `pool`.
    pub fn of(pool: &ProxyPool) -> Self {
        let autoscaling = pool.spec.autoscaling.as_ref();
        PoolEntry {
            key: pool.key(),
            labels: pool.spec.template.metadata.labels.clone(),
            wakeable: pool.spec.replicas > 0 || autoscaling.is_some_and(|a| a.max_replicas > 0),
            wake_timeout: autoscaling.map_or(DEFAULT_WAKE_TIMEOUT, |a| a.wake_timeout()),
            replicas: pool.spec.replicas,
            status: pool.status.clone().unwrap_or_default(),
        }
    }
}

/// A request that may wait for pools that are waking.
#[derive(Debug, Clone, PartialEq)]
pub struct Waking {
    /// The pools (`namespace/name`).
    pub pools: Vec<String>,
    /// The longest of their wake timeouts.
    pub wake_timeout: Duration,
}

/// The pools of this replica's view, and the demand recorder. Cheap to clone; empty (no pool
/// matches anything) in standalone mode.
#[derive(Debug, Clone)]
pub struct PoolDirectory {
    pools: Arc<RwLock<Arc<[PoolEntry]>>>,
    recent: Arc<Mutex<HashMap<String, Instant>>>,
    /// The pools each recorded refusal was for: on the leader, the pool controller looks at
    /// them at once instead of at its next evaluation.
    demanded: broadcast::Sender<Arc<[String]>>,
}

impl Default for PoolDirectory {
    fn default() -> Self {
        PoolDirectory {
            pools: Arc::default(),
            recent: Arc::default(),
            demanded: broadcast::channel(DEMAND_NOTICES).0,
        }
    }
}

impl PoolDirectory {
    /// Replaces the view with `pools`.
    pub fn replace<'a>(&self, pools: impl IntoIterator<Item = &'a ProxyPool>) {
        let entries: Arc<[PoolEntry]> = pools.into_iter().map(PoolEntry::of).collect();
        *self.pools.write().unwrap_or_else(PoisonError::into_inner) = entries;
    }

    /// Every pool of the view.
    pub fn entries(&self) -> Arc<[PoolEntry]> {
        self.pools
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The pools whose members `selector` would match; none for an empty selector.
    pub fn matching(&self, selector: &Selector) -> Vec<PoolEntry> {
        if selector.is_empty() {
            return Vec::new();
        }
        let pools = self
            .pools
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        pools
            .iter()
            .filter(|p| selector.matches(p.namespace(), Some(&p.labels)))
            .cloned()
            .collect()
    }

    /// Handles a refused request for `selector`: records it as demand of the pools it matches
    /// when it was refused for capacity or for want of a healthy member (once per
    /// `request_id`), and says whether it may wait for a pool that is waking.
    pub async fn refused(
        &self,
        ledger: &dyn Ledger,
        selector: &Selector,
        no_match: &NoMatch,
        request_id: Option<&str>,
    ) -> Option<Waking> {
        let pools = self.matching(selector);
        if pools.is_empty() || !is_demand(no_match) {
            return None;
        }
        if request_id.is_none_or(|id| self.first_time(id)) {
            let keys: Vec<String> = pools.iter().map(|p| p.key.clone()).collect();
            record(ledger, &keys).await;
            // No receiver (a follower, or standalone) is not an error.
            let _ = self.demanded.send(keys.into());
        }
        waking(&pools, no_match)
    }

    /// The pools this replica records demand for, as it does.
    pub fn demanded(&self) -> broadcast::Receiver<Arc<[String]>> {
        self.demanded.subscribe()
    }

    /// Whether `request_id` was not seen within [`DEMAND_WINDOW`] (and remembers it).
    fn first_time(&self, request_id: &str) -> bool {
        let now = Instant::now();
        let mut recent = self.recent.lock().unwrap_or_else(PoisonError::into_inner);
        if recent.len() >= REMEMBERED_REQUESTS {
            recent.retain(|_, at| now.duration_since(*at) < DEMAND_WINDOW);
            if recent.len() >= REMEMBERED_REQUESTS {
                recent.clear();
            }
        }
        match recent.get(request_id) {
            Some(at) if now.duration_since(*at) < DEMAND_WINDOW => false,
            _ => {
                recent.insert(request_id.to_owned(), now);
                true
            }
        }
    }
}

/// Records one refusal as demand of the pools `keys` (also: a request still held after a
/// while, so a long wake keeps its demand in the window). A failure is logged: the request's
/// own answer does not depend on it.
pub async fn record(ledger: &dyn Ledger, keys: &[String]) {
    if let Err(e) = ledger.record_demand(keys).await {
        log::warn!("recording demand for pools {keys:?} failed: {e}");
    }
}

/// Whether a refusal is unmet demand: for capacity, or no candidate healthy and free of
/// cooldowns (none at all, or none Ready yet). A refusal because every member cools down for
/// the target is not: more members of the same exit addresses' kind would not help it.
pub fn is_demand(no_match: &NoMatch) -> bool {
    no_match.at_capacity > 0 || (no_match.in_cooldown == 0 && no_match.at_target_limit == 0)
}

/// The pools a refused request may wait for: those that can wake, when no candidate of the
/// request was healthy (nothing at capacity or cooling down, which a wait would not fix).
pub fn waking(pools: &[PoolEntry], no_match: &NoMatch) -> Option<Waking> {
    if no_match.at_capacity > 0 || no_match.in_cooldown > 0 || no_match.at_target_limit > 0 {
        return None;
    }
    let wakeable: Vec<&PoolEntry> = pools.iter().filter(|p| p.wakeable).collect();
    let wake_timeout = wakeable.iter().map(|p| p.wake_timeout).max()?;
    Some(Waking {
        pools: wakeable.iter().map(|p| p.key.clone()).collect(),
        wake_timeout,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: &str, geo: &str, wakeable: bool, wake: u64) -> PoolEntry {
        PoolEntry {
            key: key.to_owned(),
            labels: BTreeMap::from([("geo".to_owned(), geo.to_owned())]),
            wakeable,
            wake_timeout: Duration::from_secs(wake),
            replicas: 1,
            status: ProxyPoolStatus::default(),
        }
    }

    fn no_match(at_capacity: u32, in_cooldown: u32, unhealthy: u32) -> NoMatch {
        NoMatch {
            considered: at_capacity + in_cooldown + unhealthy,
            at_capacity,
            in_cooldown,
            unhealthy,
            ..NoMatch::default()
        }
    }

    #[test]
    fn pools_match_non_empty_selectors_on_their_template_labels() {
        let directory = PoolDirectory::default();
        *directory.pools.write().unwrap() =
            vec![entry("a/eu", "eu", true, 60), entry("a/us", "us", true, 60)].into();
        let keys = |s: &str| -> Vec<String> {
            directory
                .matching(&Selector::parse(s).unwrap())
                .into_iter()
                .map(|p| p.key)
                .collect()
        };
        assert_eq!(keys("geo=eu"), ["a/eu"]);
        assert!(keys("").is_empty(), "an empty selector wakes no pool");
        assert!(keys("geo=eu,tier=a").is_empty());
        assert!(keys("geo=asia").is_empty());
        // A tenant's refusal is demand only for the pools of its scope.
        let in_b = Selector::default().in_namespaces(["b".to_owned()]);
        let scoped = Selector::parse("geo=eu").unwrap().within(&in_b);
        assert!(
            directory.matching(&scoped).is_empty(),
            "a/eu is outside the scope"
        );
        let in_a = Selector::default().in_namespaces(["a".to_owned()]);
        let scoped = Selector::parse("geo=eu").unwrap().within(&in_a);
        assert_eq!(directory.matching(&scoped).len(), 1);
    }

    #[test]
    fn what_counts_as_demand_and_what_may_wait() {
        let pools = [
            entry("a/eu", "eu", true, 60),
            entry("a/eu2", "eu", true, 90),
            entry("a/off", "eu", false, 300),
        ];
        // (no_match, demand, wait)
        for (refusal, demand, wait) in [
            (no_match(0, 0, 0), true, Some(90)),
            (no_match(0, 0, 2), true, Some(90)),
            (no_match(3, 0, 0), true, None),
            (no_match(2, 1, 0), true, None),
            (no_match(0, 2, 0), false, None),
        ] {
            assert_eq!(is_demand(&refusal), demand, "{refusal:?}");
            let waking = waking(&pools, &refusal);
            assert_eq!(
                waking.as_ref().map(|w| w.wake_timeout.as_secs()),
                wait,
                "{refusal:?}"
            );
            if let Some(w) = waking {
                assert_eq!(
                    w.pools,
                    ["a/eu", "a/eu2"],
                    "a pool that cannot wake is not waited for"
                );
            }
        }
        assert_eq!(
            waking(&[entry("a/off", "eu", false, 60)], &no_match(0, 0, 0)),
            None
        );
    }

    #[test]
    fn a_request_id_counts_once() {
        let directory = PoolDirectory::default();
        assert!(directory.first_time("r1"));
        assert!(!directory.first_time("r1"));
        assert!(directory.first_time("r2"));
    }
}
