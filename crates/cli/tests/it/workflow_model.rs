//! The workflow runtime against a model: random workflows (external and transactional steps that
//! fail a few times, then succeed or fail for good; durable sleeps; sagas whose compensations may
//! fail too; child workflows, whose failure is their parent's; runs that continue as new once or
//! twice, each generation doing the same steps; all of a case's runs through one queue with a
//! concurrency limit of 1 or 2, sampled in every poll's listing to stay within it; a schedule of
//! one plain run's workflow ticked one to three times, each tick twice, by a ticker on a virtual
//! clock while the workers run and crash: exactly one run per tick), started in a
//! random order, on workers that crash at random points (a step's body
//! blocks and the worker's runtime is torn down; a transactional step's body runs and its
//! transaction never commits; a worker killed at a random moment). A new worker (another id)
//! takes the runs over once the leases have expired. A pure model says what each run must end
//! as: `completed` with its outputs, `failed`, `compensated` with exactly the compensations of
//! the completed steps in reverse order (after the failed step's own when it was an external
//! step out of attempts), `parked` (a compensation out of attempts), or
//! `continued` (and what its continuation must end as); which children and continuations exist,
//! with their own journals, and nothing else. The real
//! SQLite store must agree: status, journal (names, kinds, statuses, attempts, in order), the
//! attempt history, each transactional step's row written exactly once, every external attempt
//! of a step with the same idempotency key, nothing left leased.
//!
//! Up to two workers run at once (each with its own connection), and a transactional body may
//! stall the writer thread past a lease, so live workers lose leases and are fenced too.
//!
//! Bounded: `PROPTEST_CASES` cases (default 32 on SQLite, 16 on PostgreSQL), each a few runs;
//! every wait is a bounded loop. `MODEL_VERBOSE=1` prints one line per case (crashes, stalls,
//! final statuses).
//!
//! The same cases run on the PostgreSQL store (`runs_end_as_the_model_says_on_postgres`, a schema
//! of its own per case on the server of `TIDEMARK_TEST_POSTGRES`, skipped when it does not
//! answer): each worker's writer is a connection of its own, as each process has, and the crash
//! of a transactional body ends the PostgreSQL transaction the same way.
//!
//! How a crash is made: an external body blocks for ever and the driver shuts the incarnation's
//! tokio runtime down (its leases stay and expire); a transactional body blocks on the writer
//! thread inside the journal's transaction, the driver shuts the runtime down and lets the body
//! go, and the body ends the transaction with `ROLLBACK` (the store then refuses the batch): on
//! disk, exactly what a crash before the commit leaves. Attempt numbers come from the journal
//! (an attempt cut short by a crash is not counted), so the model needs no knowledge of timing.

use std::collections::HashSet;
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::time::Duration;

use proptest::prelude::*;
use rusqlite::params;
use serde_json::{json, Map, Value};
use tidemark_core::queue::{Enqueue, QueueSpec, QueueStore};
use tidemark_core::schedule::{CatchUp, ScheduleSpec, ScheduleStore, Timing};
use tidemark_core::workflow::{
    child_run_id, continuation_run_id, Backoff, RetryPolicy, RunDetail, RunFilter, RunRecord, RunStatus, StartOutcome,
    StartRequest, StepFailure, StepKind, StepStatus, WorkflowStore,
};
use tidemark_engine::now_ms;
use tidemark_engine::workflow::tokio::runtime::{Builder, Runtime};
use tidemark_engine::workflow::tokio::sync::oneshot;
use tidemark_engine::workflow::{
    Saga, SagaAction, SagaData, Worker, WorkerOptions, WorkflowOptions, Workflows, Writer,
};
use tidemark_store_postgres::{ApplyTransaction, PgWorkflows};
use tidemark_store_sqlite::{Durability, SqliteWorkflows};

/// What the model needs of a backend besides the store trait: a transactional body's own
/// statements on the store's handle (read the journal's attempts of its step, write its row, end
/// the transaction the way a crash before the commit leaves it), and the test's table of rows.
trait ModelStore: WorkflowStore + QueueStore + ScheduleStore + Send + 'static
where
    Self::Target: 'static,
{
    /// Attempts the journal records for step `name` of `run_id`, read in the journal's transaction.
    fn journaled_attempts(tx: &Self::Target, run_id: &str, name: &str) -> u32;
    /// One `model_rows` row, in the journal's transaction.
    fn insert_row(tx: &Self::Target, run_id: &str, name: &str, attempt: u32) -> Result<(), StepFailure>;
    /// End the journal's transaction without committing (the store then refuses the batch).
    fn end_transaction(tx: &Self::Target);
    fn create_rows_table(&mut self);
    /// Every `model_rows` row: (run_id, name, attempt), in insertion order.
    fn rows(&mut self) -> Vec<(String, String, u32)>;
}

impl ModelStore for SqliteWorkflows {
    fn journaled_attempts(tx: &rusqlite::Connection, run_id: &str, name: &str) -> u32 {
        tx.query_row(
            "SELECT coalesce(max(attempts), 0) FROM journal WHERE run_id = ?1 AND name = ?2",
            params![run_id, name],
            |r| r.get(0),
        )
        .expect("read the journal")
    }

    fn insert_row(tx: &rusqlite::Connection, run_id: &str, name: &str, attempt: u32) -> Result<(), StepFailure> {
        tx.execute("INSERT INTO model_rows (run_id, name, attempt) VALUES (?1, ?2, ?3)", params![run_id, name, attempt])
            .map(drop)
            .map_err(|e| StepFailure::retryable(e.to_string()))
    }

    fn end_transaction(tx: &rusqlite::Connection) {
        tx.execute_batch("ROLLBACK").expect("end the transaction");
    }

    fn create_rows_table(&mut self) {
        self.connection()
            .execute_batch(
                "CREATE TABLE model_rows (run_id TEXT NOT NULL, name TEXT NOT NULL, attempt INTEGER NOT NULL)",
            )
            .unwrap();
    }

    fn rows(&mut self) -> Vec<(String, String, u32)> {
        let conn = self.connection();
        let mut stmt = conn.prepare("SELECT run_id, name, attempt FROM model_rows ORDER BY rowid").unwrap();
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).unwrap();
        rows.collect::<rusqlite::Result<Vec<_>>>().unwrap()
    }
}

impl ModelStore for PgWorkflows {
    fn journaled_attempts(tx: &ApplyTransaction, run_id: &str, name: &str) -> u32 {
        let query = format!(
            "SELECT coalesce(max(attempts), 0) FROM \"{}\".journal WHERE run_id = $1 AND name = $2",
            tx.schema()
        );
        let attempts: i32 = tx.query_one(&query, &[&run_id, &name]).expect("read the journal").get(0);
        attempts as u32
    }

    fn insert_row(tx: &ApplyTransaction, run_id: &str, name: &str, attempt: u32) -> Result<(), StepFailure> {
        let insert = format!("INSERT INTO \"{}\".model_rows (run_id, name, attempt) VALUES ($1, $2, $3)", tx.schema());
        tx.execute(&insert, &[&run_id, &name, &(attempt as i32)]).map(drop).map_err(StepFailure::from)
    }

    fn end_transaction(tx: &ApplyTransaction) {
        tx.batch_execute("ROLLBACK").expect("end the transaction");
    }

    fn create_rows_table(&mut self) {
        let schema = self.schema().to_string();
        self.client()
            .batch_execute(&format!(
                "CREATE TABLE \"{schema}\".model_rows (n bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                     run_id text NOT NULL, name text NOT NULL, attempt integer NOT NULL)"
            ))
            .unwrap();
    }

    fn rows(&mut self) -> Vec<(String, String, u32)> {
        let schema = self.schema().to_string();
        let rows = self
            .client()
            .query(&format!("SELECT run_id, name, attempt FROM \"{schema}\".model_rows ORDER BY n"), &[])
            .unwrap();
        rows.iter().map(|r| (r.get(0), r.get(1), r.get::<_, i32>(2) as u32)).collect()
    }
}

/// Opens another store (connection) on the case's database: one per worker's writer.
type Opener<S> = Arc<dyn Fn() -> tidemark_core::Result<S> + Send + Sync>;

/// Attempts of a forward step, and of a compensation.
const STEP_ATTEMPTS: u32 = 3;
/// The patch point of the saga rule that compensates an external step that failed at its last
/// attempt (docs/workflows.md, "Sagas").
const SAGA_OUT_OF_ATTEMPTS_PATCH: &str = "saga-compensates-out-of-attempts";
const COMPENSATION_ATTEMPTS: u32 = 3;
/// Short leases, so that a crashed worker's runs are taken over quickly; heartbeats often, so
/// that a live worker keeps its leases through a long scheduling stall.
const LEASE_MS: i64 = 400;
const HEARTBEAT_MS: u64 = 40;
/// How long a stalling transactional body holds the writer thread.
const STALL: Duration = Duration::from_millis(LEASE_MS as u64 + 300);
/// Worker incarnations per case (each crash starts a new one), and polls of ~1 ms per incarnation.
const INCARNATIONS_MAX: u32 = 20;
const TICKS_MAX: u64 = 30_000;
/// How long a blocked transactional body waits to be let go before it goes on by itself.
const SIGNAL_WAIT: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------------------------
// The generated cases.

/// How an action ends after its retryable failures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Ok,
    Permanent,
}

/// A step's action or a compensation: `fails` retryable failures, then `end`.
#[derive(Debug, Clone)]
struct Action {
    tx: bool,
    fails: u32,
    end: End,
    /// (Transactional only.) The first time it runs, the body holds the writer thread longer
    /// than a lease: heartbeats stall, leases expire, other workers take runs over, the stalled
    /// worker's later writes are fenced.
    stall: bool,
}

#[derive(Debug, Clone)]
enum Elem {
    /// A step `s{i}` with an optional compensation (used by sagas only).
    Step {
        action: Action,
        undo: Option<Action>,
    },
    Sleep {
        ms: u64,
    },
    /// (Plain workflows only.) A child workflow `wf-{run}-c{i}` of these steps, awaited with
    /// `ctx.child`; its failure is this step's.
    Child {
        steps: Vec<Action>,
    },
}

#[derive(Debug, Clone)]
struct RunSpec {
    saga: bool,
    elems: Vec<Elem>,
    /// Crash the worker the first time the body of element `.0` (its compensation when `.1`)
    /// runs.
    crash: Option<(usize, bool)>,
    /// (Plain workflows only.) After its elements, the run continues as a new run this many
    /// times (`ctx.continue_as_new`), each generation doing the same elements.
    continues: u32,
}

#[derive(Debug, Clone)]
struct Case {
    runs: Vec<RunSpec>,
    /// The order runs are started in; the first `first_batch` before any worker runs, the rest
    /// while the first one works.
    order: Vec<usize>,
    first_batch: usize,
    /// Kill the n-th incarnation of the workers after about this many ms, whatever it does.
    kills: Vec<u64>,
    /// Workers per incarnation (each with its own connection), and runs in flight per worker.
    workers: usize,
    concurrency: usize,
    /// Every run (and continuation) goes through queue `q` with this concurrency limit, the
    /// run's index mod 3 as its priority.
    queue: Option<u32>,
    /// A schedule `run-{.0}-tick` every second of the workflow of (plain) run `.0`, ticked `.1` times
    /// (each tick twice, by two tickers) while the workers run and crash: each tick starts one run
    /// `run-{.0}-tick:<ms>`, which must end as run `.0` does.
    schedule: Option<(usize, u32)>,
}

fn action(undo: bool) -> impl Strategy<Value = Action> {
    let out_of_attempts = if undo { COMPENSATION_ATTEMPTS } else { STEP_ATTEMPTS };
    let fails = prop_oneof![4 => Just(0_u32), 2 => Just(1), 1 => Just(2), 1 => Just(out_of_attempts)];
    let permanent = if undo { 1 } else { 2 };
    let end = prop_oneof![12 => Just(End::Ok), permanent => Just(End::Permanent)];
    let stall = proptest::bool::weighted(0.04);
    (any::<bool>(), fails, end, stall).prop_map(|(tx, fails, end, stall)| Action { tx, fails, end, stall: tx && stall })
}

fn elem() -> impl Strategy<Value = Elem> {
    prop_oneof![
        8 => (action(false), proptest::option::weighted(0.7, action(true)))
            .prop_map(|(action, undo)| Elem::Step { action, undo }),
        2 => (0_u64..=3).prop_map(|ms| Elem::Sleep { ms }),
        1 => proptest::collection::vec(action(false), 1..=2).prop_map(|steps| Elem::Child { steps }),
    ]
}

fn run_spec() -> impl Strategy<Value = RunSpec> {
    (
        any::<bool>(),
        proptest::collection::vec(elem(), 1..=4),
        proptest::option::weighted(0.6, (0_usize..4, any::<bool>())),
        prop_oneof![6 => Just(0_u32), 1 => Just(1), 1 => Just(2)],
    )
        .prop_map(|(saga, mut elems, crash, continues)| {
            // A saga needs at least one step, and has neither children nor continuations.
            let saga = saga && elems.iter().any(|e| matches!(e, Elem::Step { .. }));
            if saga {
                elems.retain(|e| !matches!(e, Elem::Child { .. }));
            }
            RunSpec { saga, elems, crash, continues: if saga { 0 } else { continues } }
        })
}

fn case() -> impl Strategy<Value = Case> {
    proptest::collection::vec(run_spec(), 1..=4).prop_flat_map(|runs| {
        let n = runs.len();
        (
            Just(runs),
            Just((0..n).collect::<Vec<usize>>()).prop_shuffle(),
            1..=n,
            proptest::collection::vec(1_u64..40, 0..=2),
            1_usize..=2,
            prop_oneof![Just(1_usize), Just(2), Just(8)],
            proptest::option::weighted(0.3, 1_u32..=2),
            proptest::option::weighted(0.3, (0..n, 1_u32..=3)),
        )
            .prop_map(|(runs, order, first_batch, kills, workers, concurrency, queue, schedule)| {
                // A plain run's workflow (a saga's actions learn their run id only from the
                // idempotency key, and the model's transactional rows need it).
                let schedule = schedule.and_then(|(run, ticks)| {
                    let plain = (run..runs.len()).chain(0..run).find(|&r| !runs[r].saga)?;
                    Some((plain, ticks))
                });
                Case { runs, order, first_batch, kills, workers, concurrency, queue, schedule }
            })
    })
}

// ---------------------------------------------------------------------------------------------
// The model.

fn run_id(run: usize) -> String {
    format!("run-{run}")
}

/// The top-level run a run id belongs to (`run-3`, `run-3.c1`, `run-3.2`, ...: 3).
fn run_index(run_id: &str) -> usize {
    let digits: String = run_id.trim_start_matches("run-").chars().take_while(char::is_ascii_digit).collect();
    digits.parse().expect("a model run id")
}

fn workflow_name(run: usize) -> String {
    format!("wf-{run}")
}

fn step_name(elem: usize) -> String {
    format!("s{elem}")
}

fn compensation_name(elem: usize) -> String {
    format!("compensate:s{elem}")
}

fn child_workflow_name(run: usize, elem: usize) -> String {
    format!("wf-{run}-c{elem}")
}

/// The queue of a case's runs.
const QUEUE: &str = "q";

/// The schedule of a case (on the workflow of run `run`).
fn schedule_id(run: usize) -> String {
    format!("run-{run}-tick")
}

/// The interval of a case's schedule; its virtual clock starts this long before the case.
const TICK_MS: i64 = 1_000;
const TICKER_BEHIND_MS: i64 = 60_000;

/// Every run the case makes, with what each must end as and the spec it executes: the
/// top-level runs' chains, and the runs of the schedule's ticks (created at `ticker_t0`).
fn expect_case(case: &Case, ticker_t0: i64) -> Vec<(String, Expected, RunSpec)> {
    let mut all: Vec<_> = case.runs.iter().enumerate().flat_map(|(run, spec)| expect_chain(run, spec)).collect();
    if let Some((run, ticks)) = case.schedule {
        for k in 1..=i64::from(ticks) {
            let root = tidemark_core::schedule::tick_run_id(&schedule_id(run), ticker_t0 + k * TICK_MS);
            all.extend(expect_chain_from(&root, &case.runs[run]));
        }
    }
    all
}

/// What a successful attempt returns.
fn output(run_id: &str, name: &str, attempt: u32) -> Value {
    json!({"run": run_id, "step": name, "attempt": attempt})
}

/// Attempts made with a budget of `budget`, and whether the last one succeeded.
fn attempts_of(action: &Action, budget: u32) -> (u32, bool) {
    if action.fails >= budget {
        (budget, false)
    } else {
        (action.fails + 1, action.end == End::Ok)
    }
}

/// The behaviour of attempt `attempt` of an action (1-based).
fn behave(run_id: &str, name: &str, action: &Action, attempt: u32) -> Result<Value, StepFailure> {
    if attempt <= action.fails {
        Err(StepFailure::retryable(format!("{name}: transient failure {attempt}")))
    } else if action.end == End::Permanent {
        Err(StepFailure::permanent(format!("{name}: refused for good")))
    } else {
        Ok(output(run_id, name, attempt))
    }
}

/// One expected journal entry: name, kind, status, attempts.
type Entry = (String, StepKind, StepStatus, u32);

#[derive(Debug)]
struct Expected {
    status: RunStatus,
    journal: Vec<Entry>,
    result: Option<Value>,
    /// A part of the run's error.
    error: Option<String>,
}

fn status_of(ok: bool) -> StepStatus {
    if ok {
        StepStatus::Completed
    } else {
        StepStatus::Failed
    }
}

/// What a run of `spec` must end as, whatever crashed on the way (its children's expectations
/// are pushed to `children`, the generation it is of the run's chain aside: a continuation is
/// expected by [`expect_chain`]).
fn expect(run_id: &str, spec: &RunSpec) -> Expected {
    expect_with_children(run_id, 0, spec, &mut Vec::new())
}

/// Every run a top-level run `run` makes (its generations and their children), with what each
/// must end as and the spec it executes.
fn expect_chain(run: usize, spec: &RunSpec) -> Vec<(String, Expected, RunSpec)> {
    expect_chain_from(&run_id(run), spec)
}

/// [`expect_chain`] of a run `root` of `spec` (a top-level run, or a schedule's tick).
fn expect_chain_from(root: &str, spec: &RunSpec) -> Vec<(String, Expected, RunSpec)> {
    let mut all = Vec::new();
    let mut id = root.to_string();
    for generation in 0..=spec.continues {
        let mut children = Vec::new();
        let expected = expect_with_children(&id, generation, spec, &mut children);
        let continues = expected.status == RunStatus::Continued;
        all.push((id.clone(), expected, spec.clone()));
        all.extend(children);
        if !continues {
            break;
        }
        id = continuation_run_id(&id);
    }
    all
}

/// The spec a child of element `steps` executes.
fn child_spec(steps: &[Action]) -> RunSpec {
    let elems = steps.iter().map(|action| Elem::Step { action: action.clone(), undo: None }).collect();
    RunSpec { saga: false, elems, crash: None, continues: 0 }
}

fn expect_with_children(
    run_id: &str,
    generation: u32,
    spec: &RunSpec,
    children: &mut Vec<(String, Expected, RunSpec)>,
) -> Expected {
    let mut journal: Vec<Entry> = Vec::new();
    let mut outputs = Map::new();
    let mut completed = Vec::new();
    let mut failed = None;
    // A saga's external step that failed at its last attempt, compensated first.
    let mut out_of_attempts = None;
    for (i, elem) in spec.elems.iter().enumerate() {
        match elem {
            Elem::Child { steps } => {
                let child_id = child_run_id(run_id, journal.len() as u32);
                let child = child_spec(steps);
                let child_expected = expect(&child_id, &child);
                let name = child_workflow_name(run_index(run_id), i);
                let ok = child_expected.status == RunStatus::Completed;
                let result = child_expected.result.clone();
                // The parent's entry completes with the child's end, whatever it was.
                journal.push((name.clone(), StepKind::Child, StepStatus::Completed, 0));
                children.push((child_id, child_expected, child));
                if !ok {
                    failed = Some(name);
                    break;
                }
                outputs.insert(name, result.unwrap_or(Value::Null));
            }
            // A saga's zero-length sleep takes no position; a workflow's does.
            Elem::Sleep { ms: 0 } if spec.saga => {}
            Elem::Sleep { .. } => journal.push(("sleep".into(), StepKind::Sleep, StepStatus::Completed, 0)),
            Elem::Step { action, .. } => {
                let name = step_name(i);
                let kind = if action.tx { StepKind::Transactional } else { StepKind::External };
                let (attempts, ok) = attempts_of(action, STEP_ATTEMPTS);
                journal.push((name.clone(), kind, status_of(ok), attempts));
                if !ok {
                    if !action.tx && attempts == STEP_ATTEMPTS {
                        out_of_attempts = Some(i);
                    }
                    failed = Some(name);
                    break;
                }
                outputs.insert(name.clone(), output(run_id, &name, attempts));
                completed.push(i);
            }
        }
    }
    let Some(failed) = failed else {
        if generation < spec.continues {
            let next = json!({"continued_as": continuation_run_id(run_id)});
            return Expected { status: RunStatus::Continued, journal, result: Some(next), error: None };
        }
        return Expected { status: RunStatus::Completed, journal, result: Some(Value::Object(outputs)), error: None };
    };
    let error = Some(format!("step {failed} failed"));
    if !spec.saga {
        return Expected { status: RunStatus::Failed, journal, result: None, error };
    }
    let undone = |i: &usize| matches!(&spec.elems[*i], Elem::Step { undo: Some(_), .. });
    if let Some(i) = out_of_attempts.filter(undone) {
        journal.push((format!("patch:{SAGA_OUT_OF_ATTEMPTS_PATCH}"), StepKind::Value, StepStatus::Completed, 1));
        completed.push(i);
    }
    for i in completed.into_iter().rev() {
        let Elem::Step { undo: Some(undo), .. } = &spec.elems[i] else { continue };
        let name = compensation_name(i);
        let (attempts, ok) = attempts_of(undo, COMPENSATION_ATTEMPTS);
        journal.push((name.clone(), StepKind::Compensation, status_of(ok), attempts));
        if !ok {
            let error = Some(format!("compensation {name} failed for good"));
            return Expected { status: RunStatus::Parked, journal, result: None, error };
        }
    }
    Expected { status: RunStatus::Compensated, journal, result: None, error }
}

/// The action behind a journal name of a run.
fn action_named<'a>(spec: &'a RunSpec, name: &str) -> Option<&'a Action> {
    spec.elems.iter().enumerate().find_map(|(i, elem)| match elem {
        Elem::Step { action, .. } if step_name(i) == name => Some(action),
        Elem::Step { undo: Some(undo), .. } if compensation_name(i) == name => Some(undo),
        _ => None,
    })
}

// ---------------------------------------------------------------------------------------------
// The real thing: steps that log what they do and crash on demand.

/// What a crashing body tells the driver.
enum Signal {
    /// An external step's body blocks for ever.
    External,
    /// A transactional body waits inside the journal's transaction; send to let it end the
    /// transaction without committing.
    Tx(mpsc::SyncSender<()>),
}

struct Gate {
    /// The worker incarnation whose bodies may crash (0: none).
    alive: u32,
    /// Runs whose crash has happened.
    fired: HashSet<usize>,
    signals: mpsc::Sender<Signal>,
}

/// One call of an external action.
#[derive(Debug, Clone)]
struct Call {
    run_id: String,
    name: String,
    key: String,
    attempt: u32,
    returned: bool,
}

/// What the steps of one case share.
struct Shared {
    case: Case,
    calls: Mutex<Vec<Call>>,
    gate: Mutex<Gate>,
    /// Transactional bodies that have stalled: (run, step name).
    stalled: Mutex<HashSet<(usize, String)>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// Does the body of element `elem` of `run` crash now? (Once per run, only in the live
    /// incarnation; the signal is sent under the gate's lock, so after the driver closed the
    /// gate no body crashes any more.)
    fn crash_here(
        &self,
        incarnation: u32,
        run: usize,
        elem: usize,
        undo: bool,
        signal: impl FnOnce() -> Signal,
    ) -> bool {
        let mut gate = lock(&self.gate);
        if gate.alive != incarnation || self.case.runs[run].crash != Some((elem, undo)) || !gate.fired.insert(run) {
            return false;
        }
        let _ = gate.signals.send(signal());
        true
    }
}

/// Where a body is: which incarnation runs it, for which run, element and step.
struct Site<S: WorkflowStore> {
    shared: Arc<Shared>,
    writer: Writer<S>,
    incarnation: u32,
    /// The run executing it (a top-level run, one of its continuations, or a child).
    run_id: String,
    run: usize,
    elem: usize,
    undo: bool,
    name: String,
    action: Action,
}

impl<S: WorkflowStore> Clone for Site<S> {
    fn clone(&self) -> Self {
        Site {
            shared: self.shared.clone(),
            writer: self.writer.clone(),
            incarnation: self.incarnation,
            run_id: self.run_id.clone(),
            run: self.run,
            elem: self.elem,
            undo: self.undo,
            name: self.name.clone(),
            action: self.action.clone(),
        }
    }
}

impl<S> Site<S>
where
    S: ModelStore,
    S::Target: 'static,
{
    /// An external attempt: its number is the journal's attempts + 1 (read through the writer,
    /// so a crash that cut an attempt short does not count it).
    async fn external(self, key: String) -> Result<Value, StepFailure> {
        let run_id = self.run_id.clone();
        let (id, name) = (run_id.clone(), self.name.clone());
        let detail = self.writer.call(move |store, _| store.run(&id)).await.expect("read the run");
        let journaled = detail.and_then(|d| d.journal.into_iter().find(|e| e.name == name)).map_or(0, |e| e.attempts);
        let attempt = journaled + 1;
        let index = {
            let mut calls = lock(&self.shared.calls);
            calls.push(Call { run_id: run_id.clone(), name: self.name.clone(), key, attempt, returned: false });
            calls.len() - 1
        };
        if self.shared.crash_here(self.incarnation, self.run, self.elem, self.undo, || Signal::External) {
            std::future::pending::<()>().await;
        }
        let result = behave(&run_id, &self.name, &self.action, attempt);
        lock(&self.shared.calls)[index].returned = true;
        result
    }

    /// A transactional attempt, inside the journal's transaction: one `model_rows` row per
    /// attempt, which rolls back with a failed one.
    fn tx(&self, tx: &S::Target) -> Result<Value, StepFailure> {
        let run_id = self.run_id.clone();
        let attempt = S::journaled_attempts(tx, &run_id, &self.name) + 1;
        if self.action.stall && lock(&self.shared.stalled).insert((self.run, self.name.clone())) {
            std::thread::sleep(STALL);
        }
        let (release, released) = mpsc::sync_channel(1);
        if self.shared.crash_here(self.incarnation, self.run, self.elem, self.undo, move || Signal::Tx(release)) {
            // The worker dies now; its transaction never commits (what a crash between the
            // body and the commit leaves: nothing of the batch).
            let _ = released.recv_timeout(SIGNAL_WAIT);
            S::end_transaction(tx);
            return Err(StepFailure::retryable("the worker died before the commit"));
        }
        S::insert_row(tx, &run_id, &self.name, attempt)?;
        behave(&run_id, &self.name, &self.action, attempt)
    }
}

fn fast_retry(max_attempts: u32) -> RetryPolicy {
    RetryPolicy {
        max_attempts,
        backoff: Backoff::Schedule { delays_ms: vec![5] },
        attempt_timeout_ms: 30_000,
        jitter: false,
    }
}

fn options() -> WorkflowOptions {
    WorkflowOptions { concurrency_max: None, retry: fast_retry(STEP_ATTEMPTS) }
}

/// The workflows of a case, as incarnation `incarnation` runs them: one workflow per run.
fn workflows<S>(shared: &Arc<Shared>, writer: &Writer<S>, incarnation: u32) -> Workflows<S>
where
    S: ModelStore,
    S::Target: 'static,
{
    let mut workflows = Workflows::new();
    for (run, spec) in shared.case.runs.iter().enumerate() {
        let site = |elem: usize, undo: bool, action: &Action| Site {
            shared: shared.clone(),
            writer: writer.clone(),
            incarnation,
            run_id: run_id(run),
            run,
            elem,
            undo,
            name: if undo { compensation_name(elem) } else { step_name(elem) },
            action: action.clone(),
        };
        // Each child element's workflow: its steps, never crashing the worker themselves.
        for (i, elem) in spec.elems.iter().enumerate() {
            let Elem::Child { steps } = elem else { continue };
            let sites: Vec<Site<S>> = steps
                .iter()
                .enumerate()
                .map(|(j, action)| Site { elem: usize::MAX, name: step_name(j), ..site(j, false, action) })
                .collect();
            register_plain(
                &mut workflows,
                &child_workflow_name(run, i),
                child_spec(steps),
                sites.into_iter().map(Some).collect(),
            );
        }
        if spec.saga {
            let mut saga =
                Saga::<S>::new(&workflow_name(run), 1).compensation_policy(fast_retry(COMPENSATION_ATTEMPTS));
            for (i, elem) in spec.elems.iter().enumerate() {
                match elem {
                    Elem::Sleep { ms } => {
                        let ms = *ms;
                        saga = saga.sleep(move |_| Duration::from_millis(ms));
                    }
                    Elem::Step { action, undo } => {
                        let forward = saga_action(site(i, false, action));
                        let compensation = undo.as_ref().map(|undo| saga_action(site(i, true, undo)));
                        saga = saga.step(&step_name(i), forward, compensation);
                    }
                    Elem::Child { .. } => unreachable!("a saga has no children (run_spec)"),
                }
            }
            saga.register(&mut workflows, options()).expect("register the saga");
        } else {
            let sites: Vec<Option<Site<S>>> = spec
                .elems
                .iter()
                .enumerate()
                .map(|(i, elem)| match elem {
                    Elem::Step { action, .. } => Some(site(i, false, action)),
                    Elem::Sleep { .. } | Elem::Child { .. } => None,
                })
                .collect();
            register_plain(&mut workflows, &workflow_name(run), spec.clone(), sites);
        }
    }
    workflows
}

/// A plain workflow of `spec`'s elements (`sites`: each step's), continuing as new while its
/// input's generation is below `spec.continues`.
fn register_plain<S>(workflows: &mut Workflows<S>, name: &str, spec: RunSpec, sites: Vec<Option<Site<S>>>)
where
    S: ModelStore,
    S::Target: 'static,
{
    let run = sites.iter().flatten().next().map(|s| s.run);
    workflows
        .register(name, 1, options(), move |ctx, input: Value| {
            let (spec, sites) = (spec.clone(), sites.clone());
            async move {
                let generation = input["gen"].as_u64().unwrap_or(0) as u32;
                let mut outputs = Map::new();
                for (i, (elem, site)) in spec.elems.iter().zip(sites).enumerate() {
                    match (elem, site) {
                        (Elem::Sleep { ms }, _) => ctx.sleep(Duration::from_millis(*ms)).await?,
                        (Elem::Child { .. }, _) => {
                            let child = child_workflow_name(run_index(ctx.run_id()), i);
                            let value: Value = ctx.child(&child, &json!({})).await?;
                            outputs.insert(child, value);
                        }
                        (Elem::Step { action, .. }, Some(site)) => {
                            let site = Site { run_id: ctx.run_id().to_string(), ..site };
                            let name = site.name.clone();
                            let value: Value = if action.tx {
                                ctx.tx_step(&name, None, move |tx: &S::Target| site.tx(tx)).await?
                            } else {
                                ctx.step(&name, None, move |key| site.external(key)).await?
                            };
                            outputs.insert(name, value);
                        }
                        (Elem::Step { .. }, None) => unreachable!("every step has its site"),
                    }
                }
                if generation < spec.continues {
                    return Err(ctx.continue_as_new(&json!({"run": run, "gen": generation + 1})));
                }
                Ok(Value::Object(outputs))
            }
        })
        .expect("register the workflow");
}

fn saga_action<S>(site: Site<S>) -> SagaAction<S::Target>
where
    S: ModelStore,
    S::Target: 'static,
{
    if site.action.tx {
        SagaAction::tx(move |tx: &S::Target, _data: &SagaData| site.tx(tx))
    } else {
        SagaAction::external(move |key, _data| site.clone().external(key))
    }
}

// ---------------------------------------------------------------------------------------------
// The driver.

fn runtime() -> Runtime {
    Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("tokio runtime")
}

fn open_writer<S>(opener: &Opener<S>) -> Writer<S>
where
    S: ModelStore,
    S::Target: 'static,
{
    let opener = opener.clone();
    Writer::spawn(move || opener()).expect("open the workflow store")
}

fn worker_options(worker_id: &str, concurrency: usize) -> WorkerOptions {
    WorkerOptions {
        worker_id: worker_id.to_string(),
        concurrency,
        lease_ms: LEASE_MS,
        poll_interval_ms: 5,
        heartbeat_ms: Some(HEARTBEAT_MS),
    }
}

fn start_requests(runs: &[usize], queued: bool) -> Vec<StartRequest> {
    runs.iter()
        .map(|&run| StartRequest {
            run_id: run_id(run),
            workflow: workflow_name(run),
            version: 1,
            input: json!({"run": run}),
            key: None,
            start_at_ms: None,
            queue: queued.then(|| Enqueue { queue: QUEUE.into(), priority: (run % 3) as i32, dedup_id: None }),
            deadline_ms: None,
        })
        .collect()
}

fn start<S: ModelStore>(store: &mut S, runs: &[usize], queued: bool)
where
    S::Target: 'static,
{
    for outcome in store.start_runs(&start_requests(runs, queued), now_ms()).expect("start") {
        assert!(matches!(outcome, StartOutcome::Started { .. }), "{outcome:?}");
    }
}

/// Have all `runs` runs the case makes ended? And, read in the same listing (one snapshot), do
/// the queue's admitted, unfinished runs stay within its limit?
fn all_finished<S: ModelStore>(store: &S, runs: usize, queue: Option<u32>) -> bool
where
    S::Target: 'static,
{
    let listed = store.list_runs(&RunFilter::default(), 1_000).expect("list runs");
    if let Some(limit) = queue {
        let inside: Vec<&RunRecord> = listed
            .iter()
            .filter(|r| r.queue.as_deref() == Some(QUEUE) && r.admitted_at_ms.is_some() && !r.status.is_terminal())
            .collect();
        assert!(
            inside.len() as u32 <= limit,
            "queue {QUEUE} (limit {limit}) has {} runs admitted: {inside:#?}",
            inside.len()
        );
    }
    listed.len() == runs && listed.iter().all(|r| r.status.is_terminal())
}

enum Ending {
    Finished,
    /// Crashed at a body (with its signal) or killed at a random moment.
    Crashed(Option<Signal>),
}

/// Run the case to the end through crashing workers; return how many times a worker stopped
/// working on a run abruptly (incarnations that died, leases lost).
fn drive<S>(
    case: &Case,
    opener: &Opener<S>,
    store: &mut S,
    shared: &Arc<Shared>,
    signals: &mpsc::Receiver<Signal>,
    ticker_t0: i64,
) -> u32
where
    S: ModelStore,
    S::Target: 'static,
{
    let n = case.runs.len();
    let queued = case.queue.is_some();
    if let Some(limit) = case.queue {
        store.put_queue(&QueueSpec::new(QUEUE).concurrency(limit), now_ms()).expect("declare the queue");
    }
    // Every run the case makes: its top-level runs, their continuations and children, the
    // schedule's ticks.
    let total = expect_case(case, ticker_t0).len();
    // The ticker: a writer of its own on a virtual clock that starts a minute in the past and
    // moves a tick at a time (so the runs it starts are due at once), through every
    // incarnation; each tick is ticked twice (the second finds nothing due).
    let virtual_now = Arc::new(std::sync::atomic::AtomicI64::new(ticker_t0));
    let ticker = case.schedule.map(|(run, _)| {
        let (opener, now) = (opener.clone(), virtual_now.clone());
        let clock: tidemark_engine::workflow::Clock = Arc::new(move || now.load(std::sync::atomic::Ordering::SeqCst));
        let ticker = Writer::spawn_with_clock(move || opener(), clock).expect("the ticker's writer");
        let spec = ScheduleSpec {
            schedule_id: schedule_id(run),
            workflow: workflow_name(run),
            input: json!({}),
            timing: Timing::IntervalMs(TICK_MS),
            timezone: "UTC".into(),
            catch_up: CatchUp::All,
        };
        ticker.call_blocking(move |store, now| store.put_schedule(&spec, now)).expect("put the schedule");
        (ticker, std::collections::BTreeMap::from([(workflow_name(run), 1_u32)]))
    });
    let mut ticked = 0;
    start(store, &case.order[..case.first_batch], queued);
    let mut started = case.first_batch;
    let mut kills = case.kills.iter().copied();
    let mut deaths = 0;
    for incarnation in 1..=INCARNATIONS_MAX {
        // An incarnation: `case.workers` workers, each with its own writer (connection) and id.
        let rt = runtime();
        let mut writers = Vec::new();
        let mut workers = Vec::new();
        let mut stops = Vec::new();
        let mut handles = Vec::new();
        lock(&shared.gate).alive = incarnation;
        for k in 0..case.workers {
            let writer = open_writer(opener);
            let options = worker_options(&format!("worker-{incarnation}-{k}"), case.concurrency);
            let worker = Arc::new(
                Worker::new(writer.clone(), workflows(shared, &writer, incarnation), options).expect("worker"),
            );
            let (stop, stopped) = oneshot::channel::<()>();
            let running = worker.clone();
            handles.push(rt.spawn(async move {
                running
                    .run_until(async move {
                        let _ = stopped.await;
                    })
                    .await
            }));
            writers.push(writer);
            workers.push(worker);
            stops.push(stop);
        }
        let kill_at = kills.next();
        let mut ending = None;
        for tick in 0..TICKS_MAX {
            if started < n && tick == 3 {
                // Through the worker's writer: queued behind whatever it is doing (a body may be
                // blocked in the journal's transaction), committed even if the worker dies.
                let requests = start_requests(&case.order[started..], queued);
                drop(writers[0].call(move |store, now| store.start_runs(&requests, now)));
                started = n;
            }
            if let (Some((ticker, versions)), Some((_, ticks))) = (&ticker, case.schedule) {
                if tick % 9 == 7 {
                    if ticked < ticks {
                        ticked += 1;
                        let at = ticker_t0 + i64::from(ticked) * TICK_MS;
                        virtual_now.store(at, std::sync::atomic::Ordering::SeqCst);
                    }
                    // Queued on the ticker's thread, not awaited (a crashed transactional body
                    // may hold the file's write lock until this loop lets it go). A pass that
                    // fails (the file busy) is made up by the next: the schedule catches up on
                    // every due tick, and passes go on until every tick's run exists.
                    for _ in 0..2 {
                        let versions = versions.clone();
                        drop(ticker.call(move |store, now| tidemark_core::schedule::tick(store, &versions, now)));
                    }
                }
            }
            if let Ok(signal) = signals.try_recv() {
                ending = Some(Ending::Crashed(Some(signal)));
                break;
            }
            if kill_at == Some(tick) {
                ending = Some(Ending::Crashed(None));
                break;
            }
            let ticks_done = !matches!(case.schedule, Some((_, ticks)) if ticked != ticks);
            if started == n && ticks_done && tick % 5 == 0 && all_finished(store, total, case.queue) {
                ending = Some(Ending::Finished);
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        match ending {
            Some(Ending::Finished) => {
                for stop in stops {
                    let _ = stop.send(());
                }
                let mut interruptions = deaths;
                for handle in handles {
                    let report = rt.block_on(handle).expect("worker task").expect("worker");
                    assert_eq!(report.errors, 0, "{report:?}");
                    if std::env::var_os("MODEL_VERBOSE").is_some() && (report.lost > 0 || report.recovered > 0) {
                        eprintln!("worker: lost {}, recovered {}", report.lost, report.recovered);
                    }
                    // A live worker that lost a lease (a scheduling stall longer than the lease)
                    // stopped that run mid-way, like a crash.
                    interruptions += report.lost as u32;
                }
                return interruptions;
            }
            Some(Ending::Crashed(signal)) => {
                // Close the gate first: no body crashes after this, and every one that did has
                // already sent its signal.
                lock(&shared.gate).alive = 0;
                rt.shutdown_background();
                drop((workers, writers, stops, handles));
                for signal in signal.into_iter().chain(signals.try_iter()) {
                    if let Signal::Tx(release) = signal {
                        let _ = release.send(());
                    }
                }
                deaths += 1;
            }
            None => {
                let runs = store.list_runs(&RunFilter::default(), 100).expect("list");
                panic!("incarnation {incarnation} did not finish in {TICKS_MAX} polls: {runs:#?}");
            }
        }
    }
    panic!("more than {INCARNATIONS_MAX} workers died");
}

/// Compare the real run with the model.
fn check_run(
    run_id: &str,
    expected: &Expected,
    spec: &RunSpec,
    d: &RunDetail,
    rows: &[(String, String, u32)],
    calls: &[Call],
    interruptions: u32,
) {
    let context = format!("run {run_id}: {spec:?}\nexpected {expected:#?}\ngot {d:#?}");
    assert_eq!(d.run.status, expected.status, "{context}");
    let journal: Vec<Entry> = d.journal.iter().map(|e| (e.name.clone(), e.kind, e.status, e.attempts)).collect();
    assert_eq!(journal, expected.journal, "{context}");
    let seqs: Vec<u32> = d.journal.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (0..d.journal.len() as u32).collect::<Vec<_>>(), "a gapless journal: {context}");
    if matches!(expected.status, RunStatus::Completed | RunStatus::Continued) {
        assert_eq!(d.run.result, expected.result, "{context}");
    }
    if let Some(part) = &expected.error {
        assert!(d.run.error.as_deref().unwrap_or("").contains(part.as_str()), "error should say {part:?}: {context}");
    }
    assert!(d.run.lease_owner.is_none() && d.run.lease_expires_at_ms.is_none(), "left leased: {context}");

    for entry in &d.journal {
        // The attempt history: every attempt recorded, failures first.
        let history: Vec<(u32, bool)> =
            d.attempts.iter().filter(|a| a.seq == entry.seq).map(|a| (a.attempt, a.ok)).collect();
        let expected_history: Vec<(u32, bool)> =
            (1..=entry.attempts).map(|a| (a, a == entry.attempts && entry.status == StepStatus::Completed)).collect();
        assert_eq!(history, expected_history, "attempts of {}: {context}", entry.name);
        let Some(action) = action_named(spec, &entry.name) else { continue };
        let mine = |name: &str, run: &str| name == entry.name && run == run_id;
        let written: Vec<u32> = rows.iter().filter(|(r, n, _)| mine(n, r)).map(|(_, _, a)| *a).collect();
        let called: Vec<&Call> = calls.iter().filter(|c| mine(&c.name, &c.run_id)).collect();
        if action.tx {
            // Exactly once: the row of the attempt that committed, none of the failed ones.
            let expected_rows = if entry.status == StepStatus::Completed { vec![entry.attempts] } else { vec![] };
            assert_eq!(written, expected_rows, "rows of {}: {context}", entry.name);
            assert!(called.is_empty(), "{context}");
        } else {
            assert!(written.is_empty(), "{context}");
            let key = format!("{run_id}:{}:{}", entry.seq, entry.name);
            assert!(called.iter().all(|c| c.key == key), "every attempt of {} uses {key}: {called:?}", entry.name);
            let returned: Vec<u32> = called.iter().filter(|c| c.returned).map(|c| c.attempt).collect();
            for attempt in 1..=entry.attempts {
                assert!(returned.contains(&attempt), "attempt {attempt} of {} ran: {called:?}\n{context}", entry.name);
            }
            assert!(returned.windows(2).all(|w| w[0] <= w[1]), "attempts in order: {called:?}");
            if interruptions == 0 {
                assert_eq!(returned, (1..=entry.attempts).collect::<Vec<_>>(), "{called:?}\n{context}");
                assert_eq!(called.len(), returned.len(), "{called:?}");
            } else {
                // A dying worker cuts at most one call of each run short (or loses its answer).
                assert!(called.len() as u32 <= entry.attempts + interruptions, "{called:?}\n{context}");
            }
        }
    }
    // Steps the run never reached did nothing.
    let journaled: HashSet<&str> = d.journal.iter().map(|e| e.name.as_str()).collect();
    assert!(rows.iter().filter(|(r, _, _)| *r == run_id).all(|(_, n, _)| journaled.contains(n.as_str())), "{context}");
    assert!(calls.iter().filter(|c| c.run_id == run_id).all(|c| journaled.contains(c.name.as_str())), "{context}");
}

/// One case on a SQLite file.
fn run_case(case: Case) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("workflows.db");
    let store = SqliteWorkflows::init_with(&path, Durability::Normal).expect("open");
    let opener: Opener<SqliteWorkflows> = Arc::new(move || SqliteWorkflows::init_with(&path, Durability::Normal));
    run_case_on(case, store, &opener);
}

static PG_CASES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// One case in a schema of its own on the PostgreSQL server `conn` (dropped afterwards, also
/// when the case fails).
fn run_case_postgres(conn: &str, case: Case) {
    struct Dropped(String, String);
    impl Drop for Dropped {
        fn drop(&mut self) {
            if let Ok(mut client) = postgres::Client::connect(&self.0, postgres::NoTls) {
                let _ = client.batch_execute(&format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.1));
            }
        }
    }
    let n = PG_CASES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let schema = format!("wfmodel_{}_{n}", std::process::id());
    let _dropped = Dropped(conn.to_string(), schema.clone());
    let store = PgWorkflows::init(conn, &schema).expect("open");
    let conn = conn.to_string();
    let opener: Opener<PgWorkflows> = Arc::new(move || PgWorkflows::open(&conn, &schema));
    run_case_on(case, store, &opener);
}

fn run_case_on<S>(case: Case, mut store: S, opener: &Opener<S>)
where
    S: ModelStore,
    S::Target: 'static,
{
    store.create_rows_table();
    let (signals_tx, signals) = mpsc::channel();
    let shared = Arc::new(Shared {
        case: case.clone(),
        calls: Mutex::new(Vec::new()),
        gate: Mutex::new(Gate { alive: 0, fired: HashSet::new(), signals: signals_tx }),
        stalled: Mutex::new(HashSet::new()),
    });
    // A stall may make the stalled worker lose its leases: count it like a crash.
    let ticker_t0 = now_ms() - TICKER_BEHIND_MS;
    let interruptions =
        drive(&case, opener, &mut store, &shared, &signals, ticker_t0) + lock(&shared.stalled).len() as u32;
    if std::env::var_os("MODEL_VERBOSE").is_some() {
        let fired: Vec<String> = lock(&shared.gate)
            .fired
            .iter()
            .map(|&r| {
                let (elem, undo) = case.runs[r].crash.unwrap();
                let tx = match &case.runs[r].elems[elem] {
                    Elem::Step { action, undo: u } => {
                        if undo {
                            u.as_ref().unwrap().tx
                        } else {
                            action.tx
                        }
                    }
                    Elem::Sleep { .. } | Elem::Child { .. } => unreachable!(),
                };
                format!("{}{}", if tx { "tx" } else { "ext" }, if undo { "-undo" } else { "" })
            })
            .collect();
        let statuses: Vec<String> = (0..case.runs.len())
            .map(|r| store.run(&run_id(r)).unwrap().unwrap().run.status.as_str().to_string())
            .collect();
        let stalls = lock(&shared.stalled).len();
        let made = expect_case(&case, ticker_t0).len();
        eprintln!(
            "case: {} runs ({made} with continuations, children and ticks), {} workers x {}, queue {:?}, schedule {:?}, interruptions {interruptions}, stalls {stalls}, crashes fired {fired:?}, kills {:?}, {statuses:?}",
            case.runs.len(),
            case.workers,
            case.concurrency,
            case.queue,
            case.schedule,
            case.kills
        );
    }

    let rows = store.rows();
    let calls = lock(&shared.calls).clone();
    let mut tx_completed = 0;
    for (id, expected, spec) in expect_case(&case, ticker_t0) {
        let d = store.run(&id).expect("read").unwrap_or_else(|| panic!("run {id} exists"));
        check_run(&id, &expected, &spec, &d, &rows, &calls, interruptions);
        let started_by_the_case = d.run.parent_run_id.is_none() && !id.contains("-tick");
        if let Some(queue) = case.queue.filter(|_| started_by_the_case) {
            assert_eq!(d.run.queue.as_deref(), Some(QUEUE), "{id} went through the queue (limit {queue})");
        }
        tx_completed += d
            .journal
            .iter()
            .filter(|e| e.status == StepStatus::Completed && action_named(&spec, &e.name).is_some_and(|a| a.tx))
            .count();
    }
    assert_eq!(rows.len(), tx_completed, "no stray rows: {rows:?}");
}

fn config() -> ProptestConfig {
    config_with(32)
}

fn config_with(cases_default: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(cases_default);
    ProptestConfig { cases, max_shrink_iters: 16, failure_persistence: None, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn runs_end_as_the_model_says_through_crashing_workers(case in case()) {
        run_case(case);
    }
}

/// The same random cases on the PostgreSQL store (fewer by default: every commit is a durable
/// commit on the server, and each case makes and drops a schema).
#[test]
fn runs_end_as_the_model_says_on_postgres() {
    let Some(conn) = crate::model_check::postgres_server() else { return };
    let mut runner = proptest::test_runner::TestRunner::new(config_with(16));
    if let Err(error) = runner.run(&case(), |case| {
        run_case_postgres(&conn, case);
        Ok(())
    }) {
        panic!("{error}");
    }
}

#[test]
fn the_model_expects_reverse_compensations_and_parks_on_a_failed_one() {
    let ok = |tx| Action { tx, fails: 0, end: End::Ok, stall: false };
    let spec = RunSpec {
        saga: true,
        elems: vec![
            Elem::Step { action: ok(true), undo: Some(ok(false)) },
            Elem::Sleep { ms: 0 },
            Elem::Step { action: Action { tx: false, fails: 1, end: End::Ok, stall: false }, undo: None },
            Elem::Step { action: ok(false), undo: Some(Action { tx: true, fails: 2, end: End::Ok, stall: false }) },
            Elem::Step { action: Action { tx: false, fails: 1, end: End::Permanent, stall: false }, undo: None },
        ],
        crash: None,
        continues: 0,
    };
    let e = expect("r", &spec);
    assert_eq!(e.status, RunStatus::Compensated);
    let names: Vec<&str> = e.journal.iter().map(|j| j.0.as_str()).collect();
    assert_eq!(names, ["s0", "s2", "s3", "s4", "compensate:s3", "compensate:s0"]);
    assert_eq!(e.journal[1].3, 2);
    assert_eq!((e.journal[3].2, e.journal[3].3), (StepStatus::Failed, 2));
    assert_eq!(e.journal[4].3, 3);

    let mut parked = spec.clone();
    parked.elems[3] = Elem::Step {
        action: ok(false),
        undo: Some(Action { tx: true, fails: COMPENSATION_ATTEMPTS, end: End::Ok, stall: false }),
    };
    let e = expect("r", &parked);
    assert_eq!(e.status, RunStatus::Parked);
    assert_eq!(e.journal.last().unwrap().0, "compensate:s3");

    let plain = RunSpec { saga: false, ..spec };
    let e = expect("r", &plain);
    assert_eq!(e.status, RunStatus::Failed);
    let names: Vec<&str> = e.journal.iter().map(|j| j.0.as_str()).collect();
    assert_eq!(names, ["s0", "sleep", "s2", "s3", "s4"]);
}
