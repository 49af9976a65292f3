//! The lease ledger against real SQLite files in temporary directories.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use jiff::Timestamp;
use proxy_operator::ledger::{
    AcquireOutcome, Candidate, Durability, Lease, LeaseState, Ledger, LedgerConfig, LedgerError,
    ManualClock, NoMatch, ReportResult, SCHEMA_VERSION, SweepStats, SystemClock,
};
use proxy_operator::proxy::ProxyId;
use tempfile::TempDir;

const MINUTE: Duration = Duration::from_secs(60);

fn start() -> Timestamp {
    "2026-01-01T00:00:00Z".parse().unwrap()
}

fn config() -> LedgerConfig {
    LedgerConfig {
        max_ttl: Duration::from_secs(3600),
        cooldown: 10 * MINUTE,
        history_retention: Duration::from_secs(24 * 3600),
        durability: Durability::Normal,
    }
}

struct Fixture {
    _dir: TempDir,
    path: PathBuf,
    clock: Arc<ManualClock>,
    ledger: Ledger,
}

impl Fixture {
    fn new() -> Self {
        Self::with_config(config())
    }

    fn with_config(config: LedgerConfig) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.db");
        let clock = Arc::new(ManualClock::new(start()));
        let ledger = Ledger::open(&path, config, clock.clone()).unwrap();
        Self {
            _dir: dir,
            path,
            clock,
            ledger,
        }
    }

    fn reopen(&mut self) {
        self.ledger = Ledger::open(&self.path, config(), self.clock.clone()).unwrap();
    }

    fn raw(&self) -> rusqlite::Connection {
        rusqlite::Connection::open(&self.path).unwrap()
    }

    /// `(kind, target, result)` of every history row of one lease, in order.
    fn events(&self, lease_id: &str) -> Vec<(String, Option<String>, Option<String>)> {
        let conn = self.raw();
        let mut stmt = conn
            .prepare(
                "SELECT kind, target, result FROM lease_events WHERE lease_id = ?1 ORDER BY seq",
            )
            .unwrap();
        stmt.query_map([lease_id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }

    fn count(&self, sql: &str) -> i64 {
        self.raw().query_row(sql, [], |r| r.get(0)).unwrap()
    }
}

fn candidate(name: &str, max_leases: u32, healthy: bool, latency_ms: Option<u64>) -> Candidate {
    Candidate {
        proxy: ProxyId {
            namespace: "crawl".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
        },
        max_leases,
        healthy,
        latency: latency_ms.map(Duration::from_millis),
    }
}

fn granted(outcome: AcquireOutcome) -> Lease {
    match outcome {
        AcquireOutcome::Granted(lease) => lease,
        AcquireOutcome::NoMatch(stats) => panic!("expected a lease, got {stats:?}"),
    }
}

fn no_match(outcome: AcquireOutcome) -> NoMatch {
    match outcome {
        AcquireOutcome::NoMatch(stats) => stats,
        AcquireOutcome::Granted(lease) => panic!("expected no match, got {lease:?}"),
    }
}

#[test]
fn open_migrates_once_uses_wal_and_reopening_is_a_no_op() {
    let mut f = Fixture::new();
    let version: u32 = f
        .raw()
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION);
    let mode: String = f
        .raw()
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "wal");
    let lease = granted(
        f.ledger
            .acquire(&[candidate("a", 1, true, None)], None, MINUTE)
            .unwrap(),
    );
    f.reopen();
    f.reopen();
    assert_eq!(f.ledger.get(&lease.id).unwrap(), Some(lease));
    let version: u32 = f
        .raw()
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION);
}

#[test]
fn full_durability_opens_and_keeps_leases_across_reopening() {
    let mut f = Fixture::with_config(LedgerConfig {
        durability: Durability::Full,
        ..config()
    });
    let lease = granted(
        f.ledger
            .acquire(&[candidate("a", 1, true, None)], None, MINUTE)
            .unwrap(),
    );
    f.reopen();
    assert_eq!(f.ledger.get(&lease.id).unwrap(), Some(lease));
}

#[test]
fn a_database_from_a_newer_binary_is_refused() {
    let f = Fixture::new();
    f.raw()
        .pragma_update(None, "user_version", SCHEMA_VERSION + 1)
        .unwrap();
    let err = Ledger::open(&f.path, config(), f.clock.clone()).unwrap_err();
    match &err {
        LedgerError::Newer {
            path,
            found,
            supported,
        } => {
            assert_eq!(path, &f.path);
            assert_eq!((*found, *supported), (SCHEMA_VERSION + 1, SCHEMA_VERSION));
        }
        other => panic!("expected Newer, got {other:?}"),
    }
    let message = err.to_string();
    assert!(message.contains(&f.path.display().to_string()), "{message}");
    assert!(message.contains("newer"), "{message}");
}

#[test]
fn open_errors_name_the_file_and_bad_config_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("missing-dir").join("ledger.db");
    let err = Ledger::open(&path, config(), Arc::new(SystemClock)).unwrap_err();
    assert!(matches!(err, LedgerError::Open { .. }), "{err:?}");
    assert!(err.to_string().contains("missing-dir"), "{err}");

    let not_a_db = dir.path().join("notes.txt");
    std::fs::write(
        &not_a_db,
        "this is not a database, just some text ".repeat(200),
    )
    .unwrap();
    let err = Ledger::open(&not_a_db, config(), Arc::new(SystemClock)).unwrap_err();
    assert!(err.to_string().contains("notes.txt"), "{err}");

    for bad in [
        LedgerConfig {
            max_ttl: Duration::ZERO,
            ..config()
        },
        LedgerConfig {
            cooldown: Duration::MAX,
            ..config()
        },
    ] {
        let err = Ledger::open(&dir.path().join("x.db"), bad, Arc::new(SystemClock)).unwrap_err();
        assert!(matches!(err, LedgerError::Config(_)), "{err:?}");
    }
}

#[test]
fn acquire_spreads_over_the_least_loaded_proxies_and_records_history() {
    let f = Fixture::new();
    let candidates = [
        candidate("slow", 2, true, Some(80)),
        candidate("fast", 2, true, Some(10)),
        candidate("unknown", 2, true, None),
    ];
    let order: Vec<String> = (0..6)
        .map(|_| {
            granted(
                f.ledger
                    .acquire(&candidates, Some("example.com"), MINUTE)
                    .unwrap(),
            )
            .proxy
            .name
        })
        .collect();
    assert_eq!(
        order,
        ["fast", "slow", "unknown", "fast", "slow", "unknown"]
    );

    let stats = no_match(f.ledger.acquire(&candidates, None, MINUTE).unwrap());
    assert_eq!(
        stats,
        NoMatch {
            considered: 3,
            at_capacity: 3,
            retry_after: Some(start() + MINUTE),
            ..NoMatch::default()
        }
    );

    let lease = granted(
        f.ledger
            .acquire(
                &[candidate("other", 1, true, None)],
                Some("example.com"),
                MINUTE,
            )
            .unwrap(),
    );
    assert_eq!(lease.proxy.uid, "uid-other");
    assert_eq!(lease.proxy.namespace, "crawl");
    assert_eq!(lease.target.as_deref(), Some("example.com"));
    assert_eq!(lease.state, LeaseState::Active);
    assert_eq!(lease.acquired_at, start());
    assert_eq!(lease.expires_at, start() + MINUTE);
    assert_eq!(lease.ttl, MINUTE);
    assert_eq!(lease.released_at, None);
    assert_eq!(f.ledger.get(&lease.id).unwrap(), Some(lease.clone()));
    assert_eq!(
        f.events(&lease.id),
        [("acquired".to_owned(), Some("example.com".to_owned()), None)]
    );
    assert_eq!(f.ledger.active_total().unwrap(), 7);
    assert_eq!(
        f.ledger.active_counts().unwrap(),
        HashMap::from([
            ("uid-slow".to_owned(), 2),
            ("uid-fast".to_owned(), 2),
            ("uid-unknown".to_owned(), 2),
            ("uid-other".to_owned(), 1),
        ])
    );
}

#[test]
fn unhealthy_and_zero_capacity_proxies_are_never_leased() {
    let f = Fixture::new();
    let candidates = [
        candidate("sick", 5, false, Some(1)),
        candidate("zero", 0, true, Some(1)),
    ];
    let stats = no_match(f.ledger.acquire(&candidates, None, MINUTE).unwrap());
    assert_eq!(
        stats,
        NoMatch {
            considered: 2,
            at_capacity: 1,
            unhealthy: 1,
            ..NoMatch::default()
        }
    );
    assert_eq!(f.ledger.active_total().unwrap(), 0);
    assert_eq!(f.count("SELECT COUNT(*) FROM lease_events"), 0);
    let stats = no_match(f.ledger.acquire(&[], None, MINUTE).unwrap());
    assert_eq!(stats, NoMatch::default());
}

#[test]
fn ttl_is_capped_and_must_not_be_zero() {
    let f = Fixture::new();
    let c = [candidate("a", 5, true, None)];
    let lease = granted(
        f.ledger
            .acquire(&c, None, Duration::from_secs(86_400))
            .unwrap(),
    );
    assert_eq!(lease.ttl, Duration::from_secs(3600));
    assert_eq!(lease.expires_at, start() + Duration::from_secs(3600));
    for ttl in [Duration::ZERO, Duration::from_micros(999)] {
        let err = f.ledger.acquire(&c, None, ttl).unwrap_err();
        assert!(
            matches!(err, LedgerError::InvalidTtl(t) if t == ttl),
            "{err:?}"
        );
        let err = f.ledger.renew(&lease.id, ttl).unwrap_err();
        assert!(matches!(err, LedgerError::InvalidTtl(_)), "{err:?}");
    }
    let renewed = f.ledger.renew(&lease.id, Duration::MAX).unwrap();
    assert_eq!(renewed.ttl, Duration::from_secs(3600));
}

#[test]
fn an_expired_lease_stops_counting_before_the_sweep() {
    let f = Fixture::new();
    let c = [candidate("a", 1, true, None)];
    let first = granted(f.ledger.acquire(&c, None, MINUTE).unwrap());
    f.clock.advance(MINUTE - Duration::from_millis(1));
    assert_eq!(
        no_match(f.ledger.acquire(&c, None, MINUTE).unwrap()).retry_after,
        Some(first.expires_at)
    );
    f.clock.advance(Duration::from_millis(1));
    let second = granted(f.ledger.acquire(&c, None, MINUTE).unwrap());
    assert_ne!(first.id, second.id);
    assert_eq!(
        f.ledger.get(&first.id).unwrap().unwrap().state,
        LeaseState::Expired
    );
    assert_eq!(f.ledger.active_total().unwrap(), 1);
}

#[test]
fn renew_extends_active_leases_only() {
    let f = Fixture::new();
    let c = [candidate("a", 3, true, None)];
    let lease = granted(f.ledger.acquire(&c, Some("t.example"), MINUTE).unwrap());
    f.clock.advance(Duration::from_secs(50));
    let renewed = f.ledger.renew(&lease.id, 2 * MINUTE).unwrap();
    assert_eq!(
        renewed.expires_at,
        start() + Duration::from_secs(50) + 2 * MINUTE
    );
    assert_eq!(renewed.ttl, 2 * MINUTE);
    assert_eq!(renewed.acquired_at, lease.acquired_at);
    assert_eq!(f.ledger.get(&lease.id).unwrap(), Some(renewed.clone()));
    f.clock.advance(MINUTE);
    assert_eq!(
        f.ledger.active_total().unwrap(),
        1,
        "renewed lease still counts"
    );
    let kinds: Vec<String> = f.events(&lease.id).into_iter().map(|e| e.0).collect();
    assert_eq!(kinds, ["acquired", "renewed"]);

    f.ledger.release(&lease.id).unwrap();
    let err = f.ledger.renew(&lease.id, MINUTE).unwrap_err();
    assert!(
        matches!(&err, LedgerError::NotActive { id, state: LeaseState::Released } if *id == lease.id),
        "{err:?}"
    );

    let short = granted(f.ledger.acquire(&c, None, MINUTE).unwrap());
    f.clock.advance(MINUTE);
    let err = f.ledger.renew(&short.id, MINUTE).unwrap_err();
    assert!(
        matches!(
            err,
            LedgerError::NotActive {
                state: LeaseState::Expired,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!("lease {:?} is expired, not active", short.id)
    );

    let err = f.ledger.renew("no-such-lease", MINUTE).unwrap_err();
    assert!(matches!(&err, LedgerError::UnknownLease(id) if id == "no-such-lease"));
}

#[test]
fn release_is_idempotent_and_frees_the_slot() {
    let f = Fixture::new();
    let c = [candidate("a", 1, true, None)];
    let lease = granted(f.ledger.acquire(&c, None, MINUTE).unwrap());
    no_match(f.ledger.acquire(&c, None, MINUTE).unwrap());
    f.clock.advance(Duration::from_secs(5));
    f.ledger.release(&lease.id).unwrap();
    f.ledger.release(&lease.id).unwrap();
    f.ledger.release("never-issued").unwrap();
    let released = f.ledger.get(&lease.id).unwrap().unwrap();
    assert_eq!(released.state, LeaseState::Released);
    assert_eq!(released.released_at, Some(start() + Duration::from_secs(5)));
    let kinds: Vec<String> = f.events(&lease.id).into_iter().map(|e| e.0).collect();
    assert_eq!(kinds, ["acquired", "released"]);
    granted(f.ledger.acquire(&c, None, MINUTE).unwrap());

    // Releasing after the TTL ran out changes nothing: the lease already expired.
    let late = granted(
        f.ledger
            .acquire(&[candidate("b", 1, true, None)], None, MINUTE)
            .unwrap(),
    );
    f.clock.advance(2 * MINUTE);
    f.ledger.release(&late.id).unwrap();
    assert_eq!(
        f.ledger.get(&late.id).unwrap().unwrap().state,
        LeaseState::Expired
    );
    assert_eq!(f.events(&late.id).len(), 1);
}

#[test]
fn rate_limited_and_blocked_reports_cool_the_proxy_down_for_that_target() {
    for result in [ReportResult::RateLimited, ReportResult::Blocked] {
        let f = Fixture::new();
        let c = [
            candidate("a", 5, true, Some(1)),
            candidate("b", 5, true, Some(9)),
        ];
        let lease = granted(f.ledger.acquire(&c, Some("shop.example"), MINUTE).unwrap());
        assert_eq!(lease.proxy.name, "a");
        f.clock.advance(Duration::from_secs(1));
        let reported = f.ledger.report(&lease.id, result, None).unwrap();
        assert_eq!(reported.id, lease.id);
        assert_eq!(f.ledger.cooldowns_active().unwrap(), 1);
        assert_eq!(
            f.events(&lease.id)[1],
            (
                "reported".to_owned(),
                Some("shop.example".to_owned()),
                Some(result.as_str().to_owned())
            )
        );

        // Released, "a" would win on load and latency; the cooldown makes the target skip it.
        f.ledger.release(&lease.id).unwrap();
        let next = granted(f.ledger.acquire(&c, Some("shop.example"), MINUTE).unwrap());
        assert_eq!(next.proxy.name, "b", "{result}");
        f.ledger.release(&next.id).unwrap();
        // Another target and no target are not affected.
        let other = granted(f.ledger.acquire(&c, Some("news.example"), MINUTE).unwrap());
        assert_eq!(other.proxy.name, "a");
        f.ledger.release(&other.id).unwrap();
        let untargeted = granted(f.ledger.acquire(&c, None, MINUTE).unwrap());
        assert_eq!(untargeted.proxy.name, "a");
        f.ledger.release(&untargeted.id).unwrap();

        // Only "a" offered for the cooled target: no match, retry when the cooldown ends.
        let cooldown_end = start() + Duration::from_secs(1) + 10 * MINUTE;
        let stats = no_match(
            f.ledger
                .acquire(&c[..1], Some("shop.example"), MINUTE)
                .unwrap(),
        );
        assert_eq!(
            stats,
            NoMatch {
                considered: 1,
                in_cooldown: 1,
                retry_after: Some(cooldown_end),
                ..NoMatch::default()
            }
        );
        f.clock.set(cooldown_end);
        assert_eq!(f.ledger.cooldowns_active().unwrap(), 0);
        let back = granted(f.ledger.acquire(&c, Some("shop.example"), MINUTE).unwrap());
        assert_eq!(back.proxy.name, "a");
    }
}

#[test]
fn report_target_defaults_to_the_lease_target_and_without_any_no_cooldown_is_keyed() {
    let f = Fixture::new();
    let c = [candidate("a", 5, true, None)];
    let untargeted = granted(f.ledger.acquire(&c, None, MINUTE).unwrap());
    f.ledger
        .report(&untargeted.id, ReportResult::RateLimited, None)
        .unwrap();
    assert_eq!(f.ledger.cooldowns_active().unwrap(), 0);
    assert_eq!(
        f.events(&untargeted.id)[1],
        ("reported".to_owned(), None, Some("rate_limited".to_owned()))
    );

    // An explicit target overrides (or supplies) the lease's.
    f.ledger
        .report(
            &untargeted.id,
            ReportResult::Blocked,
            Some("explicit.example"),
        )
        .unwrap();
    assert_eq!(f.ledger.cooldowns_active().unwrap(), 1);
    let stats = no_match(
        f.ledger
            .acquire(&c, Some("explicit.example"), MINUTE)
            .unwrap(),
    );
    assert_eq!(stats.in_cooldown, 1);

    for result in [ReportResult::Ok, ReportResult::Error] {
        let lease = granted(f.ledger.acquire(&c, Some("fine.example"), MINUTE).unwrap());
        f.ledger.report(&lease.id, result, None).unwrap();
        assert_eq!(f.ledger.cooldowns_active().unwrap(), 1, "{result}");
        assert_eq!(f.events(&lease.id)[1].2.as_deref(), Some(result.as_str()));
    }

    let err = f
        .ledger
        .report("no-such-lease", ReportResult::Ok, None)
        .unwrap_err();
    assert!(matches!(&err, LedgerError::UnknownLease(id) if id == "no-such-lease"));
    assert_eq!(err.to_string(), "unknown lease \"no-such-lease\"");
}

#[test]
fn a_late_report_on_an_expired_lease_still_lands_until_the_lease_is_pruned() {
    let f = Fixture::new();
    let c = [candidate("a", 1, true, None)];
    let lease = granted(f.ledger.acquire(&c, Some("shop.example"), MINUTE).unwrap());
    f.clock.advance(MINUTE + Duration::from_secs(30));
    assert_eq!(
        f.ledger.sweep().unwrap(),
        SweepStats {
            expired: 1,
            ..SweepStats::default()
        }
    );
    let reported = f
        .ledger
        .report(&lease.id, ReportResult::RateLimited, None)
        .unwrap();
    assert_eq!(reported.state, LeaseState::Expired);
    assert_eq!(f.ledger.cooldowns_active().unwrap(), 1);
    let stats = no_match(f.ledger.acquire(&c, Some("shop.example"), MINUTE).unwrap());
    assert_eq!(stats.in_cooldown, 1);
    let kinds: Vec<String> = f.events(&lease.id).into_iter().map(|e| e.0).collect();
    assert_eq!(kinds, ["acquired", "expired", "reported"]);

    // Retained until its expiry is older than the cooldown window, then gone.
    f.clock.set(lease.expires_at + 10 * MINUTE);
    assert_eq!(f.ledger.sweep().unwrap().leases_pruned, 0);
    f.ledger.report(&lease.id, ReportResult::Ok, None).unwrap();
    f.clock.advance(Duration::from_millis(1));
    let stats = f.ledger.sweep().unwrap();
    assert_eq!(stats.leases_pruned, 1);
    assert!(matches!(
        f.ledger.report(&lease.id, ReportResult::RateLimited, None),
        Err(LedgerError::UnknownLease(_))
    ));
    assert_eq!(f.ledger.get(&lease.id).unwrap(), None);
}

#[test]
fn sweep_expires_prunes_cooldowns_and_old_history() {
    let f = Fixture::new();
    let c = [candidate("a", 5, true, None), candidate("b", 5, true, None)];
    let short = granted(f.ledger.acquire(&c, Some("t"), MINUTE).unwrap());
    let long = granted(f.ledger.acquire(&c, Some("t"), 30 * MINUTE).unwrap());
    let released = granted(f.ledger.acquire(&c, None, 30 * MINUTE).unwrap());
    f.ledger.release(&released.id).unwrap();
    f.ledger
        .report(&short.id, ReportResult::RateLimited, None)
        .unwrap();

    f.clock.advance(2 * MINUTE);
    assert_eq!(
        f.ledger.sweep().unwrap(),
        SweepStats {
            expired: 1,
            ..SweepStats::default()
        }
    );
    assert_eq!(
        f.ledger.sweep().unwrap(),
        SweepStats::default(),
        "sweeping twice"
    );
    let expired_at: i64 = f
        .raw()
        .query_row(
            "SELECT at FROM lease_events WHERE lease_id = ?1 AND kind = 'expired'",
            [&short.id],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(expired_at, short.expires_at.as_millisecond());

    // After the cooldown: the cooldown ends, the short lease's retention ends.
    f.clock.set(start() + 12 * MINUTE);
    assert_eq!(
        f.ledger.sweep().unwrap(),
        SweepStats {
            leases_pruned: 1,
            cooldowns_pruned: 1,
            ..SweepStats::default()
        }
    );
    // After 30 min + cooldown the long and released leases go; history stays for a day.
    f.clock.set(start() + 41 * MINUTE);
    let stats = f.ledger.sweep().unwrap();
    assert_eq!((stats.expired, stats.leases_pruned), (1, 2));
    assert_eq!(f.ledger.get(&long.id).unwrap(), None);
    let history = f.count("SELECT COUNT(*) FROM lease_events");
    assert_eq!(history, 7);
    f.clock
        .set(start() + Duration::from_secs(24 * 3600) + 31 * MINUTE);
    assert_eq!(f.ledger.sweep().unwrap().events_pruned, 7);
    assert_eq!(f.count("SELECT COUNT(*) FROM lease_events"), 0);
}

#[test]
fn leases_cooldowns_and_history_survive_reopening() {
    let mut f = Fixture::new();
    let c = [candidate("a", 5, true, None), candidate("b", 5, true, None)];
    let kept = granted(f.ledger.acquire(&c, Some("t"), 30 * MINUTE).unwrap());
    let cooled = granted(f.ledger.acquire(&c, Some("t"), 30 * MINUTE).unwrap());
    f.ledger
        .report(&cooled.id, ReportResult::Blocked, None)
        .unwrap();
    f.ledger.release(&cooled.id).unwrap();
    assert_eq!(
        (kept.proxy.name.as_str(), cooled.proxy.name.as_str()),
        ("a", "b")
    );
    let history = f.count("SELECT COUNT(*) FROM lease_events");
    f.reopen();
    assert_eq!(f.ledger.get(&kept.id).unwrap(), Some(kept.clone()));
    assert_eq!(
        f.ledger.get(&cooled.id).unwrap().unwrap().state,
        LeaseState::Released
    );
    assert_eq!(f.ledger.active_total().unwrap(), 1);
    assert_eq!(f.ledger.cooldowns_active().unwrap(), 1);
    assert_eq!(f.count("SELECT COUNT(*) FROM lease_events"), history);
    let stats = no_match(f.ledger.acquire(&c[1..], Some("t"), MINUTE).unwrap());
    assert_eq!(
        stats.in_cooldown, 1,
        "the cooled proxy is still skipped after reopening"
    );
}

#[test]
fn lease_ids_are_unique_and_carry_128_random_bits() {
    let f = Fixture::new();
    let c = [candidate("a", 1000, true, None)];
    let ids: HashSet<String> = (0..500)
        .map(|_| granted(f.ledger.acquire(&c, None, MINUTE).unwrap()).id)
        .collect();
    assert_eq!(ids.len(), 500);
    let time_prefix = format!("{:012x}", start().as_millisecond());
    for id in &ids {
        assert_eq!(id.len(), 12 + 32, "{id}");
        assert!(id.starts_with(&time_prefix), "{id}");
        assert!(u128::from_str_radix(&id[12..], 16).is_ok(), "{id}");
    }
}

#[test]
fn history_is_append_only() {
    let f = Fixture::new();
    let lease = granted(
        f.ledger
            .acquire(&[candidate("a", 1, true, None)], None, MINUTE)
            .unwrap(),
    );
    let err = f
        .raw()
        .execute("UPDATE lease_events SET kind = 'released'", [])
        .unwrap_err();
    assert!(err.to_string().contains("append-only"), "{err}");
    assert_eq!(f.events(&lease.id).len(), 1);
}

/// Runs `sql` with the sqlite3 command-line shell, as an engineer would.
fn sqlite3(path: &Path, sql: &str) -> String {
    let out = Command::new("sqlite3")
        .arg(path)
        .arg(sql)
        .output()
        .expect("the sqlite3 CLI is installed (see README)");
    assert!(
        out.status.success(),
        "{sql}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_debugging_views_answer_in_the_sqlite3_shell() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let ledger = Ledger::open(&path, config(), Arc::new(SystemClock)).unwrap();
    let c = [
        candidate("a", 5, true, None),
        candidate("b", 5, true, Some(3)),
    ];
    let first = granted(ledger.acquire(&c, Some("shop.example"), MINUTE).unwrap());
    let second = granted(ledger.acquire(&c, Some("shop.example"), MINUTE).unwrap());
    ledger
        .report(&first.id, ReportResult::RateLimited, None)
        .unwrap();
    ledger.release(&first.id).unwrap();

    let per_proxy = sqlite3(&path, "SELECT proxy, leases FROM active_leases_per_proxy;");
    assert_eq!(per_proxy, format!("{}|1\n", second.proxy));
    let active = sqlite3(&path, "SELECT id FROM active_leases;");
    assert_eq!(active, format!("{}\n", second.id));
    let history = sqlite3(
        &path,
        &format!(
            "SELECT kind, result FROM lease_history WHERE lease_id = '{}';",
            first.id
        ),
    );
    assert_eq!(history, "acquired|\nreported|rate_limited\nreleased|\n");
    let cooldowns = sqlite3(&path, "SELECT proxy, target, result FROM active_cooldowns;");
    assert_eq!(
        cooldowns,
        format!("{}|shop.example|rate_limited\n", first.proxy)
    );
    let rate_limited = sqlite3(
        &path,
        "SELECT target, COUNT(*) FROM lease_events WHERE kind = 'reported' \
         AND result = 'rate_limited' \
         AND at > (unixepoch('now') - 3600) * 1000 GROUP BY target;",
    );
    assert_eq!(rate_limited, "shop.example|1\n");
}

#[test]
fn concurrent_acquires_never_exceed_max_leases() {
    const THREADS: usize = 16;
    const ACQUIRES: usize = 500;
    const MAX: u32 = 3;
    const HELD: usize = 4;
    let f = Fixture::new();
    let candidates: Vec<Candidate> = (0..10)
        .map(|i| candidate(&format!("p{i}"), MAX, true, Some(i)))
        .collect();
    let granted_total = AtomicU32::new(0);
    let refused_total = AtomicU32::new(0);
    let done = AtomicBool::new(false);
    let worst = Mutex::new(0u32);
    let observe = |counts: HashMap<String, u32>| {
        let most = counts.values().copied().max().unwrap_or(0);
        let mut worst = worst.lock().unwrap();
        *worst = (*worst).max(most);
        assert!(most <= MAX, "over-granted: {counts:?}");
    };
    thread::scope(|s| {
        // An independent reader that checks committed state at arbitrary moments.
        s.spawn(|| {
            let conn = f.raw();
            let now = start().as_millisecond();
            while !done.load(Ordering::Relaxed) {
                let mut stmt = conn
                    .prepare_cached(
                        "SELECT proxy_uid, COUNT(*) FROM leases \
                         WHERE state = 'active' AND expires_at > ?1 GROUP BY proxy_uid",
                    )
                    .unwrap();
                let counts = stmt
                    .query_map([now], |r| Ok((r.get(0)?, r.get(1)?)))
                    .unwrap()
                    .collect::<Result<HashMap<String, u32>, _>>()
                    .unwrap();
                observe(counts);
            }
        });
        let workers: Vec<_> = (0..THREADS)
            .map(|_| {
                s.spawn(|| {
                    let mut held = std::collections::VecDeque::new();
                    for _ in 0..ACQUIRES {
                        match f.ledger.acquire(&candidates, None, MINUTE).unwrap() {
                            AcquireOutcome::Granted(lease) => {
                                granted_total.fetch_add(1, Ordering::Relaxed);
                                observe(f.ledger.active_counts().unwrap());
                                held.push_back(lease.id);
                            }
                            AcquireOutcome::NoMatch(stats) => {
                                refused_total.fetch_add(1, Ordering::Relaxed);
                                assert_eq!(stats.at_capacity, 10, "{stats:?}");
                            }
                        }
                        if held.len() >= HELD || (held.len() > 1 && fastrand_bit(&held)) {
                            let id = held.pop_front().unwrap();
                            f.ledger.release(&id).unwrap();
                        }
                    }
                    for id in held {
                        f.ledger.release(&id).unwrap();
                    }
                })
            })
            .collect();
        for worker in workers {
            worker.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
    });
    let granted_total = granted_total.into_inner();
    let refused_total = refused_total.into_inner();
    assert_eq!(granted_total + refused_total, (THREADS * ACQUIRES) as u32);
    assert!(
        refused_total > 0,
        "capacity was never reached: the test proves nothing"
    );
    assert_eq!(*worst.lock().unwrap(), MAX, "capacity was never filled");
    assert_eq!(f.ledger.active_total().unwrap(), 0);
    assert_eq!(
        f.count("SELECT COUNT(*) FROM lease_events WHERE kind = 'acquired'"),
        i64::from(granted_total)
    );
    assert_eq!(
        f.count("SELECT COUNT(*) FROM lease_events WHERE kind = 'released'"),
        i64::from(granted_total)
    );
}

/// A cheap varying bit so workers hold a changing number of leases.
fn fastrand_bit(held: &std::collections::VecDeque<String>) -> bool {
    held.back().is_some_and(|id| id.as_bytes()[0] % 2 == 0)
}
