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
use proxy_operator::controllers::proxy::status::{FieldChange, StatusChange, desired_status};
use proxy_operator::controllers::proxy::{Inputs, Observation, decide};
use proxy_operator::fixtures;
use proxy_operator::provider::{Instance, InstanceState, Waiting};
use proxy_operator::resources::phase::Provisioning;
use proxy_operator::resources::proxy::{
    ConditionStatus, Disruption, DisruptionReason, ProxySpec, ProxyStatus,
};

fn now() -> Timestamp {
    Timestamp::from_second(1_800_000_000).unwrap_or(Timestamp::UNIX_EPOCH)
}

fn machine(state: InstanceState) -> Instance {
    fixtures::instance(state, now())
}

/// A settled machine with two leases and a `maxLifetime`, healthy.
fn inputs(observation: &Observation) -> Inputs<'_> {
    Inputs {
        active_leases: 2,
        max_lifetime: Some(Duration::from_secs(86_400)),
        health: Some((true, now())),
        ..fixtures::settled(observation, now())
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

    let change = StatusChange::new(
        Provisioning::Done,
        ConditionStatus::True,
        "Running",
        "machine is running",
    )
    .ip(FieldChange::Set("10.0.0.9".to_owned()));
    let spec: ProxySpec = serde_json::from_value(serde_json::json!({
        "mode": "Managed", "provider": "kubernetes", "port": 3128
    }))
    .unwrap_or_else(|e| panic!("a Managed spec: {e}"));
    let healthy = fixtures::transition(true, "http://10.0.0.9:3128", now());
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
                .filter(|a| {
                    !matches!(
                        a,
                        proxy_operator::controllers::proxy::Action::Running { .. }
                    )
                })
                .count()
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
