//! Writing what a reconcile did: the status built in one place ([`desired_status`]) and
//! written at most once, only when it differs, guarded by the newest resourceVersion known (a
//! 409 means the object changed since it was read: reconcile again at once); then the
//! annotations recorded after the provider call; then the Event.

use std::time::Duration;

use kube::api::{Patch, PatchParams};
use kube::runtime::controller;
use kube::{Api, Resource, ResourceExt};

use super::context::Context;
use super::error::Error;
use super::execute::Step;
use super::exit_status::apply_exit;
use super::status::{desired_status, status_patch};
use crate::resources::proxy::{Proxy, ProxyStatus};

/// Carries out `step` for `proxy`, whose status was `current` when the reconcile read it;
/// returns when to reconcile again.
pub(super) async fn write(
    proxy: &Proxy,
    current: &ProxyStatus,
    step: Step,
    api: &Api<Proxy>,
    ctx: &Context,
) -> Result<controller::Action, Error> {
    let mut conflict = false;
    if let Some(change) = &step.status {
        let health = ctx.health.get(&proxy.id());
        let now = (ctx.clock)();
        let mut desired = desired_status(
            current,
            change,
            &proxy.spec,
            health.as_ref(),
            proxy.metadata.generation,
            now,
        );
        apply_exit(
            &mut desired,
            &proxy.spec,
            proxy.metadata.labels.as_ref(),
            ctx.exits.get(&proxy.id()).as_ref(),
            proxy.metadata.generation,
            now,
        );
        if desired != *current {
            let known = step
                .resource_version
                .clone()
                .or_else(|| proxy.resource_version());
            let patch = status_patch(&desired, known.as_deref());
            match api
                .patch_status(
                    &proxy.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(patch),
                )
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(status)) if status.code == 409 => {
                    log::debug!(
                        "Proxy {}: changed since this reconcile read it; reconciling again",
                        proxy.key()
                    );
                    conflict = true;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
    if !conflict && let Some(reason) = step.disruption_started {
        ctx.metrics.disruption_started(reason);
    }
    if !conflict && let Some(annotations) = &step.annotations {
        api.patch(
            &proxy.name_any(),
            &PatchParams::default(),
            &Patch::Merge(annotations),
        )
        .await?;
    }
    // The Event tells of something already done (a provider call), so it goes out even when the
    // status write lost a race.
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
    if conflict {
        return Ok(controller::Action::requeue(Duration::ZERO));
    }
    Ok(step.requeue)
}
