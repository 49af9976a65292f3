//! The pure part of a reconcile: [`decide`] and the status it leads to
//! ([`desired_status`]), for the situations a fleet spends its time in —
//! - `running`: the drift poll of a healthy machine with a `maxLifetime` (most reconciles of a
//!   settled fleet);
//! - `not running`: a Pod with a waiting reason, inside its start-up time;
//! - `stuck deletion`: a machine past its deletion deadline, to be force-deleted;
//! - `draining`: a proxy draining its leases before a replacement;
//! - `unhealthy, remediation due`: a machine failing health checks past the threshold;
//! - `running + status`: `decide` and then the status that would be written (and compared with
//!   the current one to find nothing to write);
//! - `fleet of 10,000`: `decide` for every proxy of a 10,000-proxy fleet, as after a restart.
//!
//! Run with `cargo bench --bench reconcile`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use jiff::Timestamp;
use proxy_operator::provider::{Instance, InstanceState, Waiting};
use proxy_operator::proxy::{
    ConditionStatus, Disruption, DisruptionReason, Mode, Phase, ProxySpec, ProxyStatus,
};
use proxy_operator::reconcile::phase::Provisioning;
use proxy_operator::reconcile::remediation::Gate;
use proxy_operator::reconcile::status::{FieldChange, StatusChange, desired_status};
use proxy_operator::reconcile::{HealthSignal, Inputs, Limits, Observation, decide};
use proxy_operator::spec_hash::SPEC_HASH_VERSION;

const HASH: &str = "7f3c2a9b5e1d4c8a0b6e2f9d3a7c1e5b8d0f4a2c6e9b3d7f1a5c8e0b2d4f6a8c";

fn now() -> Timestamp {
    Timestamp::from_second(1_800_000_000).unwrap_or(Timestamp::UNIX_EPOCH)
}

fn machine(state: InstanceState) -> Instance {
    Instance {
        provider_id: "crawl/proxy-abcdefghijklmnop".to_owned(),
        name: "proxy-abcdefghijklmnop".to_owned(),
        state,
        ip: (state == InstanceState::Running).then(|| "10.0.3.17".to_owned()),
        uid: Some("0f8c7e4a-3b1d-4c2e-9a55-6d7e8f901234".to_owned()),
        created_at: Some(Timestamp::from_second(1_799_999_000).unwrap_or(Timestamp::UNIX_EPOCH)),
        waiting: None,
        deletion_deadline: None,
    }
}

fn inputs(observation: &Observation) -> Inputs<'_> {
    Inputs {
        mode: Mode::Managed,
        deleting: false,
        finalizer_present: true,
        provider_id: Some("crawl/proxy-abcdefghijklmnop"),
        recorded_hash: Some(HASH),
        recorded_hash_version: Some(SPEC_HASH_VERSION),
        create_pending: None,
        desired_hash: Some(HASH),
        cloud_init_problem: None,
        failed_this_generation: false,
        phase: Some(Phase::Ready),
        had_ip: true,
        not_provisioned_since: None,
        hold_until: None,
        now: now(),
        limits: Limits {
            startup_timeout: Duration::from_secs(600),
            force_delete_margin: Duration::from_secs(30),
            drain_timeout: Duration::from_secs(900),
            remediate_after: Duration::from_secs(600),
        },
        observation,
        deletion_requested: None,
        disruption: None,
        active_leases: 2,
        uid: "0f8c7e4a-3b1d-4c2e-9a55-6d7e8f901234",
        max_lifetime: Some(Duration::from_secs(86_400)),
        rotate_requested: false,
        unhealthy_since: None,
        health: Some((true, now())),
        remediation: Gate::Allowed,
    }
}

fn bench(c: &mut Criterion) {
    let running = Observation::Found(machine(InstanceState::Running));
    let mut pulling = machine(InstanceState::Provisioning);
    pulling.waiting = Some(Waiting {
        reason: "ErrImagePull".to_owned(),
        message: "pull access denied for ubuntu/squid:nope".to_owned(),
    });
    let pulling = Observation::Found(pulling);
    let mut stuck = machine(InstanceState::Terminated);
    stuck.deletion_deadline = Some(Timestamp::from_second(1_799_999_900).unwrap_or(now()));
    let stuck = Observation::Found(stuck);

    let mut group = c.benchmark_group("decide");
    group.bench_function("running", |b| {
        b.iter(|| decide(black_box(&inputs(&running))))
    });
    group.bench_function("not running", |b| {
        b.iter(|| decide(black_box(&inputs(&pulling))))
    });
    group.bench_function("stuck deletion", |b| {
        b.iter(|| decide(black_box(&inputs(&stuck))))
    });
    let draining = Disruption {
        reason: DisruptionReason::SpecChange,
        since: now(),
        replaced_at: None,
    };
    group.bench_function("draining", |b| {
        b.iter(|| {
            decide(black_box(&Inputs {
                disruption: Some(&draining),
                ..inputs(&running)
            }))
        })
    });
    group.bench_function("unhealthy, remediation due", |b| {
        b.iter(|| {
            decide(black_box(&Inputs {
                unhealthy_since: Timestamp::from_second(1_799_000_000).ok(),
                ..inputs(&running)
            }))
        })
    });

    let change = StatusChange {
        provisioning: Provisioning::Done,
        provider_id: FieldChange::Keep,
        ip: FieldChange::Set("10.0.3.17".to_owned()),
        provisioned: ConditionStatus::True,
        reason: "Running".to_owned(),
        message: "machine is running".to_owned(),
    };
    let spec: ProxySpec = serde_json::from_value(serde_json::json!({
        "mode": "Managed", "provider": "kubernetes", "port": 3128
    }))
    .unwrap_or_else(|e| panic!("a Managed spec: {e}"));
    let healthy = HealthSignal {
        healthy: true,
        latency: Duration::from_millis(12),
        at: now(),
        message: "probe answered 204 in 12 ms".to_owned(),
        proxy_url: "http://10.0.3.17:3128".to_owned(),
    };
    let settled = desired_status(
        &ProxyStatus::default(),
        &change,
        &spec,
        Some(&healthy),
        Some(3),
        now(),
    );
    group.bench_function("running + status", |b| {
        b.iter(|| {
            let action = decide(black_box(&inputs(&running)));
            let desired = desired_status(&settled, &change, &spec, Some(&healthy), Some(3), now());
            (action, desired == settled)
        })
    });

    let fleet: Vec<Observation> = (0..10_000)
        .map(|i| match i % 100 {
            0 => pulling.clone(),
            1 => stuck.clone(),
            _ => running.clone(),
        })
        .collect();
    group.bench_function("fleet of 10,000", |b| {
        b.iter(|| {
            fleet
                .iter()
                .map(|o| decide(black_box(&inputs(o))))
                .filter(|a| !matches!(a, proxy_operator::reconcile::Action::Running { .. }))
                .count()
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
