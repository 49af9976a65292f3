//! What the jobs of `execute` know about the machine behind a Proxy ([`Machine`]), and the
//! reads and ledger calls they all make through it.

use std::time::Duration;

use jiff::Timestamp;
use kube::ResourceExt;

use crate::controllers::proxy::context::Context;
use crate::controllers::proxy::decide::Observation;
use crate::controllers::proxy::error::Error;
use crate::controllers::proxy::pacing::At;
use crate::provider::{
    CreateRequest, Instance, MachineCredentials, Provider, ProviderError, machine_labels,
};
use crate::resources::naming::machine_name;
use crate::resources::proxy::Proxy;

/// What `execute` needs about the machine behind a proxy.
pub(crate) struct Machine<'a> {
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
    pub(super) fn provider(&self) -> Result<&dyn Provider, Error> {
        self.provider
            .ok_or_else(|| Error::Provider("no provider for this Proxy".to_owned()))
    }

    pub(super) fn provider_id(&self) -> Result<&str, Error> {
        self.provider_id
            .ok_or(Error::MissingField("status.providerID"))
    }

    pub(super) fn uid(&self) -> String {
        self.proxy.uid().unwrap_or_default()
    }

    pub(super) fn create_request(&self, credentials: MachineCredentials) -> CreateRequest {
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
    pub(super) fn at(&self) -> At {
        At {
            now: self.now,
            generation: self.proxy.metadata.generation,
        }
    }

    /// The base and cap of the failure backoff.
    pub(super) fn backoff(&self) -> (Duration, Duration) {
        let config = &self.ctx.config;
        (config.error_requeue, config.error_requeue_max)
    }

    /// Ends the proxy's active leases (its machine is gone); a ledger failure is logged and
    /// leaves them to expire, never blocking the repair.
    pub(super) async fn end_leases(&self, reason: &str) -> u64 {
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

/// The machine of this Proxy found by its deterministic name.
pub(super) async fn find_by_name(
    machine: &Machine<'_>,
    provider: &dyn Provider,
) -> Result<Option<Instance>, ProviderError> {
    let name = machine_name(&machine.uid());
    let instances = provider.list_managed().await?;
    Ok(instances.into_iter().find(|i| i.name == name))
}
