//! The ledger writer's mechanics against real SQLite files: group commit, the bounded queue
//! and queue deadlines, acquires whose caller left, batches whose statement or COMMIT fails,
//! and shutdown.
//!
//! To hold the writer at a known point, a test takes the file's write lock with a plain
//! SQLite connection (`BEGIN IMMEDIATE`), exactly as another process could: the writer takes
//! the first queued write and waits in its own `BEGIN IMMEDIATE`, everything queued meanwhile
//! joins that batch, and the batch runs when the test lets go of the lock. Writes are queued
//! by polling their futures once, so what is queued, and in which order, is decided by the
//! test, and time only moves through the ledger's `ManualClock`.

use crate::support;
use proxy_operator::ledger::DEFAULT_TENANT;

use std::pin::Pin;
use std::sync::LazyLock;
use std::time::Duration;

use proxy_operator::ledger::{
    AcquireOutcome, AcquireRequest, Candidates, LeaseReport, LedgerConfig, LedgerError,
    ReportResult, RequestKey,
};
use support::ledger::{Fixture, candidates, granted, request};
use support::{FileLock, queue, wait_until};

const MINUTE: Duration = Duration::from_secs(60);

/// What every acquire of these tests may choose from: four proxies, 100 leases each.
static POOL: LazyLock<Candidates> = LazyLock::new(|| candidates(4, 100));

/// How these tests queue writes and hold the writer.
impl Fixture {
    fn request(&self, target: &str, request_id: Option<&str>) -> AcquireRequest {
        AcquireRequest {
            request: request_id.map(|id| RequestKey {
                id: id.into(),
                fingerprint: "fp".into(),
            }),
            tenant: proxy_operator::ledger::Tenancy::unrestricted(),
            session: None,
            fallback_step: None,
            ..request(POOL.clone(), target, MINUTE)
        }
    }

    /// An acquire of one of the pool for `target`, not yet polled.
    fn pending_acquire(
        &self,
        target: &str,
    ) -> Pin<Box<impl Future<Output = Result<AcquireOutcome, LedgerError>> + '_>> {
        Box::pin(self.ledger.acquire(self.request(target, None)))
    }

    /// Takes the file's write lock until the returned guard is released.
    fn lock_file(&self) -> FileLock {
        FileLock::take(&self.path)
    }

    /// Waits until the writer has taken every queued write (it then waits for the lock).
    async fn writer_took_everything(&self) {
        wait_until("the writer takes the queued write", || {
            self.sqlite().queue_depth() == 0
        })
        .await;
    }
}

fn overloaded<T: std::fmt::Debug>(answer: Result<T, LedgerError>) {
    match answer {
        Err(LedgerError::Overloaded { retry_after }) => assert!(retry_after > Duration::ZERO),
        other => panic!("expected Overloaded, got {other:?}"),
    }
}

#[tokio::test]
async fn everything_queued_while_the_writer_waits_is_committed_in_one_batch() {
    let f = Fixture::new(LedgerConfig::default());
    let lock = f.lock_file();
    let mut writes: Vec<_> = (0..21).map(|_| f.pending_acquire("t.example")).collect();
    assert!(queue(&mut writes[0]).await.is_none());
    f.writer_took_everything().await;
    for write in &mut writes[1..] {
        assert!(queue(write).await.is_none());
    }
    assert_eq!(f.sqlite().queue_depth(), 20);
    assert_eq!(
        f.ledger.counts().active_total(),
        0,
        "nothing is answered before the commit"
    );
    lock.release();
    for write in writes {
        granted(write.await);
    }
    let stats = f.sqlite().writer_stats();
    assert_eq!(stats.batches, 1, "{stats:?}");
    assert_eq!(stats.batch_sizes.get(21), Some(&1), "{stats:?}");
    assert_eq!(f.ledger.counts().active_total(), 21);
    assert_eq!(f.count("SELECT COUNT(*) FROM leases"), 21);
}

#[tokio::test]
async fn a_burst_larger_than_the_queue_is_refused_at_once_and_nothing_is_granted_past_its_deadline()
{
    const CAPACITY: usize = 8;
    let f = Fixture::new(LedgerConfig {
        queue_capacity: CAPACITY,
        queue_deadline: Duration::from_secs(2),
        ..LedgerConfig::default()
    });
    let lock = f.lock_file();
    let mut first = f.pending_acquire("t.example");
    assert!(queue(&mut first).await.is_none());
    f.writer_took_everything().await;
    let mut queued: Vec<_> = (0..CAPACITY)
        .map(|_| f.pending_acquire("t.example"))
        .collect();
    for write in &mut queued {
        assert!(queue(write).await.is_none(), "the queue has room");
    }
    // The excess is answered on its first poll, while the writer is still stuck.
    for _ in 0..5 {
        let mut excess = f.pending_acquire("t.example");
        overloaded(queue(&mut excess).await.expect("refused at once"));
    }
    let mut release = Box::pin(f.ledger.release("any", DEFAULT_TENANT));
    overloaded(queue(&mut release).await.expect("releases are bounded too"));

    // Their deadline passes before the writer gets to them: none is decided.
    f.clock.advance(Duration::from_secs(2));
    lock.release();
    overloaded(first.await);
    for write in queued {
        overloaded(write.await);
    }
    assert_eq!(f.ledger.counts().active_total(), 0);
    assert_eq!(f.count("SELECT COUNT(*) FROM leases"), 0);
    assert_eq!(f.count("SELECT COUNT(*) FROM lease_events"), 0);
    let stats = f.sqlite().writer_stats();
    assert_eq!(
        (stats.refused_full, stats.refused_deadline),
        (6, 1 + CAPACITY as u64),
        "{stats:?}"
    );

    // A write just inside its deadline is decided.
    let lock = f.lock_file();
    let mut late = f.pending_acquire("t.example");
    assert!(queue(&mut late).await.is_none());
    f.writer_took_everything().await;
    f.clock.advance(Duration::from_millis(1999));
    lock.release();
    granted(late.await);
    assert_eq!(f.ledger.counts().active_total(), 1);
}

#[tokio::test]
async fn an_acquire_whose_caller_left_before_its_turn_is_not_granted() {
    let f = Fixture::new(LedgerConfig::default());
    let lock = f.lock_file();
    let mut kept = f.pending_acquire("t.example");
    assert!(queue(&mut kept).await.is_none());
    f.writer_took_everything().await;
    for _ in 0..3 {
        let mut gone = Box::pin(f.ledger.acquire(f.request("t.example", Some("retried"))));
        assert!(queue(&mut gone).await.is_none());
        // The caller gives up: its future (and the answer's receiver) is dropped.
    }
    let mut retry = Box::pin(f.ledger.acquire(f.request("t.example", Some("retried"))));
    assert!(queue(&mut retry).await.is_none());
    assert_eq!(f.sqlite().queue_depth(), 4);
    lock.release();
    granted(kept.await);
    let retried = granted(retry.await);
    assert_eq!(
        f.ledger.counts().active_total(),
        2,
        "the abandoned attempts hold nothing"
    );
    assert_eq!(f.count("SELECT COUNT(*) FROM leases"), 2);
    assert_eq!(
        f.count("SELECT COUNT(*) FROM leases WHERE request_id = 'retried'"),
        1
    );
    assert_eq!(f.sqlite().writer_stats().abandoned, 3);
    let again = f.ledger.acquire(f.request("t.example", Some("retried")));
    assert_eq!(again.await.unwrap(), AcquireOutcome::Replayed(retried));
}

/// Ways to make a batch's transaction fail for real, each armed for acquires naming
/// `poison.example`: `(name, SQL run on another connection, message expected in the error)`.
const FAILURES: [(&str, &str, &str); 2] = [
    (
        "a statement fails",
        "CREATE TRIGGER poison BEFORE INSERT ON leases WHEN NEW.target = 'poison.example' \
         BEGIN SELECT RAISE(ABORT, 'poisoned lease'); END;",
        "poisoned lease",
    ),
    (
        "the COMMIT fails (deferred foreign key)",
        "CREATE TABLE poison_parent (id INTEGER PRIMARY KEY); \
         CREATE TABLE poison_child (parent INTEGER \
             REFERENCES poison_parent (id) DEFERRABLE INITIALLY DEFERRED); \
         CREATE TRIGGER poison AFTER INSERT ON leases WHEN NEW.target = 'poison.example' \
         BEGIN INSERT INTO poison_child VALUES (42); END;",
        "FOREIGN KEY constraint failed",
    ),
];

fn batch_failed<T: std::fmt::Debug>(answer: Result<T, LedgerError>, message: &str) {
    match answer {
        Err(LedgerError::BatchFailed(error)) => {
            assert!(error.to_string().contains(message), "{error}");
        }
        other => panic!("expected the batch to fail with {message:?}, got {other:?}"),
    }
}

#[tokio::test]
async fn a_failed_batch_answers_every_caller_with_the_error_and_memory_follows_the_file() {
    for (name, poison, message) in FAILURES {
        let mut f = Fixture::new(LedgerConfig::default());
        let held = granted(f.ledger.acquire(f.request("t.example", Some("held"))).await);
        f.ledger
            .report(
                &held.id,
                DEFAULT_TENANT,
                LeaseReport::new(ReportResult::RateLimited, Some("cool.example")),
            )
            .await
            .unwrap();
        let counts = f.ledger.counts().active_counts();
        assert_eq!(
            (
                f.ledger.counts().active_total(),
                f.ledger.counts().cooldowns_active()
            ),
            (1, 1)
        );
        let rows =
            f.count("SELECT COUNT(*) FROM leases") + f.count("SELECT COUNT(*) FROM lease_events");
        rusqlite::Connection::open(&f.path)
            .unwrap()
            .execute_batch(poison)
            .unwrap();

        let lock = f.lock_file();
        let mut first = f.pending_acquire("t.example");
        assert!(queue(&mut first).await.is_none());
        f.writer_took_everything().await;
        let mut release = Box::pin(f.ledger.release(&held.id, DEFAULT_TENANT));
        let mut renew = Box::pin(f.ledger.renew(&held.id, DEFAULT_TENANT, 5 * MINUTE));
        let mut report = Box::pin(f.ledger.report(
            &held.id,
            DEFAULT_TENANT,
            LeaseReport::new(ReportResult::Blocked, Some("new.example")),
        ));
        let mut with_id = Box::pin(f.ledger.acquire(f.request("t.example", Some("fresh"))));
        let mut poisoned = f.pending_acquire("poison.example");
        let mut after = Box::pin(f.ledger.acquire(f.request("t.example", Some("after"))));
        assert!(queue(&mut release).await.is_none());
        assert!(queue(&mut renew).await.is_none());
        assert!(queue(&mut report).await.is_none());
        assert!(queue(&mut with_id).await.is_none());
        assert!(queue(&mut poisoned).await.is_none());
        assert!(queue(&mut after).await.is_none());
        lock.release();
        batch_failed(first.await, message);
        batch_failed(release.await, message);
        batch_failed(renew.await, message);
        batch_failed(report.await, message);
        batch_failed(with_id.await, message);
        batch_failed(poisoned.await, message);
        batch_failed(after.await, message);
        assert_eq!(f.sqlite().writer_stats().failed_batches, 1, "{name}");

        // Memory is what the file says: the held lease, its cooldown, nothing of the batch.
        assert_eq!(f.ledger.counts().active_counts(), counts, "{name}");
        assert_eq!(f.ledger.counts().cooldowns_active(), 1, "{name}");
        let file_rows =
            f.count("SELECT COUNT(*) FROM leases") + f.count("SELECT COUNT(*) FROM lease_events");
        assert_eq!(file_rows, rows, "{name}");
        f.self_check().await;
        // The request IDs of the failed batch were never given out; the held one still is.
        granted(
            f.ledger
                .acquire(f.request("t.example", Some("fresh")))
                .await,
        );
        let replay = f
            .ledger
            .acquire(f.request("t.example", Some("held")))
            .await
            .unwrap();
        assert_eq!(replay, AcquireOutcome::Replayed(held.clone()), "{name}");
        // A later batch without the poison commits, and a reopened ledger agrees.
        f.ledger.release(&held.id, DEFAULT_TENANT).await.unwrap();
        assert_eq!(f.ledger.counts().active_total(), 1, "{name}");
        f.self_check().await;
        let before = (
            f.ledger.counts().active_counts(),
            f.ledger.counts().cooldowns_active(),
        );
        f.reopen().await;
        assert_eq!(
            (
                f.ledger.counts().active_counts(),
                f.ledger.counts().cooldowns_active()
            ),
            before,
            "{name}"
        );
        f.self_check().await;
    }
}

#[tokio::test]
async fn shutdown_commits_what_was_queued_and_refuses_the_rest() {
    let f = Fixture::new(LedgerConfig::default());
    let lock = f.lock_file();
    let mut first = f.pending_acquire("t.example");
    assert!(queue(&mut first).await.is_none());
    f.writer_took_everything().await;
    let mut second = f.pending_acquire("t.example");
    assert!(queue(&mut second).await.is_none());
    let stopping = {
        let ledger = f.sqlite().clone();
        std::thread::spawn(move || ledger.shutdown())
    };
    wait_until("shutdown refuses new writes", || !f.sqlite().is_running()).await;
    let refused = f.ledger.release("any", DEFAULT_TENANT).await;
    assert!(matches!(refused, Err(LedgerError::Closed)), "{refused:?}");
    lock.release();
    granted(first.await);
    granted(second.await);
    stopping.join().unwrap();
    assert!(!f.sqlite().is_running());
    assert_eq!(f.count("SELECT COUNT(*) FROM leases"), 2);
    let refused = f.ledger.acquire(f.request("t.example", None)).await;
    assert!(matches!(refused, Err(LedgerError::Closed)), "{refused:?}");
    assert_eq!(f.ledger.counts().active_total(), 2, "reads still answer");
}
