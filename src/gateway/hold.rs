//! Holding a request while a pool wakes: a crawler whose request matches a ProxyPool with no
//! Ready member (asleep at zero, or its members still starting) keeps its connection open, and
//! the gateway tries again as the inventory and the health verdicts change, until a member can
//! take it or the pool's `wakeTimeout` passes. Scrapoxy refused such requests (`557
//! no_proxy`); the KEDA HTTP add-on holds them: so does this.

use std::time::{Duration, Instant};

use super::ask::Ask;
use super::choice::{Gateway, Refusal};
use super::limits::Slot;
use super::metrics::HOLD_REFUSED;
use crate::serving::candidates::Selector;
use crate::serving::pools::directory;

/// How often a held request checks whether anything changed.
const POLL: Duration = Duration::from_millis(50);
/// Longest a held request goes without trying again, changes or not.
const RETRY: Duration = Duration::from_secs(1);
/// How often a held request counts again as its pools' demand (the autoscaler reads the
/// last minute).
const RECORD_AGAIN: Duration = Duration::from_secs(30);

/// A request being held.
#[derive(Debug)]
pub(super) struct Hold {
    started: Instant,
    deadline: Instant,
    pools: Vec<String>,
    recorded: Instant,
    /// Counts the request among those held (`--gateway-max-held-requests`).
    _slot: Slot,
}

impl Hold {
    /// How long the request has waited.
    pub(super) fn waited(&self) -> Duration {
        self.started.elapsed()
    }
}

/// After `refused`: whether to try `ask` again because it waits for a waking pool. The first
/// refusal records the request as demand and starts the hold; later ones keep it until its
/// deadline. Returns once something changed that may let it through (or at the latest after
/// [`RETRY`]); `false` when it should not wait (any more).
pub(super) async fn wait_for_pool(
    gateway: &Gateway,
    ask: &Ask,
    refused: &Refusal,
    hold: &mut Option<Hold>,
) -> bool {
    let Refusal::NoMatch(no_match) = refused else {
        return false;
    };
    let now = Instant::now();
    match hold {
        None => {
            let selector = ask
                .caller
                .tenant
                .narrow(&Selector::from(ask.options.selector.clone()));
            let Some(waking) = gateway
                .fleet
                .pools
                .refused(gateway.fleet.ledger.as_ref(), &selector, no_match, None)
                .await
            else {
                return false;
            };
            let Some(slot) = gateway.limits.held() else {
                gateway.metrics.held(HOLD_REFUSED, Duration::ZERO);
                return false;
            };
            log::debug!(
                "gateway: holding a request for {} while pools {:?} wake",
                ask.target.host,
                waking.pools
            );
            *hold = Some(Hold {
                started: now,
                deadline: now + waking.wake_timeout,
                pools: waking.pools,
                recorded: now,
                _slot: slot,
            });
        }
        Some(hold) => {
            if now >= hold.deadline {
                return false;
            }
            if now.duration_since(hold.recorded) >= RECORD_AGAIN {
                directory::record(gateway.fleet.ledger.as_ref(), &hold.pools).await;
                hold.recorded = now;
            }
        }
    }
    let deadline = hold.as_ref().map_or(now, |h| h.deadline);
    let changed = changes(gateway);
    let until = (now + RETRY).min(deadline);
    tokio::select! {
        () = async {
            while Instant::now() < until && changes(gateway) == changed {
                tokio::time::sleep(POLL).await;
            }
        } => true,
        () = gateway.stopping.cancelled() => false,
    }
}

/// What, when it changes, may let a held request through: the inventory and the health table.
fn changes(gateway: &Gateway) -> (u64, u64) {
    (
        gateway.fleet.inventory.snapshot().version(),
        gateway.fleet.health.read().version(),
    )
}
