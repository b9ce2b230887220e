//! The consumer store: the SQLite consumer tests' assertions on PostgreSQL, receive outcomes,
//! drains with a handler writing projection rows in the apply transaction, gaps and blocks.

use tidemark_core::error::codes;
use tidemark_core::policy::RetentionPolicy;
use tidemark_core::store::{
    ApplyOutcome, ConsumerStore, DrainScope, DrainStop, HandleError, Handler, InboxStatus, ReceiveOutcome,
};
use tidemark_core::{Envelope, Error, Result};

use super::support::{test_db, TestDb};
use crate::{ApplyTransaction, PgConsumer};

/// Event 1 of flow `f` from `shop`.
fn event() -> Envelope {
    Envelope {
        event_id: "e1".into(),
        source: "shop".into(),
        generation: "g1".into(),
        flow_id: "f".into(),
        seq: 1,
        event_type: "t".into(),
        schema_version: 1,
        payload: serde_json::json!({}),
        created_at_ms: 1,
        traceparent: None,
    }
}

fn at(flow: &str, seq: i64) -> Envelope {
    Envelope { event_id: format!("e-{flow}-{seq}"), flow_id: flow.into(), seq, ..event() }
}

fn consumer(db: &TestDb) -> PgConsumer {
    PgConsumer::init(&db.conn, &db.schema("c"), RetentionPolicy::default()).unwrap()
}

fn words(outcomes: &[ReceiveOutcome]) -> Vec<&'static str> {
    outcomes.iter().map(ReceiveOutcome::word).collect()
}

/// Applies every event except flow `b`'s, which it blocks.
struct AllButB;

impl<T> Handler<T> for AllButB {
    fn handle(&mut self, _tx: &T, _consumer: &str, event: &Envelope) -> Result<(), HandleError> {
        if event.flow_id == "b" {
            return Err(HandleError::Blocked("not b".into()));
        }
        Ok(())
    }
}

struct Refuse;

impl Handler<ApplyTransaction> for Refuse {
    fn handle(&mut self, _tx: &ApplyTransaction, _consumer: &str, _event: &Envelope) -> Result<(), HandleError> {
        Err(HandleError::Blocked("never".into()))
    }
}

/// Writes one projection row per event (in the consumer's schema); blocks `b`'s first event after
/// writing, and fails (an infrastructure error) on flow `boom`.
struct Project;

impl Handler<ApplyTransaction> for Project {
    fn handle(&mut self, tx: &ApplyTransaction, consumer: &str, event: &Envelope) -> Result<(), HandleError> {
        let insert = format!("INSERT INTO \"{}\".log (consumer_id, event_id) VALUES ($1, $2)", tx.schema());
        tx.execute(&insert, &[&consumer, &event.event_id]).map_err(|e| HandleError::Failed(Error::from(e)))?;
        match event.flow_id.as_str() {
            "b" if event.seq == 1 => Err(HandleError::Blocked("b is refused after writing".into())),
            "boom" => Err(HandleError::Failed(Error::store("the projection's service is down"))),
            _ => Ok(()),
        }
    }
}

fn logged(consumer: &mut PgConsumer) -> Vec<String> {
    let query = format!("SELECT event_id FROM \"{}\".log ORDER BY event_id", consumer.schema());
    consumer.client().query(&query, &[]).unwrap().iter().map(|r| r.get(0)).collect()
}

#[test]
fn receive_answers_accepted_duplicate_conflict_and_expired() {
    let db = test_db!("receive");
    let mut consumer = PgConsumer::init(&db.conn, &db.schema("c"), RetentionPolicy { horizon_ms: 1_000 }).unwrap();
    let first = Envelope { created_at_ms: 5_000, ..event() };
    let tampered = Envelope { payload: serde_json::json!({"x": 1}), ..first.clone() };
    let other_at_1 = Envelope { event_id: "e9".into(), ..first.clone() };
    let elsewhere = Envelope { flow_id: "g".into(), ..first.clone() };
    let old = Envelope { event_id: "old".into(), flow_id: "h".into(), created_at_ms: 1_000, ..first.clone() };
    let outcomes = consumer
        .receive_batch(
            &[
                ("x", &first),
                ("x", &first),
                ("x", &tampered),
                ("x", &other_at_1),
                ("x", &elsewhere),
                ("x", &old),
                ("y", &first),
            ],
            5_500,
        )
        .unwrap();
    assert_eq!(words(&outcomes), ["accepted", "duplicate", "conflict", "conflict", "conflict", "expired", "accepted"]);
    match &outcomes[2] {
        ReceiveOutcome::Conflict { reason, .. } => assert!(reason.contains("different content"), "{reason}"),
        other => panic!("{other:?}"),
    }
    match &outcomes[5] {
        ReceiveOutcome::Expired { horizon_ms, .. } => assert_eq!(*horizon_ms, 1_000),
        other => panic!("{other:?}"),
    }
    // A malformed envelope fails the whole batch, and nothing of it is stored.
    let bad = Envelope { seq: 0, ..at("z", 1) };
    let error = consumer.receive_batch(&[("x", &at("z", 1)), ("x", &bad)], 5_500).unwrap_err();
    assert!(error.is_invalid_input(), "{error:?}");
    assert_eq!(consumer.inbox("x", None, 10).unwrap().len(), 1);
    assert_eq!(consumer.receive_batch(&[("bad id", &first)], 1).unwrap_err().code(), codes::INVALID_ID);
    assert_eq!(consumer.inbox("x", None, 0).unwrap_err().code(), codes::LIMIT_EXCEEDED);
}

#[test]
fn rerunning_a_finished_rename_is_a_no_op() {
    let db = test_db!("rename");
    let mut consumer = consumer(&db);
    let event = event();
    consumer.receive_batch(&[("a", &event)], 1).unwrap();
    assert_eq!(consumer.rename_consumer("a", "b", 1).unwrap().inbox, 1);
    let again = consumer.rename_consumer("a", "b", 1).unwrap();
    assert_eq!((again.inbox, again.receipts, again.cursors, again.projections), (0, 0, 0, 0));
    assert_eq!(consumer.rename_consumer("a", "c", 1).unwrap_err().code(), codes::NOT_FOUND);
    assert_eq!(consumer.inbox("b", None, 10).unwrap().len(), 1);
    match &consumer.receive_batch(&[("a", &event)], 2).unwrap()[0] {
        ReceiveOutcome::Conflict { reason, .. } => assert!(reason.contains("renamed to b"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn retiring_a_stateless_consumer_refuses_its_old_id_and_guards_the_stateful_cases() {
    let db = test_db!("retire");
    let mut consumer = consumer(&db);
    let event = event();
    consumer.receive_batch(&[("held", &event)], 1).unwrap();
    let code = |r: Result<()>| r.unwrap_err().code();
    assert_eq!(code(consumer.retire_consumer("held", "fresh", 1)), codes::INVALID_STATE_CHANGE);
    assert_eq!(code(consumer.retire_consumer("idle", "held", 1)), codes::ALREADY_EXISTS);
    assert_eq!(code(consumer.retire_consumer("idle", "idle", 1)), codes::INVALID_ARGUMENT);
    consumer.retire_consumer("idle", "idle2", 1).unwrap();
    consumer.retire_consumer("idle", "idle2", 2).unwrap();
    assert_eq!(code(consumer.retire_consumer("idle", "other", 3)), codes::INVALID_STATE_CHANGE);
    match consumer.receive_batch(&[("idle", &event)], 4).unwrap().remove(0) {
        ReceiveOutcome::Conflict { reason, .. } => assert!(reason.contains("renamed to idle2"), "{reason}"),
        other => panic!("an event for a retired id must be refused: {other:?}"),
    }
    assert!(matches!(consumer.receive_batch(&[("idle2", &event)], 5).unwrap()[0], ReceiveOutcome::Accepted { .. }));
}

#[test]
fn receipts_answer_while_new_events_are_accepted() {
    let db = test_db!("receipts");
    let mut consumer = consumer(&db);
    let first = event();
    consumer.receive_batch(&[("x", &first)], 1).unwrap();
    consumer.drain("x", &DrainScope::All, 10, &mut AllButB, 2).unwrap();
    assert_eq!(consumer.prune(0, 10, 3).unwrap().compacted, 1);
    let second = Envelope { event_id: "e2".into(), seq: 2, ..event() };
    let elsewhere = Envelope { flow_id: "g".into(), ..event() };
    let other_at_1 = Envelope { event_id: "e9".into(), ..event() };
    let outcomes =
        consumer.receive_batch(&[("x", &second), ("x", &first), ("x", &elsewhere), ("x", &other_at_1)], 4).unwrap();
    assert_eq!(words(&outcomes), ["accepted", "duplicate", "conflict", "conflict"]);
    match &outcomes[2] {
        ReceiveOutcome::Conflict { reason, .. } => assert!(reason.contains("already held for shop/f/1"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(consumer.inbox("x", None, 10).unwrap().len(), 1, "only e2 was stored");
    let reissued = Envelope { event_id: "e9".into(), generation: "g2".into(), ..event() };
    match &consumer.receive_batch(&[("x", &reissued)], 5).unwrap()[0] {
        ReceiveOutcome::Conflict { reason, .. } => {
            assert!(reason.contains("(receipt)") && reason.contains("generation changed from g1 to g2"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(consumer.snapshot(10).unwrap().receipts[0].generation.as_deref(), Some("g1"));
    // Past the horizon the receipt goes, and the same event is then `expired`, never applied again.
    let horizon = consumer.retention().horizon_ms;
    assert_eq!(consumer.prune(0, 10, 1 + horizon + 1).unwrap().receipts_deleted, 1);
    assert_eq!(words(&consumer.receive_batch(&[("x", &first)], 1 + horizon + 1).unwrap()), ["expired"]);
}

#[test]
fn prune_compacts_in_receive_order_up_to_the_first_record_received_after_the_cutoff() {
    let db = test_db!("cprune");
    let mut consumer = consumer(&db);
    let on = |flow: &str| Envelope { event_id: format!("e-{flow}"), flow_id: flow.into(), ..event() };
    for (flow, now) in [("a", 1_000), ("b", 2_000), ("e", 50_000), ("c", 3_000)] {
        consumer.receive_batch(&[("x", &on(flow))], now).unwrap();
    }
    for _ in 0..3 {
        consumer.drain("x", &DrainScope::All, 10, &mut AllButB, 3_500).unwrap();
    }
    consumer.receive_batch(&[("x", &on("d"))], 6_500).unwrap();
    consumer.drain("x", &DrainScope::All, 10, &mut AllButB, 5_000).unwrap();
    let left = |consumer: &PgConsumer| -> Vec<(String, InboxStatus)> {
        consumer.inbox("x", None, 10).unwrap().into_iter().map(|r| (r.envelope.flow_id, r.status)).collect()
    };
    let (applied, blocked) = (InboxStatus::Applied, InboxStatus::Blocked);
    let all = |flows: &[(&str, InboxStatus)]| -> Vec<(String, InboxStatus)> {
        flows.iter().map(|(f, s)| (f.to_string(), *s)).collect()
    };
    assert_eq!(left(&consumer), all(&[("a", applied), ("b", blocked), ("c", applied), ("d", applied), ("e", applied)]));
    let first = consumer.prune(1_000, 1, 7_000).unwrap();
    assert_eq!((first.compacted, first.more), (1, true));
    assert_eq!(left(&consumer), all(&[("b", blocked), ("c", applied), ("d", applied), ("e", applied)]));
    let second = consumer.prune(1_000, 10, 7_000).unwrap();
    assert_eq!((second.compacted, second.more), (2, false));
    assert_eq!(left(&consumer), all(&[("b", blocked), ("d", applied)]));
    let later = consumer.prune(1_000, 10, 8_000).unwrap();
    assert_eq!(later.compacted, 1, "d goes once the cutoff passes its receive time");
    assert_eq!(left(&consumer), all(&[("b", blocked)]));
    assert_eq!(consumer.cursors(Some("x")).unwrap().len(), 4, "high-water marks are never pruned (b has none)");
}

// A blocked record was rewritten by every drain pass of `tidemark serve` (SQLite's regression
// test checks the WAL size; here the row's version, `xmin`, must not change).
#[test]
fn a_record_blocked_again_for_the_same_reason_is_not_rewritten() {
    let db = test_db!("reblock");
    let mut consumer = consumer(&db);
    consumer.receive_batch(&[("a", &event())], 1).unwrap();
    assert_eq!(consumer.drain("a", &DrainScope::All, 10, &mut Refuse, 2).unwrap().outcome, DrainStop::Blocked);
    let version_query = format!("SELECT xmin::text FROM \"{}\".inbox", consumer.schema());
    let version =
        |consumer: &mut PgConsumer| -> String { consumer.client().query_one(&version_query, &[]).unwrap().get(0) };
    let before = version(&mut consumer);
    for now in 3..10 {
        assert_eq!(consumer.drain("a", &DrainScope::All, 10, &mut Refuse, now).unwrap().outcome, DrainStop::Blocked);
    }
    assert_eq!(version(&mut consumer), before, "a repeated block rewrote the record");
    let record = consumer.inbox("a", Some(InboxStatus::Blocked), 10).unwrap().remove(0);
    assert_eq!(record.reason.as_deref(), Some("never"));
}

/// The handler's projection rows commit with the apply; a blocked event's rows roll back to its
/// savepoint (its flow stops, the others go on); a failing handler rolls the whole drain back.
/// Gaps wait, an operator skip passes a blocked record, and the flow goes on.
#[test]
fn a_drain_commits_the_handlers_rows_with_the_apply_and_stops_only_stuck_flows() {
    let db = test_db!("drain");
    let mut consumer = consumer(&db);
    let log = format!("\"{}\".log", consumer.schema());
    consumer
        .client()
        .batch_execute(&format!("CREATE TABLE {log} (consumer_id text NOT NULL, event_id text NOT NULL)"))
        .unwrap();
    consumer.register_projection_table("log").unwrap();
    assert_eq!(consumer.register_projection_table("nothing").unwrap_err().code(), codes::INVALID_ARGUMENT);
    let events = [at("a", 1), at("a", 2), at("b", 1), at("b", 2), at("c", 2)];
    let items: Vec<(&str, &Envelope)> = events.iter().map(|e| ("x", e)).collect();
    consumer.receive_batch(&items, 10).unwrap();
    let report = consumer.drain("x", &DrainScope::All, 100, &mut Project, 11).unwrap();
    assert_eq!((report.outcome, report.applied), (DrainStop::Blocked, 2));
    assert_eq!(
        report.stuck,
        [
            ApplyOutcome::Blocked {
                source: "shop".into(),
                flow_id: "b".into(),
                seq: 1,
                event_id: "e-b-1".into(),
                reason: "b is refused after writing".into()
            },
            ApplyOutcome::Gap { source: "shop".into(), flow_id: "c".into(), missing_seq: 1 },
        ]
    );
    assert_eq!(logged(&mut consumer), ["e-a-1", "e-a-2"], "the blocked event's row rolled back");
    // Whether a consumer "has received" from a source: a record, a receipt or a high-water mark.
    assert!(consumer.has_received("x", "shop").unwrap());
    assert!(!consumer.has_received("x", "other").unwrap());
    let mut from_other = at("o", 1);
    from_other.source = "other".into();
    from_other.event_id = "e-other-1".into();
    assert!(!consumer.has_received("y", "other").unwrap());
    consumer.receive_batch(&[("y", &from_other)], 12).unwrap();
    assert!(consumer.has_received("y", "other").unwrap(), "received, not applied yet");
    // An infrastructure failure rolls back everything the drain did, the applies included.
    consumer.receive_batch(&[("x", &at("boom", 1)), ("x", &at("a", 3))], 12).unwrap();
    let error = consumer.drain("x", &DrainScope::All, 100, &mut Project, 13).unwrap_err();
    assert!(error.to_string().contains("service is down"), "{error}");
    assert_eq!(logged(&mut consumer), ["e-a-1", "e-a-2"]);
    let open = consumer.inbox("x", Some(InboxStatus::Pending), 10).unwrap();
    assert_eq!(
        open.iter().map(|r| r.envelope.event_id.as_str()).collect::<Vec<_>>(),
        ["e-a-3", "e-b-2", "e-boom-1", "e-c-2"]
    );
    // One flow only, with a limit.
    let flow = DrainScope::Flow { source: "shop".into(), flow_id: "a".into() };
    let report = consumer.drain("x", &flow, 1, &mut Project, 14).unwrap();
    assert_eq!((report.outcome, report.applied), (DrainStop::Limit, 1));
    // Skip the blocked record: its flow goes on, its handler never ran for it.
    assert_eq!(consumer.skip_blocked("x", "e-a-1", "no", 15).unwrap_err().code(), codes::INVALID_STATE_CHANGE);
    assert_eq!(consumer.skip_blocked("x", "nothing", "no", 15).unwrap_err().code(), codes::NOT_FOUND);
    let skipped = consumer.skip_blocked("x", "e-b-1", "bad data", 15).unwrap();
    assert_eq!(
        (skipped.status, skipped.reason.as_deref()),
        (InboxStatus::Skipped, Some("skipped by operator: bad data"))
    );
    let flow_b = DrainScope::Flow { source: "shop".into(), flow_id: "b".into() };
    let report = consumer.drain("x", &flow_b, 10, &mut Project, 16).unwrap();
    assert_eq!((report.outcome, report.applied), (DrainStop::Idle, 1));
    let cursors: Vec<(String, i64)> =
        consumer.cursors(Some("x")).unwrap().into_iter().map(|c| (c.flow_id, c.high_water_seq)).collect();
    assert_eq!(cursors, [("a".to_string(), 3), ("b".to_string(), 2)]);
    // The rename carries the registered projection table over.
    let renamed = consumer.rename_consumer("x", "x2", 17).unwrap();
    assert_eq!((renamed.cursors, renamed.projections), (2, 4));
}

/// `snapshot_with` reads the dedup tables and the caller's tables in one read transaction: a drain
/// another connection commits in between shows in neither.
#[test]
fn a_snapshot_with_the_handler_tables_is_one_read_transaction() {
    let db = test_db!("snapshot");
    let mut consumer = consumer(&db);
    let schema = consumer.schema().to_string();
    let log = format!("\"{schema}\".log");
    consumer
        .client()
        .batch_execute(&format!("CREATE TABLE {log} (consumer_id text NOT NULL, event_id text NOT NULL)"))
        .unwrap();
    consumer.receive_batch(&[("a", &event())], 1).unwrap();
    let count = |tx: &mut postgres::Transaction<'_>| -> Result<i64> {
        Ok(tx.query_one(&format!("SELECT count(*) FROM {log}"), &[])?.get(0))
    };
    let (snapshot, logged) = consumer
        .snapshot_with(10, |tx| {
            let mut other = PgConsumer::open(&db.conn, &schema).unwrap();
            let report = other.drain("a", &DrainScope::All, 10, &mut Project, 2).unwrap();
            assert_eq!(report.applied, 1, "the other connection commits while the snapshot is open");
            count(tx)
        })
        .unwrap();
    assert_eq!(snapshot.inbox[0].status, InboxStatus::Pending);
    assert_eq!(logged, 0, "the handler's table was read after the drain, outside the snapshot");
    let (after, logged) = consumer.snapshot_with(10, count).unwrap();
    assert_eq!((after.inbox[0].status, logged), (InboxStatus::Applied, 1));
}

/// Each event of a receive batch meets exactly the records of the events before it, as if
/// received one by one: runs of new events inserted at once, duplicates, conflicts at a position
/// and by id, expired events before and after a new one at the same position, a retired consumer,
/// and a mark left by a drain. The answers (and their reasons) and the inboxes are SQLite's.
#[test]
fn a_receive_batch_answers_each_event_as_sqlite_does() {
    let db = test_db!("receive_batch");
    let dir = tempfile::tempdir().unwrap();
    let retention = RetentionPolicy { horizon_ms: 1_000 };
    let mut pg = PgConsumer::init(&db.conn, &db.schema("c"), retention).unwrap();
    let mut lite = tidemark_store_sqlite::SqliteConsumer::init(&dir.path().join("c.db"), retention).unwrap();
    let new = |flow: &str, seq: i64| Envelope { created_at_ms: 5_000, ..at(flow, seq) };
    let old = |flow: &str, seq: i64, id: &str| Envelope { event_id: id.into(), created_at_ms: 10, ..at(flow, seq) };
    let other = |flow: &str, seq: i64, id: &str| Envelope { event_id: id.into(), ..new(flow, seq) };
    let tampered = Envelope { payload: serde_json::json!({"x": 1}), ..new("a", 1) };
    let first: Vec<(&str, Envelope)> = vec![("x", new("applied", 1)), ("x", new("applied", 2)), ("gone", new("a", 1))];
    let second: Vec<(&str, Envelope)> = vec![
        ("x", new("a", 1)),
        ("x", new("a", 2)),
        ("x", new("a", 1)),
        ("x", tampered),
        ("x", other("a", 1, "e-other")),
        ("x", Envelope { flow_id: "b".into(), ..new("a", 2) }),
        ("x", old("c", 1, "old-1")),
        ("x", other("c", 1, "new-1")),
        ("x", old("c", 1, "old-2")),
        ("x", new("applied", 1)),
        ("x", other("applied", 2, "e-late")),
        ("x", new("applied", 3)),
        ("y", new("a", 1)),
        ("gone", new("a", 2)),
        ("y", new("d", 5)),
        ("y", new("d", 4)),
    ];
    let mut answers: Vec<(Vec<String>, Vec<String>)> = Vec::new();
    for (at, batch) in [first, second].iter().enumerate() {
        let items: Vec<(&str, &Envelope)> = batch.iter().map(|(c, e)| (*c, e)).collect();
        let say = |outcomes: Vec<ReceiveOutcome>| -> Vec<String> {
            outcomes
                .into_iter()
                .map(|o| match o {
                    ReceiveOutcome::Conflict { event_id, reason, .. } => format!("conflict {event_id}: {reason}"),
                    other => format!("{} {}", other.word(), serde_json::to_string(&other).unwrap()),
                })
                .collect()
        };
        answers.push((say(pg.receive_batch(&items, 5_500).unwrap()), say(lite.receive_batch(&items, 5_500).unwrap())));
        if at == 0 {
            // `x` applies flow `applied` (its mark moves to 2); `gone` is renamed away.
            let scope = DrainScope::All;
            pg.drain("x", &scope, 10, &mut AllButB, 5_500).unwrap();
            lite.drain("x", &scope, 10, &mut AllButB, 5_500).unwrap();
            pg.rename_consumer("gone", "went", 5_500).unwrap();
            lite.rename_consumer("gone", "went", 5_500).unwrap();
        }
    }
    for (at, (on_pg, on_lite)) in answers.iter().enumerate() {
        assert_eq!(on_pg, on_lite, "batch {at}");
    }
    let words: Vec<&str> = answers[1].0.iter().map(|a| a.split(' ').next().unwrap()).collect();
    assert_eq!(
        words,
        [
            "accepted",
            "accepted",
            "duplicate",
            "conflict",
            "conflict",
            "conflict",
            "expired",
            "accepted",
            "conflict",
            "duplicate",
            "conflict",
            "accepted",
            "accepted",
            "conflict",
            "accepted",
            "accepted"
        ]
    );
    for consumer in ["x", "y"] {
        let held = |entries: Vec<tidemark_core::store::InboxEntry>| -> Vec<(String, i64, String, &'static str)> {
            let mut held: Vec<_> = entries
                .into_iter()
                .map(|e| (e.envelope.flow_id, e.envelope.seq, e.envelope.event_id, e.status.as_str()))
                .collect();
            held.sort();
            held
        };
        assert_eq!(held(pg.inbox(consumer, None, 100).unwrap()), held(lite.inbox(consumer, None, 100).unwrap()));
    }
}

/// A handler that takes `.1` events at once (the trait's default `handle_batch`: the inner
/// handler's `handle` for each), counting the batches it was handed.
struct Batches<H>(H, usize, usize);

impl<H: Handler<ApplyTransaction>> Handler<ApplyTransaction> for Batches<H> {
    fn handle(&mut self, tx: &ApplyTransaction, consumer: &str, event: &Envelope) -> Result<(), HandleError> {
        self.0.handle(tx, consumer, event)
    }

    fn batch_max(&self) -> usize {
        self.1
    }

    fn handle_batch(&mut self, tx: &ApplyTransaction, consumer: &str, events: &[Envelope]) -> Result<(), HandleError> {
        self.2 += 1;
        events.iter().try_for_each(|event| self.handle(tx, consumer, event))
    }
}

/// A batch the handler refuses after writing rolls back whole, and its events are applied again
/// one at a time: only the refused flow stops (its later event in the batch stays pending), every
/// other event is applied, and the drain reports, writes and leaves pending exactly what the
/// one-at-a-time drain does.
#[test]
fn a_refused_batch_rolls_back_and_is_applied_one_event_at_a_time() {
    let db = test_db!("drain_batch");
    let events = [at("a", 1), at("a", 2), at("b", 1), at("b", 2), at("c", 1), at("d", 1), at("e", 2)];
    let items: Vec<(&str, &Envelope)> = events.iter().map(|e| ("x", e)).collect();
    let mut outcomes = Vec::new();
    for (name, batch_max) in [("one", 1), ("batched", 4)] {
        let mut consumer = PgConsumer::init(&db.conn, &db.schema(name), RetentionPolicy::default()).unwrap();
        let log = format!("\"{}\".log", consumer.schema());
        consumer
            .client()
            .batch_execute(&format!("CREATE TABLE {log} (consumer_id text NOT NULL, event_id text NOT NULL)"))
            .unwrap();
        consumer.receive_batch(&items, 10).unwrap();
        let mut handler = Batches(Project, batch_max, 0);
        let report = consumer.drain("x", &DrainScope::All, 100, &mut handler, 11).unwrap();
        let pending: Vec<String> = consumer
            .inbox("x", Some(InboxStatus::Pending), 10)
            .unwrap()
            .into_iter()
            .map(|r| r.envelope.event_id)
            .collect();
        let cursors: Vec<(String, i64)> =
            consumer.cursors(Some("x")).unwrap().into_iter().map(|c| (c.flow_id, c.high_water_seq)).collect();
        // [a1 a2 b1 b2] is refused at b1 and replayed; [c1 d1] is applied as a batch.
        assert_eq!(handler.2, if batch_max == 1 { 0 } else { 2 }, "batches handed to {name}");
        outcomes.push((report, logged(&mut consumer), pending, cursors));
    }
    let (report, logged, pending, cursors) = &outcomes[0];
    assert_eq!((report.outcome, report.applied), (DrainStop::Blocked, 4));
    assert_eq!(logged, &["e-a-1", "e-a-2", "e-c-1", "e-d-1"]);
    assert_eq!(pending, &["e-b-2", "e-e-2"]);
    assert_eq!(cursors, &[("a".to_string(), 2), ("c".to_string(), 1), ("d".to_string(), 1)]);
    assert_eq!(report.stuck.len(), 2, "{:?}", report.stuck);
    assert_eq!(outcomes[0], outcomes[1], "batching changed what the drain did");
}
