//! Executing a decision: the thin I/O layer between [`decide`] and the provider and Kubernetes
//! APIs. Order of writes per reconcile: metadata needed *before* a provider call (finalizer,
//! create-pending marker), the provider call, one status write if anything changed, metadata
//! recorded *after* (spec hash), then an Event.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Secret;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller;
use kube::runtime::events::{Event, EventType};
use kube::{Api, Resource, ResourceExt};
use serde_json::{Value, json};

use super::decide::{Action, Inputs, Observation, decide, on_provider_error};
use super::phase::Provisioning;
use super::status::{
    FieldChange, REASON_CLOUD_INIT, REASON_DELETING, REASON_EXTERNAL, REASON_MACHINE_GONE,
    REASON_MACHINE_STOPPED, REASON_PROVIDER_FAILED, REASON_PROVISIONING, REASON_QUOTA,
    REASON_REPLACING, REASON_RUNNING, REASON_UNKNOWN_PROVIDER, StatusChange, annotations_patch,
    desired_status, status_patch,
};
use super::{CREATE_PENDING_ANNOTATION, Context, Error};
use crate::naming::machine_name;
use crate::provider::{CreateRequest, INSTALL_LABEL, Provider, ProviderError};
use crate::proxy::{
    CONDITION_PROVISIONED, ConditionStatus, FINALIZER, MANAGED_LABEL, PROXY_UID_LABEL, Phase,
    Proxy, ProxySpec, ProxyStatus, SPEC_HASH_ANNOTATION, SPEC_HASH_VERSION_ANNOTATION,
    SecretKeyRef,
};
use crate::spec_hash::{SPEC_HASH_VERSION, SpecHashInput};

/// What executing an action leaves to write.
struct Step {
    /// Status change, or `None` to leave status alone.
    status: Option<StatusChange>,
    /// Annotation patch applied after the status write.
    annotations: Option<Value>,
    /// Event to publish last.
    event: Option<Event>,
    /// When to look again.
    requeue: controller::Action,
}

impl Step {
    fn requeue(requeue: controller::Action) -> Self {
        Step {
            status: None,
            annotations: None,
            event: None,
            requeue,
        }
    }
}

/// One reconcile of one Proxy.
pub async fn reconcile(proxy: Arc<Proxy>, ctx: Arc<Context>) -> Result<controller::Action, Error> {
    let namespace = proxy
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let api: Api<Proxy> = Api::namespaced(ctx.client.clone(), &namespace);
    let current = proxy.status.clone().unwrap_or_default();
    let step = step(&proxy, &current, &api, &ctx).await?;

    if let Some(change) = &step.status {
        let health = ctx.health.get(&proxy.id());
        let now = (ctx.clock)();
        let desired = desired_status(
            &current,
            change,
            health.as_ref(),
            proxy.metadata.generation,
            now,
        );
        if desired != current {
            api.patch_status(
                &proxy.name_any(),
                &PatchParams::default(),
                &Patch::Merge(status_patch(&desired)),
            )
            .await?;
        }
    }
    if let Some(annotations) = &step.annotations {
        api.patch(
            &proxy.name_any(),
            &PatchParams::default(),
            &Patch::Merge(annotations),
        )
        .await?;
    }
    if let Some(event) = &step.event {
        let reference = proxy.object_ref(&());
        if let Err(e) = ctx.recorder.publish(event, &reference).await {
            log::warn!(
                "cannot publish event {} for Proxy {}: {e}",
                event.reason,
                proxy.key()
            );
        }
    }
    Ok(step.requeue)
}

/// Decides and executes everything up to (not including) the status write.
async fn step(
    proxy: &Proxy,
    current: &ProxyStatus,
    api: &Api<Proxy>,
    ctx: &Context,
) -> Result<Step, Error> {
    let spec = &proxy.spec;
    let deleting = proxy.metadata.deletion_timestamp.is_some();
    let finalizer_present = proxy.finalizers().iter().any(|f| f == FINALIZER);
    let provider_id = current.provider_id.as_deref().filter(|id| !id.is_empty());
    let annotations = proxy.annotations();
    let generation = proxy.metadata.generation;

    let provider = spec
        .provider
        .as_deref()
        .and_then(|name| ctx.providers.get(name));
    let needs_provider = spec.mode == crate::proxy::Mode::Managed
        && if deleting {
            provider_id.is_some()
        } else {
            finalizer_present
        };
    let provider = match provider {
        Some(provider) => Some(provider.as_ref()),
        None if needs_provider => return Ok(unknown_provider(spec, ctx)),
        None => None,
    };

    let resolve = spec.mode == crate::proxy::Mode::Managed && !deleting && finalizer_present;
    let cloud_init = if resolve {
        resolve_cloud_init(ctx, proxy, spec).await?
    } else {
        Ok(None)
    };
    let desired_hash = cloud_init
        .as_ref()
        .ok()
        .map(|content| SpecHashInput::new(spec, content.as_deref()).hash());

    let failed_this_generation = current
        .condition(CONDITION_PROVISIONED)
        .is_some_and(|c| c.reason == REASON_PROVIDER_FAILED && c.observed_generation == generation);
    let observation = match (provider, provider_id) {
        (Some(provider), Some(id))
            if deleting || (finalizer_present && !failed_this_generation) =>
        {
            observe(provider, id).await
        }
        _ => Observation::NotQueried,
    };

    let inputs = Inputs {
        mode: spec.mode,
        deleting,
        finalizer_present,
        provider_id,
        recorded_hash: annotations.get(SPEC_HASH_ANNOTATION).map(String::as_str),
        recorded_hash_version: annotations
            .get(SPEC_HASH_VERSION_ANNOTATION)
            .map(String::as_str),
        create_pending: annotations
            .get(CREATE_PENDING_ANNOTATION)
            .map(String::as_str),
        desired_hash: desired_hash.as_deref(),
        cloud_init_problem: cloud_init.as_ref().err().map(String::as_str),
        failed_this_generation,
        observation: &observation,
    };
    let action = decide(&inputs);
    log::debug!("Proxy {}: {action:?}", proxy.key());
    let machine = Machine {
        proxy,
        provider,
        provider_id,
        cloud_init: cloud_init.ok().flatten(),
        ctx,
    };
    execute(action, &machine, current, api, desired_hash.as_deref()).await
}

/// What `execute` needs about the machine behind a proxy.
struct Machine<'a> {
    proxy: &'a Proxy,
    provider: Option<&'a dyn Provider>,
    provider_id: Option<&'a str>,
    cloud_init: Option<String>,
    ctx: &'a Context,
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

    fn create_request(&self) -> CreateRequest {
        let id = self.proxy.id();
        let labels = BTreeMap::from([
            (MANAGED_LABEL.to_owned(), "true".to_owned()),
            (PROXY_UID_LABEL.to_owned(), id.uid.clone()),
            (INSTALL_LABEL.to_owned(), self.ctx.install.clone()),
        ]);
        CreateRequest {
            machine_name: machine_name(&id.uid),
            namespace: id.namespace,
            proxy_name: id.name,
            proxy_uid: id.uid,
            port: self.proxy.spec.port,
            placement: self.proxy.spec.placement.clone(),
            cloud_init: self.cloud_init.clone(),
            labels,
        }
    }
}

async fn observe(provider: &dyn Provider, id: &str) -> Observation {
    match provider.get(id).await {
        Ok(instance) => Observation::Found {
            state: instance.state,
            ip: instance.ip,
        },
        Err(e) if e.is_not_found() => Observation::NotFound,
        Err(e) => Observation::Error {
            class: e.class,
            message: e.to_string(),
        },
    }
}

/// Carries out one action.
async fn execute(
    action: Action,
    machine: &Machine<'_>,
    current: &ProxyStatus,
    api: &Api<Proxy>,
    desired_hash: Option<&str>,
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
        Action::RemoveFinalizer => {
            let finalizers = proxy
                .finalizers()
                .iter()
                .filter(|f| *f != FINALIZER)
                .cloned()
                .collect();
            patch_finalizers(api, proxy, finalizers).await?;
            machine.ctx.health.forget(&proxy.id());
            Step::requeue(controller::Action::await_change())
        }
        Action::Create { hash } => create(machine, current, api, &hash).await?,
        Action::Recover { hash } => {
            let provider = machine.provider()?;
            let name = machine_name(&proxy.id().uid);
            match provider.list_managed().await {
                Ok(instances) => match instances.into_iter().find(|i| i.name == name) {
                    Some(instance) => {
                        log::info!(
                            "Proxy {}: recovered machine {} from an interrupted create",
                            proxy.key(),
                            instance.provider_id
                        );
                        Step {
                            status: Some(provisioning(FieldChange::Set(instance.provider_id))),
                            annotations: Some(record_hash(&hash)),
                            event: None,
                            requeue: controller::Action::requeue(config.provisioning_poll),
                        }
                    }
                    None => match desired_hash {
                        Some(hash) => create(machine, current, api, hash).await?,
                        None => cloud_init_missing("cloud-init cannot be resolved", config),
                    },
                },
                Err(e) => failure(proxy, current, e, machine.ctx)?,
            }
        }
        Action::AwaitProvisioning => Step {
            status: Some(provisioning(FieldChange::Keep)),
            annotations: None,
            event: None,
            requeue: controller::Action::requeue(config.provisioning_poll),
        },
        Action::Running { ip } => Step {
            status: Some(StatusChange {
                provisioning: Provisioning::Done,
                provider_id: FieldChange::Keep,
                ip: ip.map_or(FieldChange::Clear, FieldChange::Set),
                provisioned: ConditionStatus::True,
                reason: REASON_RUNNING,
                message: "machine is running".to_owned(),
            }),
            annotations: None,
            event: None,
            requeue: controller::Action::requeue(config.drift_poll),
        },
        Action::DeleteDead => {
            delete(
                machine,
                current,
                Provisioning::Replacing,
                REASON_MACHINE_STOPPED,
                "machine stopped or terminated; deleting it to create a new one",
            )
            .await?
        }
        Action::Replace => {
            delete(
                machine,
                current,
                Provisioning::Replacing,
                REASON_REPLACING,
                "spec changed; deleting the machine to create a new one",
            )
            .await?
        }
        Action::DeleteForCleanup => {
            delete(
                machine,
                current,
                Provisioning::Deleting,
                REASON_DELETING,
                "Proxy is being deleted; deleting its machine",
            )
            .await?
        }
        Action::Forget { record_hash: hash } => Step {
            status: Some(StatusChange {
                provisioning: Provisioning::InProgress,
                provider_id: FieldChange::Clear,
                ip: FieldChange::Clear,
                provisioned: ConditionStatus::False,
                reason: REASON_MACHINE_GONE,
                message: "machine is gone; creating a new one".to_owned(),
            }),
            annotations: hash.as_deref().map(record_hash),
            event: None,
            requeue: controller::Action::requeue(std::time::Duration::ZERO),
        },
        Action::Adopt { hash } => Step {
            status: None,
            annotations: Some(record_hash(&hash)),
            event: None,
            requeue: controller::Action::requeue(std::time::Duration::ZERO),
        },
        Action::External => Step {
            status: Some(StatusChange {
                provisioning: Provisioning::Done,
                provider_id: FieldChange::Clear,
                ip: proxy
                    .spec
                    .endpoint
                    .as_ref()
                    .map_or(FieldChange::Clear, |e| FieldChange::Set(e.host.clone())),
                provisioned: ConditionStatus::True,
                reason: REASON_EXTERNAL,
                message: "external endpoint".to_owned(),
            }),
            annotations: None,
            event: None,
            requeue: controller::Action::await_change(),
        },
        Action::StayFailed => Step::requeue(controller::Action::await_change()),
        Action::AwaitCloudInit { message } => cloud_init_missing(&message, config),
        failed @ (Action::Backoff { .. } | Action::QuotaWait { .. } | Action::Fail { .. }) => {
            failure_step(failed, proxy, current, machine.ctx)?
        }
    };
    Ok(step)
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
    api.patch(
        &proxy.name_any(),
        &PatchParams::default(),
        &Patch::Merge(annotations_patch(&[(
            CREATE_PENDING_ANNOTATION,
            Some(hash),
        )])),
    )
    .await?;
    let request = machine.create_request();
    match provider.create(&request).await {
        Ok(instance) => {
            log::info!(
                "Proxy {}: created machine {}",
                proxy.key(),
                instance.provider_id
            );
            Ok(Step {
                status: Some(provisioning(FieldChange::Set(instance.provider_id.clone()))),
                annotations: Some(record_hash(hash)),
                event: Some(event(
                    EventType::Normal,
                    "Created",
                    "Create",
                    format!(
                        "created machine {} with {}",
                        instance.provider_id,
                        provider.name()
                    ),
                )),
                requeue: controller::Action::requeue(machine.ctx.config.provisioning_poll),
            })
        }
        Err(e) => failure(proxy, current, e, machine.ctx),
    }
}

/// Deletes the machine and reports the given provisioning state.
async fn delete(
    machine: &Machine<'_>,
    current: &ProxyStatus,
    state: Provisioning,
    reason: &'static str,
    message: &str,
) -> Result<Step, Error> {
    let provider = machine.provider()?;
    let id = machine.provider_id()?;
    let proxy = machine.proxy;
    if let Err(e) = provider.delete(id).await
        && !e.is_not_found()
    {
        return failure(proxy, current, e, machine.ctx);
    }
    let phase = if state == Provisioning::Deleting {
        Phase::Deleting
    } else {
        Phase::Replacing
    };
    let first = current.phase != Some(phase);
    Ok(Step {
        status: Some(StatusChange {
            provisioning: state,
            provider_id: FieldChange::Keep,
            ip: FieldChange::Clear,
            provisioned: ConditionStatus::False,
            reason,
            message: message.to_owned(),
        }),
        annotations: None,
        event: first.then(|| {
            event(
                EventType::Normal,
                reason,
                "Delete",
                format!("deleting machine {id}: {message}"),
            )
        }),
        requeue: controller::Action::requeue(machine.ctx.config.deletion_poll),
    })
}

/// The step for a failed provider call.
fn failure(
    proxy: &Proxy,
    current: &ProxyStatus,
    error: ProviderError,
    ctx: &Context,
) -> Result<Step, Error> {
    failure_step(
        on_provider_error(error.class, error.to_string()),
        proxy,
        current,
        ctx,
    )
}

/// Executes a failure action: transient → error (backoff), quota → condition and a long
/// requeue, permanent → Failed until the spec changes.
fn failure_step(
    action: Action,
    proxy: &Proxy,
    current: &ProxyStatus,
    ctx: &Context,
) -> Result<Step, Error> {
    let already = |reason: &str| {
        current
            .condition(CONDITION_PROVISIONED)
            .is_some_and(|c| c.reason == reason)
    };
    let keep_state = if current.provider_id.is_some() {
        Provisioning::InProgress
    } else {
        Provisioning::Waiting
    };
    match action {
        Action::QuotaWait { message } => {
            log::warn!("Proxy {}: quota exceeded: {message}", proxy.key());
            Ok(Step {
                event: (!already(REASON_QUOTA)).then(|| {
                    event(
                        EventType::Warning,
                        REASON_QUOTA,
                        "Provision",
                        message.clone(),
                    )
                }),
                status: Some(StatusChange {
                    provisioning: keep_state,
                    provider_id: FieldChange::Keep,
                    ip: FieldChange::Keep,
                    provisioned: ConditionStatus::False,
                    reason: REASON_QUOTA,
                    message,
                }),
                annotations: None,
                requeue: controller::Action::requeue(ctx.config.quota_requeue),
            })
        }
        Action::Fail { message } => {
            log::error!(
                "Proxy {}: provider failed permanently: {message}",
                proxy.key()
            );
            Ok(Step {
                event: (!already(REASON_PROVIDER_FAILED)).then(|| {
                    event(
                        EventType::Warning,
                        REASON_PROVIDER_FAILED,
                        "Provision",
                        message.clone(),
                    )
                }),
                status: Some(StatusChange {
                    provisioning: Provisioning::Failed,
                    provider_id: FieldChange::Keep,
                    ip: FieldChange::Keep,
                    provisioned: ConditionStatus::False,
                    reason: REASON_PROVIDER_FAILED,
                    message,
                }),
                annotations: None,
                requeue: controller::Action::await_change(),
            })
        }
        Action::Backoff { message } => Err(Error::Provider(message)),
        other => Err(Error::Provider(format!(
            "unexpected failure action {other:?}"
        ))),
    }
}

fn provisioning(provider_id: FieldChange) -> StatusChange {
    StatusChange {
        provisioning: Provisioning::InProgress,
        provider_id,
        ip: FieldChange::Clear,
        provisioned: ConditionStatus::False,
        reason: REASON_PROVISIONING,
        message: "machine is being created".to_owned(),
    }
}

fn cloud_init_missing(message: &str, config: &super::ReconcilerConfig) -> Step {
    waiting(
        REASON_CLOUD_INIT,
        message.to_owned(),
        config.provisioning_poll,
    )
}

fn unknown_provider(spec: &ProxySpec, ctx: &Context) -> Step {
    let message = format!(
        "provider {:?} is not in the operator's providers config",
        spec.provider.as_deref().unwrap_or_default()
    );
    waiting(REASON_UNKNOWN_PROVIDER, message, ctx.config.drift_poll)
}

/// A Proxy that cannot be provisioned until something outside it changes: condition
/// `Provisioned=False/<reason>`, machine fields untouched, a check again after `requeue`.
fn waiting(reason: &'static str, message: String, requeue: std::time::Duration) -> Step {
    Step {
        status: Some(StatusChange {
            provisioning: Provisioning::Waiting,
            provider_id: FieldChange::Keep,
            ip: FieldChange::Keep,
            provisioned: ConditionStatus::False,
            reason,
            message,
        }),
        annotations: None,
        event: None,
        requeue: controller::Action::requeue(requeue),
    }
}

/// Records the hash the machine was made from, and clears the create-pending marker.
fn record_hash(hash: &str) -> Value {
    annotations_patch(&[
        (SPEC_HASH_ANNOTATION, Some(hash)),
        (SPEC_HASH_VERSION_ANNOTATION, Some(SPEC_HASH_VERSION)),
        (CREATE_PENDING_ANNOTATION, None),
    ])
}

fn event(type_: EventType, reason: &str, action: &str, note: String) -> Event {
    Event {
        type_,
        reason: reason.to_owned(),
        note: Some(note),
        action: action.to_owned(),
        secondary: None,
    }
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

/// The cloud-init content: `Ok(Ok(content))`, or `Ok(Err(why))` when the Secret or key is
/// missing (a condition, not a failure). Other API errors are returned.
async fn resolve_cloud_init(
    ctx: &Context,
    proxy: &Proxy,
    spec: &ProxySpec,
) -> Result<Result<Option<String>, String>, Error> {
    let Some(cloud_init) = &spec.cloud_init else {
        return Ok(Ok(None));
    };
    if let Some(inline) = &cloud_init.inline {
        return Ok(Ok(Some(inline.clone())));
    }
    let Some(secret_ref) = &cloud_init.secret_ref else {
        return Ok(Err("cloudInit has neither inline nor secretRef".to_owned()));
    };
    let namespace = proxy
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &namespace);
    let secret = secrets.get_opt(&secret_ref.name).await?;
    Ok(cloud_init_from_secret(secret.as_ref(), &namespace, secret_ref).map(Some))
}

/// The cloud-init document in a Secret, or why it cannot be used.
pub fn cloud_init_from_secret(
    secret: Option<&Secret>,
    namespace: &str,
    secret_ref: &SecretKeyRef,
) -> Result<String, String> {
    let Some(secret) = secret else {
        return Err(format!("Secret {namespace}/{} not found", secret_ref.name));
    };
    let bytes = secret
        .data
        .as_ref()
        .and_then(|d| d.get(&secret_ref.key))
        .map(|b| b.0.clone())
        .or_else(|| {
            secret
                .string_data
                .as_ref()
                .and_then(|d| d.get(&secret_ref.key))
                .map(|s| s.clone().into_bytes())
        })
        .ok_or_else(|| {
            format!(
                "Secret {namespace}/{} has no key {:?}",
                secret_ref.name, secret_ref.key
            )
        })?;
    String::from_utf8(bytes).map_err(|_| {
        format!(
            "Secret {namespace}/{} key {:?} is not UTF-8 text",
            secret_ref.name, secret_ref.key
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;

    fn secret(data: &[(&str, &[u8])]) -> Secret {
        Secret {
            data: Some(
                data.iter()
                    .map(|(k, v)| ((*k).to_owned(), ByteString(v.to_vec())))
                    .collect(),
            ),
            ..Default::default()
        }
    }

    #[test]
    fn cloud_init_from_secret_explains_what_is_missing() {
        let key = SecretKeyRef {
            name: "ci".into(),
            key: "user-data".into(),
        };
        let ok = secret(&[("user-data", b"#cloud-config\n")]);
        assert_eq!(
            cloud_init_from_secret(Some(&ok), "ns", &key).unwrap(),
            "#cloud-config\n"
        );
        let missing = cloud_init_from_secret(None, "ns", &key).unwrap_err();
        assert_eq!(missing, "Secret ns/ci not found");
        let no_key = cloud_init_from_secret(Some(&secret(&[("other", b"x")])), "ns", &key);
        assert!(no_key.unwrap_err().contains("has no key \"user-data\""));
        let binary =
            cloud_init_from_secret(Some(&secret(&[("user-data", &[0xff, 0xfe])])), "ns", &key);
        assert!(binary.unwrap_err().contains("not UTF-8"));
    }
}
