//! Acknowledged leases survive `kill -9` of the real binary under load: `proxy-operator
//! standalone` over real squids, 32 concurrent crawlers acquiring, swapping and releasing
//! leases, the process killed with SIGKILL mid-load, restarted on the same ledger file — five
//! times. After each restart every lease a crawler was answered 201 for is in the ledger (by
//! the API and by the `sqlite3` CLI), every release answered 204 is released, and no proxy
//! ever held more leases than its `maxLeases`, neither at any grant in the history nor now.

use crate::support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::crawl_load::{
    Acknowledged, LedgerDb, MAX_LEASES, Operator, Retries, assert_recorded, assert_served,
    eventually, http_client, inventory, listed_active, spawn_crawlers, wait_all_healthy,
};
use support::{DEADLINE, Squid, Target, sqlite3};

const RUNS: usize = 5;
const CRAWLERS: usize = 32;
/// Grants before the kill, growing per run so the kill lands at different moments.
const GRANTS_BEFORE_KILL: usize = 120;

async fn one_run(run: usize, squids: &[Squid], probe_url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let inventory_path = dir.path().join("inventory.yaml");
    std::fs::write(&inventory_path, inventory(squids, probe_url)).unwrap();
    let db = dir.path().join("ledger.db");
    let ledger = db.to_str().expect("a UTF-8 temp path").to_owned();
    let log = dir.path().join("operator.log");
    let http = http_client(CRAWLERS, Duration::from_secs(10));
    let start = || {
        Operator::start(
            &log,
            &inventory_path,
            &ledger,
            &["--ledger-durability", "normal"],
        )
    };

    let mut operator = start();
    wait_all_healthy(&http, &operator, DEADLINE).await;

    let acknowledged = Arc::new(Mutex::new(Acknowledged::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let crawlers = spawn_crawlers(
        &http,
        CRAWLERS,
        &[operator.api().to_owned()],
        std::slice::from_ref(&acknowledged),
        std::slice::from_ref(&stop),
        Retries::Never,
    );
    let kill_after = GRANTS_BEFORE_KILL * (run + 1);
    eventually(&format!("{kill_after} grants"), || async {
        acknowledged.lock().unwrap().granted.len() >= kill_after
    })
    .await;
    operator.kill_9();
    stop.store(true, Ordering::Relaxed);
    for crawler in crawlers.into_iter().flatten() {
        crawler.await.unwrap();
    }
    let acknowledged = std::mem::take(&mut *acknowledged.lock().unwrap());
    assert!(
        acknowledged.unexpected.is_empty(),
        "run {run}: {:?}",
        acknowledged.unexpected
    );
    assert!(acknowledged.refused > 0, "run {run}: no contention at all");
    assert_eq!(sqlite3(&db, "PRAGMA integrity_check"), "ok", "run {run}");

    // Restart on the same file.
    drop(operator);
    let operator = start();
    eventually("the restarted API", || async {
        http.get(format!("{}/readyz", operator.api()))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
    })
    .await;

    // Every acknowledged lease is in the file, in the state the crawlers were told ...
    let file = LedgerDb::Sqlite(&db);
    let context = format!("run {run}");
    let released = acknowledged.released_set();
    assert_recorded(
        &context,
        file.name(),
        &acknowledged.granted,
        &released,
        &file.lease_states(),
    );
    // ... and the restarted API serves each of them.
    assert_served(
        &http,
        operator.api(),
        &context,
        &acknowledged.granted,
        &released,
    )
    .await;

    // Capacity: never exceeded at any grant, and not now (file and API agree).
    let (proxy, most) = file.most_held_at_any_grant();
    assert!(
        most <= MAX_LEASES,
        "run {run}: {proxy} held {most} leases, maxLeases is {MAX_LEASES}"
    );
    assert_eq!(most, MAX_LEASES, "run {run}: the load never filled a proxy");
    let per_proxy = file.active_per_proxy();
    assert!(
        per_proxy.values().all(|&n| n <= MAX_LEASES),
        "run {run}: {per_proxy:?}"
    );
    assert_eq!(
        listed_active(&http, operator.api()).await,
        per_proxy,
        "run {run}"
    );
    eprintln!(
        "run {run}: {} granted ({} released, {} refused) before kill -9; all found after restart; \
         at most {most} leases per proxy at any grant, {} active now",
        acknowledged.granted.len(),
        acknowledged.released.len(),
        acknowledged.refused,
        per_proxy.values().sum::<u64>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_leases_survive_kill_9_under_load() {
    let target = Target::start();
    let probe_url = target.http_url();
    let squids = [Squid::start(), Squid::start()];
    for run in 0..RUNS {
        one_run(run, &squids, &probe_url).await;
    }
}
