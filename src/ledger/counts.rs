//! What readers see of the lease state: the expiries of each proxy's active leases and the
//! cooldown ends, as of the last commit. The writer refreshes the entries a batch touched
//! after its COMMIT and before answering, so a caller that got its answer reads its own write;
//! counts are taken at the reader's `now`, because a lease stops counting by time alone.

use std::collections::HashMap;
use std::sync::Arc;

use super::state::{LedgerState, Touched};

/// Committed lease expiries and cooldown ends.
#[derive(Debug, Default)]
pub(crate) struct Counts {
    /// Expiries of the active leases of each proxy with one, by proxy UID.
    leases: HashMap<Arc<str>, Vec<i64>>,
    /// Cooldown end by `(proxy UID, target)`.
    cooldowns: HashMap<(Arc<str>, Arc<str>), i64>,
}

impl Counts {
    /// The view of a whole state (at open).
    pub fn of(state: &LedgerState) -> Counts {
        let mut counts = Counts::default();
        counts.refresh(state, &state.everything());
        counts
    }

    /// Copies the entries a committed batch touched from the writer's state.
    pub fn refresh(&mut self, state: &LedgerState, touched: &Touched) {
        for uid in &touched.proxies {
            let expiries: Vec<i64> = state.expiries(uid).collect();
            if expiries.is_empty() {
                self.leases.remove(uid);
            } else {
                self.leases.insert(uid.clone(), expiries);
            }
        }
        for (uid, target) in &touched.cooldowns {
            match state.cooldown(uid, target) {
                Some(until) => {
                    self.cooldowns.insert((uid.clone(), target.clone()), until);
                }
                None => {
                    self.cooldowns.remove(&(uid.clone(), target.clone()));
                }
            }
        }
    }

    /// Leases counting at `now`, by proxy UID (proxies without any are absent).
    pub fn active_counts(&self, now: i64) -> HashMap<String, u32> {
        self.leases
            .iter()
            .filter_map(|(uid, expiries)| {
                let active = counting(expiries, now);
                (active > 0).then(|| (uid.to_string(), active))
            })
            .collect()
    }

    /// Leases counting towards `uid`'s capacity at `now`.
    pub fn active_count(&self, uid: &str, now: i64) -> u32 {
        self.leases.get(uid).map_or(0, |e| counting(e, now))
    }

    /// Leases counting at `now`.
    pub fn active_total(&self, now: i64) -> u64 {
        self.leases
            .values()
            .map(|expiries| u64::from(counting(expiries, now)))
            .sum()
    }

    /// `(proxy, target)` pairs cooling down at `now`.
    pub fn cooldowns_active(&self, now: i64) -> u64 {
        let active = self
            .cooldowns
            .values()
            .filter(|&&until| until > now)
            .count();
        u64::try_from(active).unwrap_or(u64::MAX)
    }
}

fn counting(expiries: &[i64], now: i64) -> u32 {
    let active = expiries.iter().filter(|&&e| e > now).count();
    u32::try_from(active).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::state::ActiveLease;
    use crate::proxy::ProxyId;

    fn lease(uid: &str, expires_at: i64) -> ActiveLease {
        ActiveLease {
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
        }
    }

    #[test]
    fn counts_follow_commits_and_time() {
        let mut state = LedgerState::default();
        state.restore_lease("l1".into(), lease("a", 100));
        state.restore_cooldown("a", "t", 50);
        let mut counts = Counts::of(&state);
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
        counts.refresh(&state, &touched);
        assert_eq!(
            counts.active_counts(150),
            HashMap::from([("a".to_owned(), 1), ("b".to_owned(), 1)])
        );
        assert_eq!(counts.active_count("a", 0), 2);

        state.release("l3", 0);
        state.sweep(100);
        let touched = state.commit();
        counts.refresh(&state, &touched);
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
}
