//! Pool metrics, exported by the leader: per pool (labels `namespace`, `pool`: pools come from
//! the cluster's objects, a handful per install) the desired, current and Ready members,
//! utilisation, `maxReplicas` and scale events by direction. The requests the gateway holds
//! while a pool wakes are the gateway's (`proxy_operator_gateway_held_seconds`).

use prometheus::{GaugeVec, IntCounterVec, IntGaugeVec, Opts, Registry};

/// The pool controller's gauges and counters.
#[derive(Debug, Clone)]
pub struct PoolMetrics {
    desired: IntGaugeVec,
    current: IntGaugeVec,
    ready: IntGaugeVec,
    max: IntGaugeVec,
    utilization: GaugeVec,
    scale_events: IntCounterVec,
}

/// What one pool shows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolFigures {
    /// `spec.replicas` as decided.
    pub desired: u32,
    /// Members that exist and are not being deleted.
    pub current: u32,
    /// Ready members.
    pub ready: u32,
    /// `maxReplicas`, when autoscaled.
    pub max: Option<u32>,
    /// Utilisation, when there is capacity.
    pub utilization: Option<f64>,
}

impl PoolMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let labels = ["namespace", "pool"];
        let gauge = |name: &str, help: &str| IntGaugeVec::new(Opts::new(name, help), &labels);
        let metrics = PoolMetrics {
            desired: gauge(
                "proxy_operator_pool_desired_replicas",
                "Members the pool asks for (spec.replicas, as the autoscaler set it).",
            )?,
            current: gauge(
                "proxy_operator_pool_replicas",
                "Members that exist and are not being deleted.",
            )?,
            ready: gauge(
                "proxy_operator_pool_ready_replicas",
                "Members in phase Ready.",
            )?,
            max: gauge(
                "proxy_operator_pool_max_replicas",
                "maxReplicas of an autoscaled pool (absent without autoscaling).",
            )?,
            utilization: GaugeVec::new(
                Opts::new(
                    "proxy_operator_pool_utilization",
                    "Active leases / lease capacity of the Ready members (absent without capacity).",
                ),
                &labels,
            )?,
            scale_events: IntCounterVec::new(
                Opts::new(
                    "proxy_operator_pool_scale_events_total",
                    "Changes of spec.replicas by the autoscaler, by direction (up, down).",
                ),
                &["namespace", "pool", "direction"],
            )?,
        };
        registry.register(Box::new(metrics.desired.clone()))?;
        registry.register(Box::new(metrics.current.clone()))?;
        registry.register(Box::new(metrics.ready.clone()))?;
        registry.register(Box::new(metrics.max.clone()))?;
        registry.register(Box::new(metrics.utilization.clone()))?;
        registry.register(Box::new(metrics.scale_events.clone()))?;
        Ok(metrics)
    }

    /// Shows `figures` for the pool `namespace/pool`.
    pub fn set(&self, namespace: &str, pool: &str, figures: PoolFigures) {
        let labels = [namespace, pool];
        self.desired
            .with_label_values(&labels)
            .set(i64::from(figures.desired));
        self.current
            .with_label_values(&labels)
            .set(i64::from(figures.current));
        self.ready
            .with_label_values(&labels)
            .set(i64::from(figures.ready));
        match figures.max {
            Some(max) => self.max.with_label_values(&labels).set(i64::from(max)),
            None => drop(self.max.remove_label_values(&labels)),
        }
        match figures.utilization {
            Some(u) => self.utilization.with_label_values(&labels).set(u),
            None => drop(self.utilization.remove_label_values(&labels)),
        }
    }

    /// Counts a change of `spec.replicas`.
    pub fn scaled(&self, namespace: &str, pool: &str, up: bool) {
        let direction = if up { "up" } else { "down" };
        self.scale_events
            .with_label_values(&[namespace, pool, direction])
            .inc();
    }

    /// Removes every series of a pool that is gone.
    pub fn forget(&self, namespace: &str, pool: &str) {
        let labels = [namespace, pool];
        for gauge in [&self.desired, &self.current, &self.ready, &self.max] {
            drop(gauge.remove_label_values(&labels));
        }
        drop(self.utilization.remove_label_values(&labels));
        for direction in ["up", "down"] {
            drop(
                self.scale_events
                    .remove_label_values(&[namespace, pool, direction]),
            );
        }
    }
}
