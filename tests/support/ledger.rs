//! A lease ledger on a real SQLite file in a temporary directory, with time on a
//! `ManualClock`, and the builders and answer checks the ledger tests share, so every test
//! file opens, reopens and reads its ledger the same way.
//!
//! A test file adds the helpers only it needs in its own `impl Fixture` block.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use proxy_operator::ledger::{
    AcquireOutcome, AcquireRequest, Candidate, Lease, Ledger, LedgerConfig, LedgerError,
    ManualClock, NoMatch, SqliteLedger,
};
use proxy_operator::proxy::ProxyId;
use tempfile::TempDir;

/// Where every test's `ManualClock` starts: a fixed instant, so times written to the file
/// are the same on every run and a test can compute them.
pub fn start() -> Timestamp {
    "2026-01-01T00:00:00Z".parse().unwrap()
}

/// A ledger on `ledger.db` in its own temporary directory (removed on drop), its path for
/// reading the file behind the ledger's back, and the clock the test moves.
pub struct Fixture {
    _dir: TempDir,
    pub path: PathBuf,
    pub clock: Arc<ManualClock>,
    pub ledger: SqliteLedger,
    config: LedgerConfig,
}

impl Fixture {
    /// Opens a new ledger with `config`, its clock at [`start`].
    pub fn new(config: LedgerConfig) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.db");
        let clock = Arc::new(ManualClock::new(start()));
        let ledger = SqliteLedger::open(&path, config.clone(), clock.clone()).unwrap();
        Self {
            _dir: dir,
            path,
            clock,
            ledger,
            config,
        }
    }

    /// Opens the file again with the config and clock it was opened with, as a restarted
    /// operator would, then drops the old handle (the last clone stops its writer).
    pub fn reopen(&mut self) {
        self.ledger =
            SqliteLedger::open(&self.path, self.config.clone(), self.clock.clone()).unwrap();
    }

    /// The single number `sql` selects from the file.
    pub fn count(&self, sql: &str) -> i64 {
        count(&self.path, sql)
    }
}

/// The single number `sql` selects from the ledger file at `path`, read on a connection of
/// its own, so it sees only what the ledger committed.
pub fn count(path: &Path, sql: &str) -> i64 {
    rusqlite::Connection::open(path)
        .unwrap()
        .query_row(sql, [], |r| r.get(0))
        .unwrap()
}

/// A healthy proxy `crawl/<name>` (UID `uid-<name>`) without a measured latency, granting
/// `max_leases` at once. Tests that need another health or a latency set those fields with
/// `Candidate { .., ..candidate(name, max_leases) }`.
pub fn candidate(name: &str, max_leases: u32) -> Candidate {
    Candidate {
        proxy: Arc::new(ProxyId {
            namespace: "crawl".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
        }),
        max_leases,
        healthy: true,
        cordoned: false,
        draining: false,
        latency: None,
    }
}

/// `count` proxies `p0`, `p1`, … as [`candidate`]s with `max_leases` each, shared so
/// requests built from it copy nothing.
pub fn candidates(count: usize, max_leases: u32) -> Arc<[Candidate]> {
    (0..count)
        .map(|i| candidate(&format!("p{i}"), max_leases))
        .collect()
}

/// An acquire of one of `candidates` for `target` and `ttl`, without a request ID. Takes a
/// slice (copied) or a shared list (`pool.clone()`, not copied).
pub fn request(
    candidates: impl Into<Arc<[Candidate]>>,
    target: &str,
    ttl: Duration,
) -> AcquireRequest {
    AcquireRequest {
        client: None,
        candidates: candidates.into(),
        target: Some(target.to_owned()),
        ttl,
        request: None,
    }
}

/// The new lease an acquire answered; panics with the answer otherwise.
pub fn granted(outcome: Result<AcquireOutcome, LedgerError>) -> Lease {
    match outcome {
        Ok(AcquireOutcome::Granted(lease)) => lease,
        other => panic!("expected a lease, got {other:?}"),
    }
}

/// Why an acquire found no proxy; panics with the answer if it got anything else.
pub fn no_match(outcome: Result<AcquireOutcome, LedgerError>) -> NoMatch {
    match outcome {
        Ok(AcquireOutcome::NoMatch(stats)) => stats,
        other => panic!("expected no match, got {other:?}"),
    }
}
