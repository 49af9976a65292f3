//! The status page's data routes over a week of history: the release `proxy-operator
//! standalone` with 1,000 External proxies and a ledger holding 1,000,000 history events
//! spread evenly over the last 7 days (the default `--history-retention`), 500 targets and
//! 500 cooldowns in force. Times every read-only status route, and the HTML views built on
//! them, one request after the other (after a warm-up), and prints p50, p99 and max per route.
//! Exits non-zero when any route answers anything but 200 or reaches a p99 of 100 ms.
//!
//! Then, when PostgreSQL is installed (`apt-get install -y postgresql`), the same on a
//! PostgreSQL ledger (a server of the bench's own on loopback) filled the same way.
//!
//! The history is written straight into the ledger (SQLite with rusqlite, PostgreSQL with
//! psql) after the binary has created its schema and stopped, then the binary is started on
//! it again: the rows are what a week of crawling leaves, without a week of crawling.
//!
//! Run with `cargo bench --bench status`. Everything shares the machine: the binary, the
//! database and this client.

#[path = "../tests/support/mod.rs"]
mod support;

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use support::Target;
use support::postgres::{Database, Postgres};
use support::standalone::{ExternalProxy, Standalone};

const PROXIES: usize = 1_000;
const EVENTS: i64 = 1_000_000;
const TARGETS: i64 = 500;
const COOLDOWNS: i64 = 500;
/// The history's span, a little short of the 7-day retention so the sweep keeps every row.
const SPAN_MS: i64 = 7 * 24 * 3_600_000 - 600_000;
const WARM_UP: usize = 10;
const REQUESTS: usize = 200;
const P99_LIMIT: Duration = Duration::from_millis(100);
const READY_DEADLINE: Duration = Duration::from_secs(120);
const TOKEN: &str = "status-bench-token-0123456789abcdef";

/// The routes timed: the JSON data routes, then the HTML views that read them.
const ROUTES: [&str; 9] = [
    "/v1/status/fleet",
    "/v1/status/proxies?sort=success&order=desc",
    "/v1/status/proxies/default/px-7",
    "/v1/status/targets",
    "/v1/status/events?limit=100",
    "/",
    "/proxies?label=geo%3Deu&sort=latency",
    "/targets",
    "/events",
];

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

fn inventory() -> Vec<ExternalProxy> {
    (0..PROXIES)
        .map(|i| ExternalProxy {
            name: format!("px-{i}"),
            labels: vec![("geo".into(), ["eu", "us"][i % 2].into())],
            host: "127.0.0.1".into(),
            // Nothing listens there: the proxies stay unhealthy, which the routes read as
            // they read any other state.
            port: 9,
            max_leases: 5,
            probe_url: "https://127.0.0.1:9/".into(),
            interval: "30s",
            cordoned: false,
            socks5: false,
            credentials: None,
            cost: None,
        })
        .collect()
}

/// The columns of one history event for each `row` of `0..EVENTS` (a column of the caller's
/// row source), the same SQL on both backends: each lease is acquired, renewed, reported on
/// and released, and the events are spread evenly over [`SPAN_MS`] up to now.
fn events_select(row: &str) -> String {
    format!(
        "SELECT {now} - {span} + {row} * {span} / {EVENTS}, \
         'bench-' || ({row} / 4), \
         CASE {row} % 4 WHEN 0 THEN 'acquired' WHEN 1 THEN 'renewed' WHEN 2 THEN 'reported' \
              ELSE 'released' END, \
         'default', \
         'px-' || (({row} / 4) % {PROXIES}), \
         'uid-' || (({row} / 4) % {PROXIES}), \
         'site-' || (({row} / 4) % {TARGETS}) || '.example', \
         CASE WHEN {row} % 4 = 2 THEN \
              CASE ({row} / 4) % 10 WHEN 0 THEN 'rate_limited' WHEN 1 THEN 'blocked' \
                   WHEN 2 THEN 'error' ELSE 'ok' END END, \
         {now} - {span} + {row} * {span} / {EVENTS} + 300000, \
         CASE WHEN {row} % 4 = 0 THEN 'bench-crawler' END",
        now = now_ms(),
        span = SPAN_MS,
    )
}

/// The row number of the row sources below, wide enough for the arithmetic on times.
const ROW: &str = "CAST(i AS BIGINT)";

const EVENT_COLUMNS: &str = "(at, lease_id, kind, proxy_namespace, proxy_name, proxy_uid, \
     target, result, expires_at, client)";

/// The columns of one cooldown in force for each `row` of `0..COOLDOWNS`.
fn cooldowns_select(row: &str) -> String {
    format!(
        "SELECT 'uid-' || {row}, 'site-' || ({row} % {TARGETS}) || '.example', 'default', \
         'px-' || {row}, {until} + {row} * 1000, 'rate_limited', \
         'bench-cooldown-' || {row}",
        until = now_ms() + 600_000,
    )
}

const COOLDOWN_COLUMNS: &str =
    "(proxy_uid, target, proxy_namespace, proxy_name, until, result, lease_id)";

/// Fills a SQLite ledger the binary has created (and stopped using).
fn fill_sqlite(path: &Path) -> Result<(), String> {
    let conn = rusqlite::Connection::open(path).map_err(|e| format!("open the ledger: {e}"))?;
    let sql = format!(
        "BEGIN;
         WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < {last})
         INSERT INTO lease_events {EVENT_COLUMNS} {events} FROM n;
         WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < {cool_last})
         INSERT INTO cooldowns {COOLDOWN_COLUMNS} {cooldowns} FROM n;
         COMMIT;",
        last = EVENTS - 1,
        cool_last = COOLDOWNS - 1,
        events = events_select(ROW),
        cooldowns = cooldowns_select(ROW),
    );
    conn.execute_batch(&sql)
        .map_err(|e| format!("fill the ledger: {e}"))
}

fn fill_postgres(database: &Database) -> Result<(), String> {
    database.try_psql(&format!(
        "INSERT INTO lease_events {EVENT_COLUMNS} {events} FROM generate_series(0, {last}) AS n(i);
         INSERT INTO cooldowns {COOLDOWN_COLUMNS} {cooldowns} FROM generate_series(0, {cool_last}) AS n(i);
         ANALYZE;",
        last = EVENTS - 1,
        cool_last = COOLDOWNS - 1,
        events = events_select(ROW),
        cooldowns = cooldowns_select(ROW),
    ))?;
    Ok(())
}

/// Waits until the status data answers 200.
async fn wait_ready(operator: &Standalone, client: &reqwest::Client) -> Result<(), String> {
    let started = Instant::now();
    loop {
        let answer = client
            .get(format!("{}/v1/status/fleet", operator.api()))
            .bearer_auth(TOKEN)
            .send()
            .await;
        if answer.is_ok_and(|a| a.status().is_success()) {
            return Ok(());
        }
        if started.elapsed() > READY_DEADLINE {
            return Err(format!(
                "not ready after {READY_DEADLINE:?}; log:\n{}",
                operator.log()
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One route's timings, sorted.
struct Timed {
    route: &'static str,
    sorted: Vec<Duration>,
}

impl Timed {
    fn at(&self, share: f64) -> Duration {
        let index = ((self.sorted.len() as f64 - 1.0) * share).round() as usize;
        self.sorted.get(index).copied().unwrap_or(Duration::ZERO)
    }
}

/// Signs in as a person would and returns the session cookie (`name=value`) the pages take.
async fn sign_in(api: &str) -> Result<String, String> {
    // The answer is a redirect carrying the cookie: read it, do not follow it.
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| format!("sign in: {e}"))?;
    let answer = client
        .post(format!("{api}/signin"))
        .header(reqwest::header::ORIGIN, api)
        .form(&[("token", TOKEN)])
        .send()
        .await
        .map_err(|e| format!("sign in: {e}"))?;
    answer
        .headers()
        .get(reqwest::header::SET_COOKIE)
        .and_then(|h| h.to_str().ok())
        .and_then(|h| h.split(';').next())
        .map(str::to_owned)
        .ok_or_else(|| format!("sign in: {} without a cookie", answer.status()))
}

async fn time_routes(api: &str, client: &reqwest::Client) -> Result<Vec<Timed>, String> {
    let cookie = sign_in(api).await?;
    let mut timed = Vec::new();
    for route in ROUTES {
        let mut sorted = Vec::with_capacity(REQUESTS);
        for i in 0..WARM_UP + REQUESTS {
            let started = Instant::now();
            // The data routes with the API's bearer token, the pages with the cookie.
            let request = client.get(format!("{api}{route}"));
            let request = if route.starts_with("/v1/") {
                request.bearer_auth(TOKEN)
            } else {
                request.header(reqwest::header::COOKIE, &cookie)
            };
            let answer = request
                .send()
                .await
                .map_err(|e| format!("GET {route}: {e}"))?;
            let status = answer.status();
            let body = answer
                .bytes()
                .await
                .map_err(|e| format!("GET {route}: {e}"))?;
            if status != reqwest::StatusCode::OK {
                return Err(format!("GET {route}: {status}"));
            }
            if i == 0 && !route.starts_with("/v1/") && body_is_sign_in(&body) {
                return Err(format!("GET {route}: the sign-in form, not the page"));
            }
            if i >= WARM_UP {
                sorted.push(started.elapsed());
            }
        }
        sorted.sort();
        timed.push(Timed { route, sorted });
    }
    Ok(timed)
}

/// Whether a page is the sign-in form.
fn body_is_sign_in(body: &[u8]) -> bool {
    String::from_utf8_lossy(body).contains("action=\"/signin\"")
}

/// Creates the schema with the binary, fills it with `fill`, starts the binary on it again
/// and times the routes.
async fn measure(
    dir: &Path,
    probe_ca: &Path,
    ledger_args: &[&str],
    fill: impl FnOnce() -> Result<(), String>,
) -> Result<Vec<Timed>, String> {
    let client = reqwest::Client::new();
    let proxies = inventory();
    let mut creating = Standalone::start(dir, &proxies, probe_ca, TOKEN, ledger_args);
    wait_ready(&creating, &client).await?;
    creating.kill();
    let started = Instant::now();
    fill()?;
    println!("  filled in {:.1} s", started.elapsed().as_secs_f64());
    let operator = Standalone::start(dir, &proxies, probe_ca, TOKEN, ledger_args);
    wait_ready(&operator, &client).await?;
    time_routes(operator.api(), &client).await
}

fn report(label: &str, timed: &[Timed]) -> bool {
    println!("\n{label}: {REQUESTS} requests a route, one at a time");
    println!(
        "{:<46} {:>9} {:>9} {:>9}",
        "route", "p50 ms", "p99 ms", "max ms"
    );
    let mut within = true;
    for t in timed {
        let p99 = t.at(0.99);
        within &= p99 < P99_LIMIT;
        println!(
            "{:<46} {:>9.2} {:>9.2} {:>9.2}{}",
            t.route,
            t.at(0.5).as_secs_f64() * 1e3,
            p99.as_secs_f64() * 1e3,
            t.at(1.0).as_secs_f64() * 1e3,
            if p99 < P99_LIMIT { "" } else { "  over" },
        );
    }
    within
}

#[tokio::main]
async fn main() -> ExitCode {
    let target = Target::start();
    let Ok(dir) = tempfile::tempdir() else {
        eprintln!("no temp dir");
        return ExitCode::FAILURE;
    };
    let probe_ca = dir.path().join("probe-ca.pem");
    if let Err(e) = std::fs::write(&probe_ca, target.ca_cert_pem()) {
        eprintln!("write the probe CA: {e}");
        return ExitCode::FAILURE;
    }
    println!(
        "{PROXIES} proxies, {EVENTS} history events over 7 days, {TARGETS} targets, \
         {COOLDOWNS} cooldowns in force; p99 limit {P99_LIMIT:?}"
    );

    let mut within = true;
    let sqlite_dir = dir.path().join("sqlite");
    let ledger = sqlite_dir.join("ledger.db");
    let sqlite = match std::fs::create_dir_all(&sqlite_dir) {
        Ok(()) => measure(&sqlite_dir, &probe_ca, &[], || fill_sqlite(&ledger)).await,
        Err(e) => Err(format!("create {}: {e}", sqlite_dir.display())),
    };
    match sqlite {
        Ok(timed) => within &= report("SQLite", &timed),
        Err(e) => {
            eprintln!("SQLite: {e}");
            return ExitCode::FAILURE;
        }
    }

    if let Some(postgres) = Postgres::start() {
        let database = postgres.database();
        let url = database.url();
        let postgres_dir = dir.path().join("postgres");
        let measured = match std::fs::create_dir_all(&postgres_dir) {
            Ok(()) => {
                measure(&postgres_dir, &probe_ca, &["--ledger", &url], || {
                    fill_postgres(&database)
                })
                .await
            }
            Err(e) => Err(format!("create {}: {e}", postgres_dir.display())),
        };
        match measured {
            Ok(timed) => within &= report("PostgreSQL", &timed),
            Err(e) => {
                eprintln!("PostgreSQL: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        println!("\nPostgreSQL is not installed: its run is skipped");
    }

    if within {
        ExitCode::SUCCESS
    } else {
        eprintln!("a route's p99 reached {P99_LIMIT:?}");
        ExitCode::FAILURE
    }
}
