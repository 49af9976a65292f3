//! Which candidate an acquire grants, decided without I/O: a backend looks each proxy's load
//! and the target's cooldowns up in its record of the leases and asks this module, so every
//! backend chooses in the same order.

use jiff::Timestamp;

use super::candidates::Candidates;
use super::lease::NoMatch;

/// What the ledger knows about one proxy's active leases at the moment of an acquire.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ProxyLoad {
    /// Leases counting towards capacity (active and not past their expiry).
    pub active: u32,
    /// The earliest expiry among those leases.
    pub earliest_expiry: Option<Timestamp>,
}

/// The decision of an acquire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Selection {
    /// Grant a lease on `candidates[index]`.
    Chosen(usize),
    /// Grant nothing.
    NoMatch(NoMatch),
}

/// Picks the healthy candidate with a free slot and no cooldown that has the fewest active
/// leases, then the lowest latency (unknown latency last), then the smallest name (namespace
/// and UID break remaining ties, so the choice is deterministic).
///
/// `load` gives a proxy's load by UID; `cooldown_until` gives the end of a cooldown in force
/// for the acquire's target, by UID; `target_limit` says, by UID, whether the per-target
/// limits let the proxy take one more lease for the acquire's target (`None`) or not, and then
/// when the earliest of the leases holding them back expires. A cordoned or draining candidate
/// is never chosen and its load is never looked up, like an unhealthy one. When nothing is
/// chosen, every candidate is counted in one bucket (cordoned, then draining, then unhealthy,
/// then at capacity, then at the target limit, then in cooldown) and `retry_after` is the
/// earliest moment a healthy candidate that is neither cordoned nor draining frees up: for a
/// proxy at capacity the earliest expiry of its leases (or the end of its cooldown if that is
/// later), for one at the target limit the expiry that frees it (or its cooldown's end), for
/// one in cooldown the cooldown's end (an uncordon is an edit, and a drain ends with the
/// machine deleted, so the leases of a cordoned or draining proxy free nothing an acquire
/// could take). When `maxLeases` was lowered below a proxy's active count, freeing one slot is
/// not enough; the hint is then early, and the next attempt gets a fresh one.
///
/// The candidates come ranked by everything but their load ([`Candidates::ranked`]), and a
/// proxy without a lease ranks before every proxy with one: the first free candidate in that
/// order without a lease is the choice, and the walk stops there. An acquire looks up only the
/// candidates ahead of its choice, those holding leases or cooling down, not the whole fleet
/// (the stats are incomplete then, but they are only reported when nothing is chosen).
pub(crate) fn select(
    candidates: &Candidates,
    load: impl Fn(&str) -> ProxyLoad,
    cooldown_until: impl Fn(&str) -> Option<Timestamp>,
    target_limit: impl Fn(&str) -> Option<Option<Timestamp>>,
) -> Selection {
    let excluded = candidates.excluded();
    let mut stats = NoMatch {
        considered: u32::try_from(candidates.len()).unwrap_or(u32::MAX),
        cordoned: excluded.cordoned,
        draining: excluded.draining,
        unhealthy: excluded.unhealthy,
        at_capacity: excluded.no_slots,
        ..NoMatch::default()
    };
    // The fewest leases seen among free candidates, first in rank order among equals.
    let mut best: Option<(usize, u32)> = None;
    for candidate in candidates.ranked() {
        let uid = candidate.proxy.uid.as_str();
        let load = load(uid);
        let cooldown = cooldown_until(uid);
        if load.active >= candidate.max_leases {
            stats.at_capacity += 1;
            let frees_at = load
                .earliest_expiry
                .map(|expiry| cooldown.map_or(expiry, |until| until.max(expiry)));
            stats.retry_after = earliest(stats.retry_after, frees_at);
            continue;
        }
        if let Some(frees_at) = target_limit(uid) {
            stats.at_target_limit += 1;
            let frees_at = frees_at.map(|at| cooldown.map_or(at, |until| until.max(at)));
            stats.retry_after = earliest(stats.retry_after, frees_at);
            continue;
        }
        if let Some(until) = cooldown {
            stats.in_cooldown += 1;
            stats.retry_after = earliest(stats.retry_after, Some(until));
            continue;
        }
        if load.active == 0 {
            return Selection::Chosen(candidate.position);
        }
        if best.is_none_or(|(_, fewest)| load.active < fewest) {
            best = Some((candidate.position, load.active));
        }
    }
    match best {
        Some((position, _)) => Selection::Chosen(position),
        None => Selection::NoMatch(stats),
    }
}

fn earliest(a: Option<Timestamp>, b: Option<Timestamp>) -> Option<Timestamp> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::ledger::Candidate;

    /// `(proxy name, active leases, earliest expiry second)`.
    type Loads = Vec<(&'static str, u32, i64)>;
    /// `(proxy name, cooldown end second)`.
    type Cooldowns = Vec<(&'static str, i64)>;

    fn ts(second: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + second).unwrap()
    }

    fn candidate(name: &str, max_leases: u32, healthy: bool, latency_ms: Option<u64>) -> Candidate {
        Candidate {
            healthy,
            latency: latency_ms.map(Duration::from_millis),
            ..crate::fixtures::candidate(name, max_leases)
        }
    }

    fn list(candidates: &[Candidate]) -> Candidates {
        candidates.iter().cloned().collect()
    }

    fn cordoned(mut c: Candidate) -> Candidate {
        c.cordoned = true;
        c
    }

    fn draining(mut c: Candidate) -> Candidate {
        c.draining = true;
        c
    }

    /// Runs a selection with loads `(name, active, earliest expiry second)` and cooldowns
    /// `(name, until second)`, and returns the chosen name or the no-match stats.
    fn run(
        candidates: &[Candidate],
        loads: &[(&str, u32, i64)],
        cooldowns: &[(&str, i64)],
    ) -> Result<String, NoMatch> {
        let loads: HashMap<String, ProxyLoad> = loads
            .iter()
            .map(|&(name, active, expiry)| {
                let load = ProxyLoad {
                    active,
                    earliest_expiry: Some(ts(expiry)),
                };
                (format!("uid-{name}"), load)
            })
            .collect();
        let cooldowns: HashMap<String, Timestamp> = cooldowns
            .iter()
            .map(|&(name, until)| (format!("uid-{name}"), ts(until)))
            .collect();
        match select(
            &list(candidates),
            |uid| loads.get(uid).copied().unwrap_or_default(),
            |uid| cooldowns.get(uid).copied(),
            |_| None,
        ) {
            Selection::Chosen(index) => Ok(candidates[index].proxy.name.clone()),
            Selection::NoMatch(stats) => Err(stats),
        }
    }

    #[test]
    fn chooses_by_active_leases_then_latency_then_name() {
        let cases: [(&str, Vec<Candidate>, Loads, &str); 11] = [
            (
                "fewest active leases wins over lower latency",
                vec![
                    candidate("a", 5, true, Some(5)),
                    candidate("b", 5, true, Some(50)),
                ],
                vec![("a", 2, 60), ("b", 1, 60)],
                "b",
            ),
            (
                "equal load: lower latency wins",
                vec![
                    candidate("a", 5, true, Some(50)),
                    candidate("b", 5, true, Some(5)),
                ],
                vec![("a", 1, 60), ("b", 1, 60)],
                "b",
            ),
            (
                "unknown latency sorts last",
                vec![
                    candidate("a", 5, true, None),
                    candidate("b", 5, true, Some(900)),
                ],
                vec![],
                "b",
            ),
            (
                "equal load and latency: smallest name wins regardless of order",
                vec![
                    candidate("c", 5, true, Some(7)),
                    candidate("a", 5, true, Some(7)),
                ],
                vec![],
                "a",
            ),
            (
                "a full proxy is skipped even when it is the fastest",
                vec![
                    candidate("a", 2, true, Some(1)),
                    candidate("b", 2, true, Some(99)),
                ],
                vec![("a", 2, 60), ("b", 1, 60)],
                "b",
            ),
            (
                "unhealthy and unleasable proxies are never chosen",
                vec![
                    candidate("a", 5, false, Some(1)),
                    candidate("b", 0, true, Some(1)),
                    candidate("c", 5, true, Some(99)),
                ],
                vec![],
                "c",
            ),
            (
                "a cordoned proxy is never chosen, even the emptiest and fastest",
                vec![
                    cordoned(candidate("a", 5, true, Some(1))),
                    candidate("b", 5, true, Some(99)),
                ],
                vec![("b", 4, 60)],
                "b",
            ),
            (
                "a cordoned proxy holding leases does not stop others being chosen",
                vec![
                    candidate("a", 5, true, Some(50)),
                    cordoned(candidate("b", 1, true, Some(1))),
                    candidate("c", 5, true, Some(9)),
                ],
                vec![("a", 1, 60), ("b", 1, 60), ("c", 1, 60)],
                "c",
            ),
            (
                "a draining proxy is never chosen, even the emptiest and fastest",
                vec![
                    draining(candidate("a", 5, true, Some(1))),
                    candidate("b", 5, true, Some(99)),
                ],
                vec![("b", 4, 60)],
                "b",
            ),
            (
                "a draining proxy holding leases does not stop others being chosen",
                vec![
                    candidate("a", 5, true, Some(50)),
                    draining(candidate("b", 1, true, Some(1))),
                    candidate("c", 5, true, Some(9)),
                ],
                vec![("a", 1, 60), ("b", 1, 60), ("c", 1, 60)],
                "c",
            ),
            (
                "cordoned or draining, the best-ranked are passed over for the slowest",
                vec![
                    cordoned(draining(candidate("a", 5, true, Some(1)))),
                    draining(candidate("b", 5, true, Some(2))),
                    cordoned(candidate("c", 5, true, Some(3))),
                    candidate("d", 5, true, Some(900)),
                ],
                vec![("d", 4, 60)],
                "d",
            ),
        ];
        for (name, candidates, loads, expected) in cases {
            assert_eq!(
                run(&candidates, &loads, &[]),
                Ok(expected.to_owned()),
                "{name}"
            );
        }
    }

    #[test]
    fn the_target_limit_skips_a_proxy_and_says_when_it_frees() {
        let candidates = [
            candidate("a", 10, true, Some(5)),
            candidate("b", 10, true, Some(9)),
            candidate("c", 10, true, Some(7)),
        ];
        let limited = |names: &'static [(&'static str, i64)]| {
            move |uid: &str| {
                names
                    .iter()
                    .find(|(n, _)| format!("uid-{n}") == uid)
                    .map(|&(_, at)| Some(ts(at)))
            }
        };
        // a, the fastest, holds its limit for the target: c, the next fastest, is chosen.
        let chosen = select(
            &list(&candidates),
            |_| ProxyLoad::default(),
            |_| None,
            limited(&[("a", 40)]),
        );
        assert_eq!(chosen, Selection::Chosen(2));
        // Every one held back: counted apart, and retried at the earliest expiry, or later
        // when that proxy also cools down for the target.
        let none = select(
            &list(&candidates),
            |_| ProxyLoad::default(),
            |uid| (uid == "uid-a").then(|| ts(90)),
            limited(&[("a", 40), ("b", 60), ("c", 70)]),
        );
        assert_eq!(
            none,
            Selection::NoMatch(NoMatch {
                considered: 3,
                at_target_limit: 3,
                retry_after: Some(ts(60)),
                ..NoMatch::default()
            })
        );
        // A full proxy is at capacity first, whatever its target limit.
        let full = select(
            &list(&candidates[..1]),
            |_| ProxyLoad {
                active: 10,
                earliest_expiry: Some(ts(20)),
            },
            |_| None,
            limited(&[("a", 40)]),
        );
        assert_eq!(
            full,
            Selection::NoMatch(NoMatch {
                considered: 1,
                at_capacity: 1,
                retry_after: Some(ts(20)),
                ..NoMatch::default()
            })
        );
    }

    #[test]
    fn cooldown_skips_the_proxy_for_the_target() {
        let candidates = [
            candidate("a", 5, true, Some(1)),
            candidate("b", 5, true, Some(9)),
        ];
        assert_eq!(run(&candidates, &[], &[("a", 30)]), Ok("b".to_owned()));
    }

    #[test]
    fn no_match_counts_each_candidate_once_and_hints_the_earliest_free_slot() {
        let cases: [(&str, Vec<Candidate>, Loads, Cooldowns, NoMatch); 12] = [
            ("no candidates", vec![], vec![], vec![], NoMatch::default()),
            (
                "all unhealthy: nothing frees up by itself",
                vec![
                    candidate("a", 5, false, None),
                    candidate("b", 5, false, None),
                ],
                vec![],
                vec![],
                NoMatch {
                    considered: 2,
                    unhealthy: 2,
                    ..NoMatch::default()
                },
            ),
            (
                "maxLeases 0 is at capacity and never frees up",
                vec![candidate("a", 0, true, None)],
                vec![],
                vec![],
                NoMatch {
                    considered: 1,
                    at_capacity: 1,
                    ..NoMatch::default()
                },
            ),
            (
                "full proxies: the earliest lease expiry",
                vec![candidate("a", 1, true, None), candidate("b", 2, true, None)],
                vec![("a", 1, 90), ("b", 3, 40)],
                vec![],
                NoMatch {
                    considered: 2,
                    at_capacity: 2,
                    retry_after: Some(ts(40)),
                    ..NoMatch::default()
                },
            ),
            (
                "mixed: a full proxy also cooling down frees up at the later of the two",
                vec![
                    candidate("sick", 5, false, None),
                    candidate("full", 1, true, None),
                    candidate("cool", 5, true, None),
                    candidate("zero", 0, true, None),
                ],
                vec![("full", 1, 20), ("cool", 1, 10)],
                vec![("full", 70), ("cool", 50)],
                NoMatch {
                    considered: 4,
                    at_capacity: 2,
                    in_cooldown: 1,
                    unhealthy: 1,
                    retry_after: Some(ts(50)),
                    ..NoMatch::default()
                },
            ),
            (
                "cordoned proxies count as cordoned only, whatever else holds for them",
                vec![
                    cordoned(candidate("free", 5, true, Some(1))),
                    cordoned(candidate("sick", 5, false, None)),
                    cordoned(candidate("full", 1, true, None)),
                    cordoned(candidate("zero", 0, true, None)),
                    cordoned(candidate("cool", 5, true, None)),
                ],
                vec![("full", 1, 20)],
                vec![("cool", 50)],
                NoMatch {
                    considered: 5,
                    cordoned: 5,
                    ..NoMatch::default()
                },
            ),
            (
                "a cordoned proxy's lease expiry frees nothing: the hint is the uncordoned one's",
                vec![
                    cordoned(candidate("early", 1, true, None)),
                    candidate("late", 1, true, None),
                ],
                vec![("early", 1, 10), ("late", 1, 90)],
                vec![],
                NoMatch {
                    considered: 2,
                    cordoned: 1,
                    at_capacity: 1,
                    retry_after: Some(ts(90)),
                    ..NoMatch::default()
                },
            ),
            (
                "cordoned and unhealthy: no hint",
                vec![
                    cordoned(candidate("a", 5, true, Some(1))),
                    candidate("b", 5, false, None),
                ],
                vec![],
                vec![],
                NoMatch {
                    considered: 2,
                    cordoned: 1,
                    unhealthy: 1,
                    ..NoMatch::default()
                },
            ),
            (
                "draining proxies count as draining only, whatever else holds for them",
                vec![
                    draining(candidate("free", 5, true, Some(1))),
                    draining(candidate("sick", 5, false, None)),
                    draining(candidate("full", 1, true, None)),
                    draining(candidate("zero", 0, true, None)),
                    draining(candidate("cool", 5, true, None)),
                ],
                vec![("full", 1, 20)],
                vec![("cool", 50)],
                NoMatch {
                    considered: 5,
                    draining: 5,
                    ..NoMatch::default()
                },
            ),
            (
                "a proxy both cordoned and draining counts as cordoned",
                vec![
                    cordoned(draining(candidate("both", 5, true, Some(1)))),
                    draining(candidate("drain", 5, false, None)),
                ],
                vec![],
                vec![],
                NoMatch {
                    considered: 2,
                    cordoned: 1,
                    draining: 1,
                    ..NoMatch::default()
                },
            ),
            (
                "a draining proxy's lease expiry and cooldown free nothing: the hint is the others'",
                vec![
                    draining(candidate("early", 1, true, None)),
                    draining(candidate("cool", 5, true, None)),
                    candidate("late", 1, true, None),
                ],
                vec![("early", 1, 10), ("late", 1, 90)],
                vec![("cool", 20)],
                NoMatch {
                    considered: 3,
                    draining: 2,
                    at_capacity: 1,
                    retry_after: Some(ts(90)),
                    ..NoMatch::default()
                },
            ),
            (
                "every bucket at once, in order",
                vec![
                    cordoned(candidate("c", 5, true, Some(1))),
                    draining(candidate("d", 5, true, Some(1))),
                    candidate("sick", 5, false, None),
                    candidate("full", 1, true, None),
                    candidate("cool", 5, true, None),
                ],
                vec![("d", 1, 5), ("full", 1, 40)],
                vec![("cool", 30)],
                NoMatch {
                    at_target_limit: 0,
                    considered: 5,
                    cordoned: 1,
                    draining: 1,
                    unhealthy: 1,
                    at_capacity: 1,
                    in_cooldown: 1,
                    retry_after: Some(ts(30)),
                },
            ),
        ];
        for (name, candidates, loads, cooldowns, expected) in cases {
            assert_eq!(
                run(&candidates, &loads, &cooldowns),
                Err(expected),
                "{name}"
            );
        }
    }

    #[test]
    fn cordoned_and_draining_candidates_are_never_looked_up() {
        let candidates = [
            cordoned(candidate("c", 5, true, Some(1))),
            draining(candidate("d", 5, true, Some(1))),
            cordoned(draining(candidate("cd", 5, true, Some(1)))),
            candidate("open", 1, true, Some(50)),
        ];
        let looked_up = std::cell::RefCell::new(Vec::new());
        let record = |uid: &str| looked_up.borrow_mut().push(uid.to_owned());
        let full = |uid: &str| {
            record(uid);
            ProxyLoad {
                active: 1,
                earliest_expiry: Some(ts(60)),
            }
        };
        let selection = select(
            &list(&candidates),
            full,
            |uid| {
                record(uid);
                None
            },
            |_| None,
        );
        assert_eq!(
            selection,
            Selection::NoMatch(NoMatch {
                considered: 4,
                cordoned: 2,
                draining: 1,
                at_capacity: 1,
                retry_after: Some(ts(60)),
                ..NoMatch::default()
            })
        );
        assert_eq!(*looked_up.borrow(), ["uid-open", "uid-open"]);
    }

    /// The selection as the design states it, without shortcuts: every eligible candidate
    /// sorted by (active, latency with unknown last, name, namespace, UID).
    fn reference(
        candidates: &[Candidate],
        loads: &HashMap<String, ProxyLoad>,
        cooldowns: &HashMap<String, Timestamp>,
    ) -> Option<usize> {
        let mut eligible: Vec<(usize, u32)> = candidates
            .iter()
            .enumerate()
            .filter_map(|(index, c)| {
                let active = loads.get(&c.proxy.uid).map_or(0, |l| l.active);
                let free = !c.cordoned && !c.draining && c.healthy && active < c.max_leases;
                (free && !cooldowns.contains_key(&c.proxy.uid)).then_some((index, active))
            })
            .collect();
        eligible.sort_by(|&(a, a_active), &(b, b_active)| {
            let key = |c: &Candidate, active: u32| {
                (
                    active,
                    c.latency.is_none(),
                    c.latency,
                    c.proxy.name.clone(),
                    c.proxy.namespace.clone(),
                    c.proxy.uid.clone(),
                )
            };
            key(&candidates[a], a_active).cmp(&key(&candidates[b], b_active))
        });
        eligible.first().map(|&(index, _)| index)
    }

    #[test]
    fn the_shortcut_chooses_what_a_full_sort_chooses() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for case in 0..2000 {
            let n = rng.random_range(0..12);
            let candidates: Vec<Candidate> = (0..n)
                .map(|i| {
                    let latency = rng.random_bool(0.8).then(|| rng.random_range(1..4));
                    let mut c = candidate(
                        &format!("p{}", rng.random_range(0..6)),
                        rng.random_range(0..3),
                        rng.random_bool(0.9),
                        latency,
                    );
                    c.cordoned = rng.random_bool(0.15);
                    c.draining = rng.random_bool(0.15);
                    Arc::make_mut(&mut c.proxy).uid = format!("uid-{i}");
                    c
                })
                .collect();
            let loads: HashMap<String, ProxyLoad> = candidates
                .iter()
                .filter_map(|c| {
                    let load = ProxyLoad {
                        active: rng.random_range(0..3),
                        earliest_expiry: Some(ts(60)),
                    };
                    rng.random_bool(0.5).then(|| (c.proxy.uid.clone(), load))
                })
                .collect();
            let cooldowns: HashMap<String, Timestamp> = candidates
                .iter()
                .filter(|_| rng.random_bool(0.2))
                .map(|c| (c.proxy.uid.clone(), ts(30)))
                .collect();
            let chosen = match select(
                &list(&candidates),
                |uid| loads.get(uid).copied().unwrap_or_default(),
                |uid| cooldowns.get(uid).copied(),
                |_| None,
            ) {
                Selection::Chosen(index) => Some(index),
                Selection::NoMatch(stats) => {
                    let counted = stats.cordoned
                        + stats.draining
                        + stats.unhealthy
                        + stats.at_capacity
                        + stats.at_target_limit
                        + stats.in_cooldown;
                    assert_eq!(counted, stats.considered, "case {case}: {stats:?}");
                    None
                }
            };
            assert_eq!(
                chosen,
                reference(&candidates, &loads, &cooldowns),
                "case {case}: {candidates:?} {loads:?} {cooldowns:?}"
            );
        }
    }

    /// The selection before candidates were ranked: one pass over every candidate in list
    /// order, keeping the best so far (and, once the best has no lease, looking up only
    /// candidates that could still beat it).
    fn linear_select(
        candidates: &[Candidate],
        load: impl Fn(&str) -> ProxyLoad,
        cooldown_until: impl Fn(&str) -> Option<Timestamp>,
        target_limit: impl Fn(&str) -> Option<Option<Timestamp>>,
    ) -> Selection {
        fn ranks_before(a: &Candidate, a_active: u32, b: &Candidate, b_active: u32) -> bool {
            let key = |c: &Candidate, active: u32| (active, c.latency.is_none(), c.latency);
            (
                key(a, a_active),
                &a.proxy.name,
                &a.proxy.namespace,
                &a.proxy.uid,
            ) < (
                key(b, b_active),
                &b.proxy.name,
                &b.proxy.namespace,
                &b.proxy.uid,
            )
        }
        let mut stats = NoMatch {
            considered: u32::try_from(candidates.len()).unwrap_or(u32::MAX),
            ..NoMatch::default()
        };
        let mut best: Option<(usize, u32)> = None;
        for (index, candidate) in candidates.iter().enumerate() {
            if candidate.cordoned {
                stats.cordoned += 1;
                continue;
            }
            if candidate.draining {
                stats.draining += 1;
                continue;
            }
            if !candidate.healthy {
                stats.unhealthy += 1;
                continue;
            }
            if candidate.max_leases == 0 {
                stats.at_capacity += 1;
                continue;
            }
            if let Some((best_index, 0)) = best
                && !ranks_before(candidate, 0, &candidates[best_index], 0)
            {
                continue;
            }
            let uid = candidate.proxy.uid.as_str();
            let load = load(uid);
            let cooldown = cooldown_until(uid);
            if load.active >= candidate.max_leases {
                stats.at_capacity += 1;
                let frees_at = load
                    .earliest_expiry
                    .map(|expiry| cooldown.map_or(expiry, |until| until.max(expiry)));
                stats.retry_after = earliest(stats.retry_after, frees_at);
                continue;
            }
            if let Some(frees_at) = target_limit(uid) {
                stats.at_target_limit += 1;
                let frees_at = frees_at.map(|at| cooldown.map_or(at, |until| until.max(at)));
                stats.retry_after = earliest(stats.retry_after, frees_at);
                continue;
            }
            if let Some(until) = cooldown {
                stats.in_cooldown += 1;
                stats.retry_after = earliest(stats.retry_after, Some(until));
                continue;
            }
            let better = match best {
                None => true,
                Some((best_index, best_active)) => {
                    ranks_before(candidate, load.active, &candidates[best_index], best_active)
                }
            };
            if better {
                best = Some((index, load.active));
            }
        }
        match best {
            Some((index, _)) => Selection::Chosen(index),
            None => Selection::NoMatch(stats),
        }
    }

    /// The ranked selection makes the linear one's choices on random fleets: the same
    /// candidate (ties cannot differ: the UID and then the position settle them), and when
    /// nothing is chosen the same counts and the same `retryAfter`. Names, latencies and loads
    /// are drawn from small ranges so that ties are common.
    #[test]
    fn the_ranked_selection_agrees_with_the_linear_one() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(39);
        for case in 0..5000 {
            let n = rng.random_range(0..16);
            let candidates: Vec<Candidate> = (0..n)
                .map(|i| {
                    let latency = rng.random_bool(0.8).then(|| rng.random_range(1..4));
                    let mut c = candidate(
                        &format!("p{}", rng.random_range(0..6)),
                        rng.random_range(0..4),
                        rng.random_bool(0.85),
                        latency,
                    );
                    c.cordoned = rng.random_bool(0.1);
                    c.draining = rng.random_bool(0.1);
                    // Now and then the same UID twice, as two namespaces of one name would not
                    // be, to hold the position as the last tie-break.
                    let uid = if rng.random_bool(0.1) { 0 } else { i };
                    Arc::make_mut(&mut c.proxy).uid = format!("uid-{uid}");
                    c
                })
                .collect();
            let uids: Vec<String> = candidates.iter().map(|c| c.proxy.uid.clone()).collect();
            // A value from `f` for each UID with probability `p`.
            let mut draw = |p: f64, f: &mut dyn FnMut(&mut rand::rngs::StdRng) -> i64| {
                let mut drawn = HashMap::new();
                for uid in &uids {
                    if rng.random_bool(p) {
                        drawn.insert(uid.clone(), f(&mut rng));
                    }
                }
                drawn
            };
            let actives = draw(0.6, &mut |rng| rng.random_range(0..4));
            let expiries = draw(0.9, &mut |rng| rng.random_range(10..50));
            let cooldowns = draw(0.2, &mut |rng| rng.random_range(5..60));
            let limits = draw(0.15, &mut |rng| rng.random_range(0..40));
            let load = |uid: &str| ProxyLoad {
                active: actives
                    .get(uid)
                    .map_or(0, |&a| u32::try_from(a).unwrap_or(0)),
                earliest_expiry: expiries.get(uid).map(|&s| ts(s)),
            };
            let cooldown = |uid: &str| cooldowns.get(uid).map(|&s| ts(s));
            // A limit of 0 stands for one held back by leases without an expiry.
            let limit = |uid: &str| limits.get(uid).map(|&s| (s > 0).then(|| ts(s)));
            assert_eq!(
                select(&list(&candidates), load, cooldown, limit),
                linear_select(&candidates, load, cooldown, limit),
                "case {case}: {candidates:?} {actives:?} {expiries:?} {cooldowns:?} {limits:?}"
            );
        }
    }
}
