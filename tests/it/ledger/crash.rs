//! An acknowledged lease survives the process being killed with SIGKILL: the test runs a child
//! (this same test binary, re-executed) in which concurrent callers acquire leases in a loop
//! (so the writer commits them in batches) and print each lease ID and request ID once
//! `acquire` has returned, kills it mid-run and finds every printed lease in the reopened file,
//! and every printed request ID answering with its lease.

use proxy_operator::ledger::DEFAULT_TENANT;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use proxy_operator::ledger::{
    AcquireOutcome, AcquireRequest, Candidate, Candidates, LeaseState, Ledger, LedgerConfig,
    RequestKey, SqliteLedger, SqliteOptions, SystemClock,
};
use proxy_operator::resources::proxy::ProxyId;

/// Set in the child's environment to the ledger path it writes to.
const CHILD_ENV: &str = "PROXY_OPERATOR_LEDGER_CRASH_CHILD";
/// Prefix of the lines the child prints for acknowledged leases.
const ACK: &str = "ACK ";
/// Leases acknowledged before the kill.
const BEFORE_KILL: usize = 400;
/// Upper bound of each child caller's loop, so a child whose parent died stops by itself.
const CHILD_MAX_ACQUIRES: usize = 25_000;
/// Concurrent callers in the child.
const CHILD_CALLERS: usize = 8;
/// Fingerprint of every child acquire.
const FINGERPRINT: &str = "crash-test";

fn candidates() -> Candidates {
    (0..20)
        .map(|i| Candidate {
            proxy: Arc::new(ProxyId {
                namespace: "crawl".into(),
                name: format!("p{i}"),
                uid: format!("uid-{i}"),
            }),
            max_leases: 1_000_000,
            healthy: true,
            cordoned: false,
            draining: false,
            latency: None,
        })
        .collect()
}

fn open(path: &Path) -> SqliteLedger {
    SqliteLedger::open(
        path,
        SqliteOptions::default(),
        LedgerConfig::default(),
        Arc::new(SystemClock),
    )
    .unwrap()
}

fn acquire_request(request_id: &str) -> AcquireRequest {
    AcquireRequest {
        client: None,
        candidates: candidates(),
        target: Some("crash.example".into()),
        ttl: Duration::from_secs(3600),
        request: Some(RequestKey {
            id: request_id.into(),
            fingerprint: FINGERPRINT.into(),
        }),
        tenant: proxy_operator::ledger::Tenancy::unrestricted(),
        session: None,
        fallback_step: None,
    }
}

/// The child: concurrent callers acquire, print, repeat.
fn run_child(path: &Path) -> ! {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let ledger = open(path);
    let stdout = Arc::new(Mutex::new(std::io::stdout()));
    runtime.block_on(async {
        let callers: Vec<_> = (0..CHILD_CALLERS)
            .map(|caller| {
                let (ledger, stdout) = (ledger.clone(), stdout.clone());
                tokio::spawn(async move {
                    for n in 0..CHILD_MAX_ACQUIRES {
                        let request_id = format!("caller-{caller}-{n}");
                        match ledger.acquire(acquire_request(&request_id)).await.unwrap() {
                            AcquireOutcome::Granted(lease) => {
                                let mut out = stdout.lock().unwrap();
                                writeln!(out, "{ACK}{} {request_id}", lease.id).unwrap();
                                out.flush().unwrap();
                            }
                            other => panic!("no lease granted: {other:?}"),
                        }
                    }
                })
            })
            .collect();
        for caller in callers {
            caller.await.unwrap();
        }
    });
    std::process::exit(0);
}

#[test]
fn acknowledged_leases_survive_sigkill() {
    if let Some(path) = std::env::var_os(CHILD_ENV) {
        run_child(Path::new(&path));
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    // The harness names a test by its module path without the crate's name.
    let (_, module) = module_path!().split_once("::").unwrap();
    let this_test = format!("{module}::acknowledged_leases_survive_sigkill");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            this_test.as_str(),
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, &path)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (lines_tx, lines) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some((lease_id, request_id)) =
                line.strip_prefix(ACK).and_then(|ack| ack.split_once(' '))
                && lines_tx
                    .send((lease_id.to_owned(), request_id.to_owned()))
                    .is_err()
            {
                break;
            }
        }
    });

    let mut acknowledged = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while acknowledged.len() < BEFORE_KILL {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(id) => acknowledged.push(id),
            Err(e) => panic!("child acknowledged only {} leases: {e}", acknowledged.len()),
        }
    }
    child.kill().unwrap(); // SIGKILL
    let status = child.wait().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9),
        "the child must die of SIGKILL mid-run, not finish: {status:?}"
    );
    reader.join().unwrap();
    // Everything the child printed before it died was acknowledged too.
    acknowledged.extend(lines.try_iter());

    let ledger = open(&path);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    for (id, request_id) in &acknowledged {
        let lease = runtime
            .block_on(ledger.get(id, DEFAULT_TENANT))
            .unwrap()
            .unwrap_or_else(|| panic!("acknowledged lease {id} was lost"));
        assert_eq!(lease.state, LeaseState::Active, "{id}");
        let replay = runtime
            .block_on(ledger.acquire(acquire_request(request_id)))
            .unwrap();
        assert_eq!(replay, AcquireOutcome::Replayed(lease), "{request_id}");
    }
    let total = ledger.counts().active_total();
    assert!(
        total >= acknowledged.len() as u64,
        "{total} active < {} acknowledged",
        acknowledged.len()
    );
    let conn = rusqlite::Connection::open(&path).unwrap();
    let check: String = conn
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(check, "ok");
    runtime.block_on(ledger.self_check()).unwrap();
    let after = runtime
        .block_on(ledger.acquire(acquire_request("after-restart")))
        .unwrap();
    assert!(matches!(after, AcquireOutcome::Granted(_)), "{after:?}");
}
