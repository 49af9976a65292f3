//! Executing a decision: the thin I/O layer between [`decide`] and the provider and Kubernetes
//! APIs. An action makes the metadata writes needed *before* a provider call (finalizer,
//! create-pending marker) and the provider call itself, and returns a [`Step`]: the status
//! change, the annotations to record *after* (spec hash), the Event and the requeue, which
//! `write` carries out.
//!
//! [`decide`]: super::decide::decide

use std::collections::BTreeMap;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::controller;
use kube::runtime::events::{Event, EventType};
use kube::{Api, Resource, ResourceExt};
use serde_json::{Value, json};

use super::budget::{self, Admission};
use super::context::{Context, ReconcilerConfig};
use super::decide::{Action, Loss, Observation, on_provider_error};
use super::error::Error;
use super::metrics::DELETED;
use super::pacing::{At, Hold, hold_for};
use super::phase::Provisioning;
use super::status::{
    FieldChange, REASON_CLOUD_INIT, REASON_CREATE_FAILED, REASON_DELETING, REASON_EXTERNAL,
    REASON_FORCE_DELETED, REASON_MACHINE_GONE, REASON_MACHINE_LOST, REASON_MACHINE_STOPPED,
    REASON_MACHINE_TERMINATING, REASON_PROVIDER_FAILED, REASON_PROVISIONING, REASON_QUOTA,
    REASON_REFUSED, REASON_REMEDIATION_PAUSED, REASON_REPLACEMENT_PENDING, REASON_REPLACING,
    REASON_RUNNING, REASON_STARTUP_TIMEOUT, REASON_UNKNOWN_PROVIDER, StatusChange,
    annotations_patch,
};
use super::time::after;
use crate::events::event;
use crate::provider::{
    CreateRequest, MachineCredentials, Provider, ProviderError, Waiting, machine_labels,
};
use crate::resources::naming::machine_name;
use crate::resources::proxy::{
    CONDITION_PROVISIONED, CREATE_PENDING_ANNOTATION, ConditionStatus, Disruption,
    DisruptionReason, FINALIZER, Phase, Proxy, ProxySpec, ProxyStatus, REASON_DRAINING,
    ROTATE_ANNOTATION, ROTATED_ANNOTATION, SPEC_HASH_ANNOTATION, SPEC_HASH_VERSION_ANNOTATION,
};
use crate::resources::spec_hash::SPEC_HASH_VERSION;
use crate::serving::credentials::{
    CREDENTIALS_SECRET_LABEL, Credentials, HTPASSWD_SECRET_KEY, PASSWORD_KEY, USERNAME_KEY,
    machine_secret_name,
};

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

/// What a reconcile's outcome means for the retry memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RetryEffect {
    /// It did what it set out to: failures in a row start over.
    Progress,
    /// The machine runs: machines that never ran are forgiven too.
    Running,
    /// It waited, or already counted its own failure.
    Neutral,
}

/// What executing an action leaves to write.
pub(super) struct Step {
    /// Status change, or `None` to leave status alone.
    pub status: Option<StatusChange>,
    /// Annotation patch applied after the status write.
    pub annotations: Option<Value>,
    /// Event to publish last.
    pub event: Option<Event>,
    /// When to look again.
    pub requeue: controller::Action,
    /// What it means for the retry memory.
    pub outcome: RetryEffect,
    /// The resourceVersion returned by a metadata patch made before the status write.
    pub resource_version: Option<String>,
    /// The disruption (its metric label) this step starts: counted once its status is written,
    /// so a write that lost a race (and is redone) counts nothing.
    pub disruption_started: Option<&'static str>,
}

impl Step {
    fn new(status: Option<StatusChange>, requeue: controller::Action) -> Self {
        Step {
            status,
            annotations: None,
            event: None,
            requeue,
            outcome: RetryEffect::Progress,
            resource_version: None,
            disruption_started: None,
        }
    }

    fn requeue(requeue: controller::Action) -> Self {
        Step::new(None, requeue)
    }

    fn with_event(mut self, event: Option<Event>) -> Self {
        self.event = event;
        self
    }

    fn with_annotations(mut self, annotations: Option<Value>) -> Self {
        self.annotations = annotations;
        self
    }

    fn with_outcome(mut self, outcome: RetryEffect) -> Self {
        self.outcome = outcome;
        self
    }

    /// Sets (`Some`) or clears (`None`) `status.disruption` with the status change.
    fn with_disruption(mut self, disruption: Option<Disruption>) -> Self {
        if let Some(status) = &mut self.status {
            status.disruption = FieldChange::to(disruption);
        }
        self
    }

    /// Records the port a machine was created with, with the status change.
    fn with_port(mut self, port: i32) -> Self {
        if let Some(status) = &mut self.status {
            status.port = FieldChange::Set(port);
        }
        self
    }
}

/// What `execute` needs about the machine behind a proxy.
pub(super) struct Machine<'a> {
    pub proxy: &'a Proxy,
    pub provider: Option<&'a dyn Provider>,
    pub provider_id: Option<&'a str>,
    /// The resolved cloud-init content, if any.
    pub cloud_init: Option<String>,
    /// The spec hash of what the Proxy asks for, when its cloud-init could be read.
    pub desired_hash: Option<&'a str>,
    /// What the provider said about `provider_id`.
    pub observation: &'a Observation,
    pub ctx: &'a Context,
    pub now: Timestamp,
}

impl Machine<'_> {
    fn provider(&self) -> Result<&dyn Provider, Error> {
        self.provider
            .ok_or_else(|| Error::Provider("no provider for this Proxy".to_owned()))
    }

    fn provider_id(&self) -> Result<&str, Error> {
        self.provider_id
            .ok_or(Error::MissingField("status.providerID"))
    }

    fn uid(&self) -> String {
        self.proxy.uid().unwrap_or_default()
    }

    fn create_request(&self, credentials: MachineCredentials) -> CreateRequest {
        let id = self.proxy.id();
        let labels = machine_labels(&id.uid, &self.ctx.install);
        CreateRequest {
            machine_name: machine_name(&id.uid),
            namespace: id.namespace,
            proxy_name: id.name,
            proxy_uid: id.uid,
            port: self.proxy.spec.port,
            placement: self.proxy.spec.placement.clone(),
            cloud_init: self.cloud_init.clone(),
            labels,
            credentials: Some(credentials),
        }
    }

    /// Now, in the Proxy's current generation.
    fn at(&self) -> At {
        At {
            now: self.now,
            generation: self.proxy.metadata.generation,
        }
    }

    /// The base and cap of the failure backoff.
    fn backoff(&self) -> (Duration, Duration) {
        let config = &self.ctx.config;
        (config.error_requeue, config.error_requeue_max)
    }

    /// Ends the proxy's active leases (its machine is gone); a ledger failure is logged and
    /// leaves them to expire, never blocking the repair.
    async fn end_leases(&self, reason: &str) -> u64 {
        let uid = self.uid();
        match self.ctx.ledger.end_leases(&uid, reason).await {
            Ok(ended) => {
                if ended > 0 {
                    log::info!(
                        "Proxy {}: ended {ended} active leases ({reason})",
                        self.proxy.key()
                    );
                }
                ended
            }
            Err(e) => {
                log::warn!(
                    "Proxy {}: cannot end the leases of its gone machine ({reason}); they \
                     run until they expire: {e}",
                    self.proxy.key()
                );
                0
            }
        }
    }
}

/// A requeue after `until`, from `now`.
fn requeue_at(until: Timestamp, now: Timestamp) -> controller::Action {
    let wait = until
        .duration_since(now)
        .try_into()
        .unwrap_or(Duration::ZERO);
    controller::Action::requeue(wait)
}

/// A requeue after `poll`, or at `deadline` if that comes first.
fn poll_or_at(poll: Duration, deadline: Option<Timestamp>, now: Timestamp) -> controller::Action {
    match deadline {
        Some(deadline) if after(now, poll) > deadline => requeue_at(deadline, now),
        _ => controller::Action::requeue(poll),
    }
}

/// The condition message of a hold: what happened and when the next try is.
fn hold_message(hold: &Hold) -> String {
    let next = hold.until.round(jiff::Unit::Second).unwrap_or(hold.until);
    format!("{}; next attempt at {next}", hold.message)
}

/// `reason: message` of a provider's waiting reason.
fn waiting_text(waiting: &Waiting) -> String {
    if waiting.message.is_empty() {
        waiting.reason.clone()
    } else {
        format!("{}: {}", waiting.reason, waiting.message)
    }
}

/// Whether the `Provisioned` condition already has `reason` (so its Event went out).
fn condition_reason_is(current: &ProxyStatus, reason: &str) -> bool {
    current
        .condition(CONDITION_PROVISIONED)
        .is_some_and(|c| c.reason == reason)
}

/// The Event `reason` with `note`, unless the `Provisioned` condition already has that reason:
/// its Event went out when the condition got it, and a reconcile that finds the same situation
/// again does not repeat it.
fn new_reason_event(
    current: &ProxyStatus,
    event_type: EventType,
    reason: &str,
    action: &str,
    note: &str,
) -> Option<Event> {
    (!condition_reason_is(current, reason))
        .then(|| event(event_type, reason, action, note.to_owned()))
}

/// Carries out one action; the status change it leaves carries the machine's creation time
/// as the provider reported it.
pub(super) async fn execute(
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

/// The I/O of one action.
async fn act(
    action: Action,
    machine: &Machine<'_>,
    current: &ProxyStatus,
    api: &Api<Proxy>,
) -> Result<Step, Error> {
    let config = &machine.ctx.config;
    let proxy = machine.proxy;
    let step = match action {
        Action::AddFinalizer => {
            let mut finalizers = proxy.finalizers().to_vec();
            finalizers.push(FINALIZER.to_owned());
            patch_finalizers(api, proxy, finalizers).await?;
            Step::requeue(controller::Action::await_change())
        }
        Action::RemoveFinalizer => remove_finalizer(machine, api).await?,
        Action::Create { hash } => create(machine, current, api, &hash).await?,
        Action::Recover { hash } => {
            let provider = machine.provider()?;
            match find_by_name(machine, provider).await {
                Ok(Some(instance)) => {
                    log::info!(
                        "Proxy {}: recovered machine {} from an interrupted create",
                        proxy.key(),
                        instance.provider_id
                    );
                    Step::new(
                        Some(provisioning(FieldChange::Set(instance.provider_id))),
                        controller::Action::requeue(config.provisioning_poll),
                    )
                    .with_annotations(Some(record_created(proxy, &hash)))
                    .with_port(proxy.spec.port)
                }
                Ok(None) => match machine.desired_hash {
                    Some(hash) => create(machine, current, api, hash).await?,
                    None => cloud_init_missing("cloud-init cannot be resolved", config),
                },
                Err(e) => failure(machine, current, e)?,
            }
        }
        Action::HoldCreate { until } => {
            let hold = machine
                .ctx
                .pacing
                .get(&machine.uid())
                .hold
                .filter(|h| h.until == until);
            let status = hold.map(|hold| {
                StatusChange::new(
                    Provisioning::Waiting,
                    ConditionStatus::False,
                    hold.reason.clone(),
                    hold_message(&hold),
                )
            });
            Step::new(status, requeue_at(until, machine.now)).with_outcome(RetryEffect::Neutral)
        }
        Action::AwaitProvisioning { waiting, deadline } => {
            let requeue = poll_or_at(config.provisioning_poll, deadline, machine.now);
            await_provisioning(machine, current, waiting, requeue)
        }
        Action::ReplaceStuck { waiting } => {
            let id = machine.provider_id()?;
            let timeout = humantime::format_duration(config.startup_timeout);
            let why = waiting
                .as_ref()
                .map(|w| format!(" ({})", waiting_text(w)))
                .unwrap_or_default();
            let message = format!("machine {id} did not run within {timeout}{why}; replacing it");
            log::warn!("Proxy {}: {message}", proxy.key());
            machine.ctx.pacing.machine_failed(
                &machine.uid(),
                machine.backoff(),
                machine.at(),
                REASON_STARTUP_TIMEOUT,
                message.clone(),
            );
            delete(
                machine,
                current,
                Provisioning::Replacing,
                (EventType::Warning, REASON_STARTUP_TIMEOUT),
                &message,
            )
            .await?
        }
        Action::Running {
            ip,
            replaced,
            recheck,
            remediation_paused,
        } => running(machine, current, ip, replaced, recheck, remediation_paused),
        Action::Disrupt { reason } => disrupt(machine, current, reason),
        Action::Drain { leases, deadline } => {
            let deleting = proxy.metadata.deletion_timestamp.is_some();
            let cause = if deleting {
                "the Proxy's deletion"
            } else {
                current
                    .disruption
                    .as_ref()
                    .map_or("a replacement", |d| cause(d.reason))
            };
            let first = !condition_reason_is(current, REASON_DRAINING);
            let mut step = draining(machine, cause, leases, deadline, deleting);
            if first && deleting {
                step.disruption_started = Some(DELETED);
            }
            step.with_event(first.then(|| {
                event(
                    EventType::Normal,
                    REASON_DRAINING,
                    "Drain",
                    format!("draining before {cause}: {}", leases_text(leases)),
                )
            }))
        }
        Action::DeleteDead { force_at } => {
            let requeue = poll_or_at(config.deletion_poll, force_at, machine.now);
            let mut step = if current.phase == Some(Phase::Replacing) {
                // Already being replaced (its deletion shows as Terminated): keep the reason
                // given when the replacement started, ask again, wait.
                delete_again(machine, current).await?
            } else if let Some(at) = force_at {
                let id = machine.provider_id()?;
                let at = at.round(jiff::Unit::Second).unwrap_or(at);
                let message = format!(
                    "machine {id} is being deleted; a new one is created once it is gone, and \
                     it is force-deleted if still there at {at}"
                );
                delete(
                    machine,
                    current,
                    Provisioning::Replacing,
                    (EventType::Warning, REASON_MACHINE_TERMINATING),
                    &message,
                )
                .await?
            } else {
                delete(
                    machine,
                    current,
                    Provisioning::Replacing,
                    (EventType::Normal, REASON_MACHINE_STOPPED),
                    "machine stopped or terminated; deleting it to create a new one",
                )
                .await?
            };
            if step.outcome == RetryEffect::Progress {
                step.requeue = requeue;
            }
            step
        }
        Action::ForceDelete { deadline } => force_delete(machine, current, deadline).await?,
        Action::Replace {
            reason,
            drain_timed_out,
        } => {
            let ended = end_drain(machine, drain_timed_out).await;
            let message = format!("{}; deleting the machine to create a new one", why(reason));
            let step = delete(
                machine,
                current,
                Provisioning::Replacing,
                (EventType::Normal, REASON_REPLACING),
                &message,
            )
            .await?;
            with_drain_timeout(step, ended, machine)
        }
        Action::DeleteForCleanup { drain_timed_out } => {
            let ended = end_drain(machine, drain_timed_out).await;
            let step = delete(
                machine,
                current,
                Provisioning::Deleting,
                (EventType::Normal, REASON_DELETING),
                "Proxy is being deleted; deleting its machine",
            )
            .await?;
            with_drain_timeout(step, ended, machine)
        }
        Action::CleanupPending => {
            let provider = machine.provider()?;
            match find_by_name(machine, provider).await {
                Ok(Some(instance)) => {
                    let id = instance.provider_id;
                    log::info!(
                        "Proxy {}: deleting machine {id} of an interrupted create before the \
                         Proxy goes",
                        proxy.key()
                    );
                    match provider.delete(&id).await {
                        Ok(()) => deleting(machine, FieldChange::Set(id)),
                        Err(e) => failure(machine, current, e)?,
                    }
                }
                Ok(None) => remove_finalizer(machine, api).await?,
                Err(e) => failure(machine, current, e)?,
            }
        }
        Action::Forget {
            record_hash: hash,
            loss,
        } => forget(machine, current, hash, loss).await,
        Action::Adopt { hash } => Step::new(None, controller::Action::requeue(Duration::ZERO))
            .with_annotations(Some(record_hash(&hash))),
        Action::External => Step::new(
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
        ),
        Action::StayFailed { until } => {
            Step::requeue(requeue_at(until, machine.now)).with_outcome(RetryEffect::Neutral)
        }
        Action::AwaitCloudInit { message } => cloud_init_missing(&message, config),
        failed @ (Action::Backoff { .. }
        | Action::Refused { .. }
        | Action::QuotaWait { .. }
        | Action::Fail { .. }) => failure_step(failed, machine, current)?,
    };
    Ok(step)
}

/// The machine runs: record its address; end a finished replacement (freeing its budget
/// slot); say when remediation is paused; look again when rotation or remediation falls due.
fn running(
    machine: &Machine<'_>,
    current: &ProxyStatus,
    ip: Option<String>,
    replaced: bool,
    recheck: Option<Timestamp>,
    remediation_paused: Option<(usize, usize)>,
) -> Step {
    let config = &machine.ctx.config;
    let mut poll = config.drift_poll;
    let (reason, message, event) = match remediation_paused {
        Some((unhealthy, managed)) => {
            poll = config.provisioning_poll;
            let provider = machine.proxy.spec.provider.as_deref().unwrap_or_default();
            let message = format!(
                "machine is running but failing health checks for longer than {}; not replaced \
                 while {unhealthy} of the {managed} Managed proxies of provider {provider} are \
                 unhealthy (more than --max-unhealthy {}): the fault is likely the network or \
                 the probe target",
                humantime::format_duration(config.remediate_after),
                config.max_unhealthy,
            );
            let event = new_reason_event(
                current,
                EventType::Warning,
                REASON_REMEDIATION_PAUSED,
                "Remediate",
                &message,
            );
            if event.is_some() {
                log::warn!("Proxy {}: {message}", machine.proxy.key());
            }
            (REASON_REMEDIATION_PAUSED, message, event)
        }
        None => (REASON_RUNNING, "machine is running".to_owned(), None),
    };
    let mut step = Step::new(
        Some(
            StatusChange::new(Provisioning::Done, ConditionStatus::True, reason, message)
                .ip(FieldChange::to(ip)),
        ),
        poll_or_at(poll, recheck, machine.now),
    )
    .with_event(event)
    .with_outcome(RetryEffect::Running);
    // A machine from before `status.port` existed: its spec hash is current (or this would
    // be a replacement), so it listens on `spec.port`.
    if current.port.is_none() {
        step = step.with_port(machine.proxy.spec.port);
    }
    if !replaced {
        return step;
    }
    machine.ctx.grants.release(&machine.uid());
    log::info!(
        "Proxy {}: its new machine runs and passes health checks; the replacement is over",
        machine.proxy.key()
    );
    step.with_disruption(None)
}

/// A voluntary replacement is due: start its drain if the replacement budget has a slot,
/// otherwise say it waits.
fn disrupt(machine: &Machine<'_>, current: &ProxyStatus, reason: DisruptionReason) -> Step {
    let ctx = machine.ctx;
    let Some(fleet) = ctx.fleet() else {
        // Right after start-up: the holders are not known until the first list is in.
        return Step::requeue(controller::Action::requeue(ctx.config.provisioning_poll))
            .with_outcome(RetryEffect::Neutral);
    };
    let limit = ctx
        .config
        .replacement_budget
        .budget(budget::managed(fleet.iter().map(AsRef::as_ref)));
    let holders = budget::holders(fleet.iter().map(AsRef::as_ref));
    let why = why(reason);
    match ctx.grants.try_admit(&machine.uid(), holders, limit) {
        Admission::Granted | Admission::AlreadyHeld => {
            let leases = ctx.ledger.counts().active_count(&machine.uid());
            let deadline = after(machine.now, ctx.config.drain_timeout);
            let cause = cause(reason);
            log::info!(
                "Proxy {}: {why}; draining ({}) before replacing its machine",
                machine.proxy.key(),
                leases_text(leases)
            );
            let mut step = draining(machine, cause, leases, deadline, false);
            step.disruption_started = Some(reason.label());
            step.with_disruption(Some(Disruption {
                reason,
                since: machine.now,
                replaced_at: None,
            }))
            .with_event(Some(event(
                EventType::Normal,
                REASON_DRAINING,
                "Drain",
                format!("{why}; draining before {cause}: {}", leases_text(leases)),
            )))
        }
        Admission::Wait { in_use, limit } => {
            let budget = ctx.config.replacement_budget;
            let message = if limit == 0 {
                format!("{why}; replacements are paused (--replacement-budget {budget})")
            } else {
                format!(
                    "{why}; waiting for the replacement budget ({in_use} of {limit} in use, \
                     --replacement-budget {budget})"
                )
            };
            let event = new_reason_event(
                current,
                EventType::Normal,
                REASON_REPLACEMENT_PENDING,
                "Replace",
                &message,
            );
            Step::new(
                Some(StatusChange::new(
                    Provisioning::Done,
                    ConditionStatus::True,
                    REASON_REPLACEMENT_PENDING,
                    message,
                )),
                controller::Action::requeue(ctx.config.provisioning_poll),
            )
            .with_event(event)
            .with_outcome(RetryEffect::Neutral)
        }
    }
}

/// The status of a draining proxy: its machine still serves the leases it has (the address
/// stays) and is deleted when they end or at `deadline`.
fn draining(
    machine: &Machine<'_>,
    cause: &str,
    leases: u32,
    deadline: Timestamp,
    deleting: bool,
) -> Step {
    let at = deadline.round(jiff::Unit::Second).unwrap_or(deadline);
    let requeue = poll_or_at(
        machine.ctx.config.deletion_poll,
        Some(deadline),
        machine.now,
    );
    Step::new(
        Some(StatusChange::new(
            if deleting {
                Provisioning::Deleting
            } else {
                Provisioning::Replacing
            },
            ConditionStatus::False,
            REASON_DRAINING,
            format!(
                "draining before {cause}: {}; no new leases or renewals; the machine is \
                 deleted when they end or at {at}",
                leases_text(leases)
            ),
        )),
        requeue,
    )
}

/// Ends the leases a timed-out drain leaves; returns how many.
async fn end_drain(machine: &Machine<'_>, timed_out: bool) -> Option<u64> {
    if !timed_out {
        return None;
    }
    machine.ctx.metrics.drain_timed_out();
    Some(machine.end_leases(LEASES_DRAIN_TIMEOUT).await)
}

/// A deletion after a timed-out drain: its Event says so.
fn with_drain_timeout(step: Step, ended: Option<u64>, machine: &Machine<'_>) -> Step {
    let Some(ended) = ended else {
        return step;
    };
    let timeout = humantime::format_duration(machine.ctx.config.drain_timeout);
    let message = format!(
        "drain timed out after {timeout}; ended {} and deleted the machine",
        leases_text(u32::try_from(ended).unwrap_or(u32::MAX))
    );
    log::warn!("Proxy {}: {message}", machine.proxy.key());
    step.with_event(Some(event(
        EventType::Warning,
        REASON_DRAIN_TIMED_OUT,
        "Drain",
        message,
    )))
}

/// "1 active lease", "3 active leases".
fn leases_text(leases: u32) -> String {
    let noun = if leases == 1 { "lease" } else { "leases" };
    format!("{leases} active {noun}")
}

/// What a voluntary replacement is, for messages ("draining before …").
fn cause(reason: DisruptionReason) -> &'static str {
    match reason {
        DisruptionReason::SpecChange => "a replacement for a spec change",
        DisruptionReason::MaxLifetime | DisruptionReason::RotateRequested => "a rotation",
        DisruptionReason::Unhealthy => "a remediation",
    }
}

/// Why a voluntary replacement happens, for messages.
fn why(reason: DisruptionReason) -> &'static str {
    match reason {
        DisruptionReason::SpecChange => "spec changed",
        DisruptionReason::MaxLifetime => "machine reached spec.maxLifetime",
        DisruptionReason::RotateRequested => "rotation requested by annotation",
        DisruptionReason::Unhealthy => "machine failed health checks for too long",
    }
}

/// The machine of this Proxy found by its deterministic name.
async fn find_by_name(
    machine: &Machine<'_>,
    provider: &dyn Provider,
) -> Result<Option<crate::provider::Instance>, ProviderError> {
    let name = machine_name(&machine.uid());
    let instances = provider.list_managed().await?;
    Ok(instances.into_iter().find(|i| i.name == name))
}

async fn remove_finalizer(machine: &Machine<'_>, api: &Api<Proxy>) -> Result<Step, Error> {
    let proxy = machine.proxy;
    let finalizers = proxy
        .finalizers()
        .iter()
        .filter(|f| *f != FINALIZER)
        .cloned()
        .collect();
    patch_finalizers(api, proxy, finalizers).await?;
    machine.ctx.health.forget(&proxy.id());
    machine.ctx.grants.release(&machine.uid());
    Ok(Step::requeue(controller::Action::await_change()))
}

/// The machine is not running yet: say why, with an Event when the provider's reason is new.
fn await_provisioning(
    machine: &Machine<'_>,
    current: &ProxyStatus,
    waiting: Option<Waiting>,
    requeue: controller::Action,
) -> Step {
    let Some(waiting) = waiting else {
        return Step::new(Some(provisioning(FieldChange::Keep)), requeue);
    };
    let id = machine.provider_id.unwrap_or_default();
    let message = format!("machine {id} is not running: {}", waiting_text(&waiting));
    let event = new_reason_event(
        current,
        EventType::Warning,
        &waiting.reason,
        "Provision",
        &message,
    );
    Step::new(
        Some(
            StatusChange::new(
                Provisioning::InProgress,
                ConditionStatus::False,
                waiting.reason,
                message,
            )
            .ip(FieldChange::Clear),
        ),
        requeue,
    )
    .with_event(event)
}

/// Marks the create pending, creates the machine, and records its ID and the hash.
async fn create(
    machine: &Machine<'_>,
    current: &ProxyStatus,
    api: &Api<Proxy>,
    hash: &str,
) -> Result<Step, Error> {
    let provider = machine.provider()?;
    let proxy = machine.proxy;
    let marked = api
        .patch(
            &proxy.name_any(),
            &PatchParams::default(),
            &Patch::Merge(annotations_patch(&[(
                CREATE_PENDING_ANNOTATION,
                Some(hash),
            )])),
        )
        .await?;
    let request = machine.create_request(machine_credentials(machine).await?);
    match provider.create(&request).await {
        Ok(instance) => {
            log::info!(
                "Proxy {}: created machine {}",
                proxy.key(),
                instance.provider_id
            );
            let note = format!(
                "created machine {} with {}",
                instance.provider_id,
                provider.name()
            );
            let mut step = Step::new(
                Some(provisioning(FieldChange::Set(instance.provider_id))),
                controller::Action::requeue(machine.ctx.config.provisioning_poll),
            )
            .with_annotations(Some(record_created(proxy, hash)))
            .with_event(Some(event(EventType::Normal, "Created", "Create", note)));
            step.resource_version = marked.resource_version();
            Ok(step.with_port(request.port))
        }
        Err(e) => {
            let mut step = failure(machine, current, e)?;
            step.resource_version = marked.resource_version();
            Ok(step)
        }
    }
}

/// The credentials the Proxy's machines check: those of its credentials Secret, which is
/// created (owned by the Proxy, labelled so the operator's watch sees it) with new random ones
/// when it does not exist yet. Every machine of the Proxy checks the same ones until the
/// Secret is deleted; they are never logged and never part of the spec hash.
async fn machine_credentials(machine: &Machine<'_>) -> Result<MachineCredentials, Error> {
    let id = machine.proxy.id();
    let name = machine_secret_name(&id.uid);
    let secrets: Api<Secret> = Api::namespaced(machine.ctx.client.clone(), &id.namespace);
    let existing = match secrets.get_opt(&name).await? {
        Some(secret) => Some(secret),
        None => {
            let secret = credentials_secret(machine, &name)?;
            match secrets.create(&PostParams::default(), &secret).await {
                Ok(_) => {
                    log::info!(
                        "Proxy {}: generated the credentials of its machines (Secret {}/{name})",
                        machine.proxy.key(),
                        id.namespace
                    );
                    Some(secret)
                }
                // Created by a reconcile that raced this one: use what it wrote.
                Err(kube::Error::Api(status)) if status.code == 409 => {
                    secrets.get_opt(&name).await?
                }
                Err(e) => return Err(e.into()),
            }
        }
    };
    let htpasswd = existing.as_ref().and_then(htpasswd_of).ok_or_else(|| {
        Error::Credentials(format!(
            "Secret {}/{name} has no key {HTPASSWD_SECRET_KEY:?}: delete it, and the next machine \
             gets new credentials",
            id.namespace
        ))
    })?;
    Ok(MachineCredentials {
        secret_name: name,
        htpasswd,
    })
}

/// A new credentials Secret `name` for the machine's Proxy, with random credentials.
fn credentials_secret(machine: &Machine<'_>, name: &str) -> Result<Secret, Error> {
    let credentials = Credentials::generate();
    let htpasswd = credentials.htpasswd_line().map_err(Error::Credentials)?;
    let mut labels = machine_labels(&machine.uid(), &machine.ctx.install);
    labels.insert(CREDENTIALS_SECRET_LABEL.to_owned(), "true".to_owned());
    Ok(Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: machine.proxy.namespace(),
            labels: Some(labels),
            owner_references: machine.proxy.controller_owner_ref(&()).map(|o| vec![o]),
            ..ObjectMeta::default()
        },
        string_data: Some(BTreeMap::from([
            (USERNAME_KEY.to_owned(), credentials.username),
            (PASSWORD_KEY.to_owned(), credentials.password),
            (HTPASSWD_SECRET_KEY.to_owned(), htpasswd),
        ])),
        type_: Some("Opaque".to_owned()),
        ..Secret::default()
    })
}

/// The password-file line a credentials Secret holds (in `data` as the API server answers, or
/// in `stringData` as just written).
fn htpasswd_of(secret: &Secret) -> Option<String> {
    secret
        .data
        .as_ref()
        .and_then(|d| d.get(HTPASSWD_SECRET_KEY))
        .and_then(|b| String::from_utf8(b.0.clone()).ok())
        .or_else(|| {
            secret
                .string_data
                .as_ref()
                .and_then(|d| d.get(HTPASSWD_SECRET_KEY))
                .cloned()
        })
        .filter(|line| !line.is_empty())
}

/// Deletes the machine and reports the given provisioning state; the Event (`event`) goes out
/// when the phase first changes.
async fn delete(
    machine: &Machine<'_>,
    current: &ProxyStatus,
    state: Provisioning,
    (event_type, reason): (EventType, &'static str),
    message: &str,
) -> Result<Step, Error> {
    let provider = machine.provider()?;
    let id = machine.provider_id()?;
    if let Err(e) = provider.delete(id).await
        && !e.is_not_found()
    {
        return failure(machine, current, e);
    }
    let phase = if state == Provisioning::Deleting {
        Phase::Deleting
    } else {
        Phase::Replacing
    };
    let first = current.phase != Some(phase) || condition_reason_is(current, REASON_DRAINING);
    Ok(Step::new(
        Some(
            StatusChange::new(state, ConditionStatus::False, reason, message)
                .ip(FieldChange::Clear),
        ),
        controller::Action::requeue(machine.ctx.config.deletion_poll),
    )
    .with_event(first.then(|| {
        event(
            event_type,
            reason,
            "Delete",
            format!("deleting machine {id}: {message}"),
        )
    })))
}

/// Asks again for the deletion of a machine already being replaced; status stays as it is.
async fn delete_again(machine: &Machine<'_>, current: &ProxyStatus) -> Result<Step, Error> {
    let provider = machine.provider()?;
    let id = machine.provider_id()?;
    if let Err(e) = provider.delete(id).await
        && !e.is_not_found()
    {
        return failure(machine, current, e);
    }
    Ok(Step::requeue(controller::Action::requeue(
        machine.ctx.config.deletion_poll,
    )))
}

/// The Proxy is being deleted and its machine `provider_id` is going: record the ID so later
/// passes follow the machine until it is gone.
fn deleting(machine: &Machine<'_>, provider_id: FieldChange) -> Step {
    Step::new(
        Some(
            StatusChange::new(
                Provisioning::Deleting,
                ConditionStatus::False,
                REASON_DELETING,
                "Proxy is being deleted; deleting its machine",
            )
            .provider_id(provider_id)
            .ip(FieldChange::Clear),
        ),
        controller::Action::requeue(machine.ctx.config.deletion_poll),
    )
}

/// Force-deletes a machine whose deletion is stuck past `deadline` (its node is gone and will
/// never confirm it) and ends its leases, so the new machine starts with full capacity.
async fn force_delete(
    machine: &Machine<'_>,
    current: &ProxyStatus,
    deadline: Timestamp,
) -> Result<Step, Error> {
    let provider = machine.provider()?;
    let id = machine.provider_id()?;
    let proxy = machine.proxy;
    if let Err(e) = provider.force_delete(id).await
        && !e.is_not_found()
    {
        return failure(machine, current, e);
    }
    let ended = machine.end_leases(LEASES_MACHINE_LOST).await;
    let margin = humantime::format_duration(machine.ctx.config.force_delete_margin);
    let leases = if ended == 1 { "lease" } else { "leases" };
    let message = format!(
        "machine {id} was still terminating {margin} after its deletion deadline {deadline} \
         (a lost node?); force-deleted it and ended {ended} active {leases} on it"
    );
    log::warn!("Proxy {}: {message}", proxy.key());
    let deleting_proxy = proxy.metadata.deletion_timestamp.is_some();
    Ok(Step::new(
        Some(
            StatusChange::new(
                if deleting_proxy {
                    Provisioning::Deleting
                } else {
                    Provisioning::Replacing
                },
                ConditionStatus::False,
                REASON_MACHINE_LOST,
                message.clone(),
            )
            .ip(FieldChange::Clear),
        ),
        controller::Action::requeue(machine.ctx.config.deletion_poll),
    )
    .with_event(Some(event(
        EventType::Warning,
        REASON_FORCE_DELETED,
        "Delete",
        message,
    ))))
}

/// The machine is gone: end its leases, forget its ID and IP. One that vanished before it ever
/// ran (a create the provider accepted and then failed) holds the next create for a backoff.
async fn forget(
    machine: &Machine<'_>,
    current: &ProxyStatus,
    hash: Option<String>,
    loss: Loss,
) -> Step {
    let id = machine.provider_id.unwrap_or_default();
    let reason = match loss {
        Loss::Expected => LEASES_MACHINE_REPLACED,
        Loss::WhileServing | Loss::BeforeRunning => LEASES_MACHINE_GONE,
    };
    machine.end_leases(reason).await;
    let annotations = hash.as_deref().map(record_hash);
    // The old machine of a voluntary replacement is gone: what runs next is its replacement.
    let replaced = current
        .disruption
        .as_ref()
        .filter(|d| d.replaced_at.is_none())
        .map(|d| Disruption {
            replaced_at: Some(machine.now),
            ..d.clone()
        });
    if loss != Loss::BeforeRunning {
        let step = Step::new(
            Some(
                StatusChange::new(
                    Provisioning::InProgress,
                    ConditionStatus::False,
                    REASON_MACHINE_GONE,
                    "machine is gone; creating a new one",
                )
                .provider_id(FieldChange::Clear)
                .ip(FieldChange::Clear),
            ),
            controller::Action::requeue(Duration::ZERO),
        )
        .with_annotations(annotations);
        return match replaced {
            Some(disruption) => step.with_disruption(Some(disruption)),
            None => step,
        };
    }
    let message = format!(
        "machine {id} vanished before it ran (the provider accepted the create, then failed it)"
    );
    log::warn!("Proxy {}: {message}", machine.proxy.key());
    let hold = machine.ctx.pacing.machine_failed(
        &machine.uid(),
        machine.backoff(),
        machine.at(),
        REASON_CREATE_FAILED,
        message,
    );
    let event = new_reason_event(
        current,
        EventType::Warning,
        REASON_CREATE_FAILED,
        "Provision",
        &hold_message(&hold),
    );
    Step::new(
        Some(
            StatusChange::new(
                Provisioning::Waiting,
                ConditionStatus::False,
                REASON_CREATE_FAILED,
                hold_message(&hold),
            )
            .provider_id(FieldChange::Clear)
            .ip(FieldChange::Clear),
        ),
        requeue_at(hold.until, machine.now),
    )
    .with_annotations(annotations)
    .with_event(event)
}

/// The step for a failed provider call.
fn failure(
    machine: &Machine<'_>,
    current: &ProxyStatus,
    error: ProviderError,
) -> Result<Step, Error> {
    failure_step(
        on_provider_error(error.class, error.to_string()),
        machine,
        current,
    )
}

/// Executes a failure action: transient → error (the controller backs off); refused → the
/// condition and a backoff hold; quota → the condition and a long hold; permanent → Failed
/// and a slow retry. A hold keeps the status write's own re-trigger from trying again at once.
fn failure_step(
    action: Action,
    machine: &Machine<'_>,
    current: &ProxyStatus,
) -> Result<Step, Error> {
    let proxy = machine.proxy;
    let config = &machine.ctx.config;
    let uid = machine.uid();
    let keep_state = if current.provider_id.is_some() {
        Provisioning::InProgress
    } else {
        Provisioning::Waiting
    };
    let (provisioning, reason, message, delay) = match action {
        Action::Backoff { message } => return Err(Error::Provider(message)),
        Action::QuotaWait { message } => {
            log::warn!("Proxy {}: quota exceeded: {message}", proxy.key());
            (keep_state, REASON_QUOTA, message, config.quota_requeue)
        }
        Action::Refused { message } => {
            let (base, cap) = machine.backoff();
            let delay = machine.ctx.pacing.failed(&uid, base, cap);
            log::warn!("Proxy {}: refused: {message}", proxy.key());
            (keep_state, REASON_REFUSED, message, delay)
        }
        Action::Fail { message } => {
            log::error!(
                "Proxy {}: provider failed permanently: {message}",
                proxy.key()
            );
            (
                Provisioning::Failed,
                REASON_PROVIDER_FAILED,
                message,
                config.permanent_failure_retry,
            )
        }
        other => {
            return Err(Error::Provider(format!(
                "unexpected failure action {other:?}"
            )));
        }
    };
    // The hold this failure follows, if it was for the same reason, already had its Event: the
    // condition may not show it yet when this reconcile read a copy older than that write.
    let reported = machine
        .ctx
        .pacing
        .get(&uid)
        .hold
        .is_some_and(|h| h.reason == reason && h.generation == proxy.metadata.generation);
    let hold = hold_for(machine.at(), delay, reason, message);
    machine.ctx.pacing.hold(&uid, hold.clone());
    let event = new_reason_event(
        current,
        EventType::Warning,
        reason,
        "Provision",
        &hold.message,
    )
    .filter(|_| !reported);
    Ok(Step::new(
        Some(StatusChange::new(
            provisioning,
            ConditionStatus::False,
            reason,
            hold_message(&hold),
        )),
        controller::Action::requeue(delay),
    )
    .with_event(event)
    .with_outcome(RetryEffect::Neutral))
}

/// The machine is being created.
fn provisioning(provider_id: FieldChange) -> StatusChange {
    StatusChange::new(
        Provisioning::InProgress,
        ConditionStatus::False,
        REASON_PROVISIONING,
        "machine is being created",
    )
    .provider_id(provider_id)
    .ip(FieldChange::Clear)
}

fn cloud_init_missing(message: &str, config: &ReconcilerConfig) -> Step {
    waiting(
        REASON_CLOUD_INIT,
        message.to_owned(),
        config.provisioning_poll,
    )
}

/// `spec.provider` names no entry of the providers config: say so and look again at the drift
/// poll (a config change restarts the operator).
pub(super) fn unknown_provider(spec: &ProxySpec, ctx: &Context) -> Step {
    let message = format!(
        "provider {:?} is not in the operator's providers config",
        spec.provider.as_deref().unwrap_or_default()
    );
    waiting(REASON_UNKNOWN_PROVIDER, message, ctx.config.drift_poll)
}

/// A Proxy that cannot be provisioned until something outside it changes: condition
/// `Provisioned=False/<reason>`, machine fields untouched, a check again after `requeue`.
fn waiting(reason: &'static str, message: String, requeue: Duration) -> Step {
    Step::new(
        Some(StatusChange::new(
            Provisioning::Waiting,
            ConditionStatus::False,
            reason,
            message,
        )),
        controller::Action::requeue(requeue),
    )
}

/// The annotations recorded once a machine is created: the spec hash it was made with, the
/// rotate annotation's value then (so only a new value rotates it), and the create-pending
/// marker cleared.
fn record_created(proxy: &Proxy, hash: &str) -> Value {
    let rotate = proxy
        .annotations()
        .get(ROTATE_ANNOTATION)
        .map(String::as_str);
    let [spec_hash, version, pending] = hash_annotations(hash);
    annotations_patch(&[spec_hash, version, pending, (ROTATED_ANNOTATION, rotate)])
}

/// Records the hash the machine was made from, and clears the create-pending marker.
fn record_hash(hash: &str) -> Value {
    annotations_patch(&hash_annotations(hash))
}

fn hash_annotations(hash: &str) -> [(&'static str, Option<&str>); 3] {
    [
        (SPEC_HASH_ANNOTATION, Some(hash)),
        (SPEC_HASH_VERSION_ANNOTATION, Some(SPEC_HASH_VERSION)),
        (CREATE_PENDING_ANNOTATION, None),
    ]
}

/// Sets the finalizer list, guarded by resourceVersion so a concurrent edit is not overwritten.
async fn patch_finalizers(
    api: &Api<Proxy>,
    proxy: &Proxy,
    finalizers: Vec<String>,
) -> Result<(), Error> {
    let patch = json!({
        "metadata": {
            "finalizers": finalizers,
            "resourceVersion": proxy.resource_version(),
        }
    });
    api.patch(
        &proxy.name_any(),
        &PatchParams::default(),
        &Patch::Merge(patch),
    )
    .await?;
    Ok(())
}
