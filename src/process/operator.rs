//! `proxy-operator run`: the operator against a Kubernetes cluster. One Proxy watch
//! (`proxy_watch`) feeds both the reconciler and the same inventory standalone mode feeds from
//! a file; health transitions feed the reconciler (the only status writer); orphan GC runs
//! only while this process holds the leader Lease.

use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Secret;
use kube::runtime::events::Recorder;
use kube::runtime::reflector::Store;
use kube::{Api, Client};
use tokio::sync::{broadcast, mpsc, watch};

use crate::api::status::KubeEvents;

use super::{Core, Exit, Pushed, StartError, Supervisor, load_tokens, start_core};
use crate::cli::{GatewayArgs, RunArgs};
use crate::controllers::gc::{self, GcConfig};
use crate::controllers::pool::{self, PoolContext, PoolIntervals, PoolMetrics};
use crate::controllers::proxy::metrics::RemediationGauge;
use crate::controllers::proxy::{self as reconciler, Context, ReconcilerMetrics};
use crate::credentials;
use crate::inventory::Inventory;
use crate::leader::{self, LeaderConfig};
use crate::provider::ProvidersConfig;
use crate::provider::config::EgressConfig;
use crate::provider::registry::{Constructors, build_providers};
use crate::provider::squid_conf::{PortRange, SquidEgress};
use crate::proxy_watch::{self, WatchMetrics};
use crate::resources::proxy::Proxy;
use crate::serving::pools;

/// Runs operator mode until a signal or a task failure.
pub async fn run(args: RunArgs) -> Result<Exit, StartError> {
    let tokens = load_tokens(&args.common)?;
    let providers_config = load_config(&args)?;
    let client = Client::try_default().await.map_err(|e| {
        StartError(format!(
            "cannot build a Kubernetes client (in-cluster config or kubeconfig): {e}"
        ))
    })?;
    let supervisor = start(args, providers_config, client, tokens).await?;
    supervisor.run().await
}

/// Runs operator mode against `client` until `stop` completes or a task fails (the in-process
/// entry point tests drive with a mock API server).
pub async fn run_with_client(
    args: RunArgs,
    client: Client,
    stop: impl std::future::Future<Output = ()>,
) -> Result<Exit, StartError> {
    let tokens = load_tokens(&args.common)?;
    let providers_config = load_config(&args)?;
    let supervisor = start(args, providers_config, client, tokens).await?;
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

/// What the generated squids may reach: what the gateway's flags open (at the gateway and in
/// the squids alike) and what the providers config's `egress:` block opens for the squids.
fn squid_egress(gateway: &GatewayArgs, config: &EgressConfig) -> Result<SquidEgress, StartError> {
    let ports = gateway
        .gateway_allowed_ports
        .iter()
        .map(|port| PortRange::single(*port))
        .collect::<Result<_, _>>()
        .map_err(|e| StartError(format!("--gateway-allowed-ports: {e}")))?;
    let flags = SquidEgress {
        destinations: gateway.gateway_allowed_destinations.0.clone(),
        ports,
    };
    Ok(flags.union(&SquidEgress {
        destinations: config.allowed_destinations.clone(),
        ports: config.allowed_ports.clone(),
    }))
}

fn gc_config(args: &RunArgs) -> GcConfig {
    GcConfig {
        interval: args.gc_interval,
        min_age: args.gc_min_age,
        namespace: args.watch_namespace.clone(),
        allow_namespaced: args.gc_allow_namespaced,
    }
}

/// What the pool tasks take from the rest of operator mode.
struct PoolParts {
    recorder: Recorder,
    fleet: Store<Proxy>,
    members: broadcast::Receiver<Arc<Proxy>>,
    leader: watch::Receiver<bool>,
}

/// Starts the ProxyPool watch (every replica: the API and the gateway hold requests for waking
/// pools) and the pool controller (on the Lease holder).
fn start_pools(
    supervisor: &mut Supervisor,
    client: &Client,
    args: &RunArgs,
    core: &Core,
    parts: PoolParts,
) -> Result<(), StartError> {
    let (pool_watch, pool_feed) = pools::watch::shared_store();
    supervisor.spawn(
        "pool watch",
        pools::watch::run(
            pool_watch,
            pools::watch::raw_watch(client.clone(), args.watch_namespace.as_deref()),
            core.fleet.pools.clone(),
            supervisor.shutdown_token(),
        ),
    );
    let ctx = Arc::new(PoolContext {
        client: client.clone(),
        ledger: core.fleet.ledger.clone(),
        recorder: parts.recorder,
        fleet: parts.fleet,
        budget: args.reconciler_config().replacement_budget,
        metrics: PoolMetrics::register(&core.registry)
            .map_err(|e| StartError::from_display("metrics", e))?,
        intervals: PoolIntervals::default(),
        clock: jiff::Timestamp::now,
        expected: Default::default(),
    });
    supervisor.spawn(
        "pool controller",
        pool::controller::run_while_leading(
            ctx,
            pool_feed,
            parts.members,
            core.fleet.pools.demanded(),
            parts.leader,
            supervisor.shutdown_token(),
        ),
    );
    Ok(())
}

/// Opens the shared parts and starts every task of operator mode.
async fn start(
    args: RunArgs,
    providers_config: ProvidersConfig,
    client: Client,
    tokens: super::LoadedAccess,
) -> Result<Supervisor, StartError> {
    let gc_config = gc_config(&args);
    let inventory = Inventory::new();
    let core = Core::open(&args.common, inventory.clone()).await?;
    let egress = squid_egress(&args.common.gateway, &providers_config.egress)?;
    let providers = build_providers(
        &providers_config,
        &Constructors::standard(client.clone(), egress),
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
    let secrets: Api<Secret> = match &args.watch_namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let credentials = core.fleet.credentials.clone();
    let shutdown = supervisor.shutdown_token();
    supervisor.spawn("proxy credentials watch", async move {
        tokio::select! {
            () = credentials::watch(secrets, credentials) => Ok(()),
            () = shutdown.cancelled() => Ok(()),
        }
    });
    let (transitions_tx, transitions_rx) = mpsc::channel(1024);
    let (exits_tx, exits_rx) = mpsc::channel(1024);
    start_core(
        &mut supervisor,
        &core,
        &args.common,
        Pushed {
            transitions: transitions_tx,
            exits: exits_tx,
        },
        tokens,
        KubeEvents::new(client.clone()),
    )?;

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
    }
    .lasting(args.leader_lease_duration);
    let leader = leader::watch_leadership(client.clone(), &leader_config)
        .await
        .map_err(|e| StartError(format!("leader election: {e}")))?;
    let leader_gauge = leader::register_leader_gauge(&core.registry)
        .map_err(|e| StartError::from_display("metrics", e))?;
    supervisor.spawn(
        "leader gauge",
        leader::publish_leadership(leader.clone(), leader_gauge, supervisor.shutdown_token()),
    );
    let ctx = Arc::new(Context::new(
        client.clone(),
        providers
            .iter()
            .map(|(name, p)| (name.clone(), p.clone()))
            .collect::<HashMap<_, _>>(),
        args.install_id.clone(),
        args.reconciler_config(),
        core.fleet.ledger.clone(),
        ReconcilerMetrics::register(&core.registry)
            .map_err(|e| StartError::from_display("metrics", e))?,
    ));

    // One watch of raw Proxies, decoded one by one (an undecodable one is skipped and
    // reported), feeding the inventory and the reconciler from one store.
    let watch_metrics = WatchMetrics::register(&core.registry)
        .map_err(|e| StartError::from_display("metrics", e))?;
    let (watch, reconciler_feed) = proxy_watch::shared_store();
    let member_changes = watch.subscribe();
    let (reports_tx, reports_rx) = mpsc::channel(proxy_watch::REPORT_BUFFER);
    supervisor.spawn(
        "proxy watch",
        proxy_watch::run(
            watch,
            proxy_watch::raw_watch(client.clone(), args.watch_namespace.as_deref()),
            inventory,
            watch_metrics,
            reports_tx,
            supervisor.shutdown_token(),
        ),
    );
    supervisor.spawn(
        "undecodable Proxy events",
        proxy_watch::publish_reports(
            ctx.recorder.clone(),
            reports_rx,
            leader.clone(),
            supervisor.shutdown_token(),
        ),
    );

    start_pools(
        &mut supervisor,
        &client,
        &args,
        &core,
        PoolParts {
            recorder: ctx.recorder.clone(),
            fleet: reconciler_feed.store.clone(),
            members: member_changes,
            leader: leader.clone(),
        },
    )?;

    let triggers = futures::stream::select(
        reconciler::health_triggers(transitions_rx, ctx.health.clone()),
        reconciler::health_triggers(exits_rx, ctx.exits.clone()),
    );
    let namespace = args.watch_namespace.clone();
    let shutdown = supervisor.shutdown_token();
    RemediationGauge::register(
        &core.registry,
        reconciler_feed.store.clone(),
        providers.keys().cloned().collect(),
        args.max_unhealthy,
    )
    .map_err(|e| StartError::from_display("metrics", e))?;
    supervisor.spawn(
        "reconciler",
        reconciler::run_while_leading(
            ctx,
            reconciler_feed,
            namespace,
            triggers,
            leader.clone(),
            shutdown,
        ),
    );

    // GC lists Proxy metadata only, so an undecodable Proxy still counts as live: its machine
    // is kept.
    let proxies: Api<Proxy> = match &args.watch_namespace {
        Some(ns) => Api::namespaced(client, ns),
        None => Api::all(client),
    };
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

#[cfg(test)]
mod tests {
    use std::path::Path;

    use clap::Parser;

    use super::*;
    use crate::cli::{Cli, Command};

    fn gateway(flags: &[&str]) -> GatewayArgs {
        let argv = ["proxy-operator", "run", "--providers-config", "/dev/null"];
        let cli = Cli::try_parse_from(argv.iter().chain(flags)).unwrap();
        let Command::Run(args) = cli.command else {
            panic!("not run")
        };
        args.common.gateway
    }

    fn egress(text: &str) -> EgressConfig {
        ProvidersConfig::parse(text, Path::new("providers.yaml"))
            .unwrap()
            .egress
    }

    fn ports(list: &[&str]) -> Vec<PortRange> {
        list.iter().map(|p| PortRange::parse(p).unwrap()).collect()
    }

    #[test]
    fn the_squids_reach_what_the_flags_and_the_providers_config_open() {
        // Nothing opened anywhere: the default, no range, HTTP and HTTPS.
        let none = squid_egress(&gateway(&[]), &egress("providers: []\n")).unwrap();
        assert_eq!(none, SquidEgress::default());

        let flags = gateway(&[
            "--gateway-allowed-destinations",
            "127.0.0.1,10.20.0.0/16",
            "--gateway-allowed-ports",
            "80,8080",
        ]);
        let config = egress(
            "egress:\n  allowedDestinations: [192.168.1.0/24]\n  allowedPorts: [\"8000-8100\"]\n\
             providers: []\n",
        );
        let both = squid_egress(&flags, &config).unwrap();
        let ranges: Vec<String> = both.destinations.iter().map(ToString::to_string).collect();
        assert_eq!(ranges, ["127.0.0.1/32", "10.20.0.0/16", "192.168.1.0/24"]);
        // The flag's ports replace the default 80,443; the config's come on top.
        assert_eq!(both.ports, ports(&["80", "8080", "8000-8100"]));
    }
}
