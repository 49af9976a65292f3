//! The PostgreSQL ledger's own series: whether its database answers, how often replicas'
//! transactions met, and how this replica batches acquires and releases, read at scrape time.

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{IntCounter, IntGauge};

use super::PostgresLedger;
use crate::ledger::Ledger;
use crate::ledger::batch_counters::BatchCounters;

/// `proxy_operator_ledger_database_up`, `proxy_operator_ledger_conflicts_total`,
/// `proxy_operator_ledger_batches_total` and `proxy_operator_ledger_batched_writes_total`;
/// register it with `registry.register(Box::new(..))` beside the fleet collector.
pub struct PostgresLedgerCollector {
    ledger: PostgresLedger,
    up: IntGauge,
    conflicts: IntCounter,
    batched: BatchCounters,
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
        let batched = BatchCounters::new(
            "Batches this replica decided: the acquires and releases that arrived while the \
             one before ran, decided together.",
            "Acquires and releases those batches carried.",
        )?;
        let descs = up
            .desc()
            .into_iter()
            .chain(conflicts.desc())
            .chain(batched.descs())
            .cloned()
            .collect();
        Ok(PostgresLedgerCollector {
            ledger,
            up,
            conflicts,
            batched,
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
        let (batches, writes) = self.ledger.batched();
        [
            self.up.collect(),
            self.conflicts.collect(),
            self.batched.collect(batches, writes),
        ]
        .concat()
    }
}
