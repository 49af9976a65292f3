//! What the fleet may reach, through the binary: without an opened range the gateway refuses
//! every spelling of loopback, link-local (the cloud metadata server) and the private ranges,
//! for CONNECT and plain HTTP alike, before it takes a lease; the target records nothing.
//! With `--gateway-allowed-destinations` the same target is reached.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::support::fleet::{GatewayFleet, TOKEN};
use crate::support::operator::metric_sum;
use crate::support::raw::{exchange, proxy_authorization};
use crate::support::sqlite3;

/// A loopback HTTP target that counts the connections it accepts and answers every request
/// `200 recorded`.
struct Recorder {
    port: u16,
    accepted: Arc<AtomicU64>,
}

impl Recorder {
    async fn start() -> Recorder {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicU64::new(0));
        let counter = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buffer = [0u8; 4096];
                    let _ = stream.read(&mut buffer).await;
                    let _ = stream
                        .write_all(
                            b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\nconnection: close\r\n\r\nrecorded",
                        )
                        .await;
                });
            }
        });
        Recorder { port, accepted }
    }

    fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::SeqCst)
    }
}

/// The targets a crawler might try, each a request line the gateway must refuse (`{P}` is the
/// recorder's port) and the reason it must give.
fn refused_requests(port: u16) -> Vec<(String, &'static str)> {
    let connect =
        |authority: &str| format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n");
    let get = |url: &str| format!("GET {url} HTTP/1.1\r\nHost: example.com\r\n");
    vec![
        (connect(&format!("127.0.0.1:{port}")), "loopback"),
        (connect(&format!("localhost:{port}")), "loopback"),
        (connect(&format!("[::1]:{port}")), "loopback"),
        (connect(&format!("[::ffff:127.0.0.1]:{port}")), "loopback"),
        (connect(&format!("2130706433:{port}")), "loopback"),
        (connect(&format!("0x7f.1:{port}")), "loopback"),
        (connect(&format!("0177.0.0.1:{port}")), "loopback"),
        (connect(&format!("127.1:{port}")), "loopback"),
        (connect("169.254.169.254:80"), "link_local"),
        (connect("metadata.google.internal:80"), "link_local"),
        (connect(&format!("10.0.0.1:{port}")), "private"),
        (get(&format!("http://127.0.0.1:{port}/")), "loopback"),
        (get(&format!("http://localhost:{port}/")), "loopback"),
        (get(&format!("http://[::1]:{port}/")), "loopback"),
        (get(&format!("http://[::ffff:7f00:1]:{port}/")), "loopback"),
        (get(&format!("http://2130706433:{port}/")), "loopback"),
        (get(&format!("http://0x7f.0.0.1:{port}/")), "loopback"),
        (get(&format!("http://127.0.0.1.:{port}/")), "loopback"),
        // The userinfo of a URL is not its host.
        (
            get(&format!("http://example.com@127.0.0.1:{port}/")),
            "loopback",
        ),
        (
            get(&format!("http://crawler:pw@localhost:{port}/")),
            "loopback",
        ),
        (
            "GET http://169.254.169.254/computeMetadata/v1/instance/service-accounts/default/token \
             HTTP/1.1\r\nHost: 169.254.169.254\r\nMetadata-Flavor: Google\r\n"
                .to_owned(),
            "link_local",
        ),
        (
            get("http://metadata.google.internal/computeMetadata/v1/"),
            "link_local",
        ),
        (get("http://metadata/computeMetadata/v1/"), "link_local"),
        (get(&format!("http://[fe80::1]:{port}/")), "link_local"),
        (get(&format!("http://192.168.1.1:{port}/")), "private"),
        (get(&format!("http://100.64.0.1:{port}/")), "shared_address"),
        (get(&format!("http://[fd00::1]:{port}/")), "unique_local"),
        (get(&format!("http://0.0.0.0:{port}/")), "unspecified"),
    ]
}

#[tokio::test]
async fn every_spelling_of_a_private_destination_is_refused_before_any_lease() {
    let dir = tempfile::tempdir().unwrap();
    let recorder = Recorder::start().await;
    let ports = format!("{},80", recorder.port);
    let fleet =
        GatewayFleet::start_closed(dir.path(), 1, &["--gateway-allowed-ports", &ports]).await;
    let auth = proxy_authorization("egress", TOKEN);
    let cases = refused_requests(recorder.port);
    for (request, reason) in &cases {
        let answer = exchange(fleet.operator.gateway(), &format!("{request}{auth}\r\n")).await;
        let line = request.lines().next().unwrap();
        assert_eq!(answer.status, 403, "{line}: {answer:?}");
        let body = answer.json();
        assert_eq!(body["error"], "destination_not_allowed", "{line}: {body}");
        assert_eq!(body["reason"], *reason, "{line}: {body}");
        assert!(
            body["message"]
                .as_str()
                .is_some_and(|m| m.contains("--gateway-allowed-destinations")),
            "{line}: {body}"
        );
        assert_eq!(
            answer.header("proxy-status"),
            Some(
                "proxy-operator; error=destination_ip_prohibited; \
                 details=\"destination_not_allowed\""
            ),
            "{line}"
        );
    }
    // A name that does not resolve is refused too, with its own reason.
    let answer = exchange(
        fleet.operator.gateway(),
        &format!("GET http://no-such-host.invalid/ HTTP/1.1\r\nHost: x\r\n{auth}\r\n"),
    )
    .await;
    assert_eq!(answer.status, 502, "{answer:?}");
    assert_eq!(answer.json()["error"], "destination_unresolvable");
    assert_eq!(
        answer.header("proxy-status"),
        Some("proxy-operator; error=dns_error; details=\"destination_unresolvable\"")
    );

    assert_eq!(recorder.accepted(), 0, "the target was reached");
    // Never a lease, so never a ban or a pool's demand either.
    assert_eq!(
        sqlite3(
            &fleet.operator.ledger(),
            "SELECT count(*) FROM lease_history"
        ),
        "0"
    );
    let metrics = fleet.metrics().await;
    let refused = |reason: &str| {
        metric_sum(
            &metrics,
            "proxy_operator_gateway_destinations_refused_total",
            &[&format!("reason=\"{reason}\"")],
        )
    };
    let loopback = cases.iter().filter(|(_, r)| *r == "loopback").count() as f64;
    assert_eq!(refused("loopback"), loopback, "{metrics}");
    assert_eq!(refused("unresolvable"), 1.0);
    assert_eq!(
        metric_sum(
            &metrics,
            "proxy_operator_gateway_requests_total",
            &["outcome=\"destination_refused\""],
        ),
        cases.len() as f64 + 1.0
    );
}

#[tokio::test]
async fn an_opened_range_lets_the_crawler_reach_it_and_nothing_beside_it() {
    let dir = tempfile::tempdir().unwrap();
    let recorder = Recorder::start().await;
    let ports = format!("{},80", recorder.port);
    // The fleet's own flag opens loopback; `--gateway-allowed-destinations` is the same for
    // any on-premises range.
    let fleet = GatewayFleet::start(dir.path(), 1, &["--gateway-allowed-ports", &ports]).await;
    let auth = proxy_authorization("egress", TOKEN);
    for request in [
        format!(
            "GET http://127.0.0.1:{p}/ HTTP/1.1\r\nHost: 127.0.0.1:{p}\r\n",
            p = recorder.port
        ),
        format!(
            "GET http://0x7f.1:{p}/ HTTP/1.1\r\nHost: 127.0.0.1:{p}\r\n",
            p = recorder.port
        ),
    ] {
        let answer = exchange(fleet.operator.gateway(), &format!("{request}{auth}\r\n")).await;
        assert_eq!(answer.status, 200, "{request}: {answer:?}");
        assert_eq!(answer.body, "recorded");
        assert_eq!(answer.header("x-proxy-name"), Some("default/gw-0"));
    }
    assert!(recorder.accepted() >= 1);
    // The metadata server stays closed: only loopback was opened.
    let answer = exchange(
        fleet.operator.gateway(),
        &format!("GET http://169.254.169.254/ HTTP/1.1\r\nHost: x\r\n{auth}\r\n"),
    )
    .await;
    assert_eq!(answer.status, 403, "{answer:?}");
    assert_eq!(answer.json()["reason"], "link_local");
}
