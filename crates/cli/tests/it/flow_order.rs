//! What keeps each flow in seq order at a broker (docs/protocol.md, "Order in a broker"):
//! `ProducerStore::overtaking` on both backends, from one body. A delivery overtakes when an
//! earlier event of its flow is still open for the same subscriber (backing off after a failed
//! attempt, or quarantined) and not in the batch; once that event is accepted or dismissed, or
//! when it is in the batch or in flight just before it, nothing overtakes. Another flow and another subscriber are never held.

use tidemark_core::flow::AdvanceRequest;
use tidemark_core::location::StoreLocation;
use tidemark_core::reservation::ReservationMachine;
use tidemark_core::store::{Delivery, DeliveryResult, DeliveryVerdict, ProducerStore, Subscription};
use tidemark_lab::stores::Producer;

use crate::support::{path_str, Setup};

fn positions(batch: &[Delivery]) -> Vec<(String, i64, String)> {
    batch.iter().map(|d| (d.envelope.flow_id.clone(), d.envelope.seq, d.consumer_id.clone())).collect()
}

fn verdict(delivery: &Delivery, verdict: DeliveryVerdict) -> DeliveryResult {
    DeliveryResult {
        position: delivery.position,
        event_id: delivery.envelope.event_id.clone(),
        consumer_id: delivery.consumer_id.clone(),
        verdict,
    }
}

/// The producer of `s` with `consumers` subscribed from the start to its consumer store.
fn subscribed(s: &Setup, consumers: &[&str]) -> Producer {
    let location = StoreLocation::parse(s.p()).unwrap();
    let mut producer = Producer::open_at(location, tidemark_store_sqlite::Durability::Full).unwrap();
    // The consumer store as a subscription names it: its file, or its schema on the server.
    let endpoint = match StoreLocation::parse(s.c()).unwrap() {
        StoreLocation::Sqlite(path) => path_str(&path).to_string(),
        StoreLocation::Postgres(pg) => pg.schema,
    };
    for consumer in consumers {
        let subscription = Subscription { consumer_id: consumer.to_string(), endpoint: endpoint.clone() };
        producer.subscribe(&subscription, true, 1).unwrap();
    }
    producer
}

fn overtaking_holds_a_flow_behind_its_open_events() {
    let s = Setup::new(&[]);
    let mut producer = subscribed(&s, &["bus", "audit"]);
    let advance = |flow: &str, expected_seq: i64, to: &str| AdvanceRequest {
        flow_id: flow.into(),
        expected_seq,
        to_state: to.into(),
        input: serde_json::json!({"quantity": 2}),
        schema_version: 1,
        traceparent: None,
    };
    let requests = [
        advance("a", 0, "reserved"),
        advance("a", 1, "confirmed"),
        advance("a", 2, "released"),
        advance("b", 0, "reserved"),
    ];
    producer.advance_batch(&ReservationMachine, &requests, 1).unwrap();
    let bus = vec!["bus".to_string()];
    let due = |p: &mut Producer, now: i64| p.due_deliveries(now, 100, None, Some(&bus)).unwrap();
    let all = due(&mut producer, 1);
    assert_eq!(all.len(), 4, "{:?}", positions(&all));
    assert!(producer.overtaking(&all, &[]).unwrap().is_empty(), "every earlier event is in the batch");
    // A batch read while the one before it is handed over: a/3 would overtake the open a/1 and
    // a/2, unless they are in flight (handed over, their verdicts not recorded yet).
    let (before, after): (Vec<Delivery>, Vec<Delivery>) =
        all.iter().cloned().partition(|d| d.envelope.flow_id == "a" && d.envelope.seq < 3);
    assert_eq!(before.len(), 2, "{:?}", positions(&before));
    let a3 = after.iter().find(|d| d.envelope.flow_id == "a").unwrap();
    assert_eq!(producer.overtaking(&after, &[]).unwrap(), vec![(a3.position, "bus".to_string())]);
    let in_flight: Vec<(i64, String)> = before.iter().map(|d| (d.position, d.consumer_id.clone())).collect();
    assert!(producer.overtaking(&after, &in_flight).unwrap().is_empty(), "a/1 and a/2 are in flight");

    // a/1 fails and backs off until 1,000: a/2 and a/3 would overtake it, b/1 would not.
    let a1 = all.iter().find(|d| d.envelope.flow_id == "a" && d.envelope.seq == 1).unwrap().clone();
    let retry = DeliveryVerdict::Retry { reason: "down".into(), next_attempt_at_ms: 1_000 };
    producer.record_deliveries(&[verdict(&a1, retry)], 2).unwrap();
    let later = due(&mut producer, 3);
    assert_eq!(positions(&later).len(), 3, "{:?}", positions(&later));
    let held: Vec<i64> = producer.overtaking(&later, &[]).unwrap().into_iter().map(|(position, _)| position).collect();
    let expected: Vec<i64> = later.iter().filter(|d| d.envelope.flow_id == "a").map(|d| d.position).collect::<Vec<_>>();
    assert_eq!(held, expected, "a/2 and a/3 are held behind a/1; b/1 is not");
    // The other subscriber's deliveries of flow a are not held by bus's open a/1.
    let audit = vec!["audit".to_string()];
    let audit_due = producer.due_deliveries(3, 100, None, Some(&audit)).unwrap();
    assert!(producer.overtaking(&audit_due, &[]).unwrap().is_empty());

    // Quarantined, a/1 still holds its flow; accepted, it holds nothing.
    let quarantine = DeliveryVerdict::Quarantine { reason: "refused".into() };
    producer.record_deliveries(&[verdict(&a1, quarantine)], 4).unwrap();
    assert_eq!(producer.overtaking(&later, &[]).unwrap().len(), 2, "a quarantined a/1 holds a/2 and a/3");
    let requeued = producer.resolve_delivery(
        &a1.envelope.event_id,
        "bus",
        tidemark_core::store::DeliveryAction::Requeue,
        "back",
        5,
    );
    assert!(requeued.is_ok(), "{requeued:?}");
    producer.record_deliveries(&[verdict(&a1, DeliveryVerdict::Accepted)], 6).unwrap();
    assert!(producer.overtaking(&later, &[]).unwrap().is_empty(), "a/1 accepted: nothing overtakes");
}

#[test]
fn a_delivery_overtakes_only_behind_an_open_earlier_event_of_its_flow_and_subscriber() {
    crate::workflow_cli::on_both_backends(overtaking_holds_a_flow_behind_its_open_events);
}

/// Retries whose backoff ended after more than a plan's window of their flows' later events
/// were committed: a broker lane's plan still finds them (candidates are in outbox order), hands
/// them over first, and the flows move on. Keyed by due time, the window held only the later
/// events, every one of them held back behind a retry, and the lane stalled for good.
fn retries_behind_a_long_backlog_of_their_flows_are_planned_first() {
    let s = Setup::new(&[]);
    let mut producer = subscribed(&s, &["bus"]);
    let flows: Vec<String> = (0..10).map(|i| format!("f{i}")).collect();
    let step = |flow: &str, expected_seq: i64, to: &str| AdvanceRequest {
        flow_id: flow.into(),
        expected_seq,
        to_state: to.into(),
        input: serde_json::json!({"quantity": 1}),
        schema_version: 1,
        traceparent: None,
    };
    let firsts: Vec<AdvanceRequest> = flows.iter().map(|f| step(f, 0, "reserved")).collect();
    producer.advance_batch(&ReservationMachine, &firsts, 1).unwrap();
    let all = tidemark_engine::RelayOptions { limit: 10, ..Default::default() };
    let first = tidemark_engine::plan(&mut producer, &all, 2).unwrap();
    assert_eq!(first.len(), 10, "{:?}", positions(&first));
    // Every flow's first event fails and backs off until 1,000; meanwhile each flow gets two
    // later events: 20 deliveries, more than the window of a plan of 2 (4 x 2 = 8).
    let retry = DeliveryVerdict::Retry { reason: "down".into(), next_attempt_at_ms: 1_000 };
    let retries: Vec<DeliveryResult> = first.iter().map(|d| verdict(d, retry.clone())).collect();
    producer.record_deliveries(&retries, 3).unwrap();
    for (expected_seq, to) in [(1, "confirmed"), (2, "released")] {
        let later: Vec<AdvanceRequest> = flows.iter().map(|f| step(f, expected_seq, to)).collect();
        producer.advance_batch(&ReservationMachine, &later, 4).unwrap();
    }
    let two = tidemark_engine::RelayOptions { limit: 2, ..Default::default() };
    let lane_batch = |producer: &mut Producer, now: i64| {
        let planned = tidemark_engine::plan(producer, &two, now).unwrap();
        let overtaking = producer.overtaking(&planned, &[]).unwrap();
        tidemark_engine::in_flow_order(planned, &overtaking)
    };
    // Backing off: every candidate is held behind its flow's first event, nothing goes.
    assert!(lane_batch(&mut producer, 500).is_empty());
    // Due again: the first events are planned first and nothing holds them back.
    let batch = lane_batch(&mut producer, 2_000);
    let expected = [("f0".to_string(), 1, "bus".to_string()), ("f1".to_string(), 1, "bus".to_string())];
    assert_eq!(positions(&batch), expected);
}

#[test]
fn retries_behind_more_than_a_window_of_their_flows_later_events_are_not_starved() {
    crate::workflow_cli::on_both_backends(retries_behind_a_long_backlog_of_their_flows_are_planned_first);
}
