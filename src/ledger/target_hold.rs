//! The per-target limits (`max_leases_per_target`, `max_leases_per_proxy_target`) as one
//! rule: each backend counts the leases for an acquire's target in its own way, and asks here
//! which proxies the limits hold back, so both refuse (and say when to retry) alike.

use jiff::Timestamp;

use super::config::LedgerConfig;
use super::selection::ProxyLoad;

/// The per-target limits an acquire naming a target is held to (`None`: no limit).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct TargetLimits {
    /// Leases counting at once for one target, across the fleet.
    pub fleet: Option<u32>,
    /// Leases counting at once for one target on one proxy.
    pub per_proxy: Option<u32>,
}

impl TargetLimits {
    /// The limits `config` sets.
    pub fn of(config: &LedgerConfig) -> Self {
        TargetLimits {
            fleet: config.max_leases_per_target,
            per_proxy: config.max_leases_per_proxy_target,
        }
    }

    /// Whether any limit is set.
    pub fn any(self) -> bool {
        self.fleet.is_some() || self.per_proxy.is_some()
    }
}

/// What the per-target limits hold back for one acquire's target; `load_of` gives the leases
/// counting for that target on one proxy (by UID).
pub(crate) struct TargetHold<F> {
    per_proxy: Option<u32>,
    load_of: F,
    /// The fleet holds its limit for the target: when the earliest of its leases expires.
    fleet_full: Option<Option<Timestamp>>,
}

impl<F: Fn(&str) -> ProxyLoad> TargetHold<F> {
    /// The hold of `limits` on a target, or `None` when no limit is set. `fleet` gives the
    /// leases counting for the target across the fleet; it is asked only under a fleet-wide
    /// limit, since counting them may take a walk over every proxy.
    pub fn new(
        limits: TargetLimits,
        fleet: impl FnOnce() -> ProxyLoad,
        load_of: F,
    ) -> Option<Self> {
        if !limits.any() {
            return None;
        }
        Some(TargetHold {
            per_proxy: limits.per_proxy,
            load_of,
            fleet_full: limits.fleet.and_then(|cap| held(fleet(), cap)),
        })
    }

    /// Whether proxy `uid` may not take one more lease for the target, and then when the
    /// earliest lease holding it back expires (`None` inside: no known expiry).
    pub fn of(&self, uid: &str) -> Option<Option<Timestamp>> {
        if let Some(frees_at) = self.fleet_full {
            return Some(frees_at);
        }
        let cap = self.per_proxy?;
        held((self.load_of)(uid), cap)
    }
}

/// The leases of several proxies as one load: how many count, and the earliest expiry.
pub(crate) fn total_load(loads: impl IntoIterator<Item = ProxyLoad>) -> ProxyLoad {
    loads
        .into_iter()
        .fold(ProxyLoad::default(), |total, load| ProxyLoad {
            active: total.active.saturating_add(load.active),
            earliest_expiry: match (total.earliest_expiry, load.earliest_expiry) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            },
        })
}

/// When `load` holds a limit of `cap`: `Some` with its earliest expiry; `None` while fewer
/// count.
fn held(load: ProxyLoad, cap: u32) -> Option<Option<Timestamp>> {
    (load.active >= cap).then_some(load.earliest_expiry)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn at(ms: i64) -> Option<Timestamp> {
        Timestamp::from_millisecond(ms).ok()
    }

    fn load(active: u32, earliest: i64) -> ProxyLoad {
        ProxyLoad {
            active,
            earliest_expiry: at(earliest),
        }
    }

    #[test]
    fn the_limits_hold_back_a_full_fleet_or_a_full_proxy() {
        let loads = HashMap::from([("a", load(2, 300)), ("b", load(1, 100))]);
        let limits = |fleet, per_proxy| TargetLimits { fleet, per_proxy };
        // Name, limits, then what `of` says for "a", "b" and a proxy without leases.
        type Case = (&'static str, TargetLimits, [Option<Option<Timestamp>>; 3]);
        let cases: [Case; 6] = [
            ("no limit", limits(None, None), [None, None, None]),
            (
                "the fleet below its limit",
                limits(Some(4), None),
                [None, None, None],
            ),
            (
                "the fleet at its limit holds every proxy until its earliest expiry",
                limits(Some(3), None),
                [Some(at(100)), Some(at(100)), Some(at(100))],
            ),
            (
                "a proxy at its limit until its own earliest expiry",
                limits(None, Some(2)),
                [Some(at(300)), None, None],
            ),
            (
                "both limits, the fleet's first",
                limits(Some(3), Some(2)),
                [Some(at(100)), Some(at(100)), Some(at(100))],
            ),
            (
                "a limit of 0 holds even a proxy without leases, with no expiry to wait for",
                limits(None, Some(0)),
                [Some(at(300)), Some(at(100)), Some(None)],
            ),
        ];
        for (name, limits, want) in cases {
            let hold = TargetHold::new(
                limits,
                || total_load(loads.values().copied()),
                |uid| loads.get(uid).copied().unwrap_or_default(),
            );
            let got = ["a", "b", "free"].map(|uid| hold.as_ref().and_then(|h| h.of(uid)));
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn the_fleet_is_counted_only_under_a_fleet_wide_limit() {
        let hold = TargetHold::new(
            TargetLimits {
                fleet: None,
                per_proxy: Some(1),
            },
            || unreachable!("no fleet-wide limit"),
            |_| ProxyLoad::default(),
        );
        assert!(hold.is_some_and(|h| h.of("a").is_none()));
    }

    #[test]
    fn a_total_load_sums_and_keeps_the_earliest_expiry() {
        assert_eq!(total_load([]), ProxyLoad::default());
        let none = ProxyLoad {
            active: 1,
            earliest_expiry: None,
        };
        assert_eq!(total_load([load(1, 300), none, load(2, 200)]), load(4, 200));
        assert_eq!(total_load([load(u32::MAX, 5), load(1, 9)]).active, u32::MAX);
    }
}
