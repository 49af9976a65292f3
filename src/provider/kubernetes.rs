//! The kubernetes provider: one squid Pod per Managed proxy, in the Proxy's namespace.
//!
//! The Pod is the only object per proxy: squid's configuration travels in an env var that the
//! container command writes to disk before exec'ing squid, so there is no ConfigMap to create,
//! track or leak. `provider_id` is `<namespace>/<pod>`, so `get` and `delete` need nothing else.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Container, ContainerPort, EnvVar, Pod, PodSpec, Probe, ResourceRequirements, TCPSocketAction,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, DeleteParams, ListParams, PostParams};

use super::config::KubernetesConfig;
use super::kube_refusal::classify;
use super::pod_status::instance_from_pod;
use super::squid_conf::{POD_RUN_DIR, SQUID_CONFIG_ENV, pod_launch_script, pod_squid_config};
use super::{
    CreateRequest, ErrorClass, INSTALL_LABEL, Instance, Provider, ProviderError, machine_labels, op,
};
use crate::proxy::MANAGED_LABEL;

/// Name of the squid container (and of its port).
const CONTAINER_NAME: &str = "squid";
/// Pods per list request; larger fleets are read in pages.
const LIST_PAGE_SIZE: u32 = 500;

/// Squid Pods through the Kubernetes API.
pub struct KubernetesProvider {
    name: String,
    client: kube::Client,
    image: String,
    install_id: String,
}

impl KubernetesProvider {
    /// A provider named `name` creating Pods from `config` with `client` (in-cluster or from a
    /// kubeconfig; the caller decides).
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
            install_id: install_id.into(),
        }
    }

    fn error(&self, op: &'static str, id: &str, err: kube::Error) -> ProviderError {
        ProviderError::new(classify(&err), op, &self.name, id, err)
    }

    fn pods(&self, namespace: &str) -> Api<Pod> {
        Api::namespaced(self.client.clone(), namespace)
    }

    fn managed_selector(&self) -> String {
        format!("{MANAGED_LABEL}=true,{INSTALL_LABEL}={}", self.install_id)
    }
}

/// The Pod for `request`: squid from `request.placement.image` or `default_image`, listening on
/// `request.port`, labelled with the request's labels plus [`machine_labels`].
pub fn build_pod(request: &CreateRequest, default_image: &str, install_id: &str) -> Pod {
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
                "crawl.example.com/proxy".to_owned(),
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
                env: Some(vec![EnvVar {
                    name: SQUID_CONFIG_ENV.to_owned(),
                    value: Some(pod_squid_config(request.port, POD_RUN_DIR)),
                    ..EnvVar::default()
                }]),
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
                ..Container::default()
            }],
            automount_service_account_token: Some(false),
            termination_grace_period_seconds: Some(10),
            ..PodSpec::default()
        }),
        status: None,
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
        let pod = build_pod(request, &self.image, &self.install_id);
        let pods = self.pods(&request.namespace);
        let id = format!("{}/{}", request.namespace, request.machine_name);
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
    use crate::proxy::{PROXY_UID_LABEL, Placement};

    const UID: &str = "0f8c7e4a-3b1d-4c2e-9a55-6d7e8f901234";

    pub(crate) fn request() -> CreateRequest {
        CreateRequest {
            namespace: "crawl".to_owned(),
            proxy_name: "eu-1".to_owned(),
            proxy_uid: UID.to_owned(),
            machine_name: crate::naming::machine_name(UID),
            port: 3129,
            placement: None,
            cloud_init: None,
            labels: BTreeMap::from([("geo".to_owned(), "eu".to_owned())]),
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
            Some(crate::naming::machine_name(UID).as_str())
        );
        assert_eq!(pod.metadata.namespace.as_deref(), Some("crawl"));
        let labels = pod.metadata.labels.as_ref().unwrap();
        assert_eq!(labels[MANAGED_LABEL], "true");
        assert_eq!(labels[PROXY_UID_LABEL], UID);
        assert_eq!(labels[INSTALL_LABEL], "prod");
        assert_eq!(labels["geo"], "eu");
        assert_eq!(
            pod.metadata.annotations.as_ref().unwrap()["crawl.example.com/proxy"],
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
        let command = c.command.as_ref().unwrap();
        assert_eq!(command, &["/bin/sh", "-c", &pod_launch_script(POD_RUN_DIR)]);
        let env = c.env.as_ref().unwrap();
        assert_eq!(env.len(), 1);
        assert_eq!(env[0].name, SQUID_CONFIG_ENV);
        assert_eq!(
            env[0].value.as_deref(),
            Some(pod_squid_config(3129, POD_RUN_DIR).as_str())
        );
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
