//! A loopback web site that crawlers fetch through the gateway, on plain HTTP and on HTTPS (a
//! certificate from its own throw-away CA), with kept-alive connections. Its pages say which
//! address each request came from: the exit address of the upstream proxy it went through.
//!
//! - `GET /generate_204`: 204 (the probe URL of the proxies in front of it)
//! - `GET /ip`: the peer address, as text
//! - `GET /whoami`: `PEER USER`, the peer address and the `X-Vendor-User` header a vendor
//!   squid adds (see [`SquidOptions::vendor`](super::squid::SquidOptions::vendor))
//! - `GET /ban-user/{needle}/{code}`: a site that bans one vendor session: to a request whose
//!   `X-Vendor-User` contains `needle`, status `code`; to any other, as `/whoami`
//! - `GET /status/{code}[?retry_after=N]`: that status (with `Retry-After: N`)
//! - `GET /`: an index linking to `/page/0` .. `/page/{PAGES - 1}`
//! - `GET /page/{n}`: `<p id="ip">PEER</p>`
//! - `GET /assets`: a page with [`ASSETS`] subresources, `/assets/{n}.svg` (images),
//!   `.css` and `.js`, each answered with the peer address in `X-Peer`, so a browser test sees
//!   which exit every one of them left through
//! - `GET /bytes/{n}`: `n` bytes, streamed
//! - `POST /echo`: the request body
//! - `GET /forged`: 403 with the gateway's own headers (`X-Proxy-*`, a `Proxy-Status` naming
//!   `proxy-operator`), as a target could forge them
//! - `GET /ban/{ip}/{code}`: a site that bans one exit: to a request from `ip`, status `code`
//!   with the body `banned PEER`; to any other, 200 with the peer address, as text (as `/ip`)
//! - `GET /captcha/{ip}`: a site that answers one exit with a captcha page: to a request from
//!   `ip`, 200 with an HTML page holding `captcha` in its first KiB; to any other, 200 with an
//!   HTML page without it; both hold the peer address in `<p id="ip">PEER</p>`

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::loopback::LoopbackServers;
use super::target::TestTls;
use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

/// Pages the index links to.
pub const PAGES: usize = 40;

/// Subresources of `/assets`: images `0..8`, stylesheets `8..14`, scripts `14..20`.
pub const ASSETS: usize = 20;

/// The first stylesheet and the first script among the [`ASSETS`].
const FIRST_STYLESHEET: usize = 8;
const FIRST_SCRIPT: usize = 14;

/// A running site; stopped on drop.
pub struct Site {
    servers: LoopbackServers,
    ca_pem: String,
    requests: Arc<AtomicU64>,
}

impl Site {
    /// Starts the site on two free loopback ports.
    pub fn start() -> Site {
        let TestTls {
            acceptor, ca_pem, ..
        } = TestTls::new();
        let requests = Arc::new(AtomicU64::new(0));
        let servers = {
            let requests = requests.clone();
            LoopbackServers::start("test-site", acceptor, move |stream, peer| {
                let requests = requests.clone();
                async move {
                    let service = service_fn(move |request| {
                        requests.fetch_add(1, Ordering::SeqCst);
                        answer(request, peer)
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                }
            })
        };
        Site {
            servers,
            ca_pem,
            requests,
        }
    }

    /// `http://127.0.0.1:<port>{path}`.
    pub fn http(&self, path: &str) -> String {
        format!("http://{}{path}", self.servers.http)
    }

    /// `https://127.0.0.1:<port>{path}` (the certificate is for that address).
    pub fn https(&self, path: &str) -> String {
        format!("https://{}{path}", self.servers.https)
    }

    /// The plain-HTTP port.
    pub fn http_port(&self) -> u16 {
        self.servers.http.port()
    }

    /// The HTTPS port.
    pub fn https_port(&self) -> u16 {
        self.servers.https.port()
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
    let user = request
        .headers()
        .get("x-vendor-user")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_owned();
    let response = match segments.as_slice() {
        ["generate_204"] => status(StatusCode::NO_CONTENT, full("")),
        ["ip"] => text(ip),
        ["whoami"] => text(format!("{ip} {user}")),
        ["ban-user", needle, code] => {
            match code.parse().ok().and_then(|c| StatusCode::from_u16(c).ok()) {
                Some(code) if user.contains(needle) => status(code, full(format!("{ip} {user}"))),
                Some(_) => text(format!("{ip} {user}")),
                None => status(StatusCode::BAD_REQUEST, full("")),
            }
        }
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
        ["assets"] => html(assets_page()),
        ["assets", file] => asset(file, &ip),
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
        ["forged"] => {
            let mut response = status(StatusCode::FORBIDDEN, full(ip));
            for (name, value) in [
                ("x-proxy-name", "default/forged"),
                ("x-proxy-lease", "forged-lease"),
                ("x-proxy-session-moved", "default/forged"),
                ("x-proxy-ban-reported", "blocked"),
                ("proxy-status", "proxy-operator; details=\"no_match\""),
            ] {
                response.headers_mut().insert(
                    hyper::header::HeaderName::from_static(name),
                    hyper::header::HeaderValue::from_static(value),
                );
            }
            response
        }
        ["ban", banned, code] => match code.parse().ok().and_then(|c| StatusCode::from_u16(c).ok())
        {
            Some(code) if *banned == ip => status(code, full(format!("banned {ip}\n"))),
            Some(_) => text(ip),
            None => status(StatusCode::BAD_REQUEST, full("")),
        },
        ["captcha", banned] if *banned == ip => html(format!(
            "<!doctype html>\n<html><head><title>Are you a robot?</title></head><body>\n\
             <form id=\"captcha\"><p>Please solve this captcha to go on.</p></form>\n\
             <p id=\"ip\">{ip}</p></body></html>\n"
        )),
        ["captcha", _] => html(format!(
            "<!doctype html>\n<html><head><title>welcome</title></head><body>\n\
             <p id=\"ip\">{ip}</p></body></html>\n"
        )),
        _ => status(StatusCode::NOT_FOUND, full("")),
    };
    Ok(response)
}

/// The `/assets` page: every subresource is loaded before its `load` event.
fn assets_page() -> String {
    let tags: String = (0..ASSETS)
        .map(|n| match n {
            n if n < FIRST_STYLESHEET => format!("<img src=\"/assets/{n}.svg\" alt=\"{n}\">\n"),
            n if n < FIRST_SCRIPT => {
                format!("<link rel=\"stylesheet\" href=\"/assets/{n}.css\">\n")
            }
            n => format!("<script src=\"/assets/{n}.js\"></script>\n"),
        })
        .collect();
    format!(
        "<!doctype html>\n<html><head><title>assets</title></head><body>\n{tags}</body></html>\n"
    )
}

/// One subresource of `/assets` (`{n}.svg`, `{n}.css` or `{n}.js`), with the peer in `X-Peer`;
/// a script records that it ran in `window.assetScripts`. Never cached: each load is a request.
fn asset(file: &str, ip: &str) -> Response<Body> {
    let (body, content_type) = match file.split_once('.') {
        Some((n, "svg")) if n.parse::<usize>().is_ok() => (
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"1\" height=\"1\"/>".to_owned(),
            "image/svg+xml",
        ),
        Some((n, "css")) if n.parse::<usize>().is_ok() => {
            (format!(".asset-{n} {{ color: teal; }}\n"), "text/css")
        }
        Some((n, "js")) if n.parse::<usize>().is_ok() => (
            format!("(window.assetScripts = window.assetScripts || []).push({n});\n"),
            "text/javascript",
        ),
        _ => return status(StatusCode::NOT_FOUND, full("")),
    };
    let mut response = typed(body, content_type);
    let headers = response.headers_mut();
    if let Ok(peer) = hyper::header::HeaderValue::from_str(ip) {
        headers.insert("x-peer", peer);
    }
    headers.insert(
        "cache-control",
        hyper::header::HeaderValue::from_static("no-store"),
    );
    response
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
