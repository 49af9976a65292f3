//! The install in `manifests/`: every file parses and is listed in the kustomization, the CRD
//! copy matches `crd/proxy.yaml`, the RBAC rules grant exactly `rbac::API_CALLS`, and the
//! Deployment runs the binary with flags it accepts, one replica at a time, non-root, with a
//! read-only root filesystem, and no API token ships (the Secret is generated from a file the
//! user creates, and mounted as the `--discovery-token-file`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use clap::Parser;
use serde_json::Value;

use proxy_operator::cli::{Cli, Command};
use proxy_operator::ledger::LedgerLocation;
use proxy_operator::provider::ProvidersConfig;
use proxy_operator::rbac::{API_CALLS, Scope};
use proxy_operator::resources::proxy::Proxy;

const NAMESPACE: &str = "proxy-operator";
const SERVICE_ACCOUNT: &str = "proxy-operator";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn parse_all(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_saphyr::from_multiple(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn kustomization() -> Value {
    let mut docs = parse_all(&repo().join("manifests/kustomization.yaml"));
    assert_eq!(docs.len(), 1);
    docs.remove(0)
}

/// Every object the kustomization installs, in its order.
fn objects() -> Vec<Value> {
    let kustomization = kustomization();
    let resources = kustomization["resources"].as_array().expect("resources");
    resources
        .iter()
        .flat_map(|file| parse_all(&repo().join("manifests").join(file.as_str().unwrap())))
        .collect()
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in manifests/"))
}

fn str_list(value: &Value) -> Vec<&str> {
    value
        .as_array()
        .unwrap_or_else(|| panic!("not a list: {value}"))
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect()
}

fn container(objects: &[Value]) -> &Value {
    let pod = &find(objects, "Deployment", "proxy-operator")["spec"]["template"]["spec"];
    let containers = pod["containers"].as_array().unwrap();
    assert_eq!(containers.len(), 1);
    &containers[0]
}

fn env_var<'a>(container: &'a Value, name: &str) -> &'a Value {
    container["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == name)
        .unwrap_or_else(|| panic!("no env {name}"))
}

fn mount_path<'a>(container: &'a Value, volume: &str) -> &'a str {
    container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == volume)
        .and_then(|m| m["mountPath"].as_str())
        .unwrap_or_else(|| panic!("volume {volume} not mounted"))
}

fn container_port(container: &Value, name: &str) -> u64 {
    container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .and_then(|p| p["containerPort"].as_u64())
        .unwrap_or_else(|| panic!("no container port {name}"))
}

#[test]
fn every_manifest_parses_and_is_installed() {
    let listed: BTreeSet<String> = str_list(&kustomization()["resources"])
        .into_iter()
        .map(str::to_owned)
        .collect();
    let on_disk: BTreeSet<String> = std::fs::read_dir(repo().join("manifests"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|f| f.ends_with(".yaml") && f != "kustomization.yaml")
        .collect();
    assert_eq!(listed, on_disk, "manifests/ and kustomization.yaml differ");

    let cluster_scoped = [
        "Namespace",
        "CustomResourceDefinition",
        "ClusterRole",
        "ClusterRoleBinding",
    ];
    let objects = objects();
    // Plus the token Secret, which the kustomization generates (see no_api_token_ships...).
    assert!(objects.len() >= 11, "only {} objects", objects.len());
    for object in &objects {
        let kind = object["kind"].as_str().expect("kind");
        assert!(object["apiVersion"].is_string(), "{kind} has no apiVersion");
        assert!(object["metadata"]["name"].is_string(), "{kind} has no name");
        let namespace = &object["metadata"]["namespace"];
        if cluster_scoped.contains(&kind) {
            assert!(namespace.is_null(), "{kind} is cluster-scoped");
        } else {
            assert_eq!(namespace, NAMESPACE, "{kind} in the wrong namespace");
        }
    }
    find(&objects, "Namespace", NAMESPACE);
}

/// The file the kustomization generates the API token Secret from; the user creates it.
const TOKEN_FILE: &str = "discovery-tokens";

/// The kustomization's generator of the API token Secret.
fn token_secret_generator() -> Value {
    let generators = kustomization()["secretGenerator"].clone();
    let generators = generators.as_array().expect("a secretGenerator");
    assert_eq!(generators.len(), 1);
    let generator = generators[0].clone();
    assert_eq!(generator["name"], "proxy-operator-api");
    assert_eq!(generator["namespace"], NAMESPACE);
    // A stable name: a rotation updates the mounted Secret in place.
    assert_eq!(generator["options"]["disableNameSuffixHash"], true);
    assert!(generator["literals"].is_null() && generator["envs"].is_null());
    generator
}

/// Every file under `dir`, in its subdirectories too.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(files_under(&path));
        } else {
            files.push(path);
        }
    }
    files
}

#[test]
fn no_api_token_ships_with_the_install() {
    token_secret_generator();
    // The token file is the user's, generated, and never committed.
    let ignored = std::fs::read_to_string(repo().join("manifests/.gitignore")).unwrap();
    assert!(ignored.lines().any(|l| l.trim() == TOKEN_FILE), "{ignored}");
    // No Secret (and so no placeholder token) among the installed objects.
    for object in objects() {
        assert_ne!(object["kind"], "Secret", "{object}");
    }
    // No placeholder anywhere in the install (its opt-in parts and the chart included) or the
    // commands of the README and the install page.
    let mut files = files_under(&repo().join("manifests"));
    files.extend(files_under(&repo().join("charts")));
    for path in files {
        if path.file_name().and_then(|n| n.to_str()) == Some(TOKEN_FILE) {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains("change-me"), "{}", path.display());
        assert!(!text.contains("DISCOVERY_TOKEN:"), "{}", path.display());
    }
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let install = std::fs::read_to_string(repo().join("docs/install.md")).unwrap();
    for (page, text) in [("README.md", &readme), ("docs/install.md", &install)] {
        assert!(
            !text.contains("change-me"),
            "{page} ships a placeholder token"
        );
    }
    assert!(
        readme.contains(r#"export DISCOVERY_TOKEN="$(openssl rand -hex 32)""#),
        "the README's first command does not generate a token"
    );
    assert!(
        install.contains(&format!("openssl rand -hex 32 > manifests/{TOKEN_FILE}")),
        "docs/install.md does not tell how to create manifests/{TOKEN_FILE}"
    );
}

#[test]
fn crd_copies_match_the_generated_crds() {
    for (source, copy) in [
        ("crd/proxy.yaml", "manifests/crd.yaml"),
        ("crd/proxypool.yaml", "manifests/crd-proxypool.yaml"),
    ] {
        let generated = std::fs::read(repo().join(source)).unwrap();
        let copied = std::fs::read(repo().join(copy)).unwrap();
        assert!(
            generated == copied,
            "{copy} differs from {source}; run: cp {source} {copy}"
        );
    }
}

/// (group, resource, verb, scope) of every rule in `role`.
fn grants(role: &Value, scope: Scope) -> BTreeSet<(String, String, String, String)> {
    let mut out = BTreeSet::new();
    for rule in role["rules"].as_array().unwrap() {
        assert!(rule["resourceNames"].is_null() && rule["nonResourceURLs"].is_null());
        for group in str_list(&rule["apiGroups"]) {
            for resource in str_list(&rule["resources"]) {
                for verb in str_list(&rule["verbs"]) {
                    assert!(
                        !group.contains('*') && !resource.contains('*') && verb != "*",
                        "wildcard in {rule}"
                    );
                    out.insert((
                        group.to_owned(),
                        resource.to_owned(),
                        verb.to_owned(),
                        format!("{scope:?}"),
                    ));
                }
            }
        }
    }
    out
}

#[test]
fn rbac_grants_exactly_the_api_calls_the_code_makes() {
    let objects = objects();
    let cluster_role = find(&objects, "ClusterRole", "proxy-operator");
    let role = find(&objects, "Role", "proxy-operator-leader-election");
    let mut granted = grants(cluster_role, Scope::Cluster);
    granted.extend(grants(role, Scope::OperatorNamespace));

    let needed: BTreeSet<_> = API_CALLS
        .iter()
        .flat_map(|call| {
            call.verbs.iter().map(|verb| {
                (
                    call.group.to_owned(),
                    call.resource.to_owned(),
                    (*verb).to_owned(),
                    format!("{:?}", call.scope),
                )
            })
        })
        .collect();
    let missing: Vec<_> = needed.difference(&granted).collect();
    let extra: Vec<_> = granted.difference(&needed).collect();
    assert!(missing.is_empty(), "not granted: {missing:?}");
    assert!(extra.is_empty(), "granted but never called: {extra:?}");

    // Both roles are bound to the ServiceAccount the Deployment runs as.
    for (binding_kind, binding, role_kind, role_name) in [
        (
            "ClusterRoleBinding",
            "proxy-operator",
            "ClusterRole",
            "proxy-operator",
        ),
        (
            "RoleBinding",
            "proxy-operator-leader-election",
            "Role",
            "proxy-operator-leader-election",
        ),
    ] {
        let binding = find(&objects, binding_kind, binding);
        assert_eq!(binding["roleRef"]["kind"], role_kind);
        assert_eq!(binding["roleRef"]["name"], role_name);
        let subjects = binding["subjects"].as_array().unwrap();
        assert_eq!(subjects.len(), 1);
        assert_eq!(subjects[0]["kind"], "ServiceAccount");
        assert_eq!(subjects[0]["name"], SERVICE_ACCOUNT);
        assert_eq!(subjects[0]["namespace"], NAMESPACE);
    }
    find(&objects, "ServiceAccount", SERVICE_ACCOUNT);
    let pod = &find(&objects, "Deployment", "proxy-operator")["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], SERVICE_ACCOUNT);
    // The Lease is taken in the Pod's namespace, which is where the Role is.
    assert_eq!(
        env_var(container(&objects), "POD_NAMESPACE")["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.namespace"
    );
}

#[test]
fn deployment_args_are_flags_the_binary_accepts() {
    let objects = objects();
    let container = container(&objects);
    assert_eq!(container["image"], "proxy-operator:dev");
    assert_eq!(container["imagePullPolicy"], "IfNotPresent");
    let mut argv = vec!["proxy-operator"];
    argv.extend(str_list(&container["args"]));
    let cli = Cli::try_parse_from(&argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    let Command::Run(run) = cli.command else {
        panic!("the Deployment does not start `run`");
    };
    assert_eq!(run.install_id, "default");
    assert!(
        run.watch_namespace.is_none(),
        "the install watches all namespaces"
    );

    // The providers config is the ConfigMap's key, mounted where --providers-config points.
    let config_dir = mount_path(container, "providers");
    assert_eq!(
        run.providers_config,
        Path::new(config_dir).join("providers.yaml")
    );
    // The ledger lives on the PVC.
    assert!(
        matches!(&run.common.ledger, LedgerLocation::Sqlite(path)
            if path.starts_with(mount_path(container, "ledger"))),
        "ledger {} is not on the ledger volume",
        run.common.ledger
    );
    // The API tokens are a file of the Secret generated by the kustomization, mounted as a
    // directory (a subPath mount never sees the Secret change, so rotation would not work).
    let token_file = run
        .common
        .discovery_token_file
        .as_deref()
        .expect("the Deployment passes --discovery-token-file");
    assert!(!run.common.insecure_no_auth);
    let token_dir = mount_path(container, "api-token");
    assert_eq!(token_file.parent(), Some(Path::new(token_dir)));
    let mount = container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "api-token")
        .unwrap();
    assert!(mount["subPath"].is_null(), "{mount}");
    let volumes =
        find(&objects, "Deployment", "proxy-operator")["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .unwrap();
    let volume = volumes.iter().find(|v| v["name"] == "api-token").unwrap();
    let generator = token_secret_generator();
    assert_eq!(volume["secret"]["secretName"], generator["name"]);
    let key = token_file.file_name().unwrap().to_str().unwrap();
    let files = str_list(&generator["files"]);
    assert_eq!(files, [format!("{key}={TOKEN_FILE}")]);
    // The API and metrics listen on the container ports.
    assert_eq!(
        u64::from(run.common.discovery_addr.port()),
        container_port(container, "http-api")
    );
    assert_eq!(
        u64::from(run.common.metrics_addr.port()),
        container_port(container, "metrics")
    );
}

#[test]
fn deployment_runs_one_non_root_replica_with_probes_and_limits() {
    let objects = objects();
    let deployment = find(&objects, "Deployment", "proxy-operator");
    assert_eq!(deployment["spec"]["replicas"], 1);
    assert_eq!(deployment["spec"]["strategy"]["type"], "Recreate");
    let pod = &deployment["spec"]["template"]["spec"];
    let selector = &deployment["spec"]["selector"]["matchLabels"];
    for (key, value) in selector.as_object().unwrap() {
        assert_eq!(
            &deployment["spec"]["template"]["metadata"]["labels"][key],
            value
        );
    }

    let container = container(&objects);
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        assert_eq!(container[probe]["httpGet"]["path"], path, "{probe}");
        assert_eq!(container[probe]["httpGet"]["port"], "http-api", "{probe}");
    }

    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    let uid = pod["securityContext"]["runAsUser"]
        .as_u64()
        .expect("numeric runAsUser");
    assert_ne!(uid, 0);
    let security = &container["securityContext"];
    assert_eq!(security["readOnlyRootFilesystem"], true);
    assert_eq!(security["allowPrivilegeEscalation"], false);
    assert_eq!(str_list(&security["capabilities"]["drop"]), ["ALL"]);

    // Only the ledger and scratch space are writable.
    for mount in container["volumeMounts"].as_array().unwrap() {
        let writable = ["ledger", "tmp"].contains(&mount["name"].as_str().unwrap());
        assert_eq!(mount["readOnly"] != true, writable, "{mount}");
    }
    let volumes = pod["volumes"].as_array().unwrap();
    let ledger = volumes.iter().find(|v| v["name"] == "ledger").unwrap();
    let claim = ledger["persistentVolumeClaim"]["claimName"]
        .as_str()
        .unwrap();
    let pvc = find(&objects, "PersistentVolumeClaim", claim);
    assert_eq!(str_list(&pvc["spec"]["accessModes"]), ["ReadWriteOnce"]);
    let tmp = volumes.iter().find(|v| v["name"] == "tmp").unwrap();
    assert!(tmp["emptyDir"].is_object());

    for kind in ["requests", "limits"] {
        for resource in ["cpu", "memory"] {
            assert!(
                container["resources"][kind][resource].is_string(),
                "no {kind}.{resource}"
            );
        }
    }

    // No token in the environment: it comes from the mounted Secret (see
    // deployment_args_are_flags_the_binary_accepts).
    assert!(
        container["env"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["name"] != "DISCOVERY_TOKEN"),
        "DISCOVERY_TOKEN in the Deployment's env"
    );
    assert_eq!(
        env_var(container, "POD_NAME")["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.name"
    );
}

#[test]
fn providers_config_map_loads_and_serves_the_kubernetes_sample() {
    let objects = objects();
    let config_map = find(&objects, "ConfigMap", "proxy-operator-providers");
    let text = config_map["data"]["providers.yaml"].as_str().unwrap();
    let config = ProvidersConfig::parse(text, Path::new("manifests/configmap.yaml"))
        .unwrap_or_else(|e| panic!("{e}"));

    let sample = std::fs::read_to_string(repo().join("samples/proxy_kubernetes.yaml")).unwrap();
    let proxies: Vec<Proxy> = serde_saphyr::from_multiple(&sample).unwrap();
    let provider = proxies[0].spec.provider.as_deref().unwrap();
    let entry = config
        .get(provider)
        .unwrap_or_else(|| panic!("the quickstart's provider {provider} is not configured"));
    assert_eq!(
        entry.kubernetes.as_ref().map(|k| k.image.as_str()),
        Some("ubuntu/squid")
    );

    let deployment = find(&objects, "Deployment", "proxy-operator");
    let volumes = deployment["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap();
    let providers = volumes.iter().find(|v| v["name"] == "providers").unwrap();
    assert_eq!(providers["configMap"]["name"], "proxy-operator-providers");
}

#[test]
fn service_exposes_the_api_and_scrapeable_metrics() {
    let objects = objects();
    let service = find(&objects, "Service", "proxy-operator");
    let container = container(&objects);
    let ports = service["spec"]["ports"].as_array().unwrap();
    let names: Vec<&str> = ports.iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["http-api", "metrics", "gateway"]);
    for port in ports {
        let name = port["name"].as_str().unwrap();
        assert_eq!(port["targetPort"], name);
        assert_eq!(port["port"].as_u64(), Some(container_port(container, name)));
    }
    let annotations = &service["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/scrape"], "true");
    assert_eq!(annotations["prometheus.io/path"], "/metrics");
    assert_eq!(
        annotations["prometheus.io/port"],
        container_port(container, "metrics").to_string()
    );
    let labels =
        &find(&objects, "Deployment", "proxy-operator")["spec"]["template"]["metadata"]["labels"];
    for (key, value) in service["spec"]["selector"].as_object().unwrap() {
        assert_eq!(&labels[key], value, "Service selector {key}");
    }
}
