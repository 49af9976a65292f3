//! Machine providers: where Managed proxies' machines come from.

pub mod config;
pub mod error;

pub use config::{ConfigError, ProviderEntry, ProviderType, ProvidersConfig};
pub use error::{ErrorClass, ProviderError, class_of};
