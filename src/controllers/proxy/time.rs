//! Deadlines: a time plus a duration, saturating instead of failing, so a huge configured
//! duration means "never" rather than an error.

use std::time::Duration;

use jiff::Timestamp;

/// `at` plus `duration` (saturating).
pub fn after(at: Timestamp, duration: Duration) -> Timestamp {
    jiff::SignedDuration::try_from(duration)
        .ok()
        .and_then(|d| at.checked_add(d).ok())
        .unwrap_or(Timestamp::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn after_adds_and_saturates() {
        let at = Timestamp::from_second(1_000).unwrap();
        assert_eq!(
            after(at, Duration::from_secs(5)),
            Timestamp::from_second(1_005).unwrap()
        );
        assert_eq!(after(at, Duration::MAX), Timestamp::MAX);
        assert_eq!(
            after(Timestamp::MAX, Duration::from_secs(1)),
            Timestamp::MAX
        );
    }
}
