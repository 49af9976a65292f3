//! What the writer has done since open, and the counters it shares with the handles.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use prometheus::{Histogram, HistogramOpts, HistogramVec};

/// How the writer has been doing since open.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WriterStats {
    /// Transactions the writer ran (one per batch).
    pub batches: u64,
    /// Batches whose transaction failed; every write in them got the error.
    pub failed_batches: u64,
    /// `batch_sizes[n]` is the number of batches that held `n` writes.
    pub batch_sizes: Vec<u64>,
    /// Writes refused because the queue was full.
    pub refused_full: u64,
    /// Writes refused because their queue deadline passed before their turn.
    pub refused_deadline: u64,
    /// Acquires skipped because their caller had gone before their turn.
    pub abandoned: u64,
    /// Failed batches that found the ledger full (SQLITE_FULL); also in `failed_batches`.
    pub full_batches: u64,
    /// Transactions that pruned the oldest rows to keep the file within its size bound.
    pub prune_steps: u64,
    /// History rows those deleted.
    pub pruned_events: u64,
    /// Finished leases those deleted once the history had run out.
    pub pruned_leases: u64,
    /// Prune transactions that failed (rolled back); pruning is tried again.
    pub failed_prune_steps: u64,
    /// The most WAL frames one prune transaction wrote (each step is sized to half the room
    /// left in the WAL allowance from what the one before wrote).
    pub largest_prune_frames: u64,
}

impl WriterStats {
    /// Writes the batches carried.
    pub fn writes(&self) -> u64 {
        (0u64..).zip(&self.batch_sizes).map(|(n, b)| n * b).sum()
    }

    /// Writes per batch, on average (0 before the first batch).
    pub fn mean_batch_size(&self) -> f64 {
        match self.batches {
            0 => 0.0,
            batches => self.writes() as f64 / batches as f64,
        }
    }
}

/// How long the writer's steps take, in seconds: where a slow answer's time went.
#[derive(Debug, Clone)]
pub(crate) struct Timings {
    /// A batch, from its BEGIN until every caller is answered.
    pub batch: Histogram,
    /// The COMMIT statement alone.
    pub commit: Histogram,
    /// A checkpoint (`checkpoint.rs`), `by` the writer (between batches) or in the
    /// background.
    pub checkpoint: HistogramVec,
}

impl Timings {
    fn new() -> prometheus::Result<Timings> {
        // 50 µs to about 1.6 s, doubling.
        let opts = |name: &str, help: &str| -> prometheus::Result<HistogramOpts> {
            let buckets = prometheus::exponential_buckets(0.000_05, 2.0, 16)?;
            Ok(HistogramOpts::new(name, help).buckets(buckets))
        };
        let histogram = |name: &str, help: &str| Histogram::with_opts(opts(name, help)?);
        Ok(Timings {
            batch: histogram(
                "proxy_operator_ledger_batch_seconds",
                "Time of one writer transaction, from its BEGIN until its writes are answered.",
            )?,
            commit: histogram(
                "proxy_operator_ledger_commit_seconds",
                "Time of the COMMIT of one writer transaction.",
            )?,
            checkpoint: HistogramVec::new(
                opts(
                    "proxy_operator_ledger_checkpoint_seconds",
                    "Time of one checkpoint of the write-ahead log into the ledger file, by the \
                     writer between batches (writes wait) or in the background (they do not).",
                )?,
                &["by"],
            )?,
        })
    }
}

/// What the writer and the handles share besides the queue.
#[derive(Debug)]
pub(crate) struct Shared {
    /// Writes in the queue (not yet taken by the writer).
    pub depth: AtomicUsize,
    /// Writes refused because the queue was full (counted by the handles).
    pub refused_full: AtomicU64,
    /// Everything else, updated once per batch.
    pub stats: Mutex<WriterStats>,
    /// How long batches, commits and checkpoints take.
    pub timings: Timings,
}

impl Shared {
    /// Nothing counted yet.
    pub fn new() -> prometheus::Result<Shared> {
        Ok(Shared {
            depth: AtomicUsize::default(),
            refused_full: AtomicU64::default(),
            stats: Mutex::default(),
            timings: Timings::new()?,
        })
    }

    /// The figures as of now.
    pub fn stats(&self) -> WriterStats {
        let mut stats = self
            .stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        stats.refused_full = self.refused_full.load(Ordering::Relaxed);
        stats
    }

    /// Updates the figures counted once per batch.
    pub fn count(&self, update: impl FnOnce(&mut WriterStats)) {
        update(&mut self.stats.lock().unwrap_or_else(PoisonError::into_inner));
    }

    /// Counts a batch of `size` writes.
    pub fn note_batch(&self, size: usize) {
        self.count(|s| {
            s.batches += 1;
            if s.batch_sizes.len() <= size {
                s.batch_sizes.resize(size + 1, 0);
            }
            s.batch_sizes[size] += 1;
        });
    }
}
