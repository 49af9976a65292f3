//! What one request asks for: who (the token's caller and the user part's options), and the
//! target (its host, as the destination policy reads it, and its port).

use hyper::{Method, Uri};

use super::user::Options;
use crate::egress::host::{self, Host};
use crate::serving::sessions::SessionKey;
use crate::serving::tokens::Caller;

/// What a request is for: the target host and the port on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// Lower-cased host, an address in its usual spelling: the lease's target and the
    /// cooldown key.
    pub host: String,
    /// The port on the target.
    pub port: u16,
    /// What the host names, for the destination policy.
    pub destination: Host,
}

/// Why a request names no target the gateway relays to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetError {
    /// A malformed or unsupported request (400).
    Bad(&'static str),
    /// A port outside `--gateway-allowed-ports` (403).
    PortNotAllowed(u16),
    /// A host that is no host (400): a name ending in a number that is no IPv4 address.
    BadHost(String),
}

impl Target {
    /// The target of a `CONNECT host:port` or of an absolute-form `http://` request, if it is
    /// one the gateway relays to.
    pub fn of(method: &Method, uri: &Uri, allowed_ports: &[u16]) -> Result<Target, TargetError> {
        use TargetError::Bad;
        let (host, port) = if method == Method::CONNECT {
            let authority = uri.authority().ok_or(Bad("CONNECT needs host:port"))?;
            let port = authority.port_u16().ok_or(Bad("CONNECT needs host:port"))?;
            (authority.host(), port)
        } else {
            match uri.scheme_str() {
                Some("http") => {}
                Some(_) => {
                    return Err(Bad(
                        "only http:// is forwarded as is; use CONNECT for https",
                    ));
                }
                None => {
                    return Err(Bad(
                        "this is a forward proxy: send an absolute URL (GET http://host/path) \
                         or CONNECT host:port",
                    ));
                }
            }
            let authority = uri.authority().ok_or(Bad("the URL has no host"))?;
            (authority.host(), authority.port_u16().unwrap_or(80))
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(Bad("the target has no host"));
        }
        if !allowed_ports.contains(&port) {
            return Err(TargetError::PortNotAllowed(port));
        }
        let destination = host::parse(host).map_err(TargetError::BadHost)?;
        let host = match &destination {
            Host::Ip(ip) => ip.to_string(),
            Host::Metadata(_) | Host::Name(_) => host.to_ascii_lowercase(),
        };
        Ok(Target {
            host,
            port,
            destination,
        })
    }

    /// `host:port`, as a CONNECT names it (brackets around an IPv6 host).
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// One request's question: who asks, with which options, for which target.
#[derive(Debug, Clone)]
pub struct Ask {
    /// The token's identity and its tenant.
    pub caller: Caller,
    /// The user part's options.
    pub options: Options,
    /// The target.
    pub target: Target,
}

impl Ask {
    pub(super) fn session_key(&self) -> Option<SessionKey> {
        self.options.session.as_ref().map(|name| SessionKey {
            token: self.caller.token.clone(),
            name: name.clone(),
        })
    }

    /// The selector in canonical form (`k=v,k=v`, sorted): part of a session's identity.
    pub(super) fn selector_text(&self) -> String {
        self.options
            .selector
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
    }
}
