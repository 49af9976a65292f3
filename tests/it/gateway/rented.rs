//! Rotating upstreams through the binary: a vendor endpoint played by a real squid that takes
//! any password and picks the exit from the username's session part (`tcp_outgoing_address`
//! by `proxy_auth_regex`), and passes the username to the site, which answers it back
//! (`/whoami`), so every request says which vendor session carried it.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::path::Path;

use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::support::fleet::{LOOPBACK, TOKEN, proxy_url};
use crate::support::site::Site;
use crate::support::squid::{Squid, SquidOptions, vendor_exit};
use crate::support::standalone::Standalone;
use crate::support::{DEADLINE, sqlite3};

/// The vendor's username template (Oxylabs' spelling).
const TEMPLATE: &str = "customer-{username}-cc-{geo}-sessid-{session}-sesstime-{lifetime}";

/// Written in the more inventory documents of [`Vendor::start_with`] where the site's probe
/// URL goes.
const PROBE_URL: &str = "PROBE_URL";

/// A vendor endpoint, the site behind it and the binary in front.
struct Vendor {
    site: Site,
    squid: Squid,
    operator: Standalone,
    dir: std::path::PathBuf,
    /// More inventory documents (other proxies) and flags.
    more: (String, Vec<String>),
}

impl Vendor {
    async fn start(dir: &Path) -> Vendor {
        Vendor::start_with(dir, String::new(), Vec::new()).await
    }

    /// [`start`](Self::start) with `inventory` beside the vendor, and `args`.
    async fn start_with(dir: &Path, inventory: String, args: Vec<String>) -> Vendor {
        let site = Site::start();
        let squid = Squid::start_with(SquidOptions {
            vendor: true,
            ..SquidOptions::default()
        });
        let more = (inventory, args);
        let operator = launch(dir, &site, &squid, &more).await;
        Vendor {
            site,
            squid,
            operator,
            dir: dir.to_owned(),
            more,
        }
    }

    /// Kills the binary and starts it again on the same ledger.
    async fn restart(&mut self) {
        self.operator.kill();
        self.operator = launch(&self.dir, &self.site, &self.squid, &self.more).await;
    }

    fn client(&self, user: &str) -> reqwest::Client {
        let proxy = reqwest::Proxy::all(proxy_url(&self.operator, user)).expect("a proxy URL");
        reqwest::Client::builder()
            .proxy(proxy)
            .pool_max_idle_per_host(0)
            .build()
            .expect("a client")
    }

    /// `(status, exit address, vendor username)` of `GET path` through the gateway as `user`.
    async fn whoami(&self, user: &str, path: &str) -> (StatusCode, String, String) {
        let response = self
            .client(user)
            .get(self.site.http(path))
            .send()
            .await
            .expect("an answer");
        let status = response.status();
        let body = response.text().await.expect("a body");
        let (ip, username) = body.trim().split_once(' ').unwrap_or((&body, ""));
        (status, ip.to_owned(), username.to_owned())
    }
}

async fn launch(
    dir: &Path,
    site: &Site,
    squid: &Squid,
    more: &(String, Vec<String>),
) -> Standalone {
    let ca = dir.join("site-ca.pem");
    std::fs::write(&ca, site.ca_pem()).expect("write the site's CA");
    let inventory = format!(
        "apiVersion: v1
kind: Secret
metadata: {{name: vendor-credentials}}
stringData: {{username: acme, password: vendor-secret}}
---
apiVersion: crawl.example.com/v1alpha1
kind: Proxy
metadata:
  name: vendor
  labels: {{pool: rented}}
spec:
  mode: External
  endpoint:
    host: 127.0.0.1
    port: {port}
    credentialsSecretRef: {{name: vendor-credentials}}
    rotating:
      usernameTemplate: \"{TEMPLATE}\"
      sessionMinutes: 10
      defaults: {{geo: us}}
      maxSessions: 500
  healthCheck:
    probeURL: {probe}
    interval: 1s
    timeout: 1s
---
{more}",
        port = squid.port(),
        probe = site.http("/generate_204"),
        more = more.0.replace(PROBE_URL, &site.http("/generate_204")),
    );
    let ports = format!("{},{}", site.http_port(), site.https_port());
    let mut operator = Standalone::start_inventory(
        dir,
        &inventory,
        &ca,
        TOKEN,
        &[
            "--gateway-allowed-ports",
            &ports,
            "--gateway-allowed-destinations",
            LOOPBACK,
            "--inventory-poll",
            "200ms",
            "--lease-credentials",
        ]
        .into_iter()
        .chain(more.1.iter().map(String::as_str))
        .collect::<Vec<_>>(),
    );
    let proxies = 1 + more.0.matches("kind: Proxy").count();
    operator.wait_healthy(TOKEN, proxies, 2 * DEADLINE).await;
    operator
}

/// The vendor session spelled into `username`.
fn session_of(username: &str) -> &str {
    username
        .split_once("-sessid-")
        .and_then(|(_, rest)| rest.split('-').next())
        .unwrap_or_else(|| panic!("{username:?} names no vendor session"))
}

/// The exit the vendor gives a vendor session.
fn exit_of(session: &str) -> String {
    let first = session.chars().next().expect("a session id");
    vendor_exit(first).expect("a base32 session").to_string()
}

#[tokio::test]
async fn a_gateway_session_keeps_its_vendor_session_and_exit_across_requests_and_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut vendor = Vendor::start(dir.path()).await;
    let (status, ip, username) = vendor.whoami("crawler;session=s1", "/whoami").await;
    assert_eq!(status, StatusCode::OK, "{username}");
    let session = session_of(&username).to_owned();
    assert_eq!(
        username,
        format!("customer-acme-cc-us-sessid-{session}-sesstime-10"),
        "the template spelled with the Secret's username and the default geo"
    );
    assert_eq!(
        ip,
        exit_of(&session),
        "the target sees the vendor session's exit"
    );
    for _ in 0..3 {
        let (_, again_ip, again) = vendor.whoami("crawler;session=s1", "/whoami").await;
        assert_eq!(
            (again_ip.as_str(), again.as_str()),
            (ip.as_str(), username.as_str())
        );
    }
    vendor.restart().await;
    let (status, after_ip, after) = vendor.whoami("crawler;session=s1", "/whoami").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        (after_ip, after),
        (ip, username),
        "the same exit after a restart"
    );
    // The probe goes through one vendor session of its own, with the real password.
    let log = vendor.squid.access_log();
    assert!(
        log.lines()
            .any(|l| l.contains("/generate_204") && l.contains("customer-acme-cc-us-sessid-")),
        "{log}"
    );
    assert!(!vendor.operator.log().contains("vendor-secret"));
}

#[tokio::test]
async fn a_ban_moves_only_the_banned_vendor_session_and_cools_only_it() {
    let dir = tempfile::tempdir().unwrap();
    let vendor = Vendor::start(dir.path()).await;
    let mut sessions = Vec::new();
    for name in ["a", "b", "c"] {
        let user = format!("crawler;session={name}");
        let (_, _, username) = vendor.whoami(&user, "/whoami").await;
        sessions.push((user, session_of(&username).to_owned()));
    }
    let (banned_user, banned) = sessions[0].clone();
    // The site bans the first session's vendor session.
    let ban = format!("/ban-user/sessid-{banned}/429");
    let (status, _, _) = vendor.whoami(&banned_user, &ban).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    let (status, ip, username) = vendor.whoami(&banned_user, &ban).await;
    assert_eq!(status, StatusCode::OK, "moved to another vendor session");
    let moved = session_of(&username);
    assert_ne!(moved, banned);
    assert_eq!(ip, exit_of(moved));
    // The other sessions keep theirs, for that target too: only the vendor session cooled.
    for (user, session) in &sessions[1..] {
        let (status, _, username) = vendor.whoami(user, &ban).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            session_of(&username),
            session,
            "{user} kept its vendor session"
        );
    }
    let cooled = sqlite3(
        &vendor.operator.ledger(),
        "SELECT proxy_name, proxy_uid, target FROM cooldowns",
    );
    let (name, rest) = cooled.trim().split_once('|').unwrap_or_default();
    assert_eq!(name, "vendor", "{cooled}");
    assert!(
        rest.contains(&format!("/{banned}|127.0.0.1")),
        "only the vendor session: {cooled}"
    );
}

#[tokio::test]
async fn geo_reaches_the_username_and_a_hundred_sessions_get_a_hundred_vendor_sessions() {
    let dir = tempfile::tempdir().unwrap();
    let vendor = Vendor::start(dir.path()).await;
    let (status, _, username) = vendor.whoami("crawler;geo=de", "/whoami").await;
    assert_eq!(status, StatusCode::OK, "{username}");
    assert!(
        username.starts_with("customer-acme-cc-de-sessid-"),
        "{username}"
    );
    // A value that would spell another field is refused, never sent.
    let (status, _, body) = vendor
        .whoami("crawler;geo=de-zone-premium", "/whoami")
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    // 100 sessions held at once (each keeps its lease for its sessionTTL), opened 20 at a time.
    let fetches = (0..100).map(|i| {
        let user = format!("crawler;session=many{i}");
        let vendor = &vendor;
        async move { vendor.whoami(&user, "/whoami").await }
    });
    let answers: Vec<_> = futures::stream::iter(fetches)
        .buffer_unordered(20)
        .collect()
        .await;
    let sessions: BTreeSet<String> = answers
        .iter()
        .map(|(status, _, username)| {
            assert_eq!(*status, StatusCode::OK, "{username}");
            session_of(username).to_owned()
        })
        .collect();
    assert_eq!(
        sessions.len(),
        100,
        "no two gateway sessions share a vendor session"
    );
    let held = sqlite3(
        &vendor.operator.ledger(),
        "SELECT COUNT(*) FROM leases WHERE state = 'active' AND session LIKE 'many%'",
    );
    assert_eq!(held.trim(), "100", "the 100 sessions are held at once");
}

#[tokio::test]
async fn an_api_lease_on_a_vendor_endpoint_carries_its_own_username() {
    let dir = tempfile::tempdir().unwrap();
    let vendor = Vendor::start(dir.path()).await;
    let client = reqwest::Client::new();
    let acquire = |selector: Value| {
        client
            .post(format!("{}/v1/leases", vendor.operator.api()))
            .bearer_auth(TOKEN)
            .json(&json!({"selector": selector, "ttlSeconds": 60}))
            .send()
    };
    let mut usernames = BTreeSet::new();
    for _ in 0..2 {
        let response = acquire(json!({"pool": "rented", "geo": "fr"}))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::CREATED);
        let lease: Value = response.json().await.unwrap();
        let username = lease["proxy"]["username"].as_str().unwrap().to_owned();
        assert!(
            username.starts_with("customer-acme-cc-fr-sessid-"),
            "{lease}"
        );
        assert_eq!(lease["proxy"]["password"], "vendor-secret");
        usernames.insert(username);
    }
    assert_eq!(usernames.len(), 2, "each lease is its own vendor session");
    let response = acquire(json!({"geo": "fr;x"})).await.unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"], "vendor_username", "{body}");
}

#[tokio::test]
async fn a_ban_on_the_own_squid_sends_the_target_to_the_vendor_and_the_ledger_names_the_step() {
    let dir = tempfile::tempdir().unwrap();
    let own = Squid::start_with(SquidOptions {
        address: Some(Ipv4Addr::new(127, 0, 0, 5)),
        ..SquidOptions::default()
    });
    let rules = dir.path().join("rules.yaml");
    std::fs::write(
        &rules,
        "rules:
  - name: site
    hosts: [127.0.0.1]
    bans: [{status: [429], result: rate_limited}]
    action: fallback
    chain: own-then-rented
chains:
  - name: own-then-rented
    steps: [\"tier=own\", \"pool=rented\"]
",
    )
    .unwrap();
    let own_proxy = format!(
        "apiVersion: crawl.example.com/v1alpha1
kind: Proxy
metadata:
  name: own
  labels: {{tier: own}}
spec:
  mode: External
  endpoint: {{host: 127.0.0.5, port: {port}}}
  healthCheck: {{probeURL: \"{PROBE_URL}\", interval: 1s, timeout: 1s}}
",
        port = own.port()
    );
    let rules_flag = vec![
        "--gateway-rules-file".to_owned(),
        rules.display().to_string(),
    ];
    let vendor = Vendor::start_with(dir.path(), own_proxy, rules_flag).await;
    // The first request leaves through the first step: the own squid.
    let (status, ip, _) = vendor.whoami("crawler", "/whoami").await;
    assert_eq!((status, ip.as_str()), (StatusCode::OK, "127.0.0.5"));
    // The site bans the own squid: the GET is tried again on the chain's next step.
    let (status, ip, _) = vendor.whoami("crawler", "/ban/127.0.0.5/429").await;
    assert_eq!(status, StatusCode::OK, "{ip}");
    let vendor_exits = || (100..132).map(|n| Ipv4Addr::new(127, 0, 0, n).to_string());
    assert!(
        vendor_exits().any(|exit| exit == ip),
        "left through the vendor: {ip}"
    );
    // The next request for the target leaves through the vendor too.
    let (status, _, username) = vendor.whoami("crawler", "/whoami").await;
    assert_eq!(status, StatusCode::OK);
    assert!(username.contains("-sessid-"), "{username}");
    let steps = sqlite3(
        &vendor.operator.ledger(),
        "SELECT proxy_name, fallback_step FROM lease_events WHERE kind = 'acquired' \
         ORDER BY seq",
    );
    assert_eq!(steps.trim(), "own|1\nown|1\nvendor|2\nvendor|2", "{steps}");
    let scrape = reqwest::get(vendor.operator.metrics_url())
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let served = |step: &str| {
        format!(
            "proxy_operator_gateway_fallback_steps_total{{chain=\"own-then-rented\",step=\"{step}\"}} 2"
        )
    };
    assert!(
        scrape.contains(&served("1")) && scrape.contains(&served("2")),
        "{scrape}"
    );
    // A proxy URL names a chain for itself; an unknown one is refused.
    let (status, _, body) = vendor.whoami("crawler;fallback=nope", "/whoami").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let (status, _, username) = vendor
        .whoami("crawler;fallback=own-then-rented", "/whoami")
        .await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        username.contains("-sessid-"),
        "the own squid still cools: {username}"
    );
}
