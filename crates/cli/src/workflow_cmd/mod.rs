//! `tidemark workflow ...` (runs: start, list, show, operator controls, purge; the order tables
//! and the fake payment service's log) and `tidemark worker` (see `worker.rs`).
//!
//! Like every command: one JSON document on stdout; bad input exits 2 with a stable code and
//! nothing written. Arguments are validated before the database is opened, and only
//! `workflow init` creates a missing database file (every other command answers
//! `not_initialized`).

pub mod worker;

use std::io::Read;
use std::path::{Path, PathBuf};

use clap::{ArgGroup, Subcommand};
use serde_json::{json, Value};
use tidemark_builtins::order::postgres as order_pg;
use tidemark_builtins::order::tables as order_sql;
use tidemark_builtins::workflows as builtin;
use tidemark_core::error::codes;
use tidemark_core::id::{validate_id, validate_limit, validate_reason};
use tidemark_core::limits::{PAGE_SIZE_MAX, PRUNE_BATCH_ROWS_MAX};
use tidemark_core::location::StoreLocation;
use tidemark_core::policy::DAY_MS;
use tidemark_core::workflow::{
    continuation_run_id, deadline_after, validate_json_size, validate_starts, workflow_codes, RunFilter, RunStatus,
    StartOutcome, StartRequest, WorkflowStore, RESULT_WAIT_MS_MAX, RUN_STEPS_MAX, STEP_OUTPUT_BYTES_MAX,
    WORKFLOW_INPUT_BYTES_MAX,
};
use tidemark_core::{Error, Result};
use tidemark_store_postgres::PgWorkflows;
use tidemark_store_sqlite::SqliteWorkflows;

use crate::Context;

pub use worker::WorkerArgs;

/// Rows per table `workflow orders` and `workflow payments` print at most.
const ROWS_MAX: usize = 100_000;
/// Largest stock a SKU may be given.
const STOCK_MAX: i64 = 1_000_000_000_000;

#[derive(Subcommand)]
pub enum WorkflowCommand {
    /// Create (or reopen, never reset) a workflow database with the order tables; optionally
    /// stock one SKU.
    Init {
        /// The workflow store: a SQLite file or a `postgres://` URL (docs/cli.md, "Stores").
        #[arg(long, visible_alias = "store")]
        db: PathBuf,
        #[arg(long, requires = "quantity")]
        sku: Option<String>,
        #[arg(long, requires = "sku")]
        quantity: Option<i64>,
    },
    /// Set the stock of a SKU in the order tables.
    SeedStock {
        /// The workflow store: a SQLite file or a `postgres://` URL (docs/cli.md, "Stores").
        #[arg(long, visible_alias = "store")]
        db: Option<PathBuf>,
        #[arg(long)]
        sku: String,
        #[arg(long)]
        quantity: i64,
    },
    /// Start a run (idempotent per run id: `started` or `existing`).
    #[command(group(ArgGroup::new("input_source").required(true).args(["input", "input_file"])))]
    Start {
        /// The workflow store: a SQLite file or a `postgres://` URL (docs/cli.md, "Stores").
        #[arg(long, visible_alias = "store")]
        db: Option<PathBuf>,
        /// A built-in workflow: order_saga or sleepy_order.
        #[arg(long)]
        workflow: String,
        #[arg(long)]
        run_id: String,
        /// The input as JSON text.
        #[arg(long)]
        input: Option<String>,
        /// The input as a JSON file.
        #[arg(long)]
        input_file: Option<PathBuf>,
        /// Serialization key: at most one active run per key, oldest first.
        #[arg(long)]
        key: Option<String>,
        /// Do not run before this time (ms since the epoch).
        #[arg(long)]
        start_at_ms: Option<i64>,
        /// Run through this declared queue (`tidemark queue put`).
        #[arg(long)]
        queue: Option<String>,
        /// Its priority in the queue (lower first).
        #[arg(long, requires = "queue", default_value_t = 0, allow_negative_numbers = true)]
        priority: i32,
        /// At most one unfinished run of the queue holds this id.
        #[arg(long, requires = "queue")]
        dedup_id: Option<String>,
        /// Cancel the run (a saga compensates first) if it has not ended this many ms after the
        /// start (1..=366 days); its children inherit the deadline.
        #[arg(long)]
        timeout_ms: Option<i64>,
    },
    /// List runs, oldest first, a page at a time (`next_after` is the next page's cursor).
    List {
        /// The workflow store: a SQLite file or a `postgres://` URL (docs/cli.md, "Stores").
        #[arg(long, visible_alias = "store")]
        db: Option<PathBuf>,
        #[arg(long)]
        status: Option<String>,
        #[arg(long)]
        workflow: Option<String>,
        /// Runs created strictly after this time.
        #[arg(long)]
        created_after_ms: Option<i64>,
        /// Runs created strictly before this time.
        #[arg(long)]
        created_before_ms: Option<i64>,
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// The cursor (`next_after`) of the previous page.
        #[arg(long)]
        after: Option<String>,
    },
    /// One run with its journal, every attempt with its error, and its events.
    Show {
        /// The workflow store: a SQLite file or a `postgres://` URL (docs/cli.md, "Stores").
        #[arg(long, visible_alias = "store")]
        db: Option<PathBuf>,
        #[arg(long)]
        run_id: String,
    },
    /// A run's result: its output or terminal error once it has ended, waiting up to
    /// `--wait-ms` (0..=60000) for that; a run that continued as new is followed to the last run
    /// of its chain. `outcome` is `ended` or `not_ended` (ask again).
    Result {
        /// The workflow store: a SQLite file or a `postgres://` URL (docs/cli.md, "Stores").
        #[arg(long, visible_alias = "store")]
        db: Option<PathBuf>,
        #[arg(long)]
        run_id: String,
        #[arg(long, default_value_t = 0)]
        wait_ms: u64,
    },
    /// Request cancellation: a saga compensates first, then the run ends `cancelled`.
    Cancel {
        /// The workflow store: a SQLite file or a `postgres://` URL (docs/cli.md, "Stores").
        #[arg(long, visible_alias = "store")]
        db: Option<PathBuf>,
        #[arg(long)]
        run_id: String,
        #[arg(long)]
        reason: String,
    },
    /// Retry a failed or parked run from its failed step (fresh attempt budget).
    Retry {
        /// The workflow store: a SQLite file or a `postgres://` URL (docs/cli.md, "Stores").
        #[arg(long, visible_alias = "store")]
        db: Option<PathBuf>,
        #[arg(long)]
        run_id: String,
        #[arg(long)]
        reason: String,
    },
    /// Give up on a run: it ends `cancelled`, nothing compensated.
    Abandon {
        /// The workflow store: a SQLite file or a `postgres://` URL (docs/cli.md, "Stores").
        #[arg(long, visible_alias = "store")]
        db: Option<PathBuf>,
        #[arg(long)]
        run_id: String,
        #[arg(long)]
        reason: String,
    },
    /// Start a new run as a copy of a run whose journal keeps the steps before --from-step.
    Fork {
        /// The workflow store: a SQLite file or a `postgres://` URL (docs/cli.md, "Stores").
        #[arg(long, visible_alias = "store")]
        db: Option<PathBuf>,
        #[arg(long)]
        run_id: String,
        /// The journal position (seq) from which the new run executes again.
        #[arg(long)]
        from_step: u32,
        #[arg(long)]
        new_run_id: String,
    },
    /// Mark a failed, retrying or waiting step as skipped with an operator-supplied output.
    Skip {
        /// The workflow store: a SQLite file or a `postgres://` URL (docs/cli.md, "Stores").
        #[arg(long, visible_alias = "store")]
        db: Option<PathBuf>,
        #[arg(long)]
        run_id: String,
        /// The journal position (seq) of the step.
        #[arg(long)]
        step: u32,
        /// The step's output as JSON (default null).
        #[arg(long)]
        output: Option<String>,
        #[arg(long)]
        reason: String,
    },
    /// Send an event to a run (idempotent by --event-id; a fresh id when absent).
    SendEvent {
        /// The workflow store: a SQLite file or a `postgres://` URL (docs/cli.md, "Stores").
        #[arg(long, visible_alias = "store")]
        db: Option<PathBuf>,
        #[arg(long)]
        run_id: String,
        #[arg(long)]
        name: String,
        #[arg(long)]
        event_id: Option<String>,
        /// The payload as JSON.
        #[arg(long)]
        payload: String,
    },
    /// Delete finished runs older than --older-than-ms with their journals (receipts stay).
    Purge {
        /// The workflow store: a SQLite file or a `postgres://` URL (docs/cli.md, "Stores").
        #[arg(long, visible_alias = "store")]
        db: PathBuf,
        #[arg(long, default_value_t = 7 * DAY_MS)]
        older_than_ms: i64,
        #[arg(long, default_value_t = 1_000)]
        batch_rows: usize,
    },
    /// Active runs of workflows or versions this binary does not have.
    Unclaimable {
        /// The workflow store: a SQLite file or a `postgres://` URL (docs/cli.md, "Stores").
        #[arg(long, visible_alias = "store")]
        db: PathBuf,
    },
    /// The order tables: stock, reservations, and every applied effect.
    Orders {
        /// The workflow store: a SQLite file or a `postgres://` URL (docs/cli.md, "Stores").
        #[arg(long, visible_alias = "store")]
        db: PathBuf,
    },
    /// Every call the fake payment service received, with its idempotency key.
    Payments {
        /// The workflow store: a SQLite file or a `postgres://` URL (docs/cli.md, "Stores").
        #[arg(long, visible_alias = "store")]
        db: PathBuf,
        /// Default: `<db stem>.payments.db` beside the database.
        #[arg(long)]
        payments_db: Option<PathBuf>,
    },
}

/// The fake payment service's log beside a workflow database: `wf.db` -> `wf.payments.db`.
pub fn payments_path(db: &Path) -> PathBuf {
    db.with_extension("payments.db")
}

/// Only `workflow init` creates a database; everything else needs it to exist.
pub(crate) fn ensure_exists(db: &Path) -> Result<()> {
    if !db.exists() {
        return Err(Error::invalid(
            codes::NOT_INITIALIZED,
            format!("{} does not exist; run `tidemark workflow init --db {}` first", db.display(), db.display()),
        ));
    }
    Ok(())
}

/// A workflow store a command works on: a SQLite file or a schema on a PostgreSQL server.
pub(crate) enum Store {
    Sqlite(SqliteWorkflows),
    Postgres(Box<PgWorkflows>),
}

/// Run `$body` with `$s` bound to the store, whichever backend it is (the body is compiled once
/// per backend).
macro_rules! on_store {
    ($store:expr, |$s:ident| $body:expr) => {
        match $store {
            #[allow(unused_mut)]
            Store::Sqlite(mut $s) => $body,
            Store::Postgres(boxed) => {
                #[allow(unused_mut)]
                let mut $s = *boxed;
                $body
            }
        }
    };
    (ref $store:expr, |$s:ident| $body:expr) => {
        match $store {
            Store::Sqlite($s) => $body,
            Store::Postgres($s) => $body,
        }
    };
}
pub(crate) use on_store;

pub(crate) use tidemark_lab::stores::location;

fn open(ctx: &Context, db: &Path) -> Result<Store> {
    match location(ctx, db)? {
        StoreLocation::Sqlite(path) => {
            ensure_exists(&path)?;
            Ok(Store::Sqlite(SqliteWorkflows::open_with(&path, ctx.durability)?))
        }
        StoreLocation::Postgres(pg) => Ok(Store::Postgres(Box::new(PgWorkflows::open(&pg.conn, &pg.schema)?))),
    }
}

/// `--db`, which only `--server` does without.
pub(crate) fn open_db(ctx: &Context, db: Option<PathBuf>) -> Result<Store> {
    open(ctx, &crate::file_arg(db, "--db")?)
}

/// The fake payment service's log of a store: `--payments-db`, or beside a SQLite file; a
/// PostgreSQL store has no file to put it beside, so it must be given.
pub(crate) fn payments_of(location: &StoreLocation, given: Option<PathBuf>) -> Result<PathBuf> {
    match (given, location) {
        (Some(path), _) => Ok(path),
        (None, StoreLocation::Sqlite(db)) => Ok(payments_path(db)),
        (None, StoreLocation::Postgres(_)) => {
            Err(invalid("--payments-db is required with a PostgreSQL store (the fake payment service's log is a file)"))
        }
    }
}

fn invalid(message: impl Into<String>) -> Error {
    Error::invalid(codes::INVALID_ARGUMENT, message)
}

/// A JSON argument, or `invalid_input`; `inexact_number` for a number the canonical encoding
/// would change (`tidemark_core::json`).
pub(crate) fn parse_json(field: &str, text: &str) -> Result<Value> {
    let value = serde_json::from_str(text)
        .map_err(|e| Error::invalid(workflow_codes::INVALID_INPUT, format!("{field} is not valid JSON: {e}")))?;
    tidemark_core::json::check_numbers(text.as_bytes())?;
    Ok(value)
}

pub(crate) fn read_input(text: Option<&str>, file: Option<&Path>) -> Result<Value> {
    match (text, file) {
        (Some(text), None) => parse_json("--input", text),
        (None, Some(path)) => {
            let handle =
                std::fs::File::open(path).map_err(|e| invalid(format!("cannot read {}: {e}", path.display())))?;
            let mut bytes = Vec::new();
            handle
                .take(WORKFLOW_INPUT_BYTES_MAX as u64 + 1)
                .read_to_end(&mut bytes)
                .map_err(|e| invalid(format!("cannot read {}: {e}", path.display())))?;
            if bytes.len() > WORKFLOW_INPUT_BYTES_MAX {
                return Err(Error::invalid(
                    workflow_codes::INVALID_INPUT,
                    format!("{} is larger than {WORKFLOW_INPUT_BYTES_MAX} bytes", path.display()),
                ));
            }
            let value = serde_json::from_slice(&bytes).map_err(|e| {
                Error::invalid(workflow_codes::INVALID_INPUT, format!("{} is not valid JSON: {e}", path.display()))
            })?;
            tidemark_core::json::check_numbers(&bytes)?;
            Ok(value)
        }
        _ => Err(invalid("give exactly one of --input and --input-file")),
    }
}

fn validate_stock(sku: &str, quantity: i64) -> Result<()> {
    validate_id("sku", sku)?;
    if !(0..=STOCK_MAX).contains(&quantity) {
        return Err(invalid(format!("--quantity must be 0..={STOCK_MAX}")));
    }
    Ok(())
}

/// Install the order tables (idempotent).
fn install(store: &mut Store) -> Result<()> {
    match store {
        Store::Sqlite(store) => order_sql::install(store.connection()),
        Store::Postgres(store) => {
            let schema = store.schema().to_string();
            order_pg::install(store.client(), &schema)
        }
    }
}

fn seed(store: &mut Store, sku: &str, quantity: i64) -> Result<Value> {
    install(store)?;
    let stock = match store {
        Store::Sqlite(store) => {
            let conn = store.connection();
            order_sql::set_stock(conn, sku, quantity)?;
            order_sql::stock(conn, sku)?
        }
        Store::Postgres(store) => {
            let schema = store.schema().to_string();
            order_pg::set_stock(store.client(), &schema, sku, quantity)?;
            order_pg::stock(store.client(), &schema, sku)?
        }
    };
    Ok(json!({"sku": sku, "stock": stock}))
}

fn run_out(outcome: &str, run: impl serde::Serialize) -> Value {
    json!({"outcome": outcome, "run": run})
}

/// How often `workflow result` reads a run that has not ended.
const RESULT_POLL: std::time::Duration = std::time::Duration::from_millis(100);

pub(crate) fn validate_wait_ms(wait_ms: u64) -> Result<()> {
    if wait_ms > RESULT_WAIT_MS_MAX {
        return Err(invalid(format!("--wait-ms is {wait_ms}; at most {RESULT_WAIT_MS_MAX}")));
    }
    Ok(())
}

pub fn run(ctx: &Context, command: WorkflowCommand) -> Result<Value> {
    let now = ctx.now_ms();
    match command {
        WorkflowCommand::Init { db, sku, quantity } => {
            if let (Some(sku), Some(quantity)) = (&sku, quantity) {
                validate_stock(sku, quantity)?;
            }
            let location = location(ctx, &db)?;
            let (mut store, mut out) = match &location {
                StoreLocation::Sqlite(path) => (
                    Store::Sqlite(SqliteWorkflows::init_with(path, ctx.durability)?),
                    json!({"outcome": "initialized", "db": path, "payments_db": payments_path(path)}),
                ),
                StoreLocation::Postgres(pg) => (
                    Store::Postgres(Box::new(PgWorkflows::init(&pg.conn, &pg.schema)?)),
                    json!({"outcome": "initialized", "db": pg.masked, "schema": pg.schema}),
                ),
            };
            install(&mut store)?;
            if let (Some(sku), Some(quantity)) = (sku, quantity) {
                out["stock"] = seed(&mut store, &sku, quantity)?;
            }
            Ok(out)
        }
        WorkflowCommand::SeedStock { db, sku, quantity } => {
            validate_stock(&sku, quantity)?;
            let mut store = open_db(ctx, db)?;
            let stock = seed(&mut store, &sku, quantity)?;
            Ok(json!({"outcome": "stocked", "stock": stock}))
        }
        WorkflowCommand::Start {
            db,
            workflow,
            run_id,
            input,
            input_file,
            key,
            start_at_ms,
            queue,
            priority,
            dedup_id,
            timeout_ms,
        } => {
            validate_id("run_id", &run_id)?;
            validate_id("workflow", &workflow)?;
            let deadline_ms = deadline_after(now, timeout_ms)?;
            let version = builtin::version(&workflow).ok_or_else(|| {
                Error::invalid(
                    workflow_codes::UNKNOWN_WORKFLOW,
                    format!("workflow {workflow:?} is not built in; known: {}", builtin::names()),
                )
            })?;
            let input = read_input(input.as_deref(), input_file.as_deref())?;
            let queue = queue.map(|queue| tidemark_core::queue::Enqueue { queue, priority, dedup_id });
            let request = StartRequest { run_id, workflow, version, input, key, start_at_ms, queue, deadline_ms };
            validate_starts(std::slice::from_ref(&request), now)?;
            builtin::validate_input(&request.workflow, &request.input)?;
            let outcome = on_store!(open_db(ctx, db)?, |store| store.start_runs(&[request], now)?.remove(0));
            match outcome {
                StartOutcome::Conflict { run_id, reason } => {
                    Err(Error::invalid(workflow_codes::RUN_CONFLICT, format!("run {run_id:?}: {reason}")))
                }
                outcome => Ok(serde_json::to_value(&outcome).expect("outcomes serialise")),
            }
        }
        WorkflowCommand::List { db, status, workflow, created_after_ms, created_before_ms, limit, after } => {
            let status = status
                .map(|s| {
                    RunStatus::parse(&s).ok_or_else(|| {
                        let known: Vec<&str> = RunStatus::ALL.iter().map(|s| s.as_str()).collect();
                        invalid(format!("unknown run status {s:?}; known: {}", known.join(", ")))
                    })
                })
                .transpose()?;
            if let Some(workflow) = &workflow {
                validate_id("workflow", workflow)?;
            }
            validate_limit("--limit", limit, PAGE_SIZE_MAX)?;
            let after = after.as_deref().map(RunFilter::parse_page).transpose()?;
            let filter = RunFilter { status, workflow, created_after_ms, created_before_ms, after };
            let runs = on_store!(open_db(ctx, db)?, |store| store.list_runs(&filter, limit)?);
            let next_after = RunFilter::next_page(&runs, limit);
            Ok(json!({"outcome": "listed", "runs": runs, "next_after": next_after}))
        }
        WorkflowCommand::Show { db, run_id } => {
            validate_id("run_id", &run_id)?;
            let detail = on_store!(open_db(ctx, db)?, |store| store.run(&run_id)?)
                .ok_or_else(|| Error::not_found(format!("no run {run_id:?}")))?;
            let mut out = serde_json::to_value(&detail).expect("runs serialise");
            out["outcome"] = json!("found");
            Ok(out)
        }
        WorkflowCommand::Result { db, run_id, wait_ms } => {
            validate_id("run_id", &run_id)?;
            validate_wait_ms(wait_ms)?;
            let store = open_db(ctx, db)?;
            let deadline = std::time::Instant::now() + std::time::Duration::from_millis(wait_ms);
            let mut id = run_id;
            loop {
                let run = on_store!(ref &store, |store| store.run(&id)?)
                    .ok_or_else(|| Error::not_found(format!("no run {id:?}")))?
                    .run;
                if run.status == RunStatus::Continued {
                    id = continuation_run_id(&id);
                    continue;
                }
                let done = run.status.is_terminal();
                if done || std::time::Instant::now() >= deadline {
                    return Ok(json!({
                        "outcome": if done { "ended" } else { "not_ended" },
                        "run_id": run.run_id,
                        "done": done,
                        "status": run.status,
                        "result": run.result,
                        "error": run.error,
                    }));
                }
                std::thread::sleep(RESULT_POLL.min(deadline.saturating_duration_since(std::time::Instant::now())));
            }
        }
        WorkflowCommand::Cancel { db, run_id, reason } => {
            validate_id("run_id", &run_id)?;
            validate_reason(&reason)?;
            Ok(run_out("cancel_requested", on_store!(open_db(ctx, db)?, |store| store.cancel(&run_id, &reason, now)?)))
        }
        WorkflowCommand::Retry { db, run_id, reason } => {
            validate_id("run_id", &run_id)?;
            validate_reason(&reason)?;
            Ok(run_out("retried", on_store!(open_db(ctx, db)?, |store| store.retry(&run_id, &reason, now)?)))
        }
        WorkflowCommand::Abandon { db, run_id, reason } => {
            validate_id("run_id", &run_id)?;
            validate_reason(&reason)?;
            Ok(run_out("abandoned", on_store!(open_db(ctx, db)?, |store| store.abandon(&run_id, &reason, now)?)))
        }
        WorkflowCommand::Fork { db, run_id, from_step, new_run_id } => {
            validate_id("run_id", &run_id)?;
            validate_id("new_run_id", &new_run_id)?;
            if from_step > RUN_STEPS_MAX {
                return Err(Error::invalid(codes::INVALID_SEQ, format!("--from-step must be 0..={RUN_STEPS_MAX}")));
            }
            Ok(run_out(
                "forked",
                on_store!(open_db(ctx, db)?, |store| store.fork(&run_id, from_step, &new_run_id, now)?),
            ))
        }
        WorkflowCommand::Skip { db, run_id, step, output, reason } => {
            validate_id("run_id", &run_id)?;
            validate_reason(&reason)?;
            if step >= RUN_STEPS_MAX {
                return Err(Error::invalid(codes::INVALID_SEQ, format!("--step must be 0..{RUN_STEPS_MAX}")));
            }
            let output = match output {
                Some(text) => parse_json("--output", &text)?,
                None => Value::Null,
            };
            validate_json_size("--output", &output, STEP_OUTPUT_BYTES_MAX, codes::PAYLOAD_TOO_LARGE)?;
            let skipped =
                on_store!(open_db(ctx, db)?, |store| store.skip_step(&run_id, step, &output, &reason, now)?);
            Ok(run_out("skipped", skipped))
        }
        WorkflowCommand::SendEvent { db, run_id, name, event_id, payload } => {
            validate_id("run_id", &run_id)?;
            validate_id("event name", &name)?;
            let event_id = event_id.unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
            validate_id("event_id", &event_id)?;
            let payload = parse_json("--payload", &payload)?;
            validate_json_size("--payload", &payload, WORKFLOW_INPUT_BYTES_MAX, codes::PAYLOAD_TOO_LARGE)?;
            let new =
                on_store!(open_db(ctx, db)?, |store| store.send_event(&run_id, &event_id, &name, &payload, now)?);
            Ok(json!({
                "outcome": if new { "sent" } else { "duplicate" },
                "run_id": run_id,
                "event_id": event_id,
                "name": name,
            }))
        }
        WorkflowCommand::Purge { db, older_than_ms, batch_rows } => {
            validate_limit("--batch-rows", batch_rows, PRUNE_BATCH_ROWS_MAX)?;
            if older_than_ms < 0 {
                return Err(invalid("--older-than-ms must be >= 0"));
            }
            let mut store = open(ctx, &db)?;
            let finished_before_ms = now.saturating_sub(older_than_ms);
            let (mut runs_deleted, mut journal_deleted, mut batches) = (0_u64, 0_u64, 0_u64);
            // Bounded: every batch that reports `more` deleted rows.
            loop {
                batches += 1;
                let report = on_store!(ref &mut store, |store| store.purge(finished_before_ms, batch_rows, now)?);
                runs_deleted += report.runs_deleted;
                journal_deleted += report.journal_deleted;
                if !report.more {
                    break;
                }
            }
            Ok(json!({
                "outcome": "purged",
                "finished_before_ms": finished_before_ms,
                "runs_deleted": runs_deleted,
                "journal_deleted": journal_deleted,
                "batches": batches,
            }))
        }
        WorkflowCommand::Unclaimable { db } => {
            let unclaimable = on_store!(open(ctx, &db)?, |store| store.unclaimable(&builtin::versions())?);
            Ok(json!({"outcome": "listed", "known": builtin::versions(), "unclaimable": unclaimable}))
        }
        WorkflowCommand::Orders { db } => {
            let mut out = match open(ctx, &db)? {
                Store::Sqlite(mut store) => order_sql::tables(store.connection(), ROWS_MAX)?,
                Store::Postgres(mut store) => {
                    let schema = store.schema().to_string();
                    order_pg::tables(store.client(), &schema, ROWS_MAX)?
                }
            };
            out["outcome"] = json!("listed");
            Ok(out)
        }
        WorkflowCommand::Payments { db, payments_db } => {
            let location = location(ctx, &db)?;
            if let StoreLocation::Sqlite(path) = &location {
                ensure_exists(path)?;
            }
            let path = payments_of(&location, payments_db)?;
            // A missing log means no call yet; it is not created here.
            let calls =
                if path.exists() { order_sql::payment_calls(&order_sql::open_payments(&path)?)? } else { Vec::new() };
            Ok(json!({"outcome": "listed", "payments_db": path, "calls": calls}))
        }
    }
}
