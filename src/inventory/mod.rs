//! The in-memory inventory of Proxy objects: the one place the health engine and the API read
//! proxies from. A feeder (the standalone file loader, or the Kubernetes watch in operator
//! mode) replaces the whole set; readers get cheap immutable snapshots. The operator's watch
//! hands over the `Arc`s of its store, so a replacement copies pointers, not Proxies.

pub mod file;
pub mod import;

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use tokio::sync::watch;

use crate::resources::proxy::{Proxy, ProxyId};

/// What an acquire needs of one proxy besides its health, computed once per replacement so
/// an acquire over thousands of proxies scans this table instead of the Proxy objects and
/// shares the identities instead of copying their strings.
#[derive(Debug, Clone)]
pub struct Leasable {
    /// Identity, shared with every acquire candidate built from this snapshot.
    pub id: Arc<ProxyId>,
    /// Lease capacity (`maxLeases` with the default applied; 0: never leased).
    pub max_leases: u32,
    /// Whether crawlers have an address to connect to (a Managed proxy has none until its
    /// machine runs); a proxy without one is never leased.
    pub has_address: bool,
    /// `spec.cordoned`: never leased, still listed and probed.
    pub cordoned: bool,
    /// [`Proxy::is_draining`]: being deleted or about to be replaced. Never leased, its
    /// leases are not renewed; still listed and probed.
    pub draining: bool,
    /// The username template's selector fields of a rotating upstream (see
    /// [`Selector::matches_filling`](crate::serving::candidates::Selector::matches_filling)).
    pub template_fields: Option<Arc<[String]>>,
}

impl Leasable {
    fn of(proxy: &Proxy, id: ProxyId) -> Self {
        Leasable {
            id: Arc::new(id),
            max_leases: proxy.spec.max_leases(),
            has_address: proxy.spec.effective_host(proxy.status.as_ref()).is_some(),
            cordoned: proxy.spec.cordoned,
            draining: proxy.is_draining(),
            template_fields: proxy
                .spec
                .rotating()
                .map(|rotating| rotating.selector_fields().into()),
        }
    }
}

/// One immutable view of the inventory.
#[derive(Debug, Default)]
pub struct InventorySnapshot {
    /// Proxies sorted by namespace/name.
    proxies: Vec<Arc<Proxy>>,
    /// Identity, capacity, address presence, cordon and drain of each proxy in `proxies`,
    /// computed once per replacement (the API and the health engine look proxies up on every
    /// request and tick).
    leasable: Vec<Leasable>,
    /// How many of them are draining (a renew looks its lease's proxy up only when some are).
    draining: usize,
    /// Position of each proxy in `proxies`, by identity.
    by_id: HashMap<Arc<ProxyId>, usize>,
    /// Whether the feeder has delivered its first complete set (drives `/readyz`).
    synced: bool,
    /// How many replacements preceded this snapshot (0: the empty initial one).
    version: u64,
    /// What changed since the snapshot this one replaced, when both hold the same proxies in
    /// the same order (a status or spec change, not an addition or removal).
    changes: Option<Changes>,
}

/// The positions whose Proxy a replacement changed, and the snapshot it replaced.
#[derive(Debug)]
struct Changes {
    replaced: Weak<InventorySnapshot>,
    positions: Vec<usize>,
}

/// A replacement that changes more than this share of the proxies (1/8) records no changes:
/// building anew from it costs less than updating at each.
const MOST_CHANGES_DIVISOR: usize = 8;

impl InventorySnapshot {
    /// Every proxy, sorted by namespace/name.
    pub fn proxies(&self) -> &[Arc<Proxy>] {
        &self.proxies
    }

    /// Every proxy with its identity, sorted by namespace/name.
    pub fn entries(&self) -> impl Iterator<Item = (&ProxyId, &Arc<Proxy>)> {
        self.leasable.iter().map(|l| &*l.id).zip(&self.proxies)
    }

    /// What an acquire needs of each proxy, in the order of [`proxies`](Self::proxies).
    pub fn leasable(&self) -> &[Leasable] {
        &self.leasable
    }

    /// The proxy with this identity, if present.
    pub fn get(&self, id: &ProxyId) -> Option<&Arc<Proxy>> {
        self.position(id).and_then(|i| self.proxies.get(i))
    }

    /// Where the proxy with this identity is in [`proxies`](Self::proxies).
    pub fn position(&self, id: &ProxyId) -> Option<usize> {
        self.by_id.get(id).copied()
    }

    /// Whether any proxy is draining ([`Leasable::draining`]).
    pub fn any_draining(&self) -> bool {
        self.draining > 0
    }

    /// Whether the proxy with this identity is present and draining.
    pub fn is_draining(&self, id: &ProxyId) -> bool {
        self.position(id)
            .and_then(|i| self.leasable.get(i))
            .is_some_and(|l| l.draining)
    }

    /// The positions whose Proxy changed since `replaced`, when this snapshot replaced it
    /// holding the same proxies in the same order and few of them changed: what a reader
    /// updates in place instead of building anew from the whole set (a health flap changes
    /// one Proxy's status, and a fleet of 10,000 flaps often).
    /// `replaced` is held weakly, as a reader keeps what it built from an older snapshot: the
    /// snapshot itself is gone once the inventory replaced it.
    pub fn changed_since(&self, replaced: &Weak<InventorySnapshot>) -> Option<&[usize]> {
        let changes = self.changes.as_ref()?;
        Weak::ptr_eq(&changes.replaced, replaced).then_some(changes.positions.as_slice())
    }

    /// Whether a first complete set has been loaded.
    pub fn is_synced(&self) -> bool {
        self.synced
    }

    /// How many replacements preceded this snapshot: a feeder's rebuild rate is observable.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Number of proxies.
    pub fn len(&self) -> usize {
        self.proxies.len()
    }

    /// Whether there are no proxies.
    pub fn is_empty(&self) -> bool {
        self.proxies.is_empty()
    }
}

/// Shared handle to the inventory. Cloning is cheap; all clones see the same set.
#[derive(Clone, Debug)]
pub struct Inventory {
    sender: Arc<watch::Sender<Arc<InventorySnapshot>>>,
}

impl Default for Inventory {
    fn default() -> Self {
        Self::new()
    }
}

impl Inventory {
    /// An empty, not yet synced inventory.
    pub fn new() -> Self {
        let (sender, _) = watch::channel(Arc::new(InventorySnapshot::default()));
        Inventory {
            sender: Arc::new(sender),
        }
    }

    /// Replaces the whole set and marks the inventory synced.
    pub fn replace(&self, proxies: impl IntoIterator<Item = Proxy>) {
        self.replace_shared(proxies.into_iter().map(Arc::new));
    }

    /// Replaces the whole set with proxies shared with their owner (the operator's watch
    /// store), and marks the inventory synced.
    pub fn replace_shared(&self, proxies: impl IntoIterator<Item = Arc<Proxy>>) {
        let mut entries: Vec<(ProxyId, Arc<Proxy>)> =
            proxies.into_iter().map(|p| (p.id(), p)).collect();
        entries.sort_unstable_by(|(a, _), (b, _)| key_order(a, b));
        let replaced = self.sender.borrow().clone();
        let same_proxies = replaced.leasable.len() == entries.len()
            && replaced
                .leasable
                .iter()
                .zip(&entries)
                .all(|(was, (id, _))| *was.id == *id);
        let mut changed = Vec::new();
        let (leasable, proxies): (Vec<Leasable>, Vec<Arc<Proxy>>) = entries
            .into_iter()
            .enumerate()
            .map(|(position, (id, p))| {
                // A Proxy the feeder handed over again unchanged keeps what was computed of it.
                if same_proxies && Arc::ptr_eq(&replaced.proxies[position], &p) {
                    return (replaced.leasable[position].clone(), p);
                }
                changed.push(position);
                (Leasable::of(&p, id), p)
            })
            .unzip();
        let changes =
            (same_proxies && changed.len() <= proxies.len() / MOST_CHANGES_DIVISOR).then(|| {
                Changes {
                    replaced: Arc::downgrade(&replaced),
                    positions: changed,
                }
            });
        let by_id = leasable
            .iter()
            .enumerate()
            .map(|(i, l)| (l.id.clone(), i))
            .collect();
        let draining = leasable.iter().filter(|l| l.draining).count();
        let version = replaced.version + 1;
        self.sender.send_replace(Arc::new(InventorySnapshot {
            proxies,
            leasable,
            draining,
            by_id,
            synced: true,
            version,
            changes,
        }));
    }

    /// The current set.
    pub fn snapshot(&self) -> Arc<InventorySnapshot> {
        self.sender.borrow().clone()
    }

    /// A receiver that is notified on every replacement (for the health engine's loop).
    pub fn subscribe(&self) -> watch::Receiver<Arc<InventorySnapshot>> {
        self.sender.subscribe()
    }
}

/// Orders identities as their `namespace/name` strings order (then by UID), without building
/// the strings.
fn key_order(a: &ProxyId, b: &ProxyId) -> std::cmp::Ordering {
    a.namespace
        .bytes()
        .chain(std::iter::once(b'/'))
        .chain(a.name.bytes())
        .cmp(
            b.namespace
                .bytes()
                .chain(std::iter::once(b'/'))
                .chain(b.name.bytes()),
        )
        .then_with(|| a.uid.cmp(&b.uid))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::proxy::{
        CONDITION_PROVISIONED, Condition, ConditionStatus, ProxySpec, ProxyStatus, REASON_DRAINING,
    };

    fn proxy(ns: &str, name: &str) -> Proxy {
        crate::fixtures::external(name, "127.0.0.1", 3128)
            .namespace(ns)
            .uid(None)
            .build()
    }

    #[test]
    fn a_replacement_of_the_same_proxies_says_which_changed() {
        let inventory = Inventory::new();
        let proxies: Vec<Arc<Proxy>> = (0..16)
            .map(|i| Arc::new(proxy("crawl", &format!("p{i:02}"))))
            .collect();
        inventory.replace_shared(proxies.clone());
        let first = inventory.snapshot();
        // Two Proxies handed over anew (a status patch each), the rest as they were.
        let mut next = proxies.clone();
        for position in [3, 9] {
            let mut changed = (*next[position]).clone();
            changed.spec.cordoned = true;
            next[position] = Arc::new(changed);
        }
        inventory.replace_shared(next.clone());
        let second = inventory.snapshot();
        assert_eq!(
            second.changed_since(&Arc::downgrade(&first)),
            Some(&[3, 9][..])
        );
        assert!(second.leasable()[3].cordoned && !second.leasable()[4].cordoned);
        assert!(Arc::ptr_eq(
            &first.leasable()[4].id,
            &second.leasable()[4].id
        ));
        // Only against the snapshot it replaced.
        assert_eq!(second.changed_since(&Arc::downgrade(&second)), None);
        inventory.replace_shared(next.clone());
        assert_eq!(
            inventory.snapshot().changed_since(&Arc::downgrade(&second)),
            Some(&[][..])
        );
        // Not when the set changed, nor when too many changed to be worth it.
        inventory.replace_shared(next[1..].to_vec());
        let shorter = inventory.snapshot();
        inventory.replace_shared(next.clone());
        assert_eq!(
            inventory
                .snapshot()
                .changed_since(&Arc::downgrade(&shorter)),
            None
        );
        let before = inventory.snapshot();
        inventory.replace_shared(next.iter().map(|p| Arc::new((**p).clone())));
        assert_eq!(
            inventory.snapshot().changed_since(&Arc::downgrade(&before)),
            None
        );
    }

    #[test]
    fn replace_sorts_indexes_and_marks_synced() {
        let inventory = Inventory::new();
        assert!(!inventory.snapshot().is_synced());
        inventory.replace([
            proxy("b", "x"),
            proxy("a", "y"),
            proxy("a-b", "x"),
            proxy("a", "x"),
        ]);
        let snap = inventory.snapshot();
        assert!(snap.is_synced());
        let keys: Vec<String> = snap.proxies().iter().map(|p| p.key()).collect();
        // The order of the `namespace/name` strings: `-` sorts before `/`.
        assert_eq!(keys, ["a-b/x", "a/x", "a/y", "b/x"]);
        let id = proxy("a", "y").id();
        assert_eq!(snap.get(&id).unwrap().key(), "a/y");
        let ids: Vec<String> = snap.entries().map(|(id, _)| id.key()).collect();
        assert_eq!(ids, keys);
        assert_eq!(snap.len(), 4);
        assert_eq!(snap.version(), 1);
    }

    /// A Provisioned condition with `reason`, as the reconciler writes it.
    fn provisioned(mut p: Proxy, status: ConditionStatus, reason: &str) -> Proxy {
        p.status = Some(ProxyStatus {
            ip: Some("10.0.0.9".into()),
            conditions: vec![Condition {
                type_: CONDITION_PROVISIONED.into(),
                status,
                reason: reason.into(),
                message: String::new(),
                last_transition_time: jiff::Timestamp::UNIX_EPOCH,
                observed_generation: None,
            }],
            ..ProxyStatus::default()
        });
        p
    }

    #[test]
    fn leasable_facts_follow_the_proxies() {
        let managed: ProxySpec = serde_json::from_value(serde_json::json!({
            "mode": "Managed", "provider": "local", "maxLeases": 3
        }))
        .unwrap();
        let mut pending = Proxy::new("pending", managed.clone());
        pending.metadata.namespace = Some("a".into());
        let mut zero = proxy("a", "zero");
        zero.spec.max_leases = Some(0);
        let mut cordoned = proxy("a", "cordoned");
        cordoned.spec.cordoned = true;
        let mut replaced = Proxy::new("replaced", managed.clone());
        replaced.metadata.namespace = Some("a".into());
        let replaced = provisioned(replaced, ConditionStatus::False, REASON_DRAINING);
        let mut running = Proxy::new("running", managed);
        running.metadata.namespace = Some("a".into());
        let running = provisioned(running, ConditionStatus::True, "Running");
        let mut deleted = proxy("a", "deleted");
        deleted.metadata.deletion_timestamp = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::UNIX_EPOCH),
        );
        let inventory = Inventory::new();
        inventory.replace([
            proxy("a", "plain"),
            pending,
            zero,
            cordoned,
            replaced,
            running,
            deleted,
        ]);
        let snap = inventory.snapshot();
        let facts: Vec<(String, u32, bool, bool, bool)> = snap
            .leasable()
            .iter()
            .map(|l| {
                (
                    l.id.name.clone(),
                    l.max_leases,
                    l.has_address,
                    l.cordoned,
                    l.draining,
                )
            })
            .collect();
        let default = crate::resources::proxy::DEFAULT_MAX_LEASES.unsigned_abs();
        assert_eq!(
            facts,
            [
                ("cordoned".to_owned(), default, true, true, false),
                ("deleted".to_owned(), default, true, false, true),
                ("pending".to_owned(), 3, false, false, false),
                ("plain".to_owned(), default, true, false, false),
                ("replaced".to_owned(), 3, true, false, true),
                ("running".to_owned(), 3, true, false, false),
                ("zero".to_owned(), 0, true, false, false),
            ]
        );
        for (i, l) in snap.leasable().iter().enumerate() {
            assert_eq!(snap.position(&l.id), Some(i));
            assert_eq!(snap.proxies()[i].id(), *l.id);
            assert_eq!(snap.is_draining(&l.id), l.draining, "{}", l.id.name);
        }
        assert!(snap.any_draining());
        assert!(!snap.is_draining(&proxy("a", "absent").id()));

        // The count follows every replacement.
        inventory.replace([proxy("a", "plain")]);
        assert!(!inventory.snapshot().any_draining());
        assert!(!Inventory::new().snapshot().any_draining());
    }

    #[test]
    fn replace_shared_keeps_the_owners_arcs() {
        let inventory = Inventory::new();
        assert_eq!(inventory.snapshot().version(), 0);
        let owned: Vec<Arc<Proxy>> = [proxy("b", "x"), proxy("a", "x")]
            .into_iter()
            .map(Arc::new)
            .collect();
        inventory.replace_shared(owned.iter().cloned());
        let snap = inventory.snapshot();
        assert_eq!(snap.version(), 1);
        assert!(Arc::ptr_eq(&snap.proxies()[0], &owned[1]), "a/x is shared");
        assert!(Arc::ptr_eq(&snap.proxies()[1], &owned[0]), "b/x is shared");
        assert_eq!(Arc::strong_count(&owned[0]), 2);
    }

    #[tokio::test]
    async fn subscribers_see_replacements() {
        let inventory = Inventory::new();
        let mut rx = inventory.subscribe();
        inventory.replace([proxy("a", "x")]);
        rx.changed().await.unwrap();
        assert_eq!(rx.borrow().len(), 1);
    }
}
