//! The kubernetes provider: one squid Pod per Managed proxy, in the Proxy's namespace.
//!
//! The Pod is the only object per proxy: squid's configuration travels in an env var that the
//! container command writes to disk before exec'ing squid, so there is no ConfigMap to create,
//! track or leak. `provider_id` is `<namespace>/<pod>`, so `get` and `delete` need nothing else.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource, Pod,
    PodSecurityContext, PodSpec, Probe, ResourceRequirements, SeccompProfile, SecretKeySelector,
    SecurityContext, TCPSocketAction, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, DeleteParams, ListParams, PostParams};

use super::config::{KubernetesConfig, PodSecurity};
use super::kube_refusal::{ApiFailure, classify};
use super::pod_status::instance_from_pod;
use super::squid_conf::{
    POD_RUN_DIR, SQUID_CONFIG_ENV, SQUID_PASSWD_ENV, SquidEgress, pod_launch_script,
    pod_squid_config, pod_squid_config_unprivileged,
};
use super::{
    CreateRequest, ErrorClass, INSTALL_LABEL, Instance, Provider, ProviderError, machine_labels, op,
};
use crate::credentials::HTPASSWD_SECRET_KEY;
use crate::resources::proxy::{MANAGED_LABEL, PROXY_ANNOTATION};

/// Name of the squid container (and of its port).
const CONTAINER_NAME: &str = "squid";
/// Pods per list request; larger fleets are read in pages.
const LIST_PAGE_SIZE: u32 = 500;
/// The uid and gid squid runs as in a `restricted` Pod: user and group `proxy` of the
/// `ubuntu/squid` image (Debian's base-passwd gives `proxy` the static id 13).
pub const RESTRICTED_SQUID_ID: i64 = 13;
/// The lowest port a squid running as a non-root user can listen on.
pub const FIRST_UNPRIVILEGED_PORT: i32 = 1024;
/// Name of the emptyDir volume a `restricted` Pod mounts at [`POD_RUN_DIR`].
const RUN_VOLUME: &str = "run";

/// Squid Pods through the Kubernetes API.
pub struct KubernetesProvider {
    name: String,
    client: kube::Client,
    image: String,
    pod_security: PodSecurity,
    install_id: String,
    egress: SquidEgress,
}

impl KubernetesProvider {
    /// A provider named `name` creating Pods from `config` with `client` (in-cluster or from a
    /// kubeconfig; the caller decides), whose squids reach what [`SquidEgress::default`] allows
    /// until [`KubernetesProvider::with_egress`] says otherwise.
    pub fn new(
        name: impl Into<String>,
        config: &KubernetesConfig,
        install_id: impl Into<String>,
        client: kube::Client,
    ) -> Self {
        KubernetesProvider {
            name: name.into(),
            client,
            image: config.image.clone(),
            pod_security: config.pod_security,
            install_id: install_id.into(),
            egress: SquidEgress::default(),
        }
    }

    /// The provider whose squids reach what `egress` allows.
    pub fn with_egress(self, egress: SquidEgress) -> Self {
        KubernetesProvider { egress, ..self }
    }

    fn error(&self, op: &'static str, id: &str, err: kube::Error) -> ProviderError {
        ProviderError::new(classify(&err), op, &self.name, id, ApiFailure(err))
    }

    fn pods(&self, namespace: &str) -> Api<Pod> {
        Api::namespaced(self.client.clone(), namespace)
    }

    fn managed_selector(&self) -> String {
        format!("{MANAGED_LABEL}=true,{INSTALL_LABEL}={}", self.install_id)
    }
}

/// The Pod for `request` at the default level, [`PodSecurity::Baseline`], whose squid reaches
/// what [`SquidEgress::default`] allows: see [`build_pod_with`].
pub fn build_pod(request: &CreateRequest, default_image: &str, install_id: &str) -> Pod {
    build_pod_with(
        request,
        default_image,
        install_id,
        PodSecurity::Baseline,
        &SquidEgress::default(),
    )
}

/// Why a squid Pod at `pod_security` cannot serve a proxy on `port`, if it cannot: a
/// `restricted` Pod runs squid as a non-root user, which cannot listen below
/// [`FIRST_UNPRIVILEGED_PORT`].
pub fn port_problem(pod_security: PodSecurity, port: i32) -> Option<String> {
    (pod_security == PodSecurity::Restricted && port < FIRST_UNPRIVILEGED_PORT).then(|| {
        format!(
            "spec.port {port} is below {FIRST_UNPRIVILEGED_PORT}: this provider runs squid as a \
             non-root user (podSecurity: restricted), which cannot listen on a privileged port; \
             use a port of {FIRST_UNPRIVILEGED_PORT} or above, or a provider with podSecurity: \
             baseline"
        )
    })
}

/// The Pod for `request`: squid from `request.placement.image` or `default_image`, listening on
/// `request.port`, labelled with the request's labels plus [`machine_labels`], built to pass the
/// Pod Security Standards level `pod_security`, relaying only where `egress` allows.
///
/// - [`PodSecurity::Baseline`]: no securityContext; squid starts as the image's user (root in
///   `ubuntu/squid`) and drops to `proxy` itself.
/// - [`PodSecurity::Restricted`]: squid runs as uid/gid [`RESTRICTED_SQUID_ID`] from the start
///   (`runAsNonRoot`, `runAsUser`, `runAsGroup`, `fsGroup`), with RuntimeDefault seccomp, no
///   privilege escalation and every capability dropped; [`POD_RUN_DIR`], where squid's config
///   and access-log FIFO live, is an emptyDir that user can write, and the config
///   ([`pod_squid_config_unprivileged`]) writes nowhere else. Such a squid cannot listen below
///   port 1024 (see [`port_problem`]).
pub fn build_pod_with(
    request: &CreateRequest,
    default_image: &str,
    install_id: &str,
    pod_security: PodSecurity,
    egress: &SquidEgress,
) -> Pod {
    let image = request
        .placement
        .as_ref()
        .and_then(|p| p.image.clone())
        .unwrap_or_else(|| default_image.to_owned());
    let mut labels = request.labels.clone();
    labels.extend(machine_labels(&request.proxy_uid, install_id));
    labels.insert("app.kubernetes.io/name".to_owned(), "squid".to_owned());
    labels.insert(
        "app.kubernetes.io/managed-by".to_owned(),
        "proxy-operator".to_owned(),
    );
    let restricted = pod_security == PodSecurity::Restricted;
    let authenticated = request.credentials.is_some();
    let squid_config = if restricted {
        pod_squid_config_unprivileged(request.port, POD_RUN_DIR, authenticated, egress)
    } else {
        pod_squid_config(request.port, POD_RUN_DIR, authenticated, egress)
    };
    let mut env = vec![EnvVar {
        name: SQUID_CONFIG_ENV.to_owned(),
        value: Some(squid_config),
        ..EnvVar::default()
    }];
    if let Some(credentials) = &request.credentials {
        // From the Secret, so the Pod spec holds no credentials at all.
        env.push(EnvVar {
            name: SQUID_PASSWD_ENV.to_owned(),
            value_from: Some(EnvVarSource {
                secret_key_ref: Some(SecretKeySelector {
                    name: credentials.secret_name.clone(),
                    key: HTPASSWD_SECRET_KEY.to_owned(),
                    optional: Some(false),
                }),
                ..EnvVarSource::default()
            }),
            ..EnvVar::default()
        });
    }
    let quantities = |cpu: &str, memory: &str| {
        BTreeMap::from([
            ("cpu".to_owned(), Quantity(cpu.to_owned())),
            ("memory".to_owned(), Quantity(memory.to_owned())),
        ])
    };
    Pod {
        metadata: ObjectMeta {
            name: Some(request.machine_name.clone()),
            namespace: Some(request.namespace.clone()),
            labels: Some(labels),
            annotations: Some(BTreeMap::from([(
                PROXY_ANNOTATION.to_owned(),
                request.proxy_name.clone(),
            )])),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: CONTAINER_NAME.to_owned(),
                image: Some(image),
                command: Some(vec![
                    "/bin/sh".to_owned(),
                    "-c".to_owned(),
                    pod_launch_script(POD_RUN_DIR),
                ]),
                env: Some(env),
                ports: Some(vec![ContainerPort {
                    name: Some(CONTAINER_NAME.to_owned()),
                    container_port: request.port,
                    protocol: Some("TCP".to_owned()),
                    ..ContainerPort::default()
                }]),
                readiness_probe: Some(Probe {
                    tcp_socket: Some(TCPSocketAction {
                        port: IntOrString::Int(request.port),
                        ..TCPSocketAction::default()
                    }),
                    initial_delay_seconds: Some(2),
                    period_seconds: Some(5),
                    ..Probe::default()
                }),
                resources: Some(ResourceRequirements {
                    requests: Some(quantities("50m", "64Mi")),
                    limits: Some(quantities("500m", "256Mi")),
                    ..ResourceRequirements::default()
                }),
                security_context: restricted.then(restricted_container_security),
                volume_mounts: restricted.then(|| {
                    vec![VolumeMount {
                        name: RUN_VOLUME.to_owned(),
                        mount_path: POD_RUN_DIR.to_owned(),
                        ..VolumeMount::default()
                    }]
                }),
                ..Container::default()
            }],
            automount_service_account_token: Some(false),
            termination_grace_period_seconds: Some(10),
            security_context: restricted.then(restricted_pod_security),
            volumes: restricted.then(|| {
                vec![Volume {
                    name: RUN_VOLUME.to_owned(),
                    empty_dir: Some(EmptyDirVolumeSource::default()),
                    ..Volume::default()
                }]
            }),
            ..PodSpec::default()
        }),
        status: None,
    }
}

/// The Pod-level securityContext of a `restricted` Pod: squid's user from the start, and the
/// container runtime's default seccomp profile.
fn restricted_pod_security() -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(RESTRICTED_SQUID_ID),
        run_as_group: Some(RESTRICTED_SQUID_ID),
        fs_group: Some(RESTRICTED_SQUID_ID),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".to_owned(),
            ..SeccompProfile::default()
        }),
        ..PodSecurityContext::default()
    }
}

/// The squid container's securityContext in a `restricted` Pod: no way back to root, no
/// capabilities.
fn restricted_container_security() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".to_owned()]),
            ..Capabilities::default()
        }),
        run_as_non_root: Some(true),
        ..SecurityContext::default()
    }
}

/// Splits `<namespace>/<pod>`.
fn parse_provider_id<'a>(
    provider: &str,
    op: &'static str,
    id: &'a str,
) -> Result<(&'a str, &'a str), ProviderError> {
    match id.split_once('/') {
        Some((namespace, name))
            if !namespace.is_empty() && !name.is_empty() && !name.contains('/') =>
        {
            Ok((namespace, name))
        }
        _ => Err(ProviderError::new(
            ErrorClass::Permanent,
            op,
            provider,
            id,
            format!("provider ID {id:?} is not of the form <namespace>/<pod>"),
        )),
    }
}

#[async_trait::async_trait]
impl Provider for KubernetesProvider {
    fn name(&self) -> &str {
        &self.name
    }

    async fn create(&self, request: &CreateRequest) -> Result<Instance, ProviderError> {
        let id = format!("{}/{}", request.namespace, request.machine_name);
        if let Some(problem) = port_problem(self.pod_security, request.port) {
            return Err(ProviderError::new(
                ErrorClass::Permanent,
                op::CREATE,
                &self.name,
                &id,
                problem,
            ));
        }
        let pod = build_pod_with(
            request,
            &self.image,
            &self.install_id,
            self.pod_security,
            &self.egress,
        );
        let pods = self.pods(&request.namespace);
        match pods.create(&PostParams::default(), &pod).await {
            Ok(created) => Ok(instance_from_pod(&created)),
            Err(kube::Error::Api(status)) if status.code == 409 => {
                log::info!(
                    "provider {}: pod {id} already exists, reading it",
                    self.name
                );
                let existing = pods
                    .get(&request.machine_name)
                    .await
                    .map_err(|e| self.error(op::CREATE, &id, e))?;
                Ok(instance_from_pod(&existing))
            }
            Err(e) => Err(self.error(op::CREATE, &id, e)),
        }
    }

    async fn get(&self, provider_id: &str) -> Result<Instance, ProviderError> {
        let (namespace, name) = parse_provider_id(&self.name, op::GET, provider_id)?;
        let pod = self
            .pods(namespace)
            .get(name)
            .await
            .map_err(|e| self.error(op::GET, provider_id, e))?;
        Ok(instance_from_pod(&pod))
    }

    async fn delete(&self, provider_id: &str) -> Result<(), ProviderError> {
        let (namespace, name) = parse_provider_id(&self.name, op::DELETE, provider_id)?;
        match self
            .pods(namespace)
            .delete(name, &DeleteParams::default())
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if classify(&e) == ErrorClass::NotFound => Ok(()),
            Err(e) => Err(self.error(op::DELETE, provider_id, e)),
        }
    }

    async fn force_delete(&self, provider_id: &str) -> Result<(), ProviderError> {
        let (namespace, name) = parse_provider_id(&self.name, op::FORCE_DELETE, provider_id)?;
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            ..DeleteParams::default()
        };
        match self.pods(namespace).delete(name, &params).await {
            Ok(_) => Ok(()),
            Err(e) if classify(&e) == ErrorClass::NotFound => Ok(()),
            Err(e) => Err(self.error(op::FORCE_DELETE, provider_id, e)),
        }
    }

    async fn list_managed(&self) -> Result<Vec<Instance>, ProviderError> {
        let pods: Api<Pod> = Api::all(self.client.clone());
        let selector = self.managed_selector();
        let mut instances = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut params = ListParams::default()
                .labels(&selector)
                .limit(LIST_PAGE_SIZE);
            if let Some(token) = &token {
                params = params.continue_token(token);
            }
            let page = pods
                .list(&params)
                .await
                .map_err(|e| self.error(op::LIST, "", e))?;
            instances.extend(page.items.iter().map(instance_from_pod));
            token = page.metadata.continue_.filter(|t| !t.is_empty());
            if token.is_none() {
                return Ok(instances);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::squid_conf::PortRange;
    use crate::resources::proxy::{PROXY_UID_LABEL, Placement};

    const UID: &str = "0f8c7e4a-3b1d-4c2e-9a55-6d7e8f901234";

    pub(crate) fn request() -> CreateRequest {
        CreateRequest {
            namespace: "crawl".to_owned(),
            proxy_name: "eu-1".to_owned(),
            proxy_uid: UID.to_owned(),
            machine_name: crate::resources::naming::machine_name(UID),
            port: 3129,
            placement: None,
            cloud_init: None,
            labels: BTreeMap::from([("geo".to_owned(), "eu".to_owned())]),
            credentials: None,
        }
    }

    fn container(pod: &Pod) -> &Container {
        &pod.spec.as_ref().unwrap().containers[0]
    }

    #[test]
    fn pod_carries_name_namespace_and_labels() {
        let pod = build_pod(&request(), "ubuntu/squid", "prod");
        assert_eq!(
            pod.metadata.name.as_deref(),
            Some(crate::resources::naming::machine_name(UID).as_str())
        );
        assert_eq!(pod.metadata.namespace.as_deref(), Some("crawl"));
        let labels = pod.metadata.labels.as_ref().unwrap();
        assert_eq!(labels[MANAGED_LABEL], "true");
        assert_eq!(labels[PROXY_UID_LABEL], UID);
        assert_eq!(labels[INSTALL_LABEL], "prod");
        assert_eq!(labels["geo"], "eu");
        assert_eq!(
            pod.metadata.annotations.as_ref().unwrap()[PROXY_ANNOTATION],
            "eu-1"
        );
    }

    #[test]
    fn request_labels_cannot_override_the_managed_labels() {
        let mut req = request();
        req.labels
            .insert(INSTALL_LABEL.to_owned(), "other".to_owned());
        req.labels
            .insert(PROXY_UID_LABEL.to_owned(), "someone-else".to_owned());
        let pod = build_pod(&req, "ubuntu/squid", "prod");
        let labels = pod.metadata.labels.as_ref().unwrap();
        assert_eq!(labels[INSTALL_LABEL], "prod");
        assert_eq!(labels[PROXY_UID_LABEL], UID);
    }

    #[test]
    fn container_runs_squid_with_the_generated_config() {
        let pod = build_pod(&request(), "ubuntu/squid", "prod");
        let c = container(&pod);
        assert_eq!(c.image.as_deref(), Some("ubuntu/squid"));
        assert_launches_squid_with(
            c,
            &pod_squid_config(3129, POD_RUN_DIR, false, &SquidEgress::default()),
        );
    }

    /// The container runs the launch script with exactly `config` in its one env var.
    fn assert_launches_squid_with(c: &Container, config: &str) {
        let command = c.command.as_ref().unwrap();
        assert_eq!(command, &["/bin/sh", "-c", &pod_launch_script(POD_RUN_DIR)]);
        let env = c.env.as_ref().unwrap();
        assert_eq!(env.len(), 1);
        assert_eq!(env[0].name, SQUID_CONFIG_ENV);
        assert_eq!(env[0].value.as_deref(), Some(config));
    }

    #[test]
    fn squid_accepts_the_config_the_pod_carries() {
        let pod = build_pod(&request(), "ubuntu/squid", "prod");
        let config = container(&pod).env.as_ref().unwrap()[0]
            .value
            .clone()
            .unwrap();
        let (ok, output) = crate::provider::squid_conf::tests::squid_parse(&config);
        assert!(ok, "squid -k parse refused the Pod's config:\n{output}");
        assert!(output.contains("http_port 3129"), "{output}");
    }

    #[test]
    fn container_has_port_probe_and_resources() {
        let pod = build_pod(&request(), "ubuntu/squid", "prod");
        let c = container(&pod);
        let port = &c.ports.as_ref().unwrap()[0];
        assert_eq!(port.container_port, 3129);
        assert_eq!(port.protocol.as_deref(), Some("TCP"));
        let probe = c.readiness_probe.as_ref().unwrap();
        assert_eq!(
            probe.tcp_socket.as_ref().unwrap().port,
            IntOrString::Int(3129)
        );
        let resources = c.resources.as_ref().unwrap();
        assert_eq!(
            resources.requests.as_ref().unwrap()["memory"],
            Quantity("64Mi".into())
        );
        assert_eq!(
            resources.limits.as_ref().unwrap()["cpu"],
            Quantity("500m".into())
        );
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.automount_service_account_token, Some(false));
    }

    fn restricted_pod() -> Pod {
        build_pod_with(
            &request(),
            "ubuntu/squid",
            "prod",
            PodSecurity::Restricted,
            &SquidEgress::default(),
        )
    }

    #[test]
    fn baseline_is_the_default_pod_unchanged() {
        let pod = build_pod(&request(), "ubuntu/squid", "prod");
        assert_eq!(
            pod,
            build_pod_with(
                &request(),
                "ubuntu/squid",
                "prod",
                PodSecurity::Baseline,
                &SquidEgress::default(),
            )
        );
        // squid starts as the image's user and drops to `proxy` itself: nothing is set.
        let json = serde_json::to_value(&pod).unwrap();
        assert!(json["spec"].get("securityContext").is_none(), "{json}");
        assert!(json["spec"].get("volumes").is_none(), "{json}");
        let container = &json["spec"]["containers"][0];
        assert!(container.get("securityContext").is_none(), "{json}");
        assert!(container.get("volumeMounts").is_none(), "{json}");
        assert_eq!(
            container["env"][0]["value"],
            pod_squid_config(3129, POD_RUN_DIR, false, &SquidEgress::default())
        );
    }

    #[test]
    fn restricted_pod_runs_as_proxy_with_runtime_default_seccomp() {
        let pod = restricted_pod();
        let security = pod
            .spec
            .as_ref()
            .unwrap()
            .security_context
            .as_ref()
            .unwrap();
        assert_eq!(security.run_as_non_root, Some(true));
        assert_eq!(security.run_as_user, Some(13));
        assert_eq!(security.run_as_group, Some(13));
        assert_eq!(security.fs_group, Some(13));
        let seccomp = security.seccomp_profile.as_ref().unwrap();
        assert_eq!(seccomp.type_, "RuntimeDefault");
        assert_eq!(seccomp.localhost_profile, None);
        // Nothing that baseline or restricted forbids at Pod level.
        assert_eq!(security.sysctls, None);
        assert_eq!(security.se_linux_options, None);
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.host_network, None);
        assert_eq!(spec.host_pid, None);
        assert_eq!(spec.host_ipc, None);
    }

    #[test]
    fn restricted_container_cannot_escalate_and_has_no_capabilities() {
        let pod = restricted_pod();
        let security = container(&pod).security_context.as_ref().unwrap();
        assert_eq!(security.allow_privilege_escalation, Some(false));
        let capabilities = security.capabilities.as_ref().unwrap();
        assert_eq!(capabilities.drop.as_deref(), Some(&["ALL".to_owned()][..]));
        assert_eq!(capabilities.add, None);
        assert_eq!(security.run_as_non_root, Some(true));
        // Never root, never privileged, and no container-level override of the Pod's identity.
        assert_eq!(security.privileged, None);
        assert_eq!(security.run_as_user, None);
        assert_eq!(security.seccomp_profile, None);
        assert_eq!(container(&pod).ports.as_ref().unwrap()[0].host_port, None);
    }

    #[test]
    fn restricted_pod_writes_only_to_an_emptydir_at_the_run_dir() {
        let pod = restricted_pod();
        let volumes = pod.spec.as_ref().unwrap().volumes.as_ref().unwrap();
        assert_eq!(volumes.len(), 1);
        assert_eq!(volumes[0].name, "run");
        assert_eq!(volumes[0].empty_dir, Some(EmptyDirVolumeSource::default()));
        let c = container(&pod);
        let mounts = c.volume_mounts.as_ref().unwrap();
        assert_eq!(mounts.len(), 1);
        assert_eq!(mounts[0].name, "run");
        assert_eq!(mounts[0].mount_path, POD_RUN_DIR);
        assert_eq!(mounts[0].read_only, None);
        // The same launch script; a config with nothing to write outside the run dir.
        assert_launches_squid_with(
            c,
            &pod_squid_config_unprivileged(3129, POD_RUN_DIR, false, &SquidEgress::default()),
        );
    }

    #[test]
    fn restricted_pod_keeps_everything_else_of_the_baseline_pod() {
        let mut restricted = restricted_pod();
        let baseline = build_pod(&request(), "ubuntu/squid", "prod");
        let spec = restricted.spec.as_mut().unwrap();
        spec.security_context = None;
        spec.volumes = None;
        let c = &mut spec.containers[0];
        c.security_context = None;
        c.volume_mounts = None;
        c.env = baseline.spec.as_ref().unwrap().containers[0].env.clone();
        assert_eq!(restricted, baseline);
    }

    #[test]
    fn squid_accepts_the_config_the_restricted_pod_carries() {
        let pod = restricted_pod();
        let config = container(&pod).env.as_ref().unwrap()[0]
            .value
            .clone()
            .unwrap();
        let (ok, output) = crate::provider::squid_conf::tests::squid_parse(&config);
        assert!(ok, "squid -k parse refused the Pod's config:\n{output}");
        assert!(output.contains("http_port 3129"), "{output}");
    }

    #[test]
    fn only_a_restricted_pod_refuses_privileged_ports() {
        for (level, port, refused) in [
            (PodSecurity::Baseline, 80, false),
            (PodSecurity::Baseline, 1, false),
            (PodSecurity::Baseline, 3128, false),
            (PodSecurity::Restricted, 80, true),
            (PodSecurity::Restricted, 1, true),
            (PodSecurity::Restricted, 1023, true),
            (PodSecurity::Restricted, 1024, false),
            (PodSecurity::Restricted, 3128, false),
            (PodSecurity::Restricted, 65535, false),
        ] {
            let problem = port_problem(level, port);
            assert_eq!(problem.is_some(), refused, "{level} {port}: {problem:?}");
            if let Some(problem) = problem {
                assert!(problem.contains(&format!("spec.port {port} ")), "{problem}");
                assert!(problem.contains("below 1024"), "{problem}");
                assert!(problem.contains("podSecurity: restricted"), "{problem}");
            }
        }
    }

    #[tokio::test]
    async fn restricted_create_on_a_privileged_port_fails_permanently_without_a_call() {
        // A client whose every call would fail as Transient: the API server is never asked.
        let (service, handle) = tower_test::mock::pair::<
            http::Request<kube::client::Body>,
            http::Response<kube::client::Body>,
        >();
        drop(handle);
        let client = kube::Client::new(service, "default");
        let config = KubernetesConfig {
            pod_security: PodSecurity::Restricted,
            ..KubernetesConfig::default()
        };
        let provider = KubernetesProvider::new("local", &config, "prod", client);
        let mut req = request();
        req.port = 80;
        let err = provider.create(&req).await.unwrap_err();
        assert_eq!(err.class, ErrorClass::Permanent, "{err}");
        assert_eq!(err.op, op::CREATE);
        assert_eq!(err.id, format!("crawl/{}", req.machine_name));
        let message = err.to_string();
        assert!(message.contains("spec.port 80 is below 1024"), "{message}");
        // The same provider does call the server for an unprivileged port (and, with no
        // server behind the client, fails otherwise).
        req.port = 3128;
        let err = provider.create(&req).await.unwrap_err();
        assert_ne!(err.class, ErrorClass::Permanent, "{err}");
    }

    #[test]
    fn the_squid_of_every_level_relays_only_where_the_egress_allows() {
        let opened = SquidEgress {
            destinations: vec!["10.20.0.0/16".parse().unwrap()],
            ports: vec![PortRange::parse("8000-8100").unwrap()],
        };
        for (level, config) in [
            (
                PodSecurity::Baseline,
                pod_squid_config(3129, POD_RUN_DIR, false, &opened),
            ),
            (
                PodSecurity::Restricted,
                pod_squid_config_unprivileged(3129, POD_RUN_DIR, false, &opened),
            ),
        ] {
            let pod = build_pod_with(&request(), "ubuntu/squid", "prod", level, &opened);
            assert_launches_squid_with(container(&pod), &config);
            assert!(
                config.contains("\n# Opened: 10.20.0.0/16\n")
                    && !config.contains(" 10.0.0.0/8")
                    && config.contains("\nacl Safe_ports port 8000-8100\n"),
                "{level}: {config}"
            );
        }
    }

    #[test]
    fn placement_image_overrides_the_configured_image() {
        let mut req = request();
        req.placement = Some(Placement {
            image: Some("registry.example.com/squid:6".to_owned()),
            ..Placement::default()
        });
        let pod = build_pod(&req, "ubuntu/squid", "prod");
        assert_eq!(
            container(&pod).image.as_deref(),
            Some("registry.example.com/squid:6")
        );
    }
}
