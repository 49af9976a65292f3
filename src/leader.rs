//! Leader election on a `coordination.k8s.io/v1` Lease, for the work that must have a single
//! writer across replicas (orphan GC). Built on kube-lease-manager, which renews the Lease in
//! the background and publishes "am I the leader" on a watch channel.

use kube::Client;
use kube_lease_manager::{LeaseCreateMode, LeaseManagerBuilder, LeaseManagerError};
use tokio::sync::watch;

/// Which Lease to hold and how.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaderConfig {
    /// Name of the Lease object.
    pub lease_name: String,
    /// Namespace of the Lease object (the operator's own).
    pub namespace: String,
    /// This process's identity in the Lease (the Pod name).
    pub identity: String,
    /// Seconds the Lease stays valid after the last renewal.
    pub duration_seconds: u64,
    /// Seconds before expiry at which the holder renews.
    pub grace_seconds: u64,
}

impl LeaderConfig {
    /// The defaults: Lease `proxy-operator-leader`, 30 s validity, renewed 5 s before expiry.
    pub fn new(namespace: impl Into<String>, identity: impl Into<String>) -> Self {
        LeaderConfig {
            lease_name: "proxy-operator-leader".to_owned(),
            namespace: namespace.into(),
            identity: identity.into(),
            duration_seconds: 30,
            grace_seconds: 5,
        }
    }
}

/// Starts contending for the Lease. The receiver reads `true` while this process holds it; the
/// Lease is released when every receiver is dropped.
pub async fn watch_leadership(
    client: Client,
    config: &LeaderConfig,
) -> Result<watch::Receiver<bool>, LeaseManagerError> {
    let manager = LeaseManagerBuilder::new(client, config.lease_name.clone())
        .with_namespace(config.namespace.clone())
        .with_identity(config.identity.clone())
        .with_duration(config.duration_seconds)
        .with_grace(config.grace_seconds)
        .with_create_mode(LeaseCreateMode::AutoCreate)
        .build()
        .await?;
    let (leader, task) = manager.watch().await;
    let lease = config.lease_name.clone();
    tokio::spawn(async move {
        match task.await {
            Ok(Ok(_)) => log::info!("stopped contending for Lease {lease}"),
            Ok(Err(e)) => log::error!("leader election on Lease {lease} failed: {e}"),
            Err(e) => log::error!("leader election task for Lease {lease} panicked: {e}"),
        }
    });
    Ok(leader)
}

/// Waits until `leader` reads `true`. Returns `false` if the election ended first.
pub async fn until_leader(leader: &mut watch::Receiver<bool>) -> bool {
    leader.wait_for(|is_leader| *is_leader).await.is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn until_leader_waits_for_true_and_reports_a_closed_election() {
        let (tx, mut rx) = watch::channel(false);
        let waiter = tokio::spawn(async move {
            let first = until_leader(&mut rx).await;
            (first, rx)
        });
        tx.send(true).unwrap();
        let (first, mut rx) = waiter.await.unwrap();
        assert!(first);
        tx.send(false).unwrap();
        drop(tx);
        assert!(!until_leader(&mut rx).await);
    }
}
