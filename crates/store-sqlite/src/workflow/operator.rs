//! Operator controls (cancel, retry, fork, skip, abandon) and purge. Each is one immediate
//! transaction; every change but `cancel` clears the lease, which fences its old holder.

use rusqlite::{params, Connection, TransactionBehavior};
use serde_json::Value;
use tidemark_core::crash;
use tidemark_core::error::codes;
use tidemark_core::id::{validate_id, validate_limit, validate_reason};
use tidemark_core::limits::PRUNE_BATCH_ROWS_MAX;
use tidemark_core::workflow::{
    validate_json_size, PurgeReport, RunRecord, RunStatus, StepStatus, RUN_STEPS_MAX, STEP_OUTPUT_BYTES_MAX,
};
use tidemark_core::{ensure_invariant, Error, Result};

use super::rows::{self, json_text};
use crate::SqlResult;

fn state_change(run: &RunRecord, action: &str) -> Error {
    Error::invalid(
        codes::INVALID_STATE_CHANGE,
        format!("cannot {action} run {:?}: it is {}", run.run_id, run.status.as_str()),
    )
}

const CLEAR_LEASE: &str = "lease_owner = NULL, lease_token = NULL, lease_expires_at_ms = NULL";

/// Commit an operator change and return the run as it now is.
fn finish(tx: rusqlite::Transaction<'_>, run_id: &str) -> Result<RunRecord> {
    let run = rows::existing_run(&tx, run_id)?;
    crash::hit("workflow.operator.before_commit");
    tx.commit().db()?;
    Ok(run)
}

pub(super) fn cancel(conn: &mut Connection, run_id: &str, reason: &str, now_ms: i64) -> Result<RunRecord> {
    validate_id("run_id", run_id)?;
    validate_reason(reason)?;
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
    let run = rows::existing_run(&tx, run_id)?;
    if run.status.is_terminal() {
        return Err(state_change(&run, "cancel"));
    }
    // A request: the lease stays with its holder, who learns of it from its next heartbeat.
    tx.prepare_cached(
        "UPDATE runs SET cancel_requested = 1, error = ?3, wake_at_ms = min(wake_at_ms, ?2), updated_at_ms = ?2
         WHERE run_id = ?1",
    )
    .db()?
    .execute(params![run_id, now_ms, format!("cancel requested: {reason}")])
    .db()?;
    finish(tx, run_id)
}

pub(super) fn retry(conn: &mut Connection, run_id: &str, reason: &str, now_ms: i64) -> Result<RunRecord> {
    validate_id("run_id", run_id)?;
    validate_reason(reason)?;
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
    let run = rows::existing_run(&tx, run_id)?;
    if !matches!(run.status, RunStatus::Failed | RunStatus::Parked) {
        return Err(state_change(&run, "retry"));
    }
    // The last failed entry runs again with a fresh attempt budget; its attempt history stays.
    // (A saga parked on a compensation retries that compensation, not the step that failed.)
    // A cancel request stays: after a cancel the journal holds compensations, and the replay
    // must take the cancelled path again to meet them (then the run ends `cancelled`).
    tx.prepare_cached(
        "UPDATE journal SET status = 'retrying', attempts = 0, next_attempt_at_ms = ?2, reason = ?3, updated_at_ms = ?2
         WHERE run_id = ?1 AND seq = (SELECT max(seq) FROM journal WHERE run_id = ?1 AND status = 'failed')",
    )
    .db()?
    .execute(params![run_id, now_ms, format!("operator retry: {reason}")])
    .db()?;
    tx.prepare_cached(&format!(
        "UPDATE runs SET status = 'pending', result = NULL, finished_at_ms = NULL, waiting_for = NULL,
             error = NULL, wake_at_ms = ?2, updated_at_ms = ?2, {CLEAR_LEASE}
         WHERE run_id = ?1"
    ))
    .db()?
    .execute(params![run_id, now_ms])
    .db()?;
    finish(tx, run_id)
}

pub(super) fn fork(
    conn: &mut Connection,
    run_id: &str,
    from_seq: u32,
    new_run_id: &str,
    now_ms: i64,
) -> Result<RunRecord> {
    validate_id("run_id", run_id)?;
    validate_id("new_run_id", new_run_id)?;
    if from_seq > RUN_STEPS_MAX {
        return Err(Error::invalid(codes::INVALID_SEQ, format!("from_seq must be 0..={RUN_STEPS_MAX}")));
    }
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
    rows::existing_run(&tx, run_id)?;
    let journal_len = rows::next_seq(&tx, run_id)?;
    if i64::from(from_seq) > journal_len {
        return Err(Error::invalid(
            codes::INVALID_SEQ,
            format!("run {run_id:?} has {journal_len} journal entries; cannot fork from step {from_seq}"),
        ));
    }
    if rows::load_run(&tx, new_run_id)?.is_some() || rows::live_receipt(&tx, new_run_id, now_ms)?.is_some() {
        return Err(Error::invalid(codes::ALREADY_EXISTS, format!("run {new_run_id:?} already exists")));
    }
    tx.prepare_cached("DELETE FROM run_receipts WHERE run_id = ?1").db()?.execute([new_run_id]).db()?;
    let inserted = tx
        .prepare_cached(
            "INSERT INTO runs (run_id, workflow, version, input, input_hash, key, status, wake_at_ms, forked_from,
                               created_at_ms, updated_at_ms)
             SELECT ?2, workflow, version, input, input_hash, key, 'pending', ?3, run_id, ?3, ?3
             FROM runs WHERE run_id = ?1",
        )
        .db()?
        .execute(params![run_id, new_run_id, now_ms])
        .db()?;
    ensure_invariant!(inserted == 1, "forking {run_id} inserted {inserted} runs");
    // The journal before `from_seq` is reused as is (its transactional steps' writes are not
    // repeated), with its attempt history and the events its waits consumed.
    tx.prepare_cached(
        "INSERT INTO journal (run_id, seq, name, kind, status, output, error, attempts, next_attempt_at_ms, wake_at_ms,
                              event_name, reason, updated_at_ms)
         SELECT ?2, seq, name, kind, status, output, error, attempts, next_attempt_at_ms, wake_at_ms, event_name,
                reason, updated_at_ms
         FROM journal WHERE run_id = ?1 AND seq < ?3",
    )
    .db()?
    .execute(params![run_id, new_run_id, from_seq])
    .db()?;
    tx.prepare_cached(
        "INSERT INTO step_attempts (run_id, seq, attempt, ok, error, finished_at_ms)
         SELECT ?2, seq, attempt, ok, error, finished_at_ms FROM step_attempts WHERE run_id = ?1 AND seq < ?3",
    )
    .db()?
    .execute(params![run_id, new_run_id, from_seq])
    .db()?;
    tx.prepare_cached(
        "INSERT INTO run_events (run_id, event_id, name, payload, received_at_ms, consumed_by_seq)
         SELECT ?2, event_id, name, payload, received_at_ms, consumed_by_seq FROM run_events
         WHERE run_id = ?1 AND consumed_by_seq < ?3",
    )
    .db()?
    .execute(params![run_id, new_run_id, from_seq])
    .db()?;
    finish(tx, new_run_id)
}

pub(super) fn skip_step(
    conn: &mut Connection,
    run_id: &str,
    seq: u32,
    output: &Value,
    reason: &str,
    now_ms: i64,
) -> Result<RunRecord> {
    validate_id("run_id", run_id)?;
    validate_reason(reason)?;
    validate_json_size("step output", output, STEP_OUTPUT_BYTES_MAX, codes::PAYLOAD_TOO_LARGE)?;
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
    let run = rows::existing_run(&tx, run_id)?;
    if matches!(run.status, RunStatus::Completed | RunStatus::Compensated | RunStatus::Cancelled) {
        return Err(state_change(&run, "skip a step of"));
    }
    let Some(entry) = rows::journal_at(&tx, run_id, seq)? else {
        return Err(Error::not_found(format!("run {run_id:?} has no step {seq}")));
    };
    if !matches!(entry.status, StepStatus::Failed | StepStatus::Retrying | StepStatus::Waiting) {
        return Err(Error::invalid(
            codes::INVALID_STATE_CHANGE,
            format!("cannot skip step {seq} ({}) of run {run_id:?}: it is {}", entry.name, entry.status.as_str()),
        ));
    }
    tx.prepare_cached(
        "UPDATE journal SET status = 'skipped', output = ?3, next_attempt_at_ms = NULL, reason = ?4, updated_at_ms = ?5
         WHERE run_id = ?1 AND seq = ?2",
    )
    .db()?
    .execute(params![run_id, seq, json_text(output), format!("operator skip: {reason}"), now_ms])
    .db()?;
    // Runnable again at once: a compensating saga goes on compensating; anything else resumes.
    let status = if run.status == RunStatus::Compensating { RunStatus::Compensating } else { RunStatus::Pending };
    tx.prepare_cached(&format!(
        "UPDATE runs SET status = ?2, result = NULL, error = NULL, finished_at_ms = NULL, waiting_for = NULL,
             wake_at_ms = ?3, updated_at_ms = ?3, {CLEAR_LEASE}
         WHERE run_id = ?1"
    ))
    .db()?
    .execute(params![run_id, status.as_str(), now_ms])
    .db()?;
    finish(tx, run_id)
}

pub(super) fn abandon(conn: &mut Connection, run_id: &str, reason: &str, now_ms: i64) -> Result<RunRecord> {
    validate_id("run_id", run_id)?;
    validate_reason(reason)?;
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
    let run = rows::existing_run(&tx, run_id)?;
    if run.status.is_terminal() && run.status != RunStatus::Parked {
        return Err(state_change(&run, "abandon"));
    }
    tx.prepare_cached(&format!(
        "UPDATE runs SET status = 'cancelled', error = ?3, finished_at_ms = ?2, waiting_for = NULL, updated_at_ms = ?2,
             {CLEAR_LEASE}
         WHERE run_id = ?1"
    ))
    .db()?
    .execute(params![run_id, now_ms, format!("abandoned: {reason}")])
    .db()?;
    super::commit::run_ended(&tx, run_id, now_ms)?;
    finish(tx, run_id)
}

/// Finished runs, oldest first (parameters: finished_before_ms, limit).
pub(super) const PURGE_SELECT_SQL: &str = "SELECT run_id, workflow, input_hash, status, finished_at_ms FROM runs
     WHERE finished_at_ms IS NOT NULL AND finished_at_ms < ?1
     ORDER BY finished_at_ms, run_id LIMIT ?2";

/// Expired receipts, a bounded batch (parameters: now_ms, limit).
pub(super) const RECEIPTS_EXPIRED_DELETE_SQL: &str = "DELETE FROM run_receipts WHERE run_id IN
     (SELECT run_id FROM run_receipts WHERE expires_at_ms <= ?1 ORDER BY expires_at_ms LIMIT ?2)";

pub(super) fn purge(
    conn: &mut Connection,
    finished_before_ms: i64,
    batch_rows: usize,
    receipt_window_ms: i64,
    now_ms: i64,
) -> Result<PurgeReport> {
    validate_limit("purge batch", batch_rows, PRUNE_BATCH_ROWS_MAX)?;
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
    let finished: Vec<(String, String, String, String, i64)> = {
        let mut stmt = tx.prepare_cached(PURGE_SELECT_SQL).db()?;
        let rows = stmt
            .query_map(params![finished_before_ms, batch_rows as i64], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
            })
            .db()?;
        rows.collect::<rusqlite::Result<Vec<_>>>().db()?
    };
    let mut journal_deleted = 0;
    for (run_id, workflow, input_hash, status, finished_at_ms) in &finished {
        let expires_at_ms = finished_at_ms.saturating_add(receipt_window_ms);
        if expires_at_ms > now_ms {
            tx.prepare_cached(
                "INSERT INTO run_receipts (run_id, workflow, input_hash, status, finished_at_ms, expires_at_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)
                 ON CONFLICT (run_id) DO UPDATE SET workflow = excluded.workflow, input_hash = excluded.input_hash,
                     status = excluded.status, finished_at_ms = excluded.finished_at_ms,
                     expires_at_ms = excluded.expires_at_ms",
            )
            .db()?
            .execute(params![run_id, workflow, input_hash, status, finished_at_ms, expires_at_ms])
            .db()?;
        }
        journal_deleted +=
            tx.prepare_cached("DELETE FROM journal WHERE run_id = ?1").db()?.execute([run_id]).db()? as u64;
        tx.prepare_cached("DELETE FROM step_attempts WHERE run_id = ?1").db()?.execute([run_id]).db()?;
        tx.prepare_cached("DELETE FROM run_events WHERE run_id = ?1").db()?.execute([run_id]).db()?;
        tx.prepare_cached("DELETE FROM run_published WHERE run_id = ?1").db()?.execute([run_id]).db()?;
        let deleted = tx.prepare_cached("DELETE FROM runs WHERE run_id = ?1").db()?.execute([run_id]).db()?;
        ensure_invariant!(deleted == 1, "purging run {run_id} deleted {deleted} rows");
    }
    let receipts_deleted =
        tx.prepare_cached(RECEIPTS_EXPIRED_DELETE_SQL).db()?.execute(params![now_ms, batch_rows as i64]).db()?;
    crash::hit("workflow.purge.before_commit");
    tx.commit().db()?;
    Ok(PurgeReport {
        runs_deleted: finished.len() as u64,
        journal_deleted,
        more: finished.len() == batch_rows || receipts_deleted == batch_rows,
    })
}
