//! The watch driven by a scripted raw event stream: no API server, the real store, inventory
//! and gauge.

use std::time::Duration;

use super::skip::tests::{bad, good};
use super::*;

/// The watch running on a scripted stream, with everything a test looks at.
struct Harness {
    events: mpsc::Sender<watcher::Event<DynamicObject>>,
    inventory: Inventory,
    metrics: WatchMetrics,
    reports: mpsc::Receiver<Undecodable>,
    triggers: mpsc::Receiver<Arc<Proxy>>,
    store: Store<Proxy>,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), String>>,
}

impl Harness {
    fn start() -> Harness {
        let (events, rx) = mpsc::channel(1024);
        let raw_stream = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|event| (Ok(event), rx))
        });
        let metrics = WatchMetrics::register(&Registry::new()).unwrap();
        let (watch, feed) = shared_store();
        let (reports_tx, reports) = mpsc::channel(REPORT_BUFFER);
        let inventory = Inventory::new();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run(
            watch,
            raw_stream,
            inventory.clone(),
            metrics.clone(),
            reports_tx,
            shutdown.clone(),
        ));
        Harness {
            events,
            inventory,
            metrics,
            reports,
            triggers: feed.triggers,
            store: feed.store,
            shutdown,
            task,
        }
    }

    async fn send(&self, event: watcher::Event<DynamicObject>) {
        self.events.send(event).await.unwrap();
    }

    /// Waits (bounded) until the inventory holds exactly `names`, sorted.
    async fn inventory_becomes(&self, names: &[&str]) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let snapshot = self.inventory.snapshot();
            let current: Vec<String> = snapshot
                .proxies()
                .iter()
                .map(|p| p.metadata.name.clone().unwrap_or_default())
                .collect();
            if snapshot.is_synced() && current == names {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "inventory is {current:?}, expected {names:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn undecodable(&self) -> i64 {
        self.metrics.undecodable.get()
    }

    fn triggered(&mut self) -> Vec<String> {
        let mut names = Vec::new();
        while let Ok(proxy) = self.triggers.try_recv() {
            names.push(proxy.metadata.name.clone().unwrap_or_default());
        }
        names.sort();
        names
    }

    fn reported(&mut self) -> Vec<String> {
        let mut keys = Vec::new();
        while let Ok(report) = self.reports.try_recv() {
            keys.push(report.key);
        }
        keys
    }

    async fn stop(self) {
        self.shutdown.cancel();
        let result = tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(result, Ok(()));
    }
}

#[tokio::test]
async fn an_undecodable_proxy_is_skipped_and_the_others_are_served() {
    use watcher::Event::{Apply, Delete, Init, InitApply, InitDone};
    let mut h = Harness::start();
    h.send(Init).await;
    h.send(InitApply(good("a", "1"))).await;
    h.send(InitApply(bad("b", "2"))).await;
    h.send(InitApply(good("c", "3"))).await;
    h.send(InitDone).await;
    h.inventory_becomes(&["a", "c"]).await;
    assert_eq!(h.undecodable(), 1);
    assert_eq!(h.reported(), ["crawl/b"]);
    assert_eq!(h.triggered(), ["a", "c"]);

    // A good Proxy turns bad: it leaves the store and the inventory, and is reported.
    h.send(Apply(bad("a", "4"))).await;
    h.inventory_becomes(&["c"]).await;
    assert_eq!(h.undecodable(), 2);
    assert_eq!(h.reported(), ["crawl/a"]);
    assert!(h.store.get(&ObjectRef::new("a").within("crawl")).is_none());
    assert!(
        h.triggered().is_empty(),
        "an evicted Proxy is not reconciled"
    );

    // The bad one is fixed: back in, reconciled, no longer counted.
    h.send(Apply(good("b", "5"))).await;
    h.inventory_becomes(&["b", "c"]).await;
    assert_eq!(h.undecodable(), 1);
    assert_eq!(h.triggered(), ["b"]);

    // The other bad one is deleted: no longer counted, nothing reported.
    h.send(Delete(bad("a", "6"))).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while h.undecodable() != 0 {
        assert!(
            Instant::now() < deadline,
            "gauge stuck at {}",
            h.undecodable()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(h.reported().is_empty());

    // A re-list (after a reconnect) does not report an unchanged bad object again.
    h.send(Apply(bad("d", "7"))).await;
    h.send(Init).await;
    h.send(InitApply(good("b", "5"))).await;
    h.send(InitApply(good("c", "3"))).await;
    h.send(InitApply(bad("d", "7"))).await;
    h.send(InitDone).await;
    // The end of a list triggers every stored Proxy: the sign the re-list is through.
    let mut relisted = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while relisted.len() < 2 {
        assert!(Instant::now() < deadline, "re-list triggered {relisted:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
        relisted.extend(h.triggered());
    }
    assert_eq!(relisted, ["b", "c"]);
    h.inventory_becomes(&["b", "c"]).await;
    assert_eq!(h.undecodable(), 1);
    assert_eq!(
        h.reported(),
        ["crawl/d"],
        "reported once, before the re-list"
    );
    h.stop().await;
}

#[tokio::test]
async fn the_inventory_shares_the_stores_proxies() {
    use watcher::Event::{Init, InitApply, InitDone};
    let h = Harness::start();
    h.send(Init).await;
    h.send(InitApply(good("a", "1"))).await;
    h.send(InitDone).await;
    h.inventory_becomes(&["a"]).await;
    let stored = h.store.get(&ObjectRef::new("a").within("crawl")).unwrap();
    assert!(Arc::ptr_eq(&h.inventory.snapshot().proxies()[0], &stored));
    h.stop().await;
}

#[tokio::test]
async fn a_burst_of_changes_rebuilds_the_inventory_a_few_times_not_per_event() {
    use watcher::Event::{Apply, Init, InitDone};
    let mut h = Harness::start();
    h.send(Init).await;
    h.send(InitDone).await;
    h.inventory_becomes(&[]).await;
    let before = h.inventory.snapshot().version();
    const BURST: usize = 500;
    let names: Vec<String> = (0..BURST).map(|i| format!("p{i:04}")).collect();
    for (i, name) in names.iter().enumerate() {
        h.send(Apply(good(name, &format!("{}", 10 + i)))).await;
    }
    let expected: Vec<&str> = names.iter().map(String::as_str).collect();
    h.inventory_becomes(&expected).await;
    let rebuilds = h.inventory.snapshot().version() - before;
    // One rebuild per INVENTORY_BATCH while the burst is being read: a handful, however
    // slow the machine, against one per event without batching.
    assert!(
        (1..=BURST as u64 / 10).contains(&rebuilds),
        "{BURST} changes rebuilt the inventory {rebuilds} times"
    );
    assert_eq!(
        h.triggered().len(),
        BURST,
        "every change still triggers a reconcile"
    );
    h.stop().await;
}

#[tokio::test]
async fn the_watch_ending_is_an_error() {
    let h = Harness::start();
    drop(h.events);
    let result = tokio::time::timeout(Duration::from_secs(10), h.task)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(result, Err("the Proxy watch ended".to_owned()));
}

#[test]
fn the_warning_event_says_what_and_why() {
    let mut skipped = SkipList::default();
    let report = skipped
        .triage(watcher::Event::Apply(bad("b", "9")))
        .report
        .unwrap();
    let event = warning_event(&report);
    assert_eq!(event.type_, EventType::Warning);
    assert_eq!(event.reason, "InvalidSpec");
    assert_eq!(event.action, "Decode");
    let note = event.note.unwrap();
    assert!(
        note.starts_with(
            "proxy-operator cannot read this Proxy and skips it until it is fixed: \
             spec.healthCheck.interval: \"30\" is not a duration: expected numbers each \
             followed by a unit"
        ),
        "{note}"
    );
    assert!(note.contains("no validation ratcheting"), "{note}");
    assert!(note.len() <= crate::events::NOTE_LIMIT);
    assert_eq!(
        log_line(&report),
        "Proxy crawl/b (resourceVersion 9) cannot be decoded; skipping it until it is fixed: \
         spec.healthCheck.interval: \"30\" is not a duration: expected numbers each followed \
         by a unit (h, m, s, ms, us, ns), e.g. 30s, 1m30s, 500ms or 1.5h"
    );
}

#[test]
fn the_gauge_is_registered_under_its_name() {
    let registry = Registry::new();
    let metrics = WatchMetrics::register(&registry).unwrap();
    metrics.set_undecodable(3);
    let families = registry.gather();
    let family = families
        .iter()
        .find(|f| f.name() == UNDECODABLE_METRIC)
        .unwrap();
    assert_eq!(family.get_metric()[0].get_gauge().value(), 3.0);
}
