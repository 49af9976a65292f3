//! `proxy-operator proxies import`: the built binary on a list holding every line form, its
//! output read back, created on a real API server (server-side apply, and `kubectl apply -f -`)
//! and served by `proxy-operator standalone`; a bad or repeated line refused with its number
//! and nothing printed.

use crate::support;

use std::collections::BTreeSet;
use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Instant;

use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ListParams};
use proxy_operator::credentials::{CREDENTIALS_SECRET_LABEL, Credentials};
use proxy_operator::resources::proxy::{EndpointProtocol, Proxy};
use serde_json::Value;
use support::standalone::Standalone;
use support::{DEADLINE, Target};

/// Every line form, with a comment and a blank line.
const LIST: &str = "\
# acme, eu edition
10.0.0.1:3128

10.0.0.2:3128:alice:s3cret
http://proxy-a.example:8080
http://bob:p%40ss%3Aword@Proxy-B.example:8081/
socks5://proxy-c.example:1080
socks5h://carol:c%2Fpw@[2001:db8::5]:1080
";

/// A Proxy's host, port, protocol, and the user name and password of its Secret.
type Reached = (String, i32, EndpointProtocol, Option<(String, String)>);

/// What each proxy of [`LIST`] must become.
fn expected() -> Vec<Reached> {
    let creds = |u: &str, p: &str| Some((u.to_owned(), p.to_owned()));
    let http = EndpointProtocol::Http;
    let socks5 = EndpointProtocol::Socks5;
    [
        ("10.0.0.1", 3128, http, None),
        ("10.0.0.2", 3128, http, creds("alice", "s3cret")),
        ("proxy-a.example", 8080, http, None),
        ("proxy-b.example", 8081, http, creds("bob", "p@ss:word")),
        ("proxy-c.example", 1080, socks5, None),
        ("2001:db8::5", 1080, socks5, creds("carol", "c/pw")),
    ]
    .into_iter()
    .map(|(host, port, protocol, credentials)| (host.to_owned(), port, protocol, credentials))
    .collect()
}

/// `proxy-operator proxies import <args>`, with `stdin` fed to it.
fn import(args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_proxy-operator"))
        .args(["proxies", "import"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start proxy-operator proxies import");
    child
        .stdin
        .take()
        .expect("its stdin")
        .write_all(stdin.as_bytes())
        .expect("write its stdin");
    child.wait_with_output().expect("wait for it")
}

/// The list written to `dir/<file>` and imported with `args`; asserts it succeeded and
/// returns the YAML.
fn import_file(dir: &Path, file: &str, list: &str, args: &[&str]) -> String {
    let path = dir.join(file);
    std::fs::write(&path, list).expect("write the list");
    let path = path.to_str().expect("a UTF-8 path");
    let output = import(&[&[path], args].concat(), "");
    assert!(
        output.status.success(),
        "import {file}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("UTF-8 YAML")
}

/// The Proxies and Secrets of an import's output, in order.
fn objects(yaml: &str) -> (Vec<Proxy>, Vec<Secret>) {
    let mut proxies = Vec::new();
    let mut secrets = Vec::new();
    for document in support::envtest::parse_yaml_documents(yaml) {
        match document["kind"].as_str() {
            Some("Proxy") => proxies.push(serde_json::from_value(document).expect("a Proxy")),
            Some("Secret") => secrets.push(serde_json::from_value(document).expect("a Secret")),
            other => panic!("unexpected kind {other:?} in\n{yaml}"),
        }
    }
    (proxies, secrets)
}

/// Each Proxy's endpoint, with the credentials of the Secret it names (from `secrets`).
fn endpoints(proxies: &[Proxy], secrets: &[Secret]) -> Vec<Reached> {
    proxies
        .iter()
        .map(|proxy| {
            let endpoint = proxy.spec.endpoint.clone().expect("an endpoint");
            let credentials = endpoint.credentials_secret_ref.map(|reference| {
                let secret = secrets
                    .iter()
                    .find(|s| s.metadata.name.as_deref() == Some(reference.name.as_str()))
                    .unwrap_or_else(|| panic!("no Secret {}", reference.name));
                let Credentials { username, password } =
                    Credentials::from_secret(secret).expect("credentials");
                (username, password)
            });
            (endpoint.host, endpoint.port, endpoint.protocol, credentials)
        })
        .collect()
}

#[test]
fn every_line_form_becomes_an_external_proxy() {
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "--namespace",
        "crawl",
        "--label",
        "vendor=acme",
        "--label",
        "tier=gold",
        "--max-leases",
        "3",
    ];
    let yaml = import_file(dir.path(), "Acme EU.txt", LIST, &args);
    let (proxies, secrets) = objects(&yaml);
    assert_eq!(endpoints(&proxies, &secrets), expected(), "{yaml}");
    assert_eq!(secrets.len(), 3);
    let names: BTreeSet<String> = proxies
        .iter()
        .map(|p| p.metadata.name.clone().unwrap())
        .collect();
    assert_eq!(names.len(), proxies.len(), "names are unique: {names:?}");
    for proxy in &proxies {
        let name = proxy.metadata.name.as_deref().unwrap();
        assert!(name.starts_with("acme-eu-"), "{name}");
        assert_eq!(proxy.metadata.namespace.as_deref(), Some("crawl"));
        let labels = proxy.labels();
        assert_eq!(labels.get("vendor").map(String::as_str), Some("acme"));
        assert_eq!(labels.get("tier").map(String::as_str), Some("gold"));
        assert_eq!(proxy.spec.max_leases, Some(3));
        if let Some(reference) = &proxy.spec.endpoint.as_ref().unwrap().credentials_secret_ref {
            assert_eq!(reference.name, format!("{name}-credentials"));
        }
    }
    for secret in &secrets {
        let labels = secret.metadata.labels.clone().unwrap_or_default();
        assert_eq!(labels[CREDENTIALS_SECRET_LABEL], "true");
        assert_eq!(secret.metadata.namespace.as_deref(), Some("crawl"));
        assert_eq!(secret.type_.as_deref(), Some("Opaque"));
    }
    for password in ["s3cret", "p@ss:word", "c/pw"] {
        assert!(!yaml.contains(password), "{password} in clear in\n{yaml}");
    }

    // Deterministic, and a name follows its proxy when the list is reordered.
    assert_eq!(import_file(dir.path(), "Acme EU.txt", LIST, &args), yaml);
    let reversed: String = LIST.lines().rev().map(|l| format!("{l}\n")).collect();
    let (again, _) = objects(&import_file(dir.path(), "Acme EU.txt", &reversed, &args));
    let by_host = |proxies: &[Proxy]| -> BTreeSet<(String, String)> {
        proxies
            .iter()
            .map(|p| {
                let host = p.spec.endpoint.as_ref().unwrap().host.clone();
                (host, p.metadata.name.clone().unwrap())
            })
            .collect()
    };
    assert_eq!(by_host(&again), by_host(&proxies));

    // From stdin: the default prefix and namespace, no labels, the CRD's maxLeases.
    let output = import(&["-"], LIST);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let (piped, piped_secrets) = objects(&String::from_utf8(output.stdout).unwrap());
    assert_eq!(endpoints(&piped, &piped_secrets), expected());
    for proxy in &piped {
        assert!(
            proxy
                .metadata
                .name
                .as_deref()
                .unwrap()
                .starts_with("proxy-")
        );
        assert_eq!(proxy.metadata.namespace.as_deref(), Some("default"));
        assert_eq!(proxy.metadata.labels, None);
        assert_eq!(proxy.spec.max_leases(), 5);
    }
}

#[test]
fn a_bad_or_repeated_line_is_refused_with_its_number_and_nothing_printed() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "bad-port.txt",
            "# ok so far\n10.0.0.1:3128\n\n10.0.0.2:x:alice:hunter2\n10.0.0.3:3128\n",
            "bad-port.txt:4: port \"x\" is not a number",
        ),
        (
            "repeat.txt",
            "10.0.0.1:3128\n10.0.0.2:3128\nhttp://u:hunter2@10.0.0.1:3128\n",
            "repeat.txt:3: 10.0.0.1:3128 repeats line 1",
        ),
        (
            "scheme.txt",
            "https://u:hunter2@h.example:443\n",
            "scheme.txt:1: scheme \"https\" is not supported",
        ),
        ("empty.txt", "# nothing yet\n", "empty.txt: holds no proxy"),
    ];
    for (file, list, message) in cases {
        let path = dir.path().join(file);
        std::fs::write(&path, list).unwrap();
        let output = import(&[path.to_str().unwrap()], "");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{file}: {stderr}");
        assert!(
            output.stdout.is_empty(),
            "{file} printed {:?}",
            output.stdout
        );
        let want = format!("{}/{message}", dir.path().display());
        assert!(stderr.contains(&want), "{file}: {stderr:?}, want {want:?}");
        assert!(
            !stderr.contains("hunter2"),
            "{file}: a password in {stderr:?}"
        );
    }

    // Flags are checked before anything is read.
    for bad in [
        ["--label", "vendor"],
        ["--name-prefix", "Acme"],
        ["--namespace", "Crawl"],
        ["--max-leases", "-1"],
    ] {
        let output = import(&[&["-"], &bad[..]].concat(), "10.0.0.1:3128\n");
        assert_eq!(output.status.code(), Some(2), "{bad:?}");
        assert!(output.stdout.is_empty(), "{bad:?}");
    }
    let output = import(&["-"], "10.0.0.1:3128\nh.example:0\n");
    assert_eq!(output.status.code(), Some(1));
    assert!(output.stdout.is_empty());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("<stdin>:2: port 0 is not in 1-65535"),
        "{stderr}"
    );
    let missing = dir.path().join("missing.txt");
    let output = import(&[missing.to_str().unwrap()], "");
    assert_eq!(output.status.code(), Some(1));
    assert!(output.stdout.is_empty());
    assert!(String::from_utf8_lossy(&output.stderr).contains("cannot read"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_server_accepts_every_object_printed() {
    let Some(plane) = support::ControlPlane::shared() else {
        return;
    };
    plane.apply_crd().await;
    let dir = tempfile::tempdir().unwrap();

    // Server-side apply, document by document, as `kubectl apply --server-side` does.
    let ns = plane.new_namespace("import-ssa").await;
    let yaml = import_file(
        dir.path(),
        "acme.txt",
        LIST,
        &["--namespace", &ns, "--label", "vendor=acme"],
    );
    plane.apply_yaml(&yaml).await;
    assert_stored(plane, &ns, &yaml).await;

    // `kubectl apply -f -` reading the output on a pipe.
    let Some(kubectl) = support::required_tool(
        "kubectl",
        &["version", "--client"],
        "kubectl 1.31 (CONTRIBUTING.md, prerequisites)",
    ) else {
        return;
    };
    let ns = plane.new_namespace("import-kubectl").await;
    let yaml = import_file(dir.path(), "acme.txt", LIST, &["--namespace", &ns]);
    let kubeconfig = dir.path().join("admin.kubeconfig");
    plane.write_admin_kubeconfig(&kubeconfig);
    let mut child = Command::new(kubectl)
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(["apply", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kubectl");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(yaml.as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "kubectl apply: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_stored(plane, &ns, &yaml).await;
}

/// The Proxies and credentials Secrets stored in `ns` are those of `yaml`, with [`LIST`]'s
/// endpoints and credentials.
async fn assert_stored(plane: &support::ControlPlane, ns: &str, yaml: &str) {
    let client = plane.admin_client();
    let mut stored: Vec<Proxy> = Api::<Proxy>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await
        .expect("list Proxies")
        .items;
    let watched = ListParams::default().labels(&format!("{CREDENTIALS_SECRET_LABEL}=true"));
    let secrets = Api::<Secret>::namespaced(client, ns)
        .list(&watched)
        .await
        .expect("list credentials Secrets")
        .items;
    let (printed, _) = objects(yaml);
    let order: Vec<Option<String>> = printed.iter().map(|p| p.metadata.name.clone()).collect();
    stored.sort_by_key(|p| order.iter().position(|name| *name == p.metadata.name));
    assert_eq!(endpoints(&stored, &secrets), expected());
    assert_eq!(
        secrets.len(),
        3,
        "every credentials Secret carries the watch label"
    );
    for (stored, printed) in stored.iter().zip(&printed) {
        assert_eq!(stored.metadata.name, printed.metadata.name);
        assert_eq!(stored.metadata.labels, printed.metadata.labels);
        assert_eq!(
            stored.spec, printed.spec,
            "the server kept the spec as printed"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_output_is_a_standalone_inventory() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = import_file(dir.path(), "acme.txt", LIST, &["--label", "vendor=acme"]);
    let inventory = dir.path().join("inventory.yaml");
    std::fs::write(&inventory, &yaml).unwrap();
    let target = Target::start();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, target.ca_cert_pem()).unwrap();
    let token = "import-test-token-0123456789";
    let operator = Standalone::start_on(dir.path(), inventory, &ca, token, &[]);

    let (printed, _) = objects(&yaml);
    let want: BTreeSet<(String, String, i64)> = printed
        .iter()
        .map(|p| {
            let endpoint = p.spec.endpoint.as_ref().unwrap();
            (
                p.metadata.name.clone().unwrap(),
                endpoint.host.clone(),
                i64::from(endpoint.port),
            )
        })
        .collect();
    let client = support::http::client();
    let url = format!("{}/v1/proxies", operator.api());
    let start = Instant::now();
    let mut last = String::new();
    loop {
        if let Ok(response) = client.get(&url).bearer_auth(token).send().await {
            let body: Value = response.json().await.unwrap_or_default();
            let served: BTreeSet<(String, String, i64)> = body["proxies"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|p| {
                    (
                        p["name"].as_str().unwrap_or_default().to_owned(),
                        p["host"].as_str().unwrap_or_default().to_owned(),
                        p["port"].as_i64().unwrap_or_default(),
                    )
                })
                .collect();
            if served == want {
                return;
            }
            last = body.to_string();
        }
        assert!(
            start.elapsed() < DEADLINE,
            "standalone did not serve the imported proxies: {last}\nlog:\n{}",
            operator.log()
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}
