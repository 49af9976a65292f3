//! The reconciler's state machine: one pure decision per reconcile.
//!
//! [`decide`] turns what is known about a Proxy (its metadata, its status, the spec hash of what
//! it asks for, and what the provider said about its machine) into exactly one [`Action`]. The
//! I/O that carries an action out lives in `apply`, so every row of the design's table is tested
//! here without a cluster or a cloud.

use std::time::Duration;

use jiff::Timestamp;

use super::remediation::{self, Gate};
use super::rotation;
use crate::provider::{ErrorClass, Instance, InstanceState, Waiting};
use crate::proxy::{Disruption, DisruptionReason, Mode, Phase};
use crate::spec_hash::SPEC_HASH_VERSION;

/// What the provider said about the machine recorded in `status.providerID`.
#[derive(Debug, Clone, PartialEq)]
pub enum Observation {
    /// No `get` was made (no providerID, or no provider calls are allowed).
    NotQueried,
    /// The machine exists.
    Found(Instance),
    /// The machine does not exist (an input, never an error).
    NotFound,
    /// The `get` failed.
    Error {
        /// The failure's class.
        class: ErrorClass,
        /// The failure, for the condition and the log.
        message: String,
    },
}

/// The time limits of self-healing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// How long a machine may be not running (since created, or since it stopped running)
    /// before it is replaced.
    pub startup_timeout: Duration,
    /// How long past its deletion deadline a machine is left before it is force-deleted.
    pub force_delete_margin: Duration,
    /// Longest drain before a machine is deleted anyway.
    pub drain_timeout: Duration,
    /// How long a running machine may fail health checks before it is replaced.
    pub remediate_after: Duration,
}

/// Everything [`decide`] looks at. Built by the caller from the object and the provider's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Inputs<'a> {
    /// `spec.mode`.
    pub mode: Mode,
    /// Whether the object has a deletionTimestamp.
    pub deleting: bool,
    /// The deletionTimestamp: when the Proxy's deletion (and its drain) started.
    pub deletion_requested: Option<Timestamp>,
    /// Whether our finalizer is on the object.
    pub finalizer_present: bool,
    /// `status.providerID` (an empty string counts as unset).
    pub provider_id: Option<&'a str>,
    /// The spec-hash annotation (A).
    pub recorded_hash: Option<&'a str>,
    /// The spec-hash-version annotation.
    pub recorded_hash_version: Option<&'a str>,
    /// The create-pending annotation: the hash a create was started with.
    pub create_pending: Option<&'a str>,
    /// The computed spec hash (H); `None` when the cloud-init Secret cannot be read.
    pub desired_hash: Option<&'a str>,
    /// Why the cloud-init could not be resolved, when `desired_hash` is `None`.
    pub cloud_init_problem: Option<&'a str>,
    /// Whether a permanent provider failure was already recorded for this generation.
    pub failed_this_generation: bool,
    /// `status.phase` now: tells a machine that vanished while being created from one lost
    /// while serving, and both from one whose deletion was asked for.
    pub phase: Option<Phase>,
    /// Whether `status.ip` is set (the machine was running).
    pub had_ip: bool,
    /// Since when the `Provisioned` condition has been False, if it is.
    pub not_provisioned_since: Option<Timestamp>,
    /// No machine is created before this (backoff after failures).
    pub hold_until: Option<Timestamp>,
    /// Now.
    pub now: Timestamp,
    /// Self-healing time limits.
    pub limits: Limits,
    /// The provider's answer about `provider_id`.
    pub observation: &'a Observation,
    /// `status.disruption`: the voluntary replacement under way, if any.
    pub disruption: Option<&'a Disruption>,
    /// Leases active on the proxy now.
    pub active_leases: u32,
    /// The object's UID (it fixes the proxy's rotation jitter).
    pub uid: &'a str,
    /// `spec.maxLifetime`.
    pub max_lifetime: Option<Duration>,
    /// Whether the rotate annotation asks for a rotation not yet done.
    pub rotate_requested: bool,
    /// Since when the `Healthy` condition has been False, if it is.
    pub unhealthy_since: Option<Timestamp>,
    /// The last health verdict and when its probe finished.
    pub health: Option<(bool, Timestamp)>,
    /// Whether health remediation is allowed for the proxy's provider now (computed only for
    /// an unhealthy proxy; `Allowed` otherwise).
    pub remediation: Gate,
}

/// Where a drain stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Drain {
    /// Leases are still active and there is time left.
    Draining {
        /// Active leases.
        leases: u32,
        /// When the drain gives up on them.
        deadline: Timestamp,
    },
    /// No lease is active: the machine can go.
    Drained,
    /// The timeout passed with leases still active: they are ended and the machine goes.
    TimedOut,
}

/// The state of a drain that started at `since`.
fn drain(inputs: &Inputs<'_>, since: Timestamp) -> Drain {
    let deadline = after(since, inputs.limits.drain_timeout);
    match inputs.active_leases {
        0 => Drain::Drained,
        _ if deadline <= inputs.now => Drain::TimedOut,
        leases => Drain::Draining { leases, deadline },
    }
}

/// How a machine came to be missing, which decides what its disappearance means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loss {
    /// Its deletion was asked for (replacement): expected.
    Expected,
    /// It was serving: it died or was deleted under the proxy.
    WhileServing,
    /// It never ran: the provider accepted the create and then failed it.
    BeforeRunning,
}

/// The one thing a reconcile does.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Put our finalizer on the object; the update re-triggers a reconcile.
    AddFinalizer,
    /// Take our finalizer off; the machine is gone (or never existed).
    RemoveFinalizer,
    /// Mark the create as pending, create the machine, record its ID and the hash.
    Create {
        /// The hash the machine is created with.
        hash: String,
    },
    /// A create was started but its ID never recorded: find the machine by its deterministic
    /// name before creating anything.
    Recover {
        /// The hash that create was started with.
        hash: String,
    },
    /// Creates are on hold after failures: wait.
    HoldCreate {
        /// Until then.
        until: Timestamp,
    },
    /// The machine is being created: clear the IP, show why it is not running yet, poll.
    AwaitProvisioning {
        /// The provider's reason, if it gave one.
        waiting: Option<Waiting>,
        /// When the start-up timeout runs out.
        deadline: Option<Timestamp>,
    },
    /// The machine has not run within the start-up timeout: delete it to make a new one.
    ReplaceStuck {
        /// The provider's last reason, if it gave one.
        waiting: Option<Waiting>,
    },
    /// The machine runs: record its IP, poll for drift.
    Running {
        /// The machine's address.
        ip: Option<String>,
        /// It replaced a machine voluntarily and passed a health check since: the replacement
        /// is over and its budget slot is free.
        replaced: bool,
        /// When to look again before the drift poll (rotation or remediation due).
        recheck: Option<Timestamp>,
        /// Remediation is due but paused: (unhealthy, managed) proxies of its provider.
        remediation_paused: Option<(usize, usize)>,
    },
    /// The machine stopped or terminated: delete it (cattle), poll until it is gone.
    DeleteDead {
        /// When its deletion, asked for already (by anyone), is force-deleted if still there.
        force_at: Option<Timestamp>,
    },
    /// The machine's deletion is stuck past its deadline (a lost node): delete it without a
    /// grace period and end its leases.
    ForceDelete {
        /// When it should have been gone.
        deadline: Timestamp,
    },
    /// The machine is gone: forget its ID and IP and end its leases, so the next pass creates
    /// a new one.
    Forget {
        /// Record this hash as A too (it differed from H).
        record_hash: Option<String>,
        /// How it went.
        loss: Loss,
    },
    /// The machine is replaced (its drain is over, or it was not serving): delete it, poll
    /// until NotFound, then re-create.
    Replace {
        /// Why.
        reason: DisruptionReason,
        /// The drain timed out with leases still active: end them first.
        drain_timed_out: bool,
    },
    /// A voluntary replacement is due: ask the replacement budget, then start the drain.
    Disrupt {
        /// Why.
        reason: DisruptionReason,
    },
    /// The proxy drains (no new leases, no renewals): wait for its leases to end.
    Drain {
        /// Leases still active.
        leases: u32,
        /// When the machine is deleted anyway.
        deadline: Timestamp,
    },
    /// Record the hash without replacing (annotation empty or from another hash version).
    Adopt {
        /// The hash to record as A.
        hash: String,
    },
    /// The Proxy is being deleted: delete its machine, poll until it is gone.
    DeleteForCleanup {
        /// Its drain timed out with leases still active: end them first.
        drain_timed_out: bool,
    },
    /// The Proxy is being deleted while a create was pending (no ID recorded): find the machine
    /// by name and delete it before the finalizer goes.
    CleanupPending,
    /// An External proxy: no provider, the endpoint is the address.
    External,
    /// A transient failure: return an error so the controller backs off.
    Backoff {
        /// The failure.
        message: String,
    },
    /// The platform's policy refused (admission, authorization): show it, retry with backoff.
    Refused {
        /// The refusal.
        message: String,
    },
    /// The provider refused for quota: record the condition, retry in minutes.
    QuotaWait {
        /// The failure.
        message: String,
    },
    /// The provider refused permanently: phase Failed, retried on a slow timer.
    Fail {
        /// The failure.
        message: String,
    },
    /// A permanent failure was recorded for this generation and its retry is not due.
    StayFailed {
        /// When it is due.
        until: Timestamp,
    },
    /// The referenced cloud-init Secret or key is missing: record why, retry later.
    AwaitCloudInit {
        /// What is missing.
        message: String,
    },
}

/// How A relates to H.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HashState {
    /// A == H under the current hash version (or H is unknown: no drift decision possible).
    Current,
    /// A is empty or from another hash version: record H, never replace.
    Adoptable,
    /// A was computed by the current hash version and differs: the spec changed.
    Drifted,
}

fn hash_state(inputs: &Inputs<'_>) -> HashState {
    let Some(desired) = inputs.desired_hash else {
        return HashState::Current;
    };
    let recorded = inputs.recorded_hash.filter(|a| !a.is_empty());
    let same_version = inputs.recorded_hash_version == Some(SPEC_HASH_VERSION);
    match recorded {
        Some(a) if a == desired && same_version => HashState::Current,
        Some(a) if a != desired && same_version => HashState::Drifted,
        _ => HashState::Adoptable,
    }
}

/// The action for a failed provider call of the given class (from `get`, `create` or `delete`).
pub fn on_provider_error(class: ErrorClass, message: String) -> Action {
    match class {
        ErrorClass::QuotaExceeded => Action::QuotaWait { message },
        ErrorClass::Refused => Action::Refused { message },
        ErrorClass::Permanent => Action::Fail { message },
        // NotFound only means something for `get`, which `decide` handles as an input; from any
        // other call it is unexpected, and retrying is the safe answer.
        ErrorClass::Transient | ErrorClass::NotFound => Action::Backoff { message },
    }
}

/// `at` plus `duration` (saturating).
pub fn after(at: Timestamp, duration: Duration) -> Timestamp {
    jiff::SignedDuration::try_from(duration)
        .ok()
        .and_then(|d| at.checked_add(d).ok())
        .unwrap_or(Timestamp::MAX)
}

/// When the machine's stuck deletion is force-deleted, if its deletion was asked for.
fn force_delete_at(machine: &Instance, limits: &Limits) -> Option<Timestamp> {
    machine
        .deletion_deadline
        .map(|deadline| after(deadline, limits.force_delete_margin))
}

/// When a machine that is not running runs out of start-up time: the timeout counts from the
/// later of its creation and the moment the proxy stopped being provisioned.
fn startup_deadline(inputs: &Inputs<'_>, machine: &Instance) -> Option<Timestamp> {
    let since = match (machine.created_at, inputs.not_provisioned_since) {
        (Some(created), Some(since)) => Some(created.max(since)),
        (created, since) => created.or(since),
    }?;
    Some(after(since, inputs.limits.startup_timeout))
}

/// How a machine that is now NotFound went.
fn loss(inputs: &Inputs<'_>) -> Loss {
    match inputs.phase {
        Some(Phase::Replacing | Phase::Deleting) => Loss::Expected,
        _ if inputs.had_ip => Loss::WhileServing,
        _ => Loss::BeforeRunning,
    }
}

/// The design's reconcile table: exactly one action for the given inputs.
pub fn decide(inputs: &Inputs<'_>) -> Action {
    if inputs.mode == Mode::External {
        return Action::External;
    }
    let provider_id = inputs.provider_id.filter(|id| !id.is_empty());
    let create_pending = inputs.create_pending.filter(|h| !h.is_empty());
    let now = inputs.now;
    let stuck = |machine: &Instance| {
        force_delete_at(machine, &inputs.limits)
            .filter(|at| *at <= now)
            .and(machine.deletion_deadline)
    };
    if inputs.deleting {
        return match (provider_id, inputs.observation) {
            (None, _) if create_pending.is_some() => Action::CleanupPending,
            (None, _) | (Some(_), Observation::NotFound) => Action::RemoveFinalizer,
            (Some(_), Observation::Error { class, message }) => {
                on_provider_error(*class, message.clone())
            }
            (Some(_), Observation::Found(machine)) => match stuck(machine) {
                Some(deadline) => Action::ForceDelete { deadline },
                None if serving(machine) => {
                    let since = inputs.deletion_requested.unwrap_or(now);
                    match drain(inputs, since) {
                        Drain::Draining { leases, deadline } => Action::Drain { leases, deadline },
                        Drain::Drained => Action::DeleteForCleanup {
                            drain_timed_out: false,
                        },
                        Drain::TimedOut => Action::DeleteForCleanup {
                            drain_timed_out: true,
                        },
                    }
                }
                None => Action::DeleteForCleanup {
                    drain_timed_out: false,
                },
            },
            (Some(_), _) => Action::DeleteForCleanup {
                drain_timed_out: false,
            },
        };
    }
    if !inputs.finalizer_present {
        return Action::AddFinalizer;
    }
    let held = inputs.hold_until.filter(|until| *until > now);
    if let (true, Some(until)) = (inputs.failed_this_generation, held) {
        return Action::StayFailed { until };
    }
    let Some(_) = provider_id else {
        if let Some(until) = held {
            return Action::HoldCreate { until };
        }
        if let Some(hash) = create_pending {
            return Action::Recover {
                hash: hash.to_owned(),
            };
        }
        return match inputs.desired_hash {
            Some(hash) => Action::Create {
                hash: hash.to_owned(),
            },
            None => Action::AwaitCloudInit {
                message: inputs
                    .cloud_init_problem
                    .unwrap_or("cloud-init cannot be resolved")
                    .to_owned(),
            },
        };
    };
    let machine = match inputs.observation {
        Observation::Error { class, message } => {
            return on_provider_error(*class, message.clone());
        }
        Observation::NotFound => {
            let record_hash = inputs
                .desired_hash
                .filter(|h| inputs.recorded_hash != Some(*h))
                .map(str::to_owned);
            return Action::Forget {
                record_hash,
                loss: loss(inputs),
            };
        }
        // Not reachable for a Managed proxy with an ID (the caller always queries), but a
        // missing answer must never destroy anything: ask again.
        Observation::NotQueried => {
            return Action::Backoff {
                message: "no answer from the provider".to_owned(),
            };
        }
        Observation::Found(machine) => machine,
    };
    if let Some(deadline) = stuck(machine) {
        return Action::ForceDelete { deadline };
    }
    // The ID was recorded but the crash came before the pending marker was cleared: the machine
    // was created with the pending hash, so record that one.
    if let Some(hash) = create_pending {
        return Action::Adopt {
            hash: hash.to_owned(),
        };
    }
    let drifted = match hash_state(inputs) {
        HashState::Adoptable => {
            return Action::Adopt {
                hash: inputs.desired_hash.unwrap_or_default().to_owned(),
            };
        }
        HashState::Drifted => true,
        HashState::Current => false,
    };
    let serving = serving(machine);
    // A voluntary replacement whose old machine is still there: drain it, then delete it.
    if let Some(disruption) = inputs.disruption.filter(|d| d.replaced_at.is_none()) {
        let reason = disruption.reason;
        return match drain(inputs, disruption.since) {
            Drain::Draining { leases, deadline } if serving => Action::Drain { leases, deadline },
            Drain::TimedOut if serving => Action::Replace {
                reason,
                drain_timed_out: true,
            },
            _ => Action::Replace {
                reason,
                drain_timed_out: false,
            },
        };
    }
    if drifted && !serving {
        // Nothing to drain and nobody served: replace it now, outside the budget.
        return Action::Replace {
            reason: DisruptionReason::SpecChange,
            drain_timed_out: false,
        };
    }
    let due = serving.then(|| voluntary(inputs, machine));
    if drifted {
        return Action::Disrupt {
            reason: DisruptionReason::SpecChange,
        };
    }
    if let Some(Voluntary {
        reason: Some(reason),
        ..
    }) = due
    {
        return Action::Disrupt { reason };
    }
    match machine.state {
        InstanceState::Provisioning => {
            let deadline = startup_deadline(inputs, machine);
            if deadline.is_some_and(|d| d <= now) {
                Action::ReplaceStuck {
                    waiting: machine.waiting.clone(),
                }
            } else {
                Action::AwaitProvisioning {
                    waiting: machine.waiting.clone(),
                    deadline,
                }
            }
        }
        InstanceState::Running => {
            let due = due.unwrap_or_default();
            Action::Running {
                ip: machine.ip.clone(),
                replaced: replacement_done(inputs),
                recheck: due.recheck,
                remediation_paused: due.paused,
            }
        }
        InstanceState::Stopped | InstanceState::Terminated => Action::DeleteDead {
            force_at: force_delete_at(machine, &inputs.limits),
        },
    }
}

/// Whether a machine serves (runs, and nobody asked for its deletion): only a serving machine
/// drains, rotates or is remediated.
fn serving(machine: &Instance) -> bool {
    machine.state == InstanceState::Running && machine.deletion_deadline.is_none()
}

/// What rotation and remediation say about a serving machine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Voluntary {
    /// A replacement due now.
    reason: Option<DisruptionReason>,
    /// When one falls due later.
    recheck: Option<Timestamp>,
    /// Remediation is due but paused: (unhealthy, managed).
    paused: Option<(usize, usize)>,
}

/// Rotation (the annotation, then `maxLifetime`) and remediation of a serving machine.
fn voluntary(inputs: &Inputs<'_>, machine: &Instance) -> Voluntary {
    let now = inputs.now;
    let rotate_at = inputs
        .max_lifetime
        .zip(machine.created_at)
        .map(|(lifetime, created)| rotation::due_at(created, lifetime, inputs.uid));
    let remediate_at = inputs
        .unhealthy_since
        .map(|since| remediation::due_at(since, machine.created_at, inputs.limits.remediate_after));
    let mut verdict = Voluntary::default();
    if inputs.rotate_requested {
        verdict.reason = Some(DisruptionReason::RotateRequested);
    } else if rotate_at.is_some_and(|at| at <= now) {
        verdict.reason = Some(DisruptionReason::MaxLifetime);
    } else if remediate_at.is_some_and(|at| at <= now) {
        match inputs.remediation {
            Gate::Allowed => verdict.reason = Some(DisruptionReason::Unhealthy),
            Gate::Paused { unhealthy, managed } => verdict.paused = Some((unhealthy, managed)),
        }
    }
    verdict.recheck = [rotate_at, remediate_at]
        .into_iter()
        .flatten()
        .filter(|at| *at > now)
        .min();
    verdict
}

/// Whether a voluntary replacement is over: its new machine passed a health check made after
/// the old one was gone.
fn replacement_done(inputs: &Inputs<'_>) -> bool {
    let Some(replaced_at) = inputs.disruption.and_then(|d| d.replaced_at) else {
        return false;
    };
    inputs
        .health
        .is_some_and(|(healthy, at)| healthy && at > replaced_at)
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: &str = "hash-new";
    const A_OLD: &str = "hash-old";
    const V: &str = SPEC_HASH_VERSION;

    fn ts(seconds: i64) -> Timestamp {
        Timestamp::from_second(seconds).unwrap()
    }

    /// "Now" in every row.
    const NOW: i64 = 10_000;

    fn machine(state: InstanceState) -> Instance {
        Instance {
            provider_id: "ns/proxy-x".into(),
            name: "proxy-x".into(),
            state,
            ip: (state == InstanceState::Running).then(|| "10.0.0.9".to_owned()),
            uid: Some("u".into()),
            created_at: Some(ts(NOW - 60)),
            waiting: None,
            deletion_deadline: None,
        }
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
        Inputs {
            mode: Mode::Managed,
            deleting: false,
            finalizer_present: true,
            provider_id: Some("ns/proxy-x"),
            recorded_hash: Some(H),
            recorded_hash_version: Some(V),
            create_pending: None,
            desired_hash: Some(H),
            cloud_init_problem: None,
            failed_this_generation: false,
            phase: Some(Phase::Ready),
            had_ip: true,
            not_provisioned_since: None,
            hold_until: None,
            now: ts(NOW),
            limits: Limits {
                startup_timeout: Duration::from_secs(600),
                force_delete_margin: Duration::from_secs(30),
                drain_timeout: Duration::from_secs(900),
                remediate_after: Duration::from_secs(600),
            },
            observation,
            deletion_requested: None,
            disruption: None,
            active_leases: 0,
            uid: "uid-1",
            max_lifetime: None,
            rotate_requested: false,
            unhealthy_since: None,
            health: None,
            remediation: Gate::Allowed,
        }
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
    fn external_proxies_never_touch_finalizers_or_providers() {
        let obs = Observation::NotQueried;
        for (deleting, finalizer) in [(false, false), (true, false), (false, true)] {
            let inputs = Inputs {
                mode: Mode::External,
                deleting,
                finalizer_present: finalizer,
                provider_id: None,
                ..base(&obs)
            };
            assert_eq!(decide(&inputs), Action::External);
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
}
