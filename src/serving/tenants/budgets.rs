//! Where each tenant stands against its daily byte budget, as gauges: its bytes through the
//! gateway on the current UTC day, read from the ledger's hourly traffic rows (every
//! replica's, so each replica exports the same number) every [`REFRESH`], and its
//! `bytesPerDay` quota from the tenants file in force.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{IntGaugeVec, Opts};
use tokio_util::sync::CancellationToken;

use crate::ledger::{Clock, Ledger, TrafficHour, day_start};
use crate::serving::tokens::ApiToken;

/// How often the day's bytes are read again from the ledger: well within a scrape interval.
pub const REFRESH: Duration = Duration::from_secs(5);

/// The day's bytes per tenant, as last read.
#[derive(Debug, Default)]
struct DayRead {
    /// Start of the UTC day read.
    day_ms: i64,
    bytes: HashMap<String, u64>,
}

/// The gauges, filled at scrape time. Register with `registry.register(Box::new(..))`.
pub struct BudgetCollector {
    read: Arc<RwLock<DayRead>>,
    token: ApiToken,
    clock: Arc<dyn Clock>,
    bytes_today: IntGaugeVec,
    quota: IntGaugeVec,
}

impl BudgetCollector {
    /// Gauges over the tenants `token` knows, with the day's bytes [`refresh_every`] reads.
    pub fn new(token: ApiToken, clock: Arc<dyn Clock>) -> Result<Self, prometheus::Error> {
        Ok(BudgetCollector {
            read: Arc::default(),
            token,
            clock,
            bytes_today: IntGaugeVec::new(
                Opts::new(
                    "proxy_operator_tenant_bytes_today",
                    "Bytes through the gateway (up and down) per tenant on the current UTC day, \
                     every replica's, as the ledger's hourly traffic rows hold them (read every \
                     5 s).",
                ),
                &["tenant"],
            )?,
            quota: IntGaugeVec::new(
                Opts::new(
                    "proxy_operator_tenant_bytes_per_day_quota",
                    "A tenant's bytesPerDay quota (--tenants-file); only tenants with one.",
                ),
                &["tenant"],
            )?,
        })
    }

    /// Reads the day's bytes from `ledger` every [`REFRESH`] until `shutdown`.
    pub async fn refresh_every(&self, ledger: Arc<dyn Ledger>, shutdown: CancellationToken) {
        let mut ticker = tokio::time::interval(REFRESH);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = ticker.tick() => {}
            }
            let day_ms = day_start(self.clock.now().as_millisecond());
            match ledger.traffic(day_ms).await {
                Ok(rows) => {
                    *self.read.write().unwrap_or_else(PoisonError::into_inner) = DayRead {
                        day_ms,
                        bytes: per_tenant(&rows),
                    };
                }
                Err(error) => log::warn!("tenants' bytes today: reading the ledger: {error}"),
            }
        }
    }

    /// A handle that refreshes the same gauges.
    pub fn handle(&self) -> Self {
        BudgetCollector {
            read: self.read.clone(),
            token: self.token.clone(),
            clock: self.clock.clone(),
            bytes_today: self.bytes_today.clone(),
            quota: self.quota.clone(),
        }
    }
}

/// Bytes up and down per tenant in `rows`.
fn per_tenant(rows: &[TrafficHour]) -> HashMap<String, u64> {
    let mut bytes: HashMap<String, u64> = HashMap::new();
    for row in rows {
        let sum = bytes.entry(row.bytes.tenant.clone()).or_default();
        *sum = sum.saturating_add(row.bytes.total());
    }
    bytes
}

impl Collector for BudgetCollector {
    fn desc(&self) -> Vec<&Desc> {
        let mut descs = self.bytes_today.desc();
        descs.extend(self.quota.desc());
        descs
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let today = day_start(self.clock.now().as_millisecond());
        let read = self.read.read().unwrap_or_else(PoisonError::into_inner);
        let empty = HashMap::new();
        // A read of an earlier day says nothing of today: the day's turn starts from 0.
        let bytes = if read.day_ms == today {
            &read.bytes
        } else {
            &empty
        };
        self.bytes_today.reset();
        self.quota.reset();
        let gauge = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        for (tenant, n) in bytes {
            self.bytes_today.with_label_values(&[tenant]).set(gauge(*n));
        }
        for tenant in self.token.tenants() {
            if let Some(limit) = tenant.quotas.bytes_per_day {
                self.quota
                    .with_label_values(&[&tenant.name])
                    .set(gauge(limit));
                let n = bytes.get(&*tenant.name).copied().unwrap_or(0);
                self.bytes_today
                    .with_label_values(&[&tenant.name])
                    .set(gauge(n));
            }
        }
        let mut families = self.bytes_today.collect();
        families.extend(self.quota.collect());
        families
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::TrafficBytes;

    #[test]
    fn a_tenants_bytes_are_its_rows_up_and_down() {
        let row = |tenant: &str, up, down| TrafficHour {
            hour_ms: 0,
            bytes: TrafficBytes {
                tenant: tenant.into(),
                namespace: "crawl".into(),
                name: "p".into(),
                pool: None,
                target: "t".into(),
                up,
                down,
            },
        };
        let bytes = per_tenant(&[row("a", 1, 2), row("b", 5, 0), row("a", 10, 20)]);
        assert_eq!(bytes.get("a"), Some(&33));
        assert_eq!(bytes.get("b"), Some(&5));
    }
}
