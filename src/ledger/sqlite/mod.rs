//! The SQLite backend of the lease ledger: one on-disk file (WAL, migrations from
//! `migrations/`), so an engineer can read what happened with `sqlite3`.
//!
//! # One writer
//!
//! Every write (acquire, renew, release, the end of a proxy's leases, report, a refusal's
//! unmet demand, a gateway's bytes, sweep) is decided by one writer thread that owns the write connection and
//! the lease state in memory (`state.rs`): the leases whose row says active with their expiry
//! times (a lease counts while `expires_at > now`, so capacity is counted by time, not by a
//! counter), the cooldowns per (proxy UID, target), the request-ID index, and each tenant's
//! bytes of the current UTC day (its `bytesPerDay` quota). The state is rebuilt from the file
//! at open; unmet demand is not part of it (it is only added to, and
//! read from the file). Writes are decided one after the other in arrival order against that
//! state, so concurrent acquires can never exceed a proxy's `maxLeases`, and no acquire scans
//! the leases table or copies the candidates. A dedicated thread rather than a tokio task: SQLite calls
//! block, the connection stays on one thread, the ledger works without (and never starves) an
//! async runtime, and callers only enqueue and await a oneshot answer.
//!
//! # Group commit
//!
//! The writer takes the first queued write, begins a transaction (`BEGIN IMMEDIATE`, which
//! also keeps another process off the file), then takes everything else queued at that moment
//! (at most `max_batch`), decides each in order, and commits them in one transaction. Every
//! caller is answered only after the COMMIT that holds its row, so an answered lease survives
//! `kill -9`; the cost of a commit is shared by the batch instead of paid per call.
//!
//! # Rollback
//!
//! The state journals every change of the batch. If a statement or the COMMIT fails, the
//! transaction is rolled back, the journal undoes the batch in memory, and every caller of the
//! batch gets [`LedgerError::BatchFailed`] — memory matches the file again, and nothing of the
//! batch was acknowledged; when the failure is SQLITE_FULL (the disk, or the file's page
//! limit) they get [`LedgerError::Full`] instead, which says when to retry.
//!
//! # Staleness of the counts
//!
//! Readers never see a batch before its commit: the counts they read (active leases, cooldowns,
//! targets) are a view the writer refreshes after each COMMIT (only for what the batch touched)
//! and before answering, so a caller that got its answer reads its own write, and no count is
//! older than the last commit. A lease is read through a pool of WAL readers. No read waits for
//! a write.
//!
//! # Size bound
//!
//! The file and its WAL stay within `max_size` (`bound.rs` has the arithmetic): SQLite caps
//! the file's pages (`max_page_count`), the writer prunes the oldest history between batches
//! once the file nears the cap (`space.rs`), and housekeeping may use pages kept back from
//! client writes, so the sweep can free space when writes no longer fit.
//!
//! # Bounded waiting
//!
//! actix-web does not cancel a handler whose client went away, so a write queued behind a
//! slow writer would still be granted long after its client gave up, and a retrying client
//! would hold two leases. The queue therefore has a size (`queue_capacity`): a write that
//! does not fit is refused at once with [`LedgerError::Overloaded`]. Each write carries a
//! deadline (`queue_deadline` on the clock's monotonic time): one whose deadline passed before
//! the writer reached it is refused with `Overloaded` and not decided. An acquire whose caller
//! dropped its future before its turn is skipped, never granted.
//!
//! # Request IDs
//!
//! The request ID and fingerprint of an acquire are columns of the lease row (kept as long as
//! the row is retained), so replays work after a restart.

mod bound;
mod checkpoint;
mod counts;
mod metrics;
mod options;
mod schema;
mod space;
mod state;
mod stats;
mod store;
mod tenant_leases;
mod writer;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::oneshot;

use checkpoint::Checkpoints;
use counts::Counts;
use space::Space;
use stats::Shared;
use store::ReaderPool;
use writer::{Job, Message, OVERLOADED_RETRY_AFTER, Reply, Writer};

use super::{
    AcquireOutcome, AcquireRequest, Activity, Clock, EventEntry, EventsQuery, Lease, LeaseReport,
    Ledger, LedgerConfig, LedgerCounts, LedgerError, SweepStats, TrafficBytes, TrafficHour,
};
use crate::ledger::demand;
use crate::ledger::lease::is_release_reason;
use crate::ledger::quota::DEFAULT_TENANT;
use crate::ledger::target_hold::TargetLimits;

pub use metrics::SqliteLedgerCollector;
pub use options::{DEFAULT_MAX_SIZE, Durability, MIN_MAX_SIZE, SqliteOptions};
pub use schema::SCHEMA_VERSION;
pub use stats::WriterStats;

/// The lease ledger in one SQLite file. Cheap to clone; every clone talks to the same writer.
/// The writer stops when [`shutdown`](SqliteLedger::shutdown) is called or the last clone is
/// dropped, after finishing the writes queued before.
#[derive(Clone)]
pub struct SqliteLedger {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    options: SqliteOptions,
    config: LedgerConfig,
    clock: Arc<dyn Clock>,
    pool: ReaderPool,
    counts: Arc<RwLock<Counts>>,
    queue: SyncSender<Message>,
    shared: Arc<Shared>,
    closed: AtomicBool,
    writer: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for SqliteLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteLedger")
            .field("path", &self.inner.path)
            .field("options", &self.inner.options)
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl SqliteLedger {
    /// Opens (creating if needed) the ledger file at `path`, kept as `options` say, switches
    /// it to WAL, applies pending migrations, loads the lease state into memory and starts the
    /// writer thread.
    /// Refuses a file written by a newer binary. Blocks on SQLite: call it before serving, or
    /// from a blocking thread.
    pub fn open(
        path: &Path,
        options: SqliteOptions,
        config: LedgerConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<SqliteLedger, LedgerError> {
        config.validate()?;
        options.validate()?;
        let (conn, bound) = store::open_writer(path, options.durability, options.max_size)?;
        let now = clock.now().as_millisecond();
        let state = store::load_state(&conn, now, TargetLimits::of(&config)).map_err(|source| {
            LedgerError::Open {
                path: path.to_owned(),
                source,
            }
        })?;
        let counts = Arc::new(RwLock::new(Counts::of(&state, now)));
        let pool = store::reader_pool(path, options.durability)?;
        let (queue, receiver) = sync_channel(config.queue_capacity);
        let shared = Arc::new(
            Shared::new()
                .map_err(|e| LedgerError::Config(format!("ledger writer metrics: {e}")))?,
        );
        let background_path = path.to_owned();
        let durability = options.durability;
        let checkpoints = Checkpoints::start(
            path,
            move || store::checkpoint_connection(&background_path, durability),
            &bound,
            shared.timings.checkpoint.with_label_values(&["writer"]),
            shared.timings.checkpoint.with_label_values(&["background"]),
        )
        .map_err(LedgerError::Writer)?;
        let writer = Writer {
            conn,
            state,
            counts: counts.clone(),
            clock: clock.clone(),
            config: config.clone(),
            queue: receiver,
            shared: shared.clone(),
            space: Space::new(bound),
            checkpoints,
        };
        let thread = std::thread::Builder::new()
            .name("ledger-writer".into())
            .spawn(move || writer.run())
            .map_err(LedgerError::Writer)?;
        Ok(SqliteLedger {
            inner: Arc::new(Inner {
                path: path.to_owned(),
                options,
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

    /// Compares the writer's in-memory state with what the file holds (for tests, and for
    /// investigating a suspected divergence); [`LedgerError::Inconsistent`] says how they
    /// differ.
    pub async fn self_check(&self) -> Result<(), LedgerError> {
        self.submit_and_wait(|reply| Job::SelfCheck { reply }, false)
            .await
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

    /// The lease with this ID on a pooled read connection; blocks.
    fn read(&self, id: &str) -> Result<Option<Lease>, LedgerError> {
        let now = self.now_ms();
        let conn = self.inner.pool.get()?;
        Ok(store::lease_by_id(&conn, id, now)?)
    }

    /// Unmet demand per pool over the last `window` on a pooled read connection; blocks.
    fn read_demand(&self, window: Duration) -> Result<HashMap<String, u64>, LedgerError> {
        let now = self.now_ms();
        let conn = self.inner.pool.get()?;
        Ok(store::recent_demand(&conn, window, now)?)
    }

    /// Runs `read` on a pooled read connection off the async threads.
    async fn on_reader<T: Send + 'static>(
        &self,
        read: impl FnOnce(&rusqlite::Connection, i64) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, LedgerError> {
        let ledger = self.clone();
        tokio::task::spawn_blocking(move || {
            let now = ledger.now_ms();
            let conn = ledger.inner.pool.get()?;
            Ok(read(&conn, now)?)
        })
        .await
        .map_err(|e| LedgerError::Read(e.to_string()))?
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

    fn now_ms(&self) -> i64 {
        self.inner.clock.now().as_millisecond()
    }
}

#[async_trait::async_trait]
impl Ledger for SqliteLedger {
    /// Decided by the writer in arrival order against the leases in memory; answered after the
    /// COMMIT holding the lease. Refused with [`LedgerError::Overloaded`] (nothing decided) when
    /// the queue is full or the write's queue deadline passes; not granted at all when the
    /// caller has gone (dropped this future) before its turn.
    async fn acquire(&self, request: AcquireRequest) -> Result<AcquireOutcome, LedgerError> {
        let ttl_ms = self.inner.config.capped_ttl_ms(request.ttl)?;
        self.call(|reply| Job::Acquire {
            request,
            ttl_ms,
            reply,
        })
        .await
    }

    async fn renew(&self, id: &str, tenant: &str, ttl: Duration) -> Result<Lease, LedgerError> {
        let ttl_ms = self.inner.config.capped_ttl_ms(ttl)?;
        let (id, tenant) = (id.to_owned(), tenant.to_owned());
        self.call(|reply| Job::Renew {
            id,
            tenant,
            ttl_ms,
            reply,
        })
        .await
    }

    async fn release(&self, id: &str, tenant: &str) -> Result<(), LedgerError> {
        let (id, tenant) = (id.to_owned(), tenant.to_owned());
        self.call(|reply| Job::Release { id, tenant, reply }).await
    }

    /// Decided by the writer in a batch like a release, with the same errors (`BatchFailed`,
    /// `Full`: nothing recorded, retry); it has no queue deadline because deciding it late is
    /// harmless, but is refused with [`LedgerError::Overloaded`] when the queue is full.
    async fn end_leases(&self, proxy_uid: &str, reason: &str) -> Result<u64, LedgerError> {
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

    async fn report(
        &self,
        id: &str,
        tenant: &str,
        report: LeaseReport,
    ) -> Result<Lease, LedgerError> {
        let (id, tenant) = (id.to_owned(), tenant.to_owned());
        self.call(|reply| Job::Report {
            id,
            tenant,
            report,
            reply,
        })
        .await
    }

    /// A write like any other, through the writer: it joins the batch queued with it (group
    /// commit), so it never contends with the writer for the file's write lock, and a batch
    /// failure answers it like the rest (`BatchFailed`, `Full`: nothing recorded). Not
    /// housekeeping: it must not run alone, nor take the pages kept back for the sweep.
    ///
    /// No queue deadline, like `end_leases`: deciding it late is harmless (the refusal counts
    /// in the bucket of the moment it is decided, a queue's wait later), and dropping it
    /// while the writer is slow would hide demand exactly when pools are short. It never
    /// refuses an acquire: it is bounded by the queue like every write (refused itself with
    /// [`LedgerError::Overloaded`] when the queue is full, never waiting for room), and in a
    /// batch it costs one small upsert per pool.
    async fn record_demand(&self, pools: &[String]) -> Result<(), LedgerError> {
        if pools.is_empty() {
            return Ok(());
        }
        let pools = demand::distinct_pools(pools)
            .into_iter()
            .map(str::to_owned)
            .collect();
        self.submit_and_wait(|reply| Job::RecordDemand { pools, reply }, false)
            .await
    }

    /// As committed, on a pooled read connection (never waiting for the writer), on a blocking
    /// thread, like `get`.
    async fn recent_demand(&self, window: Duration) -> Result<HashMap<String, u64>, LedgerError> {
        let ledger = self.clone();
        tokio::task::spawn_blocking(move || ledger.read_demand(window))
            .await
            .map_err(|e| LedgerError::Read(e.to_string()))?
    }

    /// A write through the writer like `record_demand`: it joins the batch queued with it,
    /// has no queue deadline (a gateway flushes about once a second, and a late count is
    /// still right), and is refused with [`LedgerError::Overloaded`] when the queue is full.
    /// The tenants' days are the writer's memory, so the answer costs no read.
    async fn record_traffic(
        &self,
        traffic: Vec<TrafficBytes>,
    ) -> Result<HashMap<String, u64>, LedgerError> {
        if traffic.iter().all(|t| t.up == 0 && t.down == 0) {
            return Ok(HashMap::new());
        }
        self.submit_and_wait(|reply| Job::RecordTraffic { traffic, reply }, false)
            .await
    }

    /// As committed, on a pooled read connection, like `activity`.
    async fn traffic(&self, since_ms: i64) -> Result<Vec<TrafficHour>, LedgerError> {
        self.on_reader(move |conn, _| store::traffic(conn, since_ms))
            .await
    }

    /// Housekeeping has no queue deadline: it waits for its turn.
    async fn sweep(&self) -> Result<SweepStats, LedgerError> {
        self.submit_and_wait(|reply| Job::Sweep { reply }, false)
            .await
    }

    /// As committed, on a pooled read connection (never waiting for the writer), on a blocking
    /// thread.
    async fn activity(
        &self,
        window: Duration,
        tenant: Option<String>,
    ) -> Result<Activity, LedgerError> {
        let window = i64::try_from(window.as_millis()).unwrap_or(i64::MAX);
        self.on_reader(move |conn, now| {
            store::activity(conn, now.saturating_sub(window), now, tenant.as_deref())
        })
        .await
    }

    async fn events(&self, query: EventsQuery) -> Result<Vec<EventEntry>, LedgerError> {
        self.on_reader(move |conn, _| store::events(conn, &query))
            .await
    }

    async fn get(&self, id: &str, tenant: &str) -> Result<Option<Lease>, LedgerError> {
        let ledger = self.clone();
        let id = id.to_owned();
        let lease = tokio::task::spawn_blocking(move || ledger.read(&id))
            .await
            .map_err(|e| LedgerError::Read(e.to_string()))??;
        Ok(lease.filter(|lease| lease.tenant == tenant))
    }

    /// The writer runs and a pooled read of the file answers.
    async fn check(&self) -> Result<(), LedgerError> {
        if !self.is_running() {
            return Err(LedgerError::Closed);
        }
        self.get("readyz", DEFAULT_TENANT).await.map(drop)
    }

    /// From memory, as of the last commit: the writer refreshes what a batch touched after
    /// its COMMIT and before answering. A scrape copies the ranking of targets the writer made
    /// at its last commit that changed a cooldown, or ranks them itself once a cooldown
    /// counted there has ended.
    fn counts(&self) -> LedgerCounts<'_> {
        LedgerCounts::new(&*self.inner.counts, &*self.inner.clock)
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
