//! The settings only the PostgreSQL ledger has: how to reach the database besides its URL.
//! What SQLite alone has is in `SqliteOptions`; the rules both keep are `LedgerConfig`.

/// How to reach the database, besides the URL.
#[derive(Debug, Clone, Default)]
pub struct PostgresOptions {
    /// The password (from `--ledger-password-file`); wins over the URL's and `PGPASSWORD`.
    pub password: Option<String>,
    /// Connections in the pool.
    pub pool_size: usize,
}
