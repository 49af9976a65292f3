//! HTTPS through a forward proxy, as a load: connections that each `CONNECT` through the proxy,
//! take TLS with the target (trusting the roots given: the site's CA for a tunnel, the
//! gateway's or another interceptor's CA when the proxy intercepts) and send GETs, either kept
//! alive for a duration or one per connection. Closed loop: each connection sends its next
//! request when the last answer is read whole.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::Request;
use hyper_util::rt::TokioIo;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Where the load goes: the proxy, what it is told, and what the client trusts.
#[derive(Clone)]
pub struct Via {
    /// The proxy's `host:port`.
    pub proxy: String,
    /// A `Proxy-Authorization` header line (with its CRLF), or empty.
    pub authorization: String,
    /// The target's host and port, as the CONNECT and the TLS name them.
    pub target: (String, u16),
    /// The roots the client verifies the certificate it gets against.
    pub roots: Arc<rustls::ClientConfig>,
}

impl Via {
    /// A client configuration trusting `pem` (one or more CA certificates) only.
    pub fn trusting(pem: &[u8]) -> Arc<rustls::ClientConfig> {
        use rustls::pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(pem) {
            roots.add(cert.expect("a PEM certificate")).expect("a root");
        }
        Arc::new(
            rustls::ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::aws_lc_rs::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_root_certificates(roots)
            .with_no_client_auth(),
        )
    }
}

/// What a load did.
#[derive(Debug, Default)]
pub struct Load {
    /// Requests answered 200 and read whole.
    pub requests: u64,
    /// Connections opened (CONNECT and TLS done).
    pub connections: u64,
    /// Failures.
    pub errors: u64,
    /// The first failure, said.
    pub first_error: Option<String>,
    /// How long it ran.
    pub elapsed: Duration,
}

impl Load {
    /// Requests per second.
    pub fn rate(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64()
    }

    /// Connections per second.
    pub fn connection_rate(&self) -> f64 {
        self.connections as f64 / self.elapsed.as_secs_f64()
    }
}

type Sender = hyper::client::conn::http1::SendRequest<Empty<Bytes>>;

/// CONNECT through `via`, TLS with the target, an HTTP/1.1 connection on it.
async fn open(via: &Via) -> Result<Sender, String> {
    let (host, port) = &via.target;
    let mut stream = TcpStream::connect(&via.proxy)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let _ = stream.set_nodelay(true);
    stream
        .write_all(
            format!(
                "CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n{}\r\n",
                via.authorization
            )
            .as_bytes(),
        )
        .await
        .map_err(|e| format!("CONNECT: {e}"))?;
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = stream
            .read(&mut byte)
            .await
            .map_err(|e| format!("CONNECT answer: {e}"))?;
        if n == 0 {
            return Err("the proxy closed before answering the CONNECT".to_owned());
        }
        head.push(byte[0]);
    }
    if !head.starts_with(b"HTTP/1.1 200") && !head.starts_with(b"HTTP/1.0 200") {
        return Err(format!(
            "CONNECT answered {}",
            String::from_utf8_lossy(&head)
        ));
    }
    let name = ServerName::try_from(host.clone()).map_err(|e| e.to_string())?;
    let tls = tokio_rustls::TlsConnector::from(via.roots.clone())
        .connect(name, stream)
        .await
        .map_err(|e| format!("TLS: {e}"))?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .map_err(|e| format!("HTTP: {e}"))?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(sender)
}

/// One GET of `path`, read whole.
async fn get(sender: &mut Sender, host: &str, path: &str) -> Result<(), String> {
    sender.ready().await.map_err(|e| e.to_string())?;
    let request = Request::get(path)
        .header("host", host)
        .body(Empty::new())
        .map_err(|e| e.to_string())?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status();
    response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?;
    if status != 200 {
        return Err(format!("answered {status}"));
    }
    Ok(())
}

/// `connections` connections for `duration`; with `keep_alive` each sends its GETs of `path`
/// on one connection, else each opens a new connection per GET.
pub async fn run(
    via: &Via,
    path: &str,
    connections: usize,
    duration: Duration,
    keep_alive: bool,
) -> Load {
    let requests = Arc::new(AtomicU64::new(0));
    let opened = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let first = Arc::new(std::sync::Mutex::new(None::<String>));
    let start = Instant::now();
    let deadline = start + duration;
    let mut tasks = Vec::new();
    for _ in 0..connections {
        let (via, path) = (via.clone(), path.to_owned());
        let (requests, opened, errors, first) = (
            requests.clone(),
            opened.clone(),
            errors.clone(),
            first.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let fail = |e: String| {
                errors.fetch_add(1, Ordering::Relaxed);
                first.lock().unwrap().get_or_insert(e);
            };
            let mut sender: Option<Sender> = None;
            while Instant::now() < deadline {
                let current = match sender.as_mut() {
                    Some(sender) => sender,
                    None => match open(&via).await {
                        Ok(opened_now) => {
                            opened.fetch_add(1, Ordering::Relaxed);
                            sender.insert(opened_now)
                        }
                        Err(e) => {
                            fail(e);
                            continue;
                        }
                    },
                };
                match get(current, &via.target.0, &path).await {
                    Ok(()) => {
                        requests.fetch_add(1, Ordering::Relaxed);
                        if !keep_alive {
                            sender = None;
                        }
                    }
                    Err(e) => {
                        fail(e);
                        sender = None;
                    }
                }
            }
        }));
    }
    for task in tasks {
        let _ = task.await;
    }
    let first_error = first.lock().unwrap().take();
    Load {
        requests: requests.load(Ordering::Relaxed),
        connections: opened.load(Ordering::Relaxed),
        errors: errors.load(Ordering::Relaxed),
        first_error,
        elapsed: start.elapsed(),
    }
}
