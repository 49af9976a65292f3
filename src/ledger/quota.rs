//! Tenants' quotas, decided without I/O where capacity is decided: a backend counts what the
//! tenant holds in its record of the leases, keeps the tenant's token bucket, and asks this
//! module, so both backends refuse alike.
//!
//! - **Leases**: the tenant's leases that count (`expires_at > now`), a gateway session's
//!   included, stay within `leases`.
//! - **Sessions**: the tenant's leases that belong to a gateway session stay within
//!   `sessions`.
//! - **Rate**: a token bucket of `burst` tokens refilled at `per_second`; a granted acquire
//!   takes one token (a replay or a refusal takes none). Over any window of `T` seconds a
//!   tenant is granted at most `burst + per_second × T` acquires.
//! - **Bytes per day**: the tenant's bytes through the gateway on the current UTC day (the
//!   ledger's hourly traffic rows, as flushed) stay below `bytes_per_day`; once they reach it
//!   every acquire is refused until the day's turn. Work under way is not cut, so a tenant
//!   ends a day over its budget by at most what its requests and tunnels under way carry
//!   plus what the gateways relayed in the last flush interval.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// The tenant every token of `DISCOVERY_TOKEN` and `--discovery-token-file` belongs to, with
/// no scope and no quota: the only one without a tenants file.
pub const DEFAULT_TENANT: &str = "default";

/// Longest `Retry-After` of a refusal for the lease or session quota: a slot frees when the
/// tenant releases a lease, which crawlers do long before the lease would expire.
const MAX_SLOT_WAIT: Duration = Duration::from_secs(5);

/// A tenant's rate of acquires.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    /// Tokens added per second (above zero).
    pub per_second: f64,
    /// Tokens the bucket holds at most (at least one).
    pub burst: u32,
}

/// What a tenant may hold; `None` is no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Quotas {
    /// Leases that count at once, a gateway session's included.
    pub leases: Option<u32>,
    /// Gateway sessions at once.
    pub sessions: Option<u32>,
    /// Granted acquires per second, with a burst.
    pub rate: Option<Rate>,
    /// Bytes through the gateway (up and down) per UTC day.
    pub bytes_per_day: Option<u64>,
}

impl Quotas {
    /// Whether any quota is set.
    pub fn any(&self) -> bool {
        self.leases.is_some()
            || self.sessions.is_some()
            || self.rate.is_some()
            || self.bytes_per_day.is_some()
    }
}

/// Whose an acquire is: the tenant's name (recorded with the lease, and the scope of its
/// request ID) and the quotas it is held to.
#[derive(Debug, Clone, PartialEq)]
pub struct Tenancy {
    /// The tenant's name.
    pub name: Arc<str>,
    /// Its quotas.
    pub quotas: Quotas,
}

impl Tenancy {
    /// The default tenant: no quota.
    pub fn unrestricted() -> Self {
        Tenancy {
            name: DEFAULT_TENANT.into(),
            quotas: Quotas::default(),
        }
    }
}

/// Which quota refused an acquire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuotaKind {
    /// Concurrent leases.
    Leases,
    /// Gateway sessions.
    Sessions,
    /// Acquires per second.
    Rate,
    /// Bytes per UTC day.
    BytesPerDay,
}

impl QuotaKind {
    /// Every kind.
    pub const ALL: [QuotaKind; 4] = [
        QuotaKind::Leases,
        QuotaKind::Sessions,
        QuotaKind::Rate,
        QuotaKind::BytesPerDay,
    ];

    /// The kind as the API, the gateway and the metrics name it.
    pub fn as_str(self) -> &'static str {
        match self {
            QuotaKind::Leases => "leases",
            QuotaKind::Sessions => "sessions",
            QuotaKind::Rate => "acquiresPerSecond",
            QuotaKind::BytesPerDay => "bytesPerDay",
        }
    }
}

impl fmt::Display for QuotaKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An acquire refused because its tenant is at a quota.
#[derive(Debug, Clone, PartialEq)]
pub struct QuotaExceeded {
    /// The tenant.
    pub tenant: Arc<str>,
    /// The quota.
    pub quota: QuotaKind,
    /// Its limit: leases or sessions, acquires per second, or bytes per day.
    pub limit: f64,
    /// The bucket's size, for the rate quota.
    pub burst: Option<u32>,
    /// How long until the quota would let an acquire through by itself (at least 1 ms).
    pub retry_after: Duration,
}

impl QuotaExceeded {
    /// Why, for people.
    pub fn message(&self) -> String {
        match self.quota {
            QuotaKind::Rate => format!(
                "tenant {} is over its quota of {} acquires per second (burst {})",
                self.tenant,
                self.limit,
                self.burst.unwrap_or(0)
            ),
            QuotaKind::Leases => format!(
                "tenant {} holds {} leases, its quota: release one first",
                self.tenant, self.limit
            ),
            QuotaKind::Sessions => format!(
                "tenant {} has {} gateway sessions, its quota: end one first",
                self.tenant, self.limit
            ),
            QuotaKind::BytesPerDay => format!(
                "tenant {} used its quota of {} bytes through the gateway today (UTC): it \
                 frees at midnight UTC",
                self.tenant, self.limit
            ),
        }
    }
}

/// What a tenant holds at the moment of an acquire.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TenantUsage {
    /// Its leases that count.
    pub leases: u32,
    /// Those of them that belong to a gateway session.
    pub sessions: u32,
    /// The earliest expiry among its leases that count (ms).
    pub earliest_expiry: Option<i64>,
    /// The earliest expiry among its sessions' leases (ms).
    pub earliest_session_expiry: Option<i64>,
    /// Its bytes through the gateway on the current UTC day.
    pub bytes_today: u64,
}

impl TenantUsage {
    /// Counts one more lease expiring at `expires_at` (a session's when `session`).
    pub fn count(&mut self, expires_at: i64, session: bool) {
        self.leases = self.leases.saturating_add(1);
        self.earliest_expiry = Some(
            self.earliest_expiry
                .map_or(expires_at, |e| e.min(expires_at)),
        );
        if session {
            self.sessions = self.sessions.saturating_add(1);
            self.earliest_session_expiry = Some(
                self.earliest_session_expiry
                    .map_or(expires_at, |e| e.min(expires_at)),
            );
        }
    }
}

/// A tenant's token bucket: `tokens` as of `at` (ms).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bucket {
    /// Tokens left (0 ≤ tokens ≤ burst).
    pub tokens: f64,
    /// When `tokens` was last brought up to date.
    pub at: i64,
}

impl Bucket {
    /// A full bucket at `now`: a tenant starts with its burst.
    pub fn full(rate: &Rate, now: i64) -> Self {
        Bucket {
            tokens: f64::from(rate.burst),
            at: now,
        }
    }

    /// The bucket at `now`: refilled for the time since `at`, never above the burst. A clock
    /// that stepped back refills nothing.
    pub fn refilled(self, rate: &Rate, now: i64) -> Self {
        let elapsed_ms = now.saturating_sub(self.at).max(0);
        #[expect(
            clippy::cast_precision_loss,
            reason = "milliseconds well within f64's exact integers"
        )]
        let added = elapsed_ms as f64 * rate.per_second / 1000.0;
        Bucket {
            tokens: (self.tokens + added).min(f64::from(rate.burst)),
            at: now.max(self.at),
        }
    }

    /// The bucket with one token taken (the caller checked there is one).
    pub fn taken(self) -> Self {
        Bucket {
            tokens: (self.tokens - 1.0).max(0.0),
            ..self
        }
    }
}

/// Whether a tenant with `usage` and `bucket` (refilled to `now`; `None` without a rate
/// quota) may be granted one more lease (a gateway session's when `session`). The day's
/// bytes are checked first (nothing else frees them before the day's turn), then the lease
/// quota, then the session quota, then the rate.
pub fn check(
    tenant: &Tenancy,
    usage: &TenantUsage,
    bucket: Option<&Bucket>,
    session: bool,
    now: i64,
) -> Result<(), QuotaExceeded> {
    let quotas = &tenant.quotas;
    let refused = |quota, limit: f64, burst, retry_after| QuotaExceeded {
        tenant: tenant.name.clone(),
        quota,
        limit,
        burst,
        retry_after,
    };
    let slot_wait = |earliest: Option<i64>| {
        let until = earliest.map_or(0, |e| e.saturating_sub(now)).max(1);
        Duration::from_millis(until.unsigned_abs()).min(MAX_SLOT_WAIT)
    };
    if let Some(refused) = bytes_spent(tenant, usage.bytes_today, now) {
        return Err(refused);
    }
    if let Some(limit) = quotas.leases
        && usage.leases >= limit
    {
        return Err(refused(
            QuotaKind::Leases,
            f64::from(limit),
            None,
            slot_wait(usage.earliest_expiry),
        ));
    }
    if session
        && let Some(limit) = quotas.sessions
        && usage.sessions >= limit
    {
        return Err(refused(
            QuotaKind::Sessions,
            f64::from(limit),
            None,
            slot_wait(usage.earliest_session_expiry),
        ));
    }
    if let (Some(rate), Some(bucket)) = (quotas.rate, bucket)
        && bucket.tokens < 1.0
    {
        let missing = 1.0 - bucket.tokens;
        let wait = Duration::from_secs_f64(missing / rate.per_second).max(Duration::from_millis(1));
        return Err(refused(
            QuotaKind::Rate,
            rate.per_second,
            Some(rate.burst),
            wait,
        ));
    }
    Ok(())
}

/// The refusal of a tenant whose bytes today (`bytes_today` at `now`) reached its
/// `bytes_per_day`; `None` under it, or without that quota. It frees at the next midnight UTC.
pub fn bytes_spent(tenant: &Tenancy, bytes_today: u64, now: i64) -> Option<QuotaExceeded> {
    let limit = tenant.quotas.bytes_per_day?;
    #[expect(
        clippy::cast_precision_loss,
        reason = "a limit in bytes, exact below 2^53 (8 PiB)"
    )]
    let limit_f64 = limit as f64;
    (bytes_today >= limit).then(|| QuotaExceeded {
        tenant: tenant.name.clone(),
        quota: QuotaKind::BytesPerDay,
        limit: limit_f64,
        burst: None,
        retry_after: super::traffic::until_next_day(now),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant(leases: Option<u32>, sessions: Option<u32>, rate: Option<(f64, u32)>) -> Tenancy {
        Tenancy {
            name: "team-a".into(),
            quotas: Quotas {
                leases,
                sessions,
                rate: rate.map(|(per_second, burst)| Rate { per_second, burst }),
                bytes_per_day: None,
            },
        }
    }

    fn usage(leases: u32, sessions: u32) -> TenantUsage {
        TenantUsage {
            leases,
            sessions,
            earliest_expiry: Some(3_000),
            earliest_session_expiry: Some(2_500),
            bytes_today: 0,
        }
    }

    #[test]
    fn the_days_bytes_refuse_first_once_they_reach_the_budget_until_midnight_utc() {
        let budget = |bytes_per_day| Tenancy {
            quotas: Quotas {
                bytes_per_day,
                ..tenant(Some(1), None, Some((1.0, 1))).quotas
            },
            ..tenant(None, None, None)
        };
        let spent = |bytes_today, leases| TenantUsage {
            bytes_today,
            ..usage(leases, 0)
        };
        // 2026-01-01T18:00:00Z: six hours to the day's turn.
        let now = 1_767_290_400_000;
        let empty = Some(Bucket {
            tokens: 0.0,
            at: now,
        });
        let full = Some(Bucket {
            tokens: 1.0,
            at: now,
        });
        // (case, budget, bytes today, leases held, bucket, the quota that refuses)
        let cases = [
            ("no budget", None, u64::MAX, 0, full, None),
            ("under it", Some(1_000), 999, 0, full, None),
            (
                "at it",
                Some(1_000),
                1_000,
                0,
                full,
                Some(QuotaKind::BytesPerDay),
            ),
            (
                "over it",
                Some(1_000),
                5_000,
                0,
                full,
                Some(QuotaKind::BytesPerDay),
            ),
            (
                "before the leases",
                Some(1_000),
                1_000,
                1,
                full,
                Some(QuotaKind::BytesPerDay),
            ),
            (
                "before the rate",
                Some(1_000),
                1_000,
                0,
                empty,
                Some(QuotaKind::BytesPerDay),
            ),
            (
                "under it, the leases",
                Some(1_000),
                10,
                1,
                full,
                Some(QuotaKind::Leases),
            ),
        ];
        for (name, bytes_per_day, today, leases, bucket, expected) in cases {
            let verdict = check(
                &budget(bytes_per_day),
                &spent(today, leases),
                bucket.as_ref(),
                false,
                now,
            );
            assert_eq!(verdict.err().map(|e| e.quota), expected, "{name}");
        }
        let refused = bytes_spent(&budget(Some(1_000)), 1_000, now).unwrap();
        assert_eq!(refused.retry_after, Duration::from_secs(6 * 3600));
        assert_eq!((refused.limit, refused.burst), (1_000.0, None));
        assert_eq!(
            refused.message(),
            "tenant team-a used its quota of 1000 bytes through the gateway today (UTC): it \
             frees at midnight UTC"
        );
    }

    /// `(case, tenant, what it holds, its bucket, a session's?, the quota that refuses)`.
    type QuotaCase = (
        &'static str,
        Tenancy,
        TenantUsage,
        Option<Bucket>,
        bool,
        Option<QuotaKind>,
    );

    #[test]
    fn quotas_table() {
        let bucket = |tokens| Bucket { tokens, at: 1_000 };
        let cases: [QuotaCase; 11] = [
            (
                "no quota",
                tenant(None, None, None),
                usage(99, 99),
                None,
                true,
                None,
            ),
            (
                "below leases",
                tenant(Some(3), None, None),
                usage(2, 0),
                None,
                false,
                None,
            ),
            (
                "at leases",
                tenant(Some(3), None, None),
                usage(3, 0),
                None,
                false,
                Some(QuotaKind::Leases),
            ),
            (
                "a session at leases is refused for leases",
                tenant(Some(3), Some(9), None),
                usage(3, 1),
                None,
                true,
                Some(QuotaKind::Leases),
            ),
            (
                "at sessions, a session",
                tenant(Some(9), Some(1), None),
                usage(2, 1),
                None,
                true,
                Some(QuotaKind::Sessions),
            ),
            (
                "at sessions, not a session",
                tenant(Some(9), Some(1), None),
                usage(2, 1),
                None,
                false,
                None,
            ),
            (
                "a token left",
                tenant(None, None, Some((2.0, 4))),
                usage(0, 0),
                Some(bucket(1.0)),
                false,
                None,
            ),
            (
                "less than a token",
                tenant(None, None, Some((2.0, 4))),
                usage(0, 0),
                Some(bucket(0.99)),
                false,
                Some(QuotaKind::Rate),
            ),
            (
                "a rate without its bucket is not checked",
                tenant(None, None, Some((2.0, 4))),
                usage(0, 0),
                None,
                false,
                None,
            ),
            (
                "leases first, then the rate",
                tenant(Some(1), None, Some((2.0, 4))),
                usage(1, 0),
                Some(bucket(0.0)),
                false,
                Some(QuotaKind::Leases),
            ),
            (
                "sessions before the rate",
                tenant(None, Some(1), Some((2.0, 4))),
                usage(1, 1),
                Some(bucket(0.0)),
                true,
                Some(QuotaKind::Sessions),
            ),
        ];
        for (name, tenant, usage, bucket, session, expected) in cases {
            let verdict = check(&tenant, &usage, bucket.as_ref(), session, 1_000);
            assert_eq!(verdict.err().map(|e| e.quota), expected, "{name}");
        }
    }

    #[test]
    fn retry_after_is_when_the_quota_frees_up_by_itself() {
        let leases = check(
            &tenant(Some(1), None, None),
            &usage(1, 0),
            None,
            false,
            1_000,
        )
        .unwrap_err();
        assert_eq!(leases.retry_after, Duration::from_secs(2));
        assert_eq!(leases.limit, 1.0);
        // A lease expiring in an hour: capped, since crawlers release first.
        let far = TenantUsage {
            earliest_expiry: Some(3_600_000),
            ..usage(1, 0)
        };
        let capped = check(&tenant(Some(1), None, None), &far, None, false, 0).unwrap_err();
        assert_eq!(capped.retry_after, MAX_SLOT_WAIT);
        let sessions = check(
            &tenant(None, Some(1), None),
            &usage(1, 1),
            None,
            true,
            1_000,
        )
        .unwrap_err();
        assert_eq!(sessions.retry_after, Duration::from_millis(1_500));
        let rate = check(
            &tenant(None, None, Some((4.0, 2))),
            &usage(0, 0),
            Some(&Bucket { tokens: 0.5, at: 0 }),
            false,
            0,
        )
        .unwrap_err();
        assert_eq!(rate.retry_after, Duration::from_millis(125));
        assert_eq!((rate.limit, rate.burst), (4.0, Some(2)));
        assert!(rate.message().contains("4 acquires per second (burst 2)"));
    }

    #[test]
    fn a_bucket_refills_at_its_rate_up_to_its_burst() {
        let rate = Rate {
            per_second: 2.0,
            burst: 3,
        };
        let full = Bucket::full(&rate, 0);
        assert_eq!(full.tokens, 3.0);
        let empty = full.taken().taken().taken();
        assert_eq!(empty.tokens, 0.0);
        assert_eq!(empty.taken().tokens, 0.0);
        assert_eq!(empty.refilled(&rate, 250).tokens, 0.5);
        assert_eq!(empty.refilled(&rate, 60_000).tokens, 3.0);
        // A clock that stepped back refills nothing and keeps the later time.
        let later = Bucket {
            tokens: 1.0,
            at: 5_000,
        };
        assert_eq!(later.refilled(&rate, 4_000), later);
    }

    #[test]
    fn grants_over_any_window_stay_within_the_burst_and_the_rate() {
        // A tenant asking every 10 ms for 30 s: within each 10 s window, at most
        // 10 × rate + burst grants.
        let tenant = tenant(None, None, Some((3.0, 5)));
        let Some(rate) = tenant.quotas.rate else {
            unreachable!()
        };
        let mut bucket = Bucket::full(&rate, 0);
        let mut grants = Vec::new();
        for now in (0..30_000).step_by(10) {
            bucket = bucket.refilled(&rate, now);
            if check(&tenant, &TenantUsage::default(), Some(&bucket), false, now).is_ok() {
                bucket = bucket.taken();
                grants.push(now);
            }
        }
        for start in (0..20_000).step_by(10) {
            let within = grants
                .iter()
                .filter(|&&t| t >= start && t < start + 10_000)
                .count();
            assert!(within <= 10 * 3 + 5, "{within} grants from {start} ms");
        }
        // And the rate is actually reached over the whole run.
        assert!(grants.len() >= 3 * 30, "{} grants", grants.len());
    }

    #[test]
    fn usage_counts_leases_and_sessions_with_their_earliest_expiry() {
        let mut usage = TenantUsage::default();
        usage.count(500, false);
        usage.count(300, true);
        usage.count(400, true);
        assert_eq!(
            usage,
            TenantUsage {
                leases: 3,
                sessions: 2,
                earliest_expiry: Some(300),
                earliest_session_expiry: Some(300),
                bytes_today: 0,
            }
        );
    }
}
