//! Where the ledger reads the time, so tests can move it by hand.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use jiff::Timestamp;

/// A source of the current time.
pub trait Clock: Send + Sync + 'static {
    /// The current time.
    fn now(&self) -> Timestamp;
}

/// The system's real-time clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }
}

/// A clock that only moves when told to, for deterministic tests.
#[derive(Debug)]
pub struct ManualClock {
    now: Mutex<Timestamp>,
}

impl ManualClock {
    /// A clock standing at `start`.
    pub fn new(start: Timestamp) -> Self {
        Self {
            now: Mutex::new(start),
        }
    }

    /// Moves the clock forward by `by` (saturating at the largest representable time).
    pub fn advance(&self, by: Duration) {
        let mut now = self.now.lock().unwrap_or_else(PoisonError::into_inner);
        *now = now.saturating_add(by).unwrap_or(Timestamp::MAX);
    }

    /// Puts the clock at `to`.
    pub fn set(&self, to: Timestamp) {
        *self.now.lock().unwrap_or_else(PoisonError::into_inner) = to;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        *self.now.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_told() {
        let start = Timestamp::from_second(1_700_000_000).unwrap();
        let clock = ManualClock::new(start);
        assert_eq!(clock.now(), start);
        clock.advance(Duration::from_millis(1500));
        assert_eq!(
            clock.now(),
            Timestamp::from_millisecond(1_700_000_001_500).unwrap()
        );
        clock.set(start);
        assert_eq!(clock.now(), start);
        clock.advance(Duration::MAX);
        assert_eq!(clock.now(), Timestamp::MAX);
    }

    #[test]
    fn system_clock_is_close_to_now() {
        let before = Timestamp::now();
        let now = SystemClock.now();
        assert!(now >= before);
    }
}
