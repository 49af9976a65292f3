//! What the synchronous counts of the PostgreSQL ledger read: a snapshot of the active
//! leases and cooldowns in force, taken from the database every refresh (other replicas
//! write there too) and moved at once by this replica's own writes, so a caller reads its own
//! write. Counts are taken at the reader's `now`, since a lease stops counting by time alone.
//!
//! A refresh reads the database while this replica keeps writing; the writes it made since
//! the refresh's read began are applied again on top of the new snapshot, so a refresh never
//! hides a write this replica answered. Other replicas' writes show after the next refresh.

use std::collections::HashMap;
use std::sync::Arc;

use jiff::Timestamp;

use crate::ledger::counts::CountsView;
use crate::ledger::quota::TenantUsage;
use crate::ledger::selection::ProxyLoad;
use crate::ledger::targets::{NAMED_TARGETS, TargetCooldowns, rank_targets};

/// One change this replica made, replayed onto a refresh that began before it.
#[derive(Debug, Clone)]
pub(crate) enum Change {
    /// A lease now counts until `expires_at` (a grant or a renew).
    Lease {
        id: Arc<str>,
        uid: Arc<str>,
        expires_at: i64,
        /// Its tenant, and whether it is a gateway session's.
        tenant: Arc<str>,
        session: bool,
    },
    /// A lease no longer counts (released or ended).
    Ended { id: Arc<str> },
    /// `(proxy, target)` cools down until `until` (or later, if it already did).
    Cooldown {
        uid: Arc<str>,
        target: Arc<str>,
        until: i64,
    },
}

/// Active leases and cooldowns, as of the last refresh plus this replica's writes since.
#[derive(Debug, Default)]
pub(crate) struct Counts {
    /// Each active lease, by lease ID.
    leases: HashMap<Arc<str>, Counted>,
    /// Expiry by lease ID, by proxy UID.
    by_proxy: HashMap<Arc<str>, HashMap<Arc<str>, i64>>,
    /// Cooldown end by `(proxy UID, target)`.
    cooldowns: HashMap<(Arc<str>, Arc<str>), i64>,
    /// Changes made since the oldest refresh still reading, numbered.
    recent: Vec<(u64, Change)>,
    /// Number of the last change.
    sequence: u64,
}

/// What the counts keep of one active lease.
#[derive(Debug, Clone)]
struct Counted {
    uid: Arc<str>,
    expires_at: i64,
    tenant: Arc<str>,
    session: bool,
}

/// One active lease a refresh read: ID, proxy UID, expiry, tenant, and whether it is a
/// gateway session's.
pub(crate) type SnapshotLease = (String, String, i64, String, bool);

/// What a refresh read from the database.
#[derive(Debug, Default)]
pub(crate) struct Snapshot {
    /// The active leases.
    pub leases: Vec<SnapshotLease>,
    /// `(proxy UID, target, until)` of the cooldowns.
    pub cooldowns: Vec<(String, String, i64)>,
}

impl Counts {
    /// Records a change this replica made and applies it.
    pub fn change(&mut self, change: Change) {
        self.sequence += 1;
        self.apply(&change);
        self.recent.push((self.sequence, change));
    }

    /// The number a refresh notes before it reads, to replay later changes onto its result.
    pub fn begin_refresh(&self) -> u64 {
        self.sequence
    }

    /// Replaces the counts with what a refresh that began at `began` read, then replays the
    /// changes made since.
    pub fn finish_refresh(&mut self, began: u64, snapshot: Snapshot) {
        let recent = std::mem::take(&mut self.recent);
        self.leases.clear();
        self.by_proxy.clear();
        self.cooldowns.clear();
        for (id, uid, expires_at, tenant, session) in snapshot.leases {
            self.apply(&Change::Lease {
                id: id.into(),
                uid: uid.into(),
                expires_at,
                tenant: tenant.into(),
                session,
            });
        }
        for (uid, target, until) in snapshot.cooldowns {
            self.cooldowns.insert((uid.into(), target.into()), until);
        }
        self.recent = recent.into_iter().filter(|(n, _)| *n > began).collect();
        for (_, change) in self.recent.clone() {
            self.apply(&change);
        }
    }

    fn apply(&mut self, change: &Change) {
        match change {
            Change::Lease {
                id,
                uid,
                expires_at,
                tenant,
                session,
            } => {
                self.remove(id);
                let counted = Counted {
                    uid: uid.clone(),
                    expires_at: *expires_at,
                    tenant: tenant.clone(),
                    session: *session,
                };
                self.leases.insert(id.clone(), counted);
                self.by_proxy
                    .entry(uid.clone())
                    .or_default()
                    .insert(id.clone(), *expires_at);
            }
            Change::Ended { id } => self.remove(id),
            Change::Cooldown { uid, target, until } => {
                let end = self
                    .cooldowns
                    .entry((uid.clone(), target.clone()))
                    .or_insert(*until);
                *end = (*end).max(*until);
            }
        }
    }

    fn remove(&mut self, id: &str) {
        if let Some(Counted { uid, .. }) = self.leases.remove(id)
            && let Some(leases) = self.by_proxy.get_mut(&uid)
        {
            leases.remove(id);
            if leases.is_empty() {
                self.by_proxy.remove(&uid);
            }
        }
    }

    /// The load of every proxy with a lease counting at `now`: what an acquire batch starts
    /// its selection from.
    pub fn loads(&self, now: i64) -> HashMap<String, ProxyLoad> {
        self.by_proxy
            .iter()
            .filter_map(|(uid, leases)| {
                let active = counting(leases, now);
                let earliest = leases
                    .values()
                    .filter(|e| **e > now)
                    .min()
                    .and_then(|&ms| Timestamp::from_millisecond(ms).ok());
                (active > 0).then(|| {
                    let load = ProxyLoad {
                        active,
                        earliest_expiry: earliest,
                    };
                    (uid.to_string(), load)
                })
            })
            .collect()
    }
}

/// From the snapshot, moved by this replica's writes.
impl CountsView for Counts {
    /// Leases of `uid` counting at `now`.
    fn active_count(&self, uid: &str, now: i64) -> u32 {
        self.by_proxy
            .get(uid)
            .map_or(0, |leases| counting(leases, now))
    }

    /// Leases counting at `now`, by proxy UID (proxies without one are absent).
    fn active_counts(&self, now: i64) -> HashMap<String, u32> {
        self.loads(now)
            .into_iter()
            .map(|(uid, load)| (uid, load.active))
            .collect()
    }

    /// Every lease counting at `now`.
    fn active_total(&self, now: i64) -> u64 {
        self.leases.values().filter(|l| l.expires_at > now).count() as u64
    }

    /// Whether `(uid, target)` cools down at `now`.
    fn in_cooldown(&self, uid: &str, target: &str, now: i64) -> bool {
        self.cooldowns
            .get(&(Arc::from(uid), Arc::from(target)))
            .is_some_and(|until| *until > now)
    }

    /// Cooldowns in force at `now`.
    fn cooldowns_active(&self, now: i64) -> u64 {
        self.cooldowns
            .values()
            .filter(|until| **until > now)
            .count() as u64
    }

    /// Cooldowns in force at `now` per target, ranked as the metric shows them.
    fn target_cooldowns(&self, now: i64) -> TargetCooldowns {
        let mut per_target: HashMap<Arc<str>, u64> = HashMap::new();
        for ((_, target), until) in &self.cooldowns {
            if *until > now {
                *per_target.entry(target.clone()).or_default() += 1;
            }
        }
        rank_targets(per_target, NAMED_TARGETS)
    }

    /// Every tenant's leases counting at `now`.
    fn tenant_usage(&self, now: i64) -> HashMap<String, TenantUsage> {
        let mut usage: HashMap<String, TenantUsage> = HashMap::new();
        for lease in self.leases.values().filter(|l| l.expires_at > now) {
            usage
                .entry(lease.tenant.to_string())
                .or_default()
                .count(lease.expires_at, lease.session);
        }
        usage
    }
}

fn counting(leases: &HashMap<Arc<str>, i64>, now: i64) -> u32 {
    let n = leases.values().filter(|e| **e > now).count();
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(id: &str, uid: &str, expires_at: i64) -> Change {
        Change::Lease {
            id: id.into(),
            uid: uid.into(),
            expires_at,
            tenant: "default".into(),
            session: false,
        }
    }

    #[test]
    fn counts_follow_writes_and_time() {
        let mut counts = Counts::default();
        counts.change(lease("l1", "p", 100));
        counts.change(lease("l2", "p", 200));
        counts.change(lease("l3", "q", 300));
        assert_eq!(counts.active_count("p", 50), 2);
        assert_eq!(counts.active_count("p", 150), 1, "l1 expired by time");
        assert_eq!(counts.active_total(150), 2);
        counts.change(Change::Ended { id: "l2".into() });
        assert_eq!(counts.active_count("p", 50), 1);
        assert_eq!(
            counts.active_counts(150),
            HashMap::from([("q".to_owned(), 1)]),
            "a proxy whose leases all expired is absent"
        );
        counts.change(lease("l4", "q", 250));
        assert_eq!(
            counts.loads(150).get("q"),
            Some(&ProxyLoad {
                active: 2,
                earliest_expiry: Timestamp::from_millisecond(250).ok(),
            }),
            "the earliest expiry of the leases still counting"
        );
        counts.change(Change::Ended { id: "l4".into() });
        counts.change(lease("l1", "p", 400));
        assert_eq!(counts.active_count("p", 150), 1, "a renew moves the expiry");
        counts.change(Change::Cooldown {
            uid: "p".into(),
            target: "t".into(),
            until: 500,
        });
        counts.change(Change::Cooldown {
            uid: "p".into(),
            target: "t".into(),
            until: 450,
        });
        assert!(counts.in_cooldown("p", "t", 470), "the later end is kept");
        assert!(!counts.in_cooldown("p", "t", 500));
        assert_eq!(counts.cooldowns_active(100), 1);
        assert_eq!(counts.target_cooldowns(100).total(), 1);
        assert_eq!(counts.target_cooldowns(600).total(), 0);
    }

    #[test]
    fn a_refresh_keeps_the_writes_made_while_it_read() {
        let mut counts = Counts::default();
        counts.change(lease("before", "p", 100));
        let began = counts.begin_refresh();
        // While the refresh reads: this replica grants one lease and ends the one before.
        counts.change(lease("during", "p", 100));
        counts.change(Change::Ended {
            id: "before".into(),
        });
        // The read saw the lease from before and one another replica granted, not the rest.
        counts.finish_refresh(
            began,
            Snapshot {
                leases: vec![
                    ("before".into(), "p".into(), 100, "default".into(), false),
                    ("other".into(), "q".into(), 100, "team-b".into(), true),
                ],
                cooldowns: vec![("q".into(), "t".into(), 100)],
            },
        );
        assert_eq!(counts.active_count("p", 0), 1, "during only");
        assert_eq!(counts.active_count("q", 0), 1);
        let usage = counts.tenant_usage(0);
        assert_eq!(usage["team-b"].sessions, 1);
        assert_eq!(usage["default"].leases, 1);
        assert!(counts.in_cooldown("q", "t", 0));
        // The next refresh sees the database as it is; nothing is replayed twice.
        let began = counts.begin_refresh();
        counts.finish_refresh(
            began,
            Snapshot {
                leases: vec![("during".into(), "p".into(), 100, "default".into(), false)],
                cooldowns: vec![],
            },
        );
        assert_eq!(counts.active_total(0), 1);
        assert!(!counts.in_cooldown("q", "t", 0));
    }
}
