//! Several `proxy-operator standalone` replicas over one PostgreSQL database, under load from
//! 32 concurrent crawlers spread over their APIs, in front of real squids.
//!
//! One replica killed with SIGKILL mid-load and restarted, five times: every lease a crawler
//! was answered 201 for, on any replica, is in the database in the state the crawler was told
//! and served by every replica; no lease ID was granted twice; no proxy ever held more leases
//! than its `maxLeases`, at any grant in the history nor now; a `requestID` replays on every
//! replica. And the database stopped mid-load: writes answer 503 with `Retry-After`, the
//! replicas stay ready and say the database is down, and when it is back the same processes
//! grant again.

use crate::support;

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};
use support::crawl_load::{
    Acknowledged, LedgerDb, MAX_LEASES, Operator, POOL, Retries, TOKEN, TTL_SECONDS,
    assert_recorded, assert_served, eventually_within, http_client, inventory, listed_active,
    spawn_crawlers, wait_all_healthy,
};
use support::postgres::{Database, Postgres};
use support::{Squid, Target};

const REPLICAS: usize = 3;
const RUNS: usize = 5;
const CRAWLERS: usize = 32;
/// Grants (on all replicas) before the kill, growing per run so the kill lands at different
/// moments.
const GRANTS_BEFORE_KILL: usize = 60;
/// Grants on the other replicas between the kill and the restart.
const GRANTS_WHILE_ONE_IS_DOWN: usize = 60;
/// Grants by the crawlers of the restarted replica.
const GRANTS_AFTER_RESTART: usize = 20;
/// Grants (on all replicas) before the database is stopped.
const GRANTS_BEFORE_OUTAGE: usize = 150;
/// 503s each replica answers while the database is down, before and after the grants are
/// counted (none may be added meanwhile).
const UNAVAILABLE_PER_REPLICA: usize = 20;
/// For conditions several processes must meet on a loaded machine.
const SLOW: Duration = Duration::from_secs(90);
/// How long a request may take before it counts as unanswered: under this load an acquire
/// waits for its proxy's row lock behind the other replicas' acquires, and a replica's pool
/// opens its connections again after the database restarts.
const SLOW_ANSWER: Duration = Duration::from_secs(30);
/// The 503 codes of a write the database could not take.
const UNAVAILABLE_CODES: [&str; 2] = ["ledger_unavailable", "overloaded"];

/// How long each phase of a run took, for its summary line.
struct Phases {
    started: Instant,
    last: Instant,
    done: Vec<String>,
}

impl Phases {
    fn new() -> Phases {
        let now = Instant::now();
        Phases {
            started: now,
            last: now,
            done: Vec::new(),
        }
    }

    /// Ends phase `name`.
    fn mark(&mut self, name: &str) {
        let now = Instant::now();
        self.done
            .push(format!("{name} {:.1} s", (now - self.last).as_secs_f64()));
        self.last = now;
    }

    /// `<total> s: <phase> <time> s, …`.
    fn summary(&self) -> String {
        format!(
            "{:.1} s: {}",
            self.started.elapsed().as_secs_f64(),
            self.done.join(", ")
        )
    }
}

/// Starts `REPLICAS` processes at once over `url` (they migrate the fresh database
/// concurrently) and waits until each lists every proxy healthy.
async fn start_replicas(
    http: &reqwest::Client,
    logs: &[PathBuf],
    inventory: &Path,
    url: &str,
) -> Vec<Operator> {
    let replicas: Vec<Operator> = logs
        .iter()
        .map(|log| Operator::start(log, inventory, url, &[]))
        .collect();
    for replica in &replicas {
        wait_all_healthy(http, replica, SLOW).await;
    }
    replicas
}

fn apis(replicas: &[Operator]) -> Vec<String> {
    replicas.iter().map(|r| r.api().to_owned()).collect()
}

async fn post_json(http: &reqwest::Client, url: &str, body: &Value) -> (StatusCode, Value) {
    let response = http
        .post(url)
        .bearer_auth(TOKEN)
        .json(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e}"));
    let status = response.status();
    (status, response.json().await.unwrap_or_default())
}

/// `/readyz`'s answer. A 408 is not one: the server did not read the request within its
/// client request timeout (5 s; the machine is starved), so the question is asked again, and
/// counted in [`READYZ_REQUEST_TIMEOUTS`].
async fn readyz(http: &reqwest::Client, api: &str) -> (StatusCode, Value) {
    let start = Instant::now();
    loop {
        let response = http
            .get(format!("{api}/readyz"))
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {api}/readyz: {e}"));
        let status = response.status();
        if status != StatusCode::REQUEST_TIMEOUT || start.elapsed() > SLOW {
            return (status, response.json().await.unwrap_or_default());
        }
        READYZ_REQUEST_TIMEOUTS.fetch_add(1, Ordering::Relaxed);
    }
}

/// `/readyz` requests answered 408 (see [`readyz`]).
static READYZ_REQUEST_TIMEOUTS: AtomicUsize = AtomicUsize::new(0);

/// An acquire with a `requestID` on replica `first` (201), replayed on every other replica
/// (200, the same lease), released on the next one, and replayed again on `first` (200, the
/// same lease, released). Returns the lease's ID.
async fn replay_across_replicas(
    http: &reqwest::Client,
    apis: &[String],
    first: usize,
    context: &str,
) -> String {
    let body = json!({
        "selector": {"pool": POOL},
        "ttlSeconds": TTL_SECONDS,
        "requestID": format!("replay across replicas, {context}"),
    });
    let (status, lease) = post_json(http, &format!("{}/v1/leases", apis[first]), &body).await;
    assert_eq!(status, StatusCode::CREATED, "{context}: {lease}");
    let id = lease["leaseID"].as_str().expect("a lease ID").to_owned();
    for (i, api) in apis.iter().enumerate().filter(|(i, _)| *i != first) {
        let (status, replay) = post_json(http, &format!("{api}/v1/leases"), &body).await;
        assert_eq!(
            (status, replay["leaseID"].as_str()),
            (StatusCode::OK, Some(id.as_str())),
            "{context}: the replay on replica {i} of a lease granted on replica {first}: {replay}"
        );
    }
    let releaser = &apis[(first + 1) % apis.len()];
    let released = http
        .delete(format!("{releaser}/v1/leases/{id}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(released.status(), StatusCode::NO_CONTENT, "{context}");
    let (status, replay) = post_json(http, &format!("{}/v1/leases", apis[first]), &body).await;
    assert_eq!(
        (status, replay["leaseID"].as_str(), replay["state"].as_str()),
        (StatusCode::OK, Some(id.as_str()), Some("released")),
        "{context}: the replay of a lease released on another replica: {replay}"
    );
    id
}

/// Asserts that every replica's `/readyz` answers 200 and says the database is down.
async fn assert_ready_with_the_database_down(http: &reqwest::Client, replicas: &[Operator]) {
    for replica in replicas {
        let (status, body) = readyz(http, replica.api()).await;
        assert_eq!(
            (status, body["database"].as_str()),
            (StatusCode::OK, Some("down")),
            "{}: {body}",
            replica.api()
        );
    }
}

/// The crawlers' record of one replica, emptied.
fn take(acknowledged: &Mutex<Acknowledged>) -> Acknowledged {
    std::mem::take(&mut *acknowledged.lock().unwrap())
}

/// Asserts what every crawler's record must satisfy: only documented answers, every 503 with
/// a `Retry-After` and a code of [`UNAVAILABLE_CODES`].
fn assert_only_documented_answers(context: &str, records: &[&Acknowledged]) {
    for (i, record) in records.iter().enumerate() {
        assert!(
            record.unexpected.is_empty(),
            "{context}: record {i}: {:?}",
            record.unexpected
        );
        assert!(
            record.unavailable_without_retry_after.is_empty(),
            "{context}: record {i}: 503 without Retry-After: {:?}",
            record.unavailable_without_retry_after
        );
        assert!(
            record
                .unavailable
                .keys()
                .all(|code| UNAVAILABLE_CODES.contains(&code.as_str())),
            "{context}: record {i}: 503 codes {:?}",
            record.unavailable
        );
    }
}

/// Asserts that no lease ID was answered 201 twice, and returns them all.
fn distinct_grants(context: &str, records: &[&Acknowledged]) -> Vec<String> {
    let granted: Vec<String> = records
        .iter()
        .flat_map(|r| r.granted.iter().cloned())
        .collect();
    let distinct: HashSet<&String> = granted.iter().collect();
    assert_eq!(
        distinct.len(),
        granted.len(),
        "{context}: a lease ID was granted twice"
    );
    granted
}

/// Capacity: never exceeded at any grant (from the history) and not now, the load really
/// filled a proxy, and every replica lists what the database holds (its counts refresh every
/// second). Returns the most held at a grant and the active leases now.
async fn assert_capacity(
    context: &str,
    db: &LedgerDb<'_>,
    http: &reqwest::Client,
    replicas: &[Operator],
) -> (u64, u64) {
    let (proxy, most) = db.most_held_at_any_grant();
    assert!(
        most <= MAX_LEASES,
        "{context}: {proxy} held {most} leases, maxLeases is {MAX_LEASES}"
    );
    assert_eq!(most, MAX_LEASES, "{context}: the load never filled a proxy");
    let per_proxy = db.active_per_proxy();
    assert!(
        per_proxy.values().all(|&n| n <= MAX_LEASES),
        "{context}: {per_proxy:?}"
    );
    for replica in replicas {
        let start = Instant::now();
        loop {
            let listed = listed_active(http, replica.api()).await;
            if listed == per_proxy {
                break;
            }
            assert!(
                start.elapsed() < SLOW,
                "{context}: after {SLOW:?}, {} lists {listed:?}, the database holds {per_proxy:?}",
                replica.api()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    (most, per_proxy.values().sum())
}

async fn one_run(run: usize, database: Database, squids: &[Squid], probe_url: &str) {
    let context = format!("run {run}");
    let dir = tempfile::tempdir().unwrap();
    let inventory_path = dir.path().join("inventory.yaml");
    std::fs::write(&inventory_path, inventory(squids, probe_url)).unwrap();
    let url = database.url();
    let log_paths: Vec<PathBuf> = (0..REPLICAS)
        .map(|r| dir.path().join(format!("replica-{r}.log")))
        .collect();
    let http = http_client(CRAWLERS, SLOW_ANSWER);
    let mut phases = Phases::new();
    let mut replicas = start_replicas(&http, &log_paths, &inventory_path, &url).await;
    phases.mark("start");
    let victim = run % REPLICAS;
    let replayed = replay_across_replicas(&http, &apis(&replicas), victim, &context).await;

    let acknowledged: Vec<Arc<Mutex<Acknowledged>>> =
        (0..REPLICAS).map(|_| Arc::default()).collect();
    let stops: Vec<Arc<AtomicBool>> = (0..REPLICAS).map(|_| Arc::default()).collect();
    let mut crawlers = spawn_crawlers(
        &http,
        CRAWLERS,
        &apis(&replicas),
        &acknowledged,
        &stops,
        Retries::UnansweredWrites,
    );
    let granted_on = |which: &[usize]| -> usize {
        which
            .iter()
            .map(|&r| acknowledged[r].lock().unwrap().granted.len())
            .sum()
    };
    let all: Vec<usize> = (0..REPLICAS).collect();
    let others: Vec<usize> = all.iter().copied().filter(|&r| r != victim).collect();
    let kill_after = GRANTS_BEFORE_KILL * (run + 1);
    eventually_within(SLOW, &format!("{context}: {kill_after} grants"), || async {
        granted_on(&all) >= kill_after
    })
    .await;

    // kill -9 one replica; its crawlers stop, the others go on.
    let granted_before_kill = granted_on(&all);
    phases.mark("load");
    replicas[victim].kill_9();
    stops[victim].store(true, Ordering::Relaxed);
    for crawler in crawlers[victim].drain(..) {
        crawler.await.unwrap();
    }
    let killed = take(&acknowledged[victim]);
    let others_at_kill = granted_on(&others);
    let what = format!("{context}: {GRANTS_WHILE_ONE_IS_DOWN} grants on the other replicas");
    eventually_within(SLOW, &what, || async {
        granted_on(&others) >= others_at_kill + GRANTS_WHILE_ONE_IS_DOWN
    })
    .await;

    // Restarted with the same arguments (on fresh ports); its crawlers resume on it.
    replicas[victim] = Operator::start(&log_paths[victim], &inventory_path, &url, &[]);
    wait_all_healthy(&http, &replicas[victim], SLOW).await;
    phases.mark("kill and restart");
    let others_at_restart = granted_on(&others);
    stops[victim].store(false, Ordering::Relaxed);
    let crawlers_of_victim = (0..CRAWLERS).filter(|i| i % REPLICAS == victim).count();
    crawlers[victim] = spawn_crawlers(
        &http,
        crawlers_of_victim,
        &[replicas[victim].api().to_owned()],
        std::slice::from_ref(&acknowledged[victim]),
        std::slice::from_ref(&stops[victim]),
        Retries::UnansweredWrites,
    )
    .remove(0);
    let what = format!("{context}: {GRANTS_AFTER_RESTART} grants on the restarted replica");
    eventually_within(SLOW, &what, || async {
        granted_on(&[victim]) >= GRANTS_AFTER_RESTART
    })
    .await;
    for stop in &stops {
        stop.store(true, Ordering::Relaxed);
    }
    for crawler in crawlers.into_iter().flatten() {
        crawler.await.unwrap();
    }
    let records: Vec<Acknowledged> = acknowledged.iter().map(|a| take(a)).collect();
    phases.mark("load after restart");
    let survivors_while_down = others_at_restart - others_at_kill;

    // Only the killed replica's crawlers lost an answer.
    let mut every: Vec<&Acknowledged> = records.iter().collect();
    every.push(&killed);
    assert_only_documented_answers(&context, &every);
    for (r, record) in records.iter().enumerate() {
        assert!(
            record.unanswered.is_empty(),
            "{context}: replica {r} (killed: {victim}) left requests unanswered: {:?}",
            record.unanswered
        );
    }
    let refused: usize = every.iter().map(|r| r.refused).sum();
    assert!(refused > 0, "{context}: no contention at all");
    let granted = distinct_grants(&context, &every);
    assert!(
        !granted.contains(&replayed),
        "{context}: the replayed lease {replayed} was granted to a crawler too"
    );
    let released: HashSet<&String> = every.iter().flat_map(|r| r.released.iter()).collect();

    // Every acknowledged lease is in the database, in the state its crawler was told ...
    let db = LedgerDb::Postgres(&database);
    let in_db = db.lease_states();
    assert_recorded(&context, db.name(), &granted, &released, &in_db);
    assert_eq!(
        in_db.get(&replayed).map(String::as_str),
        Some("released"),
        "{context}: the replayed lease"
    );
    phases.mark("psql");
    // ... and every replica, the restarted one too, serves each of them.
    for replica in &replicas {
        assert_served(&http, replica.api(), &context, &granted, &released).await;
    }
    phases.mark("GETs");
    let (most, active) = assert_capacity(&context, &db, &http, &replicas).await;
    phases.mark("capacity");
    let unavailable: usize = every.iter().map(|r| r.unavailable_total()).sum();
    let timeouts: usize = every.iter().map(|r| r.request_timeouts).sum();
    eprintln!(
        "run {run}: {} granted ({} released, {refused} refused, {unavailable} answered 503) over \
         {REPLICAS} replicas; replica {victim} killed -9 after {} grants, {survivors_while_down} \
         granted by the others while it was down, {} by its crawlers after its restart; all \
         found in the database and served by every replica; a requestID replayed on every \
         replica; at most {most} leases per proxy at any grant, {active} active now; {timeouts} \
         requests not read in time (408) and retried ({})",
        granted.len(),
        released.len(),
        granted_before_kill,
        records[victim].granted.len(),
        phases.summary(),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_on_one_postgres_keep_every_acknowledged_lease_through_kill_9() {
    let Some(postgres) = Postgres::shared() else {
        return;
    };
    let target = Target::start();
    let probe_url = target.http_url();
    let squids = [Squid::start(), Squid::start()];
    for run in 0..RUNS {
        one_run(run, postgres.database(), &squids, &probe_url).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarted_mid_load_answers_503_then_recovers_without_restarting_the_replicas() {
    let Some(postgres) = Postgres::start() else {
        return;
    };
    let context = "outage";
    let database = postgres.database();
    let target = Target::start();
    let squids = [Squid::start(), Squid::start()];
    let dir = tempfile::tempdir().unwrap();
    let inventory_path = dir.path().join("inventory.yaml");
    std::fs::write(&inventory_path, inventory(&squids, &target.http_url())).unwrap();
    let log_paths: Vec<PathBuf> = (0..REPLICAS)
        .map(|r| dir.path().join(format!("replica-{r}.log")))
        .collect();
    let http = http_client(CRAWLERS, SLOW_ANSWER);
    let mut replicas = start_replicas(&http, &log_paths, &inventory_path, &database.url()).await;
    let pids: Vec<u32> = replicas.iter().map(Operator::pid).collect();
    for replica in &replicas {
        let (status, body) = readyz(&http, replica.api()).await;
        assert_eq!(
            (status, body["database"].as_str()),
            (StatusCode::OK, Some("up")),
            "{body}"
        );
    }

    let acknowledged: Vec<Arc<Mutex<Acknowledged>>> =
        (0..REPLICAS).map(|_| Arc::default()).collect();
    let stops: Vec<Arc<AtomicBool>> = (0..REPLICAS).map(|_| Arc::default()).collect();
    let crawlers = spawn_crawlers(
        &http,
        CRAWLERS,
        &apis(&replicas),
        &acknowledged,
        &stops,
        Retries::UnansweredWrites,
    );
    let granted = |r: usize| acknowledged[r].lock().unwrap().granted.len();
    let unavailable = |r: usize| acknowledged[r].lock().unwrap().unavailable_total();
    eventually_within(SLOW, &format!("{GRANTS_BEFORE_OUTAGE} grants"), || async {
        (0..REPLICAS).map(granted).sum::<usize>() >= GRANTS_BEFORE_OUTAGE
    })
    .await;

    // What the crawlers were told before the database stopped.
    let before: Vec<Acknowledged> = acknowledged
        .iter()
        .map(|a| a.lock().unwrap().clone())
        .collect();
    let stopping = Instant::now();
    tokio::task::block_in_place(|| postgres.stop());
    let stop_took = stopping.elapsed();

    // Every replica stays ready and says the database is down ...
    let mut database_errors = Vec::new();
    for replica in &replicas {
        let what = format!("{} /readyz to say the database is down", replica.api());
        eventually_within(SLOW, &what, || async {
            let (status, body) = readyz(&http, replica.api()).await;
            assert_eq!(status, StatusCode::OK, "{}: {body}", replica.api());
            body["database"] == "down"
        })
        .await;
        let (_, body) = readyz(&http, replica.api()).await;
        database_errors.push(body["databaseError"].to_string());
    }
    let down_after = stopping.elapsed();
    // ... and keeps saying so while its writes answer 503, and none grants.
    let unavailable_at_stop: Vec<usize> =
        before.iter().map(Acknowledged::unavailable_total).collect();
    let what = format!("{UNAVAILABLE_PER_REPLICA} 503s on every replica");
    eventually_within(SLOW, &what, || async {
        assert_ready_with_the_database_down(&http, &replicas).await;
        (0..REPLICAS).all(|r| unavailable(r) >= unavailable_at_stop[r] + UNAVAILABLE_PER_REPLICA)
    })
    .await;
    let granted_while_down: Vec<usize> = (0..REPLICAS).map(granted).collect();
    let unavailable_while_down: Vec<usize> = (0..REPLICAS).map(unavailable).collect();
    let what = format!("{UNAVAILABLE_PER_REPLICA} more 503s on every replica");
    eventually_within(SLOW, &what, || async {
        assert_ready_with_the_database_down(&http, &replicas).await;
        (0..REPLICAS).all(|r| unavailable(r) >= unavailable_while_down[r] + UNAVAILABLE_PER_REPLICA)
    })
    .await;
    assert_eq!(
        (0..REPLICAS).map(granted).collect::<Vec<_>>(),
        granted_while_down,
        "leases granted while the database was down"
    );
    let outage_503s: usize = (0..REPLICAS)
        .map(|r| unavailable(r) - unavailable_at_stop[r])
        .sum();

    // The database is back: every replica grants again and says so, by itself.
    let resuming = Instant::now();
    tokio::task::block_in_place(|| postgres.resume());
    let resume_took = resuming.elapsed();
    let granted_at_resume: Vec<usize> = (0..REPLICAS).map(granted).collect();
    let mut granting_after = Vec::new();
    for (r, replica) in replicas.iter().enumerate() {
        let what = format!("replica {r} ({}) to grant again", replica.api());
        eventually_within(SLOW, &what, || async { granted(r) > granted_at_resume[r] }).await;
        granting_after.push(format!("{:.1} s", resuming.elapsed().as_secs_f64()));
        let what = format!("{} /readyz to say the database is up", replica.api());
        eventually_within(SLOW, &what, || async {
            let (status, body) = readyz(&http, replica.api()).await;
            assert_eq!(status, StatusCode::OK, "{}: {body}", replica.api());
            body["database"] == "up"
        })
        .await;
    }
    let recovered_after = resuming.elapsed();
    for (r, replica) in replicas.iter_mut().enumerate() {
        assert!(
            replica.is_running() && replica.pid() == pids[r],
            "replica {r} (pid {}) is not the process started (pid {})",
            replica.pid(),
            pids[r]
        );
    }

    for stop in &stops {
        stop.store(true, Ordering::Relaxed);
    }
    for crawler in crawlers.into_iter().flatten() {
        crawler.await.unwrap();
    }
    let records: Vec<Acknowledged> = acknowledged.iter().map(|a| take(a)).collect();
    let every: Vec<&Acknowledged> = records.iter().collect();
    assert_only_documented_answers(context, &every);
    for (r, record) in records.iter().enumerate() {
        assert!(
            record.unanswered.is_empty(),
            "replica {r} left requests unanswered: {:?}",
            record.unanswered
        );
    }
    let all_unavailable: BTreeMap<&str, usize> = records
        .iter()
        .flat_map(|r| r.unavailable.iter())
        .fold(BTreeMap::new(), |mut codes, (code, n)| {
            *codes.entry(code.as_str()).or_default() += n;
            codes
        });
    let granted_ids = distinct_grants(context, &every);
    let released: HashSet<&String> = every.iter().flat_map(|r| r.released.iter()).collect();

    // The leases acknowledged before the stop are still there, as their crawlers were told
    // then; and every lease acknowledged since, too.
    let db = LedgerDb::Postgres(&database);
    let in_db = db.lease_states();
    let before_granted: Vec<String> = before.iter().flat_map(|r| r.granted.clone()).collect();
    let before_released: HashSet<&String> = before.iter().flat_map(|r| r.released.iter()).collect();
    assert_recorded(
        "acknowledged before the stop",
        db.name(),
        &before_granted,
        &before_released,
        &in_db,
    );
    assert_recorded(context, db.name(), &granted_ids, &released, &in_db);
    let (most, active) = assert_capacity(context, &db, &http, &replicas).await;
    eprintln!(
        "outage: {} granted before the stop; stopped in {:.1} s; every /readyz said \"database\": \
         \"down\" {:.1} s after the stop ({}); {outage_503s} 503s while down, none granted; \
         PostgreSQL restarted in {:.1} s; the replicas granted again {} after the restart \
         began, all said \"up\" after {:.1} s, same {REPLICAS} processes; {} granted in all, \
         503s by code {all_unavailable:?}; all found in the database; at most {most} leases per \
         proxy at any grant, {active} active now; {} requests not read in time (408) and \
         retried, {} /readyz asked again after a 408",
        before_granted.len(),
        stop_took.as_secs_f64(),
        down_after.as_secs_f64(),
        database_errors.join(", "),
        resume_took.as_secs_f64(),
        granting_after.join(", "),
        recovered_after.as_secs_f64(),
        granted_ids.len(),
        every.iter().map(|r| r.request_timeouts).sum::<usize>(),
        READYZ_REQUEST_TIMEOUTS.load(Ordering::Relaxed),
    );
}
