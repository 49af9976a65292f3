//! Acquires this replica has chosen a proxy for but not committed yet, counted per proxy.
//!
//! Concurrent acquires read the loads before any of them commits, so without this they would
//! all choose the same least-loaded proxy and then wait, one after another, for its lock. The
//! selection adds this replica's acquires in flight to the loads it read, as SQLite's single
//! writer sees the grants before them, so concurrent acquires spread over proxies and lock
//! different rows. It only steers the choice: capacity is still checked under the proxy's
//! lock against what is committed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

/// In-flight acquires per proxy UID.
#[derive(Debug, Default)]
pub(crate) struct Inflight {
    by_proxy: Mutex<HashMap<String, u32>>,
}

impl Inflight {
    /// Runs `choose` with the in-flight count of every proxy (by UID) and reserves the proxy
    /// it returns, all under one lock, so two acquires of this replica never count without
    /// each other. The reservation ends when the returned guard is dropped.
    pub fn choose<T>(
        self: &Arc<Self>,
        choose: impl FnOnce(&dyn Fn(&str) -> u32) -> (T, Option<String>),
    ) -> (T, Option<Reservation>) {
        let mut by_proxy = self.by_proxy.lock().unwrap_or_else(PoisonError::into_inner);
        let (value, chosen) = {
            let counts = &*by_proxy;
            choose(&|uid| counts.get(uid).copied().unwrap_or(0))
        };
        let reservation = chosen.map(|uid| {
            *by_proxy.entry(uid.clone()).or_default() += 1;
            Reservation {
                inflight: self.clone(),
                uid,
            }
        });
        (value, reservation)
    }

    fn release(&self, uid: &str) {
        let mut by_proxy = self.by_proxy.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = by_proxy.get_mut(uid) {
            *count -= 1;
            if *count == 0 {
                by_proxy.remove(uid);
            }
        }
    }
}

/// One acquire in flight on a proxy; ends on drop (after its transaction, committed or not).
#[derive(Debug)]
pub(crate) struct Reservation {
    inflight: Arc<Inflight>,
    uid: String,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.inflight.release(&self.uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_count_until_dropped_and_steer_the_next_choice() {
        let inflight = Arc::new(Inflight::default());
        // Choose the proxy with the fewest in flight among p, q.
        let pick = |inflight: &Arc<Inflight>| {
            inflight.choose(|count| {
                let uid = if count("p") <= count("q") { "p" } else { "q" };
                ((), Some(uid.to_owned()))
            })
        };
        let (_, first) = pick(&inflight);
        let (_, second) = pick(&inflight);
        let (_, third) = pick(&inflight);
        let uids: Vec<&str> = [&first, &second, &third]
            .iter()
            .map(|r| r.as_ref().unwrap().uid.as_str())
            .collect();
        assert_eq!(uids, ["p", "q", "p"]);
        drop(first);
        drop(third);
        let (_, fourth) = pick(&inflight);
        assert_eq!(
            fourth.as_ref().unwrap().uid,
            "p",
            "p has none in flight again"
        );
        drop((second, fourth));
        assert!(inflight.by_proxy.lock().unwrap().is_empty());
        let (value, none) = inflight.choose(|_| (7, None));
        assert_eq!((value, none.is_none()), (7, true));
    }
}
