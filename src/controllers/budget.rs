//! The fleet-wide replacement budget: how many Managed proxies may drain or be replaced at once
//! for a voluntary reason (spec change, rotation, remediation).
//!
//! A proxy holds a slot from the start of its drain until its new machine runs and passes a
//! health check; the slot is recorded in its `status.disruption`, so the store (the Proxy
//! cache) is the durable record and a restarted operator counts the same holders. Between the
//! grant and the moment the cache shows the status write, two reconciles of different proxies
//! could both see a free slot: [`Grants`] remembers the grants of this process until then.

use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;
use std::sync::{Mutex, PoisonError};

use crate::resources::pool::REMOVAL_ANNOTATION;
use crate::resources::proxy::{Mode, Proxy};

/// A part of the Managed proxies: a count (`3`) or a percentage (`25%`). Used for the
/// replacement budget and for the unhealthy share that pauses remediation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Share {
    /// That many proxies.
    Count(u32),
    /// That percentage (0 to 100) of the proxies.
    Percent(u32),
}

/// A string that is neither a count nor a percentage.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{value:?} is not a count or a percentage: {reason}; expected a whole number (e.g. 3, \
     0 pauses) or a whole percentage from 0% to 100% (e.g. 10%)"
)]
pub struct ShareError {
    /// The offending value, cut to a readable length.
    value: String,
    /// What is wrong with it.
    reason: &'static str,
}

impl ShareError {
    fn new(value: &str, reason: &'static str) -> Self {
        const SHOWN: usize = 32;
        let value = match value.char_indices().nth(SHOWN) {
            Some((cut, _)) => format!("{}...", &value[..cut]),
            None => value.to_owned(),
        };
        ShareError { value, reason }
    }
}

impl FromStr for Share {
    type Err = ShareError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let (digits, percent) = match text.strip_suffix('%') {
            Some(digits) => (digits, true),
            None => (text, false),
        };
        if digits.is_empty() {
            return Err(ShareError::new(text, "no number"));
        }
        // Digits only: `u32::from_str` would also take a leading `+`.
        if !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(ShareError::new(text, "not a whole number"));
        }
        let value: u32 = digits
            .parse()
            .map_err(|_| ShareError::new(text, "too large"))?;
        match (percent, value) {
            (true, 0..=100) => Ok(Share::Percent(value)),
            (true, _) => Err(ShareError::new(text, "more than 100%")),
            (false, _) => Ok(Share::Count(value)),
        }
    }
}

impl fmt::Display for Share {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Share::Count(n) => write!(f, "{n}"),
            Share::Percent(p) => write!(f, "{p}%"),
        }
    }
}

impl Share {
    /// The number of slots out of `managed` proxies: a count as is; a percentage rounded down
    /// but at least 1, so a small fleet still makes progress. Zero (either form) is 0: paused.
    pub fn budget(self, managed: usize) -> usize {
        match self {
            Share::Count(n) => usize::try_from(n).unwrap_or(usize::MAX),
            Share::Percent(0) => 0,
            Share::Percent(p) => {
                let slots = u128::from(p) * managed as u128 / 100;
                usize::try_from(slots).unwrap_or(usize::MAX).max(1)
            }
        }
    }

    /// Whether `part` of `whole` is more than this share: `part > n` for a count, `part / whole
    /// > p %` for a percentage (in integers: no rounding at the boundary).
    pub fn exceeded_by(self, part: usize, whole: usize) -> bool {
        match self {
            Share::Count(n) => part as u128 > u128::from(n),
            Share::Percent(p) => part as u128 * 100 > u128::from(p) * whole as u128,
        }
    }
}

/// The answer to a request for a budget slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// A free slot was taken.
    Granted,
    /// The proxy already holds a slot (its replacement is under way).
    AlreadyHeld,
    /// Every slot is taken: `in_use` of `limit`.
    Wait {
        /// Slots held now.
        in_use: usize,
        /// Slots in all.
        limit: usize,
    },
}

/// Decides a request of proxy `uid` for a slot, given the UIDs holding one.
pub fn admit(holders: &HashSet<&str>, uid: &str, limit: usize) -> Admission {
    if holders.contains(uid) {
        Admission::AlreadyHeld
    } else if holders.len() < limit {
        Admission::Granted
    } else {
        Admission::Wait {
            in_use: holders.len(),
            limit,
        }
    }
}

/// Slots granted by this process that the store may not show yet (the status write that
/// records them is in flight, or the cache has not seen it). Reconciles of different proxies
/// run concurrently; without this memory each could take the last free slot.
#[derive(Debug, Default)]
pub struct Grants {
    granted: Mutex<HashSet<String>>,
}

impl Grants {
    /// Asks for a slot for `uid`: the holders are the store's (`from_store`, the UIDs whose
    /// `status.disruption` is set) plus the grants remembered here. A grant is remembered
    /// until the store shows it, [`Grants::release`] or [`Grants::retain`]; the caller
    /// releases it when the status write that records it fails.
    pub fn try_admit(
        &self,
        uid: &str,
        from_store: impl IntoIterator<Item = String>,
        limit: usize,
    ) -> Admission {
        let store: HashSet<String> = from_store.into_iter().collect();
        let mut granted = self.granted.lock().unwrap_or_else(PoisonError::into_inner);
        // Once the store shows a grant it is the record: the memory would outlive the slot's
        // release (a cleared `disruption`) otherwise.
        granted.retain(|held| !store.contains(held));
        let holders: HashSet<&str> = store
            .iter()
            .chain(granted.iter())
            .map(String::as_str)
            .collect();
        let admission = admit(&holders, uid, limit);
        if admission == Admission::Granted {
            granted.insert(uid.to_owned());
        }
        admission
    }

    /// Forgets the grant of `uid` (its status write failed, or its replacement ended).
    pub fn release(&self, uid: &str) {
        self.granted
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(uid);
    }

    /// Forgets the grants of proxies that are gone.
    pub fn retain(&self, live: &HashSet<&str>) {
        self.granted
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|uid| live.contains(uid.as_str()));
    }
}

/// Whether the proxy counts toward the budget at all: Managed and not being deleted (a
/// deleted proxy drains without a slot).
fn counted(proxy: &Proxy) -> bool {
    proxy.spec.mode == Mode::Managed && proxy.metadata.deletion_timestamp.is_none()
}

/// Whether a pool removes the proxy (a scale-down or a roll-out): it holds a slot while it
/// drains, like a replacement, so pools and replacements share one budget.
pub fn pool_removal(proxy: &Proxy) -> bool {
    proxy.metadata.deletion_timestamp.is_some()
        && proxy
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(REMOVAL_ANNOTATION))
}

/// UIDs of the proxies holding a slot according to the store: counted, with
/// `status.disruption` set, and members a pool removes while they drain.
pub fn holders<'a>(proxies: impl IntoIterator<Item = &'a Proxy>) -> Vec<String> {
    proxies
        .into_iter()
        .filter(|p| {
            (counted(p) && p.status.as_ref().is_some_and(|s| s.disruption.is_some()))
                || pool_removal(p)
        })
        .map(|p| p.id().uid)
        .collect()
}

/// How many proxies the budget is a share of: Managed, not being deleted.
pub fn managed<'a>(proxies: impl IntoIterator<Item = &'a Proxy>) -> usize {
    proxies.into_iter().filter(|p| counted(p)).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::proxy::{Disruption, ProxyStatus};

    #[test]
    fn parses_and_displays_the_accepted_forms() {
        let cases = [
            ("3", Share::Count(3)),
            ("0", Share::Count(0)),
            ("007", Share::Count(7)),
            ("4294967295", Share::Count(u32::MAX)),
            ("25%", Share::Percent(25)),
            ("0%", Share::Percent(0)),
            ("100%", Share::Percent(100)),
        ];
        for (text, expected) in cases {
            let parsed: Share = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(parsed, expected, "{text}");
            let shown = parsed.to_string();
            assert_eq!(shown.parse::<Share>(), Ok(parsed), "{text} -> {shown}");
        }
        assert_eq!(Share::Percent(10).to_string(), "10%");
        assert_eq!(Share::Count(3).to_string(), "3");
    }

    #[test]
    fn refuses_everything_else_and_says_what_is_accepted() {
        let cases = [
            ("-1", "not a whole number"),
            ("+1", "not a whole number"),
            ("101%", "more than 100%"),
            ("1.5", "not a whole number"),
            ("2.5%", "not a whole number"),
            ("%", "no number"),
            ("", "no number"),
            ("10 %", "not a whole number"),
            (" 3", "not a whole number"),
            ("3%%", "not a whole number"),
            ("ten", "not a whole number"),
            ("4294967296", "too large"),
        ];
        for (text, reason) in cases {
            let error = text.parse::<Share>().err().map(|e| e.to_string());
            let error = error.unwrap_or_else(|| panic!("{text:?} was accepted"));
            assert!(error.contains(&format!("{text:?}")), "{error}");
            assert!(error.contains(reason), "{text:?}: {error}");
            assert!(
                error.contains("e.g. 3") && error.contains("0% to 100%"),
                "{error}"
            );
        }
    }

    #[test]
    fn budget_of_a_fleet() {
        let cases = [
            (Share::Percent(10), 5, 1),
            (Share::Percent(10), 25, 2),
            (Share::Percent(10), 0, 1),
            (Share::Percent(10), 100, 10),
            (Share::Percent(0), 25, 0),
            (Share::Percent(100), 3, 3),
            (Share::Percent(50), 3, 1),
            (Share::Count(7), 3, 7),
            (Share::Count(0), 3, 0),
            (Share::Count(2), 100, 2),
        ];
        for (share, managed, expected) in cases {
            assert_eq!(share.budget(managed), expected, "{share} of {managed}");
        }
    }

    #[test]
    fn exceeded_means_more_than() {
        let cases = [
            (Share::Count(2), 2, 5, false),
            (Share::Count(2), 3, 5, true),
            (Share::Count(0), 0, 5, false),
            (Share::Count(0), 1, 5, true),
            (Share::Percent(40), 2, 5, false),
            (Share::Percent(40), 3, 5, true),
            (Share::Percent(33), 1, 3, true),
            (Share::Percent(34), 1, 3, false),
            (Share::Percent(100), 5, 5, false),
            (Share::Percent(0), 0, 0, false),
            (Share::Percent(0), 1, 10, true),
            (Share::Percent(40), usize::MAX, usize::MAX, true),
        ];
        for (share, part, whole, expected) in cases {
            assert_eq!(
                share.exceeded_by(part, whole),
                expected,
                "{part} of {whole} against {share}"
            );
        }
    }

    #[test]
    fn admit_grants_free_slots_only() {
        let cases: [(&[&str], &str, usize, Admission); 6] = [
            (&[], "a", 1, Admission::Granted),
            (&["b"], "a", 2, Admission::Granted),
            (
                &["b"],
                "a",
                1,
                Admission::Wait {
                    in_use: 1,
                    limit: 1,
                },
            ),
            (&["a"], "a", 1, Admission::AlreadyHeld),
            (&["a", "b"], "a", 0, Admission::AlreadyHeld),
            (
                &[],
                "a",
                0,
                Admission::Wait {
                    in_use: 0,
                    limit: 0,
                },
            ),
        ];
        for (holders, uid, limit, expected) in cases {
            let holders: HashSet<&str> = holders.iter().copied().collect();
            assert_eq!(
                admit(&holders, uid, limit),
                expected,
                "{uid} among {holders:?}, limit {limit}"
            );
        }
    }

    fn store(uids: &[&str]) -> Vec<String> {
        uids.iter().map(|u| (*u).to_owned()).collect()
    }

    #[test]
    fn grants_count_until_the_store_shows_them() {
        let grants = Grants::default();
        // Limit 2: `a` and `b` take the slots before the store shows either.
        assert_eq!(grants.try_admit("a", store(&[]), 2), Admission::Granted);
        assert_eq!(grants.try_admit("a", store(&[]), 2), Admission::AlreadyHeld);
        assert_eq!(grants.try_admit("b", store(&[]), 2), Admission::Granted);
        assert_eq!(
            grants.try_admit("c", store(&[]), 2),
            Admission::Wait {
                in_use: 2,
                limit: 2
            }
        );
        // The store shows `a`: still two holders, not three.
        assert_eq!(
            grants.try_admit("c", store(&["a"]), 2),
            Admission::Wait {
                in_use: 2,
                limit: 2
            }
        );
        // `a` ends (its disruption cleared in the store): the memory no longer holds it.
        assert_eq!(grants.try_admit("c", store(&[]), 2), Admission::Granted);
        // `b`'s write failed: released, its slot is free again.
        grants.release("b");
        assert_eq!(grants.try_admit("d", store(&["c"]), 2), Admission::Granted);
        // `d` is deleted: forgotten.
        grants.retain(&HashSet::from(["c"]));
        assert_eq!(grants.try_admit("e", store(&["c"]), 2), Admission::Granted);
        assert_eq!(
            grants.try_admit("f", store(&["c"]), 2),
            Admission::Wait {
                in_use: 2,
                limit: 2
            }
        );
    }

    #[test]
    fn concurrent_grants_never_exceed_the_limit() {
        let grants = Grants::default();
        let granted: usize = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..16)
                .map(|i| {
                    let grants = &grants;
                    scope.spawn(move || grants.try_admit(&format!("p{i}"), store(&[]), 3))
                })
                .collect();
            handles
                .into_iter()
                .filter_map(|h| h.join().ok())
                .filter(|a| *a == Admission::Granted)
                .count()
        });
        assert_eq!(granted, 3);
    }

    fn proxy(uid: &str, mode: Mode, disrupted: bool, deleting: bool) -> Proxy {
        let mut proxy = match mode {
            Mode::Managed => crate::fixtures::managed(uid, "local"),
            Mode::External => crate::fixtures::external(uid, "10.0.0.1", 3128),
        }
        .uid(Some(uid))
        .namespace("default");
        if deleting {
            proxy = proxy.deleting();
        }
        // From JSON, as the store holds it: the struct may gain optional fields.
        let disruption: Option<Disruption> = disrupted.then(|| {
            serde_json::from_value(serde_json::json!({
                "reason": "SpecChange", "since": "2026-01-01T00:00:00Z"
            }))
            .unwrap_or_else(|e| panic!("disruption: {e}"))
        });
        proxy
            .status(ProxyStatus {
                disruption,
                ..ProxyStatus::default()
            })
            .build()
    }

    #[test]
    fn holders_and_managed_count_managed_proxies_not_being_deleted() {
        let fleet = [
            proxy("held", Mode::Managed, true, false),
            proxy("idle", Mode::Managed, false, false),
            proxy("deleting-held", Mode::Managed, true, true),
            proxy("deleting", Mode::Managed, false, true),
            proxy("external-held", Mode::External, true, false),
            proxy("external", Mode::External, false, false),
        ];
        assert_eq!(holders(&fleet), ["held"]);
        assert_eq!(managed(&fleet), 2);
        assert!(holders(&[]).is_empty());
        assert_eq!(managed(&[]), 0);
    }
}
