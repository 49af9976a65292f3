//! A real SOCKS5 proxy: Dante's `danted` (Debian package `dante-server`) on a free loopback
//! port, with a generated config, pid file and log in a temp dir. Stopped on drop.
//!
//! Dante checks RFC 1929 usernames and passwords against the system's users (`socksmethod:
//! username`, through `getpwnam` and the shadow file; it has no password file of its own). So
//! a proxy that asks for credentials needs a system user: [`socks_user`] creates one, the same
//! for every test process (`useradd --system`, no home, no shell, one fixed password), once per
//! process and idempotently, so test binaries running side by side agree on it. That takes
//! root, as reading the shadow file does; without it such tests are skipped.

use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::squid::free_port;

/// The system user a SOCKS5 proxy with authentication accepts.
pub const SOCKS_USER: &str = "proxy-operator-socks";
/// Its password: fixed, so that processes creating the user at once set the same one.
pub const SOCKS_PASSWORD: &str = "socks-test-password-3f9c";

/// How the proxy behaves.
#[derive(Debug, Clone, Copy, Default)]
pub struct DanteOptions {
    /// The loopback address it listens on and connects out from, so a target sees which proxy a
    /// request came through; `None`: 127.0.0.1.
    pub address: Option<Ipv4Addr>,
    /// Ask for [`SOCKS_USER`] and [`SOCKS_PASSWORD`] (RFC 1929); otherwise no authentication.
    pub authenticate: bool,
}

/// A running (or stopped, restartable) danted.
#[derive(Debug)]
pub struct Dante {
    dir: TempDir,
    address: Ipv4Addr,
    port: u16,
    binary: PathBuf,
    child: Option<Child>,
}

impl Dante {
    /// Starts danted with `options` on a free port and waits until it accepts; `None` when it
    /// cannot run here (no `danted`, or credentials asked for without root), skipped with the
    /// reason (a failure when `CI` is set).
    pub fn start(options: DanteOptions) -> Option<Dante> {
        let binary = binary()?;
        if options.authenticate && !socks_user() {
            return None;
        }
        let dir = tempfile::Builder::new()
            .prefix("dante-")
            .tempdir()
            .expect("create a temp dir for danted");
        let address = options.address.unwrap_or(Ipv4Addr::LOCALHOST);
        let mut dante = Dante {
            dir,
            address,
            port: 0,
            binary,
            child: None,
        };
        let mut last_log = String::new();
        for _ in 0..5 {
            dante.port = free_port();
            std::fs::write(
                dante.conf(),
                config(dante.dir.path(), address, dante.port, options),
            )
            .expect("write danted.conf");
            match dante.spawn() {
                Ok(()) => return Some(dante),
                // Another process took the port between probing and binding: try another.
                Err(log) => last_log = log,
            }
        }
        panic!("danted did not start; its log:\n{last_log}");
    }

    /// The port it listens on (the same across restarts).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The address it listens on and connects out from.
    pub fn address(&self) -> Ipv4Addr {
        self.address
    }

    /// `socks5h://<address>:<port>`, the proxy URL (without credentials).
    pub fn url(&self) -> String {
        format!("socks5h://{}:{}", self.address, self.port)
    }

    /// Stops danted (SIGTERM, so its children go with it) and waits for it; the port then
    /// refuses connections.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pid = libc::pid_t::try_from(child.id()).expect("a pid fits pid_t");
            // SAFETY: `pid` is our own unreaped child, so it names no other process.
            unsafe { libc::kill(pid, libc::SIGTERM) };
            let _ = child.wait();
        }
    }

    /// Starts danted again on the same port with the same config.
    pub fn restart(&mut self) {
        self.stop();
        let deadline = Instant::now() + super::DEADLINE;
        while let Err(log) = self.spawn() {
            assert!(
                Instant::now() < deadline,
                "danted did not restart on port {}; its log:\n{log}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Its log so far: one line per client and per stream it passed or refused.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("danted.log")).unwrap_or_default()
    }

    fn conf(&self) -> PathBuf {
        self.dir.path().join("danted.conf")
    }

    /// Spawns danted in the foreground and polls its port; its log when it does not listen.
    fn spawn(&mut self) -> Result<(), String> {
        let child = Command::new(&self.binary)
            .arg("-f")
            .arg(self.conf())
            .arg("-p")
            .arg(self.dir.path().join("danted.pid"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", self.binary.display()));
        let addr = SocketAddr::from((self.address, self.port));
        self.child = Some(super::listening(child, addr).ok_or_else(|| self.log())?);
        Ok(())
    }
}

impl Drop for Dante {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The danted binary (in `/usr/sbin`, often not on a user's PATH), or `None`, skipped.
fn binary() -> Option<PathBuf> {
    let found = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain([PathBuf::from("/usr/sbin")])
        .map(|dir| dir.join("danted"))
        .find(|candidate| candidate.is_file());
    if found.is_none() {
        super::skip::skip("danted is not installed (apt-get install -y dante-server)");
    }
    found
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Whether [`SOCKS_USER`] exists with [`SOCKS_PASSWORD`]: created (or its password set) once
/// per process; skipped without root.
fn socks_user() -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    let ready = *READY.get_or_init(|| {
        if !is_root() {
            return false;
        }
        let exists = Command::new("id")
            .args(["-u", SOCKS_USER])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !exists {
            // Another test process may be adding it, or holding the passwd lock: exit 9 says
            // it exists by now, any other failure is tried again.
            retry(
                "useradd",
                |status| status == Some(9),
                || {
                    Command::new("useradd")
                        .args([
                            "--system",
                            "--no-create-home",
                            "--shell",
                            "/usr/sbin/nologin",
                        ])
                        .arg(SOCKS_USER)
                        .stdin(Stdio::null())
                        .output()
                },
            );
        }
        retry(
            "chpasswd",
            |_| false,
            || {
                let mut child = Command::new("chpasswd")
                    .stdin(Stdio::piped())
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn()?;
                if let Some(mut stdin) = child.stdin.take() {
                    use std::io::Write as _;
                    writeln!(stdin, "{SOCKS_USER}:{SOCKS_PASSWORD}")?;
                }
                child.wait_with_output()
            },
        );
        true
    });
    if !ready {
        super::skip::skip(
            "a SOCKS5 proxy with authentication checks system users: run the tests as root",
        );
    }
    ready
}

/// Runs `command` until it succeeds (or exits with a status `done` accepts), while the user
/// database is locked by another process, up to the deadline.
fn retry(
    what: &str,
    done: impl Fn(Option<i32>) -> bool,
    command: impl Fn() -> std::io::Result<std::process::Output>,
) {
    let deadline = Instant::now() + super::DEADLINE;
    loop {
        let output = command().unwrap_or_else(|e| panic!("run {what}: {e}"));
        if output.status.success() || done(output.status.code()) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// danted's config: listening and connecting out on `address`, passing every client from
/// loopback and every stream (`connect` only), logging each, with or without RFC 1929.
fn config(dir: &Path, address: Ipv4Addr, port: u16, options: DanteOptions) -> String {
    let dir = dir.display();
    let method = if options.authenticate {
        "username"
    } else {
        "none"
    };
    // As root it reads the shadow file as root and runs the rest as nobody; as any other user
    // it stays that user.
    let users = if is_root() {
        "user.privileged: root\nuser.unprivileged: nobody\n"
    } else {
        ""
    };
    format!(
        "logoutput: {dir}/danted.log\n\
         internal: {address} port = {port}\n\
         external: {address}\n\
         socksmethod: {method}\n\
         {users}\
         client pass {{\n  from: 127.0.0.0/8 to: 0.0.0.0/0\n  log: error connect\n}}\n\
         socks pass {{\n  from: 127.0.0.0/8 to: 0.0.0.0/0\n  command: connect\n  log: error connect\n}}\n"
    )
}
