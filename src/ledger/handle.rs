//! The ledger handle callers hold: writes go to the writer's queue and are awaited, reads come
//! from the readers' pool (a lease) or from the published counts.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::oneshot;

use super::clock::Clock;
use super::config::LedgerConfig;
use super::counts::{Counts, TargetCooldowns};
use super::error::LedgerError;
use super::lease::{
    AcquireOutcome, AcquireRequest, Lease, ReportResult, SweepStats, is_release_reason,
};
use super::space::Space;
use super::store::{self, ReaderPool};
use super::writer::{Job, Message, OVERLOADED_RETRY_AFTER, Reply, Shared, Writer, WriterStats};

/// Handle on the on-disk lease ledger. Cheap to clone; every clone talks to the same writer.
/// The writer stops when [`shutdown`](Ledger::shutdown) is called or the last clone is
/// dropped, after finishing the writes queued before.
#[derive(Clone)]
pub struct Ledger {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    config: LedgerConfig,
    clock: Arc<dyn Clock>,
    pool: ReaderPool,
    counts: Arc<RwLock<Counts>>,
    queue: SyncSender<Message>,
    shared: Arc<Shared>,
    closed: AtomicBool,
    writer: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger")
            .field("path", &self.inner.path)
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl Ledger {
    /// Opens (creating if needed) the ledger file at `path`, switches it to WAL, applies
    /// pending migrations, loads the lease state into memory and starts the writer thread.
    /// Refuses a file written by a newer binary. Blocks on SQLite: call it before serving, or
    /// from a blocking thread.
    pub fn open(
        path: &Path,
        config: LedgerConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<Ledger, LedgerError> {
        config.validate()?;
        let (conn, bound) = store::open_writer(path, config.durability, config.max_size)?;
        let now = clock.now().as_millisecond();
        let state = store::load_state(&conn, now).map_err(|source| LedgerError::Open {
            path: path.to_owned(),
            source,
        })?;
        let counts = Arc::new(RwLock::new(Counts::of(&state, now)));
        let pool = store::reader_pool(path, config.durability)?;
        let (queue, receiver) = sync_channel(config.queue_capacity);
        let shared = Arc::new(Shared::default());
        let writer = Writer {
            conn,
            state,
            counts: counts.clone(),
            clock: clock.clone(),
            config: config.clone(),
            queue: receiver,
            shared: shared.clone(),
            bound,
            space: Space::default(),
        };
        let thread = std::thread::Builder::new()
            .name("ledger-writer".into())
            .spawn(move || writer.run())
            .map_err(LedgerError::Writer)?;
        Ok(Ledger {
            inner: Arc::new(Inner {
                path: path.to_owned(),
                config,
                clock,
                pool,
                counts,
                queue,
                shared,
                closed: AtomicBool::new(false),
                writer: Mutex::new(Some(thread)),
            }),
        })
    }

    /// The ledger file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Bytes the ledger takes on disk now: the database file plus its write-ahead log (what
    /// the size bound covers). A file that cannot be read counts as empty.
    pub fn disk_bytes(&self) -> u64 {
        let mut wal = self.inner.path.clone().into_os_string();
        wal.push("-wal");
        [self.inner.path.as_os_str(), wal.as_os_str()]
            .into_iter()
            .filter_map(|file| std::fs::metadata(file).ok())
            .map(|metadata| metadata.len())
            .sum()
    }

    /// Grants a lease on the best candidate (see the selection order) or says why none could
    /// be granted. Decided by the writer in arrival order against the leases in memory, so
    /// concurrent acquires never exceed a proxy's `max_leases`; answered after the COMMIT
    /// holding the lease. With a target, proxies cooling down for it are skipped; the TTL is
    /// capped by `max_ttl`. With a request ID whose window is open (until its lease's
    /// `expires_at`), answers with that lease as it is now, or refuses a different request.
    /// Refused with [`LedgerError::Overloaded`] (nothing decided) when the queue is full or
    /// the write's queue deadline passes; not granted at all when the caller has gone
    /// (dropped this future) before its turn.
    pub async fn acquire(&self, request: AcquireRequest) -> Result<AcquireOutcome, LedgerError> {
        let ttl_ms = self.inner.config.capped_ttl_ms(request.ttl)?;
        self.call(|reply| Job::Acquire {
            request,
            ttl_ms,
            reply,
        })
        .await
    }

    /// Extends an active lease to `ttl` from now (capped), for sticky sessions. Released and
    /// expired leases cannot be renewed.
    pub async fn renew(&self, id: &str, ttl: Duration) -> Result<Lease, LedgerError> {
        let ttl_ms = self.inner.config.capped_ttl_ms(ttl)?;
        let id = id.to_owned();
        self.call(|reply| Job::Renew { id, ttl_ms, reply }).await
    }

    /// Gives a lease back. Idempotent: releasing a released, expired or unknown lease does
    /// nothing and succeeds.
    pub async fn release(&self, id: &str) -> Result<(), LedgerError> {
        let id = id.to_owned();
        self.call(|reply| Job::Release { id, reply }).await
    }

    /// Ends at once every lease of the proxy with UID `proxy_uid` that counts towards its
    /// capacity, because the operator lost, stopped or deleted its machine: each becomes
    /// `released` now with `release_reason = reason` and one `released` history event carrying
    /// `reason`, so the replacement starts with the proxy's full capacity and the file says why
    /// the leases ended. Returns how many were ended; idempotent (again, 0).
    ///
    /// An active lease already past its expiry is not counted: it stopped counting when it
    /// expired, and the sweep marks it `expired` as usual. For its crawler an ended lease is
    /// like any released one: renew answers [`LedgerError::NotActive`], release succeeds,
    /// reports still land, and its request ID replays it until the window closes.
    ///
    /// `reason` is a machine code (`machine_lost`, `machine_stopped`, `machine_gone`; 1-64 of
    /// `a-z 0-9 _ - .`), else [`LedgerError::InvalidReason`]. Decided by the writer in a batch
    /// like a release, with the same errors (`BatchFailed`, `Full`: nothing recorded, retry);
    /// it has no queue deadline because deciding it late is harmless, but is refused with
    /// [`LedgerError::Overloaded`] when the queue is full.
    pub async fn end_leases(&self, proxy_uid: &str, reason: &str) -> Result<u64, LedgerError> {
        if !is_release_reason(reason) {
            return Err(LedgerError::InvalidReason(reason.to_owned()));
        }
        let proxy_uid = proxy_uid.to_owned();
        let reason = reason.to_owned();
        self.submit_and_wait(
            |reply| Job::EndLeases {
                proxy_uid,
                reason,
                reply,
            },
            false,
        )
        .await
    }

    /// Records what a crawler observed on a lease, in any state as long as it is retained.
    /// `rate_limited` and `blocked` put (proxy, target) into cooldown; `target` defaults to
    /// the lease's target, and without either no cooldown can be keyed, so only the report is
    /// recorded. Returns the lease.
    pub async fn report(
        &self,
        id: &str,
        result: ReportResult,
        target: Option<&str>,
    ) -> Result<Lease, LedgerError> {
        let id = id.to_owned();
        let target = target.map(str::to_owned);
        self.call(|reply| Job::Report {
            id,
            result,
            target,
            reply,
        })
        .await
    }

    /// Marks leases past their expiry as expired (one `expired` event each, timed at the
    /// expiry), deletes finished leases whose expiry is older than the cooldown window (their
    /// request IDs go with them), ended cooldowns, and history older than the retention
    /// period. Housekeeping has no queue deadline: it waits for its turn.
    pub async fn sweep(&self) -> Result<SweepStats, LedgerError> {
        self.submit_and_wait(|reply| Job::Sweep { reply }, false)
            .await
    }

    /// Compares the writer's in-memory state with what the file holds (for tests, and for
    /// investigating a suspected divergence); [`LedgerError::Inconsistent`] says how they
    /// differ.
    pub async fn self_check(&self) -> Result<(), LedgerError> {
        self.submit_and_wait(|reply| Job::SelfCheck { reply }, false)
            .await
    }

    /// The lease with this ID, if it is still retained, as committed. A lease past its expiry
    /// reads as expired even before the sweep marks it. Blocks on a pooled read connection
    /// (never on the writer): async callers use a blocking thread.
    pub fn get(&self, id: &str) -> Result<Option<Lease>, LedgerError> {
        let now = self.now_ms();
        let conn = self.inner.pool.get()?;
        Ok(store::lease_by_id(&conn, id, now)?)
    }

    /// Active leases per proxy UID (proxies without any are absent), from memory.
    pub fn active_counts(&self) -> HashMap<String, u32> {
        self.counts().active_counts(self.now_ms())
    }

    /// Active leases of one proxy, from memory.
    pub fn active_count(&self, uid: &str) -> u32 {
        self.counts().active_count(uid, self.now_ms())
    }

    /// Number of active leases, from memory.
    pub fn active_total(&self) -> u64 {
        self.counts().active_total(self.now_ms())
    }

    /// Number of (proxy, target) pairs in cooldown, from memory.
    pub fn cooldowns_active(&self) -> u64 {
        self.counts().cooldowns_active(self.now_ms())
    }

    /// (proxy, target) cooldowns in force per target, from memory: the [`NAMED_TARGETS`] targets
    /// with the most (ties by name) and the sum over the others. A scrape copies the ranking
    /// the writer made at its last commit that changed a cooldown, or ranks the targets
    /// itself once a cooldown counted there has ended; an ended cooldown never counts.
    ///
    /// [`NAMED_TARGETS`]: super::NAMED_TARGETS
    pub fn target_cooldowns(&self) -> TargetCooldowns {
        self.counts().target_cooldowns(self.now_ms())
    }

    /// Writes waiting in the queue.
    pub fn queue_depth(&self) -> usize {
        self.inner.shared.depth.load(Ordering::Relaxed)
    }

    /// Batches, their sizes, and refused or abandoned writes since open.
    pub fn writer_stats(&self) -> WriterStats {
        self.inner.shared.stats()
    }

    /// Whether the writer accepts writes (false after shutdown, or if its thread died).
    pub fn is_running(&self) -> bool {
        !self.inner.closed.load(Ordering::Acquire)
            && self
                .inner
                .writer
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .as_ref()
                .is_some_and(|thread| !thread.is_finished())
    }

    /// Stops the writer: writes already queued are decided and committed, later ones are
    /// refused with [`LedgerError::Closed`]. Blocks until the writer has stopped (at most the
    /// queued batches). Dropping the last clone does the same.
    pub fn shutdown(&self) {
        self.inner.stop();
    }

    async fn call<T>(&self, job: impl FnOnce(Reply<T>) -> Job) -> Result<T, LedgerError> {
        self.submit_and_wait(job, true).await
    }

    /// Queues a write (refusing it at once when the queue is full) and waits for its answer.
    async fn submit_and_wait<T>(
        &self,
        job: impl FnOnce(Reply<T>) -> Job,
        with_deadline: bool,
    ) -> Result<T, LedgerError> {
        let inner = &self.inner;
        if inner.closed.load(Ordering::Acquire) {
            return Err(LedgerError::Closed);
        }
        let (reply, answer) = oneshot::channel();
        let deadline = with_deadline.then(|| {
            inner
                .clock
                .monotonic()
                .saturating_add(inner.config.queue_deadline)
        });
        inner.shared.depth.fetch_add(1, Ordering::Relaxed);
        let message = Message::Job {
            job: job(reply),
            deadline,
        };
        if let Err(refused) = inner.queue.try_send(message) {
            inner.shared.depth.fetch_sub(1, Ordering::Relaxed);
            return Err(match refused {
                TrySendError::Full(_) => {
                    inner.shared.refused_full.fetch_add(1, Ordering::Relaxed);
                    LedgerError::Overloaded {
                        retry_after: OVERLOADED_RETRY_AFTER,
                    }
                }
                TrySendError::Disconnected(_) => LedgerError::Closed,
            });
        }
        // A dropped sender means the writer stopped without answering.
        answer.await.unwrap_or(Err(LedgerError::Closed))
    }

    fn counts(&self) -> std::sync::RwLockReadGuard<'_, Counts> {
        self.inner
            .counts
            .read()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn now_ms(&self) -> i64 {
        self.inner.clock.now().as_millisecond()
    }
}

impl Inner {
    fn stop(&self) {
        if !self.closed.swap(true, Ordering::AcqRel) {
            // Blocks while the queue is full; fails only if the writer is already gone.
            let _ = self.queue.send(Message::Stop);
        }
        let thread = self
            .writer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(thread) = thread
            && thread.join().is_err()
        {
            log::error!("ledger {}: the writer thread panicked", self.path.display());
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop();
    }
}
