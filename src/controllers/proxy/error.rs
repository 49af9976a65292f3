//! The error a reconcile ends with, and its label for metrics and logs.

/// Why a reconcile failed; the controller retries with exponential backoff from
/// [`ReconcilerConfig::error_requeue`].
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A Kubernetes API call failed.
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// A provider call failed transiently (or answered nothing usable).
    #[error("provider: {0}")]
    Provider(String),
    /// The object lacks a field the API server always sets.
    #[error("object has no {0}")]
    MissingField(&'static str),
    /// The machine's credentials cannot be made or read.
    #[error("machine credentials: {0}")]
    Credentials(String),
}

impl Error {
    /// Every [`Error::metric_label`].
    pub const KINDS: [&'static str; 4] = ["kube", "provider", "missing_field", "credentials"];

    /// Short label for metrics and logs.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube",
            Error::Provider(_) => "provider",
            Error::MissingField(_) => "missing_field",
            Error::Credentials(_) => "credentials",
        }
    }
}
