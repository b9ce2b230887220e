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
    // A start may be due at most a year after the request: the bound as of this server's start is
    // one every later request accepts too (the server's clock only moves on).
    if let Some(start_at) = doc["components"]["schemas"]["StartBody"]["properties"].get_mut("start_at_ms") {
        start_at["maximum"] = json!(crate::now_ms().saturating_add(tidemark_core::workflow::TIMER_MS_MAX));
    }
    // A schedule's zone is one of the IANA names the server knows (or null: UTC).
    if let Some(zone) = doc["components"]["schemas"]["ScheduleBody"]["properties"].get_mut("timezone") {
        let mut names = vec![Value::Null];
        names.extend(tidemark_core::schedule::ScheduleSpec::time_zone_names().into_iter().map(Value::from));
        zone["enum"] = Value::Array(names);
    }
    // The rules between fields that the routes check before anything else.
    let exactly_one = |given: &str, given_schema: Value, other: &str| json!({"required": [given], "properties": {given: given_schema, other: {"type": "null"}}});
    for (schema, constraint) in [
        // Redeliver: exactly one of `from_event` and `all: true`.
        (
            "RedeliverBody",
            json!({"oneOf": [
                exactly_one("from_event", json!({"type": "string"}), "all"),
                exactly_one("all", json!({"const": true}), "from_event"),
            ]}),
        ),
        // A schedule: exactly one of `cron` and `interval_ms`.
        (
            "ScheduleBody",
            json!({"oneOf": [
                exactly_one("cron", json!({"type": "string"}), "interval_ms"),
                exactly_one("interval_ms", json!({"type": "integer"}), "cron"),
            ]}),
        ),
        // A start: a queue or a key, not both.
        (
            "StartBody",
            json!({"not": {"required": ["key", "queue"],
                "properties": {"key": {"type": "string"}, "queue": {"type": "object"}}}}),
        ),
    ] {
        if let Some(Value::Object(component)) = doc["components"]["schemas"].get_mut(schema) {
            if let Value::Object(constraint) = constraint {
                component.extend(constraint);
            }
        }
    }
    if let Some(endpoint) = doc["components"]["schemas"]["SubscribeBody"]["properties"].get_mut("endpoint") {
        endpoint["pattern"] = json!(endpoint_pattern());
    }
    bound_integers(&mut doc);
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

/// The endpoints `PUT /v1/subscriptions/{id}` is documented to take: a part of what
/// `tidemark_core::endpoint::Endpoint::parse` accepts, written so that every string it matches is
/// accepted (`pull:`; an HTTP inbox, a NATS subject prefix, a RabbitMQ exchange, a Kafka topic on
/// 1..=3 servers; hosts are names whose labels start with a letter, with single hyphens, or
/// dotted IPv4 addresses).
pub fn endpoint_pattern() -> String {
    let label = "[A-Za-z]([A-Za-z0-9]|-[A-Za-z0-9]){0,20}";
    let octet = "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])";
    let port = "(:(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3}))?";
    let server = format!("({label}(\\.{label}){{0,3}}|({octet}\\.){{3}}{octet}){port}");
    let name = "[A-Za-z0-9_-]{1,60}(\\.[A-Za-z0-9_-]{1,60}){0,2}";
    let http = format!(
        "[Hh][Tt][Tt][Pp][Ss]?://{server}(/[A-Za-z0-9_-]{{1,20}}){{0,2}}/v1/consumers/[A-Za-z0-9_-]{{1,100}}/inbox"
    );
    let nats = format!("[Nn][Aa][Tt][Ss]://{server}/{name}");
    let amqp = format!("[Aa][Mm][Qq][Pp]://{server}/{name}");
    let kafka = format!("[Kk][Aa][Ff][Kk][Aa]://{server}(,{server}){{0,2}}/{name}");
    format!("^(pull:|{http}|{nats}|{amqp}|{kafka})$")
}

/// Every integer schema states its range: where its declaration gave no `minimum` or `maximum`,
/// the bounds of its format (`int32`, else a 64-bit integer), so a client never sends a number
/// the server cannot read as that integer.
fn bound_integers(value: &mut Value) {
    match value {
        Value::Object(object) => {
            let is_integer = match object.get("type") {
                Some(Value::String(kind)) => kind == "integer",
                Some(Value::Array(kinds)) => kinds.iter().any(|kind| kind == "integer"),
                _ => false,
            };
            if is_integer {
                let (min, max) = match object.get("format").and_then(Value::as_str) {
                    Some("int32") => (i64::from(i32::MIN), i64::from(i32::MAX)),
                    _ => (i64::MIN, i64::MAX),
                };
                object.entry("minimum").or_insert(json!(min));
                object.entry("maximum").or_insert(json!(max));
                // utoipa writes the implicit minimum of an unsigned type as `0.0`: an integer
                // bound is written as an integer.
                for key in ["minimum", "maximum"] {
                    if let Some(bound) = object[key].as_f64().filter(|b| object[key].is_f64() && b.fract() == 0.0) {
                        if bound.abs() < 9.0e18 {
                            object.insert(key.into(), json!(bound as i64));
                        }
                    }
                }
            }
            object.values_mut().for_each(bound_integers);
        }
        Value::Array(items) => items.iter_mut().for_each(bound_integers),
        _ => {}
    }
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

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::endpoint_pattern;
    use crate::api::subscriptions::SubscribeBody;

    /// Strings of the pattern without its anchors (proptest generates from the rest; it matches
    /// the whole string all the same).
    fn generated() -> proptest::string::RegexGeneratorStrategy<String> {
        let pattern = endpoint_pattern();
        let inner = pattern.strip_prefix('^').and_then(|p| p.strip_suffix('$')).expect("an anchored pattern");
        proptest::string::string_regex(inner).expect("a pattern proptest generates from")
    }

    proptest! {
        /// Every endpoint the document allows is one the server subscribes (so the pattern never
        /// promises what `PUT /v1/subscriptions/{id}` refuses).
        #[test]
        fn every_endpoint_the_pattern_allows_is_accepted(endpoint in generated()) {
            let body = SubscribeBody { endpoint: endpoint.clone(), from_start: false };
            prop_assert!(body.kind().is_ok(), "{endpoint}: {:?}", body.kind());
        }
    }

    #[test]
    fn the_pattern_matches_each_kind_and_refuses_files() {
        let pattern = regex::Regex::new(&endpoint_pattern()).unwrap();
        for endpoint in [
            "pull:",
            "http://127.0.0.1:7401/v1/consumers/shipping/inbox",
            "https://svc.example/api/v1/consumers/c-1/inbox",
            "nats://nats-1:4222/orders.events",
            "amqp://rabbit/orders",
            "kafka://k1:9093,k2/orders.v1",
        ] {
            assert!(pattern.is_match(endpoint), "{endpoint}");
        }
        for endpoint in ["/data/inbox.db", "sqlite:/x.db", "http://h/v1/runs", "ftp://h/x", "pull:x"] {
            assert!(!pattern.is_match(endpoint), "{endpoint}");
        }
    }
}
