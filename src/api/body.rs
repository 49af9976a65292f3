//! `ApiJson<T>`: the JSON body extractor of the API. Unlike actix's own it answers every
//! failure in the API's JSON error shape, names the offending field, and caps bodies at 64 KiB.

use actix_web::dev::Payload;
use actix_web::http::StatusCode;
use actix_web::http::header::CONTENT_TYPE;
use actix_web::web::BytesMut;
use actix_web::{FromRequest, HttpRequest};
use futures_util::StreamExt;
use futures_util::future::LocalBoxFuture;
use serde::de::DeserializeOwned;

use super::error::ApiError;

/// Largest request body accepted.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// A request body parsed as JSON into `T`.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

/// Like [`ApiJson`], for bodies whose every field is optional: no body (zero bytes, with or
/// without a content type) or a JSON `null` is read as `{}`.
#[derive(Debug)]
pub struct OptionalApiJson<T>(pub T);

fn too_large() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
        format!("request bodies are limited to {MAX_BODY_BYTES} bytes"),
    )
}

/// Accepts JSON, and no content type or curl's `-d` default (form-urlencoded), whose bodies
/// are parsed as JSON all the same; anything else is refused.
fn check_content_type(req: &HttpRequest) -> Result<(), ApiError> {
    let Some(value) = req.headers().get(CONTENT_TYPE) else {
        return Ok(());
    };
    let mime = value
        .to_str()
        .unwrap_or_default()
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    if mime == "application/json"
        || mime.ends_with("+json")
        || mime == "application/x-www-form-urlencoded"
    {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            format!("content type {mime:?} is not accepted; send application/json"),
        ))
    }
}

fn declared_length(req: &HttpRequest) -> Option<usize> {
    req.headers()
        .get(actix_web::http::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// Parses `bytes` as `T`, a JSON object, naming the field on failure. Anything but an object
/// is refused first: serde would also read a struct from an array of its fields in order
/// (`[300]`), a form the API does not offer.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    match bytes.trim_ascii().first() {
        None => {
            return Err(ApiError::bad_request(
                "invalid_body",
                "the request body is empty; send a JSON object",
            ));
        }
        Some(b'{') => {}
        Some(_) => {
            return Err(ApiError::bad_request(
                "invalid_body",
                "the request body must be a JSON object",
            ));
        }
    }
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut deserializer).map_err(|e| {
        let path = e.path().to_string();
        let message = if path == "." {
            format!("invalid JSON body: {}", e.inner())
        } else {
            format!("invalid JSON body at `{path}`: {}", e.inner())
        };
        ApiError::bad_request("invalid_body", message)
    })?;
    // Only whitespace may follow the object: `{}` and then anything else is not JSON.
    deserializer
        .end()
        .map_err(|e| ApiError::bad_request("invalid_body", format!("invalid JSON body: {e}")))?;
    Ok(value)
}

/// Reads the body (content type and size checked), up to [`MAX_BODY_BYTES`].
fn read_body(
    req: &HttpRequest,
    payload: &mut Payload,
) -> LocalBoxFuture<'static, Result<BytesMut, ApiError>> {
    let checked = check_content_type(req).and_then(|()| match declared_length(req) {
        Some(n) if n > MAX_BODY_BYTES => Err(too_large()),
        _ => Ok(()),
    });
    let mut payload = payload.take();
    Box::pin(async move {
        checked?;
        let mut body = BytesMut::new();
        while let Some(chunk) = payload.next().await {
            let chunk = chunk.map_err(|e| {
                ApiError::bad_request("invalid_body", format!("cannot read the body: {e}"))
            })?;
            if body.len() + chunk.len() > MAX_BODY_BYTES {
                return Err(too_large());
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    })
}

impl<T: DeserializeOwned + 'static> FromRequest for ApiJson<T> {
    type Error = ApiError;
    type Future = LocalBoxFuture<'static, Result<Self, ApiError>>;

    fn from_request(req: &HttpRequest, payload: &mut Payload) -> Self::Future {
        let body = read_body(req, payload);
        Box::pin(async move { parse_json(&body.await?).map(ApiJson) })
    }
}

impl<T: DeserializeOwned + 'static> FromRequest for OptionalApiJson<T> {
    type Error = ApiError;
    type Future = LocalBoxFuture<'static, Result<Self, ApiError>>;

    fn from_request(req: &HttpRequest, payload: &mut Payload) -> Self::Future {
        let body = read_body(req, payload);
        Box::pin(async move {
            let body = body.await?;
            parse_optional_json(&body).map(OptionalApiJson)
        })
    }
}

/// Parses `bytes` as `T`, no body or `null` as `{}` (the document gives such a body the
/// schema "null or the object"). Whitespace alone is a body that is not JSON, refused as such.
pub fn parse_optional_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.is_empty() || bytes.trim_ascii() == b"null" {
        parse_json(b"{}")
    } else {
        parse_json(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    #[allow(dead_code)]
    struct Body {
        ttl_seconds: u64,
        nested: Option<Nested>,
    }

    #[derive(serde::Deserialize, Debug)]
    #[allow(dead_code)]
    struct Nested {
        n: u32,
    }

    fn message(text: &str) -> String {
        parse_json::<Body>(text.as_bytes()).unwrap_err().to_string()
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (r#"{"ttlSeconds":"x"}"#, "`ttlSeconds`"),
            (r#"{"ttlSeconds":1,"nested":{"n":-1}}"#, "`nested.n`"),
            (r#"{"ttlSeconds":1,"ttl":2}"#, "unknown field `ttl`"),
            (r#"{}"#, "missing field `ttlSeconds`"),
            (r#"{"ttlSeconds":"#, "invalid JSON body"),
            ("", "the request body is empty"),
            ("[1]", "must be a JSON object"),
            (" null", "must be a JSON object"),
            ("1", "must be a JSON object"),
            // An object and then anything but whitespace (schemathesis sent this one).
            ("{\"ttlSeconds\":1}\u{13}l\u{1c}n", "trailing characters"),
            ("{\"ttlSeconds\":1} {}", "trailing characters"),
        ];
        for (body, expected) in cases {
            let m = message(body);
            assert!(m.contains(expected), "{body}: {m}");
            assert!(m.starts_with("invalid_body"), "{m}");
        }
    }

    #[derive(serde::Deserialize, Debug, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct AllOptional {
        n: Option<u32>,
    }

    #[test]
    fn an_empty_optional_body_is_an_empty_object() {
        for body in ["", "{}", "null", " null\n"] {
            assert_eq!(
                parse_optional_json::<AllOptional>(body.as_bytes()).unwrap(),
                AllOptional { n: None },
                "{body:?}"
            );
        }
        assert_eq!(
            parse_optional_json::<AllOptional>(br#"{"n":1}"#).unwrap(),
            AllOptional { n: Some(1) }
        );
        // Whitespace alone is a body, and not JSON.
        for body in [
            " ",
            " \r\n",
            "x",
            "[]",
            "[1]",
            "nul",
            "null null",
            "\"\"",
            "0",
            "{}\u{13}",
        ] {
            let m = parse_optional_json::<AllOptional>(body.as_bytes())
                .unwrap_err()
                .to_string();
            assert!(m.starts_with("invalid_body"), "{body}: {m}");
        }
    }
}
