//! The first reconcile of a new External proxy waits for its first probe.
//!
//! A new External proxy's status says two things: that it is provisioned (its endpoint is its
//! address) and whether it is healthy. Reconciled as soon as the watch delivers it, it is
//! written twice: at once (`Healthy=Unknown`, phase `Provisioning`) and again when the health
//! engine's first verdict arrives, a second or so later (a new proxy is probed at once). With a
//! large fleet the API server's time goes on writes, so the watch's trigger of such a proxy is
//! held back ([`hold_first_writes`]): the first verdict's transition triggers the reconcile
//! anyway, which then writes once, with both. A held trigger is let go at the latest its probe
//! interval, timeout and [`FIRST_PROBE_MARGIN`] after the proxy's creation (a probe that never
//! answers, thresholds above one result), and dropped when the proxy got a status meanwhile.
//! The interval counts because a proxy that is already there when the operator starts (in the
//! health engine's first inventory) has its first probe jittered over one interval.
//!
//! Only the watch's triggers wait: a reconcile, once started, writes what it knows, and every
//! other trigger (the transition, the leader's start, a requeue) reconciles at once.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};
use tokio::sync::mpsc;

use super::context::TimeSource;
use super::time::after;
use crate::resources::proxy::{FINALIZER, Mode, Proxy};

/// How long past a new External proxy's probe timeout its first reconcile waits for the probe:
/// the health engine's tick (1 s) and the inventory's batching (0.1 s), with room for a queue
/// of other first probes.
pub const FIRST_PROBE_MARGIN: Duration = Duration::from_secs(5);

/// Until when the watch's trigger of `proxy` is held back at `now`: a new External proxy
/// without a status, not being deleted and without our finalizer (which goes at once), until
/// its probe interval, timeout and [`FIRST_PROBE_MARGIN`] after its creation. `None`:
/// reconcile now.
pub fn hold_until(proxy: &Proxy, now: Timestamp) -> Option<Timestamp> {
    let unwritten = proxy.status.as_ref().and_then(|s| s.phase).is_none();
    let finalized = proxy.finalizers().iter().any(|f| f == FINALIZER);
    if proxy.spec.mode != Mode::External
        || !unwritten
        || finalized
        || proxy.metadata.deletion_timestamp.is_some()
    {
        return None;
    }
    let created = proxy.metadata.creation_timestamp.as_ref()?.0;
    let check = proxy.spec.health_check();
    let wait = check
        .interval()
        .saturating_add(check.timeout())
        .saturating_add(FIRST_PROBE_MARGIN);
    Some(after(created, wait)).filter(|until| *until > now)
}

/// A trigger held back until `until` (`seq` keeps the order of equal times).
#[derive(Debug)]
struct Held {
    until: Timestamp,
    seq: u64,
    proxy: Arc<Proxy>,
}

impl PartialEq for Held {
    fn eq(&self, other: &Self) -> bool {
        (self.until, self.seq) == (other.until, other.seq)
    }
}

impl Eq for Held {}

impl PartialOrd for Held {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Held {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.until, self.seq).cmp(&(other.until, other.seq))
    }
}

/// Forwards the Proxies `present` when leadership began, then the watch's `triggers`, to
/// `output`, holding back those [`hold_until`] says to until then; a held one is let go as
/// `store` has it then, unless it has a status by then or is gone. Returns when either channel
/// closes.
///
/// The present ones are held too: a Proxy created while the operator was starting (before it
/// held the Lease) is as new as one created after.
pub async fn hold_first_writes(
    present: Vec<Arc<Proxy>>,
    mut triggers: mpsc::Receiver<Arc<Proxy>>,
    output: mpsc::Sender<Arc<Proxy>>,
    store: Store<Proxy>,
    clock: TimeSource,
) {
    let mut held: BinaryHeap<Reverse<Held>> = BinaryHeap::new();
    let mut seq: u64 = 0;
    for proxy in present {
        match hold_until(&proxy, clock()) {
            Some(until) => {
                held.push(Reverse(Held { until, seq, proxy }));
                seq = seq.wrapping_add(1);
            }
            None => {
                if output.send(proxy).await.is_err() {
                    return;
                }
            }
        }
    }
    loop {
        let next = held.peek().map(|Reverse(h)| h.until);
        let due = async {
            match next {
                Some(until) => {
                    let left = until.duration_since(clock()).try_into();
                    tokio::time::sleep(left.unwrap_or(Duration::ZERO)).await;
                }
                None => std::future::pending().await,
            }
        };
        let forward = tokio::select! {
            trigger = triggers.recv() => {
                let Some(proxy) = trigger else {
                    return;
                };
                match hold_until(&proxy, clock()) {
                    Some(until) => {
                        held.push(Reverse(Held { until, seq, proxy }));
                        seq = seq.wrapping_add(1);
                        continue;
                    }
                    None => vec![proxy],
                }
            }
            () = due => released(&mut held, &store, clock()),
        };
        for proxy in forward {
            if output.send(proxy).await.is_err() {
                return;
            }
        }
    }
}

/// Takes the held triggers due at `now` off `held`: those whose Proxy is still in `store`
/// without a status, as `store` has it now.
fn released(
    held: &mut BinaryHeap<Reverse<Held>>,
    store: &Store<Proxy>,
    now: Timestamp,
) -> Vec<Arc<Proxy>> {
    let mut due = Vec::new();
    while held.peek().is_some_and(|Reverse(h)| h.until <= now) {
        let Some(Reverse(h)) = held.pop() else {
            break;
        };
        let current = store
            .get(&ObjectRef::from_obj(h.proxy.as_ref()))
            .filter(|p| p.status.as_ref().and_then(|s| s.phase).is_none());
        due.extend(current);
    }
    due
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures;
    use crate::resources::proxy::{Phase, ProxyStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use kube::runtime::watcher;

    fn ts(seconds: i64) -> Timestamp {
        Timestamp::from_second(seconds).unwrap()
    }

    /// A new External proxy `name` created at `created` (seconds), its probe interval 30 s and
    /// timeout 5 s.
    fn new_external(name: &str, created: i64) -> Proxy {
        let mut proxy = fixtures::external(name, "10.0.0.1", 3128).build();
        proxy.metadata.creation_timestamp = Some(Time(ts(created)));
        proxy
    }

    fn written(mut proxy: Proxy) -> Proxy {
        proxy.status = Some(ProxyStatus {
            phase: Some(Phase::Provisioning),
            ..ProxyStatus::default()
        });
        proxy
    }

    #[test]
    fn only_a_new_unwritten_external_proxy_waits_for_its_probe() {
        const NOW: i64 = 1_000;
        let new = || new_external("p", NOW - 2);
        let mut finalized = new();
        finalized.metadata.finalizers = Some(vec![FINALIZER.to_owned()]);
        let mut deleting = new();
        deleting.metadata.deletion_timestamp = Some(Time(ts(NOW)));
        let mut uncreated = new();
        uncreated.metadata.creation_timestamp = None;
        let managed = {
            let mut proxy = fixtures::managed("m", "local").build();
            proxy.metadata.creation_timestamp = Some(Time(ts(NOW - 2)));
            proxy
        };
        let mut slow_probe = new();
        slow_probe.spec.health_check.timeout = Duration::from_secs(20).into();
        let cases = [
            (
                "new: until 30 s interval + 5 s timeout + 5 s margin",
                new(),
                Some(ts(NOW + 38)),
            ),
            (
                "a longer probe timeout waits longer",
                slow_probe,
                Some(ts(NOW + 53)),
            ),
            ("the wait is over", new_external("p", NOW - 40), None),
            ("written already (an edit)", written(new()), None),
            ("our finalizer goes at once", finalized, None),
            ("being deleted", deleting, None),
            ("no creation time to count from", uncreated, None),
            ("managed", managed, None),
        ];
        for (name, proxy, expected) in cases {
            assert_eq!(hold_until(&proxy, ts(NOW)), expected, "{name}");
        }
    }

    fn now() -> Timestamp {
        Timestamp::now()
    }

    /// A proxy created so that its hold ends `ms` milliseconds from now.
    fn held_for(name: &str, ms: i64) -> Proxy {
        let mut proxy = new_external(name, 0);
        let created = now()
            .checked_sub(jiff::SignedDuration::from_secs(40))
            .and_then(|t| t.checked_add(jiff::SignedDuration::from_millis(ms)))
            .unwrap();
        proxy.metadata.creation_timestamp = Some(Time(created));
        proxy
    }

    #[tokio::test]
    async fn held_triggers_come_after_the_others_and_only_while_unwritten() {
        let (store, mut writer) = kube::runtime::reflector::store::<Proxy>();
        let (triggers, input) = mpsc::channel(8);
        let (output, mut forwarded) = mpsc::channel(8);
        // Present when leadership began: one written already, one new.
        let present_settled = written(new_external("present-settled", 0));
        let present_waits = held_for("present-waits", 50);
        let waits = held_for("waits", 300);
        let gets_written = held_for("gets-written", 200);
        let settled = written(new_external("settled", 0));
        for proxy in [
            &present_settled,
            &present_waits,
            &waits,
            &gets_written,
            &settled,
        ] {
            writer.apply_watcher_event(&watcher::Event::Apply(proxy.clone()));
        }
        let present = vec![Arc::new(present_settled), Arc::new(present_waits)];
        let task = tokio::spawn(hold_first_writes(present, input, output, store, now));
        for proxy in [&waits, &gets_written, &settled] {
            triggers.send(Arc::new(proxy.clone())).await.unwrap();
        }
        let name = |proxy: Option<Arc<Proxy>>| proxy.and_then(|p| p.metadata.name.clone());
        assert_eq!(
            name(forwarded.recv().await).as_deref(),
            Some("present-settled"),
            "a written one present at the start goes at once"
        );
        // The written trigger at once, and the present one once its short hold is over.
        let mut next_two = Vec::new();
        for _ in 0..2 {
            let next = tokio::time::timeout(Duration::from_secs(10), forwarded.recv())
                .await
                .expect("the written trigger, and the held one present at the start");
            next_two.extend(name(next));
        }
        next_two.sort();
        assert_eq!(next_two, ["present-waits", "settled"]);
        // Its first verdict was written before its hold ended: nothing left to trigger.
        writer.apply_watcher_event(&watcher::Event::Apply(written(gets_written)));
        let next = tokio::time::timeout(Duration::from_secs(10), forwarded.recv())
            .await
            .expect("the held trigger is let go")
            .unwrap();
        assert_eq!(next.metadata.name.as_deref(), Some("waits"));
        drop(triggers);
        assert!(
            forwarded.recv().await.is_none(),
            "nothing else, then the end"
        );
        task.await.unwrap();
    }
}
