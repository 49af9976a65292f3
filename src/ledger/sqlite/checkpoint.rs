//! When the write-ahead log is copied back into the database file (a checkpoint), and by whom.
//!
//! SQLite's automatic checkpoint runs inside the COMMIT that crosses its threshold: every
//! caller of that batch, and every write queued behind it, waits while it copies the log and
//! makes the two fsyncs a `normal` ledger otherwise never makes. Under a steady load that is
//! the latency tail. So the writer takes checkpoints over (`wal_autocheckpoint` off; a WAL
//! hook notes the log's length after each commit) and splits the work:
//!
//! - a background thread, on a connection of its own, copies the log into the file as it
//!   grows (PASSIVE: it never blocks the writer, which keeps appending meanwhile);
//! - the log can only start over from its beginning once a checkpoint has copied all of it,
//!   which cannot happen while the writer appends. So once the log reaches its restart length
//!   (half the WAL allowance, so a restart that has to wait for the background's checkpoint
//!   or a reader leaves the log the other half to grow into), the writer itself checkpoints between two batches:
//!   by then the background has copied nearly everything, so this copies the tail, and the
//!   next transaction starts the log over (truncated to `journal_size_limit`). The log stays
//!   within its allowance, and the writer pauses for a tail once per restart length instead
//!   of for a whole checkpoint at every half allowance.
//! - That checkpoint is a RESTART: it waits (the connection's busy timeout) for readers still
//!   on the log to move on, since a log a reader holds cannot start over. A PASSIVE one there
//!   let the log outgrow its allowance while readers and the background checkpoint kept it
//!   from finishing. While the background's checkpoint holds the checkpoint lock, SQLite
//!   answers busy at once. The writer does not wait for it then: the background's fsync can
//!   take a hundred milliseconds on a busy disk, and every write would wait behind it. It
//!   tries again after the next batch, until the log reaches three quarters of its allowance;
//!   from there it waits for the background (up to [`RESTART_PATIENCE`]), so the log keeps
//!   within its allowance.
//!
//! Both kinds are timed on `proxy_operator_ledger_checkpoint_seconds{by}`.

use std::cell::Cell;
use std::os::raw::c_int;
use std::path::Path;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;

use prometheus::Histogram;
use rusqlite::Connection;
use rusqlite::hooks::Wal;

use super::bound::SizeBound;

thread_local! {
    /// Frames in the WAL after the last commit on this thread's connection (the writer's
    /// connection lives on its own thread, so this is its WAL's length).
    static WAL_FRAMES: Cell<u64> = const { Cell::new(0) };
}

/// The WAL hook: SQLite calls it after each commit on the connection with the log's length.
fn note_frames(_wal: &Wal, frames: c_int) -> rusqlite::Result<()> {
    WAL_FRAMES.set(u64::try_from(frames).unwrap_or(0));
    Ok(())
}

/// Frames in the writer's WAL after its last commit (0 after it started the log over); read
/// on the writer's thread.
pub(super) fn wal_frames() -> u64 {
    WAL_FRAMES.get()
}

/// Turns SQLite's automatic checkpoint off on `conn` and has each commit note the WAL's
/// length. The hook replaces the automatic checkpoint's own, so the pragma comes first.
pub(crate) fn take_over(conn: &Connection) -> rusqlite::Result<()> {
    conn.pragma_update(None, "wal_autocheckpoint", 0)?;
    conn.wal_hook(Some(note_frames));
    Ok(())
}

/// How long the writer keeps trying to start the log over before it goes on (and tries again
/// after the next batch): a background checkpoint takes milliseconds.
const RESTART_PATIENCE: std::time::Duration = std::time::Duration::from_secs(2);

/// What the writer does about the log after a batch, given its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    Nothing,
    /// Wake the background checkpoint.
    Background,
    /// Checkpoint the tail now, so the next transaction starts the log over, unless the
    /// background's checkpoint is under way (then after a later batch).
    Restart,
    /// Checkpoint the tail now, waiting for the background's checkpoint: the log is near its
    /// allowance.
    RestartWaiting,
}

/// When the log's length calls for which checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Policy {
    /// Frames appended since the background was last woken that wake it again.
    pub background_every: u64,
    /// Frames at which the writer checkpoints the tail itself.
    pub restart_at: u64,
    /// Frames from which it waits for the background's checkpoint to do so.
    pub wait_at: u64,
}

impl Policy {
    pub fn of(bound: &SizeBound) -> Policy {
        let allowance = bound.wal_limit / bound.frame_bytes();
        Policy {
            background_every: (allowance / 16).max(1),
            restart_at: (allowance / 2).max(1),
            wait_at: (allowance * 3 / 4).max(1),
        }
    }

    /// The step for a log of `frames`, the background last woken at `woken` frames.
    pub fn step(&self, frames: u64, woken: u64) -> Step {
        if frames >= self.wait_at {
            Step::RestartWaiting
        } else if frames >= self.restart_at {
            Step::Restart
        } else if frames >= woken + self.background_every {
            Step::Background
        } else {
            Step::Nothing
        }
    }
}

/// The writer's side of the checkpoints: the policy, and the background thread.
pub(super) struct Checkpoints {
    policy: Policy,
    /// The log's length when the background was last woken (0 after a restart).
    woken: u64,
    wake: Option<SyncSender<()>>,
    background: Option<JoinHandle<()>>,
    /// `by="writer"`.
    writer_time: Histogram,
}

impl Checkpoints {
    /// Starts the background checkpoint of the ledger at `path` on the connection `open`
    /// makes (on its own thread), timed on `background_time`.
    pub fn start(
        path: &Path,
        open: impl FnOnce() -> rusqlite::Result<Connection> + Send + 'static,
        bound: &SizeBound,
        writer_time: Histogram,
        background_time: Histogram,
    ) -> std::io::Result<Checkpoints> {
        let (wake, woken) = sync_channel(1);
        let path = path.to_owned();
        let background = std::thread::Builder::new()
            .name("ledger-checkpoint".into())
            .spawn(move || background(&path, open, &woken, &background_time))?;
        Ok(Checkpoints {
            policy: Policy::of(bound),
            woken: 0,
            wake: Some(wake),
            background: Some(background),
            writer_time,
        })
    }

    /// After a batch: wakes the background, or checkpoints the tail, as the log's length says.
    /// A failed checkpoint loses nothing (the frames stay in the log) and is tried again.
    pub fn after_batch(&mut self, conn: &Connection) {
        let frames = WAL_FRAMES.get();
        match self.policy.step(frames, self.woken) {
            Step::Nothing => {}
            Step::Background => {
                self.woken = frames;
                if let Some(wake) = &self.wake {
                    // Full: a checkpoint is already asked for and will see these frames too.
                    if let Err(TrySendError::Disconnected(())) = wake.try_send(()) {
                        log::warn!("ledger: the background checkpoint has stopped");
                        self.wake = None;
                    }
                }
            }
            Step::Restart => self.start_log_over(conn, std::time::Duration::ZERO),
            Step::RestartWaiting => self.start_log_over(conn, RESTART_PATIENCE),
        }
    }

    /// Checkpoints the tail so that the next transaction starts the log over, trying again
    /// every millisecond for up to `patience` while the background's checkpoint holds the
    /// checkpoint lock (SQLite answers busy at once then; the busy timeout covers only readers).
    fn start_log_over(&mut self, conn: &Connection, patience: std::time::Duration) {
        let timer = self.writer_time.start_timer();
        let started = std::time::Instant::now();
        let outcome = loop {
            let outcome = restart(conn);
            if matches!(outcome, Ok(true)) || started.elapsed() >= patience {
                break outcome;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        };
        timer.observe_duration();
        match outcome {
            Ok(true) => {
                self.woken = 0;
                WAL_FRAMES.set(0);
            }
            // Not waited for: a later batch tries again.
            Ok(false) if patience.is_zero() => {}
            Ok(false) => log::warn!("ledger checkpoint unfinished; tried again"),
            Err(error) => log::warn!("ledger checkpoint failed: {error}"),
        }
    }
}

impl Drop for Checkpoints {
    /// Stops the background thread (it finishes a checkpoint under way).
    fn drop(&mut self) {
        self.wake = None;
        if let Some(thread) = self.background.take()
            && thread.join().is_err()
        {
            log::error!("ledger: the background checkpoint thread panicked");
        }
    }
}

/// Copies what it can of the log into the file without waiting for readers or writers; a
/// later checkpoint finishes what one held back.
fn passive(conn: &Connection) -> rusqlite::Result<()> {
    conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
}

/// Copies all of the log into the file, waiting for readers of the log to move on, so that the
/// next transaction starts it over; `false` when it could not finish.
fn restart(conn: &Connection) -> rusqlite::Result<bool> {
    conn.query_row("PRAGMA wal_checkpoint(RESTART)", [], |row| {
        row.get::<_, i64>(0)
    })
    .map(|busy| busy == 0)
}

/// The background thread: a checkpoint each time it is woken, until the writer goes.
fn background(
    path: &Path,
    open: impl FnOnce() -> rusqlite::Result<Connection>,
    woken: &Receiver<()>,
    time: &Histogram,
) {
    let conn = match open() {
        Ok(conn) => conn,
        Err(error) => {
            log::warn!(
                "ledger {}: no background checkpoint ({error}); the writer checkpoints alone",
                path.display()
            );
            return;
        }
    };
    while woken.recv().is_ok() {
        let timer = time.start_timer();
        if let Err(error) = passive(&conn) {
            log::warn!("ledger background checkpoint failed: {error}");
        }
        timer.observe_duration();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_background_copies_the_log_as_it_grows_and_the_writer_restarts_it() {
        let bound = SizeBound::new(16 << 20, 4096).unwrap();
        let policy = Policy::of(&bound);
        // 2 MiB of 4120-byte frames: 509; a sixteenth 31, half 254, three quarters 381.
        assert_eq!(
            policy,
            Policy {
                background_every: 31,
                restart_at: 254,
                wait_at: 381,
            }
        );
        // (frames, woken at, step)
        let cases = [
            (0, 0, Step::Nothing),
            (30, 0, Step::Nothing),
            (31, 0, Step::Background),
            (40, 31, Step::Nothing),
            (62, 31, Step::Background),
            (253, 248, Step::Nothing),
            (254, 248, Step::Restart),
            (380, 248, Step::Restart),
            (381, 248, Step::RestartWaiting),
            (900, 0, Step::RestartWaiting),
        ];
        for (frames, woken, step) in cases {
            assert_eq!(policy.step(frames, woken), step, "{frames} frames, {woken}");
        }
    }

    /// Set while another connection's checkpoint holds the checkpoint lock, waiting for a
    /// reader; it lets go once [`LET_GO`] is set.
    static HOLDING: AtomicBool = AtomicBool::new(false);
    static LET_GO: AtomicBool = AtomicBool::new(false);

    fn hold_until_let_go(_attempt: i32) -> bool {
        HOLDING.store(true, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(1));
        !LET_GO.load(Ordering::SeqCst)
    }

    /// A real ledger file: a checkpoint of another connection holds SQLite's checkpoint lock
    /// (as the background's does during its fsync). At half the allowance the writer goes on
    /// at once without starting the log over; at three quarters it waits for that checkpoint
    /// to end, then starts the log over.
    #[test]
    fn the_writer_waits_for_a_checkpoint_under_way_only_near_the_allowance() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.db");
        let open = {
            let path = path.clone();
            move || -> rusqlite::Result<Connection> {
                let conn = Connection::open(&path)?;
                conn.pragma_update(None, "journal_mode", "WAL")?;
                Ok(conn)
            }
        };
        let writer = open().unwrap();
        take_over(&writer).unwrap();
        writer
            .execute_batch("CREATE TABLE t (x); INSERT INTO t VALUES (1);")
            .unwrap();
        // A reader on the log, and frames after its snapshot: a RESTART must wait for it.
        let reader = open().unwrap();
        reader.execute_batch("BEGIN").unwrap();
        let rows: i64 = reader
            .query_row("SELECT count(*) FROM t", [], |row| row.get(0))
            .unwrap();
        assert_eq!(rows, 1);
        writer.execute_batch("INSERT INTO t VALUES (2);").unwrap();
        let holder = std::thread::spawn({
            let open = open.clone();
            move || {
                let conn = open().unwrap();
                conn.busy_handler(Some(hold_until_let_go)).unwrap();
                restart(&conn).unwrap()
            }
        });
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !HOLDING.load(Ordering::SeqCst) {
            assert!(
                std::time::Instant::now() < deadline,
                "no checkpoint under way"
            );
            std::thread::sleep(Duration::from_millis(1));
        }

        let bound = SizeBound::new(16 << 20, 4096).unwrap();
        let time = || Histogram::with_opts(prometheus::HistogramOpts::new("t", "t")).unwrap();
        let mut checkpoints = Checkpoints::start(&path, open, &bound, time(), time()).unwrap();
        let policy = Policy::of(&bound);
        WAL_FRAMES.set(policy.restart_at);
        let started = std::time::Instant::now();
        checkpoints.after_batch(&writer);
        assert!(
            started.elapsed() < RESTART_PATIENCE / 2,
            "the writer waited {:?} for the other checkpoint",
            started.elapsed()
        );
        assert_eq!(
            WAL_FRAMES.get(),
            policy.restart_at,
            "the log started over while another checkpoint held the lock"
        );
        assert!(!LET_GO.load(Ordering::SeqCst));

        // The reader moves on and the other checkpoint ends a moment later: the writer, near
        // the allowance, waits for that and starts the log over.
        let ending = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            reader.execute_batch("COMMIT").unwrap();
            LET_GO.store(true, Ordering::SeqCst);
        });
        WAL_FRAMES.set(policy.wait_at);
        checkpoints.after_batch(&writer);
        assert_eq!(WAL_FRAMES.get(), 0, "the log did not start over");
        ending.join().unwrap();
        holder.join().unwrap();
        assert_eq!(checkpoints.writer_time.get_sample_count(), 2);
    }
}
