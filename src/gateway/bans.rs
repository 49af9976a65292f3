//! What a target's answer says about the proxy it came through: a status in the ban rule
//! (`--gateway-ban-statuses`, default `429=rate_limited,403=blocked`) is reported for that
//! (proxy, target), for as long as the target's `Retry-After` asks.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::ledger::ReportResult;

/// Statuses that are reported, and as what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BanRule(BTreeMap<u16, ReportResult>);

impl Default for BanRule {
    fn default() -> Self {
        BanRule(BTreeMap::from([
            (429, ReportResult::RateLimited),
            (403, ReportResult::Blocked),
        ]))
    }
}

impl BanRule {
    /// Reads `429=rate_limited,403=blocked`: comma-separated `status=result` pairs, results
    /// `rate_limited`, `blocked` or `error`; empty for none.
    pub fn parse(text: &str) -> Result<BanRule, String> {
        let mut rule = BTreeMap::new();
        for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (status, result) = pair
                .split_once('=')
                .ok_or_else(|| format!("{pair:?} is not status=result"))?;
            let status: u16 = status
                .trim()
                .parse()
                .ok()
                .filter(|s| (100..=599).contains(s))
                .ok_or_else(|| format!("{status:?} in {pair:?} is not an HTTP status"))?;
            let result: ReportResult = result
                .trim()
                .parse()
                .map_err(|e| format!("{pair:?}: {e} (rate_limited, blocked or error)"))?;
            if result == ReportResult::Ok {
                return Err(format!("{pair:?}: a ban is not `ok`"));
            }
            if rule.insert(status, result).is_some() {
                return Err(format!("status {status} is given twice"));
            }
        }
        Ok(BanRule(rule))
    }

    /// What a target's `status` is reported as, if it is a ban.
    pub fn of(&self, status: u16) -> Option<ReportResult> {
        self.0.get(&status).copied()
    }
}

/// A `Retry-After` value as a length: delay-seconds, or an HTTP date after `now` (a date in
/// the past, or anything unreadable, asks for nothing).
pub fn retry_after(value: &str, now: jiff::Timestamp) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return (seconds > 0).then(|| Duration::from_secs(seconds));
    }
    let date = httpdate::parse_http_date(value).ok()?;
    let until = jiff::Timestamp::try_from(date).ok()?;
    Duration::try_from(until.duration_since(now))
        .ok()
        .filter(|d| !d.is_zero())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ban_rule_maps_statuses_to_results() {
        let rule = BanRule::default();
        assert_eq!(rule.of(429), Some(ReportResult::RateLimited));
        assert_eq!(rule.of(403), Some(ReportResult::Blocked));
        assert_eq!(rule.of(200), None);
        assert_eq!(
            BanRule::parse("429=rate_limited, 403=blocked"),
            Ok(BanRule::default())
        );
        let custom = BanRule::parse("503=error,451=blocked").unwrap();
        assert_eq!(custom.of(503), Some(ReportResult::Error));
        assert_eq!(custom.of(429), None);
        assert_eq!(BanRule::parse(""), Ok(BanRule(BTreeMap::new())));
        for (bad, problem) in [
            ("429", "not status=result"),
            ("42=blocked", "not an HTTP status"),
            ("429=banned", "unknown report result"),
            ("429=ok", "not `ok`"),
            ("429=blocked,429=rate_limited", "twice"),
        ] {
            let err = BanRule::parse(bad).unwrap_err();
            assert!(err.contains(problem), "{bad}: {err}");
        }
    }

    #[test]
    fn retry_after_is_seconds_or_a_date_ahead() {
        let now: jiff::Timestamp = "2026-12-01T10:00:00Z".parse().unwrap();
        assert_eq!(retry_after("120", now), Some(Duration::from_secs(120)));
        assert_eq!(retry_after(" 7 ", now), Some(Duration::from_secs(7)));
        assert_eq!(retry_after("0", now), None);
        assert_eq!(
            retry_after("Tue, 01 Dec 2026 10:02:00 GMT", now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(retry_after("Tue, 01 Dec 2026 09:00:00 GMT", now), None);
        assert_eq!(retry_after("soon", now), None);
        assert_eq!(retry_after("-5", now), None);
    }
}
