//! The producer store on PostgreSQL: flows, the immutable outbox, subscriptions with their
//! delivery cursors, and the delivery exception rows (the layout of SQLite's schema v4 and later;
//! `tidemark_store_sqlite`'s `producer.rs` explains the cursor).
//!
//! Why the cursor cannot skip an event here. PostgreSQL runs writers concurrently and a sequence
//! hands out values before commit, so "the largest position seen" could pass a lower position
//! still in flight (the Watermill SQL trap). So positions come from the schema's counter row
//! (`positions`, one row): every advance first locks it (`SELECT ... FOR UPDATE`, before it reads
//! any flow), allocates the next positions from it and writes it back in the same transaction.
//! The row lock is held until that transaction ends, so the next advance of this producer can
//! allocate only after the previous one committed (or rolled back, giving its positions back):
//! position order is commit order, and once a position is visible no lower one can still
//! appear. The cursor then moves only inside the relay's recording transaction, over outbox rows
//! that transaction reads, and only across positions accepted in that batch or holding an
//! exception row, exactly as on SQLite. The counter never goes down (not even when prune deletes
//! the newest events), so a position is never handed out twice. The price: the advances of one
//! producer serialise on one row (SQLite's single writer serialised them too); different
//! producers (schemas) do not contend.
//!
//! The relay's side (record, resolve, redeliver, prune, subscribe, rename) runs one at a time
//! per producer under a transaction-scoped advisory lock, as SQLite's single writer ran it; it
//! never waits for advances except where it reads the counter (subscribe).

use std::collections::{BTreeMap, HashMap};

use postgres::{Client, GenericClient, Row, Transaction};
use tidemark_core::crash;
use tidemark_core::error::codes;
use tidemark_core::flow::{decide_advance, validate_request, AdvanceOutcome, AdvanceRequest, FlowMachine, FlowState};
use tidemark_core::id::{validate_id, validate_limit, validate_reason};
use tidemark_core::limits::{ADVANCE_BATCH_MAX, PAGE_SIZE_MAX, PRUNE_BATCH_ROWS_MAX, RELAY_BATCH_EVENTS_MAX};
use tidemark_core::policy::retention_walk_stops_at;
use tidemark_core::store::{
    Delivery, DeliveryAction, DeliveryEntry, DeliveryResult, DeliveryStatus, DeliveryVerdict, FlowRecord,
    OutboxPruneReport, ProducerIdentity, ProducerSnapshot, ProducerStore, RedeliverReport, Subscription,
};
use tidemark_core::{ensure_invariant, Envelope, Error, Result};

use crate::schema::{self, lock, meta_get, meta_set, sql, validate_schema_name, Statements, LOCK_DELIVERIES};
use crate::{col, col_u32, PgResult};

/// Rows the cursor walk of one recording may read beyond the batch's own deliveries.
const CURSOR_WALK_ROWS_EXTRA: usize = 4_096;
/// Outbox rows read per page by the retention walk (each page is one indexed range read).
const PRUNE_PAGE_ROWS: i64 = 1_024;

/// One page of the outbox retention walk: positions after `$1`, in order, at most `$2`, each with
/// its commit time, whether every subscriber has settled it, and how many subscribers it has.
pub(crate) const PRUNE_PAGE_SQL: &str = "SELECT o.position, o.created_at_ms,
    NOT EXISTS (
        SELECT 1 FROM {s}.subscriptions s
        LEFT JOIN {s}.deliveries d ON d.position = o.position AND d.consumer_id = s.consumer_id
        WHERE s.from_position <= o.position
          AND (d.status = 'pending' OR d.status = 'quarantined'
               OR (d.status IS NULL AND o.position > s.delivered_position))),
    (SELECT count(*) FROM {s}.subscriptions s WHERE s.from_position <= o.position)
 FROM {s}.outbox o WHERE o.position > $1 ORDER BY o.position LIMIT $2";

/// A producer on PostgreSQL: its flows, outbox, subscriptions and delivery exception rows in one
/// schema of one database. Implements [`ProducerStore`]; [`PgProducer::transaction`] and
/// [`advance_in`] let the caller write business rows in the same transaction as an advance.
pub struct PgProducer {
    conn_str: String,
    client: std::cell::RefCell<Client>,
    statements: std::cell::RefCell<Statements>,
    schema: String,
    identity: ProducerIdentity,
}

fn new_generation() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

fn read_identity(client: &mut impl GenericClient, schema: &str) -> Result<Option<ProducerIdentity>> {
    let source = meta_get(client, schema, "producer.source")?;
    let generation = meta_get(client, schema, "producer.generation")?;
    Ok(source.zip(generation).map(|(source, generation)| ProducerIdentity { source, generation }))
}

impl PgProducer {
    /// Create (or reopen) the producer of namespace `source` in `schema` of the database at
    /// `conn_str`, creating the schema and migrating it. Re-running init with the same source
    /// changes nothing; another source is `already_initialized`.
    pub fn init(conn_str: &str, schema: &str, source: &str) -> Result<PgProducer> {
        validate_schema_name(schema)?;
        validate_id("source", source)?;
        let mut client = schema::connect(conn_str)?;
        schema::migrate(&mut client, schema, true)?;
        let mut tx = client.transaction().db()?;
        lock(&mut tx, LOCK_DELIVERIES, schema)?;
        let identity = match read_identity(&mut tx, schema)? {
            Some(existing) if existing.source == source => existing,
            Some(existing) => {
                return Err(Error::invalid(
                    codes::ALREADY_INITIALIZED,
                    format!("schema {schema} is already the producer of source {:?}", existing.source),
                ))
            }
            None => {
                let identity = ProducerIdentity { source: source.to_string(), generation: new_generation() };
                meta_set(&mut tx, schema, "producer.source", &identity.source)?;
                meta_set(&mut tx, schema, "producer.generation", &identity.generation)?;
                identity
            }
        };
        tx.commit().db()?;
        Ok(Self::with(conn_str, client, schema, identity))
    }

    /// Open the producer in `schema` (migrating it forward if it is older). Never creates
    /// anything: a missing schema, or one that is not a producer's, is `not_initialized`.
    pub fn open(conn_str: &str, schema: &str) -> Result<PgProducer> {
        validate_schema_name(schema)?;
        let mut client = schema::connect(conn_str)?;
        schema::migrate(&mut client, schema, false)?;
        let identity = read_identity(&mut client, schema)?.ok_or_else(|| {
            Error::invalid(
                codes::NOT_INITIALIZED,
                format!("PostgreSQL schema {schema} is not a producer's; initialise it as a producer first"),
            )
        })?;
        Ok(Self::with(conn_str, client, schema, identity))
    }

    fn with(conn_str: &str, client: Client, schema: &str, identity: ProducerIdentity) -> PgProducer {
        PgProducer {
            conn_str: conn_str.to_string(),
            client: std::cell::RefCell::new(client),
            statements: std::cell::RefCell::new(Statements::new(schema)),
            schema: schema.to_string(),
            identity,
        }
    }

    /// The PostgreSQL schema this producer lives in.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// The connection, for the caller's own statements and transactions (for example one that
    /// calls [`advance_in`]).
    pub fn client(&mut self) -> &mut Client {
        self.client.get_mut()
    }

    /// Give this producer a new generation id (run it after restoring the database from a
    /// backup).
    pub fn rotate_generation(&mut self) -> Result<ProducerIdentity> {
        let generation = new_generation();
        let mut tx = self.client.get_mut().transaction().db()?;
        meta_set(&mut tx, &self.schema, "producer.generation", &generation)?;
        tx.commit().db()?;
        self.identity.generation = generation;
        Ok(self.identity.clone())
    }

    /// Run `f` in one transaction on the producer's connection that commits only when `f`
    /// returns `Ok` and every advance in it committed: write business rows (the transaction
    /// derefs to a [`postgres::Transaction`]) and advance flows with
    /// [`ProducerTransaction::advance`]; both commit or neither does. `?` works on PostgreSQL
    /// calls (`tidemark_core::Error: From<postgres::Error>`) and on advances.
    pub fn transaction<T, E, F>(&mut self, now_ms: i64, f: F) -> std::result::Result<T, E>
    where
        F: FnOnce(&mut ProducerTransaction<'_>) -> std::result::Result<T, E>,
        E: From<Error>,
    {
        let inner = self.client.get_mut().transaction().map_err(|e| E::from(Error::from(e)))?;
        let mut tx = ProducerTransaction { inner, schema: &self.schema, now_ms, refused: None };
        let value = f(&mut tx)?;
        if let Some(refused) = tx.refused.take() {
            return Err(refused.into());
        }
        crash::hit("advance.before_commit");
        tx.inner.commit().map_err(|e| E::from(Error::from(e)))?;
        crash::hit("advance.after_commit");
        Ok(value)
    }

    /// Counts of deliveries by status (for snapshots and metrics).
    pub fn delivery_counts(&self) -> Result<Vec<(String, i64)>> {
        let mut client = self.client.borrow_mut();
        let rows = client
            .query(
                &sql(
                    &self.schema,
                    &format!("SELECT status, count(*) FROM ({DELIVERY_VIEW}) c GROUP BY status ORDER BY status"),
                ),
                &[],
            )
            .db()?;
        rows.iter().map(|r| Ok((col(r, 0)?, col(r, 1)?))).collect()
    }

    /// Rename a subscriber (the producer half of `rename-consumer`). Idempotent.
    pub fn rename_subscription(&mut self, from: &str, to: &str) -> Result<u64> {
        validate_id("from", from)?;
        validate_id("to", to)?;
        let schema = self.schema.clone();
        let mut tx = self.client.get_mut().transaction().db()?;
        lock(&mut tx, LOCK_DELIVERIES, &schema)?;
        let exists = |tx: &mut Transaction<'_>, id: &str| -> Result<bool> {
            col(
                &tx.query_one(
                    &sql(&schema, "SELECT EXISTS (SELECT 1 FROM {s}.subscriptions WHERE consumer_id = $1)"),
                    &[&id],
                )
                .db()?,
                0,
            )
        };
        let (exists_from, exists_to) = (exists(&mut tx, from)?, exists(&mut tx, to)?);
        if !exists_from {
            if exists_to {
                return Ok(0);
            }
            return Err(Error::not_found(format!("no subscription for consumer {from:?}")));
        }
        if exists_to {
            return Err(Error::invalid(codes::ALREADY_EXISTS, format!("a subscription for {to:?} already exists")));
        }
        let moved: i64 = col(
            &tx.query_one(
                &sql(&schema, "SELECT count(*) FROM {s}.outbox WHERE position >= (SELECT from_position FROM {s}.subscriptions WHERE consumer_id = $1)"),
                &[&from],
            )
            .db()?,
            0,
        )?;
        tx.execute(
            &sql(&schema, "UPDATE {s}.subscriptions SET consumer_id = $2 WHERE consumer_id = $1"),
            &[&from, &to],
        )
        .db()?;
        tx.execute(&sql(&schema, "UPDATE {s}.deliveries SET consumer_id = $2 WHERE consumer_id = $1"), &[&from, &to])
            .db()?;
        tx.commit().db()?;
        Ok(moved as u64)
    }

    /// [`ProducerStore::subscribe`], refusing a move to an endpoint that has received nothing of a
    /// subscriber that accepted events (`new_endpoint_has_received == Some(false)`), as
    /// `SqliteProducer::subscribe_checked` does.
    pub fn subscribe_checked(
        &mut self,
        subscription: &Subscription,
        from_start: bool,
        now_ms: i64,
        new_endpoint_has_received: Option<bool>,
    ) -> Result<u64> {
        validate_id("consumer_id", &subscription.consumer_id)?;
        tidemark_core::endpoint::Endpoint::parse(&subscription.endpoint)?;
        let schema = self.schema.clone();
        let mut tx = self.client.get_mut().transaction().db()?;
        lock(&mut tx, LOCK_DELIVERIES, &schema)?;
        let consumer_id = &subscription.consumer_id;
        let existing: Option<String> = tx
            .query_opt(&sql(&schema, "SELECT endpoint FROM {s}.subscriptions WHERE consumer_id = $1"), &[consumer_id])
            .db()?
            .map(|r| col(&r, 0))
            .transpose()?;
        let queued = match existing {
            Some(endpoint) if endpoint == subscription.endpoint => 0,
            Some(_) => {
                if new_endpoint_has_received == Some(false) {
                    let accepted = accepted_by(&mut tx, &schema, consumer_id)?.unwrap_or(0);
                    if accepted > 0 {
                        return Err(Error::invalid(
                            codes::INVALID_STATE_CHANGE,
                            format!(
                                "{consumer_id:?} has accepted {accepted} events at its current endpoint, and {} has \
                                 received nothing of it from {:?}: moved there, every flow under way would stop at a \
                                 gap. Subscribe a copy of the consumer's data, or a new consumer id with --from-start",
                                subscription.endpoint, self.identity.source
                            ),
                        ));
                    }
                }
                tx.execute(
                    &sql(&schema, "UPDATE {s}.subscriptions SET endpoint = $2 WHERE consumer_id = $1"),
                    &[consumer_id, &subscription.endpoint],
                )
                .db()?;
                0
            }
            None => {
                // The counter is read under its row lock: an advance in flight commits first, so
                // "from now on" is well defined (as with SQLite's single writer).
                let last: i64 = col(
                    &tx.query_one(&sql(&schema, "SELECT last_position FROM {s}.positions FOR UPDATE"), &[]).db()?,
                    0,
                )?;
                let (from_position, queued) = if from_start {
                    let held: i64 = col(&tx.query_one(&sql(&schema, "SELECT count(*) FROM {s}.outbox"), &[]).db()?, 0)?;
                    (1_i64, held as u64)
                } else {
                    (last + 1, 0)
                };
                tx.execute(
                    &sql(
                        &schema,
                        "INSERT INTO {s}.subscriptions (consumer_id, endpoint, created_at_ms, from_position, delivered_position)
                         VALUES ($1, $2, $3, $4, $4::bigint - 1)",
                    ),
                    &[consumer_id, &subscription.endpoint, &now_ms, &from_position],
                )
                .db()?;
                queued
            }
        };
        tx.commit().db()?;
        Ok(queued)
    }
}

/// A transaction of [`PgProducer::transaction`]: the caller's statements (it derefs to the
/// [`postgres::Transaction`]) and advances that either commit or abort the whole transaction.
pub struct ProducerTransaction<'a> {
    inner: Transaction<'a>,
    schema: &'a str,
    now_ms: i64,
    refused: Option<Error>,
}

impl ProducerTransaction<'_> {
    /// Advance a flow in this transaction. An answer other than `committed` is an error (codes
    /// `stale`, `invalid_transition`) and dooms the transaction: it rolls back even if the closure
    /// goes on and returns `Ok`, so business rows never commit without their event.
    pub fn advance(&mut self, machine: &dyn FlowMachine, request: &AdvanceRequest) -> Result<Committed> {
        let outcome = advance_in(&mut self.inner, self.schema, machine, request, self.now_ms);
        let committed = outcome.and_then(committed);
        // A refusal dooms the transaction, and so does a store failure (PostgreSQL has aborted
        // the transaction then, and a commit would silently roll back). Bad input wrote nothing
        // and leaves the transaction usable, as on SQLite.
        if let Err(error) = &committed {
            if matches!(error.code(), codes::STALE | codes::INVALID_TRANSITION) || !error.is_invalid_input() {
                self.refused.get_or_insert_with(|| error.clone());
            }
        }
        committed
    }

    /// The time this transaction stamps its events with.
    pub fn now_ms(&self) -> i64 {
        self.now_ms
    }

    /// The producer's PostgreSQL schema (where tidemark's tables are; your own tables may live
    /// there or in a schema of your own).
    pub fn schema(&self) -> &str {
        self.schema
    }
}

impl<'a> std::ops::Deref for ProducerTransaction<'a> {
    type Target = Transaction<'a>;
    fn deref(&self) -> &Transaction<'a> {
        &self.inner
    }
}

impl<'a> std::ops::DerefMut for ProducerTransaction<'a> {
    fn deref_mut(&mut self) -> &mut Transaction<'a> {
        &mut self.inner
    }
}

/// What an advance that committed answered (as `tidemark_store_sqlite::Committed`).
#[derive(Debug, Clone, PartialEq, Eq)]
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

/// Like [`advance_in`], for a transaction that must not commit without its event: an answer
/// other than `committed` is an error with its code (`stale`, `invalid_transition`). Return it
/// and roll the transaction back with the business rows.
pub fn advance_committed_in(
    tx: &mut Transaction<'_>,
    schema: &str,
    machine: &dyn FlowMachine,
    request: &AdvanceRequest,
    now_ms: i64,
) -> Result<Committed> {
    committed(advance_in(tx, schema, machine, request, now_ms)?)
}

/// Advance a flow of the producer in `schema` inside a transaction the caller opened on the
/// producer's database (with the caller's business rows in it). The advance locks the producer's
/// position counter until the caller's transaction ends: commit (or roll back) soon. In a
/// `REPEATABLE READ` or `SERIALIZABLE` transaction whose snapshot predates another advance's
/// commit, PostgreSQL refuses the lock with a serialization failure (a `store` error): roll back
/// and retry; `READ COMMITTED` (the default) never sees stale rows here.
pub fn advance_in(
    tx: &mut Transaction<'_>,
    schema: &str,
    machine: &dyn FlowMachine,
    request: &AdvanceRequest,
    now_ms: i64,
) -> Result<AdvanceOutcome> {
    validate_schema_name(schema)?;
    validate_request(machine, request)?;
    let mut statements = Statements::new(schema);
    let position = lock_positions(tx, &mut statements)?;
    let identity = read_identity(tx, schema)?
        .ok_or_else(|| Error::invalid(codes::NOT_INITIALIZED, format!("schema {schema} is not a producer's")))?;
    let outcome =
        advance_all(tx, &mut statements, position, &identity, machine, std::slice::from_ref(request), now_ms)?;
    outcome.into_iter().next().ok_or_else(|| Error::Invariant("an advance answered nothing".into()))
}

/// Lock the counter row (held until the transaction ends) and read the last position handed out.
/// Called before anything else an advance reads, so that what it reads is current.
fn lock_positions(tx: &mut Transaction<'_>, statements: &mut Statements) -> Result<i64> {
    let statement = statements.get(tx, "SELECT last_position FROM {s}.positions FOR UPDATE")?;
    let row = tx.query_opt(&statement, &[]).db()?.ok_or_else(|| Error::Invariant("no position counter row".into()))?;
    col(&row, 0)
}

/// The flows an advance batch names, as they are stored.
const FLOWS_OF_SQL: &str = "SELECT flow_id, state, state_data, last_seq FROM {s}.flows WHERE flow_id = ANY($1)";

/// Everything an advance batch writes, in one statement: the flows that existed (each only if it
/// is still at the seq the batch read), the new flows, the outbox rows, and the position counter
/// (only forward). Answers how many rows of each it wrote, for the caller to check.
const ADVANCE_WRITE_SQL: &str = "WITH updated AS (
     UPDATE {s}.flows f SET state = u.state, state_data = u.state_data, last_seq = u.last_seq, updated_at_ms = $1
     FROM unnest($3::text[], $4::text[], $5::text[], $6::bigint[], $7::bigint[])
         AS u(flow_id, state, state_data, last_seq, read_seq)
     WHERE f.flow_id = u.flow_id AND f.last_seq = u.read_seq
     RETURNING 1),
 created AS (
     INSERT INTO {s}.flows (flow_id, state, state_data, last_seq, updated_at_ms)
     SELECT u.flow_id, u.state, u.state_data, u.last_seq, $1
     FROM unnest($8::text[], $9::text[], $10::text[], $11::bigint[]) AS u(flow_id, state, state_data, last_seq)
     RETURNING 1),
 events AS (
     INSERT INTO {s}.outbox (position, event_id, flow_id, seq, event_type, schema_version, payload,
         content_hash, created_at_ms, generation, traceparent)
     SELECT u.position, u.event_id, u.flow_id, u.seq, u.event_type, u.schema_version, u.payload, u.content_hash,
         $1, $2, u.traceparent
     FROM unnest($12::bigint[], $13::text[], $14::text[], $15::bigint[], $16::text[], $17::integer[], $18::text[],
                 $19::text[], $20::text[])
         AS u(position, event_id, flow_id, seq, event_type, schema_version, payload, content_hash, traceparent)
     RETURNING 1),
 counter AS (
     UPDATE {s}.positions SET last_position = $21 WHERE last_position < $21 RETURNING 1)
 SELECT (SELECT count(*) FROM updated), (SELECT count(*) FROM created), (SELECT count(*) FROM events),
        (SELECT count(*) FROM counter)";

/// A flow of an advance batch, as the batch has left it so far.
struct BatchFlow {
    state: FlowState,
    seq: i64,
    /// The seq of its stored row when the batch read it (`None`: no row yet).
    read_seq: Option<i64>,
}

/// The flow rows an advance batch writes, column by column.
#[derive(Default)]
struct FlowColumns {
    flow_ids: Vec<String>,
    states: Vec<String>,
    data: Vec<String>,
    seqs: Vec<i64>,
    /// For an update: the seq the batch read (the row changes only if it is still there).
    read_seqs: Vec<i64>,
}

impl FlowColumns {
    fn push(&mut self, flow_id: String, flow: BatchFlow) {
        self.flow_ids.push(flow_id);
        self.states.push(flow.state.state);
        self.data.push(flow.state.data.to_string());
        self.seqs.push(flow.seq);
        self.read_seqs.extend(flow.read_seq);
    }
}

/// The outbox rows an advance batch writes, column by column.
#[derive(Default)]
struct EventColumns {
    positions: Vec<i64>,
    event_ids: Vec<String>,
    flow_ids: Vec<String>,
    seqs: Vec<i64>,
    event_types: Vec<String>,
    schema_versions: Vec<i32>,
    payloads: Vec<String>,
    content_hashes: Vec<String>,
    traceparents: Vec<Option<String>>,
}

impl EventColumns {
    fn push(&mut self, position: i64, event: Envelope) -> Result<()> {
        self.schema_versions.push(
            i32::try_from(event.schema_version)
                .map_err(|_| Error::invalid(codes::INVALID_SCHEMA_VERSION, "schema version out of range"))?,
        );
        self.content_hashes.push(event.content_hash());
        self.payloads.push(event.payload.to_string());
        self.positions.push(position);
        self.event_ids.push(event.event_id);
        self.flow_ids.push(event.flow_id);
        self.seqs.push(event.seq);
        self.event_types.push(event.event_type);
        self.traceparents.push(event.traceparent);
        Ok(())
    }
}

/// Advance every request in order inside `tx`, which locked the position counter at
/// `last_position` (the last position handed out; each committed event takes the next one).
/// The round trips do not grow with the batch: one read of the flows it names, the decisions in
/// memory (a flow named twice sees its first advance, as on SQLite), then one statement that
/// writes the flows, the outbox rows and the counter ([`ADVANCE_WRITE_SQL`]).
fn advance_all(
    tx: &mut Transaction<'_>,
    statements: &mut Statements,
    last_position: i64,
    identity: &ProducerIdentity,
    machine: &dyn FlowMachine,
    requests: &[AdvanceRequest],
    now_ms: i64,
) -> Result<Vec<AdvanceOutcome>> {
    let mut named: Vec<&str> = requests.iter().map(|r| r.flow_id.as_str()).collect();
    named.sort_unstable();
    named.dedup();
    let read = statements.get(tx, FLOWS_OF_SQL)?;
    let mut flows: HashMap<String, BatchFlow> = HashMap::with_capacity(named.len());
    for row in tx.query(&read, &[&named]).db()? {
        let data: String = col(&row, 2)?;
        let data = serde_json::from_str(&data).map_err(|e| Error::store(format!("corrupt flow state: {e}")))?;
        let seq: i64 = col(&row, 3)?;
        let flow = BatchFlow { state: FlowState { state: col(&row, 1)?, data }, seq, read_seq: Some(seq) };
        flows.insert(col(&row, 0)?, flow);
    }
    let mut events = EventColumns::default();
    let mut position = last_position;
    let mut outcomes = Vec::with_capacity(requests.len());
    for request in requests {
        let flow = flows.entry(request.flow_id.clone()).or_insert_with(|| BatchFlow {
            state: machine.initial(),
            seq: 0,
            read_seq: None,
        });
        let (seq, decision) = match decide_advance(machine, flow.seq, &flow.state, request)? {
            Ok(decided) => decided,
            Err(rejection) => {
                outcomes.push(rejection);
                continue;
            }
        };
        ensure_invariant!(seq == flow.seq + 1, "allocated seq {seq} is not {} + 1", flow.seq);
        position = position.checked_add(1).ok_or_else(|| Error::store("the outbox ran out of positions (i64::MAX)"))?;
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
        outcomes.push(AdvanceOutcome::Committed {
            flow_id: event.flow_id.clone(),
            seq,
            event_id: event.event_id.clone(),
            state: decision.next.state.clone(),
        });
        events.push(position, event)?;
        flow.seq = seq;
        flow.state = decision.next;
    }
    if position == last_position {
        return Ok(outcomes);
    }
    let (mut updated, mut created) = (FlowColumns::default(), FlowColumns::default());
    for (flow_id, flow) in flows {
        match flow.read_seq {
            Some(read_seq) if read_seq == flow.seq => {}
            Some(_) => updated.push(flow_id, flow),
            None if flow.seq == 0 => {}
            None => created.push(flow_id, flow),
        }
    }
    let write = statements.get(tx, ADVANCE_WRITE_SQL)?;
    let (u, c, e) = (&updated, &created, &events);
    let row = tx
        .query_one(
            &write,
            &[
                &now_ms,
                &identity.generation,
                &u.flow_ids,
                &u.states,
                &u.data,
                &u.seqs,
                &u.read_seqs,
                &c.flow_ids,
                &c.states,
                &c.data,
                &c.seqs,
                &e.positions,
                &e.event_ids,
                &e.flow_ids,
                &e.seqs,
                &e.event_types,
                &e.schema_versions,
                &e.payloads,
                &e.content_hashes,
                &e.traceparents,
                &position,
            ],
        )
        .db()?;
    let written: (i64, i64, i64, i64) = (col(&row, 0)?, col(&row, 1)?, col(&row, 2)?, col(&row, 3)?);
    let expected = (u.flow_ids.len() as i64, c.flow_ids.len() as i64, e.positions.len() as i64, 1);
    ensure_invariant!(
        written == expected,
        "an advance batch wrote (flows updated, created, events, counter) {written:?}, not {expected:?}"
    );
    Ok(outcomes)
}

const EVENT_COLUMNS: &str =
    "o.event_id, o.flow_id, o.seq, o.event_type, o.schema_version, o.payload, o.created_at_ms, o.generation, o.traceparent";
/// The number of columns in [`EVENT_COLUMNS`]: the first index of the columns a query selects
/// after them.
const EVENT_COLUMN_COUNT: usize = 9;

fn event_from_row(identity: &ProducerIdentity, r: &Row, at: usize) -> Result<Envelope> {
    let payload: String = col(r, at + 5)?;
    Ok(Envelope {
        event_id: col(r, at)?,
        source: identity.source.clone(),
        generation: col(r, at + 7)?,
        flow_id: col(r, at + 1)?,
        seq: col(r, at + 2)?,
        event_type: col(r, at + 3)?,
        schema_version: col_u32(r, at + 4)?,
        payload: serde_json::from_str(&payload).map_err(|e| Error::store(format!("corrupt outbox payload: {e}")))?,
        created_at_ms: col(r, at + 6)?,
        traceparent: col(r, at + 8)?,
    })
}

/// Every delivery (one per outbox event and subscriber from its `from_position` on), merged from
/// the subscriber's cursor and the exception rows (see SQLite's `DELIVERY_VIEW`). Columns as
/// [`delivery_entry`] reads them, then the position.
const DELIVERY_VIEW: &str =
    "SELECT event_id, flow_id, seq, consumer_id, status, attempts, next_attempt_at_ms, last_error,
        updated_at_ms, position FROM (
    SELECT o.event_id AS event_id, o.flow_id AS flow_id, o.seq AS seq, s.consumer_id AS consumer_id,
        COALESCE(d.status, CASE WHEN o.position <= s.delivered_position THEN 'accepted' ELSE 'pending' END) AS status,
        COALESCE(d.attempts, 0) AS attempts, COALESCE(d.next_attempt_at_ms, o.created_at_ms) AS next_attempt_at_ms,
        d.last_error AS last_error, COALESCE(d.updated_at_ms, o.created_at_ms) AS updated_at_ms, o.position AS position
    FROM {s}.outbox o JOIN {s}.subscriptions s ON s.from_position <= o.position
    LEFT JOIN {s}.deliveries d ON d.position = o.position AND d.consumer_id = s.consumer_id) v";

fn delivery_entry(r: &Row) -> Result<DeliveryEntry> {
    let status: String = col(r, 4)?;
    Ok(DeliveryEntry {
        event_id: col(r, 0)?,
        flow_id: col(r, 1)?,
        seq: col(r, 2)?,
        consumer_id: col(r, 3)?,
        status: DeliveryStatus::parse(&status)
            .ok_or_else(|| Error::store(format!("unknown delivery status {status:?}")))?,
        attempts: col_u32(r, 5)?,
        next_attempt_at_ms: col(r, 6)?,
        last_error: col(r, 7)?,
        updated_at_ms: col(r, 8)?,
    })
}

fn delivery_on(
    tx: &mut impl GenericClient,
    schema: &str,
    event_id: &str,
    consumer_id: &str,
) -> Result<Option<DeliveryEntry>> {
    let query = sql(schema, &format!("{DELIVERY_VIEW} WHERE event_id = $1 AND consumer_id = $2"));
    tx.query_opt(&query, &[&event_id, &consumer_id]).db()?.map(|r| delivery_entry(&r)).transpose()
}

/// How many events `consumer_id` has accepted; `None` when it is not subscribed.
fn accepted_by(tx: &mut impl GenericClient, schema: &str, consumer_id: &str) -> Result<Option<u64>> {
    let row = tx
        .query_opt(
            &sql(
                schema,
                "SELECT (s.delivered_position - s.from_position + 1)
                    - (SELECT count(*) FROM {s}.deliveries d WHERE d.consumer_id = s.consumer_id
                          AND d.position <= s.delivered_position AND d.status <> 'accepted')
                    + (SELECT count(*) FROM {s}.deliveries d WHERE d.consumer_id = s.consumer_id
                          AND d.position > s.delivered_position AND d.status = 'accepted')
                 FROM {s}.subscriptions s WHERE s.consumer_id = $1",
            ),
            &[&consumer_id],
        )
        .db()?;
    row.map(|r| {
        let accepted: i64 = col(&r, 0)?;
        u64::try_from(accepted)
            .map_err(|_| Error::Invariant(format!("subscriber {consumer_id:?} has accepted {accepted} events")))
    })
    .transpose()
}

/// Check that the outbox holds `event_id` at `position` and return the event's commit time (a
/// mismatch is a bug in the caller and nothing is recorded).
fn checked_commit_time(
    tx: &mut Transaction<'_>,
    statements: &mut Statements,
    position: i64,
    event_id: &str,
) -> Result<i64> {
    let statement = statements.get(tx, "SELECT created_at_ms FROM {s}.outbox WHERE position = $1 AND event_id = $2")?;
    let row = tx.query_opt(&statement, &[&position, &event_id]).db()?;
    match row {
        Some(row) => col(&row, 0),
        None => Err(Error::Invariant(format!(
            "delivery result names position {position}, which does not hold event {event_id}"
        ))),
    }
}

/// A subscriber's cursor while a relay batch is recorded.
struct CursorMove<'r> {
    from_position: i64,
    delivered_position: i64,
    /// Positions above the cursor accepted in this batch, with their event ids.
    accepted: BTreeMap<i64, &'r str>,
}

impl ProducerStore for PgProducer {
    fn identity(&self) -> &ProducerIdentity {
        &self.identity
    }

    fn reconnect_if_closed(&mut self) -> Result<()> {
        if !self.client.get_mut().is_closed() {
            return Ok(());
        }
        *self.client.get_mut() = schema::connect(&self.conn_str)?;
        // Prepared statements belong to the closed connection.
        *self.statements.get_mut() = Statements::new(&self.schema);
        Ok(())
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
        let statements = self.statements.get_mut();
        let mut tx = self.client.get_mut().transaction().db()?;
        let position = lock_positions(&mut tx, statements)?;
        let outcomes = advance_all(&mut tx, statements, position, &self.identity, machine, requests, now_ms)?;
        crash::hit("advance.before_commit");
        tx.commit().db()?;
        crash::hit("advance.after_commit");
        Ok(outcomes)
    }

    fn subscribe(&mut self, subscription: &Subscription, from_start: bool, now_ms: i64) -> Result<u64> {
        self.subscribe_checked(subscription, from_start, now_ms, None)
    }

    fn subscriptions(&self) -> Result<Vec<Subscription>> {
        let mut client = self.client.borrow_mut();
        let statement = self
            .statements
            .borrow_mut()
            .get(&mut *client, "SELECT consumer_id, endpoint FROM {s}.subscriptions ORDER BY consumer_id")?;
        let rows = client.query(&statement, &[]).db()?;
        rows.iter().map(|r| Ok(Subscription { consumer_id: col(r, 0)?, endpoint: col(r, 1)? })).collect()
    }

    fn due_deliveries(
        &mut self,
        now_ms: i64,
        limit: usize,
        event_id: Option<&str>,
        consumers: Option<&[String]>,
    ) -> Result<Vec<Delivery>> {
        validate_limit("relay limit", limit, RELAY_BATCH_EVENTS_MAX * 4)?;
        // The subscribers asked for (NULL: every subscriber), as a text array.
        let wanted: Option<Vec<String>> = consumers.map(<[String]>::to_vec);
        let identity = self.identity.clone();
        let schema = self.schema.clone();
        let limit_rows = limit as i64;
        // Columns: the event (0..EVENT_COLUMN_COUNT), consumer id, attempts, endpoint, due
        // time, position.
        let map = |r: &Row| -> Result<((i64, i64, String), Delivery)> {
            let delivery = Delivery {
                position: col(r, EVENT_COLUMN_COUNT + 4)?,
                envelope: event_from_row(&identity, r, 0)?,
                consumer_id: col(r, EVENT_COLUMN_COUNT)?,
                attempts: col_u32(r, EVENT_COLUMN_COUNT + 1)?,
                endpoint: col(r, EVENT_COLUMN_COUNT + 2)?,
            };
            // Keyed (position, subscriber): see the SQLite store's `due_keys`.
            Ok(((delivery.position, 0, delivery.consumer_id.clone()), delivery))
        };
        // One read-only snapshot, so that cursors and exception rows are read as of one moment.
        let mut tx = self
            .client
            .get_mut()
            .build_transaction()
            .isolation_level(postgres::IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .db()?;
        if let Some(event_id) = event_id {
            validate_id("event_id", event_id)?;
            let rows = tx
                .query(
                    &sql(
                        &schema,
                        &format!(
                            "SELECT {EVENT_COLUMNS}, s.consumer_id, COALESCE(d.attempts, 0), s.endpoint, 0::bigint, o.position
                             FROM {{s}}.outbox o JOIN {{s}}.subscriptions s ON s.from_position <= o.position
                             LEFT JOIN {{s}}.deliveries d ON d.position = o.position AND d.consumer_id = s.consumer_id
                             WHERE o.event_id = $1 AND ($3::text[] IS NULL OR s.consumer_id = ANY($3))
                               AND (d.status = 'pending' OR d.status = 'quarantined'
                                    OR (d.status IS NULL AND o.position > s.delivered_position))
                             ORDER BY s.consumer_id LIMIT $2"
                        ),
                    ),
                    &[&event_id, &limit_rows, &wanted],
                )
                .db()?;
            tx.commit().db()?;
            return rows.iter().map(|r| Ok(map(r)?.1)).collect();
        }
        let mut candidates: Vec<((i64, i64, String), Delivery)> = Vec::new();
        let retries = tx
            .query(
                &sql(
                    &schema,
                    &format!(
                        "SELECT {EVENT_COLUMNS}, d.consumer_id, d.attempts, s.endpoint, d.next_attempt_at_ms, d.position
                         FROM {{s}}.deliveries d JOIN {{s}}.outbox o ON o.position = d.position
                         JOIN {{s}}.subscriptions s ON s.consumer_id = d.consumer_id
                         WHERE d.status = 'pending' AND d.next_attempt_at_ms <= $1
                           AND ($3::text[] IS NULL OR d.consumer_id = ANY($3))
                         ORDER BY d.position, d.consumer_id LIMIT $2"
                    ),
                ),
                &[&now_ms, &limit_rows, &wanted],
            )
            .db()?;
        for row in &retries {
            candidates.push(map(row)?);
        }
        let cursors = tx
            .query(
                &sql(
                    &schema,
                    "SELECT consumer_id, endpoint, delivered_position FROM {s}.subscriptions ORDER BY consumer_id",
                ),
                &[],
            )
            .db()?;
        let fresh = sql(
            &schema,
            &format!(
                "SELECT {EVENT_COLUMNS}, $2::text, 0, $3::text, o.created_at_ms, o.position FROM {{s}}.outbox o
                 WHERE o.position > $1
                   AND NOT EXISTS (SELECT 1 FROM {{s}}.deliveries d WHERE d.position = o.position AND d.consumer_id = $2)
                 ORDER BY o.position LIMIT $4"
            ),
        );
        let fresh = tx.prepare(&fresh).db()?;
        for cursor in &cursors {
            let (consumer_id, endpoint, delivered_position): (String, String, i64) =
                (col(cursor, 0)?, col(cursor, 1)?, col(cursor, 2)?);
            if consumers.is_some_and(|list| !list.contains(&consumer_id)) {
                continue;
            }
            let rows = tx.query(&fresh, &[&delivered_position, &consumer_id, &endpoint, &limit_rows]).db()?;
            for row in &rows {
                candidates.push(map(row)?);
            }
        }
        tx.commit().db()?;
        candidates.sort_by(|a, b| a.0.cmp(&b.0));
        candidates.truncate(limit);
        Ok(candidates.into_iter().map(|(_, delivery)| delivery).collect())
    }

    fn overtaking(&mut self, batch: &[Delivery], in_flight: &[(i64, String)]) -> Result<Vec<(i64, String)>> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        // Per subscriber of the batch: the open deliveries above its cursor up to the batch's
        // highest position (one range of the outbox), and the open exception rows at or below
        // its cursor, in one read-only statement.
        let mut highest: std::collections::BTreeMap<&str, i64> = std::collections::BTreeMap::new();
        for delivery in batch {
            let entry = highest.entry(delivery.consumer_id.as_str()).or_insert(delivery.position);
            *entry = (*entry).max(delivery.position);
        }
        let consumers: Vec<&str> = highest.keys().copied().collect();
        let positions: Vec<i64> = highest.values().copied().collect();
        let rows = self
            .client
            .get_mut()
            .query(
                &sql(
                    &self.schema,
                    "SELECT b.consumer_id, o.position, o.flow_id, o.seq
                       FROM unnest($1::text[], $2::bigint[]) AS b(consumer_id, highest)
                       JOIN {s}.subscriptions s ON s.consumer_id = b.consumer_id
                       JOIN {s}.outbox o ON o.position > greatest(s.delivered_position, s.from_position - 1)
                                        AND o.position < b.highest
                       LEFT JOIN {s}.deliveries d ON d.position = o.position AND d.consumer_id = s.consumer_id
                      WHERE d.status IS NULL OR d.status IN ('pending', 'quarantined')
                     UNION ALL
                     SELECT b.consumer_id, d.position, o.flow_id, o.seq
                       FROM unnest($1::text[]) AS b(consumer_id)
                       JOIN {s}.subscriptions s ON s.consumer_id = b.consumer_id
                       JOIN {s}.deliveries d ON d.consumer_id = s.consumer_id AND d.position <= s.delivered_position
                                            AND d.status IN ('pending', 'quarantined')
                       JOIN {s}.outbox o ON o.position = d.position",
                ),
                &[&consumers, &positions],
            )
            .db()?;
        let open = rows
            .iter()
            .map(|r| Ok((col(r, 0)?, col(r, 1)?, col(r, 2)?, col(r, 3)?)))
            .collect::<Result<Vec<(String, i64, String, i64)>>>()?;
        Ok(tidemark_core::store::overtaking_of(batch, in_flight, open))
    }

    fn record_deliveries(&mut self, results: &[DeliveryResult], now_ms: i64) -> Result<()> {
        let schema = self.schema.clone();
        let statements = self.statements.get_mut();
        let mut tx = self.client.get_mut().transaction().db()?;
        lock(&mut tx, LOCK_DELIVERIES, &schema)?;
        let exception =
            statements.get(&mut tx, "SELECT 1 FROM {s}.deliveries WHERE position = $1 AND consumer_id = $2")?;
        let cursor_of = statements
            .get(&mut tx, "SELECT from_position, delivered_position FROM {s}.subscriptions WHERE consumer_id = $1")?;
        // Exception rows change only while pending or quarantined.
        let accept = statements.get(
            &mut tx,
            "UPDATE {s}.deliveries SET status = 'accepted', last_error = NULL, updated_at_ms = $3
             WHERE position = $1 AND consumer_id = $2 AND (status = 'pending' OR status = 'quarantined')",
        )?;
        let retry = statements.get(
            &mut tx,
            "UPDATE {s}.deliveries SET attempts = attempts + 1, next_attempt_at_ms = $4, last_error = $3, updated_at_ms = $5,
                 status = 'pending'
             WHERE position = $1 AND consumer_id = $2 AND (status = 'pending' OR status = 'quarantined')",
        )?;
        let quarantine = statements.get(
            &mut tx,
            "UPDATE {s}.deliveries SET attempts = attempts + 1, status = 'quarantined', last_error = $3, updated_at_ms = $4
             WHERE position = $1 AND consumer_id = $2 AND (status = 'pending' OR status = 'quarantined')",
        )?;
        let insert = statements.get(
            &mut tx,
            "INSERT INTO {s}.deliveries (position, consumer_id, status, attempts, next_attempt_at_ms, last_error, updated_at_ms)
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )?;
        let any_exceptions: bool =
            col(&tx.query_one(&sql(&schema, "SELECT EXISTS (SELECT 1 FROM {s}.deliveries)"), &[]).db()?, 0)?;
        let mut cursors: HashMap<&str, Option<CursorMove>> = HashMap::new();
        for result in results {
            let (position, event_id, consumer) =
                (result.position, result.event_id.as_str(), result.consumer_id.as_str());
            if any_exceptions && tx.query_opt(&exception, &[&position, &consumer]).db()?.is_some() {
                checked_commit_time(&mut tx, statements, position, event_id)?;
                match &result.verdict {
                    DeliveryVerdict::Accepted => tx.execute(&accept, &[&position, &consumer, &now_ms]).db()?,
                    DeliveryVerdict::Retry { reason, next_attempt_at_ms } => {
                        tx.execute(&retry, &[&position, &consumer, reason, next_attempt_at_ms, &now_ms]).db()?
                    }
                    DeliveryVerdict::Quarantine { reason } => {
                        tx.execute(&quarantine, &[&position, &consumer, reason, &now_ms]).db()?
                    }
                };
                continue;
            }
            if !cursors.contains_key(consumer) {
                let cursor = match tx.query_opt(&cursor_of, &[&consumer]).db()? {
                    Some(row) => Some(CursorMove {
                        from_position: col(&row, 0)?,
                        delivered_position: col(&row, 1)?,
                        accepted: BTreeMap::new(),
                    }),
                    None => None,
                };
                cursors.insert(consumer, cursor);
            }
            let Some(Some(cursor)) = cursors.get_mut(consumer) else { continue };
            if position < cursor.from_position || position <= cursor.delivered_position {
                continue;
            }
            match &result.verdict {
                DeliveryVerdict::Accepted => {
                    cursor.accepted.insert(position, event_id);
                }
                DeliveryVerdict::Retry { reason, next_attempt_at_ms } => {
                    checked_commit_time(&mut tx, statements, position, event_id)?;
                    tx.execute(
                        &insert,
                        &[&position, &consumer, &"pending", &1_i32, next_attempt_at_ms, reason, &now_ms],
                    )
                    .db()?;
                }
                DeliveryVerdict::Quarantine { reason } => {
                    let created_at_ms = checked_commit_time(&mut tx, statements, position, event_id)?;
                    tx.execute(
                        &insert,
                        &[&position, &consumer, &"quarantined", &1_i32, &created_at_ms, reason, &now_ms],
                    )
                    .db()?;
                }
            }
        }
        // Move each cursor across the positions right above it that are settled: accepted in this
        // batch, or holding an exception row. It stops at the first position still plainly
        // pending. Every row it reads is committed, and (positions being commit-ordered) no lower
        // position can commit after it.
        let walk = statements.get(
            &mut tx,
            "SELECT o.position, EXISTS (SELECT 1 FROM {s}.deliveries d WHERE d.position = o.position AND d.consumer_id = $2)
             FROM {s}.outbox o WHERE o.position > $1 ORDER BY o.position LIMIT $3",
        )?;
        let move_cursor =
            statements.get(&mut tx, "UPDATE {s}.subscriptions SET delivered_position = $2 WHERE consumer_id = $1")?;
        let mut consumers: Vec<&str> = cursors.keys().copied().collect();
        consumers.sort_unstable();
        for consumer in consumers {
            let Some(Some(mut cursor)) = cursors.remove(consumer) else { continue };
            if cursor.accepted.is_empty() {
                continue;
            }
            let start = cursor.delivered_position;
            let rows_max = (cursor.accepted.len() + CURSOR_WALK_ROWS_EXTRA) as i64;
            for row in tx.query(&walk, &[&start, &consumer, &rows_max]).db()? {
                let (position, has_exception): (i64, bool) = (col(&row, 0)?, col(&row, 1)?);
                if cursor.accepted.remove(&position).is_none() && !has_exception {
                    break;
                }
                cursor.delivered_position = position;
            }
            ensure_invariant!(cursor.delivered_position >= start, "a delivery cursor moved backwards");
            if cursor.delivered_position > start {
                tx.execute(&move_cursor, &[&consumer, &cursor.delivered_position]).db()?;
            }
            for (position, event_id) in cursor.accepted {
                let created_at_ms = checked_commit_time(&mut tx, statements, position, event_id)?;
                tx.execute(
                    &insert,
                    &[
                        &position,
                        &consumer,
                        &"accepted",
                        &0_i32,
                        &created_at_ms,
                        &Option::<String>::None,
                        &created_at_ms,
                    ],
                )
                .db()?;
            }
        }
        crash::hit("relay.before_producer_commit");
        tx.commit().db()?;
        crash::hit("relay.after_producer_commit");
        Ok(())
    }

    fn deliveries(&self, status: Option<DeliveryStatus>, limit: usize) -> Result<Vec<DeliveryEntry>> {
        validate_limit("page size", limit, PAGE_SIZE_MAX)?;
        let mut client = self.client.borrow_mut();
        let query = sql(
            &self.schema,
            &format!("{DELIVERY_VIEW} WHERE $1::text IS NULL OR status = $1 ORDER BY position, consumer_id LIMIT $2"),
        );
        let rows = client.query(&query, &[&status.map(DeliveryStatus::as_str), &(limit as i64)]).db()?;
        rows.iter().map(delivery_entry).collect()
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
        let schema = self.schema.clone();
        let mut tx = self.client.get_mut().transaction().db()?;
        lock(&mut tx, LOCK_DELIVERIES, &schema)?;
        let Some(current) = delivery_on(&mut tx, &schema, event_id, consumer_id)? else {
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
        let statement = match action {
            DeliveryAction::Requeue => {
                "UPDATE {s}.deliveries SET status = 'pending', attempts = 0, next_attempt_at_ms = $3, last_error = $4, updated_at_ms = $3
                 WHERE position = (SELECT position FROM {s}.outbox WHERE event_id = $1) AND consumer_id = $2"
            }
            DeliveryAction::Dismiss => {
                "INSERT INTO {s}.deliveries (position, consumer_id, status, attempts, next_attempt_at_ms, last_error, updated_at_ms)
                 SELECT position, $2, 'dismissed', 0, created_at_ms, $4, $3 FROM {s}.outbox WHERE event_id = $1
                 ON CONFLICT (position, consumer_id) DO UPDATE SET status = 'dismissed', last_error = excluded.last_error,
                     updated_at_ms = excluded.updated_at_ms"
            }
        };
        let changed = tx.execute(&sql(&schema, statement), &[&event_id, &consumer_id, &now_ms, &note]).db()?;
        ensure_invariant!(changed == 1, "resolve changed {changed} delivery rows");
        crash::hit("resolve.before_commit");
        let resolved = delivery_on(&mut tx, &schema, event_id, consumer_id)?;
        tx.commit().db()?;
        resolved.ok_or_else(|| Error::Invariant("resolved delivery vanished".into()))
    }

    fn redeliver(&mut self, consumer_id: &str, from_event_id: Option<&str>) -> Result<RedeliverReport> {
        validate_id("consumer_id", consumer_id)?;
        if let Some(event_id) = from_event_id {
            validate_id("event_id", event_id)?;
        }
        let schema = self.schema.clone();
        let mut tx = self.client.get_mut().transaction().db()?;
        lock(&mut tx, LOCK_DELIVERIES, &schema)?;
        let Some(row) = tx
            .query_opt(
                &sql(&schema, "SELECT from_position FROM {s}.subscriptions WHERE consumer_id = $1"),
                &[&consumer_id],
            )
            .db()?
        else {
            return Err(Error::not_found(format!("no subscription for consumer {consumer_id:?}")));
        };
        let from_position: i64 = col(&row, 0)?;
        let chosen: Option<i64> = match from_event_id {
            Some(event_id) => Some(
                tx.query_opt(&sql(&schema, "SELECT position FROM {s}.outbox WHERE event_id = $1"), &[&event_id])
                    .db()?
                    .map(|r| col(&r, 0))
                    .transpose()?
                    .ok_or_else(|| Error::not_found(format!("the outbox holds no event {event_id}")))?,
            ),
            None => col(&tx.query_one(&sql(&schema, "SELECT min(position) FROM {s}.outbox"), &[]).db()?, 0)?,
        };
        let newest: Option<i64> =
            col(&tx.query_one(&sql(&schema, "SELECT max(position) FROM {s}.outbox"), &[]).db()?, 0)?;
        let (Some(chosen), Some(newest)) = (chosen, newest) else {
            return Ok(RedeliverReport::default());
        };
        let count_from = sql(&schema, "SELECT count(*) FROM {s}.outbox WHERE position >= $1");
        let held: i64 = col(&tx.query_one(&count_from, &[&chosen]).db()?, 0)?;
        let start = chosen.max(from_position);
        tx.execute(
            &sql(&schema, "DELETE FROM {s}.deliveries WHERE consumer_id = $1 AND position >= $2"),
            &[&consumer_id, &start],
        )
        .db()?;
        tx.execute(
            &sql(&schema, "UPDATE {s}.subscriptions SET delivered_position = LEAST(delivered_position, $2::bigint - 1) WHERE consumer_id = $1"),
            &[&consumer_id, &start],
        )
        .db()?;
        let redelivered: i64 = col(&tx.query_one(&count_from, &[&start]).db()?, 0)?;
        crash::hit("redeliver.before_commit");
        tx.commit().db()?;
        Ok(RedeliverReport { redelivered: redelivered as u64, pruned: (newest - chosen + 1 - held) as u64 })
    }

    fn flow(&self, flow_id: &str) -> Result<Option<FlowRecord>> {
        validate_id("flow_id", flow_id)?;
        let mut client = self.client.borrow_mut();
        let statement = self
            .statements
            .borrow_mut()
            .get(&mut *client, "SELECT state, state_data, last_seq FROM {s}.flows WHERE flow_id = $1")?;
        let row = client.query_opt(&statement, &[&flow_id]).db()?;
        row.map(|r| {
            let data: String = col(&r, 1)?;
            let data = serde_json::from_str(&data).map_err(|e| Error::store(format!("corrupt flow state: {e}")))?;
            Ok(FlowRecord {
                flow_id: flow_id.to_string(),
                last_seq: col(&r, 2)?,
                state: FlowState { state: col(&r, 0)?, data },
            })
        })
        .transpose()
    }

    fn prune_delivered(&mut self, retention_ms: i64, batch_rows: usize, now_ms: i64) -> Result<OutboxPruneReport> {
        validate_limit("prune batch", batch_rows, PRUNE_BATCH_ROWS_MAX)?;
        if retention_ms < 0 {
            return Err(Error::invalid(codes::INVALID_ARGUMENT, "delivered retention must be >= 0"));
        }
        let schema = self.schema.clone();
        let statements = self.statements.get_mut();
        let mut tx = self.client.get_mut().transaction().db()?;
        lock(&mut tx, LOCK_DELIVERIES, &schema)?;
        // Oldest first by position (commit order), in pages of one indexed range read each
        // (`outbox_pkey`; see the test `retention_reads_use_their_indexes`), stopping at the first
        // event written at or after the cutoff. An event with any unsettled delivery stays and the
        // walk passes over it.
        let cutoff = now_ms.saturating_sub(retention_ms);
        let page = statements.get(&mut tx, PRUNE_PAGE_SQL)?;
        let mut positions: Vec<(i64, i64)> = Vec::new();
        let mut after = 0_i64;
        'pages: loop {
            let rows = tx.query(&page, &[&after, &PRUNE_PAGE_ROWS]).db()?;
            for row in &rows {
                if positions.len() == batch_rows {
                    break 'pages;
                }
                let (position, created_at_ms): (i64, i64) = (col(row, 0)?, col(row, 1)?);
                after = position;
                if retention_walk_stops_at(created_at_ms, cutoff, now_ms) {
                    break 'pages;
                }
                if created_at_ms < cutoff && col::<bool>(row, 2)? {
                    positions.push((position, col(row, 3)?));
                }
            }
            if (rows.len() as i64) < PRUNE_PAGE_ROWS {
                break;
            }
        }
        let delete_deliveries = statements.get(&mut tx, "DELETE FROM {s}.deliveries WHERE position = $1")?;
        let delete_event = statements.get(&mut tx, "DELETE FROM {s}.outbox WHERE position = $1")?;
        let mut deliveries_deleted = 0;
        for (position, deliveries) in &positions {
            deliveries_deleted += *deliveries as u64;
            tx.execute(&delete_deliveries, &[position]).db()?;
            let deleted = tx.execute(&delete_event, &[position]).db()?;
            ensure_invariant!(deleted == 1, "pruning outbox position {position} deleted {deleted} rows");
        }
        crash::hit("prune.before_commit");
        tx.commit().db()?;
        crash::hit("prune.after_commit");
        Ok(OutboxPruneReport {
            events_deleted: positions.len() as u64,
            deliveries_deleted,
            more: positions.len() == batch_rows,
        })
    }

    fn snapshot(&self, rows_max: usize) -> Result<ProducerSnapshot> {
        let limit = rows_max as i64;
        let schema = &self.schema;
        let mut client = self.client.borrow_mut();
        let mut tx = client
            .build_transaction()
            .isolation_level(postgres::IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .db()?;
        let subscriptions = tx
            .query(&sql(schema, "SELECT consumer_id, endpoint FROM {s}.subscriptions ORDER BY consumer_id"), &[])
            .db()?
            .iter()
            .map(|r| Ok(Subscription { consumer_id: col(r, 0)?, endpoint: col(r, 1)? }))
            .collect::<Result<Vec<_>>>()?;
        let flows = tx
            .query(
                &sql(schema, "SELECT flow_id, state, state_data, last_seq FROM {s}.flows ORDER BY flow_id LIMIT $1"),
                &[&limit],
            )
            .db()?
            .iter()
            .map(|r| {
                let data: String = col(r, 2)?;
                Ok(FlowRecord {
                    flow_id: col(r, 0)?,
                    last_seq: col(r, 3)?,
                    state: FlowState { state: col(r, 1)?, data: serde_json::from_str(&data).unwrap_or_default() },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let outbox = tx
            .query(
                &sql(schema, &format!("SELECT {EVENT_COLUMNS} FROM {{s}}.outbox o ORDER BY o.position LIMIT $1")),
                &[&limit],
            )
            .db()?
            .iter()
            .map(|r| event_from_row(&self.identity, r, 0))
            .collect::<Result<Vec<_>>>()?;
        let deliveries = tx
            .query(&sql(schema, &format!("{DELIVERY_VIEW} ORDER BY position, consumer_id LIMIT $1")), &[&limit])
            .db()?
            .iter()
            .map(delivery_entry)
            .collect::<Result<Vec<_>>>()?;
        tx.commit().db()?;
        Ok(ProducerSnapshot { identity: self.identity.clone(), subscriptions, flows, outbox, deliveries })
    }
}
