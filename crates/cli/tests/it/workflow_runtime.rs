//! The durable workflow runtime (`tidemark_engine::workflow`) on the real SQLite workflow store,
//! in process: the order saga and its compensations, retries with a stable idempotency key,
//! replay after a crashed worker, timers and events, idempotent start, versions, concurrency
//! limits, cancellation, fencing and non-determinism. Every wait is a bounded loop; no test
//! asserts on wall-clock time.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tidemark_builtins::order::tables as order_sql;
use tidemark_builtins::order::{order_saga, FakePayments, OrderInput, Payments, ORDER_SAGA, ORDER_SAGA_VERSION};
use tidemark_core::workflow::{
    Backoff, ClaimRequest, ClaimedRun, FinishStatus, JournalOp, JournalWrite, LeaseState, PurgeReport, RetryPolicy,
    RunDetail, RunFilter, RunRecord, RunStatus, StartOutcome, StartRequest, StepFailure, StepKind, StepStatus,
    UnclaimableRuns, WorkflowStore, WorkflowVersion, WriteResult,
};
use tidemark_engine::workflow::tokio::runtime::{Builder, Runtime};
use tidemark_engine::workflow::{
    Saga, SagaAction, StepAttempt, Worker, WorkerObserver, WorkerOptions, WorkerReport, WorkflowError, WorkflowOptions,
    Workflows, Writer,
};
use tidemark_store_sqlite::{Durability, SqliteWorkflows};

pub(crate) type Store = SqliteWorkflows;

/// Rounds of `run_until_idle` (with a short pause between) before a test gives up.
const ROUNDS_MAX: usize = 1_000;
/// How long a test waits for a signal from inside a workflow before it gives up.
const SIGNAL_WAIT: Duration = Duration::from_secs(60);

pub(crate) fn runtime() -> Runtime {
    Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("tokio runtime")
}

pub(crate) fn open_writer(path: &Path) -> Writer<Store> {
    let path = path.to_path_buf();
    Writer::spawn(move || SqliteWorkflows::init_with(&path, Durability::Normal)).expect("open the workflow store")
}

/// Few attempts, 20 ms apart: retries happen within a test.
pub(crate) fn fast_retry(max_attempts: u32) -> RetryPolicy {
    RetryPolicy {
        max_attempts,
        backoff: Backoff::Schedule { delays_ms: vec![20] },
        attempt_timeout_ms: 30_000,
        jitter: false,
    }
}

pub(crate) fn fast_options() -> WorkflowOptions {
    WorkflowOptions { concurrency_max: None, retry: fast_retry(3) }
}

pub(crate) fn worker_options(id: &str) -> WorkerOptions {
    WorkerOptions { poll_interval_ms: 10, lease_ms: 10_000, ..WorkerOptions::new(id) }
}

pub(crate) fn worker(
    writer: &Writer<Store>,
    workflows: Workflows<Store>,
    options: WorkerOptions,
) -> Arc<Worker<Store>> {
    Arc::new(Worker::new(writer.clone(), workflows, options).expect("worker"))
}

pub(crate) fn request(run_id: &str, workflow: &str, version: u32, input: Value) -> StartRequest {
    StartRequest {
        run_id: run_id.into(),
        workflow: workflow.into(),
        version,
        input,
        key: None,
        start_at_ms: None,
        queue: None,
        deadline_ms: None,
    }
}

/// A workflow database (with the order tables, 10 units of `sku-1`) and a fake payment service.
pub(crate) struct Env {
    _dir: tempfile::TempDir,
    pub(crate) path: PathBuf,
    pub(crate) writer: Writer<Store>,
    pub(crate) payments: Arc<FakePayments>,
}

impl Env {
    pub(crate) fn new() -> Env {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("workflows.db");
        let writer = open_writer(&path);
        writer
            .call_blocking(|store, _| {
                let conn = store.connection();
                order_sql::install(conn)?;
                order_sql::set_stock(conn, "sku-1", 10)
            })
            .expect("order tables");
        let payments = Arc::new(FakePayments::open(&dir.path().join("payments.db")).expect("payments"));
        Env { _dir: dir, path, writer, payments }
    }

    pub(crate) fn start(&self, request: StartRequest) -> StartOutcome {
        self.writer.call_blocking(move |store, now| store.start_runs(&[request], now)).expect("start").remove(0)
    }

    pub(crate) fn start_new_request(&self, request: StartRequest) {
        let run_id = request.run_id.clone();
        assert_eq!(self.start(request), StartOutcome::Started { run_id });
    }

    pub(crate) fn start_new(&self, run_id: &str, workflow: &str, version: u32, input: Value) {
        let outcome = self.start(request(run_id, workflow, version, input));
        assert_eq!(outcome, StartOutcome::Started { run_id: run_id.into() });
    }

    pub(crate) fn detail(&self, run_id: &str) -> RunDetail {
        let id = run_id.to_string();
        self.writer.call_blocking(move |store, _| store.run(&id)).expect("read run").expect("run exists")
    }

    pub(crate) fn send(&self, run_id: &str, event_id: &str, name: &str, payload: Value) -> bool {
        let (run_id, event_id, name) = (run_id.to_string(), event_id.to_string(), name.to_string());
        self.writer
            .call_blocking(move |store, now| store.send_event(&run_id, &event_id, &name, &payload, now))
            .expect("send event")
    }

    pub(crate) fn cancel(&self, run_id: &str, reason: &str) -> RunRecord {
        let (run_id, reason) = (run_id.to_string(), reason.to_string());
        self.writer.call_blocking(move |store, now| store.cancel(&run_id, &reason, now)).expect("cancel")
    }

    pub(crate) fn stock(&self) -> i64 {
        self.writer.call_blocking(|store, _| order_sql::stock(store.connection(), "sku-1")).unwrap().unwrap()
    }

    /// "kind:order" per applied order effect, in order.
    pub(crate) fn effects(&self) -> Vec<String> {
        let effects = self.writer.call_blocking(|store, _| order_sql::effects(store.connection())).unwrap();
        effects.into_iter().map(|e| format!("{}:{}", e.kind, e.order_id)).collect()
    }

    /// (op, idempotency key, outcome) of every payment call.
    pub(crate) fn payment_calls(&self) -> Vec<(String, String, String)> {
        self.payments.calls().unwrap().into_iter().map(|c| (c.op, c.idempotency_key, c.outcome)).collect()
    }
}

/// Run the workers until nothing is due, again and again, until every run satisfies `done`.
pub(crate) fn drive_all(
    rt: &Runtime,
    workers: &[Arc<Worker<Store>>],
    env: &Env,
    run_ids: &[&str],
    done: impl Fn(&RunRecord) -> bool,
) -> WorkerReport {
    let mut total = WorkerReport::default();
    for _ in 0..ROUNDS_MAX {
        let handles: Vec<_> = workers
            .iter()
            .map(|w| {
                let w = w.clone();
                rt.spawn(async move { w.run_until_idle().await })
            })
            .collect();
        for handle in handles {
            total.merge(rt.block_on(handle).expect("worker task").expect("worker"));
        }
        if run_ids.iter().all(|id| done(&env.detail(id).run)) {
            return total;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let states: Vec<_> = run_ids.iter().map(|id| (id.to_string(), env.detail(id).run)).collect();
    panic!("runs did not get there in {ROUNDS_MAX} rounds: {states:#?}");
}

pub(crate) fn drive(
    rt: &Runtime,
    worker: &Arc<Worker<Store>>,
    env: &Env,
    run_ids: &[&str],
    done: impl Fn(&RunRecord) -> bool,
) -> WorkerReport {
    drive_all(rt, std::slice::from_ref(worker), env, run_ids, done)
}

pub(crate) fn settle(rt: &Runtime, worker: &Arc<Worker<Store>>, env: &Env, run_ids: &[&str]) -> WorkerReport {
    drive(rt, worker, env, run_ids, |run| run.status.is_terminal())
}

pub(crate) fn names(detail: &RunDetail) -> Vec<&str> {
    detail.journal.iter().map(|e| e.name.as_str()).collect()
}

pub(crate) fn statuses(detail: &RunDetail) -> Vec<StepStatus> {
    detail.journal.iter().map(|e| e.status).collect()
}

pub(crate) fn order_input(order_id: &str, extra: Value) -> Value {
    let mut input = json!({"order_id": order_id, "sku": "sku-1", "quantity": 2, "amount": 500});
    for (k, v) in extra.as_object().expect("object") {
        input[k] = v.clone();
    }
    input
}

pub(crate) fn order_workflows(env: &Env) -> Workflows<Store> {
    let mut workflows = Workflows::new();
    order_saga::<Store>(env.payments.clone())
        .compensation_policy(fast_retry(5))
        .register(&mut workflows, fast_options())
        .expect("register the order saga");
    workflows
}

#[test]
fn the_order_saga_completes() {
    let (env, rt) = (Env::new(), runtime());
    let w = worker(&env.writer, order_workflows(&env), worker_options("w1"));
    env.start_new("order-1", ORDER_SAGA, ORDER_SAGA_VERSION, order_input("o1", json!({})));
    let report = settle(&rt, &w, &env, &["order-1"]);
    let d = env.detail("order-1");
    assert_eq!(d.run.status, RunStatus::Completed, "{:?}", d.run.error);
    assert_eq!(names(&d), ["reserve_inventory", "charge_payment", "ship_order"]);
    assert_eq!(statuses(&d), [StepStatus::Completed; 3]);
    let kinds: Vec<StepKind> = d.journal.iter().map(|e| e.kind).collect();
    assert_eq!(kinds, [StepKind::Transactional, StepKind::External, StepKind::Transactional]);
    let result = d.run.result.expect("result");
    assert_eq!(result["charge_payment"]["charge_id"], "ch-order-1:1:charge_payment");
    assert_eq!(result["reserve_inventory"]["stock_left"], 8);
    assert_eq!(env.stock(), 8);
    assert_eq!(env.effects(), ["reserve:o1", "ship:o1"]);
    assert_eq!(env.payment_calls(), [("charge".into(), "order-1:1:charge_payment".into(), "charged".into())]);
    assert_eq!((report.completed, report.recovered, report.errors), (1, 0, 0), "{report:?}");
    assert!(d.run.lease_owner.is_none(), "a finished run holds no lease");
}

#[test]
fn a_failed_step_compensates_the_completed_ones_in_reverse_order() {
    let (env, rt) = (Env::new(), runtime());
    let w = worker(&env.writer, order_workflows(&env), worker_options("w1"));
    env.start_new("declined", ORDER_SAGA, 1, order_input("o-declined", json!({"fail": "charge_payment"})));
    env.start_new("unshippable", ORDER_SAGA, 1, order_input("o-unshippable", json!({"fail": "ship_order"})));
    env.start_new("too-many", ORDER_SAGA, 1, order_input("o-too-many", json!({"quantity": 1000})));
    let report = settle(&rt, &w, &env, &["declined", "unshippable", "too-many"]);
    assert_eq!(report.compensated, 3, "{report:?}");

    // The charge was declined: only the reservation is undone.
    let d = env.detail("declined");
    assert_eq!(d.run.status, RunStatus::Compensated);
    assert!(d.run.error.as_deref().unwrap_or("").contains("charge declined"), "{:?}", d.run.error);
    assert_eq!(names(&d), ["reserve_inventory", "charge_payment", "compensate:reserve_inventory"]);
    assert_eq!(statuses(&d), [StepStatus::Completed, StepStatus::Failed, StepStatus::Completed]);

    // The shipment failed after the charge: refund first, then release (reverse completion).
    let d = env.detail("unshippable");
    assert_eq!(d.run.status, RunStatus::Compensated);
    assert_eq!(
        names(&d),
        [
            "reserve_inventory",
            "charge_payment",
            "ship_order",
            "compensate:charge_payment",
            "compensate:reserve_inventory"
        ]
    );
    assert_eq!(d.journal[3].kind, StepKind::Compensation);
    assert_eq!(d.journal[4].kind, StepKind::Compensation);
    assert_eq!(d.journal[2].status, StepStatus::Failed);

    // Not enough stock: the transactional step failed, its writes rolled back, nothing to undo.
    let d = env.detail("too-many");
    assert_eq!(d.run.status, RunStatus::Compensated);
    assert_eq!(names(&d), ["reserve_inventory"]);
    assert_eq!(d.journal[0].status, StepStatus::Failed);

    assert_eq!(env.stock(), 10, "every reservation was released");
    let mut effects = env.effects();
    effects.sort();
    assert_eq!(effects, ["release:o-declined", "release:o-unshippable", "reserve:o-declined", "reserve:o-unshippable"]);
    let mut calls = env.payment_calls();
    calls.sort();
    assert_eq!(
        calls,
        [
            ("charge".into(), "declined:1:charge_payment".into(), "declined".into()),
            ("charge".into(), "unshippable:1:charge_payment".into(), "charged".into()),
            ("refund".into(), "unshippable:3:compensate:charge_payment".into(), "refunded".into()),
        ]
    );
}

#[test]
fn a_flaky_external_step_is_retried_with_the_same_idempotency_key() {
    let (env, rt) = (Env::new(), runtime());
    let w = worker(&env.writer, order_workflows(&env), worker_options("w1"));
    env.start_new("flaky", ORDER_SAGA, 1, order_input("o-flaky", json!({"flaky_attempts": 2})));
    let report = settle(&rt, &w, &env, &["flaky"]);
    let d = env.detail("flaky");
    assert_eq!(d.run.status, RunStatus::Completed, "{:?}", d.run.error);
    let key = "flaky:1:charge_payment".to_string();
    assert_eq!(
        env.payment_calls(),
        [
            ("charge".into(), key.clone(), "unavailable".into()),
            ("charge".into(), key.clone(), "unavailable".into()),
            ("charge".into(), key, "charged".into()),
        ]
    );
    assert_eq!(d.journal[1].attempts, 3);
    let attempts: Vec<(u32, bool)> = d.attempts.iter().filter(|a| a.seq == 1).map(|a| (a.attempt, a.ok)).collect();
    assert_eq!(attempts, [(1, false), (2, false), (3, true)]);
    assert!(d.attempts.iter().filter(|a| a.seq == 1 && !a.ok).all(|a| a.error.is_some()), "errors are recorded");
    assert!(report.suspended >= 2, "each failed attempt suspends the run: {report:?}");
    assert_eq!(env.effects(), ["reserve:o-flaky", "ship:o-flaky"], "the transactional steps ran once");
}

#[derive(Default)]
struct CrashCounters {
    first: AtomicUsize,
    tx_bodies: AtomicUsize,
    blocking: AtomicUsize,
    keys: Mutex<Vec<String>>,
}

/// `first` (external) -> `reserve` (transactional) -> `block` (external: with a gate, signals
/// and never returns).
fn crashy_workflows(counters: Arc<CrashCounters>, gate: Option<mpsc::SyncSender<()>>) -> Workflows<Store> {
    let mut workflows = Workflows::new();
    workflows
        .register("crashy", 1, fast_options(), move |ctx, _input| {
            let (counters, gate) = (counters.clone(), gate.clone());
            async move {
                let c = counters.clone();
                let first: u32 = ctx
                    .step("first", None, |_key| async move {
                        c.first.fetch_add(1, Ordering::SeqCst);
                        Ok(1)
                    })
                    .await?;
                let c = counters.clone();
                let reserved: bool = ctx
                    .tx_step("reserve", None, move |conn| {
                        c.tx_bodies.fetch_add(1, Ordering::SeqCst);
                        let outcome = order_sql::reserve(conn, "crash-order", "sku-1", 3)
                            .map_err(|e| StepFailure::retryable(e.to_string()))?;
                        Ok(matches!(outcome, order_sql::ReserveOutcome::Reserved { .. }))
                    })
                    .await?;
                let c = counters.clone();
                let last: u32 = ctx
                    .step("block", None, |key| async move {
                        c.blocking.fetch_add(1, Ordering::SeqCst);
                        c.keys.lock().unwrap().push(key);
                        if let Some(gate) = gate {
                            let _ = gate.send(());
                            std::future::pending::<()>().await;
                        }
                        Ok(3)
                    })
                    .await?;
                Ok(json!({"first": first, "reserved": reserved, "last": last}))
            }
        })
        .unwrap();
    workflows
}

#[test]
fn a_crashed_worker_s_run_is_recovered_without_re_running_settled_steps() {
    let env = Env::new();
    let counters = Arc::new(CrashCounters::default());
    env.start_new("crashy-1", "crashy", 1, json!({}));

    // Worker 1 (its own connection) runs until the third step, which blocks; then it "crashes":
    // its runtime is torn down without releasing anything.
    let (gate, entered) = mpsc::sync_channel(1);
    let rt1 = runtime();
    let writer1 = open_writer(&env.path);
    let w1 = worker(
        &writer1,
        crashy_workflows(counters.clone(), Some(gate)),
        WorkerOptions { lease_ms: 500, ..worker_options("w1") },
    );
    let running = w1.clone();
    rt1.spawn(async move { running.run_until(std::future::pending()).await });
    entered.recv_timeout(SIGNAL_WAIT).expect("the run reached the blocking step");
    rt1.shutdown_background();
    drop((w1, writer1));
    let d = env.detail("crashy-1");
    assert_eq!(d.run.lease_owner.as_deref(), Some("w1"), "the crashed worker still holds the lease");

    // Worker 2 takes the run over once the lease has expired.
    let rt2 = runtime();
    let w2 = worker(
        &env.writer,
        crashy_workflows(counters.clone(), None),
        WorkerOptions { lease_ms: 500, ..worker_options("w2") },
    );
    let report = settle(&rt2, &w2, &env, &["crashy-1"]);
    let d = env.detail("crashy-1");
    assert_eq!(d.run.status, RunStatus::Completed, "{:?}", d.run.error);
    assert_eq!(d.run.result, Some(json!({"first": 1, "reserved": true, "last": 3})));
    assert_eq!(d.run.recoveries, 1);
    assert_eq!(report.recovered, 1, "{report:?}");
    assert_eq!(counters.first.load(Ordering::SeqCst), 1, "a completed external step is not run again");
    assert_eq!(counters.tx_bodies.load(Ordering::SeqCst), 1, "a committed transactional step is not run again");
    assert_eq!(env.effects(), ["reserve:crash-order"], "the transactional effect is applied once");
    assert_eq!(env.stock(), 7);
    assert_eq!(counters.blocking.load(Ordering::SeqCst), 2, "the interrupted step runs again (at least once)");
    let keys = counters.keys.lock().unwrap().clone();
    assert_eq!(keys, ["crashy-1:2:block", "crashy-1:2:block"], "with the same idempotency key");
}

fn waiter_workflows() -> Workflows<Store> {
    let mut workflows = Workflows::new();
    workflows
        .register("waiter", 1, fast_options(), |ctx, _input| async move {
            ctx.sleep(Duration::from_millis(30)).await?;
            let approval = ctx.wait_for_event("approve", Duration::from_secs(3_600)).await?;
            let late = ctx.wait_for_event("late", Duration::from_millis(30)).await?;
            Ok(json!({"approval": approval, "late": late}))
        })
        .unwrap();
    workflows
}

#[test]
fn sleep_and_events_resume_the_run_and_a_wait_times_out() {
    let (env, rt) = (Env::new(), runtime());
    let w = worker(&env.writer, waiter_workflows(), worker_options("w1"));

    // The event arrives before the run even started waiting.
    env.start_new("early", "waiter", 1, json!({}));
    assert!(env.send("early", "ev-1", "approve", json!({"by": "alice"})));
    assert!(!env.send("early", "ev-1", "approve", json!({"by": "alice"})), "sending again is a no-op");
    // The event arrives while the run waits for it.
    env.start_new("later", "waiter", 1, json!({}));
    drive(&rt, &w, &env, &["later"], |run| run.status == RunStatus::Waiting);
    let run = env.detail("later").run;
    assert_eq!(run.waiting_for.as_deref(), Some("approve"));
    assert!(run.lease_owner.is_none(), "a waiting run holds no lease");
    assert!(env.send("later", "ev-2", "approve", json!({"by": "bob"})));
    settle(&rt, &w, &env, &["early", "later"]);

    for (run_id, by) in [("early", "alice"), ("later", "bob")] {
        let d = env.detail(run_id);
        assert_eq!(d.run.status, RunStatus::Completed, "{run_id}: {:?}", d.run.error);
        assert_eq!(d.run.result, Some(json!({"approval": {"by": by}, "late": null})), "{run_id}");
        let kinds: Vec<StepKind> = d.journal.iter().map(|e| e.kind).collect();
        assert_eq!(kinds, [StepKind::Sleep, StepKind::Wait, StepKind::Wait]);
        assert_eq!(names(&d), ["sleep", "approve", "late"]);
        assert_eq!(statuses(&d), [StepStatus::Completed; 3]);
        assert_eq!(d.events.len(), 1);
        assert_eq!(d.events[0].consumed_by_seq, Some(1), "{run_id}: consumed by the wait at position 1");
    }
}

#[test]
fn starting_a_run_twice_is_idempotent() {
    let (env, rt) = (Env::new(), runtime());
    let executions = Arc::new(AtomicUsize::new(0));
    let mut workflows = Workflows::new();
    let counter = executions.clone();
    workflows
        .register("once", 1, fast_options(), move |ctx, input| {
            let counter = counter.clone();
            async move {
                let n: usize = ctx
                    .step("count", None, |_key| async move { Ok(counter.fetch_add(1, Ordering::SeqCst) + 1) })
                    .await?;
                Ok(json!({"input": input, "n": n}))
            }
        })
        .unwrap();
    let w = worker(&env.writer, workflows, worker_options("w1"));
    let start = w.workflows().start_request("once-1", "once", json!({"x": 1})).unwrap();
    assert_eq!(start.version, 1);
    assert_eq!(env.start(start.clone()), StartOutcome::Started { run_id: "once-1".into() });
    assert_eq!(
        env.start(start.clone()),
        StartOutcome::Existing { run_id: "once-1".into(), status: RunStatus::Pending }
    );
    let other = StartRequest { input: json!({"x": 2}), ..start.clone() };
    assert!(matches!(env.start(other), StartOutcome::Conflict { .. }));
    settle(&rt, &w, &env, &["once-1"]);
    assert_eq!(env.start(start), StartOutcome::Existing { run_id: "once-1".into(), status: RunStatus::Completed });
    let report = rt.block_on(w.run_until_idle()).unwrap();
    assert_eq!(report.claimed, 0);
    assert_eq!(executions.load(Ordering::SeqCst), 1);
    assert_eq!(env.detail("once-1").run.result, Some(json!({"input": {"x": 1}, "n": 1})));
}

fn versioned(versions: &[u32]) -> Workflows<Store> {
    let mut workflows = Workflows::new();
    for &version in versions {
        workflows
            .register(
                "versioned",
                version,
                fast_options(),
                move |_ctx, _input| async move { Ok(json!({"ran": version})) },
            )
            .unwrap();
    }
    workflows
}

#[test]
fn runs_of_an_unknown_version_are_left_alone_and_reported() {
    let (env, rt) = (Env::new(), runtime());
    env.start_new("v1-run", "versioned", 1, json!({}));
    env.start_new("v2-run", "versioned", 2, json!({}));
    let old = worker(&env.writer, versioned(&[1]), worker_options("old"));
    let report = settle(&rt, &old, &env, &["v1-run"]);
    assert_eq!(report.unclaimable, [UnclaimableRuns { workflow: "versioned".into(), version: 2, runs: 1 }]);
    assert_eq!(rt.block_on(old.unclaimable()).unwrap(), report.unclaimable);
    let v2 = env.detail("v2-run").run;
    assert_eq!((v2.status, v2.lease_owner), (RunStatus::Pending, None), "never claimed by the old worker");
    assert!(env.detail("v2-run").journal.is_empty());

    let new = worker(&env.writer, versioned(&[1, 2]), worker_options("new"));
    let report = settle(&rt, &new, &env, &["v2-run"]);
    assert!(report.unclaimable.is_empty());
    assert_eq!(env.detail("v1-run").run.result, Some(json!({"ran": 1})));
    assert_eq!(env.detail("v2-run").run.result, Some(json!({"ran": 2})));
}

#[derive(Default)]
struct Gauge {
    current: AtomicUsize,
    max: AtomicUsize,
}

impl Gauge {
    fn enter(&self) {
        let now = self.current.fetch_add(1, Ordering::SeqCst) + 1;
        self.max.fetch_max(now, Ordering::SeqCst);
    }

    fn leave(&self) {
        self.current.fetch_sub(1, Ordering::SeqCst);
    }
}

#[test]
fn per_type_limits_and_per_key_serialization_hold_across_workers() {
    let (env, rt) = (Env::new(), runtime());
    let limited = Arc::new(Gauge::default());
    let keys: Arc<Vec<(String, Gauge)>> =
        Arc::new(vec![("k1".into(), Gauge::default()), ("k2".into(), Gauge::default())]);
    let order = Arc::new(Mutex::new(Vec::new()));
    let workflows = || {
        let mut workflows = Workflows::new();
        let gauge = limited.clone();
        workflows
            .register("limited", 1, WorkflowOptions { concurrency_max: Some(2), ..fast_options() }, move |ctx, _| {
                let gauge = gauge.clone();
                async move {
                    ctx.step("work", None, |_key| async move {
                        gauge.enter();
                        tokio_sleep(15).await;
                        gauge.leave();
                        Ok(())
                    })
                    .await?;
                    Ok(Value::Null)
                }
            })
            .unwrap();
        let (keys, order) = (keys.clone(), order.clone());
        workflows
            .register("keyed", 1, fast_options(), move |ctx, input| {
                let (keys, order) = (keys.clone(), order.clone());
                async move {
                    let key = input["key"].as_str().unwrap_or_default().to_string();
                    let run_id = ctx.run_id().to_string();
                    ctx.step("work", None, |_k| async move {
                        let gauge = &keys.iter().find(|(k, _)| *k == key).expect("known key").1;
                        gauge.enter();
                        order.lock().unwrap().push(run_id);
                        tokio_sleep(10).await;
                        gauge.leave();
                        Ok(())
                    })
                    .await?;
                    ctx.sleep(Duration::from_millis(1)).await?;
                    Ok(Value::Null)
                }
            })
            .unwrap();
        workflows
    };
    let mut requests = Vec::new();
    for i in 0..6 {
        requests.push(request(&format!("limited-{i}"), "limited", 1, json!({})));
    }
    for (run_id, key) in
        [("k1-a", "k1"), ("k1-b", "k1"), ("k2-a", "k2"), ("k1-c", "k1"), ("k2-b", "k2"), ("k1-d", "k1")]
    {
        requests.push(StartRequest { key: Some(key.into()), ..request(run_id, "keyed", 1, json!({"key": key})) });
    }
    let ids: Vec<String> = requests.iter().map(|r| r.run_id.clone()).collect();
    env.writer.call_blocking(move |store, now| store.start_runs(&requests, now)).unwrap();

    // Two workers, each with its own connection, as two processes would be.
    let writer2 = open_writer(&env.path);
    let workers = [
        worker(&env.writer, workflows(), WorkerOptions { concurrency: 8, ..worker_options("w1") }),
        worker(&writer2, workflows(), WorkerOptions { concurrency: 8, ..worker_options("w2") }),
    ];
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    drive_all(&rt, &workers, &env, &ids, |run| run.status.is_terminal());
    for id in &ids {
        assert_eq!(env.detail(id).run.status, RunStatus::Completed, "{id}");
    }
    let max = limited.max.load(Ordering::SeqCst);
    assert!((1..=2).contains(&max), "at most 2 `limited` runs at once, saw {max}");
    for (key, gauge) in keys.iter() {
        assert_eq!(gauge.max.load(Ordering::SeqCst), 1, "one run of key {key} at a time");
    }
    let order = order.lock().unwrap().clone();
    let k1: Vec<&str> = order.iter().map(String::as_str).filter(|id| id.starts_with("k1")).collect();
    assert_eq!(k1, ["k1-a", "k1-b", "k1-c", "k1-d"], "oldest first within a key");
}

async fn tokio_sleep(ms: u64) {
    tidemark_engine::workflow::tokio::time::sleep(Duration::from_millis(ms)).await;
}

#[test]
fn cancelling_a_sleeping_saga_compensates_then_ends_cancelled() {
    let (env, rt) = (Env::new(), runtime());
    let w = worker(&env.writer, order_workflows(&env), worker_options("w1"));
    env.start_new("slow", ORDER_SAGA, 1, order_input("o-slow", json!({"ship_after_ms": 3_600_000})));
    drive(&rt, &w, &env, &["slow"], |run| run.status == RunStatus::Sleeping);
    assert_eq!(env.stock(), 8);
    env.cancel("slow", "customer changed their mind");
    let report = settle(&rt, &w, &env, &["slow"]);
    let d = env.detail("slow");
    assert_eq!(d.run.status, RunStatus::Cancelled, "{:?}", d.run.error);
    assert_eq!(d.run.error.as_deref(), Some("cancel requested: customer changed their mind"));
    assert_eq!(
        names(&d),
        ["reserve_inventory", "charge_payment", "sleep", "compensate:charge_payment", "compensate:reserve_inventory"]
    );
    assert_eq!(d.journal[2].status, StepStatus::Waiting, "the timer never fired");
    assert_eq!(env.stock(), 10);
    assert_eq!(env.effects(), ["reserve:o-slow", "release:o-slow"]);
    let ops: Vec<(String, String)> = env.payment_calls().into_iter().map(|(op, _, outcome)| (op, outcome)).collect();
    assert_eq!(ops, [("charge".into(), "charged".into()), ("refund".into(), "refunded".into())]);
    assert_eq!(report.cancelled, 1, "{report:?}");
}

/// An order saga whose first charge attempt failed (the payment service unavailable) and whose
/// next attempt is a minute away, cancelled there: `charged` says whether the payment service
/// charged the order meanwhile without the journal knowing (a worker that charged and died
/// before its journal write). Returns the run's detail and the payment calls (op, outcome).
fn cancel_at_the_charge(charged: bool) -> (RunDetail, Vec<(String, String)>, Env) {
    let (env, rt) = (Env::new(), runtime());
    let mut workflows = Workflows::new();
    let minute = RetryPolicy {
        max_attempts: 3,
        backoff: Backoff::Schedule { delays_ms: vec![60_000] },
        attempt_timeout_ms: 30_000,
        jitter: false,
    };
    order_saga::<Store>(env.payments.clone())
        .compensation_policy(fast_retry(5))
        .register(&mut workflows, WorkflowOptions { concurrency_max: None, retry: minute })
        .expect("register the order saga");
    let w = worker(&env.writer, workflows, worker_options("w1"));
    let input = order_input("o-cut", json!({"flaky_attempts": 1}));
    env.start_new("cut", ORDER_SAGA, 1, input.clone());
    drive(&rt, &w, &env, &["cut"], |run| run.status == RunStatus::Pending);
    let before = env.detail("cut");
    assert_eq!(names(&before), ["reserve_inventory", "charge_payment"]);
    assert_eq!(before.journal[1].status, StepStatus::Retrying, "{:?}", before.journal);
    if charged {
        // The second attempt, as a worker that died before its journal write made it.
        let order: OrderInput = serde_json::from_value(input).unwrap();
        env.payments.charge("cut:1:charge_payment", &order).expect("charged");
    }
    env.cancel("cut", "customer changed their mind");
    settle(&rt, &w, &env, &["cut"]);
    let calls = env.payment_calls().into_iter().map(|(op, _, outcome)| (op, outcome)).collect();
    (env.detail("cut"), calls, env)
}

/// A cancel that stops a saga at its charge compensates the charge too, since it may have run:
/// charged without the journal knowing, it is refunded; never charged, the refund gives nothing
/// back. Either way the reservation is released and the run ends `cancelled`.
#[test]
fn a_cancel_at_an_external_step_compensates_it_whether_or_not_it_ran() {
    let pair = |op: &str, outcome: &str| (op.to_string(), outcome.to_string());
    for charged in [true, false] {
        let (d, calls, env) = cancel_at_the_charge(charged);
        assert_eq!(d.run.status, RunStatus::Cancelled, "{:?}", d.run.error);
        assert_eq!(
            names(&d),
            ["reserve_inventory", "charge_payment", "compensate:charge_payment", "compensate:reserve_inventory"]
        );
        assert_eq!(env.effects(), ["reserve:o-cut", "release:o-cut"]);
        assert_eq!(env.stock(), 10);
        // (The input's flaky_attempts fail the first call of every key, the refund's too.)
        let refund = if charged {
            vec![
                pair("charge", "unavailable"),
                pair("charge", "charged"),
                pair("refund", "unavailable"),
                pair("refund", "refunded"),
            ]
        } else {
            vec![pair("charge", "unavailable"), pair("refund", "unavailable"), pair("refund", "nothing_to_refund")]
        };
        assert_eq!(calls, refund, "charged meanwhile: {charged}");
        if !charged {
            assert_eq!(d.journal[2].output, Some(json!({"refunded": false, "reason": "the order was never charged"})));
        }
    }
}

/// The payment service behind a link that loses the charge's answers: each charge is made (or,
/// with `applies: false`, never reaches the service) and its caller hears a timeout every time;
/// refunds pass.
struct ChargeAnswersLost {
    service: Arc<FakePayments>,
    applies: bool,
}

impl Payments for ChargeAnswersLost {
    fn charge(&self, key: &str, order: &OrderInput) -> Result<Value, StepFailure> {
        if self.applies {
            self.service.charge(key, order)?;
        }
        Err(StepFailure::retryable("the payment service did not answer within the attempt timeout"))
    }

    fn refund(&self, key: &str, order: &OrderInput, charge: &Value) -> Result<Value, StepFailure> {
        self.service.refund(key, order, charge)
    }
}

/// A saga whose external step failed at its last attempt compensates that step too, since an
/// attempt may have applied without its answer coming back: charged, the order is refunded;
/// never charged, the refund gives nothing back. A card declined at the first of two attempts
/// (the service's own answer) is not compensated.
#[test]
fn an_external_step_out_of_attempts_is_compensated_whether_or_not_it_applied() {
    let pair = |op: &str, outcome: &str| (op.to_string(), outcome.to_string());
    for applies in [true, false] {
        let (env, rt) = (Env::new(), runtime());
        let mut workflows = Workflows::new();
        let payments = Arc::new(ChargeAnswersLost { service: env.payments.clone(), applies });
        order_saga::<Store>(payments)
            .compensation_policy(fast_retry(5))
            .register(&mut workflows, WorkflowOptions { concurrency_max: None, retry: fast_retry(2) })
            .expect("register the order saga");
        let w = worker(&env.writer, workflows, worker_options("w1"));
        env.start_new("lost", ORDER_SAGA, 1, order_input("o-lost", json!({})));
        settle(&rt, &w, &env, &["lost"]);
        let d = env.detail("lost");
        assert_eq!(d.run.status, RunStatus::Compensated, "{:?}", d.run.error);
        assert_eq!(
            names(&d),
            [
                "reserve_inventory",
                "charge_payment",
                "patch:saga-compensates-out-of-attempts",
                "compensate:charge_payment",
                "compensate:reserve_inventory"
            ]
        );
        assert_eq!(d.journal[1].attempts, 2);
        assert_eq!(env.effects(), ["reserve:o-lost", "release:o-lost"]);
        assert_eq!(env.stock(), 10);
        let calls: Vec<(String, String)> =
            env.payment_calls().into_iter().map(|(op, _, outcome)| (op, outcome)).collect();
        let expected = if applies {
            vec![pair("charge", "charged"), pair("charge", "duplicate"), pair("refund", "refunded")]
        } else {
            vec![pair("refund", "nothing_to_refund")]
        };
        assert_eq!(calls, expected, "the charge applied: {applies}");
    }
    // Declined at the first of two attempts: only the reservation is compensated.
    let (env, rt) = (Env::new(), runtime());
    let mut workflows = Workflows::new();
    order_saga::<Store>(env.payments.clone())
        .register(&mut workflows, WorkflowOptions { concurrency_max: None, retry: fast_retry(2) })
        .expect("register the order saga");
    let w = worker(&env.writer, workflows, worker_options("w1"));
    env.start_new("declined", ORDER_SAGA, 1, order_input("o-declined", json!({"fail": "charge_payment"})));
    settle(&rt, &w, &env, &["declined"]);
    let d = env.detail("declined");
    assert_eq!(d.run.status, RunStatus::Compensated, "{:?}", d.run.error);
    assert_eq!(names(&d), ["reserve_inventory", "charge_payment", "compensate:reserve_inventory"]);
    assert_eq!(d.journal[1].attempts, 1);
}

/// A cancelled saga whose compensation ran out of attempts parks; an operator's retry resumes
/// the compensation and the run still ends `cancelled` (the retry does not withdraw the cancel
/// request: the journal after the cancel holds compensations, and the replay must see them so).
#[test]
fn retrying_a_cancelled_saga_parked_in_its_compensation_finishes_the_cancel() {
    let (env, rt) = (Env::new(), runtime());
    let mut workflows = Workflows::new();
    // The payment service fails the first 2 calls of each key: the charge succeeds on its 3rd
    // attempt; the refund, with 2 attempts, gives up and parks the run.
    order_saga::<Store>(env.payments.clone())
        .compensation_policy(fast_retry(2))
        .register(&mut workflows, fast_options())
        .expect("register the order saga");
    let w = worker(&env.writer, workflows, worker_options("w1"));
    let input = order_input("o-c", json!({"ship_after_ms": 3_600_000, "flaky_attempts": 2}));
    env.start_new("c1", ORDER_SAGA, 1, input);
    drive(&rt, &w, &env, &["c1"], |run| run.status == RunStatus::Sleeping);
    env.cancel("c1", "customer changed their mind");
    settle(&rt, &w, &env, &["c1"]);
    assert_eq!(env.detail("c1").run.status, RunStatus::Parked);
    let retried = env.writer.call_blocking(|store, now| store.retry("c1", "refunds are back", now)).expect("retry");
    assert!(retried.cancel_requested, "a retry keeps the cancel request");
    settle(&rt, &w, &env, &["c1"]);
    let d = env.detail("c1");
    assert_eq!(d.run.status, RunStatus::Cancelled, "{:?}", d.run.error);
    assert_eq!(
        names(&d),
        ["reserve_inventory", "charge_payment", "sleep", "compensate:charge_payment", "compensate:reserve_inventory"]
    );
    assert_eq!(env.stock(), 10);
    assert_eq!(env.effects(), ["reserve:o-c", "release:o-c"]);
    assert_eq!(d.run.error.as_deref(), Some("cancel requested"), "the park's error is gone with the retry");
}

#[test]
fn a_cancel_seen_by_a_heartbeat_stops_the_run_at_the_next_step() {
    let (env, rt) = (Env::new(), runtime());
    let after = Arc::new(AtomicUsize::new(0));
    let (entered_tx, entered) = mpsc::sync_channel(1);
    let mut workflows = Workflows::new();
    let counter = after.clone();
    workflows
        .register("patient", 1, fast_options(), move |ctx, _| {
            let (counter, entered_tx) = (counter.clone(), entered_tx.clone());
            async move {
                let watcher = ctx.clone();
                let seen: String = ctx
                    .step("hold", None, |_key| async move {
                        let _ = entered_tx.send(());
                        for _ in 0..6_000 {
                            if watcher.cancel_requested() {
                                return Ok("noticed".to_string());
                            }
                            tokio_sleep(10).await;
                        }
                        Ok("gave up".to_string())
                    })
                    .await?;
                ctx.step("after", None, |_key| async move { Ok(counter.fetch_add(1, Ordering::SeqCst)) }).await?;
                Ok(json!(seen))
            }
        })
        .unwrap();
    let w = worker(&env.writer, workflows, WorkerOptions { heartbeat_ms: Some(50), ..worker_options("w1") });
    env.start_new("patient-1", "patient", 1, json!({}));
    let running = w.clone();
    let handle = rt.spawn(async move { running.run_until_idle().await });
    entered.recv_timeout(SIGNAL_WAIT).expect("the run is in its first step");
    env.cancel("patient-1", "stop");
    let report = rt.block_on(handle).unwrap().unwrap();
    let d = env.detail("patient-1");
    assert_eq!(d.run.status, RunStatus::Cancelled, "{:?}", d.run.error);
    assert_eq!(names(&d), ["hold"]);
    assert_eq!(d.journal[0].output, Some(json!("noticed")), "the heartbeat told the running step");
    assert_eq!(after.load(Ordering::SeqCst), 0, "no step after the boundary");
    assert!(report.heartbeats >= 1, "{report:?}");
}

#[test]
fn a_run_taken_away_by_an_operator_is_dropped_by_its_worker() {
    let (env, rt) = (Env::new(), runtime());
    let after = Arc::new(AtomicUsize::new(0));
    let (entered_tx, entered) = mpsc::sync_channel(1);
    let (release_tx, release) = mpsc::sync_channel::<()>(1);
    let release = Arc::new(Mutex::new(release));
    let mut workflows = Workflows::new();
    let counter = after.clone();
    workflows
        .register("taken", 1, fast_options(), move |ctx, _| {
            let (counter, entered_tx, release) = (counter.clone(), entered_tx.clone(), release.clone());
            async move {
                ctx.step("held", None, |_key| async move {
                    let _ = entered_tx.send(());
                    // Blocks this worker thread briefly: the test answers right away.
                    let _ = release.lock().unwrap().recv_timeout(SIGNAL_WAIT);
                    Ok(1)
                })
                .await?;
                ctx.step("after", None, |_key| async move { Ok(counter.fetch_add(1, Ordering::SeqCst)) }).await?;
                Ok(Value::Null)
            }
        })
        .unwrap();
    let w = worker(&env.writer, workflows, worker_options("w1"));
    env.start_new("taken-1", "taken", 1, json!({}));
    let running = w.clone();
    let handle = rt.spawn(async move { running.run_until_idle().await });
    entered.recv_timeout(SIGNAL_WAIT).expect("the run is in its first step");
    env.writer.call_blocking(|store, now| store.abandon("taken-1", "operator takes over", now)).expect("abandon");
    release_tx.send(()).unwrap();
    let report = rt.block_on(handle).unwrap().unwrap();
    let d = env.detail("taken-1");
    assert_eq!(d.run.status, RunStatus::Cancelled);
    assert!(d.journal.is_empty(), "the fenced write recorded nothing: {:?}", d.journal);
    assert_eq!(after.load(Ordering::SeqCst), 0);
    assert_eq!(report.lost, 1, "{report:?}");
}

#[test]
fn a_replay_that_no_longer_matches_the_journal_parks_the_run() {
    let (env, rt) = (Env::new(), runtime());
    let mut v1 = Workflows::new();
    v1.register("shifty", 1, fast_options(), |ctx, _| async move {
        ctx.step("a", None, |_key| async move { Ok(1) }).await?;
        ctx.wait_for_event("go", Duration::from_secs(3_600)).await?;
        Ok(Value::Null)
    })
    .unwrap();
    let old = worker(&env.writer, v1, worker_options("old"));
    env.start_new("shifty-1", "shifty", 1, json!({}));
    drive(&rt, &old, &env, &["shifty-1"], |run| run.status == RunStatus::Waiting);

    // The same name and version, but the code changed under the running run.
    let ran_b = Arc::new(AtomicUsize::new(0));
    let counter = ran_b.clone();
    let mut changed = Workflows::new();
    changed
        .register("shifty", 1, fast_options(), move |ctx, _| {
            let counter = counter.clone();
            async move {
                ctx.step("b", None, |_key| async move { Ok(counter.fetch_add(1, Ordering::SeqCst)) }).await?;
                Ok(Value::Null)
            }
        })
        .unwrap();
    let new = worker(&env.writer, changed, worker_options("new"));
    assert!(env.send("shifty-1", "go-1", "go", json!({})));
    let report = settle(&rt, &new, &env, &["shifty-1"]);
    let d = env.detail("shifty-1");
    assert_eq!(d.run.status, RunStatus::Parked);
    let error = d.run.error.unwrap_or_default();
    assert!(error.contains("non-deterministic"), "{error}");
    assert_eq!(ran_b.load(Ordering::SeqCst), 0, "the mismatching step never ran");
    assert_eq!(report.parked, 1);
}

#[test]
fn a_compensation_out_of_attempts_parks_the_run() {
    let (env, rt) = (Env::new(), runtime());
    let mut workflows = Workflows::new();
    Saga::<Store>::new("fragile", 1)
        .step(
            "one",
            SagaAction::external(|_key, _data| async { Ok(json!("done")) }),
            Some(SagaAction::external(|_key, _data| async { Err(StepFailure::retryable("undo service down")) })),
        )
        .step("two", SagaAction::external(|_key, _data| async { Err(StepFailure::permanent("no")) }), None)
        .compensation_policy(fast_retry(2))
        .register(&mut workflows, fast_options())
        .unwrap();
    let w = worker(&env.writer, workflows, worker_options("w1"));
    env.start_new("fragile-1", "fragile", 1, json!({}));
    settle(&rt, &w, &env, &["fragile-1"]);
    let d = env.detail("fragile-1");
    assert_eq!(d.run.status, RunStatus::Parked);
    let error = d.run.error.clone().unwrap_or_default();
    assert!(error.contains("compensate:one") && error.contains("undo service down"), "{error}");
    assert_eq!(names(&d), ["one", "two", "compensate:one"]);
    assert_eq!(statuses(&d), [StepStatus::Completed, StepStatus::Failed, StepStatus::Failed]);
    assert_eq!(d.journal[2].attempts, 2, "every attempt of the compensation was made");
    assert_eq!(d.attempts.iter().filter(|a| a.seq == 2).count(), 2);
}

#[test]
fn a_swallowed_suspension_still_suspends_the_run() {
    let (env, rt) = (Env::new(), runtime());
    let runs_after = Arc::new(AtomicUsize::new(0));
    let refused = Arc::new(AtomicUsize::new(0));
    let mut workflows = Workflows::new();
    let (counter, refusals) = (runs_after.clone(), refused.clone());
    workflows
        .register("stubborn", 1, fast_options(), move |ctx, _| {
            let (counter, refusals) = (counter.clone(), refusals.clone());
            async move {
                let _ignored = ctx.sleep(Duration::from_millis(20)).await;
                let value = match ctx
                    .step("after", None, |_key| async move { Ok(counter.fetch_add(1, Ordering::SeqCst) as u64 + 7) })
                    .await
                {
                    Ok(value) => value,
                    Err(error) => {
                        assert!(error.is_suspended(), "{error}");
                        refusals.fetch_add(1, Ordering::SeqCst);
                        0
                    }
                };
                Ok(json!(value))
            }
        })
        .unwrap();
    let w = worker(&env.writer, workflows, worker_options("w1"));
    env.start_new("stubborn-1", "stubborn", 1, json!({}));
    let report = settle(&rt, &w, &env, &["stubborn-1"]);
    let d = env.detail("stubborn-1");
    assert_eq!(d.run.status, RunStatus::Completed);
    assert_eq!(d.run.result, Some(json!(7)), "the function's first `Ok(0)` was not taken");
    assert_eq!(runs_after.load(Ordering::SeqCst), 1);
    assert_eq!(refused.load(Ordering::SeqCst), 1, "the step after the swallowed suspension refused to run");
    assert!(report.suspended >= 1);
}

#[test]
fn a_panicking_workflow_is_parked() {
    let (env, rt) = (Env::new(), runtime());
    let mut workflows = Workflows::new();
    workflows
        .register("panicky", 1, fast_options(), |ctx, _| async move {
            ctx.step("fine", None, |_key| async { Ok(1) }).await?;
            if ctx.run_id() == "panicky-1" {
                panic!("bug in the workflow");
            }
            Ok(Value::Null)
        })
        .unwrap();
    let w = worker(&env.writer, workflows, worker_options("w1"));
    env.start_new("panicky-1", "panicky", 1, json!({}));
    let report = settle(&rt, &w, &env, &["panicky-1"]);
    let d = env.detail("panicky-1");
    assert_eq!(d.run.status, RunStatus::Parked);
    assert!(d.run.error.unwrap_or_default().contains("bug in the workflow"));
    assert_eq!(report.parked, 1);
}

#[test]
fn queued_journal_writes_commit_in_one_transaction() {
    let env = Env::new();
    let rt = runtime();
    let (blocked_tx, blocked) = mpsc::sync_channel(1);
    let (go_tx, go) = mpsc::sync_channel::<()>(1);
    // Hold the writer thread, queue writes behind it, then let it go: they form one batch.
    let holding = env.writer.call(move |_store, _now| {
        let _ = blocked_tx.send(());
        let _ = go.recv_timeout(SIGNAL_WAIT);
        Ok(())
    });
    blocked.recv_timeout(SIGNAL_WAIT).expect("the writer is held");
    let before = env.writer.stats().commits.load(Ordering::SeqCst);
    let answers: Vec<_> = (0..5)
        .map(|i| {
            env.writer.write(JournalWrite {
                run_id: format!("ghost-{i}"),
                lease_token: "no-such-token".into(),
                op: JournalOp::Release,
            })
        })
        .collect();
    go_tx.send(()).unwrap();
    rt.block_on(holding).unwrap();
    for answer in answers {
        assert_eq!(rt.block_on(answer).unwrap(), WriteResult::Fenced, "no lease: fenced");
    }
    assert_eq!(env.writer.stats().commits.load(Ordering::SeqCst) - before, 1, "one commit for five writes");
    assert_eq!(env.writer.stats().largest_batch.load(Ordering::SeqCst), 5);
}

#[test]
fn saga_and_worker_configuration_is_validated() {
    let env = Env::new();
    let mut workflows: Workflows<Store> = Workflows::new();
    let nothing = |_key: String, _data| async { Ok(Value::Null) };
    let duplicate = Saga::<Store>::new("dup", 1)
        .step("a", SagaAction::external(nothing), None)
        .step("a", SagaAction::external(nothing), None)
        .register(&mut workflows, WorkflowOptions::default());
    assert_eq!(duplicate.unwrap_err().code(), "already_exists");
    assert_eq!(
        Saga::<Store>::new("empty", 1).register(&mut workflows, WorkflowOptions::default()).unwrap_err().code(),
        "invalid_argument"
    );
    versioned(&[1]).register("x", 0, WorkflowOptions::default(), |_c, _i| async { Ok(Value::Null) }).unwrap_err();
    let bad = WorkerOptions { lease_ms: 10, ..WorkerOptions::new("w") };
    assert!(Worker::new(env.writer.clone(), versioned(&[1]), bad).is_err());
    assert!(Worker::new(env.writer.clone(), Workflows::new(), WorkerOptions::new("w")).is_err());
    let err = versioned(&[1]).start_request("r", "nope", json!({})).unwrap_err();
    assert_eq!(err.code(), "unknown_workflow");
    let _ = WorkflowError::failed("x").to_string();
}

#[test]
fn an_attempt_that_runs_too_long_is_cut_and_retried() {
    let (env, rt) = (Env::new(), runtime());
    let attempts = Arc::new(AtomicUsize::new(0));
    let mut workflows = Workflows::new();
    let counter = attempts.clone();
    workflows
        .register("slowpoke", 1, fast_options(), move |ctx, _| {
            let counter = counter.clone();
            async move {
                let policy = RetryPolicy { attempt_timeout_ms: 50, ..fast_retry(3) };
                let n: usize = ctx
                    .step("slow", Some(policy), |_key| async move {
                        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
                        if n == 1 {
                            tokio_sleep(600_000).await;
                        }
                        Ok(n)
                    })
                    .await?;
                Ok(json!(n))
            }
        })
        .unwrap();
    let w = worker(&env.writer, workflows, worker_options("w1"));
    env.start_new("slow-1", "slowpoke", 1, json!({}));
    settle(&rt, &w, &env, &["slow-1"]);
    let d = env.detail("slow-1");
    assert_eq!(d.run.status, RunStatus::Completed, "{:?}", d.run.error);
    assert_eq!(d.run.result, Some(json!(2)));
    assert_eq!(d.journal[0].attempts, 2);
    let first = &d.attempts[0];
    assert!(!first.ok && first.error.as_deref().unwrap_or("").contains("timed out"), "{first:?}");
}

#[test]
fn a_graceful_shutdown_releases_the_leases_at_once() {
    let (env, rt) = (Env::new(), runtime());
    let keys = Arc::new(Mutex::new(Vec::new()));
    let (entered_tx, entered) = mpsc::sync_channel(1);
    let workflows = |block: bool| {
        let (keys, entered_tx) = (keys.clone(), entered_tx.clone());
        let mut workflows = Workflows::new();
        workflows
            .register("held", 1, fast_options(), move |ctx, _| {
                let (keys, entered_tx) = (keys.clone(), entered_tx.clone());
                async move {
                    ctx.step("long", None, |key| async move {
                        keys.lock().unwrap().push(key);
                        if block {
                            let _ = entered_tx.send(());
                            tokio_sleep(600_000).await;
                        }
                        Ok(())
                    })
                    .await?;
                    Ok(Value::Null)
                }
            })
            .unwrap();
        workflows
    };
    env.start_new("held-1", "held", 1, json!({}));
    let first = worker(&env.writer, workflows(true), worker_options("w1"));
    let (stop_tx, stop) = tidemark_engine::workflow::tokio::sync::oneshot::channel::<()>();
    let running = first.clone();
    let handle = rt.spawn(async move {
        running
            .run_until(async move {
                let _ = stop.await;
            })
            .await
    });
    entered.recv_timeout(SIGNAL_WAIT).expect("the run is in its step");
    stop_tx.send(()).unwrap();
    let report = rt.block_on(handle).unwrap().unwrap();
    assert_eq!((report.aborted, report.released), (1, 1), "{report:?}");
    let run = env.detail("held-1").run;
    assert_eq!((run.lease_owner, run.status), (None, RunStatus::Running), "released, not finished");

    // Another worker takes it at once: not a recovery (no lease had to expire).
    let second = worker(&env.writer, workflows(false), worker_options("w2"));
    let report = settle(&rt, &second, &env, &["held-1"]);
    assert_eq!((report.recovered, report.completed), (0, 1), "{report:?}");
    assert_eq!(env.detail("held-1").run.recoveries, 0);
    let keys = keys.lock().unwrap().clone();
    assert_eq!(keys, ["held-1:0:long", "held-1:0:long"]);
}

/// The SQLite store whose heartbeats fail on demand.
struct FailingHeartbeats {
    inner: SqliteWorkflows,
    fail: Arc<std::sync::atomic::AtomicBool>,
}

impl WorkflowStore for FailingHeartbeats {
    type Target = rusqlite::Connection;

    fn start_runs(&mut self, r: &[StartRequest], now: i64) -> tidemark_core::Result<Vec<StartOutcome>> {
        self.inner.start_runs(r, now)
    }
    fn claim(&mut self, r: &ClaimRequest, now: i64) -> tidemark_core::Result<Vec<ClaimedRun>> {
        self.inner.claim(r, now)
    }
    fn heartbeat(
        &mut self,
        worker_id: &str,
        leases: &[(String, String)],
        lease_ms: i64,
        now: i64,
    ) -> tidemark_core::Result<Vec<LeaseState>> {
        if self.fail.load(Ordering::SeqCst) {
            return Err(tidemark_core::Error::store("disk on fire"));
        }
        self.inner.heartbeat(worker_id, leases, lease_ms, now)
    }
    fn commit(
        &mut self,
        w: Vec<JournalWrite<rusqlite::Connection>>,
        now: i64,
    ) -> tidemark_core::Result<Vec<WriteResult>> {
        self.inner.commit(w, now)
    }
    fn send_event(&mut self, run_id: &str, id: &str, name: &str, p: &Value, now: i64) -> tidemark_core::Result<bool> {
        self.inner.send_event(run_id, id, name, p, now)
    }
    fn run_page(
        &self,
        run_id: &str,
        page: &tidemark_core::workflow::DetailPage,
    ) -> tidemark_core::Result<Option<RunDetail>> {
        self.inner.run_page(run_id, page)
    }
    fn published(
        &self,
        run_id: &str,
        key: &str,
    ) -> tidemark_core::Result<Option<tidemark_core::workflow::PublishedValue>> {
        self.inner.published(run_id, key)
    }
    fn list_runs(&self, f: &RunFilter, limit: usize) -> tidemark_core::Result<Vec<RunRecord>> {
        self.inner.list_runs(f, limit)
    }
    fn cancel(&mut self, run_id: &str, reason: &str, now: i64) -> tidemark_core::Result<RunRecord> {
        self.inner.cancel(run_id, reason, now)
    }
    fn retry(&mut self, run_id: &str, reason: &str, now: i64) -> tidemark_core::Result<RunRecord> {
        self.inner.retry(run_id, reason, now)
    }
    fn fork(&mut self, run_id: &str, from: u32, new_id: &str, now: i64) -> tidemark_core::Result<RunRecord> {
        self.inner.fork(run_id, from, new_id, now)
    }
    fn skip_step(&mut self, run_id: &str, seq: u32, o: &Value, r: &str, now: i64) -> tidemark_core::Result<RunRecord> {
        self.inner.skip_step(run_id, seq, o, r, now)
    }
    fn abandon(&mut self, run_id: &str, reason: &str, now: i64) -> tidemark_core::Result<RunRecord> {
        self.inner.abandon(run_id, reason, now)
    }
    fn purge(&mut self, before: i64, rows: usize, now: i64) -> tidemark_core::Result<PurgeReport> {
        self.inner.purge(before, rows, now)
    }
    fn unclaimable(&self, known: &[WorkflowVersion]) -> tidemark_core::Result<Vec<UnclaimableRuns>> {
        self.inner.unclaimable(known)
    }
}

#[test]
fn a_failed_heartbeat_stops_the_runs_in_flight() {
    let (env, rt) = (Env::new(), runtime());
    let calls = Arc::new(AtomicUsize::new(0));
    let fail = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let path = env.path.clone();
    let failing = fail.clone();
    let writer = Writer::spawn(move || {
        Ok(FailingHeartbeats { inner: SqliteWorkflows::init_with(&path, Durability::Normal)?, fail: failing })
    })
    .unwrap();
    let counter = calls.clone();
    let mut workflows = Workflows::new();
    workflows
        .register("beating", 1, fast_options(), move |ctx, _| {
            let counter = counter.clone();
            async move {
                ctx.step("long", None, |_key| async move {
                    if counter.fetch_add(1, Ordering::SeqCst) == 0 {
                        tokio_sleep(600_000).await;
                    }
                    Ok(())
                })
                .await?;
                Ok(Value::Null)
            }
        })
        .unwrap();
    let w = Arc::new(
        Worker::new(writer.clone(), workflows, WorkerOptions { lease_ms: 500, ..worker_options("w1") }).unwrap(),
    );
    env.start_new("beating-1", "beating", 1, json!({}));
    let report = rt.block_on(w.run_until_idle()).unwrap();
    assert_eq!(report.aborted, 1, "{report:?}");
    assert!(report.last_error.unwrap_or_default().contains("disk on fire"));
    assert_eq!(env.detail("beating-1").run.lease_owner.as_deref(), Some("w1"), "the lease is left to expire");

    // Once the lease has expired the run is recovered (here by the same worker, healthy again).
    fail.store(false, Ordering::SeqCst);
    let mut total = WorkerReport::default();
    for _ in 0..ROUNDS_MAX {
        total.merge(rt.block_on(w.run_until_idle()).unwrap());
        if env.detail("beating-1").run.status.is_terminal() {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(env.detail("beating-1").run.status, RunStatus::Completed);
    assert_eq!((total.recovered, calls.load(Ordering::SeqCst)), (1, 2), "{total:?}");
}

/// The writer's urgent lane (the heartbeats'): a call on it runs as soon as the writer thread
/// is free, before the calls and journal writes queued ahead of it, which then run in their
/// order.
#[test]
fn an_urgent_call_runs_before_the_backlog_queued_ahead_of_it() {
    let (env, rt) = (Env::new(), runtime());
    let order = Arc::new(Mutex::new(Vec::<String>::new()));
    // Hold the writer thread until the backlog is queued.
    let (open, gate) = mpsc::channel::<()>();
    let held = env.writer.call(move |_, _| {
        gate.recv_timeout(SIGNAL_WAIT).expect("the gate opens");
        Ok(())
    });
    let mut backlog = Vec::new();
    for i in 0..50 {
        let order = order.clone();
        backlog.push(env.writer.call(move |_, _| {
            order.lock().unwrap().push(format!("call {i}"));
            Ok(())
        }));
    }
    let order_urgent = order.clone();
    let urgent = env.writer.call_urgent(move |store: &mut Store, now| {
        // A real store call on the lane, as a heartbeat is one.
        let leases = store.heartbeat("nobody", &[("no-run".into(), "no-token".into())], 1_000, now)?;
        order_urgent.lock().unwrap().push("urgent".into());
        Ok(leases)
    });
    open.send(()).unwrap();
    rt.block_on(async {
        held.await.unwrap();
        assert_eq!(urgent.await.unwrap(), vec![LeaseState::Lost]);
        for call in backlog {
            call.await.unwrap();
        }
    });
    let order = order.lock().unwrap().clone();
    let mut want = vec!["urgent".to_string()];
    want.extend((0..50).map(|i| format!("call {i}")));
    assert_eq!(order, want);
}

/// What a [`WorkerObserver`] was told, in order.
#[derive(Default)]
struct Recorder {
    events: Mutex<Vec<String>>,
}

impl WorkerObserver for Recorder {
    fn run_claimed(&self, run: &RunRecord, recovered: bool) {
        self.events.lock().unwrap().push(format!("claimed {} recovered={recovered}", run.run_id));
    }

    fn step_attempted(&self, attempt: &StepAttempt<'_>) {
        let StepAttempt { run_id, workflow, step, attempt, end, .. } = *attempt;
        self.events.lock().unwrap().push(format!("step {run_id} {workflow} {step}#{attempt} {}", end.as_str()));
    }

    fn run_finished(&self, run: &RunRecord, status: FinishStatus, run_ms: i64) {
        assert!(run_ms >= 0, "{run_ms}");
        assert_eq!(run.input, Value::Null, "the input is not handed over");
        self.events.lock().unwrap().push(format!("finished {} {status:?}", run.run_id));
    }

    fn lease_lost(&self, run_id: &str) {
        self.events.lock().unwrap().push(format!("lost {run_id}"));
    }
}

impl Recorder {
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.events.lock().unwrap())
    }
}

#[test]
fn an_observer_is_told_every_step_attempt_retry_and_the_end_of_the_run() {
    let (env, rt) = (Env::new(), runtime());
    let recorder = Arc::new(Recorder::default());
    let w = Arc::new(
        Worker::new(env.writer.clone(), order_workflows(&env), worker_options("w1"))
            .expect("worker")
            .with_observer(recorder.clone()),
    );
    env.start_new("seen", ORDER_SAGA, 1, order_input("o-seen", json!({"flaky_attempts": 2})));
    settle(&rt, &w, &env, &["seen"]);
    let events = recorder.take();
    let steps: Vec<&str> = events.iter().filter(|e| e.starts_with("step ")).map(String::as_str).collect();
    assert_eq!(
        steps,
        [
            "step seen order_saga reserve_inventory#1 completed",
            "step seen order_saga charge_payment#1 retrying",
            "step seen order_saga charge_payment#2 retrying",
            "step seen order_saga charge_payment#3 completed",
            "step seen order_saga ship_order#1 completed",
        ],
        "{events:#?}"
    );
    // One claim per execution: the first, and one after each retry's backoff.
    assert_eq!(events.iter().filter(|e| *e == "claimed seen recovered=false").count(), 3, "{events:#?}");
    assert_eq!(events.last().map(String::as_str), Some("finished seen Completed"), "{events:#?}");
    assert!(!events.iter().any(|e| e.starts_with("lost")), "{events:#?}");
}

#[test]
fn an_observer_is_told_of_a_recovery_and_of_a_lost_lease() {
    let (env, rt) = (Env::new(), runtime());
    let recorder = Arc::new(Recorder::default());
    let workflows = order_workflows(&env);
    let versions = workflows.versions();
    env.start_new("orphan", ORDER_SAGA, 1, order_input("o-orphan", json!({})));
    // A worker that crashed right after its claim: the lease (the shortest allowed) expires.
    let request = ClaimRequest { worker_id: "crashed".into(), workflows: versions, limit: 1, lease_ms: 100 };
    let claimed = env.writer.call_blocking(move |store, now| store.claim(&request, now)).expect("claim");
    assert_eq!(claimed.len(), 1);
    let w = Arc::new(
        Worker::new(env.writer.clone(), workflows, worker_options("w2"))
            .expect("worker")
            .with_observer(recorder.clone()),
    );
    settle(&rt, &w, &env, &["orphan"]);
    let events = recorder.take();
    assert_eq!(events.first().map(String::as_str), Some("claimed orphan recovered=true"), "{events:#?}");
    assert_eq!(events.last().map(String::as_str), Some("finished orphan Completed"), "{events:#?}");

    // An operator takes a run away mid-step: its worker's next write is fenced.
    let (entered_tx, entered) = mpsc::sync_channel(1);
    let (release_tx, release) = mpsc::sync_channel::<()>(1);
    let release = Arc::new(Mutex::new(release));
    let mut held = Workflows::new();
    held.register("held", 1, fast_options(), move |ctx, _| {
        let (entered_tx, release) = (entered_tx.clone(), release.clone());
        async move {
            ctx.step("hold", None, |_key| async move {
                let _ = entered_tx.send(());
                let _ = release.lock().unwrap().recv_timeout(SIGNAL_WAIT);
                Ok(1)
            })
            .await?;
            Ok(Value::Null)
        }
    })
    .unwrap();
    let w = Arc::new(
        Worker::new(env.writer.clone(), held, worker_options("w3")).expect("worker").with_observer(recorder.clone()),
    );
    env.start_new("held-1", "held", 1, json!({}));
    let running = w.clone();
    let handle = rt.spawn(async move { running.run_until_idle().await });
    entered.recv_timeout(SIGNAL_WAIT).expect("the run is in its step");
    env.writer.call_blocking(|store, now| store.abandon("held-1", "operator takes over", now)).expect("abandon");
    release_tx.send(()).unwrap();
    let report = rt.block_on(handle).unwrap().unwrap();
    assert_eq!(report.lost, 1, "{report:?}");
    let events = recorder.take();
    assert_eq!(events.iter().filter(|e| *e == "lost held-1").count(), 1, "{events:#?}");
    assert!(!events.iter().any(|e| e.starts_with("finished")), "{events:#?}");
}
