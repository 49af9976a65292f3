//! Per-proxy probe metrics, observed on every probe (the high-frequency signal that status writes
//! deliberately leave out). Series are removed when a proxy leaves the inventory so they never
//! leak.

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};

use super::probe::{ProbeErrorKind, ProbeResult};
use crate::proxy::ProxyId;

/// Upper bounds of the probe latency histogram, in seconds.
const DURATION_BUCKETS: [f64; 11] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// `proxy_operator_probe_duration_seconds{namespace,name}` and
/// `proxy_operator_probes_total{namespace,name,result}`.
#[derive(Debug, Clone)]
pub struct ProbeMetrics {
    duration: HistogramVec,
    probes: IntCounterVec,
}

impl ProbeMetrics {
    /// Creates the metrics and registers them with `registry`.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "proxy_operator_probe_duration_seconds",
                "Wall time of health probes through each proxy.",
            )
            .buckets(DURATION_BUCKETS.to_vec()),
            &["namespace", "name"],
        )?;
        let probes = IntCounterVec::new(
            Opts::new(
                "proxy_operator_probes_total",
                "Health probes through each proxy, by result (ok or the failure kind).",
            ),
            &["namespace", "name", "result"],
        )?;
        registry.register(Box::new(duration.clone()))?;
        registry.register(Box::new(probes.clone()))?;
        Ok(ProbeMetrics { duration, probes })
    }

    /// Records one probe of `id`.
    pub fn observe(&self, id: &ProxyId, result: &ProbeResult) {
        self.duration
            .with_label_values(&[id.namespace.as_str(), id.name.as_str()])
            .observe(result.latency.as_secs_f64());
        self.probes
            .with_label_values(&[id.namespace.as_str(), id.name.as_str(), result.label()])
            .inc();
    }

    /// Drops every series of the proxy `namespace/name`.
    pub fn remove(&self, namespace: &str, name: &str) {
        // Removing a series that was never observed is an error we have no use for.
        let _ = self.duration.remove_label_values(&[namespace, name]);
        let results = ProbeErrorKind::ALL.iter().map(|k| k.as_str());
        for result in std::iter::once("ok").chain(results) {
            let _ = self.probes.remove_label_values(&[namespace, name, result]);
        }
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
    fn observes_results_by_kind_and_removes_series() {
        let registry = Registry::new();
        let metrics = ProbeMetrics::register(&registry).unwrap();
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
        metrics.observe(&id("a"), &ok);
        metrics.observe(&id("a"), &refused);
        metrics.observe(&id("b"), &ok);
        let text = scrape(&registry);
        assert!(text.contains(
            r#"proxy_operator_probes_total{name="a",namespace="crawl",result="connect_tunnel_refused"} 1"#
        ), "{text}");
        assert!(
            text.contains(
                r#"proxy_operator_probe_duration_seconds_count{name="a",namespace="crawl"} 2"#
            ),
            "{text}"
        );

        metrics.remove("crawl", "a");
        let text = scrape(&registry);
        assert!(!text.contains(r#"name="a""#), "{text}");
        assert!(text.contains(r#"name="b""#), "{text}");
    }

    #[test]
    fn registering_twice_in_one_registry_is_an_error() {
        let registry = Registry::new();
        ProbeMetrics::register(&registry).unwrap();
        assert!(ProbeMetrics::register(&registry).is_err());
    }
}
