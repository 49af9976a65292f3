//! The providers config file (`--providers-config`): which machine providers exist, how they
//! are set up, and what their squids may reach. Strict and validated at load, because a typo
//! here must stop start-up rather than leave Proxies silently unprovisioned.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::squid_conf::PortRange;
use crate::egress::{IpNet, parse_range};

/// Default image of the kubernetes provider's squid Pods.
pub const DEFAULT_SQUID_IMAGE: &str = "ubuntu/squid";

/// The whole providers config file.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ProvidersConfig {
    /// What the generated squids may reach on top of what the operator's flags open.
    #[serde(default)]
    pub egress: EgressConfig,
    /// Named provider entries; `Proxy.spec.provider` refers to `name`.
    #[serde(default)]
    pub providers: Vec<ProviderEntry>,
}

/// The `egress:` block: ranges and ports opened for the squids the operator generates (every
/// provider's), on top of `--gateway-allowed-destinations` and `--gateway-allowed-ports`, which
/// open them at the gateway and in the squids alike. For what only the squids reach, such as
/// the addresses and ports of health-probe URLs.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(try_from = "EgressText")]
pub struct EgressConfig {
    /// Ranges opened although not public (`allowedDestinations`: CIDR ranges or addresses).
    pub allowed_destinations: Vec<IpNet>,
    /// Ports opened (`allowedPorts`: ports or `low-high` ranges).
    pub allowed_ports: Vec<PortRange>,
}

/// The `egress:` block as written; [`EgressConfig`] is the same checked, a refusal naming the
/// entry.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct EgressText {
    #[serde(default)]
    allowed_destinations: Vec<String>,
    #[serde(default)]
    allowed_ports: Vec<PortText>,
}

/// One `allowedPorts` entry: a YAML number (`8080`) or a string (`"8000-8100"`).
struct PortText(String);

impl<'de> Deserialize<'de> for PortText {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = PortText;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(
                    "egress.allowedPorts: a port (8080) or a range of ports (\"8000-8100\")",
                )
            }
            fn visit_u64<E>(self, port: u64) -> Result<PortText, E> {
                Ok(PortText(port.to_string()))
            }
            fn visit_i64<E>(self, port: i64) -> Result<PortText, E> {
                Ok(PortText(port.to_string()))
            }
            fn visit_str<E>(self, text: &str) -> Result<PortText, E> {
                Ok(PortText(text.to_owned()))
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

impl TryFrom<EgressText> for EgressConfig {
    type Error = String;

    fn try_from(text: EgressText) -> Result<Self, String> {
        let allowed_destinations = text
            .allowed_destinations
            .iter()
            .enumerate()
            .map(|(i, entry)| {
                parse_range(entry.trim())
                    .map_err(|problem| format!("egress.allowedDestinations[{i}] {problem}"))
            })
            .collect::<Result<_, _>>()?;
        let allowed_ports = text
            .allowed_ports
            .iter()
            .enumerate()
            .map(|(i, PortText(entry))| {
                PortRange::parse(entry)
                    .map_err(|problem| format!("egress.allowedPorts[{i}] {problem}"))
            })
            .collect::<Result<_, _>>()?;
        Ok(EgressConfig {
            allowed_destinations,
            allowed_ports,
        })
    }
}

/// One named provider.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ProviderEntry {
    /// Name Proxies refer to.
    pub name: String,
    /// `kubernetes` or `gcp`.
    #[serde(rename = "type")]
    pub type_: String,
    /// Settings of a `kubernetes` provider.
    #[serde(default)]
    pub kubernetes: Option<KubernetesConfig>,
    /// Settings of a `gcp` provider.
    #[serde(default)]
    pub gcp: Option<GcpConfig>,
}

/// The kubernetes provider: one squid Pod per proxy in the Proxy's namespace.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct KubernetesConfig {
    /// Container image running squid.
    #[serde(default = "default_squid_image")]
    pub image: String,
    /// The Pod Security Standards level the squid Pods are built to pass: `baseline` (the
    /// default: squid starts as root and drops to its `proxy` user) or `restricted` (squid runs
    /// as uid/gid 13, `proxy` in `ubuntu/squid`, from the start; no privilege escalation, no
    /// capabilities, RuntimeDefault seccomp; listen ports below 1024 are refused).
    #[serde(default)]
    pub pod_security: PodSecurity,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        KubernetesConfig {
            image: default_squid_image(),
            pod_security: PodSecurity::default(),
        }
    }
}

/// The [Pod Security Standards](https://kubernetes.io/docs/concepts/security/pod-security-standards/)
/// level a kubernetes provider's Pods are built to pass (`kubernetes.podSecurity`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum PodSecurity {
    /// Passes `baseline`: squid starts as root and drops to user `proxy`.
    #[default]
    Baseline,
    /// Passes `restricted`: squid runs as a non-root user from the start.
    Restricted,
}

impl PodSecurity {
    const KNOWN: &'static str = "baseline, restricted";

    /// The level named as in the namespace label `pod-security.kubernetes.io/enforce`.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "baseline" => Some(PodSecurity::Baseline),
            "restricted" => Some(PodSecurity::Restricted),
            _ => None,
        }
    }

    /// The level's name, as written in the config and in namespace labels.
    pub fn as_str(self) -> &'static str {
        match self {
            PodSecurity::Baseline => "baseline",
            PodSecurity::Restricted => "restricted",
        }
    }
}

impl std::fmt::Display for PodSecurity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for PodSecurity {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        PodSecurity::parse(&name).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "kubernetes.podSecurity {name:?} is not one of {}",
                PodSecurity::KNOWN
            ))
        })
    }
}

/// The gcp provider: Compute Engine VMs in one project.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct GcpConfig {
    /// GCP project the VMs live in.
    #[serde(default)]
    pub project: String,
    /// Zone used when a Proxy's placement names none.
    #[serde(default)]
    pub default_zone: Option<String>,
    /// Machine type used when a Proxy's placement names none.
    #[serde(default)]
    pub default_machine_type: Option<String>,
    /// Boot image used when a Proxy's placement names none.
    #[serde(default)]
    pub default_image: Option<String>,
    /// Service account e-mail attached to VMs when a Proxy's placement names none.
    #[serde(default)]
    pub service_account: Option<String>,
}

fn default_squid_image() -> String {
    DEFAULT_SQUID_IMAGE.to_owned()
}

/// The provider types this build knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProviderType {
    /// Squid Pods in the cluster.
    Kubernetes,
    /// Compute Engine VMs.
    Gcp,
}

impl ProviderType {
    const KNOWN: &'static str = "kubernetes, gcp";

    fn parse(name: &str) -> Option<Self> {
        match name {
            "kubernetes" => Some(ProviderType::Kubernetes),
            "gcp" => Some(ProviderType::Gcp),
            _ => None,
        }
    }
}

/// Why a providers config was refused. Every variant names the file; entry-level variants
/// name the entry (`providers[i]`) and the field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("providers config {path}: cannot read: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Not valid YAML, or a field that does not exist / has the wrong type.
    #[error("providers config {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message, with the location.
        message: String,
    },
    /// An entry without a name.
    #[error("providers config {path}: providers[{index}].name must not be empty")]
    EmptyName {
        /// The file.
        path: PathBuf,
        /// Position of the entry.
        index: usize,
    },
    /// Two entries with one name.
    #[error(
        "providers config {path}: providers[{index}].name {name:?} is already used by providers[{first}]"
    )]
    DuplicateName {
        /// The file.
        path: PathBuf,
        /// Position of the second entry.
        index: usize,
        /// Position of the first entry.
        first: usize,
        /// The repeated name.
        name: String,
    },
    /// A type this build does not know.
    #[error(
        "providers config {path}: providers[{index}] ({name}): type {type_:?} is not one of {known}",
        known = ProviderType::KNOWN
    )]
    UnknownType {
        /// The file.
        path: PathBuf,
        /// Position of the entry.
        index: usize,
        /// The entry's name.
        name: String,
        /// The unknown type.
        type_: String,
    },
    /// The block named after the type is missing.
    #[error(
        "providers config {path}: providers[{index}] ({name}): type {type_} needs a `{type_}:` block"
    )]
    MissingBlock {
        /// The file.
        path: PathBuf,
        /// Position of the entry.
        index: usize,
        /// The entry's name.
        name: String,
        /// The entry's type.
        type_: String,
    },
    /// A block for another type is present (almost always a copy-paste mistake).
    #[error(
        "providers config {path}: providers[{index}] ({name}): a `{block}:` block does not belong to type {type_}"
    )]
    ForeignBlock {
        /// The file.
        path: PathBuf,
        /// Position of the entry.
        index: usize,
        /// The entry's name.
        name: String,
        /// The entry's type.
        type_: String,
        /// The block that should not be there.
        block: &'static str,
    },
    /// A gcp entry without a project.
    #[error("providers config {path}: providers[{index}] ({name}): gcp.project is required")]
    MissingProject {
        /// The file.
        path: PathBuf,
        /// Position of the entry.
        index: usize,
        /// The entry's name.
        name: String,
    },
}

impl ProvidersConfig {
    /// Reads, parses and validates the file at `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Parses and validates `text`; `path` is only used in error messages.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let config: ProvidersConfig =
            serde_saphyr::from_str(text).map_err(|e| ConfigError::Parse {
                path: path.to_owned(),
                message: e.to_string(),
            })?;
        config.validate(path)?;
        Ok(config)
    }

    /// The entry named `name`.
    pub fn get(&self, name: &str) -> Option<&ProviderEntry> {
        self.providers.iter().find(|p| p.name == name)
    }

    fn validate(&self, path: &Path) -> Result<(), ConfigError> {
        let mut seen: Vec<&str> = Vec::new();
        let mut names = HashSet::new();
        for (index, entry) in self.providers.iter().enumerate() {
            let name = entry.name.trim();
            if name.is_empty() {
                return Err(ConfigError::EmptyName {
                    path: path.to_owned(),
                    index,
                });
            }
            if !names.insert(name) {
                let first = seen.iter().position(|n| *n == name).unwrap_or_default();
                return Err(ConfigError::DuplicateName {
                    path: path.to_owned(),
                    index,
                    first,
                    name: name.to_owned(),
                });
            }
            seen.push(name);
            entry.validate(path, index)?;
        }
        Ok(())
    }
}

impl ProviderEntry {
    /// The entry's type; only valid after [`ProvidersConfig::load`] accepted it.
    pub fn provider_type(&self) -> Option<ProviderType> {
        ProviderType::parse(&self.type_)
    }

    fn validate(&self, path: &Path, index: usize) -> Result<(), ConfigError> {
        let path = path.to_owned();
        let name = self.name.clone();
        let type_ = self.type_.clone();
        let Some(kind) = self.provider_type() else {
            return Err(ConfigError::UnknownType {
                path,
                index,
                name,
                type_,
            });
        };
        let (own_present, foreign) = match kind {
            ProviderType::Kubernetes => (
                self.kubernetes.is_some(),
                self.gcp.is_some().then_some("gcp"),
            ),
            ProviderType::Gcp => (
                self.gcp.is_some(),
                self.kubernetes.is_some().then_some("kubernetes"),
            ),
        };
        if let Some(block) = foreign {
            return Err(ConfigError::ForeignBlock {
                path,
                index,
                name,
                type_,
                block,
            });
        }
        if !own_present {
            return Err(ConfigError::MissingBlock {
                path,
                index,
                name,
                type_,
            });
        }
        if let Some(gcp) = &self.gcp
            && gcp.project.trim().is_empty()
        {
            return Err(ConfigError::MissingProject { path, index, name });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ProvidersConfig, ConfigError> {
        ProvidersConfig::parse(text, Path::new("/etc/proxy-operator/providers.yaml"))
    }

    fn message(text: &str) -> String {
        parse(text).unwrap_err().to_string()
    }

    #[test]
    fn valid_config_loads_with_defaults() {
        let config = parse(
            "providers:\n\
             - name: local\n  type: kubernetes\n  kubernetes: {}\n\
             - name: gcp-eu\n  type: gcp\n  gcp:\n    project: my-project\n    defaultZone: europe-west1-b\n",
        )
        .unwrap();
        assert_eq!(config.providers.len(), 2);
        let local = config.get("local").unwrap();
        assert_eq!(local.provider_type(), Some(ProviderType::Kubernetes));
        assert_eq!(local.kubernetes.as_ref().unwrap().image, "ubuntu/squid");
        let gcp = config.get("gcp-eu").unwrap().gcp.as_ref().unwrap();
        assert_eq!(gcp.project, "my-project");
        assert_eq!(gcp.default_zone.as_deref(), Some("europe-west1-b"));
    }

    #[test]
    fn unknown_field_is_refused_with_file_and_field() {
        let msg =
            message("providers:\n- name: local\n  type: kubernetes\n  kubernetes:\n    imgae: x\n");
        assert!(matches!(
            parse("providers:\n- name: local\n  type: kubernetes\n  kubernetes:\n    imgae: x\n"),
            Err(ConfigError::Parse { .. })
        ));
        assert!(msg.contains("/etc/proxy-operator/providers.yaml"), "{msg}");
        assert!(msg.contains("imgae"), "{msg}");
    }

    #[test]
    fn unknown_top_level_field_is_refused() {
        assert!(matches!(
            parse("provider: []\n"),
            Err(ConfigError::Parse { .. })
        ));
    }

    #[test]
    fn invalid_yaml_is_refused() {
        assert!(matches!(
            parse("providers: [\n"),
            Err(ConfigError::Parse { .. })
        ));
    }

    #[test]
    fn missing_file_is_a_read_error_naming_it() {
        let err = ProvidersConfig::load(Path::new("/nonexistent/providers.yaml")).unwrap_err();
        assert!(matches!(err, ConfigError::Read { .. }));
        assert!(err.to_string().contains("/nonexistent/providers.yaml"));
    }

    #[test]
    fn empty_name_is_refused() {
        let err =
            parse("providers:\n- name: ''\n  type: kubernetes\n  kubernetes: {}\n").unwrap_err();
        assert!(
            matches!(err, ConfigError::EmptyName { index: 0, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("providers[0].name"));
    }

    #[test]
    fn duplicate_name_is_refused() {
        let err = parse(
            "providers:\n\
             - {name: a, type: kubernetes, kubernetes: {}}\n\
             - {name: a, type: gcp, gcp: {project: p}}\n",
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                ConfigError::DuplicateName {
                    index: 1,
                    first: 0,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("\"a\""));
    }

    #[test]
    fn unknown_type_is_refused() {
        let err = parse("providers:\n- {name: aws, type: ec2}\n").unwrap_err();
        assert!(matches!(err, ConfigError::UnknownType { .. }), "{err}");
        assert!(err.to_string().contains("ec2"));
        assert!(err.to_string().contains("kubernetes, gcp"));
    }

    #[test]
    fn missing_type_block_is_refused() {
        let err = parse("providers:\n- {name: g, type: gcp}\n").unwrap_err();
        assert!(matches!(err, ConfigError::MissingBlock { .. }), "{err}");
        assert!(err.to_string().contains("`gcp:` block"));
    }

    #[test]
    fn foreign_block_is_refused() {
        let err =
            parse("providers:\n- {name: k, type: kubernetes, kubernetes: {}, gcp: {project: p}}\n")
                .unwrap_err();
        assert!(
            matches!(err, ConfigError::ForeignBlock { block: "gcp", .. }),
            "{err}"
        );
    }

    #[test]
    fn pod_security_defaults_to_baseline() {
        let config =
            parse("providers:\n- {name: local, type: kubernetes, kubernetes: {}}\n").unwrap();
        let kubernetes = config.get("local").unwrap().kubernetes.as_ref().unwrap();
        assert_eq!(kubernetes.pod_security, PodSecurity::Baseline);
        assert_eq!(kubernetes, &KubernetesConfig::default());
    }

    #[test]
    fn pod_security_levels_are_read() {
        for (text, want) in [
            ("baseline", PodSecurity::Baseline),
            ("restricted", PodSecurity::Restricted),
        ] {
            let config = parse(&format!(
                "providers:\n\
                 - name: local\n  type: kubernetes\n  kubernetes:\n    image: ubuntu/squid\n    podSecurity: {text}\n"
            ))
            .unwrap();
            let kubernetes = config.get("local").unwrap().kubernetes.as_ref().unwrap();
            assert_eq!(kubernetes.pod_security, want, "{text}");
            assert_eq!(kubernetes.image, "ubuntu/squid");
            assert_eq!(want.as_str(), text);
            assert_eq!(want.to_string(), text);
        }
    }

    #[test]
    fn unknown_pod_security_is_refused_naming_the_field() {
        for bad in ["Restricted", "privileged", "restricted:latest", "''", "3"] {
            let text = format!(
                "providers:\n- name: local\n  type: kubernetes\n  kubernetes:\n    podSecurity: {bad}\n"
            );
            let err = parse(&text).unwrap_err();
            assert!(matches!(err, ConfigError::Parse { .. }), "{bad}: {err}");
            let msg = err.to_string();
            assert!(msg.contains("/etc/proxy-operator/providers.yaml"), "{msg}");
            assert!(msg.contains("kubernetes.podSecurity"), "{msg}");
            assert!(msg.contains("baseline, restricted"), "{msg}");
        }
        // The field's name is spelled as in Kubernetes: snake case is an unknown field.
        let msg = message(
            "providers:\n- name: local\n  type: kubernetes\n  kubernetes:\n    pod_security: restricted\n",
        );
        assert!(msg.contains("pod_security"), "{msg}");
    }

    #[test]
    fn egress_defaults_to_opening_nothing() {
        let config = parse("providers: []\n").unwrap();
        assert_eq!(config.egress, EgressConfig::default());
        assert!(config.egress.allowed_destinations.is_empty());
        assert!(config.egress.allowed_ports.is_empty());
        let config = parse("egress: {}\nproviders: []\n").unwrap();
        assert_eq!(config.egress, EgressConfig::default());
    }

    #[test]
    fn egress_ranges_and_ports_are_read() {
        let config = parse(
            "egress:\n  allowedDestinations: [10.20.0.0/16, 127.0.0.1, \"fd00::/8\", ::1]\n  \
             allowedPorts: [8080, \"8000-8100\", 1024-65535, \"9000\"]\n\
             providers:\n- {name: local, type: kubernetes, kubernetes: {}}\n",
        )
        .unwrap();
        let ranges: Vec<String> = config
            .egress
            .allowed_destinations
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            ranges,
            ["10.20.0.0/16", "127.0.0.1/32", "fd00::/8", "::1/128"]
        );
        let ports: Vec<String> = config
            .egress
            .allowed_ports
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(ports, ["8080", "8000-8100", "1024-65535", "9000"]);
        assert_eq!(config.providers.len(), 1);
    }

    #[test]
    fn a_bad_egress_entry_is_refused_naming_the_file_and_the_entry() {
        for (egress, wanted) in [
            (
                "allowedDestinations: [127.0.0.1, 10.0.0.1/8]",
                "egress.allowedDestinations[1] \"10.0.0.1/8\" has host bits set: the range is 10.0.0.0/8",
            ),
            (
                "allowedDestinations: [localhost]",
                "egress.allowedDestinations[0] \"localhost\" is neither an IP address nor a CIDR range",
            ),
            (
                "allowedDestinations: [10.0.0.0/33]",
                "egress.allowedDestinations[0] \"10.0.0.0/33\"",
            ),
            (
                "allowedPorts: [80, 0]",
                "egress.allowedPorts[1] \"0\" includes port 0",
            ),
            (
                "allowedPorts: [70000]",
                "egress.allowedPorts[0] \"70000\" is neither a port",
            ),
            (
                "allowedPorts: [-1]",
                "egress.allowedPorts[0] \"-1\" is neither a port",
            ),
            (
                "allowedPorts: [\"9000-8000\"]",
                "egress.allowedPorts[0] \"9000-8000\" ends before it starts",
            ),
            ("allowedPorts: [[80]]", "egress.allowedPorts: a port"),
            ("allowedPorts: [80.5]", "egress.allowedPorts: a port"),
            ("allowedDestination: [127.0.0.1]", "allowedDestination"),
        ] {
            let text = format!("egress:\n  {egress}\nproviders: []\n");
            let err = parse(&text).unwrap_err();
            assert!(matches!(err, ConfigError::Parse { .. }), "{egress}: {err}");
            let msg = err.to_string();
            assert!(
                msg.starts_with("providers config /etc/proxy-operator/providers.yaml: "),
                "{msg}"
            );
            assert!(msg.contains(wanted), "{egress}: {msg}");
        }
    }

    #[test]
    fn gcp_without_project_is_refused() {
        let err = parse("providers:\n- {name: g, type: gcp, gcp: {defaultZone: z}}\n").unwrap_err();
        assert!(matches!(err, ConfigError::MissingProject { .. }), "{err}");
        assert!(err.to_string().contains("gcp.project"));
        assert!(err.to_string().contains("providers[0] (g)"));
    }
}
