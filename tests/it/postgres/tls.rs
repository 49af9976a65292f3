//! The PostgreSQL ledger over TLS, through the real `proxy-operator standalone` as a user runs
//! it, against a server with TLS on whose certificate a throw-away CA signed: with
//! `sslmode=require` and that CA in `SSL_CERT_FILE` it connects, ready, and the server sees
//! TLS connections; with `sslmode=require` and a CA that did not sign the server's
//! certificate it refuses to start, naming the ledger and the certificate, and not the
//! password; with `sslmode=disable` it connects in the clear to the same kind of server.

use crate::support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::Value;
use support::postgres::{Database, Postgres};
use support::target::TestTls;
use support::{DEADLINE, free_port};

const TOKEN: &str = "postgres-tls-discovery-token";

/// Whether the server sees the operator's connections as TLS (`t`) or not (`f`).
fn operator_ssl_sql(database: &Database) -> String {
    format!(
        "SELECT DISTINCT ssl FROM pg_stat_ssl JOIN pg_stat_activity USING (pid) \
         WHERE application_name = 'proxy-operator' AND datname = '{}'",
        database.name()
    )
}

/// `proxy-operator standalone` on an empty inventory, its ledger `url`, trusting the PEM
/// bundle `ssl_cert_file` as its only roots. Killed on drop; its log (stdout and stderr) is
/// printed when the test is failing.
struct Operator {
    child: Child,
    api: String,
    log: PathBuf,
}

impl Operator {
    fn start(dir: &Path, url: &str, ssl_cert_file: &Path) -> Operator {
        let inventory = dir.join("inventory.yaml");
        std::fs::write(&inventory, "").expect("write the inventory");
        let log = dir.join("operator.log");
        let stderr = std::fs::File::create(&log).expect("create the operator log");
        let stdout = stderr.try_clone().expect("clone the operator log");
        let api_port = free_port();
        let mut command = Command::new(env!("CARGO_BIN_EXE_proxy-operator"));
        // Only what the test sets: no `PG*` (PGAPPNAME, PGSSLMODE …), no other roots.
        for (name, _) in std::env::vars_os() {
            let name_text = name.to_string_lossy();
            if name_text.starts_with("PG")
                || name_text.starts_with("PROXY_OPERATOR_")
                || name_text.starts_with("SSL_CERT_")
            {
                command.env_remove(&name);
            }
        }
        let child = command
            .args(["standalone", "--inventory"])
            .arg(&inventory)
            .args(["--ledger", url])
            .args(["--ledger-pool-size", "2"])
            .args(["--discovery-addr", &format!("127.0.0.1:{api_port}")])
            .args(["--metrics-addr", &format!("127.0.0.1:{}", free_port())])
            .args(["--gateway-addr", "off"])
            .env("DISCOVERY_TOKEN", TOKEN)
            .env("SSL_CERT_FILE", ssl_cert_file)
            .env("RUST_LOG", "warn,proxy_operator::ledger=info")
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .expect("start proxy-operator standalone");
        Operator {
            child,
            api: format!("http://127.0.0.1:{api_port}"),
            log,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Polls `/readyz` until it answers 200, and returns its body; panics with the log when
    /// the process exits or [`DEADLINE`] passes first.
    async fn wait_ready(&mut self) -> Value {
        let http = crate::support::http::client();
        let url = format!("{}/readyz", self.api);
        let start = Instant::now();
        let mut last: String;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("proxy-operator exited ({status}):\n{}", self.log());
            }
            match http.get(&url).send().await {
                Ok(response) if response.status() == StatusCode::OK => {
                    return response.json().await.expect("/readyz answers JSON");
                }
                Ok(response) => {
                    last = format!(
                        "{}: {}",
                        response.status(),
                        response.text().await.unwrap_or_default()
                    );
                }
                Err(e) => last = e.to_string(),
            }
            assert!(
                start.elapsed() < DEADLINE,
                "/readyz not 200 after {DEADLINE:?} ({last}); log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until the process exits; panics with the log when it still runs after
    /// [`DEADLINE`].
    async fn wait_exit(&mut self) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("poll proxy-operator") {
                return status;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "proxy-operator still runs after {DEADLINE:?}; log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- proxy-operator log ---\n{}", self.log());
        }
    }
}

/// Polls `sql` on `database` until it answers something, and returns that; panics with
/// `server`'s log after [`DEADLINE`].
async fn first_answer(server: &Postgres, database: &Database, sql: &str) -> String {
    let start = Instant::now();
    loop {
        let answer = database.psql(sql);
        if !answer.is_empty() {
            return answer;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "{sql:?} answered nothing within {DEADLINE:?}; postgres.log:\n{}",
            server.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_require_verifies_the_server_against_ssl_cert_file_and_connects_over_tls() {
    let Some((server, tls)) = Postgres::start_with_tls() else {
        return;
    };
    let database = server.database();
    let dir = tempfile::tempdir().expect("a temp dir");
    let url = format!("{}?sslmode=require", database.url());
    let mut operator = Operator::start(dir.path(), &url, &tls.ca);
    let ready = operator.wait_ready().await;
    assert_eq!(ready["database"], "up", "{ready}");
    assert_eq!(
        first_answer(&server, &database, &operator_ssl_sql(&database)).await,
        "t",
        "the server sees every connection of the operator as TLS; log:\n{}",
        operator.log()
    );
    let log = operator.log();
    assert!(log.contains("TLS required"), "{log}");
    assert!(!log.contains(database.password()), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_require_refuses_a_server_certificate_no_trusted_ca_signed() {
    let Some((server, _tls)) = Postgres::start_with_tls() else {
        return;
    };
    let database = server.database();
    let dir = tempfile::tempdir().expect("a temp dir");
    // Another CA only: the system roots are not read when SSL_CERT_FILE is set.
    let unrelated = dir.path().join("unrelated-ca.pem");
    std::fs::write(&unrelated, TestTls::new().ca_pem).expect("write the unrelated CA");
    let url = format!("{}?sslmode=require", database.url());
    let mut operator = Operator::start(dir.path(), &url, &unrelated);
    let status = operator.wait_exit().await;
    let log = operator.log();
    assert!(!status.success(), "{status}; log:\n{log}");
    // E.g. `cannot start: --ledger: the ledger's database cannot be reached (user … database
    // …: error performing TLS handshake: invalid peer certificate: UnknownIssuer)`.
    assert!(log.contains("cannot start: --ledger:"), "{log}");
    assert!(
        log.contains(&format!("database {}", database.name())),
        "the message names the database: {log}"
    );
    let lower = log.to_lowercase();
    assert!(
        lower.contains("tls handshake") && lower.contains("certificate"),
        "the message names a certificate problem: {log}"
    );
    assert!(
        !log.contains(database.password()),
        "the password is printed: {log}"
    );
    // Nothing got in: the server saw no session of the operator.
    assert_eq!(
        database.psql(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'proxy-operator'"
        ),
        "0"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_disable_connects_in_the_clear_to_a_server_with_tls_on() {
    let Some((server, tls)) = Postgres::start_with_tls() else {
        return;
    };
    let database = server.database();
    let dir = tempfile::tempdir().expect("a temp dir");
    let url = format!("{}?sslmode=disable", database.url());
    let mut operator = Operator::start(dir.path(), &url, &tls.ca);
    let ready = operator.wait_ready().await;
    assert_eq!(ready["database"], "up", "{ready}");
    assert_eq!(
        first_answer(&server, &database, &operator_ssl_sql(&database)).await,
        "f",
        "the server sees the operator's connections in the clear; log:\n{}",
        operator.log()
    );
    let log = operator.log();
    assert!(log.contains("TLS off"), "{log}");
}
