//! `proxy-operator standalone`: External proxies from an inventory file, no Kubernetes.

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;

use crate::api::status::KubeEvents;

use super::{
    Core, Exit, Pushed, StartError, Supervisor, drop_exit_reports, load_tokens, log_transitions,
    start_core,
};
use crate::cli::StandaloneArgs;
use crate::inventory::Inventory;
use crate::inventory::file::{self, InventoryFile};

/// Runs standalone mode until a signal or a task failure. Start-up errors (a broken inventory
/// file, no usable API token, an unusable ledger, a busy port) are returned before anything is served.
pub async fn run(args: StandaloneArgs) -> Result<Exit, StartError> {
    let tokens = load_tokens(&args.common)?;
    let inventory_file = InventoryFile::new(&args.inventory)
        .map_err(|e| StartError::from_display("inventory schema", e))?;
    let loaded = inventory_file
        .load()
        .map_err(|e| StartError(e.to_string()))?;
    log::info!(
        "inventory {}: {} proxies, {} credentials Secrets",
        args.inventory.display(),
        loaded.proxies.len(),
        loaded.credentials.len()
    );
    let inventory = Inventory::new();
    inventory.replace(loaded.proxies);
    let core = Core::open(&args.common, inventory.clone()).await?;
    core.fleet.credentials.replace(loaded.credentials);

    let mut supervisor = Supervisor::new();
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
        KubeEvents::default(),
    )?;
    supervisor.spawn("health transition log", log_transitions(transitions_rx));
    supervisor.spawn("exit reports", drop_exit_reports(exits_rx));

    let (reload_tx, reload_rx) = mpsc::channel(1);
    let mut hangup = signal(SignalKind::hangup())
        .map_err(|e| StartError::from_display("installing the SIGHUP handler", e))?;
    let shutdown = supervisor.shutdown_token();
    supervisor.spawn("SIGHUP handler", async move {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                Some(()) = hangup.recv() => {
                    log::info!("SIGHUP: reloading the inventory");
                    // A reload already queued covers this one too.
                    let _ = reload_tx.try_send(());
                }
            }
        }
    });
    let shutdown = supervisor.shutdown_token();
    let poll = args.inventory_poll;
    let credentials = core.fleet.credentials.clone();
    supervisor.spawn("inventory file watcher", async move {
        file::watch(
            inventory_file,
            inventory,
            credentials,
            poll,
            reload_rx,
            shutdown,
        )
        .await;
        Ok(())
    });
    supervisor.run().await
}
