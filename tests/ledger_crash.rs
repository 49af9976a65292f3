//! An acknowledged lease survives the process being killed with SIGKILL: the test runs a child
//! (this same test binary, re-executed) that acquires leases in a loop and prints each ID once
//! `acquire` has returned, kills it mid-run and finds every printed ID in the reopened file.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use proxy_operator::ledger::{
    AcquireOutcome, Candidate, LeaseState, Ledger, LedgerConfig, SystemClock,
};
use proxy_operator::proxy::ProxyId;

/// Set in the child's environment to the ledger path it writes to.
const CHILD_ENV: &str = "PROXY_OPERATOR_LEDGER_CRASH_CHILD";
/// Prefix of the lines the child prints for acknowledged leases.
const ACK: &str = "ACK ";
/// Leases acknowledged before the kill.
const BEFORE_KILL: usize = 400;
/// Upper bound of the child's loop, so a child whose parent died stops by itself.
const CHILD_MAX_ACQUIRES: usize = 200_000;

fn candidates() -> Vec<Candidate> {
    (0..20)
        .map(|i| Candidate {
            proxy: ProxyId {
                namespace: "crawl".into(),
                name: format!("p{i}"),
                uid: format!("uid-{i}"),
            },
            max_leases: 1_000_000,
            healthy: true,
            latency: None,
        })
        .collect()
}

fn open(path: &Path) -> Ledger {
    Ledger::open(path, LedgerConfig::default(), Arc::new(SystemClock)).unwrap()
}

/// The child: acquire, print, repeat.
fn run_child(path: &Path) -> ! {
    let ledger = open(path);
    let candidates = candidates();
    let mut stdout = std::io::stdout().lock();
    for _ in 0..CHILD_MAX_ACQUIRES {
        match ledger
            .acquire(
                &candidates,
                Some("crash.example"),
                Duration::from_secs(3600),
            )
            .unwrap()
        {
            AcquireOutcome::Granted(lease) => {
                writeln!(stdout, "{ACK}{}", lease.id).unwrap();
                stdout.flush().unwrap();
            }
            AcquireOutcome::NoMatch(stats) => panic!("no lease granted: {stats:?}"),
        }
    }
    std::process::exit(0);
}

#[test]
fn acknowledged_leases_survive_sigkill() {
    if let Some(path) = std::env::var_os(CHILD_ENV) {
        run_child(Path::new(&path));
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "acknowledged_leases_survive_sigkill",
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
            if let Some(id) = line.strip_prefix(ACK)
                && lines_tx.send(id.to_owned()).is_err()
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
    for id in &acknowledged {
        let lease = ledger
            .get(id)
            .unwrap()
            .unwrap_or_else(|| panic!("acknowledged lease {id} was lost"));
        assert_eq!(lease.state, LeaseState::Active, "{id}");
    }
    let total = ledger.active_total().unwrap();
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
    let after = ledger
        .acquire(&candidates(), None, Duration::from_secs(60))
        .unwrap();
    assert!(matches!(after, AcquireOutcome::Granted(_)), "{after:?}");
}
