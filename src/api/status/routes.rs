//! The status page's HTML routes, its sign-in and sign-out, its assets, and who may see it:
//! a session cookie (or, for the JSON routes, a bearer token as well), every page with a
//! strict Content-Security-Policy.

use actix_web::body::BoxBody;
use actix_web::cookie::{Cookie, SameSite};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::http::header::{self, HeaderValue};
use actix_web::middleware::Next;
use actix_web::{
    Error, HttpMessage, HttpRequest, HttpResponse, HttpResponseBuilder, ResponseError, web,
};
use maud::Markup;
use serde::Deserialize;

use super::data;
use super::pages::{self, Access};
use super::session;
use super::view::ProxiesQuery;
use crate::api::{ApiError, ApiState};
use crate::serving::tokens::ApiToken;
use crate::serving::tokens::Caller;

/// What every page and asset is served with: only this origin's own script, style and data,
/// no framing, no referrer to other sites (the same-origin one keeps `Origin` on the sign-in form), nothing cached.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; img-src 'self'; connect-src 'self'; form-action 'self'; \
     frame-ancestors 'none'; base-uri 'none'";

const STATUS_JS: &str = include_str!("assets/status.js");
const STATUS_CSS: &str = include_str!("assets/status.css");
const FAVICON: &str = include_str!("assets/favicon.svg");

fn now_ms(state: &ApiState) -> i64 {
    state.fleet.clock.now().as_millisecond()
}

/// Who is looking at the page: how they got in, and the caller (a token's identity and its
/// tenant) whose scope the page shows.
struct Viewer {
    access: Access,
    caller: Caller,
}

/// How this request may see the page: signed in by cookie, open (`--insecure-no-auth`), or
/// not at all. `bearer` also accepts an `Authorization: Bearer` token (the JSON routes).
fn access(req: &HttpRequest, token: &ApiToken, now_ms: i64, bearer: bool) -> Option<Viewer> {
    let authorization = req
        .headers()
        .get(header::AUTHORIZATION)
        .map(|h| h.as_bytes());
    if !token.is_required() {
        let caller = token.bearer(authorization)?;
        return Some(Viewer {
            access: Access::Open,
            caller,
        });
    }
    if bearer && let Some(caller) = token.bearer(authorization) {
        return Some(Viewer {
            access: Access::SignedIn,
            caller,
        });
    }
    let cookie = req.cookie(session::COOKIE)?;
    let id = session::open(token, cookie.value(), now_ms)?;
    Some(Viewer {
        access: Access::SignedIn,
        caller: token.caller(&id)?,
    })
}

/// Middleware of the JSON routes: a bearer token or a session cookie, else 401; the caller
/// goes with the request, so the data is its tenant's. Only these read-only routes take the
/// cookie; every other `/v1` route takes only a bearer token.
pub async fn require_viewer(
    req: ServiceRequest,
    next: Next<BoxBody>,
) -> Result<ServiceResponse<BoxBody>, Error> {
    let viewer = match (
        req.app_data::<web::Data<ApiToken>>(),
        req.app_data::<web::Data<ApiState>>(),
    ) {
        (Some(token), Some(state)) => access(req.request(), token, now_ms(state), true),
        // Not wired: fail closed.
        _ => None,
    };
    if let Some(viewer) = viewer {
        req.extensions_mut().insert(viewer.caller);
        return next.call(req).await;
    }
    let mut response = ApiError::new(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "missing or wrong bearer token or session cookie: send `Authorization: Bearer <token>`, \
         or sign in on the status page",
    )
    .error_response();
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    Ok(req.into_response(response))
}

/// The headers every page response carries.
fn secured(mut builder: HttpResponseBuilder) -> HttpResponseBuilder {
    builder
        .insert_header((header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY))
        .insert_header((header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
        .insert_header((header::X_FRAME_OPTIONS, "DENY"))
        .insert_header((header::REFERRER_POLICY, "same-origin"))
        .insert_header((header::CACHE_CONTROL, "no-store"));
    builder
}

fn page(status: StatusCode, markup: Markup) -> HttpResponse {
    secured(HttpResponse::build(status))
        .content_type("text/html; charset=utf-8")
        .body(markup.into_string())
}

fn redirect(to: &str) -> HttpResponseBuilder {
    let mut builder = secured(HttpResponse::SeeOther());
    builder.insert_header((header::LOCATION, to.to_owned()));
    builder
}

/// A page's answer when its data could not be read: the error, on a page.
fn failed(error: &ApiError, access: Access) -> HttpResponse {
    let status = error.status_code();
    page(
        status,
        pages::problem("Cannot show this page", &error.to_string(), access),
    )
}

/// The page of a view that could be gathered, or its error on a page.
fn shown<V>(
    view: Result<V, ApiError>,
    access: Access,
    render: impl FnOnce(&V, Access) -> Markup,
) -> HttpResponse {
    match view {
        Ok(view) => page(StatusCode::OK, render(&view, access)),
        Err(e) => failed(&e, access),
    }
}

/// Who may see a page (`None`: send them to [`to_sign_in`]).
fn viewer(req: &HttpRequest, state: &ApiState, token: &ApiToken) -> Option<Viewer> {
    access(req, token, now_ms(state), false)
}

/// The answer to a viewer who may not see a page: the sign-in form.
fn to_sign_in() -> HttpResponse {
    redirect("/signin").finish()
}

/// `GET /`: the fleet.
pub async fn fleet(
    req: HttpRequest,
    state: web::Data<ApiState>,
    token: web::Data<ApiToken>,
) -> HttpResponse {
    let Some(Viewer { access, caller }) = viewer(&req, &state, &token) else {
        return to_sign_in();
    };
    let view = data::fleet_view(&state, &caller.tenant, &token.tenants()).await;
    shown(view, access, pages::fleet)
}

/// `GET /proxies`: the proxies table.
pub async fn proxies(
    req: HttpRequest,
    state: web::Data<ApiState>,
    token: web::Data<ApiToken>,
) -> HttpResponse {
    let Some(Viewer { access, caller }) = viewer(&req, &state, &token) else {
        return to_sign_in();
    };
    let query = web::Query::<ProxiesQuery>::from_query(req.query_string())
        .map_err(|e| ApiError::bad_request("invalid_query", e.to_string()))
        .and_then(|q| {
            q.check()
                .map_err(|e| ApiError::bad_request("invalid_query", e.to_string()))
        });
    let filter = match query {
        Ok(filter) => filter,
        Err(e) => return failed(&e, access),
    };
    let view = data::proxies_view(&state, &caller.tenant, &filter).await;
    shown(view, access, |view, access| {
        pages::proxies(view, &filter, access)
    })
}

/// `GET /proxies/{namespace}/{name}`: one proxy.
pub async fn proxy(
    req: HttpRequest,
    state: web::Data<ApiState>,
    token: web::Data<ApiToken>,
    path: web::Path<(String, String)>,
) -> HttpResponse {
    let (namespace, name) = path.into_inner();
    let Some(Viewer { access, caller }) = viewer(&req, &state, &token) else {
        return to_sign_in();
    };
    let view = data::proxy_detail(&state, &caller.tenant, &namespace, &name)
        .await
        .and_then(|found| found.ok_or_else(|| data::unknown_proxy(&namespace, &name)));
    shown(view, access, pages::proxy)
}

/// `GET /targets`: per target over the last hour.
pub async fn targets(
    req: HttpRequest,
    state: web::Data<ApiState>,
    token: web::Data<ApiToken>,
) -> HttpResponse {
    let Some(Viewer { access, caller }) = viewer(&req, &state, &token) else {
        return to_sign_in();
    };
    shown(
        data::targets_view(&state, &caller.tenant).await,
        access,
        pages::targets,
    )
}

/// `GET /events`: the newest lease events.
pub async fn events(
    req: HttpRequest,
    state: web::Data<ApiState>,
    token: web::Data<ApiToken>,
) -> HttpResponse {
    let Some(Viewer { access, caller }) = viewer(&req, &state, &token) else {
        return to_sign_in();
    };
    shown(
        data::events_view(&state, &caller.tenant, 100).await,
        access,
        pages::events,
    )
}

/// `GET /spend`: spend and charts.
pub async fn spend(
    req: HttpRequest,
    state: web::Data<ApiState>,
    token: web::Data<ApiToken>,
) -> HttpResponse {
    let Some(Viewer { access, caller }) = viewer(&req, &state, &token) else {
        return to_sign_in();
    };
    shown(
        data::spend_views(&state, &caller.tenant, &token.tenants()).await,
        access,
        |(spend, charts), access| pages::spend(spend, charts, access),
    )
}

/// `GET /signin`: the form (or the fleet, for a viewer already in).
pub async fn sign_in_form(
    req: HttpRequest,
    state: web::Data<ApiState>,
    token: web::Data<ApiToken>,
) -> HttpResponse {
    match access(&req, &token, now_ms(&state), false) {
        Some(_) => redirect("/").finish(),
        None => page(StatusCode::OK, pages::sign_in(None)),
    }
}

/// The sign-in form's body.
#[derive(Debug, Deserialize)]
pub struct SignIn {
    token: String,
}

/// Whether a form post comes from this page's own origin: a browser sends `Origin` on every
/// POST, and one from another site must not sign anybody in (login CSRF). A client that sends
/// none (curl) is not a browser a site could drive.
fn same_origin(req: &HttpRequest) -> bool {
    let Some(origin) = req.headers().get(header::ORIGIN) else {
        return true;
    };
    let info = req.connection_info();
    origin
        .to_str()
        .is_ok_and(|o| o == format!("{}://{}", info.scheme(), info.host()))
}

/// `POST /signin`: exchanges a valid token for a session cookie.
pub async fn sign_in(
    req: HttpRequest,
    state: web::Data<ApiState>,
    token: web::Data<ApiToken>,
    form: web::Form<SignIn>,
) -> HttpResponse {
    if !token.is_required() {
        return redirect("/").finish();
    }
    if !same_origin(&req) {
        return page(
            StatusCode::FORBIDDEN,
            pages::sign_in(Some("Sign in from this page, not from another site.")),
        );
    }
    let sealed = token
        .check(form.token.trim().as_bytes())
        .and_then(|caller| session::seal(&token, &caller.token, now_ms(&state)));
    let Some(value) = sealed else {
        return page(
            StatusCode::UNAUTHORIZED,
            pages::sign_in(Some("That token is not valid.")),
        );
    };
    let max_age = i64::try_from(session::SESSION_TTL.as_secs()).unwrap_or(i64::MAX);
    let cookie = Cookie::build(session::COOKIE, value)
        .path("/")
        .http_only(true)
        .same_site(SameSite::Strict)
        .secure(req.connection_info().scheme() == "https")
        .max_age(actix_web::cookie::time::Duration::seconds(max_age))
        .finish();
    redirect("/").cookie(cookie).finish()
}

/// `POST /signout`: clears the session cookie.
pub async fn sign_out() -> HttpResponse {
    let mut cookie = Cookie::build(session::COOKIE, "")
        .path("/")
        .http_only(true)
        .same_site(SameSite::Strict)
        .finish();
    cookie.make_removal();
    redirect("/signin").cookie(cookie).finish()
}

/// `GET /assets/status.js`.
pub async fn script() -> HttpResponse {
    secured(HttpResponse::Ok())
        .content_type("text/javascript; charset=utf-8")
        .body(STATUS_JS)
}

/// `GET /assets/status.css`.
pub async fn style() -> HttpResponse {
    secured(HttpResponse::Ok())
        .content_type("text/css; charset=utf-8")
        .body(STATUS_CSS)
}

/// `GET /assets/favicon.svg`, the icon the pages name, and `GET /favicon.ico`, where a
/// browser looks for one on any other answer of this address (a JSON route it shows): a
/// missing icon is an error in every browser's console.
pub async fn favicon() -> HttpResponse {
    secured(HttpResponse::Ok())
        .content_type("image/svg+xml")
        .body(FAVICON)
}
