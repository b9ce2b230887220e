//! `tidemark serve` over real HTTP: the pipeline end to end (advance -> relay -> drain), a
//! workflow run, error answers with stable codes that write nothing, scopes, revocation, and a
//! graceful SIGTERM. Every wait is a bounded poll.

use std::time::Duration;

use serde_json::{json, Value};

use crate::server_support::{control, served_on_both_backends, tenant_store, token, Server};
use crate::support::{ok, run_with};

const WAIT: Duration = Duration::from_secs(30);

fn order(run: &str, quantity: i64) -> Value {
    json!({"workflow": "order_saga", "run_id": run, "input": {"order_id": run, "sku": "sku-1", "quantity": quantity, "amount": 500}})
}

#[test]
fn advance_relay_drain_and_a_workflow_over_http() {
    served_on_both_backends(|| {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let admin = token(&data, "acme", "admin");
        let server = Server::start(&data, &[], &[]);
        let t = Some(admin.as_str());

        let (status, body) = server.call("PUT", "/v1/consumers/shipping", t, Some(&json!({"handler": "reservation"})));
        assert_eq!((status, body["outcome"].as_str()), (201, Some("declared")), "{body}");
        let (status, body) = server.call(
            "POST",
            "/v1/flows/res-1/advance",
            t,
            Some(&json!({"expected_seq": 0, "to": "reserved", "quantity": 3})),
        );
        assert_eq!(
            (status, body["outcome"].as_str(), body["seq"].as_i64()),
            (200, Some("committed"), Some(1)),
            "{body}"
        );
        // A stale advance is an answer (409 with the outcome), not an error, and writes nothing.
        let (status, body) = server.call(
            "POST",
            "/v1/flows/res-1/advance",
            t,
            Some(&json!({"expected_seq": 0, "to": "reserved", "quantity": 3})),
        );
        assert_eq!((status, body["outcome"].as_str()), (409, Some("stale")), "{body}");

        // The background relay and drain apply it: the consumer's high-water mark reaches 1.
        let flow = server.wait_for(WAIT, |s| {
            let (_, flow) = s.call("GET", "/v1/flows/res-1", t, None);
            (flow["consumers"][0]["high_water_seq"] == 1).then_some(flow)
        });
        assert_eq!(flow["producer"]["state"], "reserved");

        // A stream event to a `record` consumer.
        server.call("PUT", "/v1/consumers/audit", t, Some(&json!({"handler": "record"})));
        let (status, body) = server.call(
            "POST",
            "/v1/streams/notes/events",
            t,
            Some(&json!({"event_type": "note.added", "payload": {"text": "hi"}})),
        );
        assert_eq!((status, body["outcome"].as_str()), (200, Some("committed")), "{body}");
        server.wait_for(WAIT, |s| {
            let (_, cursors) = s.call("GET", "/v1/consumers/audit/cursors", t, None);
            cursors["cursors"]
                .as_array()
                .unwrap()
                .iter()
                .any(|c| c["flow_id"] == "notes" && c["high_water_seq"] == 1)
                .then_some(())
        });

        // A workflow: started once (201), the same run id again is the existing run (200), another
        // input is a conflict (409).
        let (status, _) = server.call("PUT", "/v1/stock/sku-1", t, Some(&json!({"quantity": 10})));
        assert_eq!(status, 200);
        let (status, body) = server.call("POST", "/v1/runs", t, Some(&order("order-1", 2)));
        assert_eq!((status, body["outcome"].as_str()), (201, Some("started")), "{body}");
        let (status, body) = server.call("POST", "/v1/runs", t, Some(&order("order-1", 2)));
        assert_eq!((status, body["outcome"].as_str()), (200, Some("existing")), "{body}");
        let (status, body) = server.call("POST", "/v1/runs", t, Some(&order("order-1", 3)));
        assert_eq!((status, body["error"]["code"].as_str()), (409, Some("run_conflict")), "{body}");
        let run = server.wait_for(WAIT, |s| {
            let (_, run) = s.call("GET", "/v1/runs/order-1", t, None);
            (run["run"]["status"] == "completed").then_some(run)
        });
        assert!(run["journal"].as_array().unwrap().len() >= 3, "{run}");
        let (status, page) = server.call("GET", "/v1/runs?status=completed&limit=10", t, None);
        assert_eq!((status, page["runs"].as_array().unwrap().len()), (200, 1), "{page}");

        let (status, metrics) = server.text("/metrics");
        assert_eq!(status, 200);
        assert!(metrics.contains("tidemark_relay_deliveries_total{tenant=\"acme\",outcome=\"accepted\"}"), "{metrics}");
        assert!(metrics.ends_with("# EOF\n"));
    });
}

/// `GET /v1/runs/{id}/result`: a long poll answered when the run ends (here a batch of child
/// workflows, each shown on its own run page and linked to its parent), 202 when the wait ends
/// first, and typed errors for an unknown run and a wait over the limit.
#[test]
fn a_run_s_result_is_awaited_with_a_bounded_long_poll() {
    served_on_both_backends(|| {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let admin = token(&data, "acme", "admin");
        let server = Server::start(&data, &[], &[]);
        let t = Some(admin.as_str());
        let (status, _) = server.call("PUT", "/v1/stock/sku-1", t, Some(&json!({"quantity": 10})));
        assert_eq!(status, 200);
        let orders: Vec<Value> = ["b1", "b2"]
            .iter()
            .map(|id| json!({"order_id": id, "sku": "sku-1", "quantity": 1, "amount": 100}))
            .collect();
        let start = json!({"workflow": "order_batch", "run_id": "batch-1", "input": {"orders": orders}});
        let (status, body) = server.call("POST", "/v1/runs", t, Some(&start));
        assert_eq!((status, body["outcome"].as_str()), (201, Some("started")), "{body}");

        // Each long poll waits at most 5 s; the loop is bounded.
        let done = server.wait_for(WAIT, |s| {
            let (status, body) = s.call("GET", "/v1/runs/batch-1/result?wait_ms=5000", t, None);
            assert!(status == 200 || status == 202, "{status} {body}");
            assert_eq!(body["done"], status == 200, "{body}");
            (status == 200).then_some(body)
        });
        assert_eq!(done["status"], "completed", "{done}");
        let ends: Vec<&str> =
            done["result"]["orders"].as_array().unwrap().iter().map(|o| o["status"].as_str().unwrap()).collect();
        assert_eq!(ends, ["completed", "completed"], "{done}");
        assert!(done["result"]["batch_token"].is_string(), "{done}");
        let (_, child) = server.call("GET", "/v1/runs/batch-1.2", t, None);
        assert_eq!(
            (child["run"]["status"].as_str(), child["run"]["parent_run_id"].as_str()),
            (Some("completed"), Some("batch-1"))
        );
        let (status, page) = server.text_with("/ui/runs/batch-1.2", t);
        assert_eq!(status, 200);
        assert!(page.contains("Child of") && page.contains("/ui/runs/batch-1"), "the child links its parent");
        let (status, page) = server.text_with("/ui/runs/batch-1", t);
        assert_eq!(status, 200);
        assert!(
            page.contains("child workflow") && page.contains("/ui/runs/batch-1.4"),
            "the parent links its children"
        );
        let (status, progress) = server.call("GET", "/v1/runs/batch-1/events/progress?wait_ms=100", t, None);
        assert_eq!((status, progress["value"].clone()), (200, json!({"done": 2, "of": 2})), "{progress}");
        let (status, none) = server.call("GET", "/v1/runs/batch-1/events/nothing", t, None);
        assert_eq!((status, none["error"]["code"].as_str()), (404, Some("not_found")), "{none}");

        // A run waiting for an approval that never comes: 202 once the short wait is over.
        let sleepy = json!({"workflow": "sleepy_order", "run_id": "nap-1",
        "input": {"order_id": "nap-1", "sku": "sku-1", "quantity": 1, "amount": 100, "approval": "approve"}});
        let (status, _) = server.call("POST", "/v1/runs", t, Some(&sleepy));
        assert_eq!(status, 201);
        let (status, body) = server.call("GET", "/v1/runs/nap-1/result?wait_ms=50", t, None);
        assert_eq!((status, body["done"].as_bool()), (202, Some(false)), "{body}");

        let (status, body) = server.call("GET", "/v1/runs/nobody/result", t, None);
        assert_eq!((status, body["error"]["code"].as_str()), (404, Some("not_found")), "{body}");
        let (status, body) = server.call("GET", "/v1/runs/nap-1/result?wait_ms=60001", t, None);
        assert_eq!((status, body["error"]["code"].as_str()), (400, Some("invalid_argument")), "{body}");
    });
}

/// Long-lived runs over HTTP: a batch that continues as a new run per order is awaited through
/// its first id (the result route follows the chain to its last run), and a start with
/// `timeout_ms` is cancelled when its deadline passes; a timeout out of bounds is refused.
#[test]
fn a_chain_is_awaited_through_its_first_run_and_a_timeout_cancels_a_run() {
    served_on_both_backends(|| {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let admin = token(&data, "acme", "admin");
        let server = Server::start(&data, &[], &[]);
        let t = Some(admin.as_str());
        let (status, _) = server.call("PUT", "/v1/stock/sku-1", t, Some(&json!({"quantity": 10})));
        assert_eq!(status, 200);
        let orders: Vec<Value> = ["k1", "k2"]
            .iter()
            .map(|id| json!({"order_id": id, "sku": "sku-1", "quantity": 1, "amount": 100}))
            .collect();
        let start = json!({"workflow": "order_batch", "run_id": "chain-1", "input": {"orders": orders, "per_run": 1}});
        let (status, body) = server.call("POST", "/v1/runs", t, Some(&start));
        assert_eq!((status, body["outcome"].as_str()), (201, Some("started")), "{body}");
        let done = server.wait_for(WAIT, |s| {
            let (status, body) = s.call("GET", "/v1/runs/chain-1/result?wait_ms=5000", t, None);
            assert!(status == 200 || status == 202, "{status} {body}");
            assert_eq!(body["done"], status == 200, "{body}");
            (status == 200).then_some(body)
        });
        assert_eq!(
            (done["run_id"].as_str(), done["status"].as_str()),
            (Some("chain-1.c1"), Some("completed")),
            "{done}"
        );
        assert_eq!(done["result"]["orders"].as_array().map(Vec::len), Some(2), "{done}");
        let (_, first) = server.call("GET", "/v1/runs/chain-1", t, None);
        assert_eq!(first["run"]["status"], "continued", "{first}");
        let (status, page) = server.text_with("/ui/runs/chain-1", t);
        assert_eq!(status, 200);
        assert!(
            page.contains("Continued as") && page.contains("/ui/runs/chain-1.c1"),
            "the page links the continuation"
        );

        let nap = json!({"workflow": "sleepy_order", "run_id": "nap-2", "timeout_ms": 300,
        "input": {"order_id": "nap-2", "sku": "sku-1", "quantity": 1, "amount": 100, "approval": "approve"}});
        let (status, body) = server.call("POST", "/v1/runs", t, Some(&nap));
        assert_eq!(status, 201, "{body}");
        let ended = server.wait_for(WAIT, |s| {
            let (status, body) = s.call("GET", "/v1/runs/nap-2/result?wait_ms=5000", t, None);
            (status == 200).then_some(body)
        });
        assert_eq!(ended["status"], "cancelled", "{ended}");
        assert!(ended["error"].as_str().unwrap_or("").starts_with("deadline_passed"), "{ended}");
        for bad in [0, 31_622_400_001_i64] {
            let far = json!({"workflow": "sleepy_order", "run_id": "nap-3", "timeout_ms": bad,
            "input": {"order_id": "nap-3", "sku": "sku-1", "quantity": 1, "amount": 100}});
            let (status, body) = server.call("POST", "/v1/runs", t, Some(&far));
            assert_eq!((status, body["error"]["code"].as_str()), (400, Some("invalid_argument")), "{body}");
        }
        let (status, _) = server.call("GET", "/v1/runs/nap-3", t, None);
        assert_eq!(status, 404, "a refused start writes nothing");
    });
}

/// Schedules over HTTP: created, ticked by the tenant's loop into runs `<id>:<tick ms>` (each a
/// `sleepy_order` of its own: the input names no order, so the run id is the order), paused (no
/// more ticks), listed on the dashboard, deleted; bad schedules are typed errors that write
/// nothing.
#[test]
fn a_schedule_ticks_into_runs_until_paused() {
    served_on_both_backends(|| {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let admin = token(&data, "acme", "admin");
        let server = Server::start(&data, &[], &[]);
        let t = Some(admin.as_str());
        let (status, _) = server.call("PUT", "/v1/stock/sku-1", t, Some(&json!({"quantity": 100})));
        assert_eq!(status, 200);
        let body = json!({"workflow": "sleepy_order", "interval_ms": 1000, "catch_up": "skip",
        "input": {"sku": "sku-1", "quantity": 1, "amount": 100, "approval": "never"}});
        let (status, created) = server.call("PUT", "/v1/schedules/beat", t, Some(&body));
        assert_eq!(status, 200, "{created}");
        assert_eq!(
            (created["workflow"].as_str(), created["interval_ms"].as_i64()),
            (Some("sleepy_order"), None),
            "{created}"
        );
        assert_eq!(created["timing"]["interval_ms"], 1000, "{created}");
        assert!(created["next_tick_at_ms"].as_i64().unwrap() > created["created_at_ms"].as_i64().unwrap());

        // The schedule loop starts a run per tick (bounded wait); each reserves an order of its
        // own and waits for its approval (one order for every tick would fail the second run:
        // "already has a reservation").
        let runs = server.wait_for(WAIT, |s| {
            let (_, page) = s.call("GET", "/v1/runs?workflow=sleepy_order&status=waiting", t, None);
            let ids: Vec<String> =
                page["runs"].as_array().unwrap().iter().map(|r| r["run_id"].as_str().unwrap().to_string()).collect();
            (ids.len() >= 2).then_some(ids)
        });
        assert!(runs.iter().all(|id| id.starts_with("beat:")), "{runs:?}");
        let (_, failed) = server.call("GET", "/v1/runs?workflow=sleepy_order&status=failed", t, None);
        assert_eq!(failed["runs"].as_array().map(Vec::len), Some(0), "{failed}");
        let (_, shown) = server.call("GET", &format!("/v1/runs/{}", runs[0]), t, None);
        assert_eq!(shown["run"]["input"]["order_id"], serde_json::Value::Null, "the input is the schedule's: {shown}");
        let (status, paused) = server.call("POST", "/v1/schedules/beat/pause", t, None);
        assert_eq!((status, paused["paused"].as_bool()), (200, Some(true)), "{paused}");
        let (_, page) = server.call("GET", "/v1/runs?workflow=sleepy_order", t, None);
        let count = page["runs"].as_array().unwrap().len();
        let started = server.call("GET", "/v1/schedules/beat", t, None).1["ticks_started"].as_u64().unwrap();
        assert_eq!(started as usize, count, "each started tick is one run");
        let (status, page) = server.text_with("/ui/schedules", t);
        assert_eq!(status, 200);
        assert!(page.contains("beat") && page.contains("paused") && page.contains("Resume"), "{page}");
        let (status, list) = server.call("GET", "/v1/schedules", t, None);
        assert_eq!((status, list["schedules"].as_array().map(Vec::len)), (200, Some(1)), "{list}");

        for (body, code) in [
            (json!({"workflow": "sleepy_order", "input": {}, "cron": "61 * * * *"}), "invalid_schedule"),
            (
                json!({"workflow": "sleepy_order", "input": {}, "cron": "* * * * *", "interval_ms": 1000}),
                "invalid_schedule",
            ),
            (json!({"workflow": "sleepy_order", "input": {}, "interval_ms": 5}), "invalid_schedule"),
            (
                json!({"workflow": "order_saga", "input": {"order_id": "x"}, "interval_ms": 1000, "timezone": "Mars/Base"}),
                "invalid_schedule",
            ),
            (json!({"workflow": "nope", "input": {}, "interval_ms": 1000}), "unknown_workflow"),
            (json!({"workflow": "order_saga", "input": {"nonsense": true}, "interval_ms": 1000}), "invalid_input"),
        ] {
            let (status, answer) = server.call("PUT", "/v1/schedules/bad", t, Some(&body));
            assert_eq!((status, answer["error"]["code"].as_str()), (400, Some(code)), "{body}: {answer}");
        }
        let (status, _) = server.call("GET", "/v1/schedules/bad", t, None);
        assert_eq!(status, 404, "a refused schedule wrote nothing");
        let (status, deleted) = server.call("DELETE", "/v1/schedules/beat", t, None);
        assert_eq!((status, deleted["outcome"].as_str()), (200, Some("deleted")), "{deleted}");
        let (status, _) = server.call("DELETE", "/v1/schedules/beat", t, None);
        assert_eq!(status, 404);
    });
}

#[test]
fn bad_requests_get_stable_codes_and_write_nothing() {
    served_on_both_backends(|| {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let admin = token(&data, "acme", "admin");
        let reader = token(&data, "acme", "read");
        let server =
            Server::start(&data, &["--config", &write_config(dir.path(), "[limits]\nbody_bytes_max = 4096\n")], &[]);
        let t = Some(admin.as_str());
        server.call("PUT", "/v1/consumers/c1", t, Some(&json!({"handler": "reservation"})));
        let before = snapshot(&data);

        type Case<'a> = (&'a str, &'a str, Option<&'a str>, Vec<u8>, u16, &'a str);
        let cases: Vec<Case> = vec![
        ("POST", "/v1/flows/f1/advance", None, b"{}".to_vec(), 401, "unauthenticated"),
        ("POST", "/v1/flows/f1/advance", Some("tmk_nope"), b"{}".to_vec(), 401, "unauthenticated"),
        (
            "POST",
            "/v1/flows/f1/advance",
            Some(&reader),
            br#"{"expected_seq":0,"to":"reserved","quantity":1}"#.to_vec(),
            403,
            "forbidden",
        ),
        ("POST", "/v1/flows/f1/advance", t, b"{not json".to_vec(), 400, "invalid_argument"),
        ("POST", "/v1/flows/f1/advance", t, br#"{"expected_seq":0,"to":"reserved"}"#.to_vec(), 400, "invalid_quantity"),
        (
            "POST",
            "/v1/flows/f1/advance",
            t,
            br#"{"expected_seq":0,"to":"gone","quantity":1}"#.to_vec(),
            400,
            "unknown_state",
        ),
        (
            "POST",
            "/v1/flows/f1/advance",
            t,
            br#"{"expected_seq":-1,"to":"reserved","quantity":1}"#.to_vec(),
            400,
            "invalid_seq",
        ),
        (
            "POST",
            "/v1/flows/f1/advance",
            t,
            br#"{"expected_seq":0,"to":"reserved","quantity":1,"x":1}"#.to_vec(),
            400,
            "invalid_argument",
        ),
        (
            "POST",
            "/v1/flows/bad%20id/advance",
            t,
            br#"{"expected_seq":0,"to":"reserved","quantity":1}"#.to_vec(),
            400,
            "invalid_id",
        ),
        ("POST", "/v1/flows/f1/advance", t, vec![b' '; 8000], 413, "payload_too_large"),
        ("POST", "/v1/streams/s1/events", t, br#"{"event_type":"a b","payload":{}}"#.to_vec(), 400, "invalid_id"),
        ("POST", "/v1/consumers/c1/inbox", t, b"{}".to_vec(), 400, "invalid_envelope"),
        ("POST", "/v1/consumers/nobody/inbox", t, b"{}".to_vec(), 404, "not_found"),
        ("PUT", "/v1/consumers/c1", t, br#"{"handler":"record"}"#.to_vec(), 409, "already_exists"),
        ("PUT", "/v1/consumers/c2", t, br#"{"handler":"magic"}"#.to_vec(), 400, "unknown_handler"),
        ("POST", "/v1/runs", t, br#"{"workflow":"nope","run_id":"r1","input":{}}"#.to_vec(), 400, "unknown_workflow"),
        (
            "POST",
            "/v1/runs",
            t,
            br#"{"workflow":"order_saga","run_id":"r1","input":{"order_id":"o"}}"#.to_vec(),
            400,
            "invalid_input",
        ),
        ("POST", "/v1/runs/nope/retry", t, br#"{"reason":"x"}"#.to_vec(), 404, "not_found"),
        ("POST", "/v1/runs/r1/cancel", t, br#"{"reason":""}"#.to_vec(), 400, "invalid_argument"),
        ("GET", "/v1/runs?limit=100000", t, vec![], 400, "limit_exceeded"),
        ("GET", "/v1/runs?status=sleepy", t, vec![], 400, "invalid_argument"),
        ("GET", "/v1/outbox?status=lost", t, vec![], 400, "invalid_argument"),
        ("POST", "/v1/outbox/redeliver/c1", t, b"{}".to_vec(), 400, "invalid_argument"),
        ("POST", "/v1/outbox/redeliver/c1", t, br#"{"all":false}"#.to_vec(), 400, "invalid_argument"),
        ("POST", "/v1/outbox/redeliver/c1", t, br#"{"all":true,"from_event":"e1"}"#.to_vec(), 400, "invalid_argument"),
        ("POST", "/v1/outbox/redeliver/c1", t, br#"{"all":true,"x":1}"#.to_vec(), 400, "invalid_argument"),
        ("POST", "/v1/outbox/redeliver/c1", t, br#"{"from_event":"a b"}"#.to_vec(), 400, "invalid_id"),
        ("POST", "/v1/outbox/redeliver/c1", t, br#"{"from_event":"nope"}"#.to_vec(), 404, "not_found"),
        ("POST", "/v1/outbox/redeliver/nobody", t, br#"{"all":true}"#.to_vec(), 404, "not_found"),
        ("POST", "/v1/outbox/redeliver/c1", Some(&reader), br#"{"all":true}"#.to_vec(), 403, "forbidden"),
        ("GET", "/v1/nowhere", t, vec![], 404, "not_found"),
        ("DELETE", "/v1/runs", t, vec![], 405, "method_not_allowed"),
        // A JSON array is not an object, though serde's derived structs read one as their fields
        // in order (schemathesis found `PUT /v1/queues/{name}` taking `[null, null]`): refused
        // for a body, a struct nested in it, and an envelope.
        ("PUT", "/v1/queues/q1", t, b"[null, null]".to_vec(), 400, "invalid_argument"),
        ("PUT", "/v1/queues/q1", t, br#"{"rate":[5,60000]}"#.to_vec(), 400, "invalid_argument"),
        ("POST", "/v1/runs/r1/cancel", t, br#"["stop"]"#.to_vec(), 400, "invalid_argument"),
        (
            "POST",
            "/v1/consumers/c1/inbox",
            t,
            br#"["e1","partner","g1","f1",1,"note.added",1,{},1700000000000]"#.to_vec(),
            400,
            "invalid_envelope",
        ),
        // Numbers the canonical encoding cannot keep exactly (2^64 would be stored as a float):
        // refused wherever a payload or an input enters, never rounded.
        (
            "POST",
            "/v1/flows/f1/advance",
            t,
            br#"{"expected_seq":0,"to":"reserved","quantity":1,"input":{"n":18446744073709551616}}"#.to_vec(),
            400,
            "inexact_number",
        ),
        (
            "POST",
            "/v1/streams/s1/events",
            t,
            br#"{"event_type":"note.added","payload":{"n":18446744073709551616}}"#.to_vec(),
            400,
            "inexact_number",
        ),
        (
            "POST",
            "/v1/streams/s1/events",
            t,
            br#"{"event_type":"note.added","payload":{"n":[0.10000000000000000001]}}"#.to_vec(),
            400,
            "inexact_number",
        ),
        ("POST", "/v1/consumers/c1/inbox", t, envelope_with(b"-9223372036854775809"), 400, "inexact_number"),
        (
            "POST",
            "/v1/consumers/c1/inbox/batch",
            t,
            [&b"{\"events\":["[..], &envelope_with(b"18446744073709551616")[..], &b"]}"[..]].concat(),
            400,
            "inexact_number",
        ),
        (
            "POST",
            "/v1/runs",
            t,
            br#"{"workflow":"order_saga","run_id":"r1","input":{"order_id":"o","sku":"sku-1","quantity":1,"amount":18446744073709551616}}"#.to_vec(),
            400,
            "inexact_number",
        ),
        (
            "POST",
            "/v1/runs/r1/events",
            t,
            br#"{"name":"approval","event_id":"e1","payload":{"n":1e400}}"#.to_vec(),
            400,
            "invalid_argument",
        ),
        (
            "PUT",
            "/v1/schedules/s1",
            t,
            br#"{"workflow":"order_saga","interval_ms":60000,"input":{"amount":100000000000000000000001}}"#.to_vec(),
            400,
            "inexact_number",
        ),
    ];
        for (method, path, token, body, status, code) in cases {
            let (got, answer) = server.call_raw(method, path, token, body);
            assert_eq!((got, answer["error"]["code"].as_str()), (status, Some(code)), "{method} {path}: {answer}");
        }
        assert_eq!(snapshot(&data), before, "a refused request changed the files");
    });
}

/// An envelope for `POST /v1/consumers/{id}/inbox` whose payload holds the number `number`.
/// `limits.page_bytes_max` bounds the JSON of a page's items (so an answer held for a client
/// that reads it slowly stays small): inbox records, runs and a pull consumer's feed stop before
/// the item that would pass it, say `truncated`, and their cursors read on to every item once;
/// an item larger than the bound alone is a page of its own.
#[test]
fn pages_stop_at_their_byte_bound_and_their_cursors_read_on_to_every_item() {
    served_on_both_backends(|| {
        const BOUND: usize = 16_384;
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let admin = token(&data, "acme", "admin");
        let config = write_config(dir.path(), &format!("[limits]\npage_bytes_max = {BOUND}\n"));
        let server = Server::start(&data, &["--config", &config], &[]);
        let t = Some(admin.as_str());
        // 6,000 bytes of text in each item: two fit in the bound, three do not.
        let text = |i: usize| format!("{i}{}", "x".repeat(6_000));
        let items_bytes =
            |items: &Value| items.as_array().unwrap().iter().map(|i| i.to_string().len() + 1).sum::<usize>();

        // Inbox records.
        server.call("PUT", "/v1/consumers/log", t, Some(&json!({"handler": "record"})));
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
        let events: Vec<Value> = (0..5)
            .map(|i| {
                json!({"event_id": format!("e{i}"), "source": "src", "generation": "g1", "flow_id": format!("f{i}"),
                    "seq": 1, "event_type": "note.added", "schema_version": 1, "payload": {"text": text(i)},
                    "created_at_ms": now})
            })
            .collect();
        let (status, body) = server.call("POST", "/v1/consumers/log/inbox/batch", t, Some(&json!({"events": events})));
        assert_eq!(status, 200, "{body}");
        let (status, page) = server.call("GET", "/v1/consumers/log/inbox?limit=100", t, None);
        assert_eq!(status, 200, "{page}");
        assert_eq!((page["records"].as_array().map(Vec::len), &page["truncated"]), (Some(2), &json!(true)), "{page}");
        assert!(items_bytes(&page["records"]) <= BOUND);
        let (_, page) = server.call("GET", "/v1/consumers/log/inbox?limit=2", t, None);
        assert_eq!((page["records"].as_array().map(Vec::len), &page["truncated"]), (Some(2), &json!(false)));

        // Runs (due in an hour, so that none runs meanwhile): read page by page, each once.
        let later = now + 3_600_000;
        let mut started = Vec::new();
        for i in 0..5 {
            let run_id = format!("r{i}");
            let input = json!({"order_id": run_id, "sku": "sku-1", "quantity": 1, "amount": 500, "note": text(i)});
            let body = json!({"workflow": "order_saga", "run_id": run_id, "input": input, "start_at_ms": later});
            let (status, answer) = server.call("POST", "/v1/runs", t, Some(&body));
            assert_eq!(status, 201, "{answer}");
            started.push(run_id);
        }
        // An input larger than the bound: a page of its own.
        let big = json!({"order_id": "r5", "sku": "sku-1", "quantity": 1, "amount": 500, "note": "y".repeat(BOUND)});
        let body = json!({"workflow": "order_saga", "run_id": "r5", "input": big, "start_at_ms": later});
        assert_eq!(server.call("POST", "/v1/runs", t, Some(&body)).0, 201);
        started.push("r5".into());
        let (mut read, mut sizes, mut after) = (Vec::new(), Vec::new(), None::<String>);
        for _ in 0..10 {
            let path = match &after {
                Some(cursor) => format!("/v1/runs?limit=100&after={cursor}"),
                None => "/v1/runs?limit=100".into(),
            };
            let (status, page) = server.call("GET", &path, t, None);
            assert_eq!(status, 200, "{page}");
            let runs = page["runs"].as_array().unwrap();
            read.extend(runs.iter().map(|r| r["run_id"].as_str().unwrap().to_string()));
            sizes.push(runs.len());
            assert_eq!(page["truncated"], page["next_after"].is_string(), "every page but the last was cut: {page}");
            match page["next_after"].as_str() {
                Some(cursor) => after = Some(cursor.into()),
                None => break,
            }
        }
        assert_eq!(read, started, "every run once, in order");
        assert_eq!(sizes, [2, 2, 1, 1], "two a page, then the one left before the big one, then the big one alone");

        // A pull consumer's feed: each page continues after the last position of the one before.
        let (status, body) = server.call("PUT", "/v1/subscriptions/search", t, Some(&json!({"endpoint": "pull:"})));
        assert_eq!(status, 200, "{body}");
        for i in 0..5 {
            let body = json!({"event_type": "noted", "payload": {"text": text(i)}});
            assert_eq!(server.call("POST", &format!("/v1/streams/s{i}/events"), t, Some(&body)).0, 200);
        }
        let (mut positions, mut after) = (Vec::new(), 0);
        for _ in 0..10 {
            let (status, page) =
                server.call("GET", &format!("/v1/outbox/feed/search?after={after}&limit=100"), t, None);
            assert_eq!(status, 200, "{page}");
            let events = page["events"].as_array().unwrap();
            if events.is_empty() {
                break;
            }
            assert_eq!(page["truncated"], events.len() == 2 && positions.len() < 4, "{page}");
            assert!(items_bytes(&page["events"]) <= BOUND);
            positions.extend(events.iter().map(|e| e["position"].as_i64().unwrap()));
            after = page["next_after"].as_i64().unwrap();
        }
        assert_eq!(positions, [1, 2, 3, 4, 5]);
    });
}

/// A run's detail is paged by journal position: a page holds at most `limit` entries and stops
/// before the position that would take it past `limits.page_bytes_max` (an entry with its
/// attempts and the events it consumed; the first always stays), `next_after_seq` reads on, and
/// the events no wait consumed come on the last page. The pages join into the whole detail a
/// server with room for it serves in one answer, and `tidemark workflow show --server` joins them.
#[test]
fn a_run_detail_is_read_in_pages_that_join_into_the_whole() {
    served_on_both_backends(|| {
        const BOUND: usize = 16_384;
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let admin = token(&data, "acme", "admin");
        let config = write_config(dir.path(), &format!("[limits]\npage_bytes_max = {BOUND}\n"));
        let mut server = Server::start(&data, &["--config", &config], &[]);
        let t = Some(admin.as_str());
        assert_eq!(server.call("PUT", "/v1/stock/sku-1", t, Some(&json!({"quantity": 10}))).0, 200);
        // The run's record alone passes the bound (its input), so every page holds one position:
        // reserve_inventory, hold, the wait for `approve`, charge_payment, ship_order.
        let input = json!({"order_id": "paged", "sku": "sku-1", "quantity": 1, "amount": 100, "approval": "approve",
            "note": "y".repeat(BOUND)});
        let start = json!({"workflow": "sleepy_order", "run_id": "paged", "input": input});
        assert_eq!(server.call("POST", "/v1/runs", t, Some(&start)).0, 201);
        // Three events no wait asks for: they stay unconsumed, and come a page each after the
        // journal (the run's record alone passes the bound; a page with no entry holds one).
        for n in 0..3 {
            let spare =
                json!({"event_id": format!("spare{n}"), "name": "unasked", "payload": {"pad": "z".repeat(6_000)}});
            assert_eq!(server.call("POST", "/v1/runs/paged/events", t, Some(&spare)).0, 200);
        }
        let approve = json!({"event_id": "yes", "name": "approve", "payload": {"approved": true}});
        assert_eq!(server.call("POST", "/v1/runs/paged/events", t, Some(&approve)).0, 200);
        let done = server.wait_for(WAIT, |s| {
            let (status, body) = s.call("GET", "/v1/runs/paged/result?wait_ms=5000", t, None);
            (status == 200).then_some(body)
        });
        assert_eq!(done["status"], "completed", "{done}");

        let (mut pages, mut next) = (Vec::new(), String::new());
        for _ in 0..12 {
            let (status, page) = server.call("GET", &format!("/v1/runs/paged?limit=3{next}"), t, None);
            assert_eq!(status, 200, "{page}");
            next.clear();
            if let Some(seq) = page["next_after_seq"].as_u64() {
                next += &format!("&after_seq={seq}");
            }
            if let Some(cursor) = page["next_events_after"].as_str() {
                next += &format!("&events_after={cursor}");
            }
            pages.push(page);
            if next.is_empty() {
                break;
            }
        }
        let seqs_of = |page: &Value| -> Vec<u64> {
            page["journal"].as_array().unwrap().iter().map(|e| e["seq"].as_u64().unwrap()).collect()
        };
        let seqs: Vec<Vec<u64>> = pages.iter().map(seqs_of).collect();
        let none = Vec::<u64>::new;
        assert_eq!(seqs, [vec![0], vec![1], vec![2], vec![3], vec![4], none(), none(), none()], "{pages:?}");
        for page in &pages {
            assert!(page["attempts"].as_array().unwrap().iter().all(|a| seqs_of(page) == [a["seq"].as_u64().unwrap()]));
        }
        let events_of = |page: &Value| -> Vec<String> {
            page["events"].as_array().unwrap().iter().map(|e| e["event_id"].as_str().unwrap().to_string()).collect()
        };
        let events: Vec<Vec<String>> = pages.iter().map(events_of).collect();
        let one = |id: &str| vec![id.to_string()];
        assert_eq!(events, [vec![], vec![], one("yes"), vec![], vec![], one("spare0"), one("spare1"), one("spare2")]);
        let (status, page) = server.text_with("/ui/runs/paged?after_seq=1", t);
        assert_eq!(status, 200);
        assert!(page.contains("Steps 2 to 2") && page.contains("/ui/runs/paged?after_seq=2"), "{page}");
        let (status, page) = server.text_with("/ui/runs/paged?after_seq=4", t);
        assert_eq!(status, 200);
        assert!(page.contains("More events") && page.contains("after_seq=4&amp;events_after="), "{page}");
        // Out of range: refused, as every page size is; a cursor no page gave too.
        for query in
            ["after_seq=10000", "limit=0", "limit=1001", "after_seq=-1", "events_after=x", "events_after=1:a%20b"]
        {
            let (status, body) = server.call("GET", &format!("/v1/runs/paged?{query}"), t, None);
            assert_eq!(status, 400, "{query}: {body}");
        }
        let shown = run_with(
            &["--server", &server.base, "--token", &admin, "workflow", "show", "--run-id", "paged"],
            &[],
            None,
        );
        shown.assert_exit(0);
        server.terminate();

        // The same run served whole (the default bound), and in pages of two positions.
        let server = Server::start(&data, &[], &[]);
        let (_, whole) = server.call("GET", "/v1/runs/paged", t, None);
        assert_eq!(whole["next_after_seq"], Value::Null, "{whole}");
        let joined = |field: &str| -> Vec<Value> {
            let mut items: Vec<Value> = pages.iter().flat_map(|p| p[field].as_array().unwrap().clone()).collect();
            items.sort_by_key(|item| item.to_string());
            items
        };
        let sorted = |items: &Value| -> Vec<Value> {
            let mut items = items.as_array().unwrap().clone();
            items.sort_by_key(|item| item.to_string());
            items
        };
        for field in ["journal", "attempts", "events"] {
            assert_eq!(joined(field), sorted(&whole[field]), "{field}: the pages join into the whole");
            assert_eq!(sorted(&shown.json[field]), sorted(&whole[field]), "{field}: the CLI joins the pages");
        }
        assert_eq!(whole["run"], pages[7]["run"]);
        let (_, two) = server.call("GET", "/v1/runs/paged?limit=2&after_seq=1", t, None);
        let seqs: Vec<u64> = two["journal"].as_array().unwrap().iter().map(|e| e["seq"].as_u64().unwrap()).collect();
        assert_eq!((seqs, two["next_after_seq"].as_u64()), (vec![2, 3], Some(3)), "{two}");
        assert_eq!(events_of(&two), ["yes"], "{two}");
    });
}

fn envelope_with(number: &[u8]) -> Vec<u8> {
    let head = br#"{"event_id":"e-num","source":"partner","generation":"g1","flow_id":"f-num","seq":1,"event_type":"note.added","schema_version":1,"created_at_ms":1,"payload":{"n":"#;
    [&head[..], number, &b"}}"[..]].concat()
}

#[test]
fn payload_numbers_at_the_limits_are_kept_exactly() {
    served_on_both_backends(|| {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let admin = token(&data, "acme", "admin");
        let server = Server::start(&data, &[], &[]);
        let t = Some(admin.as_str());
        let (status, body) = server.call("PUT", "/v1/consumers/audit", t, Some(&json!({"handler": "record"})));
        assert_eq!(status, 201, "{body}");
        // The largest and smallest integers the encoding holds, and doubles given in their shortest
        // form or in another form of the same value (1e2 is written 100.0: the form may change, the
        // value never does).
        let numbers =
            br#"{"max":18446744073709551615,"min":-9223372036854775808,"tenth":0.1,"tiny":5e-324,"hundred":1e2}"#;
        let expected = json!({"max": u64::MAX, "min": i64::MIN, "tenth": 0.1, "tiny": 5e-324, "hundred": 100.0});
        let append = [&br#"{"event_type":"note.added","payload":"#[..], &numbers[..], &b"}"[..]].concat();
        let (status, body) = server.call_raw("POST", "/v1/streams/limits/events", t, append);
        assert_eq!(status, 200, "{body}");
        // Within the consumer's retention horizon (an older event is `expired`).
        let head = format!(
            r#"{{"event_id":"e-limits","source":"partner","generation":"g1","flow_id":"f-limits","seq":1,"event_type":"note.added","schema_version":1,"created_at_ms":{},"payload":"#,
            crate::server_fixture::now_ms()
        );
        let envelope = [head.as_bytes(), &numbers[..], &b"}"[..]].concat();
        let (status, body) = server.call_raw("POST", "/v1/consumers/audit/inbox", t, envelope);
        assert_eq!((status, body["outcome"].as_str()), (200, Some("accepted")), "{body}");
        // Both reach audit's inbox (the stream's through the relay) with every number as it was sent.
        let records = server.wait_for(WAIT, |s| {
            let (_, page) = s.call("GET", "/v1/consumers/audit/inbox", t, None);
            let records = page["records"].as_array().cloned().unwrap_or_default();
            (records.len() == 2).then_some(records)
        });
        for record in &records {
            assert_eq!(record["envelope"]["payload"], expected, "{record}");
        }
    });
}

#[test]
fn revoked_tokens_are_refused_and_sigterm_stops_cleanly() {
    served_on_both_backends(|| {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let admin = token(&data, "acme", "admin");
        let mut server = Server::start(&data, &[], &[]);
        let (status, _) = server.call("GET", "/v1/runs", Some(&admin), None);
        assert_eq!(status, 200);
        let [flag, value] = control(&data);
        let listed = ok(&["token", "list", &flag, &value]);
        let id = listed["tokens"][0]["token_id"].as_str().unwrap().to_string();
        assert!(!listed.to_string().contains(&admin), "token list must not print secrets");
        ok(&["token", "revoke", &flag, &value, "--token-id", &id]);
        let (status, body) = server.call("GET", "/v1/runs", Some(&admin), None);
        assert_eq!((status, body["error"]["code"].as_str()), (401, Some("unauthenticated")), "{body}");
        let (status, _) = server.call("GET", "/healthz", None, None);
        assert_eq!(status, 200);
        let (status, _) = server.call("GET", "/readyz", None, None);
        assert_eq!(status, 200);
        // The tenant's counts, read through a connection of their own on PostgreSQL: the stop
        // closes it too (it used to panic, exit code 101, when dropped on the runtime's thread).
        let (status, metrics) = server.text("/metrics");
        assert_eq!(status, 200);
        assert!(metrics.contains("tenant=\"acme\""), "{metrics}");
        let (code, stderr) = server.terminate();
        assert_eq!(code, 0, "{stderr}");
    });
}

#[test]
fn unauthenticated_mode_is_loud() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut server = Server::start(&data, &[], &[("TIDEMARK_AUTH__MODE", "none")]);
    let (status, _) = server.call("PUT", "/v1/stock/s", None, Some(&json!({"quantity": 1})));
    assert_eq!(status, 200);
    let (code, stderr) = server.terminate();
    assert_eq!(code, 0);
    assert!(stderr.contains("AUTHENTICATION IS DISABLED"), "{stderr}");
}

pub fn write_config(dir: &std::path::Path, text: &str) -> String {
    let path = dir.join("tidemark.toml");
    std::fs::write(&path, text).unwrap();
    path.to_string_lossy().into_owned()
}

/// What the service of `data` stored (see [`crate::server_support::stored`]).
pub fn snapshot(data: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    crate::server_support::stored(data, None)
}

/// SIGTERM with a run in flight (its worker holds the lease inside a slow external step): the
/// server exits 0 after releasing the lease, and the next start takes the run over at once (no
/// lease expiry, no recovery) and finishes it.
#[test]
fn sigterm_releases_leases_and_a_restart_takes_the_runs_at_once() {
    served_on_both_backends(|| {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let admin = token(&data, "acme", "admin");
        let t = Some(admin.as_str());
        // A lease far longer than the test's waits: only a released lease can be taken at once.
        let env = [("TIDEMARK_WORKERS__LEASE_MS", "600000")];
        let mut server = Server::start(&data, &[], &env);
        server.call("PUT", "/v1/stock/sku-1", t, Some(&json!({"quantity": 5})));
        let hold_until_ms = tidemark_engine::now_ms() + 4_000;
        let mut input = order("h1", 1)["input"].clone();
        input["hold_until_ms"] = json!(hold_until_ms);
        let (status, body) = server.call(
            "POST",
            "/v1/runs",
            t,
            Some(&json!({"workflow": "sleepy_order", "run_id": "h1", "input": input})),
        );
        assert_eq!(status, 201, "{body}");
        server.wait_for(WAIT, |s| {
            let (_, run) = s.call("GET", "/v1/runs/h1", t, None);
            (run["run"]["lease_owner"].is_string() && !run["journal"].as_array().unwrap().is_empty()).then_some(())
        });
        let (code, stderr) = server.terminate();
        assert_eq!(code, 0, "{stderr}");
        let db = tenant_store(&data, "acme", tidemark_server::Database::Workflows);
        let shown = ok(&["workflow", "show", "--db", &db, "--run-id", "h1"]);
        assert_eq!(
            (shown["run"]["lease_owner"].clone(), shown["run"]["status"].as_str()),
            (Value::Null, Some("running")),
            "{shown}"
        );

        let server = Server::start(&data, &[], &env);
        let run = server.wait_for(WAIT, |s| {
            let (_, run) = s.call("GET", "/v1/runs/h1", t, None);
            (run["run"]["status"] == "completed").then_some(run)
        });
        assert_eq!(run["run"]["recoveries"], 0, "released, not expired: {run}");
    });
}

#[test]
fn config_check_names_the_bad_key() {
    let dir = tempfile::tempdir().unwrap();
    let good = write_config(dir.path(), "listen = \"127.0.0.1:9999\"\n[workers]\nconcurrency = 8\n");
    let out = ok(&["config", "check", "--config", &good]);
    assert_eq!((out["outcome"].as_str(), out["config"]["workers"]["concurrency"].as_u64()), (Some("valid"), Some(8)));
    for (text, key) in [("[workers]\nconcurency = 8\n", "concurency"), ("[relay]\nbatch = 0\n", "relay.batch")] {
        let bad = write_config(dir.path(), text);
        let run = crate::support::run(&["config", "check", "--config", &bad]);
        assert_eq!((run.code, run.json["error"]["code"].as_str()), (2, Some("invalid_config")), "{}", run.stdout);
        assert!(run.json["error"]["message"].as_str().unwrap().contains(key), "{}", run.stdout);
    }
    // Secrets written in the file are shown masked; `env:NAME` as is.
    let secrets = write_config(
        dir.path(),
        "[relay.tokens]\n\"http://h:80\" = \"tok-in-file\"\n\"http://h:81\" = \"env:TOK\"\n\
         [relay.amqp_credentials]\n\"h:5672\" = \"relay:pw-in-file\"\n\"h:5673\" = \"env:AMQP_CREDS\"\n\
         [relay.postgres.\"app@db:5432\"]\npassword = \"pg-in-file\"\n[relay.postgres.\"app@db:5433\"]\n\
         password = \"env:PG_PW\"\n[relay.postgres.\"trusted@db:5432\"]\n",
    );
    let run = crate::support::run(&["config", "check", "--config", &secrets]);
    assert_eq!(run.code, 0, "{}", run.stdout);
    for secret in ["tok-in-file", "pw-in-file", "pg-in-file"] {
        assert!(!run.stdout.contains(secret), "{secret}: {}", run.stdout);
    }
    let relay = &run.json["config"]["relay"];
    assert_eq!(
        (relay["tokens"]["http://h:80"].as_str(), relay["tokens"]["http://h:81"].as_str()),
        (Some("***"), Some("env:TOK"))
    );
    let amqp = &relay["amqp_credentials"];
    assert_eq!((amqp["h:5672"].as_str(), amqp["h:5673"].as_str()), (Some("***"), Some("env:AMQP_CREDS")));
    let postgres = &relay["postgres"];
    assert_eq!(
        (
            postgres["app@db:5432"]["password"].as_str(),
            postgres["app@db:5433"]["password"].as_str(),
            &postgres["trusted@db:5432"]["password"]
        ),
        (Some("***"), Some("env:PG_PW"), &Value::Null)
    );
    // The environment overrides the file, and is validated too.
    let good = write_config(dir.path(), "[workers]\nconcurrency = 8\n");
    let run = crate::support::run_with(
        &["config", "check", "--config", &good],
        &[("TIDEMARK_WORKERS__CONCURRENCY", "0")],
        None,
    );
    assert_eq!(run.code, 2, "{}", run.stdout);
    assert!(run.stdout.contains("workers.concurrency"), "{}", run.stdout);
}

/// Each token has its own bucket: a token over its rate gets 429 `rate_limited`, another token
/// of the same tenant is not affected.
#[test]
fn rate_limits_are_per_token() {
    served_on_both_backends(|| {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let busy = token(&data, "acme", "read");
        let calm = token(&data, "acme", "read");
        let config = write_config(dir.path(), "[auth]\nrate_per_second = 1\nburst = 3\n");
        let server = Server::start(&data, &["--config", &config], &[]);
        let statuses: Vec<u16> = (0..10).map(|_| server.call("GET", "/v1/runs", Some(&busy), None).0).collect();
        assert_eq!(&statuses[..3], &[200, 200, 200], "the burst passes: {statuses:?}");
        assert!(
            statuses.contains(&429),
            "ten requests in far less than 7 s exceed 1/s after a burst of 3: {statuses:?}"
        );
        let (status, body) = server.call("GET", "/v1/runs", Some(&busy), None);
        if status == 429 {
            assert_eq!(body["error"]["code"], "rate_limited", "{body}");
        }
        assert_eq!(server.call("GET", "/v1/runs", Some(&calm), None).0, 200, "another token has its own bucket");
    });
}

/// Two `tidemark serve` processes on one PostgreSQL store serve the same tenant: runs started
/// through either complete, and when one is killed with SIGKILL while its worker holds leases
/// (inside a slow external step), the other finishes those runs after the leases expire, with
/// every transactional effect once.
#[test]
fn two_servers_on_one_postgres_store_share_the_runs_and_the_survivor_finishes_a_killed_one_s() {
    let Some(_postgres) = crate::workflow_cli::on_postgres() else { return };
    let _schemas = crate::server_support::DropServedSchemas;
    let dir = tempfile::tempdir().unwrap();
    let (a_data, b_data) = (dir.path().join("a"), dir.path().join("b"));
    crate::server_support::store_of(&a_data);
    crate::server_support::share_store(&b_data, &a_data);
    let admin = token(&a_data, "acme", "admin");
    let t = Some(admin.as_str());
    let env = [("TIDEMARK_WORKERS__LEASE_MS", "2000"), ("TIDEMARK_WORKERS__POLL_MS", "50")];
    let mut a = Server::start(&a_data, &[], &env);
    let b = Server::start(&b_data, &[], &env);
    let (status, _) = a.call("PUT", "/v1/stock/sku-1", t, Some(&json!({"quantity": 100})));
    assert_eq!(status, 200);

    // Started through either, run by either.
    for (i, server) in [&a, &b, &a, &b].into_iter().enumerate() {
        let (status, body) = server.call("POST", "/v1/runs", t, Some(&order(&format!("shared-{i}"), 1)));
        assert_eq!(status, 201, "{body}");
    }
    for i in 0..4 {
        b.wait_for(WAIT, |s| {
            let (_, run) = s.call("GET", &format!("/v1/runs/shared-{i}"), t, None);
            (run["run"]["status"] == "completed").then_some(())
        });
    }

    // A holds leases in a slow step; it dies; B takes the runs over once the leases expire.
    let hold_until_ms = tidemark_engine::now_ms() + 3_000;
    let held: Vec<String> = (0..3).map(|i| format!("held-{i}")).collect();
    for run_id in &held {
        let mut input = order(run_id, 1)["input"].clone();
        input["hold_until_ms"] = json!(hold_until_ms);
        let start = json!({"workflow": "sleepy_order", "run_id": run_id, "input": input});
        let (status, body) = a.call("POST", "/v1/runs", t, Some(&start));
        assert_eq!(status, 201, "{body}");
    }
    for run_id in &held {
        a.wait_for(WAIT, |s| {
            let (_, run) = s.call("GET", &format!("/v1/runs/{run_id}"), t, None);
            let holding = run["run"]["lease_owner"].is_string() && !run["journal"].as_array().unwrap().is_empty();
            holding.then_some(())
        });
    }
    // Started through A, leased to A's worker in the start's own transaction.
    let a_worker = format!("serve-{}-acme", a.pid());
    for run_id in &held {
        let (_, run) = b.call("GET", &format!("/v1/runs/{run_id}"), t, None);
        assert_eq!(run["run"]["lease_owner"], a_worker.as_str(), "{run}");
    }
    a.kill9();
    for run_id in &held {
        let run = b.wait_for(WAIT, |s| {
            let (_, run) = s.call("GET", &format!("/v1/runs/{run_id}"), t, None);
            (run["run"]["status"] == "completed").then_some(run)
        });
        assert!(run["run"]["recoveries"].as_u64().unwrap_or(0) >= 1, "taken over after the lease expired: {run}");
    }

    // Every transactional effect once: one reservation per order, in the shared workflow schema.
    let store = crate::server_support::tenant_store(&a_data, "acme", tidemark_server::Database::Workflows);
    let (conn, schema) = store.rsplit_once("?schema=").expect("a PostgreSQL store");
    let mut client = postgres::Client::connect(conn, postgres::NoTls).unwrap();
    let counts = client
        .query(&format!(r#"SELECT order_id, kind, count(*) FROM "{schema}".order_effects GROUP BY 1, 2"#), &[])
        .unwrap();
    assert!(!counts.is_empty());
    for row in &counts {
        let (order_id, kind, n): (String, String, i64) = (row.get(0), row.get(1), row.get(2));
        assert_eq!(n, 1, "{order_id} {kind} applied {n} times");
    }
    let reserved: Vec<String> =
        counts.iter().filter(|r| r.get::<_, String>(1) == "reserve").map(|r| r.get::<_, String>(0)).collect();
    assert_eq!(reserved.len(), 7, "four shared runs and three held ones reserved once each: {reserved:?}");
}

/// A service on PostgreSQL outlives the server closing every one of its connections
/// (`pg_terminate_backend`, as a restart or a failover does): its store threads, workflow writer,
/// control store and counts reconnect, and advances, deliveries, runs and tokens work again
/// without restarting the service. A request the closed connection failed is answered 5xx and
/// wrote nothing.
#[test]
fn a_service_on_postgres_reconnects_after_the_server_closed_its_connections() {
    let Some(_postgres) = crate::workflow_cli::on_postgres() else { return };
    let _schemas = crate::server_support::DropServedSchemas;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    // The service's connections carry a name of their own, so that only they are closed.
    let name = format!("tmreconnect{}", std::process::id());
    let store = crate::server_support::store_of(&data)
        .unwrap()
        .replace("?schema=", &format!("?application_name={name}&schema="));
    crate::server_support::set_store(&data, &store);
    let admin = token(&data, "acme", "admin");
    let t = Some(admin.as_str());
    let server = Server::start(&data, &[], &[]);
    server.call("PUT", "/v1/consumers/shipping", t, Some(&json!({"handler": "reservation"})));
    server.call("PUT", "/v1/stock/sku-1", t, Some(&json!({"quantity": 10})));
    let advance = |flow: &str| {
        server.call(
            "POST",
            &format!("/v1/flows/{flow}/advance"),
            t,
            Some(&json!({"expected_seq": 0, "to": "reserved", "quantity": 1})),
        )
    };
    let (status, body) = advance("before");
    assert_eq!(status, 200, "{body}");
    let applied = |s: &Server, flow: &str| {
        let (_, flow) = s.call("GET", &format!("/v1/flows/{flow}"), t, None);
        (flow["consumers"][0]["high_water_seq"] == 1).then_some(())
    };
    server.wait_for(WAIT, |s| applied(s, "before"));

    let (_, mut client) = crate::support::postgres_server().unwrap();
    let closed = client
        .query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1", &[&name])
        .unwrap()
        .len();
    assert!(closed >= 4, "the service's connections were closed: {closed}");

    // The first requests may meet a closed connection (5xx, nothing written); then it works.
    let mut failed = 0;
    let committed = server.wait_for(WAIT, |_| {
        let (status, body) = advance("after");
        match status {
            200 => Some(body),
            500..=599 => {
                failed += 1;
                None
            }
            other => panic!("advance after the close: {other} {body}"),
        }
    });
    assert_eq!(committed["seq"], 1, "{committed}");
    server.wait_for(WAIT, |s| applied(s, "after"));
    let (status, body) = server.call("POST", "/v1/runs", t, Some(&order("after-close", 1)));
    assert!(status == 201 || status >= 500, "{status} {body}");
    server.wait_for(WAIT, |s| {
        let (status, _) = s.call("POST", "/v1/runs", t, Some(&order("after-close", 1)));
        let (_, run) = s.call("GET", "/v1/runs/after-close", t, None);
        (status < 500 && run["run"]["status"] == "completed").then_some(())
    });
    let (status, text) = server.text("/metrics");
    assert_eq!(status, 200);
    assert!(text.contains("tidemark_runs{tenant=\"acme\",status=\"completed\"}"), "{text}");
    println!("requests failed by the closed connections: {failed}");
}

/// A service whose URL asks for TLS (`sslmode=require`, the server's own certificate as
/// `sslrootcert`, the host by the name the certificate names) makes every connection encrypted:
/// the token command's, the control store's, each tenant's stores' (acting as the tenant's role)
/// and the relay's. Skipped, saying why, when the server has `ssl = off` or its certificate does
/// not name `localhost`.
#[test]
fn a_service_on_postgres_connects_over_tls_when_its_url_asks() {
    let Some(_postgres) = crate::workflow_cli::on_postgres() else { return };
    let _schemas = crate::server_support::DropServedSchemas;
    let (_, mut client) = crate::support::postgres_server().unwrap();
    let ssl: String = client.query_one("SHOW ssl", &[]).unwrap().get(0);
    let cert: String = client.query_one("SHOW ssl_cert_file", &[]).unwrap().get(0);
    let names_localhost = std::fs::read_to_string(&cert).is_ok_and(|pem| {
        use tokio_rustls::rustls::pki_types::{pem::PemObject, CertificateDer};
        CertificateDer::from_pem_slice(pem.as_bytes()).is_ok_and(|der| der.windows(9).any(|w| w == b"localhost"))
    });
    if ssl != "on" || !names_localhost {
        crate::support::skip(&format!(
            "the test server's TLS (ssl = {ssl}, {cert}) is not usable by the name localhost"
        ));
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let name = format!("tmtls{}", std::process::id());
    let store = crate::server_support::store_of(&data).unwrap();
    assert!(store.contains("@127.0.0.1:"), "the test server is on the loopback: {store}");
    let store = format!(
        "{}&sslmode=require&sslrootcert={cert}&application_name={name}",
        store.replace("@127.0.0.1:", "@localhost:")
    );
    crate::server_support::set_store(&data, &store);
    let admin = token(&data, "acme", "admin");
    let t = Some(admin.as_str());
    let server = Server::start(&data, &[], &[]);
    server.call("PUT", "/v1/consumers/shipping", t, Some(&json!({"handler": "reservation"})));
    let advance = json!({"expected_seq": 0, "to": "reserved", "quantity": 1});
    let (status, body) = server.call("POST", "/v1/flows/tls-1/advance", t, Some(&advance));
    assert_eq!(status, 200, "{body}");
    server.wait_for(WAIT, |s| {
        let (_, flow) = s.call("GET", "/v1/flows/tls-1", t, None);
        (flow["consumers"][0]["high_water_seq"] == 1).then_some(())
    });
    let row = client
        .query_one(
            "SELECT count(*), count(*) FILTER (WHERE s.ssl)
               FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) WHERE a.application_name = $1",
            &[&name],
        )
        .unwrap();
    let (connections, encrypted): (i64, i64) = (row.get(0), row.get(1));
    assert!(connections >= 4, "the service's connections: {connections}");
    assert_eq!(encrypted, connections, "every connection of the service is encrypted");
}

/// A run holding its most events no wait consumed yet answers the next send 429
/// `run_events_full` (a client may send it again later) and keeps nothing of it; a duplicate of
/// an event it holds is still `duplicate`.
#[test]
fn a_send_to_a_full_run_is_429_run_events_full_and_writes_nothing() {
    use tidemark_core::workflow::RUN_EVENTS_HELD_MAX;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let admin = token(&data, "acme", "admin");
    let server = Server::start(&data, &[], &[]);
    let t = Some(admin.as_str());
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    let mut body = order("r1", 1);
    body["start_at_ms"] = json!(now + 3_600_000);
    let (status, answer) = server.call("POST", "/v1/runs", t, Some(&body));
    assert_eq!(status, 201, "{answer}");
    let workflows = rusqlite::Connection::open(data.join("tenants").join("acme").join("workflows.db")).unwrap();
    workflows.busy_timeout(Duration::from_secs(10)).unwrap();
    workflows
        .execute(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
             INSERT INTO run_events (run_id, event_id, name, payload, received_at_ms)
             SELECT 'r1', 'e' || i, 'approval', '{}', ?2 + i FROM n",
            [RUN_EVENTS_HELD_MAX as i64, now],
        )
        .unwrap();
    let held = || -> i64 { workflows.query_row("SELECT count(*) FROM run_events", [], |r| r.get(0)).unwrap() };
    let event = |id: &str| json!({"name": "approval", "event_id": id, "payload": {}});
    let (status, answer) = server.call("POST", "/v1/runs/r1/events", t, Some(&event("over")));
    assert_eq!((status, answer["error"]["code"].as_str()), (429, Some("run_events_full")), "{answer}");
    assert_eq!(held(), RUN_EVENTS_HELD_MAX as i64);
    let (status, answer) = server.call("POST", "/v1/runs/r1/events", t, Some(&event("e1")));
    assert_eq!((status, answer["outcome"].as_str()), (200, Some("duplicate")), "{answer}");
    // One consumed (as a wait would): the next send is kept.
    workflows.execute("UPDATE run_events SET consumed_by_seq = 0 WHERE event_id = 'e1'", []).unwrap();
    let (status, answer) = server.call("POST", "/v1/runs/r1/events", t, Some(&event("over")));
    assert_eq!((status, answer["outcome"].as_str()), (200, Some("sent")), "{answer}");
    assert_eq!(held(), RUN_EVENTS_HELD_MAX as i64 + 1);
}
