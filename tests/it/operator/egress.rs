//! What a Managed squid may reach, on a real API server: with a providers config that opens no
//! range, the squid the operator generates — run by the test kubelet with real squid — refuses
//! the cloud metadata address and loopback after its own resolution, even to a client that
//! sends the machine's credentials.
//!
//! Needs `KUBEBUILDER_ASSETS` (kube-apiserver + etcd); without it every test here passes as
//! skipped and says how to get the binaries, unless `CI` is set.

use crate::support;

use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use proxy_operator::credentials::machine_secret_name;
use support::raw::{Answer, exchange, proxy_authorization};
use support::world::World;

/// The port of `url` (`http://127.0.0.1:PORT/...`).
fn port_of(url: &str) -> u16 {
    reqwest::Url::parse(url)
        .ok()
        .and_then(|u| u.port())
        .expect("a URL with a port")
}

/// Asserts squid refused the request by its own access rules (no forward was attempted).
fn assert_refused(answer: &Answer, what: &str) {
    assert_eq!(answer.status, 403, "{what}: {}", answer.head);
    assert_eq!(
        answer
            .header("x-squid-error")
            .map(|e| e.split_whitespace().next()),
        Some(Some("ERR_ACCESS_DENIED")),
        "{what}: {}",
        answer.head
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_managed_squid_with_nothing_opened_refuses_the_metadata_address_and_loopback() {
    let Some(world) = World::new("egress").await else {
        return;
    };
    // No `egress:` block: no range is opened for the squids.
    std::fs::write(
        world.dir.path().join("providers.yaml"),
        "providers:\n  - {name: local, type: kubernetes, kubernetes: {image: ubuntu/squid}}\n",
    )
    .expect("write the providers config");
    // The target's ports are opened (at the gateway and in the squids), its address is not: what
    // refuses below is the destination rule, not the port rule.
    let http_port = port_of(&world.target.http_url());
    let https_port = port_of(&world.target.https_url());
    let _operator = world
        .operator(&[
            "--gateway-allowed-ports",
            &format!("80,443,{http_port},{https_port}"),
        ])
        .await;
    world
        .create("closed", world.managed_spec(3128))
        .await
        .expect("create the Managed Proxy");
    // Its own probes of the loopback target are refused too, so it never turns healthy: wait
    // for its machine's address, and for the probes to have failed.
    let proxy = world
        .wait_proxy("closed", "the Proxy provisioned and unhealthy", |s| {
            let unhealthy = s["conditions"].as_array().is_some_and(|conditions| {
                conditions
                    .iter()
                    .any(|c| c["type"] == "Healthy" && c["status"] == "False")
            });
            s["ip"].as_str().is_some_and(|ip| !ip.is_empty()) && unhealthy
        })
        .await;
    let squid = format!(
        "{}:3128",
        proxy["status"]["ip"].as_str().unwrap_or_default()
    );
    let uid = proxy["metadata"]["uid"].as_str().unwrap_or_default();
    let secrets: Api<Secret> = Api::namespaced(world.client.clone(), &world.ns);
    let secret = secrets
        .get(&machine_secret_name(uid))
        .await
        .expect("the machine's credentials Secret");
    let data = secret.data.unwrap_or_default();
    let value = |key: &str| String::from_utf8(data[key].0.clone()).expect("UTF-8 credentials");
    let auth = proxy_authorization(&value("username"), &value("password"));

    let get = |url: String| {
        let host = url
            .trim_start_matches("http://")
            .split('/')
            .next()
            .unwrap_or_default()
            .to_owned();
        format!("GET {url} HTTP/1.1\r\nHost: {host}\r\n{auth}Connection: close\r\n\r\n")
    };
    let connect = |authority: String| {
        format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n{auth}\r\n")
    };
    for (what, request) in [
        (
            "the metadata address",
            get("http://169.254.169.254/computeMetadata/v1/".into()),
        ),
        (
            "the metadata name",
            get("http://metadata.google.internal/computeMetadata/v1/".into()),
        ),
        (
            "CONNECT to the metadata address",
            connect("169.254.169.254:443".into()),
        ),
        (
            "the loopback target",
            get(format!("http://127.0.0.1:{http_port}/generate_204")),
        ),
        (
            "a name squid resolves to loopback",
            get(format!("http://localhost:{http_port}/generate_204")),
        ),
        (
            "CONNECT to the loopback target",
            connect(format!("127.0.0.1:{https_port}")),
        ),
    ] {
        assert_refused(&exchange(&squid, &request).await, what);
    }
    assert_eq!(
        world.target.connections(),
        0,
        "a refused request (or a probe) reached the loopback target"
    );
}
