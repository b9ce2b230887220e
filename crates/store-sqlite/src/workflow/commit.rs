//! Group commit of journal writes: one transaction for many writes of many runs, each fenced by
//! its run's lease token; transactional step bodies run in a savepoint each.

use rusqlite::{params, CachedStatement, Connection, TransactionBehavior};
use serde_json::Value;
use tidemark_core::crash;
use tidemark_core::error::codes;
use tidemark_core::workflow::{
    child_event, json_within, message_event_id, validate_write, ClaimedRun, JournalOp, JournalWrite, RunRecord,
    RunStatus, StartOutcome, StepFailure, StepKind, StepStatus, WriteResult, COMMIT_BATCH_MAX, STEP_OUTPUT_BYTES_MAX,
};
use tidemark_core::{ensure_invariant, Error, Result};

use super::clip_error;
use super::rows::{self, json_text};
use crate::SqlResult;

/// Whether an event the run would wait for is there unconsumed: the event named, or the end of
/// any child (a parent may await several at once). Through `run_events_unconsumed`.
pub(super) const EVENT_WAITING_SQL: &str = "SELECT count(*) FROM run_events
     WHERE run_id = ?1 AND consumed_by_seq IS NULL AND (name = ?2 OR name LIKE 'child/%')";

/// The statements of a commit. Each is taken from the connection's statement cache once per
/// batch and kept until the batch ends: `prepare_cached` trims, copies and hashes the SQL text
/// twice on every call, which costs about as much as some of these statements themselves.
#[derive(Clone, Copy)]
enum Sql {
    Fence,
    CancelRequested,
    SetStatus,
    Finish,
    Release,
    Position,
    NewEntry,
    Entry,
    FirstAttempt,
    Attempt,
    TimerStarted,
    TimerFinished,
    ChildEnded,
    ConsumeEvent,
    EventWaiting,
    Suspend,
    ChildOf,
    Continuation,
    NotifyParent,
    SettleParent,
    WakeParent,
    CancelChildren,
    Savepoint,
    RollbackToSavepoint,
    ReleaseSavepoint,
}

const SQL_COUNT: usize = Sql::ReleaseSavepoint as usize + 1;

impl Sql {
    fn text(self) -> &'static str {
        match self {
            Sql::Fence => "UPDATE runs SET updated_at_ms = ?3 WHERE run_id = ?1 AND lease_token = ?2",
            Sql::CancelRequested => "SELECT cancel_requested FROM runs WHERE run_id = ?1",
            Sql::SetStatus => {
                "UPDATE runs SET status = ?3, waiting_for = NULL, updated_at_ms = ?4
                 WHERE run_id = ?1 AND lease_token = ?2"
            }
            Sql::Finish => {
                "UPDATE runs SET status = ?3, result = ?4, error = ?5, finished_at_ms = ?6, updated_at_ms = ?6,
                     waiting_for = NULL, lease_owner = NULL, lease_token = NULL, lease_expires_at_ms = NULL
                 WHERE run_id = ?1 AND lease_token = ?2"
            }
            Sql::Release => {
                "UPDATE runs SET lease_owner = NULL, lease_token = NULL, lease_expires_at_ms = NULL, updated_at_ms = ?3
                 WHERE run_id = ?1 AND lease_token = ?2"
            }
            Sql::Position => {
                "SELECT j.name, j.kind, j.status, j.attempts,
                        (SELECT coalesce(max(seq) + 1, 0) FROM journal WHERE run_id = ?1)
                 FROM (SELECT 1) LEFT JOIN journal j ON j.run_id = ?1 AND j.seq = ?2"
            }
            Sql::NewEntry => {
                "INSERT INTO journal (run_id, seq, name, kind, status, output, error, attempts, next_attempt_at_ms, updated_at_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)"
            }
            Sql::Entry => {
                "INSERT INTO journal (run_id, seq, name, kind, status, output, error, attempts, next_attempt_at_ms, updated_at_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)
                 ON CONFLICT (run_id, seq) DO UPDATE SET status = excluded.status, output = excluded.output,
                     error = excluded.error, attempts = excluded.attempts, next_attempt_at_ms = excluded.next_attempt_at_ms,
                     updated_at_ms = excluded.updated_at_ms"
            }
            // The attempt history counts over the run's whole life (an operator retry resets only
            // the entry's budget), so its ordinal is the next one at this position. (A scalar
            // subquery in VALUES, not INSERT ... SELECT from the same table, which would go
            // through a temporary table on every call.)
            // At a new position: no attempt is recorded there yet (attempts go with their journal
            // entry: a fork copies both, a purge deletes both).
            Sql::FirstAttempt => {
                "INSERT INTO step_attempts (run_id, seq, attempt, ok, error, finished_at_ms) VALUES (?1, ?2, 1, ?3, ?4, ?5)"
            }
            Sql::Attempt => {
                "INSERT INTO step_attempts (run_id, seq, attempt, ok, error, finished_at_ms)
                 VALUES (?1, ?2, (SELECT coalesce(max(attempt), 0) + 1 FROM step_attempts WHERE run_id = ?1 AND seq = ?2),
                         ?3, ?4, ?5)"
            }
            Sql::TimerStarted => {
                "INSERT INTO journal (run_id, seq, name, kind, status, attempts, wake_at_ms, event_name, updated_at_ms)
                 VALUES (?1, ?2, ?3, ?4, 'waiting', 0, ?5, ?6, ?7)
                 ON CONFLICT (run_id, seq) DO UPDATE SET wake_at_ms = excluded.wake_at_ms,
                     event_name = excluded.event_name, updated_at_ms = excluded.updated_at_ms"
            }
            Sql::TimerFinished => {
                "UPDATE journal SET status = 'completed', output = ?3, updated_at_ms = ?4 WHERE run_id = ?1 AND seq = ?2"
            }
            Sql::ChildEnded => {
                "UPDATE journal SET status = 'completed', output = ?3, updated_at_ms = ?4
                 WHERE run_id = ?1 AND seq = ?2 AND status = 'waiting' AND kind = 'child'"
            }
            Sql::ConsumeEvent => "UPDATE run_events SET consumed_by_seq = ?3 WHERE run_id = ?1 AND event_id = ?2",
            Sql::EventWaiting => EVENT_WAITING_SQL,
            Sql::Suspend => {
                "UPDATE runs SET status = ?2, wake_at_ms = ?3, waiting_for = ?4,
                     lease_owner = NULL, lease_token = NULL, lease_expires_at_ms = NULL
                 WHERE run_id = ?1"
            }
            Sql::ChildOf => {
                "UPDATE runs SET parent_run_id = ?2, parent_seq = ?3 WHERE run_id = ?1 AND parent_run_id IS NULL"
            }
            // A continuation takes over its predecessor's parent (its end is the one the parent
            // learns of). Parameters: the continuation's run id, the predecessor's.
            Sql::Continuation => {
                "UPDATE runs SET (parent_run_id, parent_seq) = (SELECT parent_run_id, parent_seq FROM runs WHERE run_id = ?2)
                 WHERE run_id = ?1"
            }
            Sql::NotifyParent => NOTIFY_PARENT_SQL,
            // A child's end settles the entry of its parent waiting in memory, while the parent
            // holds the lease it waits with (`JournalOp::FinishChild`). Parameters: the child's
            // run id (finished just before, in the same transaction), the parent's token, now.
            Sql::SettleParent => {
                "UPDATE journal SET status = 'completed', updated_at_ms = ?3,
                     output = (SELECT json_object('run_id', c.run_id, 'status', c.status, 'result', json(c.result),
                                                  'error', c.error)
                               FROM runs c WHERE c.run_id = ?1)
                 WHERE (run_id, seq) = (SELECT c.parent_run_id, c.parent_seq FROM runs c
                                        JOIN runs p ON p.run_id = c.parent_run_id AND p.lease_token = ?2
                                        WHERE c.run_id = ?1)
                   AND status = 'waiting' AND kind = 'child'"
            }
            Sql::WakeParent => WAKE_PARENT_SQL,
            Sql::CancelChildren => CANCEL_CHILDREN_SQL,
            Sql::Savepoint => "SAVEPOINT wf_tx_step",
            Sql::RollbackToSavepoint => "ROLLBACK TO wf_tx_step",
            Sql::ReleaseSavepoint => "RELEASE wf_tx_step",
        }
    }
}

/// A child that ended (not parked: that waits for an operator; not continued: its continuation
/// tells the parent when the chain ends) tells its parent how, as the event
/// `child/<seq>` (`child_event`): `{"run_id", "status", "result", "error"}`. Only while the parent
/// is active (a purged or finished parent takes no more events); at most once (an operator retry
/// of a child that already told its parent tells it nothing new). Parameters: the child's run id,
/// now.
pub(super) const NOTIFY_PARENT_SQL: &str = "INSERT INTO run_events (run_id, event_id, name, payload, received_at_ms, consumed_by_seq)
     SELECT c.parent_run_id, 'child/' || c.parent_seq, 'child/' || c.parent_seq,
            json_object('run_id', c.run_id, 'status', c.status, 'result', json(c.result), 'error', c.error), ?2, NULL
     FROM runs c JOIN runs p ON p.run_id = c.parent_run_id
     WHERE c.run_id = ?1 AND c.finished_at_ms IS NOT NULL AND c.status <> 'parked' AND c.status <> 'continued'
       AND (p.status = 'pending' OR p.status = 'running' OR p.status = 'sleeping' OR p.status = 'waiting' OR p.status = 'compensating')
     ON CONFLICT (run_id, event_id) DO NOTHING";

/// The parent of a child that ended is due now, if it waits (for this child or another: a
/// parent that awaits several looks again). Parameters: the child's run id, now.
pub(super) const WAKE_PARENT_SQL: &str = "UPDATE runs SET wake_at_ms = min(wake_at_ms, ?2), updated_at_ms = ?2
     WHERE run_id = (SELECT parent_run_id FROM runs WHERE run_id = ?1 AND status <> 'parked' AND status <> 'continued')
       AND status = 'waiting'";

/// The cancel cascade: a run that ended (not parked) has cancellation requested for each of its
/// children still active; each stops at its next step boundary (compensating as its workflow
/// does), and its own end cascades to its children. Parameters: the parent's run id, now.
pub(super) const CANCEL_CHILDREN_SQL: &str = "UPDATE runs SET cancel_requested = 1,
         error = 'cancel requested: its parent run ended', wake_at_ms = min(wake_at_ms, ?2), updated_at_ms = ?2
     WHERE parent_run_id = ?1 AND cancel_requested = 0
       AND (status = 'pending' OR status = 'running' OR status = 'sleeping' OR status = 'waiting' OR status = 'compensating')
       AND (SELECT status FROM runs WHERE run_id = ?1) <> 'parked'";

/// What a run's end does to its family, in the transaction that ended it: its parent learns of
/// it, and its children still running are cancelled. For the operator changes that end a run
/// (the commit path uses the same statements through its cache).
pub(super) fn run_ended(tx: &Connection, run_id: &str, now_ms: i64) -> Result<()> {
    for text in [NOTIFY_PARENT_SQL, WAKE_PARENT_SQL, CANCEL_CHILDREN_SQL] {
        tx.prepare_cached(text).db()?.execute(params![run_id, now_ms]).db()?;
    }
    Ok(())
}

/// The prepared statements of one commit, taken from the cache at first use.
struct Statements<'c> {
    conn: &'c Connection,
    prepared: [Option<CachedStatement<'c>>; SQL_COUNT],
}

impl<'c> Statements<'c> {
    fn new(conn: &'c Connection) -> Self {
        Statements { conn, prepared: std::array::from_fn(|_| None) }
    }

    fn get(&mut self, sql: Sql) -> Result<&mut CachedStatement<'c>> {
        let slot = &mut self.prepared[sql as usize];
        if slot.is_none() {
            *slot = Some(self.conn.prepare_cached(sql.text()).db()?);
        }
        Ok(slot.as_mut().expect("prepared above"))
    }
}

pub(super) fn commit(
    conn: &mut Connection,
    writes: Vec<JournalWrite<Connection>>,
    now_ms: i64,
) -> Result<Vec<WriteResult>> {
    if writes.len() > COMMIT_BATCH_MAX {
        return Err(Error::invalid(codes::LIMIT_EXCEEDED, format!("at most {COMMIT_BATCH_MAX} writes per commit")));
    }
    let mut previous: Option<(&str, &str)> = None;
    let texts = writes
        .iter()
        .map(|write| {
            let ids = (write.run_id.as_str(), write.lease_token.as_str());
            validate_write(write, previous.replace(ids) == Some(ids), now_ms)
        })
        .collect::<Result<Vec<_>>>()?;
    if writes.is_empty() {
        return Ok(Vec::new());
    }
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
    let mut results = Vec::with_capacity(writes.len());
    {
        let mut sql = Statements::new(&tx);
        let mut lease_seen = None;
        for (write, text) in writes.into_iter().zip(texts) {
            results.push(apply(&tx, &mut sql, write, text, now_ms, &mut lease_seen)?);
        }
    }
    crash::hit("workflow.commit.before_commit");
    tx.commit().db()?;
    crash::hit("workflow.commit.after_commit");
    Ok(results)
}

/// Is `token` the run's lease token? Touches the run's `updated_at_ms` when it is; false:
/// fenced, nothing changed. A run holding a lease is always active (a CHECK of the table says
/// so), and nothing else of the row is needed here: one UPDATE, no read. (Not UPDATE ...
/// RETURNING: SQLite buffers returned rows in a temporary B-tree.)
fn fence(sql: &mut Statements<'_>, run_id: &str, token: &str, now_ms: i64) -> Result<bool> {
    Ok(sql.get(Sql::Fence)?.execute(params![run_id, token, now_ms]).db()? == 1)
}

/// What the previous writes of a batch found out about their run, when nothing in the
/// transaction can have changed it since (no transactional step's body ran): the next write of
/// the same run and token needs no fence of its own (`updated_at_ms` was already touched with the
/// batch's `now_ms`), and a new journal position right after the last one written needs no look-up.
struct LeaseSeen {
    run_id: String,
    token: String,
    /// Not read yet in this batch: only a suspension needs it.
    cancel_requested: Option<bool>,
    /// The run's next free journal position, when a write of this batch established it.
    next_seq: Option<u32>,
}

fn apply(
    tx: &Connection,
    sql: &mut Statements<'_>,
    write: JournalWrite<Connection>,
    text: Option<String>,
    now_ms: i64,
    last: &mut Option<LeaseSeen>,
) -> Result<WriteResult> {
    let JournalWrite { run_id: run, lease_token, op } = write;
    let known = last.take().filter(|f| f.run_id == run && f.token == lease_token);
    if matches!(
        op,
        JournalOp::SetStatus { .. } | JournalOp::Finish { .. } | JournalOp::FinishChild { .. } | JournalOp::Release
    ) {
        let (result, after) = apply_to_run(sql, &run, &lease_token, op, text, now_ms)?;
        // A status change leaves the journal as it is: what was known of it still holds.
        *last = after.then(|| LeaseSeen {
            run_id: run,
            token: lease_token,
            cancel_requested: known.as_ref().and_then(|k| k.cancel_requested),
            next_seq: known.and_then(|k| k.next_seq),
        });
        return Ok(result);
    }
    let (cancel_requested, next_seq) = match known {
        Some(known) => (known.cancel_requested, known.next_seq),
        None if fence(sql, &run, &lease_token, now_ms)? => (None, None),
        None => return Ok(WriteResult::Fenced),
    };
    let run_id = run.as_str();
    // After these writes the lease stays as it is and the run's next position is known (a
    // transactional step's body could change anything, so the write after it looks again).
    let mut seen = None;
    let result = match op {
        JournalOp::StepAttempt { seq, name, kind, attempt, result, retry_at_ms } => {
            let (existing, next) = position(sql, run_id, seq, &name, kind, StepStatus::Retrying, next_seq)?;
            check_attempt(run_id, seq, attempt, existing)?;
            let recorded = match &result {
                Ok(_) => Ok(text.as_deref().unwrap_or("null")),
                Err(failure) => Err(failure),
            };
            let step = Step { run_id, seq, name: &name, kind, attempt, new: existing.is_none() };
            record_attempt(sql, &step, recorded, retry_at_ms, now_ms)?;
            seen = Some(Some(next));
            WriteResult::Done
        }
        JournalOp::TxStep { seq, name, kind, attempt, body, retry_at_ms } => {
            let (existing, _) = position(sql, run_id, seq, &name, kind, StepStatus::Retrying, next_seq)?;
            check_attempt(run_id, seq, attempt, existing)?;
            sql.get(Sql::Savepoint)?.execute([]).db()?;
            let outcome = body(tx);
            if tx.is_autocommit() {
                // The body committed or rolled back (or SQLite rolled back after an I/O error):
                // nothing of this batch can be trusted to commit together any more.
                return Err(Error::store(format!(
                    "the journal's transaction ended inside the body of step {name} of run {run_id}"
                )));
            }
            let outcome = match outcome {
                Ok(output) => match json_within("step output", &output, STEP_OUTPUT_BYTES_MAX) {
                    Ok(text) => Ok((output, text)),
                    Err(e) => Err(StepFailure::permanent(e.to_string())),
                },
                Err(failure) => Err(failure),
            };
            if outcome.is_err() {
                sql.get(Sql::RollbackToSavepoint)?.execute([]).db()?;
            }
            sql.get(Sql::ReleaseSavepoint)?.execute([]).db()?;
            let recorded = outcome.as_ref().map(|(_, text)| text.as_str());
            let step = Step { run_id, seq, name: &name, kind, attempt, new: existing.is_none() };
            record_attempt(sql, &step, recorded, retry_at_ms, now_ms)?;
            WriteResult::TxResult(outcome.map(|(output, _)| output))
        }
        JournalOp::StartChild { seq, name, request, wake_at_ms, claim } => {
            let (existing, next) = position(sql, run_id, seq, &name, StepKind::Child, StepStatus::Waiting, next_seq)?;
            ensure_invariant!(existing.is_none(), "run {run_id} step {seq}: its child was started already");
            // A child this write creates has its parent, and its lease when asked, in its row.
            let token = claim.as_ref().map(|_| super::new_token());
            let lease =
                claim.as_ref().zip(token.as_deref()).map(|(c, t)| (c.worker_id.as_str(), t, now_ms + c.lease_ms));
            let row = super::ChildRow { parent_run_id: run_id, parent_seq: seq, lease };
            let outcome = super::start_rows_in(tx, std::slice::from_ref(&*request), now_ms, Some(&row))?;
            let mut created = false;
            let conflict = match outcome.into_iter().next() {
                Some(StartOutcome::Started { .. }) => {
                    created = true;
                    None
                }
                Some(StartOutcome::Existing { .. }) => {
                    // A run of that id (same workflow and input) was there already: adopted; if it
                    // has ended, the parent learns of it now (the event keeps the parent due).
                    sql.get(Sql::ChildOf)?.execute(params![request.run_id, run_id, seq]).db()?;
                    sql.get(Sql::NotifyParent)?.execute(params![request.run_id, now_ms]).db()?;
                    None
                }
                Some(StartOutcome::Conflict { reason, .. }) => Some(reason),
                None => return Err(Error::Invariant("a start answered nothing".into())),
            };
            let result = match conflict {
                None => {
                    sql.get(Sql::TimerStarted)?
                        .execute(params![
                            run_id,
                            seq,
                            name,
                            StepKind::Child.as_str(),
                            wake_at_ms,
                            child_event(seq),
                            now_ms
                        ])
                        .db()?;
                    Ok(Value::Null)
                }
                Some(reason) => {
                    let failure = StepFailure::permanent(format!("the child run id is taken: {reason}"));
                    let step = Step { run_id, seq, name: &name, kind: StepKind::Child, attempt: 1, new: true };
                    record_attempt(sql, &step, Err(&failure), None, now_ms)?;
                    Err(failure)
                }
            };
            seen = Some(Some(next));
            match lease.filter(|_| created).map(|(owner, _, expires)| (owner.to_string(), expires)) {
                Some((owner, expires)) => {
                    let run = RunRecord::started_child(&request, run_id, &owner, expires, now_ms);
                    let lease_token = token.expect("a lease has its token");
                    let claimed =
                        ClaimedRun { run, lease_token, journal: Vec::new(), events: Vec::new(), recovered: false };
                    WriteResult::Claimed(Box::new(claimed))
                }
                _ => WriteResult::TxResult(result),
            }
        }
        JournalOp::ChildEnded { seq, end } => {
            let event_id = child_event(seq);
            let event = rows::event(tx, run_id, &event_id)?;
            let held = event.is_some_and(|e| e.consumed_by_seq.is_none() && e.payload == end);
            // The entry is settled only while it is the child step waiting (one statement).
            let text = text.unwrap_or_else(|| json_text(&end));
            let settled = held && sql.get(Sql::ChildEnded)?.execute(params![run_id, seq, text, now_ms]).db()? == 1;
            if !settled {
                // The parent went on with an end the store does not hold: it replays instead.
                sql.get(Sql::Release)?.execute(params![run_id, lease_token, now_ms]).db()?;
                return Ok(WriteResult::Fenced);
            }
            sql.get(Sql::ConsumeEvent)?.execute(params![run_id, event_id, seq]).db()?;
            seen = Some(next_seq);
            WriteResult::Done
        }
        JournalOp::Publish { seq, key, value: _ } => {
            let (existing, next) = position(sql, run_id, seq, &key, StepKind::Publish, StepStatus::Waiting, next_seq)?;
            ensure_invariant!(existing.is_none(), "run {run_id} step {seq}: published already");
            let text = text.unwrap_or_else(|| "null".into());
            tx.prepare_cached(
                "INSERT INTO run_published (run_id, key, value, seq, updated_at_ms) VALUES (?1, ?2, ?3, ?4, ?5)
                 ON CONFLICT (run_id, key) DO UPDATE SET value = excluded.value, seq = excluded.seq,
                     updated_at_ms = excluded.updated_at_ms",
            )
            .db()?
            .execute(params![run_id, key, text, seq, now_ms])
            .db()?;
            let step = Step { run_id, seq, name: &key, kind: StepKind::Publish, attempt: 1, new: true };
            record_attempt(sql, &step, Ok("null"), None, now_ms)?;
            seen = Some(Some(next));
            WriteResult::Done
        }
        JournalOp::Send { seq, to, topic, payload } => {
            let (existing, next) = position(sql, run_id, seq, &topic, StepKind::Send, StepStatus::Waiting, next_seq)?;
            ensure_invariant!(existing.is_none(), "run {run_id} step {seq}: sent already");
            let event_id = message_event_id(run_id, seq);
            let delivered = match super::send_event_checked(tx, &to, &event_id, &topic, &payload, now_ms) {
                Ok(_) => Ok(serde_json::json!({"to": to, "event_id": event_id})),
                // A receiver holding its most events waits for its waits to consume some: the
                // send is not journaled, and the sender tries again after a delay.
                Err(Error::Invalid { code: codes::RUN_EVENTS_FULL, message }) => {
                    return Ok(WriteResult::TxResult(Err(StepFailure::retryable(format!(
                        "cannot send to run {to:?} yet: {message}"
                    )))));
                }
                Err(Error::Invalid { message, .. }) => {
                    Err(StepFailure::permanent(format!("cannot send to run {to:?}: {message}")))
                }
                Err(other) => return Err(other),
            };
            let output = delivered.as_ref().map(rows::json_text);
            let step = Step { run_id, seq, name: &topic, kind: StepKind::Send, attempt: 1, new: true };
            let recorded = match &output {
                Ok(text) => Ok(text.as_str()),
                Err(failure) => Err(*failure),
            };
            record_attempt(sql, &step, recorded, None, now_ms)?;
            seen = Some(Some(next));
            WriteResult::TxResult(delivered)
        }
        JournalOp::ContinueAsNew { request } => {
            let outcome = super::start_in(tx, std::slice::from_ref(&*request), now_ms)?;
            match outcome.into_iter().next() {
                Some(StartOutcome::Started { .. }) => {
                    sql.get(Sql::Continuation)?.execute(params![request.run_id, run_id]).db()?;
                    let result = serde_json::json!({"continued_as": request.run_id});
                    let finished = sql
                        .get(Sql::Finish)?
                        .execute(params![
                            run_id,
                            lease_token,
                            RunStatus::Continued.as_str(),
                            json_text(&result),
                            None::<String>,
                            now_ms
                        ])
                        .db()?;
                    ensure_invariant!(finished == 1, "run {run_id}: fenced above, yet its finish changed nothing");
                    // Its children still running are cancelled, as at any end.
                    sql.get(Sql::CancelChildren)?.execute(params![run_id, now_ms]).db()?;
                    WriteResult::TxResult(Ok(result))
                }
                Some(StartOutcome::Existing { .. } | StartOutcome::Conflict { .. }) => WriteResult::TxResult(Err(
                    StepFailure::permanent(format!("the continuation's run id {:?} is taken", request.run_id)),
                )),
                None => return Err(Error::Invariant("a start answered nothing".into())),
            }
        }
        JournalOp::TimerStarted { seq, name, kind, wake_at_ms, event_name } => {
            let (_, next) = position(sql, run_id, seq, &name, kind, StepStatus::Waiting, next_seq)?;
            sql.get(Sql::TimerStarted)?
                .execute(params![run_id, seq, name, kind.as_str(), wake_at_ms, event_name, now_ms])
                .db()?;
            seen = Some(Some(next));
            WriteResult::Done
        }
        JournalOp::TimerFinished { seq, event_id, output } => {
            let entry = rows::journal_at(tx, run_id, seq)?;
            let Some(entry) = entry else {
                return Err(Error::Invariant(format!("run {run_id}: no timer at step {seq} to finish")));
            };
            ensure_invariant!(
                entry.status == StepStatus::Waiting,
                "run {run_id} step {seq} ({}) is {}, not a pending timer",
                entry.name,
                entry.status.as_str()
            );
            if let Some(event_id) = &event_id {
                ensure_invariant!(
                    matches!(entry.kind, StepKind::Wait | StepKind::Child),
                    "run {run_id} step {seq} is a sleep, not a wait"
                );
                let event = rows::event(tx, run_id, event_id)?;
                let Some(event) = event else {
                    return Err(Error::Invariant(format!("run {run_id} has no event {event_id}")));
                };
                ensure_invariant!(
                    event.consumed_by_seq.is_none(),
                    "run {run_id} event {event_id} was already consumed by step {:?}",
                    event.consumed_by_seq
                );
                ensure_invariant!(
                    Some(&event.name) == entry.event_name.as_ref(),
                    "run {run_id} event {event_id} is {:?}; step {seq} waits for {:?}",
                    event.name,
                    entry.event_name
                );
                sql.get(Sql::ConsumeEvent)?.execute(params![run_id, event_id, seq]).db()?;
            }
            sql.get(Sql::TimerFinished)?
                .execute(params![run_id, seq, text.unwrap_or_else(|| json_text(&output)), now_ms])
                .db()?;
            seen = Some(next_seq);
            WriteResult::Done
        }
        JournalOp::Suspend { status, wake_at_ms, waiting_for } => {
            // No lost wake-up: an event that arrived while the run was running, or a cancel
            // request, keeps it due now.
            let event_waiting = match &waiting_for {
                Some(name) => sql.get(Sql::EventWaiting)?.query_row([run_id, name], |r| r.get::<_, i64>(0)).db()? > 0,
                None => false,
            };
            let cancel_requested = match cancel_requested {
                Some(cancel_requested) => cancel_requested,
                None => sql.get(Sql::CancelRequested)?.query_row([run_id], |r| r.get(0)).db()?,
            };
            let wake_at_ms = if event_waiting || cancel_requested { wake_at_ms.min(now_ms) } else { wake_at_ms };
            sql.get(Sql::Suspend)?
                .execute(params![run_id, status.run_status().as_str(), wake_at_ms, waiting_for])
                .db()?;
            WriteResult::Done
        }
        JournalOp::SetStatus { .. } | JournalOp::Finish { .. } | JournalOp::FinishChild { .. } | JournalOp::Release => {
            unreachable!("applied by apply_to_run")
        }
    };
    if let Some(next_seq) = seen {
        *last = Some(LeaseSeen { run_id: run, token: lease_token, cancel_requested, next_seq });
    }
    Ok(result)
}

/// A write that changes only the run's row: one UPDATE, fenced by its own `WHERE` (no row
/// changed: fenced). A run holding a lease is always active (a CHECK of the table says so).
/// True when the lease is still held after the write (a status change).
fn apply_to_run(
    sql: &mut Statements<'_>,
    run_id: &str,
    token: &str,
    op: JournalOp<Connection>,
    text: Option<String>,
    now_ms: i64,
) -> Result<(WriteResult, bool)> {
    let changed = match op {
        JournalOp::SetStatus { status } => {
            let changed = sql.get(Sql::SetStatus)?.execute(params![run_id, token, status.as_str(), now_ms]).db()?;
            if changed == 0 {
                return Ok((WriteResult::Fenced, false));
            }
            return Ok((WriteResult::Done, true));
        }
        JournalOp::Finish { status, result: _, error } => {
            let changed = sql
                .get(Sql::Finish)?
                .execute(params![
                    run_id,
                    token,
                    status.run_status().as_str(),
                    text,
                    error.as_deref().map(clip_error),
                    now_ms
                ])
                .db()?;
            if changed == 1 {
                // The run's family learns of its end in the same transaction.
                for family in [Sql::NotifyParent, Sql::WakeParent, Sql::CancelChildren] {
                    sql.get(family)?.execute(params![run_id, now_ms]).db()?;
                }
            }
            changed
        }
        JournalOp::FinishChild { status, result: _, error, parent_lease_token } => {
            let changed = sql
                .get(Sql::Finish)?
                .execute(params![
                    run_id,
                    token,
                    status.run_status().as_str(),
                    text,
                    error.as_deref().map(clip_error),
                    now_ms
                ])
                .db()?;
            if changed == 0 {
                return Ok((WriteResult::Fenced, false));
            }
            // The parent waiting in memory has its entry settled, or (its lease gone) learns of
            // the end by the event as after any finish.
            let settled = sql.get(Sql::SettleParent)?.execute(params![run_id, parent_lease_token, now_ms]).db()? == 1;
            let family: &[Sql] = if settled {
                &[Sql::CancelChildren]
            } else {
                &[Sql::NotifyParent, Sql::WakeParent, Sql::CancelChildren]
            };
            for family in family {
                sql.get(*family)?.execute(params![run_id, now_ms]).db()?;
            }
            return Ok((if settled { WriteResult::ParentSettled } else { WriteResult::Done }, false));
        }
        JournalOp::Release => sql.get(Sql::Release)?.execute(params![run_id, token, now_ms]).db()?,
        _ => return Err(Error::Invariant("apply_to_run takes only run-row writes".into())),
    };
    Ok((if changed == 0 { WriteResult::Fenced } else { WriteResult::Done }, false))
}

/// A write at `seq` either opens the next position or continues the unsettled entry there
/// (which must be the same step, in `unsettled` status). A settled entry is never rewritten.
/// Returns the attempts recorded at the position (`None`: a new position) and the run's next
/// free position after the write. One statement (the entry at `seq`, if any, and the run's next
/// free position), or none when `known_next` (established by this batch) is `seq`.
fn position(
    sql: &mut Statements<'_>,
    run_id: &str,
    seq: u32,
    name: &str,
    kind: StepKind,
    unsettled: StepStatus,
    known_next: Option<u32>,
) -> Result<(Option<u32>, u32)> {
    if known_next == Some(seq) {
        return Ok((None, seq + 1));
    }
    type Found = (Option<String>, Option<String>, Option<String>, Option<u32>, i64);
    let (found_name, found_kind, found_status, attempts, next): Found = sql
        .get(Sql::Position)?
        .query_row(params![run_id, seq], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)))
        .db()?;
    let (Some(found_name), Some(found_kind), Some(found_status), Some(attempts)) =
        (found_name, found_kind, found_status, attempts)
    else {
        ensure_invariant!(i64::from(seq) == next, "run {run_id}: a new step at {seq}, but the next position is {next}");
        return Ok((None, seq + 1));
    };
    let status = StepStatus::parse(&found_status)
        .ok_or_else(|| Error::Invariant(format!("run {run_id} step {seq}: unknown step status {found_status:?}")))?;
    ensure_invariant!(
        !status.is_settled(),
        "run {run_id} step {seq} ({found_name}) is {}: a settled entry is never rewritten",
        status.as_str()
    );
    ensure_invariant!(
        found_name == name && found_kind == kind.as_str(),
        "run {run_id} step {seq} is {found_name} ({found_kind}), not {name} ({})",
        kind.as_str()
    );
    ensure_invariant!(
        status == unsettled,
        "run {run_id} step {seq} ({name}) is {}, expected {}",
        status.as_str(),
        unsettled.as_str()
    );
    let next = u32::try_from(next).map_err(|_| Error::Invariant(format!("run {run_id}: next position {next}")))?;
    Ok((Some(attempts), next))
}

/// Attempts count from 1 and follow the entry's recorded attempts one by one.
fn check_attempt(run_id: &str, seq: u32, attempt: u32, recorded: Option<u32>) -> Result<()> {
    let expected = recorded.unwrap_or(0) + 1;
    ensure_invariant!(attempt == expected, "run {run_id} step {seq}: attempt {attempt}, expected attempt {expected}");
    Ok(())
}

/// The step an attempt is recorded for.
struct Step<'a> {
    run_id: &'a str,
    seq: u32,
    name: &'a str,
    kind: StepKind,
    attempt: u32,
    /// A new journal position (nothing recorded at `seq` yet).
    new: bool,
}

fn record_attempt(
    sql: &mut Statements<'_>,
    step: &Step<'_>,
    outcome: std::result::Result<&str, &StepFailure>,
    retry_at_ms: Option<i64>,
    now_ms: i64,
) -> Result<()> {
    let ok = outcome.is_ok();
    let (status, output, error, next_attempt_at_ms) = match outcome {
        Ok(text) => (StepStatus::Completed, Some(text), None, None),
        Err(failure) if failure.retryable && retry_at_ms.is_some() => {
            (StepStatus::Retrying, None, Some(clip_error(&failure.message)), retry_at_ms)
        }
        Err(failure) => (StepStatus::Failed, None, Some(clip_error(&failure.message)), None),
    };
    let Step { run_id, seq, name, kind, attempt, new } = *step;
    sql.get(if new { Sql::NewEntry } else { Sql::Entry })?
        .execute(params![
            run_id,
            seq,
            name,
            kind.as_str(),
            status.as_str(),
            output,
            error,
            attempt,
            next_attempt_at_ms,
            now_ms
        ])
        .db()?;
    sql.get(if new { Sql::FirstAttempt } else { Sql::Attempt })?
        .execute(params![run_id, seq, ok, error, now_ms])
        .db()?;
    Ok(())
}
