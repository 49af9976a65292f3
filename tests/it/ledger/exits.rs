//! Proxies' exits in the ledger, each behaviour test run on both backends (a real SQLite
//! file, a fresh database on the real PostgreSQL server): a change is recorded once however
//! often the same exit is recorded, the first exit is a change from nothing, a stable exit's
//! row is confirmed rarely and survives the sweep while a gone proxy's row does not, and the
//! history reads back per proxy. Then what PostgreSQL adds: two replicas recording the same
//! change at once record it once. Time only moves through the ledger's `ManualClock`.

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use proxy_operator::ledger::{
    ExitRecord, ExitSeen, Ledger, LedgerConfig, ManualClock, PostgresLedger, PostgresOptions,
};
use proxy_operator::resources::proxy::ProxyId;
use support::ledger::{Backend, Fixture, start};
use support::postgres::Postgres;

const HOUR: Duration = Duration::from_secs(3600);

fn config() -> LedgerConfig {
    LedgerConfig {
        history_retention: 24 * HOUR,
        ..LedgerConfig::default()
    }
}

fn record(name: &str, ip: &str) -> ExitRecord {
    ExitRecord {
        proxy: ProxyId {
            namespace: "crawl".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
        },
        exit_ip: ip.into(),
        country: Some("DE".into()),
        asn: Some(64500),
    }
}

fn ms(offset: Duration) -> i64 {
    (start() + offset).as_millisecond()
}

impl Fixture {
    fn at(&self, offset: Duration) {
        self.clock.set(start() + offset);
    }

    async fn exit(&self, name: &str, ip: &str) -> ExitSeen {
        self.ledger.record_exit(record(name, ip)).await.unwrap()
    }

    /// `previous → exit` of every change of `name`, oldest first.
    async fn history(&self, name: &str) -> Vec<String> {
        let mut changes = self
            .ledger
            .exit_changes(Some(("crawl".into(), name.into())), 100)
            .await
            .unwrap();
        changes.reverse();
        changes
            .iter()
            .map(|c| {
                format!(
                    "{} → {}",
                    c.previous_ip.as_deref().unwrap_or("-"),
                    c.exit_ip
                )
            })
            .collect()
    }
}

async fn a_change_is_recorded_once_however_often_the_exit_is_seen(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    let first = f.exit("a", "192.0.2.1").await;
    assert_eq!(
        first,
        ExitSeen {
            changed_at_ms: ms(Duration::ZERO),
            changed: true
        }
    );
    for minute in 1..=5 {
        f.at(Duration::from_secs(60 * minute));
        let again = f.exit("a", "192.0.2.1").await;
        assert_eq!(
            again,
            ExitSeen {
                changed_at_ms: ms(Duration::ZERO),
                changed: false
            }
        );
    }
    f.at(HOUR);
    let moved = f.exit("a", "192.0.2.2").await;
    assert_eq!(
        moved,
        ExitSeen {
            changed_at_ms: ms(HOUR),
            changed: true
        }
    );
    f.at(2 * HOUR);
    assert!(!f.exit("a", "192.0.2.2").await.changed);
    // Back to the first address: a change again.
    f.at(3 * HOUR);
    assert!(f.exit("a", "192.0.2.1").await.changed);
    assert_eq!(
        f.history("a").await,
        [
            "- → 192.0.2.1",
            "192.0.2.1 → 192.0.2.2",
            "192.0.2.2 → 192.0.2.1"
        ]
    );
    // Another proxy's history is its own; the unfiltered read has everyone's, newest first.
    f.exit("b", "192.0.2.1").await;
    assert_eq!(f.history("b").await, ["- → 192.0.2.1"]);
    let all = f.ledger.exit_changes(None, 2).await.unwrap();
    let names: Vec<&str> = all.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["b", "a"]);
    assert_eq!(all[0].country.as_deref(), Some("DE"));
    assert_eq!(all[0].asn, Some(64500));
}

async fn a_stable_exit_outlives_the_sweep_and_a_gone_proxys_does_not(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    f.exit("stable", "192.0.2.1").await;
    f.exit("gone", "192.0.2.9").await;
    // The stable proxy is checked through the day; its row is confirmed on the way (half the
    // retention), with no new history row.
    for hour in [6, 13, 20] {
        f.at(hour * HOUR);
        assert!(!f.exit("stable", "192.0.2.1").await.changed);
    }
    f.at(25 * HOUR);
    f.ledger.sweep().await.unwrap();
    assert_eq!(f.count("SELECT COUNT(*) FROM proxy_exits"), 1);
    // History older than the retention is pruned like lease history.
    assert_eq!(f.count("SELECT COUNT(*) FROM exit_changes"), 0);
    // The stable proxy's exit did not change, so nothing is recorded again.
    let seen = f.exit("stable", "192.0.2.1").await;
    assert_eq!(
        seen,
        ExitSeen {
            changed_at_ms: ms(Duration::ZERO),
            changed: false
        }
    );
    // The gone proxy, back under the same UID, starts afresh.
    assert!(f.exit("gone", "192.0.2.9").await.changed);
}

crate::on_both_backends!(
    a_change_is_recorded_once_however_often_the_exit_is_seen,
    a_stable_exit_outlives_the_sweep_and_a_gone_proxys_does_not,
);

/// Two replicas seeing the same change at once (each checks the proxy) record it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_on_one_postgres_database_record_a_change_once() {
    let Some(server) = Postgres::shared() else {
        return;
    };
    let database = server.database();
    let clock = Arc::new(ManualClock::new(start()));
    let open = || async {
        let options = PostgresOptions {
            password: None,
            pool_size: 4,
        };
        PostgresLedger::open(&database.url(), options, config(), clock.clone())
            .await
            .unwrap()
    };
    let (one, two) = (open().await, open().await);
    for (round, ip) in ["192.0.2.1", "192.0.2.2", "192.0.2.3"].iter().enumerate() {
        clock.set(start() + HOUR * u32::try_from(round).unwrap());
        let (a, b) = tokio::join!(
            one.record_exit(record("a", ip)),
            two.record_exit(record("a", ip))
        );
        let changed = [a.unwrap().changed, b.unwrap().changed];
        assert_eq!(
            changed.iter().filter(|c| **c).count(),
            1,
            "{ip}: {changed:?}"
        );
    }
    let history = one.exit_changes(None, 100).await.unwrap();
    assert_eq!(history.len(), 3, "{history:?}");
}
