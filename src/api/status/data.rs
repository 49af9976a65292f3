//! The status page's JSON routes (`/v1/status/...`, in the OpenAPI document) and the
//! gathering both they and the pages use: each reads the process's in-memory state and at
//! most one bounded ledger read, and hands it to the pure builders of [`super::view`].
//!
//! Every view is the viewer's tenant's: the proxies (and pools) in its scope, its own leases,
//! reports and events, its gateway sessions. The default tenant (the token file's tokens)
//! sees every tenant's; the per-target success rates, counted for the whole fleet, are shown
//! to it only.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use actix_web::{HttpResponse, web};
use serde::Deserialize;
use utoipa::IntoParams;

use super::spend::{self, ChartsView, PricedProxy, SpendInputs, SpendView};
use super::view::{
    self, EventsView, Figures, FleetView, ProxiesFilter, ProxiesQuery, ProxiesView, ProxyDetail,
    TargetsView,
};
use crate::api::{ApiError, ApiState, ErrorBody};
use crate::ledger::{EventsQuery, MAX_EVENTS};
use crate::resources::pool::member_of;
use crate::resources::proxy::ProxyId;
use crate::serving::tenants::Tenant;
use crate::serving::tokens::{ApiToken, Caller};

/// Lease events a proxy's page lists.
const PROXY_EVENTS: usize = 50;

/// Exit changes a proxy's page lists.
const PROXY_EXIT_CHANGES: usize = 20;

/// Lease events the events page lists by default.
const DEFAULT_EVENTS: usize = 100;

fn ledger_error(state: &ApiState, error: crate::ledger::LedgerError) -> ApiError {
    crate::api::ledger_error(state, "status", error)
}

/// The proxies of the inventory in `tenant`'s scope.
fn in_scope(state: &ApiState, tenant: &Tenant) -> HashSet<ProxyId> {
    state
        .fleet
        .inventory
        .snapshot()
        .entries()
        .filter(|(id, proxy)| tenant.sees(id, proxy.metadata.labels.as_ref()))
        .map(|(id, _)| id.clone())
        .collect()
}

/// Every proxy's row, with the figures an hour of outcomes and the cooldowns in force give;
/// `cooldowns` per `namespace/name`.
fn figures_then<T>(
    state: &ApiState,
    cooldowns: &HashMap<String, u32>,
    build: impl FnOnce(&crate::inventory::InventorySnapshot, &Figures<'_>) -> T,
) -> T {
    let snapshot = state.fleet.inventory.snapshot();
    let active = state.fleet.ledger.counts().active_counts();
    let outcomes: HashMap<ProxyId, _> = state.fleet.outcomes.proxies().into_iter().collect();
    let health = |id: &ProxyId| state.fleet.health.get(id);
    let exits = state.fleet.exits.all();
    let figures = Figures {
        health: &health,
        active: &active,
        cooldowns,
        outcomes: &outcomes,
        exits: &exits,
        now: jiff::Timestamp::now(),
    };
    build(&snapshot, &figures)
}

/// The fleet view of `tenant`: the whole fleet, or the proxies, pools, cooldowns and gateway
/// traffic of its scope and its own sessions. `tenants`: every tenant with a token, whose
/// usage the default tenant sees (any other sees its own).
pub async fn fleet_view(
    state: &ApiState,
    tenant: &Arc<Tenant>,
    tenants: &[Arc<Tenant>],
) -> Result<FleetView, ApiError> {
    let usage = state.fleet.ledger.counts().tenant_usage();
    let visible_tenants = match tenant.sees_every_tenant() {
        true => view::tenant_rows(tenants, &usage),
        false => view::tenant_rows(std::slice::from_ref(tenant), &usage),
    };
    let no_cooldowns = HashMap::new();
    let rows = figures_then(state, &no_cooldowns, |snapshot, figures| {
        snapshot
            .entries()
            .filter(|(id, proxy)| tenant.sees(id, proxy.metadata.labels.as_ref()))
            .map(|(id, proxy)| view::proxy_row(id, proxy, figures))
            .collect::<Vec<_>>()
    });
    let minutes = i64::try_from(view::GATEWAY_WINDOW.as_secs() / 60).unwrap_or(5);
    let pools = state.fleet.pools.entries();
    if tenant.sees_everything() && tenant.sees_every_tenant() {
        let window = state.fleet.outcomes.recent(minutes, |_| true);
        let gateway = view::gateway_figures(state.fleet.sessions.len(), &window);
        let cooldowns = state.fleet.ledger.counts().cooldowns_active();
        return Ok(view::fleet_view(
            &rows,
            cooldowns,
            gateway,
            &pools,
            visible_tenants,
        ));
    }
    let visible = in_scope(state, tenant);
    let window = state
        .fleet
        .outcomes
        .recent(minutes, |id| visible.contains(id));
    let sessions = state
        .fleet
        .sessions
        .per_tenant()
        .get(&tenant.name)
        .copied()
        .unwrap_or(0);
    let gateway = view::gateway_figures(sessions, &window);
    let activity = state
        .fleet
        .ledger
        .activity(view::HOUR, tenant.history_filter())
        .await
        .map_err(|e| ledger_error(state, e))?;
    let cooldowns = activity
        .cooldowns
        .iter()
        .filter(|c| {
            visible
                .iter()
                .any(|id| id.namespace == c.namespace && id.name == c.name)
        })
        .count();
    let pools: Vec<_> = pools
        .iter()
        .filter(|pool| tenant.scope.matches(pool.namespace(), Some(&pool.labels)))
        .cloned()
        .collect();
    Ok(view::fleet_view(
        &rows,
        u64::try_from(cooldowns).unwrap_or(u64::MAX),
        gateway,
        &pools,
        visible_tenants,
    ))
}

/// The proxies view for `filter`, within `tenant`'s scope.
pub async fn proxies_view(
    state: &ApiState,
    tenant: &Tenant,
    filter: &ProxiesFilter,
) -> Result<ProxiesView, ApiError> {
    let activity = state
        .fleet
        .ledger
        .activity(view::HOUR, tenant.history_filter())
        .await
        .map_err(|e| ledger_error(state, e))?;
    let cooldowns = view::cooldowns_by_proxy(&activity);
    let filter = filter.within(tenant);
    Ok(figures_then(state, &cooldowns, |snapshot, figures| {
        view::proxies_view(snapshot, &filter, figures)
    }))
}

/// The per-target view of `tenant`: its leases and reports, and the cooldowns of the proxies
/// in its scope (the fleet's success rates per target for the default tenant only).
pub async fn targets_view(state: &ApiState, tenant: &Tenant) -> Result<TargetsView, ApiError> {
    let mut activity = state
        .fleet
        .ledger
        .activity(view::HOUR, tenant.history_filter())
        .await
        .map_err(|e| ledger_error(state, e))?;
    if !tenant.sees_everything() {
        let visible = in_scope(state, tenant);
        activity.cooldowns.retain(|c| {
            visible
                .iter()
                .any(|id| id.namespace == c.namespace && id.name == c.name)
        });
    }
    let outcomes = match tenant.sees_every_tenant() {
        true => state.fleet.outcomes.targets(),
        false => Vec::new(),
    };
    Ok(view::targets_view(&activity, &outcomes))
}

/// The newest `limit` lease events `tenant` may see.
pub async fn events_view(
    state: &ApiState,
    tenant: &Tenant,
    limit: usize,
) -> Result<EventsView, ApiError> {
    let events = state
        .fleet
        .ledger
        .events(EventsQuery {
            proxy: None,
            tenant: tenant.history_filter(),
            limit,
        })
        .await
        .map_err(|e| ledger_error(state, e))?;
    Ok(EventsView { events })
}

/// One proxy's view; `None` for a proxy the inventory does not hold, or that is outside
/// `tenant`'s scope.
pub async fn proxy_detail(
    state: &ApiState,
    tenant: &Tenant,
    namespace: &str,
    name: &str,
) -> Result<Option<ProxyDetail>, ApiError> {
    let snapshot = state.fleet.inventory.snapshot();
    let Some((id, proxy)) = snapshot
        .entries()
        .find(|(id, _)| id.namespace == namespace && id.name == name)
        .filter(|(id, proxy)| tenant.sees(id, proxy.metadata.labels.as_ref()))
        .map(|(id, proxy)| (id.clone(), proxy.clone()))
    else {
        return Ok(None);
    };
    let lease_events = state
        .fleet
        .ledger
        .events(EventsQuery {
            proxy: Some((namespace.to_owned(), name.to_owned())),
            tenant: tenant.history_filter(),
            limit: PROXY_EVENTS,
        })
        .await
        .map_err(|e| ledger_error(state, e))?;
    let activity = state
        .fleet
        .ledger
        .activity(view::HOUR, tenant.history_filter())
        .await
        .map_err(|e| ledger_error(state, e))?;
    let cooldowns = view::cooldowns_by_proxy(&activity);
    let row = figures_then(state, &cooldowns, |_, figures| {
        view::proxy_row(&id, &proxy, figures)
    });
    let exit_changes = state
        .fleet
        .ledger
        .exit_changes(
            Some((namespace.to_owned(), name.to_owned())),
            PROXY_EXIT_CHANGES,
        )
        .await
        .map_err(|e| ledger_error(state, e))?;
    let kube = state.kube_events.of(&proxy).await;
    let health = state.fleet.health.get(&id);
    Ok(Some(view::proxy_detail(
        &proxy,
        row,
        health.as_ref(),
        lease_events,
        exit_changes,
        kube,
    )))
}

/// The spend and charts `tenant` may see: its own bytes (every tenant's for `default`), the
/// proxies of its scope, the hours of those proxies for `default` only. `tenants`: every
/// tenant with a token, charted for `default`.
pub async fn spend_views(
    state: &ApiState,
    tenant: &Arc<Tenant>,
    tenants: &[Arc<Tenant>],
) -> Result<(SpendView, ChartsView), ApiError> {
    let now_ms = state.fleet.clock.now().as_millisecond();
    let mut rows = state
        .fleet
        .ledger
        .traffic(spend::window_start(now_ms))
        .await
        .map_err(|e| ledger_error(state, e))?;
    let every_tenant = tenant.sees_every_tenant();
    if !every_tenant {
        rows.retain(|row| *row.bytes.tenant == *tenant.name);
    }
    let snapshot = state.fleet.inventory.snapshot();
    let proxies: Vec<PricedProxy<'_>> = snapshot
        .entries()
        .filter(|(id, proxy)| tenant.sees(id, proxy.metadata.labels.as_ref()))
        .map(|(id, proxy)| PricedProxy {
            namespace: &id.namespace,
            name: &id.name,
            pool: member_of(proxy),
            cost: proxy.spec.cost.as_ref(),
            created_ms: proxy
                .metadata
                .creation_timestamp
                .as_ref()
                .map(|t| t.0.as_millisecond()),
        })
        .collect();
    let inputs = SpendInputs {
        now_ms,
        currency: &state.fleet.currency,
        rows: &rows,
        proxies: &proxies,
        hours: every_tenant,
    };
    let mut names: Vec<String> = match every_tenant {
        true => tenants
            .iter()
            .map(|t| t.name.to_string())
            .chain(rows.iter().map(|row| row.bytes.tenant.clone()))
            .collect(),
        false => vec![tenant.name.to_string()],
    };
    names.sort();
    names.dedup();
    let outcomes = &state.fleet.outcomes;
    let minutes: Vec<_> = names
        .into_iter()
        .map(|name| {
            let per_minute = outcomes.tenant_minutes(&name);
            (name, per_minute)
        })
        .collect();
    let minutes_from_ms = minutes
        .first()
        .map_or_else(|| spend::minutes_start(now_ms), |(_, m)| m.from_ms);
    let charts = spend::charts_view(
        &inputs,
        &minutes,
        |target| every_tenant.then(|| outcomes.target_minutes(target)),
        minutes_from_ms,
    );
    Ok((spend::spend_view(&inputs), charts))
}

/// Query of `GET /v1/status/events`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct EventsParams {
    /// How many, newest first (default 100).
    #[param(minimum = 1, maximum = 500)]
    pub limit: Option<u16>,
}

impl EventsParams {
    /// The limit asked for, or why it is refused.
    pub fn limit(&self) -> Result<usize, ApiError> {
        match self.limit.map(usize::from) {
            None => Ok(DEFAULT_EVENTS),
            Some(n) if (1..=MAX_EVENTS).contains(&n) => Ok(n),
            Some(_) => Err(ApiError::bad_request(
                "invalid_query",
                format!("`limit`: from 1 to {MAX_EVENTS}"),
            )),
        }
    }
}

/// The fleet: proxies by phase and health, leases against capacity, the gateway over the
/// last 5 minutes, the pools.
#[utoipa::path(
    get,
    path = "/v1/status/fleet",
    tag = "status",
    responses(
        (status = 200, description = "The fleet", body = FleetView),
        (status = 401, description = "`unauthorized`: no valid bearer token or session cookie", body = ErrorBody),
        (status = 503, description = "`ledger_unavailable` or `overloaded`: the ledger could not be read (a tenant's view reads its cooldowns there)", body = ErrorBody),
    ),
    security(("bearer" = []), ("session" = []))
)]
pub async fn fleet(
    state: web::Data<ApiState>,
    token: web::Data<ApiToken>,
    caller: web::ReqData<Caller>,
) -> Result<HttpResponse, ApiError> {
    let view = fleet_view(&state, &caller.tenant, &token.tenants()).await?;
    Ok(HttpResponse::Ok().json(view))
}

/// Proxies, filtered, sorted and paged, with an hour of outcomes each.
#[utoipa::path(
    get,
    path = "/v1/status/proxies",
    tag = "status",
    params(ProxiesQuery),
    responses(
        (status = 200, description = "One page of proxies", body = ProxiesView),
        (status = 400, description = "`invalid_query`: bad `name`, `label`, `sort`, `order` or `page`", body = ErrorBody),
        (status = 401, description = "`unauthorized`: no valid bearer token or session cookie", body = ErrorBody),
        (status = 503, description = "`ledger_unavailable` or `overloaded`: the ledger could not be read", body = ErrorBody),
    ),
    security(("bearer" = []), ("session" = []))
)]
pub async fn proxies(
    state: web::Data<ApiState>,
    caller: web::ReqData<Caller>,
    query: web::Query<ProxiesQuery>,
) -> Result<HttpResponse, ApiError> {
    let filter = query
        .check()
        .map_err(|e| ApiError::bad_request("invalid_query", e.to_string()))?;
    Ok(HttpResponse::Ok().json(proxies_view(&state, &caller.tenant, &filter).await?))
}

/// One proxy: its row, labels, conditions, last probe, lease events and Kubernetes Events.
#[utoipa::path(
    get,
    path = "/v1/status/proxies/{namespace}/{name}",
    tag = "status",
    params(
        ("namespace" = String, Path, description = "The Proxy's namespace"),
        ("name" = String, Path, description = "The Proxy's name"),
    ),
    responses(
        (status = 200, description = "The proxy", body = ProxyDetail),
        (status = 401, description = "`unauthorized`: no valid bearer token or session cookie", body = ErrorBody),
        (status = 404, description = "`unknown_proxy`: no such proxy", body = ErrorBody),
        (status = 503, description = "`ledger_unavailable` or `overloaded`: the ledger could not be read", body = ErrorBody),
    ),
    security(("bearer" = []), ("session" = []))
)]
pub async fn proxy(
    state: web::Data<ApiState>,
    caller: web::ReqData<Caller>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (namespace, name) = path.into_inner();
    match proxy_detail(&state, &caller.tenant, &namespace, &name).await? {
        Some(detail) => Ok(HttpResponse::Ok().json(detail)),
        None => Err(unknown_proxy(&namespace, &name)),
    }
}

/// 404 for a proxy the inventory does not hold.
pub fn unknown_proxy(namespace: &str, name: &str) -> ApiError {
    ApiError::new(
        actix_web::http::StatusCode::NOT_FOUND,
        "unknown_proxy",
        format!("no proxy {namespace}/{name}"),
    )
}

/// Targets over the last hour: leases and reports from the ledger, outcomes from this
/// replica, and the proxies cooling down for each with their end times.
#[utoipa::path(
    get,
    path = "/v1/status/targets",
    tag = "status",
    responses(
        (status = 200, description = "Targets, busiest first", body = TargetsView),
        (status = 401, description = "`unauthorized`: no valid bearer token or session cookie", body = ErrorBody),
        (status = 503, description = "`ledger_unavailable` or `overloaded`: the ledger could not be read", body = ErrorBody),
    ),
    security(("bearer" = []), ("session" = []))
)]
pub async fn targets(
    state: web::Data<ApiState>,
    caller: web::ReqData<Caller>,
) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(targets_view(&state, &caller.tenant).await?))
}

/// The newest lease events of the ledger's history.
#[utoipa::path(
    get,
    path = "/v1/status/events",
    tag = "status",
    params(EventsParams),
    responses(
        (status = 200, description = "Lease events, newest first", body = EventsView),
        (status = 400, description = "`invalid_query`: bad `limit`", body = ErrorBody),
        (status = 401, description = "`unauthorized`: no valid bearer token or session cookie", body = ErrorBody),
        (status = 503, description = "`ledger_unavailable` or `overloaded`: the ledger could not be read", body = ErrorBody),
    ),
    security(("bearer" = []), ("session" = []))
)]
pub async fn events(
    state: web::Data<ApiState>,
    caller: web::ReqData<Caller>,
    query: web::Query<EventsParams>,
) -> Result<HttpResponse, ApiError> {
    let limit = query.limit()?;
    Ok(HttpResponse::Ok().json(events_view(&state, &caller.tenant, limit).await?))
}

/// Spend per tenant, pool and proxy over the current hour and day (the viewer's tenant's own
/// bytes only, unless it is `default`).
#[utoipa::path(
    get,
    path = "/v1/status/spend",
    tag = "status",
    responses(
        (status = 200, description = "Spend over the hour and the day", body = SpendView),
        (status = 401, description = "`unauthorized`: no valid bearer token or session cookie", body = ErrorBody),
        (status = 503, description = "`ledger_unavailable` or `overloaded`: the ledger could not be read", body = ErrorBody),
    ),
    security(("bearer" = []), ("session" = []))
)]
pub async fn spend(
    state: web::Data<ApiState>,
    token: web::Data<ApiToken>,
    caller: web::ReqData<Caller>,
) -> Result<HttpResponse, ApiError> {
    let (view, _) = spend_views(&state, &caller.tenant, &token.tenants()).await?;
    Ok(HttpResponse::Ok().json(view))
}

/// Per tenant and per target: bytes and spend per hour over the last day, success rate per
/// minute over the last hour (the viewer's tenant only, unless it is `default`).
#[utoipa::path(
    get,
    path = "/v1/status/charts",
    tag = "status",
    responses(
        (status = 200, description = "The series the charts draw", body = ChartsView),
        (status = 401, description = "`unauthorized`: no valid bearer token or session cookie", body = ErrorBody),
        (status = 503, description = "`ledger_unavailable` or `overloaded`: the ledger could not be read", body = ErrorBody),
    ),
    security(("bearer" = []), ("session" = []))
)]
pub async fn charts(
    state: web::Data<ApiState>,
    token: web::Data<ApiToken>,
    caller: web::ReqData<Caller>,
) -> Result<HttpResponse, ApiError> {
    let (_, charts) = spend_views(&state, &caller.tenant, &token.tenants()).await?;
    Ok(HttpResponse::Ok().json(charts))
}
