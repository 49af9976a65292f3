//! Leader election on a `coordination.k8s.io/v1` Lease, for the work that must have a single
//! writer across replicas (orphan GC). Built on kube-lease-manager, which renews the Lease in
//! the background and publishes "am I the leader" on a watch channel.

use kube::Client;
use kube_lease_manager::{LeaseCreateMode, LeaseManagerBuilder, LeaseManagerError};
use prometheus::{IntGauge, Registry};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

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

    /// This config with a Lease valid for `duration` (whole seconds), renewed a sixth of it
    /// (1 to 5 s) before expiry.
    pub fn lasting(self, duration: std::time::Duration) -> Self {
        let duration_seconds = duration.as_secs().max(2);
        LeaderConfig {
            duration_seconds,
            grace_seconds: (duration_seconds / 6).clamp(1, 5),
            ..self
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

/// Waits for the Lease while `drain` keeps a follower's inputs from piling up (it ends only
/// when an input ends, with why). `Ok(true)` once this process leads; `Ok(false)` at shutdown
/// or when the election ended (then after shutdown). An input that ends at shutdown, maybe
/// before this task sees the signal, is not a failure.
pub async fn wait_to_lead(
    leader: &mut watch::Receiver<bool>,
    shutdown: &CancellationToken,
    drain: impl std::future::Future<Output = String>,
) -> Result<bool, String> {
    tokio::select! {
        () = shutdown.cancelled() => Ok(false),
        held = until_leader(leader) => {
            if !held {
                shutdown.cancelled().await;
            }
            Ok(held)
        }
        ended = drain => if shutdown.is_cancelled() { Ok(false) } else { Err(ended) },
    }
}

/// Runs `work` (named `what`) while this process leads, until shutdown. Losing the Lease is an
/// error that stops the process: its restart contends again as a follower, so two processes
/// never lead at once. `work` ending before shutdown is an error too.
pub async fn lead(
    leader: &mut watch::Receiver<bool>,
    shutdown: &CancellationToken,
    what: &str,
    work: impl std::future::Future<Output = ()>,
) -> Result<(), String> {
    tokio::select! {
        () = work => {
            if shutdown.is_cancelled() { Ok(()) } else { Err(format!("{what} stopped")) }
        }
        () = shutdown.cancelled() => Ok(()),
        () = async { drop(leader.wait_for(|leading| !*leading).await) } => {
            if shutdown.is_cancelled() {
                Ok(())
            } else {
                Err(format!("lost the leader Lease: stopping so that no two replicas run {what}"))
            }
        }
    }
}

/// Registers `proxy_operator_leader`: summed over the replicas it is 1 while some process holds
/// the Lease, so 0 (or no series at all) is what tells that orphan GC runs nowhere.
pub fn register_leader_gauge(registry: &Registry) -> Result<IntGauge, prometheus::Error> {
    let gauge = IntGauge::new(
        "proxy_operator_leader",
        "1 while this process holds the leader Lease (and runs orphan GC), else 0.",
    )?;
    registry.register(Box::new(gauge.clone()))?;
    Ok(gauge)
}

/// Mirrors `leader` into `gauge` until `shutdown`: 0 once the election has ended. A task of
/// its own rather than a scrape-time read, so that no receiver outlives the process's tasks
/// and keeps the Lease from being released at shutdown.
pub async fn publish_leadership(
    mut leader: watch::Receiver<bool>,
    gauge: IntGauge,
    shutdown: CancellationToken,
) -> Result<(), String> {
    loop {
        gauge.set(i64::from(*leader.borrow_and_update()));
        let changed = tokio::select! {
            changed = leader.changed() => changed,
            () = shutdown.cancelled() => return Ok(()),
        };
        if changed.is_err() {
            gauge.set(0);
            shutdown.cancelled().await;
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Waits (at most 10 s) until `gauge` reads `want`.
    async fn gauge_reaches(gauge: &IntGauge, want: i64) {
        tokio::time::timeout(Duration::from_secs(10), async {
            while gauge.get() != want {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("the leader gauge stayed at {}, not {want}", gauge.get()));
    }

    #[tokio::test]
    async fn the_leader_gauge_follows_the_election_and_reads_0_once_it_ended() {
        let registry = Registry::new();
        let gauge = register_leader_gauge(&registry).unwrap();
        let (tx, rx) = watch::channel(true);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(publish_leadership(rx, gauge.clone(), shutdown.clone()));
        gauge_reaches(&gauge, 1).await;
        tx.send(false).unwrap();
        gauge_reaches(&gauge, 0).await;
        tx.send(true).unwrap();
        gauge_reaches(&gauge, 1).await;
        // The election ends while this process leads: the Lease is no longer renewed.
        drop(tx);
        gauge_reaches(&gauge, 0).await;
        assert!(!task.is_finished(), "the task ended before shutdown");
        shutdown.cancel();
        task.await.unwrap().unwrap();
        let families = registry.gather();
        assert_eq!(families.len(), 1);
        assert_eq!(families[0].name(), "proxy_operator_leader");
    }

    #[test]
    fn a_lease_duration_sets_the_renewal_grace() {
        let base = LeaderConfig::new("ns", "me");
        assert_eq!((base.duration_seconds, base.grace_seconds), (30, 5));
        for (seconds, grace) in [(30, 5), (60, 5), (12, 2), (3, 1), (2, 1)] {
            let config = base
                .clone()
                .lasting(std::time::Duration::from_secs(seconds));
            assert_eq!(
                (config.duration_seconds, config.grace_seconds),
                (seconds, grace)
            );
        }
    }

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
