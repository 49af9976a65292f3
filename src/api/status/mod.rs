//! The status page the API server serves at `/`: the fleet, pools, proxies, targets and lease
//! events for a person, read-only, behind the API's tokens (docs/status.md).
//!
//! `view` builds what is shown from the process's state (pure), `data` gathers it and serves
//! it as JSON under `/v1/status`, `pages` renders it as HTML, `routes` serves the pages, the
//! sign-in and the assets, `session` seals the sign-in cookie, `spend` builds the spend and charts views, `chart` draws
//! a chart, `kube_events` reads a Proxy's
//! Kubernetes Events.

pub mod chart;
pub mod data;
mod kube_events;
pub mod pages;
pub mod routes;
pub mod session;
pub mod spend;
pub mod view;

use actix_web::middleware::from_fn;
use actix_web::web;

pub use kube_events::KubeEvents;

use crate::api::resource;

/// Where the JSON routes are.
const SCOPE: &str = "/v1/status";

/// The JSON routes, under `/v1/status` (registered before the rest of `/v1`, whose bearer-only
/// check they replace with one that also takes the session cookie).
pub fn configure_data(cfg: &mut web::ServiceConfig) {
    cfg.service(
        web::scope(SCOPE)
            .wrap(from_fn(routes::require_viewer))
            .service(resource(SCOPE, "/fleet").get(data::fleet))
            .service(resource(SCOPE, "/proxies").get(data::proxies))
            .service(resource(SCOPE, "/proxies/{namespace}/{name}").get(data::proxy))
            .service(resource(SCOPE, "/targets").get(data::targets))
            .service(resource(SCOPE, "/events").get(data::events))
            .service(resource(SCOPE, "/spend").get(data::spend))
            .service(resource(SCOPE, "/charts").get(data::charts))
            .default_service(web::to(crate::api::not_found)),
    );
}

/// The pages, the sign-in and the assets (the icon also where browsers look for one).
pub fn configure_pages(cfg: &mut web::ServiceConfig) {
    cfg.route("/", web::get().to(routes::fleet))
        .route("/proxies", web::get().to(routes::proxies))
        .route("/proxies/{namespace}/{name}", web::get().to(routes::proxy))
        .route("/targets", web::get().to(routes::targets))
        .route("/events", web::get().to(routes::events))
        .route("/spend", web::get().to(routes::spend))
        .route("/signin", web::get().to(routes::sign_in_form))
        .route("/signin", web::post().to(routes::sign_in))
        .route("/signout", web::post().to(routes::sign_out))
        .route("/assets/status.js", web::get().to(routes::script))
        .route("/assets/status.css", web::get().to(routes::style))
        .route("/assets/favicon.svg", web::get().to(routes::favicon))
        .route("/favicon.ico", web::get().to(routes::favicon));
}
