//! A loopback "what is my address" target, like `api.ipify.org`: it answers every request
//! `200` with the caller's address as plain text, on plain HTTP and on HTTPS (the test CA).
//! Behind squids that connect out from different loopback addresses (`tcp_outgoing_address`),
//! it tells which exit a request left from.

use tokio::io::AsyncWriteExt;

use super::loopback::LoopbackServers;
use super::target::{TestTls, read_head};

/// A running echo target.
pub struct EchoTarget {
    servers: LoopbackServers,
    ca_pem: String,
}

impl EchoTarget {
    /// Starts the target.
    pub fn start() -> EchoTarget {
        let TestTls {
            acceptor, ca_pem, ..
        } = TestTls::new();
        let servers =
            LoopbackServers::start("echo-target", acceptor, |mut stream, peer| async move {
                if !read_head(&mut stream).await {
                    return;
                }
                let body = peer.ip().to_string();
                let response = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\
                 Connection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(response.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        EchoTarget { servers, ca_pem }
    }

    /// `http://127.0.0.1:<port>/ip`.
    pub fn http_url(&self) -> String {
        format!("http://{}/ip", self.servers.http)
    }

    /// `https://127.0.0.1:<port>/ip`.
    pub fn https_url(&self) -> String {
        format!("https://{}/ip", self.servers.https)
    }

    /// The PEM of the CA its HTTPS certificate is signed by.
    pub fn ca_cert_pem(&self) -> &str {
        &self.ca_pem
    }
}
