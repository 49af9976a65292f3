//! The OpenAPI 3 document served at `/v1/openapi.json`, generated from the handlers' and
//! bodies' types so it cannot drift from what the server answers. It is the API's contract:
//! schemathesis (`--checks all`, the `schemathesis` integration test) holds the server to it.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use actix_web::HttpResponse;
use utoipa::openapi::link::LinkBuilder;
use utoipa::openapi::path::PathItem;
use utoipa::openapi::security::{ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{RefOr, Response};
use utoipa::{Modify, OpenApi};

use super::error::{ErrorBody, NoMatchBody, PoolWakingBody, QuotaExceededBody};
use super::handlers;
use super::types::{
    AcquireRequest, LeaseProxy, LeaseView, ProxyList, ProxyView, RenewRequest, ReportRequest,
    StatusBody,
};
use crate::api::status::data as status;
use crate::api::status::spend::{ChartsView, SpendView};
use crate::api::status::view::{
    EventsView, FleetView, Order, ProxiesView, ProxyDetail, SortKey, TargetsView,
};

/// The API description.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "proxy-operator discovery and lease API",
        description = "List healthy egress proxies and lease them. Every error body is {\"error\":\"<code>\",\"message\":\"<text>\"}."
    ),
    paths(
        handlers::list_proxies,
        handlers::acquire,
        handlers::get_lease,
        handlers::release,
        handlers::renew,
        handlers::report,
        handlers::report_session,
        handlers::end_session,
        handlers::healthz,
        handlers::readyz,
        openapi_document,
        status::fleet,
        status::proxies,
        status::proxy,
        status::targets,
        status::events,
        status::spend,
        status::charts,
    ),
    components(schemas(
        ErrorBody,
        NoMatchBody,
        PoolWakingBody,
        QuotaExceededBody,
        ProxyList,
        ProxyView,
        AcquireRequest,
        RenewRequest,
        ReportRequest,
        LeaseView,
        LeaseProxy,
        StatusBody,
        FleetView,
        ProxiesView,
        ProxyDetail,
        TargetsView,
        EventsView,
        SpendView,
        ChartsView,
        SortKey,
        Order,
    )),
    modifiers(&BearerAuth, &LeaseLinks)
)]
pub struct ApiDoc;

/// Declares the `bearer` security scheme the `/v1` routes require, and the status page's
/// `session` cookie, which only the read-only `/v1/status` routes also take.
struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
        components.add_security_scheme(
            "session",
            SecurityScheme::ApiKey(ApiKey::Cookie(ApiKeyValue::with_description(
                crate::api::status::session::COOKIE,
                "The status page's sign-in cookie (POST /signin with a token)",
            ))),
        );
    }
}

/// The operations on one lease, by operation ID, that every answer carrying a lease links to
/// with its `leaseID`: a client (or schemathesis's stateful phase) follows them from an
/// acquire to reading, renewing, reporting on and releasing what it got.
const LEASE_OPERATIONS: [(&str, &str, &str); 4] = [
    ("GetLease", "get_lease", "Read this lease"),
    ("RenewLease", "renew", "Extend this lease"),
    (
        "ReportResult",
        "report",
        "Report what the target did through this lease",
    ),
    ("ReleaseLease", "release", "Give this lease back"),
];

/// The answers that carry a lease (a `LeaseView`): (path, method, status).
const LEASE_ANSWERS: [(&str, &str, &str); 4] = [
    ("/v1/leases", "post", "200"),
    ("/v1/leases", "post", "201"),
    ("/v1/leases/{id}", "get", "200"),
    ("/v1/leases/{id}/renew", "post", "200"),
];

/// Adds [`LEASE_OPERATIONS`] as OpenAPI links to every answer in [`LEASE_ANSWERS`].
struct LeaseLinks;

impl Modify for LeaseLinks {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        for (path, method, status) in LEASE_ANSWERS {
            let Some(operation) = openapi
                .paths
                .paths
                .get_mut(path)
                .and_then(|item| operation_mut(item, method))
            else {
                continue;
            };
            let Some(RefOr::T(response)) = operation.responses.responses.get_mut(status) else {
                continue;
            };
            add_lease_links(response);
        }
    }
}

fn operation_mut<'a>(
    item: &'a mut PathItem,
    method: &str,
) -> Option<&'a mut utoipa::openapi::path::Operation> {
    match method {
        "get" => item.get.as_mut(),
        "post" => item.post.as_mut(),
        _ => None,
    }
}

fn add_lease_links(response: &mut Response) {
    for (name, operation_id, description) in LEASE_OPERATIONS {
        let mut link = LinkBuilder::new()
            .parameter("id", "$response.body#/leaseID")
            .description(description)
            .build();
        // utoipa 5.5 writes `Link::operation_id` as `operation_id`, a key OpenAPI readers
        // ignore; the spec's `operationId` goes in through the link's flattened extensions.
        link.extensions
            .get_or_insert_with(Default::default)
            .insert("operationId".to_owned(), operation_id.into());
        response.links.insert(name.to_owned(), RefOr::T(link));
    }
}

/// The methods the document gives each path, as an `Allow` header value (`GET, DELETE`).
fn allow_values() -> &'static BTreeMap<String, String> {
    static ALLOW: OnceLock<BTreeMap<String, String>> = OnceLock::new();
    ALLOW.get_or_init(|| {
        document()
            .paths
            .paths
            .iter()
            .map(|(path, item)| {
                let methods = [
                    ("GET", item.get.is_some()),
                    ("HEAD", item.head.is_some()),
                    ("POST", item.post.is_some()),
                    ("PUT", item.put.is_some()),
                    ("PATCH", item.patch.is_some()),
                    ("DELETE", item.delete.is_some()),
                    ("OPTIONS", item.options.is_some()),
                    ("TRACE", item.trace.is_some()),
                ];
                let allow: Vec<&str> = methods
                    .into_iter()
                    .filter_map(|(name, present)| present.then_some(name))
                    .collect();
                (path.clone(), allow.join(", "))
            })
            .collect()
    })
}

/// The `Allow` header value of a documented path (`None` for a path the document lacks).
pub fn allowed_methods(path: &str) -> Option<&'static str> {
    allow_values().get(path).map(String::as_str)
}

/// The OpenAPI document of this API: the contract the server is checked against.
#[utoipa::path(
    get,
    path = "/v1/openapi.json",
    responses(
        (status = 200, description = "The OpenAPI 3 document", content_type = "application/json"),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn openapi_document() -> HttpResponse {
    HttpResponse::Ok().json(document())
}

/// The document.
pub fn document() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}
