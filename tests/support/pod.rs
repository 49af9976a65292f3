//! A test kubelet for the operator's own Pod: runs the Deployment's Pod on the envtest control
//! plane (no controller-manager, no kubelet) the way a ReplicaSet and a kubelet would, so the
//! install in `manifests/` (or the Helm chart's rendering) is what the test runs.
//!
//! [`PodHost::start`] creates a Pod from the Deployment's template, binds it to a node and runs
//! its one container: the container's command and args, with the test-built binary standing for
//! the image's entrypoint at `/usr/local/bin/proxy-operator`, in a mount namespace of its own
//! over a tmpfs root (the host's `/usr/lib` and CA certificates stand for the image's glibc and
//! `ca-certificates`), with a cleared environment (the template's env, fieldRefs resolved, and
//! `KUBERNETES_SERVICE_HOST/PORT`), every volume at its `mountPath` (ConfigMaps and Secrets
//! projected as the kubelet does: files under a timestamped directory behind a `..data`
//! symlink that an update swaps atomically; a PVC is a directory that outlives the Pod; an
//! `emptyDir` a fresh one), the ServiceAccount's token (TokenRequest), `ca.crt` and `namespace`
//! at `/var/run/secrets/kubernetes.io/serviceaccount`, as `runAsUser`/`runAsGroup` with
//! `fsGroup` ownership and file modes, `no_new_privs`, and the root read-only when asked. It
//! runs the readiness and liveness probes as written, reports `Ready` through `pods/status`,
//! restarts the container when it exits or fails liveness, and on the Pod's deletion sends
//! SIGTERM and kills after the grace period, then confirms the deletion.
//!
//! The Pod shares the host's network (its ports are the host's, so one such Pod runs at a time:
//! [`PodHost::new`] waits for the previous one) and has a loopback address of its own as its
//! Pod IP. Needs root (mounts, uid switch); without it the test is skipped, unless `CI` is set.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::net::{IpAddr, Ipv4Addr, TcpListener};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, EnvVar, HTTPGetAction, KeyToPath, Pod, PodSpec, Probe, Secret,
    ServiceAccount, Volume,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use serde_json::{Value, json};
use tempfile::TempDir;

use super::envtest::{ControlPlane, spawn_tied};
use super::kubelet::next_address;

/// Where the image's entrypoint is (Dockerfile `ENTRYPOINT`).
pub const ENTRYPOINT: &str = "/usr/local/bin/proxy-operator";
/// The image's environment (distroless `cc-debian12`).
const IMAGE_ENV: &[(&str, &str)] = &[
    (
        "PATH",
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    ),
    ("SSL_CERT_FILE", "/etc/ssl/certs/ca-certificates.crt"),
];
/// Where every Pod finds its ServiceAccount's credentials.
const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// How often the Pod's state is looked at (exit, deletion, probes due).
const TICK: Duration = Duration::from_millis(200);
/// How often mounted ConfigMaps and Secrets are re-read (the kubelet's sync period is a minute;
/// shorter here so rotations are seen quickly).
const VOLUME_SYNC: Duration = Duration::from_secs(1);
/// Wait before restarting a container that exited (the kubelet's back-off starts at 10 s).
const RESTART_BACKOFF: Duration = Duration::from_secs(2);

/// One Pod of this kind at a time: they listen on the host's ports.
static HOST_PORTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The node the operator's Pods run on, for the tests of one control plane.
pub struct PodHost {
    plane: &'static ControlPlane,
    dir: TempDir,
    binary: PathBuf,
    node: String,
    _ports: tokio::sync::MutexGuard<'static, ()>,
}

/// How a container run ended.
#[derive(Debug, Clone, Copy)]
pub struct Exit {
    pub status: ExitStatus,
    /// How long after SIGTERM it exited (`None`: it was not asked to stop).
    pub after_sigterm: Option<Duration>,
    /// Whether it had to be killed after the grace period.
    pub killed: bool,
}

#[derive(Default)]
struct PodState {
    ready: bool,
    restarts: i32,
    /// Every container run's end, in order.
    exits: Vec<Exit>,
    /// PIDs of every container run, in order.
    pids: Vec<u32>,
    /// The Pod is gone (deleted and confirmed): the task has ended.
    gone: bool,
    problems: Vec<String>,
}

/// A Pod the host runs; its container is killed on drop.
pub struct RunningPod {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    ip: Ipv4Addr,
    log: PathBuf,
    state: Arc<Mutex<PodState>>,
    task: tokio::task::JoinHandle<()>,
}

impl PodHost {
    /// The node for `plane`'s Pods, once no other such Pod runs. `None` (skipped) when not
    /// root, unless `CI` is set, where that fails the test.
    pub async fn new(plane: &'static ControlPlane) -> Option<PodHost> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            super::skip::skip("the test kubelet needs root (mount namespace, uid switch)");
            return None;
        }
        let ports = HOST_PORTS.lock().await;
        let dir = tempfile::Builder::new()
            .prefix("proxy-operator-pods-")
            .tempdir()
            .expect("a temp dir for the Pods");
        // Every uid reads its way down to the volumes (the temp dir is 0700 by default).
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("open the Pods' dir");
        Some(PodHost {
            plane,
            dir,
            binary: PathBuf::from(env!("CARGO_BIN_EXE_proxy-operator")),
            node: "operator-node".to_owned(),
            _ports: ports,
        })
    }

    /// Creates a Pod from Deployment `namespace/name`'s template, as its ReplicaSet would, and
    /// runs it.
    pub async fn start(&self, namespace: &str, name: &str) -> RunningPod {
        let client = self.plane.admin_client();
        let deployment = Api::<Deployment>::namespaced(client.clone(), namespace)
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("read Deployment {namespace}/{name}: {e}"));
        let template = deployment.spec.template;
        let mut metadata = template.metadata.unwrap_or_default();
        // `<deployment>-<template hash>-<random>`, as a ReplicaSet names its Pods (the hash is
        // a fixed stand-in: nothing here reads it).
        metadata.generate_name = Some(format!("{name}-7d9f8c6b5-"));
        metadata.namespace = Some(namespace.to_owned());
        let pod = Pod {
            metadata,
            spec: template.spec,
            status: None,
        };
        let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
        let pod = pods
            .create(&PostParams::default(), &pod)
            .await
            .unwrap_or_else(|e| panic!("create the Pod of Deployment {namespace}/{name}: {e}"));
        let pod_name = pod.metadata.name.clone().expect("a created Pod has a name");
        let uid = pod.metadata.uid.clone().expect("a created Pod has a uid");
        let binding = json!({
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": pod_name, "namespace": namespace, "uid": uid},
            "target": {"apiVersion": "v1", "kind": "Node", "name": self.node},
        });
        let _: Value = pods
            .create_subresource("binding", &pod_name, &PostParams::default(), &binding)
            .await
            .unwrap_or_else(|e| panic!("bind Pod {namespace}/{pod_name}: {e}"));
        let pod = pods
            .get(&pod_name)
            .await
            .unwrap_or_else(|e| panic!("read Pod {namespace}/{pod_name}: {e}"));

        let ip = next_address();
        let pod_dir = self.dir.path().join(&uid);
        std::fs::create_dir_all(&pod_dir).expect("create the Pod's dir");
        let spec = pod.spec.clone().expect("a Pod has a spec");
        let [container] = spec.containers.as_slice() else {
            panic!("the operator's Pod has exactly one container");
        };
        let sandbox = Sandbox::prepare(self, &pod, &spec, container, &pod_dir, ip).await;
        let log = pod_dir.join("container.log");
        let state = Arc::new(Mutex::new(PodState::default()));
        let runner = Runner {
            pods,
            pod_name: pod_name.clone(),
            uid: uid.clone(),
            ip,
            spec: spec.clone(),
            container: container.clone(),
            sandbox,
            log: log.clone(),
            state: state.clone(),
            client,
            namespace: namespace.to_owned(),
        };
        let task = tokio::spawn(runner.run());
        RunningPod {
            namespace: namespace.to_owned(),
            name: pod_name,
            uid,
            ip,
            log,
            state,
            task,
        }
    }
}

impl RunningPod {
    /// The Pod IP; the container listens on the host's ports, so also at this address.
    pub fn ip(&self) -> IpAddr {
        IpAddr::V4(self.ip)
    }

    /// Everything the container wrote to stdout and stderr, every run.
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn restarts(&self) -> i32 {
        self.lock().restarts
    }

    /// PIDs of every container run so far (one entry: never restarted).
    pub fn pids(&self) -> Vec<u32> {
        self.lock().pids.clone()
    }

    pub fn exits(&self) -> Vec<Exit> {
        self.lock().exits.clone()
    }

    /// Waits until the readiness probe passes (the Pod is `Ready`), panicking with the
    /// container's logs after `deadline`.
    /// A container that crashed three times fails the wait at once (a broken install does not
    /// heal by waiting).
    pub async fn wait_ready(&self, deadline: Duration) {
        self.wait("Ready", deadline, |s| {
            assert!(
                s.exits.len() < 3 || s.ready,
                "Pod {}/{} crashed {} times: {:?}\n--- container log ---\n{}",
                self.namespace,
                self.name,
                s.exits.len(),
                s.exits,
                self.logs()
            );
            s.ready
        })
        .await;
    }

    /// Waits until the container exited at least once (by itself or stopped).
    pub async fn wait_exited(&self, deadline: Duration) {
        self.wait("exited", deadline, |s| !s.exits.is_empty()).await;
    }

    /// Whether the readiness probe passes now.
    pub fn ready(&self) -> bool {
        self.lock().ready
    }

    /// Waits until the Pod was deleted and its deletion confirmed.
    pub async fn wait_gone(&self, deadline: Duration) {
        self.wait("gone", deadline, |s| s.gone).await;
    }

    async fn wait(&self, what: &str, deadline: Duration, done: impl Fn(&PodState) -> bool) {
        let start = Instant::now();
        loop {
            {
                let state = self.lock();
                if done(&state) {
                    return;
                }
                if start.elapsed() > deadline {
                    panic!(
                        "Pod {}/{} not {what} after {deadline:?}: {} restarts, exits {:?}, \
                         problems {:?}\n--- container log ---\n{}",
                        self.namespace,
                        self.name,
                        state.restarts,
                        state.exits,
                        state.problems,
                        self.logs()
                    );
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PodState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for RunningPod {
    fn drop(&mut self) {
        self.task.abort();
        // The container dies with its runner, unless the Pod is gone (then it was reaped).
        let state = self.lock();
        if !state.gone
            && let Some(pid) = state.pids.last().copied()
        {
            // SAFETY: kill has no memory preconditions; the PID is our child's (or gone).
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The sandbox: volumes on the host, and the mounts that put them into the container's root.

/// The host side of a Pod: its root mount point and every mount of its container.
struct Sandbox {
    root: PathBuf,
    mounts: Vec<Mount>,
    projected: Vec<Projected>,
    env: Vec<(String, String)>,
    argv: Vec<String>,
    user: u32,
    group: u32,
    groups: Vec<u32>,
    read_only_root: bool,
    no_new_privs: bool,
}

/// A bind mount of `source` (host) at `target` (inside the container's root).
struct Mount {
    source: PathBuf,
    target: String,
    read_only: bool,
    file: bool,
}

/// A ConfigMap or Secret volume, re-projected when the object changes.
struct Projected {
    kind: ProjectedKind,
    name: String,
    items: Option<Vec<KeyToPath>>,
    mode: u32,
    dir: PathBuf,
    current: Option<BTreeMap<String, Vec<u8>>>,
}

#[derive(Clone, Copy)]
enum ProjectedKind {
    ConfigMap,
    Secret,
}

impl Sandbox {
    async fn prepare(
        host: &PodHost,
        pod: &Pod,
        spec: &PodSpec,
        container: &Container,
        pod_dir: &Path,
        ip: Ipv4Addr,
    ) -> Sandbox {
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let pod_security = spec.security_context.clone().unwrap_or_default();
        let security = container.security_context.clone().unwrap_or_default();
        let user = security
            .run_as_user
            .or(pod_security.run_as_user)
            .unwrap_or(0);
        let group = security
            .run_as_group
            .or(pod_security.run_as_group)
            .unwrap_or(0);
        let non_root = security
            .run_as_non_root
            .or(pod_security.run_as_non_root)
            .unwrap_or(false);
        assert!(
            !(non_root && user == 0),
            "CreateContainerConfigError: runAsNonRoot and the image would run as root"
        );
        let fs_group = pod_security.fs_group;
        let mut groups: Vec<u32> = fs_group.into_iter().map(|g| g as u32).collect();
        groups.extend(
            pod_security
                .supplemental_groups
                .unwrap_or_default()
                .into_iter()
                .map(|g| g as u32),
        );

        let client = host.plane.admin_client();
        let volumes_dir = pod_dir.join("volumes");
        let mut mounts = Vec::new();
        let mut projected = Vec::new();
        let volumes: BTreeMap<&str, &Volume> = spec
            .volumes
            .iter()
            .flatten()
            .map(|v| (v.name.as_str(), v))
            .collect();
        for volume_mount in container.volume_mounts.iter().flatten() {
            let volume = volumes.get(volume_mount.name.as_str()).unwrap_or_else(|| {
                panic!(
                    "CreateContainerConfigError: volumeMount {} names no volume of the Pod",
                    volume_mount.name
                )
            });
            assert!(
                volume_mount.sub_path.is_none(),
                "subPath mounts are not played by the test kubelet"
            );
            let source = if let Some(claim) = &volume.persistent_volume_claim {
                // A claim's directory outlives its Pods (the next Pod of a Recreate finds it).
                let dir = host.dir.path().join("claims").join(&claim.claim_name);
                if !dir.exists() {
                    std::fs::create_dir_all(&dir).expect("create the claim's dir");
                    own_for_group(&dir, fs_group, 0o2775);
                }
                dir
            } else if volume.empty_dir.is_some() {
                let dir = volumes_dir.join(&volume.name);
                std::fs::create_dir_all(&dir).expect("create the emptyDir");
                own_for_group(&dir, fs_group, 0o2777);
                dir
            } else {
                let (kind, name, items, mode) = if let Some(c) = &volume.config_map {
                    (
                        ProjectedKind::ConfigMap,
                        c.name.clone(),
                        c.items.clone(),
                        c.default_mode.unwrap_or(0o644),
                    )
                } else if let Some(s) = &volume.secret {
                    (
                        ProjectedKind::Secret,
                        s.secret_name
                            .clone()
                            .expect("a secret volume names its Secret"),
                        s.items.clone(),
                        s.default_mode.unwrap_or(0o644),
                    )
                } else {
                    panic!(
                        "volume {} is of a kind the test kubelet does not play",
                        volume.name
                    );
                };
                let dir = volumes_dir.join(&volume.name);
                std::fs::create_dir_all(&dir).expect("create the volume's dir");
                own_for_group(&dir, fs_group, 0o755);
                let mut volume = Projected {
                    kind,
                    name,
                    items,
                    mode: mode as u32,
                    dir: dir.clone(),
                    current: None,
                };
                volume
                    .sync(&client, &namespace, fs_group)
                    .await
                    .unwrap_or_else(|e| panic!("CreateContainerConfigError: {e}"));
                projected.push(volume);
                dir
            };
            mounts.push(Mount {
                source,
                target: volume_mount.mount_path.clone(),
                read_only: volume_mount.read_only.unwrap_or(false),
                file: false,
            });
        }

        // The ServiceAccount's credentials (the kube-api-access projected volume).
        if spec.automount_service_account_token != Some(false) {
            let account = spec
                .service_account_name
                .clone()
                .unwrap_or_else(|| "default".to_owned());
            let token = service_account_token(&client, pod, &namespace, &account).await;
            let ca = std::fs::read(host.plane.ca_path()).expect("read the control plane's CA");
            let dir = volumes_dir.join("kube-api-access");
            std::fs::create_dir_all(&dir).expect("create the token volume");
            own_for_group(&dir, fs_group, 0o755);
            let files = BTreeMap::from([
                ("token".to_owned(), token.into_bytes()),
                ("ca.crt".to_owned(), ca),
                ("namespace".to_owned(), namespace.clone().into_bytes()),
            ]);
            project(&dir, &files, 0o644, fs_group);
            mounts.push(Mount {
                source: dir,
                target: SERVICE_ACCOUNT_DIR.to_owned(),
                read_only: true,
                file: false,
            });
        }

        let env = container_env(&client, pod, container, ip, host.plane.url()).await;
        let mut argv = container
            .command
            .clone()
            .unwrap_or_else(|| vec![ENTRYPOINT.to_owned()]);
        argv.extend(container.args.clone().unwrap_or_default());

        // The image: its entrypoint, glibc and CA certificates, and a minimal /dev.
        mounts.push(Mount {
            source: host.binary.clone(),
            target: ENTRYPOINT.to_owned(),
            read_only: true,
            file: true,
        });
        for (source, target) in [
            ("/usr/lib", "/usr/lib"),
            ("/usr/lib64", "/usr/lib64"),
            ("/etc/ssl/certs", "/etc/ssl/certs"),
        ] {
            mounts.push(Mount {
                source: source.into(),
                target: target.to_owned(),
                read_only: true,
                file: false,
            });
        }
        for device in ["null", "zero", "random", "urandom"] {
            mounts.push(Mount {
                source: Path::new("/dev").join(device),
                target: format!("/dev/{device}"),
                read_only: false,
                file: true,
            });
        }

        let root = pod_dir.join("rootfs");
        std::fs::create_dir_all(&root).expect("create the root mount point");
        Sandbox {
            root,
            mounts,
            projected,
            env,
            argv,
            user: user as u32,
            group: group as u32,
            groups,
            read_only_root: security.read_only_root_filesystem.unwrap_or(false),
            no_new_privs: security.allow_privilege_escalation == Some(false),
        }
    }

    /// Re-projects every ConfigMap and Secret volume whose object changed.
    async fn sync_volumes(
        &mut self,
        client: &kube::Client,
        namespace: &str,
        fs_group: Option<i64>,
    ) {
        for volume in &mut self.projected {
            // A failed read keeps the last projection, as the kubelet does.
            let _ = volume.sync(client, namespace, fs_group).await;
        }
    }

    /// Starts the container: a child that enters a mount namespace of its own, builds the
    /// root there, switches user and runs the container's argv.
    fn spawn(&self, log: &Path) -> std::io::Result<Child> {
        let plan = MountPlan::new(self);
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)?;
        let mut command = Command::new(&self.argv[0]);
        command
            .args(&self.argv[1..])
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file);
        // SAFETY: the closure makes only system calls on data prepared before the fork.
        unsafe {
            command.pre_exec(move || plan.enter());
        }
        spawn_tied(command)
    }
}

/// Chowns `path` to the Pod's fsGroup with `mode` (the setgid bit keeps new files in it).
fn own_for_group(path: &Path, fs_group: Option<i64>, mode: u32) {
    if let Some(group) = fs_group {
        std::os::unix::fs::chown(path, Some(0), Some(group as u32)).expect("chown to the fsGroup");
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

impl Projected {
    /// Reads the object and projects it when its content changed.
    async fn sync(
        &mut self,
        client: &kube::Client,
        namespace: &str,
        fs_group: Option<i64>,
    ) -> Result<(), String> {
        let mut data: BTreeMap<String, Vec<u8>> = match self.kind {
            ProjectedKind::ConfigMap => {
                let map = Api::<ConfigMap>::namespaced(client.clone(), namespace)
                    .get(&self.name)
                    .await
                    .map_err(|e| format!("configmap {:?} not found: {e}", self.name))?;
                let mut data: BTreeMap<String, Vec<u8>> = map
                    .data
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(k, v)| (k, v.into_bytes()))
                    .collect();
                data.extend(
                    map.binary_data
                        .unwrap_or_default()
                        .into_iter()
                        .map(|(k, v)| (k, v.0)),
                );
                data
            }
            ProjectedKind::Secret => {
                let secret = Api::<Secret>::namespaced(client.clone(), namespace)
                    .get(&self.name)
                    .await
                    .map_err(|e| format!("secret {:?} not found: {e}", self.name))?;
                secret
                    .data
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(k, v)| (k, v.0))
                    .collect()
            }
        };
        if let Some(items) = &self.items {
            let mut chosen = BTreeMap::new();
            for item in items {
                let value = data
                    .remove(&item.key)
                    .ok_or_else(|| format!("key {:?} not in {:?}", item.key, self.name))?;
                chosen.insert(item.path.clone(), value);
            }
            data = chosen;
        }
        if self.current.as_ref() != Some(&data) {
            project(&self.dir, &data, self.mode, fs_group);
            self.current = Some(data);
        }
        Ok(())
    }
}

/// Writes `files` into `dir` the way the kubelet's atomic writer does: into a new timestamped
/// directory, then `..data` is swapped to it by a rename (readers see the old or the new set,
/// never a mix), with a `name -> ..data/name` symlink per file.
fn project(dir: &Path, files: &BTreeMap<String, Vec<u8>>, mode: u32, fs_group: Option<i64>) {
    let stamp = format!(
        "..{}",
        jiff::Timestamp::now().strftime("%Y_%m_%d_%H_%M_%S.%f")
    );
    let version = dir.join(&stamp);
    std::fs::create_dir(&version).expect("create a projection");
    own_for_group(&version, fs_group, 0o755);
    for (name, content) in files {
        let path = version.join(name);
        std::fs::write(&path, content).expect("write a projected file");
        own_for_group(&path, fs_group, mode);
    }
    let data = dir.join("..data");
    let previous = std::fs::read_link(&data).ok();
    let staged = dir.join("..data_tmp");
    let _ = std::fs::remove_file(&staged);
    std::os::unix::fs::symlink(&stamp, &staged).expect("stage ..data");
    std::fs::rename(&staged, &data).expect("swap ..data");
    for name in files.keys() {
        let link = dir.join(name);
        if std::fs::symlink_metadata(&link).is_err() {
            std::os::unix::fs::symlink(Path::new("..data").join(name), &link)
                .expect("link a projected file");
        }
    }
    for entry in std::fs::read_dir(dir).expect("list the volume").flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with("..") && !files.contains_key(&name) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    if let Some(previous) = previous.filter(|p| p != Path::new(&stamp)) {
        let _ = std::fs::remove_dir_all(dir.join(previous));
    }
}

/// A token of `account` bound to the Pod, as the kubelet requests for the kube-api-access
/// volume.
async fn service_account_token(
    client: &kube::Client,
    pod: &Pod,
    namespace: &str,
    account: &str,
) -> String {
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let request = TokenRequest {
        metadata: ObjectMeta::default(),
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(3607),
            bound_object_ref: Some(BoundObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Pod".to_owned()),
                name: pod.metadata.name.clone(),
                uid: pod.metadata.uid.clone(),
            }),
            ..TokenRequestSpec::default()
        }),
        status: None,
    };
    accounts
        .create_token_request(account, &PostParams::default(), &request)
        .await
        .unwrap_or_else(|e| panic!("TokenRequest for ServiceAccount {namespace}/{account}: {e}"))
        .status
        .and_then(|s| s.token)
        .filter(|t| !t.is_empty())
        .unwrap_or_else(|| panic!("TokenRequest for {namespace}/{account} returned no token"))
}

/// The container's environment: the image's, then the template's (values, fieldRefs,
/// ConfigMap and Secret keys), then the service links a kubelet adds.
async fn container_env(
    client: &kube::Client,
    pod: &Pod,
    container: &Container,
    ip: Ipv4Addr,
    api_url: &str,
) -> Vec<(String, String)> {
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let mut env: Vec<(String, String)> = IMAGE_ENV
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    env.push((
        "HOSTNAME".to_owned(),
        pod.metadata.name.clone().unwrap_or_default(),
    ));
    for EnvVar {
        name,
        value,
        value_from,
    } in container.env.iter().flatten()
    {
        let value = match (value, value_from) {
            (Some(value), _) => value.clone(),
            (None, Some(from)) => {
                if let Some(field) = &from.field_ref {
                    match field.field_path.as_str() {
                        "metadata.name" => pod.metadata.name.clone().unwrap_or_default(),
                        "metadata.namespace" => namespace.clone(),
                        "metadata.uid" => pod.metadata.uid.clone().unwrap_or_default(),
                        "spec.nodeName" => pod
                            .spec
                            .as_ref()
                            .and_then(|s| s.node_name.clone())
                            .unwrap_or_default(),
                        "spec.serviceAccountName" => pod
                            .spec
                            .as_ref()
                            .and_then(|s| s.service_account_name.clone())
                            .unwrap_or_default(),
                        "status.podIP" => ip.to_string(),
                        other => panic!("fieldRef {other} is not played by the test kubelet"),
                    }
                } else if let Some(key) = &from.secret_key_ref {
                    let secret = Api::<Secret>::namespaced(client.clone(), &namespace)
                        .get(&key.name)
                        .await
                        .unwrap_or_else(|e| panic!("CreateContainerConfigError: {e}"));
                    let bytes = secret
                        .data
                        .unwrap_or_default()
                        .remove(&key.key)
                        .unwrap_or_else(|| panic!("key {} not in Secret {}", key.key, key.name));
                    String::from_utf8(bytes.0).expect("a UTF-8 env value")
                } else if let Some(key) = &from.config_map_key_ref {
                    Api::<ConfigMap>::namespaced(client.clone(), &namespace)
                        .get(&key.name)
                        .await
                        .unwrap_or_else(|e| panic!("CreateContainerConfigError: {e}"))
                        .data
                        .unwrap_or_default()
                        .remove(&key.key)
                        .unwrap_or_else(|| panic!("key {} not in ConfigMap {}", key.key, key.name))
                } else {
                    panic!("env {name}: a valueFrom the test kubelet does not play")
                }
            }
            (None, None) => String::new(),
        };
        env.push((name.clone(), value));
    }
    let authority = api_url
        .strip_prefix("https://")
        .expect("the control plane serves https");
    let (host, port) = authority
        .rsplit_once(':')
        .expect("the control plane URL has a port");
    for (k, v) in [
        ("KUBERNETES_SERVICE_HOST", host.to_owned()),
        ("KUBERNETES_SERVICE_PORT", port.to_owned()),
        ("KUBERNETES_SERVICE_PORT_HTTPS", port.to_owned()),
        ("KUBERNETES_PORT", format!("tcp://{authority}")),
    ] {
        env.push((k.to_owned(), v));
    }
    env
}

/// Everything the child does between fork and exec, prepared before the fork (no allocation
/// after it).
struct MountPlan {
    root: CString,
    /// Directories to create in the tmpfs root, parents first.
    dirs: Vec<CString>,
    /// Files to create as mount points.
    files: Vec<CString>,
    /// (link path, its target).
    links: Vec<(CString, CString)>,
    /// (source, target, read-only).
    binds: Vec<(CString, CString, bool)>,
    proc_dir: CString,
    read_only_root: bool,
    user: libc::uid_t,
    group: libc::gid_t,
    groups: Vec<libc::gid_t>,
    no_new_privs: bool,
}

impl MountPlan {
    fn new(sandbox: &Sandbox) -> MountPlan {
        let c =
            |path: &Path| CString::new(path.as_os_str().as_bytes()).expect("a path without NUL");
        let root = &sandbox.root;
        let inside = |target: &str| root.join(target.trim_start_matches('/'));
        let mut dirs: Vec<PathBuf> = Vec::new();
        let add_dir = |dir: PathBuf, dirs: &mut Vec<PathBuf>| {
            let mut ancestors: Vec<PathBuf> = dir
                .ancestors()
                .take_while(|a| a.starts_with(root) && *a != root.as_path())
                .map(Path::to_path_buf)
                .collect();
            ancestors.reverse();
            for a in ancestors {
                if !dirs.contains(&a) {
                    dirs.push(a);
                }
            }
        };
        let mut files = Vec::new();
        let mut binds = Vec::new();
        for mount in &sandbox.mounts {
            let target = inside(&mount.target);
            if mount.file {
                add_dir(
                    target.parent().expect("a file has a parent").to_path_buf(),
                    &mut dirs,
                );
                files.push(c(&target));
            } else {
                add_dir(target.clone(), &mut dirs);
            }
            binds.push((c(&mount.source), c(&target), mount.read_only));
        }
        for dir in ["proc", "tmp", "etc"] {
            add_dir(inside(dir), &mut dirs);
        }
        // Merged /usr, as in the image: /lib and /lib64 are links into /usr.
        let links = vec![
            (c(&inside("lib")), c(Path::new("usr/lib"))),
            (c(&inside("lib64")), c(Path::new("usr/lib64"))),
            (c(&inside("bin")), c(Path::new("usr/bin"))),
        ];
        MountPlan {
            root: c(root),
            dirs: dirs.iter().map(|d| c(d)).collect(),
            files,
            links,
            binds,
            proc_dir: c(&inside("proc")),
            read_only_root: sandbox.read_only_root,
            user: sandbox.user,
            group: sandbox.group,
            groups: sandbox.groups.clone(),
            no_new_privs: sandbox.no_new_privs,
        }
    }

    /// In the child: a private mount namespace, the tmpfs root with every mount, chroot, then
    /// the container's user. Only system calls.
    fn enter(&self) -> std::io::Result<()> {
        let check = |result: libc::c_int| {
            if result == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        };
        let null = std::ptr::null::<libc::c_char>();
        // SAFETY: every pointer is a NUL-terminated string owned by `self`, or null where the
        // call allows it.
        unsafe {
            check(libc::unshare(libc::CLONE_NEWNS))?;
            check(libc::mount(
                null,
                c"/".as_ptr(),
                null,
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ))?;
            check(libc::mount(
                c"tmpfs".as_ptr(),
                self.root.as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                c"mode=0755".as_ptr().cast(),
            ))?;
            for dir in &self.dirs {
                check(libc::mkdir(dir.as_ptr(), 0o755))?;
            }
            for file in &self.files {
                let fd = libc::open(file.as_ptr(), libc::O_CREAT | libc::O_WRONLY, 0o644);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(fd);
            }
            for (link, target) in &self.links {
                check(libc::symlink(target.as_ptr(), link.as_ptr()))?;
            }
            for (source, target, read_only) in &self.binds {
                check(libc::mount(
                    source.as_ptr(),
                    target.as_ptr(),
                    null,
                    libc::MS_BIND | libc::MS_REC,
                    std::ptr::null(),
                ))?;
                if *read_only {
                    check(libc::mount(
                        null,
                        target.as_ptr(),
                        null,
                        libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY,
                        std::ptr::null(),
                    ))?;
                }
            }
            check(libc::mount(
                c"proc".as_ptr(),
                self.proc_dir.as_ptr(),
                c"proc".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                std::ptr::null(),
            ))?;
            if self.read_only_root {
                check(libc::mount(
                    null,
                    self.root.as_ptr(),
                    null,
                    libc::MS_REMOUNT
                        | libc::MS_BIND
                        | libc::MS_RDONLY
                        | libc::MS_NOSUID
                        | libc::MS_NODEV,
                    std::ptr::null(),
                ))?;
            }
            check(libc::chdir(self.root.as_ptr()))?;
            check(libc::chroot(c".".as_ptr()))?;
            check(libc::chdir(c"/".as_ptr()))?;
            check(libc::setgroups(self.groups.len(), self.groups.as_ptr()))?;
            check(libc::setgid(self.group))?;
            check(libc::setuid(self.user))?;
            if self.no_new_privs {
                check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// The runner: one task per Pod, playing its kubelet.

struct Runner {
    client: kube::Client,
    pods: Api<Pod>,
    namespace: String,
    pod_name: String,
    uid: String,
    ip: Ipv4Addr,
    spec: PodSpec,
    container: Container,
    sandbox: Sandbox,
    log: PathBuf,
    state: Arc<Mutex<PodState>>,
}

/// A probe's schedule and its consecutive results.
struct ProbeState {
    probe: Probe,
    next: Instant,
    failures: i32,
    successes: i32,
}

impl ProbeState {
    fn new(probe: Probe, started: Instant) -> ProbeState {
        let delay = Duration::from_secs(probe.initial_delay_seconds.unwrap_or(0) as u64);
        ProbeState {
            probe,
            next: started + delay,
            failures: 0,
            successes: 0,
        }
    }

    /// Runs the probe when due; `Some(passed)` when its verdict changed this time.
    async fn run_if_due(&mut self, http: &reqwest::Client, url: &str) -> Option<bool> {
        if Instant::now() < self.next {
            return None;
        }
        self.next =
            Instant::now() + Duration::from_secs(self.probe.period_seconds.unwrap_or(10) as u64);
        let timeout = Duration::from_secs(self.probe.timeout_seconds.unwrap_or(1) as u64);
        let passed = http
            .get(url)
            .timeout(timeout)
            .send()
            .await
            .is_ok_and(|r| (200..400).contains(&r.status().as_u16()));
        if passed {
            self.failures = 0;
            self.successes += 1;
            (self.successes == self.probe.success_threshold.unwrap_or(1)).then_some(true)
        } else {
            self.successes = 0;
            self.failures += 1;
            (self.failures == self.probe.failure_threshold.unwrap_or(3)).then_some(false)
        }
    }
}

impl Runner {
    async fn run(mut self) {
        let http = super::http::client();
        let fs_group = self.spec.security_context.as_ref().and_then(|s| s.fs_group);
        let grace =
            Duration::from_secs(self.spec.termination_grace_period_seconds.unwrap_or(30) as u64);
        let mut last_sync = Instant::now();
        let mut restart_at = Some(Instant::now());
        let mut child: Option<(Child, Instant)> = None;
        let mut readiness: Option<ProbeState> = None;
        let mut liveness: Option<ProbeState> = None;
        let mut published: Option<Value> = None;
        loop {
            // Start (or restart) the container.
            if child.is_none() && restart_at.is_some_and(|at| Instant::now() >= at) {
                restart_at = None;
                match self.ports_free().and_then(|()| {
                    self.sandbox
                        .spawn(&self.log)
                        .map_err(|e| format!("start the container: {e}"))
                }) {
                    Ok(process) => {
                        let started = Instant::now();
                        self.lock().pids.push(process.id());
                        readiness = self
                            .container
                            .readiness_probe
                            .clone()
                            .map(|p| ProbeState::new(p, started));
                        liveness = self
                            .container
                            .liveness_probe
                            .clone()
                            .map(|p| ProbeState::new(p, started));
                        child = Some((process, started));
                    }
                    Err(e) => {
                        self.complain(e);
                        restart_at = Some(Instant::now() + RESTART_BACKOFF);
                    }
                }
            }
            // It exited on its own: restartPolicy Always.
            if let Some((process, _)) = &mut child
                && let Ok(Some(status)) = process.try_wait()
            {
                self.record_exit(Exit {
                    status,
                    after_sigterm: None,
                    killed: false,
                });
                child = None;
                restart_at = Some(Instant::now() + RESTART_BACKOFF);
            }
            // Probes.
            if child.is_some() {
                if let Some(probe) = &mut readiness
                    && let Some(url) = self.probe_url(&probe.probe)
                    && let Some(passed) = probe.run_if_due(&http, &url).await
                {
                    self.lock().ready = passed;
                }
                if let Some(probe) = &mut liveness
                    && let Some(url) = self.probe_url(&probe.probe)
                    && probe.run_if_due(&http, &url).await == Some(false)
                    && let Some((process, _)) = child.take()
                {
                    self.complain("liveness probe failed: restarting the container".to_owned());
                    self.stop(process, grace).await;
                    restart_at = Some(Instant::now() + RESTART_BACKOFF);
                }
            } else {
                self.lock().ready = false;
            }
            // Deleted: SIGTERM, kill after the grace period, confirm.
            match self.pods.get_opt(&self.pod_name).await {
                Ok(Some(pod)) if pod.metadata.uid.as_deref() == Some(&self.uid) => {
                    if let Some(deletion) = pod
                        .metadata
                        .deletion_grace_period_seconds
                        .filter(|_| pod.metadata.deletion_timestamp.is_some())
                    {
                        self.lock().ready = false;
                        if let Some((process, _)) = child.take() {
                            self.stop(process, Duration::from_secs(deletion as u64))
                                .await;
                        }
                        self.confirm_deletion().await;
                        self.lock().gone = true;
                        return;
                    }
                }
                Ok(_) => {
                    if let Some((mut process, _)) = child.take() {
                        let _ = process.kill();
                        let _ = process.wait();
                    }
                    self.lock().gone = true;
                    return;
                }
                Err(e) => self.complain(format!("read the Pod: {e}")),
            }
            if last_sync.elapsed() >= VOLUME_SYNC {
                self.sandbox
                    .sync_volumes(&self.client, &self.namespace, fs_group)
                    .await;
                last_sync = Instant::now();
            }
            let status = self.status(child.as_ref().map(|(_, started)| *started));
            if published.as_ref() != Some(&status) {
                let patch = Patch::Merge(json!({ "status": status }));
                match self
                    .pods
                    .patch_status(&self.pod_name, &PatchParams::default(), &patch)
                    .await
                {
                    Ok(_) => published = Some(status),
                    Err(e) => self.complain(format!("write pods/status: {e}")),
                }
            }
            tokio::time::sleep(TICK).await;
        }
    }

    /// SIGTERM, then SIGKILL after `grace`; records how it ended.
    async fn stop(&self, mut process: Child, grace: Duration) {
        let asked = Instant::now();
        // SAFETY: kill has no memory preconditions; the PID is our unreaped child.
        unsafe { libc::kill(process.id() as libc::pid_t, libc::SIGTERM) };
        let mut killed = false;
        let status = loop {
            if let Ok(Some(status)) = process.try_wait() {
                break status;
            }
            if asked.elapsed() > grace && !killed {
                let _ = process.kill();
                killed = true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        self.record_exit(Exit {
            status,
            after_sigterm: Some(asked.elapsed()),
            killed,
        });
    }

    fn record_exit(&self, exit: Exit) {
        let mut state = self.lock();
        state.exits.push(exit);
        if !state.gone {
            state.restarts = state.exits.len() as i32;
        }
    }

    async fn confirm_deletion(&self) {
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: Some(self.uid.clone()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        if let Err(e) = self.pods.delete(&self.pod_name, &params).await {
            self.complain(format!("confirm the deletion: {e}"));
        }
    }

    /// The URL an httpGet probe asks (host defaults to the Pod IP; a port may be named).
    fn probe_url(&self, probe: &Probe) -> Option<String> {
        let HTTPGetAction {
            host,
            path,
            port,
            scheme,
            ..
        } = probe.http_get.clone()?;
        let port = match port {
            IntOrString::Int(port) => port,
            IntOrString::String(name) => self
                .container
                .ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref() == Some(name.as_str()))
                .map(|p| p.container_port)
                .unwrap_or_else(|| panic!("probe port {name:?} names no container port")),
        };
        let scheme = scheme
            .unwrap_or_else(|| "HTTP".to_owned())
            .to_ascii_lowercase();
        let host = host.unwrap_or_else(|| self.ip.to_string());
        Some(format!(
            "{scheme}://{host}:{port}{}",
            path.unwrap_or_default()
        ))
    }

    /// The container listens on the host's ports: say so plainly when one is taken.
    fn ports_free(&self) -> Result<(), String> {
        for port in self.container.ports.iter().flatten() {
            if TcpListener::bind((Ipv4Addr::UNSPECIFIED, port.container_port as u16)).is_err() {
                return Err(format!(
                    "port {} of the operator's Pod is in use on this host (the test Pod shares \
                     the host's network)",
                    port.container_port
                ));
            }
        }
        Ok(())
    }

    /// `pods/status` as a kubelet writes it for this container.
    fn status(&self, started: Option<Instant>) -> Value {
        let state = self.lock();
        let ready = state.ready && started.is_some();
        let flag = |ok: bool| if ok { "True" } else { "False" };
        let container_state = match (started, state.exits.last()) {
            (Some(_), _) => json!({"running": {}}),
            (None, Some(exit)) => json!({"waiting": {
                "reason": "CrashLoopBackOff",
                "message": format!("last exit: {:?}", exit.status),
            }}),
            (None, None) => json!({"waiting": {"reason": "ContainerCreating"}}),
        };
        json!({
            "phase": "Running",
            "podIP": self.ip.to_string(),
            "podIPs": [{"ip": self.ip.to_string()}],
            "hostIP": "127.0.0.1",
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": flag(ready)},
                {"type": "Ready", "status": flag(ready)},
            ],
            "containerStatuses": [{
                "name": self.container.name,
                "image": self.container.image.clone().unwrap_or_default(),
                "imageID": "",
                "ready": ready,
                "started": started.is_some(),
                "restartCount": state.restarts,
                "state": container_state,
            }],
        })
    }

    fn complain(&self, problem: String) {
        let mut state = self.lock();
        if state.problems.len() < 20 {
            state.problems.push(problem);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PodState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Whether a container run ended by itself with status 0.
pub fn exited_cleanly(exit: &Exit) -> bool {
    !exit.killed && exit.status.code() == Some(0) && exit.status.signal().is_none()
}
