//! Row mapping and the small reads shared by the workflow operations (the PostgreSQL side of
//! `tidemark_store_sqlite`'s `workflow/rows.rs`).

use std::collections::HashMap;

use postgres::{GenericClient, Row};
use serde_json::Value;
use tidemark_core::workflow::{
    AttemptRecord, JournalEntry, RunEvent, RunRecord, RunStatus, StepKind, StepStatus, DETAIL_ATTEMPTS_MAX,
};
use tidemark_core::{Error, Result};

use crate::schema::Statements;
use crate::{col, col_u32, PgResult};

/// The columns of a run as [`run_record`] reads them (prefix `r.` where a query joins).
pub(super) const RUN_COLUMNS: &str = "run_id, workflow, version, input, key, status, result, error, wake_at_ms, \
     waiting_for, cancel_requested, forked_from, lease_owner, lease_expires_at_ms, recoveries, created_at_ms, \
     updated_at_ms, parent_run_id, queue, priority, admitted_at_ms, deadline_ms";

/// One run by id (`FOR UPDATE` variants lock it for an operator change).
const RUN_SQL: &str = "SELECT run_id, workflow, version, input, key, status, result, error, wake_at_ms,
     waiting_for, cancel_requested, forked_from, lease_owner, lease_expires_at_ms, recoveries, created_at_ms,
     updated_at_ms, parent_run_id, queue, priority, admitted_at_ms, deadline_ms FROM {s}.runs WHERE run_id = $1";
const RUN_LOCKED_SQL: &str = "SELECT run_id, workflow, version, input, key, status, result, error, wake_at_ms,
     waiting_for, cancel_requested, forked_from, lease_owner, lease_expires_at_ms, recoveries, created_at_ms,
     updated_at_ms, parent_run_id, queue, priority, admitted_at_ms, deadline_ms FROM {s}.runs WHERE run_id = $1 FOR UPDATE";
const JOURNAL_PAGE_SQL: &str =
    "SELECT seq, name, kind, status, output, error, attempts, next_attempt_at_ms, wake_at_ms,
     event_name, reason, updated_at_ms FROM {s}.journal WHERE run_id = $1 AND seq > $2 ORDER BY seq LIMIT $3";
const JOURNAL_AT_SQL: &str = "SELECT seq, name, kind, status, output, error, attempts, next_attempt_at_ms, wake_at_ms,
     event_name, reason, updated_at_ms FROM {s}.journal WHERE run_id = $1 AND seq = $2";
/// The last `$4` attempts (by number) of each journal position in `$2 + 1..=$3`: the primary key
/// finds each position's highest and reads only those after it less the bound.
const ATTEMPTS_SQL: &str = "SELECT a.seq, a.attempt, a.ok, a.error, a.finished_at_ms FROM {s}.journal j
     JOIN {s}.step_attempts a ON a.run_id = j.run_id AND a.seq = j.seq
      AND a.attempt > (SELECT max(m.attempt) FROM {s}.step_attempts m WHERE m.run_id = j.run_id AND m.seq = j.seq) - $4
     WHERE j.run_id = $1 AND j.seq > $2 AND j.seq <= $3 ORDER BY a.seq, a.attempt";
const CONSUMED_EVENTS_SQL: &str = "SELECT event_id, name, payload, received_at_ms, consumed_by_seq FROM {s}.run_events
     WHERE run_id = $1 AND consumed_by_seq > $2 AND consumed_by_seq <= $3 ORDER BY received_at_ms, event_id";
/// How many events no wait consumed yet a run holds, counted up to `$2`
/// ([`tidemark_core::workflow::RUN_EVENTS_HELD_MAX`]): through `run_events_unconsumed`.
pub(crate) const EVENTS_HELD_SQL: &str =
    "SELECT count(*) FROM (SELECT 1 FROM {s}.run_events WHERE run_id = $1 AND consumed_by_seq IS NULL LIMIT $2) h";
pub(crate) const UNCONSUMED_PAGE_SQL: &str =
    "SELECT event_id, name, payload, received_at_ms, consumed_by_seq FROM {s}.run_events
     WHERE run_id = $1 AND consumed_by_seq IS NULL
       AND ($2::bigint IS NULL OR (received_at_ms, event_id) > ($2::bigint, $3::text))
     ORDER BY received_at_ms, event_id LIMIT $4";
const EVENT_SQL: &str = "SELECT event_id, name, payload, received_at_ms, consumed_by_seq FROM {s}.run_events
     WHERE run_id = $1 AND event_id = $2";
/// The journals of many runs at once (a claim's): one probe of `journal_pkey` per run, whatever
/// the table's statistics say. (`WHERE run_id = ANY($1)` was planned as a sequential scan of the
/// whole journal, each row compared with every run id, whenever the statistics were missing or
/// older than the table's growth: a new schema's first minute under load, where it took a
/// quarter of the server's CPU in the saga bench. A lateral subquery with its own `ORDER BY` is
/// not flattened into a join, so each run is an index scan of its own.) Rows come grouped by
/// run in position order; the caller does not rely on it.
pub(crate) const JOURNALS_SQL: &str = "SELECT u.run_id, j.seq, j.name, j.kind, j.status, j.output, j.error, j.attempts,
     j.next_attempt_at_ms, j.wake_at_ms, j.event_name, j.reason, j.updated_at_ms
 FROM unnest($1::text[]) AS u(run_id)
 CROSS JOIN LATERAL (SELECT * FROM {s}.journal WHERE run_id = u.run_id ORDER BY seq) j";
/// The unconsumed events of many runs at once (a claim's), one probe of `run_events_pkey` per run
/// (as [`JOURNALS_SQL`]).
pub(crate) const UNCONSUMED_EVENTS_SQL: &str = "SELECT u.run_id, e.event_id, e.name, e.payload, e.received_at_ms,
     e.consumed_by_seq
 FROM unnest($1::text[]) AS u(run_id)
 CROSS JOIN LATERAL (SELECT * FROM {s}.run_events WHERE run_id = u.run_id AND consumed_by_seq IS NULL
                     ORDER BY received_at_ms, event_id) e";
const NEXT_SEQ_SQL: &str = "SELECT coalesce(max(seq) + 1, 0) FROM {s}.journal WHERE run_id = $1";
const LIVE_RECEIPT_SQL: &str =
    "SELECT workflow, input_hash, status FROM {s}.run_receipts WHERE run_id = $1 AND expires_at_ms > $2";

fn json_column(row: &Row, index: usize) -> Result<Value> {
    let text: String = col(row, index)?;
    serde_json::from_str(&text).map_err(|e| Error::store(format!("corrupt JSON in column {index}: {e}")))
}

fn opt_json_column(row: &Row, index: usize) -> Result<Option<Value>> {
    let text: Option<String> = col(row, index)?;
    text.map(|t| serde_json::from_str(&t).map_err(|e| Error::store(format!("corrupt JSON in column {index}: {e}"))))
        .transpose()
}

fn opt_u32(row: &Row, index: usize) -> Result<Option<u32>> {
    let value: Option<i32> = col(row, index)?;
    value
        .map(|v| u32::try_from(v).map_err(|_| Error::store(format!("column {index} holds {v}, not a u32"))))
        .transpose()
}

/// A `u32` stored as `bigint` (workflow versions).
pub(super) fn col_u32_wide(row: &Row, index: usize) -> Result<u32> {
    let value: i64 = col(row, index)?;
    u32::try_from(value).map_err(|_| Error::store(format!("column {index} holds {value}, not a u32")))
}

pub(super) fn run_status_column(row: &Row, index: usize) -> Result<RunStatus> {
    let text: String = col(row, index)?;
    RunStatus::parse(&text).ok_or_else(|| Error::store(format!("unknown run status {text:?}")))
}

/// Map a row selected with [`RUN_COLUMNS`].
pub(super) fn run_record(row: &Row) -> Result<RunRecord> {
    let input = json_column(row, 3)?;
    Ok(RunRecord { input, ..run_record_without_input(row)? })
}

/// [`run_record`] with the input left `null`, for a reader that parses the input text (column 3)
/// only when it needs it (a claim's candidates).
pub(super) fn run_record_without_input(row: &Row) -> Result<RunRecord> {
    Ok(RunRecord {
        run_id: col(row, 0)?,
        workflow: col(row, 1)?,
        version: col_u32_wide(row, 2)?,
        input: Value::Null,
        key: col(row, 4)?,
        status: run_status_column(row, 5)?,
        result: opt_json_column(row, 6)?,
        error: col(row, 7)?,
        wake_at_ms: col(row, 8)?,
        waiting_for: col(row, 9)?,
        cancel_requested: col(row, 10)?,
        forked_from: col(row, 11)?,
        lease_owner: col(row, 12)?,
        lease_expires_at_ms: col(row, 13)?,
        recoveries: col_u32(row, 14)?,
        created_at_ms: col(row, 15)?,
        updated_at_ms: col(row, 16)?,
        parent_run_id: col(row, 17)?,
        queue: col(row, 18)?,
        priority: col(row, 19)?,
        admitted_at_ms: col(row, 20)?,
        deadline_ms: col(row, 21)?,
    })
}

/// Map a row selected with [`JOURNAL_COLUMNS`] starting at column `at`.
fn journal_entry(row: &Row, at: usize) -> Result<JournalEntry> {
    let kind: String = col(row, at + 2)?;
    let status: String = col(row, at + 3)?;
    Ok(JournalEntry {
        seq: col_u32(row, at)?,
        name: col(row, at + 1)?,
        kind: StepKind::parse(&kind).ok_or_else(|| Error::store(format!("unknown step kind {kind:?}")))?,
        status: StepStatus::parse(&status).ok_or_else(|| Error::store(format!("unknown step status {status:?}")))?,
        output: opt_json_column(row, at + 4)?,
        error: col(row, at + 5)?,
        attempts: col_u32(row, at + 6)?,
        next_attempt_at_ms: col(row, at + 7)?,
        wake_at_ms: col(row, at + 8)?,
        event_name: col(row, at + 9)?,
        reason: col(row, at + 10)?,
        updated_at_ms: col(row, at + 11)?,
    })
}

/// Map a row selected with [`EVENT_COLUMNS`] starting at column `at`.
fn run_event(row: &Row, at: usize) -> Result<RunEvent> {
    Ok(RunEvent {
        event_id: col(row, at)?,
        name: col(row, at + 1)?,
        payload: json_column(row, at + 2)?,
        received_at_ms: col(row, at + 3)?,
        consumed_by_seq: opt_u32(row, at + 4)?,
    })
}

pub(super) fn load_run(c: &mut impl GenericClient, st: &mut Statements, run_id: &str) -> Result<Option<RunRecord>> {
    let statement = st.get(c, RUN_SQL)?;
    c.query_opt(&statement, &[&run_id]).db()?.map(|r| run_record(&r)).transpose()
}

/// The run, or `not_found`.
pub(super) fn existing_run(c: &mut impl GenericClient, st: &mut Statements, run_id: &str) -> Result<RunRecord> {
    load_run(c, st, run_id)?.ok_or_else(|| Error::not_found(format!("no run {run_id:?}")))
}

/// The run, locked until the transaction ends (`FOR UPDATE`), or `not_found`: what every change
/// of a single run reads first, so that nobody changes it between the check and the write.
pub(super) fn locked_run(c: &mut impl GenericClient, st: &mut Statements, run_id: &str) -> Result<RunRecord> {
    let statement = st.get(c, RUN_LOCKED_SQL)?;
    c.query_opt(&statement, &[&run_id])
        .db()?
        .map(|r| run_record(&r))
        .transpose()?
        .ok_or_else(|| Error::not_found(format!("no run {run_id:?}")))
}

/// At most `limit` journal entries of the run after position `after` (-1: from the start).
pub(super) fn journal_page(
    c: &mut impl GenericClient,
    st: &mut Statements,
    run_id: &str,
    after: i32,
    limit: usize,
) -> Result<Vec<JournalEntry>> {
    let statement = st.get(c, JOURNAL_PAGE_SQL)?;
    c.query(&statement, &[&run_id, &after, &(limit as i64)]).db()?.iter().map(|r| journal_entry(r, 0)).collect()
}

pub(super) fn journal_at(
    c: &mut impl GenericClient,
    st: &mut Statements,
    run_id: &str,
    seq: u32,
) -> Result<Option<JournalEntry>> {
    let statement = st.get(c, JOURNAL_AT_SQL)?;
    c.query_opt(&statement, &[&run_id, &(seq as i32)]).db()?.map(|r| journal_entry(&r, 0)).transpose()
}

/// The journals of `run_ids`, by run.
pub(crate) fn journals(
    c: &mut impl GenericClient,
    st: &mut Statements,
    run_ids: &[String],
) -> Result<HashMap<String, Vec<JournalEntry>>> {
    let statement = st.get(c, JOURNALS_SQL)?;
    let mut by_run: HashMap<String, Vec<JournalEntry>> = HashMap::new();
    for row in c.query(&statement, &[&run_ids]).db()? {
        by_run.entry(col(&row, 0)?).or_default().push(journal_entry(&row, 1)?);
    }
    for journal in by_run.values_mut() {
        journal.sort_by_key(|entry| entry.seq);
    }
    Ok(by_run)
}

/// The position the next new journal entry of the run takes.
pub(super) fn next_seq(c: &mut impl GenericClient, st: &mut Statements, run_id: &str) -> Result<i64> {
    let statement = st.get(c, NEXT_SEQ_SQL)?;
    let next: i32 = col(&c.query_one(&statement, &[&run_id]).db()?, 0)?;
    Ok(i64::from(next))
}

/// The attempts of the run's journal positions in `after + 1..=last`, by position and attempt:
/// of each position the last [`DETAIL_ATTEMPTS_MAX`].
pub(super) fn attempts(
    c: &mut impl GenericClient,
    st: &mut Statements,
    run_id: &str,
    after: i32,
    last: i32,
) -> Result<Vec<AttemptRecord>> {
    let statement = st.get(c, ATTEMPTS_SQL)?;
    c.query(&statement, &[&run_id, &after, &last, &(DETAIL_ATTEMPTS_MAX as i32)])
        .db()?
        .iter()
        .map(|r| {
            Ok(AttemptRecord {
                seq: col_u32(r, 0)?,
                attempt: col_u32(r, 1)?,
                ok: col(r, 2)?,
                error: col(r, 3)?,
                finished_at_ms: col(r, 4)?,
            })
        })
        .collect()
}

/// The run's events consumed by its positions in `after + 1..=last`, in arrival order.
pub(super) fn consumed_events(
    c: &mut impl GenericClient,
    st: &mut Statements,
    run_id: &str,
    after: i32,
    last: i32,
) -> Result<Vec<RunEvent>> {
    let statement = st.get(c, CONSUMED_EVENTS_SQL)?;
    c.query(&statement, &[&run_id, &after, &last]).db()?.iter().map(|r| run_event(r, 0)).collect()
}

/// At most `limit` of the run's events no wait consumed yet, in arrival order, after `after`
/// (received_at_ms, event_id).
pub(super) fn unconsumed_page(
    c: &mut impl GenericClient,
    st: &mut Statements,
    run_id: &str,
    after: Option<&(i64, String)>,
    limit: usize,
) -> Result<Vec<RunEvent>> {
    let statement = st.get(c, UNCONSUMED_PAGE_SQL)?;
    let (ms, id) = after.map(|(ms, id)| (*ms, id.as_str())).unzip();
    c.query(&statement, &[&run_id, &ms, &id, &(limit as i64)]).db()?.iter().map(|r| run_event(r, 0)).collect()
}

/// The unconsumed events of `run_ids`, by run.
pub(super) fn unconsumed_events(
    c: &mut impl GenericClient,
    st: &mut Statements,
    run_ids: &[String],
) -> Result<HashMap<String, Vec<RunEvent>>> {
    let statement = st.get(c, UNCONSUMED_EVENTS_SQL)?;
    let mut by_run: HashMap<String, Vec<RunEvent>> = HashMap::new();
    for row in c.query(&statement, &[&run_ids]).db()? {
        by_run.entry(col(&row, 0)?).or_default().push(run_event(&row, 1)?);
    }
    for events in by_run.values_mut() {
        events.sort_by(|a, b| (a.received_at_ms, &a.event_id).cmp(&(b.received_at_ms, &b.event_id)));
    }
    Ok(by_run)
}

pub(super) fn event(
    c: &mut impl GenericClient,
    st: &mut Statements,
    run_id: &str,
    event_id: &str,
) -> Result<Option<RunEvent>> {
    let statement = st.get(c, EVENT_SQL)?;
    c.query_opt(&statement, &[&run_id, &event_id]).db()?.map(|r| run_event(&r, 0)).transpose()
}

/// A purged run's receipt that has not expired at `now_ms`: (workflow, input_hash, status).
pub(super) fn live_receipt(
    c: &mut impl GenericClient,
    st: &mut Statements,
    run_id: &str,
    now_ms: i64,
) -> Result<Option<(String, String, RunStatus)>> {
    let statement = st.get(c, LIVE_RECEIPT_SQL)?;
    c.query_opt(&statement, &[&run_id, &now_ms])
        .db()?
        .map(|r| Ok((col(&r, 0)?, col(&r, 1)?, run_status_column(&r, 2)?)))
        .transpose()
}

/// Canonical JSON text of a value (serde_json writes object keys in sorted order).
pub(crate) fn json_text(value: &Value) -> String {
    serde_json::to_string(value).expect("a JSON value always serialises")
}
