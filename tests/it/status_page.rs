//! The status page of the binary: signed in and used in headless Chromium over real squids (a
//! squid killed while the page is open, a 429 through the gateway, filters, sorting, axe-core,
//! sign-out), and its sign-in cookie over plain HTTP (where it is accepted and where not, on a
//! second replica, after the token is rotated away), and the open page of
//! `--insecure-no-auth`.

use std::path::Path;
use std::time::Duration;

use reqwest::StatusCode;
use reqwest::header::{
    CONTENT_SECURITY_POLICY, CONTENT_TYPE, COOKIE, LOCATION, ORIGIN, SET_COOKIE,
};
use serde_json::{Value, json};

use crate::support::browser::{axe_core, chromium, run_script};
use crate::support::curl::{curl, header_value};
use crate::support::fleet::{GatewayFleet, TOKEN};
use crate::support::standalone::{ExternalProxy, Standalone};
use crate::support::{DEADLINE, sqlite3};

/// A client that shows redirects instead of following them.
fn client() -> reqwest::Client {
    crate::support::http::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

/// Posts the sign-in form with `token` (and `origin`, if any).
async fn sign_in(base: &str, token: &str, origin: Option<&str>) -> reqwest::Response {
    let mut request = client()
        .post(format!("{base}/signin"))
        .form(&[("token", token)]);
    if let Some(origin) = origin {
        request = request.header(ORIGIN, origin);
    }
    request.send().await.unwrap()
}

/// The `name=value` of the session cookie a sign-in answer sets, with its attributes.
fn session_cookie(response: &reqwest::Response) -> (String, String) {
    let header = response
        .headers()
        .get(SET_COOKIE)
        .expect("a Set-Cookie header")
        .to_str()
        .unwrap()
        .to_owned();
    let pair = header.split(';').next().unwrap().trim().to_owned();
    (pair, header)
}

async fn get_with(url: &str, cookie: &str) -> reqwest::Response {
    client()
        .get(url)
        .header(COOKIE, cookie)
        .send()
        .await
        .unwrap()
}

/// In Chromium: sign in, see the three proxies Ready, watch a killed squid's row turn
/// unhealthy without a reload and say why, filter and sort, find a 429's cooldown in the
/// per-target table, no serious or critical axe-core violation on any view, the icon served
/// and no console error on any view, sign out and the data routes answer 401.
#[tokio::test]
async fn chromium_signs_in_and_watches_the_fleet() {
    if chromium().is_none() {
        return;
    }
    let Some(axe) = axe_core() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut fleet = GatewayFleet::start(dir.path(), 3, &[]).await;
    let base = fleet.operator.api().to_owned();

    // Pages through the gateway, one session each: answers the gateway counts as successes.
    for n in 0..6 {
        let (code, _, _) = curl(
            DEADLINE,
            &[
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "-x",
                &fleet.proxy_url(&format!("crawler;session=s{n}")),
                &fleet.site.http(&format!("/page/{n}")),
            ],
        )
        .await;
        assert_eq!(code, 0);
    }
    // A 429 through the gateway, on plain HTTP, where the gateway sees it and reports it.
    let (_, head, _) = curl(
        DEADLINE,
        &[
            "-s",
            "-D",
            "-",
            "-o",
            "/dev/null",
            "-x",
            &fleet.proxy_url("crawler"),
            &fleet.site.http("/status/429?retry_after=600"),
        ],
    )
    .await;
    let banned = header_value(&head, "x-proxy-name")
        .unwrap_or_else(|| panic!("the gateway names the proxy: {head}"))
        .to_owned();
    let cooled = sqlite3(
        &fleet.operator.ledger(),
        "SELECT target FROM active_cooldowns",
    );
    assert!(!cooled.is_empty(), "the 429 put a cooldown in force");

    // The squid the browser test kills: another one than the banned proxy's.
    let killed = ["default/gw-0", "default/gw-1"]
        .into_iter()
        .find(|p| *p != banned)
        .unwrap()
        .to_owned();
    let pid = fleet.squid_of(&killed).pid().expect("the squid runs");
    let screenshot = dir.path().join("status-page.png");
    let seen = run_script(
        "status_page.py",
        &json!({
            "base": base,
            "token": TOKEN,
            "kill_pid": pid,
            "killed": killed,
            "target": cooled,
            "axe": axe,
            "screenshot": screenshot,
        }),
    )
    .await;
    let look = |key: &str| &seen[key];

    assert_eq!(
        look("unsigned_url"),
        &json!(format!("{base}/signin")),
        "{seen}"
    );
    assert_eq!(look("fleet_title"), "Fleet · proxy-operator", "{seen}");
    assert_eq!(look("cookie")["httpOnly"], true, "{seen}");
    assert_eq!(look("cookie")["sameSite"], "Strict", "{seen}");
    assert_eq!(look("cookie")["holds_token"], false, "{seen}");
    let expires_in = look("cookie")["expires_in"].as_f64().unwrap();
    assert!(
        (7.0 * 3600.0..=8.0 * 3600.0 + 60.0).contains(&expires_in),
        "the session expires: {seen}"
    );
    assert_eq!(look("token_in_page"), false);
    let all_ready =
        json!({"default/gw-0": "Ready", "default/gw-1": "Ready", "default/gw-2": "Ready"});
    assert_eq!(look("phases_before"), &all_ready, "{seen}");
    // The banned proxy's 429 counts against it; the others' pages for them.
    let badges = look("badges").as_object().unwrap();
    assert!(
        badges
            .values()
            .any(|b| b.as_str().unwrap().contains("good 100 %")),
        "{seen}"
    );
    let banned_badge = badges[&banned].as_str().unwrap();
    assert!(!banned_badge.contains("100 %"), "{banned_badge}: {seen}");
    assert_eq!(
        look("not_reloaded"),
        true,
        "the row changed by the live refresh: {seen}"
    );
    assert_eq!(look("phases_after")[&killed], "Unhealthy", "{seen}");
    // Why, instead of a latency: squid is gone, so its port refuses.
    let killed_health = look("killed_health").as_str().unwrap();
    assert!(
        killed_health.contains("unhealthy connect_refused") && !killed_health.contains(" ms"),
        "{killed_health}: {seen}"
    );

    assert_eq!(look("filtered_by_name"), &json!(["default/gw-1"]), "{seen}");
    assert_eq!(look("filtered_by_other_label"), &json!([]), "{seen}");
    assert_eq!(
        look("filtered_by_label"),
        &json!(["default/gw-0", "default/gw-1", "default/gw-2"]),
        "{seen}"
    );
    assert_eq!(
        look("sorted_by_name_desc"),
        &json!(["default/gw-2", "default/gw-1", "default/gw-0"]),
        "{seen}"
    );
    let sorted_url = look("sorted_url").as_str().unwrap();
    assert!(
        sorted_url.contains("label=pool%3Dgateway") && sorted_url.contains("order=desc"),
        "sorting keeps the filter: {sorted_url}"
    );
    assert_eq!(look("sorted_by_health").as_object().unwrap().len(), 3);

    let row = look("target_row")
        .as_str()
        .unwrap_or_else(|| panic!("a row for {cooled}: {seen}"));
    assert!(
        row.contains(&banned) && row.contains("rate_limited until"),
        "the cooldown and its end: {row}"
    );

    let proxy_page = look("proxy_page").as_str().unwrap();
    assert!(proxy_page.contains("unhealthy"), "{proxy_page}");
    assert!(proxy_page.contains("connect_refused"), "{proxy_page}");
    assert!(
        look("events").as_u64().unwrap() >= 2,
        "acquired and reported: {seen}"
    );

    assert_eq!(look("data_signed_in"), 200, "{seen}");
    assert_eq!(
        look("lease_with_cookie"),
        401,
        "the cookie leases nothing: {seen}"
    );
    for (path, violations) in look("violations").as_object().unwrap() {
        assert_eq!(violations, &json!([]), "axe-core on {path}");
    }
    assert_eq!(look("cookies_after"), &json!([]), "{seen}");
    assert_eq!(look("data_signed_out"), 401, "{seen}");
    assert_eq!(
        look("signed_out_url"),
        &json!(format!("{base}/signin")),
        "{seen}"
    );
    assert_eq!(look("errors"), &json!([]), "no console errors: {seen}");
    let console = look("console").as_array().unwrap();
    assert!(
        console.iter().all(|m| m["type"] != "error"),
        "every console message, the icon's included: {seen}"
    );
    let icons = look("icons").as_array().unwrap();
    assert!(
        !icons.is_empty(),
        "the browser fetched the page's icon: {seen}"
    );
    for icon in icons {
        assert_eq!(icon["status"], 200, "{icon}: {seen}");
        assert_eq!(icon["type"], "image/svg+xml", "{icon}: {seen}");
    }
    assert_eq!(
        look("default_icon"),
        &json!({"status": 200, "type": "image/svg+xml"}),
        "{seen}"
    );
    assert!(screenshot.is_file());
}

/// The spend view in Chromium with JavaScript off: after a download through the gateway, the
/// tenant's row is in the day's table and every chart is drawn (an image with a name, a
/// description and a data table), bars where bytes went; axe-core finds nothing serious.
#[tokio::test]
async fn chromium_shows_the_spend_charts_without_javascript_and_axe_passes() {
    if chromium().is_none() {
        return;
    }
    let Some(axe) = axe_core() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let fleet = GatewayFleet::start(dir.path(), 1, &[]).await;
    let base = fleet.operator.api().to_owned();
    let (code, _, err) = curl(
        DEADLINE,
        &[
            "-sS",
            "-o",
            "/dev/null",
            "-x",
            &fleet.proxy_url("charts"),
            &fleet.site.http("/bytes/100000"),
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    // The hourly rows are written by the ledger's writer: wait for the tenant's.
    let client = crate::support::http::client();
    let started = std::time::Instant::now();
    loop {
        let charts: Value = client
            .get(format!("{base}/v1/status/charts"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .expect("GET /v1/status/charts")
            .json()
            .await
            .expect("a ChartsView");
        let bytes = charts["tenants"]
            .as_array()
            .and_then(|tenants| tenants.iter().find(|t| t["name"] == "default"))
            .and_then(|t| t["bytes"].as_array())
            .map_or(0, |hours| {
                hours.iter().filter_map(Value::as_u64).sum::<u64>()
            });
        if bytes >= 100_000 {
            break;
        }
        assert!(started.elapsed() < DEADLINE, "no hourly bytes: {charts}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let seen = run_script(
        "spend_page.py",
        &json!({"base": base, "token": TOKEN, "axe": axe}),
    )
    .await;
    assert_eq!(seen["title"], "Spend · proxy-operator", "{seen}");
    let tenant_rows = seen["tenant_rows"].as_array().expect("rows");
    assert!(
        tenant_rows.iter().any(|row| row[0] == "default"),
        "the tenant's spend: {seen}"
    );
    let charts = seen["charts"].as_array().expect("charts");
    // The tenant and the one target: bytes, spend and success rate each.
    assert_eq!(charts.len(), 6, "{seen}");
    for chart in charts {
        assert_eq!(chart["role"], "img", "{chart}");
        let name = chart["name"].as_str().unwrap();
        assert!(
            name.contains(" | From ") || name.contains(" | No data"),
            "a title and a description: {chart}"
        );
        assert!(
            chart["width"].as_f64() > Some(100.0) && chart["height"].as_f64() > Some(20.0),
            "drawn: {chart}"
        );
        assert!(chart["rows"].as_u64() >= Some(24), "{chart}");
    }
    let bytes_chart = charts
        .iter()
        .find(|c| {
            c["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("Bytes per hour: default"))
        })
        .unwrap_or_else(|| panic!("the tenant's bytes: {seen}"));
    assert_eq!(bytes_chart["bars"], 1, "this hour's bar: {seen}");
    let rate_chart = charts
        .iter()
        .find(|c| {
            c["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("Success rate per minute: default"))
        })
        .unwrap_or_else(|| panic!("the tenant's success rate: {seen}"));
    assert!(
        rate_chart["lines"].as_u64() >= Some(1),
        "this minute's point: {seen}"
    );
    assert_eq!(seen["violations"], json!([]), "axe-core: {seen}");
    assert_eq!(seen["errors"], json!([]), "{seen}");
}

/// Over plain HTTP: a wrong token or another site's form signs nobody in; the cookie is
/// `HttpOnly`, `SameSite=Strict` and expires; it opens the pages and the `/v1/status` routes,
/// on a second replica too, never a `/v1` route that lists or changes leases; the pages carry
/// a strict CSP; rotating the token away ends the session; sign-out clears the cookie.
#[tokio::test]
async fn the_session_cookie_opens_only_the_page_and_its_data_routes() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    let rotated_token = "page-token-0123456789abcdef";
    std::fs::write(&tokens, format!("{rotated_token}\n")).unwrap();
    let tokens_arg = tokens.to_str().unwrap().to_owned();
    let fleet = GatewayFleet::start(
        dir.path(),
        1,
        &[
            "--discovery-token-file",
            &tokens_arg,
            "--discovery-token-poll",
            "200ms",
        ],
    )
    .await;
    let base = fleet.operator.api().to_owned();

    // The icon needs no sign-in, and carries the pages' headers.
    for path in ["/favicon.ico", "/assets/favicon.svg"] {
        let icon = client().get(format!("{base}{path}")).send().await.unwrap();
        assert_eq!(icon.status(), StatusCode::OK, "{path}");
        assert_eq!(icon.headers()[CONTENT_TYPE], "image/svg+xml", "{path}");
        assert!(
            icon.headers().contains_key(CONTENT_SECURITY_POLICY),
            "{path}"
        );
        assert!(icon.text().await.unwrap().starts_with("<svg"), "{path}");
    }

    let wrong = sign_in(&base, "not-the-token-0123456789", None).await;
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
    assert!(wrong.headers().get(SET_COOKIE).is_none());
    let elsewhere = sign_in(&base, rotated_token, Some("https://evil.example")).await;
    assert_eq!(elsewhere.status(), StatusCode::FORBIDDEN);
    assert!(elsewhere.headers().get(SET_COOKIE).is_none());

    let signed = sign_in(&base, rotated_token, Some(&base)).await;
    assert_eq!(signed.status(), StatusCode::SEE_OTHER);
    assert_eq!(signed.headers()[LOCATION], "/");
    let (cookie, header) = session_cookie(&signed);
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/", "Max-Age=28800"] {
        assert!(header.contains(attribute), "{attribute} in {header}");
    }
    assert!(!header.contains(rotated_token), "{header}");

    let page = get_with(&format!("{base}/"), &cookie).await;
    assert_eq!(page.status(), StatusCode::OK);
    let csp = page.headers()[CONTENT_SECURITY_POLICY]
        .to_str()
        .unwrap()
        .to_owned();
    for directive in [
        "default-src 'none'",
        "script-src 'self'",
        "frame-ancestors 'none'",
    ] {
        assert!(csp.contains(directive), "{directive} in {csp}");
    }
    let body = page.text().await.unwrap();
    assert!(!body.contains(rotated_token) && !body.contains("Open access"));
    for route in [
        "fleet",
        "proxies",
        "targets",
        "events",
        "proxies/default/gw-0",
    ] {
        let answer = get_with(&format!("{base}/v1/status/{route}"), &cookie).await;
        assert_eq!(answer.status(), StatusCode::OK, "{route}");
        let _: Value = answer.json().await.unwrap();
    }
    let bad = get_with(&format!("{base}/v1/status/proxies?page=0"), &cookie).await;
    assert_eq!(bad.status(), StatusCode::BAD_REQUEST);
    let unknown = get_with(&format!("{base}/v1/status/proxies/default/nope"), &cookie).await;
    assert_eq!(unknown.status(), StatusCode::NOT_FOUND);

    // Only the page's read-only routes take it.
    let http = client();
    let refused = [
        http.get(format!("{base}/v1/proxies")),
        http.post(format!("{base}/v1/leases"))
            .json(&json!({"selector": {}})),
        http.delete(format!("{base}/v1/leases/anything")),
        http.delete(format!("{base}/v1/sessions/s1")),
    ];
    for request in refused {
        let answer = request.header(COOKIE, &cookie).send().await.unwrap();
        assert_eq!(answer.status(), StatusCode::UNAUTHORIZED, "{answer:?}");
    }

    // Valid on another replica that holds the same tokens.
    let replica_dir = tempfile::tempdir().unwrap();
    std::fs::write(
        replica_dir.path().join("tokens"),
        format!("{rotated_token}\n"),
    )
    .unwrap();
    let replica = replica(&fleet, replica_dir.path()).await;
    let there = get_with(&format!("{}/v1/status/fleet", replica.api()), &cookie).await;
    assert_eq!(there.status(), StatusCode::OK);

    // Sign-out clears the cookie.
    let out = client()
        .post(format!("{base}/signout"))
        .header(COOKIE, &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(out.status(), StatusCode::SEE_OTHER);
    let (cleared, attributes) = session_cookie(&out);
    assert_eq!(cleared, "proxy_operator_session=");
    assert!(attributes.contains("Max-Age=0"), "{attributes}");

    // The token rotated away (the file re-read): its session ends at once, everywhere.
    std::fs::write(&tokens, "another-token-0123456789abc\n").unwrap();
    let deadline = std::time::Instant::now() + DEADLINE;
    loop {
        let answer = get_with(&format!("{base}/v1/status/fleet"), &cookie).await;
        if answer.status() == StatusCode::UNAUTHORIZED {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the session outlived its token"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let page = get_with(&format!("{base}/proxies"), &cookie).await;
    assert_eq!(page.status(), StatusCode::SEE_OTHER);
    assert_eq!(page.headers()[LOCATION], "/signin");
}

/// A second standalone process on the fleet's proxies, reading its tokens from `dir/tokens`.
async fn replica(fleet: &GatewayFleet, dir: &Path) -> Standalone {
    let tokens = dir.join("tokens");
    let ca = dir.join("site-ca.pem");
    std::fs::write(&ca, fleet.site.ca_pem()).unwrap();
    let tokens = tokens.to_str().unwrap().to_owned();
    let mut replica = Standalone::start(dir, &[], &ca, TOKEN, &["--discovery-token-file", &tokens]);
    replica.wait_healthy(TOKEN, 0, DEADLINE).await;
    replica
}

/// With `--insecure-no-auth` the page needs no sign-in and says on every view that it is open.
#[tokio::test]
async fn an_open_install_shows_the_page_to_anyone_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, crate::support::site::Site::start().ca_pem()).unwrap();
    let mut open = Standalone::start(dir.path(), &[], &ca, "", &["--insecure-no-auth"]);
    open.wait_healthy("", 0, DEADLINE).await;
    for path in ["/", "/proxies", "/targets", "/events"] {
        let answer = client()
            .get(format!("{}{path}", open.api()))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::OK, "{path}");
        let body = answer.text().await.unwrap();
        assert!(body.contains("Open access"), "{path}: {body}");
        assert!(!body.contains("Sign out"), "{path}");
    }
    let data = client()
        .get(format!("{}/v1/status/fleet", open.api()))
        .send()
        .await
        .unwrap();
    assert_eq!(data.status(), StatusCode::OK);
}

/// A fleet of 10,000 proxies: every view loads in Chromium in under a second (the proxies
/// table is paged, 100 rows a page), and so does the last page.
#[tokio::test]
async fn ten_thousand_proxies_load_in_under_a_second() {
    if chromium().is_none() {
        return;
    }
    const FLEET: usize = 10_000;
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, crate::support::site::Site::start().ca_pem()).unwrap();
    // Nothing listens on port 9: each probe fails at once, spread over the hour's interval.
    let proxies: Vec<ExternalProxy> = (0..FLEET)
        .map(|i| ExternalProxy {
            name: format!("p{i:05}"),
            labels: vec![("geo".into(), if i % 2 == 0 { "eu" } else { "us" }.into())],
            host: "127.0.0.1".into(),
            port: 9,
            max_leases: 4,
            probe_url: "http://127.0.0.1:9/".into(),
            interval: "1h",
            cordoned: false,
            socks5: false,
            credentials: None,
            cost: None,
        })
        .collect();
    let mut fleet = Standalone::start(dir.path(), &proxies, &ca, TOKEN, &[]);
    // A debug build checks 10,000 documents before it serves: seconds of CPU, many more while
    // the other tests share the two cores.
    let loaded = Duration::from_secs(180);
    fleet.wait_healthy(TOKEN, 0, loaded).await;
    let fleet_url = format!("{}/v1/status/fleet", fleet.api());
    let deadline = std::time::Instant::now() + loaded;
    loop {
        let view: Value = client()
            .get(&fleet_url)
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if view["proxies"]["total"] == FLEET {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the inventory loads: {view}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let seen = run_script(
        "page_load.py",
        &json!({
            "base": fleet.api(),
            "token": TOKEN,
            "paths": ["/", "/proxies", "/proxies?sort=latency&order=desc&label=geo%3Deu", "/proxies?page=100", "/targets", "/events"],
        }),
    )
    .await;
    assert_eq!(seen["rows"]["/proxies"], 100, "{seen}");
    assert_eq!(seen["rows"]["/proxies?page=100"], 100, "{seen}");
    for (path, ms) in seen["timings"].as_object().unwrap() {
        let ms = ms.as_f64().unwrap();
        assert!(ms < 1000.0, "{path} loaded in {ms:.0} ms: {seen}");
    }
    eprintln!("load times at {FLEET} proxies (ms): {}", seen["timings"]);
}
