//! Tenants in the ledger, each test on both backends (a real SQLite file, a fresh database on
//! the real PostgreSQL server): a lease and its request ID belong to the tenant that acquired
//! it, and the quotas (leases, sessions, a token bucket of acquires) refuse at their limit
//! and let acquires through again when a lease goes or the clock refills the bucket. Time only
//! moves through the ledger's `ManualClock`.

use crate::support;

use std::time::Duration;

use proxy_operator::ledger::{
    AcquireOutcome, AcquireRequest, Candidate, LeaseReport, LeaseState, LedgerConfig, LedgerError,
    QuotaExceeded, QuotaKind, Quotas, Rate, ReportResult, RequestKey, Tenancy,
};
use support::ledger::{Backend, Fixture, candidate, granted};

const MINUTE: Duration = Duration::from_secs(60);

fn tenant(name: &str, quotas: Quotas) -> Tenancy {
    Tenancy {
        name: name.into(),
        quotas,
    }
}

/// An acquire of `tenant` over `candidates`, with request ID `id` (fingerprint `fp`) when
/// given, for gateway session `session` when given.
fn ask(
    candidates: &[Candidate],
    tenant: &Tenancy,
    id: Option<&str>,
    session: Option<&str>,
) -> AcquireRequest {
    AcquireRequest {
        candidates: candidates.into(),
        target: None,
        ttl: MINUTE,
        request: id.map(|id| RequestKey {
            id: id.into(),
            fingerprint: "fp".into(),
        }),
        client: None,
        tenant: tenant.clone(),
        session: session.map(str::to_owned),
        fallback_step: None,
    }
}

/// The refusal of an acquire refused for a quota; panics with the answer otherwise.
fn refused(outcome: Result<AcquireOutcome, LedgerError>) -> QuotaExceeded {
    match outcome {
        Ok(AcquireOutcome::QuotaExceeded(refused)) => refused,
        other => panic!("expected a quota refusal, got {other:?}"),
    }
}

async fn a_lease_and_its_request_id_are_their_tenants_own(backend: Backend) {
    let Some(f) = Fixture::on(backend, LedgerConfig::default()).await else {
        return;
    };
    let c = [candidate("a", 5), candidate("b", 5)];
    let a = tenant("team-a", Quotas::default());
    let b = tenant("team-b", Quotas::default());
    let lease = granted(f.ledger.acquire(ask(&c, &a, Some("r"), None)).await);
    assert_eq!(lease.tenant, "team-a");

    // Team B: the same request ID is a new acquire, and team A's lease is unknown to it.
    let theirs = granted(f.ledger.acquire(ask(&c, &b, Some("r"), None)).await);
    assert_ne!(theirs.id, lease.id);
    assert!(f.ledger.get(&lease.id, "team-b").await.unwrap().is_none());
    let unknown = |e: LedgerError| matches!(e, LedgerError::UnknownLease(_));
    assert!(unknown(
        f.ledger
            .renew(&lease.id, "team-b", MINUTE)
            .await
            .unwrap_err()
    ));
    let report = LeaseReport::new(ReportResult::Blocked, Some("t.example"));
    assert!(unknown(
        f.ledger
            .report(&lease.id, "team-b", report)
            .await
            .unwrap_err()
    ));
    f.ledger.release(&lease.id, "team-b").await.unwrap();
    let still = f.ledger.get(&lease.id, "team-a").await.unwrap().unwrap();
    assert_eq!(
        still.state,
        LeaseState::Active,
        "team-b's release did nothing"
    );
    assert_eq!(
        f.count(&format!(
            "SELECT COUNT(*) FROM lease_events WHERE lease_id = '{}' AND kind = 'reported'",
            lease.id
        )),
        0
    );

    // Team A replays its own request, and the rows name the tenants.
    match f.ledger.acquire(ask(&c, &a, Some("r"), None)).await {
        Ok(AcquireOutcome::Replayed(again)) => assert_eq!(again.id, lease.id),
        other => panic!("expected team-a's replay, got {other:?}"),
    }
    f.ledger.release(&lease.id, "team-a").await.unwrap();
    assert_eq!(
        f.rows("SELECT tenant, COUNT(*) FROM lease_history GROUP BY tenant ORDER BY tenant"),
        [
            vec![Some("team-a".to_owned()), Some("2".to_owned())],
            vec![Some("team-b".to_owned()), Some("1".to_owned())],
        ]
    );
}

async fn quotas_refuse_at_their_limit_and_free_up(backend: Backend) {
    let Some(f) = Fixture::on(backend, LedgerConfig::default()).await else {
        return;
    };
    let c = [candidate("a", 10), candidate("b", 10)];

    // Leases: two at once, a session's included; a release frees a slot at once.
    let leases = tenant(
        "leases",
        Quotas {
            leases: Some(2),
            sessions: Some(1),
            ..Quotas::default()
        },
    );
    let first = granted(f.ledger.acquire(ask(&c, &leases, None, Some("s1"))).await);
    let refusal = refused(f.ledger.acquire(ask(&c, &leases, None, Some("s2"))).await);
    assert_eq!((refusal.quota, refusal.limit), (QuotaKind::Sessions, 1.0));
    assert_eq!(&*refusal.tenant, "leases");
    granted(f.ledger.acquire(ask(&c, &leases, None, None)).await);
    let refusal = refused(f.ledger.acquire(ask(&c, &leases, None, None)).await);
    assert_eq!(refusal.quota, QuotaKind::Leases);
    assert!(refusal.retry_after > Duration::ZERO && refusal.retry_after <= Duration::from_secs(5));
    f.ledger.release(&first.id, "leases").await.unwrap();
    granted(f.ledger.acquire(ask(&c, &leases, None, Some("s2"))).await);
    assert_eq!(
        f.count("SELECT COUNT(*) FROM leases WHERE tenant = 'leases' AND session IS NOT NULL"),
        2
    );

    // The rate: a burst of 3, then one a second; a refusal takes no token.
    let rated = tenant(
        "rated",
        Quotas {
            rate: Some(Rate {
                per_second: 1.0,
                burst: 3,
            }),
            ..Quotas::default()
        },
    );
    for _ in 0..3 {
        let lease = granted(f.ledger.acquire(ask(&c, &rated, None, None)).await);
        f.ledger.release(&lease.id, "rated").await.unwrap();
    }
    let refusal = refused(f.ledger.acquire(ask(&c, &rated, None, None)).await);
    assert_eq!(
        (refusal.quota, refusal.limit, refusal.burst),
        (QuotaKind::Rate, 1.0, Some(3))
    );
    assert_eq!(refusal.retry_after, Duration::from_secs(1));
    f.clock.advance(Duration::from_millis(999));
    refused(f.ledger.acquire(ask(&c, &rated, None, None)).await);
    f.clock.advance(Duration::from_millis(1));
    granted(f.ledger.acquire(ask(&c, &rated, None, None)).await);
    refused(f.ledger.acquire(ask(&c, &rated, None, None)).await);

    // A tenant without a quota is not held back by the others'.
    for _ in 0..5 {
        granted(
            f.ledger
                .acquire(ask(&c, &tenant("free", Quotas::default()), None, None))
                .await,
        );
    }
}

crate::on_both_backends!(
    a_lease_and_its_request_id_are_their_tenants_own,
    quotas_refuse_at_their_limit_and_free_up,
);
