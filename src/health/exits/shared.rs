//! Which Ready proxies exit from the same address: a pure function over the exits known, so
//! two External entries behind one NAT, or two VMs given one address, are flagged on both.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use crate::resources::proxy::ProxyId;

/// What the decision needs of one proxy with a known exit.
#[derive(Debug, Clone, Copy)]
pub struct KnownExit<'a> {
    /// The proxy.
    pub id: &'a ProxyId,
    /// Its exit address.
    pub ip: IpAddr,
    /// Whether it is Ready (passing health checks): only Ready proxies share an exit that
    /// matters to crawlers.
    pub ready: bool,
    /// A rotating upstream's sampled exit: one vendor session of many, never flagged.
    pub sampled: bool,
}

/// For every Ready proxy that exits from the same address as another Ready proxy, the
/// `namespace/name` of the others, sorted. Proxies absent from the answer share nothing.
pub fn shared_exits<'a>(
    exits: impl IntoIterator<Item = KnownExit<'a>>,
) -> HashMap<ProxyId, Vec<String>> {
    let mut by_address: BTreeMap<IpAddr, Vec<&ProxyId>> = BTreeMap::new();
    for exit in exits {
        if exit.ready && !exit.sampled {
            by_address.entry(exit.ip).or_default().push(exit.id);
        }
    }
    let mut shared = HashMap::new();
    for ids in by_address.values().filter(|ids| ids.len() > 1) {
        for id in ids {
            let mut others: Vec<String> = ids
                .iter()
                .filter(|other| *other != id)
                .map(|other| other.key())
                .collect();
            others.sort();
            shared.insert((*id).clone(), others);
        }
    }
    shared
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(name: &str) -> ProxyId {
        ProxyId {
            namespace: "crawl".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
        }
    }

    #[test]
    fn ready_proxies_on_one_address_name_each_other() {
        let ids: Vec<ProxyId> = ["a", "b", "c", "d", "e", "f"].map(id).to_vec();
        let ip = |text: &str| text.parse::<IpAddr>().unwrap();
        let exit = |n: usize, address: &str, ready: bool, sampled: bool| KnownExit {
            id: &ids[n],
            ip: ip(address),
            ready,
            sampled,
        };
        // (case, exits, expected: proxy → others)
        type Expected<'a> = Vec<(&'a str, Vec<&'a str>)>;
        let cases: Vec<(&str, Vec<KnownExit>, Expected)> = vec![
            (
                "distinct exits",
                vec![
                    exit(0, "192.0.2.1", true, false),
                    exit(1, "192.0.2.2", true, false),
                ],
                vec![],
            ),
            (
                "two on one address",
                vec![
                    exit(0, "192.0.2.1", true, false),
                    exit(1, "192.0.2.1", true, false),
                    exit(2, "192.0.2.2", true, false),
                ],
                vec![("a", vec!["crawl/b"]), ("b", vec!["crawl/a"])],
            ),
            (
                "three on one address",
                vec![
                    exit(2, "192.0.2.9", true, false),
                    exit(0, "192.0.2.9", true, false),
                    exit(1, "192.0.2.9", true, false),
                ],
                vec![
                    ("a", vec!["crawl/b", "crawl/c"]),
                    ("b", vec!["crawl/a", "crawl/c"]),
                    ("c", vec!["crawl/a", "crawl/b"]),
                ],
            ),
            (
                "one of the two not Ready",
                vec![
                    exit(0, "192.0.2.1", true, false),
                    exit(1, "192.0.2.1", false, false),
                ],
                vec![],
            ),
            (
                "a rotating upstream's sample is never flagged",
                vec![
                    exit(0, "192.0.2.1", true, false),
                    exit(3, "192.0.2.1", true, true),
                ],
                vec![],
            ),
            (
                "IPv6 and two pairs",
                vec![
                    exit(0, "2001:db8::1", true, false),
                    exit(1, "2001:db8::1", true, false),
                    exit(4, "192.0.2.5", true, false),
                    exit(5, "192.0.2.5", true, false),
                ],
                vec![
                    ("a", vec!["crawl/b"]),
                    ("b", vec!["crawl/a"]),
                    ("e", vec!["crawl/f"]),
                    ("f", vec!["crawl/e"]),
                ],
            ),
        ];
        for (case, exits, expected) in cases {
            let shared = shared_exits(exits);
            let mut got: Vec<(String, Vec<String>)> = shared
                .into_iter()
                .map(|(id, others)| (id.name, others))
                .collect();
            got.sort();
            let expected: Vec<(String, Vec<String>)> = expected
                .into_iter()
                .map(|(name, others)| {
                    (
                        name.to_owned(),
                        others.into_iter().map(str::to_owned).collect(),
                    )
                })
                .collect();
            assert_eq!(got, expected, "{case}");
        }
    }
}
