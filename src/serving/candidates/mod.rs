//! The candidate set of an acquire — every proxy matching the selector, with its health as of
//! the request — assembled without copying the inventory, for the lease API and the gateway
//! alike.
//!
//! Which proxies match a selector changes only when the inventory does, so the positions of
//! the matches are cached per inventory snapshot and selector. Health and latency change on
//! every probe, so they are read per request, through each proxy's position in the health
//! table (cached per table layout) instead of hashing identities. A candidate shares its
//! identity with the snapshot (`Arc<ProxyId>`), so a request copies no string. The assembled
//! list is kept too, and handed out again for as long as no verdict or latency in the health
//! table has changed: it is then exactly the list a fresh assembly would produce. A fleet
//! probed every 30 s changes hundreds of times a second at 10,000 proxies, so after a change
//! the kept list is updated at the positions the health table's journal names, each in
//! O(log n) ([`Candidates`] is persistent), instead of being assembled again. In operator mode
//! a health flap also patches the Proxy's status and so replaces the inventory; a replacement
//! that keeps the proxies and their order says which changed, and the index is carried over
//! to it, its lists updated at those positions as after a probe.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, RwLockReadGuard, Weak};

mod selector;

pub use selector::{Selector, SelectorError, selector_pattern};

use crate::health::{HealthSnapshot, HealthTable, ProxyHealth};
use crate::inventory::InventorySnapshot;
use crate::inventory::Leasable;
use crate::ledger::{Candidate, Candidates};
use crate::resources::proxy::Proxy;

/// Selectors whose matches are kept per inventory snapshot. Crawlers use a handful; the bound
/// keeps a client sending endless distinct selectors from growing the cache without limit (a
/// full cache is emptied and refilled by the selectors in use).
pub const MAX_CACHED_SELECTORS: usize = 256;

/// Selectors whose assembled candidate lists are kept per inventory snapshot; each list is
/// as long as the selector's matches, so this bound is lower.
pub const MAX_CACHED_LISTS: usize = 32;

/// Marks an inventory position without a health entry.
const NO_SLOT: u32 = u32::MAX;

/// The cached match positions and health positions of the current inventory snapshot,
/// shared by the API's workers. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct CandidateIndex {
    current: Arc<Mutex<Option<Arc<SnapshotIndex>>>>,
}

/// What is cached for one inventory snapshot.
#[derive(Debug)]
struct SnapshotIndex {
    snapshot: Weak<InventorySnapshot>,
    /// Positions (in the snapshot) of the proxies each selector matches, ascending.
    matches: Mutex<HashMap<Selector, Arc<[u32]>>>,
    /// Health-table position of each inventory position, for one table layout.
    health_slots: Mutex<Option<Arc<HealthSlots>>>,
    /// The last candidate list assembled per selector.
    lists: Mutex<HashMap<Selector, AssembledList>>,
}

/// A candidate list and the health-table layout and version it reflects.
#[derive(Debug)]
struct AssembledList {
    layout: u64,
    version: u64,
    candidates: Candidates,
    /// Inventory positions whose proxy changed since the list was made (it was carried over
    /// from the snapshot before): updated on its next use.
    changed: Option<Arc<[u32]>>,
}

#[derive(Debug)]
struct HealthSlots {
    layout: u64,
    /// Indexed by inventory position; [`NO_SLOT`] when the proxy has no health entry.
    slots: Box<[u32]>,
    /// The inverse: indexed by health-table position, the inventory position ([`NO_SLOT`]
    /// when the proxy is not in this inventory snapshot).
    positions: Box<[u32]>,
}

/// The health table read-locked, addressed by inventory position. Hold it only while
/// reading: the health engine waits for it to be dropped.
pub struct PositionedHealth<'a> {
    table: RwLockReadGuard<'a, HealthTable>,
    slots: Arc<HealthSlots>,
}

impl PositionedHealth<'_> {
    /// The health table's version (see [`HealthTable::version`]).
    pub fn version(&self) -> u64 {
        self.table.version()
    }

    /// The health table's layout (see [`HealthTable::layout`]).
    fn layout(&self) -> u64 {
        self.slots.layout
    }

    /// Inventory positions whose verdict or latency changed after `version` of this layout
    /// (see [`HealthTable::changed_since`]).
    fn changed_since(&self, version: u64) -> Option<impl Iterator<Item = usize> + '_> {
        let changed = self.table.changed_since(version)?;
        Some(changed.filter_map(|slot| {
            let position = *self.slots.positions.get(slot)?;
            (position != NO_SLOT).then_some(position as usize)
        }))
    }

    /// Health of the proxy at `position` of the inventory snapshot this view was built for.
    pub fn at(&self, position: usize) -> Option<&ProxyHealth> {
        match self.slots.slots.get(position) {
            Some(&slot) if slot != NO_SLOT => usize::try_from(slot)
                .ok()
                .and_then(|slot| self.table.at(slot)),
            _ => None,
        }
    }
}

impl SnapshotIndex {
    fn empty(snapshot: &Arc<InventorySnapshot>) -> Self {
        SnapshotIndex {
            snapshot: Arc::downgrade(snapshot),
            matches: Mutex::new(HashMap::new()),
            health_slots: Mutex::new(None),
            lists: Mutex::new(HashMap::new()),
        }
    }

    /// This index carried over to `next`, when `next` replaced this index's snapshot holding
    /// the same proxies in the same order and says which changed: the health slots kept,
    /// each selector's matches kept unless a changed proxy entered or left them, and their
    /// lists kept with the changed positions to update on their next use. `None`: build anew.
    fn carried_to(&self, next: &Arc<InventorySnapshot>) -> Option<SnapshotIndex> {
        let changed: Arc<[u32]> = next
            .changed_since(&self.snapshot)?
            .iter()
            .filter_map(|&position| u32::try_from(position).ok())
            .collect();
        let proxies = next.proxies();
        let leasable = next.leasable();
        let still_matching = |selector: &Selector, found: &[u32]| {
            changed.iter().all(|&position| {
                let at = position as usize;
                let matches = match (leasable.get(at), proxies.get(at)) {
                    (Some(l), Some(proxy)) => selects(selector, l, proxy),
                    _ => false,
                };
                matches == found.binary_search(&position).is_ok()
            })
        };
        let matches: HashMap<Selector, Arc<[u32]>> = lock(&self.matches)
            .iter()
            .filter(|(selector, found)| still_matching(selector, found))
            .map(|(selector, found)| (selector.clone(), found.clone()))
            .collect();
        let lists = lock(&self.lists)
            .iter()
            .filter(|(selector, _)| matches.contains_key(*selector))
            .map(|(selector, list)| {
                let changed = match &list.changed {
                    Some(before) => {
                        let mut both: Vec<u32> =
                            before.iter().chain(changed.iter()).copied().collect();
                        both.sort_unstable();
                        both.dedup();
                        both.into()
                    }
                    None => changed.clone(),
                };
                let list = AssembledList {
                    layout: list.layout,
                    version: list.version,
                    candidates: list.candidates.clone(),
                    changed: Some(changed),
                };
                (selector.clone(), list)
            })
            .collect();
        Some(SnapshotIndex {
            snapshot: Arc::downgrade(next),
            matches: Mutex::new(matches),
            health_slots: Mutex::new(lock(&self.health_slots).clone()),
            lists: Mutex::new(lists),
        })
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl CandidateIndex {
    fn index(&self, snapshot: &Arc<InventorySnapshot>) -> Arc<SnapshotIndex> {
        let mut current = lock(&self.current);
        match current.as_ref() {
            Some(index) if std::ptr::eq(index.snapshot.as_ptr(), Arc::as_ptr(snapshot)) => {
                index.clone()
            }
            _ => {
                let carried = current
                    .as_ref()
                    .and_then(|index| index.carried_to(snapshot));
                let index = Arc::new(carried.unwrap_or_else(|| SnapshotIndex::empty(snapshot)));
                *current = Some(index.clone());
                index
            }
        }
    }

    /// Positions in `snapshot` of the proxies `selector` matches, ascending.
    pub fn matching(&self, snapshot: &Arc<InventorySnapshot>, selector: &Selector) -> Arc<[u32]> {
        matching(&self.index(snapshot), snapshot, selector)
    }

    /// The health table read-locked and addressed by position in `snapshot`.
    pub fn health<'a>(
        &self,
        snapshot: &Arc<InventorySnapshot>,
        health: &'a HealthSnapshot,
    ) -> PositionedHealth<'a> {
        positioned(&self.index(snapshot), snapshot, health)
    }

    /// The acquire candidates: every proxy of `snapshot` matching `selector`, healthy or not,
    /// cordoned or draining or not. Only a proxy that passes health checks and has an address
    /// counts as healthy; a cordoned or draining one is passed on flagged, so the ledger counts
    /// it without choosing it.
    pub fn candidates(
        &self,
        snapshot: &Arc<InventorySnapshot>,
        health: &HealthSnapshot,
        selector: &Selector,
    ) -> Candidates {
        let index = self.index(snapshot);
        let positions = matching(&index, snapshot, selector);
        let health = positioned(&index, snapshot, health);
        let version = health.version();
        let kept = lock(&index.lists)
            .get(selector)
            .filter(|list| list.layout == health.layout())
            .map(|list| (list.version, list.candidates.clone(), list.changed.clone()));
        let leasable = snapshot.leasable();
        let candidates = match kept {
            Some((kept_version, candidates, None)) if kept_version == version => {
                return candidates;
            }
            Some((kept_version, mut candidates, proxies_changed)) => {
                match health.changed_since(kept_version) {
                    Some(changed) => {
                        let proxies_changed = proxies_changed
                            .iter()
                            .flat_map(|positions| positions.iter().map(|&p| p as usize));
                        for position in changed.chain(proxies_changed) {
                            let at = u32::try_from(position)
                                .ok()
                                .and_then(|p| positions.binary_search(&p).ok());
                            if let (Some(at), Some(proxy)) = (at, leasable.get(position)) {
                                candidates.set(at, candidate(proxy, health.at(position)));
                            }
                        }
                        candidates
                    }
                    None => assemble(leasable, &positions, &health),
                }
            }
            None => assemble(leasable, &positions, &health),
        };
        let layout = health.layout();
        drop(health);
        let mut lists = lock(&index.lists);
        if lists.len() >= MAX_CACHED_LISTS && !lists.contains_key(selector) {
            lists.clear();
        }
        // Another request may have kept a newer list meanwhile (versions only grow).
        let replaced = match lists.get(selector) {
            Some(list) if list.layout == layout && list.version > version => None,
            _ => lists.insert(
                selector.clone(),
                AssembledList {
                    layout,
                    version,
                    candidates: candidates.clone(),
                    changed: None,
                },
            ),
        };
        drop(lists);
        // Releasing the previous list's identities happens outside the lock.
        drop(replaced);
        candidates
    }
}

/// The candidate list of the proxies at `positions` of the inventory, as of `health`.
fn assemble(leasable: &[Leasable], positions: &[u32], health: &PositionedHealth<'_>) -> Candidates {
    positions
        .iter()
        .filter_map(|&position| {
            let position = usize::try_from(position).ok()?;
            let proxy = leasable.get(position)?;
            Some(candidate(proxy, health.at(position)))
        })
        .collect()
}

/// One proxy as a candidate: only one that passes health checks and has an address counts as
/// healthy.
fn candidate(proxy: &Leasable, health: Option<&ProxyHealth>) -> Candidate {
    Candidate {
        proxy: proxy.id.clone(),
        max_leases: proxy.max_leases,
        healthy: proxy.has_address && health.and_then(|h| h.healthy) == Some(true),
        cordoned: proxy.cordoned,
        draining: proxy.draining,
        latency: health.and_then(|h| h.latency),
    }
}

/// Whether `selector` matches the proxy (a rotating upstream's template fields match any value).
fn selects(selector: &Selector, leasable: &Leasable, proxy: &Proxy) -> bool {
    selector.matches_filling(
        &leasable.id.namespace,
        proxy.metadata.labels.as_ref(),
        leasable.template_fields.as_deref().unwrap_or_default(),
    )
}

fn matching(
    index: &SnapshotIndex,
    snapshot: &InventorySnapshot,
    selector: &Selector,
) -> Arc<[u32]> {
    if let Some(found) = lock(&index.matches).get(selector) {
        return found.clone();
    }
    // Scanned outside the lock: other selectors are served meanwhile.
    let found: Arc<[u32]> = snapshot
        .leasable()
        .iter()
        .zip(snapshot.proxies())
        .enumerate()
        .filter(|(_, (leasable, proxy))| selects(selector, leasable, proxy))
        .filter_map(|(position, _)| u32::try_from(position).ok())
        .collect();
    let mut matches = lock(&index.matches);
    if matches.len() >= MAX_CACHED_SELECTORS {
        matches.clear();
    }
    matches.insert(selector.clone(), found.clone());
    found
}

fn positioned<'a>(
    index: &SnapshotIndex,
    snapshot: &InventorySnapshot,
    health: &'a HealthSnapshot,
) -> PositionedHealth<'a> {
    let table = health.read();
    let cached = lock(&index.health_slots)
        .as_ref()
        .filter(|s| s.layout == table.layout())
        .cloned();
    let slots = match cached {
        Some(slots) => slots,
        None => {
            let slots: Box<[u32]> = snapshot
                .leasable()
                .iter()
                .map(|l| {
                    table
                        .slot(&l.id)
                        .and_then(|s| u32::try_from(s).ok())
                        .unwrap_or(NO_SLOT)
                })
                .collect();
            let mut positions = vec![NO_SLOT; table.len()].into_boxed_slice();
            for (position, &slot) in slots.iter().enumerate() {
                if let (Ok(slot), Ok(position)) = (usize::try_from(slot), u32::try_from(position))
                    && let Some(entry) = positions.get_mut(slot)
                {
                    *entry = position;
                }
            }
            let slots = Arc::new(HealthSlots {
                layout: table.layout(),
                slots,
                positions,
            });
            *lock(&index.health_slots) = Some(slots.clone());
            slots
        }
    };
    PositionedHealth { table, slots }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::fixtures;
    use crate::health::ProxyHealth;
    use crate::inventory::Inventory;
    use crate::resources::proxy::Proxy;

    fn proxy(name: &str, geo: &str, max_leases: i32, external: bool) -> Proxy {
        let proxy = if external {
            fixtures::external(name, "127.0.0.1", 3128)
        } else {
            fixtures::managed(name, "local")
        };
        proxy
            .uid(None)
            .max_leases(max_leases)
            .labels(&[("geo", geo)])
            .build()
    }

    fn healthy(ms: u64) -> ProxyHealth {
        ProxyHealth {
            healthy: Some(true),
            latency: Some(Duration::from_millis(ms)),
            ..Default::default()
        }
    }

    fn selector(text: &str) -> Selector {
        Selector::parse(text).unwrap()
    }

    /// (name, max leases, healthy, latency ms)
    fn summary(candidates: &Candidates) -> Vec<(String, u32, bool, Option<u128>)> {
        candidates
            .iter()
            .map(|c| {
                (
                    c.proxy.name.clone(),
                    c.max_leases,
                    c.healthy,
                    c.latency.map(|l| l.as_millis()),
                )
            })
            .collect()
    }

    #[test]
    fn candidates_carry_current_health_and_shared_identities() {
        let inventory = Inventory::new();
        let health = HealthSnapshot::new();
        let proxies = [
            proxy("eu-fast", "eu", 2, true),
            proxy("eu-sick", "eu", 2, true),
            proxy("eu-managed", "eu", 2, false),
            proxy("eu-unprobed", "eu", 2, true),
            proxy("us", "us", 2, true),
        ];
        health.set(proxies[0].id(), healthy(5));
        health.set(
            proxies[1].id(),
            ProxyHealth {
                healthy: Some(false),
                ..Default::default()
            },
        );
        health.set(proxies[2].id(), healthy(1));
        health.set(proxies[4].id(), healthy(9));
        inventory.replace(proxies);
        let snapshot = inventory.snapshot();
        let index = CandidateIndex::default();
        let eu = index.candidates(&snapshot, &health, &selector("geo=eu"));
        assert_eq!(
            summary(&eu),
            [
                ("eu-fast".to_owned(), 2, true, Some(5)),
                // No address yet: never leasable, whatever its health says.
                ("eu-managed".to_owned(), 2, false, Some(1)),
                ("eu-sick".to_owned(), 2, false, None),
                ("eu-unprobed".to_owned(), 2, false, None),
            ]
        );
        let first = eu.get(0).unwrap();
        let position = snapshot.position(&first.proxy).unwrap();
        assert!(Arc::ptr_eq(&first.proxy, &snapshot.leasable()[position].id));
        assert_eq!(index.candidates(&snapshot, &health, &selector("")).len(), 5);
        assert!(
            index
                .candidates(&snapshot, &health, &selector("geo=mars"))
                .is_empty()
        );

        // While no verdict or latency changes, the same list is handed out again.
        let again = index.candidates(&snapshot, &health, &selector("geo=eu"));
        assert!(eu.shares(&again));

        // Health changes in place are seen at once; so are proxies that appear in the table.
        health.set(
            snapshot.leasable()[position].id.as_ref().clone(),
            healthy(50),
        );
        health.set(snapshot.proxies()[4].id(), healthy(3));
        let unprobed = snapshot
            .proxies()
            .iter()
            .position(|p| p.key() == "crawl/eu-unprobed");
        health.set(snapshot.proxies()[unprobed.unwrap()].id(), healthy(7));
        let eu = index.candidates(&snapshot, &health, &selector("geo=eu"));
        assert_eq!(eu.get(0).unwrap().latency, Some(Duration::from_millis(50)));
        assert_eq!(
            summary(&eu)[3],
            ("eu-unprobed".to_owned(), 2, true, Some(7))
        );
        // ... and removals.
        health.retain(|id| id.name != "eu-fast");
        let eu = index.candidates(&snapshot, &health, &selector("geo=eu"));
        assert_eq!(summary(&eu)[0], ("eu-fast".to_owned(), 2, false, None));
        assert_eq!(
            summary(&eu)[3],
            ("eu-unprobed".to_owned(), 2, true, Some(7))
        );
    }

    #[test]
    fn cordoned_proxies_are_offered_flagged_with_their_health() {
        let inventory = Inventory::new();
        let health = HealthSnapshot::new();
        let mut cordoned = proxy("a", "eu", 2, true);
        cordoned.spec.cordoned = true;
        let open = proxy("b", "eu", 2, true);
        health.set(cordoned.id(), healthy(1));
        health.set(open.id(), healthy(9));
        inventory.replace([cordoned.clone(), open]);
        let index = CandidateIndex::default();
        let flags = |list: &Candidates| -> Vec<(String, bool, bool)> {
            list.iter()
                .map(|c| (c.proxy.name.clone(), c.healthy, c.cordoned))
                .collect()
        };
        let eu = index.candidates(&inventory.snapshot(), &health, &selector("geo=eu"));
        assert_eq!(
            flags(&eu),
            [("a".to_owned(), true, true), ("b".to_owned(), true, false)]
        );
        // Uncordoning is an inventory change: the next snapshot's list says so.
        cordoned.spec.cordoned = false;
        inventory.replace([cordoned, proxy("b", "eu", 2, true)]);
        let eu = index.candidates(&inventory.snapshot(), &health, &selector("geo=eu"));
        assert_eq!(
            flags(&eu),
            [("a".to_owned(), true, false), ("b".to_owned(), true, false)]
        );
    }

    #[test]
    fn draining_proxies_are_offered_flagged_with_their_health() {
        let inventory = Inventory::new();
        let health = HealthSnapshot::new();
        let mut deleted = proxy("a", "eu", 2, true);
        deleted.metadata.deletion_timestamp = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::UNIX_EPOCH),
        );
        let mut both = proxy("b", "eu", 2, true);
        both.spec.cordoned = true;
        both.metadata.deletion_timestamp = deleted.metadata.deletion_timestamp.clone();
        let open = proxy("c", "eu", 2, true);
        for (p, ms) in [(&deleted, 1), (&both, 2), (&open, 9)] {
            health.set(p.id(), healthy(ms));
        }
        inventory.replace([deleted.clone(), both, open.clone()]);
        let index = CandidateIndex::default();
        // (name, healthy, cordoned, draining)
        let flags = |list: &Candidates| -> Vec<(String, bool, bool, bool)> {
            list.iter()
                .map(|c| (c.proxy.name.clone(), c.healthy, c.cordoned, c.draining))
                .collect()
        };
        let eu = index.candidates(&inventory.snapshot(), &health, &selector("geo=eu"));
        assert_eq!(
            flags(&eu),
            [
                ("a".to_owned(), true, false, true),
                ("b".to_owned(), true, true, true),
                ("c".to_owned(), true, false, false),
            ]
        );
        // A drain that ends (the object is back without a deletionTimestamp) is an inventory
        // change: the next snapshot's list says so.
        deleted.metadata.deletion_timestamp = None;
        inventory.replace([deleted, open]);
        let eu = index.candidates(&inventory.snapshot(), &health, &selector("geo=eu"));
        assert_eq!(
            flags(&eu),
            [
                ("a".to_owned(), true, false, false),
                ("c".to_owned(), true, false, false),
            ]
        );
    }

    #[test]
    fn matches_are_cached_per_snapshot_and_bounded() {
        let inventory = Inventory::new();
        inventory.replace([proxy("a", "eu", 1, true), proxy("b", "us", 1, true)]);
        let index = CandidateIndex::default();
        let first = inventory.snapshot();
        let eu = index.matching(&first, &selector("geo=eu"));
        assert_eq!(&*eu, &[0]);
        assert!(Arc::ptr_eq(
            &eu,
            &index.matching(&first, &selector("geo = eu"))
        ));
        // A new snapshot is matched afresh.
        inventory.replace([proxy("b", "us", 1, true), proxy("c", "eu", 1, true)]);
        let second = inventory.snapshot();
        assert_eq!(&*index.matching(&second, &selector("geo=eu")), &[1]);
        // Distinct selectors never grow the cache past its bound.
        for i in 0..MAX_CACHED_SELECTORS * 2 {
            index.matching(&second, &selector(&format!("geo=x{i}")));
            let cached = lock(&index.index(&second).matches).len();
            assert!(cached <= MAX_CACHED_SELECTORS, "{cached}");
        }
    }

    /// A kept list updated at the positions the health journal names is the list a fresh
    /// assembly makes, through any mix of verdicts and latencies changing, also when more
    /// changes come than the journal keeps between two acquires.
    /// Checks that `index`'s lists for two selectors are what a fresh index assembles.
    fn as_assembled_afresh(
        index: &CandidateIndex,
        snapshot: &Arc<InventorySnapshot>,
        health: &HealthSnapshot,
        round: usize,
    ) {
        let order =
            |list: &Candidates| -> Vec<usize> { list.ranked().map(|r| r.position).collect() };
        for text in ["geo=eu", ""] {
            let kept = index.candidates(snapshot, health, &selector(text));
            let fresh = CandidateIndex::default().candidates(snapshot, health, &selector(text));
            assert_eq!(kept, fresh, "round {round}, {text:?}");
            assert_eq!(kept.excluded(), fresh.excluded(), "round {round}, {text:?}");
            assert_eq!(order(&kept), order(&fresh), "round {round}, {text:?}");
        }
    }

    #[test]
    fn a_list_updated_from_the_journal_is_the_list_assembled_afresh() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let inventory = Inventory::new();
        let health = HealthSnapshot::new();
        let proxies: Vec<Proxy> = (0..60)
            .map(|i| proxy(&format!("p{i:02}"), ["eu", "us"][i % 2], 2, i % 7 != 0))
            .collect();
        for p in &proxies {
            health.set(p.id(), healthy(5));
        }
        inventory.replace(proxies.clone());
        let snapshot = inventory.snapshot();
        let index = CandidateIndex::default();
        for round in 0..200 {
            let changes = if round % 50 == 49 {
                3_000
            } else {
                rng.random_range(0..8)
            };
            for _ in 0..changes {
                let p = &proxies[rng.random_range(0..proxies.len())];
                let verdict = rng.random_bool(0.8).then(|| rng.random_bool(0.8));
                let latency = rng.random_bool(0.9).then(|| rng.random_range(1..6));
                health.set(
                    p.id(),
                    ProxyHealth {
                        healthy: verdict,
                        latency: latency.map(Duration::from_millis),
                        ..Default::default()
                    },
                );
            }
            as_assembled_afresh(&index, &snapshot, &health, round);
        }
    }

    #[test]
    fn a_list_carried_across_inventory_changes_is_the_list_assembled_afresh() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let inventory = Inventory::new();
        let health = HealthSnapshot::new();
        let mut proxies: Vec<Arc<Proxy>> = (0..64)
            .map(|i| {
                Arc::new(proxy(
                    &format!("p{i:02}"),
                    ["eu", "us"][i % 2],
                    2,
                    i % 7 != 0,
                ))
            })
            .collect();
        for p in &proxies {
            health.set(p.id(), healthy(5));
        }
        inventory.replace_shared(proxies.clone());
        let index = CandidateIndex::default();
        let mut carried = 0;
        for round in 0..200 {
            // A few Proxies change as a status or spec patch changes them: cordoned, drained,
            // relabelled (entering or leaving a selector), their address gone; sometimes a
            // health verdict too, and once in a while one is removed and added back.
            for _ in 0..rng.random_range(0..4) {
                let at = rng.random_range(0..proxies.len());
                let mut changed = (*proxies[at]).clone();
                match rng.random_range(0..4) {
                    0 => changed.spec.cordoned = !changed.spec.cordoned,
                    1 => changed.spec.max_leases = Some(rng.random_range(0..4)),
                    2 => {
                        let geo = ["eu", "us", "de"][rng.random_range(0..3)];
                        changed
                            .metadata
                            .labels
                            .get_or_insert_default()
                            .insert("geo".into(), geo.into());
                    }
                    _ => health.set(
                        changed.id(),
                        ProxyHealth {
                            healthy: Some(rng.random_bool(0.5)),
                            latency: Some(Duration::from_millis(rng.random_range(1..9))),
                            ..Default::default()
                        },
                    ),
                }
                proxies[at] = Arc::new(changed);
            }
            // Only the index holds on to the snapshot before, as the servers do.
            let before = Arc::downgrade(&inventory.snapshot());
            if round % 40 == 39 {
                inventory.replace_shared(proxies[1..].to_vec());
            }
            inventory.replace_shared(proxies.clone());
            let snapshot = inventory.snapshot();
            carried += usize::from(snapshot.changed_since(&before).is_some());
            as_assembled_afresh(&index, &snapshot, &health, round);
        }
        assert!(
            carried > 150,
            "{carried} of 200 rounds carried the lists over"
        );
    }
}
