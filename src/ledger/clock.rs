//! Where the ledger reads the time, so tests can move it by hand.

use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use jiff::Timestamp;

/// A source of the current time.
pub trait Clock: Send + Sync + 'static {
    /// The current time (lease expiry and cooldowns are wall-clock times stored in the file).
    fn now(&self) -> Timestamp;

    /// Time elapsed since a fixed origin, never stepping backwards. The ledger measures queue
    /// deadlines on it, so a wall-clock step cannot expire or prolong every queued write.
    fn monotonic(&self) -> Duration {
        static ORIGIN: OnceLock<Instant> = OnceLock::new();
        ORIGIN.get_or_init(Instant::now).elapsed()
    }
}

/// The system's real-time clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }
}

/// A clock that only moves when told to, for deterministic tests. Its monotonic time moves
/// with it (forwards only).
#[derive(Debug)]
pub struct ManualClock {
    state: Mutex<ManualTime>,
}

#[derive(Debug, Clone, Copy)]
struct ManualTime {
    now: Timestamp,
    monotonic: Duration,
}

impl ManualClock {
    /// A clock standing at `start`.
    pub fn new(start: Timestamp) -> Self {
        Self {
            state: Mutex::new(ManualTime {
                now: start,
                monotonic: Duration::ZERO,
            }),
        }
    }

    fn time(&self) -> std::sync::MutexGuard<'_, ManualTime> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Moves the clock forward by `by` (saturating at the largest representable time).
    pub fn advance(&self, by: Duration) {
        let mut time = self.time();
        time.now = time.now.saturating_add(by).unwrap_or(Timestamp::MAX);
        time.monotonic = time.monotonic.saturating_add(by);
    }

    /// Puts the clock at `to`. The monotonic time follows a step forward and stays put on a
    /// step back, as a real monotonic clock would.
    pub fn set(&self, to: Timestamp) {
        let mut time = self.time();
        if to > time.now {
            let step = Duration::try_from(to.duration_since(time.now)).unwrap_or(Duration::MAX);
            time.monotonic = time.monotonic.saturating_add(step);
        }
        time.now = to;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        self.time().now
    }

    fn monotonic(&self) -> Duration {
        self.time().monotonic
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
        assert_eq!(clock.monotonic(), Duration::ZERO);
        clock.advance(Duration::from_millis(1500));
        assert_eq!(
            clock.now(),
            Timestamp::from_millisecond(1_700_000_001_500).unwrap()
        );
        assert_eq!(clock.monotonic(), Duration::from_millis(1500));
        clock.set(start);
        assert_eq!(clock.now(), start);
        assert_eq!(
            clock.monotonic(),
            Duration::from_millis(1500),
            "monotonic time never steps back"
        );
        clock.set(Timestamp::from_second(1_700_000_010).unwrap());
        assert_eq!(clock.monotonic(), Duration::from_millis(11_500));
        clock.advance(Duration::MAX);
        assert_eq!(clock.now(), Timestamp::MAX);
        assert_eq!(clock.monotonic(), Duration::MAX);
    }

    #[test]
    fn system_clock_is_close_to_now() {
        let before = Timestamp::now();
        let now = SystemClock.now();
        assert!(now >= before);
        let first = SystemClock.monotonic();
        assert!(SystemClock.monotonic() >= first);
    }
}
