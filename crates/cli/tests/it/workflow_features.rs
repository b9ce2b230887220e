//! Workflow features on the real SQLite workflow store, in process: deterministic values replayed
//! across executions, child workflows (started once, awaited durably, in parallel, failing,
//! cancelled with their parent, of an unknown workflow), and awaiting a run's result through its
//! handle. Every wait is bounded; no test asserts on wall-clock time. (The same features across a
//! killed worker process: `crash.rs`, `order_batch`.)

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tidemark_core::queue::{queue_codes, QueueSpec, QueueState, QueueStore};
use tidemark_core::schedule::{
    schedule_codes, CatchUp, Fired, Schedule, ScheduleSpec, ScheduleStore, TickReport, Timing,
};
use tidemark_core::workflow::{
    child_run_id, workflow_codes, RunFilter, RunStatus, StepFailure, StepKind, StepStatus, WorkflowStore,
};
use tidemark_engine::workflow::{RunHandle, WorkflowError, Workflows};

use crate::workflow_runtime::{
    drive, fast_options, names, runtime, settle, statuses, worker, worker_options, Env, Store,
};

/// What each execution of `stamped` saw: (now, random, uuid).
type Seen = Arc<Mutex<Vec<(i64, u64, String)>>>;

/// `stamped` takes the three deterministic values, then a step that fails once (the run suspends
/// and executes again); `double` doubles its input; `parent` runs `double` as a child (and a step
/// after it that fails once); `pair` runs two children at once; `failing` fails; `waits` waits an
/// hour for an event; `orphan` starts a child of a workflow nobody registered.
fn feature_workflows(seen: Seen) -> Workflows<Store> {
    let mut workflows = Workflows::new();
    let attempts = Arc::new(Mutex::new(0u32));
    workflows
        .register("stamped", 1, fast_options(), move |ctx, _input: Value| {
            let (seen, attempts) = (seen.clone(), attempts.clone());
            async move {
                let (now, random, uuid) = (ctx.now()?, ctx.random()?, ctx.uuid()?);
                seen.lock().unwrap().push((now, random, uuid.clone()));
                let _: Value = ctx
                    .step("flaky", None, move |_key| async move {
                        let mut n = attempts.lock().unwrap();
                        *n += 1;
                        if *n == 1 {
                            return Err(StepFailure::retryable("first attempt fails"));
                        }
                        Ok(json!(null))
                    })
                    .await?;
                Ok(json!({"now": now, "random": random, "uuid": uuid}))
            }
        })
        .unwrap();
    workflows
        .register("double", 1, fast_options(), |_ctx, input: Value| async move {
            Ok(json!({"y": input["x"].as_i64().unwrap_or(0) * 2}))
        })
        .unwrap();
    let after = Arc::new(Mutex::new(0u32));
    workflows
        .register("parent", 1, fast_options(), move |ctx, input: Value| {
            let after = after.clone();
            async move {
                let doubled: Value = ctx.child("double", &json!({"x": input["x"]})).await?;
                let _: Value = ctx
                    .step("after_child", None, move |_key| async move {
                        let mut n = after.lock().unwrap();
                        *n += 1;
                        if *n == 1 {
                            return Err(StepFailure::retryable("fails once, so the parent executes again"));
                        }
                        Ok(json!(null))
                    })
                    .await?;
                Ok(doubled)
            }
        })
        .unwrap();
    workflows
        .register("pair", 1, fast_options(), |ctx, _input: Value| async move {
            let (one, two) = (json!({"x": 1}), json!({"x": 2}));
            let (a, b) = tokio::join!(ctx.child::<_, Value>("double", &one), ctx.child::<_, Value>("double", &two));
            Ok(json!([a?, b?]))
        })
        .unwrap();
    workflows
        .register("failing", 1, fast_options(), |_ctx, _input: Value| async move {
            Err::<Value, _>(WorkflowError::failed("the child gives up"))
        })
        .unwrap();
    workflows
        .register("calls_failing", 1, fast_options(), |ctx, _input: Value| async move {
            match ctx.child::<_, Value>("failing", &json!({})).await {
                Err(WorkflowError::StepFailed { step, message, .. }) => Ok(json!({"step": step, "message": message})),
                other => Ok(json!({"unexpected": format!("{other:?}")})),
            }
        })
        .unwrap();
    register_waiting(&mut workflows);
    workflows
        .register("orphan", 1, fast_options(), |ctx, _input: Value| async move {
            let end: Value = ctx.child("nobody_registered_this", &json!({})).await?;
            Ok(end)
        })
        .unwrap();
    workflows
}

/// `waits` waits an hour for an event; `waits_for_child` runs `waits` as a child.
pub(crate) fn register_waiting(workflows: &mut Workflows<Store>) {
    workflows
        .register("waits", 1, fast_options(), |ctx, _input: Value| async move {
            let got = ctx.wait_for_event("never", Duration::from_secs(3_600)).await?;
            Ok(json!({"got": got}))
        })
        .unwrap();
    workflows
        .register("waits_for_child", 1, fast_options(), |ctx, _input: Value| async move {
            let end: Value = ctx.child("waits", &json!({})).await?;
            Ok(end)
        })
        .unwrap();
}

fn all_runs(env: &Env) -> Vec<tidemark_core::workflow::RunRecord> {
    env.writer.call_blocking(|store, _| store.list_runs(&RunFilter::default(), 1_000)).expect("list runs")
}

#[test]
fn deterministic_values_are_journaled_once_and_replayed_by_the_next_execution() {
    let (env, rt) = (Env::new(), runtime());
    let seen: Seen = Arc::default();
    let w = worker(&env.writer, feature_workflows(seen.clone()), worker_options("w1"));
    env.start_new("s1", "stamped", 1, json!({}));
    settle(&rt, &w, &env, &["s1"]);

    let d = env.detail("s1");
    assert_eq!(d.run.status, RunStatus::Completed, "{:?}", d.run.error);
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "the failed step made the run execute twice: {seen:?}");
    assert_eq!(seen[0], seen[1], "the second execution replayed the values of the first");
    let (now, random, uuid) = seen[0].clone();
    assert_eq!(d.run.result, Some(json!({"now": now, "random": random, "uuid": uuid})));
    assert_eq!(names(&d), ["now", "random", "uuid", "flaky"]);
    let kinds: Vec<StepKind> = d.journal.iter().map(|e| e.kind).collect();
    assert_eq!(kinds, [StepKind::Value, StepKind::Value, StepKind::Value, StepKind::External]);
    assert_eq!(d.journal[0].output, Some(json!(now)));
    assert_eq!(d.journal[1].output, Some(json!(random)));
    assert_eq!(d.journal[2].output, Some(json!(uuid)));
    assert_eq!(uuid::Uuid::parse_str(&uuid).map(|u| u.get_version_num()).ok(), Some(4), "{uuid}");
}

#[test]
fn a_child_is_started_once_awaited_durably_and_its_output_returned() {
    let (env, rt) = (Env::new(), runtime());
    let w = worker(&env.writer, feature_workflows(Arc::default()), worker_options("w1"));
    env.start_new("p1", "parent", 1, json!({"x": 21}));
    settle(&rt, &w, &env, &["p1"]);

    let parent = env.detail("p1");
    assert_eq!(parent.run.status, RunStatus::Completed, "{:?}", parent.run.error);
    assert_eq!(parent.run.result, Some(json!({"y": 42})));
    assert_eq!(names(&parent), ["double", "after_child"]);
    assert_eq!(parent.journal[0].kind, StepKind::Child);
    assert_eq!(statuses(&parent), [StepStatus::Completed, StepStatus::Completed]);
    let child_id = child_run_id("p1", 0);
    assert_eq!(child_id, "p1.0");
    let child = env.detail(&child_id);
    assert_eq!(child.run.status, RunStatus::Completed);
    assert_eq!(child.run.parent_run_id.as_deref(), Some("p1"));
    assert_eq!(child.run.input, json!({"x": 21}));
    // The parent executed again after its failed step (replaying the child's entry): still one
    // child.
    let ids: Vec<String> = all_runs(&env).into_iter().map(|r| r.run_id).collect();
    assert_eq!(ids, ["p1", "p1.0"]);
    // The child ran on the parent's worker while the parent waited in memory: its last
    // transaction settled the parent's entry with its end (no end event).
    assert!(parent.events.is_empty(), "{:?}", parent.events);
    let end = parent.journal[0].output.clone().expect("the child's end");
    assert_eq!((end["run_id"].clone(), end["status"].clone()), (json!("p1.0"), json!("completed")));
}

#[test]
fn children_awaited_together_each_wake_the_parent() {
    let (env, rt) = (Env::new(), runtime());
    let w = worker(&env.writer, feature_workflows(Arc::default()), worker_options("w1"));
    env.start_new("pair-1", "pair", 1, json!({}));
    settle(&rt, &w, &env, &["pair-1"]);
    let d = env.detail("pair-1");
    assert_eq!(d.run.status, RunStatus::Completed, "{:?}", d.run.error);
    assert_eq!(d.run.result, Some(json!([{"y": 2}, {"y": 4}])));
    assert_eq!(names(&d), ["double", "double"]);
    assert_eq!(env.detail("pair-1.0").run.input, json!({"x": 1}));
    assert_eq!(env.detail("pair-1.1").run.input, json!({"x": 2}));
}

/// `chain` runs `double` three times as a child, one after the other, counting its own
/// executions; `limited_chain` does the same with `limited_double`, whose type has a global
/// limit (`concurrency_max`).
fn chain_workflows(executions: Arc<Mutex<u32>>) -> Workflows<Store> {
    let mut workflows = feature_workflows(Arc::default());
    let limited = tidemark_engine::workflow::WorkflowOptions { concurrency_max: Some(8), ..fast_options() };
    workflows
        .register("limited_double", 1, limited, |_ctx, input: Value| async move {
            Ok(json!({"y": input["x"].as_i64().unwrap_or(0) * 2}))
        })
        .unwrap();
    for (name, child) in [("chain", "double"), ("limited_chain", "limited_double")] {
        let executions = executions.clone();
        workflows
            .register(name, 1, fast_options(), move |ctx, _input: Value| {
                let executions = executions.clone();
                async move {
                    *executions.lock().unwrap() += 1;
                    let mut ys = Vec::new();
                    for x in 1..=3 {
                        let end: Value = ctx.child(child, &json!({"x": x})).await?;
                        ys.push(end["y"].clone());
                    }
                    Ok(json!(ys))
                }
            })
            .unwrap();
    }
    workflows
}

#[test]
fn a_parent_waits_in_memory_for_children_leased_to_its_worker_and_executes_once() {
    let (env, rt) = (Env::new(), runtime());
    let executions = Arc::new(Mutex::new(0u32));
    let w = worker(&env.writer, chain_workflows(executions.clone()), worker_options("w1"));
    env.start_new("c1", "chain", 1, json!({}));
    let report = settle(&rt, &w, &env, &["c1"]);
    let d = env.detail("c1");
    assert_eq!(d.run.status, RunStatus::Completed, "{:?}", d.run.error);
    assert_eq!(d.run.result, Some(json!([2, 4, 6])));
    // Each child was leased to the worker as it started and ran in the parent's slot while the
    // parent waited with its lease: one execution of the parent, no suspension of anything.
    assert_eq!(*executions.lock().unwrap(), 1, "the parent never suspended for a child");
    assert_eq!((report.suspended, report.completed, report.recovered), (0, 4, 0), "{report:?}");
    assert_eq!(names(&d), ["double", "double", "double"]);
    for (seq, entry) in d.journal.iter().enumerate() {
        // The child's end, consumed by its step as in any wait for a child.
        let child = format!("c1.{seq}");
        assert_eq!(entry.status, StepStatus::Completed, "{entry:?}");
        assert_eq!(entry.output.as_ref().map(|o| o["run_id"].clone()), Some(json!(child)));
        let c = env.detail(&child).run;
        assert_eq!((c.status, c.parent_run_id.as_deref()), (RunStatus::Completed, Some("c1")));
    }
    assert!(d.events.iter().all(|e| e.consumed_by_seq.is_some()), "{:?}", d.events);

    // A child whose type has a global limit is claimed within that budget, as any run: its
    // parent waits in the store and executes again for each child.
    *executions.lock().unwrap() = 0;
    env.start_new("c2", "limited_chain", 1, json!({}));
    let report = settle(&rt, &w, &env, &["c2"]);
    assert_eq!(env.detail("c2").run.result, Some(json!([2, 4, 6])));
    assert_eq!(*executions.lock().unwrap(), 4, "once, then once per child's end");
    assert!(report.suspended >= 3, "{report:?}");
}

#[test]
fn a_parent_cancelled_while_it_waits_in_memory_for_a_running_child_ends_without_waiting_for_it() {
    let (env, rt) = (Env::new(), runtime());
    let release = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workflows = feature_workflows(Arc::default());
    let held = release.clone();
    // `slow`'s one step holds until the test releases it (at most 20 s).
    workflows
        .register("slow", 1, fast_options(), move |ctx, _input: Value| {
            let held = held.clone();
            async move {
                let _: Value = ctx
                    .step("hold", None, move |_key| async move {
                        for _ in 0..2_000 {
                            if held.load(std::sync::atomic::Ordering::SeqCst) {
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                        Ok(json!("held"))
                    })
                    .await?;
                Ok(json!(null))
            }
        })
        .unwrap();
    workflows
        .register("waits_on_slow", 1, fast_options(), |ctx, _input: Value| async move {
            let end: Value = ctx.child("slow", &json!({})).await?;
            Ok(end)
        })
        .unwrap();
    // A short lease: heartbeats (which bring the cancel request) every 100 ms.
    let options = tidemark_engine::workflow::WorkerOptions { lease_ms: 300, ..worker_options("w1") };
    let w = worker(&env.writer, workflows, options);
    env.start_new("ws", "waits_on_slow", 1, json!({}));
    let running = {
        let w = w.clone();
        rt.spawn(async move { w.run_until_idle().await })
    };
    let until = |what: &str, done: &dyn Fn() -> bool| {
        for _ in 0..2_000 {
            if done() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("{what} did not happen in 20 s");
    };
    until("the child's start", &|| env.writer.call_blocking(|s, _| s.run("ws.0")).unwrap().is_some());
    env.writer.call_blocking(|s, now| s.cancel("ws", "the customer gave up", now)).unwrap();
    // The parent ends while its child is still inside its step: it did not wait for it.
    until("the parent's end", &|| env.detail("ws").run.status.is_terminal());
    assert!(!release.load(std::sync::atomic::Ordering::SeqCst));
    let parent = env.detail("ws").run;
    assert_eq!(parent.status, RunStatus::Cancelled, "{:?}", parent.error);
    assert_eq!(parent.error.as_deref(), Some("cancel requested: the customer gave up"));
    // Its end asked the child to cancel; the child ends once its step lets it.
    assert!(env.detail("ws.0").run.cancel_requested);
    release.store(true, std::sync::atomic::Ordering::SeqCst);
    rt.block_on(running).expect("worker task").expect("worker");
    let child = env.detail("ws.0").run;
    assert!(child.status.is_terminal(), "{child:?}");
    assert_eq!(env.detail("ws").run.status, RunStatus::Cancelled);
}

#[test]
fn a_failed_child_is_a_step_failure_of_its_parent() {
    let (env, rt) = (Env::new(), runtime());
    let w = worker(&env.writer, feature_workflows(Arc::default()), worker_options("w1"));
    env.start_new("cf", "calls_failing", 1, json!({}));
    settle(&rt, &w, &env, &["cf"]);
    let d = env.detail("cf");
    assert_eq!(d.run.status, RunStatus::Completed, "{:?}", d.run.error);
    let result = d.run.result.unwrap();
    assert_eq!(result["step"], "failing");
    let message = result["message"].as_str().unwrap();
    assert!(message.contains("child run cf.0 ended failed") && message.contains("the child gives up"), "{message}");
    assert_eq!(env.detail("cf.0").run.status, RunStatus::Failed);
}

#[test]
fn cancelling_a_parent_cancels_the_child_it_waits_for() {
    let (env, rt) = (Env::new(), runtime());
    let w = worker(&env.writer, feature_workflows(Arc::default()), worker_options("w1"));
    env.start_new("wp", "waits_for_child", 1, json!({}));
    drive(&rt, &w, &env, &["wp", "wp.0"], |run| run.status == RunStatus::Waiting);
    assert_eq!(env.detail("wp").run.waiting_for.as_deref(), Some("child/0"));
    env.cancel("wp", "the customer left");
    settle(&rt, &w, &env, &["wp", "wp.0"]);
    let (parent, child) = (env.detail("wp").run, env.detail("wp.0").run);
    assert_eq!(parent.status, RunStatus::Cancelled, "{:?}", parent.error);
    assert_eq!(child.status, RunStatus::Cancelled, "{:?}", child.error);
    assert!(child.error.as_deref().unwrap_or("").contains("its parent run ended"), "{:?}", child.error);
}

#[test]
fn a_child_of_an_unknown_workflow_fails_its_parent_and_writes_no_child() {
    let (env, rt) = (Env::new(), runtime());
    let w = worker(&env.writer, feature_workflows(Arc::default()), worker_options("w1"));
    env.start_new("o1", "orphan", 1, json!({}));
    settle(&rt, &w, &env, &["o1"]);
    let d = env.detail("o1");
    assert_eq!(d.run.status, RunStatus::Failed);
    let error = d.run.error.unwrap();
    assert!(error.starts_with(workflow_codes::UNKNOWN_WORKFLOW), "{error}");
    assert!(d.journal.is_empty(), "{:?}", d.journal);
    assert_eq!(all_runs(&env).len(), 1);
}

#[test]
fn a_handle_awaits_the_result_the_terminal_error_or_times_out() {
    let (env, rt) = (Env::new(), runtime());
    let w = worker(&env.writer, feature_workflows(Arc::default()), worker_options("w1"));
    let (stop, stopped) = tidemark_engine::workflow::tokio::sync::oneshot::channel::<()>();
    let looping = {
        let w = w.clone();
        rt.spawn(async move { w.run_until(async { drop(stopped.await) }).await })
    };
    env.start_new("p2", "parent", 1, json!({"x": 5}));
    env.start_new("f2", "failing", 1, json!({}));
    env.start_new("w2", "waits", 1, json!({}));
    rt.block_on(async {
        let bound = Duration::from_secs(60);
        let doubled: Value = RunHandle::new(w.clone(), "p2").result_within(bound).await.expect("p2's result");
        assert_eq!(doubled, json!({"y": 10}));

        let typed = RunHandle::new(w.clone(), "p2").result::<Vec<String>>().await.unwrap_err();
        assert_eq!(typed.code(), workflow_codes::INVALID_OUTPUT, "{typed}");

        let failed = RunHandle::new(w.clone(), "f2").result_within::<Value>(bound).await.unwrap_err();
        assert_eq!(failed.code(), workflow_codes::RUN_NOT_COMPLETED, "{failed}");
        assert!(failed.to_string().contains("ended failed") && failed.to_string().contains("gives up"), "{failed}");

        let waiting = RunHandle::new(w.clone(), "w2");
        let early = waiting.result_within::<Value>(Duration::from_millis(50)).await.unwrap_err();
        assert_eq!(early.code(), workflow_codes::RESULT_TIMEOUT, "{early}");
        assert_eq!(waiting.wait(Some(Duration::from_millis(10))).await.unwrap(), None);

        let unknown = RunHandle::new(w.clone(), "nobody").wait(None).await.unwrap_err();
        assert_eq!(unknown.code(), "not_found", "{unknown}");
    });
    stop.send(()).unwrap();
    rt.block_on(looping).expect("worker task").expect("worker");
}

/// A workflow database on a clock the test moves, with the feature workflows registered.
struct Clocked {
    _dir: tempfile::TempDir,
    now: Arc<std::sync::atomic::AtomicI64>,
    writer: tidemark_engine::workflow::Writer<Store>,
    workflows: Workflows<Store>,
}

impl Clocked {
    fn new(start_ms: i64) -> Clocked {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wf.db");
        let now = Arc::new(std::sync::atomic::AtomicI64::new(start_ms));
        let clock_now = now.clone();
        let clock: tidemark_engine::workflow::Clock =
            Arc::new(move || clock_now.load(std::sync::atomic::Ordering::SeqCst));
        let writer = tidemark_engine::workflow::Writer::spawn_with_clock(
            move || tidemark_store_sqlite::SqliteWorkflows::init(&path),
            clock,
        )
        .unwrap();
        Clocked { _dir: dir, now, writer, workflows: feature_workflows(Arc::default()) }
    }

    fn at(&self, ms: i64) {
        self.now.store(ms, std::sync::atomic::Ordering::SeqCst);
    }

    fn put(&self, spec: ScheduleSpec) -> tidemark_core::Result<Schedule> {
        self.writer.call_blocking(move |store, now| store.put_schedule(&spec, now))
    }

    fn tick(&self, rt: &tidemark_engine::workflow::tokio::runtime::Runtime) -> TickReport {
        rt.block_on(tidemark_engine::workflow::tick_schedules(&self.writer, &self.workflows)).unwrap()
    }

    fn run_ids(&self) -> Vec<String> {
        let runs = self.writer.call_blocking(|store, _| store.list_runs(&RunFilter::default(), 1_000)).unwrap();
        runs.into_iter().map(|r| r.run_id).collect()
    }

    fn schedule(&self, id: &str) -> Schedule {
        let id = id.to_string();
        self.writer.call_blocking(move |store, _| store.schedule(&id)).unwrap().unwrap()
    }
}

fn every(id: &str, ms: i64, catch_up: CatchUp) -> ScheduleSpec {
    ScheduleSpec {
        schedule_id: id.into(),
        workflow: "double".into(),
        input: json!({"x": 1}),
        timing: Timing::IntervalMs(ms),
        timezone: "UTC".into(),
        catch_up,
    }
}

#[test]
fn a_schedule_starts_each_tick_once_and_catches_up_by_its_policy() {
    let rt = runtime();
    let c = Clocked::new(1_000_000);
    let created = c.put(every("beat", 10_000, CatchUp::One)).unwrap();
    assert_eq!(created.next_tick_at_ms, Some(1_010_000));
    c.at(1_009_999);
    assert_eq!(c.tick(&rt).fired, 0, "nothing is due before the first tick");
    c.at(1_010_000);
    let report = c.tick(&rt);
    assert_eq!((report.fired, report.started), (1, 1), "{report:?}");
    assert_eq!(c.tick(&rt).fired, 0, "the same tick is not started twice");
    assert_eq!(c.run_ids(), ["beat:1010000"]);
    // A tick made from a stale view (another ticker fired first) writes nothing.
    c.at(1_020_000);
    let stale = {
        let s = c.schedule("beat");
        s.plan(1_020_000, 1).unwrap().unwrap()
    };
    assert_eq!(c.tick(&rt).started, 1);
    let answer = c.writer.call_blocking(move |store, now| store.fire(&stale, now)).unwrap();
    assert_eq!(answer, Fired::Stale);
    assert_eq!(c.run_ids(), ["beat:1010000", "beat:1020000"]);

    // Down for 100 s: of the missed ticks only the latest starts, then the on-time ones.
    c.at(1_120_000);
    let report = c.tick(&rt);
    // Due: 1,030,000..=1,120,000; missed (over 60 s late): 1,030,000 to 1,050,000.
    assert_eq!((report.started, report.skipped), (8, 2), "{report:?}");
    let ids = c.run_ids();
    assert_eq!(ids.len(), 10);
    assert!(ids.contains(&"beat:1050000".to_string()) && !ids.contains(&"beat:1040000".to_string()), "{ids:?}");
    let s = c.schedule("beat");
    assert_eq!((s.ticks_started, s.ticks_skipped, s.next_tick_at_ms), (10, 2, Some(1_130_000)));
    assert_eq!(s.last_started_tick_ms, Some(1_120_000));

    // Paused: no tick; resumed: from the next tick after now, the pause's ticks not started.
    let paused = c.writer.call_blocking(|store, now| store.pause_schedule("beat", true, now)).unwrap();
    assert!(paused.paused);
    c.at(1_200_000);
    assert_eq!(c.tick(&rt).fired, 0);
    let resumed = c.writer.call_blocking(|store, now| store.pause_schedule("beat", false, now)).unwrap();
    assert_eq!(resumed.next_tick_at_ms, Some(1_210_000));
    c.at(1_210_000);
    assert_eq!(c.tick(&rt).started, 1);
    assert_eq!(c.run_ids().len(), 11);

    // `all` starts every missed tick; `skip` none of them.
    c.put(every("all", 10_000, CatchUp::All)).unwrap();
    c.put(every("skip", 10_000, CatchUp::Skip)).unwrap();
    c.at(1_210_000 + 200_000);
    let report = c.tick(&rt);
    let ids = c.run_ids();
    let of = |prefix: &str| ids.iter().filter(|id| id.starts_with(prefix)).count();
    assert_eq!((of("all:"), of("skip:")), (20, 7), "{report:?}");

    // A schedule of a workflow this registry does not know stays due and is reported.
    c.put(ScheduleSpec { workflow: "nobody".into(), ..every("orphan", 10_000, CatchUp::One) }).unwrap();
    c.at(1_210_000 + 220_000);
    assert_eq!(c.tick(&rt).unregistered, ["orphan"]);
    assert!(!c.run_ids().iter().any(|id| id.starts_with("orphan:")));
}

#[test]
fn bad_schedules_are_refused_and_write_nothing() {
    let c = Clocked::new(0);
    for bad in [
        ScheduleSpec { timing: Timing::Cron("not a cron".into()), ..every("bad", 1_000, CatchUp::One) },
        ScheduleSpec { timing: Timing::IntervalMs(10), ..every("bad", 1_000, CatchUp::One) },
        ScheduleSpec { timezone: "Nowhere/City".into(), ..every("bad", 1_000, CatchUp::One) },
    ] {
        let error = c.put(bad).unwrap_err();
        assert_eq!(error.code(), schedule_codes::INVALID_SCHEDULE, "{error}");
    }
    assert!(c.writer.call_blocking(|store, _| store.schedules()).unwrap().is_empty());
}

/// `hold` holds its run in an external step for 30 ms and records how many runs were inside at
/// once and in which order they entered.
struct Inside {
    now: std::sync::atomic::AtomicUsize,
    most: std::sync::atomic::AtomicUsize,
    order: Mutex<Vec<String>>,
}

fn queue_workflows(inside: Arc<Inside>) -> Workflows<Store> {
    use std::sync::atomic::Ordering::SeqCst;
    let mut workflows = Workflows::new();
    workflows
        .register("hold", 1, fast_options(), move |ctx, _input: Value| {
            let inside = inside.clone();
            async move {
                let run_id = ctx.run_id().to_string();
                let _: Value = ctx
                    .step("hold", None, move |_key| async move {
                        inside.order.lock().unwrap().push(run_id);
                        let n = inside.now.fetch_add(1, SeqCst) + 1;
                        inside.most.fetch_max(n, SeqCst);
                        tokio::time::sleep(Duration::from_millis(30)).await;
                        inside.now.fetch_sub(1, SeqCst);
                        Ok(json!(null))
                    })
                    .await?;
                Ok(json!(null))
            }
        })
        .unwrap();
    workflows
}

fn inside() -> Arc<Inside> {
    Arc::new(Inside { now: Default::default(), most: Default::default(), order: Mutex::default() })
}

fn hold(run_id: &str) -> tidemark_core::workflow::StartRequest {
    crate::workflow_runtime::request(run_id, "hold", 1, json!({}))
}

fn declare(env: &Env, spec: QueueSpec) {
    env.writer.call_blocking(move |store, now| store.put_queue(&spec, now)).expect("declare the queue");
}

fn queue_state(env: &Env, name: &str) -> QueueState {
    let name = name.to_string();
    env.writer.call_blocking(move |store, now| store.queue(&name, 100, now)).unwrap().expect("the queue")
}

#[test]
fn a_queue_s_concurrency_limit_holds_across_two_workers_on_their_own_connections() {
    use std::sync::atomic::Ordering::SeqCst;
    let (env, rt) = (Env::new(), runtime());
    declare(&env, QueueSpec::new("narrow").concurrency(2));
    let ids: Vec<String> = (0..10).map(|i| format!("q{i}")).collect();
    for id in &ids {
        env.start_new_request(hold(id).in_queue("narrow", 0, None));
    }
    // The control: the same runs without a queue, with the same workers, go wider.
    let control: Vec<String> = (0..10).map(|i| format!("c{i}")).collect();
    let (queued, free) = (inside(), inside());
    let second = crate::workflow_runtime::open_writer(&env.path);
    let w1 = worker(&env.writer, queue_workflows(queued.clone()), worker_options("w1"));
    let w2 = worker(&second, queue_workflows(queued.clone()), worker_options("w2"));
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    crate::workflow_runtime::drive_all(&rt, &[w1, w2], &env, &refs, |run| run.status.is_terminal());
    assert!(refs.iter().all(|id| env.detail(id).run.status == RunStatus::Completed));
    assert!(queued.most.load(SeqCst) <= 2, "at most 2 runs of the queue at once, saw {}", queued.most.load(SeqCst));
    for id in &control {
        env.start_new_request(hold(id));
    }
    let w3 = worker(&env.writer, queue_workflows(free.clone()), worker_options("w3"));
    let control_refs: Vec<&str> = control.iter().map(String::as_str).collect();
    settle(&rt, &w3, &env, &control_refs);
    assert!(free.most.load(SeqCst) > 2, "without the queue more run at once: {}", free.most.load(SeqCst));
    let state = queue_state(&env, "narrow");
    assert_eq!((state.in_progress, state.waiting), (0, 0), "{state:?}");
}

#[test]
fn a_queue_admits_by_priority_then_age_and_its_rate_limit_makes_runs_wait_with_a_position() {
    let (env, rt) = (Env::new(), runtime());
    declare(&env, QueueSpec::new("single").concurrency(1));
    for (id, priority) in [("low", 5), ("urgent", -1), ("mid", 3), ("mid-later", 3)] {
        env.start_new_request(hold(id).in_queue("single", priority, None));
    }
    let order = inside();
    let w = worker(&env.writer, queue_workflows(order.clone()), worker_options("w1"));
    settle(&rt, &w, &env, &["low", "urgent", "mid", "mid-later"]);
    assert_eq!(*order.order.lock().unwrap(), ["urgent", "mid", "mid-later", "low"]);
    let admitted = env.detail("urgent").run;
    assert_eq!((admitted.queue.as_deref(), admitted.priority), (Some("single"), Some(-1)));
    assert!(admitted.admitted_at_ms.is_some());

    // Two admissions an hour: the third and later runs wait, in order, with their positions.
    declare(&env, QueueSpec::new("trickle").rate(2, 3_600_000));
    for i in 0..5 {
        env.start_new_request(hold(&format!("t{i}")).in_queue("trickle", 0, None));
    }
    let w = worker(&env.writer, queue_workflows(inside()), worker_options("w2"));
    rt.block_on(w.run_until_idle()).unwrap();
    let statuses: Vec<RunStatus> = (0..5).map(|i| env.detail(&format!("t{i}")).run.status).collect();
    assert_eq!(statuses[..2], [RunStatus::Completed, RunStatus::Completed]);
    assert_eq!(statuses[2..], [RunStatus::Pending, RunStatus::Pending, RunStatus::Pending]);
    let state = queue_state(&env, "trickle");
    assert_eq!((state.admitted_in_period, state.waiting, state.in_progress), (2, 3, 0), "{state:?}");
    let positions: Vec<(u64, &str)> = state.next.iter().map(|r| (r.position, r.run_id.as_str())).collect();
    assert_eq!(positions, [(1, "t2"), (2, "t3"), (3, "t4")]);
    assert!(env.detail("t2").run.admitted_at_ms.is_none(), "a waiting run is not admitted");
}

#[test]
fn a_dedup_id_is_held_until_its_run_ends_and_an_unknown_queue_is_refused() {
    let (env, rt) = (Env::new(), runtime());
    declare(&env, QueueSpec::new("mail"));
    env.start_new_request(hold("first").in_queue("mail", 0, Some("welcome-42")));
    let again = hold("second").in_queue("mail", 0, Some("welcome-42"));
    let refused = env.writer.call_blocking(move |store, now| store.start_runs(&[again], now)).unwrap_err();
    assert_eq!(refused.code(), queue_codes::DEDUPLICATED, "{refused}");
    assert!(refused.to_string().contains("first"), "names the run that holds it: {refused}");
    let unknown = hold("third").in_queue("nowhere", 0, None);
    let refused = env.writer.call_blocking(move |store, now| store.start_runs(&[unknown], now)).unwrap_err();
    assert_eq!(refused.code(), queue_codes::UNKNOWN_QUEUE, "{refused}");
    assert_eq!(all_runs(&env).len(), 1, "nothing was written");
    let w = worker(&env.writer, queue_workflows(inside()), worker_options("w1"));
    settle(&rt, &w, &env, &["first"]);
    // Its run ended: the id is free again.
    env.start_new_request(hold("second").in_queue("mail", 0, Some("welcome-42")));
}

/// `inbox` publishes its stage, waits for a message `go`, publishes again and returns the message;
/// `poster` sends `go` to the run its input names (and fails once after sending, so that it
/// executes again and replays the send); `stray` sends to a run that does not exist.
fn message_workflows() -> Workflows<Store> {
    let mut workflows = Workflows::new();
    workflows
        .register("inbox", 1, fast_options(), |ctx, _input: Value| async move {
            ctx.set_event("stage", &json!("waiting")).await?;
            let message = ctx.recv("go", Duration::from_secs(3_600)).await?;
            ctx.set_event("stage", &json!("done")).await?;
            Ok(json!({"message": message}))
        })
        .unwrap();
    let failed_once = Arc::new(Mutex::new(false));
    workflows
        .register("poster", 1, fast_options(), move |ctx, input: Value| {
            let failed_once = failed_once.clone();
            async move {
                let to = input["to"].as_str().unwrap_or_default().to_string();
                ctx.send(&to, "go", &json!({"from": ctx.run_id()})).await?;
                let _: Value = ctx
                    .step("after_send", None, move |_key| async move {
                        let mut failed = failed_once.lock().unwrap();
                        if !*failed {
                            *failed = true;
                            return Err(StepFailure::retryable("fails once after the send"));
                        }
                        Ok(json!(null))
                    })
                    .await?;
                Ok(json!({"sent_to": to}))
            }
        })
        .unwrap();
    workflows
        .register("stray", 1, fast_options(), |ctx, _input: Value| async move {
            match ctx.send("nobody-home", "go", &json!(1)).await {
                Err(WorkflowError::StepFailed { message, .. }) => Ok(json!({"failed": message})),
                other => Ok(json!({"unexpected": format!("{other:?}")})),
            }
        })
        .unwrap();
    workflows
}

#[test]
fn runs_publish_values_and_send_each_other_messages_exactly_once() {
    let (env, rt) = (Env::new(), runtime());
    let w = worker(&env.writer, message_workflows(), worker_options("w1"));
    env.start_new("in-1", "inbox", 1, json!({}));
    drive(&rt, &w, &env, &["in-1"], |run| run.status == RunStatus::Waiting);
    let handle = RunHandle::new(w.clone(), "in-1");
    let stage: Option<String> = rt.block_on(handle.get_event("stage", Duration::ZERO)).unwrap();
    assert_eq!(stage.as_deref(), Some("waiting"));
    let nothing: Option<Value> = rt.block_on(handle.get_event("other", Duration::from_millis(20))).unwrap();
    assert_eq!(nothing, None);
    let unknown = rt.block_on(RunHandle::new(w.clone(), "nobody").get_event::<Value>("stage", Duration::ZERO));
    assert_eq!(unknown.unwrap_err().code(), "not_found");

    env.start_new("post-1", "poster", 1, json!({"to": "in-1"}));
    settle(&rt, &w, &env, &["in-1", "post-1"]);
    let receiver = env.detail("in-1");
    assert_eq!(receiver.run.status, RunStatus::Completed, "{:?}", receiver.run.error);
    assert_eq!(receiver.run.result, Some(json!({"message": {"from": "post-1"}})));
    // The poster executed twice (its step failed once): still one message.
    assert_eq!(receiver.events.len(), 1, "{:?}", receiver.events);
    assert_eq!(receiver.events[0].event_id, tidemark_core::workflow::message_event_id("post-1", 0));
    let stage: Option<String> = rt.block_on(handle.get_event("stage", Duration::ZERO)).unwrap();
    assert_eq!(stage.as_deref(), Some("done"), "the latest value of a key wins");
    let kinds: Vec<StepKind> = receiver.journal.iter().map(|e| e.kind).collect();
    assert_eq!(kinds, [StepKind::Publish, StepKind::Wait, StepKind::Publish]);
    let sender = env.detail("post-1");
    assert_eq!((sender.journal[0].kind, sender.journal[0].name.as_str()), (StepKind::Send, "go"));
    assert_eq!(sender.run.status, RunStatus::Completed);

    env.start_new("stray-1", "stray", 1, json!({}));
    settle(&rt, &w, &env, &["stray-1"]);
    let stray = env.detail("stray-1");
    let message = stray.run.result.unwrap()["failed"].as_str().unwrap_or_default().to_string();
    assert!(message.contains("nobody-home"), "{message}");
    assert_eq!(stray.journal[0].status, StepStatus::Failed);
}
