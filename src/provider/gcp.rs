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
use super::squid_conf::squid_cloud_init;
use super::{
    CreateRequest, ErrorClass, INSTALL_LABEL, Instance, InstanceState, Provider, ProviderError,
    machine_labels, op,
};
use crate::proxy::{MANAGED_LABEL, PROXY_UID_LABEL};

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

    /// A provider over an already built client (another endpoint, other credentials).
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
        }
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
/// cloud-init as `user-data` metadata (a squid install on the Proxy's port when the Proxy names
/// none), the managed labels in GCP form, the [`NETWORK_TAG`] plus the placement's tags, and a
/// service account when one is configured.
pub fn insert_request(
    project: &str,
    config: &GcpConfig,
    request: &CreateRequest,
    install_id: &str,
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

    let user_data = request
        .cloud_init
        .clone()
        .unwrap_or_else(|| squid_cloud_init(request.port));
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
        .set_metadata(
            Metadata::new().set_items([metadata::Items::new()
                .set_key(USER_DATA_KEY)
                .set_value(user_data)]),
        )
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
    err.http_status_code() == Some(409)
        && (reasons(err).is_empty() || reasons(err).iter().any(|r| is_already_exists_reason(r)))
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
