//! What only the SQLite ledger can report to Prometheus: the bytes its file takes on disk beside
//! the bound it must stay within, how its writer batches writes into transactions (writes
//! per batch = the ratio of the two counters, what amortises each COMMIT), and how long its
//! batches, commits and checkpoints take (where a slow answer waited).

use prometheus::IntGauge;
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;

use super::SqliteLedger;
use crate::ledger::batch_counters::BatchCounters;

/// `proxy_operator_ledger_bytes` (two `stat` calls, no query), `proxy_operator_ledger_max_bytes`,
/// `proxy_operator_ledger_batches_total` and `proxy_operator_ledger_batched_writes_total`, read
/// at scrape time, and the writer's `proxy_operator_ledger_{batch,commit,checkpoint}_seconds`
/// histograms; register it with `registry.register(Box::new(..))` beside the fleet collector.
pub struct SqliteLedgerCollector {
    ledger: SqliteLedger,
    bytes: IntGauge,
    /// `--ledger-max-size`, so an alert can compare the size with it on any install.
    max_bytes: IntGauge,
    batched: BatchCounters,
    descs: Vec<Desc>,
}

impl SqliteLedgerCollector {
    /// A collector of `ledger`'s size on disk and writer batches.
    pub fn new(ledger: SqliteLedger) -> Result<Self, prometheus::Error> {
        let bytes = IntGauge::new(
            "proxy_operator_ledger_bytes",
            "Bytes the lease ledger takes on disk: its SQLite file plus write-ahead log.",
        )?;
        let max_bytes = IntGauge::new(
            "proxy_operator_ledger_max_bytes",
            "The size bound of the lease ledger's file plus write-ahead log (--ledger-max-size).",
        )?;
        max_bytes.set(i64::try_from(ledger.inner.options.max_size).unwrap_or(i64::MAX));
        let batched = BatchCounters::new(
            "Transactions the ledger's writer ran, each carrying a batch of writes.",
            "Writes (acquire, renew, release, report) the writer's transactions carried.",
        )?;
        let timings = &ledger.inner.shared.timings;
        let descs = [
            bytes.desc(),
            max_bytes.desc(),
            timings.batch.desc(),
            timings.commit.desc(),
            timings.checkpoint.desc(),
        ]
        .into_iter()
        .flatten()
        .chain(batched.descs())
        .cloned()
        .collect();
        Ok(SqliteLedgerCollector {
            ledger,
            bytes,
            max_bytes,
            batched,
            descs,
        })
    }
}

impl Collector for SqliteLedgerCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.bytes
            .set(i64::try_from(self.ledger.disk_bytes()).unwrap_or(i64::MAX));
        let stats = self.ledger.writer_stats();
        let timings = &self.ledger.inner.shared.timings;
        [
            self.bytes.collect(),
            self.max_bytes.collect(),
            self.batched.collect(stats.batches, stats.writes()),
            timings.batch.collect(),
            timings.commit.collect(),
            timings.checkpoint.collect(),
        ]
        .concat()
    }
}
