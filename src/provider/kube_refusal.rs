//! Classifying a Kubernetes API failure by what refused it, not by status code alone: an
//! admission plugin, a webhook or RBAC refusing a Pod is a policy that someone can change at
//! any time (a ServiceAccount created, a LimitRange relaxed, a namespace relabelled), so it is
//! retried with backoff; only a request the server can never accept as it stands is permanent.

use std::error::Error as StdError;
use std::fmt;

use super::ErrorClass;

/// A Kubernetes API failure that displays as the server's message with its code and reason.
/// kube's own display repeats the whole Status after the message, which doubles every
/// condition message and Event note built from it; the kube error stays reachable as the
/// source.
#[derive(Debug)]
pub struct ApiFailure(pub kube::Error);

impl fmt::Display for ApiFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            kube::Error::Api(status) => {
                write!(f, "{} ({} {})", status.message, status.code, status.reason)
            }
            other => write!(f, "{other}"),
        }
    }
}

impl StdError for ApiFailure {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&self.0)
    }
}

/// The class of a Kubernetes API failure.
pub fn classify(err: &kube::Error) -> ErrorClass {
    let kube::Error::Api(status) = err else {
        return ErrorClass::Transient;
    };
    let message = status.message.as_str();
    match status.code {
        404 => ErrorClass::NotFound,
        403 if message.contains("exceeded quota") => ErrorClass::QuotaExceeded,
        408 | 409 | 410 | 429 => ErrorClass::Transient,
        // A webhook picks its own code; its refusal is policy like any other admission.
        _ if message.contains("admission webhook") => ErrorClass::Refused,
        // Admission plugins (ServiceAccount, LimitRanger, PodSecurity) and RBAC answer 403;
        // 401 is a credential the platform may rotate.
        401 | 403 => ErrorClass::Refused,
        400..=499 => ErrorClass::Permanent,
        _ => ErrorClass::Transient,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(code: u16, reason: &str, message: &str) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure(message, reason)
                .with_code(code)
                .boxed(),
        )
    }

    #[test]
    fn classification_table() {
        use ErrorClass::*;
        let cases = [
            (404, "NotFound", "pods \"x\" not found", NotFound),
            (
                403,
                "Forbidden",
                "pods \"x\" is forbidden: exceeded quota: compute, requested: pods=1",
                QuotaExceeded,
            ),
            (
                403,
                "Forbidden",
                "pods \"x\" is forbidden: error looking up service account crawl/default: \
                 serviceaccount \"default\" not found",
                Refused,
            ),
            (
                403,
                "Forbidden",
                "pods \"x\" is forbidden: maximum cpu usage per Container is 100m, but limit \
                 is 500m",
                Refused,
            ),
            (
                403,
                "Forbidden",
                "pods \"x\" is forbidden: violates PodSecurity \"restricted:latest\": \
                 runAsNonRoot != true",
                Refused,
            ),
            (
                403,
                "Forbidden",
                "pods is forbidden: User \"system:serviceaccount:ops:proxy-operator\" cannot \
                 create resource \"pods\"",
                Refused,
            ),
            (
                400,
                "BadRequest",
                "admission webhook \"deny.example.com\" denied the request: no",
                Refused,
            ),
            (
                422,
                "Invalid",
                "admission webhook \"v.example.com\" denied the request: bad",
                Refused,
            ),
            (401, "Unauthorized", "Unauthorized", Refused),
            (400, "BadRequest", "bad", Permanent),
            (
                422,
                "Invalid",
                "spec.containers[0].image: Required value",
                Permanent,
            ),
            (409, "Conflict", "retry", Transient),
            (410, "Expired", "continue token expired", Transient),
            (429, "TooManyRequests", "slow down", Transient),
            (500, "InternalError", "etcd", Transient),
            (503, "ServiceUnavailable", "down", Transient),
        ];
        for (code, reason, message, want) in cases {
            assert_eq!(
                classify(&api_error(code, reason, message)),
                want,
                "{code} {reason}: {message}"
            );
        }
        let io = kube::Error::ReadEvents(std::io::Error::other("reset"));
        assert_eq!(classify(&io), Transient);
    }

    #[test]
    fn failures_show_the_servers_message_once_and_keep_the_kube_error() {
        let message = "pods \"x\" is forbidden: violates PodSecurity \"restricted:latest\"";
        let failure = ApiFailure(api_error(403, "Forbidden", message));
        assert_eq!(failure.to_string(), format!("{message} (403 Forbidden)"));
        let source = failure
            .source()
            .and_then(|s| s.downcast_ref::<kube::Error>());
        assert!(matches!(source, Some(kube::Error::Api(s)) if s.code == 403));
        let io = ApiFailure(kube::Error::ReadEvents(std::io::Error::other("reset")));
        assert!(io.to_string().contains("reset"), "{io}");
    }
}
