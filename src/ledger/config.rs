//! The ledger's tunables.

use std::time::Duration;

use super::error::LedgerError;
use super::lease::LeaseReport;

/// Upper bound of every configured duration, so timestamps stay in range.
const MAX_CONFIG_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Tunables every backend shares: the lease rules, and the queue and batches every backend
/// decides its writes in. What only one backend has is in its options (`SqliteOptions`,
/// `PostgresOptions`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerConfig {
    /// Longest TTL granted; longer requests are cut to it (`--max-lease-ttl`).
    pub max_ttl: Duration,
    /// How long a `rate_limited`/`blocked` (proxy, target) pair is skipped, and how long
    /// finished leases are retained so late reports land (`--lease-cooldown`).
    pub cooldown: Duration,
    /// Longest cooldown one report may ask for (a target's `Retry-After`;
    /// `--max-lease-cooldown`); the default `cooldown` is not bounded by it.
    pub max_cooldown: Duration,
    /// Most leases counting at once for one target across the fleet (`--max-leases-per-target`);
    /// `None`: no limit. Acquires naming no target are not limited.
    pub max_leases_per_target: Option<u32>,
    /// Most leases counting at once for one target on one proxy
    /// (`--max-leases-per-proxy-target`); `None`: only the proxy's `maxLeases`.
    pub max_leases_per_proxy_target: Option<u32>,
    /// How long lease history is kept.
    pub history_retention: Duration,
    /// Writes that may wait for the writer; one more is refused at once with
    /// [`LedgerError::Overloaded`] instead of queueing behind work its client may abandon.
    pub queue_capacity: usize,
    /// Longest a write may wait for its turn; past it, it is refused with
    /// [`LedgerError::Overloaded`] and not decided, so a client that gave up and retries does
    /// not also get the first attempt's lease.
    pub queue_deadline: Duration,
    /// Most writes committed in one transaction (group commit), so one batch's commit never
    /// keeps its first callers waiting for an unbounded tail.
    pub max_batch: usize,
}

impl Default for LedgerConfig {
    fn default() -> Self {
        Self {
            max_ttl: Duration::from_secs(3600),
            cooldown: Duration::from_secs(600),
            max_cooldown: Duration::from_secs(3600),
            max_leases_per_target: None,
            max_leases_per_proxy_target: None,
            history_retention: Duration::from_secs(7 * 24 * 3600),
            queue_capacity: 4096,
            queue_deadline: Duration::from_secs(2),
            max_batch: 256,
        }
    }
}

impl LedgerConfig {
    pub(crate) fn validate(&self) -> Result<(), LedgerError> {
        let config_error = |message: String| Err(LedgerError::Config(message));
        if self.max_ttl < Duration::from_millis(1) {
            return config_error(format!("max_ttl {:?} must be at least 1 ms", self.max_ttl));
        }
        if self.queue_deadline < Duration::from_millis(1) {
            return config_error(format!(
                "queue_deadline {:?} must be at least 1 ms: every write would be refused",
                self.queue_deadline
            ));
        }
        if self.queue_capacity == 0 || self.max_batch == 0 {
            return config_error(format!(
                "queue_capacity ({}) and max_batch ({}) must be at least 1",
                self.queue_capacity, self.max_batch
            ));
        }
        for (name, value) in [
            ("max_ttl", self.max_ttl),
            ("cooldown", self.cooldown),
            ("max_cooldown", self.max_cooldown),
            ("history_retention", self.history_retention),
            ("queue_deadline", self.queue_deadline),
        ] {
            if value > MAX_CONFIG_DURATION {
                return config_error(format!("{name} {value:?} is longer than 100 years"));
            }
        }
        Ok(())
    }

    /// The cooldown a report starts, in milliseconds: the length it asked for, at most
    /// `max_cooldown` (and at least 1 ms), else `cooldown`.
    pub(crate) fn cooldown_ms(&self, asked: Option<Duration>) -> i64 {
        match asked {
            Some(asked) => millis(asked.min(self.max_cooldown)).max(1),
            None => millis(self.cooldown),
        }
    }

    /// What a report on a lease whose own target is `lease_target` keys and starts: the
    /// target it is about (the report's, else the lease's) and, for a `rate_limited` or
    /// `blocked` report about some target, the cooldown's length in milliseconds.
    pub(crate) fn report_cooldown<'a>(
        &self,
        report: &'a LeaseReport,
        lease_target: Option<&'a str>,
    ) -> (Option<&'a str>, Option<i64>) {
        let target = report
            .target
            .as_deref()
            .filter(|t| !t.is_empty())
            .or(lease_target);
        let cooldown_ms = (report.result.starts_cooldown() && target.is_some())
            .then(|| self.cooldown_ms(report.cooldown));
        (target, cooldown_ms)
    }

    /// The TTL actually granted for a requested one, in milliseconds.
    pub(crate) fn capped_ttl_ms(&self, ttl: Duration) -> Result<i64, LedgerError> {
        match millis(ttl.min(self.max_ttl)) {
            0 => Err(LedgerError::InvalidTtl(ttl)),
            ms => Ok(ms),
        }
    }
}

/// A duration in whole milliseconds (configured durations are bounded, so this never clips).
pub(crate) fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_that_cannot_work_are_refused() {
        let cases: [(&str, LedgerConfig, bool); 6] = [
            ("defaults", LedgerConfig::default(), true),
            (
                "zero max TTL",
                LedgerConfig {
                    max_ttl: Duration::ZERO,
                    ..LedgerConfig::default()
                },
                false,
            ),
            (
                "zero queue deadline",
                LedgerConfig {
                    queue_deadline: Duration::ZERO,
                    ..LedgerConfig::default()
                },
                false,
            ),
            (
                "no queue",
                LedgerConfig {
                    queue_capacity: 0,
                    ..LedgerConfig::default()
                },
                false,
            ),
            (
                "empty batches",
                LedgerConfig {
                    max_batch: 0,
                    ..LedgerConfig::default()
                },
                false,
            ),
            (
                "endless cooldown",
                LedgerConfig {
                    cooldown: Duration::MAX,
                    ..LedgerConfig::default()
                },
                false,
            ),
        ];
        for (name, config, ok) in cases {
            assert_eq!(config.validate().is_ok(), ok, "{name}");
        }
    }

    #[test]
    fn ttl_is_capped_and_must_round_to_a_millisecond() {
        let config = LedgerConfig::default();
        assert_eq!(
            config.capped_ttl_ms(Duration::from_secs(5)).ok(),
            Some(5000)
        );
        assert_eq!(config.capped_ttl_ms(Duration::MAX).ok(), Some(3_600_000));
        assert!(matches!(
            config.capped_ttl_ms(Duration::from_micros(999)),
            Err(LedgerError::InvalidTtl(_))
        ));
    }

    #[test]
    fn a_report_cools_down_for_what_it_asked_bounded_or_for_the_default() {
        let config = LedgerConfig {
            cooldown: Duration::from_secs(600),
            max_cooldown: Duration::from_secs(3600),
            ..LedgerConfig::default()
        };
        let cases = [
            (None, 600_000),
            (Some(Duration::from_secs(30)), 30_000),
            (Some(Duration::from_secs(7200)), 3_600_000),
            (Some(Duration::ZERO), 1),
            (Some(Duration::MAX), 3_600_000),
        ];
        for (asked, ms) in cases {
            assert_eq!(config.cooldown_ms(asked), ms, "{asked:?}");
        }
    }
}
