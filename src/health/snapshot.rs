//! The read-only view of proxy health that the health engine publishes and the API reads.
//!
//! Health changes on every probe, so an acquire reads it fresh; to do that for thousands of
//! candidates without hashing each identity, entries live in a dense table whose positions
//! ([`HealthTable::slot`]) stay put until a proxy is added or removed. [`HealthTable::layout`]
//! changes exactly then, so a reader may cache the positions of the proxies it cares about
//! for as long as the layout is unchanged; [`HealthTable::version`] also changes when a
//! proxy's verdict or latency does, so a reader may cache what it derived from those, and
//! [`HealthTable::changed_since`] says which positions changed since a version, so that
//! reader can update what it derived instead of deriving it again.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard};
use std::time::Duration;

use super::probe::ProbeErrorKind;
use crate::resources::proxy::ProxyId;

/// What is known about one proxy's health.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProxyHealth {
    /// `Some(true)` healthy, `Some(false)` unhealthy, `None` not decided yet.
    pub healthy: Option<bool>,
    /// Latency of the last probe.
    pub latency: Option<Duration>,
    /// When the last probe finished.
    pub last_probe: Option<jiff::Timestamp>,
    /// Why the last probe failed, if it did.
    pub last_error: Option<String>,
    /// The most recent failed probe of the current address (kept across later successes, so
    /// an unhealthy proxy that is recovering still says why it turned unhealthy).
    pub last_failure: Option<LastFailure>,
}

impl ProxyHealth {
    /// The most recent failure, while the proxy is unhealthy: why it is (none when healthy, not
    /// decided yet, or seeded unhealthy and not probed since).
    pub fn unhealthy_because(&self) -> Option<LastFailure> {
        self.last_failure.filter(|_| self.healthy == Some(false))
    }
}

/// Kind, status and time of a failed probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LastFailure {
    /// Why it failed.
    pub kind: ProbeErrorKind,
    /// The status the target answered, for an unexpected one.
    pub status: Option<u16>,
    /// When the probe finished.
    pub at: jiff::Timestamp,
}

/// Source of layout and version numbers unique across every table of the process, so a
/// cache built against one table can never be mistaken as valid for another.
static NEXT_LAYOUT: AtomicU64 = AtomicU64::new(1);

fn next_layout() -> u64 {
    NEXT_LAYOUT.fetch_add(1, Ordering::Relaxed)
}

/// Changes the journal keeps at least, however few proxies are tracked.
const MIN_JOURNAL: usize = 1024;

/// Health of every tracked proxy, by identity or by position.
#[derive(Debug)]
pub struct HealthTable {
    index: HashMap<ProxyId, usize>,
    slots: Vec<ProxyHealth>,
    layout: u64,
    version: u64,
    /// `(version, slot)` of each change of a verdict or latency in this layout, oldest first;
    /// at most as many as there are slots (or [`MIN_JOURNAL`]), so a fleet probed every 30 s
    /// keeps half a minute of changes or more.
    journal: VecDeque<(u64, usize)>,
    /// Every change after this version is in the journal.
    journal_since: u64,
}

impl Default for HealthTable {
    fn default() -> Self {
        let layout = next_layout();
        HealthTable {
            index: HashMap::new(),
            slots: Vec::new(),
            layout,
            version: layout,
            journal: VecDeque::new(),
            journal_since: layout,
        }
    }
}

impl HealthTable {
    /// Health of one proxy.
    pub fn get(&self, id: &ProxyId) -> Option<&ProxyHealth> {
        self.slot(id).and_then(|slot| self.slots.get(slot))
    }

    /// Position of a proxy's entry; valid while [`layout`](Self::layout) is unchanged.
    pub fn slot(&self, id: &ProxyId) -> Option<usize> {
        self.index.get(id).copied()
    }

    /// The entry at a position from [`slot`](Self::slot) of the same layout.
    pub fn at(&self, slot: usize) -> Option<&ProxyHealth> {
        self.slots.get(slot)
    }

    /// Changes whenever proxies are added or removed (positions move); unique per process.
    pub fn layout(&self) -> u64 {
        self.layout
    }

    /// Changes whenever the layout does or a proxy's verdict or latency changes (not when
    /// only the probe time or error text does); unique per process.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The positions whose verdict or latency changed after `version` (a version of this
    /// layout), in the order they changed, a position once per change; `None` when that is
    /// no longer known (the version is of another layout, or older than the journal).
    pub fn changed_since(&self, version: u64) -> Option<impl Iterator<Item = usize> + '_> {
        if version < self.journal_since || version > self.version {
            return None;
        }
        let start = self.journal.partition_point(|&(v, _)| v <= version);
        Some(self.journal.range(start..).map(|&(_, slot)| slot))
    }

    /// Number of tracked proxies.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether no proxy is tracked.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    fn set(&mut self, id: ProxyId, health: ProxyHealth) {
        if let Some(position) = self.slot(&id)
            && let Some(slot) = self.slots.get_mut(position)
        {
            let changed = (slot.healthy, slot.latency) != (health.healthy, health.latency);
            *slot = health;
            if changed {
                self.version = next_layout();
                self.note(position);
            }
            return;
        }
        self.index.insert(id, self.slots.len());
        self.slots.push(health);
        self.new_layout();
    }

    /// Journals a change of the slot at `position`, made at the current version.
    fn note(&mut self, position: usize) {
        if self.journal.len() >= self.slots.len().max(MIN_JOURNAL)
            && let Some((dropped, _)) = self.journal.pop_front()
        {
            self.journal_since = dropped;
        }
        self.journal.push_back((self.version, position));
    }

    /// Positions moved: every reader derives again, and the journal starts over.
    fn new_layout(&mut self) {
        self.layout = next_layout();
        self.version = self.layout;
        self.journal.clear();
        self.journal_since = self.version;
    }

    fn retain(&mut self, mut keep: impl FnMut(&ProxyId) -> bool) {
        let before = self.slots.len();
        let mut kept: Vec<(ProxyId, usize)> =
            self.index.drain().filter(|(id, _)| keep(id)).collect();
        if kept.len() == before {
            self.index = kept.into_iter().collect();
            return;
        }
        kept.sort_unstable_by_key(|&(_, slot)| slot);
        let mut old = std::mem::take(&mut self.slots).into_iter().enumerate();
        for (id, slot) in kept {
            if let Some((_, health)) = old.find(|&(i, _)| i == slot) {
                self.index.insert(id, self.slots.len());
                self.slots.push(health);
            }
        }
        self.new_layout();
    }
}

/// Shared table of proxy health. The engine is the only writer.
#[derive(Debug, Clone, Default)]
pub struct HealthSnapshot {
    inner: Arc<RwLock<HealthTable>>,
}

impl HealthSnapshot {
    /// An empty snapshot.
    pub fn new() -> Self {
        Self::default()
    }

    /// Health of one proxy.
    pub fn get(&self, id: &ProxyId) -> Option<ProxyHealth> {
        self.read().get(id).cloned()
    }

    /// A read guard over the whole table, for readers that look up many proxies at once.
    pub fn read(&self) -> RwLockReadGuard<'_, HealthTable> {
        self.inner.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records the health of one proxy.
    pub fn set(&self, id: ProxyId, health: ProxyHealth) {
        self.inner
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .set(id, health);
    }

    /// Drops every proxy for which `keep` is false.
    pub fn retain(&self, keep: impl FnMut(&ProxyId) -> bool) {
        self.inner
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(keep);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(name: &str) -> ProxyId {
        ProxyId {
            namespace: "default".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
        }
    }

    fn latency(ms: u64) -> ProxyHealth {
        ProxyHealth {
            healthy: Some(true),
            latency: Some(Duration::from_millis(ms)),
            ..Default::default()
        }
    }

    #[test]
    fn set_get_and_retain() {
        let snapshot = HealthSnapshot::new();
        snapshot.set(id("a"), latency(12));
        snapshot.set(id("b"), ProxyHealth::default());
        assert_eq!(snapshot.get(&id("a")), Some(latency(12)));
        snapshot.retain(|i| i.name == "b");
        assert_eq!(snapshot.get(&id("a")), None);
        assert_eq!(snapshot.get(&id("b")), Some(ProxyHealth::default()));
        assert_eq!(snapshot.read().len(), 1);
    }

    #[test]
    fn positions_hold_until_the_layout_changes() {
        let snapshot = HealthSnapshot::new();
        for (name, ms) in [("a", 1), ("b", 2), ("c", 3), ("d", 4)] {
            snapshot.set(id(name), latency(ms));
        }
        let (layout, slot_c) = {
            let table = snapshot.read();
            (table.layout(), table.slot(&id("c")).unwrap())
        };
        // An update in place keeps the layout and the positions; the version follows the
        // verdict and latency only.
        let version = snapshot.read().version();
        snapshot.set(id("c"), latency(30));
        let version = {
            let table = snapshot.read();
            assert_eq!(table.layout(), layout);
            assert_eq!(table.at(slot_c), Some(&latency(30)));
            assert_ne!(table.version(), version);
            table.version()
        };
        let c = ProxyHealth {
            last_error: Some("same verdict, same latency".into()),
            ..latency(30)
        };
        snapshot.set(id("c"), c.clone());
        assert_eq!(snapshot.read().version(), version);
        // Keeping everything changes nothing.
        snapshot.retain(|_| true);
        assert_eq!(snapshot.read().layout(), layout);
        assert_eq!(snapshot.read().version(), version);
        // Removing one moves the others: a new layout, and every entry is still found.
        snapshot.retain(|i| i.name != "b");
        let table = snapshot.read();
        assert_ne!(table.layout(), layout);
        for (name, expected) in [("a", Some(latency(1))), ("b", None), ("c", Some(c))] {
            assert_eq!(table.get(&id(name)), expected.as_ref(), "{name}");
            let by_slot = table.slot(&id(name)).and_then(|s| table.at(s));
            assert_eq!(by_slot, expected.as_ref(), "{name}");
        }
        drop(table);
        // Adding one changes the layout too; layouts are unique across tables.
        let before = snapshot.read().layout();
        snapshot.set(id("e"), latency(5));
        assert_ne!(snapshot.read().layout(), before);
        let table = snapshot.read();
        assert_eq!(table.version(), table.layout());
        drop(table);
        assert_ne!(
            HealthSnapshot::new().read().layout(),
            snapshot.read().layout()
        );
    }

    #[test]
    fn the_journal_names_the_positions_changed_since_a_version() {
        let snapshot = HealthSnapshot::new();
        snapshot.set(id("a"), latency(1));
        snapshot.set(id("b"), latency(1));
        let version = || snapshot.read().version();
        let changed = |since| {
            snapshot
                .read()
                .changed_since(since)
                .map(|slots| slots.collect::<Vec<_>>())
        };
        let (a, b) = {
            let table = snapshot.read();
            (table.slot(&id("a")).unwrap(), table.slot(&id("b")).unwrap())
        };
        let start = version();
        assert_eq!(changed(start), Some(vec![]));
        snapshot.set(id("b"), latency(2));
        let after_b = version();
        snapshot.set(id("a"), latency(2));
        // Only the error text or probe time: no change.
        snapshot.set(
            id("a"),
            ProxyHealth {
                last_error: Some("slow".into()),
                ..latency(2)
            },
        );
        assert_eq!(changed(start), Some(vec![b, a]));
        assert_eq!(changed(after_b), Some(vec![a]));
        assert_eq!(changed(version()), Some(vec![]));
        // A version this table never had, or one of an earlier layout: not known.
        assert_eq!(changed(version() + 1_000_000), None);
        snapshot.set(id("c"), latency(1));
        assert_eq!(changed(after_b), None);
        // The journal keeps the newest changes only.
        let before = version();
        snapshot.set(id("a"), latency(10));
        let first = version();
        for i in 0..MIN_JOURNAL {
            snapshot.set(id("a"), latency(11 + (i % 2) as u64));
        }
        assert_eq!(changed(before), None);
        let kept = changed(first).expect("the newest changes are kept");
        assert_eq!(kept.len(), MIN_JOURNAL);
    }
}
