//! A vendor's proxy list turned into External `Proxy` objects and their credentials Secrets:
//! what `proxy-operator proxies import FILE` prints, for `kubectl apply -f -` or as a
//! standalone inventory file.
//!
//! One proxy a line, as vendors hand them out: `host:port`, `host:port:user:pass`, or a URL
//! `scheme://[user:pass@]host:port` with scheme `http`, `socks5` or `socks5h` (user and password
//! percent-decoded, an IPv6 host in brackets). Blank lines and lines starting with `#` are
//! skipped. The whole list is checked before anything is rendered: one bad line refuses the
//! list, so a pipe into `kubectl apply` never applies half of it.
//!
//! Names are the prefix and a hash of the proxy's `host:port`, not its line number: the same
//! proxy keeps its name when the vendor reorders, adds or drops lines, so importing a new
//! edition of a list updates the Proxies that stayed instead of renaming them all (which would
//! drop their health history and leases). A `host:port` listed twice is refused with both line
//! numbers: the two lines could differ in credentials or protocol, and picking one silently
//! would hide the vendor's mistake.

use std::collections::{BTreeMap, HashMap};
use std::net::Ipv6Addr;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use sha2::{Digest, Sha256};

use crate::credentials::{CREDENTIALS_SECRET_LABEL, Credentials, PASSWORD_KEY, USERNAME_KEY};
use crate::resources::proxy::{
    DEFAULT_PORT, Endpoint, EndpointProtocol, HealthCheck, Mode, Proxy, ProxySpec, SecretRef,
};

/// The name prefix when the list's file name gives none (stdin, or a name without letters or
/// digits).
pub const DEFAULT_PREFIX: &str = "proxy";
/// Longest name prefix: the prefix, `-`, the hash and `-credentials` fit the 63 characters of a
/// DNS-1123 label, so every name is valid wherever Kubernetes asks for a label-sized name.
pub const MAX_PREFIX_LEN: usize = 40;
/// Characters of the name hash: 50 bits of SHA-256, so two proxies of one list sharing a name
/// is about one chance in 10^6 at 50,000 proxies (and refused, never overwritten, if it happens).
const HASH_LEN: usize = 10;
/// Suffix of a Proxy's name that names its credentials Secret.
const SECRET_SUFFIX: &str = "-credentials";
/// What a line that fits no form is told.
const FORMS: &str = "expected host:port, host:port:user:pass or scheme://[user:pass@]host:port";

/// What every imported object gets, besides what its line says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportOptions {
    /// Namespace of the Proxies and Secrets.
    pub namespace: String,
    /// Start of every name (a DNS-1123 label of at most [`MAX_PREFIX_LEN`] characters).
    pub name_prefix: String,
    /// Labels of every Proxy and Secret (what crawlers select on, and what
    /// `kubectl delete -l` or `kubectl apply --prune -l` finds the import by).
    pub labels: BTreeMap<String, String>,
    /// `spec.maxLeases` of every Proxy; `None` leaves the CRD's default.
    pub max_leases: Option<i32>,
}

/// Why a list was refused: where (`list.txt:7`) and what, never a password.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImportError {
    /// One line is not a proxy.
    #[error("{list}:{line}: {reason}")]
    Line {
        /// The list's name (its path, or `-`).
        list: String,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// The list holds no proxy at all: nothing to apply is more likely a wrong file than
    /// an intent.
    #[error("{list}: holds no proxy")]
    Empty {
        /// The list's name.
        list: String,
    },
    /// The objects could not be written as YAML.
    #[error("{list}: cannot render the YAML: {message}")]
    Render {
        /// The list's name.
        list: String,
        /// The serializer's message.
        message: String,
    },
}

/// One proxy of a list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedProxy {
    /// Host name (lowercase) or IP address (IPv6 without brackets).
    pub host: String,
    /// TCP port.
    pub port: u16,
    /// What it speaks.
    pub protocol: EndpointProtocol,
    /// The credentials the line gave.
    pub credentials: Option<Credentials>,
}

impl ListedProxy {
    /// `host:port` (IPv6 in brackets): the proxy's identity within a list.
    pub fn address(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// The proxy on one line, `None` for a blank line or a comment, or why the line is none.
/// The reason never repeats the line: it may hold a password.
pub fn parse_line(line: &str) -> Result<Option<ListedProxy>, String> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return Ok(None);
    }
    if line.contains(char::is_whitespace) {
        return Err(format!("whitespace inside the line; {FORMS}"));
    }
    match line.split_once("://") {
        Some((scheme, rest)) => parse_url(scheme, rest).map(Some),
        None => parse_colons(line).map(Some),
    }
}

/// `host:port` or `host:port:user:pass` (the password may hold `:`; it is the rest of the line).
fn parse_colons(line: &str) -> Result<ListedProxy, String> {
    let parts: Vec<&str> = line.splitn(4, ':').collect();
    let (host, port, credentials) = match parts[..] {
        [host, port] => (host, port, None),
        [host, port, user, pass] => (host, port, Some(credentials(user, pass)?)),
        _ => return Err(FORMS.to_owned()),
    };
    Ok(ListedProxy {
        host: host_name(host)?,
        port: port_number(port)?,
        protocol: EndpointProtocol::Http,
        credentials,
    })
}

/// `scheme://[user:pass@]host:port[/]`, the user and password percent-decoded.
fn parse_url(scheme: &str, rest: &str) -> Result<ListedProxy, String> {
    let protocol = match scheme.to_ascii_lowercase().as_str() {
        "http" => EndpointProtocol::Http,
        "socks5" | "socks5h" => EndpointProtocol::Socks5,
        _ => {
            return Err(format!(
                "scheme {scheme:?} is not supported (http, socks5, socks5h)"
            ));
        }
    };
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.contains(['/', '?', '#']) {
        return Err(
            "a proxy URL has no path, query or fragment (in a user name or password, write \
             / ? # as %2F %3F %23)"
                .to_owned(),
        );
    }
    let (userinfo, host_port) = match authority.rsplit_once('@') {
        Some((userinfo, host_port)) => (Some(userinfo), host_port),
        None => (None, authority),
    };
    let credentials = userinfo
        .map(|userinfo| {
            let (user, pass) = userinfo
                .split_once(':')
                .ok_or("credentials in a URL are user:password")?;
            credentials(
                &percent_decode(user)
                    .ok_or("the user name has a bad percent-escape or is not UTF-8")?,
                &percent_decode(pass)
                    .ok_or("the password has a bad percent-escape or is not UTF-8")?,
            )
        })
        .transpose()?;
    let (host, port) = match host_port.strip_prefix('[') {
        Some(bracketed) => {
            let (v6, port) = bracketed
                .split_once("]:")
                .ok_or("an IPv6 host is [address]:port")?;
            let address: Ipv6Addr = v6
                .parse()
                .map_err(|_| format!("{v6:?} is not an IPv6 address"))?;
            (address.to_string(), port)
        }
        None => {
            let (host, port) = host_port
                .rsplit_once(':')
                .ok_or("the URL has no port (host:port)")?;
            (host_name(host)?, port)
        }
    };
    Ok(ListedProxy {
        host,
        port: port_number(port)?,
        protocol,
        credentials,
    })
}

/// A host name or IPv4 address as the endpoint takes it: lowercase, `[a-z0-9.-]` (and `_`,
/// which some vendors' names hold). An IPv6 address needs the URL form's brackets.
fn host_name(host: &str) -> Result<String, String> {
    if host.is_empty() {
        return Err("the host is empty".to_owned());
    }
    if host.contains([':', '[', ']']) {
        return Err("an IPv6 host is written scheme://[address]:port".to_owned());
    }
    if host.len() > 253
        || !host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
    {
        return Err(format!("host {host:?} is not a host name or IP address"));
    }
    Ok(host.to_ascii_lowercase())
}

fn port_number(port: &str) -> Result<u16, String> {
    let number: u64 = port
        .parse()
        .map_err(|_| format!("port {port:?} is not a number"))?;
    u16::try_from(number)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| format!("port {number} is not in 1-65535"))
}

/// The user name and password of a line, as a credentials Secret can hold them.
fn credentials(username: &str, password: &str) -> Result<Credentials, String> {
    if username.is_empty() {
        return Err("the user name is empty".to_owned());
    }
    if username.contains(':') {
        return Err("the user name holds ':' (Basic authentication cannot carry it)".to_owned());
    }
    if password.is_empty() {
        return Err("the password is empty".to_owned());
    }
    Ok(Credentials {
        username: username.to_owned(),
        password: password.to_owned(),
    })
}

/// `%XX` escapes decoded; `None` for a malformed escape or a result that is not UTF-8.
fn percent_decode(text: &str) -> Option<String> {
    let mut bytes = Vec::with_capacity(text.len());
    let mut rest = text.as_bytes();
    while let Some((&first, tail)) = rest.split_first() {
        if first == b'%' {
            let (&[high, low], after) = tail.split_first_chunk::<2>()?;
            let digit = |b: u8| char::from(b).to_digit(16);
            bytes.push(u8::try_from(digit(high)? * 16 + digit(low)?).ok()?);
            rest = after;
        } else {
            bytes.push(first);
            rest = tail;
        }
    }
    String::from_utf8(bytes).ok()
}

/// Every proxy of `text` with its 1-based line number, or the first line that is refused.
/// `source` names the list in errors.
pub fn parse_list(text: &str, source: &str) -> Result<Vec<(usize, ListedProxy)>, ImportError> {
    let mut proxies = Vec::new();
    let mut first_line: HashMap<String, usize> = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let number = i + 1;
        let refuse = |reason: String| ImportError::Line {
            list: source.to_owned(),
            line: number,
            reason,
        };
        let Some(proxy) = parse_line(line).map_err(refuse)? else {
            continue;
        };
        let address = proxy.address();
        if let Some(first) = first_line.get(&address) {
            return Err(refuse(format!("{address} repeats line {first}")));
        }
        first_line.insert(address, number);
        proxies.push((number, proxy));
    }
    if proxies.is_empty() {
        return Err(ImportError::Empty {
            list: source.to_owned(),
        });
    }
    Ok(proxies)
}

/// The name of the Proxy for `proxy`: the prefix, `-` and lowercase base32 of SHA-256 over its
/// `host:port`, cut to [`HASH_LEN`] characters.
pub fn proxy_name(prefix: &str, proxy: &ListedProxy) -> String {
    let digest = Sha256::digest(proxy.address().as_bytes());
    let encoded = base32::encode(
        base32::Alphabet::Rfc4648Lower { padding: false },
        &digest[..(HASH_LEN * 5).div_ceil(8)],
    );
    format!("{prefix}-{}", &encoded[..HASH_LEN])
}

/// The Secret holding the credentials of the Proxy named `proxy_name`.
pub fn secret_name(proxy_name: &str) -> String {
    format!("{proxy_name}{SECRET_SUFFIX}")
}

/// The name prefix a list's path gives: its file name without the extension, lowercased,
/// every run of other characters than letters and digits made one `-`, cut to
/// [`MAX_PREFIX_LEN`]; [`DEFAULT_PREFIX`] for stdin (`-`) or when nothing is left.
pub fn default_prefix(path: &str) -> String {
    let stem = std::path::Path::new(path)
        .file_stem()
        .map(|s| s.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default();
    let mut prefix = String::new();
    for c in stem.chars() {
        if c.is_ascii_alphanumeric() {
            prefix.push(c);
        } else if !prefix.is_empty() && !prefix.ends_with('-') {
            prefix.push('-');
        }
    }
    prefix.truncate(MAX_PREFIX_LEN);
    let prefix = prefix.trim_end_matches('-');
    if path == "-" || prefix.is_empty() {
        DEFAULT_PREFIX.to_owned()
    } else {
        prefix.to_owned()
    }
}

/// A `--name-prefix`: a DNS-1123 label of at most [`MAX_PREFIX_LEN`] characters.
pub fn name_prefix(text: &str) -> Result<String, String> {
    if text.is_empty() || text.len() > MAX_PREFIX_LEN || !is_dns_label(text) {
        return Err(format!(
            "{text:?} is not a name prefix: lowercase letters, digits and '-', starting and \
             ending with a letter or digit, at most {MAX_PREFIX_LEN} characters"
        ));
    }
    Ok(text.to_owned())
}

/// A `--namespace`: a DNS-1123 label, as Kubernetes names namespaces.
pub fn namespace(text: &str) -> Result<String, String> {
    if !is_dns_label(text) {
        return Err(format!(
            "{text:?} is not a namespace: at most 63 lowercase letters, digits and '-', \
             starting and ending with a letter or digit"
        ));
    }
    Ok(text.to_owned())
}

/// A `--label key=value`, checked as Kubernetes checks label keys and values.
pub fn label(text: &str) -> Result<(String, String), String> {
    let (key, value) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not key=value"))?;
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if let Some(prefix) = prefix
        && (prefix.len() > 253 || !prefix.split('.').all(is_dns_label))
    {
        return Err(format!("label key {key:?}: prefix is not a DNS subdomain"));
    }
    if name.is_empty() || !is_label_value(name) {
        return Err(format!(
            "label key {key:?}: name is not at most 63 letters, digits, '-', '_' or '.', \
             starting and ending with a letter or digit"
        ));
    }
    if !value.is_empty() && !is_label_value(value) {
        return Err(format!(
            "label value {value:?} is not at most 63 letters, digits, '-', '_' or '.', \
             starting and ending with a letter or digit"
        ));
    }
    Ok((key.to_owned(), value.to_owned()))
}

/// `[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63 characters.
fn is_dns_label(text: &str) -> bool {
    is_bounded_by_alphanumerics(text)
        && text
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// A label value (and a label key's name): `[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?`, at
/// most 63 characters.
fn is_label_value(text: &str) -> bool {
    is_bounded_by_alphanumerics(text)
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

fn is_bounded_by_alphanumerics(text: &str) -> bool {
    let bytes = text.as_bytes();
    match (bytes.first(), bytes.last()) {
        (Some(first), Some(last)) => {
            bytes.len() <= 63 && first.is_ascii_alphanumeric() && last.is_ascii_alphanumeric()
        }
        _ => false,
    }
}

/// The objects of one listed proxy: its credentials Secret (when the line had credentials),
/// then its Proxy.
pub struct Imported {
    /// The credentials Secret, labelled for the operator's watch.
    pub secret: Option<Secret>,
    /// The External Proxy.
    pub proxy: Proxy,
}

/// The objects for every proxy of a list; two proxies whose names collide are refused with
/// both lines (the hash makes it vanishingly rare, and overwriting one with the other would
/// lose a proxy).
pub fn objects(
    listed: &[(usize, ListedProxy)],
    source: &str,
    options: &ImportOptions,
) -> Result<Vec<Imported>, ImportError> {
    let mut first_line: HashMap<String, usize> = HashMap::new();
    let mut imported = Vec::with_capacity(listed.len());
    for (line, proxy) in listed {
        let name = proxy_name(&options.name_prefix, proxy);
        if let Some(first) = first_line.insert(name.clone(), *line) {
            return Err(ImportError::Line {
                list: source.to_owned(),
                line: *line,
                reason: format!("name {name} is also line {first}'s; choose another --name-prefix"),
            });
        }
        imported.push(object(name, proxy, options));
    }
    Ok(imported)
}

fn object(name: String, proxy: &ListedProxy, options: &ImportOptions) -> Imported {
    let metadata = |name: String, extra: Option<(&str, &str)>| {
        let mut labels = options.labels.clone();
        labels.extend(extra.map(|(k, v)| (k.to_owned(), v.to_owned())));
        ObjectMeta {
            name: Some(name),
            namespace: Some(options.namespace.clone()),
            labels: (!labels.is_empty()).then_some(labels),
            ..ObjectMeta::default()
        }
    };
    let secret_ref = proxy.credentials.as_ref().map(|_| SecretRef {
        name: secret_name(&name),
    });
    let secret = proxy.credentials.as_ref().map(|credentials| Secret {
        metadata: metadata(secret_name(&name), Some((CREDENTIALS_SECRET_LABEL, "true"))),
        type_: Some("Opaque".to_owned()),
        data: Some(BTreeMap::from([
            (
                USERNAME_KEY.to_owned(),
                ByteString(credentials.username.clone().into_bytes()),
            ),
            (
                PASSWORD_KEY.to_owned(),
                ByteString(credentials.password.clone().into_bytes()),
            ),
        ])),
        ..Secret::default()
    });
    let spec = ProxySpec {
        mode: Mode::External,
        provider: None,
        endpoint: Some(Endpoint {
            host: proxy.host.clone(),
            port: i32::from(proxy.port),
            credentials_secret_ref: secret_ref,
            protocol: proxy.protocol,
            rotating: None,
        }),
        port: DEFAULT_PORT,
        placement: None,
        cloud_init: None,
        max_leases: options.max_leases,
        cordoned: false,
        max_lifetime: None,
        health_check: HealthCheck::default(),
        exit_check: None,
        cost: None,
    };
    let mut object = Proxy::new(&name, spec);
    object.metadata = metadata(name, None);
    Imported {
        secret,
        proxy: object,
    }
}

/// The YAML of `imported`: each Secret before its Proxy, documents separated by `---`.
pub fn to_yaml(imported: &[Imported]) -> Result<String, serde_saphyr::ser::Error> {
    let mut documents = Vec::with_capacity(imported.len() * 2);
    for Imported { secret, proxy } in imported {
        if let Some(secret) = secret {
            documents.push(serde_saphyr::to_string(secret)?);
        }
        documents.push(serde_saphyr::to_string(proxy)?);
    }
    Ok(documents.join("---\n"))
}

/// What `proxy-operator proxies import` prints for the list `text` named `source`: every
/// object as YAML, or the first reason the list is refused (then nothing).
pub fn render(text: &str, source: &str, options: &ImportOptions) -> Result<String, ImportError> {
    let listed = parse_list(text, source)?;
    let imported = objects(&listed, source, options)?;
    to_yaml(&imported).map_err(|e| ImportError::Render {
        list: source.to_owned(),
        message: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::file::InventoryFile;

    fn http(host: &str, port: u16) -> ListedProxy {
        ListedProxy {
            host: host.to_owned(),
            port,
            protocol: EndpointProtocol::Http,
            credentials: None,
        }
    }

    fn with(mut proxy: ListedProxy, user: &str, pass: &str) -> ListedProxy {
        proxy.credentials = Some(Credentials {
            username: user.to_owned(),
            password: pass.to_owned(),
        });
        proxy
    }

    fn socks5(proxy: ListedProxy) -> ListedProxy {
        ListedProxy {
            protocol: EndpointProtocol::Socks5,
            ..proxy
        }
    }

    fn options() -> ImportOptions {
        ImportOptions {
            namespace: "crawl".to_owned(),
            name_prefix: "acme".to_owned(),
            labels: BTreeMap::from([("vendor".to_owned(), "acme".to_owned())]),
            max_leases: None,
        }
    }

    #[test]
    fn every_line_form_parses() {
        let cases = [
            ("", None),
            ("   ", None),
            ("# a comment", None),
            ("  # indented: user:pass@h:1", None),
            ("10.0.0.1:3128", Some(http("10.0.0.1", 3128))),
            (
                "  Proxy.Example.COM:8080  ",
                Some(http("proxy.example.com", 8080)),
            ),
            (
                "10.0.0.1:3128:alice:s3cret",
                Some(with(http("10.0.0.1", 3128), "alice", "s3cret")),
            ),
            (
                "h.example:1:user:pass:with:colons",
                Some(with(http("h.example", 1), "user", "pass:with:colons")),
            ),
            ("http://h.example:80", Some(http("h.example", 80))),
            ("HTTP://h.example:80/", Some(http("h.example", 80))),
            (
                "http://bob:p%40ss%3Aw%2Fd@h.example:8080",
                Some(with(http("h.example", 8080), "bob", "p@ss:w/d")),
            ),
            (
                "http://us%65r:a@b@h.example:8080",
                Some(with(http("h.example", 8080), "user", "a@b")),
            ),
            (
                "socks5://h.example:1080",
                Some(socks5(http("h.example", 1080))),
            ),
            (
                "socks5h://h.example:1080",
                Some(socks5(http("h.example", 1080))),
            ),
            (
                "socks5://u:p@10.1.2.3:1080",
                Some(socks5(with(http("10.1.2.3", 1080), "u", "p"))),
            ),
            ("http://[::1]:3128", Some(http("::1", 3128))),
            (
                "socks5://u:p@[2001:DB8:0:0::7]:1080",
                Some(socks5(with(http("2001:db8::7", 1080), "u", "p"))),
            ),
            ("http://[fe80::1]:1/", Some(http("fe80::1", 1))),
            ("h_1.example:65535", Some(http("h_1.example", 65535))),
        ];
        for (line, want) in cases {
            assert_eq!(parse_line(line), Ok(want), "{line:?}");
        }
    }

    #[test]
    fn every_bad_line_is_refused_with_its_reason() {
        let cases = [
            ("h.example:x", "port \"x\" is not a number"),
            ("h.example:", "port \"\" is not a number"),
            ("h.example:0", "port 0 is not in 1-65535"),
            ("h.example:65536", "port 65536 is not in 1-65535"),
            ("h.example", FORMS),
            ("h.example:1:user", FORMS),
            (":3128", "the host is empty"),
            ("h.example:1::pass", "the user name is empty"),
            ("h.example:1:user:", "the password is empty"),
            ("h ex:1", "whitespace inside the line"),
            (
                "bad/host:1",
                "host \"bad/host\" is not a host name or IP address",
            ),
            ("::1:3128", "the host is empty"),
            ("https://h.example:443", "scheme \"https\" is not supported"),
            (
                "socks4://h.example:1080",
                "scheme \"socks4\" is not supported",
            ),
            ("http://h.example", "the URL has no port"),
            ("http://h.example:8080/path", "a proxy URL has no path"),
            ("http://h.example:8080?x=1", "a proxy URL has no path"),
            ("http://u:a#b@h.example:8080", "a proxy URL has no path"),
            (
                "http://user@h.example:8080",
                "credentials in a URL are user:password",
            ),
            ("http://:p@h.example:8080", "the user name is empty"),
            ("http://u:@h.example:8080", "the password is empty"),
            ("http://a%3Ab:p@h.example:1", "the user name holds ':'"),
            (
                "http://u:p%zz@h.example:1",
                "the password has a bad percent-escape",
            ),
            (
                "http://u%4:p@h.example:1",
                "the user name has a bad percent-escape",
            ),
            (
                "http://u:%ff@h.example:1",
                "the password has a bad percent-escape",
            ),
            (
                "http://u:%+f@h.example:1",
                "the password has a bad percent-escape",
            ),
            (
                "http://u:%f@h.example:1",
                "the password has a bad percent-escape",
            ),
            ("http://::1:3128", "an IPv6 host is written"),
            ("http://[::1]3128", "an IPv6 host is [address]:port"),
            ("http://[not-v6]:3128", "\"not-v6\" is not an IPv6 address"),
            ("http://[::1]:x", "port \"x\" is not a number"),
            ("http://h.example:99999", "port 99999 is not in 1-65535"),
        ];
        for (line, want) in cases {
            let reason = parse_line(line).expect_err(line);
            assert!(
                reason.starts_with(want),
                "{line:?}: {reason:?}, want {want:?}"
            );
        }
    }

    #[test]
    fn no_reason_repeats_a_password() {
        for line in [
            "h.example:1:user:",
            "h.example:x:user:hunter2",
            "h ex:1:user:hunter2",
            "http://u:hunter2%zz@h.example:1",
            "http://u:hunter2@h.example:1/path",
            "http://u:hunter2@h.example",
            "ftp://u:hunter2@h.example:1",
        ] {
            let reason = parse_line(line).expect_err(line);
            assert!(!reason.contains("hunter2"), "{line:?}: {reason:?}");
        }
    }

    #[test]
    fn a_list_is_refused_at_its_first_bad_line_or_repeat() {
        let list = "# acme\n10.0.0.1:3128\n\n10.0.0.2:x\n";
        assert_eq!(
            parse_list(list, "list.txt").unwrap_err().to_string(),
            "list.txt:4: port \"x\" is not a number"
        );
        let repeat = "10.0.0.1:3128\nH.example:1\nhttp://u:p@h.example:1\n";
        assert_eq!(
            parse_list(repeat, "list.txt").unwrap_err().to_string(),
            "list.txt:3: h.example:1 repeats line 2"
        );
        let v6 = "http://[::1]:1\nsocks5://[0::1]:1\n";
        assert_eq!(
            parse_list(v6, "-").unwrap_err().to_string(),
            "-:2: [::1]:1 repeats line 1"
        );
        assert_eq!(
            parse_list("# nothing\n\n", "empty.txt")
                .unwrap_err()
                .to_string(),
            "empty.txt: holds no proxy"
        );
        let good = parse_list("a:1\r\n\r\n#x\r\nb:2\r\n", "crlf.txt").unwrap();
        assert_eq!(good, [(1, http("a", 1)), (4, http("b", 2))]);
    }

    #[test]
    fn names_are_prefix_and_a_hash_of_the_address() {
        let name = proxy_name("acme", &http("10.0.0.1", 3128));
        assert_eq!(name.len(), "acme-".len() + HASH_LEN);
        assert!(name.starts_with("acme-"), "{name}");
        assert!(is_dns_label(&secret_name(&name)), "{name}");
        // Neither the protocol nor the credentials name the proxy: a line that changes them
        // updates the same Proxy.
        assert_eq!(
            name,
            proxy_name("acme", &socks5(with(http("10.0.0.1", 3128), "u", "p")))
        );
        assert_ne!(name, proxy_name("acme", &http("10.0.0.1", 3129)));
        // The longest prefix still leaves a Secret name that is a DNS-1123 label.
        let longest = "p".repeat(MAX_PREFIX_LEN);
        let secret = secret_name(&proxy_name(&longest, &http("h", 1)));
        assert_eq!(secret.len(), 63);
        assert!(is_dns_label(&secret), "{secret}");
        // Known vector: SHA-256("h:1"), base32, first 10 characters.
        let digest = Sha256::digest(b"h:1");
        let encoded = base32::encode(base32::Alphabet::Rfc4648Lower { padding: false }, &digest);
        assert_eq!(
            proxy_name("x", &http("h", 1)),
            format!("x-{}", &encoded[..10])
        );
    }

    #[test]
    fn ten_thousand_addresses_get_ten_thousand_names() {
        let names: std::collections::HashSet<String> = (0..10_000u32)
            .map(|i| {
                let [a, b, c, d] = i.to_be_bytes();
                proxy_name("p", &http(&format!("{a}.{b}.{c}.{d}"), 3128))
            })
            .collect();
        assert_eq!(names.len(), 10_000);
    }

    #[test]
    fn the_prefix_comes_from_the_file_name() {
        let cases = [
            ("list.txt", "list"),
            ("/data/Acme_EU.proxies.txt", "acme-eu-proxies"),
            ("vendors/--odd--name--", "odd-name"),
            ("-", DEFAULT_PREFIX),
            ("/tmp/..txt", DEFAULT_PREFIX),
            ("___.txt", DEFAULT_PREFIX),
            ("ünïcode.txt", "n-code"),
        ];
        for (path, want) in cases {
            assert_eq!(default_prefix(path), want, "{path}");
            assert_eq!(name_prefix(want).as_deref(), Ok(want), "{path}");
        }
        let long = default_prefix(&format!("{}-{}.txt", "a".repeat(39), "b".repeat(9)));
        assert_eq!(long, "a".repeat(39), "cut to 40 without a trailing '-'");
    }

    #[test]
    fn prefixes_and_labels_are_checked() {
        for bad in [
            "",
            "Acme",
            "-acme",
            "acme-",
            "a_b",
            &"a".repeat(MAX_PREFIX_LEN + 1),
        ] {
            assert!(name_prefix(bad).is_err(), "{bad:?}");
        }
        assert_eq!(namespace("crawl-eu").as_deref(), Ok("crawl-eu"));
        for bad in ["", "Crawl", "crawl.eu", &"n".repeat(64)] {
            assert!(namespace(bad).is_err(), "{bad:?}");
        }
        let good = [
            ("vendor=acme", ("vendor", "acme")),
            ("geo=", ("geo", "")),
            (
                "crawl.example.com/tier=Gold_1.a",
                ("crawl.example.com/tier", "Gold_1.a"),
            ),
        ];
        for (text, (key, value)) in good {
            assert_eq!(
                label(text),
                Ok((key.to_owned(), value.to_owned())),
                "{text}"
            );
        }
        for bad in [
            "vendor",
            "=acme",
            "-vendor=acme",
            "Bad_Prefix/x=y",
            "/x=y",
            "a/b/c=d",
            "vendor=-acme",
            "vendor=a b",
            "a=b=c",
            &format!("k={}", "v".repeat(64)),
        ] {
            assert!(label(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_list_renders_to_proxies_and_secrets_the_inventory_loads() {
        let list = "\
# acme, eu
10.0.0.1:3128
10.0.0.2:3128:alice:s3cret:x
socks5h://bob:p%40ss@[2001:db8::2]:1080
";
        let mut opts = options();
        opts.max_leases = Some(0);
        let yaml = render(list, "acme.txt", &opts).unwrap();
        assert_eq!(yaml.matches("---\n").count(), 4, "{yaml}");
        let file = InventoryFile::new("acme.yaml").unwrap();
        let loaded = file.parse(&yaml).unwrap();
        let endpoints: Vec<(String, i32, EndpointProtocol, Option<String>)> = loaded
            .proxies
            .iter()
            .map(|p| {
                let e = p.spec.endpoint.clone().unwrap();
                (
                    e.host,
                    e.port,
                    e.protocol,
                    e.credentials_secret_ref.map(|r| r.name),
                )
            })
            .collect();
        let name = |p: &ListedProxy| proxy_name("acme", p);
        let second = name(&http("10.0.0.2", 3128));
        let third = name(&http("2001:db8::2", 1080));
        assert_eq!(
            endpoints,
            [
                ("10.0.0.1".to_owned(), 3128, EndpointProtocol::Http, None),
                (
                    "10.0.0.2".to_owned(),
                    3128,
                    EndpointProtocol::Http,
                    Some(secret_name(&second))
                ),
                (
                    "2001:db8::2".to_owned(),
                    1080,
                    EndpointProtocol::Socks5,
                    Some(secret_name(&third))
                ),
            ]
        );
        for proxy in &loaded.proxies {
            assert_eq!(proxy.metadata.namespace.as_deref(), Some("crawl"));
            assert_eq!(
                proxy.labels().get("vendor").map(String::as_str),
                Some("acme")
            );
            assert_eq!(proxy.spec.max_leases, Some(0));
            assert_eq!(proxy.spec.mode, Mode::External);
        }
        let credentials = |name: &str| {
            loaded
                .credentials
                .get(&("crawl".to_owned(), secret_name(name)))
                .cloned()
                .unwrap()
        };
        assert_eq!(credentials(&second).username, "alice");
        assert_eq!(credentials(&second).password, "s3cret:x");
        assert_eq!(credentials(&third).password, "p@ss");
        assert_eq!(loaded.credentials.len(), 2);
        // The password is only in the Secret's base64 data.
        assert!(!yaml.contains("s3cret"), "{yaml}");
    }

    #[test]
    fn secrets_carry_the_watch_label_and_the_options_labels() {
        let listed = parse_list("h.example:1:u:p\n", "l").unwrap();
        let imported = objects(&listed, "l", &options()).unwrap();
        let secret = imported[0].secret.as_ref().unwrap();
        let labels = secret.metadata.labels.clone().unwrap();
        assert_eq!(labels[CREDENTIALS_SECRET_LABEL], "true");
        assert_eq!(labels["vendor"], "acme");
        assert_eq!(secret.type_.as_deref(), Some("Opaque"));
        let without = ImportOptions {
            labels: BTreeMap::new(),
            ..options()
        };
        let imported = objects(&listed, "l", &without).unwrap();
        assert_eq!(imported[0].proxy.metadata.labels, None);
        // Without --max-leases the CRD's default applies: the field is left out.
        let yaml = to_yaml(&imported).unwrap();
        assert!(!yaml.contains("maxLeases"), "{yaml}");
    }
}
