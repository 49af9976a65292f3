//! Executing a decision: the thin I/O layer between [`decide`] and the provider and Kubernetes
//! APIs. An action makes the metadata writes needed *before* a provider call (finalizer,
//! create-pending marker) and the provider call itself, and returns a [`Step`]: the status
//! change, the annotations to record *after* (spec hash), the Event and the requeue, which
//! `write` carries out.
//!
//! [`act`] dispatches each action to its job: `create` (credentials, the create, its
//! recovery, the wait until it runs), `running` (a running machine, a replacement's start),
//! `drain`, `delete` (replacements, deletions, a gone machine), `finalizer` and `failure`.
//! `step` and `machine` hold what they all use.
//!
//! [`decide`]: super::decide::decide

mod create;
mod delete;
mod drain;
mod failure;
mod finalizer;
mod machine;
mod running;
mod step;

use std::time::Duration;

use kube::Api;
use kube::runtime::controller;

pub(crate) use failure::unknown_provider;
pub(crate) use machine::Machine;
pub(crate) use step::{RetryEffect, Step};

use super::decide::{Action, Observation};
use super::error::Error;
use super::status::{FieldChange, REASON_EXTERNAL, StatusChange};
use crate::resources::phase::Provisioning;
use crate::resources::proxy::{ConditionStatus, Proxy, ProxyStatus};
use step::{poll_or_at, requeue_at};

/// Ledger reason of leases ended because their machine was force-deleted.
pub const LEASES_MACHINE_LOST: &str = "machine_lost";
/// Ledger reason of leases ended because their machine vanished under them.
pub const LEASES_MACHINE_GONE: &str = "machine_gone";
/// Ledger reason of leases ended because their machine was replaced.
pub const LEASES_MACHINE_REPLACED: &str = "machine_replaced";
/// Ledger reason of leases still active when a drain timed out.
pub const LEASES_DRAIN_TIMEOUT: &str = "drain_timeout";
/// Event reason: a drain timed out and its leases were ended.
pub const REASON_DRAIN_TIMED_OUT: &str = "DrainTimedOut";

/// Carries out one action; the status change it leaves carries the machine's creation time
/// as the provider reported it.
pub(crate) async fn execute(
    action: Action,
    machine: &Machine<'_>,
    current: &ProxyStatus,
    api: &Api<Proxy>,
) -> Result<Step, Error> {
    // A slot granted by a Disrupt whose status write was lost, for a replacement no longer
    // wanted, goes back to the budget.
    if current.disruption.is_none() && !matches!(action, Action::Disrupt { .. }) {
        machine.ctx.grants.release(&machine.uid());
    }
    let mut step = act(action, machine, current, api).await?;
    if let Some(status) = &mut step.status {
        status.machine_created_at = match machine.observation {
            Observation::Found(instance) => FieldChange::to(instance.created_at),
            Observation::NotFound => FieldChange::Clear,
            Observation::NotQueried | Observation::Error { .. } => FieldChange::Keep,
        };
    }
    Ok(step)
}

/// The I/O of one action, by the job it belongs to.
async fn act(
    action: Action,
    machine: &Machine<'_>,
    current: &ProxyStatus,
    api: &Api<Proxy>,
) -> Result<Step, Error> {
    let config = &machine.ctx.config;
    Ok(match action {
        Action::AddFinalizer => finalizer::add_finalizer(machine, api).await?,
        Action::RemoveFinalizer => finalizer::remove_finalizer(machine, api).await?,
        Action::Create { hash } => create::create(machine, current, api, &hash).await?,
        Action::Recover { hash } => create::recover(machine, current, api, &hash).await?,
        Action::HoldCreate { until } => create::hold_create(machine, until),
        Action::AwaitProvisioning { waiting, deadline } => {
            let requeue = poll_or_at(config.provisioning_poll, deadline, machine.now);
            create::await_provisioning(machine, current, waiting, requeue)
        }
        Action::ReplaceStuck { waiting } => {
            delete::replace_stuck(machine, current, waiting).await?
        }
        Action::Running {
            ip,
            replaced,
            recheck,
            remediation_paused,
        } => running::running(machine, current, ip, replaced, recheck, remediation_paused),
        Action::Disrupt { reason } => running::disrupt(machine, current, reason),
        Action::Drain { leases, deadline } => drain::drain(machine, current, leases, deadline),
        Action::DeleteDead { force_at } => delete::delete_dead(machine, current, force_at).await?,
        Action::ForceDelete { deadline } => {
            delete::force_delete(machine, current, deadline).await?
        }
        Action::Replace {
            reason,
            drain_timed_out,
        } => delete::replace(machine, current, reason, drain_timed_out).await?,
        Action::DeleteForCleanup { drain_timed_out } => {
            delete::delete_for_cleanup(machine, current, drain_timed_out).await?
        }
        Action::CleanupPending => delete::cleanup_pending(machine, current, api).await?,
        Action::Forget {
            record_hash: hash,
            loss,
        } => delete::forget(machine, current, hash, loss).await,
        Action::Adopt { hash } => Step::new(None, controller::Action::requeue(Duration::ZERO))
            .with_annotations(Some(create::record_hash(&hash))),
        Action::External => external(machine.proxy),
        Action::StayFailed { until } => {
            Step::requeue(requeue_at(until, machine.now)).with_retry(RetryEffect::Neutral)
        }
        Action::AwaitCloudInit { message } => failure::cloud_init_missing(&message, config),
        failed @ (Action::Backoff { .. }
        | Action::Refused { .. }
        | Action::QuotaWait { .. }
        | Action::Fail { .. }) => failure::failure_step(failed, machine, current)?,
    })
}

/// An External proxy: nothing to create; its address is its endpoint's host.
fn external(proxy: &Proxy) -> Step {
    Step::new(
        Some(
            StatusChange::new(
                Provisioning::Done,
                ConditionStatus::True,
                REASON_EXTERNAL,
                "external endpoint",
            )
            .provider_id(FieldChange::Clear)
            .ip(proxy
                .spec
                .endpoint
                .as_ref()
                .map_or(FieldChange::Clear, |e| FieldChange::Set(e.host.clone()))),
        ),
        controller::Action::await_change(),
    )
}
