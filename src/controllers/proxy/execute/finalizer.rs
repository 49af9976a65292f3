//! The finalizer that keeps a Managed Proxy until its machine is gone: added before the first
//! create, removed once nothing is left to delete. An External proxy has no machine and never
//! gets it; one that carries it anyway loses it.

use kube::api::{Patch, PatchParams};
use kube::runtime::controller;
use kube::{Api, ResourceExt};
use serde_json::json;

use super::machine::Machine;
use super::step::Step;
use crate::controllers::proxy::error::Error;
use crate::resources::proxy::{FINALIZER, Proxy};

/// Adds the finalizer; the change triggers the next reconcile.
pub(super) async fn add_finalizer(machine: &Machine<'_>, api: &Api<Proxy>) -> Result<Step, Error> {
    let proxy = machine.proxy;
    let mut finalizers = proxy.finalizers().to_vec();
    finalizers.push(FINALIZER.to_owned());
    patch_finalizers(api, proxy, finalizers).await?;
    Ok(Step::requeue(controller::Action::await_change()))
}

/// Removes the finalizer. A Proxy being deleted goes now, so its health and budget slot are
/// forgotten; an External proxy that only loses a finalizer it never needed stays, with both.
pub(super) async fn remove_finalizer(
    machine: &Machine<'_>,
    api: &Api<Proxy>,
) -> Result<Step, Error> {
    let proxy = machine.proxy;
    let finalizers = proxy
        .finalizers()
        .iter()
        .filter(|f| *f != FINALIZER)
        .cloned()
        .collect();
    patch_finalizers(api, proxy, finalizers).await?;
    if proxy.metadata.deletion_timestamp.is_some() {
        machine.ctx.health.forget(&proxy.id());
        machine.ctx.exits.forget(&proxy.id());
        machine.ctx.grants.release(&machine.uid());
    }
    Ok(Step::requeue(controller::Action::await_change()))
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
