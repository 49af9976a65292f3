//! Machine providers: where Managed proxies' machines come from.
//!
//! Every provider implements [`Provider`]; the reconciler and orphan GC only ever talk to the
//! trait. Machines are found by deterministic name and by the labels in [`CreateRequest`], so a
//! repeated create after a crash finds the machine instead of making a second one.

pub mod config;
pub mod error;
#[cfg(feature = "gcp")]
pub mod gcp;
pub mod kube_refusal;
pub mod kubernetes;
pub mod metered;
pub mod pod_status;
pub mod registry;
pub mod squid_conf;

use std::collections::BTreeMap;

pub use config::{ConfigError, ProviderEntry, ProviderType, ProvidersConfig};
pub use error::{ErrorClass, ProviderError};

use crate::resources::proxy::{MANAGED_LABEL, PROXY_UID_LABEL, Placement};

/// Label naming the operator install that created a machine, so two installs sharing a
/// cloud project or cluster never touch each other's machines.
pub const INSTALL_LABEL: &str = "crawl.example.com/install";

/// The labels every machine of this install carries: managed, proxy-uid and install. Providers
/// put them on every machine they create (over whatever the request carries) and
/// [`Provider::list_managed`] selects on managed and install.
pub fn machine_labels(proxy_uid: &str, install_id: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (MANAGED_LABEL.to_owned(), "true".to_owned()),
        (PROXY_UID_LABEL.to_owned(), proxy_uid.to_owned()),
        (INSTALL_LABEL.to_owned(), install_id.to_owned()),
    ])
}

/// Lifecycle state of a machine as the provider reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InstanceState {
    /// Being created, or running without a usable IP yet.
    Provisioning,
    /// Running with an IP.
    Running,
    /// Stopped (still exists, not serving).
    Stopped,
    /// Finished, failed or being torn down.
    Terminated,
}

/// A machine backing a Managed proxy.
#[derive(Debug, Clone, PartialEq)]
pub struct Instance {
    /// Provider-scoped ID (`<namespace>/<pod>` or `zones/<zone>/instances/<name>`).
    pub provider_id: String,
    /// Machine name (`proxy-…`).
    pub name: String,
    /// Current state.
    pub state: InstanceState,
    /// Address crawlers connect to; only set when running.
    pub ip: Option<String>,
    /// UID of the owning Proxy, from the machine's label.
    pub uid: Option<String>,
    /// When the machine was created.
    pub created_at: Option<jiff::Timestamp>,
    /// Why the machine is not running yet, when the provider says (an image that cannot be
    /// pulled, a Pod that cannot be scheduled, a crash-looping squid).
    pub waiting: Option<Waiting>,
    /// When a deletion already asked for should have completed (a Pod's deletionTimestamp,
    /// which includes its grace period). Past it, only a lost node can be holding it.
    pub deletion_deadline: Option<jiff::Timestamp>,
}

/// The provider's own reason why a machine is not running, e.g. `ErrImagePull`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiting {
    /// A short CamelCase reason, as Kubernetes spells it (`CrashLoopBackOff`, `Unschedulable`).
    pub reason: String,
    /// The provider's explanation.
    pub message: String,
}

/// Everything a provider needs to create the machine of one Proxy.
#[derive(Debug, Clone, PartialEq)]
pub struct CreateRequest {
    /// Namespace of the Proxy.
    pub namespace: String,
    /// Name of the Proxy.
    pub proxy_name: String,
    /// UID of the Proxy.
    pub proxy_uid: String,
    /// Deterministic machine name ([`crate::resources::naming::machine_name`]).
    pub machine_name: String,
    /// Squid listen port.
    pub port: i32,
    /// Provider-specific placement.
    pub placement: Option<Placement>,
    /// Resolved cloud-init content.
    pub cloud_init: Option<String>,
    /// Labels to put on the machine (managed, proxy-uid, install).
    pub labels: BTreeMap<String, String>,
    /// The credentials the machine's squid asks of every client; `None`: an open squid.
    pub credentials: Option<MachineCredentials>,
}

/// The credentials a machine checks, as the operator generated them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MachineCredentials {
    /// The Secret holding them, in the Proxy's namespace (keys `username`, `password` and
    /// `htpasswd`); a squid Pod reads its password file from it.
    pub secret_name: String,
    /// The squid password-file line (`user:$6$...`): a hash, never the password.
    pub htpasswd: String,
}

/// The name of a provider operation, used in errors and as the `op` metric label.
pub mod op {
    /// [`super::Provider::create`].
    pub const CREATE: &str = "create";
    /// [`super::Provider::get`].
    pub const GET: &str = "get";
    /// [`super::Provider::delete`].
    pub const DELETE: &str = "delete";
    /// [`super::Provider::force_delete`].
    pub const FORCE_DELETE: &str = "force_delete";
    /// [`super::Provider::list_managed`].
    pub const LIST: &str = "list";
}

/// A source of machines. Implementations are cheap to share (`Arc<dyn Provider>`).
#[async_trait::async_trait]
pub trait Provider: Send + Sync {
    /// Name of the providers-config entry this provider was built from.
    fn name(&self) -> &str;

    /// Creates the machine, or returns the existing one of the same name ("already exists" is
    /// success). Never waits for the machine to be running.
    async fn create(&self, request: &CreateRequest) -> Result<Instance, ProviderError>;

    /// Reads a machine; a missing machine is an error of class [`ErrorClass::NotFound`].
    async fn get(&self, provider_id: &str) -> Result<Instance, ProviderError>;

    /// Deletes a machine; deleting a missing machine succeeds.
    async fn delete(&self, provider_id: &str) -> Result<(), ProviderError>;

    /// Deletes a machine whose deletion is stuck (its node is gone and will never confirm it),
    /// without waiting for a grace period. Providers whose deletes cannot get stuck delete as
    /// usual.
    async fn force_delete(&self, provider_id: &str) -> Result<(), ProviderError> {
        self.delete(provider_id).await
    }

    /// Every machine carrying this install's managed labels.
    async fn list_managed(&self) -> Result<Vec<Instance>, ProviderError>;
}
