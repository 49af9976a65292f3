//! Which addresses are not public: the ranges every destination check refuses unless a range
//! is opened, each with the reason a refusal names. One table serves the gateway's check and
//! the ACLs of the squids the operator generates.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::LazyLock;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

/// Why an address is not a public destination (a bounded metric label and the `reason` of a
/// refusal).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// `0.0.0.0/8`, `::`.
    Unspecified,
    /// `127.0.0.0/8`, `::1`.
    Loopback,
    /// `169.254.0.0/16` (the cloud metadata address among them), `fe80::/10`.
    LinkLocal,
    /// RFC 1918 (`10/8`, `172.16/12`, `192.168/16`) and IPv6 site-local `fec0::/10`.
    Private,
    /// `100.64.0.0/10`: carrier-grade NAT, and the node and Pod networks of some clusters.
    SharedAddress,
    /// `fc00::/7`.
    UniqueLocal,
    /// `224.0.0.0/4`, `ff00::/8`.
    Multicast,
    /// `255.255.255.255`.
    Broadcast,
    /// What IANA reserves: protocol assignments, documentation, benchmarking, `240.0.0.0/4`,
    /// the IPv6 discard prefix, Teredo, the local-use NAT64 prefix.
    Reserved,
}

impl Kind {
    /// Every kind, in the order of [`Kind::as_str`]'s documentation.
    pub const ALL: [Kind; 9] = [
        Kind::Unspecified,
        Kind::Loopback,
        Kind::LinkLocal,
        Kind::Private,
        Kind::SharedAddress,
        Kind::UniqueLocal,
        Kind::Multicast,
        Kind::Broadcast,
        Kind::Reserved,
    ];

    /// The reason's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Unspecified => "unspecified",
            Kind::Loopback => "loopback",
            Kind::LinkLocal => "link_local",
            Kind::Private => "private",
            Kind::SharedAddress => "shared_address",
            Kind::UniqueLocal => "unique_local",
            Kind::Multicast => "multicast",
            Kind::Broadcast => "broadcast",
            Kind::Reserved => "reserved",
        }
    }
}

/// The IPv4 ranges refused, with their kind.
const DENIED_V4: [(&str, Kind); 16] = [
    ("0.0.0.0/8", Kind::Unspecified),
    ("10.0.0.0/8", Kind::Private),
    ("100.64.0.0/10", Kind::SharedAddress),
    ("127.0.0.0/8", Kind::Loopback),
    ("169.254.0.0/16", Kind::LinkLocal),
    ("172.16.0.0/12", Kind::Private),
    ("192.0.0.0/24", Kind::Reserved),
    ("192.0.2.0/24", Kind::Reserved),
    ("192.88.99.0/24", Kind::Reserved),
    ("192.168.0.0/16", Kind::Private),
    ("198.18.0.0/15", Kind::Reserved),
    ("198.51.100.0/24", Kind::Reserved),
    ("203.0.113.0/24", Kind::Reserved),
    ("224.0.0.0/4", Kind::Multicast),
    ("255.255.255.255/32", Kind::Broadcast),
    ("240.0.0.0/4", Kind::Reserved),
];

/// The IPv6 ranges refused, with their kind. The prefixes that carry an IPv4 address
/// (IPv4-mapped and -compatible, NAT64's well-known prefix, 6to4) are not here: such an
/// address is judged by the IPv4 address inside ([`embedded_v4`]).
const DENIED_V6: [(&str, Kind); 11] = [
    ("::/128", Kind::Unspecified),
    ("::1/128", Kind::Loopback),
    ("64:ff9b:1::/48", Kind::Reserved),
    ("100::/64", Kind::Reserved),
    ("2001::/32", Kind::Reserved),
    ("2001:2::/48", Kind::Reserved),
    ("2001:db8::/32", Kind::Reserved),
    ("fc00::/7", Kind::UniqueLocal),
    ("fe80::/10", Kind::LinkLocal),
    ("fec0::/10", Kind::Private),
    ("ff00::/8", Kind::Multicast),
];

/// Every denied range, parsed once.
static DENIED: LazyLock<Vec<(IpNet, Kind)>> = LazyLock::new(|| {
    let v4 = DENIED_V4
        .iter()
        .filter_map(|(net, kind)| Some((IpNet::V4(net.parse::<Ipv4Net>().ok()?), *kind)));
    let v6 = DENIED_V6
        .iter()
        .filter_map(|(net, kind)| Some((IpNet::V6(net.parse::<Ipv6Net>().ok()?), *kind)));
    v4.chain(v6).collect()
});

/// The denied ranges, in table order (a squid ACL lists them; the broadcast address is inside
/// `240.0.0.0/4`).
pub fn denied_ranges() -> impl Iterator<Item = (IpNet, Kind)> {
    DENIED.iter().copied()
}

/// A destination address refused, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeniedAddress {
    /// The address as it was found (an IPv4-mapped address stays mapped).
    pub address: IpAddr,
    /// The range it is in.
    pub kind: Kind,
}

/// Whether `address` may be reached: yes when a range of `allowed` holds it, no when it is in
/// a denied range, yes otherwise. An IPv6 address that carries an IPv4 address (`::ffff:a.b.c.d`,
/// `::a.b.c.d`, `64:ff9b::a.b.c.d`, `2002:AABB:CCDD::`) is judged by that IPv4 address.
pub fn check(address: IpAddr, allowed: &[IpNet]) -> Result<(), DeniedAddress> {
    if allowed.iter().any(|net| net.contains(&address)) {
        return Ok(());
    }
    if let IpAddr::V6(v6) = address
        && let Some(v4) = embedded_v4(v6)
    {
        return check(IpAddr::V4(v4), allowed).map_err(|denied| DeniedAddress {
            address,
            kind: denied.kind,
        });
    }
    match DENIED.iter().find(|(net, _)| net.contains(&address)) {
        Some((_, kind)) => Err(DeniedAddress {
            address,
            kind: *kind,
        }),
        None => Ok(()),
    }
}

/// The IPv4 address an IPv6 address carries, for the prefixes that carry one: IPv4-mapped
/// (`::ffff:0:0/96`), IPv4-compatible (`::/96`, but `::` and `::1`), NAT64's well-known prefix
/// (`64:ff9b::/96`) and 6to4 (`2002::/16`, the address in bits 16 to 48).
pub fn embedded_v4(address: Ipv6Addr) -> Option<Ipv4Addr> {
    if let Some(v4) = address.to_ipv4_mapped() {
        return Some(v4);
    }
    let segments = address.segments();
    let low = Ipv4Addr::new(
        (segments[6] >> 8) as u8,
        segments[6] as u8,
        (segments[7] >> 8) as u8,
        segments[7] as u8,
    );
    match segments {
        [0, 0, 0, 0, 0, 0, 0, 0 | 1] => None,
        [0, 0, 0, 0, 0, 0, _, _] => Some(low),
        [0x64, 0xff9b, 0, 0, 0, 0, _, _] => Some(low),
        [0x2002, high, next, ..] => Some(Ipv4Addr::new(
            (high >> 8) as u8,
            high as u8,
            (next >> 8) as u8,
            next as u8,
        )),
        _ => None,
    }
}

/// The IPv6 ranges that carry a denied IPv4 range, for a squid ACL: squid compares IPv4 and
/// IPv4-mapped addresses alike on its own, but NAT64 (`64:ff9b::/96`) and 6to4 (`2002::/16`)
/// are other addresses to it.
pub fn denied_embedding_ranges() -> impl Iterator<Item = (IpNet, Kind)> {
    DENIED
        .iter()
        .filter_map(|(net, kind)| match net {
            IpNet::V4(v4) => Some((v4, *kind)),
            IpNet::V6(_) => None,
        })
        .flat_map(|(v4, kind)| {
            let octets = v4.network().octets();
            let prefix = v4.prefix_len();
            let high = u16::from_be_bytes([octets[0], octets[1]]);
            let low = u16::from_be_bytes([octets[2], octets[3]]);
            let nat64 = Ipv6Net::new(
                Ipv6Addr::new(0x64, 0xff9b, 0, 0, 0, 0, high, low),
                96 + prefix,
            );
            let six_to_four =
                Ipv6Net::new(Ipv6Addr::new(0x2002, high, low, 0, 0, 0, 0, 0), 16 + prefix);
            [nat64, six_to_four]
                .into_iter()
                .filter_map(Result::ok)
                .map(move |net| (IpNet::V6(net.trunc()), kind))
        })
}

/// Parses a list of ranges to open: CIDR ranges (`10.20.0.0/16`, `fd00::/8`) or single
/// addresses (`127.0.0.1`), separated by commas or spaces; empty opens nothing. The error names
/// the entry.
pub fn parse_allowed(text: &str) -> Result<Vec<IpNet>, String> {
    text.split([',', ' '])
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .map(parse_range)
        .collect()
}

/// One range to open: `a.b.c.d/n`, `x::/n`, or a single address. A range with host bits set
/// (`10.20.0.1/16`) is refused: it almost always means another range than it says.
pub fn parse_range(entry: &str) -> Result<IpNet, String> {
    if let Ok(address) = entry.parse::<IpAddr>() {
        return Ok(IpNet::from(address));
    }
    let net: IpNet = entry.parse().map_err(|_| {
        format!("{entry:?} is neither an IP address nor a CIDR range (10.20.0.0/16, fd00::/8)")
    })?;
    if net.trunc() != net {
        return Err(format!(
            "{entry:?} has host bits set: the range is {}",
            net.trunc()
        ));
    }
    Ok(net)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdict(address: &str, allowed: &[&str]) -> Result<(), &'static str> {
        let allowed: Vec<IpNet> = allowed.iter().map(|a| parse_range(a).unwrap()).collect();
        check(address.parse().unwrap(), &allowed).map_err(|d| d.kind.as_str())
    }

    #[test]
    fn every_range_that_is_not_public_is_refused_in_every_spelling() {
        let cases = [
            ("127.0.0.1", Err("loopback")),
            ("127.255.255.254", Err("loopback")),
            ("::1", Err("loopback")),
            ("::ffff:127.0.0.1", Err("loopback")),
            ("::127.0.0.1", Err("loopback")),
            ("64:ff9b::7f00:1", Err("loopback")),
            ("2002:7f00:1::", Err("loopback")),
            ("169.254.169.254", Err("link_local")),
            ("::ffff:169.254.169.254", Err("link_local")),
            ("fe80::1", Err("link_local")),
            ("10.1.2.3", Err("private")),
            ("172.16.0.1", Err("private")),
            ("172.31.255.255", Err("private")),
            ("192.168.1.1", Err("private")),
            ("fec0::1", Err("private")),
            ("100.64.0.1", Err("shared_address")),
            ("100.127.255.255", Err("shared_address")),
            ("fc00::1", Err("unique_local")),
            ("fd00:ec2::254", Err("unique_local")),
            ("0.0.0.0", Err("unspecified")),
            ("0.1.2.3", Err("unspecified")),
            ("::", Err("unspecified")),
            ("224.0.0.1", Err("multicast")),
            ("ff02::1", Err("multicast")),
            ("255.255.255.255", Err("broadcast")),
            ("240.0.0.1", Err("reserved")),
            ("192.0.2.1", Err("reserved")),
            ("198.18.0.1", Err("reserved")),
            ("2001:db8::1", Err("reserved")),
            ("2001::1", Err("reserved")),
            ("100::1", Err("reserved")),
            // Public addresses, and their neighbours just outside the denied ranges.
            ("93.184.216.34", Ok(())),
            ("8.8.8.8", Ok(())),
            ("172.32.0.1", Ok(())),
            ("172.15.255.255", Ok(())),
            ("100.128.0.1", Ok(())),
            ("169.253.255.255", Ok(())),
            ("11.0.0.1", Ok(())),
            ("::ffff:8.8.8.8", Ok(())),
            ("64:ff9b::808:808", Ok(())),
            ("2002:808:808::1", Ok(())),
            ("2606:4700:4700::1111", Ok(())),
            ("2001:4860:4860::8888", Ok(())),
        ];
        for (address, want) in cases {
            assert_eq!(verdict(address, &[]), want, "{address}");
        }
    }

    #[test]
    fn an_opened_range_lets_its_addresses_through_and_nothing_else() {
        let allowed = ["10.20.0.0/16", "127.0.0.1"];
        assert_eq!(verdict("10.20.3.4", &allowed), Ok(()));
        assert_eq!(verdict("127.0.0.1", &allowed), Ok(()));
        // The same address in its IPv4-mapped spelling.
        assert_eq!(verdict("::ffff:127.0.0.1", &allowed), Ok(()));
        assert_eq!(verdict("10.21.0.1", &allowed), Err("private"));
        assert_eq!(verdict("127.0.0.2", &allowed), Err("loopback"));
        assert_eq!(verdict("::1", &allowed), Err("loopback"));
        assert_eq!(verdict("169.254.169.254", &allowed), Err("link_local"));
    }

    #[test]
    fn ranges_to_open_are_parsed_strictly() {
        assert_eq!(
            parse_allowed("10.20.0.0/16, 127.0.0.1,fd00::/8").unwrap(),
            [
                "10.20.0.0/16".parse::<IpNet>().unwrap(),
                "127.0.0.1/32".parse().unwrap(),
                "fd00::/8".parse().unwrap()
            ]
        );
        assert_eq!(parse_allowed("").unwrap(), []);
        for (bad, problem) in [
            ("10.20.0.1/16", "host bits set: the range is 10.20.0.0/16"),
            ("10.20.0.0/33", "neither an IP address nor a CIDR range"),
            ("localhost", "neither an IP address nor a CIDR range"),
            ("10.0.0.0/8,nope", "\"nope\""),
        ] {
            let err = parse_allowed(bad).unwrap_err();
            assert!(err.contains(problem), "{bad}: {err}");
        }
    }

    #[test]
    fn the_ipv6_embeddings_of_denied_ranges_are_listed_for_squid() {
        let ranges: Vec<String> = denied_embedding_ranges()
            .map(|(net, _)| net.to_string())
            .collect();
        for expected in [
            "64:ff9b::7f00:0/104",
            "2002:7f00::/24",
            "64:ff9b::a9fe:0/112",
        ] {
            assert!(
                ranges.iter().any(|r| r == expected),
                "{expected}: {ranges:?}"
            );
        }
        for (net, kind) in denied_embedding_ranges() {
            let IpNet::V6(v6) = net else {
                panic!("{net} is not IPv6")
            };
            let inner = embedded_v4(v6.network()).unwrap();
            assert_eq!(
                check(IpAddr::V4(inner), &[]).map_err(|d| d.kind),
                Err(kind),
                "{net}"
            );
        }
    }
}
