//! The install as shipped: the objects of `kubectl kustomize manifests/` (after docs/install.md's
//! token step) applied server-side with kubectl to a control plane of their own, and the
//! Deployment's own Pod run by the test kubelet (`tests/support/pod.rs`): in-cluster config
//! from the ServiceAccount token, uid 65532 with fsGroup, a 0440 token Secret, a read-only
//! root, the ConfigMap and Secret as the kubelet projects them, the probes as written.
//!
//! Through that Pod: it becomes Ready; a Proxy of `samples/` (kubernetes provider, probing a
//! loopback target) and an External one reach Ready; a lease through the Pod's address; the
//! token rotated the way docs/install.md says reaches the process without a restart; a
//! Recreate rollout (SIGTERM within the grace period, a new Pod on the same claim) keeps the
//! lease.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::support::operator::{LOOPBACK_EGRESS, LOOPBACK_PROVIDERS};
use crate::support::pod::{PodHost, RunningPod, exited_cleanly};
use crate::support::render::{Manifests, repo, run, tool};
use crate::support::world::within;
use crate::support::{ControlPlane, Kubelet, Squid, Target};

pub(super) const NAMESPACE: &str = "proxy-operator";
pub(super) const DEPLOYMENT: &str = "proxy-operator";
/// The Pod's start: a debug binary, the in-cluster client, the Proxy watch's first sync and a
/// readiness probe every 5 s, on a loaded machine.
pub(super) const POD_READY: Duration = Duration::from_secs(120);
/// A Proxy's first Ready under the shipped (not shortened) poll intervals.
const PROXY_READY: Duration = Duration::from_secs(120);
/// The API's port in the Deployment (`http-api`) and docs/install.md.
pub(super) const API_PORT: u16 = 8090;

/// A random token, as `openssl rand -hex 32` makes one.
pub(super) fn new_token() -> String {
    uuid::Uuid::new_v4().simple().to_string() + &uuid::Uuid::new_v4().simple().to_string()
}

/// `kubectl --kubeconfig <admin> <args>`, asserting success; returns stdout.
pub(super) fn kubectl(kubeconfig: &Path, args: &[&str]) -> String {
    let kubectl = tool("kubectl").expect("kubectl was found before");
    run(Command::new(kubectl)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args))
}

/// An install as a user makes it, on one control plane.
struct Install {
    kubeconfig: PathBuf,
    how: How,
    /// The API's tokens, one a line in the token Secret.
    tokens: Vec<String>,
    /// The install's own files (kubeconfig, Helm's providers config).
    dir: tempfile::TempDir,
}

/// Which of the installs of docs/install.md.
enum How {
    /// `kubectl apply --server-side -k` of a copy of `manifests/` with its token file.
    Kustomize(Manifests),
    /// `helm install` of `charts/proxy-operator/`, which generates the token Secret.
    Helm,
}

impl Install {
    /// The kind install's steps 2 and 3: the token file, then `kubectl apply --server-side -k`;
    /// its providers config opening loopback to the squids (the probe target is on loopback).
    fn kustomize(plane: &'static ControlPlane) -> Option<Install> {
        Install::kustomize_edited(plane, |dir| {
            let path = dir.join("configmap.yaml");
            let text = std::fs::read_to_string(&path).expect("read configmap.yaml");
            let key = "  providers.yaml: |\n";
            assert!(text.contains(key), "configmap.yaml holds {key:?}");
            let egress: String = LOOPBACK_EGRESS
                .lines()
                .map(|line| format!("    {line}\n"))
                .collect();
            std::fs::write(&path, text.replacen(key, &format!("{key}{egress}"), 1))
                .expect("write configmap.yaml");
        })
    }

    /// The same with the copy of `manifests/` edited first (a broken install).
    fn kustomize_edited(plane: &'static ControlPlane, edit: impl FnOnce(&Path)) -> Option<Install> {
        tool("kubectl")?;
        let token = new_token();
        let manifests = Manifests::copy(&token);
        edit(manifests.dir());
        let install = Install::new(plane, How::Kustomize(manifests), vec![token]);
        install.apply();
        Some(install)
    }

    /// "Install with Helm": `helm install … --create-namespace` (with a providers config opening
    /// loopback to the squids, the probe target being on loopback), then the generated token
    /// read back with kubectl.
    fn helm(plane: &'static ControlPlane) -> Option<Install> {
        tool("kubectl")?;
        let helm = tool("helm")?;
        let mut install = Install::new(plane, How::Helm, Vec::new());
        let chart = repo().join("charts/proxy-operator");
        let providers = install.dir.path().join("providers.yaml");
        std::fs::write(&providers, LOOPBACK_PROVIDERS).expect("write the providers config");
        run(Command::new(helm)
            .arg("install")
            .arg(DEPLOYMENT)
            .arg(&chart)
            .args(["-n", NAMESPACE, "--create-namespace", "--kubeconfig"])
            .arg(&install.kubeconfig)
            .arg("--set-file")
            .arg(format!("providersConfig={}", providers.display())));
        // Decoded by kubectl itself, as the kind quickstart test reads it.
        let decoded = kubectl(
            &install.kubeconfig,
            &[
                "-n",
                NAMESPACE,
                "get",
                "secret",
                "proxy-operator-api",
                "-o",
                "go-template={{.data.tokens | base64decode}}",
            ],
        );
        install.tokens = decoded.lines().map(str::to_owned).collect();
        assert_eq!(
            install.tokens.len(),
            1,
            "the chart generates one token: {decoded:?}"
        );
        Some(install)
    }

    fn new(plane: &'static ControlPlane, how: How, tokens: Vec<String>) -> Install {
        let dir = tempfile::tempdir().expect("a temp dir");
        let kubeconfig = dir.path().join("admin.kubeconfig");
        plane.write_admin_kubeconfig(&kubeconfig);
        Install {
            kubeconfig,
            how,
            tokens,
            dir,
        }
    }

    fn apply(&self) {
        if let How::Kustomize(manifests) = &self.how {
            let dir = manifests.dir().to_string_lossy().into_owned();
            kubectl(&self.kubeconfig, &["apply", "--server-side", "-k", &dir]);
        }
    }

    fn token(&self) -> &str {
        &self.tokens[0]
    }

    /// The rotation of docs/install.md: with kustomize the token file edited and applied again;
    /// with Helm the Secret edited with kubectl.
    fn set_tokens(&mut self, tokens: Vec<String>) {
        let text: String = tokens.iter().map(|t| format!("{t}\n")).collect();
        match &self.how {
            How::Kustomize(manifests) => {
                std::fs::write(manifests.dir().join("discovery-tokens"), text)
                    .expect("write discovery-tokens");
                self.apply();
            }
            How::Helm => {
                let patch = json!({"stringData": {"tokens": text}}).to_string();
                kubectl(
                    &self.kubeconfig,
                    &[
                        "-n",
                        NAMESPACE,
                        "patch",
                        "secret",
                        "proxy-operator-api",
                        "--type",
                        "merge",
                        "-p",
                        &patch,
                    ],
                );
            }
        }
        self.tokens = tokens;
    }
}

/// `GET /v1/proxies` on the Pod's API with `token`: the status.
async fn list_status(http: &reqwest::Client, pod: &RunningPod, token: &str) -> Option<StatusCode> {
    http.get(format!("http://{}:{API_PORT}/v1/proxies", pod.ip()))
        .bearer_auth(token)
        .send()
        .await
        .ok()
        .map(|r| r.status())
}

/// A sample Proxy (`samples/<file>`) in `namespace`, probing `target`, with `spec` merged in.
async fn apply_sample(
    plane: &'static ControlPlane,
    namespace: &str,
    file: &str,
    target: &Target,
    spec: Value,
) -> String {
    let path = repo().join("samples").join(file);
    let text = std::fs::read_to_string(&path).expect("read the sample");
    let mut proxy: Value = serde_saphyr::from_str(&text).expect("the sample parses");
    proxy["metadata"]["namespace"] = json!(namespace);
    proxy["spec"]["healthCheck"] = json!({
        "probeURL": target.http_url(),
        "interval": "1s",
        "timeout": "1s",
        "failureThreshold": 2,
    });
    for (key, value) in spec.as_object().expect("an object") {
        proxy["spec"][key] = value.clone();
    }
    let name = proxy["metadata"]["name"]
        .as_str()
        .expect("a name")
        .to_owned();
    proxies(plane, namespace)
        .patch(
            &name,
            &PatchParams::apply("install-test").force(),
            &Patch::Apply(&proxy),
        )
        .await
        .unwrap_or_else(|e| panic!("apply {file}: {e}"));
    name
}

pub(super) fn proxies(plane: &'static ControlPlane, namespace: &str) -> Api<DynamicObject> {
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(
        "crawl.example.com",
        "v1alpha1",
        "Proxy",
    ));
    Api::namespaced_with(plane.admin_client(), namespace, &resource)
}

pub(super) async fn wait_proxy_ready(
    plane: &'static ControlPlane,
    namespace: &str,
    name: &str,
    pod: &RunningPod,
) {
    let api = proxies(plane, namespace);
    let ready = tokio::time::timeout(PROXY_READY, async {
        loop {
            if let Ok(proxy) = api.get(name).await
                && proxy.data["status"]["phase"] == "Ready"
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    if ready.is_err() {
        let status = api.get(name).await.map(|p| p.data["status"].clone());
        panic!(
            "Proxy {namespace}/{name} not Ready after {PROXY_READY:?}: {status:?}\n--- operator log ---\n{}",
            pod.logs()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kustomize_install_runs_as_its_own_pod() {
    let Some(plane) = ControlPlane::dedicated("install-kustomize", &[]) else {
        return;
    };
    let Some(host) = PodHost::new(plane).await else {
        return;
    };
    if let Some(install) = Install::kustomize(plane) {
        the_install_serves(plane, &host, install).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_helm_install_runs_as_its_own_pod() {
    let Some(plane) = ControlPlane::dedicated("install-helm", &[]) else {
        return;
    };
    let Some(host) = PodHost::new(plane).await else {
        return;
    };
    if let Some(install) = Install::helm(plane) {
        the_install_serves(plane, &host, install).await;
    }
}

/// The Pod becomes Ready; Proxies reach Ready; a lease; a rotation; a Recreate keeps the lease.
async fn the_install_serves(plane: &'static ControlPlane, host: &PodHost, mut install: Install) {
    let http = crate::support::http::client();

    let pod = host.start(NAMESPACE, DEPLOYMENT).await;
    pod.wait_ready(POD_READY).await;

    // A squid Pod's Proxy (the sample's kubernetes provider) and an External one.
    let namespace = plane.new_namespace("install-proxies").await;
    let _kubelet = Kubelet::start(plane.admin_client(), Some(&namespace));
    let target = Target::start();
    let squid = Squid::start();
    let managed = apply_sample(
        plane,
        &namespace,
        "proxy_kubernetes.yaml",
        &target,
        json!({}),
    )
    .await;
    let external = apply_sample(
        plane,
        &namespace,
        "proxy_external.yaml",
        &target,
        json!({"endpoint": {"host": "127.0.0.1", "port": squid.port()}}),
    )
    .await;
    wait_proxy_ready(plane, &namespace, &managed, &pod).await;
    wait_proxy_ready(plane, &namespace, &external, &pod).await;

    // A lease through the Pod's API address.
    let api = format!("http://{}:{API_PORT}", pod.ip());
    let lease: Value = within(POD_READY, "a lease from the Pod's API", || async {
        let response = http
            .post(format!("{api}/v1/leases"))
            .bearer_auth(install.token())
            .json(&json!({"selector": {"geo": "eu"}, "target": "example.com", "ttlSeconds": 3600}))
            .send()
            .await
            .ok()?;
        (response.status() == StatusCode::CREATED)
            .then_some(response)?
            .json()
            .await
            .ok()
    })
    .await;
    let lease_id = lease["leaseID"].as_str().expect("a lease ID").to_owned();
    assert_eq!(lease["proxy"]["name"], managed.as_str(), "{lease}");

    // Rotation, the way docs/install.md says: add a token, apply; it is accepted without a
    // restart. Then remove the old one, apply; it is refused.
    let old = install.token().to_owned();
    let new = new_token();
    install.set_tokens(vec![old.clone(), new.clone()]);
    within(POD_READY, "the added token accepted", || async {
        (list_status(&http, &pod, &new).await == Some(StatusCode::OK)).then_some(())
    })
    .await;
    install.set_tokens(vec![new.clone()]);
    within(POD_READY, "the removed token refused", || async {
        (list_status(&http, &pod, &old).await == Some(StatusCode::UNAUTHORIZED)).then_some(())
    })
    .await;
    assert_eq!(pod.pids().len(), 1, "the rotation restarted the container");
    assert_eq!(pod.restarts(), 0);

    // A Recreate rollout: the Pod deleted (SIGTERM, exit within the grace period), a new Pod
    // on the same claim, the lease still active.
    kubectl(
        &install.kubeconfig,
        &["-n", NAMESPACE, "delete", "pod", &pod.name, "--wait=false"],
    );
    pod.wait_gone(Duration::from_secs(60)).await;
    let exit = *pod.exits().last().expect("the container exited");
    assert!(
        exited_cleanly(&exit)
            && exit
                .after_sigterm
                .is_some_and(|d| d < Duration::from_secs(30)),
        "SIGTERM did not end the container within its grace period: {exit:?}\n{}",
        pod.logs()
    );
    drop(pod);
    let pod = host.start(NAMESPACE, DEPLOYMENT).await;
    pod.wait_ready(POD_READY).await;
    let api = format!("http://{}:{API_PORT}", pod.ip());
    let response = http
        .get(format!("{api}/v1/leases/{lease_id}"))
        .bearer_auth(&new)
        .send()
        .await
        .expect("read the lease");
    assert_eq!(response.status(), StatusCode::OK);
    let read: Value = response.json().await.expect("a lease body");
    assert_eq!(read["state"], "active", "{read}");
}

/// A mount path changed on one side only (the Deployment mounts the token Secret elsewhere,
/// `--discovery-token-file` still points at the old path): the Pod never becomes Ready, and
/// its log says which file is missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mount_path_changed_on_one_side_fails_the_pod() {
    let Some(plane) = ControlPlane::dedicated("install-broken", &[]) else {
        return;
    };
    let Some(host) = PodHost::new(plane).await else {
        return;
    };
    let Some(_install) = Install::kustomize_edited(plane, |dir| {
        let path = dir.join("deployment.yaml");
        let text = std::fs::read_to_string(&path).expect("read deployment.yaml");
        let mount = "mountPath: /etc/proxy-operator-api";
        assert!(
            text.contains(mount),
            "deployment.yaml mounts the token at {mount}"
        );
        let broken = text.replace(mount, "mountPath: /etc/proxy-operator-token");
        std::fs::write(&path, broken).expect("write deployment.yaml");
    }) else {
        return;
    };
    let pod = host.start(NAMESPACE, DEPLOYMENT).await;
    pod.wait_exited(POD_READY).await;
    let exit = pod.exits()[0];
    assert!(!exited_cleanly(&exit), "{exit:?}");
    let logs = pod.logs();
    assert!(
        logs.contains("/etc/proxy-operator-api/tokens"),
        "the log names the missing token file:\n{logs}"
    );
    assert!(
        !pod.ready(),
        "a Pod without its token file was reported Ready"
    );
}

/// The install page (`docs/install.md`) says what the tests do and what the Pod runs: the
/// commands, every flag that names a path with that path, every mount path, every port with its
/// name. A flag, path or port changed in the manifests alone, or the page moved, fails here.
#[test]
fn the_install_page_documents_what_the_pod_runs() {
    let Some(objects) = Manifests::copy(&new_token()).kustomize() else {
        return;
    };
    let page = "docs/install.md";
    let text = std::fs::read_to_string(repo().join(page)).expect("read docs/install.md");
    for command in [
        "kubectl apply --server-side -k manifests/",
        "helm install proxy-operator charts/proxy-operator -n proxy-operator --create-namespace",
    ] {
        assert!(
            text.contains(command),
            "{page} lacks the install command {command:?}"
        );
    }
    let deployment = objects
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .expect("the install has a Deployment");
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let args: Vec<&str> = container["args"]
        .as_array()
        .expect("the container has args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for pair in args.windows(2) {
        if pair[0].starts_with("--") && pair[1].starts_with('/') {
            let documented = format!("`{} {}`", pair[0], pair[1]);
            assert!(text.contains(&documented), "{page} lacks {documented}");
        }
    }
    for mount in container["volumeMounts"].as_array().expect("volume mounts") {
        let path = mount["mountPath"].as_str().expect("a mount path");
        assert!(text.contains(path), "{page} lacks the mount path {path}");
    }
    for port in container["ports"].as_array().expect("ports") {
        let documented = format!(
            "port {} (`{}`)",
            port["containerPort"],
            port["name"].as_str().unwrap_or("")
        );
        assert!(text.contains(&documented), "{page} lacks {documented}");
    }
}
