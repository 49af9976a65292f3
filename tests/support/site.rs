//! A loopback web site that crawlers fetch through the gateway, on plain HTTP and on HTTPS (a
//! certificate from its own throw-away CA), with kept-alive connections. Its pages say which
//! address each request came from: the exit address of the upstream proxy it went through.
//!
//! - `GET /generate_204`: 204 (the probe URL of the proxies in front of it)
//! - `GET /ip`: the peer address, as text
//! - `GET /status/{code}[?retry_after=N]`: that status (with `Retry-After: N`)
//! - `GET /`: an index linking to `/page/0` .. `/page/{PAGES - 1}`
//! - `GET /page/{n}`: `<p id="ip">PEER</p>`
//! - `GET /bytes/{n}`: `n` bytes, streamed
//! - `POST /echo`: the request body

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::target::TestTls;

/// Pages the index links to.
pub const PAGES: usize = 40;

/// A running site; stopped on drop.
pub struct Site {
    http: SocketAddr,
    https: SocketAddr,
    ca_pem: String,
    requests: Arc<AtomicU64>,
    shutdown: CancellationToken,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Site {
    /// Starts the site on two free loopback ports.
    pub fn start() -> Site {
        let TestTls {
            acceptor, ca_pem, ..
        } = TestTls::new();
        let std_http = super::loopback_listener();
        let std_https = super::loopback_listener();
        let http = std_http.local_addr().expect("the HTTP address");
        let https = std_https.local_addr().expect("the HTTPS address");
        for listener in [&std_http, &std_https] {
            listener.set_nonblocking(true).expect("non-blocking");
        }
        let requests = Arc::new(AtomicU64::new(0));
        let shutdown = CancellationToken::new();
        let thread = {
            let shutdown = shutdown.clone();
            let requests = requests.clone();
            std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name("test-site")
                    .enable_all()
                    .build()
                    .expect("the site's runtime");
                runtime.block_on(async move {
                    let http = TcpListener::from_std(std_http).expect("HTTP listener");
                    let https = TcpListener::from_std(std_https).expect("HTTPS listener");
                    tokio::spawn(serve(http, None, requests.clone()));
                    tokio::spawn(serve(https, Some(acceptor), requests));
                    shutdown.cancelled().await;
                });
                runtime.shutdown_background();
            })
        };
        Site {
            http,
            https,
            ca_pem,
            requests,
            shutdown,
            thread: Some(thread),
        }
    }

    /// `http://127.0.0.1:<port>{path}`.
    pub fn http(&self, path: &str) -> String {
        format!("http://{}{path}", self.http)
    }

    /// `https://127.0.0.1:<port>{path}` (the certificate is for that address).
    pub fn https(&self, path: &str) -> String {
        format!("https://{}{path}", self.https)
    }

    /// The plain-HTTP port.
    pub fn http_port(&self) -> u16 {
        self.http.port()
    }

    /// The HTTPS port.
    pub fn https_port(&self) -> u16 {
        self.https.port()
    }

    /// The CA that signed the HTTPS certificate, PEM.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// Requests answered so far.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }
}

impl Drop for Site {
    fn drop(&mut self) {
        self.shutdown.cancel();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn serve(
    listener: TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    requests: Arc<AtomicU64>,
) {
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            continue;
        };
        let tls = tls.clone();
        let requests = requests.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                requests.fetch_add(1, Ordering::SeqCst);
                answer(request, peer)
            });
            let builder = hyper::server::conn::http1::Builder::new();
            match tls {
                Some(acceptor) => {
                    if let Ok(stream) = acceptor.accept(stream).await {
                        let _ = builder
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    }
                }
                None => {
                    let _ = builder
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                }
            }
        });
    }
}

type Body = BoxBody<Bytes, Infallible>;

fn full(text: impl Into<Bytes>) -> Body {
    Full::new(text.into()).boxed()
}

async fn answer(
    request: Request<Incoming>,
    peer: SocketAddr,
) -> Result<Response<Body>, Infallible> {
    let path = request.uri().path().to_owned();
    let query = request.uri().query().unwrap_or_default().to_owned();
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let ip = peer.ip().to_string();
    let response = match segments.as_slice() {
        ["generate_204"] => status(StatusCode::NO_CONTENT, full("")),
        ["ip"] => text(ip),
        ["status", code] => {
            let code = code.parse().ok().and_then(|c| StatusCode::from_u16(c).ok());
            let mut response = status(code.unwrap_or(StatusCode::BAD_REQUEST), full(ip));
            if let Some(seconds) = query.strip_prefix("retry_after=")
                && let Ok(value) = seconds.parse()
            {
                response.headers_mut().insert("retry-after", value);
            }
            response
        }
        [""] => {
            let links: String = (0..PAGES)
                .map(|n| format!("<a href=\"/page/{n}\">page {n}</a>\n"))
                .collect();
            html(format!("<html><body>\n{links}</body></html>\n"))
        }
        ["page", n] => html(format!(
            "<html><body><h1>page {n}</h1><p id=\"ip\">{ip}</p></body></html>\n"
        )),
        ["bytes", n] => match n.parse::<u64>() {
            Ok(n) => Response::new(bytes(n)),
            Err(_) => status(StatusCode::BAD_REQUEST, full("")),
        },
        ["echo"] => {
            let body = request
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            Response::new(full(body))
        }
        _ => status(StatusCode::NOT_FOUND, full("")),
    };
    Ok(response)
}

fn status(code: StatusCode, body: Body) -> Response<Body> {
    let mut response = Response::new(body);
    *response.status_mut() = code;
    response
}

fn html(text: String) -> Response<Body> {
    typed(text, "text/html; charset=utf-8")
}

fn text(text: String) -> Response<Body> {
    typed(text, "text/plain; charset=utf-8")
}

fn typed(text: String, content_type: &'static str) -> Response<Body> {
    let mut response = Response::new(full(text));
    response.headers_mut().insert(
        "content-type",
        hyper::header::HeaderValue::from_static(content_type),
    );
    response
}

/// `n` bytes in 64 KiB frames.
fn bytes(n: u64) -> Body {
    const CHUNK: u64 = 64 * 1024;
    let chunk = Bytes::from(vec![b'x'; CHUNK as usize]);
    let frames = (0..n.div_ceil(CHUNK)).map(move |i| {
        let len = CHUNK.min(n - i * CHUNK) as usize;
        Ok::<_, Infallible>(Frame::data(chunk.slice(..len)))
    });
    StreamBody::new(futures::stream::iter(frames)).boxed()
}
