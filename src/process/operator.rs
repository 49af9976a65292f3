//! `proxy-operator run`: the operator against a Kubernetes cluster. The Proxy watch feeds the
//! same inventory standalone mode feeds from a file; health transitions feed the reconciler
//! (the only status writer); orphan GC runs only while this process holds the leader Lease.

use std::collections::HashMap;
use std::sync::Arc;

use futures::StreamExt;
use kube::runtime::events::Recorder;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Api, Client};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{Core, Exit, StartError, Supervisor, start_core};
use crate::cli::RunArgs;
use crate::gc::{self, GcConfig};
use crate::health::HealthTransition;
use crate::inventory::Inventory;
use crate::leader::{self, LeaderConfig};
use crate::provider::ProvidersConfig;
use crate::provider::registry::{Constructors, build_providers};
use crate::proxy::{Proxy, ProxyId};
use crate::reconcile::{self, Context, HealthSignal, HealthStates};

/// Runs operator mode until a signal or a task failure.
pub async fn run(args: RunArgs) -> Result<Exit, StartError> {
    let providers_config = load_config(&args)?;
    let client = Client::try_default().await.map_err(|e| {
        StartError(format!(
            "cannot build a Kubernetes client (in-cluster config or kubeconfig): {e}"
        ))
    })?;
    let supervisor = start(args, providers_config, client).await?;
    supervisor.run().await
}

/// Runs operator mode against `client` until `stop` completes or a task fails (the in-process
/// entry point tests drive with a mock API server).
pub async fn run_with_client(
    args: RunArgs,
    client: Client,
    stop: impl std::future::Future<Output = ()>,
) -> Result<Exit, StartError> {
    let providers_config = load_config(&args)?;
    let supervisor = start(args, providers_config, client).await?;
    supervisor.run_until(stop).await
}

/// The providers config and the GC scope check: everything that can be refused before any
/// connection is made.
fn load_config(args: &RunArgs) -> Result<ProvidersConfig, StartError> {
    let config =
        ProvidersConfig::load(&args.providers_config).map_err(|e| StartError(e.to_string()))?;
    gc_config(args)
        .check_scope()
        .map_err(|e| StartError(format!("--watch-namespace: {e}")))?;
    Ok(config)
}

fn gc_config(args: &RunArgs) -> GcConfig {
    GcConfig {
        interval: args.gc_interval,
        min_age: args.gc_min_age,
        namespace: args.watch_namespace.clone(),
        allow_namespaced: args.gc_allow_namespaced,
    }
}

/// Opens the shared parts and starts every task of operator mode.
async fn start(
    args: RunArgs,
    providers_config: ProvidersConfig,
    client: Client,
) -> Result<Supervisor, StartError> {
    let gc_config = gc_config(&args);
    let inventory = Inventory::new();
    let core = Core::open(&args.common, inventory.clone())?;
    let providers = build_providers(
        &providers_config,
        &Constructors::standard(client.clone()),
        &args.install_id,
        &core.registry,
    )
    .await
    .map_err(|e| {
        StartError(format!(
            "providers config {}: {e}",
            args.providers_config.display()
        ))
    })?;

    let mut supervisor = Supervisor::new();
    let (transitions_tx, transitions_rx) = mpsc::channel(1024);
    start_core(&mut supervisor, &core, &args.common, transitions_tx)?;

    let proxies: Api<Proxy> = match &args.watch_namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    supervisor.spawn(
        "proxy watch",
        feed_inventory(proxies.clone(), inventory, supervisor.shutdown_token()),
    );

    let ctx = Arc::new(Context {
        recorder: Recorder::new(client.clone(), "proxy-operator".into()),
        client: client.clone(),
        providers: providers
            .iter()
            .map(|(name, p)| (name.clone(), p.clone()))
            .collect::<HashMap<_, _>>(),
        install: args.install_id.clone(),
        config: args.reconciler_config(),
        health: HealthStates::default(),
        clock: jiff::Timestamp::now,
    });
    let (signals_tx, signals_rx) = mpsc::channel(1024);
    supervisor.spawn(
        "health transition relay",
        relay_transitions(transitions_rx, signals_tx),
    );
    let triggers = reconcile::health_triggers(signals_rx, ctx.health.clone());
    let namespace = args.watch_namespace.clone();
    let shutdown = supervisor.shutdown_token();
    supervisor.spawn("reconciler", async move {
        tokio::select! {
            () = reconcile::run_controller(ctx, namespace.as_deref(), triggers) => Ok(()),
            () = shutdown.cancelled() => Ok(()),
        }
    });

    let identity = std::env::var("POD_NAME")
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| format!("proxy-operator-{}", std::process::id()));
    let lease_namespace = args
        .leader_namespace
        .clone()
        .unwrap_or_else(|| "default".to_owned());
    let leader_config = LeaderConfig {
        lease_name: args.leader_lease.clone(),
        ..LeaderConfig::new(lease_namespace, identity)
    };
    let leader = leader::watch_leadership(client, &leader_config)
        .await
        .map_err(|e| StartError(format!("leader election: {e}")))?;
    let gc_providers = providers.values().cloned().collect();
    let shutdown = supervisor.shutdown_token();
    supervisor.spawn("orphan GC", async move {
        tokio::select! {
            result = gc::run_gc(proxies, gc_providers, gc_config, leader) => result.map_err(|e| e.to_string()),
            () = shutdown.cancelled() => Ok(()),
        }
    });
    Ok(supervisor)
}

/// Mirrors the cluster's Proxies into the inventory; the inventory becomes synced (and
/// `/readyz` ready) once the first full list has arrived.
async fn feed_inventory(
    api: Api<Proxy>,
    inventory: Inventory,
    shutdown: CancellationToken,
) -> Result<(), String> {
    let (reader, writer) = reflector::store();
    let mut events = Box::pin(reflector(
        writer,
        watcher(api, watcher::Config::default()).default_backoff(),
    ));
    let mut listed = false;
    loop {
        let event = tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            event = events.next() => event,
        };
        match event {
            None => return Err("the Proxy watch ended".into()),
            Some(Err(e)) => log::warn!("Proxy watch: {e} (retrying)"),
            Some(Ok(watcher::Event::InitDone)) => {
                listed = true;
                inventory.replace(reader.state().iter().map(|p| Proxy::clone(p)));
            }
            Some(Ok(watcher::Event::Init | watcher::Event::InitApply(_))) => {}
            Some(Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_))) if listed => {
                inventory.replace(reader.state().iter().map(|p| Proxy::clone(p)));
            }
            Some(Ok(_)) => {}
        }
    }
}

/// Hands the health engine's transitions to the reconciler's trigger stream.
async fn relay_transitions(
    mut transitions: mpsc::Receiver<HealthTransition>,
    signals: mpsc::Sender<(ProxyId, HealthSignal)>,
) -> Result<(), String> {
    while let Some(t) = transitions.recv().await {
        let signal = HealthSignal {
            healthy: t.healthy,
            latency: t.latency,
            at: t.at,
            message: t.message,
        };
        signals
            .send((t.id, signal))
            .await
            .map_err(|_| "the reconciler stopped taking health transitions".to_owned())?;
    }
    Ok(())
}
