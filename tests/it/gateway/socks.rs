//! SOCKS5 upstreams, through the binary: a real danted (Debian `dante-server`) listed as an
//! External proxy with `protocol: socks5`, connecting out from its own loopback address (the
//! site's `/ip` says the request left through it), with and without RFC 1929 credentials.

use std::net::Ipv4Addr;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::DEADLINE;
use crate::support::curl::header_value;
use crate::support::dante::{Dante, DanteOptions, SOCKS_PASSWORD, SOCKS_USER};
use crate::support::fleet::{LOOPBACK, TOKEN, proxy_url};
use crate::support::gateway_ca::GatewayCa;
use crate::support::site::Site;
use crate::support::standalone::{ExternalProxy, Standalone};

/// curl with the gateway tests' limit of 30 s.
async fn curl(args: &[&str]) -> (i32, String, String) {
    crate::support::curl::curl(Duration::from_secs(30), args).await
}

/// The address danted listens on and connects out from: none of the squid fleets' addresses.
const SOCKS_ADDRESS: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 60);

/// The SOCKS5 proxy `default/socks` in front of `sites`, with `credentials` in its Secret,
/// probed every `interval`.
fn socks_proxy(
    dante: &Dante,
    site: &Site,
    credentials: Option<&str>,
    interval: &'static str,
) -> ExternalProxy {
    ExternalProxy {
        name: "socks".to_owned(),
        labels: Vec::new(),
        host: dante.address().to_string(),
        port: dante.port(),
        max_leases: 16,
        probe_url: site.http("/generate_204"),
        interval,
        cordoned: false,
        socks5: true,
        credentials: credentials.map(|password| (SOCKS_USER.to_owned(), password.to_owned())),
        cost: None,
    }
}

/// The binary on `proxies` in `dir`, opening loopback and the ports of `sites`, intercepting
/// with a CA of its own that trusts the first site's CA; waits until the proxies are healthy.
async fn start(dir: &Path, proxies: &[ExternalProxy], sites: &[&Site]) -> (Standalone, GatewayCa) {
    let ca = GatewayCa::write(dir);
    let site_ca = dir.join("site-ca.pem");
    std::fs::write(&site_ca, sites[0].ca_pem()).expect("write the site's CA");
    let ports: Vec<String> = sites
        .iter()
        .flat_map(|site| [site.http_port(), site.https_port()])
        .map(|port| port.to_string())
        .collect();
    let ports = ports.join(",");
    let mut args = vec![
        "--gateway-allowed-ports".to_owned(),
        ports,
        "--gateway-allowed-destinations".to_owned(),
        LOOPBACK.to_owned(),
        "--inventory-poll".to_owned(),
        "200ms".to_owned(),
        "--gateway-target-ca-file".to_owned(),
        site_ca.display().to_string(),
    ];
    args.extend(ca.args());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut operator = Standalone::start(dir, proxies, &site_ca, TOKEN, &args);
    operator
        .wait_healthy(TOKEN, proxies.len(), Duration::from_secs(60))
        .await;
    (operator, ca)
}

#[tokio::test]
async fn curl_reaches_http_and_https_targets_through_a_socks5_upstream() {
    for authenticate in [false, true] {
        let Some(dante) = Dante::start(DanteOptions {
            address: Some(SOCKS_ADDRESS),
            authenticate,
        }) else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let (site, other) = (Site::start(), Site::start());
        let password = authenticate.then_some(SOCKS_PASSWORD);
        let proxy = socks_proxy(&dante, &site, password, "1s");
        let (operator, ca) = start(dir.path(), &[proxy], &[&site, &other]).await;
        let exit = SOCKS_ADDRESS.to_string();
        let case = if authenticate { "with" } else { "without" };

        // Plain HTTP, twice on one crawler connection to two targets: each target gets its
        // own stream through the proxy, the request in origin-form with its Host header.
        let gateway = proxy_url(&operator, "curl-crawler");
        let (code, out, err) = curl(&[
            "-sS",
            "-D",
            "-",
            "-x",
            &gateway,
            &site.http("/ip"),
            &other.http("/ip"),
            &site.http("/ip"),
        ])
        .await;
        assert_eq!(code, 0, "{case} credentials: {err}");
        let answers: Vec<&str> = out.split("HTTP/1.1 ").skip(1).collect();
        assert_eq!(answers.len(), 3, "{out}");
        for answer in answers {
            assert!(answer.starts_with("200"), "{case} credentials: {answer}");
            assert_eq!(header_value(answer, "x-proxy-name"), Some("default/socks"));
            assert_eq!(answer.lines().last().map(str::trim), Some(exit.as_str()));
        }
        assert!(site.requests() >= 2 && other.requests() >= 1, "{out}");

        // HTTPS: a CONNECT tunnel over a SOCKS5 stream, the site's certificate checked by curl.
        let site_ca = dir.path().join("site-ca.pem").display().to_string();
        let (code, out, err) = curl(&[
            "-sS",
            "-D",
            "-",
            "--cacert",
            &site_ca,
            "-x",
            &gateway,
            &site.https("/ip"),
        ])
        .await;
        assert_eq!(code, 0, "{case} credentials: {err}");
        let (connect, response) = out.split_once("\r\n\r\n").expect("two heads");
        assert!(connect.starts_with("HTTP/1.1 200"), "{connect}");
        assert_eq!(header_value(connect, "x-proxy-name"), Some("default/socks"));
        assert!(response.starts_with("HTTP/1.1 200"), "{response}");
        assert_eq!(response.lines().last().map(str::trim), Some(exit.as_str()));

        // Intercepted: the gateway's own TLS to the target over the SOCKS5 stream.
        let inspecting = proxy_url(&operator, "curl;tls=inspect");
        let gateway_ca = ca.cert.display().to_string();
        let (code, out, err) = curl(&[
            "-sS",
            "--cacert",
            &gateway_ca,
            "-x",
            &inspecting,
            &site.https("/ip"),
        ])
        .await;
        assert_eq!(code, 0, "{case} credentials: {err}");
        assert_eq!(out.trim(), exit, "{case} credentials");

        // danted saw the streams, and with credentials the user they came as.
        let log = dante.log();
        assert!(log.contains("tcp/connect"), "{log}");
        assert_eq!(
            log.contains(&format!("username%{SOCKS_USER}@")),
            authenticate,
            "{log}"
        );

        // The destination policy and the allowed ports hold before any SOCKS request: a
        // private address not opened, the metadata address (plain and CONNECT) and a port not
        // allowed are refused, and danted sees nothing of them.
        let port = site.http_port();
        let refused = [
            (
                format!("http://10.20.30.40:{port}/ip"),
                false,
                "destination_not_allowed",
            ),
            (
                format!("https://169.254.169.254:{}/", site.https_port()),
                true,
                "destination_not_allowed",
            ),
            ("http://127.0.0.1:9/".to_owned(), false, "port_not_allowed"),
        ];
        for (url, tunnel, code_name) in refused {
            let mut args = vec!["-sS", "-D", "-", "-x", &gateway];
            if tunnel {
                args.push("-p");
            }
            args.push(&url);
            let (_, out, err) = curl(&args).await;
            assert!(
                out.contains(" 403"),
                "{case} credentials, {url}: {out}{err}"
            );
            assert!(
                out.contains(code_name),
                "{case} credentials, {url}: {out}{err}"
            );
        }
        // danted may still log the end of the streams above; of the refused requests it
        // logs nothing (it writes addresses as `host.port`).
        let later = dante.log();
        let since = later.get(log.len()..).unwrap_or(&later);
        let refused_address = |word: &str| {
            word.starts_with("10.20.30.40.")
                || word.starts_with("169.254.169.254.")
                || word == "127.0.0.1.9"
        };
        assert!(
            !since.split_whitespace().any(refused_address),
            "{case} credentials: danted saw a refused request: {since}"
        );
    }
}

/// The proxy list's entry for `default/socks`; null while the API does not answer yet.
async fn listed(operator: &Standalone) -> Value {
    let response = crate::support::http::client()
        .get(format!("{}/v1/proxies", operator.api()))
        .bearer_auth(TOKEN)
        .send()
        .await;
    let body: Value = match response {
        Ok(response) => response.json().await.unwrap_or_default(),
        Err(_) => Value::Null,
    };
    body["proxies"]
        .as_array()
        .and_then(|proxies| proxies.first())
        .cloned()
        .unwrap_or_default()
}

/// Polls the proxy list until `default/socks` is `healthy`; its entry.
async fn wait_for_health(operator: &Standalone, healthy: bool) -> Value {
    let start = Instant::now();
    loop {
        let entry = listed(operator).await;
        // Unhealthy counts once a probe failed, not while none has run.
        let probed = healthy || entry["lastFailure"]["kind"].is_string();
        if entry["healthy"] == Value::Bool(healthy) && probed {
            return entry;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "the SOCKS5 proxy is not healthy={healthy}: {entry}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_socks5_proxy_is_healthy_while_danted_runs_and_unhealthy_when_stopped() {
    let Some(mut dante) = Dante::start(DanteOptions {
        address: Some(SOCKS_ADDRESS),
        authenticate: true,
    }) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let site = Site::start();
    let proxy = socks_proxy(&dante, &site, Some(SOCKS_PASSWORD), "1s");
    // Healthy: the probe went through danted, as the user of its Secret.
    let (operator, _ca) = start(dir.path(), &[proxy], &[&site]).await;
    let log = dante.log();
    assert!(log.contains(&format!("username%{SOCKS_USER}@")), "{log}");

    dante.stop();
    let entry = wait_for_health(&operator, false).await;
    assert_eq!(entry["lastFailure"]["kind"], "connect_refused", "{entry}");

    dante.restart();
    wait_for_health(&operator, true).await;
}

#[tokio::test]
async fn a_wrong_socks5_password_is_a_failed_upstream_and_never_logged() {
    let Some(dante) = Dante::start(DanteOptions {
        address: Some(SOCKS_ADDRESS),
        authenticate: true,
    }) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let site = Site::start();
    let wrong = format!("wrong-{}", rand::random::<u64>());

    // The probe: unhealthy, its SOCKS5 stream refused.
    let probed = socks_proxy(&dante, &site, Some(&wrong), "1s");
    let ca = dir.path().join("site-ca.pem");
    std::fs::write(&ca, site.ca_pem()).expect("write the site's CA");
    let mut operator =
        Standalone::start(dir.path(), std::slice::from_ref(&probed), &ca, TOKEN, &[]);
    let entry = wait_for_health(&operator, false).await;
    assert_eq!(
        entry["lastFailure"]["kind"], "connect_tunnel_refused",
        "{entry}"
    );
    operator.kill();
    let log = operator.log();
    assert!(
        !log.contains(&wrong),
        "the wrong password was logged:\n{log}"
    );

    // The gateway: a proxy healthy with the right password (added to a running process, so
    // probed at once, then once an hour) whose Secret then changes to a wrong one. Its next
    // stream is refused: `502` naming the refusal.
    let dir = tempfile::tempdir().unwrap();
    let (mut operator, _ca) = start(dir.path(), &[], &[&site]).await;
    let mut proxy = socks_proxy(&dante, &site, Some(SOCKS_PASSWORD), "1h");
    operator.rewrite_inventory(std::slice::from_ref(&proxy));
    operator
        .wait_healthy(TOKEN, 1, Duration::from_secs(60))
        .await;
    proxy.credentials = Some((SOCKS_USER.to_owned(), wrong.clone()));
    operator.rewrite_inventory(std::slice::from_ref(&proxy));
    let gateway = proxy_url(&operator, "curl-crawler");
    let start = Instant::now();
    let out = loop {
        let (code, out, err) = curl(&["-sS", "-D", "-", "-x", &gateway, &site.http("/ip")]).await;
        assert_eq!(code, 0, "{err}");
        if out.starts_with("HTTP/1.1 502") {
            break out;
        }
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        assert!(
            start.elapsed() < DEADLINE,
            "the new password was never used"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(out.contains("credentials not accepted"), "{out}");
    assert!(!out.contains(&wrong), "{out}");

    // Neither password in anything the process wrote.
    let log = operator.log();
    assert!(
        !log.contains(&wrong),
        "the wrong password was logged:\n{log}"
    );
    assert!(
        !log.contains(SOCKS_PASSWORD),
        "the password was logged:\n{log}"
    );
}
