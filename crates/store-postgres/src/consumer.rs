//! The consumer store on PostgreSQL: inboxes scoped by consumer, per-flow high-water marks,
//! compact receipts, and the drain that runs the user's handler inside the transaction that marks
//! events applied (the behaviour of `tidemark_store_sqlite`'s `consumer.rs`, statement for
//! statement where PostgreSQL allows).
//!
//! Every write of one consumer schema (receive, drain, skip, prune, rename, retire) runs under a
//! transaction-scoped advisory lock of that schema, one at a time, as SQLite's single writer ran
//! them; reads (listings, snapshots) never wait for it.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};

use postgres::{Client, GenericClient, Row, Statement, Transaction};
use tidemark_core::crash;
use tidemark_core::error::codes;
use tidemark_core::id::{validate_id, validate_limit, validate_reason, validate_rename};
use tidemark_core::limits::{DRAIN_BATCH_EVENTS_MAX, PAGE_SIZE_MAX, PRUNE_BATCH_ROWS_MAX, RECEIVE_BATCH_EVENTS_MAX};
use tidemark_core::policy::{retention_walk_stops_at, RetentionPolicy};
use tidemark_core::store::{
    ConsumerSnapshot, ConsumerStore, DrainReport, DrainScope, FlowCursor, Handler, InboxEntry, InboxStatus,
    PruneReport, Receipt, ReceiveOutcome, RenameReport,
};
use tidemark_core::{ensure_invariant, Envelope, Error, Result};

use crate::apply::{ApplyTransaction, OpenTransaction};
use crate::schema::{self, lock, meta_get, meta_set, sql, validate_schema_name, Statements, LOCK_CONSUMER};
use crate::{col, col_u32, PgResult};
use tidemark_core::drain::{self, DrainPosition, DrainTransaction, OpenRecord, DRAIN_PAGE_ROWS};

/// Inbox rows read per page by the retention walk.
const PRUNE_PAGE_ROWS: i64 = 1_024;

/// One page of the inbox retention walk: records after `$1` in receive order, at most `$2`, each
/// with its receive time and whether it was applied or skipped at or before the cutoff `$3`.
pub(crate) const PRUNE_PAGE_SQL: &str =
    "SELECT record, received_at_ms, status IN ('applied', 'skipped') AND status_at_ms <= $3
 FROM {s}.inbox WHERE record > $1 ORDER BY record LIMIT $2";

/// Delete at most `$2` receipts created before `$1` (past the horizon), found by `receipts_age`.
pub(crate) const EXPIRE_RECEIPTS_SQL: &str = "DELETE FROM {s}.receipts WHERE (consumer_id, source, flow_id, seq) IN
    (SELECT consumer_id, source, flow_id, seq FROM {s}.receipts WHERE created_at_ms < $1 LIMIT $2)";

/// A consumer on PostgreSQL: the inbox, high-water marks, receipts and retired ids of every
/// logical consumer it holds, in one schema, with the user's projection tables in the same
/// database (so a handler's writes commit with the apply). Implements [`ConsumerStore`] with
/// [`ApplyTransaction`] as the handlers' target.
pub struct PgConsumer {
    conn_str: String,
    apply: ApplyTransaction,
    statements: RefCell<Statements>,
    retention: RetentionPolicy,
}

fn read_retention(client: &mut impl GenericClient, schema: &str) -> Result<Option<RetentionPolicy>> {
    Ok(meta_get(client, schema, "consumer.horizon_ms")?
        .and_then(|v| v.parse().ok())
        .map(|horizon_ms| RetentionPolicy { horizon_ms }))
}

fn projection_tables(client: &mut impl GenericClient, schema: &str) -> Result<Vec<String>> {
    let raw = meta_get(client, schema, "consumer.projection_tables")?.unwrap_or_else(|| "[]".into());
    serde_json::from_str(&raw).map_err(|e| Error::store(format!("corrupt consumer.projection_tables: {e}")))
}

/// A page of a consumer's open records (`$1`) with their flows' high-water marks, the page's
/// position and order given by `$tail`. Each record's mark is a lookup of the cursor's primary
/// key (a correlated subquery), not a join: with the statistics of a table that grew since it was
/// last analysed, the planner joined every record of the page to all of the consumer's cursors
/// (1,000 x 1,000 rows filtered, 190-260 ms a page, seen with `auto_explain` in the three-thread
/// pipeline bench; docs/benchmarks.md).
macro_rules! open_records_sql {
    ($tail:literal) => {
        concat!(
            "SELECT i.source, i.flow_id, i.seq, i.event_id, i.generation, i.event_type, i.schema_version, i.payload,
                    i.created_at_ms,
                    COALESCE((SELECT c.high_water_seq FROM {s}.cursors c
                              WHERE c.consumer_id = i.consumer_id AND c.source = i.source AND c.flow_id = i.flow_id), 0),
                    i.record, i.traceparent
             FROM {s}.inbox i
             WHERE i.consumer_id = $1 AND i.status IN ('pending', 'blocked') ",
            $tail
        )
    };
}

impl PgConsumer {
    /// Create (or reopen) a consumer in `schema` of the database at `conn_str`, creating the
    /// schema and migrating it. The retention horizon is set on first init and kept afterwards.
    pub fn init(conn_str: &str, schema: &str, retention: RetentionPolicy) -> Result<PgConsumer> {
        validate_schema_name(schema)?;
        if retention.horizon_ms <= 0 {
            return Err(Error::invalid(codes::INVALID_ARGUMENT, "horizon_ms must be positive"));
        }
        let mut client = schema::connect(conn_str)?;
        schema::migrate(&mut client, schema, true)?;
        let mut tx = client.transaction().db()?;
        lock(&mut tx, LOCK_CONSUMER, schema)?;
        let retention = match read_retention(&mut tx, schema)? {
            Some(existing) => existing,
            None => {
                meta_set(&mut tx, schema, "consumer.horizon_ms", &retention.horizon_ms.to_string())?;
                retention
            }
        };
        tx.commit().db()?;
        Ok(Self::with(conn_str, client, schema, retention))
    }

    /// Open the consumer in `schema` (migrating it forward if it is older). Never creates
    /// anything: a missing schema, or one that is not a consumer's, is `not_initialized`.
    pub fn open(conn_str: &str, schema: &str) -> Result<PgConsumer> {
        validate_schema_name(schema)?;
        let mut client = schema::connect(conn_str)?;
        schema::migrate(&mut client, schema, false)?;
        let retention = read_retention(&mut client, schema)?.ok_or_else(|| {
            Error::invalid(
                codes::NOT_INITIALIZED,
                format!("PostgreSQL schema {schema} is not a consumer's; initialise it as a consumer first"),
            )
        })?;
        Ok(Self::with(conn_str, client, schema, retention))
    }

    fn with(conn_str: &str, client: Client, schema: &str, retention: RetentionPolicy) -> PgConsumer {
        PgConsumer {
            conn_str: conn_str.to_string(),
            apply: ApplyTransaction::new(client, schema),
            statements: RefCell::new(Statements::new(schema)),
            retention,
        }
    }

    /// The PostgreSQL schema this consumer lives in.
    pub fn schema(&self) -> &str {
        self.apply.schema()
    }

    /// The retention horizon this consumer was initialised with.
    pub fn retention(&self) -> RetentionPolicy {
        self.retention
    }

    /// The connection, for reading projections and creating the handler's tables.
    pub fn client(&mut self) -> &mut Client {
        self.apply.client_get_mut()
    }

    /// Register a projection table of the user's in this consumer's schema (it must exist and
    /// have a `consumer_id` column), so that renaming a consumer carries its rows over in the
    /// same transaction as the dedup state. Idempotent.
    pub fn register_projection_table(&mut self, table: &str) -> Result<()> {
        let schema = self.apply.schema().to_string();
        let mut tx = self.apply.client_get_mut().transaction().db()?;
        register_projection_table(&mut tx, &schema, table)?;
        tx.commit().db()
    }

    /// Whether this consumer has received anything for `consumer_id` from `source`.
    pub fn has_received(&self, consumer_id: &str, source: &str) -> Result<bool> {
        validate_id("consumer_id", consumer_id)?;
        validate_id("source", source)?;
        // A record (received, applied or not), a receipt (a pruned record) or a high-water mark.
        let query = sql(
            self.apply.schema(),
            "SELECT EXISTS (SELECT 1 FROM {s}.inbox WHERE consumer_id = $1 AND source = $2)
                 OR EXISTS (SELECT 1 FROM {s}.receipts WHERE consumer_id = $1 AND source = $2)
                 OR EXISTS (SELECT 1 FROM {s}.cursors WHERE consumer_id = $1 AND source = $2)",
        );
        col(&self.apply.with(|c| c.query_one(&query, &[&consumer_id, &source])).db()?, 0)
    }

    /// [`ConsumerStore::snapshot`], and `also` (e.g. the handler's projection tables) read in the
    /// same read-only `REPEATABLE READ` transaction: what `also` sees is the state the snapshot
    /// shows.
    pub fn snapshot_with<T>(
        &self,
        rows_max: usize,
        also: impl FnOnce(&mut Transaction<'_>) -> Result<T>,
    ) -> Result<(ConsumerSnapshot, T)> {
        let mut client = self.apply.client_mut();
        let mut tx = client
            .build_transaction()
            .isolation_level(postgres::IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .db()?;
        let snapshot = snapshot_in(&mut tx, self.apply.schema(), self.retention.horizon_ms, rows_max)?;
        let also = also(&mut tx)?;
        tx.commit().db()?;
        Ok((snapshot, also))
    }

    /// The body of [`ConsumerStore::drain`], inside the transaction the caller opened on
    /// `self.apply`.
    #[allow(clippy::too_many_arguments)]
    fn drain_in(
        apply: &ApplyTransaction,
        statements: &mut Statements,
        consumer_id: &str,
        scope: &DrainScope,
        limit: usize,
        handler: &mut dyn Handler<ApplyTransaction>,
        now_ms: i64,
    ) -> Result<DrainReport> {
        let prepare = |statements: &mut Statements, template: &'static str| -> Result<Statement> {
            apply.with(|c| Ok(statements.get(c, template))).db()?
        };
        let mut drain = PgDrain {
            apply,
            consumer_id,
            scope,
            now_ms,
            page_all: prepare(
                statements,
                open_records_sql!(
                    "AND (i.source, i.flow_id, i.seq) > ($2::text, $3::text, $4::bigint)
                     ORDER BY i.source, i.flow_id, i.seq LIMIT $5"
                ),
            )?,
            page_flow: prepare(
                statements,
                open_records_sql!("AND i.source = $2 AND i.flow_id = $3 AND i.seq > $4 ORDER BY i.seq LIMIT $5"),
            )?,
            mark_blocked: prepare(
                statements,
                "UPDATE {s}.inbox SET status = 'blocked', reason = $2, status_at_ms = $3
                 WHERE record = $1 AND NOT (status = 'blocked' AND reason IS NOT DISTINCT FROM $2)",
            )?,
            savepoint_held: false,
            settled: Settled::default(),
        };
        let report = drain::walk(&mut drain, consumer_id, scope, limit, handler)?;
        if drain.savepoint_held {
            // A handler that returned `Ok` after one of its statements failed left the
            // transaction aborted: this release fails then, and the drain with it.
            drain.command("RELEASE SAVEPOINT apply_one")?;
        }
        drain.settled.write(apply, statements, consumer_id, now_ms)?;
        Ok(report)
    }
}

/// The drain's apply transaction ([`tidemark_core::drain`] decides; this writes). The applied
/// marks and the cursors are written once, at the end ([`DRAIN_SETTLE_SQL`]): nothing the drain
/// reads later looks at them (pages move forward by position, and a flow's walk keeps its mark in
/// memory), so per event the handler's own statements are the only round trips. A released
/// savepoint is released together with the next one's start (one round trip per event, not two).
struct PgDrain<'a> {
    apply: &'a ApplyTransaction,
    consumer_id: &'a str,
    scope: &'a DrainScope,
    now_ms: i64,
    page_all: Statement,
    page_flow: Statement,
    mark_blocked: Statement,
    savepoint_held: bool,
    settled: Settled,
}

impl PgDrain<'_> {
    fn command(&self, command: &str) -> Result<()> {
        self.apply.with(|c| c.batch_execute(command)).db()
    }
}

impl DrainTransaction for PgDrain<'_> {
    type Target = ApplyTransaction;

    fn target(&self) -> &ApplyTransaction {
        self.apply
    }

    fn page(&mut self, after: &DrainPosition) -> Result<Vec<OpenRecord>> {
        let page_rows = DRAIN_PAGE_ROWS as i64;
        let rows = match self.scope {
            DrainScope::All => {
                self.apply.rows(&self.page_all, &[&self.consumer_id, &after.0, &after.1, &after.2, &page_rows])?
            }
            DrainScope::Flow { source, flow_id } => {
                self.apply.rows(&self.page_flow, &[&self.consumer_id, source, flow_id, &after.2, &page_rows])?
            }
        };
        rows.iter()
            .map(|row| {
                Ok(OpenRecord { record: col(row, 10)?, high_water_seq: col(row, 9)?, envelope: open_event(row)? })
            })
            .collect()
    }

    fn savepoint(&mut self) -> Result<()> {
        let held = std::mem::replace(&mut self.savepoint_held, false);
        self.command(if held { "RELEASE SAVEPOINT apply_one; SAVEPOINT apply_one" } else { "SAVEPOINT apply_one" })
    }

    fn release_savepoint(&mut self) -> Result<()> {
        self.savepoint_held = true;
        Ok(())
    }

    fn roll_back_to_savepoint(&mut self) -> Result<()> {
        self.command("ROLLBACK TO SAVEPOINT apply_one; RELEASE SAVEPOINT apply_one")
    }

    fn mark_applied(&mut self, record: i64) -> Result<()> {
        self.settled.records.push(record);
        Ok(())
    }

    fn mark_blocked(&mut self, record: i64, reason: &str) -> Result<()> {
        // Blocked again for the same reason: nothing to write.
        self.apply.run(&self.mark_blocked, &[&record, &reason, &self.now_ms])?;
        Ok(())
    }

    fn move_cursor(&mut self, source: &str, flow_id: &str, start_high_water: i64, high_water: i64) -> Result<()> {
        let moves = if start_high_water == 0 { &mut self.settled.started } else { &mut self.settled.moved };
        moves.0.push(source.to_string());
        moves.1.push(flow_id.to_string());
        moves.2.push(high_water);
        Ok(())
    }
}

/// What a drain writes at its end: the records it applied, and the cursors it moved (existing
/// ones and new ones: source, flow, high-water mark).
#[derive(Default)]
struct Settled {
    records: Vec<i64>,
    moved: (Vec<String>, Vec<String>, Vec<i64>),
    started: (Vec<String>, Vec<String>, Vec<i64>),
}

/// A drain's marks and cursors in one statement (`$1` the consumer, `$2` now): the records
/// applied (`$3`, each while still open), the cursors that existed moved forward (`$4`..`$6`),
/// the new ones inserted (`$7`..`$9`). Answers how many rows of each it wrote.
const DRAIN_SETTLE_SQL: &str = "WITH applied AS (
     UPDATE {s}.inbox SET status = 'applied', reason = NULL, status_at_ms = $2
     WHERE record = ANY($3) AND (status = 'pending' OR status = 'blocked')
     RETURNING 1),
 moved AS (
     UPDATE {s}.cursors c SET high_water_seq = u.high_water_seq
     FROM unnest($4::text[], $5::text[], $6::bigint[]) AS u(source, flow_id, high_water_seq)
     WHERE c.consumer_id = $1 AND c.source = u.source AND c.flow_id = u.flow_id
       AND c.high_water_seq < u.high_water_seq
     RETURNING 1),
 started AS (
     INSERT INTO {s}.cursors (consumer_id, source, flow_id, high_water_seq)
     SELECT $1, u.source, u.flow_id, u.high_water_seq FROM unnest($7::text[], $8::text[], $9::bigint[])
         AS u(source, flow_id, high_water_seq)
     RETURNING 1)
 SELECT (SELECT count(*) FROM applied), (SELECT count(*) FROM moved), (SELECT count(*) FROM started)";

impl Settled {
    fn write(
        &self,
        apply: &ApplyTransaction,
        statements: &mut Statements,
        consumer_id: &str,
        now_ms: i64,
    ) -> Result<()> {
        if self.records.is_empty() {
            ensure_invariant!(
                self.moved.0.is_empty() && self.started.0.is_empty(),
                "a drain moved cursors it applied nothing for"
            );
            return Ok(());
        }
        let (m, n) = (&self.moved, &self.started);
        let settle = apply.with(|c| Ok(statements.get(c, DRAIN_SETTLE_SQL))).db()??;
        let row = apply
            .with(|c| c.query_one(&settle, &[&consumer_id, &now_ms, &self.records, &m.0, &m.1, &m.2, &n.0, &n.1, &n.2]))
            .db()?;
        let written: (i64, i64, i64) = (col(&row, 0)?, col(&row, 1)?, col(&row, 2)?);
        let expected = (self.records.len() as i64, m.0.len() as i64, n.0.len() as i64);
        ensure_invariant!(
            written == expected,
            "a drain settled (records applied, cursors moved, cursors started) {written:?}, not {expected:?}"
        );
        Ok(())
    }
}

fn open_event(r: &Row) -> Result<Envelope> {
    let payload: String = col(r, 7)?;
    Ok(Envelope {
        source: col(r, 0)?,
        flow_id: col(r, 1)?,
        seq: col(r, 2)?,
        event_id: col(r, 3)?,
        generation: col(r, 4)?,
        event_type: col(r, 5)?,
        schema_version: col_u32(r, 6)?,
        payload: serde_json::from_str(&payload).map_err(|e| Error::store(format!("corrupt inbox payload: {e}")))?,
        created_at_ms: col(r, 8)?,
        traceparent: col(r, 11)?,
    })
}

fn consumer_has_state(tx: &mut Transaction<'_>, schema: &str, consumer_id: &str) -> Result<bool> {
    let query = sql(
        schema,
        "SELECT EXISTS (SELECT 1 FROM {s}.inbox WHERE consumer_id = $1)
             OR EXISTS (SELECT 1 FROM {s}.receipts WHERE consumer_id = $1)
             OR EXISTS (SELECT 1 FROM {s}.cursors WHERE consumer_id = $1)",
    );
    col(&tx.query_one(&query, &[&consumer_id]).db()?, 0)
}

fn renamed_to(tx: &mut Transaction<'_>, schema: &str, consumer_id: &str) -> Result<Option<String>> {
    let query = sql(schema, "SELECT renamed_to FROM {s}.retired_consumers WHERE consumer_id = $1");
    tx.query_opt(&query, &[&consumer_id]).db()?.map(|r| col(&r, 0)).transpose()
}

fn retire(tx: &mut Transaction<'_>, schema: &str, from: &str, to: &str, now_ms: i64) -> Result<()> {
    tx.execute(&sql(schema, "DELETE FROM {s}.retired_consumers WHERE consumer_id = $1"), &[&to]).db()?;
    tx.execute(
        &sql(
            schema,
            "INSERT INTO {s}.retired_consumers (consumer_id, renamed_to, retired_at_ms) VALUES ($1, $2, $3)
             ON CONFLICT (consumer_id) DO UPDATE SET renamed_to = excluded.renamed_to, retired_at_ms = excluded.retired_at_ms",
        ),
        &[&from, &to, &now_ms],
    )
    .db()?;
    Ok(())
}

struct ExistingRecord {
    event_id: String,
    content_hash: String,
    generation: Option<String>,
}

fn conflict_reason(existing: &ExistingRecord, event: &Envelope, hash: &str, place: &str) -> Option<String> {
    if existing.event_id == event.event_id && existing.content_hash == hash {
        return None;
    }
    let mut reason = if existing.event_id != event.event_id {
        format!(
            "{}/{}/{} is already held ({place}) as event {}; got event {}",
            event.source, event.flow_id, event.seq, existing.event_id, event.event_id
        )
    } else {
        format!("event {} is already held ({place}) with different content", event.event_id)
    };
    if let Some(generation) = &existing.generation {
        if generation != &event.generation {
            reason.push_str(&format!(
                "; producer generation changed from {generation} to {} (restored or re-created producer?)",
                event.generation
            ));
        }
    }
    Some(reason)
}

/// The statements of one receive batch.
struct ReceiveStatements {
    probe: Statement,
    insert: Statement,
    insert_all: Statement,
}

/// One statement looks everything up: the record at this position (inbox, then receipt), the
/// same event id at another position, and the flow's high-water mark.
const RECEIVE_PROBE_SQL: &str = "SELECT 0, event_id, content_hash, generation, NULL::text, NULL::text, NULL::bigint
   FROM {s}.inbox WHERE consumer_id = $1 AND source = $2 AND flow_id = $3 AND seq = $4
 UNION ALL SELECT 1, event_id, content_hash, generation, NULL, NULL, NULL
   FROM {s}.receipts WHERE consumer_id = $1 AND source = $2 AND flow_id = $3 AND seq = $4
 UNION ALL SELECT 2, NULL, NULL, NULL, source, flow_id, seq FROM {s}.inbox WHERE consumer_id = $1 AND event_id = $5
 UNION ALL SELECT 2, NULL, NULL, NULL, source, flow_id, seq FROM {s}.receipts WHERE consumer_id = $1 AND event_id = $5
 UNION ALL SELECT 3, NULL, NULL, NULL, NULL, NULL, high_water_seq
   FROM {s}.cursors WHERE consumer_id = $1 AND source = $2 AND flow_id = $3";

const RECEIVE_INSERT_SQL: &str =
    "INSERT INTO {s}.inbox (consumer_id, source, flow_id, seq, event_id, generation, event_type,
     schema_version, payload, content_hash, created_at_ms, received_at_ms, status, status_at_ms, traceparent)
 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, 'pending', $12, $13)";

/// The high-water marks of the flows a receive batch names (`$1`..`$3`: consumer, source and
/// flow of each).
const HIGH_WATERS_SQL: &str = "SELECT c.consumer_id, c.source, c.flow_id, c.high_water_seq FROM {s}.cursors c
 WHERE (c.consumer_id, c.source, c.flow_id) IN (SELECT * FROM unnest($1::text[], $2::text[], $3::text[]))";

/// Which of a receive batch's event ids (`$1`, with their consumers `$2`) a receipt holds.
const RECEIPTS_OF_IDS_SQL: &str = "SELECT r.event_id, r.consumer_id FROM {s}.receipts r
 WHERE (r.event_id, r.consumer_id) IN (SELECT * FROM unnest($1::text[], $2::text[]))";

/// The new events of a receive batch, inserted in batch order (`$1` now); an event a uniqueness
/// constraint refuses is left out and answered by the probe. Returns what it inserted.
const RECEIVE_INSERT_ALL_SQL: &str = "INSERT INTO {s}.inbox (consumer_id, source, flow_id, seq, event_id, generation,
     event_type, schema_version, payload, content_hash, created_at_ms, received_at_ms, status, status_at_ms,
     traceparent)
 SELECT u.consumer_id, u.source, u.flow_id, u.seq, u.event_id, u.generation, u.event_type, u.schema_version,
        u.payload, u.content_hash, u.created_at_ms, $1, 'pending', $1, u.traceparent
 FROM unnest($2::text[], $3::text[], $4::text[], $5::bigint[], $6::text[], $7::text[], $8::text[], $9::integer[],
             $10::text[], $11::text[], $12::bigint[], $13::text[]) WITH ORDINALITY
     AS u(consumer_id, source, flow_id, seq, event_id, generation, event_type, schema_version, payload,
          content_hash, created_at_ms, traceparent, at)
 ORDER BY u.at
 ON CONFLICT DO NOTHING
 RETURNING consumer_id, source, flow_id, seq, event_id";

/// An event of a receive batch with what its rows need.
struct Received<'a> {
    consumer_id: &'a str,
    event: &'a Envelope,
    hash: String,
    schema_version: i32,
}

impl<'a> Received<'a> {
    fn new(consumer_id: &'a str, event: &'a Envelope) -> Result<Self> {
        let schema_version = i32::try_from(event.schema_version)
            .map_err(|_| Error::invalid(codes::INVALID_SCHEMA_VERSION, "schema version out of range"))?;
        Ok(Received { consumer_id, event, hash: event.content_hash(), schema_version })
    }
}

/// Insert the events `at` of `items` (new by every check made before: not expired, above the
/// high-water mark, no receipt of their id) in one statement, and answer each: `accepted` when
/// inserted, else what the probe finds in its way ([`receive_probed`]), in batch order.
fn receive_new(
    tx: &mut Transaction<'_>,
    statements: &ReceiveStatements,
    items: &[Received<'_>],
    at: &[usize],
    outcomes: &mut [Option<ReceiveOutcome>],
    now_ms: i64,
    retention: RetentionPolicy,
) -> Result<()> {
    if at.is_empty() {
        return Ok(());
    }
    let column = |f: &dyn Fn(&Received<'_>) -> String| at.iter().map(|&i| f(&items[i])).collect::<Vec<String>>();
    let consumers = column(&|r| r.consumer_id.to_string());
    let sources = column(&|r| r.event.source.clone());
    let flows = column(&|r| r.event.flow_id.clone());
    let event_ids = column(&|r| r.event.event_id.clone());
    let generations = column(&|r| r.event.generation.clone());
    let types = column(&|r| r.event.event_type.clone());
    let payloads = column(&|r| r.event.payload.to_string());
    let hashes = column(&|r| r.hash.clone());
    let seqs: Vec<i64> = at.iter().map(|&i| items[i].event.seq).collect();
    let versions: Vec<i32> = at.iter().map(|&i| items[i].schema_version).collect();
    let created: Vec<i64> = at.iter().map(|&i| items[i].event.created_at_ms).collect();
    let traceparents: Vec<Option<&str>> = at.iter().map(|&i| items[i].event.traceparent.as_deref()).collect();
    let inserted = tx
        .query(
            &statements.insert_all,
            &[
                &now_ms,
                &consumers,
                &sources,
                &flows,
                &seqs,
                &event_ids,
                &generations,
                &types,
                &versions,
                &payloads,
                &hashes,
                &created,
                &traceparents,
            ],
        )
        .db()?;
    let mut inserted: HashMap<(String, String, String, i64, String), ()> = inserted
        .iter()
        .map(|r| Ok(((col(r, 0)?, col(r, 1)?, col(r, 2)?, col(r, 3)?, col(r, 4)?), ())))
        .collect::<Result<_>>()?;
    for &i in at {
        let Received { consumer_id, event, .. } = items[i];
        let key =
            (consumer_id.to_string(), event.source.clone(), event.flow_id.clone(), event.seq, event.event_id.clone());
        // Each inserted row answers the first event of the batch that carried it.
        outcomes[i] = Some(if inserted.remove(&key).is_some() {
            ReceiveOutcome::Accepted { consumer_id: consumer_id.to_string(), event_id: event.event_id.clone() }
        } else {
            receive_probed(tx, statements, &items[i], now_ms, retention)?
        });
    }
    Ok(())
}

/// Receive one event the batch could not insert as new: the probe tells a duplicate, a conflict
/// (another record at its position, its id at another position, a position at or below the
/// high-water mark with no record left) or an expired event; an event none of these holds is
/// inserted.
fn receive_probed(
    tx: &mut Transaction<'_>,
    statements: &ReceiveStatements,
    item: &Received<'_>,
    now_ms: i64,
    retention: RetentionPolicy,
) -> Result<ReceiveOutcome> {
    let Received { consumer_id, event, ref hash, schema_version } = *item;
    let expired = event.created_at_ms < now_ms.saturating_sub(retention.horizon_ms);
    let consumer = consumer_id.to_string();
    let event_id = event.event_id.clone();
    let duplicate = || ReceiveOutcome::Duplicate { consumer_id: consumer.clone(), event_id: event_id.clone() };
    let conflict =
        |reason: String| ReceiveOutcome::Conflict { consumer_id: consumer.clone(), event_id: event_id.clone(), reason };
    let mut at_inbox: Option<ExistingRecord> = None;
    let mut at_receipt: Option<ExistingRecord> = None;
    let mut id_elsewhere: Option<(String, String, i64)> = None;
    let mut high_water_seq = 0_i64;
    let rows = tx
        .query(&statements.probe, &[&consumer_id, &event.source, &event.flow_id, &event.seq, &event.event_id])
        .db()?;
    for r in &rows {
        match col::<i32>(r, 0)? {
            kind @ (0 | 1) => {
                let existing =
                    ExistingRecord { event_id: col(r, 1)?, content_hash: col(r, 2)?, generation: col(r, 3)? };
                if kind == 0 {
                    at_inbox = Some(existing);
                } else {
                    at_receipt = Some(existing);
                }
            }
            2 => {
                let place: (String, String, i64) = (col(r, 4)?, col(r, 5)?, col(r, 6)?);
                let same_position = place.0 == event.source && place.1 == event.flow_id && place.2 == event.seq;
                if !same_position {
                    id_elsewhere = Some(place);
                }
            }
            _ => high_water_seq = col(r, 6)?,
        }
    }
    for (existing, place) in [(at_inbox, "inbox"), (at_receipt, "receipt")] {
        if let Some(existing) = existing {
            return Ok(match conflict_reason(&existing, event, hash, place) {
                None => duplicate(),
                Some(reason) => conflict(reason),
            });
        }
    }
    if let Some((source, flow, seq)) = id_elsewhere {
        return Ok(conflict(format!(
            "event id {} is already held for {source}/{flow}/{seq}; got it for {}/{}/{}",
            event.event_id, event.source, event.flow_id, event.seq
        )));
    }
    if expired {
        return Ok(ReceiveOutcome::Expired { consumer_id: consumer, event_id, horizon_ms: retention.horizon_ms });
    }
    if event.seq <= high_water_seq {
        return Ok(conflict(format!(
            "seq {} is at or below the high-water mark {high_water_seq} of {}/{} but no record or receipt of it remains",
            event.seq, event.source, event.flow_id
        )));
    }
    let payload = event.payload.to_string();
    tx.execute(
        &statements.insert,
        &[
            &consumer_id,
            &event.source,
            &event.flow_id,
            &event.seq,
            &event.event_id,
            &event.generation,
            &event.event_type,
            &schema_version,
            &payload,
            hash,
            &event.created_at_ms,
            &now_ms,
            &event.traceparent,
        ],
    )
    .db()?;
    Ok(ReceiveOutcome::Accepted { consumer_id: consumer, event_id })
}

const INBOX_COLUMNS: &str =
    "consumer_id, source, flow_id, seq, event_id, generation, event_type, schema_version, payload,
    content_hash, created_at_ms, received_at_ms, status, reason, traceparent";

fn inbox_entry(r: &Row) -> Result<InboxEntry> {
    let payload: String = col(r, 8)?;
    let status: String = col(r, 12)?;
    Ok(InboxEntry {
        consumer_id: col(r, 0)?,
        envelope: Envelope {
            source: col(r, 1)?,
            flow_id: col(r, 2)?,
            seq: col(r, 3)?,
            event_id: col(r, 4)?,
            generation: col(r, 5)?,
            event_type: col(r, 6)?,
            schema_version: col_u32(r, 7)?,
            payload: serde_json::from_str(&payload).map_err(|e| Error::store(format!("corrupt inbox payload: {e}")))?,
            created_at_ms: col(r, 10)?,
            traceparent: col(r, 14)?,
        },
        content_hash: col(r, 9)?,
        status: InboxStatus::parse(&status).ok_or_else(|| Error::store(format!("unknown inbox status {status:?}")))?,
        reason: col(r, 13)?,
        received_at_ms: col(r, 11)?,
    })
}

fn set_cursor(
    tx: &mut Transaction<'_>,
    schema: &str,
    consumer_id: &str,
    source: &str,
    flow_id: &str,
    high_water_seq: i64,
) -> Result<()> {
    tx.execute(
        &sql(
            schema,
            "INSERT INTO {s}.cursors (consumer_id, source, flow_id, high_water_seq) VALUES ($1, $2, $3, $4)
             ON CONFLICT (consumer_id, source, flow_id) DO UPDATE SET high_water_seq = excluded.high_water_seq
             WHERE excluded.high_water_seq > {s}.cursors.high_water_seq",
        ),
        &[&consumer_id, &source, &flow_id, &high_water_seq],
    )
    .db()?;
    Ok(())
}

fn high_water(tx: &mut Transaction<'_>, schema: &str, consumer_id: &str, source: &str, flow_id: &str) -> Result<i64> {
    let query =
        sql(schema, "SELECT high_water_seq FROM {s}.cursors WHERE consumer_id = $1 AND source = $2 AND flow_id = $3");
    Ok(tx.query_opt(&query, &[&consumer_id, &source, &flow_id]).db()?.map(|r| col(&r, 0)).transpose()?.unwrap_or(0))
}

impl ConsumerStore for PgConsumer {
    type Target = ApplyTransaction;

    fn reconnect_if_closed(&mut self) -> Result<()> {
        if !self.apply.client_get_mut().is_closed() {
            return Ok(());
        }
        let schema = self.apply.schema().to_string();
        self.apply = ApplyTransaction::new(schema::connect(&self.conn_str)?, &schema);
        // Prepared statements belong to the closed connection.
        *self.statements.get_mut() = Statements::new(&schema);
        Ok(())
    }

    fn receive_batch(&mut self, items: &[(&str, &Envelope)], now_ms: i64) -> Result<Vec<ReceiveOutcome>> {
        validate_limit("receive batch", items.len(), RECEIVE_BATCH_EVENTS_MAX)?;
        for (consumer_id, event) in items {
            validate_id("consumer_id", consumer_id)?;
            event.validate()?;
        }
        let items = items.iter().map(|(c, e)| Received::new(c, e)).collect::<Result<Vec<_>>>()?;
        let retention = self.retention;
        let schema = self.apply.schema().to_string();
        let cache = self.statements.get_mut();
        let mut tx = self.apply.client_get_mut().transaction().db()?;
        lock(&mut tx, LOCK_CONSUMER, &schema)?;
        let statements = ReceiveStatements {
            probe: cache.get(&mut tx, RECEIVE_PROBE_SQL)?,
            insert: cache.get(&mut tx, RECEIVE_INSERT_SQL)?,
            insert_all: cache.get(&mut tx, RECEIVE_INSERT_ALL_SQL)?,
        };
        let mut outcomes: Vec<Option<ReceiveOutcome>> = Vec::with_capacity(items.len());
        // Consumers renamed away are refused (each looked up once).
        let mut retired: HashMap<&str, Option<String>> = HashMap::new();
        for item in &items {
            if !retired.contains_key(item.consumer_id) {
                let renamed = renamed_to(&mut tx, &schema, item.consumer_id)?;
                retired.insert(item.consumer_id, renamed);
            }
            outcomes.push(retired.get(item.consumer_id).cloned().flatten().map(|renamed_to| {
                ReceiveOutcome::Conflict {
                    consumer_id: item.consumer_id.to_string(),
                    event_id: item.event.event_id.clone(),
                    reason: format!(
                        "consumer {} was renamed to {renamed_to}; rename the producer's subscription too",
                        item.consumer_id
                    ),
                }
            }));
        }
        // The fast path for new events (see SQLite's `receive_one`): not expired, above the
        // high-water mark, no receipt of their id, and an insert no uniqueness constraint refuses.
        // The marks and receipts of the whole batch are read in one statement each (neither
        // changes during a receive), and the new events are inserted in one.
        let open: Vec<usize> = (0..items.len()).filter(|&i| outcomes[i].is_none()).collect();
        let fresh: Vec<usize> = open
            .iter()
            .copied()
            .filter(|&i| items[i].event.created_at_ms >= now_ms.saturating_sub(retention.horizon_ms))
            .collect();
        let mut high_water: HashMap<(String, String, String), i64> = HashMap::new();
        let mut held_ids: HashSet<(String, String)> = HashSet::new();
        if !fresh.is_empty() {
            let fresh_items = || fresh.iter().map(|&i| &items[i]);
            let consumers: Vec<&str> = fresh_items().map(|r| r.consumer_id).collect();
            let sources: Vec<&str> = fresh_items().map(|r| r.event.source.as_str()).collect();
            let flows: Vec<&str> = fresh_items().map(|r| r.event.flow_id.as_str()).collect();
            let marks = cache.get(&mut tx, HIGH_WATERS_SQL)?;
            for row in tx.query(&marks, &[&consumers, &sources, &flows]).db()? {
                high_water.insert((col(&row, 0)?, col(&row, 1)?, col(&row, 2)?), col(&row, 3)?);
            }
            let receipts = cache.get(&mut tx, RECEIPTS_OF_IDS_SQL)?;
            let ids: Vec<&str> = fresh_items().map(|r| r.event.event_id.as_str()).collect();
            for row in tx.query(&receipts, &[&ids, &consumers]).db()? {
                held_ids.insert((col(&row, 0)?, col(&row, 1)?));
            }
        }
        let is_new = |i: usize| {
            let r = &items[i];
            let (consumer, event) = (r.consumer_id.to_string(), r.event);
            let mark = high_water.get(&(consumer.clone(), event.source.clone(), event.flow_id.clone()));
            event.seq > mark.copied().unwrap_or(0) && !held_ids.contains(&(event.event_id.clone(), consumer))
        };
        let new: Vec<bool> = (0..items.len()).map(|i| fresh.binary_search(&i).is_ok() && is_new(i)).collect();
        // In batch order: a run of new events is inserted at once before the next event that is
        // not new is probed, so each event meets exactly the records of the events before it.
        let mut run: Vec<usize> = Vec::new();
        for i in open {
            if new[i] {
                run.push(i);
                continue;
            }
            receive_new(&mut tx, &statements, &items, &run, &mut outcomes, now_ms, retention)?;
            run.clear();
            outcomes[i] = Some(receive_probed(&mut tx, &statements, &items[i], now_ms, retention)?);
        }
        receive_new(&mut tx, &statements, &items, &run, &mut outcomes, now_ms, retention)?;
        crash::hit("receive.before_commit");
        tx.commit().db()?;
        crash::hit("receive.after_commit");
        outcomes
            .into_iter()
            .map(|o| o.ok_or_else(|| Error::Invariant("a received event was left unanswered".into())))
            .collect()
    }

    fn drain(
        &mut self,
        consumer_id: &str,
        scope: &DrainScope,
        limit: usize,
        handler: &mut dyn Handler<ApplyTransaction>,
        now_ms: i64,
    ) -> Result<DrainReport> {
        validate_id("consumer_id", consumer_id)?;
        validate_limit("drain limit", limit, DRAIN_BATCH_EVENTS_MAX)?;
        if let DrainScope::Flow { source, flow_id } = scope {
            validate_id("source", source)?;
            validate_id("flow_id", flow_id)?;
        }
        let apply = &self.apply;
        let statements = self.statements.get_mut();
        // The transaction is begun and ended by hand (not a `postgres::Transaction`), because the
        // handler is handed the connection itself, wrapped so that it can run statements but not
        // end the transaction. A handler that panics unwinds through `open`, which rolls back.
        let open = OpenTransaction::begin(apply)?;
        lock(&mut *apply.client_mut(), LOCK_CONSUMER, apply.schema())?;
        let report = Self::drain_in(apply, statements, consumer_id, scope, limit, handler, now_ms)?;
        crash::hit("apply.before_commit");
        open.commit()?;
        crash::hit("apply.after_commit");
        Ok(report)
    }

    fn inbox(&self, consumer_id: &str, status: Option<InboxStatus>, limit: usize) -> Result<Vec<InboxEntry>> {
        validate_id("consumer_id", consumer_id)?;
        validate_limit("page size", limit, PAGE_SIZE_MAX)?;
        let query = sql(
            self.apply.schema(),
            &format!(
                "SELECT {INBOX_COLUMNS} FROM {{s}}.inbox WHERE consumer_id = $1 AND ($2::text IS NULL OR status = $2)
                 ORDER BY source, flow_id, seq LIMIT $3"
            ),
        );
        let rows = self
            .apply
            .with(|c| c.query(&query, &[&consumer_id, &status.map(InboxStatus::as_str), &(limit as i64)]))
            .db()?;
        rows.iter().map(inbox_entry).collect()
    }

    fn skip_blocked(&mut self, consumer_id: &str, event_id: &str, reason: &str, now_ms: i64) -> Result<InboxEntry> {
        validate_id("consumer_id", consumer_id)?;
        validate_id("event_id", event_id)?;
        validate_reason(reason)?;
        let schema = self.apply.schema().to_string();
        let mut tx = self.apply.client_get_mut().transaction().db()?;
        lock(&mut tx, LOCK_CONSUMER, &schema)?;
        let select =
            sql(&schema, &format!("SELECT {INBOX_COLUMNS} FROM {{s}}.inbox WHERE consumer_id = $1 AND event_id = $2"));
        let entry = tx
            .query_opt(&select, &[&consumer_id, &event_id])
            .db()?
            .map(|r| inbox_entry(&r))
            .transpose()?
            .ok_or_else(|| Error::not_found(format!("consumer {consumer_id} holds no event {event_id}")))?;
        if entry.status != InboxStatus::Blocked {
            return Err(Error::invalid(
                codes::INVALID_STATE_CHANGE,
                format!("only blocked records can be skipped; event {event_id} is {}", entry.status.as_str()),
            ));
        }
        let event = &entry.envelope;
        let high_water = high_water(&mut tx, &schema, consumer_id, &event.source, &event.flow_id)?;
        ensure_invariant!(high_water + 1 == event.seq, "blocked seq {} is not high-water {high_water} + 1", event.seq);
        tx.execute(
            &sql(&schema, "UPDATE {s}.inbox SET status = 'skipped', reason = $3, status_at_ms = $4 WHERE consumer_id = $1 AND event_id = $2"),
            &[&consumer_id, &event_id, &format!("skipped by operator: {reason}"), &now_ms],
        )
        .db()?;
        set_cursor(&mut tx, &schema, consumer_id, &event.source, &event.flow_id, event.seq)?;
        let skipped = inbox_entry(&tx.query_one(&select, &[&consumer_id, &event_id]).db()?)?;
        crash::hit("resolve.before_commit");
        tx.commit().db()?;
        Ok(skipped)
    }

    fn prune(&mut self, applied_retention_ms: i64, batch_rows: usize, now_ms: i64) -> Result<PruneReport> {
        validate_limit("prune batch", batch_rows, PRUNE_BATCH_ROWS_MAX)?;
        if applied_retention_ms < 0 {
            return Err(Error::invalid(codes::INVALID_ARGUMENT, "applied retention must be >= 0"));
        }
        let horizon_ms = self.retention.horizon_ms;
        let schema = self.apply.schema().to_string();
        let statements = self.statements.get_mut();
        let mut tx = self.apply.client_get_mut().transaction().db()?;
        lock(&mut tx, LOCK_CONSUMER, &schema)?;
        // Oldest first by record (receive order), in pages of one indexed range read each
        // (`inbox_pkey`), stopping at the first record received after the cutoff; open records
        // and records applied after the cutoff are passed over.
        let cutoff = now_ms.saturating_sub(applied_retention_ms);
        let page = statements.get(&mut tx, PRUNE_PAGE_SQL)?;
        let mut done: Vec<i64> = Vec::new();
        let mut after = 0_i64;
        'pages: loop {
            let rows = tx.query(&page, &[&after, &PRUNE_PAGE_ROWS, &cutoff]).db()?;
            for row in &rows {
                if done.len() == batch_rows {
                    break 'pages;
                }
                let (record, received_at_ms): (i64, i64) = (col(row, 0)?, col(row, 1)?);
                after = record;
                if retention_walk_stops_at(received_at_ms, cutoff.saturating_add(1), now_ms) {
                    break 'pages;
                }
                if col::<bool>(row, 2)? {
                    done.push(record);
                }
            }
            if (rows.len() as i64) < PRUNE_PAGE_ROWS {
                break;
            }
        }
        let copy = statements.get(
            &mut tx,
            "INSERT INTO {s}.receipts (consumer_id, source, flow_id, seq, event_id, content_hash, created_at_ms, generation)
             SELECT consumer_id, source, flow_id, seq, event_id, content_hash, created_at_ms, generation
             FROM {s}.inbox WHERE record = $1",
        )?;
        let remove = statements.get(&mut tx, "DELETE FROM {s}.inbox WHERE record = $1")?;
        for record in &done {
            let copied = tx.execute(&copy, &[record]).db()?;
            let removed = tx.execute(&remove, &[record]).db()?;
            ensure_invariant!(
                copied == 1 && removed == 1,
                "compacting inbox record {record} touched {copied}/{removed} rows"
            );
        }
        let compacted = done.len();
        let expire = statements.get(&mut tx, EXPIRE_RECEIPTS_SQL)?;
        let receipts_deleted = tx.execute(&expire, &[&now_ms.saturating_sub(horizon_ms), &(batch_rows as i64)]).db()?;
        crash::hit("prune.before_commit");
        tx.commit().db()?;
        crash::hit("prune.after_commit");
        Ok(PruneReport {
            compacted: compacted as u64,
            receipts_deleted,
            more: compacted == batch_rows || receipts_deleted as usize == batch_rows,
        })
    }

    fn rename_consumer(&mut self, from: &str, to: &str, now_ms: i64) -> Result<RenameReport> {
        validate_rename(from, to)?;
        let schema = self.apply.schema().to_string();
        let mut tx = self.apply.client_get_mut().transaction().db()?;
        lock(&mut tx, LOCK_CONSUMER, &schema)?;
        if !consumer_has_state(&mut tx, &schema, from)? {
            if renamed_to(&mut tx, &schema, from)?.as_deref() == Some(to) {
                return Ok(RenameReport { inbox: 0, receipts: 0, cursors: 0, projections: 0 });
            }
            return Err(Error::not_found(format!("consumer {from:?} has no state in this database")));
        }
        if consumer_has_state(&mut tx, &schema, to)? {
            return Err(Error::invalid(
                codes::ALREADY_EXISTS,
                format!("consumer {to:?} already has state; pick an unused id"),
            ));
        }
        let mut moved = |table: &str| -> Result<u64> {
            tx.execute(
                &sql(&schema, &format!("UPDATE {{s}}.\"{table}\" SET consumer_id = $2 WHERE consumer_id = $1")),
                &[&from, &to],
            )
            .db()
        };
        let (inbox, receipts, cursors) = (moved("inbox")?, moved("receipts")?, moved("cursors")?);
        let mut projections = 0;
        for table in projection_tables(&mut tx, &schema)? {
            validate_schema_name(&table)?;
            projections += tx
                .execute(
                    &sql(&schema, &format!("UPDATE {{s}}.\"{table}\" SET consumer_id = $2 WHERE consumer_id = $1")),
                    &[&from, &to],
                )
                .db()?;
        }
        retire(&mut tx, &schema, from, to, now_ms)?;
        crash::hit("rename.before_commit");
        tx.commit().db()?;
        crash::hit("rename.after_commit");
        Ok(RenameReport { inbox, receipts, cursors, projections })
    }

    fn retire_consumer(&mut self, from: &str, to: &str, now_ms: i64) -> Result<()> {
        validate_rename(from, to)?;
        let schema = self.apply.schema().to_string();
        let mut tx = self.apply.client_get_mut().transaction().db()?;
        lock(&mut tx, LOCK_CONSUMER, &schema)?;
        if consumer_has_state(&mut tx, &schema, from)? {
            return Err(Error::invalid(
                codes::INVALID_STATE_CHANGE,
                format!("consumer {from:?} has state in this database; rename it, which carries the state over"),
            ));
        }
        if consumer_has_state(&mut tx, &schema, to)? {
            return Err(Error::invalid(
                codes::ALREADY_EXISTS,
                format!("consumer {to:?} already has state; pick an unused id"),
            ));
        }
        if let Some(other) = renamed_to(&mut tx, &schema, from)?.filter(|other| other != to) {
            return Err(Error::invalid(
                codes::INVALID_STATE_CHANGE,
                format!("consumer {from:?} was already renamed to {other:?}; finish that rename instead"),
            ));
        }
        retire(&mut tx, &schema, from, to, now_ms)?;
        crash::hit("rename.before_commit");
        tx.commit().db()?;
        crash::hit("rename.after_commit");
        Ok(())
    }

    fn cursors(&self, consumer_id: Option<&str>) -> Result<Vec<FlowCursor>> {
        if let Some(id) = consumer_id {
            validate_id("consumer_id", id)?;
        }
        let query = sql(
            self.apply.schema(),
            "SELECT consumer_id, source, flow_id, high_water_seq FROM {s}.cursors
             WHERE $1::text IS NULL OR consumer_id = $1 ORDER BY consumer_id, source, flow_id LIMIT $2",
        );
        let rows = self.apply.with(|c| c.query(&query, &[&consumer_id, &(PAGE_SIZE_MAX as i64)])).db()?;
        rows.iter().map(flow_cursor).collect()
    }

    fn snapshot(&self, rows_max: usize) -> Result<ConsumerSnapshot> {
        Ok(self.snapshot_with(rows_max, |_| Ok(()))?.0)
    }
}

fn flow_cursor(r: &Row) -> Result<FlowCursor> {
    Ok(FlowCursor { consumer_id: col(r, 0)?, source: col(r, 1)?, flow_id: col(r, 2)?, high_water_seq: col(r, 3)? })
}

/// The dedup tables, read on `tx` (one read transaction the caller holds open).
fn snapshot_in(tx: &mut Transaction<'_>, schema: &str, horizon_ms: i64, rows_max: usize) -> Result<ConsumerSnapshot> {
    let limit = rows_max as i64;
    let inbox = tx
        .query(
            &sql(
                schema,
                &format!("SELECT {INBOX_COLUMNS} FROM {{s}}.inbox ORDER BY consumer_id, source, flow_id, seq LIMIT $1"),
            ),
            &[&limit],
        )
        .db()?
        .iter()
        .map(inbox_entry)
        .collect::<Result<Vec<_>>>()?;
    let receipts = tx
        .query(
            &sql(
                schema,
                "SELECT consumer_id, event_id, source, flow_id, seq, content_hash, created_at_ms, generation FROM {s}.receipts
                 ORDER BY consumer_id, source, flow_id, seq LIMIT $1",
            ),
            &[&limit],
        )
        .db()?
        .iter()
        .map(|r| {
            Ok(Receipt {
                consumer_id: col(r, 0)?,
                event_id: col(r, 1)?,
                source: col(r, 2)?,
                flow_id: col(r, 3)?,
                seq: col(r, 4)?,
                content_hash: col(r, 5)?,
                created_at_ms: col(r, 6)?,
                generation: col(r, 7)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let cursors = tx
        .query(
            &sql(schema, "SELECT consumer_id, source, flow_id, high_water_seq FROM {s}.cursors ORDER BY consumer_id, source, flow_id LIMIT $1"),
            &[&limit],
        )
        .db()?
        .iter()
        .map(flow_cursor)
        .collect::<Result<Vec<_>>>()?;
    Ok(ConsumerSnapshot { horizon_ms, inbox, receipts, cursors })
}

/// [`PgConsumer::register_projection_table`] inside a transaction of the caller's (a user
/// migration's, `Migration::with`): takes the consumer schema's lock, which the transaction holds
/// until it ends.
pub fn register_projection_table(tx: &mut impl GenericClient, schema: &str, table: &str) -> Result<()> {
    validate_schema_name(table)?;
    lock(tx, LOCK_CONSUMER, schema)?;
    let has_consumer_id: bool = col(
        &tx.query_one(
            "SELECT EXISTS (SELECT 1 FROM information_schema.columns
                 WHERE table_schema = $1 AND table_name = $2 AND column_name = 'consumer_id')",
            &[&schema, &table],
        )
        .db()?,
        0,
    )?;
    if !has_consumer_id {
        return Err(Error::invalid(
            codes::INVALID_ARGUMENT,
            format!("table {schema}.{table} does not exist or has no consumer_id column"),
        ));
    }
    let mut tables = projection_tables(tx, schema)?;
    if !tables.iter().any(|t| t == table) {
        tables.push(table.to_string());
        meta_set(
            tx,
            schema,
            "consumer.projection_tables",
            &serde_json::to_string(&tables).expect("strings serialise"),
        )?;
    }
    Ok(())
}
