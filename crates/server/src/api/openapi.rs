//! The OpenAPI 3.1 document of the HTTP API, served at `GET /openapi.json`.
//!
//! The paths, parameters, request bodies and success answers come from the `#[utoipa::path]`
//! declarations of the handlers (mounted with `routes!`, so the router and the document cannot
//! disagree). What every `/v1` route shares is added here once: the bearer security scheme, the
//! error answers every route can give (`400`, `401`, `403`, `413` with a body, `429`, `500`,
//! `503`, all with the `ErrorBody` shape), the id pattern of path parameters, and the configured
//! limits (the description, the largest `limit`).

use axum::body::Bytes;
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use serde_json::{json, Map, Value};
use utoipa::OpenApi;

use super::ErrorBody;
use crate::config::Config;
use crate::registry::Registry;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "tidemark",
        description = "tidemark serve: transactional outbox/inbox flows, consumers and durable workflow runs, one tenant per token.",
        license(name = "Apache-2.0")
    ),
    components(schemas(ErrorBody)),
    tags(
        (name = "service", description = "Health, readiness, metrics and this document (no token needed)"),
        (name = "flows", description = "Producer side: advance flows, append to streams, the outbox"),
        (name = "consumers", description = "Consumers, their inboxes and high-water marks"),
        (name = "runs", description = "Durable workflow runs and their operator controls"),
    )
)]
struct ApiDoc;

/// The document's fixed parts; the routes add their paths to it.
pub fn base() -> utoipa::openapi::OpenApi {
    let mut doc = ApiDoc::openapi();
    doc.info.version = env!("CARGO_PKG_VERSION").to_string();
    doc
}

/// The served document (serialised once, at start-up).
#[derive(Clone)]
pub struct Document(pub Bytes);

/// The name of the security scheme in the document.
pub const BEARER: &str = "bearer";

/// What `tidemark_core::id::validate_id` accepts: every path parameter is such an id.
pub const ID_PATTERN: &str = "^[A-Za-z0-9_.:-]{1,100}$";

fn error_answer(description: &str) -> Value {
    json!({
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}},
    })
}

/// Add what every route shares, the configured limits and the names the registry serves, to the
/// generated document.
pub fn finish(doc: utoipa::openapi::OpenApi, config: &Config, registry: &Registry) -> Document {
    let mut doc = serde_json::to_value(&doc).expect("the OpenAPI document serialises");
    // The names a request may use are this service's registrations: list them where the
    // document names the kind (a machine's states, a handler, a workflow).
    let mut states: Vec<String> = registry
        .machines()
        .machines()
        .iter()
        .filter(|m| m.name() != tidemark_core::flow::StreamMachine::NAME)
        .flat_map(|m| m.states().into_iter().map(str::to_string).collect::<Vec<_>>())
        .collect();
    states.sort();
    let handlers: Vec<String> = registry.handler_infos().into_iter().map(|h| h.name).collect();
    let mut workflows: Vec<String> = registry.workflow_names().into_iter().map(|(name, _)| name).collect();
    workflows.dedup();
    for (schema, names) in [("StateName", states), ("HandlerName", handlers), ("WorkflowName", workflows)] {
        if let Some(component) = doc["components"]["schemas"].get_mut(schema) {
            component["enum"] = json!(names);
        }
    }
    let limits = &config.limits;
    let description = format!(
        "{} Every error answer is `{{\"error\": {{\"code\", \"message\"}}}}` with a stable code. Limits of this \
         server: request bodies at most {} bytes (413 `payload_too_large`), pages at most {} items (`limit` above \
         it is 400 `limit_exceeded`), {} requests per second per token with bursts of {} (429 `rate_limited`). \
         See docs/api.md.",
        doc["info"]["description"].as_str().unwrap_or_default(),
        limits.body_bytes_max,
        limits.page_size_max,
        config.auth.rate_per_second,
        config.auth.burst,
    );
    doc["info"]["description"] = json!(description);
    doc["components"]["securitySchemes"] = json!({
        BEARER: {
            "type": "http",
            "scheme": "bearer",
            "description": "A token from `tidemark token create --tenant T --scope S`. The token's tenant is the \
                            only tenant a request sees; its scope (read < operate < admin) must be at least the \
                            one each operation lists under `security`.",
        }
    });
    let Some(paths) = doc["paths"].as_object_mut() else {
        return Document(Bytes::from(doc.to_string()));
    };
    for (path, item) in paths.iter_mut() {
        let Some(item) = item.as_object_mut() else { continue };
        for (_, operation) in item.iter_mut() {
            let Some(operation) = operation.as_object_mut() else { continue };
            if !path.starts_with("/v1/") {
                continue;
            }
            // Every path parameter is an id; every `limit` is a page size.
            for parameter in operation.get_mut("parameters").and_then(Value::as_array_mut).into_iter().flatten() {
                if parameter["in"] == "path" {
                    parameter["schema"]["pattern"] = json!(ID_PATTERN);
                } else if parameter["name"] == "limit" {
                    parameter["schema"]["minimum"] = json!(1);
                    parameter["schema"]["maximum"] = json!(limits.page_size_max);
                }
            }
            let has_body = operation.contains_key("requestBody");
            let responses = operation.entry("responses").or_insert_with(|| Value::Object(Map::new()));
            let Some(responses) = responses.as_object_mut() else { continue };
            let mut shared = vec![
                ("400", "Invalid input (a bad id, query parameter or body): nothing was written"),
                ("401", "`unauthenticated`: no token, or an unknown or revoked one"),
                ("403", "`forbidden`: the token's scope is below the one this operation needs"),
                ("429", "`rate_limited`: too many requests for this token"),
                ("500", "An internal error (a storage failure or a bug); the request's transaction rolled back"),
                ("503", "`unavailable`: the server is shutting down"),
            ];
            if has_body {
                shared.push(("413", "`payload_too_large`: the body is larger than the configured limit"));
            }
            for (status, description) in shared {
                responses.entry(status).or_insert_with(|| error_answer(description));
            }
        }
    }
    Document(Bytes::from(doc.to_string()))
}

/// This document (OpenAPI 3.1).
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "service",
    responses((status = 200, description = "The OpenAPI 3.1 document of this API", body = serde_json::Value))
)]
pub async fn document(Extension(document): Extension<Document>) -> Response {
    ([(CONTENT_TYPE, "application/json")], document.0).into_response()
}
