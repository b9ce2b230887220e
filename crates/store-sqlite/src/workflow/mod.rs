//! The SQLite [`WorkflowStore`]: runs, their journal, step attempts, events and idempotency
//! receipts (schema v3, see `schema.rs` for every column's reason), for the durable workflow
//! runtime (`docs/workflows.md`).
//!
//! **Opening.** [`SqliteWorkflows::init`] creates (or reopens) a file and
//! [`SqliteWorkflows::open`] opens an existing one, the rule of every store. The workflow
//! tables come with the schema (migration v3), so any tidemark file is a workflow database and
//! there is no identity to set. The same file may be a producer database
//! ([`crate::SqliteProducer::init`]): a transactional step's body then writes business rows and
//! outbox events ([`crate::advance_committed_in`]) in the journal's transaction.
//!
//! **Transactions.** Every method that writes is one `BEGIN IMMEDIATE` transaction. Input is
//! validated before the transaction begins: bad input is `Error::Invalid` with a stable code and
//! nothing is written. State errors found inside (`not_found`, `invalid_state_change`,
//! `already_exists`) roll the transaction back too.
//!
//! **Decisions the trait leaves open** (the runtime relies on them):
//! - `claim` leaves the status as it is; the runtime sets `running` (or `compensating`) with
//!   `SetStatus`. A claimable run may therefore be `running` without a lease (its worker released
//!   it or died).
//! - The lease token is the fence of `commit`: a write whose token matches is applied even when
//!   the lease has expired, as long as nobody re-claimed the run (a claim, a release, a finish and
//!   every operator change replace or clear the token). `heartbeat` is stricter: it extends only
//!   unexpired leases, so a worker that sees `Lost` must stop.
//! - `cancel` does not take the lease away: the holder learns of the request from its heartbeat
//!   and acts on it. `retry`, `skip_step` and `abandon` clear the lease (the holder is fenced).
//! - A `Suspend` into `waiting` when an unconsumed event of that name is already there, or of a
//!   run with a cancel request, keeps the run due now (no lost wake-up).
//! - Failed attempts: a failure that is not retryable, or has no `retry_at_ms`, fails the step
//!   for good (`failed`); otherwise it is `retrying` until `retry_at_ms`.
//! - Purged runs leave a receipt for [`SqliteWorkflows::receipt_window_ms`] after they finished
//!   (default [`RECEIPT_WINDOW_MS_DEFAULT`], 30 days); an expired receipt no longer counts.

mod commit;
mod import;
mod operator;
mod queues;
mod reads;
mod rows;
mod schedules;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};
use serde_json::Value;
use tidemark_core::crash;
use tidemark_core::error::codes;
use tidemark_core::id::{validate_id, validate_limit};
use tidemark_core::limits::PAGE_SIZE_MAX;
use tidemark_core::workflow::{
    cut_journal_page, validate_json_size, ClaimRequest, ClaimedRun, DetailPage, JournalWrite, LeaseState, PurgeReport,
    RunDetail, RunFilter, RunRecord, RunStatus, StartOutcome, StartRequest, UnclaimableRuns, WorkflowStore,
    WorkflowVersion, WriteResult, CLAIM_BATCH_MAX, ERROR_BYTES_MAX, LEASE_MS_MAX, LEASE_MS_MIN, RUN_EVENTS_HELD_MAX,
    WORKFLOW_INPUT_BYTES_MAX,
};
use tidemark_core::{Error, Result};

use crate::schema::{self, Durability};
use crate::SqlResult;
use rows::{active, run_status_at, RUN_COLUMNS};

/// How long a purged run's idempotency receipt is kept, counted from when the run finished.
pub const RECEIPT_WINDOW_MS_DEFAULT: i64 = 30 * 24 * 60 * 60 * 1000;

/// The workflow store on one SQLite file.
pub struct SqliteWorkflows {
    conn: Connection,
    receipt_window_ms: i64,
}

impl SqliteWorkflows {
    /// Create (or reopen, never resetting) a workflow database, fsyncing every commit. The
    /// rule of every store: `init` creates, `open` only opens.
    pub fn init(path: &Path) -> Result<SqliteWorkflows> {
        Self::init_with(path, Durability::Full)
    }

    /// [`SqliteWorkflows::init`] with a durability.
    pub fn init_with(path: &Path, durability: Durability) -> Result<SqliteWorkflows> {
        let conn = schema::open(path, true, durability)?;
        Ok(SqliteWorkflows { conn, receipt_window_ms: RECEIPT_WINDOW_MS_DEFAULT })
    }

    /// Open an existing workflow database (`not_initialized` when the file does not exist; it
    /// is never created here), fsyncing every commit.
    pub fn open(path: &Path) -> Result<SqliteWorkflows> {
        Self::open_with(path, Durability::Full)
    }

    /// [`SqliteWorkflows::open`] with a durability.
    pub fn open_with(path: &Path, durability: Durability) -> Result<SqliteWorkflows> {
        let conn = schema::open(path, false, durability)?;
        Ok(SqliteWorkflows { conn, receipt_window_ms: RECEIPT_WINDOW_MS_DEFAULT })
    }

    /// Keep purged runs' receipts this long after they finished (must be > 0).
    pub fn with_receipt_window_ms(mut self, receipt_window_ms: i64) -> Result<SqliteWorkflows> {
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

    /// The connection, for the caller's own tables and reads.
    pub fn connection(&mut self) -> &mut Connection {
        &mut self.conn
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

/// Deliver an event to a run inside a transaction the caller opened on the workflow database
/// (for example an inbox handler's transaction on a consumer database that also holds the
/// workflows). Same rules as [`WorkflowStore::send_event`].
pub fn send_event_in(
    tx: &Connection,
    run_id: &str,
    event_id: &str,
    name: &str,
    payload: &Value,
    now_ms: i64,
) -> Result<bool> {
    if tx.is_autocommit() {
        return Err(invalid_arg("send_event_in needs an open transaction"));
    }
    validate_event(run_id, event_id, name, payload)?;
    send_event_validated(tx, run_id, event_id, name, payload, now_ms)
}

/// A message of one run to another (`JournalOp::Send`), in the sender's journal transaction:
/// the receiver must exist and be active; the event id is the store's own (`msg/...`).
pub(super) fn send_event_checked(
    tx: &Connection,
    run_id: &str,
    event_id: &str,
    name: &str,
    payload: &Value,
    now_ms: i64,
) -> Result<bool> {
    validate_id("run_id", run_id)?;
    validate_id("event name", name)?;
    send_event_validated(tx, run_id, event_id, name, payload, now_ms)
}

fn validate_event(run_id: &str, event_id: &str, name: &str, payload: &Value) -> Result<()> {
    validate_id("run_id", run_id)?;
    validate_id("event_id", event_id)?;
    validate_id("event name", name)?;
    validate_json_size("event payload", payload, WORKFLOW_INPUT_BYTES_MAX, codes::PAYLOAD_TOO_LARGE)
}

fn send_event_validated(
    tx: &Connection,
    run_id: &str,
    event_id: &str,
    name: &str,
    payload: &Value,
    now_ms: i64,
) -> Result<bool> {
    let run = rows::existing_run(tx, run_id)?;
    if let Some(existing) = rows::event(tx, run_id, event_id)? {
        if existing.name == name && &existing.payload == payload {
            return Ok(false);
        }
        return Err(Error::invalid(
            codes::ALREADY_EXISTS,
            format!("event {event_id:?} of run {run_id:?} was already sent with another name or payload"),
        ));
    }
    if run.status.is_terminal() {
        return Err(Error::invalid(
            codes::INVALID_STATE_CHANGE,
            format!("run {run_id:?} is {}; it takes no more events", run.status.as_str()),
        ));
    }
    let held: i64 = tx
        .prepare_cached(rows::EVENTS_HELD_SQL)
        .db()?
        .query_row(params![run_id, RUN_EVENTS_HELD_MAX as i64], |r| r.get(0))
        .db()?;
    tidemark_core::workflow::events_held_check(run_id, held as usize)?;
    tx.prepare_cached(
        "INSERT INTO run_events (run_id, event_id, name, payload, received_at_ms, consumed_by_seq)
         VALUES (?1, ?2, ?3, ?4, ?5, NULL)",
    )
    .db()?
    .execute(params![run_id, event_id, name, rows::json_text(payload), now_ms])
    .db()?;
    // A run waiting for this name is due now (the worker that claims it consumes the event).
    tx.prepare_cached(
        "UPDATE runs SET wake_at_ms = min(wake_at_ms, ?3), updated_at_ms = ?3
         WHERE run_id = ?1 AND status = 'waiting' AND waiting_for = ?2",
    )
    .db()?
    .execute(params![run_id, name, now_ms])
    .db()?;
    Ok(true)
}

/// Due, unleased (or lease expired) runs of one (workflow, version), oldest due first. A keyed
/// run qualifies only as the oldest active run of its key while no other run of the key holds a
/// live lease. Parameters: workflow, version, now_ms, limit.
fn claim_candidates_sql() -> String {
    let (r_active, o_active) = (active("r.status"), active("o.status"));
    format!(
        "SELECT {RUN_COLUMNS}, r.lease_token IS NOT NULL
                     FROM runs r
                     WHERE r.workflow = ?1 AND r.version = ?2 AND {r_active} AND r.wake_at_ms <= ?3
                       AND (r.lease_token IS NULL OR r.lease_expires_at_ms <= ?3)
                       AND (r.queue IS NULL OR r.admitted_at_ms IS NOT NULL)
                       AND (r.key IS NULL OR (
                             NOT EXISTS (SELECT 1 FROM runs o WHERE o.key = r.key AND {o_active}
                                           AND (o.created_at_ms < r.created_at_ms
                                                OR (o.created_at_ms = r.created_at_ms AND o.run_id < r.run_id)))
                         AND NOT EXISTS (SELECT 1 FROM runs o WHERE o.key = r.key AND {o_active}
                                           AND o.run_id <> r.run_id AND o.lease_token IS NOT NULL
                                           AND o.lease_expires_at_ms > ?3)))
                     ORDER BY r.wake_at_ms, r.created_at_ms, r.run_id
                     LIMIT ?4"
    )
}

/// Runs of a workflow type holding a live lease (parameters: workflow, now_ms). Pinned to
/// `runs_due`, which holds only active runs: without statistics the planner may take
/// `runs_workflow` (every run the type ever had) as an equal choice, and did once `runs` was
/// rebuilt (schema v10).
fn leased_count_sql() -> String {
    let active = active("status");
    format!(
        "SELECT count(*) FROM runs INDEXED BY runs_due WHERE workflow = ?1 AND {active}
           AND lease_token IS NOT NULL AND lease_expires_at_ms > ?2"
    )
}

/// The listing query of a filter and its parameters.
fn list_sql(filter: &RunFilter, limit: usize) -> (String, Vec<rusqlite::types::Value>) {
    let mut sql = format!("SELECT {RUN_COLUMNS} FROM runs WHERE 1 = 1");
    let mut args: Vec<rusqlite::types::Value> = Vec::new();
    let mut arg = |sql: &mut String, clause: &str, value: rusqlite::types::Value| {
        args.push(value);
        sql.push_str(&clause.replace('?', &format!("?{}", args.len())));
    };
    if let Some(status) = filter.status {
        arg(&mut sql, " AND status = ?", status.as_str().to_string().into());
    }
    if let Some(workflow) = &filter.workflow {
        arg(&mut sql, " AND workflow = ?", workflow.clone().into());
    }
    if let Some(after) = filter.created_after_ms {
        arg(&mut sql, " AND created_at_ms > ?", after.into());
    }
    if let Some(before) = filter.created_before_ms {
        arg(&mut sql, " AND created_at_ms < ?", before.into());
    }
    if let Some((created, run_id)) = &filter.after {
        arg(&mut sql, " AND (created_at_ms, run_id) > (?", (*created).into());
        arg(&mut sql, ", ?)", run_id.clone().into());
    }
    arg(&mut sql, " ORDER BY created_at_ms, run_id LIMIT ?", (limit as i64).into());
    (sql, args)
}

/// One candidate of a claim: its row as read (the input still JSON text, parsed only when the
/// run is claimed).
struct Candidate {
    run: RunRecord,
    input: String,
    had_lease: bool,
}

pub(super) use tidemark_core::workflow::validate_starts;

/// Start validated requests in the caller's transaction.
/// What a child's start writes into its row at once (no update after the insert): its parent,
/// and, when it is leased to the starting worker, the lease (owner, token, expiry).
pub(super) struct ChildRow<'a> {
    pub parent_run_id: &'a str,
    pub parent_seq: u32,
    pub lease: Option<(&'a str, &'a str, i64)>,
}

pub(super) fn start_in(tx: &Connection, requests: &[StartRequest], now_ms: i64) -> Result<Vec<StartOutcome>> {
    start_rows_in(tx, requests, now_ms, None)
}

/// [`start_in`], with `child` written into the row of each run it creates.
pub(super) fn start_rows_in(
    tx: &Connection,
    requests: &[StartRequest],
    now_ms: i64,
    child: Option<&ChildRow<'_>>,
) -> Result<Vec<StartOutcome>> {
    let mut outcomes = Vec::with_capacity(requests.len());
    for request in requests {
        let hash = request.input_hash();
        let existing: Option<(String, String, RunStatus)> = tx
            .prepare_cached("SELECT workflow, input_hash, status FROM runs WHERE run_id = ?1")
            .db()?
            .query_row([&request.run_id], |r| Ok((r.get(0)?, r.get(1)?, run_status_at(r, 2)?)))
            .optional()
            .db()?;
        // A removed run's receipt keeps its id taken while it lives; one read, and a delete
        // only when an expired one is there (no statement for the receipt a new id never had).
        let mut expired_receipt = false;
        let earlier = match existing {
            Some(existing) => Some(existing),
            None => match rows::receipt(tx, &request.run_id)? {
                Some(receipt) if receipt.live(now_ms) => Some((receipt.workflow, receipt.input_hash, receipt.status)),
                Some(_) => {
                    expired_receipt = true;
                    None
                }
                None => None,
            },
        };
        if let Some((workflow, input_hash, status)) = earlier {
            outcomes.push(if workflow == request.workflow && input_hash == hash {
                StartOutcome::Existing { run_id: request.run_id.clone(), status }
            } else {
                StartOutcome::Conflict {
                    run_id: request.run_id.clone(),
                    reason: if workflow != request.workflow {
                        format!("run {:?} is a run of workflow {workflow:?}", request.run_id)
                    } else {
                        format!("run {:?} was started with another input", request.run_id)
                    },
                }
            });
            continue;
        }
        if let Some(enqueue) = &request.queue {
            queues::check_enqueue(tx, enqueue)?;
        }
        // An expired receipt no longer counts: the id may be used again.
        if expired_receipt {
            tx.prepare_cached("DELETE FROM run_receipts WHERE run_id = ?1").db()?.execute([&request.run_id]).db()?;
        }
        let enqueue = request.queue.as_ref();
        tx.prepare_cached(
            "INSERT INTO runs (run_id, workflow, version, input, input_hash, key, status, wake_at_ms,
                               created_at_ms, updated_at_ms, queue, priority, dedup_id, deadline_ms,
                               parent_run_id, parent_seq, lease_owner, lease_token, lease_expires_at_ms)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'pending', ?7, ?8, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17)",
        )
        .db()?
        .execute(params![
            request.run_id,
            request.workflow,
            request.version,
            rows::json_text(&request.input),
            hash,
            request.key,
            request.start_at_ms.unwrap_or(now_ms),
            now_ms,
            enqueue.map(|e| e.queue.as_str()),
            enqueue.map(|e| e.priority),
            enqueue.and_then(|e| e.dedup_id.as_deref()),
            request.deadline_ms,
            child.map(|c| c.parent_run_id),
            child.map(|c| c.parent_seq),
            child.and_then(|c| c.lease.map(|(owner, _, _)| owner)),
            child.and_then(|c| c.lease.map(|(_, token, _)| token)),
            child.and_then(|c| c.lease.map(|(_, _, expires)| expires)),
        ])
        .db()?;
        outcomes.push(StartOutcome::Started { run_id: request.run_id.clone() });
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

/// Claim for a validated request in the caller's transaction.
fn claim_in(tx: &Connection, request: &ClaimRequest, now_ms: i64) -> Result<Vec<ClaimedRun>> {
    // The per-type limit of a workflow is the smallest one given for any of its versions.
    let mut type_max: BTreeMap<&str, Option<u32>> = BTreeMap::new();
    for w in &request.workflows {
        let entry = type_max.entry(w.workflow.as_str()).or_insert(w.concurrency_max);
        *entry = match (*entry, w.concurrency_max) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
    // Slots left per workflow type (runs of it leased right now count, on any worker).
    let mut slots: HashMap<&str, usize> = HashMap::new();
    for (workflow, max) in &type_max {
        let free = match max {
            None => request.limit,
            Some(max) => {
                let leased: i64 = tx
                    .prepare_cached(&leased_count_sql())
                    .db()?
                    .query_row(params![workflow, now_ms], |r| r.get(0))
                    .db()?;
                (*max as usize).saturating_sub(leased as usize).min(request.limit)
            }
        };
        slots.insert(workflow, free);
    }
    // Due, unleased (or lease expired) runs of each (workflow, version), oldest due first. A
    // keyed run qualifies only as the oldest active run of its key while no other run of the
    // key holds a live lease.
    let mut candidates = Vec::new();
    {
        let mut stmt = tx.prepare_cached(&claim_candidates_sql()).db()?;
        let mut seen = std::collections::HashSet::new();
        for w in &request.workflows {
            let free = slots[w.workflow.as_str()];
            if free == 0 || !seen.insert((w.workflow.as_str(), w.version)) {
                continue;
            }
            let found = stmt
                .query_map(params![w.workflow, w.version, now_ms, free as i64], |r| {
                    Ok(Candidate { run: rows::run_record_without_input(r)?, input: r.get(3)?, had_lease: r.get(22)? })
                })
                .db()?;
            for candidate in found {
                candidates.push(candidate.db()?);
            }
        }
    }
    // Runs waiting in queues, admitted (in this transaction, with their lease) while their queue
    // has room: by priority, then oldest first.
    for (run, input) in queues::admissible(tx, &request.workflows, &slots, now_ms)? {
        candidates.push(Candidate { run, input, had_lease: false });
    }
    candidates.sort_by(|a, b| {
        (a.run.wake_at_ms, a.run.created_at_ms, &a.run.run_id).cmp(&(
            b.run.wake_at_ms,
            b.run.created_at_ms,
            &b.run.run_id,
        ))
    });
    let expires = now_ms + request.lease_ms;
    let mut claimed = Vec::new();
    // Each statement is taken from the cache once for the whole claim.
    let mut lease = tx
        .prepare_cached(
            "UPDATE runs SET lease_owner = ?2, lease_token = ?3, lease_expires_at_ms = ?4,
                 recoveries = recoveries + ?5, updated_at_ms = ?6
             WHERE run_id = ?1",
        )
        .db()?;
    let mut admit = tx.prepare_cached("UPDATE runs SET admitted_at_ms = ?2 WHERE run_id = ?1").db()?;
    let mut journal = rows::journal_statement(tx)?;
    let mut events = rows::unconsumed_statement(tx)?;
    for candidate in candidates {
        if claimed.len() == request.limit {
            break;
        }
        let free = slots.get_mut(candidate.run.workflow.as_str()).expect("slots of every requested workflow");
        if *free == 0 {
            continue;
        }
        *free -= 1;
        let Candidate { mut run, input, had_lease } = candidate;
        let token = new_token();
        let changed = lease.execute(params![run.run_id, request.worker_id, token, expires, had_lease, now_ms]).db()?;
        if run.queue.is_some() && run.admitted_at_ms.is_none() {
            admit.execute(params![run.run_id, now_ms]).db()?;
            run.admitted_at_ms = Some(now_ms);
        }
        tidemark_core::ensure_invariant!(changed == 1, "claiming {} changed {changed} rows", run.run_id);
        // The row as the candidate query read it, with what this UPDATE changed (the same
        // transaction: nothing else can have written it in between). Not UPDATE ... RETURNING:
        // SQLite buffers returned rows in a temporary B-tree.
        run.input = serde_json::from_str(&input)
            .map_err(|e| Error::store(format!("run {:?} has a corrupt input: {e}", run.run_id)))?;
        run.lease_owner = Some(request.worker_id.clone());
        run.lease_expires_at_ms = Some(expires);
        run.recoveries += u32::from(had_lease);
        run.updated_at_ms = now_ms;
        let journal = rows::journal_with(&mut journal, &run.run_id)?;
        let events = rows::unconsumed_with(&mut events, &run.run_id)?;
        claimed.push(ClaimedRun { run, lease_token: token, journal, events, recovered: had_lease });
    }
    Ok(claimed)
}

impl WorkflowStore for SqliteWorkflows {
    type Target = Connection;

    fn start_runs(&mut self, requests: &[StartRequest], now_ms: i64) -> Result<Vec<StartOutcome>> {
        validate_starts(requests, now_ms)?;
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        let outcomes = start_in(&tx, requests, now_ms)?;
        crash::hit("workflow.start.before_commit");
        tx.commit().db()?;
        Ok(outcomes)
    }

    fn claim(&mut self, request: &ClaimRequest, now_ms: i64) -> Result<Vec<ClaimedRun>> {
        validate_claim(request)?;
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        let claimed = claim_in(&tx, request, now_ms)?;
        tx.commit().db()?;
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
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        let outcomes = start_in(&tx, requests, now_ms)?;
        let claimed = claim_in(&tx, claim, now_ms)?;
        crash::hit("workflow.start.before_commit");
        tx.commit().db()?;
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
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        let mut states = Vec::with_capacity(leases.len());
        {
            let mut extend = tx
                .prepare_cached(
                    "UPDATE runs SET lease_expires_at_ms = ?4
                     WHERE run_id = ?1 AND lease_owner = ?2 AND lease_token = ?3 AND lease_expires_at_ms > ?5
                     RETURNING cancel_requested",
                )
                .db()?;
            for (run_id, token) in leases {
                let mut found = extend.query(params![run_id, worker_id, token, now_ms + lease_ms, now_ms]).db()?;
                states.push(match found.next().db()? {
                    Some(r) => LeaseState::Held { cancel_requested: r.get(0).db()? },
                    None => LeaseState::Lost,
                });
            }
        }
        tx.commit().db()?;
        Ok(states)
    }

    fn commit(&mut self, writes: Vec<JournalWrite<Connection>>, now_ms: i64) -> Result<Vec<WriteResult>> {
        commit::commit(&mut self.conn, writes, now_ms)
    }

    fn send_event(&mut self, run_id: &str, event_id: &str, name: &str, payload: &Value, now_ms: i64) -> Result<bool> {
        validate_event(run_id, event_id, name, payload)?;
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        let added = send_event_validated(&tx, run_id, event_id, name, payload, now_ms)?;
        tx.commit().db()?;
        Ok(added)
    }

    fn run_page(&self, run_id: &str, page: &DetailPage) -> Result<Option<RunDetail>> {
        page.validate(run_id)?;
        let tx = self.conn.unchecked_transaction().db()?;
        let Some(run) = rows::load_run(&tx, run_id)? else {
            return Ok(None);
        };
        let after = page.after_seq.map_or(-1, i64::from);
        let mut journal = rows::journal_page(&tx, run_id, after, page.limit + 1)?;
        let next_after_seq = cut_journal_page(&mut journal, page.limit);
        let last = journal.last().map_or(after, |entry| i64::from(entry.seq));
        let mut detail = RunDetail {
            run,
            journal,
            attempts: rows::attempts(&tx, run_id, after, last)?,
            events: rows::consumed_events(&tx, run_id, after, last)?,
            next_after_seq,
            next_events_after: None,
        };
        if next_after_seq.is_none() {
            detail.add_unconsumed(
                rows::unconsumed_events(&tx, run_id, page.events_after.as_ref(), page.limit + 1)?,
                page,
            );
        }
        tx.finish().db()?;
        Ok(Some(detail))
    }

    fn published(&self, run_id: &str, key: &str) -> Result<Option<tidemark_core::workflow::PublishedValue>> {
        validate_id("run_id", run_id)?;
        validate_id("event key", key)?;
        self.conn
            .prepare_cached("SELECT value, seq, updated_at_ms FROM run_published WHERE run_id = ?1 AND key = ?2")
            .db()?
            .query_row([run_id, key], |r| Ok((r.get::<_, String>(0)?, r.get::<_, u32>(1)?, r.get::<_, i64>(2)?)))
            .optional()
            .db()?
            .map(|(text, seq, updated_at_ms)| {
                let value = serde_json::from_str(&text)
                    .map_err(|e| Error::store(format!("run {run_id:?} published a corrupt value: {e}")))?;
                Ok(tidemark_core::workflow::PublishedValue {
                    run_id: run_id.to_string(),
                    key: key.to_string(),
                    value,
                    seq,
                    updated_at_ms,
                })
            })
            .transpose()
    }

    fn list_runs(&self, filter: &RunFilter, limit: usize) -> Result<Vec<RunRecord>> {
        validate_limit("page size", limit, PAGE_SIZE_MAX)?;
        if let Some(workflow) = &filter.workflow {
            validate_id("workflow", workflow)?;
        }
        if let Some((_, run_id)) = &filter.after {
            validate_id("after run_id", run_id)?;
        }
        let (sql, args) = list_sql(filter, limit);
        let mut stmt = self.conn.prepare_cached(&sql).db()?;
        let rows = stmt.query_map(rusqlite::params_from_iter(args), rows::run_record).db()?;
        rows.collect::<rusqlite::Result<Vec<_>>>().db()
    }

    fn cancel(&mut self, run_id: &str, reason: &str, now_ms: i64) -> Result<RunRecord> {
        operator::cancel(&mut self.conn, run_id, reason, now_ms)
    }

    fn retry(&mut self, run_id: &str, reason: &str, now_ms: i64) -> Result<RunRecord> {
        operator::retry(&mut self.conn, run_id, reason, now_ms)
    }

    fn fork(&mut self, run_id: &str, from_seq: u32, new_run_id: &str, now_ms: i64) -> Result<RunRecord> {
        operator::fork(&mut self.conn, run_id, from_seq, new_run_id, now_ms)
    }

    fn skip_step(&mut self, run_id: &str, seq: u32, output: &Value, reason: &str, now_ms: i64) -> Result<RunRecord> {
        operator::skip_step(&mut self.conn, run_id, seq, output, reason, now_ms)
    }

    fn abandon(&mut self, run_id: &str, reason: &str, now_ms: i64) -> Result<RunRecord> {
        operator::abandon(&mut self.conn, run_id, reason, now_ms)
    }

    fn purge(&mut self, finished_before_ms: i64, batch_rows: usize, now_ms: i64) -> Result<PurgeReport> {
        operator::purge(&mut self.conn, finished_before_ms, batch_rows, self.receipt_window_ms, now_ms)
    }

    fn unclaimable(&self, known: &[WorkflowVersion]) -> Result<Vec<UnclaimableRuns>> {
        let active = active("status");
        let mut stmt = self
            .conn
            .prepare_cached(&format!(
                "SELECT workflow, version, count(*) FROM runs WHERE {active}
                 GROUP BY workflow, version ORDER BY workflow, version"
            ))
            .db()?;
        let rows = stmt
            .query_map([], |r| Ok(UnclaimableRuns { workflow: r.get(0)?, version: r.get(1)?, runs: r.get(2)? }))
            .db()?;
        let all = rows.collect::<rusqlite::Result<Vec<_>>>().db()?;
        Ok(all
            .into_iter()
            .filter(|u| !known.iter().any(|k| k.workflow == u.workflow && k.version == u.version))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The query plan of `sql` (parameters unbound), one step per line.
    fn plan(conn: &Connection, sql: &str) -> String {
        let mut stmt = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
        let mut rows = stmt.raw_query();
        let mut steps = Vec::new();
        while let Some(row) = rows.next().unwrap() {
            steps.push(row.get::<_, String>(3).unwrap());
        }
        steps.join("\n")
    }

    fn assert_uses(plan: &str, index: &str) {
        assert!(plan.contains(index), "the plan does not use {index}:\n{plan}");
        for step in plan.lines() {
            assert!(!step.starts_with("SCAN") || step.contains("USING"), "the plan scans a table:\n{plan}");
        }
        assert!(!plan.contains("TEMP B-TREE"), "the plan sorts:\n{plan}");
    }

    #[test]
    fn every_workflow_query_uses_its_index() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteWorkflows::init(&dir.path().join("wf.db")).unwrap();
        let conn = &store.conn;
        let claim = plan(conn, &claim_candidates_sql());
        assert_uses(&claim, "INDEX runs_due");
        assert_uses(&claim, "INDEX runs_key");
        assert_uses(&plan(conn, &leased_count_sql()), "INDEX runs_due");
        let by = |filter: RunFilter| plan(conn, &list_sql(&filter, 10).0);
        assert_uses(&by(RunFilter::default()), "INDEX runs_created");
        let after = Some((5, "r".to_string()));
        assert_uses(&by(RunFilter { after: after.clone(), ..RunFilter::default() }), "INDEX runs_created");
        assert_uses(
            &by(RunFilter { status: Some(RunStatus::Failed), after, ..RunFilter::default() }),
            "INDEX runs_status",
        );
        assert_uses(&by(RunFilter { workflow: Some("w".into()), ..RunFilter::default() }), "INDEX runs_workflow");
        assert_uses(&plan(conn, operator::PURGE_SELECT_SQL), "INDEX runs_finished");
        assert_uses(&plan(conn, operator::RECEIPTS_EXPIRED_DELETE_SQL), "INDEX run_receipts_expiry");
        assert_uses(&plan(conn, &queues::in_progress_sql()), "INDEX runs_queue_in_progress");
        assert_uses(&plan(conn, queues::ADMITTED_SINCE_SQL), "INDEX runs_queue_admitted");
        assert_uses(&plan(conn, &queues::waiting_sql()), "INDEX runs_queue_waiting");
        for unconsumed in [rows::UNCONSUMED_SQL, rows::UNCONSUMED_PAGE_SQL, commit::EVENT_WAITING_SQL] {
            assert_uses(&plan(conn, unconsumed), "INDEX run_events_unconsumed");
        }
        // The count reads its bounded subquery (a scan of the subquery's rows, not of a table).
        let held = plan(conn, rows::EVENTS_HELD_SQL);
        assert!(held.contains("SEARCH run_events USING INDEX run_events_unconsumed"), "{held}");
        assert!(!held.contains("SCAN run_events") && !held.contains("TEMP B-TREE"), "{held}");
    }
}
