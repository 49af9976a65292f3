//! The decision table: every row of the design's table for Managed and External proxies,
//! self-healing, the fleet lifecycle and provider errors, each a named case of inputs and the
//! one action `decide` must choose.

use super::*;
use crate::fixtures;

const H: &str = fixtures::HASH;
const A_OLD: &str = "hash-old";

fn ts(seconds: i64) -> Timestamp {
    Timestamp::from_second(seconds).unwrap()
}

/// "Now" in every row.
const NOW: i64 = 10_000;

fn machine(state: InstanceState) -> Instance {
    fixtures::instance(state, ts(NOW))
}

fn found(state: InstanceState) -> Observation {
    Observation::Found(machine(state))
}

fn error(class: ErrorClass) -> Observation {
    Observation::Error {
        class,
        message: "boom".into(),
    }
}

/// A Managed proxy with the finalizer, a recorded ID and A == H.
fn base(observation: &Observation) -> Inputs<'_> {
    fixtures::settled(observation, ts(NOW))
}

/// The Running action of a machine with nothing due.
fn running_at(ip: &str) -> Action {
    Action::Running {
        ip: Some(ip.into()),
        replaced: false,
        recheck: None,
        remediation_paused: None,
    }
}

#[test]
fn every_row_of_the_managed_table() {
    let not_queried = Observation::NotQueried;
    let provisioning = found(InstanceState::Provisioning);
    let running = found(InstanceState::Running);
    let stopped = found(InstanceState::Stopped);
    let terminated = found(InstanceState::Terminated);
    let not_found = Observation::NotFound;
    let running_ip = running_at("10.0.0.9");
    type Case<'a> = (&'a str, Inputs<'a>, Action);
    let cases: Vec<Case<'_>> = vec![
        (
            "no finalizer -> add it",
            Inputs {
                finalizer_present: false,
                provider_id: None,
                ..base(&not_queried)
            },
            Action::AddFinalizer,
        ),
        (
            "no ID -> create with H",
            Inputs {
                provider_id: None,
                recorded_hash: None,
                ..base(&not_queried)
            },
            Action::Create { hash: H.into() },
        ),
        (
            "empty ID string counts as unset",
            Inputs {
                provider_id: Some(""),
                ..base(&not_queried)
            },
            Action::Create { hash: H.into() },
        ),
        (
            "A == H, Provisioning -> poll until the start-up deadline",
            base(&provisioning),
            Action::AwaitProvisioning {
                waiting: None,
                deadline: Some(ts(NOW - 60 + 600)),
            },
        ),
        ("A == H, Running -> set ip", base(&running), running_ip),
        (
            "A == H, Stopped -> delete",
            base(&stopped),
            Action::DeleteDead { force_at: None },
        ),
        (
            "A == H, Terminated -> delete",
            base(&terminated),
            Action::DeleteDead { force_at: None },
        ),
        (
            "A == H, NotFound while serving -> forget, the machine was lost",
            base(&not_found),
            Action::Forget {
                record_hash: None,
                loss: Loss::WhileServing,
            },
        ),
        (
            "NotFound while being created -> forget, the create failed",
            Inputs {
                phase: Some(Phase::Provisioning),
                had_ip: false,
                ..base(&not_found)
            },
            Action::Forget {
                record_hash: None,
                loss: Loss::BeforeRunning,
            },
        ),
        (
            "NotFound while replacing -> forget, as expected",
            Inputs {
                phase: Some(Phase::Replacing),
                had_ip: false,
                ..base(&not_found)
            },
            Action::Forget {
                record_hash: None,
                loss: Loss::Expected,
            },
        ),
        (
            "A != H, NotFound -> forget and record H (replacement completes)",
            Inputs {
                recorded_hash: Some(A_OLD),
                phase: Some(Phase::Replacing),
                ..base(&not_found)
            },
            Action::Forget {
                record_hash: Some(H.into()),
                loss: Loss::Expected,
            },
        ),
        (
            "A != H, Running -> a voluntary replacement: budget, then drain",
            Inputs {
                recorded_hash: Some(A_OLD),
                ..base(&running)
            },
            Action::Disrupt {
                reason: DisruptionReason::SpecChange,
            },
        ),
        (
            "A != H, Provisioning -> replace",
            Inputs {
                recorded_hash: Some(A_OLD),
                ..base(&provisioning)
            },
            Action::Replace {
                reason: DisruptionReason::SpecChange,
                drain_timed_out: false,
            },
        ),
        (
            "A != H, Terminated (still deleting) -> replace again, wait for NotFound",
            Inputs {
                recorded_hash: Some(A_OLD),
                ..base(&terminated)
            },
            Action::Replace {
                reason: DisruptionReason::SpecChange,
                drain_timed_out: false,
            },
        ),
        (
            "A empty, Running -> adopt",
            Inputs {
                recorded_hash: None,
                recorded_hash_version: None,
                ..base(&running)
            },
            Action::Adopt { hash: H.into() },
        ),
        (
            "A empty string, Stopped -> adopt first",
            Inputs {
                recorded_hash: Some(""),
                ..base(&stopped)
            },
            Action::Adopt { hash: H.into() },
        ),
        (
            "hash version mismatch -> adopt, not drift",
            Inputs {
                recorded_hash: Some(A_OLD),
                recorded_hash_version: Some("0"),
                ..base(&running)
            },
            Action::Adopt { hash: H.into() },
        ),
        (
            "hash version missing, A == H -> adopt records the version",
            Inputs {
                recorded_hash_version: None,
                ..base(&running)
            },
            Action::Adopt { hash: H.into() },
        ),
        (
            "deleting, no ID -> remove finalizer",
            Inputs {
                deleting: true,
                provider_id: None,
                ..base(&not_queried)
            },
            Action::RemoveFinalizer,
        ),
        (
            "deleting, ID, NotFound -> remove finalizer",
            Inputs {
                deleting: true,
                ..base(&not_found)
            },
            Action::RemoveFinalizer,
        ),
        (
            "deleting, ID, Running -> delete",
            Inputs {
                deleting: true,
                ..base(&running)
            },
            Action::DeleteForCleanup {
                drain_timed_out: false,
            },
        ),
        (
            "deleting, ID, Terminated -> delete",
            Inputs {
                deleting: true,
                ..base(&terminated)
            },
            Action::DeleteForCleanup {
                drain_timed_out: false,
            },
        ),
        (
            "deleting after a permanent failure still deletes",
            Inputs {
                deleting: true,
                failed_this_generation: true,
                ..base(&running)
            },
            Action::DeleteForCleanup {
                drain_timed_out: false,
            },
        ),
    ];
    for (name, inputs, expected) in cases {
        assert_eq!(decide(&inputs), expected, "{name}");
    }
}

#[test]
fn self_healing_rows() {
    let with = |f: &dyn Fn(&mut Instance)| {
        let mut m = machine(InstanceState::Provisioning);
        f(&mut m);
        Observation::Found(m)
    };
    let image_pull = Waiting {
        reason: "ErrImagePull".into(),
        message: "pull access denied".into(),
    };
    let pulling = with(&|m| m.waiting = Some(image_pull.clone()));
    let old_pulling = with(&|m| {
        m.waiting = Some(image_pull.clone());
        m.created_at = Some(ts(NOW - 601));
    });
    let old_unknown_age = with(&|m| m.created_at = None);
    let terminating = |deadline: i64| {
        with(&|m| {
            m.state = InstanceState::Terminated;
            m.deletion_deadline = Some(ts(deadline));
        })
    };
    let terminating_recent = terminating(NOW - 29);
    let terminating_stuck = terminating(NOW - 30);
    let not_queried = Observation::NotQueried;
    let running = found(InstanceState::Running);
    let hold = Some(ts(NOW + 5));
    type Case<'a> = (&'a str, Inputs<'a>, Action);
    let cases: Vec<Case<'_>> = vec![
        (
            "not running yet -> the provider's reason, deadline from creation",
            base(&pulling),
            Action::AwaitProvisioning {
                waiting: Some(image_pull.clone()),
                deadline: Some(ts(NOW - 60 + 600)),
            },
        ),
        (
            "not running since creation past the start-up timeout -> replace",
            base(&old_pulling),
            Action::ReplaceStuck {
                waiting: Some(image_pull.clone()),
            },
        ),
        (
            "was running, stopped running recently -> the clock starts then",
            Inputs {
                not_provisioned_since: Some(ts(NOW - 10)),
                ..base(&old_pulling)
            },
            Action::AwaitProvisioning {
                waiting: Some(image_pull.clone()),
                deadline: Some(ts(NOW - 10 + 600)),
            },
        ),
        (
            "no creation time, not provisioned for long -> replace",
            Inputs {
                not_provisioned_since: Some(ts(NOW - 600)),
                ..base(&old_unknown_age)
            },
            Action::ReplaceStuck { waiting: None },
        ),
        (
            "no time known at all -> never replaced for slowness",
            base(&old_unknown_age),
            Action::AwaitProvisioning {
                waiting: None,
                deadline: None,
            },
        ),
        (
            "terminating within the margin -> delete and wait for the force-delete time",
            base(&terminating_recent),
            Action::DeleteDead {
                force_at: Some(ts(NOW - 29 + 30)),
            },
        ),
        (
            "terminating past deadline + margin -> force-delete",
            base(&terminating_stuck),
            Action::ForceDelete {
                deadline: ts(NOW - 30),
            },
        ),
        (
            "stuck during a spec-change replacement -> force-delete first",
            Inputs {
                recorded_hash: Some(A_OLD),
                ..base(&terminating_stuck)
            },
            Action::ForceDelete {
                deadline: ts(NOW - 30),
            },
        ),
        (
            "Proxy deleted, machine stuck -> force-delete",
            Inputs {
                deleting: true,
                ..base(&terminating_stuck)
            },
            Action::ForceDelete {
                deadline: ts(NOW - 30),
            },
        ),
        (
            "Proxy deleted, machine terminating within the margin -> delete",
            Inputs {
                deleting: true,
                ..base(&terminating_recent)
            },
            Action::DeleteForCleanup {
                drain_timed_out: false,
            },
        ),
        (
            "Proxy deleted with a create pending and no ID -> find the machine first",
            Inputs {
                deleting: true,
                provider_id: None,
                create_pending: Some(A_OLD),
                ..base(&not_queried)
            },
            Action::CleanupPending,
        ),
        (
            "Proxy deleted with an empty pending marker -> remove finalizer",
            Inputs {
                deleting: true,
                provider_id: None,
                create_pending: Some(""),
                ..base(&not_queried)
            },
            Action::RemoveFinalizer,
        ),
        (
            "creates on hold after failures -> wait",
            Inputs {
                provider_id: None,
                hold_until: hold,
                ..base(&not_queried)
            },
            Action::HoldCreate { until: ts(NOW + 5) },
        ),
        (
            "a hold also waits before recovering a pending create",
            Inputs {
                provider_id: None,
                create_pending: Some(A_OLD),
                hold_until: hold,
                ..base(&not_queried)
            },
            Action::HoldCreate { until: ts(NOW + 5) },
        ),
        (
            "a hold that ran out -> create",
            Inputs {
                provider_id: None,
                hold_until: Some(ts(NOW)),
                ..base(&not_queried)
            },
            Action::Create { hash: H.into() },
        ),
        (
            "a hold never stops a machine that exists from being looked after",
            Inputs {
                hold_until: hold,
                ..base(&running)
            },
            running_at("10.0.0.9"),
        ),
    ];
    for (name, inputs, expected) in cases {
        assert_eq!(decide(&inputs), expected, "{name}");
    }
}

#[test]
fn external_proxies_never_touch_providers_and_lose_our_finalizer() {
    let obs = Observation::NotQueried;
    let cases = [
        ("settled", false, false, Action::External),
        ("being deleted", true, false, Action::External),
        (
            "carries our finalizer",
            false,
            true,
            Action::RemoveFinalizer,
        ),
        (
            "being deleted, held by our finalizer",
            true,
            true,
            Action::RemoveFinalizer,
        ),
    ];
    for (name, deleting, finalizer, expected) in cases {
        let inputs = Inputs {
            mode: Mode::External,
            deleting,
            finalizer_present: finalizer,
            provider_id: None,
            ..base(&obs)
        };
        assert_eq!(decide(&inputs), expected, "{name}");
    }
}

#[test]
fn error_classes_from_get() {
    let cases = [
        (ErrorClass::Transient, "Backoff"),
        (ErrorClass::QuotaExceeded, "QuotaWait"),
        (ErrorClass::Refused, "Refused"),
        (ErrorClass::Permanent, "Fail"),
    ];
    for (class, expected) in cases {
        let obs = error(class);
        for deleting in [false, true] {
            let action = decide(&Inputs {
                deleting,
                ..base(&obs)
            });
            let name = format!("{action:?}");
            assert!(name.starts_with(expected), "{class:?}: {name}");
        }
    }
}

#[test]
fn error_classes_from_create_and_delete() {
    let m = || "x".to_owned();
    assert_eq!(
        on_provider_error(ErrorClass::Transient, m()),
        Action::Backoff { message: m() }
    );
    assert_eq!(
        on_provider_error(ErrorClass::QuotaExceeded, m()),
        Action::QuotaWait { message: m() }
    );
    assert_eq!(
        on_provider_error(ErrorClass::Refused, m()),
        Action::Refused { message: m() }
    );
    assert_eq!(
        on_provider_error(ErrorClass::Permanent, m()),
        Action::Fail { message: m() }
    );
    assert_eq!(
        on_provider_error(ErrorClass::NotFound, m()),
        Action::Backoff { message: m() }
    );
}

#[test]
fn permanent_failure_waits_for_its_slow_retry() {
    let obs = Observation::NotQueried;
    let until = ts(NOW + 1800);
    let inputs = Inputs {
        failed_this_generation: true,
        provider_id: None,
        hold_until: Some(until),
        ..base(&obs)
    };
    assert_eq!(decide(&inputs), Action::StayFailed { until });
    let running = found(InstanceState::Running);
    let inputs = Inputs {
        failed_this_generation: true,
        hold_until: Some(until),
        ..base(&running)
    };
    assert_eq!(decide(&inputs), Action::StayFailed { until });
    // Retry due (slow timer passed, or a restart forgot the hold): try again.
    for hold_until in [Some(ts(NOW)), None] {
        let inputs = Inputs {
            failed_this_generation: true,
            provider_id: None,
            hold_until,
            ..base(&obs)
        };
        assert_eq!(decide(&inputs), Action::Create { hash: H.into() });
        let inputs = Inputs {
            failed_this_generation: true,
            hold_until,
            ..base(&running)
        };
        assert!(matches!(decide(&inputs), Action::Running { .. }));
    }
}

#[test]
fn create_pending_is_recovered_by_name_not_created_again() {
    let obs = Observation::NotQueried;
    let inputs = Inputs {
        provider_id: None,
        create_pending: Some(A_OLD),
        ..base(&obs)
    };
    assert_eq!(decide(&inputs), Action::Recover { hash: A_OLD.into() });
    // ID recorded, marker not yet cleared: the machine carries the pending hash.
    let running = found(InstanceState::Running);
    let inputs = Inputs {
        recorded_hash: None,
        create_pending: Some(A_OLD),
        ..base(&running)
    };
    assert_eq!(decide(&inputs), Action::Adopt { hash: A_OLD.into() });
}

#[test]
fn unresolvable_cloud_init_blocks_create_but_never_replaces() {
    let obs = Observation::NotQueried;
    let inputs = Inputs {
        provider_id: None,
        desired_hash: None,
        cloud_init_problem: Some("Secret ns/ci not found"),
        ..base(&obs)
    };
    assert_eq!(
        decide(&inputs),
        Action::AwaitCloudInit {
            message: "Secret ns/ci not found".into()
        }
    );
    let running = found(InstanceState::Running);
    let inputs = Inputs {
        recorded_hash: Some(A_OLD),
        desired_hash: None,
        ..base(&running)
    };
    assert!(matches!(decide(&inputs), Action::Running { .. }));
}

fn machine_created(state: InstanceState, created: i64) -> Observation {
    Observation::Found(Instance {
        created_at: Some(ts(created)),
        ..machine(state)
    })
}

fn disruption(since: i64, replaced_at: Option<i64>) -> Disruption {
    Disruption {
        reason: DisruptionReason::SpecChange,
        since: ts(since),
        replaced_at: replaced_at.map(ts),
    }
}

#[test]
fn drains_rotations_and_remediations() {
    let running = found(InstanceState::Running);
    let provisioning = found(InstanceState::Provisioning);
    let terminated = found(InstanceState::Terminated);
    let terminating = Observation::Found(Instance {
        deletion_deadline: Some(ts(NOW + 20)),
        ..machine(InstanceState::Terminated)
    });
    let old_machine = machine_created(InstanceState::Running, NOW - 1000);
    let draining = disruption(NOW - 10, None);
    let drain_expired = disruption(NOW - 1000, None);
    let replaced = disruption(NOW - 100, Some(NOW - 30));
    let hour = Duration::from_secs(3600);
    let rotate_at = rotation::due_at(ts(NOW - 60), hour, "uid-1");
    let deleted = |since: i64| Inputs {
        deleting: true,
        deletion_requested: Some(ts(since)),
        active_leases: 2,
        ..base(&running)
    };
    type Case<'a> = (&'a str, Inputs<'a>, Action);
    let cases: Vec<Case<'_>> = vec![
        (
            "deleted with leases -> drain until the deletion time plus the timeout",
            deleted(NOW - 10),
            Action::Drain {
                leases: 2,
                deadline: ts(NOW - 10 + 900),
            },
        ),
        (
            "deleted, drain timed out -> end the leases and delete",
            deleted(NOW - 1000),
            Action::DeleteForCleanup {
                drain_timed_out: true,
            },
        ),
        (
            "deleted without leases -> delete at once",
            Inputs {
                active_leases: 0,
                ..deleted(NOW - 10)
            },
            Action::DeleteForCleanup {
                drain_timed_out: false,
            },
        ),
        (
            "deleted, machine already terminating -> no drain",
            Inputs {
                observation: &terminating,
                ..deleted(NOW - 10)
            },
            Action::DeleteForCleanup {
                drain_timed_out: false,
            },
        ),
        (
            "replacement admitted, leases active -> drain",
            Inputs {
                disruption: Some(&draining),
                active_leases: 1,
                ..base(&running)
            },
            Action::Drain {
                leases: 1,
                deadline: ts(NOW - 10 + 900),
            },
        ),
        (
            "replacement admitted, no lease left -> replace",
            Inputs {
                disruption: Some(&draining),
                ..base(&running)
            },
            Action::Replace {
                reason: DisruptionReason::SpecChange,
                drain_timed_out: false,
            },
        ),
        (
            "replacement admitted, drain timed out -> end leases, replace",
            Inputs {
                disruption: Some(&drain_expired),
                active_leases: 3,
                ..base(&running)
            },
            Action::Replace {
                reason: DisruptionReason::SpecChange,
                drain_timed_out: true,
            },
        ),
        (
            "replacement admitted, machine already going -> replace (delete again)",
            Inputs {
                disruption: Some(&draining),
                active_leases: 1,
                ..base(&terminated)
            },
            Action::Replace {
                reason: DisruptionReason::SpecChange,
                drain_timed_out: false,
            },
        ),
        (
            "new machine healthy after the old one went -> replacement over",
            Inputs {
                disruption: Some(&replaced),
                health: Some((true, ts(NOW - 5))),
                ..base(&running)
            },
            Action::Running {
                ip: Some("10.0.0.9".into()),
                replaced: true,
                recheck: None,
                remediation_paused: None,
            },
        ),
        (
            "a healthy verdict from before the old machine went does not count",
            Inputs {
                disruption: Some(&replaced),
                health: Some((true, ts(NOW - 40))),
                ..base(&running)
            },
            running_at("10.0.0.9"),
        ),
        (
            "new machine unhealthy -> replacement not over",
            Inputs {
                disruption: Some(&replaced),
                health: Some((false, ts(NOW - 5))),
                ..base(&running)
            },
            running_at("10.0.0.9"),
        ),
        (
            "spec changed again on the new machine -> a new drain (slot already held)",
            Inputs {
                disruption: Some(&replaced),
                recorded_hash: Some(A_OLD),
                ..base(&running)
            },
            Action::Disrupt {
                reason: DisruptionReason::SpecChange,
            },
        ),
        (
            "rotate annotation -> rotate",
            Inputs {
                rotate_requested: true,
                ..base(&running)
            },
            Action::Disrupt {
                reason: DisruptionReason::RotateRequested,
            },
        ),
        (
            "rotate annotation on a machine not running yet -> wait for it",
            Inputs {
                rotate_requested: true,
                ..base(&provisioning)
            },
            Action::AwaitProvisioning {
                waiting: None,
                deadline: Some(ts(NOW - 60 + 600)),
            },
        ),
        (
            "older than maxLifetime -> rotate",
            Inputs {
                max_lifetime: Some(Duration::from_secs(30)),
                ..base(&running)
            },
            Action::Disrupt {
                reason: DisruptionReason::MaxLifetime,
            },
        ),
        (
            "younger than maxLifetime -> look again when it is due",
            Inputs {
                max_lifetime: Some(hour),
                ..base(&running)
            },
            Action::Running {
                ip: Some("10.0.0.9".into()),
                replaced: false,
                recheck: Some(rotate_at),
                remediation_paused: None,
            },
        ),
        (
            "unhealthy since before the machine existed -> counted from its creation",
            Inputs {
                unhealthy_since: Some(ts(NOW - 700)),
                ..base(&running)
            },
            Action::Running {
                ip: Some("10.0.0.9".into()),
                replaced: false,
                recheck: Some(ts(NOW - 60 + 600)),
                remediation_paused: None,
            },
        ),
        (
            "unhealthy past the threshold -> remediate",
            Inputs {
                unhealthy_since: Some(ts(NOW - 700)),
                ..base(&old_machine)
            },
            Action::Disrupt {
                reason: DisruptionReason::Unhealthy,
            },
        ),
        (
            "unhealthy past the threshold, but a probe passed since -> recovered, left alone",
            Inputs {
                unhealthy_since: Some(ts(NOW - 700)),
                health: Some((true, ts(NOW - 1))),
                ..base(&old_machine)
            },
            Action::Running {
                ip: Some("10.0.0.9".into()),
                replaced: false,
                recheck: None,
                remediation_paused: None,
            },
        ),
        (
            "unhealthy past the threshold, the last probe failed too -> remediate",
            Inputs {
                unhealthy_since: Some(ts(NOW - 700)),
                health: Some((false, ts(NOW - 1))),
                ..base(&old_machine)
            },
            Action::Disrupt {
                reason: DisruptionReason::Unhealthy,
            },
        ),
        (
            "unhealthy past the threshold, provider mostly unhealthy -> paused",
            Inputs {
                unhealthy_since: Some(ts(NOW - 700)),
                remediation: Gate::Paused {
                    unhealthy: 3,
                    managed: 5,
                },
                ..base(&old_machine)
            },
            Action::Running {
                ip: Some("10.0.0.9".into()),
                replaced: false,
                recheck: None,
                remediation_paused: Some((3, 5)),
            },
        ),
        (
            "unhealthy past the threshold while not serving -> no remediation",
            Inputs {
                unhealthy_since: Some(ts(NOW - 700)),
                ..base(&terminating)
            },
            Action::DeleteDead {
                force_at: Some(ts(NOW + 50)),
            },
        ),
    ];
    for (name, inputs, expected) in cases {
        assert_eq!(decide(&inputs), expected, "{name}");
    }
}
