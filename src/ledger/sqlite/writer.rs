//! The ledger writer: one thread that owns the write connection and the lease state, takes
//! writes from a bounded queue in arrival order, and commits everything queued at that moment
//! in one transaction (group commit), answering each caller only after that COMMIT.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use rusqlite::Connection;
use tokio::sync::oneshot;

use super::checkpoint::Checkpoints;
use super::counts::Counts;
use super::space::{self, Space, is_full};
use super::state::{AcquireDecision, ActiveLease, LedgerState, RenewOutcome};
use super::stats::Shared;
use super::store;
use crate::ledger::clock::Clock;
use crate::ledger::config::{LedgerConfig, millis};
use crate::ledger::error::LedgerError;
use crate::ledger::lease::{
    AcquireOutcome, AcquireRequest, Lease, LeaseReport, LeaseState, SweepStats, new_lease_id,
};
use crate::ledger::traffic::TrafficBytes;

/// Where a write's answer goes.
pub(crate) type Reply<T> = oneshot::Sender<Result<T, LedgerError>>;

/// One write for the writer.
pub(crate) enum Job {
    Acquire {
        request: AcquireRequest,
        ttl_ms: i64,
        reply: Reply<AcquireOutcome>,
    },
    Renew {
        id: String,
        tenant: String,
        ttl_ms: i64,
        reply: Reply<Lease>,
    },
    Release {
        id: String,
        tenant: String,
        reply: Reply<()>,
    },
    /// The operator ends every counting lease of one proxy (its machine is lost or gone).
    EndLeases {
        proxy_uid: String,
        reason: String,
        reply: Reply<u64>,
    },
    Report {
        id: String,
        tenant: String,
        report: LeaseReport,
        reply: Reply<Lease>,
    },
    /// One refused request a member of each of `pools` (distinct) would have served.
    RecordDemand {
        pools: Vec<String>,
        reply: Reply<()>,
    },
    /// Bytes a gateway relayed since its last flush.
    RecordTraffic {
        traffic: Vec<TrafficBytes>,
        reply: Reply<HashMap<String, u64>>,
    },
    Sweep {
        reply: Reply<SweepStats>,
    },
    SelfCheck {
        reply: Reply<()>,
    },
}

/// A write taken from the queue, with its deadline.
pub(super) type Queued = (Job, Option<Duration>);

/// What travels through the queue.
#[expect(
    clippy::large_enum_variant,
    reason = "one message per write, moved once through the queue; boxing would allocate per write"
)]
pub(crate) enum Message {
    /// A write and the moment (on the clock's monotonic time) past which it is refused
    /// instead of decided; housekeeping has none.
    Job {
        job: Job,
        deadline: Option<Duration>,
    },
    /// Finish what is queued before this, then stop.
    Stop,
}

/// Why a batch's transaction failed; every write of the batch is answered with it.
#[derive(Debug, Clone)]
pub(super) enum BatchError {
    /// SQLITE_FULL: the disk is full or the file reached its page limit.
    Full { retry_after: Duration },
    /// Anything else.
    Failed(Arc<rusqlite::Error>),
}

impl BatchError {
    fn to_ledger_error(&self) -> LedgerError {
        match self {
            BatchError::Full { retry_after } => LedgerError::Full {
                retry_after: *retry_after,
            },
            BatchError::Failed(error) => LedgerError::BatchFailed(error.clone()),
        }
    }
}

/// Answers one write once its batch's fate is known: with its own result after a COMMIT, with
/// the batch's error otherwise.
type Settle = Box<dyn FnOnce(Option<&BatchError>) + Send>;

fn settle<T: Send + 'static>(reply: Reply<T>, result: Result<T, LedgerError>) -> Settle {
    Box::new(move |failed| {
        let answer = match failed {
            Some(error) => Err(error.to_ledger_error()),
            None => result,
        };
        // The caller may have gone; then nobody needs the answer.
        let _ = reply.send(answer);
    })
}

/// A write's own answer, or the statement error that aborts its batch.
type Decision<T> = Result<Result<T, LedgerError>, rusqlite::Error>;

/// How to answer a decided write, and the error that aborts the batch if it has one (the write
/// is then answered with the batch's error like the others).
fn answer<T: Send + 'static>(
    reply: Reply<T>,
    decision: Decision<T>,
) -> (Option<Settle>, Option<rusqlite::Error>) {
    match decision {
        Ok(result) => (Some(settle(reply, result)), None),
        Err(error) => (Some(settle(reply, Err(LedgerError::Closed))), Some(error)),
    }
}

impl Job {
    /// Answers the write at once with `error` (it was not decided).
    fn refuse(self, error: impl FnOnce() -> LedgerError) {
        fn send<T>(reply: Reply<T>, error: LedgerError) {
            let _ = reply.send(Err(error));
        }
        match self {
            Job::Acquire { reply, .. } => send(reply, error()),
            Job::Renew { reply, .. } | Job::Report { reply, .. } => send(reply, error()),
            Job::Release { reply, .. } | Job::SelfCheck { reply } => send(reply, error()),
            Job::RecordDemand { reply, .. } => send(reply, error()),
            Job::RecordTraffic { reply, .. } => send(reply, error()),
            Job::Sweep { reply } => send(reply, error()),
            Job::EndLeases { reply, .. } => send(reply, error()),
        }
    }

    /// Housekeeping frees space, so it runs alone in its own transaction, where it may use
    /// the pages kept back from client writes.
    fn is_housekeeping(&self) -> bool {
        matches!(self, Job::Sweep { .. })
    }
}

/// The writer thread's state.
pub(crate) struct Writer {
    pub conn: Connection,
    pub state: LedgerState,
    pub counts: Arc<RwLock<Counts>>,
    pub clock: Arc<dyn Clock>,
    pub config: LedgerConfig,
    pub queue: Receiver<Message>,
    pub shared: Arc<Shared>,
    /// Where the writer stands with the size bound.
    pub space: Space,
    /// Keeps the WAL within its allowance without making writes wait for whole checkpoints.
    pub checkpoints: Checkpoints,
}

/// How long an overloaded caller is told to wait: the smallest `Retry-After` the API can say.
/// A healthy writer drains a full queue well within it.
pub(crate) const OVERLOADED_RETRY_AFTER: Duration = Duration::from_secs(1);

impl Writer {
    /// Serves batches until told to stop or every handle is gone.
    pub fn run(mut self) {
        // A file over a lowered bound is pruned while no write waits.
        self.after_batch();
        let mut stopping = false;
        // A housekeeping job met while collecting a batch; it runs next, on its own.
        let mut next: Option<Queued> = None;
        loop {
            let first = match next.take() {
                Some(queued) => queued,
                None if stopping => break,
                None => match self.next_message() {
                    Some(Message::Job { job, deadline }) => {
                        self.shared.depth.fetch_sub(1, Ordering::Relaxed);
                        (job, deadline)
                    }
                    Some(Message::Stop) | None => break,
                },
            };
            if first.0.is_housekeeping() {
                self.housekeeping(first);
                self.after_batch();
                continue;
            }
            // Begin before collecting the batch: whatever queues while the transaction waits
            // for the file's write lock joins this batch.
            let timer = self.shared.timings.batch.start_timer();
            let begun = self.conn.execute_batch("BEGIN IMMEDIATE");
            let mut batch = vec![first];
            while batch.len() < self.config.max_batch {
                match self.queue.try_recv() {
                    Ok(Message::Job { job, deadline }) => {
                        self.shared.depth.fetch_sub(1, Ordering::Relaxed);
                        if job.is_housekeeping() {
                            next = Some((job, deadline));
                            break;
                        }
                        batch.push((job, deadline));
                    }
                    Ok(Message::Stop) => {
                        stopping = true;
                        break;
                    }
                    Err(_) => break,
                }
            }
            self.shared.note_batch(batch.len());
            match begun {
                Ok(()) => self.run_batch(batch),
                Err(error) => self.fail(error, Vec::new(), batch),
            }
            timer.observe_duration();
            self.after_batch();
        }
        log::debug!("ledger writer stopped");
    }

    /// Decides the batch's writes in order inside the open transaction and commits them.
    pub(super) fn run_batch(&mut self, batch: Vec<Queued>) {
        let mut settled: Vec<Settle> = Vec::with_capacity(batch.len());
        let mut jobs = batch.into_iter();
        while let Some((job, deadline)) = jobs.next() {
            if deadline.is_some_and(|d| self.clock.monotonic() >= d) {
                self.shared.count(|s| s.refused_deadline += 1);
                job.refuse(|| LedgerError::Overloaded {
                    retry_after: OVERLOADED_RETRY_AFTER,
                });
                continue;
            }
            let (answer, failed) = self.decide(job);
            settled.extend(answer);
            if let Some(error) = failed {
                self.fail(error, settled, jobs.collect());
                return;
            }
        }
        let timer = self.shared.timings.commit.start_timer();
        let committed = self.conn.execute_batch("COMMIT");
        timer.observe_duration();
        if let Err(error) = committed {
            self.fail(error, settled, Vec::new());
            return;
        }
        self.space.writable_again(self.clock.as_ref());
        let touched = self.state.commit();
        if !touched.proxies.is_empty() || !touched.cooldowns.is_empty() {
            let now = self.clock.now().as_millisecond();
            self.counts
                .write()
                .unwrap_or_else(PoisonError::into_inner)
                .refresh(&self.state, &touched, now);
        }
        for settle in settled {
            settle(None);
        }
    }

    /// Rolls the file and memory back and answers every write of the batch with `error` (a
    /// full ledger as such, see [`Writer::full`]).
    pub(super) fn fail(
        &mut self,
        error: rusqlite::Error,
        settled: Vec<Settle>,
        undecided: Vec<Queued>,
    ) {
        // SQLite may have rolled the transaction back itself (it does on a full disk).
        if !self.conn.is_autocommit()
            && let Err(rollback) = self.conn.execute_batch("ROLLBACK")
        {
            log::error!("ledger rollback failed: {rollback}");
        }
        self.state.rollback();
        let error = if is_full(&error) {
            let parts = space::WriterParts {
                conn: &self.conn,
                shared: &self.shared,
                clock: self.clock.as_ref(),
            };
            BatchError::Full {
                retry_after: self.space.full(&parts, &error),
            }
        } else {
            log::error!("ledger batch failed, rolled back: {error}");
            self.shared.count(|s| s.failed_batches += 1);
            BatchError::Failed(Arc::new(error))
        };
        for settle in settled {
            settle(Some(&error));
        }
        for (job, _) in undecided {
            job.refuse(|| error.to_ledger_error());
        }
    }

    /// Decides one write against the state and runs its statements. Returns how to answer
    /// it (none when nobody waits for the answer) and the error that aborts the batch, if a
    /// statement failed.
    fn decide(&mut self, job: Job) -> (Option<Settle>, Option<rusqlite::Error>) {
        let now = self.clock.now().as_millisecond();
        match job {
            Job::Acquire {
                request,
                ttl_ms,
                reply,
            } => {
                if reply.is_closed() {
                    self.shared.count(|s| s.abandoned += 1);
                    return (None, None);
                }
                answer(reply, self.acquire(&request, ttl_ms, now))
            }
            Job::Renew {
                id,
                tenant,
                ttl_ms,
                reply,
            } => answer(reply, self.renew(&id, &tenant, ttl_ms, now)),
            Job::Release { id, tenant, reply } => answer(reply, self.release(&id, &tenant, now)),
            Job::EndLeases {
                proxy_uid,
                reason,
                reply,
            } => answer(reply, self.end_leases(&proxy_uid, &reason, now)),
            Job::Report {
                id,
                tenant,
                report,
                reply,
            } => answer(reply, self.report(&id, &tenant, &report, now)),
            Job::RecordDemand { pools, reply } => answer(reply, self.record_demand(&pools, now)),
            Job::RecordTraffic { traffic, reply } => {
                answer(reply, self.record_traffic(&traffic, now))
            }
            Job::Sweep { reply } => answer(reply, self.sweep(now)),
            Job::SelfCheck { reply } => answer(reply, self.self_check(now)),
        }
    }

    fn release(&mut self, id: &str, tenant: &str, now: i64) -> Decision<()> {
        if let Some(lease) = self.state.release(id, tenant, now) {
            store::release_lease(&self.conn, id, &lease, now, None)?;
        }
        Ok(Ok(()))
    }

    /// Releases every counting lease of the proxy with `reason`, like as many releases in
    /// this batch: memory changes through the journal, so a failed batch undoes it.
    fn end_leases(&mut self, uid: &str, reason: &str, now: i64) -> Decision<u64> {
        let ended = self.state.end_leases(uid, now);
        store::end_leases(&self.conn, &ended, reason, now)?;
        Ok(Ok(u64::try_from(ended.len()).unwrap_or(u64::MAX)))
    }

    /// Counts a refusal for each pool in the bucket holding `now`. Memory holds no demand, so
    /// nothing is journalled: a failed batch rolls the rows back with the rest.
    fn record_demand(&self, pools: &[String], now: i64) -> Decision<()> {
        store::record_demand(&self.conn, pools, now)?;
        Ok(Ok(()))
    }

    /// Adds a gateway's bytes to the hour's rows and the tenants' days (journalled, so a failed
    /// batch undoes both); answers each tenant's bytes today.
    fn record_traffic(
        &mut self,
        traffic: &[TrafficBytes],
        now: i64,
    ) -> Decision<HashMap<String, u64>> {
        let added = store::record_traffic(&self.conn, traffic, now)?;
        Ok(Ok(added
            .into_iter()
            .map(|(tenant, bytes)| {
                let today = self.state.count_bytes(&tenant, bytes, now);
                (tenant, today)
            })
            .collect()))
    }

    /// Marks expired leases and prunes what is past its time. When even the housekeeping page
    /// limit is too small for the `expired` history rows, the expiries are marked without them
    /// (history is what pruning would delete first anyway), so leases that ended always stop
    /// taking room.
    fn sweep(&mut self, now: i64) -> Decision<SweepStats> {
        let sweep = |expiry_events| {
            store::sweep(
                &self.conn,
                now,
                millis(self.config.cooldown),
                millis(self.config.history_retention),
                expiry_events,
            )
        };
        self.conn.execute_batch("SAVEPOINT sweep")?;
        let stats = match sweep(true) {
            Err(error) if is_full(&error) && !self.conn.is_autocommit() => {
                self.conn
                    .execute_batch("ROLLBACK TO sweep; RELEASE sweep")?;
                let stats = sweep(false)?;
                if stats.expired > 0 {
                    log::warn!(
                        "ledger full: marked {} leases expired without their history rows",
                        stats.expired
                    );
                }
                stats
            }
            result => {
                let stats = result?;
                self.conn.execute_batch("RELEASE sweep")?;
                stats
            }
        };
        let swept = self.state.sweep(now);
        if swept.expired != stats.expired || swept.cooldowns != stats.cooldowns_pruned {
            log::error!(
                "ledger sweep: memory expired {} leases and {} cooldowns, the file {} and {}",
                swept.expired,
                swept.cooldowns,
                stats.expired,
                stats.cooldowns_pruned
            );
        }
        Ok(Ok(stats))
    }

    fn self_check(&mut self, now: i64) -> Decision<()> {
        let file = store::load_state(&self.conn, now, self.state.limits())?.summary(now);
        let memory = self.state.summary(now);
        Ok(if file == memory {
            Ok(())
        } else {
            Err(LedgerError::Inconsistent(format!(
                "memory {memory:?}, file {file:?}"
            )))
        })
    }

    fn acquire(
        &mut self,
        request: &AcquireRequest,
        ttl_ms: i64,
        now: i64,
    ) -> Decision<AcquireOutcome> {
        let target = request.target.as_deref().filter(|t| !t.is_empty());
        let key = request.request.as_ref();
        let tenant = &request.tenant;
        match self.state.decide_acquire(
            &request.candidates,
            target,
            key,
            tenant,
            request.session.is_some(),
            now,
        ) {
            AcquireDecision::NoMatch(stats) => Ok(Ok(AcquireOutcome::NoMatch(stats))),
            AcquireDecision::Quota(refused) => Ok(Ok(AcquireOutcome::QuotaExceeded(refused))),
            AcquireDecision::Reused => Ok(Err(LedgerError::RequestIdReused {
                request_id: key.map(|k| k.id.clone()).unwrap_or_default(),
            })),
            AcquireDecision::Replay(id) => Ok(match self.lease_now(&id, now)? {
                Some(lease) => Ok(AcquireOutcome::Replayed(lease)),
                None => Err(LedgerError::Inconsistent(format!(
                    "request ID {:?} names lease {id} that the file no longer holds",
                    key.map(|k| k.id.as_str()).unwrap_or_default()
                ))),
            }),
            AcquireDecision::Grant { index, bucket } => {
                let Some(candidate) = request.candidates.get(index) else {
                    return Ok(Err(LedgerError::Inconsistent(format!(
                        "selection chose candidate {index} of {}",
                        request.candidates.len()
                    ))));
                };
                let id = new_lease_id(now);
                let lease = ActiveLease {
                    proxy: candidate.proxy.clone(),
                    target: target.map(Arc::from),
                    acquired_at: now,
                    expires_at: now.saturating_add(ttl_ms),
                    ttl_ms,
                    request_id: key.map(|k| Arc::from(k.id.as_str())),
                    client: request.client.as_deref().map(Arc::from),
                    tenant: tenant.name.clone(),
                    session: request.session.as_deref().map(Arc::from),
                };
                let fingerprint = key.map(|k| k.fingerprint.as_str());
                store::insert_lease(&self.conn, &id, &lease, fingerprint, request.fallback_step)?;
                let granted = store::lease_of(&id, &lease, now)?;
                self.state
                    .grant(id.into(), lease, fingerprint.map(Arc::from));
                if let Some(bucket) = bucket {
                    self.state.spend(&tenant.name, bucket);
                }
                Ok(Ok(AcquireOutcome::Granted(granted)))
            }
        }
    }

    fn renew(&mut self, id: &str, tenant: &str, ttl_ms: i64, now: i64) -> Decision<Lease> {
        let expires_at = now.saturating_add(ttl_ms);
        Ok(
            match self.state.renew(id, tenant, now, expires_at, ttl_ms) {
                RenewOutcome::Renewed(lease) => {
                    store::renew_lease(&self.conn, id, &lease, now)?;
                    Ok(store::lease_of(id, &lease, now)?)
                }
                RenewOutcome::Expired => Err(LedgerError::NotActive {
                    id: id.to_owned(),
                    state: LeaseState::Expired,
                }),
                RenewOutcome::NotHeld => match store::lease_by_id(&self.conn, id, now)?
                    .filter(|lease| lease.tenant == tenant)
                {
                    Some(lease) => Err(LedgerError::NotActive {
                        id: id.to_owned(),
                        state: lease.state,
                    }),
                    None => Err(LedgerError::UnknownLease(id.to_owned())),
                },
            },
        )
    }

    fn report(
        &mut self,
        id: &str,
        tenant: &str,
        report: &LeaseReport,
        now: i64,
    ) -> Decision<Lease> {
        let Some(lease) = self.lease_now(id, now)?.filter(|l| l.tenant == tenant) else {
            return Ok(Err(LedgerError::UnknownLease(id.to_owned())));
        };
        let (target, cooldown_ms) = self.config.report_cooldown(report, lease.target.as_deref());
        let cooled = report.cooled(&lease.proxy.uid);
        store::report(
            &self.conn,
            &lease,
            &cooled,
            target,
            report.result,
            now,
            cooldown_ms,
        )?;
        if let (Some(ms), Some(target)) = (cooldown_ms, target) {
            self.state
                .cool_down(&cooled, target, now.saturating_add(ms));
        }
        Ok(Ok(lease))
    }

    /// The lease as it is now: from memory while active, else from the file (which this
    /// connection reads including the batch's own uncommitted writes).
    fn lease_now(&self, id: &str, now: i64) -> rusqlite::Result<Option<Lease>> {
        match self.state.lease(id) {
            Some(lease) => store::lease_of(id, lease, now).map(Some),
            None => store::lease_by_id(&self.conn, id, now),
        }
    }

    /// Runs a housekeeping job as a batch of its own that may use the whole page budget.
    fn housekeeping(&mut self, job: Queued) {
        self.shared.note_batch(1);
        self.space.housekeeping_pages(&self.conn);
        match self.conn.execute_batch("BEGIN IMMEDIATE") {
            Ok(()) => self.run_batch(vec![job]),
            Err(error) => self.fail(error, Vec::new(), vec![job]),
        }
        self.space.client_pages(&self.conn);
    }

    /// The next message, `None` once every handle is gone. While a pruning episode is
    /// unfinished, waiting for work is split into retries of the prune step.
    fn next_message(&mut self) -> Option<Message> {
        while let Some(wait) = self.space.retry_after() {
            match self.queue.recv_timeout(wait) {
                Ok(message) => return Some(message),
                Err(RecvTimeoutError::Timeout) => self.after_batch(),
                Err(RecvTimeoutError::Disconnected) => return None,
            }
        }
        self.queue.recv().ok()
    }

    /// Keeps the file within its size bound between batches, and the WAL within its
    /// allowance: each prune step is followed by the checkpoint its frames call for, also
    /// when steps follow one another while idle.
    fn after_batch(&mut self) {
        loop {
            let parts = space::WriterParts {
                conn: &self.conn,
                shared: &self.shared,
                clock: self.clock.as_ref(),
            };
            let more = self.space.after_batch(&parts);
            self.checkpoints.after_batch(&self.conn);
            if !more {
                break;
            }
        }
    }
}
