//! Tenants (`--tenants-file`) on the real binary: two teams on one fleet of real squids, each
//! seeing and leasing only its scope through the lease API, the gateway and the status page's
//! data; neither able to touch the other's leases or sessions; quotas holding under 32
//! connections of acquire load on SQLite and on three PostgreSQL replicas with one killed
//! with SIGKILL; a token rotated and a broken file while running.

use crate::support;

use std::collections::{BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};
use support::crawl_load::{self, LedgerDb, Operator, POOL, http_client, inventory};
use support::curl::{curl, header_value};
use support::fleet::{GatewayFleet, TOKEN};
use support::postgres::Postgres;
use support::{DEADLINE, Squid, Target, sqlite3, token_digest as digest, wait_until};

const TEAM_A: &str = "team-a-token-0123456789abcdef";
const TEAM_A_NEXT: &str = "team-a-next-token-0123456789ab";
const TEAM_B: &str = "team-b-token-0123456789abcdef";

/// A tenants file: team-a (its tokens `a_tokens`) sees `team=a`, team-b sees `team=b`; both
/// with a quota of 10 leases and 1 gateway session.
fn two_teams(a_tokens: &[&str]) -> String {
    let a: Vec<String> = a_tokens
        .iter()
        .map(|t| format!("\"{}\"", digest(t)))
        .collect();
    format!(
        "tenants:
  - name: team-a
    tokens: [{a}]
    scope:
      selector: {{team: a}}
    quotas: {{leases: 10, sessions: 1}}
  - name: team-b
    tokens: [\"{b}\"]
    scope:
      selector: {{team: b}}
    quotas: {{leases: 10, sessions: 1}}
",
        a = a.join(", "),
        b = digest(TEAM_B),
    )
}

/// Writes `content` over `path` as a deployment tool would (a new file renamed over the old).
fn replace_file(path: &Path, content: &str) {
    let next = path.with_extension("next");
    std::fs::write(&next, content).unwrap();
    std::fs::rename(&next, path).unwrap();
}

/// A fleet of four squids: `gw-0`, `gw-1` labelled `team: a`, `gw-2`, `gw-3` `team: b`; the
/// binary reads `tenants` (written in `dir`) and re-reads it every 200 ms.
async fn fleet_of_two_teams(dir: &Path, tenants: &str) -> (GatewayFleet, PathBuf) {
    fleet_of_two_teams_with(dir, tenants, &[]).await
}

/// [`fleet_of_two_teams`] with `extra_args` for the binary.
async fn fleet_of_two_teams_with(
    dir: &Path,
    tenants: &str,
    extra_args: &[&str],
) -> (GatewayFleet, PathBuf) {
    let file = dir.join("tenants.yaml");
    std::fs::write(&file, tenants).unwrap();
    let file_arg = file.to_str().unwrap().to_owned();
    let team = |i: usize| vec![("team".to_owned(), if i < 2 { "a" } else { "b" }.to_owned())];
    let args: Vec<&str> = [
        "--tenants-file",
        &file_arg,
        "--discovery-token-poll",
        "200ms",
    ]
    .into_iter()
    .chain(extra_args.iter().copied())
    .collect();
    let fleet = GatewayFleet::start_labelled(dir, 4, team, &args).await;
    (fleet, file)
}

fn client() -> reqwest::Client {
    crate::support::http::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

/// `(status, body)` of an API call with `token`.
async fn call(
    method: reqwest::Method,
    url: String,
    token: &str,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let mut request = client().request(method, &url).bearer_auth(token);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.unwrap();
    let status = response.status();
    let body = response.json().await.unwrap_or(Value::Null);
    (status, body)
}

/// The names of the proxies `GET /v1/proxies` lists for `token`.
async fn listed(fleet: &GatewayFleet, token: &str) -> BTreeSet<String> {
    let url = format!("{}/v1/proxies", fleet.operator.api());
    let (status, body) = call(reqwest::Method::GET, url, token, None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    body["proxies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap().to_owned())
        .collect()
}

/// Acquires a lease for `token` (201 asserted) and returns its body.
async fn lease(fleet: &GatewayFleet, token: &str, body: Value) -> Value {
    let url = format!("{}/v1/leases", fleet.operator.api());
    let (status, lease) = call(reqwest::Method::POST, url, token, Some(body)).await;
    assert_eq!(status, StatusCode::CREATED, "{lease}");
    lease
}

/// One plain-HTTP request through the gateway as `user` with `token`: its status and the
/// proxy it went through (`X-Proxy-Name`).
async fn through_gateway(fleet: &GatewayFleet, user: &str, token: &str) -> (u16, Option<String>) {
    let (status, head) = gateway_head(fleet, user, token).await;
    (
        status,
        header_value(&head, "x-proxy-name").map(str::to_owned),
    )
}

/// The status and the head of one plain-HTTP request through the gateway.
async fn gateway_head(fleet: &GatewayFleet, user: &str, token: &str) -> (u16, String) {
    let proxy = format!("http://{user}:{token}@{}", fleet.operator.gateway());
    let (code, head, stderr) = curl(
        DEADLINE,
        &[
            "-s",
            "-o",
            "/dev/null",
            "-D",
            "-",
            "-x",
            &proxy,
            &fleet.site.http("/page/1"),
        ],
    )
    .await;
    assert_eq!(code, 0, "curl: {stderr}");
    let status = head
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, head)
}

/// The HTML of `path` for a person signed in with `token`.
async fn signed_in_page(api: &str, token: &str, path: &str) -> String {
    let no_redirects = crate::support::http::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let signed_in = no_redirects
        .post(format!("{api}/signin"))
        .form(&[("token", token)])
        .send()
        .await
        .unwrap();
    let cookie = signed_in
        .headers()
        .get(reqwest::header::SET_COOKIE)
        .and_then(|h| h.to_str().ok())
        .and_then(|h| h.split(';').next())
        .expect("a session cookie")
        .to_owned();
    client()
        .get(format!("{api}{path}"))
        .header(reqwest::header::COOKIE, cookie)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

fn names(list: &[&str]) -> BTreeSet<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tenant_sees_and_leases_only_its_scope_through_the_api_gateway_and_page() {
    let dir = tempfile::tempdir().unwrap();
    let (fleet, _) = fleet_of_two_teams(dir.path(), &two_teams(&[TEAM_A])).await;

    assert_eq!(listed(&fleet, TEAM_A).await, names(&["gw-0", "gw-1"]));
    assert_eq!(listed(&fleet, TEAM_B).await, names(&["gw-2", "gw-3"]));
    assert_eq!(
        listed(&fleet, TOKEN).await,
        names(&["gw-0", "gw-1", "gw-2", "gw-3"]),
        "the token file's tokens are the unrestricted tenant default"
    );

    // Leases: only from the scope, whatever the selector asks.
    for _ in 0..3 {
        let a = lease(&fleet, TEAM_A, json!({"target": "a.example"})).await;
        assert!(
            ["gw-0", "gw-1"].contains(&a["proxy"]["name"].as_str().unwrap()),
            "{a}"
        );
    }
    let url = format!("{}/v1/leases", fleet.operator.api());
    let (status, refused) = call(
        reqwest::Method::POST,
        url,
        TEAM_B,
        Some(json!({"selector": {"team": "a"}})),
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT, "{refused}");
    assert_eq!(
        refused["considered"], 0,
        "team-a's proxies are not team-b's to consider"
    );

    // The gateway: each team's requests leave through its own proxies.
    for (token, mine) in [
        (TEAM_A, ["default/gw-0", "default/gw-1"]),
        (TEAM_B, ["default/gw-2", "default/gw-3"]),
    ] {
        for i in 0..3 {
            let (status, proxy) = through_gateway(&fleet, &format!("crawler{i}"), token).await;
            assert_eq!(status, 200);
            let proxy = proxy.expect("the gateway names the proxy");
            assert!(mine.contains(&proxy.as_str()), "{token}: {proxy}");
        }
    }
    let (status, proxy) = through_gateway(&fleet, "crawler;team=a", TEAM_B).await;
    assert_eq!(
        (status, proxy),
        (503, None),
        "team-b cannot ask for team-a's proxies"
    );

    // Over its quota of one session, the gateway answers in a way no target's ban looks like.
    let (status, _) = gateway_head(&fleet, "crawler;session=one", TEAM_B).await;
    assert_eq!(status, 200);
    let (status, head) = gateway_head(&fleet, "crawler;session=two", TEAM_B).await;
    assert_eq!(status, 503, "{head}");
    assert_eq!(
        header_value(&head, "proxy-status"),
        Some("proxy-operator; error=http_request_denied; details=\"quota_exceeded\""),
        "{head}"
    );
    assert!(header_value(&head, "retry-after").is_some(), "{head}");

    // The status page's data: each team sees its proxies and its own usage.
    let url = format!("{}/v1/status/proxies", fleet.operator.api());
    let (status, page) = call(reqwest::Method::GET, url, TEAM_B, None).await;
    assert_eq!(status, StatusCode::OK, "{page}");
    let rows: BTreeSet<String> = page["proxies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(rows, names(&["gw-2", "gw-3"]), "{page}");
    let url = format!("{}/v1/status/fleet", fleet.operator.api());
    // Its three API leases, once the gateway has given back its connections' leases.
    let deadline = Instant::now() + DEADLINE;
    let view = loop {
        let (_, view) = call(reqwest::Method::GET, url.clone(), TEAM_A, None).await;
        if view["tenants"][0]["leases"] == 3 || Instant::now() > deadline {
            break view;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(view["proxies"]["total"], 2, "{view}");
    let tenants = view["tenants"].as_array().unwrap();
    assert_eq!(tenants.len(), 1, "a team sees its own usage only: {view}");
    assert_eq!(tenants[0]["name"], "team-a");
    assert_eq!(tenants[0]["leases"], 3, "{view}");
    assert_eq!(tenants[0]["leaseQuota"], 10);
    let (_, everything) = call(reqwest::Method::GET, url, TOKEN, None).await;
    let seen: BTreeSet<String> = everything["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        seen,
        names(&["default", "team-a", "team-b"]),
        "{everything}"
    );
    // The page itself: the default tenant's fleet view lists every tenant's usage.
    let page = signed_in_page(fleet.operator.api(), TOKEN, "/").await;
    assert!(page.contains("id=\"tenants\""), "{page}");
    for name in ["team-a", "team-b"] {
        assert!(
            page.contains(&format!("data-tenant=\"{name}\"")),
            "{name}: {page}"
        );
    }
    let page = signed_in_page(fleet.operator.api(), TEAM_B, "/").await;
    assert!(page.contains("data-tenant=\"team-b\"") && !page.contains("data-tenant=\"team-a\""));
    let url = format!("{}/v1/status/events", fleet.operator.api());
    let (_, events) = call(reqwest::Method::GET, url, TEAM_B, None).await;
    let events = events["events"].as_array().unwrap();
    assert!(!events.is_empty());
    assert!(
        events.iter().all(|e| e["tenant"] == "team-b"),
        "team-b reads its own history only: {events:?}"
    );
    // Spend and charts: team-b's own bytes only, priced per GB and no hours; the default
    // tenant sees both teams' (once the ledger's writer has the hour's rows).
    let spend_url = format!("{}/v1/status/spend", fleet.operator.api());
    let deadline = Instant::now() + DEADLINE;
    let everything = loop {
        let (status, view) = call(reqwest::Method::GET, spend_url.clone(), TOKEN, None).await;
        assert_eq!(status, StatusCode::OK, "{view}");
        if view["day"]["tenants"].as_array().map_or(0, Vec::len) >= 2 || Instant::now() > deadline {
            break view;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let named = |rows: &Value| -> BTreeSet<String> {
        rows.as_array()
            .unwrap()
            .iter()
            .map(|r| r["name"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(
        named(&everything["day"]["tenants"]),
        names(&["team-a", "team-b"]),
        "{everything}"
    );
    let (status, own) = call(reqwest::Method::GET, spend_url, TEAM_B, None).await;
    assert_eq!(status, StatusCode::OK, "{own}");
    assert_eq!(named(&own["day"]["tenants"]), names(&["team-b"]), "{own}");
    let proxies = named(&own["day"]["proxies"]);
    assert!(
        !proxies.is_empty() && proxies.is_subset(&names(&["default/gw-2", "default/gw-3"])),
        "{own}"
    );
    assert!(
        own["day"]["proxies"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["hoursSpend"] == 0.0),
        "a tenant's view has no hours: {own}"
    );
    let url = format!("{}/v1/status/charts", fleet.operator.api());
    let (_, charts) = call(reqwest::Method::GET, url, TEAM_B, None).await;
    assert_eq!(named(&charts["tenants"]), names(&["team-b"]), "{charts}");
    assert!(
        charts["targets"]
            .as_array()
            .unwrap()
            .iter()
            .all(|t| t.get("successRate").is_none()),
        "the fleet's per-target rates are the default tenant's: {charts}"
    );

    // The ledger records who held what.
    let ledger = fleet.operator.ledger();
    assert_eq!(
        sqlite3(
            &ledger,
            "SELECT tenant, COUNT(*) FROM leases GROUP BY tenant ORDER BY tenant"
        ),
        "team-a|6\nteam-b|4"
    );
    let metrics = fleet.metrics().await;
    assert!(
        metrics.contains("proxy_operator_tenant_leases_active{tenant=\"team-a\"}"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_can_neither_see_nor_change_another_tenants_lease_or_session() {
    let dir = tempfile::tempdir().unwrap();
    let (fleet, _) = fleet_of_two_teams(dir.path(), &two_teams(&[TEAM_A])).await;
    let api = fleet.operator.api().to_owned();
    let body = json!({"target": "shop.example", "requestID": "crawl-42"});
    let a = lease(&fleet, TEAM_A, body.clone()).await;
    let id = a["leaseID"].as_str().unwrap().to_owned();

    // Another tenant's lease answers exactly as an unknown one.
    for (method, path, body, unknown) in [
        (
            reqwest::Method::GET,
            format!("/v1/leases/{id}"),
            None,
            StatusCode::NOT_FOUND,
        ),
        (
            reqwest::Method::POST,
            format!("/v1/leases/{id}/renew"),
            Some(json!({})),
            StatusCode::NOT_FOUND,
        ),
        (
            reqwest::Method::POST,
            format!("/v1/leases/{id}/report"),
            Some(json!({"result": "blocked"})),
            StatusCode::NOT_FOUND,
        ),
        (
            reqwest::Method::DELETE,
            format!("/v1/leases/{id}"),
            None,
            StatusCode::NO_CONTENT,
        ),
    ] {
        let (theirs, answer) =
            call(method.clone(), format!("{api}{path}"), TEAM_B, body.clone()).await;
        let nobody = path.replace(&id, "0".repeat(44).as_str());
        let (never, unknown_answer) =
            call(method.clone(), format!("{api}{nobody}"), TEAM_B, body).await;
        assert_eq!(
            (theirs, never),
            (unknown, unknown),
            "{method} {path}: {answer}"
        );
        assert_eq!(
            answer["error"], unknown_answer["error"],
            "{method} {path}: the same answer as for a lease that never was"
        );
    }
    let (status, still) = call(
        reqwest::Method::GET,
        format!("{api}/v1/leases/{id}"),
        TEAM_A,
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        still["state"], "active",
        "team-b's release did nothing: {still}"
    );
    assert_eq!(
        sqlite3(
            &fleet.operator.ledger(),
            &format!(
                "SELECT COUNT(*) FROM lease_events WHERE lease_id = '{id}' AND kind = 'reported'"
            )
        ),
        "0",
        "team-b's report was not recorded"
    );

    // Request IDs are per tenant: team-b replaying team-a's request gets a lease of its own.
    let b = lease(&fleet, TEAM_B, body.clone()).await;
    assert_ne!(b["leaseID"], a["leaseID"]);
    let url = format!("{api}/v1/leases");
    let (status, replay) = call(reqwest::Method::POST, url, TEAM_A, Some(body)).await;
    assert_eq!(status, StatusCode::OK, "team-a's own replay: {replay}");
    assert_eq!(replay["leaseID"], a["leaseID"]);

    // Sessions: team-a's session s1 is not team-b's to report on or end.
    let (status, proxy) = through_gateway(&fleet, "crawler;session=s1", TEAM_A).await;
    assert_eq!(status, 200);
    let proxy = proxy.unwrap();
    let (status, answer) = call(
        reqwest::Method::POST,
        format!("{api}/v1/sessions/s1/report"),
        TEAM_B,
        Some(json!({"result": "blocked"})),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{answer}");
    assert_eq!(answer["error"], "unknown_session");
    let (status, _) = call(
        reqwest::Method::DELETE,
        format!("{api}/v1/sessions/s1"),
        TEAM_B,
        None,
    )
    .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (_, again) = through_gateway(&fleet, "crawler;session=s1", TEAM_A).await;
    assert_eq!(
        again.as_deref(),
        Some(proxy.as_str()),
        "the session kept its proxy"
    );
    assert_eq!(
        sqlite3(
            &fleet.operator.ledger(),
            "SELECT COUNT(*) FROM active_leases WHERE tenant = 'team-a' AND session = 's1'"
        ),
        "1"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_token_and_a_broken_file_apply_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let (fleet, file) = fleet_of_two_teams(dir.path(), &two_teams(&[TEAM_A])).await;
    let api = fleet.operator.api().to_owned();
    let proxies = |token: &'static str| {
        let url = format!("{api}/v1/proxies");
        async move { call(reqwest::Method::GET, url, token, None).await.0 }
    };
    assert_eq!(proxies(TEAM_A_NEXT).await, StatusCode::UNAUTHORIZED);

    // Rotation: the new token next to the old, then the old removed.
    replace_file(&file, &two_teams(&[TEAM_A, TEAM_A_NEXT]));
    let deadline = Instant::now() + DEADLINE;
    while proxies(TEAM_A_NEXT).await != StatusCode::OK {
        assert!(Instant::now() < deadline, "the new token never worked");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(listed(&fleet, TEAM_A_NEXT).await, names(&["gw-0", "gw-1"]));
    replace_file(&file, &two_teams(&[TEAM_A_NEXT]));
    while proxies(TEAM_A).await != StatusCode::UNAUTHORIZED {
        assert!(Instant::now() < deadline, "the old token kept working");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, _) = through_gateway(&fleet, "crawler", TEAM_A).await;
    assert_eq!(status, 407, "the gateway takes the same tokens");

    // A broken file is logged, and the last good tenants stay in force.
    replace_file(
        &file,
        "tenants:\n  - name: team-a\n    tokens: [\"not-a-digest\"]\n",
    );
    let log = || fleet.operator.log();
    wait_until("the broken file to be logged", || {
        log().contains("line 3: tenants[0].tokens[0]")
            && log().contains("keeping the previous tenants")
    })
    .await;
    assert_eq!(proxies(TEAM_A_NEXT).await, StatusCode::OK);
    assert_eq!(proxies(TEAM_B).await, StatusCode::OK);
    assert_eq!(proxies(TEAM_A).await, StatusCode::UNAUTHORIZED);
}

#[test]
fn a_broken_tenants_file_stops_start_up_naming_its_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tenants.yaml");
    std::fs::write(
        &file,
        "tenants:\n  - name: team-a\n    tokens: [\"sha256:00\"]\n",
    )
    .unwrap();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_proxy-operator"))
        .args([
            "standalone",
            "--inventory",
            "/nonexistent",
            "--tenants-file",
        ])
        .arg(&file)
        .env_remove("DISCOVERY_TOKEN")
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!(
            "--tenants-file {}: line 3: tenants[0].tokens[0]",
            file.display()
        )),
        "{stderr}"
    );
}

#[test]
fn a_byte_budget_without_the_ledgers_accounting_stops_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tenants.yaml");
    std::fs::write(&file, budget_of_team_a(1_000_000)).unwrap();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_proxy-operator"))
        .args([
            "standalone",
            "--inventory",
            "/nonexistent",
            "--gateway-no-traffic-ledger",
            "--tenants-file",
        ])
        .arg(&file)
        .env_remove("DISCOVERY_TOKEN")
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!(
            "--gateway-no-traffic-ledger: tenant team-a of --tenants-file {} has a bytesPerDay \
             quota",
            file.display()
        )),
        "{stderr}"
    );
}

/// The tenants of the load tests: `quota-leases` may hold 5 leases, `quota-rate` acquire 20 a
/// second with a burst of 5.
const LEASES_TOKEN: &str = "quota-leases-token-0123456789";
const RATE_TOKEN: &str = "quota-rate-token-0123456789ab";
const LEASE_QUOTA: i64 = 5;
const RATE: f64 = 20.0;
const BURST: usize = 5;
const CRAWLERS: usize = 32;
const LOAD: Duration = Duration::from_secs(11);

fn quota_tenants() -> String {
    format!(
        "tenants:
  - name: quota-leases
    tokens: [\"{}\"]
    quotas: {{leases: {LEASE_QUOTA}}}
  - name: quota-rate
    tokens: [\"{}\"]
    quotas: {{acquiresPerSecond: {RATE}, burst: {BURST}}}
",
        digest(LEASES_TOKEN),
        digest(RATE_TOKEN)
    )
}

/// What the crawlers of one tenant saw.
#[derive(Default)]
struct Seen {
    /// Leases answered 201.
    granted: Mutex<Vec<String>>,
    refused: AtomicUsize,
    /// Leases held at once, counted from each 201 to the release's request: a lower bound
    /// of what the ledger counted, so it can never exceed the quota.
    holding: AtomicI64,
    most_held: AtomicI64,
}

/// One crawler: acquire, hold briefly, release, until `stop`; over quota, ask again soon (the
/// load stays on). `apis` are asked in turn.
async fn crawl(
    http: reqwest::Client,
    apis: Arc<Mutex<Vec<String>>>,
    token: &'static str,
    seen: Arc<Seen>,
    stop: Arc<AtomicBool>,
    offset: usize,
) {
    let mut turn = offset;
    while !stop.load(Ordering::Relaxed) {
        turn += 1;
        let api = {
            let apis = apis.lock().unwrap();
            apis[turn % apis.len()].clone()
        };
        let answer = http
            .post(format!("{api}/v1/leases"))
            .bearer_auth(token)
            .json(&json!({"selector": {"pool": POOL}, "ttlSeconds": 300}))
            .send()
            .await;
        let Ok(answer) = answer else {
            // A replica killed mid-request: asked again elsewhere.
            continue;
        };
        match answer.status() {
            StatusCode::CREATED => {
                let lease: Value = answer.json().await.unwrap_or_default();
                let id = lease["leaseID"].as_str().unwrap_or_default().to_owned();
                let now = seen.holding.fetch_add(1, Ordering::SeqCst) + 1;
                seen.most_held.fetch_max(now, Ordering::SeqCst);
                seen.granted.lock().unwrap().push(id.clone());
                tokio::time::sleep(Duration::from_millis(20)).await;
                seen.holding.fetch_sub(1, Ordering::SeqCst);
                // Released on this replica or, if it is gone, on the next.
                for attempt in 0..3 {
                    let api = {
                        let apis = apis.lock().unwrap();
                        apis[(turn + attempt) % apis.len()].clone()
                    };
                    let released = http
                        .delete(format!("{api}/v1/leases/{id}"))
                        .bearer_auth(token)
                        .send()
                        .await;
                    if released.is_ok_and(|r| r.status() == StatusCode::NO_CONTENT) {
                        break;
                    }
                }
            }
            StatusCode::TOO_MANY_REQUESTS => {
                let body: Value = answer.json().await.unwrap_or_default();
                assert_eq!(body["error"], "quota_exceeded", "{body}");
                seen.refused.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            _ => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
}

/// The largest number of `tenant`'s leases counting at any of its grants, from the history in
/// decision order (see `LedgerDb::most_held_at_any_grant`: a tenant's acquires hold its quota
/// row, or the SQLite writer, from their check to their commit).
fn most_held_by_tenant(db: &LedgerDb<'_>, tenant: &str) -> i64 {
    db.query(&format!(
        "SELECT COALESCE(MAX((
             SELECT count(*) FROM lease_events m
             WHERE m.kind = 'acquired' AND m.tenant = a.tenant AND m.seq <= a.seq
               AND m.expires_at > a.at
               AND NOT EXISTS (SELECT 1 FROM lease_events r WHERE r.lease_id = m.lease_id
                               AND r.kind = 'released' AND r.seq < a.seq)
         )), 0) FROM lease_events a WHERE a.kind = 'acquired' AND a.tenant = '{tenant}';"
    ))
    .parse()
    .unwrap_or(i64::MAX)
}

/// The most of `tenant`'s grants in any window of `window_ms`, from the history's times.
fn most_granted_in_any_window(db: &LedgerDb<'_>, tenant: &str, window_ms: i64) -> (usize, usize) {
    let times: Vec<i64> = db
        .query(&format!(
            "SELECT at FROM lease_events WHERE kind = 'acquired' AND tenant = '{tenant}' ORDER BY at"
        ))
        .lines()
        .filter_map(|l| l.parse().ok())
        .collect();
    let mut most = 0;
    let mut start = 0;
    for end in 0..times.len() {
        while times[end] - times[start] >= window_ms {
            start += 1;
        }
        most = most.max(end - start + 1);
    }
    (most, times.len())
}

/// 32 crawlers (16 per tenant) acquiring and releasing for [`LOAD`] against `replicas` (one
/// killed with SIGKILL midway when `kill` is set); both quotas hold, in what the crawlers saw
/// and in the ledger's history, and every lease answered 201 is in the ledger.
async fn quotas_hold_under_load(mut replicas: Vec<Operator>, db: LedgerDb<'_>, kill: bool) {
    let http = http_client(CRAWLERS, Duration::from_secs(30));
    for replica in &replicas {
        crawl_load::wait_all_healthy(&http, replica, Duration::from_secs(90)).await;
    }
    let apis = Arc::new(Mutex::new(
        replicas
            .iter()
            .map(|r| r.api().to_owned())
            .collect::<Vec<_>>(),
    ));
    let stop = Arc::new(AtomicBool::new(false));
    let leases = Arc::new(Seen::default());
    let rate = Arc::new(Seen::default());
    let mut crawlers = Vec::new();
    for i in 0..CRAWLERS {
        let (token, seen) = match i % 2 {
            0 => (LEASES_TOKEN, leases.clone()),
            _ => (RATE_TOKEN, rate.clone()),
        };
        crawlers.push(tokio::spawn(crawl(
            http.clone(),
            apis.clone(),
            token,
            seen,
            stop.clone(),
            i,
        )));
    }
    let started = Instant::now();
    if kill {
        tokio::time::sleep(LOAD / 3).await;
        let victim = replicas.len() - 1;
        replicas[victim].kill_9();
        let survivors: Vec<String> = replicas[..victim]
            .iter()
            .map(|r| r.api().to_owned())
            .collect();
        *apis.lock().unwrap() = survivors;
    }
    tokio::time::sleep(LOAD.saturating_sub(started.elapsed())).await;
    stop.store(true, Ordering::Relaxed);
    for crawler in crawlers {
        crawler.await.unwrap();
    }

    let refused = leases.refused.load(Ordering::Relaxed);
    assert!(
        refused > 0,
        "32 crawlers never met the lease quota: the test would prove nothing"
    );
    assert!(
        leases.most_held.load(Ordering::SeqCst) <= LEASE_QUOTA,
        "crawlers held {} leases at once",
        leases.most_held.load(Ordering::SeqCst)
    );
    let held = most_held_by_tenant(&db, "quota-leases");
    assert!(
        held <= LEASE_QUOTA,
        "{} held {held} leases at a grant",
        db.name()
    );
    assert_eq!(held, LEASE_QUOTA, "the quota was reached");
    let (most, total) = most_granted_in_any_window(&db, "quota-rate", 10_000);
    let bound = (10.0 * RATE) as usize + BURST;
    assert!(most <= bound, "{most} grants in 10 s, over {bound}");
    assert!(
        total >= (RATE * LOAD.as_secs_f64() * 0.5) as usize,
        "only {total} grants of quota-rate in {LOAD:?}: the bucket was never the limit"
    );
    assert!(rate.refused.load(Ordering::Relaxed) > 0);

    let in_ledger: HashSet<String> = db
        .query("SELECT lease_id FROM lease_events WHERE kind = 'acquired'")
        .lines()
        .map(str::to_owned)
        .collect();
    for seen in [&leases, &rate] {
        for id in seen.granted.lock().unwrap().iter() {
            assert!(
                in_ledger.contains(id),
                "lease {id} was answered 201 but {} lacks it",
                db.name()
            );
        }
    }
    eprintln!(
        "tenants: {} grants and {refused} refusals at the lease quota (most held {held}); \
         {total} grants at the rate quota (most in 10 s: {most} of {bound})",
        leases.granted.lock().unwrap().len(),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_hold_under_32_connections_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let target = Target::start();
    let squids = [Squid::start(), Squid::start()];
    let inventory_path = dir.path().join("inventory.yaml");
    std::fs::write(&inventory_path, inventory(&squids, &target.http_url())).unwrap();
    let tenants = dir.path().join("tenants.yaml");
    std::fs::write(&tenants, quota_tenants()).unwrap();
    let ledger = dir.path().join("ledger.db");
    let operator = Operator::start(
        &dir.path().join("operator.log"),
        &inventory_path,
        ledger.to_str().unwrap(),
        &["--tenants-file", tenants.to_str().unwrap()],
    );
    quotas_hold_under_load(vec![operator], LedgerDb::Sqlite(&ledger), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_hold_on_three_postgres_replicas_with_one_killed() {
    let Some(postgres) = Postgres::shared() else {
        return;
    };
    let database = postgres.database();
    let dir = tempfile::tempdir().unwrap();
    let target = Target::start();
    let squids = [Squid::start(), Squid::start()];
    let inventory_path = dir.path().join("inventory.yaml");
    std::fs::write(&inventory_path, inventory(&squids, &target.http_url())).unwrap();
    let tenants = dir.path().join("tenants.yaml");
    std::fs::write(&tenants, quota_tenants()).unwrap();
    let url = database.url();
    let replicas: Vec<Operator> = (0..3)
        .map(|r| {
            Operator::start(
                &dir.path().join(format!("replica-{r}.log")),
                &inventory_path,
                &url,
                &["--tenants-file", tenants.to_str().unwrap()],
            )
        })
        .collect();
    quotas_hold_under_load(replicas, LedgerDb::Postgres(&database), true).await;
    assert_eq!(
        database.psql("SELECT tenant FROM tenant_quotas ORDER BY tenant"),
        "quota-leases\nquota-rate",
        "each tenant with a quota has its row"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_that_left_a_tenants_scope_takes_no_renewal_and_no_more_of_its_requests() {
    let dir = tempfile::tempdir().unwrap();
    let (fleet, file) = fleet_of_two_teams(dir.path(), &two_teams(&[TEAM_A])).await;
    let api = fleet.operator.api().to_owned();
    let held = lease(&fleet, TEAM_A, json!({})).await;
    let id = held["leaseID"].as_str().unwrap().to_owned();
    let (status, proxy) = through_gateway(&fleet, "crawler;session=s1", TEAM_A).await;
    assert_eq!(status, 200);
    assert!(proxy.is_some());

    // Team-a's scope shrinks to a label no proxy carries.
    replace_file(
        &file,
        &two_teams(&[TEAM_A]).replacen("{team: a}", "{team: gone}", 1),
    );
    let renew = format!("{api}/v1/leases/{id}/renew");
    let deadline = Instant::now() + DEADLINE;
    let refused = loop {
        let (status, body) = call(
            reqwest::Method::POST,
            renew.clone(),
            TEAM_A,
            Some(json!({})),
        )
        .await;
        if status != StatusCode::OK || Instant::now() > deadline {
            break (status, body);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(refused.0, StatusCode::CONFLICT, "{}", refused.1);
    assert_eq!(refused.1["error"], "proxy_out_of_scope");
    // Its lease is still its own to report on and give back.
    let (status, _) = call(
        reqwest::Method::POST,
        format!("{api}/v1/leases/{id}/report"),
        TEAM_A,
        Some(json!({"result": "ok"})),
    )
    .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, _) = call(
        reqwest::Method::DELETE,
        format!("{api}/v1/leases/{id}"),
        TEAM_A,
        None,
    )
    .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    // The gateway no longer sends the session's requests through its old proxy.
    let (status, proxy) = through_gateway(&fleet, "crawler;session=s1", TEAM_A).await;
    assert_eq!((status, proxy), (503, None));
}

/// `--gateway-max-tenant-connections`: a tenant of the file holds at most that many gateway
/// connections; the next is refused with `503 too_many_connections` and closed, other tenants
/// and the default tenant's tokens go on, and a closed connection makes room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_holds_at_most_its_cap_of_gateway_connections() {
    use support::raw::{closed_within, proxy_authorization, read_answer, send};
    use tokio::net::TcpStream;

    let dir = tempfile::tempdir().unwrap();
    let (fleet, _) = fleet_of_two_teams_with(
        dir.path(),
        &two_teams(&[TEAM_A]),
        &["--gateway-max-tenant-connections", "1"],
    )
    .await;
    let gateway = fleet.operator.gateway().to_owned();
    let url = fleet.site.http("/page/1");
    let request = |token: &str| {
        format!(
            "GET {url} HTTP/1.1\r\nHost: x\r\n{}\r\n",
            proxy_authorization("c", token)
        )
    };
    let open = async |token: &str| {
        let mut stream = TcpStream::connect(&gateway).await.unwrap();
        send(&mut stream, &request(token)).await;
        let answer = read_answer(&mut stream, DEADLINE).await;
        (stream, answer)
    };
    let (first, answer) = open(TEAM_A).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let (mut second, refused) = open(TEAM_A).await;
    assert_eq!(refused.status, 503, "{refused:?}");
    assert_eq!(refused.json()["error"], "too_many_connections");
    assert!(
        refused.json()["message"]
            .as_str()
            .is_some_and(|m| m.contains("team-a") && m.contains("--gateway-max-tenant-connections")),
        "{}",
        refused.body
    );
    assert!(
        closed_within(&mut second, DEADLINE).await,
        "the refused connection stays open"
    );
    // Another tenant, and the operators' tokens, are not held to team-a's cap.
    let (_b, answer) = open(TEAM_B).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let (_default_1, answer) = open(TOKEN).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let (_default_2, answer) = open(TOKEN).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let metrics = reqwest::get(fleet.operator.metrics_url())
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(
        support::operator::metric_sum(
            &metrics,
            "proxy_operator_gateway_connections_refused_total",
            &["reason=\"tenant_limit\""],
        ),
        1.0
    );
    // The first connection closes: team-a has room again.
    drop(first);
    let start = Instant::now();
    while open(TEAM_A).await.1.status != 200 {
        assert!(
            start.elapsed() < DEADLINE,
            "team-a has no room after a close"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A tenants file giving team-a a budget of `bytes_per_day` through the gateway, team-b none.
fn budget_of_team_a(bytes_per_day: u64) -> String {
    format!(
        "tenants:
  - name: team-a
    tokens: [\"{a}\"]
    scope:
      selector: {{team: a}}
    quotas: {{bytesPerDay: {bytes_per_day}}}
  - name: team-b
    tokens: [\"{b}\"]
    scope:
      selector: {{team: b}}
",
        a = digest(TEAM_A),
        b = digest(TEAM_B),
    )
}

/// One download of `url` through the gateway as `user` with `token`: the status, the head and
/// the body.
async fn download(
    fleet: &GatewayFleet,
    user: &str,
    token: &str,
    url: &str,
) -> (u16, String, String) {
    let proxy = format!("http://{user}:{token}@{}", fleet.operator.gateway());
    let dir = tempfile::tempdir().unwrap();
    let body = dir.path().join("body");
    let (code, head, stderr) = curl(
        DEADLINE,
        &[
            "-s",
            "-o",
            body.to_str().unwrap(),
            "-D",
            "-",
            "-x",
            &proxy,
            url,
        ],
    )
    .await;
    assert_eq!(code, 0, "curl: {stderr}");
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (
        status,
        head,
        std::fs::read_to_string(&body).unwrap_or_default(),
    )
}

/// A tenant's daily byte budget on the real binary: a session crawls until its tenant's bytes
/// reach the budget, then new work is refused, on its session too (`503`, `Proxy-Status`
/// `quota_exceeded`, `Retry-After` until midnight UTC), the lease API answers `429`, another
/// tenant goes on, and the tenant is over its budget by no more than the request that crossed
/// it (the work under way) and what a flush interval let through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daily_byte_budget_refuses_new_work_once_spent_and_is_over_by_the_work_under_way() {
    const BUDGET: u64 = 500_000;
    const ANSWER: u64 = 200_000;
    let dir = tempfile::tempdir().unwrap();
    let (fleet, _) = fleet_of_two_teams(dir.path(), &budget_of_team_a(BUDGET)).await;
    let ledger = fleet.operator.ledger();
    let team_a_bytes = || -> u64 {
        sqlite3(
            &ledger,
            "SELECT coalesce(SUM(up + down), 0) FROM traffic_hours WHERE tenant = 'team-a'",
        )
        .trim()
        .parse()
        .unwrap()
    };
    let url = fleet.site.http(&format!("/bytes/{ANSWER}"));
    // Three answers through one session: the third crosses the budget.
    for n in 1..=3_u64 {
        let (status, head, _) = download(&fleet, "crawler;session=s1", TEAM_A, &url).await;
        assert_eq!(status, 200, "answer {n}: {head}");
        wait_until("team-a's bytes in the ledger", || {
            team_a_bytes() >= n * ANSWER
        })
        .await;
    }
    // The flush that counted the third told the gateway: new work on the session is refused
    // (a request the gateway let through before it heard is what one flush interval allows).
    let mut let_through = 0;
    let started = Instant::now();
    let (head, body) = loop {
        let (status, head, body) = download(&fleet, "crawler;session=s1", TEAM_A, &url).await;
        if status == 503 {
            break (head, body);
        }
        assert_eq!(status, 200, "{head}");
        let_through += 1;
        assert!(started.elapsed() < DEADLINE, "never refused: {head}");
    };
    assert!(
        let_through <= 1,
        "{let_through} answers after the budget was spent"
    );
    assert_eq!(
        header_value(&head, "proxy-status"),
        Some("proxy-operator; error=http_request_denied; details=\"quota_exceeded\""),
        "{head}"
    );
    let retry_after: u64 = header_value(&head, "retry-after")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no Retry-After: {head}"));
    assert!((1..=86_400).contains(&retry_after), "{head}");
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["error"], "quota_exceeded", "{body}");
    assert_eq!(body["quota"], "bytesPerDay", "{body}");
    assert_eq!(body["limit"], BUDGET, "{body}");
    assert_eq!(body["tenant"], "team-a", "{body}");
    // A new connection without a session, and the lease API, are refused too.
    let (status, head, _) = download(&fleet, "crawler", TEAM_A, &url).await;
    assert_eq!(status, 503, "{head}");
    let url_api = format!("{}/v1/leases", fleet.operator.api());
    let answer = client()
        .post(&url_api)
        .bearer_auth(TEAM_A)
        .json(&json!({"ttlSeconds": 60}))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry_after = answer
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    assert!(retry_after.is_some_and(|s| (1..=86_400).contains(&s)));
    let refused: Value = answer.json().await.unwrap();
    assert_eq!(refused["error"], "quota_exceeded", "{refused}");
    assert_eq!(refused["quota"], "bytesPerDay", "{refused}");
    assert_eq!(
        refused["retryAfterSeconds"],
        json!(retry_after),
        "{refused}"
    );
    // Team B has no budget and goes on.
    let (status, head, _) = download(&fleet, "crawler", TEAM_B, &url).await;
    assert_eq!(status, 200, "{head}");
    // Over by the answer that crossed the budget and what one interval let through, each
    // within its heads' size.
    let heads = 4 * 1_024;
    let spent = team_a_bytes();
    assert!(
        spent <= BUDGET + (1 + let_through) * ANSWER + heads,
        "team-a used {spent} bytes"
    );
    let metrics = fleet.metrics().await;
    assert!(
        metrics.contains(
            "proxy_operator_tenant_refusals_total{reason=\"quota_bytesPerDay\",tenant=\"team-a\"}"
        ),
        "{metrics}"
    );
    // The gauges: the day's bytes as the ledger holds them, and the budget.
    assert!(
        metrics.contains(&format!(
            "proxy_operator_tenant_bytes_per_day_quota{{tenant=\"team-a\"}} {BUDGET}"
        )),
        "{metrics}"
    );
    let gauge = format!("proxy_operator_tenant_bytes_today{{tenant=\"team-a\"}} {spent}");
    let started = Instant::now();
    loop {
        let metrics = fleet.metrics().await;
        if metrics.contains(&gauge) {
            break;
        }
        assert!(started.elapsed() < DEADLINE, "no {gauge}: {metrics}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
