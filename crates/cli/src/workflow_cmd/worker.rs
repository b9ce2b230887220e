//! `tidemark worker`: runs the built-in workflows on a workflow database.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use serde_json::{json, Value};
use tidemark_builtins::order::postgres as order_pg;
use tidemark_builtins::order::tables as order_sql;
use tidemark_builtins::order::OrderTx;
use tidemark_builtins::order::{FakePayments, Payments};
use tidemark_core::error::codes;
use tidemark_core::location::StoreLocation;
use tidemark_core::schedule::ScheduleStore;
use tidemark_core::workflow::WorkflowStore;
use tidemark_core::{Error, Result};
use tidemark_engine::workflow::{system_clock, tick_schedules, Clock, Worker, WorkerOptions, WorkerReport, Writer};
use tidemark_store_postgres::{DueRunListener, PgWorkflows};
use tidemark_store_sqlite::SqliteWorkflows;

use super::{ensure_exists, location, payments_of};
use crate::Context;
use tidemark_builtins::workflows as builtin;

/// Upper bound of `--idle-wait-ms` (an hour).
const IDLE_WAIT_MS_MAX: u64 = 3_600_000;
/// How often a long-running worker ticks the database's schedules, in ms (as `tidemark serve`).
const SCHEDULE_TICK_MS: u64 = 1_000;
/// Upper bound of `--max-seconds` (a year).
const MAX_SECONDS_MAX: u64 = 366 * 24 * 60 * 60;

#[derive(Args)]
pub struct WorkerArgs {
    /// The workflow store (created by `tidemark workflow init`): a SQLite file or a
    /// `postgres://` URL, where any number of workers on any number of machines share the runs.
    #[arg(long, visible_alias = "store")]
    db: PathBuf,
    /// The fake payment service's call log (created if missing); default: `<db stem>.payments.db`
    /// beside a SQLite database (required with a PostgreSQL store).
    #[arg(long)]
    payments_db: Option<PathBuf>,
    /// The lease owner's name; default `worker-<pid>`.
    #[arg(long)]
    worker_id: Option<String>,
    /// Runs in flight at once.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Lease length; heartbeats every third of it. A killed worker's runs are taken over once
    /// its leases expire.
    #[arg(long, default_value_t = 30_000)]
    lease_ms: i64,
    /// Pause between claims when nothing is due.
    #[arg(long, default_value_t = 200)]
    poll_ms: u64,
    /// Stop when nothing is due and nothing is in flight (runs waiting for a later time or an
    /// event are not due); SIGINT/SIGTERM stop it gracefully before that. Without it the worker
    /// runs until SIGINT/SIGTERM or --max-seconds.
    #[arg(long, conflicts_with = "max_seconds")]
    until_idle: bool,
    /// With --until-idle: keep going until nothing was claimed for this long (a retry backoff,
    /// a short timer or a dead worker's lease shorter than this does not end the worker).
    #[arg(long, requires = "until_idle", default_value_t = 0)]
    idle_wait_ms: u64,
    /// Stop after this many seconds (graceful: in-flight runs are stopped and released).
    #[arg(long)]
    max_seconds: Option<u64>,
    /// Attempts per step, the first included.
    #[arg(long, default_value_t = 5)]
    max_attempts: u32,
    /// A fixed delay between attempts of a step (default: exponential 1 s x 5^(n-1), jittered).
    #[arg(long)]
    retry_delay_ms: Option<i64>,
}

pub fn run(ctx: &Context, args: WorkerArgs) -> Result<Value> {
    // Everything is validated before a file is touched.
    let worker_id = args.worker_id.clone().unwrap_or_else(|| format!("worker-{}", std::process::id()));
    let options = WorkerOptions {
        worker_id,
        concurrency: args.concurrency,
        lease_ms: args.lease_ms,
        poll_interval_ms: args.poll_ms,
        heartbeat_ms: None,
    };
    options.validate()?;
    let retry = builtin::retry_policy(args.max_attempts, args.retry_delay_ms)?;
    if args.idle_wait_ms > IDLE_WAIT_MS_MAX {
        return Err(Error::invalid(codes::INVALID_ARGUMENT, format!("--idle-wait-ms must be 0..={IDLE_WAIT_MS_MAX}")));
    }
    if let Some(seconds) = args.max_seconds {
        if seconds == 0 || seconds > MAX_SECONDS_MAX {
            return Err(Error::invalid(
                codes::INVALID_ARGUMENT,
                format!("--max-seconds must be 1..={MAX_SECONDS_MAX}"),
            ));
        }
    }
    // The runtime and the signal handlers before the store opens (a PostgreSQL connection and its
    // migrations can take a while): a SIGINT or SIGTERM meanwhile stops the worker gracefully as
    // soon as it is ready, before it claims anything, instead of killing it by the signal's
    // default action.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::io(format!("cannot start the async runtime: {e}")))?;
    let signals = {
        let _entered = runtime.enter();
        Signals::install()?
    };
    let process = Process { runtime, signals };
    let location = location(ctx, &args.db)?;
    if let StoreLocation::Sqlite(path) = &location {
        ensure_exists(path)?;
    }
    let payments_db = payments_of(&location, args.payments_db.clone())?;
    let payments: Arc<dyn Payments> = Arc::new(FakePayments::open(&payments_db)?);
    let clock: Clock = match ctx.fixed_now_ms {
        Some(now) => Arc::new(move || now),
        None => system_clock(),
    };
    let mut out = match location {
        StoreLocation::Sqlite(path) => {
            let durability = ctx.durability;
            let writer = Writer::spawn_with_clock(move || SqliteWorkflows::open_with(&path, durability), clock)?;
            writer.call_blocking(|store, _| order_sql::install(store.connection()))?;
            let left = |store: &mut SqliteWorkflows| tidemark_store_sqlite::stats::active_runs(store.connection());
            let workflows = builtin::workflows(payments, &retry)?;
            work(process, writer, workflows, &options, &args, left, |_| Ok(None))?
        }
        StoreLocation::Postgres(pg) => {
            let (conn, schema) = (pg.conn.clone(), pg.schema.clone());
            let writer = Writer::spawn_with_clock(move || PgWorkflows::open(&conn, &schema), clock)?;
            writer.call_blocking(|store, _| {
                let schema = store.schema().to_string();
                order_pg::install(store.client(), &schema)
            })?;
            // Starts and events from other processes wake this worker at once (LISTEN/NOTIFY, a
            // hint: its polls still find every due run).
            let listen = move |wake: Waker| DueRunListener::spawn(&pg.conn, &pg.schema, wake).map(Some);
            let workflows = builtin::workflows(payments, &retry)?;
            work(process, writer, workflows, &options, &args, PgWorkflows::active_runs, listen)?
        }
    };
    out["files"] = json!({"db": args.db, "payments_db": payments_db});
    Ok(out)
}

/// What wakes the worker from outside.
type Waker = Box<dyn Fn() + Send + 'static>;

/// Runs still active, by status, and the earliest time one of them is due.
type ActiveRuns = (std::collections::BTreeMap<String, u64>, Option<i64>);

/// The worker's async runtime and its signal handlers, set up before the store opens.
struct Process {
    runtime: tokio::runtime::Runtime,
    signals: Signals,
}

/// SIGINT and SIGTERM, caught from the moment they are installed (elsewhere: Ctrl-C).
struct Signals {
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
}

impl Signals {
    /// Install the handlers (inside a runtime's context).
    fn install() -> Result<Signals> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let install = |kind| signal(kind).map_err(|e| Error::io(format!("cannot install a signal handler: {e}")));
            Ok(Signals { interrupt: install(SignalKind::interrupt())?, terminate: install(SignalKind::terminate())? })
        }
        #[cfg(not(unix))]
        Ok(Signals {})
    }

    /// Resolves at the first signal (one that came before this call included).
    async fn received(self) {
        #[cfg(unix)]
        {
            let Signals { mut interrupt, mut terminate } = self;
            tokio::select! {
                _ = interrupt.recv() => {}
                _ = terminate.recv() => {}
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// The worker loop on a store behind `writer`; `left` reads what is still active at the end.
fn work<S>(
    process: Process,
    writer: Writer<S>,
    workflows: tidemark_engine::workflow::Workflows<S>,
    options: &WorkerOptions,
    args: &WorkerArgs,
    left: fn(&mut S) -> Result<ActiveRuns>,
    listen: impl FnOnce(Waker) -> Result<Option<DueRunListener>>,
) -> Result<Value>
where
    S: WorkflowStore + ScheduleStore + Send + 'static,
    S::Target: OrderTx + 'static,
{
    let worker = Worker::new(writer.clone(), workflows, options.clone())?;
    let listener = listen(Box::new(worker.waker()))?;
    let Process { runtime, signals } = process;

    let stopped_by = Arc::new(Mutex::new("idle"));
    let (ticks_started, tick_errors) = (AtomicU64::new(0), AtomicU64::new(0));
    let report = runtime.block_on(async {
        if args.until_idle {
            // A signal stops the worker gracefully here too: the round in progress stops its
            // runs and releases their leases, and no other round starts.
            let (signalled, mut signal) = tokio::sync::watch::channel(false);
            let stop = shutdown(signals, None, stopped_by.clone());
            tokio::spawn(async move {
                stop.await;
                let _ = signalled.send(true);
            });
            // Bounded by the runs themselves: every round that claims something moves a run
            // through its finite steps and attempts.
            let idle_wait = Duration::from_millis(args.idle_wait_ms);
            let mut total = WorkerReport::default();
            let mut quiet_since = Instant::now();
            loop {
                let mut round_signal = signal.clone();
                let stopped = async move {
                    let _ = round_signal.wait_for(|s| *s).await;
                };
                let round = worker.run_until_idle_or(stopped).await?;
                if round.claimed > 0 {
                    quiet_since = Instant::now();
                }
                total.merge(round);
                if *signal.borrow() || quiet_since.elapsed() >= idle_wait {
                    return Ok(total);
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(args.poll_ms)) => {}
                    _ = signal.wait_for(|s| *s) => return Ok(total),
                }
            }
        }
        let stop = shutdown(signals, args.max_seconds.map(Duration::from_secs), stopped_by.clone());
        // A long-running worker also ticks the database's schedules, as `tidemark serve` does.
        let ticking = async {
            loop {
                tokio::time::sleep(Duration::from_millis(SCHEDULE_TICK_MS)).await;
                match tick_schedules(worker.writer(), worker.workflows()).await {
                    Ok(report) => ticks_started.fetch_add(report.started, Ordering::Relaxed),
                    Err(_) => tick_errors.fetch_add(1, Ordering::Relaxed),
                };
            }
        };
        tokio::select! {
            report = worker.run_until(stop) => report,
            never = ticking => never,
        }
    })?;
    drop(listener);
    drop(worker);
    let (active, next_wake_at_ms) = writer.call_blocking(move |store, _| left(store))?;
    drop(writer);
    drop(runtime);

    let mut out = serde_json::to_value(&report).expect("the report serialises");
    out["outcome"] = json!("worked");
    out["worker_id"] = json!(options.worker_id);
    out["stopped_by"] = json!(*stopped_by.lock().unwrap_or_else(|p| p.into_inner()));
    out["left"] = json!({"active": active, "next_wake_at_ms": next_wake_at_ms});
    out["schedules"] = json!({
        "runs_started": ticks_started.load(Ordering::Relaxed),
        "tick_errors": tick_errors.load(Ordering::Relaxed),
    });
    Ok(out)
}

/// Resolves on SIGINT, SIGTERM (installed before the store opened, so a signal at any point
/// stops the worker gracefully) or after `max`.
async fn shutdown(signals: Signals, max: Option<Duration>, stopped_by: Arc<Mutex<&'static str>>) {
    let signal = signals.received();
    let deadline = async move {
        match max {
            Some(max) => tokio::time::sleep(max).await,
            None => std::future::pending().await,
        }
    };
    let why = tokio::select! {
        _ = signal => "signal",
        _ = deadline => "max_seconds",
    };
    *stopped_by.lock().unwrap_or_else(|p| p.into_inner()) = why;
}
