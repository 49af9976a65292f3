//! The ledger's size bound (`max_size`, `--ledger-max-size`): how its bytes are split between
//! the database file and the write-ahead log, and when and how much of the oldest history is
//! pruned. Pure arithmetic over page counts, so every decision is tested without a file.
//!
//! The bound covers the database file and its WAL together. The WAL gets an allowance (an
//! eighth of the bound, at most 8 MiB): the writer starts the log over before it is full
//! (`checkpoint.rs`) and a reset WAL is truncated back to it (`journal_size_limit`). The
//! rest is the database's page budget, enforced by SQLite with `max_page_count`: a write that
//! would need a page past it fails with SQLITE_FULL, so the file never outgrows the bound.
//! Within the page budget:
//!
//! - below the high-water mark (7/8 of the pages) the ledger just grows;
//! - above it the writer prunes the oldest history, one bounded transaction after each batch,
//!   until the used pages are down to the low-water mark (3/4); freed pages are reused by
//!   later writes, so the file stays at its size instead of shrinking (no VACUUM);
//! - client writes may fill pages up to 15/16 (their `max_page_count`); the last sixteenth is
//!   kept for housekeeping (the sweep and pruning), which frees space and so must still run
//!   when client writes no longer can.

use super::options::check_max_size;

/// Largest WAL allowance. The writer pauses to checkpoint the log's tail once per three
/// quarters of it (`checkpoint.rs`). A longer log would pause it less often, but measured at
/// 64 MiB the saturated throughput fell by a sixth, with no better latency tail.
const MAX_WAL_ALLOWANCE: u64 = 8 << 20;
/// Bytes of a WAL frame besides its page.
const WAL_FRAME_HEADER: u64 = 24;
/// Fewest rows one prune step deletes, so that every step makes progress. Small: at a small
/// bound a step's WAL frames allow only a few dozen rows, and a file above its high-water mark
/// gets another step before the next batch (`space.rs`) rather than a larger one.
const MIN_PRUNE_ROWS: u64 = 16;
/// WAL frames a deleted history row is taken to cost before a step measured it: its share of
/// the table's pages and one page of the by-lease index, whose keys are scattered. Measured
/// steps write about half a frame a row.
const UNMEASURED_FRAMES_PER_ROW: u64 = 2;

/// What one prune step cost: the rows it deleted and the WAL frames its transaction wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StepCost {
    pub rows: u64,
    pub frames: u64,
}

/// Pages of the database file as SQLite counts them (`page_count`, `freelist_count`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Usage {
    /// Pages of the database, free or used.
    pub pages: u64,
    /// Pages on the free list, reused before the file grows.
    pub free: u64,
}

impl Usage {
    /// Pages holding data.
    pub fn used(self) -> u64 {
        self.pages.saturating_sub(self.free)
    }
}

/// Why the writer looks at its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Check {
    /// After a batch; `pruning` says whether the last check started or continued pruning.
    AfterBatch {
        /// A pruning episode is under way (hysteresis between the two marks).
        pruning: bool,
    },
    /// A batch just failed with SQLITE_FULL: prune even below the marks, since the disk
    /// itself may be what is full, and reused pages need no new disk space.
    AfterFull,
}

/// The page limits and marks of one ledger file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SizeBound {
    /// The file's page size in bytes.
    pub page_size: u64,
    /// The WAL's allowance, and the bytes kept after a reset (`journal_size_limit`).
    pub wal_limit: u64,
    /// `max_page_count` while housekeeping runs: the whole page budget.
    pub housekeeping_pages: u64,
    /// `max_page_count` of client batches.
    pub client_pages: u64,
    /// Used pages above which pruning starts.
    pub high_water: u64,
    /// Used pages pruning brings the file back to.
    pub low_water: u64,
}

impl SizeBound {
    /// The limits for a bound of `max_size` bytes (file and WAL) on a file of `page_size`
    /// bytes per page; refuses a bound too small to hold anything.
    pub fn new(max_size: u64, page_size: u64) -> Result<SizeBound, String> {
        check_max_size(max_size)?;
        if !(512..=65536).contains(&page_size) || !page_size.is_power_of_two() {
            return Err(format!("page size {page_size} is not an SQLite page size"));
        }
        let wal_limit = wal_allowance(max_size);
        let housekeeping_pages = (max_size - wal_limit) / page_size;
        Ok(SizeBound {
            page_size,
            wal_limit,
            housekeeping_pages,
            client_pages: housekeeping_pages - housekeeping_pages / 16,
            high_water: housekeeping_pages - housekeeping_pages / 8,
            low_water: housekeeping_pages - housekeeping_pages / 4,
        })
    }

    /// Bytes of the oldest history to prune now, or `None` when the file is within its marks.
    /// Pruning starts above the high-water mark and goes on down to the low-water mark; after
    /// SQLITE_FULL it frees at least one step's worth.
    pub fn bytes_to_free(&self, usage: Usage, check: Check) -> Option<u64> {
        let used = usage.used();
        let above_low = used.saturating_sub(self.low_water) * self.page_size;
        match check {
            Check::AfterBatch { pruning: false } if used < self.high_water => None,
            Check::AfterBatch { .. } if above_low == 0 => None,
            Check::AfterBatch { .. } => Some(above_low),
            Check::AfterFull => Some(above_low.max(self.step_bytes())),
        }
    }

    /// Rows to delete in one prune step to free `bytes`, given the used pages, the rows of
    /// history, what the last step cost and the frames in the WAL now: the average row's share
    /// of the used bytes overestimates a history row (leases and indexes share the pages), so
    /// a step frees at most what it is asked to and the next check measures again. A step
    /// deletes at least [`MIN_PRUNE_ROWS`] and at most [`SizeBound::most_rows`].
    pub fn rows_to_prune(
        &self,
        bytes: u64,
        usage: Usage,
        history_rows: u64,
        last: Option<StepCost>,
        wal_frames: u64,
    ) -> u64 {
        let used_bytes = usage.used().max(1) * self.page_size;
        let row_bytes = (used_bytes / history_rows.max(1)).max(1);
        bytes
            .div_ceil(row_bytes)
            .clamp(MIN_PRUNE_ROWS, self.most_rows(last, wal_frames))
    }

    /// The most rows one step may delete so that its transaction writes at most
    /// [`SizeBound::step_frames`]: as many as the frames per row the last step wrote allow, or
    /// [`UNMEASURED_FRAMES_PER_ROW`] before any step was measured. A step's fixed frames (the
    /// tree's upper pages, the file header) make a small step's rows look dear, so the
    /// estimate errs small and grows back.
    pub fn most_rows(&self, last: Option<StepCost>, wal_frames: u64) -> u64 {
        let frames = self.step_frames(wal_frames);
        let rows = match last {
            Some(StepCost {
                rows,
                frames: wrote,
            }) if rows > 0 && wrote > 0 => frames.saturating_mul(rows) / wrote,
            _ => frames / UNMEASURED_FRAMES_PER_ROW,
        };
        rows.max(MIN_PRUNE_ROWS)
    }

    /// The WAL frames one prune step may write when the log holds `wal_frames`: half the room
    /// left in the allowance, so that a step whose rows cost up to twice what the last one's
    /// did still fits, and the checkpoint after it (`checkpoint.rs`) starts the log over.
    pub fn step_frames(&self, wal_frames: u64) -> u64 {
        let allowance = self.wal_limit / self.frame_bytes();
        (allowance.saturating_sub(wal_frames) / 2).max(1)
    }

    /// Bytes of one WAL frame: a page and its header.
    pub fn frame_bytes(&self) -> u64 {
        self.page_size + WAL_FRAME_HEADER
    }

    /// What one prune step may write to the WAL.
    fn step_bytes(&self) -> u64 {
        self.wal_limit / 4
    }
}

/// The WAL's share of a bound of `max_size` bytes.
pub(crate) fn wal_allowance(max_size: u64) -> u64 {
    (max_size / 8).min(MAX_WAL_ALLOWANCE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::sqlite::options::{DEFAULT_MAX_SIZE, MIN_MAX_SIZE};

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_bound_is_split_between_the_wal_and_the_pages() {
        // (max_size, page size, wal_limit, housekeeping, client, high, low)
        let cases = [
            (MIN_MAX_SIZE, 4096, MIB / 8, 224, 210, 196, 168),
            (16 * MIB, 4096, 2 * MIB, 3584, 3360, 3136, 2688),
            (
                DEFAULT_MAX_SIZE,
                4096,
                8 * MIB,
                129_024,
                120_960,
                112_896,
                96_768,
            ),
            (1 << 30, 4096, 8 * MIB, 260_096, 243_840, 227_584, 195_072),
            (16 * MIB, 65536, 2 * MIB, 224, 210, 196, 168),
        ];
        for (max, page, wal, housekeeping, client, high, low) in cases {
            let bound = SizeBound::new(max, page).unwrap();
            assert_eq!(
                (
                    bound.wal_limit,
                    bound.housekeeping_pages,
                    bound.client_pages,
                    bound.high_water,
                    bound.low_water
                ),
                (wal, housekeeping, client, high, low),
                "{max} bytes, {page}-byte pages"
            );
            // The file at its page limit plus a full WAL allowance fit in the bound.
            assert!(bound.housekeeping_pages * page + bound.wal_limit <= max);
            assert!(bound.low_water < bound.high_water && bound.high_water < bound.client_pages);
            assert!(bound.client_pages < bound.housekeeping_pages);
        }
    }

    #[test]
    fn bounds_that_cannot_hold_a_ledger_are_refused() {
        for (max, page) in [
            (0, 4096),
            (MIN_MAX_SIZE - 1, 4096),
            (64 * 1024, 4096),
            (MIB, 1000),
            (MIB, 256),
            (MIB, 131_072),
        ] {
            assert!(
                SizeBound::new(max, page).is_err(),
                "{max} bytes, {page}-byte pages"
            );
        }
        let error = SizeBound::new(512 * 1024, 4096).unwrap_err();
        assert!(error.contains("at least 1048576 bytes"), "{error}");
    }

    #[test]
    fn pruning_starts_at_the_high_water_mark_and_stops_at_the_low_one() {
        let bound = SizeBound::new(16 * MIB, 4096).unwrap();
        let usage = |used: u64, free: u64| Usage {
            pages: used + free,
            free,
        };
        let idle = Check::AfterBatch { pruning: false };
        let pruning = Check::AfterBatch { pruning: true };
        let page = 4096;
        let step = 2 * MIB / 4;
        let cases = [
            ("small file", usage(100, 0), idle, None),
            ("just below high water", usage(3135, 0), idle, None),
            ("at high water", usage(3136, 0), idle, Some(448 * page)),
            ("free pages do not count", usage(3000, 500), idle, None),
            ("over high water", usage(3400, 10), idle, Some(712 * page)),
            (
                "pruning goes on",
                usage(3000, 600),
                pruning,
                Some(312 * page),
            ),
            ("pruning reached low water", usage(2688, 900), pruning, None),
            ("below low water", usage(2000, 0), pruning, None),
            (
                "full below the marks",
                usage(2000, 0),
                Check::AfterFull,
                Some(step),
            ),
            (
                "full above low water",
                usage(3584, 0),
                Check::AfterFull,
                Some(896 * page),
            ),
        ];
        for (name, usage, check, want) in cases {
            assert_eq!(bound.bytes_to_free(usage, check), want, "{name}");
        }
    }

    #[test]
    fn a_prune_step_is_sized_by_the_average_row_and_capped_by_the_frames_the_last_one_wrote() {
        let bound = SizeBound::new(16 * MIB, 4096).unwrap();
        // 2 MiB of 4120-byte frames: 509; half of the room in an empty log 254.
        assert_eq!(bound.step_frames(0), 254);
        assert_eq!(bound.step_frames(300), 104);
        assert_eq!(bound.step_frames(509), 1);
        let usage = Usage {
            pages: 3200,
            free: 0,
        };
        let cost = |rows, frames| Some(StepCost { rows, frames });
        // 3200 pages over 40,000 rows: 327 bytes a row.
        let cases = [
            ("a little", 4096, 40_000, None, 0, MIN_PRUNE_ROWS),
            ("some, unmeasured", 200_000, 40_000, None, 0, 127),
            (
                "some, half a frame a row",
                200_000,
                40_000,
                cost(200, 100),
                0,
                508,
            ),
            (
                "some, a fuller log",
                200_000,
                40_000,
                cost(200, 100),
                300,
                208,
            ),
            ("some, cheap rows", 200_000, 40_000, cost(1000, 100), 0, 612),
            (
                "more than a step may write",
                4 * MIB,
                40_000,
                cost(200, 100),
                0,
                508,
            ),
            ("dear rows", 4 * MIB, 40_000, cost(100, 400), 0, 63),
            (
                "dearer rows",
                4 * MIB,
                40_000,
                cost(100, 2000),
                0,
                MIN_PRUNE_ROWS,
            ),
            (
                "a step that wrote nothing",
                4 * MIB,
                40_000,
                cost(100, 0),
                0,
                127,
            ),
            ("no history yet", 4 * MIB, 0, None, 0, MIN_PRUNE_ROWS),
            ("huge rows", 4 * MIB, 10, cost(200, 100), 0, MIN_PRUNE_ROWS),
        ];
        for (name, bytes, rows, last, wal, want) in cases {
            assert_eq!(
                bound.rows_to_prune(bytes, usage, rows, last, wal),
                want,
                "{name}"
            );
        }
        let empty = Usage { pages: 0, free: 0 };
        assert_eq!(
            bound.rows_to_prune(MIB, empty, 0, None, 0),
            127,
            "an empty file, unmeasured"
        );
    }

    #[test]
    fn a_measured_step_stays_within_its_frames_at_every_bound() {
        // A step writes `fixed` frames besides `per_row` hundredths of a frame a row: steps
        // sized from the one before converge under their frames, from the first one on, and a
        // step over them still fits in the log.
        for max in [MIN_MAX_SIZE, 4 * MIB, 16 * MIB, DEFAULT_MAX_SIZE] {
            let bound = SizeBound::new(max, 4096).unwrap();
            let allowance = bound.wal_limit / bound.frame_bytes();
            for (fixed, per_row) in [(0, 50), (4, 50), (6, 100), (2, 150)] {
                let wrote = |rows: u64| fixed + (rows * per_row).div_ceil(100);
                for wal in [0, allowance / 2, allowance * 3 / 4] {
                    let mut last = None;
                    for step in 0..10 {
                        let rows = bound.most_rows(last, wal);
                        let frames = wrote(rows);
                        let what = format!("{max} bytes, log at {wal}, step {step}");
                        if rows > MIN_PRUNE_ROWS {
                            assert!(
                                frames <= bound.step_frames(wal),
                                "{what}: {rows} rows wrote {frames} frames of {}",
                                bound.step_frames(wal)
                            );
                        }
                        if max > MIN_MAX_SIZE {
                            assert!(wal + frames <= allowance, "{what}: {frames} frames");
                        }
                        last = Some(StepCost { rows, frames });
                    }
                }
            }
        }
    }
}
