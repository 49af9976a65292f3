//! A crawler writing its requests by hand: for request lines no HTTP client library would
//! send as given (`CONNECT 0x7f.1:80`, a URL with userinfo), half-sent heads, and connections
//! held open on purpose.

use std::time::Duration;

use base64::Engine;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::curl::header_value;

/// One answer read off a connection.
#[derive(Debug)]
pub struct Answer {
    /// Its status.
    pub status: u16,
    /// Its head, status line included.
    pub head: String,
    /// Its body (by `Content-Length`).
    pub body: String,
}

impl Answer {
    /// The value of header `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        header_value(&self.head, name)
    }

    /// The body as JSON (`Null` when it is not).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_default()
    }
}

/// `Proxy-Authorization: Basic` for `user` and `token`, as a header line.
pub fn proxy_authorization(user: &str, token: &str) -> String {
    let pair = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{token}"));
    format!("Proxy-Authorization: Basic {pair}\r\n")
}

/// Writes `request` (a whole head, and a body if any) to `stream`.
pub async fn send(stream: &mut TcpStream, request: &str) {
    stream
        .write_all(request.as_bytes())
        .await
        .expect("write the request");
}

/// Reads one answer (head, then `Content-Length` bytes of body) within `limit`.
pub async fn read_answer(stream: &mut TcpStream, limit: Duration) -> Answer {
    tokio::time::timeout(limit, async {
        let mut buffer = Vec::new();
        let mut chunk = [0u8; 4096];
        let head_end = loop {
            if let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
                break end + 4;
            }
            let n = stream.read(&mut chunk).await.expect("read the answer");
            assert!(
                n > 0,
                "closed before a whole head: {:?}",
                String::from_utf8_lossy(&buffer)
            );
            buffer.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buffer[..head_end]).into_owned();
        let length: usize = header_value(&head, "content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        while buffer.len() < head_end + length {
            let n = stream.read(&mut chunk).await.expect("read the body");
            assert!(n > 0, "closed before the whole body");
            buffer.extend_from_slice(&chunk[..n]);
        }
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .expect("a status line");
        Answer {
            status,
            body: String::from_utf8_lossy(&buffer[head_end..head_end + length]).into_owned(),
            head,
        }
    })
    .await
    .expect("an answer in time")
}

/// Sends `request` on a new connection to `address` and reads the answer.
pub async fn exchange(address: &str, request: &str) -> Answer {
    let mut stream = TcpStream::connect(address).await.expect("connect");
    send(&mut stream, request).await;
    read_answer(&mut stream, Duration::from_secs(30)).await
}

/// Reads from `stream` until the peer closes it (or it errs), within `limit`; `false` when it
/// stayed open that long.
pub async fn closed_within(stream: &mut TcpStream, limit: Duration) -> bool {
    tokio::time::timeout(limit, async {
        let mut chunk = [0u8; 4096];
        loop {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}
