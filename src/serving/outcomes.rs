//! How requests through each proxy, and to each target, ended over the last hour: the signal
//! behind a proxy's success rate. The ledger hears only bans and errors (a row per request
//! would cost a write per request), so the gateway and the report routes count every outcome
//! here instead, in memory, per replica: a restart starts from nothing, and each replica counts
//! what it served.
//!
//! - **Window**: one bucket per minute (aligned to the Unix epoch) of the clock's time; a read
//!   sums the minute holding now and the 59 before it, so a count made at `t` is still read
//!   at `t + 59 min` and gone by `t + 60 min`. Memory follows the minutes that saw traffic.
//! - **Success** (see [`OutcomeCounts::success_rate`]): 2xx and 3xx answers, tunnels opened,
//!   `ok` reports. **Failure**: answers in the gateway's ban rule (whatever their status),
//!   5xx, tunnels that failed to open, upstream failures before an answer, `rate_limited`,
//!   `blocked` and `error` reports. **Neither**: other 4xx (the request's fault, not the
//!   proxy's), and 1xx or non-standard statuses.
//! - **Reports add up**: a report is one more observation, never a correction of one already
//!   counted. Inside a TLS tunnel the gateway counts only the tunnel, so a crawler's reports
//!   are the only word on the answers; a crawler reporting an answer the gateway relayed (and
//!   counted) counts it twice, which is why the gateway marks the bans it reported
//!   (`X-Proxy-Ban-Reported`).
//! - **Bounds**: at most [`MAX_TARGETS`] targets are counted by name; further ones, while
//!   those stay in the window, and a target named [`OTHER_TARGETS`], are counted under
//!   [`OTHER_TARGETS`], so what crawlers send cannot grow memory. Tenants come from the tenants
//!   file (at most [`MAX_TENANTS`] and `default`). Proxies are not bounded (the
//!   inventory names them, not the crawlers); a proxy or target whose last count left the
//!   window is dropped, so a deleted proxy is forgotten an hour after its last request.

use std::borrow::Borrow;
use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

pub use crate::ledger::OTHER_TARGETS;
use crate::ledger::{Clock, ReportResult};
use crate::resources::proxy::ProxyId;
use crate::serving::tenants::MAX_TENANTS;

/// Minutes in the sliding window.
pub const WINDOW_MINUTES: i64 = 60;

/// The length of a bucket.
const SECONDS_PER_MINUTE: i64 = 60;

/// Targets counted by name; the rest are counted under [`OTHER_TARGETS`].
pub const MAX_TARGETS: usize = 1000;

/// How one request, tunnel or report ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The target answered a plain-HTTP request with `status`; `banned`: the status is in the
    /// gateway's ban rule (`--gateway-ban-statuses`).
    Http {
        /// The target's status.
        status: u16,
        /// Whether the ban rule names the status.
        banned: bool,
    },
    /// A `CONNECT` tunnel opened through the proxy.
    TunnelOpened,
    /// The proxy did not open a `CONNECT` tunnel (refused, timed out, answered non-2xx).
    TunnelFailed,
    /// The proxy failed a plain-HTTP request before the target's answer came back.
    UpstreamFailed,
    /// A crawler reported this through the lease API.
    Reported(ReportResult),
}

/// The fields of [`OutcomeCounts`], as indexes of a bucket's counters. Every outcome counts
/// in exactly one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    HttpOther,
    Http2xx,
    Http3xx,
    Http4xx,
    Http5xx,
    Banned,
    TunnelsOpened,
    TunnelsFailed,
    UpstreamFailed,
    ReportsOk,
    ReportsRateLimited,
    ReportsBlocked,
    ReportsError,
}

const CLASSES: usize = 13;

impl Outcome {
    fn class(self) -> Class {
        match self {
            Outcome::Http { banned: true, .. } => Class::Banned,
            Outcome::Http { status, .. } => match status {
                200..=299 => Class::Http2xx,
                300..=399 => Class::Http3xx,
                400..=499 => Class::Http4xx,
                500..=599 => Class::Http5xx,
                _ => Class::HttpOther,
            },
            Outcome::TunnelOpened => Class::TunnelsOpened,
            Outcome::TunnelFailed => Class::TunnelsFailed,
            Outcome::UpstreamFailed => Class::UpstreamFailed,
            Outcome::Reported(ReportResult::Ok) => Class::ReportsOk,
            Outcome::Reported(ReportResult::RateLimited) => Class::ReportsRateLimited,
            Outcome::Reported(ReportResult::Blocked) => Class::ReportsBlocked,
            Outcome::Reported(ReportResult::Error) => Class::ReportsError,
        }
    }
}

/// Outcomes over the last hour, by class; each outcome counts in exactly one field.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema, ToSchema,
)]
#[serde(rename_all = "camelCase")]
pub struct OutcomeCounts {
    /// 2xx answers (success).
    pub http2xx: u64,
    /// 3xx answers (success).
    pub http3xx: u64,
    /// 4xx answers outside the ban rule (neither: the request's fault, not the proxy's).
    pub http4xx: u64,
    /// 5xx answers outside the ban rule (failure).
    pub http5xx: u64,
    /// 1xx and non-standard statuses (neither).
    pub http_other: u64,
    /// Answers whose status is in the gateway's ban rule, 429 and 403 by default (failure).
    pub banned: u64,
    /// `CONNECT` tunnels opened (success).
    pub tunnels_opened: u64,
    /// `CONNECT` tunnels the proxy did not open (failure).
    pub tunnels_failed: u64,
    /// Plain requests the proxy failed before an answer (failure).
    pub upstream_failed: u64,
    /// `ok` reports (success).
    pub reports_ok: u64,
    /// `rate_limited` reports (failure).
    pub reports_rate_limited: u64,
    /// `blocked` reports (failure).
    pub reports_blocked: u64,
    /// `error` reports (failure).
    pub reports_error: u64,
}

impl OutcomeCounts {
    /// The counts of a bucket sum, indexed by [`Class`].
    fn from_sums(sums: &[u64; CLASSES]) -> Self {
        let count = |class: Class| sums[class as usize];
        OutcomeCounts {
            http2xx: count(Class::Http2xx),
            http3xx: count(Class::Http3xx),
            http4xx: count(Class::Http4xx),
            http5xx: count(Class::Http5xx),
            http_other: count(Class::HttpOther),
            banned: count(Class::Banned),
            tunnels_opened: count(Class::TunnelsOpened),
            tunnels_failed: count(Class::TunnelsFailed),
            upstream_failed: count(Class::UpstreamFailed),
            reports_ok: count(Class::ReportsOk),
            reports_rate_limited: count(Class::ReportsRateLimited),
            reports_blocked: count(Class::ReportsBlocked),
            reports_error: count(Class::ReportsError),
        }
    }

    /// Adds `other`'s counts to these.
    fn add(&mut self, other: &OutcomeCounts) {
        let fields = [
            (&mut self.http2xx, other.http2xx),
            (&mut self.http3xx, other.http3xx),
            (&mut self.http4xx, other.http4xx),
            (&mut self.http5xx, other.http5xx),
            (&mut self.http_other, other.http_other),
            (&mut self.banned, other.banned),
            (&mut self.tunnels_opened, other.tunnels_opened),
            (&mut self.tunnels_failed, other.tunnels_failed),
            (&mut self.upstream_failed, other.upstream_failed),
            (&mut self.reports_ok, other.reports_ok),
            (&mut self.reports_rate_limited, other.reports_rate_limited),
            (&mut self.reports_blocked, other.reports_blocked),
            (&mut self.reports_error, other.reports_error),
        ];
        for (sum, n) in fields {
            *sum = sum.saturating_add(n);
        }
    }

    /// Requests the gateway relayed (answers, tunnels and upstream failures; not reports).
    pub fn relayed(&self) -> u64 {
        [
            self.http2xx,
            self.http3xx,
            self.http4xx,
            self.http5xx,
            self.http_other,
            self.banned,
            self.tunnels_opened,
            self.tunnels_failed,
            self.upstream_failed,
        ]
        .iter()
        .fold(0, |sum, n| sum.saturating_add(*n))
    }

    /// Outcomes that say the proxy works: 2xx and 3xx answers, tunnels opened, `ok` reports.
    pub fn successes(&self) -> u64 {
        [
            self.http2xx,
            self.http3xx,
            self.tunnels_opened,
            self.reports_ok,
        ]
        .iter()
        .fold(0, |sum, n| sum.saturating_add(*n))
    }

    /// Outcomes that say it does not: bans, 5xx, tunnels failed, upstream failures,
    /// `rate_limited`, `blocked` and `error` reports.
    pub fn failures(&self) -> u64 {
        [
            self.banned,
            self.http5xx,
            self.tunnels_failed,
            self.upstream_failed,
            self.reports_rate_limited,
            self.reports_blocked,
            self.reports_error,
        ]
        .iter()
        .fold(0, |sum, n| sum.saturating_add(*n))
    }

    /// Every outcome counted, those that count in neither successes nor failures too.
    pub fn total(&self) -> u64 {
        self.successes()
            .saturating_add(self.failures())
            .saturating_add(self.http4xx)
            .saturating_add(self.http_other)
    }

    /// Successes ÷ (successes + failures), from 0 to 1; `None` without either.
    pub fn success_rate(&self) -> Option<f64> {
        let successes = self.successes();
        let judged = successes.saturating_add(self.failures());
        (judged > 0).then(|| successes as f64 / judged as f64)
    }
}

/// Counts minute by minute over the last hour.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PerMinute {
    /// The start of the first minute, ms since the Unix epoch.
    pub from_ms: i64,
    /// [`WINDOW_MINUTES`] minutes' counts, oldest first; the last is the minute holding now.
    pub minutes: Vec<OutcomeCounts>,
}

impl PerMinute {
    /// The minutes of `window` (none: all zero) up to the minute `now`.
    fn of(window: Option<&Window>, now: i64) -> PerMinute {
        let first = now - WINDOW_MINUTES + 1;
        let mut minutes =
            vec![OutcomeCounts::default(); usize::try_from(WINDOW_MINUTES).unwrap_or(60)];
        for bucket in window.map(|w| &w.buckets).into_iter().flatten() {
            let Ok(index) = usize::try_from(bucket.minute - first) else {
                continue;
            };
            if let Some(slot) = minutes.get_mut(index) {
                let mut sums = [0u64; CLASSES];
                for (sum, count) in sums.iter_mut().zip(bucket.counts) {
                    *sum = u64::from(count);
                }
                slot.add(&OutcomeCounts::from_sums(&sums));
            }
        }
        PerMinute {
            from_ms: first.saturating_mul(SECONDS_PER_MINUTE * 1000),
            minutes,
        }
    }
}

/// The counters of one minute.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    /// Minutes since the Unix epoch.
    minute: i64,
    counts: [u32; CLASSES],
}

/// Whether a count made in `minute` is read at `now` (both minutes since the epoch). A count
/// ahead of `now` (the clock stepped back) is read as current rather than lost.
fn in_window(minute: i64, now: i64) -> bool {
    minute > now.saturating_sub(WINDOW_MINUTES)
}

/// The minutes of one proxy or target that saw traffic, oldest first, at most
/// [`WINDOW_MINUTES`] of them.
#[derive(Debug, Default)]
struct Window {
    buckets: VecDeque<Bucket>,
}

impl Window {
    /// Counts `class` in `minute`. A clock that stepped back counts into the newest minute,
    /// so the minutes stay in order.
    fn add(&mut self, minute: i64, class: Class) {
        let newest = self.buckets.back().map(|b| b.minute);
        if newest.is_none_or(|newest| newest < minute) {
            while self
                .buckets
                .front()
                .is_some_and(|b| !in_window(b.minute, minute))
            {
                self.buckets.pop_front();
            }
            self.buckets.push_back(Bucket {
                minute,
                counts: [0; CLASSES],
            });
        }
        if let Some(bucket) = self.buckets.back_mut() {
            let count = &mut bucket.counts[class as usize];
            *count = count.saturating_add(1);
        }
    }

    fn counts(&self, now: i64) -> OutcomeCounts {
        self.counts_within(now, WINDOW_MINUTES)
    }

    /// The counts of the last `minutes` at `now` (the minute holding now included).
    fn counts_within(&self, now: i64, minutes: i64) -> OutcomeCounts {
        let mut sums = [0u64; CLASSES];
        let first = now.saturating_sub(minutes.min(WINDOW_MINUTES));
        for bucket in self.buckets.iter().filter(|b| b.minute > first) {
            for (sum, count) in sums.iter_mut().zip(bucket.counts) {
                *sum = sum.saturating_add(u64::from(count));
            }
        }
        OutcomeCounts::from_sums(&sums)
    }

    /// Whether anything counted is still read at `now`.
    fn live(&self, now: i64) -> bool {
        self.buckets
            .back()
            .is_some_and(|b| in_window(b.minute, now))
    }
}

/// Windows by key, at most `limit` of them; those with nothing left in the window are dropped
/// once a minute.
#[derive(Debug)]
struct Keyed<K> {
    windows: HashMap<K, Window>,
    limit: usize,
    /// The minute of the last sweep.
    swept: i64,
}

impl<K: Hash + Eq> Keyed<K> {
    fn new(limit: usize) -> Self {
        Keyed {
            windows: HashMap::new(),
            limit,
            swept: i64::MIN,
        }
    }

    /// Drops the windows with nothing left to read at `now`, at most once a minute.
    fn sweep(&mut self, now: i64) {
        if self.swept != now {
            self.windows.retain(|_, window| window.live(now));
            self.swept = now;
        }
    }

    /// Counts `class` for `key` in `minute`; `false` when the key is new and `limit` keys are
    /// counted already. Allocates only for a new key.
    fn add<Q>(&mut self, key: &Q, minute: i64, class: Class) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.sweep(minute);
        if let Some(window) = self.windows.get_mut(key) {
            window.add(minute, class);
            return true;
        }
        if self.windows.len() >= self.limit {
            return false;
        }
        self.windows
            .entry(key.to_owned())
            .or_default()
            .add(minute, class);
        true
    }

    /// Every key's counts at `now`.
    fn counts(&mut self, now: i64) -> impl Iterator<Item = (&K, OutcomeCounts)> {
        self.sweep(now);
        self.windows
            .iter()
            .map(move |(key, window)| (key, window.counts(now)))
    }
}

/// The targets counted by name, and the rest.
#[derive(Debug)]
struct Targets {
    named: Keyed<String>,
    other: Window,
}

struct Shared {
    clock: Arc<dyn Clock>,
    proxies: Mutex<Keyed<ProxyId>>,
    targets: Mutex<Targets>,
    tenants: Mutex<Keyed<String>>,
}

/// Outcome counts per proxy and per target over a sliding hour, shared by the gateway and the
/// API (cheap to clone). Proxies and targets have a lock each, held for a hash lookup and an
/// increment.
#[derive(Clone)]
pub struct Outcomes {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Outcomes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outcomes").finish_non_exhaustive()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Outcomes {
    /// Counts kept on `clock`'s time.
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Outcomes {
            shared: Arc::new(Shared {
                clock,
                proxies: Mutex::new(Keyed::new(usize::MAX)),
                targets: Mutex::new(Targets {
                    named: Keyed::new(MAX_TARGETS),
                    other: Window::default(),
                }),
                tenants: Mutex::new(Keyed::new(MAX_TENANTS + 1)),
            }),
        }
    }

    /// The current minute since the Unix epoch.
    fn minute(&self) -> i64 {
        self.shared
            .clock
            .now()
            .as_second()
            .div_euclid(SECONDS_PER_MINUTE)
    }

    /// Counts `outcome` of `tenant`'s request for `proxy` and, when given, `target` (a host,
    /// already lower-cased as the gateway and the API hand it over).
    pub fn record(&self, tenant: &str, proxy: &ProxyId, target: Option<&str>, outcome: Outcome) {
        let minute = self.minute();
        let class = outcome.class();
        lock(&self.shared.proxies).add(proxy, minute, class);
        lock(&self.shared.tenants).add(tenant, minute, class);
        if let Some(target) = target {
            let mut targets = lock(&self.shared.targets);
            if target == OTHER_TARGETS || !targets.named.add(target, minute, class) {
                targets.other.add(minute, class);
            }
        }
    }

    /// `proxy`'s counts over the last hour (all zero when it has none).
    pub fn proxy(&self, proxy: &ProxyId) -> OutcomeCounts {
        let now = self.minute();
        lock(&self.shared.proxies)
            .windows
            .get(proxy)
            .map(|window| window.counts(now))
            .unwrap_or_default()
    }

    /// Every proxy with counts in the last hour, ordered by identity.
    pub fn proxies(&self) -> Vec<(ProxyId, OutcomeCounts)> {
        let now = self.minute();
        let mut proxies: Vec<(ProxyId, OutcomeCounts)> = lock(&self.shared.proxies)
            .counts(now)
            .filter(|(_, counts)| counts.total() > 0)
            .map(|(id, counts)| (id.clone(), counts))
            .collect();
        proxies.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        proxies
    }

    /// The outcomes of the proxies `include` picks, summed over the last `minutes` (at most
    /// the hour; the minute holding now included): the fleet's (or a tenant's scope's) recent
    /// traffic.
    pub fn recent(&self, minutes: i64, include: impl Fn(&ProxyId) -> bool) -> OutcomeCounts {
        let now = self.minute();
        let guard = lock(&self.shared.proxies);
        let mut sum = OutcomeCounts::default();
        for (_, window) in guard.windows.iter().filter(|(id, _)| include(id)) {
            sum.add(&window.counts_within(now, minutes));
        }
        sum
    }

    /// `tenant`'s counts in each minute of the last hour.
    pub fn tenant_minutes(&self, tenant: &str) -> PerMinute {
        let now = self.minute();
        let guard = lock(&self.shared.tenants);
        PerMinute::of(guard.windows.get(tenant), now)
    }

    /// `target`'s counts in each minute of the last hour (a target not counted by name: none).
    pub fn target_minutes(&self, target: &str) -> PerMinute {
        let now = self.minute();
        let guard = lock(&self.shared.targets);
        PerMinute::of(guard.named.windows.get(target), now)
    }

    /// Every target with counts in the last hour, most outcomes first (ties by name), then
    /// [`OTHER_TARGETS`] when the targets beyond the bound have any.
    pub fn targets(&self) -> Vec<(String, OutcomeCounts)> {
        let now = self.minute();
        let mut guard = lock(&self.shared.targets);
        let other = guard.other.counts(now);
        let mut targets: Vec<(String, OutcomeCounts)> = guard
            .named
            .counts(now)
            .filter(|(_, counts)| counts.total() > 0)
            .map(|(target, counts)| (target.clone(), counts))
            .collect();
        drop(guard);
        targets.sort_unstable_by(|a, b| b.1.total().cmp(&a.1.total()).then_with(|| a.0.cmp(&b.0)));
        if other.total() > 0 {
            targets.push((OTHER_TARGETS.to_owned(), other));
        }
        targets
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use jiff::Timestamp;

    use super::*;
    use crate::ledger::ManualClock;

    const MINUTE: Duration = Duration::from_secs(60);

    fn proxy(name: &str) -> ProxyId {
        ProxyId {
            namespace: "default".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
        }
    }

    /// A clock 10 s into a minute, and counts on it.
    fn outcomes() -> (Arc<ManualClock>, Outcomes) {
        let start = Timestamp::from_second(1_700_000_000 / 60 * 60 + 10).unwrap();
        let clock = Arc::new(ManualClock::new(start));
        (clock.clone(), Outcomes::new(clock))
    }

    /// Sets some fields of zero counts, in a table of cases.
    type Set = fn(&mut OutcomeCounts);

    fn counts(set: impl FnOnce(&mut OutcomeCounts)) -> OutcomeCounts {
        let mut counts = OutcomeCounts::default();
        set(&mut counts);
        counts
    }

    #[test]
    fn every_outcome_counts_in_one_class() {
        let http = |status, banned| Outcome::Http { status, banned };
        let cases: [(Outcome, Set); 20] = [
            (http(200, false), |c| c.http2xx = 1),
            (http(204, false), |c| c.http2xx = 1),
            (http(301, false), |c| c.http3xx = 1),
            (http(304, false), |c| c.http3xx = 1),
            (http(404, false), |c| c.http4xx = 1),
            (http(499, false), |c| c.http4xx = 1),
            (http(500, false), |c| c.http5xx = 1),
            (http(599, false), |c| c.http5xx = 1),
            (http(101, false), |c| c.http_other = 1),
            (http(600, false), |c| c.http_other = 1),
            (http(429, true), |c| c.banned = 1),
            (http(403, true), |c| c.banned = 1),
            (http(503, true), |c| c.banned = 1),
            (Outcome::TunnelOpened, |c| c.tunnels_opened = 1),
            (Outcome::TunnelFailed, |c| c.tunnels_failed = 1),
            (Outcome::UpstreamFailed, |c| c.upstream_failed = 1),
            (Outcome::Reported(ReportResult::Ok), |c| c.reports_ok = 1),
            (Outcome::Reported(ReportResult::RateLimited), |c| {
                c.reports_rate_limited = 1
            }),
            (Outcome::Reported(ReportResult::Blocked), |c| {
                c.reports_blocked = 1
            }),
            (Outcome::Reported(ReportResult::Error), |c| {
                c.reports_error = 1
            }),
        ];
        for (outcome, expected) in cases {
            let (_, outcomes) = outcomes();
            let p = proxy("a");
            outcomes.record("team", &p, Some("example.com"), outcome);
            let expected = counts(expected);
            assert_eq!(outcomes.proxy(&p), expected, "{outcome:?}");
            assert_eq!(
                outcomes.targets(),
                vec![("example.com".to_owned(), expected)],
                "{outcome:?}"
            );
            assert_eq!(expected.total(), 1, "{outcome:?}");
        }
    }

    #[test]
    fn success_rate_weighs_successes_against_failures() {
        let cases: [(Set, Option<f64>); 8] = [
            (|_| {}, None),
            (|c| c.http4xx = 5, None),
            (|c| c.http_other = 2, None),
            (|c| c.http2xx = 3, Some(1.0)),
            (|c| c.banned = 1, Some(0.0)),
            (
                |c| {
                    c.http2xx = 6;
                    c.http3xx = 1;
                    c.tunnels_opened = 1;
                    c.reports_ok = 1;
                    c.http4xx = 100;
                    c.upstream_failed = 1;
                },
                Some(0.9),
            ),
            (
                |c| {
                    c.tunnels_opened = 7;
                    c.banned = 1;
                    c.http5xx = 1;
                    c.tunnels_failed = 1;
                },
                Some(0.7),
            ),
            (
                |c| {
                    c.reports_ok = 1;
                    c.reports_rate_limited = 1;
                    c.reports_blocked = 1;
                    c.reports_error = 1;
                },
                Some(0.25),
            ),
        ];
        for (set, expected) in cases {
            let c = counts(set);
            match (c.success_rate(), expected) {
                (Some(rate), Some(expected)) => {
                    assert!((rate - expected).abs() < 1e-9, "{c:?}: {rate}")
                }
                (rate, expected) => assert_eq!(rate, expected, "{c:?}"),
            }
        }
    }

    #[test]
    fn a_report_adds_to_the_answer_it_is_about() {
        let (_, outcomes) = outcomes();
        let p = proxy("a");
        outcomes.record(
            "team",
            &p,
            Some("t"),
            Outcome::Http {
                status: 200,
                banned: false,
            },
        );
        outcomes.record(
            "team",
            &p,
            Some("t"),
            Outcome::Reported(ReportResult::Blocked),
        );
        let c = outcomes.proxy(&p);
        assert_eq!((c.http2xx, c.reports_blocked), (1, 1));
        assert_eq!(c.success_rate(), Some(0.5));
    }

    #[test]
    fn counts_stay_for_59_minutes_and_leave_at_60() {
        // (minutes after the count, at which second of that minute, still read)
        let cases = [
            (0, 0, true),
            (1, 0, true),
            (59, 0, true),
            (59, 49, true),
            (59, 50, false),
            (60, 0, false),
            (61, 0, false),
            (24 * 60, 0, false),
        ];
        for (minutes, seconds, read) in cases {
            let (clock, outcomes) = outcomes();
            let p = proxy("a");
            outcomes.record("team", &p, Some("t"), Outcome::TunnelOpened);
            clock.advance(MINUTE * minutes + Duration::from_secs(seconds));
            let expected = u64::from(read);
            assert_eq!(
                outcomes.proxy(&p).tunnels_opened,
                expected,
                "{minutes} min {seconds} s later"
            );
            let targets = outcomes.targets();
            assert_eq!(
                targets.len(),
                usize::from(read),
                "{minutes} min {seconds} s"
            );
            assert_eq!(outcomes.proxies().len(), usize::from(read));
        }
    }

    #[test]
    fn the_window_slides_minute_by_minute() {
        let (clock, outcomes) = outcomes();
        let p = proxy("a");
        // One count in each of 90 minutes, i + 1 of them in minute i.
        for minute in 0..90u64 {
            for _ in 0..=minute {
                outcomes.record(
                    "team",
                    &p,
                    None,
                    Outcome::Http {
                        status: 200,
                        banned: false,
                    },
                );
            }
            let first = minute.saturating_sub(59);
            let expected: u64 = (first..=minute).map(|m| m + 1).sum();
            assert_eq!(outcomes.proxy(&p).http2xx, expected, "minute {minute}");
            clock.advance(MINUTE);
        }
        assert!(outcomes.targets().is_empty(), "no target was named");
    }

    #[test]
    fn tenants_and_targets_are_read_minute_by_minute_over_the_hour() {
        let (clock, outcomes) = outcomes();
        let p = proxy("a");
        let ok = Outcome::Http {
            status: 200,
            banned: false,
        };
        let start_minute = clock.now().as_second().div_euclid(60);
        // Minute 0: a success for team-a on a.example; minute 61: a failure; minute 62: two
        // successes for team-b.
        outcomes.record("team-a", &p, Some("a.example"), ok);
        clock.advance(MINUTE * 61);
        outcomes.record("team-a", &p, Some("a.example"), Outcome::UpstreamFailed);
        clock.advance(MINUTE);
        outcomes.record("team-b", &p, Some("b.example"), ok);
        outcomes.record("team-b", &p, None, ok);
        let a = outcomes.tenant_minutes("team-a");
        assert_eq!(a.minutes.len(), 60);
        assert_eq!(
            a.from_ms,
            (start_minute + 62 - 59) * 60_000,
            "the hour up to now"
        );
        let rates: Vec<Option<f64>> = a.minutes.iter().map(OutcomeCounts::success_rate).collect();
        // Minute 0 left the window; minute 61 is the one before last.
        assert_eq!(rates.iter().flatten().count(), 1, "{rates:?}");
        assert_eq!(rates[58], Some(0.0));
        let b = outcomes.tenant_minutes("team-b");
        assert_eq!(b.minutes[59].http2xx, 2);
        assert_eq!(outcomes.target_minutes("b.example").minutes[59].http2xx, 1);
        assert_eq!(
            outcomes.target_minutes("a.example").minutes[58].upstream_failed,
            1
        );
        assert!(
            outcomes
                .tenant_minutes("nobody")
                .minutes
                .iter()
                .all(|m| m.total() == 0)
        );
    }

    #[test]
    fn a_clock_stepping_back_counts_into_the_newest_minute() {
        let (clock, outcomes) = outcomes();
        let p = proxy("a");
        let start = clock.now();
        clock.advance(MINUTE * 5);
        outcomes.record("team", &p, None, Outcome::TunnelOpened);
        clock.set(start);
        outcomes.record("team", &p, None, Outcome::TunnelOpened);
        assert_eq!(outcomes.proxy(&p).tunnels_opened, 2, "read as current");
        clock.advance(MINUTE * 5);
        assert_eq!(outcomes.proxy(&p).tunnels_opened, 2);
        clock.advance(MINUTE * 60);
        assert_eq!(
            outcomes.proxy(&p).tunnels_opened,
            0,
            "both in the newest minute"
        );
    }

    #[test]
    fn targets_beyond_the_bound_count_as_other() {
        let (clock, outcomes) = outcomes();
        let p = proxy("a");
        let ok = Outcome::Http {
            status: 200,
            banned: false,
        };
        for i in 0..MAX_TARGETS {
            // Target i gets i % 3 + 1 outcomes.
            for _ in 0..=(i % 3) {
                outcomes.record("team", &p, Some(&format!("t{i:04}")), ok);
            }
        }
        for extra in ["late-1.example", "late-2.example", OTHER_TARGETS] {
            outcomes.record("team", &p, Some(extra), Outcome::UpstreamFailed);
        }
        // A named target keeps counting: t0000 goes from 1 to 4, the most.
        for _ in 0..3 {
            outcomes.record("team", &p, Some("t0000"), ok);
        }
        let targets = outcomes.targets();
        assert_eq!(targets.len(), MAX_TARGETS + 1);
        assert_eq!(targets[0].0, "t0000");
        assert_eq!(targets[0].1.http2xx, 4);
        assert_eq!(targets[1].0, "t0002", "3 outcomes, ties by name");
        assert!(
            targets[..MAX_TARGETS]
                .windows(2)
                .all(|w| w[0].1.total() >= w[1].1.total()),
            "most outcomes first"
        );
        assert_eq!(
            targets[MAX_TARGETS],
            (OTHER_TARGETS.to_owned(), counts(|c| c.upstream_failed = 3))
        );
        assert_eq!(outcomes.proxy(&p).upstream_failed, 3);

        // Once the named targets leave the window, new ones get named again.
        clock.advance(MINUTE * 60);
        outcomes.record("team", &p, Some("fresh.example"), ok);
        assert_eq!(
            outcomes.targets(),
            vec![("fresh.example".to_owned(), counts(|c| c.http2xx = 1))]
        );
    }

    #[test]
    fn proxies_and_targets_are_dropped_once_their_counts_leave() {
        let (clock, outcomes) = outcomes();
        let (gone, staying) = (proxy("gone"), proxy("staying"));
        outcomes.record("team", &gone, Some("old.example"), Outcome::TunnelOpened);
        clock.advance(MINUTE * 30);
        outcomes.record("team", &staying, Some("new.example"), Outcome::TunnelFailed);
        assert_eq!(
            outcomes.proxies(),
            vec![
                (gone.clone(), counts(|c| c.tunnels_opened = 1)),
                (staying.clone(), counts(|c| c.tunnels_failed = 1)),
            ]
        );
        clock.advance(MINUTE * 30);
        // A record sweeps as a read does.
        outcomes.record("team", &staying, None, Outcome::TunnelFailed);
        {
            let proxies = lock(&outcomes.shared.proxies);
            assert_eq!(proxies.windows.len(), 1);
            assert!(proxies.windows.contains_key(&staying));
        }
        assert_eq!(
            outcomes.proxies(),
            vec![(staying.clone(), counts(|c| c.tunnels_failed = 2))]
        );
        assert_eq!(outcomes.proxy(&gone), OutcomeCounts::default());
        assert_eq!(
            outcomes.targets(),
            vec![("new.example".to_owned(), counts(|c| c.tunnels_failed = 1))]
        );
        assert_eq!(lock(&outcomes.shared.targets).named.windows.len(), 1);
        clock.advance(MINUTE * 59);
        assert_eq!(
            outcomes.proxies().len(),
            1,
            "the last count is 59 minutes old"
        );
        clock.advance(MINUTE);
        assert!(outcomes.proxies().is_empty());
        assert!(outcomes.targets().is_empty());
        assert!(lock(&outcomes.shared.proxies).windows.is_empty());
        assert!(lock(&outcomes.shared.targets).named.windows.is_empty());
    }

    #[test]
    fn a_window_keeps_at_most_an_hour_of_minutes() {
        let mut window = Window::default();
        for minute in 0..500 {
            window.add(minute, Class::Http2xx);
            assert!(window.buckets.len() <= WINDOW_MINUTES as usize);
        }
        assert_eq!(window.counts(499).http2xx, 60);
    }

    #[test]
    fn counts_serialise_in_camel_case() {
        let json = serde_json::to_value(counts(|c| {
            c.http2xx = 1;
            c.tunnels_opened = 2;
            c.reports_rate_limited = 3;
        }))
        .unwrap();
        assert_eq!(json["http2xx"], 1);
        assert_eq!(json["tunnelsOpened"], 2);
        assert_eq!(json["reportsRateLimited"], 3);
        assert_eq!(json["httpOther"], 0);
        assert_eq!(json.as_object().unwrap().len(), CLASSES);
    }
}
