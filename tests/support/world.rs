//! One envtest test's world: its own namespace on a shared control plane, a test kubelet, a
//! probe target and helpers to create Proxies and wait on what the operator does with them.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use proxy_operator::provider::CreateRequest;
use proxy_operator::provider::kubernetes::build_pod;
use proxy_operator::resources::naming::machine_name;
use proxy_operator::resources::proxy::Proxy;
use serde_json::{Value, json};

use super::envtest::ControlPlane;
use super::kubelet::Kubelet;
use super::operator::OperatorProcess;
use super::{Squid, Target};

/// Deadline for anything that waits on the operator, the API server and real squids.
pub const SLOW: Duration = Duration::from_secs(90);

/// One test's world: its own namespace, kubelet, probe target and operator identity.
pub struct World {
    pub cp: &'static ControlPlane,
    pub ns: String,
    pub client: Client,
    pub dir: tempfile::TempDir,
    pub target: Target,
    pub kubelet: Kubelet,
}

impl World {
    /// A fresh namespace on the shared control plane, or `None` when there is none (skipped).
    pub async fn new(prefix: &str) -> Option<World> {
        Some(World::on(ControlPlane::shared()?, prefix).await)
    }

    /// A fresh namespace on `cp` (a control plane started with its own flags).
    pub async fn on(cp: &'static ControlPlane, prefix: &str) -> World {
        cp.apply_crd().await;
        let ns = cp.new_namespace(prefix).await;
        let client = cp.admin_client();
        let kubelet = Kubelet::start(cp.admin_client(), Some(&ns));
        World {
            cp,
            ns,
            client,
            dir: tempfile::tempdir().expect("temp dir"),
            target: Target::start(),
            kubelet,
        }
    }

    /// Starts `proxy-operator run` for this namespace (its own install ID and Lease) and waits
    /// until it is ready.
    pub async fn operator(&self, extra_args: &[&str]) -> OperatorProcess {
        OperatorProcess::start_ready(
            self.cp,
            self.dir.path(),
            &self.target,
            &self.ns,
            Some(&self.ns),
            extra_args,
        )
        .await
    }

    pub fn proxies(&self) -> Api<Proxy> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    pub fn raw_proxies(&self) -> Api<DynamicObject> {
        Api::namespaced_with(
            self.client.clone(),
            &self.ns,
            &ApiResource::erase::<Proxy>(&()),
        )
    }

    pub fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// Creates a Proxy from its JSON `spec` (plus labels), as `kubectl apply` would.
    pub async fn create(&self, name: &str, spec: Value) -> Result<DynamicObject, kube::Error> {
        let object: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "crawl.example.com/v1alpha1",
            "kind": "Proxy",
            "metadata": {"name": name, "labels": {"pool": "envtest"}},
            "spec": spec,
        }))
        .expect("a Proxy object");
        self.raw_proxies()
            .create(&PostParams::default(), &object)
            .await
    }

    /// A health check that probes this world's HTTPS target every `interval` (also its
    /// timeout: a loopback probe takes milliseconds).
    pub fn health_check(&self, interval: &str) -> Value {
        json!({
            "probeURL": self.target.https_url(),
            "interval": interval,
            "timeout": interval,
            "failureThreshold": 2,
        })
    }

    pub fn external_spec(&self, squid: &Squid, interval: &str) -> Value {
        json!({
            "mode": "External",
            "endpoint": {"host": "127.0.0.1", "port": squid.port()},
            "healthCheck": self.health_check(interval),
        })
    }

    pub fn managed_spec(&self, port: u16) -> Value {
        json!({
            "mode": "Managed",
            "provider": "local",
            "port": port,
            "healthCheck": self.health_check("500ms"),
        })
    }

    /// Waits until the Proxy's status satisfies `check`, returning the object.
    pub async fn wait_proxy(
        &self,
        name: &str,
        what: &str,
        check: impl Fn(&Value) -> bool,
    ) -> Value {
        let api = self.raw_proxies();
        eventually(what, || async {
            let object = api.get_opt(name).await.ok()??;
            let value = serde_json::to_value(&object).ok()?;
            check(&value["status"]).then_some(value)
        })
        .await
    }

    pub async fn wait_ready(&self, name: &str) -> Value {
        self.wait_proxy(name, &format!("Proxy {name} Ready with an IP"), |s| {
            s["phase"] == "Ready" && s["ip"].as_str().is_some_and(|ip| !ip.is_empty())
        })
        .await
    }

    /// The machine Pod of a Proxy, if it exists.
    pub async fn pod_of(&self, proxy: &Value) -> Option<Pod> {
        let uid = proxy["metadata"]["uid"].as_str()?;
        self.pods().get_opt(&machine_name(uid)).await.ok()?
    }

    /// The Pod the operator would make for the Proxy `proxy_name` with UID `uid` (default port
    /// and image; the install ID of these tests' operators is the namespace name).
    pub fn machine_pod(&self, proxy_name: &str, uid: &str) -> Pod {
        build_pod(
            &CreateRequest {
                namespace: self.ns.clone(),
                proxy_name: proxy_name.to_owned(),
                proxy_uid: uid.to_owned(),
                machine_name: machine_name(uid),
                port: 3128,
                placement: None,
                cloud_init: None,
                labels: BTreeMap::new(),
                credentials: None,
            },
            "ubuntu/squid",
            &self.ns,
        )
    }

    /// Creates a Proxy labelled `pool: <pool>` (so each proxy of a test can have a selector of
    /// its own) with `annotations` (none when empty); returns its UID.
    pub async fn create_in_pool(
        &self,
        name: &str,
        pool: &str,
        annotations: &[(&str, &str)],
        spec: Value,
    ) -> String {
        let mut metadata = json!({"name": name, "labels": {"pool": pool}});
        if !annotations.is_empty() {
            let annotations: serde_json::Map<String, Value> = annotations
                .iter()
                .map(|(k, v)| ((*k).to_owned(), json!(v)))
                .collect();
            metadata["annotations"] = Value::Object(annotations);
        }
        let object = serde_json::from_value(json!({
            "apiVersion": "crawl.example.com/v1alpha1",
            "kind": "Proxy",
            "metadata": metadata,
            "spec": spec,
        }))
        .expect("a Proxy object");
        let created = self
            .raw_proxies()
            .create(&PostParams::default(), &object)
            .await
            .unwrap_or_else(|e| panic!("create Proxy {name}: {e}"));
        created.metadata.uid.expect("the server sets a UID")
    }

    /// Writes the admin kubeconfig (for `kubectl`) into the world's directory; returns its path.
    pub fn admin_kubeconfig(&self) -> PathBuf {
        let path = self.dir.path().join("admin.kubeconfig");
        self.cp.write_admin_kubeconfig(&path);
        path
    }

    /// Runs `kubectl` with `kubeconfig` in the world's namespace, asserting it succeeds; returns
    /// its output, or `None` when kubectl is not installed.
    pub fn kubectl(&self, kubeconfig: &Path, args: &[&str]) -> Option<String> {
        let output = match Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(["-n", &self.ns])
            .args(args)
            .output()
        {
            Ok(output) => output,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => panic!("run kubectl: {e}"),
        };
        assert!(
            output.status.success(),
            "kubectl {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        Some(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// `kubectl patch px <name> --type merge -p <patch>` (through the client without kubectl).
    pub async fn patch_proxy(&self, kubeconfig: &Path, name: &str, patch: &Value) {
        let text = patch.to_string();
        let args = ["patch", "px", name, "--type", "merge", "-p", text.as_str()];
        if self.kubectl(kubeconfig, &args).is_none() {
            self.raw_proxies()
                .patch(name, &PatchParams::default(), &Patch::Merge(patch))
                .await
                .unwrap_or_else(|e| panic!("patch Proxy {name} with {patch}: {e}"));
        }
    }

    /// Waits (up to `deadline`) until the Proxy `name` is Ready on a Pod other than `old_uid`,
    /// with the IP the kubelet published for that Pod; returns the Proxy and the new Pod.
    pub async fn wait_ready_on_new_pod(
        &self,
        name: &str,
        old_uid: &str,
        deadline: Duration,
    ) -> (Value, Pod) {
        let api = self.raw_proxies();
        within(
            deadline,
            &format!("Proxy {name} Ready again on a Pod other than {old_uid}"),
            || async {
                let object = api.get_opt(name).await.ok()??;
                let proxy = serde_json::to_value(&object).ok()?;
                let status = &proxy["status"];
                if status["phase"] != "Ready" {
                    return None;
                }
                let pod = self.pod_of(&proxy).await?;
                if pod.metadata.uid.as_deref() == Some(old_uid)
                    || pod.metadata.deletion_timestamp.is_some()
                {
                    return None;
                }
                let address = self.kubelet.address(&self.ns, &pod.name_any())?;
                (status["ip"] == address.to_string()).then_some((proxy, pod))
            },
        )
        .await
    }

    /// Events (events.k8s.io/v1) about the object `name`.
    pub async fn events_about(&self, name: &str) -> Vec<Event> {
        Api::<Event>::namespaced(self.client.clone(), &self.ns)
            .list(&ListParams::default())
            .await
            .expect("list Events")
            .items
            .into_iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
            .collect()
    }

    /// `(type, note)` of every Event about the object `name` with this `reason`.
    pub async fn events_with_reason(&self, name: &str, reason: &str) -> Vec<(String, String)> {
        self.events_about(name)
            .await
            .into_iter()
            .filter(|e| e.reason.as_deref() == Some(reason))
            .map(|e| (e.type_.unwrap_or_default(), e.note.unwrap_or_default()))
            .collect()
    }

    /// Events about the object `name` (events.k8s.io/v1), as `reason` values.
    pub async fn event_reasons(&self, name: &str) -> Vec<String> {
        let events: Api<Event> = Api::namespaced(self.client.clone(), &self.ns);
        let list = events
            .list(&ListParams::default())
            .await
            .expect("list events");
        list.items
            .iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
            .filter_map(|e| e.reason.clone())
            .collect()
    }
}

/// Creates `count` Proxies named `px-0000`, `px-0001`, ... labelled `pool: <pool>` through `api`,
/// `concurrency` requests at a time, the `i`-th with `spec(i)`.
pub async fn create_numbered(
    api: &Api<DynamicObject>,
    count: usize,
    pool: &str,
    concurrency: usize,
    spec: impl Fn(usize) -> Value,
) {
    futures::stream::iter(0..count)
        .map(|i| {
            let object: DynamicObject = serde_json::from_value(json!({
                "apiVersion": "crawl.example.com/v1alpha1",
                "kind": "Proxy",
                "metadata": {"name": format!("px-{i:04}"), "labels": {"pool": pool}},
                "spec": spec(i),
            }))
            .expect("a Proxy object");
            async move { api.create(&PostParams::default(), &object).await }
        })
        .buffer_unordered(concurrency)
        .try_collect::<Vec<_>>()
        .await
        .expect("create the Proxies");
}

/// Polls `probe` until it yields a value, panicking with `what` after [`SLOW`].
pub async fn eventually<T, F, Fut>(what: &str, probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    within(SLOW, what, probe).await
}

/// Polls `probe` every 100 ms until it yields a value, panicking with `what` after `deadline`.
pub async fn within<T, F, Fut>(deadline: Duration, what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(
            start.elapsed() < deadline,
            "timed out after {deadline:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the object `name` no longer exists.
pub async fn wait_gone<K>(api: &Api<K>, name: &str)
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    K::DynamicType: Default,
{
    let what = format!("{} {name} to be gone", K::kind(&Default::default()));
    eventually(&what, || async {
        api.get_opt(name)
            .await
            .ok()
            .and_then(|o| o.is_none().then_some(()))
    })
    .await;
}

/// The `reason` of a failed API call (the server's verdict), or a panic if it succeeded.
pub fn refusal(result: Result<DynamicObject, kube::Error>) -> String {
    match result {
        Err(kube::Error::Api(status)) => status.message,
        Err(e) => panic!("not an API refusal: {e}"),
        Ok(o) => panic!(
            "accepted: {}",
            serde_json::to_string(&o).unwrap_or_default()
        ),
    }
}
