//! The gcp provider: one Compute Engine VM per Managed proxy.
//!
//! Only insert, get, delete and aggregated list are used, and no call ever waits on the
//! long-running operation: create returns as soon as the insert is accepted, and the reconciler
//! polls `get`. The machine name is deterministic, so "already exists" on insert is success.
//! `provider_id` is `zones/<zone>/instances/<name>`: self-contained, because re-reading the
//! Proxy's zone is wrong exactly when a zone change is the replacement being processed.

use std::collections::BTreeMap;
use std::time::Duration;

use google_cloud_compute_v1::client::Instances;
use google_cloud_compute_v1::model::{
    self, AccessConfig, AttachedDisk, AttachedDiskInitializeParams, Metadata, NetworkInterface,
    ServiceAccount, Tags, access_config, attached_disk, instance, instances, metadata,
};
use google_cloud_gax::error::rpc::StatusDetails;
use google_cloud_gax::paginator::Paginator;
use google_cloud_gax::retry_policy::NeverRetry;

use super::config::GcpConfig;
use super::error::BoxError;
use super::squid_conf::{SquidEgress, squid_cloud_init};
use super::{
    CreateRequest, ErrorClass, INSTALL_LABEL, Instance, InstanceState, Provider, ProviderError,
    machine_labels, op,
};
use crate::resources::proxy::{MANAGED_LABEL, PROXY_UID_LABEL};

/// Machine type when neither the placement nor the config names one.
pub const DEFAULT_MACHINE_TYPE: &str = "e2-small";
/// Boot image when neither the placement nor the config names one.
pub const DEFAULT_IMAGE: &str =
    "projects/ubuntu-os-cloud/global/images/family/ubuntu-2404-lts-amd64";
/// Boot disk size when the placement names none.
pub const DEFAULT_DISK_SIZE_GB: i64 = 10;
/// Network when the placement names none.
pub const DEFAULT_NETWORK: &str = "global/networks/default";
/// Network tag on every VM, for the firewall rule that opens the proxy port.
pub const NETWORK_TAG: &str = "proxy-operator";
/// Name of the external NAT access config (the one GCP's console and gcloud create).
pub const EXTERNAL_NAT: &str = "External NAT";
/// Metadata key cloud-init reads its user data from.
pub const USER_DATA_KEY: &str = "user-data";
/// Metadata key holding the machine's squid password-file line (`user:$6$...`), for a Proxy's
/// own cloud-init to read from the metadata server (the default cloud-init has it already).
pub const HTPASSWD_METADATA_KEY: &str = "proxy-operator-htpasswd";
/// OAuth scope given to an attached service account; its IAM roles decide what it can do.
pub const SERVICE_ACCOUNT_SCOPE: &str = "https://www.googleapis.com/auth/cloud-platform";
/// Per-attempt timeout of a Compute API call.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(30);

/// Compute Engine VMs in one project.
pub struct GcpProvider {
    name: String,
    config: GcpConfig,
    install_id: String,
    client: Instances,
    egress: SquidEgress,
}

impl GcpProvider {
    /// Connects with Application Default Credentials. Calls are never retried inside the SDK:
    /// a failure reaches the reconciler at once, with its status, and the reconciler's backoff
    /// (or the next GC sweep) retries.
    pub async fn connect(
        name: &str,
        config: &GcpConfig,
        install_id: impl Into<String>,
    ) -> Result<Self, BoxError> {
        let client = Instances::builder()
            .with_retry_policy(NeverRetry)
            .with_attempt_timeout(ATTEMPT_TIMEOUT)
            .build()
            .await?;
        Ok(Self::new(name, config, install_id, client))
    }

    /// A provider over an already built client (another endpoint, other credentials), whose
    /// squids reach what [`SquidEgress::default`] allows until [`GcpProvider::with_egress`]
    /// says otherwise.
    pub fn new(
        name: impl Into<String>,
        config: &GcpConfig,
        install_id: impl Into<String>,
        client: Instances,
    ) -> Self {
        GcpProvider {
            name: name.into(),
            config: config.clone(),
            install_id: install_id.into(),
            client,
            egress: SquidEgress::default(),
        }
    }

    /// The provider whose default cloud-init's squid reaches what `egress` allows (a Proxy's
    /// own cloud-init runs its own squid configuration).
    pub fn with_egress(self, egress: SquidEgress) -> Self {
        GcpProvider { egress, ..self }
    }

    fn error(
        &self,
        op: &'static str,
        id: &str,
        err: google_cloud_compute_v1::Error,
    ) -> ProviderError {
        ProviderError::new(classify_error(&err), op, &self.name, id, err)
    }

    fn permanent(&self, op: &'static str, id: &str, source: impl Into<BoxError>) -> ProviderError {
        ProviderError::new(ErrorClass::Permanent, op, &self.name, id, source)
    }

    fn is_ours(&self, vm: &model::Instance) -> bool {
        vm.labels
            .get(&gcp_label_key(MANAGED_LABEL))
            .map(String::as_str)
            == Some("true")
            && vm.labels.get(&gcp_label_key(INSTALL_LABEL)) == Some(&self.install_id)
    }
}

/// Why an insert request could not be built. Both are mistakes in the Proxy or the config,
/// so the provider reports them as permanent.
#[derive(Debug, thiserror::Error)]
pub enum InsertError {
    /// Neither the placement nor the config names a zone.
    #[error("no zone: set spec.placement.zone or the provider's defaultZone")]
    NoZone,
    /// A label that GCP would refuse.
    #[error(
        "label {key}={value:?} is not a valid GCP label (lowercase letters, digits, '_' and '-', at most 63)"
    )]
    InvalidLabel {
        /// The GCP label key.
        key: String,
        /// The value.
        value: String,
    },
}

/// The GCP form of a Kubernetes-style label key: GCP keys allow neither `.` nor `/`, so
/// `crawl.example.com/proxy-uid` becomes `crawl-example-com_proxy-uid`.
pub fn gcp_label_key(key: &str) -> String {
    key.replace('.', "-").replace('/', "_")
}

fn valid_label_part(s: &str, first_must_be_letter: bool) -> bool {
    s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
        && (!first_must_be_letter || s.bytes().next().is_some_and(|b| b.is_ascii_lowercase()))
}

/// The `zones/<zone>/instances/<name>` ID.
pub fn provider_id(zone: &str, name: &str) -> String {
    format!("zones/{zone}/instances/{name}")
}

/// Splits a `zones/<zone>/instances/<name>` ID into (zone, name).
pub fn parse_provider_id(id: &str) -> Option<(&str, &str)> {
    let mut parts = id.split('/');
    match (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) {
        (Some("zones"), Some(zone), Some("instances"), Some(name), None)
            if !zone.is_empty() && !name.is_empty() =>
        {
            Some((zone, name))
        }
        _ => None,
    }
}

/// The zone a request goes to: the placement's, else the config's default.
pub fn zone_of<'a>(config: &'a GcpConfig, request: &'a CreateRequest) -> Option<&'a str> {
    request
        .placement
        .as_ref()
        .and_then(|p| p.zone.as_deref())
        .or(config.default_zone.as_deref())
        .filter(|z| !z.is_empty())
}

/// `name` if it is already a path or URL, else `prefix` + `name`.
fn qualify(prefix: &str, name: &str) -> String {
    if name.contains('/') {
        name.to_owned()
    } else {
        format!("{prefix}{name}")
    }
}

/// The insert request for `request`: the machine type, boot image and disk size from the
/// placement or the config defaults, one network interface with an external NAT address,
/// cloud-init as `user-data` metadata (a squid install on the Proxy's port, relaying where
/// `egress` allows, when the Proxy names none), the managed labels in GCP form, the [`NETWORK_TAG`] plus the placement's tags, and a
/// service account when one is configured.
pub fn insert_request(
    project: &str,
    config: &GcpConfig,
    request: &CreateRequest,
    install_id: &str,
    egress: &SquidEgress,
) -> Result<instances::InsertRequest, InsertError> {
    let zone = zone_of(config, request).ok_or(InsertError::NoZone)?;
    let placement = request.placement.clone().unwrap_or_default();
    let machine_type = placement
        .machine_type
        .as_deref()
        .or(config.default_machine_type.as_deref())
        .unwrap_or(DEFAULT_MACHINE_TYPE);
    let image = placement
        .image
        .as_deref()
        .or(config.default_image.as_deref())
        .unwrap_or(DEFAULT_IMAGE);
    let disk_size = placement
        .disk_size_gb
        .map(i64::from)
        .unwrap_or(DEFAULT_DISK_SIZE_GB);

    let mut labels = BTreeMap::new();
    let mut wanted = request.labels.clone();
    wanted.extend(machine_labels(&request.proxy_uid, install_id));
    for (key, value) in wanted {
        let key = gcp_label_key(&key);
        if !valid_label_part(&key, true) || !valid_label_part(&value, false) {
            return Err(InsertError::InvalidLabel { key, value });
        }
        labels.insert(key, value);
    }

    let mut tags = vec![NETWORK_TAG.to_owned()];
    for tag in placement.tags {
        if !tags.contains(&tag) {
            tags.push(tag);
        }
    }

    let network = placement
        .network
        .as_deref()
        .map(|n| qualify("global/networks/", n))
        .unwrap_or_else(|| DEFAULT_NETWORK.to_owned());
    let region = zone.rsplit_once('-').map_or(zone, |(region, _)| region);
    let subnetwork = placement
        .subnetwork
        .as_deref()
        .map(|s| qualify(&format!("regions/{region}/subnetworks/"), s));
    let interface = NetworkInterface::new()
        .set_network(network)
        .set_or_clear_subnetwork(subnetwork)
        .set_access_configs([AccessConfig::new()
            .set_name(EXTERNAL_NAT)
            .set_type(access_config::Type::OneToOneNat)]);

    let htpasswd = request.credentials.as_ref().map(|c| c.htpasswd.as_str());
    let user_data = request
        .cloud_init
        .clone()
        .unwrap_or_else(|| squid_cloud_init(request.port, htpasswd, egress));
    let mut metadata = vec![
        metadata::Items::new()
            .set_key(USER_DATA_KEY)
            .set_value(user_data),
    ];
    if let Some(line) = htpasswd {
        metadata.push(
            metadata::Items::new()
                .set_key(HTPASSWD_METADATA_KEY)
                .set_value(line),
        );
    }
    let service_account = placement
        .service_account
        .or_else(|| config.service_account.clone())
        .filter(|s| !s.is_empty());

    let body = model::Instance::new()
        .set_name(&request.machine_name)
        .set_description(format!(
            "proxy-operator: Proxy {}/{}",
            request.namespace, request.proxy_name
        ))
        .set_machine_type(qualify(
            &format!("zones/{zone}/machineTypes/"),
            machine_type,
        ))
        .set_disks([AttachedDisk::new()
            .set_boot(true)
            .set_auto_delete(true)
            .set_type(attached_disk::Type::Persistent)
            .set_initialize_params(
                AttachedDiskInitializeParams::new()
                    .set_source_image(image)
                    .set_disk_size_gb(disk_size),
            )])
        .set_network_interfaces([interface])
        .set_metadata(Metadata::new().set_items(metadata))
        .set_labels(labels)
        .set_tags(Tags::new().set_items(tags))
        .set_service_accounts(service_account.map(|email| {
            ServiceAccount::new()
                .set_email(email)
                .set_scopes([SERVICE_ACCOUNT_SCOPE])
        }));

    Ok(instances::InsertRequest::new()
        .set_project(project)
        .set_zone(zone)
        .set_body(body))
}

/// The machine state a VM status means. RUNNING without an external NAT IP is still
/// provisioning (an empty IP is never published); stopping and suspending count as stopped;
/// an unknown status is treated as provisioning, so the reconciler polls instead of deleting.
pub fn instance_state(status: Option<&instance::Status>, nat_ip: Option<&str>) -> InstanceState {
    use instance::Status::*;
    match status {
        Some(Running) if nat_ip.is_some_and(|ip| !ip.is_empty()) => InstanceState::Running,
        Some(Stopping | Stopped | Suspending | Suspended | PendingStop) => InstanceState::Stopped,
        Some(Terminated | Deprovisioning) => InstanceState::Terminated,
        _ => InstanceState::Provisioning,
    }
}

/// The external NAT IP of a VM, if it has one yet.
fn nat_ip(vm: &model::Instance) -> Option<&str> {
    vm.network_interfaces
        .iter()
        .flat_map(|i| i.access_configs.iter())
        .filter_map(|a| a.nat_ip.as_deref())
        .find(|ip| !ip.is_empty())
}

/// The [`Instance`] a VM describes; the zone comes from the VM's zone URL.
pub fn instance_from_vm(vm: &model::Instance) -> Instance {
    let name = vm.name.clone().unwrap_or_default();
    let zone = vm
        .zone
        .as_deref()
        .and_then(|z| z.rsplit('/').next())
        .unwrap_or_default();
    let ip = nat_ip(vm);
    let state = instance_state(vm.status.as_ref(), ip);
    Instance {
        provider_id: provider_id(zone, &name),
        state,
        ip: (state == InstanceState::Running)
            .then(|| ip.map(str::to_owned))
            .flatten(),
        uid: vm.labels.get(&gcp_label_key(PROXY_UID_LABEL)).cloned(),
        created_at: vm
            .creation_timestamp
            .as_deref()
            .and_then(|t| t.parse::<jiff::Timestamp>().ok()),
        name,
        waiting: None,
        deletion_deadline: None,
    }
}

/// Whether an error reason (an `ErrorInfo` reason or an operation error code) means a quota
/// or rate limit; Compute spells these both `quotaExceeded` and `QUOTA_EXCEEDED`.
fn is_quota_reason(reason: &str) -> bool {
    matches!(
        normalise(reason).as_str(),
        "quotaexceeded" | "ratelimitexceeded" | "userratelimitexceeded"
    )
}

/// Whether an error reason means the resource already exists.
fn is_already_exists_reason(reason: &str) -> bool {
    matches!(
        normalise(reason).as_str(),
        "alreadyexists" | "resourcealreadyexists"
    )
}

fn normalise(reason: &str) -> String {
    reason.replace('_', "").to_ascii_lowercase()
}

/// The class of a Compute failure from its HTTP status (None: no response, i.e. transport
/// failure or timeout) and its `ErrorInfo` reasons: 404 → NotFound; 429, or 403 for quota or
/// rate → QuotaExceeded; other 4xx except 408/409 → Permanent; the rest → Transient.
pub fn classify(http_status: Option<u16>, reasons: &[&str]) -> ErrorClass {
    match http_status {
        Some(404) => ErrorClass::NotFound,
        Some(429) => ErrorClass::QuotaExceeded,
        Some(403) if reasons.iter().any(|r| is_quota_reason(r)) => ErrorClass::QuotaExceeded,
        Some(408 | 409) => ErrorClass::Transient,
        Some(400..=499) => ErrorClass::Permanent,
        _ => ErrorClass::Transient,
    }
}

/// The `ErrorInfo` reasons of an SDK error (Compute's `errors[].reason` arrive as these).
fn reasons(err: &google_cloud_compute_v1::Error) -> Vec<&str> {
    err.status()
        .map(|s| {
            s.details
                .iter()
                .filter_map(|d| match d {
                    StatusDetails::ErrorInfo(info) => Some(info.reason.as_str()),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default()
}

/// [`classify`] applied to an SDK error.
pub fn classify_error(err: &google_cloud_compute_v1::Error) -> ErrorClass {
    classify(err.http_status_code(), &reasons(err))
}

/// Whether an insert failed only because the VM already exists.
fn is_already_exists(err: &google_cloud_compute_v1::Error) -> bool {
    let reasons = reasons(err);
    err.http_status_code() == Some(409)
        && (reasons.is_empty() || reasons.iter().any(|r| is_already_exists_reason(r)))
}

/// The error an insert's operation already carries when Compute answers with a finished,
/// failed operation; `None` when the operation is pending or succeeded. An "already exists"
/// code is no failure.
fn operation_failure(operation: &model::Operation) -> Option<(ErrorClass, String)> {
    let errors = &operation.error.as_ref()?.errors;
    let codes: Vec<&str> = errors.iter().filter_map(|e| e.code.as_deref()).collect();
    if codes.is_empty() || codes.iter().all(|c| is_already_exists_reason(c)) {
        return None;
    }
    let class = if codes.iter().any(|c| is_quota_reason(c)) {
        ErrorClass::QuotaExceeded
    } else {
        ErrorClass::Transient
    };
    let messages: Vec<&str> = errors
        .iter()
        .map(|e| e.message.as_deref().or(e.code.as_deref()).unwrap_or("?"))
        .collect();
    Some((class, messages.join("; ")))
}

/// The aggregated-list filter selecting this install's managed VMs.
pub fn managed_filter(install_id: &str) -> String {
    format!(
        "(labels.{} = \"true\") AND (labels.{} = \"{install_id}\")",
        gcp_label_key(MANAGED_LABEL),
        gcp_label_key(INSTALL_LABEL)
    )
}

#[async_trait::async_trait]
impl Provider for GcpProvider {
    fn name(&self) -> &str {
        &self.name
    }

    async fn create(&self, request: &CreateRequest) -> Result<Instance, ProviderError> {
        let insert = insert_request(
            &self.config.project,
            &self.config,
            request,
            &self.install_id,
            &self.egress,
        )
        .map_err(|e| self.permanent(op::CREATE, &request.machine_name, e))?;
        let id = provider_id(&insert.zone, &request.machine_name);
        let accepted = Instance {
            provider_id: id.clone(),
            name: request.machine_name.clone(),
            state: InstanceState::Provisioning,
            ip: None,
            uid: Some(request.proxy_uid.clone()),
            created_at: None,
            waiting: None,
            deletion_deadline: None,
        };
        match self.client.insert().with_request(insert).send().await {
            Ok(operation) => match operation_failure(&operation) {
                None => Ok(accepted),
                Some((class, message)) => Err(ProviderError::new(
                    class,
                    op::CREATE,
                    &self.name,
                    &id,
                    message,
                )),
            },
            Err(e) if is_already_exists(&e) => {
                log::info!("provider {}: {id} already exists", self.name);
                Ok(accepted)
            }
            Err(e) => Err(self.error(op::CREATE, &id, e)),
        }
    }

    async fn get(&self, id: &str) -> Result<Instance, ProviderError> {
        let (zone, name) =
            parse_provider_id(id).ok_or_else(|| self.permanent(op::GET, id, bad_id(id)))?;
        let vm = self
            .client
            .get()
            .set_project(&self.config.project)
            .set_zone(zone)
            .set_instance(name)
            .send()
            .await
            .map_err(|e| self.error(op::GET, id, e))?;
        Ok(instance_from_vm(&vm))
    }

    async fn delete(&self, id: &str) -> Result<(), ProviderError> {
        let (zone, name) =
            parse_provider_id(id).ok_or_else(|| self.permanent(op::DELETE, id, bad_id(id)))?;
        match self
            .client
            .delete()
            .set_project(&self.config.project)
            .set_zone(zone)
            .set_instance(name)
            .send()
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if classify_error(&e) == ErrorClass::NotFound => Ok(()),
            Err(e) => Err(self.error(op::DELETE, id, e)),
        }
    }

    /// One aggregated list over every zone. A zone the API reports as unreachable (a scope
    /// warning, or an entry in `unreachables`) is logged and skipped; the SDK has no
    /// `returnPartialSuccess`, so a call that fails as a whole fails this provider's sweep and
    /// the next sweep tries again.
    async fn list_managed(&self) -> Result<Vec<Instance>, ProviderError> {
        let mut pages = self
            .client
            .aggregated_list()
            .set_project(&self.config.project)
            .set_filter(managed_filter(&self.install_id))
            .by_page();
        let mut found = Vec::new();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| self.error(op::LIST, "", e))?;
            for zone in &page.unreachables {
                log::warn!("provider {}: {zone} is unreachable, skipped", self.name);
            }
            let mut scopes: Vec<_> = page.items.iter().collect();
            scopes.sort_by(|a, b| a.0.cmp(b.0));
            for (scope, list) in scopes {
                if let Some(warning) = &list.warning {
                    let code = warning.code.as_ref().and_then(|c| c.name()).unwrap_or("?");
                    if code != "NO_RESULTS_ON_PAGE" {
                        log::warn!(
                            "provider {}: {scope}: {code}: {}",
                            self.name,
                            warning.message.as_deref().unwrap_or_default()
                        );
                    }
                }
                found.extend(
                    list.instances
                        .iter()
                        .filter(|vm| self.is_ours(vm))
                        .map(instance_from_vm),
                );
            }
        }
        Ok(found)
    }
}

fn bad_id(id: &str) -> String {
    format!("provider ID {id:?} is not of the form zones/<zone>/instances/<name>")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::MachineCredentials;
    use crate::resources::proxy::Placement;

    const UID: &str = "6a1f4c9e-2b7d-4e8a-b1c3-d5e6f7a8b9c0";

    fn config() -> GcpConfig {
        GcpConfig {
            project: "my-project".to_owned(),
            default_zone: Some("europe-west1-b".to_owned()),
            default_machine_type: None,
            default_image: None,
            service_account: None,
        }
    }

    fn request() -> CreateRequest {
        CreateRequest {
            namespace: "crawl".to_owned(),
            proxy_name: "eu-1".to_owned(),
            proxy_uid: UID.to_owned(),
            machine_name: crate::resources::naming::machine_name(UID),
            port: 3128,
            placement: None,
            cloud_init: Some("#cloud-config\nruncmd: [[echo, hi]]\n".to_owned()),
            labels: machine_labels(UID, "prod"),
            credentials: None,
        }
    }

    fn body(insert: &instances::InsertRequest) -> &model::Instance {
        insert.body.as_ref().unwrap()
    }

    fn metadata_value<'a>(vm: &'a model::Instance, key: &str) -> Option<&'a str> {
        vm.metadata
            .as_ref()?
            .items
            .iter()
            .find(|i| i.key.as_deref() == Some(key))?
            .value
            .as_deref()
    }

    #[test]
    fn insert_request_with_defaults_field_by_field() {
        let insert = insert_request(
            "my-project",
            &config(),
            &request(),
            "prod",
            &SquidEgress::default(),
        )
        .unwrap();
        assert_eq!(insert.project, "my-project");
        assert_eq!(insert.zone, "europe-west1-b");
        let vm = body(&insert);
        assert_eq!(vm.name.as_deref(), Some(request().machine_name.as_str()));
        assert_eq!(
            vm.machine_type.as_deref(),
            Some("zones/europe-west1-b/machineTypes/e2-small")
        );

        assert_eq!(vm.disks.len(), 1);
        let disk = &vm.disks[0];
        assert_eq!(disk.boot, Some(true));
        assert_eq!(disk.auto_delete, Some(true));
        assert_eq!(disk.r#type, Some(attached_disk::Type::Persistent));
        let params = disk.initialize_params.as_ref().unwrap();
        assert_eq!(params.source_image.as_deref(), Some(DEFAULT_IMAGE));
        assert_eq!(params.disk_size_gb, Some(10));

        assert_eq!(vm.network_interfaces.len(), 1);
        let nic = &vm.network_interfaces[0];
        assert_eq!(nic.network.as_deref(), Some("global/networks/default"));
        assert_eq!(nic.subnetwork, None);
        assert_eq!(nic.access_configs.len(), 1);
        let nat = &nic.access_configs[0];
        assert_eq!(nat.name.as_deref(), Some("External NAT"));
        assert_eq!(nat.r#type, Some(access_config::Type::OneToOneNat));

        assert_eq!(
            metadata_value(vm, "user-data"),
            Some("#cloud-config\nruncmd: [[echo, hi]]\n")
        );
        assert_eq!(vm.metadata.as_ref().unwrap().items.len(), 1);

        let labels: BTreeMap<&str, &str> = vm
            .labels
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(
            labels,
            BTreeMap::from([
                ("crawl-example-com_managed", "true"),
                ("crawl-example-com_proxy-uid", UID),
                ("crawl-example-com_install", "prod"),
            ])
        );
        assert_eq!(vm.tags.as_ref().unwrap().items, ["proxy-operator"]);
        assert!(vm.service_accounts.is_empty());
        assert_eq!(
            vm.description.as_deref(),
            Some("proxy-operator: Proxy crawl/eu-1")
        );
    }

    #[test]
    fn insert_request_takes_the_placement_over_the_config() {
        let mut config = config();
        config.default_machine_type = Some("n2-standard-2".to_owned());
        config.default_image =
            Some("projects/debian-cloud/global/images/family/debian-12".to_owned());
        config.service_account = Some("config-sa@my-project.iam.gserviceaccount.com".to_owned());
        let mut req = request();
        req.placement = Some(Placement {
            zone: Some("us-central1-a".to_owned()),
            machine_type: Some("e2-micro".to_owned()),
            image: Some("projects/my-project/global/images/squid-v3".to_owned()),
            disk_size_gb: Some(20),
            network: Some("crawl-net".to_owned()),
            subnetwork: Some("crawl-subnet".to_owned()),
            tags: vec!["egress".to_owned(), "proxy-operator".to_owned()],
            service_account: Some("proxy@my-project.iam.gserviceaccount.com".to_owned()),
        });
        let insert =
            insert_request("my-project", &config, &req, "prod", &SquidEgress::default()).unwrap();
        assert_eq!(insert.zone, "us-central1-a");
        let vm = body(&insert);
        assert_eq!(
            vm.machine_type.as_deref(),
            Some("zones/us-central1-a/machineTypes/e2-micro")
        );
        let params = vm.disks[0].initialize_params.as_ref().unwrap();
        assert_eq!(
            params.source_image.as_deref(),
            Some("projects/my-project/global/images/squid-v3")
        );
        assert_eq!(params.disk_size_gb, Some(20));
        let nic = &vm.network_interfaces[0];
        assert_eq!(nic.network.as_deref(), Some("global/networks/crawl-net"));
        assert_eq!(
            nic.subnetwork.as_deref(),
            Some("regions/us-central1/subnetworks/crawl-subnet")
        );
        assert_eq!(
            vm.tags.as_ref().unwrap().items,
            ["proxy-operator", "egress"]
        );
        assert_eq!(vm.service_accounts.len(), 1);
        let sa = &vm.service_accounts[0];
        assert_eq!(
            sa.email.as_deref(),
            Some("proxy@my-project.iam.gserviceaccount.com")
        );
        assert_eq!(sa.scopes, [SERVICE_ACCOUNT_SCOPE]);
    }

    #[test]
    fn insert_request_uses_the_config_defaults_and_service_account() {
        let mut config = config();
        config.default_machine_type = Some("n2-standard-2".to_owned());
        config.default_image =
            Some("projects/debian-cloud/global/images/family/debian-12".to_owned());
        config.service_account = Some("config-sa@my-project.iam.gserviceaccount.com".to_owned());
        let insert = insert_request(
            "my-project",
            &config,
            &request(),
            "prod",
            &SquidEgress::default(),
        )
        .unwrap();
        let vm = body(&insert);
        assert_eq!(
            vm.machine_type.as_deref(),
            Some("zones/europe-west1-b/machineTypes/n2-standard-2")
        );
        assert_eq!(
            vm.disks[0]
                .initialize_params
                .as_ref()
                .unwrap()
                .source_image
                .as_deref(),
            Some("projects/debian-cloud/global/images/family/debian-12")
        );
        assert_eq!(
            vm.service_accounts[0].email.as_deref(),
            Some("config-sa@my-project.iam.gserviceaccount.com")
        );
    }

    #[test]
    fn full_urls_are_kept_as_given() {
        let mut req = request();
        let machine_type = "https://www.googleapis.com/compute/v1/projects/p/zones/europe-west1-b/machineTypes/c3-standard-4";
        req.placement = Some(Placement {
            machine_type: Some(machine_type.to_owned()),
            network: Some("projects/shared/global/networks/vpc".to_owned()),
            subnetwork: Some("projects/shared/regions/europe-west1/subnetworks/s".to_owned()),
            ..Placement::default()
        });
        let insert = insert_request(
            "my-project",
            &config(),
            &req,
            "prod",
            &SquidEgress::default(),
        )
        .unwrap();
        let vm = body(&insert);
        assert_eq!(vm.machine_type.as_deref(), Some(machine_type));
        let nic = &vm.network_interfaces[0];
        assert_eq!(
            nic.network.as_deref(),
            Some("projects/shared/global/networks/vpc")
        );
        assert_eq!(
            nic.subnetwork.as_deref(),
            Some("projects/shared/regions/europe-west1/subnetworks/s")
        );
    }

    #[test]
    fn without_cloud_init_the_vm_installs_squid_on_the_port() {
        let mut req = request();
        req.cloud_init = None;
        req.port = 8080;
        let insert = insert_request(
            "my-project",
            &config(),
            &req,
            "prod",
            &SquidEgress::default(),
        )
        .unwrap();
        assert_eq!(
            metadata_value(body(&insert), USER_DATA_KEY),
            Some(squid_cloud_init(8080, None, &SquidEgress::default()).as_str())
        );
        assert_eq!(metadata_value(body(&insert), HTPASSWD_METADATA_KEY), None);

        // Its squid relays where the provider's egress allows.
        let opened = SquidEgress {
            destinations: vec!["10.20.0.0/16".parse().unwrap()],
            ..SquidEgress::default()
        };
        let insert = insert_request("my-project", &config(), &req, "prod", &opened).unwrap();
        let user_data = metadata_value(body(&insert), USER_DATA_KEY).unwrap();
        assert_eq!(user_data, squid_cloud_init(8080, None, &opened));
        assert!(
            user_data.contains("      # Opened: 10.20.0.0/16\n")
                && !user_data.contains(" 10.0.0.0/8"),
            "{user_data}"
        );

        // Generated credentials: the default cloud-init checks them, and a Proxy's own
        // cloud-init finds the password-file line in the metadata.
        req.credentials = Some(MachineCredentials {
            secret_name: "proxy-x-credentials".into(),
            htpasswd: "proxy-operator:$6$s$h".into(),
        });
        let insert = insert_request(
            "my-project",
            &config(),
            &req,
            "prod",
            &SquidEgress::default(),
        )
        .unwrap();
        assert_eq!(
            metadata_value(body(&insert), USER_DATA_KEY),
            Some(
                squid_cloud_init(8080, Some("proxy-operator:$6$s$h"), &SquidEgress::default())
                    .as_str()
            )
        );
        assert_eq!(
            metadata_value(body(&insert), HTPASSWD_METADATA_KEY),
            Some("proxy-operator:$6$s$h")
        );
        req.cloud_init = Some("#cloud-config\n".into());
        let insert = insert_request(
            "my-project",
            &config(),
            &req,
            "prod",
            &SquidEgress::default(),
        )
        .unwrap();
        assert_eq!(
            metadata_value(body(&insert), HTPASSWD_METADATA_KEY),
            Some("proxy-operator:$6$s$h")
        );
    }

    #[test]
    fn insert_request_refuses_a_missing_zone_and_bad_labels() {
        let mut config = config();
        config.default_zone = None;
        assert!(matches!(
            insert_request("p", &config, &request(), "prod", &SquidEgress::default()),
            Err(InsertError::NoZone)
        ));
        let mut req = request();
        req.labels.insert("geo".to_owned(), "EU".to_owned());
        let err = insert_request("p", &self::config(), &req, "prod", &SquidEgress::default())
            .unwrap_err();
        assert!(
            matches!(&err, InsertError::InvalidLabel { key, value } if key == "geo" && value == "EU"),
            "{err}"
        );
    }

    #[test]
    fn request_labels_cannot_override_the_managed_labels() {
        let mut req = request();
        req.labels
            .insert(INSTALL_LABEL.to_owned(), "someone-else".to_owned());
        let insert = insert_request("p", &config(), &req, "prod", &SquidEgress::default()).unwrap();
        assert_eq!(body(&insert).labels["crawl-example-com_install"], "prod");
    }

    #[test]
    fn label_keys_in_gcp_form() {
        assert_eq!(gcp_label_key(MANAGED_LABEL), "crawl-example-com_managed");
        assert_eq!(
            gcp_label_key(PROXY_UID_LABEL),
            "crawl-example-com_proxy-uid"
        );
        assert_eq!(gcp_label_key("geo"), "geo");
        assert_eq!(
            managed_filter("prod"),
            "(labels.crawl-example-com_managed = \"true\") AND (labels.crawl-example-com_install = \"prod\")"
        );
    }

    #[test]
    fn provider_ids_round_trip_and_bad_ones_are_refused() {
        let id = provider_id("europe-west1-b", "proxy-abc");
        assert_eq!(id, "zones/europe-west1-b/instances/proxy-abc");
        assert_eq!(
            parse_provider_id(&id),
            Some(("europe-west1-b", "proxy-abc"))
        );
        for bad in [
            "",
            "proxy-abc",
            "zones/z/instances/",
            "zones//instances/n",
            "zones/z/instances/n/extra",
            "regions/r/instances/n",
            "crawl/proxy-abc",
        ] {
            assert_eq!(parse_provider_id(bad), None, "{bad}");
        }
    }

    #[test]
    fn state_mapping_table() {
        use InstanceState as S;
        use instance::Status::*;
        let cases = [
            (None, None, S::Provisioning),
            (Some(Provisioning), None, S::Provisioning),
            (Some(Staging), None, S::Provisioning),
            (Some(Pending), None, S::Provisioning),
            (Some(Repairing), Some("34.1.2.3"), S::Provisioning),
            (Some(Running), None, S::Provisioning),
            (Some(Running), Some(""), S::Provisioning),
            (Some(Running), Some("34.1.2.3"), S::Running),
            (Some(Stopping), Some("34.1.2.3"), S::Stopped),
            (Some(Stopped), None, S::Stopped),
            (Some(Suspending), None, S::Stopped),
            (Some(Suspended), None, S::Stopped),
            (Some(PendingStop), None, S::Stopped),
            (Some(Terminated), None, S::Terminated),
            (Some(Deprovisioning), None, S::Terminated),
        ];
        for (status, ip, want) in cases {
            assert_eq!(
                instance_state(status.as_ref(), ip),
                want,
                "{status:?} {ip:?}"
            );
        }
    }

    #[test]
    fn classification_table() {
        use ErrorClass::*;
        let cases: &[(Option<u16>, &[&str], ErrorClass)] = &[
            (Some(404), &["notFound"], NotFound),
            (Some(429), &[], QuotaExceeded),
            (Some(429), &["rateLimitExceeded"], QuotaExceeded),
            (Some(403), &["quotaExceeded"], QuotaExceeded),
            (Some(403), &["QUOTA_EXCEEDED"], QuotaExceeded),
            (Some(403), &["rateLimitExceeded"], QuotaExceeded),
            (Some(403), &["userRateLimitExceeded"], QuotaExceeded),
            (Some(403), &["forbidden"], Permanent),
            (Some(403), &[], Permanent),
            (Some(400), &["invalid"], Permanent),
            (Some(400), &["quotaExceeded"], Permanent),
            (Some(401), &["authError"], Permanent),
            (Some(412), &["conditionNotMet"], Permanent),
            (Some(408), &[], Transient),
            (Some(409), &["resourceNotReady"], Transient),
            (Some(500), &["backendError"], Transient),
            (Some(502), &[], Transient),
            (Some(503), &["serviceUnavailable"], Transient),
            (None, &[], Transient),
        ];
        for (status, reasons, want) in cases {
            assert_eq!(classify(*status, reasons), *want, "{status:?} {reasons:?}");
        }
    }

    fn failed_operation(codes: &[&str]) -> model::Operation {
        let errors = codes.iter().map(|code| {
            model::operation::error::Errors::new()
                .set_code(*code)
                .set_message(format!("{code} happened"))
        });
        model::Operation::new()
            .set_status(model::operation::Status::Done)
            .set_error(model::operation::Error::new().set_errors(errors))
    }

    #[test]
    fn operation_errors_returned_by_insert() {
        let pending = model::Operation::new().set_status(model::operation::Status::Running);
        assert_eq!(operation_failure(&pending), None);
        assert_eq!(
            operation_failure(&failed_operation(&["RESOURCE_ALREADY_EXISTS"])),
            None
        );
        let (class, message) = operation_failure(&failed_operation(&["QUOTA_EXCEEDED"])).unwrap();
        assert_eq!(class, ErrorClass::QuotaExceeded);
        assert!(message.contains("QUOTA_EXCEEDED happened"), "{message}");
        let (class, _) =
            operation_failure(&failed_operation(&["ZONE_RESOURCE_POOL_EXHAUSTED"])).unwrap();
        assert_eq!(class, ErrorClass::Transient);
    }

    #[test]
    fn instance_from_a_running_vm() {
        let vm = model::Instance::new()
            .set_name("proxy-abc")
            .set_zone("https://www.googleapis.com/compute/v1/projects/p/zones/europe-west1-b")
            .set_status(instance::Status::Running)
            .set_creation_timestamp("2026-03-04T05:06:07.123-08:00")
            .set_labels([(gcp_label_key(PROXY_UID_LABEL), UID)])
            .set_network_interfaces([NetworkInterface::new()
                .set_network_ip("10.132.0.5")
                .set_access_configs([AccessConfig::new().set_nat_ip("34.77.1.2")])]);
        let instance = instance_from_vm(&vm);
        assert_eq!(
            instance,
            Instance {
                provider_id: "zones/europe-west1-b/instances/proxy-abc".to_owned(),
                name: "proxy-abc".to_owned(),
                state: InstanceState::Running,
                ip: Some("34.77.1.2".to_owned()),
                uid: Some(UID.to_owned()),
                created_at: Some("2026-03-04T13:06:07.123Z".parse().unwrap()),
                waiting: None,
                deletion_deadline: None,
            }
        );
        let no_nat =
            vm.set_network_interfaces([NetworkInterface::new().set_network_ip("10.1.1.1")]);
        let instance = instance_from_vm(&no_nat);
        assert_eq!(instance.state, InstanceState::Provisioning);
        assert_eq!(instance.ip, None);
    }
}
