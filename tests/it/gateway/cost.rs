//! What the gateway's bytes cost, through the binary: a download through a priced proxy
//! (`spec.cost`, `--cost-currency EUR`), then the spend metrics of the proxy and the tenant and
//! the spend route of the status page agree with the bytes counted × the price, and those
//! bytes with the body within the headers' size.

use std::time::{Duration, Instant};

use serde_json::Value;

use super::traffic::downloaded;
use crate::support::DEADLINE;
use crate::support::fleet::{GATEWAY_FLEET_PER_GB, GATEWAY_FLEET_PER_HOUR, GatewayFleet, TOKEN};
use crate::support::operator::metric_sum;

/// The body downloaded.
const BODY: f64 = 2_000_000.0;
/// What the heads of one request and its answer may add to the body.
const HEADERS: f64 = 4096.0;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1.0)
}

/// The spend route's body, once its day has the tenant `default`'s row.
async fn spend_route(fleet: &GatewayFleet) -> Value {
    let client = crate::support::http::client();
    let started = Instant::now();
    loop {
        let response = client
            .get(format!("{}/v1/status/spend", fleet.operator.api()))
            .bearer_auth(TOKEN)
            .send()
            .await
            .expect("GET /v1/status/spend");
        assert_eq!(response.status(), reqwest::StatusCode::OK);
        let body: Value = response.json().await.expect("a SpendView");
        let carried = body["day"]["tenants"].as_array().is_some_and(|rows| {
            rows.iter()
                .any(|r| r["name"] == "default" && r["bytes"].as_f64() >= Some(BODY))
        });
        if carried {
            return body;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "no day row for the download: {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_download_costs_its_bytes_times_the_price_in_metrics_and_on_the_spend_route() {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let fleet = GatewayFleet::start(dir.path(), 1, &["--cost-currency", "EUR"]).await;
    let proxy = fleet.proxy_url("bill");
    let url = fleet.site.http(&format!("/bytes/{}", BODY as u64));
    assert_eq!(downloaded(&proxy, &[], &url).await as f64, BODY);

    let on_gw0 = ["name=\"gw-0\"", "currency=\"EUR\""];
    let metrics = loop {
        let metrics = fleet.metrics().await;
        if metric_sum(
            &metrics,
            "proxy_operator_proxy_bytes_total",
            &["name=\"gw-0\""],
        ) >= BODY
        {
            break metrics;
        }
        assert!(
            started.elapsed() < DEADLINE * 2,
            "the bytes never came: {metrics}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let bytes = metric_sum(
        &metrics,
        "proxy_operator_proxy_bytes_total",
        &["name=\"gw-0\""],
    );
    assert!((BODY..=BODY + HEADERS).contains(&bytes), "{bytes}");
    let per_gb = bytes / 1e9 * GATEWAY_FLEET_PER_GB;
    let part = |metrics: &str, part: &str| {
        let part = format!("part=\"{part}\"");
        metric_sum(
            metrics,
            "proxy_operator_proxy_spend_total",
            &[on_gw0[0], on_gw0[1], &part],
        )
    };
    assert!(
        close(part(&metrics, "bytes"), per_gb),
        "{per_gb}: {metrics}"
    );
    // Its hours accrue by the second from its first reading, at most this test's time.
    let metrics = loop {
        let metrics = fleet.metrics().await;
        if part(&metrics, "hours") > 0.0 {
            break metrics;
        }
        assert!(
            started.elapsed() < DEADLINE * 2,
            "no hours were priced: {metrics}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let hours = started.elapsed().as_secs_f64() / 3600.0 * GATEWAY_FLEET_PER_HOUR;
    assert!(part(&metrics, "hours") <= hours, "{hours}: {metrics}");
    assert!(
        close(part(&metrics, "bytes"), per_gb),
        "the bytes' part stays: {metrics}"
    );
    // The tenant pays the bytes only.
    let tenant = metric_sum(
        &metrics,
        "proxy_operator_tenant_spend_total",
        &["tenant=\"default\"", "currency=\"EUR\""],
    );
    assert!(close(tenant, per_gb), "{tenant} != {per_gb}: {metrics}");

    // The spend route: the same bytes in the ledger's hourly row, priced the same.
    let body = spend_route(&fleet).await;
    assert_eq!(body["currency"], "EUR");
    // A standalone inventory's proxies have no creation time: they count the whole window.
    for (window, hours) in [("hour", 1.0), ("day", 24.0)] {
        let rows = body[window]["tenants"].as_array().expect("tenants");
        let row = rows
            .iter()
            .find(|r| r["name"] == "default")
            .expect("the tenant's row");
        let row_bytes = row["bytes"].as_f64().expect("bytes");
        assert!(
            (BODY..=BODY + HEADERS).contains(&row_bytes),
            "{window}: {body}"
        );
        let expected = row_bytes / 1e9 * GATEWAY_FLEET_PER_GB;
        assert!(
            close(row["spend"].as_f64().unwrap(), expected),
            "{window}: {body}"
        );
        assert_eq!(row["hoursSpend"], 0.0, "a tenant pays no hours: {body}");
        let gw0 = body[window]["proxies"]
            .as_array()
            .and_then(|rows| rows.iter().find(|r| r["name"] == "default/gw-0"))
            .unwrap_or_else(|| panic!("gw-0's row: {body}"));
        assert!(
            close(gw0["bytesSpend"].as_f64().unwrap(), expected),
            "{body}"
        );
        let hours_spend = gw0["hoursSpend"].as_f64().unwrap();
        assert!(
            hours_spend > 0.0 && hours_spend <= hours * GATEWAY_FLEET_PER_HOUR,
            "{body}"
        );
    }
}
