//! Inside HTTPS, through the binary: a crawler asking for `tls=inspect` gets the gateway's
//! leaf for the host (signed by the CA it was given), and the gateway sees the target's
//! answers inside the tunnel as it sees plain HTTP: the exit and lease named on every answer,
//! a ban reported and its exit cooled down for the target. Without the option, a CONNECT
//! stays a byte tunnel.

use std::time::Duration;

use crate::support::curl::header_value;
use crate::support::fleet::GatewayFleet;
use crate::support::gateway_ca::GatewayCa;
use crate::support::operator::metric_sum;

/// curl with the gateway tests' limit of 30 s.
async fn curl(args: &[&str]) -> (i32, String, String) {
    crate::support::curl::curl(Duration::from_secs(30), args).await
}

/// A fleet of `count` squids whose gateway intercepts with a CA of its own and trusts the
/// site's CA for the targets; `extra` flags last.
async fn intercepting_fleet(
    dir: &std::path::Path,
    count: usize,
    extra: &[&str],
) -> (GatewayFleet, GatewayCa) {
    let ca = GatewayCa::write(dir);
    let site_ca = dir.join("site-ca.pem").display().to_string();
    let mut args: Vec<String> = ca.args();
    args.extend(["--gateway-target-ca-file".to_owned(), site_ca]);
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let fleet = GatewayFleet::start(dir, count, &args).await;
    (fleet, ca)
}

#[tokio::test]
async fn curl_trusting_the_gateway_ca_sees_the_exit_the_lease_and_bans_inside_https() {
    let dir = tempfile::tempdir().unwrap();
    let (fleet, ca) = intercepting_fleet(dir.path(), 2, &[]).await;
    let proxy = fleet.proxy_url("curl;tls=inspect");
    let cacert = ca.cert.display().to_string();
    let url = fleet.site.https("/ip");
    let (code, out, err) = curl(&["-sS", "-D", "-", "--cacert", &cacert, "-x", &proxy, &url]).await;
    assert_eq!(code, 0, "{err}\n{out}");
    // The inner answer names the exit and the lease, as plain HTTP's does.
    let inner = out.rsplit("\r\n\r\n").nth(1).unwrap_or_default();
    assert!(out.contains("HTTP/1.1 200"), "{out}");
    let exit = out.lines().last().unwrap().trim();
    assert_eq!(
        header_value(inner, "x-proxy-name"),
        fleet.proxy_of(exit).as_deref(),
        "{out}"
    );

    // A 429 inside TLS is seen, reported and said; the exit cools down for the target, so
    // the next request leaves through the other one.
    let banned = fleet.site.https("/status/429");
    let (code, out, err) =
        curl(&["-sS", "-D", "-", "--cacert", &cacert, "-x", &proxy, &banned]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        header_value(&out, "x-proxy-ban-reported"),
        Some("rate_limited"),
        "{out}"
    );
    let cooled = header_value(&out, "x-proxy-name").unwrap().to_owned();
    for _ in 0..3 {
        let (code, out, err) =
            curl(&["-sS", "-D", "-", "--cacert", &cacert, "-x", &proxy, &url]).await;
        assert_eq!(code, 0, "{err}");
        assert_ne!(
            header_value(&out, "x-proxy-name"),
            Some(cooled.as_str()),
            "{out}"
        );
    }
    let metrics = fleet.metrics().await;
    assert!(
        metric_sum(&metrics, "proxy_operator_gateway_intercepted_total", &[]) >= 5.0,
        "{metrics}"
    );
    assert_eq!(
        metric_sum(
            &metrics,
            "proxy_operator_gateway_rule_matches_total",
            &["rule=\"default\"", "result=\"rate_limited\""]
        ),
        1.0
    );

    // Without the option: a byte tunnel, the site's own certificate end to end.
    let plain = fleet.proxy_url("curl");
    let (code, _, err) = curl(&["-sS", "--cacert", &cacert, "-x", &plain, &url]).await;
    assert_ne!(code, 0, "the gateway's CA verified a tunnelled site: {err}");
    let site_ca = dir.path().join("site-ca.pem").display().to_string();
    let (code, out, err) = curl(&["-sS", "--cacert", &site_ca, "-x", &plain, &url]).await;
    assert_eq!(code, 0, "{err}");
    assert!(fleet.proxy_of(out.trim()).is_some(), "{out}");
}

/// A CA of the test's own, for targets with certificates of every kind.
struct TargetCa {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    pem: String,
}

impl TargetCa {
    fn new() -> TargetCa {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::default();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "target test CA");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let cert = params.self_signed(&key).unwrap();
        TargetCa {
            pem: cert.pem(),
            issuer: rcgen::Issuer::new(params, key),
        }
    }

    /// A server configuration for a certificate naming `names`, signed by this CA (or by itself
    /// when `self_signed`), valid until `until`.
    fn server(
        &self,
        names: &[&str],
        self_signed: bool,
        until: time::OffsetDateTime,
    ) -> std::sync::Arc<rustls::ServerConfig> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(
            names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>(),
        )
        .unwrap();
        params.not_before = time::OffsetDateTime::now_utc() - time::Duration::days(30);
        params.not_after = until;
        let cert = if self_signed {
            params.self_signed(&key).unwrap()
        } else {
            params.signed_by(&key, &self.issuer).unwrap()
        };
        std::sync::Arc::new(
            rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
                rustls::crypto::aws_lc_rs::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).unwrap(),
            )
            .unwrap(),
        )
    }
}

/// An HTTPS target on loopback with `config`: its port, and how many TLS handshakes it
/// completed.
async fn tls_target(
    config: std::sync::Arc<rustls::ServerConfig>,
) -> (u16, std::sync::Arc<std::sync::atomic::AtomicU64>) {
    use std::sync::atomic::Ordering;
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let handshakes = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counted = handshakes.clone();
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (acceptor, counted) = (acceptor.clone(), counted.clone());
            tokio::spawn(async move {
                if let Ok(mut tls) = acceptor.accept(stream).await {
                    counted.fetch_add(1, Ordering::SeqCst);
                    let _ = tls
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                        .await;
                }
            });
        }
    });
    (port, handshakes)
}

#[tokio::test]
async fn a_target_whose_certificate_does_not_verify_is_502_and_nothing_is_relayed() {
    use std::sync::atomic::Ordering;
    let dir = tempfile::tempdir().unwrap();
    let target_ca = TargetCa::new();
    let roots = dir.path().join("targets.pem");
    std::fs::write(&roots, &target_ca.pem).unwrap();
    let later = time::OffsetDateTime::now_utc() + time::Duration::days(30);
    let past = time::OffsetDateTime::now_utc() - time::Duration::days(1);
    let good = tls_target(target_ca.server(&["127.0.0.1"], false, later)).await;
    let cases = [
        (
            "self-signed",
            tls_target(target_ca.server(&["127.0.0.1"], true, later)).await,
        ),
        (
            "wrongly named",
            tls_target(target_ca.server(&["other.test"], false, later)).await,
        ),
        (
            "expired",
            tls_target(target_ca.server(&["127.0.0.1"], false, past)).await,
        ),
    ];
    let ports: Vec<String> = cases
        .iter()
        .map(|(_, (port, _))| port.to_string())
        .chain([good.0.to_string()])
        .collect();
    let ca = GatewayCa::write(dir.path());
    let mut args = ca.args();
    args.extend([
        "--gateway-target-ca-file".to_owned(),
        roots.display().to_string(),
        "--gateway-allowed-ports".to_owned(),
        ports.join(","),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let fleet = GatewayFleet::start(dir.path(), 1, &args).await;
    let auth =
        crate::support::raw::proxy_authorization("c;tls=inspect", crate::support::fleet::TOKEN);
    for (kind, (port, handshakes)) in &cases {
        let answer = crate::support::raw::exchange(
            fleet.operator.gateway(),
            &format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{auth}\r\n"),
        )
        .await;
        assert_eq!(answer.status, 502, "{kind}: {answer:?}");
        assert_eq!(answer.json()["error"], "target_tls_failed", "{kind}");
        assert_eq!(
            answer.json()["reason"],
            "certificate",
            "{kind}: {}",
            answer.body
        );
        assert_eq!(
            answer.header("proxy-status"),
            Some("proxy-operator; error=tls_certificate_error; details=\"target_tls_failed\""),
        );
        assert_eq!(
            handshakes.load(Ordering::SeqCst),
            0,
            "{kind}: a handshake completed"
        );
    }
    // The well-signed target is reached through the same gateway.
    let answer = crate::support::raw::exchange(
        fleet.operator.gateway(),
        &format!(
            "CONNECT 127.0.0.1:{p} HTTP/1.1\r\nHost: 127.0.0.1:{p}\r\n{auth}\r\n",
            p = good.0
        ),
    )
    .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    // Never a ban, never a failure of the exit.
    let ledger = fleet.operator.ledger();
    assert_eq!(
        crate::support::sqlite3(
            &ledger,
            "SELECT count(*) FROM lease_history WHERE kind = 'reported'"
        ),
        "0"
    );
    let metrics = fleet.metrics().await;
    assert_eq!(
        metric_sum(
            &metrics,
            "proxy_operator_gateway_tls_handshake_failures_total",
            &["side=\"target\"", "reason=\"certificate\""]
        ),
        3.0
    );
}

#[tokio::test]
async fn a_client_hello_naming_another_host_and_a_refused_ask_never_become_a_silent_tunnel() {
    let dir = tempfile::tempdir().unwrap();
    let tenants = dir.path().join("tenants.yaml");
    std::fs::write(
        &tenants,
        format!(
            "tenants:\n  - name: no-mitm\n    tokens: [\"{}\"]\n",
            crate::support::token_digest(NO_MITM_TOKEN)
        ),
    )
    .unwrap();
    let tenants_arg = tenants.display().to_string();
    let (fleet, ca) = intercepting_fleet(
        dir.path(),
        1,
        &[
            "--tenants-file",
            &tenants_arg,
            "--gateway-intercept-exclude",
            "pinned.example,*.pinned.example",
        ],
    )
    .await;
    let port = fleet.site.https_port();
    let gateway = fleet.operator.gateway();

    // A tenant not allowed to intercept: 403 naming why.
    let auth = crate::support::raw::proxy_authorization("c;tls=inspect", NO_MITM_TOKEN);
    let answer = crate::support::raw::exchange(
        gateway,
        &format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: x\r\n{auth}\r\n"),
    )
    .await;
    assert_eq!(answer.status, 403, "{answer:?}");
    assert_eq!(answer.json()["error"], "interception_refused");
    assert!(answer.body.contains("no-mitm"), "{}", answer.body);

    // A hello whose SNI names another host than the CONNECT: the handshake is refused.
    let auth =
        crate::support::raw::proxy_authorization("c;tls=inspect", crate::support::fleet::TOKEN);
    let mut stream = tokio::net::TcpStream::connect(gateway).await.unwrap();
    crate::support::raw::send(
        &mut stream,
        &format!("CONNECT localhost:{port} HTTP/1.1\r\nHost: x\r\n{auth}\r\n"),
    )
    .await;
    let answer = crate::support::raw::read_answer(&mut stream, crate::support::DEADLINE).await;
    // localhost resolves to loopback, which the fleet opened.
    assert_eq!(answer.status, 200, "{answer:?}");
    let pem = std::fs::read(&ca.cert).unwrap();
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(rustls::pki_types::CertificateDer::from_pem_slice(&pem).unwrap())
        .unwrap();
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::aws_lc_rs::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let name = rustls::pki_types::ServerName::try_from("elsewhere.example").unwrap();
    assert!(
        connector.connect(name, stream).await.is_err(),
        "a mismatched SNI was served"
    );
    let start = std::time::Instant::now();
    loop {
        let metrics = fleet.metrics().await;
        let refused = metric_sum(
            &metrics,
            "proxy_operator_gateway_tls_handshake_failures_total",
            &["side=\"client\"", "reason=\"sni_mismatch\""],
        );
        if refused == 1.0 {
            break;
        }
        assert!(start.elapsed() < crate::support::DEADLINE, "{metrics}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

const NO_MITM_TOKEN: &str = "no-mitm-token-0123456789abcdef";

#[tokio::test]
async fn no_ca_refuses_the_ask_and_an_excluded_host_stays_a_tunnel() {
    let dir = tempfile::tempdir().unwrap();
    let port = {
        // Without a CA: the ask is refused naming the flag.
        let fleet = GatewayFleet::start(dir.path(), 1, &[]).await;
        let port = fleet.site.https_port();
        let auth =
            crate::support::raw::proxy_authorization("c;tls=inspect", crate::support::fleet::TOKEN);
        let answer = crate::support::raw::exchange(
            fleet.operator.gateway(),
            &format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: x\r\n{auth}\r\n"),
        )
        .await;
        assert_eq!(answer.status, 403, "{answer:?}");
        assert_eq!(answer.json()["error"], "interception_refused");
        assert!(answer.body.contains("--gateway-ca-cert"), "{}", answer.body);
        port
    };
    let _ = port;
    let dir = tempfile::tempdir().unwrap();
    let (fleet, ca) =
        intercepting_fleet(dir.path(), 1, &["--gateway-intercept-exclude", "127.0.0.1"]).await;
    let url = fleet.site.https("/ip");
    let proxy = fleet.proxy_url("c;tls=inspect");
    // The host is excluded: a byte tunnel, the site's own certificate, asked or not.
    let site_ca = dir.path().join("site-ca.pem").display().to_string();
    let (code, out, err) = curl(&["-sS", "--cacert", &site_ca, "-x", &proxy, &url]).await;
    assert_eq!(code, 0, "{err}");
    assert!(fleet.proxy_of(out.trim()).is_some(), "{out}");
    let cacert = ca.cert.display().to_string();
    let (code, _, _) = curl(&["-sS", "--cacert", &cacert, "-x", &proxy, &url]).await;
    assert_ne!(code, 0, "an excluded host was intercepted");
}

#[tokio::test]
async fn a_kill_9_during_intercepted_transfers_loses_no_acknowledged_lease() {
    use crate::support::raw::{proxy_authorization, read_answer, send};
    use crate::support::{DEADLINE, sqlite3};
    let dir = tempfile::tempdir().unwrap();
    let (mut fleet, ca) = intercepting_fleet(dir.path(), 2, &[]).await;
    let port = fleet.site.https_port();
    let pem = std::fs::read(&ca.cert).unwrap();
    let roots = crate::support::tls_load::Via::trusting(&pem);
    let mut acknowledged = Vec::new();
    let mut transfers = Vec::new();
    // Intercepted downloads under way, each on the lease its CONNECT was answered with.
    for i in 0..6 {
        let user = if i % 2 == 0 {
            "dl;tls=inspect".to_owned()
        } else {
            format!("dl;tls=inspect;session=s{i}")
        };
        let auth = proxy_authorization(&user, crate::support::fleet::TOKEN);
        let mut stream = tokio::net::TcpStream::connect(fleet.operator.gateway())
            .await
            .unwrap();
        send(
            &mut stream,
            &format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: x\r\n{auth}\r\n"),
        )
        .await;
        let answer = read_answer(&mut stream, DEADLINE).await;
        assert_eq!(answer.status, 200, "{answer:?}");
        acknowledged.push(answer.header("x-proxy-lease").unwrap().to_owned());
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
        let mut tls = tokio_rustls::TlsConnector::from(roots.clone())
            .connect(name, stream)
            .await
            .unwrap();
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        tls.write_all(b"GET /bytes/1073741824 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            .await
            .unwrap();
        let mut first = [0u8; 4096];
        assert!(tls.read(&mut first).await.unwrap() > 0);
        transfers.push(tls);
    }
    // Leases the API acknowledged meanwhile.
    let client = crate::support::http::client();
    for _ in 0..10 {
        let answer = client
            .post(format!("{}/v1/leases", fleet.operator.api()))
            .bearer_auth(crate::support::fleet::TOKEN)
            .json(&serde_json::json!({"target": "example.com"}))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 201);
        let body: serde_json::Value = answer.json().await.unwrap();
        acknowledged.push(body["leaseID"].as_str().unwrap().to_owned());
    }
    fleet.restart().await;
    drop(transfers);
    let ids: Vec<String> = acknowledged.iter().map(|id| format!("'{id}'")).collect();
    let kept = sqlite3(
        &fleet.operator.ledger(),
        &format!(
            "SELECT count(*) FROM leases WHERE id IN ({})",
            ids.join(",")
        ),
    );
    assert_eq!(
        kept,
        acknowledged.len().to_string(),
        "acknowledged leases lost"
    );
}
