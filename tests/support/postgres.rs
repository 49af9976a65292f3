//! A real PostgreSQL server (Debian package `postgresql`, installed by `.ci/run`) on a free
//! loopback port, with its data directory, unix socket and log in a temp dir. Clients log in
//! over TCP as role `proxy_operator` with a password (scram-sha-256), as against a production
//! server; the support itself administers it as superuser `postgres` through the socket.
//!
//! PostgreSQL refuses to run as root: when the tests run as root, every PostgreSQL program the
//! support starts runs as the `postgres` system user, which owns the temp dir.
//!
//! Lifetime: the server is spawned through [`spawn_tied`], so the kernel kills it when the test
//! process dies, however it dies. A killed postmaster leaves its data directory and a small
//! System V shared memory segment behind, so: a server of its own ([`Postgres::start`]) is shut
//! down and removed on drop; the shared one ([`Postgres::shared`]) lives in a static, which is
//! never dropped, and is shut down and removed by an `atexit` hook when the test process exits
//! (tests passed or failed); and each start removes what processes that were killed left
//! behind (their roots are named `$TMPDIR/proxy-operator-postgres-<pid>-*`).
//!
//! TLS: [`Postgres::start_with_tls`] starts a server of its own with `ssl = on` and a server
//! certificate for `127.0.0.1` and `localhost` signed by a throw-away CA, whose PEM file it
//! returns (what a client is told to trust, e.g. with `SSL_CERT_FILE`). It accepts TCP logins
//! with and without TLS, both with a password.

use std::fs::OpenOptions;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, TryLockError};
use std::time::{Duration, Instant};

use rand::distr::{Alphanumeric, SampleString};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair,
};

use super::envtest::spawn_tied;
use super::skip::skip;
use super::{DEADLINE, free_port};

/// The login role the operator and the tests' psql connect as.
const ROLE: &str = "proxy_operator";
/// The superuser initdb creates, which only the support uses (through the socket).
const SUPERUSER: &str = "postgres";
/// Prefix of every server's temp root (those of dead processes are removed by the next start).
const ROOT_PREFIX: &str = "proxy-operator-postgres-";
/// The programs the support runs, all in PostgreSQL's `bindir`.
const PROGRAMS: [&str; 4] = ["initdb", "postgres", "pg_isready", "psql"];
/// How to get them, printed when they are missing.
const HOW_TO_INSTALL: &str = "apt-get install -y postgresql";

/// A PostgreSQL server of the tests' own.
pub struct Postgres {
    install: Install,
    /// The temp dir: `data/` (the cluster), the unix socket and `postgres.log`.
    root: PathBuf,
    port: u16,
    /// `proxy_operator`'s password, the same for every database on this server.
    password: String,
    /// The postmaster while it runs; `None` after [`Postgres::stop`].
    server: Mutex<Option<Child>>,
}

/// Where PostgreSQL is installed and whom it runs as.
#[derive(Debug, Clone)]
struct Install {
    /// `pg_config --bindir`, or the newest `/usr/lib/postgresql/<version>/bin`.
    bin: PathBuf,
    /// The `postgres` user's uid and gid when this process is root; `None`: run as ourselves.
    user: Option<(u32, u32)>,
}

/// The shared server's start: skipped (not installed: why, so every test asking for it is
/// skipped as the first was), running, or failed (remembered, so every test asking for it
/// fails fast with the same message).
enum Shared {
    Skipped(String),
    Running(Postgres),
    Failed(String),
}

static SHARED: OnceLock<Shared> = OnceLock::new();

/// Numbers the databases of this process, so their names never repeat.
static DATABASES: AtomicU64 = AtomicU64::new(0);

impl Postgres {
    /// The server shared by every test of this test binary, started on first use and shut down
    /// when the process exits (see the module doc). `None` (after printing "skipped: …") when
    /// PostgreSQL is not installed and `CI` is unset; panics when `CI` is set (CI installs it,
    /// so a missing one is a broken install) or when the server does not start. Tests sharing
    /// it must not [`stop`](Postgres::stop) it.
    pub fn shared() -> Option<&'static Postgres> {
        let shared = SHARED.get_or_init(|| {
            let install = match find_install() {
                Ok(install) => install,
                Err(message) => return Shared::Skipped(message),
            };
            // A failed start is remembered rather than retried by every later test.
            match std::panic::catch_unwind(|| Postgres::launch(install)) {
                Ok(postgres) => {
                    // SAFETY: registers a plain function; it touches only statics.
                    if unsafe { libc::atexit(shut_down_shared) } != 0 {
                        eprintln!("atexit failed: the shared PostgreSQL is killed at exit instead");
                    }
                    Shared::Running(postgres)
                }
                Err(panic) => Shared::Failed(panic_message(&*panic)),
            }
        });
        match shared {
            Shared::Skipped(message) => {
                skip(message);
                None
            }
            Shared::Running(postgres) => Some(postgres),
            Shared::Failed(message) => panic!("the shared PostgreSQL did not start: {message}"),
        }
    }

    /// A server of its own, for tests that stop and restart it; shut down and its directory
    /// removed on drop. `None` or a panic as for [`Postgres::shared`].
    pub fn start() -> Option<Postgres> {
        installed().map(Postgres::launch)
    }

    /// A new, empty database with a unique name (`t_<pid>_<n>`), owned by `proxy_operator`, so
    /// tests sharing the server never see each other's tables. Safe to call from many threads
    /// at once: concurrent `CREATE DATABASE`s of one template are fine in PostgreSQL.
    pub fn database(&self) -> Database {
        let name = format!(
            "t_{}_{}",
            std::process::id(),
            DATABASES.fetch_add(1, Ordering::Relaxed)
        );
        self.admin(&format!("CREATE DATABASE {name} OWNER {ROLE}"));
        Database {
            bin: self.install.bin.clone(),
            port: self.port,
            name,
            password: self.password.clone(),
        }
    }

    /// Stops the server with a fast shutdown (open connections are aborted, as in a database
    /// failover) and waits until the postmaster has exited, so nothing accepts connections.
    /// A no-op when it is stopped already.
    pub fn stop(&self) {
        let mut server = self.server.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(child) = server.take()
            && let Err(message) = shut_down(child, libc::SIGINT, DEADLINE)
        {
            panic!("{message}; postgres.log:\n{}", self.log());
        }
    }

    /// Starts the server again on the same port and data directory and waits until it accepts
    /// connections. A no-op when it runs.
    pub fn resume(&self) {
        let mut server = self.server.lock().unwrap_or_else(|e| e.into_inner());
        if server.is_none() {
            match self.spawn_server() {
                Ok(child) => *server = Some(child),
                Err(message) => panic!("restarting PostgreSQL on port {}: {message}", self.port),
            }
        }
    }

    /// The TCP port on 127.0.0.1 (the same across [`stop`](Postgres::stop) and
    /// [`resume`](Postgres::resume)).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's log, for a failing test's message.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.root.join("postgres.log")).unwrap_or_default()
    }

    /// Creates the cluster (initdb), starts it on a free port and creates `proxy_operator`.
    /// Panics with the failing command's stderr; the server is then shut down and its dir
    /// removed by the drop of the half-made value.
    fn launch(install: Install) -> Postgres {
        remove_stale_roots();
        let root = tempfile::Builder::new()
            .prefix(&format!("{ROOT_PREFIX}{}-", std::process::id()))
            .tempdir()
            .expect("create a temp dir for PostgreSQL")
            .keep();
        let mut postgres = Postgres {
            install,
            root,
            port: 0,
            password: Alphanumeric.sample_string(&mut rand::rng(), 32),
            server: Mutex::new(None),
        };
        postgres.init();
        let mut last_failure = String::new();
        // A port found free can be taken before the postmaster binds it: retry on another.
        for _ in 0..3 {
            postgres.port = free_port();
            match postgres.spawn_server() {
                Ok(child) => {
                    *postgres.server.get_mut().unwrap_or_else(|e| e.into_inner()) = Some(child);
                    postgres.admin(&format!(
                        "CREATE ROLE {ROLE} LOGIN CREATEDB PASSWORD '{}'",
                        postgres.password
                    ));
                    return postgres;
                }
                Err(message) if message.contains("Address already in use") => {
                    last_failure = message;
                }
                Err(message) => panic!("starting PostgreSQL: {message}"),
            }
        }
        panic!("PostgreSQL found no free port: {last_failure}");
    }

    /// initdb, then the settings and client authentication the tests rely on.
    fn init(&self) {
        if let Some((uid, gid)) = self.install.user {
            std::os::unix::fs::chown(&self.root, Some(uid), Some(gid)).unwrap_or_else(|e| {
                panic!("give {} to the postgres user: {e}", self.root.display())
            });
        }
        let data = self.root.join("data");
        // No sync at the end: a crash loses only a test's cluster, and it saves seconds.
        run(self
            .command("initdb")
            .arg("--pgdata")
            .arg(&data)
            .args(["--username", SUPERUSER, "--auth=trust", "--encoding=UTF8"])
            .args(["--locale=C", "--no-sync", "--no-instructions"]));
        let config = format!(
            "\n# The tests' server: TCP on loopback only, its socket in its own temp dir.\n\
             listen_addresses = '127.0.0.1'\n\
             unix_socket_directories = '{}'\n\
             # Several operator processes, each with a pool of 16, share one server.\n\
             max_connections = 200\n\
             password_encryption = 'scram-sha-256'\n",
            self.root.display()
        );
        let mut conf = OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.conf"))
            .expect("open postgresql.conf");
        std::io::Write::write_all(&mut conf, config.as_bytes()).expect("write postgresql.conf");
        std::fs::write(
            data.join("pg_hba.conf"),
            format!(
                "# The support's own administration, through a socket only the server's user \
                 can reach.\n\
                 local all {SUPERUSER} trust\n\
                 # Everyone else over TCP, with a password: authentication is really on.\n\
                 host all all 127.0.0.1/32 scram-sha-256\n"
            ),
        )
        .expect("write pg_hba.conf");
    }

    /// Spawns the postmaster on `self.port` and waits until it accepts connections; on failure
    /// it is killed and the error carries what it logged.
    fn spawn_server(&self) -> Result<Child, String> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.root.join("postgres.log"))
            .map_err(|e| format!("open postgres.log: {e}"))?;
        // The log is kept across restarts; an error shows this start's part only.
        let logged_before = log.metadata().map_or(0, |m| m.len() as usize);
        let log_err = log
            .try_clone()
            .map_err(|e| format!("clone postgres.log: {e}"))?;
        let mut command = self.command("postgres");
        command
            .arg("-D")
            .arg(self.root.join("data"))
            .arg("-p")
            .arg(self.port.to_string())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err);
        let mut child = spawn_tied(command).map_err(|e| format!("spawn postgres: {e}"))?;
        let deadline = Instant::now() + DEADLINE;
        loop {
            if self.accepts_connections() {
                return Ok(child);
            }
            let exited = child.try_wait().ok().flatten();
            if exited.is_some() || Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                let what = match exited {
                    Some(status) => format!("postgres exited ({status})"),
                    None => format!("postgres did not accept connections within {DEADLINE:?}"),
                };
                let log = self.log();
                let this_start = log.get(logged_before..).unwrap_or(&log);
                return Err(format!("{what}; postgres.log:\n{this_start}"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether the server accepts connections on its TCP port (`pg_isready`: not while it
    /// starts up or shuts down, unlike a bare TCP connect).
    fn accepts_connections(&self) -> bool {
        Command::new(self.install.bin.join("pg_isready"))
            .args(["-q", "-h", "127.0.0.1", "-t", "5", "-p"])
            .arg(self.port.to_string())
            .env_clear()
            .stdin(Stdio::null())
            .status()
            .is_ok_and(|status| status.success())
    }

    /// Runs `sql` as the superuser, through the socket.
    fn admin(&self, sql: &str) {
        run(self
            .command("psql")
            .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-h"])
            .arg(&self.root)
            .arg("-p")
            .arg(self.port.to_string())
            .args(["-U", SUPERUSER, "-d", "postgres", "-c", sql]));
    }

    /// `program` from the bindir, as the server's user, in the temp dir (the caller's working
    /// directory may be closed to that user), without the caller's `PG*` settings.
    fn command(&self, program: &str) -> Command {
        let mut command = Command::new(self.install.bin.join(program));
        command.current_dir(&self.root).stdin(Stdio::null());
        without_pg_environment(&mut command);
        if let Some((uid, gid)) = self.install.user {
            command.uid(uid).gid(gid).env("HOME", &self.root);
        }
        command
    }

    /// Shuts the server down (immediate: its data is thrown away next) and removes its dir,
    /// without panicking: it runs in drop and at exit.
    fn remove(&self) {
        let child = match self.server.try_lock() {
            Ok(mut server) => server.take(),
            Err(TryLockError::Poisoned(server)) => server.into_inner().take(),
            // Someone is stopping or starting it: the kernel kills it when the process ends.
            Err(TryLockError::WouldBlock) => return,
        };
        if let Some(child) = child
            && let Err(message) = shut_down(child, libc::SIGQUIT, Duration::from_secs(10))
        {
            eprintln!("{message}");
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.remove();
    }
}

/// The `atexit` hook of the shared server (see the module doc).
extern "C" fn shut_down_shared() {
    if let Some(Shared::Running(postgres)) = SHARED.get() {
        postgres.remove();
    }
}

/// The files of a [`Postgres::start_with_tls`] server a client needs: they live in its temp
/// dir, so they are removed with it.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The CA certificate that signed the server's, PEM (for `SSL_CERT_FILE`).
    pub ca: PathBuf,
    /// The same CA certificate's PEM text.
    pub ca_pem: String,
}

impl Postgres {
    /// A server of its own, as [`Postgres::start`] makes, with TLS on: a throw-away CA signs a
    /// certificate for `127.0.0.1` and `localhost`, which the server presents (`server.crt`
    /// and `server.key`, mode 0600 and the server's user's, in its data dir). TCP logins with
    /// TLS (`hostssl`) and without (`hostnossl`) both need the password. `None` or a panic as
    /// for [`Postgres::shared`].
    pub fn start_with_tls() -> Option<(Postgres, TlsFiles)> {
        let postgres = Postgres::start()?;
        let tls = postgres.enable_tls();
        Some((postgres, tls))
    }

    /// Writes the certificates, turns `ssl` on, lets TCP logins in with and without TLS, and
    /// restarts the server (on the same port) so it takes all of it.
    fn enable_tls(&self) -> TlsFiles {
        let (ca_pem, cert_pem, key_pem) = test_certificates();
        let data = self.root.join("data");
        let ca = self.root.join("ca.crt");
        std::fs::write(&ca, &ca_pem).expect("write ca.crt");
        std::fs::write(data.join("server.crt"), cert_pem).expect("write server.crt");
        {
            use std::os::unix::fs::OpenOptionsExt;
            // PostgreSQL refuses a key that others can read.
            let mut key = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(data.join("server.key"))
                .expect("create server.key");
            std::io::Write::write_all(&mut key, key_pem.as_bytes()).expect("write server.key");
        }
        if let Some((uid, gid)) = self.install.user {
            for file in [&ca, &data.join("server.crt"), &data.join("server.key")] {
                std::os::unix::fs::chown(file, Some(uid), Some(gid)).unwrap_or_else(|e| {
                    panic!("give {} to the postgres user: {e}", file.display())
                });
            }
        }
        let mut conf = OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.conf"))
            .expect("open postgresql.conf");
        std::io::Write::write_all(
            &mut conf,
            b"\n# TLS, with a certificate of the tests' CA (paths relative to the data dir).\n\
              ssl = on\n\
              ssl_cert_file = 'server.crt'\n\
              ssl_key_file = 'server.key'\n",
        )
        .expect("write postgresql.conf");
        std::fs::write(
            data.join("pg_hba.conf"),
            format!(
                "# The support's own administration, through a socket only the server's user \
                 can reach.\n\
                 local all {SUPERUSER} trust\n\
                 # Everyone else over TCP, with a password, with TLS or without.\n\
                 hostssl all all 127.0.0.1/32 scram-sha-256\n\
                 hostnossl all all 127.0.0.1/32 scram-sha-256\n"
            ),
        )
        .expect("write pg_hba.conf");
        self.stop();
        self.resume();
        let ssl = run(self
            .command("psql")
            .args(["-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-h"])
            .arg(&self.root)
            .arg("-p")
            .arg(self.port.to_string())
            .args(["-U", SUPERUSER, "-d", "postgres", "-c", "SHOW ssl"]));
        let ssl = String::from_utf8_lossy(&ssl.stdout).trim().to_owned();
        assert_eq!(
            ssl,
            "on",
            "ssl after the restart; postgres.log:\n{}",
            self.log()
        );
        TlsFiles { ca, ca_pem }
    }
}

/// A new CA's certificate, and a server certificate for `127.0.0.1` and `localhost` it signed
/// with its key, all PEM: `(ca, certificate, key)`.
fn test_certificates() -> (String, String, String) {
    let ca_key = KeyPair::generate().expect("generate the CA key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "proxy-operator test PostgreSQL CA");
    let ca = CertifiedIssuer::self_signed(ca_params, ca_key).expect("self-sign the CA");
    let key = KeyPair::generate().expect("generate the server key");
    let mut params = CertificateParams::new(vec!["127.0.0.1".into(), "localhost".into()])
        .expect("server params");
    params
        .distinguished_name
        .push(DnType::CommonName, "localhost");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let certificate = params
        .signed_by(&key, &ca)
        .expect("sign the server certificate");
    (ca.pem(), certificate.pem(), key.serialize_pem())
}

/// A database on a [`Postgres`] server, with what a client needs to reach it.
#[derive(Debug, Clone)]
pub struct Database {
    bin: PathBuf,
    port: u16,
    name: String,
    password: String,
}

impl Database {
    /// `postgres://proxy_operator:<password>@127.0.0.1:<port>/<name>`, the URL a user would
    /// pass to `--ledger` (the password is alphanumeric: nothing to percent-encode).
    pub fn url(&self) -> String {
        format!(
            "postgres://{ROLE}:{}@127.0.0.1:{}/{}",
            self.password, self.port, self.name
        )
    }

    /// The same URL without the password, for tests of `--ledger-password-file` and
    /// `PGPASSWORD`.
    pub fn url_without_password(&self) -> String {
        format!("postgres://{ROLE}@127.0.0.1:{}/{}", self.port, self.name)
    }

    pub fn password(&self) -> &str {
        &self.password
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The same database reached with another password, for tests that it is refused.
    pub fn with_password(&self, password: &str) -> Database {
        Database {
            password: password.to_owned(),
            ..self.clone()
        }
    }

    /// Runs `sql` with psql against this database, as an engineer would (`psql -X -A -t -v
    /// ON_ERROR_STOP=1 -c`, over TCP with `PGPASSWORD`), and returns its trimmed output;
    /// panics with psql's stderr when it fails.
    pub fn psql(&self, sql: &str) -> String {
        self.try_psql(sql)
            .unwrap_or_else(|stderr| panic!("psql -c {sql:?} on {}: {stderr}", self.name))
    }

    /// [`Database::psql`] that returns psql's stderr when it fails, for tests of a refused
    /// connection. `--no-password`: a missing password fails instead of prompting; psql's own
    /// messages are in English (`LC_MESSAGES=C`), so tests can match them.
    pub fn try_psql(&self, sql: &str) -> Result<String, String> {
        let mut command = Command::new(self.bin.join("psql"));
        without_pg_environment(&mut command);
        let output = command
            .args(["-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "--no-password"])
            .args(["-d", &self.url_without_password(), "-c", sql])
            .env("PGPASSWORD", &self.password)
            .env("PGCONNECT_TIMEOUT", "10")
            .env_remove("LC_ALL")
            .env("LC_MESSAGES", "C")
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("run {}: {e}", self.bin.join("psql").display()));
        if output.status.success() {
            Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
        } else {
            Err(format!(
                "{}: {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ))
        }
    }
}

/// Where PostgreSQL is, or `None`, skipped (see [`skip`]) for want of it.
fn installed() -> Option<Install> {
    match find_install() {
        Ok(install) => Some(install),
        Err(message) => {
            skip(message);
            None
        }
    }
}

fn find_install() -> Result<Install, String> {
    // Debian keeps the server programs off PATH, in a versioned bindir.
    let from_pg_config = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|output| output.status.success())
        .map(|output| PathBuf::from(String::from_utf8_lossy(&output.stdout).trim()));
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse().ok()?;
            Some((version, entry.path().join("bin")))
        })
        .collect();
    versions.sort();
    let bin = from_pg_config
        .into_iter()
        .chain(versions.into_iter().rev().map(|(_, bin)| bin))
        .find(|bin| PROGRAMS.iter().all(|program| bin.join(program).is_file()))
        .ok_or_else(|| {
            format!(
                "PostgreSQL's {} are not under `pg_config --bindir` or \
                 /usr/lib/postgresql/<version>/bin ({HOW_TO_INSTALL})",
                PROGRAMS.join(", ")
            )
        })?;
    // SAFETY: geteuid has no preconditions.
    let user = if unsafe { libc::geteuid() } == 0 {
        Some(postgres_user().ok_or_else(|| {
            format!(
                "PostgreSQL refuses to run as root, and there is no `postgres` user to run it \
                 as ({HOW_TO_INSTALL} creates it)"
            )
        })?)
    } else {
        None
    };
    Ok(Install { bin, user })
}

/// The uid and gid of the `postgres` system user.
fn postgres_user() -> Option<(u32, u32)> {
    // SAFETY: getpwnam's result is read at once, before any other passwd lookup here.
    unsafe {
        let entry = libc::getpwnam(c"postgres".as_ptr());
        if entry.is_null() {
            return None;
        }
        Some(((*entry).pw_uid, (*entry).pw_gid))
    }
}

/// Drops the caller's `PG*` variables (`PGHOST`, `PGSSLMODE`, `PGSERVICE`, …), which would
/// send a connection elsewhere or change how it is made.
fn without_pg_environment(command: &mut Command) {
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("PG") {
            command.env_remove(name);
        }
    }
}

/// Runs `command`, panicking with its stderr when it fails.
fn run(command: &mut Command) -> Output {
    let what = format!("{command:?}");
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("run {what}: {e}"));
    assert!(
        output.status.success(),
        "{what}: {}: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr).trim()
    );
    output
}

/// Sends `signal` to the postmaster and reaps it: SIGINT is a fast shutdown (a checkpoint,
/// connections aborted), SIGQUIT an immediate one; both free its shared memory. SIGKILLs it
/// when it has not exited within `within`.
fn shut_down(mut child: Child, signal: libc::c_int, within: Duration) -> Result<(), String> {
    let Ok(pid) = libc::pid_t::try_from(child.id()) else {
        let _ = child.kill();
        let _ = child.wait();
        return Ok(());
    };
    // SAFETY: `pid` is our unreaped child, so it cannot name another process.
    unsafe { libc::kill(pid, signal) };
    let deadline = Instant::now() + within;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => return Ok(()),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "postgres (pid {pid}) did not shut down within {within:?} of signal \
                     {signal}; killed"
                ));
            }
        }
    }
}

/// Removes the roots left by test processes that were killed (no destructor or `atexit` hook
/// ran), with the shared memory segment their killed postmaster left behind.
fn remove_stale_roots() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(ROOT_PREFIX)
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if alive(pid) {
            continue;
        }
        let root = entry.path();
        let pid_file =
            std::fs::read_to_string(root.join("data/postmaster.pid")).unwrap_or_default();
        let lines: Vec<&str> = pid_file.lines().collect();
        // A postmaster that outlived its test process still uses its directory.
        if let Some(postmaster) = lines.first().and_then(|pid| pid.trim().parse().ok())
            && alive(postmaster)
        {
            continue;
        }
        // Line 7: the segment's key and id.
        if let Some(segment) = lines.get(6) {
            remove_segment(segment);
        }
        let _ = std::fs::remove_dir_all(&root);
    }
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Removes the System V segment `key id` (from a `postmaster.pid`) when it still has that key
/// and nothing attached: then it is the dead postmaster's, not a running server's.
fn remove_segment(key_and_id: &str) {
    let mut fields = key_and_id.split_whitespace();
    let (Some(Ok(key)), Some(Ok(id))) = (
        fields.next().map(str::parse::<libc::key_t>),
        fields.next().map(str::parse::<libc::c_int>),
    ) else {
        return;
    };
    // SAFETY: shmid_ds is plain data, and IPC_STAT only fills it in.
    unsafe {
        let mut segment: libc::shmid_ds = std::mem::zeroed();
        if libc::shmctl(id, libc::IPC_STAT, &mut segment) == 0
            && segment.shm_perm.__key == key
            && segment.shm_nattch == 0
        {
            libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut());
        }
    }
}

/// The message of a caught panic.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "(a panic without a message)".to_owned())
}
