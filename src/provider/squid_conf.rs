//! The squid configuration every Managed proxy runs, whatever provider created its machine.
//!
//! It is generated here, by pure functions, so the squid Pod and the default cloud-init of a
//! VM serve the same proxy, and tests can hand the text to a real squid.
//!
//! Every configuration refuses what [`crate::egress`] denies (deny by default), after squid's
//! own resolution, unless a [`SquidEgress`] opens it.

use std::net::IpAddr;

use crate::egress::host::METADATA_NAMES;
use crate::egress::{IpNet, METADATA_ADDRESS, denied_embedding_ranges, denied_ranges};
use ipnet::Ipv6Net;

/// Env var carrying the generated configuration into the squid container.
pub const SQUID_CONFIG_ENV: &str = "SQUID_CONFIG";
/// Directory in the squid container holding the configuration and the access-log FIFO.
pub const POD_RUN_DIR: &str = "/run/proxy-operator";
/// Where a VM's squid reads its configuration (the distribution package's path).
pub const VM_CONF_PATH: &str = "/etc/squid/squid.conf";
/// Env var carrying the machine's password-file line (`user:$6$...`, from its credentials
/// Secret) into the squid container.
pub const SQUID_PASSWD_ENV: &str = "SQUID_PASSWD";
/// squid's helper that checks Basic credentials against a password file (Debian's and
/// Ubuntu's squid packages, and so `ubuntu/squid`).
pub const NCSA_AUTH: &str = "/usr/lib/squid/basic_ncsa_auth";
/// Where a VM's squid reads its password file.
pub const VM_PASSWD_PATH: &str = "/etc/squid/passwd";

/// Ports a squid relays to when nothing else is opened: HTTP and HTTPS.
pub const DEFAULT_PORTS: [u16; 2] = [80, 443];

/// Values per `acl` line: squid adds up the lines of one ACL, and short lines stay readable
/// (and far below squid's line length limit however many ranges are opened).
const VALUES_PER_LINE: usize = 8;

/// A port, or a range of ports, a squid relays to (squid's `port` ACL takes both).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortRange {
    low: u16,
    high: u16,
}

impl PortRange {
    /// The ports `low` to `high`; both in 1..=65535, `low` not above `high`.
    pub fn new(low: u16, high: u16) -> Result<Self, String> {
        if low == 0 {
            return Err("includes port 0 (ports are 1-65535)".to_owned());
        }
        if low > high {
            return Err("ends before it starts".to_owned());
        }
        Ok(PortRange { low, high })
    }

    /// The one port `port` (1..=65535).
    pub fn single(port: u16) -> Result<Self, String> {
        Self::new(port, port)
    }

    /// Reads `8080` or `8000-8100`; the error quotes `text`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let number = |part: &str| part.trim().parse::<u16>().ok();
        let (low, high) = match text.split_once('-') {
            Some((low, high)) => (number(low), number(high)),
            None => (number(text), number(text)),
        };
        let (Some(low), Some(high)) = (low, high) else {
            return Err(format!(
                "{text:?} is neither a port (1-65535) nor a range of ports (8000-8100)"
            ));
        };
        Self::new(low, high).map_err(|problem| format!("{text:?} {problem}"))
    }

    /// The first port.
    pub fn low(self) -> u16 {
        self.low
    }

    /// The last port.
    pub fn high(self) -> u16 {
        self.high
    }
}

impl std::fmt::Display for PortRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.low == self.high {
            write!(f, "{}", self.low)
        } else {
            write!(f, "{}-{}", self.low, self.high)
        }
    }
}

/// What a generated squid may reach, on top of the public addresses: the ranges opened among
/// those [`crate::egress`] denies, and the ports it relays to (plain HTTP and CONNECT alike,
/// as the gateway relays both to the same ports). The default opens no range and relays to
/// ports 80 and 443.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SquidEgress {
    /// Ranges opened although they are not public.
    pub destinations: Vec<IpNet>,
    /// Ports relayed to; none relays nothing.
    pub ports: Vec<PortRange>,
}

impl Default for SquidEgress {
    fn default() -> Self {
        SquidEgress {
            destinations: Vec::new(),
            ports: DEFAULT_PORTS
                .iter()
                .map(|&port| PortRange {
                    low: port,
                    high: port,
                })
                .collect(),
        }
    }
}

impl SquidEgress {
    /// Everything `self` or `other` opens.
    pub fn union(mut self, other: &SquidEgress) -> Self {
        self.destinations.extend(other.destinations.iter().copied());
        self.ports.extend(other.ports.iter().copied());
        self
    }

    /// Whether the cloud metadata address is opened (then its names are not refused either).
    fn opens_metadata(&self) -> bool {
        let metadata = IpAddr::V4(METADATA_ADDRESS);
        self.destinations.iter().any(|net| net.contains(&metadata))
    }

    /// The ACLs and the `http_access deny` lines that come before any allow, in two parts:
    /// what is checked before a client authenticates (the ports, which cost nothing), and what
    /// after (the metadata servers' names, and every address that is not public and not
    /// opened: an unauthenticated client learns nothing of them, and makes squid resolve
    /// nothing). squid judges `dst` on the addresses it resolves itself, and a `dst` ACL matches
    /// a name when any of its addresses does: so the opened ranges are cut out of the refused
    /// ones (an "allowed" ACL would let through a name with one opened address and one that is
    /// not). squid compares an IPv4-mapped address as the IPv4 address; the NAT64, 6to4 and
    /// IPv4-compatible spellings are listed.
    fn deny_lines(&self) -> DenyLines {
        let ports: Vec<String> = merged(&self.ports)
            .iter()
            .map(ToString::to_string)
            .collect();
        let opened = outermost(self.destinations.iter().copied());
        let mut before_auth = String::from(
            "# Destinations: the opened ports only, and no address that is not public unless \
             its range is opened.\n",
        );
        if ports.is_empty() {
            before_auth.push_str("http_access deny all\n");
            return DenyLines {
                before_auth,
                after_auth: String::new(),
            };
        }
        before_auth.push_str(&value_lines("# Opened:", &strings(&opened)));
        before_auth.push_str(&value_lines("acl Safe_ports port", &ports));
        before_auth.push_str(&value_lines("acl SSL_ports port", &ports));
        before_auth.push_str(&value_lines(
            &format!("acl {DENIED_ACL} dst"),
            &strings(&refused(&opened)),
        ));
        let metadata = !self.opens_metadata();
        if metadata {
            before_auth.push_str(&format!(
                "acl {METADATA_ACL} dstdomain -n {}\n",
                METADATA_NAMES.join(" ")
            ));
        }
        before_auth.push_str(
            "http_access deny !Safe_ports\n\
             http_access deny CONNECT !SSL_ports\n",
        );
        let mut after_auth = String::new();
        if metadata {
            after_auth.push_str(&format!("http_access deny {METADATA_ACL}\n"));
        }
        after_auth.push_str(&format!("http_access deny {DENIED_ACL}\n"));
        DenyLines {
            before_auth,
            after_auth,
        }
    }
}

/// The deny lines of [`SquidEgress::deny_lines`], split around authentication.
struct DenyLines {
    /// ACL definitions and the port rules.
    before_auth: String,
    /// The destination rules.
    after_auth: String,
}

/// The ACL of the addresses refused.
const DENIED_ACL: &str = "proxy_operator_denied";
/// The ACL of the cloud metadata servers' names.
const METADATA_ACL: &str = "proxy_operator_metadata";

/// Every denied range and its NAT64, 6to4 and IPv4-compatible spellings, without the `opened`
/// ranges, sorted.
fn refused(opened: &[IpNet]) -> Vec<IpNet> {
    let mut refused = outermost(
        denied_ranges()
            .chain(denied_embedding_ranges())
            .map(|(net, _)| net)
            .chain(compatible_ranges()),
    );
    for hole in opened {
        refused = refused
            .into_iter()
            .flat_map(|net| without(net, hole))
            .collect();
    }
    refused.sort();
    refused
}

/// The IPv4-compatible spellings (`::a.b.c.d`) of the denied IPv4 ranges: squid takes them for
/// IPv6 addresses of their own (it compares only IPv4-mapped ones as IPv4), where the gateway
/// judges them by the IPv4 address inside.
fn compatible_ranges() -> impl Iterator<Item = IpNet> {
    denied_ranges().filter_map(|(net, _)| match net {
        IpNet::V4(v4) => Ipv6Net::new(v4.network().to_ipv6_compatible(), 96 + v4.prefix_len())
            .ok()
            .map(IpNet::V6),
        IpNet::V6(_) => None,
    })
}

/// `net` without the addresses of `hole`: `net` itself when they do not meet, nothing when
/// `hole` covers it, else the halves of `net`, down to `hole`, that do not hold it.
fn without(net: IpNet, hole: &IpNet) -> Vec<IpNet> {
    if hole.contains(&net) {
        return Vec::new();
    }
    if !net.contains(hole) {
        return vec![net];
    }
    let mut rest = Vec::new();
    let mut current = net;
    while current.prefix_len() < hole.prefix_len() {
        let Ok(mut halves) = current.subnets(current.prefix_len() + 1) else {
            break;
        };
        let (Some(low), Some(high)) = (halves.next(), halves.next()) else {
            break;
        };
        let (inside, outside) = if low.contains(hole) {
            (low, high)
        } else {
            (high, low)
        };
        rest.push(outside);
        current = inside;
    }
    rest
}

/// `nets` without those inside another one, and without repeats, in their order: squid warns
/// about a range inside another of the same ACL and ignores it.
fn outermost(nets: impl IntoIterator<Item = IpNet>) -> Vec<IpNet> {
    let all: Vec<IpNet> = nets.into_iter().map(|net| net.trunc()).collect();
    all.iter()
        .enumerate()
        .filter(|&(i, net)| {
            !all.iter()
                .enumerate()
                .any(|(j, other)| j != i && other.contains(net) && (other != net || j < i))
        })
        .map(|(_, net)| *net)
        .collect()
}

/// `ports` sorted, with overlapping and adjacent ranges made one.
fn merged(ports: &[PortRange]) -> Vec<PortRange> {
    let mut sorted = ports.to_vec();
    sorted.sort();
    let mut out: Vec<PortRange> = Vec::with_capacity(sorted.len());
    for range in sorted {
        match out.last_mut() {
            Some(last) if range.low <= last.high.saturating_add(1) => {
                last.high = last.high.max(range.high);
            }
            _ => out.push(range),
        }
    }
    out
}

/// The ranges as squid reads them.
fn strings(nets: &[IpNet]) -> Vec<String> {
    nets.iter().map(ToString::to_string).collect()
}

/// `<start> <values>` over as many lines as `values` needs (none for no value).
fn value_lines(start: &str, values: &[String]) -> String {
    values
        .chunks(VALUES_PER_LINE)
        .map(|chunk| format!("{start} {}\n", chunk.join(" ")))
        .collect()
}

/// A forward proxy on `port` that caches nothing and relays only where `egress` allows,
/// followed by the `logging` lines. With a `passwd` file, only clients sending credentials it
/// holds may use it (`Proxy-Authorization: Basic`; others get 407); without, every client may
/// (a machine made before the operator generated credentials). Targets learn nothing of the
/// proxy (no `Via`, no `X-Forwarded-For`; the `Via` header is removed rather than switched off
/// with `via off`, which makes squid warn at every start), and a client connection that sends
/// nothing, sends its request slowly or idles is closed.
fn squid_config(port: i32, passwd: Option<&str>, egress: &SquidEgress, logging: &str) -> String {
    let DenyLines {
        before_auth,
        after_auth,
    } = egress.deny_lines();
    let access = match passwd {
        // `deny !authenticated` asks for credentials (407) before any destination is judged.
        Some(passwd) => format!(
            "{before_auth}\
             auth_param basic program {NCSA_AUTH} {passwd}\n\
             auth_param basic realm proxy-operator\n\
             acl authenticated proxy_auth REQUIRED\n\
             http_access deny !authenticated\n\
             {after_auth}\
             http_access allow authenticated\n\
             http_access deny all\n"
        ),
        None => format!("{before_auth}{after_auth}http_access allow all\n"),
    };
    format!(
        "# Generated by proxy-operator; changes are lost when the machine is replaced.\n\
         http_port {port}\n\
         {access}\
         cache deny all\n\
         cache_mem 8 MB\n\
         forwarded_for delete\n\
         request_header_access Via deny all\n\
         request_start_timeout 30 seconds\n\
         request_timeout 30 seconds\n\
         client_idle_pconn_timeout 60 seconds\n\
         shutdown_lifetime 1 seconds\n\
         {logging}"
    )
}

/// The password file of a squid container: in its run dir, written by [`pod_launch_script`].
fn pod_passwd(run_dir: &str) -> String {
    format!("{run_dir}/passwd")
}

/// The configuration of the squid container. Squid drops root for user `proxy` before it
/// opens its logs, and `proxy` may not open the container's stdout, so the access log goes to
/// a FIFO in `run_dir` that [`pod_launch_script`] copies to stdout; squid's own messages reach
/// stderr through `-d 1`. No pid file, no ICMP pinger: the container is the process.
///
/// `authenticated`: clients must send the credentials of [`SQUID_PASSWD_ENV`]; `egress`: what
/// it may reach.
pub fn pod_squid_config(
    port: i32,
    run_dir: &str,
    authenticated: bool,
    egress: &SquidEgress,
) -> String {
    squid_config(
        port,
        authenticated.then(|| pod_passwd(run_dir)).as_deref(),
        egress,
        &format!(
            "access_log stdio:{run_dir}/access.log\n\
             cache_log /dev/null\n\
             logfile_rotate 0\n\
             pid_filename none\n\
             pinger_enable off\n"
        ),
    )
}

/// The configuration of a squid container that runs as a non-root user from the start
/// (`podSecurity: restricted`): [`pod_squid_config`] (no user switch is configured: squid started
/// as non-root keeps its user) with squid's netdb journal switched off, because its default path
/// under `/var/spool/squid` belongs to the image, not to the Pod's user. Every file squid then
/// writes is in `run_dir` (an emptyDir in the Pod): the configuration, the access-log FIFO, and
/// no pid file, so a restarted container never trips over a stale one; squid's shared-memory
/// segments go to `/dev/shm`, which every container has writable.
pub fn pod_squid_config_unprivileged(
    port: i32,
    run_dir: &str,
    authenticated: bool,
    egress: &SquidEgress,
) -> String {
    format!(
        "{}netdb_filename none\n",
        pod_squid_config(port, run_dir, authenticated, egress)
    )
}

/// The container command: writes [`SQUID_CONFIG_ENV`] to `run_dir/squid.conf` (and, when
/// set, [`SQUID_PASSWD_ENV`] to the password file), makes the access-log FIFO, copies it to
/// stdout in the background and execs squid in the foreground.
pub fn pod_launch_script(run_dir: &str) -> String {
    let passwd = pod_passwd(run_dir);
    format!(
        "set -e; mkdir -p {run_dir}; printf '%s' \"${SQUID_CONFIG_ENV}\" > {run_dir}/squid.conf; \
         if [ -n \"${SQUID_PASSWD_ENV}\" ]; then printf '%s\\n' \"${SQUID_PASSWD_ENV}\" > {passwd}; \
         fi; rm -f {run_dir}/access.log; mkfifo -m 0666 {run_dir}/access.log; \
         cat {run_dir}/access.log & exec squid -f {run_dir}/squid.conf -N -d 1"
    )
}

/// The configuration of a VM's packaged squid: logs where the package rotates them; with
/// `authenticated`, clients must send credentials of [`VM_PASSWD_PATH`]; `egress`: what it may
/// reach.
pub fn vm_squid_config(port: i32, authenticated: bool, egress: &SquidEgress) -> String {
    squid_config(
        port,
        authenticated.then_some(VM_PASSWD_PATH),
        egress,
        "access_log daemon:/var/log/squid/access.log\n\
         cache_log /var/log/squid/cache.log\n",
    )
}

/// cloud-init user data that installs squid on a fresh Ubuntu/Debian VM and runs it with
/// [`vm_squid_config`]; with `htpasswd` (the machine's password-file line), only clients
/// sending those credentials may use it; `egress`: what it may reach. Used when a Proxy names no
/// cloud-init of its own.
pub fn squid_cloud_init(port: i32, htpasswd: Option<&str>, egress: &SquidEgress) -> String {
    let indented =
        |text: &str| -> String { text.lines().map(|line| format!("      {line}\n")).collect() };
    let config = indented(&vm_squid_config(port, htpasswd.is_some(), egress));
    let passwd = htpasswd
        .map(|line| {
            format!(
                "  - path: {VM_PASSWD_PATH}\n    permissions: '0640'\n    owner: root:proxy\n    \
                 defer: true\n    content: |\n{}",
                indented(line)
            )
        })
        .unwrap_or_default();
    format!(
        "#cloud-config\n\
         package_update: true\n\
         packages:\n  - squid\n\
         write_files:\n  - path: {VM_CONF_PATH}\n    permissions: '0644'\n    content: |\n{config}\
         {passwd}\
         runcmd:\n  - [systemctl, restart, squid]\n"
    )
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::{Ipv4Addr, TcpListener, TcpStream, UdpSocket};
    use std::os::unix::fs::PermissionsExt;
    use std::path::{Path, PathBuf};
    use std::process::{Child, Command, Stdio};
    use std::sync::mpsc::Receiver;
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use crate::credentials::Credentials;
    use crate::egress::parse_range;

    const SQUID: &str = "/usr/sbin/squid";
    /// How long anything a real squid does may take on a loaded machine.
    const DEADLINE: Duration = Duration::from_secs(30);

    /// Runs `squid -k parse` on `config` and returns (success, combined output).
    pub(crate) fn squid_parse(config: &str) -> (bool, String) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("squid.conf");
        std::fs::write(&path, config).unwrap();
        let output = Command::new(SQUID)
            .arg("-k")
            .arg("parse")
            .arg("-f")
            .arg(&path)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        (output.status.success(), text)
    }

    fn assert_clean_parse(config: &str) -> String {
        assert!(
            Path::new(SQUID).exists(),
            "squid must be installed at {SQUID}"
        );
        let (ok, output) = squid_parse(config);
        assert!(ok, "squid -k parse refused the config:\n{output}");
        assert!(
            !output.contains("WARNING") && !output.contains("ERROR"),
            "squid complained:\n{output}"
        );
        output
    }

    fn ports(list: &[&str]) -> Vec<PortRange> {
        list.iter().map(|p| PortRange::parse(p).unwrap()).collect()
    }

    fn ranges(list: &[&str]) -> Vec<IpNet> {
        list.iter().map(|r| parse_range(r).unwrap()).collect()
    }

    /// The policy opening `destinations` and relaying to `ports`.
    fn egress(destinations: &[&str], ports_list: &[&str]) -> SquidEgress {
        SquidEgress {
            destinations: ranges(destinations),
            ports: ports(ports_list),
        }
    }

    /// The values of every `acl <name> <kind> ...` line of `config`, in order.
    fn acl_values(config: &str, name: &str, kind: &str) -> Vec<String> {
        line_values(config, &format!("acl {name} {kind}"))
    }

    /// The values of every `<start> ...` line of `config`, in order.
    fn line_values(config: &str, start: &str) -> Vec<String> {
        let prefix = format!("{start} ");
        config
            .lines()
            .filter_map(|line| line.strip_prefix(&prefix))
            .flat_map(str::split_whitespace)
            .map(str::to_owned)
            .collect()
    }

    /// The ranges of the `proxy_operator_denied` ACL of `config`.
    fn refused_in(config: &str) -> Vec<IpNet> {
        acl_values(config, DENIED_ACL, "dst")
            .iter()
            .map(|r| r.parse().unwrap())
            .collect()
    }

    /// Every generated configuration of a pod and a VM, open or authenticated, with `egress`.
    fn every_config(egress: &SquidEgress) -> Vec<String> {
        [false, true]
            .into_iter()
            .flat_map(|authenticated| {
                [
                    pod_squid_config(3128, POD_RUN_DIR, authenticated, egress),
                    pod_squid_config_unprivileged(3129, POD_RUN_DIR, authenticated, egress),
                    vm_squid_config(3130, authenticated, egress),
                ]
            })
            .collect()
    }

    #[test]
    fn ports_and_port_ranges_are_read_strictly() {
        for (text, want) in [
            ("80", Ok((80, 80))),
            ("8000-8100", Ok((8000, 8100))),
            (" 8000 - 8100 ", Ok((8000, 8100))),
            ("65535", Ok((65535, 65535))),
            ("1-65535", Ok((1, 65535))),
            ("0", Err("includes port 0")),
            ("0-80", Err("includes port 0")),
            ("8100-8000", Err("ends before it starts")),
            ("65536", Err("neither a port")),
            ("80-", Err("neither a port")),
            ("http", Err("neither a port")),
            ("", Err("neither a port")),
        ] {
            let got = PortRange::parse(text).map(|r| (r.low(), r.high()));
            match want {
                Ok(want) => assert_eq!(got, Ok(want), "{text:?}"),
                Err(problem) => {
                    let err = got.unwrap_err();
                    assert!(err.contains(problem), "{text:?}: {err}");
                    assert!(err.contains(&format!("{text:?}")), "{text:?}: {err}");
                }
            }
        }
        assert_eq!(PortRange::parse("8080").unwrap().to_string(), "8080");
        assert_eq!(
            PortRange::parse("8000-8100").unwrap().to_string(),
            "8000-8100"
        );
        assert!(PortRange::single(0).is_err());
    }

    #[test]
    fn the_default_opens_no_range_and_relays_to_http_and_https() {
        let default = SquidEgress::default();
        assert!(default.destinations.is_empty());
        assert_eq!(default.ports, ports(&["80", "443"]));
        let config = pod_squid_config(3128, POD_RUN_DIR, true, &default);
        assert_eq!(acl_values(&config, "Safe_ports", "port"), ["80", "443"]);
        assert_eq!(acl_values(&config, "SSL_ports", "port"), ["80", "443"]);
        assert!(line_values(&config, "# Opened:").is_empty(), "{config}");
        let lines: Vec<&str> = config.lines().collect();
        assert!(
            lines.contains(&"http_access deny proxy_operator_denied"),
            "{config}"
        );
    }

    #[test]
    fn every_denied_range_is_refused_through_its_outermost_range() {
        let config = vm_squid_config(3128, true, &SquidEgress::default());
        let listed = refused_in(&config);
        let table: Vec<IpNet> = denied_ranges()
            .chain(denied_embedding_ranges())
            .map(|(net, _)| net)
            .chain(compatible_ranges())
            .collect();
        // Every range of the table is covered, and nothing else is listed.
        for net in &table {
            assert!(
                listed.iter().any(|l| l.contains(net)),
                "{net} is not refused: {listed:?}"
            );
        }
        for net in &listed {
            assert!(table.contains(net), "{net} is not in the table");
        }
        // squid warns about (and ignores) a range inside another of one ACL.
        for (i, a) in listed.iter().enumerate() {
            for (j, b) in listed.iter().enumerate() {
                assert!(i == j || !a.contains(b), "{b} is inside {a}");
            }
        }
        assert!(listed.contains(&"240.0.0.0/4".parse().unwrap()));
        assert!(!listed.contains(&"255.255.255.255/32".parse().unwrap()));
        // NAT64, 6to4 and IPv4-compatible spellings of loopback and the metadata address;
        // never an IPv4-mapped range (squid stores IPv4 mapped: that would match everything).
        for embedded in [
            "64:ff9b::7f00:0/104",
            "2002:7f00::/24",
            "64:ff9b::a9fe:0/112",
            "::7f00:0/104",
            "::a9fe:0/112",
        ] {
            assert!(listed.contains(&embedded.parse().unwrap()), "{embedded}");
        }
        assert!(
            !listed.iter().any(|l| l.to_string().starts_with("::ffff:")),
            "{listed:?}"
        );
        // Short lines.
        assert!(config.lines().all(|l| l.len() < 400), "{config}");
    }

    #[test]
    fn destination_rules_come_before_any_client_is_allowed() {
        for config in every_config(&egress(&["10.20.0.0/16"], &["80", "443"])) {
            let lines: Vec<&str> = config.lines().collect();
            let position = |wanted: &str| {
                lines
                    .iter()
                    .position(|l| *l == wanted)
                    .unwrap_or_else(|| panic!("no {wanted:?} in:\n{config}"))
            };
            let first_allow = lines
                .iter()
                .position(|l| l.starts_with("http_access allow"))
                .unwrap();
            let denies = [
                "http_access deny !Safe_ports",
                "http_access deny CONNECT !SSL_ports",
                "http_access deny proxy_operator_metadata",
                "http_access deny proxy_operator_denied",
            ];
            let mut last = 0;
            for deny in denies {
                let at = position(deny);
                assert!(
                    at >= last && at < first_allow,
                    "{deny} out of order:\n{config}"
                );
                last = at;
            }
            // With credentials, a client proves who it is before any destination is judged:
            // the ports are checked first, the addresses (which squid resolves) after.
            if let Some(challenge) = lines
                .iter()
                .position(|l| *l == "http_access deny !authenticated")
            {
                assert!(
                    position("http_access deny CONNECT !SSL_ports") < challenge,
                    "{config}"
                );
                assert!(
                    challenge < position("http_access deny proxy_operator_metadata"),
                    "{config}"
                );
            }
            // Every ACL is defined before it is used.
            let first_access = lines
                .iter()
                .position(|l| l.starts_with("http_access"))
                .unwrap();
            for acl in ["Safe_ports", "SSL_ports", DENIED_ACL, METADATA_ACL] {
                let defined = lines
                    .iter()
                    .position(|l| l.starts_with(&format!("acl {acl} ")))
                    .unwrap_or_else(|| panic!("{acl} not defined:\n{config}"));
                assert!(defined < first_access, "{acl}:\n{config}");
            }
            assert_eq!(
                acl_values(&config, METADATA_ACL, "dstdomain"),
                std::iter::once("-n")
                    .chain(METADATA_NAMES)
                    .collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn targets_learn_nothing_of_the_proxy_and_slow_or_idle_clients_are_closed() {
        for config in every_config(&SquidEgress::default()) {
            let lines: Vec<&str> = config.lines().collect();
            for wanted in [
                "forwarded_for delete",
                "request_header_access Via deny all",
                "request_start_timeout 30 seconds",
                "request_timeout 30 seconds",
                "client_idle_pconn_timeout 60 seconds",
            ] {
                assert!(lines.contains(&wanted), "no {wanted:?} in:\n{config}");
            }
        }
    }

    #[test]
    fn opened_ranges_and_ports_are_listed_once_in_their_outermost_form() {
        let opened = egress(
            &[
                "127.0.0.1",
                "10.20.0.0/16",
                "127.0.0.0/8",
                "fd00::/8",
                "10.20.0.0/16",
            ],
            &["443", "8080", "8000-8100", "80", "8101", "9000"],
        );
        let config = pod_squid_config(3128, POD_RUN_DIR, true, &opened);
        assert_eq!(
            line_values(&config, "# Opened:"),
            ["10.20.0.0/16", "127.0.0.0/8", "fd00::/8"]
        );
        let merged = ["80", "443", "8000-8101", "9000"];
        assert_eq!(acl_values(&config, "Safe_ports", "port"), merged);
        assert_eq!(acl_values(&config, "SSL_ports", "port"), merged);
        // Cut out of the refused ranges: nothing refused meets an opened range, and what is
        // around them stays refused.
        let refused = refused_in(&config);
        for net in &refused {
            for hole in &opened.destinations {
                assert!(
                    !net.contains(hole) && !hole.contains(net),
                    "{net} meets the opened {hole}"
                );
            }
        }
        for still in [
            "10.21.0.0/16",
            "10.0.0.0/12",
            "172.16.0.0/12",
            "fc00::/8",
            "::1/128",
        ] {
            let still: IpNet = still.parse().unwrap();
            assert!(
                refused.iter().any(|r| r.contains(&still)),
                "{still} is open"
            );
        }
        assert!(config.lines().all(|l| l.len() < 400), "{config}");
        assert_clean_parse(&config);
    }

    /// `address` plus or minus `step` within its family, if there is such an address.
    fn step(address: IpAddr, step: i8) -> Option<IpAddr> {
        match address {
            IpAddr::V4(v4) => u32::from(v4)
                .checked_add_signed(i32::from(step))
                .map(|n| IpAddr::V4(n.into())),
            IpAddr::V6(v6) => u128::from(v6)
                .checked_add_signed(i128::from(step))
                .map(|n| IpAddr::V6(n.into())),
        }
    }

    #[tokio::test]
    async fn the_squids_refuse_what_the_gateway_refuses() {
        use crate::egress::{Destinations, Host, embedded_v4};
        for opened in [
            &[][..],
            &["127.0.0.1"],
            &["127.0.0.0/8", "::1"],
            &[
                "10.20.0.0/16",
                "169.254.169.254",
                "fd00:1::/32",
                "255.255.255.255",
            ],
            &["10.0.0.0/8", "192.168.1.0/24", "100.64.0.0/10"],
        ] {
            let opened = ranges(opened);
            let refused = refused(&opened);
            let gateway = Destinations::new(opened.clone(), false);
            // Every range's edges and the addresses just outside, of the table and the opened.
            let edges: Vec<IpNet> = denied_ranges()
                .chain(denied_embedding_ranges())
                .map(|(net, _)| net)
                .chain(compatible_ranges())
                .chain(opened.iter().copied())
                .collect();
            let mut addresses: Vec<IpAddr> = ["8.8.8.8", "93.184.216.34", "2606:4700::1111"]
                .iter()
                .map(|a| a.parse().unwrap())
                .collect();
            for net in &edges {
                for edge in [net.network(), net.broadcast()] {
                    addresses.extend(
                        [Some(edge), step(edge, -1), step(edge, 1)]
                            .into_iter()
                            .flatten(),
                    );
                }
            }
            // And the IPv4-mapped spelling of every IPv4 address.
            let mapped: Vec<IpAddr> = addresses
                .iter()
                .filter_map(|a| match a {
                    IpAddr::V4(v4) => Some(IpAddr::V6(v4.to_ipv6_mapped())),
                    IpAddr::V6(_) => None,
                })
                .collect();
            addresses.extend(mapped);
            for address in addresses {
                // squid compares an IPv4-mapped address as the IPv4 address.
                let compared = match address {
                    IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(address, IpAddr::V4),
                    IpAddr::V4(_) => address,
                };
                let squid_refuses = refused.iter().any(|net| net.contains(&compared));
                let gateway_refuses = gateway.check(&Host::Ip(address), 80).await.is_err();
                let embedded = match address {
                    IpAddr::V6(v6) => embedded_v4(v6).is_some() && v6.to_ipv4_mapped().is_none(),
                    IpAddr::V4(_) => false,
                };
                if embedded {
                    // A NAT64, 6to4 or IPv4-compatible spelling is refused as its IPv4 address
                    // is, and stays refused when only the IPv4 range is opened.
                    assert!(
                        squid_refuses || !gateway_refuses,
                        "{address} with {opened:?}"
                    );
                } else {
                    assert_eq!(squid_refuses, gateway_refuses, "{address} with {opened:?}");
                }
            }
        }
    }

    #[test]
    fn opening_the_metadata_address_stops_refusing_its_names() {
        for (opened, refused_by_name) in [
            (egress(&["169.254.169.254"], &["80"]), false),
            (egress(&["169.254.0.0/16"], &["80"]), false),
            (egress(&["169.254.169.0/25"], &["80"]), true),
            (egress(&["10.0.0.0/8"], &["80"]), true),
        ] {
            let config = vm_squid_config(3128, true, &opened);
            assert_eq!(
                config.contains(METADATA_ACL),
                refused_by_name,
                "{:?}:\n{config}",
                opened.destinations
            );
            assert_clean_parse(&config);
        }
    }

    #[test]
    fn with_no_port_opened_nothing_is_relayed() {
        let closed = egress(&[], &[]);
        for config in every_config(&closed) {
            let lines: Vec<&str> = config.lines().collect();
            let deny = lines.iter().position(|l| *l == "http_access deny all");
            let allow = lines
                .iter()
                .position(|l| l.starts_with("http_access allow"));
            assert!(deny.is_some() && deny < allow, "{config}");
            assert_clean_parse(&config);
        }
    }

    #[test]
    fn the_union_opens_what_either_opens() {
        let flags = egress(&["127.0.0.1"], &["80", "443"]);
        let config = egress(&["10.20.0.0/16"], &["8000-8100"]);
        assert_eq!(
            flags.union(&config),
            egress(&["127.0.0.1", "10.20.0.0/16"], &["80", "443", "8000-8100"])
        );
    }

    #[test]
    fn unprivileged_config_is_the_pod_config_without_the_netdb_journal() {
        let egress = SquidEgress::default();
        let config = pod_squid_config_unprivileged(8081, "/run/x", true, &egress);
        let base = pod_squid_config(8081, "/run/x", true, &egress);
        assert_eq!(config, format!("{base}netdb_filename none\n"));
        // Nothing asks squid to switch users, and every path squid writes is in the run dir.
        for line in config.lines() {
            let mut words = line.split_whitespace();
            let directive = words.next().unwrap_or_default();
            assert!(
                !directive.starts_with("cache_effective_"),
                "a user switch: {line}"
            );
            if matches!(
                directive,
                "access_log" | "pid_filename" | "netdb_filename" | "coredump_dir" | "cache_dir"
            ) {
                let target = words.next().unwrap_or_default();
                assert!(
                    target == "none" || target.contains("/run/x/"),
                    "{line} writes outside the run dir"
                );
            }
        }
    }

    #[test]
    fn config_listens_on_the_port_and_allows_all() {
        let egress = SquidEgress::default();
        for config in [
            pod_squid_config(8081, POD_RUN_DIR, false, &egress),
            pod_squid_config_unprivileged(8081, POD_RUN_DIR, false, &egress),
            vm_squid_config(8081, false, &egress),
        ] {
            let lines: Vec<&str> = config.lines().collect();
            assert!(lines.contains(&"http_port 8081"), "{config}");
            assert!(lines.contains(&"http_access allow all"), "{config}");
            assert!(lines.contains(&"cache deny all"), "{config}");
            assert_eq!(
                lines.iter().filter(|l| l.starts_with("http_port")).count(),
                1
            );
        }
        let pod = pod_squid_config(8081, "/run/x", false, &egress);
        assert!(
            pod.contains("\naccess_log stdio:/run/x/access.log\n"),
            "{pod}"
        );
    }

    #[test]
    fn an_authenticated_config_lets_only_the_password_file_in() {
        let egress = SquidEgress::default();
        for (config, passwd) in [
            (
                pod_squid_config(8081, "/run/x", true, &egress),
                "/run/x/passwd",
            ),
            (
                pod_squid_config_unprivileged(8081, "/run/x", true, &egress),
                "/run/x/passwd",
            ),
            (vm_squid_config(8081, true, &egress), VM_PASSWD_PATH),
        ] {
            let lines: Vec<&str> = config.lines().collect();
            let program = format!("auth_param basic program {NCSA_AUTH} {passwd}");
            assert!(lines.contains(&program.as_str()), "{config}");
            let allow = lines
                .iter()
                .position(|l| *l == "http_access allow authenticated");
            let deny = lines.iter().position(|l| *l == "http_access deny all");
            assert!(allow.is_some() && allow < deny, "{config}");
            assert!(!lines.contains(&"http_access allow all"), "{config}");
        }
    }

    #[test]
    fn squid_accepts_the_generated_configs() {
        for opened in [
            SquidEgress::default(),
            egress(
                &[
                    "127.0.0.0/8",
                    "127.0.0.1",
                    "10.20.0.0/16",
                    "::1",
                    "fd00::/8",
                ],
                &["80", "443", "1024-65535", "8080"],
            ),
        ] {
            for config in every_config(&opened) {
                let output = assert_clean_parse(&config);
                let port = config
                    .lines()
                    .find(|l| l.starts_with("http_port "))
                    .unwrap();
                assert!(output.contains(&format!("Processing: {port}")), "{output}");
                assert!(
                    output.contains("Processing: request_header_access Via deny all"),
                    "{output}"
                );
            }
        }
        let output = assert_clean_parse(&pod_squid_config_unprivileged(
            3129,
            POD_RUN_DIR,
            true,
            &SquidEgress::default(),
        ));
        assert!(
            output.contains("Processing: netdb_filename none"),
            "{output}"
        );
    }

    #[test]
    fn squid_parse_check_rejects_a_broken_config() {
        // Proves the check above can fail: squid refuses an unknown directive, and warns about
        // a range inside another of one ACL.
        let broken = format!(
            "{}http_portt 3128\n",
            pod_squid_config(3128, POD_RUN_DIR, false, &SquidEgress::default())
        );
        let (ok, output) = squid_parse(&broken);
        assert!(!ok, "squid accepted a broken config:\n{output}");
        let nested = pod_squid_config(3128, POD_RUN_DIR, false, &SquidEgress::default()).replace(
            "http_port 3128\n",
            "http_port 3128\nacl nested dst 240.0.0.0/4 255.255.255.255\n",
        );
        let (_, output) = squid_parse(&nested);
        assert!(output.contains("WARNING"), "{output}");
    }

    #[test]
    fn cloud_init_is_yaml_that_writes_the_vm_config() {
        let egress = SquidEgress::default();
        let cloud_init = squid_cloud_init(3130, None, &egress);
        assert!(cloud_init.starts_with("#cloud-config\n"));
        let doc: serde_json::Value = serde_saphyr::from_str(&cloud_init).unwrap();
        assert_eq!(doc["packages"], serde_json::json!(["squid"]));
        let file = &doc["write_files"][0];
        assert_eq!(file["path"], VM_CONF_PATH);
        assert_eq!(file["content"], vm_squid_config(3130, false, &egress));
        assert_eq!(doc["write_files"].as_array().map(Vec::len), Some(1));
        assert_eq!(
            doc["runcmd"],
            serde_json::json!([["systemctl", "restart", "squid"]])
        );

        // With credentials: the authenticated config and its password file, readable by squid.
        let line = "proxy-operator:$6$salt$hash";
        let opened = self::egress(&["10.20.0.0/16"], &["80", "443", "8080"]);
        let cloud_init = squid_cloud_init(3130, Some(line), &opened);
        let doc: serde_json::Value = serde_saphyr::from_str(&cloud_init).unwrap();
        assert_eq!(
            doc["write_files"][0]["content"],
            vm_squid_config(3130, true, &opened)
        );
        let passwd = &doc["write_files"][1];
        assert_eq!(passwd["path"], VM_PASSWD_PATH);
        assert_eq!(passwd["content"], format!("{line}\n"));
        assert_eq!(passwd["owner"], "root:proxy");
        assert_eq!(passwd["permissions"], "0640");
        assert_eq!(passwd["defer"], true);
    }

    /// A loopback HTTP server answering every request with 200 `ok`, keeping the request
    /// heads that reach it.
    struct Origin {
        port: u16,
        heads: Arc<Mutex<Vec<String>>>,
    }

    impl Origin {
        fn start() -> Origin {
            Self::start_on("127.0.0.1:0")
        }

        /// An origin listening on `address` (`ip:port`, port 0 for any).
        fn start_on(address: &str) -> Origin {
            let listener = TcpListener::bind(address).unwrap();
            let port = listener.local_addr().unwrap().port();
            let heads = Arc::new(Mutex::new(Vec::new()));
            let kept = heads.clone();
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    let Ok(mut stream) = stream else { continue };
                    let kept = kept.clone();
                    std::thread::spawn(move || {
                        let mut reader = BufReader::new(stream.try_clone().unwrap());
                        let mut head = String::new();
                        while reader.read_line(&mut head).is_ok_and(|n| n > 0)
                            && !head.ends_with("\r\n\r\n")
                        {}
                        if head.is_empty() {
                            return;
                        }
                        kept.lock().unwrap().push(head);
                        let _ = stream.write_all(
                            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
                        );
                    });
                }
            });
            Origin { port, heads }
        }

        /// The request heads received so far.
        fn heads(&self) -> Vec<String> {
            self.heads.lock().unwrap().clone()
        }
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// Kills the launched squid when the test ends, however it ends.
    struct Launched(Child);

    impl Drop for Launched {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// The uid and gid of user `proxy` (the Debian squid package's user, uid 13 like in
    /// `ubuntu/squid`).
    fn proxy_user() -> (u32, u32) {
        // SAFETY: getpwnam's result is read at once, before any other passwd lookup here.
        unsafe {
            let entry = libc::getpwnam(c"proxy".as_ptr());
            assert!(
                !entry.is_null(),
                "user proxy must exist (Debian package squid)"
            );
            ((*entry).pw_uid, (*entry).pw_gid)
        }
    }

    /// One field of `/proc/<pid>/status`, e.g. `Uid`.
    fn proc_status(pid: u32, field: &str) -> String {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{field}:")))
            .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status:\n{status}"))
            .trim()
            .to_owned()
    }

    /// A squid run by [`pod_launch_script`] the way the container runs it, on a free loopback
    /// port; killed on drop.
    struct PodSquid {
        squid: Launched,
        port: u16,
        dir: tempfile::TempDir,
        run_path: PathBuf,
        /// squid's stdout (the access log), line by line.
        lines: Receiver<String>,
    }

    impl PodSquid {
        /// Starts squid with `config(port, run_dir)`, with the run dir already there with mode
        /// 0777 (like a Pod's emptyDir) when `emptydir` is set. `user` makes it run as that
        /// uid/gid, with no new privileges (as `allowPrivilegeEscalation: false`); `passwd`
        /// goes in [`SQUID_PASSWD_ENV`]. Returns once squid listens.
        fn start(
            config: impl FnOnce(i32, &str) -> String,
            emptydir: bool,
            user: Option<(u32, u32)>,
            passwd: Option<String>,
        ) -> PodSquid {
            let port = free_port();
            let dir = tempfile::tempdir().unwrap();
            // Run as root, squid drops to user `proxy` after start-up and must reach the FIFO
            // inside; run as a user, the user must.
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
            let run_path = dir.path().join("run");
            if emptydir {
                std::fs::create_dir(&run_path).unwrap();
                std::fs::set_permissions(&run_path, std::fs::Permissions::from_mode(0o777))
                    .unwrap();
            }
            let run_dir = run_path.to_str().unwrap();
            let mut command = Command::new("/bin/sh");
            command
                .arg("-c")
                .arg(pod_launch_script(run_dir))
                .env(SQUID_CONFIG_ENV, config(i32::from(port), run_dir))
                .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
                .current_dir("/")
                .stdout(Stdio::piped())
                .stderr(std::fs::File::create(dir.path().join("stderr")).unwrap());
            if let Some((uid, gid)) = user {
                use std::os::unix::process::CommandExt;
                command.uid(uid).gid(gid);
                // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
                unsafe {
                    command.pre_exec(|| {
                        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 {
                            Ok(())
                        } else {
                            Err(std::io::Error::last_os_error())
                        }
                    });
                }
            }
            if let Some(passwd) = passwd {
                command.env(SQUID_PASSWD_ENV, passwd);
            }
            let mut child = command.spawn().unwrap();
            let stdout = child.stdout.take().unwrap();
            let (lines_tx, lines) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    if lines_tx.send(line).is_err() {
                        break;
                    }
                }
            });
            let mut squid = PodSquid {
                squid: Launched(child),
                port,
                dir,
                run_path,
                lines,
            };
            let deadline = Instant::now() + DEADLINE;
            while TcpStream::connect(("127.0.0.1", port)).is_err() {
                if let Some(status) = squid.squid.0.try_wait().unwrap() {
                    panic!(
                        "squid exited ({status}) before listening:\n{}",
                        squid.stderr()
                    );
                }
                assert!(
                    Instant::now() < deadline,
                    "squid never listened on {port}:\n{}",
                    squid.stderr()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
            squid
        }

        fn stderr(&self) -> String {
            std::fs::read_to_string(self.dir.path().join("stderr")).unwrap_or_default()
        }

        /// Sends `request` (a request head, `Connection: close` for a plain request) and
        /// returns the answer: a CONNECT's head, or a plain request's whole response.
        fn ask(&self, request: &str) -> String {
            let mut proxy = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
            proxy.set_read_timeout(Some(DEADLINE)).unwrap();
            proxy.write_all(request.as_bytes()).unwrap();
            let mut answer = Vec::new();
            let mut buf = [0u8; 4096];
            loop {
                let n = proxy
                    .read(&mut buf)
                    .unwrap_or_else(|e| panic!("no answer to {request:?}: {e}"));
                answer.extend_from_slice(&buf[..n]);
                let head_done = answer.windows(4).any(|w| w == b"\r\n\r\n");
                if n == 0 || (head_done && request.starts_with("CONNECT ")) {
                    break;
                }
            }
            String::from_utf8_lossy(&answer).into_owned()
        }

        /// A plain GET of `url` through squid, with `authorization` header lines.
        fn get(&self, url: &str, authorization: &str) -> String {
            let host = url
                .trim_start_matches("http://")
                .split('/')
                .next()
                .unwrap_or_default();
            self.ask(&format!(
                "GET {url} HTTP/1.1\r\nHost: {host}\r\n{authorization}Connection: close\r\n\r\n"
            ))
        }

        /// A CONNECT to `authority` through squid, with `authorization` header lines.
        fn connect(&self, authority: &str, authorization: &str) -> String {
            self.ask(&format!(
                "CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n{authorization}\r\n"
            ))
        }
    }

    /// Asserts squid refused `answer` itself, by its access rules (not a failed forward).
    fn assert_refused(answer: &str, what: &str) {
        assert!(answer.starts_with("HTTP/1.1 403 "), "{what}: {answer}");
        assert!(
            answer.contains("X-Squid-Error: ERR_ACCESS_DENIED"),
            "{what}: {answer}"
        );
    }

    /// Runs [`pod_launch_script`] with `config` (opening loopback and the origin's port) as
    /// [`PodSquid::start`] does. With `credentials`, their password-file line goes in
    /// [`SQUID_PASSWD_ENV`], the config is the authenticated one, and a request without them
    /// is refused 407 first. Checks that squid proxies a request (sending the credentials) and
    /// that its access log reaches stdout, then hands squid's process ID to `check` while squid
    /// still runs.
    fn launch_and_proxy(
        config: impl Fn(i32, &str, bool, &SquidEgress) -> String,
        emptydir: bool,
        user: Option<(u32, u32)>,
        credentials: Option<&Credentials>,
        check: impl FnOnce(u32),
    ) {
        let origin = Origin::start();
        let opened = egress(&["127.0.0.0/8"], &[&origin.port.to_string()]);
        let squid = PodSquid::start(
            |port, run_dir| config(port, run_dir, credentials.is_some(), &opened),
            emptydir,
            user,
            credentials.map(|c| c.htpasswd_line().unwrap()),
        );
        let url = format!("http://127.0.0.1:{}/probe", origin.port);
        let authorization = match credentials {
            Some(credentials) => {
                let refused = squid.get(&url, "");
                assert!(
                    refused.starts_with("HTTP/1.1 407"),
                    "{refused}\n{}",
                    squid.stderr()
                );
                let wrong = Credentials {
                    password: "wrong".into(),
                    ..credentials.clone()
                };
                let refused =
                    squid.get(&url, &format!("Proxy-Authorization: {}\r\n", wrong.basic()));
                assert!(refused.starts_with("HTTP/1.1 407"), "{refused}");
                format!("Proxy-Authorization: {}\r\n", credentials.basic())
            }
            None => String::new(),
        };
        let response = squid.get(&url, &authorization);
        assert!(
            response.starts_with("HTTP/1.1 200"),
            "{response}\n{}",
            squid.stderr()
        );
        assert!(response.ends_with("ok"), "{response}");

        let deadline = Instant::now() + DEADLINE;
        loop {
            let wait = deadline.saturating_duration_since(Instant::now());
            match squid.lines.recv_timeout(wait) {
                Ok(line) if line.contains(&format!("GET {url}")) => break,
                Ok(_) => continue,
                Err(e) => panic!(
                    "no access-log line for {url} on stdout: {e}\n{}",
                    squid.stderr()
                ),
            }
        }
        assert!(squid.run_path.join("squid.conf").exists());
        // The shell exec'd squid: the child is squid itself.
        check(squid.squid.0.id());
    }

    #[test]
    fn the_pod_command_runs_squid_that_proxies_and_logs_to_stdout() {
        launch_and_proxy(pod_squid_config, false, None, None, |_| {});
    }

    #[test]
    fn the_pod_command_with_credentials_serves_only_those_who_send_them() {
        let credentials = Credentials::generate();
        launch_and_proxy(pod_squid_config, false, None, Some(&credentials), |_| {});
    }

    #[test]
    fn a_running_squid_refuses_what_is_not_public_after_its_own_resolution() {
        let origin = Origin::start();
        let port = origin.port;
        let credentials = Credentials::generate();
        // The origin's port is opened, its address is not: what refuses is the destination.
        let closed = egress(&[], &[&port.to_string()]);
        let squid = PodSquid::start(
            |listen, run_dir| pod_squid_config(listen, run_dir, true, &closed),
            false,
            None,
            Some(credentials.htpasswd_line().unwrap()),
        );
        let auth = format!("Proxy-Authorization: {}\r\n", credentials.basic());
        for url in [
            // A name squid resolves to loopback itself.
            format!("http://localhost:{port}/"),
            format!("http://127.0.0.1:{port}/"),
            // IPv4-mapped, NAT64 and 6to4 spellings of the same address.
            format!("http://[::ffff:127.0.0.1]:{port}/"),
            format!("http://[64:ff9b::7f00:1]:{port}/"),
            format!("http://[2002:7f00:1::]:{port}/"),
            format!("http://[::127.0.0.1]:{port}/"),
            format!("http://[::1]:{port}/"),
        ] {
            assert_refused(&squid.get(&url, &auth), &url);
        }
        assert_refused(
            &squid.connect(&format!("127.0.0.1:{port}"), &auth),
            "CONNECT",
        );
        assert_refused(
            &squid.connect(&format!("localhost:{port}"), &auth),
            "CONNECT",
        );
        assert_eq!(
            origin.heads(),
            [] as [String; 0],
            "a refused request reached the origin"
        );

        // The metadata server: by address and by name, refused before any connect attempt
        // (a failed one would be ERR_CONNECT_FAIL or a timeout, not ERR_ACCESS_DENIED).
        let metadata = PodSquid::start(
            |listen, run_dir| pod_squid_config(listen, run_dir, true, &SquidEgress::default()),
            false,
            None,
            Some(credentials.htpasswd_line().unwrap()),
        );
        for url in [
            "http://169.254.169.254/computeMetadata/v1/",
            "http://metadata.google.internal/computeMetadata/v1/",
            "http://instance-data/latest/meta-data/",
        ] {
            let asked = Instant::now();
            assert_refused(&metadata.get(url, &auth), url);
            assert!(
                asked.elapsed() < Duration::from_secs(10),
                "{url}: {:?}",
                asked.elapsed()
            );
        }
        assert_refused(&metadata.connect("169.254.169.254:443", &auth), "CONNECT");
        // A port outside the opened ones, even to a public address.
        assert_refused(&metadata.get("http://93.184.216.34:25/", &auth), "port 25");
        assert_refused(&metadata.connect("93.184.216.34:22", &auth), "CONNECT :22");
    }

    /// A DNS server on `address` port 53 answering an A query for `name` with `answers`, and
    /// every other query with no address; for a squid told to ask it (`dns_nameservers`).
    fn dns_server(address: Ipv4Addr, name: &'static str, answers: Vec<Ipv4Addr>) {
        let socket = UdpSocket::bind((address, 53)).unwrap();
        std::thread::spawn(move || {
            let mut buf = [0u8; 1500];
            while let Ok((n, from)) = socket.recv_from(&mut buf) {
                let query = &buf[..n];
                // The question: labels up to the root label, then its type and class.
                let mut at = 12;
                let mut labels = Vec::new();
                while let Some(&len) = query.get(at).filter(|&&len| len != 0) {
                    let label = query
                        .get(at + 1..at + 1 + usize::from(len))
                        .unwrap_or_default();
                    labels.push(String::from_utf8_lossy(label).into_owned());
                    at += 1 + usize::from(len);
                }
                let Some(question) = query.get(12..at + 5) else {
                    continue;
                };
                let is_a = query[at + 1..at + 3] == [0, 1];
                let found: &[Ipv4Addr] = if is_a && labels.join(".") == name {
                    &answers
                } else {
                    &[]
                };
                let mut reply = query[..2].to_vec();
                reply.extend_from_slice(&[0x81, 0x80, 0, 1, 0, found.len() as u8, 0, 0, 0, 0]);
                reply.extend_from_slice(question);
                for address in found {
                    // A pointer to the question's name, type A, class IN, TTL 60, 4 bytes.
                    reply.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4]);
                    reply.extend_from_slice(&address.octets());
                }
                let _ = socket.send_to(&reply, from);
            }
        });
    }

    #[test]
    fn a_name_is_refused_when_one_of_its_addresses_is_refused() {
        // SAFETY: geteuid cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: a DNS server on port 53 for squid needs root");
            return;
        }
        // A name resolving to an opened and a refused address: squid may connect to either (it
        // tries them in turn), so the name is refused. The same port on both addresses.
        let opened_origin = Origin::start();
        let port = opened_origin.port;
        let refused_origin = Origin::start_on(&format!("127.0.0.2:{port}"));
        let nameserver = Ipv4Addr::new(127, 53, (std::process::id() % 200) as u8 + 1, 1);
        let (one, two) = (Ipv4Addr::new(127, 0, 0, 1), Ipv4Addr::new(127, 0, 0, 2));
        dns_server(nameserver, "two-faced.test", vec![two, one]);
        let opened = egress(&["127.0.0.1"], &[&port.to_string()]);
        let squid = PodSquid::start(
            |listen, run_dir| {
                // The generated configuration, asking this test's DNS server.
                format!(
                    "{}dns_nameservers {nameserver}\n",
                    pod_squid_config(listen, run_dir, false, &opened)
                )
            },
            false,
            None,
            None,
        );
        assert_refused(
            &squid.get(&format!("http://two-faced.test:{port}/"), ""),
            "a name with a refused address",
        );
        assert_refused(
            &squid.connect(&format!("two-faced.test:{port}"), ""),
            "CONNECT to a name with a refused address",
        );
        assert_eq!(refused_origin.heads(), [] as [String; 0]);
        assert_eq!(opened_origin.heads(), [] as [String; 0]);
        // Its opened address alone is served.
        let response = squid.get(&format!("http://127.0.0.1:{port}/"), "");
        assert!(
            response.starts_with("HTTP/1.1 200"),
            "{response}\n{}",
            squid.stderr()
        );
        assert_eq!(opened_origin.heads().len(), 1);
    }

    #[test]
    fn an_opened_range_reaches_the_origin_and_only_on_the_opened_ports() {
        let origin = Origin::start();
        let elsewhere = Origin::start();
        let opened = egress(&["127.0.0.1"], &["80", &origin.port.to_string()]);
        let squid = PodSquid::start(
            |listen, run_dir| pod_squid_config(listen, run_dir, false, &opened),
            false,
            None,
            None,
        );
        let response = squid.get(&format!("http://127.0.0.1:{}/", origin.port), "");
        assert!(
            response.starts_with("HTTP/1.1 200"),
            "{response}\n{}",
            squid.stderr()
        );
        assert!(response.ends_with("ok"), "{response}");
        let tunnel = squid.connect(&format!("127.0.0.1:{}", origin.port), "");
        assert!(
            tunnel.starts_with("HTTP/1.1 200"),
            "{tunnel}\n{}",
            squid.stderr()
        );
        // The same address on a port not opened; another loopback address on the opened one.
        assert_refused(
            &squid.get(&format!("http://127.0.0.1:{}/", elsewhere.port), ""),
            "a port not opened",
        );
        assert_refused(
            &squid.connect(&format!("127.0.0.1:{}", elsewhere.port), ""),
            "CONNECT to a port not opened",
        );
        assert_refused(
            &squid.get(&format!("http://127.0.0.2:{}/", origin.port), ""),
            "127.0.0.2",
        );
        assert_refused(&squid.get("http://169.254.169.254/", ""), "metadata");
        assert_eq!(elsewhere.heads(), [] as [String; 0]);
        // The GET reached the origin, and told it nothing of the proxy.
        let heads = origin.heads();
        assert_eq!(heads.len(), 1, "{heads:?}");
        let head = heads[0].to_ascii_lowercase();
        assert!(head.starts_with("get / http/1.1\r\n"), "{head}");
        for header in ["\r\nvia:", "\r\nx-forwarded-for:", "\r\nforwarded:"] {
            assert!(
                !head.contains(header),
                "{header} sent to the target: {head}"
            );
        }
    }

    #[test]
    fn the_restricted_pod_command_serves_as_a_non_root_user() {
        // Root here (the usual case in this project's test environment) plays the container
        // runtime: the command starts as `proxy` with no new privileges, as the restricted Pod's
        // securityContext asks. Any other user is already what the Pod asks for.
        // SAFETY: geteuid cannot fail.
        let user = (unsafe { libc::geteuid() } == 0).then(proxy_user);
        if let Some((uid, gid)) = user {
            assert_eq!(
                (uid, gid),
                (13, 13),
                "proxy is uid/gid 13 in Debian and Ubuntu"
            );
        }
        let credentials = Credentials::generate();
        launch_and_proxy(
            pod_squid_config_unprivileged,
            true,
            user,
            Some(&credentials),
            |pid| {
                let uids: Vec<String> = proc_status(pid, "Uid")
                    .split_whitespace()
                    .map(str::to_owned)
                    .collect();
                assert_eq!(uids.len(), 4, "{uids:?}");
                assert!(
                    uids.iter().all(|u| u != "0"),
                    "squid runs as root: {uids:?}"
                );
                if let Some((uid, gid)) = user {
                    assert!(uids.iter().all(|u| *u == uid.to_string()), "{uids:?}");
                    let gids = proc_status(pid, "Gid");
                    assert!(
                        gids.split_whitespace().all(|g| *g == gid.to_string()),
                        "{gids}"
                    );
                    assert_eq!(proc_status(pid, "NoNewPrivs"), "1");
                }
                assert_eq!(proc_status(pid, "CapEff"), "0000000000000000");
            },
        );
    }
}
