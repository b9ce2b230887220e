//! The CLI contract: bad input exits 2 with `{"outcome":"error","error":{"code","message"}}`, a
//! stable code, and changes nothing on disk (every file's bytes compared, and a missing database
//! path is never created); protocol rejections exit 0 with their outcome word; init never resets.
//! The scenarios that do not reach into a file's bytes run twice: on SQLite files, then on
//! PostgreSQL schemas of the test server (`on_both_backends`; there "changes nothing" is checked on
//! both stores' snapshots, and "never created" on the server's schemas).

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Value};
use tidemark_core::limits::ENVELOPE_BYTES_MAX;

use crate::crash::{advance, array, consumer_snapshot, producer_snapshot, relay, SOURCE};
use crate::support::{ok, path_str, run, run_with, Setup};
use crate::workflow_cli::on_both_backends;

/// Every file of the folder (databases, WAL companions, envelopes) with its bytes.
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .expect("read dir")
        .map(|entry| {
            let entry = entry.expect("dir entry");
            (entry.file_name().to_string_lossy().into_owned(), std::fs::read(entry.path()).expect("read file"))
        })
        .collect()
}

/// Both snapshots, read by the binary.
fn snapshots(s: &Setup) -> (Value, Value) {
    (producer_snapshot(s), consumer_snapshot(s))
}

/// Run bad input; require exit 2, the JSON error with `code`, and no change on disk (on
/// PostgreSQL: in either store's snapshot).
fn assert_rejected(s: &Setup, args: &[&str], code: &str) {
    let before = files(s.dir.path());
    let stores_before = s.on_postgres().then(|| snapshots(s));
    let r = run(args);
    assert_eq!(r.code, 2, "tidemark {args:?} must exit 2:\n{}\n{}", r.stdout, r.stderr);
    assert_eq!(r.json["outcome"], "error", "{}", r.stdout);
    assert_eq!(r.json["error"]["code"], code, "tidemark {args:?}: {}", r.stdout);
    assert!(r.json["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{}", r.stdout);
    assert_eq!(r.stdout.trim().lines().count(), 1, "one JSON document on one line: {}", r.stdout);
    let after = files(s.dir.path());
    assert_eq!(after.keys().collect::<Vec<_>>(), before.keys().collect::<Vec<_>>(), "files appeared or vanished");
    for (name, bytes) in &before {
        assert!(after[name] == *bytes, "tidemark {args:?} changed {name}");
    }
    if let Some(stores_before) = stores_before {
        assert_eq!(snapshots(s), stores_before, "tidemark {args:?} changed a store");
    }
}

/// audit and search subscribed; r1 reserved -> confirmed, relayed, applied by audit only;
/// r2 reserved and not relayed (its deliveries pending).
fn populated() -> (Setup, String, String) {
    let s = Setup::new(&["audit", "search"]);
    let r1 = advance(&s, "r1", 0, "reserved", Some(3))["event_id"].as_str().unwrap().to_string();
    advance(&s, "r1", 1, "confirmed", None);
    relay(&s);
    ok(&["drain", "--consumer-db", s.c(), "--consumer-id", "audit"]);
    let r2 = advance(&s, "r2", 0, "reserved", Some(4))["event_id"].as_str().unwrap().to_string();
    (s, r1, r2)
}

fn advance_args<'a>(s: &'a Setup, flow: &'a str, expected: &'a str, to: &'a str, more: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["advance", "--producer", s.p(), "--flow", flow, "--expected-seq", expected, "--to", to];
    args.extend_from_slice(more);
    args
}

#[test]
fn bad_input_exits_2_with_a_stable_code_and_changes_nothing() {
    on_both_backends(scenario_bad_input_exits_2_with_a_stable_code_and_changes_nothing);
}

fn scenario_bad_input_exits_2_with_a_stable_code_and_changes_nothing() {
    let (s, r1, r2) = populated();
    let (p, c) = (s.p(), s.c());
    let long_id = "a".repeat(101);
    let before = snapshots(&s);

    // Identifiers: empty, 101 characters, spaces, non-ASCII; on every command that takes one.
    for bad in ["", long_id.as_str(), "has space", "réservation", "a/b"] {
        assert_rejected(&s, &advance_args(&s, bad, "2", "released", &[]), "invalid_id");
        assert_rejected(&s, &["drain", "--consumer-db", c, "--consumer-id", bad], "invalid_id");
        assert_rejected(
            &s,
            &["apply", "--consumer-db", c, "--consumer-id", "audit", "--source", SOURCE, "--flow", bad],
            "invalid_id",
        );
        assert_rejected(&s, &["subscribe", "--producer", p, "--consumer-id", bad, "--endpoint", c], "invalid_id");
        assert_rejected(&s, &["rename-consumer", "--consumer-db", c, "--from", "audit", "--to", bad], "invalid_id");
        assert_rejected(&s, &["inbox", "list", "--consumer-db", c, "--consumer-id", bad], "invalid_id");
        assert_rejected(&s, &["init", "--producer", p, "--source", bad], "invalid_id");
    }
    assert_eq!(long_id.len(), tidemark_core::limits::ID_BYTES_MAX + 1);
    ok(&advance_args(&s, &long_id[..100], "0", "reserved", &["--quantity", "1"]));
    let before_after_a_valid_100_char_id = snapshots(&s);

    // Domain input.
    for quantity in ["--quantity=0", "--quantity=1000001", "--quantity=-1"] {
        assert_rejected(&s, &advance_args(&s, "r9", "0", "reserved", &[quantity]), "invalid_quantity");
    }
    assert_rejected(&s, &advance_args(&s, "r9", "0", "reserved", &[]), "invalid_quantity");
    assert_rejected(&s, &advance_args(&s, "r1", "2", "cancelled", &[]), "unknown_state");
    assert_rejected(&s, &advance_args(&s, "r1", "2", "released", &["--schema-version", "3"]), "invalid_schema_version");
    assert_rejected(&s, &advance_args(&s, "r1", "2", "released", &["--schema-version", "0"]), "invalid_schema_version");
    assert_rejected(&s, &advance_args(&s, "r1", "-1", "released", &[]), "invalid_argument");
    assert_rejected(
        &s,
        &["advance", "--producer", p, "--flow", "r1", "--expected-seq=-1", "--to", "released"],
        "invalid_seq",
    );

    // Envelopes: malformed JSON, unknown fields, bad seq, oversized.
    let envelope = array(&before.0, "outbox")[0].clone();
    let mut cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("malformed", b"{\"event_id\": ".to_vec(), "invalid_envelope"),
        ("not-json", b"hello".to_vec(), "invalid_envelope"),
        ("empty", Vec::new(), "invalid_envelope"),
    ];
    let mut extra = envelope.clone();
    extra["extra"] = json!(1);
    cases.push(("extra-field", extra.to_string().into_bytes(), "invalid_envelope"));
    let mut seq0 = envelope.clone();
    seq0["seq"] = json!(0);
    cases.push(("seq0", seq0.to_string().into_bytes(), "invalid_seq"));
    let mut bad_id = envelope.clone();
    bad_id["event_id"] = json!("has space");
    cases.push(("bad-id", bad_id.to_string().into_bytes(), "invalid_id"));
    let mut oversized = envelope.to_string().into_bytes();
    oversized.resize(ENVELOPE_BYTES_MAX + 1, b' ');
    cases.push(("oversized", oversized, "payload_too_large"));
    let mut big_payload = envelope.clone();
    big_payload["payload"] = json!({"amount": 3, "pad": "x".repeat(tidemark_core::limits::PAYLOAD_BYTES_MAX)});
    cases.push(("big-payload", big_payload.to_string().into_bytes(), "payload_too_large"));
    let inputs = tempfile::tempdir().expect("tempdir");
    for (name, bytes, code) in &cases {
        let file = inputs.path().join(format!("{name}.json"));
        std::fs::write(&file, bytes).expect("write envelope");
        assert_rejected(
            &s,
            &["receive", "--consumer-db", c, "--consumer-id", "audit", "--file", path_str(&file)],
            code,
        );
        // The same bytes on stdin.
        let before = files(s.dir.path());
        let r = run_with(&["receive", "--consumer-db", c, "--consumer-id", "audit"], &[], Some(bytes));
        assert_eq!((r.code, r.json["error"]["code"].as_str()), (2, Some(*code)), "{name} on stdin: {}", r.stdout);
        assert_eq!(files(s.dir.path()), before);
    }

    // Flags and filters.
    assert_rejected(
        &s,
        &["advance", "--producer", p, "--flow", "r1", "--expected-seq", "2", "--to", "released", "--bogus"],
        "invalid_argument",
    );
    assert_rejected(
        &s,
        &["advance", "--producer", p, "--flow", "r1", "--expected-seq", "two", "--to", "released"],
        "invalid_argument",
    );
    assert_rejected(&s, &["advance", "--producer", p, "--flow", "r1", "--to", "released"], "invalid_argument");
    assert_rejected(&s, &["no-such-command"], "invalid_argument");
    assert_rejected(&s, &["--durability", "sometimes", "snapshot", "--producer", p], "invalid_argument");
    assert_rejected(&s, &["outbox", "list", "--producer", p, "--status", "lost"], "invalid_argument");
    assert_rejected(
        &s,
        &["inbox", "list", "--consumer-db", c, "--consumer-id", "audit", "--status", "lost"],
        "invalid_argument",
    );
    assert_rejected(
        &s,
        &[
            "outbox",
            "resolve",
            "--producer",
            p,
            "--event",
            &r1,
            "--consumer-id",
            "audit",
            "--action",
            "forget",
            "--reason",
            "x",
        ],
        "invalid_argument",
    );
    assert_rejected(
        &s,
        &[
            "outbox",
            "resolve",
            "--producer",
            p,
            "--event",
            &r1,
            "--consumer-id",
            "audit",
            "--action",
            "requeue",
            "--reason",
            " ",
        ],
        "invalid_argument",
    );
    assert_rejected(&s, &["prune", "--consumer-db", c, "--applied-retention-ms", "-1"], "invalid_argument");
    assert_rejected(&s, &["relay", "--producer", p, "--max-attempts", "0"], "invalid_argument");

    // Limits: 0 and one over the maximum.
    for (flag_args, max, read_only) in [
        (vec!["relay", "--producer", p], 10_000, false),
        (vec!["drain", "--consumer-db", c, "--consumer-id", "search"], 10_000, false),
        (vec!["outbox", "list", "--producer", p], 1_000, true),
        (vec!["inbox", "list", "--consumer-db", c, "--consumer-id", "audit"], 1_000, true),
    ] {
        for limit in ["0".to_string(), (max + 1).to_string()] {
            assert_rejected(&s, &[&flag_args[..], &["--limit", &limit]].concat(), "limit_exceeded");
        }
        if read_only {
            ok(&[&flag_args[..], &["--limit", &max.to_string()]].concat());
        }
    }
    assert_rejected(&s, &["prune", "--consumer-db", c, "--batch-rows", "0"], "limit_exceeded");
    assert_rejected(&s, &["snapshot", "--producer", p, "--rows-max", "0"], "limit_exceeded");

    // Redelivery: a bad id, an unknown subscriber or event, both or neither of the range flags.
    let redeliver = ["outbox", "redeliver", "--producer", p];
    for (args, code) in [
        (vec!["--consumer-id", "bad id", "--all"], "invalid_id"),
        (vec!["--consumer-id", "audit", "--from-event", "bad id"], "invalid_id"),
        (vec!["--consumer-id", "nobody", "--all"], "not_found"),
        (vec!["--consumer-id", "audit", "--from-event", "nope"], "not_found"),
        (vec!["--consumer-id", "audit", "--from-event", r1.as_str(), "--all"], "invalid_argument"),
        (vec!["--consumer-id", "audit"], "invalid_argument"),
    ] {
        assert_rejected(&s, &[&redeliver[..], &args[..]].concat(), code);
    }

    // Operator actions on records in the wrong state.
    for (event, consumer, action) in [(&r1, "audit", "requeue"), (&r1, "audit", "dismiss"), (&r2, "audit", "requeue")] {
        let args =
            ["outbox", "resolve", "--producer", p, "--event", event, "--consumer-id", consumer, "--action", action];
        assert_rejected(&s, &[&args[..], &["--reason", "operator"]].concat(), "invalid_state_change");
    }
    assert_rejected(
        &s,
        &[
            "outbox",
            "resolve",
            "--producer",
            p,
            "--event",
            "nope",
            "--consumer-id",
            "audit",
            "--action",
            "requeue",
            "--reason",
            "x",
        ],
        "not_found",
    );
    for consumer in ["audit", "search"] {
        // audit applied r1's first event; search holds it pending. Neither is blocked.
        assert_rejected(
            &s,
            &["inbox", "skip", "--consumer-db", c, "--consumer-id", consumer, "--event", &r1, "--reason", "x"],
            "invalid_state_change",
        );
    }
    assert_rejected(
        &s,
        &["inbox", "skip", "--consumer-db", c, "--consumer-id", "audit", "--event", &r2, "--reason", "x"],
        "not_found",
    );
    assert_rejected(
        &s,
        &["rename-consumer", "--consumer-db", c, "--from", "audit", "--to", "search"],
        "already_exists",
    );
    assert_rejected(
        &s,
        &["rename-consumer", "--consumer-db", c, "--from", "audit", "--to", "search", "--producer", p],
        "already_exists",
    );
    assert_rejected(&s, &["rename-consumer", "--consumer-db", c, "--from", "nobody", "--to", "somebody"], "not_found");
    assert_rejected(
        &s,
        &["rename-consumer", "--consumer-db", c, "--from", "audit", "--to", "audit"],
        "invalid_argument",
    );

    // A file of the other role.
    assert_rejected(
        &s,
        &["advance", "--producer", c, "--flow", "r1", "--expected-seq", "2", "--to", "released"],
        "not_initialized",
    );
    assert_rejected(&s, &["drain", "--consumer-db", p, "--consumer-id", "audit"], "not_initialized");

    assert_eq!(snapshots(&s), before_after_a_valid_100_char_id, "bad input changed the state");
    assert_ne!(before, before_after_a_valid_100_char_id);
}

/// Renaming a subscriber that has not received anything: with `--producer` (which confirms the
/// subscription) the subscription is renamed and the old id retired in the consumer file; a
/// mistyped id stays `not_found` and changes nothing.
#[test]
fn renaming_a_subscriber_that_has_received_nothing_yet() {
    on_both_backends(scenario_renaming_a_subscriber_that_has_received_nothing_yet);
}

fn scenario_renaming_a_subscriber_that_has_received_nothing_yet() {
    let s = Setup::new(&["audit", "quiet"]);
    let (p, c) = (s.p(), s.c());
    assert_rejected(&s, &["rename-consumer", "--consumer-db", c, "--from", "quiet", "--to", "quiet2"], "not_found");
    assert_rejected(
        &s,
        &["rename-consumer", "--consumer-db", c, "--from", "qiuet", "--to", "quiet2", "--producer", p],
        "not_found",
    );
    let out = ok(&["rename-consumer", "--consumer-db", c, "--from", "quiet", "--to", "quiet2", "--producer", p]);
    assert_eq!(out["outcome"], "renamed", "{out}");
    assert_eq!(out["consumer"], json!({"inbox": 0, "receipts": 0, "cursors": 0, "projections": 0}), "{out}");
    let subscribers: Vec<String> = ok(&["snapshot", "--producer", p])["producer"]["subscriptions"]
        .as_array()
        .expect("subscriptions")
        .iter()
        .map(|sub| sub["consumer_id"].as_str().expect("id").to_string())
        .collect();
    assert_eq!(subscribers, ["audit", "quiet2"]);
    // The pipeline goes on under the new id: every event applied once for each subscriber.
    ok(&["advance", "--producer", p, "--flow", "r1", "--expected-seq", "0", "--to", "reserved", "--quantity", "2"]);
    ok(&["relay", "--producer", p, "--until-idle"]);
    for consumer in ["audit", "quiet2"] {
        let out = ok(&["drain", "--consumer-db", c, "--consumer-id", consumer]);
        assert_eq!(out["applied"], 1, "{consumer}: {out}");
    }
    // Run again (a retry after a crash between the two halves): nothing left to do.
    let again = ok(&["rename-consumer", "--consumer-db", c, "--from", "quiet", "--to", "quiet2", "--producer", p]);
    assert_eq!(again["producer_deliveries_moved"], 0, "{again}");
}

/// Moving a subscription (`subscribe` again with another endpoint) to a consumer database that
/// holds nothing of a subscriber that has accepted events would leave every flow under way at a
/// gap there: refused, nothing changed. A copy of its database (the file really moved), or a
/// subscriber that has accepted nothing yet, moves.
#[test]
fn a_subscription_moves_only_to_a_database_that_holds_its_state() {
    on_both_backends(scenario_a_subscription_moves_only_to_a_database_that_holds_its_state);
}

fn scenario_a_subscription_moves_only_to_a_database_that_holds_its_state() {
    let s = Setup::new(&["audit"]);
    let (p, c) = (s.p(), s.c());
    let fresh = s.another_store("fresh");
    ok(&["init", "--consumer-db", &fresh]);
    advance(&s, "r1", 0, "reserved", Some(2));
    relay(&s);
    ok(&["drain", "--consumer-db", c, "--consumer-id", "audit"]);
    // quiet subscribes from now on: it has accepted nothing yet.
    ok(&["subscribe", "--producer", p, "--consumer-id", "quiet", "--endpoint", c]);
    let move_audit = ["subscribe", "--producer", p, "--consumer-id", "audit", "--endpoint", &fresh];
    assert_rejected(&s, &move_audit, "invalid_state_change");
    let moved = ok(&["subscribe", "--producer", p, "--consumer-id", "quiet", "--endpoint", &fresh]);
    assert_eq!(moved["outcome"], "subscribed", "{moved}");
    if s.on_postgres() {
        // A schema is not copied like a file: quiet goes on where it moved.
        advance(&s, "r2", 0, "reserved", Some(1));
        relay(&s);
        let out = ok(&["drain", "--consumer-db", &fresh, "--consumer-id", "quiet"]);
        assert_eq!(out["applied"], 1, "quiet applies r2 where it moved: {out}");
        return;
    }

    // The consumer database really moves: a checkpointed copy holds audit's state.
    let copy = s.dir.path().join("copy.db");
    let conn = rusqlite::Connection::open(c).unwrap();
    conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)").unwrap();
    drop(conn);
    std::fs::copy(c, &copy).unwrap();
    let moved = ok(&["subscribe", "--producer", p, "--consumer-id", "audit", "--endpoint", path_str(&copy)]);
    assert_eq!(moved["outcome"], "subscribed", "{moved}");
    advance(&s, "r1", 1, "confirmed", None);
    advance(&s, "r2", 0, "reserved", Some(1));
    relay(&s);
    let out = ok(&["drain", "--consumer-db", path_str(&copy), "--consumer-id", "audit"]);
    assert_eq!((&out["applied"], &out["outcome"]), (&json!(2), &json!("idle")), "{out}");
    let out = ok(&["drain", "--consumer-db", &fresh, "--consumer-id", "quiet"]);
    assert_eq!(out["applied"], 1, "quiet applies r2 where it moved: {out}");
}

/// The relay is fair across flows: with a limit of two, a flow with three due events and a flow
/// with one each get one delivery in the first pass (not the busy flow's first two), and each
/// flow's own order holds over the passes.
#[test]
fn a_relay_batch_takes_flows_round_robin() {
    on_both_backends(scenario_a_relay_batch_takes_flows_round_robin);
}

fn scenario_a_relay_batch_takes_flows_round_robin() {
    let s = Setup::new(&["audit"]);
    advance(&s, "busy", 0, "reserved", Some(1));
    advance(&s, "busy", 1, "confirmed", None);
    advance(&s, "busy", 2, "released", None);
    advance(&s, "quiet", 0, "reserved", Some(1));
    let pass = |expected: &[(&str, i64)]| {
        let out = ok(&["relay", "--producer", s.p(), "--limit", "2", "--verbose"]);
        let mut got: Vec<(String, i64)> = array(&out, "answers")
            .iter()
            .map(|a| (a["flow_id"].as_str().unwrap().to_string(), a["seq"].as_i64().unwrap()))
            .collect();
        got.sort();
        let expected: Vec<(String, i64)> = expected.iter().map(|(f, q)| (f.to_string(), *q)).collect();
        assert_eq!(got, expected, "{out}");
    };
    pass(&[("busy", 1), ("quiet", 1)]);
    pass(&[("busy", 2), ("busy", 3)]);
    let out = ok(&["drain", "--consumer-db", s.c(), "--consumer-id", "audit"]);
    assert_eq!((&out["applied"], &out["outcome"]), (&json!(4), &json!("idle")), "{out}");
}

#[test]
fn a_missing_database_is_never_created() {
    on_both_backends(scenario_a_missing_database_is_never_created);
}

fn scenario_a_missing_database_is_never_created() {
    let s = Setup::new(&["audit"]);
    let missing = s.another_store("missing");
    let m = missing.as_str();
    let envelope = s.dir.path().join("envelope.json");
    advance(&s, "r1", 0, "reserved", Some(1));
    std::fs::write(&envelope, array(&producer_snapshot(&s), "outbox")[0].to_string()).unwrap();
    let e = path_str(&envelope);
    for args in [
        vec!["advance", "--producer", m, "--flow", "r1", "--expected-seq", "0", "--to", "reserved", "--quantity", "1"],
        vec!["advance", "--producer", m, "--flow", "", "--expected-seq", "0", "--to", "reserved", "--quantity", "1"],
        vec!["subscribe", "--producer", m, "--consumer-id", "audit", "--endpoint", s.c()],
        vec!["subscribe", "--producer", s.p(), "--consumer-id", "audit2", "--endpoint", m],
        vec!["relay", "--producer", m],
        vec!["receive", "--consumer-db", m, "--consumer-id", "audit", "--file", e],
        vec!["apply", "--consumer-db", m, "--consumer-id", "audit", "--source", SOURCE, "--flow", "r1"],
        vec!["drain", "--consumer-db", m, "--consumer-id", "audit"],
        vec!["snapshot", "--producer", m],
        vec!["snapshot", "--consumer-db", m],
        vec!["outbox", "list", "--producer", m],
        vec!["outbox", "rotate-generation", "--producer", m],
        vec!["inbox", "list", "--consumer-db", m, "--consumer-id", "audit"],
        vec!["inbox", "cursors", "--consumer-db", m],
        vec!["prune", "--consumer-db", m],
        vec!["rename-consumer", "--consumer-db", m, "--from", "audit", "--to", "audit2"],
    ] {
        let r = run(&args);
        assert_eq!(r.code, 2, "tidemark {args:?}:\n{}\n{}", r.stdout, r.stderr);
        let code = r.json["error"]["code"].as_str().unwrap_or_default().to_string();
        assert!(["not_initialized", "invalid_id"].contains(&code.as_str()), "tidemark {args:?}: {}", r.stdout);
        assert!(!s.store_exists(m), "tidemark {args:?} created {m}");
    }
}

/// Run and require exit 0 with the given outcome word; the files' state must not change when
/// `unchanged` (rejections are answers, not remembered state).
fn assert_outcome(s: &Setup, args: &[&str], word: &str, unchanged: bool) -> Value {
    let before = snapshots(s);
    let out = ok(args);
    assert_eq!(out["outcome"], word, "tidemark {args:?}: {out}");
    if unchanged {
        assert_eq!(snapshots(s), before, "tidemark {args:?} answered {word} but changed the state");
    }
    out
}

#[test]
fn protocol_rejections_exit_0_with_their_outcome_word() {
    on_both_backends(scenario_protocol_rejections_exit_0_with_their_outcome_word);
}

fn scenario_protocol_rejections_exit_0_with_their_outcome_word() {
    let s = Setup::new(&["audit"]);
    let (p, c) = (s.p(), s.c());
    advance(&s, "r1", 0, "reserved", Some(3));
    let stale = assert_outcome(
        &s,
        &["advance", "--producer", p, "--flow", "r1", "--expected-seq", "0", "--to", "confirmed"],
        "stale",
        true,
    );
    assert_eq!((stale["expected_seq"].as_i64(), stale["current_seq"].as_i64()), (Some(0), Some(1)));
    let skip = assert_outcome(
        &s,
        &["advance", "--producer", p, "--flow", "r1", "--expected-seq", "1", "--to", "released"],
        "invalid_transition",
        true,
    );
    assert_eq!(skip["current_state"], "reserved");
    assert_outcome(
        &s,
        &["advance", "--producer", p, "--flow", "r1", "--expected-seq", "1", "--to", "confirmed", "--quantity", "4"],
        "invalid_transition",
        true,
    );
    advance(&s, "r1", 1, "confirmed", None);

    // Receive by hand: duplicate, conflict (same position, another id; same id, other content).
    let outbox = array(&producer_snapshot(&s), "outbox").clone();
    let write = |name: &str, value: &Value| {
        let path = s.dir.path().join(name);
        std::fs::write(&path, value.to_string()).unwrap();
        path_str(&path).to_string()
    };
    let second = write("second.json", &outbox[1]);
    let apply = ["apply", "--consumer-db", c, "--consumer-id", "audit", "--source", SOURCE, "--flow", "r1"];
    let idle = assert_outcome(&s, &apply, "idle", true);
    assert_eq!(idle["high_water_seq"], 0);
    assert_outcome(
        &s,
        &["receive", "--consumer-db", c, "--consumer-id", "audit", "--file", &second],
        "accepted",
        false,
    );
    let gap = assert_outcome(&s, &apply, "gap", true);
    assert_eq!(gap["missing_seq"], 1);
    assert_outcome(
        &s,
        &["receive", "--consumer-db", c, "--consumer-id", "audit", "--file", &second],
        "duplicate",
        true,
    );
    let mut other_id = outbox[1].clone();
    other_id["event_id"] = json!("forged-1");
    let other_id = write("other-id.json", &other_id);
    assert_outcome(
        &s,
        &["receive", "--consumer-db", c, "--consumer-id", "audit", "--file", &other_id],
        "conflict",
        true,
    );
    let mut other_content = outbox[1].clone();
    other_content["payload"] = json!({"amount": 4});
    let other_content = write("other-content.json", &other_content);
    assert_outcome(
        &s,
        &["receive", "--consumer-db", c, "--consumer-id", "audit", "--file", &other_content],
        "conflict",
        true,
    );
    relay(&s);
    assert_outcome(&s, &apply, "applied", false);
    assert_outcome(&s, &apply, "applied", false);
    assert_outcome(&s, &apply, "idle", true);

    // A v2 event is blocked until the consumer enables v2.
    ok(&[
        "advance",
        "--producer",
        p,
        "--flow",
        "r2",
        "--expected-seq",
        "0",
        "--to",
        "reserved",
        "--quantity",
        "2",
        "--schema-version",
        "2",
    ]);
    relay(&s);
    let apply_r2 = ["apply", "--consumer-db", c, "--consumer-id", "audit", "--source", SOURCE, "--flow", "r2"];
    let blocked = assert_outcome(&s, &apply_r2, "blocked", false);
    assert!(blocked["reason"].as_str().is_some_and(|r| r.contains("schema version 2")), "{blocked}");
    assert_outcome(&s, &apply_r2, "blocked", true);
    assert_eq!(ok(&["drain", "--consumer-db", c, "--consumer-id", "audit"])["outcome"], "blocked");
    assert_outcome(&s, &[&apply_r2[..], &["--support-v2"]].concat(), "applied", false);
}

#[test]
fn init_twice_keeps_data_and_another_source_is_an_error() {
    on_both_backends(scenario_init_twice_keeps_data_and_another_source_is_an_error);
}

fn scenario_init_twice_keeps_data_and_another_source_is_an_error() {
    let s = Setup::new(&["audit"]);
    advance(&s, "r1", 0, "reserved", Some(3));
    relay(&s);
    ok(&["drain", "--consumer-db", s.c(), "--consumer-id", "audit"]);
    let before = snapshots(&s);
    let again = ok(&["init", "--producer", s.p(), "--source", SOURCE, "--consumer-db", s.c(), "--horizon-ms", "5"]);
    assert_eq!(again["producer"], before.0["identity"], "re-init keeps the generation");
    assert_eq!(again["consumer"]["horizon_ms"], before.1["horizon_ms"], "re-init keeps the horizon");
    assert_eq!(snapshots(&s), before, "re-init changed data");
    assert_rejected(&s, &["init", "--producer", s.p(), "--source", "other-shop"], "already_initialized");
    assert_rejected(&s, &["init", "--producer", s.p()], "invalid_argument");
    assert_rejected(&s, &["init"], "invalid_argument");
    assert_rejected(&s, &["init", "--consumer-db", s.c(), "--horizon-ms", "0"], "invalid_argument");
    assert_eq!(snapshots(&s), before);
}

/// An internal failure (here: a file that is not a SQLite database) exits 1 with the JSON error
/// and code `store`, not 2: the input was well formed, the storage failed. Neither the file nor
/// the folder changes (no WAL or shared-memory companion is left behind).
#[test]
fn an_internal_error_exits_1_with_a_json_error_and_changes_nothing() {
    let s = Setup::new(&["audit"]);
    let garbage = s.dir.path().join("garbage.db");
    // Deterministic pseudo-random bytes (xorshift64), two pages' worth; never SQLite's header.
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let bytes: Vec<u8> = (0..8192)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect();
    assert!(!bytes.starts_with(b"SQLite format 3\0"));
    std::fs::write(&garbage, &bytes).expect("write garbage");
    let g = path_str(&garbage);
    let envelope = s.dir.path().join("envelope.json");
    advance(&s, "r1", 0, "reserved", Some(1));
    std::fs::write(&envelope, array(&producer_snapshot(&s), "outbox")[0].to_string()).unwrap();
    let e = path_str(&envelope);
    for args in [
        vec!["advance", "--producer", g, "--flow", "r1", "--expected-seq", "0", "--to", "reserved", "--quantity", "1"],
        vec!["init", "--producer", g, "--source", SOURCE],
        vec!["init", "--consumer-db", g],
        vec!["relay", "--producer", g],
        vec!["snapshot", "--producer", g],
        vec!["subscribe", "--producer", s.p(), "--consumer-id", "audit2", "--endpoint", g],
        vec!["receive", "--consumer-db", g, "--consumer-id", "audit", "--file", e],
        vec!["drain", "--consumer-db", g, "--consumer-id", "audit"],
        vec!["prune", "--consumer-db", g],
    ] {
        let before = files(s.dir.path());
        let r = run(&args);
        assert_eq!(r.code, 1, "tidemark {args:?} must exit 1:\n{}\n{}", r.stdout, r.stderr);
        assert_eq!(r.stdout.trim().lines().count(), 1, "one JSON document on one line: {}", r.stdout);
        assert_eq!(r.json["outcome"], "error", "{}", r.stdout);
        assert_eq!(r.json["error"]["code"], "store", "tidemark {args:?}: {}", r.stdout);
        assert!(
            r.json["error"]["message"].as_str().is_some_and(|m| m.contains("not a database")),
            "tidemark {args:?}: {}",
            r.stdout
        );
        assert!(files(s.dir.path()) == before, "tidemark {args:?} changed the folder");
    }
    assert_eq!(std::fs::read(&garbage).unwrap(), bytes);
}

/// A flow at the last seq (i64::MAX) cannot advance: `seq_overflow`, exit 2, no file changed.
/// The seq is set directly in the file (or the schema's table): no real flow gets there.
#[test]
fn advance_at_the_last_seq_is_seq_overflow_and_changes_nothing() {
    on_both_backends(scenario_advance_at_the_last_seq_is_seq_overflow_and_changes_nothing);
}

fn scenario_advance_at_the_last_seq_is_seq_overflow_and_changes_nothing() {
    let s = Setup::new(&["audit"]);
    advance(&s, "r1", 0, "reserved", Some(3));
    match tidemark_core::location::StoreLocation::parse(s.p()).unwrap() {
        tidemark_core::location::StoreLocation::Sqlite(path) => {
            let conn = rusqlite::Connection::open(path).unwrap();
            let updated = conn.execute("UPDATE flows SET last_seq = ?1 WHERE flow_id = 'r1'", [i64::MAX]).unwrap();
            assert_eq!(updated, 1);
            conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)").unwrap();
        }
        tidemark_core::location::StoreLocation::Postgres(pg) => {
            let mut client = postgres::Client::connect(&pg.conn, postgres::NoTls).unwrap();
            let update = format!("UPDATE {}.flows SET last_seq = $1 WHERE flow_id = 'r1'", pg.schema);
            assert_eq!(client.execute(&update, &[&i64::MAX]).unwrap(), 1);
        }
    }
    let before = producer_snapshot(&s);
    assert_eq!(array(&before, "flows")[0]["last_seq"], i64::MAX, "{before}");
    let max = i64::MAX.to_string();
    assert_rejected(&s, &advance_args(&s, "r1", &max, "confirmed", &[]), "seq_overflow");
    // Stale and overflowing: the stale answer comes first (the caller's view is out of date).
    let stale = ok(&advance_args(&s, "r1", "1", "confirmed", &[]));
    assert_eq!((&stale["outcome"], &stale["current_seq"]), (&json!("stale"), &json!(i64::MAX)), "{stale}");
    assert_eq!(producer_snapshot(&s), before);
}

/// The envelope of flow r1's first event, committed at `at_ms`, as the outbox holds it.
fn first_envelope(s: &Setup, at_ms: i64) -> Value {
    let at = at_ms.to_string();
    let out = ok(&[&["--now-ms", &at][..], &advance_args(s, "r1", "0", "reserved", &["--quantity", "2"])].concat());
    assert_eq!(out["outcome"], "committed", "{out}");
    let envelope = array(&producer_snapshot(s), "outbox")[0].clone();
    assert_eq!(envelope["created_at_ms"], at_ms, "{envelope}");
    envelope
}

/// `receive` answers `expired` (exit 0) for an event older than the consumer's horizon
/// (`init --horizon-ms`) and stores nothing; at exactly the horizon it is still accepted.
#[test]
fn receive_of_an_event_older_than_the_horizon_is_expired_and_stores_nothing() {
    on_both_backends(scenario_receive_of_an_event_older_than_the_horizon_is_expired_and_stores_nothing);
}

fn scenario_receive_of_an_event_older_than_the_horizon_is_expired_and_stores_nothing() {
    let s = Setup::new(&[]);
    let short = s.another_store("short");
    let horizon_ms = 60_000_i64;
    let init = ok(&["init", "--consumer-db", &short, "--horizon-ms", &horizon_ms.to_string()]);
    assert_eq!(init["consumer"]["horizon_ms"], horizon_ms, "{init}");
    let created_ms = 1_000_000_i64;
    let envelope = first_envelope(&s, created_ms);
    let file = s.dir.path().join("envelope.json");
    std::fs::write(&file, envelope.to_string()).unwrap();
    let receive_at = |now_ms: i64| {
        let now = now_ms.to_string();
        let args = ["--now-ms", &now, "receive", "--consumer-db", &short, "--consumer-id", "audit", "--file"];
        ok(&[&args[..], &[path_str(&file)]].concat())
    };
    let snapshot = || ok(&["snapshot", "--consumer-db", &short])["consumer"].clone();
    let empty = snapshot();
    for key in ["inbox", "receipts", "cursors"] {
        assert!(array(&empty, key).is_empty(), "{empty}");
    }

    let expired = receive_at(created_ms + horizon_ms + 1);
    assert_eq!(expired["outcome"], "expired", "{expired}");
    assert_eq!((&expired["event_id"], &expired["horizon_ms"]), (&envelope["event_id"], &json!(horizon_ms)));
    assert_eq!(snapshot(), empty, "an expired event was stored");
    // Long after, still expired, still nothing.
    assert_eq!(receive_at(created_ms + 10 * horizon_ms)["outcome"], "expired");
    assert_eq!(snapshot(), empty);

    // At exactly the horizon the event is not older than it: accepted.
    let accepted = receive_at(created_ms + horizon_ms);
    assert_eq!(accepted["outcome"], "accepted", "{accepted}");
    let inbox = array(&snapshot(), "inbox").clone();
    assert_eq!(inbox.len(), 1, "{inbox:?}");
    assert_eq!(inbox[0]["envelope"], envelope, "the stored event is the one sent");
}

/// `receive` reads the envelope from stdin (no `--file`, and `--file -`): the first one is
/// `accepted` and stored, the same bytes again are a `duplicate` that changes nothing.
#[test]
fn receive_from_stdin_accepts_then_answers_duplicate() {
    on_both_backends(scenario_receive_from_stdin_accepts_then_answers_duplicate);
}

fn scenario_receive_from_stdin_accepts_then_answers_duplicate() {
    let s = Setup::new(&["audit"]);
    let envelope = advance(&s, "r1", 0, "reserved", Some(2));
    let event_id = envelope["event_id"].clone();
    let bytes = array(&producer_snapshot(&s), "outbox")[0].to_string().into_bytes();
    let receive = ["receive", "--consumer-db", s.c(), "--consumer-id", "audit"];
    assert!(array(&consumer_snapshot(&s), "inbox").is_empty());

    let r = run_with(&receive, &[], Some(&bytes));
    r.assert_exit(0);
    assert_eq!((&r.json["outcome"], &r.json["event_id"]), (&json!("accepted"), &event_id), "{}", r.stdout);
    let after_accept = consumer_snapshot(&s);
    let inbox = array(&after_accept, "inbox");
    assert_eq!(inbox.len(), 1, "{after_accept}");
    assert_eq!((&inbox[0]["envelope"]["event_id"], &inbox[0]["status"]), (&event_id, &json!("pending")));

    for args in [receive.to_vec(), [&receive[..], &["--file", "-"]].concat()] {
        let r = run_with(&args, &[], Some(&bytes));
        r.assert_exit(0);
        assert_eq!((&r.json["outcome"], &r.json["event_id"]), (&json!("duplicate"), &event_id), "{}", r.stdout);
        assert_eq!(consumer_snapshot(&s), after_accept, "a duplicate changed the consumer");
    }
    // The stored event is the one that was sent: it applies.
    let drained = ok(&["drain", "--consumer-db", s.c(), "--consumer-id", "audit"]);
    assert_eq!(drained["applied"], 1, "{drained}");
}

/// A reader that goes away before the output is written (`tidemark ... | head`) is not the
/// command's failure: no panic, the command's own exit code, and its work done.
#[test]
fn a_closed_stdout_is_not_a_panic_and_keeps_the_exit_code() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("wf.db");
    let mut child = std::process::Command::new(crate::support::BIN)
        .args(["workflow", "init", "--db", crate::support::path_str(&db)])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Close the read end at once: the command writes into a pipe nobody reads.
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(db.exists(), "the command did its work");
}

/// PostgreSQL stores: the SQLite-only durability switch, a PostgreSQL producer's subscription of
/// a file, a `postgres://` endpoint with a password or without a user, and a server that does not
/// answer are typed errors, and nothing is written
/// (neither store's snapshot changes, no schema or file appears). Skipped, saying why, without a
/// server.
#[test]
fn postgres_stores_refuse_what_has_no_postgres_equivalent_and_change_nothing() {
    let Some(_postgres) = crate::workflow_cli::on_postgres() else { return };
    let s = Setup::new(&["audit"]);
    let (p, c) = (s.p(), s.c());
    advance(&s, "r1", 0, "reserved", Some(2));
    let fresh = s.another_store("fresh");
    let side = s.dir.path().join("side.db");
    let side = path_str(&side);
    ok(&["init", "--producer", side, "--source", SOURCE, "--consumer-db", side]);
    let before = snapshots(&s);

    // `--durability normal` is SQLite's per-commit fsync switch: refused before anything opens.
    for args in [
        vec![
            "--durability",
            "normal",
            "advance",
            "--producer",
            p,
            "--flow",
            "r1",
            "--expected-seq",
            "1",
            "--to",
            "confirmed",
        ],
        vec!["--durability", "normal", "drain", "--consumer-db", c, "--consumer-id", "audit"],
        vec!["--durability", "normal", "relay", "--producer", p],
        vec!["--durability", "normal", "init", "--consumer-db", &fresh],
    ] {
        assert_rejected(&s, &args, "invalid_argument");
    }
    // A PostgreSQL producer delivers to no file; a consumer schema on another server (or any, for
    // a producer file) is a `postgres://` endpoint (crash.rs tests them), which never carries a
    // password and always names its user.
    let with_password = format!("{c}&application_name=elsewhere").replacen("postgres@", "postgres:secret@", 1);
    let without_user = format!("{c}&application_name=elsewhere").replacen("postgres@", "", 1);
    for (producer, endpoint) in [(p, side), (side, with_password.as_str()), (p, without_user.as_str())] {
        assert_rejected(
            &s,
            &["subscribe", "--producer", producer, "--consumer-id", "moved", "--endpoint", endpoint],
            "invalid_endpoint",
        );
    }
    // A schema that `init` has not made is never created by another command.
    assert_rejected(
        &s,
        &["subscribe", "--producer", p, "--consumer-id", "new", "--endpoint", &fresh],
        "not_initialized",
    );
    assert!(!s.store_exists(&fresh), "{fresh} was created");
    assert_eq!(snapshots(&s), before);
    assert!(array(&ok(&["snapshot", "--producer", side])["producer"], "subscriptions").is_empty());

    // A server that does not answer: `io`, exit 1.
    let nobody = "postgres://postgres@127.0.0.1:1/test?schema=nowhere&connect_timeout=2";
    for args in [
        vec!["init", "--producer", nobody, "--source", SOURCE],
        vec![
            "advance",
            "--producer",
            nobody,
            "--flow",
            "r1",
            "--expected-seq",
            "0",
            "--to",
            "reserved",
            "--quantity",
            "1",
        ],
        vec!["relay", "--producer", nobody],
        vec!["drain", "--consumer-db", nobody, "--consumer-id", "audit"],
        vec!["snapshot", "--consumer-db", nobody],
    ] {
        let r = run(&args);
        assert_eq!((r.code, r.json["error"]["code"].as_str()), (1, Some("io")), "tidemark {args:?}: {}", r.stdout);
    }
    assert_eq!(snapshots(&s), before);
}
