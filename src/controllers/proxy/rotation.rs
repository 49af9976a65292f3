//! Rotation: when a Managed proxy's machine is replaced for its age (`spec.maxLifetime`) or on
//! request (the `crawl.example.com/rotate` annotation).
//!
//! Proxies created together would all reach their lifetime together and the replacement
//! budget would then hold most of them waiting; a fixed per-proxy jitter spreads them. It is
//! derived from the UID, so every reconcile (and a restarted operator) computes the same due
//! time.

use std::time::Duration;

use jiff::Timestamp;
use sha2::{Digest, Sha256};

use super::time::after;

/// Nanoseconds in a second.
const NANOS_PER_SEC: u128 = 1_000_000_000;

/// The proxy's jitter: uniform in [0, 10 %) of `max_lifetime` (zero when that is under 10 ns),
/// fixed by the SHA-256 of its UID. Exact integer math on nanoseconds: the first 128 bits of
/// the digest modulo the range (the bias is below 2^-37 for any `Duration`).
pub fn jitter(max_lifetime: Duration, uid: &str) -> Duration {
    let range = max_lifetime.as_nanos() / 10;
    if range == 0 {
        return Duration::ZERO;
    }
    let digest = Sha256::digest(uid.as_bytes());
    let mut first = [0_u8; 16];
    first.copy_from_slice(&digest[..16]);
    let nanos = u128::from_be_bytes(first) % range;
    // Below `max_lifetime`, so the seconds fit in a u64.
    let secs = u64::try_from(nanos / NANOS_PER_SEC).unwrap_or(u64::MAX);
    let subsec = u32::try_from(nanos % NANOS_PER_SEC).unwrap_or(0);
    Duration::new(secs, subsec)
}

/// When the machine created at `created` is due for rotation: `created + max_lifetime -
/// jitter`, saturating; never later than `created + max_lifetime`.
pub fn due_at(created: Timestamp, max_lifetime: Duration, uid: &str) -> Timestamp {
    after(
        created,
        max_lifetime.saturating_sub(jitter(max_lifetime, uid)),
    )
}

/// Whether the user asked for a rotation: the rotate annotation has a value other than the
/// one recorded when the current machine was created. An empty or absent annotation never
/// rotates (removing it is not a request).
pub fn requested(annotation: Option<&str>, recorded: Option<&str>) -> bool {
    annotation.is_some_and(|value| !value.is_empty() && Some(value) != recorded)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(86_400);

    #[test]
    fn jitter_stays_below_a_tenth() {
        let lifetimes = [
            Duration::from_secs(60),
            Duration::from_secs(90),
            DAY,
            Duration::from_nanos(10),
            Duration::from_nanos(19),
            Duration::from_nanos(9),
            Duration::ZERO,
            Duration::MAX,
        ];
        for lifetime in lifetimes {
            for i in 0..200 {
                let uid = format!("3f1c2a9e-0000-4000-8000-{i:012}");
                let j = jitter(lifetime, &uid);
                assert!(
                    j.as_nanos() * 10 < lifetime.as_nanos() || j.is_zero(),
                    "{uid}: {j:?} of {lifetime:?}"
                );
                assert!(
                    due_at(Timestamp::UNIX_EPOCH, lifetime, &uid)
                        <= after(Timestamp::UNIX_EPOCH, lifetime)
                );
            }
        }
        assert_eq!(jitter(Duration::from_nanos(9), "u"), Duration::ZERO);
        assert_eq!(jitter(Duration::ZERO, "u"), Duration::ZERO);
    }

    #[test]
    fn jitter_is_fixed_per_uid_and_spread_across_uids() {
        let uids: Vec<String> = (0..1000).map(|i| format!("uid-{i}")).collect();
        let jitters: Vec<Duration> = uids.iter().map(|u| jitter(DAY, u)).collect();
        for (uid, j) in uids.iter().zip(&jitters) {
            assert_eq!(jitter(DAY, uid), *j, "{uid}");
        }
        let distinct: std::collections::HashSet<_> = jitters.iter().collect();
        assert!(distinct.len() > 990, "{} distinct", distinct.len());
        // Spread over the range: each tenth of [0, 2.4h) gets a fair share of 1000 UIDs.
        let range = DAY.as_nanos() / 10;
        let mut buckets = [0_u32; 10];
        for j in &jitters {
            let bucket = usize::try_from(j.as_nanos() * 10 / range).unwrap_or(9);
            buckets[bucket.min(9)] += 1;
        }
        assert!(
            buckets.iter().all(|&n| (50..=150).contains(&n)),
            "{buckets:?}"
        );
    }

    #[test]
    fn due_is_lifetime_minus_jitter_from_creation() {
        let created: Timestamp = "2026-01-01T00:00:00Z"
            .parse()
            .unwrap_or_else(|e| panic!("{e}"));
        let cases = [
            (created, DAY, "a"),
            (created, Duration::from_secs(60), "b"),
            (created, Duration::from_secs(90), "c"),
            (Timestamp::MAX, DAY, "d"),
        ];
        for (created, lifetime, uid) in cases {
            let due = due_at(created, lifetime, uid);
            assert_eq!(
                due,
                after(created, lifetime - jitter(lifetime, uid)),
                "{uid}"
            );
            assert!(due <= after(created, lifetime), "{uid}");
            assert!(
                created == Timestamp::MAX || due > after(created, lifetime * 9 / 10),
                "{uid}: {due} before nine tenths"
            );
        }
        assert_eq!(due_at(created, Duration::MAX, "e"), Timestamp::MAX);
    }

    #[test]
    fn only_a_new_non_empty_annotation_rotates() {
        let cases = [
            (None, None, false),
            (None, Some("1"), false),
            (Some(""), None, false),
            (Some(""), Some("1"), false),
            (Some("1"), None, true),
            (Some("1"), Some(""), true),
            (Some("1"), Some("1"), false),
            (Some("2"), Some("1"), true),
            (
                Some("2026-01-01T00:00:00Z"),
                Some("2026-01-01T00:00:00Z"),
                false,
            ),
        ];
        for (annotation, recorded, expected) in cases {
            assert_eq!(
                requested(annotation, recorded),
                expected,
                "{annotation:?} / {recorded:?}"
            );
        }
    }
}
