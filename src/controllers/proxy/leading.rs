//! The reconciler runs on the holder of the leader Lease only, so that with several replicas
//! one process writes status, creates and deletes machines and publishes Events. Every replica
//! still watches Proxies and probes them: each serves the lease API from its own inventory and
//! its own health verdicts.

use std::sync::Arc;

use futures::{Stream, StreamExt};
use kube::runtime::reflector::ObjectRef;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::context::Context;
use super::controller::run_controller;
use super::first_write::hold_first_writes;
use crate::proxy_watch::ReconcilerFeed;
use crate::resources::proxy::Proxy;

/// Triggers buffered between the first-write hold and the controller.
const PACED_BUFFER: usize = 1024;

/// Waits for the Lease, then runs the controller until shutdown. Until the Lease is held the
/// watch's triggers, its deletions and the health transitions are drained (the watch must never
/// wait on a reconciler that does not run, and health states are recorded as they come; the
/// leader's sweep finds the deletions); once it is held every Proxy in the store is reconciled,
/// then the triggers follow, a new External proxy's held back until its first probe, also one
/// that was in the store already ([`hold_first_writes`]). Losing the Lease is an
/// error that stops the process: its restart contends again as a follower, and two processes
/// never reconcile at once.
pub async fn run_while_leading(
    ctx: Arc<Context>,
    feed: ReconcilerFeed,
    namespace: Option<String>,
    health: impl Stream<Item = ObjectRef<Proxy>> + Send + 'static,
    mut leader: watch::Receiver<bool>,
    shutdown: CancellationToken,
) -> Result<(), String> {
    let ReconcilerFeed {
        store,
        mut triggers,
        mut deleted,
    } = feed;
    let mut health = Box::pin(health);
    log::info!("waiting for the leader Lease before reconciling");
    // Drained, not reconciled: the new leader reconciles the whole store.
    let drain = async {
        loop {
            tokio::select! {
                trigger = triggers.recv() => if trigger.is_none() {
                    return "the Proxy watch stopped feeding the reconciler".to_owned();
                },
                Some(_) = deleted.recv() => {}
                _ = health.next() => {}
            }
        }
    };
    if !crate::leader::wait_to_lead(&mut leader, &shutdown, drain).await? {
        return Ok(());
    }
    log::info!("holding the leader Lease: reconciling");
    let (forward, mut paced) = mpsc::channel(PACED_BUFFER);
    let holding = hold_first_writes(store.state(), triggers, forward, store.clone(), ctx.clock);
    let triggers = futures::stream::poll_fn(move |cx| paced.poll_recv(cx));
    let controller = run_controller(ctx, store, triggers, namespace.as_deref(), health, deleted);
    // Either ends only when the watch stops feeding the reconciler.
    let work = async {
        tokio::select! {
            () = controller => {}
            () = holding => {}
        }
    };
    crate::leader::lead(&mut leader, &shutdown, "the reconciler", work).await
}
