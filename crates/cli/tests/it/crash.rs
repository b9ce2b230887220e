//! Crash tests: every name in `CRASH_POINTS` is reached by the real binary (the process exits
//! with the crash code there), and fresh processes afterwards prove that nothing was lost,
//! nothing was applied twice, the interrupted step is either fully committed or fully absent,
//! and a retry completes. Needs the `failpoints` feature.
//!
//! The last point, `unsafe_dual_write.between_commits`, is on the deliberately wrong dual-write
//! path: there the test shows the loss that the real `advance` never allows.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde_json::{json, Value};
use tidemark_core::crash::{exit_code, CRASH_POINTS};

use crate::support::{self, ok, path_str, run_with, Setup};
use crate::workflow_cli::{order as wf_order, refs, run_env, Wf};

pub(crate) const SOURCE: &str = "shop";

// ---------------------------------------------------------------------------------------------
// Helpers shared with the concurrency tests.

pub(crate) fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// `tidemark advance ...` as arguments.
pub(crate) fn advance_cmd(
    producer: &str,
    flow: &str,
    expected_seq: i64,
    to: &str,
    quantity: Option<i64>,
) -> Vec<String> {
    let mut args: Vec<String> =
        ["advance", "--producer", producer, "--flow", flow, "--to", to].iter().map(|s| s.to_string()).collect();
    args.extend(["--expected-seq".to_string(), expected_seq.to_string()]);
    if let Some(q) = quantity {
        args.extend(["--quantity".to_string(), q.to_string()]);
    }
    args
}

/// Advance and require `committed`; returns the output.
pub(crate) fn advance(s: &Setup, flow: &str, expected_seq: i64, to: &str, quantity: Option<i64>) -> Value {
    let out = ok(&strs(&advance_cmd(s.p(), flow, expected_seq, to, quantity)));
    assert_eq!(out["outcome"], "committed", "advance {flow} {expected_seq} {to}: {out}");
    assert_eq!(out["seq"], expected_seq + 1, "{out}");
    out
}

pub(crate) fn producer_snapshot(s: &Setup) -> Value {
    ok(&["snapshot", "--producer", s.p(), "--rows-max", "100000"])["producer"].clone()
}

pub(crate) fn consumer_snapshot(s: &Setup) -> Value {
    ok(&["snapshot", "--consumer-db", s.c(), "--rows-max", "100000"])["consumer"].clone()
}

pub(crate) fn array<'a>(value: &'a Value, key: &str) -> &'a Vec<Value> {
    value[key].as_array().unwrap_or_else(|| panic!("{key} is not an array in {value}"))
}

/// Milliseconds since the epoch, an hour from now: a relay at this clock finds every delivery
/// due, including those waiting in a backoff.
fn later_ms() -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis();
    (now + 3_600_000).to_string()
}

pub(crate) fn relay(s: &Setup) -> Value {
    ok(&["relay", "--producer", s.p(), "--until-idle", "--passes", "1000", "--verbose"])
}

/// The consumers subscribed to the producer.
pub(crate) fn subscribers(s: &Setup) -> Vec<String> {
    array(&producer_snapshot(s), "subscriptions")
        .iter()
        .map(|sub| sub["consumer_id"].as_str().expect("consumer_id").to_string())
        .collect()
}

/// Drain one consumer until nothing more can be applied (bounded); returns the last report.
pub(crate) fn drain(s: &Setup, consumer: &str) -> Value {
    for _ in 0..100 {
        let out = ok(&["drain", "--consumer-db", s.c(), "--consumer-id", consumer]);
        if out["outcome"] != "limit" {
            return out;
        }
    }
    panic!("drain of {consumer} did not finish in 100 calls");
}

/// Retry relay (with every backoff elapsed) and drain every subscriber.
pub(crate) fn settle(s: &Setup) {
    ok(&["--now-ms", &later_ms(), "relay", "--producer", s.p(), "--until-idle", "--passes", "1000"]);
    for consumer in subscribers(s) {
        drain(s, &consumer);
    }
}

/// No (consumer, source, flow, seq) has more than one effect, read straight from the consumer
/// store (the file, or the schema's table).
pub(crate) fn assert_no_duplicate_effects(s: &Setup) {
    let duplicates = s.duplicate_effects();
    assert!(duplicates.is_empty(), "events applied twice: {duplicates:?}");
}

/// Events of the outbox per flow, in seq order: (seq, event_id).
fn outbox_by_flow(producer: &Value) -> BTreeMap<String, Vec<(i64, String)>> {
    let mut by_flow: BTreeMap<String, Vec<(i64, String)>> = BTreeMap::new();
    for event in array(producer, "outbox") {
        by_flow
            .entry(event["flow_id"].as_str().expect("flow_id").to_string())
            .or_default()
            .push((event["seq"].as_i64().expect("seq"), event["event_id"].as_str().expect("event_id").to_string()));
    }
    for events in by_flow.values_mut() {
        events.sort();
    }
    by_flow
}

/// Every flow's state change has its events: the outbox holds seqs 1..=last_seq of each flow.
pub(crate) fn assert_state_has_its_events(producer: &Value) {
    let by_flow = outbox_by_flow(producer);
    for flow in array(producer, "flows") {
        let flow_id = flow["flow_id"].as_str().expect("flow_id");
        let last_seq = flow["last_seq"].as_i64().expect("last_seq");
        let seqs: Vec<i64> = by_flow.get(flow_id).map(|e| e.iter().map(|(seq, _)| *seq).collect()).unwrap_or_default();
        assert_eq!(seqs, (1..=last_seq).collect::<Vec<_>>(), "flow {flow_id} is at seq {last_seq} without its events");
    }
}

/// After a final relay + drain: every committed event reached every subscriber's projection
/// exactly once and in order, and every delivery is accepted.
pub(crate) fn assert_converged(s: &Setup) {
    let producer = producer_snapshot(s);
    let consumer = consumer_snapshot(s);
    assert_state_has_its_events(&producer);
    for delivery in array(&producer, "deliveries") {
        assert_eq!(delivery["status"], "accepted", "delivery not acked: {delivery}");
    }
    let outbox = outbox_by_flow(&producer);
    let mut effects: BTreeMap<(String, String), Vec<(i64, String)>> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for effect in array(&consumer, "reservation_effects") {
        let key =
            (effect["consumer_id"].as_str().unwrap().to_string(), effect["flow_id"].as_str().unwrap().to_string());
        let seq = effect["seq"].as_i64().unwrap();
        assert_eq!(effect["source"], SOURCE);
        assert!(seen.insert((key.clone(), seq)), "effect applied twice: {effect}");
        effects.entry(key).or_default().push((seq, effect["event_id"].as_str().unwrap().to_string()));
    }
    let projections: BTreeMap<(String, String), &Value> = array(&consumer, "reservation_projection")
        .iter()
        .map(|p| ((p["consumer_id"].as_str().unwrap().to_string(), p["flow_id"].as_str().unwrap().to_string()), p))
        .collect();
    let subscribers = subscribers(s);
    for flow in array(&producer, "flows") {
        let flow_id = flow["flow_id"].as_str().unwrap().to_string();
        for consumer_id in &subscribers {
            let key = (consumer_id.clone(), flow_id.clone());
            let projection =
                projections.get(&key).unwrap_or_else(|| panic!("{consumer_id} never saw flow {flow_id}: lost"));
            assert_eq!(projection["state"], flow["state"], "{consumer_id}/{flow_id}: {projection} vs {flow}");
            assert_eq!(projection["last_seq"], flow["last_seq"], "{consumer_id}/{flow_id}");
            assert_eq!(projection["quantity"], flow["data"]["quantity"], "{consumer_id}/{flow_id}");
            // Effects in effect_id order are the flow's events, 1..=n, each once.
            assert_eq!(effects.get(&key), outbox.get(&flow_id), "effects of {consumer_id}/{flow_id}");
        }
    }
    let expected_effects: usize = outbox.values().map(Vec::len).sum::<usize>() * subscribers.len();
    assert_eq!(seen.len(), expected_effects, "effects for unsubscribed consumers or unknown flows");
    assert_no_duplicate_effects(s);
}

// ---------------------------------------------------------------------------------------------
// Crash helpers.

/// Run with `TIDEMARK_CRASH_AT=point` and require that the process died at that point.
fn crash_at(point: &str, args: &[&str]) -> support::Run {
    let name = point.split('@').next().expect("a name");
    let r = run_with(args, &[("TIDEMARK_CRASH_AT", point)], None);
    assert_eq!(
        r.code,
        exit_code(name),
        "tidemark {args:?} with TIDEMARK_CRASH_AT={point} did not die there:\n{}\n{}",
        r.stdout,
        r.stderr
    );
    assert!(r.stderr.contains(&format!("crash point {name} reached")), "{}", r.stderr);
    assert!(r.stdout.is_empty(), "a crashed process printed an answer: {}", r.stdout);
    r
}

fn world() -> Setup {
    Setup::new(&["audit", "search"])
}

/// r1: reserved(3) -> confirmed; r2: reserved(5). Three events.
fn seed(s: &Setup) {
    advance(s, "r1", 0, "reserved", Some(3));
    advance(s, "r1", 1, "confirmed", None);
    advance(s, "r2", 0, "reserved", Some(5));
}

fn write_envelope(s: &Setup, name: &str, envelope: &Value) -> String {
    let path = s.dir.path().join(name);
    std::fs::write(&path, envelope.to_string()).expect("write envelope");
    path_str(&path).to_string()
}

fn receive(s: &Setup, consumer: &str, file: &str) -> Value {
    ok(&["receive", "--consumer-db", s.c(), "--consumer-id", consumer, "--file", file])
}

/// Hand every outbox event to `consumer` again, by hand; each must answer `duplicate`.
fn replay_all(s: &Setup, consumer: &str) {
    for (i, event) in array(&producer_snapshot(s), "outbox").iter().enumerate() {
        let file = write_envelope(s, &format!("replay-{i}.json"), event);
        let out = receive(s, consumer, &file);
        assert_eq!(out["outcome"], "duplicate", "replayed event {event}: {out}");
    }
}

fn delivery_statuses(producer: &Value) -> Vec<String> {
    array(producer, "deliveries").iter().map(|d| d["status"].as_str().unwrap().to_string()).collect()
}

fn inbox_of<'a>(consumer: &'a Value, consumer_id: &str) -> Vec<&'a Value> {
    array(consumer, "inbox").iter().filter(|r| r["consumer_id"] == consumer_id).collect()
}

// ---------------------------------------------------------------------------------------------
// One scenario per crash point.

/// The advance is rolled back whole; the same advance with the same expected_seq then commits.
fn advance_before_commit(point: &str) {
    let s = world();
    advance(&s, "r1", 0, "reserved", Some(3));
    settle(&s);
    let before = producer_snapshot(&s);
    crash_at(point, &strs(&advance_cmd(s.p(), "r1", 1, "confirmed", None)));
    assert_eq!(producer_snapshot(&s), before, "a rolled-back advance left traces");
    advance(&s, "r1", 1, "confirmed", None);
    settle(&s);
    assert_converged(&s);
}

/// The advance is committed whole (state, event, deliveries); a retry is `stale`.
fn advance_after_commit(point: &str) {
    let s = world();
    advance(&s, "r1", 0, "reserved", Some(3));
    crash_at(point, &strs(&advance_cmd(s.p(), "r1", 1, "confirmed", None)));
    let producer = producer_snapshot(&s);
    let flow = &array(&producer, "flows")[0];
    assert_eq!((flow["state"].as_str(), flow["last_seq"].as_i64()), (Some("confirmed"), Some(2)));
    assert_state_has_its_events(&producer);
    assert_eq!(delivery_statuses(&producer), ["pending"; 4], "each event queued for both subscribers");
    let retry = ok(&strs(&advance_cmd(s.p(), "r1", 1, "confirmed", None)));
    assert_eq!((retry["outcome"].as_str(), retry["current_seq"].as_i64()), (Some("stale"), Some(2)), "{retry}");
    settle(&s);
    assert_converged(&s);
    advance(&s, "r1", 2, "released", None);
    settle(&s);
    assert_converged(&s);
}

/// The consumer committed, the producer did not record it: the redelivery is answered
/// `duplicate` and then acked.
fn relay_consumer_committed_only(point: &str) {
    let s = world();
    seed(&s);
    let before = producer_snapshot(&s);
    crash_at(point, &["relay", "--producer", s.p()]);
    assert_eq!(producer_snapshot(&s), before, "the producer recorded verdicts it never committed");
    let consumer = consumer_snapshot(&s);
    assert_eq!(array(&consumer, "inbox").len(), 6, "the consumer's transaction was committed");
    let redelivery = relay(&s);
    assert_eq!((redelivery["duplicate"].as_u64(), redelivery["accepted"].as_u64()), (Some(6), Some(0)), "{redelivery}");
    assert!(array(&redelivery, "answers").iter().all(|a| a["answer"] == "duplicate"), "{redelivery}");
    assert_eq!(delivery_statuses(&producer_snapshot(&s)), ["accepted"; 6], "duplicates are acked");
    assert_eq!(consumer_snapshot(&s), consumer, "a duplicate changed the consumer");
    settle(&s);
    assert_converged(&s);
}

/// Both sides committed: nothing is due any more.
fn relay_after_producer_commit(point: &str) {
    let s = world();
    seed(&s);
    crash_at(point, &["relay", "--producer", s.p()]);
    assert_eq!(delivery_statuses(&producer_snapshot(&s)), ["accepted"; 6]);
    assert_eq!(array(&consumer_snapshot(&s), "inbox").len(), 6);
    assert_eq!(relay(&s)["attempted"], 0);
    settle(&s);
    assert_converged(&s);
}

/// The receive is rolled back (via the relay and via `receive`); the retry is `accepted`.
fn receive_before_commit(point: &str) {
    let s = world();
    advance(&s, "r1", 0, "reserved", Some(3));
    let (producer, consumer) = (producer_snapshot(&s), consumer_snapshot(&s));
    crash_at(point, &["relay", "--producer", s.p()]);
    assert_eq!(producer_snapshot(&s), producer);
    assert_eq!(consumer_snapshot(&s), consumer, "a rolled-back receive left traces");
    let file = write_envelope(&s, "e1.json", &array(&producer, "outbox")[0]);
    crash_at(point, &["receive", "--consumer-db", s.c(), "--consumer-id", "audit", "--file", &file]);
    assert_eq!(consumer_snapshot(&s), consumer, "a rolled-back receive left traces");
    assert_eq!(receive(&s, "audit", &file)["outcome"], "accepted");
    let out = relay(&s);
    let answers: BTreeSet<(String, String)> = array(&out, "answers")
        .iter()
        .map(|a| (a["consumer_id"].as_str().unwrap().into(), a["answer"].as_str().unwrap().into()))
        .collect();
    let expected: BTreeSet<(String, String)> =
        [("audit".into(), "duplicate".into()), ("search".into(), "accepted".into())].into();
    assert_eq!(answers, expected);
    settle(&s);
    assert_converged(&s);
}

/// The receive is committed; the redelivery is `duplicate`.
fn receive_after_commit(point: &str) {
    let s = world();
    advance(&s, "r1", 0, "reserved", Some(3));
    crash_at(point, &["relay", "--producer", s.p()]);
    assert_eq!(array(&consumer_snapshot(&s), "inbox").len(), 2);
    assert_eq!(delivery_statuses(&producer_snapshot(&s)), ["pending"; 2]);
    assert_eq!(relay(&s)["duplicate"], 2);
    advance(&s, "r1", 1, "confirmed", None);
    let event = array(&producer_snapshot(&s), "outbox")[1].clone();
    let file = write_envelope(&s, "e2.json", &event);
    crash_at(point, &["receive", "--consumer-db", s.c(), "--consumer-id", "audit", "--file", &file]);
    assert_eq!(inbox_of(&consumer_snapshot(&s), "audit").len(), 2, "the receive was committed");
    assert_eq!(receive(&s, "audit", &file)["outcome"], "duplicate");
    let out = relay(&s);
    assert_eq!((out["duplicate"].as_u64(), out["accepted"].as_u64()), (Some(1), Some(1)), "{out}");
    settle(&s);
    assert_converged(&s);
}

/// The handler's writes and the applied marks are rolled back together (drain and apply).
fn apply_rolled_back(point: &str) {
    let s = world();
    seed(&s);
    relay(&s);
    let before = consumer_snapshot(&s);
    crash_at(point, &["drain", "--consumer-db", s.c(), "--consumer-id", "audit"]);
    assert_eq!(consumer_snapshot(&s), before, "a rolled-back drain left effects or marks");
    crash_at(point, &["apply", "--consumer-db", s.c(), "--consumer-id", "audit", "--source", SOURCE, "--flow", "r1"]);
    assert_eq!(consumer_snapshot(&s), before, "a rolled-back apply left effects or marks");
    let applied = ok(&["apply", "--consumer-db", s.c(), "--consumer-id", "audit", "--source", SOURCE, "--flow", "r1"]);
    assert_eq!((applied["outcome"].as_str(), applied["seq"].as_i64()), (Some("applied"), Some(1)), "{applied}");
    assert_eq!(drain(&s, "audit")["applied"], 2);
    settle(&s);
    assert_converged(&s);
}

/// The drain (and the apply) is committed whole; the retry applies nothing again.
fn apply_after_commit(point: &str) {
    let s = world();
    seed(&s);
    relay(&s);
    crash_at(point, &["drain", "--consumer-db", s.c(), "--consumer-id", "audit"]);
    let consumer = consumer_snapshot(&s);
    let audit_effects = array(&consumer, "reservation_effects").iter().filter(|e| e["consumer_id"] == "audit").count();
    assert_eq!(audit_effects, 3, "the drain was committed");
    assert!(inbox_of(&consumer, "audit").iter().all(|r| r["status"] == "applied"));
    let retry = drain(&s, "audit");
    assert_eq!((retry["outcome"].as_str(), retry["applied"].as_u64()), (Some("idle"), Some(0)), "{retry}");
    let apply = ["apply", "--consumer-db", s.c(), "--consumer-id", "search", "--source", SOURCE, "--flow", "r1"];
    crash_at(point, &apply);
    let retry = ok(&apply);
    assert_eq!((retry["outcome"].as_str(), retry["seq"].as_i64()), (Some("applied"), Some(2)), "{retry}");
    let idle = ok(&apply);
    assert_eq!((idle["outcome"].as_str(), idle["high_water_seq"].as_i64()), (Some("idle"), Some(2)), "{idle}");
    assert_no_duplicate_effects(&s);
    settle(&s);
    assert_converged(&s);
}

fn prune_cmd(s: &Setup) -> [&str; 5] {
    ["prune", "--consumer-db", s.c(), "--applied-retention-ms", "0"]
}

fn prune_outbox_cmd(s: &Setup) -> [&str; 5] {
    ["prune", "--producer", s.p(), "--delivered-retention-ms", "0"]
}

/// After an outbox prune (every event settled, so all three go): the flows keep their seqs, the
/// next event of r2 is delivered and applied once by each subscriber, and nothing is redelivered.
fn assert_goes_on_after_outbox_prune(s: &Setup) {
    assert!(array(&producer_snapshot(s), "outbox").is_empty());
    let effects_before = array(&consumer_snapshot(s), "reservation_effects").len();
    advance(s, "r2", 1, "confirmed", None);
    settle(s);
    let producer = producer_snapshot(s);
    let outbox: Vec<(String, i64)> = array(&producer, "outbox")
        .iter()
        .map(|e| (e["flow_id"].as_str().unwrap().to_string(), e["seq"].as_i64().unwrap()))
        .collect();
    assert_eq!(outbox, [("r2".to_string(), 2)], "seqs continue after the prune");
    assert!(delivery_statuses(&producer).iter().all(|d| d == "accepted"), "{producer}");
    let consumer = consumer_snapshot(s);
    let effects = array(&consumer, "reservation_effects");
    assert_eq!(effects.len(), effects_before + 2, "one new effect per subscriber, nothing redelivered: {consumer}");
    for subscriber in ["audit", "search"] {
        let projection = array(&consumer, "reservation_projection")
            .iter()
            .find(|p| p["consumer_id"] == subscriber && p["flow_id"] == "r2")
            .expect("r2's projection");
        assert_eq!((projection["state"].as_str(), projection["last_seq"].as_i64()), (Some("confirmed"), Some(2)));
    }
    assert_no_duplicate_effects(s);
}

/// The prune is rolled back whole; replays stay `duplicate` before and after the retry.
fn prune_before_commit(point: &str) {
    let s = world();
    seed(&s);
    settle(&s);
    let before = consumer_snapshot(&s);
    crash_at(point, &prune_cmd(&s));
    assert_eq!(consumer_snapshot(&s), before, "a rolled-back prune left traces");
    replay_all(&s, "audit");
    assert_eq!(ok(&prune_cmd(&s))["consumer"]["compacted"], 6);
    let consumer = consumer_snapshot(&s);
    assert_eq!((array(&consumer, "inbox").len(), array(&consumer, "receipts").len()), (0, 6));
    replay_all(&s, "audit");
    replay_all(&s, "search");
    assert_eq!(drain(&s, "audit")["applied"], 0, "a pruned event was applied again");
    settle(&s);
    assert_converged(&s);
    // The producer side: an outbox prune killed before its commit deleted nothing.
    let before = producer_snapshot(&s);
    crash_at(point, &prune_outbox_cmd(&s));
    assert_eq!(producer_snapshot(&s), before, "a rolled-back outbox prune left traces");
    let out = ok(&prune_outbox_cmd(&s));
    assert_eq!(
        (out["producer"]["events_deleted"].as_u64(), out["producer"]["deliveries_deleted"].as_u64()),
        (Some(3), Some(6))
    );
    assert_goes_on_after_outbox_prune(&s);
}

/// The prune is committed: receipts keep dedup; a replay is `duplicate`, never applied twice.
fn prune_after_commit(point: &str) {
    let s = world();
    seed(&s);
    settle(&s);
    crash_at(point, &prune_cmd(&s));
    let consumer = consumer_snapshot(&s);
    assert_eq!((array(&consumer, "inbox").len(), array(&consumer, "receipts").len()), (0, 6));
    replay_all(&s, "audit");
    replay_all(&s, "search");
    assert_eq!(drain(&s, "search")["applied"], 0, "a pruned event was applied again");
    assert_eq!(ok(&prune_cmd(&s))["consumer"]["compacted"], 0);
    settle(&s);
    assert_converged(&s);
    // The producer side: the outbox prune is committed; run again, it finds nothing.
    crash_at(point, &prune_outbox_cmd(&s));
    assert!(array(&producer_snapshot(&s), "deliveries").is_empty());
    assert_eq!(ok(&prune_outbox_cmd(&s))["producer"]["events_deleted"], 0);
    assert_goes_on_after_outbox_prune(&s);
}

/// Move the consumer file away (and its WAL companions) or back; on PostgreSQL, rename the
/// consumer's schema.
fn move_consumer_file(s: &Setup, away: bool) {
    if s.on_postgres() {
        s.move_consumer_schema(away);
        return;
    }
    for suffix in ["", "-wal", "-shm"] {
        let here = format!("{}{suffix}", s.c());
        let there = format!("{}.away{suffix}", s.c());
        let (from, to) = if away { (here, there) } else { (there, here) };
        if Path::new(&from).exists() {
            std::fs::rename(&from, &to).expect("move consumer file");
        }
    }
}

/// The consumer file is restored from a backup taken before its last two events: the producer
/// holds them as delivered, so the flows stop at a gap. `outbox redeliver` is rolled back whole
/// when it dies before its commit; run again, it hands the events out again, the consumer answers
/// `duplicate` for what the backup holds and accepts what it lost, and each event is applied once.
fn redeliver_before_commit(point: &str) {
    let s = world();
    advance(&s, "r1", 0, "reserved", Some(3));
    relay(&s);
    for consumer in ["audit", "search"] {
        drain(&s, consumer);
    }
    // The backup: the consumer file checkpointed and copied (on PostgreSQL: the consumer schema
    // dumped with pg_dump).
    let backup = s.dir.path().join("consumer.backup");
    if s.on_postgres() {
        s.dump_consumer_schema(&backup);
    } else {
        let conn = rusqlite::Connection::open(s.c()).expect("open consumer file");
        conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)").expect("checkpoint");
        drop(conn);
        std::fs::copy(s.c(), &backup).expect("back up");
    }
    let lost = advance(&s, "r1", 1, "confirmed", None)["event_id"].as_str().unwrap().to_string();
    advance(&s, "r2", 0, "reserved", Some(5));
    relay(&s);
    for consumer in ["audit", "search"] {
        assert_eq!(drain(&s, consumer)["applied"], 2);
    }
    // The restore (on PostgreSQL: the schema dropped and restored with pg_restore).
    if s.on_postgres() {
        s.restore_consumer_schema(&backup);
    } else {
        for suffix in ["-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", s.c()));
        }
        std::fs::copy(&backup, s.c()).expect("restore");
    }
    advance(&s, "r1", 2, "released", None);
    relay(&s);
    let stuck = drain(&s, "audit");
    assert_eq!(stuck["outcome"], "gap", "the restored file misses r1's second event: {stuck}");

    let before = producer_snapshot(&s);
    let redeliver = ["outbox", "redeliver", "--producer", s.p(), "--consumer-id", "audit", "--from-event", &lost];
    crash_at(point, &redeliver);
    assert_eq!(producer_snapshot(&s), before, "a rolled-back redeliver left traces");
    let out = ok(&redeliver);
    assert_eq!((&out["redelivered"], &out["pruned"]), (&json!(3), &json!(0)), "{out}");
    let out = ok(&["outbox", "redeliver", "--producer", s.p(), "--consumer-id", "search", "--all"]);
    assert_eq!((&out["redelivered"], &out["pruned"]), (&json!(4), &json!(0)), "{out}");
    let report = relay(&s);
    assert_eq!((&report["accepted"], &report["duplicate"]), (&json!(4), &json!(3)), "{report}");
    settle(&s);
    assert_converged(&s);
}

/// `outbox resolve` and `inbox skip` share the point: each is rolled back whole, and its retry
/// completes.
fn resolve_before_commit(point: &str) {
    let s = world();
    advance(&s, "r1", 0, "reserved", Some(3));
    // Quarantine both deliveries: the consumer file is unreachable for the one allowed attempt.
    move_consumer_file(&s, true);
    let out = ok(&["relay", "--producer", s.p(), "--max-attempts", "1"]);
    assert_eq!(out["quarantined"], 2, "{out}");
    move_consumer_file(&s, false);
    let before = producer_snapshot(&s);
    let event = array(&before, "outbox")[0]["event_id"].as_str().unwrap().to_string();
    let resolve = |consumer: &'static str| -> Vec<String> {
        ["outbox", "resolve", "--producer", s.p(), "--event", event.as_str(), "--consumer-id", consumer]
            .into_iter()
            .chain(["--action", "requeue", "--reason", "consumer file restored"])
            .map(String::from)
            .collect()
    };
    crash_at(point, &strs(&resolve("audit")));
    assert_eq!(producer_snapshot(&s), before, "a rolled-back resolve left traces");
    for consumer in ["audit", "search"] {
        let out = ok(&strs(&resolve(consumer)));
        assert_eq!(out["delivery"]["status"], "pending", "{out}");
    }
    settle(&s);
    assert_converged(&s);

    // A v2 event blocks `audit` (no v2 decoder); `search` applies it with --support-v2.
    let v2 = ["advance", "--producer", s.p(), "--flow", "r2", "--expected-seq", "0", "--to", "reserved"];
    let out = ok(&[&v2[..], &["--quantity", "4", "--schema-version", "2"]].concat());
    let blocked_event = out["event_id"].as_str().unwrap().to_string();
    relay(&s);
    assert_eq!(drain(&s, "audit")["outcome"], "blocked");
    assert_eq!(ok(&["drain", "--consumer-db", s.c(), "--consumer-id", "search", "--support-v2"])["applied"], 1);
    let before = consumer_snapshot(&s);
    let skip = ["inbox", "skip", "--consumer-db", s.c(), "--consumer-id", "audit", "--event", &blocked_event];
    let skip = [&skip[..], &["--reason", "v2 not supported here"]].concat();
    crash_at(point, &skip);
    assert_eq!(consumer_snapshot(&s), before, "a rolled-back skip left traces");
    let out = ok(&skip);
    assert_eq!(out["record"]["status"], "skipped", "{out}");
    let cursors = ok(&["inbox", "cursors", "--consumer-db", s.c(), "--consumer-id", "audit"]);
    assert!(array(&cursors, "cursors").iter().any(|c| c["flow_id"] == "r2" && c["high_water_seq"] == 1), "{cursors}");
    assert_eq!(drain(&s, "audit")["outcome"], "idle");
    let consumer = consumer_snapshot(&s);
    let audit_r2 =
        array(&consumer, "reservation_effects").iter().any(|e| e["consumer_id"] == "audit" && e["flow_id"] == "r2");
    assert!(!audit_r2, "a skipped event was applied");
    assert_no_duplicate_effects(&s);
}

fn rename_cmd(s: &Setup) -> [&str; 9] {
    ["rename-consumer", "--consumer-db", s.c(), "--from", "audit", "--to", "audit2", "--producer", s.p()]
}

/// The consumer rename is rolled back whole (and the producer never reached); the retry completes.
fn rename_before_commit(point: &str) {
    let s = world();
    seed(&s);
    settle(&s);
    let (producer, consumer) = (producer_snapshot(&s), consumer_snapshot(&s));
    crash_at(point, &rename_cmd(&s));
    assert_eq!(producer_snapshot(&s), producer);
    assert_eq!(consumer_snapshot(&s), consumer, "a rolled-back rename left traces");
    let out = ok(&rename_cmd(&s));
    assert_eq!((out["outcome"].as_str(), out["consumer"]["inbox"].as_u64()), (Some("renamed"), Some(3)), "{out}");
    assert_eq!(out["producer_deliveries_moved"], 3);
    advance(&s, "r2", 1, "confirmed", None);
    settle(&s);
    assert_eq!(subscribers(&s), ["audit2", "search"]);
    assert_converged(&s);
}

/// Killed after the consumer file's rename and before the producer's: the retry of the same
/// command completes the producer half, and events queued meanwhile reach the new id.
fn rename_after_commit(point: &str) {
    let s = world();
    seed(&s);
    settle(&s);
    crash_at(point, &rename_cmd(&s));
    let cursors = ok(&["inbox", "cursors", "--consumer-db", s.c(), "--consumer-id", "audit2"]);
    assert_eq!(array(&cursors, "cursors").len(), 2, "the consumer half was committed: {cursors}");
    assert_eq!(subscribers(&s), ["audit", "search"], "the producer half never ran");
    // Meanwhile an event for the old id is refused (retried later), never applied under it.
    advance(&s, "r2", 1, "confirmed", None);
    let out = relay(&s);
    let audit = array(&out, "answers").iter().find(|a| a["consumer_id"] == "audit").cloned().expect("an answer");
    assert_eq!((audit["answer"].as_str(), audit["verdict"].as_str()), (Some("conflict"), Some("retry")), "{out}");
    let out = ok(&rename_cmd(&s));
    assert_eq!(out["outcome"], "renamed", "the retry must complete: {out}");
    assert_eq!(out["consumer"]["inbox"], 0, "nothing left to move in the consumer file: {out}");
    assert_eq!(out["producer_deliveries_moved"], 4);
    settle(&s);
    assert_eq!(subscribers(&s), ["audit2", "search"]);
    assert_converged(&s);
}

/// Rewrite a current consumer file into the schema-v4 layout (the consumer tables keyed by
/// consumer id, source, flow id), rows and all, as a file written by the previous release.
fn downgrade_consumer_file_to_v4(path: &Path) {
    let conn = rusqlite::Connection::open(path).expect("open the consumer file");
    let version: String =
        conn.query_row("SELECT value FROM meta WHERE key = 'schema_version'", [], |r| r.get(0)).expect("version");
    assert_eq!(version, "12", "this downgrade is written for schema v12 -> v4");
    conn.execute_batch(
        "BEGIN IMMEDIATE;
         CREATE TABLE inbox_v4 (
             consumer_id TEXT NOT NULL, source TEXT NOT NULL, flow_id TEXT NOT NULL,
             seq INTEGER NOT NULL CHECK (seq >= 1), event_id TEXT NOT NULL, generation TEXT NOT NULL,
             event_type TEXT NOT NULL, schema_version INTEGER NOT NULL, payload TEXT NOT NULL,
             content_hash TEXT NOT NULL, created_at_ms INTEGER NOT NULL, received_at_ms INTEGER NOT NULL,
             status TEXT NOT NULL CHECK ((status = 'pending' OR status = 'applied' OR status = 'blocked' OR status = 'skipped')),
             reason TEXT, status_at_ms INTEGER NOT NULL,
             PRIMARY KEY (consumer_id, source, flow_id, seq)) WITHOUT ROWID;
         INSERT INTO inbox_v4 SELECT consumer_id, source, flow_id, seq, event_id, generation, event_type,
             schema_version, payload, content_hash, created_at_ms, received_at_ms, status, reason, status_at_ms
           FROM inbox;
         DROP TABLE inbox;
         ALTER TABLE inbox_v4 RENAME TO inbox;
         CREATE UNIQUE INDEX inbox_event ON inbox (consumer_id, event_id);
         CREATE INDEX inbox_open ON inbox (consumer_id, source, flow_id, seq) WHERE status IN ('pending', 'blocked');
         CREATE INDEX inbox_done_age ON inbox (status_at_ms) WHERE status IN ('applied', 'skipped');
         CREATE INDEX outbox_age ON outbox (created_at_ms);
         CREATE TABLE receipts_v4 (
             consumer_id TEXT NOT NULL, source TEXT NOT NULL, flow_id TEXT NOT NULL, seq INTEGER NOT NULL,
             event_id TEXT NOT NULL, content_hash TEXT NOT NULL, created_at_ms INTEGER NOT NULL,
             PRIMARY KEY (consumer_id, source, flow_id, seq)) WITHOUT ROWID;
         INSERT INTO receipts_v4 SELECT consumer_id, source, flow_id, seq, event_id, content_hash, created_at_ms
           FROM receipts;
         DROP TABLE receipts;
         ALTER TABLE receipts_v4 RENAME TO receipts;
         CREATE UNIQUE INDEX receipts_event ON receipts (consumer_id, event_id);
         CREATE INDEX receipts_age ON receipts (created_at_ms);
         CREATE TABLE cursors_v4 (
             consumer_id TEXT NOT NULL, source TEXT NOT NULL, flow_id TEXT NOT NULL,
             high_water_seq INTEGER NOT NULL CHECK (high_water_seq >= 1),
             PRIMARY KEY (consumer_id, source, flow_id)) WITHOUT ROWID;
         INSERT INTO cursors_v4 SELECT * FROM cursors;
         DROP TABLE cursors;
         ALTER TABLE cursors_v4 RENAME TO cursors;
         DROP INDEX run_events_unconsumed;
         DROP INDEX runs_children;
         DROP INDEX runs_queue_waiting;
         DROP INDEX runs_queue_admitted;
         DROP INDEX runs_queue_in_progress;
         DROP INDEX runs_queue_dedup;
         DROP TABLE schedules;
         DROP TABLE queues;
         DROP TABLE run_published;
         ALTER TABLE runs DROP COLUMN parent_run_id;
         ALTER TABLE runs DROP COLUMN parent_seq;
         ALTER TABLE runs DROP COLUMN queue;
         ALTER TABLE runs DROP COLUMN priority;
         ALTER TABLE runs DROP COLUMN dedup_id;
         ALTER TABLE runs DROP COLUMN admitted_at_ms;
         ALTER TABLE runs DROP COLUMN deadline_ms;
         ALTER TABLE outbox DROP COLUMN traceparent;
         UPDATE meta SET value = '4' WHERE key = 'schema_version';
         COMMIT;",
    )
    .expect("downgrade to v4");
}

/// (schema version, first key column of the inbox) of a consumer file, read straight from it.
fn consumer_file_layout(path: &Path) -> (String, String) {
    let conn = rusqlite::Connection::open(path).expect("open the consumer file");
    let version = conn.query_row("SELECT value FROM meta WHERE key = 'schema_version'", [], |r| r.get(0));
    let first =
        conn.query_row("SELECT name FROM pragma_index_xinfo('sqlite_autoindex_inbox_1') WHERE seqno = 0", [], |r| {
            r.get(0)
        });
    (version.expect("version"), first.expect("key column"))
}

/// Opening a consumer file of schema v4 rebuilds its tables in one transaction. Killed before
/// that commit, the file is still a whole v4 file; the next open migrates it with every record,
/// receipt and cursor, and the pipeline goes on from there without losing or repeating an apply.
fn migrate_before_commit(point: &str) {
    let s = world();
    seed(&s);
    settle(&s);
    // Receipts too: compact the applied records of one consumer's flows.
    ok(&["prune", "--consumer-db", s.c(), "--applied-retention-ms", "0", "--batch-rows", "2"]);
    advance(&s, "r2", 1, "confirmed", None);
    relay(&s);
    let before = consumer_snapshot(&s);
    assert!(!array(&before, "receipts").is_empty() && !array(&before, "inbox").is_empty(), "{before}");
    downgrade_consumer_file_to_v4(&s.consumer);
    assert_eq!(consumer_file_layout(&s.consumer), ("4".to_string(), "consumer_id".to_string()));
    crash_at(point, &["snapshot", "--consumer-db", s.c(), "--rows-max", "100000"]);
    assert_eq!(
        consumer_file_layout(&s.consumer),
        ("4".to_string(), "consumer_id".to_string()),
        "a migration killed before its commit left the file changed"
    );
    // Everything comes back but the receipts' generations, which a v4 file did not keep.
    let mut expected = before.clone();
    for receipt in expected["receipts"].as_array_mut().expect("receipts") {
        assert!(receipt["generation"].is_string(), "a v8 receipt keeps its generation: {receipt}");
        receipt["generation"] = Value::Null;
    }
    assert_eq!(consumer_snapshot(&s), expected, "the migration changed what the file holds");
    assert_eq!(consumer_file_layout(&s.consumer), ("12".to_string(), "flow_id".to_string()));
    // Replays of the pruned, the applied and the pending events are all recognised.
    replay_all(&s, "audit");
    replay_all(&s, "search");
    settle(&s);
    assert_converged(&s);
}

/// The deliberately wrong dual write: killed between its two commits, the flow says `reserved`
/// but no event exists, and no consumer ever sees it. The real `advance` killed at any of its
/// points never leaves that state.
fn unsafe_dual_write_between_commits(point: &str) {
    let s = Setup::new(&["audit"]);
    let unsafe_cmd = |flow: &str, expected: &str, to: &str, quantity: Option<&str>| -> Vec<String> {
        let mut args =
            vec!["unsafe-dual-write-advance", "--producer", s.p(), "--flow", flow, "--expected-seq", expected];
        args.extend(["--to", to]);
        if let Some(q) = quantity {
            args.extend(["--quantity", q]);
        }
        args.into_iter().map(String::from).collect()
    };
    crash_at(point, &strs(&unsafe_cmd("r1", "0", "reserved", Some("3"))));
    let producer = producer_snapshot(&s);
    let flow = &array(&producer, "flows")[0];
    assert_eq!((flow["flow_id"].as_str(), flow["state"].as_str()), (Some("r1"), Some("reserved")));
    assert!(array(&producer, "outbox").is_empty(), "the event was never written");
    assert!(array(&producer, "deliveries").is_empty());
    settle(&s);
    let consumer = consumer_snapshot(&s);
    assert!(array(&consumer, "inbox").is_empty() && array(&consumer, "reservation_projection").is_empty());
    // The flow moves on; its consumer can never catch up: seq 1 is lost for good.
    advance(&s, "r1", 1, "confirmed", None);
    settle(&s);
    let apply = ok(&["apply", "--consumer-db", s.c(), "--consumer-id", "audit", "--source", SOURCE, "--flow", "r1"]);
    assert_eq!((apply["outcome"].as_str(), apply["missing_seq"].as_i64()), (Some("gap"), Some(1)), "{apply}");
    assert!(array(&consumer_snapshot(&s), "reservation_projection").is_empty(), "the consumer never sees r1");
    // Without a crash the wrong path looks fine, which is why it survives in real code.
    let out = ok(&strs(&unsafe_cmd("r2", "0", "reserved", Some("2"))));
    assert_eq!(out["outcome"], "committed");
    settle(&s);
    assert!(array(&consumer_snapshot(&s), "reservation_projection").iter().any(|p| p["flow_id"] == "r2"));

    // The real advance, killed at each of its points, never leaves a state without its event.
    let advance_points: Vec<&str> = CRASH_POINTS.iter().copied().filter(|p| p.starts_with("advance.")).collect();
    assert!(advance_points.len() >= 2, "{advance_points:?}");
    for real_point in advance_points {
        let s = Setup::new(&["audit"]);
        crash_at(real_point, &strs(&advance_cmd(s.p(), "r1", 0, "reserved", Some(3))));
        assert_state_has_its_events(&producer_snapshot(&s));
        crash_at(real_point, &strs(&advance_cmd(s.p(), "r2", 0, "reserved", Some(4))));
        assert_state_has_its_events(&producer_snapshot(&s));
        settle(&s);
        assert_converged(&s);
    }
}

// ---------------------------------------------------------------------------------------------
// Durable workflows: `tidemark workflow ...` and `tidemark worker` processes killed at the
// workflow crash points, then fresh worker processes. Every run must end `completed` or
// `compensated` (or as the operator asked), no transactional step applied twice, stock
// consistent, and every external step's calls under one idempotency key.

/// The workflow crash points are also reached one level down, by store calls in child
/// processes (workflow_store.rs checks that list against `CRASH_POINTS`). Here each has a
/// scenario through the real CLI.
pub(crate) const REACHED_BY_WORKFLOW_STORE_TESTS: &[&str] = &[
    "workflow.start.before_commit",
    "workflow.claim.after_commit",
    "workflow.commit.before_commit",
    "workflow.commit.after_commit",
    "workflow.operator.before_commit",
    "workflow.purge.before_commit",
];

/// Upper bound of the n in `<point>@<n>` a worker is killed at, for one world.
const WORKFLOW_COMMITS_MAX: u32 = 200;

fn days_from_now(days: i64) -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis() as i64;
    (now + days * 86_400_000).to_string()
}

/// The start is rolled back whole; the same start then commits and the run completes.
fn workflow_start_before_commit(point: &str) {
    let w = Wf::new();
    let input = wf_order("o1", 2, json!({"flaky_attempts": 1}));
    crash_at(point, &refs(&w.start_cmd("order_saga", "o1", &input)));
    let shown = support::run(&refs(&w.cmd("show", &["--run-id", "o1"])));
    assert_eq!(shown.json["error"]["code"], "not_found", "the interrupted start is absent: {}", shown.stdout);
    assert_eq!(w.wf("list", &[])["runs"], json!([]));
    w.start("order_saga", "o1", &input);
    w.drive(&["o1"], &[]);
    assert_eq!(w.status("o1"), "completed");
    w.assert_consistent();
}

/// The dead worker's lease was committed: nobody takes the run until it expires; then a fresh
/// worker recovers it and finishes it.
fn workflow_claim_after_commit(point: &str) {
    let w = Wf::new();
    w.start("order_saga", "o1", &wf_order("o1", 2, json!({"flaky_attempts": 1})));
    crash_at(point, &refs(&w.worker_cmd(&["--until-idle", "--worker-id", "doomed"])));
    let claimed = w.show("o1");
    assert_eq!(claimed["run"]["lease_owner"], "doomed", "{claimed}");
    assert_eq!(
        (claimed["run"]["status"].as_str(), claimed["journal"].as_array().map(Vec::len)),
        (Some("pending"), Some(0))
    );
    w.drive(&["o1"], &[]);
    let done = w.show("o1");
    assert_eq!(
        (done["run"]["status"].as_str(), done["run"]["recoveries"].as_u64()),
        (Some("completed"), Some(1)),
        "{done}"
    );
    w.assert_consistent();
}

/// A worker killed at the n-th journal commit, for every n until one gets through: three runs
/// (a saga through a flaky payment service, a saga that compensates in reverse order with a
/// flaky refund, and sleepy_order through an event and a timer), then fresh workers. Before the
/// commit, a killed external call is repeated with the same idempotency key (the payment
/// service answers `duplicate`); a killed transactional step rolled back with its journal entry.
fn workflow_commit(point: &str) {
    let mut crashes = 0;
    let mut duplicates = 0;
    let mut excused = 0;
    for n in 1..=WORKFLOW_COMMITS_MAX {
        let w = Wf::new();
        w.start("order_saga", "ok", &wf_order("ok", 2, json!({"flaky_attempts": 1})));
        w.start("order_saga", "undo", &wf_order("undo", 3, json!({"flaky_attempts": 1, "fail": "ship_order"})));
        w.start("sleepy_order", "nap", &wf_order("nap", 1, json!({"approval": "approve", "ship_after_ms": 1})));
        w.wf(
            "send-event",
            &["--run-id", "nap", "--name", "approve", "--event-id", "e1", "--payload", "{\"approved\": true}"],
        );
        let spec = format!("{point}@{n}");
        let doomed = w.worker_cmd(&["--until-idle", "--worker-id", "doomed", "--concurrency", "1"]);
        let r = run_env(&doomed, &[("TIDEMARK_CRASH_AT", &spec)]);
        if r.code == 0 {
            // Fewer commits than n: the whole work went through; nothing more to kill.
            assert!(n > 10, "only {n} commits for three runs? {}", r.stdout);
            break;
        }
        assert_eq!(r.code, exit_code(point), "worker at {spec}:\n{}\n{}", r.stdout, r.stderr);
        assert!(r.stderr.contains(&format!("crash point {point} reached")), "{}", r.stderr);
        crashes += 1;
        // The runs the dead worker held: each is taken over once after its lease ran out.
        let runs = ["ok", "undo", "nap"];
        let held_at_crash = runs.iter().filter(|id| w.show(id)["run"]["lease_owner"] == "doomed").count() as u64;
        let leases_lost = w.drive(&runs, &[]);
        let statuses = [w.status("ok"), w.status("undo"), w.status("nap")];
        assert_eq!(statuses, ["completed", "compensated", "completed"], "after a crash at {spec}");
        // More takeovers than that: a lease ran out under a live worker, the dead one before its
        // crash included (a late heartbeat on a loaded machine; a killed process reports none).
        let takeovers: u64 = runs.iter().map(|id| w.show(id)["run"]["recoveries"].as_u64().unwrap()).sum();
        let leases_lost = leases_lost + takeovers.saturating_sub(held_at_crash);
        let undo: Vec<String> = w.show("undo")["journal"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["name"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(
            undo,
            [
                "reserve_inventory",
                "charge_payment",
                "ship_order",
                "compensate:charge_payment",
                "compensate:reserve_inventory"
            ]
        );
        assert_eq!(w.effects_of("ok"), ["reserve", "ship"], "after a crash at {spec}");
        assert_eq!(w.effects_of("undo"), ["reserve", "release"], "after a crash at {spec}");
        assert_eq!(w.effects_of("nap"), ["reserve", "ship"], "after a crash at {spec}");
        w.assert_consistent();
        let repeated = w.payment_calls().iter().filter(|c| c["outcome"] == "duplicate").count();
        if point != "workflow.commit.before_commit" && repeated > 0 {
            // After the commit nothing is repeated, unless a lease ran out under a live worker
            // of the recovery (a late heartbeat on a loaded machine): then the step may run
            // again, with its idempotency key. Anything else is a committed step run twice.
            let calls: Vec<Value> = w.payment_calls();
            assert!(
                leases_lost > 0,
                "a committed external step was called again after a crash at {spec} ({held_at_crash} runs held, \
                 {takeovers} takeovers): {calls:?}"
            );
            excused += repeated;
        } else {
            duplicates += repeated;
        }
    }
    eprintln!(
        "  {point}: killed at {crashes} commits, {duplicates} repeated payment calls \
         ({excused} more after a lease ran out under a live worker)"
    );
    assert!(crashes > 10, "the worker was killed at only {crashes} commits");
    if point == "workflow.commit.before_commit" {
        assert!(duplicates > 0, "no kill fell between a payment call and its journal entry");
    }
}

/// The worker killed at each commit of `order_batch` in turn: a parent stamping itself with
/// journaled values (`now`, `uuid`) and running two orders as child `order_saga`s (one completes,
/// one compensates), then fresh workers. Each child is started exactly once (its start commits
/// with the parent's journal entry), the parent sees both ends, and the values it reports are the
/// ones journaled at its first execution, whichever execution finished it.
fn workflow_commit_children(point: &str) {
    let mut crashes = 0;
    for n in 1..=WORKFLOW_COMMITS_MAX {
        let w = Wf::new();
        let orders: Vec<Value> = [wf_order("b-ok", 2, json!({})), wf_order("b-undo", 3, json!({"fail": "ship_order"}))]
            .iter()
            .map(|o| serde_json::from_str(o).unwrap())
            .collect();
        w.start("order_batch", "batch", &json!({"orders": orders}).to_string());
        let spec = format!("{point}@{n}");
        let doomed = w.worker_cmd(&["--until-idle", "--worker-id", "doomed", "--concurrency", "1"]);
        let r = run_env(&doomed, &[("TIDEMARK_CRASH_AT", &spec)]);
        if r.code == 0 {
            assert!(n > 8, "only {n} commits for a batch of two children? {}", r.stdout);
            break;
        }
        assert_eq!(r.code, exit_code(point), "worker at {spec}:\n{}\n{}", r.stdout, r.stderr);
        crashes += 1;
        w.drive(&["batch", "batch.2", "batch.4"], &[]);
        let batch = w.show("batch");
        assert_eq!(batch["run"]["status"], "completed", "after a crash at {spec}: {batch}");
        let result = &batch["run"]["result"];
        let ends: Vec<(&str, &str)> = result["orders"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| (o["order_id"].as_str().unwrap(), o["status"].as_str().unwrap()))
            .collect();
        assert_eq!(ends, [("b-ok", "completed"), ("b-undo", "not_completed")], "after a crash at {spec}");
        let journal = batch["journal"].as_array().unwrap();
        let shape: Vec<(&str, &str)> =
            journal.iter().map(|e| (e["kind"].as_str().unwrap(), e["name"].as_str().unwrap())).collect();
        assert_eq!(
            shape,
            [
                ("value", "now"),
                ("value", "uuid"),
                ("child", "order_saga"),
                ("publish", "progress"),
                ("child", "order_saga"),
                ("publish", "progress")
            ],
            "after a crash at {spec}"
        );
        assert_eq!(journal[0]["output"], result["started_at_ms"], "after a crash at {spec}");
        assert_eq!(journal[1]["output"], result["batch_token"], "after a crash at {spec}");
        // Exactly the two children, each a child of the batch, each run to its end once.
        let runs = w.wf("list", &[])["runs"].as_array().unwrap().clone();
        let ids: BTreeSet<&str> = runs.iter().map(|r| r["run_id"].as_str().unwrap()).collect();
        assert_eq!(ids, BTreeSet::from(["batch", "batch.2", "batch.4"]), "after a crash at {spec}");
        for (child, status) in [("batch.2", "completed"), ("batch.4", "compensated")] {
            let run = w.show(child)["run"].clone();
            assert_eq!((run["status"].as_str(), run["parent_run_id"].as_str()), (Some(status), Some("batch")));
        }
        assert_eq!(w.effects_of("b-ok"), ["reserve", "ship"], "after a crash at {spec}");
        assert_eq!(w.effects_of("b-undo"), ["reserve", "release"], "after a crash at {spec}");
        w.assert_consistent();
    }
    eprintln!("  {point} (order_batch): killed at {crashes} commits");
    assert!(crashes > 8, "the worker was killed at only {crashes} commits of the batch");
}

/// The worker killed at each commit of an `order_batch` that takes one order per run and
/// continues as a new run with the other (`ctx.continue_as_new`), then tells a waiting
/// `sleepy_order` it is done (`ctx.send`): the run that ends `continued` and its continuation's
/// start commit together, and the message commits with its journal entry, so after any crash
/// there is exactly one continuation, each order's child is started once, the chain's last run
/// completes with both ends, and the waiting order got one message and shipped.
fn workflow_commit_continued(point: &str) {
    let mut crashes = 0;
    for n in 1..=WORKFLOW_COMMITS_MAX {
        let w = Wf::new();
        let orders: Vec<Value> = [wf_order("c-ok", 2, json!({})), wf_order("c-undo", 3, json!({"fail": "ship_order"}))]
            .iter()
            .map(|o| serde_json::from_str(o).unwrap())
            .collect();
        w.start("sleepy_order", "ship", &wf_order("ship", 1, json!({"approval": "batch_done"})));
        let batch = json!({"orders": orders, "per_run": 1, "notify": "ship"});
        w.start("order_batch", "chain", &batch.to_string());
        let spec = format!("{point}@{n}");
        let doomed = w.worker_cmd(&["--until-idle", "--worker-id", "doomed", "--concurrency", "1"]);
        let r = run_env(&doomed, &[("TIDEMARK_CRASH_AT", &spec)]);
        if r.code == 0 {
            assert!(n > 8, "only {n} commits for a chain of two runs? {}", r.stdout);
            break;
        }
        assert_eq!(r.code, exit_code(point), "worker at {spec}:\n{}\n{}", r.stdout, r.stderr);
        crashes += 1;
        w.drive(&["chain", "chain.2", "chain.c1", "chain.c1.2", "ship"], &[]);
        let first = w.show("chain")["run"].clone();
        assert_eq!(first["status"], "continued", "after a crash at {spec}: {first}");
        assert_eq!(first["result"], json!({"continued_as": "chain.c1"}), "after a crash at {spec}");
        let last = w.show("chain.c1");
        assert_eq!(last["run"]["status"], "completed", "after a crash at {spec}: {last}");
        let ends: Vec<(&str, &str)> = last["run"]["result"]["orders"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| (o["order_id"].as_str().unwrap(), o["status"].as_str().unwrap()))
            .collect();
        assert_eq!(ends, [("c-ok", "completed"), ("c-undo", "not_completed")], "after a crash at {spec}");
        for (run, shape) in [
            ("chain", vec!["now", "uuid", "order_saga", "progress"]),
            ("chain.c1", vec!["now", "uuid", "order_saga", "progress", "batch_done"]),
        ] {
            let journal = w.show(run)["journal"].as_array().unwrap().clone();
            let names: Vec<&str> = journal.iter().map(|e| e["name"].as_str().unwrap()).collect();
            assert_eq!(names, shape, "{run} after a crash at {spec}");
        }
        // The message reached the waiting order once, and it went on.
        let ship = w.show("ship");
        assert_eq!(ship["run"]["status"], "completed", "after a crash at {spec}: {ship}");
        let events = ship["events"].as_array().unwrap();
        assert_eq!(events.len(), 1, "one message after a crash at {spec}: {events:?}");
        assert!(events[0]["event_id"].as_str().unwrap().starts_with("msg/4/"), "{events:?}");
        assert_eq!(events[0]["payload"], json!({"approved": true, "orders": 2}));
        let runs = w.wf("list", &[])["runs"].as_array().unwrap().clone();
        let ids: BTreeSet<&str> = runs.iter().map(|r| r["run_id"].as_str().unwrap()).collect();
        let expected = BTreeSet::from(["chain", "chain.2", "chain.c1", "chain.c1.2", "ship"]);
        assert_eq!(ids, expected, "after a crash at {spec}");
        assert_eq!(w.effects_of("c-ok"), ["reserve", "ship"], "after a crash at {spec}");
        assert_eq!(w.effects_of("c-undo"), ["reserve", "release"], "after a crash at {spec}");
        w.assert_consistent();
    }
    eprintln!("  {point} (order_batch, continued as new): killed at {crashes} commits");
    assert!(crashes > 8, "the worker was killed at only {crashes} commits of the chain");
}

/// Each operator command killed before its commit changes nothing; run again, it takes effect,
/// and the runs finish as the operator asked.
fn workflow_operator_before_commit(point: &str) {
    let w = Wf::new();
    w.start("sleepy_order", "retry", &wf_order("retry", 1, json!({"flaky_attempts": 3})));
    w.start("sleepy_order", "skip", &wf_order("skip", 1, json!({"fail": "charge_payment"})));
    w.start("sleepy_order", "src", &wf_order("src", 1, json!({"flaky_attempts": 3})));
    w.start("order_saga", "cancel", &wf_order("cancel", 2, json!({"ship_after_ms": 86_400_000})));
    w.start("sleepy_order", "abandon", &wf_order("abandon", 1, json!({"approval": "approve"})));
    w.drive(&["retry", "skip", "src"], &["--max-attempts", "2"]);
    let commands = [
        w.cmd("retry", &["--run-id", "retry", "--reason", "service back"]),
        w.cmd(
            "skip",
            &["--run-id", "skip", "--step", "2", "--output", "{\"charge_id\": \"manual\"}", "--reason", "paid"],
        ),
        w.cmd("fork", &["--run-id", "src", "--from-step", "2", "--new-run-id", "forked"]),
        w.cmd("cancel", &["--run-id", "cancel", "--reason", "customer"]),
        w.cmd("abandon", &["--run-id", "abandon", "--reason", "approver gone"]),
    ];
    for command in &commands {
        let before = w.wf("list", &[]);
        let details: Vec<Value> = ["retry", "skip", "src", "cancel", "abandon"].iter().map(|id| w.show(id)).collect();
        crash_at(point, &refs(command));
        assert_eq!(w.wf("list", &[]), before, "tidemark {command:?} killed before its commit changed runs");
        let after: Vec<Value> = ["retry", "skip", "src", "cancel", "abandon"].iter().map(|id| w.show(id)).collect();
        assert_eq!(after, details);
        ok(&refs(command));
    }
    w.drive(&["retry", "skip", "src", "forked", "cancel", "abandon"], &["--max-attempts", "5"]);
    let statuses: Vec<String> =
        ["retry", "skip", "src", "forked", "cancel", "abandon"].iter().map(|id| w.status(id)).collect();
    assert_eq!(statuses, ["completed", "completed", "failed", "completed", "cancelled", "cancelled"]);
    assert_eq!(w.effects_of("cancel"), ["reserve", "release"], "the cancelled saga compensated");
    assert_eq!(w.effects_of("src"), ["reserve", "ship"], "the fork reused the reservation and shipped it");
    w.assert_consistent();
}

/// A purge killed before its commit deletes nothing; killed in its second batch, the first
/// batch stays deleted; the retry finishes; receipts still recognise a late duplicate start.
fn workflow_purge_before_commit(point: &str) {
    let w = Wf::new();
    let ids = ["p1", "p2", "p3"];
    for id in ids {
        w.start("order_saga", id, &wf_order(id, 1, json!({})));
    }
    w.drive(&ids, &[]);
    let later = days_from_now(8);
    let purge = ["--now-ms", later.as_str(), "workflow", "purge", "--db", w.d(), "--batch-rows", "2"];
    let before = w.wf("list", &[]);
    crash_at(point, &purge);
    assert_eq!(w.wf("list", &[]), before, "a purge killed before its commit deleted runs");
    crash_at(&format!("{point}@2"), &purge);
    assert_eq!(w.wf("list", &[])["runs"].as_array().map(Vec::len), Some(1), "the first batch was committed");
    let out = ok(&purge);
    assert_eq!(out["runs_deleted"], 1, "{out}");
    for id in ids {
        let again = ok(&refs(&w.start_cmd("order_saga", id, &wf_order(id, 1, json!({})))));
        assert_eq!((again["outcome"].as_str(), again["status"].as_str()), (Some("existing"), Some("completed")));
    }
    w.assert_consistent();
}

/// A worker process killed with SIGKILL while a step holds its lease (after the first step was
/// journaled): another process takes the run over once the lease has expired, replays the
/// journaled step without running it again, and finishes the run.
#[test]
fn a_worker_killed_mid_run_is_resumed_by_another_process() {
    let w = Wf::new();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    // The hold step lasts until then: the kill comes while it runs, even on a loaded machine.
    w.start("sleepy_order", "k1", &wf_order("k1", 2, json!({"hold_until_ms": now + 3_000})));
    let mut child = std::process::Command::new(support::BIN)
        .args(w.worker_cmd(&["--until-idle", "--worker-id", "doomed"]))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn the worker");
    w.wait_journaled("k1", 1, &mut child);
    child.kill().expect("SIGKILL the worker");
    child.wait().expect("reap the worker");
    let at_kill = w.show("k1");
    assert_eq!(at_kill["run"]["lease_owner"], "doomed", "{at_kill}");
    assert_eq!(at_kill["journal"].as_array().map(Vec::len), Some(1), "killed inside the hold step: {at_kill}");
    // A lease that ran out under a driving worker too (a heartbeat later than the 200 ms test
    // lease on a loaded machine) is one more takeover, and `drive` counts it.
    let lost_under_live_workers = w.drive(&["k1"], &[]);
    let done = w.show("k1");
    let recoveries = done["run"]["recoveries"].as_u64().unwrap_or(0);
    assert_eq!(done["run"]["status"].as_str(), Some("completed"), "{done}");
    assert!(
        (1..=1 + lost_under_live_workers).contains(&recoveries),
        "taken over once, plus once per lease lost under a live worker ({lost_under_live_workers}): {done}"
    );
    let reserve_attempts = done["attempts"].as_array().unwrap().iter().filter(|a| a["seq"] == 0).count();
    assert_eq!((done["journal"][0]["attempts"].as_u64(), reserve_attempts), (Some(1), 1), "reserve ran once");
    assert_eq!(w.effects_of("k1"), ["reserve", "ship"]);
    w.assert_consistent();
}

fn scenario(point: &str) -> fn(&str) {
    match point {
        "workflow.start.before_commit" => workflow_start_before_commit,
        "workflow.claim.after_commit" => workflow_claim_after_commit,
        "workflow.commit.before_commit" | "workflow.commit.after_commit" => workflow_commit,
        "workflow.operator.before_commit" => workflow_operator_before_commit,
        "workflow.purge.before_commit" => workflow_purge_before_commit,
        "advance.before_commit" => advance_before_commit,
        "advance.after_commit" => advance_after_commit,
        "relay.after_consumer_commit" | "relay.before_producer_commit" => relay_consumer_committed_only,
        "relay.after_producer_commit" => relay_after_producer_commit,
        "receive.before_commit" => receive_before_commit,
        "receive.after_commit" => receive_after_commit,
        "apply.after_handler" | "apply.before_commit" => apply_rolled_back,
        "apply.after_commit" => apply_after_commit,
        "prune.before_commit" => prune_before_commit,
        "prune.after_commit" => prune_after_commit,
        "resolve.before_commit" => resolve_before_commit,
        "redeliver.before_commit" => redeliver_before_commit,
        "rename.before_commit" => rename_before_commit,
        "rename.after_commit" => rename_after_commit,
        "migrate.before_commit" => migrate_before_commit,
        "unsafe_dual_write.between_commits" => unsafe_dual_write_between_commits,
        other => panic!("crash point {other} has no crash scenario: add one to crates/cli/tests/it/crash.rs"),
    }
}

#[test]
fn every_crash_point_has_a_scenario() {
    // Checked even without the feature, so a new point cannot be forgotten.
    for point in CRASH_POINTS {
        let _ = scenario(point);
    }
}

#[test]
fn every_crash_point_recovers_without_loss_or_double_apply() {
    if !support::failpoints_enabled() {
        support::skip("crash tests need --features failpoints (cargo test --workspace --all-features)");
        return;
    }
    for point in CRASH_POINTS {
        eprintln!("crash scenario: {point}");
        scenario(point)(point);
    }
    // The workflow store's points again on PostgreSQL: the same scenarios (each `Wf` a fresh
    // schema of the test server), a `tidemark worker --store postgres://...` killed at each.
    // In this test, after the SQLite ones, rather than in a test of their own: the crash tests
    // are the heaviest of the suite, and more of them at once on a loaded machine make the
    // test workers' 200 ms leases run out under them. Skipped, saying why, without a server.
    let Some(_postgres) = crate::workflow_cli::on_postgres() else { return };
    for point in CRASH_POINTS.iter().filter(|p| p.starts_with("workflow.")) {
        eprintln!("crash scenario on PostgreSQL: {point}");
        scenario(point)(point);
    }
}

/// The relay's and the receive's crash points with the consumer behind a `postgres://` endpoint
/// (a consumer schema on another server, as the producer sees it: the relay writes into its
/// inbox over a connection of its own), for a producer file and then a producer schema: the same
/// scenarios as for a consumer of the producer's own backend. Killed after the consumer schema's
/// commit and before the producer's record, the relay's next pass is answered `duplicate` for
/// every event and changes nothing there; nothing is lost, nothing applied twice. Skipped, saying
/// why, without a server.
#[test]
fn the_relay_crash_points_recover_at_a_postgres_endpoint_from_either_backend() {
    if !support::failpoints_enabled() {
        support::skip("crash tests need --features failpoints (cargo test --workspace --all-features)");
        return;
    }
    let Some(_endpoint) = support::consumer_behind_postgres_endpoint() else { return };
    let points = [
        "relay.after_consumer_commit",
        "relay.before_producer_commit",
        "relay.after_producer_commit",
        "receive.before_commit",
        "receive.after_commit",
    ];
    for point in points {
        eprintln!("crash scenario, a producer file and a postgres:// endpoint: {point}");
        scenario(point)(point);
    }
    let Some(_postgres) = crate::workflow_cli::on_postgres() else { return };
    for point in points {
        eprintln!("crash scenario, a producer schema and a postgres:// endpoint: {point}");
        scenario(point)(point);
    }
}

/// The pipeline's crash points on PostgreSQL: the same scenarios as on SQLite files, each
/// `Setup` a fresh producer schema and consumer schema of the test server, the real `tidemark`
/// process killed at each point (its connection dropped with its transaction open, or right
/// after a commit), then fresh processes proving nothing lost and nothing applied twice (the
/// consumer backup of `redeliver.before_commit` is a `pg_dump` of its schema, restored with
/// `pg_restore`). Not here: `migrate.before_commit` (a SQLite file of an older layout),
/// `unsafe_dual_write.between_commits` (a SQLite-only demonstration) and the workflow points
/// (above). Skipped, saying why, without a server.
#[test]
fn every_pipeline_crash_point_recovers_on_postgres() {
    if !support::failpoints_enabled() {
        support::skip("crash tests need --features failpoints (cargo test --workspace --all-features)");
        return;
    }
    let Some(_postgres) = crate::workflow_cli::on_postgres() else { return };
    let sqlite_only = ["migrate.before_commit", "unsafe_dual_write.between_commits"];
    let points: Vec<&str> =
        CRASH_POINTS.iter().copied().filter(|p| !p.starts_with("workflow.") && !sqlite_only.contains(p)).collect();
    assert_eq!(points.len(), 16, "{points:?}");
    for point in points {
        eprintln!("crash scenario on PostgreSQL: {point}");
        scenario(point)(point);
    }
    crash_on_the_nth_hit();
}

/// The journal commit points again, for child workflows and journaled values (its own test, so it
/// runs beside the others).
#[test]
fn child_workflows_and_values_survive_a_worker_killed_at_every_journal_commit() {
    if !support::failpoints_enabled() {
        support::skip("crash tests need --features failpoints");
        return;
    }
    for point in ["workflow.commit.before_commit", "workflow.commit.after_commit"] {
        workflow_commit_children(point);
    }
    // Again on PostgreSQL (after the SQLite runs, as above).
    let Some(_postgres) = crate::workflow_cli::on_postgres() else { return };
    for point in ["workflow.commit.before_commit", "workflow.commit.after_commit"] {
        workflow_commit_children(point);
    }
}

/// The journal commit points again, for a run that continues as a new run.
#[test]
fn a_run_continued_as_new_survives_a_worker_killed_at_every_journal_commit() {
    if !support::failpoints_enabled() {
        support::skip("crash tests need --features failpoints");
        return;
    }
    for point in ["workflow.commit.before_commit", "workflow.commit.after_commit"] {
        workflow_commit_continued(point);
    }
    // Again on PostgreSQL (after the SQLite runs, as above).
    let Some(_postgres) = crate::workflow_cli::on_postgres() else { return };
    for point in ["workflow.commit.before_commit", "workflow.commit.after_commit"] {
        workflow_commit_continued(point);
    }
}

/// A schedule tick killed before its commit (`workflow.start.before_commit`, the commit that
/// starts a tick's runs and moves the schedule's next tick) starts nothing and leaves the next
/// tick where it was; the next pass starts each due tick exactly once.
#[test]
fn a_schedule_tick_killed_before_its_commit_starts_nothing_and_the_next_pass_starts_each_tick_once() {
    if !support::failpoints_enabled() {
        support::skip("crash tests need --features failpoints");
        return;
    }
    schedule_tick_before_commit();
}

/// The schedule tick and the queue admission crash scenarios on PostgreSQL.
#[test]
fn a_schedule_tick_and_a_queue_admission_survive_their_crash_points_on_postgres() {
    if !support::failpoints_enabled() {
        support::skip("crash tests need --features failpoints");
        return;
    }
    let Some(_postgres) = crate::workflow_cli::on_postgres() else { return };
    schedule_tick_before_commit();
    queue_admission_after_claim();
}

fn schedule_tick_before_commit() {
    let w = Wf::new();
    let at = |ms: i64| ms.to_string();
    let schedule = |now: i64, args: &[&str]| -> Vec<String> {
        let mut all = vec!["--now-ms".to_string(), at(now), "schedule".to_string()];
        all.extend(args.iter().map(|a| a.to_string()));
        all.extend(["--db".to_string(), w.d().to_string()]);
        all
    };
    let input = wf_order("beat", 1, json!({}));
    let put = schedule(
        1_000_000,
        &["put", "--schedule-id", "beat", "--workflow", "order_saga", "--interval-ms", "10000", "--input", &input],
    );
    let out = ok(&refs(&put));
    assert_eq!(out["schedule"]["next_tick_at_ms"], 1_010_000, "{out}");
    let tick = schedule(1_030_000, &["tick"]);
    let r = run_env(&tick, &[("TIDEMARK_CRASH_AT", "workflow.start.before_commit")]);
    assert_eq!(r.code, exit_code("workflow.start.before_commit"), "{}\n{}", r.stdout, r.stderr);
    let shown = ok(&refs(&schedule(1_030_000, &["show", "--schedule-id", "beat"])));
    assert_eq!(shown["schedule"]["next_tick_at_ms"], 1_010_000, "the killed tick moved nothing: {shown}");
    assert_eq!(shown["schedule"]["ticks_started"], 0);
    assert_eq!(w.wf("list", &[])["runs"], json!([]), "the killed tick started nothing");

    let out = ok(&refs(&tick));
    assert_eq!((out["report"]["fired"].as_u64(), out["report"]["started"].as_u64()), (Some(1), Some(3)), "{out}");
    let again = ok(&refs(&tick));
    assert_eq!(again["report"]["fired"], 0, "{again}");
    let runs: Vec<String> = w.wf("list", &[])["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["run_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(runs, ["beat:1010000", "beat:1020000", "beat:1030000"]);
    let shown = ok(&refs(&schedule(1_030_000, &["show", "--schedule-id", "beat"])));
    assert_eq!(
        (shown["schedule"]["next_tick_at_ms"].as_i64(), shown["last_run_id"].as_str()),
        (Some(1_040_000), Some("beat:1030000"))
    );
}

/// A queue admission commits with the claim that leases the run: a worker killed right after
/// that commit (`workflow.claim.after_commit`) leaves the run admitted and leased; the queue's one
/// slot stays taken until the lease runs out and another worker finishes the run, and only then is
/// the next run admitted (its admission comes after the first run's end).
#[test]
fn a_queue_admission_survives_a_worker_killed_after_its_claim_and_the_limit_holds() {
    if !support::failpoints_enabled() {
        support::skip("crash tests need --features failpoints");
        return;
    }
    queue_admission_after_claim();
}

fn queue_admission_after_claim() {
    let w = Wf::new();
    ok(&["queue", "put", "--db", w.d(), "--name", "single", "--concurrency", "1"]);
    for run in ["first", "second"] {
        let mut start = w.start_cmd("order_saga", run, &wf_order(run, 1, json!({})));
        start.extend(["--queue".to_string(), "single".to_string()]);
        let out = ok(&refs(&start));
        assert_eq!(out["outcome"], "started", "{out}");
    }
    let doomed = w.worker_cmd(&["--until-idle", "--worker-id", "doomed", "--concurrency", "4"]);
    let r = run_env(&doomed, &[("TIDEMARK_CRASH_AT", "workflow.claim.after_commit")]);
    assert_eq!(r.code, exit_code("workflow.claim.after_commit"), "{}\n{}", r.stdout, r.stderr);
    let first = w.show("first")["run"].clone();
    assert_eq!(first["lease_owner"], "doomed", "the dead worker's claim committed: {first}");
    assert!(first["admitted_at_ms"].is_i64(), "{first}");
    assert!(w.show("second")["run"]["admitted_at_ms"].is_null(), "the queue had room for one only");

    w.drive(&["first", "second"], &[]);
    let (first, second) = (w.show("first")["run"].clone(), w.show("second")["run"].clone());
    assert_eq!((first["status"].as_str(), second["status"].as_str()), (Some("completed"), Some("completed")));
    assert!(
        second["admitted_at_ms"].as_i64().unwrap() >= first["updated_at_ms"].as_i64().unwrap(),
        "the second run was admitted only after the first ended: {first} {second}"
    );
    assert_eq!(first["recoveries"], 1, "{first}");
    let queue = ok(&["queue", "show", "--db", w.d(), "--name", "single"]);
    assert_eq!((queue["queue"]["in_progress"].as_u64(), queue["queue"]["waiting"].as_u64()), (Some(0), Some(0)));
    assert_eq!(w.effects_of("first"), ["reserve", "ship"]);
    w.assert_consistent();
}

/// `<name>@<n>` dies on the n-th hit: the earlier passes and batches stay committed.
#[test]
fn crash_on_the_nth_hit_keeps_the_earlier_commits() {
    if !support::failpoints_enabled() {
        support::skip("crash tests need --features failpoints");
        return;
    }
    crash_on_the_nth_hit();
}

fn crash_on_the_nth_hit() {
    let s = Setup::new(&["audit"]);
    seed(&s);
    // One delivery per pass: pass 1 commits on both sides, pass 2 dies after its consumer commit.
    let relay_one_by_one = ["relay", "--producer", s.p(), "--limit", "1", "--until-idle", "--passes", "100"];
    crash_at("relay.after_consumer_commit@2", &relay_one_by_one);
    let mut statuses = delivery_statuses(&producer_snapshot(&s));
    statuses.sort();
    assert_eq!(statuses, ["accepted", "pending", "pending"]);
    assert_eq!(array(&consumer_snapshot(&s), "inbox").len(), 2);
    let out = relay(&s);
    assert_eq!((out["duplicate"].as_u64(), out["accepted"].as_u64()), (Some(1), Some(1)), "{out}");
    settle(&s);
    assert_converged(&s);
    // One row per prune batch: batch 1 commits, batch 2 commits and then the process dies.
    let prune_one_by_one = ["prune", "--consumer-db", s.c(), "--applied-retention-ms", "0", "--batch-rows", "1"];
    crash_at("prune.after_commit@2", &prune_one_by_one);
    let consumer = consumer_snapshot(&s);
    assert_eq!((array(&consumer, "inbox").len(), array(&consumer, "receipts").len()), (1, 2));
    replay_all(&s, "audit");
    assert_eq!(ok(&prune_one_by_one)["consumer"]["compacted"], 1);
    replay_all(&s, "audit");
    settle(&s);
    assert_converged(&s);
}
