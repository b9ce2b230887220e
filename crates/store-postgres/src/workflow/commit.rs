//! Group commit of journal writes: one transaction for many writes of many runs, each fenced by
//! its run's lease token alone; transactional step bodies run in a savepoint each (the behaviour
//! of `tidemark_store_sqlite`'s `workflow/commit.rs`, with the fences decided on rows this
//! transaction locked first).

use std::collections::{BTreeSet, HashMap};

use postgres::error::SqlState;
use postgres::Client;
use serde_json::Value;
use tidemark_core::crash;
use tidemark_core::error::codes;
use tidemark_core::workflow::{
    child_event, json_within, message_event_id, validate_write, ClaimedRun, JournalOp, JournalWrite, RunRecord,
    RunStatus, StartOutcome, StartRequest, StepFailure, StepKind, StepStatus, WriteResult, COMMIT_BATCH_MAX,
    STEP_OUTPUT_BYTES_MAX,
};
use tidemark_core::{ensure_invariant, Error, Result};

use super::rows::{self, json_text};
use super::{clip_error, seq_param};
use crate::apply::{ApplyTransaction, OpenTransaction};
use crate::schema::Statements;
use crate::{col, PgResult};

type Write = JournalWrite<ApplyTransaction>;

/// Lock, before anything is written, every run of the batch and every run it sends a message to
/// (`$1`), and for the runs it may
/// finish (`$2`) their parent and their active children (whom the end notifies, wakes or
/// cancels), in run id order: two commits, a commit and a heartbeat, or a commit and an
/// operator's `abandon` never wait for each other in a cycle. The lease token read here is the
/// run's as of this transaction: nobody else can change it until the transaction ends.
/// (The family's ids are gathered first, by `runs_pkey` and `runs_children`, so that the rows to
/// lock are one primary-key probe each.) Each row comes with its run's next free journal
/// position (one backward probe of the journal's primary key), so that a write at a new
/// position needs no read of its own.
pub(crate) const LOCK_BATCH_SQL: &str = "SELECT run_id, lease_token,
        (SELECT coalesce(max(j.seq) + 1, 0) FROM {s}.journal j WHERE j.run_id = r.run_id), parent_run_id
 FROM {s}.runs r
 WHERE run_id = ANY($1::text[]
     || ARRAY(SELECT parent_run_id FROM {s}.runs WHERE run_id = ANY($2) AND parent_run_id IS NOT NULL)
     || ARRAY(SELECT run_id FROM {s}.runs WHERE parent_run_id = ANY($2)
                AND status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating')))
 ORDER BY run_id
 FOR UPDATE";

const RELEASE_SQL: &str = "UPDATE {s}.runs SET lease_owner = NULL, lease_token = NULL, lease_expires_at_ms = NULL,
     updated_at_ms = $3
 WHERE run_id = $1 AND lease_token = $2";
/// Touch the runs the batch wrote for (a write whose token matched sets `updated_at_ms`, as
/// SQLite's fence does) and write the status changes the batch made (`$3`, null for none: the
/// status, with `waiting_for` cleared), in one statement at the end, one row each: `$1` the run
/// ids, `$2` now.
const TOUCH_SQL: &str = "UPDATE {s}.runs r SET updated_at_ms = $2, status = coalesce(u.status, r.status),
     waiting_for = CASE WHEN u.status IS NULL THEN r.waiting_for END
 FROM unnest($1::text[], $3::text[]) AS u(run_id, status)
 WHERE r.run_id = u.run_id AND (r.updated_at_ms <> $2 OR u.status IS NOT NULL)";
/// The entry at `$2` (if any) and the run's next free position, in one statement.
const POSITION_SQL: &str = "SELECT j.name, j.kind, j.status, j.attempts,
        (SELECT coalesce(max(seq) + 1, 0) FROM {s}.journal WHERE run_id = $1)
 FROM (SELECT 1) AS one LEFT JOIN {s}.journal j ON j.run_id = $1 AND j.seq = $2";
/// The first attempts at new positions of a batch ([`NewEntries`]): their journal entries and
/// their attempt rows, in one statement (`$1` now). Answers how many of each it wrote.
const NEW_ATTEMPTS_SQL: &str = "WITH entries AS (
     INSERT INTO {s}.journal (run_id, seq, name, kind, status, output, error, attempts, next_attempt_at_ms,
                              updated_at_ms)
     SELECT u.run_id, u.seq, u.name, u.kind, u.status, u.output, u.error, 1, u.next_attempt_at_ms, $1
     FROM unnest($2::text[], $3::integer[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[],
                 $9::bigint[]) AS u(run_id, seq, name, kind, status, output, error, next_attempt_at_ms)
     RETURNING 1),
 attempts AS (
     INSERT INTO {s}.step_attempts (run_id, seq, attempt, ok, error, finished_at_ms)
     SELECT u.run_id, u.seq, 1, u.ok, u.error, $1
     FROM unnest($2::text[], $3::integer[], $10::boolean[], $8::text[]) AS u(run_id, seq, ok, error)
     RETURNING 1)
 SELECT (SELECT count(*) FROM entries), (SELECT count(*) FROM attempts)";
/// A further attempt at an unsettled position: the entry updated, the attempt appended with the
/// next ordinal of the position's whole history (an operator retry resets only the entry's
/// budget).
const NEXT_ATTEMPT_SQL: &str = "WITH entry AS (
     UPDATE {s}.journal SET status = $5, output = $6, error = $7, attempts = $8, next_attempt_at_ms = $9,
         updated_at_ms = $10
     WHERE run_id = $1 AND seq = $2 AND name = $3 AND kind = $4)
 INSERT INTO {s}.step_attempts (run_id, seq, attempt, ok, error, finished_at_ms)
 VALUES ($1, $2, (SELECT coalesce(max(attempt), 0) + 1 FROM {s}.step_attempts WHERE run_id = $1 AND seq = $2),
         $11, $7, $10)";
const TIMER_STARTED_SQL: &str = "INSERT INTO {s}.journal (run_id, seq, name, kind, status, attempts, wake_at_ms,
     event_name, updated_at_ms)
 VALUES ($1, $2, $3, $4, 'waiting', 0, $5, $6, $7)
 ON CONFLICT (run_id, seq) DO UPDATE SET wake_at_ms = excluded.wake_at_ms, event_name = excluded.event_name,
     updated_at_ms = excluded.updated_at_ms";
const TIMER_FINISHED_SQL: &str =
    "UPDATE {s}.journal SET status = 'completed', output = $3, updated_at_ms = $4 WHERE run_id = $1 AND seq = $2";
/// A child step's end, settled only while the entry is that step waiting, and the child's end
/// event (`$5`) consumed by it in the same statement. Answers the entries settled and the
/// events consumed: (1, 1), or (0, 0) when the entry was not that step waiting (nothing written).
const CHILD_ENDED_SQL: &str = "WITH settled AS (
     UPDATE {s}.journal SET status = 'completed', output = $3, updated_at_ms = $4
     WHERE run_id = $1 AND seq = $2 AND status = 'waiting' AND kind = 'child'
     RETURNING 1),
 consumed AS (
     UPDATE {s}.run_events SET consumed_by_seq = $2
     WHERE run_id = $1 AND event_id = $5 AND consumed_by_seq IS NULL AND EXISTS (SELECT 1 FROM settled)
     RETURNING 1)
 SELECT (SELECT count(*) FROM settled), (SELECT count(*) FROM consumed)";
const CONSUME_EVENT_SQL: &str = "UPDATE {s}.run_events SET consumed_by_seq = $3 WHERE run_id = $1 AND event_id = $2";
/// Release the lease and wait. Due now (`$5`) instead of at `$3` when a cancel was requested (the
/// row's own flag, as this transaction left it: a parent's end earlier in the batch may have set
/// it) or an unconsumed event the run waits for (`$4`), or any child's end (a parent may await
/// several at once), is already there: read by this statement, after the run's lock was granted,
/// so an event sent meanwhile is either seen here or wakes the suspended run itself.
pub(crate) const SUSPEND_SQL: &str = "UPDATE {s}.runs SET status = $2, waiting_for = $4,
     lease_owner = NULL, lease_token = NULL, lease_expires_at_ms = NULL,
     wake_at_ms = CASE WHEN cancel_requested OR ($4::text IS NOT NULL AND EXISTS (
             SELECT 1 FROM {s}.run_events WHERE run_id = $1 AND (name = $4 OR name LIKE 'child/%')
               AND consumed_by_seq IS NULL))
         THEN least($3::bigint, $5::bigint) ELSE $3::bigint END
 WHERE run_id = $1";
/// The run's latest value under a key (`ctx.set_event`), replaced in the journal's transaction.
const PUBLISH_SQL: &str =
    "INSERT INTO {s}.run_published (run_id, key, value, seq, updated_at_ms) VALUES ($1, $2, $3, $4, $5)
 ON CONFLICT (run_id, key) DO UPDATE SET value = excluded.value, seq = excluded.seq,
     updated_at_ms = excluded.updated_at_ms";
/// A continuation takes over its predecessor's parent (`$1` the continuation, `$2` the
/// predecessor): its end is the one the parent learns of.
const CONTINUATION_SQL: &str = "UPDATE {s}.runs SET (parent_run_id, parent_seq) =
     (SELECT parent_run_id, parent_seq FROM {s}.runs WHERE run_id = $2)
 WHERE run_id = $1";
const CHILD_OF_SQL: &str =
    "UPDATE {s}.runs SET parent_run_id = $2, parent_seq = $3 WHERE run_id = $1 AND parent_run_id IS NULL";

/// What a run's end does to its family, in the transaction that ended it (the common tail of
/// [`RUN_ENDED_SQL`] and [`FINISH_SQL`], which define `ended`: the run that ended, unless it was
/// parked, with its status, result, error, parent and parent seq; `$2` is now):
/// - a child that ended (not parked: that waits for an operator; not continued: its continuation
///   tells the parent when the chain ends) tells its parent how, as the
///   event `child/<seq>` (`child_event`): `{"run_id", "status", "result", "error"}`, only while
///   the parent is active and at most once (an operator retry of a child that already told its
///   parent tells it nothing new);
/// - the parent is due now if it waits (for this child or another: a parent awaiting several
///   looks again);
/// - each of its own children still active has cancellation requested (each stops at its next
///   step boundary, and its end cascades to its children).
///
/// The parent and the children were locked by the caller first (`LOCK_BATCH_SQL`, or the
/// operator's lock), so a parent's `Suspend` and this notification wait for each other.
macro_rules! family_told {
    () => {
        family_told!("ended")
    };
    // `$told`: the CTE of the runs whose parents learn of their end by the event (`ended`, or
    // those whose end did not settle the parent's entry, `FINISH_CHILDREN_SQL`).
    ($told:literal) => {
        concat!(
            " notify AS (
     INSERT INTO {s}.run_events (run_id, event_id, name, payload, received_at_ms, consumed_by_seq)
     SELECT c.parent_run_id, 'child/' || c.parent_seq, 'child/' || c.parent_seq,
            json_build_object('run_id', c.run_id, 'status', c.status, 'result', c.result::json,
                              'error', c.error)::text,
            $2, NULL
     FROM ",
            $told,
            " c JOIN {s}.runs p ON p.run_id = c.parent_run_id
     WHERE c.status <> 'continued' AND p.status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating')
     ON CONFLICT (run_id, event_id) DO NOTHING),
 wake AS (
     UPDATE {s}.runs SET wake_at_ms = least(wake_at_ms, $2), updated_at_ms = $2
     WHERE run_id IN (SELECT parent_run_id FROM ",
            $told,
            " WHERE status <> 'continued') AND status = 'waiting'),
 cancel AS (
     UPDATE {s}.runs SET cancel_requested = true, error = 'cancel requested: its parent run ended',
         wake_at_ms = least(wake_at_ms, $2), updated_at_ms = $2
     WHERE parent_run_id IN (SELECT run_id FROM ended) AND NOT cancel_requested
       AND status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating'))"
        )
    };
}

/// Finish many runs that have no family (no parent, no active child: nobody to tell) under their
/// lease tokens, releasing their leases, in one statement: `$1` run ids, `$3` their tokens, `$4`
/// statuses, `$5` results, `$6` errors, `$2` now. A run with family finishes with
/// [`FINISH_SQL`].
const FINISH_ALONE_SQL: &str = "UPDATE {s}.runs r SET status = u.status, result = u.result, error = u.error,
     finished_at_ms = $2, updated_at_ms = $2, waiting_for = NULL, lease_owner = NULL, lease_token = NULL,
     lease_expires_at_ms = NULL
 FROM unnest($1::text[], $3::text[], $4::text[], $5::text[], $6::text[]) AS u(run_id, token, status, result, error)
 WHERE r.run_id = u.run_id AND r.lease_token = u.token";

/// A run that has ended (`$1`, by an operator) tells its family ([`family_told!`]).
pub(crate) const RUN_ENDED_SQL: &str = concat!(
    "WITH ended AS (
     SELECT run_id, status, result, error, parent_run_id, parent_seq
     FROM {s}.runs WHERE run_id = $1 AND finished_at_ms IS NOT NULL AND status <> 'parked'),",
    family_told!(),
    " SELECT 1"
);

/// Finish run `$1` under its lease token `$3` (status `$4`, result `$5`, error `$6`, now `$2`),
/// releasing its lease, and tell its family in the same statement ([`family_told!`]). Answers
/// how many runs it finished (1, or 0 when the token no longer holds).
const FINISH_SQL: &str = concat!(
    "WITH finished AS (
     UPDATE {s}.runs SET status = $4, result = $5, error = $6, finished_at_ms = $2, updated_at_ms = $2,
         waiting_for = NULL, lease_owner = NULL, lease_token = NULL, lease_expires_at_ms = NULL
     WHERE run_id = $1 AND lease_token = $3
     RETURNING run_id, status, result, error, parent_run_id, parent_seq),
 ended AS (SELECT * FROM finished WHERE status <> 'parked'),",
    family_told!(),
    " SELECT count(*) FROM finished"
);

/// Finish child runs as [`FINISH_SQL`] does, many in one statement (`$1` run ids, `$3` their
/// tokens, `$4` statuses, `$5` results, `$6` errors, `$7` the lease token each one's parent
/// waits with in memory, `JournalOp::FinishChild`; `$2` now), and for each whose parent still
/// holds that lease, settle the parent's `child` entry with the child's end instead of sending
/// the end event (the parents' rows were locked with the batch, so their leases cannot change
/// under this statement). No run of the statement is another's parent
/// ([`FamilyWrites`]): each row is updated once. Answers how many runs it finished and the
/// children whose parent's entry it settled.
const FINISH_CHILDREN_SQL: &str = concat!(
    "WITH finished AS (
     UPDATE {s}.runs r SET status = u.status, result = u.result, error = u.error, finished_at_ms = $2,
         updated_at_ms = $2, waiting_for = NULL, lease_owner = NULL, lease_token = NULL, lease_expires_at_ms = NULL
     FROM unnest($1::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[])
          AS u(run_id, token, status, result, error, parent_token)
     WHERE r.run_id = u.run_id AND r.lease_token = u.token
     RETURNING r.run_id, r.status, r.result, r.error, r.parent_run_id, r.parent_seq, u.parent_token),
 ended AS (SELECT * FROM finished WHERE status <> 'parked'),
 settled AS (
     UPDATE {s}.journal j SET status = 'completed', updated_at_ms = $2,
         output = json_build_object('run_id', c.run_id, 'status', c.status, 'result', c.result::json,
                                    'error', c.error)::text
     FROM ended c JOIN {s}.runs p ON p.run_id = c.parent_run_id AND p.lease_token = c.parent_token
     WHERE c.status <> 'continued' AND j.run_id = c.parent_run_id AND j.seq = c.parent_seq
       AND j.status = 'waiting' AND j.kind = 'child'
     RETURNING c.run_id),
 told AS (SELECT * FROM ended WHERE run_id NOT IN (SELECT run_id FROM settled)),",
    family_told!("told"),
    " SELECT (SELECT count(*) FROM finished), ARRAY(SELECT run_id FROM settled)"
);

/// A child run that was there already (same workflow and input) and has ended tells its new
/// parent now (`$1` the child, `$2` now): the event keeps the parent due.
const NOTIFY_ADOPTED_SQL: &str = "INSERT INTO {s}.run_events (run_id, event_id, name, payload, received_at_ms,
     consumed_by_seq)
 SELECT c.parent_run_id, 'child/' || c.parent_seq, 'child/' || c.parent_seq,
        json_build_object('run_id', c.run_id, 'status', c.status, 'result', c.result::json, 'error', c.error)::text,
        $2, NULL
 FROM {s}.runs c JOIN {s}.runs p ON p.run_id = c.parent_run_id
 WHERE c.run_id = $1 AND c.finished_at_ms IS NOT NULL AND c.status <> 'parked' AND c.status <> 'continued'
   AND p.status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating')
 ON CONFLICT (run_id, event_id) DO NOTHING";

/// What the batch knows of one of its runs, from the rows it locked and the writes it applied
/// since.
struct RunState {
    /// The run's lease token now (`None`: released, finished or suspended in this batch).
    token: Option<String>,
    /// The run's next free journal position, when a write of this batch established it.
    next_seq: Option<u32>,
    /// A transactional step's body ran for this run since its row was read: read it again
    /// before the next write (the body's statements could have changed anything).
    stale: bool,
    /// A write with the run's token was applied: `updated_at_ms` is touched at the end.
    touched: bool,
    /// A status change (`JournalOp::SetStatus`, a run starting to execute or to compensate) not
    /// written yet: it goes with the touch at the end ([`TOUCH_SQL`]), one statement for the whole
    /// batch instead of one per run, unless a later write of the run (a finish, a suspension)
    /// writes the status itself. Until then the row shows the status the claim read (an active
    /// one either way: what other runs' writes in the batch check of it, `status IN (active)`,
    /// holds; a message or a child's end that finds it `waiting` moves its `wake_at_ms` to now,
    /// which its own suspension or end later rewrites).
    status: Option<RunStatus>,
    /// The run has a parent or a child (locked with the batch, or started by it): its end tells
    /// them ([`FINISH_SQL`]).
    family: bool,
    /// The run's finish, when it has no family: written with the batch's other such finishes in
    /// one statement ([`FINISH_ALONE_SQL`]) at the end, or before a write that reads other runs'
    /// rows (a message, a child's start or end, a continuation, a finish with family), so that
    /// every write sees the ended runs ended.
    finish: Option<LoneFinish>,
    /// The run's parent, as the batch's lock read it.
    parent: Option<String>,
    /// The run's end for its parent waiting in memory, not written yet ([`FamilyWrites`]).
    finish_child: Option<ChildFinish>,
}

/// A run's finish not written yet ([`RunState::finish`]).
struct LoneFinish {
    token: String,
    status: RunStatus,
    result: Option<String>,
    error: Option<String>,
}

/// A child's end for its parent waiting in memory (`JournalOp::FinishChild`) not written yet
/// ([`RunState::finish_child`], [`FamilyWrites`]).
struct ChildFinish {
    token: String,
    status: RunStatus,
    result: Option<String>,
    error: Option<String>,
    parent_token: String,
}

/// A new child's start not written yet ([`FamilyWrites`]): a child that joins no queue.
struct ChildStart {
    /// The index of its write in the batch.
    index: usize,
    parent: String,
    seq: u32,
    name: String,
    request: Box<StartRequest>,
    wake_at_ms: i64,
    /// Leased to the starting worker: owner, token, expiry.
    lease: Option<(String, String, i64)>,
}

impl ChildStart {
    fn row(&self) -> super::ChildRow<'_> {
        let lease = self.lease.as_ref().map(|(owner, token, expires)| (owner.as_str(), token.as_str(), *expires));
        super::ChildRow { parent_run_id: &self.parent, parent_seq: self.seq, lease }
    }
}

/// The batch's writes between parents and children not written yet: new children's starts
/// (`JournalOp::StartChild`) and children's ends for parents waiting in memory
/// (`JournalOp::FinishChild`, [`RunState::finish_child`]). Each kind is written in one statement
/// for the whole batch (`CHILD_STARTS_SQL`, [`FINISH_CHILDREN_SQL`]) at its end, or first when a
/// write comes that must see them:
/// - a write that reads other runs' rows (a message, a continuation, a finish with family, a
///   queued child's start), or any write of a run they involve (a starting parent, an ending
///   child or its parent);
/// - a child's end whose run or parent a start involves, or that is the parent of an end held,
///   or whose parent's end is held (a run and its parent never end in one statement: no row is
///   updated twice);
/// - a start whose parent already starts one held (its position read must see it), or whose
///   parent or child an end involves.
///
/// So the starts and the ends held touch distinct runs, and writing either kind first gives what
/// the writes one at a time give. A write is answered at once as if it were written; when a start
/// finds its child's id taken (then started the general way, [`start_child_general`]) or an end
/// settles its parent's entry, the answer is replaced at the end of the batch.
#[derive(Default)]
struct FamilyWrites {
    /// The index of the write being applied.
    index: usize,
    starts: Vec<ChildStart>,
    /// The starts' parents; the starts' parents and children.
    start_parents: BTreeSet<String>,
    start_runs: BTreeSet<String>,
    /// The children whose end is held, with the index of each one's write, and their parents.
    ends: HashMap<String, usize>,
    end_parents: BTreeSet<String>,
    /// Answers replaced at the end of the batch (by write index).
    answers: Vec<(usize, WriteResult)>,
}

impl FamilyWrites {
    fn is_empty(&self) -> bool {
        self.starts.is_empty() && self.ends.is_empty()
    }

    /// Whether a held end involves `run` (as the child or its parent).
    fn ending(&self, run: &str) -> bool {
        self.ends.contains_key(run) || self.end_parents.contains(run)
    }

    /// Whether what is held must be written before `write` applies.
    fn written_before(&self, write: &Write, runs: &HashMap<String, RunState>) -> bool {
        if self.is_empty() {
            return false;
        }
        let run = write.run_id.as_str();
        match &write.op {
            JournalOp::FinishChild { .. } => {
                let parent = runs.get(run).and_then(|state| state.parent.as_deref());
                self.end_parents.contains(run)
                    || self.start_runs.contains(run)
                    || parent.is_some_and(|p| self.ends.contains_key(p) || self.start_runs.contains(p))
            }
            JournalOp::StartChild { request, .. } if request.queue.is_none() => {
                self.start_parents.contains(run) || self.ending(run) || self.ending(&request.run_id)
            }
            op => reads_other_runs(op, runs.get(run)) || self.start_runs.contains(run) || self.ending(run),
        }
    }

    /// Hold a child's end, answered `Done` for now.
    fn hold_end(&mut self, child: &str, parent: Option<&str>) {
        self.ends.insert(child.to_string(), self.index);
        self.end_parents.extend(parent.map(str::to_string));
    }

    /// Hold a new child's start, answered as started for now.
    fn hold_start(&mut self, start: ChildStart) {
        self.start_parents.insert(start.parent.clone());
        self.start_runs.insert(start.parent.clone());
        self.start_runs.insert(start.request.run_id.clone());
        self.starts.push(start);
    }

    /// Write what is held: the starts in one statement (and a start whose child's id was taken
    /// the general way), then the ends in one statement.
    fn write(
        &mut self,
        apply: &ApplyTransaction,
        st: &mut Statements,
        runs: &mut HashMap<String, RunState>,
        pending: &mut NewEntries,
        now_ms: i64,
    ) -> Result<()> {
        self.write_starts(apply, st, runs, pending, now_ms)?;
        self.write_ends(apply, st, runs, now_ms)?;
        self.start_parents.clear();
        self.start_runs.clear();
        self.end_parents.clear();
        Ok(())
    }

    fn write_starts(
        &mut self,
        apply: &ApplyTransaction,
        st: &mut Statements,
        runs: &mut HashMap<String, RunState>,
        pending: &mut NewEntries,
        now_ms: i64,
    ) -> Result<()> {
        if self.starts.is_empty() {
            return Ok(());
        }
        let starts = std::mem::take(&mut self.starts);
        let events: Vec<String> = starts.iter().map(|start| child_event(start.seq)).collect();
        let children: Vec<super::NewChild<'_>> = starts
            .iter()
            .zip(&events)
            .map(|(start, event)| super::NewChild {
                request: &start.request,
                row: start.row(),
                name: &start.name,
                wake_at_ms: start.wake_at_ms,
                event,
            })
            .collect();
        let created = super::start_children_in(&mut *apply.client()?, st, &children, now_ms)?;
        let taken: Vec<&ChildStart> = starts.iter().filter(|start| !created.contains(&start.request.run_id)).collect();
        if !taken.is_empty() {
            // What the general path reads of the id's run shows the batch's ended runs ended.
            write_lone_finishes(apply, st, runs, now_ms)?;
        }
        for start in taken {
            let mut c = apply.client()?;
            let row = start.row();
            let (created, result) =
                start_child_general(&mut c, st, pending, &start.name, &start.request, start.wake_at_ms, &row, now_ms)?;
            self.answers.push((start.index, child_answer(created, &row, &start.request, now_ms, result)));
        }
        Ok(())
    }

    fn write_ends(
        &mut self,
        apply: &ApplyTransaction,
        st: &mut Statements,
        runs: &mut HashMap<String, RunState>,
        now_ms: i64,
    ) -> Result<()> {
        if self.ends.is_empty() {
            return Ok(());
        }
        let (mut ids, mut tokens, mut statuses, mut results, mut errors, mut parent_tokens) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for run_id in self.ends.keys() {
            let finish = runs.get_mut(run_id).and_then(|state| state.finish_child.take());
            let Some(ChildFinish { token, status, result, error, parent_token }) = finish else {
                return Err(Error::Invariant(format!("run {run_id}: a child's end to write is not there")));
            };
            ids.push(run_id.as_str());
            tokens.push(token);
            statuses.push(status.as_str());
            results.push(result);
            errors.push(error);
            parent_tokens.push(parent_token);
        }
        let mut c = apply.client()?;
        let statement = st.get(&mut *c, FINISH_CHILDREN_SQL)?;
        let row =
            c.query_one(&statement, &[&ids, &now_ms, &tokens, &statuses, &results, &errors, &parent_tokens]).db()?;
        let (finished, settled): (i64, Vec<String>) = (col(&row, 0)?, col(&row, 1)?);
        ensure_invariant!(finished as usize == ids.len(), "{} locked children finished {finished} rows", ids.len());
        for child in settled {
            if let Some(&index) = self.ends.get(&child) {
                self.answers.push((index, WriteResult::ParentSettled));
            }
        }
        self.ends.clear();
        Ok(())
    }
}

/// A child's start the general way ([`super::start_rows_in`]): a queued child, or one whose id
/// the one-statement start found taken. A run of that id with the same workflow and input is
/// adopted (and tells its new parent now if it has ended); another is a permanent failure of the
/// parent's step. Answers whether it created the child, and the step's result.
#[allow(clippy::too_many_arguments)]
fn start_child_general(
    c: &mut Client,
    st: &mut Statements,
    pending: &mut NewEntries,
    name: &str,
    request: &StartRequest,
    wake_at_ms: i64,
    row: &super::ChildRow<'_>,
    now_ms: i64,
) -> Result<(bool, std::result::Result<Value, StepFailure>)> {
    let (run, seq) = (row.parent_run_id, row.parent_seq);
    let (created, conflict) =
        match super::start_rows_in(&mut *c, st, std::slice::from_ref(request), now_ms, Some(row))?.into_iter().next() {
            Some(StartOutcome::Started { .. }) => (true, None),
            Some(StartOutcome::Existing { .. }) => {
                // A run of that id (same workflow and input) was there already: adopted; if it
                // has ended, the parent learns of it now (the event keeps the parent due).
                let child_of = st.get(&mut *c, CHILD_OF_SQL)?;
                c.execute(&child_of, &[&request.run_id, &run, &seq_param(seq)]).db()?;
                let notify = st.get(&mut *c, NOTIFY_ADOPTED_SQL)?;
                c.execute(&notify, &[&request.run_id, &now_ms]).db()?;
                (false, None)
            }
            Some(StartOutcome::Conflict { reason, .. }) => (false, Some(reason)),
            None => return Err(Error::Invariant("a start answered nothing".into())),
        };
    let result = match conflict {
        None => {
            let timer = st.get(&mut *c, TIMER_STARTED_SQL)?;
            let event = child_event(seq);
            let kind = StepKind::Child.as_str();
            c.execute(&timer, &[&run, &seq_param(seq), &name, &kind, &wake_at_ms, &event, &now_ms]).db()?;
            Ok(Value::Null)
        }
        Some(reason) => {
            let failure = StepFailure::permanent(format!("the child run id is taken: {reason}"));
            let step = Step { run_id: run, seq, name, kind: StepKind::Child, attempt: 1, new: true };
            record_attempt(c, st, pending, &step, Err(&failure), None, now_ms)?;
            Err(failure)
        }
    };
    Ok((created, result))
}

/// A child's start answered: the claimed child when it was created leased to the starting
/// worker (built from the request, [`RunRecord::started_child`]), else the step's result.
fn child_answer(
    created: bool,
    row: &super::ChildRow<'_>,
    request: &StartRequest,
    now_ms: i64,
    result: std::result::Result<Value, StepFailure>,
) -> WriteResult {
    match row.lease.filter(|_| created) {
        Some((owner, token, expires)) => WriteResult::Claimed(Box::new(ClaimedRun {
            run: RunRecord::started_child(request, row.parent_run_id, owner, expires, now_ms),
            lease_token: token.to_string(),
            journal: Vec::new(),
            events: Vec::new(),
            recovered: false,
        })),
        None => WriteResult::TxResult(result),
    }
}

/// Whether `op`, a write of a run in `state`, reads other runs' rows: they must show the ends
/// written before it.
fn reads_other_runs(op: &JournalOp<ApplyTransaction>, state: Option<&RunState>) -> bool {
    match op {
        JournalOp::Finish { .. } => state.is_some_and(|state| state.family),
        JournalOp::ContinueAsNew { .. }
        | JournalOp::StartChild { .. }
        | JournalOp::ChildEnded { .. }
        | JournalOp::Send { .. } => true,
        _ => false,
    }
}

/// What the batch holds to write later: new journal positions ([`NewEntries`]) and the writes
/// between parents and children ([`FamilyWrites`]).
struct Held {
    entries: NewEntries,
    family: FamilyWrites,
}

/// Write the batch's pending finishes of runs without family ([`FINISH_ALONE_SQL`]).
fn write_lone_finishes(
    apply: &ApplyTransaction,
    st: &mut Statements,
    runs: &mut HashMap<String, RunState>,
    now_ms: i64,
) -> Result<()> {
    let (mut ids, mut tokens, mut statuses, mut results, mut errors) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (run_id, state) in runs.iter_mut() {
        if let Some(LoneFinish { token, status, result, error }) = state.finish.take() {
            ids.push(run_id.as_str());
            tokens.push(token);
            statuses.push(status.as_str());
            results.push(result);
            errors.push(error);
        }
    }
    if ids.is_empty() {
        return Ok(());
    }
    let mut c = apply.client()?;
    let statement = st.get(&mut *c, FINISH_ALONE_SQL)?;
    let finished = c.execute(&statement, &[&ids, &now_ms, &tokens, &statuses, &results, &errors]).db()?;
    ensure_invariant!(finished as usize == ids.len(), "{} locked runs finished {finished} rows", ids.len());
    Ok(())
}

pub(super) fn commit(
    apply: &ApplyTransaction,
    st: &mut Statements,
    writes: Vec<Write>,
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
    let run_ids: Vec<&str> = writes.iter().map(|w| w.run_id.as_str()).collect::<BTreeSet<_>>().into_iter().collect();
    // The runs the batch's messages go to are locked with the batch (a message locks its
    // receiver, as `send_event` does): in the same order, so two runs messaging each other from
    // two workers' commits never wait for each other in a cycle.
    let locked: Vec<&str> = writes
        .iter()
        .map(|w| match &w.op {
            JournalOp::Send { to, .. } => to.as_str(),
            _ => w.run_id.as_str(),
        })
        .chain(writes.iter().map(|w| w.run_id.as_str()))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let finishing: Vec<&str> = writes
        .iter()
        .filter(|w| {
            matches!(w.op, JournalOp::Finish { .. } | JournalOp::FinishChild { .. } | JournalOp::ContinueAsNew { .. })
        })
        .map(|w| w.run_id.as_str())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let open = OpenTransaction::begin(apply)?;
    let mut runs: HashMap<String, RunState> = HashMap::new();
    {
        let mut c = apply.client()?;
        let lock = st.get(&mut *c, LOCK_BATCH_SQL)?;
        // Runs named as the parent of a locked run (a run with an active child is in the lock
        // set only if that child is locked with it).
        let mut parents: BTreeSet<String> = BTreeSet::new();
        for row in c.query(&lock, &[&locked, &finishing]).db()? {
            let run_id: String = col(&row, 0)?;
            let parent: Option<String> = col(&row, 3)?;
            if run_ids.binary_search(&run_id.as_str()).is_ok() {
                let next: i32 = col(&row, 2)?;
                let next_seq =
                    Some(u32::try_from(next).map_err(|_| Error::Invariant(format!("next position {next}")))?);
                let state = RunState {
                    token: col(&row, 1)?,
                    next_seq,
                    stale: false,
                    touched: false,
                    status: None,
                    family: parent.is_some(),
                    finish: None,
                    parent: parent.clone(),
                    finish_child: None,
                };
                runs.insert(run_id, state);
            }
            parents.extend(parent);
        }
        for parent in &parents {
            if let Some(state) = runs.get_mut(parent) {
                state.family = true;
            }
        }
    }
    let mut held = Held { entries: NewEntries { now_ms, ..NewEntries::default() }, family: FamilyWrites::default() };
    let mut results = Vec::with_capacity(writes.len());
    for (index, (write, text)) in writes.into_iter().zip(texts).enumerate() {
        if held.family.written_before(&write, &runs) {
            held.family.write(apply, st, &mut runs, &mut held.entries, now_ms)?;
        }
        held.family.index = index;
        results.push(apply_write(apply, st, &mut runs, &mut held, write, text, now_ms)?);
    }
    held.family.write(apply, st, &mut runs, &mut held.entries, now_ms)?;
    for (index, answer) in held.family.answers.drain(..) {
        results[index] = answer;
    }
    let mut pending = held.entries;
    pending.write(&mut *apply.client()?, st)?;
    write_lone_finishes(apply, st, &mut runs, now_ms)?;
    let (touched, statuses): (Vec<&str>, Vec<Option<&str>>) =
        runs.iter().filter(|(_, s)| s.touched).map(|(id, s)| (id.as_str(), s.status.map(RunStatus::as_str))).unzip();
    if !touched.is_empty() {
        let mut c = apply.client()?;
        let touch = st.get(&mut *c, TOUCH_SQL)?;
        c.execute(&touch, &[&touched, &now_ms, &statuses]).db()?;
    }
    crash::hit("workflow.commit.before_commit");
    open.commit()?;
    crash::hit("workflow.commit.after_commit");
    Ok(results)
}

/// Apply one write: fenced (nothing written, the batch goes on) unless its token is the run's
/// token now; a broken journal invariant refuses the whole batch.
fn apply_write(
    apply: &ApplyTransaction,
    st: &mut Statements,
    runs: &mut HashMap<String, RunState>,
    held: &mut Held,
    write: Write,
    text: Option<String>,
    now_ms: i64,
) -> Result<WriteResult> {
    let Held { entries: pending, family } = held;
    let JournalWrite { run_id, lease_token, op } = write;
    // (A child's end reads its parent and its own children: never a run that finishes alone. A
    // new child's start is held, [`FamilyWrites`], which writes them first if its id is taken.)
    let held_start = matches!(&op, JournalOp::StartChild { request, .. } if request.queue.is_none());
    if reads_other_runs(&op, runs.get(&run_id)) && !held_start {
        write_lone_finishes(apply, st, runs, now_ms)?;
    }
    let Some(state) = runs.get_mut(&run_id) else {
        // No such run (or purged): nobody holds it.
        return Ok(WriteResult::Fenced);
    };
    if state.stale {
        let mut c = apply.client()?;
        let row = c
            .query_opt(
                &crate::schema::sql(apply.schema(), "SELECT lease_token FROM {s}.runs WHERE run_id = $1"),
                &[&run_id],
            )
            .db()?;
        let Some(row) = row else {
            return Err(Error::Invariant(format!("run {run_id} vanished inside its own commit")));
        };
        state.token = col(&row, 0)?;
        state.next_seq = None;
        state.stale = false;
    }
    if state.token.as_deref() != Some(lease_token.as_str()) {
        return Ok(WriteResult::Fenced);
    }
    state.touched = true;
    let run = run_id.as_str();
    let token = lease_token.as_str();
    match op {
        JournalOp::SetStatus { status } => {
            // Written with the touch at the end (the row is locked and its token checked above).
            state.status = Some(status);
            Ok(WriteResult::Done)
        }
        JournalOp::Finish { status, result: _, error } => {
            let error = error.as_deref().map(clip_error);
            if state.family {
                // The run's family learns of its end in the same statement.
                let mut c = apply.client()?;
                finish(&mut c, st, run, token, status.run_status(), text.as_deref(), error.as_deref(), now_ms)?;
            } else {
                let finish =
                    LoneFinish { token: lease_token.clone(), status: status.run_status(), result: text, error };
                state.finish = Some(finish);
            }
            state.token = None;
            state.status = None;
            Ok(WriteResult::Done)
        }
        JournalOp::FinishChild { status, result: _, error, parent_lease_token } => {
            // Written with the batch's other children's ends ([`FamilyWrites`]), which answers
            // `ParentSettled` for it when it settled its parent's entry.
            let error = error.as_deref().map(clip_error);
            let (status, parent_token) = (status.run_status(), parent_lease_token);
            state.finish_child =
                Some(ChildFinish { token: lease_token.clone(), status, result: text, error, parent_token });
            family.hold_end(run, state.parent.as_deref());
            state.token = None;
            state.status = None;
            Ok(WriteResult::Done)
        }
        JournalOp::ContinueAsNew { request } => {
            let mut c = apply.client()?;
            let outcome = super::start_in(&mut *c, st, std::slice::from_ref(&*request), now_ms)?;
            match outcome.into_iter().next() {
                Some(StartOutcome::Started { .. }) => {
                    let continuation = st.get(&mut *c, CONTINUATION_SQL)?;
                    c.execute(&continuation, &[&request.run_id, &run]).db()?;
                    let result = serde_json::json!({"continued_as": request.run_id});
                    // Its children still running are cancelled, as at any end.
                    let text = json_text(&result);
                    finish(&mut c, st, run, token, RunStatus::Continued, Some(&text), None, now_ms)?;
                    state.token = None;
                    state.status = None;
                    Ok(WriteResult::TxResult(Ok(result)))
                }
                Some(StartOutcome::Existing { .. } | StartOutcome::Conflict { .. }) => Ok(WriteResult::TxResult(Err(
                    StepFailure::permanent(format!("the continuation's run id {:?} is taken", request.run_id)),
                ))),
                None => Err(Error::Invariant("a start answered nothing".into())),
            }
        }
        JournalOp::Release => {
            let mut c = apply.client()?;
            let statement = st.get(&mut *c, RELEASE_SQL)?;
            let changed = c.execute(&statement, &[&run, &token, &now_ms]).db()?;
            ensure_invariant!(changed == 1, "run {run}: its locked row was not released");
            state.token = None;
            Ok(WriteResult::Done)
        }
        JournalOp::StepAttempt { seq, name, kind, attempt, result, retry_at_ms } => {
            let mut c = apply.client()?;
            let (existing, next) =
                position(&mut c, st, pending, run, seq, &name, kind, StepStatus::Retrying, state.next_seq)?;
            check_attempt(run, seq, attempt, existing)?;
            let recorded = match &result {
                Ok(_) => Ok(text.as_deref().unwrap_or("null")),
                Err(failure) => Err(failure),
            };
            let step = Step { run_id: run, seq, name: &name, kind, attempt, new: existing.is_none() };
            record_attempt(&mut c, st, pending, &step, recorded, retry_at_ms, now_ms)?;
            state.next_seq = Some(next);
            Ok(WriteResult::Done)
        }
        JournalOp::TxStep { seq, name, kind, attempt, body, retry_at_ms } => {
            let existing = {
                // A new position this batch established reads nothing ([`position`]): the
                // release of the previous step's savepoint, if it is pending, then travels with
                // this step's savepoint in one round trip.
                let release = if state.next_seq == Some(seq) { apply.take_release() } else { None };
                let mut c = apply.client()?;
                let (existing, _) =
                    position(&mut c, st, pending, run, seq, &name, kind, StepStatus::Retrying, state.next_seq)?;
                check_attempt(run, seq, attempt, existing)?;
                match release {
                    Some(previous) => c.batch_execute(&format!("RELEASE SAVEPOINT {previous}; SAVEPOINT {TX_STEP}")),
                    None => c.batch_execute(&format!("SAVEPOINT {TX_STEP}")),
                }
                .map_err(|error| {
                    Error::store(format!(
                        "the journal's transaction ended inside the body of the transactional step before step {name} of run {run}: {}",
                        Error::from(error)
                    ))
                })?;
                existing
            };
            // The body gets the connection with no borrow of the store's held.
            apply.begin_user_code();
            let outcome = body(apply);
            state.stale = true;
            let outcome = match outcome {
                Ok(output) => match json_within("step output", &output, STEP_OUTPUT_BYTES_MAX) {
                    Ok(text) => Ok((output, text)),
                    Err(e) => Err(StepFailure::permanent(e.to_string())),
                },
                Err(failure) => Err(failure),
            };
            // A new position's attempt is recorded with the batch's others (no statement now), so
            // the release of a body that ran no failing statement can wait ([`end_savepoint`]).
            let may_defer = existing.is_none() && !apply.user_statement_failed();
            let outcome = end_savepoint(apply, run, &name, outcome, may_defer)?;
            let mut c = apply.client()?;
            let recorded = outcome.as_ref().map(|(_, text)| text.as_str());
            let step = Step { run_id: run, seq, name: &name, kind, attempt, new: existing.is_none() };
            record_attempt(&mut c, st, pending, &step, recorded, retry_at_ms, now_ms)?;
            Ok(WriteResult::TxResult(outcome.map(|(output, _)| output)))
        }
        JournalOp::StartChild { seq, name, request, wake_at_ms, claim } => {
            let mut c = apply.client()?;
            let (existing, next) =
                position(&mut c, st, pending, run, seq, &name, StepKind::Child, StepStatus::Waiting, state.next_seq)?;
            ensure_invariant!(existing.is_none(), "run {run} step {seq}: its child was started already");
            state.next_seq = Some(next);
            // Its end now tells this child ([`FINISH_SQL`]).
            state.family = true;
            // A child this write creates has its parent, and its lease when asked, in its row.
            let lease = claim.map(|claim| (claim.worker_id, super::new_token(), now_ms + claim.lease_ms));
            if request.queue.is_none() {
                // Started with the batch's other new children ([`FamilyWrites`]), which answers
                // otherwise if its id turns out taken.
                let index = family.index;
                let start = ChildStart { index, parent: run_id.clone(), seq, name, request, wake_at_ms, lease };
                let answer = child_answer(true, &start.row(), &start.request, now_ms, Ok(Value::Null));
                family.hold_start(start);
                return Ok(answer);
            }
            let lease = lease.as_ref().map(|(owner, token, expires)| (owner.as_str(), token.as_str(), *expires));
            let row = super::ChildRow { parent_run_id: run, parent_seq: seq, lease };
            let (created, result) =
                start_child_general(&mut c, st, pending, &name, &request, wake_at_ms, &row, now_ms)?;
            Ok(child_answer(created, &row, &request, now_ms, result))
        }
        JournalOp::ChildEnded { seq, end } => {
            let mut c = apply.client()?;
            let event_id = child_event(seq);
            let event = rows::event(&mut *c, st, run, &event_id)?;
            let held = event.is_some_and(|e| e.consumed_by_seq.is_none() && e.payload == end);
            // The entry is settled only while it is the child step waiting, and the event
            // consumed with it (one statement).
            let settled = held && {
                let settle = st.get(&mut *c, CHILD_ENDED_SQL)?;
                let text = text.unwrap_or_else(|| json_text(&end));
                let row = c.query_one(&settle, &[&run, &seq_param(seq), &text, &now_ms, &event_id]).db()?;
                let counts: (i64, i64) = (col(&row, 0)?, col(&row, 1)?);
                ensure_invariant!(counts.0 == counts.1, "run {run} step {seq}: settled and consumed {counts:?}");
                counts.0 == 1
            };
            if !settled {
                // The parent went on with an end the store does not hold: it replays instead.
                let release = st.get(&mut *c, RELEASE_SQL)?;
                c.execute(&release, &[&run, &token, &now_ms]).db()?;
                state.token = None;
                return Ok(WriteResult::Fenced);
            }
            Ok(WriteResult::Done)
        }
        JournalOp::Publish { seq, key, value: _ } => {
            let mut c = apply.client()?;
            let (existing, next) =
                position(&mut c, st, pending, run, seq, &key, StepKind::Publish, StepStatus::Waiting, state.next_seq)?;
            ensure_invariant!(existing.is_none(), "run {run} step {seq}: published already");
            let text = text.unwrap_or_else(|| "null".into());
            let publish = st.get(&mut *c, PUBLISH_SQL)?;
            c.execute(&publish, &[&run, &key, &text, &seq_param(seq), &now_ms]).db()?;
            let step = Step { run_id: run, seq, name: &key, kind: StepKind::Publish, attempt: 1, new: true };
            record_attempt(&mut c, st, pending, &step, Ok("null"), None, now_ms)?;
            state.next_seq = Some(next);
            Ok(WriteResult::Done)
        }
        JournalOp::Send { seq, to, topic, payload } => {
            let mut c = apply.client()?;
            let (existing, next) =
                position(&mut c, st, pending, run, seq, &topic, StepKind::Send, StepStatus::Waiting, state.next_seq)?;
            ensure_invariant!(existing.is_none(), "run {run} step {seq}: sent already");
            let event_id = message_event_id(run, seq);
            // The receiver was locked with the batch; an unknown or ended receiver fails the step.
            let delivered = match super::send_event_locked(&mut *c, st, &to, &event_id, &topic, &payload, now_ms) {
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
            let output = delivered.as_ref().map(json_text);
            let recorded = match &output {
                Ok(text) => Ok(text.as_str()),
                Err(failure) => Err(*failure),
            };
            let step = Step { run_id: run, seq, name: &topic, kind: StepKind::Send, attempt: 1, new: true };
            record_attempt(&mut c, st, pending, &step, recorded, None, now_ms)?;
            state.next_seq = Some(next);
            Ok(WriteResult::TxResult(delivered))
        }
        JournalOp::TimerStarted { seq, name, kind, wake_at_ms, event_name } => {
            let mut c = apply.client()?;
            let (_, next) = position(&mut c, st, pending, run, seq, &name, kind, StepStatus::Waiting, state.next_seq)?;
            let timer = st.get(&mut *c, TIMER_STARTED_SQL)?;
            c.execute(&timer, &[&run, &seq_param(seq), &name, &kind.as_str(), &wake_at_ms, &event_name, &now_ms])
                .db()?;
            state.next_seq = Some(next);
            Ok(WriteResult::Done)
        }
        JournalOp::TimerFinished { seq, event_id, output } => {
            let mut c = apply.client()?;
            pending.write(&mut c, st)?;
            let Some(entry) = rows::journal_at(&mut *c, st, run, seq)? else {
                return Err(Error::Invariant(format!("run {run}: no timer at step {seq} to finish")));
            };
            ensure_invariant!(
                entry.status == StepStatus::Waiting,
                "run {run} step {seq} ({}) is {}, not a pending timer",
                entry.name,
                entry.status.as_str()
            );
            if let Some(event_id) = &event_id {
                ensure_invariant!(
                    matches!(entry.kind, StepKind::Wait | StepKind::Child),
                    "run {run} step {seq} is a sleep, not a wait"
                );
                let Some(event) = rows::event(&mut *c, st, run, event_id)? else {
                    return Err(Error::Invariant(format!("run {run} has no event {event_id}")));
                };
                ensure_invariant!(
                    event.consumed_by_seq.is_none(),
                    "run {run} event {event_id} was already consumed by step {:?}",
                    event.consumed_by_seq
                );
                ensure_invariant!(
                    Some(&event.name) == entry.event_name.as_ref(),
                    "run {run} event {event_id} is {:?}; step {seq} waits for {:?}",
                    event.name,
                    entry.event_name
                );
                let consume = st.get(&mut *c, CONSUME_EVENT_SQL)?;
                c.execute(&consume, &[&run, event_id, &seq_param(seq)]).db()?;
            }
            let finished = st.get(&mut *c, TIMER_FINISHED_SQL)?;
            let output = text.unwrap_or_else(|| json_text(&output));
            c.execute(&finished, &[&run, &seq_param(seq), &output, &now_ms]).db()?;
            Ok(WriteResult::Done)
        }
        JournalOp::Suspend { status, wake_at_ms, waiting_for } => {
            let mut c = apply.client()?;
            let suspend = st.get(&mut *c, SUSPEND_SQL)?;
            let changed =
                c.execute(&suspend, &[&run, &status.run_status().as_str(), &wake_at_ms, &waiting_for, &now_ms]).db()?;
            ensure_invariant!(changed == 1, "run {run}: its locked row did not suspend");
            state.token = None;
            state.status = None;
            Ok(WriteResult::Done)
        }
    }
}

/// Finish a run whose lease token is `token` ([`FINISH_SQL`]): its row, its lease, its family.
#[allow(clippy::too_many_arguments)]
fn finish(
    c: &mut Client,
    st: &mut Statements,
    run: &str,
    token: &str,
    status: RunStatus,
    result: Option<&str>,
    error: Option<&str>,
    now_ms: i64,
) -> Result<()> {
    let statement = st.get(c, FINISH_SQL)?;
    let row = c.query_one(&statement, &[&run, &now_ms, &token, &status.as_str(), &result, &error]).db()?;
    let finished: i64 = col(&row, 0)?;
    ensure_invariant!(finished == 1, "run {run}: its locked row did not finish");
    Ok(())
}

/// The savepoint of a transactional step's body.
const TX_STEP: &str = "wf_tx_step";

/// End a transactional step's savepoint: kept when the body succeeded, rolled back when it
/// failed. A body whose own statement failed leaves the transaction aborted even if it returned
/// `Ok`: its writes cannot commit, so they are rolled back and the attempt counts as failed. A
/// body that ended the transaction (`COMMIT` or `ROLLBACK` on the connection it was handed)
/// leaves nothing this batch could commit together: the whole batch is refused.
///
/// With `may_defer` (the body ran no failing statement, and recording its attempt sends
/// nothing), a kept savepoint's release is not sent now: it goes with the next step's savepoint
/// or the commit, or before the store's next statement ([`ApplyTransaction::client`]), and
/// whichever carries it still refuses the batch if the body ended the transaction, before any
/// other statement of the batch runs.
fn end_savepoint(
    apply: &ApplyTransaction,
    run_id: &str,
    name: &str,
    outcome: std::result::Result<(Value, String), StepFailure>,
    may_defer: bool,
) -> Result<std::result::Result<(Value, String), StepFailure>> {
    if may_defer && outcome.is_ok() {
        apply.defer_release(TX_STEP);
        return Ok(outcome);
    }
    let mut c = apply.client()?;
    let c = &mut *c;
    let ended = |error: postgres::Error| {
        Error::store(format!(
            "the journal's transaction ended inside the body of step {name} of run {run_id}: {}",
            Error::from(error)
        ))
    };
    let outcome = match outcome {
        Ok(done) => match c.batch_execute(&format!("RELEASE SAVEPOINT {TX_STEP}")) {
            Ok(()) => return Ok(Ok(done)),
            Err(error) if error.code() == Some(&SqlState::IN_FAILED_SQL_TRANSACTION) => Err(StepFailure::retryable(
                format!("a statement of the step failed (the step returned success anyway): {}", Error::from(error)),
            )),
            Err(error) => return Err(ended(error)),
        },
        Err(failure) => Err(failure),
    };
    c.batch_execute(&format!("ROLLBACK TO SAVEPOINT {TX_STEP}; RELEASE SAVEPOINT {TX_STEP}")).map_err(ended)?;
    Ok(outcome)
}

/// A write at `seq` either opens the next position or continues the unsettled entry there
/// (which must be the same step, in `unsettled` status). A settled entry is never rewritten.
/// Returns the attempts recorded at the position (`None`: a new position) and the run's next
/// free position after the write. One statement, or none when `known_next` (established by this
/// batch) is `seq`.
#[allow(clippy::too_many_arguments)]
fn position(
    c: &mut Client,
    st: &mut Statements,
    pending: &mut NewEntries,
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
    pending.write(c, st)?;
    let statement = st.get(c, POSITION_SQL)?;
    let row = c.query_one(&statement, &[&run_id, &seq_param(seq)]).db()?;
    let (found_name, found_kind, found_status, attempts, next): (
        Option<String>,
        Option<String>,
        Option<String>,
        Option<i32>,
        i32,
    ) = (col(&row, 0)?, col(&row, 1)?, col(&row, 2)?, col(&row, 3)?, col(&row, 4)?);
    let (Some(found_name), Some(found_kind), Some(found_status), Some(attempts)) =
        (found_name, found_kind, found_status, attempts)
    else {
        ensure_invariant!(
            i64::from(seq) == i64::from(next),
            "run {run_id}: a new step at {seq}, but the next position is {next}"
        );
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
    let attempts =
        u32::try_from(attempts).map_err(|_| Error::Invariant(format!("run {run_id}: attempts {attempts}")))?;
    let next = u32::try_from(next).map_err(|_| Error::Invariant(format!("run {run_id}: next position {next}")))?;
    Ok((Some(attempts), next))
}

/// The first attempts at new journal positions that a batch recorded and has not written yet:
/// they are written in one statement ([`NEW_ATTEMPTS_SQL`]) before the batch reads the journal
/// or the attempts again (a position check that needs the table, a timer's entry, the next
/// attempt's ordinal) and before it commits. Nothing else in the batch reads them: the fences
/// read runs, and a transactional step's body must not read tidemark's tables
/// ([`ApplyTransaction`]).
#[derive(Default)]
struct NewEntries {
    /// The commit's time (every row of one commit has it).
    now_ms: i64,
    run_ids: Vec<String>,
    seqs: Vec<i32>,
    names: Vec<String>,
    kinds: Vec<&'static str>,
    statuses: Vec<&'static str>,
    outputs: Vec<Option<String>>,
    errors: Vec<Option<String>>,
    next_attempt_at_ms: Vec<Option<i64>>,
    oks: Vec<bool>,
}

impl NewEntries {
    fn write(&mut self, c: &mut Client, st: &mut Statements) -> Result<()> {
        if self.run_ids.is_empty() {
            return Ok(());
        }
        let statement = st.get(c, NEW_ATTEMPTS_SQL)?;
        let row = c
            .query_one(
                &statement,
                &[
                    &self.now_ms,
                    &self.run_ids,
                    &self.seqs,
                    &self.names,
                    &self.kinds,
                    &self.statuses,
                    &self.outputs,
                    &self.errors,
                    &self.next_attempt_at_ms,
                    &self.oks,
                ],
            )
            .db()?;
        let written: (i64, i64) = (col(&row, 0)?, col(&row, 1)?);
        let expected = self.run_ids.len() as i64;
        ensure_invariant!(written == (expected, expected), "{expected} new journal entries wrote {written:?}");
        *self = NewEntries { now_ms: self.now_ms, ..NewEntries::default() };
        Ok(())
    }
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
    c: &mut Client,
    st: &mut Statements,
    pending: &mut NewEntries,
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
    let attempts = i32::try_from(attempt).map_err(|_| Error::Invariant(format!("run {run_id}: attempt {attempt}")))?;
    if new {
        // A new position's first attempt is written with the batch's others ([`NewEntries`]).
        ensure_invariant!(attempt == 1, "run {run_id} step {seq}: a new position at attempt {attempt}");
        pending.run_ids.push(run_id.to_string());
        pending.seqs.push(seq_param(seq));
        pending.names.push(name.to_string());
        pending.kinds.push(kind.as_str());
        pending.statuses.push(status.as_str());
        pending.outputs.push(output.map(str::to_string));
        pending.errors.push(error);
        pending.next_attempt_at_ms.push(next_attempt_at_ms);
        pending.oks.push(ok);
        return Ok(());
    }
    // The next attempt's ordinal is read from the position's history: the batch's new entries first.
    pending.write(c, st)?;
    let statement = st.get(c, NEXT_ATTEMPT_SQL)?;
    c.execute(
        &statement,
        &[
            &run_id,
            &seq_param(seq),
            &name,
            &kind.as_str(),
            &status.as_str(),
            &output,
            &error,
            &attempts,
            &next_attempt_at_ms,
            &now_ms,
            &ok,
        ],
    )
    .db()?;
    Ok(())
}
