//! What the status page shows, as data: the bodies of its JSON routes, built by pure
//! functions from what the process knows (inventory, health, ledger counts and activity, the
//! gateway's sessions and outcomes, the pools), so a page and its route cannot disagree.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::api::types::LastFailureView;
use crate::geoip::{GEO_LABEL, geo_mismatch};
use crate::health::ProxyHealth;
use crate::health::exits::ExitView;
use crate::inventory::InventorySnapshot;
use crate::ledger::TenantUsage;
use crate::ledger::{ActiveCooldown, Activity, EventEntry, ExitChange, ReportCounts};
use crate::resources::phase::shown_phase;
use crate::resources::proxy::{Mode, Proxy, ProxyId};
use crate::serving::candidates::Selector;
use crate::serving::outcomes::OutcomeCounts;
use crate::serving::pools::PoolEntry;
use crate::serving::tenants::Tenant;

/// Rows of the proxies table per page.
pub const PAGE_SIZE: usize = 100;

/// The highest page number a query may ask for.
pub const MAX_PAGE: u32 = 100_000;

/// Longest name filter, in bytes.
pub const MAX_NAME_FILTER: usize = 253;

/// The window of the gateway's figures on the fleet view.
pub const GATEWAY_WINDOW: Duration = Duration::from_secs(300);

/// The window of success rates and per-target figures.
pub const HOUR: Duration = Duration::from_secs(3600);

/// A success rate from this up is shown green.
pub const GOOD_RATE: f64 = 0.9;

/// A success rate from this up (and below [`GOOD_RATE`]) is shown amber; below, red.
pub const FAIR_RATE: f64 = 0.7;

/// How a success rate is badged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Badge {
    /// At least [`GOOD_RATE`].
    Good,
    /// At least [`FAIR_RATE`].
    Fair,
    /// Below [`FAIR_RATE`].
    Poor,
    /// No outcome in the window.
    None,
}

impl Badge {
    /// The badge of `rate` (`None`: nothing to rate).
    pub fn of(rate: Option<f64>) -> Badge {
        match rate {
            None => Badge::None,
            Some(r) if r >= GOOD_RATE => Badge::Good,
            Some(r) if r >= FAIR_RATE => Badge::Fair,
            Some(_) => Badge::Poor,
        }
    }
}

/// Counts of proxies by phase and by health.
#[derive(Debug, Clone, Default, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct FleetProxies {
    /// Every proxy known.
    pub total: u64,
    /// By phase (`Ready`, `Unhealthy`, …); phases with none are absent.
    pub by_phase: BTreeMap<String, u64>,
    /// Passing health checks.
    pub healthy: u64,
    /// Failing them.
    pub unhealthy: u64,
    /// Not probed yet.
    pub unknown: u64,
}

/// Leases against capacity.
#[derive(Debug, Clone, Default, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct FleetLeases {
    /// Leases counting towards capacity now.
    pub active: u64,
    /// `maxLeases` summed over healthy proxies that take leases (not cordoned, not draining).
    pub capacity: u64,
    /// Cooldowns in force.
    pub cooldowns: u64,
}

/// The gateway on this replica.
#[derive(Debug, Clone, Default, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct FleetGateway {
    /// Sticky sessions open now.
    pub sessions: u64,
    /// Requests relayed (answers and tunnels) per second over the window.
    pub requests_per_second: f64,
    /// Answers with a ban status over the window.
    pub bans: u64,
    /// The window, in seconds.
    pub window_seconds: u64,
}

/// One ProxyPool.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolRow {
    /// `namespace/name`.
    pub pool: String,
    /// `spec.replicas`.
    pub replicas: i32,
    /// What the autoscaler (or `spec.replicas`) asks for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub desired: Option<i32>,
    /// Members in phase Ready.
    pub ready: i32,
    /// Active leases ÷ capacity of the Ready members.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub utilization: Option<f64>,
    /// When the autoscaler last changed `spec.replicas` (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_scale_time: Option<String>,
    /// Why `desired` is what it is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Body of `GET /v1/status/fleet`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct FleetView {
    /// Proxies by phase and health.
    pub proxies: FleetProxies,
    /// Leases against capacity.
    pub leases: FleetLeases,
    /// The gateway.
    pub gateway: FleetGateway,
    /// The ProxyPools (none in standalone mode).
    pub pools: Vec<PoolRow>,
    /// The tenants the viewer may see, with their usage against their quotas: every tenant
    /// for the default tenant, its own for any other.
    pub tenants: Vec<TenantRow>,
}

/// One tenant's usage against its quotas (`--tenants-file`).
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TenantRow {
    /// The tenant.
    pub name: String,
    /// Which proxies it may see and lease, for people (`any proxy` without a scope).
    pub scope: String,
    /// Its leases counting now (every replica's), a gateway session's included.
    pub leases: u32,
    /// Its quota of leases, if it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_quota: Option<u32>,
    /// Its gateway sessions' leases counting now.
    pub sessions: u32,
    /// Its quota of gateway sessions, if it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session_quota: Option<u32>,
    /// Its quota of acquires per second, if it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub acquires_per_second: Option<f64>,
    /// The burst of that quota.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
}

/// The rows of `tenants`, with what each holds according to `usage` (by name).
pub fn tenant_rows(
    tenants: &[std::sync::Arc<Tenant>],
    usage: &HashMap<String, TenantUsage>,
) -> Vec<TenantRow> {
    tenants
        .iter()
        .map(|tenant| {
            let held = usage.get(&*tenant.name).copied().unwrap_or_default();
            let rate = tenant.quotas.rate;
            TenantRow {
                name: tenant.name.to_string(),
                scope: tenant.scope.to_string(),
                leases: held.leases,
                lease_quota: tenant.quotas.leases,
                sessions: held.sessions,
                session_quota: tenant.quotas.sessions,
                acquires_per_second: rate.map(|r| r.per_second),
                burst: rate.map(|r| r.burst),
            }
        })
        .collect()
}

/// The column the proxies table is sorted by.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub enum SortKey {
    /// `namespace/name`.
    #[default]
    Name,
    /// Phase.
    Phase,
    /// Last probe latency.
    Latency,
    /// Active leases.
    Leases,
    /// Success rate over the last hour.
    Success,
    /// Age.
    Age,
}

/// Sort order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub enum Order {
    /// Ascending.
    #[default]
    Asc,
    /// Descending.
    Desc,
}

/// Query of `GET /v1/status/proxies` (and of the proxies page).
#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ProxiesQuery {
    /// Only proxies whose `namespace/name` contains this text.
    #[param(max_length = 253)]
    pub name: Option<String>,
    /// Only proxies whose labels match this selector (`k=v,k2=v2`).
    #[param(schema_with = crate::api::types::selector_schema)]
    pub label: Option<String>,
    /// Only proxies whose exit (address, country or network) contains this text; `shared`:
    /// only proxies flagged for a shared exit.
    #[param(max_length = 253)]
    pub exit: Option<String>,
    /// The column to sort by (default `name`).
    pub sort: Option<SortKey>,
    /// Ascending (default) or descending.
    pub order: Option<Order>,
    /// The page, from 1 (default 1), of 100 rows each.
    #[param(minimum = 1, maximum = 100000)]
    pub page: Option<u32>,
}

/// Why a [`ProxiesQuery`] was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueryError {
    /// The name filter is too long.
    #[error("`name`: at most {MAX_NAME_FILTER} bytes")]
    NameTooLong,
    /// The exit filter is too long.
    #[error("`exit`: at most {MAX_NAME_FILTER} bytes")]
    ExitTooLong,
    /// The selector does not parse.
    #[error("`label`: {0}")]
    Selector(String),
    /// The page is out of range.
    #[error("`page`: from 1 to {MAX_PAGE}")]
    Page,
}

/// A checked [`ProxiesQuery`].
#[derive(Debug, Clone)]
pub struct ProxiesFilter {
    name: String,
    label: String,
    exit: String,
    selector: Selector,
    /// The sort column.
    pub sort: SortKey,
    /// The sort order.
    pub order: Order,
    /// The page, from 1.
    pub page: u32,
}

impl ProxiesQuery {
    /// The filter this query asks for, or why it is refused.
    pub fn check(&self) -> Result<ProxiesFilter, QueryError> {
        let name = self.name.clone().unwrap_or_default();
        if name.len() > MAX_NAME_FILTER {
            return Err(QueryError::NameTooLong);
        }
        let exit = self.exit.clone().unwrap_or_default();
        if exit.len() > MAX_NAME_FILTER {
            return Err(QueryError::ExitTooLong);
        }
        let selector = Selector::parse(self.label.as_deref().unwrap_or_default())
            .map_err(|e| QueryError::Selector(e.to_string()))?;
        let page = self.page.unwrap_or(1);
        if !(1..=MAX_PAGE).contains(&page) {
            return Err(QueryError::Page);
        }
        Ok(ProxiesFilter {
            name,
            exit,
            label: self.label.clone().unwrap_or_default(),
            selector,
            sort: self.sort.unwrap_or_default(),
            order: self.order.unwrap_or_default(),
            page,
        })
    }
}

impl ProxiesFilter {
    /// The filter narrowed to `tenant`'s scope: its proxies only, whatever the label asked.
    pub fn within(&self, tenant: &Tenant) -> ProxiesFilter {
        ProxiesFilter {
            selector: tenant.narrow(&self.selector),
            ..self.clone()
        }
    }

    /// The name filter as given (empty: none).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The label selector as given (empty: none).
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The exit filter as given (empty: none).
    pub fn exit(&self) -> &str {
        &self.exit
    }

    /// Whether a row passes the exit filter: `shared` keeps the rows flagged for a shared
    /// exit; other text must be part of the exit's address, country or organisation.
    fn keeps_exit(&self, row: &ProxyRow) -> bool {
        if self.exit.is_empty() {
            return true;
        }
        let Some(exit) = &row.exit else {
            return false;
        };
        if self.exit == SHARED_FILTER {
            return !exit.shared_with.is_empty();
        }
        let wanted = self.exit.to_lowercase();
        [
            Some(exit.ip.as_str()),
            exit.country.as_deref(),
            exit.organization.as_deref(),
        ]
        .into_iter()
        .flatten()
        .any(|field| field.to_lowercase().contains(&wanted))
    }
}

/// The exit filter's value that keeps proxies flagged for a shared exit.
pub const SHARED_FILTER: &str = "shared";

/// A proxy's exit, as its row shows it.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExitRow {
    /// The address targets see.
    pub ip: String,
    /// When it last changed (RFC 3339; absent for a rotating upstream's sample).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub changed_at: Option<String>,
    /// A rotating upstream's exit: one vendor session's, sampled at each check.
    pub sampled: bool,
    /// ISO 3166-1 country code, from `--geoip-database`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub country: Option<String>,
    /// Autonomous system number, from `--geoip-database`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub asn: Option<u32>,
    /// The autonomous system's organisation, from `--geoip-database`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub organization: Option<String>,
    /// Other Ready proxies exiting from the same address (`namespace/name`).
    pub shared_with: Vec<String>,
    /// The proxy's `geo` label names another country than the exit's: what it says, as the
    /// `GeoMismatch` condition does (absent when they agree or either is unknown).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub geo_mismatch: Option<String>,
    /// When it was last checked (RFC 3339).
    pub checked_at: String,
    /// Why the last check failed, when it did (the exit shown is the last one found).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

impl ExitRow {
    /// The row of `view`, for a proxy labelled `labels`.
    fn of(view: &ExitView, labels: Option<&BTreeMap<String, String>>) -> Self {
        let label = labels.and_then(|l| l.get(GEO_LABEL)).map(String::as_str);
        let geo_mismatch =
            geo_mismatch(label, view.network.country.as_deref()).map(|(labelled, found)| {
                format!("label {GEO_LABEL} names {labelled}, the exit is in {found}")
            });
        ExitRow {
            geo_mismatch,
            ip: view.ip.to_string(),
            changed_at: view.changed_at.map(|t| t.to_string()),
            sampled: view.sampled,
            country: view.network.country.clone(),
            asn: view.network.asn,
            organization: view.network.organization.clone(),
            shared_with: view.shared_with.clone(),
            checked_at: view.checked_at.to_string(),
            last_error: view.last_error.clone(),
        }
    }
}

/// One row of the proxies table.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxyRow {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// `Managed` or `External`.
    pub mode: String,
    /// The provider of a Managed proxy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// `host:port`, once it has an address.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// Phase.
    pub phase: String,
    /// Passing health checks (`null`: not probed yet).
    pub healthy: Option<bool>,
    /// Latency of the last probe, in milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<u64>,
    /// Why it is unhealthy: its most recent failed probe (absent when healthy, not probed yet,
    /// or unhealthy as recorded before a restart and not failed since).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_failure: Option<LastFailureView>,
    /// Leases counting towards capacity.
    pub active_leases: u32,
    /// `maxLeases`.
    pub max_leases: u32,
    /// `spec.cordoned`.
    pub cordoned: bool,
    /// Being drained before a replacement.
    pub draining: bool,
    /// Cooldowns in force on it.
    pub cooldowns: u32,
    /// Outcomes of requests through it over the last hour (this replica's gateway and the
    /// API's reports).
    pub outcomes: OutcomeCounts,
    /// Their success rate, `null` with none.
    pub success_rate: Option<f64>,
    /// Seconds since the Proxy was created, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub age_seconds: Option<u64>,
    /// Its exit, from its exit check (absent without one, or before its first answer).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit: Option<ExitRow>,
}

/// Body of `GET /v1/status/proxies`.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxiesView {
    /// Every proxy known.
    pub total: u64,
    /// Those the filter matches.
    pub matched: u64,
    /// This page, from 1.
    pub page: u32,
    /// Pages of matched rows (at least 1).
    pub pages: u32,
    /// Rows per page.
    pub page_size: u32,
    /// This page's rows, sorted.
    pub proxies: Vec<ProxyRow>,
}

/// What [`proxy_rows`] reads besides the inventory.
pub struct Figures<'a> {
    /// Health by proxy.
    pub health: &'a dyn Fn(&ProxyId) -> Option<ProxyHealth>,
    /// Active leases by proxy UID.
    pub active: &'a HashMap<String, u32>,
    /// Cooldowns in force by `namespace/name`.
    pub cooldowns: &'a HashMap<String, u32>,
    /// Outcomes over the last hour by proxy.
    pub outcomes: &'a HashMap<ProxyId, OutcomeCounts>,
    /// Exits by proxy.
    pub exits: &'a HashMap<ProxyId, ExitView>,
    /// Now, for ages.
    pub now: jiff::Timestamp,
}

/// The row of one proxy.
pub fn proxy_row(id: &ProxyId, proxy: &Proxy, figures: &Figures<'_>) -> ProxyRow {
    let health = (figures.health)(id);
    let healthy = health.as_ref().and_then(|h| h.healthy);
    let status = proxy.status.as_ref();
    let outcomes = figures.outcomes.get(id).copied().unwrap_or_default();
    ProxyRow {
        namespace: id.namespace.clone(),
        name: id.name.clone(),
        mode: match proxy.spec.mode {
            Mode::Managed => "Managed",
            Mode::External => "External",
        }
        .to_owned(),
        provider: proxy.spec.provider.clone(),
        endpoint: proxy.spec.effective_host(status).map(|host| {
            let port = proxy.spec.effective_port(status);
            format!("{host}:{port}")
        }),
        phase: shown_phase(proxy, healthy).as_str().to_owned(),
        healthy,
        latency_ms: health
            .as_ref()
            .and_then(|h| h.latency)
            .map(|l| u64::try_from(l.as_millis()).unwrap_or(u64::MAX)),
        last_failure: health
            .as_ref()
            .and_then(ProxyHealth::unhealthy_because)
            .map(LastFailureView::from),
        active_leases: figures.active.get(&id.uid).copied().unwrap_or(0),
        max_leases: proxy.spec.max_leases(),
        cordoned: proxy.spec.cordoned,
        draining: proxy.is_draining(),
        cooldowns: figures.cooldowns.get(&id.key()).copied().unwrap_or(0),
        success_rate: outcomes.success_rate(),
        outcomes,
        age_seconds: proxy
            .metadata
            .creation_timestamp
            .as_ref()
            .and_then(|t| u64::try_from(figures.now.duration_since(t.0).as_secs()).ok()),
        exit: figures
            .exits
            .get(id)
            .map(|view| ExitRow::of(view, proxy.metadata.labels.as_ref())),
    }
}

/// The proxies page: every proxy of `inventory` the filter matches, sorted, one page of them.
pub fn proxies_view(
    inventory: &InventorySnapshot,
    filter: &ProxiesFilter,
    figures: &Figures<'_>,
) -> ProxiesView {
    let mut rows: Vec<ProxyRow> = inventory
        .entries()
        .filter(|(id, proxy)| {
            (filter.name.is_empty() || id.key().contains(&filter.name))
                && filter
                    .selector
                    .matches(&id.namespace, proxy.metadata.labels.as_ref())
        })
        .map(|(id, proxy)| proxy_row(id, proxy, figures))
        .filter(|row| filter.keeps_exit(row))
        .collect();
    rows.sort_by(|a, b| {
        let by_column = match filter.sort {
            SortKey::Name => std::cmp::Ordering::Equal,
            SortKey::Phase => a.phase.cmp(&b.phase),
            SortKey::Latency => a.latency_ms.cmp(&b.latency_ms),
            SortKey::Leases => a.active_leases.cmp(&b.active_leases),
            SortKey::Success => a
                .success_rate
                .partial_cmp(&b.success_rate)
                .unwrap_or(std::cmp::Ordering::Equal),
            SortKey::Age => a.age_seconds.cmp(&b.age_seconds),
        };
        let ordered = match filter.order {
            Order::Asc => by_column,
            Order::Desc => by_column.reverse(),
        };
        // Ties (and the name column) by name, in the order asked, so pages are stable.
        let by_name = (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name));
        ordered.then(match (filter.sort, filter.order) {
            (SortKey::Name, Order::Desc) => by_name.reverse(),
            _ => by_name,
        })
    });
    let matched = rows.len();
    let pages = matched.div_ceil(PAGE_SIZE).max(1);
    let page = usize::try_from(filter.page)
        .unwrap_or(usize::MAX)
        .min(pages);
    let proxies = rows
        .into_iter()
        .skip((page - 1) * PAGE_SIZE)
        .take(PAGE_SIZE)
        .collect();
    ProxiesView {
        total: inventory.len() as u64,
        matched: matched as u64,
        page: u32::try_from(page).unwrap_or(u32::MAX),
        pages: u32::try_from(pages).unwrap_or(u32::MAX),
        page_size: PAGE_SIZE as u32,
        proxies,
    }
}

/// The fleet view from every proxy's row (unfiltered), the ledger's counts, the gateway's and
/// the pools.
pub fn fleet_view(
    rows: &[ProxyRow],
    cooldowns: u64,
    gateway: FleetGateway,
    pools: &[PoolEntry],
    tenants: Vec<TenantRow>,
) -> FleetView {
    let mut proxies = FleetProxies {
        total: rows.len() as u64,
        ..FleetProxies::default()
    };
    let mut leases = FleetLeases {
        cooldowns,
        ..FleetLeases::default()
    };
    for row in rows {
        *proxies.by_phase.entry(row.phase.clone()).or_default() += 1;
        match row.healthy {
            Some(true) => proxies.healthy += 1,
            Some(false) => proxies.unhealthy += 1,
            None => proxies.unknown += 1,
        }
        leases.active += u64::from(row.active_leases);
        if row.healthy == Some(true) && !row.cordoned && !row.draining {
            leases.capacity += u64::from(row.max_leases);
        }
    }
    FleetView {
        proxies,
        leases,
        gateway,
        pools: pools.iter().map(pool_row).collect(),
        tenants,
    }
}

fn pool_row(pool: &PoolEntry) -> PoolRow {
    let status = &pool.status;
    PoolRow {
        pool: pool.key.clone(),
        replicas: pool.replicas,
        desired: status.desired_replicas,
        ready: status.ready_replicas,
        utilization: status.utilization,
        last_scale_time: status.last_scale_time.map(|t| t.to_string()),
        reason: status.desired_reason.clone(),
    }
}

/// The gateway's figures over [`GATEWAY_WINDOW`] from the outcomes summed over it.
pub fn gateway_figures(sessions: usize, window: &OutcomeCounts) -> FleetGateway {
    let seconds = GATEWAY_WINDOW.as_secs();
    FleetGateway {
        sessions: sessions as u64,
        requests_per_second: window.relayed() as f64 / seconds as f64,
        bans: window.banned,
        window_seconds: seconds,
    }
}

/// A proxy cooling down for a target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct CoolingProxy {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// When the cooldown ends (RFC 3339).
    pub until: String,
    /// `rate_limited` or `blocked`.
    pub result: String,
}

/// One target over the last hour.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TargetRow {
    /// The target (a host name), or `other` for targets past the bound of this replica's
    /// outcome counts.
    pub target: String,
    /// Leases acquired for it (ledger).
    pub leases: u64,
    /// Reports on it by result (ledger).
    pub reports: ReportCounts,
    /// Outcomes of requests to it (this replica's gateway and the API's reports).
    pub outcomes: OutcomeCounts,
    /// Their success rate, `null` with none.
    pub success_rate: Option<f64>,
    /// Proxies cooling down for it now, ending last first.
    pub cooling: Vec<CoolingProxy>,
}

/// Body of `GET /v1/status/targets`.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TargetsView {
    /// The window, in seconds.
    pub window_seconds: u64,
    /// Targets with leases, reports, outcomes or cooldowns, busiest first.
    pub targets: Vec<TargetRow>,
}

/// The targets view from the ledger's activity and the outcomes per target.
pub fn targets_view(activity: &Activity, outcomes: &[(String, OutcomeCounts)]) -> TargetsView {
    let mut rows: BTreeMap<&str, TargetRow> = BTreeMap::new();
    let blank = |target: &str| TargetRow {
        target: target.to_owned(),
        leases: 0,
        reports: ReportCounts::default(),
        outcomes: OutcomeCounts::default(),
        success_rate: None,
        cooling: Vec::new(),
    };
    for (target, counts) in &activity.targets {
        let row = rows.entry(target).or_insert_with(|| blank(target));
        row.leases = counts.leases;
        row.reports = counts.reports;
    }
    for (target, counts) in outcomes {
        let row = rows.entry(target).or_insert_with(|| blank(target));
        row.outcomes = *counts;
        row.success_rate = counts.success_rate();
    }
    for cooldown in &activity.cooldowns {
        let row = rows
            .entry(&cooldown.target)
            .or_insert_with(|| blank(&cooldown.target));
        row.cooling.push(cooling(cooldown));
    }
    let mut targets: Vec<TargetRow> = rows.into_values().collect();
    targets.sort_by(|a, b| {
        let busy = |r: &TargetRow| r.leases + r.reports.total() + r.outcomes.total();
        busy(b)
            .cmp(&busy(a))
            .then(b.cooling.len().cmp(&a.cooling.len()))
            .then(a.target.cmp(&b.target))
    });
    TargetsView {
        window_seconds: HOUR.as_secs(),
        targets,
    }
}

fn cooling(cooldown: &ActiveCooldown) -> CoolingProxy {
    CoolingProxy {
        namespace: cooldown.namespace.clone(),
        name: cooldown.name.clone(),
        until: jiff::Timestamp::from_millisecond(cooldown.until_ms)
            .map(|t| t.to_string())
            .unwrap_or_default(),
        result: cooldown.result.clone(),
    }
}

/// Cooldowns in force per proxy (`namespace/name`).
pub fn cooldowns_by_proxy(activity: &Activity) -> HashMap<String, u32> {
    let mut by_proxy = HashMap::new();
    for cooldown in &activity.cooldowns {
        *by_proxy
            .entry(format!("{}/{}", cooldown.namespace, cooldown.name))
            .or_default() += 1;
    }
    by_proxy
}

/// Body of `GET /v1/status/events`.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct EventsView {
    /// Newest first.
    pub events: Vec<EventEntry>,
}

/// A condition of a Proxy.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConditionRow {
    /// `Provisioned`, `Healthy`, …
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// Machine-readable reason.
    pub reason: String,
    /// Human text.
    pub message: String,
    /// When it last changed (RFC 3339).
    pub last_transition_time: String,
}

/// The last probe of a proxy.
#[derive(Debug, Clone, Default, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProbeView {
    /// Passing health checks (`null`: not probed yet).
    pub healthy: Option<bool>,
    /// Latency of the last probe, in milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<u64>,
    /// When it was last probed (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_probe: Option<String>,
    /// What the last failing probe said.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// A Kubernetes Event about a Proxy.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct KubeEventRow {
    /// `Normal` or `Warning`.
    #[serde(rename = "type")]
    pub type_: String,
    /// Machine-readable reason.
    pub reason: String,
    /// Human text.
    pub message: String,
    /// How many times it happened.
    pub count: i32,
    /// When it last happened (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_seen: Option<String>,
}

/// Body of `GET /v1/status/proxies/{namespace}/{name}`.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxyDetail {
    /// Its row of the proxies table.
    pub proxy: ProxyRow,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Its status conditions (none in standalone mode).
    pub conditions: Vec<ConditionRow>,
    /// Its last probe.
    pub probe: ProbeView,
    /// Its newest lease events, newest first.
    pub lease_events: Vec<EventEntry>,
    /// Its newest exit changes, newest first.
    pub exit_changes: Vec<ExitChange>,
    /// Its recent Kubernetes Events, newest first (operator mode; empty in standalone mode).
    pub events: Vec<KubeEventRow>,
}

/// The parts of a proxy's page the inventory and health engine give.
pub fn proxy_detail(
    proxy: &Proxy,
    row: ProxyRow,
    health: Option<&ProxyHealth>,
    lease_events: Vec<EventEntry>,
    exit_changes: Vec<ExitChange>,
    events: Vec<KubeEventRow>,
) -> ProxyDetail {
    let conditions = proxy
        .status
        .as_ref()
        .map(|s| {
            s.conditions
                .iter()
                .map(|c| ConditionRow {
                    type_: c.type_.clone(),
                    status: format!("{:?}", c.status),
                    reason: c.reason.clone(),
                    message: c.message.clone(),
                    last_transition_time: c.last_transition_time.to_string(),
                })
                .collect()
        })
        .unwrap_or_default();
    let probe = ProbeView {
        healthy: row.healthy,
        latency_ms: row.latency_ms,
        last_probe: health.and_then(|h| h.last_probe).map(|t| t.to_string()),
        last_error: health.and_then(|h| h.last_error.clone()),
    };
    ProxyDetail {
        labels: proxy.labels(),
        proxy: row,
        conditions,
        probe,
        lease_events,
        exit_changes,
        events,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::fixtures::{external, proxy_id};
    use crate::health::{LastFailure, ProbeErrorKind};
    use crate::inventory::Inventory;
    use crate::ledger::TargetCounts;

    #[test]
    fn badges_follow_the_thresholds() {
        let cases = [
            (None, Badge::None),
            (Some(1.0), Badge::Good),
            (Some(0.9), Badge::Good),
            (Some(0.899), Badge::Fair),
            (Some(0.7), Badge::Fair),
            (Some(0.699), Badge::Poor),
            (Some(0.0), Badge::Poor),
        ];
        for (rate, badge) in cases {
            assert_eq!(Badge::of(rate), badge, "{rate:?}");
        }
    }

    /// p1 .. p5: p2 and p4 in geo=us, the rest geo=eu; latency 50 - 10 × n ms; p5 unprobed;
    /// n leases on pn.
    fn fleet() -> (
        Inventory,
        HashMap<ProxyId, ProxyHealth>,
        HashMap<String, u32>,
    ) {
        let inventory = Inventory::new();
        let proxies = (1..=5).map(|n| {
            let geo = if n % 2 == 0 { "us" } else { "eu" };
            external(&format!("p{n}"), "10.0.0.1", 3128)
                .labels(&[("geo", geo)])
                .build()
        });
        inventory.replace(proxies);
        let health = (1..5)
            .map(|n| {
                let health = ProxyHealth {
                    healthy: Some(n != 3),
                    latency: Some(Duration::from_millis(50 - 10 * n)),
                    // Kept across successes: shown only while unhealthy.
                    last_failure: Some(LastFailure {
                        kind: ProbeErrorKind::UnexpectedStatus,
                        status: Some(503),
                        at: jiff::Timestamp::UNIX_EPOCH,
                    }),
                    ..ProxyHealth::default()
                };
                (proxy_id(&format!("p{n}")), health)
            })
            .collect();
        let active = (1..=5).map(|n| (format!("uid-p{n}"), n)).collect();
        (inventory, health, active)
    }

    fn names(view: &ProxiesView) -> Vec<&str> {
        view.proxies.iter().map(|r| r.name.as_str()).collect()
    }

    #[test]
    fn the_proxies_table_filters_sorts_and_pages() {
        let (inventory, health, active) = fleet();
        let snapshot = inventory.snapshot();
        let cooldowns = HashMap::from([("crawl/p2".to_owned(), 2)]);
        let outcomes = HashMap::from([(
            proxy_id("p1"),
            OutcomeCounts {
                http2xx: 9,
                banned: 1,
                ..OutcomeCounts::default()
            },
        )]);
        let lookup = |id: &ProxyId| health.get(id).cloned();
        let exit = |ip: &str, country: &str, shared: &[&str]| ExitView {
            ip: ip.parse().unwrap(),
            changed_at: Some(jiff::Timestamp::UNIX_EPOCH),
            sampled: false,
            network: crate::geoip::ExitNetwork {
                country: Some(country.to_owned()),
                asn: Some(64500),
                organization: Some("Example Net".to_owned()),
            },
            shared_with: shared.iter().map(|s| (*s).to_owned()).collect(),
            checked_at: jiff::Timestamp::UNIX_EPOCH,
            last_error: None,
        };
        let exits = HashMap::from([
            (proxy_id("p1"), exit("192.0.2.1", "DE", &["crawl/p2"])),
            (proxy_id("p2"), exit("192.0.2.1", "DE", &["crawl/p1"])),
            (proxy_id("p3"), exit("198.51.100.3", "FR", &[])),
        ]);
        let figures = Figures {
            health: &lookup,
            active: &active,
            cooldowns: &cooldowns,
            outcomes: &outcomes,
            exits: &exits,
            now: jiff::Timestamp::UNIX_EPOCH,
        };
        let query = |name: &str, label: &str, sort: Option<SortKey>, order: Option<Order>| {
            ProxiesQuery {
                name: Some(name.to_owned()),
                label: Some(label.to_owned()),
                sort,
                order,
                page: None,
                exit: None,
            }
            .check()
            .unwrap()
        };
        let by_exit = |exit: &str| {
            ProxiesQuery {
                exit: Some(exit.to_owned()),
                ..ProxiesQuery::default()
            }
            .check()
            .unwrap()
        };
        let cases: [(ProxiesFilter, Vec<&str>); 12] = [
            (by_exit("shared"), vec!["p1", "p2"]),
            (by_exit("fr"), vec!["p3"]),
            (by_exit("192.0.2."), vec!["p1", "p2"]),
            (by_exit("example"), vec!["p1", "p2", "p3"]),
            (
                query("", "", None, None),
                vec!["p1", "p2", "p3", "p4", "p5"],
            ),
            (query("p3", "", None, None), vec!["p3"]),
            (query("crawl/p", "geo=us", None, None), vec!["p2", "p4"]),
            (query("", "geo=asia", None, None), vec![]),
            (
                query("", "", Some(SortKey::Name), Some(Order::Desc)),
                vec!["p5", "p4", "p3", "p2", "p1"],
            ),
            // Unprobed (no latency) first ascending, then fastest.
            (
                query("", "", Some(SortKey::Latency), None),
                vec!["p5", "p4", "p3", "p2", "p1"],
            ),
            (
                query("", "", Some(SortKey::Leases), Some(Order::Desc)),
                vec!["p5", "p4", "p3", "p2", "p1"],
            ),
            // Ties (no outcomes) by name; the rated one last ascending.
            (
                query("", "", Some(SortKey::Success), None),
                vec!["p2", "p3", "p4", "p5", "p1"],
            ),
        ];
        for (filter, expected) in cases {
            let view = proxies_view(&snapshot, &filter, &figures);
            assert_eq!(names(&view), expected, "{filter:?}");
            assert_eq!(view.total, 5);
        }
        let all = proxies_view(&snapshot, &query("", "", None, None), &figures);
        let p1 = &all.proxies[0];
        assert_eq!(p1.success_rate, Some(0.9));
        assert_eq!((p1.active_leases, p1.latency_ms), (1, Some(40)));
        assert_eq!(all.proxies[1].cooldowns, 2);
        assert_eq!(all.proxies[2].phase, "Unhealthy");
        let failure = all.proxies[2]
            .last_failure
            .as_ref()
            .expect("why p3 is unhealthy");
        assert_eq!(
            (failure.kind, failure.status),
            (ProbeErrorKind::UnexpectedStatus, Some(503))
        );
        assert!(
            all.proxies
                .iter()
                .filter(|r| r.name != "p3")
                .all(|r| r.last_failure.is_none())
        );
        assert_eq!(all.proxies[4].healthy, None);
        assert_eq!(all.proxies[4].endpoint.as_deref(), Some("10.0.0.1:3128"));
    }

    #[test]
    fn pages_hold_a_hundred_rows_and_a_page_past_the_end_is_the_last() {
        let inventory = Inventory::new();
        inventory.replace((0..250).map(|n| external(&format!("p{n:03}"), "h", 1).build()));
        let snapshot = inventory.snapshot();
        let none = HashMap::new();
        let outcomes = HashMap::new();
        let lookup = |_: &ProxyId| None;
        let no_exits = HashMap::new();
        let figures = Figures {
            health: &lookup,
            active: &none,
            cooldowns: &none,
            outcomes: &outcomes,
            exits: &no_exits,
            now: jiff::Timestamp::UNIX_EPOCH,
        };
        for (page, first, rows) in [(1, "p000", 100), (3, "p200", 50), (9, "p200", 50)] {
            let filter = ProxiesQuery {
                page: Some(page),
                ..ProxiesQuery::default()
            }
            .check()
            .unwrap();
            let view = proxies_view(&snapshot, &filter, &figures);
            assert_eq!(view.proxies[0].name, first, "page {page}");
            assert_eq!(view.proxies.len(), rows, "page {page}");
            assert_eq!((view.pages, view.matched), (3, 250));
        }
    }

    #[test]
    fn bad_queries_are_refused() {
        let cases = [
            ProxiesQuery {
                page: Some(0),
                ..ProxiesQuery::default()
            },
            ProxiesQuery {
                page: Some(MAX_PAGE + 1),
                ..ProxiesQuery::default()
            },
            ProxiesQuery {
                name: Some("x".repeat(MAX_NAME_FILTER + 1)),
                ..ProxiesQuery::default()
            },
            ProxiesQuery {
                label: Some("=v".to_owned()),
                ..ProxiesQuery::default()
            },
        ];
        for query in cases {
            assert!(query.check().is_err(), "{query:?}");
        }
    }

    #[test]
    fn targets_merge_the_ledger_and_the_outcomes_busiest_first() {
        let mut activity = Activity::default();
        activity.targets.insert(
            "a.example".to_owned(),
            TargetCounts {
                leases: 3,
                reports: ReportCounts {
                    rate_limited: 1,
                    ..ReportCounts::default()
                },
            },
        );
        activity.cooldowns.push(ActiveCooldown {
            target: "c.example".to_owned(),
            namespace: "default".to_owned(),
            name: "p1".to_owned(),
            until_ms: 60_000,
            result: "rate_limited".to_owned(),
        });
        let outcomes = vec![(
            "b.example".to_owned(),
            OutcomeCounts {
                http2xx: 7,
                http5xx: 3,
                ..OutcomeCounts::default()
            },
        )];
        let view = targets_view(&activity, &outcomes);
        let order: Vec<&str> = view.targets.iter().map(|t| t.target.as_str()).collect();
        assert_eq!(order, ["b.example", "a.example", "c.example"]);
        assert_eq!(view.targets[0].success_rate, Some(0.7));
        assert_eq!(view.targets[1].leases, 3);
        assert_eq!(view.targets[1].success_rate, None);
        let cooling = &view.targets[2].cooling;
        assert_eq!(cooling.len(), 1);
        assert_eq!(cooling[0].until, "1970-01-01T00:01:00Z");
    }

    #[test]
    fn the_fleet_counts_phases_health_and_capacity() {
        let row = |name: &str, healthy: Option<bool>, leases: u32, cordoned: bool| ProxyRow {
            namespace: "default".to_owned(),
            name: name.to_owned(),
            mode: "External".to_owned(),
            provider: None,
            endpoint: None,
            phase: match healthy {
                Some(true) => "Ready",
                Some(false) => "Unhealthy",
                None => "Provisioning",
            }
            .to_owned(),
            healthy,
            latency_ms: None,
            last_failure: None,
            active_leases: leases,
            max_leases: 5,
            cordoned,
            draining: false,
            cooldowns: 0,
            outcomes: OutcomeCounts::default(),
            success_rate: None,
            age_seconds: None,
            exit: None,
        };
        let rows = [
            row("a", Some(true), 2, false),
            row("b", Some(true), 1, true),
            row("c", Some(false), 0, false),
            row("d", None, 0, false),
        ];
        let view = fleet_view(&rows, 4, FleetGateway::default(), &[], Vec::new());
        assert_eq!(
            (
                view.proxies.total,
                view.proxies.healthy,
                view.proxies.unhealthy,
                view.proxies.unknown
            ),
            (4, 2, 1, 1)
        );
        assert_eq!(view.proxies.by_phase["Ready"], 2);
        // Only healthy proxies that take leases count as capacity; every lease counts.
        assert_eq!(
            (
                view.leases.active,
                view.leases.capacity,
                view.leases.cooldowns
            ),
            (3, 5, 4)
        );
    }
}
