//! The gateway's start-up: what it needs from files (the per-target rules, the interception
//! CA and the targets' extra roots), loaded and checked before anything is bound, so a bad
//! file stops the process with a message naming its flag; then the gateway served.

use std::net::TcpListener;
use std::sync::Arc;

use super::{Core, StartError, Supervisor};
use crate::cli::CommonArgs;
use crate::gateway::intercept::{CaFiles, InterceptCa, Interception};
use crate::gateway::rules::{self, RuleSet, Rules, RulesFile};
use crate::gateway::{self, Gateway, GatewayConfig};
use crate::serving::tokens::ApiToken;

/// What the gateway reads from files.
pub struct GatewayFiles {
    rules: Rules,
    /// The rules file and the content in force, re-read while the process runs.
    watched: Option<(RulesFile, Vec<u8>)>,
    interception: Option<Arc<Interception>>,
}

/// Loads the rules file and the interception CA the flags name.
pub fn load(common: &CommonArgs) -> Result<GatewayFiles, StartError> {
    let flags = &common.gateway;
    let (rules, watched) = match &flags.gateway_rules_file {
        Some(path) => {
            let file = RulesFile::new(path);
            let (loaded, content) = file.load().map_err(|e| StartError(e.to_string()))?;
            let set = RuleSet::of_file(&flags.gateway_ban_statuses, loaded);
            (Rules::new(set), Some((file, content)))
        }
        None => (
            Rules::new(RuleSet::new(&flags.gateway_ban_statuses, Vec::new())),
            None,
        ),
    };
    let interception = match (&flags.gateway_ca_cert, &flags.gateway_ca_key) {
        (Some(cert), Some(key)) => {
            let ca = InterceptCa::load(&CaFiles {
                cert: cert.clone(),
                key: key.clone(),
            })
            .map_err(|e| StartError(e.to_string()))?;
            let roots = match &flags.gateway_target_ca_file {
                Some(path) => crate::tls::pem_certificates(path).map_err(|e| {
                    StartError(format!("--gateway-target-ca-file {}: {e}", path.display()))
                })?,
                None => Vec::new(),
            };
            let interception = Interception::new(ca, &roots)
                .map_err(|e| StartError::from_display("--gateway-target-ca-file", e))?;
            Some(Arc::new(interception))
        }
        _ => None,
    };
    Ok(GatewayFiles {
        rules,
        watched,
        interception,
    })
}

/// Serves the crawler gateway on `listener` until shutdown, re-reading its rules file.
pub fn start(
    supervisor: &mut Supervisor,
    core: &Core,
    common: &CommonArgs,
    listener: TcpListener,
    config: GatewayConfig,
    token: ApiToken,
    files: GatewayFiles,
) -> Result<(), StartError> {
    let threads = match common.gateway.gateway_threads {
        0 => std::thread::available_parallelism().map_or(1, usize::from),
        threads => usize::from(threads),
    };
    let workers = gateway::Workers::new(listener, threads)
        .map_err(|e| StartError::from_display("--gateway-threads", e))?;
    if !token.is_required() {
        log::warn!("--insecure-no-auth: the gateway relays for anyone who can reach it");
    }
    if let Some((file, content)) = files.watched {
        let (default, rules, poll) = (
            config.ban_rule.clone(),
            files.rules.clone(),
            common.discovery_token_poll,
        );
        let shutdown = supervisor.shutdown_token();
        supervisor.spawn("gateway rules", async move {
            rules::watch(file, content, default, rules, poll, shutdown).await;
            Ok(())
        });
    }
    let mut gateway = Gateway::new(
        core.fleet.clone(),
        token,
        core.gateway_metrics.clone(),
        config,
    )
    .with_rules(files.rules);
    if let Some(interception) = files.interception {
        log::info!("gateway: interception of HTTPS on request (tls=inspect) with the CA given");
        gateway = gateway.with_interception(interception);
    }
    let gateway = Arc::new(gateway);
    let shutdown = supervisor.shutdown_token();
    supervisor.spawn("gateway", async move {
        gateway::serve(workers, gateway, shutdown).await;
        Ok(())
    });
    Ok(())
}
