//! Inside HTTPS with the crawlers users run, through the binary: Python `requests` and `httpx`
//! (verifying against the gateway's CA), Scrapy configured by settings only, curl, and Chromium
//! through Playwright trusting the CA in its NSS database (made with `certutil`), each asking
//! for `tls=inspect` in its proxy URL. The site bans one exit at a time (`/ban/{ip}/{code}`,
//! `/captcha/{ip}`, see `tests/support/site.rs`), so which exit a request left through decides
//! its answer: a ban the rules retry comes back `200` from another exit, the session moved;
//! a ban passed on is reported and the next request leaves through another exit. The ledger
//! file, read with `sqlite3`, shows the reports and the cooldowns.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdout};

use super::wait_for_ledger;
use crate::support::browser::{chromium, run_script};
use crate::support::curl::header_value;
use crate::support::fleet::{GatewayFleet, TOKEN};
use crate::support::gateway_ca::GatewayCa;
use crate::support::operator::metric_sum;
use crate::support::python::{python_with, script};
use crate::support::{required_tool, sqlite3};

/// The site's host, as the rules name it and the ledger records it as the target.
const SITE: &str = "127.0.0.1";

/// How long a ban cools an exit down for the site: short, so that the exits one client's
/// crawl cooled down are free again for the next client's (the fleet has three).
const COOLDOWN_SECONDS: u64 = 6;

/// The rules for the site: 403 and 429, and a `200` captcha page, are bans; an idempotent
/// request is retried on up to two other exits.
fn rules() -> String {
    format!(
        "rules:
  - name: site
    hosts: [\"{SITE}\"]
    bans:
      - status: [403]
        result: blocked
      - status: [429]
        result: rate_limited
      - status: [200]
        body: captcha
        result: blocked
    cooldown: {COOLDOWN_SECONDS}s
    action: retry
    retries: 2
"
    )
}

/// A fleet of `count` squids whose gateway intercepts with a CA of its own, trusts the site's
/// CA for the targets and reads [`rules`].
async fn intercepting_fleet(dir: &Path, count: usize) -> (GatewayFleet, GatewayCa) {
    let ca = GatewayCa::write(dir);
    let rules_file = dir.join("rules.yaml");
    std::fs::write(&rules_file, rules()).unwrap();
    let mut args = ca.args();
    args.extend([
        "--gateway-target-ca-file".to_owned(),
        dir.join("site-ca.pem").display().to_string(),
        "--gateway-rules-file".to_owned(),
        rules_file.display().to_string(),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let fleet = GatewayFleet::start(dir, count, &args).await;
    (fleet, ca)
}

/// One answer a crawler got, as `tests/python/inspect_crawl.py` prints it.
#[derive(Debug, Deserialize)]
struct Answer {
    path: String,
    status: u16,
    /// The address the site saw: the exit.
    ip: String,
    captcha: bool,
    proxy: Option<String>,
    lease: Option<String>,
    moved: Option<String>,
    ban_reported: Option<String>,
}

impl Answer {
    /// Checks the answer's status, the exit the gateway names and the proxy the session
    /// moved from (none: no `X-Proxy-Session-Moved`).
    #[track_caller]
    fn is(&self, kind: &str, status: u16, exit: &str, moved_from: Option<&str>) {
        assert_eq!(self.status, status, "{kind}: {self:?}");
        assert_eq!(self.proxy.as_deref(), Some(exit), "{kind}: {self:?}");
        assert_eq!(self.moved.as_deref(), moved_from, "{kind}: {self:?}");
    }
}

/// A crawl of the site's paths in turn by one client; `{ip}` in a path is the exit of the
/// answer before it.
enum Crawl {
    /// `inspect_crawl.py` with `requests`, `httpx` or `scrapy`, read line by line as it goes.
    Python {
        kind: &'static str,
        child: Box<Child>,
        lines: tokio::io::Lines<BufReader<ChildStdout>>,
        stderr: PathBuf,
    },
    /// One curl per path (a new connection each, so a new CONNECT each).
    Curl {
        proxy: String,
        ca: String,
        base: String,
        paths: std::vec::IntoIter<String>,
        ip: String,
    },
}

impl Crawl {
    fn python(
        python: &str,
        kind: &'static str,
        dir: &Path,
        proxy: &str,
        ca: &Path,
        base: &str,
        paths: &[&str],
    ) -> Crawl {
        let stderr = dir.join(format!("{kind}.stderr"));
        let mut child = tokio::process::Command::new(python)
            .arg(script("inspect_crawl.py"))
            .args([kind, proxy, &ca.display().to_string(), base])
            .args(paths)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .kill_on_drop(true)
            .spawn()
            .expect("run python3");
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        Crawl::Python {
            kind,
            child: Box::new(child),
            lines,
            stderr,
        }
    }

    fn curl(proxy: &str, ca: &Path, base: &str, paths: &[&str]) -> Crawl {
        Crawl::Curl {
            proxy: proxy.to_owned(),
            ca: ca.display().to_string(),
            base: base.to_owned(),
            paths: paths
                .iter()
                .map(|p| (*p).to_owned())
                .collect::<Vec<_>>()
                .into_iter(),
            ip: String::new(),
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Crawl::Python { kind, .. } => kind,
            Crawl::Curl { .. } => "curl",
        }
    }

    /// The next answer.
    async fn next(&mut self) -> Answer {
        match self {
            Crawl::Python {
                kind,
                lines,
                stderr,
                ..
            } => {
                let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
                    .await
                    .unwrap_or_else(|_| panic!("{kind}: no answer within 60 s"))
                    .unwrap();
                let Some(line) = line else {
                    panic!(
                        "{kind} ended early:\n{}",
                        std::fs::read_to_string(stderr).unwrap_or_default()
                    );
                };
                serde_json::from_str(&line).unwrap_or_else(|e| panic!("{kind}: {e}: {line}"))
            }
            Crawl::Curl {
                proxy,
                ca,
                base,
                paths,
                ip,
            } => {
                let path = paths.next().expect("a path left").replace("{ip}", ip);
                let url = format!("{base}{path}");
                let (code, out, err) = crate::support::curl::curl(
                    Duration::from_secs(30),
                    &["-sS", "-D", "-", "--cacert", ca, "-x", proxy, &url],
                )
                .await;
                assert_eq!(code, 0, "curl {url}: {err}\n{out}");
                // The CONNECT's head, the inner answer's head, its body.
                let mut parts = out.rsplitn(2, "\r\n\r\n");
                let body = parts.next().unwrap_or_default();
                let heads = parts.next().unwrap_or_default();
                let head = heads.rsplit("\r\n\r\n").next().unwrap_or_default();
                assert!(
                    heads.starts_with("HTTP/1.1 200") && head.starts_with("HTTP/1.1 "),
                    "{out}"
                );
                let status = head[9..12].parse().unwrap();
                let header = |name| header_value(head, name).map(str::to_owned);
                let answer = Answer {
                    path,
                    status,
                    ip: exit_in(body),
                    captcha: body.to_ascii_lowercase().contains("captcha"),
                    proxy: header("x-proxy-name"),
                    lease: header("x-proxy-lease"),
                    moved: header("x-proxy-session-moved"),
                    ban_reported: header("x-proxy-ban-reported"),
                };
                answer.ip.clone_into(ip);
                answer
            }
        }
    }

    /// Waits for the client to end, successfully.
    async fn finish(self) {
        if let Crawl::Python {
            kind,
            mut child,
            stderr,
            ..
        } = self
        {
            let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
                .await
                .unwrap_or_else(|_| panic!("{kind} still ran 60 s after its last answer"))
                .unwrap();
            assert!(
                status.success(),
                "{kind}: {status}\n{}",
                std::fs::read_to_string(stderr).unwrap_or_default()
            );
        }
    }
}

/// The exit a page names: its `<p id="ip">`, else its text.
fn exit_in(body: &str) -> String {
    match body.split_once("<p id=\"ip\">") {
        Some((_, rest)) => rest.split('<').next().unwrap_or_default().to_owned(),
        None => body.trim().to_owned(),
    }
}

/// The ledger's newest history event.
fn last_event(fleet: &GatewayFleet) -> String {
    sqlite3(
        &fleet.operator.ledger(),
        "SELECT coalesce(max(seq), 0) FROM lease_events",
    )
}

/// Waits until no exit cools down for the site: each crawl of [`BANNED_TWICE`] needs the
/// three exits free, so the next one starts once the cooldowns of the one before are over.
async fn exits_free_for_the_site(fleet: &GatewayFleet) {
    wait_for_ledger(
        fleet,
        &format!("SELECT count(*) FROM active_cooldowns WHERE target = '{SITE}'"),
        "0",
    )
    .await;
}

/// The paths of a crawl that meets a 429 and a captcha page, each to the exit it is on.
const BANNED_TWICE: &[&str] = &["/ip", "/ban/{ip}/429", "/ip", "/captcha/{ip}", "/ip"];

/// Follows `crawl` of [`BANNED_TWICE`] by a client with a session: its exit X is answered
/// 429, so the gateway reports it and the answer comes from Y (the session moved from X); the
/// session stays on Y; Y is answered a captcha page, so the answer comes from Z. The ledger
/// holds both reports and cools X and Y down for the site.
async fn retried_past_two_bans(fleet: &GatewayFleet, mut crawl: Crawl) {
    let kind = crawl.kind();
    let since = last_event(fleet);
    let proxy_of = |answer: &Answer| {
        fleet
            .proxy_of(&answer.ip)
            .unwrap_or_else(|| panic!("{kind}: {answer:?} names no exit of the fleet"))
    };

    let first = crawl.next().await;
    let x = proxy_of(&first);
    first.is(kind, 200, &x, None);
    assert!(first.lease.is_some(), "{kind}: {first:?}");

    // X is answered 429: reported, and the request retried through another exit.
    let retried = crawl.next().await;
    assert_eq!(retried.path, format!("/ban/{}/429", first.ip), "{kind}");
    let y = proxy_of(&retried);
    assert_ne!(y, x, "{kind}: {retried:?}");
    retried.is(kind, 200, &y, Some(&x));

    // The session stays on Y.
    let stayed = crawl.next().await;
    assert_eq!(proxy_of(&stayed), y, "{kind}: {stayed:?}");
    stayed.is(kind, 200, &y, None);

    // Y is answered a captcha page with 200: a ban too, retried through the third exit.
    let captcha = crawl.next().await;
    assert_eq!(captcha.path, format!("/captcha/{}", stayed.ip), "{kind}");
    assert!(
        !captcha.captcha,
        "{kind}: the captcha page relayed: {captcha:?}"
    );
    let z = proxy_of(&captcha);
    assert!(z != x && z != y, "{kind}: {captcha:?} after {x} and {y}");
    captcha.is(kind, 200, &z, Some(&y));

    // Both exits cool down for the site, each for what it answered.
    let mut cooled = [(x.clone(), "rate_limited"), (y.clone(), "blocked")];
    cooled.sort();
    let expected: Vec<String> = cooled
        .iter()
        .map(|(proxy, result)| format!("{proxy}|{SITE}|{result}"))
        .collect();
    wait_for_ledger(
        fleet,
        &format!(
            "SELECT proxy, target, result FROM active_cooldowns WHERE target = '{SITE}' \
             ORDER BY proxy"
        ),
        &expected.join("\n"),
    )
    .await;

    let last = crawl.next().await;
    assert_eq!(proxy_of(&last), z, "{kind}: {last:?}");
    last.is(kind, 200, &z, None);
    crawl.finish().await;

    // The history holds the two reports, nothing else.
    wait_for_ledger(
        fleet,
        &format!(
            "SELECT proxy, target, result FROM lease_history WHERE kind = 'reported' \
             AND seq > {since} ORDER BY seq"
        ),
        &format!("{x}|{SITE}|rate_limited\n{y}|{SITE}|blocked"),
    )
    .await;
}

/// Python `requests`, `httpx`, Scrapy (settings only) and curl, one after the other through
/// one intercepting fleet of three exits, each with a session: a 429 and a captcha page, each
/// to the exit the session is on, are reported, cool that exit down for the site, and the
/// request is retried through another exit that the session then stays on.
#[tokio::test]
async fn crawlers_inside_https_are_retried_past_a_429_and_a_captcha_onto_other_exits() {
    let Some(python) = python_with(&["requests", "httpx", "scrapy"]) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (fleet, ca) = intercepting_fleet(dir.path(), 3).await;
    let base = format!("https://{SITE}:{}", fleet.site.https_port());
    let mut took = Vec::new();
    for (kind, session) in [("requests", "s1"), ("httpx", "s2"), ("scrapy", "s3")] {
        let start = Instant::now();
        exits_free_for_the_site(&fleet).await;
        let proxy = fleet.proxy_url(&format!("{kind};session={session};tls=inspect"));
        let crawl = Crawl::python(
            python,
            kind,
            dir.path(),
            &proxy,
            &ca.cert,
            &base,
            BANNED_TWICE,
        );
        retried_past_two_bans(&fleet, crawl).await;
        took.push((kind, start.elapsed()));
    }
    let start = Instant::now();
    exits_free_for_the_site(&fleet).await;
    let proxy = fleet.proxy_url("curl;session=s4;tls=inspect");
    retried_past_two_bans(&fleet, Crawl::curl(&proxy, &ca.cert, &base, BANNED_TWICE)).await;
    took.push(("curl", start.elapsed()));
    eprintln!("each client's crawl, the cooldowns before it included: {took:?}");

    let metrics = fleet.metrics().await;
    for (result, count) in [("rate_limited", 4.0), ("blocked", 4.0)] {
        assert_eq!(
            metric_sum(
                &metrics,
                "proxy_operator_gateway_rule_matches_total",
                &["rule=\"site\"", &format!("result=\"{result}\"")]
            ),
            count,
            "{result}: {metrics}"
        );
    }
}

/// The paths of a crawl that meets a 403 to the exit it is on, then goes on.
const BANNED_ONCE: &[&str] = &["/ip", "/ban/{ip}/403", "/ip", "/ip"];

/// Follows `crawl` of [`BANNED_ONCE`] on `localhost`, a host no rule names, so the default
/// rule's (403 and 429 are bans, passed on): the target's 403 to the crawl's exit A reaches
/// the client naming the ban the gateway reported, and the requests after it leave through
/// other exits; the ledger holds the report and A's cooldown for `localhost`.
async fn passed_on_and_left(fleet: &GatewayFleet, mut crawl: Crawl) {
    let kind = crawl.kind();
    let first = crawl.next().await;
    let a = fleet
        .proxy_of(&first.ip)
        .unwrap_or_else(|| panic!("{kind}: {first:?}"));
    first.is(kind, 200, &a, None);

    let ban = crawl.next().await;
    assert_eq!(ban.ip, format!("banned {}", first.ip), "{kind}: {ban:?}");
    ban.is(kind, 403, &a, None);
    let said = ban.ban_reported.as_deref();
    assert_eq!(said, Some("blocked"), "{kind}: {ban:?}");

    for _ in 0..2 {
        let next = crawl.next().await;
        assert_eq!(next.status, 200, "{kind}: {next:?}");
        let exit = fleet.proxy_of(&next.ip);
        assert!(
            exit.is_some() && exit.as_deref() != Some(a.as_str()),
            "{kind}: the request after {a}'s ban left through {next:?}"
        );
        assert_eq!(next.proxy, exit, "{kind}: {next:?}");
    }
    crawl.finish().await;
    wait_for_ledger(
        fleet,
        "SELECT proxy, target, result FROM active_cooldowns ORDER BY proxy",
        &format!("{a}|localhost|blocked"),
    )
    .await;
    wait_for_ledger(
        fleet,
        "SELECT proxy, target, result FROM lease_history WHERE kind = 'reported'",
        &format!("{a}|localhost|blocked"),
    )
    .await;
}

/// The site's host as `localhost` (its certificate names it too), on HTTPS.
fn localhost(fleet: &GatewayFleet) -> String {
    format!("https://localhost:{}", fleet.site.https_port())
}

/// curl, a new connection (a new CONNECT) per request, without a session, on a host the
/// default rule covers: the 403 to its exit is passed on, said and reported, and its next
/// requests leave through another exit.
#[tokio::test]
async fn curl_inside_https_gets_a_ban_passed_on_and_its_next_request_leaves_another_exit() {
    let dir = tempfile::tempdir().unwrap();
    let (fleet, ca) = intercepting_fleet(dir.path(), 2).await;
    let proxy = fleet.proxy_url("curl;tls=inspect");
    let crawl = Crawl::curl(&proxy, &ca.cert, &localhost(&fleet), BANNED_ONCE);
    passed_on_and_left(&fleet, crawl).await;
}

/// Python `requests` with one session (one kept-alive connection to the gateway, so one
/// intercepted tunnel for all its requests), without a gateway session, on a host the default
/// rule covers: the 403 to its exit is passed on, said and reported, and its next requests,
/// on the same connection, leave through another exit.
#[tokio::test]
async fn a_kept_alive_intercepted_connection_leaves_the_exit_a_passed_ban_cooled_down() {
    let Some(python) = python_with(&["requests"]) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (fleet, ca) = intercepting_fleet(dir.path(), 2).await;
    let proxy = fleet.proxy_url("requests;tls=inspect");
    let crawl = Crawl::python(
        python,
        "requests",
        dir.path(),
        &proxy,
        &ca.cert,
        &localhost(&fleet),
        BANNED_ONCE,
    );
    passed_on_and_left(&fleet, crawl).await;
}

/// Headless Chromium through Playwright, trusting the gateway's CA as a user makes it: an NSS
/// database made with `certutil` in the HOME it runs with (never a switch that ignores
/// certificate errors). Without that database it refuses the gateway's certificate; with it,
/// the site's page loads through the gateway, and a page whose exit the site answers 403 comes
/// from another exit, the session moved, with no certificate error on the way.
#[tokio::test]
async fn chromium_trusting_the_gateway_ca_in_its_nss_database_loads_a_banned_page_elsewhere() {
    if chromium().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("home");
    let nssdb = home.join(".pki/nssdb");
    std::fs::create_dir_all(&nssdb).unwrap();
    let database = format!("sql:{}", nssdb.display());
    // certutil has no flag that only prints its version: making the empty database is the
    // check that it runs.
    if required_tool(
        "certutil",
        &["-d", &database, "-N", "--empty-password"],
        "apt-get install -y libnss3-tools",
    )
    .is_none()
    {
        return;
    }
    let untrusted_home = dir.path().join("untrusted-home");
    std::fs::create_dir_all(&untrusted_home).unwrap();
    let (fleet, ca) = intercepting_fleet(dir.path(), 2).await;
    // Trusted to issue server certificates (`C,,`), as a user adds a CA of their own.
    let added = std::process::Command::new("certutil")
        .args(["-d", &database, "-A", "-t", "C,,", "-n", "gateway CA", "-i"])
        .arg(&ca.cert)
        .output()
        .expect("run certutil");
    assert!(
        added.status.success(),
        "certutil -A: {}",
        String::from_utf8_lossy(&added.stderr)
    );
    let server = format!("http://{}", fleet.operator.gateway());
    let base = format!("https://{SITE}:{}", fleet.site.https_port());
    let result = run_script(
        "inspect_page.py",
        &json!({
            "gateway": {"server": server, "username": "pw;session=b1;tls=inspect", "password": TOKEN},
            "home": home,
            "untrusted": {
                "home": untrusted_home,
                "gateway": {
                    "server": server, "username": "pw-untrusted;tls=inspect", "password": TOKEN,
                },
            },
            "urls": [format!("{base}/ip"), format!("{base}/ban/{{ip}}/403")],
        }),
    )
    .await;

    // Without the CA in its database, Chromium refuses the gateway's leaf.
    let refused = &result["untrusted"];
    assert!(
        refused["error"]
            .as_str()
            .is_some_and(|e| e.contains("ERR_CERT_AUTHORITY_INVALID")),
        "{result}"
    );

    let pages = result["pages"].as_array().expect("pages");
    assert_eq!(pages.len(), 2, "{result}");
    for page in pages {
        assert_eq!(page["status"], 200, "{page}");
        assert_eq!(page["errors"], json!([]), "{page}");
    }
    let x_ip = pages[0]["text"].as_str().unwrap();
    let x = fleet
        .proxy_of(x_ip)
        .unwrap_or_else(|| panic!("{}", pages[0]));
    assert_eq!(pages[0]["proxy"], x.as_str(), "{}", pages[0]);
    let banned = &pages[1];
    assert_eq!(banned["url"], format!("{base}/ban/{x_ip}/403"), "{banned}");
    let y = fleet
        .proxy_of(banned["text"].as_str().unwrap())
        .unwrap_or_else(|| panic!("{banned}"));
    assert_ne!(y, x, "{banned}");
    assert_eq!(banned["proxy"], y.as_str(), "{banned}");
    assert_eq!(banned["moved"], x.as_str(), "{banned}");

    // The gateway reported X's 403 for the site and counted the browser's refusal.
    wait_for_ledger(
        &fleet,
        &format!(
            "SELECT proxy, result FROM lease_history WHERE kind = 'reported' AND target = '{SITE}'"
        ),
        &format!("{x}|blocked"),
    )
    .await;
    let metrics = fleet.metrics().await;
    assert!(
        metric_sum(
            &metrics,
            "proxy_operator_gateway_tls_handshake_failures_total",
            &["side=\"client\""]
        ) >= 1.0,
        "{metrics}"
    );
}

/// One exit only, and a rule that retries: the site's 429 to it has no other exit to go to,
/// so the crawler gets the 429 itself, the ban said and reported (never a `503` saying no
/// proxy matched), for plain HTTP and inside HTTPS alike.
#[tokio::test]
async fn a_retried_ban_with_no_other_exit_is_passed_on_as_the_target_said_it() {
    let dir = tempfile::tempdir().unwrap();
    let (fleet, ca) = intercepting_fleet(dir.path(), 1).await;
    let exit = fleet.proxy_of(&crate::support::fleet::exit_address(0).to_string());
    let ip = crate::support::fleet::exit_address(0).to_string();

    let plain = fleet.site.http(&format!("/ban/{ip}/429"));
    let proxy = fleet.proxy_url("plain");
    let (code, out, err) = crate::support::curl::curl(
        Duration::from_secs(30),
        &["-sS", "-D", "-", "-x", &proxy, &plain],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("HTTP/1.1 429"), "{out}");
    assert_eq!(
        header_value(&out, "x-proxy-ban-reported"),
        Some("rate_limited"),
        "{out}"
    );
    assert_eq!(header_value(&out, "x-proxy-name"), exit.as_deref(), "{out}");

    exits_free_for_the_site(&fleet).await;
    let base = format!("https://{SITE}:{}", fleet.site.https_port());
    let proxy = fleet.proxy_url("inspected;session=one;tls=inspect");
    let mut crawl = Crawl::curl(&proxy, &ca.cert, &base, &["/ip", "/ban/{ip}/429"]);
    let first = crawl.next().await;
    first.is("curl", 200, exit.as_deref().unwrap_or_default(), None);
    let ban = crawl.next().await;
    assert_eq!(ban.status, 429, "{ban:?}");
    assert_eq!(ban.ban_reported.as_deref(), Some("rate_limited"), "{ban:?}");
    assert_eq!(ban.proxy, exit, "{ban:?}");
    assert_eq!(ban.ip, format!("banned {ip}"), "{ban:?}");
}
