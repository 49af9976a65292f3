//! Probe metrics, observed on every probe (the high-frequency signal that status writes
//! deliberately leave out).
//!
//! The latency histogram and the result counter are fleet-level (no per-proxy labels): a
//! histogram per proxy cost about 22 series, 1.5 KB of `/metrics` per proxy. Per proxy there
//! are only two gauges (`up` and the last latency), removed when the proxy leaves the
//! inventory so they never leak.
//!
//! The per-proxy gauges are not prometheus `GaugeVec`s: each series of one keeps its own copy
//! of the metric's descriptor and label pairs (about 490 bytes, 10 MB at 10,000 proxies), and
//! a scrape walks a hash map. Here they are two numbers per proxy in a table sorted the way
//! the registry sorts series, turned into samples when scraped ([`PerProxyGauge`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use prometheus::core::{Collector, Desc};
use prometheus::proto::{Gauge, LabelPair, Metric, MetricFamily, MetricType};
use prometheus::{Histogram, HistogramOpts, IntCounterVec, Opts, Registry};

use super::probe::{ProbeErrorKind, ProbeResult};
use crate::resources::proxy::ProxyId;

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
    proxies: Arc<ProxyGauges>,
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
        let proxies = Arc::new(ProxyGauges::new()?);
        registry.register(Box::new(duration.clone()))?;
        registry.register(Box::new(probes.clone()))?;
        registry.register(Box::new(ProxyGaugesCollector(proxies.clone())))?;
        // Every result starts at 0, so a rate over any of them is defined from the start.
        for result in results() {
            probes.with_label_values(&[result]);
        }
        Ok(ProbeMetrics {
            duration,
            probes,
            proxies,
        })
    }

    /// Records one probe of `id`, whose thresholded health is now `healthy`.
    pub fn observe(&self, id: &ProxyId, result: &ProbeResult, healthy: Option<bool>) {
        let seconds = result.latency.as_secs_f64();
        self.duration.observe(seconds);
        self.probes.with_label_values(&[result.label()]).inc();
        self.proxies.set(id, healthy == Some(true), seconds);
    }

    /// Drops the per-proxy series of the proxy `namespace/name`.
    pub fn remove(&self, namespace: &str, name: &str) {
        self.proxies.remove(namespace, name);
    }
}

/// The last values of one proxy's gauges. Atomics, so a probe result is recorded under the
/// table's read lock, concurrently with a scrape.
#[derive(Debug)]
struct Gauges {
    up: AtomicBool,
    /// `f64` bits of the last probe's latency in seconds.
    latency: AtomicU64,
}

/// `proxy_operator_proxy_up` and `proxy_operator_proxy_probe_latency_seconds`: one entry per
/// proxy name (a re-created Proxy, same name with a new UID, shares the name's series).
#[derive(Debug)]
struct ProxyGauges {
    up: PerProxyGauge,
    latency: PerProxyGauge,
    /// namespace → name → gauges.
    table: RwLock<BTreeMap<String, BTreeMap<String, Gauges>>>,
}

impl ProxyGauges {
    fn new() -> Result<Self, prometheus::Error> {
        Ok(ProxyGauges {
            up: PerProxyGauge::new(
                "proxy_operator_proxy_up",
                "1 when the proxy is healthy (thresholded), 0 when unhealthy or not decided yet.",
            )?,
            latency: PerProxyGauge::new(
                "proxy_operator_proxy_probe_latency_seconds",
                "Wall time of the proxy's last health probe.",
            )?,
            table: RwLock::new(BTreeMap::new()),
        })
    }

    fn set(&self, id: &ProxyId, up: bool, latency: f64) {
        let store = |gauges: &Gauges| {
            gauges.up.store(up, Ordering::Relaxed);
            gauges.latency.store(latency.to_bits(), Ordering::Relaxed);
        };
        {
            let table = self.table.read().unwrap_or_else(PoisonError::into_inner);
            if let Some(gauges) = table.get(&id.namespace).and_then(|n| n.get(&id.name)) {
                store(gauges);
                return;
            }
        }
        let mut table = self.table.write().unwrap_or_else(PoisonError::into_inner);
        let gauges = table
            .entry(id.namespace.clone())
            .or_default()
            .entry(id.name.clone())
            .or_insert_with(|| Gauges {
                up: AtomicBool::new(false),
                latency: AtomicU64::new(0),
            });
        store(gauges);
    }

    fn remove(&self, namespace: &str, name: &str) {
        let mut table = self.table.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(names) = table.get_mut(namespace) {
            names.remove(name);
            if names.is_empty() {
                table.remove(namespace);
            }
        }
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let table = self.table.read().unwrap_or_else(PoisonError::into_inner);
        let proxies = || {
            table.iter().flat_map(|(namespace, names)| {
                names.iter().map(move |(name, g)| (namespace, name, g))
            })
        };
        let up = self.up.family(proxies().map(|(namespace, name, g)| {
            let up = f64::from(u8::from(g.up.load(Ordering::Relaxed)));
            (namespace.as_str(), name.as_str(), up)
        }));
        let latency = self.latency.family(proxies().map(|(namespace, name, g)| {
            let seconds = f64::from_bits(g.latency.load(Ordering::Relaxed));
            (namespace.as_str(), name.as_str(), seconds)
        }));
        vec![up, latency]
    }
}

/// Registers the shared table, which [`ProbeMetrics`] keeps writing to.
struct ProxyGaugesCollector(Arc<ProxyGauges>);

impl Collector for ProxyGaugesCollector {
    fn desc(&self) -> Vec<&Desc> {
        vec![self.0.up.desc(), self.0.latency.desc()]
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.0.collect()
    }
}

/// A gauge with one series per proxy, labelled `namespace` and `name`, whose samples are made
/// at scrape time from state kept elsewhere. Unlike a prometheus `GaugeVec` it keeps nothing
/// per proxy between scrapes: no series to reset, refill or forget to remove.
#[derive(Debug)]
pub struct PerProxyGauge {
    desc: Desc,
}

impl PerProxyGauge {
    /// A gauge named `name`; register it through a collector that returns [`desc`](Self::desc)
    /// and [`family`](Self::family).
    pub fn new(name: &str, help: &str) -> Result<Self, prometheus::Error> {
        let desc = Desc::new(
            name.into(),
            help.into(),
            vec!["namespace".into(), "name".into()],
            HashMap::new(),
        )?;
        Ok(PerProxyGauge { desc })
    }

    /// The gauge's descriptor.
    pub fn desc(&self) -> &Desc {
        &self.desc
    }

    /// One scrape's samples, each `(namespace, name, value)`; a name must come once. The
    /// registry sorts them by name, then namespace: cheaply when they come in that order.
    pub fn family<'a>(
        &self,
        samples: impl IntoIterator<Item = (&'a str, &'a str, f64)>,
    ) -> MetricFamily {
        let metrics = samples
            .into_iter()
            .map(|(namespace, name, value)| {
                // Sorted by label name, as the registry's own series are.
                let mut metric = Metric::from_label(vec![
                    label_pair("name", name),
                    label_pair("namespace", namespace),
                ]);
                let mut gauge = Gauge::default();
                gauge.set_value(value);
                metric.set_gauge(gauge);
                metric
            })
            .collect();
        scraped_family(&self.desc, MetricType::GAUGE, metrics)
    }
}

/// One label of a series made at scrape time.
pub fn label_pair(name: &str, value: &str) -> LabelPair {
    let mut pair = LabelPair::default();
    pair.set_name(name.to_owned());
    pair.set_value(value.to_owned());
    pair
}

/// The family of `desc`, of type `kind`, with the series `metrics` made at scrape time.
pub fn scraped_family(desc: &Desc, kind: MetricType, metrics: Vec<Metric>) -> MetricFamily {
    let mut family = MetricFamily::default();
    family.set_name(desc.fq_name.clone());
    family.set_help(desc.help.clone());
    family.set_field_type(kind);
    family.set_metric(metrics);
    family
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
