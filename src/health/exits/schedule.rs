//! When a proxy's exit is checked: at a fixed phase within its interval, derived from its UID,
//! on slots counted from the Unix epoch. Proxies' phases fall evenly over the interval, so a
//! fleet of 10,000 with a 10-minute interval asks about 17 checks a second, every second —
//! never a burst at start-up, after a restart or when a pool scales up — and a restarted
//! process (or another replica) keeps the same slots.

use std::time::Duration;

use sha2::{Digest, Sha256};

/// The exit-check slots of one proxy: `phase`, `phase + interval`, `phase + 2·interval`, …
/// after the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitSchedule {
    interval: Duration,
    phase: Duration,
}

impl ExitSchedule {
    /// The schedule of the proxy with UID `uid` checked every `interval`.
    pub fn new(uid: &str, interval: Duration) -> ExitSchedule {
        let digest = Sha256::digest(uid.as_bytes());
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        let nanos = interval.as_nanos();
        let phase = if nanos == 0 {
            0
        } else {
            u128::from(u64::from_be_bytes(first)) % nanos
        };
        ExitSchedule {
            interval,
            phase: nanos_duration(phase),
        }
    }

    /// Where in each interval this proxy's slot is.
    pub fn phase(&self) -> Duration {
        self.phase
    }

    /// The first slot strictly after `after` (both as time since the Unix epoch). A zero
    /// interval has a slot at every instant: `after` itself.
    pub fn next_after(&self, after: Duration) -> Duration {
        let interval = self.interval.as_nanos();
        if interval == 0 {
            return after;
        }
        let after = after.as_nanos();
        let phase = self.phase.as_nanos();
        let slots = if after < phase {
            0
        } else {
            (after - phase) / interval + 1
        };
        nanos_duration(slots * interval + phase)
    }
}

fn nanos_duration(nanos: u128) -> Duration {
    Duration::new(
        u64::try_from(nanos / 1_000_000_000).unwrap_or(u64::MAX),
        u32::try_from(nanos % 1_000_000_000).unwrap_or(0),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_the_phase() {
        let interval = Duration::from_secs(600);
        let schedule = ExitSchedule::new("0f8c7e4a-uid", interval);
        let phase = schedule.phase();
        assert!(phase < interval);
        assert_eq!(schedule, ExitSchedule::new("0f8c7e4a-uid", interval));
        let cases = [
            ("before the first slot", Duration::ZERO, phase),
            ("on a slot: the next one", phase, phase + interval),
            (
                "between slots",
                phase + Duration::from_secs(1),
                phase + interval,
            ),
            (
                "days later",
                phase + interval * 1000 + Duration::from_millis(1),
                phase + interval * 1001,
            ),
        ];
        for (name, after, want) in cases {
            assert_eq!(schedule.next_after(after), want, "{name}");
        }
        let every_tick = ExitSchedule::new("u", Duration::ZERO);
        assert_eq!(every_tick.next_after(phase), phase);
    }

    /// The performance promise: 10,000 proxies on a 10-minute interval are checked about 17
    /// times a second, every second of the interval, whenever the process started. Phases
    /// hashed from UIDs fall like random ones: a second's load varies around the mean as a
    /// Poisson count does (the busiest of 600 seconds near twice the mean), and every
    /// 10-second window carries its share within a quarter.
    #[test]
    fn ten_thousand_proxies_spread_over_their_interval() {
        const PROXIES: usize = 10_000;
        let interval = Duration::from_secs(600);
        let seconds = usize::try_from(interval.as_secs()).unwrap();
        // A start in the middle of some slot, like any restart.
        let start = Duration::from_secs(1_765_000_000) + Duration::from_millis(123);
        let mut per_second = vec![0usize; seconds];
        for n in 0..PROXIES {
            let uid = format!("{:08x}-5c1e-4f7a-9b0d-{n:012x}", n * 7919);
            let due = ExitSchedule::new(&uid, interval).next_after(start) - start;
            assert!(due <= interval, "{uid}: first check within one interval");
            let second = usize::try_from(due.as_secs()).unwrap().min(seconds - 1);
            per_second[second] += 1;
        }
        let mean = PROXIES as f64 / seconds as f64;
        let max = *per_second.iter().max().unwrap();
        let min = *per_second.iter().min().unwrap();
        assert!(
            (max as f64) <= 2.5 * mean,
            "busiest second {max} checks, mean {mean:.1}"
        );
        assert!(min >= 1, "quietest second {min} checks, mean {mean:.1}");
        // Every 10-second window carries its share within 25 %.
        for window in per_second.chunks(10) {
            let sum: usize = window.iter().sum();
            let expected = mean * window.len() as f64;
            assert!(
                (sum as f64 - expected).abs() <= 0.25 * expected,
                "a 10 s window had {sum} checks, expected {expected:.0}"
            );
        }
    }
}
