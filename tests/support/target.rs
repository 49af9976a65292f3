//! A loopback probe target answering on plain HTTP and on HTTPS (a certificate signed by a
//! throw-away CA the test trusts), with a status and a delay the test sets at any time. It runs
//! on its own thread and runtime, so it serves sync tests, async tests and benches alike.

use std::sync::Arc;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::loopback::LoopbackServers;

/// Name of the target's threads, so a bench can tell their CPU time apart from its own.
pub const THREAD_NAME: &str = "probe-target";

/// A throw-away CA and a server certificate it signed for `127.0.0.1` and `localhost`: what a
/// loopback HTTPS server presents and what the client under test is told to trust.
pub struct TestTls {
    /// Accepts TLS with the server certificate.
    pub acceptor: tokio_rustls::TlsAcceptor,
    /// The CA certificate, PEM.
    pub ca_pem: String,
    /// The CA certificate, DER.
    pub ca_der: Vec<u8>,
}

impl TestTls {
    /// A new CA and server certificate.
    pub fn new() -> TestTls {
        let ca_key = KeyPair::generate().expect("generate the CA key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "proxy-operator test CA");
        let ca = CertifiedIssuer::self_signed(ca_params, ca_key).expect("self-sign the CA");
        let leaf_key = KeyPair::generate().expect("generate the server key");
        let leaf_params = CertificateParams::new(vec!["127.0.0.1".into(), "localhost".into()])
            .expect("server params");
        let leaf = leaf_params
            .signed_by(&leaf_key, &ca)
            .expect("sign the server certificate");
        let tls = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::aws_lc_rs::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_no_client_auth()
        .with_single_cert(
            vec![leaf.der().clone(), ca.der().clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der())),
        )
        .expect("server TLS config");
        TestTls {
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(tls)),
            ca_pem: ca.pem(),
            ca_der: ca.der().to_vec(),
        }
    }
}

/// What the target answers, shared with its server tasks.
#[derive(Debug)]
struct Behaviour {
    status: AtomicU16,
    delay_ms: AtomicU64,
}

/// A running target; stopped on drop.
#[derive(Debug)]
pub struct Target {
    servers: LoopbackServers,
    ca_pem: String,
    ca_der: Vec<u8>,
    behaviour: Arc<Behaviour>,
}

impl Target {
    /// Starts a target answering 204 without delay.
    pub fn start() -> Target {
        let TestTls {
            acceptor,
            ca_pem,
            ca_der,
        } = TestTls::new();
        let behaviour = Arc::new(Behaviour {
            status: AtomicU16::new(204),
            delay_ms: AtomicU64::new(0),
        });
        let servers = {
            let behaviour = behaviour.clone();
            LoopbackServers::start(THREAD_NAME, acceptor, move |stream, _| {
                let behaviour = behaviour.clone();
                async move { answer(stream, &behaviour).await }
            })
        };
        Target {
            servers,
            ca_pem,
            ca_der,
            behaviour,
        }
    }

    /// `http://127.0.0.1:<port>/generate_204`.
    pub fn http_url(&self) -> String {
        format!("http://{}/generate_204", self.servers.http)
    }

    /// `https://127.0.0.1:<port>/generate_204`.
    pub fn https_url(&self) -> String {
        format!("https://{}/generate_204", self.servers.https)
    }

    /// The status every following request is answered with.
    pub fn set_status(&self, status: u16) {
        self.behaviour.status.store(status, Ordering::SeqCst);
    }

    /// How long the target waits before answering each following request.
    pub fn set_delay(&self, delay: Duration) {
        let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.behaviour.delay_ms.store(ms, Ordering::SeqCst);
    }

    /// Connections accepted so far (HTTP and HTTPS): one per probe when nothing is pooled.
    pub fn connections(&self) -> u64 {
        self.servers.accepted()
    }

    /// The CA certificate that signed the HTTPS certificate, PEM.
    pub fn ca_cert_pem(&self) -> &str {
        &self.ca_pem
    }

    /// The CA certificate that signed the HTTPS certificate, DER.
    pub fn ca_cert_der(&self) -> Vec<u8> {
        self.ca_der.clone()
    }
}

/// Reads one request head (at most 64 KiB); `false` when the peer went away first.
pub async fn read_head<S: AsyncRead + Unpin>(stream: &mut S) -> bool {
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
        if head.len() > 64 * 1024 {
            return false;
        }
    }
    true
}

/// Reads one request head and answers it with the current status, then closes.
async fn answer<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S, behaviour: &Behaviour) {
    if !read_head(&mut stream).await {
        return;
    }
    let delay = behaviour.delay_ms.load(Ordering::SeqCst);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    let status = behaviour.status.load(Ordering::SeqCst);
    let reason = match status {
        200 => "OK",
        204 => "No Content",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Status",
    };
    let length = if status == 204 {
        ""
    } else {
        "Content-Length: 0\r\n"
    };
    let response = format!("HTTP/1.1 {status} {reason}\r\n{length}Connection: close\r\n\r\n");
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.shutdown().await;
}
