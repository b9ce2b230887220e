//! Schedules: a workflow started on a cron expression or a fixed interval, each tick an
//! idempotent start of run `<schedule_id>:<tick time in ms>` (docs/workflows.md, "Schedules").
//!
//! The store keeps each schedule with the time of its next tick; a ticker (the service's loop,
//! or `tidemark schedule tick`) reads the due ones, works out which ticks to start under the
//! schedule's [`CatchUp`] policy and the next tick after now ([`Schedule::plan`]), and hands both
//! to [`ScheduleStore::fire`], which starts the runs and moves the next tick in one transaction,
//! only if nobody moved it meanwhile (two tickers never start a tick twice; the run id would make
//! a second start `existing` anyway).

use std::str::FromStr;

use chrono::{DateTime, TimeZone, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Error, Result};
use crate::id::validate_id;
use crate::workflow::{StartOutcome, StartRequest, TIMER_MS_MAX};

/// Stable error codes of schedules.
pub mod schedule_codes {
    /// A cron expression, interval, time zone or catch-up policy that is not valid.
    pub const INVALID_SCHEDULE: &str = "invalid_schedule";
}

/// A schedule id: an identifier of at most 80 characters (the run ids of its ticks add
/// `:<ms>`, at most 20 more).
pub const SCHEDULE_ID_BYTES_MAX: usize = 80;
/// The shortest interval: one second.
pub const INTERVAL_MS_MIN: i64 = 1_000;
/// A cron expression: at most 200 bytes.
pub const CRON_BYTES_MAX: usize = 200;
/// A tick later than this (ms) when the ticker sees it counts as missed (downtime), and the
/// schedule's [`CatchUp`] policy decides whether it starts.
pub const MISSED_AFTER_MS: i64 = 60_000;
/// At most this many ticks start per schedule and `fire` (`CatchUp::All` after a long downtime
/// goes on at the next tick of the ticker).
pub const TICKS_PER_FIRE_MAX: usize = 1_000;
/// At most this many schedules per workflow database.
pub const SCHEDULES_MAX: usize = 10_000;

fn invalid(message: impl Into<String>) -> Error {
    Error::invalid(schedule_codes::INVALID_SCHEDULE, message)
}

/// When a schedule ticks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Timing {
    /// A cron expression: five fields (minute hour day-of-month month day-of-week), or six with
    /// seconds first, or an alias (`@hourly`, `@daily`, ...), evaluated in the schedule's time
    /// zone (croner's syntax: `L`, `#` and `W` are understood).
    Cron(String),
    /// A fixed interval in ms (at least 1,000), counted from the schedule's creation.
    IntervalMs(i64),
}

/// What happens to ticks that were missed (the ticker did not run: downtime, a paused process)
/// by more than [`MISSED_AFTER_MS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum CatchUp {
    /// Missed ticks are not started; the schedule goes on from the next one.
    Skip,
    /// Of the missed ticks only the latest is started (the default; on-time ticks start as
    /// usual), as `anacron` runs a missed job once.
    #[default]
    One,
    /// Every missed tick is started (at most [`TICKS_PER_FIRE_MAX`] per pass).
    All,
}

impl CatchUp {
    /// The word stored and shown.
    pub fn as_str(self) -> &'static str {
        match self {
            CatchUp::Skip => "skip",
            CatchUp::One => "one",
            CatchUp::All => "all",
        }
    }

    /// The policy named `value`, or `None`.
    pub fn parse(value: &str) -> Option<CatchUp> {
        [CatchUp::Skip, CatchUp::One, CatchUp::All].into_iter().find(|c| c.as_str() == value)
    }
}

/// A schedule as its owner defines it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ScheduleSpec {
    /// The schedule's id (an identifier, at most 80 characters).
    pub schedule_id: String,
    /// The registered workflow each tick starts (at its latest version when the tick starts).
    pub workflow: String,
    /// The input of every run it starts.
    pub input: Value,
    /// When it ticks.
    pub timing: Timing,
    /// The IANA time zone a cron expression is read in (`UTC` by default; intervals ignore it).
    #[serde(default = "utc")]
    pub timezone: String,
    /// What happens to missed ticks.
    #[serde(default)]
    pub catch_up: CatchUp,
}

fn utc() -> String {
    "UTC".to_string()
}

impl ScheduleSpec {
    /// Check everything but the workflow's registration: the id, the timing, the time zone.
    pub fn validate(&self) -> Result<()> {
        validate_id("schedule_id", &self.schedule_id)?;
        if self.schedule_id.len() > SCHEDULE_ID_BYTES_MAX {
            return Err(invalid(format!("schedule_id is at most {SCHEDULE_ID_BYTES_MAX} characters")));
        }
        validate_id("workflow", &self.workflow)?;
        self.zone()?;
        match &self.timing {
            Timing::Cron(expression) => {
                parse_cron(expression)?;
            }
            Timing::IntervalMs(ms) => {
                if !(INTERVAL_MS_MIN..=TIMER_MS_MAX).contains(ms) {
                    return Err(invalid(format!("interval_ms must be {INTERVAL_MS_MIN}..={TIMER_MS_MAX}, got {ms}")));
                }
            }
        }
        Ok(())
    }

    /// Every time zone a schedule may be read in (the IANA names of chrono-tz's database), for
    /// the OpenAPI document's `enum`.
    pub fn time_zone_names() -> Vec<&'static str> {
        chrono_tz::TZ_VARIANTS.iter().map(|zone| zone.name()).collect()
    }

    fn zone(&self) -> Result<chrono_tz::Tz> {
        chrono_tz::Tz::from_str(&self.timezone).map_err(|_| {
            invalid(format!("unknown time zone {:?} (an IANA name such as UTC or Europe/Paris)", self.timezone))
        })
    }

    /// The first tick strictly after `after_ms`, or `None` when there is none (a cron
    /// expression that never matches again).
    pub fn next_after(&self, after_ms: i64, created_at_ms: i64) -> Result<Option<i64>> {
        match &self.timing {
            Timing::IntervalMs(ms) => {
                // Ticks at created + k * interval, k >= 1.
                let since = after_ms.saturating_sub(created_at_ms).max(0);
                let k = since / ms + 1;
                Ok(Some(created_at_ms.saturating_add(k.saturating_mul(*ms))))
            }
            Timing::Cron(expression) => {
                let cron = parse_cron(expression)?;
                let zone = self.zone()?;
                let Some(start) = Utc.timestamp_millis_opt(after_ms).single() else {
                    return Err(invalid(format!("time {after_ms} is out of range")));
                };
                let start: DateTime<chrono_tz::Tz> = start.with_timezone(&zone);
                match cron.find_next_occurrence(&start, false) {
                    Ok(next) => Ok(Some(next.timestamp_millis())),
                    Err(croner::errors::CronError::TimeSearchLimitExceeded) => Ok(None),
                    Err(e) => Err(invalid(format!("cron expression {expression:?}: {e}"))),
                }
            }
        }
    }
}

fn parse_cron(expression: &str) -> Result<croner::Cron> {
    if expression.is_empty() || expression.len() > CRON_BYTES_MAX {
        return Err(invalid(format!("a cron expression is 1..={CRON_BYTES_MAX} bytes")));
    }
    // A field of commas alone is an empty set to croner: a seconds, minutes or hours field that
    // matches nothing made the search for the next tick walk to its limit one step at a time
    // (4.5 s of CPU per call in a release build; found by the `bodies` fuzz target). A list
    // never has an empty element here.
    if expression.split_whitespace().any(|field| field.split(',').any(str::is_empty)) {
        return Err(invalid(format!(
            "cron expression {expression:?}: a list has an empty element (a leading, trailing or doubled ',')"
        )));
    }
    croner::Cron::from_str(expression).map_err(|e| invalid(format!("cron expression {expression:?}: {e}")))
}

/// A schedule as stored.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Schedule {
    /// What its owner defined.
    #[serde(flatten)]
    pub spec: ScheduleSpec,
    /// A paused schedule does not tick; resuming it goes on from the next tick after the resume
    /// (the ticks of the pause are not started).
    pub paused: bool,
    /// The next tick, in ms since the Unix epoch (`None`: it never ticks again).
    pub next_tick_at_ms: Option<i64>,
    /// The last tick that started a run.
    pub last_started_tick_ms: Option<i64>,
    /// Ticks started so far, and ticks skipped as missed.
    pub ticks_started: u64,
    /// Missed ticks the catch-up policy did not start.
    pub ticks_skipped: u64,
    /// When it was created (intervals count from here), in ms since the Unix epoch.
    pub created_at_ms: i64,
    /// When it last changed.
    pub updated_at_ms: i64,
}

/// What one pass of the ticker does for one due schedule.
#[derive(Debug, Clone, PartialEq)]
pub struct TickPlan {
    /// The schedule.
    pub schedule_id: String,
    /// The next tick the plan was made from: `fire` applies it only if the store still holds it.
    pub expected_next_tick_at_ms: i64,
    /// The runs to start, one per tick (run id `<schedule>:<tick ms>`).
    pub starts: Vec<StartRequest>,
    /// Missed ticks not started.
    pub skipped: u64,
    /// The next tick after the plan.
    pub next_tick_at_ms: Option<i64>,
}

/// The run id of a schedule's tick at `tick_ms`.
pub fn tick_run_id(schedule_id: &str, tick_ms: i64) -> String {
    format!("{schedule_id}:{tick_ms}")
}

impl Schedule {
    /// The plan for a pass of the ticker at `now_ms`: the ticks due by now (at most
    /// [`TICKS_PER_FIRE_MAX`]) sorted into started and skipped by the catch-up policy, and the
    /// next tick. `version` is the workflow's version the runs are pinned to. `None` when nothing
    /// is due.
    pub fn plan(&self, now_ms: i64, version: u32) -> Result<Option<TickPlan>> {
        let Some(first) = self.next_tick_at_ms.filter(|at| *at <= now_ms && !self.paused) else {
            return Ok(None);
        };
        let mut due = vec![first];
        let mut next = self.spec.next_after(first, self.created_at_ms)?;
        while let Some(at) = next.filter(|at| *at <= now_ms) {
            if due.len() == TICKS_PER_FIRE_MAX {
                break;
            }
            due.push(at);
            next = self.spec.next_after(at, self.created_at_ms)?;
        }
        let missed = |at: &i64| now_ms.saturating_sub(*at) > MISSED_AFTER_MS;
        let started: Vec<i64> = match self.spec.catch_up {
            CatchUp::All => due.clone(),
            CatchUp::Skip => due.iter().copied().filter(|at| !missed(at)).collect(),
            CatchUp::One => {
                let latest_missed = due.iter().copied().rfind(missed);
                latest_missed.into_iter().chain(due.iter().copied().filter(|at| !missed(at))).collect()
            }
        };
        let skipped = (due.len() - started.len()) as u64;
        let starts = started
            .into_iter()
            .map(|at| {
                StartRequest::new(
                    &tick_run_id(&self.spec.schedule_id, at),
                    &self.spec.workflow,
                    version,
                    self.spec.input.clone(),
                )
            })
            .collect();
        Ok(Some(TickPlan {
            schedule_id: self.spec.schedule_id.clone(),
            expected_next_tick_at_ms: first,
            starts,
            skipped,
            next_tick_at_ms: next,
        }))
    }
}

/// What `fire` did with a plan.
#[derive(Debug, Clone, PartialEq)]
pub enum Fired {
    /// The runs were started (or were there already) and the next tick moved.
    Fired(Vec<StartOutcome>),
    /// Another ticker moved the next tick first, or the schedule was changed, paused or
    /// deleted: nothing was written.
    Stale,
}

/// Where schedules are kept (the workflow database). Implemented by the SQLite and PostgreSQL
/// workflow stores.
pub trait ScheduleStore {
    /// Create or replace a schedule (validated; the caller checked its workflow is registered).
    /// Replacing keeps its counters and computes its next tick from now.
    fn put_schedule(&mut self, spec: &ScheduleSpec, now_ms: i64) -> Result<Schedule>;
    /// One schedule, or `None`.
    fn schedule(&self, schedule_id: &str) -> Result<Option<Schedule>>;
    /// Every schedule, by id.
    fn schedules(&self) -> Result<Vec<Schedule>>;
    /// Pause (`true`) or resume (`false`); resuming computes the next tick from now.
    fn pause_schedule(&mut self, schedule_id: &str, paused: bool, now_ms: i64) -> Result<Schedule>;
    /// Delete a schedule (the runs it started stay). True when it existed.
    fn delete_schedule(&mut self, schedule_id: &str) -> Result<bool>;
    /// Schedules whose next tick is due by `now_ms` and that are not paused, at most `limit`.
    fn due_schedules(&self, now_ms: i64, limit: usize) -> Result<Vec<Schedule>>;
    /// Apply a plan in one transaction: start its runs (idempotent per run id) and move the next
    /// tick, only if the stored next tick is still `plan.expected_next_tick_at_ms`.
    fn fire(&mut self, plan: &TickPlan, now_ms: i64) -> Result<Fired>;
}

/// Due schedules looked at per pass of [`tick`], at most.
pub const SCHEDULES_PER_TICK_MAX: usize = 1_000;

/// What one pass of the ticker did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct TickReport {
    /// Due schedules fired.
    pub fired: u64,
    /// Runs started.
    pub started: u64,
    /// Ticks whose run was there already (a start repeated after a crash, or by another ticker).
    pub existing: u64,
    /// Ticks whose run id another run had taken (passed over).
    pub conflicts: u64,
    /// Missed ticks the catch-up policy did not start.
    pub skipped: u64,
    /// Schedules another ticker fired first (nothing written for them).
    pub stale: u64,
    /// Due schedules of workflows `versions` does not name (left due: a process with other code
    /// may tick them).
    pub unregistered: Vec<String>,
}

/// One pass of the ticker on `store`: every due schedule (at most [`SCHEDULES_PER_TICK_MAX`])
/// planned at `now_ms` with its workflow's latest version in `versions` and fired (each
/// schedule's runs and next tick in one transaction of the store).
pub fn tick<S: ScheduleStore + ?Sized>(
    store: &mut S,
    versions: &std::collections::BTreeMap<String, u32>,
    now_ms: i64,
) -> Result<TickReport> {
    let mut report = TickReport::default();
    for schedule in store.due_schedules(now_ms, SCHEDULES_PER_TICK_MAX)? {
        let Some(version) = versions.get(&schedule.spec.workflow) else {
            report.unregistered.push(schedule.spec.schedule_id.clone());
            continue;
        };
        let Some(plan) = schedule.plan(now_ms, *version)? else { continue };
        match store.fire(&plan, now_ms)? {
            Fired::Stale => report.stale += 1,
            Fired::Fired(outcomes) => {
                report.fired += 1;
                report.skipped += plan.skipped;
                for outcome in outcomes {
                    match outcome {
                        StartOutcome::Started { .. } => report.started += 1,
                        StartOutcome::Existing { .. } => report.existing += 1,
                        StartOutcome::Conflict { .. } => report.conflicts += 1,
                    }
                }
            }
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(timing: Timing, catch_up: CatchUp) -> ScheduleSpec {
        ScheduleSpec {
            schedule_id: "nightly".into(),
            workflow: "report".into(),
            input: json!({}),
            timing,
            timezone: "UTC".into(),
            catch_up,
        }
    }

    fn schedule(spec: ScheduleSpec, next: i64, created: i64) -> Schedule {
        Schedule {
            spec,
            paused: false,
            next_tick_at_ms: Some(next),
            last_started_tick_ms: None,
            ticks_started: 0,
            ticks_skipped: 0,
            created_at_ms: created,
            updated_at_ms: created,
        }
    }

    #[test]
    fn intervals_tick_from_creation_and_cron_in_its_time_zone() {
        let every = spec(Timing::IntervalMs(10_000), CatchUp::One);
        assert_eq!(every.next_after(0, 0).unwrap(), Some(10_000));
        assert_eq!(every.next_after(10_000, 0).unwrap(), Some(20_000));
        assert_eq!(every.next_after(25_000, 3).unwrap(), Some(30_003));
        // 2026-12-01T00:00:00Z; daily at 09:00 in Paris (UTC+1 in December) is 08:00Z.
        let midnight = 1_796_083_200_000;
        let mut paris = spec(Timing::Cron("0 9 * * *".into()), CatchUp::One);
        paris.timezone = "Europe/Paris".into();
        assert_eq!(paris.next_after(midnight, 0).unwrap(), Some(midnight + 8 * 3_600_000));
        let utc = spec(Timing::Cron("@hourly".into()), CatchUp::One);
        assert_eq!(utc.next_after(midnight, 0).unwrap(), Some(midnight + 3_600_000));
    }

    #[test]
    fn bad_schedules_are_refused_with_their_code() {
        for bad in [
            spec(Timing::Cron("61 * * * *".into()), CatchUp::One),
            spec(Timing::Cron("".into()), CatchUp::One),
            spec(Timing::Cron("every tuesday".into()), CatchUp::One),
            spec(Timing::IntervalMs(999), CatchUp::One),
            spec(Timing::IntervalMs(TIMER_MS_MAX + 1), CatchUp::One),
            ScheduleSpec { timezone: "Mars/Olympus".into(), ..spec(Timing::IntervalMs(1_000), CatchUp::One) },
            ScheduleSpec { schedule_id: "x".repeat(81), ..spec(Timing::IntervalMs(1_000), CatchUp::One) },
            // Empty list elements (the fuzzer's `,1 , * * * MON-FRI` was an empty minutes set,
            // which croner searched for the next tick for seconds), refused before croner sees them.
            spec(Timing::Cron(",1 , * * * MON-FRI".into()), CatchUp::One),
            spec(Timing::Cron("0 , * * *".into()), CatchUp::One),
            spec(Timing::Cron("1,,2 * * * *".into()), CatchUp::One),
            spec(Timing::Cron("1, * * * *".into()), CatchUp::One),
        ] {
            let error = bad.validate().unwrap_err();
            assert!(
                [schedule_codes::INVALID_SCHEDULE, crate::error::codes::INVALID_ID].contains(&error.code()),
                "{bad:?}: {error}"
            );
        }
        spec(Timing::Cron("*/5 * * * *".into()), CatchUp::One).validate().unwrap();
        spec(Timing::Cron("0 0 12 * * MON-FRI".into()), CatchUp::One).validate().unwrap();
        spec(Timing::Cron("0,30 9-17 * * 1,3,5".into()), CatchUp::One).validate().unwrap();
    }

    #[test]
    fn missed_ticks_follow_the_catch_up_policy() {
        // Ticks every 10 s from 0; the ticker comes back at 100 s: ticks 10..=100 s are due, those
        // before 40 s are missed (more than 60 s late).
        let ids = |plan: &TickPlan| plan.starts.iter().map(|s| s.run_id.clone()).collect::<Vec<_>>();
        let now = 100_000;
        let all = schedule(spec(Timing::IntervalMs(10_000), CatchUp::All), 10_000, 0).plan(now, 1).unwrap().unwrap();
        assert_eq!(all.starts.len(), 10);
        assert_eq!((all.skipped, all.next_tick_at_ms, all.expected_next_tick_at_ms), (0, Some(110_000), 10_000));
        let skip = schedule(spec(Timing::IntervalMs(10_000), CatchUp::Skip), 10_000, 0).plan(now, 1).unwrap().unwrap();
        assert_eq!(
            ids(&skip),
            [
                "nightly:40000",
                "nightly:50000",
                "nightly:60000",
                "nightly:70000",
                "nightly:80000",
                "nightly:90000",
                "nightly:100000"
            ]
        );
        assert_eq!(skip.skipped, 3);
        // `one`: the latest missed tick (30 s), then the on-time ones.
        let one = schedule(spec(Timing::IntervalMs(10_000), CatchUp::One), 10_000, 0).plan(now, 1).unwrap().unwrap();
        assert_eq!(ids(&one)[..2], ["nightly:30000", "nightly:40000"]);
        assert_eq!((one.starts.len(), one.skipped), (8, 2));
        // A daily report after a week down: one run, for the latest day.
        let daily = spec(Timing::IntervalMs(86_400_000), CatchUp::One);
        let week = schedule(daily, 86_400_000, 0).plan(7 * 86_400_000 + 3_600_000, 1).unwrap().unwrap();
        assert_eq!((ids(&week), week.skipped), (vec!["nightly:604800000".to_string()], 6));
        // Nothing due, or paused: no plan.
        assert_eq!(schedule(spec(Timing::IntervalMs(10_000), CatchUp::All), 10_000, 0).plan(9_999, 1).unwrap(), None);
        let mut paused = schedule(spec(Timing::IntervalMs(10_000), CatchUp::All), 10_000, 0);
        paused.paused = true;
        assert_eq!(paused.plan(now, 1).unwrap(), None);
        assert_eq!(all.starts[0].version, 1);
    }
}
