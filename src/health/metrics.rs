//! Probe metrics, observed on every probe (the high-frequency signal that status writes
//! deliberately leave out).
//!
//! The latency histogram and the result counter are fleet-level (no per-proxy labels): a
//! histogram per proxy cost about 22 series, 1.5 KB of `/metrics` per proxy. Per proxy there
//! are only two gauges (`up` and the last latency), removed when the proxy leaves the
//! inventory so they never leak.

use prometheus::{GaugeVec, Histogram, HistogramOpts, IntCounterVec, IntGaugeVec, Opts, Registry};

use super::probe::{ProbeErrorKind, ProbeResult};
use crate::proxy::ProxyId;

/// Upper bounds of the probe latency histogram, in seconds.
const DURATION_BUCKETS: [f64; 11] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Every `result` label value: `ok` and the failure kinds.
fn results() -> impl Iterator<Item = &'static str> {
    std::iter::once("ok").chain(ProbeErrorKind::ALL.iter().map(|k| k.as_str()))
}

/// `proxy_operator_probe_duration_seconds`, `proxy_operator_probes_total{result}`,
/// `proxy_operator_proxy_up{namespace,name}` and
/// `proxy_operator_proxy_probe_latency_seconds{namespace,name}`.
#[derive(Debug, Clone)]
pub struct ProbeMetrics {
    duration: Histogram,
    probes: IntCounterVec,
    up: IntGaugeVec,
    latency: GaugeVec,
}

impl ProbeMetrics {
    /// Creates the metrics and registers them with `registry`.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let duration = Histogram::with_opts(
            HistogramOpts::new(
                "proxy_operator_probe_duration_seconds",
                "Wall time of health probes through the proxies, whole fleet.",
            )
            .buckets(DURATION_BUCKETS.to_vec()),
        )?;
        let probes = IntCounterVec::new(
            Opts::new(
                "proxy_operator_probes_total",
                "Health probes through the proxies, whole fleet, by result (ok or the failure kind).",
            ),
            &["result"],
        )?;
        let up = IntGaugeVec::new(
            Opts::new(
                "proxy_operator_proxy_up",
                "1 when the proxy is healthy (thresholded), 0 when unhealthy or not decided yet.",
            ),
            &["namespace", "name"],
        )?;
        let latency = GaugeVec::new(
            Opts::new(
                "proxy_operator_proxy_probe_latency_seconds",
                "Wall time of the proxy's last health probe.",
            ),
            &["namespace", "name"],
        )?;
        registry.register(Box::new(duration.clone()))?;
        registry.register(Box::new(probes.clone()))?;
        registry.register(Box::new(up.clone()))?;
        registry.register(Box::new(latency.clone()))?;
        // Every result starts at 0, so a rate over any of them is defined from the start.
        for result in results() {
            probes.with_label_values(&[result]);
        }
        Ok(ProbeMetrics {
            duration,
            probes,
            up,
            latency,
        })
    }

    /// Records one probe of `id`, whose thresholded health is now `healthy`.
    pub fn observe(&self, id: &ProxyId, result: &ProbeResult, healthy: Option<bool>) {
        let seconds = result.latency.as_secs_f64();
        self.duration.observe(seconds);
        self.probes.with_label_values(&[result.label()]).inc();
        let labels = [id.namespace.as_str(), id.name.as_str()];
        self.up
            .with_label_values(&labels)
            .set(i64::from(healthy == Some(true)));
        self.latency.with_label_values(&labels).set(seconds);
    }

    /// Drops the per-proxy series of the proxy `namespace/name`.
    pub fn remove(&self, namespace: &str, name: &str) {
        // Removing a series that was never observed is an error we have no use for.
        let _ = self.up.remove_label_values(&[namespace, name]);
        let _ = self.latency.remove_label_values(&[namespace, name]);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use prometheus::Encoder;

    use super::*;
    use crate::health::probe::ProbeError;

    fn id(name: &str) -> ProxyId {
        ProxyId {
            namespace: "crawl".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
        }
    }

    fn scrape(registry: &Registry) -> String {
        let mut out = Vec::new();
        prometheus::TextEncoder::new()
            .encode(&registry.gather(), &mut out)
            .unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn fleet_series_by_result_and_per_proxy_gauges_that_go_with_the_proxy() {
        let registry = Registry::new();
        let metrics = ProbeMetrics::register(&registry).unwrap();
        let text = scrape(&registry);
        for result in results() {
            let zero = format!("proxy_operator_probes_total{{result=\"{result}\"}} 0");
            assert!(text.contains(&zero), "{text}");
        }
        let ok = ProbeResult {
            outcome: Ok(204),
            latency: Duration::from_millis(30),
        };
        let refused = ProbeResult {
            outcome: Err(ProbeError {
                kind: ProbeErrorKind::ConnectTunnelRefused,
                status: None,
                message: "tunnel error: unsuccessful".into(),
            }),
            latency: Duration::from_millis(2),
        };
        metrics.observe(&id("a"), &ok, Some(true));
        metrics.observe(&id("a"), &refused, Some(true));
        metrics.observe(&id("b"), &ok, None);
        let text = scrape(&registry);
        for line in [
            r#"proxy_operator_probes_total{result="connect_tunnel_refused"} 1"#,
            r#"proxy_operator_probes_total{result="ok"} 2"#,
            "proxy_operator_probe_duration_seconds_count 3",
            r#"proxy_operator_probe_duration_seconds_bucket{le="0.005"} 1"#,
            r#"proxy_operator_proxy_up{name="a",namespace="crawl"} 1"#,
            r#"proxy_operator_proxy_up{name="b",namespace="crawl"} 0"#,
            r#"proxy_operator_proxy_probe_latency_seconds{name="a",namespace="crawl"} 0.002"#,
            r#"proxy_operator_proxy_probe_latency_seconds{name="b",namespace="crawl"} 0.03"#,
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in {text}");
        }

        metrics.remove("crawl", "a");
        let text = scrape(&registry);
        assert!(!text.contains(r#"name="a""#), "{text}");
        assert!(text.contains(r#"name="b""#), "{text}");
        // Fleet-level series stay.
        assert!(text.contains("proxy_operator_probe_duration_seconds_count 3"));
    }

    #[test]
    fn registering_twice_in_one_registry_is_an_error() {
        let registry = Registry::new();
        ProbeMetrics::register(&registry).unwrap();
        assert!(ProbeMetrics::register(&registry).is_err());
    }
}
