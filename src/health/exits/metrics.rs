//! Exit-check metrics: a fleet-level counter of checks by result and of exit changes, and at
//! scrape time one info series per proxy with a known exit (its address, country and ASN as
//! labels: one series per proxy, replaced when the exit changes) and the number of proxies
//! flagged for a shared exit.

use prometheus::core::{Collector, Desc};
use prometheus::proto::{Gauge, Metric, MetricFamily, MetricType};
use prometheus::{IntCounter, IntCounterVec, Opts, Registry};

use super::table::ExitTable;
use crate::health::metrics::{label_pair, scraped_family};

/// `proxy_operator_exit_checks_total{result}`, `proxy_operator_exit_changes_total`,
/// `proxy_operator_proxy_exit_info{namespace,name,exit_ip,country,asn}` and
/// `proxy_operator_shared_exit_proxies`.
#[derive(Debug, Clone)]
pub struct ExitMetrics {
    checks: IntCounterVec,
    changes: IntCounter,
}

impl ExitMetrics {
    /// Creates the metrics and registers them with `registry`, the per-proxy ones read from
    /// `table` at scrape time.
    pub fn register(registry: &Registry, table: ExitTable) -> Result<Self, prometheus::Error> {
        let checks = IntCounterVec::new(
            Opts::new(
                "proxy_operator_exit_checks_total",
                "Exit checks through the proxies, whole fleet, by result (ok or error).",
            ),
            &["result"],
        )?;
        let changes = IntCounter::new(
            "proxy_operator_exit_changes_total",
            "Exit address changes recorded (a proxy's first exit included), whole fleet.",
        )?;
        registry.register(Box::new(checks.clone()))?;
        registry.register(Box::new(changes.clone()))?;
        registry.register(Box::new(ExitCollector::new(table)?))?;
        for result in ["ok", "error"] {
            checks.with_label_values(&[result]);
        }
        Ok(ExitMetrics { checks, changes })
    }

    /// Counts one check.
    pub fn checked(&self, ok: bool) {
        self.checks
            .with_label_values(&[if ok { "ok" } else { "error" }])
            .inc();
    }

    /// Counts one recorded change.
    pub fn changed(&self) {
        self.changes.inc();
    }
}

struct ExitCollector {
    table: ExitTable,
    info: Desc,
    shared: Desc,
}

impl ExitCollector {
    fn new(table: ExitTable) -> Result<Self, prometheus::Error> {
        let info = Desc::new(
            "proxy_operator_proxy_exit_info".into(),
            "A proxy's exit address, country and ASN (empty when unknown), from its last \
             successful exit check; always 1."
                .into(),
            ["namespace", "name", "exit_ip", "country", "asn"]
                .map(String::from)
                .to_vec(),
            Default::default(),
        )?;
        let shared = Desc::new(
            "proxy_operator_shared_exit_proxies".into(),
            "Ready proxies exiting from the same address as another Ready proxy.".into(),
            Vec::new(),
            Default::default(),
        )?;
        Ok(ExitCollector {
            table,
            info,
            shared,
        })
    }
}

fn gauge(labels: Vec<prometheus::proto::LabelPair>, value: f64) -> Metric {
    let mut metric = Metric::from_label(labels);
    let mut gauge = Gauge::default();
    gauge.set_value(value);
    metric.set_gauge(gauge);
    metric
}

impl Collector for ExitCollector {
    fn desc(&self) -> Vec<&Desc> {
        vec![&self.info, &self.shared]
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let mut exits: Vec<_> = self.table.all().into_iter().collect();
        exits.sort_by(|(a, _), (b, _)| (&a.name, &a.namespace).cmp(&(&b.name, &b.namespace)));
        let shared = exits
            .iter()
            .filter(|(_, v)| !v.shared_with.is_empty())
            .count();
        // A rotating upstream's samples would make a new series every check: left out.
        let info = exits
            .iter()
            .filter(|(_, view)| !view.sampled)
            .map(|(id, view)| {
                // Sorted by label name, as the registry's own series are.
                gauge(
                    vec![
                        label_pair(
                            "asn",
                            &view.network.asn.map(|a| a.to_string()).unwrap_or_default(),
                        ),
                        label_pair(
                            "country",
                            view.network.country.as_deref().unwrap_or_default(),
                        ),
                        label_pair("exit_ip", &view.ip.to_string()),
                        label_pair("name", &id.name),
                        label_pair("namespace", &id.namespace),
                    ],
                    1.0,
                )
            })
            .collect();
        vec![
            scraped_family(&self.info, MetricType::GAUGE, info),
            scraped_family(
                &self.shared,
                MetricType::GAUGE,
                vec![gauge(Vec::new(), shared as f64)],
            ),
        ]
    }
}
