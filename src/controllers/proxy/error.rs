//! The error a reconcile ends with, and its label for metrics and logs.

use kube::Resource;

use crate::resources::proxy::Proxy;

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

    /// Whether the API server answered that the Proxy `name` itself is gone: the reconcile ran
    /// on the store's copy of a Proxy deleted meanwhile (one without a finalizer, or whose
    /// finalizer came off). Nothing is left to reconcile, so this is no failure.
    pub fn is_gone(&self, name: &str) -> bool {
        let Error::Kube(kube::Error::Api(status)) = self else {
            return false;
        };
        status.is_not_found()
            && status
                .details
                .as_ref()
                .is_some_and(|d| d.kind == Proxy::plural(&()) && d.name == name)
    }

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

#[cfg(test)]
mod tests {
    use kube::core::Status;

    use super::*;

    /// An API error as the API server answers it about `kind`/`name`.
    fn api_error(code: u16, reason: &str, kind: &str, name: &str) -> Error {
        let status: Status = serde_json::from_value(serde_json::json!({
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "message": format!("{kind}.crawl.example.com \"{name}\" {reason}"),
            "reason": reason,
            "details": {"name": name, "group": "crawl.example.com", "kind": kind},
            "code": code,
        }))
        .unwrap();
        Error::Kube(kube::Error::Api(status.boxed()))
    }

    #[test]
    fn only_a_not_found_of_the_proxy_itself_means_it_is_gone() {
        let cases = [
            (api_error(404, "NotFound", "proxies", "px"), true),
            (api_error(404, "NotFound", "proxies", "other"), false),
            (api_error(404, "NotFound", "secrets", "px"), false),
            (api_error(409, "Conflict", "proxies", "px"), false),
            (Error::Provider("not found".to_owned()), false),
            (Error::MissingField("metadata.namespace"), false),
        ];
        for (error, gone) in cases {
            assert_eq!(error.is_gone("px"), gone, "{error}");
        }
    }
}
