//! Long-lived runs on the real SQLite workflow store, in process: a deadline that cancels a run
//! (compensating first) and its children, `continue_as_new` (a chain of short journals that a
//! handle and a parent follow to its end), `ctx.patched` (old journals replayed through new code
//! take the old branch, new runs the new one, where the same change without a patch parks the
//! run), and the bound on a run's journal. Every wait is bounded; no test asserts on wall-clock
//! time. (The same chain across a killed worker process: `crash.rs`, `order_batch` with
//! `per_run`.)

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tidemark_core::workflow::{
    continuation_run_id, workflow_codes, RunStatus, StartRequest, StepKind, WorkflowStore, RUN_STEPS_MAX,
};
use tidemark_engine::workflow::{RunHandle, WorkflowContext, WorkflowError, Workflows};

use crate::workflow_runtime::{
    drive, fast_options, names, request, runtime, settle, worker, worker_options, Env, Store,
};

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64
}

/// `booking`: books (an external step), sleeps an hour, ships; a cancellation (its deadline)
/// during the sleep unbooks (a compensation) and ends the run `cancelled`. `waits` waits an hour
/// for an event; `booking_parent` runs `waits` as a child. `countdown` continues as new until its
/// `n` is 0, summing; `counts_down` runs a `countdown` child. `endless` takes values for ever.
fn long_lived_workflows() -> Workflows<Store> {
    let mut workflows = Workflows::new();
    workflows
        .register("booking", 1, fast_options(), |ctx, _input: Value| async move {
            let _: Value = ctx.step("book", None, |_key| async { Ok(json!("booked")) }).await?;
            match ctx.sleep(Duration::from_secs(3_600)).await {
                Err(WorkflowError::Cancelled) => {
                    let _: Value = ctx.compensation("unbook", None, |_key| async { Ok(json!("unbooked")) }).await?;
                    Err(WorkflowError::Cancelled)
                }
                other => {
                    other?;
                    Ok(json!("shipped"))
                }
            }
        })
        .unwrap();
    crate::workflow_features::register_waiting(&mut workflows);
    workflows
        .register("countdown", 1, fast_options(), |ctx, input: Value| async move {
            let n = input["n"].as_i64().unwrap_or(0);
            let total = input["total"].as_i64().unwrap_or(0);
            let seen: i64 = ctx.step("tick", None, move |_key| async move { Ok(n) }).await?;
            if seen > 0 {
                return Err(ctx.continue_as_new(&json!({"n": seen - 1, "total": total + seen})));
            }
            Ok(json!({"total": total}))
        })
        .unwrap();
    workflows
        .register("counts_down", 1, fast_options(), |ctx, input: Value| async move {
            let end: Value = ctx.child("countdown", &input).await?;
            Ok(end)
        })
        .unwrap();
    workflows
        .register("endless", 1, fast_options(), |ctx, _input: Value| async move {
            for _ in 0..=RUN_STEPS_MAX {
                ctx.now()?;
            }
            Ok(json!("a journal longer than the bound"))
        })
        .unwrap();
    workflows
}

fn with_deadline(run_id: &str, workflow: &str, deadline_ms: i64) -> StartRequest {
    request(run_id, workflow, 1, json!({})).with_deadline(deadline_ms)
}

#[test]
fn a_deadline_cancels_a_sleeping_run_which_compensates_first() {
    let (env, rt) = (Env::new(), runtime());
    let w = worker(&env.writer, long_lived_workflows(), worker_options("w1"));
    let deadline = now_ms() + 300;
    env.start_new_request(with_deadline("b1", "booking", deadline));
    env.start_new("b2", "booking", 1, json!({}));
    // b1 sleeps until its deadline, not for the hour its timer asks.
    drive(&rt, &w, &env, &["b1", "b2"], |run| run.status == RunStatus::Sleeping);
    assert_eq!(env.detail("b1").run.wake_at_ms, deadline);
    assert_eq!(env.detail("b1").run.deadline_ms, Some(deadline));
    assert!(env.detail("b2").run.wake_at_ms > deadline + 3_000_000);
    settle(&rt, &w, &env, &["b1"]);

    let d = env.detail("b1");
    assert_eq!(d.run.status, RunStatus::Cancelled, "{:?}", d.run.error);
    let error = d.run.error.clone().unwrap_or_default();
    assert!(error.starts_with(workflow_codes::DEADLINE_PASSED), "{error}");
    assert_eq!(names(&d), ["book", "sleep", "unbook"]);
    assert_eq!(d.journal[2].kind, StepKind::Compensation);
    // The run without a deadline sleeps on.
    assert_eq!(env.detail("b2").run.status, RunStatus::Sleeping);
}

#[test]
fn a_child_inherits_its_parent_s_deadline_and_both_are_cancelled_when_it_passes() {
    let (env, rt) = (Env::new(), runtime());
    let w = worker(&env.writer, long_lived_workflows(), worker_options("w1"));
    let deadline = now_ms() + 300;
    env.start_new_request(with_deadline("p1", "waits_for_child", deadline));
    settle(&rt, &w, &env, &["p1", "p1.0"]);
    let (parent, child) = (env.detail("p1").run, env.detail("p1.0").run);
    assert_eq!(child.deadline_ms, Some(deadline));
    assert_eq!(parent.status, RunStatus::Cancelled, "{:?}", parent.error);
    assert_eq!(child.status, RunStatus::Cancelled, "{:?}", child.error);
    assert!(parent.error.unwrap_or_default().starts_with(workflow_codes::DEADLINE_PASSED));
}

#[test]
fn a_deadline_too_far_ahead_is_refused_and_writes_nothing() {
    let env = Env::new();
    let too_far = now_ms() + tidemark_core::workflow::TIMER_MS_MAX + 60_000;
    let refused = env
        .writer
        .call_blocking(move |store, now| store.start_runs(&[with_deadline("far", "booking", too_far)], now))
        .unwrap_err();
    assert_eq!(refused.code(), "invalid_argument", "{refused}");
    let negative = StartRequest { deadline_ms: Some(-1), ..request("neg", "booking", 1, json!({})) };
    assert_eq!(negative.validate().unwrap_err().code(), "invalid_argument");
    let none = env.writer.call_blocking(|store, _| store.run("far")).unwrap();
    assert!(none.is_none());
}

#[test]
fn continue_as_new_keeps_each_journal_short_and_a_handle_follows_the_chain() {
    let (env, rt) = (Env::new(), runtime());
    let w = worker(&env.writer, long_lived_workflows(), worker_options("w1"));
    env.start_new_request(StartRequest {
        key: Some("account-7".into()),
        ..request("cd", "countdown", 1, json!({"n": 3}))
    });
    let chain = ["cd", "cd.c1", "cd.c2", "cd.c3"];
    assert_eq!(continuation_run_id("cd.c2"), "cd.c3");
    settle(&rt, &w, &env, &chain);
    for (i, id) in chain.iter().enumerate() {
        let d = env.detail(id);
        assert_eq!(names(&d), ["tick"], "{id}: one step each");
        assert_eq!(d.run.key.as_deref(), Some("account-7"), "{id} keeps the key");
        if i < 3 {
            assert_eq!(d.run.status, RunStatus::Continued);
            assert_eq!(d.run.result, Some(json!({"continued_as": chain[i + 1]})));
        }
    }
    let last = env.detail("cd.c3").run;
    assert_eq!((last.status, last.result), (RunStatus::Completed, Some(json!({"total": 6}))));
    assert_eq!(env.detail("cd.c1").run.input, json!({"n": 2, "total": 3}));
    rt.block_on(async {
        let total: Value = RunHandle::new(w.clone(), "cd").result_within(Duration::from_secs(60)).await.unwrap();
        assert_eq!(total, json!({"total": 6}));
        let ended = RunHandle::new(w.clone(), "cd").wait(Some(Duration::from_secs(60))).await.unwrap().unwrap();
        assert_eq!(ended.run_id, "cd.c3", "the record is the chain's last run");
    });
}

#[test]
fn a_parent_awaits_the_end_of_its_child_s_chain() {
    let (env, rt) = (Env::new(), runtime());
    let w = worker(&env.writer, long_lived_workflows(), worker_options("w1"));
    env.start_new("p", "counts_down", 1, json!({"n": 2}));
    settle(&rt, &w, &env, &["p", "p.0", "p.0.c1", "p.0.c2"]);
    let parent = env.detail("p");
    assert_eq!(parent.run.status, RunStatus::Completed, "{:?}", parent.run.error);
    assert_eq!(parent.run.result, Some(json!({"total": 3})));
    // The chain's last run told the parent; the runs that continued did not.
    assert_eq!(parent.events.len(), 1, "{:?}", parent.events);
    assert_eq!(parent.events[0].payload["run_id"], "p.0.c2");
    assert_eq!(env.detail("p.0.c2").run.parent_run_id.as_deref(), Some("p"));
}

#[test]
fn a_run_that_fills_its_journal_fails_with_journal_full() {
    let (env, rt) = (Env::new(), runtime());
    let w = worker(&env.writer, long_lived_workflows(), worker_options("w1"));
    env.start_new("e", "endless", 1, json!({}));
    settle(&rt, &w, &env, &["e"]);
    let d = env.detail("e");
    assert_eq!(d.run.status, RunStatus::Failed);
    assert!(d.run.error.as_deref().unwrap_or("").starts_with(workflow_codes::JOURNAL_FULL), "{:?}", d.run.error);
    assert_eq!(d.journal.len(), RUN_STEPS_MAX as usize);
}

/// What ran of the fee steps, across workers.
type Ran = Arc<Mutex<Vec<String>>>;

/// `fees` in three generations of the same name and version: `old` books, charges the old fee,
/// waits for `go` and finishes; `patched` puts the new fee behind `ctx.patched("fee-v2")`;
/// `deprecated` keeps only the new fee behind `ctx.deprecate_patch("fee-v2")`; `unpatched`
/// changes the fee without a patch.
fn fees(generation: &'static str, ran: Ran) -> Workflows<Store> {
    async fn fee(ctx: &WorkflowContext<Store>, name: &'static str, ran: Ran) -> Result<(), WorkflowError> {
        let _: Value = ctx
            .step(name, None, move |_key| async move {
                ran.lock().unwrap().push(name.to_string());
                Ok(json!(name))
            })
            .await?;
        Ok(())
    }
    let mut workflows = Workflows::new();
    workflows
        .register("fees", 1, fast_options(), move |ctx, _input: Value| {
            let ran = ran.clone();
            async move {
                let _: Value = ctx.step("book", None, |_key| async { Ok(json!("booked")) }).await?;
                match generation {
                    "old" => fee(&ctx, "old_fee", ran).await?,
                    "patched" => {
                        if ctx.patched("fee-v2")? {
                            fee(&ctx, "new_fee", ran).await?
                        } else {
                            fee(&ctx, "old_fee", ran).await?
                        }
                    }
                    "deprecated" => {
                        ctx.deprecate_patch("fee-v2")?;
                        fee(&ctx, "new_fee", ran).await?
                    }
                    _ => fee(&ctx, "new_fee", ran).await?,
                }
                ctx.wait_for_event("go", Duration::from_secs(3_600)).await?;
                let _: Value = ctx.step("finish", None, |_key| async { Ok(json!("done")) }).await?;
                Ok(json!("finished"))
            }
        })
        .unwrap();
    workflows
}

#[test]
fn a_patch_replays_old_journals_on_the_old_branch_and_new_runs_on_the_new_one() {
    let (env, rt) = (Env::new(), runtime());
    let ran: Ran = Arc::default();
    let waiting = |run: &tidemark_core::workflow::RunRecord| run.status == RunStatus::Waiting;
    // Old code takes two runs past the fee; they wait for `go`.
    let old = worker(&env.writer, fees("old", ran.clone()), worker_options("old"));
    env.start_new("r-old", "fees", 1, json!({}));
    env.start_new("r-unpatched", "fees", 1, json!({}));
    drive(&rt, &old, &env, &["r-old", "r-unpatched"], waiting);
    drop(old);

    // The fix without a patch: the journal says old_fee where the code now calls new_fee.
    let unpatched = worker(&env.writer, fees("unpatched", ran.clone()), worker_options("unpatched"));
    env.send("r-unpatched", "go-1", "go", json!({}));
    settle(&rt, &unpatched, &env, &["r-unpatched"]);
    let parked = env.detail("r-unpatched").run;
    assert_eq!(parked.status, RunStatus::Parked);
    assert!(parked.error.unwrap_or_default().contains("non-deterministic"));
    drop(unpatched);

    // The same fix behind a patch: the old run replays the old branch, a new run takes the new
    // one (and replays it after its wait).
    let patched = worker(&env.writer, fees("patched", ran.clone()), worker_options("patched"));
    env.start_new("r-new", "fees", 1, json!({}));
    drive(&rt, &patched, &env, &["r-new"], waiting);
    env.send("r-old", "go-2", "go", json!({}));
    env.send("r-new", "go-3", "go", json!({}));
    settle(&rt, &patched, &env, &["r-old", "r-new"]);
    let (r_old, r_new) = (env.detail("r-old"), env.detail("r-new"));
    assert_eq!(r_old.run.status, RunStatus::Completed, "{:?}", r_old.run.error);
    assert_eq!(names(&r_old), ["book", "old_fee", "go", "finish"], "no marker in an old journal");
    assert_eq!(r_new.run.status, RunStatus::Completed, "{:?}", r_new.run.error);
    assert_eq!(names(&r_new), ["book", "patch:fee-v2", "new_fee", "go", "finish"]);
    assert_eq!(r_new.journal[1].kind, StepKind::Value);
    drop(patched);

    // Once every old run is done, the old branch goes: runs that journaled the marker replay.
    let patched = worker(&env.writer, fees("patched", ran.clone()), worker_options("patched-2"));
    env.start_new("r-marked", "fees", 1, json!({}));
    drive(&rt, &patched, &env, &["r-marked"], waiting);
    drop(patched);
    let deprecated = worker(&env.writer, fees("deprecated", ran.clone()), worker_options("deprecated"));
    env.start_new("r-latest", "fees", 1, json!({}));
    env.send("r-marked", "go-4", "go", json!({}));
    drive(&rt, &deprecated, &env, &["r-latest"], waiting);
    env.send("r-latest", "go-5", "go", json!({}));
    settle(&rt, &deprecated, &env, &["r-marked", "r-latest"]);
    assert_eq!(env.detail("r-marked").run.status, RunStatus::Completed);
    assert_eq!(names(&env.detail("r-marked")), ["book", "patch:fee-v2", "new_fee", "go", "finish"]);
    assert_eq!(names(&env.detail("r-latest")), ["book", "new_fee", "go", "finish"]);
    // Each fee was charged once per run: replays returned the journaled result.
    let ran = ran.lock().unwrap().clone();
    assert_eq!(ran, ["old_fee", "old_fee", "new_fee", "new_fee", "new_fee"], "{ran:?}");
}

/// A message to a run id that is not an identifier, and a published value over its limit, are
/// bad input every store refuses: the run that asked fails with the code (nothing of it was
/// written, and the group commit it would have shared with other runs goes on), once, without
/// being claimed again and again.
#[test]
fn a_write_a_store_would_refuse_fails_its_run_and_nothing_else() {
    let mut workflows = long_lived_workflows();
    workflows
        .register("bad_send", 1, fast_options(), |ctx, _input: Value| async move {
            ctx.send("not an id!", "hello", &json!({})).await?;
            Ok(json!("sent"))
        })
        .unwrap();
    workflows
        .register("big_event", 1, fast_options(), |ctx, _input: Value| async move {
            let big = "x".repeat(tidemark_core::workflow::WORKFLOW_INPUT_BYTES_MAX + 1);
            ctx.set_event("progress", &big).await?;
            Ok(json!("published"))
        })
        .unwrap();
    let (env, rt) = (Env::new(), runtime());
    let w = worker(&env.writer, workflows, worker_options("w1"));
    env.start_new("bad", "bad_send", 1, json!({}));
    env.start_new("big", "big_event", 1, json!({}));
    env.start_new("good", "countdown", 1, json!({"n": 0}));
    let report = settle(&rt, &w, &env, &["bad", "big", "good"]);
    let bad = env.detail("bad").run;
    assert_eq!(bad.status, RunStatus::Failed);
    assert!(bad.error.as_deref().unwrap_or("").starts_with("invalid_id"), "{:?}", bad.error);
    let big = env.detail("big").run;
    assert_eq!(big.status, RunStatus::Failed);
    assert!(big.error.as_deref().unwrap_or("").starts_with("payload_too_large"), "{:?}", big.error);
    assert!(env.detail("big").journal.is_empty() && env.detail("bad").journal.is_empty());
    assert_eq!(env.detail("good").run.status, RunStatus::Completed);
    assert_eq!(report.claimed, 3, "each run claimed once: {report:?}");
    assert_eq!(report.errors, 0, "{report:?}");
}

/// A `ctx.send` to a run that holds its most events no wait consumed
/// ([`tidemark_core::workflow::RUN_EVENTS_HELD_MAX`]) waits: nothing journaled, the sender
/// pending, sending again after its retry delay, until the receiver took some; then the send
/// is journaled once and the receiver holds the message once.
#[test]
fn a_send_to_a_full_run_waits_until_the_receiver_takes_some() {
    use tidemark_core::workflow::RUN_EVENTS_HELD_MAX;
    let mut workflows = long_lived_workflows();
    workflows
        .register("note_sender", 1, fast_options(), |ctx, _input: Value| async move {
            ctx.send("full", "note", &json!("hello")).await?;
            Ok(json!("sent"))
        })
        .unwrap();
    let (env, rt) = (Env::new(), runtime());
    let w = worker(&env.writer, workflows, worker_options("w1"));
    env.start_new("full", "waits", 1, json!({}));
    drive(&rt, &w, &env, &["full"], |run| run.status == RunStatus::Waiting);
    env.writer
        .call_blocking(|store, _| {
            store
                .connection()
                .execute(
                    "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
                     INSERT INTO run_events (run_id, event_id, name, payload, received_at_ms)
                     SELECT 'full', 'e' || i, 'other', '{}', 1000 + i FROM n",
                    [RUN_EVENTS_HELD_MAX as i64],
                )
                .map_err(|e| tidemark_core::Error::store(e.to_string()))
        })
        .expect("fill the receiver");
    env.start_new("sender", "note_sender", 1, json!({}));
    let mut claimed = 0;
    for _ in 0..200 {
        claimed += rt.block_on(w.run_until_idle()).expect("worker").claimed;
        if claimed >= 3 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(claimed >= 3, "the sender tried again after its delay: claimed {claimed} times");
    let sender = env.detail("sender");
    assert_eq!(sender.run.status, RunStatus::Pending, "{:?}", sender.run);
    assert!(sender.journal.is_empty(), "nothing journaled while the receiver is full: {:?}", sender.journal);
    assert!(env.detail("full").events.iter().all(|e| e.name == "other"));
    // The receiver takes one (as a wait would): the next try sends.
    env.writer
        .call_blocking(|store, _| {
            store
                .connection()
                .execute("UPDATE run_events SET consumed_by_seq = 0 WHERE run_id = 'full' AND event_id = 'e1'", [])
                .map_err(|e| tidemark_core::Error::store(e.to_string()))
        })
        .expect("consume one");
    settle(&rt, &w, &env, &["sender"]);
    let sender = env.detail("sender");
    assert_eq!(sender.run.status, RunStatus::Completed, "{:?}", sender.run);
    assert_eq!(sender.journal.len(), 1);
    assert_eq!(sender.journal[0].kind, StepKind::Send);
    let notes = env.detail("full").events.iter().filter(|e| e.name == "note").count();
    assert_eq!(notes, 1);
}
