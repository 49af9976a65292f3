//! A Proxy's exit check: the URL that tells the caller's address, fetched through the proxy
//! at its own interval, so the status says which address targets see (see `docs/health.md`).
//!
//! The doc comments on fields become `kubectl explain` text, so they are written for users.

use std::time::Duration;

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// Default time between two exit checks of one proxy.
pub const DEFAULT_EXIT_CHECK_INTERVAL: Duration = Duration::from_secs(600);
/// Default timeout of one exit check.
pub const DEFAULT_EXIT_CHECK_TIMEOUT: Duration = Duration::from_secs(10);
/// Message of the CRD's rule on the URL's scheme.
pub const URL_MESSAGE: &str = "must be an http:// or https:// URL";

/// Which address targets see when a request leaves through the proxy: a URL that answers the
/// caller's address (a plain-text IP such as `https://api.ipify.org`,
/// `https://checkip.amazonaws.com` or `https://ifconfig.me/ip`, or JSON with an `ip` or
/// `origin` field), requested through the proxy at its own interval, spread over that
/// interval across the fleet.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new(super::duration::timeout_rule()).message(super::duration::TIMEOUT_MESSAGE)
)]
#[schemars(transform = super::schema::strip_nullable)]
#[serde(rename_all = "camelCase")]
pub struct ExitCheck {
    /// URL requested through the proxy; it must answer `200` with the caller's address.
    #[serde(rename = "url")]
    #[schemars(length(min = 1, max = 2048))]
    #[x_kube(
        validation = Rule::new("self.startsWith('http://') || self.startsWith('https://')")
            .message(URL_MESSAGE)
    )]
    pub url: String,
    /// Time between two checks of this proxy, above zero, in the syntax of
    /// `healthCheck.interval` (default `10m`).
    #[serde(
        default = "default_interval",
        deserialize_with = "super::duration::deserialize"
    )]
    #[schemars(length(max = 64))]
    #[x_kube(
        validation = Rule::new(super::duration::field_rule()).message(super::duration::FIELD_MESSAGE)
    )]
    pub interval: kube::core::Duration,
    /// Connect, TLS and response timeout of one check, at most `interval` (default `10s`).
    #[serde(
        default = "default_timeout",
        deserialize_with = "super::duration::deserialize"
    )]
    #[schemars(length(max = 64))]
    #[x_kube(
        validation = Rule::new(super::duration::field_rule()).message(super::duration::FIELD_MESSAGE)
    )]
    pub timeout: kube::core::Duration,
}

impl ExitCheck {
    /// The interval as a std duration (negative durations count as zero).
    pub fn interval(&self) -> Duration {
        self.interval.into()
    }

    /// The timeout as a std duration (negative durations count as zero).
    pub fn timeout(&self) -> Duration {
        self.timeout.into()
    }
}

fn default_interval() -> kube::core::Duration {
    DEFAULT_EXIT_CHECK_INTERVAL.into()
}

fn default_timeout() -> kube::core::Duration {
    DEFAULT_EXIT_CHECK_TIMEOUT.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_fill_a_url_only_check() {
        let check: ExitCheck =
            serde_json::from_value(serde_json::json!({"url": "https://api.ipify.org"})).unwrap();
        assert_eq!(check.interval(), Duration::from_secs(600));
        assert_eq!(check.timeout(), Duration::from_secs(10));
        let bad = serde_json::from_value::<ExitCheck>(
            serde_json::json!({"url": "https://api.ipify.org", "interval": "10"}),
        );
        assert!(bad.is_err());
    }
}
