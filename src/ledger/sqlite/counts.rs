//! What readers see of the lease state: the expiries of each proxy's active leases and the
//! cooldown ends, as of the last commit. The writer refreshes the entries a batch touched
//! after its COMMIT and before answering, so a caller that got its answer reads its own write;
//! counts are taken at the reader's `now`, because a lease stops counting by time alone.
//!
//! # Cooldowns per target
//!
//! The view also keeps the cooldown ends of each target, and after each commit that changed a
//! cooldown the writer ranks the targets by cooldowns in force ([`rank_targets`]): the
//! [`NAMED_TARGETS`] with the most, and the sum over the rest. A reader copies that ranking
//! (at most 51 numbers) while it is exact, that is until the first cooldown it counted ends;
//! after that, until the next commit that changes a cooldown (a report, or the sweep removing
//! the ended ones), the reader ranks the targets itself at its own `now` (one binary search
//! per target). Either way an ended cooldown never counts, as in
//! [`cooldowns_active`](Counts::cooldowns_active).

use std::collections::HashMap;
use std::sync::Arc;

use super::state::{LedgerState, Touched};
use super::tenant_leases::TenantLeases;
use crate::ledger::counts::CountsView;
use crate::ledger::quota::TenantUsage;
use crate::ledger::targets::{NAMED_TARGETS, TargetCooldowns, rank_targets};

/// The ranking the writer made at its last commit that changed a cooldown.
#[derive(Debug, Default)]
struct Ranking {
    targets: TargetCooldowns,
    /// The writer's clock when it ranked.
    as_of: i64,
    /// The first end among the cooldowns it counted (`i64::MAX`: none): from then on it
    /// would count an ended cooldown.
    exact_until: i64,
}

impl Ranking {
    fn is_exact_at(&self, now: i64) -> bool {
        self.as_of <= now && now < self.exact_until
    }
}

/// Committed lease expiries and cooldown ends.
#[derive(Debug, Default)]
pub(crate) struct Counts {
    /// Expiries of the active leases of each proxy with one, by proxy UID.
    leases: HashMap<Arc<str>, Vec<i64>>,
    /// The active leases of each tenant with one.
    tenants: HashMap<Arc<str>, TenantLeases>,
    /// Cooldown end by `(proxy UID, target)`.
    cooldowns: HashMap<(Arc<str>, Arc<str>), i64>,
    /// The same cooldown ends by target, sorted (ended ones stay until the sweep removes them).
    by_target: HashMap<Arc<str>, Vec<i64>>,
    ranking: Ranking,
}

impl Counts {
    /// The view of a whole state (at open), ranked at `now`.
    pub fn of(state: &LedgerState, now: i64) -> Counts {
        let mut counts = Counts::default();
        counts.refresh(state, &state.everything(), now);
        counts
    }

    /// Copies the entries a committed batch touched from the writer's state, and ranks the
    /// targets at `now` (the writer's clock) when a cooldown changed.
    pub fn refresh(&mut self, state: &LedgerState, touched: &Touched, now: i64) {
        for uid in &touched.proxies {
            let expiries: Vec<i64> = state.expiries(uid).collect();
            if expiries.is_empty() {
                self.leases.remove(uid);
            } else {
                self.leases.insert(uid.clone(), expiries);
            }
        }
        for tenant in &touched.tenants {
            match state.tenant_leases(tenant) {
                Some(leases) => self.tenants.insert(tenant.clone(), leases),
                None => self.tenants.remove(tenant),
            };
        }
        for (uid, target) in &touched.cooldowns {
            let key = (uid.clone(), target.clone());
            let until = state.cooldown(uid, target);
            let previous = match until {
                Some(until) => self.cooldowns.insert(key, until),
                None => self.cooldowns.remove(&key),
            };
            if previous != until {
                self.move_end(target, previous, until);
            }
        }
        if !touched.cooldowns.is_empty() || self.ranking.as_of > now {
            self.rank(now);
        }
    }

    /// Replaces one cooldown end of `target` in its sorted list.
    fn move_end(&mut self, target: &Arc<str>, previous: Option<i64>, until: Option<i64>) {
        let ends = self.by_target.entry(target.clone()).or_default();
        if let Some(previous) = previous
            && let Ok(at) = ends.binary_search(&previous)
        {
            ends.remove(at);
        }
        if let Some(until) = until {
            let at = ends.partition_point(|&end| end <= until);
            ends.insert(at, until);
        }
        if ends.is_empty() {
            self.by_target.remove(target);
        }
    }

    fn rank(&mut self, now: i64) {
        let exact_until = self
            .by_target
            .values()
            .filter_map(|ends| in_force(ends, now).first().copied())
            .min()
            .unwrap_or(i64::MAX);
        self.ranking = Ranking {
            targets: self.rank_at(now),
            as_of: now,
            exact_until,
        };
    }

    fn rank_at(&self, now: i64) -> TargetCooldowns {
        let counts = self.by_target.iter().map(|(target, ends)| {
            let count = u64::try_from(in_force(ends, now).len()).unwrap_or(u64::MAX);
            (target.clone(), count)
        });
        rank_targets(counts, NAMED_TARGETS)
    }
}

/// From memory, as of the last commit.
impl CountsView for Counts {
    /// Cooldowns in force at `now` per target, bounded (see the module documentation): a copy
    /// of the writer's ranking while it is exact, else ranked here.
    fn target_cooldowns(&self, now: i64) -> TargetCooldowns {
        if self.ranking.is_exact_at(now) {
            self.ranking.targets.clone()
        } else {
            self.rank_at(now)
        }
    }

    /// Leases counting at `now`, by proxy UID (proxies without any are absent).
    fn active_counts(&self, now: i64) -> HashMap<String, u32> {
        self.leases
            .iter()
            .filter_map(|(uid, expiries)| {
                let active = counting(expiries, now);
                (active > 0).then(|| (uid.to_string(), active))
            })
            .collect()
    }

    /// Leases counting towards `uid`'s capacity at `now`.
    fn active_count(&self, uid: &str, now: i64) -> u32 {
        self.leases.get(uid).map_or(0, |e| counting(e, now))
    }

    /// Leases counting at `now`.
    fn active_total(&self, now: i64) -> u64 {
        self.leases
            .values()
            .map(|expiries| u64::from(counting(expiries, now)))
            .sum()
    }

    /// Whether `(uid, target)` is cooling down at `now`.
    fn in_cooldown(&self, uid: &str, target: &str, now: i64) -> bool {
        self.cooldowns
            .get(&(Arc::from(uid), Arc::from(target)))
            .is_some_and(|&until| until > now)
    }

    /// `(proxy, target)` pairs cooling down at `now`: the ranking's total while it is exact.
    fn cooldowns_active(&self, now: i64) -> u64 {
        if self.ranking.is_exact_at(now) {
            return self.ranking.targets.total();
        }
        let active = self
            .cooldowns
            .values()
            .filter(|&&until| until > now)
            .count();
        u64::try_from(active).unwrap_or(u64::MAX)
    }

    /// Every tenant's leases counting at `now`.
    fn tenant_usage(&self, now: i64) -> HashMap<String, TenantUsage> {
        let mut usage = HashMap::new();
        for (tenant, leases) in &self.tenants {
            let held = leases.usage(now);
            if held.leases > 0 {
                usage.insert(tenant.to_string(), held);
            }
        }
        usage
    }
}

/// The ends of a target's cooldowns (sorted) that are still in force at `now`.
fn in_force(ends: &[i64], now: i64) -> &[i64] {
    &ends[ends.partition_point(|&end| end <= now)..]
}

fn counting(expiries: &[i64], now: i64) -> u32 {
    let active = expiries.iter().filter(|&&e| e > now).count();
    u32::try_from(active).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::DEFAULT_TENANT;
    use crate::ledger::sqlite::state::ActiveLease;
    use crate::resources::proxy::ProxyId;

    fn lease(uid: &str, expires_at: i64) -> ActiveLease {
        ActiveLease {
            client: None,
            proxy: Arc::new(ProxyId {
                namespace: "crawl".into(),
                name: uid.into(),
                uid: uid.into(),
            }),
            target: None,
            acquired_at: 0,
            expires_at,
            ttl_ms: expires_at,
            request_id: None,
            tenant: DEFAULT_TENANT.into(),
            session: None,
        }
    }

    #[test]
    fn counts_follow_commits_and_time() {
        let mut state = LedgerState::default();
        state.restore_lease("l1".into(), lease("a", 100));
        state.restore_cooldown("a", "t", 50);
        let mut counts = Counts::of(&state, 0);
        let cases = [(0, 1, 1), (49, 1, 1), (50, 1, 0), (100, 0, 0)];
        for (now, leases, cooldowns) in cases {
            assert_eq!(counts.active_total(now), leases, "at {now}");
            assert_eq!(counts.cooldowns_active(now), cooldowns, "at {now}");
        }

        state.grant("l2".into(), lease("a", 200), None);
        state.grant("l3".into(), lease("b", 200), None);
        assert_eq!(
            counts.active_total(0),
            1,
            "nothing is seen before the commit"
        );
        let touched = state.commit();
        counts.refresh(&state, &touched, 0);
        assert_eq!(
            counts.active_counts(150),
            HashMap::from([("a".to_owned(), 1), ("b".to_owned(), 1)])
        );
        assert_eq!(counts.active_count("a", 0), 2);

        state.release("l3", DEFAULT_TENANT, 0);
        state.sweep(100);
        let touched = state.commit();
        counts.refresh(&state, &touched, 0);
        assert_eq!(
            counts.active_counts(0),
            HashMap::from([("a".to_owned(), 1)])
        );
        assert_eq!(
            counts.cooldowns_active(0),
            0,
            "the sweep removed the ended cooldown"
        );
    }

    #[test]
    fn target_cooldowns_stop_counting_when_they_end() {
        let mut state = LedgerState::default();
        state.restore_cooldown("a", "t", 50);
        state.restore_cooldown("b", "t", 80);
        state.restore_cooldown("a", "u", 100);
        let mut counts = Counts::of(&state, 0);
        let named = |counts: &Counts, now| -> Vec<(String, u64)> {
            let ranked = counts.target_cooldowns(now);
            assert_eq!(ranked.other, 0);
            assert_eq!(ranked.total(), counts.cooldowns_active(now), "at {now}");
            ranked
                .named
                .iter()
                .map(|(t, c)| (t.to_string(), *c))
                .collect()
        };
        let cases: [(i64, &[(&str, u64)]); 5] = [
            (0, &[("t", 2), ("u", 1)]),
            (49, &[("t", 2), ("u", 1)]),
            // Past the writer's ranking: ranked at the reader's now, before any sweep.
            (50, &[("t", 1), ("u", 1)]),
            (80, &[("u", 1)]),
            (100, &[]),
        ];
        for (now, want) in cases {
            let want: Vec<(String, u64)> = want.iter().map(|&(t, c)| (t.into(), c)).collect();
            assert_eq!(named(&counts, now), want, "at {now}");
        }

        // A later report extends (b, t) and adds (b, u); the sweep at 60 removed (a, t).
        state.sweep(60);
        state.cool_down("b", "t", 200);
        state.cool_down("b", "u", 150);
        let touched = state.commit();
        counts.refresh(&state, &touched, 60);
        let cases: [(i64, &[(&str, u64)]); 4] = [
            (60, &[("u", 2), ("t", 1)]),
            (100, &[("t", 1), ("u", 1)]),
            (150, &[("t", 1)]),
            (200, &[]),
        ];
        for (now, want) in cases {
            let want: Vec<(String, u64)> = want.iter().map(|&(t, c)| (t.into(), c)).collect();
            assert_eq!(named(&counts, now), want, "at {now}");
        }

        // Once the sweep has removed every cooldown, no target is left behind.
        state.sweep(200);
        let touched = state.commit();
        counts.refresh(&state, &touched, 200);
        assert!(counts.by_target.is_empty());
        assert_eq!(counts.target_cooldowns(0), TargetCooldowns::default());
    }
}
