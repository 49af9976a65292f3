//! The exit's country and network, from MaxMind-format database files the user provides
//! (`--geoip-database`, repeatable: a GeoLite2-Country or -City file and a GeoLite2-ASN file,
//! or DB-IP's free equivalents). Each file is read whole at start-up; a file that cannot be
//! read stops the process naming the flag and the file.
//!
//! A lookup asks every file and takes each field from the first file that has it, so one
//! file may give the country and another the autonomous system.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The label whose value [`geo_mismatch`] compares with the exit's country.
pub const GEO_LABEL: &str = "geo";

/// A database file that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("--geoip-database {}: {source}", path.display())]
pub struct GeoIpError {
    path: PathBuf,
    source: maxminddb::MaxMindDbError,
}

/// What the databases say of one address; every field is optional.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExitNetwork {
    /// ISO 3166-1 alpha-2 country code, upper case.
    pub country: Option<String>,
    /// Autonomous system number.
    pub asn: Option<u32>,
    /// The autonomous system's organisation.
    pub organization: Option<String>,
}

/// The fields read of a record, whichever kind of database holds it (Country, City, ASN).
#[derive(Debug, Deserialize)]
struct Record<'a> {
    #[serde(borrow, default)]
    country: Option<Country<'a>>,
    #[serde(borrow, default)]
    registered_country: Option<Country<'a>>,
    #[serde(default)]
    autonomous_system_number: Option<u32>,
    #[serde(borrow, default)]
    autonomous_system_organization: Option<&'a str>,
}

#[derive(Debug, Deserialize)]
struct Country<'a> {
    #[serde(borrow, default)]
    iso_code: Option<&'a str>,
}

/// The databases given, opened.
#[derive(Default)]
pub struct GeoIp {
    databases: Vec<(PathBuf, maxminddb::Reader<Vec<u8>>)>,
}

impl std::fmt::Debug for GeoIp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let paths: Vec<&Path> = self.databases.iter().map(|(p, _)| p.as_path()).collect();
        f.debug_struct("GeoIp").field("databases", &paths).finish()
    }
}

impl GeoIp {
    /// Reads every file of `paths`; the first that cannot be read (missing, unreadable, not
    /// a MaxMind DB) is the error.
    pub fn open(paths: &[PathBuf]) -> Result<GeoIp, GeoIpError> {
        let databases = paths
            .iter()
            .map(|path| {
                maxminddb::Reader::open_readfile(path)
                    .map(|reader| (path.clone(), reader))
                    .map_err(|source| GeoIpError {
                        path: path.clone(),
                        source,
                    })
            })
            .collect::<Result<_, _>>()?;
        Ok(GeoIp { databases })
    }

    /// Whether no database was given (nothing to look up).
    pub fn is_empty(&self) -> bool {
        self.databases.is_empty()
    }

    /// What the databases know of `ip`. A record a database cannot decode is logged and
    /// skipped: it says nothing, it never fails the exit check.
    pub fn lookup(&self, ip: IpAddr) -> ExitNetwork {
        let mut network = ExitNetwork::default();
        for (path, reader) in &self.databases {
            let record = reader
                .lookup(ip)
                .and_then(|found| found.decode::<Record<'_>>());
            let record = match record {
                Ok(Some(record)) => record,
                Ok(None) => continue,
                Err(e) => {
                    log::warn!("{}: cannot read the record of {ip}: {e}", path.display());
                    continue;
                }
            };
            let country = record
                .country
                .and_then(|c| c.iso_code)
                .or_else(|| record.registered_country.and_then(|c| c.iso_code));
            if network.country.is_none() {
                network.country = country.map(str::to_ascii_uppercase);
            }
            if network.asn.is_none() {
                network.asn = record.autonomous_system_number;
            }
            if network.organization.is_none() {
                network.organization = record.autonomous_system_organization.map(str::to_owned);
            }
        }
        network
    }
}

/// The country a `geo` label names, when it names one: two ASCII letters, upper-cased, with
/// `UK` read as `GB` (its ISO code). `EU` is a region, not a country, and longer values
/// (`eu-west`, `europe`) name no country: neither is compared.
pub fn label_country(label: &str) -> Option<String> {
    let code = label.trim().to_ascii_uppercase();
    if code.len() != 2 || !code.bytes().all(|b| b.is_ascii_uppercase()) || code == "EU" {
        return None;
    }
    Some(if code == "UK" { "GB".to_owned() } else { code })
}

/// `(label's country, exit's country)` when the proxy's `geo` label names a country and its
/// exit is in another one; `None` when they agree or either is unknown.
pub fn geo_mismatch(label: Option<&str>, exit_country: Option<&str>) -> Option<(String, String)> {
    let labelled = label_country(label?)?;
    let exit = exit_country?.to_ascii_uppercase();
    (labelled != exit).then_some((labelled, exit))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_two_letter_country_labels_are_compared() {
        let cases = [
            ("same, lower case label", Some("de"), Some("DE"), None),
            ("same, upper case", Some("DE"), Some("DE"), None),
            ("other country", Some("de"), Some("FR"), Some(("DE", "FR"))),
            ("uk is GB", Some("uk"), Some("GB"), None),
            ("uk elsewhere", Some("uk"), Some("IE"), Some(("GB", "IE"))),
            ("eu is a region", Some("eu"), Some("FR"), None),
            ("longer value", Some("eu-west"), Some("FR"), None),
            ("digits", Some("d1"), Some("FR"), None),
            ("no label", None, Some("FR"), None),
            ("country unknown", Some("de"), None, None),
        ];
        for (case, label, country, want) in cases {
            let want = want.map(|(a, b): (&str, &str)| (a.to_owned(), b.to_owned()));
            assert_eq!(geo_mismatch(label, country), want, "{case}");
        }
    }

    #[test]
    fn an_unreadable_file_names_the_flag_and_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("GeoLite2-Country.mmdb");
        let error = GeoIp::open(std::slice::from_ref(&missing)).unwrap_err();
        let text = error.to_string();
        assert!(text.starts_with("--geoip-database "), "{text}");
        assert!(text.contains("GeoLite2-Country.mmdb"), "{text}");
        let garbage = dir.path().join("not-a-database.mmdb");
        std::fs::write(&garbage, b"not a MaxMind DB").unwrap();
        let text = GeoIp::open(&[garbage]).unwrap_err().to_string();
        assert!(text.contains("not-a-database.mmdb"), "{text}");
    }

    #[test]
    fn fields_come_from_whichever_file_has_them() {
        use mmdb_writer::Writer;
        let dir = tempfile::tempdir().unwrap();
        let mut country = Writer::new("GeoLite2-Country");
        country
            .insert(
                "192.0.2.0/24".parse::<ipnet::IpNet>().unwrap(),
                &serde_json::json!({"country": {"iso_code": "de"}}),
            )
            .unwrap();
        // Typed as GeoLite2-ASN has it: the number a uint32.
        #[derive(serde::Serialize)]
        struct Asn {
            autonomous_system_number: u32,
            autonomous_system_organization: &'static str,
        }
        let mut asn = Writer::new("GeoLite2-ASN");
        asn.insert(
            "192.0.2.0/25".parse::<ipnet::IpNet>().unwrap(),
            &Asn {
                autonomous_system_number: 64500,
                autonomous_system_organization: "Example Net",
            },
        )
        .unwrap();
        let paths = [dir.path().join("country.mmdb"), dir.path().join("asn.mmdb")];
        std::fs::write(&paths[0], country.to_bytes().unwrap()).unwrap();
        std::fs::write(&paths[1], asn.to_bytes().unwrap()).unwrap();
        let geoip = GeoIp::open(&paths).unwrap();
        let ip = |text: &str| text.parse::<IpAddr>().unwrap();
        assert_eq!(
            geoip.lookup(ip("192.0.2.7")),
            ExitNetwork {
                country: Some("DE".into()),
                asn: Some(64500),
                organization: Some("Example Net".into()),
            }
        );
        assert_eq!(
            geoip.lookup(ip("192.0.2.200")).country.as_deref(),
            Some("DE")
        );
        assert_eq!(geoip.lookup(ip("198.51.100.1")), ExitNetwork::default());
    }
}
