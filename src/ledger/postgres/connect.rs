//! How the PostgreSQL ledger connects: the libpq-style URL, with what it leaves out taken
//! from the usual `PG*` environment, the password from a file when one is given, TLS when
//! `sslmode=require`, and the connection pool.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::config::SslMode;

/// How long opening one connection may take when neither the URL nor `PGCONNECT_TIMEOUT`
/// says: a database that is down is answered 503 within this, not after the OS's minutes.
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a pooled connection's health check (recycling) may take.
const RECYCLE_TIMEOUT: Duration = Duration::from_secs(2);

/// A resolved connection: the driver's config, and whether TLS is required.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    pub config: tokio_postgres::Config,
    /// `sslmode=require`: connect over TLS, verifying the server against the system roots.
    pub tls: bool,
}

/// The config `url` describes, filled in libpq's way from `env` (`PGHOST`, `PGPORT`,
/// `PGUSER`, `PGDATABASE`, `PGPASSWORD`, `PGSSLMODE`, `PGAPPNAME`, `PGCONNECT_TIMEOUT`) where
/// the URL says nothing. A `password_from_file` wins over both. The user defaults to
/// `postgres` (there is no OS user to fall back on in a container), the database to the
/// user, the host to `localhost`.
pub(crate) fn resolve(
    url: &str,
    env: impl Fn(&str) -> Option<String>,
    password_from_file: Option<String>,
) -> Result<Target, String> {
    let env = |name: &str| env(name).filter(|v| !v.is_empty());
    let port = env("PGPORT")
        .map(|port| {
            port.parse::<u16>()
                .map_err(|_| format!("PGPORT {port:?} is not a port number"))
        })
        .transpose()?
        .filter(|_| !url_has_port(url));
    let url = match port {
        // The driver would fill in 5432 for a host of the URL without a port.
        Some(port) => with_port(url, port),
        None => url.to_owned(),
    };
    let mut config = tokio_postgres::Config::from_str(&url).map_err(|e| {
        let cause = std::error::Error::source(&e)
            .map(|c| format!(": {c}"))
            .unwrap_or_default();
        format!("not a PostgreSQL connection URL ({e}{cause})")
    })?;
    if config.get_hosts().is_empty() {
        let hosts = env("PGHOST").unwrap_or_else(|| "localhost".to_owned());
        for host in hosts.split(',') {
            config.host(host);
        }
    }
    if config.get_ports().is_empty()
        && let Some(port) = port
    {
        config.port(port);
    }
    if config.get_user().is_none() {
        config.user(env("PGUSER").unwrap_or_else(|| "postgres".to_owned()));
    }
    if config.get_dbname().is_none()
        && let Some(db) = env("PGDATABASE")
    {
        config.dbname(db);
    }
    if let Some(password) = password_from_file {
        config.password(password);
    } else if config.get_password().is_none()
        && let Some(password) = env("PGPASSWORD")
    {
        config.password(password);
    }
    if !has_parameter(&url, "sslmode")
        && let Some(mode) = env("PGSSLMODE")
    {
        config.ssl_mode(ssl_mode(&mode)?);
    }
    if config.get_application_name().is_none() {
        config.application_name(env("PGAPPNAME").unwrap_or_else(|| "proxy-operator".to_owned()));
    }
    if config.get_connect_timeout().is_none() {
        let timeout = match env("PGCONNECT_TIMEOUT") {
            Some(seconds) => seconds
                .parse::<u64>()
                .map(Duration::from_secs)
                .map_err(|_| format!("PGCONNECT_TIMEOUT {seconds:?} is not whole seconds"))?,
            None => DEFAULT_CONNECT_TIMEOUT,
        };
        config.connect_timeout(timeout);
    }
    let tls = config.get_ssl_mode() == SslMode::Require;
    if !tls {
        // `prefer` would try TLS with a connector that cannot verify; like `disable`, it
        // connects in the clear, and `require` is how TLS is asked for.
        config.ssl_mode(SslMode::Disable);
    }
    Ok(Target { config, tls })
}

/// `url` with `:port` after each host of its authority that has none.
fn with_port(url: &str, port: u16) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let (user_info, hosts) = match authority.rsplit_once('@') {
        Some((user_info, hosts)) => (format!("{user_info}@"), hosts),
        None => (String::new(), authority),
    };
    let hosts: Vec<String> = hosts
        .split(',')
        .map(|host| {
            let after_bracket = host.rsplit_once(']').map_or(host, |(_, after)| after);
            if host.is_empty() || after_bracket.contains(':') {
                host.to_owned()
            } else {
                format!("{host}:{port}")
            }
        })
        .collect();
    format!("{scheme}://{user_info}{}{tail}", hosts.join(","))
}

/// Whether the URL's authority names a port (`host:port`, `[::1]:port`, or a `port`
/// parameter).
fn url_has_port(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = &rest[..rest.find(['/', '?']).unwrap_or(rest.len())];
    let hosts = authority
        .rsplit_once('@')
        .map_or(authority, |(_, hosts)| hosts);
    let in_authority = hosts.split(',').any(|host| {
        let after_bracket = host.rsplit_once(']').map_or(host, |(_, after)| after);
        after_bracket.contains(':')
    });
    in_authority || has_parameter(url, "port")
}

/// Whether the URL's query names `key`.
fn has_parameter(url: &str, key: &str) -> bool {
    url.split_once('?').is_some_and(|(_, query)| {
        query.split('&').any(|pair| {
            pair.split('=')
                .next()
                .is_some_and(|k| k.eq_ignore_ascii_case(key))
        })
    })
}

fn ssl_mode(mode: &str) -> Result<SslMode, String> {
    match mode {
        "disable" => Ok(SslMode::Disable),
        "prefer" | "allow" => Ok(SslMode::Prefer),
        "require" => Ok(SslMode::Require),
        other => Err(format!(
            "PGSSLMODE {other:?} is not one of disable, allow, prefer, require"
        )),
    }
}

/// The pool of at most `size` connections to `target`; a caller waits at most `wait` for one.
pub(crate) fn pool(target: &Target, size: usize, wait: Duration) -> Result<Pool, String> {
    let manager_config = ManagerConfig {
        recycling_method: RecyclingMethod::Fast,
    };
    let manager = if target.tls {
        use rustls_platform_verifier::BuilderVerifierExt;
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .and_then(|builder| builder.with_platform_verifier())
            .map_err(|e| format!("TLS: {e}"))?
            .with_no_client_auth();
        Manager::from_config(
            target.config.clone(),
            tokio_postgres_rustls::MakeRustlsConnect::new(tls),
            manager_config,
        )
    } else {
        Manager::from_config(target.config.clone(), tokio_postgres::NoTls, manager_config)
    };
    let connect = target
        .config
        .get_connect_timeout()
        .copied()
        .unwrap_or(DEFAULT_CONNECT_TIMEOUT);
    // Last in, first out: a quiet ledger keeps reusing the same few connections, and each
    // backend that sits idle skips the cache rebuilds every commit's invalidations cost the
    // ones in use (measured: more pairs/s with three replicas on one database).
    Pool::builder(manager)
        .max_size(size)
        .queue_mode(deadpool_postgres::QueueMode::Lifo)
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(wait))
        .create_timeout(Some(connect))
        .recycle_timeout(Some(RECYCLE_TIMEOUT))
        .build()
        .map_err(|e| format!("connection pool: {e}"))
}

/// Where the config points, for logs: user, hosts, ports and database, never the password.
pub(crate) fn describe(config: &tokio_postgres::Config) -> String {
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .map(|host| match host {
            tokio_postgres::config::Host::Tcp(name) => name.clone(),
            tokio_postgres::config::Host::Unix(path) => path.display().to_string(),
        })
        .collect();
    let ports: Vec<String> = config.get_ports().iter().map(u16::to_string).collect();
    format!(
        "user {} on {} port {} database {}",
        config.get_user().unwrap_or("?"),
        hosts.join(","),
        if ports.is_empty() {
            "5432".to_owned()
        } else {
            ports.join(",")
        },
        config.get_dbname().or(config.get_user()).unwrap_or("?"),
    )
}

/// A driver error as one line: the server's code and message when the server answered,
/// else the driver's error and its cause (a refused connection, a timeout).
pub(crate) fn explain(error: &tokio_postgres::Error) -> String {
    if let Some(db) = error.as_db_error() {
        return format!("{} ({})", db.message(), db.code().code());
    }
    match std::error::Error::source(error) {
        Some(cause) => format!("{error}: {cause}"),
        None => error.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn resolve_with(url: &str, env: &[(&str, &str)], file: Option<&str>) -> Result<Target, String> {
        let env: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        resolve(url, |name| env.get(name).cloned(), file.map(str::to_owned))
    }

    #[test]
    fn the_url_wins_and_the_environment_fills_what_it_leaves_out() {
        let target = resolve_with(
            "postgres://op@db.internal:6432/ledger?sslmode=require",
            &[
                ("PGHOST", "other"),
                ("PGPORT", "1"),
                ("PGUSER", "nobody"),
                ("PGDATABASE", "x"),
                ("PGSSLMODE", "disable"),
            ],
            None,
        )
        .unwrap();
        assert_eq!(
            describe(&target.config),
            "user op on db.internal port 6432 database ledger"
        );
        assert!(target.tls);

        let target = resolve_with(
            "postgres://",
            &[
                ("PGHOST", "pg"),
                ("PGPORT", "5433"),
                ("PGUSER", "op"),
                ("PGDATABASE", "leases"),
                ("PGPASSWORD", "from-env"),
                ("PGSSLMODE", "require"),
                ("PGAPPNAME", "crawl-ledger"),
                ("PGCONNECT_TIMEOUT", "7"),
            ],
            None,
        )
        .unwrap();
        assert_eq!(
            describe(&target.config),
            "user op on pg port 5433 database leases"
        );
        assert_eq!(target.config.get_password(), Some(&b"from-env"[..]));
        assert_eq!(target.config.get_application_name(), Some("crawl-ledger"));
        assert_eq!(
            target.config.get_connect_timeout(),
            Some(&Duration::from_secs(7))
        );
        assert!(target.tls);

        let target = resolve_with("postgres://", &[], None).unwrap();
        assert_eq!(
            describe(&target.config),
            "user postgres on localhost port 5432 database postgres"
        );
        assert_eq!(target.config.get_application_name(), Some("proxy-operator"));
        assert_eq!(
            target.config.get_connect_timeout(),
            Some(&DEFAULT_CONNECT_TIMEOUT)
        );
        assert!(!target.tls);
        assert_eq!(target.config.get_ssl_mode(), SslMode::Disable);
    }

    #[test]
    fn pgport_applies_only_when_the_url_names_no_port() {
        for (url, port) in [
            ("postgres://db/l", 7000),
            ("postgres://op:pw@db/l", 7000),
            ("postgres://db:6432/l", 6432),
            ("postgres://[::1]:6433/l", 6433),
            ("postgres://[::1]/l", 7000),
            ("postgres://a:1,b:2/l", 1),
            ("postgres:///l?host=db&port=6434", 6434),
        ] {
            let target = resolve_with(url, &[("PGPORT", "7000")], None).unwrap();
            assert_eq!(target.config.get_ports().first(), Some(&port), "{url}");
        }
    }

    #[test]
    fn the_password_file_wins_over_the_url_and_the_environment() {
        let target = resolve_with(
            "postgres://op:from-url@db/ledger",
            &[("PGPASSWORD", "from-env")],
            Some("from-file"),
        )
        .unwrap();
        assert_eq!(target.config.get_password(), Some(&b"from-file"[..]));
        let target = resolve_with(
            "postgres://op:from-url@db/ledger",
            &[("PGPASSWORD", "from-env")],
            None,
        )
        .unwrap();
        assert_eq!(target.config.get_password(), Some(&b"from-url"[..]));
        assert!(!format!("{:?}", describe(&target.config)).contains("from-url"));
    }

    #[test]
    fn bad_values_are_named() {
        let cases = [
            (
                "postgres://db?nonsense=1",
                &[][..],
                "unknown option `nonsense`",
            ),
            ("postgres://db", &[("PGPORT", "x")][..], "PGPORT \"x\""),
            (
                "postgres://db",
                &[("PGSSLMODE", "verify-full")][..],
                "PGSSLMODE",
            ),
            (
                "postgres://db",
                &[("PGCONNECT_TIMEOUT", "2s")][..],
                "PGCONNECT_TIMEOUT",
            ),
        ];
        for (url, env, message) in cases {
            let err = resolve_with(url, env, None).unwrap_err();
            assert!(err.contains(message), "{url} {env:?}: {err}");
        }
    }
}
