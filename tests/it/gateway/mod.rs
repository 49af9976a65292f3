//! The crawler gateway, through the binary: real squids on their own loopback addresses, each
//! asking for its own credentials (the site sees which one a request left from), real clients
//! (curl, reqwest, Python `requests`, Scrapy), and the ledger file read with `sqlite3`.

use std::collections::BTreeSet;
use std::process::Stdio;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::curl::header_value;
use crate::support::fleet::{GatewayFleet, TOKEN, proxy_url};
use crate::support::operator::metric_sum;
use crate::support::postgres::Postgres;
use crate::support::python::{python_with, script};
use crate::support::site::PAGES;
use crate::support::{DEADLINE, sqlite3};

mod bounds;
mod cost;
mod destinations;
mod inspect;
mod inspect_clients;
mod rented;
mod socks;
mod traffic;

/// A client whose every request goes through the gateway as `user`; `fresh`: a new
/// connection per request (no pooling), as separate crawler processes would.
fn client(fleet: &GatewayFleet, user: &str, fresh: bool) -> reqwest::Client {
    let proxy = reqwest::Proxy::all(fleet.proxy_url(user)).expect("a proxy URL");
    let mut builder = reqwest::Client::builder().proxy(proxy);
    if fresh {
        builder = builder.pool_max_idle_per_host(0);
    }
    builder.build().expect("a client")
}

/// What a request through the gateway got.
struct Fetched {
    status: StatusCode,
    proxy: Option<String>,
    lease: Option<String>,
    moved_from: Option<String>,
    retry_after: Option<u64>,
    ban_reported: Option<String>,
    body: String,
}

async fn fetch(client: &reqwest::Client, url: &str) -> Fetched {
    let response = client.get(url).send().await.expect("an answer");
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    Fetched {
        status: response.status(),
        proxy: header("x-proxy-name"),
        lease: header("x-proxy-lease"),
        moved_from: header("x-proxy-session-moved"),
        retry_after: header("retry-after").and_then(|v| v.parse().ok()),
        ban_reported: header("x-proxy-ban-reported"),
        body: response.text().await.expect("a body"),
    }
}

/// Fetches the site's `/ip` and checks that the proxy the gateway names is the one the site
/// saw the request come from; returns it.
async fn exit_through(fleet: &GatewayFleet, client: &reqwest::Client) -> Fetched {
    let fetched = fetch(client, &fleet.site.http("/ip")).await;
    assert_eq!(fetched.status, StatusCode::OK, "{}", fetched.body);
    assert_eq!(
        fetched.proxy,
        fleet.proxy_of(&fetched.body),
        "the named proxy is the exit"
    );
    fetched
}

/// curl with the gateway tests' limit of 30 s.
async fn curl(args: &[&str]) -> (i32, String, String) {
    crate::support::curl::curl(Duration::from_secs(30), args).await
}

/// Polls the ledger with `sql` until it answers `expected`.
async fn wait_for_ledger(fleet: &GatewayFleet, sql: &str, expected: &str) {
    let start = Instant::now();
    loop {
        let answer = sqlite3(&fleet.operator.ledger(), sql);
        if answer == expected {
            return;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "{sql} answers {answer:?}, not {expected:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn curl_fetches_http_and_https_through_the_gateway_which_names_the_lease() {
    let dir = tempfile::tempdir().unwrap();
    let fleet = GatewayFleet::start(dir.path(), 2, &[]).await;
    let proxy = fleet.proxy_url("curl-crawler");

    // Plain HTTP: the gateway forwards the absolute-form request and names the lease.
    let (code, out, err) = curl(&["-sS", "-D", "-", "-x", &proxy, &fleet.site.http("/ip")]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    let exit = out.lines().last().unwrap().trim();
    assert_eq!(
        header_value(&out, "x-proxy-name"),
        fleet.proxy_of(exit).as_deref()
    );
    let lease = header_value(&out, "x-proxy-lease")
        .expect("the lease")
        .to_owned();

    // HTTPS: a CONNECT tunnel; curl checks the site's own certificate end to end (the gateway
    // never sees inside), and the CONNECT answer names the lease.
    let ca = dir.path().join("site-ca.pem");
    let ca = ca.to_str().unwrap();
    let https = fleet.site.https("/ip");
    let (code, out, err) = curl(&["-sS", "-D", "-", "--cacert", ca, "-x", &proxy, &https]).await;
    assert_eq!(code, 0, "{err}");
    let (connect, response) = out.split_once("\r\n\r\n").expect("two heads");
    assert!(connect.starts_with("HTTP/1.1 200"), "{connect}");
    let exit = response.lines().last().unwrap().trim();
    assert_eq!(
        header_value(connect, "x-proxy-name"),
        fleet.proxy_of(exit).as_deref()
    );
    assert!(
        header_value(connect, "x-proxy-lease").is_some(),
        "{connect}"
    );
    assert!(response.contains("HTTP/1.1 200"), "{response}");
    // Without the site's CA, curl refuses the certificate: nothing in between re-signs it.
    let (code, _, err) = curl(&["-sS", "-x", &proxy, &https]).await;
    assert_eq!(code, 60, "{err}");

    // Each lease went back when curl closed its connection; the history names the crawler.
    wait_for_ledger(
        &fleet,
        "SELECT COUNT(*) FROM leases WHERE state = 'active'",
        "0",
    )
    .await;
    let history = sqlite3(
        &fleet.operator.ledger(),
        &format!(
            "SELECT kind, quote(client), target FROM lease_history \
             WHERE lease_id = '{lease}' ORDER BY seq"
        ),
    );
    assert_eq!(
        history,
        "acquired|'curl-crawler'|127.0.0.1\nreleased|NULL|127.0.0.1"
    );
    let metrics = fleet.metrics().await;
    let requests = "proxy_operator_gateway_requests_total";
    assert_eq!(
        metric_sum(
            &metrics,
            requests,
            &["kind=\"http\"", "outcome=\"forwarded\""]
        ),
        1.0
    );
    assert_eq!(
        metric_sum(
            &metrics,
            requests,
            &["kind=\"connect\"", "outcome=\"tunneled\""]
        ),
        2.0
    );
    assert!(
        metric_sum(
            &metrics,
            "proxy_operator_gateway_bytes_total",
            &["direction=\"down\""]
        ) > 0.0
    );
}

#[tokio::test]
async fn bad_credentials_options_and_ports_are_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let fleet = GatewayFleet::start(dir.path(), 1, &[]).await;
    let url = fleet.site.http("/ip");
    let gateway = fleet.operator.gateway().to_owned();

    // No credentials, or a wrong token: 407 with the challenge.
    for proxy in [
        format!("http://{gateway}"),
        format!("http://crawler:wrong-token-0123456789@{gateway}"),
    ] {
        let anonymous = reqwest::Client::builder()
            .proxy(reqwest::Proxy::all(&proxy).unwrap())
            .build()
            .unwrap();
        let response = anonymous.get(&url).send().await.unwrap();
        assert_eq!(
            response.status(),
            StatusCode::PROXY_AUTHENTICATION_REQUIRED,
            "{proxy}"
        );
        let challenge = response.headers()["proxy-authenticate"].to_str().unwrap();
        assert!(challenge.starts_with("Basic"), "{challenge}");
    }

    // A malformed user part: 400 naming the problem, never a silent default.
    for (user, problem) in [
        ("crawler;session", "not key=value"),
        ("crawler;sessionTTL=forever", "sessionTTL"),
        ("crawler;session=a;session=b", "twice"),
    ] {
        let fetched = fetch(&client(&fleet, user, false), &url).await;
        assert_eq!(fetched.status, StatusCode::BAD_REQUEST, "{user}");
        let body: Value = serde_json::from_str(&fetched.body).unwrap();
        assert_eq!(body["error"], "bad_proxy_user");
        assert!(
            body["message"].as_str().unwrap().contains(problem),
            "{user}: {body}"
        );
    }

    // A port outside --gateway-allowed-ports: 403, for plain HTTP and CONNECT alike.
    let crawler = client(&fleet, "crawler", false);
    let fetched = fetch(&crawler, "http://127.0.0.1:1/").await;
    assert_eq!(fetched.status, StatusCode::FORBIDDEN);
    assert!(
        fetched.body.contains("port_not_allowed"),
        "{}",
        fetched.body
    );
    let proxy = fleet.proxy_url("crawler");
    let (code, _, err) = curl(&["-sS", "-x", &proxy, "https://127.0.0.1:1/"]).await;
    assert_ne!(code, 0);
    assert!(err.contains("403"), "{err}");

    // A request for the gateway itself (origin-form): 400, it is a forward proxy.
    let mut stream = tokio::net::TcpStream::connect(&gateway).await.unwrap();
    let basic = proxy_operator::credentials::Credentials {
        username: "crawler".into(),
        password: TOKEN.into(),
    }
    .basic();
    let request =
        format!("GET /ip HTTP/1.1\r\nHost: {gateway}\r\nProxy-Authorization: {basic}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut head = vec![0u8; 12];
    stream.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 400");

    let metrics = fleet.metrics().await;
    let requests = "proxy_operator_gateway_requests_total";
    for (outcome, at_least) in [
        ("auth_required", 2.0),
        ("bad_request", 4.0),
        ("port_refused", 2.0),
    ] {
        let seen = metric_sum(&metrics, requests, &[&format!("outcome=\"{outcome}\"")]);
        assert!(seen >= at_least, "{outcome}: {seen}");
    }
    assert!(fleet.site.requests() > 0, "probes reached the site");
}

#[tokio::test]
async fn sticky_sessions_keep_their_exit_and_move_when_their_upstream_dies_or_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let mut fleet = GatewayFleet::start(dir.path(), 3, &[]).await;
    let s1 = client(&fleet, "crawler;session=s1", true);
    let s2 = client(&fleet, "crawler;session=s2", true);

    // Every request of a session leaves through the same proxy, one connection each.
    let first = exit_through(&fleet, &s1).await.proxy.unwrap();
    let other = exit_through(&fleet, &s2).await.proxy.unwrap();
    for _ in 0..15 {
        assert_eq!(exit_through(&fleet, &s1).await.proxy.unwrap(), first);
        assert_eq!(exit_through(&fleet, &s2).await.proxy.unwrap(), other);
    }
    // One lease per session, however many connections used it.
    let active = sqlite3(
        &fleet.operator.ledger(),
        "SELECT COUNT(*) FROM leases WHERE state = 'active'",
    );
    assert_eq!(active, "2");
    let metrics = fleet.metrics().await;
    assert_eq!(
        metric_sum(&metrics, "proxy_operator_gateway_sessions_active", &[]),
        2.0
    );

    // Its proxy dies: the next request moves (and says from where), without failing.
    fleet.squid_of(&first).kill();
    let moved = exit_through(&fleet, &s1).await;
    let second = moved.proxy.clone().unwrap();
    assert_ne!(second, first);
    assert_eq!(moved.moved_from.as_deref(), Some(first.as_str()));
    for _ in 0..5 {
        let again = exit_through(&fleet, &s1).await;
        assert_eq!(again.proxy.as_deref(), Some(second.as_str()));
        assert_eq!(again.moved_from, None);
    }

    // Inside TLS only the crawler sees a ban: it reports it for the session by name.
    let api = crate::support::http::client();
    let report = |name: &str| {
        api.post(format!(
            "{}/v1/sessions/{name}/report",
            fleet.operator.api()
        ))
        .bearer_auth(TOKEN)
        .json(&json!({"result": "blocked", "retryAfterSeconds": 60}))
        .send()
    };
    assert_eq!(report("s1").await.unwrap().status(), StatusCode::NO_CONTENT);
    let unknown = report("nobody").await.unwrap();
    assert_eq!(unknown.status(), StatusCode::NOT_FOUND);
    let body: Value = unknown.json().await.unwrap();
    assert_eq!(body["error"], "unknown_session");
    let third = exit_through(&fleet, &s1).await;
    assert_eq!(third.moved_from.as_deref(), Some(second.as_str()));
    assert!(![first.as_str(), second.as_str()].contains(&third.proxy.as_deref().unwrap()));
    let cooldown = sqlite3(
        &fleet.operator.ledger(),
        "SELECT result, cooldown_seconds FROM lease_history \
         WHERE kind = 'reported' AND result = 'blocked'",
    );
    assert_eq!(cooldown, "blocked|60.0");
    // The dead upstream was reported too, by the gateway, without a cooldown of its own.
    let errors = sqlite3(
        &fleet.operator.ledger(),
        &format!(
            "SELECT COUNT(*) FROM lease_history WHERE kind = 'reported' AND result = 'error' \
             AND proxy = '{first}' AND cooldown_seconds IS NULL"
        ),
    );
    assert_ne!(errors, "0");

    // Ending the session gives its lease back at once; ending it again is no error.
    let end = || {
        api.delete(format!("{}/v1/sessions/s1", fleet.operator.api()))
            .bearer_auth(TOKEN)
            .send()
    };
    let third_lease = third.lease.unwrap();
    assert_eq!(end().await.unwrap().status(), StatusCode::NO_CONTENT);
    let state = sqlite3(
        &fleet.operator.ledger(),
        &format!("SELECT state FROM leases WHERE id = '{third_lease}'"),
    );
    assert_eq!(state, "released");
    assert_eq!(end().await.unwrap().status(), StatusCode::NO_CONTENT);
    assert_eq!(report("s1").await.unwrap().status(), StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn a_429_cools_that_proxy_for_the_target_and_the_next_request_goes_elsewhere() {
    let dir = tempfile::tempdir().unwrap();
    let fleet = GatewayFleet::start(dir.path(), 2, &[]).await;
    let crawler = client(&fleet, "crawler", false);
    let first = exit_through(&fleet, &crawler).await.proxy.unwrap();
    let banned = fetch(&crawler, &fleet.site.http("/status/429?retry_after=120")).await;
    assert_eq!(banned.status, StatusCode::TOO_MANY_REQUESTS, "passed on");
    assert_eq!(banned.ban_reported.as_deref(), Some("rate_limited"));
    assert_eq!(banned.proxy.as_deref(), Some(first.as_str()));
    let next = exit_through(&fleet, &crawler).await.proxy.unwrap();
    assert_ne!(next, first, "the cooled proxy is skipped for this target");
    let reported = sqlite3(
        &fleet.operator.ledger(),
        "SELECT proxy, result, target, cooldown_seconds FROM lease_history \
         WHERE kind = 'reported'",
    );
    assert_eq!(reported, format!("{first}|rate_limited|127.0.0.1|120.0"));
    let metrics = fleet.metrics().await;
    assert_eq!(
        metric_sum(
            &metrics,
            "proxy_operator_gateway_bans_total",
            &["result=\"rate_limited\""]
        ),
        1.0
    );
}

#[tokio::test]
async fn no_usable_proxy_is_503_with_retry_after_and_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let fleet = GatewayFleet::start(dir.path(), 1, &[]).await;
    let nowhere = client(&fleet, "crawler;pool=nowhere", false);
    let fetched = fetch(&nowhere, &fleet.site.http("/ip")).await;
    assert_eq!(fetched.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(fetched.retry_after.is_some_and(|s| s >= 1));
    let body: Value = serde_json::from_str(&fetched.body).unwrap();
    assert_eq!(body["error"], "no_match");
    assert_eq!(body["considered"], 0);
    // The selector that matches: served.
    let matching = client(&fleet, "crawler;pool=gateway", false);
    exit_through(&fleet, &matching).await;
}

#[tokio::test]
async fn a_killed_upstream_costs_python_requests_no_failed_request() {
    let Some(python) = python_with(&["requests"]) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut fleet = GatewayFleet::start(dir.path(), 3, &[]).await;
    let output = dir.path().join("requests.out");
    let mut child = tokio::process::Command::new(python)
        .arg(script("requests_loop.py"))
        .arg(fleet.proxy_url("requests-crawler"))
        .arg(fleet.site.http("/ip"))
        .arg("150")
        .arg("0.01")
        .stdout(std::fs::File::create(&output).unwrap())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("run python3");
    // Once it is under way, kill the proxy its kept-alive connection goes through.
    let start = Instant::now();
    let exit = loop {
        let lines = std::fs::read_to_string(&output).unwrap_or_default();
        if lines.lines().count() >= 30 {
            let first = lines.lines().next().unwrap();
            break first.split(' ').nth(1).unwrap_or(first).to_owned();
        }
        assert!(
            start.elapsed() < DEADLINE,
            "requests did not get going:\n{lines}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let proxy = fleet
        .proxy_of(&exit)
        .unwrap_or_else(|| panic!("{exit} is no exit of the fleet"));
    fleet.squid_of(&proxy).kill();
    let status = tokio::time::timeout(Duration::from_secs(120), child.wait())
        .await
        .expect("requests finished")
        .unwrap();
    assert!(status.success());
    let lines = std::fs::read_to_string(&output).unwrap();
    let mut exits = BTreeSet::new();
    for line in lines.lines() {
        let (status, ip) = line.split_once(' ').unwrap();
        assert_eq!(status, "200", "{line}\n{lines}");
        exits.insert(fleet.proxy_of(ip).expect("a fleet exit"));
    }
    assert_eq!(lines.lines().count(), 150);
    assert!(exits.len() >= 2 && exits.contains(&proxy), "{exits:?}");
    let metrics = fleet.metrics().await;
    assert!(
        metric_sum(
            &metrics,
            "proxy_operator_gateway_upstream_retries_total",
            &[]
        ) >= 1.0
    );
}

#[tokio::test]
async fn scrapy_crawls_a_site_through_the_gateway() {
    let Some(python) = python_with(&["scrapy"]) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let fleet = GatewayFleet::start(dir.path(), 2, &[]).await;
    let items = dir.path().join("items.jsonl");
    let output = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new(python)
            .arg(script("spider.py"))
            .arg(fleet.proxy_url("scrapy"))
            .arg(fleet.site.http("/"))
            .arg(&items)
            .output(),
    )
    .await
    .expect("the crawl finished")
    .expect("run python3");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let items: Vec<Value> = std::fs::read_to_string(&items)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(items.len(), PAGES, "{stdout}");
    for item in &items {
        assert_eq!(item["status"], 200);
        let exit = item["ip"].as_str().unwrap();
        assert_eq!(
            item["upstream"].as_str(),
            fleet.proxy_of(exit).as_deref(),
            "{item}"
        );
    }
}

#[tokio::test]
async fn a_proxy_leaving_the_inventory_loses_the_gateway_leases_on_it_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut fleet = GatewayFleet::start(dir.path(), 3, &[]).await;
    // One kept-alive connection, idle after its requests: a session's and its own lease.
    let crawler = client(&fleet, "crawler", false);
    let session = client(&fleet, "crawler;session=s1", false);
    let plain = exit_through(&fleet, &crawler).await;
    let sticky = exit_through(&fleet, &session).await;
    let used: BTreeSet<String> = [plain.proxy.clone(), sticky.proxy.clone()]
        .into_iter()
        .flatten()
        .collect();
    for proxy in &used {
        fleet.remove(proxy);
    }
    let leases = format!(
        "SELECT group_concat(state) FROM (SELECT state FROM leases WHERE id IN ('{}', '{}') \
         ORDER BY id)",
        plain.lease.unwrap(),
        sticky.lease.unwrap()
    );
    wait_for_ledger(&fleet, &leases, "released,released").await;
    let moved = exit_through(&fleet, &session).await;
    assert_eq!(moved.moved_from, sticky.proxy);
    assert!(!used.contains(moved.proxy.as_deref().unwrap()));
}

#[tokio::test]
async fn a_tunnel_renews_its_lease_while_open_and_gives_it_back_when_it_closes() {
    let dir = tempfile::tempdir().unwrap();
    let fleet = GatewayFleet::start(dir.path(), 1, &["--default-lease-ttl", "2s"]).await;
    let gateway = fleet.operator.gateway().to_owned();
    let basic = proxy_operator::credentials::Credentials {
        username: "tunneler".into(),
        password: TOKEN.into(),
    }
    .basic();
    let authority = fleet
        .site
        .https("")
        .trim_start_matches("https://")
        .to_owned();
    let mut tunnel = tokio::net::TcpStream::connect(&gateway).await.unwrap();
    let connect = format!(
        "CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\nProxy-Authorization: {basic}\r\n\r\n"
    );
    tunnel.write_all(connect.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        tunnel.read_exact(&mut byte).await.unwrap();
        head.push(byte[0]);
    }
    let head = String::from_utf8(head).unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let lease = header_value(&head, "x-proxy-lease").unwrap().to_owned();

    // Open and idle for well past its 2s TTL: renewed meanwhile, still counting.
    let renewals = format!(
        "SELECT COUNT(*) >= 2 FROM lease_history WHERE lease_id = '{lease}' AND kind = 'renewed'"
    );
    wait_for_ledger(&fleet, &renewals, "1").await;
    let state = format!("SELECT state FROM leases WHERE id = '{lease}'");
    assert_eq!(sqlite3(&fleet.operator.ledger(), &state), "active");

    drop(tunnel);
    wait_for_ledger(&fleet, &state, "released").await;
}

#[tokio::test]
async fn an_idle_session_gives_its_lease_back_after_its_session_ttl() {
    let dir = tempfile::tempdir().unwrap();
    let fleet = GatewayFleet::start(dir.path(), 1, &[]).await;
    let session = client(&fleet, "crawler;session=brief;sessionTTL=2s", true);
    let used = Instant::now();
    let lease = exit_through(&fleet, &session).await.lease.unwrap();
    let state = format!("SELECT state FROM leases WHERE id = '{lease}'");
    wait_for_ledger(&fleet, &state, "released").await;
    assert!(
        used.elapsed() >= Duration::from_secs(1),
        "released before it was idle"
    );
    let metrics = fleet.metrics().await;
    assert_eq!(
        metric_sum(&metrics, "proxy_operator_gateway_sessions_active", &[]),
        0.0
    );
}

#[tokio::test]
async fn a_session_keeps_its_proxy_and_lease_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut fleet = GatewayFleet::start(dir.path(), 3, &[]).await;
    let before = exit_through(&fleet, &client(&fleet, "crawler;session=s1", true)).await;
    fleet.restart().await;
    let after = exit_through(&fleet, &client(&fleet, "crawler;session=s1", true)).await;
    assert_eq!(after.proxy, before.proxy);
    assert_eq!(after.lease, before.lease, "found again through the ledger");
    assert_eq!(after.moved_from, None);
}

#[tokio::test]
async fn a_session_is_the_same_through_every_replica_of_one_postgres_ledger() {
    let Some(postgres) = Postgres::shared() else {
        return;
    };
    let database = postgres.database();
    let url = database.url();
    let dir = tempfile::tempdir().unwrap();
    let fleet = GatewayFleet::start(dir.path(), 3, &["--ledger", &url]).await;
    let other = dir.path().join("replica-b");
    std::fs::create_dir_all(&other).unwrap();
    let replica = fleet.start_replica(&other).await;
    let through_b = |user: &str| {
        let proxy = reqwest::Proxy::all(proxy_url(&replica, user)).expect("a proxy URL");
        reqwest::Client::builder()
            .proxy(proxy)
            .pool_max_idle_per_host(0)
            .build()
            .expect("a client")
    };
    let first = exit_through(&fleet, &client(&fleet, "crawler;session=s1", true)).await;
    let again = fetch(&through_b("crawler;session=s1"), &fleet.site.http("/ip")).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.body);
    assert_eq!(
        again.proxy, first.proxy,
        "the other replica found the session's proxy"
    );
    assert_eq!(
        again.lease, first.lease,
        "... and its lease, through the ledger"
    );
    assert_eq!(again.moved_from, None);
    // Another session through the other replica is a lease of its own.
    let second = fetch(&through_b("crawler;session=s2"), &fleet.site.http("/ip")).await;
    assert_eq!(second.status, StatusCode::OK, "{}", second.body);
    assert_ne!(second.lease, first.lease);
    assert_eq!(
        database.psql("SELECT count(*) FROM leases WHERE state = 'active'"),
        "2"
    );
}

#[tokio::test]
async fn per_target_caps_refuse_with_their_own_reason_and_credentials_are_given_out_on_request() {
    let dir = tempfile::tempdir().unwrap();
    let args = ["--max-leases-per-target", "1", "--lease-credentials"];
    let fleet = GatewayFleet::start(dir.path(), 2, &args).await;
    // One connection holds the one lease the target may have, fleet-wide.
    let holder = client(&fleet, "crawler", false);
    exit_through(&fleet, &holder).await;
    let other = fetch(&client(&fleet, "crawler", false), &fleet.site.http("/ip")).await;
    assert_eq!(other.status, StatusCode::SERVICE_UNAVAILABLE);
    let body: Value = serde_json::from_str(&other.body).unwrap();
    assert_eq!(body["reason"], "target_limit", "{body}");
    assert!(other.retry_after.is_some());

    // The lease API holds acquires to the same cap, and gives the credentials out (the flag).
    let api = crate::support::http::client();
    let acquire = |target: Option<&str>| {
        let mut body = json!({"ttlSeconds": 60});
        if let Some(target) = target {
            body["target"] = json!(target);
        }
        api.post(format!("{}/v1/leases", fleet.operator.api()))
            .bearer_auth(TOKEN)
            .json(&body)
            .send()
    };
    let refused = acquire(Some("127.0.0.1")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::CONFLICT);
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["atTargetLimit"], 2, "{body}");
    let granted = acquire(Some("elsewhere.example")).await.unwrap();
    assert_eq!(granted.status(), StatusCode::CREATED);
    let lease: Value = granted.json().await.unwrap();
    let name = lease["proxy"]["name"].as_str().unwrap();
    let index: usize = name.trim_start_matches("gw-").parse().unwrap();
    assert_eq!(lease["proxy"]["username"], format!("upstream{index}"));
    assert!(
        lease["proxy"]["password"]
            .as_str()
            .is_some_and(|p| !p.is_empty())
    );
    let metrics = fleet.metrics().await;
    assert_eq!(
        metric_sum(
            &metrics,
            "proxy_operator_gateway_requests_total",
            &["outcome=\"no_proxy\""]
        ),
        1.0
    );
    assert_eq!(
        metric_sum(
            &metrics,
            "proxy_operator_lease_rejections_total",
            &["reason=\"target_limit\""]
        ),
        1.0
    );
}
