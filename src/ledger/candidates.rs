//! The candidates of an acquire, kept in the order the selection ranks proxies by.
//!
//! An acquire grants the free candidate with the fewest active leases, then the lowest latency,
//! then the smallest name. The loads live in the ledger, but every other part of that order
//! belongs to the candidate itself: with the candidates kept sorted by it, the choice is the
//! first one in that order without a lease, so an acquire looks only at the candidates ahead of
//! its choice (those holding leases or cooling down for the target), however large the fleet.
//!
//! Both collections are persistent (their nodes are shared and copied on write): the list
//! handed to each acquire is a clone that costs nothing, and a changed verdict or latency
//! updates it in O(log n) instead of a new list of the whole fleet.

use std::cmp::Ordering;
use std::sync::Arc;
use std::time::Duration;

use imbl::{OrdSet, Vector};

use crate::resources::proxy::ProxyId;

/// A proxy an acquire may choose: every proxy matching the crawler's selector, healthy or not.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// The proxy; capacity is counted by its UID. Shared with the inventory, so building a
    /// candidate list copies no string.
    pub proxy: Arc<ProxyId>,
    /// How many leases it grants at once; 0 means never.
    pub max_leases: u32,
    /// Whether the health engine considers it healthy (unhealthy ones are only counted).
    pub healthy: bool,
    /// Whether its spec says `cordoned: true`: never chosen, only counted. (The flag sits in
    /// the struct's padding, so the candidate list takes no more memory for it.)
    pub cordoned: bool,
    /// Whether it is draining (being deleted, or its machine about to be replaced): never
    /// chosen, only counted. (In the padding too, like `cordoned`.)
    pub draining: bool,
    /// Latency of its last probe; proxies without one sort after those with one.
    pub latency: Option<Duration>,
}

/// The candidates that can never be chosen, whatever the ledger holds, by the reason a refusal
/// reports for each (the first that applies, in this order).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Excluded {
    /// `spec.cordoned: true`.
    pub cordoned: u32,
    /// Draining and not cordoned.
    pub draining: u32,
    /// Not healthy, and neither cordoned nor draining.
    pub unhealthy: u32,
    /// Healthy with `maxLeases: 0`: at capacity with no lease to wait for.
    pub no_slots: u32,
}

impl Excluded {
    /// The count `candidate` belongs to, or `None` when it may be chosen.
    fn count_of(&mut self, candidate: &Candidate) -> Option<&mut u32> {
        if candidate.cordoned {
            Some(&mut self.cordoned)
        } else if candidate.draining {
            Some(&mut self.draining)
        } else if !candidate.healthy {
            Some(&mut self.unhealthy)
        } else if candidate.max_leases == 0 {
            Some(&mut self.no_slots)
        } else {
            None
        }
    }
}

/// Every candidate of an acquire by position (the position a choice names), and those that
/// may be chosen ranked by their own part of the selection order: latency (unknown last),
/// name, namespace, UID, then position.
///
/// A pointer wide: requests carry it through the ledger's queues by value.
#[derive(Debug, Clone, Default)]
pub struct Candidates(Arc<Lists>);

#[derive(Debug, Clone, Default)]
struct Lists {
    all: Vector<Candidate>,
    ranked: OrdSet<Ranked>,
    excluded: Excluded,
}

/// A choosable candidate's place in the order, with what the selection reads of it (so a walk
/// of the order never looks the candidate up by position).
#[derive(Debug, Clone)]
pub(crate) struct Ranked {
    latency: Option<Duration>,
    /// The proxy; its load and cooldowns are looked up by its UID.
    pub proxy: Arc<ProxyId>,
    /// Its position among all the candidates: what a choice names.
    pub position: usize,
    /// Its `maxLeases` (never 0 here).
    pub max_leases: u32,
}

impl Ranked {
    fn of(position: usize, candidate: &Candidate) -> Self {
        Ranked {
            latency: candidate.latency,
            proxy: candidate.proxy.clone(),
            position,
            max_leases: candidate.max_leases,
        }
    }

    fn key(&self) -> (bool, Option<Duration>, &str, &str, &str, usize) {
        (
            self.latency.is_none(),
            self.latency,
            &self.proxy.name,
            &self.proxy.namespace,
            &self.proxy.uid,
            self.position,
        )
    }
}

impl Ord for Ranked {
    fn cmp(&self, other: &Self) -> Ordering {
        self.key().cmp(&other.key())
    }
}

impl PartialOrd for Ranked {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Ranked {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Ranked {}

impl Candidates {
    /// Number of candidates.
    pub fn len(&self) -> usize {
        self.0.all.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.0.all.is_empty()
    }

    /// The candidate at `position`.
    pub fn get(&self, position: usize) -> Option<&Candidate> {
        self.0.all.get(position)
    }

    /// Every candidate, by position.
    pub fn iter(&self) -> impl Iterator<Item = &Candidate> {
        self.0.all.iter()
    }

    /// Whether `other` is this very list, handed out again (not only an equal one).
    #[cfg(test)]
    pub(crate) fn shares(&self, other: &Candidates) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Replaces the candidate at `position` (nothing past the end).
    pub fn set(&mut self, position: usize, candidate: Candidate) {
        if position >= self.0.all.len() {
            return;
        }
        let lists = Arc::make_mut(&mut self.0);
        let previous = lists.all.set(position, candidate.clone());
        lists.leave(position, &previous);
        lists.enter(position, &candidate);
    }

    /// The candidates that can never be chosen, counted by reason.
    pub(crate) fn excluded(&self) -> Excluded {
        self.0.excluded
    }

    /// The candidates that may be chosen, best first by their own part of the order (the
    /// ledger's loads come first in the selection, before all of it).
    pub(crate) fn ranked(&self) -> impl Iterator<Item = &Ranked> {
        self.0.ranked.iter()
    }
}

impl Lists {
    fn enter(&mut self, position: usize, candidate: &Candidate) {
        match self.excluded.count_of(candidate) {
            Some(count) => *count += 1,
            None => {
                self.ranked.insert(Ranked::of(position, candidate));
            }
        }
    }

    fn leave(&mut self, position: usize, candidate: &Candidate) {
        match self.excluded.count_of(candidate) {
            Some(count) => *count = count.saturating_sub(1),
            None => {
                self.ranked.remove(&Ranked::of(position, candidate));
            }
        }
    }
}

impl FromIterator<Candidate> for Candidates {
    fn from_iter<I: IntoIterator<Item = Candidate>>(iter: I) -> Self {
        let mut lists = Lists {
            all: iter.into_iter().collect(),
            ..Lists::default()
        };
        let mut ranked = Vec::with_capacity(lists.all.len());
        for (position, candidate) in lists.all.iter().enumerate() {
            match lists.excluded.count_of(candidate) {
                Some(count) => *count += 1,
                None => ranked.push(Ranked::of(position, candidate)),
            }
        }
        lists.ranked = ranked.into_iter().collect();
        Candidates(Arc::new(lists))
    }
}

impl From<Vec<Candidate>> for Candidates {
    fn from(candidates: Vec<Candidate>) -> Self {
        candidates.into_iter().collect()
    }
}

impl From<&[Candidate]> for Candidates {
    fn from(candidates: &[Candidate]) -> Self {
        candidates.iter().cloned().collect()
    }
}

impl PartialEq for Candidates {
    fn eq(&self, other: &Self) -> bool {
        self.0.all == other.0.all
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::fixtures;

    fn candidate(name: &str, latency_ms: Option<u64>) -> Candidate {
        Candidate {
            latency: latency_ms.map(Duration::from_millis),
            ..fixtures::candidate(name, 2)
        }
    }

    fn ranked_names(candidates: &Candidates) -> Vec<String> {
        candidates.ranked().map(|r| r.proxy.name.clone()).collect()
    }

    #[test]
    #[cfg(target_pointer_width = "64")]
    fn the_cordoned_and_draining_flags_cost_a_candidate_no_memory() {
        // Acquires over large fleets read these lists in place: more flags must not make
        // each entry bigger (they fit next to `max_leases` and `healthy`).
        assert_eq!(std::mem::size_of::<Candidate>(), 32);
    }

    #[test]
    fn the_choosable_are_ranked_by_latency_then_name_and_the_rest_counted() {
        let mut cordoned = candidate("cordoned", Some(1));
        cordoned.cordoned = true;
        cordoned.draining = true;
        let mut draining = candidate("draining", Some(1));
        draining.draining = true;
        draining.healthy = false;
        let mut sick = candidate("sick", Some(1));
        sick.healthy = false;
        let mut closed = candidate("closed", Some(1));
        closed.max_leases = 0;
        let candidates = Candidates::from(vec![
            candidate("unknown", None),
            candidate("slow", Some(30)),
            cordoned,
            candidate("b-fast", Some(2)),
            draining,
            candidate("a-fast", Some(2)),
            sick,
            closed,
        ]);
        assert_eq!(
            ranked_names(&candidates),
            ["a-fast", "b-fast", "slow", "unknown"]
        );
        assert_eq!(
            candidates.ranked().map(|r| r.position).collect::<Vec<_>>(),
            [5, 3, 1, 0]
        );
        assert_eq!(
            candidates.excluded(),
            Excluded {
                cordoned: 1,
                draining: 1,
                unhealthy: 1,
                no_slots: 1,
            }
        );
        assert_eq!(candidates.len(), 8);
        assert_eq!(
            candidates.get(7).map(|c| c.proxy.name.as_str()),
            Some("closed")
        );
        assert_eq!(candidates.get(8), None);
    }

    #[test]
    fn a_set_moves_the_candidate_and_leaves_clones_as_they_were() {
        let mut candidates =
            Candidates::from(vec![candidate("a", Some(5)), candidate("b", Some(9))]);
        let before = candidates.clone();
        candidates.set(0, candidate("a", Some(20)));
        assert_eq!(ranked_names(&candidates), ["b", "a"]);
        assert_eq!(ranked_names(&before), ["a", "b"]);
        let mut sick = candidate("b", Some(9));
        sick.healthy = false;
        candidates.set(1, sick);
        assert_eq!(ranked_names(&candidates), ["a"]);
        assert_eq!(candidates.excluded().unhealthy, 1);
        // Past the end: nothing changes.
        candidates.set(2, candidate("c", Some(1)));
        assert_eq!(candidates.len(), 2);
        assert_eq!(ranked_names(&candidates), ["a"]);
    }

    /// Any sequence of updates leaves the same order and counts as building the final list
    /// afresh.
    #[test]
    fn updates_in_place_match_a_fresh_build() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let random = |rng: &mut rand::rngs::StdRng, i: usize| {
            let mut c = candidate(
                &format!("p{}", rng.random_range(0..5)),
                rng.random_bool(0.8).then(|| rng.random_range(1..4)),
            );
            c.healthy = rng.random_bool(0.8);
            c.cordoned = rng.random_bool(0.1);
            c.draining = rng.random_bool(0.1);
            c.max_leases = rng.random_range(0..3);
            Arc::make_mut(&mut c.proxy).uid = format!("uid-{i}");
            c
        };
        for case in 0..300 {
            let n = rng.random_range(0..20);
            let mut list: Vec<Candidate> = (0..n).map(|i| random(&mut rng, i)).collect();
            let mut candidates = Candidates::from(list.clone());
            for _ in 0..rng.random_range(0..30) {
                let position = rng.random_range(0..n.max(1));
                let c = random(&mut rng, position);
                if let Some(slot) = list.get_mut(position) {
                    *slot = c.clone();
                }
                candidates.set(position, c);
            }
            let fresh = Candidates::from(list);
            assert_eq!(candidates, fresh, "case {case}");
            assert_eq!(candidates.excluded(), fresh.excluded(), "case {case}");
            assert_eq!(
                candidates.ranked().map(|r| r.position).collect::<Vec<_>>(),
                fresh.ranked().map(|r| r.position).collect::<Vec<_>>(),
                "case {case}"
            );
        }
    }
}
