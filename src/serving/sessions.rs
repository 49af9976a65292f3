//! Sticky sessions of the crawler gateway: one lease per (token, session name) however many
//! connections use it, so every connection of a session leaves through the same upstream proxy
//! (the same exit address) while that proxy stays usable for the target.
//!
//! The table is the process's memory of the sessions it serves; the ledger is the record. A
//! session's lease is acquired with a request ID derived from the token, the session name, the
//! selector and an epoch (see [`request_id`]), so after a restart the same session finds its
//! lease again through the ledger (a replay), and a session that had to move to another proxy
//! (a new epoch) finds the newer one. The lease API reads the table too, to take a crawler's
//! ban report for a session it only knows by name.
//!
//! # Timing
//!
//! With an idle lifetime `T` (`sessionTTL`), the lease's TTL is `1.5 T` and a use renews it once
//! `T / 2` has passed since the last renewal: it then outlives the last use by at least `T` and
//! at most `1.5 T`, and a busy session costs one renewal per `T / 2`. A session idle for `T` is
//! released.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use super::tokens::TokenId;
use crate::resources::proxy::ProxyId;

/// A session: the token that opened it and its name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionKey {
    /// The token's identity (never the token).
    pub token: TokenId,
    /// The name the crawler gave it.
    pub name: String,
}

/// How many requests and tunnels are using a lease right now: one that is in use is never given
/// back for a drain (the machine would go while they run). Clones count together.
#[derive(Debug, Clone, Default)]
pub struct Uses(Arc<AtomicUsize>);

impl Uses {
    /// Counts a use until the guard is dropped.
    pub fn begin(&self) -> InUse {
        self.0.fetch_add(1, Ordering::AcqRel);
        InUse(self.0.clone())
    }

    /// Whether nothing uses it.
    pub fn idle(&self) -> bool {
        self.0.load(Ordering::Acquire) == 0
    }
}

/// One use of a lease (see [`Uses`]).
#[derive(Debug)]
pub struct InUse(Arc<AtomicUsize>);

impl Drop for InUse {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A session's current lease.
#[derive(Debug, Clone)]
pub struct Session {
    /// The lease.
    pub lease_id: String,
    /// The tenant of the token that opened it: the lease is that tenant's.
    pub tenant: Arc<str>,
    /// Its proxy.
    pub proxy: ProxyId,
    /// The canonical selector it was acquired with; another selector is another session.
    pub selector: String,
    /// How many times the session moved to another proxy: part of its request ID.
    pub epoch: u32,
    /// Its idle lifetime `T`.
    pub idle_ttl: Duration,
    /// The last use.
    pub last_used: Instant,
    /// The last renewal (or the acquire).
    pub renewed: Instant,
    /// Requests and tunnels using the lease now.
    pub uses: Uses,
    /// The lease was given back because its proxy is draining or gone: the next use moves.
    pub released: bool,
}

impl Session {
    /// The TTL its lease is acquired and renewed with: `1.5 T`.
    pub fn lease_ttl(idle_ttl: Duration) -> Duration {
        idle_ttl.saturating_add(idle_ttl / 2)
    }

    /// Whether a use at `now` should renew the lease (half of `T` since the last renewal).
    pub fn renewal_due(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.renewed) >= self.idle_ttl / 2
    }

    /// Whether it has been idle for its whole lifetime at `now`.
    pub fn idle(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.last_used) >= self.idle_ttl
    }
}

/// The request ID of a session's lease at `epoch`: a digest of the token, the session name and
/// the selector (so neither the token nor the name leaves the process in it), and the epoch.
pub fn request_id(key: &SessionKey, selector: &str, epoch: u32) -> String {
    let mut digest = Sha256::new();
    for part in [key.token.as_str(), &key.name, selector] {
        digest.update(part.len().to_le_bytes());
        digest.update(part.as_bytes());
    }
    let hash = hex::encode(&digest.finalize()[..16]);
    format!("gw-session-{hash}-{epoch}")
}

/// The sessions this process serves. Cheap to clone; every clone sees the same table.
#[derive(Debug, Clone, Default)]
pub struct Sessions {
    table: Arc<Mutex<HashMap<SessionKey, Session>>>,
}

impl Sessions {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SessionKey, Session>> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The session, if the table has it.
    pub fn get(&self, key: &SessionKey) -> Option<Session> {
        self.lock().get(key).cloned()
    }

    /// The session of `token` named `name`, if the table has it.
    pub fn find(&self, token: &TokenId, name: &str) -> Option<Session> {
        self.get(&SessionKey {
            token: token.clone(),
            name: name.to_owned(),
        })
    }

    /// Records the session's (new) lease.
    pub fn put(&self, key: SessionKey, session: Session) {
        self.lock().insert(key, session);
    }

    /// Notes a use at `now` (and a renewal, when `renewed`), if the session still holds
    /// `lease_id`.
    pub fn touch(&self, key: &SessionKey, lease_id: &str, now: Instant, renewed: bool) {
        if let Some(session) = self.lock().get_mut(key).filter(|s| s.lease_id == lease_id) {
            session.last_used = now;
            if renewed {
                session.renewed = now;
            }
        }
    }

    /// Forgets the session if it still holds `lease_id`.
    pub fn remove(&self, key: &SessionKey, lease_id: &str) {
        let mut table = self.lock();
        if table.get(key).is_some_and(|s| s.lease_id == lease_id) {
            table.remove(key);
        }
    }

    /// Marks every session whose proxy `gone` says is draining or gone and that nothing uses
    /// as released, and returns their leases (with their tenants) for the caller to give back.
    /// The sessions stay in the table, so their next use moves and says from where.
    pub fn release_where(&self, gone: impl Fn(&ProxyId) -> bool) -> Vec<(String, Arc<str>)> {
        let mut table = self.lock();
        table
            .values_mut()
            .filter(|s| !s.released && s.uses.idle() && gone(&s.proxy))
            .map(|s| {
                s.released = true;
                (s.lease_id.clone(), s.tenant.clone())
            })
            .collect()
    }

    /// Sessions in the table per tenant.
    pub fn per_tenant(&self) -> HashMap<Arc<str>, usize> {
        let mut counts: HashMap<Arc<str>, usize> = HashMap::new();
        for session in self.lock().values() {
            *counts.entry(session.tenant.clone()).or_default() += 1;
        }
        counts
    }

    /// Takes out every session idle at `now` that nothing uses; their leases are for the
    /// caller to release.
    pub fn take_idle(&self, now: Instant) -> Vec<(SessionKey, Session)> {
        let mut table = self.lock();
        let idle: Vec<SessionKey> = table
            .iter()
            .filter(|(_, s)| s.idle(now) && s.uses.idle())
            .map(|(k, _)| k.clone())
            .collect();
        idle.into_iter()
            .filter_map(|key| table.remove(&key).map(|s| (key, s)))
            .collect()
    }

    /// Sessions in the table.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serving::tokens::{ApiToken, TokenSet};

    fn token(text: &str) -> TokenId {
        let set = TokenSet::single(text.as_bytes(), "t").unwrap();
        ApiToken::new(set).check(text.as_bytes()).unwrap().token
    }

    fn key(token_text: &str, name: &str) -> SessionKey {
        SessionKey {
            token: token(token_text),
            name: name.into(),
        }
    }

    fn session(lease: &str, at: Instant) -> Session {
        Session {
            lease_id: lease.into(),
            tenant: "default".into(),
            proxy: ProxyId {
                namespace: "crawl".into(),
                name: "p".into(),
                uid: "u".into(),
            },
            selector: String::new(),
            epoch: 0,
            idle_ttl: Duration::from_secs(300),
            last_used: at,
            renewed: at,
            uses: Uses::default(),
            released: false,
        }
    }

    #[test]
    fn a_session_lease_outlives_its_last_use_by_its_idle_lifetime() {
        let t = Duration::from_secs(300);
        assert_eq!(Session::lease_ttl(t), Duration::from_secs(450));
        let start = Instant::now();
        let s = session("l", start);
        let at = |secs| start + Duration::from_secs(secs);
        assert!(!s.renewal_due(at(149)));
        assert!(s.renewal_due(at(150)));
        assert!(!s.idle(at(299)));
        assert!(s.idle(at(300)));
        // The worst case: used just before a renewal is due, then idle. The lease, renewed
        // at most T/2 before the last use, still has at least T left when the use happens.
        let renewed_at = 0;
        let last_use = 149;
        let expires = renewed_at + Session::lease_ttl(t).as_secs();
        assert!(expires >= last_use + t.as_secs());
    }

    #[test]
    fn request_ids_are_per_token_session_selector_and_epoch() {
        let a = key("token-aaaaaaaaaaaaaaaa", "s1");
        let id = request_id(&a, "geo=eu", 0);
        assert!(id.starts_with("gw-session-") && id.ends_with("-0"), "{id}");
        assert!(id.len() <= 128);
        assert!(!id.contains("s1") && !id.contains("token"));
        assert_eq!(id, request_id(&a, "geo=eu", 0), "stable across restarts");
        for other in [
            request_id(&a, "geo=eu", 1),
            request_id(&a, "geo=us", 0),
            request_id(&key("token-aaaaaaaaaaaaaaaa", "s2"), "geo=eu", 0),
            request_id(&key("token-bbbbbbbbbbbbbbbb", "s1"), "geo=eu", 0),
        ] {
            assert_ne!(id, other);
        }
    }

    #[test]
    fn the_table_touches_forgets_and_releases_only_the_lease_it_holds() {
        let sessions = Sessions::default();
        let start = Instant::now();
        let k = key("token-aaaaaaaaaaaaaaaa", "s1");
        sessions.put(k.clone(), session("l1", start));
        let later = start + Duration::from_secs(100);
        sessions.touch(&k, "l1", later, false);
        assert_eq!(sessions.get(&k).unwrap().last_used, later);
        assert_eq!(sessions.get(&k).unwrap().renewed, start);
        sessions.touch(&k, "old", start + Duration::from_secs(200), true);
        assert_eq!(sessions.get(&k).unwrap().last_used, later, "another lease");
        sessions.remove(&k, "old");
        assert_eq!(sessions.len(), 1);
        assert_eq!(
            sessions.find(&k.token, "s1").map(|s| s.lease_id),
            Some("l1".to_owned())
        );
        assert!(
            sessions
                .take_idle(later + Duration::from_secs(299))
                .is_empty()
        );
        let in_use = sessions.get(&k).unwrap().uses.begin();
        assert!(
            sessions
                .take_idle(later + Duration::from_secs(300))
                .is_empty(),
            "a session in use (a long tunnel) is not idle"
        );
        drop(in_use);
        let idle = sessions.take_idle(later + Duration::from_secs(300));
        assert_eq!(idle.len(), 1);
        assert!(sessions.is_empty());
    }

    #[test]
    fn a_drain_releases_only_unused_sessions_on_the_proxy_and_keeps_them_to_move() {
        let sessions = Sessions::default();
        let start = Instant::now();
        let (a, b) = (
            key("token-aaaaaaaaaaaaaaaa", "a"),
            key("token-aaaaaaaaaaaaaaaa", "b"),
        );
        sessions.put(a.clone(), session("la", start));
        let mut other = session("lb", start);
        other.proxy.uid = "other".into();
        sessions.put(b.clone(), other);
        let in_use = sessions.get(&a).unwrap().uses.begin();
        let on_u = |p: &ProxyId| p.uid == "u";
        assert!(sessions.release_where(on_u).is_empty(), "in use");
        drop(in_use);
        assert_eq!(
            sessions.release_where(on_u),
            vec![("la".to_owned(), Arc::from("default"))]
        );
        assert!(sessions.release_where(on_u).is_empty(), "once");
        assert!(sessions.get(&a).unwrap().released);
        assert!(!sessions.get(&b).unwrap().released);
        assert_eq!(sessions.len(), 2);
    }
}
