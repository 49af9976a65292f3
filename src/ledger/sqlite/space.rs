//! How the writer keeps the file within its size bound (see `bound` for the policy): it
//! prunes the oldest history after batches while the file is above its marks, runs
//! housekeeping with the pages kept back from client writes, and turns SQLITE_FULL into a
//! refusal the caller can retry, logged once per episode.

use std::sync::atomic::Ordering;
use std::time::Duration;

use rusqlite::Connection;

use super::bound::{Check, SizeBound, StepCost, Usage};
use super::checkpoint;
use super::stats::Shared;
use super::store;
use crate::ledger::clock::Clock;

/// The writer's view of the size bound between batches.
#[derive(Debug)]
pub(super) struct Space {
    /// The page limits and marks of the size bound.
    bound: SizeBound,
    /// A pruning episode is under way (from the high-water mark down to the low one).
    pruning: bool,
    /// The last step found the file above its high-water mark: pruning is behind the writes,
    /// so another step follows before the next batch.
    behind: bool,
    /// What the last prune step cost, to size the next within its WAL frames.
    last_step: Option<StepCost>,
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
    /// A prune step failed.
    failed: bool,
}

/// What the size bound's checks need besides the bound: the writer's connection, the counters
/// it shares with the handles (the queue depth, the prune figures) and its clock.
pub(super) struct WriterParts<'a> {
    pub conn: &'a Connection,
    pub shared: &'a Shared,
    pub clock: &'a dyn Clock,
}

/// How often an idle writer tries a failed prune step again.
const PRUNE_RETRY: Duration = Duration::from_secs(1);

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

impl Space {
    pub fn new(bound: SizeBound) -> Self {
        Space {
            bound,
            pruning: false,
            behind: false,
            last_step: None,
            full_since: None,
            logged: Logged::default(),
        }
    }

    /// Lets the writes that follow use the whole page budget, the pages kept back from client
    /// writes included (housekeeping, which frees space).
    pub fn housekeeping_pages(&self, conn: &Connection) {
        page_limit(conn, self.bound.housekeeping_pages);
    }

    /// Limits the writes that follow to the client writes' pages again.
    pub fn client_pages(&self, conn: &Connection) {
        page_limit(conn, self.bound.client_pages);
    }

    /// After a batch, or while the writer is idle: prunes one step of the oldest history when
    /// the size bound calls for it. Returns whether the writer should go on with another step
    /// before it waits for work: this one deleted rows, and no write waits or the file was
    /// above its high-water mark (steps are small at small bounds, and must outpace the
    /// batches). Idle time so brings the file back within its marks, and a write arriving is
    /// served after one step unless pruning is behind.
    pub fn after_batch(&mut self, writer: &WriterParts<'_>) -> bool {
        self.keep_in_bound(
            writer,
            Check::AfterBatch {
                pruning: self.pruning,
            },
        ) && (self.behind || writer.shared.depth.load(Ordering::Relaxed) == 0)
    }

    /// How long the writer may wait for work before it tries pruning again: only while a
    /// pruning episode is unfinished, so a step that failed (the file locked by another
    /// process, a full disk) is retried even when no batch comes to retry it after.
    pub fn retry_after(&self) -> Option<Duration> {
        self.pruning.then_some(PRUNE_RETRY)
    }

    /// Prunes one step of the oldest history when the size bound calls for it. Returns
    /// whether anything was deleted.
    fn keep_in_bound(&mut self, writer: &WriterParts<'_>, check: Check) -> bool {
        let usage = match store::usage(writer.conn) {
            Ok(usage) => usage,
            Err(error) => {
                log::error!("ledger: cannot read the file's page counts: {error}");
                return false;
            }
        };
        let Some(bytes) = self.bound.bytes_to_free(usage, check) else {
            if std::mem::take(&mut self.logged).started {
                log::info!("ledger: pruned down to {} used pages", usage.used());
            }
            self.pruning = false;
            return false;
        };
        if !std::mem::replace(&mut self.logged.started, true) {
            log::info!(
                "ledger: {} of {} pages used: pruning the oldest history to stay within the \
                 size bound",
                usage.used(),
                self.bound.housekeeping_pages
            );
        }
        self.pruning = true;
        self.behind = usage.used() >= self.bound.high_water;
        self.housekeeping_pages(writer.conn);
        let pruned = self.prune_step(writer, bytes, usage);
        self.client_pages(writer.conn);
        match pruned {
            Ok(pruned) if pruned == store::Pruned::default() => {
                if !std::mem::replace(&mut self.logged.exhausted, true) {
                    log::warn!(
                        "ledger: {} of {} pages used and nothing left to prune (no history, \
                         no finished lease past its request window): what remains are \
                         active leases, cooldowns and leases a requestID may replay",
                        usage.used(),
                        self.bound.housekeeping_pages
                    );
                }
                self.pruning = false;
                false
            }
            Ok(pruned) => {
                writer.shared.count(|s| {
                    s.prune_steps += 1;
                    s.pruned_events += pruned.events;
                    s.pruned_leases += pruned.leases;
                });
                if pruned.leases > 0 && !std::mem::replace(&mut self.logged.leases, true) {
                    log::warn!(
                        "ledger: no history left to prune; pruning finished leases, oldest \
                         first, to stay within the size bound (late reports on them answer \
                         unknown lease)"
                    );
                }
                true
            }
            Err(error) => {
                writer.shared.count(|s| s.failed_prune_steps += 1);
                if !std::mem::replace(&mut self.logged.failed, true) {
                    log::error!(
                        "ledger: a prune step failed (tried again every {PRUNE_RETRY:?} while \
                         the file stays above its bound): {error}"
                    );
                }
                false
            }
        }
    }

    /// One prune transaction of at most a step's worth of rows; notes the WAL frames it wrote
    /// to size the next.
    fn prune_step(
        &mut self,
        writer: &WriterParts<'_>,
        bytes: u64,
        usage: Usage,
    ) -> rusqlite::Result<store::Pruned> {
        let conn = writer.conn;
        let now = writer.clock.now().as_millisecond();
        let frames_before = checkpoint::wal_frames();
        let last = self.last_step;
        let result = (|| {
            conn.execute_batch("BEGIN IMMEDIATE")?;
            let history = store::history_rows(conn)?;
            let rows = self
                .bound
                .rows_to_prune(bytes, usage, history, last, frames_before);
            let pruned = store::prune_oldest(conn, rows, now)?;
            conn.execute_batch("COMMIT")?;
            Ok(pruned)
        })();
        if let Ok(pruned) = &result {
            let frames = checkpoint::wal_frames().saturating_sub(frames_before);
            let rows = pruned.events + pruned.traffic + pruned.leases;
            self.last_step = Some(StepCost { rows, frames });
            writer
                .shared
                .count(|s| s.largest_prune_frames = s.largest_prune_frames.max(frames));
        }
        if result.is_err()
            && !conn.is_autocommit()
            && let Err(rollback) = conn.execute_batch("ROLLBACK")
        {
            log::error!("ledger: rollback of a prune step failed: {rollback}");
        }
        result
    }

    /// How long the writes of a batch that failed with SQLITE_FULL are told to wait: after one
    /// prune step, which may make room for the retry, a `Retry-After` that says whether it
    /// did. The episode is logged when it starts and when it ends, not per batch.
    pub fn full(&mut self, writer: &WriterParts<'_>, error: &rusqlite::Error) -> Duration {
        writer.shared.count(|s| {
            s.failed_batches += 1;
            s.full_batches += 1;
        });
        let now = writer.clock.monotonic();
        let episode = self.full_since.get_or_insert((now, 0));
        episode.1 += 1;
        if episode.1 == 1 {
            log::error!(
                "ledger {}: full ({error}): writes are answered 503 ledger_full until pruning or \
                 the sweep frees pages, or the disk has room again",
                writer.conn.path().unwrap_or("?")
            );
        }
        if self.keep_in_bound(writer, Check::AfterFull) {
            FULL_RETRY_AFTER_PRUNED
        } else {
            FULL_RETRY_AFTER
        }
    }

    /// Ends a full episode (logged) once a batch commits again.
    pub fn writable_again(&mut self, clock: &dyn Clock) {
        if let Some((since, refused)) = self.full_since.take() {
            log::warn!(
                "ledger: writes are recorded again after {refused} batches refused as full over \
                 {:.1?}",
                clock.monotonic().saturating_sub(since)
            );
        }
    }
}

/// Sets the file's page limit; if SQLite refuses, the previous limit stays (logged).
fn page_limit(conn: &Connection, pages: u64) {
    if let Err(error) = store::set_page_limit(conn, pages) {
        log::error!("ledger: cannot set max_page_count to {pages}: {error}");
    }
}
