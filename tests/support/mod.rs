//! Real parts for tests and benches: a squid forward proxy on a loopback port, and a loopback
//! HTTP + HTTPS probe target whose answer (status, delay) is set by the test.
//!
//! Used by integration tests with `mod support;` and by benches with
//! `#[path = "../tests/support/mod.rs"] mod support;`. Not every user needs every helper.
#![allow(dead_code, unused_imports)]

pub mod browser;
pub mod crawl_load;
pub mod curl;
pub mod dante;
pub mod echo;
pub mod envtest;
pub mod fleet;
pub mod gateway_ca;
pub mod http;
pub mod kubelet;
pub mod ledger;
pub mod loopback;
pub mod mock_api;
pub mod open_loop;
pub mod operator;
pub mod pod;
pub mod pools;
pub mod postgres;
pub mod prometheus;
pub mod python;
pub mod raw;
pub mod render;
pub mod site;
pub mod skip;
pub mod squid;
pub mod standalone;
pub mod stub_provider;
pub mod target;
pub mod tls_load;
pub mod world;
pub mod wrk;

pub use envtest::ControlPlane;
pub use kubelet::{Behaviour, Kubelet};
pub use squid::{Squid, SquidOptions, free_port, loopback_listener};
pub use target::Target;

use std::time::{Duration, Instant};

/// Generous deadline for conditions that depend on real processes on a loaded machine.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// Polls until the server `child` just spawned listens on `addr`: the child back, or `None`
/// once it has exited or [`DEADLINE`] has passed (then it is killed and reaped).
pub fn listening(
    mut child: std::process::Child,
    addr: std::net::SocketAddr,
) -> Option<std::process::Child> {
    let deadline = Instant::now() + DEADLINE;
    loop {
        if std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Some(child);
        }
        let exited = matches!(child.try_wait(), Ok(Some(_)));
        if exited || Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `name` when `name <version_args…>` runs and succeeds; otherwise `None`, skipped (see
/// [`skip::skip`]) for want of it and saying `how_to_install`.
pub fn required_tool(
    name: &'static str,
    version_args: &[&str],
    how_to_install: &str,
) -> Option<&'static str> {
    let runs = std::process::Command::new(name)
        .args(version_args)
        .output()
        .is_ok_and(|output| output.status.success());
    if runs {
        return Some(name);
    }
    skip::skip(format!("{name} is not on PATH ({how_to_install})"));
    None
}

/// Polls `condition` every 10 ms until it holds, panicking with `what` after [`DEADLINE`].
pub async fn wait_until(what: &str, condition: impl FnMut() -> bool) {
    wait_until_within(what, DEADLINE, condition).await;
}

/// [`wait_until`] with a deadline of its own, for what is paced by the disk.
pub async fn wait_until_within(
    what: &str,
    deadline: Duration,
    mut condition: impl FnMut() -> bool,
) {
    let start = Instant::now();
    while !condition() {
        assert!(
            start.elapsed() < deadline,
            "timed out after {deadline:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Runs `sql` against the ledger file `db` with the `sqlite3` command-line shell, as an
/// engineer would, and returns its trimmed output.
pub fn sqlite3(db: &std::path::Path, sql: &str) -> String {
    let output = std::process::Command::new("sqlite3")
        .arg(db)
        .arg(sql)
        .output()
        .expect("the sqlite3 CLI is installed (apt-get install -y sqlite3)");
    assert!(
        output.status.success(),
        "{sql}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

/// Another connection holding a ledger file's write lock, so the ledger's writer waits in its
/// `BEGIN IMMEDIATE` while a test queues writes behind it.
pub struct FileLock(rusqlite::Connection);

impl FileLock {
    pub fn take(path: &std::path::Path) -> Self {
        let conn = rusqlite::Connection::open(path).expect("open the ledger file");
        conn.execute_batch("BEGIN IMMEDIATE")
            .expect("take the ledger's write lock");
        FileLock(conn)
    }

    pub fn release(self) {
        self.0
            .execute_batch("ROLLBACK")
            .expect("release the ledger's write lock");
    }
}

/// Polls a future once, which queues a ledger write; returns its answer if it already has one.
pub async fn queue<F: std::future::Future + Unpin>(write: &mut F) -> Option<F::Output> {
    match futures::poll!(write) {
        std::task::Poll::Ready(answer) => Some(answer),
        std::task::Poll::Pending => None,
    }
}

/// Serves the lease API over `state` the way the binary does (`api::serve`), on a free
/// loopback port, accepting `token`; returns the base URL and the server's handle.
pub fn serve_api(
    state: proxy_operator::api::ApiState,
    token: &str,
) -> (String, actix_web::dev::ServerHandle) {
    use proxy_operator::api;
    use proxy_operator::serving::tokens::{ApiToken, TokenSet};
    let listener = loopback_listener();
    let base = format!("http://{}", listener.local_addr().expect("its address"));
    let tokens = TokenSet::single(token.as_bytes(), "TOKEN").expect("a valid test token");
    let server = api::serve(listener, state, ApiToken::new(tokens)).expect("the API serves");
    let handle = server.handle();
    tokio::spawn(server);
    (base, handle)
}

/// `sha256:<hex>` of `token`, as a tenants file lists a token.
pub fn token_digest(token: &str) -> String {
    use sha2::{Digest, Sha256};
    let hex: String = Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("sha256:{hex}")
}
