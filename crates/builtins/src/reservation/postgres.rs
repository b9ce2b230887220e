//! The built-in reservation projection on PostgreSQL: the same tables, handler logic and read-backs
//! as on SQLite ([`super`]), in the consumer's schema. The handler writes through the consumer's
//! [`ApplyTransaction`], so its rows commit exactly when the event counts as applied.

use std::collections::HashMap;
use std::sync::Arc;

use tidemark::decode::DecoderRegistry;
use tidemark::postgres::client::{self, GenericClient};
use tidemark::postgres::{ApplyTransaction, PgConsumer};
use tidemark::reservation::{decoders, project, ReservationEvent, ReservationProjection};
use tidemark::store::{HandleError, Handler};
use tidemark::{Envelope, Error, Result};

use super::{DuplicateEffect, Effect, ProjectionRow};

/// The tables, as `rename-consumer` must carry them over.
const TABLES: [&str; 2] = ["reservation_projection", "reservation_effects"];

fn db(error: client::Error) -> Error {
    Error::from(error)
}

/// True when both tables exist and are registered as the consumer's projection tables.
fn installed(consumer: &mut PgConsumer) -> Result<bool> {
    let schema = consumer.schema().to_string();
    let row = consumer
        .client()
        .query_one(
            "SELECT to_regclass(format('%I.reservation_projection', $1::text)) IS NOT NULL
                AND to_regclass(format('%I.reservation_effects', $1::text)) IS NOT NULL",
            &[&schema],
        )
        .map_err(db)?;
    if !row.get::<_, bool>(0) {
        return Ok(false);
    }
    let registered: Option<String> = consumer
        .client()
        .query_opt(&format!(r#"SELECT value FROM "{schema}".meta WHERE key = 'consumer.projection_tables'"#), &[])
        .map_err(db)?
        .map(|r| r.get(0));
    let registered: Vec<String> = registered.and_then(|raw| serde_json::from_str(&raw).ok()).unwrap_or_default();
    Ok(TABLES.iter().all(|t| registered.iter().any(|r| r == t)))
}

/// Create the reservation tables in the consumer's schema and register them for
/// `rename-consumer` (idempotent; writes nothing when they are already there). Two processes
/// installing at once take turns on an advisory lock.
pub fn install(consumer: &mut PgConsumer) -> Result<()> {
    if installed(consumer)? {
        return Ok(());
    }
    let s = consumer.schema().to_string();
    let mut tx = consumer.client().transaction().map_err(db)?;
    tx.execute("SELECT pg_advisory_xact_lock(hashtext($1::text || '/reservation_tables'))", &[&s]).map_err(db)?;
    create_tables(&mut tx, &s)?;
    tx.commit().map_err(db)?;
    for table in TABLES {
        consumer.register_projection_table(table)?;
    }
    Ok(())
}

/// The tables as a user migration of a service's inbox database on PostgreSQL (`tidemark serve
/// --store postgres://...`): created and registered in the migration's transaction.
pub fn migration() -> tidemark::postgres::Migration {
    tidemark::postgres::Migration::with("reservation_tables", |tx, schema| {
        create_tables(tx, schema)?;
        for table in TABLES {
            tidemark::postgres::register_projection_table(tx, schema, table)?;
        }
        Ok(())
    })
}

fn create_tables(tx: &mut impl GenericClient, s: &str) -> Result<()> {
    tx.batch_execute(&format!(
        r#"CREATE TABLE IF NOT EXISTS "{s}".reservation_projection (
               consumer_id text COLLATE "C" NOT NULL,
               source      text COLLATE "C" NOT NULL,
               flow_id     text COLLATE "C" NOT NULL,
               state       text NOT NULL,
               quantity    bigint NOT NULL,
               last_seq    bigint NOT NULL,
               PRIMARY KEY (flow_id, source, consumer_id)
           );
           CREATE TABLE IF NOT EXISTS "{s}".reservation_effects (
               effect_id   bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
               consumer_id text COLLATE "C" NOT NULL,
               source      text COLLATE "C" NOT NULL,
               flow_id     text COLLATE "C" NOT NULL,
               seq         bigint NOT NULL,
               event_id    text NOT NULL,
               kind        text NOT NULL,
               quantity    bigint NOT NULL
           );"#
    ))
    .map_err(db)
}

/// The reservation handler on PostgreSQL: the same decoders and transitions as
/// [`super::ReservationHandler`], one projection row per (consumer, source, flow) and one effect
/// row per applied event.
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

impl Handler<ApplyTransaction> for ReservationHandler {
    /// A batch of one: the same three statements, so that one event at a time and in batches make
    /// the same writes by construction.
    fn handle(&mut self, tx: &ApplyTransaction, consumer_id: &str, event: &Envelope) -> Result<(), HandleError> {
        self.handle_batch(tx, consumer_id, std::slice::from_ref(event))
    }

    /// Every refusal comes before the first write (as on SQLite).
    fn refuses_before_writing(&self) -> bool {
        true
    }

    fn batch_max(&self) -> usize {
        BATCH_EVENTS_MAX
    }

    /// The same transitions and rows as [`Handler::handle`], in three statements per batch:
    /// the projections of the batch's flows read in one, their new states written in one
    /// upsert, the effects inserted in one. Any refusal refuses the whole batch before it writes
    /// (the drain then applies it one event at a time, and only the refused flow stops).
    fn handle_batch(
        &mut self,
        tx: &ApplyTransaction,
        consumer_id: &str,
        events: &[Envelope],
    ) -> Result<(), HandleError> {
        let failed = |e: client::Error| HandleError::Failed(Error::from(e));
        let s = tx.schema().to_string();
        // The batch's flows in their order (`index` maps each to its place), each with its
        // projection (`states`; None: no row yet).
        let mut index: HashMap<(&str, &str), usize> = HashMap::new();
        let (mut sources, mut flow_ids) = (Vec::new(), Vec::new());
        for event in events {
            index.entry((&event.source, &event.flow_id)).or_insert_with(|| {
                sources.push(event.source.as_str());
                flow_ids.push(event.flow_id.as_str());
                sources.len() - 1
            });
        }
        let mut states: Vec<Option<ReservationProjection>> = vec![None; sources.len()];
        let read = tx
            .prepare_cached(&format!(
                r#"SELECT k.i, p.state, p.quantity FROM "{s}".reservation_projection p
                   JOIN unnest($2::text[], $3::text[]) WITH ORDINALITY AS k(source, flow_id, i)
                     ON p.flow_id = k.flow_id AND p.source = k.source AND p.consumer_id = $1"#
            ))
            .map_err(failed)?;
        for row in tx.query(&read, &[&consumer_id, &sources, &flow_ids]).map_err(failed)? {
            let i = usize::try_from(row.get::<_, i64>(0) - 1).expect("ordinality starts at 1");
            states[i] = Some(ReservationProjection { state: row.get(1), quantity: row.get(2) });
        }
        let mut effects = Effects::default();
        let mut last_seqs = vec![0_i64; sources.len()];
        for event in events {
            let decoded = self
                .decoders
                .decode(&event.event_type, event.schema_version, &event.payload)
                .map_err(HandleError::Blocked)?;
            let i = index[&(event.source.as_str(), event.flow_id.as_str())];
            let next = project(states[i].as_ref(), &decoded).map_err(HandleError::Blocked)?;
            effects.push(event, &next);
            last_seqs[i] = event.seq;
            states[i] = Some(next);
        }
        // The projections' new rows, one per flow, in the order of `sources` and `flow_ids`.
        let (mut kinds, mut quantities) = (Vec::new(), Vec::new());
        for state in &states {
            let state = state.as_ref().expect("every flow was projected");
            kinds.push(state.state.as_str());
            quantities.push(state.quantity);
        }
        let write = tx
            .prepare_cached(&format!(
                r#"INSERT INTO "{s}".reservation_projection (consumer_id, source, flow_id, state, quantity, last_seq)
                   SELECT $1, * FROM unnest($2::text[], $3::text[], $4::text[], $5::bigint[], $6::bigint[])
                   ON CONFLICT (flow_id, source, consumer_id)
                   DO UPDATE SET state = excluded.state, quantity = excluded.quantity, last_seq = excluded.last_seq"#
            ))
            .map_err(failed)?;
        let written = tx
            .execute(&write, &[&consumer_id, &sources, &flow_ids, &kinds, &quantities, &last_seqs])
            .map_err(failed)?;
        let insert = tx
            .prepare_cached(&format!(
                r#"INSERT INTO "{s}".reservation_effects (consumer_id, source, flow_id, seq, event_id, kind, quantity)
                   SELECT $1, * FROM unnest($2::text[], $3::text[], $4::bigint[], $5::text[], $6::text[], $7::bigint[])"#
            ))
            .map_err(failed)?;
        let e = &effects;
        let inserted = tx
            .execute(&insert, &[&consumer_id, &e.sources, &e.flow_ids, &e.seqs, &e.event_ids, &e.kinds, &e.quantities])
            .map_err(failed)?;
        if written != sources.len() as u64 || inserted != events.len() as u64 {
            return Err(HandleError::Failed(Error::store(format!(
                "a batch of {} events wrote {written} projections (not {}) and {inserted} effects",
                events.len(),
                sources.len()
            ))));
        }
        Ok(())
    }
}

/// Events one [`Handler::handle_batch`] of the reservation handler takes at most (each of its
/// array parameters holds one element per event or flow).
pub const BATCH_EVENTS_MAX: usize = 1_000;

/// Effect rows as columns: the array parameters of one statement.
#[derive(Default)]
struct Effects {
    sources: Vec<String>,
    flow_ids: Vec<String>,
    seqs: Vec<i64>,
    event_ids: Vec<String>,
    kinds: Vec<String>,
    quantities: Vec<i64>,
}

impl Effects {
    fn push(&mut self, event: &Envelope, next: &ReservationProjection) {
        self.sources.push(event.source.clone());
        self.flow_ids.push(event.flow_id.clone());
        self.seqs.push(event.seq);
        self.event_ids.push(event.event_id.clone());
        self.kinds.push(next.state.clone());
        self.quantities.push(next.quantity);
    }
}

/// Read the reservation projection and effects of `schema`, capped at `rows_max`, inside the
/// caller's transaction (see `PgConsumer::snapshot_with`).
pub fn read_in(
    tx: &mut impl GenericClient,
    schema: &str,
    rows_max: usize,
) -> Result<(Vec<ProjectionRow>, Vec<Effect>)> {
    let limit = rows_max as i64;
    let projections = tx
        .query(
            &format!(
                r#"SELECT consumer_id, source, flow_id, state, quantity, last_seq FROM "{schema}".reservation_projection
                   ORDER BY consumer_id, source, flow_id LIMIT $1"#
            ),
            &[&limit],
        )
        .map_err(db)?
        .iter()
        .map(|r| ProjectionRow {
            consumer_id: r.get(0),
            source: r.get(1),
            flow_id: r.get(2),
            state: r.get(3),
            quantity: r.get(4),
            last_seq: r.get(5),
        })
        .collect();
    let effects = tx
        .query(
            &format!(
                r#"SELECT consumer_id, source, flow_id, seq, event_id, kind, quantity FROM "{schema}".reservation_effects
                   ORDER BY effect_id LIMIT $1"#
            ),
            &[&limit],
        )
        .map_err(db)?
        .iter()
        .map(|r| Effect {
            consumer_id: r.get(0),
            source: r.get(1),
            flow_id: r.get(2),
            seq: r.get(3),
            event_id: r.get(4),
            kind: r.get(5),
            quantity: r.get(6),
        })
        .collect();
    Ok((projections, effects))
}

/// Effects per (consumer, source, flow, seq) applied more than once in `schema`: must always be
/// empty.
pub fn duplicate_effects(client: &mut impl GenericClient, schema: &str) -> Result<Vec<DuplicateEffect>> {
    let rows = client
        .query(
            &format!(
                r#"SELECT consumer_id, source, flow_id, seq, count(*) FROM "{schema}".reservation_effects
                   GROUP BY consumer_id, source, flow_id, seq HAVING count(*) > 1 ORDER BY 1, 2, 3, 4 LIMIT 1000"#
            ),
            &[],
        )
        .map_err(db)?;
    Ok(rows
        .iter()
        .map(|r| DuplicateEffect {
            consumer_id: r.get(0),
            source: r.get(1),
            flow_id: r.get(2),
            seq: r.get(3),
            count: r.get(4),
        })
        .collect())
}
