//! The engine's durable workflow runtime (`tidemark_engine::workflow`) on `PgWorkflows`, in
//! process against the real server: a saga whose transactional steps write the user's own table
//! in the journal's transaction (and compensate), a parent that takes journaled values
//! (`ctx.now()`, `ctx.uuid()`), writes a row and runs the saga as its child, and two workers with
//! two stores (two connections, as two processes have) sharing runs without running any twice.
//! Every wait is a bounded loop; no test asserts on wall-clock time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tidemark_core::workflow::{
    Backoff, RetryPolicy, RunDetail, RunRecord, RunStatus, StartOutcome, StartRequest, StepFailure, StepKind,
    StepStatus, WorkflowStore,
};
use tidemark_engine::workflow::tokio::runtime::{Builder, Runtime};
use tidemark_engine::workflow::{
    Saga, SagaAction, SagaData, Worker, WorkerOptions, WorkerReport, WorkflowOptions, Workflows, Writer,
};

use super::support::{test_db, TestDb};
use crate::{ApplyTransaction, PgWorkflows};

type Store = PgWorkflows;

/// Rounds of `run_until_idle` (with a short pause between) before a test gives up.
const ROUNDS_MAX: usize = 2_000;

fn runtime() -> Runtime {
    Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("tokio runtime")
}

fn fast_options() -> WorkflowOptions {
    WorkflowOptions {
        concurrency_max: None,
        retry: RetryPolicy {
            max_attempts: 3,
            backoff: Backoff::Schedule { delays_ms: vec![20] },
            attempt_timeout_ms: 30_000,
            jitter: false,
        },
    }
}

fn worker_options(id: &str, concurrency: usize) -> WorkerOptions {
    WorkerOptions { poll_interval_ms: 10, lease_ms: 10_000, concurrency, ..WorkerOptions::new(id) }
}

/// A fake payment service: charges by idempotency key (a second call with the same key returns
/// the first answer), refusing amounts over 1,000.
#[derive(Default)]
struct Payments {
    charges: Mutex<HashMap<String, i64>>,
    calls: Mutex<Vec<(String, String)>>,
}

impl Payments {
    fn charge(&self, key: &str, amount: i64) -> Result<Value, StepFailure> {
        self.calls.lock().unwrap().push(("charge".into(), key.into()));
        if amount > 1_000 {
            return Err(StepFailure::permanent(format!("card declined for {amount}")));
        }
        let mut charges = self.charges.lock().unwrap();
        charges.entry(key.to_string()).or_insert(amount);
        Ok(json!({"charged": amount}))
    }

    fn refund(&self, key: &str) -> Result<Value, StepFailure> {
        self.calls.lock().unwrap().push(("refund".into(), key.into()));
        Ok(json!({"refunded": true}))
    }
}

fn order_of(data: &SagaData) -> Result<(String, i64), StepFailure> {
    let id = data.input["order_id"].as_str().ok_or_else(|| StepFailure::permanent("no order_id"))?.to_string();
    Ok((id, data.input["amount"].as_i64().unwrap_or(0)))
}

/// A saga named `name`: reserve (a row in the user's `orders` table, transactional; compensated
/// by marking it released), then `charge` (external, with the idempotency key; compensated by a
/// refund through `payments`).
fn reserve_then_charge(name: &str, charge: SagaAction<ApplyTransaction>, payments: Arc<Payments>) -> Saga<Store> {
    Saga::new(name, 1)
        .step(
            "reserve",
            SagaAction::tx(|tx: &ApplyTransaction, data: &SagaData| {
                let (id, amount) = order_of(data)?;
                let insert =
                    format!("INSERT INTO \"{}\".orders (id, amount, state) VALUES ($1, $2, 'reserved')", tx.schema());
                tx.execute(&insert, &[&id, &amount])?;
                Ok(json!({"reserved": id}))
            }),
            Some(SagaAction::tx(|tx: &ApplyTransaction, data: &SagaData| {
                let (id, _) = order_of(data)?;
                let release = format!("UPDATE \"{}\".orders SET state = 'released' WHERE id = $1", tx.schema());
                tx.execute(&release, &[&id])?;
                Ok(json!({"released": id}))
            })),
        )
        .step(
            "charge",
            charge,
            Some(SagaAction::external(move |key, _data| {
                let payments = payments.clone();
                async move { payments.refund(&key) }
            })),
        )
}

/// The saga: [`reserve_then_charge`] with the charge answered by `payments`, then ship
/// (transactional).
fn order_saga(payments: Arc<Payments>) -> Saga<Store> {
    let charge = payments.clone();
    let charge = SagaAction::external(move |key, data| {
        let payments = charge.clone();
        async move { payments.charge(&key, order_of(&data)?.1) }
    });
    reserve_then_charge("pg_order", charge, payments).step(
        "ship",
        SagaAction::tx(|tx: &ApplyTransaction, data: &SagaData| {
            let (id, _) = order_of(data)?;
            let ship = format!("UPDATE \"{}\".orders SET state = 'shipped' WHERE id = $1", tx.schema());
            tx.execute(&ship, &[&id])?;
            Ok(json!({"shipped": id}))
        }),
        None,
    )
}

/// What each execution of `checkout` saw: (run id, now, uuid).
type Seen = Arc<Mutex<Vec<(String, i64, String)>>>;

/// The workflows: the saga, and `checkout`, which takes `now` and a `uuid`, records them in the
/// user's `audit` table (transactional), calls a step that fails once (so the run executes again
/// and replays the values), then runs the saga as its child.
fn workflows(payments: Arc<Payments>, seen: Seen) -> Workflows<Store> {
    let mut workflows = Workflows::new();
    order_saga(payments).register(&mut workflows, fast_options()).unwrap();
    let flaky = Arc::new(Mutex::new(HashMap::<String, u32>::new()));
    workflows
        .register("checkout", 1, fast_options(), move |ctx, input: Value| {
            let (seen, flaky) = (seen.clone(), flaky.clone());
            async move {
                let (now, uuid) = (ctx.now()?, ctx.uuid()?);
                let run_id = ctx.run_id().to_string();
                seen.lock().unwrap().push((run_id.clone(), now, uuid.clone()));
                let audited: Value = ctx
                    .tx_step("audit", None, {
                        let (run_id, uuid) = (run_id.clone(), uuid.clone());
                        move |tx: &ApplyTransaction| {
                            let insert = format!(
                                "INSERT INTO \"{}\".audit (run_id, token, at_ms) VALUES ($1, $2, $3)",
                                tx.schema()
                            );
                            tx.execute(&insert, &[&run_id, &uuid, &now])?;
                            Ok(json!({"audited": uuid}))
                        }
                    })
                    .await?;
                let _: Value = ctx
                    .step("flaky", None, move |_key| async move {
                        let mut counts = flaky.lock().unwrap();
                        let n = counts.entry(run_id).or_insert(0);
                        *n += 1;
                        if *n == 1 {
                            return Err(StepFailure::retryable("the first attempt fails"));
                        }
                        Ok(json!(null))
                    })
                    .await?;
                let order: Value = ctx.child("pg_order", &input).await?;
                Ok(json!({"now": now, "uuid": uuid, "audited": audited, "order": order}))
            }
        })
        .unwrap();
    workflows
}

/// A workflow schema with the user's tables, and a writer (store thread) on it.
struct Env {
    db: TestDb,
    schema: String,
    writer: Writer<Store>,
}

impl Env {
    fn new(db: TestDb) -> Env {
        let schema = db.schema("wf");
        let writer = Self::writer_on(&db, &schema);
        writer
            .call_blocking(|store, _| {
                let s = format!("\"{}\"", store.schema());
                store
                    .client()
                    .batch_execute(&format!(
                        "CREATE TABLE {s}.orders (id text PRIMARY KEY, amount bigint NOT NULL, state text NOT NULL);
                         CREATE TABLE {s}.audit (run_id text PRIMARY KEY, token text NOT NULL, at_ms bigint NOT NULL);
                         CREATE TABLE {s}.effects (run_id text PRIMARY KEY, worker text NOT NULL);"
                    ))
                    .map_err(tidemark_core::Error::from)
            })
            .expect("the user's tables");
        Env { db, schema, writer }
    }

    /// Another writer thread with its own store (connection) on the same schema: another worker
    /// process.
    fn writer_on(db: &TestDb, schema: &str) -> Writer<Store> {
        let (conn, schema) = (db.conn.clone(), schema.to_string());
        Writer::spawn(move || PgWorkflows::init(&conn, &schema)).expect("open the workflow store")
    }

    fn start(&self, run_id: &str, workflow: &str, input: Value) {
        let request = StartRequest::new(run_id, workflow, 1, input);
        let outcome = self.writer.call_blocking(move |store, now| store.start_runs(&[request], now)).unwrap().remove(0);
        assert_eq!(outcome, StartOutcome::Started { run_id: run_id.into() });
    }

    fn detail(&self, run_id: &str) -> RunDetail {
        let id = run_id.to_string();
        self.writer.call_blocking(move |store, _| store.run(&id)).unwrap().expect("run exists")
    }

    fn rows(&self, query: &str) -> Vec<postgres::Row> {
        self.db.client().query(&crate::schema::sql(&self.schema, query), &[]).unwrap()
    }
}

/// Run the workers until nothing is due, again and again, until every run satisfies `done`.
fn drive(rt: &Runtime, workers: &[Arc<Worker<Store>>], env: &Env, run_ids: &[&str]) -> WorkerReport {
    let done = |run: &RunRecord| run.status.is_terminal();
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
    panic!("runs did not finish in {ROUNDS_MAX} rounds: {states:#?}");
}

#[test]
fn a_parent_with_journaled_values_and_a_saga_child_runs_on_postgres() {
    let env = Env::new(test_db!("rt_checkout"));
    let rt = runtime();
    let (payments, seen) = (Arc::new(Payments::default()), Seen::default());
    let worker = Arc::new(
        Worker::new(env.writer.clone(), workflows(payments.clone(), seen.clone()), worker_options("w1", 8)).unwrap(),
    );
    env.start("c1", "checkout", json!({"order_id": "o-1", "amount": 300}));
    env.start("c2", "checkout", json!({"order_id": "o-2", "amount": 5_000}));
    drive(&rt, &[worker], &env, &["c1", "c2", "c1.4", "c2.4"]);

    // c1: completed, its child saga completed, every row written once.
    let c1 = env.detail("c1");
    assert_eq!(c1.run.status, RunStatus::Completed, "{:?}", c1.run.error);
    let kinds: Vec<StepKind> = c1.journal.iter().map(|e| e.kind).collect();
    assert_eq!(kinds, [StepKind::Value, StepKind::Value, StepKind::Transactional, StepKind::External, StepKind::Child]);
    let seen_c1: Vec<(i64, String)> =
        seen.lock().unwrap().iter().filter(|(run, _, _)| run == "c1").map(|(_, n, u)| (*n, u.clone())).collect();
    // Executed twice (the failed step, then to the end: its child was leased to the same worker
    // as it started and ran while the parent waited with its lease), the second time with the
    // values journaled by the first.
    assert_eq!(seen_c1.len(), 2, "{seen_c1:?}");
    assert!(seen_c1.windows(2).all(|w| w[0] == w[1]), "{seen_c1:?}");
    let (now, uuid) = seen_c1[0].clone();
    assert_eq!((c1.journal[0].output.clone(), c1.journal[1].output.clone()), (Some(json!(now)), Some(json!(uuid))));
    assert_eq!(uuid::Uuid::parse_str(&uuid).map(|u| u.get_version_num()).ok(), Some(4), "{uuid}");
    let result = c1.run.result.clone().unwrap();
    assert_eq!((result["now"].clone(), result["uuid"].clone()), (json!(now), json!(uuid)));
    assert_eq!(result["order"]["ship"], json!({"shipped": "o-1"}));
    let child = env.detail("c1.4");
    assert_eq!((child.run.status, child.run.parent_run_id.as_deref()), (RunStatus::Completed, Some("c1")));
    // The child's last transaction settled the entry of its parent waiting in memory: no event.
    assert!(c1.events.is_empty(), "{:?}", c1.events);
    let end = c1.journal[4].output.clone().expect("the child's end");
    assert_eq!((end["run_id"].clone(), end["status"].clone()), (json!("c1.4"), json!("completed")));
    let audit = env.rows("SELECT run_id, token, at_ms FROM {s}.audit ORDER BY run_id");
    assert_eq!(audit.len(), 2, "one audit row per run, although each executed twice");
    assert_eq!((audit[0].get::<_, String>(1), audit[0].get::<_, i64>(2)), (uuid, now));

    // c2: the charge was declined, so its child compensated (the reservation released in the
    // same transaction as the compensation's journal entry) and the parent failed with it.
    let c2 = env.detail("c2");
    assert_eq!(c2.run.status, RunStatus::Failed, "{:?}", c2.run.error);
    assert!(c2.run.error.as_deref().unwrap_or("").contains("declined"), "{:?}", c2.run.error);
    let saga = env.detail("c2.4");
    assert_eq!(saga.run.status, RunStatus::Compensated);
    let names: Vec<&str> = saga.journal.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["reserve", "charge", "compensate:reserve"]);
    assert_eq!(saga.journal[1].status, StepStatus::Failed);
    let orders = env.rows("SELECT id, state FROM {s}.orders ORDER BY id");
    let orders: Vec<(String, String)> = orders.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(orders, [("o-1".to_string(), "shipped".to_string()), ("o-2".to_string(), "released".to_string())]);
    // One successful charge with c1's saga's key; the declined one was never retried.
    let calls = payments.calls.lock().unwrap().clone();
    assert_eq!(calls.iter().filter(|(op, _)| op == "charge").count(), 2, "{calls:?}");
    assert!(calls.iter().all(|(op, _)| op != "refund"), "nothing was charged for o-2: {calls:?}");
}

/// Two workers, each with its own writer thread and store (two connections, as two processes
/// have), share 40 runs: both work, every run completes, each run's external step ran once and
/// its transactional effect row was written once, and nobody took a run over (no lease expired).
#[test]
fn two_workers_on_two_connections_share_the_runs_and_run_none_twice() {
    let env = Env::new(test_db!("rt_two"));
    let rt = runtime();
    let executions: Arc<Mutex<HashMap<String, Vec<String>>>> = Arc::default();
    let make = |worker_id: &str, writer: Writer<Store>| {
        let mut workflows: Workflows<Store> = Workflows::new();
        let (executions, me) = (executions.clone(), worker_id.to_string());
        workflows
            .register("job", 1, fast_options(), move |ctx, _input: Value| {
                let (executions, me) = (executions.clone(), me.clone());
                async move {
                    let run_id = ctx.run_id().to_string();
                    let _: Value = ctx
                        .step("work", None, {
                            let (run_id, me) = (run_id.clone(), me.clone());
                            move |_key| async move {
                                executions.lock().unwrap().entry(run_id).or_default().push(me);
                                tokio_sleep(Duration::from_millis(15)).await;
                                Ok(json!(null))
                            }
                        })
                        .await?;
                    let _: Value = ctx
                        .tx_step("effect", None, move |tx: &ApplyTransaction| {
                            let insert =
                                format!("INSERT INTO \"{}\".effects (run_id, worker) VALUES ($1, $2)", tx.schema());
                            tx.execute(&insert, &[&run_id, &me])?;
                            Ok(json!(null))
                        })
                        .await?;
                    Ok(json!("done"))
                }
            })
            .unwrap();
        Arc::new(Worker::new(writer, workflows, worker_options(worker_id, 4)).unwrap())
    };
    let second_writer = Env::writer_on(&env.db, &env.schema);
    let workers = [make("wa", env.writer.clone()), make("wb", second_writer)];
    let ids: Vec<String> = (0..40).map(|i| format!("job-{i:02}")).collect();
    for id in &ids {
        env.start(id, "job", json!({}));
    }
    let id_refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let report = drive(&rt, &workers, &env, &id_refs);
    assert_eq!((report.completed, report.recovered, report.lost), (40, 0, 0), "{report:?}");
    let executions = executions.lock().unwrap().clone();
    assert_eq!(executions.len(), 40);
    assert!(executions.values().all(|by| by.len() == 1), "a run's step ran twice: {executions:?}");
    let effects = env.rows("SELECT worker, count(*) FROM {s}.effects GROUP BY worker ORDER BY worker");
    let by_worker: Vec<(String, i64)> = effects.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(by_worker.iter().map(|(_, n)| n).sum::<i64>(), 40);
    assert_eq!(by_worker.len(), 2, "both workers ran some: {by_worker:?}");
    for id in &ids {
        assert_eq!(env.detail(id).run.status, RunStatus::Completed);
    }
}

async fn tokio_sleep(duration: Duration) {
    tidemark_engine::workflow::tokio::time::sleep(duration).await;
}

/// A queue with room for two, ten runs in it, two workers with their own connections: every run
/// completes, and never more than two are inside their step at once (without the queue, the same
/// workers run more at once).
#[test]
fn a_queues_concurrency_limit_holds_across_two_workers_on_their_own_connections() {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use tidemark_core::queue::{QueueSpec, QueueStore};
    let env = Env::new(test_db!("rt_queue"));
    let rt = runtime();
    env.writer.call_blocking(|store, now| store.put_queue(&QueueSpec::new("narrow").concurrency(2), now)).unwrap();
    // (runs inside their step now, the most inside at once)
    type Inside = Arc<(AtomicUsize, AtomicUsize)>;
    let make = |worker_id: &str, writer: Writer<Store>, inside: Inside| {
        let mut workflows: Workflows<Store> = Workflows::new();
        workflows
            .register("hold", 1, fast_options(), move |ctx, _input: Value| {
                let inside = inside.clone();
                async move {
                    let _: Value = ctx
                        .step("hold", None, move |_key| async move {
                            let n = inside.0.fetch_add(1, SeqCst) + 1;
                            inside.1.fetch_max(n, SeqCst);
                            tokio_sleep(Duration::from_millis(30)).await;
                            inside.0.fetch_sub(1, SeqCst);
                            Ok(json!(null))
                        })
                        .await?;
                    Ok(json!(null))
                }
            })
            .unwrap();
        Arc::new(Worker::new(writer, workflows, worker_options(worker_id, 8)).unwrap())
    };
    let (queued, free): (Inside, Inside) = Default::default();
    let second = Env::writer_on(&env.db, &env.schema);
    let workers = [make("wa", env.writer.clone(), queued.clone()), make("wb", second.clone(), queued.clone())];
    let ids: Vec<String> = (0..10).map(|i| format!("q{i}")).collect();
    let requests: Vec<StartRequest> =
        ids.iter().map(|id| StartRequest::new(id, "hold", 1, json!({})).in_queue("narrow", 0, None)).collect();
    env.writer.call_blocking(move |store, now| store.start_runs(&requests, now)).unwrap();
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let report = drive(&rt, &workers, &env, &refs);
    assert_eq!(report.completed, 10, "{report:?}");
    let most = queued.1.load(SeqCst);
    assert!((1..=2).contains(&most), "at most 2 runs of the queue at once, saw {most}");
    // The control: the same runs without the queue go wider on the same two workers.
    let control: Vec<String> = (0..10).map(|i| format!("c{i}")).collect();
    for id in &control {
        env.start(id, "hold", json!({}));
    }
    let workers = [make("wc", env.writer.clone(), free.clone()), make("wd", second, free.clone())];
    let refs: Vec<&str> = control.iter().map(String::as_str).collect();
    drive(&rt, &workers, &env, &refs);
    assert!(free.1.load(SeqCst) > 2, "without the queue more run at once: {}", free.1.load(SeqCst));
    let state = env.writer.call_blocking(|store, now| store.queue("narrow", 10, now)).unwrap().unwrap();
    assert_eq!((state.in_progress, state.waiting), (0, 0), "{state:?}");
}

/// Messages between runs under the runtime: `ponger` waits for a `ping` (ctx.recv), `pinger`
/// publishes its progress (ctx.set_event) and sends the ping (ctx.send) to it; the ping arrives
/// once, the published value is read from outside (RunHandle::get_event).
#[test]
fn runs_message_each_other_and_publish_values_on_postgres() {
    use tidemark_engine::workflow::RunHandle;
    let env = Env::new(test_db!("rt_messages"));
    let rt = runtime();
    let mut workflows: Workflows<Store> = Workflows::new();
    workflows
        .register("ponger", 1, fast_options(), |ctx, _input: Value| async move {
            let got = ctx.recv("ping", Duration::from_secs(3_600)).await?;
            Ok(json!({"got": got}))
        })
        .unwrap();
    workflows
        .register("pinger", 1, fast_options(), |ctx, input: Value| async move {
            ctx.set_event("progress", &json!({"step": "sending"})).await?;
            let to = input["to"].as_str().unwrap_or_default().to_string();
            ctx.send(&to, "ping", &json!({"from": ctx.run_id()})).await?;
            ctx.set_event("progress", &json!({"step": "sent"})).await?;
            Ok(json!("sent"))
        })
        .unwrap();
    let worker = Arc::new(Worker::new(env.writer.clone(), workflows, worker_options("w1", 4)).unwrap());
    env.start("pong", "ponger", json!({}));
    drive(&rt, std::slice::from_ref(&worker), &env, &[]);
    env.start("ping", "pinger", json!({"to": "pong"}));
    drive(&rt, std::slice::from_ref(&worker), &env, &["ping", "pong"]);
    assert_eq!(env.detail("pong").run.result, Some(json!({"got": {"from": "ping"}})));
    assert_eq!(env.detail("pong").events.len(), 1, "the ping arrived once");
    let published: Option<Value> =
        rt.block_on(RunHandle::new(worker, "ping").get_event("progress", Duration::from_secs(5))).unwrap();
    assert_eq!(published, Some(json!({"step": "sent"})));
}

/// A saga whose external step failed at its last attempt compensates that step too on
/// PostgreSQL: each attempt charges and times out before answering (its answer lost), the second
/// is the last, and the refund runs before the reservation's release.
#[test]
fn an_external_step_out_of_attempts_is_compensated_on_postgres() {
    let env = Env::new(test_db!("rt_out_of_attempts"));
    let rt = runtime();
    let payments = Arc::new(Payments::default());
    let charging = payments.clone();
    let charge = SagaAction::external(move |key, data| {
        let payments = charging.clone();
        async move {
            payments.charge(&key, order_of(&data)?.1)?;
            // The answer never comes back within the attempt timeout.
            tidemark_engine::workflow::tokio::time::sleep(Duration::from_secs(60)).await;
            Ok(json!({"charged": "too late"}))
        }
    });
    let policy = RetryPolicy {
        max_attempts: 2,
        backoff: Backoff::Schedule { delays_ms: vec![20] },
        attempt_timeout_ms: 100,
        jitter: false,
    };
    let mut workflows = Workflows::new();
    reserve_then_charge("pg_lost", charge, payments.clone())
        .register(&mut workflows, WorkflowOptions { concurrency_max: None, retry: policy })
        .unwrap();
    let worker = Arc::new(Worker::new(env.writer.clone(), workflows, worker_options("w1", 8)).unwrap());
    env.start("lost", "pg_lost", json!({"order_id": "o-lost", "amount": 300}));
    drive(&rt, &[worker], &env, &["lost"]);
    let d = env.detail("lost");
    assert_eq!(d.run.status, RunStatus::Compensated, "{:?}", d.run.error);
    let names: Vec<&str> = d.journal.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(
        names,
        ["reserve", "charge", "patch:saga-compensates-out-of-attempts", "compensate:charge", "compensate:reserve"]
    );
    assert!(d.journal[1].error.as_deref().unwrap_or_default().contains("timed out"), "{:?}", d.journal[1]);
    let calls: Vec<String> = payments.calls.lock().unwrap().iter().map(|(op, _)| op.clone()).collect();
    assert_eq!(calls, ["charge", "charge", "refund"], "the charge whose answer was lost was refunded");
    let state: String = env.rows("SELECT state FROM {s}.orders WHERE id = 'o-lost'")[0].get(0);
    assert_eq!(state, "released");
}

/// A cancel that stops a saga at its external step compensates that step too on PostgreSQL: the
/// charge's first attempt fails (its retry a minute away), the payment service charges on a
/// second attempt that no journal write recorded (a worker that died before it), the run is
/// cancelled, and the refund runs before the reservation's release.
#[test]
fn a_cancel_at_an_external_step_compensates_it_on_postgres() {
    let env = Env::new(test_db!("rt_cancel_cut"));
    let rt = runtime();
    let payments = Arc::new(Payments::default());
    let attempts = Arc::new(Mutex::new(0_u32));
    let (charge, refund, tries) = (payments.clone(), payments.clone(), attempts.clone());
    let minute = RetryPolicy {
        max_attempts: 3,
        backoff: Backoff::Schedule { delays_ms: vec![60_000] },
        attempt_timeout_ms: 30_000,
        jitter: false,
    };
    let charge = SagaAction::external(move |key, data| {
        let (payments, tries) = (charge.clone(), tries.clone());
        async move {
            *tries.lock().unwrap() += 1;
            if *tries.lock().unwrap() == 1 {
                return Err(StepFailure::retryable("the payment service is unavailable"));
            }
            payments.charge(&key, order_of(&data)?.1)
        }
    });
    let mut workflows = Workflows::new();
    reserve_then_charge("pg_cut", charge, refund)
        .register(&mut workflows, WorkflowOptions { concurrency_max: None, retry: minute })
        .unwrap();
    let worker = Arc::new(Worker::new(env.writer.clone(), workflows, worker_options("w1", 8)).unwrap());
    env.start("cut", "pg_cut", json!({"order_id": "o-cut", "amount": 300}));
    rt.block_on(worker.run_until_idle()).unwrap();
    let before = env.detail("cut");
    assert_eq!(before.run.status, RunStatus::Pending, "{:?}", before.run.error);
    assert_eq!(before.journal[1].status, StepStatus::Retrying, "{:?}", before.journal);
    // The second attempt, charged by a worker that died before its journal write.
    payments.charge("cut:1:charge", 300).unwrap();
    env.writer.call_blocking(|store, now| store.cancel("cut", "customer changed their mind", now)).unwrap();
    drive(&rt, &[worker], &env, &["cut"]);
    let d = env.detail("cut");
    assert_eq!(d.run.status, RunStatus::Cancelled, "{:?}", d.run.error);
    let names: Vec<&str> = d.journal.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["reserve", "charge", "compensate:charge", "compensate:reserve"]);
    let calls: Vec<String> = payments.calls.lock().unwrap().iter().map(|(op, _)| op.clone()).collect();
    assert_eq!(calls, ["charge", "refund"], "the lost charge was refunded");
    let state: String = env.rows("SELECT state FROM {s}.orders WHERE id = 'o-cut'")[0].get(0);
    assert_eq!(state, "released");
}
