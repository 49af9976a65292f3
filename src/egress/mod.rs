//! What the fleet may reach: the destination policy of the gateway and of every squid the
//! operator generates. Deny by default, as Stripe's Smokescreen does: a destination is refused
//! when it is not a public address (loopback, link-local with the cloud metadata server,
//! RFC 1918, carrier-grade NAT, unique-local, unspecified, broadcast, multicast, reserved; in
//! every spelling), unless a range is opened.
//!
//! The gateway judges a target before it asks an upstream: an address as spelled, a metadata
//! server's name as its address, any other name by every address it resolves to. The squids
//! judge again after their own resolution (`acl ... dst`, see
//! [`crate::provider::squid_conf`]), so a name that resolves elsewhere a moment later gains
//! nothing on a machine the operator runs; for an External proxy, the gateway's check is the
//! only one.

mod address;
pub mod host;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use address::{
    DeniedAddress, Kind, denied_embedding_ranges, denied_ranges, embedded_v4, parse_allowed,
    parse_range,
};
pub use host::{Host, METADATA_ADDRESS};
pub use ipnet::IpNet;

/// Ranges opened to the fleet (`--gateway-allowed-destinations`, the providers config's
/// `egress.allowedDestinations`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowedRanges(pub Vec<IpNet>);

impl AllowedRanges {
    /// Reads a comma- or space-separated list (see [`parse_allowed`]).
    pub fn parse(text: &str) -> Result<Self, String> {
        parse_allowed(text).map(AllowedRanges)
    }
}

/// How long a name's addresses are reused before it is resolved again.
const RESOLVED_LIFETIME: Duration = Duration::from_secs(10);
/// Most names whose addresses are kept (the table starts over when full).
const RESOLVED_CAPACITY: usize = 4096;
/// Longest wait for the resolver.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a destination is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// The target is, names or resolves to an address in a denied range.
    Denied {
        /// The host as asked for.
        host: String,
        /// The address refused.
        address: IpAddr,
        /// Its range.
        kind: Kind,
    },
    /// The target's name does not resolve (and unresolved names are not passed on).
    Unresolvable {
        /// The name.
        host: String,
        /// What the resolver said.
        problem: String,
    },
}

/// The reason of a refusal for a name that does not resolve (next to [`Kind::as_str`]).
pub const UNRESOLVABLE: &str = "unresolvable";

impl Refused {
    /// The bounded reason: a [`Kind`]'s name, or [`UNRESOLVABLE`].
    pub fn reason(&self) -> &'static str {
        match self {
            Refused::Denied { kind, .. } => kind.as_str(),
            Refused::Unresolvable { .. } => UNRESOLVABLE,
        }
    }

    /// What a person reads.
    pub fn message(&self) -> String {
        match self {
            Refused::Denied {
                host,
                address,
                kind,
            } => {
                let what = if host == &address.to_string() {
                    format!("{address}")
                } else {
                    format!("{host} ({address})")
                };
                format!(
                    "{what} is not a public destination ({}): the gateway does not relay there \
                     unless --gateway-allowed-destinations opens its range",
                    kind.as_str()
                )
            }
            Refused::Unresolvable { host, problem } => format!(
                "{host} does not resolve ({problem}): the gateway relays only to destinations \
                 it can check"
            ),
        }
    }
}

/// The destination policy: the ranges opened, and what to do with a name that does not
/// resolve. Addresses resolved for a name are reused for [`RESOLVED_LIFETIME`].
#[derive(Debug, Default)]
pub struct Destinations {
    allowed: Vec<IpNet>,
    pass_unresolved: bool,
    resolved: Mutex<Resolved>,
}

impl Destinations {
    /// The policy opening `allowed`; with `pass_unresolved`, a name the gateway cannot resolve
    /// goes on to the upstream, which resolves it and is then the only judge.
    pub fn new(allowed: Vec<IpNet>, pass_unresolved: bool) -> Self {
        Destinations {
            allowed,
            pass_unresolved,
            resolved: Mutex::default(),
        }
    }

    /// The ranges opened.
    pub fn allowed(&self) -> &[IpNet] {
        &self.allowed
    }

    /// Whether `host` (connected to on `port`) may be reached.
    pub async fn check(&self, host: &Host, port: u16) -> Result<(), Refused> {
        let denied = |asked: &str, d: DeniedAddress| Refused::Denied {
            host: asked.to_owned(),
            address: d.address,
            kind: d.kind,
        };
        match host {
            Host::Ip(ip) => {
                address::check(*ip, &self.allowed).map_err(|d| denied(&ip.to_string(), d))
            }
            Host::Metadata(name) => address::check(IpAddr::V4(METADATA_ADDRESS), &self.allowed)
                .map_err(|d| denied(name, d)),
            Host::Name(name) => match self.resolve(name, port).await {
                Ok(addresses) => addresses
                    .iter()
                    .try_for_each(|ip| address::check(*ip, &self.allowed))
                    .map_err(|d| denied(name, d)),
                Err(_) if self.pass_unresolved => Ok(()),
                Err(problem) => Err(Refused::Unresolvable {
                    host: name.clone(),
                    problem,
                }),
            },
        }
    }

    /// Every address `name` resolves to (none is an error), from the table while fresh.
    async fn resolve(&self, name: &str, port: u16) -> Result<Vec<IpAddr>, String> {
        if let Some(found) = self.table().get(name, Instant::now()) {
            return found;
        }
        let looked_up =
            tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host((name, port)))
                .await
                .map_err(|_| format!("no answer within {RESOLVE_TIMEOUT:?}"))
                .and_then(|found| found.map_err(|e| e.to_string()))
                .map(|found| found.map(|socket| socket.ip()).collect::<Vec<_>>())
                .and_then(|addresses| {
                    if addresses.is_empty() {
                        Err("no address".to_owned())
                    } else {
                        Ok(addresses)
                    }
                });
        self.table()
            .put(name.to_owned(), looked_up.clone(), Instant::now());
        looked_up
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Resolved> {
        self.resolved
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Names resolved lately and what they resolved to.
#[derive(Debug, Default)]
struct Resolved {
    entries: HashMap<String, (Instant, Result<Vec<IpAddr>, String>)>,
}

impl Resolved {
    fn get(&self, name: &str, now: Instant) -> Option<Result<Vec<IpAddr>, String>> {
        let (at, found) = self.entries.get(name)?;
        (now.saturating_duration_since(*at) < RESOLVED_LIFETIME).then(|| found.clone())
    }

    fn put(&mut self, name: String, found: Result<Vec<IpAddr>, String>, now: Instant) {
        if self.entries.len() >= RESOLVED_CAPACITY && !self.entries.contains_key(&name) {
            self.entries.clear();
        }
        self.entries.insert(name, (now, found));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(allowed: &str) -> Destinations {
        Destinations::new(parse_allowed(allowed).unwrap(), false)
    }

    async fn reason(policy: &Destinations, host: &str) -> Result<(), &'static str> {
        let host = host::parse(host).unwrap();
        policy.check(&host, 80).await.map_err(|r| r.reason())
    }

    #[tokio::test]
    async fn names_are_judged_by_every_address_they_resolve_to() {
        let closed = policy("");
        assert_eq!(reason(&closed, "localhost").await, Err("loopback"));
        assert_eq!(reason(&closed, "2130706433").await, Err("loopback"));
        assert_eq!(
            reason(&closed, "metadata.google.internal").await,
            Err("link_local")
        );
        assert_eq!(reason(&closed, "169.254.169.254").await, Err("link_local"));
        assert_eq!(
            reason(&closed, "no-such-host.invalid").await,
            Err(UNRESOLVABLE)
        );
        // `localhost` is 127.0.0.1 and ::1 here: opening one leaves the other refused.
        let loopback_v4 = policy("127.0.0.0/8");
        assert_eq!(reason(&loopback_v4, "127.0.0.1").await, Ok(()));
        assert_eq!(reason(&loopback_v4, "0x7f.1").await, Ok(()));
        let both = policy("127.0.0.0/8,::1");
        assert_eq!(reason(&both, "localhost").await, Ok(()));
        assert_eq!(reason(&both, "metadata").await, Err("link_local"));
        let passing = Destinations::new(Vec::new(), true);
        assert_eq!(reason(&passing, "no-such-host.invalid").await, Ok(()));
        assert_eq!(reason(&passing, "localhost").await, Err("loopback"));
    }

    #[test]
    fn resolved_names_are_reused_while_fresh_and_the_table_stays_bounded() {
        let mut table = Resolved::default();
        let start = Instant::now();
        let found = Ok(vec!["93.184.216.34".parse().unwrap()]);
        table.put("example.com".into(), found.clone(), start);
        assert_eq!(
            table.get("example.com", start + Duration::from_secs(9)),
            Some(found)
        );
        assert_eq!(table.get("example.com", start + RESOLVED_LIFETIME), None);
        for i in 0..RESOLVED_CAPACITY + 10 {
            table.put(format!("host-{i}"), Err("no".into()), start);
        }
        assert!(table.entries.len() <= RESOLVED_CAPACITY);
    }

    #[test]
    fn a_refusal_says_what_was_refused_and_how_to_open_it() {
        let refused = Refused::Denied {
            host: "metadata.google.internal".into(),
            address: IpAddr::V4(METADATA_ADDRESS),
            kind: Kind::LinkLocal,
        };
        let message = refused.message();
        assert!(
            message.contains("metadata.google.internal (169.254.169.254)")
                && message.contains("link_local")
                && message.contains("--gateway-allowed-destinations"),
            "{message}"
        );
    }
}
