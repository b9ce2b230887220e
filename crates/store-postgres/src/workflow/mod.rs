//! The PostgreSQL [`WorkflowStore`], [`ScheduleStore`](tidemark_core::schedule::ScheduleStore) and
//! [`QueueStore`](tidemark_core::queue::QueueStore): runs, their journal, step attempts, events,
//! idempotency receipts, schedules and queues (migration v2
//! of `schema.rs`, the tables of SQLite's v3 and v9), for the durable workflow runtime
//! (`docs/workflows.md`), shared by any number of worker processes on any number of machines.
//!
//! **Same decisions as SQLite.** Every decision `tidemark_store_sqlite`'s `workflow/mod.rs` lists
//! is made the same way here: `claim` leaves the status as it is; the lease token alone fences
//! `commit` (a write whose token is still the run's applies even after its lease expired, as long
//! as nobody re-claimed the run) while `heartbeat` extends only unexpired leases; `cancel` does
//! not take the lease (`retry`, `skip_step` and `abandon` clear it); a `Suspend` into `waiting`
//! with an unconsumed event of that name (or a child's end, `child/<seq>`) or a cancel request
//! stays due now; a failure that is not retryable, or has no `retry_at_ms`, fails the step for
//! good; a child's end reaches its parent, and a run's end requests the cancel of its active
//! children, in the transaction that ends it; purged runs leave a receipt for
//! [`PgWorkflows::receipt_window_ms`]; a schedule's `fire` is a compare-and-set on its next tick.
//!
//! **Transactions.** Every method that writes is one short `READ COMMITTED` transaction, begun
//! and committed inside the call (none is left open between calls, none spans an await: the
//! store is blocking and lives on its own thread). Input is validated before the transaction
//! begins; bad input is `Error::Invalid` with a stable code and nothing is written. Reads of a
//! whole run (`run`) use one `REPEATABLE READ READ ONLY` transaction.
//!
//! **Concurrency: what replaces SQLite's single writer.** Several processes write at once, so
//! every write that reads a run before changing it locks the run's row first (`FOR UPDATE`) and
//! reads it with a statement that runs after the lock was granted:
//! - `commit` locks every run of its batch, and the parent and active children of each run the
//!   batch finishes, in one statement, in `run_id` order, before it writes anything; the fences
//!   are then decided on those locked rows. `heartbeat` locks its runs in `run_id` order too, and
//!   so does an operator's `abandon` (the run and its family). Every transaction that locks
//!   several runs locks them in that one order, so two of them never wait for each other.
//! - `send_event` locks the run, then checks, inserts and wakes. A `Suspend` reads the events
//!   after its own lock: one of the two waits for the other, and either the suspension sees the
//!   event or the event's wake-up sees the suspended run (no lost wake-up across processes).
//! - `claim` reads due runs with `FOR UPDATE SKIP LOCKED`: a run another claim, a commit or an
//!   operator holds is passed over (never waited for) and taken at the next poll.
//! - Per-type limits are one budget for the whole database: a claim that honours a limit first
//!   takes a transaction-scoped advisory lock of the workflow type ([`crate::schema`]'s
//!   `LOCK_WORKFLOW_TYPE`), then counts the type's live leases with a statement that sees every
//!   claim committed before the lock was granted, and leases at most the rest. Only claims lease
//!   runs, so no lease can appear that the count missed: two workers never spend one slot twice.
//! - Per-key serialization: only the oldest active run of a key qualifies, and a claim that
//!   leases a keyed run takes the key's advisory lock (`LOCK_RUN_KEY`, keys in order) and checks
//!   again, after the lock, that no other run of the key holds a live lease. At most one run per
//!   key holds a live lease, whatever the clocks of the starting machines say about creation
//!   times.
//! - Queues (`queues.rs`): a queue's room is spent the same way, under the queue's advisory lock.
//! - Advisory locks are taken only by claims, in one order (types, then queues, then keys), and
//!   claims never wait for a row lock, so lock waits cannot form a cycle. Every wait is bounded by
//!   the session's `lock_timeout` (10 s; a `store` error after it).

pub(crate) mod commit;
mod import;
pub(crate) mod operator;
pub(crate) mod queues;
pub(crate) mod rows;
pub(crate) mod schedules;

use std::cell::{RefCell, RefMut};
use std::collections::{BTreeMap, BTreeSet, HashMap};

use postgres::types::ToSql;
use postgres::{Client, GenericClient};
use serde_json::Value;
use tidemark_core::crash;
use tidemark_core::error::codes;
use tidemark_core::id::{validate_id, validate_limit};
use tidemark_core::limits::PAGE_SIZE_MAX;
use tidemark_core::workflow::{
    cut_journal_page, validate_json_size, ClaimRequest, ClaimedRun, DetailPage, JournalWrite, LeaseState,
    PublishedValue, PurgeReport, RunDetail, RunFilter, RunRecord, RunStatus, StartOutcome, StartRequest,
    UnclaimableRuns, WorkflowStore, WorkflowVersion, WriteResult, CLAIM_BATCH_MAX, ERROR_BYTES_MAX, LEASE_MS_MAX,
    LEASE_MS_MIN, RUN_EVENTS_HELD_MAX, WORKFLOW_INPUT_BYTES_MAX,
};
use tidemark_core::{ensure_invariant, Error, Result};

use crate::apply::{ApplyTransaction, CommitHook};
use crate::schema::{self, lock, sql, validate_schema_name, Statements, LOCK_RUN_KEY, LOCK_WORKFLOW_TYPE};
use crate::{col, PgResult};

/// How long a purged run's idempotency receipt is kept, counted from when the run finished (30
/// days, as on SQLite).
pub const RECEIPT_WINDOW_MS_DEFAULT: i64 = 30 * 24 * 60 * 60 * 1000;

/// The workflow store in one schema of a PostgreSQL database: any number of `PgWorkflows`, in
/// any number of processes, may share the schema (each with its own connection); claims, leases,
/// limits, queues and keys hold across all of them. Implements [`WorkflowStore`] with
/// [`ApplyTransaction`] as the transactional steps' target, `ScheduleStore` and `QueueStore`.
pub struct PgWorkflows {
    apply: ApplyTransaction,
    statements: RefCell<Statements>,
    receipt_window_ms: i64,
    /// Where it connected, to reconnect after the server closed the connection.
    conn_str: String,
}

impl PgWorkflows {
    /// Create (or reopen, never resetting) the workflow store in `schema` of the database at
    /// `conn_str`, creating the schema and migrating it. The workflow tables come with the schema
    /// (migration v2), as on SQLite: the schema may also be a producer's or a consumer's, so that
    /// a transactional step writes business rows and outbox events in the journal's transaction.
    pub fn init(conn_str: &str, schema: &str) -> Result<PgWorkflows> {
        validate_schema_name(schema)?;
        let mut client = schema::connect(conn_str)?;
        schema::migrate(&mut client, schema, true)?;
        Ok(Self::with(client, schema, conn_str))
    }

    /// Open the workflow store in `schema` (migrating it forward if it is older). Never creates
    /// anything: a missing schema, or one that holds no tidemark tables, is `not_initialized`.
    pub fn open(conn_str: &str, schema: &str) -> Result<PgWorkflows> {
        validate_schema_name(schema)?;
        let mut client = schema::connect(conn_str)?;
        schema::migrate(&mut client, schema, false)?;
        Ok(Self::with(client, schema, conn_str))
    }

    fn with(client: Client, schema: &str, conn_str: &str) -> PgWorkflows {
        PgWorkflows {
            apply: ApplyTransaction::new(client, schema),
            statements: RefCell::new(Statements::new(schema)),
            receipt_window_ms: RECEIPT_WINDOW_MS_DEFAULT,
            conn_str: conn_str.to_string(),
        }
    }

    /// Keep purged runs' receipts this long after they finished (must be > 0).
    pub fn with_receipt_window_ms(mut self, receipt_window_ms: i64) -> Result<PgWorkflows> {
        if receipt_window_ms <= 0 {
            return Err(Error::invalid(codes::INVALID_ARGUMENT, "receipt_window_ms must be positive"));
        }
        self.receipt_window_ms = receipt_window_ms;
        Ok(self)
    }

    /// How long purged runs' idempotency receipts are kept after the run finished, in ms.
    pub fn receipt_window_ms(&self) -> i64 {
        self.receipt_window_ms
    }

    /// The PostgreSQL schema this store lives in.
    pub fn schema(&self) -> &str {
        self.apply.schema()
    }

    /// Ask `hook` before each write transaction of this store commits (claims, heartbeats,
    /// journal commits, starts, events, operator changes, queue and schedule changes): `true`
    /// rolls the transaction back and the call fails with a `store` error, as SQLite's commit
    /// hook does. For tests: the test kit (`tidemark::testing`) crashes a workflow at each
    /// journal boundary with it. `None` removes it.
    pub fn set_commit_hook(&mut self, hook: Option<CommitHook>) {
        self.apply.set_commit_hook(hook);
    }

    /// The connection, for the caller's own tables and reads (outside any store call).
    pub fn client(&mut self) -> &mut Client {
        self.apply.client_get_mut()
    }

    /// Runs still active, counted by status, and the earliest time one of them is due (what
    /// `tidemark worker` reports as left when it stops; SQLite's `stats::active_runs`).
    pub fn active_runs(&mut self) -> Result<(BTreeMap<String, u64>, Option<i64>)> {
        let statement = format!(
            r#"SELECT status, count(*), min(wake_at_ms) FROM "{}".runs
               WHERE status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating')
               GROUP BY status ORDER BY status"#,
            self.schema()
        );
        let rows = self.client().query(&statement, &[]).db()?;
        let mut active = BTreeMap::new();
        let mut next_wake_at_ms: Option<i64> = None;
        for row in &rows {
            let (status, count, wake): (String, i64, i64) = (col(row, 0)?, col(row, 1)?, col(row, 2)?);
            active.insert(status, count as u64);
            next_wake_at_ms = Some(next_wake_at_ms.map_or(wake, |w| w.min(wake)));
        }
        Ok((active, next_wake_at_ms))
    }

    /// Runs by status, every status (SQLite's `stats::run_counts`; the benchmarks' check).
    pub fn run_counts(&mut self) -> Result<BTreeMap<String, u64>> {
        let schema = self.schema().to_string();
        crate::stats::run_counts(self.client(), &schema)
    }

    /// `(recovered, completed)`: runs taken over after a lease expired at least once, and runs
    /// completed (SQLite's `SqliteWorkflows::recovered_and_completed_runs`; what the benchmarks
    /// poll while a killed worker's runs are resumed).
    pub fn recovered_and_completed_runs(&mut self) -> Result<(u64, u64)> {
        let statement = format!(
            r#"SELECT count(*) FILTER (WHERE recoveries > 0), count(*) FILTER (WHERE status = 'completed')
               FROM "{}".runs"#,
            self.schema()
        );
        let row = self.client().query_one(&statement, &[]).db()?;
        let (recovered, completed): (i64, i64) = (col(&row, 0)?, col(&row, 1)?);
        Ok((recovered as u64, completed as u64))
    }

    /// `(held, earliest, latest)`: how many runs hold a lease of worker `owner` (until it
    /// expires, even if the worker is gone) and the earliest and latest expiry of those leases
    /// (SQLite's `SqliteWorkflows::leases_held_by`).
    pub fn leases_held_by(&mut self, owner: &str) -> Result<(u64, Option<i64>, Option<i64>)> {
        let statement = format!(
            r#"SELECT count(*), min(lease_expires_at_ms), max(lease_expires_at_ms) FROM "{}".runs
               WHERE lease_owner = $1"#,
            self.schema()
        );
        let row = self.client().query_one(&statement, &[&owner]).db()?;
        let (held, earliest, latest): (i64, Option<i64>, Option<i64>) = (col(&row, 0)?, col(&row, 1)?, col(&row, 2)?);
        Ok((held as u64, earliest, latest))
    }

    /// The connection and the statement cache, for a read through `&self`.
    fn reader(&self) -> (RefMut<'_, Client>, RefMut<'_, Statements>) {
        (self.apply.client_mut(), self.statements.borrow_mut())
    }
}

pub(crate) fn invalid_arg(message: impl Into<String>) -> Error {
    Error::invalid(codes::INVALID_ARGUMENT, message)
}

/// Error texts are kept to [`ERROR_BYTES_MAX`] bytes (cut at a character boundary).
pub(crate) fn clip_error(message: &str) -> String {
    let mut end = message.len().min(ERROR_BYTES_MAX);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    message[..end].to_string()
}

pub(super) fn new_token() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// A journal position as stored (`integer`; positions are below `RUN_STEPS_MAX`, checked first).
pub(crate) fn seq_param(seq: u32) -> i32 {
    i32::try_from(seq).unwrap_or(i32::MAX)
}

fn validate_versions(workflows: &[WorkflowVersion]) -> Result<()> {
    for w in workflows {
        validate_id("workflow", &w.workflow)?;
        if w.version == 0 {
            return Err(invalid_arg("workflow version must be >= 1"));
        }
        if w.concurrency_max == Some(0) {
            return Err(invalid_arg(format!("concurrency_max of {} must be >= 1", w.workflow)));
        }
    }
    Ok(())
}

fn validate_event(run_id: &str, event_id: &str, name: &str, payload: &Value) -> Result<()> {
    validate_id("run_id", run_id)?;
    validate_id("event_id", event_id)?;
    validate_id("event name", name)?;
    validate_json_size("event payload", payload, WORKFLOW_INPUT_BYTES_MAX, codes::PAYLOAD_TOO_LARGE)
}

/// Deliver an event to a run of the workflow store in schema `workflow_schema` inside the
/// transaction the store handed `tx` (an inbox handler's apply transaction on a `PgConsumer` of
/// the same database, or a transactional step's): the event, and the run's wake-up, commit exactly
/// when that transaction does. Same rules and answers as [`WorkflowStore::send_event`]; the run is
/// locked until the transaction ends.
pub fn send_event_in(
    tx: &ApplyTransaction,
    workflow_schema: &str,
    run_id: &str,
    event_id: &str,
    name: &str,
    payload: &Value,
    now_ms: i64,
) -> Result<bool> {
    validate_schema_name(workflow_schema)?;
    validate_event(run_id, event_id, name, payload)?;
    // Prepared for this call only: the handle's statement cache belongs to its own store.
    let mut st = Statements::new(workflow_schema);
    send_event_validated(&mut *tx.client_mut(), &mut st, run_id, event_id, name, payload, now_ms)
}

/// A message of one run to another (`JournalOp::Send`), in the sender's journal transaction
/// (which locked the receiver with its batch): the receiver must exist and be active; the event
/// id is the store's own (`msg/...`).
pub(super) fn send_event_locked(
    c: &mut impl GenericClient,
    st: &mut Statements,
    run_id: &str,
    event_id: &str,
    name: &str,
    payload: &Value,
    now_ms: i64,
) -> Result<bool> {
    validate_id("run_id", run_id)?;
    validate_id("event name", name)?;
    send_event_validated(c, st, run_id, event_id, name, payload, now_ms)
}

/// Lock the run (a `send_event` and a `Suspend` of it then wait for each other), then insert the
/// event and wake the run if it waits for that name. In the caller's transaction.
fn send_event_validated(
    c: &mut impl GenericClient,
    st: &mut Statements,
    run_id: &str,
    event_id: &str,
    name: &str,
    payload: &Value,
    now_ms: i64,
) -> Result<bool> {
    let run = rows::locked_run(c, st, run_id)?;
    let same = |existing: &tidemark_core::workflow::RunEvent| -> Result<bool> {
        if existing.name == name && &existing.payload == payload {
            return Ok(false);
        }
        Err(Error::invalid(
            codes::ALREADY_EXISTS,
            format!("event {event_id:?} of run {run_id:?} was already sent with another name or payload"),
        ))
    };
    if let Some(existing) = rows::event(c, st, run_id, event_id)? {
        return same(&existing);
    }
    if run.status.is_terminal() {
        return Err(Error::invalid(
            codes::INVALID_STATE_CHANGE,
            format!("run {run_id:?} is {}; it takes no more events", run.status.as_str()),
        ));
    }
    // The run is locked: no other send counts meanwhile.
    let count = st.get(c, rows::EVENTS_HELD_SQL)?;
    let held: i64 = c.query_one(&count, &[&run_id, &(RUN_EVENTS_HELD_MAX as i64)]).db()?.get(0);
    tidemark_core::workflow::events_held_check(run_id, held as usize)?;
    let insert = st.get(
        c,
        "INSERT INTO {s}.run_events (run_id, event_id, name, payload, received_at_ms, consumed_by_seq)
         VALUES ($1, $2, $3, $4, $5, NULL) ON CONFLICT (run_id, event_id) DO NOTHING",
    )?;
    let inserted = c.execute(&insert, &[&run_id, &event_id, &name, &rows::json_text(payload), &now_ms]).db()?;
    ensure_invariant!(inserted == 1, "run {run_id:?} is locked, yet event {event_id:?} appeared meanwhile");
    // A run waiting for this name is due now (the worker that claims it consumes the event).
    let wake = st.get(
        c,
        "UPDATE {s}.runs SET wake_at_ms = least(wake_at_ms, $3), updated_at_ms = $3
         WHERE run_id = $1 AND status = 'waiting' AND waiting_for = $2",
    )?;
    c.execute(&wake, &[&run_id, &name, &now_ms]).db()?;
    Ok(true)
}

/// Due, unleased (or lease expired) runs of one (workflow, version), oldest due first, locked
/// and skipping any row another transaction holds. A keyed run qualifies only as the oldest
/// active run of its key while no other run of the key holds a live lease. Parameters:
/// workflow, version, now_ms, limit. (`runs_due` for the runs, `runs_key` for the key checks.)
pub(crate) const CLAIM_CANDIDATES_SQL: &str = "SELECT r.run_id, r.workflow, r.version, r.input, r.key, r.status,
        r.result, r.error, r.wake_at_ms, r.waiting_for, r.cancel_requested, r.forked_from, r.lease_owner,
        r.lease_expires_at_ms, r.recoveries, r.created_at_ms, r.updated_at_ms, r.parent_run_id, r.queue,
        r.priority, r.admitted_at_ms, r.deadline_ms, r.lease_token IS NOT NULL
 FROM {s}.runs r
 WHERE r.workflow = $1 AND r.version = $2
   AND r.status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating') AND r.wake_at_ms <= $3
   AND (r.lease_token IS NULL OR r.lease_expires_at_ms <= $3)
   AND (r.queue IS NULL OR r.admitted_at_ms IS NOT NULL)
   AND (r.key IS NULL OR (
         NOT EXISTS (SELECT 1 FROM {s}.runs o WHERE o.key = r.key
                       AND o.status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating')
                       AND (o.created_at_ms, o.run_id) < (r.created_at_ms, r.run_id))
     AND NOT EXISTS (SELECT 1 FROM {s}.runs o WHERE o.key = r.key
                       AND o.status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating')
                       AND o.run_id <> r.run_id AND o.lease_token IS NOT NULL AND o.lease_expires_at_ms > $3)))
 ORDER BY r.wake_at_ms, r.created_at_ms, r.run_id
 LIMIT $4
 FOR UPDATE OF r SKIP LOCKED";

/// Of the keyed runs `$1` (locked by this claim, their keys' advisory locks held), those that
/// are still the oldest active run of their key with no other run of the key holding a live
/// lease at `$2`, read after the locks were granted (so with every claim of those keys committed
/// before).
pub(crate) const KEYS_STILL_FREE_SQL: &str = "SELECT r.run_id FROM {s}.runs r
 WHERE r.run_id = ANY($1)
   AND NOT EXISTS (SELECT 1 FROM {s}.runs o WHERE o.key = r.key
                     AND o.status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating')
                     AND (o.created_at_ms, o.run_id) < (r.created_at_ms, r.run_id))
   AND NOT EXISTS (SELECT 1 FROM {s}.runs o WHERE o.key = r.key
                     AND o.status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating')
                     AND o.run_id <> r.run_id AND o.lease_token IS NOT NULL AND o.lease_expires_at_ms > $2)";

/// Runs of a workflow type holding a live lease (parameters: workflow, now_ms), counted under the
/// type's advisory lock, by `runs_leased` (only leased runs; a run holding a lease is active, a
/// CHECK of the table says so).
pub(crate) const LEASED_COUNT_SQL: &str = "SELECT count(*) FROM {s}.runs WHERE workflow = $1
   AND lease_token IS NOT NULL AND lease_expires_at_ms > $2";

/// Lease the chosen runs in one statement: `$1` run ids, `$5` their new tokens, `$6` whether
/// each took over an expired lease. A queued run's first lease admits it.
const LEASE_SQL: &str = "UPDATE {s}.runs r SET lease_owner = $2, lease_token = c.token, lease_expires_at_ms = $3,
     recoveries = r.recoveries + CASE WHEN c.recovered THEN 1 ELSE 0 END, updated_at_ms = $4,
     admitted_at_ms = CASE WHEN r.queue IS NOT NULL AND r.admitted_at_ms IS NULL THEN $4 ELSE r.admitted_at_ms END
 FROM unnest($1::text[], $5::text[], $6::boolean[]) AS c(run_id, token, recovered)
 WHERE r.run_id = c.run_id";

/// The listing query of a filter and its parameters.
fn list_sql(filter: &RunFilter, limit: usize) -> (String, Vec<Box<dyn ToSql + Sync>>) {
    let mut text = format!("SELECT {} FROM {{s}}.runs WHERE true", rows::RUN_COLUMNS);
    let mut args: Vec<Box<dyn ToSql + Sync>> = Vec::new();
    let mut arg = |text: &mut String, clause: &str, value: Box<dyn ToSql + Sync>| {
        args.push(value);
        text.push_str(&clause.replace('?', &format!("${}", args.len())));
    };
    if let Some(status) = filter.status {
        arg(&mut text, " AND status = ?", Box::new(status.as_str().to_string()));
    }
    if let Some(workflow) = &filter.workflow {
        arg(&mut text, " AND workflow = ?", Box::new(workflow.clone()));
    }
    if let Some(after) = filter.created_after_ms {
        arg(&mut text, " AND created_at_ms > ?", Box::new(after));
    }
    if let Some(before) = filter.created_before_ms {
        arg(&mut text, " AND created_at_ms < ?", Box::new(before));
    }
    if let Some((created, run_id)) = &filter.after {
        arg(&mut text, " AND (created_at_ms, run_id) > (?", Box::new(*created));
        arg(&mut text, ", ?)", Box::new(run_id.clone()));
    }
    arg(&mut text, " ORDER BY created_at_ms, run_id LIMIT ?", Box::new(limit as i64));
    (text, args)
}

/// Start requests are validated before any transaction begins.
pub(super) use tidemark_core::workflow::validate_starts;

/// What a start found under a run id: (workflow, input hash, status).
type Found = (String, String, RunStatus);

/// The answer to a start whose run id is taken by `found`.
fn outcome_of(request: &StartRequest, hash: &str, found: &Found) -> StartOutcome {
    let (workflow, input_hash, status) = found;
    if *workflow == request.workflow && input_hash == hash {
        StartOutcome::Existing { run_id: request.run_id.clone(), status: *status }
    } else {
        StartOutcome::Conflict {
            run_id: request.run_id.clone(),
            reason: if *workflow != request.workflow {
                format!("run {:?} is a run of workflow {workflow:?}", request.run_id)
            } else {
                format!("run {:?} was started with another input", request.run_id)
            },
        }
    }
}

/// Runs (and receipts of purged runs: 1 live, 2 expired) under the ids `$1`, in one statement,
/// so one snapshot: a purge commits the run's deletion and its receipt together, and this sees
/// one or the other.
const STARTS_FOUND_SQL: &str = "SELECT run_id, workflow, input_hash, status, 0 FROM {s}.runs WHERE run_id = ANY($1)
 UNION ALL
 SELECT run_id, workflow, input_hash, status, CASE WHEN expires_at_ms > $2 THEN 1 ELSE 2 END
 FROM {s}.run_receipts WHERE run_id = ANY($1)";

/// New runs, in run id order (two batches that share ids wait for each other in one order).
/// A run id another transaction inserted meanwhile, or a queue's deduplication id another
/// transaction took meanwhile, leaves its run out of `RETURNING` (any unique index is an arbiter).
const STARTS_INSERT_SQL: &str = "INSERT INTO {s}.runs (run_id, workflow, version, input, input_hash, key, status,
     wake_at_ms, created_at_ms, updated_at_ms, queue, priority, dedup_id, deadline_ms,
     parent_run_id, parent_seq, lease_owner, lease_token, lease_expires_at_ms)
 SELECT n.run_id, n.workflow, n.version, n.input, n.input_hash, n.key, 'pending', n.wake_at_ms, $8, $8,
        n.queue, n.priority, n.dedup_id, n.deadline_ms, $13, $14, $15, $16, $17
 FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::text[], $6::text[], $7::bigint[],
             $9::text[], $10::integer[], $11::text[], $12::bigint[])
      AS n(run_id, workflow, version, input, input_hash, key, wake_at_ms, queue, priority, dedup_id, deadline_ms)
 ON CONFLICT DO NOTHING RETURNING run_id";

/// New children's starts in one statement, for children without a queue (a batch's,
/// [`start_children_in`]; `$8` now, every other parameter an array of one element per child):
/// each child's run (with its parent and lease, as [`STARTS_INSERT_SQL`] writes them) unless the
/// id holds a run or a live receipt, an expired receipt of the id forgotten, and, only for the
/// runs inserted, the parent's `child` entry waiting for the child's end event (`$17`), as the
/// timer statement writes it. Answers the ids inserted and the entries written (as many); a
/// child not inserted had its id taken (by a run, a live receipt, or a concurrent start that
/// committed first: the insert waited for it) and has nothing written: the caller answers its
/// start by the general path.
const CHILD_STARTS_SQL: &str = "WITH u AS (
     SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::text[], $6::text[], $7::bigint[],
                          $9::bigint[], $10::text[], $11::integer[], $12::text[], $13::text[], $14::bigint[],
                          $15::text[], $16::bigint[], $17::text[])
         AS u(run_id, workflow, version, input, input_hash, key, wake_at_ms, deadline_ms, parent_run_id, parent_seq,
              lease_owner, lease_token, lease_expires_at_ms, name, entry_wake_at_ms, event_name)),
 forgotten AS (
     DELETE FROM {s}.run_receipts r USING u WHERE r.run_id = u.run_id AND r.expires_at_ms <= $8),
 child AS (
     INSERT INTO {s}.runs (run_id, workflow, version, input, input_hash, key, status, wake_at_ms, created_at_ms,
         updated_at_ms, deadline_ms, parent_run_id, parent_seq, lease_owner, lease_token, lease_expires_at_ms)
     SELECT u.run_id, u.workflow, u.version, u.input, u.input_hash, u.key, 'pending', u.wake_at_ms, $8, $8,
            u.deadline_ms, u.parent_run_id, u.parent_seq, u.lease_owner, u.lease_token, u.lease_expires_at_ms
     FROM u WHERE NOT EXISTS (SELECT 1 FROM {s}.run_receipts r WHERE r.run_id = u.run_id AND r.expires_at_ms > $8)
     ORDER BY u.run_id
     ON CONFLICT DO NOTHING RETURNING run_id),
 entry AS (
     INSERT INTO {s}.journal (run_id, seq, name, kind, status, attempts, wake_at_ms, event_name, updated_at_ms)
     SELECT u.parent_run_id, u.parent_seq, u.name, 'child', 'waiting', 0, u.entry_wake_at_ms, u.event_name, $8
     FROM u JOIN child c ON c.run_id = u.run_id
     RETURNING 1)
 SELECT ARRAY(SELECT run_id FROM child), (SELECT count(*) FROM entry)";

/// A new child to start ([`start_children_in`]): the request, the row it gets
/// ([`ChildRow`]), and its parent's waiting entry (the step's name, when it wakes, the event).
pub(super) struct NewChild<'a> {
    pub request: &'a StartRequest,
    pub row: ChildRow<'a>,
    pub name: &'a str,
    pub wake_at_ms: i64,
    pub event: &'a str,
}

/// Many children's starts in one round trip ([`CHILD_STARTS_SQL`]): the ids of the children it
/// created, each with its parent's waiting `child` entry; a child whose id was taken is not
/// among them and has nothing written (its start goes the general path, [`start_rows_in`]).
/// None may join a queue.
pub(super) fn start_children_in(
    c: &mut impl GenericClient,
    st: &mut Statements,
    children: &[NewChild<'_>],
    now_ms: i64,
) -> Result<BTreeSet<String>> {
    ensure_invariant!(children.iter().all(|child| child.request.queue.is_none()), "a queued child in a batch start");
    let requests = || children.iter().map(|child| child.request);
    let ids: Vec<&str> = requests().map(|r| r.run_id.as_str()).collect();
    let workflows: Vec<&str> = requests().map(|r| r.workflow.as_str()).collect();
    let versions: Vec<i64> = requests().map(|r| i64::from(r.version)).collect();
    let inputs: Vec<String> = requests().map(|r| rows::json_text(&r.input)).collect();
    let hashes: Vec<String> = requests().map(StartRequest::input_hash).collect();
    let keys: Vec<Option<&str>> = requests().map(|r| r.key.as_deref()).collect();
    let wakes: Vec<i64> = requests().map(|r| r.start_at_ms.unwrap_or(now_ms)).collect();
    let deadlines: Vec<Option<i64>> = requests().map(|r| r.deadline_ms).collect();
    let parents: Vec<&str> = children.iter().map(|child| child.row.parent_run_id).collect();
    let seqs: Vec<i32> = children.iter().map(|child| seq_param(child.row.parent_seq)).collect();
    let owners: Vec<Option<&str>> = children.iter().map(|child| child.row.lease.map(|l| l.0)).collect();
    let tokens: Vec<Option<&str>> = children.iter().map(|child| child.row.lease.map(|l| l.1)).collect();
    let expiries: Vec<Option<i64>> = children.iter().map(|child| child.row.lease.map(|l| l.2)).collect();
    let names: Vec<&str> = children.iter().map(|child| child.name).collect();
    let entry_wakes: Vec<i64> = children.iter().map(|child| child.wake_at_ms).collect();
    let events: Vec<&str> = children.iter().map(|child| child.event).collect();
    let statement = st.get(c, CHILD_STARTS_SQL)?;
    let row = c
        .query_one(
            &statement,
            &[
                &ids,
                &workflows,
                &versions,
                &inputs,
                &hashes,
                &keys,
                &wakes,
                &now_ms,
                &deadlines,
                &parents,
                &seqs,
                &owners,
                &tokens,
                &expiries,
                &names,
                &entry_wakes,
                &events,
            ],
        )
        .db()?;
    let (created, entries): (Vec<String>, i64) = (col(&row, 0)?, col(&row, 1)?);
    ensure_invariant!(entries as usize == created.len(), "{} children started with {entries} entries", created.len());
    Ok(created.into_iter().collect())
}

/// What a child's start writes into its row at once (no update after the insert): its parent,
/// and, when it is leased to the starting worker, the lease (owner, token, expiry).
pub(super) struct ChildRow<'a> {
    pub parent_run_id: &'a str,
    pub parent_seq: u32,
    pub lease: Option<(&'a str, &'a str, i64)>,
}

/// Start validated requests in the caller's transaction: one read of what the ids hold, one
/// insert of the new runs. Idempotent per run id, also against concurrent starts of the same id
/// elsewhere (the insert waits for theirs, and the run they made is compared like any other).
pub(super) fn start_in(
    c: &mut impl GenericClient,
    st: &mut Statements,
    requests: &[StartRequest],
    now_ms: i64,
) -> Result<Vec<StartOutcome>> {
    start_rows_in(c, st, requests, now_ms, None)
}

/// [`start_in`], with `child` written into the row of each run it creates.
pub(super) fn start_rows_in(
    c: &mut impl GenericClient,
    st: &mut Statements,
    requests: &[StartRequest],
    now_ms: i64,
    child: Option<&ChildRow<'_>>,
) -> Result<Vec<StartOutcome>> {
    if requests.is_empty() {
        return Ok(Vec::new());
    }
    let hashes: Vec<String> = requests.iter().map(StartRequest::input_hash).collect();
    let ids: Vec<String> = requests.iter().map(|r| r.run_id.clone()).collect::<BTreeSet<_>>().into_iter().collect();
    let found_sql = st.get(c, STARTS_FOUND_SQL)?;
    let mut found: HashMap<String, Found> = HashMap::new();
    let mut expired: BTreeSet<String> = BTreeSet::new();
    for row in c.query(&found_sql, &[&ids, &now_ms]).db()? {
        let run_id: String = col(&row, 0)?;
        let source = col::<i32>(&row, 4)?;
        if source == 2 {
            // An expired receipt no longer counts: the id may be used again.
            expired.insert(run_id);
            continue;
        }
        let from_receipt = source == 1;
        // A run is what counts; a receipt only stands in for a purged one.
        if from_receipt && found.contains_key(&run_id) {
            continue;
        }
        found.insert(run_id, (col(&row, 1)?, col(&row, 2)?, rows::run_status_column(&row, 3)?));
    }
    let mut outcomes = Vec::with_capacity(requests.len());
    let mut new: BTreeMap<&str, usize> = BTreeMap::new();
    for (index, (request, hash)) in requests.iter().zip(&hashes).enumerate() {
        match found.get(&request.run_id) {
            Some(existing) => outcomes.push(outcome_of(request, hash, existing)),
            None => {
                // A later request of the same id in this batch meets this run.
                found.insert(request.run_id.clone(), (request.workflow.clone(), hash.clone(), RunStatus::Pending));
                new.insert(request.run_id.as_str(), index);
                outcomes.push(StartOutcome::Started { run_id: request.run_id.clone() });
            }
        }
    }
    if new.is_empty() {
        return Ok(outcomes);
    }
    let new_ids: Vec<String> = new.keys().map(|id| id.to_string()).collect();
    let chosen: Vec<&StartRequest> = new.values().map(|index| &requests[*index]).collect();
    queues::check_enqueues(c, st, &chosen)?;
    // Expired receipts of the new ids are deleted (a statement only when there is one).
    let forget_ids: Vec<&String> = new_ids.iter().filter(|id| expired.contains(*id)).collect();
    if !forget_ids.is_empty() {
        let forget = st.get(c, "DELETE FROM {s}.run_receipts WHERE run_id = ANY($1)")?;
        c.execute(&forget, &[&forget_ids]).db()?;
    }
    let workflows: Vec<&str> = chosen.iter().map(|r| r.workflow.as_str()).collect();
    let versions: Vec<i64> = chosen.iter().map(|r| i64::from(r.version)).collect();
    let inputs: Vec<String> = chosen.iter().map(|r| rows::json_text(&r.input)).collect();
    let input_hashes: Vec<&str> = new.values().map(|index| hashes[*index].as_str()).collect();
    let keys: Vec<Option<&str>> = chosen.iter().map(|r| r.key.as_deref()).collect();
    let wakes: Vec<i64> = chosen.iter().map(|r| r.start_at_ms.unwrap_or(now_ms)).collect();
    let queue_names: Vec<Option<&str>> = chosen.iter().map(|r| r.queue.as_ref().map(|q| q.queue.as_str())).collect();
    let priorities: Vec<Option<i32>> = chosen.iter().map(|r| r.queue.as_ref().map(|q| q.priority)).collect();
    let dedups: Vec<Option<&str>> =
        chosen.iter().map(|r| r.queue.as_ref().and_then(|q| q.dedup_id.as_deref())).collect();
    let deadlines: Vec<Option<i64>> = chosen.iter().map(|r| r.deadline_ms).collect();
    let parent = child.map(|c| c.parent_run_id);
    let parent_seq = child.map(|c| seq_param(c.parent_seq));
    let lease_owner = child.and_then(|c| c.lease.map(|(owner, _, _)| owner));
    let lease_token = child.and_then(|c| c.lease.map(|(_, token, _)| token));
    let lease_expires = child.and_then(|c| c.lease.map(|(_, _, expires)| expires));
    let insert = st.get(c, STARTS_INSERT_SQL)?;
    let params: [&(dyn ToSql + Sync); 17] = [
        &new_ids,
        &workflows,
        &versions,
        &inputs,
        &input_hashes,
        &keys,
        &wakes,
        &now_ms,
        &queue_names,
        &priorities,
        &dedups,
        &deadlines,
        &parent,
        &parent_seq,
        &lease_owner,
        &lease_token,
        &lease_expires,
    ];
    let inserted: BTreeSet<String> =
        c.query(&insert, &params).db()?.iter().map(|row| col(row, 0)).collect::<Result<_>>()?;
    let raced: Vec<String> = new_ids.into_iter().filter(|id| !inserted.contains(id)).collect();
    if raced.is_empty() {
        return Ok(outcomes);
    }
    // Another transaction started some of these ids first (and committed: the insert waited for
    // it). Every request of such an id is answered by comparing it with that run.
    let theirs = st.get(c, "SELECT run_id, workflow, input_hash, status FROM {s}.runs WHERE run_id = ANY($1)")?;
    let mut winners: HashMap<String, Found> = HashMap::new();
    for row in c.query(&theirs, &[&raced]).db()? {
        winners.insert(col(&row, 0)?, (col(&row, 1)?, col(&row, 2)?, rows::run_status_column(&row, 3)?));
    }
    for (index, request) in requests.iter().enumerate() {
        if raced.contains(&request.run_id) {
            let Some(winner) = winners.get(&request.run_id) else {
                // Not there: the insert met the deduplication id of a concurrent start (committed:
                // the insert waited for it), which the check names.
                queues::check_enqueues(c, st, &[request])?;
                return Err(Error::Invariant(format!("run {:?} was neither inserted nor found", request.run_id)));
            };
            outcomes[index] = outcome_of(request, &hashes[index], winner);
        }
    }
    Ok(outcomes)
}

fn validate_claim(request: &ClaimRequest) -> Result<()> {
    validate_id("worker_id", &request.worker_id)?;
    validate_limit("claim limit", request.limit, CLAIM_BATCH_MAX)?;
    validate_limit("claim workflows", request.workflows.len(), CLAIM_BATCH_MAX)?;
    validate_versions(&request.workflows)?;
    if !(LEASE_MS_MIN..=LEASE_MS_MAX).contains(&request.lease_ms) {
        return Err(invalid_arg(format!("lease_ms must be {LEASE_MS_MIN}..={LEASE_MS_MAX}")));
    }
    Ok(())
}

/// One candidate of a claim: its row as read (the input still JSON text, parsed only when the
/// run is claimed).
struct Candidate {
    run: RunRecord,
    input: String,
    had_lease: bool,
}

/// Claim for a validated request in the caller's transaction.
fn claim_in(
    c: &mut impl GenericClient,
    st: &mut Statements,
    schema: &str,
    request: &ClaimRequest,
    now_ms: i64,
) -> Result<Vec<ClaimedRun>> {
    // The per-type limit of a workflow is the smallest one given for any of its versions.
    let mut type_max: BTreeMap<&str, Option<u32>> = BTreeMap::new();
    for w in &request.workflows {
        let entry = type_max.entry(w.workflow.as_str()).or_insert(w.concurrency_max);
        *entry = match (*entry, w.concurrency_max) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
    // Slots left per workflow type: the type's budget lock first (types in name order), then the
    // count of live leases on any worker, read after the lock was granted.
    let mut slots: HashMap<&str, usize> = HashMap::new();
    for (workflow, max) in &type_max {
        let free = match max {
            None => request.limit,
            Some(max) => {
                lock(c, LOCK_WORKFLOW_TYPE, &format!("{schema}/{workflow}"))?;
                let count = st.get(c, LEASED_COUNT_SQL)?;
                let leased: i64 = col(&c.query_one(&count, &[workflow, &now_ms]).db()?, 0)?;
                (*max as usize).saturating_sub(leased.max(0) as usize).min(request.limit)
            }
        };
        slots.insert(workflow, free);
    }
    let candidates_sql = st.get(c, CLAIM_CANDIDATES_SQL)?;
    let mut candidates = Vec::new();
    let mut seen = BTreeSet::new();
    for w in &request.workflows {
        let free = slots[w.workflow.as_str()];
        if free == 0 || !seen.insert((w.workflow.as_str(), w.version)) {
            continue;
        }
        let rows = c.query(&candidates_sql, &[&w.workflow, &i64::from(w.version), &now_ms, &(free as i64)]).db()?;
        for row in &rows {
            candidates.push(Candidate {
                run: rows::run_record_without_input(row)?,
                input: col(row, 3)?,
                had_lease: col(row, 22)?,
            });
        }
    }
    // Runs waiting in queues, admitted (in this transaction, with their lease) while their queue
    // has room: by priority, then oldest first.
    for (run, input) in queues::admissible(c, st, schema, &request.workflows, &slots, now_ms)? {
        candidates.push(Candidate { run, input, had_lease: false });
    }
    candidates.sort_by(|a, b| {
        (a.run.wake_at_ms, a.run.created_at_ms, &a.run.run_id).cmp(&(
            b.run.wake_at_ms,
            b.run.created_at_ms,
            &b.run.run_id,
        ))
    });
    let mut chosen: Vec<Candidate> = Vec::new();
    for candidate in candidates {
        if chosen.len() == request.limit {
            break;
        }
        let free = slots.get_mut(candidate.run.workflow.as_str()).expect("slots of every requested workflow");
        if *free == 0 {
            continue;
        }
        *free -= 1;
        chosen.push(candidate);
    }
    // Keyed runs: the keys' locks (in key order), then the key rule checked again with what every
    // claim committed before the locks were granted.
    let keys: BTreeSet<&str> = chosen.iter().filter_map(|c| c.run.key.as_deref()).collect();
    if !keys.is_empty() {
        for key in &keys {
            lock(c, LOCK_RUN_KEY, &format!("{schema}/{key}"))?;
        }
        let keyed: Vec<String> = chosen.iter().filter(|c| c.run.key.is_some()).map(|c| c.run.run_id.clone()).collect();
        let check = st.get(c, KEYS_STILL_FREE_SQL)?;
        let free: BTreeSet<String> =
            c.query(&check, &[&keyed, &now_ms]).db()?.iter().map(|r| col(r, 0)).collect::<Result<_>>()?;
        chosen.retain(|c| c.run.key.is_none() || free.contains(&c.run.run_id));
    }
    if chosen.is_empty() {
        return Ok(Vec::new());
    }
    let expires = now_ms + request.lease_ms;
    let ids: Vec<String> = chosen.iter().map(|c| c.run.run_id.clone()).collect();
    let tokens: Vec<String> = chosen.iter().map(|_| new_token()).collect();
    let recovered: Vec<bool> = chosen.iter().map(|c| c.had_lease).collect();
    let lease = st.get(c, LEASE_SQL)?;
    let changed = c.execute(&lease, &[&ids, &request.worker_id, &expires, &now_ms, &tokens, &recovered]).db()?;
    ensure_invariant!(changed as usize == ids.len(), "leasing {} claimed runs changed {changed} rows", ids.len());
    let mut journals = rows::journals(c, st, &ids)?;
    let mut events = rows::unconsumed_events(c, st, &ids)?;
    let mut claimed = Vec::with_capacity(chosen.len());
    for (Candidate { mut run, input, had_lease }, token) in chosen.into_iter().zip(tokens) {
        // The row as the candidate query read it, with what the lease changed (the row is locked
        // by this transaction: nothing else can have written it in between).
        run.input = serde_json::from_str(&input)
            .map_err(|e| Error::store(format!("run {:?} has a corrupt input: {e}", run.run_id)))?;
        run.lease_owner = Some(request.worker_id.clone());
        run.lease_expires_at_ms = Some(expires);
        run.recoveries += u32::from(had_lease);
        run.updated_at_ms = now_ms;
        if run.queue.is_some() && run.admitted_at_ms.is_none() {
            run.admitted_at_ms = Some(now_ms);
        }
        let journal = journals.remove(&run.run_id).unwrap_or_default();
        let events = events.remove(&run.run_id).unwrap_or_default();
        claimed.push(ClaimedRun { run, lease_token: token, journal, events, recovered: had_lease });
    }
    Ok(claimed)
}

/// Lock runs `$1` in run id order (every transaction that locks several runs does it this way).
const LOCK_RUNS_SQL: &str = "SELECT run_id FROM {s}.runs WHERE run_id = ANY($1) ORDER BY run_id FOR UPDATE";

/// Extend the leases `$1`/`$2` (run ids and tokens) of worker `$3` that are still live at `$5`,
/// to `$4`.
const HEARTBEAT_SQL: &str = "UPDATE {s}.runs r SET lease_expires_at_ms = $4
 FROM unnest($1::text[], $2::text[]) AS h(run_id, token)
 WHERE r.run_id = h.run_id AND r.lease_owner = $3 AND r.lease_token = h.token AND r.lease_expires_at_ms > $5
 RETURNING r.run_id, r.lease_token, r.cancel_requested";

impl WorkflowStore for PgWorkflows {
    type Target = ApplyTransaction;

    /// A closed connection (the server restarted or ended the session) is replaced by a new
    /// one, with the statement caches started over; the schema is opened as [`PgWorkflows::open`]
    /// does. Nothing was lost with the old session: no transaction stays open between calls.
    fn reconnect_if_closed(&mut self) -> Result<()> {
        if !self.apply.client_get_mut().is_closed() {
            return Ok(());
        }
        let receipt_window_ms = self.receipt_window_ms;
        let schema = self.schema().to_string();
        let commit_hook = self.apply.take_commit_hook();
        *self = PgWorkflows::open(&self.conn_str, &schema)?;
        self.receipt_window_ms = receipt_window_ms;
        self.apply.set_commit_hook(commit_hook);
        Ok(())
    }

    fn start_runs(&mut self, requests: &[StartRequest], now_ms: i64) -> Result<Vec<StartOutcome>> {
        validate_starts(requests, now_ms)?;
        let schema = self.apply.schema().to_string();
        let st = self.statements.get_mut();
        let (mut tx, gate) = self.apply.write_transaction()?;
        let outcomes = start_in(&mut tx, st, requests, now_ms)?;
        if outcomes.iter().any(|o| matches!(o, StartOutcome::Started { .. })) {
            // A wake-up hint for listening workers (`DueRunListener`); polling stays the truth.
            crate::listen::notify(&mut tx, &schema)?;
        }
        crash::hit("workflow.start.before_commit");
        gate.commit(tx)?;
        Ok(outcomes)
    }

    fn claim(&mut self, request: &ClaimRequest, now_ms: i64) -> Result<Vec<ClaimedRun>> {
        validate_claim(request)?;
        let schema = self.apply.schema().to_string();
        let st = self.statements.get_mut();
        let (mut tx, gate) = self.apply.write_transaction()?;
        let claimed = claim_in(&mut tx, st, &schema, request, now_ms)?;
        gate.commit(tx)?;
        crash::hit("workflow.claim.after_commit");
        Ok(claimed)
    }

    /// Both in one transaction: one commit for the start and the claim.
    fn start_and_claim(
        &mut self,
        requests: &[StartRequest],
        claim: &ClaimRequest,
        now_ms: i64,
    ) -> Result<(Vec<StartOutcome>, Result<Vec<ClaimedRun>>)> {
        validate_starts(requests, now_ms)?;
        validate_claim(claim)?;
        let schema = self.apply.schema().to_string();
        let st = self.statements.get_mut();
        let (mut tx, gate) = self.apply.write_transaction()?;
        let outcomes = start_in(&mut tx, st, requests, now_ms)?;
        let claimed = claim_in(&mut tx, st, &schema, claim, now_ms)?;
        crash::hit("workflow.start.before_commit");
        gate.commit(tx)?;
        crash::hit("workflow.claim.after_commit");
        Ok((outcomes, Ok(claimed)))
    }

    fn heartbeat(
        &mut self,
        worker_id: &str,
        leases: &[(String, String)],
        lease_ms: i64,
        now_ms: i64,
    ) -> Result<Vec<LeaseState>> {
        validate_id("worker_id", worker_id)?;
        if leases.len() > CLAIM_BATCH_MAX {
            return Err(Error::invalid(
                codes::LIMIT_EXCEEDED,
                format!("at most {CLAIM_BATCH_MAX} leases per heartbeat"),
            ));
        }
        for (run_id, token) in leases {
            validate_id("run_id", run_id)?;
            validate_id("lease_token", token)?;
        }
        if !(LEASE_MS_MIN..=LEASE_MS_MAX).contains(&lease_ms) {
            return Err(invalid_arg(format!("lease_ms must be {LEASE_MS_MIN}..={LEASE_MS_MAX}")));
        }
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        let st = self.statements.get_mut();
        let (mut tx, gate) = self.apply.write_transaction()?;
        let run_ids: Vec<&str> = leases.iter().map(|(run_id, _)| run_id.as_str()).collect();
        let tokens: Vec<&str> = leases.iter().map(|(_, token)| token.as_str()).collect();
        let lock_runs = st.get(&mut tx, LOCK_RUNS_SQL)?;
        tx.query(&lock_runs, &[&run_ids]).db()?;
        let extend = st.get(&mut tx, HEARTBEAT_SQL)?;
        let mut held: HashMap<(String, String), bool> = HashMap::new();
        for row in tx.query(&extend, &[&run_ids, &tokens, &worker_id, &(now_ms + lease_ms), &now_ms]).db()? {
            held.insert((col(&row, 0)?, col(&row, 1)?), col(&row, 2)?);
        }
        gate.commit(tx)?;
        Ok(leases
            .iter()
            .map(|lease| match held.get(lease) {
                Some(cancel_requested) => LeaseState::Held { cancel_requested: *cancel_requested },
                None => LeaseState::Lost,
            })
            .collect())
    }

    fn commit(&mut self, writes: Vec<JournalWrite<ApplyTransaction>>, now_ms: i64) -> Result<Vec<WriteResult>> {
        commit::commit(&self.apply, self.statements.get_mut(), writes, now_ms)
    }

    fn send_event(&mut self, run_id: &str, event_id: &str, name: &str, payload: &Value, now_ms: i64) -> Result<bool> {
        validate_event(run_id, event_id, name, payload)?;
        let schema = self.apply.schema().to_string();
        let st = self.statements.get_mut();
        let (mut tx, gate) = self.apply.write_transaction()?;
        let added = send_event_validated(&mut tx, st, run_id, event_id, name, payload, now_ms)?;
        if added {
            // The run may be due now: a hint for listening workers.
            crate::listen::notify(&mut tx, &schema)?;
        }
        gate.commit(tx)?;
        Ok(added)
    }

    fn run_page(&self, run_id: &str, page: &DetailPage) -> Result<Option<RunDetail>> {
        page.validate(run_id)?;
        let (mut client, mut st) = self.reader();
        let mut tx = client
            .build_transaction()
            .isolation_level(postgres::IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .db()?;
        let Some(run) = rows::load_run(&mut tx, &mut st, run_id)? else {
            tx.commit().db()?;
            return Ok(None);
        };
        // Positions are below RUN_STEPS_MAX (validated), so they fit the columns' integer.
        let after = page.after_seq.map_or(-1, |seq| seq as i32);
        let mut journal = rows::journal_page(&mut tx, &mut st, run_id, after, page.limit + 1)?;
        let next_after_seq = cut_journal_page(&mut journal, page.limit);
        let last = journal.last().map_or(after, |entry| entry.seq as i32);
        let mut detail = RunDetail {
            run,
            journal,
            attempts: rows::attempts(&mut tx, &mut st, run_id, after, last)?,
            events: rows::consumed_events(&mut tx, &mut st, run_id, after, last)?,
            next_after_seq,
            next_events_after: None,
        };
        if next_after_seq.is_none() {
            let after = page.events_after.as_ref();
            detail.add_unconsumed(rows::unconsumed_page(&mut tx, &mut st, run_id, after, page.limit + 1)?, page);
        }
        tx.commit().db()?;
        Ok(Some(detail))
    }

    fn published(&self, run_id: &str, key: &str) -> Result<Option<PublishedValue>> {
        validate_id("run_id", run_id)?;
        validate_id("event key", key)?;
        let (mut client, mut st) = self.reader();
        let statement = st.get(
            &mut *client,
            "SELECT value, seq, updated_at_ms FROM {s}.run_published WHERE run_id = $1 AND key = $2",
        )?;
        let Some(row) = client.query_opt(&statement, &[&run_id, &key]).db()? else { return Ok(None) };
        let text: String = col(&row, 0)?;
        let value = serde_json::from_str(&text)
            .map_err(|e| Error::store(format!("run {run_id:?} published a corrupt value: {e}")))?;
        Ok(Some(PublishedValue {
            run_id: run_id.to_string(),
            key: key.to_string(),
            value,
            seq: crate::col_u32(&row, 1)?,
            updated_at_ms: col(&row, 2)?,
        }))
    }

    fn list_runs(&self, filter: &RunFilter, limit: usize) -> Result<Vec<RunRecord>> {
        validate_limit("page size", limit, PAGE_SIZE_MAX)?;
        if let Some(workflow) = &filter.workflow {
            validate_id("workflow", workflow)?;
        }
        if let Some((_, run_id)) = &filter.after {
            validate_id("after run_id", run_id)?;
        }
        let (text, args) = list_sql(filter, limit);
        let params: Vec<&(dyn ToSql + Sync)> = args.iter().map(|a| a.as_ref()).collect();
        let (mut client, _) = self.reader();
        let rows = client.query(&sql(self.apply.schema(), &text), &params).db()?;
        rows.iter().map(rows::run_record).collect()
    }

    fn cancel(&mut self, run_id: &str, reason: &str, now_ms: i64) -> Result<RunRecord> {
        operator::cancel(&mut self.apply, self.statements.get_mut(), run_id, reason, now_ms)
    }

    fn retry(&mut self, run_id: &str, reason: &str, now_ms: i64) -> Result<RunRecord> {
        operator::retry(&mut self.apply, self.statements.get_mut(), run_id, reason, now_ms)
    }

    fn fork(&mut self, run_id: &str, from_seq: u32, new_run_id: &str, now_ms: i64) -> Result<RunRecord> {
        operator::fork(&mut self.apply, self.statements.get_mut(), run_id, from_seq, new_run_id, now_ms)
    }

    fn skip_step(&mut self, run_id: &str, seq: u32, output: &Value, reason: &str, now_ms: i64) -> Result<RunRecord> {
        operator::skip_step(&mut self.apply, self.statements.get_mut(), run_id, seq, output, reason, now_ms)
    }

    fn abandon(&mut self, run_id: &str, reason: &str, now_ms: i64) -> Result<RunRecord> {
        operator::abandon(&mut self.apply, self.statements.get_mut(), run_id, reason, now_ms)
    }

    fn purge(&mut self, finished_before_ms: i64, batch_rows: usize, now_ms: i64) -> Result<PurgeReport> {
        let window = self.receipt_window_ms;
        operator::purge(&mut self.apply, self.statements.get_mut(), finished_before_ms, batch_rows, window, now_ms)
    }

    fn unclaimable(&self, known: &[WorkflowVersion]) -> Result<Vec<UnclaimableRuns>> {
        let (mut client, mut st) = self.reader();
        let statement = st.get(
            &mut *client,
            "SELECT workflow, version, count(*) FROM {s}.runs
             WHERE status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating')
             GROUP BY workflow, version ORDER BY workflow, version",
        )?;
        let mut all = Vec::new();
        for row in client.query(&statement, &[]).db()? {
            let runs: i64 = col(&row, 2)?;
            all.push(UnclaimableRuns {
                workflow: col(&row, 0)?,
                version: rows::col_u32_wide(&row, 1)?,
                runs: runs.max(0) as u64,
            });
        }
        Ok(all
            .into_iter()
            .filter(|u| !known.iter().any(|k| k.workflow == u.workflow && k.version == u.version))
            .collect())
    }
}
