//! The pure decision of one pool reconcile: which members to create and which to remove, from
//! the members that exist, the desired count, the strategy and the replacement budget.
//!
//! - **Bound**: members that exist, including those still draining or being deleted, never
//!   exceed `desired + maxSurge`; creates are cut to fit.
//! - **Scale down** removes current members beyond `desired` in this order: not Ready first,
//!   then fewest active leases, then newest.
//! - **Roll-out**: members of an older template (or edited by hand) go only while at least
//!   `desired - maxUnavailable` members stay Ready, so with the defaults a new member is Ready
//!   before an old one drains. Old members that are not Ready go at once.
//! - **Budget**: removing a Ready member takes a slot of the fleet's replacement budget (the
//!   same budget rotations and remediations use); `budget_free` is how many are free.

use std::cmp::Reverse;

use super::members::Member;
use crate::resources::pool::Removal;

/// What one reconcile of a pool sees.
#[derive(Debug, Clone)]
pub struct PlanInputs<'a> {
    /// How many members the pool wants.
    pub desired: u32,
    /// Members a roll-out may add above `desired`.
    pub surge: u32,
    /// Members a roll-out may take out of service below `desired`.
    pub unavailable: u32,
    /// Every member that exists.
    pub members: &'a [Member],
    /// Free slots of the replacement budget.
    pub budget_free: u32,
}

/// What to do now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Indexes of current-template members to create.
    pub create: Vec<u32>,
    /// Members to remove, and why.
    pub remove: Vec<(String, Removal)>,
    /// Creates left out because the bound (`desired + maxSurge`) is reached.
    pub held_by_surge: bool,
    /// Removals left out because the replacement budget has no free slot.
    pub held_by_budget: bool,
}

impl Plan {
    /// Whether the plan changes nothing.
    pub fn is_empty(&self) -> bool {
        self.create.is_empty() && self.remove.is_empty()
    }
}

/// Decides creates and removals (see the module doc).
pub fn plan(inputs: &PlanInputs<'_>) -> Plan {
    let PlanInputs {
        desired,
        surge,
        unavailable,
        members,
        mut budget_free,
    } = *inputs;
    let live: Vec<&Member> = members.iter().filter(|m| !m.deleting).collect();
    let (current, old): (Vec<&Member>, Vec<&Member>) = live.iter().partition(|m| m.current);
    let mut plan = Plan::default();
    let mut ready = count(live.iter().filter(|m| m.ready));
    let min_ready = desired.saturating_sub(unavailable);

    // Scale down: current members beyond `desired`, in the removal order.
    let mut current = current;
    current.sort_by_key(|m| removal_order(m));
    let excess = count(current.iter()).saturating_sub(desired);
    let mut kept_current = count(current.iter());
    for member in current.iter().take(excess as usize) {
        if member.ready {
            if budget_free == 0 {
                plan.held_by_budget = true;
                continue;
            }
            budget_free -= 1;
            ready -= 1;
        }
        kept_current -= 1;
        plan.remove.push((member.name.clone(), Removal::ScaleDown));
    }

    // Scale up: current members up to `desired`, within the bound, at the lowest free indexes.
    // Members being removed still exist (they drain first), so they count too.
    let room = (desired + surge).saturating_sub(count(members.iter()));
    let wanted = desired.saturating_sub(kept_current);
    if wanted > room {
        plan.held_by_surge = true;
    }
    // Every name of the current hash is taken while its member exists: an edited one (not
    // current), or one still draining.
    let taken: Vec<u32> = members.iter().filter_map(|m| m.index).collect();
    plan.create = (0..)
        .filter(|i| !taken.contains(i))
        .take(wanted.min(room) as usize)
        .collect();

    // Roll-out: old members go, the not-Ready ones at once, the Ready ones while enough stay.
    let mut old = old;
    old.sort_by_key(|m| removal_order(m));
    for member in old {
        if member.ready {
            if ready <= min_ready {
                continue;
            }
            if budget_free == 0 {
                plan.held_by_budget = true;
                continue;
            }
            budget_free -= 1;
            ready -= 1;
        }
        plan.remove.push((member.name.clone(), Removal::Rollout));
    }
    plan
}

/// The removal order: not Ready first, then fewest active leases, then newest.
fn removal_order(member: &Member) -> (bool, u32, Reverse<jiff::Timestamp>, String) {
    (
        member.ready,
        member.leases,
        Reverse(member.created),
        member.name.clone(),
    )
}

fn count<T>(items: impl Iterator<Item = T>) -> u32 {
    u32::try_from(items.count()).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use jiff::Timestamp;

    /// A member: `c`urrent or `o`ld, `R`eady or `n`ot, leases, created at second `age`.
    fn m(name: &str, current: bool, ready: bool, leases: u32, created: i64) -> Member {
        Member {
            name: name.to_owned(),
            current,
            index: name.strip_prefix("p-h-").and_then(|i| i.parse().ok()),
            ready,
            leases,
            capacity: 5,
            created: Timestamp::from_second(created).unwrap(),
            deleting: false,
            quota_refused: false,
        }
    }

    fn deleting(mut member: Member) -> Member {
        member.deleting = true;
        member
    }

    fn names(plan: &Plan, why: Removal) -> Vec<&str> {
        plan.remove
            .iter()
            .filter(|(_, r)| *r == why)
            .map(|(n, _)| n.as_str())
            .collect()
    }

    fn run(desired: u32, surge: u32, unavailable: u32, budget: u32, members: &[Member]) -> Plan {
        plan(&PlanInputs {
            desired,
            surge,
            unavailable,
            members,
            budget_free: budget,
        })
    }

    #[test]
    fn scale_up_fills_the_lowest_free_indexes_within_the_bound() {
        let members = [m("p-h-1", true, true, 0, 1)];
        type Case<'a> = (u32, u32, &'a [Member], Vec<u32>, bool);
        let cases: [Case<'_>; 5] = [
            (3, 1, &[], vec![0, 1, 2], false),
            (3, 1, &members, vec![0, 2], false),
            (1, 1, &members, vec![], false),
            // An old member and two draining ones fill the bound of 3 + 1.
            (
                3,
                1,
                &[
                    m("p-h-0", true, true, 0, 1),
                    m("p-old-0", false, false, 0, 1),
                    deleting(m("p-h-1", true, true, 0, 1)),
                    deleting(m("p-h-2", true, true, 0, 1)),
                ],
                vec![],
                true,
            ),
            (0, 1, &[], vec![], false),
        ];
        for (desired, surge, members, create, held) in cases {
            let plan = run(desired, surge, 0, 10, members);
            assert_eq!(plan.create, create, "desired {desired}: {members:?}");
            assert_eq!(plan.held_by_surge, held, "desired {desired}: {members:?}");
        }
    }

    #[test]
    fn scale_down_removes_not_ready_then_fewest_leases_then_newest() {
        let members = [
            m("p-h-0", true, true, 3, 10),
            m("p-h-1", true, true, 0, 20),
            m("p-h-2", true, false, 4, 30),
            m("p-h-3", true, true, 0, 40),
            m("p-h-4", true, true, 1, 50),
        ];
        for (desired, removed) in [
            (4, vec!["p-h-2"]),
            (3, vec!["p-h-2", "p-h-3"]),
            (2, vec!["p-h-2", "p-h-3", "p-h-1"]),
            (0, vec!["p-h-2", "p-h-3", "p-h-1", "p-h-4", "p-h-0"]),
            (5, vec![]),
        ] {
            let plan = run(desired, 1, 0, 10, &members);
            assert_eq!(
                names(&plan, Removal::ScaleDown),
                removed,
                "desired {desired}"
            );
            assert!(plan.create.is_empty(), "desired {desired}");
        }
    }

    #[test]
    fn the_budget_holds_ready_removals_but_not_dead_ones() {
        let members = [
            m("p-h-0", true, true, 0, 10),
            m("p-h-1", true, false, 0, 20),
            m("p-h-2", true, true, 0, 30),
        ];
        let plan = run(0, 1, 0, 1, &members);
        assert_eq!(names(&plan, Removal::ScaleDown), ["p-h-1", "p-h-2"]);
        assert!(plan.held_by_budget);
        let plan = run(0, 1, 0, 0, &members);
        assert_eq!(names(&plan, Removal::ScaleDown), ["p-h-1"]);
    }

    #[test]
    fn a_roll_out_adds_a_new_member_before_an_old_one_goes() {
        let old = |i: i64, ready: bool| m(&format!("p-old-{i}"), false, ready, 0, i);
        // Step by step, 3 members with maxSurge 1 and maxUnavailable 0.
        let start = [old(0, true), old(1, true), old(2, true)];
        let plan = run(3, 1, 0, 10, &start);
        assert_eq!(plan.create, [0]);
        assert!(plan.remove.is_empty(), "nothing Ready to spare yet");

        let new_not_ready = [
            old(0, true),
            old(1, true),
            old(2, true),
            m("p-h-0", true, false, 0, 9),
        ];
        let plan = run(3, 1, 0, 10, &new_not_ready);
        assert!(plan.is_empty(), "{plan:?}");

        let new_ready = [
            old(0, true),
            old(1, true),
            old(2, true),
            m("p-h-0", true, true, 0, 9),
        ];
        let plan = run(3, 1, 0, 10, &new_ready);
        assert!(plan.create.is_empty());
        assert_eq!(
            names(&plan, Removal::Rollout),
            ["p-old-2"],
            "newest old first"
        );

        // The old one drains and still counts: no create until it is gone.
        let draining = [
            old(0, true),
            old(1, true),
            deleting(old(2, true)),
            m("p-h-0", true, true, 0, 9),
        ];
        let plan = run(3, 1, 0, 10, &draining);
        assert!(plan.is_empty() && plan.held_by_surge, "{plan:?}");

        // Old members that are not Ready go at once, and count as the one unavailable.
        let mixed = [old(0, false), old(1, true), old(2, true)];
        let plan = run(3, 1, 1, 10, &mixed);
        assert_eq!(names(&plan, Removal::Rollout), ["p-old-0"]);
        assert_eq!(plan.create, [0]);
        // maxUnavailable 1 lets one Ready old member go before its replacement is Ready.
        let plan = run(3, 1, 1, 10, &start);
        assert_eq!(names(&plan, Removal::Rollout), ["p-old-2"]);
        assert_eq!(plan.create, [0]);
    }

    #[test]
    fn a_member_edited_by_hand_is_replaced_under_a_new_name_then_drains() {
        let mut edited = m("p-h-0", false, true, 0, 1);
        edited.index = Some(0);
        let plan = run(1, 1, 0, 10, std::slice::from_ref(&edited));
        assert_eq!(plan.create, [1], "its own name is taken");
        assert!(
            plan.remove.is_empty(),
            "it serves until its replacement is Ready"
        );
        let plan = run(1, 1, 0, 10, &[edited, m("p-h-1", true, true, 0, 2)]);
        assert_eq!(names(&plan, Removal::Rollout), ["p-h-0"]);
        // A draining member's name stays taken until it is gone.
        let plan = run(2, 1, 0, 10, &[deleting(m("p-h-0", true, true, 0, 1))]);
        assert_eq!(plan.create, [1, 2]);
    }

    #[test]
    fn a_roll_out_waits_for_the_budget() {
        let members = [
            m("p-old-0", false, true, 0, 1),
            m("p-h-0", true, true, 0, 2),
        ];
        let plan = run(1, 1, 0, 0, &members);
        assert!(plan.remove.is_empty() && plan.held_by_budget);
        let plan = run(1, 1, 0, 1, &members);
        assert_eq!(names(&plan, Removal::Rollout), ["p-old-0"]);
    }
}
