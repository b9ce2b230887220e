//! The OpenAPI 3.1 document of the HTTP API, served at `GET /openapi.json`.
//!
//! The paths, parameters, request bodies and success answers come from the `#[utoipa::path]`
//! declarations of the handlers (mounted with `routes!`, so the router and the document cannot
//! disagree). What every `/v1` route shares is added here once: the bearer security scheme, the
//! error answers every route can give (`400`, `401`, `403`, `413` with a body, `429`, `500`,
//! `503`, all with the `ErrorBody` shape, the `400` naming its codes), the id pattern of path
//! parameters, the configured limits (the description, the largest `limit`), and the names this
//! service registers (machines, states, handlers, workflows) as `enum`s.
//!
//! `start_at_ms`'s `maximum` depends on the day: [`Document::at`] states the bound of the day it
//! is served (`tidemark_core::workflow::start_at_ms_max`), the one every start that day is held
//! to.

use std::sync::{Arc, Mutex};

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

/// The served document: the generated one, serialised once a day with that day's latest
/// `start_at_ms`.
#[derive(Clone)]
pub struct Document {
    doc: Arc<Value>,
    /// The latest `start_at_ms` of the text last served, and that text.
    served: Arc<Mutex<Option<(i64, Bytes)>>>,
}

impl Document {
    fn new(doc: Value) -> Document {
        Document { doc: Arc::new(doc), served: Arc::new(Mutex::new(None)) }
    }

    /// The document's text at `now_ms`: `start_at_ms`'s `maximum` is
    /// `tidemark_core::workflow::start_at_ms_max(now_ms)`, the bound `POST /v1/runs` holds a
    /// start received then to. It changes at UTC midnight; the text is made again then.
    pub fn at(&self, now_ms: i64) -> Bytes {
        let latest = tidemark_core::workflow::start_at_ms_max(now_ms);
        let mut served = self.served.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        match &*served {
            Some((of, text)) if *of == latest => text.clone(),
            _ => {
                let mut doc = (*self.doc).clone();
                if let Some(start_at) = doc["components"]["schemas"]["StartBody"]["properties"].get_mut("start_at_ms") {
                    start_at["maximum"] = json!(latest);
                }
                let text = Bytes::from(doc.to_string());
                *served = Some((latest, text.clone()));
                text
            }
        }
    }
}

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
    // The machines an advance may name, with the states of each: the event stream's are left out
    // (`POST /v1/streams/{flow_id}/events` appends to a stream; an advance to its state is
    // `unknown_state`).
    let machines: Vec<(String, Vec<String>)> = registry
        .machines()
        .machines()
        .iter()
        .filter(|m| m.name() != tidemark_core::flow::StreamMachine::NAME)
        .map(|m| {
            let mut states: Vec<String> = m.states().into_iter().map(str::to_string).collect();
            states.sort();
            (m.name().to_string(), states)
        })
        .collect();
    let machine_names: Vec<&String> = machines.iter().map(|(name, _)| name).collect();
    let machine_names = json!(machine_names);
    for (schema, names) in [
        ("StateName", json!(states)),
        ("MachineName", machine_names),
        ("HandlerName", json!(handlers)),
        ("WorkflowName", json!(workflows)),
    ] {
        if let Some(component) = doc["components"]["schemas"].get_mut(schema) {
            component["enum"] = names;
        }
    }
    // An advance that names its machine goes to one of that machine's states.
    if let Some(Value::Object(advance)) = doc["components"]["schemas"].get_mut("AdvanceBody") {
        let mut forms = vec![json!({"properties": {"machine": {"type": "null"}}})];
        forms.extend(machines.iter().map(|(name, states)| {
            json!({"required": ["machine"], "properties": {"machine": {"const": name}, "to": {"enum": states}}})
        }));
        advance.insert("anyOf".into(), Value::Array(forms));
    }
    // A start is due at most at the end of the UTC day 365 days after the request's: `Document::at`
    // states the bound of the day it serves the document.
    if let Some(start_at) = doc["components"]["schemas"]["StartBody"]["properties"].get_mut("start_at_ms") {
        start_at["maximum"] = json!(tidemark_core::workflow::start_at_ms_max(crate::now_ms()));
    }
    // The trace context an envelope carries: exactly what `validate_traceparent` accepts.
    if let Some(traceparent) = doc["components"]["schemas"]["Envelope"]["properties"].get_mut("traceparent") {
        traceparent["pattern"] = json!(tidemark_core::envelope::traceparent_pattern());
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
        return Document::new(doc);
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
            let has_limit = operation
                .get("parameters")
                .and_then(Value::as_array)
                .is_some_and(|parameters| parameters.iter().any(|p| p["name"] == "limit"));
            let responses = operation.entry("responses").or_insert_with(|| Value::Object(Map::new()));
            let Some(responses) = responses.as_object_mut() else { continue };
            // Every operation's 400 names the codes any request may get; an operation that
            // documents codes of its own keeps them first.
            let invalid = invalid_request(has_body, has_limit);
            if let Some(description) = responses.get_mut("400").and_then(|r| r.get_mut("description")) {
                let own = description.as_str().unwrap_or_default().trim_end_matches('.');
                *description = json!(format!("{own}. {invalid}"));
            }
            let mut shared = vec![
                ("400", invalid.as_str()),
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
    Document::new(doc)
}

/// The description of the 400 answer every `/v1` operation may give, with the codes any request
/// may get there (an operation's own codes come before it): `invalid_id`, `invalid_argument`,
/// `limit_exceeded` when it takes a `limit`, and with a JSON body `inexact_number`.
pub fn invalid_request(has_body: bool, has_limit: bool) -> String {
    let mut codes = vec!["`invalid_id` (a malformed id)".to_string()];
    codes.push(if has_body {
        "`invalid_argument` (a bad query parameter; a body that is not JSON, not a JSON object, or with a \
         missing, unknown or mistyped field; a value out of range)"
            .to_string()
    } else {
        "`invalid_argument` (a bad query parameter)".to_string()
    });
    if has_limit {
        codes.push("`limit_exceeded` (a `limit` above the page size)".to_string());
    }
    if has_body {
        codes.push(
            "`inexact_number` (a number of the body that the canonical encoding would change, such as 2^64 or \
             0.10000000000000000001: a body keeps every number exactly or is refused, see docs/api.md)"
                .to_string(),
        );
    }
    format!("Invalid input, nothing written: {}.", codes.join(", "))
}

/// The endpoints `PUT /v1/subscriptions/{id}` is documented to take: a part of what
/// `tidemark_core::endpoint::Endpoint::parse` accepts, written so that every string it matches is
/// accepted (`pull:`; an HTTP inbox, a NATS subject prefix, a RabbitMQ exchange, a Kafka topic on
/// 1..=3 servers, a PostgreSQL consumer schema with `?schema=` alone; hosts are names whose labels
/// start with a letter, with single hyphens, or dotted IPv4 addresses).
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
    // A schema name: lower case, not `pg_*` (written without look-ahead).
    let schema = "(([a-oq-z_]|p[a-fh-z0-9_]|pg[a-z0-9])[a-z0-9_]{0,40}|p|pg)";
    let postgres = format!(
        "[Pp][Oo][Ss][Tt][Gg][Rr][Ee][Ss]([Qq][Ll])?://[A-Za-z0-9_-]{{1,30}}@{server}/[A-Za-z0-9_-]{{1,30}}\\?schema={schema}"
    );
    format!("^(pull:|{http}|{nats}|{amqp}|{kafka}|{postgres})$")
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
    ([(CONTENT_TYPE, "application/json")], document.at(crate::now_ms())).into_response()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use proptest::prelude::*;
    use serde_json::{json, Value};
    use tidemark_core::envelope::{traceparent_pattern, validate_traceparent};
    use tidemark_core::reservation::ReservationMachine;
    use tidemark_core::workflow::{parse_event_cursor, start_at_ms_max, RunFilter, PAGE_CURSOR_PATTERN};

    use super::{endpoint_pattern, finish, Document};
    use crate::api::subscriptions::{CommitBody, SubscribeBody};
    use crate::config::Config;
    use crate::registry::{Registry, RegistryParts};

    const DAY_MS: i64 = 86_400_000;

    /// The document of a service with the reservation machine (and the event stream), as served
    /// at `now_ms`.
    fn document_at(now_ms: i64) -> Value {
        serde_json::from_slice(&served().at(now_ms)).expect("the document is JSON")
    }

    fn served() -> Document {
        let parts =
            RegistryParts::<crate::Sqlite> { machines: vec![Arc::new(ReservationMachine)], ..Default::default() };
        let (registry, _) = Registry::new(parts).expect("a registry");
        let (_, generated) = crate::api::documented_routes().split_for_parts();
        finish(generated, &Config::default(), &registry)
    }

    fn document() -> Value {
        document_at(crate::now_ms())
    }

    /// An operation of the document.
    fn operation<'a>(doc: &'a Value, method: &str, path: &str) -> &'a Value {
        let operation = &doc["paths"][path][method];
        assert!(operation.is_object(), "{method} {path} is not documented");
        operation
    }

    /// The schema of a parameter, with a reference resolved.
    fn parameter_schema(doc: &Value, method: &str, path: &str, name: &str) -> Value {
        let parameters = operation(doc, method, path)["parameters"].as_array().expect("parameters");
        let parameter = parameters.iter().find(|p| p["name"] == name).unwrap_or_else(|| panic!("no {name}"));
        parameter["schema"].clone()
    }

    /// The `enum` a schema states, through a `$ref` and an `oneOf` with `null`.
    fn names(doc: &Value, schema: &Value) -> Vec<Value> {
        if let Some(reference) = schema["$ref"].as_str() {
            let name = reference.strip_prefix("#/components/schemas/").expect("a component");
            return names(doc, &doc["components"]["schemas"][name]);
        }
        for key in ["oneOf", "anyOf"] {
            if let Some(parts) = schema[key].as_array() {
                return parts.iter().flat_map(|part| names(doc, part)).collect();
            }
        }
        if schema["type"] == "null" {
            return vec![Value::Null];
        }
        schema["enum"].as_array().cloned().unwrap_or_else(|| panic!("no enum in {schema}"))
    }

    /// schemathesis sent `outbox=""`, which the document allowed: it names the two outboxes, and
    /// they are what the feed and its commit take.
    #[test]
    fn the_outbox_of_a_feed_and_its_commit_is_an_enum_of_what_the_server_takes() {
        let doc = document();
        let in_query = names(&doc, &parameter_schema(&doc, "get", "/v1/outbox/feed/{consumer_id}", "outbox"));
        assert_eq!(in_query, [json!("producer"), json!("workflows")]);
        let in_body = names(&doc, &doc["components"]["schemas"]["CommitBody"]["properties"]["outbox"]);
        assert_eq!(in_body, [json!("producer"), json!("workflows"), Value::Null]);
        let commit = |outbox: Option<&str>| {
            CommitBody { outbox: outbox.map(str::to_string), through_position: 0 }.outbox_index().is_ok()
        };
        for name in in_body.iter().map(Value::as_str) {
            assert!(commit(name), "{name:?} is documented and refused");
        }
        for name in ["", "Producer", "producers", "workflow"] {
            assert!(!commit(Some(name)), "{name:?} is accepted, and not documented");
        }
    }

    /// schemathesis sent `after=""`: the document states the cursor's pattern, and the server
    /// accepts exactly the strings it matches.
    #[test]
    fn the_runs_page_cursor_pattern_is_what_the_server_accepts() {
        let doc = document();
        let schema = parameter_schema(&doc, "get", "/v1/runs", "after");
        assert_eq!(schema["pattern"], PAGE_CURSOR_PATTERN, "{schema}");
        let schema = parameter_schema(&doc, "get", "/v1/runs/{run_id}", "events_after");
        assert_eq!(schema["pattern"], PAGE_CURSOR_PATTERN, "{schema}");
    }

    fn cursor_strings() -> impl Strategy<Value = String> {
        prop_oneof![
            proptest::string::string_regex(&PAGE_CURSOR_PATTERN[1..PAGE_CURSOR_PATTERN.len() - 1]).unwrap(),
            proptest::string::string_regex("[-+]?[0-9]{0,20}:?[A-Za-z0-9_.: -]{0,4}").unwrap(),
            proptest::string::string_regex("[-+0-9a-z:. ]{0,12}").unwrap(),
        ]
    }

    fn traceparent_strings() -> impl Strategy<Value = String> {
        let pattern = traceparent_pattern();
        prop_oneof![
            proptest::string::string_regex(&pattern[1..pattern.len() - 1]).unwrap(),
            proptest::string::string_regex("0[01]-[01]{31,33}-[01]{15,17}-[0-9a-f]{2}").unwrap(),
            proptest::string::string_regex("00-[0-9a-fA-F]{32}-[0-9a-g]{16}-[0-9a-fA-F]{1,3}").unwrap(),
        ]
    }

    proptest! {
        #[test]
        fn a_page_cursor_is_accepted_exactly_when_the_pattern_matches(text in cursor_strings()) {
            let pattern = regex::Regex::new(PAGE_CURSOR_PATTERN).unwrap();
            prop_assert_eq!(pattern.is_match(&text), RunFilter::parse_page(&text).is_ok(), "{:?}", text);
            prop_assert_eq!(pattern.is_match(&text), parse_event_cursor(&text).is_ok(), "{:?}", text);
        }

        /// schemathesis sent an envelope with `"traceparent": ""`: the document states the
        /// pattern of exactly the trace contexts an envelope may carry.
        #[test]
        fn a_traceparent_is_accepted_exactly_when_the_pattern_matches(text in traceparent_strings()) {
            let pattern = regex::Regex::new(&traceparent_pattern()).unwrap();
            prop_assert_eq!(pattern.is_match(&text), validate_traceparent(&text).is_ok(), "{:?}", text);
        }
    }

    #[test]
    fn the_envelope_states_the_traceparent_pattern() {
        let doc = document();
        let traceparent = &doc["components"]["schemas"]["Envelope"]["properties"]["traceparent"];
        assert_eq!(traceparent["pattern"], traceparent_pattern(), "{traceparent}");
        let pattern = regex::Regex::new(&traceparent_pattern()).unwrap();
        let valid = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert!(pattern.is_match(valid) && validate_traceparent(valid).is_ok());
        for invalid in [
            "",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        ] {
            assert!(!pattern.is_match(invalid) && validate_traceparent(invalid).is_err(), "{invalid}");
        }
    }

    /// schemathesis sent `machine: "0"`: the document lists the machines an advance may name,
    /// and a named machine's states for `to`.
    #[test]
    fn an_advance_names_a_registered_machine_and_one_of_its_states() {
        let doc = document();
        let machine = &doc["components"]["schemas"]["AdvanceBody"]["properties"]["machine"];
        assert_eq!(names(&doc, machine), [json!("reservation"), Value::Null], "{machine}");
        let states = reservation_states();
        assert_eq!(doc["components"]["schemas"]["StateName"]["enum"], json!(states));
        assert_eq!(
            doc["components"]["schemas"]["AdvanceBody"]["anyOf"],
            json!([
                {"properties": {"machine": {"type": "null"}}},
                {"required": ["machine"], "properties": {"machine": {"const": "reservation"}, "to": {"enum": states}}},
            ])
        );
    }

    /// The reservation machine's states, sorted as the document lists states.
    fn reservation_states() -> Vec<Value> {
        use tidemark_core::flow::FlowMachine;
        let mut states: Vec<Value> = ReservationMachine.states().into_iter().map(Value::from).collect();
        states.sort_by(|a, b| a.as_str().cmp(&b.as_str()));
        states
    }

    /// schemathesis sent a `start_at_ms` just above the documented maximum and the server took it:
    /// the bound moved with every millisecond. Now it moves at UTC midnight, and the document
    /// served on a day states that day's bound, the one the server holds starts to.
    #[test]
    fn the_latest_start_is_the_bound_of_the_day_the_document_is_served() {
        let midnight = 1_767_225_600_000; // 2026-01-01T00:00:00Z
        let served = served();
        let maximum = |now: i64| {
            let doc: Value = serde_json::from_slice(&served.at(now)).unwrap();
            doc["components"]["schemas"]["StartBody"]["properties"]["start_at_ms"]["maximum"].as_i64().unwrap()
        };
        for now in [midnight, midnight + 1, midnight + DAY_MS - 1] {
            assert_eq!(maximum(now), start_at_ms_max(now), "{now}");
            assert_eq!(maximum(now), midnight + 366 * DAY_MS - 1, "{now}");
        }
        assert_eq!(maximum(midnight + DAY_MS), midnight + 367 * DAY_MS - 1);
        // The text is made once a day.
        assert_eq!(served.at(midnight + 5).as_ptr(), served.at(midnight + 6).as_ptr());
    }

    /// A refusal the document cannot prevent (data of the server's: a run's journal, a workflow's
    /// own input check; a number no schema of an arbitrary payload can bound) is a documented
    /// answer of its operation, with its code.
    #[test]
    fn every_refusal_is_a_documented_answer_with_its_code() {
        let doc = document();
        for (path, item) in doc["paths"].as_object().unwrap() {
            if !path.starts_with("/v1/") {
                continue;
            }
            for (method, operation) in item.as_object().unwrap() {
                let invalid = operation["responses"]["400"]["description"].as_str().unwrap_or_default();
                assert!(invalid.contains("`invalid_id`"), "{method} {path}: {invalid}");
                if operation.get("requestBody").is_some() {
                    assert!(invalid.contains("`inexact_number`"), "{method} {path}: {invalid}");
                    assert!(operation["responses"]["413"].is_object(), "{method} {path}");
                }
            }
        }
        for (method, path, codes) in [
            ("post", "/v1/runs/{run_id}/fork", &["invalid_seq"][..]),
            ("post", "/v1/runs", &["invalid_input", "unknown_workflow", "start_at_ms"]),
            ("put", "/v1/schedules/{schedule_id}", &["invalid_input", "invalid_schedule"]),
            ("post", "/v1/flows/{flow_id}/advance", &["unknown_machine", "unknown_state", "invalid_quantity"]),
            ("post", "/v1/streams/{flow_id}/events", &["invalid_seq", "inexact_number"]),
            ("post", "/v1/consumers/{consumer_id}/inbox", &["invalid_envelope", "inexact_number"]),
            ("post", "/v1/consumers/{consumer_id}/inbox/batch", &["invalid_envelope", "inexact_number"]),
            ("put", "/v1/consumers/{consumer_id}", &["unknown_handler"]),
            ("get", "/v1/runs", &["limit_exceeded", "invalid_argument"]),
        ] {
            let invalid = operation(&doc, method, path)["responses"]["400"]["description"].as_str().unwrap();
            for code in codes {
                assert!(invalid.contains(code), "{method} {path}: {code} is not in {invalid:?}");
            }
            let schema = &operation(&doc, method, path)["responses"]["400"]["content"]["application/json"]["schema"];
            assert_eq!(schema["$ref"], "#/components/schemas/ErrorBody", "{method} {path}");
        }
    }

    /// A full run's refusal is its send's own 429, with its code beside the token's rate limit.
    #[test]
    fn a_full_run_is_a_documented_429_of_its_send() {
        let doc = document();
        let full = operation(&doc, "post", "/v1/runs/{run_id}/events")["responses"]["429"]["description"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(full.contains("`run_events_full`") && full.contains("`rate_limited`"), "{full}");
    }

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
            "postgres://app@db2:5432/shop?schema=shipping_inbox",
            "postgresql://app@127.0.0.1/shop?schema=p",
        ] {
            assert!(pattern.is_match(endpoint), "{endpoint}");
        }
        for endpoint in [
            "/data/inbox.db",
            "sqlite:/x.db",
            "http://h/v1/runs",
            "ftp://h/x",
            "pull:x",
            "postgres://app@h/d?schema=pg_x",
            "postgres://app:pw@h/d?schema=s",
            "postgres://h/d?schema=s",
        ] {
            assert!(!pattern.is_match(endpoint), "{endpoint}");
        }
    }
}
