//! The PostgreSQL ledger's own series: whether its database answers, and how often
//! replicas' transactions met, read at scrape time.

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{IntCounter, IntGauge};

use super::PostgresLedger;
use crate::ledger::Ledger;

/// `proxy_operator_ledger_database_up` and `proxy_operator_ledger_conflicts_total`; register
/// it with `registry.register(Box::new(..))` beside the fleet collector.
pub struct PostgresLedgerCollector {
    ledger: PostgresLedger,
    up: IntGauge,
    conflicts: IntCounter,
    descs: Vec<Desc>,
}

impl PostgresLedgerCollector {
    /// A collector of `ledger`'s database state.
    pub fn new(ledger: PostgresLedger) -> Result<Self, prometheus::Error> {
        let up = IntGauge::new(
            "proxy_operator_ledger_database_up",
            "1 while the lease ledger's PostgreSQL database answers, 0 while it does not \
             (lease writes are answered 503 meanwhile).",
        )?;
        let conflicts = IntCounter::new(
            "proxy_operator_ledger_conflicts_total",
            "Ledger transactions decided again because a concurrent one (on this or another \
             replica) changed what they read.",
        )?;
        let descs = up
            .desc()
            .into_iter()
            .chain(conflicts.desc())
            .cloned()
            .collect();
        Ok(PostgresLedgerCollector {
            ledger,
            up,
            conflicts,
            descs,
        })
    }
}

impl Collector for PostgresLedgerCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let up = self.ledger.database().is_some_and(|d| d.up);
        self.up.set(i64::from(up));
        let seen = self.ledger.conflicts();
        self.conflicts
            .inc_by(seen.saturating_sub(self.conflicts.get()));
        self.up
            .collect()
            .into_iter()
            .chain(self.conflicts.collect())
            .collect()
    }
}
