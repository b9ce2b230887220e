//! `tidemark bench --workflows`: durable execution speed of the reference order saga
//! (`reserve_inventory` transactional -> `charge_payment` external -> `ship_order`
//! transactional) on a real SQLite file with the default durability (WAL, `synchronous=FULL`),
//! or, with `--store postgres://...`, on PostgreSQL schemas (`PgWorkflows`; the server's
//! durability, never weakened; see `bench/postgres.rs` for what only PostgreSQL runs).
//!
//! - **throughput**: `--sagas` runs are started first (one transaction per 10,000), then one
//!   worker runs them with `--in-flight` runs at once (group commit of every run's journal
//!   writes). The external step is the fake payment service with its call log in memory: zero
//!   latency. A second run gives the charge `--external-latency-ms` of simulated latency.
//! - **latency**: `--latency-sagas` sagas one at a time at idle, each from `Worker::start` to the
//!   worker's report that it finished (its final commit), after a few uncounted warm-up sagas.
//! - **resumption**: a worker (its own connection and async runtime) is dropped abruptly while
//!   `--resume-sagas` runs are inside their external step (as a killed process would leave them:
//!   leases held, nothing released); a second worker takes them over once the leases expire.
//!
//! Every run is checked: every saga `completed`, exactly one `reserve` and one `ship` effect per
//! order, one successful charge per idempotency key, stock consistent. Numbers are printed, never
//! asserted. The workflow bench always runs on the system clock (leases need real time).
//!
//! The runs are written once, generic over the store ([`BenchStore`]): a SQLite file per run in
//! the bench's folder, or a fresh PostgreSQL schema per run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tidemark_builtins::order::postgres as order_pg;
use tidemark_builtins::order::tables as order_sql;
use tidemark_builtins::order::{
    order_saga, FakePayments, OrderInput, OrderTx, Payments, ORDER_SAGA, ORDER_SAGA_VERSION,
};
use tidemark_core::queue::QueueStore;
use tidemark_core::workflow::{StartOutcome, StartRequest, WorkflowStore, START_BATCH_MAX};
use tidemark_core::{Error, Result};
use tidemark_engine::workflow::{
    FinishedRun, Saga, SagaAction, SagaData, Worker, WorkerOptions, WorkerReport, WorkflowContext, WorkflowError,
    WorkflowOptions, Workflows, Writer,
};
use tidemark_store_postgres::PgWorkflows;
use tidemark_store_sqlite::{probe, stats, Durability, SqliteWorkflows};
use tokio::runtime::Runtime;
use tokio::sync::mpsc;

use super::postgres::PgPlace;
use super::{durability_word, failed, median, round1, round3, PROBE_TIME_MAX};

pub(super) const SKU: &str = "widget";

/// The SKU order `i` of a run reserves when the orders are spread over `skus` SKUs: [`SKU`]
/// when there is one, else `widget-<i mod skus>`.
fn sku_of(i: u64, skus: u64) -> String {
    if skus <= 1 {
        SKU.to_string()
    } else {
        format!("{SKU}-{}", i % skus)
    }
}
/// Uncounted sagas before the latency samples (page cache, statement cache, WAL).
const LATENCY_WARMUP: u64 = 10;
/// Bound of every wait of the bench.
pub(super) const WAIT_MAX: Duration = Duration::from_secs(600);

/// What `--workflows` measures.
#[derive(Debug, Clone)]
pub struct Params {
    pub sagas: u64,
    pub in_flight: usize,
    pub latency_sagas: u64,
    pub external_latency_ms: u64,
    pub resume_sagas: u64,
    pub lease_ms: i64,
    pub repeat: u64,
    pub probe_commits: u64,
    /// PostgreSQL only: sagas of the one- and two-`tidemark worker`-process runs (0 skips them).
    pub process_sagas: u64,
    /// PostgreSQL only: seconds of each pgbench ceiling run (0 skips them).
    pub pgbench_seconds: u64,
    /// SKUs the orders are spread over (1: every order reserves [`SKU`], one row every
    /// reservation locks until its commit).
    pub skus: u64,
}

/// A workflow store the bench measures: how a fresh one is made at a place, the order tables
/// on it, and the reads of the exactly-once check. Every SQL statement is the store crate's
/// (tidemark's tables) or the built-ins' (the order tables).
pub(super) trait BenchStore: WorkflowStore<Target = Self::Tx> + QueueStore + Send + Sized + 'static {
    /// The transactional steps' handle.
    type Tx: OrderTx + 'static;
    /// Where stores are made: a folder (SQLite), a server and a schema prefix (PostgreSQL).
    type Place: Clone + Send + Sync + 'static;

    /// A new, empty store named `name` at `place` (refused if it exists).
    fn create(place: &Self::Place, name: &str) -> Result<Self>;
    /// Another connection to the store `name` at `place`.
    fn reopen(place: &Self::Place, name: &str) -> Result<Self>;
    /// Install the order tables with `stock` units of each of `skus`.
    fn install_orders(&mut self, skus: &[String], stock: i64) -> Result<()>;
    fn run_counts(&mut self) -> Result<BTreeMap<String, u64>>;
    fn order_effect_counts(&mut self) -> Result<BTreeMap<String, u64>>;
    fn orders_with_duplicate_effects(&mut self) -> Result<u64>;
    fn stock(&mut self, sku: &str) -> Result<Option<i64>>;
    fn leases_held_by(&mut self, owner: &str) -> Result<(u64, Option<i64>, Option<i64>)>;
    fn recovered_and_completed_runs(&mut self) -> Result<(u64, u64)>;
    /// CPU seconds of the database server's processes so far, when they can be read (`None`
    /// for SQLite, which runs inside this process).
    fn server_cpu_seconds(place: &Self::Place) -> Option<f64>;
}

/// Where the SQLite bench makes its files: a folder per store, `wf.db` in it.
#[derive(Debug, Clone)]
pub(super) struct SqlitePlace {
    pub dir: PathBuf,
    pub durability: Durability,
}

impl BenchStore for SqliteWorkflows {
    type Tx = rusqlite::Connection;
    type Place = SqlitePlace;

    fn create(place: &SqlitePlace, name: &str) -> Result<Self> {
        let dir = place.dir.join(name);
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(format!("{}: {e}", dir.display())))?;
        SqliteWorkflows::init_with(&dir.join("wf.db"), place.durability)
    }

    fn reopen(place: &SqlitePlace, name: &str) -> Result<Self> {
        SqliteWorkflows::init_with(&place.dir.join(name).join("wf.db"), place.durability)
    }

    fn install_orders(&mut self, skus: &[String], stock: i64) -> Result<()> {
        let conn = self.connection();
        order_sql::install(conn)?;
        // One transaction for every SKU's stock (one commit, not one per SKU).
        let tx = conn.unchecked_transaction()?;
        skus.iter().try_for_each(|sku| order_sql::set_stock(&tx, sku, stock))?;
        Ok(tx.commit()?)
    }

    fn run_counts(&mut self) -> Result<BTreeMap<String, u64>> {
        stats::run_counts(self.connection())
    }

    fn order_effect_counts(&mut self) -> Result<BTreeMap<String, u64>> {
        order_sql::order_effect_counts(self.connection())
    }

    fn orders_with_duplicate_effects(&mut self) -> Result<u64> {
        order_sql::orders_with_duplicate_effects(self.connection())
    }

    fn stock(&mut self, sku: &str) -> Result<Option<i64>> {
        order_sql::stock(self.connection(), sku)
    }

    fn leases_held_by(&mut self, owner: &str) -> Result<(u64, Option<i64>, Option<i64>)> {
        SqliteWorkflows::leases_held_by(self.connection(), owner)
    }

    fn recovered_and_completed_runs(&mut self) -> Result<(u64, u64)> {
        SqliteWorkflows::recovered_and_completed_runs(self.connection())
    }

    fn server_cpu_seconds(_: &SqlitePlace) -> Option<f64> {
        None
    }
}

impl BenchStore for PgWorkflows {
    type Tx = tidemark_store_postgres::ApplyTransaction;
    type Place = PgPlace;

    fn create(place: &PgPlace, name: &str) -> Result<Self> {
        let schema = place.fresh_schema(name)?;
        PgWorkflows::init(&place.conn, &schema)
    }

    fn reopen(place: &PgPlace, name: &str) -> Result<Self> {
        PgWorkflows::open(&place.conn, &place.schema_of(name))
    }

    fn install_orders(&mut self, skus: &[String], stock: i64) -> Result<()> {
        let schema = self.schema().to_string();
        order_pg::install(self.client(), &schema)?;
        // One transaction for every SKU's stock (one commit, not one per SKU).
        let mut tx = self.client().transaction().map_err(Error::from)?;
        skus.iter().try_for_each(|sku| order_pg::set_stock(&mut tx, &schema, sku, stock))?;
        tx.commit().map_err(Error::from)
    }

    fn run_counts(&mut self) -> Result<BTreeMap<String, u64>> {
        PgWorkflows::run_counts(self)
    }

    fn order_effect_counts(&mut self) -> Result<BTreeMap<String, u64>> {
        let schema = self.schema().to_string();
        order_pg::order_effect_counts(self.client(), &schema)
    }

    fn orders_with_duplicate_effects(&mut self) -> Result<u64> {
        let schema = self.schema().to_string();
        order_pg::orders_with_duplicate_effects(self.client(), &schema)
    }

    fn stock(&mut self, sku: &str) -> Result<Option<i64>> {
        let schema = self.schema().to_string();
        order_pg::stock(self.client(), &schema, sku)
    }

    fn leases_held_by(&mut self, owner: &str) -> Result<(u64, Option<i64>, Option<i64>)> {
        PgWorkflows::leases_held_by(self, owner)
    }

    fn recovered_and_completed_runs(&mut self) -> Result<(u64, u64)> {
        PgWorkflows::recovered_and_completed_runs(self)
    }

    fn server_cpu_seconds(_: &PgPlace) -> Option<f64> {
        super::postgres::server_cpu_seconds()
    }
}

fn runtime() -> Result<Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::io(format!("cannot start the async runtime: {e}")))
}

fn input(order_id: &str, sku: &str) -> Value {
    json!({"order_id": order_id, "sku": sku, "quantity": 1, "amount": 100})
}

/// A fresh workflow store with the order tables and `stock` units of the SKU, behind a writer,
/// and a fake payment service (by default with its call log in memory: a zero-latency external
/// service).
pub(super) struct World<S: BenchStore> {
    place: S::Place,
    name: String,
    pub(super) writer: Writer<S>,
    payments: Arc<FakePayments>,
    stock: i64,
    /// How many SKUs the orders are spread over ([`sku_of`]).
    skus: u64,
}

impl<S: BenchStore> World<S> {
    pub(super) fn new(place: &S::Place, name: &str, stock: i64, skus: u64) -> Result<World<S>> {
        Self::with_payments(place, name, stock, skus, Arc::new(FakePayments::in_memory()?))
    }

    /// A world whose payment service is `payments` (a call log in a file that worker processes
    /// share, for example).
    pub(super) fn with_payments(
        place: &S::Place,
        name: &str,
        stock: i64,
        skus: u64,
        payments: Arc<FakePayments>,
    ) -> Result<World<S>> {
        let (at, named) = (place.clone(), name.to_string());
        let writer = Writer::spawn(move || S::create(&at, &named))?;
        let all: Vec<String> = (0..skus.max(1)).map(|i| sku_of(i, skus)).collect();
        writer.call_blocking(move |store, _| store.install_orders(&all, stock))?;
        Ok(World { place: place.clone(), name: name.to_string(), writer, payments, stock, skus })
    }

    /// The input of the `i`-th order of a run, `order_id`.
    fn input(&self, i: u64, order_id: &str) -> Value {
        input(order_id, &sku_of(i, self.skus))
    }

    /// The start of the `i`-th order saga of a run, `run_id` (its order id too).
    fn request(&self, i: u64, run_id: &str) -> StartRequest {
        StartRequest::new(run_id, ORDER_SAGA, ORDER_SAGA_VERSION, self.input(i, run_id))
    }

    /// Another writer (its own connection) on the same store.
    fn open_writer(&self) -> Result<Writer<S>> {
        let (at, named) = (self.place.clone(), self.name.clone());
        Writer::spawn(move || S::reopen(&at, &named))
    }

    /// Start `ids` (one transaction per `START_BATCH_MAX`); every one must be new.
    pub(super) fn start_all(&self, ids: &[String]) -> Result<u64> {
        let mut transactions = 0;
        for (c, chunk) in ids.chunks(START_BATCH_MAX).enumerate() {
            let first = (c * START_BATCH_MAX) as u64;
            let requests: Vec<StartRequest> =
                chunk.iter().enumerate().map(|(k, id)| self.request(first + k as u64, id)).collect();
            let outcomes = self.writer.call_blocking(move |store, now| store.start_runs(&requests, now))?;
            transactions += 1;
            if let Some(other) = outcomes.iter().find(|o| !matches!(o, StartOutcome::Started { .. })) {
                return Err(failed(format!("a start was not new: {other:?}")));
            }
        }
        Ok(transactions)
    }

    /// The end state of `sagas` order sagas that should all have completed.
    pub(super) fn check(&self, sagas: u64) -> Result<Value> {
        self.check_with_parents(sagas, 0)
    }

    /// [`World::check`] when `parents` more runs (each the parent of some of the sagas, as
    /// children) should have completed too.
    fn check_with_parents(&self, sagas: u64, parents: u64) -> Result<Value> {
        let stock = self.stock;
        let skus: Vec<String> = (0..self.skus.max(1)).map(|i| sku_of(i, self.skus)).collect();
        let db = self.writer.call_blocking(move |store, _| {
            let mut left = 0;
            for sku in &skus {
                left += store.stock(sku)?.unwrap_or(0);
            }
            let runs = store.run_counts()?;
            let effects = store.order_effect_counts()?;
            let effects_of = |kind: &str| effects.get(kind).copied().unwrap_or(0);
            let other_effects: u64 =
                effects.iter().filter(|(kind, _)| !matches!(kind.as_str(), "reserve" | "ship")).map(|(_, n)| n).sum();
            Ok(json!({
                "runs": runs.values().sum::<u64>(),
                "completed": runs.get("completed").copied().unwrap_or(0),
                "reserve_effects": effects_of("reserve"),
                "ship_effects": effects_of("ship"),
                "other_effects": other_effects,
                "orders_with_duplicate_effects": store.orders_with_duplicate_effects()?,
                "stock_taken": stock * skus.len() as i64 - left,
            }))
        })?;
        let calls = self.payments.calls()?;
        let charged = calls.iter().filter(|c| c.outcome == "charged").count() as u64;
        let mut keys: Vec<&str> =
            calls.iter().filter(|c| c.outcome == "charged").map(|c| c.idempotency_key.as_str()).collect();
        keys.sort_unstable();
        keys.dedup();
        let repeated = calls.iter().filter(|c| c.outcome == "duplicate").count() as u64;
        let other = calls.iter().filter(|c| !matches!(c.outcome.as_str(), "charged" | "duplicate")).count() as u64;
        let n = json!(sagas);
        let all = json!(sagas + parents);
        let passed = db["runs"] == all
            && db["completed"] == all
            && db["reserve_effects"] == n
            && db["ship_effects"] == n
            && db["other_effects"] == json!(0)
            && db["orders_with_duplicate_effects"] == json!(0)
            && db["stock_taken"] == n
            && charged == sagas
            && keys.len() as u64 == sagas
            && other == 0;
        let mut out = db;
        out["passed"] = json!(passed);
        out["charges"] = json!(charged);
        out["charged_keys"] = json!(keys.len());
        out["repeated_charge_calls_answered_duplicate"] = json!(repeated);
        out["what"] = json!(
            "every saga completed; one reserve and one ship effect per order, none twice; one successful \
             charge per idempotency key; stock taken == sagas"
        );
        Ok(out)
    }
}

/// The order saga with a simulated latency in the charge (a tokio sleep before the payment
/// call) and, for the worker that is killed, a charge that never returns after the payment call.
/// Same steps, names and version as [`order_saga`].
fn order_saga_variant<S: BenchStore>(payments: Arc<FakePayments>, charge_latency: Duration, hang: bool) -> Saga<S> {
    let refund = payments.clone();
    Saga::new(ORDER_SAGA, ORDER_SAGA_VERSION)
        .step(
            "reserve_inventory",
            SagaAction::tx(|tx: &S::Tx, data: &SagaData| tx.reserve_inventory(&OrderInput::from_data(data)?)),
            Some(SagaAction::tx(|tx: &S::Tx, data: &SagaData| tx.release_inventory(&OrderInput::from_data(data)?))),
        )
        .step(
            "charge_payment",
            SagaAction::external(move |key, data| {
                let payments = payments.clone();
                async move {
                    if !charge_latency.is_zero() {
                        tokio::time::sleep(charge_latency).await;
                    }
                    let charged = payments.charge(&key, &OrderInput::from_data(&data)?);
                    if hang {
                        std::future::pending::<()>().await;
                    }
                    charged
                }
            }),
            Some(SagaAction::external(move |key, data| {
                let payments = refund.clone();
                async move {
                    let charge = data.outputs.get("charge_payment").cloned().unwrap_or(Value::Null);
                    payments.refund(&key, &OrderInput::from_data(&data)?, &charge)
                }
            })),
        )
        .step(
            "ship_order",
            SagaAction::tx(|tx: &S::Tx, data: &SagaData| tx.ship_order(&OrderInput::from_data(data)?)),
            None,
        )
}

fn workflows<S: BenchStore>(saga: Saga<S>) -> Result<Workflows<S>> {
    let mut workflows = Workflows::new();
    saga.register(&mut workflows, WorkflowOptions::default())?;
    Ok(workflows)
}

fn real_saga<S: BenchStore>(payments: &Arc<FakePayments>) -> Saga<S> {
    order_saga::<S>(payments.clone() as Arc<dyn Payments>)
}

/// Counters of the writer thread at one moment.
#[derive(Debug, Clone, Copy, Default)]
struct WriterCounts {
    commits: u64,
    writes: u64,
    calls: u64,
}

impl WriterCounts {
    fn of<S: BenchStore>(writer: &Writer<S>) -> WriterCounts {
        use std::sync::atomic::Ordering::Relaxed;
        let stats = writer.stats();
        WriterCounts {
            commits: stats.commits.load(Relaxed),
            writes: stats.writes.load(Relaxed),
            calls: stats.calls.load(Relaxed),
        }
    }

    fn json_since<S: BenchStore>(self, start: WriterCounts, writer: &Writer<S>, sagas: u64) -> Value {
        use std::sync::atomic::Ordering::Relaxed;
        let (commits, writes, calls) =
            (self.commits - start.commits, self.writes - start.writes, self.calls - start.calls);
        let per = |n: u64| round3(n as f64 / sagas.max(1) as f64);
        json!({
            "commits": commits,
            "journal_writes": writes,
            "calls": calls,
            "largest_batch": writer.stats().largest_batch.load(Relaxed),
            "writes_per_commit": round1(writes as f64 / commits.max(1) as f64),
            "per_saga": {"commits": per(commits), "journal_writes": per(writes), "calls": per(calls)},
            "what": "commits: journal group commits (transactions); journal_writes: journal writes in them; \
                     calls: other writer calls (claims, starts, heartbeats, reads), one transaction each",
        })
    }
}

/// The fields of `/proc/<pid>/stat` after the command name (which may hold spaces), from the
/// state on, as numbers (the state itself reads as 0): ppid is `[1]`, utime `[11]`, stime
/// `[12]`, cutime `[13]`, cstime `[14]`. `pid` may be `self`.
pub(super) fn stat_fields(pid: &str) -> Option<Vec<u64>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = text.get(text.rfind(')')? + 2..)?;
    Some(rest.split_whitespace().map(|f| f.parse::<i64>().unwrap_or(0).max(0) as u64).collect())
}

/// CPU time of process `pid` (user + system, all threads), in seconds; `self` for this one.
pub(super) fn pid_cpu_seconds(pid: &str) -> Option<f64> {
    let fields = stat_fields(pid)?;
    Some((fields.get(11)? + fields.get(12)?) as f64 / 100.0)
}

/// CPU time of this process (user + system, all threads, from `/proc/self/stat`), in seconds.
pub(super) fn process_cpu_seconds() -> Option<f64> {
    pid_cpu_seconds("self")
}

/// CPU time of every running process whose command is `comm` (a broker: `nats-server`,
/// `beam.smp`), summed, in seconds; `None` when none runs.
pub(super) fn named_cpu_seconds(comm: &str) -> Option<f64> {
    let mut total = None;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().filter(|n| n.bytes().all(|b| b.is_ascii_digit())) else { continue };
        let this = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if this.trim_end() == comm {
            if let Some(seconds) = pid_cpu_seconds(pid) {
                total = Some(total.unwrap_or(0.0) + seconds);
            }
        }
    }
    total
}

/// On-CPU nanoseconds of each of this process's threads named `name`, by thread id (Linux
/// `/proc/self/task`).
fn threads_on_cpu_ns(name: &str) -> Option<std::collections::HashMap<String, u64>> {
    let mut by_thread = std::collections::HashMap::new();
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let path = task.ok()?.path();
        let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        if comm.trim_end() == name {
            let Ok(stat) = std::fs::read_to_string(path.join("schedstat")) else { continue };
            let Some(ns) = stat.split_whitespace().next().and_then(|n| n.parse().ok()) else { continue };
            by_thread.insert(path.file_name()?.to_string_lossy().into_owned(), ns);
        }
    }
    Some(by_thread)
}

/// On-CPU nanoseconds spent since `start` by the threads named `name` that are still alive: a
/// thread that ended in between (another world's writer, in a test run in parallel) is left
/// out, a thread started in between counts whole. `None` when nothing was found.
fn threads_on_cpu_ns_since(name: &str, start: &Option<std::collections::HashMap<String, u64>>) -> Option<u64> {
    let end = threads_on_cpu_ns(name)?;
    let start = start.as_ref()?;
    if end.is_empty() {
        return None;
    }
    Some(end.iter().map(|(tid, ns)| ns.saturating_sub(start.get(tid).copied().unwrap_or(0))).sum())
}

pub(super) fn load_average() -> Option<String> {
    std::fs::read_to_string("/proc/loadavg").ok().map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

fn report_json(report: &WorkerReport) -> Value {
    json!({
        "claimed": report.claimed,
        "recovered": report.recovered,
        "completed": report.completed,
        "suspended": report.suspended,
        "errors": report.errors,
        "last_error": report.last_error,
        "max_in_flight": report.max_in_flight,
    })
}

/// Start `sagas` runs, then run them with one worker, `in_flight` at once, until none is due.
pub(super) fn throughput<S: BenchStore>(
    place: &S::Place,
    name: &str,
    p: &Params,
    charge_latency: Duration,
) -> Result<Value> {
    let world = World::<S>::new(place, name, p.sagas as i64, p.skus)?;
    let ids: Vec<String> = (0..p.sagas).map(|i| format!("order-{i:08}")).collect();
    let t = Instant::now();
    let start_transactions = world.start_all(&ids)?;
    let start_seconds = t.elapsed().as_secs_f64();
    let saga = if charge_latency.is_zero() {
        real_saga(&world.payments)
    } else {
        order_saga_variant(world.payments.clone(), charge_latency, false)
    };
    let options = WorkerOptions { concurrency: p.in_flight, poll_interval_ms: 10, ..WorkerOptions::new("bench") };
    let worker = Worker::new(world.writer.clone(), workflows(saga)?, options)?;
    let rt = runtime()?;
    let counts = WriterCounts::of(&world.writer);
    let cpu = process_cpu_seconds();
    let server_cpu = S::server_cpu_seconds(place);
    let writer_cpu = threads_on_cpu_ns("tidemark-writer");
    let t = Instant::now();
    let report = rt.block_on(worker.run_until_idle())?;
    let elapsed = t.elapsed();
    let cpu = process_cpu_seconds().zip(cpu).map(|(end, start)| end - start);
    let server_cpu = S::server_cpu_seconds(place).zip(server_cpu).map(|(end, start)| end - start);
    let writer_cpu = threads_on_cpu_ns_since("tidemark-writer", &writer_cpu);
    let writer = WriterCounts::of(&world.writer).json_since(counts, &world.writer, p.sagas);
    drop(worker);
    drop(rt);
    let check = world.check(p.sagas)?;
    let seconds = elapsed.as_secs_f64();
    Ok(json!({
        "sagas": p.sagas,
        "in_flight": p.in_flight,
        "external_step": if charge_latency.is_zero() {
            "the fake payment service (order::FakePayments) with its call log in memory: zero latency".to_string()
        } else {
            format!("the fake payment service behind a simulated latency of {} ms per charge", charge_latency.as_millis())
        },
        "start": {
            "transactions": start_transactions,
            "seconds": round3(start_seconds),
            "starts_per_s": round1(p.sagas as f64 / start_seconds.max(1e-9)),
        },
        "seconds": round3(seconds),
        "sagas_per_s": round1(p.sagas as f64 / seconds.max(1e-9)),
        "sagas_per_s_including_start": round1(p.sagas as f64 / (seconds + start_seconds).max(1e-9)),
        "cpu_seconds": cpu.map(round3),
        "sagas_per_cpu_s": cpu.map(|c| round1(p.sagas as f64 / c.max(1e-9))),
        "server_cpu_seconds": server_cpu.map(round3),
        "server_cpu_share_of_wall": server_cpu.map(|c| round3(c / seconds.max(1e-9))),
        "writer_thread": writer_cpu.map(|ns| json!({
            "on_cpu_seconds": round3(ns as f64 / 1e9),
            "busy_share": round3(ns as f64 / 1e9 / seconds.max(1e-9)),
            "us_per_saga": round1(ns as f64 / 1e3 / p.sagas.max(1) as f64),
            "what": "on-CPU time of the writer thread (it owns the connection; every SQLite statement runs on it)",
        })),
        "writer": writer,
        "worker": report_json(&report),
        "check": check,
    }))
}

/// Children per parent of the child-workflow run.
pub const CHILDREN_PER_PARENT: u64 = 10;

/// The parent of the child-workflow run: its orders, each run as a child order saga, one after
/// the other.
async fn fan_out<S: BenchStore>(
    ctx: WorkflowContext<S>,
    orders: Vec<Value>,
) -> std::result::Result<Value, WorkflowError> {
    let mut done = 0;
    for order in &orders {
        let _: Value = ctx.child(ORDER_SAGA, order).await?;
        done += 1;
    }
    Ok(json!({"children": done}))
}

/// The same order sagas as [`throughput`], but each run as one of the `CHILDREN_PER_PARENT`
/// children of a parent (`sagas / 10` parents started, the children started by them).
pub(super) fn children<S: BenchStore>(place: &S::Place, p: &Params) -> Result<Value> {
    let parents = (p.sagas / CHILDREN_PER_PARENT).max(1);
    let sagas = parents * CHILDREN_PER_PARENT;
    let world = World::<S>::new(place, "children", sagas as i64, p.skus)?;
    let requests: Vec<StartRequest> = (0..parents)
        .map(|i| {
            let orders: Vec<Value> = (0..CHILDREN_PER_PARENT)
                .map(|j| world.input(i * CHILDREN_PER_PARENT + j, &format!("order-{i:06}-{j:02}")))
                .collect();
            StartRequest::new(&format!("parent-{i:06}"), "fan_out", 1, json!(orders))
        })
        .collect();
    for chunk in requests.chunks(START_BATCH_MAX) {
        let chunk = chunk.to_vec();
        world.writer.call_blocking(move |store, now| store.start_runs(&chunk, now))?;
    }
    let mut registry = workflows(real_saga(&world.payments))?;
    registry.add(tidemark_engine::workflow::Workflow::new("fan_out", 1, fan_out::<S>))?;
    let options = WorkerOptions { concurrency: p.in_flight, poll_interval_ms: 10, ..WorkerOptions::new("bench") };
    let worker = Worker::new(world.writer.clone(), registry, options)?;
    let rt = runtime()?;
    let counts = WriterCounts::of(&world.writer);
    let cpu = process_cpu_seconds();
    let writer_cpu = threads_on_cpu_ns("tidemark-writer");
    let t = Instant::now();
    let report = rt.block_on(worker.run_until_idle())?;
    let seconds = t.elapsed().as_secs_f64();
    let cpu = process_cpu_seconds().zip(cpu).map(|(end, start)| end - start);
    let writer_cpu = threads_on_cpu_ns_since("tidemark-writer", &writer_cpu);
    let writer = WriterCounts::of(&world.writer).json_since(counts, &world.writer, sagas);
    drop(worker);
    drop(rt);
    let check = world.check_with_parents(sagas, parents)?;
    Ok(json!({
        "parents": parents,
        "children_per_parent": CHILDREN_PER_PARENT,
        "sagas": sagas,
        "in_flight": p.in_flight,
        "seconds": round3(seconds),
        "sagas_per_s": round1(sagas as f64 / seconds.max(1e-9)),
        "cpu_seconds": cpu.map(round3),
        "sagas_per_cpu_s": cpu.map(|c| round1(sagas as f64 / c.max(1e-9))),
        "writer_thread": writer_cpu.map(|ns| json!({
            "on_cpu_seconds": round3(ns as f64 / 1e9),
            "busy_share": round3(ns as f64 / 1e9 / seconds.max(1e-9)),
            "us_per_saga": round1(ns as f64 / 1e3 / sagas.max(1) as f64),
        })),
        "writer": writer,
        "worker": report_json(&report),
        "check": check,
        "what": "each order saga a child (ctx.child) of a parent that runs its 10 children one after the other; \
                 sagas_per_s counts the children",
    }))
}

/// The same order sagas as [`throughput`], each started through a queue whose concurrency limit
/// is the worker's (so the limit never binds): what admission costs.
pub(super) fn queued<S: BenchStore>(place: &S::Place, p: &Params) -> Result<Value> {
    let world = World::<S>::new(place, "queued", p.sagas as i64, p.skus)?;
    let limit = u32::try_from(p.in_flight).unwrap_or(u32::MAX);
    let spec = tidemark_core::queue::QueueSpec::new("bench").concurrency(limit);
    world.writer.call_blocking(move |store, now| store.put_queue(&spec, now))?;
    let ids: Vec<String> = (0..p.sagas).map(|i| format!("order-{i:08}")).collect();
    for (c, chunk) in ids.chunks(START_BATCH_MAX).enumerate() {
        let first = (c * START_BATCH_MAX) as u64;
        let requests: Vec<StartRequest> = chunk
            .iter()
            .enumerate()
            .map(|(k, id)| world.request(first + k as u64, id).in_queue("bench", 0, None))
            .collect();
        world.writer.call_blocking(move |store, now| store.start_runs(&requests, now))?;
    }
    let options = WorkerOptions { concurrency: p.in_flight, poll_interval_ms: 10, ..WorkerOptions::new("bench") };
    let worker = Worker::new(world.writer.clone(), workflows(real_saga(&world.payments))?, options)?;
    let rt = runtime()?;
    let counts = WriterCounts::of(&world.writer);
    let t = Instant::now();
    let report = rt.block_on(worker.run_until_idle())?;
    let seconds = t.elapsed().as_secs_f64();
    let writer = WriterCounts::of(&world.writer).json_since(counts, &world.writer, p.sagas);
    drop(worker);
    drop(rt);
    let check = world.check(p.sagas)?;
    Ok(json!({
        "sagas": p.sagas,
        "queue_concurrency_max": limit,
        "seconds": round3(seconds),
        "sagas_per_s": round1(p.sagas as f64 / seconds.max(1e-9)),
        "writer": writer,
        "worker": report_json(&report),
        "check": check,
        "what": "every saga through one queue whose limit is the worker's in-flight count",
    }))
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Wait for the worker to report `run_id` finished.
async fn finished_run(finished: &mut mpsc::UnboundedReceiver<FinishedRun>, run_id: &str) -> Result<FinishedRun> {
    let deadline = tokio::time::Instant::now() + WAIT_MAX;
    loop {
        match tokio::time::timeout_at(deadline, finished.recv()).await {
            Ok(Some(run)) if run.run_id == run_id => return Ok(run),
            Ok(Some(_)) => {}
            Ok(None) => return Err(failed("the worker stopped reporting finished runs".into())),
            Err(_) => return Err(failed(format!("run {run_id} did not finish within {WAIT_MAX:?}"))),
        }
    }
}

/// One saga at a time: `Worker::start` to the worker's report that the run finished.
fn latency<S: BenchStore>(place: &S::Place, p: &Params) -> Result<Value> {
    let total = LATENCY_WARMUP + p.latency_sagas;
    let world = World::<S>::new(place, "latency", total as i64, p.skus)?;
    // A long poll interval: the saga must not depend on polling to start.
    let options = WorkerOptions { poll_interval_ms: 1_000, ..WorkerOptions::new("bench-latency") };
    let worker = Arc::new(Worker::new(world.writer.clone(), workflows(real_saga(&world.payments))?, options)?);
    let rt = runtime()?;
    let mut finished = worker.subscribe_finished();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let looping = worker.clone();
    let handle = rt.spawn(async move {
        looping
            .run_until(async move {
                let _ = stopped.await;
            })
            .await
    });
    let mut counts = WriterCounts::default();
    let mut samples_ms = Vec::with_capacity(p.latency_sagas as usize);
    let sampled = rt.block_on(async {
        for i in 0..total {
            if i == LATENCY_WARMUP {
                counts = WriterCounts::of(&world.writer);
            }
            let run_id = format!("order-{i:08}");
            let t = Instant::now();
            let outcome = worker.start(vec![world.request(i, &run_id)]).await?;
            if outcome != [StartOutcome::Started { run_id: run_id.clone() }] {
                return Err(failed(format!("start of {run_id}: {outcome:?}")));
            }
            let run = finished_run(&mut finished, &run_id).await?;
            let elapsed = t.elapsed();
            if run.status != tidemark_core::workflow::FinishStatus::Completed {
                return Err(failed(format!("run {run_id} ended {:?}", run.status)));
            }
            if i >= LATENCY_WARMUP {
                samples_ms.push(elapsed.as_secs_f64() * 1_000.0);
            }
        }
        Ok(())
    });
    let _ = stop.send(());
    let report = rt.block_on(handle).map_err(|e| failed(format!("the worker task failed: {e}")))?;
    sampled?;
    let report = report?;
    let writer = WriterCounts::of(&world.writer).json_since(counts, &world.writer, p.latency_sagas);
    drop(rt);
    let check = world.check(total)?;
    let mean = samples_ms.iter().sum::<f64>() / samples_ms.len().max(1) as f64;
    let mut sorted = samples_ms.clone();
    sorted.sort_by(f64::total_cmp);
    Ok(json!({
        "sagas": p.latency_sagas,
        "warmup_sagas": LATENCY_WARMUP,
        "what": "one saga at a time on an otherwise idle worker: from Worker::start (the start's commit) to \
                 the worker's report that the run finished (its final commit); the external step has zero latency",
        "ms": {
            "p50": round3(percentile(&sorted, 0.5)),
            "p90": round3(percentile(&sorted, 0.9)),
            "p99": round3(percentile(&sorted, 0.99)),
            "min": round3(sorted.first().copied().unwrap_or(0.0)),
            "max": round3(sorted.last().copied().unwrap_or(0.0)),
            "mean": round3(mean),
        },
        "writer": writer,
        "worker": report_json(&report),
        "check": check,
    }))
}

/// A worker dropped abruptly while its runs are inside their external step; a second worker
/// takes them over once the leases expire.
fn resumption<S: BenchStore>(place: &S::Place, p: &Params) -> Result<Value> {
    let n = p.resume_sagas;
    let world = World::<S>::new(place, "resumption", n as i64, p.skus)?;
    let ids: Vec<String> = (0..n).map(|i| format!("order-{i:08}")).collect();
    world.start_all(&ids)?;
    let poll_ms = 10;
    let options = |id: &str| WorkerOptions {
        concurrency: (n as usize).max(1),
        lease_ms: p.lease_ms,
        poll_interval_ms: poll_ms,
        ..WorkerOptions::new(id)
    };

    // The doomed worker: its own connection and runtime; its charge calls the payment service
    // and then never returns.
    let doomed_rt = runtime()?;
    let doomed_writer = world.open_writer()?;
    let doomed = Worker::new(
        doomed_writer,
        workflows(order_saga_variant::<S>(world.payments.clone(), Duration::ZERO, true))?,
        options("bench-doomed"),
    )?;
    doomed_rt.spawn(async move { doomed.run_until(std::future::pending()).await });
    let t = Instant::now();
    while (world.payments.calls()?.len() as u64) < n {
        if t.elapsed() > WAIT_MAX {
            return Err(failed("the doomed worker did not reach the charge of every run".into()));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    // Kill: the runtime stops at once; nothing is released, the leases stay until they expire.
    let killed_at = Instant::now();
    let killed_at_ms = tidemark_engine::now_ms();
    doomed_rt.shutdown_background();
    let leases = world.writer.call_blocking(move |store, _| store.leases_held_by("bench-doomed"))?;
    let (held, min_expiry, max_expiry) = leases;

    // The rescuer: the bench's own connection, the real order saga.
    let rescuer_rt = runtime()?;
    let rescuer =
        Arc::new(Worker::new(world.writer.clone(), workflows(real_saga(&world.payments))?, options("bench-rescuer"))?);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let looping = rescuer.clone();
    let handle = rescuer_rt.spawn(async move {
        looping
            .run_until(async move {
                let _ = stopped.await;
            })
            .await
    });
    // A connection of its own, read only (a WAL reader never waits for the writer; a
    // PostgreSQL read never waits for a row lock).
    let mut reader = S::reopen(&world.place, &world.name)?;
    let mut first_recovered = None;
    let mut all_recovered = None;
    let all_completed;
    loop {
        let (recovered, completed) = reader.recovered_and_completed_runs()?;
        let now = killed_at.elapsed();
        if recovered > 0 && first_recovered.is_none() {
            first_recovered = Some(now);
        }
        if recovered >= n && all_recovered.is_none() {
            all_recovered = Some(now);
        }
        if completed >= n {
            all_completed = now;
            break;
        }
        if now > WAIT_MAX {
            return Err(failed("the rescuer did not complete the killed worker's runs".into()));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let _ = stop.send(());
    let report = rescuer_rt.block_on(handle).map_err(|e| failed(format!("the worker task failed: {e}")))??;
    drop(rescuer_rt);
    let check = world.check(n)?;
    let ms = |d: Option<Duration>| d.map(|d| round1(d.as_secs_f64() * 1_000.0));
    let lease_left = |at: Option<i64>| at.map(|at| at - killed_at_ms);
    let all_recovered_ms = ms(all_recovered);
    Ok(json!({
        "runs": n,
        "what": "a worker (own connection and async runtime) is dropped abruptly while every run is inside its \
                 external step (charge sent, result not journaled): its leases stay, nothing is released, as \
                 after a SIGKILL. A second worker (claim poll every 10 ms) takes the runs over once the leases \
                 expire, replays reserve_inventory from the journal and calls the charge again with the same \
                 idempotency key (the payment service answers duplicate).",
        "lease_ms": p.lease_ms,
        "heartbeat_ms": p.lease_ms / 3,
        "rescuer_poll_ms": poll_ms,
        "leases_held_at_kill": held,
        "lease_left_at_kill_ms": {"min": lease_left(min_expiry), "max": lease_left(max_expiry)},
        "ms_from_kill": {
            "first_recovered": ms(first_recovered),
            "all_recovered": all_recovered_ms,
            "all_completed": round1(all_completed.as_secs_f64() * 1_000.0),
        },
        "resumed_within_lease": all_recovered_ms.is_some_and(|ms| ms <= (p.lease_ms + poll_ms as i64) as f64),
        "measured_by": "a connection of its own polled every 1 ms (recoveries > 0, status = completed)",
        "worker": report_json(&report),
        "check": check,
    }))
}

/// Every run of the workflow bench on stores made at `place`, and the JSON every backend
/// reports; `ceilings` (the database's own commit rate) and `extra` (what one backend adds to
/// the summary's targets) are the caller's.
pub(super) fn run_on<S: BenchStore>(place: &S::Place, p: &Params) -> Result<(Value, f64, bool)> {
    let mut all_passed = true;
    let mut passed = |v: &Value| {
        all_passed &= v["check"]["passed"] == json!(true);
    };
    let mut runs = Vec::new();
    let mut rates = Vec::new();
    let mut cpu_rates = Vec::new();
    for r in 0..p.repeat {
        let run = throughput::<S>(place, &format!("throughput-{r}"), p, Duration::ZERO)?;
        passed(&run);
        rates.push(run["sagas_per_s"].as_f64().unwrap_or(0.0));
        if let Some(rate) = run["sagas_per_cpu_s"].as_f64() {
            cpu_rates.push(rate);
        }
        runs.push(run);
    }
    let child_run = children::<S>(place, p)?;
    passed(&child_run);
    let queued_run = queued::<S>(place, p)?;
    passed(&queued_run);
    let latent = if p.external_latency_ms > 0 {
        let run = throughput::<S>(place, "throughput-latent", p, Duration::from_millis(p.external_latency_ms))?;
        passed(&run);
        Some(run)
    } else {
        None
    };
    let latency = if p.latency_sagas > 0 {
        let run = latency::<S>(place, p)?;
        passed(&run);
        Some(run)
    } else {
        None
    };
    let resumption = if p.resume_sagas > 0 {
        let run = resumption::<S>(place, p)?;
        passed(&run);
        Some(run)
    } else {
        None
    };
    let rate = median(&rates);
    let plain_commits = runs.last().map(|r| r["writer"]["per_saga"]["commits"].clone());
    let p50 = latency.as_ref().and_then(|l| l["ms"]["p50"].as_f64());
    let out = json!({
        "outcome": "bench",
        "kind": "workflows",
        "params": {
            "sagas": p.sagas,
            "in_flight": p.in_flight,
            "latency_sagas": p.latency_sagas,
            "external_latency_ms": p.external_latency_ms,
            "resume_sagas": p.resume_sagas,
            "lease_ms": p.lease_ms,
            "repeat": p.repeat,
            "skus": p.skus,
            "available_parallelism": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "load_average_at_start": load_average(),
        },
        "throughput": {
            "sagas_per_s_median": rate,
            "sagas_per_s_each": rates,
            "sagas_per_cpu_s_median": (!cpu_rates.is_empty()).then(|| median(&cpu_rates)),
            "runs": runs,
        },
        "children": child_run,
        "queued": queued_run,
        "throughput_with_external_latency": latent,
        "latency": latency,
        "resumption": resumption,
        "summary": {
            "sagas_per_s": rate,
            "sagas_per_s_with_external_latency": latent.as_ref().map(|l| l["sagas_per_s"].clone()),
            "child_sagas_per_s": child_run["sagas_per_s"].clone(),
            "child_to_plain_ratio": child_run["sagas_per_s"].as_f64().map(|c| round3(c / rate.max(1e-9))),
            "commits_per_child_saga": child_run["writer"]["per_saga"]["commits"].clone(),
            "commits_per_plain_saga": plain_commits,
            "queued_sagas_per_s": queued_run["sagas_per_s"].clone(),
            "queued_to_plain_ratio": queued_run["sagas_per_s"].as_f64().map(|c| round3(c / rate.max(1e-9))),
            "commits_per_queued_saga": queued_run["writer"]["per_saga"]["commits"].clone(),
            "latency_ms": latency.as_ref().map(|l| l["ms"].clone()),
            "resumption_ms_from_kill": resumption.as_ref().map(|r| r["ms_from_kill"].clone()),
            "lease_ms": p.lease_ms,
            "targets": {
                "latency_p50_under_3_ms": p50.map(|ms| ms < 3.0),
                "resumed_within_lease": resumption.as_ref().map(|r| r["resumed_within_lease"].clone()),
            },
        },
    });
    Ok((out, rate, all_passed))
}

/// The workflow bench on SQLite files in `dir`, beside the disk's single-row commit ceiling.
pub fn run(dir: &Path, durability: Durability, p: &Params) -> Result<Value> {
    let commit_probe =
        probe::single_row_commits(&dir.join("probe.db"), Durability::Full, p.probe_commits, PROBE_TIME_MAX)?;
    let place = SqlitePlace { dir: dir.to_path_buf(), durability };
    let (mut out, rate, all_passed) = run_on::<SqliteWorkflows>(&place, p)?;
    out["durability"] = json!(durability_word(durability));
    out["params"]["dir"] = json!(dir);
    out["fsync_ceiling"] = json!({
        "sqlite_single_row_commits_per_s": round1(commit_probe.commits_per_s),
        "sqlite_single_row_commits": commit_probe.commits,
    });
    out["summary"]["targets"]["sagas_per_s_at_least_10000"] = json!(rate >= 10_000.0);
    out["check"] = json!({
        "passed": all_passed,
        "what": "every run: every saga completed, one reserve and one ship effect per order, one charge per key",
    });
    Ok(out)
}

/// `--quick` numbers for tests.
pub fn quick(p: &mut Params) {
    p.sagas = 300;
    p.in_flight = 50;
    p.latency_sagas = 10;
    p.external_latency_ms = 1;
    p.resume_sagas = 5;
    p.lease_ms = 300;
    p.repeat = 1;
    p.probe_commits = 20;
    p.process_sagas = 200;
    p.pgbench_seconds = 1;
    p.skus = 1;
}
