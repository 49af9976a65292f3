//! `Retry-After`: how long an answer tells its client to wait, in whole seconds, for the lease
//! API and the gateway alike.

use std::time::Duration;

/// `wait` rounded up to whole seconds, at least 1 (a `Retry-After` of 0 would invite an
/// immediate retry storm).
pub fn seconds(wait: Duration) -> u64 {
    let whole = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    whole.max(1)
}

/// The wait until `at`, from `now` (nothing when `at` has passed).
pub fn until(at: jiff::Timestamp, now: jiff::Timestamp) -> Duration {
    Duration::try_from(at.duration_since(now)).unwrap_or(Duration::ZERO)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_round_up_to_whole_seconds_and_never_to_zero() {
        for (wait, want) in [
            (Duration::ZERO, 1),
            (Duration::from_millis(1), 1),
            (Duration::from_millis(1000), 1),
            (Duration::from_millis(1001), 2),
            (Duration::from_secs(30), 30),
        ] {
            assert_eq!(seconds(wait), want, "{wait:?}");
        }
        let now: jiff::Timestamp = "2026-12-01T10:00:00Z".parse().unwrap();
        let later: jiff::Timestamp = "2026-12-01T10:00:02.5Z".parse().unwrap();
        assert_eq!(until(later, now), Duration::from_millis(2500));
        assert_eq!(until(now, later), Duration::ZERO);
    }
}
