//! The outbox is written inside the caller's own transaction: business rows and events commit
//! or roll back together.

use serde_json::json;
use tidemark_core::flow::{AdvanceOutcome, AdvanceRequest};
use tidemark_core::reservation::ReservationMachine;
use tidemark_core::store::ProducerStore;
use tidemark_store_sqlite::{advance_in, SqliteProducer};

fn reserve(flow: &str) -> AdvanceRequest {
    AdvanceRequest {
        flow_id: flow.into(),
        expected_seq: 0,
        to_state: "reserved".into(),
        input: json!({"quantity": 3}),
        schema_version: 1,
        traceparent: None,
    }
}

fn counts(producer: &mut SqliteProducer) -> (i64, i64, i64) {
    let conn = producer.connection();
    let orders: i64 = conn.query_row("SELECT count(*) FROM orders", [], |r| r.get(0)).unwrap();
    let outbox: i64 = conn.query_row("SELECT count(*) FROM outbox", [], |r| r.get(0)).unwrap();
    let flows: i64 = conn.query_row("SELECT count(*) FROM flows", [], |r| r.get(0)).unwrap();
    (orders, outbox, flows)
}

#[test]
fn a_rolled_back_business_transaction_leaves_neither_row() {
    let dir = tempfile::tempdir().unwrap();
    let mut producer = SqliteProducer::init(&dir.path().join("p.db"), "shop").unwrap();
    producer.connection().execute_batch("CREATE TABLE orders (id TEXT PRIMARY KEY, total INTEGER)").unwrap();

    let tx = producer.begin().unwrap();
    tx.execute("INSERT INTO orders (id, total) VALUES (?1, ?2)", ("order-1", 300)).unwrap();
    let outcome = tx.advance(&ReservationMachine, &reserve("order-1"), 1).unwrap();
    assert!(matches!(outcome, AdvanceOutcome::Committed { seq: 1, .. }));
    drop(tx); // rolled back
    assert_eq!(counts(&mut producer), (0, 0, 0));

    let tx = producer.begin().unwrap();
    tx.execute("INSERT INTO orders (id, total) VALUES (?1, ?2)", ("order-1", 300)).unwrap();
    tx.advance(&ReservationMachine, &reserve("order-1"), 1).unwrap();
    tx.commit().unwrap();
    assert_eq!(counts(&mut producer), (1, 1, 1));
}

#[test]
fn advance_in_joins_a_transaction_the_caller_opened() {
    let dir = tempfile::tempdir().unwrap();
    let mut producer = SqliteProducer::init(&dir.path().join("p.db"), "shop").unwrap();
    producer.connection().execute_batch("CREATE TABLE orders (id TEXT PRIMARY KEY, total INTEGER)").unwrap();

    let conn = producer.connection();
    let tx = conn.transaction().unwrap();
    tx.execute("INSERT INTO orders (id, total) VALUES ('order-2', 5)", []).unwrap();
    advance_in(&tx, &ReservationMachine, &reserve("order-2"), 1).unwrap();
    tx.rollback().unwrap();
    assert_eq!(counts(&mut producer), (0, 0, 0));

    let conn = producer.connection();
    let tx = conn.transaction().unwrap();
    tx.execute("INSERT INTO orders (id, total) VALUES ('order-2', 5)", []).unwrap();
    advance_in(&tx, &ReservationMachine, &reserve("order-2"), 1).unwrap();
    tx.commit().unwrap();
    assert_eq!(counts(&mut producer), (1, 1, 1));
    assert_eq!(producer.flow("order-2").unwrap().unwrap().last_seq, 1);
}

#[test]
fn advance_in_refuses_autocommit_mode() {
    let dir = tempfile::tempdir().unwrap();
    let mut producer = SqliteProducer::init(&dir.path().join("p.db"), "shop").unwrap();
    let err = advance_in(producer.connection(), &ReservationMachine, &reserve("order-3"), 1).unwrap_err();
    assert_eq!(err.code(), "invalid_argument");
}

#[test]
fn outbox_events_are_immutable() {
    let dir = tempfile::tempdir().unwrap();
    let mut producer = SqliteProducer::init(&dir.path().join("p.db"), "shop").unwrap();
    producer.advance_batch(&ReservationMachine, &[reserve("order-4")], 1).unwrap();
    let err = producer.connection().execute("UPDATE outbox SET payload = '{}'", []).unwrap_err();
    assert!(err.to_string().contains("immutable"), "{err}");
}
