//! A real squid (Debian package `squid`) on a free loopback port, with its own config, pid,
//! log and cache paths in a temp dir. Killed on drop.

use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

/// How the proxy behaves.
#[derive(Debug, Clone, Default)]
pub struct SquidOptions {
    /// Refuse every CONNECT request (403), as a proxy with a strict ACL does.
    pub deny_connect: bool,
    /// The loopback address it listens on and connects out from (`tcp_outgoing_address`), so a
    /// target sees which proxy a request came through; `None`: 127.0.0.1.
    pub address: Option<Ipv4Addr>,
    /// The `user:password-file line` it requires (`basic_ncsa_auth`), as paid proxies and the
    /// operator's Managed squids do; `None`: open.
    pub htpasswd: Option<String>,
    /// Plays a vendor endpoint whose exit follows the username: any password is taken
    /// (`basic_fake_auth`), a username holding `session-C…` (or `sessid-C…`) leaves from `127.0.0.(100 + i)`
    /// where `C` is the `i`-th character of `a`–`z`, `2`–`7` (`proxy_auth_regex`), and plain
    /// requests carry the username to the target in `X-Vendor-User`.
    pub vendor: bool,
}

/// The characters a vendor session id starts with (lowercase RFC 4648 base32).
const SESSION_ALPHABET: &str = "abcdefghijklmnopqrstuvwxyz234567";

/// The exit address a vendor squid gives a username whose session starts with `first`.
pub fn vendor_exit(first: char) -> Option<Ipv4Addr> {
    let index = SESSION_ALPHABET.find(first)?;
    Some(Ipv4Addr::new(127, 0, 0, 100 + u8::try_from(index).ok()?))
}

/// A running (or killed, restartable) squid.
#[derive(Debug)]
pub struct Squid {
    dir: TempDir,
    address: Ipv4Addr,
    port: u16,
    child: Option<Child>,
}

impl Squid {
    /// Starts a permissive squid.
    pub fn start() -> Squid {
        Squid::start_with(SquidOptions::default())
    }

    /// Starts a squid with `options`, on a free loopback port, and waits until it accepts.
    pub fn start_with(options: SquidOptions) -> Squid {
        let binary = binary();
        let mut dir = tempfile::Builder::new()
            .prefix("squid-")
            .tempdir()
            .expect("create a temp dir for squid");
        // Started as root, squid drops to the `proxy` user, which must write here.
        make_world_writable(dir.path());
        if let Some(line) = &options.htpasswd {
            std::fs::write(dir.path().join("passwd"), format!("{line}\n")).expect("write passwd");
        }
        let address = options.address.unwrap_or(Ipv4Addr::LOCALHOST);
        let mut last_log = String::new();
        for _ in 0..5 {
            let port = free_port();
            std::fs::write(
                dir.path().join("squid.conf"),
                config(dir.path(), address, port, &options),
            )
            .expect("write squid.conf");
            let mut squid = Squid {
                dir,
                address,
                port,
                child: None,
            };
            match squid.spawn(&binary) {
                Ok(()) => return squid,
                // Another process took the port between probing and binding: try another.
                Err(log) => {
                    last_log = log;
                    dir = squid.into_dir();
                }
            }
        }
        panic!("squid did not start; cache.log:\n{last_log}");
    }

    /// The port squid listens on (stays the same across restarts).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The address it listens on and connects out from.
    pub fn address(&self) -> Ipv4Addr {
        self.address
    }

    /// `http://<address>:<port>`, the proxy URL.
    pub fn url(&self) -> String {
        format!("http://{}:{}", self.address, self.port)
    }

    /// The process ID, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills squid (SIGKILL) and reaps it; the port then refuses connections.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts squid again on the same port with the same config.
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + super::DEADLINE;
        loop {
            match self.spawn(&binary()) {
                Ok(()) => return,
                Err(log) if Instant::now() > deadline => {
                    panic!(
                        "squid did not restart on port {}; cache.log:\n{log}",
                        self.port
                    )
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// The access log: one line per request squid served (CONNECT tunnels included).
    pub fn access_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("access.log")).unwrap_or_default()
    }

    fn spawn(&mut self, binary: &Path) -> Result<(), String> {
        let conf = self.dir.path().join("squid.conf");
        let child = Command::new(binary)
            .arg("-N")
            .arg("-f")
            .arg(&conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", binary.display()));
        let addr = SocketAddr::from((self.address, self.port));
        self.child = Some(super::listening(child, addr).ok_or_else(|| self.cache_log())?);
        Ok(())
    }

    fn cache_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("cache.log")).unwrap_or_default()
    }

    fn into_dir(mut self) -> TempDir {
        self.kill();
        let placeholder = tempfile::tempdir().expect("create a temp dir");
        std::mem::replace(&mut self.dir, placeholder)
    }
}

impl Drop for Squid {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The squid binary, or a panic that says how to install it.
fn binary() -> PathBuf {
    let candidates = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/sbin")]);
    for dir in candidates {
        let candidate = dir.join("squid");
        if candidate.is_file() {
            return candidate;
        }
    }
    panic!("squid is required by the health tests; install squid: apt-get install -y squid");
}

/// Ports this process has handed out (see [`free_port`]).
static HANDED_OUT: std::sync::Mutex<std::collections::BTreeSet<u16>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// A listener on a loopback port this process has not used before: the tests run side by
/// side, and a port a test has freed (a killed squid, meant to refuse connections) must not
/// become another test's listener.
pub fn loopback_listener() -> TcpListener {
    loop {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
        let port = listener
            .local_addr()
            .expect("a bound listener has an address")
            .port();
        if HANDED_OUT
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(port)
        {
            return listener;
        }
    }
}

/// A loopback port nothing listens on right now, never handed out before in this process
/// (see [`loopback_listener`]), for a server the caller starts on it.
pub fn free_port() -> u16 {
    loopback_listener()
        .local_addr()
        .expect("a bound listener has an address")
        .port()
}

fn make_world_writable(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777))
        .expect("make the squid dir writable");
}

fn config(dir: &Path, address: Ipv4Addr, port: u16, options: &SquidOptions) -> String {
    let dir = dir.display();
    let connect_rule = if options.deny_connect {
        "http_access deny CONNECT\n"
    } else {
        ""
    };
    let outgoing = match options.address {
        Some(address) => format!("tcp_outgoing_address {address}\n"),
        None => String::new(),
    };
    let access = match options.htpasswd {
        _ if options.vendor => {
            let exits: String = SESSION_ALPHABET
                .chars()
                .filter_map(|c| Some((c, vendor_exit(c)?)))
                .map(|(c, exit)| {
                    format!(
                        "acl session_{c} proxy_auth_regex sess[a-z]*-{c}\n\
                         tcp_outgoing_address {exit} session_{c}\n"
                    )
                })
                .collect();
            format!(
                "auth_param basic program /usr/lib/squid/basic_fake_auth\n\
                 auth_param basic realm vendor\n\
                 acl authenticated proxy_auth REQUIRED\n\
                 {exits}\
                 request_header_add X-Vendor-User \"%ul\" all\n\
                 http_access allow authenticated\n\
                 http_access deny all\n"
            )
        }
        Some(_) => format!(
            "auth_param basic program /usr/lib/squid/basic_ncsa_auth {dir}/passwd\n\
             auth_param basic realm proxy-operator-test\n\
             acl authenticated proxy_auth REQUIRED\n\
             http_access allow authenticated\n\
             http_access deny all\n"
        ),
        None => "http_access allow all\n".to_owned(),
    };
    format!(
        "http_port {address}:{port}\n\
         {outgoing}\
         pid_filename {dir}/squid.pid\n\
         access_log stdio:{dir}/access.log\n\
         cache_log {dir}/cache.log\n\
         cache_store_log none\n\
         cache deny all\n\
         coredump_dir {dir}\n\
         pinger_enable off\n\
         visible_hostname proxy-operator-test\n\
         shutdown_lifetime 0 seconds\n\
         {connect_rule}\
         {access}"
    )
}
