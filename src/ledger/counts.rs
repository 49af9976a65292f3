//! The synchronous counts every backend answers from memory (active leases, cooldowns), read
//! through one view so the hot paths (every proxy list, metrics scrape and reconcile) never
//! wait for a round trip, whichever ledger is behind them.

use std::collections::HashMap;
use std::sync::{PoisonError, RwLock, RwLockReadGuard};

use super::clock::Clock;
use super::quota::TenantUsage;
use super::targets::TargetCooldowns;

/// What a backend's counts answer at a moment `now` (milliseconds): a lease counts while
/// `expires_at > now` and a cooldown while `until > now`, so the reader's own clock decides.
pub(crate) trait CountsView {
    /// Leases counting, by proxy UID (proxies without any are absent).
    fn active_counts(&self, now: i64) -> HashMap<String, u32>;

    /// Leases counting towards `uid`'s capacity.
    fn active_count(&self, uid: &str, now: i64) -> u32;

    /// Every lease counting.
    fn active_total(&self, now: i64) -> u64;

    /// Whether `(uid, target)` cools down.
    fn in_cooldown(&self, uid: &str, target: &str, now: i64) -> bool;

    /// `(proxy, target)` pairs cooling down.
    fn cooldowns_active(&self, now: i64) -> u64;

    /// Cooldowns in force per target, ranked as the metric shows them.
    fn target_cooldowns(&self, now: i64) -> TargetCooldowns;

    /// What each tenant with a lease counting holds (tenants without one are absent).
    fn tenant_usage(&self, now: i64) -> HashMap<String, TenantUsage>;
}

/// A read of a ledger's counts at one moment ([`Ledger::counts`](super::Ledger::counts)).
///
/// It holds the backend's read lock, so it must be short-lived: take it, read, drop it
/// (`ledger.counts().active_count(uid)`). While it lives the backend cannot record a write
/// in its counts, so never keep it across an `.await` or a call into the ledger; it is not
/// `Send`, which keeps it out of any future that must be.
pub struct LedgerCounts<'a> {
    counts: RwLockReadGuard<'a, dyn CountsView + 'a>,
    now: i64,
}

impl<'a> LedgerCounts<'a> {
    /// Reads `counts`, then `clock`'s time, which every answer is given at.
    pub(crate) fn new(counts: &'a RwLock<dyn CountsView + 'a>, clock: &dyn Clock) -> Self {
        let counts = counts.read().unwrap_or_else(PoisonError::into_inner);
        LedgerCounts {
            counts,
            now: clock.now().as_millisecond(),
        }
    }

    /// Active leases per proxy UID (proxies without any are absent).
    pub fn active_counts(&self) -> HashMap<String, u32> {
        self.counts.active_counts(self.now)
    }

    /// Active leases of one proxy.
    pub fn active_count(&self, uid: &str) -> u32 {
        self.counts.active_count(uid, self.now)
    }

    /// Number of active leases.
    pub fn active_total(&self) -> u64 {
        self.counts.active_total(self.now)
    }

    /// Whether proxy `proxy_uid` is cooling down for `target`.
    pub fn in_cooldown(&self, proxy_uid: &str, target: &str) -> bool {
        self.counts.in_cooldown(proxy_uid, target, self.now)
    }

    /// Number of (proxy, target) pairs in cooldown.
    pub fn cooldowns_active(&self) -> u64 {
        self.counts.cooldowns_active(self.now)
    }

    /// (proxy, target) cooldowns in force per target: the
    /// [`NAMED_TARGETS`](super::NAMED_TARGETS) targets with the most (ties by name) and the
    /// sum over the others ([`rank_targets`](super::rank_targets)); an ended cooldown never
    /// counts.
    pub fn target_cooldowns(&self) -> TargetCooldowns {
        self.counts.target_cooldowns(self.now)
    }

    /// Leases and gateway sessions' leases counting per tenant (tenants without any are
    /// absent): the usage its quotas are held against.
    pub fn tenant_usage(&self) -> HashMap<String, TenantUsage> {
        self.counts.tenant_usage(self.now)
    }
}

impl std::fmt::Debug for LedgerCounts<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LedgerCounts")
            .field("now", &self.now)
            .finish_non_exhaustive()
    }
}
