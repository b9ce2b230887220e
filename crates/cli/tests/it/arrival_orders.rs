//! Arrival orders: one reservation flow with three events (reserved, confirmed, released),
//! received in each of the six possible orders (`tidemark receive --file`, envelopes taken from
//! `snapshot --producer`), with `tidemark apply` after every receive. While a lower seq is
//! missing, apply answers `gap`; when it arrives, `applied`. Whatever the order, the final
//! consumer state is the same: the same projection and the same three effects in seq order.
//! The same holds when the relay is forced into the order 3 -> 1 -> 2 (`relay --event`), with
//! drains in between.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::support::{ok, path_str};

const CONSUMER: &str = "audit";
const PERMUTATIONS: [[i64; 3]; 6] = [[1, 2, 3], [1, 3, 2], [2, 1, 3], [2, 3, 1], [3, 1, 2], [3, 2, 1]];

/// A producer with one flow `r1`: reserved (3), confirmed, released; each envelope in a file.
struct OneFlow {
    dir: tempfile::TempDir,
    producer: PathBuf,
    /// Envelope files and event ids, index = seq - 1.
    files: Vec<PathBuf>,
    event_ids: Vec<String>,
}

fn one_flow() -> OneFlow {
    let dir = tempfile::tempdir().expect("tempdir");
    let producer = dir.path().join("producer.db");
    let p = path_str(&producer);
    ok(&["init", "--producer", p, "--source", "shop"]);
    for (expected_seq, to) in ["reserved", "confirmed", "released"].into_iter().enumerate() {
        let expected_seq = expected_seq.to_string();
        let mut args = vec!["advance", "--producer", p, "--flow", "r1", "--expected-seq", &expected_seq, "--to", to];
        if to == "reserved" {
            args.extend(["--quantity", "3"]);
        }
        let out = ok(&args);
        assert_eq!(out["outcome"], "committed", "{out}");
    }
    let snapshot = ok(&["snapshot", "--producer", p]);
    let outbox = snapshot["producer"]["outbox"].as_array().expect("outbox").clone();
    assert_eq!(outbox.len(), 3, "{snapshot}");
    let mut files = Vec::new();
    let mut event_ids = Vec::new();
    for (index, envelope) in outbox.iter().enumerate() {
        assert_eq!(envelope["seq"], json!(index + 1));
        let file = dir.path().join(format!("event-{}.json", index + 1));
        std::fs::write(&file, serde_json::to_vec(envelope).expect("json")).expect("write envelope");
        files.push(file);
        event_ids.push(envelope["event_id"].as_str().expect("event id").to_string());
    }
    OneFlow { dir, producer, files, event_ids }
}

fn init_consumer(path: &Path) {
    ok(&["init", "--consumer-db", path_str(path)]);
}

fn apply(consumer: &Path) -> Value {
    ok(&["apply", "--consumer-db", path_str(consumer), "--consumer-id", CONSUMER, "--source", "shop", "--flow", "r1"])
}

/// The consumer's state without timestamps: inbox, cursors, receipts, projection, effects.
fn consumer_state(consumer: &Path) -> Value {
    let snapshot = ok(&["snapshot", "--consumer-db", path_str(consumer)]);
    let c = &snapshot["consumer"];
    let inbox: Vec<Value> = c["inbox"]
        .as_array()
        .expect("inbox")
        .iter()
        .map(|r| {
            json!({
                "consumer_id": r["consumer_id"], "event_id": r["envelope"]["event_id"], "seq": r["envelope"]["seq"],
                "status": r["status"], "content_hash": r["content_hash"],
            })
        })
        .collect();
    json!({
        "inbox": inbox,
        "cursors": c["cursors"],
        "receipts": c["receipts"],
        "projection": c["reservation_projection"],
        "effects": c["reservation_effects"],
    })
}

/// What every arrival order must end with.
fn expected_state(flow: &OneFlow) -> Value {
    let kinds = ["reserved", "confirmed", "released"];
    let effects: Vec<Value> = (0..3)
        .map(|i| {
            json!({"consumer_id": CONSUMER, "source": "shop", "flow_id": "r1", "seq": i + 1,
                   "event_id": flow.event_ids[i], "kind": kinds[i], "quantity": 3})
        })
        .collect();
    json!({
        "cursors": [{"consumer_id": CONSUMER, "source": "shop", "flow_id": "r1", "high_water_seq": 3}],
        "receipts": [],
        "projection": [{"consumer_id": CONSUMER, "source": "shop", "flow_id": "r1", "state": "released",
                        "quantity": 3, "last_seq": 3}],
        "effects": effects,
    })
}

fn without_inbox(state: &Value) -> Value {
    let mut state = state.clone();
    state.as_object_mut().expect("object").remove("inbox");
    state
}

#[test]
fn every_arrival_order_applies_in_seq_order_and_ends_in_the_same_state() {
    let flow = one_flow();
    let mut finals: Vec<([i64; 3], Value)> = Vec::new();
    for order in PERMUTATIONS {
        let consumer = flow.dir.path().join(format!("consumer-{}{}{}.db", order[0], order[1], order[2]));
        init_consumer(&consumer);
        let mut received = [false; 3];
        let mut high_water = 0_i64;
        for seq in order {
            let file = &flow.files[(seq - 1) as usize];
            let out = ok(&[
                "receive",
                "--consumer-db",
                path_str(&consumer),
                "--consumer-id",
                CONSUMER,
                "--file",
                path_str(file),
            ]);
            assert_eq!(out["outcome"], "accepted", "order {order:?}, seq {seq}: {out}");
            received[(seq - 1) as usize] = true;
            let out = apply(&consumer);
            if received[high_water as usize] {
                high_water += 1;
                assert_eq!(out["outcome"], "applied", "order {order:?} after receiving {seq}: {out}");
                assert_eq!(out["seq"], json!(high_water), "order {order:?}: {out}");
                assert_eq!(out["event_id"], json!(flow.event_ids[(high_water - 1) as usize]));
            } else {
                assert_eq!(out["outcome"], "gap", "order {order:?} after receiving {seq}: {out}");
                assert_eq!(out["missing_seq"], json!(high_water + 1), "order {order:?}: {out}");
            }
        }
        // Everything has arrived: each further apply takes the next seq, then the flow is idle.
        while high_water < 3 {
            high_water += 1;
            let out = apply(&consumer);
            assert_eq!((&out["outcome"], &out["seq"]), (&json!("applied"), &json!(high_water)), "{order:?}: {out}");
        }
        let out = apply(&consumer);
        assert_eq!((&out["outcome"], &out["high_water_seq"]), (&json!("idle"), &json!(3)), "{order:?}: {out}");
        // A late copy of the first event is a duplicate, and changes nothing.
        let first = &flow.files[(order[0] - 1) as usize];
        let out = ok(&[
            "receive",
            "--consumer-db",
            path_str(&consumer),
            "--consumer-id",
            CONSUMER,
            "--file",
            path_str(first),
        ]);
        assert_eq!(out["outcome"], "duplicate", "{order:?}: {out}");
        finals.push((order, consumer_state(&consumer)));
    }
    let expected = expected_state(&flow);
    let (first_order, first_state) = &finals[0];
    assert_eq!(without_inbox(first_state), expected, "order {first_order:?}");
    for (order, state) in &finals {
        assert_eq!(state, first_state, "order {order:?} ends differently from {first_order:?}");
    }
    let statuses: Vec<&Value> = first_state["inbox"].as_array().expect("inbox").iter().map(|r| &r["status"]).collect();
    assert_eq!(statuses, [&json!("applied"); 3]);
}

#[test]
fn a_relay_forced_into_the_order_three_one_two_reaches_the_same_state() {
    let flow = one_flow();
    let p = path_str(&flow.producer);
    // The reference: in order, by files.
    let reference = flow.dir.path().join("reference.db");
    init_consumer(&reference);
    for file in &flow.files {
        ok(&["receive", "--consumer-db", path_str(&reference), "--consumer-id", CONSUMER, "--file", path_str(file)]);
    }
    let out = ok(&["drain", "--consumer-db", path_str(&reference), "--consumer-id", CONSUMER]);
    assert_eq!((&out["outcome"], &out["applied"]), (&json!("idle"), &json!(3)), "{out}");

    let consumer = flow.dir.path().join("relayed.db");
    let c = path_str(&consumer);
    init_consumer(&consumer);
    let out = ok(&["subscribe", "--producer", p, "--consumer-id", CONSUMER, "--endpoint", c, "--from-start"]);
    assert_eq!(out["queued"], json!(3), "{out}");
    // (seq relayed, drain outcome, applied by that drain, missing seq reported)
    let steps = [(3, "gap", 0, Some(1)), (1, "gap", 1, Some(2)), (2, "idle", 2, None)];
    for (seq, outcome, applied, missing) in steps {
        let event_id = &flow.event_ids[seq - 1];
        let out = ok(&["relay", "--producer", p, "--event", event_id, "--verbose"]);
        assert_eq!((&out["attempted"], &out["accepted"]), (&json!(1), &json!(1)), "relay of seq {seq}: {out}");
        assert_eq!(out["answers"][0]["seq"], json!(seq), "{out}");
        let out = ok(&["drain", "--consumer-db", c, "--consumer-id", CONSUMER]);
        assert_eq!((&out["outcome"], &out["applied"]), (&json!(outcome), &json!(applied)), "after seq {seq}: {out}");
        match missing {
            Some(missing) => {
                let stuck = out["stuck"].as_array().expect("stuck");
                assert_eq!(stuck.len(), 1, "{out}");
                assert_eq!((&stuck[0]["outcome"], &stuck[0]["missing_seq"]), (&json!("gap"), &json!(missing)));
            }
            None => assert_eq!(out["stuck"], json!([]), "{out}"),
        }
    }
    // Nothing is left to deliver, every delivery is accepted, and the state is the reference's.
    let out = ok(&["relay", "--producer", p, "--until-idle"]);
    assert_eq!(out["attempted"], json!(0), "{out}");
    let out = ok(&["outbox", "list", "--producer", p, "--status", "accepted"]);
    assert_eq!(out["deliveries"].as_array().map(Vec::len), Some(3), "{out}");
    let state = consumer_state(&consumer);
    assert_eq!(without_inbox(&state), expected_state(&flow));
    assert_eq!(state, consumer_state(&reference));
}
