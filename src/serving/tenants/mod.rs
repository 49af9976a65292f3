//! Tenants: the teams that share one fleet. A tenant is named by its tokens (`--tenants-file`,
//! see `file`), sees and leases only the proxies in its scope, and is held to its quotas by
//! the ledger. The tokens of `DISCOVERY_TOKEN` and `--discovery-token-file` are one tenant
//! with no scope and no quota, [`DEFAULT_TENANT`], so an install without a tenants file
//! behaves as it always did.
//!
//! Another tenant's leases and sessions are answered exactly as unknown ones: the API and
//! the gateway never say that an ID exists.

mod budgets;
mod file;
mod metrics;
mod refusal;

use std::sync::Arc;

pub use budgets::BudgetCollector;
pub use file::{LoadedTenants, MAX_TENANTS, TenantsError, TenantsFile, load, watch_file};
pub use metrics::TenantMetrics;
pub use refusal::QuotaExceededBody;

use super::candidates::Selector;
use crate::ledger::{DEFAULT_TENANT, Quotas, Tenancy};

/// A token's SHA-256: all the process keeps of a token, and what the tenants file lists.
pub type TokenDigest = [u8; 32];
use crate::resources::proxy::ProxyId;

/// One tenant: its name, the proxies it may see and lease, and its quotas.
#[derive(Debug, Clone, PartialEq)]
pub struct Tenant {
    /// Its name, recorded with its leases and history (and a metrics label).
    pub name: Arc<str>,
    /// What a proxy must match to be in its scope (namespaces and labels); unrestricted for
    /// the default tenant.
    pub scope: Selector,
    /// What it may hold at once, and how fast it may acquire.
    pub quotas: Quotas,
    /// Whether its requests may ask the gateway to intercept their TLS (`tls=inspect`): the
    /// default tenant's may (the operators' tokens), a tenant of the file's only when it says.
    pub interception: bool,
}

impl Tenant {
    /// The tenant of the token file and `DISCOVERY_TOKEN`: no scope, no quota.
    pub fn unrestricted() -> Arc<Tenant> {
        Arc::new(Tenant {
            name: DEFAULT_TENANT.into(),
            scope: Selector::default(),
            quotas: Quotas::default(),
            interception: true,
        })
    }

    /// `selector` narrowed to what this tenant may see.
    pub fn narrow(&self, selector: &Selector) -> Selector {
        if self.scope.is_unrestricted() {
            return selector.clone();
        }
        selector.within(&self.scope)
    }

    /// Whether the proxy `id` with `labels` is in this tenant's scope.
    pub fn sees(
        &self,
        id: &ProxyId,
        labels: Option<&std::collections::BTreeMap<String, String>>,
    ) -> bool {
        self.scope.matches(&id.namespace, labels)
    }

    /// Whether it sees the whole fleet (the default tenant, or one scoped to nothing).
    pub fn sees_everything(&self) -> bool {
        self.scope.is_unrestricted()
    }

    /// Whether it sees every tenant's leases, reports and history on the status page: only
    /// the default tenant, whose tokens are the operators'. Any other tenant sees its own.
    pub fn sees_every_tenant(&self) -> bool {
        &*self.name == DEFAULT_TENANT
    }

    /// The tenant whose history a read covers: `None` (every tenant's) for the default
    /// tenant, else this one's.
    pub fn history_filter(&self) -> Option<String> {
        (!self.sees_every_tenant()).then(|| self.name.to_string())
    }

    /// What the ledger holds its acquires to.
    pub fn tenancy(&self) -> Tenancy {
        Tenancy {
            name: self.name.clone(),
            quotas: self.quotas,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::label_map as labels;

    fn id(namespace: &str) -> ProxyId {
        ProxyId {
            namespace: namespace.into(),
            name: "p".into(),
            uid: "u".into(),
        }
    }

    #[test]
    fn the_default_tenant_sees_everything_and_narrows_nothing() {
        let tenant = Tenant::unrestricted();
        assert!(tenant.sees_everything());
        assert!(tenant.sees(&id("anywhere"), None));
        let selector = Selector::parse("geo=eu").unwrap();
        assert_eq!(tenant.narrow(&selector), selector);
        assert_eq!(tenant.tenancy(), Tenancy::unrestricted());
    }

    #[test]
    fn a_scoped_tenant_sees_its_namespaces_and_labels_only() {
        let tenant = Tenant {
            name: "team-a".into(),
            scope: Selector::parse("team=a")
                .unwrap()
                .in_namespaces(["crawl-a".to_owned()]),
            quotas: Quotas::default(),
            interception: false,
        };
        let mine = labels(&[("team", "a"), ("geo", "eu")]);
        let theirs = labels(&[("team", "b"), ("geo", "eu")]);
        assert!(tenant.sees(&id("crawl-a"), Some(&mine)));
        assert!(!tenant.sees(&id("crawl-a"), Some(&theirs)));
        assert!(!tenant.sees(&id("crawl-b"), Some(&mine)));
        assert!(!tenant.sees_everything());
        let narrowed = tenant.narrow(&Selector::parse("geo=eu").unwrap());
        assert!(narrowed.matches("crawl-a", Some(&mine)));
        assert!(!narrowed.matches("crawl-a", Some(&theirs)));
    }
}
