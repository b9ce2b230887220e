//! The built-in reservation projection on SQLite: one projection row per (consumer, source,
//! flow) and one effect row per applied event. The effects table deliberately has no unique
//! constraint, so that an event applied twice would show as two rows. The same projection on
//! PostgreSQL is [`postgres`].

pub mod postgres;

use std::sync::Arc;

use tidemark::decode::DecoderRegistry;
use tidemark::reservation::{decoders, project, ReservationEvent, ReservationProjection};
use tidemark::rusqlite::{self, params, Connection, OptionalExtension};
use tidemark::sqlite::{register_projection_table, Migration, SqliteConsumer};
use tidemark::store::{HandleError, Handler};
use tidemark::{Envelope, Error, Result};

/// The migration that creates the reservation tables and registers them for
/// `rename-consumer` (idempotent: files made before migrations were recorded already have them).
/// The projection's key leads with the flow id, like the inbox's (schema v5): files made before
/// keep their (consumer, source, flow) key, which works the same, only slower.
pub fn migration() -> Migration {
    Migration::with("reservation_tables", install_in)
}

/// Create the reservation tables (idempotent) in a consumer database, in one transaction
/// (`BEGIN IMMEDIATE`: two processes installing at once take turns).
pub fn install(consumer: &SqliteConsumer) -> Result<()> {
    let tx = rusqlite::Transaction::new_unchecked(consumer.connection(), rusqlite::TransactionBehavior::Immediate)?;
    install_in(&tx)?;
    tx.commit()?;
    Ok(())
}

/// Create the reservation tables (idempotent) and register them, inside `tx`.
pub fn install_in(tx: &Connection) -> Result<()> {
    tx.execute_batch(
        "CREATE TABLE IF NOT EXISTS reservation_projection (
             consumer_id TEXT NOT NULL,
             source      TEXT NOT NULL,
             flow_id     TEXT NOT NULL,
             state       TEXT NOT NULL,
             quantity    INTEGER NOT NULL,
             last_seq    INTEGER NOT NULL,
             PRIMARY KEY (flow_id, source, consumer_id)
         ) WITHOUT ROWID;
         CREATE TABLE IF NOT EXISTS reservation_effects (
             effect_id     INTEGER PRIMARY KEY,
             consumer_id   TEXT NOT NULL,
             source        TEXT NOT NULL,
             flow_id       TEXT NOT NULL,
             seq           INTEGER NOT NULL,
             event_id      TEXT NOT NULL,
             kind          TEXT NOT NULL,
             quantity      INTEGER NOT NULL
         );",
    )?;
    register_projection_table(tx, "reservation_projection")?;
    register_projection_table(tx, "reservation_effects")
}

/// The reservation handler: decode by (event type, schema version), check the transition
/// against the projection, then write the projection and one effect row.
#[derive(Clone)]
pub struct ReservationHandler {
    decoders: Arc<DecoderRegistry<ReservationEvent>>,
}

impl ReservationHandler {
    /// The handler with the v1 decoders, and the v2 ones with `support_v2`.
    pub fn new(support_v2: bool) -> Self {
        ReservationHandler { decoders: Arc::new(decoders(support_v2)) }
    }
}

fn failed(error: rusqlite::Error) -> HandleError {
    HandleError::Failed(Error::from(error))
}

impl Handler<Connection> for ReservationHandler {
    fn handle(&mut self, tx: &Connection, consumer_id: &str, event: &Envelope) -> Result<(), HandleError> {
        let decoded = self
            .decoders
            .decode(&event.event_type, event.schema_version, &event.payload)
            .map_err(HandleError::Blocked)?;
        let current: Option<ReservationProjection> = tx
            .prepare_cached(
                "SELECT state, quantity FROM reservation_projection WHERE consumer_id = ?1 AND source = ?2 AND flow_id = ?3",
            )
            .map_err(failed)?
            .query_row(params![consumer_id, event.source, event.flow_id], |r| {
                Ok(ReservationProjection { state: r.get(0)?, quantity: r.get(1)? })
            })
            .optional()
            .map_err(failed)?;
        let next = project(current.as_ref(), &decoded).map_err(HandleError::Blocked)?;
        // The read above says whether the row exists: a plain UPDATE or INSERT (an upsert of an
        // existing row seeks the primary key twice).
        let write = if current.is_some() {
            "UPDATE reservation_projection SET state = ?4, quantity = ?5, last_seq = ?6
             WHERE consumer_id = ?1 AND source = ?2 AND flow_id = ?3"
        } else {
            "INSERT INTO reservation_projection (consumer_id, source, flow_id, state, quantity, last_seq)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)"
        };
        let changed = tx
            .prepare_cached(write)
            .map_err(failed)?
            .execute(params![consumer_id, event.source, event.flow_id, next.state, next.quantity, event.seq])
            .map_err(failed)?;
        if changed != 1 {
            return Err(HandleError::Failed(Error::store(format!("writing the projection changed {changed} rows"))));
        }
        tx.prepare_cached(
            "INSERT INTO reservation_effects (consumer_id, source, flow_id, seq, event_id, kind, quantity)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        )
        .map_err(failed)?
        .execute(params![
            consumer_id,
            event.source,
            event.flow_id,
            event.seq,
            event.event_id,
            next.state,
            next.quantity
        ])
        .map_err(failed)?;
        Ok(())
    }

    /// Every refusal (undecodable payload, refused transition) comes before the first write, so
    /// the drain needs no savepoint per event (a database error after a write fails the whole
    /// drain, whose transaction then rolls back).
    fn refuses_before_writing(&self) -> bool {
        true
    }
}

/// One effect row, as read back for snapshots and tests.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Effect {
    /// The logical consumer whose handler wrote the effect.
    pub consumer_id: String,
    /// The producer namespace of the event.
    pub source: String,
    /// The event's flow (one reservation).
    pub flow_id: String,
    /// The event's seq in its flow.
    pub seq: i64,
    /// The event that caused the effect; one effect per applied event, so a double apply shows up
    /// as two rows.
    pub event_id: String,
    /// The state the event moved the reservation to (`reserved`, `confirmed`, `released`).
    pub kind: String,
    /// The reservation's quantity at that event.
    pub quantity: i64,
}

/// One row of `reservation_projection`: where a consumer's view of one reservation stands.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ProjectionRow {
    /// The logical consumer the row belongs to.
    pub consumer_id: String,
    /// The producer namespace of the flow.
    pub source: String,
    /// The reservation (flow).
    pub flow_id: String,
    /// The reservation's state as this consumer has applied it.
    pub state: String,
    /// The reservation's quantity, fixed for its life.
    pub quantity: i64,
    /// The seq of the last event applied to this row.
    pub last_seq: i64,
}

/// Read the reservation projection and effects (in one read transaction), capped at `rows_max`.
pub fn read(conn: &Connection, rows_max: usize) -> Result<(Vec<ProjectionRow>, Vec<Effect>)> {
    let tx = conn.unchecked_transaction()?;
    let read = read_in(&tx, rows_max)?;
    tx.finish()?;
    Ok(read)
}

/// [`read`] on a connection whose read transaction the caller holds (see
/// [`SqliteConsumer::snapshot_with`]).
pub fn read_in(tx: &Connection, rows_max: usize) -> Result<(Vec<ProjectionRow>, Vec<Effect>)> {
    let projections = {
        let mut stmt = tx.prepare(
            "SELECT consumer_id, source, flow_id, state, quantity, last_seq FROM reservation_projection
                 ORDER BY consumer_id, source, flow_id LIMIT ?1",
        )?;
        let rows = stmt.query_map([rows_max as i64], |r| {
            Ok(ProjectionRow {
                consumer_id: r.get(0)?,
                source: r.get(1)?,
                flow_id: r.get(2)?,
                state: r.get(3)?,
                quantity: r.get(4)?,
                last_seq: r.get(5)?,
            })
        })?;
        rows.collect::<rusqlite::Result<Vec<_>>>()?
    };
    let effects = {
        let mut stmt = tx.prepare(
            "SELECT consumer_id, source, flow_id, seq, event_id, kind, quantity FROM reservation_effects
                 ORDER BY effect_id LIMIT ?1",
        )?;
        let rows = stmt.query_map([rows_max as i64], |r| {
            Ok(Effect {
                consumer_id: r.get(0)?,
                source: r.get(1)?,
                flow_id: r.get(2)?,
                seq: r.get(3)?,
                event_id: r.get(4)?,
                kind: r.get(5)?,
                quantity: r.get(6)?,
            })
        })?;
        rows.collect::<rusqlite::Result<Vec<_>>>()?
    };
    Ok((projections, effects))
}

/// How many effect rows there are (one per applied event and consumer, when nothing was applied
/// twice).
pub fn effect_count(conn: &Connection) -> Result<u64> {
    let count: i64 = conn.query_row("SELECT count(*) FROM reservation_effects", [], |r| r.get(0))?;
    Ok(count as u64)
}

/// An effect written more than once: (consumer, source, flow, seq) and how many times.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DuplicateEffect {
    /// The logical consumer.
    pub consumer_id: String,
    /// The producer namespace of the flow.
    pub source: String,
    /// The flow of the event applied more than once.
    pub flow_id: String,
    /// The seq whose effect is there more than once.
    pub seq: i64,
    /// How many effect rows it has (more than one is a double apply: a bug).
    pub count: i64,
}

/// Effects per (consumer, source, flow, seq) applied more than once: must always be empty.
pub fn duplicate_effects(conn: &Connection) -> Result<Vec<DuplicateEffect>> {
    let mut stmt = conn.prepare(
        "SELECT consumer_id, source, flow_id, seq, count(*) FROM reservation_effects
             GROUP BY consumer_id, source, flow_id, seq HAVING count(*) > 1 ORDER BY 1, 2, 3, 4 LIMIT 1000",
    )?;
    let rows = stmt.query_map([], |r| {
        Ok(DuplicateEffect {
            consumer_id: r.get(0)?,
            source: r.get(1)?,
            flow_id: r.get(2)?,
            seq: r.get(3)?,
            count: r.get(4)?,
        })
    })?;
    rows.collect::<rusqlite::Result<Vec<_>>>().map_err(Error::from)
}
