//! The route handlers. Each one reads the inventory and health snapshot, hands writes and
//! lease reads to the ledger (awaiting its answer), and maps the outcome to the API's JSON
//! shapes.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::http::header::{self, ContentType, HeaderValue};
use actix_web::{HttpResponse, ResponseError, web};

use super::body::{ApiJson, OptionalApiJson};
use super::error::{ApiError, ErrorBody, NoMatchBody, PoolWakingBody, QuotaExceededBody};
use super::idempotency::{fingerprint, parse_request_id};
use super::list::{Dynamic, ListBody, address};
use super::state::ApiState;
use super::types::{
    AcquireRequest, LeaseProxy, LeaseView, ListQuery, ProxyList, RenewRequest, ReportRequest,
    StatusBody, parse_target,
};
use crate::credentials::Credentials;
use crate::ledger::{
    AcquireOutcome, Lease, LeaseReport, LeaseState, LedgerError, ReportResult, RequestKey,
};
use crate::resources::proxy::{Proxy, proxy_url};
use crate::serving::candidates::Selector;
use crate::serving::fleet::{Acquire, lease_exit};
use crate::serving::outcomes::Outcome;
use crate::serving::pools::Waking;
use crate::serving::sessions::SessionKey;
use crate::serving::tenants::Tenant;
use crate::serving::tokens::Caller;

/// The answer to a ledger error every write can meet. The write calls are awaited to the
/// end: the writer answers every write it has queued (with its result, or `Overloaded` when
/// the write's deadline passed before its turn), so a lease it committed always reaches the
/// client that asked for it. A full ledger recorded nothing of the write: 503 like an
/// overload, so clients back off and retry instead of giving up.
pub(crate) fn ledger_error(
    state: &ApiState,
    context: &'static str,
    error: LedgerError,
) -> ApiError {
    match error {
        LedgerError::Overloaded { retry_after } => {
            state.metrics.write_overloaded();
            ApiError::overloaded(retry_after)
        }
        LedgerError::Full { retry_after } => {
            state.metrics.write_refused_full();
            ApiError::ledger_full(retry_after)
        }
        LedgerError::Unavailable {
            retry_after,
            reason,
        } => {
            log::warn!("{context}: {reason}");
            state.metrics.write_unavailable();
            ApiError::ledger_unavailable(retry_after)
        }
        LedgerError::RequestIdReused { request_id } => ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "request_id_reused",
            format!(
                "requestID {request_id:?} was used for an acquire with a different selector, \
                 target or ttlSeconds; use a new requestID for a new acquire"
            ),
        ),
        LedgerError::UnknownLease(id) => ApiError::unknown_lease(&id),
        LedgerError::NotActive { id, state: s } => ApiError::new(
            StatusCode::CONFLICT,
            "lease_not_active",
            format!("lease {id:?} is {s}; acquire a new one"),
        ),
        other => ApiError::internal(context, other),
    }
}

/// The requested TTL (the body's reader has checked its range), or the server's default.
fn ttl(state: &ApiState, ttl_seconds: Option<u64>) -> Duration {
    ttl_seconds.map_or(state.default_ttl, Duration::from_secs)
}

/// The answer to an acquire of `lease` with `selector`: a rotating upstream's credentials are
/// spelled from it; when they cannot be, the lease goes back and the answer is 400.
async fn acquired_view(
    state: &ApiState,
    lease: &Lease,
    selector: &BTreeMap<String, String>,
    tenant: &str,
) -> Result<LeaseView, ApiError> {
    let snapshot = state.fleet.inventory.snapshot();
    let object = snapshot.get(&lease.proxy).map(|proxy| &**proxy);
    let credentials = object
        .filter(|_| state.lease_credentials)
        .map(|proxy| {
            let exit = lease_exit(proxy, &lease.proxy, &lease.id);
            state
                .fleet
                .upstream_credentials(proxy, exit.as_deref(), selector)
        })
        .transpose();
    match credentials {
        Ok(credentials) => Ok(lease_view(lease, object, credentials.flatten())),
        Err(unspellable) => {
            if let Err(e) = state.fleet.ledger.release(&lease.id, tenant).await {
                log::warn!(
                    "api: giving back lease {} failed (it expires by itself): {e}",
                    lease.id
                );
            }
            Err(ApiError::bad_request(
                "vendor_username",
                unspellable.to_string(),
            ))
        }
    }
}

/// The answer of a renew or a read of `lease`: a rotating upstream's credentials are spelled
/// from the acquire's selector, which only the acquire's answer carries.
fn stored_view(state: &ApiState, lease: &Lease) -> LeaseView {
    let snapshot = state.fleet.inventory.snapshot();
    let object = snapshot.get(&lease.proxy).map(|proxy| &**proxy);
    let credentials = object
        .filter(|proxy| state.lease_credentials && proxy.spec.rotating().is_none())
        .and_then(|proxy| state.fleet.credentials.for_proxy(proxy));
    lease_view(lease, object, credentials)
}

/// `lease` as an answer: where its proxy (`object`, as the inventory has it) is, with
/// `credentials` to reach it.
fn lease_view(
    lease: &Lease,
    object: Option<&Proxy>,
    credentials: Option<Credentials>,
) -> LeaseView {
    let address = object.and_then(|p| address(p));
    let (username, password) = credentials.map(|c| (c.username, c.password)).unzip();
    LeaseView {
        lease_id: lease.id.clone(),
        proxy: LeaseProxy {
            name: lease.proxy.name.clone(),
            namespace: lease.proxy.namespace.clone(),
            url: object
                .zip(address)
                .map(|(proxy, (h, p))| proxy_url(proxy.spec.protocol(), h, p)),
            host: address.map(|(h, _)| h.to_owned()),
            port: address.map(|(_, p)| p),
            username,
            password,
        },
        target: lease.target.clone(),
        state: lease.state.as_str().to_owned(),
        acquired_at: lease.acquired_at.to_string(),
        expires_at: lease.expires_at.to_string(),
        ttl_seconds: lease.ttl.as_secs(),
        released_at: lease.released_at.map(|t| t.to_string()),
    }
}

/// The 503 of a ledger write other than acquire.
const WRITE_UNAVAILABLE: &str = "`overloaded` (the ledger could not take the write in time), \
     `ledger_full` (the ledger's disk or file is full) or `ledger_unavailable` (its database \
     cannot be reached): nothing was written. Retry after `Retry-After` seconds";

/// Lists the proxies in the caller's scope, optionally only healthy (or unhealthy) ones
/// matching a selector.
#[utoipa::path(
    get,
    path = "/v1/proxies",
    params(ListQuery),
    responses(
        (status = 200, description = "Matching proxies (possibly none)", body = ProxyList),
        (status = 400, description = "`invalid_query`: bad `healthy` or `selector`", body = ErrorBody),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn list_proxies(
    state: web::Data<ApiState>,
    caller: web::ReqData<Caller>,
    query: web::Query<ListQuery>,
) -> Result<HttpResponse, ApiError> {
    let healthy_filter = match query.healthy.as_deref() {
        None | Some("") => None,
        Some("true") => Some(true),
        Some("false") => Some(false),
        Some(other) => {
            return Err(ApiError::bad_request(
                "invalid_query",
                format!("`healthy` must be true or false, not {other:?}"),
            ));
        }
    };
    let selector = Selector::parse(query.selector.as_deref().unwrap_or_default())
        .map_err(|e| ApiError::bad_request("invalid_query", format!("`selector`: {e}")))?;
    let selector = caller.tenant.narrow(&selector);
    let counts = state.fleet.ledger.counts().active_counts();
    let snapshot = state.fleet.inventory.snapshot();
    let fragments = state.proxy_list.fragments(&snapshot);
    let positions = state.fleet.candidates.matching(&snapshot, &selector);
    let leasable = snapshot.leasable();
    let health = state
        .fleet
        .candidates
        .health(&snapshot, &state.fleet.health);
    let mut body = ListBody::default();
    for &position in positions.iter() {
        let Ok(position) = usize::try_from(position) else {
            continue;
        };
        let Some(proxy) = leasable.get(position) else {
            continue;
        };
        let active_leases = counts.get(&proxy.id.uid).copied().unwrap_or(0);
        let dynamic = Dynamic::new(health.at(position), active_leases);
        if healthy_filter.is_some_and(|want| want != dynamic.healthy) {
            continue;
        }
        body.push(&fragments, position, dynamic);
    }
    drop(health);
    Ok(HttpResponse::Ok()
        .content_type(ContentType::json())
        .body(body.finish()))
}

/// Leases the least-loaded healthy proxy in the caller's scope matching the selector.
#[utoipa::path(
    post,
    path = "/v1/leases",
    request_body(content = Option<AcquireRequest>, description = "Every field is optional; an empty body is read as `{}`"),
    responses(
        (status = 200, description = "Replay: an earlier acquire with the same `requestID` (and the same selector, target and `ttlSeconds`) was granted this lease; it is returned as it is now, even if released or expired", body = LeaseView),
        (status = 201, description = "Lease granted", body = LeaseView),
        (status = 400, description = "`invalid_body` (the message names the field), `invalid_target`, or `vendor_username`: the lease fell on a rotating upstream whose username template needs a field the selector gives unsafely or nobody gives (the lease was given back)", body = ErrorBody),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 409, description = "`no_match`: no proxy can take a lease", body = NoMatchBody,
            headers(("Retry-After" = u64, description = "Seconds until a lease expiry or a cooldown end frees a proxy by itself; absent when nothing will"))),
        (status = 413, description = "Body over 64 KiB", body = ErrorBody),
        (status = 415, description = "Body is not JSON", body = ErrorBody),
        (status = 422, description = "`request_id_reused`: the `requestID` was used for an acquire with a different selector, target or `ttlSeconds`", body = ErrorBody),
        (status = 429, description = "`quota_exceeded`: the caller's tenant is at one of its quotas (`--tenants-file`); nothing was looked at", body = QuotaExceededBody,
            headers(("Retry-After" = u64, description = "Seconds until the quota lets an acquire through by itself, at least 1"))),
        (status = 503, description = "`overloaded` (the ledger could not take the write in time), `ledger_full` (the ledger's disk or file is full) or `ledger_unavailable` (its database cannot be reached): nothing was granted. Retry after `Retry-After` seconds (with the same `requestID`, if any). Or `pool_waking` (body `PoolWakingBody`): the selector matches a ProxyPool with no Ready member yet, which was asked for one; retry after `Retry-After` for up to `wakeTimeoutSeconds`", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds to wait before retrying, at least 1"))),
    ),
    security(("bearer" = []))
)]
pub async fn acquire(
    state: web::Data<ApiState>,
    caller: web::ReqData<Caller>,
    body: OptionalApiJson<AcquireRequest>,
) -> Result<HttpResponse, ApiError> {
    let request = body.0;
    let request_id = parse_request_id(request.request_id)?;
    let target = parse_target(request.target)?;
    let ttl = ttl(&state, request.ttl_seconds);
    let key = request_id.map(|id| RequestKey {
        fingerprint: fingerprint(&request.selector, target.as_deref(), request.ttl_seconds),
        id,
    });
    let request_id = key.as_ref().map(|k| k.id.clone());
    let pairs = request.selector.clone();
    let selector = Selector::from(request.selector);
    let outcome = state
        .fleet
        .acquire(Acquire {
            tenant: &caller.tenant,
            selector: selector.clone(),
            excluding: &HashSet::new(),
            target,
            ttl,
            request: key,
            client: None,
            session: None,
            fallback_step: None,
        })
        .await
        .map_err(|e| ledger_error(&state, "acquiring a lease", e))?;
    match outcome {
        AcquireOutcome::Granted(lease) => {
            let view = acquired_view(&state, &lease, &pairs, caller.tenant_name()).await?;
            state.metrics.lease_granted();
            Ok(HttpResponse::Created().json(view))
        }
        AcquireOutcome::Replayed(lease) => {
            let view = acquired_view(&state, &lease, &pairs, caller.tenant_name()).await?;
            state.metrics.lease_replayed();
            Ok(HttpResponse::Ok().json(view))
        }
        AcquireOutcome::QuotaExceeded(refused) => {
            state.metrics.quota_refused(&refused);
            Err(ApiError::QuotaExceeded(QuotaExceededBody::of(&refused)))
        }
        AcquireOutcome::NoMatch(no_match) => {
            state
                .metrics
                .lease_rejected(caller.tenant_name(), &no_match);
            let waking = state
                .fleet
                .pools
                .refused(
                    state.fleet.ledger.as_ref(),
                    &caller.tenant.narrow(&selector),
                    &no_match,
                    request_id.as_deref(),
                )
                .await;
            Err(match waking {
                Some(waking) => pool_waking(waking),
                None => ApiError::NoMatch(NoMatchBody::of(&no_match, state.fleet.clock.now())),
            })
        }
    }
}

/// The 503 for an acquire that waits for waking pools.
fn pool_waking(waking: Waking) -> ApiError {
    ApiError::PoolWaking(PoolWakingBody {
        error: "pool_waking".into(),
        message: format!(
            "no member of pool {} is Ready yet; it was asked for one: retry after Retry-After, \
             for up to {} s",
            waking.pools.join(", "),
            waking.wake_timeout.as_secs()
        ),
        pools: waking.pools,
        wake_timeout_seconds: waking.wake_timeout.as_secs().max(1),
    })
}

/// Reads a lease.
#[utoipa::path(
    get,
    path = "/v1/leases/{id}",
    params(("id" = String, Path, description = "Lease ID")),
    responses(
        (status = 200, description = "The lease", body = LeaseView),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 404, description = "`unknown_lease`", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn get_lease(
    state: web::Data<ApiState>,
    caller: web::ReqData<Caller>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let lease = state
        .fleet
        .ledger
        .get(&id, caller.tenant_name())
        .await
        .map_err(|e| ApiError::internal("reading a lease", e))?
        .ok_or_else(|| ApiError::unknown_lease(&id))?;
    Ok(HttpResponse::Ok().json(stored_view(&state, &lease)))
}

/// Gives a lease back. Always 204: releasing twice, or an unknown lease, is not an error.
#[utoipa::path(
    delete,
    path = "/v1/leases/{id}",
    params(("id" = String, Path, description = "Lease ID")),
    responses(
        (status = 204, description = "Released (or already gone)"),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 503, description = WRITE_UNAVAILABLE, body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds to wait before retrying, at least 1"))),
    ),
    security(("bearer" = []))
)]
pub async fn release(
    state: web::Data<ApiState>,
    caller: web::ReqData<Caller>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    state
        .fleet
        .ledger
        .release(&id, caller.tenant_name())
        .await
        .map_err(|e| ledger_error(&state, "releasing a lease", e))?;
    Ok(HttpResponse::NoContent().finish())
}

/// Extends an active lease (sticky sessions).
#[utoipa::path(
    post,
    path = "/v1/leases/{id}/renew",
    params(("id" = String, Path, description = "Lease ID")),
    request_body(content = Option<RenewRequest>, description = "Every field is optional; an empty body is read as `{}`"),
    responses(
        (status = 200, description = "Renewed", body = LeaseView),
        (status = 400, description = "`invalid_body`: malformed body (the message names the field)", body = ErrorBody),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 404, description = "`unknown_lease`", body = ErrorBody),
        (status = 409, description = "`lease_not_active`: the lease was released or has expired; `proxy_draining`: the lease's proxy is draining (being deleted, or its machine about to be replaced) and its leases are not extended; or `proxy_out_of_scope`: the proxy left the caller's tenant's scope since the lease was taken. Either way, release it and acquire another proxy", body = ErrorBody),
        (status = 413, description = "Body over 64 KiB", body = ErrorBody),
        (status = 415, description = "Body is not JSON", body = ErrorBody),
        (status = 503, description = WRITE_UNAVAILABLE, body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds to wait before retrying, at least 1"))),
    ),
    security(("bearer" = []))
)]
pub async fn renew(
    state: web::Data<ApiState>,
    caller: web::ReqData<Caller>,
    id: web::Path<String>,
    body: OptionalApiJson<RenewRequest>,
) -> Result<HttpResponse, ApiError> {
    let ttl = ttl(&state, body.0.ttl_seconds);
    refuse_renewal(&state, &id, &caller.tenant).await?;
    let lease = state
        .fleet
        .ledger
        .renew(&id, caller.tenant_name(), ttl)
        .await
        .map_err(|e| ledger_error(&state, "renewing a lease", e))?;
    Ok(HttpResponse::Ok().json(stored_view(&state, &lease)))
}

/// 409 when `tenant`'s lease `id` is active but its proxy takes no renewal: `proxy_draining`
/// when it drains in the current inventory, `proxy_out_of_scope` when it left the tenant's
/// scope (the tenants file changed). The lease is looked up (a blocking read) only when a
/// proxy drains or the tenant has a scope: otherwise a renew costs what it did. An unknown or
/// inactive lease passes, so the renew gives its usual answer (404 `unknown_lease`, 409
/// `lease_not_active`); so does a lease whose proxy has left the inventory.
async fn refuse_renewal(state: &ApiState, id: &str, tenant: &Tenant) -> Result<(), ApiError> {
    let scoped = !tenant.sees_everything();
    if !scoped && !state.fleet.inventory.snapshot().any_draining() {
        return Ok(());
    }
    let Some(lease) = state
        .fleet
        .ledger
        .get(id, &tenant.name)
        .await
        .map_err(|e| ApiError::internal("renewing a lease", e))?
    else {
        return Ok(());
    };
    if lease.state != LeaseState::Active {
        return Ok(());
    }
    // The inventory as it is after the read, not before it.
    let snapshot = state.fleet.inventory.snapshot();
    let Some(proxy) = snapshot.get(&lease.proxy) else {
        return Ok(());
    };
    if scoped && !tenant.sees(&lease.proxy, proxy.metadata.labels.as_ref()) {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "proxy_out_of_scope",
            format!(
                "proxy {}/{} is no longer in tenant {}'s scope, so lease {id} cannot be \
                 renewed: release it (DELETE /v1/leases/{id}) and acquire another proxy",
                lease.proxy.namespace, lease.proxy.name, tenant.name
            ),
        ));
    }
    if !snapshot.is_draining(&lease.proxy) {
        return Ok(());
    }
    Err(ApiError::new(
        StatusCode::CONFLICT,
        "proxy_draining",
        format!(
            "proxy {}/{} is draining (its Proxy is being deleted or its machine replaced), so \
             lease {id} cannot be renewed: release it (DELETE /v1/leases/{id}) and acquire \
             another proxy (POST /v1/leases); the lease ends at {} at the latest",
            lease.proxy.namespace, lease.proxy.name, lease.expires_at
        ),
    ))
}

/// Records what the crawler saw through the lease's proxy.
#[utoipa::path(
    post,
    path = "/v1/leases/{id}/report",
    params(("id" = String, Path, description = "Lease ID")),
    request_body = ReportRequest,
    responses(
        (status = 204, description = "Recorded"),
        (status = 400, description = "`unknown_result`, `invalid_target` or `invalid_body` (malformed body; the message names the field)", body = ErrorBody),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 404, description = "`unknown_lease`", body = ErrorBody),
        (status = 413, description = "Body over 64 KiB", body = ErrorBody),
        (status = 415, description = "Body is not JSON", body = ErrorBody),
        (status = 503, description = WRITE_UNAVAILABLE, body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds to wait before retrying, at least 1"))),
    ),
    security(("bearer" = []))
)]
pub async fn report(
    state: web::Data<ApiState>,
    caller: web::ReqData<Caller>,
    id: web::Path<String>,
    body: ApiJson<ReportRequest>,
) -> Result<HttpResponse, ApiError> {
    let report = lease_report(body.0)?;
    record_report(&state, &id.into_inner(), caller.tenant_name(), report).await
}

/// The report a request body asks for.
fn lease_report(request: ReportRequest) -> Result<LeaseReport, ApiError> {
    let result: ReportResult = request.result.parse().map_err(|_| {
        let allowed: Vec<&str> = ReportResult::ALL.iter().map(|r| r.as_str()).collect();
        ApiError::bad_request(
            "unknown_result",
            format!(
                "`result` {:?} is not one of {}",
                request.result,
                allowed.join(", ")
            ),
        )
    })?;
    Ok(LeaseReport {
        result,
        target: parse_target(request.target)?,
        cooldown: request.retry_after_seconds.map(Duration::from_secs),
        exit: None,
    })
}

/// Records `report` on `tenant`'s lease `id`, and counts it for the lease's proxy and the
/// target it is about (the lease's own when it names none): 204.
async fn record_report(
    state: &ApiState,
    id: &str,
    tenant: &str,
    mut report: LeaseReport,
) -> Result<HttpResponse, ApiError> {
    report.exit = state.fleet.exit_of_lease(id, tenant).await;
    let result = report.result;
    let target = report.target.clone();
    let lease = state
        .fleet
        .ledger
        .report(id, tenant, report)
        .await
        .map_err(|e| ledger_error(state, "recording a report", e))?;
    state.metrics.report_received(result);
    state.fleet.outcomes.record(
        tenant,
        &lease.proxy,
        target.or(lease.target).as_deref(),
        Outcome::Reported(result),
    );
    Ok(HttpResponse::NoContent().finish())
}

/// Records what the crawler saw through the proxy of one of its gateway sessions (the
/// session of this bearer token with that name): inside a TLS tunnel only the crawler sees
/// the target's answers. A ban moves the session off the proxy for that target on its next
/// request.
#[utoipa::path(
    post,
    path = "/v1/sessions/{name}/report",
    params(("name" = String, Path, description = "Session name, as in the gateway's proxy URL (`session=`)")),
    request_body = ReportRequest,
    responses(
        (status = 204, description = "Recorded"),
        (status = 400, description = "`unknown_result`, `invalid_target` or `invalid_body` (malformed body; the message names the field)", body = ErrorBody),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 404, description = "`unknown_session`: this token has no gateway session of that name (never opened, idle past its sessionTTL, or opened on another replica)", body = ErrorBody),
        (status = 413, description = "Body over 64 KiB", body = ErrorBody),
        (status = 415, description = "Body is not JSON", body = ErrorBody),
        (status = 503, description = WRITE_UNAVAILABLE, body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds to wait before retrying, at least 1"))),
    ),
    security(("bearer" = []))
)]
pub async fn report_session(
    state: web::Data<ApiState>,
    name: web::Path<String>,
    caller: web::ReqData<Caller>,
    body: ApiJson<ReportRequest>,
) -> Result<HttpResponse, ApiError> {
    let name = name.into_inner();
    let report = lease_report(body.0)?;
    let session = state
        .fleet
        .sessions
        .find(&caller.token, &name)
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "unknown_session",
                format!(
                    "this token has no gateway session {name:?} (never opened, idle past its \
                     sessionTTL, or served by another replica)"
                ),
            )
        })?;
    record_report(&state, &session.lease_id, caller.tenant_name(), report).await
}

/// Ends one of this token's gateway sessions: its lease is given back and the name starts a
/// new session on its next use. Always 204, like a release: ending a session that is already
/// gone is not an error. A tunnel still open in it runs on until it closes.
#[utoipa::path(
    delete,
    path = "/v1/sessions/{name}",
    params(("name" = String, Path, description = "Session name, as in the gateway's proxy URL (`session=`)")),
    responses(
        (status = 204, description = "Ended (or already gone)"),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 503, description = WRITE_UNAVAILABLE, body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds to wait before retrying, at least 1"))),
    ),
    security(("bearer" = []))
)]
pub async fn end_session(
    state: web::Data<ApiState>,
    name: web::Path<String>,
    caller: web::ReqData<Caller>,
) -> Result<HttpResponse, ApiError> {
    let key = SessionKey {
        token: caller.token.clone(),
        name: name.into_inner(),
    };
    if let Some(session) = state.fleet.sessions.get(&key) {
        state
            .fleet
            .ledger
            .release(&session.lease_id, caller.tenant_name())
            .await
            .map_err(|e| ledger_error(&state, "ending a session", e))?;
        state.fleet.sessions.remove(&key, &session.lease_id);
    }
    Ok(HttpResponse::NoContent().finish())
}

/// Liveness: the process is serving.
#[utoipa::path(
    get,
    path = "/healthz",
    responses((status = 200, description = "Serving", body = StatusBody))
)]
pub async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(StatusBody {
        status: "ok".into(),
        database: None,
        database_error: None,
    })
}

/// Readiness: the inventory has synced, and an SQLite ledger's writer runs and its file
/// answers reads. A PostgreSQL ledger keeps the replica ready while its database is down (the
/// body says `"database": "down"`): every replica shares it, so none would be better.
#[utoipa::path(
    get,
    path = "/readyz",
    responses(
        (status = 200, description = "Ready", body = StatusBody),
        (status = 503, description = "Not ready yet", body = ErrorBody),
    )
)]
pub async fn readyz(state: web::Data<ApiState>) -> Result<HttpResponse, ApiError> {
    let not_ready =
        |message: String| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "not_ready", message);
    if !state.fleet.inventory.snapshot().is_synced() {
        return Err(not_ready("the proxy inventory has not synced yet".into()));
    }
    state
        .fleet
        .ledger
        .check()
        .await
        .map_err(|e| not_ready(format!("the ledger does not answer: {e}")))?;
    let database = state.fleet.ledger.database();
    Ok(HttpResponse::Ok().json(StatusBody {
        status: "ready".into(),
        database: database
            .as_ref()
            .map(|d| if d.up { "up" } else { "down" }.to_owned()),
        database_error: database.and_then(|d| d.error),
    }))
}

/// Every request that matches no route.
pub(crate) async fn not_found() -> Result<HttpResponse, ApiError> {
    Err(ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        "no such route",
    ))
}

/// A known route called with a method it does not have: 405 with the `Allow` header RFC 9110
/// requires, naming the methods the route does have (`allow`, e.g. `GET, DELETE`).
pub async fn method_not_allowed(allow: &'static str) -> HttpResponse {
    let mut response = ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("this route accepts {allow} only"),
    )
    .error_response();
    response
        .headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static(allow));
    response
}
