//! What bounds a client connection, through the binary: a head sent by halves and an idle
//! connection are closed within their (shortened) timeouts, connections over the cap are
//! refused with a clear answer and counted, long names are refused naming the field, a
//! target's forgeries of the gateway's headers never reach the crawler, and a connection
//! without a session holds a bounded number of leases, the least recently used going first.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::support::fleet::{GatewayFleet, TOKEN};
use crate::support::operator::metric_sum;
use crate::support::raw::{closed_within, exchange, proxy_authorization, read_answer, send};
use crate::support::{DEADLINE, sqlite3};

/// Polls the fleet's metrics until `metric{labels}` sums to `want`.
async fn wait_for_metric(fleet: &GatewayFleet, metric: &str, labels: &[&str], want: f64) {
    let start = Instant::now();
    loop {
        let metrics = fleet.metrics().await;
        let got = metric_sum(&metrics, metric, labels);
        if got == want {
            return;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "{metric}{labels:?} is {got}, not {want}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_head_sent_by_halves_and_an_idle_connection_are_closed_in_time() {
    let dir = tempfile::tempdir().unwrap();
    let fleet = GatewayFleet::start(
        dir.path(),
        1,
        &[
            "--gateway-header-timeout",
            "1s",
            "--gateway-idle-timeout",
            "2s",
        ],
    )
    .await;
    let gateway = fleet.operator.gateway();

    // Half a head, before any authentication: closed after about a second.
    let mut slow = TcpStream::connect(gateway).await.unwrap();
    send(
        &mut slow,
        "GET http://127.0.0.1/ HTTP/1.1\r\nHost: 127.0.0.1\r\n",
    )
    .await;
    let start = Instant::now();
    assert!(
        closed_within(&mut slow, DEADLINE).await,
        "a half-sent head is kept open"
    );
    assert!(
        start.elapsed() >= Duration::from_millis(900),
        "{:?}",
        start.elapsed()
    );

    // A connection that sends nothing at all: closed at the header timeout too.
    let mut silent = TcpStream::connect(gateway).await.unwrap();
    assert!(
        closed_within(&mut silent, DEADLINE).await,
        "a silent connection is kept open"
    );

    // A kept-alive connection: its request is served, then it idles, and is closed after
    // about two seconds, not at the header timeout.
    let mut kept = TcpStream::connect(gateway).await.unwrap();
    let auth = proxy_authorization("idle", TOKEN);
    send(
        &mut kept,
        &format!(
            "GET {} HTTP/1.1\r\nHost: x\r\n{auth}\r\n",
            fleet.site.http("/ip")
        ),
    )
    .await;
    let answer = read_answer(&mut kept, DEADLINE).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let served = Instant::now();
    assert!(
        closed_within(&mut kept, DEADLINE).await,
        "an idle connection is kept open"
    );
    let idled = served.elapsed();
    assert!(
        idled >= Duration::from_millis(1900),
        "closed after {idled:?}"
    );

    wait_for_metric(
        &fleet,
        "proxy_operator_gateway_connections_timed_out_total",
        &["reason=\"header_timeout\""],
        2.0,
    )
    .await;
    wait_for_metric(
        &fleet,
        "proxy_operator_gateway_connections_timed_out_total",
        &["reason=\"idle_timeout\""],
        1.0,
    )
    .await;
}

#[tokio::test]
async fn a_download_longer_than_the_idle_timeout_is_not_cut() {
    let dir = tempfile::tempdir().unwrap();
    let fleet = GatewayFleet::start(
        dir.path(),
        1,
        &[
            "--gateway-header-timeout",
            "1s",
            "--gateway-idle-timeout",
            "1s",
        ],
    )
    .await;
    // 64 MiB read slowly: the response takes longer than both timeouts.
    let mut stream = TcpStream::connect(fleet.operator.gateway()).await.unwrap();
    let auth = proxy_authorization("download", TOKEN);
    let size = 64 << 20;
    send(
        &mut stream,
        &format!(
            "GET {} HTTP/1.1\r\nHost: x\r\n{auth}\r\n",
            fleet.site.http(&format!("/bytes/{size}"))
        ),
    )
    .await;
    let start = Instant::now();
    let mut received = 0usize;
    let mut chunk = vec![0u8; 1 << 20];
    while received < size {
        let n = stream.read(&mut chunk).await.unwrap();
        assert!(
            n > 0,
            "cut after {received} bytes and {:?}",
            start.elapsed()
        );
        received += n;
        if start.elapsed() < Duration::from_secs(3) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    assert!(
        start.elapsed() > Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
}

#[tokio::test]
async fn connections_over_the_cap_are_refused_with_a_clear_answer_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let fleet = GatewayFleet::start(dir.path(), 1, &["--gateway-max-connections", "2"]).await;
    let gateway = fleet.operator.gateway();
    let auth = proxy_authorization("cap", TOKEN);
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: x\r\n{auth}\r\n",
        fleet.site.http("/ip")
    );
    let mut first = TcpStream::connect(gateway).await.unwrap();
    send(&mut first, &request).await;
    assert_eq!(read_answer(&mut first, DEADLINE).await.status, 200);
    let mut second = TcpStream::connect(gateway).await.unwrap();
    send(&mut second, &request).await;
    assert_eq!(read_answer(&mut second, DEADLINE).await.status, 200);

    let mut third = TcpStream::connect(gateway).await.unwrap();
    let refused = read_answer(&mut third, DEADLINE).await;
    assert_eq!(refused.status, 503, "{refused:?}");
    assert_eq!(refused.json()["error"], "too_many_connections");
    assert!(
        refused.json()["message"]
            .as_str()
            .is_some_and(|m| m.contains("--gateway-max-connections")),
        "{}",
        refused.body
    );
    assert_eq!(
        refused.header("proxy-status"),
        Some("proxy-operator; error=http_request_denied; details=\"too_many_connections\"")
    );
    assert!(refused.header("retry-after").is_some());
    assert!(closed_within(&mut third, DEADLINE).await);
    wait_for_metric(
        &fleet,
        "proxy_operator_gateway_connections_refused_total",
        &["reason=\"process_limit\""],
        1.0,
    )
    .await;
    wait_for_metric(&fleet, "proxy_operator_gateway_connections_open", &[], 2.0).await;

    // A connection that closes makes room.
    drop(first);
    let start = Instant::now();
    loop {
        let answer = exchange(gateway, &request).await;
        if answer.status == 200 {
            break;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "no room after a close: {answer:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn long_names_are_refused_naming_the_field_and_forged_headers_never_reach_the_crawler() {
    let dir = tempfile::tempdir().unwrap();
    let fleet = GatewayFleet::start(dir.path(), 1, &[]).await;
    let gateway = fleet.operator.gateway();
    let url = fleet.site.http("/ip");
    for (user, field) in [
        ("c".repeat(129), "crawler name"),
        (format!("c;geo={}", "e".repeat(64)), "label \"geo\""),
        (format!("c;session={}", "s".repeat(129)), "session name"),
        (format!("c;{}", "k=v;".repeat(300)), "user part"),
    ] {
        let auth = proxy_authorization(&user, TOKEN);
        let answer = exchange(
            gateway,
            &format!("GET {url} HTTP/1.1\r\nHost: x\r\n{auth}\r\n"),
        )
        .await;
        assert_eq!(answer.status, 400, "{answer:?}");
        let body = answer.json();
        assert_eq!(body["error"], "bad_proxy_user");
        assert!(
            body["message"].as_str().is_some_and(|m| m.contains(field)),
            "{field}: {body}"
        );
    }
    assert_eq!(
        sqlite3(
            &fleet.operator.ledger(),
            "SELECT count(*) FROM lease_history"
        ),
        "0"
    );

    // A target that answers with the gateway's own headers: the crawler sees the gateway's.
    let auth = proxy_authorization("forged", TOKEN);
    let answer = exchange(
        gateway,
        &format!(
            "GET {} HTTP/1.1\r\nHost: x\r\n{auth}\r\n",
            fleet.site.http("/forged")
        ),
    )
    .await;
    assert_eq!(answer.status, 403);
    assert_eq!(answer.header("x-proxy-name"), Some("default/gw-0"));
    assert_ne!(answer.header("x-proxy-lease"), Some("forged-lease"));
    assert!(answer.header("x-proxy-lease").is_some());
    assert_eq!(
        answer.header("x-proxy-session-moved"),
        None,
        "{}",
        answer.head
    );
    assert_eq!(answer.header("proxy-status"), None, "{}", answer.head);
    // The 403 is the target's, and the gateway's ban rule reports it: the one
    // `X-Proxy-Ban-Reported` left is the gateway's own.
    assert_eq!(answer.header("x-proxy-ban-reported"), Some("blocked"));
    assert_eq!(answer.head.matches("x-proxy-ban-reported").count(), 1);
}

/// A loopback target on `address:port` answering every request `200` with the address.
async fn target_on(address: Ipv4Addr, port: u16) -> Option<TcpListener> {
    let listener = TcpListener::bind((address, port)).await.ok()?;
    Some(listener)
}

fn serve(listener: TcpListener) {
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buffer = [0u8; 4096];
                while let Ok(n) = stream.read(&mut buffer).await {
                    if n == 0
                        || stream
                            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                            .await
                            .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
}

#[tokio::test]
async fn a_connection_without_a_session_holds_a_bounded_number_of_leases() {
    // Three targets on three loopback addresses, one port: three hosts to the ledger.
    let (port, listeners) = loop {
        let first = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = first.local_addr().unwrap().port();
        let mut listeners = vec![first];
        for last in [2, 3] {
            if let Some(listener) = target_on(Ipv4Addr::new(127, 0, 0, last), port).await {
                listeners.push(listener);
            }
        }
        if listeners.len() == 3 {
            break (port, listeners);
        }
    };
    listeners.into_iter().for_each(serve);
    let dir = tempfile::tempdir().unwrap();
    let fleet = GatewayFleet::start(
        dir.path(),
        1,
        &[
            "--gateway-allowed-ports",
            &port.to_string(),
            "--gateway-connection-leases",
            "2",
        ],
    )
    .await;
    let auth = proxy_authorization("lru", TOKEN);
    let mut stream = TcpStream::connect(fleet.operator.gateway()).await.unwrap();
    let mut get = async |host: &str| {
        send(
            &mut stream,
            &format!("GET http://{host}:{port}/ HTTP/1.1\r\nHost: {host}\r\n{auth}\r\n"),
        )
        .await;
        let answer = read_answer(&mut stream, DEADLINE).await;
        assert_eq!(answer.status, 200, "{host}: {answer:?}");
    };
    get("127.0.0.1").await;
    get("127.0.0.2").await;
    get("127.0.0.1").await;
    // A third target: the lease used longest ago (127.0.0.2's) goes back first.
    get("127.0.0.3").await;
    let ledger = fleet.operator.ledger();
    let active = "SELECT group_concat(target) FROM \
                  (SELECT target FROM leases WHERE client = 'lru' AND state = 'active' \
                  ORDER BY target)";
    let start = Instant::now();
    loop {
        let held = sqlite3(&ledger, active);
        if held == "127.0.0.1,127.0.0.3" {
            break;
        }
        assert!(start.elapsed() < DEADLINE, "the connection holds {held}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Every answer came on the one connection, and it still serves.
    get("127.0.0.1").await;
    assert_eq!(
        sqlite3(
            &ledger,
            "SELECT count(*) FROM lease_history WHERE kind = 'acquired' AND client = 'lru'"
        ),
        "3"
    );
}
