//! Where the ledger lives, as `--ledger` names it: a path is an SQLite file, a `postgres://`
//! or `postgresql://` URL a PostgreSQL database. Shown without the URL's password, so the
//! value can be logged and printed in errors.

use std::fmt;
use std::path::PathBuf;

/// The ledger's backend and where it keeps its rows.
#[derive(Clone, PartialEq, Eq)]
pub enum LedgerLocation {
    /// An SQLite file (created if missing).
    Sqlite(PathBuf),
    /// A PostgreSQL connection URL (libpq style); what it leaves out comes from `PG*`.
    Postgres(String),
}

impl LedgerLocation {
    /// Reads a `--ledger` value. Never fails: anything that is not a PostgreSQL URL is a path.
    pub fn parse(value: &str) -> Result<LedgerLocation, String> {
        if is_postgres_url(value) {
            Ok(LedgerLocation::Postgres(value.to_owned()))
        } else {
            Ok(LedgerLocation::Sqlite(PathBuf::from(value)))
        }
    }
}

/// Whether `value` is a PostgreSQL connection URL (the two schemes libpq accepts).
fn is_postgres_url(value: &str) -> bool {
    ["postgres://", "postgresql://"].iter().any(|scheme| {
        value.len() >= scheme.len() && value[..scheme.len()].eq_ignore_ascii_case(scheme)
    })
}

/// `url` with the password of its user-info (and a `password` query parameter) replaced by
/// `***`.
pub(crate) fn redact(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let authority = match authority.rsplit_once('@') {
        Some((user_info, host)) => match user_info.split_once(':') {
            Some((user, _)) => format!("{user}:***@{host}"),
            None => authority.to_owned(),
        },
        None => authority.to_owned(),
    };
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let query: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((key, _)) if key.eq_ignore_ascii_case("password") => {
                        format!("{key}=***")
                    }
                    _ => pair.to_owned(),
                })
                .collect();
            format!("{path}?{}", query.join("&"))
        }
        None => tail.to_owned(),
    };
    format!("{scheme}://{authority}{tail}")
}

impl fmt::Display for LedgerLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LedgerLocation::Sqlite(path) => write!(f, "{}", path.display()),
            LedgerLocation::Postgres(url) => f.write_str(&redact(url)),
        }
    }
}

impl fmt::Debug for LedgerLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LedgerLocation::Sqlite(path) => f.debug_tuple("Sqlite").field(path).finish(),
            LedgerLocation::Postgres(url) => f.debug_tuple("Postgres").field(&redact(url)).finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_postgres_and_everything_else_a_path() {
        let cases = [
            ("postgres://u@db/ledger", true),
            ("postgresql://db", true),
            ("POSTGRES://db", true),
            ("postgres://", true),
            ("./proxy-operator.db", false),
            ("/var/lib/proxy-operator/ledger.db", false),
            ("postgres.db", false),
            ("postgres:/db", false),
            ("", false),
        ];
        for (value, postgres) in cases {
            let location = LedgerLocation::parse(value).unwrap();
            assert_eq!(
                matches!(location, LedgerLocation::Postgres(_)),
                postgres,
                "{value}"
            );
        }
    }

    #[test]
    fn a_password_is_never_shown() {
        let cases = [
            (
                "postgres://op:s3cret@db:5432/ledger?sslmode=require",
                "postgres://op:***@db:5432/ledger?sslmode=require",
            ),
            ("postgres://op@db/ledger", "postgres://op@db/ledger"),
            ("postgres://db", "postgres://db"),
            (
                "postgresql://db/l?user=op&password=s3cret&sslmode=disable",
                "postgresql://db/l?user=op&password=***&sslmode=disable",
            ),
            ("postgres://op:p@ss:w@rd@db/l", "postgres://op:***@db/l"),
        ];
        for (url, shown) in cases {
            let location = LedgerLocation::parse(url).unwrap();
            assert_eq!(location.to_string(), shown);
            assert!(!format!("{location:?}").contains("s3cret"), "{url}");
        }
    }
}
