//! The leases of deleted Proxies, which no finalizer waits for.
//!
//! A Managed Proxy's finalizer drains its leases before its machine goes. An External proxy has
//! no machine and no finalizer (so its deletion never waits on this operator), and a Proxy can
//! also go while no operator leads; either way its leases would run on until their TTL, on a
//! proxy that is no longer served. They are ended here instead, on the leader, with the ledger
//! reason [`LEASES_PROXY_DELETED`]:
//!
//! - at once, from the Proxy watch's delete events ([`follow`]): the API server says the object
//!   is gone, which no undecodable object or watch re-list can fake;
//! - and by a sweep ([`sweep`]) when this process starts leading and every
//!   [`FORGET_PERIOD`](super::controller) after, for deletions no event reported (made while no
//!   operator led, or during a re-list of the watch): proxies with active leases that are not
//!   in the store are looked up in the API server, and only those it no longer has are ended.
//!   In the usual case no proxy qualifies and the sweep makes no API call.

use std::collections::{HashMap, HashSet};

use kube::Api;
use kube::runtime::reflector::Store;
use tokio::sync::mpsc;

use super::context::Context;
use crate::resources::proxy::Proxy;

/// Ledger reason of leases ended because their Proxy was deleted.
pub const LEASES_PROXY_DELETED: &str = "proxy_deleted";

/// The proxies (by UID) holding active leases that are not among `known`: the candidates of a
/// sweep, sorted.
pub fn unknown_lease_holders(active: &HashMap<String, u32>, known: &HashSet<&str>) -> Vec<String> {
    let mut unknown: Vec<String> = active
        .iter()
        .filter(|(uid, count)| **count > 0 && !known.contains(uid.as_str()))
        .map(|(uid, _)| uid.clone())
        .collect();
    unknown.sort();
    unknown
}

/// Ends the leases of the Proxy with `uid`, which the API server no longer has. Reads the
/// ledger's counts first, so a deletion without leases (nearly all) costs no ledger write. A
/// ledger failure is logged; the leases then run until they expire.
pub async fn end_leases(ctx: &Context, uid: &str) {
    if ctx.ledger.counts().active_count(uid) == 0 {
        return;
    }
    match ctx.ledger.end_leases(uid, LEASES_PROXY_DELETED).await {
        Ok(0) => {}
        Ok(ended) => {
            log::info!("deleted Proxy (UID {uid}): ended {ended} active leases");
        }
        Err(e) => log::warn!(
            "cannot end the leases of deleted Proxy (UID {uid}); they run until they expire: {e}"
        ),
    }
}

/// Ends the leases of every Proxy the watch reports deleted (by UID), until the watch stops.
pub async fn follow(ctx: &Context, mut deleted: mpsc::Receiver<String>) {
    while let Some(uid) = deleted.recv().await {
        end_leases(ctx, &uid).await;
    }
}

/// Ends the leases of proxies the API server no longer has that the delete events missed: the
/// holders of active leases absent from `store` are checked against a metadata list of the
/// Proxies (`namespace`, or all), which also has the Proxies the watch skips as undecodable.
pub async fn sweep(ctx: &Context, store: &Store<Proxy>, namespace: Option<&str>) {
    let unknown = {
        let state = store.state();
        let uids: Vec<String> = state
            .iter()
            .filter_map(|p| p.metadata.uid.clone())
            .collect();
        let known: HashSet<&str> = uids.iter().map(String::as_str).collect();
        unknown_lease_holders(&ctx.ledger.counts().active_counts(), &known)
    };
    if unknown.is_empty() {
        return;
    }
    let api: Api<Proxy> = match namespace {
        Some(ns) => Api::namespaced(ctx.client.clone(), ns),
        None => Api::all(ctx.client.clone()),
    };
    let live = match crate::controllers::gc::live_proxy_uids(&api).await {
        Ok(live) => live,
        Err(e) => {
            log::warn!(
                "cannot list Proxies to end the leases of deleted ones (next try later): {e}"
            );
            return;
        }
    };
    for uid in unknown.iter().filter(|uid| !live.contains(*uid)) {
        end_leases(ctx, uid).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_holders_not_known_are_the_candidates() {
        let active: HashMap<String, u32> = [("gone-b", 2), ("live", 1), ("gone-a", 1), ("idle", 0)]
            .into_iter()
            .map(|(uid, n)| (uid.to_owned(), n))
            .collect();
        let cases: [(&str, &[&str], &[&str]); 4] = [
            ("none known", &[], &["gone-a", "gone-b", "live"]),
            ("one known", &["live"], &["gone-a", "gone-b"]),
            (
                "a proxy without leases is never one",
                &["live", "gone-a"],
                &["gone-b"],
            ),
            ("all known", &["live", "gone-a", "gone-b"], &[]),
        ];
        for (name, known, expected) in cases {
            let known: HashSet<&str> = known.iter().copied().collect();
            assert_eq!(unknown_lease_holders(&active, &known), expected, "{name}");
        }
    }
}
