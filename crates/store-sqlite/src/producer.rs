//! The producer store: flows, the immutable outbox and per-subscriber delivery records.
//!
//! Deliveries are kept as a cursor per subscriber plus exceptions (schema v4). Each subscription
//! row holds `from_position` (the first outbox position it receives) and `delivered_position`:
//! every position in `from_position..=delivered_position` is accepted by that subscriber unless
//! the `deliveries` table holds a row for it, and every later position is pending unless it holds
//! one. `deliveries` rows are the exceptions: an event that failed at least once (retrying,
//! quarantined, or accepted after failures), an operator's decision, or an event accepted ahead of
//! the cursor. Listing methods merge the two, so callers see one delivery per event and
//! subscriber exactly as before. Advance therefore writes no delivery row, and the relay records
//! a batch of accepted deliveries by moving one cursor.
//!
//! Why the cursor cannot skip an event (a known trap of outbox relays: "reading the outbox by last id seen"):
//! positions are allocated inside the advancing write transaction as one more than the largest
//! position any outbox row or cursor names ([`last_position`]); SQLite has one writer at a time,
//! and in WAL mode a writer always works on the newest snapshot, so positions become visible in
//! commit order and a lower position can never commit after a higher one was seen. The cursor
//! moves only inside the relay's recording write transaction, over outbox rows read in that
//! transaction, and only across positions that were accepted in this batch or have an exception
//! row. The cursor lives in the same file as the outbox, so a restored backup brings both back
//! together, and because allocation starts above every cursor and above the newest event prune
//! deleted, a position is never handed out again (prune may delete the newest events, accepted
//! ahead of every cursor, and a position reused there would make `redeliver` count its gap as
//! held: the model check found that). PostgreSQL allocates
//! sequence values before commit and commits out of order; its backend must make position order
//! commit order (allocate from a per-producer counter row updated in the advancing transaction,
//! whose row lock is held until commit) or move cursors only below the oldest transaction still
//! in progress (`pg_snapshot_xmin`).

use std::collections::HashMap;
use std::path::Path;

use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};
use tidemark_core::crash;
use tidemark_core::endpoint::Endpoint;
use tidemark_core::error::codes;
use tidemark_core::flow::{decide_advance, validate_request, AdvanceOutcome, AdvanceRequest, FlowMachine, FlowState};
use tidemark_core::id::{validate_id, validate_limit, validate_reason};
use tidemark_core::limits::{ADVANCE_BATCH_MAX, PAGE_SIZE_MAX, PRUNE_BATCH_ROWS_MAX, RELAY_BATCH_EVENTS_MAX};
use tidemark_core::policy::retention_walk_stops_at;
use tidemark_core::store::{
    leave_out, round_robin, Delivery, DeliveryAction, DeliveryEntry, DeliveryResult, DeliveryStatus, DeliveryVerdict,
    DueQuery, FlowRecord, OutboxPruneReport, ProducerIdentity, ProducerSnapshot, ProducerStore, RedeliverReport,
    Subscription,
};
use tidemark_core::{ensure_invariant, Envelope, Error, Result};

use crate::schema::{self, meta_get, meta_set, Durability};
use crate::SqlResult;

/// A producer database on SQLite: its flows, the immutable outbox, subscriptions with their
/// delivery cursors and the delivery exception rows. Implements
/// [`ProducerStore`](tidemark_core::store::ProducerStore); [`SqliteProducer::begin`] and
/// [`advance_in`] let the caller write business rows in the same transaction as an advance.
pub struct SqliteProducer {
    conn: Connection,
    identity: ProducerIdentity,
}

fn new_generation() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

fn read_identity(conn: &Connection) -> Result<Option<ProducerIdentity>> {
    let source = meta_get(conn, "producer.source")?;
    let generation = meta_get(conn, "producer.generation")?;
    Ok(source.zip(generation).map(|(source, generation)| ProducerIdentity { source, generation }))
}

impl SqliteProducer {
    /// Create (or reopen) a producer database with the namespace `source`. Re-running init on
    /// an initialised file with the same source changes nothing; another source is an error.
    pub fn init(path: &Path, source: &str) -> Result<SqliteProducer> {
        validate_id("source", source)?;
        let mut conn = schema::open(path, true, Durability::Full)?;
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        let identity = match read_identity(&tx)? {
            Some(existing) if existing.source == source => existing,
            Some(existing) => {
                return Err(Error::invalid(
                    codes::ALREADY_INITIALIZED,
                    format!("{} is already the producer of source {:?}", path.display(), existing.source),
                ))
            }
            None => {
                let identity = ProducerIdentity { source: source.to_string(), generation: new_generation() };
                meta_set(&tx, "producer.source", &identity.source)?;
                meta_set(&tx, "producer.generation", &identity.generation)?;
                identity
            }
        };
        tx.commit().db()?;
        Ok(SqliteProducer { conn, identity })
    }

    /// Open an initialised producer database. Never creates a file.
    pub fn open(path: &Path) -> Result<SqliteProducer> {
        Self::open_with(path, Durability::Full)
    }

    /// [`SqliteProducer::open`] with a durability (`Durability::Normal` skips the per-commit
    /// fsync).
    pub fn open_with(path: &Path, durability: Durability) -> Result<SqliteProducer> {
        let conn = schema::open(path, false, durability)?;
        let identity = read_identity(&conn)?.ok_or_else(|| {
            Error::invalid(
                codes::NOT_INITIALIZED,
                format!("{} is not a producer database; run `tidemark init --producer`", path.display()),
            )
        })?;
        Ok(SqliteProducer { conn, identity })
    }

    /// Give this producer a new generation id. Run it after restoring the file from a backup:
    /// events it re-issues then carry the new generation, which consumers name in the conflict.
    pub fn rotate_generation(&mut self) -> Result<ProducerIdentity> {
        let generation = new_generation();
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        meta_set(&tx, "producer.generation", &generation)?;
        tx.commit().db()?;
        self.identity.generation = generation;
        Ok(self.identity.clone())
    }

    /// The connection, for the caller's own reads and for opening its own transactions.
    pub fn connection(&mut self) -> &mut Connection {
        &mut self.conn
    }

    /// Begin a `BEGIN IMMEDIATE` transaction in which the caller writes its business rows and
    /// advances flows; both commit or roll back together.
    /// Run `f` in one `BEGIN IMMEDIATE` transaction that commits only when `f` returns `Ok` and
    /// every advance in it committed: write business rows (the transaction derefs to the
    /// connection) and advance flows with [`ProducerTransaction::advance`], and both commit or
    /// neither does. `?` works on SQLite calls (`tidemark::Error: From<rusqlite::Error>`) and on
    /// advances.
    ///
    /// ```
    /// # use tidemark_core::flow::AdvanceRequest;
    /// # use tidemark_core::reservation::ReservationMachine;
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let mut producer = tidemark_store_sqlite::SqliteProducer::init(&dir.path().join("shop.db"), "shop").unwrap();
    /// # producer.connection().execute_batch("CREATE TABLE orders (id TEXT PRIMARY KEY, total INTEGER)").unwrap();
    /// let request = AdvanceRequest::new("order-1", 0, "reserved", serde_json::json!({"quantity": 3}));
    /// let committed = producer.transaction(1_000, |tx| -> tidemark_core::Result<_> {
    ///     tx.execute("INSERT INTO orders (id, total) VALUES (?1, ?2)", ("order-1", 300))?;
    ///     tx.advance(&ReservationMachine, &request)
    /// })?;
    /// assert_eq!(committed.seq, 1);
    /// // The same request again is stale: the insert of this second transaction rolls back too.
    /// let again = producer.transaction(1_001, |tx| -> tidemark_core::Result<_> {
    ///     tx.execute("INSERT INTO orders (id, total) VALUES (?1, ?2)", ("order-2", 100))?;
    ///     tx.advance(&ReservationMachine, &request)
    /// });
    /// assert_eq!(again.unwrap_err().code(), "stale");
    /// # let orders: i64 = producer.connection().query_row("SELECT count(*) FROM orders", [], |r| r.get(0)).unwrap();
    /// # assert_eq!(orders, 1);
    /// # Ok::<(), tidemark_core::Error>(())
    /// ```
    pub fn transaction<T, E, F>(&mut self, now_ms: i64, f: F) -> std::result::Result<T, E>
    where
        F: FnOnce(&ProducerTransaction<'_>) -> std::result::Result<T, E>,
        E: From<Error>,
    {
        let tx = ProducerTransaction { inner: self.begin()?, now_ms, refused: Default::default() };
        let value = f(&tx)?;
        if let Some(refused) = tx.refused.take() {
            return Err(refused.into());
        }
        tx.inner.commit()?;
        Ok(value)
    }

    /// A transaction for the caller's rows and advances, committed with
    /// [`OutboxTransaction::commit`]. Its `advance` answers outcomes (`stale` and
    /// `invalid_transition` are answers, not errors): check them before committing, or use
    /// [`SqliteProducer::transaction`], which cannot commit half.
    pub fn begin(&mut self) -> Result<OutboxTransaction<'_>> {
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        Ok(OutboxTransaction { tx, identity: &self.identity })
    }
}

/// A transaction on the producer database that can write the caller's rows and outbox events.
/// Dropping it without `commit` rolls everything back.
pub struct OutboxTransaction<'a> {
    tx: rusqlite::Transaction<'a>,
    identity: &'a ProducerIdentity,
}

impl OutboxTransaction<'_> {
    /// Advance one flow in this transaction (the event is inserted at the next outbox position).
    /// `stale` and `invalid_transition` are answers that wrote nothing; bad input is an error
    /// (`invalid_id`, `invalid_seq`, the machine's own codes, `payload_too_large`, `seq_overflow`).
    /// Nothing is visible to anyone until [`OutboxTransaction::commit`].
    pub fn advance(&self, machine: &dyn FlowMachine, request: &AdvanceRequest, now_ms: i64) -> Result<AdvanceOutcome> {
        validate_request(machine, request)?;
        let mut statements = AdvanceStatements::prepare(&self.tx)?;
        let mut position = last_position(&self.tx)?;
        advance_validated(&mut statements, &mut position, self.identity, machine, request, now_ms)
    }

    /// Commit the caller's rows and every advance of this transaction together (crash points
    /// `advance.before_commit` and `advance.after_commit`).
    pub fn commit(self) -> Result<()> {
        crash::hit("advance.before_commit");
        self.tx.commit().db()?;
        crash::hit("advance.after_commit");
        Ok(())
    }
}

impl std::ops::Deref for OutboxTransaction<'_> {
    type Target = Connection;
    fn deref(&self) -> &Connection {
        &self.tx
    }
}

/// What an advance that committed answered.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Committed {
    /// The flow.
    pub flow_id: String,
    /// The flow's new seq (the event's).
    pub seq: i64,
    /// The event's id.
    pub event_id: String,
    /// The flow's new state.
    pub state: String,
}

/// `Ok` for a committed outcome; the refusal (`stale`, `invalid_transition`) as an error with
/// that code otherwise, for a transaction that must not commit without its event.
pub fn committed(outcome: AdvanceOutcome) -> Result<Committed> {
    match outcome {
        AdvanceOutcome::Committed { flow_id, seq, event_id, state } => Ok(Committed { flow_id, seq, event_id, state }),
        AdvanceOutcome::Stale { flow_id, expected_seq, current_seq } => Err(Error::invalid(
            codes::STALE,
            format!("stale: flow {flow_id} is at seq {current_seq}, the request expected {expected_seq}"),
        )),
        AdvanceOutcome::InvalidTransition { flow_id, current_state, to_state, reason } => Err(Error::invalid(
            codes::INVALID_TRANSITION,
            format!("invalid transition of flow {flow_id} from {current_state} to {to_state}: {reason}"),
        )),
    }
}

/// A transaction of [`SqliteProducer::transaction`]: the caller's statements (it derefs to the
/// connection) and advances that either commit or abort the whole transaction.
pub struct ProducerTransaction<'a> {
    inner: OutboxTransaction<'a>,
    now_ms: i64,
    refused: std::cell::RefCell<Option<Error>>,
}

impl ProducerTransaction<'_> {
    /// Advance a flow in this transaction. An answer other than `committed` is an error (codes
    /// `stale`, `invalid_transition`) and dooms the transaction: it rolls back even if the
    /// closure goes on and returns `Ok`, so business rows never commit without their event.
    pub fn advance(&self, machine: &dyn FlowMachine, request: &AdvanceRequest) -> Result<Committed> {
        let outcome = self.inner.advance(machine, request, self.now_ms)?;
        committed(outcome).inspect_err(|error| {
            self.refused.borrow_mut().get_or_insert_with(|| error.clone());
        })
    }

    /// The time this transaction stamps its events with.
    pub fn now_ms(&self) -> i64 {
        self.now_ms
    }
}

impl std::ops::Deref for ProducerTransaction<'_> {
    type Target = Connection;
    fn deref(&self) -> &Connection {
        &self.inner.tx
    }
}

/// Like [`advance_in`], for a transaction that must not commit without its event (a
/// transactional workflow step, a caller's own transaction): an answer other than `committed`
/// is an error with its code (`stale`, `invalid_transition`). Return it from the step or
/// closure and the transaction (or the step's savepoint) rolls back with the business rows.
pub fn advance_committed_in(
    tx: &Connection,
    machine: &dyn FlowMachine,
    request: &AdvanceRequest,
    now_ms: i64,
) -> Result<Committed> {
    committed(advance_in(tx, machine, request, now_ms)?)
}

/// Advance a flow inside a transaction the caller opened on the producer database (for
/// example a `rusqlite::Transaction` that also writes business rows).
pub fn advance_in(
    tx: &Connection,
    machine: &dyn FlowMachine,
    request: &AdvanceRequest,
    now_ms: i64,
) -> Result<AdvanceOutcome> {
    if tx.is_autocommit() {
        return Err(Error::invalid(codes::INVALID_ARGUMENT, "advance_in needs an open transaction"));
    }
    validate_request(machine, request)?;
    let identity = read_identity(tx)?
        .ok_or_else(|| Error::invalid(codes::NOT_INITIALIZED, "this database is not a producer database"))?;
    let mut statements = AdvanceStatements::prepare(tx)?;
    let mut position = last_position(tx)?;
    advance_validated(&mut statements, &mut position, &identity, machine, request, now_ms)
}

/// The largest outbox position ever handed out, as far as this file can tell: the largest
/// position of an outbox row, of a subscriber's cursor or of an event prune deleted (meta key
/// `outbox.pruned_position`). The next event gets this + 1. Read in the write transaction that
/// inserts the event (see the module documentation for why this makes positions commit-ordered
/// and never reused).
pub(crate) fn last_position(tx: &Connection) -> Result<i64> {
    tx.prepare_cached(
        "SELECT max(COALESCE((SELECT max(position) FROM outbox), 0),
                    COALESCE((SELECT max(delivered_position) FROM subscriptions), 0),
                    COALESCE((SELECT CAST(value AS INTEGER) FROM meta WHERE key = 'outbox.pruned_position'), 0))",
    )
    .db()?
    .query_row([], |r| r.get(0))
    .db()
}

/// The statements of one advance batch, prepared once per batch (a `prepare_cached` per event
/// hashes the SQL text twice per statement). The flow row is written with a plain UPDATE or
/// INSERT, as the read before it found it or not (an upsert of an existing row seeks the
/// primary key twice).
struct AdvanceStatements<'c> {
    flow: rusqlite::CachedStatement<'c>,
    update_flow: rusqlite::CachedStatement<'c>,
    insert_flow: rusqlite::CachedStatement<'c>,
    insert_event: rusqlite::CachedStatement<'c>,
}

impl<'c> AdvanceStatements<'c> {
    fn prepare(tx: &'c Connection) -> Result<Self> {
        Ok(AdvanceStatements {
            flow: tx.prepare_cached("SELECT state, state_data, last_seq FROM flows WHERE flow_id = ?1").db()?,
            update_flow: tx
                .prepare_cached(
                    "UPDATE flows SET state = ?2, state_data = ?3, last_seq = ?4, updated_at_ms = ?5
                     WHERE flow_id = ?1 AND last_seq = ?4 - 1",
                )
                .db()?,
            insert_flow: tx
                .prepare_cached(
                    "INSERT INTO flows (flow_id, state, state_data, last_seq, updated_at_ms) VALUES (?1, ?2, ?3, ?4, ?5)",
                )
                .db()?,
            insert_event: tx
                .prepare_cached(
                    "INSERT INTO outbox (position, event_id, flow_id, seq, event_type, schema_version, payload,
                         content_hash, created_at_ms, generation, traceparent)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
                )
                .db()?,
        })
    }
}

/// Advance one flow. `last_position` is the last position handed out in this transaction; a
/// committed event takes the next one.
fn advance_validated(
    statements: &mut AdvanceStatements<'_>,
    last_position: &mut i64,
    identity: &ProducerIdentity,
    machine: &dyn FlowMachine,
    request: &AdvanceRequest,
    now_ms: i64,
) -> Result<AdvanceOutcome> {
    let existing: Option<(String, String, i64)> =
        statements.flow.query_row([&request.flow_id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).optional().db()?;
    let flow_exists = existing.is_some();
    let (current_seq, current) = match existing {
        Some((state, data, seq)) => {
            let data = serde_json::from_str(&data).map_err(|e| Error::store(format!("corrupt flow state: {e}")))?;
            (seq, FlowState { state, data })
        }
        None => (0, machine.initial()),
    };
    let (seq, decision) = match decide_advance(machine, current_seq, &current, request)? {
        Ok(decided) => decided,
        Err(rejection) => return Ok(rejection),
    };
    ensure_invariant!(seq == current_seq + 1, "allocated seq {seq} is not {current_seq} + 1");
    let event = Envelope {
        event_id: uuid::Uuid::now_v7().simple().to_string(),
        source: identity.source.clone(),
        generation: identity.generation.clone(),
        flow_id: request.flow_id.clone(),
        seq,
        event_type: decision.event_type,
        schema_version: request.schema_version,
        payload: decision.payload,
        created_at_ms: now_ms,
        traceparent: request.traceparent.clone(),
    };
    let state_data = decision.next.data.to_string();
    let write_flow = if flow_exists { &mut statements.update_flow } else { &mut statements.insert_flow };
    let changed = write_flow.execute(params![request.flow_id, decision.next.state, state_data, seq, now_ms]).db()?;
    ensure_invariant!(changed == 1, "writing flow {} at seq {seq} changed {changed} rows", request.flow_id);
    let position =
        last_position.checked_add(1).ok_or_else(|| Error::store("the outbox ran out of positions (i64::MAX)"))?;
    statements
        .insert_event
        .execute(params![
            position,
            event.event_id,
            event.flow_id,
            event.seq,
            event.event_type,
            event.schema_version,
            event.payload.to_string(),
            event.content_hash(),
            event.created_at_ms,
            event.generation,
            event.traceparent
        ])
        .db()?;
    *last_position = position;
    Ok(AdvanceOutcome::Committed { flow_id: event.flow_id, seq, event_id: event.event_id, state: decision.next.state })
}

/// A due delivery before its envelope is read: its key (position, subscriber) and what a relay
/// pass picks by.
struct DueKey {
    position: i64,
    consumer_id: String,
    flow_id: String,
    attempts: u32,
    endpoint: String,
}

/// The `limit` due deliveries with the smallest (position, subscriber) keys, in that order, to
/// `consumers` when given: retries whose backoff has passed, from the exception rows, and for
/// each subscriber the first `limit` events after its cursor that have no exception row (due
/// since their commit). Keys only: the envelopes are read by [`deliveries_of`] for those a pass
/// keeps.
///
/// Outbox order, not due time: a flow's earliest open event that is due always comes before its
/// later events, so a lane that holds a flow back behind it (docs/protocol.md, "Order in a
/// broker") finds it in its window however long the backlog behind it. (Keyed by due time, a
/// retry whose backoff ended after more than a window of that flow's later events were
/// committed stayed outside the window for good, behind events held back for it.)
fn due_keys(
    read: &rusqlite::Transaction<'_>,
    now_ms: i64,
    limit: usize,
    consumers: Option<&[String]>,
) -> Result<Vec<DueKey>> {
    // The subscribers asked for, as a JSON array for `json_each` (NULL: every subscriber).
    let wanted: Option<String> = consumers.map(|list| serde_json::to_string(list).expect("strings serialize"));
    let any_exceptions: bool =
        read.prepare_cached("SELECT EXISTS (SELECT 1 FROM deliveries)").db()?.query_row([], |r| r.get(0)).db()?;
    let mut keys: Vec<DueKey> = Vec::new();
    if any_exceptions {
        // (The due retries are found by `deliveries_due` and sorted by position: a plan reads
        // every due retry once, which costs only while an outage's retries are due.)
        let mut stmt = read
            .prepare_cached(
                "SELECT d.position, d.consumer_id, o.flow_id, d.attempts, s.endpoint
                 FROM deliveries d JOIN outbox o ON o.position = d.position
                 JOIN subscriptions s ON s.consumer_id = d.consumer_id
                 WHERE d.status = 'pending' AND d.next_attempt_at_ms <= ?1
                   AND (?3 IS NULL OR d.consumer_id IN (SELECT value FROM json_each(?3)))
                 ORDER BY d.position, d.consumer_id LIMIT ?2",
            )
            .db()?;
        let rows = stmt
            .query_map(params![now_ms, limit as i64, wanted], |r| {
                Ok(DueKey {
                    position: r.get(0)?,
                    consumer_id: r.get(1)?,
                    flow_id: r.get(2)?,
                    attempts: r.get(3)?,
                    endpoint: r.get(4)?,
                })
            })
            .db()?;
        for row in rows {
            keys.push(row.db()?);
        }
    }
    let cursors: Vec<(String, String, i64)> = {
        let mut stmt = read
            .prepare_cached("SELECT consumer_id, endpoint, delivered_position FROM subscriptions ORDER BY consumer_id")
            .db()?;
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).db()?;
        rows.collect::<rusqlite::Result<Vec<_>>>().db()?
    };
    // Without any exception row the fresh scan need not look for one.
    let exception_filter = if any_exceptions {
        "NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.position = o.position AND d.consumer_id = ?2)"
    } else {
        "?2 IS NOT NULL"
    };
    // A committed event is due at once, whatever its `created_at_ms` says: an event stamped by a
    // writer whose clock runs ahead of the relay's (another machine, an NTP step) is not held
    // back until the relay's clock catches up.
    let mut fresh = read
        .prepare_cached(&format!(
            "SELECT o.position, o.flow_id FROM outbox o
             WHERE o.position > ?1 AND {exception_filter}
             ORDER BY o.position LIMIT ?3"
        ))
        .db()?;
    for (consumer_id, endpoint, delivered_position) in
        cursors.iter().filter(|(c, _, _)| consumers.is_none_or(|list| list.contains(c)))
    {
        let rows = fresh
            .query_map(params![delivered_position, consumer_id, limit as i64], |r| {
                Ok(DueKey {
                    position: r.get(0)?,
                    consumer_id: consumer_id.clone(),
                    flow_id: r.get(1)?,
                    attempts: 0,
                    endpoint: endpoint.clone(),
                })
            })
            .db()?;
        for row in rows {
            keys.push(row.db()?);
        }
    }
    keys.sort_by(|a, b| (a.position, &a.consumer_id).cmp(&(b.position, &b.consumer_id)));
    keys.truncate(limit);
    Ok(keys)
}

/// The deliveries `keys` name, in their order, each with its event's envelope (read once per
/// event, by position).
fn deliveries_of(
    read: &rusqlite::Transaction<'_>,
    identity: &ProducerIdentity,
    keys: Vec<DueKey>,
) -> Result<Vec<Delivery>> {
    let mut stmt = read.prepare_cached(&format!("SELECT {EVENT_COLUMNS} FROM outbox o WHERE o.position = ?1")).db()?;
    let mut envelopes: HashMap<i64, Envelope> = HashMap::new();
    let mut deliveries = Vec::with_capacity(keys.len());
    for key in keys {
        let envelope = match envelopes.get(&key.position) {
            Some(envelope) => envelope.clone(),
            None => {
                let envelope = stmt.query_row([key.position], |r| event_from_row(identity, r, 0)).db()?;
                envelopes.insert(key.position, envelope.clone());
                envelope
            }
        };
        deliveries.push(Delivery {
            position: key.position,
            envelope,
            consumer_id: key.consumer_id,
            endpoint: key.endpoint,
            attempts: key.attempts,
        });
    }
    Ok(deliveries)
}

fn event_from_row(identity: &ProducerIdentity, r: &rusqlite::Row<'_>, at: usize) -> rusqlite::Result<Envelope> {
    let payload: String = r.get(at + 5)?;
    // An event keeps the generation it was committed under (a restored producer redelivers its
    // old events unchanged); rows written before schema v2 have none and take the current one.
    let generation: Option<String> = r.get(at + 7)?;
    Ok(Envelope {
        event_id: r.get(at)?,
        source: identity.source.clone(),
        generation: generation.unwrap_or_else(|| identity.generation.clone()),
        flow_id: r.get(at + 1)?,
        seq: r.get(at + 2)?,
        event_type: r.get(at + 3)?,
        schema_version: r.get(at + 4)?,
        payload: serde_json::from_str(&payload)
            .map_err(|e| rusqlite::Error::FromSqlConversionFailure(at + 5, rusqlite::types::Type::Text, Box::new(e)))?,
        created_at_ms: r.get(at + 6)?,
        traceparent: r.get(at + 8)?,
    })
}

const EVENT_COLUMNS: &str =
    "o.event_id, o.flow_id, o.seq, o.event_type, o.schema_version, o.payload, o.created_at_ms, o.generation, o.traceparent";
/// The number of columns in [`EVENT_COLUMNS`]: the first index of the columns a query selects
/// after them.
const EVENT_COLUMN_COUNT: usize = 9;

fn delivery_entry(r: &rusqlite::Row<'_>) -> rusqlite::Result<DeliveryEntry> {
    let status: String = r.get(4)?;
    Ok(DeliveryEntry {
        event_id: r.get(0)?,
        flow_id: r.get(1)?,
        seq: r.get(2)?,
        consumer_id: r.get(3)?,
        status: DeliveryStatus::parse(&status).unwrap_or(DeliveryStatus::Pending),
        attempts: r.get(5)?,
        next_attempt_at_ms: r.get(6)?,
        last_error: r.get(7)?,
        updated_at_ms: r.get(8)?,
    })
}

/// Every delivery (one per outbox event and subscriber from its `from_position` on), merged from
/// the subscriber's cursor and the exception rows. A delivery without an exception row is
/// `accepted` at or below the cursor and `pending` above it, with no attempts, due and last
/// changed when its event was committed. Columns as [`delivery_entry`] reads them, then the
/// position.
const DELIVERY_VIEW: &str =
    "SELECT event_id, flow_id, seq, consumer_id, status, attempts, next_attempt_at_ms, last_error,
        updated_at_ms, position FROM (
    SELECT o.event_id AS event_id, o.flow_id AS flow_id, o.seq AS seq, s.consumer_id AS consumer_id,
        COALESCE(d.status, CASE WHEN o.position <= s.delivered_position THEN 'accepted' ELSE 'pending' END) AS status,
        COALESCE(d.attempts, 0) AS attempts, COALESCE(d.next_attempt_at_ms, o.created_at_ms) AS next_attempt_at_ms,
        d.last_error AS last_error, COALESCE(d.updated_at_ms, o.created_at_ms) AS updated_at_ms, o.position AS position
    FROM outbox o JOIN subscriptions s ON s.from_position <= o.position
    LEFT JOIN deliveries d ON d.position = o.position AND d.consumer_id = s.consumer_id)";

fn delivery_on(conn: &Connection, event_id: &str, consumer_id: &str) -> Result<Option<DeliveryEntry>> {
    conn.prepare_cached(&format!("{DELIVERY_VIEW} WHERE event_id = ?1 AND consumer_id = ?2"))
        .db()?
        .query_row([event_id, consumer_id], delivery_entry)
        .optional()
        .db()
}

/// Rows the cursor walk of one recording may read beyond the batch's own deliveries (exception
/// rows it passes).
const CURSOR_WALK_ROWS_EXTRA: usize = 4_096;

/// Check that the outbox holds `event_id` at `position` (a delivery result names both; a
/// mismatch is a bug in the caller and nothing is recorded) and return the event's commit time.
/// Every write of an exception row goes through it; passing the cursor needs no check, as the
/// cursor walk moves only across positions that exist.
fn checked_commit_time(stmt: &mut rusqlite::CachedStatement<'_>, position: i64, event_id: &str) -> Result<i64> {
    let created_at_ms: Option<i64> = stmt.query_row(params![position, event_id], |r| r.get(0)).optional().db()?;
    created_at_ms.ok_or_else(|| {
        Error::Invariant(format!("delivery result names position {position}, which does not hold event {event_id}"))
    })
}

/// How many events `consumer_id` has accepted (custody moved to its endpoint); `None` when it is
/// not subscribed. Counts events the outbox no longer holds too: the cursor remembers them.
fn accepted_by(conn: &Connection, consumer_id: &str) -> Result<Option<u64>> {
    conn.query_row(
        "SELECT (s.delivered_position - s.from_position + 1)
                - (SELECT count(*) FROM deliveries d WHERE d.consumer_id = s.consumer_id
                      AND d.position <= s.delivered_position AND d.status <> 'accepted')
                + (SELECT count(*) FROM deliveries d WHERE d.consumer_id = s.consumer_id
                      AND d.position > s.delivered_position AND d.status = 'accepted')
         FROM subscriptions s WHERE s.consumer_id = ?1",
        [consumer_id],
        |r| r.get::<_, i64>(0),
    )
    .optional()
    .db()?
    .map(|accepted| {
        u64::try_from(accepted)
            .map_err(|_| Error::Invariant(format!("subscriber {consumer_id:?} has accepted {accepted} events")))
    })
    .transpose()
}

/// A subscriber's cursor while a relay batch is recorded.
struct CursorMove<'r> {
    from_position: i64,
    delivered_position: i64,
    /// Positions above the cursor accepted in this batch, with their event ids.
    accepted: std::collections::BTreeMap<i64, &'r str>,
}

impl SqliteProducer {
    /// Rename a subscriber (the producer half of `rename-consumer`). Idempotent: renaming an id
    /// that is already renamed is a no-op.
    pub fn rename_subscription(&mut self, from: &str, to: &str) -> Result<u64> {
        validate_id("from", from)?;
        validate_id("to", to)?;
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        let exists_to: bool =
            tx.query_row("SELECT count(*) FROM subscriptions WHERE consumer_id = ?1", [to], |r| r.get(0)).db()?;
        let exists_from: bool =
            tx.query_row("SELECT count(*) FROM subscriptions WHERE consumer_id = ?1", [from], |r| r.get(0)).db()?;
        if !exists_from {
            if exists_to {
                return Ok(0);
            }
            return Err(Error::not_found(format!("no subscription for consumer {from:?}")));
        }
        if exists_to {
            return Err(Error::invalid(codes::ALREADY_EXISTS, format!("a subscription for {to:?} already exists")));
        }
        // Every delivery of `from` moves: one per event from its `from_position` on (the cursor
        // and the exception rows travel with the subscription).
        let moved: i64 = tx
            .query_row(
                "SELECT count(*) FROM outbox WHERE position >= (SELECT from_position FROM subscriptions WHERE consumer_id = ?1)",
                [from],
                |r| r.get(0),
            )
            .db()?;
        tx.execute("UPDATE subscriptions SET consumer_id = ?2 WHERE consumer_id = ?1", [from, to]).db()?;
        tx.execute("UPDATE deliveries SET consumer_id = ?2 WHERE consumer_id = ?1", [from, to]).db()?;
        tx.commit().db()?;
        Ok(moved as u64)
    }

    /// [`ProducerStore::subscribe`], and when the subscription exists with another endpoint (a
    /// move), refuse it with `invalid_state_change` if the subscriber has accepted events and
    /// `new_endpoint_has_received` is `Some(false)`: the new database holds nothing of it, so
    /// every flow under way would stop at a gap there. Checked in the subscribe transaction, so
    /// a relay accepting its first event meanwhile cannot slip past.
    pub fn subscribe_checked(
        &mut self,
        subscription: &Subscription,
        from_start: bool,
        now_ms: i64,
        new_endpoint_has_received: Option<bool>,
    ) -> Result<u64> {
        validate_id("consumer_id", &subscription.consumer_id)?;
        Endpoint::parse(&subscription.endpoint)?;
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        let existing: Option<String> = tx
            .query_row("SELECT endpoint FROM subscriptions WHERE consumer_id = ?1", [&subscription.consumer_id], |r| {
                r.get(0)
            })
            .optional()
            .db()?;
        let queued = match existing {
            Some(endpoint) if endpoint == subscription.endpoint => 0,
            Some(_) => {
                if new_endpoint_has_received == Some(false) {
                    let accepted = accepted_by(&tx, &subscription.consumer_id)?.unwrap_or(0);
                    if accepted > 0 {
                        return Err(Error::invalid(
                            codes::INVALID_STATE_CHANGE,
                            format!(
                                "{:?} has accepted {accepted} events at its current endpoint, and {} has received \
                                 nothing of it from {:?}: moved there, every flow under way would stop at a gap. \
                                 Copy the consumer database (with its -wal file) to the new place and subscribe \
                                 that copy, or subscribe a new consumer id with --from-start",
                                subscription.consumer_id, subscription.endpoint, self.identity.source
                            ),
                        ));
                    }
                }
                tx.execute(
                    "UPDATE subscriptions SET endpoint = ?2 WHERE consumer_id = ?1",
                    [&subscription.consumer_id, &subscription.endpoint],
                )
                .db()?;
                0
            }
            None => {
                // From the start: every event still in the outbox is pending for it. Otherwise
                // it receives events committed from now on: its cursor starts at the last
                // position handed out.
                let (from_position, queued) = if from_start {
                    (1, tx.query_row("SELECT count(*) FROM outbox", [], |r| r.get::<_, i64>(0)).db()? as u64)
                } else {
                    (last_position(&tx)? + 1, 0)
                };
                tx.execute(
                    "INSERT INTO subscriptions (consumer_id, endpoint, created_at_ms, from_position, delivered_position)
                     VALUES (?1, ?2, ?3, ?4, ?4 - 1)",
                    params![subscription.consumer_id, subscription.endpoint, now_ms, from_position],
                )
                .db()?;
                queued
            }
        };
        tx.commit().db()?;
        Ok(queued)
    }

    /// Counts of deliveries by status (for snapshots and metrics).
    pub fn delivery_counts(&self) -> Result<Vec<(String, i64)>> {
        let mut stmt = self
            .conn
            .prepare(&format!("SELECT status, count(*) FROM ({DELIVERY_VIEW}) GROUP BY status ORDER BY status"))
            .db()?;
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).db()?;
        rows.collect::<rusqlite::Result<Vec<_>>>().db()
    }
}

impl ProducerStore for SqliteProducer {
    fn identity(&self) -> &ProducerIdentity {
        &self.identity
    }

    fn advance_batch(
        &mut self,
        machine: &dyn FlowMachine,
        requests: &[AdvanceRequest],
        now_ms: i64,
    ) -> Result<Vec<AdvanceOutcome>> {
        validate_limit("advance batch", requests.len(), ADVANCE_BATCH_MAX)?;
        for request in requests {
            validate_request(machine, request)?;
        }
        let tx = self.begin()?;
        let mut outcomes = Vec::with_capacity(requests.len());
        {
            let mut statements = AdvanceStatements::prepare(&tx.tx)?;
            let mut position = last_position(&tx.tx)?;
            for request in requests {
                outcomes.push(advance_validated(
                    &mut statements,
                    &mut position,
                    tx.identity,
                    machine,
                    request,
                    now_ms,
                )?);
            }
        }
        tx.commit()?;
        Ok(outcomes)
    }

    fn subscribe(&mut self, subscription: &Subscription, from_start: bool, now_ms: i64) -> Result<u64> {
        self.subscribe_checked(subscription, from_start, now_ms, None)
    }

    fn subscriptions(&self) -> Result<Vec<Subscription>> {
        let mut stmt =
            self.conn.prepare_cached("SELECT consumer_id, endpoint FROM subscriptions ORDER BY consumer_id").db()?;
        let rows = stmt.query_map([], |r| Ok(Subscription { consumer_id: r.get(0)?, endpoint: r.get(1)? })).db()?;
        rows.collect::<rusqlite::Result<Vec<_>>>().db()
    }

    fn due_deliveries(
        &mut self,
        now_ms: i64,
        limit: usize,
        event_id: Option<&str>,
        consumers: Option<&[String]>,
    ) -> Result<Vec<Delivery>> {
        validate_limit("relay limit", limit, RELAY_BATCH_EVENTS_MAX * 4)?;
        // The subscribers asked for, as a JSON array for `json_each` (NULL: every subscriber).
        let wanted: Option<String> = consumers.map(|list| serde_json::to_string(list).expect("strings serialize"));
        const WANTED: &str = "(?9 IS NULL OR {column} IN (SELECT value FROM json_each(?9)))";
        let identity = &self.identity;
        let map = |r: &rusqlite::Row<'_>| -> rusqlite::Result<Delivery> {
            Ok(Delivery {
                position: r.get(EVENT_COLUMN_COUNT + 4)?,
                envelope: event_from_row(identity, r, 0)?,
                consumer_id: r.get(EVENT_COLUMN_COUNT)?,
                attempts: r.get(EVENT_COLUMN_COUNT + 1)?,
                endpoint: r.get(EVENT_COLUMN_COUNT + 2)?,
            })
        };
        if let Some(event_id) = event_id {
            validate_id("event_id", event_id)?;
            // That event's pending or quarantined deliveries, due or not: exception rows in
            // those states, and subscribers whose cursor has not passed it yet.
            let mut stmt = self
                .conn
                .prepare_cached(&format!(
                    "SELECT {EVENT_COLUMNS}, s.consumer_id, COALESCE(d.attempts, 0), s.endpoint, 0, o.position
                     FROM outbox o JOIN subscriptions s ON s.from_position <= o.position
                     LEFT JOIN deliveries d ON d.position = o.position AND d.consumer_id = s.consumer_id
                     WHERE o.event_id = ?1 AND {wanted}
                       AND (d.status = 'pending' OR d.status = 'quarantined'
                            OR (d.status IS NULL AND o.position > s.delivered_position))
                     ORDER BY s.consumer_id LIMIT ?2",
                    wanted = WANTED.replace("{column}", "s.consumer_id").replace("?9", "?3")
                ))
                .db()?;
            let rows = stmt.query_map(params![event_id, limit as i64, wanted], map).db()?;
            return rows.collect::<rusqlite::Result<Vec<_>>>().db();
        }
        // One read transaction, so that cursors, exception rows and events are read as of one
        // moment.
        let read = self.conn.unchecked_transaction().db()?;
        let keys = due_keys(&read, now_ms, limit, consumers)?;
        let deliveries = deliveries_of(&read, &self.identity, keys)?;
        read.finish().db()?;
        Ok(deliveries)
    }

    fn pick_due(&mut self, query: &DueQuery<'_>) -> Result<Vec<Delivery>> {
        validate_limit("relay limit", query.window, RELAY_BATCH_EVENTS_MAX * 4)?;
        // The candidates' keys first, the envelopes of the picked ones only.
        let read = self.conn.unchecked_transaction().db()?;
        let mut keys = due_keys(&read, query.now_ms, query.window, query.consumers)?;
        leave_out(&mut keys, query.in_flight, |k| (k.position, k.consumer_id.as_str()));
        // One source per outbox: the flow alone tells flows apart.
        let picked = round_robin(keys, query.pick, |k| ("", k.flow_id.as_str()));
        let deliveries = deliveries_of(&read, &self.identity, picked)?;
        read.finish().db()?;
        Ok(deliveries)
    }

    fn overtaking(&mut self, batch: &[Delivery], in_flight: &[(i64, String)]) -> Result<Vec<(i64, String)>> {
        // Per subscriber of the batch: the open deliveries above its cursor up to the batch's
        // highest position (the backlog a plan reads from, one range of the outbox), and the
        // open exception rows at or below its cursor (retries the cursor has passed).
        let mut highest: std::collections::BTreeMap<&str, i64> = std::collections::BTreeMap::new();
        for delivery in batch {
            let entry = highest.entry(delivery.consumer_id.as_str()).or_insert(delivery.position);
            *entry = (*entry).max(delivery.position);
        }
        let read = self.conn.unchecked_transaction().db()?;
        let mut open = Vec::new();
        {
            let mut above = read
                .prepare_cached(
                    "SELECT o.position, o.flow_id, o.seq FROM subscriptions s
                     JOIN outbox o ON o.position > max(s.delivered_position, s.from_position - 1) AND o.position < ?2
                     LEFT JOIN deliveries d ON d.position = o.position AND d.consumer_id = s.consumer_id
                     WHERE s.consumer_id = ?1 AND (d.status IS NULL OR d.status = 'pending' OR d.status = 'quarantined')",
                )
                .db()?;
            let mut below = read
                .prepare_cached(
                    "SELECT d.position, o.flow_id, o.seq FROM subscriptions s
                     JOIN deliveries d ON d.consumer_id = s.consumer_id AND d.position <= s.delivered_position
                     JOIN outbox o ON o.position = d.position
                     WHERE s.consumer_id = ?1 AND (d.status = 'pending' OR d.status = 'quarantined')",
                )
                .db()?;
            let row = |r: &rusqlite::Row<'_>| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?, r.get::<_, i64>(2)?));
            for (consumer_id, max_position) in &highest {
                let rows = above.query_map(params![consumer_id, max_position], row).db()?;
                for r in rows {
                    let (position, flow_id, seq) = r.db()?;
                    open.push((consumer_id.to_string(), position, flow_id, seq));
                }
                let rows = below.query_map(params![consumer_id], row).db()?;
                for r in rows {
                    let (position, flow_id, seq) = r.db()?;
                    open.push((consumer_id.to_string(), position, flow_id, seq));
                }
            }
        }
        read.finish().db()?;
        Ok(tidemark_core::store::overtaking_of(batch, in_flight, open))
    }

    fn record_deliveries(&mut self, results: &[DeliveryResult], now_ms: i64) -> Result<()> {
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        {
            // Only for exception rows (see `checked_commit_time`).
            let mut commit_time =
                tx.prepare_cached("SELECT created_at_ms FROM outbox WHERE position = ?1 AND event_id = ?2").db()?;
            let mut exception =
                tx.prepare_cached("SELECT 1 FROM deliveries WHERE position = ?1 AND consumer_id = ?2").db()?;
            let mut cursor_of = tx
                .prepare_cached("SELECT from_position, delivered_position FROM subscriptions WHERE consumer_id = ?1")
                .db()?;
            // Exception rows change only while pending or quarantined (as before: an accepted or
            // dismissed delivery stays so).
            let mut accept = tx
                .prepare_cached(
                    "UPDATE deliveries SET status = 'accepted', last_error = NULL, updated_at_ms = ?3
                     WHERE position = ?1 AND consumer_id = ?2 AND (status = 'pending' OR status = 'quarantined')",
                )
                .db()?;
            let mut retry = tx
                .prepare_cached(
                    "UPDATE deliveries SET attempts = attempts + 1, next_attempt_at_ms = ?4, last_error = ?3, updated_at_ms = ?5,
                         status = 'pending'
                     WHERE position = ?1 AND consumer_id = ?2 AND (status = 'pending' OR status = 'quarantined')",
                )
                .db()?;
            let mut quarantine = tx
                .prepare_cached(
                    "UPDATE deliveries SET attempts = attempts + 1, status = 'quarantined', last_error = ?3, updated_at_ms = ?4
                     WHERE position = ?1 AND consumer_id = ?2 AND (status = 'pending' OR status = 'quarantined')",
                )
                .db()?;
            let mut insert = tx
                .prepare_cached(
                    "INSERT INTO deliveries (position, consumer_id, status, attempts, next_attempt_at_ms, last_error, updated_at_ms)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                )
                .db()?;
            // Most of the time no delivery has an exception row: then neither the per-result
            // probe nor the cursor walk needs to look for one.
            let any_exceptions: bool =
                tx.prepare_cached("SELECT EXISTS (SELECT 1 FROM deliveries)").db()?.query_row([], |r| r.get(0)).db()?;
            let mut cursors: HashMap<&str, Option<CursorMove>> = HashMap::new();
            for result in results {
                // The position is the one `due_deliveries` handed out.
                let (position, event_id, consumer) =
                    (result.position, result.event_id.as_str(), result.consumer_id.as_str());
                if any_exceptions && exception.exists(params![position, consumer]).db()? {
                    checked_commit_time(&mut commit_time, position, event_id)?;
                    match &result.verdict {
                        DeliveryVerdict::Accepted => accept.execute(params![position, consumer, now_ms]).db()?,
                        DeliveryVerdict::Retry { reason, next_attempt_at_ms } => {
                            retry.execute(params![position, consumer, reason, next_attempt_at_ms, now_ms]).db()?
                        }
                        DeliveryVerdict::Quarantine { reason } => {
                            quarantine.execute(params![position, consumer, reason, now_ms]).db()?
                        }
                    };
                    continue;
                }
                if !cursors.contains_key(consumer) {
                    let cursor = cursor_of.query_row([consumer], |r| Ok((r.get(0)?, r.get(1)?))).optional().db()?.map(
                        |(from_position, delivered_position)| CursorMove {
                            from_position,
                            delivered_position,
                            accepted: Default::default(),
                        },
                    );
                    cursors.insert(consumer, cursor);
                }
                // No exception row: accepted at or below the cursor (nothing to change), not
                // subscribed below `from_position`, pending above the cursor.
                let Some(Some(cursor)) = cursors.get_mut(consumer) else { continue };
                if position < cursor.from_position || position <= cursor.delivered_position {
                    continue;
                }
                match &result.verdict {
                    DeliveryVerdict::Accepted => {
                        cursor.accepted.insert(position, event_id);
                    }
                    DeliveryVerdict::Retry { reason, next_attempt_at_ms } => {
                        checked_commit_time(&mut commit_time, position, event_id)?;
                        insert
                            .execute(params![position, consumer, "pending", 1, next_attempt_at_ms, reason, now_ms])
                            .db()?;
                    }
                    DeliveryVerdict::Quarantine { reason } => {
                        let created_at_ms = checked_commit_time(&mut commit_time, position, event_id)?;
                        insert
                            .execute(params![position, consumer, "quarantined", 1, created_at_ms, reason, now_ms])
                            .db()?;
                    }
                }
            }
            // Move each cursor across the positions right above it that are settled: accepted in
            // this batch, or holding an exception row (retrying, quarantined, ...). It stops at the
            // first position that is still plainly pending. Reads are in this write transaction,
            // so every row it walks over is committed and no lower position can appear later.
            let mut walk = tx
                .prepare_cached(if any_exceptions {
                    "SELECT o.position, EXISTS (SELECT 1 FROM deliveries d WHERE d.position = o.position AND d.consumer_id = ?2)
                     FROM outbox o WHERE o.position > ?1 ORDER BY o.position LIMIT ?3"
                } else {
                    "SELECT o.position, ?2 IS NULL FROM outbox o WHERE o.position > ?1 ORDER BY o.position LIMIT ?3"
                })
                .db()?;
            let mut move_cursor =
                tx.prepare_cached("UPDATE subscriptions SET delivered_position = ?2 WHERE consumer_id = ?1").db()?;
            for (consumer, cursor) in cursors {
                let Some(mut cursor) = cursor else { continue };
                if cursor.accepted.is_empty() {
                    continue;
                }
                let start = cursor.delivered_position;
                let rows_max = (cursor.accepted.len() + CURSOR_WALK_ROWS_EXTRA) as i64;
                let mut rows = walk.query(params![start, consumer, rows_max]).db()?;
                while let Some(r) = rows.next().db()? {
                    let (position, has_exception): (i64, bool) = (r.get(0).db()?, r.get(1).db()?);
                    if cursor.accepted.remove(&position).is_none() && !has_exception {
                        break;
                    }
                    cursor.delivered_position = position;
                }
                drop(rows);
                ensure_invariant!(cursor.delivered_position >= start, "a delivery cursor moved backwards");
                if cursor.delivered_position > start {
                    move_cursor.execute(params![consumer, cursor.delivered_position]).db()?;
                }
                // Accepted beyond a position that is still pending (the relay picked round-robin,
                // not a prefix): an exception row that reads exactly like a cursor-accepted one.
                for (position, event_id) in cursor.accepted {
                    let created_at_ms = checked_commit_time(&mut commit_time, position, event_id)?;
                    insert
                        .execute(params![
                            position,
                            consumer,
                            "accepted",
                            0,
                            created_at_ms,
                            Option::<String>::None,
                            created_at_ms
                        ])
                        .db()?;
                }
            }
        }
        crash::hit("relay.before_producer_commit");
        tx.commit().db()?;
        crash::hit("relay.after_producer_commit");
        Ok(())
    }

    fn deliveries(&self, status: Option<DeliveryStatus>, limit: usize) -> Result<Vec<DeliveryEntry>> {
        validate_limit("page size", limit, PAGE_SIZE_MAX)?;
        let mut stmt = self
            .conn
            .prepare_cached(&format!(
                "{DELIVERY_VIEW} WHERE ?1 IS NULL OR status = ?1 ORDER BY position, consumer_id LIMIT ?2"
            ))
            .db()?;
        let rows = stmt.query_map(params![status.map(DeliveryStatus::as_str), limit as i64], delivery_entry).db()?;
        rows.collect::<rusqlite::Result<Vec<_>>>().db()
    }

    fn resolve_delivery(
        &mut self,
        event_id: &str,
        consumer_id: &str,
        action: DeliveryAction,
        reason: &str,
        now_ms: i64,
    ) -> Result<DeliveryEntry> {
        validate_id("event_id", event_id)?;
        validate_id("consumer_id", consumer_id)?;
        validate_reason(reason)?;
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        let Some(current) = delivery_on(&tx, event_id, consumer_id)? else {
            return Err(Error::not_found(format!("no delivery of event {event_id} to consumer {consumer_id}")));
        };
        let allowed = match action {
            DeliveryAction::Requeue => {
                matches!(current.status, DeliveryStatus::Quarantined | DeliveryStatus::Dismissed)
            }
            DeliveryAction::Dismiss => matches!(current.status, DeliveryStatus::Quarantined | DeliveryStatus::Pending),
        };
        if !allowed {
            return Err(Error::invalid(
                codes::INVALID_STATE_CHANGE,
                format!("cannot {action:?} a delivery that is {}", current.status.as_str()),
            ));
        }
        let note =
            format!("operator {}: {reason}", if action == DeliveryAction::Requeue { "requeued" } else { "dismissed" });
        // A quarantined or dismissed delivery always has an exception row; a pending one may be
        // plain (above the cursor), and dismissing it writes its exception row.
        let sql = match action {
            DeliveryAction::Requeue => {
                "UPDATE deliveries SET status = 'pending', attempts = 0, next_attempt_at_ms = ?3, last_error = ?4, updated_at_ms = ?3
                 WHERE position = (SELECT position FROM outbox WHERE event_id = ?1) AND consumer_id = ?2"
            }
            DeliveryAction::Dismiss => {
                "INSERT INTO deliveries (position, consumer_id, status, attempts, next_attempt_at_ms, last_error, updated_at_ms)
                 SELECT position, ?2, 'dismissed', 0, created_at_ms, ?4, ?3 FROM outbox WHERE event_id = ?1
                 ON CONFLICT (position, consumer_id) DO UPDATE SET status = 'dismissed', last_error = excluded.last_error,
                     updated_at_ms = excluded.updated_at_ms"
            }
        };
        let changed = tx.execute(sql, params![event_id, consumer_id, now_ms, note]).db()?;
        ensure_invariant!(changed == 1, "resolve changed {changed} delivery rows");
        crash::hit("resolve.before_commit");
        let resolved = delivery_on(&tx, event_id, consumer_id)?;
        tx.commit().db()?;
        resolved.ok_or_else(|| Error::Invariant("resolved delivery vanished".into()))
    }

    fn redeliver(&mut self, consumer_id: &str, from_event_id: Option<&str>) -> Result<RedeliverReport> {
        validate_id("consumer_id", consumer_id)?;
        if let Some(event_id) = from_event_id {
            validate_id("event_id", event_id)?;
        }
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        let Some(from_position) = tx
            .query_row("SELECT from_position FROM subscriptions WHERE consumer_id = ?1", [consumer_id], |r| {
                r.get::<_, i64>(0)
            })
            .optional()
            .db()?
        else {
            return Err(Error::not_found(format!("no subscription for consumer {consumer_id:?}")));
        };
        let chosen: Option<i64> = match from_event_id {
            Some(event_id) => Some(
                tx.query_row("SELECT position FROM outbox WHERE event_id = ?1", [event_id], |r| r.get(0))
                    .optional()
                    .db()?
                    .ok_or_else(|| Error::not_found(format!("the outbox holds no event {event_id}")))?,
            ),
            None => tx.query_row("SELECT min(position) FROM outbox", [], |r| r.get(0)).db()?,
        };
        let newest: Option<i64> = tx.query_row("SELECT max(position) FROM outbox", [], |r| r.get(0)).db()?;
        let (Some(chosen), Some(newest)) = (chosen, newest) else {
            return Ok(RedeliverReport::default());
        };
        let held: i64 =
            tx.query_row("SELECT count(*) FROM outbox WHERE position >= ?1", [chosen], |r| r.get(0)).db()?;
        // The subscriber's deliveries from `start` on: no exception rows, the cursor below them.
        let start = chosen.max(from_position);
        tx.execute("DELETE FROM deliveries WHERE consumer_id = ?1 AND position >= ?2", params![consumer_id, start])
            .db()?;
        tx.execute(
            "UPDATE subscriptions SET delivered_position = min(delivered_position, ?2 - 1) WHERE consumer_id = ?1",
            params![consumer_id, start],
        )
        .db()?;
        let redelivered: i64 =
            tx.query_row("SELECT count(*) FROM outbox WHERE position >= ?1", [start], |r| r.get(0)).db()?;
        crash::hit("redeliver.before_commit");
        tx.commit().db()?;
        Ok(RedeliverReport { redelivered: redelivered as u64, pruned: (newest - chosen + 1 - held) as u64 })
    }

    fn flow(&self, flow_id: &str) -> Result<Option<FlowRecord>> {
        validate_id("flow_id", flow_id)?;
        let row: Option<(String, String, i64)> = self
            .conn
            .prepare_cached("SELECT state, state_data, last_seq FROM flows WHERE flow_id = ?1")
            .db()?
            .query_row([flow_id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .optional()
            .db()?;
        row.map(|(state, data, last_seq)| {
            let data = serde_json::from_str(&data).map_err(|e| Error::store(format!("corrupt flow state: {e}")))?;
            Ok(FlowRecord { flow_id: flow_id.to_string(), last_seq, state: FlowState { state, data } })
        })
        .transpose()
    }

    fn prune_delivered(&mut self, retention_ms: i64, batch_rows: usize, now_ms: i64) -> Result<OutboxPruneReport> {
        validate_limit("prune batch", batch_rows, PRUNE_BATCH_ROWS_MAX)?;
        if retention_ms < 0 {
            return Err(Error::invalid(codes::INVALID_ARGUMENT, "delivered retention must be >= 0"));
        }
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        // Oldest first: positions follow commit order, so the walk goes by position and stops at
        // the first event written at or after the cutoff (no age index; see
        // `retention_walk_stops_at`). An event with any unsettled delivery stays, whatever its
        // age, and the walk passes over it.
        // Unsettled for a subscriber: a pending or quarantined exception row, or no row and above
        // its cursor. Each event counts one delivery per subscriber from its `from_position`.
        let cutoff = now_ms.saturating_sub(retention_ms);
        let mut positions: Vec<(i64, i64)> = Vec::new();
        {
            let mut stmt = tx
                .prepare_cached(
                    "SELECT o.position, o.created_at_ms,
                            NOT EXISTS (
                                SELECT 1 FROM subscriptions s
                                LEFT JOIN deliveries d ON d.position = o.position AND d.consumer_id = s.consumer_id
                                WHERE s.from_position <= o.position
                                  AND (d.status = 'pending' OR d.status = 'quarantined'
                                       OR (d.status IS NULL AND o.position > s.delivered_position))),
                            (SELECT count(*) FROM subscriptions s WHERE s.from_position <= o.position)
                     FROM outbox o ORDER BY o.position",
                )
                .db()?;
            let mut rows = stmt.query([]).db()?;
            while positions.len() < batch_rows {
                let Some(row) = rows.next().db()? else { break };
                let created_at_ms: i64 = row.get(1).db()?;
                if retention_walk_stops_at(created_at_ms, cutoff, now_ms) {
                    break;
                }
                if created_at_ms < cutoff && row.get::<_, bool>(2).db()? {
                    positions.push((row.get(0).db()?, row.get(3).db()?));
                }
            }
        }
        let mut deliveries_deleted = 0;
        for (position, deliveries) in &positions {
            deliveries_deleted += *deliveries as usize;
            tx.prepare_cached("DELETE FROM deliveries WHERE position = ?1").db()?.execute([position]).db()?;
            let deleted = tx.prepare_cached("DELETE FROM outbox WHERE position = ?1").db()?.execute([position]).db()?;
            ensure_invariant!(deleted == 1, "pruning outbox position {position} deleted {deleted} rows");
        }
        // The newest event pruned may lie above every cursor (accepted ahead of the cursor, or
        // dismissed): remember its position, so the next advance does not hand it out again.
        if let Some(&(pruned_max, _)) = positions.last() {
            tx.prepare_cached(
                "INSERT INTO meta (key, value) VALUES ('outbox.pruned_position', ?1)
                 ON CONFLICT (key) DO UPDATE SET value = max(CAST(value AS INTEGER), CAST(excluded.value AS INTEGER))",
            )
            .db()?
            .execute([pruned_max.to_string()])
            .db()?;
        }
        crash::hit("prune.before_commit");
        tx.commit().db()?;
        crash::hit("prune.after_commit");
        Ok(OutboxPruneReport {
            events_deleted: positions.len() as u64,
            deliveries_deleted: deliveries_deleted as u64,
            more: positions.len() == batch_rows,
        })
    }

    fn snapshot(&self, rows_max: usize) -> Result<ProducerSnapshot> {
        let tx = self.conn.unchecked_transaction().db()?;
        let limit = rows_max as i64;
        let subscriptions = self.subscriptions()?;
        let flows = {
            let mut stmt =
                tx.prepare("SELECT flow_id, state, state_data, last_seq FROM flows ORDER BY flow_id LIMIT ?1").db()?;
            let rows = stmt
                .query_map([limit], |r| {
                    let data: String = r.get(2)?;
                    Ok(FlowRecord {
                        flow_id: r.get(0)?,
                        last_seq: r.get(3)?,
                        state: FlowState { state: r.get(1)?, data: serde_json::from_str(&data).unwrap_or_default() },
                    })
                })
                .db()?;
            rows.collect::<rusqlite::Result<Vec<_>>>().db()?
        };
        let outbox = {
            let mut stmt =
                tx.prepare(&format!("SELECT {EVENT_COLUMNS} FROM outbox o ORDER BY o.position LIMIT ?1")).db()?;
            let rows = stmt.query_map([limit], |r| event_from_row(&self.identity, r, 0)).db()?;
            rows.collect::<rusqlite::Result<Vec<_>>>().db()?
        };
        let deliveries = {
            let mut stmt = tx.prepare(&format!("{DELIVERY_VIEW} ORDER BY position, consumer_id LIMIT ?1")).db()?;
            let rows = stmt.query_map([limit], delivery_entry).db()?;
            rows.collect::<rusqlite::Result<Vec<_>>>().db()?
        };
        tx.finish().db()?;
        Ok(ProducerSnapshot { identity: self.identity.clone(), subscriptions, flows, outbox, deliveries })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidemark_core::reservation::ReservationMachine;

    fn reserve(flow: &str) -> AdvanceRequest {
        AdvanceRequest {
            flow_id: flow.into(),
            expected_seq: 0,
            to_state: "reserved".into(),
            input: serde_json::json!({"quantity": 3}),
            schema_version: 1,
            traceparent: None,
        }
    }

    /// The trace context of an advance rides with its event: outbox, delivery, inbox, handler;
    /// it is not content, so the same event with another trace context is a duplicate.
    #[test]
    fn a_trace_context_travels_from_the_advance_to_the_handler() {
        use crate::SqliteConsumer;
        use tidemark_core::policy::RetentionPolicy;
        use tidemark_core::store::{ConsumerStore, DrainScope, HandleError, Handler, ReceiveOutcome};
        const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        struct Seen(Vec<Option<String>>);
        impl Handler<Connection> for Seen {
            fn handle(&mut self, _: &Connection, _: &str, event: &Envelope) -> Result<(), HandleError> {
                self.0.push(event.traceparent.clone());
                Ok(())
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let mut producer = SqliteProducer::init(&dir.path().join("p.db"), "shop").unwrap();
        producer.subscribe(&Subscription { consumer_id: "audit".into(), endpoint: "a.db".into() }, true, 0).unwrap();
        let traced = reserve("a").with_traceparent(TRACEPARENT);
        producer.advance_batch(&ReservationMachine, &[traced, reserve("b")], 1).unwrap();
        let due = producer.due_deliveries(10, 10, None, None).unwrap();
        let carried: Vec<_> = due.iter().map(|d| d.envelope.traceparent.as_deref()).collect();
        assert_eq!(carried, [Some(TRACEPARENT), None]);
        let mut consumer = SqliteConsumer::init(&dir.path().join("c.db"), RetentionPolicy::default()).unwrap();
        let items: Vec<(&str, &Envelope)> = due.iter().map(|d| ("audit", &d.envelope)).collect();
        let outcomes = consumer.receive_batch(&items, 2).unwrap();
        assert!(outcomes.iter().all(|o| matches!(o, ReceiveOutcome::Accepted { .. })), "{outcomes:?}");
        // The same event again with another trace context is the same event: a duplicate.
        let mut again = due[1].envelope.clone();
        again.traceparent = Some(TRACEPARENT.into());
        let outcome = consumer.receive_batch(&[("audit", &again)], 3).unwrap();
        assert!(matches!(outcome[0], ReceiveOutcome::Duplicate { .. }), "{outcome:?}");
        let mut seen = Seen(Vec::new());
        consumer.drain("audit", &DrainScope::All, 10, &mut seen, 4).unwrap();
        assert_eq!(seen.0, [Some(TRACEPARENT.to_string()), None]);
        let records = consumer.inbox("audit", None, 10).unwrap();
        assert_eq!(records[0].envelope.traceparent.as_deref(), Some(TRACEPARENT));
    }

    #[test]
    fn events_keep_the_generation_they_were_committed_under() {
        let dir = tempfile::tempdir().unwrap();
        let mut producer = SqliteProducer::init(&dir.path().join("p.db"), "shop").unwrap();
        let first = producer.identity().generation.clone();
        producer.advance_batch(&ReservationMachine, &[reserve("a")], 1).unwrap();
        let second = producer.rotate_generation().unwrap().generation;
        producer.advance_batch(&ReservationMachine, &[reserve("b")], 2).unwrap();
        let outbox = producer.snapshot(10).unwrap().outbox;
        assert_eq!(outbox[0].generation, first, "an old event is redelivered unchanged after a rotation");
        assert_eq!(outbox[1].generation, second);
        let due = producer.due_deliveries(10, 10, None, None).unwrap();
        assert!(due.is_empty(), "no subscribers, nothing due");
    }

    #[test]
    fn a_verdict_is_recorded_at_the_position_it_was_handed_out_for() {
        let dir = tempfile::tempdir().unwrap();
        let mut producer = SqliteProducer::init(&dir.path().join("p.db"), "shop").unwrap();
        let subscription = Subscription { consumer_id: "audit".into(), endpoint: "a.db".into() };
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
        // A retry names the wrong position: refused as a bug, and nothing is written.
        let retry = DeliveryVerdict::Retry { reason: "down".into(), next_attempt_at_ms: 5 };
        let error = producer.record_deliveries(&[result(&due[0], 2, retry.clone())], 2).unwrap_err();
        assert!(matches!(error, Error::Invariant(_)), "{error:?}");
        assert_eq!(producer.delivery_counts().unwrap(), [("pending".to_string(), 2)]);
        // The second event accepted before the first: an exception row at its own position; then
        // the first: the cursor passes both.
        producer.record_deliveries(&[result(&due[1], 2, DeliveryVerdict::Accepted)], 2).unwrap();
        assert_eq!(producer.delivery_counts().unwrap(), [("accepted".to_string(), 1), ("pending".to_string(), 1)]);
        producer.record_deliveries(&[result(&due[0], 1, DeliveryVerdict::Accepted)], 3).unwrap();
        assert_eq!(producer.delivery_counts().unwrap(), [("accepted".to_string(), 2)]);
        assert!(producer.due_deliveries(10, 10, None, None).unwrap().is_empty());
    }

    /// A subscription moves to an endpoint that has received nothing of it only while it has
    /// accepted nothing: events below the cursor with another verdict do not count, events
    /// accepted ahead of it do.
    #[test]
    fn a_subscriber_that_accepted_events_moves_only_to_an_endpoint_that_holds_them() {
        let dir = tempfile::tempdir().unwrap();
        let mut producer = SqliteProducer::init(&dir.path().join("p.db"), "shop").unwrap();
        let at = |endpoint: &str| Subscription { consumer_id: "audit".into(), endpoint: endpoint.into() };
        producer.subscribe(&at("a.db"), true, 0).unwrap();
        let requests = [reserve("a"), reserve("b"), reserve("c"), reserve("d")];
        producer.advance_batch(&ReservationMachine, &requests, 1).unwrap();
        let due = producer.due_deliveries(10, 10, None, None).unwrap();
        let result = |i: usize, verdict: DeliveryVerdict| DeliveryResult {
            position: due[i].position,
            event_id: due[i].envelope.event_id.clone(),
            consumer_id: "audit".into(),
            verdict,
        };
        producer.record_deliveries(&[result(0, DeliveryVerdict::Quarantine { reason: "no".into() })], 2).unwrap();
        assert_eq!(accepted_by(&producer.conn, "audit").unwrap(), Some(0));
        producer.subscribe_checked(&at("b.db"), false, 3, Some(false)).unwrap();
        producer
            .record_deliveries(&[result(1, DeliveryVerdict::Accepted), result(3, DeliveryVerdict::Accepted)], 4)
            .unwrap();
        assert_eq!(accepted_by(&producer.conn, "audit").unwrap(), Some(2));
        assert_eq!(producer.subscriptions().unwrap(), [at("b.db")]);
        assert_eq!(accepted_by(&producer.conn, "nobody").unwrap(), None);
        let before = producer.snapshot(10).unwrap();
        let refused = producer.subscribe_checked(&at("c.db"), false, 5, Some(false)).unwrap_err();
        assert!(matches!(&refused, Error::Invalid { code, .. } if *code == codes::INVALID_STATE_CHANGE), "{refused:?}");
        assert_eq!(producer.snapshot(10).unwrap(), before, "a refused move changes nothing");
        producer.subscribe_checked(&at("c.db"), false, 5, Some(true)).unwrap();
        assert_eq!(producer.subscriptions().unwrap(), [at("c.db")]);
    }

    /// Retention walks the outbox in position order (no age index): it passes over events a
    /// subscriber has not settled and stops at the first event written at or after the cutoff,
    /// so an older-stamped event behind it (the clock stepped back) waits instead of going early.
    #[test]
    fn prune_deletes_in_position_order_up_to_the_first_event_written_after_the_cutoff() {
        let dir = tempfile::tempdir().unwrap();
        let mut producer = SqliteProducer::init(&dir.path().join("p.db"), "shop").unwrap();
        producer.advance_batch(&ReservationMachine, &[reserve("a")], 1_000).unwrap();
        let subscription = Subscription { consumer_id: "audit".into(), endpoint: "a.db".into() };
        producer.subscribe(&subscription, false, 1_500).unwrap();
        for (flow, now) in [("b", 2_000), ("c", 5_000), ("d", 3_000)] {
            producer.advance_batch(&ReservationMachine, &[reserve(flow)], now).unwrap();
        }
        let due = producer.due_deliveries(10_000, 10, None, None).unwrap();
        let mut flows: Vec<&str> = due.iter().map(|d| d.envelope.flow_id.as_str()).collect();
        flows.sort();
        assert_eq!(flows, ["b", "c", "d"], "the subscription starts after a");
        let left = |producer: &SqliteProducer| -> Vec<String> {
            producer.snapshot(10).unwrap().outbox.into_iter().map(|e| e.flow_id).collect()
        };
        // Cutoff 5,000 at 6,000: b is not delivered yet and is passed over; a goes; the walk
        // stops at c, so d waits.
        let report = producer.prune_delivered(1_000, 10, 6_000).unwrap();
        assert_eq!((report.events_deleted, report.deliveries_deleted, report.more), (1, 0, false));
        assert_eq!(left(&producer), ["b", "c", "d"]);
        let accepted: Vec<DeliveryResult> = due
            .iter()
            .map(|d| DeliveryResult {
                position: d.position,
                event_id: d.envelope.event_id.clone(),
                consumer_id: d.consumer_id.clone(),
                verdict: DeliveryVerdict::Accepted,
            })
            .collect();
        producer.record_deliveries(&accepted, 5_000).unwrap();
        let report = producer.prune_delivered(1_000, 1, 6_000).unwrap();
        assert_eq!((report.events_deleted, report.deliveries_deleted, report.more), (1, 1, true));
        assert_eq!(left(&producer), ["c", "d"]);
        assert_eq!(producer.prune_delivered(1_000, 10, 6_000).unwrap().events_deleted, 0, "c stops the walk");
        let report = producer.prune_delivered(1_000, 10, 7_000).unwrap();
        assert_eq!((report.events_deleted, report.deliveries_deleted), (2, 2));
        assert!(left(&producer).is_empty());
    }
}
