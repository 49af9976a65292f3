//! What status shows of a proxy's exit, as a pure function of the spec, the labels and the
//! exit checker's last report: `exitIP` and when it changed, its country and network, and
//! the `SharedExit` and `GeoMismatch` conditions.

use std::collections::BTreeMap;

use crate::geoip::{GEO_LABEL, geo_mismatch, label_country};
use crate::health::exits::ExitReport;
use crate::resources::proxy::{
    CONDITION_GEO_MISMATCH, CONDITION_SHARED_EXIT, Condition, ConditionStatus, ProxySpec,
    ProxyStatus, set_condition,
};

/// `SharedExit` reason (True): another Ready proxy exits from the same address.
pub const REASON_SHARED_EXIT: &str = "SharedExit";
/// `SharedExit` reason (False): no other Ready proxy exits from this address.
pub const REASON_UNIQUE_EXIT: &str = "UniqueExit";
/// `GeoMismatch` reason (True): the `geo` label names another country than the exit's.
pub const REASON_COUNTRY_DIFFERS: &str = "CountryDiffers";
/// `GeoMismatch` reason (False): the `geo` label names the exit's country.
pub const REASON_COUNTRY_MATCHES: &str = "CountryMatches";

/// Applies `exit` to `status`. Without `spec.exitCheck` every exit field and condition goes;
/// without a report yet (a restart) what status shows is kept. A rotating upstream's sample
/// sets the address and its network, never `exitIPChangedAt` nor `SharedExit`.
/// `GeoMismatch` is set only when the `geo` label names a country (two letters, see
/// [`label_country`]) and the exit's country is known.
pub fn apply_exit(
    status: &mut ProxyStatus,
    spec: &ProxySpec,
    labels: Option<&BTreeMap<String, String>>,
    exit: Option<&ExitReport>,
    generation: Option<i64>,
    now: jiff::Timestamp,
) {
    if spec.exit_check.is_none() {
        status.exit_ip = None;
        status.exit_ip_changed_at = None;
        status.exit_country = None;
        status.exit_asn = None;
        status.exit_organization = None;
        remove_condition(status, CONDITION_SHARED_EXIT);
        remove_condition(status, CONDITION_GEO_MISMATCH);
        return;
    }
    let Some(exit) = exit else {
        return;
    };
    let ip = exit.ip.to_string();
    status.exit_ip = Some(ip.clone());
    status.exit_ip_changed_at = exit.changed_at;
    status.exit_country = exit.network.country.clone();
    status.exit_asn = exit.network.asn.map(i64::from);
    status.exit_organization = exit.network.organization.clone();
    let condition = |type_: &str, value, reason: &str, message: String| Condition {
        type_: type_.to_owned(),
        status: value,
        reason: reason.to_owned(),
        message,
        last_transition_time: now,
        observed_generation: generation,
    };
    if exit.sampled {
        remove_condition(status, CONDITION_SHARED_EXIT);
    } else if exit.shared_with.is_empty() {
        set_condition(
            &mut status.conditions,
            condition(
                CONDITION_SHARED_EXIT,
                ConditionStatus::False,
                REASON_UNIQUE_EXIT,
                format!("no other Ready proxy exits from {ip}"),
            ),
        );
    } else {
        set_condition(
            &mut status.conditions,
            condition(
                CONDITION_SHARED_EXIT,
                ConditionStatus::True,
                REASON_SHARED_EXIT,
                format!("exits from {ip} like {}", exit.shared_with.join(", ")),
            ),
        );
    }
    let label = labels.and_then(|l| l.get(GEO_LABEL)).map(String::as_str);
    let country = exit.network.country.as_deref();
    match (
        geo_mismatch(label, country),
        label.and_then(label_country),
        country,
    ) {
        (Some((labelled, found)), _, _) => set_condition(
            &mut status.conditions,
            condition(
                CONDITION_GEO_MISMATCH,
                ConditionStatus::True,
                REASON_COUNTRY_DIFFERS,
                format!(
                    "label {GEO_LABEL}={} names {labelled}, but the exit {ip} is in {found}",
                    label.unwrap_or_default()
                ),
            ),
        ),
        (None, Some(labelled), Some(_)) => set_condition(
            &mut status.conditions,
            condition(
                CONDITION_GEO_MISMATCH,
                ConditionStatus::False,
                REASON_COUNTRY_MATCHES,
                format!("the exit {ip} is in {labelled}, as label {GEO_LABEL} says"),
            ),
        ),
        _ => remove_condition(status, CONDITION_GEO_MISMATCH),
    }
}

fn remove_condition(status: &mut ProxyStatus, type_: &str) {
    status.conditions.retain(|c| c.type_ != type_);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geoip::ExitNetwork;
    use crate::resources::proxy::ProxyId;

    fn ts(seconds: i64) -> jiff::Timestamp {
        jiff::Timestamp::from_second(seconds).unwrap()
    }

    fn spec(exit_check: bool) -> ProxySpec {
        let mut spec = serde_json::json!({"mode": "External",
                                          "endpoint": {"host": "10.0.0.1", "port": 3128}});
        if exit_check {
            spec["exitCheck"] = serde_json::json!({"url": "https://api.ipify.org"});
        }
        serde_json::from_value(spec).unwrap()
    }

    fn report(ip: &str, country: Option<&str>, shared: &[&str], sampled: bool) -> ExitReport {
        ExitReport {
            id: ProxyId {
                namespace: "crawl".into(),
                name: "a".into(),
                uid: "uid-a".into(),
            },
            ip: ip.parse().unwrap(),
            changed_at: (!sampled).then(|| ts(100)),
            sampled,
            network: ExitNetwork {
                country: country.map(str::to_owned),
                asn: Some(64500),
                organization: Some("Example Net".into()),
            },
            shared_with: shared.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    fn condition<'a>(status: &'a ProxyStatus, type_: &str) -> Option<(&'a str, ConditionStatus)> {
        status
            .condition(type_)
            .map(|c| (c.reason.as_str(), c.status))
    }

    #[test]
    fn exit_conditions_follow_the_report() {
        use ConditionStatus::{False, True};
        // (case, geo label, report, SharedExit, GeoMismatch, message fragment)
        let cases = [
            (
                "unique, country matches",
                Some("de"),
                report("192.0.2.1", Some("DE"), &[], false),
                Some((REASON_UNIQUE_EXIT, False)),
                Some((REASON_COUNTRY_MATCHES, False)),
                "",
            ),
            (
                "shared, country differs",
                Some("DE"),
                report("192.0.2.1", Some("FR"), &["crawl/b"], false),
                Some((REASON_SHARED_EXIT, True)),
                Some((REASON_COUNTRY_DIFFERS, True)),
                "names DE, but the exit 192.0.2.1 is in FR",
            ),
            (
                "region label: not compared",
                Some("eu"),
                report("192.0.2.1", Some("FR"), &[], false),
                Some((REASON_UNIQUE_EXIT, False)),
                None,
                "",
            ),
            (
                "no database: not compared",
                Some("de"),
                report("192.0.2.1", None, &[], false),
                Some((REASON_UNIQUE_EXIT, False)),
                None,
                "",
            ),
            (
                "a rotating sample: never shared",
                None,
                report("192.0.2.1", Some("FR"), &["crawl/b"], true),
                None,
                None,
                "",
            ),
        ];
        for (case, geo, exit, shared, mismatch, message) in cases {
            let labels = geo.map(|g| BTreeMap::from([(GEO_LABEL.to_owned(), g.to_owned())]));
            let mut status = ProxyStatus::default();
            apply_exit(
                &mut status,
                &spec(true),
                labels.as_ref(),
                Some(&exit),
                Some(1),
                ts(200),
            );
            assert_eq!(status.exit_ip.as_deref(), Some("192.0.2.1"), "{case}");
            assert_eq!(status.exit_asn, Some(64500), "{case}");
            assert_eq!(status.exit_ip_changed_at, exit.changed_at, "{case}");
            assert_eq!(condition(&status, CONDITION_SHARED_EXIT), shared, "{case}");
            assert_eq!(
                condition(&status, CONDITION_GEO_MISMATCH),
                mismatch,
                "{case}"
            );
            if !message.is_empty() {
                let text = &status.condition(CONDITION_GEO_MISMATCH).unwrap().message;
                assert!(text.contains(message), "{case}: {text}");
            }
            let before = status.clone();
            apply_exit(
                &mut status,
                &spec(true),
                labels.as_ref(),
                Some(&exit),
                Some(1),
                ts(300),
            );
            assert_eq!(status, before, "{case}: stable on the next pass");
            apply_exit(
                &mut status,
                &spec(true),
                labels.as_ref(),
                None,
                Some(1),
                ts(300),
            );
            assert_eq!(status, before, "{case}: kept without a report");
            apply_exit(
                &mut status,
                &spec(false),
                labels.as_ref(),
                Some(&exit),
                Some(1),
                ts(300),
            );
            assert_eq!(status.exit_ip, None, "{case}: check removed");
            assert!(status.conditions.is_empty(), "{case}");
        }
    }

    #[test]
    fn the_shared_message_names_the_others() {
        let mut status = ProxyStatus::default();
        let exit = report("192.0.2.1", None, &["crawl/b", "crawl/c"], false);
        apply_exit(&mut status, &spec(true), None, Some(&exit), None, ts(1));
        let shared = status.condition(CONDITION_SHARED_EXIT).unwrap();
        assert_eq!(shared.message, "exits from 192.0.2.1 like crawl/b, crawl/c");
    }
}
