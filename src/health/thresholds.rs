//! The pure health state machine of one proxy: consecutive-result thresholds decide healthy or
//! unhealthy, and the suppression rule decides which results are worth a status write.
//!
//! A result is *reported* (pushed to the reconciler as a transition) only when it is the first
//! decided result, when the thresholded state differs from the last reported one (a flip, or a
//! flip whose report could not be delivered yet), or when the latency of a successful probe moved
//! by more than max(20 ms, 50 % of the last reported latency) and the last report is at least
//! 60 s old. The absolute floor keeps a proxy jittering between 40 and 61 ms from writing status
//! forever; the rate limit bounds status churn for any latency pattern.
//!
//! Time is passed in (`now`), so every rule is tested without a clock.

use std::time::{Duration, Instant};

/// Smallest latency change worth reporting.
pub const LATENCY_CHANGE_FLOOR: Duration = Duration::from_millis(20);
/// Shortest time between two latency-only reports.
pub const LATENCY_REPORT_MIN_GAP: Duration = Duration::from_secs(60);

/// Consecutive results needed to flip the state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Thresholds {
    /// Consecutive failures that mark the proxy unhealthy (at least 1).
    pub failure: u32,
    /// Consecutive successes that mark the proxy healthy (at least 1).
    pub success: u32,
}

impl Thresholds {
    /// The thresholds of a proxy's health check.
    pub fn of(check: &crate::resources::proxy::HealthCheck) -> Thresholds {
        Thresholds {
            failure: check.failure_threshold(),
            success: check.success_threshold(),
        }
    }
}

/// Why a result is reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportReason {
    /// Nothing was reported for this proxy yet.
    First,
    /// The thresholded state differs from the last reported one.
    Flip,
    /// Latency moved enough, and long enough after the last report.
    Latency,
}

/// A result that should be pushed to the reconciler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    /// The thresholded state to report.
    pub healthy: bool,
    /// Why it is reported.
    pub reason: ReportReason,
}

/// What was last delivered to the reconciler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Reported {
    healthy: bool,
    latency: Duration,
    at: Instant,
}

/// Threshold counters and report bookkeeping of one proxy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HealthState {
    healthy: Option<bool>,
    successes: u32,
    failures: u32,
    reported: Option<Reported>,
}

impl HealthState {
    /// A fresh state whose health is `seed` (the Proxy's existing Healthy condition, so a restart
    /// does not flap to unknown) with zero counters (a real flip still needs a full run).
    pub fn seeded(seed: Option<bool>) -> HealthState {
        HealthState {
            healthy: seed,
            ..HealthState::default()
        }
    }

    /// The thresholded state: `None` until a threshold was first reached (or seeded).
    pub fn healthy(&self) -> Option<bool> {
        self.healthy
    }

    /// Counts one probe result and says whether it should be reported. Nothing is marked as
    /// reported here: call [`HealthState::mark_reported`] once the report was delivered, so an
    /// undelivered report is retried on the next result.
    pub fn observe(
        &mut self,
        success: bool,
        latency: Duration,
        now: Instant,
        thresholds: Thresholds,
    ) -> Option<Report> {
        if success {
            self.successes = self.successes.saturating_add(1);
            self.failures = 0;
            if self.successes >= thresholds.success.max(1) {
                self.healthy = Some(true);
            }
        } else {
            self.failures = self.failures.saturating_add(1);
            self.successes = 0;
            if self.failures >= thresholds.failure.max(1) {
                self.healthy = Some(false);
            }
        }
        let healthy = self.healthy?;
        let reason = match self.reported {
            None => ReportReason::First,
            Some(last) if last.healthy != healthy => ReportReason::Flip,
            Some(last) if success && latency_report_due(last, latency, now) => {
                ReportReason::Latency
            }
            Some(_) => return None,
        };
        Some(Report { healthy, reason })
    }

    /// Records that the current state with `latency` was delivered at `now`.
    pub fn mark_reported(&mut self, latency: Duration, now: Instant) {
        if let Some(healthy) = self.healthy {
            self.reported = Some(Reported {
                healthy,
                latency,
                at: now,
            });
        }
    }
}

fn latency_report_due(last: Reported, latency: Duration, now: Instant) -> bool {
    let change = latency.abs_diff(last.latency);
    let threshold = LATENCY_CHANGE_FLOOR.max(last.latency / 2);
    change > threshold && now.saturating_duration_since(last.at) >= LATENCY_REPORT_MIN_GAP
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }
    const T: Thresholds = Thresholds {
        failure: 3,
        success: 2,
    };

    /// Feeds `results` one second apart, marking every report as delivered, and returns the
    /// report of each step.
    /// The seconds (result indexes) at which `run` produced a report.
    fn report_seconds(reports: &[Option<Report>]) -> Vec<usize> {
        reports
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.map(|_| i))
            .collect()
    }

    fn run(state: &mut HealthState, results: &[(bool, u64)]) -> Vec<Option<Report>> {
        let t0 = Instant::now();
        results
            .iter()
            .enumerate()
            .map(|(i, &(ok, millis))| {
                let now = t0 + Duration::from_secs(i as u64);
                let report = state.observe(ok, ms(millis), now, T);
                if report.is_some() {
                    state.mark_reported(ms(millis), now);
                }
                report
            })
            .collect()
    }

    fn report(healthy: bool, reason: ReportReason) -> Option<Report> {
        Some(Report { healthy, reason })
    }

    /// Name, seed, (success, latency ms) per probe, expected report per probe.
    type Case = (
        &'static str,
        Option<bool>,
        Vec<(bool, u64)>,
        Vec<Option<Report>>,
    );

    #[test]
    fn thresholds_flip_after_consecutive_runs() {
        use ReportReason::*;
        let cases: Vec<Case> = vec![
            (
                "unseeded: undecided until the success threshold",
                None,
                vec![(true, 10), (true, 10)],
                vec![None, report(true, First)],
            ),
            (
                "unseeded: undecided until the failure threshold",
                None,
                vec![(false, 10), (false, 10), (false, 10)],
                vec![None, None, report(false, First)],
            ),
            (
                "a broken run resets the failure counter",
                Some(true),
                vec![
                    (true, 10),
                    (false, 10),
                    (false, 10),
                    (true, 10),
                    (false, 10),
                ],
                vec![report(true, First), None, None, None, None],
            ),
            (
                "failure threshold flips a healthy proxy",
                Some(true),
                vec![
                    (true, 10),
                    (false, 10),
                    (false, 10),
                    (false, 10),
                    (false, 10),
                ],
                vec![report(true, First), None, None, report(false, Flip), None],
            ),
            (
                "success threshold flips it back",
                Some(false),
                vec![(false, 10), (true, 10), (true, 10), (true, 10)],
                vec![report(false, First), None, report(true, Flip), None],
            ),
            (
                "seeded healthy with zero counters: a failure alone does not flip",
                Some(true),
                vec![(false, 10), (false, 10)],
                vec![report(true, First), None],
            ),
        ];
        for (name, seed, results, expected) in cases {
            let mut state = HealthState::seeded(seed);
            assert_eq!(run(&mut state, &results), expected, "{name}");
        }
    }

    #[test]
    fn undelivered_reports_are_retried() {
        let t0 = Instant::now();
        let mut state = HealthState::seeded(None);
        let one = Thresholds {
            failure: 1,
            success: 1,
        };
        let first = state.observe(true, ms(10), t0, one);
        assert_eq!(first, report(true, ReportReason::First));
        // Not delivered: the next result still reports.
        let again = state.observe(true, ms(10), t0 + Duration::from_secs(1), one);
        assert_eq!(again, report(true, ReportReason::First));
        state.mark_reported(ms(10), t0 + Duration::from_secs(1));
        let flip = state.observe(false, ms(10), t0 + Duration::from_secs(2), one);
        assert_eq!(flip, report(false, ReportReason::Flip));
        // Flip not delivered, the proxy keeps failing: still a flip to report.
        let pending = state.observe(false, ms(10), t0 + Duration::from_secs(3), one);
        assert_eq!(pending, report(false, ReportReason::Flip));
        // Flip not delivered and the proxy recovered: nothing left to report.
        let recovered = state.observe(true, ms(10), t0 + Duration::from_secs(4), one);
        assert_eq!(recovered, None);
    }

    #[test]
    fn latency_reports_need_a_large_change_and_a_quiet_minute() {
        // (last reported ms, seconds since, new ms, success, report?)
        let cases = [
            (40, 61, 61, true, true),    // 21 ms > max(20, 20)
            (40, 61, 60, true, false),   // 20 ms is not more than the floor
            (40, 59, 100, true, false),  // large change, but within the minute
            (100, 61, 149, true, false), // 49 ms < 50 % of 100
            (100, 61, 151, true, true),
            (100, 61, 49, true, true),    // drops count too
            (100, 61, 500, false, false), // failed probes never report latency
            (0, 61, 21, true, true),      // defined at zero thanks to the floor
        ];
        let t0 = Instant::now();
        for (last, since, new, ok, expected) in cases {
            let mut state = HealthState::seeded(Some(true));
            state.mark_reported(ms(last), t0);
            let thresholds = Thresholds {
                failure: 3,
                success: 1,
            };
            let got = state.observe(ok, ms(new), t0 + Duration::from_secs(since), thresholds);
            let want = expected.then_some(Report {
                healthy: true,
                reason: ReportReason::Latency,
            });
            assert_eq!(got, want, "{last} ms -> {new} ms after {since} s, ok={ok}");
        }
    }

    #[test]
    fn latency_jitter_between_40_and_61_ms_does_not_write_forever() {
        let mut state = HealthState::seeded(Some(true));
        let results: Vec<(bool, u64)> = (0..3600)
            .map(|i| (true, if i % 2 == 0 { 40 } else { 61 }))
            .collect();
        let at = report_seconds(&run(&mut state, &results));
        // The first result, then at most one latency report; an hour of jitter adds nothing.
        assert_eq!(at.first(), Some(&0));
        assert!(at.len() <= 2, "reports at seconds {at:?}");
    }

    #[test]
    fn a_steady_drift_reports_at_most_once_a_minute() {
        let mut state = HealthState::seeded(Some(true));
        // Latency grows by 10 ms every second for ten minutes.
        let results: Vec<(bool, u64)> = (0..600).map(|i| (true, 10 + 10 * i)).collect();
        let at = report_seconds(&run(&mut state, &results));
        assert!(at.len() > 2, "a real drift is reported: {at:?}");
        for pair in at.windows(2) {
            assert!(pair[1] - pair[0] >= 60, "reports at seconds {at:?}");
        }
    }
}
