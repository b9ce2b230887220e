//! Schedules on SQLite (`ScheduleStore`): the `schedules` table of migration v9. `fire` starts a
//! plan's runs and moves the schedule's next tick in one immediate transaction, guarded by the next
//! tick the plan was made from (compare and set), so two tickers never both apply one tick.

use rusqlite::{params, Connection, OptionalExtension, Row, TransactionBehavior};
use tidemark_core::crash;
use tidemark_core::id::{validate_id, validate_limit};
use tidemark_core::schedule::{
    schedule_codes, CatchUp, Fired, Schedule, ScheduleSpec, ScheduleStore, TickPlan, Timing, SCHEDULES_MAX,
    TICKS_PER_FIRE_MAX,
};
use tidemark_core::workflow::{validate_json_size, workflow_codes, WORKFLOW_INPUT_BYTES_MAX};
use tidemark_core::{Error, Result};

use super::rows::json_text;
use super::{start_in, validate_starts, SqliteWorkflows};
use crate::SqlResult;

const COLUMNS: &str = "schedule_id, workflow, input, cron, interval_ms, timezone, catch_up, paused, next_tick_at_ms, \
     last_started_tick_ms, ticks_started, ticks_skipped, created_at_ms, updated_at_ms";

fn bad_column(index: usize, message: String) -> rusqlite::Error {
    rusqlite::Error::FromSqlConversionFailure(index, rusqlite::types::Type::Text, message.into())
}

fn schedule_row(r: &Row<'_>) -> rusqlite::Result<Schedule> {
    let input: String = r.get(2)?;
    let cron: Option<String> = r.get(3)?;
    let interval: Option<i64> = r.get(4)?;
    let catch_up: String = r.get(6)?;
    let timing = match (cron, interval) {
        (Some(cron), None) => Timing::Cron(cron),
        (None, Some(ms)) => Timing::IntervalMs(ms),
        _ => return Err(bad_column(3, "a schedule holds exactly one of cron and interval_ms".into())),
    };
    Ok(Schedule {
        spec: ScheduleSpec {
            schedule_id: r.get(0)?,
            workflow: r.get(1)?,
            input: serde_json::from_str(&input).map_err(|e| bad_column(2, format!("corrupt JSON: {e}")))?,
            timing,
            timezone: r.get(5)?,
            catch_up: CatchUp::parse(&catch_up).ok_or_else(|| bad_column(6, format!("catch_up {catch_up:?}")))?,
        },
        paused: r.get(7)?,
        next_tick_at_ms: r.get(8)?,
        last_started_tick_ms: r.get(9)?,
        ticks_started: r.get(10)?,
        ticks_skipped: r.get(11)?,
        created_at_ms: r.get(12)?,
        updated_at_ms: r.get(13)?,
    })
}

fn load(conn: &Connection, schedule_id: &str) -> Result<Option<Schedule>> {
    conn.prepare_cached(&format!("SELECT {COLUMNS} FROM schedules WHERE schedule_id = ?1"))
        .db()?
        .query_row([schedule_id], schedule_row)
        .optional()
        .db()
}

fn existing(conn: &Connection, schedule_id: &str) -> Result<Schedule> {
    load(conn, schedule_id)?.ok_or_else(|| Error::not_found(format!("no schedule {schedule_id:?}")))
}

impl ScheduleStore for SqliteWorkflows {
    fn put_schedule(&mut self, spec: &ScheduleSpec, now_ms: i64) -> Result<Schedule> {
        spec.validate()?;
        validate_json_size("input", &spec.input, WORKFLOW_INPUT_BYTES_MAX, workflow_codes::INVALID_INPUT)?;
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        let before = load(&tx, &spec.schedule_id)?;
        if before.is_none() {
            let count: i64 = tx.query_row("SELECT count(*) FROM schedules", [], |r| r.get(0)).db()?;
            if count as usize >= SCHEDULES_MAX {
                return Err(Error::invalid(
                    tidemark_core::error::codes::LIMIT_EXCEEDED,
                    format!("at most {SCHEDULES_MAX} schedules per workflow database"),
                ));
            }
        }
        let created_at_ms = before.as_ref().map_or(now_ms, |b| b.created_at_ms);
        let next = spec.next_after(now_ms, created_at_ms)?;
        let (cron, interval) = match &spec.timing {
            Timing::Cron(cron) => (Some(cron.as_str()), None),
            Timing::IntervalMs(ms) => (None, Some(*ms)),
        };
        tx.prepare_cached(
            "INSERT INTO schedules (schedule_id, workflow, input, cron, interval_ms, timezone, catch_up, paused,
                                    next_tick_at_ms, created_at_ms, updated_at_ms)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, 0, ?8, ?9, ?10)
             ON CONFLICT (schedule_id) DO UPDATE SET workflow = excluded.workflow, input = excluded.input,
                 cron = excluded.cron, interval_ms = excluded.interval_ms, timezone = excluded.timezone,
                 catch_up = excluded.catch_up, next_tick_at_ms = excluded.next_tick_at_ms,
                 updated_at_ms = excluded.updated_at_ms",
        )
        .db()?
        .execute(params![
            spec.schedule_id,
            spec.workflow,
            json_text(&spec.input),
            cron,
            interval,
            spec.timezone,
            spec.catch_up.as_str(),
            next,
            created_at_ms,
            now_ms
        ])
        .db()?;
        let schedule = existing(&tx, &spec.schedule_id)?;
        crash::hit("workflow.operator.before_commit");
        tx.commit().db()?;
        Ok(schedule)
    }

    fn schedule(&self, schedule_id: &str) -> Result<Option<Schedule>> {
        validate_id("schedule_id", schedule_id)?;
        load(&self.conn, schedule_id)
    }

    fn schedules(&self) -> Result<Vec<Schedule>> {
        let mut stmt =
            self.conn.prepare_cached(&format!("SELECT {COLUMNS} FROM schedules ORDER BY schedule_id")).db()?;
        let rows = stmt.query_map([], schedule_row).db()?;
        rows.collect::<rusqlite::Result<Vec<_>>>().db()
    }

    fn pause_schedule(&mut self, schedule_id: &str, paused: bool, now_ms: i64) -> Result<Schedule> {
        validate_id("schedule_id", schedule_id)?;
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        let schedule = existing(&tx, schedule_id)?;
        // Resuming goes on from the next tick after now: the ticks of the pause are not started.
        let next =
            if paused { schedule.next_tick_at_ms } else { schedule.spec.next_after(now_ms, schedule.created_at_ms)? };
        tx.prepare_cached(
            "UPDATE schedules SET paused = ?2, next_tick_at_ms = ?3, updated_at_ms = ?4 WHERE schedule_id = ?1",
        )
        .db()?
        .execute(params![schedule_id, paused, next, now_ms])
        .db()?;
        let schedule = existing(&tx, schedule_id)?;
        crash::hit("workflow.operator.before_commit");
        tx.commit().db()?;
        Ok(schedule)
    }

    fn delete_schedule(&mut self, schedule_id: &str) -> Result<bool> {
        validate_id("schedule_id", schedule_id)?;
        let deleted = self
            .conn
            .prepare_cached("DELETE FROM schedules WHERE schedule_id = ?1")
            .db()?
            .execute([schedule_id])
            .db()?;
        Ok(deleted == 1)
    }

    fn due_schedules(&self, now_ms: i64, limit: usize) -> Result<Vec<Schedule>> {
        validate_limit("due schedules", limit, SCHEDULES_MAX)?;
        let mut stmt = self
            .conn
            .prepare_cached(&format!(
                "SELECT {COLUMNS} FROM schedules
                 WHERE paused = 0 AND next_tick_at_ms IS NOT NULL AND next_tick_at_ms <= ?1
                 ORDER BY next_tick_at_ms LIMIT ?2"
            ))
            .db()?;
        let rows = stmt.query_map(params![now_ms, limit as i64], schedule_row).db()?;
        rows.collect::<rusqlite::Result<Vec<_>>>().db()
    }

    fn fire(&mut self, plan: &TickPlan, now_ms: i64) -> Result<Fired> {
        validate_id("schedule_id", &plan.schedule_id)?;
        if plan.starts.len() > TICKS_PER_FIRE_MAX {
            return Err(Error::invalid(
                schedule_codes::INVALID_SCHEDULE,
                format!("at most {TICKS_PER_FIRE_MAX} ticks per fire"),
            ));
        }
        validate_starts(&plan.starts, now_ms)?;
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        let moved = tx
            .prepare_cached(
                "UPDATE schedules SET next_tick_at_ms = ?3, ticks_started = ticks_started + ?4,
                     ticks_skipped = ticks_skipped + ?5,
                     last_started_tick_ms = coalesce(?6, last_started_tick_ms), updated_at_ms = ?7
                 WHERE schedule_id = ?1 AND next_tick_at_ms = ?2 AND paused = 0",
            )
            .db()?
            .execute(params![
                plan.schedule_id,
                plan.expected_next_tick_at_ms,
                plan.next_tick_at_ms,
                plan.starts.len() as i64,
                plan.skipped as i64,
                plan.starts.last().map(|s| tick_of(&s.run_id)),
                now_ms
            ])
            .db()?;
        if moved == 0 {
            return Ok(Fired::Stale);
        }
        let outcomes = start_in(&tx, &plan.starts, now_ms)?;
        crash::hit("workflow.start.before_commit");
        tx.commit().db()?;
        // A tick whose run id another run took is answered `conflict` in the outcomes: passed
        // over, the schedule goes on.
        Ok(Fired::Fired(outcomes))
    }
}

/// The tick time a tick's run id ends with.
fn tick_of(run_id: &str) -> Option<i64> {
    run_id.rsplit(':').next().and_then(|ms| ms.parse().ok())
}
