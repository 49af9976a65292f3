//! The PostgreSQL install, `overlays/postgres/`, as `kubectl kustomize` renders it next to a
//! copy of `manifests/` (its base, with the token file docs/install.md has users create), against
//! the base's own rendering: three replicas rolled out one at a time, a PodDisruptionBudget
//! that selects their Pods, spread over nodes by preference only, no PersistentVolumeClaim,
//! the ledger URL from the user's Secret and its password a file of that Secret mounted
//! read-only, args the binary accepts, and everything else exactly as the base has it: an
//! overlay that changes more than the ledger and the replicas, or a base change it hides,
//! fails here.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Parser;
use serde_json::Value;

use proxy_operator::cli::{Cli, Command as CliCommand};

use crate::support::render::{Manifests, parse_objects, repo, run, tool};

/// The token the base's Secret is generated from (its value does not matter here).
const TOKEN: &str = "0123456789abcdef0123456789abcdef";
/// The overlay, relative to the repository root (its base is `../../manifests`).
const OVERLAY: &str = "overlays/postgres";
/// The Secret the user creates, with the keys `url` and `password`.
const SECRET: &str = "proxy-operator-ledger";
/// The environment variable the ledger URL comes in.
const LEDGER_ENV: &str = "PROXY_OPERATOR_LEDGER";
/// Flags that name or tune the ledger, each followed by its value.
const LEDGER_FLAGS: [&str; 4] = [
    "--ledger",
    "--ledger-max-size",
    "--ledger-durability",
    "--ledger-password-file",
];
/// Flags of the SQLite ledger only (PostgreSQL ignores them and logs so).
const SQLITE_ONLY_FLAGS: [&str; 2] = ["--ledger-max-size", "--ledger-durability"];

/// A copy of `manifests/` and, beside it, one of `overlays/postgres/`, laid out as in the
/// repository. Edit files in [`Install::overlay_dir`] to try a broken overlay.
struct Install {
    base: Manifests,
    root: tempfile::TempDir,
}

impl Install {
    fn copy() -> Install {
        let base = Manifests::copy(TOKEN);
        let root = tempfile::tempdir().expect("a temp dir");
        // The overlay's `../../manifests`: the copy of manifests/, token file included.
        std::os::unix::fs::symlink(base.dir(), root.path().join("manifests"))
            .expect("link the copy of manifests/");
        let overlay = root.path().join(OVERLAY);
        std::fs::create_dir_all(&overlay).expect("create the overlay's directory");
        let source = repo().join(OVERLAY);
        for entry in std::fs::read_dir(&source).unwrap_or_else(|e| panic!("{OVERLAY}: {e}")) {
            let entry = entry.expect("a directory entry");
            std::fs::copy(entry.path(), overlay.join(entry.file_name()))
                .unwrap_or_else(|e| panic!("copy {}: {e}", entry.path().display()));
        }
        Install { base, root }
    }

    fn overlay_dir(&self) -> PathBuf {
        self.root.path().join(OVERLAY)
    }

    /// The base's objects and the overlay's, or `None` when kubectl is missing (outside CI).
    fn render(&self) -> Option<(Vec<Value>, Vec<Value>)> {
        let base = self.base.kustomize()?;
        let kubectl = tool("kubectl")?;
        let yaml = run(Command::new(kubectl)
            .arg("kustomize")
            .arg(self.overlay_dir()));
        Some((base, parse_objects(&yaml)))
    }
}

/// The one object of `kind`.
fn only<'a>(objects: &'a [Value], kind: &str) -> &'a Value {
    let found: Vec<&Value> = objects.iter().filter(|o| o["kind"] == kind).collect();
    assert_eq!(found.len(), 1, "{} objects of kind {kind}", found.len());
    found[0]
}

fn pod_spec(deployment: &Value) -> &Value {
    &deployment["spec"]["template"]["spec"]
}

fn container(deployment: &Value) -> &Value {
    let containers = pod_spec(deployment)["containers"]
        .as_array()
        .expect("containers");
    assert_eq!(containers.len(), 1);
    &containers[0]
}

fn list<'a>(value: &'a Value, what: &str) -> &'a [Value] {
    value
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_else(|| panic!("no {what}"))
}

fn args(container: &Value) -> Vec<&str> {
    list(&container["args"], "args")
        .iter()
        .map(|a| a.as_str().expect("a string arg"))
        .collect()
}

/// The value of `flag` in `args` (`--flag value` or `--flag=value`).
fn flag_value<'a>(args: &[&'a str], flag: &str) -> Option<&'a str> {
    args.iter().enumerate().find_map(|(i, arg)| {
        if *arg == flag {
            Some(args.get(i + 1).copied().unwrap_or_default())
        } else {
            arg.strip_prefix(flag)
                .and_then(|rest| rest.strip_prefix('='))
        }
    })
}

/// Panics unless `selector` is a non-empty `matchLabels` that the Pods' `labels` satisfy.
fn assert_selects(selector: &Value, labels: &Value, what: &str) {
    assert!(selector["matchExpressions"].is_null(), "{what}: {selector}");
    let wanted = selector["matchLabels"]
        .as_object()
        .unwrap_or_else(|| panic!("{what} has no matchLabels: {selector}"));
    assert!(
        !wanted.is_empty(),
        "{what}: an empty selector selects every Pod of the namespace"
    );
    for (key, value) in wanted {
        assert_eq!(
            &labels[key], value,
            "{what} selects {key}={value}; the Pods carry {labels}"
        );
    }
}

#[test]
fn three_replicas_roll_one_at_a_time_under_a_disruption_budget() {
    let Some((_, objects)) = Install::copy().render() else {
        return;
    };
    let deployment = only(&objects, "Deployment");
    assert_eq!(deployment["spec"]["replicas"], 3);
    let strategy = &deployment["spec"]["strategy"];
    assert_eq!(strategy["type"], "RollingUpdate", "{strategy}");
    assert_eq!(strategy["rollingUpdate"]["maxSurge"], 1, "{strategy}");
    let unavailable = &strategy["rollingUpdate"]["maxUnavailable"];
    assert!(*unavailable == 0 || *unavailable == 1, "{strategy}");

    let labels = &deployment["spec"]["template"]["metadata"]["labels"];
    let budget = only(&objects, "PodDisruptionBudget");
    assert_eq!(budget["apiVersion"], "policy/v1");
    assert_eq!(
        budget["metadata"]["namespace"], deployment["metadata"]["namespace"],
        "a budget in another namespace protects nothing"
    );
    assert_selects(&budget["spec"]["selector"], labels, "the budget");
    // One eviction at a time: two of the three keep serving.
    let spec = &budget["spec"];
    let one_at_a_time = match (&spec["maxUnavailable"], &spec["minAvailable"]) {
        (Value::Number(n), Value::Null) => n.as_u64() == Some(1),
        (Value::Null, Value::Number(n)) => n.as_u64() == Some(2),
        _ => false,
    };
    assert!(one_at_a_time, "{spec}");

    // Spread over nodes, preferred only: a one-node cluster (kind) runs all three.
    let pod = pod_spec(deployment);
    let constraints = list(
        &pod["topologySpreadConstraints"],
        "topologySpreadConstraints",
    );
    assert!(
        constraints
            .iter()
            .any(|c| c["topologyKey"] == "kubernetes.io/hostname"),
        "no spread over nodes: {constraints:?}"
    );
    for constraint in constraints {
        assert_eq!(
            constraint["whenUnsatisfiable"], "ScheduleAnyway",
            "a required spread leaves replicas Pending: {constraint}"
        );
        assert_selects(&constraint["labelSelector"], labels, "a spread constraint");
    }
    assert!(
        pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            .is_null(),
        "a required anti-affinity leaves replicas Pending: {}",
        pod["affinity"]
    );
}

#[test]
fn no_persistent_volume_claim_and_no_volume_naming_one() {
    let Some((base, objects)) = Install::copy().render() else {
        return;
    };
    // The base has one, so the overlay has something to take out.
    assert!(base.iter().any(|o| o["kind"] == "PersistentVolumeClaim"));
    for object in &objects {
        assert_ne!(
            object["kind"], "PersistentVolumeClaim",
            "{}",
            object["metadata"]["name"]
        );
    }
    let deployment = only(&objects, "Deployment");
    let volumes = list(&pod_spec(deployment)["volumes"], "volumes");
    for volume in volumes {
        assert!(
            volume["persistentVolumeClaim"].is_null() && volume["ephemeral"].is_null(),
            "a volume of a claim: {volume}"
        );
    }
    // And no mount left behind by the ledger's volume: the Pod would be invalid.
    let names: BTreeSet<&str> = volumes.iter().filter_map(|v| v["name"].as_str()).collect();
    for mount in list(&container(deployment)["volumeMounts"], "volumeMounts") {
        let name = mount["name"].as_str().unwrap_or_default();
        assert!(names.contains(name), "no volume for {mount}");
    }
}

#[test]
fn the_ledger_url_and_password_come_from_the_users_secret() {
    let Some((_, objects)) = Install::copy().render() else {
        return;
    };
    let deployment = only(&objects, "Deployment");
    let container = container(deployment);
    let env = list(&container["env"], "env");
    let ledger = env
        .iter()
        .find(|e| e["name"] == LEDGER_ENV)
        .unwrap_or_else(|| panic!("no {LEDGER_ENV} in {env:?}"));
    assert!(ledger["value"].is_null(), "{ledger}");
    let key_ref = &ledger["valueFrom"]["secretKeyRef"];
    assert_eq!(key_ref["name"], SECRET, "{ledger}");
    assert_eq!(key_ref["key"], "url", "{ledger}");
    assert_ne!(key_ref["optional"], true, "{ledger}");

    let args = args(container);
    // A --ledger flag would win over the environment variable.
    assert_eq!(flag_value(&args, "--ledger"), None, "{args:?}");
    for flag in SQLITE_ONLY_FLAGS {
        assert_eq!(
            flag_value(&args, flag),
            None,
            "{flag} is SQLite's: {args:?}"
        );
    }

    // The password: a file of that Secret, mounted read-only as a directory.
    let file = Path::new(
        flag_value(&args, "--ledger-password-file")
            .unwrap_or_else(|| panic!("no --ledger-password-file in {args:?}")),
    );
    let mount = list(&container["volumeMounts"], "volumeMounts")
        .iter()
        .find(|m| m["mountPath"].as_str().map(Path::new) == file.parent())
        .unwrap_or_else(|| panic!("nothing mounted at the directory of {}", file.display()));
    assert_eq!(mount["readOnly"], true, "{mount}");
    assert!(mount["subPath"].is_null(), "{mount}");
    let volume = list(&pod_spec(deployment)["volumes"], "volumes")
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap_or_else(|| panic!("no volume for {mount}"));
    assert_eq!(volume["secret"]["secretName"], SECRET, "{volume}");
    let name = file
        .file_name()
        .and_then(|n| n.to_str())
        .expect("a file name");
    let key = match volume["secret"]["items"].as_array() {
        Some(items) => items
            .iter()
            .find(|item| item["path"] == name)
            .and_then(|item| item["key"].as_str()),
        None => Some(name),
    };
    assert_eq!(key, Some("password"), "{} in {volume}", file.display());
    // The binary takes the args, and reads the password from that file.
    let mut argv = vec!["proxy-operator"];
    argv.extend(&args);
    let cli = Cli::try_parse_from(&argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    let CliCommand::Run(run) = cli.command else {
        panic!("the Deployment does not start `run`");
    };
    assert_eq!(run.common.ledger_password_file.as_deref(), Some(file));

    // Not in the environment as well.
    for var in env {
        let from = &var["valueFrom"]["secretKeyRef"];
        assert!(
            var["name"] != "PGPASSWORD" && !(from["name"] == SECRET && from["key"] == "password"),
            "{var}"
        );
    }
    assert!(container["envFrom"].is_null(), "{}", container["envFrom"]);

    // Nothing secret ships: the ledger's Secret is the user's, and the only Secret rendered
    // is the API tokens' (generated from the user's file, as in the base).
    let secrets: Vec<&str> = objects
        .iter()
        .filter(|o| o["kind"] == "Secret")
        .map(|o| o["metadata"]["name"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(secrets, ["proxy-operator-api"]);
}

/// `kind namespace/name`.
fn key(object: &Value) -> String {
    let field = |value: &Value| value.as_str().unwrap_or_default().to_owned();
    format!(
        "{} {}/{}",
        field(&object["kind"]),
        field(&object["metadata"]["namespace"]),
        field(&object["metadata"]["name"])
    )
}

/// `args` without [`LEDGER_FLAGS`] and their values.
fn without_ledger_flags(args: &[Value]) -> Vec<Value> {
    let mut kept = Vec::new();
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        let arg_str = arg.as_str().unwrap_or_default();
        if LEDGER_FLAGS.contains(&arg_str) {
            iter.next();
        } else if !LEDGER_FLAGS
            .iter()
            .any(|flag| arg_str.starts_with(&format!("{flag}=")))
        {
            kept.push(arg.clone());
        }
    }
    kept
}

/// `deployment` without what the overlay changes on purpose: the replicas, the strategy, the
/// spread, the ledger's flags, variable, volume (the base's claim, the overlay's Secret) and
/// its mount.
fn without_the_ledger(deployment: &mut Value) {
    let spec = deployment["spec"]
        .as_object_mut()
        .expect("a Deployment spec");
    spec.remove("replicas");
    spec.remove("strategy");
    let pod = deployment["spec"]["template"]["spec"]
        .as_object_mut()
        .expect("a Pod spec");
    pod.remove("topologySpreadConstraints");
    let mut ledger_volumes = BTreeSet::new();
    if let Some(Value::Array(volumes)) = pod.get_mut("volumes") {
        volumes.retain(|volume| {
            let ledger = volume["persistentVolumeClaim"].is_object()
                || volume["secret"]["secretName"] == SECRET;
            if ledger {
                ledger_volumes.insert(volume["name"].as_str().unwrap_or_default().to_owned());
            }
            !ledger
        });
    }
    let Some(Value::Array(containers)) = pod.get_mut("containers") else {
        panic!("no containers");
    };
    for container in containers {
        if let Some(args) = container["args"].as_array() {
            container["args"] = Value::Array(without_ledger_flags(args));
        }
        if let Some(env) = container["env"].as_array_mut() {
            env.retain(|var| var["name"] != LEDGER_ENV);
        }
        if let Some(mounts) = container["volumeMounts"].as_array_mut() {
            mounts.retain(|mount| {
                !ledger_volumes.contains(mount["name"].as_str().unwrap_or_default())
            });
        }
    }
}

/// The path and both sides of the first difference between `base` and `overlay`.
fn first_difference(path: &str, base: &Value, overlay: &Value) -> Option<String> {
    match (base, overlay) {
        (Value::Object(a), Value::Object(b)) => a
            .keys()
            .chain(b.keys())
            .find_map(|k| first_difference(&format!("{path}.{k}"), &base[k], &overlay[k])),
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => a
            .iter()
            .zip(b)
            .enumerate()
            .find_map(|(i, (a, b))| first_difference(&format!("{path}[{i}]"), a, b)),
        _ if base == overlay => None,
        _ => Some(format!("{path}: base {base}, overlay {overlay}")),
    }
}

/// The first difference between the base's objects and the overlay's beyond what the overlay
/// is for: the ledger's PersistentVolumeClaim (base only), the PodDisruptionBudget (overlay
/// only) and [`without_the_ledger`] of the Deployment.
fn drift(base: &[Value], overlay: &[Value]) -> Option<String> {
    let by_key = |objects: &[Value], leave_out: &str| {
        let mut map = BTreeMap::new();
        for object in objects {
            let mut object = object.clone();
            let key = key(&object);
            if key == leave_out {
                continue;
            }
            if object["kind"] == "Deployment" {
                without_the_ledger(&mut object);
            }
            assert!(map.insert(key.clone(), object).is_none(), "{key} twice");
        }
        map
    };
    let base = by_key(
        base,
        "PersistentVolumeClaim proxy-operator/proxy-operator-ledger",
    );
    let overlay = by_key(overlay, "PodDisruptionBudget proxy-operator/proxy-operator");
    let base_keys: Vec<&String> = base.keys().collect();
    let overlay_keys: Vec<&String> = overlay.keys().collect();
    if base_keys != overlay_keys {
        return Some(format!(
            "objects: base {base_keys:?}, overlay {overlay_keys:?}"
        ));
    }
    base.iter().find_map(|(key, object)| {
        first_difference("", object, &overlay[key]).map(|d| format!("{key}{d}"))
    })
}

#[test]
fn everything_but_the_ledger_and_the_replicas_is_the_base() {
    let Some((base, overlay)) = Install::copy().render() else {
        return;
    };
    if let Some(difference) = drift(&base, &overlay) {
        panic!("overlays/postgres changes more than the ledger and the replicas: {difference}");
    }
}

/// The comparison above sees a change the overlay makes to the rest of the install: the
/// Deployment's image, and an annotation on every object.
#[test]
fn a_change_beyond_the_ledger_is_drift() {
    for (edit, expected) in [
        (
            "images:\n  - name: proxy-operator\n    newTag: other\n",
            ".spec.template.spec.containers[0].image",
        ),
        (
            "commonAnnotations:\n  example.com/drift: \"yes\"\n",
            ".metadata.annotations",
        ),
    ] {
        let install = Install::copy();
        let path = install.overlay_dir().join("kustomization.yaml");
        let text = std::fs::read_to_string(&path).expect("read the kustomization");
        std::fs::write(&path, text + edit).expect("write the kustomization");
        let Some((base, overlay)) = install.render() else {
            return;
        };
        let difference =
            drift(&base, &overlay).unwrap_or_else(|| panic!("{edit:?} went unnoticed"));
        assert!(difference.contains(expected), "{edit:?}: {difference}");
    }
}
