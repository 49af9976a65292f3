//! A lease ledger on either backend, with time on a `ManualClock`, and the builders and
//! answer checks the ledger tests share, so every test file opens, reopens and reads its
//! ledger the same way: a real SQLite file in a temporary directory, or a fresh database on
//! the test binary's real PostgreSQL server ([`super::postgres`]).
//!
//! A behaviour test is written once as `async fn name(backend: Backend)` and run on both with
//! [`on_both_backends!`](crate::on_both_backends). A test file adds the helpers only it needs
//! in its own `impl Fixture` block.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use proxy_operator::ledger::{
    AcquireOutcome, AcquireRequest, Candidate, Candidates, Clock, Lease, Ledger, LedgerConfig,
    LedgerError, ManualClock, NoMatch, PostgresLedger, PostgresOptions, SqliteLedger,
    SqliteOptions,
};
use proxy_operator::resources::proxy::ProxyId;
use tempfile::TempDir;

pub use proxy_operator::fixtures::candidate;

use super::postgres::{Database, Postgres};

/// Where every test's `ManualClock` starts: a fixed instant, so times written to the ledger
/// are the same on every run and a test can compute them.
pub fn start() -> Timestamp {
    "2026-01-01T00:00:00Z".parse().unwrap()
}

/// Which ledger a behaviour test runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// A file in a temporary directory.
    Sqlite,
    /// A database of its own on the shared PostgreSQL server.
    Postgres,
}

/// Runs each named `async fn name(backend: Backend)` of the enclosing module once per
/// backend, as tests `sqlite::name` and `postgres::name` (one body, two tests; a PostgreSQL
/// test returns early, saying so, when PostgreSQL is not installed and `CI` is unset).
#[macro_export]
macro_rules! on_both_backends {
    ($($name:ident),+ $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::support::ledger::Backend::Sqlite).await
                }
            )+
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::support::ledger::Backend::Postgres).await
                }
            )+
        }
    };
}

/// A ledger on one backend, how to read it behind the ledger's back, and the clock the test
/// moves.
pub struct Fixture {
    _dir: TempDir,
    /// The SQLite file (unused on PostgreSQL).
    pub path: PathBuf,
    pub clock: Arc<ManualClock>,
    pub ledger: Arc<dyn Ledger>,
    pub backend: Backend,
    sqlite: Option<SqliteLedger>,
    database: Option<Database>,
    /// How the SQLite file is kept (unused on PostgreSQL).
    options: SqliteOptions,
    config: LedgerConfig,
}

impl Fixture {
    /// Opens a new SQLite ledger with `config`, its clock at [`start`].
    pub fn new(config: LedgerConfig) -> Self {
        Self::with_options(SqliteOptions::default(), config)
    }

    /// Opens a new SQLite ledger kept as `options` say, with `config`, its clock at
    /// [`start`].
    pub fn with_options(options: SqliteOptions, config: LedgerConfig) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.db");
        let clock = Arc::new(ManualClock::new(start()));
        let ledger = SqliteLedger::open(&path, options, config.clone(), clock.clone()).unwrap();
        Self {
            _dir: dir,
            path,
            clock,
            ledger: Arc::new(ledger.clone()),
            backend: Backend::Sqlite,
            sqlite: Some(ledger),
            database: None,
            options,
            config,
        }
    }

    /// Opens a new ledger on `backend` with `config`, its clock at [`start`]; `None` when
    /// that backend cannot run here (PostgreSQL not installed, outside CI).
    pub async fn on(backend: Backend, config: LedgerConfig) -> Option<Self> {
        match backend {
            Backend::Sqlite => Some(Fixture::new(config)),
            Backend::Postgres => {
                let database = Postgres::shared()?.database();
                let clock = Arc::new(ManualClock::new(start()));
                let ledger = open_postgres(&database, &config, &clock).await;
                Some(Self {
                    _dir: tempfile::tempdir().unwrap(),
                    path: PathBuf::new(),
                    clock,
                    ledger: Arc::new(ledger),
                    backend,
                    sqlite: None,
                    database: Some(database),
                    options: SqliteOptions::default(),
                    config,
                })
            }
        }
    }

    /// The SQLite ledger, for tests of what only it has (its writer, its file).
    pub fn sqlite(&self) -> &SqliteLedger {
        self.sqlite
            .as_ref()
            .expect("an SQLite-only test runs on the SQLite backend")
    }

    /// Opens the ledger again with the options, config and clock it was opened with, as a restarted
    /// operator would, then drops the old handle (the last clone of an SQLite ledger stops
    /// its writer).
    pub async fn reopen(&mut self) {
        match &self.database {
            None => {
                let ledger = SqliteLedger::open(
                    &self.path,
                    self.options,
                    self.config.clone(),
                    self.clock.clone(),
                )
                .unwrap();
                self.ledger = Arc::new(ledger.clone());
                self.sqlite = Some(ledger);
            }
            Some(database) => {
                self.ledger = Arc::new(open_postgres(database, &self.config, &self.clock).await);
            }
        }
    }

    /// Checks what each backend can check of itself: the SQLite writer's memory against its
    /// file; the PostgreSQL ledger's counts against its tables.
    pub async fn self_check(&self) {
        match &self.sqlite {
            Some(sqlite) => sqlite.self_check().await.unwrap(),
            None => {
                let now = self.clock.now().as_millisecond();
                let active = self.count(&format!(
                    "SELECT count(*) FROM leases WHERE state = 'active' AND expires_at > {now}"
                ));
                assert_eq!(
                    self.ledger.counts().active_total(),
                    active as u64,
                    "active leases"
                );
                let cooling = self.count(&format!(
                    "SELECT count(*) FROM cooldowns WHERE until > {now}"
                ));
                assert_eq!(
                    self.ledger.counts().cooldowns_active(),
                    cooling as u64,
                    "cooldowns"
                );
            }
        }
    }

    /// The single number `sql` selects, read on a connection of its own, so it sees only
    /// what the ledger committed.
    pub fn count(&self, sql: &str) -> i64 {
        match &self.database {
            None => count(&self.path, sql),
            Some(database) => {
                let out = database.psql(sql);
                out.parse()
                    .unwrap_or_else(|_| panic!("{sql}: not a number: {out:?}"))
            }
        }
    }

    /// The rows `sql` selects, each column as text (`NULL` as `None`), read behind the
    /// ledger's back.
    pub fn rows(&self, sql: &str) -> Vec<Vec<Option<String>>> {
        match &self.database {
            None => {
                let conn = rusqlite::Connection::open(&self.path).unwrap();
                let mut statement = conn.prepare(sql).unwrap();
                let columns = statement.column_count();
                statement
                    .query_map([], |row| {
                        (0..columns)
                            .map(|i| {
                                Ok(match row.get_ref(i)? {
                                    rusqlite::types::ValueRef::Null => None,
                                    rusqlite::types::ValueRef::Integer(n) => Some(n.to_string()),
                                    rusqlite::types::ValueRef::Real(x) => Some(x.to_string()),
                                    rusqlite::types::ValueRef::Text(t) => {
                                        Some(String::from_utf8_lossy(t).into_owned())
                                    }
                                    rusqlite::types::ValueRef::Blob(_) => Some("<blob>".into()),
                                })
                            })
                            .collect()
                    })
                    .unwrap()
                    .collect::<Result<_, _>>()
                    .unwrap()
            }
            Some(database) => {
                // Each row as a JSON array (in column order) keeps NULLs apart from psql's
                // text layout.
                let out = database.psql(&format!(
                    "SELECT (SELECT json_agg(e.value ORDER BY e.n) FROM \
                     json_each(row_to_json(r)) WITH ORDINALITY AS e(key, value, n))::text \
                     FROM ({sql}) r"
                ));
                out.lines()
                    .map(|line| {
                        let row: Vec<serde_json::Value> = serde_json::from_str(line).unwrap();
                        row.into_iter()
                            .map(|value| match value {
                                serde_json::Value::Null => None,
                                serde_json::Value::String(s) => Some(s),
                                other => Some(other.to_string()),
                            })
                            .collect()
                    })
                    .collect()
            }
        }
    }

    /// The column names of the relation (table or view) `name`, in order.
    pub fn columns(&self, name: &str) -> Vec<String> {
        match &self.database {
            None => {
                let conn = rusqlite::Connection::open(&self.path).unwrap();
                let statement = conn.prepare(&format!("SELECT * FROM {name}")).unwrap();
                statement
                    .column_names()
                    .into_iter()
                    .map(str::to_owned)
                    .collect()
            }
            Some(database) => database
                .psql(&format!(
                    "SELECT attname FROM pg_attribute WHERE attrelid = '{name}'::regclass \
                     AND attnum > 0 AND NOT attisdropped ORDER BY attnum"
                ))
                .lines()
                .map(str::to_owned)
                .collect(),
        }
    }
}

async fn open_postgres(
    database: &Database,
    config: &LedgerConfig,
    clock: &Arc<ManualClock>,
) -> PostgresLedger {
    let options = PostgresOptions {
        password: None,
        pool_size: 8,
    };
    PostgresLedger::open(&database.url(), options, config.clone(), clock.clone())
        .await
        .unwrap()
}

/// The single number `sql` selects from the ledger file at `path`, read on a connection of
/// its own, so it sees only what the ledger committed.
pub fn count(path: &Path, sql: &str) -> i64 {
    rusqlite::Connection::open(path)
        .unwrap()
        .query_row(sql, [], |r| r.get(0))
        .unwrap()
}

/// `count` proxies `p0`, `p1`, … as [`candidate`]s with `max_leases` each, shared so
/// requests built from it copy nothing.
pub fn candidates(count: usize, max_leases: u32) -> Candidates {
    (0..count)
        .map(|i| candidate(&format!("p{i}"), max_leases))
        .collect()
}

/// An acquire of one of `candidates` for `target` and `ttl`, without a request ID. Takes a
/// slice (copied) or a shared list (`pool.clone()`, not copied).
pub fn request(candidates: impl Into<Candidates>, target: &str, ttl: Duration) -> AcquireRequest {
    AcquireRequest {
        client: None,
        candidates: candidates.into(),
        target: Some(target.to_owned()),
        ttl,
        request: None,
        tenant: proxy_operator::ledger::Tenancy::unrestricted(),
        session: None,
        fallback_step: None,
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
