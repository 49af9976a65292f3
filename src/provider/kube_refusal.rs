//! Classifying a Kubernetes API failure by what refused it, not by status code alone: an
//! admission plugin, a webhook or RBAC refusing a Pod is a policy that someone can change at
//! any time (a ServiceAccount created, a LimitRange relaxed, a namespace relabelled), so it is
//! retried with backoff; only a request the server can never accept as it stands is permanent.

use super::ErrorClass;

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
}
