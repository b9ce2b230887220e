//! Row mapping and the small reads shared by the workflow operations.

use rusqlite::types::Type;
use rusqlite::{params, CachedStatement, Connection, OptionalExtension, Row};
use serde_json::Value;
use tidemark_core::workflow::{
    AttemptRecord, JournalEntry, RunEvent, RunRecord, RunStatus, StepKind, StepStatus, DETAIL_ATTEMPTS_MAX,
};
use tidemark_core::{Error, Result};

use crate::SqlResult;

/// "This run is active" (non-terminal, claimable) for the status column `column`, written
/// exactly like the predicate of the partial indexes `runs_due` and `runs_key` (migration v3) so
/// that SQLite can use them. An OR chain, not `IN (...)`: an IN list of more than two constants
/// builds a temporary b-tree on every execution, and the index predicate runs on every write.
pub(super) fn active(column: &str) -> String {
    let terms: Vec<String> = ["pending", "running", "sleeping", "waiting", "compensating"]
        .iter()
        .map(|status| format!("{column} = '{status}'"))
        .collect();
    format!("({})", terms.join(" OR "))
}

pub(super) const RUN_COLUMNS: &str = "run_id, workflow, version, input, key, status, result, error, wake_at_ms, \
     waiting_for, cancel_requested, forked_from, lease_owner, lease_expires_at_ms, recoveries, created_at_ms, \
     updated_at_ms, parent_run_id, queue, priority, admitted_at_ms, deadline_ms";

const JOURNAL_COLUMNS: &str =
    "seq, name, kind, status, output, error, attempts, next_attempt_at_ms, wake_at_ms, event_name, reason, updated_at_ms";

const EVENT_COLUMNS: &str = "event_id, name, payload, received_at_ms, consumed_by_seq";

fn bad_column(index: usize, message: String) -> rusqlite::Error {
    rusqlite::Error::FromSqlConversionFailure(index, Type::Text, message.into())
}

fn json_at(r: &Row<'_>, index: usize) -> rusqlite::Result<Value> {
    let text: String = r.get(index)?;
    serde_json::from_str(&text).map_err(|e| bad_column(index, format!("corrupt JSON: {e}")))
}

fn opt_json_at(r: &Row<'_>, index: usize) -> rusqlite::Result<Option<Value>> {
    let text: Option<String> = r.get(index)?;
    text.map(|t| serde_json::from_str(&t).map_err(|e| bad_column(index, format!("corrupt JSON: {e}")))).transpose()
}

pub(super) fn run_status_at(r: &Row<'_>, index: usize) -> rusqlite::Result<RunStatus> {
    let text: String = r.get(index)?;
    RunStatus::parse(&text).ok_or_else(|| bad_column(index, format!("unknown run status {text:?}")))
}

/// Map a row selected with [`RUN_COLUMNS`].
pub(super) fn run_record(r: &Row<'_>) -> rusqlite::Result<RunRecord> {
    let input = json_at(r, 3)?;
    Ok(RunRecord { input, ..run_record_without_input(r)? })
}

/// Map a row selected with [`RUN_COLUMNS`] but its input (left `null`), for a reader that parses
/// the input text (column 3) only when it needs it.
pub(super) fn run_record_without_input(r: &Row<'_>) -> rusqlite::Result<RunRecord> {
    Ok(RunRecord {
        run_id: r.get(0)?,
        workflow: r.get(1)?,
        version: r.get(2)?,
        input: Value::Null,
        key: r.get(4)?,
        status: run_status_at(r, 5)?,
        result: opt_json_at(r, 6)?,
        error: r.get(7)?,
        wake_at_ms: r.get(8)?,
        waiting_for: r.get(9)?,
        cancel_requested: r.get(10)?,
        forked_from: r.get(11)?,
        lease_owner: r.get(12)?,
        lease_expires_at_ms: r.get(13)?,
        recoveries: r.get(14)?,
        created_at_ms: r.get(15)?,
        updated_at_ms: r.get(16)?,
        parent_run_id: r.get(17)?,
        queue: r.get(18)?,
        priority: r.get(19)?,
        admitted_at_ms: r.get(20)?,
        deadline_ms: r.get(21)?,
    })
}

fn journal_entry(r: &Row<'_>) -> rusqlite::Result<JournalEntry> {
    let kind: String = r.get(2)?;
    let status: String = r.get(3)?;
    Ok(JournalEntry {
        seq: r.get(0)?,
        name: r.get(1)?,
        kind: StepKind::parse(&kind).ok_or_else(|| bad_column(2, format!("unknown step kind {kind:?}")))?,
        status: StepStatus::parse(&status).ok_or_else(|| bad_column(3, format!("unknown step status {status:?}")))?,
        output: opt_json_at(r, 4)?,
        error: r.get(5)?,
        attempts: r.get(6)?,
        next_attempt_at_ms: r.get(7)?,
        wake_at_ms: r.get(8)?,
        event_name: r.get(9)?,
        reason: r.get(10)?,
        updated_at_ms: r.get(11)?,
    })
}

fn run_event(r: &Row<'_>) -> rusqlite::Result<RunEvent> {
    Ok(RunEvent {
        event_id: r.get(0)?,
        name: r.get(1)?,
        payload: json_at(r, 2)?,
        received_at_ms: r.get(3)?,
        consumed_by_seq: r.get(4)?,
    })
}

pub(super) fn load_run(conn: &Connection, run_id: &str) -> Result<Option<RunRecord>> {
    conn.prepare_cached(&format!("SELECT {RUN_COLUMNS} FROM runs WHERE run_id = ?1"))
        .db()?
        .query_row([run_id], run_record)
        .optional()
        .db()
}

/// The run, or `not_found`.
pub(super) fn existing_run(conn: &Connection, run_id: &str) -> Result<RunRecord> {
    load_run(conn, run_id)?.ok_or_else(|| Error::not_found(format!("no run {run_id:?}")))
}

/// At most `limit` journal entries of the run after position `after` (-1: from the start).
pub(super) fn journal_page(conn: &Connection, run_id: &str, after: i64, limit: usize) -> Result<Vec<JournalEntry>> {
    let mut stmt = conn
        .prepare_cached(&format!(
            "SELECT {JOURNAL_COLUMNS} FROM journal WHERE run_id = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3"
        ))
        .db()?;
    let rows = stmt.query_map(params![run_id, after, limit as i64], journal_entry).db()?;
    rows.collect::<rusqlite::Result<Vec<_>>>().db()
}

/// The statement of [`journal_with`] (to run it for many runs).
pub(super) fn journal_statement(conn: &Connection) -> Result<CachedStatement<'_>> {
    conn.prepare_cached(&format!("SELECT {JOURNAL_COLUMNS} FROM journal WHERE run_id = ?1 ORDER BY seq")).db()
}

/// A run's journal in position order, with [`journal_statement`].
pub(super) fn journal_with(stmt: &mut CachedStatement<'_>, run_id: &str) -> Result<Vec<JournalEntry>> {
    let rows = stmt.query_map([run_id], journal_entry).db()?;
    rows.collect::<rusqlite::Result<Vec<_>>>().db()
}

pub(super) fn journal_at(conn: &Connection, run_id: &str, seq: u32) -> Result<Option<JournalEntry>> {
    conn.prepare_cached(&format!("SELECT {JOURNAL_COLUMNS} FROM journal WHERE run_id = ?1 AND seq = ?2"))
        .db()?
        .query_row(params![run_id, seq], journal_entry)
        .optional()
        .db()
}

/// The position the next new journal entry of the run takes.
pub(super) fn next_seq(conn: &Connection, run_id: &str) -> Result<i64> {
    conn.prepare_cached("SELECT coalesce(max(seq) + 1, 0) FROM journal WHERE run_id = ?1")
        .db()?
        .query_row([run_id], |r| r.get(0))
        .db()
}

/// The attempts of the run's journal positions in `after + 1..=last`, by position and attempt:
/// of each position the last [`DETAIL_ATTEMPTS_MAX`] by attempt number (the primary key finds
/// each position's highest and reads only those after it less the bound).
pub(super) fn attempts(conn: &Connection, run_id: &str, after: i64, last: i64) -> Result<Vec<AttemptRecord>> {
    let mut stmt = conn
        .prepare_cached(
            "SELECT a.seq, a.attempt, a.ok, a.error, a.finished_at_ms FROM journal j
             JOIN step_attempts a ON a.run_id = j.run_id AND a.seq = j.seq
              AND a.attempt > (SELECT max(m.attempt) FROM step_attempts m WHERE m.run_id = j.run_id AND m.seq = j.seq) - ?4
             WHERE j.run_id = ?1 AND j.seq > ?2 AND j.seq <= ?3 ORDER BY a.seq, a.attempt",
        )
        .db()?;
    let rows = stmt
        .query_map(params![run_id, after, last, DETAIL_ATTEMPTS_MAX], |r| {
            Ok(AttemptRecord {
                seq: r.get(0)?,
                attempt: r.get(1)?,
                ok: r.get(2)?,
                error: r.get(3)?,
                finished_at_ms: r.get(4)?,
            })
        })
        .db()?;
    rows.collect::<rusqlite::Result<Vec<_>>>().db()
}

/// The run's events consumed by its positions in `after + 1..=last`, in arrival order.
pub(super) fn consumed_events(conn: &Connection, run_id: &str, after: i64, last: i64) -> Result<Vec<RunEvent>> {
    let mut stmt = conn
        .prepare_cached(&format!(
            "SELECT {EVENT_COLUMNS} FROM run_events
             WHERE run_id = ?1 AND consumed_by_seq > ?2 AND consumed_by_seq <= ?3
             ORDER BY received_at_ms, event_id"
        ))
        .db()?;
    let rows = stmt.query_map(params![run_id, after, last], run_event).db()?;
    rows.collect::<rusqlite::Result<Vec<_>>>().db()
}

/// The page of [`unconsumed_events`]: through `run_events_unconsumed`, never the events consumed.
pub(super) const UNCONSUMED_PAGE_SQL: &str = "SELECT event_id, name, payload, received_at_ms, consumed_by_seq
     FROM run_events
     WHERE run_id = ?1 AND consumed_by_seq IS NULL AND (?2 IS NULL OR (received_at_ms, event_id) > (?2, ?3))
     ORDER BY received_at_ms, event_id LIMIT ?4";

/// How many events no wait consumed yet a run holds, counted up to `?2`
/// ([`tidemark_core::workflow::RUN_EVENTS_HELD_MAX`]): through `run_events_unconsumed`.
pub(super) const EVENTS_HELD_SQL: &str =
    "SELECT count(*) FROM (SELECT 1 FROM run_events WHERE run_id = ?1 AND consumed_by_seq IS NULL LIMIT ?2)";

/// All of a run's events no wait consumed yet, in arrival order (a claim's): through
/// `run_events_unconsumed`, never the events consumed.
pub(super) const UNCONSUMED_SQL: &str = "SELECT event_id, name, payload, received_at_ms, consumed_by_seq
     FROM run_events WHERE run_id = ?1 AND consumed_by_seq IS NULL ORDER BY received_at_ms, event_id";

/// At most `limit` of the run's events no wait consumed yet, in arrival order, after `after`
/// (received_at_ms, event_id).
pub(super) fn unconsumed_events(
    conn: &Connection,
    run_id: &str,
    after: Option<&(i64, String)>,
    limit: usize,
) -> Result<Vec<RunEvent>> {
    let mut stmt = conn.prepare_cached(UNCONSUMED_PAGE_SQL).db()?;
    let (ms, id) = after.map(|(ms, id)| (*ms, id.as_str())).unzip();
    let rows = stmt.query_map(params![run_id, ms, id, limit as i64], run_event).db()?;
    rows.collect::<rusqlite::Result<Vec<_>>>().db()
}

/// The statement of [`unconsumed_with`] (to run it for many runs).
pub(super) fn unconsumed_statement(conn: &Connection) -> Result<CachedStatement<'_>> {
    conn.prepare_cached(UNCONSUMED_SQL).db()
}

/// All of the run's events no wait consumed yet, in arrival order, with [`unconsumed_statement`].
pub(super) fn unconsumed_with(stmt: &mut CachedStatement<'_>, run_id: &str) -> Result<Vec<RunEvent>> {
    let rows = stmt.query_map(params![run_id], run_event).db()?;
    rows.collect::<rusqlite::Result<Vec<_>>>().db()
}

pub(super) fn event(conn: &Connection, run_id: &str, event_id: &str) -> Result<Option<RunEvent>> {
    conn.prepare_cached(&format!("SELECT {EVENT_COLUMNS} FROM run_events WHERE run_id = ?1 AND event_id = ?2"))
        .db()?
        .query_row([run_id, event_id], run_event)
        .optional()
        .db()
}

/// A purged run's receipt that has not expired at `now_ms`: (workflow, input_hash, status).
pub(super) fn live_receipt(
    conn: &Connection,
    run_id: &str,
    now_ms: i64,
) -> Result<Option<(String, String, RunStatus)>> {
    Ok(receipt(conn, run_id)?.filter(|r| r.live(now_ms)).map(|r| (r.workflow, r.input_hash, r.status)))
}

/// The receipt a run left when it was removed (its workflow, input hash and end), which keeps
/// its id taken until `expires_at_ms`.
pub(super) struct Receipt {
    pub workflow: String,
    pub input_hash: String,
    pub status: RunStatus,
    pub expires_at_ms: i64,
}

impl Receipt {
    pub fn live(&self, now_ms: i64) -> bool {
        self.expires_at_ms > now_ms
    }
}

/// The receipt of `run_id`, live or expired.
pub(super) fn receipt(conn: &Connection, run_id: &str) -> Result<Option<Receipt>> {
    conn.prepare_cached("SELECT workflow, input_hash, status, expires_at_ms FROM run_receipts WHERE run_id = ?1")
        .db()?
        .query_row([run_id], |r| {
            Ok(Receipt {
                workflow: r.get(0)?,
                input_hash: r.get(1)?,
                status: run_status_at(r, 2)?,
                expires_at_ms: r.get(3)?,
            })
        })
        .optional()
        .db()
}

/// Canonical JSON text of a value (serde_json writes object keys in sorted order). The same
/// text as `value.to_string()`, written straight into a buffer rather than through
/// `fmt::Display` (which costs about twice as much).
pub(super) fn json_text(value: &Value) -> String {
    serde_json::to_string(value).expect("a JSON value always serialises")
}
