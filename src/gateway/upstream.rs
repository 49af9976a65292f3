//! Connections to upstream proxies: where a proxy is ([`Upstream`]), a kept-alive HTTP/1.1
//! connection per client connection and lease for plain requests, and a tunnel per `CONNECT`.
//!
//! An HTTP proxy gets a `CONNECT` for a tunnel and absolute-form requests on its kept
//! connection. A SOCKS5 proxy (RFC 1928, credentials as RFC 1929 username/password) opens a
//! stream to the target for either: the target's name goes upstream unresolved (`socks5h`), and
//! plain requests go over that stream in origin-form, so a kept connection to a SOCKS5 proxy
//! serves one target authority only. The handshake is hyper-util's, the one reqwest's `socks`
//! feature uses for the probes.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::client::conn::http1::{self, SendRequest};
use hyper::header::{HOST, HeaderValue, PROXY_AUTHORIZATION};
use hyper::{Method, Request, StatusCode, Uri};
use hyper_util::client::legacy::connect::proxy::SocksV5;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tower_service::Service;

use super::intercept::TargetRefused;
use crate::credentials::Credentials;
use crate::resources::proxy::{EndpointProtocol, ProxyId};

/// Where a proxy is and what it asks for.
#[derive(Debug, Clone)]
pub struct Upstream {
    /// Host to connect to.
    pub host: String,
    /// Port to connect to.
    pub port: u16,
    /// What it speaks.
    pub protocol: EndpointProtocol,
    /// Credentials it asks for, if any.
    pub credentials: Option<Credentials>,
}

/// Why an upstream proxy could not carry a request (said in the `502` answer).
#[derive(Debug)]
pub enum UpstreamFailure {
    /// The TCP connection failed.
    Connect(std::io::Error),
    /// No answer in time.
    Timeout,
    /// The HTTP exchange with the proxy failed.
    Http(hyper::Error),
    /// The proxy answered the `CONNECT` (or a plain request, with its own 407) with this
    /// status.
    Refused(StatusCode),
    /// A SOCKS5 proxy refused the credentials or the stream to the target (a reply code other
    /// than success), or its handshake made no sense; the reason, without the credentials.
    SocksRefused(String),
    /// The target refused the gateway's own TLS (an intercepted CONNECT): its certificate
    /// did not verify, or its handshake failed. No fault of the proxy.
    Target(TargetRefused),
}

impl fmt::Display for UpstreamFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UpstreamFailure::Connect(e) => write!(f, "connecting failed: {e}"),
            UpstreamFailure::Timeout => f.write_str("no answer in time"),
            UpstreamFailure::Http(e) => write!(f, "the exchange failed: {e}"),
            UpstreamFailure::Refused(status) => write!(f, "answered {status}"),
            UpstreamFailure::SocksRefused(reason) => write!(f, "SOCKS5 refused: {reason}"),
            UpstreamFailure::Target(refused) => write!(f, "{refused}"),
        }
    }
}

/// The `Proxy-Authorization` value for an upstream's credentials, if it has any.
fn proxy_authorization(upstream: &Upstream) -> Option<HeaderValue> {
    let credentials = upstream.credentials.as_ref()?;
    HeaderValue::try_from(credentials.basic()).ok()
}

/// Opens a TCP connection to the upstream proxy within `timeout`.
async fn connect(upstream: &Upstream, timeout: Duration) -> Result<TcpStream, UpstreamFailure> {
    let stream = tokio::time::timeout(
        timeout,
        TcpStream::connect((upstream.host.as_str(), upstream.port)),
    )
    .await
    .map_err(|_| UpstreamFailure::Timeout)?
    .map_err(UpstreamFailure::Connect)?;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// A stream to the target through an upstream proxy, and the bytes the proxy already sent past
/// its answer (the target's first bytes).
pub struct Tunnel {
    /// The TCP connection to the proxy, now carrying the target's bytes.
    pub stream: TcpStream,
    /// What came from the target with the proxy's answer, to be read first.
    pub early: Bytes,
}

/// A tunnel to `authority` (`host:port`) through the upstream proxy: an HTTP proxy's `CONNECT`
/// answered 2xx, or a SOCKS5 proxy's stream granted, within `timeout`.
pub async fn tunnel(
    upstream: &Upstream,
    authority: &str,
    timeout: Duration,
) -> Result<Tunnel, UpstreamFailure> {
    match upstream.protocol {
        EndpointProtocol::Http => http_tunnel(upstream, authority, timeout).await,
        EndpointProtocol::Socks5 => Ok(Tunnel {
            stream: socks_stream(upstream, authority, timeout).await?,
            early: Bytes::new(),
        }),
    }
}

/// A tunnel through an HTTP proxy's `CONNECT`.
async fn http_tunnel(
    upstream: &Upstream,
    authority: &str,
    timeout: Duration,
) -> Result<Tunnel, UpstreamFailure> {
    let stream = connect(upstream, timeout).await?;
    let exchange = async {
        let (mut sender, connection) = http1::handshake::<_, Full<Bytes>>(TokioIo::new(stream))
            .await
            .map_err(UpstreamFailure::Http)?;
        tokio::spawn(async move {
            if let Err(e) = connection.with_upgrades().await {
                log::debug!("gateway: upstream CONNECT connection ended: {e}");
            }
        });
        let mut request = Request::builder()
            .method(Method::CONNECT)
            .uri(authority)
            .body(Full::default())
            .map_err(|_| UpstreamFailure::Refused(StatusCode::BAD_REQUEST))?;
        if let Ok(host) = HeaderValue::try_from(authority) {
            request.headers_mut().insert(HOST, host);
        }
        if let Some(value) = proxy_authorization(upstream) {
            request.headers_mut().insert(PROXY_AUTHORIZATION, value);
        }
        let response = sender
            .send_request(request)
            .await
            .map_err(UpstreamFailure::Http)?;
        if !response.status().is_success() {
            return Err(UpstreamFailure::Refused(response.status()));
        }
        hyper::upgrade::on(response)
            .await
            .map_err(UpstreamFailure::Http)
    };
    let upgraded = tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| UpstreamFailure::Timeout)??;
    // The handshake ran on a plain TCP stream: the downcast cannot miss.
    let parts = upgraded
        .downcast::<TokioIo<TcpStream>>()
        .map_err(|_| UpstreamFailure::Connect(std::io::Error::other("not a TCP stream")))?;
    Ok(Tunnel {
        stream: parts.io.into_inner(),
        early: parts.read_buf,
    })
}

/// A stream to `authority` through a SOCKS5 proxy, granted within `timeout`: the name goes
/// upstream unresolved (`socks5h`), with the proxy's credentials as RFC 1929
/// username/password when it has some.
async fn socks_stream(
    upstream: &Upstream,
    authority: &str,
    timeout: Duration,
) -> Result<TcpStream, UpstreamFailure> {
    let target = Uri::builder()
        .scheme("http")
        .authority(authority)
        .path_and_query("/")
        .build()
        .map_err(|e| UpstreamFailure::SocksRefused(format!("no target {authority:?}: {e}")))?;
    if target.port_u16().is_none() {
        // hyper-util would fill in 443 for a missing port.
        return Err(UpstreamFailure::SocksRefused(format!(
            "no port in the target {authority:?}"
        )));
    }
    let stream = connect(upstream, timeout).await?;
    // The connector is handed the open connection; the proxy address it is given is unused.
    let mut socks = SocksV5::new(Uri::default(), Opened(Some(stream)));
    if let Some(credentials) = &upstream.credentials {
        socks = socks.with_auth(credentials.username.clone(), credentials.password.clone());
    }
    let granted = tokio::time::timeout(timeout, socks.call(target))
        .await
        .map_err(|_| UpstreamFailure::Timeout)?;
    granted.map(TokioIo::into_inner).map_err(socks_failure)
}

/// A SOCKS5 handshake's failure as an upstream failure. hyper-util's error type is not
/// public, only its message: it names the step that failed or the proxy's reply code (e.g.
/// "connection refused", "credentials not accepted"), never the credentials.
fn socks_failure(error: impl fmt::Display) -> UpstreamFailure {
    let message = error.to_string();
    let reason = message.strip_prefix("SOCKS error: ").unwrap_or(&message);
    UpstreamFailure::SocksRefused(reason.to_owned())
}

/// The connection already open to a SOCKS5 proxy, as the connector hyper-util's handshake
/// asks for: it hands it out once.
struct Opened(Option<TcpStream>);

impl Service<Uri> for Opened {
    type Response = TokioIo<TcpStream>;
    type Error = std::io::Error;
    type Future = std::future::Ready<Result<TokioIo<TcpStream>, std::io::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), std::io::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Uri) -> Self::Future {
        std::future::ready(
            self.0
                .take()
                .map(TokioIo::new)
                .ok_or_else(|| std::io::Error::other("the SOCKS5 connection was used already")),
        )
    }
}

/// A kept-alive HTTP/1.1 connection through an upstream proxy, for one client connection's
/// plain requests on one lease (HTTP/1 carries one request at a time, as the client connection
/// does): to an HTTP proxy, for any target, or through a SOCKS5 proxy to one target.
pub struct HttpUpstream {
    proxy: ProxyId,
    sender: SendRequest<Full<Bytes>>,
    busy: Arc<AtomicBool>,
    authorization: Option<HeaderValue>,
    /// The target authority a connection through a SOCKS5 proxy leads to; `None` for an HTTP
    /// proxy's connection.
    target: Option<String>,
}

impl HttpUpstream {
    /// Connects to the proxy of `proxy` at `upstream`, and through a SOCKS5 proxy on to
    /// `authority` (`host:port`), the target of the first request.
    pub async fn open(
        proxy: ProxyId,
        upstream: &Upstream,
        authority: &str,
        timeout: Duration,
    ) -> Result<Self, UpstreamFailure> {
        let (stream, target) = match upstream.protocol {
            EndpointProtocol::Http => (connect(upstream, timeout).await?, None),
            EndpointProtocol::Socks5 => (
                socks_stream(upstream, authority, timeout).await?,
                Some(authority.to_owned()),
            ),
        };
        let (sender, connection) = tokio::time::timeout(
            timeout,
            http1::handshake::<_, Full<Bytes>>(TokioIo::new(stream)),
        )
        .await
        .map_err(|_| UpstreamFailure::Timeout)?
        .map_err(UpstreamFailure::Http)?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                log::debug!("gateway: upstream connection ended: {e}");
            }
        });
        Ok(HttpUpstream {
            proxy,
            sender,
            busy: Arc::new(AtomicBool::new(false)),
            authorization: target
                .is_none()
                .then(|| proxy_authorization(upstream))
                .flatten(),
            target,
        })
    }

    /// Whether it can carry a request to `authority`: an HTTP proxy's connection carries any,
    /// one through a SOCKS5 proxy the target it leads to only.
    pub fn leads_to(&self, authority: &str) -> bool {
        self.target
            .as_deref()
            .is_none_or(|target| target == authority)
    }

    /// Whether the answers come from a proxy (which may ask for its credentials with a `407`)
    /// rather than straight from the target.
    pub fn via_proxy(&self) -> bool {
        self.target.is_none()
    }

    /// The proxy it goes to.
    pub fn proxy(&self) -> &ProxyId {
        &self.proxy
    }

    /// Whether a response is still coming through it.
    pub fn busy(&self) -> bool {
        self.busy.load(Ordering::Acquire)
    }

    /// Whether it can take a request now (open and not busy).
    pub fn ready(&self) -> bool {
        !self.busy() && self.sender.is_ready()
    }

    /// Sends `request` (absolute-form, hop-by-hop headers already gone) with the proxy's
    /// credentials, or in origin-form through a SOCKS5 proxy's stream (the `Host` header names
    /// the target); the answer's head must come within `timeout`. The connection is busy until
    /// the returned flag's guard is dropped (when the response body has been relayed).
    pub async fn send(
        &mut self,
        mut request: Request<Full<Bytes>>,
        timeout: Duration,
    ) -> Result<(hyper::Response<hyper::body::Incoming>, Busy), UpstreamFailure> {
        if let Some(value) = &self.authorization {
            request
                .headers_mut()
                .insert(PROXY_AUTHORIZATION, value.clone());
        }
        if self.target.is_some() {
            let origin_form = request
                .uri()
                .path_and_query()
                .map_or_else(|| Uri::from_static("/"), |path| Uri::from(path.clone()));
            *request.uri_mut() = origin_form;
        }
        self.busy.store(true, Ordering::Release);
        let busy = Busy(self.busy.clone());
        let response = tokio::time::timeout(timeout, self.sender.send_request(request))
            .await
            .map_err(|_| UpstreamFailure::Timeout)?
            .map_err(UpstreamFailure::Http)?;
        Ok((response, busy))
    }
}

/// Marks an [`HttpUpstream`] busy until dropped.
#[derive(Debug)]
pub struct Busy(Arc<AtomicBool>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}
