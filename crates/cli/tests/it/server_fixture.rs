//! A tenant with something behind every route of the HTTP API (flows, a stream, consumers, a
//! blocked inbox record, a quarantined delivery, runs completed, failed and waiting), and the id
//! each route's path parameters name in it. Used by the OpenAPI and tenant-isolation tests.

#![allow(dead_code)]

use std::time::Duration;

use serde_json::{json, Value};

use crate::server_support::Server;

pub const WAIT: Duration = Duration::from_secs(60);

/// Relay and step failures end at once (quarantined, failed), so the fixture settles quickly.
pub const CONFIG: &str = "[relay]\nmax_attempts = 1\n[workers]\nmax_attempts = 1\nretry_delay_ms = 10\n";

/// The ids the fixture made, for the routes that need existing data.
#[derive(Debug, Clone)]
pub struct Fixture {
    pub tenant: String,
    /// A text that appears in this tenant's payloads and nowhere else.
    pub marker: String,
    /// The event whose delivery to `mirror` is quarantined (a conflict).
    pub quarantined_event: String,
    /// The event blocked in `ledger`'s inbox (a stream event the reservation handler refuses).
    pub blocked_event: String,
    /// The journal seq of the failed step of `sleepy-fail-2`.
    pub failed_step: u64,
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_millis() as i64
}

fn order(run: &str, quantity: i64, marker: &str) -> Value {
    json!({"workflow": "order_saga", "run_id": run, "input": {"order_id": format!("{run}-{marker}"), "sku": "sku-1", "quantity": quantity, "amount": 500}})
}

fn sleepy(run: &str, extra: Value, marker: &str) -> Value {
    let mut input = json!({"order_id": format!("{run}-{marker}"), "sku": "sku-1", "quantity": 1, "amount": 100});
    for (key, value) in extra.as_object().expect("an object") {
        input[key] = value.clone();
    }
    json!({"workflow": "sleepy_order", "run_id": run, "input": input})
}

fn expect(server: &Server, method: &str, path: &str, token: &str, body: Value, statuses: &[u16]) -> Value {
    let (status, answer) = server.call(method, path, Some(token), Some(&body));
    assert!(statuses.contains(&status), "{method} {path} answered {status}: {answer}");
    answer
}

/// Make the data, and wait (bounded) until the background loops have settled it.
pub fn populate(server: &Server, token: &str, tenant: &str) -> Fixture {
    let marker = format!("secret-of-{tenant}");
    let t = token;
    expect(server, "PUT", "/v1/stock/sku-1", t, json!({"quantity": 100}), &[200]);
    expect(server, "PUT", "/v1/consumers/ledger", t, json!({"handler": "reservation"}), &[201]);
    expect(server, "PUT", "/v1/consumers/audit", t, json!({"handler": "record"}), &[201]);
    expect(server, "PUT", "/v1/consumers/mirror", t, json!({"handler": "record"}), &[201]);
    // A forged first event of flow `forged` in mirror's inbox: the producer's real seq 1 of that
    // flow then conflicts, and with relay.max_attempts = 1 its delivery is quarantined.
    let forged = json!({
        "event_id": format!("forged-{tenant}"), "source": tenant, "generation": "forged", "flow_id": "forged",
        "seq": 1, "event_type": "note.forged", "schema_version": 1, "payload": {"text": marker},
        "created_at_ms": now_ms(),
    });
    let answer = expect(server, "POST", "/v1/consumers/mirror/inbox", t, forged, &[200]);
    assert_eq!(answer["outcome"], "accepted", "{answer}");
    expect(
        server,
        "POST",
        "/v1/flows/res-1/advance",
        t,
        json!({"expected_seq": 0, "to": "reserved", "quantity": 2}),
        &[200],
    );
    let note = json!({"event_type": "note.added", "payload": {"text": marker}});
    let blocked = expect(server, "POST", "/v1/streams/notes/events", t, note.clone(), &[200]);
    let quarantined = expect(server, "POST", "/v1/streams/forged/events", t, note, &[200]);

    expect(server, "POST", "/v1/runs", t, order("order-ok", 1, &marker), &[201]);
    // A batch of one child order: it publishes its progress (GET /v1/runs/{id}/events/{key}).
    let child = order("unused", 1, &marker)["input"].clone();
    let mut child = child;
    child["order_id"] = json!(format!("batch-child-{marker}"));
    let batch = json!({"workflow": "order_batch", "run_id": "batch-ok", "input": {"orders": [child]}});
    expect(server, "POST", "/v1/runs", t, batch, &[201]);
    let fail = json!({"fail": "charge_payment"});
    for run in ["sleepy-fail", "sleepy-fail-2"] {
        expect(server, "POST", "/v1/runs", t, sleepy(run, fail.clone(), &marker), &[201]);
    }
    let wait = json!({"approval": "approval", "approval_timeout_ms": 86_400_000});
    for run in ["sleepy-wait", "sleepy-wait-2", "sleepy-wait-3"] {
        expect(server, "POST", "/v1/runs", t, sleepy(run, wait.clone(), &marker), &[201]);
    }

    let quarantined_event = quarantined["event_id"].as_str().expect("event id").to_string();
    let blocked_event = blocked["event_id"].as_str().expect("event id").to_string();
    let status_of = |s: &Server, run: &str| {
        let (_, detail) = s.call("GET", &format!("/v1/runs/{run}"), Some(t), None);
        detail["run"]["status"].as_str().unwrap_or_default().to_string()
    };
    server.wait_for(WAIT, |s| {
        let (_, outbox) = s.call("GET", "/v1/outbox?status=quarantined", Some(t), None);
        let quarantined = outbox["deliveries"].as_array()?.iter().any(|d| d["event_id"] == quarantined_event.as_str());
        let (_, inbox) = s.call("GET", "/v1/consumers/ledger/inbox?status=blocked", Some(t), None);
        let blocked = inbox["records"].as_array()?.iter().any(|r| r["envelope"]["event_id"] == blocked_event.as_str());
        let (_, pending) = s.call("GET", "/v1/outbox?status=pending", Some(t), None);
        let settled = pending["deliveries"].as_array()?.is_empty();
        let runs = status_of(s, "order-ok") == "completed"
            && status_of(s, "batch-ok") == "completed"
            && ["sleepy-fail", "sleepy-fail-2"].iter().all(|r| status_of(s, r) == "failed")
            && ["sleepy-wait", "sleepy-wait-2", "sleepy-wait-3"].iter().all(|r| status_of(s, r) == "waiting");
        (quarantined && blocked && settled && runs).then_some(())
    });
    // Schedules that never tick during a test (daily, far from now is not needed: a tick only
    // starts a waiting sleepy_order), one of them for the DELETE route.
    for id in ["nightly", "doomed"] {
        let mut schedule = sleepy(id, wait.clone(), &marker);
        schedule.as_object_mut().unwrap().remove("run_id");
        schedule["cron"] = json!("0 3 1 1 *");
        expect(server, "PUT", &format!("/v1/schedules/{id}"), t, schedule, &[200]);
    }
    // A queue with a run waiting in it (its single slot is held by a run that waits a day).
    expect(server, "PUT", "/v1/queues/mail", t, json!({"concurrency_max": 1}), &[200]);
    for run in ["queued-hold", "queued-next"] {
        let mut start = sleepy(run, wait.clone(), &marker);
        start["queue"] = json!({"queue": "mail", "priority": 0});
        expect(server, "POST", "/v1/runs", t, start, &[201]);
    }
    // A pull consumer (after the wait above: its deliveries stay pending until it commits).
    expect(server, "PUT", "/v1/subscriptions/reader", t, json!({"endpoint": "pull:", "from_start": true}), &[200]);
    let (_, detail) = server.call("GET", "/v1/runs/sleepy-fail-2", Some(t), None);
    let failed_step = detail["journal"]
        .as_array()
        .expect("journal")
        .iter()
        .find(|e| e["status"] == "failed")
        .and_then(|e| e["seq"].as_u64())
        .unwrap_or_else(|| panic!("no failed step in {detail}"));
    Fixture { tenant: tenant.to_string(), marker, quarantined_event, blocked_event, failed_step }
}

impl Fixture {
    /// The value of path parameter `param` of `method path` that names this fixture's data
    /// (a route that changes something gets its own target, so the calls do not interfere).
    /// A new route with a new parameter fails here until the fixture knows it.
    pub fn path_param(&self, method: &str, path: &str, param: &str) -> String {
        let value = match (param, method, path) {
            ("flow_id", "POST", "/v1/flows/{flow_id}/advance") => "res-2",
            ("flow_id", "POST", "/v1/streams/{flow_id}/events") => "notes",
            ("flow_id", _, _) => "res-1",
            ("consumer_id", "PUT", _) => "fresh",
            ("consumer_id", _, "/v1/outbox/{event_id}/{consumer_id}/resolve") => "mirror",
            // Not mirror: redelivering would drop the quarantined delivery `resolve` targets.
            ("consumer_id", _, "/v1/outbox/redeliver/{consumer_id}") => "audit",
            ("consumer_id", "POST", "/v1/consumers/{consumer_id}/inbox") => "audit",
            ("consumer_id", _, p) if p.starts_with("/v1/outbox/feed/") => "reader",
            ("consumer_id", _, _) => "ledger",
            ("event_id", _, "/v1/outbox/{event_id}/{consumer_id}/resolve") => &self.quarantined_event,
            ("event_id", _, "/v1/consumers/{consumer_id}/inbox/{event_id}/skip") => &self.blocked_event,
            ("run_id", _, "/v1/runs/{run_id}/cancel") => "sleepy-wait-2",
            ("run_id", _, "/v1/runs/{run_id}/events") => "sleepy-wait",
            ("run_id", _, "/v1/runs/{run_id}/retry") => "sleepy-fail",
            ("run_id", _, "/v1/runs/{run_id}/skip") => "sleepy-fail-2",
            ("run_id", _, "/v1/runs/{run_id}/abandon") => "sleepy-wait-3",
            ("run_id", _, "/v1/runs/{run_id}/events/{key}") => "batch-ok",
            ("key", _, _) => "progress",
            ("run_id", _, _) => "order-ok",
            ("sku", _, _) => "sku-1",
            ("schedule_id", "PUT", _) => "fresh-schedule",
            ("schedule_id", "DELETE", _) => "doomed",
            ("schedule_id", _, _) => "nightly",
            ("name", "PUT", p) if p.starts_with("/v1/queues/") => "fresh-queue",
            ("name", _, p) if p.starts_with("/v1/queues/") => "mail",
            _ => panic!("the fixture has no value for path parameter {param:?} of {method} {path}: add one"),
        };
        value.to_string()
    }

    /// The request body of `method path`: the example the document gives, with the fields that
    /// must name this fixture's data replaced.
    pub fn body(&self, method: &str, path: &str, example: &Value) -> Value {
        let mut body = example.clone();
        match (method, path) {
            ("POST", "/v1/runs/{run_id}/skip") => body["step"] = json!(self.failed_step),
            ("POST", "/v1/consumers/{consumer_id}/inbox") => {
                // An event of another producer, new to the consumer.
                body["event_id"] = json!(format!("partner-{}", self.tenant));
                body["payload"] = json!({"text": self.marker});
                // Within the consumer's retention horizon (an older event is `expired`).
                body["created_at_ms"] = json!(now_ms());
            }
            ("POST", "/v1/runs") => {
                body["run_id"] = json!("order-new");
                body["input"]["order_id"] = json!(format!("order-new-{}", self.marker));
            }
            _ => {}
        }
        body
    }

    /// Every documented operation: (method in upper case, path template, operation object).
    pub fn operations(document: &Value) -> Vec<(String, String, Value)> {
        let mut out = Vec::new();
        for (path, item) in document["paths"].as_object().expect("paths") {
            for (method, operation) in item.as_object().expect("a path item") {
                if ["get", "put", "post", "delete", "patch"].contains(&method.as_str()) {
                    out.push((method.to_uppercase(), path.clone(), operation.clone()));
                }
            }
        }
        out
    }

    /// The concrete path of an operation, its parameters filled in.
    pub fn concrete_path(&self, method: &str, path: &str) -> String {
        let mut concrete = path.to_string();
        while let Some(start) = concrete.find('{') {
            let end = concrete[start..].find('}').expect("a closing brace") + start;
            let param = &concrete[start + 1..end];
            let value = self.path_param(method, path, param);
            concrete.replace_range(start..=end, &value);
        }
        concrete
    }
}

/// The documented example body of an operation, if it takes one.
pub fn example_body(document: &Value, operation: &Value) -> Option<Value> {
    let content = operation.get("requestBody")?.get("content")?.get("application/json")?;
    if let Some(example) = content.get("example") {
        return Some(example.clone());
    }
    let schema = resolve(document, content.get("schema")?);
    let example = schema.get("example").or_else(|| schema.get("examples").and_then(|e| e.get(0)));
    Some(example.cloned().unwrap_or_else(|| panic!("no example for {operation}")))
}

/// A `$ref` to a component, followed.
pub fn resolve<'a>(document: &'a Value, schema: &'a Value) -> &'a Value {
    match schema.get("$ref").and_then(Value::as_str) {
        Some(reference) => {
            let pointer = reference.strip_prefix('#').expect("a local reference");
            document.pointer(pointer).unwrap_or_else(|| panic!("dangling {reference}"))
        }
        None => schema,
    }
}

/// The scope an operation lists under `security` (`None`: no token needed).
pub fn scope(operation: &Value) -> Option<String> {
    let requirement = operation.get("security")?.as_array()?.first()?.get("bearer")?.as_array()?;
    requirement.first().and_then(Value::as_str).map(str::to_string)
}
