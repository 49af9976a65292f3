//! Errors from machine providers, classified so the reconciler knows what to do next.

use std::error::Error as StdError;
use std::fmt;

/// What a provider failure means for the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// Worth retrying with backoff. The default for anything unclassified: retrying is always
    /// safer than latching a proxy into Failed.
    Transient,
    /// The cloud refused for quota or rate reasons; retry in minutes, not seconds.
    QuotaExceeded,
    /// Refused by the platform's policy (admission, authorization): someone must change that
    /// policy or the namespace, which may happen any time, so retry with backoff and say why.
    Refused,
    /// The request can never be accepted as it stands (an invalid spec); needs a human.
    /// Still retried on a slow timer, since the provider's rules may change.
    Permanent,
    /// The machine does not exist. An input to the reconciler, never a failure.
    NotFound,
}

impl ErrorClass {
    /// Stable lowercase name, used as a metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::Transient => "transient",
            ErrorClass::QuotaExceeded => "quota_exceeded",
            ErrorClass::Refused => "refused",
            ErrorClass::Permanent => "permanent",
            ErrorClass::NotFound => "not_found",
        }
    }
}

impl fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The boxed underlying error of a provider call (an SDK or HTTP error).
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// A failed provider call: its class, what was attempted, and the underlying error.
#[derive(Debug, thiserror::Error)]
#[error("provider {provider}: {op} {id}: {class}: {source}")]
pub struct ProviderError {
    /// What the failure means for the caller.
    pub class: ErrorClass,
    /// The operation, e.g. `create`, `get`, `delete`, `list`.
    pub op: &'static str,
    /// Name of the provider entry in the providers config.
    pub provider: String,
    /// Machine name or provider ID the call was about (empty for `list`).
    pub id: String,
    /// The underlying error.
    #[source]
    pub source: BoxError,
}

impl ProviderError {
    /// A classified error.
    pub fn new(
        class: ErrorClass,
        op: &'static str,
        provider: impl Into<String>,
        id: impl Into<String>,
        source: impl Into<BoxError>,
    ) -> Self {
        ProviderError {
            class,
            op,
            provider: provider.into(),
            id: id.into(),
            source: source.into(),
        }
    }

    /// Whether this is a NotFound answer.
    pub fn is_not_found(&self) -> bool {
        self.class == ErrorClass::NotFound
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn class_and_source_are_both_reachable() {
        let io = std::io::Error::new(std::io::ErrorKind::TimedOut, "deadline");
        let err = ProviderError::new(ErrorClass::QuotaExceeded, "create", "gcp-eu", "proxy-x", io);
        assert_eq!(err.class, ErrorClass::QuotaExceeded);
        assert!(!err.is_not_found());
        let source = err.source().unwrap();
        let io = source.downcast_ref::<std::io::Error>().unwrap();
        assert_eq!(io.kind(), std::io::ErrorKind::TimedOut);
        let text = err.to_string();
        for part in ["gcp-eu", "create", "proxy-x", "quota_exceeded", "deadline"] {
            assert!(text.contains(part), "{text} lacks {part}");
        }
    }

    #[test]
    fn only_the_not_found_class_is_not_found() {
        let gone = ProviderError::new(ErrorClass::NotFound, "get", "local", "ns/p", "gone");
        assert!(gone.is_not_found());
        assert_eq!(gone.class.as_str(), "not_found");
    }
}
