//! The command line of the `proxy-operator` binary. Every flag has an environment twin and
//! shows its default in `--help`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::controllers::proxy::{ReconcilerConfig, Share};
use crate::gateway::{BanRule, GatewayConfig};
use crate::ledger::{Durability, LedgerLocation, MIN_MAX_SIZE};

/// Kubernetes operator for a fleet of HTTP egress proxies: health-checks them through the
/// proxy and leases them to crawlers.
#[derive(Parser, Debug)]
#[command(name = "proxy-operator", version, about)]
pub struct Cli {
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
// Parsed once at start-up: the size of the larger variant costs nothing worth a Box.
#[allow(clippy::large_enum_variant)]
pub enum Command {
    /// Run without Kubernetes: External proxies from an inventory file, with the health
    /// engine, the lease ledger, the API and metrics. The bearer token comes from
    /// `DISCOVERY_TOKEN` and/or `--discovery-token-file`; without one it refuses to start
    /// (unless `--insecure-no-auth`).
    Standalone(StandaloneArgs),
    /// Run the operator against a Kubernetes cluster (in-cluster config or kubeconfig).
    Run(RunArgs),
    /// Print the CustomResourceDefinitions as YAML: Proxy then ProxyPool, as two documents
    /// (what `crd/proxy.yaml` and `crd/proxypool.yaml` hold), or only the one named.
    Crd(CrdArgs),
    /// Work with lists of proxies.
    #[command(subcommand)]
    Proxies(ProxiesCommand),
}

/// The subcommands of `proxies`.
#[derive(Subcommand, Debug)]
pub enum ProxiesCommand {
    /// Print a vendor's proxy list as External `Proxy` objects and credentials Secrets (YAML
    /// documents for `kubectl apply -f -` or a standalone inventory). One proxy a line:
    /// `host:port`, `host:port:user:pass`, or `scheme://[user:pass@]host:port` with scheme
    /// `http`, `socks5` or `socks5h` (user and password percent-decoded, an IPv6 host in
    /// brackets); blank lines and `#` comments are skipped. A bad or repeated line refuses the
    /// whole list, naming the line, and prints nothing.
    Import(ImportArgs),
}

/// Flags of `proxies import`.
#[derive(Args, Debug, Clone)]
pub struct ImportArgs {
    /// The list, or `-` for stdin.
    #[arg(value_name = "FILE")]
    pub file: String,

    /// Namespace of the Proxies and Secrets.
    #[arg(long, env = "PROXY_OPERATOR_IMPORT_NAMESPACE", default_value = crate::resources::proxy::DEFAULT_NAMESPACE, value_parser = crate::inventory::import::namespace)]
    pub namespace: String,

    /// Start of every name, followed by a hash of the proxy's host:port (so a proxy keeps its
    /// name when the list is reordered); its Secret adds `-credentials`. Default: the file's
    /// name without extension, or `proxy`.
    #[arg(long, env = "PROXY_OPERATOR_IMPORT_NAME_PREFIX", value_parser = crate::inventory::import::name_prefix)]
    pub name_prefix: Option<String>,

    /// A label `key=value` of every Proxy and Secret (what crawlers select on, and what
    /// `kubectl delete -l` finds the import by); repeatable.
    #[arg(long = "label", env = "PROXY_OPERATOR_IMPORT_LABELS", value_name = "KEY=VALUE", value_delimiter = ',', value_parser = crate::inventory::import::label)]
    pub labels: Vec<(String, String)>,

    /// `spec.maxLeases` of every Proxy (0: listed and probed, never leased). Unset: the
    /// Proxy's default.
    #[arg(long, env = "PROXY_OPERATOR_IMPORT_MAX_LEASES", value_parser = clap::value_parser!(i32).range(0..))]
    pub max_leases: Option<i32>,
}

impl ImportArgs {
    /// What every imported object gets.
    pub fn options(&self) -> crate::inventory::import::ImportOptions {
        crate::inventory::import::ImportOptions {
            namespace: self.namespace.clone(),
            name_prefix: self
                .name_prefix
                .clone()
                .unwrap_or_else(|| crate::inventory::import::default_prefix(&self.file)),
            labels: self.labels.iter().cloned().collect(),
            max_leases: self.max_leases,
        }
    }
}

/// Flags of `crd`.
#[derive(Args, Debug, Clone)]
pub struct CrdArgs {
    /// Print only this resource's CRD.
    #[arg(value_enum)]
    pub kind: Option<crate::resources::crd::Kind>,
}

/// Flags shared by `standalone` and `run`.
#[derive(Args, Debug, Clone)]
pub struct CommonArgs {
    /// Address of the discovery and lease API.
    #[arg(
        long,
        env = "PROXY_OPERATOR_DISCOVERY_ADDR",
        default_value = "0.0.0.0:8090"
    )]
    pub discovery_addr: SocketAddr,

    /// Address of the Prometheus metrics endpoint (`/metrics`).
    #[arg(
        long,
        env = "PROXY_OPERATOR_METRICS_ADDR",
        default_value = "0.0.0.0:8080"
    )]
    pub metrics_addr: SocketAddr,

    /// The lease ledger: an SQLite file (created if missing), or a PostgreSQL database as a
    /// `postgres://user@host:5432/db?sslmode=require` URL, which several replicas can share
    /// (what the URL leaves out comes from `PGHOST`, `PGPORT`, `PGUSER`, `PGDATABASE`,
    /// `PGPASSWORD`, `PGSSLMODE`).
    #[arg(
        long,
        env = "PROXY_OPERATOR_LEDGER",
        default_value = "./proxy-operator.db",
        value_name = "PATH|URL",
        value_parser = LedgerLocation::parse
    )]
    pub ledger: LedgerLocation,

    /// A file holding the PostgreSQL ledger's password (a trailing newline is ignored); wins
    /// over a password in the URL and `PGPASSWORD`.
    #[arg(long, env = "PROXY_OPERATOR_LEDGER_PASSWORD_FILE", value_name = "PATH")]
    pub ledger_password_file: Option<PathBuf>,

    /// Connections of the PostgreSQL ledger's pool, per replica.
    #[arg(long, env = "PROXY_OPERATOR_LEDGER_POOL_SIZE", default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=1000))]
    pub ledger_pool_size: u16,

    /// What an acknowledged lease survives: `normal` (process crash, kill -9) or `full`
    /// (also power loss; one fsync per write).
    #[arg(long, env = "PROXY_OPERATOR_LEDGER_DURABILITY", value_enum, default_value_t = DurabilityArg::Normal)]
    pub ledger_durability: DurabilityArg,

    /// Ledger writes (acquire, renew, release, report) waiting for the ledger's writer at
    /// most; a write arriving at a full queue is answered 503 with `Retry-After` at once. The
    /// queue is allocated up front, hence the upper bound of 100000.
    #[arg(long, env = "PROXY_OPERATOR_LEDGER_QUEUE_CAPACITY", default_value_t = DEFAULT_LEDGER_QUEUE_CAPACITY, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub ledger_queue_capacity: u32,

    /// How long a ledger write may wait in the queue; one still waiting then is answered
    /// 503 with `Retry-After` and nothing is written. A write the writer has taken is always
    /// answered with its result.
    #[arg(long, env = "PROXY_OPERATOR_LEDGER_QUEUE_DEADLINE", default_value = "2s", value_parser = positive_duration)]
    pub ledger_queue_deadline: Duration,

    /// Probes in flight at once.
    #[arg(long, env = "PROXY_OPERATOR_HEALTH_WORKERS", default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..))]
    pub health_workers: u16,

    /// How long a proxy is skipped for a target after a `rate_limited`/`blocked` report (and
    /// how long finished leases are kept so late reports land).
    #[arg(long, env = "PROXY_OPERATOR_LEASE_COOLDOWN", default_value = "10m", value_parser = humantime::parse_duration)]
    pub lease_cooldown: Duration,

    /// Longest cooldown one report may ask for: a report's `retryAfterSeconds` (or a target's
    /// `Retry-After` seen by the gateway) is cut to it. Reports that ask for none cool down
    /// for `--lease-cooldown`.
    #[arg(long, env = "PROXY_OPERATOR_MAX_LEASE_COOLDOWN", default_value = "1h", value_parser = positive_duration)]
    pub max_lease_cooldown: Duration,

    /// Most leases at once for one target across the whole fleet (acquires naming a target,
    /// from the API and the gateway); one more is answered 409 (503 by the gateway) with
    /// reason `target_limit`. Unset: no limit.
    #[arg(long, env = "PROXY_OPERATOR_MAX_LEASES_PER_TARGET", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_leases_per_target: Option<u32>,

    /// Most leases at once for one target on one proxy, below the proxy's `maxLeases` (how
    /// many crawlers hit one site through one exit address). Unset: only `maxLeases`.
    #[arg(long, env = "PROXY_OPERATOR_MAX_LEASES_PER_PROXY_TARGET", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_leases_per_proxy_target: Option<u32>,

    /// Longest lease TTL granted; longer requests are cut to it.
    #[arg(long, env = "PROXY_OPERATOR_MAX_LEASE_TTL", default_value = "1h", value_parser = humantime::parse_duration)]
    pub max_lease_ttl: Duration,

    /// TTL of a lease whose request names none (above zero).
    #[arg(long, env = "PROXY_OPERATOR_DEFAULT_LEASE_TTL", default_value = "5m", value_parser = positive_duration)]
    pub default_lease_ttl: Duration,

    /// PEM file of extra CA certificates trusted for `https://` probe URLs (on top of the
    /// system roots), for probe targets behind a private CA.
    #[arg(long, env = "PROXY_OPERATOR_PROBE_CA_FILE")]
    pub probe_ca_file: Option<PathBuf>,

    /// A MaxMind-format database file (`.mmdb`: GeoLite2-Country, -City or -ASN, or DB-IP's
    /// free equivalents) that gives exit addresses their country and network; repeat it for
    /// one file of each kind. Read whole at start: a file that cannot be read stops the
    /// process.
    #[arg(
        long,
        env = "PROXY_OPERATOR_GEOIP_DATABASE",
        value_name = "PATH",
        value_delimiter = ','
    )]
    pub geoip_database: Vec<PathBuf>,

    /// File of API bearer tokens, one a line (blank lines and surrounding whitespace
    /// ignored; each at least 16 bytes of printable ASCII), e.g. a mounted Secret. Re-read
    /// when its content changes, so tokens rotate without a restart: list the new token next
    /// to the old one, move clients over, then remove the old one. A token in
    /// `DISCOVERY_TOKEN` is valid as well when both are given. A change that leaves no valid
    /// token keeps the previous tokens (and logs an error).
    #[arg(long, env = "PROXY_OPERATOR_DISCOVERY_TOKEN_FILE")]
    pub discovery_token_file: Option<PathBuf>,

    /// How often `--discovery-token-file` and `--tenants-file` are checked for changes.
    #[arg(long, env = "PROXY_OPERATOR_DISCOVERY_TOKEN_POLL", default_value = "5s", value_parser = positive_duration)]
    pub discovery_token_poll: Duration,

    /// YAML file of tenants (e.g. a mounted Secret): each one's name, the SHA-256 digests of
    /// its tokens (`sha256:<hex>`), its scope (namespaces and/or labels its proxies must
    /// carry) and its quotas (leases, sessions, acquires per second). Each tenant sees and
    /// leases only its scope's proxies, within its quotas. The tokens of `DISCOVERY_TOKEN`
    /// and `--discovery-token-file` stay valid as the unrestricted tenant `default`. Re-read
    /// when its content changes; a bad file stops start-up, and a bad change is logged and
    /// the last good tenants stay in force.
    #[arg(long, env = "PROXY_OPERATOR_TENANTS_FILE", value_name = "PATH")]
    pub tenants_file: Option<PathBuf>,

    /// Serve the lease API without authentication, to anyone who can reach
    /// `--discovery-addr`. Without this flag, start-up refuses a missing, empty, non-UTF-8 or
    /// shorter-than-16-byte token; with it, giving a token as well is refused.
    #[arg(long, env = "PROXY_OPERATOR_INSECURE_NO_AUTH")]
    pub insecure_no_auth: bool,

    /// How long lease history is kept in the ledger.
    #[arg(long, env = "PROXY_OPERATOR_HISTORY_RETENTION", default_value = "7days", value_parser = humantime::parse_duration)]
    pub history_retention: Duration,

    /// Most bytes the ledger's file and write-ahead log take together (`512MiB`, `2GiB`,
    /// `1.5GB`; `Mi`/`MiB` are powers of 1024, `M`/`MB` of 1000; at least 1MiB). The oldest
    /// history is pruned to stay within it, before `--history-retention` would; a write that
    /// still finds no room is answered 503 `ledger_full`. Keep it well below the volume's
    /// size (the manifests ship half of the 1Gi volume).
    #[arg(long, env = "PROXY_OPERATOR_LEDGER_MAX_SIZE", value_name = "SIZE", default_value = DEFAULT_LEDGER_MAX_SIZE, value_parser = ledger_size)]
    pub ledger_max_size: u64,

    /// Include the upstream proxy's credentials (`username`, `password`) in lease answers, so
    /// crawlers using the lease API can authenticate to it. Off by default: crawlers that go
    /// through the gateway never need them, and every token holder could read them.
    #[arg(long, env = "PROXY_OPERATOR_LEASE_CREDENTIALS")]
    pub lease_credentials: bool,

    /// The currency of every Proxy's `spec.cost` (one for the fleet): three capital letters
    /// (ISO 4217), shown beside every amount on the status page and as the `currency` label
    /// of the spend metrics.
    #[arg(long, env = "PROXY_OPERATOR_COST_CURRENCY", default_value = crate::resources::cost::DEFAULT_CURRENCY, value_parser = crate::resources::cost::currency)]
    pub cost_currency: String,

    /// The crawler gateway.
    #[command(flatten)]
    pub gateway: GatewayArgs,
}

/// Flags of the crawler gateway.
#[derive(Args, Debug, Clone)]
pub struct GatewayArgs {
    /// Address of the crawler gateway, the forward proxy crawlers point at
    /// (`http://crawler:TOKEN@host:8888`); `off` to serve none.
    #[arg(long, env = "PROXY_OPERATOR_GATEWAY_ADDR", default_value = "0.0.0.0:8888", value_parser = gateway_addr)]
    pub gateway_addr: Listen,

    /// Target ports the gateway relays to (CONNECT and plain HTTP alike), comma-separated; any
    /// other is refused 403, so a token holder cannot reach anything else through it.
    #[arg(long, env = "PROXY_OPERATOR_GATEWAY_ALLOWED_PORTS", default_value = "80,443", value_delimiter = ',', value_parser = clap::value_parser!(u16).range(1..), required = false)]
    pub gateway_allowed_ports: Vec<u16>,

    /// Destinations opened to crawlers (comma-separated CIDR ranges or addresses, e.g.
    /// `10.20.0.0/16,127.0.0.1`): by default the gateway refuses, and the squids the operator
    /// generates (`run`) refuse too, every destination that is not a public address:
    /// loopback, link-local (the cloud metadata server), RFC 1918, carrier-grade NAT,
    /// unique-local, unspecified, broadcast, multicast and reserved ranges, in every spelling.
    /// A name is judged by every address it resolves to.
    #[arg(long, env = "PROXY_OPERATOR_GATEWAY_ALLOWED_DESTINATIONS", value_name = "RANGES", default_value = "", value_parser = crate::egress::AllowedRanges::parse)]
    pub gateway_allowed_destinations: crate::egress::AllowedRanges,

    /// Pass a target name the gateway cannot resolve to the upstream proxy, which resolves it
    /// itself (names only the upstreams' DNS knows), instead of refusing it. The upstream's
    /// own destination rules are then the only check: the squids the operator generates have
    /// them; an External proxy may not.
    #[arg(long, env = "PROXY_OPERATOR_GATEWAY_PASS_UNRESOLVED")]
    pub gateway_pass_unresolved: bool,

    /// Keep the gateway's bytes out of the ledger's hourly traffic rows (the metrics still
    /// count them): for measuring what the accounting costs. Refused with a tenants file that
    /// sets a `bytesPerDay` quota, which the rows decide.
    #[arg(long, env = "PROXY_OPERATOR_GATEWAY_NO_TRAFFIC_LEDGER")]
    pub gateway_no_traffic_ledger: bool,

    /// Other proxies a gateway request is tried on after an upstream failed (refused, timed
    /// out, answered the CONNECT with an error) before anything reached the crawler; then 502.
    #[arg(long, env = "PROXY_OPERATOR_GATEWAY_RETRIES", default_value_t = 2, value_parser = clap::value_parser!(u32).range(0..=10))]
    pub gateway_retries: u32,

    /// Longest wait for an upstream proxy: connecting, its answer to a CONNECT, and the
    /// response head of a plain request.
    #[arg(long, env = "PROXY_OPERATOR_GATEWAY_UPSTREAM_TIMEOUT", default_value = "10s", value_parser = positive_duration)]
    pub gateway_upstream_timeout: Duration,

    /// Target statuses on plain HTTP reported as bans for the (proxy, target), as
    /// `status=result` pairs (results `rate_limited`, `blocked`, `error`); empty for none.
    #[arg(long, env = "PROXY_OPERATOR_GATEWAY_BAN_STATUSES", default_value = "429=rate_limited,403=blocked", value_parser = BanRule::parse)]
    pub gateway_ban_statuses: BanRule,

    /// Idle lifetime of a sticky session whose proxy URL names no `sessionTTL`.
    #[arg(long, env = "PROXY_OPERATOR_GATEWAY_SESSION_TTL", default_value = "5m", value_parser = session_ttl)]
    pub gateway_session_ttl: Duration,

    /// The CA certificate (PEM) the gateway intercepts HTTPS with, for requests that ask
    /// (`tls=inspect` in the proxy URL's user part) from tenants allowed to: clients must trust
    /// it. Unset: no interception, every CONNECT a byte tunnel. With --gateway-ca-key.
    #[arg(
        long,
        env = "PROXY_OPERATOR_GATEWAY_CA_CERT",
        value_name = "PATH",
        requires = "gateway_ca_key"
    )]
    pub gateway_ca_cert: Option<PathBuf>,

    /// The CA's private key (PEM), readable by this process only (mode 0400 or 0600; 0440
    /// when its group is this process's, as a Secret mounted for the Pod's fsGroup is).
    #[arg(
        long,
        env = "PROXY_OPERATOR_GATEWAY_CA_KEY",
        value_name = "PATH",
        requires = "gateway_ca_cert"
    )]
    pub gateway_ca_key: Option<PathBuf>,

    /// PEM file of extra CA certificates the gateway trusts for intercepted targets, on top of
    /// the system's roots (targets behind a private CA). A target that does not verify is
    /// answered 502, never relayed.
    #[arg(
        long,
        env = "PROXY_OPERATOR_GATEWAY_TARGET_CA_FILE",
        value_name = "PATH"
    )]
    pub gateway_target_ca_file: Option<PathBuf>,

    /// Hosts never intercepted, even when asked (apps that pin certificates): comma-separated
    /// host names, `*.example.com` (any subdomain) or `*`. Their CONNECTs stay byte tunnels.
    #[arg(
        long,
        env = "PROXY_OPERATOR_GATEWAY_INTERCEPT_EXCLUDE",
        value_name = "HOSTS",
        value_delimiter = ',',
        required = false,
        value_parser = crate::gateway::rules::HostPattern::parse
    )]
    pub gateway_intercept_exclude: Vec<crate::gateway::rules::HostPattern>,

    /// YAML file of per-target rules: what in a target's answer is a ban (statuses, a header,
    /// a pattern in the body's first KiB) and whether to retry on another exit. Re-read when
    /// it changes (every --discovery-token-poll); a bad edit keeps the last good rules. Hosts no
    /// rule names get --gateway-ban-statuses.
    #[arg(long, env = "PROXY_OPERATOR_GATEWAY_RULES_FILE", value_name = "PATH")]
    pub gateway_rules_file: Option<PathBuf>,

    /// Longest a client may take to send a request head, from its first byte (and a new
    /// connection's first head, from the accept); the connection is then closed.
    #[arg(long, env = "PROXY_OPERATOR_GATEWAY_HEADER_TIMEOUT", default_value = "10s", value_parser = positive_duration)]
    pub gateway_header_timeout: Duration,

    /// Longest a kept-alive client connection may stay without a request before it is closed
    /// (tunnels are not affected: a tunnel ends when either side closes it).
    #[arg(long, env = "PROXY_OPERATOR_GATEWAY_IDLE_TIMEOUT", default_value = "60s", value_parser = positive_duration)]
    pub gateway_idle_timeout: Duration,

    /// Most client connections (and tunnels) open at once; one more is answered 503
    /// `too_many_connections` and closed.
    #[arg(long, env = "PROXY_OPERATOR_GATEWAY_MAX_CONNECTIONS", default_value_t = 8192, value_parser = clap::value_parser!(u32).range(1..))]
    pub gateway_max_connections: u32,

    /// Most client connections open at once for one tenant of the tenants file (the default
    /// tenant's tokens have only --gateway-max-connections); one more is answered 503
    /// `too_many_connections` and closed.
    #[arg(long, env = "PROXY_OPERATOR_GATEWAY_MAX_TENANT_CONNECTIONS", default_value_t = 2048, value_parser = clap::value_parser!(u32).range(1..))]
    pub gateway_max_tenant_connections: u32,

    /// Most leases one client connection without a session holds, one per target it names;
    /// for another target, the least recently used one is given back first.
    #[arg(long, env = "PROXY_OPERATOR_GATEWAY_CONNECTION_LEASES", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub gateway_connection_leases: u32,

    /// Most requests held at once while their ProxyPools wake; one more is refused at once
    /// as if no pool were waking (503 with `Retry-After`).
    #[arg(long, env = "PROXY_OPERATOR_GATEWAY_MAX_HELD_REQUESTS", default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    pub gateway_max_held_requests: u32,

    /// Threads serving the gateway's client connections, each with every connection it
    /// accepted; `0` is one per CPU the process may use.
    #[arg(long, env = "PROXY_OPERATOR_GATEWAY_THREADS", default_value_t = 0, value_parser = clap::value_parser!(u16))]
    pub gateway_threads: u16,
}

/// Where a server listens, or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listen {
    /// On this address.
    On(SocketAddr),
    /// Not at all.
    Off,
}

fn gateway_addr(text: &str) -> Result<Listen, String> {
    if text.eq_ignore_ascii_case("off") {
        return Ok(Listen::Off);
    }
    text.parse()
        .map(Listen::On)
        .map_err(|_| format!("{text:?} is neither host:port nor `off`"))
}

fn session_ttl(text: &str) -> Result<Duration, String> {
    use crate::gateway::user::{MAX_SESSION_TTL, MIN_SESSION_TTL};
    let ttl = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if !(MIN_SESSION_TTL..=MAX_SESSION_TTL).contains(&ttl) {
        return Err("must be at least 1s and at most 24h".to_owned());
    }
    Ok(ttl)
}

impl CommonArgs {
    /// Where the gateway listens (if at all) and how it behaves; the leases it takes for a
    /// connection (without a session) last `--default-lease-ttl`, renewed while in use.
    pub fn gateway_config(&self) -> Option<(SocketAddr, GatewayConfig)> {
        let gateway = &self.gateway;
        let Listen::On(addr) = gateway.gateway_addr else {
            return None;
        };
        Some((
            addr,
            GatewayConfig {
                allowed_ports: gateway.gateway_allowed_ports.clone(),
                retries: gateway.gateway_retries,
                upstream_timeout: gateway.gateway_upstream_timeout,
                ban_rule: gateway.gateway_ban_statuses.clone(),
                session_ttl: gateway.gateway_session_ttl,
                connection_lease_ttl: self.default_lease_ttl,
                allowed_destinations: gateway.gateway_allowed_destinations.0.clone(),
                pass_unresolved: gateway.gateway_pass_unresolved,
                traffic_ledger: !gateway.gateway_no_traffic_ledger,
                timeouts: crate::gateway::Timeouts {
                    header: gateway.gateway_header_timeout,
                    idle: gateway.gateway_idle_timeout,
                },
                max_connections: gateway.gateway_max_connections as usize,
                max_tenant_connections: gateway.gateway_max_tenant_connections as usize,
                max_connection_leases: gateway.gateway_connection_leases as usize,
                max_held: gateway.gateway_max_held_requests as usize,
                intercept_exclude: gateway.gateway_intercept_exclude.clone(),
                ..GatewayConfig::default()
            },
        ))
    }
}

/// Default of `--ledger-max-size`, as `--help` shows it.
const DEFAULT_LEDGER_MAX_SIZE: &str = "512MiB";

/// A size with a unit (`bytesize` syntax), large enough to hold a ledger.
fn ledger_size(text: &str) -> Result<u64, String> {
    let bytes = text.trim().parse::<bytesize::ByteSize>()?.as_u64();
    if bytes < MIN_MAX_SIZE {
        return Err(format!(
            "{bytes} bytes cannot hold a ledger: it must be at least 1MiB"
        ));
    }
    Ok(bytes)
}

/// Default of `--ledger-queue-capacity`: a few seconds of writes at the rate one writer
/// commits on a small machine, so a burst queues instead of failing, and an overload is
/// answered within the deadline instead of piling up.
pub const DEFAULT_LEDGER_QUEUE_CAPACITY: u32 = 4096;

/// A leader Lease duration: whole seconds (the Lease counts in seconds), at least 2 so that a
/// renewal can come before expiry.
fn lease_duration(text: &str) -> Result<Duration, String> {
    let duration = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if duration.subsec_nanos() != 0 || duration < Duration::from_secs(2) {
        return Err("must be whole seconds, at least 2s".to_owned());
    }
    Ok(duration)
}

/// A duration above zero (`humantime` syntax).
fn positive_duration(text: &str) -> Result<Duration, String> {
    match humantime::parse_duration(text) {
        Ok(d) if d.is_zero() => Err("must be above zero".to_owned()),
        Ok(d) => Ok(d),
        Err(e) => Err(e.to_string()),
    }
}

/// `--ledger-durability` values.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DurabilityArg {
    /// Survives a crash of the process.
    Normal,
    /// Also survives a power loss.
    Full,
}

impl From<DurabilityArg> for Durability {
    fn from(value: DurabilityArg) -> Self {
        match value {
            DurabilityArg::Normal => Durability::Normal,
            DurabilityArg::Full => Durability::Full,
        }
    }
}

/// Flags of `standalone`.
#[derive(Args, Debug, Clone)]
pub struct StandaloneArgs {
    /// Multi-document YAML file of External `Proxy` objects (what `kubectl apply -f` takes).
    /// Reloaded when it changes and on SIGHUP.
    #[arg(long, env = "PROXY_OPERATOR_INVENTORY")]
    pub inventory: PathBuf,

    /// How often the inventory file is checked for changes.
    #[arg(long, env = "PROXY_OPERATOR_INVENTORY_POLL", default_value = "2s", value_parser = humantime::parse_duration)]
    pub inventory_poll: Duration,

    /// The flags shared with `run`.
    #[command(flatten)]
    pub common: CommonArgs,
}

/// Flags of `run`.
#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// The providers config (YAML) naming the machine providers Managed proxies use.
    #[arg(long, env = "PROXY_OPERATOR_PROVIDERS_CONFIG")]
    pub providers_config: PathBuf,

    /// Watch Proxies in this namespace only (default: all namespaces).
    #[arg(long, env = "PROXY_OPERATOR_WATCH_NAMESPACE")]
    pub watch_namespace: Option<String>,

    /// How often orphaned machines are looked for.
    #[arg(long, env = "PROXY_OPERATOR_GC_INTERVAL", default_value = "10m", value_parser = humantime::parse_duration)]
    pub gc_interval: Duration,

    /// Machines younger than this are never collected as orphans.
    #[arg(long, env = "PROXY_OPERATOR_GC_MIN_AGE", default_value = "10m", value_parser = humantime::parse_duration)]
    pub gc_min_age: Duration,

    /// Allow orphan GC while watching a single namespace (it would otherwise delete the
    /// machines of Proxies in other namespaces).
    #[arg(long, env = "PROXY_OPERATOR_GC_ALLOW_NAMESPACED")]
    pub gc_allow_namespaced: bool,

    /// Identifies this install on the machines it creates, so installs sharing a cluster or
    /// cloud project never touch each other's machines.
    #[arg(long, env = "PROXY_OPERATOR_INSTALL_ID", default_value = "default")]
    pub install_id: String,

    /// Namespace of the leader-election Lease (default: the pod's namespace, else `default`).
    #[arg(long, env = "POD_NAMESPACE")]
    pub leader_namespace: Option<String>,

    /// Name of the leader-election Lease; installs sharing a namespace need different names.
    #[arg(
        long,
        env = "PROXY_OPERATOR_LEADER_LEASE",
        default_value = "proxy-operator-leader"
    )]
    pub leader_lease: String,

    /// How long the leader Lease stays valid without a renewal: how long the replicas go
    /// without a reconciler after its holder dies (whole seconds, at least 2).
    #[arg(long, env = "PROXY_OPERATOR_LEADER_LEASE_DURATION", default_value = "30s", value_parser = lease_duration)]
    pub leader_lease_duration: Duration,

    /// Reconciles running at once.
    #[arg(long, env = "PROXY_OPERATOR_MAX_CONCURRENT_RECONCILES", default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..))]
    pub max_concurrent_reconciles: u16,

    /// How often a machine being created is looked at again.
    #[arg(long, env = "PROXY_OPERATOR_PROVISIONING_POLL", default_value = "10s", value_parser = humantime::parse_duration)]
    pub provisioning_poll: Duration,

    /// How often a running machine is looked at again (catches machines that die or vanish).
    #[arg(long, env = "PROXY_OPERATOR_DRIFT_POLL", default_value = "5m", value_parser = humantime::parse_duration)]
    pub drift_poll: Duration,

    /// How often a machine being deleted is looked at again.
    #[arg(long, env = "PROXY_OPERATOR_DELETION_POLL", default_value = "5s", value_parser = humantime::parse_duration)]
    pub deletion_poll: Duration,

    /// Wait after a provider refused for quota.
    #[arg(long, env = "PROXY_OPERATOR_QUOTA_REQUEUE", default_value = "5m", value_parser = humantime::parse_duration)]
    pub quota_requeue: Duration,

    /// First wait after a failed reconcile (or a refused create); it doubles with each failure
    /// in a row, up to --error-requeue-max, and starts over after a success.
    #[arg(long, env = "PROXY_OPERATOR_ERROR_REQUEUE", default_value = "5s", value_parser = humantime::parse_duration)]
    pub error_requeue: Duration,

    /// Longest wait between retries after failures in a row.
    #[arg(long, env = "PROXY_OPERATOR_ERROR_REQUEUE_MAX", default_value = "5m", value_parser = humantime::parse_duration)]
    pub error_requeue_max: Duration,

    /// How long a machine may take to run after it was created (or after it stopped running)
    /// before it is replaced.
    #[arg(long, env = "PROXY_OPERATOR_STARTUP_TIMEOUT", default_value = "10m", value_parser = humantime::parse_duration)]
    pub startup_timeout: Duration,

    /// How long past its deletion deadline (a Pod's deletionTimestamp, grace period included)
    /// a machine may stay undeleted before it is force-deleted: only a lost node keeps a Pod
    /// Terminating that long.
    #[arg(long, env = "PROXY_OPERATOR_FORCE_DELETE_MARGIN", default_value = "30s", value_parser = humantime::parse_duration)]
    pub force_delete_margin: Duration,

    /// How often a provider's permanent refusal (a spec it cannot accept) is tried again;
    /// a restart or a spec change tries again at once.
    #[arg(long, env = "PROXY_OPERATOR_PERMANENT_FAILURE_RETRY", default_value = "30m", value_parser = humantime::parse_duration)]
    pub permanent_failure_retry: Duration,

    /// How long a proxy drains before its machine is deleted anyway (a replacement, or the
    /// Proxy's deletion): it takes no new leases meanwhile, and the leases still active at
    /// the end are ended.
    #[arg(long, env = "PROXY_OPERATOR_DRAIN_TIMEOUT", default_value = "15m", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,

    /// Most Managed proxies draining or being replaced at once for a spec change, a rotation,
    /// a remediation, or a ProxyPool's roll-out or scale-down: a count (`3`) or a percentage of the Managed proxies (`10%`, rounded
    /// down but at least 1). `0` pauses all such replacements; repairs of machines already
    /// gone or dead never wait.
    #[arg(long, env = "PROXY_OPERATOR_REPLACEMENT_BUDGET", default_value = "10%")]
    pub replacement_budget: Share,

    /// How long a Managed proxy may fail health checks before its machine is replaced.
    #[arg(long, env = "PROXY_OPERATOR_REMEDIATE_AFTER", default_value = "10m", value_parser = humantime::parse_duration)]
    pub remediate_after: Duration,

    /// No machine is replaced for failing health checks while more than this many of its
    /// provider's Managed proxies fail them (the fault is then the network or the probe
    /// target): a count (`5`) or a percentage (`40%`).
    #[arg(long, env = "PROXY_OPERATOR_MAX_UNHEALTHY", default_value = "40%")]
    pub max_unhealthy: Share,

    /// The flags shared with `standalone`.
    #[command(flatten)]
    pub common: CommonArgs,
}

impl RunArgs {
    /// The reconciler's poll intervals and concurrency from the flags.
    pub fn reconciler_config(&self) -> ReconcilerConfig {
        ReconcilerConfig {
            provisioning_poll: self.provisioning_poll,
            drift_poll: self.drift_poll,
            deletion_poll: self.deletion_poll,
            quota_requeue: self.quota_requeue,
            error_requeue: self.error_requeue,
            error_requeue_max: self.error_requeue_max,
            startup_timeout: self.startup_timeout,
            force_delete_margin: self.force_delete_margin,
            permanent_failure_retry: self.permanent_failure_retry,
            drain_timeout: self.drain_timeout,
            replacement_budget: self.replacement_budget,
            remediate_after: self.remediate_after,
            max_unhealthy: self.max_unhealthy,
            concurrency: self.max_concurrent_reconciles,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn a_leader_lease_lasts_whole_seconds_and_at_least_two() {
        for (text, expected) in [
            ("30s", Ok(30)),
            ("2s", Ok(2)),
            ("1m", Ok(60)),
            ("1s", Err(())),
            ("2500ms", Err(())),
            ("0s", Err(())),
            ("soon", Err(())),
        ] {
            let parsed = lease_duration(text).map(|d| d.as_secs()).map_err(|_| ());
            assert_eq!(parsed, expected, "{text}");
        }
    }

    #[test]
    fn command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn defaults_apply() {
        let cli = Cli::try_parse_from(["proxy-operator", "standalone", "--inventory", "inv.yaml"])
            .unwrap();
        let Command::Standalone(args) = cli.command else {
            panic!("not standalone");
        };
        assert_eq!(args.common.discovery_addr.to_string(), "0.0.0.0:8090");
        assert_eq!(args.common.metrics_addr.to_string(), "0.0.0.0:8080");
        assert_eq!(
            args.common.ledger,
            LedgerLocation::Sqlite(PathBuf::from("./proxy-operator.db"))
        );
        assert_eq!(args.common.ledger_password_file, None);
        assert_eq!(args.common.ledger_pool_size, 16);
        assert_eq!(args.common.health_workers, 8);
        assert_eq!(args.common.lease_cooldown, Duration::from_secs(600));
        assert_eq!(args.common.max_lease_ttl, Duration::from_secs(3600));
        assert_eq!(
            args.common.history_retention,
            Duration::from_secs(7 * 86400)
        );
        assert_eq!(args.inventory_poll, Duration::from_secs(2));
        assert_eq!(args.common.ledger_queue_capacity, 4096);
        assert_eq!(args.common.ledger_queue_deadline, Duration::from_secs(2));
        assert_eq!(args.common.default_lease_ttl, Duration::from_secs(300));
        assert_eq!(args.common.discovery_token_file, None);
        assert_eq!(args.common.discovery_token_poll, Duration::from_secs(5));
        assert!(!args.common.insecure_no_auth);
        assert_eq!(args.common.ledger_max_size, 512 * 1024 * 1024);
        assert_eq!(
            ledger_size(DEFAULT_LEDGER_MAX_SIZE),
            Ok(crate::ledger::DEFAULT_MAX_SIZE)
        );
        assert!(!args.common.lease_credentials);
        let (addr, gateway) = args.common.gateway_config().unwrap();
        assert_eq!(addr.to_string(), "0.0.0.0:8888");
        let defaults = GatewayConfig::default();
        assert_eq!(gateway.allowed_ports, defaults.allowed_ports);
        assert_eq!(gateway.retries, defaults.retries);
        assert_eq!(gateway.upstream_timeout, defaults.upstream_timeout);
        assert_eq!(gateway.ban_rule, defaults.ban_rule);
        assert_eq!(gateway.session_ttl, defaults.session_ttl);
        assert_eq!(gateway.allowed_destinations, defaults.allowed_destinations);
        assert!(
            gateway.allowed_destinations.is_empty(),
            "nothing opened by default"
        );
        assert!(!gateway.pass_unresolved);
        assert_eq!(gateway.timeouts, defaults.timeouts);
        assert_eq!(gateway.max_connections, defaults.max_connections);
        assert_eq!(
            gateway.max_tenant_connections,
            defaults.max_tenant_connections
        );
        assert_eq!(
            gateway.max_connection_leases,
            defaults.max_connection_leases
        );
        assert_eq!(gateway.max_held, defaults.max_held);
    }

    #[test]
    fn the_gateway_takes_its_flags_or_is_off() {
        let cli = Cli::try_parse_from([
            "proxy-operator",
            "standalone",
            "--inventory",
            "i",
            "--gateway-addr",
            "127.0.0.1:9999",
            "--gateway-allowed-ports",
            "443,8443",
            "--gateway-ban-statuses",
            "",
            "--gateway-session-ttl",
            "30s",
            "--gateway-allowed-destinations",
            "10.20.0.0/16,127.0.0.1",
            "--gateway-header-timeout",
            "2s",
            "--gateway-idle-timeout",
            "5s",
        ])
        .unwrap();
        let Command::Standalone(args) = cli.command else {
            panic!("not standalone");
        };
        let (addr, gateway) = args.common.gateway_config().unwrap();
        assert_eq!(addr.to_string(), "127.0.0.1:9999");
        assert_eq!(gateway.allowed_ports, vec![443, 8443]);
        assert_eq!(gateway.ban_rule.of(429), None);
        assert_eq!(gateway.session_ttl, Duration::from_secs(30));
        assert_eq!(
            gateway.allowed_destinations,
            crate::egress::parse_allowed("10.20.0.0/16,127.0.0.1/32").unwrap()
        );
        assert_eq!(gateway.timeouts.header, Duration::from_secs(2));
        assert_eq!(gateway.timeouts.idle, Duration::from_secs(5));
        let off = Cli::try_parse_from([
            "proxy-operator",
            "standalone",
            "--inventory",
            "i",
            "--gateway-addr",
            "off",
        ])
        .unwrap();
        let Command::Standalone(args) = off.command else {
            panic!("not standalone");
        };
        assert!(args.common.gateway_config().is_none());
    }

    #[test]
    fn ledger_sizes_take_units_and_refuse_what_holds_nothing() {
        let cases: [(&str, Option<u64>); 10] = [
            ("512MiB", Some(512 << 20)),
            ("512Mi", Some(512 << 20)),
            ("1.5GiB", Some(3 << 29)),
            ("2GB", Some(2_000_000_000)),
            ("16 MiB", Some(16 << 20)),
            ("1048576", Some(1 << 20)),
            ("1MiB", Some(1 << 20)),
            ("1000KiB", None),
            ("0", None),
            ("lots", None),
        ];
        for (text, want) in cases {
            assert_eq!(ledger_size(text).ok(), want, "{text}");
        }
        let err = Cli::try_parse_from([
            "proxy-operator",
            "standalone",
            "--inventory",
            "i",
            "--ledger-max-size",
            "64KiB",
        ])
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("--ledger-max-size") && err.contains("at least 1MiB"),
            "{err}"
        );
    }

    #[test]
    fn run_defaults_are_the_reconcilers_defaults() {
        let cli =
            Cli::try_parse_from(["proxy-operator", "run", "--providers-config", "p.yaml"]).unwrap();
        let Command::Run(args) = cli.command else {
            panic!("not run");
        };
        assert_eq!(args.reconciler_config(), ReconcilerConfig::default());
        assert_eq!(args.leader_lease, "proxy-operator-leader");
        assert_eq!(args.gc_interval, Duration::from_secs(600));
        assert_eq!(args.gc_min_age, Duration::from_secs(600));
    }

    #[test]
    fn bad_values_are_refused_with_the_flag_named() {
        for args in [
            vec![
                "proxy-operator",
                "standalone",
                "--inventory",
                "i",
                "--lease-cooldown",
                "soon",
            ],
            vec![
                "proxy-operator",
                "standalone",
                "--inventory",
                "i",
                "--health-workers",
                "0",
            ],
            vec![
                "proxy-operator",
                "standalone",
                "--inventory",
                "i",
                "--discovery-addr",
                "nowhere",
            ],
            vec!["proxy-operator", "standalone"],
            vec![
                "proxy-operator",
                "standalone",
                "--inventory",
                "i",
                "--ledger-queue-capacity",
                "0",
            ],
            vec![
                "proxy-operator",
                "standalone",
                "--inventory",
                "i",
                "--ledger-queue-deadline",
                "0s",
            ],
            vec![
                "proxy-operator",
                "standalone",
                "--inventory",
                "i",
                "--default-lease-ttl",
                "0s",
            ],
            vec![
                "proxy-operator",
                "standalone",
                "--inventory",
                "i",
                "--discovery-token-poll",
                "0s",
            ],
            vec![
                "proxy-operator",
                "standalone",
                "--inventory",
                "i",
                "--gateway-addr",
                "everywhere",
            ],
            vec![
                "proxy-operator",
                "standalone",
                "--inventory",
                "i",
                "--gateway-ban-statuses",
                "429=banned",
            ],
            vec![
                "proxy-operator",
                "standalone",
                "--inventory",
                "i",
                "--gateway-allowed-ports",
                "0",
            ],
            vec![
                "proxy-operator",
                "standalone",
                "--inventory",
                "i",
                "--gateway-session-ttl",
                "2days",
            ],
            vec![
                "proxy-operator",
                "standalone",
                "--inventory",
                "i",
                "--gateway-allowed-destinations",
                "10.20.0.1/16",
            ],
            vec![
                "proxy-operator",
                "standalone",
                "--inventory",
                "i",
                "--gateway-header-timeout",
                "0s",
            ],
        ] {
            let err = Cli::try_parse_from(&args).unwrap_err().to_string();
            assert!(err.contains("--"), "{args:?}: {err}");
        }
    }

    #[test]
    fn a_zero_default_lease_ttl_is_refused_naming_the_flag() {
        let err = Cli::try_parse_from([
            "proxy-operator",
            "standalone",
            "--inventory",
            "i",
            "--default-lease-ttl",
            "0s",
        ])
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("--default-lease-ttl") && err.contains("must be above zero"),
            "{err}"
        );
    }

    #[test]
    fn help_shows_defaults_and_env_twins() {
        let help = Cli::command()
            .find_subcommand_mut("standalone")
            .unwrap()
            .render_long_help()
            .to_string();
        for expected in [
            "[default: 0.0.0.0:8090]",
            "PROXY_OPERATOR_LEDGER",
            "[default: 10m]",
            "[default: 512MiB]",
            "PROXY_OPERATOR_LEDGER_MAX_SIZE",
            "--insecure-no-auth",
            "DISCOVERY_TOKEN",
        ] {
            assert!(help.contains(expected), "{expected} missing from\n{help}");
        }
    }
}
