//! A file the process re-reads while it runs (the token file, the tenants file: mounted
//! Secrets). A change is noticed by content, not modification time, since a Kubernetes Secret
//! volume swaps a symlink; a change that cannot be read or is refused keeps what is in force
//! and is logged once per distinct failure, so a broken edit never opens the API.

use std::path::PathBuf;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Re-reads `path` every `poll` until `shutdown`. When its content differs from the last
/// content applied (first `content`), hands the new content to `apply`, which either puts it
/// in force and says what it made of it (logged at info), or refuses it and says why (logged
/// at error, with `keeping`, and the content is tried again at the next change). `flag` names
/// the file in messages (`--tenants-file`).
pub async fn watch(
    flag: &'static str,
    path: PathBuf,
    mut content: Vec<u8>,
    mut apply: impl FnMut(&[u8]) -> Result<String, String> + Send,
    keeping: &'static str,
    poll: Duration,
    shutdown: CancellationToken,
) {
    let mut ticker = tokio::time::interval(poll);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    let mut last_error: Option<String> = None;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let read = {
            let path = path.clone();
            tokio::task::spawn_blocking(move || std::fs::read(path)).await
        };
        let outcome = match read {
            Ok(Ok(new)) if new == content => continue,
            Ok(Ok(new)) => apply(&new).map(|applied| {
                content = new;
                log::info!("{flag} {} changed: {applied}", path.display());
            }),
            Ok(Err(e)) => Err(format!("{flag} {}: cannot read: {e}", path.display())),
            Err(e) => Err(format!("reading {flag}: {e}")),
        };
        match outcome {
            Ok(()) => last_error = None,
            Err(e) => {
                if last_error.as_deref() != Some(e.as_str()) {
                    log::error!("{e}; {keeping}");
                }
                last_error = Some(e);
            }
        }
    }
}
