//! A target's host as the gateway reads it: an IP address in any spelling a resolver would
//! accept (`127.1`, `2130706433`, `0x7f.0.0.1`, `0177.0.0.1`, `[::ffff:127.0.0.1]`), a
//! cloud metadata name, or another name to resolve. Numeric spellings follow the WHATWG URL
//! standard's IPv4 parser (what browsers and `inet_aton` read), so no spelling can stand for
//! another address here than at the upstream.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The cloud metadata servers' names and the address they stand for: a request naming one is
/// judged as that address, without asking DNS (and the generated squids refuse them by name).
pub const METADATA_NAMES: [&str; 5] = [
    "metadata.google.internal",
    "metadata",
    "metadata.goog",
    "instance-data",
    "instance-data.ec2.internal",
];

/// The metadata servers' address (GCP, AWS, Azure).
pub const METADATA_ADDRESS: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);

/// What a target host names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Host {
    /// An address, however spelled.
    Ip(IpAddr),
    /// A cloud metadata server's name.
    Metadata(String),
    /// A name to resolve (lower-cased, without a trailing dot).
    Name(String),
}

/// Reads `host` (a URL's or a CONNECT's host, without brackets). The error says why it is no
/// host at all (a name ending in a number that is no IPv4 address).
pub fn parse(host: &str) -> Result<Host, String> {
    if host.contains(':') {
        return host
            .parse::<Ipv6Addr>()
            .map(|v6| Host::Ip(IpAddr::V6(v6)))
            .map_err(|_| format!("{host:?} is not an IPv6 address"));
    }
    let name = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
    if ends_in_a_number(&name) {
        return ipv4(&name)
            .map(|v4| Host::Ip(IpAddr::V4(v4)))
            .ok_or_else(|| format!("{host:?} ends in a number but is not an IPv4 address"));
    }
    if METADATA_NAMES.contains(&name.as_str()) {
        return Ok(Host::Metadata(name));
    }
    Ok(Host::Name(name))
}

/// Whether the last label is a number (WHATWG "ends in a number"): such a host is an IPv4
/// address or nothing.
fn ends_in_a_number(name: &str) -> bool {
    let last = name.rsplit('.').next().unwrap_or_default();
    if last.is_empty() {
        return false;
    }
    if last.bytes().all(|b| b.is_ascii_digit()) {
        return true;
    }
    last.strip_prefix("0x")
        .is_some_and(|hex| hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// The WHATWG IPv4 parser: one to four parts, each decimal, `0x` hex or `0`-led octal; every
/// part but the last at most 255, the last filling the bytes left.
fn ipv4(name: &str) -> Option<Ipv4Addr> {
    let parts: Vec<&str> = name.split('.').collect();
    if parts.is_empty() || parts.len() > 4 {
        return None;
    }
    let numbers: Vec<u64> = parts.iter().map(|p| number(p)).collect::<Option<_>>()?;
    let (last, leading) = numbers.split_last()?;
    if leading.iter().any(|n| *n > 255) {
        return None;
    }
    let room = 8 * (5 - numbers.len() as u32);
    if *last >= 1u64 << room {
        return None;
    }
    let mut value = *last;
    for (i, n) in leading.iter().enumerate() {
        value += n << (8 * (3 - i as u32));
    }
    u32::try_from(value).ok().map(Ipv4Addr::from)
}

/// One part of a numeric IPv4 spelling (at most 2^32 - 1 as any part may be that large only
/// when alone).
fn number(part: &str) -> Option<u64> {
    let (digits, radix) = if let Some(hex) = part.strip_prefix("0x") {
        (hex, 16)
    } else if part.len() > 1 && part.starts_with('0') {
        (&part[1..], 8)
    } else {
        (part, 10)
    };
    if digits.is_empty() {
        // `0x` alone is zero, as in the standard; an empty part is not.
        return (radix == 16).then_some(0);
    }
    u64::from_str_radix(digits, radix)
        .ok()
        .filter(|n| *n <= u64::from(u32::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> Host {
        Host::Ip(text.parse().unwrap())
    }

    #[test]
    fn every_spelling_of_an_address_is_that_address() {
        let cases = [
            ("127.0.0.1", ip("127.0.0.1")),
            ("127.1", ip("127.0.0.1")),
            ("127.0.1", ip("127.0.0.1")),
            ("2130706433", ip("127.0.0.1")),
            ("0x7f000001", ip("127.0.0.1")),
            ("0x7f.1", ip("127.0.0.1")),
            ("0X7F.0.0.1", ip("127.0.0.1")),
            ("0177.0.0.1", ip("127.0.0.1")),
            ("017700000001", ip("127.0.0.1")),
            ("127.0.0.1.", ip("127.0.0.1")),
            ("0", ip("0.0.0.0")),
            ("0x", ip("0.0.0.0")),
            ("169.254.43518", ip("169.254.169.254")),
            ("2852039166", ip("169.254.169.254")),
            ("0xa9.0xfe.0xa9.0xfe", ip("169.254.169.254")),
            ("::1", ip("::1")),
            ("::ffff:127.0.0.1", ip("::ffff:127.0.0.1")),
            ("::ffff:7f00:1", ip("::ffff:127.0.0.1")),
            (
                "metadata.google.internal",
                Host::Metadata("metadata.google.internal".into()),
            ),
            (
                "METADATA.google.internal.",
                Host::Metadata("metadata.google.internal".into()),
            ),
            ("metadata", Host::Metadata("metadata".into())),
            ("example.com", Host::Name("example.com".into())),
            ("Example.COM.", Host::Name("example.com".into())),
            ("localhost", Host::Name("localhost".into())),
            ("1.2.3.example", Host::Name("1.2.3.example".into())),
            ("0x7f.example", Host::Name("0x7f.example".into())),
            ("a0x1", Host::Name("a0x1".into())),
            ("0x7g", Host::Name("0x7g".into())),
        ];
        for (host, want) in cases {
            assert_eq!(parse(host), Ok(want), "{host}");
        }
    }

    #[test]
    fn a_host_ending_in_a_number_that_is_no_address_is_refused() {
        for host in [
            "256.0.0.1",
            "1.2.3.4.5",
            "1.256.1",
            "4294967296",
            "08.0.0.1",
            "1..1",
            "::zz",
            "example.123",
        ] {
            assert!(parse(host).is_err(), "{host}: {:?}", parse(host));
        }
    }
}
