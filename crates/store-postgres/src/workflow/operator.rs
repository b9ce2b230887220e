//! Operator controls (cancel, retry, fork, skip, abandon) and purge. Each is one short
//! transaction that locks the run it changes before it reads it; every change but `cancel`
//! clears the lease, which fences its old holder.

use postgres::Transaction;
use serde_json::Value;
use tidemark_core::crash;
use tidemark_core::error::codes;
use tidemark_core::id::{validate_id, validate_limit, validate_reason};
use tidemark_core::limits::PRUNE_BATCH_ROWS_MAX;
use tidemark_core::workflow::{
    validate_json_size, PurgeReport, RunRecord, RunStatus, StepStatus, RUN_STEPS_MAX, STEP_OUTPUT_BYTES_MAX,
};
use tidemark_core::{ensure_invariant, Error, Result};

use super::commit::{LOCK_BATCH_SQL, RUN_ENDED_SQL};
use super::rows::{self, json_text};
use super::seq_param;
use crate::apply::{ApplyTransaction, CommitGate};
use crate::schema::Statements;
use crate::{col, PgResult};

fn state_change(run: &RunRecord, action: &str) -> Error {
    Error::invalid(
        codes::INVALID_STATE_CHANGE,
        format!("cannot {action} run {:?}: it is {}", run.run_id, run.status.as_str()),
    )
}

/// Commit an operator change and return the run as it now is.
fn finish(mut tx: Transaction<'_>, gate: CommitGate<'_>, st: &mut Statements, run_id: &str) -> Result<RunRecord> {
    let run = rows::existing_run(&mut tx, st, run_id)?;
    crash::hit("workflow.operator.before_commit");
    gate.commit(tx)?;
    Ok(run)
}

pub(super) fn cancel(
    apply: &mut ApplyTransaction,
    st: &mut Statements,
    run_id: &str,
    reason: &str,
    now_ms: i64,
) -> Result<RunRecord> {
    validate_id("run_id", run_id)?;
    validate_reason(reason)?;
    let (mut tx, gate) = apply.write_transaction()?;
    let run = rows::locked_run(&mut tx, st, run_id)?;
    if run.status.is_terminal() {
        return Err(state_change(&run, "cancel"));
    }
    // A request: the lease stays with its holder, who learns of it from its next heartbeat.
    let statement = st.get(
        &mut tx,
        "UPDATE {s}.runs SET cancel_requested = true, error = $3, wake_at_ms = least(wake_at_ms, $2),
             updated_at_ms = $2
         WHERE run_id = $1",
    )?;
    tx.execute(&statement, &[&run_id, &now_ms, &format!("cancel requested: {reason}")]).db()?;
    finish(tx, gate, st, run_id)
}

pub(super) fn retry(
    apply: &mut ApplyTransaction,
    st: &mut Statements,
    run_id: &str,
    reason: &str,
    now_ms: i64,
) -> Result<RunRecord> {
    validate_id("run_id", run_id)?;
    validate_reason(reason)?;
    let (mut tx, gate) = apply.write_transaction()?;
    let run = rows::locked_run(&mut tx, st, run_id)?;
    if !matches!(run.status, RunStatus::Failed | RunStatus::Parked) {
        return Err(state_change(&run, "retry"));
    }
    // The last failed entry runs again with a fresh attempt budget; its attempt history stays.
    // (A saga parked on a compensation retries that compensation, not the step that failed.)
    // A cancel request stays: after a cancel the journal holds compensations, and the replay
    // must take the cancelled path again to meet them (then the run ends `cancelled`).
    let reopen = st.get(
        &mut tx,
        "UPDATE {s}.journal SET status = 'retrying', attempts = 0, next_attempt_at_ms = $2, reason = $3,
             updated_at_ms = $2
         WHERE run_id = $1 AND seq = (SELECT max(seq) FROM {s}.journal WHERE run_id = $1 AND status = 'failed')",
    )?;
    tx.execute(&reopen, &[&run_id, &now_ms, &format!("operator retry: {reason}")]).db()?;
    let resume = st.get(
        &mut tx,
        "UPDATE {s}.runs SET status = 'pending', result = NULL, finished_at_ms = NULL, waiting_for = NULL,
             error = NULL, wake_at_ms = $2, updated_at_ms = $2,
             lease_owner = NULL, lease_token = NULL, lease_expires_at_ms = NULL
         WHERE run_id = $1",
    )?;
    tx.execute(&resume, &[&run_id, &now_ms]).db()?;
    finish(tx, gate, st, run_id)
}

pub(super) fn fork(
    apply: &mut ApplyTransaction,
    st: &mut Statements,
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
    let (mut tx, gate) = apply.write_transaction()?;
    // Locked: the source's journal, attempts and events are copied as one moment of them (its
    // commits wait meanwhile).
    rows::locked_run(&mut tx, st, run_id)?;
    let journal_len = rows::next_seq(&mut tx, st, run_id)?;
    if i64::from(from_seq) > journal_len {
        return Err(Error::invalid(
            codes::INVALID_SEQ,
            format!("run {run_id:?} has {journal_len} journal entries; cannot fork from step {from_seq}"),
        ));
    }
    let taken = || Error::invalid(codes::ALREADY_EXISTS, format!("run {new_run_id:?} already exists"));
    if rows::load_run(&mut tx, st, new_run_id)?.is_some()
        || rows::live_receipt(&mut tx, st, new_run_id, now_ms)?.is_some()
    {
        return Err(taken());
    }
    let forget = st.get(&mut tx, "DELETE FROM {s}.run_receipts WHERE run_id = $1")?;
    tx.execute(&forget, &[&new_run_id]).db()?;
    let copy_run = st.get(
        &mut tx,
        "INSERT INTO {s}.runs (run_id, workflow, version, input, input_hash, key, status, wake_at_ms, forked_from,
                               created_at_ms, updated_at_ms)
         SELECT $2, workflow, version, input, input_hash, key, 'pending', $3, run_id, $3, $3
         FROM {s}.runs WHERE run_id = $1
         ON CONFLICT (run_id) DO NOTHING",
    )?;
    let inserted = tx.execute(&copy_run, &[&run_id, &new_run_id, &now_ms]).db()?;
    if inserted == 0 {
        // Started elsewhere a moment ago (after the check above).
        return Err(taken());
    }
    // The journal before `from_seq` is reused as is (its transactional steps' writes are not
    // repeated), with its attempt history and the events its waits consumed.
    let from = seq_param(from_seq);
    let copy_journal = st.get(
        &mut tx,
        "INSERT INTO {s}.journal (run_id, seq, name, kind, status, output, error, attempts, next_attempt_at_ms,
                                  wake_at_ms, event_name, reason, updated_at_ms)
         SELECT $2, seq, name, kind, status, output, error, attempts, next_attempt_at_ms, wake_at_ms, event_name,
                reason, updated_at_ms
         FROM {s}.journal WHERE run_id = $1 AND seq < $3",
    )?;
    tx.execute(&copy_journal, &[&run_id, &new_run_id, &from]).db()?;
    let copy_attempts = st.get(
        &mut tx,
        "INSERT INTO {s}.step_attempts (run_id, seq, attempt, ok, error, finished_at_ms)
         SELECT $2, seq, attempt, ok, error, finished_at_ms FROM {s}.step_attempts WHERE run_id = $1 AND seq < $3",
    )?;
    tx.execute(&copy_attempts, &[&run_id, &new_run_id, &from]).db()?;
    let copy_events = st.get(
        &mut tx,
        "INSERT INTO {s}.run_events (run_id, event_id, name, payload, received_at_ms, consumed_by_seq)
         SELECT $2, event_id, name, payload, received_at_ms, consumed_by_seq FROM {s}.run_events
         WHERE run_id = $1 AND consumed_by_seq < $3",
    )?;
    tx.execute(&copy_events, &[&run_id, &new_run_id, &from]).db()?;
    finish(tx, gate, st, new_run_id)
}

pub(super) fn skip_step(
    apply: &mut ApplyTransaction,
    st: &mut Statements,
    run_id: &str,
    seq: u32,
    output: &Value,
    reason: &str,
    now_ms: i64,
) -> Result<RunRecord> {
    validate_id("run_id", run_id)?;
    validate_reason(reason)?;
    validate_json_size("step output", output, STEP_OUTPUT_BYTES_MAX, codes::PAYLOAD_TOO_LARGE)?;
    let (mut tx, gate) = apply.write_transaction()?;
    let run = rows::locked_run(&mut tx, st, run_id)?;
    if matches!(run.status, RunStatus::Completed | RunStatus::Compensated | RunStatus::Cancelled) {
        return Err(state_change(&run, "skip a step of"));
    }
    let Some(entry) = rows::journal_at(&mut tx, st, run_id, seq)? else {
        return Err(Error::not_found(format!("run {run_id:?} has no step {seq}")));
    };
    if !matches!(entry.status, StepStatus::Failed | StepStatus::Retrying | StepStatus::Waiting) {
        return Err(Error::invalid(
            codes::INVALID_STATE_CHANGE,
            format!("cannot skip step {seq} ({}) of run {run_id:?}: it is {}", entry.name, entry.status.as_str()),
        ));
    }
    let settle = st.get(
        &mut tx,
        "UPDATE {s}.journal SET status = 'skipped', output = $3, next_attempt_at_ms = NULL, reason = $4,
             updated_at_ms = $5
         WHERE run_id = $1 AND seq = $2",
    )?;
    tx.execute(&settle, &[&run_id, &seq_param(seq), &json_text(output), &format!("operator skip: {reason}"), &now_ms])
        .db()?;
    // Runnable again at once: a compensating saga goes on compensating; anything else resumes.
    let status = if run.status == RunStatus::Compensating { RunStatus::Compensating } else { RunStatus::Pending };
    let resume = st.get(
        &mut tx,
        "UPDATE {s}.runs SET status = $2, result = NULL, error = NULL, finished_at_ms = NULL, waiting_for = NULL,
             wake_at_ms = $3, updated_at_ms = $3, lease_owner = NULL, lease_token = NULL, lease_expires_at_ms = NULL
         WHERE run_id = $1",
    )?;
    tx.execute(&resume, &[&run_id, &status.as_str(), &now_ms]).db()?;
    finish(tx, gate, st, run_id)
}

pub(super) fn abandon(
    apply: &mut ApplyTransaction,
    st: &mut Statements,
    run_id: &str,
    reason: &str,
    now_ms: i64,
) -> Result<RunRecord> {
    validate_id("run_id", run_id)?;
    validate_reason(reason)?;
    let (mut tx, gate) = apply.write_transaction()?;
    // The run and its family (whom its end notifies, wakes or cancels), in run id order, as a
    // commit that finishes a run locks them.
    let family = st.get(&mut tx, LOCK_BATCH_SQL)?;
    let ids = vec![run_id];
    tx.query(&family, &[&ids, &ids]).db()?;
    let run = rows::existing_run(&mut tx, st, run_id)?;
    if run.status.is_terminal() && run.status != RunStatus::Parked {
        return Err(state_change(&run, "abandon"));
    }
    let end = st.get(
        &mut tx,
        "UPDATE {s}.runs SET status = 'cancelled', error = $3, finished_at_ms = $2, waiting_for = NULL,
             updated_at_ms = $2, lease_owner = NULL, lease_token = NULL, lease_expires_at_ms = NULL
         WHERE run_id = $1",
    )?;
    tx.execute(&end, &[&run_id, &now_ms, &format!("abandoned: {reason}")]).db()?;
    let ended = st.get(&mut tx, RUN_ENDED_SQL)?;
    tx.execute(&ended, &[&run_id, &now_ms]).db()?;
    finish(tx, gate, st, run_id)
}

/// Finished runs, oldest first (parameters: finished_before_ms, limit), by `runs_finished`;
/// rows another transaction holds (an operator retrying one, another purge) are passed over, so
/// purges running in several processes at once never wait for each other or delete a row twice.
pub(crate) const PURGE_SELECT_SQL: &str = "SELECT run_id, workflow, input_hash, status, finished_at_ms FROM {s}.runs
 WHERE finished_at_ms IS NOT NULL AND finished_at_ms < $1
 ORDER BY finished_at_ms, run_id LIMIT $2
 FOR UPDATE SKIP LOCKED";

/// Expired receipts, a bounded batch (parameters: now_ms, limit): found by `run_receipts_expiry`
/// (rows another purge holds are passed over), then deleted by `run_receipts_pkey` (the ids are
/// gathered first: a join of the table with its own batch would read the whole table).
pub(crate) const RECEIPTS_EXPIRED_DELETE_SQL: &str = "DELETE FROM {s}.run_receipts WHERE run_id = ANY(ARRAY(
     SELECT run_id FROM {s}.run_receipts WHERE expires_at_ms <= $1 ORDER BY expires_at_ms LIMIT $2
     FOR UPDATE SKIP LOCKED))";

/// The receipts of the runs a purge batch deletes (those still inside their window).
const RECEIPTS_INSERT_SQL: &str = "INSERT INTO {s}.run_receipts (run_id, workflow, input_hash, status,
     finished_at_ms, expires_at_ms)
 SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bigint[], $6::bigint[])
 ON CONFLICT (run_id) DO UPDATE SET workflow = excluded.workflow, input_hash = excluded.input_hash,
     status = excluded.status, finished_at_ms = excluded.finished_at_ms, expires_at_ms = excluded.expires_at_ms";

/// The receipts of one purge batch, column by column (the arrays of `RECEIPTS_INSERT_SQL`).
#[derive(Default)]
struct Receipts {
    run_ids: Vec<String>,
    workflows: Vec<String>,
    input_hashes: Vec<String>,
    statuses: Vec<String>,
    finished_at_ms: Vec<i64>,
    expires_at_ms: Vec<i64>,
}

pub(super) fn purge(
    apply: &mut ApplyTransaction,
    st: &mut Statements,
    finished_before_ms: i64,
    batch_rows: usize,
    receipt_window_ms: i64,
    now_ms: i64,
) -> Result<PurgeReport> {
    validate_limit("purge batch", batch_rows, PRUNE_BATCH_ROWS_MAX)?;
    let (mut tx, gate) = apply.write_transaction()?;
    let select = st.get(&mut tx, PURGE_SELECT_SQL)?;
    let finished = tx.query(&select, &[&finished_before_ms, &(batch_rows as i64)]).db()?;
    let mut run_ids: Vec<String> = Vec::with_capacity(finished.len());
    let mut receipts = Receipts::default();
    for row in &finished {
        let run_id: String = col(row, 0)?;
        let finished_at_ms: i64 = col(row, 4)?;
        let expires_at_ms = finished_at_ms.saturating_add(receipt_window_ms);
        if expires_at_ms > now_ms {
            receipts.run_ids.push(run_id.clone());
            receipts.workflows.push(col(row, 1)?);
            receipts.input_hashes.push(col(row, 2)?);
            receipts.statuses.push(col(row, 3)?);
            receipts.finished_at_ms.push(finished_at_ms);
            receipts.expires_at_ms.push(expires_at_ms);
        }
        run_ids.push(run_id);
    }
    let mut journal_deleted = 0;
    if !run_ids.is_empty() {
        if !receipts.run_ids.is_empty() {
            let r = &receipts;
            let insert = st.get(&mut tx, RECEIPTS_INSERT_SQL)?;
            let params: [&(dyn postgres::types::ToSql + Sync); 6] =
                [&r.run_ids, &r.workflows, &r.input_hashes, &r.statuses, &r.finished_at_ms, &r.expires_at_ms];
            tx.execute(&insert, &params).db()?;
        }
        for template in [
            "DELETE FROM {s}.journal WHERE run_id = ANY($1)",
            "DELETE FROM {s}.step_attempts WHERE run_id = ANY($1)",
            "DELETE FROM {s}.run_events WHERE run_id = ANY($1)",
            "DELETE FROM {s}.run_published WHERE run_id = ANY($1)",
        ] {
            let delete = st.get(&mut tx, template)?;
            let deleted = tx.execute(&delete, &[&run_ids]).db()?;
            if template.contains(".journal ") {
                journal_deleted = deleted;
            }
        }
        let delete = st.get(&mut tx, "DELETE FROM {s}.runs WHERE run_id = ANY($1)")?;
        let deleted = tx.execute(&delete, &[&run_ids]).db()?;
        ensure_invariant!(deleted as usize == run_ids.len(), "purging {} runs deleted {deleted}", run_ids.len());
    }
    let expire = st.get(&mut tx, RECEIPTS_EXPIRED_DELETE_SQL)?;
    let receipts_deleted = tx.execute(&expire, &[&now_ms, &(batch_rows as i64)]).db()? as usize;
    crash::hit("workflow.purge.before_commit");
    gate.commit(tx)?;
    Ok(PurgeReport {
        runs_deleted: run_ids.len() as u64,
        journal_deleted,
        more: run_ids.len() == batch_rows || receipts_deleted == batch_rows,
    })
}
