//! A relay that parses nothing, for `benches/gateway/socks.rs` to print beside the gateway:
//! haproxy in `mode tcp` (one thread) on a free loopback port, passing bytes to one upstream.
//! What it costs is what any extra hop costs on this machine (a loopback connection each way,
//! and the client, the proxy and the site sharing the cores), so the gateway's figure can be
//! read against it. Stopped on drop.

use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::squid::free_port;

/// How long haproxy gets to accept its first connection.
const START_DEADLINE: Duration = Duration::from_secs(10);

/// A running haproxy relaying to one address.
pub struct TcpRelay {
    child: Child,
    port: u16,
}

impl TcpRelay {
    /// haproxy relaying 127.0.0.1:<free port> to `upstream`, its config in `dir`; `None` (said
    /// on stderr) when haproxy is not installed or does not start.
    pub fn start(dir: &Path, upstream: SocketAddr) -> Option<TcpRelay> {
        let port = free_port();
        let config = dir.join("haproxy.cfg");
        let text = format!(
            "global\n  nbthread 1\n\
             defaults\n  mode tcp\n  timeout connect 5s\n  timeout client 60s\n  \
             timeout server 60s\n\
             listen relay\n  bind 127.0.0.1:{port}\n  server upstream {upstream}\n"
        );
        std::fs::write(&config, text).expect("write haproxy.cfg");
        // `-db`: in the foreground, so the child is haproxy itself and stops with it.
        let child = match Command::new("haproxy")
            .arg("-db")
            .arg("-f")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
        {
            Ok(child) => child,
            Err(e) => {
                eprintln!(
                    "haproxy cannot run ({e}); the TCP relay's reference row is left out \
                     (apt-get install -y haproxy)"
                );
                return None;
            }
        };
        let relay = TcpRelay { child, port };
        let started = Instant::now();
        while started.elapsed() < START_DEADLINE {
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Some(relay);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!("haproxy did not listen within {START_DEADLINE:?}; its row is left out");
        None
    }

    /// `socks5h://127.0.0.1:<port>`: the upstream's SOCKS5, one hop further.
    pub fn socks_url(&self) -> String {
        format!("socks5h://127.0.0.1:{}", self.port)
    }
}

impl Drop for TcpRelay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
