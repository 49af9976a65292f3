//! The fleet as the crawler-facing servers see it: one value, built once by the process and
//! handed to the lease API, the gateway and the status page, holding what they read (the
//! inventory, health, the candidate index, the pools a request may wake, upstream
//! credentials) and write (the ledger, the sessions, the outcomes). Cheap to clone: every
//! clone sees the same fleet.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use super::candidates::{CandidateIndex, Selector};
use super::outcomes::Outcomes;
use super::pools::PoolDirectory;
use super::sessions::Sessions;
use super::tenants::Tenant;
use super::traffic::Traffic;
use crate::credentials::CredentialStore;
use crate::credentials::{Credentials, vendor_credentials};
use crate::health::HealthSnapshot;
use crate::inventory::Inventory;
use crate::ledger::{
    AcquireOutcome, AcquireRequest, Candidate, Clock, Ledger, LedgerError, RequestKey,
};
use crate::resources::proxy::{Proxy, ProxyId};
use crate::resources::rotating::{Fill, FillError, vendor_session};

/// What the servers share of the fleet.
#[derive(Clone)]
pub struct Fleet {
    /// Proxies known to the process.
    pub inventory: Inventory,
    /// Their health, as the engine last saw it.
    pub health: HealthSnapshot,
    /// The lease ledger.
    pub ledger: Arc<dyn Ledger>,
    /// The ledger's clock (for `Retry-After`).
    pub clock: Arc<dyn Clock>,
    /// Selector matches and health positions, kept per inventory snapshot.
    pub candidates: CandidateIndex,
    /// Upstream credentials of the proxies that ask for them.
    pub credentials: CredentialStore,
    /// The gateway's sticky sessions (the API takes reports for them).
    pub sessions: Sessions,
    /// How requests through each proxy ended: the gateway's and the API's reports.
    pub outcomes: Outcomes,
    /// The ProxyPools a refused request may wake (empty in standalone mode).
    pub pools: PoolDirectory,
    /// Bytes through the gateway per proxy.
    pub traffic: Traffic,
    /// Each proxy's exit, as the exit checker last found it.
    pub exits: crate::health::exits::ExitTable,
    /// The currency of every proxy's `cost` (`--cost-currency`).
    pub currency: Arc<str>,
}

/// One acquire as a server asks it (see [`Fleet::acquire`]).
pub struct Acquire<'a> {
    /// The caller's tenant: its scope narrows the selector, its quotas apply.
    pub tenant: &'a Tenant,
    /// The labels the proxy must carry, as the caller gave them.
    pub selector: Selector,
    /// Proxies (by UID) not to lease, e.g. those a request already failed on.
    pub excluding: &'a HashSet<String>,
    /// The target the crawler names.
    pub target: Option<String>,
    /// The requested TTL.
    pub ttl: Duration,
    /// Makes a retried acquire return the lease the first attempt got.
    pub request: Option<RequestKey>,
    /// The crawler asking, when it says.
    pub client: Option<String>,
    /// The gateway session the lease is for.
    pub session: Option<String>,
    /// Which step of a fallback chain this acquire is, recorded with the lease.
    pub fallback_step: Option<u32>,
}

/// The exit lease `lease_id` on `object` (the proxy `proxy`) goes through when the proxy has
/// many: a rotating upstream's vendor session, derived from the lease's ID (a gateway session
/// keeps its lease, and so its exit, across requests and restarts). `None`: the proxy is one
/// exit.
pub fn lease_exit(object: &Proxy, proxy: &ProxyId, lease_id: &str) -> Option<String> {
    object.spec.rotating()?;
    Some(vendor_session(&proxy.uid, lease_id))
}

impl Fleet {
    /// [`lease_exit`] of a lease on `proxy`, read in the current inventory.
    pub fn exit_of(&self, proxy: &ProxyId, lease_id: &str) -> Option<String> {
        lease_exit(self.inventory.snapshot().get(proxy)?, proxy, lease_id)
    }

    /// What to send through `object` on a lease whose exit is `exit` (its [`lease_exit`]) for
    /// a request with `selector`: the credentials Secret's; for a rotating upstream, the
    /// username and password spelled for that vendor session.
    pub fn upstream_credentials(
        &self,
        object: &Proxy,
        exit: Option<&str>,
        selector: &BTreeMap<String, String>,
    ) -> Result<Option<Credentials>, FillError> {
        let secret = self.credentials.for_proxy(object);
        let (Some(rotating), Some(session)) = (object.spec.rotating(), exit) else {
            return Ok(secret);
        };
        let fill = Fill {
            session,
            selector,
            labels: object.metadata.labels.as_ref(),
            secret: None,
        };
        vendor_credentials(rotating, fill, secret.as_ref()).map(Some)
    }

    /// [`exit_of`](Self::exit_of) for `tenant`'s lease `id`, looked up in the ledger (`None`
    /// when it is unknown: the report then fails on its own).
    pub async fn exit_of_lease(&self, id: &str, tenant: &str) -> Option<String> {
        let lease = self.ledger.get(id, tenant).await.ok()??;
        self.exit_of(&lease.proxy, id)
    }

    /// A fleet of `inventory`, `health` and `ledger` with nothing else known yet: no
    /// credentials, sessions or pools, outcomes counted on `clock`.
    pub fn new(
        inventory: Inventory,
        health: HealthSnapshot,
        ledger: Arc<dyn Ledger>,
        clock: Arc<dyn Clock>,
    ) -> Self {
        Fleet {
            inventory,
            health,
            ledger,
            outcomes: Outcomes::new(clock.clone()),
            clock,
            candidates: CandidateIndex::default(),
            credentials: CredentialStore::default(),
            sessions: Sessions::default(),
            pools: PoolDirectory::default(),
            traffic: Traffic::default(),
            exits: Default::default(),
            currency: crate::resources::cost::DEFAULT_CURRENCY.into(),
        }
    }

    /// The ledger's answer to `acquire`: the tenant narrows the selector to its scope, and the
    /// candidates of the current inventory and health, less those excluded, go to the ledger,
    /// which decides.
    pub async fn acquire(&self, acquire: Acquire<'_>) -> Result<AcquireOutcome, LedgerError> {
        let selector = acquire.tenant.narrow(&acquire.selector);
        let snapshot = self.inventory.snapshot();
        let mut candidates = self
            .candidates
            .candidates(&snapshot, &self.health, &selector);
        drop(snapshot);
        if !acquire.excluding.is_empty() {
            let left: Vec<Candidate> = candidates
                .iter()
                .filter(|c| !acquire.excluding.contains(&c.proxy.uid))
                .cloned()
                .collect();
            candidates = left.into();
        }
        self.ledger
            .acquire(AcquireRequest {
                candidates,
                target: acquire.target,
                ttl: acquire.ttl,
                request: acquire.request,
                client: acquire.client,
                tenant: acquire.tenant.tenancy(),
                session: acquire.session,
                fallback_step: acquire.fallback_step,
            })
            .await
    }
}
