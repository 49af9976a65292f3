//! Bytes through the gateway per proxy, against what the target and the crawler sent: plain
//! HTTP answers and request bodies, and a CONNECT tunnel's bytes (TLS included), each in the
//! series of the proxy that carried them; a proxy that carried nothing has none. The same
//! bytes in the ledger's hourly traffic rows, on SQLite and on three replicas sharing one
//! PostgreSQL database.

use std::future::Future;
use std::time::Instant;

use super::curl;
use crate::support::DEADLINE;
use crate::support::fleet::{GatewayFleet, proxy_url};
use crate::support::ledger::count;
use crate::support::operator::metric_sum;
use crate::support::postgres::Postgres;

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
pub(super) async fn downloaded(proxy: &str, options: &[&str], url: &str) -> u64 {
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

/// Polls `read` (bytes `(up, down)` in the ledger) until down reaches `bodies_down`, then
/// checks both against what was sent: within the heads' and TLS's size of the bodies.
async fn ledger_bytes_reach<F, Fut>(read: F, bodies_up: u64, bodies_down: u64)
where
    F: Fn() -> Fut,
    Fut: Future<Output = (u64, u64)>,
{
    let started = Instant::now();
    let (up, down) = loop {
        let (up, down) = read().await;
        if down >= bodies_down && up >= bodies_up {
            break (up, down);
        }
        assert!(
            started.elapsed() < DEADLINE,
            "the ledger's rows never reached the bodies': up {up}, down {down}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    let overhead = TUNNEL_OVERHEAD as u64;
    assert!(down - bodies_down <= overhead, "down {down}");
    assert!(up - bodies_up <= overhead, "up {up}");
}

#[tokio::test]
async fn the_ledger_keeps_the_bytes_per_hour_tenant_proxy_and_target_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let fleet = GatewayFleet::start(dir.path(), 2, &[]).await;
    let proxy = fleet.proxy_url("bytes");
    let body = dir.path().join("body");
    std::fs::write(&body, vec![b'x'; 40_000]).unwrap();
    let upload = format!("@{}", body.display());
    let echo = fleet.site.http("/echo");
    assert_eq!(
        downloaded(&proxy, &["--data-binary", &upload], &echo).await,
        40_000
    );
    assert_eq!(
        downloaded(&proxy, &[], &fleet.site.http("/bytes/250000")).await,
        250_000
    );
    let ca = dir.path().join("site-ca.pem");
    let tunnelled = ["-p", "--cacert", ca.to_str().unwrap()];
    let https = fleet.site.https("/bytes/100000");
    assert_eq!(downloaded(&proxy, &tunnelled, &https).await, 100_000);

    let ledger = fleet.operator.ledger();
    let sum = |column: &str| {
        let total = count(
            &ledger,
            &format!("SELECT coalesce(SUM({column}), 0) FROM traffic_hours"),
        );
        u64::try_from(total).unwrap()
    };
    ledger_bytes_reach(|| async { (sum("up"), sum("down")) }, 40_000, 390_000).await;
    // Rows per (hour, tenant, proxy, pool, target), not per request: the token file's
    // tenant, the proxies of no ProxyPool, the site's host.
    let rows = crate::support::sqlite3(
        &ledger,
        "SELECT DISTINCT tenant, namespace, pool, target, hour_ms % 3600000 FROM traffic_hours",
    );
    assert_eq!(rows.trim(), "default|default||127.0.0.1|0", "{rows}");
    let per_proxy = count(&ledger, "SELECT COUNT(*) FROM traffic_hours");
    assert!((1..=2).contains(&per_proxy), "{per_proxy} rows");
}

#[tokio::test]
async fn three_replicas_on_one_postgres_database_add_their_bytes_to_the_same_rows() {
    let Some(postgres) = Postgres::shared() else {
        return;
    };
    let database = postgres.database();
    let url = database.url();
    let dir = tempfile::tempdir().unwrap();
    // One proxy, so every replica's bytes go to the same row.
    let fleet = GatewayFleet::start(dir.path(), 1, &["--ledger", &url]).await;
    let mut replicas = Vec::new();
    for name in ["replica-b", "replica-c"] {
        let other = dir.path().join(name);
        std::fs::create_dir_all(&other).unwrap();
        replicas.push(fleet.start_replica(&other).await);
    }
    let gateways: Vec<String> = std::iter::once(fleet.proxy_url("bytes"))
        .chain(replicas.iter().map(|r| proxy_url(r, "bytes")))
        .collect();
    let url = fleet.site.http("/bytes/120000");
    let fetches = gateways
        .iter()
        .flat_map(|gateway| [gateway, gateway])
        .map(|gateway| downloaded(gateway, &[], &url));
    for got in futures::future::join_all(fetches).await {
        assert_eq!(got, 120_000);
    }
    let sum = |column: &str| {
        let total = database.psql(&format!(
            "SELECT coalesce(sum({column}), 0) FROM traffic_hours"
        ));
        total.trim().parse::<u64>().unwrap()
    };
    ledger_bytes_reach(|| async { (sum("up"), sum("down")) }, 0, 6 * 120_000).await;
    assert_eq!(
        database.psql(
            "SELECT count(*) FROM (SELECT DISTINCT tenant, namespace, name, pool, target \
             FROM traffic_hours) AS keys"
        ),
        "1",
        "one row per hour for the tenant, the proxy and the target, whichever replica"
    );
}
