//! The lease ledger on PostgreSQL (or a database that speaks its protocol), for installs
//! that run several replicas: every replica writes the same database, and the database
//! decides, so any number of them agree.
//!
//! Every write is a transaction in READ COMMITTED (or one statement), with its time from the
//! injected clock as a parameter. Acquires are decided a batch at a time (`batch`): the same
//! [`select`](super::selection) as the SQLite ledger for each acquire in arrival order,
//! starting from this replica's counts, the chosen proxies' rows in `proxy_locks` locked and
//! what is committed checked under those locks; a grant that no longer fits (another
//! replica's batch got there first) is decided again in the next batch on loads read from the
//! database, and a batch that would refuse on the counts is planned again on those loads, so
//! a 409 always comes from a decision on what was committed, never from a skipped lock or a
//! stale count. Statements that do not wait for each other's answers are sent together
//! (`pipelined`): the common batch is one round trip. Releases wait for the same batches, one
//! statement per batch: in the acquires' transaction when it is that one round trip, else
//! beside it.
//! See `docs/architecture.md` for the choices and the clock skew they tolerate.
//!
//! The synchronous counts come from a snapshot refreshed every [`COUNTS_REFRESH`] and moved
//! by this replica's own writes at once (`counts`). The same refresh tells whether the
//! database answers, for `/readyz`'s body and `proxy_operator_ledger_database_up`.

mod batch;
mod connect;
mod counts;
mod metrics;
mod options;
mod pipelined;
mod retry;
mod schema;
mod store;

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use deadpool_postgres::{Pool, PoolError};

pub use metrics::PostgresLedgerCollector;
pub use options::PostgresOptions;
pub use schema::POSTGRES_SCHEMA_VERSION;

use self::batch::{Pending, Verdict};
use self::counts::{Change, Counts};
use self::pipelined::Pipelined;
use self::retry::{Failure, UNAVAILABLE_RETRY_AFTER};
use self::store::{Ended, StoreError};
use super::clock::Clock;
use super::config::LedgerConfig;
use super::counts::LedgerCounts;
use super::demand;
use super::error::LedgerError;
use super::lease::{
    AcquireOutcome, AcquireRequest, Lease, LeaseReport, SweepStats, is_release_reason, new_lease_id,
};
use super::{Activity, DatabaseStatus, EventEntry, EventsQuery, Ledger, TrafficBytes, TrafficHour};

/// How often the counts are read again from the database (other replicas' writes show
/// within this) and the database's state is checked.
pub const COUNTS_REFRESH: Duration = Duration::from_secs(1);
/// Batches an acquire may be decided in when each finds its chosen proxy taken by another
/// replica's batch first; then it is answered `Overloaded`.
const RACE_ATTEMPTS: u32 = 64;

/// A lease ledger in a PostgreSQL database. Clones share the pool and the counts.
#[derive(Clone)]
pub struct PostgresLedger {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Pool,
    config: LedgerConfig,
    clock: Arc<dyn Clock>,
    counts: RwLock<Counts>,
    /// Acquires waiting for their batch (see `batch`).
    acquires: mpsc::Sender<Pending>,
    /// Releases waiting for theirs.
    releases: mpsc::Sender<PendingRelease>,
    /// Where it connects, for logs and errors (no password).
    target: String,
    up: AtomicBool,
    /// Why the last statement that could not reach the database failed.
    last_error: Mutex<Option<String>>,
    /// Acquires decided again because a concurrent one took the chosen proxy, and
    /// transactions the database aborted for a conflict.
    conflicts: AtomicU64,
    /// Batches decided, and the acquires and releases they carried (see `run_batches`).
    batches: AtomicU64,
    batched_writes: AtomicU64,
}

impl std::fmt::Debug for PostgresLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresLedger")
            .field("target", &self.inner.target)
            .finish_non_exhaustive()
    }
}

/// Runs `$attempt` (a future using the pooled connection `$client` that gives its outcome and
/// whether the connection may be pooled again) until [`PostgresLedger::settle`] answers: again
/// after a conflict or a lost connection. A connection that failed is closed rather than
/// pooled again. Macros rather than functions taking closures, so each call's future stays
/// `Send`.
macro_rules! with_retries {
    ($ledger:expr, |$client:ident| $attempt:expr) => {{
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            let result = async {
                #[allow(
                    unused_mut,
                    reason = "a transaction borrows it mutably, a pipeline not"
                )]
                let mut $client = $ledger.inner.pool.get().await.map_err(Attempted::Pool)?;
                let (outcome, reusable): (Result<_, StoreError>, bool) = $attempt.await;
                if !reusable {
                    // Never back to the pool: it is broken, reaches a standby, or is left
                    // inside a transaction.
                    drop(deadpool_postgres::Object::take($client));
                }
                outcome.map_err(Attempted::from)
            }
            .await;
            match $ledger.settle(result, attempt) {
                ControlFlow::Break(answer) => break answer,
                ControlFlow::Continue(wait) => tokio::time::sleep(wait).await,
            }
        }
    }};
}

/// Runs `$work` (a future using the transaction `$tx`) in a transaction and commits when it
/// returns `Ok`, with the retries of [`with_retries!`]; a `$work` that fails rolls the
/// transaction back.
macro_rules! in_transaction {
    ($ledger:expr, |$tx:ident| $work:expr) => {
        with_retries!($ledger, |client| async {
            let outcome = async {
                let $tx = client.transaction().await?;
                let value = $work.await?;
                $tx.commit().await?;
                Ok::<_, StoreError>(value)
            }
            .await;
            let reusable = !outcome.as_ref().is_err_and(StoreError::breaks_connection);
            (outcome, reusable)
        })
    };
}

/// Runs `$work` (a future using the [`Pipelined`] connection `$conn`, which opens and commits
/// its transaction itself, if it needs one) with the retries of [`with_retries!`].
macro_rules! on_connection {
    ($ledger:expr, |$conn:ident| $work:expr) => {
        with_retries!($ledger, |client| async {
            let $conn = Pipelined::new(&client);
            let outcome = $work.await;
            let reusable = $conn.finish(&outcome).await;
            (outcome, reusable)
        })
    };
}

impl PostgresLedger {
    /// Connects to the database `url` names (what it leaves out from `PG*`), applies pending
    /// migrations under the schema row's lock, reads the counts, and starts refreshing them.
    /// Must be called inside a Tokio runtime.
    pub async fn open(
        url: &str,
        options: PostgresOptions,
        config: LedgerConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<PostgresLedger, LedgerError> {
        config.validate()?;
        let resolved = connect::resolve(url, |name| std::env::var(name).ok(), options.password)
            .map_err(|e| LedgerError::Config(format!("{}: {e}", super::location::redact(url))))?;
        let target = connect::describe(&resolved.config);
        let pool = connect::pool(&resolved, options.pool_size.max(1), config.queue_deadline)
            .map_err(|e| LedgerError::Config(format!("{target}: {e}")))?;
        let unreachable = |e: String| LedgerError::Connect(format!("{target}: {e}"));
        let mut client = pool.get().await.map_err(|e| unreachable(pool_error(&e)))?;
        let applied = schema::migrate(&mut client, &target)
            .await
            .map_err(LedgerError::Connect)?;
        drop(client);
        // Every connection made now, not by the first burst of acquires, which would wait
        // for logins past their deadline and be answered 503.
        let connections: Vec<_> =
            futures::future::join_all((0..pool.status().max_size).map(|_| pool.get()))
                .await
                .into_iter()
                .collect::<Result<_, _>>()
                .map_err(|e| unreachable(pool_error(&e)))?;
        drop(connections);
        log::info!(
            "ledger: PostgreSQL, {target}, schema version {POSTGRES_SCHEMA_VERSION} ({applied} \
             migrations applied), TLS {}",
            if resolved.tls { "required" } else { "off" }
        );
        let (acquires, queued_acquires) = mpsc::channel(config.queue_capacity);
        let (releases, queued_releases) = mpsc::channel(config.queue_capacity);
        let ledger = PostgresLedger {
            inner: Arc::new(Inner {
                pool,
                config,
                clock,
                counts: RwLock::new(Counts::default()),
                acquires,
                releases,
                target,
                up: AtomicBool::new(true),
                last_error: Mutex::new(None),
                conflicts: AtomicU64::new(0),
                batches: AtomicU64::new(0),
                batched_writes: AtomicU64::new(0),
            }),
        };
        ledger.refresh().await?;
        tokio::spawn(refresh_counts(Arc::downgrade(&ledger.inner)));
        tokio::spawn(run_batches(
            Arc::downgrade(&ledger.inner),
            queued_acquires,
            queued_releases,
        ));
        Ok(ledger)
    }

    fn now_ms(&self) -> i64 {
        self.inner.clock.now().as_millisecond()
    }

    fn read_counts(&self) -> std::sync::RwLockReadGuard<'_, Counts> {
        self.inner
            .counts
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn change(&self, change: Change) {
        self.inner
            .counts
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .change(change);
    }

    /// Transactions decided again after a conflict with another replica's.
    pub fn conflicts(&self) -> u64 {
        self.inner.conflicts.load(Ordering::Relaxed)
    }

    /// Batches this replica decided so far, and the acquires and releases they carried: their
    /// ratio is how much one batch's transaction amortises.
    pub fn batched(&self) -> (u64, u64) {
        (
            self.inner.batches.load(Ordering::Relaxed),
            self.inner.batched_writes.load(Ordering::Relaxed),
        )
    }

    fn mark(&self, result: Result<(), String>) {
        let up = result.is_ok();
        if self.inner.up.swap(up, Ordering::Relaxed) != up {
            match &result {
                Ok(()) => log::info!("ledger: the database {} answers again", self.inner.target),
                Err(e) => log::warn!("ledger: the database does not answer: {e}"),
            }
        }
        if let Err(e) = result {
            *self
                .inner
                .last_error
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(e);
        }
    }

    /// What to do after attempt number `attempt` of a transaction ended with `result`:
    /// answer, or wait and try again (a conflict or a lost connection, within the bounds of
    /// `retry`).
    fn settle<T>(
        &self,
        result: Result<T, Attempted>,
        attempt: u32,
    ) -> ControlFlow<Result<T, LedgerError>, Duration> {
        let (failure, message) = match result {
            Ok(value) => {
                self.mark(Ok(()));
                return ControlFlow::Break(Ok(value));
            }
            Err(Attempted::Answer(error)) => return ControlFlow::Break(Err(error)),
            Err(Attempted::Pool(PoolError::Timeout(deadpool_postgres::TimeoutType::Wait))) => {
                return ControlFlow::Break(Err(LedgerError::Overloaded {
                    retry_after: UNAVAILABLE_RETRY_AFTER,
                }));
            }
            Err(Attempted::Pool(error)) => (Failure::Connection, pool_error(&error)),
            Err(Attempted::Db(error)) => (Failure::of(&error), connect::explain(&error)),
        };
        match failure {
            Failure::Conflict => {
                self.inner.conflicts.fetch_add(1, Ordering::Relaxed);
            }
            Failure::Connection => self.mark(Err(message.clone())),
            Failure::Full => {
                return ControlFlow::Break(Err(LedgerError::Full {
                    retry_after: UNAVAILABLE_RETRY_AFTER,
                }));
            }
            Failure::Other => return ControlFlow::Break(Err(LedgerError::Postgres(message))),
        }
        if attempt >= failure.attempts() {
            return ControlFlow::Break(Err(match failure {
                Failure::Conflict => LedgerError::Overloaded {
                    retry_after: Duration::from_millis(100),
                },
                _ => LedgerError::Unavailable {
                    retry_after: UNAVAILABLE_RETRY_AFTER,
                    reason: message,
                },
            }));
        }
        ControlFlow::Continue(failure.backoff(attempt + 1))
    }

    /// Reads the counts again, and whether the database answers.
    async fn refresh(&self) -> Result<(), LedgerError> {
        let began = self.read_counts().begin_refresh();
        let now = self.now_ms();
        let snapshot = in_transaction!(self, |tx| store::counting(&tx, now))?;
        self.inner
            .counts
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .finish_refresh(began, snapshot);
        Ok(())
    }
}

/// Why one attempt failed.
enum Attempted {
    Pool(PoolError),
    Db(tokio_postgres::Error),
    Answer(LedgerError),
}

impl From<StoreError> for Attempted {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::Db(e) => Attempted::Db(e),
            StoreError::Ledger(e) => Attempted::Answer(e),
        }
    }
}

fn pool_error(error: &PoolError) -> String {
    match error {
        PoolError::Backend(e) => connect::explain(e),
        other => other.to_string(),
    }
}

/// Refreshes the counts every [`COUNTS_REFRESH`] until the ledger is dropped.
async fn refresh_counts(inner: Weak<Inner>) {
    let mut ticker = tokio::time::interval(COUNTS_REFRESH);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    loop {
        ticker.tick().await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let ledger = PostgresLedger { inner };
        if let Err(e) = ledger.refresh().await {
            log::debug!("ledger: refreshing the counts failed: {e}");
        }
    }
}

/// A release waiting for its batch.
struct PendingRelease {
    id: String,
    tenant: String,
    reply: oneshot::Sender<Result<(), LedgerError>>,
}

/// Decides what is queued, one batch at a time, until the ledger is dropped and both queues
/// are drained: the acquires decided again first, then those that arrived while the last batch
/// ran (up to `max_batch`), and the releases that arrived meanwhile (as many).
///
/// One batch at a time, so each starts from the counts the one before left and concurrent
/// acquires spread over proxies as on SQLite, and each collects what arrived while the last
/// ran: fewer, larger statements. Acquires and releases in one batch, so that in the common
/// case a replica commits once per batch, not once for its acquires and once for its releases
/// (on the API bench, 3–8 % more pairs/s for one replica, 5–15 % for three, a tenth less CPU
/// per pair; two release batches at once had cost one replica a tenth of its pairs/s).
async fn run_batches(
    inner: Weak<Inner>,
    mut acquires: mpsc::Receiver<Pending>,
    mut releases: mpsc::Receiver<PendingRelease>,
) {
    let mut again: Vec<Pending> = Vec::new();
    let (mut acquires_open, mut releases_open) = (true, true);
    loop {
        let mut batch = std::mem::take(&mut again);
        let mut released: Vec<PendingRelease> = Vec::new();
        if batch.is_empty() {
            tokio::select! {
                acquire = acquires.recv(), if acquires_open => match acquire {
                    Some(acquire) => batch.push(acquire),
                    None => acquires_open = false,
                },
                release = releases.recv(), if releases_open => match release {
                    Some(release) => released.push(release),
                    None => releases_open = false,
                },
                else => return,
            }
        }
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let ledger = PostgresLedger { inner };
        let max_batch = ledger.inner.config.max_batch;
        while batch.len() < max_batch {
            match acquires.try_recv() {
                Ok(acquire) => batch.push(acquire),
                Err(_) => break,
            }
        }
        while released.len() < max_batch {
            match releases.try_recv() {
                Ok(release) => released.push(release),
                Err(_) => break,
            }
        }
        if batch.is_empty() && released.is_empty() {
            continue;
        }
        ledger.inner.batches.fetch_add(1, Ordering::Relaxed);
        let writes = u64::try_from(batch.len() + released.len()).unwrap_or(u64::MAX);
        ledger
            .inner
            .batched_writes
            .fetch_add(writes, Ordering::Relaxed);
        again = ledger.decide(batch, released).await;
    }
}

/// The leases `releases` name, for a batch's release statement.
fn releasing(releases: &[PendingRelease]) -> batch::Releasing<'_> {
    let (ids, tenants) = releases
        .iter()
        .map(|r| (r.id.as_str(), r.tenant.as_str()))
        .unzip();
    batch::Releasing { ids, tenants }
}

/// Queues `write`; a full queue refuses at once, as SQLite's does (nothing was decided).
fn enqueue<T>(queue: &mpsc::Sender<T>, write: T) -> Result<(), LedgerError> {
    queue.try_send(write).map_err(|e| match e {
        mpsc::error::TrySendError::Full(_) => LedgerError::Overloaded {
            retry_after: UNAVAILABLE_RETRY_AFTER,
        },
        mpsc::error::TrySendError::Closed(_) => LedgerError::Closed,
    })
}

impl PostgresLedger {
    /// Decides one batch of acquires and releases and answers what it decided; returns the
    /// acquires to decide again in the next batch. The releases commit in the acquires'
    /// transaction when it is the common one round trip (`batch::at_once`), else beside it on
    /// a connection of their own, so they never wait for a tenant's or a target's checks.
    async fn decide(&self, batch: Vec<Pending>, releases: Vec<PendingRelease>) -> Vec<Pending> {
        let deadline = self.inner.config.queue_deadline;
        let (late, batch): (Vec<Pending>, Vec<Pending>) = batch
            .into_iter()
            .partition(|p| p.retries == 0 && p.queued_at.elapsed() > deadline);
        for pending in late {
            // Waited past its deadline: refused before anything was decided for it.
            let _ = pending.reply.send(Err(LedgerError::Overloaded {
                retry_after: UNAVAILABLE_RETRY_AFTER,
            }));
        }
        let together = !batch.is_empty() && batch::at_once(&batch, &self.inner.config);
        let (with_grants, apart) = match together {
            true => (releases, Vec::new()),
            false => (Vec::new(), releases),
        };
        let (again, ()) = tokio::join!(
            self.decide_acquires(batch, with_grants),
            self.release_apart(apart)
        );
        again
    }

    /// Decides `batch` in one transaction, with `releases` (when it is decided at once).
    async fn decide_acquires(
        &self,
        batch: Vec<Pending>,
        releases: Vec<PendingRelease>,
    ) -> Vec<Pending> {
        if batch.is_empty() {
            return Vec::new();
        }
        let now = self.now_ms();
        let config = &self.inner.config;
        let releasing = releasing(&releases);
        // An acquire decided again lost a race to another replica's grant that the counts
        // may not show yet: that batch starts from the database's loads.
        let snapshot = batch
            .iter()
            .all(|p| p.retries == 0)
            .then(|| self.read_counts().loads(now));
        let attempted = AtomicBool::new(false);
        let decided = on_connection!(self, |conn| batch::decide(
            &conn,
            &batch,
            &releasing,
            config,
            snapshot.clone(),
            attempted.swap(true, Ordering::Relaxed),
            now
        ));
        let verdicts = match decided {
            Ok(decided) => {
                self.answer_releases(releases, Ok(&decided.released));
                decided.verdicts
            }
            Err(error) => {
                log::debug!("ledger: a batch failed: {error}");
                self.answer_releases(releases, Err(&error));
                for pending in batch {
                    let _ = pending.reply.send(Err(error.shared()));
                }
                return Vec::new();
            }
        };
        let mut again = Vec::new();
        for (mut pending, verdict) in batch.into_iter().zip(verdicts) {
            match verdict {
                Verdict::Answer(answer) => {
                    if let Ok(AcquireOutcome::Granted(lease)) = &answer {
                        self.change(Change::Lease {
                            id: lease.id.as_str().into(),
                            uid: lease.proxy.uid.as_str().into(),
                            expires_at: lease.expires_at.as_millisecond(),
                            tenant: lease.tenant.as_str().into(),
                            session: lease.session.is_some(),
                        });
                    }
                    let _ = pending.reply.send(answer);
                }
                Verdict::Again if pending.retries + 1 >= RACE_ATTEMPTS => {
                    let _ = pending.reply.send(Err(LedgerError::Overloaded {
                        retry_after: Duration::from_millis(100),
                    }));
                }
                Verdict::Again => {
                    self.inner.conflicts.fetch_add(1, Ordering::Relaxed);
                    pending.retries += 1;
                    again.push(pending);
                }
            }
        }
        again
    }

    /// Releases a batch in one statement of its own (nothing when it is empty).
    async fn release_apart(&self, releases: Vec<PendingRelease>) {
        if releases.is_empty() {
            return;
        }
        let now = self.now_ms();
        let releasing = releasing(&releases);
        let released = on_connection!(self, |conn| batch::release(conn.client(), &releasing, now));
        if let Err(error) = &released {
            log::debug!("ledger: a batch of releases failed: {error}");
        }
        self.answer_releases(releases, released.as_deref());
    }

    /// Moves the counts by the leases a batch's releases ended, and answers them; a release is
    /// never decided again.
    fn answer_releases(
        &self,
        releases: Vec<PendingRelease>,
        ended: Result<&[(String, String)], &LedgerError>,
    ) {
        for (_, id) in ended.unwrap_or_default() {
            self.change(Change::Ended {
                id: id.as_str().into(),
            });
        }
        for release in releases {
            let _ = release
                .reply
                .send(ended.map(|_| ()).map_err(LedgerError::shared));
        }
    }
}

#[async_trait::async_trait]
impl Ledger for PostgresLedger {
    /// Queued for the next batch (see `batch`); answered once that batch committed.
    async fn acquire(&self, request: AcquireRequest) -> Result<AcquireOutcome, LedgerError> {
        let ttl_ms = self.inner.config.capped_ttl_ms(request.ttl)?;
        let (reply, answer) = oneshot::channel();
        let pending = Pending {
            request,
            ttl_ms,
            id: new_lease_id(self.now_ms()),
            retries: 0,
            queued_at: Instant::now(),
            reply,
        };
        enqueue(&self.inner.acquires, pending)?;
        answer.await.map_err(|_| LedgerError::Closed)?
    }

    async fn renew(&self, id: &str, tenant: &str, ttl: Duration) -> Result<Lease, LedgerError> {
        let ttl_ms = self.inner.config.capped_ttl_ms(ttl)?;
        let now = self.now_ms();
        let lease = in_transaction!(self, |tx| store::renew(&tx, id, tenant, ttl_ms, now))?;
        self.change(Change::Lease {
            id: id.into(),
            uid: lease.proxy.uid.as_str().into(),
            expires_at: lease.expires_at.as_millisecond(),
            tenant: lease.tenant.as_str().into(),
            session: lease.session.is_some(),
        });
        Ok(lease)
    }

    /// Queued for the next batch of releases, answered once it committed.
    async fn release(&self, id: &str, tenant: &str) -> Result<(), LedgerError> {
        let (reply, answer) = oneshot::channel();
        let release = PendingRelease {
            id: id.to_owned(),
            tenant: tenant.to_owned(),
            reply,
        };
        enqueue(&self.inner.releases, release)?;
        answer.await.map_err(|_| LedgerError::Closed)?
    }

    async fn end_leases(&self, proxy_uid: &str, reason: &str) -> Result<u64, LedgerError> {
        if !is_release_reason(reason) {
            return Err(LedgerError::InvalidReason(reason.to_owned()));
        }
        let now = self.now_ms();
        let released = on_connection!(self, |conn| store::release(
            conn.client(),
            Ended::Proxy(proxy_uid),
            Some(reason),
            now
        ))?;
        let count = u64::try_from(released.len()).unwrap_or(u64::MAX);
        for (_, id) in released {
            self.change(Change::Ended { id: id.into() });
        }
        Ok(count)
    }

    async fn report(
        &self,
        id: &str,
        tenant: &str,
        report: LeaseReport,
    ) -> Result<Lease, LedgerError> {
        let now = self.now_ms();
        let config = &self.inner.config;
        let (lease, cooldown) = in_transaction!(self, |tx| store::report(
            &tx, config, id, tenant, &report, now
        ))?;
        if let Some((target, until)) = cooldown {
            self.change(Change::Cooldown {
                uid: report.cooled(&lease.proxy.uid).as_ref().into(),
                target: target.into(),
                until,
            });
        }
        Ok(lease)
    }

    /// One statement on a pooled connection, like `end_leases`: every replica counts into the
    /// same rows, so the leader reads every replica's refusals. Waits at most the queue
    /// deadline for a connection (then `Overloaded`), like the writes outside the batches;
    /// tried again on a fresh connection after a lost one, which may count a refusal twice
    /// when the first attempt committed unanswered: harmless for demand.
    async fn record_demand(&self, pools: &[String]) -> Result<(), LedgerError> {
        if pools.is_empty() {
            return Ok(());
        }
        let pools = demand::distinct_pools(pools);
        let now = self.now_ms();
        on_connection!(self, |conn| store::record_demand(
            conn.client(),
            &pools,
            now
        ))
    }

    async fn recent_demand(&self, window: Duration) -> Result<HashMap<String, u64>, LedgerError> {
        let now = self.now_ms();
        on_connection!(self, |conn| store::recent_demand(
            conn.client(),
            window,
            now
        ))
    }

    /// One transaction on a pooled connection, like `report`: every replica adds to the same
    /// rows. Tried again on a fresh connection after a lost one, which may count bytes twice
    /// when the first attempt committed unanswered.
    async fn record_traffic(
        &self,
        traffic: Vec<TrafficBytes>,
    ) -> Result<HashMap<String, u64>, LedgerError> {
        if traffic.iter().all(|t| t.up == 0 && t.down == 0) {
            return Ok(HashMap::new());
        }
        let now = self.now_ms();
        in_transaction!(self, |tx| store::record_traffic(&tx, &traffic, now))
    }

    async fn traffic(&self, since_ms: i64) -> Result<Vec<TrafficHour>, LedgerError> {
        on_connection!(self, |conn| store::traffic(conn.client(), since_ms))
    }

    /// Safe on every replica at once (see `store::sweep`).
    async fn sweep(&self) -> Result<SweepStats, LedgerError> {
        let now = self.now_ms();
        let config = &self.inner.config;
        in_transaction!(self, |tx| store::sweep(&tx, config, now))
    }

    async fn activity(
        &self,
        window: Duration,
        tenant: Option<String>,
    ) -> Result<Activity, LedgerError> {
        let now = self.now_ms();
        let since = now.saturating_sub(i64::try_from(window.as_millis()).unwrap_or(i64::MAX));
        on_connection!(self, |conn| store::activity(
            conn.client(),
            since,
            now,
            tenant.as_deref()
        ))
    }

    async fn events(&self, query: EventsQuery) -> Result<Vec<EventEntry>, LedgerError> {
        on_connection!(self, |conn| store::events(conn.client(), &query))
    }

    async fn get(&self, id: &str, tenant: &str) -> Result<Option<Lease>, LedgerError> {
        let now = self.now_ms();
        on_connection!(self, |conn| store::lease_by_id(
            conn.client(),
            id,
            tenant,
            now
        ))
    }

    /// Always ready: a database that does not answer affects every replica alike, so taking
    /// this one out of the Service would help no crawler; writes answer 503 meanwhile, and
    /// [`database`](Ledger::database) says why.
    async fn check(&self) -> Result<(), LedgerError> {
        Ok(())
    }

    fn database(&self) -> Option<DatabaseStatus> {
        let up = self.inner.up.load(Ordering::Relaxed);
        let error = (!up)
            .then(|| {
                self.inner
                    .last_error
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .clone()
            })
            .flatten();
        Some(DatabaseStatus { up, error })
    }

    /// From the snapshot (see the module docs).
    fn counts(&self) -> LedgerCounts<'_> {
        LedgerCounts::new(&self.inner.counts, &*self.inner.clock)
    }
}
