//! The consumer store: inboxes scoped by consumer, cursors (high-water marks), compact receipts,
//! and the apply loop that runs user handlers inside the transaction that marks events applied.

use std::collections::HashMap;
use std::path::Path;

use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};
use tidemark_core::crash;
use tidemark_core::drain::{self, DrainPosition, DrainTransaction, OpenRecord, DRAIN_PAGE_ROWS};
use tidemark_core::error::codes;
use tidemark_core::id::{validate_id, validate_limit, validate_reason, validate_rename};
use tidemark_core::limits::{DRAIN_BATCH_EVENTS_MAX, PAGE_SIZE_MAX, PRUNE_BATCH_ROWS_MAX, RECEIVE_BATCH_EVENTS_MAX};
use tidemark_core::policy::{retention_walk_stops_at, RetentionPolicy};
use tidemark_core::store::{
    ConsumerSnapshot, ConsumerStore, DrainReport, DrainScope, FlowCursor, Handler, InboxEntry, InboxStatus,
    PruneReport, Receipt, ReceiveOutcome, RenameReport,
};
use tidemark_core::{ensure_invariant, Envelope, Error, Result};

use crate::schema::{self, meta_get, meta_set, Durability};
use crate::SqlResult;

/// A consumer database on SQLite: the inbox, the per-flow high-water marks, the receipts and the
/// retired ids of every logical consumer it holds, with the user's projection tables in the same
/// file (so a handler's writes commit with the apply). Implements
/// [`ConsumerStore`](tidemark_core::store::ConsumerStore).
pub struct SqliteConsumer {
    conn: Connection,
    retention: RetentionPolicy,
}

fn read_retention(conn: &Connection) -> Result<Option<RetentionPolicy>> {
    Ok(meta_get(conn, "consumer.horizon_ms")?
        .and_then(|v| v.parse().ok())
        .map(|horizon_ms| RetentionPolicy { horizon_ms }))
}

/// Tables of user projections keyed by `consumer_id`, carried over by `rename_consumer`.
fn projection_tables(conn: &Connection) -> Result<Vec<String>> {
    let raw = meta_get(conn, "consumer.projection_tables")?.unwrap_or_else(|| "[]".into());
    serde_json::from_str(&raw).map_err(|e| Error::store(format!("corrupt consumer.projection_tables: {e}")))
}

/// Register a projection table of the user's (it must exist and have a `consumer_id` column) so
/// that renaming a consumer carries its rows over in the same transaction as the dedup state.
/// Idempotent. Call it in the migration (or transaction) that creates the table.
pub fn register_projection_table(conn: &Connection, table: &str) -> Result<()> {
    validate_id("table", table)?;
    let has_consumer_id: bool = conn
        .query_row("SELECT count(*) FROM pragma_table_info(?1) WHERE name = 'consumer_id'", [table], |r| {
            r.get::<_, i64>(0)
        })
        .db()?
        > 0;
    if !has_consumer_id {
        return Err(Error::invalid(
            codes::INVALID_ARGUMENT,
            format!("table {table:?} does not exist or has no consumer_id column"),
        ));
    }
    let mut tables = projection_tables(conn)?;
    if !tables.iter().any(|t| t == table) {
        tables.push(table.to_string());
        meta_set(conn, "consumer.projection_tables", &serde_json::to_string(&tables).expect("strings serialise"))?;
    }
    Ok(())
}

impl SqliteConsumer {
    /// Create (or reopen) a consumer database. The retention horizon is set on first init and
    /// kept afterwards (init never resets anything).
    pub fn init(path: &Path, retention: RetentionPolicy) -> Result<SqliteConsumer> {
        if retention.horizon_ms <= 0 {
            return Err(Error::invalid(codes::INVALID_ARGUMENT, "horizon_ms must be positive"));
        }
        let mut conn = schema::open(path, true, Durability::Full)?;
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        let retention = match read_retention(&tx)? {
            Some(existing) => existing,
            None => {
                meta_set(&tx, "consumer.horizon_ms", &retention.horizon_ms.to_string())?;
                retention
            }
        };
        tx.commit().db()?;
        Ok(SqliteConsumer { conn, retention })
    }

    /// Open an initialised consumer database, fsyncing every commit. Never creates a file: a
    /// missing file or one that is not a consumer database is `not_initialized`.
    pub fn open(path: &Path) -> Result<SqliteConsumer> {
        Self::open_with(path, Durability::Full)
    }

    /// [`SqliteConsumer::open`] with a durability (`Durability::Normal` skips the per-commit
    /// fsync).
    pub fn open_with(path: &Path, durability: Durability) -> Result<SqliteConsumer> {
        let conn = schema::open(path, false, durability)?;
        let retention = read_retention(&conn)?.ok_or_else(|| {
            Error::invalid(
                codes::NOT_INITIALIZED,
                format!("{} is not a consumer database; run `tidemark init --consumer`", path.display()),
            )
        })?;
        Ok(SqliteConsumer { conn, retention })
    }

    /// The retention horizon this file was initialised with.
    pub fn retention(&self) -> RetentionPolicy {
        self.retention
    }

    /// The connection, for reading projections and installing handler tables.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// [`ConsumerStore::snapshot`], and `also` (e.g. a handler's projection tables) read in the
    /// same read transaction: what `also` sees is exactly the state the snapshot shows.
    pub fn snapshot_with<T>(
        &self,
        rows_max: usize,
        also: impl FnOnce(&Connection) -> Result<T>,
    ) -> Result<(ConsumerSnapshot, T)> {
        let tx = self.conn.unchecked_transaction().db()?;
        let snapshot = snapshot_in(&tx, self.retention.horizon_ms, rows_max)?;
        let also = also(&tx)?;
        tx.finish().db()?;
        Ok((snapshot, also))
    }

    /// Whether this file has received anything for `consumer_id` from `source`: an inbox record
    /// (received, applied or not), a receipt (a pruned record) or a high-water mark (written by
    /// applies and skips, never pruned).
    pub fn has_received(&self, consumer_id: &str, source: &str) -> Result<bool> {
        validate_id("consumer_id", consumer_id)?;
        validate_id("source", source)?;
        self.conn
            .query_row(
                "SELECT EXISTS (SELECT 1 FROM inbox WHERE consumer_id = ?1 AND source = ?2)
                     OR EXISTS (SELECT 1 FROM receipts WHERE consumer_id = ?1 AND source = ?2)
                     OR EXISTS (SELECT 1 FROM cursors WHERE consumer_id = ?1 AND source = ?2)",
                [consumer_id, source],
                |r| r.get(0),
            )
            .db()
    }
}

/// Whether `consumer_id` holds any dedup state (records, receipts, cursors) in this file.
fn consumer_has_state(tx: &Connection, consumer_id: &str) -> Result<bool> {
    tx.query_row(
        "SELECT EXISTS (SELECT 1 FROM inbox WHERE consumer_id = ?1)
             OR EXISTS (SELECT 1 FROM receipts WHERE consumer_id = ?1)
             OR EXISTS (SELECT 1 FROM cursors WHERE consumer_id = ?1)",
        [consumer_id],
        |r| r.get(0),
    )
    .db()
}

/// The id `consumer_id` was renamed to, if it is retired.
fn renamed_to(tx: &Connection, consumer_id: &str) -> Result<Option<String>> {
    tx.prepare_cached("SELECT renamed_to FROM retired_consumers WHERE consumer_id = ?1")
        .db()?
        .query_row([consumer_id], |r| r.get(0))
        .optional()
        .db()
}

/// Record `from` as renamed to `to` (and `to` as no longer retired, if it was).
fn retire(tx: &Connection, from: &str, to: &str, now_ms: i64) -> Result<()> {
    tx.execute("DELETE FROM retired_consumers WHERE consumer_id = ?1", [to]).db()?;
    tx.execute(
        "INSERT INTO retired_consumers (consumer_id, renamed_to, retired_at_ms) VALUES (?1, ?2, ?3)
         ON CONFLICT (consumer_id) DO UPDATE SET renamed_to = excluded.renamed_to, retired_at_ms = excluded.retired_at_ms",
        params![from, to, now_ms],
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

/// The statements of one receive batch, prepared once per batch (a `prepare_cached` per event
/// hashed the SQL text twice per statement: about a tenth of the pipeline's instructions).
struct ReceiveStatements<'c> {
    /// Receive never writes receipts, so whether the file holds any is fixed for the batch.
    any_receipts: bool,
    probe: rusqlite::CachedStatement<'c>,
    high_water: rusqlite::CachedStatement<'c>,
    /// Whether a receipt holds an event id (for this consumer), at any position.
    receipt_of_id: rusqlite::CachedStatement<'c>,
    insert: rusqlite::CachedStatement<'c>,
    insert_if_new: rusqlite::CachedStatement<'c>,
}

impl<'c> ReceiveStatements<'c> {
    fn prepare(tx: &'c Connection) -> Result<Self> {
        let any_receipts: bool = tx.query_row("SELECT EXISTS (SELECT 1 FROM receipts)", [], |r| r.get(0)).db()?;
        // Without receipts the probe leaves out its two receipt lookups.
        let probe = if any_receipts { RECEIVE_PROBE_SQL } else { RECEIVE_PROBE_NO_RECEIPTS_SQL };
        Ok(ReceiveStatements {
            any_receipts,
            probe: tx.prepare_cached(probe).db()?,
            high_water: tx
                .prepare_cached(
                    "SELECT high_water_seq FROM cursors WHERE consumer_id = ?1 AND source = ?2 AND flow_id = ?3",
                )
                .db()?,
            receipt_of_id: tx
                .prepare_cached("SELECT EXISTS (SELECT 1 FROM receipts WHERE event_id = ?1 AND consumer_id = ?2)")
                .db()?,
            insert: tx.prepare_cached(RECEIVE_INSERT_SQL).db()?,
            insert_if_new: tx.prepare_cached(&format!("{RECEIVE_INSERT_SQL} ON CONFLICT DO NOTHING")).db()?,
        })
    }
}

/// One statement looks everything up: the record at this position (inbox, then receipt), the
/// same event id at another position, and the flow's high-water mark.
const RECEIVE_PROBE_SQL: &str = "SELECT 0, event_id, content_hash, generation, NULL, NULL, NULL FROM inbox
   WHERE consumer_id = ?1 AND source = ?2 AND flow_id = ?3 AND seq = ?4
 UNION ALL SELECT 1, event_id, content_hash, generation, NULL, NULL, NULL FROM receipts
   WHERE consumer_id = ?1 AND source = ?2 AND flow_id = ?3 AND seq = ?4
 UNION ALL SELECT 2, NULL, NULL, NULL, source, flow_id, seq FROM inbox
   WHERE consumer_id = ?1 AND event_id = ?5
 UNION ALL SELECT 2, NULL, NULL, NULL, source, flow_id, seq FROM receipts
   WHERE consumer_id = ?1 AND event_id = ?5
 UNION ALL SELECT 3, NULL, NULL, NULL, NULL, NULL, high_water_seq FROM cursors
   WHERE consumer_id = ?1 AND source = ?2 AND flow_id = ?3";

/// [`RECEIVE_PROBE_SQL`] for a file that holds no receipts (the same columns and kinds).
const RECEIVE_PROBE_NO_RECEIPTS_SQL: &str = "SELECT 0, event_id, content_hash, generation, NULL, NULL, NULL FROM inbox
   WHERE consumer_id = ?1 AND source = ?2 AND flow_id = ?3 AND seq = ?4
 UNION ALL SELECT 2, NULL, NULL, NULL, source, flow_id, seq FROM inbox
   WHERE consumer_id = ?1 AND event_id = ?5
 UNION ALL SELECT 3, NULL, NULL, NULL, NULL, NULL, high_water_seq FROM cursors
   WHERE consumer_id = ?1 AND source = ?2 AND flow_id = ?3";

const RECEIVE_INSERT_SQL: &str =
    "INSERT INTO inbox (consumer_id, source, flow_id, seq, event_id, generation, event_type, schema_version,
     payload, content_hash, created_at_ms, received_at_ms, status, status_at_ms, traceparent)
 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, 'pending', ?12, ?13)";

fn receive_one(
    statements: &mut ReceiveStatements<'_>,
    consumer_id: &str,
    event: &Envelope,
    now_ms: i64,
    retention: RetentionPolicy,
) -> Result<ReceiveOutcome> {
    let hash = event.content_hash();
    let insert_params = params![
        consumer_id,
        event.source,
        event.flow_id,
        event.seq,
        event.event_id,
        event.generation,
        event.event_type,
        event.schema_version,
        event.payload.to_string(),
        hash,
        event.created_at_ms,
        now_ms,
        event.traceparent
    ];
    // The fast path, for a new event: not expired, above the flow's high-water mark, no receipt
    // of its event id, and an insert that no uniqueness constraint refuses (so no record holds
    // this position or this event id) is exactly the case the full probe below answers
    // `accepted`. No receipt can hold this position: a receipt is what prune leaves of an
    // applied or skipped record, so it is at or below its flow's high-water mark, which never
    // goes down. Anything else (the insert did nothing because a record exists, or a rare case)
    // takes the full probe, which compares the content hash of whatever it finds.
    let expired = event.created_at_ms < now_ms.saturating_sub(retention.horizon_ms);
    if !expired {
        let high_water_seq: i64 = statements
            .high_water
            .query_row(params![consumer_id, event.source, event.flow_id], |r| r.get(0))
            .optional()
            .db()?
            .unwrap_or(0);
        if event.seq > high_water_seq {
            let receipt_holds_id = statements.any_receipts
                && statements.receipt_of_id.query_row(params![event.event_id, consumer_id], |r| r.get(0)).db()?;
            if !receipt_holds_id && statements.insert_if_new.execute(insert_params).db()? == 1 {
                return Ok(ReceiveOutcome::Accepted {
                    consumer_id: consumer_id.to_string(),
                    event_id: event.event_id.clone(),
                });
            }
        }
    }
    let consumer = consumer_id.to_string();
    let event_id = event.event_id.clone();
    let duplicate = || ReceiveOutcome::Duplicate { consumer_id: consumer.clone(), event_id: event_id.clone() };
    let conflict =
        |reason: String| ReceiveOutcome::Conflict { consumer_id: consumer.clone(), event_id: event_id.clone(), reason };

    // Every path that finds an existing record compares the content hash.
    let mut at_inbox: Option<ExistingRecord> = None;
    let mut at_receipt: Option<ExistingRecord> = None;
    let mut id_elsewhere: Option<(String, String, i64)> = None;
    let mut high_water_seq = 0_i64;
    {
        let stmt = &mut statements.probe;
        let mut rows = stmt.query(params![consumer_id, event.source, event.flow_id, event.seq, event.event_id]).db()?;
        while let Some(r) = rows.next().db()? {
            match r.get::<_, i64>(0).db()? {
                0 => {
                    at_inbox = Some(ExistingRecord {
                        event_id: r.get(1).db()?,
                        content_hash: r.get(2).db()?,
                        generation: r.get(3).db()?,
                    })
                }
                1 => {
                    at_receipt = Some(ExistingRecord {
                        event_id: r.get(1).db()?,
                        content_hash: r.get(2).db()?,
                        generation: r.get(3).db()?,
                    })
                }
                2 => {
                    let place: (String, String, i64) = (r.get(4).db()?, r.get(5).db()?, r.get(6).db()?);
                    let same_position = place.0 == event.source && place.1 == event.flow_id && place.2 == event.seq;
                    if !same_position {
                        id_elsewhere = Some(place);
                    }
                }
                _ => high_water_seq = r.get(6).db()?,
            }
        }
    }
    for (existing, place) in [(at_inbox, "inbox"), (at_receipt, "receipt")] {
        if let Some(existing) = existing {
            return Ok(match conflict_reason(&existing, event, &hash, place) {
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
        // Applied and pruned, and its receipt is gone although the event claims to be younger
        // than the horizon: it cannot be the same event. Never apply it.
        return Ok(conflict(format!(
            "seq {} is at or below the high-water mark {high_water_seq} of {}/{} but no record or receipt of it remains",
            event.seq, event.source, event.flow_id
        )));
    }
    statements.insert.execute(insert_params).db()?;
    Ok(ReceiveOutcome::Accepted { consumer_id: consumer, event_id })
}

const OPEN_COLUMNS: &str =
    "i.source, i.flow_id, i.seq, i.event_id, i.generation, i.event_type, i.schema_version, i.payload,
    i.created_at_ms, COALESCE(c.high_water_seq, 0), i.record, i.traceparent";

fn open_record(r: &rusqlite::Row<'_>) -> rusqlite::Result<OpenRecord> {
    let payload: String = r.get(7)?;
    Ok(OpenRecord {
        record: r.get(10)?,
        envelope: Envelope {
            source: r.get(0)?,
            flow_id: r.get(1)?,
            seq: r.get(2)?,
            event_id: r.get(3)?,
            generation: r.get(4)?,
            event_type: r.get(5)?,
            schema_version: r.get(6)?,
            payload: serde_json::from_str(&payload)
                .map_err(|e| rusqlite::Error::FromSqlConversionFailure(7, rusqlite::types::Type::Text, Box::new(e)))?,
            created_at_ms: r.get(8)?,
            traceparent: r.get(11)?,
        },
        high_water_seq: r.get(9)?,
    })
}

fn open_page(
    tx: &Connection,
    consumer_id: &str,
    scope: &DrainScope,
    after: &(String, String, i64),
) -> Result<Vec<OpenRecord>> {
    // `INDEXED BY inbox_open`: the partial index holds only open records. Without it SQLite
    // walks the primary key, i.e. every applied record of the consumer that sorts after `after`,
    // so each drain cost grew with the size of the inbox (0.25 s per page at 1M applied rows).
    let base = format!(
        "SELECT {OPEN_COLUMNS} FROM inbox i INDEXED BY inbox_open
         LEFT JOIN cursors c ON c.consumer_id = i.consumer_id AND c.source = i.source AND c.flow_id = i.flow_id
         WHERE i.consumer_id = ?1 AND i.status IN ('pending', 'blocked')"
    );
    let rows = match scope {
        DrainScope::All => {
            let mut stmt = tx
                .prepare_cached(&format!(
                    "{base} AND (i.source, i.flow_id, i.seq) > (?2, ?3, ?4) ORDER BY i.source, i.flow_id, i.seq LIMIT ?5"
                ))
                .db()?;
            let rows = stmt
                .query_map(params![consumer_id, after.0, after.1, after.2, DRAIN_PAGE_ROWS as i64], open_record)
                .db()?;
            rows.collect::<rusqlite::Result<Vec<_>>>().db()?
        }
        DrainScope::Flow { source, flow_id } => {
            let mut stmt = tx
                .prepare_cached(&format!(
                    "{base} AND i.source = ?2 AND i.flow_id = ?3 AND i.seq > ?4 ORDER BY i.seq LIMIT ?5"
                ))
                .db()?;
            let rows = stmt
                .query_map(params![consumer_id, source, flow_id, after.2, DRAIN_PAGE_ROWS as i64], open_record)
                .db()?;
            rows.collect::<rusqlite::Result<Vec<_>>>().db()?
        }
    };
    Ok(rows)
}

const SET_CURSOR_SQL: &str =
    "INSERT INTO cursors (consumer_id, source, flow_id, high_water_seq) VALUES (?1, ?2, ?3, ?4)
     ON CONFLICT (consumer_id, source, flow_id) DO UPDATE SET high_water_seq = excluded.high_water_seq
     WHERE excluded.high_water_seq > cursors.high_water_seq";

fn set_cursor(tx: &Connection, consumer_id: &str, source: &str, flow_id: &str, high_water_seq: i64) -> Result<()> {
    tx.prepare_cached(SET_CURSOR_SQL).db()?.execute(params![consumer_id, source, flow_id, high_water_seq]).db()?;
    Ok(())
}

fn high_water(conn: &Connection, consumer_id: &str, source: &str, flow_id: &str) -> Result<i64> {
    Ok(conn
        .prepare_cached("SELECT high_water_seq FROM cursors WHERE consumer_id = ?1 AND source = ?2 AND flow_id = ?3")
        .db()?
        .query_row(params![consumer_id, source, flow_id], |r| r.get(0))
        .optional()
        .db()?
        .unwrap_or(0))
}

/// The drain's apply transaction ([`tidemark_core::drain`] decides; this writes). The open-record
/// read joins each flow's cursor, so the drain knows whether the row exists and writes it with a
/// plain UPDATE or INSERT (an upsert seeks the primary key twice when the row exists: once for
/// the refused insert, once for the update). Statements are prepared once per drain, not once
/// per event (see `ReceiveStatements`).
struct SqliteDrain<'c> {
    tx: &'c Connection,
    consumer_id: &'c str,
    scope: &'c DrainScope,
    now_ms: i64,
    mark_applied: rusqlite::CachedStatement<'c>,
    cursor_update: rusqlite::CachedStatement<'c>,
    cursor_insert: rusqlite::CachedStatement<'c>,
}

impl<'c> SqliteDrain<'c> {
    fn prepare(tx: &'c Connection, consumer_id: &'c str, scope: &'c DrainScope, now_ms: i64) -> Result<Self> {
        Ok(SqliteDrain {
            tx,
            consumer_id,
            scope,
            now_ms,
            mark_applied: tx
                .prepare_cached(
                    "UPDATE inbox SET status = 'applied', reason = NULL, status_at_ms = ?2
                     WHERE record = ?1 AND (status = 'pending' OR status = 'blocked')",
                )
                .db()?,
            cursor_update: tx
                .prepare_cached(
                    "UPDATE cursors SET high_water_seq = ?4
                     WHERE consumer_id = ?1 AND source = ?2 AND flow_id = ?3 AND high_water_seq < ?4",
                )
                .db()?,
            cursor_insert: tx
                .prepare_cached(
                    "INSERT INTO cursors (consumer_id, source, flow_id, high_water_seq) VALUES (?1, ?2, ?3, ?4)",
                )
                .db()?,
        })
    }

    fn run(&self, sql: &str) -> Result<()> {
        self.tx.prepare_cached(sql).db()?.execute([]).db()?;
        Ok(())
    }
}

impl DrainTransaction for SqliteDrain<'_> {
    type Target = Connection;

    fn target(&self) -> &Connection {
        self.tx
    }

    fn page(&mut self, after: &DrainPosition) -> Result<Vec<OpenRecord>> {
        open_page(self.tx, self.consumer_id, self.scope, after)
    }

    fn savepoint(&mut self) -> Result<()> {
        self.run("SAVEPOINT apply_one")
    }

    fn release_savepoint(&mut self) -> Result<()> {
        self.run("RELEASE apply_one")
    }

    fn roll_back_to_savepoint(&mut self) -> Result<()> {
        self.run("ROLLBACK TO apply_one")?;
        self.run("RELEASE apply_one")
    }

    fn mark_applied(&mut self, record: i64) -> Result<()> {
        let changed = self.mark_applied.execute(params![record, self.now_ms]).db()?;
        ensure_invariant!(changed == 1, "marking applied changed {changed} rows");
        Ok(())
    }

    fn mark_blocked(&mut self, record: i64, reason: &str) -> Result<()> {
        // Blocked again for the same reason: nothing to write (a drain loop retries blocked
        // records; without this every pass rewrote the row and fsynced).
        self.tx
            .prepare_cached(
                "UPDATE inbox SET status = 'blocked', reason = ?2, status_at_ms = ?3
                 WHERE record = ?1 AND NOT (status = 'blocked' AND reason IS ?2)",
            )
            .db()?
            .execute(params![record, reason, self.now_ms])
            .db()?;
        Ok(())
    }

    fn move_cursor(&mut self, source: &str, flow_id: &str, start_high_water: i64, high_water: i64) -> Result<()> {
        // `start_high_water` 0 means the join found no cursor row (a stored one is >= 1).
        let statement = if start_high_water == 0 { &mut self.cursor_insert } else { &mut self.cursor_update };
        let changed = statement.execute(params![self.consumer_id, source, flow_id, high_water]).db()?;
        ensure_invariant!(changed == 1, "moving the cursor of {source}/{flow_id} changed {changed} rows");
        Ok(())
    }
}

const INBOX_COLUMNS: &str =
    "consumer_id, source, flow_id, seq, event_id, generation, event_type, schema_version, payload,
    content_hash, created_at_ms, received_at_ms, status, reason, traceparent";

fn inbox_entry(r: &rusqlite::Row<'_>) -> rusqlite::Result<InboxEntry> {
    let payload: String = r.get(8)?;
    let status: String = r.get(12)?;
    Ok(InboxEntry {
        consumer_id: r.get(0)?,
        envelope: Envelope {
            source: r.get(1)?,
            flow_id: r.get(2)?,
            seq: r.get(3)?,
            event_id: r.get(4)?,
            generation: r.get(5)?,
            event_type: r.get(6)?,
            schema_version: r.get(7)?,
            payload: serde_json::from_str(&payload)
                .map_err(|e| rusqlite::Error::FromSqlConversionFailure(8, rusqlite::types::Type::Text, Box::new(e)))?,
            created_at_ms: r.get(10)?,
            traceparent: r.get(14)?,
        },
        content_hash: r.get(9)?,
        status: InboxStatus::parse(&status).unwrap_or(InboxStatus::Pending),
        reason: r.get(13)?,
        received_at_ms: r.get(11)?,
    })
}

impl ConsumerStore for SqliteConsumer {
    type Target = Connection;

    fn receive_batch(&mut self, items: &[(&str, &Envelope)], now_ms: i64) -> Result<Vec<ReceiveOutcome>> {
        validate_limit("receive batch", items.len(), RECEIVE_BATCH_EVENTS_MAX)?;
        for (consumer_id, event) in items {
            validate_id("consumer_id", consumer_id)?;
            event.validate()?;
        }
        let retention = self.retention;
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        let mut retired: HashMap<&str, Option<String>> = HashMap::new();
        let mut outcomes = Vec::with_capacity(items.len());
        let mut statements = ReceiveStatements::prepare(&tx)?;
        for (consumer_id, event) in items {
            if !retired.contains_key(consumer_id) {
                retired.insert(consumer_id, renamed_to(&tx, consumer_id)?);
            }
            if let Some(Some(renamed_to)) = retired.get(consumer_id) {
                outcomes.push(ReceiveOutcome::Conflict {
                    consumer_id: consumer_id.to_string(),
                    event_id: event.event_id.clone(),
                    reason: format!(
                        "consumer {consumer_id} was renamed to {renamed_to}; rename the producer's subscription too"
                    ),
                });
                continue;
            }
            outcomes.push(receive_one(&mut statements, consumer_id, event, now_ms, retention)?);
        }
        drop(statements);
        crash::hit("receive.before_commit");
        tx.commit().db()?;
        crash::hit("receive.after_commit");
        Ok(outcomes)
    }

    fn drain(
        &mut self,
        consumer_id: &str,
        scope: &DrainScope,
        limit: usize,
        handler: &mut dyn Handler<Connection>,
        now_ms: i64,
    ) -> Result<DrainReport> {
        validate_id("consumer_id", consumer_id)?;
        validate_limit("drain limit", limit, DRAIN_BATCH_EVENTS_MAX)?;
        if let DrainScope::Flow { source, flow_id } = scope {
            validate_id("source", source)?;
            validate_id("flow_id", flow_id)?;
        }
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        let report = drain::walk(
            &mut SqliteDrain::prepare(&tx, consumer_id, scope, now_ms)?,
            consumer_id,
            scope,
            limit,
            handler,
        )?;
        crash::hit("apply.before_commit");
        tx.commit().db()?;
        crash::hit("apply.after_commit");
        Ok(report)
    }

    fn inbox(&self, consumer_id: &str, status: Option<InboxStatus>, limit: usize) -> Result<Vec<InboxEntry>> {
        validate_id("consumer_id", consumer_id)?;
        validate_limit("page size", limit, PAGE_SIZE_MAX)?;
        // Open records come from the open-record index, in its order. Every other listing
        // walks the consumer's rows and sorts them: the primary key leads with the flow id
        // (schema v5), so a page of applied records costs a pass over the table.
        let sql = match status {
            Some(InboxStatus::Pending | InboxStatus::Blocked) => format!(
                "SELECT {INBOX_COLUMNS} FROM inbox INDEXED BY inbox_open
                 WHERE consumer_id = ?1 AND status IN ('pending', 'blocked') AND status = ?2
                 ORDER BY source, flow_id, seq LIMIT ?3"
            ),
            _ => format!(
                "SELECT {INBOX_COLUMNS} FROM inbox WHERE consumer_id = ?1 AND (?2 IS NULL OR status = ?2)
                 ORDER BY source, flow_id, seq LIMIT ?3"
            ),
        };
        let mut stmt = self.conn.prepare_cached(&sql).db()?;
        let rows =
            stmt.query_map(params![consumer_id, status.map(InboxStatus::as_str), limit as i64], inbox_entry).db()?;
        rows.collect::<rusqlite::Result<Vec<_>>>().db()
    }

    fn skip_blocked(&mut self, consumer_id: &str, event_id: &str, reason: &str, now_ms: i64) -> Result<InboxEntry> {
        validate_id("consumer_id", consumer_id)?;
        validate_id("event_id", event_id)?;
        validate_reason(reason)?;
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        let entry = tx
            .prepare_cached(&format!("SELECT {INBOX_COLUMNS} FROM inbox WHERE consumer_id = ?1 AND event_id = ?2"))
            .db()?
            .query_row([consumer_id, event_id], inbox_entry)
            .optional()
            .db()?
            .ok_or_else(|| Error::not_found(format!("consumer {consumer_id} holds no event {event_id}")))?;
        if entry.status != InboxStatus::Blocked {
            return Err(Error::invalid(
                codes::INVALID_STATE_CHANGE,
                format!("only blocked records can be skipped; event {event_id} is {}", entry.status.as_str()),
            ));
        }
        let event = &entry.envelope;
        let high_water = high_water(&tx, consumer_id, &event.source, &event.flow_id)?;
        ensure_invariant!(high_water + 1 == event.seq, "blocked seq {} is not high-water {high_water} + 1", event.seq);
        tx.execute(
            "UPDATE inbox SET status = 'skipped', reason = ?3, status_at_ms = ?4 WHERE consumer_id = ?1 AND event_id = ?2",
            params![consumer_id, event_id, format!("skipped by operator: {reason}"), now_ms],
        )
        .db()?;
        set_cursor(&tx, consumer_id, &event.source, &event.flow_id, event.seq)?;
        let skipped = tx
            .prepare_cached(&format!("SELECT {INBOX_COLUMNS} FROM inbox WHERE consumer_id = ?1 AND event_id = ?2"))
            .db()?
            .query_row([consumer_id, event_id], inbox_entry)
            .db()?;
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
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        // Applied (or skipped) bodies become compact receipts; high-water marks are never pruned.
        // Oldest first: records are numbered in receive order, so the walk goes by record and
        // stops at the first record received after the cutoff (no age index; such a record
        // cannot have been applied before the cutoff; see `retention_walk_stops_at`). Open
        // records and records applied after the cutoff are passed over.
        let cutoff = now_ms.saturating_sub(applied_retention_ms);
        let mut done: Vec<(String, String, String, i64)> = Vec::new();
        {
            let mut stmt = tx
                .prepare_cached(
                    "SELECT received_at_ms, status IN ('applied', 'skipped') AND status_at_ms <= ?1,
                            consumer_id, source, flow_id, seq
                     FROM inbox ORDER BY record",
                )
                .db()?;
            let mut rows = stmt.query([cutoff]).db()?;
            while done.len() < batch_rows {
                let Some(row) = rows.next().db()? else { break };
                let received_at_ms: i64 = row.get(0).db()?;
                if retention_walk_stops_at(received_at_ms, cutoff.saturating_add(1), now_ms) {
                    break;
                }
                if row.get::<_, bool>(1).db()? {
                    done.push((row.get(2).db()?, row.get(3).db()?, row.get(4).db()?, row.get(5).db()?));
                }
            }
        }
        for (consumer_id, source, flow_id, seq) in &done {
            let key = params![consumer_id, source, flow_id, seq];
            let copied = tx
                .prepare_cached(
                    "INSERT INTO receipts (consumer_id, source, flow_id, seq, event_id, content_hash, created_at_ms, generation)
                     SELECT consumer_id, source, flow_id, seq, event_id, content_hash, created_at_ms, generation FROM inbox
                     WHERE consumer_id = ?1 AND source = ?2 AND flow_id = ?3 AND seq = ?4",
                )
                .db()?
                .execute(key)
                .db()?;
            let removed = tx
                .prepare_cached(
                    "DELETE FROM inbox WHERE consumer_id = ?1 AND source = ?2 AND flow_id = ?3 AND seq = ?4",
                )
                .db()?
                .execute(key)
                .db()?;
            ensure_invariant!(
                copied == 1 && removed == 1,
                "compacting {consumer_id}/{source}/{flow_id}/{seq} touched {copied}/{removed} rows"
            );
        }
        let compacted = done.len();
        // Receipts past the horizon go: an event that old is rejected as expired anyway.
        let receipts_deleted = tx
            .prepare_cached(
                "DELETE FROM receipts WHERE (consumer_id, source, flow_id, seq) IN
                    (SELECT consumer_id, source, flow_id, seq FROM receipts WHERE created_at_ms < ?1 LIMIT ?2)",
            )
            .db()?
            .execute(params![now_ms.saturating_sub(horizon_ms), batch_rows as i64])
            .db()?;
        crash::hit("prune.before_commit");
        tx.commit().db()?;
        crash::hit("prune.after_commit");
        Ok(PruneReport {
            compacted: compacted as u64,
            receipts_deleted: receipts_deleted as u64,
            more: compacted == batch_rows || receipts_deleted == batch_rows,
        })
    }

    fn rename_consumer(&mut self, from: &str, to: &str, now_ms: i64) -> Result<RenameReport> {
        validate_rename(from, to)?;
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        let used = |id: &str| consumer_has_state(&tx, id);
        if !used(from)? {
            // Idempotent: `from` was already renamed to `to` (a retry after a crash between this
            // commit and the producer's half of `rename-consumer`). Nothing left to move.
            if renamed_to(&tx, from)?.as_deref() == Some(to) {
                return Ok(RenameReport { inbox: 0, receipts: 0, cursors: 0, projections: 0 });
            }
            return Err(Error::not_found(format!("consumer {from:?} has no state in this database")));
        }
        if used(to)? {
            return Err(Error::invalid(
                codes::ALREADY_EXISTS,
                format!("consumer {to:?} already has state; pick an unused id"),
            ));
        }
        let inbox = tx.execute("UPDATE inbox SET consumer_id = ?2 WHERE consumer_id = ?1", [from, to]).db()?;
        let receipts = tx.execute("UPDATE receipts SET consumer_id = ?2 WHERE consumer_id = ?1", [from, to]).db()?;
        let cursors = tx.execute("UPDATE cursors SET consumer_id = ?2 WHERE consumer_id = ?1", [from, to]).db()?;
        let mut projections = 0;
        for table in projection_tables(&tx)? {
            validate_id("table", &table)?;
            projections += tx
                .execute(&format!("UPDATE \"{table}\" SET consumer_id = ?2 WHERE consumer_id = ?1"), [from, to])
                .db()?;
        }
        retire(&tx, from, to, now_ms)?;
        crash::hit("rename.before_commit");
        tx.commit().db()?;
        crash::hit("rename.after_commit");
        Ok(RenameReport {
            inbox: inbox as u64,
            receipts: receipts as u64,
            cursors: cursors as u64,
            projections: projections as u64,
        })
    }

    fn retire_consumer(&mut self, from: &str, to: &str, now_ms: i64) -> Result<()> {
        validate_rename(from, to)?;
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        if consumer_has_state(&tx, from)? {
            return Err(Error::invalid(
                codes::INVALID_STATE_CHANGE,
                format!("consumer {from:?} has state in this database; rename it, which carries the state over"),
            ));
        }
        if consumer_has_state(&tx, to)? {
            return Err(Error::invalid(
                codes::ALREADY_EXISTS,
                format!("consumer {to:?} already has state; pick an unused id"),
            ));
        }
        if let Some(other) = renamed_to(&tx, from)?.filter(|other| other != to) {
            return Err(Error::invalid(
                codes::INVALID_STATE_CHANGE,
                format!("consumer {from:?} was already renamed to {other:?}; finish that rename instead"),
            ));
        }
        retire(&tx, from, to, now_ms)?;
        crash::hit("rename.before_commit");
        tx.commit().db()?;
        crash::hit("rename.after_commit");
        Ok(())
    }

    fn cursors(&self, consumer_id: Option<&str>) -> Result<Vec<FlowCursor>> {
        if let Some(id) = consumer_id {
            validate_id("consumer_id", id)?;
        }
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT consumer_id, source, flow_id, high_water_seq FROM cursors WHERE ?1 IS NULL OR consumer_id = ?1
                 ORDER BY consumer_id, source, flow_id LIMIT ?2",
            )
            .db()?;
        let rows = stmt
            .query_map(params![consumer_id, PAGE_SIZE_MAX as i64], |r| {
                Ok(FlowCursor {
                    consumer_id: r.get(0)?,
                    source: r.get(1)?,
                    flow_id: r.get(2)?,
                    high_water_seq: r.get(3)?,
                })
            })
            .db()?;
        rows.collect::<rusqlite::Result<Vec<_>>>().db()
    }

    fn snapshot(&self, rows_max: usize) -> Result<ConsumerSnapshot> {
        Ok(self.snapshot_with(rows_max, |_| Ok(()))?.0)
    }
}

/// The dedup tables, read on `tx` (which the caller holds open as one read transaction).
fn snapshot_in(tx: &Connection, horizon_ms: i64, rows_max: usize) -> Result<ConsumerSnapshot> {
    let limit = rows_max as i64;
    let inbox = {
        let mut stmt = tx
            .prepare(&format!("SELECT {INBOX_COLUMNS} FROM inbox ORDER BY consumer_id, source, flow_id, seq LIMIT ?1"))
            .db()?;
        let rows = stmt.query_map([limit], inbox_entry).db()?;
        rows.collect::<rusqlite::Result<Vec<_>>>().db()?
    };
    let receipts = {
        let mut stmt = tx
            .prepare(
                "SELECT consumer_id, event_id, source, flow_id, seq, content_hash, created_at_ms, generation FROM receipts
                 ORDER BY consumer_id, source, flow_id, seq LIMIT ?1",
            )
            .db()?;
        let rows = stmt
            .query_map([limit], |r| {
                Ok(Receipt {
                    consumer_id: r.get(0)?,
                    event_id: r.get(1)?,
                    source: r.get(2)?,
                    flow_id: r.get(3)?,
                    seq: r.get(4)?,
                    content_hash: r.get(5)?,
                    created_at_ms: r.get(6)?,
                    generation: r.get(7)?,
                })
            })
            .db()?;
        rows.collect::<rusqlite::Result<Vec<_>>>().db()?
    };
    let cursors = {
        let mut stmt = tx
            .prepare("SELECT consumer_id, source, flow_id, high_water_seq FROM cursors ORDER BY consumer_id, source, flow_id LIMIT ?1")
            .db()?;
        let rows = stmt
            .query_map([limit], |r| {
                Ok(FlowCursor {
                    consumer_id: r.get(0)?,
                    source: r.get(1)?,
                    flow_id: r.get(2)?,
                    high_water_seq: r.get(3)?,
                })
            })
            .db()?;
        rows.collect::<rusqlite::Result<Vec<_>>>().db()?
    };
    Ok(ConsumerSnapshot { horizon_ms, inbox, receipts, cursors })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidemark_core::store::{DrainStop, HandleError};

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

    /// A consumer "has received" from a source as soon as a record of it is stored, before any
    /// apply (the subscribe-move check relies on it), and per source.
    #[test]
    fn has_received_counts_records_before_they_are_applied() {
        let dir = tempfile::tempdir().unwrap();
        let mut consumer = SqliteConsumer::init(&dir.path().join("c.db"), RetentionPolicy::default()).unwrap();
        assert!(!consumer.has_received("a", "shop").unwrap());
        consumer.receive_batch(&[("a", &event())], 1).unwrap();
        assert!(consumer.has_received("a", "shop").unwrap());
        assert!(!consumer.has_received("a", "other").unwrap());
        assert!(!consumer.has_received("b", "shop").unwrap());
    }

    #[test]
    fn rerunning_a_finished_rename_is_a_no_op() {
        let dir = tempfile::tempdir().unwrap();
        let mut consumer = SqliteConsumer::init(&dir.path().join("c.db"), RetentionPolicy::default()).unwrap();
        let event = event();
        consumer.receive_batch(&[("a", &event)], 1).unwrap();
        assert_eq!(consumer.rename_consumer("a", "b", 1).unwrap().inbox, 1);
        let again = consumer.rename_consumer("a", "b", 1).unwrap();
        assert_eq!((again.inbox, again.receipts, again.cursors, again.projections), (0, 0, 0, 0));
        assert_eq!(consumer.rename_consumer("a", "c", 1).unwrap_err().code(), codes::NOT_FOUND);
        assert_eq!(consumer.inbox("b", None, 10).unwrap().len(), 1);
    }

    /// A subscriber that never received anything is retired, not renamed: events still sent to
    /// its old id are refused naming the new one. Ids with state, a new id with state, and an id
    /// already renamed elsewhere are refused; repeating the retirement is a no-op.
    #[test]
    fn retiring_a_stateless_consumer_refuses_its_old_id_and_guards_the_stateful_cases() {
        let dir = tempfile::tempdir().unwrap();
        let mut consumer = SqliteConsumer::init(&dir.path().join("c.db"), RetentionPolicy::default()).unwrap();
        let event = event();
        consumer.receive_batch(&[("held", &event)], 1).unwrap();
        let code = |r: Result<()>| r.unwrap_err().code();
        assert_eq!(code(consumer.retire_consumer("held", "fresh", 1)), codes::INVALID_STATE_CHANGE);
        assert_eq!(code(consumer.retire_consumer("idle", "held", 1)), codes::ALREADY_EXISTS);
        assert_eq!(code(consumer.retire_consumer("idle", "idle", 1)), codes::INVALID_ARGUMENT);
        consumer.retire_consumer("idle", "idle2", 1).unwrap();
        consumer.retire_consumer("idle", "idle2", 2).unwrap();
        assert_eq!(code(consumer.retire_consumer("idle", "other", 3)), codes::INVALID_STATE_CHANGE);
        let outcome = consumer.receive_batch(&[("idle", &event)], 4).unwrap().remove(0);
        match outcome {
            ReceiveOutcome::Conflict { reason, .. } => assert!(reason.contains("renamed to idle2"), "{reason}"),
            other => panic!("an event for a retired id must be refused: {other:?}"),
        }
        assert!(matches!(consumer.receive_batch(&[("idle2", &event)], 5).unwrap()[0], ReceiveOutcome::Accepted { .. }));
    }

    struct Refuse;

    impl Handler<Connection> for Refuse {
        fn handle(&mut self, _tx: &Connection, _consumer: &str, _event: &Envelope) -> Result<(), HandleError> {
            Err(HandleError::Blocked("never".into()))
        }
    }

    /// With receipts in the file, a new event still takes the short path, and the receipts
    /// still answer: a replay of a compacted event is `duplicate`, its id at another position
    /// `conflict`, another event at its position `conflict`.
    #[test]
    fn receipts_answer_while_new_events_are_accepted() {
        let dir = tempfile::tempdir().unwrap();
        let mut consumer = SqliteConsumer::init(&dir.path().join("c.db"), RetentionPolicy::default()).unwrap();
        let first = event();
        consumer.receive_batch(&[("x", &first)], 1).unwrap();
        consumer.drain("x", &DrainScope::All, 10, &mut AllButB, 2).unwrap();
        assert_eq!(consumer.prune(0, 10, 3).unwrap().compacted, 1);
        let second = Envelope { event_id: "e2".into(), seq: 2, ..event() };
        let elsewhere = Envelope { flow_id: "g".into(), ..event() };
        let other_at_1 = Envelope { event_id: "e9".into(), ..event() };
        let outcomes =
            consumer.receive_batch(&[("x", &second), ("x", &first), ("x", &elsewhere), ("x", &other_at_1)], 4).unwrap();
        let words: Vec<&str> = outcomes
            .iter()
            .map(|o| match o {
                ReceiveOutcome::Accepted { .. } => "accepted",
                ReceiveOutcome::Duplicate { .. } => "duplicate",
                ReceiveOutcome::Conflict { .. } => "conflict",
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(words, ["accepted", "duplicate", "conflict", "conflict"]);
        match &outcomes[2] {
            ReceiveOutcome::Conflict { reason, .. } => {
                assert!(reason.contains("already held for shop/f/1"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(consumer.inbox("x", None, 10).unwrap().len(), 1, "only e2 was stored");
        // A producer restored from a backup re-issues seq 1 under a new generation: the receipt
        // keeps the old generation, so the conflict names the change (as a record's would).
        let reissued = Envelope { event_id: "e9".into(), generation: "g2".into(), ..event() };
        match &consumer.receive_batch(&[("x", &reissued)], 5).unwrap()[0] {
            ReceiveOutcome::Conflict { reason, .. } => {
                assert!(reason.contains("(receipt)") && reason.contains("generation changed from g1 to g2"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(consumer.snapshot(10).unwrap().receipts[0].generation.as_deref(), Some("g1"));
    }

    /// Applies every event except flow `b`'s, which it blocks.
    struct AllButB;

    impl Handler<Connection> for AllButB {
        fn handle(&mut self, _tx: &Connection, _consumer: &str, event: &Envelope) -> Result<(), HandleError> {
            if event.flow_id == "b" {
                return Err(HandleError::Blocked("not b".into()));
            }
            Ok(())
        }
    }

    /// Retention walks the inbox in receive order (no age index): it takes applied records,
    /// passes over open ones and ones stamped by a clock that ran ahead, and stops at the first
    /// record received after the cutoff, so a record applied by a clock that stepped back waits
    /// instead of going early.
    #[test]
    fn prune_compacts_in_receive_order_up_to_the_first_record_received_after_the_cutoff() {
        let dir = tempfile::tempdir().unwrap();
        let mut consumer = SqliteConsumer::init(&dir.path().join("c.db"), RetentionPolicy::default()).unwrap();
        let on = |flow: &str| Envelope { event_id: format!("e-{flow}"), flow_id: flow.into(), ..event() };
        // e arrives stamped 50,000 by a clock that ran ahead.
        for (flow, now) in [("a", 1_000), ("b", 2_000), ("e", 50_000), ("c", 3_000)] {
            consumer.receive_batch(&[("x", &on(flow))], now).unwrap();
        }
        for _ in 0..3 {
            consumer.drain("x", &DrainScope::All, 10, &mut AllButB, 3_500).unwrap();
        }
        // d arrives at 6,500 and is applied at 5,000: the clock stepped back in between.
        consumer.receive_batch(&[("x", &on("d"))], 6_500).unwrap();
        consumer.drain("x", &DrainScope::All, 10, &mut AllButB, 5_000).unwrap();
        let left = |consumer: &SqliteConsumer| -> Vec<(String, InboxStatus)> {
            consumer.inbox("x", None, 10).unwrap().into_iter().map(|r| (r.envelope.flow_id, r.status)).collect()
        };
        let (applied, blocked) = (InboxStatus::Applied, InboxStatus::Blocked);
        let all = |flows: &[(&str, InboxStatus)]| -> Vec<(String, InboxStatus)> {
            flows.iter().map(|(f, s)| (f.to_string(), *s)).collect()
        };
        assert_eq!(
            left(&consumer),
            all(&[("a", applied), ("b", blocked), ("c", applied), ("d", applied), ("e", applied)])
        );
        // Cutoff 6,000 at 7,000: a first (batch of one), then e (passed over by age, not a
        // stop) and c; b is open; d was received after the cutoff and stops the walk.
        let first = consumer.prune(1_000, 1, 7_000).unwrap();
        assert_eq!((first.compacted, first.more), (1, true));
        assert_eq!(left(&consumer), all(&[("b", blocked), ("c", applied), ("d", applied), ("e", applied)]));
        let second = consumer.prune(1_000, 10, 7_000).unwrap();
        assert_eq!((second.compacted, second.more), (2, false));
        assert_eq!(left(&consumer), all(&[("b", blocked), ("d", applied)]));
        let later = consumer.prune(1_000, 10, 8_000).unwrap();
        assert_eq!(later.compacted, 1, "d goes once the cutoff passes its receive time");
        assert_eq!(left(&consumer), all(&[("b", blocked)]));
    }

    // A blocked record was rewritten (and fsynced) by every drain pass of `tidemark serve`.
    #[test]
    fn a_record_blocked_again_for_the_same_reason_is_not_rewritten() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.db");
        let mut consumer = SqliteConsumer::init(&path, RetentionPolicy::default()).unwrap();
        let event = event();
        consumer.receive_batch(&[("a", &event)], 1).unwrap();
        let first = consumer.drain("a", &DrainScope::All, 10, &mut Refuse, 2).unwrap();
        assert_eq!(first.outcome, DrainStop::Blocked);
        let wal = path.with_extension("db-wal");
        let size = std::fs::metadata(&wal).unwrap().len();
        for now in 3..10 {
            let again = consumer.drain("a", &DrainScope::All, 10, &mut Refuse, now).unwrap();
            assert_eq!(again.outcome, DrainStop::Blocked);
        }
        assert_eq!(std::fs::metadata(&wal).unwrap().len(), size, "a repeated block wrote to the WAL");
        let record = consumer.inbox("a", Some(InboxStatus::Blocked), 10).unwrap().remove(0);
        assert_eq!(record.reason.as_deref(), Some("never"));
    }

    struct Log;

    impl Handler<Connection> for Log {
        fn handle(&mut self, tx: &Connection, _consumer: &str, event: &Envelope) -> Result<(), HandleError> {
            tx.execute("INSERT INTO log (event_id) VALUES (?1)", [&event.event_id])
                .map(|_| ())
                .map_err(|e| HandleError::Failed(Error::store(e.to_string())))
        }
    }

    /// `snapshot_with` reads the dedup tables and the caller's tables in one read transaction: a
    /// drain another connection commits in between shows in neither.
    #[test]
    fn a_snapshot_with_the_handler_tables_is_one_read_transaction() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.db");
        let mut consumer = SqliteConsumer::init(&path, RetentionPolicy::default()).unwrap();
        consumer.connection().execute("CREATE TABLE log (event_id TEXT NOT NULL)", []).unwrap();
        consumer.receive_batch(&[("a", &event())], 1).unwrap();
        let count = |conn: &Connection| -> Result<i64> {
            conn.query_row("SELECT count(*) FROM log", [], |r| r.get(0)).map_err(|e| Error::store(e.to_string()))
        };
        let (snapshot, logged) = consumer
            .snapshot_with(10, |tx| {
                let mut other = SqliteConsumer::open(&path).unwrap();
                let report = other.drain("a", &DrainScope::All, 10, &mut Log, 2).unwrap();
                assert_eq!(report.applied, 1, "the other connection commits while the snapshot is open");
                count(tx)
            })
            .unwrap();
        assert_eq!(snapshot.inbox[0].status, InboxStatus::Pending);
        assert_eq!(logged, 0, "the handler's table was read after the drain, outside the snapshot");
        let (after, logged) = consumer.snapshot_with(10, count).unwrap();
        assert_eq!((after.inbox[0].status, logged), (InboxStatus::Applied, 1));
    }

    /// Logs each event (`LogRefusing`), refusing flow `b`'s first one after writing, in batches of
    /// `.0` (the trait's default `handle_batch`), counting the batches it was handed (`.1`).
    struct LogRefusing(usize, usize);

    impl Handler<Connection> for LogRefusing {
        fn handle(&mut self, tx: &Connection, consumer: &str, event: &Envelope) -> Result<(), HandleError> {
            Log.handle(tx, consumer, event)?;
            if event.flow_id == "b" && event.seq == 1 {
                return Err(HandleError::Blocked("b is refused after writing".into()));
            }
            Ok(())
        }

        fn batch_max(&self) -> usize {
            self.0
        }

        fn handle_batch(&mut self, tx: &Connection, consumer: &str, events: &[Envelope]) -> Result<(), HandleError> {
            self.1 += 1;
            events.iter().try_for_each(|event| self.handle(tx, consumer, event))
        }
    }

    /// A batch the handler refuses after writing rolls back whole, and its events are applied
    /// again one at a time: only the refused flow stops (its later event in the batch stays
    /// pending), every other event is applied, and the drain reports, writes and leaves pending
    /// exactly what the one-at-a-time drain does.
    #[test]
    fn a_refused_batch_rolls_back_and_is_applied_one_event_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let at = |flow: &str, seq: i64| Envelope {
            event_id: format!("e-{flow}-{seq}"),
            flow_id: flow.into(),
            seq,
            ..event()
        };
        let events = [at("a", 1), at("a", 2), at("b", 1), at("b", 2), at("c", 1), at("d", 1), at("e", 2)];
        let items: Vec<(&str, &Envelope)> = events.iter().map(|e| ("x", e)).collect();
        let mut outcomes = Vec::new();
        for batch_max in [1, 4] {
            let path = dir.path().join(format!("c{batch_max}.db"));
            let mut consumer = SqliteConsumer::init(&path, RetentionPolicy::default()).unwrap();
            consumer.connection().execute("CREATE TABLE log (event_id TEXT NOT NULL)", []).unwrap();
            consumer.receive_batch(&items, 10).unwrap();
            let mut handler = LogRefusing(batch_max, 0);
            let report = consumer.drain("x", &DrainScope::All, 100, &mut handler, 11).unwrap();
            let logged: Vec<String> = consumer
                .connection()
                .prepare("SELECT event_id FROM log ORDER BY event_id")
                .unwrap()
                .query_map([], |r| r.get(0))
                .unwrap()
                .collect::<rusqlite::Result<_>>()
                .unwrap();
            let pending: Vec<String> = consumer
                .inbox("x", Some(InboxStatus::Pending), 10)
                .unwrap()
                .into_iter()
                .map(|r| r.envelope.event_id)
                .collect();
            let cursors: Vec<(String, i64)> =
                consumer.cursors(Some("x")).unwrap().into_iter().map(|c| (c.flow_id, c.high_water_seq)).collect();
            // [a1 a2 b1 b2] is refused at b1 and replayed; [c1 d1] is applied as a batch.
            assert_eq!(handler.1, if batch_max == 1 { 0 } else { 2 }, "batches of {batch_max}");
            outcomes.push((report, logged, pending, cursors));
        }
        let (report, logged, pending, cursors) = &outcomes[0];
        assert_eq!((report.outcome, report.applied), (DrainStop::Blocked, 4));
        assert_eq!(logged, &["e-a-1", "e-a-2", "e-c-1", "e-d-1"]);
        assert_eq!(pending, &["e-b-2", "e-e-2"]);
        assert_eq!(cursors, &[("a".to_string(), 2), ("c".to_string(), 1), ("d".to_string(), 1)]);
        assert_eq!(report.stuck.len(), 2, "{:?}", report.stuck);
        assert_eq!(outcomes[0], outcomes[1], "batching changed what the drain did");
    }
}
