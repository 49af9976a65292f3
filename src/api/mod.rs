//! The discovery and lease API crawlers call (actix-web on `--discovery-addr`).
//!
//! `/v1/*` needs a bearer token (unless started with `--insecure-no-auth`); `/healthz` and
//! `/readyz` do not. The status page (`/`, [`status`]) and its read-only data routes
//! (`/v1/status/*`) also take its session cookie.
//! Every error answer is `{"error":"<code>","message":"<text>"}`.

mod auth;
mod body;
mod error;
mod handlers;
mod idempotency;
mod list;
mod metrics;
mod observe;
pub mod openapi;
mod state;
pub mod status;
pub mod types;

use std::net::TcpListener;

use actix_web::dev::Server;
use actix_web::middleware::from_fn;
use actix_web::{App, HttpServer, Resource, web};

use crate::serving::tokens::ApiToken;

pub use body::MAX_BODY_BYTES;
pub use error::{ApiError, ErrorBody, NoMatchBody};
pub(crate) use handlers::{ledger_error, not_found};
pub use idempotency::{MAX_REQUEST_ID_LEN, REQUEST_ID_PATTERN, fingerprint, parse_request_id};
pub use list::ProxyListCache;
pub use metrics::LeaseMetrics;
pub use observe::observe;
pub use state::ApiState;

/// How long a stopping server lets in-flight requests finish.
pub const SHUTDOWN_GRACE_SECS: u64 = 10;

/// Registers every route, the middleware and the JSON error handlers on an app.
pub fn configure(state: ApiState, token: ApiToken) -> impl FnOnce(&mut web::ServiceConfig) {
    move |cfg: &mut web::ServiceConfig| {
        let query_config = web::QueryConfig::default().error_handler(|err, _req| {
            ApiError::bad_request("invalid_query", err.to_string()).into()
        });
        let path_config = web::PathConfig::default().error_handler(|err, _req| {
            ApiError::bad_request("invalid_path", err.to_string()).into()
        });
        cfg.app_data(web::Data::new(state))
            .app_data(web::Data::new(token))
            .app_data(query_config)
            .app_data(path_config)
            .service(resource("", "/healthz").get(handlers::healthz))
            .service(resource("", "/readyz").get(handlers::readyz))
            .configure(status::configure_pages)
            .configure(status::configure_data)
            .service(
                web::scope("/v1")
                    .wrap(from_fn(auth::require_token))
                    .service(resource("/v1", "/proxies").get(handlers::list_proxies))
                    .service(resource("/v1", "/leases").post(handlers::acquire))
                    .service(
                        resource("/v1", "/leases/{id}")
                            .get(handlers::get_lease)
                            .delete(handlers::release),
                    )
                    .service(resource("/v1", "/leases/{id}/renew").post(handlers::renew))
                    .service(resource("/v1", "/leases/{id}/report").post(handlers::report))
                    .service(resource("/v1", "/sessions/{name}").delete(handlers::end_session))
                    .service(
                        resource("/v1", "/sessions/{name}/report").post(handlers::report_session),
                    )
                    .service(resource("/v1", "/openapi.json").get(openapi::openapi_document))
                    .default_service(web::to(handlers::not_found)),
            )
            .default_service(web::to(handlers::not_found));
    }
}

/// The route `path` inside the scope `scope`: any method the OpenAPI document does not give
/// it answers 405 with an `Allow` header naming those it does (RFC 9110), so the header and
/// the document cannot disagree.
pub(crate) fn resource(scope: &str, path: &str) -> Resource {
    let allow = openapi::allowed_methods(&format!("{scope}{path}")).unwrap_or_default();
    web::resource(path).default_service(web::to(move || handlers::method_not_allowed(allow)))
}

/// Starts the API on an already bound listener. The returned server runs until its handle is
/// stopped; a graceful stop drains in-flight requests for up to [`SHUTDOWN_GRACE_SECS`].
/// Signals are the caller's business (the process stops every server on SIGTERM/SIGINT).
pub fn serve(listener: TcpListener, state: ApiState, token: ApiToken) -> std::io::Result<Server> {
    if !token.is_required() {
        log::warn!(
            "--insecure-no-auth: the lease API on {} accepts requests from anyone who can reach it",
            listener
                .local_addr()
                .map(|a| a.to_string())
                .unwrap_or_default()
        );
    }
    let server = HttpServer::new(move || {
        App::new()
            .wrap(from_fn(observe::observe))
            .configure(configure(state.clone(), token.clone()))
    })
    .listen(listener)?
    .disable_signals()
    .shutdown_timeout(SHUTDOWN_GRACE_SECS)
    .run();
    Ok(server)
}
