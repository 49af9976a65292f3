//! Connections to upstream proxies: where a proxy is ([`Upstream`]), a kept-alive HTTP/1.1
//! connection per client connection and lease for plain requests, and a `CONNECT` per tunnel.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::client::conn::http1::{self, SendRequest};
use hyper::header::{HOST, HeaderValue, PROXY_AUTHORIZATION};
use hyper::upgrade::Upgraded;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::intercept::TargetRefused;
use crate::credentials::Credentials;
use crate::resources::proxy::ProxyId;

/// Where a proxy is and what it asks for.
#[derive(Debug, Clone)]
pub struct Upstream {
    /// Host to connect to.
    pub host: String,
    /// Port to connect to.
    pub port: u16,
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

/// A tunnel to `authority` through the upstream proxy: its `CONNECT` answered 2xx within
/// `timeout`.
pub async fn tunnel(
    upstream: &Upstream,
    authority: &str,
    timeout: Duration,
) -> Result<Upgraded, UpstreamFailure> {
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
    Ok(upgraded)
}

/// A kept-alive HTTP/1.1 connection to an upstream proxy, for one client connection's plain
/// requests on one lease (HTTP/1 carries one request at a time, as the client connection does).
pub struct HttpUpstream {
    proxy: ProxyId,
    sender: SendRequest<Full<Bytes>>,
    busy: Arc<AtomicBool>,
    authorization: Option<HeaderValue>,
}

impl HttpUpstream {
    /// Connects to the proxy of `proxy` at `upstream`.
    pub async fn open(
        proxy: ProxyId,
        upstream: &Upstream,
        timeout: Duration,
    ) -> Result<Self, UpstreamFailure> {
        let stream = connect(upstream, timeout).await?;
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
            authorization: proxy_authorization(upstream),
        })
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
    /// credentials; the answer's head must come within `timeout`. The connection is busy until
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
