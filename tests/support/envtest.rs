//! A real Kubernetes control plane for tests: etcd + kube-apiserver from `KUBEBUILDER_ASSETS`
//! (see `../shared/envtest/README.md` for the flags and what this control plane lacks).
//!
//! One control plane per test process ([`ControlPlane::shared`]), started on first use and
//! shared by its tests, each in its own namespace ([`ControlPlane::new_namespace`]); tests that
//! need other API server flags or change cluster-wide objects name a control plane of their own
//! ([`ControlPlane::dedicated`]).
//!
//! Lifetime: the control plane lives in a static, which is never dropped. etcd and the API
//! server are therefore spawned with `PR_SET_PDEATHSIG = SIGKILL` from one thread that lives
//! for the whole process ([`spawn_tied`]), so the kernel kills them when the test process exits,
//! however it exits. Temp files: everything lives under one root,
//! `$TMPDIR/proxy-operator-envtest-<pid>-*`; it cannot be removed at exit (no destructor runs),
//! so each start removes the roots whose owner pid is dead. The last run's root therefore stays
//! until the next run.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::discovery::Scope;
use serde_json::{Value, json};

use super::free_port;

/// How long the API server may take to answer `/readyz` 200 (2.5–3.5 s is usual on 2 idle
/// cores; much longer while other test binaries compile or run).
const START_DEADLINE: Duration = Duration::from_secs(60);
/// Deadline for the API to reach a state (CRD established, RBAC visible to the authorizer).
const API_DEADLINE: Duration = Duration::from_secs(60);
/// Prefix of every control plane's temp root (stale ones are removed by the next start).
const ROOT_PREFIX: &str = "proxy-operator-envtest-";
/// Field manager of every server-side apply made by the harness.
const FIELD_MANAGER: &str = "envtest-harness";

/// How to get the binaries, printed when `KUBEBUILDER_ASSETS` is unset.
const HOW_TO: &str = "To run the tests that need a real kube-apiserver, point KUBEBUILDER_ASSETS \
at a folder holding kube-apiserver and etcd 1.28.x: `setup-envtest use 1.28.x -p path` prints \
one (go install sigs.k8s.io/controller-runtime/tools/setup-envtest@latest), then \
`export KUBEBUILDER_ASSETS=<that folder>`; in this repository's checkout: \
`export KUBEBUILDER_ASSETS=$PWD/../shared/envtest/bin`.";

/// The API server flags that differ per start are added by [`start`]; these are fixed.
const APISERVER_FIXED_FLAGS: &[&str] = &[
    "--bind-address=127.0.0.1",
    "--advertise-address=127.0.0.1",
    "--authorization-mode=RBAC",
    "--anonymous-auth=false",
    "--service-account-issuer=https://kubernetes.default.svc",
    "--service-cluster-ip-range=10.0.0.0/24",
    "--endpoint-reconciler-type=none",
];

/// A running etcd + kube-apiserver. Get it with [`ControlPlane::shared`].
pub struct ControlPlane {
    root: PathBuf,
    url: String,
    ca_path: PathBuf,
    ca_der: Vec<Vec<u8>>,
    admin_token: String,
    extra_args: Vec<String>,
    startup: Duration,
    /// The CRD text last applied and seen served (tests share the CRD; re-applying the same
    /// text is skipped).
    crd: tokio::sync::Mutex<Option<String>>,
    /// The ProxyPool CRD text applied, if any.
    pool_crd: tokio::sync::Mutex<Option<String>>,
    /// Whether the operator's namespace, ServiceAccount and RBAC are applied and authorized.
    operator_rbac: tokio::sync::Mutex<bool>,
    /// Never waited for: the kernel kills them when the process exits (see the module doc).
    _children: Mutex<Vec<Child>>,
}

/// A control plane's start: skipped (no assets), started, or failed (remembered, so every
/// test asking for it fails fast with the same message).
enum Started {
    Skipped,
    Running(Box<ControlPlane>),
    Failed(String),
}

/// The control planes of this test process by name, each started on first use and kept (and
/// leaked: it lives as long as the process) for every later test asking for that name.
static PLANES: Mutex<BTreeMap<String, &'static OnceLock<Started>>> = Mutex::new(BTreeMap::new());

/// Name of the control plane most tests share.
const SHARED: &str = "shared";

impl ControlPlane {
    /// The control plane shared by the tests of this process, started on first use with the
    /// default flags; `None` (after printing how to get the binaries) when `KUBEBUILDER_ASSETS`
    /// is unset and `CI` is not: the caller then returns early, as skipped. Panics when `CI` is
    /// set and the binaries are missing, or when the control plane does not start.
    pub fn shared() -> Option<&'static ControlPlane> {
        ControlPlane::dedicated(SHARED, &[])
    }

    /// A control plane of its own for the tests that name it, beside the shared one: for tests
    /// that need other kube-apiserver flags, appended to the defaults (e.g.
    /// `--enable-admission-plugins=ServiceAccount`; any `--enable-admission-plugins` or
    /// `--disable-admission-plugins` drops the default `--disable-admission-plugins=ServiceAccount`),
    /// or that change what is cluster-wide (the CRD). Every test naming it gets the same
    /// control plane; asking for it with other flags panics, because that test would silently
    /// run against flags it did not ask for. Skips and fails like [`ControlPlane::shared`].
    pub fn dedicated(name: &str, extra_apiserver_args: &[&str]) -> Option<&'static ControlPlane> {
        let cell: &'static OnceLock<Started> = PLANES
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(name.to_owned())
            .or_insert_with(|| Box::leak(Box::new(OnceLock::new())));
        let started = cell.get_or_init(|| {
            let Some(assets) = std::env::var_os("KUBEBUILDER_ASSETS").filter(|a| !a.is_empty())
            else {
                return Started::Skipped;
            };
            let assets = PathBuf::from(assets);
            let extra: Vec<String> = extra_apiserver_args
                .iter()
                .map(|a| (*a).to_owned())
                .collect();
            // Started on a plain thread: the caller is usually inside a tokio runtime, where
            // the readiness poll could not block on a runtime of its own.
            let started = std::thread::Builder::new()
                .name(format!("envtest-start-{name}"))
                .spawn(move || start(&assets, extra))
                .expect("spawn the envtest start-up thread")
                .join();
            match started {
                Ok(Ok(plane)) => Started::Running(Box::new(plane)),
                Ok(Err(message)) => Started::Failed(message),
                Err(panic) => Started::Failed(panic_message(&panic)),
            }
        });
        match started {
            Started::Skipped => {
                super::skip::skip(format!(
                    "KUBEBUILDER_ASSETS is not set, so there is no control plane. {HOW_TO}"
                ));
                None
            }
            Started::Failed(message) => {
                panic!("the envtest control plane {name:?} did not start: {message}")
            }
            Started::Running(plane) => {
                let asked: Vec<&str> = extra_apiserver_args.to_vec();
                let running: Vec<&str> = plane.extra_args.iter().map(String::as_str).collect();
                assert_eq!(
                    asked, running,
                    "the control plane {name:?} was started with other extra kube-apiserver \
                     flags; every test naming it must ask for the same flags"
                );
                Some(plane)
            }
        }
    }

    /// `https://127.0.0.1:<port>` (the serving certificate has no `localhost` name).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The PEM file to trust: the API server's self-generated serving certificate and its CA.
    pub fn ca_path(&self) -> &Path {
        &self.ca_path
    }

    /// The static token of `admin` (group `system:masters`).
    pub fn admin_token(&self) -> &str {
        &self.admin_token
    }

    /// This control plane's temp root (logs: `etcd.log`, `apiserver.log`).
    pub fn dir(&self) -> &Path {
        &self.root
    }

    /// The process IDs of etcd and kube-apiserver, for a bench that reports the CPU time
    /// they spend.
    pub fn process_ids(&self) -> Vec<u32> {
        self._children
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(Child::id)
            .collect()
    }

    /// How long etcd + kube-apiserver took to become ready.
    pub fn startup_time(&self) -> Duration {
        self.startup
    }

    /// A new client authenticated as `admin`. Never cache one across tests: a kube client
    /// spawns tasks on the runtime it is created in, and each `#[tokio::test]` has its own.
    pub fn admin_client(&self) -> kube::Client {
        self.client_with_token(&self.admin_token)
    }

    /// A new client authenticated by a bearer `token` (e.g. a ServiceAccount token).
    pub fn client_with_token(&self, token: &str) -> kube::Client {
        let mut config = kube::Config::new(self.url.parse().expect("control plane URL"));
        config.root_cert = Some(self.ca_der.clone());
        config.auth_info.token = Some(token.to_owned().into());
        kube::Client::try_from(config).expect("build a kube client for the control plane")
    }

    /// Writes a kubeconfig for `admin` (for spawned processes).
    pub fn write_admin_kubeconfig(&self, path: &Path) {
        self.write_kubeconfig(path, &self.admin_token);
    }

    /// Writes a kubeconfig that trusts [`ControlPlane::ca_path`] and authenticates with `token`.
    pub fn write_kubeconfig(&self, path: &Path, token: &str) {
        let config = json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "envtest", "cluster": {
                "server": self.url,
                "certificate-authority": self.ca_path,
            }}],
            "users": [{"name": "envtest-user", "user": {"token": token}}],
            "contexts": [{"name": "envtest", "context": {
                "cluster": "envtest", "user": "envtest-user", "namespace": "default",
            }}],
            "current-context": "envtest",
        });
        // JSON is YAML; every kubeconfig loader reads it.
        let text = serde_json::to_string_pretty(&config).expect("serialize kubeconfig");
        std::fs::write(path, text)
            .unwrap_or_else(|e| panic!("write kubeconfig {}: {e}", path.display()));
    }

    /// Creates a namespace named `<prefix>-<random>` and its `default` ServiceAccount (what
    /// kube-controller-manager would add; Pods need it when ServiceAccount admission is on).
    /// Namespaces never finish deleting here (no namespace controller), so tests leave them.
    pub async fn new_namespace(&self, prefix: &str) -> String {
        let client = self.admin_client();
        let mut clean: String = prefix
            .to_ascii_lowercase()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        clean.truncate(40);
        let clean = clean.trim_matches('-');
        let clean = if clean.is_empty() { "test" } else { clean };
        let suffix = uuid::Uuid::new_v4().simple().to_string();
        let name = format!("{clean}-{}", &suffix[..10]);
        let namespace = Namespace {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &namespace)
            .await
            .unwrap_or_else(|e| panic!("create namespace {name}: {e}"));
        let account = ServiceAccount {
            metadata: ObjectMeta {
                name: Some("default".to_owned()),
                ..ObjectMeta::default()
            },
            ..ServiceAccount::default()
        };
        Api::<ServiceAccount>::namespaced(client, &name)
            .create(&PostParams::default(), &account)
            .await
            .unwrap_or_else(|e| panic!("create ServiceAccount {name}/default: {e}"));
        name
    }

    /// Applies `crd/proxy.yaml` and `crd/proxypool.yaml` and waits until both are served.
    /// Cheap when those texts are already applied.
    pub async fn apply_crd(&self) {
        let read = |file: &str| {
            let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
            std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
        };
        self.apply_crd_yaml(&read("crd/proxy.yaml")).await;
        self.apply_crd_in(&self.pool_crd, &read("crd/proxypool.yaml"))
            .await;
    }

    /// Server-side applies the Proxy CustomResourceDefinition `yaml` and waits until it is
    /// Established, its names are accepted and every served version answers a list. For tests
    /// that swap the CRD (run those on a [`ControlPlane::dedicated`] one: the CRD is
    /// cluster-wide).
    pub async fn apply_crd_yaml(&self, yaml: &str) {
        self.apply_crd_in(&self.crd, yaml).await;
    }

    /// Applies one CRD, remembering its text in `slot`.
    async fn apply_crd_in(&self, slot: &tokio::sync::Mutex<Option<String>>, yaml: &str) {
        let mut applied = slot.lock().await;
        if applied.as_deref() == Some(yaml) {
            return;
        }
        let client = self.admin_client();
        let document = parse_yaml_documents(yaml)
            .into_iter()
            .next()
            .unwrap_or_else(|| panic!("the CRD YAML has no document: {yaml:?}"));
        let crd: CustomResourceDefinition = serde_json::from_value(document)
            .unwrap_or_else(|e| panic!("the CRD YAML is not a CustomResourceDefinition: {e}"));
        let name = crd.metadata.name.clone().expect("the CRD has a name");
        let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
        crds.patch(&name, &apply_params(), &Patch::Apply(&crd))
            .await
            .unwrap_or_else(|e| panic!("apply CRD {name}: {e}"));
        let deadline = Instant::now() + API_DEADLINE;
        loop {
            let current = crds
                .get(&name)
                .await
                .unwrap_or_else(|e| panic!("read CRD {name}: {e}"));
            if crd_is_served(&client, &current).await {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "CRD {name} not Established and served after {API_DEADLINE:?}; status: {:?}",
                current.status
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        *applied = Some(yaml.to_owned());
    }

    /// Server-side applies every document of a multi-document manifest as `admin` (kinds are
    /// resolved through discovery, so any served kind works).
    pub async fn apply_yaml(&self, yaml: &str) {
        let client = self.admin_client();
        for document in parse_yaml_documents(yaml) {
            apply_document(&client, document).await;
        }
    }

    /// A ServiceAccount token (1 h) of the operator's identity: the ServiceAccount of
    /// `manifests/serviceaccount.yaml` (`proxy-operator/proxy-operator`), bound by exactly the
    /// objects of `manifests/rbac.yaml` and nothing else, so RBAC is the server's verdict.
    /// The manifests are applied once per control plane.
    pub async fn operator_token(&self) -> String {
        let (namespace, name) = self.ensure_operator_identity().await;
        let accounts: Api<ServiceAccount> = Api::namespaced(self.admin_client(), &namespace);
        let request = TokenRequest {
            spec: Some(TokenRequestSpec {
                expiration_seconds: Some(3600),
                ..TokenRequestSpec::default()
            }),
            ..TokenRequest::default()
        };
        let response = accounts
            .create_token_request(&name, &PostParams::default(), &request)
            .await
            .unwrap_or_else(|e| panic!("TokenRequest for {namespace}/{name}: {e}"));
        response
            .status
            .and_then(|s| s.token)
            .filter(|t| !t.is_empty())
            .unwrap_or_else(|| panic!("TokenRequest for {namespace}/{name} returned no token"))
    }

    /// A new client with the operator's identity (see [`ControlPlane::operator_token`]).
    pub async fn operator_client(&self) -> kube::Client {
        let token = self.operator_token().await;
        self.client_with_token(&token)
    }

    /// Writes a kubeconfig with the operator's identity at `path` (see
    /// [`ControlPlane::operator_token`]) and returns its token.
    pub async fn operator_kubeconfig(&self, path: &Path) -> String {
        let token = self.operator_token().await;
        self.write_kubeconfig(path, &token);
        token
    }

    /// Applies the operator's namespace, ServiceAccount and RBAC manifests (once) and waits
    /// until the authorizer grants every rule in them; returns the ServiceAccount's
    /// (namespace, name).
    async fn ensure_operator_identity(&self) -> (String, String) {
        let manifests = Path::new(env!("CARGO_MANIFEST_DIR")).join("manifests");
        let read = |file: &str| {
            let path = manifests.join(file);
            std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
        };
        let mut documents = Vec::new();
        for file in ["namespace.yaml", "serviceaccount.yaml", "rbac.yaml"] {
            documents.extend(parse_yaml_documents(&read(file)));
        }
        let account = documents
            .iter()
            .find(|d| d["kind"] == "ServiceAccount")
            .expect("manifests/serviceaccount.yaml defines the operator's ServiceAccount");
        let namespace = account["metadata"]["namespace"]
            .as_str()
            .expect("the operator's ServiceAccount has a namespace")
            .to_owned();
        let name = account["metadata"]["name"]
            .as_str()
            .expect("the operator's ServiceAccount has a name")
            .to_owned();
        let mut done = self.operator_rbac.lock().await;
        if *done {
            return (namespace, name);
        }
        let client = self.admin_client();
        for document in &documents {
            apply_document(&client, document.clone()).await;
        }
        let user = format!("system:serviceaccount:{namespace}:{name}");
        let groups = vec![
            "system:serviceaccounts".to_owned(),
            format!("system:serviceaccounts:{namespace}"),
            "system:authenticated".to_owned(),
        ];
        for document in &documents {
            let role_namespace = match document["kind"].as_str() {
                Some("ClusterRole") => None,
                Some("Role") => document["metadata"]["namespace"].as_str(),
                _ => continue,
            };
            for attributes in rule_attributes(document, role_namespace) {
                wait_authorized(&client, &user, &groups, attributes).await;
            }
        }
        *done = true;
        (namespace, name)
    }
}

/// Applies one manifest document with server-side apply, resolving its kind by discovery.
async fn apply_document(client: &kube::Client, document: Value) {
    let api_version = document["apiVersion"].as_str().unwrap_or_default();
    let kind = document["kind"].as_str().unwrap_or_default();
    let name = document["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        !api_version.is_empty() && !kind.is_empty() && !name.is_empty(),
        "a manifest document lacks apiVersion, kind or metadata.name: {document}"
    );
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let gvk = GroupVersionKind::gvk(group, version, kind);
    let (resource, capabilities) = kube::discovery::pinned_kind(client, &gvk)
        .await
        .unwrap_or_else(|e| panic!("discover {api_version} {kind}: {e}"));
    let api: Api<DynamicObject> = match (
        &capabilities.scope,
        document["metadata"]["namespace"].as_str(),
    ) {
        (Scope::Namespaced, Some(namespace)) => {
            Api::namespaced_with(client.clone(), namespace, &resource)
        }
        (Scope::Namespaced, None) => Api::default_namespaced_with(client.clone(), &resource),
        (Scope::Cluster, _) => Api::all_with(client.clone(), &resource),
    };
    api.patch(&name, &apply_params(), &Patch::Apply(&document))
        .await
        .unwrap_or_else(|e| panic!("apply {kind} {name}: {e}"));
}

fn apply_params() -> PatchParams {
    PatchParams::apply(FIELD_MANAGER).force()
}

/// Every document of a multi-document YAML text, as JSON values (empty documents skipped).
pub fn parse_yaml_documents(yaml: &str) -> Vec<Value> {
    let documents: Vec<Value> = serde_saphyr::from_multiple(yaml)
        .unwrap_or_else(|e| panic!("parse YAML documents: {e}\n{yaml}"));
    documents.into_iter().filter(|d| !d.is_null()).collect()
}

/// Established, names accepted, and a list of every served version succeeds.
async fn crd_is_served(client: &kube::Client, crd: &CustomResourceDefinition) -> bool {
    let conditions = crd
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .cloned()
        .unwrap_or_default();
    let is_true = |kind: &str| {
        conditions
            .iter()
            .any(|c| c.type_ == kind && c.status == "True")
    };
    if !is_true("Established") || !is_true("NamesAccepted") {
        return false;
    }
    let names = &crd.spec.names;
    for version in crd.spec.versions.iter().filter(|v| v.served) {
        let resource = ApiResource {
            group: crd.spec.group.clone(),
            version: version.name.clone(),
            api_version: format!("{}/{}", crd.spec.group, version.name),
            kind: names.kind.clone(),
            plural: names.plural.clone(),
        };
        let api: Api<DynamicObject> = if crd.spec.scope == "Namespaced" {
            Api::namespaced_with(client.clone(), "default", &resource)
        } else {
            Api::all_with(client.clone(), &resource)
        };
        if api.list(&ListParams::default().limit(1)).await.is_err() {
            return false;
        }
    }
    true
}

/// One access check per (group, resource, verb) of a Role/ClusterRole document's rules.
fn rule_attributes(role: &Value, namespace: Option<&str>) -> Vec<ResourceAttributes> {
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut attributes = Vec::new();
    for rule in role["rules"].as_array().into_iter().flatten() {
        for group in strings(&rule["apiGroups"]) {
            for resource in strings(&rule["resources"]) {
                let (resource, subresource) = match resource.split_once('/') {
                    Some((r, s)) => (r.to_owned(), Some(s.to_owned())),
                    None => (resource.clone(), None),
                };
                for verb in strings(&rule["verbs"]) {
                    attributes.push(ResourceAttributes {
                        group: Some(group.clone()),
                        resource: Some(resource.clone()),
                        subresource: subresource.clone(),
                        verb: Some(verb),
                        namespace: namespace.map(str::to_owned),
                        ..ResourceAttributes::default()
                    });
                }
            }
        }
    }
    attributes
}

/// Waits until the authorizer grants `attributes` to `user` (RBAC objects reach the
/// authorizer's cache through a watch, a few milliseconds after they are written).
async fn wait_authorized(
    client: &kube::Client,
    user: &str,
    groups: &[String],
    attributes: ResourceAttributes,
) {
    let reviews: Api<SubjectAccessReview> = Api::all(client.clone());
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(user.to_owned()),
            groups: Some(groups.to_vec()),
            resource_attributes: Some(attributes.clone()),
            ..SubjectAccessReviewSpec::default()
        },
        ..SubjectAccessReview::default()
    };
    let deadline = Instant::now() + API_DEADLINE;
    loop {
        let answer = reviews
            .create(&PostParams::default(), &review)
            .await
            .unwrap_or_else(|e| panic!("SubjectAccessReview: {e}"));
        if answer.status.as_ref().is_some_and(|s| s.allowed) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{user} is still not allowed {attributes:?} after {API_DEADLINE:?}: {:?}",
            answer.status
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Processes tied to the test process.

type SpawnJob = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Spawns `command` so that the kernel SIGKILLs it when this test process exits.
///
/// `PR_SET_PDEATHSIG` fires when the *thread* that forked the child exits, not the process, so
/// every such child is forked by one thread that lives as long as the process. The kernel clears
/// the setting when the child changes its user (squid started as root dropping to `proxy`), so
/// start such a program as its final user (`Command::uid`; the test kubelet does).
pub fn spawn_tied(command: Command) -> std::io::Result<Child> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnJob>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (jobs, receive) = mpsc::channel::<SpawnJob>();
        std::thread::Builder::new()
            .name("envtest-spawner".to_owned())
            .spawn(move || {
                // The sender lives in a static, so this loop (and the thread) ends only with
                // the process.
                while let Ok((mut command, reply)) = receive.recv() {
                    let parent = std::process::id();
                    // SAFETY: only async-signal-safe calls between fork and exec.
                    unsafe {
                        command.pre_exec(move || {
                            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                                return Err(std::io::Error::last_os_error());
                            }
                            // The parent died before prctl took effect: go too.
                            if libc::getppid() as u32 != parent {
                                libc::_exit(1);
                            }
                            Ok(())
                        });
                    }
                    let _ = reply.send(command.spawn());
                }
            })
            .expect("spawn the envtest spawner thread");
        Mutex::new(jobs)
    });
    let (reply, answer) = mpsc::channel();
    spawner
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send((command, reply))
        .expect("the envtest spawner thread is alive");
    answer.recv().expect("the envtest spawner thread answers")
}

// ---------------------------------------------------------------------------------------------
// Start-up.

fn start(assets: &Path, extra_args: Vec<String>) -> Result<ControlPlane, String> {
    let started = Instant::now();
    remove_stale_roots();
    let root = tempfile::Builder::new()
        .prefix(&format!("{ROOT_PREFIX}{}-", std::process::id()))
        .tempdir()
        .map_err(|e| format!("create the control plane's temp dir: {e}"))?
        .keep();
    let etcd_binary = executable(assets, "etcd", &root)?;
    let apiserver_binary = executable(assets, "kube-apiserver", &root)?;
    let mut children = Vec::new();

    let etcd_url = start_etcd(&etcd_binary, &root, &mut children)?;

    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_RSA_SHA256)
        .map_err(|e| format!("generate the service-account RSA key: {e}"))?;
    let sa_key = root.join("sa.key");
    let sa_pub = root.join("sa.pub");
    write(&sa_key, &key.serialize_pem())?;
    write(&sa_pub, &key.public_key_pem())?;
    let admin_token = uuid::Uuid::new_v4().simple().to_string();
    let tokens = root.join("tokens.csv");
    write(
        &tokens,
        &format!("{admin_token},admin,admin-uid,system:masters\n"),
    )?;
    let cert_dir = root.join("pki");
    std::fs::create_dir_all(&cert_dir)
        .map_err(|e| format!("create {}: {e}", cert_dir.display()))?;

    let override_admission = extra_args.iter().any(|a| {
        a.starts_with("--enable-admission-plugins") || a.starts_with("--disable-admission-plugins")
    });
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("build a runtime for the readiness poll: {e}"))?;
    let mut last_failure = String::new();
    // A port found free can be taken before the API server binds it: retry on a new one.
    for _ in 0..3 {
        let port = free_port();
        let mut command = Command::new(&apiserver_binary);
        command
            .arg(format!("--etcd-servers={etcd_url}"))
            .arg(format!(
                "--etcd-prefix=/envtest-{}",
                uuid::Uuid::new_v4().simple()
            ))
            .arg(format!("--secure-port={port}"))
            .arg(format!("--cert-dir={}", cert_dir.display()))
            .arg(format!("--token-auth-file={}", tokens.display()))
            .arg(format!("--service-account-key-file={}", sa_pub.display()))
            .arg(format!(
                "--service-account-signing-key-file={}",
                sa_key.display()
            ))
            .args(APISERVER_FIXED_FLAGS);
        if !override_admission {
            command.arg("--disable-admission-plugins=ServiceAccount");
        }
        command.args(&extra_args);
        let log = root.join("apiserver.log");
        let mut child = spawn_logged(command, &log)?;
        let url = format!("https://127.0.0.1:{port}");
        let ca_path = cert_dir.join("apiserver.crt");
        match runtime.block_on(wait_apiserver_ready(
            &mut child,
            &url,
            &ca_path,
            &admin_token,
        )) {
            Ok(ca_der) => {
                children.push(child);
                return Ok(ControlPlane {
                    root,
                    url,
                    ca_path,
                    ca_der,
                    admin_token,
                    extra_args,
                    startup: started.elapsed(),
                    crd: tokio::sync::Mutex::new(None),
                    pool_crd: tokio::sync::Mutex::new(None),
                    operator_rbac: tokio::sync::Mutex::new(false),
                    _children: Mutex::new(children),
                });
            }
            Err(reason) => {
                let _ = child.kill();
                let _ = child.wait();
                last_failure = format!("{reason}\n--- apiserver.log (tail) ---\n{}", tail(&log));
            }
        }
    }
    Err(format!(
        "kube-apiserver did not become ready: {last_failure}"
    ))
}

/// The binary `name` from `assets`, copied into `root` with the exec bit when it lacks it (the
/// assets folder may be read-only, and copies may lose the bit).
fn executable(assets: &Path, name: &str, root: &Path) -> Result<PathBuf, String> {
    let source = assets.join(name);
    let metadata = std::fs::metadata(&source).map_err(|e| {
        format!(
            "KUBEBUILDER_ASSETS={} has no usable {name} ({e}). {HOW_TO}",
            assets.display()
        )
    })?;
    if metadata.permissions().mode() & 0o111 == 0o111 {
        return Ok(source);
    }
    let bin = root.join("bin");
    std::fs::create_dir_all(&bin).map_err(|e| format!("create {}: {e}", bin.display()))?;
    let target = bin.join(name);
    std::fs::copy(&source, &target)
        .map_err(|e| format!("copy {} to {}: {e}", source.display(), target.display()))?;
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("chmod +x {}: {e}", target.display()))?;
    Ok(target)
}

/// Starts etcd on free loopback ports and waits for `/health`; returns its client URL.
fn start_etcd(binary: &Path, root: &Path, children: &mut Vec<Child>) -> Result<String, String> {
    let mut last_failure = String::new();
    for attempt in 0..3 {
        let client_port = free_port();
        let peer_port = free_port();
        let client_url = format!("http://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let data_dir = root.join(format!("etcd-{attempt}"));
        let mut command = Command::new(binary);
        command
            .arg(format!("--data-dir={}", data_dir.display()))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=default={peer_url}"))
            .arg("--heartbeat-interval=10")
            .arg("--election-timeout=100");
        let log = root.join("etcd.log");
        let mut child = spawn_logged(command, &log)?;
        let deadline = Instant::now() + START_DEADLINE;
        loop {
            if etcd_healthy(client_port) {
                children.push(child);
                return Ok(client_url);
            }
            if let Ok(Some(status)) = child.try_wait() {
                last_failure = format!("etcd exited ({status})");
                break;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                last_failure = format!("etcd not healthy after {START_DEADLINE:?}");
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        last_failure = format!("{last_failure}\n--- etcd.log (tail) ---\n{}", tail(&log));
    }
    Err(format!("etcd did not start: {last_failure}"))
}

/// `GET /health` answers `{"health":"true"}`.
fn etcd_healthy(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    if stream
        .write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    response.starts_with("HTTP/1.") && response.contains("\"health\":\"true\"")
}

/// Polls `/readyz` with the admin token until HTTP 200 (early 500s are not ready); returns the
/// CA bundle (DER) the API server generated.
async fn wait_apiserver_ready(
    child: &mut Child,
    url: &str,
    ca_path: &Path,
    token: &str,
) -> Result<Vec<Vec<u8>>, String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;

    let deadline = Instant::now() + START_DEADLINE;
    let mut client: Option<(kube::Client, Vec<Vec<u8>>)> = None;
    let mut last = String::from("no answer yet");
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("kube-apiserver exited ({status})"));
        }
        if Instant::now() > deadline {
            return Err(format!(
                "/readyz not 200 after {START_DEADLINE:?}; last answer: {last}"
            ));
        }
        if client.is_none() {
            // The certificate is written shortly before the server listens.
            let certs: Vec<Vec<u8>> = CertificateDer::pem_file_iter(ca_path)
                .map(|iter| iter.filter_map(Result::ok).map(|c| c.to_vec()).collect())
                .unwrap_or_default();
            if !certs.is_empty() {
                let mut config = kube::Config::new(url.parse().expect("API server URL"));
                config.root_cert = Some(certs.clone());
                config.auth_info.token = Some(token.to_owned().into());
                config.connect_timeout = Some(Duration::from_secs(2));
                config.read_timeout = Some(Duration::from_secs(5));
                let built = kube::Client::try_from(config)
                    .map_err(|e| format!("build the readiness client: {e}"))?;
                client = Some((built, certs));
            }
        }
        if let Some((client, certs)) = &client {
            let request = http::Request::get("/readyz")
                .body(Vec::new())
                .expect("readyz request");
            match client.request_text(request).await {
                Ok(_) => return Ok(certs.clone()),
                Err(e) => last = e.to_string(),
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn spawn_logged(mut command: Command, log: &Path) -> Result<Child, String> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| format!("open {}: {e}", log.display()))?;
    let stderr = file
        .try_clone()
        .map_err(|e| format!("clone {}: {e}", log.display()))?;
    command.stdin(Stdio::null()).stdout(file).stderr(stderr);
    let program = command.get_program().to_owned();
    spawn_tied(command).map_err(|e| format!("spawn {}: {e}", Path::new(&program).display()))
}

fn write(path: &Path, text: &str) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| format!("write {}: {e}", path.display()))
}

/// The last 40 lines of a log file.
fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// Removes `proxy-operator-envtest-<pid>-*` roots whose process is gone (best effort).
fn remove_stale_roots() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    let mut stale = BTreeSet::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(ROOT_PREFIX) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            stale.insert(entry.path());
        }
    }
    for path in stale {
        let _ = std::fs::remove_dir_all(path);
    }
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "the start-up thread panicked".to_owned())
}
