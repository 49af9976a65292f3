//! Exit checks end to end: the real `proxy-operator standalone` binary, real squids leaving
//! from different loopback addresses (`tcp_outgoing_address`), a loopback echo target that
//! answers the caller's address, a MaxMind-format database written for the test, and the
//! ledger file read with `sqlite3` — driven through the API and the metrics endpoint only.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support;
use support::echo::EchoTarget;
use support::standalone::Standalone;
use support::{DEADLINE, Squid, SquidOptions, sqlite3};

const TOKEN: &str = "exits-secret-0123456789abcdef";

/// A squid leaving from `127.0.0.<last>`.
fn squid_from(last: u8) -> Squid {
    Squid::start_with(SquidOptions {
        address: Some(Ipv4Addr::new(127, 0, 0, last)),
        ..SquidOptions::default()
    })
}

fn proxy_doc(name: &str, geo: Option<&str>, squid: &Squid, echo: &str) -> String {
    let labels = geo.map(|g| format!("geo: {g}")).unwrap_or_default();
    format!(
        "apiVersion: crawl.example.com/v1alpha1
kind: Proxy
metadata:
  name: {name}
  labels: {{{labels}}}
spec:
  mode: External
  endpoint: {{host: '{host}', port: {port}}}
  healthCheck: {{probeURL: '{echo}', interval: 500ms, timeout: 500ms}}
  exitCheck: {{url: '{echo}', interval: 1s, timeout: 1s}}
---
",
        host = squid.address(),
        port = squid.port(),
    )
}

/// Country and ASN records for two loopback exits, `127.0.0.<first>` in Germany and the next
/// one in France, as GeoLite2-Country and -ASN files hold them.
fn write_databases(dir: &std::path::Path, first: u8) -> (std::path::PathBuf, std::path::PathBuf) {
    #[derive(serde::Serialize)]
    struct Country {
        country: IsoCode,
    }
    #[derive(serde::Serialize)]
    struct IsoCode {
        iso_code: &'static str,
    }
    #[derive(serde::Serialize)]
    struct Asn {
        autonomous_system_number: u32,
        autonomous_system_organization: &'static str,
    }
    let mut countries = mmdb_writer::Writer::new("GeoLite2-Country");
    let mut asns = mmdb_writer::Writer::new("GeoLite2-ASN");
    for (last, iso_code, organization) in
        [(first, "DE", "Exit Net A"), (first + 1, "FR", "Exit Net B")]
    {
        let network: ipnet::IpNet = format!("127.0.0.{last}/32").parse().unwrap();
        let number = 64500 + u32::from(last);
        countries
            .insert(
                network,
                &Country {
                    country: IsoCode { iso_code },
                },
            )
            .unwrap();
        asns.insert(
            network,
            &Asn {
                autonomous_system_number: number,
                autonomous_system_organization: organization,
            },
        )
        .unwrap();
    }
    let country = dir.join("GeoLite2-Country.mmdb");
    let asn = dir.join("GeoLite2-ASN.mmdb");
    std::fs::write(&country, countries.to_bytes().unwrap()).unwrap();
    std::fs::write(&asn, asns.to_bytes().unwrap()).unwrap();
    (country, asn)
}

/// The exit of every proxy on the proxies page, by name.
async fn exits(operator: &Standalone) -> BTreeMap<String, Value> {
    let body: Value = support::http::client()
        .get(format!("{}/v1/status/proxies", operator.api()))
        .bearer_auth(TOKEN)
        .send()
        .await
        .and_then(|r| r.error_for_status())
        .map(|r| r.json())
        .expect("the proxies view")
        .await
        .unwrap_or_default();
    body["proxies"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|row| !row["exit"].is_null())
        .map(|row| {
            (
                row["name"].as_str().unwrap_or_default().to_owned(),
                row["exit"].clone(),
            )
        })
        .collect()
}

/// Polls the exits until `done` holds, panicking with the last view after [`DEADLINE`].
async fn wait_exits(
    operator: &Standalone,
    what: &str,
    done: impl Fn(&BTreeMap<String, Value>) -> bool,
) -> BTreeMap<String, Value> {
    let start = Instant::now();
    loop {
        let seen = exits(operator).await;
        if done(&seen) {
            return seen;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "{what}: not within {DEADLINE:?}; exits: {seen:#?}\nlog:\n{}",
            operator.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exits_are_checked_shared_ones_flagged_and_changes_recorded_once() {
    let dir = tempfile::tempdir().unwrap();
    let echo = EchoTarget::start();
    let ca = dir.path().join("echo-ca.pem");
    std::fs::write(&ca, echo.ca_cert_pem()).unwrap();
    let (a_squid, b_squid) = (squid_from(71), squid_from(72));
    let url = echo.https_url();
    // a and b leave from their own squids; c is a second entry for b's squid (one NAT).
    let inventory = [
        proxy_doc("a", Some("de"), &a_squid, &url),
        proxy_doc("b", Some("de"), &b_squid, &url),
        proxy_doc("c", None, &b_squid, &url),
    ];
    let (country_db, asn_db) = write_databases(dir.path(), 71);
    let mut operator = Standalone::start_inventory(
        dir.path(),
        &inventory.concat(),
        &ca,
        TOKEN,
        &[
            "--geoip-database",
            country_db.to_str().unwrap(),
            "--geoip-database",
            asn_db.to_str().unwrap(),
            "--inventory-poll",
            "100ms",
        ],
    );
    operator.wait_healthy(TOKEN, 3, DEADLINE).await;

    let seen = wait_exits(&operator, "three exits, b and c flagged", |seen| {
        seen.len() == 3
            && seen["b"]["sharedWith"] == serde_json::json!(["default/c"])
            && seen["c"]["sharedWith"] == serde_json::json!(["default/b"])
    })
    .await;
    assert_eq!(seen["a"]["ip"], "127.0.0.71");
    assert_eq!(seen["a"]["sharedWith"], serde_json::json!([]));
    assert_eq!(seen["b"]["ip"], "127.0.0.72");
    assert_eq!(seen["c"]["ip"], "127.0.0.72");
    // Country and network from the two files.
    assert_eq!(seen["a"]["country"], "DE");
    assert_eq!(seen["a"]["asn"], 64571);
    assert_eq!(seen["a"]["organization"], "Exit Net A");
    assert_eq!(seen["b"]["country"], "FR");
    assert_eq!(seen["b"]["asn"], 64572);
    // b is labelled geo=de but exits in France; a's label agrees; c has none.
    assert_eq!(
        seen["b"]["geoMismatch"],
        "label geo names DE, the exit is in FR"
    );
    assert!(seen["a"].get("geoMismatch").is_none(), "{seen:#?}");
    assert!(seen["c"].get("geoMismatch").is_none(), "{seen:#?}");

    // The metrics: one info series per proxy, two proxies flagged.
    let metrics = support::http::client()
        .get(operator.metrics_url())
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains(
            r#"proxy_operator_proxy_exit_info{asn="64571",country="DE",exit_ip="127.0.0.71",name="a",namespace="default"} 1"#
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains("proxy_operator_shared_exit_proxies 2"),
        "{metrics}"
    );

    // The same in Chromium: the exit filter, the exit column, a proxy's page, axe-core.
    if support::browser::chromium().is_some()
        && let Some(axe) = support::browser::axe_core()
    {
        let seen = support::browser::run_script(
            "exit_pages.py",
            &serde_json::json!({"base": operator.api(), "token": TOKEN, "proxy": "default/b",
                                "axe": axe}),
        )
        .await;
        let shared = seen["shared"].as_object().unwrap();
        let names: Vec<&String> = shared.keys().collect();
        assert_eq!(names, ["default/b", "default/c"], "{seen}");
        let b = shared["default/b"].as_str().unwrap();
        for part in ["127.0.0.72", "FR", "AS64572", "shared", "geo mismatch"] {
            assert!(b.contains(part), "{part} in {b:?}: {seen}");
        }
        assert_eq!(
            seen["by_country"],
            serde_json::json!(["default/a"]),
            "{seen}"
        );
        let page = seen["proxy_page"].as_str().unwrap();
        for part in [
            "127.0.0.72",
            "Exit Net B",
            "default/c",
            "names DE, the exit is in FR",
        ] {
            assert!(page.contains(part), "{part} on the proxy's page: {page}");
        }
        for (path, violations) in seen["violations"].as_object().unwrap() {
            assert_eq!(violations, &serde_json::json!([]), "axe-core on {path}");
        }
        assert_eq!(seen["errors"], serde_json::json!([]), "{seen}");
    }

    // a moves to b's squid: its exit changes once, however many checks follow.
    let moved = [
        proxy_doc("a", Some("de"), &b_squid, &url),
        inventory[1].clone(),
        inventory[2].clone(),
    ];
    let next = dir.path().join("inventory.yaml.next");
    std::fs::write(&next, moved.concat()).unwrap();
    std::fs::rename(&next, dir.path().join("inventory.yaml")).unwrap();
    let seen = wait_exits(&operator, "a exits from b's address", |seen| {
        seen.get("a").is_some_and(|a| {
            a["ip"] == "127.0.0.72"
                && a["sharedWith"] == serde_json::json!(["default/b", "default/c"])
        })
    })
    .await;
    let changed_at = seen["a"]["changedAt"].clone();
    let checked_at = seen["a"]["checkedAt"].clone();
    // Three more checks of a at the same exit.
    let mut checks = 0;
    let mut last_checked = checked_at;
    while checks < 3 {
        let seen = wait_exits(&operator, "another check of a", |seen| {
            seen.get("a")
                .is_some_and(|a| a["checkedAt"] != last_checked)
        })
        .await;
        assert_eq!(
            seen["a"]["changedAt"], changed_at,
            "a check at the same exit changes nothing"
        );
        last_checked = seen["a"]["checkedAt"].clone();
        checks += 1;
    }
    let ledger = operator.ledger();
    let history = sqlite3(
        &ledger,
        "SELECT coalesce(previous_ip, '-') || ' ' || exit_ip || ' ' || coalesce(country, '-') \
         FROM exit_changes WHERE proxy_name = 'a' ORDER BY seq",
    );
    assert_eq!(history, "- 127.0.0.71 DE\n127.0.0.71 127.0.0.72 FR");
    let others = sqlite3(
        &ledger,
        "SELECT proxy_name, count(*) FROM exit_changes WHERE proxy_name <> 'a' \
         GROUP BY proxy_name ORDER BY proxy_name",
    );
    assert_eq!(others, "b|1\nc|1");

    // The proxy's page lists the same history, newest first.
    let detail: Value = support::http::client()
        .get(format!("{}/v1/status/proxies/default/a", operator.api()))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let changes: Vec<&str> = detail["exitChanges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["exitIP"].as_str().unwrap())
        .collect();
    assert_eq!(changes, ["127.0.0.72", "127.0.0.71"]);
}

#[test]
fn an_unreadable_geoip_database_stops_start_up_naming_the_flag_and_file() {
    let dir = tempfile::tempdir().unwrap();
    let broken = dir.path().join("GeoLite2-ASN.mmdb");
    std::fs::write(&broken, "not a database").unwrap();
    std::fs::write(dir.path().join("inventory.yaml"), "").unwrap();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_proxy-operator"))
        .args(["standalone", "--inventory"])
        .arg(dir.path().join("inventory.yaml"))
        .arg("--ledger")
        .arg(dir.path().join("ledger.db"))
        .arg("--geoip-database")
        .arg(&broken)
        .args([
            "--discovery-addr",
            "127.0.0.1:0",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .env("DISCOVERY_TOKEN", TOKEN)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--geoip-database") && stderr.contains("GeoLite2-ASN.mmdb"),
        "{stderr}"
    );
}

/// On a real API server: `proxy-operator run` writes the exits to status — `exitIP`,
/// `exitIPChangedAt`, country and network — with `SharedExit` on the two proxies behind one
/// squid naming each other and `GeoMismatch` on the one labelled `geo=de` that exits in France.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_writes_exits_and_their_conditions_to_status() {
    use support::world::{World, eventually};
    let Some(world) = World::new("exits").await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let echo = EchoTarget::start();
    let (x_squid, y_squid) = (squid_from(73), squid_from(74));
    let (country_db, asn_db) = write_databases(dir.path(), 73);
    let _operator = world
        .operator(&[
            "--geoip-database",
            country_db.to_str().unwrap(),
            "--geoip-database",
            asn_db.to_str().unwrap(),
        ])
        .await;
    // x and y leave from their own squids; z is a second entry for y's squid.
    for (name, geo, squid) in [
        ("x", Some("de"), &x_squid),
        ("y", Some("de"), &y_squid),
        ("z", None, &y_squid),
    ] {
        let labels = match geo {
            Some(geo) => serde_json::json!({"geo": geo}),
            None => serde_json::json!({}),
        };
        let object: kube::api::DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "crawl.example.com/v1alpha1",
            "kind": "Proxy",
            "metadata": {"name": name, "labels": labels},
            "spec": {
                "mode": "External",
                "endpoint": {"host": squid.address().to_string(), "port": squid.port()},
                "healthCheck": world.health_check("2s"),
                "exitCheck": {"url": echo.http_url(), "interval": "2s", "timeout": "2s"},
            },
        }))
        .unwrap();
        world
            .raw_proxies()
            .create(&kube::api::PostParams::default(), &object)
            .await
            .unwrap_or_else(|e| panic!("create {name}: {e}"));
    }
    let condition = |status: &Value, kind: &str| -> Option<(String, String, String)> {
        status["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == kind)
            .map(|c| {
                let text = |key: &str| c[key].as_str().unwrap_or_default().to_owned();
                (text("status"), text("reason"), text("message"))
            })
    };
    let statuses = eventually("exits and their conditions in status", || async {
        let mut statuses = BTreeMap::new();
        for name in ["x", "y", "z"] {
            let proxy = world.proxies().get(name).await.ok()?;
            statuses.insert(name, serde_json::to_value(proxy.status?).ok()?);
        }
        let shared = |name: &str| condition(&statuses[name], "SharedExit").map(|c| c.0);
        let ready = statuses.values().all(|s| s["exitIP"].is_string())
            && shared("x").as_deref() == Some("False")
            && shared("y").as_deref() == Some("True")
            && shared("z").as_deref() == Some("True");
        ready.then_some(statuses)
    })
    .await;
    let (x, y, z) = (&statuses["x"], &statuses["y"], &statuses["z"]);
    assert_eq!(x["exitIP"], "127.0.0.73", "{x}");
    assert_eq!(x["exitCountry"], "DE", "{x}");
    assert_eq!(x["exitASN"], 64573, "{x}");
    assert_eq!(x["exitOrganization"], "Exit Net A", "{x}");
    assert!(x["exitIPChangedAt"].is_string(), "{x}");
    assert_eq!(y["exitIP"], "127.0.0.74", "{y}");
    assert_eq!(y["exitCountry"], "FR", "{y}");
    let (_, reason, message) = condition(y, "SharedExit").unwrap();
    assert_eq!(reason, "SharedExit");
    assert!(
        message.ends_with(&format!("like {}/z", world.ns)),
        "{message}"
    );
    let (_, _, message) = condition(z, "SharedExit").unwrap();
    assert!(
        message.ends_with(&format!("like {}/y", world.ns)),
        "{message}"
    );
    let mismatch = condition(y, "GeoMismatch").expect("GeoMismatch on y");
    assert_eq!(mismatch.0, "True");
    assert_eq!(mismatch.1, "CountryDiffers");
    assert!(
        mismatch
            .2
            .contains("names DE, but the exit 127.0.0.74 is in FR"),
        "{mismatch:?}"
    );
    assert_eq!(
        condition(x, "GeoMismatch").map(|c| c.1).as_deref(),
        Some("CountryMatches")
    );
    assert_eq!(condition(z, "GeoMismatch"), None, "no geo label on z");
}
