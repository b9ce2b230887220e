//! Model check: random operation sequences run against the SQLite stores (real files in a
//! tempdir: one producer, two consumer databases, four consumer slots, three of them subscribed
//! at the start; in-process through the library crates), and the same code against the
//! PostgreSQL stores (one schema per database on the server of `TIDEMARK_TEST_POSTGRES`, default
//! the local one; skipped with a message when it does not answer), each against the in-memory model
//! (`tidemark_core::model`), with the same clock and the same engine (`relay_once`). After every
//! operation the normalised outcome and the full normalised state (flows, outbox, deliveries,
//! inbox, cursors, receipts, projections, effects, retired ids) must be equal, and the protocol
//! invariants must hold: no duplicate effects; per (consumer, flow) the effects plus the skipped
//! seqs are exactly 1..=high_water, in order; no delivery is accepted that its consumer does not
//! hold; what a consumer holds at a (consumer, source, flow, seq) never changes to another event
//! (a re-issued seq, a tampered copy) and every effect was written by that event; an outbox event
//! keeps the generation it was committed under and a new one carries the current generation.
//!
//! Operations: advance (1..=3 flows per transaction, with stale, invalid and v2 requests), relay,
//! `relay --event`, direct redelivery, reordered and tampered receives, apply, drain, skip,
//! consumer and producer prune, resolve (requeue, dismiss), the two rename steps, clock ticks
//! (also to an event's exact horizon), crashes (below), and:
//! - `RelayUnreachable`: a relay pass in which one consumer database's endpoint fails with a
//!   transport error (`Endpoints::store` errs, no protocol answer). Checked on each side: its
//!   deliveries answer `failed`, count one attempt, back off (pending, due later) or are
//!   quarantined at `POLICY.max_attempts`, are never accepted, its database is untouched, the
//!   other database's consumers get protocol answers, and no delivery outside the batch changes.
//! - `Subscribe`: subscribing mid-run, with or without `from_start`: the fourth slot `d`, a
//!   re-subscription (a no-op), or a slot's original id after a rename (a new subscription for an
//!   id its consumer database has retired, so every delivery conflicts). Checked on each side: a
//!   new id gets exactly the events still in the outbox with `from_start` and none otherwise; a
//!   re-subscription changes nothing.
//! - `RotateGeneration`, `BackupProducer`, `RestoreProducer`: the producer's generation changes
//!   mid-run; a backup (also taken when a case starts) is put back in place of the producer
//!   (SQLite: the files; the model: a clone) and the generation rotated, so the restored producer
//!   redelivers old events (keeping their generation: `duplicate`) and re-issues (flow, seq)
//!   values that consumers may already hold with other content (`conflict`, naming the
//!   generation change).
//!
//! Normalisation maps every event id to its (source, flow, seq), with `@genN` for events of
//! a later generation, every content hash to the event (or tampered copy) it is the hash of, and
//! the producer generations to `<gen>`, `<gen1>`, ... in the order they appeared. Timestamps are
//! kept: both sides run on the same fixed clock, so they must match too.
//!
//! On PostgreSQL the backup is a copy of the producer's tables into another schema (a dump, in
//! effect) and the restore puts them back in one transaction; the reservation handler is the
//! built-in one on PostgreSQL (`tidemark_builtins::reservation::postgres`).
//!
//! A drain draws how many events its handler takes at once (`batch`): 1 is the one-at-a-time
//! path; above 1 the stores hand the handler batches (`Handler::handle_batch`: on PostgreSQL the
//! built-in handler's three statements per batch, on SQLite the default one-after-the-other), and
//! the model, which always applies one event at a time, checks that batching changes nothing:
//! not the outcomes, not what a refused event's flow keeps pending, not the projections.
//!
//! "Crash" drops the SQLite (or PostgreSQL) store objects (after dropping an open producer or consumer
//! transaction, or after a handler failure in the middle of a drain) and reopens them from the
//! files; the model, which only holds committed state, is unchanged by it.
//!
//! Bounded: `PROPTEST_CASES` cases (default 64) of at most `MAX_OPS` operations.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestRunner};
use serde::Serialize;
use serde_json::{json, Value};
use tidemark_builtins::reservation::{self as sqlite_reservation, ReservationHandler};
use tidemark_core::flow::AdvanceRequest;
use tidemark_core::model::{ModelConsumer, ModelEndpoints, ModelProducer, ModelReservationHandler};
use tidemark_core::policy::{RelayPolicy, RetentionPolicy};
use tidemark_core::reservation::ReservationMachine;
use tidemark_core::store::{
    ConsumerStore, DeliveryAction, DeliveryEntry, DeliveryStatus, DrainReport, DrainScope, Endpoints, HandleError,
    Handler, InboxStatus, ProducerIdentity, ProducerSnapshot, ProducerStore, ReceiveOutcome, Subscription,
};
use tidemark_core::{Envelope, Error, Result};
use tidemark_engine::{relay_once, RelayOptions, RelayReport};
use tidemark_store_postgres::{advance_in, PgConsumer, PgEndpoints, PgProducer};
use tidemark_store_sqlite::{Durability, SqliteConsumer, SqliteEndpoints, SqliteProducer};

const MAX_OPS: usize = 40;
const DEFAULT_CASES: u32 = 64;
/// Random cases of the PostgreSQL model check when `PROPTEST_CASES` is not set.
const DEFAULT_POSTGRES_CASES: u32 = 16;
const SOURCE: &str = "shop";
const FLOWS: [&str; 3] = ["r1", "r2", "r3"];
/// Consumers: `a` and `b` share the first consumer database, `c` and `d` the second one. `d` is
/// not subscribed at the start (see `Op::Subscribe`).
const SLOTS: [&str; 4] = ["a", "b", "c", "d"];
const DATABASE_OF: [usize; 4] = [0, 0, 1, 1];
/// The slots subscribed (from the start) when a case begins.
const SUBSCRIBED_AT_START: usize = 3;
const DATABASES: usize = 2;
const TARGET_STATES: [&str; 5] = ["new", "reserved", "confirmed", "released", "bogus"];
const START_MS: i64 = 1_700_000_000_000;
const HORIZON_MS: i64 = 10_000;
const MODEL_GENERATION: &str = "0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d";
/// What an unreachable endpoint answers instead of a protocol answer.
const UNREACHABLE: &str = "simulated: the consumer endpoint did not answer";
const ROWS_MAX: usize = 100_000;
const POLICY: RelayPolicy = RelayPolicy { max_attempts: 2, backoff_base_ms: 1_000, backoff_max_ms: 4_000 };
const REASON: &str = "model check operator";

// ------------------------------------------------------------------------------------------
// Operations
// ------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
enum Expect {
    Current,
    Behind,
    Ahead,
    Negative,
}

#[derive(Debug, Clone)]
enum To {
    /// The next state of the flow (or `released` again when it is final).
    Next,
    /// `TARGET_STATES[i]` (including `new` and the unknown `bogus`).
    State(usize),
}

#[derive(Debug, Clone)]
enum Qty {
    /// A valid quantity when reserving, none afterwards.
    Auto,
    None,
    Value(i64),
}

#[derive(Debug, Clone)]
struct AdvanceSpec {
    flow: usize,
    expect: Expect,
    to: To,
    quantity: Qty,
    v2: bool,
}

#[derive(Debug, Clone, Copy)]
enum Tamper {
    Payload,
    EventId,
    /// Same event id, next position: the id is then held elsewhere.
    Seq,
    Generation,
    FreshTimestamp,
}

#[derive(Debug, Clone)]
enum Crash {
    /// Drop the stores and reopen them.
    Reopen,
    /// Drop an open producer transaction that advanced a flow, then reopen.
    ProducerTxDropped { flow: usize },
    /// Drop an open consumer transaction that scribbled over the inbox, then reopen.
    ConsumerTxDropped { db: usize },
    /// A handler fails (infrastructure error) after `after` events of a drain, then reopen.
    DrainFails { slot: usize, after: usize, v2: bool, batch: usize },
}

#[derive(Debug, Clone)]
enum Op {
    /// 1..=3 advance requests in one producer transaction.
    Advance(Vec<AdvanceSpec>),
    Relay {
        limit: usize,
    },
    /// A relay lane's pass: only the deliveries to the subscribers of these slots (their current
    /// producer-side ids), as `tidemark serve` runs one per network endpoint.
    RelayTo {
        slots: Vec<usize>,
        limit: usize,
    },
    /// `relay --event`: one chosen event (pending or quarantined), due or not. `patient` is an
    /// operator retrying a quarantined event (if any) with a larger `max_attempts`.
    RelayEvent {
        pick: usize,
        patient: bool,
    },
    /// Receive again, directly, an event whose delivery was already accepted.
    Redeliver {
        slot: usize,
        pick: usize,
    },
    /// Receive directly, in one batch, up to `count` still pending events, latest first.
    Reorder {
        slot: usize,
        pick: usize,
        count: usize,
    },
    /// Receive directly a modified copy of an event; with `applied`, of one at or below the
    /// consumer's high-water mark (held as an applied record, a receipt, or pruned past the
    /// horizon).
    Tampered {
        slot: usize,
        pick: usize,
        how: Tamper,
        applied: bool,
    },
    /// `apply`: the next event of one flow.
    Apply {
        slot: usize,
        flow: usize,
        v2: bool,
    },
    Drain {
        slot: usize,
        limit: usize,
        v2: bool,
        batch: usize,
    },
    Skip {
        slot: usize,
        pick: usize,
    },
    Prune {
        db: usize,
        applied_retention_ms: i64,
        batch_rows: usize,
    },
    PruneOutbox {
        retention_ms: i64,
        batch_rows: usize,
    },
    Resolve {
        pick: usize,
        requeue: bool,
    },
    /// `outbox redeliver`: the slot's subscriber gets every event again from one the outbox
    /// holds (or, with `all`, from the oldest).
    RedeliverFrom {
        slot: usize,
        pick: usize,
        all: bool,
    },
    RenameConsumer {
        slot: usize,
    },
    RenameSubscription {
        slot: usize,
    },
    Tick {
        ms: i64,
    },
    /// Set the clock so that the next operation runs exactly at the horizon of one event
    /// (`created_at_ms + horizon`: not yet expired; one millisecond later it is).
    TickToHorizon {
        pick: usize,
    },
    Crash(Crash),
    /// A relay pass in which consumer database `db` does not answer: its endpoint fails with a
    /// transport error before any receive (not a protocol answer).
    RelayUnreachable {
        db: usize,
        limit: usize,
    },
    /// Subscribe a consumer while events already exist: the slot's current subscription id (a
    /// re-subscription, or `d`'s first one) or, with `retired`, the slot's original id (a new
    /// subscription for an id its consumer database has retired, once the slot was renamed).
    /// Always at the slot's own database.
    Subscribe {
        slot: usize,
        from_start: bool,
        retired: bool,
    },
    /// `outbox rotate-generation`.
    RotateGeneration,
    /// Copy the producer database aside (a backup). A backup is also taken when a case starts.
    BackupProducer,
    /// Put the last backup back in place of the producer (flows, outbox, deliveries and
    /// subscriptions go back to it) and rotate the generation, as an operator must.
    RestoreProducer,
}

fn advance_spec() -> impl Strategy<Value = AdvanceSpec> {
    (
        0..FLOWS.len(),
        prop_oneof![
            24 => Just(Expect::Current),
            1 => Just(Expect::Behind),
            1 => Just(Expect::Ahead),
            1 => Just(Expect::Negative),
        ],
        prop_oneof![8 => Just(To::Next), 2 => (0..TARGET_STATES.len()).prop_map(To::State)],
        prop_oneof![24 => Just(Qty::Auto), 1 => Just(Qty::None), 2 => (0..=5_i64).prop_map(Qty::Value)],
        prop::bool::weighted(0.25),
    )
        .prop_map(|(flow, expect, to, quantity, v2)| AdvanceSpec { flow, expect, to, quantity, v2 })
}

fn op() -> impl Strategy<Value = Op> {
    let slot = 0..SLOTS.len();
    let pick = 0..64_usize;
    let tamper = prop_oneof![
        Just(Tamper::Payload),
        Just(Tamper::EventId),
        Just(Tamper::Seq),
        Just(Tamper::Generation),
        Just(Tamper::FreshTimestamp)
    ];
    let crash =
        prop_oneof![
            Just(Crash::Reopen),
            (0..FLOWS.len()).prop_map(|flow| Crash::ProducerTxDropped { flow }),
            (0..DATABASES).prop_map(|db| Crash::ConsumerTxDropped { db }),
            (slot.clone(), 0..4_usize, any::<bool>(), 1..=4_usize)
                .prop_map(|(slot, after, v2, batch)| Crash::DrainFails { slot, after, v2, batch }),
        ];
    prop_oneof![
        10 => prop::collection::vec(advance_spec(), 1..=3).prop_map(Op::Advance),
        10 => (1..=5_usize).prop_map(|limit| Op::Relay { limit }),
        3 => (prop::collection::vec(slot.clone(), 0..=2), 1..=5_usize)
            .prop_map(|(slots, limit)| Op::RelayTo { slots, limit }),
        2 => (pick.clone(), any::<bool>()).prop_map(|(pick, patient)| Op::RelayEvent { pick, patient }),
        3 => (slot.clone(), pick.clone()).prop_map(|(slot, pick)| Op::Redeliver { slot, pick }),
        2 => (slot.clone(), pick.clone(), 1..=3_usize).prop_map(|(slot, pick, count)| Op::Reorder { slot, pick, count }),
        4 => (slot.clone(), pick.clone(), tamper, any::<bool>())
            .prop_map(|(slot, pick, how, applied)| Op::Tampered { slot, pick, how, applied }),
        3 => (slot.clone(), 0..FLOWS.len(), prop::bool::weighted(0.3))
            .prop_map(|(slot, flow, v2)| Op::Apply { slot, flow, v2 }),
        6 => (slot.clone(), 1..=10_usize, prop::bool::weighted(0.5), 1..=4_usize)
            .prop_map(|(slot, limit, v2, batch)| Op::Drain { slot, limit, v2, batch }),
        3 => (slot.clone(), pick.clone()).prop_map(|(slot, pick)| Op::Skip { slot, pick }),
        4 => (
            0..DATABASES,
            prop_oneof![Just(0_i64), Just(1), Just(1_000), Just(10_000)],
            prop_oneof![1..=3_usize, Just(1_000)]
        )
            .prop_map(|(db, applied_retention_ms, batch_rows)| Op::Prune { db, applied_retention_ms, batch_rows }),
        2 => (prop_oneof![Just(0_i64), Just(1_000), Just(10_000)], prop_oneof![1..=3_usize, Just(1_000)])
            .prop_map(|(retention_ms, batch_rows)| Op::PruneOutbox { retention_ms, batch_rows }),
        2 => (pick.clone(), any::<bool>()).prop_map(|(pick, requeue)| Op::Resolve { pick, requeue }),
        2 => (slot.clone(), pick.clone(), any::<bool>()).prop_map(|(slot, pick, all)| Op::RedeliverFrom { slot, pick, all }),
        2 => slot.clone().prop_map(|slot| Op::RenameConsumer { slot }),
        2 => slot.clone().prop_map(|slot| Op::RenameSubscription { slot }),
        4 => prop_oneof![Just(1_000_i64), Just(4_000), Just(12_000)].prop_map(|ms| Op::Tick { ms }),
        1 => pick.prop_map(|pick| Op::TickToHorizon { pick }),
        3 => crash.prop_map(Op::Crash),
        3 => (0..DATABASES, 1..=5_usize).prop_map(|(db, limit)| Op::RelayUnreachable { db, limit }),
        // Half of them for `d`, the slot not subscribed at the start.
        3 => (prop_oneof![Just(SLOTS.len() - 1), slot], any::<bool>(), prop::bool::weighted(0.3))
            .prop_map(|(slot, from_start, retired)| Op::Subscribe { slot, from_start, retired }),
        1 => Just(Op::RotateGeneration),
        1 => Just(Op::BackupProducer),
        1 => Just(Op::RestoreProducer),
    ]
}

// ------------------------------------------------------------------------------------------
// Backends
// ------------------------------------------------------------------------------------------

/// A handler wrapper that fails with an infrastructure error after `left` events, and takes
/// `batch_max` events at once.
struct FailAfter<'a, T: ?Sized> {
    inner: &'a mut dyn Handler<T>,
    left: Option<usize>,
    batch_max: usize,
}

impl<T: ?Sized> Handler<T> for FailAfter<'_, T> {
    fn handle(&mut self, target: &T, consumer_id: &str, event: &Envelope) -> std::result::Result<(), HandleError> {
        if let Some(left) = &mut self.left {
            if *left == 0 {
                return Err(HandleError::Failed(Error::store("simulated crash inside the drain")));
            }
            *left -= 1;
        }
        self.inner.handle(target, consumer_id, event)
    }

    fn batch_max(&self) -> usize {
        self.batch_max
    }

    /// Counted as the model counts its one-at-a-time calls: a batch that could reach the failure
    /// is refused, so that the drain applies it again one event at a time through `handle`.
    fn handle_batch(
        &mut self,
        target: &T,
        consumer_id: &str,
        events: &[Envelope],
    ) -> std::result::Result<(), HandleError> {
        if self.left.is_some_and(|left| left < events.len()) {
            return Err(HandleError::Blocked("the failure is within this batch".into()));
        }
        self.inner.handle_batch(target, consumer_id, events)?;
        if let Some(left) = &mut self.left {
            *left -= events.len();
        }
        Ok(())
    }
}

/// Endpoints of which one (`down`) does not answer: `store` fails with a transport error, as an
/// unreachable consumer would, so nothing reaches that consumer in this pass.
struct Unreachable<'a, E> {
    inner: &'a mut E,
    down: Option<&'a str>,
}

impl<E: Endpoints> Endpoints for Unreachable<'_, E> {
    fn deliver(&mut self, endpoint: &str, items: &[(&str, &Envelope)], now_ms: i64) -> Result<Vec<ReceiveOutcome>> {
        if self.down == Some(endpoint) {
            return Err(Error::io(UNREACHABLE));
        }
        self.inner.deliver(endpoint, items, now_ms)
    }
}

/// The reservation handler a drain runs: with or without the v2 decoders, optionally failing
/// (an infrastructure error) after `fail_after` events, taking `batch_max` events at once.
#[derive(Debug, Clone, Copy)]
struct HandlerSpec {
    support_v2: bool,
    fail_after: Option<usize>,
    batch_max: usize,
}

/// What the test needs from one implementation of the stores.
trait Backend {
    type P: ProducerStore;
    type C: ConsumerStore;
    fn producer(&mut self) -> &mut Self::P;
    fn consumer(&mut self, db: usize) -> &mut Self::C;
    /// One relay pass; the endpoint `down`, if any, does not answer.
    fn relay(&mut self, options: &RelayOptions, down: Option<&str>, now_ms: i64) -> Result<RelayReport>;
    /// `outbox rotate-generation`. SQLite picks a random generation; the model takes `model`.
    fn rotate_generation(&mut self, model: &str) -> Result<ProducerIdentity>;
    /// Copy the producer database aside, replacing the previous backup.
    fn backup_producer(&mut self);
    /// Put the backup back in place of the producer database.
    fn restore_producer(&mut self);
    fn drain(
        &mut self,
        db: usize,
        consumer_id: &str,
        scope: &DrainScope,
        limit: usize,
        handler: HandlerSpec,
        now_ms: i64,
    ) -> Result<DrainReport>;
    fn rename_subscription(&mut self, from: &str, to: &str) -> Result<u64>;
    /// Die with `crash` in progress, then come back from durable state.
    fn crash(&mut self, crash: &Crash, now_ms: i64);
    /// `{"projections": [...], "effects": [...]}` in the SQLite tables' order and field names.
    fn projection(&mut self, db: usize) -> Value;
    fn retired(&mut self, db: usize) -> Vec<(String, String)>;
    /// Checks that only this backend can make.
    fn own_invariants(&mut self) -> std::result::Result<(), String> {
        Ok(())
    }
}

struct SqliteBackend {
    producer_path: PathBuf,
    backup_path: PathBuf,
    consumer_paths: Vec<PathBuf>,
    producer: Option<SqliteProducer>,
    /// Empty while "crashed".
    consumers: Vec<SqliteConsumer>,
    endpoints: Option<SqliteEndpoints>,
}

impl SqliteBackend {
    fn create(dir: &Path) -> SqliteBackend {
        let producer_path = dir.join("producer.db");
        let consumer_paths: Vec<PathBuf> = (0..DATABASES).map(|db| dir.join(format!("consumer-{db}.db"))).collect();
        drop(SqliteProducer::init(&producer_path, SOURCE).expect("init producer"));
        for path in &consumer_paths {
            let consumer = SqliteConsumer::init(path, RetentionPolicy { horizon_ms: HORIZON_MS }).expect("init");
            sqlite_reservation::install(&consumer).expect("install reservation tables");
        }
        let backup_path = dir.join("producer-backup.db");
        let mut backend = SqliteBackend {
            producer_path,
            backup_path,
            consumer_paths,
            producer: None,
            consumers: Vec::new(),
            endpoints: None,
        };
        backend.open();
        backend
    }

    /// Open everything from the files. `Normal` durability: a process crash loses nothing.
    fn open(&mut self) {
        self.producer =
            Some(SqliteProducer::open_with(&self.producer_path, Durability::Normal).expect("open producer"));
        for path in &self.consumer_paths {
            let consumer = SqliteConsumer::open_with(path, Durability::Normal).expect("open consumer");
            sqlite_reservation::install(&consumer).expect("install reservation tables");
            self.consumers.push(consumer);
        }
        self.endpoints = Some(SqliteEndpoints::new(Durability::Normal));
    }

    fn endpoints(&self) -> Vec<String> {
        self.consumer_paths.iter().map(|p| p.to_string_lossy().into_owned()).collect()
    }
}

impl Backend for SqliteBackend {
    type P = SqliteProducer;
    type C = SqliteConsumer;

    fn producer(&mut self) -> &mut SqliteProducer {
        self.producer.as_mut().expect("producer is open")
    }

    fn consumer(&mut self, db: usize) -> &mut SqliteConsumer {
        &mut self.consumers[db]
    }

    fn relay(&mut self, options: &RelayOptions, down: Option<&str>, now_ms: i64) -> Result<RelayReport> {
        let producer = self.producer.as_mut().expect("producer is open");
        let inner = self.endpoints.as_mut().expect("endpoints are open");
        relay_once(producer, &mut Unreachable { inner, down }, options, now_ms, &mut || 0.5)
    }

    fn rotate_generation(&mut self, _model: &str) -> Result<ProducerIdentity> {
        self.producer().rotate_generation()
    }

    /// Close the producer and copy its file and WAL (closing the last connection checkpoints
    /// the WAL, so the copy is consistent), then reopen it.
    fn backup_producer(&mut self) {
        self.producer = None;
        copy_database(&self.producer_path, &self.backup_path);
        self.producer =
            Some(SqliteProducer::open_with(&self.producer_path, Durability::Normal).expect("open producer"));
    }

    fn restore_producer(&mut self) {
        self.producer = None;
        copy_database(&self.backup_path, &self.producer_path);
        self.producer =
            Some(SqliteProducer::open_with(&self.producer_path, Durability::Normal).expect("open producer"));
    }

    fn drain(
        &mut self,
        db: usize,
        consumer_id: &str,
        scope: &DrainScope,
        limit: usize,
        handler: HandlerSpec,
        now_ms: i64,
    ) -> Result<DrainReport> {
        let mut inner = ReservationHandler::new(handler.support_v2);
        let mut handler = FailAfter { inner: &mut inner, left: handler.fail_after, batch_max: handler.batch_max };
        self.consumer(db).drain(consumer_id, scope, limit, &mut handler, now_ms)
    }

    fn rename_subscription(&mut self, from: &str, to: &str) -> Result<u64> {
        self.producer().rename_subscription(from, to)
    }

    fn crash(&mut self, crash: &Crash, now_ms: i64) {
        match crash {
            Crash::Reopen | Crash::DrainFails { .. } => {}
            Crash::ProducerTxDropped { flow } => {
                let flow_id = FLOWS[*flow];
                let producer = self.producer();
                let current = producer.flow(flow_id).expect("read flow");
                let (seq, state) = current.map_or((0, "new".to_string()), |f| (f.last_seq, f.state.state));
                let request = AdvanceRequest {
                    flow_id: flow_id.into(),
                    expected_seq: seq,
                    to_state: next_state(&state).into(),
                    input: json!({"quantity": 2}),
                    schema_version: 1,
                    traceparent: None,
                };
                let tx = producer.begin().expect("begin producer transaction");
                let _ = tx.advance(&ReservationMachine, &request, now_ms);
                drop(tx);
            }
            Crash::ConsumerTxDropped { db } => {
                let conn = self.consumer(*db).connection();
                let tx = conn.unchecked_transaction().expect("begin consumer transaction");
                tx.execute_batch(
                    "UPDATE inbox SET status = 'applied';
                     DELETE FROM cursors;
                     DELETE FROM receipts;
                     INSERT INTO reservation_effects (consumer_id, source, flow_id, seq, event_id, kind, quantity)
                         VALUES ('a', 'shop', 'r1', 1, 'ghost', 'reserved', 1);",
                )
                .expect("scribble inside the transaction");
                drop(tx);
            }
        }
        self.producer = None;
        self.consumers.clear();
        self.endpoints = None;
        self.open();
    }

    fn projection(&mut self, db: usize) -> Value {
        let (projections, effects) = sqlite_reservation::read(self.consumer(db).connection(), ROWS_MAX).expect("read");
        json!({"projections": projections, "effects": effects})
    }

    fn retired(&mut self, db: usize) -> Vec<(String, String)> {
        let conn = self.consumer(db).connection();
        let mut stmt =
            conn.prepare("SELECT consumer_id, renamed_to FROM retired_consumers ORDER BY consumer_id").expect("sql");
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).expect("query");
        rows.collect::<rusqlite::Result<Vec<_>>>().expect("rows")
    }

    fn own_invariants(&mut self) -> std::result::Result<(), String> {
        for consumer in &self.consumers {
            let duplicates = sqlite_reservation::duplicate_effects(consumer.connection()).map_err(|e| e.to_string())?;
            if !duplicates.is_empty() {
                return Err(format!("duplicate effects: {duplicates:?}"));
            }
        }
        Ok(())
    }
}

/// Replace the database file `to` (and its WAL, shared memory) by a copy of `from`.
fn copy_database(from: &Path, to: &Path) {
    let with = |path: &Path, suffix: &str| PathBuf::from(format!("{}{suffix}", path.display()));
    for suffix in ["-wal", "-shm"] {
        let path = with(to, suffix);
        if path.exists() {
            std::fs::remove_file(&path).expect("remove the old WAL");
        }
    }
    std::fs::copy(from, to).expect("copy the database file");
    if with(from, "-wal").exists() {
        std::fs::copy(with(from, "-wal"), with(to, "-wal")).expect("copy the WAL");
    }
}

struct ModelBackend {
    producer: ModelProducer,
    backup: Option<ModelProducer>,
    endpoints: ModelEndpoints,
    /// Endpoint of each consumer database.
    databases: Vec<String>,
}

impl ModelBackend {
    fn create(databases: &[String]) -> ModelBackend {
        let mut endpoints = ModelEndpoints::new();
        for endpoint in databases {
            let consumer = ModelConsumer::new(RetentionPolicy { horizon_ms: HORIZON_MS }).expect("consumer");
            endpoints.insert(endpoint, consumer);
        }
        ModelBackend {
            producer: ModelProducer::new(SOURCE, MODEL_GENERATION).expect("producer"),
            backup: None,
            endpoints,
            databases: databases.to_vec(),
        }
    }
}

impl Backend for ModelBackend {
    type P = ModelProducer;
    type C = ModelConsumer;

    fn producer(&mut self) -> &mut ModelProducer {
        &mut self.producer
    }

    fn consumer(&mut self, db: usize) -> &mut ModelConsumer {
        self.endpoints.get_mut(&self.databases[db]).expect("the model consumer exists")
    }

    fn relay(&mut self, options: &RelayOptions, down: Option<&str>, now_ms: i64) -> Result<RelayReport> {
        let endpoints = &mut Unreachable { inner: &mut self.endpoints, down };
        relay_once(&mut self.producer, endpoints, options, now_ms, &mut || 0.5)
    }

    fn rotate_generation(&mut self, model: &str) -> Result<ProducerIdentity> {
        self.producer.rotate_generation(model)
    }

    fn backup_producer(&mut self) {
        self.backup = Some(self.producer.clone());
    }

    fn restore_producer(&mut self) {
        self.producer = self.backup.clone().expect("a backup is taken when a case starts");
    }

    fn drain(
        &mut self,
        db: usize,
        consumer_id: &str,
        scope: &DrainScope,
        limit: usize,
        handler: HandlerSpec,
        now_ms: i64,
    ) -> Result<DrainReport> {
        // The model is the reference: it applies one event at a time, whatever the batch.
        let mut inner = ModelReservationHandler::new(handler.support_v2);
        let mut handler = FailAfter { inner: &mut inner, left: handler.fail_after, batch_max: 1 };
        self.consumer(db).drain(consumer_id, scope, limit, &mut handler, now_ms)
    }

    fn rename_subscription(&mut self, from: &str, to: &str) -> Result<u64> {
        self.producer.rename_subscription(from, to)
    }

    fn crash(&mut self, _crash: &Crash, _now_ms: i64) {
        // The model holds committed state only: a crash changes nothing.
    }

    fn projection(&mut self, db: usize) -> Value {
        let projection = self.consumer(db).projection().clone();
        let rows: Vec<Value> = projection
            .reservations
            .iter()
            .map(|((consumer_id, source, flow_id), row)| {
                json!({"consumer_id": consumer_id, "source": source, "flow_id": flow_id, "state": row.state,
                       "quantity": row.quantity, "last_seq": row.last_seq})
            })
            .collect();
        json!({"projections": rows, "effects": projection.effects})
    }

    fn retired(&mut self, db: usize) -> Vec<(String, String)> {
        self.consumer(db).retired()
    }
}

// ------------------------------------------------------------------------------------------
// The PostgreSQL backend: the same operations on `tidemark-store-postgres`, one schema per
// database (producer, backup, consumers), dropped when the backend goes.
// ------------------------------------------------------------------------------------------

/// The test server (`TIDEMARK_TEST_POSTGRES`, default the local one); `None` when it does not
/// answer (the PostgreSQL model checks then print why and pass).
pub(crate) fn postgres_server() -> Option<String> {
    let conn = std::env::var("TIDEMARK_TEST_POSTGRES")
        .unwrap_or_else(|_| "host=127.0.0.1 port=5432 user=postgres dbname=test".to_string());
    match postgres::Client::connect(&conn, postgres::NoTls) {
        Ok(_) => Some(conn),
        Err(error) => {
            println!("skipped: PostgreSQL not reachable at {conn}: {error}");
            None
        }
    }
}

/// The producer tables a backup copies (a pg_dump of the producer's schema, in effect).
const PG_PRODUCER_TABLES: [&str; 6] = ["meta", "positions", "flows", "outbox", "subscriptions", "deliveries"];

struct PostgresBackend {
    conn: String,
    producer_schema: String,
    backup_schema: String,
    consumer_schemas: Vec<String>,
    producer: Option<PgProducer>,
    /// Empty while "crashed".
    consumers: Vec<PgConsumer>,
    endpoints: Option<PgEndpoints>,
    /// One connection of the test's own (backups, restores, reads of the user's tables).
    admin: postgres::Client,
}

static PG_CASES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl PostgresBackend {
    fn create(conn: &str) -> PostgresBackend {
        let case = PG_CASES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let prefix = format!("mc{}_{case}", std::process::id());
        let producer_schema = format!("{prefix}_p");
        let consumer_schemas: Vec<String> = (0..DATABASES).map(|db| format!("{prefix}_c{db}")).collect();
        let mut admin = postgres::Client::connect(conn, postgres::NoTls).expect("connect");
        drop(PgProducer::init(conn, &producer_schema, SOURCE).expect("init producer"));
        for schema in &consumer_schemas {
            let mut consumer =
                PgConsumer::init(conn, schema, RetentionPolicy { horizon_ms: HORIZON_MS }).expect("init");
            consumer
                .client()
                .batch_execute(&format!(
                    "CREATE TABLE IF NOT EXISTS \"{schema}\".reservation_projection (
                         consumer_id text COLLATE \"C\" NOT NULL,
                         source      text COLLATE \"C\" NOT NULL,
                         flow_id     text COLLATE \"C\" NOT NULL,
                         state       text NOT NULL,
                         quantity    bigint NOT NULL,
                         last_seq    bigint NOT NULL,
                         PRIMARY KEY (consumer_id, source, flow_id));
                     CREATE TABLE IF NOT EXISTS \"{schema}\".reservation_effects (
                         effect_id   bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                         consumer_id text COLLATE \"C\" NOT NULL,
                         source      text COLLATE \"C\" NOT NULL,
                         flow_id     text COLLATE \"C\" NOT NULL,
                         seq         bigint NOT NULL,
                         event_id    text NOT NULL,
                         kind        text NOT NULL,
                         quantity    bigint NOT NULL);"
                ))
                .expect("create the reservation tables");
            consumer.register_projection_table("reservation_projection").expect("register");
            consumer.register_projection_table("reservation_effects").expect("register");
        }
        admin.batch_execute(&format!("CREATE SCHEMA \"{prefix}_backup\"")).expect("backup schema");
        let mut backend = PostgresBackend {
            conn: conn.to_string(),
            producer_schema,
            backup_schema: format!("{prefix}_backup"),
            consumer_schemas,
            producer: None,
            consumers: Vec::new(),
            endpoints: None,
            admin,
        };
        backend.open();
        backend
    }

    fn open(&mut self) {
        self.producer = Some(PgProducer::open(&self.conn, &self.producer_schema).expect("open producer"));
        for schema in &self.consumer_schemas {
            self.consumers.push(PgConsumer::open(&self.conn, schema).expect("open consumer"));
        }
        self.endpoints = Some(PgEndpoints::new(&self.conn));
    }

    fn endpoints(&self) -> Vec<String> {
        self.consumer_schemas.clone()
    }
}

impl Drop for PostgresBackend {
    fn drop(&mut self) {
        self.producer = None;
        self.consumers.clear();
        self.endpoints = None;
        let mut schemas = self.consumer_schemas.clone();
        schemas.extend([self.producer_schema.clone(), self.backup_schema.clone()]);
        for schema in schemas {
            let _ = self.admin.batch_execute(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"));
        }
    }
}

impl Backend for PostgresBackend {
    type P = PgProducer;
    type C = PgConsumer;

    fn producer(&mut self) -> &mut PgProducer {
        self.producer.as_mut().expect("producer is open")
    }

    fn consumer(&mut self, db: usize) -> &mut PgConsumer {
        &mut self.consumers[db]
    }

    fn relay(&mut self, options: &RelayOptions, down: Option<&str>, now_ms: i64) -> Result<RelayReport> {
        let producer = self.producer.as_mut().expect("producer is open");
        let inner = self.endpoints.as_mut().expect("endpoints are open");
        relay_once(producer, &mut Unreachable { inner, down }, options, now_ms, &mut || 0.5)
    }

    fn rotate_generation(&mut self, _model: &str) -> Result<ProducerIdentity> {
        self.producer().rotate_generation()
    }

    /// Copy the producer tables into `<table>_copy` tables of the backup schema, in one
    /// transaction (a dump of the producer's schema, in effect).
    fn backup_producer(&mut self) {
        self.producer = None;
        let (producer, backup) = (&self.producer_schema, &self.backup_schema);
        let mut statements = String::from("BEGIN;");
        for table in PG_PRODUCER_TABLES {
            statements.push_str(&format!(
                "DROP TABLE IF EXISTS \"{backup}\".{table}_copy;
                 CREATE TABLE \"{backup}\".{table}_copy AS TABLE \"{producer}\".{table};"
            ));
        }
        statements.push_str("COMMIT;");
        self.admin.batch_execute(&statements).expect("back up the producer tables");
        self.producer = Some(PgProducer::open(&self.conn, &self.producer_schema).expect("open producer"));
    }

    fn restore_producer(&mut self) {
        self.producer = None;
        let (backup, producer) = (self.backup_schema.clone(), self.producer_schema.clone());
        let mut statements =
            format!("BEGIN; TRUNCATE {};", PG_PRODUCER_TABLES.map(|t| format!("\"{producer}\".{t}")).join(", "));
        for table in PG_PRODUCER_TABLES {
            statements
                .push_str(&format!("INSERT INTO \"{producer}\".{table} SELECT * FROM \"{backup}\".{table}_copy;"));
        }
        statements.push_str("COMMIT;");
        self.admin.batch_execute(&statements).expect("restore the producer tables");
        self.producer = Some(PgProducer::open(&self.conn, &self.producer_schema).expect("open producer"));
    }

    fn drain(
        &mut self,
        db: usize,
        consumer_id: &str,
        scope: &DrainScope,
        limit: usize,
        handler: HandlerSpec,
        now_ms: i64,
    ) -> Result<DrainReport> {
        let mut inner = tidemark_builtins::reservation::postgres::ReservationHandler::new(handler.support_v2);
        let mut handler = FailAfter { inner: &mut inner, left: handler.fail_after, batch_max: handler.batch_max };
        self.consumer(db).drain(consumer_id, scope, limit, &mut handler, now_ms)
    }

    fn rename_subscription(&mut self, from: &str, to: &str) -> Result<u64> {
        self.producer().rename_subscription(from, to)
    }

    fn crash(&mut self, crash: &Crash, now_ms: i64) {
        match crash {
            Crash::Reopen | Crash::DrainFails { .. } => {}
            Crash::ProducerTxDropped { flow } => {
                let flow_id = FLOWS[*flow];
                let schema = self.producer_schema.clone();
                let producer = self.producer();
                let current = producer.flow(flow_id).expect("read flow");
                let (seq, state) = current.map_or((0, "new".to_string()), |f| (f.last_seq, f.state.state));
                let request = AdvanceRequest {
                    flow_id: flow_id.into(),
                    expected_seq: seq,
                    to_state: next_state(&state).into(),
                    input: json!({"quantity": 2}),
                    schema_version: 1,
                    traceparent: None,
                };
                let mut tx = producer.client().transaction().expect("begin producer transaction");
                let _ = advance_in(&mut tx, &schema, &ReservationMachine, &request, now_ms);
                drop(tx);
            }
            Crash::ConsumerTxDropped { db } => {
                let s = self.consumer_schemas[*db].clone();
                let mut tx = self.consumers[*db].client().transaction().expect("begin consumer transaction");
                tx.batch_execute(&format!(
                    "UPDATE \"{s}\".inbox SET status = 'applied';
                     DELETE FROM \"{s}\".cursors;
                     DELETE FROM \"{s}\".receipts;
                     INSERT INTO \"{s}\".reservation_effects (consumer_id, source, flow_id, seq, event_id, kind, quantity)
                         VALUES ('a', 'shop', 'r1', 1, 'ghost', 'reserved', 1);"
                ))
                .expect("scribble inside the transaction");
                drop(tx);
            }
        }
        self.producer = None;
        self.consumers.clear();
        self.endpoints = None;
        self.open();
    }

    fn projection(&mut self, db: usize) -> Value {
        let s = &self.consumer_schemas[db];
        let projections: Vec<Value> = self
            .admin
            .query(
                &format!(
                    "SELECT consumer_id, source, flow_id, state, quantity, last_seq FROM \"{s}\".reservation_projection
                     ORDER BY consumer_id, source, flow_id LIMIT $1"
                ),
                &[&(ROWS_MAX as i64)],
            )
            .expect("read the projection")
            .iter()
            .map(|r| {
                json!({"consumer_id": r.get::<_, String>(0), "source": r.get::<_, String>(1), "flow_id": r.get::<_, String>(2),
                       "state": r.get::<_, String>(3), "quantity": r.get::<_, i64>(4), "last_seq": r.get::<_, i64>(5)})
            })
            .collect();
        let effects: Vec<Value> = self
            .admin
            .query(
                &format!(
                    "SELECT consumer_id, source, flow_id, seq, event_id, kind, quantity FROM \"{s}\".reservation_effects
                     ORDER BY effect_id LIMIT $1"
                ),
                &[&(ROWS_MAX as i64)],
            )
            .expect("read the effects")
            .iter()
            .map(|r| {
                json!({"consumer_id": r.get::<_, String>(0), "source": r.get::<_, String>(1), "flow_id": r.get::<_, String>(2),
                       "seq": r.get::<_, i64>(3), "event_id": r.get::<_, String>(4), "kind": r.get::<_, String>(5),
                       "quantity": r.get::<_, i64>(6)})
            })
            .collect();
        json!({"projections": projections, "effects": effects})
    }

    fn retired(&mut self, db: usize) -> Vec<(String, String)> {
        let s = &self.consumer_schemas[db];
        self.admin
            .query(&format!("SELECT consumer_id, renamed_to FROM \"{s}\".retired_consumers ORDER BY consumer_id"), &[])
            .expect("read the retired ids")
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect()
    }

    fn own_invariants(&mut self) -> std::result::Result<(), String> {
        for s in &self.consumer_schemas {
            let duplicates = self
                .admin
                .query(
                    &format!(
                        "SELECT consumer_id, source, flow_id, seq, count(*) FROM \"{s}\".reservation_effects
                         GROUP BY consumer_id, source, flow_id, seq HAVING count(*) > 1 LIMIT 10"
                    ),
                    &[],
                )
                .map_err(|e| e.to_string())?;
            if !duplicates.is_empty() {
                let found: Vec<(String, String, i64)> =
                    duplicates.iter().map(|r| (r.get(0), r.get(2), r.get(3))).collect();
                return Err(format!("duplicate effects: {found:?}"));
            }
        }
        Ok(())
    }
}

// ------------------------------------------------------------------------------------------
// Running operations
// ------------------------------------------------------------------------------------------

fn next_state(state: &str) -> &'static str {
    match state {
        "new" => "reserved",
        "reserved" => "confirmed",
        _ => "released",
    }
}

fn out<T: Serialize>(result: Result<T>) -> Value {
    match result {
        Ok(value) => json!({"ok": value}),
        Err(error) => json!({"err": error.code(), "message": error.to_string()}),
    }
}

fn token(event: &Envelope) -> String {
    format!("{}/{}/{}", event.source, event.flow_id, event.seq)
}

/// (consumer database, consumer id, source, flow, seq).
type HeldKey = (usize, String, String, String, i64);

impl Ctx {
    /// `source/flow/seq` of an event, with `@genN` when its generation is not the first one (a
    /// restored producer re-issues the same `source/flow/seq` under a new generation).
    fn label(&self, event: &Envelope) -> String {
        match self.generations.iter().position(|g| *g == event.generation) {
            Some(i) if i > 0 => format!("{}@gen{i}", token(event)),
            _ => token(event),
        }
    }
}

/// What the test remembers next to one backend (both evolve identically while they agree).
struct Ctx {
    now_ms: i64,
    /// The consumer id each slot has in the consumer database...
    consumer_names: [String; 4],
    /// ...and in the producer's subscriptions (they differ between the two rename steps).
    producer_names: [String; 4],
    /// `producer_names` when the producer backup was taken (a restore brings them back).
    backup_names: [String; 4],
    renames: u32,
    /// Generations rotated to so far (never reused, not even after a restore).
    rotations: u32,
    /// Every producer generation seen, in order: normalised to `<gen>`, `<gen1>`, ...
    generations: Vec<String>,
    /// The generation each outbox event had when it was first seen (event id -> generation).
    event_generations: HashMap<String, String>,
    /// What each (database, consumer, source, flow, seq) held when first seen: (event id,
    /// content hash). A consumer never exchanges the event it holds at a position for another.
    held: HashMap<HeldKey, (String, String)>,
    /// A broken invariant that an operation noticed while it ran (reported after the step).
    violation: Option<String>,
    forged: u32,
    /// Hashes of tampered copies and of every outbox event ever seen -> label (outbox events
    /// can be pruned while consumers still hold them).
    hash_labels: HashMap<String, String>,
    /// Event ids of every outbox event ever seen -> label.
    id_labels: BTreeMap<String, String>,
    /// Successfully skipped (consumer, source, flow, seq).
    skipped: BTreeSet<(String, String, String, i64)>,
    /// Endpoint of each consumer database.
    databases: Vec<String>,
}

struct Run<B: Backend> {
    backend: B,
    ctx: Ctx,
}

impl<B: Backend> Run<B> {
    fn new(mut backend: B, databases: &[String]) -> Run<B> {
        for (slot, db) in SLOTS.into_iter().zip(DATABASE_OF).take(SUBSCRIBED_AT_START) {
            let subscription = Subscription { consumer_id: slot.into(), endpoint: databases[db].clone() };
            backend.producer().subscribe(&subscription, true, START_MS).expect("subscribe");
        }
        backend.backup_producer();
        let names = SLOTS.map(String::from);
        let generation = backend.producer().identity().generation.clone();
        Run {
            backend,
            ctx: Ctx {
                now_ms: START_MS,
                consumer_names: names.clone(),
                producer_names: names.clone(),
                backup_names: names,
                renames: 0,
                rotations: 0,
                generations: vec![generation],
                event_generations: HashMap::new(),
                held: HashMap::new(),
                violation: None,
                forged: 0,
                hash_labels: HashMap::new(),
                id_labels: BTreeMap::new(),
                skipped: BTreeSet::new(),
                databases: databases.to_vec(),
            },
        }
    }

    fn outbox(&mut self) -> Vec<Envelope> {
        self.backend.producer().snapshot(ROWS_MAX).expect("producer snapshot").outbox
    }

    fn step(&mut self, op: &Op) -> Value {
        self.ctx.now_ms += 1;
        let now = self.ctx.now_ms;
        match op {
            Op::Advance(specs) => {
                let mut requests = Vec::new();
                for spec in specs {
                    let flow_id = FLOWS[spec.flow];
                    let current = self.backend.producer().flow(flow_id).expect("read flow");
                    let (seq, state) = current.map_or((0, "new".to_string()), |f| (f.last_seq, f.state.state));
                    let expected_seq = match spec.expect {
                        Expect::Current => seq,
                        Expect::Behind => seq - 1,
                        Expect::Ahead => seq + 1,
                        Expect::Negative => -1,
                    };
                    let to_state = match spec.to {
                        To::Next => next_state(&state),
                        To::State(i) => TARGET_STATES[i],
                    };
                    let quantity = match spec.quantity {
                        Qty::Auto => (to_state == "reserved").then_some(spec.flow as i64 + 1),
                        Qty::None => None,
                        Qty::Value(q) => Some(q),
                    };
                    let input = quantity.map_or(json!({}), |q| json!({"quantity": q}));
                    let schema_version = if spec.v2 { 2 } else { 1 };
                    requests.push(AdvanceRequest {
                        flow_id: flow_id.into(),
                        expected_seq,
                        to_state: to_state.into(),
                        input,
                        schema_version,
                        traceparent: None,
                    });
                }
                out(self.backend.producer().advance_batch(&ReservationMachine, &requests, now))
            }
            Op::Relay { limit } => {
                let options = RelayOptions { limit: *limit, policy: POLICY, keep_answers: true, ..Default::default() };
                out(self.backend.relay(&options, None, now))
            }
            Op::RelayTo { slots, limit } => {
                let consumers: Vec<String> = slots.iter().map(|&slot| self.ctx.producer_names[slot].clone()).collect();
                let options = RelayOptions {
                    limit: *limit,
                    policy: POLICY,
                    keep_answers: true,
                    consumers: Some(consumers.clone()),
                    ..Default::default()
                };
                let result = self.backend.relay(&options, None, now);
                if let Ok(report) = &result {
                    if let Some(other) = report.answers.iter().find(|a| !consumers.contains(&a.consumer_id)) {
                        self.ctx.violation =
                            Some(format!("a relay to {consumers:?} delivered to {:?}", other.consumer_id));
                    }
                }
                out(result)
            }
            Op::RelayUnreachable { db, limit } => {
                let down = self.ctx.databases[*db].clone();
                let before = self.backend.producer().snapshot(ROWS_MAX).expect("producer snapshot");
                let consumer_before = self.consumer_state(*db);
                let options = RelayOptions { limit: *limit, policy: POLICY, keep_answers: true, ..Default::default() };
                let result = self.backend.relay(&options, Some(&down), now);
                if let Ok(report) = &result {
                    let after = self.backend.producer().snapshot(ROWS_MAX).expect("producer snapshot");
                    let mut problems = unreachable_problems(&before, &after, report, &down, now);
                    if self.consumer_state(*db) != consumer_before {
                        problems.push(format!("the unreachable database {db} changed"));
                    }
                    if !problems.is_empty() {
                        self.ctx.violation = Some(format!("relay with database {db} unreachable: {problems:#?}"));
                    }
                }
                out(result)
            }
            Op::Subscribe { slot, from_start, retired } => {
                let consumer_id =
                    if *retired { SLOTS[*slot].to_string() } else { self.ctx.producer_names[*slot].clone() };
                let subscription =
                    Subscription { consumer_id, endpoint: self.ctx.databases[DATABASE_OF[*slot]].clone() };
                let before = self.backend.producer().snapshot(ROWS_MAX).expect("producer snapshot");
                let existed = before.subscriptions.iter().any(|s| s.consumer_id == subscription.consumer_id);
                let result = self.backend.producer().subscribe(&subscription, *from_start, now);
                let Ok(queued) = result else { return out(result) };
                let after = self.backend.producer().snapshot(ROWS_MAX).expect("producer snapshot");
                if let Some(problem) = subscribe_problem(&before, &after, &subscription, *from_start, queued) {
                    self.ctx.violation = Some(format!("subscribe {subscription:?}: {problem}"));
                }
                let outcome = match (existed, from_start, before.outbox.is_empty()) {
                    (true, _, _) => "unchanged",
                    (false, _, true) => "new_with_empty_outbox",
                    (false, true, false) => "new_from_start",
                    (false, false, false) => "new_from_now",
                };
                json!({"outcome": outcome, "queued": queued})
            }
            Op::RotateGeneration => {
                let model_generation = self.next_model_generation();
                out(self.backend.rotate_generation(&model_generation).map(|identity| identity.generation))
            }
            Op::BackupProducer => {
                self.backend.backup_producer();
                self.ctx.backup_names = self.ctx.producer_names.clone();
                json!("backed up")
            }
            Op::RestoreProducer => {
                self.backend.restore_producer();
                self.ctx.producer_names = self.ctx.backup_names.clone();
                let model_generation = self.next_model_generation();
                out(self.backend.rotate_generation(&model_generation).map(|identity| identity.generation))
            }
            Op::RelayEvent { pick, patient } => {
                let outbox = self.outbox();
                let deliveries = self.backend.producer().deliveries(None, 1_000).expect("deliveries");
                let quarantined: Vec<&str> = deliveries
                    .iter()
                    .filter(|d| *patient && d.status == DeliveryStatus::Quarantined)
                    .map(|d| d.event_id.as_str())
                    .collect();
                let event_id = match (quarantined.len(), outbox.len()) {
                    (0, 0) => "no-such-event".to_string(),
                    (0, n) => outbox[pick % n].event_id.clone(),
                    (n, _) => quarantined[pick % n].to_string(),
                };
                let policy = if *patient { RelayPolicy { max_attempts: 5, ..POLICY } } else { POLICY };
                let options = RelayOptions {
                    limit: 5,
                    event_id: Some(event_id),
                    policy,
                    keep_answers: true,
                    ..Default::default()
                };
                out(self.backend.relay(&options, None, now))
            }
            Op::Redeliver { slot, pick } => {
                let snapshot = self.backend.producer().snapshot(ROWS_MAX).expect("producer snapshot");
                let accepted: Vec<&str> = snapshot
                    .deliveries
                    .iter()
                    .filter(|d| d.status == DeliveryStatus::Accepted && d.consumer_id == self.ctx.producer_names[*slot])
                    .map(|d| d.event_id.as_str())
                    .collect();
                let event = match (accepted.len(), snapshot.outbox.len()) {
                    (0, 0) => return json!("nothing to redeliver"),
                    (0, n) => snapshot.outbox[pick % n].clone(),
                    (n, _) => {
                        let id = accepted[pick % n];
                        snapshot.outbox.iter().find(|e| e.event_id == id).expect("delivered event").clone()
                    }
                };
                let consumer_id = self.ctx.consumer_names[*slot].clone();
                out(self.backend.consumer(DATABASE_OF[*slot]).receive_batch(&[(consumer_id.as_str(), &event)], now))
            }
            Op::Reorder { slot, pick, count } => {
                let snapshot = self.backend.producer().snapshot(ROWS_MAX).expect("producer snapshot");
                let mut pending: Vec<&str> = snapshot
                    .deliveries
                    .iter()
                    .filter(|d| d.status == DeliveryStatus::Pending && d.consumer_id == self.ctx.producer_names[*slot])
                    .map(|d| d.event_id.as_str())
                    .collect();
                pending.reverse(); // latest position first
                if pending.is_empty() {
                    return json!("nothing pending");
                }
                let start = pick % pending.len();
                let events: Vec<&Envelope> = pending[start..]
                    .iter()
                    .take(*count)
                    .map(|id| snapshot.outbox.iter().find(|e| e.event_id == *id).expect("pending event"))
                    .collect();
                let consumer_id = self.ctx.consumer_names[*slot].clone();
                let items: Vec<(&str, &Envelope)> = events.iter().map(|e| (consumer_id.as_str(), *e)).collect();
                out(self.backend.consumer(DATABASE_OF[*slot]).receive_batch(&items, now))
            }
            Op::Tampered { slot, pick, how, applied } => {
                let mut outbox = self.outbox();
                if *applied {
                    let consumer_id = self.ctx.consumer_names[*slot].clone();
                    let cursors =
                        self.backend.consumer(DATABASE_OF[*slot]).cursors(Some(&consumer_id)).expect("cursors");
                    outbox.retain(|e| {
                        cursors
                            .iter()
                            .any(|c| c.source == e.source && c.flow_id == e.flow_id && e.seq <= c.high_water_seq)
                    });
                }
                if outbox.is_empty() {
                    return json!("nothing to tamper with");
                }
                let mut event = outbox[pick % outbox.len()].clone();
                let label = format!("hash({}~{how:?})", self.ctx.label(&event));
                match how {
                    Tamper::Payload => {
                        let field = if event.schema_version == 1 { "amount" } else { "units" };
                        event.payload = json!({ field: 999 });
                    }
                    Tamper::EventId => {
                        self.ctx.forged += 1;
                        event.event_id = format!("forged-{}", self.ctx.forged);
                    }
                    Tamper::Seq => event.seq += 1,
                    Tamper::Generation => event.generation = "restored-generation".into(),
                    Tamper::FreshTimestamp => event.created_at_ms = now,
                }
                self.ctx.hash_labels.insert(event.content_hash(), label);
                let consumer_id = self.ctx.consumer_names[*slot].clone();
                out(self.backend.consumer(DATABASE_OF[*slot]).receive_batch(&[(consumer_id.as_str(), &event)], now))
            }
            Op::Apply { slot, flow, v2 } => {
                let scope = DrainScope::Flow { source: SOURCE.into(), flow_id: FLOWS[*flow].into() };
                let consumer_id = self.ctx.consumer_names[*slot].clone();
                let handler = HandlerSpec { support_v2: *v2, fail_after: None, batch_max: 1 };
                out(self.backend.drain(DATABASE_OF[*slot], &consumer_id, &scope, 1, handler, now))
            }
            Op::Drain { slot, limit, v2, batch } => {
                let consumer_id = self.ctx.consumer_names[*slot].clone();
                let handler = HandlerSpec { support_v2: *v2, fail_after: None, batch_max: *batch };
                out(self.backend.drain(DATABASE_OF[*slot], &consumer_id, &DrainScope::All, *limit, handler, now))
            }
            Op::Skip { slot, pick } => {
                let consumer_id = self.ctx.consumer_names[*slot].clone();
                let inbox = self.backend.consumer(DATABASE_OF[*slot]).inbox(&consumer_id, None, 1_000).expect("inbox");
                let blocked: Vec<_> = inbox.iter().filter(|e| e.status == InboxStatus::Blocked).collect();
                let event_id = match (blocked.len(), inbox.len()) {
                    (0, 0) => "no-such-event".to_string(),
                    (0, n) => inbox[pick % n].envelope.event_id.clone(),
                    (n, _) => blocked[pick % n].envelope.event_id.clone(),
                };
                let result =
                    self.backend.consumer(DATABASE_OF[*slot]).skip_blocked(&consumer_id, &event_id, REASON, now);
                if let Ok(entry) = &result {
                    let e = &entry.envelope;
                    self.ctx.skipped.insert((entry.consumer_id.clone(), e.source.clone(), e.flow_id.clone(), e.seq));
                }
                out(result)
            }
            Op::Prune { db, applied_retention_ms, batch_rows } => {
                out(self.backend.consumer(*db).prune(*applied_retention_ms, *batch_rows, now))
            }
            Op::PruneOutbox { retention_ms, batch_rows } => {
                out(self.backend.producer().prune_delivered(*retention_ms, *batch_rows, now))
            }
            Op::Resolve { pick, requeue } => {
                let deliveries = self.backend.producer().deliveries(None, 1_000).expect("deliveries");
                let quarantined: Vec<_> =
                    deliveries.iter().filter(|d| d.status == DeliveryStatus::Quarantined).collect();
                let chosen = match (quarantined.len(), deliveries.len()) {
                    (0, 0) => return json!("nothing to resolve"),
                    (0, n) => &deliveries[pick % n],
                    (n, _) => quarantined[pick % n],
                };
                let action = if *requeue { DeliveryAction::Requeue } else { DeliveryAction::Dismiss };
                let (event_id, consumer_id) = (chosen.event_id.clone(), chosen.consumer_id.clone());
                out(self.backend.producer().resolve_delivery(&event_id, &consumer_id, action, REASON, now))
            }
            Op::RedeliverFrom { slot, pick, all } => {
                let consumer_id = self.ctx.producer_names[*slot].clone();
                let outbox = self.backend.producer().snapshot(ROWS_MAX).expect("producer snapshot").outbox;
                let from = match (*all, outbox.len()) {
                    (true, _) | (_, 0) => None,
                    (false, n) => Some(outbox[pick % n].event_id.clone()),
                };
                out(self.backend.producer().redeliver(&consumer_id, from.as_deref()))
            }
            Op::RenameConsumer { slot } => {
                self.ctx.renames += 1;
                let from = self.ctx.consumer_names[*slot].clone();
                let to = format!("{}-{}", SLOTS[*slot], self.ctx.renames);
                let consumer = self.backend.consumer(DATABASE_OF[*slot]);
                let (renamed, answer) = match consumer.rename_consumer(&from, &to, now) {
                    // No state under `from` yet: retire the old id, as `tidemark rename-consumer`
                    // does for a subscriber that has received nothing.
                    Err(error) if error.code() == "not_found" => {
                        let retired = consumer.retire_consumer(&from, &to, now);
                        (retired.is_ok(), json!({"rename": out::<()>(Err(error)), "retire": out(retired)}))
                    }
                    result => (result.is_ok(), out(result)),
                };
                if renamed {
                    self.ctx.consumer_names[*slot] = to.clone();
                    self.ctx.skipped = std::mem::take(&mut self.ctx.skipped)
                        .into_iter()
                        .map(|(c, s, f, q)| (if c == from { to.clone() } else { c }, s, f, q))
                        .collect();
                }
                answer
            }
            Op::RenameSubscription { slot } => {
                let from = self.ctx.producer_names[*slot].clone();
                let to = self.ctx.consumer_names[*slot].clone();
                if from == to {
                    return json!("subscription already follows the consumer");
                }
                let result = self.backend.rename_subscription(&from, &to);
                if result.is_ok() {
                    self.ctx.producer_names[*slot] = to;
                }
                out(result)
            }
            Op::Tick { ms } => {
                self.ctx.now_ms += ms;
                json!("tick")
            }
            Op::TickToHorizon { pick } => {
                let outbox = self.outbox();
                if let Some(event) = outbox.get(pick % outbox.len().max(1)) {
                    // The next step adds 1 ms before it runs.
                    self.ctx.now_ms = self.ctx.now_ms.max(event.created_at_ms + HORIZON_MS - 1);
                }
                json!("tick")
            }
            Op::Crash(crash) => {
                let outcome = match crash {
                    Crash::DrainFails { slot, after, v2, batch } => {
                        let consumer_id = self.ctx.consumer_names[*slot].clone();
                        let db = DATABASE_OF[*slot];
                        let handler = HandlerSpec { support_v2: *v2, fail_after: Some(*after), batch_max: *batch };
                        out(self.backend.drain(db, &consumer_id, &DrainScope::All, 10, handler, now))
                    }
                    _ => json!("crashed"),
                };
                self.backend.crash(crash, now);
                outcome
            }
        }
    }

    /// Everything both stores hold, not yet normalised.
    fn raw_state(&mut self) -> Value {
        let producer =
            serde_json::to_value(self.backend.producer().snapshot(ROWS_MAX).expect("producer snapshot")).expect("json");
        let consumers: Vec<Value> = (0..DATABASES).map(|db| self.consumer_state(db)).collect();
        json!({"producer": producer, "consumers": consumers})
    }

    fn normaliser(&mut self) -> Normaliser {
        let snapshot = self.backend.producer().snapshot(ROWS_MAX).expect("producer snapshot");
        if !self.ctx.generations.contains(&snapshot.identity.generation) {
            self.ctx.generations.push(snapshot.identity.generation.clone());
        }
        for event in &snapshot.outbox {
            let label = self.ctx.label(event);
            self.ctx.id_labels.insert(event.event_id.clone(), format!("id({label})"));
            self.ctx.hash_labels.insert(event.content_hash(), format!("hash({label})"));
        }
        let ids = self.ctx.id_labels.iter().map(|(id, label)| (id.clone(), label.clone())).collect();
        let generations = self
            .ctx
            .generations
            .iter()
            .enumerate()
            .map(|(i, g)| (g.clone(), if i == 0 { "<gen>".to_string() } else { format!("<gen{i}>") }))
            .collect();
        Normaliser { ids, hashes: self.ctx.hash_labels.clone(), generations }
    }

    /// The generation the model rotates to next: `0e0e...`, `0f0f...`, ... (fixed width, so no
    /// generation is a part of another).
    fn next_model_generation(&mut self) -> String {
        self.ctx.rotations += 1;
        format!("{:02x}", 0x0d + self.ctx.rotations).repeat(16)
    }

    /// One consumer database as the state comparison sees it.
    fn consumer_state(&mut self, db: usize) -> Value {
        let store = self.backend.consumer(db).snapshot(ROWS_MAX).expect("consumer snapshot");
        json!({"store": store, "projection": self.backend.projection(db), "retired": self.backend.retired(db)})
    }

    /// The protocol invariants, on this backend's raw state.
    fn check_invariants(&mut self, state: &Value) -> std::result::Result<(), String> {
        if let Some(violation) = self.ctx.violation.take() {
            return Err(violation);
        }
        self.backend.own_invariants()?;
        self.check_generations(state)?;
        for (db, consumer) in state["consumers"].as_array().expect("consumers").iter().enumerate() {
            self.check_held(db, consumer)?;
        }
        for consumer in state["consumers"].as_array().expect("consumers") {
            self.check_effects(consumer)?;
        }
        // Every accepted delivery is held by its consumer (following renames), with the same
        // content, unless its receipt is gone because the event is older than the horizon.
        let outbox: Vec<Envelope> = serde_json::from_value(state["producer"]["outbox"].clone()).expect("outbox");
        let subscriptions = state["producer"]["subscriptions"].as_array().expect("subscriptions");
        for delivery in state["producer"]["deliveries"].as_array().expect("deliveries") {
            if delivery["status"] != "accepted" {
                continue;
            }
            let event_id = s(&delivery["event_id"]);
            let event = outbox.iter().find(|e| e.event_id == event_id).expect("delivered event is in the outbox");
            let mut consumer_id = s(&delivery["consumer_id"]);
            let endpoint = subscriptions
                .iter()
                .find(|sub| sub["consumer_id"] == *consumer_id)
                .map(|sub| s(&sub["endpoint"]))
                .expect("an accepted delivery has a subscription");
            let db = self.ctx.databases.iter().position(|d| *d == endpoint).expect("a known endpoint");
            let consumer = &state["consumers"][db];
            let retired: BTreeMap<String, String> = serde_json::from_value(consumer["retired"].clone())
                .map(|v: Vec<(String, String)>| v.into_iter().collect())
                .expect("retired");
            for _ in 0..16 {
                match retired.get(&consumer_id) {
                    Some(to) => consumer_id = to.clone(),
                    None => break,
                }
            }
            let hash = event.content_hash();
            let in_inbox = consumer["store"]["inbox"].as_array().expect("inbox").iter().any(|r| {
                r["consumer_id"] == *consumer_id && r["envelope"]["event_id"] == *event_id && r["content_hash"] == *hash
            });
            let in_receipts =
                consumer["store"]["receipts"].as_array().expect("receipts").iter().any(|r| {
                    r["consumer_id"] == *consumer_id && r["event_id"] == *event_id && r["content_hash"] == *hash
                });
            let expired = event.created_at_ms < self.ctx.now_ms - HORIZON_MS;
            if !in_inbox && !in_receipts && !expired {
                return Err(format!("delivery of {} to {consumer_id} is accepted but not held", token(event)));
            }
        }
        Ok(())
    }

    /// An event keeps the generation it was committed under (a rotation or a restore changes only
    /// later events), and a new event carries the producer's current generation.
    fn check_generations(&mut self, state: &Value) -> std::result::Result<(), String> {
        let current = s(&state["producer"]["identity"]["generation"]);
        let outbox: Vec<Envelope> = serde_json::from_value(state["producer"]["outbox"].clone()).expect("outbox");
        for event in &outbox {
            match self.ctx.event_generations.get(&event.event_id) {
                Some(generation) if *generation != event.generation => {
                    return Err(format!(
                        "{} changed generation from {generation} to {}",
                        token(event),
                        event.generation
                    ));
                }
                Some(_) => {}
                None if event.generation != current => {
                    return Err(format!(
                        "new event {} has generation {}, not {current}",
                        token(event),
                        event.generation
                    ));
                }
                None => {
                    self.ctx.event_generations.insert(event.event_id.clone(), event.generation.clone());
                }
            }
        }
        Ok(())
    }

    /// A consumer never exchanges the event it holds at a (consumer, source, flow, seq) for
    /// another one (a re-issued seq with other content, a tampered copy): inbox records and
    /// receipts keep the first event id and hash seen there, and every effect was written by the
    /// event held at its position.
    fn check_held(&mut self, db: usize, consumer: &Value) -> std::result::Result<(), String> {
        // The consumer id is on the row; source, flow and seq on the row (receipts, effects) or
        // in its envelope (inbox records).
        let key = |row: &Value, event: &Value| -> HeldKey {
            let seq = event["seq"].as_i64().expect("seq");
            (db, s(&row["consumer_id"]), s(&event["source"]), s(&event["flow_id"]), seq)
        };
        let mut rows: Vec<(HeldKey, (String, String))> = Vec::new();
        for record in consumer["store"]["inbox"].as_array().expect("inbox") {
            let envelope = &record["envelope"];
            rows.push((key(record, envelope), (s(&envelope["event_id"]), s(&record["content_hash"]))));
        }
        for receipt in consumer["store"]["receipts"].as_array().expect("receipts") {
            rows.push((key(receipt, receipt), (s(&receipt["event_id"]), s(&receipt["content_hash"]))));
        }
        for (k, held) in rows {
            match self.ctx.held.get(&k) {
                Some(first) if *first != held => {
                    return Err(format!("{k:?} held {first:?} and now holds {held:?}"));
                }
                Some(_) => {}
                None => {
                    self.ctx.held.insert(k, held);
                }
            }
        }
        for effect in consumer["projection"]["effects"].as_array().expect("effects") {
            if let Some((event_id, _)) = self.ctx.held.get(&key(effect, effect)) {
                if *event_id != s(&effect["event_id"]) {
                    return Err(format!("effect {effect} was not written by the event held there, {event_id}"));
                }
            }
        }
        Ok(())
    }

    /// In one consumer database: no effect twice, and per (consumer, flow) the effects (in the
    /// order they were written) plus the skipped seqs are exactly 1..=high_water.
    fn check_effects(&self, consumer: &Value) -> std::result::Result<(), String> {
        let mut seen = BTreeSet::new();
        let mut by_flow: BTreeMap<(String, String, String), Vec<i64>> = BTreeMap::new();
        for effect in consumer["projection"]["effects"].as_array().expect("effects") {
            let key = (s(&effect["consumer_id"]), s(&effect["source"]), s(&effect["flow_id"]));
            let seq = effect["seq"].as_i64().expect("seq");
            if !seen.insert((key.clone(), seq)) {
                return Err(format!("effect {key:?}/{seq} was written twice"));
            }
            by_flow.entry(key).or_default().push(seq);
        }
        let mut cursors: BTreeMap<(String, String, String), i64> = BTreeMap::new();
        for cursor in consumer["store"]["cursors"].as_array().expect("cursors") {
            let key = (s(&cursor["consumer_id"]), s(&cursor["source"]), s(&cursor["flow_id"]));
            cursors.insert(key, cursor["high_water_seq"].as_i64().expect("high water"));
        }
        let keys: BTreeSet<_> = by_flow.keys().chain(cursors.keys()).cloned().collect();
        for key in keys {
            let high_water = cursors.get(&key).copied().unwrap_or(0);
            let seqs = by_flow.get(&key).cloned().unwrap_or_default();
            if seqs.windows(2).any(|w| w[0] >= w[1]) {
                return Err(format!("effects of {key:?} are out of order: {seqs:?}"));
            }
            let skipped: BTreeSet<i64> = self
                .ctx
                .skipped
                .iter()
                .filter(|(c, s, f, _)| (c, s, f) == (&key.0, &key.1, &key.2))
                .map(|k| k.3)
                .collect();
            let mut covered: BTreeSet<i64> = seqs.iter().copied().collect();
            if let Some(both) = covered.intersection(&skipped).next() {
                return Err(format!("{key:?}/{both} was both applied and skipped"));
            }
            covered.extend(skipped);
            if covered != (1..=high_water).collect::<BTreeSet<i64>>() {
                return Err(format!(
                    "{key:?}: applied {seqs:?} plus skipped are not exactly 1..={high_water}: {covered:?}"
                ));
            }
        }
        Ok(())
    }
}

/// What a relay pass with the endpoint `down` unreachable must have done, from the producer's
/// view before and after it: every delivery to `down` in the batch answered `failed` (a transport
/// error, not a protocol answer), counted one more attempt and either backs off (pending, due
/// later) or, at `POLICY.max_attempts`, is quarantined, and is never accepted; every delivery to
/// another endpoint got a protocol answer; deliveries outside the batch did not change.
fn unreachable_problems(
    before: &ProducerSnapshot,
    after: &ProducerSnapshot,
    report: &RelayReport,
    down: &str,
    now_ms: i64,
) -> Vec<String> {
    let key = |d: &DeliveryEntry| (d.event_id.clone(), d.consumer_id.clone());
    let old: BTreeMap<_, _> = before.deliveries.iter().map(|d| (key(d), d)).collect();
    let new: BTreeMap<_, _> = after.deliveries.iter().map(|d| (key(d), d)).collect();
    let endpoint: BTreeMap<&str, &str> =
        before.subscriptions.iter().map(|s| (s.consumer_id.as_str(), s.endpoint.as_str())).collect();
    let mut problems = Vec::new();
    let mut answered = BTreeSet::new();
    for answer in &report.answers {
        let id = (answer.event_id.clone(), answer.consumer_id.clone());
        answered.insert(id.clone());
        let what = format!("{}/{} to {}", answer.flow_id, answer.seq, answer.consumer_id);
        let unreachable = endpoint.get(answer.consumer_id.as_str()) == Some(&down);
        if !unreachable {
            if answer.answer == "failed" {
                problems.push(format!("{what}: a reachable consumer failed: {:?}", answer.reason));
            }
            continue;
        }
        if answer.answer != "failed" || !answer.reason.as_deref().is_some_and(|r| r.contains(UNREACHABLE)) {
            problems.push(format!("{what}: answered {:?} ({:?}) while unreachable", answer.answer, answer.reason));
        }
        let (Some(was), Some(is)) = (old.get(&id), new.get(&id)) else {
            problems.push(format!("{what}: no delivery row before and after"));
            continue;
        };
        if is.attempts != was.attempts + 1 {
            problems.push(format!("{what}: attempts went from {} to {}", was.attempts, is.attempts));
        }
        let quarantined = is.attempts >= POLICY.max_attempts;
        match is.status {
            DeliveryStatus::Quarantined if quarantined => {}
            DeliveryStatus::Pending if !quarantined && is.next_attempt_at_ms > now_ms => {}
            status => problems.push(format!(
                "{what}: {} after {} attempts, due at {} (now {now_ms})",
                status.as_str(),
                is.attempts,
                is.next_attempt_at_ms
            )),
        }
    }
    for (id, was) in &old {
        if !answered.contains(id) && new.get(id) != Some(was) {
            problems.push(format!("{id:?} was not in the batch but changed: {was:?} -> {:?}", new.get(id)));
        }
    }
    problems
}

/// What a subscribe that answered `queued` must have done: a new id receives exactly the events
/// still in the outbox (all plainly pending) with `from_start`, and none of them otherwise (only
/// events committed later); an existing subscription is left as it was.
fn subscribe_problem(
    before: &ProducerSnapshot,
    after: &ProducerSnapshot,
    subscription: &Subscription,
    from_start: bool,
    queued: u64,
) -> Option<String> {
    let id = &subscription.consumer_id;
    let mine = |snapshot: &ProducerSnapshot| -> Vec<DeliveryEntry> {
        snapshot.deliveries.iter().filter(|d| d.consumer_id == *id).cloned().collect()
    };
    if !after.subscriptions.contains(subscription) {
        return Some("the subscription is not listed".into());
    }
    if before.subscriptions.iter().any(|s| s.consumer_id == *id) {
        return (queued != 0 || mine(before) != mine(after) || before.subscriptions != after.subscriptions)
            .then(|| format!("a re-subscription changed something (queued {queued})"));
    }
    let deliveries = mine(after);
    let expected: Vec<&str> =
        if from_start { after.outbox.iter().map(|e| e.event_id.as_str()).collect() } else { vec![] };
    let got: Vec<&str> = deliveries.iter().map(|d| d.event_id.as_str()).collect();
    let fresh = deliveries.iter().all(|d| d.status == DeliveryStatus::Pending && d.attempts == 0);
    (got != expected || queued != expected.len() as u64 || !fresh).then(|| {
        format!("from_start {from_start}: queued {queued}, deliveries {deliveries:?}, expected events {expected:?}")
    })
}

fn s(value: &Value) -> String {
    value.as_str().expect("a string").to_string()
}

/// Maps one backend's event ids, hashes and generations to backend-independent labels.
struct Normaliser {
    ids: Vec<(String, String)>,
    hashes: HashMap<String, String>,
    /// Generation -> label, in the order the generations appeared.
    generations: Vec<(String, String)>,
}

impl Normaliser {
    fn text(&self, text: &str) -> String {
        if let Some(label) = self.hashes.get(text) {
            return label.clone();
        }
        let mut out = text.to_string();
        for (id, label) in &self.ids {
            if out.contains(id.as_str()) {
                out = out.replace(id.as_str(), label);
            }
        }
        for (generation, label) in &self.generations {
            if out.contains(generation.as_str()) {
                out = out.replace(generation.as_str(), label);
            }
        }
        out
    }

    fn apply(&self, value: &mut Value) {
        match value {
            Value::String(text) => *text = self.text(text),
            Value::Array(items) => items.iter_mut().for_each(|v| self.apply(v)),
            Value::Object(map) => map.values_mut().for_each(|v| self.apply(v)),
            _ => {}
        }
    }

    fn normalised(&self, mut value: Value) -> Value {
        self.apply(&mut value);
        value
    }
}

/// The first place where two JSON documents differ, for a readable failure.
fn first_difference(path: &str, sqlite: &Value, model: &Value) -> Option<String> {
    match (sqlite, model) {
        (Value::Object(a), Value::Object(b)) => {
            let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            keys.into_iter().find_map(|k| {
                first_difference(
                    &format!("{path}.{k}"),
                    a.get(k).unwrap_or(&Value::Null),
                    b.get(k).unwrap_or(&Value::Null),
                )
            })
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            a.iter().zip(b).enumerate().find_map(|(i, (x, y))| first_difference(&format!("{path}[{i}]"), x, y))
        }
        _ if sqlite == model => None,
        _ => Some(format!("{path}:\n  sqlite: {sqlite}\n  model:  {model}")),
    }
}

/// How often each (operation, answer) pair was seen: printed at the end (`--nocapture`) to show
/// what the random cases covered.
static COVERAGE: Mutex<BTreeMap<String, u64>> = Mutex::new(BTreeMap::new());

fn op_name(op: &Op) -> String {
    let debug = format!("{op:?}");
    let end = debug.find(|c: char| !c.is_alphanumeric()).unwrap_or(debug.len());
    match op {
        Op::Crash(crash) => {
            let crash = format!("{crash:?}");
            let end = crash.find(|c: char| !c.is_alphanumeric()).unwrap_or(crash.len());
            format!("Crash.{}", &crash[..end])
        }
        _ => debug[..end].to_string(),
    }
}

/// The protocol words in an outcome: `outcome`, relay `answer` and `verdict`, error codes.
fn answers(value: &Value, found: &mut BTreeSet<String>) {
    match value {
        Value::Object(map) => {
            for (key, item) in map {
                match (key.as_str(), item) {
                    ("outcome" | "answer" | "verdict" | "err", Value::String(word)) => {
                        found.insert(word.clone());
                    }
                    ("reason", Value::String(reason)) if reason.contains("producer generation changed") => {
                        found.insert("generation changed".into());
                    }
                    ("compacted" | "receipts_deleted", Value::Number(n)) if n.as_u64() > Some(0) => {
                        found.insert(key.clone());
                    }
                    _ => answers(item, found),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|item| answers(item, found)),
        _ => {}
    }
}

fn tally(op: &Op, outcome: &Value) {
    let mut found = BTreeSet::new();
    answers(outcome, &mut found);
    if found.is_empty() {
        found.insert(if outcome.get("ok").is_some() { "ok" } else { "no-op" }.to_string());
    }
    let mut coverage = COVERAGE.lock().unwrap_or_else(|e| e.into_inner());
    for word in found {
        *coverage.entry(format!("{} -> {word}", op_name(op))).or_default() += 1;
    }
}

/// Run `ops` on the SQLite stores and the model, comparing after every step; returns the
/// normalised outcomes.
fn run_case(ops: &[Op]) -> std::result::Result<Vec<Value>, TestCaseError> {
    let dir = tempfile::tempdir().expect("tempdir");
    let sqlite = SqliteBackend::create(dir.path());
    let databases = sqlite.endpoints();
    run_case_on("SQLite", sqlite, &databases, ops)
}

/// Run `ops` on the PostgreSQL stores of the server at `conn` and the model.
fn run_case_postgres(conn: &str, ops: &[Op]) -> std::result::Result<Vec<Value>, TestCaseError> {
    let postgres = PostgresBackend::create(conn);
    let databases = postgres.endpoints();
    run_case_on("PostgreSQL", postgres, &databases, ops)
}

/// Run `ops` on a real backend (`name` in messages) and on the model, comparing after every step.
fn run_case_on<B: Backend>(
    name: &str,
    real: B,
    databases: &[String],
    ops: &[Op],
) -> std::result::Result<Vec<Value>, TestCaseError> {
    let mut real = Run::new(real, databases);
    let mut model = Run::new(ModelBackend::create(databases), databases);
    let mut outcomes = Vec::with_capacity(ops.len());
    for (index, op) in ops.iter().enumerate() {
        let fail = |what: &str, detail: String| {
            TestCaseError::fail(format!(
                "{name}: after op #{index} {op:?}: {what}\n{detail}\nops so far: {:#?}",
                &ops[..=index]
            ))
        };
        let (real_outcome, model_outcome) = (real.step(op), model.step(op));
        let (real_norm, model_norm) = (real.normaliser(), model.normaliser());
        let (a, b) = (real_norm.normalised(real_outcome), model_norm.normalised(model_outcome));
        tally(op, &a);
        if let Some(difference) = first_difference("outcome", &a, &b) {
            return Err(fail("outcomes differ", difference));
        }
        outcomes.push(a);
        let (raw_a, raw_b) = (real.raw_state(), model.raw_state());
        real.check_invariants(&raw_a).map_err(|e| fail(&format!("{name} broke an invariant"), e))?;
        model.check_invariants(&raw_b).map_err(|e| fail("the model broke an invariant", e))?;
        let (a, b) = (real_norm.normalised(raw_a), model_norm.normalised(raw_b));
        if let Some(difference) = first_difference("state", &a, &b) {
            return Err(fail("states differ", difference));
        }
    }
    Ok(outcomes)
}

/// `PROPTEST_CASES` random cases (default `cases_default`) of `run`, printing the coverage.
fn random_cases(cases_default: u32, run: impl Fn(&[Op]) -> std::result::Result<Vec<Value>, TestCaseError>) {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(cases_default);
    let config = Config {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Off)),
        max_shrink_iters: 2_048,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let result = runner.run(&prop::collection::vec(op(), 1..=MAX_OPS), |ops| run(&ops).map(drop));
    let coverage = COVERAGE.lock().unwrap_or_else(|e| e.into_inner());
    let lines: Vec<String> = coverage.iter().map(|(what, n)| format!("  {what}: {n}")).collect();
    eprintln!("model check coverage ({cases} cases, operation -> answer: count):\n{}", lines.join("\n"));
    if let Err(error) = result {
        panic!("{error}");
    }
}

#[test]
fn sqlite_stores_match_the_model() {
    random_cases(DEFAULT_CASES, run_case);
}

/// The same random cases on the PostgreSQL stores (`TIDEMARK_TEST_POSTGRES`, default the local
/// server; skipped with a message when it does not answer). Fewer by default: each case creates
/// and drops its schemas on the server.
#[test]
fn postgres_stores_match_the_model() {
    let Some(conn) = postgres_server() else { return };
    random_cases(DEFAULT_POSTGRES_CASES, |ops| run_case_postgres(&conn, ops));
}

/// A fixed scenario through every kind of operation (the next test walks through the unreachable
/// endpoint, subscribe, rotation and restore operations), so that a regression shows up even when
/// the random cases happen to miss it. It also checks that the scenario reaches what it is
/// meant to reach (the words listed next to the operations).
#[test]
fn a_fixed_walk_through_every_operation_matches_the_model() {
    check_walk(&walk_through_every_operation(), run_case);
}

/// The first fixed walk on the PostgreSQL stores.
#[test]
fn a_fixed_walk_through_every_operation_matches_the_model_on_postgres() {
    let Some(conn) = postgres_server() else { return };
    check_walk(&walk_through_every_operation(), |ops| run_case_postgres(&conn, ops));
}

/// Each operation of the first walk, with the words its answer must contain.
fn walk_through_every_operation() -> Vec<(Op, &'static [&'static str])> {
    let spec = |flow, to| AdvanceSpec { flow, expect: Expect::Current, to, quantity: Qty::Auto, v2: false };
    vec![
        (Op::Advance(vec![spec(0, To::Next), spec(1, To::Next)]), &["committed"]),
        (Op::Advance(vec![spec(0, To::Next), AdvanceSpec { v2: true, ..spec(1, To::Next) }]), &["committed"]),
        (Op::Advance(vec![spec(0, To::Next), spec(2, To::State(2))]), &["committed", "invalid_transition"]),
        (Op::Reorder { slot: 0, pick: 0, count: 2 }, &["accepted"]),
        (Op::Apply { slot: 0, flow: 0, v2: false }, &["gap"]),
        (Op::Relay { limit: 3 }, &["accepted", "duplicate"]),
        (Op::Drain { slot: 0, limit: 10, v2: false, batch: 3 }, &["applied", "blocked"]),
        (Op::Relay { limit: 5 }, &["accepted"]),
        (Op::Redeliver { slot: 0, pick: 1 }, &["duplicate"]),
        (Op::Tampered { slot: 0, pick: 0, how: Tamper::Payload, applied: true }, &["conflict"]),
        (Op::Tampered { slot: 2, pick: 0, how: Tamper::EventId, applied: false }, &["conflict", "already held"]),
        (Op::Relay { limit: 5 }, &["accepted", "duplicate"]),
        (Op::Drain { slot: 1, limit: 10, v2: false, batch: 1 }, &["blocked"]),
        (Op::Skip { slot: 1, pick: 0 }, &["skipped"]),
        (Op::Crash(Crash::DrainFails { slot: 0, after: 1, v2: true, batch: 2 }), &["store"]),
        (Op::Crash(Crash::ProducerTxDropped { flow: 1 }), &[]),
        (Op::Crash(Crash::ConsumerTxDropped { db: 0 }), &[]),
        (Op::Drain { slot: 0, limit: 10, v2: true, batch: 4 }, &["applied", "idle"]),
        (Op::RenameConsumer { slot: 0 }, &["projections"]),
        (Op::Advance(vec![spec(1, To::Next)]), &["committed"]),
        (Op::Relay { limit: 5 }, &["conflict", "renamed", "retry"]),
        (Op::Tick { ms: 4_000 }, &[]),
        (Op::Relay { limit: 5 }, &["conflict", "quarantined"]),
        (Op::RelayEvent { pick: 0, patient: true }, &["conflict", "retry"]),
        (Op::Tick { ms: 4_000 }, &[]),
        (Op::Relay { limit: 5 }, &["quarantined"]),
        (Op::RenameSubscription { slot: 0 }, &[]),
        (Op::Resolve { pick: 0, requeue: true }, &["pending", "requeued"]),
        (Op::Relay { limit: 5 }, &["accepted"]),
        (Op::Drain { slot: 2, limit: 10, v2: true, batch: 2 }, &["applied"]),
        // 1 ms later, with 1 ms of retention: exactly at the cutoff, so compacted.
        (Op::Prune { db: 1, applied_retention_ms: 1, batch_rows: 1_000 }, &["compacted"]),
        (Op::Prune { db: 0, applied_retention_ms: 0, batch_rows: 2 }, &["compacted"]),
        (Op::Redeliver { slot: 0, pick: 0 }, &["duplicate"]),
        (Op::Advance(vec![spec(2, To::Next)]), &["committed"]),
        // Exactly at the horizon of r3/1 (outbox index 6): still accepted; 1 ms later expired.
        (Op::TickToHorizon { pick: 6 }, &[]),
        (Op::Relay { limit: 1 }, &["accepted", "shop/r3/1"]),
        (Op::Relay { limit: 5 }, &["expired", "retry"]),
        (Op::Prune { db: 1, applied_retention_ms: 0, batch_rows: 1_000 }, &["receipts_deleted"]),
        (Op::Tampered { slot: 2, pick: 0, how: Tamper::FreshTimestamp, applied: true }, &["high-water"]),
        (Op::Crash(Crash::Reopen), &[]),
        (Op::Drain { slot: 1, limit: 10, v2: true, batch: 1 }, &["blocked", "invalid transition"]),
        // Everything the outbox still holds handed to c again: duplicates, and what the prune
        // above compacted is still recognised from its receipt.
        (Op::RedeliverFrom { slot: 2, pick: 0, all: true }, &["redelivered"]),
        (Op::Relay { limit: 5 }, &["duplicate"]),
        (Op::RedeliverFrom { slot: 2, pick: 3, all: false }, &["redelivered"]),
    ]
}

/// Run `walk` with `run` and check that each operation answered the words listed next to it.
fn check_walk(walk: &[(Op, &[&str])], run: impl Fn(&[Op]) -> std::result::Result<Vec<Value>, TestCaseError>) {
    let ops: Vec<Op> = walk.iter().map(|(op, _)| op.clone()).collect();
    let outcomes = run(&ops).unwrap_or_else(|error| panic!("{error}"));
    for ((op, words), outcome) in walk.iter().zip(&outcomes) {
        let text = outcome.to_string();
        for word in *words {
            assert!(text.contains(word), "{op:?} was expected to answer {word:?}, got {text}");
        }
    }
}

/// A fixed scenario through the operations that the first walk does not take: an unreachable
/// consumer database (failed attempts, backoff, quarantine, while the other database progresses),
/// subscribing mid-run (without and with `from_start`, and an id its consumer has retired), and a
/// producer restored from a backup with its generation rotated (old events redelivered as
/// duplicates, a re-issued seq a conflict naming the generation change).
#[test]
fn a_fixed_walk_through_unreachable_subscribe_and_restore_matches_the_model() {
    check_walk(&walk_through_unreachable_subscribe_and_restore(), run_case);
}

/// The second fixed walk on the PostgreSQL stores (the backup is a copy of the producer's tables).
#[test]
fn a_fixed_walk_through_unreachable_subscribe_and_restore_matches_the_model_on_postgres() {
    let Some(conn) = postgres_server() else { return };
    check_walk(&walk_through_unreachable_subscribe_and_restore(), |ops| run_case_postgres(&conn, ops));
}

/// Each operation of the second walk, with the words its answer must contain.
fn walk_through_unreachable_subscribe_and_restore() -> Vec<(Op, &'static [&'static str])> {
    let spec = |flow| AdvanceSpec { flow, expect: Expect::Current, to: To::Next, quantity: Qty::Auto, v2: false };
    vec![
        (Op::Advance(vec![spec(0), spec(1)]), &["committed"]),
        (Op::BackupProducer, &["backed up"]),
        // a and b (database 0) do not answer; c (database 1) accepts.
        (Op::RelayUnreachable { db: 0, limit: 10 }, &["failed", "retry", "did not answer", "accepted"]),
        // d, subscribed now without `from_start`, receives only what is committed from now on.
        (Op::Subscribe { slot: 3, from_start: false, retired: false }, &["new_from_now", "\"queued\":0"]),
        (Op::Advance(vec![spec(0)]), &["committed", "shop/r1/2"]),
        (Op::Tick { ms: 4_000 }, &[]),
        // Second failed attempt: quarantined (max_attempts 2); c and d still progress.
        (Op::RelayUnreachable { db: 0, limit: 10 }, &["quarantined", "failed", "accepted", "\"d\""]),
        (Op::Drain { slot: 3, limit: 10, v2: false, batch: 2 }, &["gap"]),
        (Op::Drain { slot: 2, limit: 10, v2: false, batch: 1 }, &["applied", "idle"]),
        (Op::Subscribe { slot: 3, from_start: true, retired: false }, &["unchanged", "\"queued\":0"]),
        (Op::RenameConsumer { slot: 2 }, &["projections"]),
        (Op::RenameSubscription { slot: 2 }, &[]),
        // A new subscription for the retired id `c`: everything in the outbox, refused as renamed.
        (Op::Subscribe { slot: 2, from_start: true, retired: true }, &["new_from_start", "\"queued\":3"]),
        (Op::Relay { limit: 3 }, &["conflict", "renamed", "retry"]),
        // Back to the backup (r1/1 and r2/1 pending for a, b, c; no d), with a new generation.
        (Op::RestoreProducer, &["<gen1>"]),
        // Old events keep their generation: c (renamed back from the backup's subscription id
        // `c`, so retired) conflicts, a and b accept.
        (Op::Relay { limit: 10 }, &["accepted", "conflict", "renamed"]),
        (Op::RenameSubscription { slot: 2 }, &[]),
        (Op::Tick { ms: 4_000 }, &[]),
        (Op::Relay { limit: 10 }, &["duplicate"]),
        // The restored producer re-issues r1/2 under the new generation.
        (Op::Advance(vec![spec(0)]), &["committed"]),
        (Op::Relay { limit: 10 }, &["shop/r1/2@gen1", "accepted", "conflict", "generation changed"]),
        (Op::Subscribe { slot: 3, from_start: true, retired: false }, &["new_from_start", "\"queued\":3"]),
        (Op::Relay { limit: 10 }, &["accepted", "conflict", "generation changed"]),
        (Op::Drain { slot: 3, limit: 10, v2: false, batch: 2 }, &["applied"]),
        (Op::RotateGeneration, &["<gen2>"]),
        (Op::Advance(vec![spec(1)]), &["committed"]),
        (Op::Relay { limit: 10 }, &["shop/r2/2@gen2", "accepted"]),
        (Op::Drain { slot: 0, limit: 10, v2: false, batch: 1 }, &["applied"]),
    ]
}

/// Prune deletes an event once every delivery of it is settled, the newest one included when it
/// was accepted ahead of every cursor. Found by the random cases: SQLite handed that position out
/// again, and a later `outbox redeliver` counted the gap it left as held (`pruned` 1, the model 2).
#[test]
fn a_position_prune_deleted_above_every_cursor_is_never_handed_out_again() {
    check_walk(&walk_past_a_pruned_newest_position(), run_case);
}

/// The same walk on the PostgreSQL stores.
#[test]
fn a_position_prune_deleted_above_every_cursor_is_never_handed_out_again_on_postgres() {
    let Some(conn) = postgres_server() else { return };
    check_walk(&walk_past_a_pruned_newest_position(), |ops| run_case_postgres(&conn, ops));
}

fn walk_past_a_pruned_newest_position() -> Vec<(Op, &'static [&'static str])> {
    let spec = |flow| AdvanceSpec { flow, expect: Expect::Current, to: To::Next, quantity: Qty::Auto, v2: false };
    vec![
        (Op::Advance(vec![spec(1), spec(0)]), &["committed"]),
        (Op::RelayUnreachable { db: 0, limit: 1 }, &[]),
        (Op::Advance(vec![spec(0), spec(2)]), &["committed"]),
        (Op::Relay { limit: 4 }, &[]),
        (Op::Relay { limit: 4 }, &[]),
        (Op::RedeliverFrom { slot: 1, pick: 0, all: false }, &[]),
        (Op::RelayTo { slots: vec![1], limit: 3 }, &[]),
        (Op::Tick { ms: 1_000 }, &[]),
        (Op::PruneOutbox { retention_ms: 0, batch_rows: 2 }, &[]),
        (Op::Advance(vec![spec(1), spec(0)]), &["committed"]),
        (Op::RedeliverFrom { slot: 0, pick: 4, all: false }, &["\"pruned\":2"]),
    ]
}
