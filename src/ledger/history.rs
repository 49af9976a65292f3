//! One row of the lease history (`lease_events`), as every backend writes it, so the
//! history reads the same whichever ledger wrote it. Rows written by a set-based statement
//! (the sweep's `expired` events, PostgreSQL's batched grants and releases) spell their kind
//! in that SQL; the values are [`EventKind::as_str`]'s.

use super::lease::ReportResult;
use crate::resources::proxy::ProxyId;

/// What happened to a lease, as written to `lease_events.kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventKind {
    Acquired,
    Renewed,
    Released,
    Reported,
}

impl EventKind {
    /// The kind as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Acquired => "acquired",
            EventKind::Renewed => "renewed",
            EventKind::Released => "released",
            EventKind::Reported => "reported",
        }
    }
}

/// One history row, borrowed from whatever the caller holds; times in milliseconds.
#[derive(Debug)]
pub(crate) struct Event<'a> {
    pub kind: EventKind,
    pub at: i64,
    pub lease_id: &'a str,
    /// The tenant that holds the lease.
    pub tenant: &'a str,
    pub proxy: &'a ProxyId,
    pub target: Option<&'a str>,
    /// What a report said (`reported` events only).
    pub result: Option<ReportResult>,
    pub expires_at: i64,
    /// Why the operator released the lease (`released` events only).
    pub reason: Option<&'a str>,
    /// The cooldown a report started (`reported` events only).
    pub cooldown_ms: Option<i64>,
    /// The crawler that took the lease (`acquired` events only).
    pub client: Option<&'a str>,
    /// The fallback chain's step that served the acquire (`acquired` events only).
    pub fallback_step: Option<u32>,
}

impl<'a> Event<'a> {
    /// A `kind` event at `at` on `tenant`'s lease expiring at `expires_at`, with none of the
    /// fields that only some kinds carry.
    pub fn new(
        kind: EventKind,
        at: i64,
        lease_id: &'a str,
        tenant: &'a str,
        proxy: &'a ProxyId,
        target: Option<&'a str>,
        expires_at: i64,
    ) -> Self {
        Event {
            kind,
            at,
            lease_id,
            tenant,
            proxy,
            target,
            result: None,
            expires_at,
            reason: None,
            cooldown_ms: None,
            client: None,
            fallback_step: None,
        }
    }
}
