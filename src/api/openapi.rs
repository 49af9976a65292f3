//! The OpenAPI 3 document served at `/v1/openapi.json`, generated from the handlers' and
//! bodies' types so it cannot drift from what the server answers.

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::error::{ErrorBody, NoMatchBody};
use super::handlers;
use super::types::{
    AcquireRequest, LeaseProxy, LeaseView, ProxyList, ProxyView, RenewRequest, ReportRequest,
    StatusBody,
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
        handlers::healthz,
        handlers::readyz,
    ),
    components(schemas(
        ErrorBody,
        NoMatchBody,
        ProxyList,
        ProxyView,
        AcquireRequest,
        RenewRequest,
        ReportRequest,
        LeaseView,
        LeaseProxy,
        StatusBody,
    )),
    modifiers(&BearerAuth)
)]
pub struct ApiDoc;

/// Declares the `bearer` security scheme the `/v1` routes require.
struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The document as JSON.
pub fn document() -> utoipa::openapi::OpenApi {
    let mut doc = ApiDoc::openapi();
    doc.paths.paths.insert(
        "/v1/openapi.json".into(),
        utoipa::openapi::path::PathItem::new(
            utoipa::openapi::HttpMethod::Get,
            utoipa::openapi::path::OperationBuilder::new()
                .summary(Some("This document"))
                .response(
                    "200",
                    utoipa::openapi::ResponseBuilder::new().description("The OpenAPI document"),
                ),
        ),
    );
    doc
}
