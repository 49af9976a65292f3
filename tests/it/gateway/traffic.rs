//! Bytes through the gateway per proxy, against what the target and the crawler sent: plain
//! HTTP answers and request bodies, and a CONNECT tunnel's bytes (TLS included), each in the
//! series of the proxy that carried them; a proxy that carried nothing has none.

use std::time::Instant;

use super::curl;
use crate::support::DEADLINE;
use crate::support::fleet::GatewayFleet;
use crate::support::operator::metric_sum;

const PROXY_BYTES: &str = "proxy_operator_proxy_bytes_total";
/// What a tunnel may carry beyond the bodies: the TLS handshake (the site's certificate
/// chain), record framing and the HTTP heads.
const TUNNEL_OVERHEAD: f64 = 16_384.0;

/// `gw-N`'s bytes in `direction` in `metrics`.
fn proxy_bytes(metrics: &str, n: usize, direction: &str) -> f64 {
    let name = format!("name=\"gw-{n}\"");
    let direction = format!("direction=\"{direction}\"");
    metric_sum(metrics, PROXY_BYTES, &[&name, &direction, "pool=\"\""])
}

/// The bytes of `url`'s answer body curl received through `proxy`, with `options`.
async fn downloaded(proxy: &str, options: &[&str], url: &str) -> u64 {
    let mut args = vec![
        "-sS",
        "-o",
        "/dev/null",
        "-w",
        "%{size_download}",
        "-x",
        proxy,
    ];
    args.extend_from_slice(options);
    args.push(url);
    let (code, out, err) = curl(&args).await;
    assert_eq!(code, 0, "{url}: {err}");
    out.parse().unwrap_or_else(|_| panic!("{url}: {out}"))
}

#[tokio::test]
async fn bytes_are_counted_per_proxy_as_the_target_and_the_crawler_sent_them() {
    let dir = tempfile::tempdir().unwrap();
    let slot = |i: usize| vec![("slot".to_owned(), format!("s{i}"))];
    let fleet = GatewayFleet::start_labelled(dir.path(), 2, slot, &[]).await;

    // No proxy carried anything yet.
    let metrics = fleet.metrics().await;
    assert!(!metrics.contains(PROXY_BYTES), "{metrics}");

    // Through gw-0 only: 300,000 bytes down; 50,000 up and echoed back; then 200,000 down
    // inside a TLS tunnel.
    let proxy = fleet.proxy_url("bytes;slot=s0");
    assert_eq!(
        downloaded(&proxy, &[], &fleet.site.http("/bytes/300000")).await,
        300_000
    );
    let body = dir.path().join("body");
    std::fs::write(&body, vec![b'x'; 50_000]).unwrap();
    let upload = format!("@{}", body.display());
    let echo = fleet.site.http("/echo");
    let posted = downloaded(&proxy, &["--data-binary", &upload], &echo).await;
    assert_eq!(posted, 50_000);
    let ca = dir.path().join("site-ca.pem");
    let tunnelled = ["-p", "--cacert", ca.to_str().unwrap()];
    let https = fleet.site.https("/bytes/200000");
    assert_eq!(downloaded(&proxy, &tunnelled, &https).await, 200_000);

    // Counted as each answer and the tunnel ended: poll until the bodies are in.
    let bodies_down = 300_000.0 + 50_000.0 + 200_000.0;
    let started = Instant::now();
    let metrics = loop {
        let metrics = fleet.metrics().await;
        if proxy_bytes(&metrics, 0, "down") >= bodies_down && proxy_bytes(&metrics, 0, "up") > 0.0 {
            break metrics;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "gw-0's bytes never reached the bodies': {metrics}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    let (up, down) = (
        proxy_bytes(&metrics, 0, "up"),
        proxy_bytes(&metrics, 0, "down"),
    );
    assert!(down - bodies_down <= TUNNEL_OVERHEAD, "down {down}");
    assert!(
        (50_000.0..=50_000.0 + TUNNEL_OVERHEAD).contains(&up),
        "up {up}"
    );
    // gw-1 carried nothing; the fleet's and the tenant's counts are gw-0's.
    let gw1 = |line: &str| line.starts_with(PROXY_BYTES) && line.contains("name=\"gw-1\"");
    assert!(!metrics.lines().any(gw1), "{metrics}");
    for direction in ["up", "down"] {
        let label = format!("direction=\"{direction}\"");
        let fleet_wide = metric_sum(&metrics, "proxy_operator_gateway_bytes_total", &[&label]);
        let tenant = metric_sum(
            &metrics,
            "proxy_operator_tenant_gateway_bytes_total",
            &[&label],
        );
        let proxies = metric_sum(&metrics, PROXY_BYTES, &[&label]);
        assert_eq!((fleet_wide, tenant), (proxies, proxies), "{direction}");
    }
}
