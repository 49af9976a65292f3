//! Cooldowns per target, bounded for a metric: every backend counts the (proxy, target)
//! cooldowns in force per target and ranks them here, so `proxy_operator_target_cooldowns`
//! names the same targets whichever ledger is behind it.

use std::sync::Arc;

/// How many targets the per-target cooldown gauge names; the rest are summed under
/// [`OTHER_TARGETS`].
pub const NAMED_TARGETS: usize = 50;

/// The label value the targets beyond the named ones are summed under. A target of that very
/// name is always counted there, so the value stays unique.
pub const OTHER_TARGETS: &str = "_other";

/// Cooldowns in force per target, bounded: what `proxy_operator_target_cooldowns` shows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TargetCooldowns {
    /// At most [`NAMED_TARGETS`] targets with their count of (proxy, target) cooldowns in
    /// force, most first, ties by target name; only targets with at least one.
    pub named: Vec<(Arc<str>, u64)>,
    /// Cooldowns in force of every other target (0 when there is none: no `_other` series).
    pub other: u64,
}

impl TargetCooldowns {
    /// Every cooldown in force, named or not.
    pub fn total(&self) -> u64 {
        self.named
            .iter()
            .map(|(_, count)| count)
            .sum::<u64>()
            .saturating_add(self.other)
    }
}

/// Ranks targets by their count of cooldowns (`(target, count)`, each target once): the `cap`
/// with the most are named, most first and ties by name so the choice is deterministic;
/// the counts of the others are summed in `other`. Targets counting 0 are left out, and a
/// target named [`OTHER_TARGETS`] always goes to `other`.
pub fn rank_targets(
    counts: impl IntoIterator<Item = (Arc<str>, u64)>,
    cap: usize,
) -> TargetCooldowns {
    let mut other = 0u64;
    let mut named: Vec<(Arc<str>, u64)> = Vec::new();
    for (target, count) in counts {
        if count == 0 {
            continue;
        }
        if &*target == OTHER_TARGETS {
            other = other.saturating_add(count);
        } else {
            named.push((target, count));
        }
    }
    let order =
        |a: &(Arc<str>, u64), b: &(Arc<str>, u64)| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0));
    if named.len() > cap {
        // The first `cap` are then the top ones, in no order: linear, not a full sort.
        named.select_nth_unstable_by(cap, order);
        for (_, count) in named.drain(cap..) {
            other = other.saturating_add(count);
        }
    }
    named.sort_unstable_by(order);
    TargetCooldowns { named, other }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn targets(counts: &[(&str, u64)]) -> Vec<(Arc<str>, u64)> {
        counts.iter().map(|&(t, c)| (Arc::from(t), c)).collect()
    }

    /// `n` targets `t000`.. with `count(i)` cooldowns each.
    fn many(n: usize, count: impl Fn(usize) -> u64) -> Vec<(Arc<str>, u64)> {
        (0..n)
            .map(|i| (Arc::from(format!("t{i:03}")), count(i)))
            .collect()
    }

    /// Name, input, cap, the named targets wanted and `other`.
    type RankCase<'a> = (
        &'a str,
        Vec<(Arc<str>, u64)>,
        usize,
        Vec<(&'a str, u64)>,
        u64,
    );

    #[test]
    fn the_top_targets_are_named_and_the_rest_summed() {
        let cases: Vec<RankCase> = vec![
            ("nothing", vec![], 50, vec![], 0),
            (
                "zero counts are no target",
                targets(&[("a", 0)]),
                50,
                vec![],
                0,
            ),
            (
                "most first, ties by name",
                targets(&[("c", 2), ("b", 1), ("a", 2), ("d", 1)]),
                50,
                vec![("a", 2), ("c", 2), ("b", 1), ("d", 1)],
                0,
            ),
            (
                "the tie at the cap goes by name",
                targets(&[("b", 1), ("a", 1), ("c", 1), ("z", 3)]),
                2,
                vec![("z", 3), ("a", 1)],
                2,
            ),
            (
                "a target named _other is counted there",
                targets(&[("_other", 4), ("a", 1)]),
                50,
                vec![("a", 1)],
                4,
            ),
        ];
        for (name, counts, cap, named, other) in cases {
            let ranked = rank_targets(counts, cap);
            let want: Vec<(Arc<str>, u64)> = targets(&named);
            assert_eq!(ranked.named, want, "{name}");
            assert_eq!(ranked.other, other, "{name}");
        }
    }

    #[test]
    fn fifty_targets_are_named_and_the_51st_goes_to_other() {
        // Exactly 50: all named, no _other.
        let ranked = rank_targets(many(50, |_| 1), NAMED_TARGETS);
        assert_eq!(ranked.named.len(), 50);
        assert_eq!(ranked.other, 0);
        // 51 with equal counts: the last by name goes to _other.
        let ranked = rank_targets(many(51, |_| 1), NAMED_TARGETS);
        assert_eq!(ranked.named.len(), 50);
        assert_eq!(&*ranked.named[49].0, "t049");
        assert_eq!(ranked.other, 1);
        // 60 targets, t000 with 1 .. t059 with 60: t059..t010 named, t000..t009 summed.
        let ranked = rank_targets(many(60, |i| i as u64 + 1), NAMED_TARGETS);
        assert_eq!(&*ranked.named[0].0, "t059");
        assert_eq!(&*ranked.named[49].0, "t010");
        assert_eq!(ranked.other, (1..=10).sum::<u64>());
        assert_eq!(ranked.total(), (1..=60).sum::<u64>());
        // The input order does not matter.
        let mut reversed = many(60, |i| i as u64 + 1);
        reversed.reverse();
        assert_eq!(rank_targets(reversed, NAMED_TARGETS), ranked);
    }
}
