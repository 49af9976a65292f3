//! ProxyPools in a test's [`World`]: the pool APIs, pool objects and templates as `kubectl
//! apply` would send them, and waits on a pool's members.

use std::collections::BTreeMap;
use std::time::Duration;

use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, PostParams};
use proxy_operator::controllers::pool::members::template_hash;
use proxy_operator::resources::pool::{POOL_LABEL, ProxyPool, TEMPLATE_HASH_LABEL};
use proxy_operator::resources::proxy::{Phase, Proxy};
use serde_json::{Value, json};

use super::world::{World, within};

/// A pool object named `name` with `spec`.
pub fn pool_object(name: &str, spec: Value) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "crawl.example.com/v1alpha1",
        "kind": "ProxyPool",
        "metadata": {"name": name},
        "spec": spec,
    }))
    .expect("a ProxyPool object")
}

/// Whether a member is Ready and not being deleted.
pub fn is_ready(proxy: &Proxy) -> bool {
    proxy.metadata.deletion_timestamp.is_none()
        && proxy.status.as_ref().and_then(|s| s.phase) == Some(Phase::Ready)
}

impl World {
    /// The pools of the world's namespace.
    pub fn pools(&self) -> Api<ProxyPool> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// The pools, untyped (for objects the server should refuse, and creates as `kubectl
    /// apply` sends them, with the server's defaults).
    pub fn raw_pools(&self) -> Api<DynamicObject> {
        Api::namespaced_with(
            self.client.clone(),
            &self.ns,
            &ApiResource::erase::<ProxyPool>(&()),
        )
    }

    /// Creates the pool `name` with `spec`, as `kubectl apply` would.
    pub async fn create_pool(&self, name: &str, spec: Value) {
        self.raw_pools()
            .create(&PostParams::default(), &pool_object(name, spec))
            .await
            .unwrap_or_else(|e| panic!("create ProxyPool {name}: {e}"));
    }

    /// A template of squid members labelled `geo: <geo>`, probed every 500ms.
    pub fn pool_template(&self, geo: &str, max_leases: u32) -> Value {
        let mut spec = self.managed_spec(3128);
        spec["maxLeases"] = json!(max_leases);
        json!({"metadata": {"labels": {"geo": geo}}, "spec": spec})
    }

    /// The members of pool `name` that exist, by name.
    pub async fn members(&self, name: &str) -> BTreeMap<String, Proxy> {
        self.proxies()
            .list(&ListParams::default().labels(&format!("{POOL_LABEL}={name}")))
            .await
            .expect("list members")
            .items
            .into_iter()
            .map(|p| (p.name_any(), p))
            .collect()
    }

    /// Waits (up to `deadline`) until pool `name` has exactly `count` members, all Ready and
    /// on its current template (by its status and by the members themselves); returns them.
    pub async fn wait_pool_settled(
        &self,
        name: &str,
        count: usize,
        deadline: Duration,
    ) -> BTreeMap<String, Proxy> {
        within(
            deadline,
            &format!("pool {name} settled at {count} Ready members"),
            || async {
                let pool = self.pools().get(name).await.ok()?;
                let status = pool.status.as_ref()?;
                let hash = template_hash(&pool.spec.template);
                let all = self.members(name).await;
                let current = all
                    .values()
                    .all(|p| is_ready(p) && p.labels().get(TEMPLATE_HASH_LABEL) == Some(&hash));
                (all.len() == count
                    && current
                    && status.ready_replicas == count as i32
                    && status.replicas == count as i32
                    && status.updated_replicas == count as i32)
                    .then_some(all)
            },
        )
        .await
    }
}
