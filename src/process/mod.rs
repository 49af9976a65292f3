//! The long-running process: the parts both modes share (ledger, health engine, API and
//! metrics servers, ledger sweep) and the supervisor that runs them as tasks, stops them all
//! on SIGTERM/SIGINT, and takes the process down when any of them dies.

mod gateway_start;
pub mod operator;
pub mod standalone;

use std::future::Future;
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;

use actix_web::dev::{Server, ServerHandle};
use prometheus::Registry;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::api::status::KubeEvents;
use crate::api::{self, ApiState, LeaseMetrics};
use crate::cli::CommonArgs;
use crate::gateway::GatewayMetrics;
use crate::geoip::GeoIp;
use crate::health::engine::DEFAULT_TICK;
use crate::health::exits::{ExitChecker, ExitCheckerConfig, ExitMetrics, ExitReport, ExitTable};
use crate::health::{EngineConfig, HealthEngine, HealthSnapshot, HealthTransition, ProbeMetrics};
use crate::inventory::Inventory;
use crate::ledger::{
    Clock, Durability, Ledger, LedgerConfig, LedgerError, LedgerLocation, PostgresLedger,
    PostgresLedgerCollector, PostgresOptions, SqliteLedger, SqliteLedgerCollector, SqliteOptions,
    SystemClock,
};
use crate::metrics::{self, FleetCollector};
use crate::serving::Fleet;
use crate::serving::sessions::Sessions;
use crate::serving::tenants::{self, BudgetCollector, LoadedTenants, TenantsFile};
use crate::serving::tokens::{self, ApiToken, LoadedTokens, TokenSources};
use crate::serving::traffic::Traffic;

/// How often expired leases are marked and old rows pruned.
pub const LEDGER_SWEEP_INTERVAL: Duration = Duration::from_secs(10);
/// How long stopping tasks get after the API has drained.
const STOP_GRACE: Duration = Duration::from_secs(15);

/// A start-up failure; the message names the file, flag or address at fault.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct StartError(pub String);

impl StartError {
    fn from_display(context: &str, error: impl std::fmt::Display) -> Self {
        StartError(format!("{context}: {error}"))
    }
}

/// How a started process ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Exit {
    /// Stopped by a signal, every task ended cleanly.
    Clean,
    /// A task died (already logged).
    TaskFailed,
}

/// The parts every mode shares, opened and ready to start.
pub struct Core {
    /// What the servers read and write of the fleet (the health engine and the reconciler
    /// feed it): the inventory, health, the ledger, credentials, sessions, outcomes, pools.
    pub fleet: Fleet,
    /// The metrics registry.
    pub registry: Registry,
    /// Probe metrics for the health engine.
    pub probe_metrics: ProbeMetrics,
    /// Lease counters for the API.
    pub lease_metrics: LeaseMetrics,
    /// The gateway's counters.
    pub gateway_metrics: GatewayMetrics,
    /// Exit-check counters (the per-proxy series read `fleet.exits`).
    pub exit_metrics: ExitMetrics,
    /// The `--geoip-database` files, opened.
    pub geoip: Arc<GeoIp>,
}

impl Core {
    /// Opens (and migrates) the ledger and registers the metrics.
    pub async fn open(common: &CommonArgs, inventory: Inventory) -> Result<Core, StartError> {
        let geoip = GeoIp::open(&common.geoip_database).map_err(|e| StartError(e.to_string()))?;
        if !geoip.is_empty() {
            log::info!("exit countries and networks from {geoip:?}");
        }
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let config = LedgerConfig {
            max_ttl: common.max_lease_ttl,
            cooldown: common.lease_cooldown,
            max_cooldown: common.max_lease_cooldown,
            max_leases_per_target: common.max_leases_per_target,
            max_leases_per_proxy_target: common.max_leases_per_proxy_target,
            history_retention: common.history_retention,
            queue_capacity: usize::try_from(common.ledger_queue_capacity).unwrap_or(usize::MAX),
            queue_deadline: common.ledger_queue_deadline,
            ..LedgerConfig::default()
        };
        let health = HealthSnapshot::new();
        let registry = Registry::new();
        let metric_error = |e: prometheus::Error| StartError::from_display("metrics", e);
        let probe_metrics = ProbeMetrics::register(&registry).map_err(metric_error)?;
        let lease_metrics = LeaseMetrics::register(&registry).map_err(metric_error)?;
        let exits = ExitTable::new();
        let exit_metrics = ExitMetrics::register(&registry, exits.clone()).map_err(metric_error)?;
        let sessions = Sessions::default();
        let traffic = Traffic::default();
        let gateway_metrics = GatewayMetrics::register(
            &registry,
            sessions.clone(),
            lease_metrics.tenants.clone(),
            traffic.clone(),
        )
        .map_err(metric_error)?;
        let ledger_error = |e: LedgerError| StartError::from_display("--ledger", e);
        let ledger: Arc<dyn Ledger> = match &common.ledger {
            LedgerLocation::Sqlite(path) => {
                let options = SqliteOptions {
                    max_size: common.ledger_max_size,
                    durability: common.ledger_durability.into(),
                };
                let sqlite = SqliteLedger::open(path, options, config, clock.clone())
                    .map_err(ledger_error)?;
                let file = SqliteLedgerCollector::new(sqlite.clone()).map_err(metric_error)?;
                registry.register(Box::new(file)).map_err(metric_error)?;
                Arc::new(sqlite)
            }
            LedgerLocation::Postgres(url) => {
                log_sqlite_only_flags(common);
                let options = PostgresOptions {
                    password: read_password(common.ledger_password_file.as_deref())?,
                    pool_size: usize::from(common.ledger_pool_size),
                };
                let postgres = PostgresLedger::open(url, options, config, clock.clone())
                    .await
                    .map_err(ledger_error)?;
                let database =
                    PostgresLedgerCollector::new(postgres.clone()).map_err(metric_error)?;
                registry
                    .register(Box::new(database))
                    .map_err(metric_error)?;
                Arc::new(postgres)
            }
        };
        let fleet = FleetCollector::new(
            inventory.clone(),
            health.clone(),
            ledger.clone(),
            traffic.clone(),
            &common.cost_currency,
            clock.clone(),
        )
        .map_err(metric_error)?;
        registry.register(Box::new(fleet)).map_err(metric_error)?;
        registry
            .register(Box::new(
                prometheus::process_collector::ProcessCollector::for_self(),
            ))
            .map_err(metric_error)?;
        Ok(Core {
            fleet: Fleet {
                sessions,
                traffic,
                exits,
                currency: common.cost_currency.as_str().into(),
                ..Fleet::new(inventory, health, ledger, clock)
            },
            registry,
            probe_metrics,
            lease_metrics,
            gateway_metrics,
            exit_metrics,
            geoip: Arc::new(geoip),
        })
    }
}

/// The PostgreSQL ledger's password from `--ledger-password-file`, without the trailing
/// newline an editor or `kubectl create secret --from-file` leaves.
fn read_password(path: Option<&std::path::Path>) -> Result<Option<String>, StartError> {
    let Some(path) = path else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| StartError(format!("--ledger-password-file {}: {e}", path.display())))?;
    Ok(Some(text.trim_end_matches(['\n', '\r']).to_owned()))
}

/// Says which SQLite-only settings a PostgreSQL ledger leaves aside, when they were changed.
fn log_sqlite_only_flags(common: &CommonArgs) {
    let defaults = SqliteOptions::default();
    if common.ledger_max_size != defaults.max_size {
        log::info!(
            "--ledger-max-size applies to an SQLite ledger only; PostgreSQL's room is its own \
             (a full disk answers 503 ledger_full)"
        );
    }
    if Durability::from(common.ledger_durability) != defaults.durability {
        log::info!(
            "--ledger-durability applies to an SQLite ledger only; PostgreSQL commits as its \
             synchronous_commit says"
        );
    }
}

fn bind(addr: SocketAddr, flag: &str) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr).map_err(|e| StartError(format!("{flag} {addr}: cannot listen: {e}")))
}

/// Tasks of a running process, each named for the log line that reports its death.
pub struct Supervisor {
    tasks: JoinSet<(&'static str, Result<(), String>)>,
    servers: Vec<ServerHandle>,
    shutdown: CancellationToken,
}

impl Default for Supervisor {
    fn default() -> Self {
        Self::new()
    }
}

impl Supervisor {
    /// No tasks yet.
    pub fn new() -> Self {
        Supervisor {
            tasks: JoinSet::new(),
            servers: Vec::new(),
            shutdown: CancellationToken::new(),
        }
    }

    /// Cancelled when the process stops; long-running tasks return when it fires.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Runs `task` until it returns; returning before shutdown stops the process.
    pub fn spawn(
        &mut self,
        name: &'static str,
        task: impl Future<Output = Result<(), String>> + Send + 'static,
    ) {
        self.tasks.spawn(async move { (name, task.await) });
    }

    /// Runs an HTTP server; it is stopped gracefully (draining requests) at shutdown.
    pub fn spawn_server(&mut self, name: &'static str, server: Server) {
        self.servers.push(server.handle());
        self.spawn(name, async move { server.await.map_err(|e| e.to_string()) });
    }

    /// Waits for SIGTERM/SIGINT or the first task to end, then stops everything.
    pub async fn run(self) -> Result<Exit, StartError> {
        let mut terminate = signal(SignalKind::terminate())
            .map_err(|e| StartError::from_display("installing the SIGTERM handler", e))?;
        let mut interrupt = signal(SignalKind::interrupt())
            .map_err(|e| StartError::from_display("installing the SIGINT handler", e))?;
        self.run_until(async move {
            tokio::select! {
                _ = terminate.recv() => log::info!("SIGTERM: stopping"),
                _ = interrupt.recv() => log::info!("SIGINT: stopping"),
            }
        })
        .await
    }

    /// Waits for `stop` or the first task to end, then stops everything.
    pub async fn run_until(mut self, stop: impl Future<Output = ()>) -> Result<Exit, StartError> {
        let exit = tokio::select! {
            () = stop => Exit::Clean,
            Some(joined) = self.tasks.join_next() => {
                match joined {
                    Ok((name, Ok(()))) => log::error!("{name} stopped unexpectedly; stopping the process"),
                    Ok((name, Err(e))) => log::error!("{name} failed: {e}; stopping the process"),
                    Err(e) => log::error!("a task panicked: {e}; stopping the process"),
                }
                Exit::TaskFailed
            }
        };
        self.shutdown.cancel();
        for server in &self.servers {
            server.stop(true).await;
        }
        let drained = tokio::time::timeout(STOP_GRACE, async {
            let mut clean = true;
            while let Some(joined) = self.tasks.join_next().await {
                match joined {
                    Ok((_, Ok(()))) => {}
                    Ok((name, Err(e))) => {
                        log::error!("{name} failed while stopping: {e}");
                        clean = false;
                    }
                    Err(e) => {
                        log::error!("a task panicked while stopping: {e}");
                        clean = false;
                    }
                }
            }
            clean
        })
        .await;
        match (exit, drained) {
            (Exit::Clean, Ok(true)) => {
                log::info!("stopped cleanly");
                Ok(Exit::Clean)
            }
            (Exit::Clean, Ok(false)) => Ok(Exit::TaskFailed),
            (_, Err(_)) => {
                log::error!("tasks did not stop within {STOP_GRACE:?}");
                Ok(Exit::TaskFailed)
            }
            (exit, Ok(_)) => Ok(exit),
        }
    }
}

/// Where the health engine and the exit checker push what status should show.
pub struct Pushed {
    /// Health transitions.
    pub transitions: mpsc::Sender<HealthTransition>,
    /// Exit reports.
    pub exits: mpsc::Sender<ExitReport>,
}

/// Starts the parts both modes share: the health engine, the exit checker, the ledger sweep,
/// the API, the gateway and the metrics server (with `tokens`, from [`load_tokens`]). Health
/// transitions and exit reports go to `pushed`; the status page reads Proxies' Kubernetes
/// Events from `kube_events`.
pub fn start_core(
    supervisor: &mut Supervisor,
    core: &Core,
    common: &CommonArgs,
    pushed: Pushed,
    tokens: LoadedAccess,
    kube_events: KubeEvents,
) -> Result<(), StartError> {
    let api_listener = bind(common.discovery_addr, "--discovery-addr")?;
    let metrics_listener = bind(common.metrics_addr, "--metrics-addr")?;
    let gateway_listener = match common.gateway_config() {
        Some((addr, config)) => Some((bind(addr, "--gateway-addr")?, config)),
        None => None,
    };
    let roots = probe_roots(common)?;
    let engine = HealthEngine::new(
        EngineConfig {
            workers: usize::from(common.health_workers),
            extra_root_certs: roots.clone(),
            credentials: core.fleet.credentials.clone(),
            ..EngineConfig::default()
        },
        core.fleet.inventory.clone(),
        core.fleet.health.clone(),
        core.probe_metrics.clone(),
        pushed.transitions,
    );
    let shutdown = supervisor.shutdown_token();
    supervisor.spawn("health engine", async move {
        engine.run(shutdown).await;
        Ok(())
    });
    let exit_checker = ExitChecker::new(
        ExitCheckerConfig {
            workers: usize::from(common.health_workers),
            tick: DEFAULT_TICK,
            extra_root_certs: roots,
            credentials: core.fleet.credentials.clone(),
        },
        core.fleet.inventory.clone(),
        core.fleet.health.clone(),
        core.fleet.ledger.clone(),
        core.geoip.clone(),
        core.fleet.exits.clone(),
        core.exit_metrics.clone(),
        pushed.exits,
    );
    let shutdown = supervisor.shutdown_token();
    supervisor.spawn("exit checker", async move {
        exit_checker.run(shutdown).await;
        Ok(())
    });
    supervisor.spawn(
        "ledger sweep",
        sweep_ledger(core.fleet.ledger.clone(), supervisor.shutdown_token()),
    );
    let LoadedAccess {
        tokens,
        tenants,
        gateway: gateway_files,
    } = tokens;
    let token = watch_tokens(supervisor, tokens, tenants, common);
    let metric_error = |e: prometheus::Error| StartError::from_display("metrics", e);
    let budgets =
        BudgetCollector::new(token.clone(), core.fleet.clock.clone()).map_err(metric_error)?;
    let refresher = budgets.handle();
    core.registry
        .register(Box::new(budgets))
        .map_err(metric_error)?;
    let (ledger, shutdown) = (core.fleet.ledger.clone(), supervisor.shutdown_token());
    supervisor.spawn("tenants' bytes today", async move {
        refresher.refresh_every(ledger, shutdown).await;
        Ok(())
    });
    let state = ApiState {
        lease_credentials: common.lease_credentials,
        kube_events,
        ..ApiState::new(
            core.fleet.clone(),
            core.lease_metrics.clone(),
            common.default_lease_ttl,
        )
    };
    if let Some((listener, config)) = gateway_listener {
        gateway_start::start(
            supervisor,
            core,
            common,
            listener,
            config,
            token.clone(),
            gateway_files,
        )?;
    }
    let api = api::serve(api_listener, state, token)
        .map_err(|e| StartError::from_display("--discovery-addr", e))?;
    supervisor.spawn_server("lease API server", api);
    let metrics = metrics::serve(metrics_listener, core.registry.clone())
        .map_err(|e| StartError::from_display("--metrics-addr", e))?;
    supervisor.spawn_server("metrics server", metrics);
    let gateway_addr = match common.gateway_config() {
        Some((addr, _)) => addr.to_string(),
        None => "off".to_owned(),
    };
    log::info!(
        "lease API on {}, gateway on {gateway_addr}, metrics on {}, ledger {}",
        common.discovery_addr,
        common.metrics_addr,
        common.ledger
    );
    Ok(())
}

/// What start-up loaded from files before anything is opened or bound: who may call (the
/// tokens, the tenants file's tenants), and what the gateway reads (its rules, its CA).
pub struct LoadedAccess {
    tokens: LoadedTokens,
    tenants: Option<(TenantsFile, LoadedTenants)>,
    gateway: gateway_start::GatewayFiles,
}

/// The API's tokens from `DISCOVERY_TOKEN`, `--discovery-token-file` and `--tenants-file`,
/// failing closed (open only with `--insecure-no-auth`), and the gateway's files. Called
/// first, before anything is opened or bound, so a bad file stops the process naming its
/// flag.
pub fn load_tokens(common: &CommonArgs) -> Result<LoadedAccess, StartError> {
    let tenants = common
        .tenants_file
        .as_ref()
        .map(|path| {
            let file = TenantsFile::new(path);
            let loaded = file.load().map_err(|e| StartError(e.0))?;
            Ok::<_, StartError>((file, loaded))
        })
        .transpose()?;
    let env = std::env::var_os(tokens::TOKEN_ENV);
    let tokens = tokens::load(&TokenSources {
        env: env.as_deref(),
        file: common.discovery_token_file.as_deref(),
        insecure_no_auth: common.insecure_no_auth,
        tenants_file: tenants.is_some(),
    })
    .map_err(|e| StartError(e.0))?;
    if let Some((file, loaded)) = &tenants {
        if common.gateway.gateway_no_traffic_ledger
            && let Some(budgeted) = loaded
                .tenants
                .iter()
                .find(|t| t.quotas.bytes_per_day.is_some())
        {
            return Err(StartError(format!(
                "--gateway-no-traffic-ledger: tenant {} of --tenants-file {} has a bytesPerDay \
                 quota, which counts the bytes the ledger would no longer get",
                budgeted.name,
                file.path().display()
            )));
        }
        tokens.token.replace_tenants(loaded.tokens.clone());
        log::info!(
            "--tenants-file {}: {} tenant(s)",
            file.path().display(),
            loaded.tenants.len()
        );
    }
    let gateway = gateway_start::load(common)?;
    Ok(LoadedAccess {
        tokens,
        tenants,
        gateway,
    })
}

/// The token the API checks; a token file and a tenants file are watched for changes by a
/// task each.
fn watch_tokens(
    supervisor: &mut Supervisor,
    tokens: LoadedTokens,
    tenants: Option<(TenantsFile, LoadedTenants)>,
    common: &CommonArgs,
) -> ApiToken {
    if let Some((file, loaded)) = tenants {
        let shutdown = supervisor.shutdown_token();
        let token = tokens.token.clone();
        let poll = common.discovery_token_poll;
        supervisor.spawn("tenants file watcher", async move {
            let replace = move |tenants| token.replace_tenants(tenants);
            tenants::watch_file(file, loaded.content, replace, poll, shutdown).await;
            Ok(())
        });
    }
    if let Some((path, content)) = tokens.file {
        let shutdown = supervisor.shutdown_token();
        let token = tokens.token.clone();
        let env_tokens = tokens.env_tokens;
        let poll = common.discovery_token_poll;
        supervisor.spawn("token file watcher", async move {
            tokens::watch_file(path, content, env_tokens, token, poll, shutdown).await;
            Ok(())
        });
    }
    tokens.token
}

/// The certificates of `--probe-ca-file`, as DER.
fn probe_roots(common: &CommonArgs) -> Result<Vec<Vec<u8>>, StartError> {
    let Some(path) = &common.probe_ca_file else {
        return Ok(Vec::new());
    };
    crate::tls::pem_certificates(path)
        .map_err(|e| StartError(format!("--probe-ca-file {}: {e}", path.display())))
}

/// Marks expired leases and prunes old rows every [`LEDGER_SWEEP_INTERVAL`]. A failed sweep
/// is logged and retried; it never stops the process.
async fn sweep_ledger(ledger: Arc<dyn Ledger>, shutdown: CancellationToken) -> Result<(), String> {
    let mut ticker = tokio::time::interval(LEDGER_SWEEP_INTERVAL);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            _ = ticker.tick() => {}
        }
        match ledger.sweep().await {
            Ok(stats) => log::debug!("ledger sweep: {stats:?}"),
            Err(e) => log::warn!("ledger sweep failed (will retry): {e}"),
        }
    }
}

/// Logs health transitions (the standalone mode has no reconciler to write them anywhere).
pub async fn log_transitions(
    mut transitions: mpsc::Receiver<HealthTransition>,
) -> Result<(), String> {
    while let Some(t) = transitions.recv().await {
        let state = if t.healthy { "healthy" } else { "unhealthy" };
        log::info!("proxy {} is {state}: {}", t.id, t.message);
    }
    Ok(())
}

/// Drops exit reports (the standalone mode has no status to write them to: the API and the
/// status page read the exit table, and the checker logs changes).
pub async fn drop_exit_reports(mut reports: mpsc::Receiver<ExitReport>) -> Result<(), String> {
    while reports.recv().await.is_some() {}
    Ok(())
}
