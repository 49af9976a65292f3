//! Builds the providers named in the providers config.
//!
//! The type → constructor map is an explicit value handed to [`build_providers`]: nothing
//! registers itself globally, tests pass constructors of their own, and a build without the
//! `gcp` feature simply has no constructor for `gcp` (and says so at start-up).

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use super::Provider;
use super::config::{ProviderEntry, ProviderType, ProvidersConfig};
use super::error::BoxError;
use super::kubernetes::KubernetesProvider;
use super::metered::{MeteredProvider, ProviderMetrics};
use super::squid_conf::SquidEgress;

/// What a constructor returns.
pub type ConstructorFuture =
    Pin<Box<dyn Future<Output = Result<Arc<dyn Provider>, BoxError>> + Send>>;

/// Builds one provider from its config entry and the install id.
pub type Constructor = Box<dyn Fn(ProviderEntry, String) -> ConstructorFuture + Send + Sync>;

/// The providers built from the config, by entry name, each wrapped in [`MeteredProvider`].
pub type Providers = BTreeMap<String, Arc<dyn Provider>>;

/// The type → constructor map.
#[derive(Default)]
pub struct Constructors {
    by_type: HashMap<ProviderType, Constructor>,
}

impl Constructors {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) the constructor of `provider_type`.
    pub fn with<F, Fut>(mut self, provider_type: ProviderType, constructor: F) -> Self
    where
        F: Fn(ProviderEntry, String) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Arc<dyn Provider>, BoxError>> + Send + 'static,
    {
        self.by_type.insert(
            provider_type,
            Box::new(move |entry, install_id| Box::pin(constructor(entry, install_id))),
        );
        self
    }

    /// The constructors of a running operator: squid Pods through `client`, and (with the
    /// `gcp` feature) Compute Engine VMs with Application Default Credentials; every squid they
    /// generate reaches what `egress` allows.
    pub fn standard(client: kube::Client, egress: SquidEgress) -> Self {
        let pods_egress = egress.clone();
        let constructors = Self::new().with(ProviderType::Kubernetes, move |entry, install_id| {
            let client = client.clone();
            let egress = pods_egress.clone();
            async move {
                let config = entry
                    .kubernetes
                    .as_ref()
                    .ok_or("the entry has no `kubernetes:` block")?;
                let provider = KubernetesProvider::new(&entry.name, config, install_id, client)
                    .with_egress(egress);
                Ok(Arc::new(provider) as Arc<dyn Provider>)
            }
        });
        #[cfg(feature = "gcp")]
        let constructors = constructors.with(ProviderType::Gcp, move |entry, install_id| {
            let egress = egress.clone();
            async move {
                let config = entry.gcp.as_ref().ok_or("the entry has no `gcp:` block")?;
                let provider = super::gcp::GcpProvider::connect(&entry.name, config, install_id)
                    .await?
                    .with_egress(egress);
                Ok(Arc::new(provider) as Arc<dyn Provider>)
            }
        });
        constructors
    }
}

/// Why the providers could not be built. Start-up stops on any of these.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The install id cannot be used as a label value.
    #[error(
        "install id {0:?} must be 1-63 lowercase letters, digits or '-', starting and ending with a letter or digit"
    )]
    InvalidInstallId(String),
    /// No constructor for the entry's type in this build.
    #[error(
        "provider {name}: type {type_} is not available in this build (is the `{type_}` feature enabled?)"
    )]
    NoConstructor {
        /// The entry's name.
        name: String,
        /// The entry's type.
        type_: String,
    },
    /// The constructor failed (bad credentials, unreachable metadata server, ...).
    #[error("provider {name}: cannot be built: {source}")]
    Build {
        /// The entry's name.
        name: String,
        /// What went wrong.
        source: BoxError,
    },
    /// The metering counter could not be registered.
    #[error("provider metrics: {0}")]
    Metrics(#[from] prometheus::Error),
}

/// Whether `id` is usable as a label value in Kubernetes and in GCP alike.
pub fn validate_install_id(id: &str) -> Result<(), RegistryError> {
    let bytes = id.as_bytes();
    let allowed = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-';
    let edge = |b: Option<&u8>| b.is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if bytes.len() <= 63 && bytes.iter().all(allowed) && edge(bytes.first()) && edge(bytes.last()) {
        Ok(())
    } else {
        Err(RegistryError::InvalidInstallId(id.to_owned()))
    }
}

/// Builds every provider of `config` with `constructors`, wraps each in the metering
/// decorator counting into `registry`, and returns them by name.
pub async fn build_providers(
    config: &ProvidersConfig,
    constructors: &Constructors,
    install_id: &str,
    registry: &prometheus::Registry,
) -> Result<Providers, RegistryError> {
    validate_install_id(install_id)?;
    let metrics = ProviderMetrics::register(registry)?;
    let mut providers = Providers::new();
    for entry in &config.providers {
        let constructor = entry
            .provider_type()
            .and_then(|t| constructors.by_type.get(&t))
            .ok_or_else(|| RegistryError::NoConstructor {
                name: entry.name.clone(),
                type_: entry.type_.clone(),
            })?;
        let provider = constructor(entry.clone(), install_id.to_owned())
            .await
            .map_err(|source| RegistryError::Build {
                name: entry.name.clone(),
                source,
            })?;
        let metered = MeteredProvider::new(provider, metrics.clone());
        providers.insert(entry.name.clone(), Arc::new(metered));
    }
    Ok(providers)
}
