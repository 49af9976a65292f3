//! The pool controller, on the leader Lease holder beside the Proxy reconciler: one reconcile
//! of a pool lists its members from the API server (a consistent read, never a cache that may
//! lag a create), lets the autoscaler set `spec.replicas`, plans creates and removals
//! ([`plan`]), carries them out and writes the status once.
//!
//! Members are removed by deleting their Proxy after marking why
//! ([`REMOVAL_ANNOTATION`]): the Proxy's own finalizer drains it (no new leases, existing ones
//! run out or time out) before its machine goes, and it holds a replacement-budget slot
//! meanwhile. A deleted pool deletes its members first, through its own finalizer, so it works
//! without Kubernetes' garbage collector.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::{Stream, StreamExt};
use jiff::Timestamp;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{self, Controller};
use kube::runtime::events::{EventType, Recorder};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use tokio::sync::{broadcast, watch};
use tokio_util::sync::CancellationToken;

use super::autoscale::{ScaleDecision, ScaleInputs, autoscale};
use super::members::{Member, build_member, member_of, repriced, template_hash};
use super::metrics::{PoolFigures, PoolMetrics};
use super::plan::{Plan, PlanInputs, plan};
use super::status::{StatusInputs, pool_status, status_patch};
use crate::controllers::budget::{self, Share};
use crate::events::event;
use crate::ledger::{Ledger, LedgerError};
use crate::resources::pool::{POOL_FINALIZER, POOL_LABEL, ProxyPool, REMOVAL_ANNOTATION, Removal};
use crate::resources::proxy::Proxy;
use crate::serving::pools::directory::DEMAND_WINDOW;
use crate::serving::pools::watch::PoolFeed;

/// How soon a pool is looked at again.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolIntervals {
    /// While members are created, rolled, removed or not yet Ready.
    pub busy: Duration,
    /// When nothing is under way, without autoscaling.
    pub idle: Duration,
    /// When nothing is under way, with autoscaling: how often demand recorded by other
    /// replicas is read (this replica's own refusals trigger a reconcile at once).
    pub evaluate: Duration,
}

impl Default for PoolIntervals {
    fn default() -> Self {
        PoolIntervals {
            busy: Duration::from_secs(1),
            idle: Duration::from_secs(10),
            evaluate: Duration::from_secs(2),
        }
    }
}

/// What every pool reconcile shares.
pub struct PoolContext {
    /// Kubernetes client.
    pub client: Client,
    /// The ledger: active leases and unmet demand.
    pub ledger: Arc<dyn Ledger>,
    /// Publishes Events on pools.
    pub recorder: Recorder,
    /// Every Proxy (the Proxy watch's store): the fleet the replacement budget is a share of.
    pub fleet: Store<Proxy>,
    /// The replacement budget (`--replacement-budget`).
    pub budget: Share,
    /// Gauges and counters.
    pub metrics: PoolMetrics,
    /// Requeue intervals.
    pub intervals: PoolIntervals,
    /// Current time.
    pub clock: fn() -> Timestamp,
    /// The generation each pool reaches with the `spec.replicas` this process wrote last, by
    /// UID: until the cache shows it, a reconcile would plan from the count before it.
    pub expected: Mutex<HashMap<String, i64>>,
}

impl PoolContext {
    /// Whether `pool` is older than what this process wrote to it (the cache lags the write).
    fn is_stale(&self, pool: &ProxyPool) -> bool {
        let uid = pool.uid().unwrap_or_default();
        let mut expected = self.expected.lock().unwrap_or_else(PoisonError::into_inner);
        match expected.get(&uid) {
            Some(&generation) if pool.metadata.generation.unwrap_or(0) < generation => true,
            Some(_) => {
                expected.remove(&uid);
                false
            }
            None => false,
        }
    }

    /// Remembers that `pool` reaches its next generation with this process's write.
    fn expect_next_generation(&self, pool: &ProxyPool) {
        let next = pool.metadata.generation.unwrap_or(0) + 1;
        self.expected
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(pool.uid().unwrap_or_default(), next);
    }
}

/// Why a pool reconcile failed; retried after a backoff.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// A Kubernetes API call failed.
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// The ledger could not say how much demand there is.
    #[error("ledger: {0}")]
    Ledger(#[from] LedgerError),
    /// The object lacks a field the API server always sets.
    #[error("object has no {0}")]
    MissingField(&'static str),
}

/// One reconcile of one pool (see the module doc).
pub async fn reconcile(
    pool: Arc<ProxyPool>,
    ctx: Arc<PoolContext>,
) -> Result<controller::Action, PoolError> {
    let namespace = pool
        .namespace()
        .ok_or(PoolError::MissingField("metadata.namespace"))?;
    let name = pool.name_any();
    let pools: Api<ProxyPool> = Api::namespaced(ctx.client.clone(), &namespace);
    let proxies: Api<Proxy> = Api::namespaced(ctx.client.clone(), &namespace);
    let listed = proxies
        .list(&ListParams::default().labels(&format!("{POOL_LABEL}={name}")))
        .await?
        .items;
    // A member is one this pool owns: an object that only carries the label is left alone.
    let owned: Vec<Proxy> = listed
        .into_iter()
        .filter(|p| {
            p.owner_references()
                .iter()
                .any(|o| o.controller == Some(true) && Some(&o.uid) == pool.uid().as_ref())
        })
        .collect();

    if pool.metadata.deletion_timestamp.is_some() {
        return delete_members(&pool, &owned, &pools, &proxies, &ctx).await;
    }
    if ctx.is_stale(&pool) {
        log::debug!(
            "ProxyPool {}: waiting for the cache to show the last scale",
            pool.key()
        );
        return Ok(controller::Action::requeue(ctx.intervals.busy));
    }
    if !pool.finalizers().iter().any(|f| f == POOL_FINALIZER) {
        let mut finalizers = pool.finalizers().to_vec();
        finalizers.push(POOL_FINALIZER.to_owned());
        patch_finalizers(&pools, &pool, finalizers).await?;
        return Ok(controller::Action::await_change());
    }

    let now = (ctx.clock)();
    let hash = template_hash(&pool.spec.template);
    let members: Vec<Member> = {
        let counts = ctx.ledger.counts();
        owned
            .iter()
            .map(|p| member_of(&pool, &hash, p, counts.active_count(&p.id().uid)))
            .collect()
    };
    let current = pool.status.clone().unwrap_or_default();
    let spec_replicas = pool.spec.replicas.max(0).unsigned_abs();
    let scale = match &pool.spec.autoscaling {
        Some(autoscaling) => {
            let unmet = ctx
                .ledger
                .recent_demand(DEMAND_WINDOW)
                .await?
                .get(&pool.key())
                .copied()
                .unwrap_or(0);
            let active = members
                .iter()
                .filter(|m| !m.deleting)
                .map(|m| u64::from(m.leases))
                .sum();
            Some(autoscale(&ScaleInputs {
                replicas: spec_replicas,
                decided: current.desired_replicas.and_then(|d| u32::try_from(d).ok()),
                min: autoscaling.min_replicas.max(0).unsigned_abs(),
                max: autoscaling.max_replicas.max(0).unsigned_abs(),
                target: autoscaling.target_utilization,
                max_leases: pool.spec.template.spec.max_leases(),
                active,
                unmet,
                below_target_since: current.below_target_since,
                scale_down_after: autoscaling.scale_down_after(),
                now,
            }))
        }
        None => None,
    };
    let desired = scale.as_ref().map_or(spec_replicas, |s| s.replicas);
    let scaled = desired != spec_replicas;
    let (surge, unavailable) = strategy(&pool, desired);
    let plan = plan(&PlanInputs {
        desired,
        surge,
        unavailable,
        members: &members,
        budget_free: budget_free(&ctx),
    });
    let status = pool_status(&StatusInputs {
        current: &current,
        members: &members,
        desired,
        unavailable,
        plan: &plan,
        scale: scale.as_ref(),
        scaled,
        selector: pool.selector(),
        generation: pool.metadata.generation,
        now,
    });
    // The decision is recorded (status.desiredReplicas) before spec.replicas is written, so a
    // failed write is retried towards it rather than taken for someone else's scale.
    let mut version = pool.resource_version();
    if status != current {
        let written = pools
            .patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(status_patch(&status)),
            )
            .await?;
        version = written.resource_version();
    }
    let scale_written = !scaled
        || scale_to(
            &pool,
            version.as_deref(),
            &pools,
            (spec_replicas, desired),
            scale.as_ref(),
            &ctx,
        )
        .await?;
    if !scale_written {
        return Ok(controller::Action::requeue(ctx.intervals.busy));
    }
    carry_out(&pool, &plan, &hash, &proxies, &ctx).await?;
    reprice(&pool, &owned, &proxies).await?;

    ctx.metrics.set(
        &namespace,
        &name,
        PoolFigures {
            desired,
            current: u32::try_from(status.replicas).unwrap_or(0),
            ready: u32::try_from(status.ready_replicas).unwrap_or(0),
            max: pool
                .spec
                .autoscaling
                .as_ref()
                .map(|a| a.max_replicas.max(0).unsigned_abs()),
            utilization: status.utilization,
        },
    );
    let settled = plan.is_empty()
        && !scaled
        && status.replicas == status.ready_replicas
        && status.updated_replicas == status.replicas
        && u32::try_from(status.replicas).ok() == Some(desired)
        && members.iter().all(|m| !m.deleting);
    Ok(controller::Action::requeue(
        match (settled, &pool.spec.autoscaling) {
            (false, _) => ctx.intervals.busy,
            (true, Some(_)) => ctx.intervals.evaluate,
            (true, None) => ctx.intervals.idle,
        },
    ))
}

/// `maxSurge` and `maxUnavailable` for `desired` members; a value the server let through but
/// that does not read (an older CRD) falls back to the defaults, with a warning.
fn strategy(pool: &ProxyPool, desired: u32) -> (u32, u32) {
    let strategy = &pool.spec.strategy;
    let surge = strategy.surge(desired).unwrap_or_else(|e| {
        log::warn!("ProxyPool {}: {e}; using 1", pool.key());
        1
    });
    let unavailable = strategy.unavailable(desired).unwrap_or_else(|e| {
        log::warn!("ProxyPool {}: {e}; using 0", pool.key());
        0
    });
    // Both 0 would never roll (the CRD refuses it; an older object may not have been checked).
    (
        if surge == 0 && unavailable == 0 {
            1
        } else {
            surge
        },
        unavailable,
    )
}

/// Free slots of the fleet's replacement budget: its share of the Managed proxies, less the
/// slots replacements and pool removals hold.
fn budget_free(ctx: &PoolContext) -> u32 {
    let fleet = ctx.fleet.state();
    let limit = ctx
        .budget
        .budget(budget::managed(fleet.iter().map(AsRef::as_ref)));
    let held = budget::holders(fleet.iter().map(AsRef::as_ref)).len();
    u32::try_from(limit.saturating_sub(held)).unwrap_or(u32::MAX)
}

/// Writes the autoscaler's `spec.replicas`, with an Event that says why (and that it overrules
/// a manual scale, when someone else changed it since the last decision). `false` when the pool
/// changed since it was read (nothing written: look again).
async fn scale_to(
    pool: &ProxyPool,
    version: Option<&str>,
    pools: &Api<ProxyPool>,
    (was, desired): (u32, u32),
    scale: Option<&ScaleDecision>,
    ctx: &PoolContext,
) -> Result<bool, PoolError> {
    // Through `/scale`, as an HPA would, guarded by the resourceVersion the decision was made on
    // (`version`: the pool's, or its status write's).
    let patch = json!({
        "metadata": {"resourceVersion": version},
        "spec": {"replicas": desired},
    });
    match pools
        .patch_scale(
            &pool.name_any(),
            &PatchParams::default(),
            &Patch::Merge(patch),
        )
        .await
    {
        Ok(_) => ctx.expect_next_generation(pool),
        Err(kube::Error::Api(status)) if status.code == 409 => {
            log::debug!(
                "ProxyPool {}: changed since read; looking again",
                pool.key()
            );
            return Ok(false);
        }
        Err(e) => return Err(e.into()),
    }
    let up = desired > was;
    ctx.metrics
        .scaled(&pool.namespace().unwrap_or_default(), &pool.name_any(), up);
    let reason = scale.map_or("Scaled", |s| s.reason.as_str());
    let note = match scale {
        Some(s) if s.overruled => format!(
            "overruled a manual scale to {was}: autoscaling sets spec.replicas (demand asks for \
             {} members, {reason}); scaled to {desired}",
            s.wanted
        ),
        _ => format!("scaled from {was} to {desired} ({reason})"),
    };
    log::info!("ProxyPool {}: {note}", pool.key());
    publish(
        ctx,
        pool,
        EventType::Normal,
        if up { "ScaledUp" } else { "ScaledDown" },
        note,
    )
    .await;
    Ok(true)
}

/// Creates and removes what `plan` says.
async fn carry_out(
    pool: &ProxyPool,
    plan: &Plan,
    hash: &str,
    proxies: &Api<Proxy>,
    ctx: &PoolContext,
) -> Result<(), PoolError> {
    let mut created = Vec::new();
    for &index in &plan.create {
        let member = build_member(pool, hash, index);
        match proxies.create(&PostParams::default(), &member).await {
            Ok(_) => created.push(member.name_any()),
            // Named deterministically: a repeated create finds the member it already made.
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
    }
    if !created.is_empty() {
        let note = format!("created members {}", created.join(", "));
        log::info!("ProxyPool {}: {note}", pool.key());
        publish(ctx, pool, EventType::Normal, "CreatedMembers", note).await;
    }
    for (name, removal) in &plan.remove {
        remove_member(proxies, name, *removal).await?;
        let note = format!(
            "removing member {name} ({}): it drains first",
            removal.cause()
        );
        log::info!("ProxyPool {}: {note}", pool.key());
        publish(ctx, pool, EventType::Normal, "RemovingMember", note).await;
    }
    Ok(())
}

/// Writes the template's `cost` onto the members with another one (`null` removes it).
async fn reprice(pool: &ProxyPool, owned: &[Proxy], proxies: &Api<Proxy>) -> Result<(), PoolError> {
    let cost = &pool.spec.template.spec.cost;
    for member in repriced(&pool.spec.template, owned) {
        let name = member.name_any();
        let patch = json!({"spec": {"cost": cost}});
        match proxies
            .patch(&name, &PatchParams::default(), &Patch::Merge(patch))
            .await
        {
            Ok(_) => log::info!(
                "ProxyPool {}: member {name} takes the template's cost",
                pool.key()
            ),
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Marks why a member goes, then deletes it (its finalizer drains it first).
async fn remove_member(
    proxies: &Api<Proxy>,
    name: &str,
    removal: Removal,
) -> Result<(), PoolError> {
    let mark = json!({"metadata": {"annotations": {REMOVAL_ANNOTATION: removal.as_str()}}});
    match proxies
        .patch(name, &PatchParams::default(), &Patch::Merge(mark))
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 404 => return Ok(()),
        Err(e) => return Err(e.into()),
    }
    match proxies.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// A deleted pool: deletes its members, and lets the pool go once none is left.
async fn delete_members(
    pool: &ProxyPool,
    owned: &[Proxy],
    pools: &Api<ProxyPool>,
    proxies: &Api<Proxy>,
    ctx: &PoolContext,
) -> Result<controller::Action, PoolError> {
    if !pool.finalizers().iter().any(|f| f == POOL_FINALIZER) {
        return Ok(controller::Action::await_change());
    }
    for member in owned
        .iter()
        .filter(|m| m.metadata.deletion_timestamp.is_none())
    {
        match proxies
            .delete(&member.name_any(), &DeleteParams::default())
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(e) => return Err(e.into()),
        }
    }
    if !owned.is_empty() {
        return Ok(controller::Action::requeue(ctx.intervals.busy));
    }
    let finalizers = pool
        .finalizers()
        .iter()
        .filter(|f| *f != POOL_FINALIZER)
        .cloned()
        .collect();
    patch_finalizers(pools, pool, finalizers).await?;
    ctx.metrics
        .forget(&pool.namespace().unwrap_or_default(), &pool.name_any());
    Ok(controller::Action::await_change())
}

/// Sets the finalizer list, guarded by resourceVersion so a concurrent edit is not overwritten.
async fn patch_finalizers(
    pools: &Api<ProxyPool>,
    pool: &ProxyPool,
    finalizers: Vec<String>,
) -> Result<(), PoolError> {
    let patch = json!({
        "metadata": {"finalizers": finalizers, "resourceVersion": pool.resource_version()}
    });
    pools
        .patch(
            &pool.name_any(),
            &PatchParams::default(),
            &Patch::Merge(patch),
        )
        .await?;
    Ok(())
}

async fn publish(
    ctx: &PoolContext,
    pool: &ProxyPool,
    type_: EventType,
    reason: &str,
    note: String,
) {
    let reference = pool.object_ref(&());
    let event = event(type_, reason, "Scale", note);
    if let Err(e) = ctx.recorder.publish(&event, &reference).await {
        log::warn!(
            "cannot publish event {reason} for ProxyPool {}: {e}",
            pool.key()
        );
    }
}

/// After a failed reconcile: log it and retry in a few seconds.
fn error_policy(
    pool: Arc<ProxyPool>,
    error: &PoolError,
    _: Arc<PoolContext>,
) -> controller::Action {
    log::warn!(
        "reconcile of ProxyPool {} failed; retrying: {error}",
        pool.key()
    );
    controller::Action::requeue(Duration::from_secs(2))
}

/// The pool a changed Proxy is a member of, by its pool label.
fn pool_of(proxy: &Proxy) -> Option<ObjectRef<ProxyPool>> {
    let pool = proxy.labels().get(POOL_LABEL)?.clone();
    Some(ObjectRef::new(&pool).within(&proxy.namespace()?))
}

/// Runs the pool controller once this process holds the leader Lease, until shutdown; losing
/// the Lease is an error that stops the process (as for the Proxy reconciler).
pub async fn run_while_leading(
    ctx: Arc<PoolContext>,
    feed: PoolFeed,
    members: broadcast::Receiver<Arc<Proxy>>,
    demanded: broadcast::Receiver<Arc<[String]>>,
    mut leader: watch::Receiver<bool>,
    shutdown: CancellationToken,
) -> Result<(), String> {
    let PoolFeed {
        store,
        mut triggers,
    } = feed;
    // Drained, not reconciled: the new leader reconciles the whole store.
    let drain = async {
        while triggers.recv().await.is_some() {}
        "the ProxyPool watch stopped feeding the pool controller".to_owned()
    };
    if !crate::leader::wait_to_lead(&mut leader, &shutdown, drain).await? {
        return Ok(());
    }
    let current = futures::stream::iter(store.state());
    let later = futures::stream::poll_fn(move |cx| triggers.poll_recv(cx));
    let work = run_controller(
        ctx,
        store,
        current.chain(later),
        futures::stream::select(member_changes(members), demand_notices(demanded)),
    );
    crate::leader::lead(&mut leader, &shutdown, "the pool controller", work).await
}

/// What `receiver` gets, skipping what it missed while behind: the periodic requeue catches
/// up on any pool a missed message was about.
fn received<T: Clone + Send + 'static>(
    receiver: broadcast::Receiver<T>,
) -> impl Stream<Item = T> + Send + 'static {
    futures::stream::unfold(receiver, |mut receiver| async move {
        loop {
            match receiver.recv().await {
                Ok(item) => return Some((item, receiver)),
                Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    })
}

/// The pools whose members changed.
fn member_changes(
    members: broadcast::Receiver<Arc<Proxy>>,
) -> impl Stream<Item = ObjectRef<ProxyPool>> + Send + 'static {
    received(members).filter_map(|proxy| std::future::ready(pool_of(&proxy)))
}

/// The pools this replica just recorded demand for.
fn demand_notices(
    demanded: broadcast::Receiver<Arc<[String]>>,
) -> impl Stream<Item = ObjectRef<ProxyPool>> + Send + 'static {
    received(demanded).flat_map(|keys| {
        futures::stream::iter(
            keys.iter()
                .filter_map(|key| {
                    let (namespace, name) = key.split_once('/')?;
                    Some(ObjectRef::new(name).within(namespace))
                })
                .collect::<Vec<_>>(),
        )
    })
}

async fn run_controller(
    ctx: Arc<PoolContext>,
    store: Store<ProxyPool>,
    pools: impl Stream<Item = Arc<ProxyPool>> + Send + 'static,
    members: impl Stream<Item = ObjectRef<ProxyPool>> + Send + 'static,
) {
    Controller::for_shared_stream(pools, store)
        .reconcile_on(members)
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            match result {
                Ok((pool, _)) => log::debug!("reconciled ProxyPool {pool}"),
                Err(e) => log::debug!("pool reconcile error: {e}"),
            }
        })
        .await;
}
