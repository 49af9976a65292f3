//! Headless Chromium crawling through the gateway of the binary: real squids on their own
//! loopback exit addresses in front of the loopback site, Playwright scripts in
//! `tests/python/browser/` driving Debian's Chromium, the ledger read with `sqlite3`.

use serde_json::{Value, json};

use crate::support::browser::{chromium, run_script};
use crate::support::fleet::{GatewayFleet, TOKEN, exit_address};
use crate::support::operator::metric_sum;
use crate::support::site::ASSETS;
use crate::support::{sqlite3, wait_until};

/// Requests the gateway has answered so far, of any kind and outcome.
const REQUESTS: &str = "proxy_operator_gateway_requests_total";

/// The pages `navigate.py` reported.
fn pages(result: &Value) -> &[Value] {
    result["pages"].as_array().expect("a list of pages")
}

/// The responses of subresources `/assets/{n}.*` a page loaded.
fn assets(page: &Value) -> Vec<&Value> {
    let responses = page["responses"].as_array().expect("a list of responses");
    responses
        .iter()
        .filter(|r| {
            r["url"]
                .as_str()
                .is_some_and(|url| url.contains("/assets/"))
        })
        .collect()
}

/// One session crawls HTTP and HTTPS pages, and pages of 20 subresources, through the
/// gateway: every request leaves through the one upstream of the session's one lease (the
/// site sees that squid's exit address), though the fleet has two. Chromium's own rule that
/// loopback skips the proxy is shown first, then lifted with `<-loopback>`.
#[tokio::test]
async fn chromium_crawls_http_and_https_through_the_gateway_on_one_session_exit() {
    if chromium().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let fleet = GatewayFleet::start(dir.path(), 2, &[]).await;
    let server = format!("http://{}", fleet.operator.gateway());

    // `--proxy-server` alone: Chromium goes straight to a loopback site, past the gateway.
    let direct = run_script(
        "navigate.py",
        &json!({"args": [format!("--proxy-server={server}")], "urls": [fleet.site.http("/page/0")]}),
    )
    .await;
    // Through the gateway, without credentials, the page would have been a 407. (Chromium's
    // own background requests do reach the gateway, CONNECTs and at times plain HTTP, each
    // refused with a 407: a browser-wide proxy carries more than the pages, so the gateway's
    // request count says nothing here.)
    assert_eq!(pages(&direct)[0]["status"], 200, "{direct}");
    assert_eq!(pages(&direct)[0]["ip"], "127.0.0.1", "{direct}");

    // The gateway as Playwright's proxy, credentials and session in it, loopback included.
    let mut urls: Vec<String> = (1..=3)
        .map(|n| fleet.site.http(&format!("/page/{n}")))
        .collect();
    urls.extend((1..=3).map(|n| fleet.site.https(&format!("/page/{n}"))));
    urls.extend([fleet.site.http("/assets"), fleet.site.https("/assets")]);
    let crawl = run_script(
        "navigate.py",
        &json!({
            "gateway": {"server": server, "username": "chromium;session=s1", "password": TOKEN},
            "ignore_https_errors": true,
            "urls": urls,
        }),
    )
    .await;

    // The session had one lease, on one proxy: its exit is every page's peer.
    let ledger = fleet.operator.ledger();
    let lease = sqlite3(
        &ledger,
        "SELECT COUNT(*), group_concat(proxy_name) FROM leases WHERE client = 'chromium'",
    );
    let (count, proxy) = lease.split_once('|').expect("count|proxy");
    assert_eq!(count, "1", "one lease for the session: {lease}");
    let index: usize = proxy
        .strip_prefix("gw-")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("a fleet proxy: {proxy}"));
    let exit = exit_address(index).to_string();
    let name = format!("default/{proxy}");
    for page in pages(&crawl) {
        let url = page["url"].as_str().unwrap();
        assert_eq!(page["status"], 200, "{page}");
        assert_eq!(page["errors"], json!([]), "{page}");
        if url.contains("/page/") {
            assert_eq!(page["ip"], exit.as_str(), "{page}");
        }
        // Plain HTTP: the gateway names the upstream on the answer (inside TLS it cannot).
        if url.starts_with("http:") {
            assert_eq!(page["proxy"], name.as_str(), "{page}");
        }
    }

    // Each `/assets` page loaded all 20 subresources, each through the session's exit.
    let asset_pages: Vec<&Value> = pages(&crawl)
        .iter()
        .filter(|p| p["url"].as_str().unwrap().ends_with("/assets"))
        .collect();
    assert_eq!(asset_pages.len(), 2);
    for page in asset_pages {
        assert_eq!(
            (page["images"].as_u64(), page["stylesheets"].as_u64()),
            (Some(8), Some(6))
        );
        assert_eq!(
            page["scripts"],
            json!((14..20).collect::<Vec<_>>()),
            "{page}"
        );
        let loaded = assets(page);
        assert_eq!(loaded.len(), ASSETS, "{page}");
        let plain = page["url"].as_str().unwrap().starts_with("http:");
        for asset in loaded {
            assert_eq!(asset["status"], 200, "{asset}");
            assert_eq!(asset["peer"], exit.as_str(), "{asset}");
            if plain {
                assert_eq!(asset["proxy"], name.as_str(), "{asset}");
            }
        }
    }

    // The squids agree: the session's relayed every plain-HTTP subresource and the HTTPS
    // tunnels; the other relayed nothing for the browser (its log holds only health probes).
    let session_squid = &fleet.squids[index];
    wait_until(
        "the session's squid to log the 20 plain-HTTP assets",
        || session_squid.access_log().matches("/assets/").count() == ASSETS,
    )
    .await;
    assert!(
        session_squid.access_log().contains("CONNECT 127.0.0.1:"),
        "{}",
        session_squid.access_log()
    );
    let other = fleet.squids[1 - index].access_log();
    for seen in ["/page/", "/assets", "CONNECT"] {
        assert!(
            !other.contains(seen),
            "{seen} through the other squid:\n{other}"
        );
    }
    let metrics = fleet.metrics().await;
    let forwarded = metric_sum(
        &metrics,
        REQUESTS,
        &["kind=\"http\"", "outcome=\"forwarded\""],
    );
    assert!(
        forwarded >= (3 + 1 + ASSETS) as f64,
        "{forwarded} forwarded"
    );
    assert!(
        metric_sum(
            &metrics,
            REQUESTS,
            &["kind=\"connect\"", "outcome=\"tunneled\""]
        ) >= 1.0
    );
    assert_eq!(
        metric_sum(&metrics, "proxy_operator_gateway_sessions_active", &[]),
        1.0
    );
}
