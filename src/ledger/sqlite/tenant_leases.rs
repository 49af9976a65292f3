//! A tenant's active leases in the writer's state, ordered by expiry, so that its quota usage
//! is read in time that does not grow with its leases: the leases that count at `now` are
//! those expiring after it, and the expired ones the sweep has not ended yet are few (they
//! are skipped from the front). The sets are persistent, so the readers' view after a batch
//! takes a copy of a tenant's in constant time.

use std::sync::Arc;

use imbl::OrdSet;

use crate::ledger::quota::TenantUsage;

/// `(expires_at, lease ID)` of one tenant's active leases, all and its gateway sessions'.
#[derive(Debug, Clone, Default)]
pub(super) struct TenantLeases {
    all: OrdSet<(i64, Arc<str>)>,
    sessions: OrdSet<(i64, Arc<str>)>,
}

impl TenantLeases {
    pub fn insert(&mut self, id: Arc<str>, expires_at: i64, session: bool) {
        if session {
            self.sessions.insert((expires_at, id.clone()));
        }
        self.all.insert((expires_at, id));
    }

    pub fn remove(&mut self, id: &Arc<str>, expires_at: i64) {
        let key = (expires_at, id.clone());
        self.sessions.remove(&key);
        self.all.remove(&key);
    }

    /// Moves a renewed lease from `from` to `to`.
    pub fn renew(&mut self, id: &Arc<str>, from: i64, to: i64) {
        let key = (from, id.clone());
        if self.sessions.remove(&key).is_some() {
            self.sessions.insert((to, id.clone()));
        }
        if self.all.remove(&key).is_some() {
            self.all.insert((to, id.clone()));
        }
    }

    pub fn is_empty(&self) -> bool {
        self.all.is_empty()
    }

    /// What the tenant's leases count against its quotas at `now` (its bytes are the
    /// state's).
    pub fn usage(&self, now: i64) -> TenantUsage {
        let (leases, earliest_expiry) = counting(&self.all, now);
        let (sessions, earliest_session_expiry) = counting(&self.sessions, now);
        TenantUsage {
            leases,
            sessions,
            earliest_expiry,
            earliest_session_expiry,
            bytes_today: 0,
        }
    }
}

/// How many of `leases` expire after `now`, and the earliest of those expiries.
fn counting(leases: &OrdSet<(i64, Arc<str>)>, now: i64) -> (u32, Option<i64>) {
    let expired = leases.iter().take_while(|(at, _)| *at <= now).count();
    let earliest = leases.iter().nth(expired).map(|(at, _)| *at);
    let count = leases.len().saturating_sub(expired);
    (u32::try_from(count).unwrap_or(u32::MAX), earliest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_leases_expiring_after_now_count_and_renewals_move_them() {
        let id = |n: u32| -> Arc<str> { format!("l{n}").into() };
        let mut leases = TenantLeases::default();
        leases.insert(id(1), 100, false);
        leases.insert(id(2), 200, true);
        leases.insert(id(3), 300, false);
        let usage = |leases: &TenantLeases, now| {
            let u = leases.usage(now);
            (
                u.leases,
                u.sessions,
                u.earliest_expiry,
                u.earliest_session_expiry,
            )
        };
        // (now, leases, sessions, earliest, earliest session)
        assert_eq!(usage(&leases, 50), (3, 1, Some(100), Some(200)));
        assert_eq!(usage(&leases, 100), (2, 1, Some(200), Some(200)));
        assert_eq!(usage(&leases, 250), (1, 0, Some(300), None));
        assert_eq!(usage(&leases, 300), (0, 0, None, None));

        leases.renew(&id(2), 200, 400);
        assert_eq!(usage(&leases, 250), (2, 1, Some(300), Some(400)));
        leases.renew(&id(9), 200, 500);
        assert_eq!(usage(&leases, 250), (2, 1, Some(300), Some(400)));

        leases.remove(&id(3), 300);
        leases.remove(&id(2), 400);
        assert_eq!(usage(&leases, 250), (0, 0, None, None));
        assert!(!leases.is_empty());
        leases.remove(&id(1), 100);
        assert!(leases.is_empty());
    }
}
