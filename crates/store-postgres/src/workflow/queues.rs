//! Queues on PostgreSQL (`QueueStore`, and the admission a claim does): the `queues` table and
//! the queue columns of `runs` (migration v2), with SQLite's semantics (`tidemark_store_sqlite`'s
//! `workflow/queues.rs`): a run started through a queue waits until a claim admits it, in the
//! claim's own transaction, only while the queue has room.
//!
//! A queue's room is one budget for every worker on the schema, like a per-type limit: a claim
//! takes the queue's advisory lock (`LOCK_QUEUE`, queues in name order, after the per-type locks)
//! before it counts the queue's admitted runs, and admits at most the rest before it commits. Only
//! claims admit, so no admission can appear that the count missed; two workers never spend one
//! queue's room twice.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use postgres::{GenericClient, Row};
use tidemark_core::error::codes;
use tidemark_core::id::validate_id;
use tidemark_core::queue::{
    queue_codes, QueueSpec, QueueState, QueueStore, QueuedRun, RateLimit, QUEUES_MAX, QUEUE_WAITING_SHOWN_MAX,
};
use tidemark_core::workflow::{RunRecord, StartRequest, WorkflowVersion};
use tidemark_core::{Error, Result};

use super::{rows, PgWorkflows};
use crate::schema::{lock, Statements, LOCK_QUEUE, LOCK_QUEUES};
use crate::{col, PgResult};

const SPEC_SQL: &str = "SELECT name, concurrency_max, rate_limit, rate_period_ms FROM {s}.queues WHERE name = $1";
const SPECS_SQL: &str =
    "SELECT name, concurrency_max, rate_limit, rate_period_ms FROM {s}.queues ORDER BY name LIMIT $1";

/// Of the queues `$1`, those declared.
const DECLARED_SQL: &str = "SELECT name FROM {s}.queues WHERE name = ANY($1)";

/// Unfinished runs holding one of the deduplication ids `$2` in the queues `$1` (pairs).
const DEDUP_HOLDERS_SQL: &str = "SELECT r.queue, r.dedup_id, r.run_id FROM {s}.runs r
 JOIN unnest($1::text[], $2::text[]) AS d(queue, dedup_id) ON r.queue = d.queue AND r.dedup_id = d.dedup_id
 WHERE r.status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating')";

/// Declared queues that have a run waiting to be admitted (one probe of `runs_queue_waiting`
/// each, not a walk of the waiting runs).
const QUEUES_WAITING_SQL: &str = "SELECT q.name, q.concurrency_max, q.rate_limit, q.rate_period_ms FROM {s}.queues q
 WHERE EXISTS (SELECT 1 FROM {s}.runs r WHERE r.queue = q.name AND r.admitted_at_ms IS NULL
                 AND r.status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating'))
 ORDER BY q.name";

/// Admitted, unfinished runs of queue `$1` (what its concurrency limit counts), by
/// `runs_queue_admitted`.
const IN_PROGRESS_SQL: &str = "SELECT count(*) FROM {s}.runs WHERE queue = $1 AND admitted_at_ms IS NOT NULL
   AND status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating')";

/// Runs of queue `$1` admitted after `$2` (what its rate limit counts), by `runs_queue_admitted`.
const IN_PERIOD_SQL: &str = "SELECT count(*) FROM {s}.runs WHERE queue = $1 AND admitted_at_ms > $2";

/// Waiting runs of queue `$1` a claim may admit at `$2`, of the workflows and versions `$3`/`$4`,
/// in admission order (priority, then oldest), at most `$5`, locked and skipping any row another
/// transaction holds; by `runs_queue_waiting`.
pub(crate) const ADMISSIBLE_SQL: &str = "SELECT r.run_id, r.workflow, r.version, r.input, r.key, r.status,
        r.result, r.error, r.wake_at_ms, r.waiting_for, r.cancel_requested, r.forked_from, r.lease_owner,
        r.lease_expires_at_ms, r.recoveries, r.created_at_ms, r.updated_at_ms, r.parent_run_id, r.queue,
        r.priority, r.admitted_at_ms, r.deadline_ms
 FROM {s}.runs r
 WHERE r.queue = $1 AND r.admitted_at_ms IS NULL
   AND r.status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating')
   AND r.wake_at_ms <= $2 AND (r.lease_token IS NULL OR r.lease_expires_at_ms <= $2)
   AND (r.workflow, r.version) IN (SELECT * FROM unnest($3::text[], $4::bigint[]))
 ORDER BY r.priority, r.created_at_ms, r.run_id
 LIMIT $5
 FOR UPDATE OF r SKIP LOCKED";

const WAITING_COUNT_SQL: &str = "SELECT count(*) FROM {s}.runs WHERE queue = $1 AND admitted_at_ms IS NULL
   AND status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating')";

const WAITING_NEXT_SQL: &str = "SELECT run_id, workflow, priority, created_at_ms FROM {s}.runs
 WHERE queue = $1 AND admitted_at_ms IS NULL AND status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating')
 ORDER BY priority, created_at_ms, run_id LIMIT $2";

fn limit_column(row: &Row, index: usize) -> Result<Option<u32>> {
    let value: Option<i32> = col(row, index)?;
    value.map(|v| u32::try_from(v).map_err(|_| Error::store(format!("queue limit {v} is negative")))).transpose()
}

fn spec_row(row: &Row) -> Result<QueueSpec> {
    let rate = match (limit_column(row, 2)?, col::<Option<i64>>(row, 3)?) {
        (Some(limit), Some(period_ms)) => Some(RateLimit { limit, period_ms }),
        _ => None,
    };
    Ok(QueueSpec { name: col(row, 0)?, concurrency_max: limit_column(row, 1)?, rate })
}

fn load_spec(c: &mut impl GenericClient, st: &mut Statements, name: &str) -> Result<Option<QueueSpec>> {
    let statement = st.get(c, SPEC_SQL)?;
    c.query_opt(&statement, &[&name]).db()?.map(|r| spec_row(&r)).transpose()
}

fn count(
    c: &mut impl GenericClient,
    st: &mut Statements,
    template: &'static str,
    params: &[&(dyn postgres::types::ToSql + Sync)],
) -> Result<u64> {
    let statement = st.get(c, template)?;
    let n: i64 = col(&c.query_one(&statement, params).db()?, 0)?;
    Ok(n.max(0) as u64)
}

/// (admitted and unfinished, admitted in the rate period) of a queue.
fn counts(c: &mut impl GenericClient, st: &mut Statements, spec: &QueueSpec, now_ms: i64) -> Result<(u64, u64)> {
    let in_progress = count(c, st, IN_PROGRESS_SQL, &[&spec.name])?;
    let in_period = match spec.rate {
        Some(rate) => count(c, st, IN_PERIOD_SQL, &[&spec.name, &now_ms.saturating_sub(rate.period_ms)])?,
        None => 0,
    };
    Ok((in_progress, in_period))
}

/// How many more runs a queue may admit now.
fn room(spec: &QueueSpec, in_progress: u64, in_period: u64) -> u64 {
    let by_concurrency = spec.concurrency_max.map_or(u64::MAX, |max| u64::from(max).saturating_sub(in_progress));
    let by_rate = spec.rate.map_or(u64::MAX, |rate| u64::from(rate.limit).saturating_sub(in_period));
    by_concurrency.min(by_rate)
}

/// The new runs of a start batch that go through queues: each queue must be declared, and each
/// deduplication id free among its queue's unfinished runs (and not taken twice in the batch).
/// Either is a typed error that refuses the whole batch, as on SQLite.
pub(super) fn check_enqueues(c: &mut impl GenericClient, st: &mut Statements, new: &[&StartRequest]) -> Result<()> {
    let queued: Vec<&StartRequest> = new.iter().copied().filter(|r| r.queue.is_some()).collect();
    if queued.is_empty() {
        return Ok(());
    }
    let names: Vec<String> = queued
        .iter()
        .filter_map(|r| r.queue.as_ref())
        .map(|q| q.queue.clone())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let declared_sql = st.get(c, DECLARED_SQL)?;
    let declared: BTreeSet<String> =
        c.query(&declared_sql, &[&names]).db()?.iter().map(|r| col(r, 0)).collect::<Result<_>>()?;
    if let Some(missing) = names.iter().find(|n| !declared.contains(*n)) {
        return Err(Error::invalid(
            queue_codes::UNKNOWN_QUEUE,
            format!("queue {missing:?} is not declared (PUT /v1/queues/{{name}} or the builder's .queue)"),
        ));
    }
    let mut wanted: BTreeMap<(String, String), String> = BTreeMap::new();
    for request in &queued {
        let enqueue = request.queue.as_ref().expect("filtered on queue");
        if let Some(dedup) = &enqueue.dedup_id {
            let pair = (enqueue.queue.clone(), dedup.clone());
            if let Some(holder) = wanted.get(&pair) {
                return Err(deduplicated(holder, &pair.0, &pair.1));
            }
            wanted.insert(pair, request.run_id.clone());
        }
    }
    if wanted.is_empty() {
        return Ok(());
    }
    let queues: Vec<&str> = wanted.keys().map(|(q, _)| q.as_str()).collect();
    let dedups: Vec<&str> = wanted.keys().map(|(_, d)| d.as_str()).collect();
    let holders = st.get(c, DEDUP_HOLDERS_SQL)?;
    if let Some(row) = c.query(&holders, &[&queues, &dedups]).db()?.first() {
        let (queue, dedup, holder): (String, String, String) = (col(row, 0)?, col(row, 1)?, col(row, 2)?);
        return Err(deduplicated(&holder, &queue, &dedup));
    }
    Ok(())
}

fn deduplicated(holder: &str, queue: &str, dedup: &str) -> Error {
    Error::invalid(
        queue_codes::DEDUPLICATED,
        format!("run {holder:?} of queue {queue:?} holds dedup_id {dedup:?} until it ends"),
    )
}

/// The waiting runs a claim may admit now, of the workflows and versions it asks for, within each
/// queue's room (counted under the queue's lock) and the claim's largest per-type slot; each with
/// its input text. In the claim's transaction, after its per-type locks.
pub(super) fn admissible(
    c: &mut impl GenericClient,
    st: &mut Statements,
    schema: &str,
    workflows: &[WorkflowVersion],
    slots: &HashMap<&str, usize>,
    now_ms: i64,
) -> Result<Vec<(RunRecord, String)>> {
    let largest = slots.values().copied().max().unwrap_or(0);
    if largest == 0 || workflows.is_empty() {
        return Ok(Vec::new());
    }
    let waiting = st.get(c, QUEUES_WAITING_SQL)?;
    let specs: Vec<QueueSpec> = c.query(&waiting, &[]).db()?.iter().map(spec_row).collect::<Result<_>>()?;
    if specs.is_empty() {
        return Ok(Vec::new());
    }
    let names: Vec<&str> = workflows.iter().map(|w| w.workflow.as_str()).collect();
    let versions: Vec<i64> = workflows.iter().map(|w| i64::from(w.version)).collect();
    let mut out = Vec::new();
    for spec in specs {
        // Queues in name order (the order of `QUEUES_WAITING_SQL`): every claim locks them so.
        lock(c, LOCK_QUEUE, &format!("{schema}/{}", spec.name))?;
        let (in_progress, in_period) = counts(c, st, &spec, now_ms)?;
        let room = room(&spec, in_progress, in_period).min(largest as u64);
        if room == 0 {
            continue;
        }
        let admissible = st.get(c, ADMISSIBLE_SQL)?;
        let room = i64::try_from(room).unwrap_or(i64::MAX);
        for row in c.query(&admissible, &[&spec.name, &now_ms, &names, &versions, &room]).db()? {
            out.push((rows::run_record_without_input(&row)?, col(&row, 3)?));
        }
    }
    Ok(out)
}

fn state(
    c: &mut impl GenericClient,
    st: &mut Statements,
    spec: QueueSpec,
    shown: usize,
    now_ms: i64,
) -> Result<QueueState> {
    let (in_progress, admitted_in_period) = counts(c, st, &spec, now_ms)?;
    let waiting = count(c, st, WAITING_COUNT_SQL, &[&spec.name])?;
    let next_sql = st.get(c, WAITING_NEXT_SQL)?;
    let shown = shown.min(QUEUE_WAITING_SHOWN_MAX) as i64;
    let mut next = Vec::new();
    for (i, row) in c.query(&next_sql, &[&spec.name, &shown]).db()?.iter().enumerate() {
        next.push(QueuedRun {
            position: i as u64 + 1,
            run_id: col(row, 0)?,
            workflow: col(row, 1)?,
            priority: col(row, 2)?,
            created_at_ms: col(row, 3)?,
        });
    }
    Ok(QueueState { spec, in_progress, admitted_in_period, waiting, next })
}

impl QueueStore for PgWorkflows {
    fn put_queue(&mut self, spec: &QueueSpec, now_ms: i64) -> Result<QueueSpec> {
        spec.validate()?;
        let schema = self.apply.schema().to_string();
        let st = self.statements.get_mut();
        let (mut tx, gate) = self.apply.write_transaction()?;
        // One declaration at a time per schema, so that the count below holds when two
        // processes declare queues at once.
        lock(&mut tx, LOCK_QUEUES, &schema)?;
        if load_spec(&mut tx, st, &spec.name)?.is_none() {
            let total = count(&mut tx, st, "SELECT count(*) FROM {s}.queues", &[])?;
            if total as usize >= QUEUES_MAX {
                return Err(Error::invalid(
                    codes::LIMIT_EXCEEDED,
                    format!("at most {QUEUES_MAX} queues per workflow database"),
                ));
            }
        }
        let upsert = st.get(
            &mut tx,
            "INSERT INTO {s}.queues (name, concurrency_max, rate_limit, rate_period_ms, created_at_ms, updated_at_ms)
             VALUES ($1, $2, $3, $4, $5, $5)
             ON CONFLICT (name) DO UPDATE SET concurrency_max = excluded.concurrency_max,
                 rate_limit = excluded.rate_limit, rate_period_ms = excluded.rate_period_ms,
                 updated_at_ms = excluded.updated_at_ms",
        )?;
        // Limits are at most QUEUE_LIMIT_MAX (validated): they fit an integer.
        let as_int = |n: u32| i32::try_from(n).unwrap_or(i32::MAX);
        let concurrency = spec.concurrency_max.map(as_int);
        let rate_limit = spec.rate.map(|r| as_int(r.limit));
        let period = spec.rate.map(|r| r.period_ms);
        tx.execute(&upsert, &[&spec.name, &concurrency, &rate_limit, &period, &now_ms]).db()?;
        gate.commit(tx)?;
        Ok(spec.clone())
    }

    fn queue(&self, name: &str, shown: usize, now_ms: i64) -> Result<Option<QueueState>> {
        validate_id("queue", name)?;
        let (mut client, mut st) = self.reader();
        // One snapshot for the declaration and its counts.
        let mut tx = client
            .build_transaction()
            .isolation_level(postgres::IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .db()?;
        let state = match load_spec(&mut tx, &mut st, name)? {
            Some(spec) => Some(state(&mut tx, &mut st, spec, shown, now_ms)?),
            None => None,
        };
        tx.commit().db()?;
        Ok(state)
    }

    fn queues(&self, now_ms: i64) -> Result<Vec<QueueState>> {
        let (mut client, mut st) = self.reader();
        let mut tx = client
            .build_transaction()
            .isolation_level(postgres::IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .db()?;
        let specs_sql = st.get(&mut tx, SPECS_SQL)?;
        let specs: Vec<QueueSpec> =
            tx.query(&specs_sql, &[&(QUEUES_MAX as i64)]).db()?.iter().map(spec_row).collect::<Result<_>>()?;
        let states = specs.into_iter().map(|spec| state(&mut tx, &mut st, spec, 0, now_ms)).collect::<Result<_>>()?;
        tx.commit().db()?;
        Ok(states)
    }
}
