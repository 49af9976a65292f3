//! How the writer keeps the file within its size bound (see `bound` for the policy): it
//! prunes the oldest history after batches while the file is above its marks, runs
//! housekeeping with the pages kept back from client writes, and turns SQLITE_FULL into a
//! refusal the caller can retry, logged once per episode.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::bound::{Check, Usage};
use super::store;
use super::writer::{BatchError, Queued, Writer};

/// The writer's view of the size bound between batches.
#[derive(Debug, Default)]
pub(crate) struct Space {
    /// A pruning episode is under way (from the high-water mark down to the low one).
    pub(super) pruning: bool,
    /// Since when (monotonic) batches have been failing with SQLITE_FULL, and how many did.
    full_since: Option<(Duration, u64)>,
    /// What the current pruning episode (until the file is back within its marks) has
    /// logged, so a file that stays full logs each once rather than per batch.
    logged: Logged,
}

#[derive(Debug, Default)]
struct Logged {
    /// Pruning started.
    started: bool,
    /// Nothing was left to prune.
    exhausted: bool,
    /// Finished leases had to go.
    leases: bool,
}

/// How long a caller refused for a full ledger is told to wait when pruning just freed pages:
/// the retry lands on them.
const FULL_RETRY_AFTER_PRUNED: Duration = Duration::from_secs(1);
/// ... and when nothing could be freed: space has to come from outside (the disk), or from
/// leases ending and being swept.
const FULL_RETRY_AFTER: Duration = Duration::from_secs(10);

/// Whether SQLite said the disk or the database is full.
pub(crate) fn is_full(error: &rusqlite::Error) -> bool {
    error.sqlite_error_code() == Some(rusqlite::ErrorCode::DiskFull)
}

impl Writer {
    /// Runs a housekeeping job as a batch of its own that may use the whole page budget.
    pub(super) fn housekeeping(&mut self, job: Queued) {
        self.note_batch(1);
        self.page_limit(self.bound.housekeeping_pages);
        match self.conn.execute_batch("BEGIN IMMEDIATE") {
            Ok(()) => self.run_batch(vec![job]),
            Err(error) => self.fail(error, Vec::new(), vec![job]),
        }
        self.page_limit(self.bound.client_pages);
    }

    /// Sets the file's page limit; if SQLite refuses, the previous limit stays (logged).
    fn page_limit(&self, pages: u64) {
        if let Err(error) = store::set_page_limit(&self.conn, pages) {
            log::error!("ledger: cannot set max_page_count to {pages}: {error}");
        }
    }

    /// Prunes one step of the oldest history when the size bound calls for it. Returns
    /// whether anything was deleted.
    pub(super) fn keep_in_bound(&mut self, check: Check) -> bool {
        let usage = match store::usage(&self.conn) {
            Ok(usage) => usage,
            Err(error) => {
                log::error!("ledger: cannot read the file's page counts: {error}");
                return false;
            }
        };
        let Some(bytes) = self.bound.bytes_to_free(usage, check) else {
            if std::mem::take(&mut self.space.logged).started {
                log::info!("ledger: pruned down to {} used pages", usage.used());
            }
            self.space.pruning = false;
            return false;
        };
        if !std::mem::replace(&mut self.space.logged.started, true) {
            log::info!(
                "ledger: {} of {} pages used: pruning the oldest history to stay within the \
                 size bound",
                usage.used(),
                self.bound.housekeeping_pages
            );
        }
        self.space.pruning = true;
        self.page_limit(self.bound.housekeeping_pages);
        let pruned = self.prune_step(bytes, usage);
        self.page_limit(self.bound.client_pages);
        match pruned {
            Ok(pruned) if pruned == store::Pruned::default() => {
                if !std::mem::replace(&mut self.space.logged.exhausted, true) {
                    log::warn!(
                        "ledger: {} of {} pages used and nothing left to prune (no history, \
                         no finished lease past its request window): what remains are \
                         active leases, cooldowns and leases a requestID may replay",
                        usage.used(),
                        self.bound.housekeeping_pages
                    );
                }
                self.space.pruning = false;
                false
            }
            Ok(pruned) => {
                self.count(|s| {
                    s.prune_steps += 1;
                    s.pruned_events += pruned.events;
                    s.pruned_leases += pruned.leases;
                });
                if pruned.leases > 0 && !std::mem::replace(&mut self.space.logged.leases, true) {
                    log::warn!(
                        "ledger: no history left to prune; pruning finished leases, oldest \
                         first, to stay within the size bound (late reports on them answer \
                         unknown lease)"
                    );
                }
                true
            }
            Err(error) => {
                // Logged with the episode when the disk is full; otherwise here.
                if !is_full(&error) {
                    log::error!(
                        "ledger: pruning failed (will retry after the next batch): {error}"
                    );
                }
                false
            }
        }
    }

    /// Goes on pruning, step by step, while a pruning episode is under way and no write
    /// waits: idle time brings the file back within its marks, and a write arriving is
    /// served after at most one step.
    pub(super) fn prune_while_idle(&mut self) {
        while self.space.pruning
            && self.shared.depth.load(Ordering::Relaxed) == 0
            && self.keep_in_bound(Check::AfterBatch { pruning: true })
        {}
    }

    /// One prune transaction of at most a step's worth of rows.
    fn prune_step(&mut self, bytes: u64, usage: Usage) -> rusqlite::Result<store::Pruned> {
        let now = self.clock.now().as_millisecond();
        let result = (|| {
            self.conn.execute_batch("BEGIN IMMEDIATE")?;
            let history = store::history_rows(&self.conn)?;
            let rows = self.bound.rows_to_prune(bytes, usage, history);
            let pruned = store::prune_oldest(&self.conn, rows, now)?;
            self.conn.execute_batch("COMMIT")?;
            Ok(pruned)
        })();
        if result.is_err()
            && !self.conn.is_autocommit()
            && let Err(rollback) = self.conn.execute_batch("ROLLBACK")
        {
            log::error!("ledger: rollback of a prune step failed: {rollback}");
        }
        result
    }

    /// What a batch that failed with SQLITE_FULL answers: after one prune step, which may make
    /// room for the retry, `Full` with a `Retry-After` that says whether it did. The episode
    /// is logged when it starts and when it ends, not per batch.
    pub(super) fn full(&mut self, error: &rusqlite::Error) -> BatchError {
        self.count(|s| {
            s.failed_batches += 1;
            s.full_batches += 1;
        });
        let now = self.clock.monotonic();
        let episode = self.space.full_since.get_or_insert((now, 0));
        episode.1 += 1;
        if episode.1 == 1 {
            log::error!(
                "ledger {}: full ({error}): writes are answered 503 ledger_full until pruning or \
                 the sweep frees pages, or the disk has room again",
                self.conn.path().unwrap_or("?")
            );
        }
        let freed = self.keep_in_bound(Check::AfterFull);
        BatchError::Full {
            retry_after: if freed {
                FULL_RETRY_AFTER_PRUNED
            } else {
                FULL_RETRY_AFTER
            },
        }
    }

    /// Ends a full episode (logged) once a batch commits again.
    pub(super) fn writable_again(&mut self) {
        if let Some((since, refused)) = self.space.full_since.take() {
            log::warn!(
                "ledger: writes are recorded again after {refused} batches refused as full over \
                 {:.1?}",
                self.clock.monotonic().saturating_sub(since)
            );
        }
    }
}
