//! Gathering a reconcile's inputs: the object, the provider's answer about its machine, the
//! cloud-init content and the spec hash it gives, the retry memory, the last health verdict,
//! the proxy's active leases and its provider's health. Everything [`decide`] looks at comes
//! from here; nothing here changes anything.
//!
//! [`decide`]: super::decide::decide

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Secret;
use kube::{Api, ResourceExt};

use super::context::Context;
use super::decide::{Inputs, Limits, Observation};
use super::error::Error;
use super::execute::Machine;
use super::remediation::{self, Gate};
use super::rotation;
use crate::controllers::proxy::status::REASON_PROVIDER_FAILED;
use crate::provider::Provider;
use crate::resources::proxy::{
    CONDITION_HEALTHY, CONDITION_PROVISIONED, CREATE_PENDING_ANNOTATION, ConditionStatus, Mode,
    Proxy, ProxySpec, ProxyStatus, ROTATE_ANNOTATION, ROTATED_ANNOTATION, SPEC_HASH_ANNOTATION,
    SPEC_HASH_VERSION_ANNOTATION, SecretKeyRef,
};
use crate::resources::spec_hash::SpecHashInput;

/// What a reconcile starts from.
pub(super) enum Gathered<'a> {
    /// `spec.provider` names no entry of the providers config, and the Proxy needs its
    /// provider now (to create, observe or delete a machine).
    UnknownProvider,
    /// Everything [`decide`](super::decide::decide) looks at.
    Facts(Box<Facts<'a>>),
}

/// What was read for one reconcile, besides the object itself.
pub(super) struct Facts<'a> {
    provider: Option<&'a dyn Provider>,
    provider_id: Option<&'a str>,
    /// The cloud-init content (`Ok(None)`: none), or why it cannot be read.
    cloud_init: Result<Option<String>, String>,
    /// The spec hash of what the Proxy asks for (H); `None` when the cloud-init is unreadable.
    desired_hash: Option<String>,
    observation: Observation,
    failed_this_generation: bool,
    hold_until: Option<Timestamp>,
    uid: String,
    unhealthy_since: Option<Timestamp>,
    health: Option<(bool, Timestamp)>,
    remediation: Gate,
    active_leases: u32,
    limits: Limits,
    now: Timestamp,
}

/// Reads what one reconcile of `proxy` needs: no provider call unless the Proxy has a machine
/// that may be looked at (a permanent failure of this generation is only looked at again when
/// its hold ends), no Secret read unless a machine may be created.
pub(super) async fn gather<'a>(
    proxy: &Proxy,
    current: &'a ProxyStatus,
    ctx: &'a Context,
) -> Result<Gathered<'a>, Error> {
    let spec = &proxy.spec;
    let deleting = proxy.metadata.deletion_timestamp.is_some();
    let finalizer_present = has_finalizer(proxy);
    let provider_id = current.provider_id.as_deref().filter(|id| !id.is_empty());
    let annotations = proxy.annotations();
    let generation = proxy.metadata.generation;
    let now = (ctx.clock)();

    let needs_provider = spec.mode == Mode::Managed
        && if deleting {
            provider_id.is_some() || annotations.contains_key(CREATE_PENDING_ANNOTATION)
        } else {
            finalizer_present
        };
    let provider = match spec
        .provider
        .as_deref()
        .and_then(|name| ctx.providers.get(name))
    {
        Some(provider) => Some(provider.as_ref()),
        None if needs_provider => return Ok(Gathered::UnknownProvider),
        None => None,
    };

    let cloud_init = if spec.mode == Mode::Managed && !deleting && finalizer_present {
        resolve_cloud_init(ctx, proxy, spec).await?
    } else {
        Ok(None)
    };
    let desired_hash = cloud_init
        .as_ref()
        .ok()
        .map(|content| SpecHashInput::new(spec, content.as_deref()).hash());

    let uid = proxy.uid().unwrap_or_default();
    let failed_this_generation = current
        .condition(CONDITION_PROVISIONED)
        .is_some_and(|c| c.reason == REASON_PROVIDER_FAILED && c.observed_generation == generation);
    let hold_until = ctx.pacing.hold_until(&uid, generation);
    let retry_due = hold_until.is_none_or(|until| until <= now);
    let observation = match (provider, provider_id) {
        (Some(provider), Some(id))
            if deleting || (finalizer_present && (!failed_this_generation || retry_due)) =>
        {
            observe(provider, id).await
        }
        _ => Observation::NotQueried,
    };

    let unhealthy_since = current
        .condition(CONDITION_HEALTHY)
        .filter(|c| c.status == ConditionStatus::False)
        .map(|c| c.last_transition_time);
    let health = ctx
        .health
        .get(&proxy.id())
        .map(|transition| (transition.healthy, transition.at))
        .or_else(|| current.healthy().zip(current.last_health_check_time));
    let remediation = match (&spec.provider, unhealthy_since) {
        (Some(provider), Some(_)) if spec.mode == Mode::Managed => {
            let fleet = ctx.fleet().unwrap_or_default();
            remediation::gate(
                remediation::provider_health(fleet.iter().map(AsRef::as_ref), provider),
                ctx.config.max_unhealthy,
            )
        }
        _ => Gate::Allowed,
    };
    Ok(Gathered::Facts(Box::new(Facts {
        provider,
        provider_id,
        cloud_init,
        desired_hash,
        observation,
        failed_this_generation,
        hold_until,
        active_leases: ctx.ledger.counts().active_count(&uid),
        uid,
        unhealthy_since,
        health,
        remediation,
        limits: Limits {
            startup_timeout: ctx.config.startup_timeout,
            force_delete_margin: ctx.config.force_delete_margin,
            drain_timeout: ctx.config.drain_timeout,
            remediate_after: ctx.config.remediate_after,
        },
        now,
    })))
}

impl Facts<'_> {
    /// The inputs of [`decide`](super::decide::decide) for `proxy` with status `current`.
    pub fn inputs<'b>(&'b self, proxy: &'b Proxy, current: &'b ProxyStatus) -> Inputs<'b> {
        let annotations = proxy.annotations();
        let annotation = |key: &str| annotations.get(key).map(String::as_str);
        Inputs {
            mode: proxy.spec.mode,
            deleting: proxy.metadata.deletion_timestamp.is_some(),
            deletion_requested: proxy.metadata.deletion_timestamp.as_ref().map(|t| t.0),
            finalizer_present: has_finalizer(proxy),
            provider_id: self.provider_id,
            recorded_hash: annotation(SPEC_HASH_ANNOTATION),
            recorded_hash_version: annotation(SPEC_HASH_VERSION_ANNOTATION),
            create_pending: annotation(CREATE_PENDING_ANNOTATION),
            desired_hash: self.desired_hash.as_deref(),
            cloud_init_problem: self.cloud_init.as_ref().err().map(String::as_str),
            failed_this_generation: self.failed_this_generation,
            phase: current.phase,
            had_ip: current.ip.is_some(),
            not_provisioned_since: current
                .condition(CONDITION_PROVISIONED)
                .filter(|c| c.status == ConditionStatus::False)
                .map(|c| c.last_transition_time),
            hold_until: self.hold_until,
            now: self.now,
            limits: self.limits,
            observation: &self.observation,
            disruption: current.disruption.as_ref(),
            active_leases: self.active_leases,
            uid: &self.uid,
            max_lifetime: proxy.spec.max_lifetime(),
            rotate_requested: rotation::requested(
                annotation(ROTATE_ANNOTATION),
                annotation(ROTATED_ANNOTATION),
            ),
            unhealthy_since: self.unhealthy_since,
            health: self.health,
            remediation: self.remediation,
        }
    }

    /// What executing the decided action needs about the machine behind `proxy`.
    pub fn machine<'b>(&'b self, proxy: &'b Proxy, ctx: &'b Context) -> Machine<'b> {
        Machine {
            proxy,
            provider: self.provider,
            provider_id: self.provider_id,
            cloud_init: self.cloud_init.as_ref().ok().cloned().flatten(),
            desired_hash: self.desired_hash.as_deref(),
            observation: &self.observation,
            ctx,
            now: self.now,
        }
    }
}

fn has_finalizer(proxy: &Proxy) -> bool {
    proxy
        .finalizers()
        .iter()
        .any(|f| f == crate::resources::proxy::FINALIZER)
}

async fn observe(provider: &dyn Provider, id: &str) -> Observation {
    match provider.get(id).await {
        Ok(instance) => Observation::Found(instance),
        Err(e) if e.is_not_found() => Observation::NotFound,
        Err(e) => Observation::Error {
            class: e.class,
            message: e.to_string(),
        },
    }
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
