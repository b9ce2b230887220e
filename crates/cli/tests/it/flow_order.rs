//! What keeps each flow in seq order at a broker (docs/protocol.md, "Order in a broker"):
//! `ProducerStore::overtaking` on both backends, from one body. A delivery overtakes when an
//! earlier event of its flow is still open for the same subscriber (backing off after a failed
//! attempt, or quarantined) and not in the batch; once that event is accepted or dismissed, or
//! when it is in the batch, nothing overtakes. Another flow and another subscriber are never held.

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

fn overtaking_holds_a_flow_behind_its_open_events() {
    let s = Setup::new(&[]);
    let location = StoreLocation::parse(s.p()).unwrap();
    let mut producer = Producer::open_at(location, tidemark_store_sqlite::Durability::Full).unwrap();
    // The consumer store as a subscription names it: its file, or its schema on the server.
    let endpoint = match StoreLocation::parse(s.c()).unwrap() {
        StoreLocation::Sqlite(path) => path_str(&path).to_string(),
        StoreLocation::Postgres(pg) => pg.schema,
    };
    for consumer in ["bus", "audit"] {
        let subscription = Subscription { consumer_id: consumer.into(), endpoint: endpoint.clone() };
        producer.subscribe(&subscription, true, 1).unwrap();
    }
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
    assert!(producer.overtaking(&all).unwrap().is_empty(), "every earlier event is in the batch");

    // a/1 fails and backs off until 1,000: a/2 and a/3 would overtake it, b/1 would not.
    let a1 = all.iter().find(|d| d.envelope.flow_id == "a" && d.envelope.seq == 1).unwrap().clone();
    let retry = DeliveryVerdict::Retry { reason: "down".into(), next_attempt_at_ms: 1_000 };
    producer.record_deliveries(&[verdict(&a1, retry)], 2).unwrap();
    let later = due(&mut producer, 3);
    assert_eq!(positions(&later).len(), 3, "{:?}", positions(&later));
    let held: Vec<i64> = producer.overtaking(&later).unwrap().into_iter().map(|(position, _)| position).collect();
    let expected: Vec<i64> = later.iter().filter(|d| d.envelope.flow_id == "a").map(|d| d.position).collect::<Vec<_>>();
    assert_eq!(held, expected, "a/2 and a/3 are held behind a/1; b/1 is not");
    // The other subscriber's deliveries of flow a are not held by bus's open a/1.
    let audit = vec!["audit".to_string()];
    let audit_due = producer.due_deliveries(3, 100, None, Some(&audit)).unwrap();
    assert!(producer.overtaking(&audit_due).unwrap().is_empty());

    // Quarantined, a/1 still holds its flow; accepted, it holds nothing.
    let quarantine = DeliveryVerdict::Quarantine { reason: "refused".into() };
    producer.record_deliveries(&[verdict(&a1, quarantine)], 4).unwrap();
    assert_eq!(producer.overtaking(&later).unwrap().len(), 2, "a quarantined a/1 holds a/2 and a/3");
    let requeued = producer.resolve_delivery(
        &a1.envelope.event_id,
        "bus",
        tidemark_core::store::DeliveryAction::Requeue,
        "back",
        5,
    );
    assert!(requeued.is_ok(), "{requeued:?}");
    producer.record_deliveries(&[verdict(&a1, DeliveryVerdict::Accepted)], 6).unwrap();
    assert!(producer.overtaking(&later).unwrap().is_empty(), "a/1 accepted: nothing overtakes");
}

#[test]
fn a_delivery_overtakes_only_behind_an_open_earlier_event_of_its_flow_and_subscriber() {
    crate::workflow_cli::on_both_backends(overtaking_holds_a_flow_behind_its_open_events);
}
