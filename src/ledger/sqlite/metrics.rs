//! What only the SQLite ledger can report to Prometheus: the bytes its file takes on disk.

use prometheus::IntGauge;
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;

use super::SqliteLedger;

/// `proxy_operator_ledger_bytes`, read at scrape time (two `stat` calls, no query); register
/// it with `registry.register(Box::new(..))` beside the fleet collector.
pub struct LedgerFileCollector {
    ledger: SqliteLedger,
    bytes: IntGauge,
}

impl LedgerFileCollector {
    /// A collector of `ledger`'s size on disk.
    pub fn new(ledger: SqliteLedger) -> Result<Self, prometheus::Error> {
        Ok(LedgerFileCollector {
            ledger,
            bytes: IntGauge::new(
                "proxy_operator_ledger_bytes",
                "Bytes the lease ledger takes on disk: its SQLite file plus write-ahead log.",
            )?,
        })
    }
}

impl Collector for LedgerFileCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.bytes.desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.bytes
            .set(i64::try_from(self.ledger.disk_bytes()).unwrap_or(i64::MAX));
        self.bytes.collect()
    }
}
