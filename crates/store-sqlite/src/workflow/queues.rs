//! Queues on SQLite (`QueueStore`, and the admission the claim does): the `queues` table and the
//! queue columns of `runs` (migration v9). The claim's immediate transaction serializes every
//! admission on the database, so two workers never spend one queue's room twice.

use std::collections::HashMap;

use rusqlite::types::Value as SqlValue;
use rusqlite::{params, params_from_iter, Connection, OptionalExtension, Row, TransactionBehavior};
use tidemark_core::id::validate_id;
use tidemark_core::queue::{
    queue_codes, Enqueue, QueueSpec, QueueState, QueueStore, QueuedRun, RateLimit, QUEUES_MAX, QUEUE_WAITING_SHOWN_MAX,
};
use tidemark_core::workflow::{RunRecord, WorkflowVersion};
use tidemark_core::{Error, Result};

use super::rows::{self, active, RUN_COLUMNS};
use super::SqliteWorkflows;
use crate::SqlResult;

fn spec_row(r: &Row<'_>) -> rusqlite::Result<QueueSpec> {
    let rate = match (r.get::<_, Option<u32>>(2)?, r.get::<_, Option<i64>>(3)?) {
        (Some(limit), Some(period_ms)) => Some(RateLimit { limit, period_ms }),
        _ => None,
    };
    Ok(QueueSpec { name: r.get(0)?, concurrency_max: r.get(1)?, rate })
}

fn load_spec(conn: &Connection, name: &str) -> Result<Option<QueueSpec>> {
    conn.prepare_cached("SELECT name, concurrency_max, rate_limit, rate_period_ms FROM queues WHERE name = ?1")
        .db()?
        .query_row([name], spec_row)
        .optional()
        .db()
}

/// A start through `enqueue`: its queue must be declared, and its deduplication id free among
/// the queue's unfinished runs.
pub(super) fn check_enqueue(tx: &Connection, enqueue: &Enqueue) -> Result<()> {
    if load_spec(tx, &enqueue.queue)?.is_none() {
        return Err(Error::invalid(
            queue_codes::UNKNOWN_QUEUE,
            format!("queue {:?} is not declared (PUT /v1/queues/{{name}} or the builder's .queue)", enqueue.queue),
        ));
    }
    if let Some(dedup) = &enqueue.dedup_id {
        let holder: Option<String> = tx
            .prepare_cached(&format!(
                "SELECT run_id FROM runs WHERE queue = ?1 AND dedup_id = ?2 AND {}",
                active("status")
            ))
            .db()?
            .query_row([&enqueue.queue, dedup], |r| r.get(0))
            .optional()
            .db()?;
        if let Some(holder) = holder {
            return Err(Error::invalid(
                queue_codes::DEDUPLICATED,
                format!("run {holder:?} of queue {:?} holds dedup_id {dedup:?} until it ends", enqueue.queue),
            ));
        }
    }
    Ok(())
}

/// A queue's admitted runs not finished yet (parameter: the queue). `INDEXED BY`: without
/// statistics the planner would take the admissions index and walk every run the queue ever
/// admitted (measured: the queued saga bench ran at 0.16 of the plain one); this index holds only
/// the unfinished ones, and a schema without it fails loudly instead of slowly.
pub(super) fn in_progress_sql() -> String {
    format!(
        "SELECT count(*) FROM runs INDEXED BY runs_queue_in_progress
         WHERE queue = ?1 AND admitted_at_ms IS NOT NULL AND {}",
        active("status")
    )
}

/// A queue's admissions since a time (parameters: the queue, the time).
pub(super) const ADMITTED_SINCE_SQL: &str = "SELECT count(*) FROM runs WHERE queue = ?1 AND admitted_at_ms > ?2";

/// A queue's waiting runs in admission order (parameters: the queue, a limit).
pub(super) fn waiting_sql() -> String {
    format!(
        "SELECT run_id, workflow, priority, created_at_ms FROM runs
         WHERE queue = ?1 AND admitted_at_ms IS NULL AND {}
         ORDER BY priority, created_at_ms, run_id LIMIT ?2",
        active("status")
    )
}

/// (admitted and unfinished, admitted in the rate period) of a queue.
fn counts(conn: &Connection, spec: &QueueSpec, now_ms: i64) -> Result<(u64, u64)> {
    let in_progress: i64 = conn.prepare_cached(&in_progress_sql()).db()?.query_row([&spec.name], |r| r.get(0)).db()?;
    let in_period: i64 = match spec.rate {
        Some(rate) => conn
            .prepare_cached(ADMITTED_SINCE_SQL)
            .db()?
            .query_row(params![spec.name, now_ms.saturating_sub(rate.period_ms)], |r| r.get(0))
            .db()?,
        None => 0,
    };
    Ok((in_progress as u64, in_period as u64))
}

/// How many more runs a queue may admit now.
fn room(spec: &QueueSpec, in_progress: u64, in_period: u64) -> u64 {
    let by_concurrency = spec.concurrency_max.map_or(u64::MAX, |max| u64::from(max).saturating_sub(in_progress));
    let by_rate = spec.rate.map_or(u64::MAX, |rate| u64::from(rate.limit).saturating_sub(in_period));
    by_concurrency.min(by_rate)
}

/// The waiting runs a claim may admit now, per queue in admission order, of the workflows and
/// versions it asks for, within each queue's room and the claim's per-workflow slots.
pub(super) fn admissible(
    tx: &Connection,
    workflows: &[WorkflowVersion],
    slots: &HashMap<&str, usize>,
    now_ms: i64,
) -> Result<Vec<(RunRecord, String)>> {
    // The declared queues (at most 1,000), not a DISTINCT over the waiting runs: that walks the
    // whole waiting index on every claim (measured: 0.25 of the plain saga rate with 20,000
    // queued runs).
    let specs: Vec<QueueSpec> = {
        let mut stmt = tx
            .prepare_cached("SELECT name, concurrency_max, rate_limit, rate_period_ms FROM queues ORDER BY name")
            .db()?;
        let rows = stmt.query_map([], spec_row).db()?;
        rows.collect::<rusqlite::Result<Vec<_>>>().db()?
    };
    if specs.is_empty() || workflows.is_empty() {
        return Ok(Vec::new());
    }
    let largest = slots.values().copied().max().unwrap_or(0);
    let wanted: Vec<String> = workflows.iter().map(|_| "(workflow = ? AND version = ?)".to_string()).collect();
    let sql = format!(
        "SELECT {RUN_COLUMNS} FROM runs
         WHERE queue = ? AND admitted_at_ms IS NULL AND {} AND wake_at_ms <= ?
           AND (lease_token IS NULL OR lease_expires_at_ms <= ?) AND ({})
         ORDER BY priority, created_at_ms, run_id LIMIT ?",
        active("status"),
        wanted.join(" OR ")
    );
    let mut out = Vec::new();
    let waits = format!(
        "SELECT EXISTS (SELECT 1 FROM runs WHERE queue = ?1 AND admitted_at_ms IS NULL AND {})",
        active("status")
    );
    for spec in specs {
        let name = spec.name.clone();
        // A queue nobody waits in costs a claim one index probe, not its counts.
        let waiting: bool = tx.prepare_cached(&waits).db()?.query_row([&name], |r| r.get(0)).db()?;
        if !waiting {
            continue;
        }
        let (in_progress, in_period) = counts(tx, &spec, now_ms)?;
        let room = room(&spec, in_progress, in_period).min(largest as u64);
        if room == 0 {
            continue;
        }
        let mut values: Vec<SqlValue> = vec![name.clone().into(), now_ms.into(), now_ms.into()];
        for w in workflows {
            values.push(w.workflow.clone().into());
            values.push(i64::from(w.version).into());
        }
        values.push((room as i64).into());
        let mut stmt = tx.prepare_cached(&sql).db()?;
        let found = stmt
            .query_map(params_from_iter(values), |r| Ok((rows::run_record_without_input(r)?, r.get::<_, String>(3)?)))
            .db()?;
        for row in found {
            out.push(row.db()?);
        }
    }
    Ok(out)
}

fn state(conn: &Connection, spec: QueueSpec, shown: usize, now_ms: i64) -> Result<QueueState> {
    let (in_progress, admitted_in_period) = counts(conn, &spec, now_ms)?;
    let waiting: i64 = conn
        .prepare_cached(&format!(
            "SELECT count(*) FROM runs WHERE queue = ?1 AND admitted_at_ms IS NULL AND {}",
            active("status")
        ))
        .db()?
        .query_row([&spec.name], |r| r.get(0))
        .db()?;
    let next = {
        let mut stmt = conn.prepare_cached(&waiting_sql()).db()?;
        let rows = stmt
            .query_map(params![spec.name, shown.min(QUEUE_WAITING_SHOWN_MAX) as i64], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?, r.get::<_, i32>(2)?, r.get::<_, i64>(3)?))
            })
            .db()?;
        let mut next = Vec::new();
        for (i, row) in rows.enumerate() {
            let (run_id, workflow, priority, created_at_ms) = row.db()?;
            next.push(QueuedRun { position: i as u64 + 1, run_id, workflow, priority, created_at_ms });
        }
        next
    };
    Ok(QueueState { spec, in_progress, admitted_in_period, waiting: waiting as u64, next })
}

impl QueueStore for SqliteWorkflows {
    fn put_queue(&mut self, spec: &QueueSpec, now_ms: i64) -> Result<QueueSpec> {
        spec.validate()?;
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        if load_spec(&tx, &spec.name)?.is_none() {
            let count: i64 = tx.query_row("SELECT count(*) FROM queues", [], |r| r.get(0)).db()?;
            if count as usize >= QUEUES_MAX {
                return Err(Error::invalid(
                    tidemark_core::error::codes::LIMIT_EXCEEDED,
                    format!("at most {QUEUES_MAX} queues per workflow database"),
                ));
            }
        }
        tx.prepare_cached(
            "INSERT INTO queues (name, concurrency_max, rate_limit, rate_period_ms, created_at_ms, updated_at_ms)
             VALUES (?1, ?2, ?3, ?4, ?5, ?5)
             ON CONFLICT (name) DO UPDATE SET concurrency_max = excluded.concurrency_max,
                 rate_limit = excluded.rate_limit, rate_period_ms = excluded.rate_period_ms,
                 updated_at_ms = excluded.updated_at_ms",
        )
        .db()?
        .execute(params![
            spec.name,
            spec.concurrency_max,
            spec.rate.map(|r| r.limit),
            spec.rate.map(|r| r.period_ms),
            now_ms
        ])
        .db()?;
        tx.commit().db()?;
        Ok(spec.clone())
    }

    fn queue(&self, name: &str, shown: usize, now_ms: i64) -> Result<Option<QueueState>> {
        validate_id("queue", name)?;
        match load_spec(&self.conn, name)? {
            Some(spec) => state(&self.conn, spec, shown, now_ms).map(Some),
            None => Ok(None),
        }
    }

    fn queues(&self, now_ms: i64) -> Result<Vec<QueueState>> {
        let specs = {
            let mut stmt = self
                .conn
                .prepare_cached("SELECT name, concurrency_max, rate_limit, rate_period_ms FROM queues ORDER BY name")
                .db()?;
            let rows = stmt.query_map([], spec_row).db()?;
            rows.collect::<rusqlite::Result<Vec<_>>>().db()?
        };
        specs.into_iter().map(|spec| state(&self.conn, spec, 0, now_ms)).collect()
    }
}
