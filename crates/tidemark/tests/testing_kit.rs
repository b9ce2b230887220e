//! The workflow authors' test kit (`tidemark::testing`) on a user's own workflows: a correct
//! saga passes at every boundary, and each mistake the kit exists for is caught (the tests
//! assert that the findings are there, so a kit that stopped finding them fails here). Recorded
//! journals replay on code that only appends steps and not on code that reorders them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{json, Value};
use tidemark::prelude::*;
use tidemark::testing::{parse_recorded, CrashTest, Effects, FindingKind, ReplayCheck, Report, INVALID_RECORDING};
use tidemark::workflow::{RunDetail, StepStatus};

mod kit_shared;
use kit_shared::{
    appends_a_receipt, assert_the_saga_compensated_at_every_boundary, assert_the_saga_completed_at_every_boundary,
    branches_on_the_live_clock, external, notify, reorders_the_steps, reserve_then_charge, stops_early, FakePayments,
    Order,
};

// ---------------------------------------------------------------------------------------------
// A correct saga: stock reserved in the workflow database, a card charged by a fake payment
// service that fails the first call of every key (so every charge retries), an hour's sleep, a
// child that e-mails, and the compensation of the reservation when the card is declined.
// ---------------------------------------------------------------------------------------------

fn quick_retries() -> RetryPolicy {
    RetryPolicy { max_attempts: 3, ..RetryPolicy::default() }
}

fn stock_table() -> Migration {
    Migration::sql("0001_reservations", "CREATE TABLE reservations (order_id TEXT PRIMARY KEY, status TEXT NOT NULL)")
}

fn order_saga(payments: FakePayments) -> Workflow {
    tidemark::workflow("order", 1, move |ctx: Context, order: Order| {
        let payments = payments.clone();
        async move {
            let id = order.order_id.clone();
            ctx.tx_step("reserve", None, move |tx: &Connection| {
                tx.execute("INSERT INTO reservations (order_id, status) VALUES (?1, 'reserved')", [&id])?;
                Ok(())
            })
            .await?;
            let placed_at = ctx.now()?;
            let charged = ctx
                .step("charge", Some(quick_retries()), |key| {
                    let (payments, order) = (payments.clone(), order.clone());
                    async move { payments.charge(&order, &key).await }
                })
                .await;
            let charge = match charged {
                Ok(charge) => charge,
                Err(WorkflowError::StepFailed { step, message, .. }) => {
                    ctx.begin_compensation().await?;
                    let id = order.order_id.clone();
                    ctx.tx_compensation("release", None, move |tx: &Connection| {
                        tx.execute("UPDATE reservations SET status = 'released' WHERE order_id = ?1", [&id])?;
                        Ok(())
                    })
                    .await?;
                    return Err(WorkflowError::Compensated(format!("{step} failed: {message}")));
                }
                Err(other) => return Err(other),
            };
            ctx.sleep(Duration::from_secs(3_600)).await?;
            let mail: String = ctx.child("notify", &json!({"order_id": order.order_id})).await?;
            Ok(json!({"charge": charge, "placed_at": placed_at, "mail": mail}))
        }
    })
}

fn saga_test(effects: &Effects, amount: i64) -> CrashTest {
    CrashTest::new(order_saga(FakePayments { effects: effects.clone() }))
        .workflow(notify(effects.clone()))
        .input(&Order { order_id: "order-1".into(), amount })
        .effects(effects)
        .migration(stock_table())
}

#[test]
fn a_correct_saga_passes_at_every_boundary() {
    let effects = Effects::new();
    let report = saga_test(&effects, 500).run().unwrap();
    assert_the_saga_completed_at_every_boundary(&report);
    assert_eq!(report.random_schedules, tidemark::testing::RANDOM_SCHEDULES_DEFAULT);
    // The charge's repeats all came after crashes.
    let notes: Vec<_> = report.of_kind(FindingKind::RetriedWithSameKey).collect();
    assert!(notes.iter().all(|n| !n.crashes.is_empty()), "{report}");
}

#[test]
fn a_compensating_saga_passes_at_every_boundary() {
    let effects = Effects::new();
    let report = saga_test(&effects, 5_000).random_schedules(4).run().unwrap();
    assert_the_saga_compensated_at_every_boundary(&report);
}

// ---------------------------------------------------------------------------------------------
// Wrong workflows, each caught.
// ---------------------------------------------------------------------------------------------

#[test]
fn branching_on_the_live_clock_is_a_non_deterministic_replay() {
    let report = CrashTest::new(branches_on_the_live_clock::<tidemark::sqlite::SqliteWorkflows>())
        .random_schedules(0)
        .run()
        .unwrap();
    assert!(!report.is_ok(), "{report}");
    let found: Vec<_> = report.of_kind(FindingKind::NonDeterministicReplay).collect();
    assert!(!found.is_empty(), "{report}");
    assert!(found.iter().all(|f| !f.crashes.is_empty()), "the crash-free run is fine by itself: {report}");
    // Crashed after `charge` was journaled: the replay calls `expire` at its position and parks.
    assert!(
        found.iter().any(|f| f.seq == Some(1) && f.step.as_deref() == Some("charge") && f.message.contains("parked")),
        "{report}"
    );
    // Crashed before: the journal goes on with `expire` where the crash-free one has `charge`.
    assert!(found.iter().any(|f| f.step.as_deref() == Some("expire")), "{report}");
    let text = report.to_string();
    assert!(text.contains("non_deterministic_replay") && text.contains("crashes at boundaries"), "{text}");
}

#[test]
fn branching_on_a_value_outside_the_journal_is_a_non_deterministic_replay() {
    // A number read outside the journal (a counter standing in for `rand::random()`, so that the
    // branch flips on every execution and the test cannot pass by luck).
    static DRAWS: AtomicU64 = AtomicU64::new(0);
    let workflow = tidemark::workflow("coin", 1, |ctx: Context, _: Value| async move {
        let heads = DRAWS.fetch_add(1, Ordering::SeqCst) & 1 == 0;
        ctx.step("toss", None, external("toss")).await?;
        ctx.step(if heads { "heads" } else { "tails" }, None, external("side")).await
    });
    let report = CrashTest::new(workflow).random_schedules(0).run().unwrap();
    assert!(report.has(FindingKind::NonDeterministicReplay), "{report}");
    // The same code with the value journaled (ctx.random()) passes.
    let workflow = tidemark::workflow("coin", 1, |ctx: Context, _: Value| async move {
        let heads = ctx.random()? & 1 == 0;
        ctx.step("toss", None, external("toss")).await?;
        ctx.step(if heads { "heads" } else { "tails" }, None, external("side")).await
    });
    // Each execution is a fresh run that draws its own value, so its side may differ from the
    // crash-free run's: that is no replay of one run taking another branch, and it is not reported.
    CrashTest::new(workflow).random_schedules(4).run().unwrap().assert_ok();
}

#[test]
fn an_effect_keyed_with_a_fresh_uuid_per_attempt_is_reported() {
    let effects = Effects::new();
    let recorder = effects.clone();
    let workflow = tidemark::workflow("fresh_keys", 1, move |ctx: Context, _: Value| {
        let recorder = recorder.clone();
        async move {
            ctx.step("charge", None, move |_key| async move {
                let key = uuid::Uuid::new_v4().to_string(); // wrong: a new key on every attempt
                recorder.record("charge order-1", &key);
                Ok(key)
            })
            .await?;
            ctx.step("ship", None, external("ship")).await
        }
    });
    let report = CrashTest::new(workflow).effects(&effects).random_schedules(0).run().unwrap();
    let found: Vec<_> = report.of_kind(FindingKind::IdempotencyKeyChanged).collect();
    assert!(!found.is_empty(), "{report}");
    assert!(found.iter().all(|f| f.step.as_deref() == Some("charge") && !f.crashes.is_empty()), "{report}");
    assert!(found[0].message.contains("charge order-1"), "{report}");
}

#[test]
fn a_retry_that_changes_its_key_is_reported_without_a_crash() {
    let effects = Effects::new();
    let recorder = effects.clone();
    let workflow = tidemark::workflow("retry_keys", 1, move |ctx: Context, _: Value| {
        let recorder = recorder.clone();
        async move {
            ctx.step("charge", None, move |_key| async move {
                let key = uuid::Uuid::new_v4().to_string();
                if !recorder.record("charge order-2", &key) && recorder.calls().len() == 1 {
                    return Err::<String, _>(StepFailure::retryable("timed out"));
                }
                Ok(key)
            })
            .await
        }
    });
    let report = CrashTest::new(workflow).effects(&effects).every_boundary(false).random_schedules(0).run().unwrap();
    let found: Vec<_> = report.of_kind(FindingKind::IdempotencyKeyChanged).collect();
    assert_eq!(found.len(), 1, "{report}");
    assert!(found[0].crashes.is_empty() && found[0].message.contains("after a failed attempt"), "{report}");
}

#[test]
fn a_side_effect_in_the_workflow_function_is_a_step_that_ran_twice() {
    let effects = Effects::new();
    let recorder = effects.clone();
    let workflow = tidemark::workflow("mailer", 1, move |ctx: Context, _: Value| {
        let recorder = recorder.clone();
        async move {
            ctx.step("reserve", None, external("reserve")).await?;
            // Wrong: outside a step, so it runs again on every replay.
            recorder.record("welcome mail", "order-3");
            ctx.step("ship", None, external("ship")).await
        }
    });
    let report = CrashTest::new(workflow).effects(&effects).random_schedules(0).run().unwrap();
    let found: Vec<_> = report.of_kind(FindingKind::StepRanTwice).collect();
    assert!(!found.is_empty(), "{report}");
    assert!(found.iter().all(|f| f.message.contains("welcome mail") && !f.crashes.is_empty()), "{report}");
}

#[test]
fn an_external_call_in_a_transactional_step_is_a_step_that_ran_twice() {
    let effects = Effects::new();
    let recorder = effects.clone();
    let workflow = tidemark::workflow("tx_mail", 1, move |ctx: Context, _: Value| {
        let recorder = recorder.clone();
        async move {
            ctx.tx_step("record_and_mail", None, move |tx: &Connection| {
                tx.execute("INSERT INTO sent (what) VALUES ('mail')", [])?;
                // Wrong: this call is not rolled back with the transaction.
                recorder.record("receipt mail", "order-4");
                Ok(())
            })
            .await
        }
    });
    let report = CrashTest::new(workflow)
        .effects(&effects)
        .migration(Migration::sql("0001_sent", "CREATE TABLE sent (what TEXT NOT NULL)"))
        .random_schedules(0)
        .run()
        .unwrap();
    let found: Vec<_> = report.of_kind(FindingKind::StepRanTwice).collect();
    assert!(!found.is_empty(), "{report}");
    assert!(found.iter().all(|f| f.message.contains("receipt mail")), "the row itself committed once: {report}");
}

#[test]
fn a_write_from_an_external_step_lands_twice() {
    let workflow = tidemark::workflow("own_writes", 1, |ctx: Context, _: Value| async move {
        let file: String =
            ctx.tx_step("where", None, |tx: &Connection| Ok(tx.path().unwrap_or_default().to_string())).await?;
        ctx.step("remember", None, move |_key| async move {
            // Wrong: a write to the workflow database outside a transactional step is not made
            // exactly once (it runs again when the crash came before its attempt was committed).
            let conn = tidemark::rusqlite::Connection::open(&file)?;
            conn.execute("INSERT INTO remembered (n) VALUES (1)", [])?;
            Ok(())
        })
        .await?;
        ctx.step("ship", None, external("ship")).await
    });
    let report = CrashTest::new(workflow)
        .migration(Migration::sql("0001_remembered", "CREATE TABLE remembered (n INTEGER NOT NULL)"))
        .compare_outputs(false) // each execution's file has its own name, which `where` returns
        .random_schedules(0)
        .run()
        .unwrap();
    let found: Vec<_> = report.of_kind(FindingKind::StepRanTwice).collect();
    assert!(!found.is_empty(), "{report}");
    assert!(found.iter().all(|f| f.message.contains("table remembered holds 2 rows, 1 after")), "{report}");
}

#[test]
fn a_seed_draws_the_same_schedules_and_the_report_names_it() {
    static DRAWS: AtomicU64 = AtomicU64::new(0);
    let flaky = || {
        tidemark::workflow("flaky", 1, |ctx: Context, _: Value| async move {
            let odd = DRAWS.fetch_add(1, Ordering::SeqCst) & 1 == 1;
            ctx.step("a", None, external("a")).await?;
            ctx.step(if odd { "b" } else { "c" }, None, external("b")).await
        })
    };
    let schedules = |report: &Report| -> Vec<Vec<u32>> {
        let mut crashes: Vec<Vec<u32>> = report.findings.iter().map(|f| f.crashes.clone()).collect();
        crashes.dedup();
        crashes
    };
    let run = |seed| {
        DRAWS.store(0, Ordering::SeqCst);
        CrashTest::new(flaky()).every_boundary(false).random_schedules(6).seed(seed).run().unwrap()
    };
    let (first, again, other) = (run(7), run(7), run(8));
    assert!(first.has(FindingKind::NonDeterministicReplay), "{first}");
    assert_eq!(schedules(&first), schedules(&again));
    assert_ne!(schedules(&first), schedules(&other), "{first}\n{other}");
    assert_eq!(first.seed, Some(7));
    assert!(first.to_string().contains("seed 7"), "{first}");
    // A finding's crashes, given back as a schedule, run that execution again.
    let finding = first.of_kind(FindingKind::NonDeterministicReplay).next().unwrap().clone();
    DRAWS.store(0, Ordering::SeqCst);
    let replayed =
        CrashTest::new(flaky()).every_boundary(false).random_schedules(0).schedule(&finding.crashes).run().unwrap();
    assert_eq!(replayed.given_schedules, 1);
    assert!(replayed.findings.iter().any(|f| f.crashes == finding.crashes), "{replayed}");
}

#[test]
fn bad_configuration_is_a_typed_error() {
    let workflow = || tidemark::workflow("typed", 1, |_: Context, order: Order| async move { Ok(order.amount) });
    let error = CrashTest::new(workflow()).input(&json!({"nope": 1})).run().unwrap_err();
    assert_eq!(error.code(), tidemark::workflow::workflow_codes::INVALID_INPUT);
    let error = CrashTest::new(workflow()).schedule(&[0]).run().unwrap_err();
    assert_eq!(error.code(), tidemark::codes::INVALID_ARGUMENT);
    let error = CrashTest::new(workflow()).run_id("not an id").input(&Order { order_id: "o".into(), amount: 1 });
    assert_eq!(error.run().unwrap_err().code(), tidemark::codes::INVALID_ID);
    let error = CrashTest::new(workflow()).workflow(workflow()).run().unwrap_err();
    assert_eq!(error.code(), tidemark::codes::ALREADY_EXISTS);
    let error = ReplayCheck::new().workflow(workflow()).recorded_json("{\"run\": 3}").run().unwrap_err();
    assert_eq!(error.code(), INVALID_RECORDING);
    assert_eq!(ReplayCheck::new().workflow(workflow()).run().unwrap_err().code(), tidemark::codes::INVALID_ARGUMENT);
}

// ---------------------------------------------------------------------------------------------
// Recorded journals replayed against new code.
// ---------------------------------------------------------------------------------------------

/// Journals recorded by the first code: one finished run, and one caught in its sleep (as a
/// production run in flight is), as `GET /v1/runs/{id}` gives them.
fn recordings() -> (String, String) {
    let report = CrashTest::new(tidemark::workflow("order", 1, reserve_then_charge))
        .every_boundary(false)
        .random_schedules(0)
        .run()
        .unwrap();
    report.assert_ok();
    let finished = report.runs[0].clone();
    assert_eq!(finished.run.status, RunStatus::Completed);
    let mut sleeping = finished.clone();
    sleeping.run.run_id = "order-sleeping".into();
    sleeping.run.status = RunStatus::Sleeping;
    sleeping.run.result = None;
    sleeping.journal.truncate(2);
    sleeping.journal[1].status = StepStatus::Waiting;
    sleeping.attempts.retain(|a| a.seq < 2);
    (serde_json::to_string(&finished).unwrap(), serde_json::to_string(&sleeping).unwrap())
}

fn replay<F, Fut>(code: F, recorded: &[&str]) -> Report
where
    F: Fn(Context, Value) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<String, WorkflowError>> + Send + 'static,
{
    let mut check = ReplayCheck::new().workflow(tidemark::workflow("order", 1, code));
    for json in recorded {
        check = check.recorded_json(json);
    }
    check.run().unwrap()
}

#[test]
fn recorded_journals_round_trip_as_json() {
    let (finished, _) = recordings();
    let parsed = parse_recorded(&finished).unwrap();
    assert_eq!(serde_json::to_string(&parsed[0]).unwrap(), finished);
    // `tidemark workflow show` adds its outcome beside the run's fields; arrays hold many.
    let mut shown: Value = serde_json::from_str(&finished).unwrap();
    shown["outcome"] = json!("found");
    let both = format!("[{shown}, {finished}]");
    assert_eq!(parse_recorded(&both).unwrap().len(), 2);
}

/// The page of `whole` that `GET /v1/runs/{id}?after_seq=&limit=` serves.
fn page_of(whole: &RunDetail, after_seq: Option<u32>, limit: usize) -> RunDetail {
    let from = after_seq.map_or(0, |seq| seq + 1);
    let mut page = whole.clone();
    page.journal.retain(|entry| entry.seq >= from);
    page.attempts.retain(|attempt| attempt.seq >= from);
    page.events.retain(|event| event.consumed_by_seq.is_none_or(|seq| seq >= from));
    page.keep_entries(limit);
    page
}

#[test]
fn a_recording_in_pages_is_joined_and_one_without_its_last_page_is_refused() {
    let (finished, _) = recordings();
    let whole = parse_recorded(&finished).unwrap().remove(0);
    assert_eq!(whole.journal.len(), 3, "{finished}");
    let first = page_of(&whole, None, 1);
    let (second, last) = (page_of(&whole, Some(0), 1), page_of(&whole, Some(1), 5));
    assert_eq!((first.next_after_seq, second.next_after_seq, last.next_after_seq), (Some(0), Some(1), None));
    assert!(first.attempts.iter().all(|a| a.seq == 0) && !first.attempts.is_empty());
    let pages = serde_json::to_string(&[&first, &second, &last]).unwrap();
    assert_eq!(parse_recorded(&pages).unwrap(), [whole], "the pages join into the whole");
    replay(reserve_then_charge, &[&pages]).assert_ok();

    let without_last = serde_json::to_string(&[&first, &second]).unwrap();
    let out_of_order = serde_json::to_string(&[&first, &last, &second]).unwrap();
    for json in [without_last, out_of_order, serde_json::to_string(&first).unwrap()] {
        let error = parse_recorded(&json).unwrap_err();
        assert_eq!(error.code(), INVALID_RECORDING, "{error}");
    }
}

#[test]
fn a_journal_recorded_by_v1_replays_on_code_that_only_appends() {
    let (finished, sleeping) = recordings();
    let report = replay(appends_a_receipt, &[&finished, &sleeping]);
    report.assert_ok();
    // Nothing ran: each replay stopped at the first position its journal had not settled.
    let ends: Vec<(&str, &str)> =
        report.runs.iter().map(|d| (d.run.run_id.as_str(), d.run.error.as_deref().unwrap_or_default())).collect();
    assert_eq!(ends.len(), 2, "{report}");
    assert!(ends.iter().all(|(_, e)| e.starts_with(tidemark::workflow::REPLAY_END)), "{ends:?}");
    assert!(ends[0].1.contains("position 3") && ends[0].1.contains("\"receipt\""), "{ends:?}");
    assert!(ends[1].1.contains("position 1") && ends[1].1.contains("sleep"), "{ends:?}");
    // The unchanged code replays too.
    replay(reserve_then_charge, &[&finished, &sleeping]).assert_ok();
}

#[test]
fn a_journal_recorded_by_v1_does_not_replay_on_code_that_reorders_or_stops_early() {
    let (finished, sleeping) = recordings();
    let report = replay(reorders_the_steps, &[&finished, &sleeping]);
    let found: Vec<_> = report.of_kind(FindingKind::RecordedJournalMismatch).collect();
    assert_eq!(found.len(), 2, "{report}");
    assert!(found.iter().all(|f| f.seq == Some(0) && f.step.as_deref() == Some("reserve")), "{report}");
    assert!(found[0].message.contains("\"charge\""), "{report}");
    let report = replay(stops_early, &[&finished]);
    let found: Vec<_> = report.of_kind(FindingKind::RecordedJournalMismatch).collect();
    assert_eq!(found.len(), 1, "{report}");
    assert!(found[0].message.contains("returned before reaching journaled step"), "{report}");
}

#[test]
fn a_recording_of_an_unregistered_workflow_or_a_broken_journal_is_refused() {
    let (finished, _) = recordings();
    let error = ReplayCheck::new()
        .workflow(tidemark::workflow("other", 1, reserve_then_charge))
        .recorded_json(&finished)
        .run()
        .unwrap_err();
    assert_eq!(error.code(), tidemark::workflow::workflow_codes::UNKNOWN_WORKFLOW);
    let mut gapped = parse_recorded(&finished).unwrap().remove(0);
    gapped.journal.remove(0);
    let error = ReplayCheck::new().workflow(tidemark::workflow("order", 1, reserve_then_charge)).recorded(gapped).run();
    assert_eq!(error.unwrap_err().code(), tidemark::codes::INVALID_ARGUMENT);
    let error = ReplayCheck::new()
        .workflow(tidemark::workflow("order", 1, reserve_then_charge))
        .recorded_json(&finished)
        .recorded_json(&finished)
        .run();
    assert_eq!(error.unwrap_err().code(), tidemark::codes::ALREADY_EXISTS);
}

#[test]
fn a_run_recorded_by_a_service_replays() {
    // The production path: a run of an embedded service, read as the API serves it.
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let json = runtime.block_on(async {
        async fn short(ctx: Context, _: Value) -> Result<String, WorkflowError> {
            ctx.step("reserve", None, external("reserve")).await?;
            ctx.step("charge", None, external("charge")).await
        }
        let service = Service::builder()
            .data_dir(dir.path())
            .without_auth("main")
            .workflow(tidemark::workflow("order", 1, short))
            .build()
            .unwrap();
        service.start().await.unwrap();
        let tenant = service.tenant("main").await.unwrap();
        let handle = tenant.start_run(StartRequest::new("order-9", "order", 1, json!({}))).await.unwrap();
        let _: String = handle.result().await.unwrap();
        let detail = tenant.run("order-9").await.unwrap().unwrap();
        service.shutdown().await;
        serde_json::to_string(&detail).unwrap()
    });
    let report = replay(appends_a_receipt, &[&json]);
    let found: Vec<_> = report.of_kind(FindingKind::RecordedJournalMismatch).collect();
    // `appends_a_receipt` sleeps where the recorded code charged: caught at position 1.
    assert_eq!(found.len(), 1, "{report}");
    assert_eq!(found[0].seq, Some(1), "{report}");
    assert_eq!(found[0].run_id, "order-9");
}

// ---------------------------------------------------------------------------------------------
// Long-lived runs: a workflow that continues as new, with a patch point and a deadline-free
// sleep, passes at every boundary of its whole chain.
// ---------------------------------------------------------------------------------------------

fn tally(effects: Effects) -> Workflow {
    tidemark::workflow("tally", 1, move |ctx: Context, left: u32| {
        let effects = effects.clone();
        async move {
            let counted: u32 = ctx
                .step("count", None, move |key| async move {
                    effects.record(&format!("count {left}"), &key);
                    Ok(left)
                })
                .await?;
            if ctx.patched("nap")? {
                ctx.sleep(Duration::from_secs(600)).await?;
            }
            if counted > 0 {
                return Err(ctx.continue_as_new(&(counted - 1)));
            }
            Ok(counted)
        }
    })
}

#[test]
fn a_chain_of_runs_continued_as_new_passes_at_every_boundary() {
    let effects = Effects::new();
    let report = CrashTest::new(tally(effects.clone())).input(&2_u32).effects(&effects).run().unwrap();
    report.assert_ok();
    let statuses: Vec<(&str, RunStatus)> = report.runs.iter().map(|d| (d.run.run_id.as_str(), d.run.status)).collect();
    assert_eq!(
        statuses,
        vec![
            ("kit-run", RunStatus::Continued),
            ("kit-run.c1", RunStatus::Continued),
            ("kit-run.c2", RunStatus::Completed)
        ],
        "{report}"
    );
    assert!(report.boundaries >= 9, "three runs of three commits at least: {report}");
}
