//! The OpenAPI document (`GET /openapi.json`) is true of the running server, on SQLite files and
//! on PostgreSQL: every documented operation exists, its documented example request is valid and
//! accepted, the real answers of a representative call per route validate against the documented
//! schemas (made strict: an answer field the document does not name fails), and so do the error
//! answers.

use serde_json::{json, Value};

use crate::server_api::write_config;
use crate::server_fixture::{example_body, resolve, scope, Fixture, CONFIG};
use crate::server_support::{served_on_both_backends, token, Server};

/// Make every object schema refuse properties it does not name. `unevaluatedProperties` (not
/// `additionalProperties`) so that a schema built with `allOf` (a flattened struct) still sees
/// the properties of all its parts; the parts themselves (and those of `oneOf`, `anyOf`, `not`)
/// are left open for the same reason.
fn strict(schema: &mut Value, in_all_of: bool) {
    match schema {
        Value::Object(object) => {
            let is_object = object.contains_key("properties") || object.contains_key("allOf");
            if is_object && !in_all_of && !object.contains_key("additionalProperties") {
                object.insert("unevaluatedProperties".into(), json!(false));
            }
            for (key, child) in object.iter_mut() {
                // The parts of a composition stay open: the properties of the whole are
                // evaluated where they are declared, not in each part.
                strict(child, matches!(key.as_str(), "allOf" | "oneOf" | "anyOf" | "not"));
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|item| strict(item, in_all_of)),
        _ => {}
    }
}

/// The components an `allOf` refers to (the parts of flattened structs): they stay open.
fn all_of_parts(schema: &Value, out: &mut Vec<String>) {
    match schema {
        Value::Object(object) => {
            for part in object.get("allOf").and_then(Value::as_array).into_iter().flatten() {
                if let Some(name) = part["$ref"].as_str().and_then(|r| r.strip_prefix("#/components/schemas/")) {
                    out.push(name.to_string());
                }
            }
            object.values().for_each(|child| all_of_parts(child, out));
        }
        Value::Array(items) => items.iter().for_each(|item| all_of_parts(item, out)),
        _ => {}
    }
}

/// A validator of `schema` (a part of `document`) with the document's components in reach.
fn validator(document: &Value, schema: &Value) -> jsonschema::Validator {
    let mut root = schema.clone();
    let mut components = document["components"].clone();
    strict(&mut root, false);
    let mut parts = Vec::new();
    all_of_parts(document, &mut parts);
    for (name, component) in components["schemas"].as_object_mut().expect("component schemas") {
        strict(component, parts.contains(name));
    }
    root["$schema"] = json!("https://json-schema.org/draft/2020-12/schema");
    root["components"] = components;
    jsonschema::validator_for(&root).unwrap_or_else(|e| panic!("not a valid schema: {e}\n{root}"))
}

fn assert_valid(document: &Value, schema: &Value, instance: &Value, what: &str) {
    let validator = validator(document, schema);
    let errors: Vec<String> =
        validator.iter_errors(instance).map(|e| format!("{e} at {}", e.instance_path())).collect();
    assert!(errors.is_empty(), "{what} does not match its documented schema: {errors:?}\n{instance}\nschema: {schema}");
}

/// The documented schema of the answer `status` of an operation.
fn answer_schema(operation: &Value, status: u16) -> Option<Value> {
    let answer = operation["responses"].get(status.to_string())?;
    Some(answer.get("content")?.get("application/json")?.get("schema")?.clone())
}

#[test]
fn the_openapi_document_is_true_of_the_running_server() {
    served_on_both_backends(|| {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let admin = token(&data, "acme", "admin");
        let server = Server::start(&data, &["--config", &write_config(dir.path(), CONFIG)], &[]);
        let fixture = crate::server_fixture::populate(&server, &admin, "acme");

        let (status, document) = server.call("GET", "/openapi.json", None, None);
        assert_eq!(status, 200, "{document}");
        assert!(document["openapi"].as_str().unwrap().starts_with("3.1"), "{}", document["openapi"]);
        assert_eq!(document["components"]["securitySchemes"]["bearer"]["scheme"], "bearer");
        let operations = Fixture::operations(&document);
        let mut documented: Vec<String> = operations.iter().map(|(m, p, _)| format!("{m} {p}")).collect();
        documented.sort();
        // The routes this test knows of are all documented (a route dropped from the document fails
        // here; a route added to it is exercised below through the fixture, which must know its ids).
        for route in [
            "GET /healthz",
            "GET /readyz",
            "GET /metrics",
            "GET /openapi.json",
            "GET /v1/flows/{flow_id}",
            "POST /v1/flows/{flow_id}/advance",
            "POST /v1/streams/{flow_id}/events",
            "GET /v1/outbox",
            "POST /v1/outbox/{event_id}/{consumer_id}/resolve",
            "POST /v1/outbox/redeliver/{consumer_id}",
            "GET /v1/consumers",
            "PUT /v1/consumers/{consumer_id}",
            "GET /v1/consumers/{consumer_id}/cursors",
            "GET /v1/consumers/{consumer_id}/inbox",
            "POST /v1/consumers/{consumer_id}/inbox",
            "POST /v1/consumers/{consumer_id}/inbox/{event_id}/skip",
            "GET /v1/runs",
            "POST /v1/runs",
            "GET /v1/runs/{run_id}",
            "POST /v1/runs/{run_id}/cancel",
            "POST /v1/runs/{run_id}/retry",
            "POST /v1/runs/{run_id}/abandon",
            "POST /v1/runs/{run_id}/fork",
            "POST /v1/runs/{run_id}/skip",
            "POST /v1/runs/{run_id}/events",
            "PUT /v1/stock/{sku}",
        ] {
            assert!(documented.contains(&route.to_string()), "{route} is not documented; documented: {documented:?}");
        }

        for (method, path, operation) in &operations {
            let what = format!("{method} {path}");
            let concrete = fixture.concrete_path(method, path);
            let needs_token = scope(operation).is_some();
            assert_eq!(needs_token, path.starts_with("/v1/"), "{what}: every /v1 route and only those need a token");
            let body = example_body(&document, operation).map(|example| {
                let body = fixture.body(method, path, &example);
                // The example, and the request made of it, are what the document calls valid.
                let schema = &operation["requestBody"]["content"]["application/json"]["schema"];
                assert_valid(&document, schema, &example, &format!("{what}: the documented example"));
                assert_valid(&document, schema, &body, &format!("{what}: the request"));
                body
            });

            if needs_token {
                // Without a token: 401 with the documented error shape.
                let (status, answer) = server.call(method, &concrete, None, body.as_ref());
                assert_eq!((status, answer["error"]["code"].as_str()), (401, Some("unauthenticated")), "{what}");
                let schema = answer_schema(operation, 401).unwrap_or_else(|| panic!("{what}: 401 undocumented"));
                assert_valid(&document, &schema, &answer, &format!("{what}: the 401 answer"));
            }
            if let Some(first) = path.find('{') {
                // A malformed id: 400 `invalid_id`, as documented, before anything is read or written.
                let end = path[first..].find('}').unwrap() + first;
                let value = fixture.path_param(method, path, &path[first + 1..end]);
                let bad = format!("{}bad%20id{}", &concrete[..first], &concrete[first + value.len()..]);
                let (status, answer) = server.call(method, &bad, Some(&admin), body.as_ref());
                assert_eq!(
                    (status, answer["error"]["code"].as_str()),
                    (400, Some("invalid_id")),
                    "{what} at {bad}: {answer}"
                );
                let schema = answer_schema(operation, 400).unwrap_or_else(|| panic!("{what}: 400 undocumented"));
                assert_valid(&document, &schema, &answer, &format!("{what}: the 400 answer"));
            }

            // The representative call: accepted, with a documented status and a documented answer.
            let token = needs_token.then_some(admin.as_str());
            if path == "/metrics" {
                let (status, text) = server.text(path);
                assert_eq!(status, 200);
                assert!(text.ends_with("# EOF\n"), "{text}");
                continue;
            }
            let (status, answer) = server.call(method, &concrete, token, body.as_ref());
            assert!((200..300).contains(&status), "{what} ({concrete}) was not accepted: {status} {answer}");
            let schema = answer_schema(operation, status)
                .unwrap_or_else(|| panic!("{what} answered {status}, which the document does not list: {answer}"));
            assert_valid(&document, &schema, &answer, &format!("{what}: the {status} answer"));
            if path == "/openapi.json" {
                assert_eq!(answer, document);
            }
        }

        // Answers with a documented non-2xx outcome validate too: a stale advance (409).
        let (method, path, operation) = operations.iter().find(|(_, p, _)| p == "/v1/flows/{flow_id}/advance").unwrap();
        let stale = json!({"expected_seq": 0, "to": "reserved", "quantity": 2});
        let (status, answer) = server.call(method, "/v1/flows/res-1/advance", Some(&admin), Some(&stale));
        assert_eq!((status, answer["outcome"].as_str()), (409, Some("stale")), "{answer}");
        assert_valid(&document, &answer_schema(operation, 409).unwrap(), &answer, &format!("{method} {path}: 409"));
        // A component the document names resolves (no dangling reference).
        let reference = json!({"$ref": "#/components/schemas/ErrorBody"});
        let error_body = resolve(&document, &reference);
        assert_eq!(error_body["required"], json!(["error"]), "{error_body}");
    });
}

/// Every integer schema under `schema` (following references), with where it is.
fn integer_schemas(document: &Value, schema: &Value, at: &str, out: &mut Vec<(String, Value)>, depth: usize) {
    if depth > 12 {
        return;
    }
    let schema = resolve(document, schema);
    let kinds = match &schema["type"] {
        Value::String(kind) => vec![kind.clone()],
        Value::Array(kinds) => kinds.iter().filter_map(|k| k.as_str().map(str::to_string)).collect(),
        _ => vec![],
    };
    if kinds.iter().any(|k| k == "integer") {
        out.push((at.to_string(), schema.clone()));
    }
    for (name, child) in schema["properties"].as_object().into_iter().flatten() {
        integer_schemas(document, child, &format!("{at}.{name}"), out, depth + 1);
    }
    for key in ["items", "additionalProperties"] {
        if schema[key].is_object() {
            integer_schemas(document, &schema[key], &format!("{at}[]"), out, depth + 1);
        }
    }
    for key in ["allOf", "oneOf", "anyOf"] {
        for part in schema[key].as_array().into_iter().flatten() {
            integer_schemas(document, part, at, out, depth + 1);
        }
    }
}

/// The document states the bounds the server enforces (schemathesis found operations refused
/// although the document allowed them: `start_at_ms` near `i64::MAX`, integers beyond 64 bits):
/// every integer a request may carry has a `minimum` and a `maximum`, and the server accepts
/// the documented extremes of the bounds it checks against its clock.
#[test]
fn the_documented_bounds_are_the_servers() {
    served_on_both_backends(|| {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let admin = token(&data, "acme", "admin");
        let server = Server::start(&data, &[], &[]);
        let (_, document) = server.call("GET", "/openapi.json", None, None);
        let mut integers = Vec::new();
        for (method, path, operation) in Fixture::operations(&document) {
            let what = format!("{method} {path}");
            for parameter in operation["parameters"].as_array().into_iter().flatten() {
                let at = format!("{what} ?{}", parameter["name"].as_str().unwrap_or_default());
                integer_schemas(&document, &parameter["schema"], &at, &mut integers, 0);
            }
            let body = &operation["requestBody"]["content"]["application/json"]["schema"];
            if body.is_object() {
                integer_schemas(&document, body, &format!("{what} body"), &mut integers, 0);
            }
        }
        assert!(integers.len() > 20, "integers found: {integers:?}");
        for (at, schema) in &integers {
            assert!(
                schema["minimum"].is_i64() && schema["maximum"].is_i64(),
                "{at}: an integer without its bounds: {schema}"
            );
        }

        let start = |document: &Value| document["components"]["schemas"]["StartBody"]["properties"].clone();
        let longest = start(&document)["timeout_ms"]["maximum"].as_i64().expect("timeout_ms has a maximum");
        let run = |run_id: &str, extra: Value| {
            let mut body = json!({"workflow": "order_saga", "run_id": run_id,
                "input": {"order_id": run_id, "sku": "sku-1", "quantity": 1, "amount": 500}});
            for (key, value) in extra.as_object().unwrap() {
                body[key] = value.clone();
            }
            server.call("POST", "/v1/runs", Some(&admin), Some(&body))
        };
        // The latest start the document states is the server's, to the millisecond: accepted, and one
        // more refused (schemathesis found a bound that moved with the clock). It moves at UTC
        // midnight, so a try that straddles one reads the document again and tries again.
        for attempt in 0.. {
            let (_, document) = server.call("GET", "/openapi.json", None, None);
            let latest = start(&document)["start_at_ms"]["maximum"].as_i64().expect("start_at_ms has a maximum");
            let at_latest = run(&format!("latest-{attempt}"), json!({"start_at_ms": latest, "timeout_ms": longest}));
            let too_late = run(&format!("too-late-{attempt}"), json!({"start_at_ms": latest + 1}));
            let (_, again) = server.call("GET", "/openapi.json", None, None);
            if start(&again)["start_at_ms"]["maximum"].as_i64() != Some(latest) && attempt < 3 {
                continue;
            }
            let (status, answer) = at_latest;
            assert_eq!(status, 201, "the documented latest start and longest timeout are accepted: {answer}");
            let (status, answer) = too_late;
            assert_eq!((status, answer["error"]["code"].as_str()), (400, Some("invalid_argument")), "{answer}");
            break;
        }
        let (status, answer) = run("too-long", json!({"timeout_ms": longest + 1}));
        assert_eq!((status, answer["error"]["code"].as_str()), (400, Some("invalid_argument")), "{answer}");
    });
}
