//! Tenants in the install (docs/tenants.md): `overlays/tenants/` (manifests/ with the user's
//! Secret `proxy-operator-tenants` mounted read-only and passed as `--tenants-file`),
//! `overlays/tenants/with-postgres/` (the same on top of `overlays/postgres/`), the chart's
//! `tenants.*` values (compared with the overlay in `helm_chart.rs`) and the example tenants
//! file.
//!
//! Each overlay is rendered with `kubectl kustomize` next to copies of the installs it goes on,
//! and must differ from that install by exactly the flag, the mount and the Secret's volume
//! (an overlay that changes more, or mounts the file where the flag does not look, fails
//! here); `manifests/` itself stays without tenants. On a real API server the overlay is applied
//! server-side the way docs/tenants.md says, and its own Pod, run by the test kubelet, serves
//! each team its scope and quota, and takes a token rotated in the Secret without a restart.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Parser;
use kube::api::{Patch, PatchParams};
use reqwest::StatusCode;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use proxy_operator::cli::{Cli, Command as CliCommand, RunArgs};

use super::pod::{
    API_PORT, DEPLOYMENT, NAMESPACE, POD_READY, kubectl, new_token, proxies, wait_proxy_ready,
};
use crate::support::pod::PodHost;
use crate::support::render::{Manifests, parse_objects, repo, run, tool};
use crate::support::world::within;
use crate::support::{ControlPlane, Squid, Target};

/// The token the base's Secret is generated from (its value does not matter here).
const TOKEN: &str = "0123456789abcdef0123456789abcdef";
/// The Secret the user creates (docs/tenants.md), and its key (`--from-file=tenants.yaml`).
pub(super) const SECRET: &str = "proxy-operator-tenants";
pub(super) const KEY: &str = "tenants.yaml";
/// The flag the overlay and the chart add.
const FLAG: &str = "--tenants-file";
/// The overlay on `manifests/`, and the one on `overlays/postgres/`.
pub(super) const OVERLAY: &str = "overlays/tenants";
const WITH_POSTGRES: &str = "overlays/tenants/with-postgres";
/// The example tenants file, and the published example tokens its digests are of.
const EXAMPLE: &str = "overlays/tenants/tenants.example.yaml";
const EXAMPLE_TOKENS: [(&str, &str); 2] = [
    ("team-a", "example-token-of-team-a"),
    ("team-b", "example-token-of-team-b"),
];

/// A copy of `manifests/` (with its token file) and of `overlays/`, laid out as in the
/// repository. Edit files under [`Layout::path`] to try a broken overlay.
pub(super) struct Layout {
    base: Manifests,
}

impl Layout {
    pub(super) fn copy() -> Layout {
        Layout::copy_with_token(TOKEN)
    }

    fn copy_with_token(token: &str) -> Layout {
        let base = Manifests::copy(token);
        let layout = Layout { base };
        copy_dir(&repo().join("overlays"), &layout.path("overlays"));
        layout
    }

    fn root(&self) -> &Path {
        self.base
            .dir()
            .parent()
            .expect("the copy of manifests/ has a parent")
    }

    /// `relative` (e.g. `overlays/tenants`) in the copy.
    pub(super) fn path(&self, relative: &str) -> PathBuf {
        self.root().join(relative)
    }

    /// `kubectl kustomize` of `relative` in the copy, or `None` when kubectl is missing
    /// (outside CI).
    pub(super) fn kustomize(&self, relative: &str) -> Option<Vec<Value>> {
        let kubectl = tool("kubectl")?;
        let yaml = run(Command::new(kubectl)
            .arg("kustomize")
            .arg(self.path(relative)));
        Some(parse_objects(&yaml))
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap_or_else(|e| panic!("create {}: {e}", to.display()));
    for entry in std::fs::read_dir(from).unwrap_or_else(|e| panic!("{}: {e}", from.display())) {
        let entry = entry.expect("a directory entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("its type").is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target)
                .unwrap_or_else(|e| panic!("copy {}: {e}", entry.path().display()));
        }
    }
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

fn by_key(objects: &[Value]) -> BTreeMap<String, Value> {
    let mut map = BTreeMap::new();
    for object in objects {
        assert!(
            map.insert(key(object), object.clone()).is_none(),
            "{} twice",
            key(object)
        );
    }
    map
}

/// The path and both sides of the first difference between `without` and `with`.
fn first_difference(path: &str, without: &Value, with: &Value) -> Option<String> {
    match (without, with) {
        (Value::Object(a), Value::Object(b)) => a
            .keys()
            .chain(b.keys())
            .find_map(|k| first_difference(&format!("{path}.{k}"), &without[k], &with[k])),
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => a
            .iter()
            .zip(b)
            .enumerate()
            .find_map(|(i, (a, b))| first_difference(&format!("{path}[{i}]"), a, b)),
        _ if without == with => None,
        _ => Some(format!("{path}: without tenants {without}, with {with}")),
    }
}

/// The `run` arguments of a Deployment's container, as the binary parses them.
pub(super) fn run_args(container: &Value) -> RunArgs {
    let mut argv = vec!["proxy-operator".to_owned()];
    argv.extend(
        container["args"]
            .as_array()
            .expect("the container has args")
            .iter()
            .map(|a| a.as_str().expect("a string arg").to_owned()),
    );
    let cli = Cli::try_parse_from(&argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    let CliCommand::Run(run) = cli.command else {
        panic!("the Deployment does not start `run`");
    };
    run
}

/// Takes the tenants' flag, mount and volume out of `deployment` (rendered with tenants, the
/// file in Secret `secret` under key `key`), checking each: the flag once, naming a file in a
/// directory mounted read-only (no subPath, so a Secret edit reaches it), from a volume of
/// that Secret whose file of that name is the key, readable by the Pod's group only.
fn take_tenants(deployment: &mut Value, secret: &str, key: &str) -> Result<(), String> {
    let container = &mut deployment["spec"]["template"]["spec"]["containers"][0];
    let file = run_args(container)
        .common
        .tenants_file
        .ok_or_else(|| format!("no {FLAG} in {}", container["args"]))?;
    let args = container["args"].as_array_mut().ok_or("no args")?;
    let at = args
        .iter()
        .position(|a| a == FLAG)
        .ok_or_else(|| format!("{FLAG} is not given as `{FLAG} PATH`"))?;
    args.drain(at..at + 2);
    if args
        .iter()
        .any(|a| a.as_str().is_some_and(|a| a.starts_with(FLAG)))
    {
        return Err(format!("{FLAG} given twice"));
    }
    let mounts = container["volumeMounts"]
        .as_array_mut()
        .ok_or("no volumeMounts")?;
    let at = mounts
        .iter()
        .position(|m| m["mountPath"].as_str().map(Path::new) == file.parent())
        .ok_or_else(|| format!("nothing is mounted at the directory of {}", file.display()))?;
    let mount = mounts.remove(at);
    if mount["readOnly"] != true {
        return Err(format!("the tenants mount is not read-only: {mount}"));
    }
    if !mount["subPath"].is_null() {
        return Err(format!(
            "a subPath mount never sees the Secret change: {mount}"
        ));
    }
    let volumes = deployment["spec"]["template"]["spec"]["volumes"]
        .as_array_mut()
        .ok_or("no volumes")?;
    let at = volumes
        .iter()
        .position(|v| v["name"] == mount["name"])
        .ok_or_else(|| format!("no volume for {mount}"))?;
    let volume = volumes.remove(at);
    let source = &volume["secret"];
    if source["secretName"] != secret {
        return Err(format!(
            "the tenants volume is not Secret {secret}: {volume}"
        ));
    }
    if source["optional"] == true {
        return Err(format!(
            "an optional Secret starts the Pod without it: {volume}"
        ));
    }
    if source["defaultMode"] != 0o440 {
        return Err(format!("the tenants file is not mode 0440: {volume}"));
    }
    let name = file
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    let projected = match source["items"].as_array() {
        Some(items) => items
            .iter()
            .find(|item| item["path"] == name)
            .and_then(|item| item["key"].as_str()),
        None => Some(name),
    };
    if projected != Some(key) {
        return Err(format!(
            "{} is not the Secret's key {key}: {volume}",
            file.display()
        ));
    }
    Ok(())
}

/// Whether `with` is `without` plus the tenants (Secret `secret`, key `key`): the same
/// objects, equal but for the Deployment's [`take_tenants`]. The first difference otherwise.
pub(super) fn tenants_added(
    without: &[Value],
    with: &[Value],
    secret: &str,
    key: &str,
) -> Result<(), String> {
    let without = by_key(without);
    let mut with = by_key(with);
    let without_keys: Vec<&String> = without.keys().collect();
    let with_keys: Vec<&String> = with.keys().collect();
    if without_keys != with_keys {
        return Err(format!(
            "objects: without tenants {without_keys:?}, with {with_keys:?}"
        ));
    }
    let deployments: Vec<String> = with
        .keys()
        .filter(|k| k.starts_with("Deployment "))
        .cloned()
        .collect();
    if deployments.len() != 1 {
        return Err(format!("Deployments: {deployments:?}"));
    }
    take_tenants(with.get_mut(&deployments[0]).expect("listed"), secret, key)?;
    for (name, object) in &without {
        if let Some(difference) = first_difference("", object, &with[name]) {
            return Err(format!("{name}{difference}"));
        }
    }
    Ok(())
}

fn deployment(objects: &[Value]) -> &Value {
    let found: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] == "Deployment")
        .collect();
    assert_eq!(found.len(), 1, "{} Deployments", found.len());
    found[0]
}

#[test]
fn the_overlay_is_manifests_plus_the_tenants_mount_and_flag() {
    let layout = Layout::copy();
    let (Some(base), Some(overlay)) = (layout.kustomize("manifests"), layout.kustomize(OVERLAY))
    else {
        return;
    };
    if let Err(difference) = tenants_added(&base, &overlay, SECRET, KEY) {
        panic!("{OVERLAY} is not manifests/ plus the tenants: {difference}");
    }
    // The flag as the binary reads it: the file of the mounted Secret.
    let container = &deployment(&overlay)["spec"]["template"]["spec"]["containers"][0];
    let run = run_args(container);
    assert_eq!(
        run.common.tenants_file.as_deref(),
        Some(Path::new("/etc/proxy-operator-tenants/tenants.yaml"))
    );
    // The API token file stays: its tokens are the tenant `default`.
    assert!(run.common.discovery_token_file.is_some());
    // Nothing secret ships: the tenants' Secret is the user's, and the only Secret rendered is
    // the API tokens' (generated from the user's file, as in the base).
    let secrets: Vec<&str> = overlay
        .iter()
        .filter(|o| o["kind"] == "Secret")
        .map(|o| o["metadata"]["name"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(secrets, ["proxy-operator-api"]);
}

/// `manifests/` stays the install without tenants: no flag, no volume of the tenants' Secret.
#[test]
fn the_base_install_has_no_tenants() {
    let Some(base) = Layout::copy().kustomize("manifests") else {
        return;
    };
    let deployment = deployment(&base);
    let run = run_args(&deployment["spec"]["template"]["spec"]["containers"][0]);
    assert_eq!(run.common.tenants_file, None);
    let volumes = deployment["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .expect("volumes");
    assert!(
        volumes.iter().all(|v| v["secret"]["secretName"] != SECRET),
        "{volumes:?}"
    );
    let text = std::fs::read_to_string(repo().join("manifests/deployment.yaml"))
        .expect("read manifests/deployment.yaml");
    assert!(
        !text.contains("tenants"),
        "manifests/deployment.yaml names tenants"
    );
}

/// The overlay composes with the PostgreSQL one: `with-postgres` is `overlays/postgres` plus
/// exactly the same tenants, the ledger's Secret and replicas untouched.
#[test]
fn with_postgres_is_the_postgres_overlay_plus_the_tenants() {
    let layout = Layout::copy();
    let (Some(postgres), Some(both)) = (
        layout.kustomize("overlays/postgres"),
        layout.kustomize(WITH_POSTGRES),
    ) else {
        return;
    };
    if let Err(difference) = tenants_added(&postgres, &both, SECRET, KEY) {
        panic!("{WITH_POSTGRES} is not overlays/postgres plus the tenants: {difference}");
    }
    let deployment = deployment(&both);
    assert_eq!(deployment["spec"]["replicas"], 3);
    let run = run_args(&deployment["spec"]["template"]["spec"]["containers"][0]);
    assert!(run.common.ledger_password_file.is_some());
    // And the tenants are the same as on manifests/: one Component, mounted alike.
    let Some(overlay) = layout.kustomize(OVERLAY) else {
        return;
    };
    let container = |objects: &[Value]| {
        let pod = &self::deployment(objects)["spec"]["template"]["spec"];
        let tenants = |list: &Value| {
            list.as_array()
                .expect("a list")
                .iter()
                .filter(|v| v["name"] == "tenants")
                .cloned()
                .collect::<Vec<_>>()
        };
        (
            tenants(&pod["volumes"]),
            tenants(&pod["containers"][0]["volumeMounts"]),
            run_args(&pod["containers"][0]).common.tenants_file,
        )
    };
    assert_eq!(container(&both), container(&overlay));
}

/// The comparison is not vacuous: an overlay that mounts the file elsewhere than the flag
/// reads it, writably, from another Secret, or changes anything else, fails it.
#[test]
fn a_broken_or_wider_overlay_is_noticed() {
    let component = "overlays/tenants/component/deployment.yaml";
    for (file, from, to, expected) in [
        (
            component,
            "mountPath: /etc/proxy-operator-tenants",
            "mountPath: /etc/tenants",
            "nothing is mounted at the directory of /etc/proxy-operator-tenants/tenants.yaml",
        ),
        (
            component,
            "readOnly: true",
            "readOnly: false",
            "not read-only",
        ),
        (
            component,
            "secretName: proxy-operator-tenants",
            "secretName: proxy-operator-api",
            "is not Secret proxy-operator-tenants",
        ),
        (
            component,
            "path: tenants.yaml",
            "path: teams.yaml",
            "is not the Secret's key tenants.yaml",
        ),
        (
            "overlays/tenants/kustomization.yaml",
            "components:",
            "commonAnnotations:\n  example.com/drift: \"yes\"\ncomponents:",
            ".metadata.annotations",
        ),
    ] {
        let layout = Layout::copy();
        let path = layout.path(file);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert!(text.contains(from), "{file} no longer holds {from:?}");
        std::fs::write(&path, text.replacen(from, to, 1)).expect("write the edit");
        let (Some(base), Some(overlay)) =
            (layout.kustomize("manifests"), layout.kustomize(OVERLAY))
        else {
            return;
        };
        let difference = tenants_added(&base, &overlay, SECRET, KEY)
            .err()
            .unwrap_or_else(|| panic!("{to:?} in {file} went unnoticed"));
        assert!(difference.contains(expected), "{to:?}: {difference}");
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The example tenants file loads as the binary loads `--tenants-file`, says what
/// docs/tenants.md says it does, and its digests are those of the published example tokens,
/// never of a real one.
#[test]
fn the_example_tenants_file_loads_and_holds_only_example_digests() {
    let path = repo().join(EXAMPLE);
    let loaded = proxy_operator::serving::tenants::load(&path)
        .unwrap_or_else(|e| panic!("the binary refuses {EXAMPLE}: {e}"));
    let names: Vec<&str> = loaded.tenants.iter().map(|t| &*t.name).collect();
    assert_eq!(names, ["team-a", "team-b"]);
    let scopes: Vec<String> = loaded.tenants.iter().map(|t| t.scope.to_string()).collect();
    assert_eq!(scopes, ["namespace in (crawl-a)", "team=b"]);
    let team_a = &loaded.tenants[0].quotas;
    assert_eq!((team_a.leases, team_a.sessions), (Some(20), Some(10)));
    let rate = team_a.rate.as_ref().expect("team-a has a rate");
    assert_eq!((rate.per_second, rate.burst), (5.0, 10));
    let digests: Vec<(String, String)> = loaded
        .tokens
        .iter()
        .map(|(digest, tenant)| (tenant.name.to_string(), hex(digest)))
        .collect();
    let examples: Vec<(String, String)> = EXAMPLE_TOKENS
        .iter()
        .map(|(tenant, token)| ((*tenant).to_owned(), hex(&Sha256::digest(token))))
        .collect();
    assert_eq!(
        digests, examples,
        "{EXAMPLE} holds a digest of a token other than the published example tokens"
    );
    // The file tells readers to replace them, and names the tokens it holds.
    let text = std::fs::read_to_string(&path).expect("read the example");
    assert!(text.contains("REPLACE BOTH DIGESTS"), "{text}");
    for (_, token) in EXAMPLE_TOKENS {
        assert!(text.contains(token), "{EXAMPLE} does not name {token}");
    }
    // The file docs/tenants.md writes in its walkthrough is this one, its own digests aside.
    let page = std::fs::read_to_string(repo().join("docs/tenants.md")).expect("read the page");
    let heredoc = page
        .split_once("cat > tenants.yaml <<EOF\n")
        .and_then(|(_, rest)| rest.split_once("\nEOF\n"))
        .map(|(file, _)| file)
        .expect("docs/tenants.md writes tenants.yaml with a heredoc");
    let written = heredoc
        .replace("$DIGEST_A", &format!("sha256:{}", examples[0].1))
        .replace("$DIGEST_B", &format!("sha256:{}", examples[1].1));
    let walkthrough = proxy_operator::serving::tenants::TenantsFile::new("docs/tenants.md")
        .parse(written.into_bytes())
        .unwrap_or_else(|e| panic!("the walkthrough's tenants file: {e}"));
    assert_eq!(walkthrough.tenants, loaded.tenants);

    // Nothing of it is installed: no rendering of the overlays holds one of its digests.
    let layout = Layout::copy();
    for dir in [OVERLAY, WITH_POSTGRES] {
        let Some(objects) = layout.kustomize(dir) else {
            return;
        };
        let rendered = serde_json::to_string(&objects).expect("JSON");
        for (_, digest) in &examples {
            assert!(
                !rendered.contains(digest.as_str()),
                "{dir} installs the example"
            );
        }
    }
}

/// A tenants file for two teams: team A scoped to `namespace_a` with at most one lease, team
/// B to the label `team=b`, each token given as its digest.
fn tenants_file(a: &[&str], b: &[&str], namespace_a: &str) -> String {
    let digests = |tokens: &[&str]| {
        tokens
            .iter()
            .map(|t| format!("\"sha256:{}\"", hex(&Sha256::digest(t))))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "tenants:\n\
         \x20 - name: team-a\n\
         \x20   tokens: [{}]\n\
         \x20   scope:\n\
         \x20     namespaces: [{namespace_a}]\n\
         \x20   quotas:\n\
         \x20     leases: 1\n\
         \x20 - name: team-b\n\
         \x20   tokens: [{}]\n\
         \x20   scope:\n\
         \x20     selector: {{team: b}}\n",
        digests(a),
        digests(b)
    )
}

/// docs/tenants.md's Secret step: `kubectl create secret generic … --from-file=tenants.yaml`
/// (first time), or the same through `--dry-run=client -o yaml | kubectl apply -f -` (an edit).
fn write_secret(kubeconfig: &Path, dir: &Path, content: &str, first: bool) {
    std::fs::write(dir.join(KEY), content).expect("write tenants.yaml");
    let kubectl = || {
        let mut command = Command::new(tool("kubectl").expect("kubectl was found"));
        command.current_dir(dir).arg("--kubeconfig").arg(kubeconfig);
        command
    };
    let create = [
        "-n",
        NAMESPACE,
        "create",
        "secret",
        "generic",
        SECRET,
        "--from-file=tenants.yaml",
    ];
    if first {
        run(kubectl().args(create));
    } else {
        let yaml = run(kubectl()
            .args(create)
            .args(["--dry-run=client", "-o", "yaml"]));
        let file = dir.join("secret.yaml");
        std::fs::write(&file, yaml).expect("write the Secret");
        run(kubectl().args(["apply", "-f"]).arg(&file));
    }
}

/// An External Proxy `name` in `namespace` with `labels`, through `squid`, probing `target`.
async fn apply_proxy(
    plane: &'static ControlPlane,
    namespace: &str,
    name: &str,
    labels: Value,
    squid: &Squid,
    target: &Target,
) {
    let proxy = json!({
        "apiVersion": "crawl.example.com/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "mode": "External",
            "endpoint": {"host": "127.0.0.1", "port": squid.port()},
            "maxLeases": 5,
            "healthCheck": {
                "probeURL": target.http_url(),
                "interval": "1s",
                "timeout": "1s",
                "failureThreshold": 2,
            },
        },
    });
    proxies(plane, namespace)
        .patch(
            name,
            &PatchParams::apply("install-test").force(),
            &Patch::Apply(&proxy),
        )
        .await
        .unwrap_or_else(|e| panic!("apply Proxy {namespace}/{name}: {e}"));
}

/// `namespace/name` of every proxy `token` lists, sorted; `None` until the API answers 200.
async fn listed(http: &reqwest::Client, api: &str, token: &str) -> Option<Vec<String>> {
    let response = http
        .get(format!("{api}/v1/proxies"))
        .bearer_auth(token)
        .send()
        .await
        .ok()?;
    if response.status() != StatusCode::OK {
        return None;
    }
    let body: Value = response.json().await.ok()?;
    let mut names: Vec<String> = body["proxies"]
        .as_array()?
        .iter()
        .map(|p| {
            Some(format!(
                "{}/{}",
                p["namespace"].as_str()?,
                p["name"].as_str()?
            ))
        })
        .collect::<Option<_>>()?;
    names.sort();
    Some(names)
}

async fn list_status(http: &reqwest::Client, api: &str, token: &str) -> Option<StatusCode> {
    http.get(format!("{api}/v1/proxies"))
        .bearer_auth(token)
        .send()
        .await
        .ok()
        .map(|r| r.status())
}

/// docs/tenants.md on a real API server: the Secret created with kubectl, the overlay applied
/// server-side, and the Deployment's own Pod run by the test kubelet. Each team lists and
/// leases only its scope, team A's second lease is refused for its quota (429,
/// `Retry-After`), the install's own token still sees everything, a token rotated in the
/// Secret is taken without a restart, and a broken edit of the Secret keeps the last good
/// tenants.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tenants_overlay_runs_as_its_own_pod() {
    let Some(plane) = ControlPlane::dedicated("install-tenants", &[]) else {
        return;
    };
    let Some(host) = PodHost::new(plane).await else {
        return;
    };
    if tool("kubectl").is_none() {
        return;
    }
    let http = crate::support::http::client();
    let admin = new_token();
    let layout = Layout::copy_with_token(&admin);
    let kubeconfig = layout.path("admin.kubeconfig");
    plane.write_admin_kubeconfig(&kubeconfig);
    let namespace_a = plane.new_namespace("crawl-a").await;
    let namespace_b = plane.new_namespace("crawl-b").await;
    let (team_a, team_b) = (new_token(), new_token());

    // The steps of docs/tenants.md: the namespace, the Secret, the overlay.
    kubectl(&kubeconfig, &["create", "namespace", NAMESPACE]);
    let secret_dir = tempfile::tempdir().expect("a temp dir");
    write_secret(
        &kubeconfig,
        secret_dir.path(),
        &tenants_file(&[&team_a], &[&team_b], &namespace_a),
        true,
    );
    let overlay = layout.path(OVERLAY);
    kubectl(
        &kubeconfig,
        &[
            "apply",
            "--server-side",
            "-k",
            overlay.to_str().expect("a UTF-8 path"),
        ],
    );

    let pod = host.start(NAMESPACE, DEPLOYMENT).await;
    pod.wait_ready(POD_READY).await;
    let api = format!("http://{}:{API_PORT}", pod.ip());

    // One proxy per team: team A's by namespace, team B's by label (in another namespace).
    let target = Target::start();
    let squid = Squid::start();
    apply_proxy(
        plane,
        &namespace_a,
        "squid-a",
        json!({"team": "a"}),
        &squid,
        &target,
    )
    .await;
    apply_proxy(
        plane,
        &namespace_b,
        "squid-b",
        json!({"team": "b"}),
        &squid,
        &target,
    )
    .await;
    wait_proxy_ready(plane, &namespace_a, "squid-a", &pod).await;
    wait_proxy_ready(plane, &namespace_b, "squid-b", &pod).await;
    let (a, b) = (
        format!("{namespace_a}/squid-a"),
        format!("{namespace_b}/squid-b"),
    );
    let mut both = vec![a.clone(), b.clone()];
    both.sort();
    for (token, expected) in [
        (&team_a, vec![a.clone()]),
        (&team_b, vec![b.clone()]),
        (&admin, both),
    ] {
        let seen = within(POD_READY, "the proxies listed", || async {
            listed(&http, &api, token)
                .await
                .filter(|names| names.len() == expected.len())
        })
        .await;
        assert_eq!(seen, expected);
    }

    // Team A's lease is on its proxy; a second one is over its quota of one lease.
    let acquire = || async {
        http.post(format!("{api}/v1/leases"))
            .bearer_auth(&team_a)
            .json(&json!({"target": "example.com"}))
            .send()
            .await
            .expect("POST /v1/leases")
    };
    let first = acquire().await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let lease: Value = first.json().await.expect("a lease");
    assert_eq!(lease["proxy"]["namespace"], namespace_a.as_str(), "{lease}");
    let refused = acquire().await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(
        refused.headers().contains_key("retry-after"),
        "{:?}",
        refused.headers()
    );
    let body: Value = refused.json().await.expect("a JSON body");
    assert_eq!(body["error"], "quota_exceeded", "{body}");
    assert_eq!(body["tenant"], "team-a", "{body}");
    assert_eq!(body["quota"], "leases", "{body}");

    // Rotation of team B's token through the Secret, as docs/tenants.md says: the new digest
    // added, then the old one removed; no restart.
    let rotated = new_token();
    write_secret(
        &kubeconfig,
        secret_dir.path(),
        &tenants_file(&[&team_a], &[&team_b, &rotated], &namespace_a),
        false,
    );
    within(POD_READY, "the rotated token accepted", || async {
        (listed(&http, &api, &rotated).await == Some(vec![b.clone()])).then_some(())
    })
    .await;
    write_secret(
        &kubeconfig,
        secret_dir.path(),
        &tenants_file(&[&team_a], &[&rotated], &namespace_a),
        false,
    );
    within(POD_READY, "the old token refused", || async {
        (list_status(&http, &api, &team_b).await == Some(StatusCode::UNAUTHORIZED)).then_some(())
    })
    .await;

    // A broken edit: logged, and the last good tenants stay.
    write_secret(
        &kubeconfig,
        secret_dir.path(),
        "tenants:\n  - name: Team_B\n    tokens: [\"sha256:00\"]\n",
        false,
    );
    within(POD_READY, "the broken tenants file logged", || async {
        pod.logs()
            .contains("keeping the previous tenants")
            .then_some(())
    })
    .await;
    assert_eq!(listed(&http, &api, &rotated).await, Some(vec![b.clone()]));
    assert_eq!(
        pod.pids().len(),
        1,
        "a tenants change restarted the container"
    );
    assert_eq!(pod.restarts(), 0);
}
