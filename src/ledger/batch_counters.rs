//! The two series every ledger exports about how it batches writes:
//! `proxy_operator_ledger_batches_total` and `proxy_operator_ledger_batched_writes_total`.
//! Their ratio is the writes one batch carries, what amortises its transaction: the figure
//! that says whether a slow ledger is doing many small transactions.

use prometheus::IntCounter;
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;

/// The two counters, set at scrape time from figures the backend keeps itself.
pub(crate) struct BatchCounters {
    batches: IntCounter,
    writes: IntCounter,
}

impl BatchCounters {
    /// The counters, with help texts saying what a batch and a write are in this backend.
    pub fn new(batches_help: &str, writes_help: &str) -> Result<Self, prometheus::Error> {
        Ok(BatchCounters {
            batches: IntCounter::new("proxy_operator_ledger_batches_total", batches_help)?,
            writes: IntCounter::new("proxy_operator_ledger_batched_writes_total", writes_help)?,
        })
    }

    pub fn descs(&self) -> impl Iterator<Item = &Desc> {
        self.batches.desc().into_iter().chain(self.writes.desc())
    }

    /// The series, at `batches` batches that carried `writes` writes so far.
    pub fn collect(&self, batches: u64, writes: u64) -> Vec<MetricFamily> {
        for (counter, value) in [(&self.batches, batches), (&self.writes, writes)] {
            counter.reset();
            counter.inc_by(value);
        }
        [self.batches.collect(), self.writes.collect()].concat()
    }
}
