//! The workflow authors' test kit: run your workflow in your own `cargo test` on a throwaway
//! store, crash it at every journal boundary in turn (and at random ones from a seed), recover
//! it as a restarted process would, and get a report of what a crash would break in
//! production. And replay journals recorded in production against changed code before you
//! deploy it (in the manner of Temporal's replayer). The guide is `docs/testing.md`.
//!
//! - [`CrashTest`]: one run of your workflow, executed once without crashes (the reference) and
//!   then again with a crash at boundary 1, 2, 3, ... until a run completes with no crash left to
//!   inject, and with random schedules of several crashes drawn from a seed. Time is the kit's
//!   own clock: a `ctx.sleep(Duration::from_secs(3600))`, a retry backoff or a wait's timeout
//!   passes in milliseconds.
//! - [`Effects`]: what your fake external services call with (effect, idempotency key), so that
//!   the kit can tell a legitimate at-least-once retry (same key) from an effect called with two
//!   keys, or called again after its step had committed.
//! - [`ReplayCheck`]: runs recorded elsewhere (the JSON of `tidemark workflow show`, or the
//!   pages of `GET /v1/runs/{id}` in order) replayed against the code you register, running no step.
//! - [`Report`]: the [`Finding`]s, each of a [`FindingKind`]; [`Report::assert_ok`] panics with a
//!   readable report when one is a problem.
//!
//! # What a crash is here
//!
//! A *journal boundary* is one commit of the workflow database: the claim that leases a run,
//! and every transaction the runtime writes its journal in (a group commit carries a step's
//! entry, the attempt of the external step before it, a timer, a suspension, the end of the
//! run). The kit counts the commits of its worker's connection (a SQLite commit hook); at
//! boundary `k` that commit rolls back and so does every later one, and from then on nothing the
//! process does is recorded: exactly what a process killed at that point leaves behind. The kit
//! then drops that worker, moves its clock past the lease ([`LEASE_MS`]), and runs a new worker
//! on a new connection to the same file, which recovers the run and takes it to its end (or to
//! the next crash of the schedule).
//!
//! # What is reported
//!
//! - [`FindingKind::NonDeterministicReplay`]: a replay took another branch. The run was parked
//!   as non-deterministic, or its journal (step names, kinds and order, their statuses, the run's
//!   end, the outputs of transactional steps, children, waits and messages) differs from the
//!   crash-free run's. Journals are compared up to the first journaled value (`ctx.now()`,
//!   `ctx.random()`, `ctx.uuid()`) that differs between the two executions: from there on they
//!   are two runs that read different values and may rightly go different ways. Typical cause: a
//!   branch on `ctx.live_clock_ms()`, on a random number or on anything else read outside the
//!   journal.
//! - [`FindingKind::StepRanTwice`]: an effect was called more often than the crash-free run
//!   called it, beyond the calls that crashes legitimately repeat (the attempt of an external
//!   step whose completion had not been committed yet); or one of your tables in the workflow
//!   database holds another number of rows than after the crash-free run. Typical causes: a side
//!   effect in the workflow function itself (it runs again on every replay), an external call in
//!   a transactional step's body (the body runs again when its commit did not happen), a write
//!   to your database from an external step.
//! - [`FindingKind::IdempotencyKeyChanged`]: a retry of a step (after a failed attempt, or after
//!   a crash before its completion was committed) called an effect with another key than the
//!   attempt before it. Typical cause: a key made fresh per attempt (a new UUID in the step's
//!   body) instead of the key `ctx.step` hands the step.
//! - [`FindingKind::RetriedWithSameKey`], a note, not a problem: a crash came before a step's
//!   completion was committed and the step ran again, with the same key. That is the at-least-once
//!   contract of external steps; the service must treat the key as idempotent.
//! - [`FindingKind::RecordedJournalMismatch`]: new code calls another step than a recorded
//!   journal holds at a position, returns before reaching journaled steps, or cannot read it.
//! - [`FindingKind::Unfinished`]: a run did not end within [`ROUNDS_MAX`] executions, or waits
//!   for something the kit cannot give it.
//!
//! # Limits
//!
//! One run (and its children) per [`CrashTest`], executed one at a time (a worker of one slot,
//! so that every execution commits the same boundaries in the same order); at most
//! [`BOUNDARIES_MAX`] boundaries crashed in turn, [`ROUNDS_MAX`] worker passes per execution,
//! [`RUNS_MAX`] runs per store. Events a run waits for are sent before it starts
//! ([`CrashTest::event`]); a wait for anything else times out when the kit's clock passes its
//! deadline.
#![warn(missing_docs)]

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use serde::Serialize;
use serde_json::Value;
use tidemark_core::error::codes;
use tidemark_core::limits::PAGE_SIZE_MAX;
use tidemark_core::workflow::{
    workflow_codes, JournalEntry, RunDetail, RunFilter, RunStatus, StartOutcome, StartRequest, StepKind, WorkflowStore,
    LEASE_MS_MAX,
};
use tidemark_core::{Error, Result};
use tidemark_engine::workflow::{
    tokio, Clock, IntoWorkflow, StepAttempt, StepAttemptEnd, Worker, WorkerObserver, WorkerOptions, WorkerReport,
    Workflow, Workflows, Writer, REPLAY_END,
};
use tidemark_store_postgres::PgWorkflows;
use tidemark_store_sqlite::{Durability, SqliteWorkflows};

/// Where the kit's clock starts, in ms since the Unix epoch (2023-11-14T22:13:20Z). Every run
/// of the kit starts at this time, so a workflow's times are the same on every execution.
pub const CLOCK_START_MS: i64 = 1_700_000_000_000;
/// The lease the kit's workers take, in ms (the longest a worker may take: one hour). After a
/// crash the kit's clock moves `LEASE_MS + 1` ahead, so the dead worker's leases have expired
/// and the next worker recovers the run.
pub const LEASE_MS: i64 = LEASE_MS_MAX;
/// At most this many boundaries are crashed in turn (a run with more commits is crashed at the
/// first ones only).
pub const BOUNDARIES_MAX: u32 = 1_000;
/// At most this many worker passes per execution (each ends when nothing is due; the kit then
/// moves its clock to the next timer, backoff or deadline).
pub const ROUNDS_MAX: u32 = 1_000;
/// At most this many runs (the run and its children) in one store.
pub const RUNS_MAX: usize = PAGE_SIZE_MAX - 1;
/// Random crash schedules run by default ([`CrashTest::random_schedules`]).
pub const RANDOM_SCHEDULES_DEFAULT: u32 = 16;
/// The most random crash schedules one [`CrashTest`] runs.
pub const RANDOM_SCHEDULES_MAX: u32 = 10_000;
/// At most this many crashes in one schedule (random or given).
pub const CRASHES_PER_SCHEDULE_MAX: u32 = 100;
/// Crashes per random schedule by default (each schedule has 1..=this many).
pub const CRASHES_PER_SCHEDULE_DEFAULT: u32 = 3;
/// The seed of the random schedules unless [`CrashTest::seed`] gives another.
pub const SEED_DEFAULT: u64 = 0x7D3A_5EED;
/// The run id of the run a [`CrashTest`] starts unless [`CrashTest::run_id`] gives another.
pub const RUN_ID_DEFAULT: &str = "kit-run";
/// The error code of a recorded run that does not parse as a run's JSON
/// (`tidemark workflow show`, the pages of `GET /v1/runs/{id}`).
pub const INVALID_RECORDING: &str = "invalid_recording";

/// The poll interval of the kit's workers: the longest there is, so that a worker claims only
/// when it starts and when its slot frees (never on a timer whose firing depends on speed).
const POLL_INTERVAL_MS: u64 = 3_600_000;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn invalid(message: impl Into<String>) -> Error {
    Error::invalid(codes::INVALID_ARGUMENT, message)
}

// ---------------------------------------------------------------------------------------------
// The stores the kit runs on.
// ---------------------------------------------------------------------------------------------

/// A workflow store the kit runs workflows on, each execution on a throwaway store of its own:
/// [`SqliteWorkflows`] (a file in a temporary folder, copied from one prepared file) and
/// [`PgWorkflows`] (a schema `tidemark_kit_<pid>_<n>_<execution>` in the database given by
/// [`CrashTest::database`], prepared anew for each execution and dropped after it; every such
/// schema left is dropped when the test ends). Implemented for those two; its hidden methods
/// are the kit's and not meant to be called.
pub trait KitStore: WorkflowStore + Sized + 'static {
    /// Your migrations on this store (`tidemark::sqlite::Migration`,
    /// `tidemark::postgres::Migration`).
    type Migration: Clone + Send + Sync + 'static;
    #[doc(hidden)]
    type Sandbox;
    #[doc(hidden)]
    type Location: Clone + Send + 'static;
    #[doc(hidden)]
    fn kit_sandbox(database: Option<&str>) -> Result<Self::Sandbox>;
    #[doc(hidden)]
    fn kit_location(sandbox: &Self::Sandbox, name: &str) -> Self::Location;
    #[doc(hidden)]
    fn kit_init(sandbox: &mut Self::Sandbox, name: &str) -> Result<Self>;
    #[doc(hidden)]
    fn kit_open(location: &Self::Location) -> Result<Self>;
    /// Whether a closed store can be copied ([`KitStore::kit_copy`]); else each execution's
    /// store is prepared anew.
    #[doc(hidden)]
    const KIT_COPIES: bool;
    /// Copy the closed store `from` to a new store `to` (where [`KitStore::KIT_COPIES`]).
    #[doc(hidden)]
    fn kit_copy(sandbox: &mut Self::Sandbox, from: &str, to: &str) -> Result<()>;
    #[doc(hidden)]
    fn kit_remove(sandbox: &mut Self::Sandbox, name: &str);
    #[doc(hidden)]
    fn kit_migrate(&mut self, migrations: &[Self::Migration], now_ms: i64) -> Result<()>;
    /// The names of the store's tables (its catalogue's, tidemark's and the user's).
    #[doc(hidden)]
    fn kit_tables(&mut self) -> Result<BTreeSet<String>>;
    #[doc(hidden)]
    fn kit_rows(&mut self, table: &str) -> Result<i64>;
    /// Ask `hook` before each commit of this store's connection (true: rolled back instead).
    #[doc(hidden)]
    fn kit_commit_hook(&mut self, hook: Box<dyn FnMut() -> bool + Send>);
    #[doc(hidden)]
    fn kit_import_run(&mut self, detail: &RunDetail, now_ms: i64) -> Result<()>;
}

impl KitStore for SqliteWorkflows {
    type Migration = tidemark_store_sqlite::Migration;
    type Sandbox = tempfile::TempDir;
    type Location = PathBuf;
    const KIT_COPIES: bool = true;

    fn kit_sandbox(_database: Option<&str>) -> Result<tempfile::TempDir> {
        tempfile::Builder::new()
            .prefix("tidemark-testing-")
            .tempdir()
            .map_err(|e| Error::io(format!("cannot create the test kit's temporary folder: {e}")))
    }

    fn kit_location(dir: &tempfile::TempDir, name: &str) -> PathBuf {
        dir.path().join(format!("{name}.db"))
    }

    fn kit_init(dir: &mut tempfile::TempDir, name: &str) -> Result<Self> {
        SqliteWorkflows::init_with(&Self::kit_location(dir, name), Durability::Normal)
    }

    fn kit_open(path: &PathBuf) -> Result<Self> {
        SqliteWorkflows::open_with(path, Durability::Normal)
    }

    fn kit_copy(dir: &mut tempfile::TempDir, from: &str, to: &str) -> Result<()> {
        // Closed: its last connection checkpointed the WAL into the file.
        let (from, to) = (Self::kit_location(dir, from), Self::kit_location(dir, to));
        std::fs::copy(&from, to).map_err(|e| Error::io(format!("cannot copy {}: {e}", from.display())))?;
        Ok(())
    }

    fn kit_remove(dir: &mut tempfile::TempDir, name: &str) {
        for suffix in ["", "-wal", "-shm"] {
            let mut file = Self::kit_location(dir, name).into_os_string();
            file.push(suffix);
            let _ = std::fs::remove_file(PathBuf::from(file));
        }
    }

    fn kit_migrate(&mut self, migrations: &[Self::Migration], now_ms: i64) -> Result<()> {
        tidemark_store_sqlite::apply_migrations(self.connection(), migrations, now_ms).map(drop)
    }

    fn kit_tables(&mut self) -> Result<BTreeSet<String>> {
        let conn = self.connection();
        let mut stmt =
            conn.prepare("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")?;
        let names = stmt.query_map([], |row| row.get::<_, String>(0))?;
        Ok(names.collect::<rusqlite::Result<BTreeSet<String>>>()?)
    }

    fn kit_rows(&mut self, table: &str) -> Result<i64> {
        let quoted = table.replace('"', "\"\"");
        Ok(self.connection().query_row(&format!("SELECT count(*) FROM \"{quoted}\""), [], |row| row.get(0))?)
    }

    fn kit_commit_hook(&mut self, hook: Box<dyn FnMut() -> bool + Send>) {
        self.connection().commit_hook(Some(hook));
    }

    fn kit_import_run(&mut self, detail: &RunDetail, now_ms: i64) -> Result<()> {
        self.import_run(detail, now_ms)
    }
}

/// The kit's schemas on a PostgreSQL server: each made by [`KitStore::kit_init`] and dropped by
/// [`KitStore::kit_remove`] or, the ones left, when the sandbox goes.
#[doc(hidden)]
pub struct PgSandbox {
    url: String,
    prefix: String,
    schemas: BTreeSet<String>,
}

impl PgSandbox {
    fn drop_schema(&self, schema: &str) -> Result<()> {
        let mut client = tidemark_store_postgres::connect(&self.url)?;
        client
            .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
            .map_err(|e| Error::store(format!("postgres: cannot drop the test kit's schema {schema}: {e}")))
    }
}

impl Drop for PgSandbox {
    fn drop(&mut self) {
        for schema in std::mem::take(&mut self.schemas) {
            let _ = self.drop_schema(&schema);
        }
    }
}

impl KitStore for PgWorkflows {
    type Migration = tidemark_store_postgres::Migration;
    type Sandbox = PgSandbox;
    type Location = (String, String);
    /// A schema cannot be copied as a file is.
    const KIT_COPIES: bool = false;

    fn kit_sandbox(database: Option<&str>) -> Result<PgSandbox> {
        static SANDBOXES: AtomicI64 = AtomicI64::new(0);
        let url = database.ok_or_else(|| {
            invalid("the test kit on PostgreSQL needs the database to make its schemas in: .database(url)")
        })?;
        // Unique among the processes of this machine (pid) and the tests of this one (counter).
        let prefix = format!("tidemark_kit_{}_{}", std::process::id(), SANDBOXES.fetch_add(1, Ordering::SeqCst));
        Ok(PgSandbox { url: url.to_string(), prefix, schemas: BTreeSet::new() })
    }

    fn kit_location(sandbox: &PgSandbox, name: &str) -> (String, String) {
        (sandbox.url.clone(), format!("{}_{name}", sandbox.prefix))
    }

    fn kit_init(sandbox: &mut PgSandbox, name: &str) -> Result<Self> {
        let (url, schema) = Self::kit_location(sandbox, name);
        // A schema left by an earlier process with the same pid is dropped first.
        sandbox.drop_schema(&schema)?;
        sandbox.schemas.insert(schema.clone());
        PgWorkflows::init(&url, &schema)
    }

    fn kit_open((url, schema): &(String, String)) -> Result<Self> {
        PgWorkflows::open(url, schema)
    }

    fn kit_copy(_: &mut PgSandbox, _: &str, _: &str) -> Result<()> {
        Err(Error::Invariant("a PostgreSQL schema is not copied".into()))
    }

    fn kit_remove(sandbox: &mut PgSandbox, name: &str) {
        let (_, schema) = Self::kit_location(sandbox, name);
        if sandbox.drop_schema(&schema).is_ok() {
            sandbox.schemas.remove(&schema);
        }
    }

    fn kit_migrate(&mut self, migrations: &[Self::Migration], now_ms: i64) -> Result<()> {
        let schema = self.schema().to_string();
        tidemark_store_postgres::apply_migrations(self.client(), &schema, migrations, now_ms).map(drop)
    }

    fn kit_tables(&mut self) -> Result<BTreeSet<String>> {
        let schema = self.schema().to_string();
        let rows = self
            .client()
            .query("SELECT table_name::text FROM information_schema.tables WHERE table_schema = $1", &[&schema])
            .map_err(|e| Error::store(format!("postgres: {e}")))?;
        Ok(rows.iter().map(|row| row.get::<_, String>(0)).collect())
    }

    fn kit_rows(&mut self, table: &str) -> Result<i64> {
        let (schema, quoted) = (self.schema().to_string(), table.replace('"', "\"\""));
        let row = self
            .client()
            .query_one(&format!("SELECT count(*) FROM \"{schema}\".\"{quoted}\""), &[])
            .map_err(|e| Error::store(format!("postgres: {e}")))?;
        Ok(row.get(0))
    }

    fn kit_commit_hook(&mut self, hook: Box<dyn FnMut() -> bool + Send>) {
        self.set_commit_hook(Some(hook));
    }

    fn kit_import_run(&mut self, detail: &RunDetail, now_ms: i64) -> Result<()> {
        self.import_run(detail, now_ms)
    }
}

// ---------------------------------------------------------------------------------------------
// What the kit sees happen: effects and step attempts, in order.
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Default)]
struct Log {
    /// False between the kit's executions and once the current process has crashed: a dead
    /// process does nothing, so nothing it would still do is recorded.
    live: bool,
    /// The process (0 first, then one more after each crash) of what is recorded now.
    process: u32,
    events: Vec<Event>,
}

/// What the kit saw, in the order it happened (each pushed under the log's lock with the time
/// taken there, so the times are in order too).
#[derive(Debug, Clone)]
enum Event {
    Effect {
        process: u32,
        at: Instant,
        effect: String,
        key: String,
    },
    /// `began`: when the attempt began (its end less the time it took).
    Attempt {
        process: u32,
        began: Instant,
        run_id: String,
        step: String,
        attempt: u32,
        end: StepAttemptEnd,
    },
    /// A commit of the process's connection.
    Commit {
        at: Instant,
    },
}

type SharedLog = Arc<Mutex<Log>>;

/// The recorder your fake external services call: one call per effect they perform, with the
/// idempotency key they were given. Cheap to clone (every clone records into the same log); give
/// a clone to your fake and the same [`Effects`] to [`CrashTest::effects`].
///
/// ```
/// use tidemark::prelude::*;
/// use tidemark::testing::Effects;
///
/// /// A fake payment service: charges once per idempotency key, as the real one does.
/// #[derive(Clone)]
/// struct FakePayments { effects: Effects }
///
/// impl FakePayments {
///     async fn charge(&self, order_id: &str, amount: i64, key: &str) -> Result<String, StepFailure> {
///         // The logical effect names what is done to what; the key is what the step passes.
///         let repeat = self.effects.record(&format!("charge {order_id}"), key);
///         // A repeat under the same key answers what the first call answered.
///         let _ = (repeat, amount);
///         Ok(format!("ch_{key}"))
///     }
/// }
/// # let _ = FakePayments { effects: Effects::new() };
/// ```
///
/// Name the *logical* effect (`charge order-1`, not `charge`) when one run performs the same kind
/// of effect on several things. Use one [`Effects`] per test: two tests that run at once with
/// one recorder would mix their calls.
#[derive(Clone, Default)]
pub struct Effects {
    log: SharedLog,
}

impl fmt::Debug for Effects {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Effects").field("calls", &lock(&self.log).events.len()).finish()
    }
}

/// One call a fake made to [`Effects::record`], as [`Effects::calls`] lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EffectCall {
    /// The logical effect (`charge order-1`).
    pub effect: String,
    /// The idempotency key it was called with.
    pub idempotency_key: String,
    /// The process that made the call: 0 for the first, one more after each crash.
    pub process: u32,
}

impl Effects {
    /// A recorder with no calls.
    pub fn new() -> Self {
        Self::default()
    }

    /// Record that `effect` was performed under `idempotency_key`. Answers true when this effect
    /// was already recorded with this key during the current execution (a repeat, which a real
    /// service answers with the first call's outcome). Outside the kit's executions, and after the
    /// current process crashed, nothing is recorded (and the answer is false).
    pub fn record(&self, effect: &str, idempotency_key: &str) -> bool {
        let mut log = lock(&self.log);
        if !log.live {
            return false;
        }
        let repeat = log.events.iter().any(
            |event| matches!(event, Event::Effect { effect: e, key, .. } if e == effect && key == idempotency_key),
        );
        let process = log.process;
        let at = Instant::now();
        log.events.push(Event::Effect { process, at, effect: effect.to_string(), key: idempotency_key.to_string() });
        repeat
    }

    /// The calls of the execution running now, or of the last one.
    pub fn calls(&self) -> Vec<EffectCall> {
        lock(&self.log)
            .events
            .iter()
            .filter_map(|event| match event {
                Event::Effect { process, effect, key, .. } => {
                    Some(EffectCall { effect: effect.clone(), idempotency_key: key.clone(), process: *process })
                }
                Event::Attempt { .. } | Event::Commit { .. } => None,
            })
            .collect()
    }

    fn begin_execution(&self) {
        let mut log = lock(&self.log);
        log.events.clear();
        log.process = 0;
        log.live = true;
    }

    fn end_execution(&self) -> Vec<Event> {
        let mut log = lock(&self.log);
        log.live = false;
        log.events.clone()
    }
}

/// Tells the log of every step attempt, while the process lives.
struct AttemptRecorder {
    log: SharedLog,
}

impl WorkerObserver for AttemptRecorder {
    fn step_attempted(&self, attempt: &StepAttempt<'_>) {
        let mut log = lock(&self.log);
        if log.live {
            let process = log.process;
            log.events.push(Event::Attempt {
                process,
                began: attempt.began,
                run_id: attempt.run_id.to_string(),
                step: attempt.step.to_string(),
                attempt: attempt.attempt,
                end: attempt.end,
            });
        }
    }
}

/// One process of an execution: its commits so far, and the one it crashes at.
struct Process {
    commits: u32,
    crash_at: Option<u32>,
    crashed: bool,
}

impl Process {
    fn new(crash_at: Option<u32>) -> Arc<Mutex<Process>> {
        Arc::new(Mutex::new(Process { commits: 0, crash_at, crashed: false }))
    }
}

/// The commit hook: true turns the commit into a rollback. At the crash boundary and after it
/// every commit is refused, and the log stops recording.
fn refuse_commit(process: &Mutex<Process>, log: &Mutex<Log>) -> bool {
    let mut process = lock(process);
    if process.crashed {
        return true;
    }
    process.commits += 1;
    let mut log = lock(log);
    if process.crash_at == Some(process.commits) {
        process.crashed = true;
        log.live = false;
        return true;
    }
    if log.live {
        log.events.push(Event::Commit { at: Instant::now() });
    }
    false
}

// ---------------------------------------------------------------------------------------------
// The report.
// ---------------------------------------------------------------------------------------------

/// What a finding is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FindingKind {
    /// A replay took another branch: the run was parked as non-deterministic, or its journal
    /// differs from the crash-free run's.
    NonDeterministicReplay,
    /// A step's effect happened more often than crashes explain: a step ran again although its
    /// completion was committed, or a write landed twice.
    StepRanTwice,
    /// A retry of a step called an effect with another idempotency key than the attempt before.
    IdempotencyKeyChanged,
    /// A note, not a problem: a step whose completion had not been committed when a crash came
    /// ran again with the same key (at least once, as promised).
    RetriedWithSameKey,
    /// New code does not replay a recorded journal: another step at a position, an end before
    /// the journaled steps, or a journal it cannot read.
    RecordedJournalMismatch,
    /// A run did not end, or the kit could not take it to its end.
    Unfinished,
}

impl FindingKind {
    /// The word for this kind (`non_deterministic_replay`, `step_ran_twice`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            FindingKind::NonDeterministicReplay => "non_deterministic_replay",
            FindingKind::StepRanTwice => "step_ran_twice",
            FindingKind::IdempotencyKeyChanged => "idempotency_key_changed",
            FindingKind::RetriedWithSameKey => "retried_with_same_key",
            FindingKind::RecordedJournalMismatch => "recorded_journal_mismatch",
            FindingKind::Unfinished => "unfinished",
        }
    }

    /// True for a problem ([`Report::assert_ok`] fails on it); false for a note.
    pub fn is_problem(self) -> bool {
        self != FindingKind::RetriedWithSameKey
    }
}

impl fmt::Display for FindingKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One thing the kit found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// What it is about.
    pub kind: FindingKind,
    /// The run it was found in (the run under test, one of its children, or a recorded run).
    pub run_id: String,
    /// The step concerned, when one is.
    pub step: Option<String>,
    /// Its journal position, when known.
    pub seq: Option<u32>,
    /// The crashes of the execution that found it: the boundary each process crashed at, in
    /// order (`[3]`: the first process crashed at its third commit; `[3, 1]`: and the process that
    /// recovered it at its first). Empty without a crash (the crash-free run, or a replay of a
    /// recorded journal). [`CrashTest::schedule`] with these boundaries runs that execution again.
    pub crashes: Vec<u32>,
    /// What happened, in a sentence or two.
    pub message: String,
}

impl Finding {
    /// The boundary the first process crashed at, if any.
    pub fn boundary(&self) -> Option<u32> {
        self.crashes.first().copied()
    }
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let label = if self.kind.is_problem() { "problem" } else { "note" };
        write!(f, "{label} {}: run {}", self.kind, self.run_id)?;
        match (&self.step, self.seq) {
            (Some(step), Some(seq)) => write!(f, ", step {step:?} at position {seq}")?,
            (Some(step), None) => write!(f, ", step {step:?}")?,
            (None, Some(seq)) => write!(f, ", position {seq}")?,
            (None, None) => {}
        }
        if self.crashes.is_empty() {
            write!(f, ", without a crash")?;
        } else {
            write!(f, ", crashes at boundaries {:?}", self.crashes)?;
        }
        write!(f, ": {}", self.message)
    }
}

/// What a [`CrashTest`] or a [`ReplayCheck`] found. [`Report::assert_ok`] panics with the
/// report when it holds a problem; its `Display` is the readable report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// What was checked: the workflow and run, or the recorded runs.
    pub subject: String,
    /// The journal boundaries (commits) of the crash-free execution; 0 for a replay check.
    pub boundaries: u32,
    /// Executions crashed at each boundary in turn.
    pub boundary_schedules: u32,
    /// Executions with random crash schedules.
    pub random_schedules: u32,
    /// Executions with the schedules given to [`CrashTest::schedule`].
    pub given_schedules: u32,
    /// The seed the random schedules were drawn from: the same seed draws the same schedules.
    pub seed: Option<u64>,
    /// Everything found, in the order found.
    pub findings: Vec<Finding>,
    /// The runs of the crash-free execution as they ended (a [`ReplayCheck`]: the runs as the
    /// replay left them). Serialised with `serde_json`, one of them is a recorded journal
    /// [`ReplayCheck::recorded_json`] takes, as `GET /v1/runs/{id}` gives one.
    pub runs: Vec<RunDetail>,
}

/// At most this many findings are written out by `Display` (the rest are counted).
const FINDINGS_SHOWN_MAX: usize = 40;

impl Report {
    fn new(subject: String) -> Self {
        Report {
            subject,
            boundaries: 0,
            boundary_schedules: 0,
            random_schedules: 0,
            given_schedules: 0,
            seed: None,
            findings: Vec::new(),
            runs: Vec::new(),
        }
    }

    /// Add findings: every problem, and a note only when no note of its kind was made for its run
    /// and step yet (the same retry shows at many boundaries).
    fn add(&mut self, findings: Vec<Finding>) {
        for finding in findings {
            let repeated = !finding.kind.is_problem()
                && self
                    .findings
                    .iter()
                    .any(|f| f.kind == finding.kind && f.run_id == finding.run_id && f.step == finding.step);
            if !repeated {
                self.findings.push(finding);
            }
        }
    }

    /// The findings that are problems (not notes).
    pub fn problems(&self) -> impl Iterator<Item = &Finding> {
        self.findings.iter().filter(|finding| finding.kind.is_problem())
    }

    /// The findings of `kind`.
    pub fn of_kind(&self, kind: FindingKind) -> impl Iterator<Item = &Finding> {
        self.findings.iter().filter(move |finding| finding.kind == kind)
    }

    /// True when a finding of `kind` was made.
    pub fn has(&self, kind: FindingKind) -> bool {
        self.of_kind(kind).next().is_some()
    }

    /// True when no finding is a problem.
    pub fn is_ok(&self) -> bool {
        self.problems().next().is_none()
    }

    /// Panic with the whole report when a finding is a problem.
    #[track_caller]
    pub fn assert_ok(&self) {
        if !self.is_ok() {
            panic!("{self}");
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "tidemark::testing: {}", self.subject)?;
        if self.boundaries > 0 {
            write!(
                f,
                "  {} journal boundaries without crashes; executions crashed at each boundary in turn: {}, \
                 with random crashes: {}",
                self.boundaries, self.boundary_schedules, self.random_schedules
            )?;
            if let Some(seed) = self.seed {
                write!(f, " (seed {seed}: `.seed({seed})` draws them again)")?;
            }
            writeln!(f, ", given: {}", self.given_schedules)?;
        }
        let problems = self.problems().count();
        let notes = self.findings.len() - problems;
        let plural = |n: usize, word: &str| if n == 1 { format!("1 {word}") } else { format!("{n} {word}s") };
        writeln!(f, "  {}, {}", plural(problems, "problem"), plural(notes, "note"))?;
        let mut shown: Vec<&Finding> = self.problems().collect();
        shown.extend(self.findings.iter().filter(|finding| !finding.kind.is_problem()));
        for finding in shown.iter().take(FINDINGS_SHOWN_MAX) {
            writeln!(f, "  - {finding}")?;
        }
        if shown.len() > FINDINGS_SHOWN_MAX {
            writeln!(f, "  ... and {} more", shown.len() - FINDINGS_SHOWN_MAX)?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// The crash test.
// ---------------------------------------------------------------------------------------------

/// One run of a workflow, executed without crashes, then crashed at every journal boundary in
/// turn and at random ones, each time recovered and taken to its end, and every execution
/// compared with the crash-free one (see the [module docs](self) for what is reported).
///
/// Blocking: call [`CrashTest::run`] from a plain `#[test]` (inside an async test it still
/// works, on a thread of its own, but blocks that test's task meanwhile).
///
/// ```
/// use std::time::Duration;
/// use tidemark::prelude::*;
/// use tidemark::testing::{CrashTest, Effects};
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct Order { order_id: String, amount: i64 }
///
/// fn checkout(effects: Effects) -> Workflow {
///     tidemark::workflow("checkout", 1, move |ctx: Context, order: Order| {
///         let effects = effects.clone();
///         async move {
///             let key: String = ctx.step("charge", None, |key| async move {
///                 effects.record(&format!("charge {}", order.order_id), &key); // the fake payment service
///                 Ok(key)
///             }).await?;
///             ctx.sleep(Duration::from_secs(3600)).await?; // passes on the kit's clock at once
///             let charge = key.clone();
///             ctx.tx_step("record", None, move |tx: &Connection| {
///                 tx.execute("INSERT INTO charges (charge) VALUES (?1)", [&charge])?;
///                 Ok(())
///             }).await?;
///             Ok(key)
///         }
///     })
/// }
///
/// # fn main() -> tidemark::Result<()> {
/// let effects = Effects::new();
/// let report = CrashTest::new(checkout(effects.clone()))
///     .input(&Order { order_id: "order-1".into(), amount: 500 })
///     .effects(&effects)
///     .migration(Migration::sql("0001_charges", "CREATE TABLE charges (charge TEXT NOT NULL)"))
///     .run()?;
/// report.assert_ok(); // panics with the report when a crash breaks something
/// assert!(report.boundaries > 3); // claim, charge, sleep, wake-up, record, end: each crashed in turn
/// assert_eq!(report.boundary_schedules, report.boundaries);
/// # Ok(()) }
/// ```
pub struct CrashTest<S: KitStore = SqliteWorkflows> {
    /// The workflow under test first, then the others it starts (children).
    workflows: Vec<Result<Workflow<S>>>,
    input: std::result::Result<Value, String>,
    run_id: String,
    effects: Effects,
    migrations: Vec<S::Migration>,
    events: Vec<(String, std::result::Result<Value, String>)>,
    /// Where the PostgreSQL kit makes its schemas.
    database: Option<String>,
    every_boundary: bool,
    random_schedules: u32,
    crashes_per_schedule: u32,
    seed: u64,
    schedules: Vec<Vec<u32>>,
    compare_outputs: bool,
    compare_external_outputs: bool,
}

impl<S: KitStore> fmt::Debug for CrashTest<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CrashTest")
            .field("workflows", &self.workflows.iter().map(|w| w.as_ref().map(|w| w.name())).collect::<Vec<_>>())
            .field("run_id", &self.run_id)
            .field("seed", &self.seed)
            .finish_non_exhaustive()
    }
}

impl CrashTest<PgWorkflows> {
    /// The PostgreSQL database (a `postgres://` URL, or a libpq string) the kit makes its
    /// throwaway schemas in: needed by a crash test of a workflow on PostgreSQL, refused at
    /// [`CrashTest::run`] (`invalid_argument`) without it. The login role must be allowed to
    /// create schemas there.
    pub fn database(mut self, url: &str) -> Self {
        self.database = Some(url.to_string());
        self
    }
}

impl<S: KitStore> CrashTest<S> {
    /// A crash test of `workflow` (a [`Workflow`](crate::Workflow) or a
    /// [`Saga`](crate::Saga), or their PostgreSQL kinds), with input `null` until
    /// [`CrashTest::input`] gives one. Defaults: every boundary in turn,
    /// [`RANDOM_SCHEDULES_DEFAULT`] random schedules from [`SEED_DEFAULT`], outputs compared.
    pub fn new(workflow: impl IntoWorkflow<S>) -> Self {
        CrashTest {
            workflows: vec![workflow.into_workflow()],
            input: Ok(Value::Null),
            run_id: RUN_ID_DEFAULT.to_string(),
            effects: Effects::new(),
            migrations: Vec::new(),
            events: Vec::new(),
            database: None,
            every_boundary: true,
            random_schedules: RANDOM_SCHEDULES_DEFAULT,
            crashes_per_schedule: CRASHES_PER_SCHEDULE_DEFAULT,
            seed: SEED_DEFAULT,
            schedules: Vec::new(),
            compare_outputs: true,
            compare_external_outputs: false,
        }
    }

    /// Register another workflow beside the one under test (one it starts as a child).
    pub fn workflow(mut self, workflow: impl IntoWorkflow<S>) -> Self {
        self.workflows.push(workflow.into_workflow());
        self
    }

    /// The run's input (refused at [`CrashTest::run`] as the workflow refuses it: `invalid_input`).
    pub fn input<T: Serialize>(mut self, input: &T) -> Self {
        self.input = serde_json::to_value(input).map_err(|e| format!("the input does not serialise: {e}"));
        self
    }

    /// The run's id (default [`RUN_ID_DEFAULT`]); its external steps' keys start with it.
    pub fn run_id(mut self, run_id: &str) -> Self {
        self.run_id = run_id.to_string();
        self
    }

    /// The recorder your fakes call (see [`Effects`]). Without it, only step attempts and the
    /// journal are checked.
    pub fn effects(mut self, effects: &Effects) -> Self {
        self.effects = effects.clone();
        self
    }

    /// A migration of your own tables in the workflow database (what your transactional steps
    /// write to), applied before the run starts. Their row counts after every execution are
    /// compared with the crash-free execution's.
    pub fn migration(mut self, migration: S::Migration) -> Self {
        self.migrations.push(migration);
        self
    }

    /// Send the run the event `name` with `payload` before it starts (a wait for `name` then
    /// finds it); each event gets its own id.
    pub fn event<T: Serialize>(mut self, name: &str, payload: &T) -> Self {
        let payload = serde_json::to_value(payload).map_err(|e| format!("event {name} does not serialise: {e}"));
        self.events.push((name.to_string(), payload));
        self
    }

    /// Crash at every boundary in turn (default true).
    pub fn every_boundary(mut self, on: bool) -> Self {
        self.every_boundary = on;
        self
    }

    /// Run `count` random crash schedules (default [`RANDOM_SCHEDULES_DEFAULT`], at most
    /// [`RANDOM_SCHEDULES_MAX`]; 0: none).
    pub fn random_schedules(mut self, count: u32) -> Self {
        self.random_schedules = count;
        self
    }

    /// Each random schedule crashes 1..=`max` times (default [`CRASHES_PER_SCHEDULE_DEFAULT`], at
    /// most [`CRASHES_PER_SCHEDULE_MAX`]).
    pub fn crashes_per_schedule(mut self, max: u32) -> Self {
        self.crashes_per_schedule = max;
        self
    }

    /// The seed the random schedules are drawn from (default [`SEED_DEFAULT`]). The report
    /// names it: the same seed draws the same schedules.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Also run this crash schedule: the first process crashes at its `boundaries[0]`-th commit,
    /// the one that recovers it at its `boundaries[1]`-th, and so on (a [`Finding`]'s `crashes`).
    pub fn schedule(mut self, boundaries: &[u32]) -> Self {
        self.schedules.push(boundaries.to_vec());
        self
    }

    /// Compare the outputs of transactional steps, children, waits and messages, and the run's
    /// result, with the crash-free execution's, while the values both read are the same (default
    /// true): an output that differs came from something outside the journal. Turn it off when a
    /// step returns something that differs per execution on purpose (a path, a fresh id).
    pub fn compare_outputs(mut self, on: bool) -> Self {
        self.compare_outputs = on;
        self
    }

    /// Compare the outputs of external steps and compensations too (default false: the outside
    /// world may answer each call differently, and a fake that mints ids does). For fakes that
    /// answer the same request the same way.
    pub fn compare_external_outputs(mut self, on: bool) -> Self {
        self.compare_external_outputs = on;
        self
    }

    /// Run every execution and report. Bad configuration is an error, nothing run: a workflow
    /// refused as the registry refuses it (`already_exists`, `invalid_argument`), an input the
    /// workflow refuses (`invalid_input`), bad ids (`invalid_id`), a schedule or count out of
    /// its bounds (`invalid_argument`), a migration that fails.
    pub fn run(&self) -> Result<Report> {
        std::thread::scope(|scope| {
            let thread = std::thread::Builder::new()
                .name("tidemark-testing".into())
                .spawn_scoped(scope, || self.run_here())
                .map_err(|e| Error::io(format!("cannot start the test kit's thread: {e}")))?;
            thread.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }

    fn validate(&self) -> Result<()> {
        if self.random_schedules > RANDOM_SCHEDULES_MAX {
            return Err(invalid(format!("random_schedules must be at most {RANDOM_SCHEDULES_MAX}")));
        }
        if !(1..=CRASHES_PER_SCHEDULE_MAX).contains(&self.crashes_per_schedule) {
            return Err(invalid(format!("crashes_per_schedule must be 1..={CRASHES_PER_SCHEDULE_MAX}")));
        }
        for schedule in &self.schedules {
            if schedule.is_empty() || schedule.len() > CRASHES_PER_SCHEDULE_MAX as usize || schedule.contains(&0) {
                return Err(invalid(format!(
                    "a crash schedule holds 1..={CRASHES_PER_SCHEDULE_MAX} boundaries, each at least 1: {schedule:?}"
                )));
            }
        }
        Ok(())
    }

    fn run_here(&self) -> Result<Report> {
        self.validate()?;
        let mut registry = Workflows::new();
        let mut under_test = None;
        for workflow in &self.workflows {
            let workflow = workflow.clone()?;
            under_test.get_or_insert((workflow.name().to_string(), workflow.version()));
            registry.add(workflow)?;
        }
        let (name, version) = under_test.ok_or_else(|| invalid("a crash test needs a workflow"))?;
        let input = self.input.clone().map_err(|m| Error::invalid(workflow_codes::INVALID_INPUT, m))?;
        let request = StartRequest::new(&self.run_id, &name, version, input);
        registry.check_start(&request)?;
        let mut events = Vec::with_capacity(self.events.len());
        for (event, payload) in &self.events {
            let payload = payload.clone().map_err(|m| Error::invalid(codes::INVALID_PAYLOAD, m))?;
            events.push((event.clone(), payload));
        }
        let mut env = Env::new(self, registry, request, events)?;
        let mut report = Report::new(format!("workflow {name} v{version}, run {}", self.run_id));
        report.seed = (self.random_schedules > 0).then_some(self.seed);

        let reference = env.execute(&[])?;
        report.boundaries = reference.commits.first().copied().unwrap_or(0);
        report.runs = reference.runs.values().cloned().collect();
        report.add(env.findings_alone(&reference));
        if reference.unfinished.is_some() {
            // Nothing to compare the crashed executions with.
            return Ok(report);
        }
        if self.every_boundary {
            for boundary in 1..=BOUNDARIES_MAX {
                let outcome = env.execute(&[boundary])?;
                if outcome.crashes.is_empty() {
                    break; // no crash left to inject: the run completed before this boundary
                }
                report.boundary_schedules += 1;
                report.add(env.compare(&reference, &outcome));
            }
        }
        let mut random = SplitMix64(self.seed);
        let span = report.boundaries.max(1);
        for _ in 0..self.random_schedules {
            let crashes = 1 + random.below(self.crashes_per_schedule);
            let schedule: Vec<u32> = (0..crashes).map(|_| 1 + random.below(span)).collect();
            let outcome = env.execute(&schedule)?;
            report.random_schedules += 1;
            report.add(env.compare(&reference, &outcome));
        }
        for schedule in &self.schedules {
            let outcome = env.execute(schedule)?;
            report.given_schedules += 1;
            report.add(env.compare(&reference, &outcome));
        }
        Ok(report)
    }
}

/// A small, seedable generator (SplitMix64): the same seed gives the same schedules on every
/// machine and build.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform enough in `0..n` (`n` >= 1).
    fn below(&mut self, n: u32) -> u32 {
        (self.next() % u64::from(n.max(1))) as u32
    }
}

/// What one execution left: its crashes, the durable state at each, the end, and what was seen.
struct Outcome {
    /// The boundary each crashed process crashed at, in order.
    crashes: Vec<u32>,
    /// The commits of each process (the crashed ones up to their crash, then the last).
    commits: Vec<u32>,
    /// The runs as durable at each crash.
    snapshots: Vec<BTreeMap<String, RunDetail>>,
    /// The runs at the end.
    runs: BTreeMap<String, RunDetail>,
    /// Effects and step attempts, in order.
    events: Vec<Event>,
    /// The rows of each of the user's tables at the end.
    tables: BTreeMap<String, i64>,
    /// Why the run did not reach its end, if it did not.
    unfinished: Option<String>,
}

/// The kit's working state for one [`CrashTest::run`].
struct Env<'a, S: KitStore> {
    test: &'a CrashTest<S>,
    registry: Workflows<S>,
    request: StartRequest,
    events: Vec<(String, Value)>,
    /// Where the stores are: the prepared store [`TEMPLATE`] (migrated, the run started, its
    /// events sent) copied for each execution where the store can be copied, and the
    /// executions' stores.
    sandbox: S::Sandbox,
    /// Tables that are not the user's.
    own_tables: BTreeSet<String>,
    executions: u32,
    runtime: tokio::runtime::Runtime,
}

/// The name of the kit's prepared store.
const TEMPLATE: &str = "template";

fn worker_options() -> WorkerOptions {
    WorkerOptions {
        concurrency: 1,
        lease_ms: LEASE_MS,
        poll_interval_ms: POLL_INTERVAL_MS,
        ..WorkerOptions::new("tidemark-testing")
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::io(format!("cannot start the test kit's runtime: {e}")))
}

/// Every run of a store (the run and its children), with journals, attempts and events.
fn read_runs<S: KitStore>(store: &S) -> Result<BTreeMap<String, RunDetail>> {
    let records = store.list_runs(&RunFilter::default(), RUNS_MAX + 1)?;
    if records.len() > RUNS_MAX {
        return Err(Error::invalid(codes::LIMIT_EXCEEDED, format!("the test kit takes at most {RUNS_MAX} runs")));
    }
    let mut runs = BTreeMap::new();
    for record in records {
        if let Some(detail) = store.run(&record.run_id)? {
            runs.insert(record.run_id, detail);
        }
    }
    Ok(runs)
}

impl<'a, S: KitStore> Env<'a, S> {
    fn new(
        test: &'a CrashTest<S>,
        registry: Workflows<S>,
        request: StartRequest,
        events: Vec<(String, Value)>,
    ) -> Result<Self> {
        let sandbox = S::kit_sandbox(test.database.as_deref())?;
        let mut env = Env {
            test,
            registry,
            request,
            events,
            own_tables: BTreeSet::new(),
            sandbox,
            executions: 0,
            runtime: runtime()?,
        };
        {
            let mut store = S::kit_init(&mut env.sandbox, TEMPLATE)?;
            env.own_tables = store.kit_tables()?;
            env.own_tables.insert("user_migrations".to_string());
            env.prepare(&mut store)?;
        }
        if !S::KIT_COPIES {
            // Made to read the tables and check the preparation: each execution makes its own.
            S::kit_remove(&mut env.sandbox, TEMPLATE);
        }
        Ok(env)
    }

    /// Migrate a new store, start the run and send it its events.
    fn prepare(&self, store: &mut S) -> Result<()> {
        store.kit_migrate(&self.test.migrations, CLOCK_START_MS)?;
        match store.start_runs(std::slice::from_ref(&self.request), CLOCK_START_MS)?.as_slice() {
            [StartOutcome::Started { .. }] => {}
            other => return Err(Error::Invariant(format!("the kit's first start answered {other:?}"))),
        }
        for (index, (name, payload)) in self.events.iter().enumerate() {
            let event_id = format!("kit-event-{index}");
            store.send_event(&self.request.run_id, &event_id, name, payload, CLOCK_START_MS)?;
        }
        Ok(())
    }

    /// One execution with crash schedule `schedule`, taken to the run's end.
    fn execute(&mut self, schedule: &[u32]) -> Result<Outcome> {
        self.executions += 1;
        let name = format!("execution_{}", self.executions);
        if S::KIT_COPIES {
            S::kit_copy(&mut self.sandbox, TEMPLATE, &name)?;
        } else {
            let mut store = S::kit_init(&mut self.sandbox, &name)?;
            self.prepare(&mut store)?;
        }
        let location = S::kit_location(&self.sandbox, &name);
        let outcome = self.execute_at(&location, schedule);
        S::kit_remove(&mut self.sandbox, &name);
        outcome
    }

    fn execute_at(&self, location: &S::Location, schedule: &[u32]) -> Result<Outcome> {
        let reader = S::kit_open(location)?;
        let effects = &self.test.effects;
        effects.begin_execution();
        let clock = Arc::new(AtomicI64::new(CLOCK_START_MS));
        let mut outcome = Outcome {
            crashes: Vec::new(),
            commits: Vec::new(),
            snapshots: Vec::new(),
            runs: BTreeMap::new(),
            events: Vec::new(),
            tables: BTreeMap::new(),
            unfinished: None,
        };
        let mut process = Process::new(schedule.first().copied());
        let mut idle = 0;
        for round in 0..=ROUNDS_MAX {
            if round == ROUNDS_MAX {
                outcome.unfinished = Some(format!("the run did not end within {ROUNDS_MAX} worker passes"));
                break;
            }
            let passed = self.pass(location, &clock, &process, effects);
            let (crashed, commits, boundary) = {
                let p = lock(&process);
                (p.crashed, p.commits, p.crash_at.unwrap_or(0))
            };
            if crashed {
                outcome.crashes.push(boundary);
                outcome.commits.push(commits);
                outcome.snapshots.push(read_runs(&reader)?);
                let next = outcome.crashes.len();
                process = Process::new(schedule.get(next).copied());
                // The dead worker's leases expire before the next one claims.
                clock.fetch_add(LEASE_MS + 1, Ordering::SeqCst);
                let mut log = lock(&effects.log);
                log.process = next as u32;
                log.live = true;
                continue;
            }
            let report = match passed {
                Ok(report) => report,
                Err(error) => {
                    outcome.unfinished = Some(format!("the worker failed: {error}"));
                    break;
                }
            };
            let runs = read_runs(&reader)?;
            let next_due = runs
                .values()
                .filter(|detail| !detail.run.status.is_terminal())
                .map(|detail| {
                    let lease_over = detail.run.lease_expires_at_ms.map_or(i64::MIN, |at| at.saturating_add(1));
                    (detail.run.wake_at_ms.max(lease_over), &detail.run)
                })
                .min_by_key(|(at, _)| *at);
            let Some((at, run)) = next_due else { break };
            let now = clock.load(Ordering::SeqCst);
            if at > now {
                clock.store(at, Ordering::SeqCst);
                idle = 0;
            } else if report.claimed == 0 {
                idle += 1;
                if idle >= 2 {
                    outcome.unfinished = Some(format!(
                        "run {} is {} and due, but the kit's worker claims nothing (is its workflow {} v{} registered?)",
                        run.run_id,
                        run.status.as_str(),
                        run.workflow,
                        run.version
                    ));
                    break;
                }
            }
        }
        outcome.commits.push(lock(&process).commits);
        outcome.events = effects.end_execution();
        outcome.runs = read_runs(&reader)?;
        outcome.tables = self.table_rows(reader)?;
        Ok(outcome)
    }

    /// One worker pass: a writer on a new connection (its commits counted and crashed by the
    /// hook), a worker of one slot, until nothing is due.
    fn pass(
        &self,
        location: &S::Location,
        clock: &Arc<AtomicI64>,
        process: &Arc<Mutex<Process>>,
        effects: &Effects,
    ) -> Result<WorkerReport> {
        let (hook_process, hook_log, location) = (process.clone(), effects.log.clone(), location.clone());
        let read_clock = clock.clone();
        let kit_clock: Clock = Arc::new(move || read_clock.load(Ordering::SeqCst));
        let writer = Writer::spawn_with_clock(
            move || {
                let mut store = S::kit_open(&location)?;
                store.kit_commit_hook(Box::new(move || refuse_commit(&hook_process, &hook_log)));
                Ok(store)
            },
            kit_clock,
        )?;
        let worker = Worker::new(writer, self.registry.clone(), worker_options())?
            .with_observer(Arc::new(AttemptRecorder { log: effects.log.clone() }));
        self.runtime.block_on(worker.run_until_idle())
    }

    fn table_rows(&self, mut store: S) -> Result<BTreeMap<String, i64>> {
        let names: Vec<String> = store.kit_tables()?.difference(&self.own_tables).cloned().collect();
        let mut rows = BTreeMap::new();
        for name in names {
            let count = store.kit_rows(&name)?;
            rows.insert(name, count);
        }
        Ok(rows)
    }

    /// What one execution shows by itself: runs parked as non-deterministic, retries that
    /// changed keys, a run that did not end.
    fn findings_alone(&self, outcome: &Outcome) -> Vec<Finding> {
        let mut findings = Vec::new();
        for detail in outcome.runs.values() {
            if let Some(finding) = parked_as_non_deterministic(detail, &outcome.crashes) {
                findings.push(finding);
            }
        }
        findings.extend(key_changes(outcome));
        if let Some(reason) = &outcome.unfinished {
            findings.push(Finding {
                kind: FindingKind::Unfinished,
                run_id: self.request.run_id.clone(),
                step: None,
                seq: None,
                crashes: outcome.crashes.clone(),
                message: reason.clone(),
            });
        }
        findings
    }

    /// Everything a crashed execution shows, alone and against the crash-free one.
    fn compare(&self, reference: &Outcome, outcome: &Outcome) -> Vec<Finding> {
        let mut findings = self.findings_alone(outcome);
        let finding = |kind, run_id: &str, step: Option<String>, seq: Option<u32>, message: String| Finding {
            kind,
            run_id: run_id.to_string(),
            step,
            seq,
            crashes: outcome.crashes.clone(),
            message,
        };
        let parked: BTreeSet<&str> = findings
            .iter()
            .filter(|f| f.kind == FindingKind::NonDeterministicReplay)
            .map(|f| f.run_id.as_str())
            .collect();
        let run_ids: BTreeSet<&String> = reference.runs.keys().chain(outcome.runs.keys()).collect();
        let mut journal_findings = Vec::new();
        for run_id in run_ids {
            if parked.contains(run_id.as_str()) {
                continue;
            }
            match (reference.runs.get(run_id), outcome.runs.get(run_id)) {
                (Some(expected), Some(got)) => {
                    if let Some((seq, step, message)) =
                        journal_difference(expected, got, self.test.compare_outputs, self.test.compare_external_outputs)
                    {
                        journal_findings.push(finding(FindingKind::NonDeterministicReplay, run_id, step, seq, message));
                    }
                }
                (Some(expected), None) => journal_findings.push(finding(
                    FindingKind::NonDeterministicReplay,
                    run_id,
                    None,
                    None,
                    format!(
                        "the crash-free execution has run {run_id} (workflow {}), this one not",
                        expected.run.workflow
                    ),
                )),
                (None, Some(got)) => journal_findings.push(finding(
                    FindingKind::NonDeterministicReplay,
                    run_id,
                    None,
                    None,
                    format!("this execution has run {run_id} (workflow {}), the crash-free one not", got.run.workflow),
                )),
                (None, None) => {}
            }
        }
        findings.extend(journal_findings);
        findings.extend(effects_beyond_crashes(reference, outcome, &self.request.run_id));
        for (table, rows) in &outcome.tables {
            let expected = reference.tables.get(table).copied().unwrap_or(0);
            if *rows != expected {
                findings.push(finding(
                    FindingKind::StepRanTwice,
                    &self.request.run_id,
                    None,
                    None,
                    format!(
                        "your table {table} holds {rows} rows, {expected} after the crash-free execution: a write landed \
                         twice (or was lost), e.g. an external step that writes to the database, or a transactional \
                         step's effect outside its transaction"
                    ),
                ));
            }
        }
        findings
    }
}

/// The journal position a runtime message names (`... position 3 ...`).
fn position_in(message: &str) -> Option<u32> {
    let rest = &message[message.find("position ")? + "position ".len()..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

fn name_at(detail: &RunDetail, seq: Option<u32>) -> Option<String> {
    seq.and_then(|seq| detail.journal.get(seq as usize)).map(|entry| entry.name.clone())
}

fn parked_as_non_deterministic(detail: &RunDetail, crashes: &[u32]) -> Option<Finding> {
    let error = detail.run.error.as_deref().unwrap_or_default();
    if detail.run.status != RunStatus::Parked || !error.contains("non-deterministic replay") {
        return None;
    }
    let seq = position_in(error);
    let after = if crashes.is_empty() { "replayed after a suspension" } else { "replayed after a crash" };
    Some(Finding {
        kind: FindingKind::NonDeterministicReplay,
        run_id: detail.run.run_id.clone(),
        step: name_at(detail, seq),
        seq,
        crashes: crashes.to_vec(),
        message: format!(
            "{after}, the run was parked: {error} (branch only on what the journal holds: step outputs, ctx.now(), \
             ctx.random(), ctx.uuid())"
        ),
    })
}

fn describe(entry: &JournalEntry) -> String {
    format!("{} step {:?} ({})", entry.kind.as_str(), entry.name, entry.status.as_str())
}

/// The first difference between the crash-free journal of a run and this execution's:
/// (position, step, message). The journals are compared while every value the runs read (kind
/// `value`: `ctx.now()`, `ctx.random()`, `ctx.uuid()`) is the same in both: after a crash the
/// clock has moved and a fresh run draws its own numbers, so from the first value that differs on
/// the two executions are different runs that may rightly branch apart (a replay that branched
/// within one run is still caught: the runtime parks it).
fn journal_difference(
    expected: &RunDetail,
    got: &RunDetail,
    compare_outputs: bool,
    compare_external_outputs: bool,
) -> Option<(Option<u32>, Option<String>, String)> {
    let positions = expected.journal.len().max(got.journal.len());
    for position in 0..positions {
        let seq = Some(position as u32);
        match (expected.journal.get(position), got.journal.get(position)) {
            (Some(a), Some(b)) if a.name != b.name || a.kind != b.kind || a.status != b.status => {
                return Some((
                    seq,
                    Some(b.name.clone()),
                    format!(
                        "the replay took another branch: position {position} holds {}, the crash-free execution {}",
                        describe(b),
                        describe(a)
                    ),
                ));
            }
            (Some(a), Some(b)) if a.output != b.output => {
                if a.kind == StepKind::Value {
                    return None;
                }
                let external = matches!(a.kind, StepKind::External | StepKind::Compensation);
                if compare_outputs && (compare_external_outputs || !external) {
                    return Some((
                        seq,
                        Some(b.name.clone()),
                        format!(
                            "the replay gave step {:?} another output: {} here, {} without crashes (its input came \
                             from outside the journal?)",
                            b.name,
                            b.output.as_ref().map_or("none".into(), Value::to_string),
                            a.output.as_ref().map_or("none".into(), Value::to_string)
                        ),
                    ));
                }
            }
            (Some(_), Some(_)) => {}
            (Some(a), None) => {
                return Some((
                    seq,
                    Some(a.name.clone()),
                    format!(
                        "the replay took another branch: the journal ends before position {position}, where the \
                         crash-free execution has {}",
                        describe(a)
                    ),
                ));
            }
            (None, Some(b)) => {
                return Some((
                    seq,
                    Some(b.name.clone()),
                    format!(
                        "the replay took another branch: position {position} holds {}, where the crash-free \
                         execution's journal ends",
                        describe(b)
                    ),
                ));
            }
            (None, None) => {}
        }
    }
    if expected.run.status != got.run.status {
        return Some((
            None,
            None,
            format!(
                "the run ended {} ({}), {} without crashes",
                got.run.status.as_str(),
                got.run.error.as_deref().unwrap_or("no error"),
                expected.run.status.as_str()
            ),
        ));
    }
    if compare_outputs && expected.run.result != got.run.result {
        return Some((
            None,
            None,
            format!(
                "the run's result differs: {} here, {} without crashes",
                got.run.result.as_ref().map_or("none".into(), Value::to_string),
                expected.run.result.as_ref().map_or("none".into(), Value::to_string)
            ),
        ));
    }
    None
}

/// One step attempt as the kit saw it, with the effects called during it.
struct SeenAttempt<'o> {
    index: usize,
    process: u32,
    run_id: &'o str,
    step: &'o str,
    attempt: u32,
    end: StepAttemptEnd,
    /// (effect, key), in call order.
    effects: Vec<(&'o str, &'o str)>,
    /// The attempt was committed before its process crashed (always, in a process that did not).
    durable: bool,
}

/// Does `key` hold the idempotency key of a step of run `run_id` (`{run_id}:{seq}:{name}`, as
/// `ctx.step` makes it, maybe inside a longer key)? `Some(true)` when it is step `step`'s,
/// `Some(false)` when another step's, `None` when it holds none.
fn key_names_step(key: &str, run_id: &str, step: &str) -> Option<bool> {
    let prefix = format!("{run_id}:");
    let mut found = None;
    for (at, _) in key.match_indices(&prefix) {
        let rest = &key[at + prefix.len()..];
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        let Some(name) = rest[digits..].strip_prefix(':').filter(|_| digits > 0) else { continue };
        let ends = name
            .strip_prefix(step)
            .map(|after| !after.starts_with(|c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')));
        if ends == Some(true) {
            return Some(true);
        }
        found = Some(false);
    }
    found
}

/// The attempts of an execution with the effects each made, and the effects made outside any
/// attempt (in the workflow function, or in a transactional step whose commit never came). An
/// effect made in a process before the attempt told next in it belongs to that attempt when its
/// key holds that step's idempotency key; when it holds another step's, it does not; otherwise
/// when it was made after the attempt began (its end less the time it took) and after the last
/// commit before that (none of a run's commits happens while one of its external steps runs, and
/// a transactional step's body runs after the commit before it).
fn attempts_of(outcome: &Outcome) -> (Vec<SeenAttempt<'_>>, Vec<(&str, &str)>) {
    let mut attempts = Vec::new();
    let mut orphans = Vec::new();
    let mut pending: Vec<(u32, Instant, &str, &str)> = Vec::new();
    let mut commits: Vec<Instant> = Vec::new();
    for event in &outcome.events {
        match event {
            Event::Commit { at } => commits.push(*at),
            Event::Effect { process, at, effect, key } => {
                if pending.last().is_some_and(|(p, ..)| p != process) {
                    orphans.extend(pending.drain(..).map(|(_, _, e, k)| (e, k)));
                }
                pending.push((*process, *at, effect, key));
            }
            Event::Attempt { process, began, run_id, step, attempt, end } => {
                // The last commit before the attempt began (a commit after it is its own, for a
                // transactional step).
                let from = commits.iter().rev().find(|at| **at <= *began).map_or(*began, |at| (*at).max(*began));
                let (mine, older): (Vec<_>, Vec<_>) = pending.drain(..).partition(|(p, at, _, key)| {
                    p == process && key_names_step(key, run_id, step).unwrap_or(*at >= from)
                });
                orphans.extend(older.into_iter().map(|(_, _, e, k)| (e, k)));
                attempts.push(SeenAttempt {
                    index: attempts.len(),
                    process: *process,
                    run_id,
                    step,
                    attempt: *attempt,
                    end: *end,
                    effects: mine.into_iter().map(|(_, _, e, k)| (e, k)).collect(),
                    durable: true,
                });
            }
        }
    }
    orphans.extend(pending.into_iter().map(|(_, _, e, k)| (e, k)));
    // In each crashed process, the last attempts of a step beyond what its crash left durable
    // were lost (the runtime commits an attempt with the run's next write).
    for (process, snapshot) in outcome.snapshots.iter().enumerate() {
        let before = process.checked_sub(1).map(|p| &outcome.snapshots[p]);
        let keys: BTreeSet<(&str, &str)> =
            attempts.iter().filter(|a| a.process as usize == process).map(|a| (a.run_id, a.step)).collect();
        for (run_id, step) in keys {
            let durable_now = durable_attempts(snapshot, run_id, step);
            let durable_before = before.map_or(0, |s| durable_attempts(s, run_id, step));
            let mine: Vec<usize> = attempts
                .iter()
                .filter(|a| a.process as usize == process && a.run_id == run_id && a.step == step)
                .map(|a| a.index)
                .collect();
            let lost = mine.len().saturating_sub(durable_now.saturating_sub(durable_before));
            for index in mine.iter().rev().take(lost) {
                attempts[*index].durable = false;
            }
        }
    }
    (attempts, orphans)
}

/// Attempts of steps named `step` of run `run_id` that a store holds.
fn durable_attempts(runs: &BTreeMap<String, RunDetail>, run_id: &str, step: &str) -> usize {
    let Some(detail) = runs.get(run_id) else { return 0 };
    detail
        .attempts
        .iter()
        .filter(|attempt| {
            detail.journal.get(attempt.seq as usize).is_some_and(|entry| {
                entry.name == step
                    && matches!(entry.kind, StepKind::External | StepKind::Transactional | StepKind::Compensation)
            })
        })
        .count()
}

/// Retries (after a failed attempt, or after a crash that lost an attempt) that called an
/// effect with another key than the attempt before them; and, as notes, the ones after a crash
/// that kept the key.
fn key_changes(outcome: &Outcome) -> Vec<Finding> {
    let (attempts, _) = attempts_of(outcome);
    let mut findings = Vec::new();
    let mut open: BTreeMap<(&str, &str), &SeenAttempt<'_>> = BTreeMap::new();
    for attempt in &attempts {
        let key = (attempt.run_id, attempt.step);
        if let Some(previous) = open.get(&key) {
            let crash = (attempt.process > previous.process).then(|| {
                let boundary = outcome.crashes.get(previous.process as usize).copied().unwrap_or(0);
                format!("after the crash at boundary {boundary} of process {}", previous.process)
            });
            let effects: BTreeSet<&str> = attempt.effects.iter().map(|(e, _)| *e).collect();
            for effect in effects {
                let keys = |a: &SeenAttempt<'_>| -> BTreeSet<String> {
                    a.effects.iter().filter(|(e, _)| *e == effect).map(|(_, k)| k.to_string()).collect()
                };
                let (before, now) = (keys(previous), keys(attempt));
                if before.is_empty() {
                    continue;
                }
                let why = crash.clone().unwrap_or_else(|| "after a failed attempt".into());
                let base = Finding {
                    kind: FindingKind::RetriedWithSameKey,
                    run_id: attempt.run_id.to_string(),
                    step: Some(attempt.step.to_string()),
                    seq: None,
                    crashes: outcome.crashes.clone(),
                    message: String::new(),
                };
                if before != now {
                    findings.push(Finding {
                        kind: FindingKind::IdempotencyKeyChanged,
                        message: format!(
                            "attempt {} called {effect:?} with key {:?}; attempt {}, {why}, with key {:?}: the \
                             service sees two requests (pass on the key ctx.step gives the step, never a fresh one)",
                            previous.attempt,
                            before.iter().next().map(String::as_str).unwrap_or_default(),
                            attempt.attempt,
                            now.iter().next().map(String::as_str).unwrap_or_default(),
                        ),
                        ..base
                    });
                } else if crash.is_some() {
                    findings.push(Finding {
                        message: format!(
                            "the step ran again {why} (its completion had not been committed) and called \
                             {effect:?} with the same key {:?}: at least once, as promised",
                            now.iter().next().map(String::as_str).unwrap_or_default()
                        ),
                        ..base
                    });
                }
            }
        }
        let settled = attempt.durable && matches!(attempt.end, StepAttemptEnd::Completed | StepAttemptEnd::Failed);
        if settled {
            open.remove(&key);
        } else {
            open.insert(key, attempt);
        }
    }
    findings
}

/// Effects called more often than in the crash-free execution, beyond the calls of attempts
/// that crashes lost (which run again, legitimately).
fn effects_beyond_crashes(reference: &Outcome, outcome: &Outcome, run_id: &str) -> Vec<Finding> {
    fn count(events: &[Event]) -> BTreeMap<&str, usize> {
        let mut calls: BTreeMap<&str, usize> = BTreeMap::new();
        for event in events {
            if let Event::Effect { effect, .. } = event {
                *calls.entry(effect.as_str()).or_default() += 1;
            }
        }
        calls
    }
    let (expected, got) = (count(&reference.events), count(&outcome.events));
    let (attempts, orphans) = attempts_of(outcome);
    let mut findings = Vec::new();
    for (effect, calls) in got {
        let before = expected.get(effect).copied().unwrap_or(0);
        let lost: usize = attempts
            .iter()
            .filter(|a| !a.durable)
            .map(|a| a.effects.iter().filter(|(e, _)| *e == effect).count())
            .sum();
        if calls > before + lost {
            let outside = orphans.iter().filter(|(e, _)| *e == effect).count();
            let steps: BTreeSet<&str> =
                attempts.iter().filter(|a| a.effects.iter().any(|(e, _)| *e == effect)).map(|a| a.step).collect();
            findings.push(Finding {
                kind: FindingKind::StepRanTwice,
                run_id: run_id.to_string(),
                step: (steps.len() == 1).then(|| steps.iter().next().map(|s| s.to_string())).flatten(),
                seq: None,
                crashes: outcome.crashes.clone(),
                message: if outside > 0 {
                    format!(
                        "effect {effect:?} was called {calls} times, {before} without crashes, and the crashes explain \
                         {lost} more (calls of attempts lost before their commit): {outside} calls were made outside \
                         any step attempt, in the workflow function (which runs again on every replay) or in a \
                         transactional step's body (which runs again when its commit did not happen)"
                    )
                } else {
                    format!(
                        "effect {effect:?} was called {calls} times, {before} without crashes, and the crashes explain \
                         {lost} more (calls of attempts lost before their commit): a step that called it ({steps:?}) \
                         ran again although its completion was committed"
                    )
                },
            });
        }
    }
    findings
}

// ---------------------------------------------------------------------------------------------
// Replaying recorded journals.
// ---------------------------------------------------------------------------------------------

/// Parse recorded runs: the JSON of one run as `tidemark workflow show` gives it (fields
/// the run's JSON does not have, like the CLI's `outcome`, are ignored), or an array of them.
/// The pages of one run's detail as `GET /v1/runs/{id}` serves them (`next_after_seq`,
/// `next_events_after`) are joined when they follow one another in the array; a run whose last page is missing, and
/// anything else, is `invalid_recording`.
pub fn parse_recorded(json: &str) -> Result<Vec<RunDetail>> {
    let value: Value = serde_json::from_str(json)
        .map_err(|e| Error::invalid(INVALID_RECORDING, format!("a recorded run is not JSON: {e}")))?;
    let items = match value {
        Value::Array(items) => items,
        single => vec![single],
    };
    let mut runs: Vec<RunDetail> = Vec::new();
    for (index, item) in items.into_iter().enumerate() {
        let detail = serde_json::from_value::<RunDetail>(item).map_err(|e| {
            Error::invalid(
                INVALID_RECORDING,
                format!("recorded run {index} is not a run's JSON (run, journal, attempts, events): {e}"),
            )
        })?;
        // A page that follows a cut page of the same run is that run's next page.
        match runs.last_mut() {
            Some(before) if before.is_cut() && before.run.run_id == detail.run.run_id => {
                before.append_page(detail).map_err(|e| Error::invalid(INVALID_RECORDING, e.to_string()))?;
            }
            _ => runs.push(detail),
        }
    }
    for detail in &runs {
        detail.ensure_whole().map_err(|e| Error::invalid(INVALID_RECORDING, e.to_string()))?;
    }
    Ok(runs)
}

/// Runs recorded elsewhere (production), replayed against the code registered here before it
/// is deployed, without running any step: in the manner of Temporal's replayer.
///
/// Each recorded run is imported into a throwaway store (its journal, attempts and events as
/// recorded) and executed by a replay-only worker ([`Workflows::replay_only`]): journaled steps
/// return their recorded results, and the execution stops at the first position the journal
/// has not settled, running nothing. Reported, as [`FindingKind::RecordedJournalMismatch`]: a
/// position where the code calls another step (name or kind) than the journal holds, code that
/// returns before reaching journaled steps, a journaled output or an input the code can no
/// longer decode, and a finished recording whose replay ends otherwise (completed, now failed).
/// Code that only goes on after the recorded positions passes.
///
/// The recorded run's workflow and version must be registered (a new version never replays old
/// runs: tidemark pins each run to the version it started with; this checks code changed
/// under one version, e.g. behind `ctx.patched`).
///
/// ```
/// use tidemark::prelude::*;
/// use tidemark::testing::{CrashTest, ReplayCheck};
///
/// async fn v1(ctx: Context, _: serde_json::Value) -> Result<(), WorkflowError> {
///     ctx.step("reserve", None, |_| async { Ok(()) }).await?;
///     ctx.step("charge", None, |_| async { Ok(()) }).await
/// }
/// async fn v2(ctx: Context, _: serde_json::Value) -> Result<(), WorkflowError> {
///     ctx.step("charge", None, |_| async { Ok(()) }).await?; // reordered: old runs cannot replay
///     ctx.step("reserve", None, |_| async { Ok(()) }).await
/// }
/// # fn main() -> tidemark::Result<()> {
/// // A journal recorded by v1 (from production: `tidemark workflow show --server ...`).
/// let recorded = CrashTest::new(tidemark::workflow("order", 1, v1)).every_boundary(false).random_schedules(0).run()?;
/// let json = serde_json::to_string(&recorded.runs[0]).unwrap();
/// let report = ReplayCheck::new().workflow(tidemark::workflow("order", 1, v2)).recorded_json(&json).run()?;
/// assert!(!report.is_ok(), "{report}");
/// # Ok(()) }
/// ```
pub struct ReplayCheck<S: KitStore = SqliteWorkflows> {
    workflows: Vec<Result<Workflow<S>>>,
    recorded: Vec<Result<Vec<RunDetail>>>,
    /// Where the PostgreSQL kit makes its schema.
    database: Option<String>,
}

impl<S: KitStore> fmt::Debug for ReplayCheck<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReplayCheck")
            .field("workflows", &self.workflows.len())
            .field("recorded", &self.recorded.len())
            .finish()
    }
}

impl<S: KitStore> Default for ReplayCheck<S> {
    fn default() -> Self {
        ReplayCheck { workflows: Vec::new(), recorded: Vec::new(), database: None }
    }
}

impl ReplayCheck {
    /// A check with no workflow and no recorded run yet, on SQLite (`ReplayCheck::default()` or
    /// [`ReplayCheck::on_postgres`] for PostgreSQL's workflows).
    pub fn new() -> Self {
        Self::default()
    }
}

impl ReplayCheck<PgWorkflows> {
    /// A check of workflows on PostgreSQL, replaying in a throwaway schema of the database at
    /// `url` (dropped when the check ends; the login role must be allowed to create schemas).
    pub fn on_postgres(url: &str) -> Self {
        ReplayCheck { database: Some(url.to_string()), ..Self::default() }
    }
}

impl<S: KitStore> ReplayCheck<S> {
    /// Register the new code of a workflow (or a saga) the recordings ran.
    pub fn workflow(mut self, workflow: impl IntoWorkflow<S>) -> Self {
        self.workflows.push(workflow.into_workflow());
        self
    }

    /// Replay this recorded run.
    pub fn recorded(mut self, run: RunDetail) -> Self {
        self.recorded.push(Ok(vec![run]));
        self
    }

    /// Replay the runs of this JSON (see [`parse_recorded`]; bad JSON fails [`ReplayCheck::run`]
    /// with `invalid_recording`).
    pub fn recorded_json(mut self, json: &str) -> Self {
        self.recorded.push(parse_recorded(json));
        self
    }

    /// Replay every recorded run and report. Errors, nothing replayed: a recording that does not
    /// parse (`invalid_recording`), a recorded workflow or version not registered
    /// (`unknown_workflow`), two recordings of one run id (`already_exists`), no recording
    /// (`invalid_argument`), a recording the store refuses (see
    /// [`SqliteWorkflows::import_run`]).
    pub fn run(&self) -> Result<Report> {
        std::thread::scope(|scope| {
            let thread = std::thread::Builder::new()
                .name("tidemark-replay".into())
                .spawn_scoped(scope, || self.run_here())
                .map_err(|e| Error::io(format!("cannot start the test kit's thread: {e}")))?;
            thread.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }

    fn run_here(&self) -> Result<Report> {
        let mut registry = Workflows::new();
        for workflow in &self.workflows {
            registry.add(workflow.clone()?)?;
        }
        let mut recorded = Vec::new();
        for runs in &self.recorded {
            recorded.extend(runs.clone()?);
        }
        if recorded.is_empty() {
            return Err(invalid("a replay check needs at least one recorded run"));
        }
        let known = registry.versions();
        for detail in &recorded {
            let run = &detail.run;
            if !known.iter().any(|k| k.workflow == run.workflow && k.version == run.version) {
                return Err(Error::invalid(
                    workflow_codes::UNKNOWN_WORKFLOW,
                    format!(
                        "recorded run {} ran workflow {} v{}, which is not registered here (registered: {})",
                        run.run_id,
                        run.workflow,
                        run.version,
                        registry.names()
                    ),
                ));
            }
        }
        let mut sandbox = S::kit_sandbox(self.database.as_deref())?;
        // The kit's clock stands just after everything recorded, so no recorded time lies ahead.
        let now = recorded
            .iter()
            .flat_map(|d| std::iter::once(d.run.updated_at_ms).chain(d.journal.iter().map(|e| e.updated_at_ms)))
            .max()
            .unwrap_or(CLOCK_START_MS)
            .saturating_add(1);
        {
            let mut store = S::kit_init(&mut sandbox, "replay")?;
            for detail in &recorded {
                store.kit_import_run(detail, now)?;
            }
        }
        let effects = Effects::new();
        effects.begin_execution();
        let location = S::kit_location(&sandbox, "replay");
        let opens = location.clone();
        let clock: Clock = Arc::new(move || now);
        let writer = Writer::spawn_with_clock(move || S::kit_open(&opens), clock)?;
        let options = WorkerOptions { concurrency: recorded.len().clamp(1, 64), ..worker_options() };
        let worker = Worker::new(writer, registry.replay_only(), options)?
            .with_observer(Arc::new(AttemptRecorder { log: effects.log.clone() }));
        let worker_report = runtime()?.block_on(worker.run_until_idle())?;
        drop(worker);
        let events = effects.end_execution();
        if !events.is_empty() {
            return Err(Error::Invariant(format!("a replay-only worker ran {} step attempts", events.len())));
        }
        let replayed = read_runs(&S::kit_open(&location)?)?;
        let mut report =
            Report::new(format!("{} recorded runs replayed ({} executions)", recorded.len(), worker_report.claimed));
        for detail in &recorded {
            let Some(now) = replayed.get(&detail.run.run_id) else { continue };
            if let Some(finding) = replay_mismatch(detail, now) {
                report.findings.push(finding);
            }
            report.runs.push(now.clone());
        }
        Ok(report)
    }
}

/// How the replay of `recorded` (now `replayed`) went wrong, if it did.
fn replay_mismatch(recorded: &RunDetail, replayed: &RunDetail) -> Option<Finding> {
    let run = &replayed.run;
    let error = run.error.clone().unwrap_or_default();
    let finding = |seq: Option<u32>, message: String| Finding {
        kind: FindingKind::RecordedJournalMismatch,
        run_id: run.run_id.clone(),
        step: name_at(recorded, seq),
        seq,
        crashes: Vec::new(),
        message,
    };
    match run.status {
        RunStatus::Parked if error.starts_with(REPLAY_END) => None,
        RunStatus::Parked => {
            let seq = position_in(&error);
            Some(finding(seq, format!("the new code does not replay the recorded journal: {error}")))
        }
        status if !status.is_terminal() => Some(finding(
            None,
            format!("the replay did not end (it is {}): nothing in a replay should wait", status.as_str()),
        )),
        status => {
            let before = recorded.run.status;
            let comparable = before.is_terminal() && before != RunStatus::Parked;
            (comparable && before != status).then(|| {
                finding(
                    None,
                    format!(
                        "the recorded run ended {}, its replay ends {} ({}): the new code ends the same history \
                         otherwise",
                        before.as_str(),
                        status.as_str(),
                        if error.is_empty() { "no error" } else { error.as_str() }
                    ),
                )
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_are_read_from_runtime_messages() {
        assert_eq!(position_in("non-deterministic replay: position 3 is journaled as"), Some(3));
        assert_eq!(position_in("reached journaled step \"x\" at position 12"), Some(12));
        assert_eq!(position_in("no number here"), None);
    }

    #[test]
    fn keys_name_their_steps() {
        assert_eq!(key_names_step("order-1:2:charge", "order-1", "charge"), Some(true));
        assert_eq!(key_names_step("pay-order-1:2:charge-v2", "order-1", "charge"), Some(false));
        assert_eq!(key_names_step("stripe/order-1:2:charge", "order-1", "charge"), Some(true));
        assert_eq!(key_names_step("order-1:2:ship", "order-1", "charge"), Some(false));
        assert_eq!(key_names_step("order-1:x:charge", "order-1", "charge"), None);
        assert_eq!(key_names_step("6f1c-uuid", "order-1", "charge"), None);
    }

    #[test]
    fn the_same_seed_draws_the_same_schedules() {
        let draw = |seed| {
            let mut random = SplitMix64(seed);
            (0..20).map(|_| 1 + random.below(7)).collect::<Vec<u32>>()
        };
        assert_eq!(draw(42), draw(42));
        assert_ne!(draw(42), draw(43));
        assert!(draw(42).iter().all(|b| (1..=7).contains(b)));
    }

    #[test]
    fn recordings_that_are_not_runs_are_invalid_recordings() {
        assert_eq!(parse_recorded("{").unwrap_err().code(), INVALID_RECORDING);
        assert_eq!(parse_recorded(r#"{"run": 1}"#).unwrap_err().code(), INVALID_RECORDING);
        assert_eq!(parse_recorded("[]").unwrap().len(), 0);
    }
}
