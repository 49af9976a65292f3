//! The Kubernetes API calls the operator makes, kept as data: the RBAC rules in `manifests/`
//! must grant exactly these (a test compares them), and the mock-API tests check every request
//! the code sends against [`permits`], so a new call without a rule fails a test instead of a
//! production install.

/// Where a rule is granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// In every namespace (ClusterRole): Proxies, their Secrets, Events and Pods live wherever
    /// the Proxies are.
    Cluster,
    /// Only in the operator's own namespace (Role): the leader-election Lease.
    OperatorNamespace,
}

/// One resource the operator calls and the verbs it uses on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApiCall {
    /// API group (`""` for the core group).
    pub group: &'static str,
    /// Resource, with `/subresource` where one is called.
    pub resource: &'static str,
    /// RBAC verbs, sorted.
    pub verbs: &'static [&'static str],
    /// Where the rule is granted.
    pub scope: Scope,
    /// The modules that make the calls.
    pub made_by: &'static str,
}

/// Every API call of the operator.
pub const API_CALLS: &[ApiCall] = &[
    // The one Proxy watch shared by the reconciler and the inventory (list + watch; raw objects,
    // same URL as a typed watch), the live-UID list of orphan GC, and merge patches of
    // finalizers and annotations on the object itself (finalizers are patched through the main
    // resource, so `proxies/finalizers` is not used).
    // Pools create their member Proxies and delete them on scale-down, roll-out and the pool's
    // deletion.
    ApiCall {
        group: "crawl.example.com",
        resource: "proxies",
        verbs: &["create", "delete", "list", "patch", "watch"],
        scope: Scope::Cluster,
        made_by: "proxy_watch, reconcile, gc, pool::controller",
    },
    // Every replica watches ProxyPools (the API and the gateway hold requests for waking pools
    // on followers too); the pool controller patches their finalizer.
    ApiCall {
        group: "crawl.example.com",
        resource: "proxypools",
        verbs: &["list", "patch", "watch"],
        scope: Scope::Cluster,
        made_by: "pool::watch, pool::controller",
    },
    // The pool controller is the only writer of pool status.
    ApiCall {
        group: "crawl.example.com",
        resource: "proxypools/status",
        verbs: &["patch"],
        scope: Scope::Cluster,
        made_by: "pool::controller",
    },
    // The autoscaler writes spec.replicas through /scale, as an HPA would.
    ApiCall {
        group: "crawl.example.com",
        resource: "proxypools/scale",
        verbs: &["patch"],
        scope: Scope::Cluster,
        made_by: "pool::controller",
    },
    // Members carry an owner reference with blockOwnerDeletion, which a cluster enforcing
    // owner-reference permissions allows only to whoever may update the owner's finalizers.
    ApiCall {
        group: "crawl.example.com",
        resource: "proxypools/finalizers",
        verbs: &["update"],
        scope: Scope::Cluster,
        made_by: "pool::controller (member owner references)",
    },
    // The single status writer: one JSON merge patch per reconcile.
    ApiCall {
        group: "crawl.example.com",
        resource: "proxies/status",
        verbs: &["patch"],
        scope: Scope::Cluster,
        made_by: "reconcile::write",
    },
    // Reading a `cloudInit.secretRef`, and the watch of Secrets labelled
    // `crawl.example.com/cloud-init=true` that re-triggers the Proxies using them; the watch of
    // Secrets labelled `crawl.example.com/proxy-credentials=true` (upstream credentials); and
    // the credentials Secret the reconciler creates for a Managed proxy's machines.
    ApiCall {
        group: "",
        resource: "secrets",
        verbs: &["create", "get", "list", "watch"],
        scope: Scope::Cluster,
        made_by: "reconcile, credentials watch",
    },
    // kube-runtime's event `Recorder` writes `events.k8s.io/v1` Events (create, then patch to
    // count repeats): reconcile outcomes, and InvalidSpec on Proxies that do not decode.
    ApiCall {
        group: "events.k8s.io",
        resource: "events",
        verbs: &["create", "patch"],
        scope: Scope::Cluster,
        made_by: "reconcile::write, proxy_watch",
    },
    // The status page lists the Events about one Proxy (core/v1, by `involvedObject` field
    // selector) for its page, on every replica; `watch` for a live view of them.
    ApiCall {
        group: "",
        resource: "events",
        verbs: &["list", "watch"],
        scope: Scope::Cluster,
        made_by: "status::kube_events",
    },
    // The kubernetes provider: one squid Pod per Proxy in the Proxy's namespace, listed by label
    // across namespaces; the reconciler watches them by label so a dead or evicted Pod is seen
    // at once.
    ApiCall {
        group: "",
        resource: "pods",
        verbs: &["create", "delete", "get", "list", "watch"],
        scope: Scope::Cluster,
        made_by: "provider::kubernetes, reconcile",
    },
    // Leader election for orphan GC (kube-lease-manager): read, create when missing, and
    // acquire/renew/release by patch.
    ApiCall {
        group: "coordination.k8s.io",
        resource: "leases",
        verbs: &["create", "get", "patch"],
        scope: Scope::OperatorNamespace,
        made_by: "leader",
    },
];

/// What the API server authorizes for one HTTP request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestAttributes {
    /// API group (`""` for the core group).
    pub group: String,
    /// Resource, with `/subresource` when the path names one.
    pub resource: String,
    /// RBAC verb.
    pub verb: &'static str,
    /// Namespace in the path, if any.
    pub namespace: Option<String>,
}

/// The RBAC attributes of `method` on `path_and_query`, derived the way the API server does
/// (`/api/v1/...` is the core group; a GET without a name is `list`, or `watch` with
/// `watch=true`; a DELETE without a name is `deletecollection`). `None` for paths that are
/// not resource requests (discovery, `/version`).
pub fn request_attributes(method: &str, path_and_query: &str) -> Option<RequestAttributes> {
    let (path, query) = path_and_query
        .split_once('?')
        .unwrap_or((path_and_query, ""));
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    let (group, rest) = match parts.as_slice() {
        ["api", _version, rest @ ..] => ("", rest),
        ["apis", group, _version, rest @ ..] => (*group, rest),
        _ => return None,
    };
    let (namespace, rest) = match rest {
        ["namespaces", namespace, rest @ ..] if !rest.is_empty() => (Some(*namespace), rest),
        _ => (None, rest),
    };
    let (resource, name, subresource) = match rest {
        [resource] => (*resource, None, None),
        [resource, name] => (*resource, Some(*name), None),
        [resource, name, subresource] => (*resource, Some(*name), Some(*subresource)),
        _ => return None,
    };
    let watching = query
        .split('&')
        .any(|pair| pair == "watch=true" || pair == "watch=1");
    let verb = match (method, name.is_some()) {
        ("GET", true) => "get",
        ("GET", false) if watching => "watch",
        ("GET", false) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        _ => return None,
    };
    Some(RequestAttributes {
        group: group.to_owned(),
        resource: match subresource {
            Some(sub) => format!("{resource}/{sub}"),
            None => resource.to_owned(),
        },
        verb,
        namespace: namespace.map(str::to_owned),
    })
}

/// The entry of [`API_CALLS`] that grants `attributes`, if any.
pub fn granting(attributes: &RequestAttributes) -> Option<&'static ApiCall> {
    API_CALLS.iter().find(|call| {
        call.group == attributes.group
            && call.resource == attributes.resource
            && call.verbs.contains(&attributes.verb)
            && (call.scope == Scope::Cluster || attributes.namespace.is_some())
    })
}

/// Whether [`API_CALLS`] grants `method` on `path_and_query`. Non-resource paths are not
/// granted: the operator makes no such calls.
pub fn permits(method: &str, path_and_query: &str) -> bool {
    request_attributes(method, path_and_query)
        .as_ref()
        .and_then(granting)
        .is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attrs(
        group: &str,
        resource: &str,
        verb: &'static str,
        ns: Option<&str>,
    ) -> RequestAttributes {
        RequestAttributes {
            group: group.into(),
            resource: resource.into(),
            verb,
            namespace: ns.map(str::to_owned),
        }
    }

    #[test]
    fn request_attributes_follow_the_api_server() {
        let cases = [
            (
                "GET",
                "/apis/crawl.example.com/v1alpha1/proxies?&limit=500",
                Some(attrs("crawl.example.com", "proxies", "list", None)),
            ),
            (
                "GET",
                "/apis/crawl.example.com/v1alpha1/proxies?&watch=true&timeoutSeconds=290",
                Some(attrs("crawl.example.com", "proxies", "watch", None)),
            ),
            (
                "PATCH",
                "/apis/crawl.example.com/v1alpha1/namespaces/crawl/proxies/p1/status?",
                Some(attrs(
                    "crawl.example.com",
                    "proxies/status",
                    "patch",
                    Some("crawl"),
                )),
            ),
            (
                "GET",
                "/api/v1/namespaces/crawl/secrets/init",
                Some(attrs("", "secrets", "get", Some("crawl"))),
            ),
            (
                "POST",
                "/apis/events.k8s.io/v1/namespaces/crawl/events?",
                Some(attrs("events.k8s.io", "events", "create", Some("crawl"))),
            ),
            (
                "DELETE",
                "/api/v1/namespaces/crawl/pods/proxy-abc",
                Some(attrs("", "pods", "delete", Some("crawl"))),
            ),
            (
                "DELETE",
                "/api/v1/namespaces/crawl/pods",
                Some(attrs("", "pods", "deletecollection", Some("crawl"))),
            ),
            (
                "PUT",
                "/apis/coordination.k8s.io/v1/namespaces/ops/leases/l",
                Some(attrs(
                    "coordination.k8s.io",
                    "leases",
                    "update",
                    Some("ops"),
                )),
            ),
            // The namespace object itself, not something inside it.
            (
                "GET",
                "/api/v1/namespaces/crawl",
                Some(attrs("", "namespaces", "get", None)),
            ),
            ("GET", "/version", None),
            ("GET", "/apis/crawl.example.com/v1alpha1", None),
            ("HEAD", "/api/v1/pods", None),
        ];
        for (method, path, expected) in cases {
            assert_eq!(
                request_attributes(method, path),
                expected,
                "{method} {path}"
            );
        }
    }

    #[test]
    fn permits_exactly_the_listed_calls() {
        let allowed = [
            (
                "PATCH",
                "/apis/crawl.example.com/v1alpha1/namespaces/a/proxies/p",
            ),
            ("GET", "/apis/crawl.example.com/v1alpha1/proxies?watch=true"),
            ("GET", "/api/v1/pods?labelSelector=x"),
            ("POST", "/apis/coordination.k8s.io/v1/namespaces/ops/leases"),
        ];
        let refused = [
            // No `get` on Proxies, no `update` anywhere, no core Events.
            (
                "GET",
                "/apis/crawl.example.com/v1alpha1/namespaces/a/proxies/p",
            ),
            (
                "PUT",
                "/apis/crawl.example.com/v1alpha1/namespaces/a/proxies/p/finalizers",
            ),
            ("POST", "/api/v1/namespaces/a/events"),
            ("PATCH", "/api/v1/namespaces/a/pods/p"),
            // The Lease rule is namespaced: a cluster-wide list is not granted.
            ("GET", "/apis/coordination.k8s.io/v1/leases"),
            ("GET", "/healthz"),
        ];
        for (method, path) in allowed {
            assert!(permits(method, path), "{method} {path} refused");
        }
        for (method, path) in refused {
            assert!(!permits(method, path), "{method} {path} permitted");
        }
    }

    #[test]
    fn calls_are_listed_once_with_sorted_verbs() {
        for (i, call) in API_CALLS.iter().enumerate() {
            assert!(call.verbs.is_sorted(), "{}: verbs unsorted", call.resource);
            assert!(!call.made_by.is_empty());
            assert!(
                API_CALLS[..i]
                    .iter()
                    .all(|c| (c.group, c.resource) != (call.group, call.resource)),
                "{} listed twice",
                call.resource
            );
        }
    }
}
