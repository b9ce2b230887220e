//! Concurrency: real `tidemark` processes racing on the same files. SQLite serialises writers
//! (BEGIN IMMEDIATE + busy timeout); the protocol must turn every race into a clean answer:
//! exactly one `committed` per seq, the other contenders `stale`; relays and drains running side
//! by side never lose, duplicate or reorder an effect. Every loop here is bounded. Each scenario
//! runs on SQLite files, then on PostgreSQL schemas of the test server (where the counter row
//! and the stores' advisory locks serialise what must be), skipped, saying why, without one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Barrier;

use serde_json::Value;

use crate::crash::{advance, advance_cmd, array, assert_converged, producer_snapshot, settle, strs};
use crate::support::{run, Setup};
use crate::workflow_cli::on_both_backends;

const CONTENDERS: usize = 6;

/// Run `args` in `CONTENDERS` processes released together; every one must exit 0.
fn race(args: &[String]) -> Vec<Value> {
    let barrier = Barrier::new(CONTENDERS);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..CONTENDERS)
            .map(|_| {
                scope.spawn(|| {
                    barrier.wait();
                    let r = run(&strs(args));
                    assert_eq!(r.code, 0, "a contender failed instead of answering:\n{}\n{}", r.stdout, r.stderr);
                    r.json
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("contender thread")).collect()
    })
}

#[test]
fn six_advances_with_the_same_expected_seq_commit_exactly_once() {
    on_both_backends(scenario_six_advances_with_the_same_expected_seq_commit_exactly_once);
}

fn scenario_six_advances_with_the_same_expected_seq_commit_exactly_once() {
    let s = Setup::new(&["audit", "search"]);
    for flow in ["f1", "f2"] {
        for (expected_seq, to, quantity) in [(0, "reserved", Some(7)), (1, "confirmed", None), (2, "released", None)] {
            let answers = race(&advance_cmd(s.p(), flow, expected_seq, to, quantity));
            let committed: Vec<&Value> = answers.iter().filter(|a| a["outcome"] == "committed").collect();
            assert_eq!(committed.len(), 1, "{flow} seq {}: {answers:?}", expected_seq + 1);
            assert_eq!(committed[0]["seq"], expected_seq + 1);
            assert_eq!(committed[0]["state"], to);
            for answer in answers.iter().filter(|a| a["outcome"] != "committed") {
                assert_eq!(answer["outcome"], "stale", "{answer}");
                assert_eq!(answer["expected_seq"], expected_seq);
                assert_eq!(answer["current_seq"], expected_seq + 1, "{answer}");
            }
        }
    }
    let producer = producer_snapshot(&s);
    assert_eq!(array(&producer, "outbox").len(), 6, "one event per committed seq, nothing more");
    for flow in array(&producer, "flows") {
        assert_eq!((flow["state"].as_str(), flow["last_seq"].as_i64()), (Some("released"), Some(3)), "{flow}");
    }
    settle(&s);
    assert_converged(&s);
}

/// Relays and drains (several of each, for several consumers) run in bounded loops while flows
/// advance; afterwards one final relay + drain leaves every projection equal to the producer.
#[test]
fn concurrent_relays_and_drains_lose_nothing_and_apply_once_in_order() {
    on_both_backends(scenario_concurrent_relays_and_drains_lose_nothing_and_apply_once_in_order);
}

fn scenario_concurrent_relays_and_drains_lose_nothing_and_apply_once_in_order() {
    const FLOWS: usize = 6;
    const LOOPS: usize = 12;
    let s = Setup::new(&["audit", "search"]);
    let (relayed, applied) = (AtomicU64::new(0), AtomicU64::new(0));
    std::thread::scope(|scope| {
        // Two advancers, each driving its own half of the flows through the whole chain.
        for half in 0..2 {
            let s = &s;
            scope.spawn(move || {
                for (expected_seq, to, quantity) in
                    [(0, "reserved", Some(2)), (1, "confirmed", None), (2, "released", None)]
                {
                    for i in (half..FLOWS).step_by(2) {
                        advance(s, &format!("c{i}"), expected_seq, to, quantity);
                    }
                }
            });
        }
        for _ in 0..2 {
            let (s, relayed) = (&s, &relayed);
            scope.spawn(move || {
                for _ in 0..LOOPS {
                    let r = run(&["relay", "--producer", s.p(), "--limit", "3"]);
                    assert_eq!(r.code, 0, "relay failed:\n{}\n{}", r.stdout, r.stderr);
                    assert_eq!(r.json["conflict"], 0, "{}", r.stdout);
                    relayed.fetch_add(r.json["attempted"].as_u64().expect("attempted"), Ordering::Relaxed);
                }
            });
        }
        for consumer in ["audit", "audit", "search", "search"] {
            let (s, applied) = (&s, &applied);
            scope.spawn(move || {
                for _ in 0..LOOPS {
                    let r = run(&["drain", "--consumer-db", s.c(), "--consumer-id", consumer, "--limit", "2"]);
                    assert_eq!(r.code, 0, "drain failed:\n{}\n{}", r.stdout, r.stderr);
                    assert_ne!(r.json["outcome"], "blocked", "{}", r.stdout);
                    applied.fetch_add(r.json["applied"].as_u64().expect("applied"), Ordering::Relaxed);
                }
            });
        }
    });
    // How much happened during the race depends on scheduling; the end state must not.
    eprintln!("during the race: {relayed:?} deliveries attempted, {applied:?} events applied");
    let producer = producer_snapshot(&s);
    assert_eq!(array(&producer, "outbox").len(), FLOWS * 3);
    settle(&s);
    assert_converged(&s);
}
