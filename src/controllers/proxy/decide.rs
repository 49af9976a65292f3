//! The reconciler's state machine: one pure decision per reconcile.
//!
//! [`decide`] turns what is known about a Proxy (its metadata, its status, the spec hash of what
//! it asks for, and what the provider said about its machine) into exactly one [`Action`]. The
//! I/O that carries an action out lives in `execute`, so every row of the design's table is tested
//! here without a cluster or a cloud.

use std::time::Duration;

use jiff::Timestamp;

use super::remediation::{self, Gate};
use super::rotation;
use super::time::after;
use crate::provider::{ErrorClass, Instance, InstanceState, Waiting};
use crate::resources::proxy::{Disruption, DisruptionReason, Mode, Phase};
use crate::resources::spec_hash::SPEC_HASH_VERSION;

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

impl Action {
    /// Every [`Action::label`], for metrics that start each series at zero.
    pub const LABELS: [&'static str; 24] = [
        "add_finalizer",
        "remove_finalizer",
        "create",
        "recover",
        "hold_create",
        "await_provisioning",
        "replace_stuck",
        "running",
        "delete_dead",
        "force_delete",
        "forget",
        "replace",
        "disrupt",
        "drain",
        "adopt",
        "delete_for_cleanup",
        "cleanup_pending",
        "external",
        "backoff",
        "refused",
        "quota_wait",
        "fail",
        "stay_failed",
        "await_cloud_init",
    ];

    /// The action's name as a metric label (one per variant, so the label set is bounded).
    pub fn label(&self) -> &'static str {
        match self {
            Action::AddFinalizer => "add_finalizer",
            Action::RemoveFinalizer => "remove_finalizer",
            Action::Create { .. } => "create",
            Action::Recover { .. } => "recover",
            Action::HoldCreate { .. } => "hold_create",
            Action::AwaitProvisioning { .. } => "await_provisioning",
            Action::ReplaceStuck { .. } => "replace_stuck",
            Action::Running { .. } => "running",
            Action::DeleteDead { .. } => "delete_dead",
            Action::ForceDelete { .. } => "force_delete",
            Action::Forget { .. } => "forget",
            Action::Replace { .. } => "replace",
            Action::Disrupt { .. } => "disrupt",
            Action::Drain { .. } => "drain",
            Action::Adopt { .. } => "adopt",
            Action::DeleteForCleanup { .. } => "delete_for_cleanup",
            Action::CleanupPending => "cleanup_pending",
            Action::External => "external",
            Action::Backoff { .. } => "backoff",
            Action::Refused { .. } => "refused",
            Action::QuotaWait { .. } => "quota_wait",
            Action::Fail { .. } => "fail",
            Action::StayFailed { .. } => "stay_failed",
            Action::AwaitCloudInit { .. } => "await_cloud_init",
        }
    }
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

/// An External proxy: no machine and no provider, so nothing its deletion must wait for and
/// no finalizer. One that carries ours anyway (from a manifest copied off a finalized object,
/// or added by hand) loses it, so that its deletion never waits on this operator.
fn external(inputs: &Inputs<'_>) -> Action {
    if inputs.finalizer_present {
        Action::RemoveFinalizer
    } else {
        Action::External
    }
}

/// The design's reconcile table: exactly one action for the given inputs.
pub fn decide(inputs: &Inputs<'_>) -> Action {
    if inputs.mode == Mode::External {
        return external(inputs);
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
    // The Healthy condition lags the probes: a passing probe after it turned False means the
    // proxy recovered, whatever the condition still says.
    let remediate_at = inputs
        .unhealthy_since
        .filter(|since| {
            !inputs
                .health
                .is_some_and(|(healthy, at)| healthy && at > *since)
        })
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
mod tests;
