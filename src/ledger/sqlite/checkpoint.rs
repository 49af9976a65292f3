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
//!   answers busy at once, so the writer waits for it (up to [`RESTART_PATIENCE`]).
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
    /// Checkpoint the tail now, so the next transaction starts the log over.
    Restart,
}

/// When the log's length calls for which checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Policy {
    /// Frames appended since the background was last woken that wake it again.
    pub background_every: u64,
    /// Frames at which the writer checkpoints the tail itself.
    pub restart_at: u64,
}

impl Policy {
    pub fn of(bound: &SizeBound) -> Policy {
        let allowance = bound.wal_limit / bound.frame_bytes();
        Policy {
            background_every: (allowance / 16).max(1),
            restart_at: (allowance / 2).max(1),
        }
    }

    /// The step for a log of `frames`, the background last woken at `woken` frames.
    pub fn step(&self, frames: u64, woken: u64) -> Step {
        if frames >= self.restart_at {
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
            Step::Restart => {
                let timer = self.writer_time.start_timer();
                // SQLite answers busy at once while the background's checkpoint holds the
                // checkpoint lock (the busy timeout covers only readers): wait for it to end,
                // so the log starts over now, not batches later.
                let started = std::time::Instant::now();
                loop {
                    match restart(conn) {
                        Ok(true) => {
                            self.woken = 0;
                            WAL_FRAMES.set(0);
                        }
                        Ok(false) | Err(_) if started.elapsed() < RESTART_PATIENCE => {
                            std::thread::sleep(std::time::Duration::from_millis(1));
                            continue;
                        }
                        Ok(false) => log::warn!("ledger checkpoint unfinished; tried again"),
                        Err(error) => log::warn!("ledger checkpoint failed: {error}"),
                    }
                    break;
                }
                timer.observe_duration();
            }
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
    use super::*;

    #[test]
    fn the_background_copies_the_log_as_it_grows_and_the_writer_restarts_it() {
        let bound = SizeBound::new(16 << 20, 4096).unwrap();
        let policy = Policy::of(&bound);
        // 2 MiB of 4120-byte frames: 509; a sixteenth 31, half 254.
        assert_eq!(
            policy,
            Policy {
                background_every: 31,
                restart_at: 254
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
            (900, 0, Step::Restart),
        ];
        for (frames, woken, step) in cases {
            assert_eq!(policy.step(frames, woken), step, "{frames} frames, {woken}");
        }
    }
}
