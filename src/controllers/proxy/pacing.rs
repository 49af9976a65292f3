//! When to try again: per-Proxy memory of failures in a row, and the exponential backoff they
//! buy.
//!
//! A failure that writes a condition (a refused create, a machine that never ran) also
//! re-triggers the reconcile through the Proxy watch, so a requeue delay alone would not slow
//! anything down: the failure also sets a *hold*, a time before which no machine is created,
//! which [`super::decide`] obeys. The memory lives in this process only: a restart forgets it
//! and so tries everything once at once, which is what an operator restarted to pick up a
//! fixed policy wants.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use jiff::Timestamp;

use super::time::after;

/// The delay after `failures` failures in a row: `base`, doubled per further failure, at most
/// `cap` (and never less than `base`).
pub fn backoff(base: Duration, cap: Duration, failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(32);
    base.saturating_mul(1_u32 << doublings.min(31))
        .min(cap)
        .max(base)
}

/// Why creates are on hold, shown in the `Provisioned` condition while they are. A hold is for
/// one generation of the spec: an edit (a fixed image, a lower port) tries again at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    /// No create before this.
    pub until: Timestamp,
    /// The Proxy's `metadata.generation` it was set for.
    pub generation: Option<i64>,
    /// The condition reason that caused it (e.g. `StartupTimeout`).
    pub reason: String,
    /// What happened.
    pub message: String,
}

/// One Proxy's retry memory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Record {
    /// Failed reconciles or refused calls in a row; reset by any reconcile that succeeds.
    pub failures: u32,
    /// Machines in a row that never ran (start-up timeouts, creates that vanished); reset when
    /// a machine runs.
    pub failed_machines: u32,
    /// Creates are held until then.
    pub hold: Option<Hold>,
}

/// Retry memory of every Proxy, keyed by UID.
#[derive(Debug, Default)]
pub struct Pacing {
    records: Mutex<HashMap<String, Record>>,
}

impl Pacing {
    fn with<T>(&self, uid: &str, f: impl FnOnce(&mut Record) -> T) -> T {
        let mut records = self.records.lock().unwrap_or_else(PoisonError::into_inner);
        f(records.entry(uid.to_owned()).or_default())
    }

    /// The Proxy's memory (default when it has none).
    pub fn get(&self, uid: &str) -> Record {
        self.records
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(uid)
            .cloned()
            .unwrap_or_default()
    }

    /// Counts a failure and returns how long to wait before the next try.
    pub fn failed(&self, uid: &str, base: Duration, cap: Duration) -> Duration {
        self.with(uid, |r| {
            r.failures = r.failures.saturating_add(1);
            backoff(base, cap, r.failures)
        })
    }

    /// Counts a machine that never ran and holds creates for the backoff it earns, from `at`.
    pub fn machine_failed(
        &self,
        uid: &str,
        (base, cap): (Duration, Duration),
        at: At,
        reason: &str,
        message: String,
    ) -> Hold {
        self.with(uid, |r| {
            r.failed_machines = r.failed_machines.saturating_add(1);
            let delay = backoff(base, cap, r.failed_machines);
            let hold = hold_for(at, delay, reason, message);
            r.hold = Some(hold.clone());
            hold
        })
    }

    /// When creates of the Proxy's `generation` are held until, if they are.
    pub fn hold_until(&self, uid: &str, generation: Option<i64>) -> Option<Timestamp> {
        self.get(uid)
            .hold
            .filter(|h| h.generation == generation)
            .map(|h| h.until)
    }

    /// Holds creates until `hold.until`.
    pub fn hold(&self, uid: &str, hold: Hold) {
        self.with(uid, |r| r.hold = Some(hold));
    }

    /// A reconcile succeeded: failures in a row start over. A running machine also clears the
    /// count of machines that never ran.
    pub fn succeeded(&self, uid: &str, machine_running: bool) {
        let mut records = self.records.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(r) = records.get_mut(uid) {
            r.failures = 0;
            if machine_running {
                r.failed_machines = 0;
                r.hold = None;
            }
            if *r == Record::default() {
                records.remove(uid);
            }
        }
    }

    /// Forgets Proxies that are gone.
    pub fn retain(&self, live: &HashSet<&str>) {
        self.records
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|uid, _| live.contains(uid.as_str()));
    }

    /// How many Proxies have memory (for tests of pruning).
    pub fn len(&self) -> usize {
        self.records
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Whether no Proxy has memory.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A moment in one generation of a Proxy's spec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct At {
    /// Now.
    pub now: Timestamp,
    /// The Proxy's `metadata.generation`.
    pub generation: Option<i64>,
}

/// A hold of `delay` from `at`.
pub fn hold_for(at: At, delay: Duration, reason: &str, message: String) -> Hold {
    Hold {
        until: after(at.now, delay),
        generation: at.generation,
        reason: reason.to_owned(),
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn backoff_doubles_from_the_base_up_to_the_cap() {
        let cases = [
            (0, S(5)),
            (1, S(5)),
            (2, S(10)),
            (3, S(20)),
            (4, S(40)),
            (6, S(160)),
            (7, S(300)),
            (40, S(300)),
            (u32::MAX, S(300)),
        ];
        for (failures, want) in cases {
            assert_eq!(backoff(S(5), S(300), failures), want, "{failures} failures");
        }
        assert_eq!(
            backoff(S(5), S(1), 3),
            S(5),
            "a cap below the base is the base"
        );
    }

    #[test]
    fn failures_count_up_and_success_resets_them() {
        let pacing = Pacing::default();
        let delays: Vec<Duration> = (0..4).map(|_| pacing.failed("u", S(5), S(300))).collect();
        assert_eq!(delays, [S(5), S(10), S(20), S(40)]);
        pacing.succeeded("u", false);
        assert_eq!(pacing.failed("u", S(5), S(300)), S(5));
        pacing.succeeded("u", false);
        assert!(pacing.is_empty(), "an all-default record is dropped");
    }

    #[test]
    fn machines_that_never_ran_hold_creates_until_one_runs() {
        let pacing = Pacing::default();
        let at = At {
            now: Timestamp::from_second(1_000).unwrap(),
            generation: Some(2),
        };
        let base_cap = (S(5), S(300));
        let first = pacing.machine_failed("u", base_cap, at, "StartupTimeout", "m".into());
        assert_eq!(first.until, Timestamp::from_second(1_005).unwrap());
        let second = pacing.machine_failed("u", base_cap, at, "StartupTimeout", "m".into());
        assert_eq!(second.until, Timestamp::from_second(1_010).unwrap());
        assert_eq!(pacing.hold_until("u", Some(2)), Some(second.until));
        assert_eq!(
            pacing.hold_until("u", Some(3)),
            None,
            "a spec edit lifts the hold"
        );
        // A success that is not a running machine keeps the hold and the count.
        pacing.succeeded("u", false);
        assert_eq!(pacing.get("u").failed_machines, 2);
        assert_eq!(pacing.get("u").hold, Some(second));
        pacing.succeeded("u", true);
        assert_eq!(pacing.get("u"), Record::default());
    }

    #[test]
    fn gone_proxies_are_forgotten() {
        let pacing = Pacing::default();
        pacing.failed("a", S(1), S(2));
        pacing.failed("b", S(1), S(2));
        pacing.retain(&HashSet::from(["b"]));
        assert_eq!(pacing.len(), 1);
        assert_eq!(pacing.get("a"), Record::default());
        assert_eq!(pacing.get("b").failures, 1);
    }
}
