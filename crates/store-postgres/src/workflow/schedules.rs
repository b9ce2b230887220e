//! Schedules on PostgreSQL (`ScheduleStore`): the `schedules` table of migration v2. `fire`
//! starts a plan's runs and moves the schedule's next tick in one transaction, guarded by the
//! next tick the plan was made from (compare and set): two tickers in two processes that planned
//! the same tick both run the guarded `UPDATE`; the second waits for the first's row lock, then
//! finds the next tick moved and changes nothing (`stale`).

use postgres::{GenericClient, Row};
use tidemark_core::crash;
use tidemark_core::error::codes;
use tidemark_core::id::{validate_id, validate_limit};
use tidemark_core::schedule::{
    schedule_codes, CatchUp, Fired, Schedule, ScheduleSpec, ScheduleStore, TickPlan, Timing, SCHEDULES_MAX,
    TICKS_PER_FIRE_MAX,
};
use tidemark_core::workflow::{validate_json_size, workflow_codes, WORKFLOW_INPUT_BYTES_MAX};
use tidemark_core::{Error, Result};

use super::rows::json_text;
use super::{start_in, validate_starts, PgWorkflows};
use crate::schema::{lock, Statements, LOCK_SCHEDULES};
use crate::{col, PgResult};

const SELECT_ONE_SQL: &str = "SELECT schedule_id, workflow, input, cron, interval_ms, timezone, catch_up, paused,
     next_tick_at_ms, last_started_tick_ms, ticks_started, ticks_skipped, created_at_ms, updated_at_ms
 FROM {s}.schedules WHERE schedule_id = $1";
const SELECT_ALL_SQL: &str = "SELECT schedule_id, workflow, input, cron, interval_ms, timezone, catch_up, paused,
     next_tick_at_ms, last_started_tick_ms, ticks_started, ticks_skipped, created_at_ms, updated_at_ms
 FROM {s}.schedules ORDER BY schedule_id LIMIT $1";
/// The ticker's read: due schedules, soonest first, by `schedules_due`.
pub(crate) const DUE_SQL: &str = "SELECT schedule_id, workflow, input, cron, interval_ms, timezone, catch_up, paused,
     next_tick_at_ms, last_started_tick_ms, ticks_started, ticks_skipped, created_at_ms, updated_at_ms
 FROM {s}.schedules WHERE NOT paused AND next_tick_at_ms IS NOT NULL AND next_tick_at_ms <= $1
 ORDER BY next_tick_at_ms LIMIT $2";

fn counter(row: &Row, index: usize) -> Result<u64> {
    let value: i64 = col(row, index)?;
    u64::try_from(value).map_err(|_| Error::store(format!("schedule counter {value} is negative")))
}

fn schedule_row(row: &Row) -> Result<Schedule> {
    let input: String = col(row, 2)?;
    let cron: Option<String> = col(row, 3)?;
    let interval: Option<i64> = col(row, 4)?;
    let catch_up: String = col(row, 6)?;
    let timing = match (cron, interval) {
        (Some(cron), None) => Timing::Cron(cron),
        (None, Some(ms)) => Timing::IntervalMs(ms),
        _ => return Err(Error::store("a schedule holds exactly one of cron and interval_ms")),
    };
    Ok(Schedule {
        spec: ScheduleSpec {
            schedule_id: col(row, 0)?,
            workflow: col(row, 1)?,
            input: serde_json::from_str(&input).map_err(|e| Error::store(format!("corrupt schedule input: {e}")))?,
            timing,
            timezone: col(row, 5)?,
            catch_up: CatchUp::parse(&catch_up).ok_or_else(|| Error::store(format!("catch_up {catch_up:?}")))?,
        },
        paused: col(row, 7)?,
        next_tick_at_ms: col(row, 8)?,
        last_started_tick_ms: col(row, 9)?,
        ticks_started: counter(row, 10)?,
        ticks_skipped: counter(row, 11)?,
        created_at_ms: col(row, 12)?,
        updated_at_ms: col(row, 13)?,
    })
}

fn load(c: &mut impl GenericClient, st: &mut Statements, schedule_id: &str) -> Result<Option<Schedule>> {
    let statement = st.get(c, SELECT_ONE_SQL)?;
    c.query_opt(&statement, &[&schedule_id]).db()?.map(|r| schedule_row(&r)).transpose()
}

fn existing(c: &mut impl GenericClient, st: &mut Statements, schedule_id: &str) -> Result<Schedule> {
    load(c, st, schedule_id)?.ok_or_else(|| Error::not_found(format!("no schedule {schedule_id:?}")))
}

impl ScheduleStore for PgWorkflows {
    fn put_schedule(&mut self, spec: &ScheduleSpec, now_ms: i64) -> Result<Schedule> {
        spec.validate()?;
        validate_json_size("input", &spec.input, WORKFLOW_INPUT_BYTES_MAX, workflow_codes::INVALID_INPUT)?;
        let schema = self.apply.schema().to_string();
        let st = self.statements.get_mut();
        let (mut tx, gate) = self.apply.write_transaction()?;
        // One put at a time per schema, so that the count below holds when two processes add
        // schedules at once.
        lock(&mut tx, LOCK_SCHEDULES, &schema)?;
        let before = load(&mut tx, st, &spec.schedule_id)?;
        if before.is_none() {
            let count = st.get(&mut tx, "SELECT count(*) FROM {s}.schedules")?;
            let count: i64 = col(&tx.query_one(&count, &[]).db()?, 0)?;
            if count.max(0) as usize >= SCHEDULES_MAX {
                return Err(Error::invalid(
                    codes::LIMIT_EXCEEDED,
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
        let upsert = st.get(
            &mut tx,
            "INSERT INTO {s}.schedules (schedule_id, workflow, input, cron, interval_ms, timezone, catch_up, paused,
                                        next_tick_at_ms, created_at_ms, updated_at_ms)
             VALUES ($1, $2, $3, $4, $5, $6, $7, false, $8, $9, $10)
             ON CONFLICT (schedule_id) DO UPDATE SET workflow = excluded.workflow, input = excluded.input,
                 cron = excluded.cron, interval_ms = excluded.interval_ms, timezone = excluded.timezone,
                 catch_up = excluded.catch_up, next_tick_at_ms = excluded.next_tick_at_ms,
                 updated_at_ms = excluded.updated_at_ms",
        )?;
        tx.execute(
            &upsert,
            &[
                &spec.schedule_id,
                &spec.workflow,
                &json_text(&spec.input),
                &cron,
                &interval,
                &spec.timezone,
                &spec.catch_up.as_str(),
                &next,
                &created_at_ms,
                &now_ms,
            ],
        )
        .db()?;
        let schedule = existing(&mut tx, st, &spec.schedule_id)?;
        crash::hit("workflow.operator.before_commit");
        gate.commit(tx)?;
        Ok(schedule)
    }

    fn schedule(&self, schedule_id: &str) -> Result<Option<Schedule>> {
        validate_id("schedule_id", schedule_id)?;
        let (mut client, mut st) = self.reader();
        load(&mut *client, &mut st, schedule_id)
    }

    fn schedules(&self) -> Result<Vec<Schedule>> {
        let (mut client, mut st) = self.reader();
        let statement = st.get(&mut *client, SELECT_ALL_SQL)?;
        client.query(&statement, &[&(SCHEDULES_MAX as i64)]).db()?.iter().map(schedule_row).collect()
    }

    fn pause_schedule(&mut self, schedule_id: &str, paused: bool, now_ms: i64) -> Result<Schedule> {
        validate_id("schedule_id", schedule_id)?;
        let st = self.statements.get_mut();
        let (mut tx, gate) = self.apply.write_transaction()?;
        let lock_one = st.get(&mut tx, "SELECT 1 FROM {s}.schedules WHERE schedule_id = $1 FOR UPDATE")?;
        tx.query(&lock_one, &[&schedule_id]).db()?;
        let schedule = existing(&mut tx, st, schedule_id)?;
        // Resuming goes on from the next tick after now: the ticks of the pause are not started.
        let next =
            if paused { schedule.next_tick_at_ms } else { schedule.spec.next_after(now_ms, schedule.created_at_ms)? };
        let update = st.get(
            &mut tx,
            "UPDATE {s}.schedules SET paused = $2, next_tick_at_ms = $3, updated_at_ms = $4 WHERE schedule_id = $1",
        )?;
        tx.execute(&update, &[&schedule_id, &paused, &next, &now_ms]).db()?;
        let schedule = existing(&mut tx, st, schedule_id)?;
        crash::hit("workflow.operator.before_commit");
        gate.commit(tx)?;
        Ok(schedule)
    }

    fn delete_schedule(&mut self, schedule_id: &str) -> Result<bool> {
        validate_id("schedule_id", schedule_id)?;
        let st = self.statements.get_mut();
        let client = self.apply.client_get_mut();
        let delete = st.get(client, "DELETE FROM {s}.schedules WHERE schedule_id = $1")?;
        Ok(client.execute(&delete, &[&schedule_id]).db()? == 1)
    }

    fn due_schedules(&self, now_ms: i64, limit: usize) -> Result<Vec<Schedule>> {
        validate_limit("due schedules", limit, SCHEDULES_MAX)?;
        let (mut client, mut st) = self.reader();
        let statement = st.get(&mut *client, DUE_SQL)?;
        client.query(&statement, &[&now_ms, &(limit as i64)]).db()?.iter().map(schedule_row).collect()
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
        let st = self.statements.get_mut();
        let (mut tx, gate) = self.apply.write_transaction()?;
        let moved = st.get(
            &mut tx,
            "UPDATE {s}.schedules SET next_tick_at_ms = $3, ticks_started = ticks_started + $4,
                 ticks_skipped = ticks_skipped + $5,
                 last_started_tick_ms = coalesce($6, last_started_tick_ms), updated_at_ms = $7
             WHERE schedule_id = $1 AND next_tick_at_ms = $2 AND NOT paused",
        )?;
        let skipped = i64::try_from(plan.skipped).unwrap_or(i64::MAX);
        let moved = tx
            .execute(
                &moved,
                &[
                    &plan.schedule_id,
                    &plan.expected_next_tick_at_ms,
                    &plan.next_tick_at_ms,
                    &(plan.starts.len() as i64),
                    &skipped,
                    &plan.starts.last().and_then(|s| tick_of(&s.run_id)),
                    &now_ms,
                ],
            )
            .db()?;
        if moved == 0 {
            return Ok(Fired::Stale);
        }
        let outcomes = start_in(&mut tx, st, &plan.starts, now_ms)?;
        crash::hit("workflow.start.before_commit");
        gate.commit(tx)?;
        // A tick whose run id another run took is answered `conflict` in the outcomes: passed
        // over, the schedule goes on.
        Ok(Fired::Fired(outcomes))
    }
}

/// The tick time a tick's run id ends with.
fn tick_of(run_id: &str) -> Option<i64> {
    run_id.rsplit(':').next().and_then(|ms| ms.parse().ok())
}
