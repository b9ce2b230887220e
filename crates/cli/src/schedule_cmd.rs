//! `tidemark schedule ...`: schedules of the built-in workflows on a workflow database (put,
//! list, show, pause, resume, delete) and `tick`, one pass of the ticker (what `tidemark serve`
//! runs every second per tenant). Like every command: one JSON document on stdout; bad input exits
//! 2 with a stable code and nothing written.

use std::collections::BTreeMap;
use std::path::PathBuf;

use clap::{ArgGroup, Subcommand};
use serde_json::{json, Value};
use tidemark_builtins::workflows as builtin;
use tidemark_core::id::validate_id;
use tidemark_core::schedule::{schedule_codes, tick, tick_run_id, CatchUp, ScheduleSpec, ScheduleStore, Timing};
use tidemark_core::workflow::workflow_codes;
use tidemark_core::{Error, Result};

use crate::workflow_cmd::{on_store, open_db, read_input, Store};
use crate::Context;

#[derive(Subcommand)]
pub enum ScheduleCommand {
    /// Create or replace a schedule of a built-in workflow: a cron expression or an interval.
    #[command(group(ArgGroup::new("timing").required(true).args(["cron", "interval_ms"])))]
    #[command(group(ArgGroup::new("input_source").required(true).args(["input", "input_file"])))]
    Put {
        /// The workflow store: a SQLite file or a `postgres://` URL.
        #[arg(long, visible_alias = "store")]
        db: Option<PathBuf>,
        /// The schedule's id (at most 80 characters); its ticks are runs `<id>:<tick ms>`.
        #[arg(long)]
        schedule_id: String,
        /// A built-in workflow.
        #[arg(long)]
        workflow: String,
        /// A cron expression (5 fields, 6 with seconds first, or `@daily`-style aliases).
        #[arg(long)]
        cron: Option<String>,
        /// A fixed interval in ms (at least 1,000), counted from the schedule's creation.
        #[arg(long)]
        interval_ms: Option<i64>,
        /// The IANA time zone of the cron expression.
        #[arg(long, default_value = "UTC")]
        timezone: String,
        /// Missed ticks (more than 60 s late): skip, one (the latest) or all.
        #[arg(long, default_value = "one")]
        catch_up: String,
        /// The input of every run, as JSON text.
        #[arg(long)]
        input: Option<String>,
        /// The input as a JSON file.
        #[arg(long)]
        input_file: Option<PathBuf>,
    },
    /// Every schedule, by id.
    List {
        /// The workflow store: a SQLite file or a `postgres://` URL.
        #[arg(long, visible_alias = "store")]
        db: Option<PathBuf>,
    },
    /// One schedule.
    Show {
        /// The workflow store: a SQLite file or a `postgres://` URL.
        #[arg(long, visible_alias = "store")]
        db: Option<PathBuf>,
        #[arg(long)]
        schedule_id: String,
    },
    /// Stop a schedule's ticks until it is resumed.
    Pause {
        /// The workflow store: a SQLite file or a `postgres://` URL.
        #[arg(long, visible_alias = "store")]
        db: Option<PathBuf>,
        #[arg(long)]
        schedule_id: String,
    },
    /// Go on from the next tick after now (the ticks of the pause are not started).
    Resume {
        /// The workflow store: a SQLite file or a `postgres://` URL.
        #[arg(long, visible_alias = "store")]
        db: Option<PathBuf>,
        #[arg(long)]
        schedule_id: String,
    },
    /// Delete a schedule (the runs it started stay).
    Delete {
        /// The workflow store: a SQLite file or a `postgres://` URL.
        #[arg(long, visible_alias = "store")]
        db: Option<PathBuf>,
        #[arg(long)]
        schedule_id: String,
    },
    /// One pass of the ticker: start the runs of every due schedule (a worker runs them).
    Tick {
        /// The workflow store: a SQLite file or a `postgres://` URL.
        #[arg(long, visible_alias = "store")]
        db: Option<PathBuf>,
    },
}

fn builtin_version(workflow: &str) -> Result<u32> {
    builtin::version(workflow).ok_or_else(|| {
        Error::invalid(
            workflow_codes::UNKNOWN_WORKFLOW,
            format!("workflow {workflow:?} is not built in; known: {}", builtin::names()),
        )
    })
}

pub fn run(ctx: &Context, command: ScheduleCommand) -> Result<Value> {
    let now = ctx.now_ms();
    match command {
        ScheduleCommand::Put {
            db,
            schedule_id,
            workflow,
            cron,
            interval_ms,
            timezone,
            catch_up,
            input,
            input_file,
        } => {
            let catch_up = CatchUp::parse(&catch_up).ok_or_else(|| {
                Error::invalid(
                    schedule_codes::INVALID_SCHEDULE,
                    format!("--catch-up is skip, one or all, not {catch_up:?}"),
                )
            })?;
            let timing = match (cron, interval_ms) {
                (Some(cron), None) => Timing::Cron(cron),
                (None, Some(ms)) => Timing::IntervalMs(ms),
                _ => unreachable!("clap requires exactly one of --cron and --interval-ms"),
            };
            let input = read_input(input.as_deref(), input_file.as_deref())?;
            let spec = ScheduleSpec { schedule_id, workflow, input, timing, timezone, catch_up };
            spec.validate()?;
            builtin_version(&spec.workflow)?;
            builtin::validate_input(&spec.workflow, &spec.input)?;
            on_store!(open_db(ctx, db)?, |store| {
                let schedule = store.put_schedule(&spec, now)?;
                Ok(json!({"outcome": "scheduled", "schedule": schedule}))
            })
        }
        ScheduleCommand::List { db } => {
            on_store!(open_db(ctx, db)?, |store| Ok(json!({"schedules": store.schedules()?})))
        }
        ScheduleCommand::Show { db, schedule_id } => {
            validate_id("schedule_id", &schedule_id)?;
            on_store!(open_db(ctx, db)?, |store| {
                let schedule = store
                    .schedule(&schedule_id)?
                    .ok_or_else(|| Error::not_found(format!("no schedule {schedule_id:?}")))?;
                let last_run = schedule.last_started_tick_ms.map(|at| tick_run_id(&schedule_id, at));
                Ok(json!({"schedule": schedule, "last_run_id": last_run}))
            })
        }
        ScheduleCommand::Pause { db, schedule_id } => {
            validate_id("schedule_id", &schedule_id)?;
            on_store!(open_db(ctx, db)?, |store| {
                Ok(json!({"outcome": "paused", "schedule": store.pause_schedule(&schedule_id, true, now)?}))
            })
        }
        ScheduleCommand::Resume { db, schedule_id } => {
            validate_id("schedule_id", &schedule_id)?;
            on_store!(open_db(ctx, db)?, |store| {
                Ok(json!({"outcome": "resumed", "schedule": store.pause_schedule(&schedule_id, false, now)?}))
            })
        }
        ScheduleCommand::Delete { db, schedule_id } => {
            validate_id("schedule_id", &schedule_id)?;
            on_store!(open_db(ctx, db)?, |store| {
                if !store.delete_schedule(&schedule_id)? {
                    return Err(Error::not_found(format!("no schedule {schedule_id:?}")));
                }
                Ok(json!({"outcome": "deleted", "schedule_id": schedule_id}))
            })
        }
        ScheduleCommand::Tick { db } => {
            on_store!(open_db(ctx, db)?, |store| {
                let versions: BTreeMap<String, u32> =
                    builtin::BUILTINS.iter().map(|(name, version)| (name.to_string(), *version)).collect();
                let report = tick(&mut store, &versions, now)?;
                Ok(json!({"outcome": "ticked", "report": report}))
            })
        }
    }
}
