//! The producer store: the SQLite producer tests' assertions on PostgreSQL, advances in the
//! caller's transaction, and the retention walk's indexes.

use tidemark_core::error::codes;
use tidemark_core::flow::AdvanceOutcome;
use tidemark_core::reservation::ReservationMachine;
use tidemark_core::store::{
    Delivery, DeliveryAction, DeliveryResult, DeliveryStatus, DeliveryVerdict, ProducerStore, Subscription,
};
use tidemark_core::Error;

use super::support::{advance, reserve, test_db};
use crate::{advance_committed_in, advance_in, PgProducer};

fn accepted(d: &Delivery) -> DeliveryResult {
    DeliveryResult {
        position: d.position,
        event_id: d.envelope.event_id.clone(),
        consumer_id: d.consumer_id.clone(),
        verdict: DeliveryVerdict::Accepted,
    }
}

#[test]
fn advances_commit_state_and_event_and_answer_stale_and_invalid_transition() {
    let db = test_db!("advance");
    let mut producer = PgProducer::init(&db.conn, &db.schema("p"), "shop").unwrap();
    let outcomes = producer
        .advance_batch(&ReservationMachine, &[reserve("a"), reserve("b"), advance("a", 0, "reserved")], 1)
        .unwrap();
    assert!(matches!(&outcomes[0], AdvanceOutcome::Committed { seq: 1, .. }), "{outcomes:?}");
    assert!(matches!(&outcomes[1], AdvanceOutcome::Committed { seq: 1, .. }), "{outcomes:?}");
    assert!(matches!(&outcomes[2], AdvanceOutcome::Stale { current_seq: 1, .. }), "{outcomes:?}");
    let outcome = producer.advance_batch(&ReservationMachine, &[advance("a", 1, "released")], 2).unwrap();
    assert!(matches!(&outcome[0], AdvanceOutcome::InvalidTransition { .. }), "{outcome:?}");
    let confirmed = producer.advance_batch(&ReservationMachine, &[advance("a", 1, "confirmed")], 3).unwrap();
    assert!(matches!(&confirmed[0], AdvanceOutcome::Committed { seq: 2, .. }), "{confirmed:?}");
    let flow = producer.flow("a").unwrap().unwrap();
    assert_eq!((flow.last_seq, flow.state.state.as_str()), (2, "confirmed"));
    assert_eq!(producer.flow("nothing").unwrap(), None);
    // Bad input anywhere in a batch writes nothing of it.
    let before = producer.snapshot(100).unwrap();
    let error = producer.advance_batch(&ReservationMachine, &[reserve("c"), reserve("bad flow")], 4).unwrap_err();
    assert_eq!(error.code(), codes::INVALID_ID);
    assert_eq!(producer.advance_batch(&ReservationMachine, &[], 4).unwrap_err().code(), codes::LIMIT_EXCEEDED);
    assert_eq!(producer.snapshot(100).unwrap(), before);
    let seqs: Vec<(String, i64)> = before.outbox.iter().map(|e| (e.flow_id.clone(), e.seq)).collect();
    assert_eq!(seqs, [("a".to_string(), 1), ("b".to_string(), 1), ("a".to_string(), 2)], "commit order");
}

#[test]
fn events_keep_the_generation_they_were_committed_under() {
    let db = test_db!("generation");
    let mut producer = PgProducer::init(&db.conn, &db.schema("p"), "shop").unwrap();
    let first = producer.identity().generation.clone();
    producer.advance_batch(&ReservationMachine, &[reserve("a")], 1).unwrap();
    let second = producer.rotate_generation().unwrap().generation;
    producer.advance_batch(&ReservationMachine, &[reserve("b")], 2).unwrap();
    let outbox = producer.snapshot(10).unwrap().outbox;
    assert_eq!(outbox[0].generation, first, "an old event is redelivered unchanged after a rotation");
    assert_eq!(outbox[1].generation, second);
    assert!(producer.due_deliveries(10, 10, None, None).unwrap().is_empty(), "no subscribers, nothing due");
}

#[test]
fn a_verdict_is_recorded_at_the_position_it_was_handed_out_for() {
    let db = test_db!("verdict");
    let mut producer = PgProducer::init(&db.conn, &db.schema("p"), "shop").unwrap();
    let subscription = Subscription { consumer_id: "audit".into(), endpoint: "a".into() };
    producer.subscribe(&subscription, true, 0).unwrap();
    producer.advance_batch(&ReservationMachine, &[reserve("a"), reserve("b")], 1).unwrap();
    let due = producer.due_deliveries(10, 10, None, None).unwrap();
    let positions: Vec<i64> = due.iter().map(|d| d.position).collect();
    assert_eq!(positions, [1, 2]);
    let result = |d: &Delivery, position: i64, verdict: DeliveryVerdict| DeliveryResult {
        position,
        event_id: d.envelope.event_id.clone(),
        consumer_id: d.consumer_id.clone(),
        verdict,
    };
    let retry = DeliveryVerdict::Retry { reason: "down".into(), next_attempt_at_ms: 5 };
    let error = producer.record_deliveries(&[result(&due[0], 2, retry)], 2).unwrap_err();
    assert!(matches!(error, Error::Invariant(_)), "{error:?}");
    assert_eq!(producer.delivery_counts().unwrap(), [("pending".to_string(), 2)]);
    producer.record_deliveries(&[result(&due[1], 2, DeliveryVerdict::Accepted)], 2).unwrap();
    assert_eq!(producer.delivery_counts().unwrap(), [("accepted".to_string(), 1), ("pending".to_string(), 1)]);
    producer.record_deliveries(&[result(&due[0], 1, DeliveryVerdict::Accepted)], 3).unwrap();
    assert_eq!(producer.delivery_counts().unwrap(), [("accepted".to_string(), 2)]);
    assert!(producer.due_deliveries(10, 10, None, None).unwrap().is_empty());
}

/// An event stamped by a writer whose clock runs a day ahead of the relay's is due at once.
#[test]
fn an_event_stamped_ahead_of_the_relays_clock_is_due_at_once() {
    let db = test_db!("ahead");
    let mut producer = PgProducer::init(&db.conn, &db.schema("p"), "shop").unwrap();
    producer.subscribe(&Subscription { consumer_id: "audit".into(), endpoint: "a".into() }, true, 0).unwrap();
    let (relay_now, writer_now) = (1_000, 1_000 + 86_400_000);
    producer.advance_batch(&ReservationMachine, &[reserve("a")], writer_now).unwrap();
    let due = producer.due_deliveries(relay_now, 10, None, None).unwrap();
    assert_eq!(due.iter().map(|d| d.position).collect::<Vec<_>>(), [1]);
    assert_eq!(due[0].envelope.created_at_ms, writer_now);
}

/// Failures back off, quarantine, and an operator requeues or dismisses; `redeliver` hands a
/// subscriber everything again; a subscriber added later without `from_start` gets only new events.
#[test]
fn retries_quarantine_resolve_and_redeliver() {
    let db = test_db!("resolve");
    let mut producer = PgProducer::init(&db.conn, &db.schema("p"), "shop").unwrap();
    producer.subscribe(&Subscription { consumer_id: "audit".into(), endpoint: "a".into() }, true, 0).unwrap();
    producer.advance_batch(&ReservationMachine, &[reserve("a"), reserve("b")], 1).unwrap();
    let due = producer.due_deliveries(10, 10, None, None).unwrap();
    let verdict = |d: &Delivery, verdict: DeliveryVerdict| DeliveryResult { verdict, ..accepted(d) };
    producer
        .record_deliveries(
            &[
                verdict(&due[0], DeliveryVerdict::Retry { reason: "down".into(), next_attempt_at_ms: 100 }),
                verdict(&due[1], DeliveryVerdict::Quarantine { reason: "conflict".into() }),
            ],
            10,
        )
        .unwrap();
    assert!(producer.due_deliveries(50, 10, None, None).unwrap().is_empty(), "backing off");
    let retried = producer.due_deliveries(100, 10, None, None).unwrap();
    assert_eq!((retried.len(), retried[0].attempts), (1, 1));
    let quarantined = producer.deliveries(Some(DeliveryStatus::Quarantined), 10).unwrap();
    assert_eq!((quarantined.len(), quarantined[0].last_error.as_deref()), (1, Some("conflict")));
    let event_b = due[1].envelope.event_id.clone();
    let code = |r: tidemark_core::Result<_>| r.map(|_: tidemark_core::store::DeliveryEntry| ()).unwrap_err().code();
    assert_eq!(
        code(producer.resolve_delivery(&event_b, "audit", DeliveryAction::Requeue, "", 11)),
        codes::INVALID_ARGUMENT
    );
    assert_eq!(code(producer.resolve_delivery(&event_b, "nobody", DeliveryAction::Requeue, "x", 11)), codes::NOT_FOUND);
    let requeued = producer.resolve_delivery(&event_b, "audit", DeliveryAction::Requeue, "fixed", 11).unwrap();
    assert_eq!((requeued.status, requeued.attempts), (DeliveryStatus::Pending, 0));
    assert_eq!(
        code(producer.resolve_delivery(&event_b, "audit", DeliveryAction::Requeue, "again", 12)),
        codes::INVALID_STATE_CHANGE
    );
    let dismissed = producer.resolve_delivery(&event_b, "audit", DeliveryAction::Dismiss, "not needed", 12).unwrap();
    assert_eq!(dismissed.status, DeliveryStatus::Dismissed);
    producer.record_deliveries(&[accepted(&retried[0])], 120).unwrap();
    let statuses: Vec<DeliveryStatus> = producer.deliveries(None, 10).unwrap().iter().map(|d| d.status).collect();
    assert_eq!(statuses, [DeliveryStatus::Accepted, DeliveryStatus::Dismissed]);
    // Everything again from the start: both pending as if never attempted.
    let report = producer.redeliver("audit", None).unwrap();
    assert_eq!((report.redelivered, report.pruned), (2, 0));
    let again = producer.deliveries(None, 10).unwrap();
    assert!(again.iter().all(|d| d.status == DeliveryStatus::Pending && d.attempts == 0), "{again:?}");
    assert_eq!(producer.redeliver("nobody", None).unwrap_err().code(), codes::NOT_FOUND);
    // A late subscriber receives events committed from now on only.
    assert_eq!(
        producer.subscribe(&Subscription { consumer_id: "late".into(), endpoint: "b".into() }, false, 13).unwrap(),
        0
    );
    producer.advance_batch(&ReservationMachine, &[reserve("c")], 14).unwrap();
    let late: Vec<String> = producer
        .due_deliveries(1_000, 10, None, None)
        .unwrap()
        .into_iter()
        .filter(|d| d.consumer_id == "late")
        .map(|d| d.envelope.flow_id)
        .collect();
    assert_eq!(late, ["c"]);
    assert_eq!(producer.rename_subscription("late", "later").unwrap(), 1);
    assert_eq!(producer.rename_subscription("late", "later").unwrap(), 0, "idempotent");
    assert_eq!(producer.rename_subscription("later", "audit").unwrap_err().code(), codes::ALREADY_EXISTS);
}

#[test]
fn a_subscriber_that_accepted_events_moves_only_to_an_endpoint_that_holds_them() {
    let db = test_db!("move");
    let mut producer = PgProducer::init(&db.conn, &db.schema("p"), "shop").unwrap();
    let at = |endpoint: &str| Subscription { consumer_id: "audit".into(), endpoint: endpoint.into() };
    producer.subscribe(&at("a"), true, 0).unwrap();
    let requests = [reserve("a"), reserve("b"), reserve("c"), reserve("d")];
    producer.advance_batch(&ReservationMachine, &requests, 1).unwrap();
    let due = producer.due_deliveries(10, 10, None, None).unwrap();
    let result = |i: usize, verdict: DeliveryVerdict| DeliveryResult { verdict, ..accepted(&due[i]) };
    producer.record_deliveries(&[result(0, DeliveryVerdict::Quarantine { reason: "no".into() })], 2).unwrap();
    producer.subscribe_checked(&at("b"), false, 3, Some(false)).unwrap();
    producer
        .record_deliveries(&[result(1, DeliveryVerdict::Accepted), result(3, DeliveryVerdict::Accepted)], 4)
        .unwrap();
    assert_eq!(producer.subscriptions().unwrap(), [at("b")]);
    let before = producer.snapshot(10).unwrap();
    let refused = producer.subscribe_checked(&at("c"), false, 5, Some(false)).unwrap_err();
    assert_eq!(refused.code(), codes::INVALID_STATE_CHANGE, "{refused:?}");
    assert_eq!(producer.snapshot(10).unwrap(), before, "a refused move changes nothing");
    producer.subscribe_checked(&at("c"), false, 5, Some(true)).unwrap();
    assert_eq!(producer.subscriptions().unwrap(), [at("c")]);
}

/// Retention walks the outbox in position order: it passes over events a subscriber has not
/// settled and stops at the first event written at or after the cutoff.
#[test]
fn prune_deletes_in_position_order_up_to_the_first_event_written_after_the_cutoff() {
    let db = test_db!("prune");
    let mut producer = PgProducer::init(&db.conn, &db.schema("p"), "shop").unwrap();
    producer.advance_batch(&ReservationMachine, &[reserve("a")], 1_000).unwrap();
    producer.subscribe(&Subscription { consumer_id: "audit".into(), endpoint: "a".into() }, false, 1_500).unwrap();
    for (flow, now) in [("b", 2_000), ("c", 5_000), ("d", 3_000)] {
        producer.advance_batch(&ReservationMachine, &[reserve(flow)], now).unwrap();
    }
    let due = producer.due_deliveries(10_000, 10, None, None).unwrap();
    let mut flows: Vec<&str> = due.iter().map(|d| d.envelope.flow_id.as_str()).collect();
    flows.sort();
    assert_eq!(flows, ["b", "c", "d"], "the subscription starts after a");
    let left = |producer: &PgProducer| -> Vec<String> {
        producer.snapshot(10).unwrap().outbox.into_iter().map(|e| e.flow_id).collect()
    };
    let report = producer.prune_delivered(1_000, 10, 6_000).unwrap();
    assert_eq!((report.events_deleted, report.deliveries_deleted, report.more), (1, 0, false));
    assert_eq!(left(&producer), ["b", "c", "d"]);
    let all: Vec<DeliveryResult> = due.iter().map(accepted).collect();
    producer.record_deliveries(&all, 5_000).unwrap();
    let report = producer.prune_delivered(1_000, 1, 6_000).unwrap();
    assert_eq!((report.events_deleted, report.deliveries_deleted, report.more), (1, 1, true));
    assert_eq!(left(&producer), ["c", "d"]);
    assert_eq!(producer.prune_delivered(1_000, 10, 6_000).unwrap().events_deleted, 0, "c stops the walk");
    let report = producer.prune_delivered(1_000, 10, 7_000).unwrap();
    assert_eq!((report.events_deleted, report.deliveries_deleted), (2, 2));
    assert!(left(&producer).is_empty());
    // Positions are never handed out twice, not even after the newest events were pruned.
    producer.advance_batch(&ReservationMachine, &[reserve("e")], 8_000).unwrap();
    let due = producer.due_deliveries(9_000, 10, None, None).unwrap();
    assert_eq!(due.iter().map(|d| d.position).collect::<Vec<_>>(), [5]);
    assert_eq!(producer.prune_delivered(-1, 10, 1).unwrap_err().code(), codes::INVALID_ARGUMENT);
    assert_eq!(producer.prune_delivered(0, 0, 1).unwrap_err().code(), codes::LIMIT_EXCEEDED);
}

/// `PgProducer::transaction`: business rows commit with a committed advance; a stale advance
/// dooms the transaction, even when the closure ignores the error and returns `Ok`.
#[test]
fn a_producer_transaction_commits_business_rows_only_with_their_event() {
    let db = test_db!("tx");
    let schema = db.schema("p");
    let mut producer = PgProducer::init(&db.conn, &schema, "shop").unwrap();
    let orders = format!("\"{schema}\".orders");
    producer.client().batch_execute(&format!("CREATE TABLE {orders} (id text PRIMARY KEY, total bigint)")).unwrap();
    let insert = format!("INSERT INTO {orders} (id, total) VALUES ($1, $2)");
    let committed = producer
        .transaction(1_000, |tx| -> tidemark_core::Result<_> {
            tx.execute(&insert, &[&"order-1", &300_i64])?;
            tx.advance(&ReservationMachine, &reserve("order-1"))
        })
        .unwrap();
    assert_eq!((committed.seq, committed.state.as_str()), (1, "reserved"));
    let stale = producer.transaction(1_001, |tx| -> tidemark_core::Result<_> {
        tx.execute(&insert, &[&"order-2", &100_i64])?;
        tx.advance(&ReservationMachine, &reserve("order-1"))
    });
    assert_eq!(stale.unwrap_err().code(), codes::STALE);
    let ignored = producer.transaction(1_002, |tx| -> tidemark_core::Result<()> {
        tx.execute(&insert, &[&"order-3", &100_i64])?;
        let _ = tx.advance(&ReservationMachine, &advance("order-1", 1, "released"));
        Ok(())
    });
    assert_eq!(ignored.unwrap_err().code(), codes::INVALID_TRANSITION, "a refusal dooms the transaction");
    let ids: Vec<String> = producer
        .client()
        .query(&format!("SELECT id FROM {orders} ORDER BY id"), &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(ids, ["order-1"]);
    assert_eq!(producer.snapshot(10).unwrap().outbox.len(), 1);
}

/// `advance_in` / `advance_committed_in` on a `postgres::Transaction` the user opened on a
/// connection of their own: committed with the business row, or refused and rolled back with it.
#[test]
fn advance_in_the_users_own_transaction_commits_or_rolls_back_with_the_business_rows() {
    let db = test_db!("advance_in");
    let schema = db.schema("p");
    let producer = PgProducer::init(&db.conn, &schema, "shop").unwrap();
    let mut user = db.client();
    let orders = format!("\"{schema}\".orders");
    user.batch_execute(&format!("CREATE TABLE {orders} (id text PRIMARY KEY)")).unwrap();
    let insert = format!("INSERT INTO {orders} (id) VALUES ($1)");
    let mut tx = user.transaction().unwrap();
    tx.execute(&insert, &[&"order-1"]).unwrap();
    let outcome = advance_in(&mut tx, &schema, &ReservationMachine, &reserve("order-1"), 1_000).unwrap();
    assert!(matches!(outcome, AdvanceOutcome::Committed { seq: 1, .. }), "{outcome:?}");
    assert!(producer.snapshot(10).unwrap().outbox.is_empty(), "nothing is visible before the commit");
    tx.commit().unwrap();
    assert_eq!(producer.snapshot(10).unwrap().outbox.len(), 1);

    let mut tx = user.transaction().unwrap();
    tx.execute(&insert, &[&"order-2"]).unwrap();
    let refused = advance_committed_in(&mut tx, &schema, &ReservationMachine, &reserve("order-1"), 1_001).unwrap_err();
    assert_eq!(refused.code(), codes::STALE);
    tx.rollback().unwrap();
    let ids: Vec<String> =
        user.query(&format!("SELECT id FROM {orders} ORDER BY id"), &[]).unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(ids, ["order-1"]);
    assert_eq!(producer.snapshot(10).unwrap().outbox.len(), 1);
    let flow = producer.flow("order-1").unwrap().unwrap();
    assert_eq!(flow.last_seq, 1);
    // A schema that is not a producer's: typed, nothing written.
    let mut tx = user.transaction().unwrap();
    let error = advance_in(&mut tx, "Not-A-Schema", &ReservationMachine, &reserve("x"), 1).unwrap_err();
    assert_eq!(error.code(), codes::INVALID_ARGUMENT);
}

/// The retention walks and deletes read their indexes (checked with `EXPLAIN` on a table of
/// 50,000 rows after `ANALYZE`): the outbox page by `outbox_pkey`, the inbox page by
/// `inbox_pkey`, the deletes by primary key, expired receipts by `receipts_age`.
#[test]
fn retention_reads_use_their_indexes() {
    let db = test_db!("explain");
    let schema = db.schema("p");
    PgProducer::init(&db.conn, &schema, "shop").unwrap();
    crate::PgConsumer::init(&db.conn, &schema, tidemark_core::policy::RetentionPolicy::default()).unwrap();
    let mut client = db.client();
    let s = format!("\"{schema}\"");
    client
        .batch_execute(&format!(
            "INSERT INTO {s}.outbox (position, event_id, flow_id, seq, event_type, schema_version, payload, content_hash, created_at_ms, generation)
               SELECT g, 'e' || g, 'f' || g, 1, 't', 1, '{{}}', 'h', g, 'g' FROM generate_series(1, 50000) g;
             INSERT INTO {s}.inbox (consumer_id, source, flow_id, seq, event_id, generation, event_type, schema_version, payload, content_hash, created_at_ms, received_at_ms, status, status_at_ms)
               SELECT 'c', 'shop', 'f' || g, 1, 'e' || g, 'g', 't', 1, '{{}}', 'h', g, g, 'applied', g FROM generate_series(1, 50000) g;
             INSERT INTO {s}.receipts (consumer_id, source, flow_id, seq, event_id, content_hash, created_at_ms)
               SELECT 'c', 'shop', 'r' || g, 1, 'r' || g, 'h', g FROM generate_series(1, 50000) g;
             ANALYZE {s}.outbox; ANALYZE {s}.inbox; ANALYZE {s}.receipts;"
        ))
        .unwrap();
    let plan = |client: &mut postgres::Client, template: &str, args: &str| -> String {
        let statement = crate::schema::sql(&schema, template);
        client.batch_execute("DEALLOCATE ALL").unwrap();
        client.batch_execute(&format!("PREPARE p AS {statement}")).unwrap();
        let rows = client.query(&format!("EXPLAIN EXECUTE p({args})"), &[]).unwrap();
        rows.iter().map(|r| r.get::<_, String>(0)).collect::<Vec<_>>().join("\n")
    };
    let outbox_page = plan(&mut client, crate::producer::PRUNE_PAGE_SQL, "0, 1024");
    assert!(outbox_page.contains("Index Scan using outbox_pkey"), "{outbox_page}");
    let inbox_page = plan(&mut client, crate::consumer::PRUNE_PAGE_SQL, "0, 1024, 100");
    assert!(inbox_page.contains("Index Scan using inbox_pkey"), "{inbox_page}");
    let delete = plan(&mut client, "DELETE FROM {s}.outbox WHERE position = $1", "7");
    assert!(delete.contains("outbox_pkey"), "{delete}");
    let delete = plan(&mut client, "DELETE FROM {s}.inbox WHERE record = $1", "7");
    assert!(delete.contains("inbox_pkey"), "{delete}");
    let expire = plan(&mut client, crate::consumer::EXPIRE_RECEIPTS_SQL, "100, 1000");
    assert!(expire.contains("receipts_age"), "{expire}");
}

/// The trace context of an advance rides with its event on PostgreSQL as on SQLite: outbox,
/// delivery, inbox, handler; the same event with another trace context is a duplicate.
#[test]
fn a_trace_context_travels_from_the_advance_to_the_handler() {
    use tidemark_core::policy::RetentionPolicy;
    use tidemark_core::store::{ConsumerStore, DrainScope, HandleError, Handler, ReceiveOutcome};
    use tidemark_core::Envelope;
    const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    struct Seen(Vec<Option<String>>);
    impl Handler<crate::ApplyTransaction> for Seen {
        fn handle(&mut self, _: &crate::ApplyTransaction, _: &str, event: &Envelope) -> Result<(), HandleError> {
            self.0.push(event.traceparent.clone());
            Ok(())
        }
    }
    let db = test_db!("traceparent");
    let mut producer = PgProducer::init(&db.conn, &db.schema("p"), "shop").unwrap();
    producer.subscribe(&Subscription { consumer_id: "audit".into(), endpoint: "x".into() }, true, 0).unwrap();
    producer
        .advance_batch(&ReservationMachine, &[reserve("a").with_traceparent(TRACEPARENT), reserve("b")], 1)
        .unwrap();
    let due = producer.due_deliveries(10, 10, None, None).unwrap();
    let carried: Vec<_> = due.iter().map(|d| d.envelope.traceparent.as_deref()).collect();
    assert_eq!(carried, [Some(TRACEPARENT), None]);
    let mut consumer = crate::PgConsumer::init(&db.conn, &db.schema("c"), RetentionPolicy::default()).unwrap();
    let items: Vec<(&str, &Envelope)> = due.iter().map(|d| ("audit", &d.envelope)).collect();
    let outcomes = consumer.receive_batch(&items, 2).unwrap();
    assert!(outcomes.iter().all(|o| matches!(o, ReceiveOutcome::Accepted { .. })), "{outcomes:?}");
    let mut again = due[1].envelope.clone();
    again.traceparent = Some(TRACEPARENT.into());
    let outcome = consumer.receive_batch(&[("audit", &again)], 3).unwrap();
    assert!(matches!(outcome[0], ReceiveOutcome::Duplicate { .. }), "{outcome:?}");
    let mut seen = Seen(Vec::new());
    consumer.drain("audit", &DrainScope::All, 10, &mut seen, 4).unwrap();
    assert_eq!(seen.0, [Some(TRACEPARENT.to_string()), None]);
    assert_eq!(consumer.inbox("audit", None, 10).unwrap()[0].envelope.traceparent.as_deref(), Some(TRACEPARENT));
}

/// An outcome as both backends word it (the event id differs by nature).
fn advance_word(outcome: &AdvanceOutcome) -> String {
    match outcome {
        AdvanceOutcome::Committed { flow_id, seq, state, .. } => format!("committed {flow_id}/{seq} {state}"),
        AdvanceOutcome::Stale { flow_id, expected_seq, current_seq } => {
            format!("stale {flow_id} {expected_seq}/{current_seq}")
        }
        AdvanceOutcome::InvalidTransition { flow_id, current_state, to_state, reason } => {
            format!("invalid {flow_id} {current_state}->{to_state}: {reason}")
        }
    }
}

/// A batch that names flows several times (new and stored ones, with refusals between) is
/// decided as if advanced one by one: the same answers, flows and outbox as SQLite's store.
#[test]
fn an_advance_batch_naming_flows_several_times_answers_as_sqlite_does() {
    let db = test_db!("advance_batch");
    let dir = tempfile::tempdir().unwrap();
    let mut pg = PgProducer::init(&db.conn, &db.schema("p"), "shop").unwrap();
    let mut lite = tidemark_store_sqlite::SqliteProducer::init(&dir.path().join("p.db"), "shop").unwrap();
    let batches = [
        vec![reserve("stored"), reserve("twice")],
        vec![
            advance("stored", 1, "confirmed"),
            advance("stored", 1, "released"),
            reserve("new"),
            advance("new", 1, "confirmed"),
            advance("twice", 1, "released"),
            reserve("twice"),
            advance("new", 2, "released"),
            reserve("refused"),
            advance("refused", 1, "reserved"),
            advance("elsewhere", 0, "confirmed"),
        ],
        vec![advance("stored", 2, "confirmed"), advance("new", 2, "confirmed")],
    ];
    for (at, batch) in batches.iter().enumerate() {
        let now = at as i64 + 1;
        let on_pg: Vec<String> =
            pg.advance_batch(&ReservationMachine, batch, now).unwrap().iter().map(advance_word).collect();
        let on_lite: Vec<String> =
            lite.advance_batch(&ReservationMachine, batch, now).unwrap().iter().map(advance_word).collect();
        assert_eq!(on_pg, on_lite, "batch {at}");
    }
    let (pg, lite) = (pg.snapshot(100).unwrap(), lite.snapshot(100).unwrap());
    let events = |s: &tidemark_core::store::ProducerSnapshot| -> Vec<(String, i64, String, String)> {
        s.outbox.iter().map(|e| (e.flow_id.clone(), e.seq, e.event_type.clone(), e.payload.to_string())).collect()
    };
    assert_eq!(events(&pg), events(&lite), "the outbox in commit order");
    assert_eq!(events(&pg).len(), 7, "{:?}", events(&pg));
    let flows = |s: &tidemark_core::store::ProducerSnapshot| -> Vec<(String, i64, String)> {
        let mut flows: Vec<_> =
            s.flows.iter().map(|f| (f.flow_id.clone(), f.last_seq, f.state.state.clone())).collect();
        flows.sort();
        flows
    };
    assert_eq!(flows(&pg), flows(&lite));
}
