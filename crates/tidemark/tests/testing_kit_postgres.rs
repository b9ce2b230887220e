//! The workflow authors' test kit (`tidemark::testing`) on workflows written for PostgreSQL
//! (`tidemark::postgres::Workflow`, transactional steps on an `ApplyTransaction`): each
//! execution runs in a throwaway schema of the test server, crashed at every commit of its
//! worker's connection in turn through the store's commit hook. A correct saga passes, each
//! mistake is caught as on SQLite, recorded journals replay, and no schema is left behind.
//! Skipped, saying why, without a PostgreSQL server (`TIDEMARK_TEST_POSTGRES_URL`, default the
//! local one).

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use serde_json::{json, Value};
use tidemark::postgres::{ApplyTransaction, Context, Migration, PgWorkflows, Workflow};
use tidemark::prelude::{RetryPolicy, StepFailure};
use tidemark::testing::{CrashTest, Effects, FindingKind, ReplayCheck, Report};
use tidemark::workflow::WorkflowError;

mod kit_shared;
use kit_shared::{
    appends_a_receipt, assert_the_saga_compensated_at_every_boundary, assert_the_saga_completed_at_every_boundary,
    branches_on_the_live_clock, external, notify, reorders_the_steps, reserve_then_charge, FakePayments, Order,
};

/// The test server's URL, or `None` after saying why the test is skipped.
fn server() -> Option<String> {
    let url = std::env::var("TIDEMARK_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    match postgres::Client::connect(&url, postgres::NoTls) {
        Ok(_) => Some(url),
        Err(error) => {
            println!("SKIPPED: PostgreSQL not reachable at {url}: {error}");
            None
        }
    }
}

/// The kit's schemas of this process (`tidemark_kit_<pid>_...`).
fn kit_schemas(url: &str) -> Vec<String> {
    let mut client = postgres::Client::connect(url, postgres::NoTls).unwrap();
    let prefix = format!("tidemark_kit_{}_", std::process::id());
    client
        .query("SELECT nspname::text FROM pg_namespace WHERE starts_with(nspname, $1)", &[&prefix])
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// One kit run at a time in this process (so that each can check that it left no schema), on
/// two cores the faster way anyway.
fn one_at_a_time() -> MutexGuard<'static, ()> {
    static KIT: Mutex<()> = Mutex::new(());
    KIT.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Run a crash test on the server and check that its schemas are gone afterwards.
fn crash_test(url: &str, test: CrashTest<PgWorkflows>) -> Report {
    let _one = one_at_a_time();
    let report = test.database(url).run().unwrap();
    assert_eq!(kit_schemas(url), Vec::<String>::new(), "the kit left schemas behind");
    report
}

// ---------------------------------------------------------------------------------------------
// A correct saga, as in testing_kit.rs but on PostgreSQL: stock reserved in the workflow's
// schema, a card charged by a fake payment service that fails the first call of every key, an
// hour's sleep, a child that e-mails, and the compensation of the reservation when the card is
// declined.
// ---------------------------------------------------------------------------------------------

fn stock_table() -> Migration {
    Migration::sql(
        "0001_reservations",
        "CREATE TABLE {s}.reservations (order_id text PRIMARY KEY, status text NOT NULL)",
    )
}

fn reservation(tx: &ApplyTransaction, statement: &str, order_id: &str) -> Result<(), StepFailure> {
    let statement = statement.replace("{s}", tx.schema());
    tx.execute(&statement, &[&order_id]).map_err(tidemark::Error::from)?;
    Ok(())
}

fn order_saga(payments: FakePayments) -> Workflow {
    Workflow::new("order", 1, move |ctx: Context, order: Order| {
        let payments = payments.clone();
        async move {
            let id = order.order_id.clone();
            ctx.tx_step("reserve", None, move |tx: &ApplyTransaction| {
                reservation(tx, "INSERT INTO {s}.reservations (order_id, status) VALUES ($1, 'reserved')", &id)
            })
            .await?;
            let placed_at = ctx.now()?;
            let retries = RetryPolicy { max_attempts: 3, ..RetryPolicy::default() };
            let charged = ctx
                .step("charge", Some(retries), |key| {
                    let (payments, order) = (payments.clone(), order.clone());
                    async move { payments.charge(&order, &key).await }
                })
                .await;
            let charge = match charged {
                Ok(charge) => charge,
                Err(WorkflowError::StepFailed { step, message, .. }) => {
                    ctx.begin_compensation().await?;
                    let id = order.order_id.clone();
                    ctx.tx_compensation("release", None, move |tx: &ApplyTransaction| {
                        reservation(tx, "UPDATE {s}.reservations SET status = 'released' WHERE order_id = $1", &id)
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

fn saga_test(effects: &Effects, amount: i64) -> CrashTest<PgWorkflows> {
    CrashTest::new(order_saga(FakePayments { effects: effects.clone() }))
        .workflow(notify(effects.clone()))
        .input(&Order { order_id: "order-1".into(), amount })
        .effects(effects)
        .migration(stock_table())
        .random_schedules(4)
}

#[test]
fn on_postgres_a_correct_saga_passes_at_every_boundary() {
    let Some(url) = server() else { return };
    let effects = Effects::new();
    let report = crash_test(&url, saga_test(&effects, 500));
    println!("{report}");
    assert_the_saga_completed_at_every_boundary(&report);
    assert_eq!(report.random_schedules, 4, "{report}");
}

#[test]
fn on_postgres_a_compensating_saga_passes_at_every_boundary() {
    let Some(url) = server() else { return };
    let effects = Effects::new();
    let report = crash_test(&url, saga_test(&effects, 5_000).random_schedules(0));
    assert_the_saga_compensated_at_every_boundary(&report);
}

// ---------------------------------------------------------------------------------------------
// Wrong workflows, each caught on PostgreSQL too.
// ---------------------------------------------------------------------------------------------

#[test]
fn on_postgres_branching_on_the_live_clock_is_a_non_deterministic_replay() {
    let Some(url) = server() else { return };
    let report = crash_test(&url, CrashTest::new(branches_on_the_live_clock::<PgWorkflows>()).random_schedules(0));
    let found: Vec<_> = report.of_kind(FindingKind::NonDeterministicReplay).collect();
    assert!(!found.is_empty() && found.iter().all(|f| !f.crashes.is_empty()), "{report}");
    assert!(found.iter().any(|f| f.step.as_deref() == Some("expire")), "{report}");
}

#[test]
fn on_postgres_an_external_call_in_a_transactional_step_is_a_step_that_ran_twice() {
    let Some(url) = server() else { return };
    let effects = Effects::new();
    let recorder = effects.clone();
    let workflow = Workflow::new("tx_mail", 1, move |ctx: Context, _: Value| {
        let recorder = recorder.clone();
        async move {
            ctx.tx_step("record_and_mail", None, move |tx: &ApplyTransaction| {
                let insert = format!("INSERT INTO {}.sent (what) VALUES ('mail')", tx.schema());
                tx.execute(&insert, &[]).map_err(tidemark::Error::from)?;
                // Wrong: this call is not rolled back with the transaction.
                recorder.record("receipt mail", "order-4");
                Ok(())
            })
            .await
        }
    });
    let test = CrashTest::new(workflow)
        .effects(&effects)
        .migration(Migration::sql("0001_sent", "CREATE TABLE {s}.sent (what text NOT NULL)"))
        .random_schedules(0);
    let report = crash_test(&url, test);
    let found: Vec<_> = report.of_kind(FindingKind::StepRanTwice).collect();
    assert!(!found.is_empty(), "{report}");
    assert!(found.iter().all(|f| f.message.contains("receipt mail")), "the row itself committed once: {report}");
}

#[test]
fn on_postgres_a_write_from_an_external_step_lands_twice() {
    let Some(url) = server() else { return };
    let server_url = url.clone();
    let workflow = Workflow::new("own_writes", 1, move |ctx: Context, _: Value| {
        let url = server_url.clone();
        async move {
            let schema: String =
                ctx.tx_step("where", None, |tx: &ApplyTransaction| Ok(tx.schema().to_string())).await?;
            ctx.step("remember", None, move |_key| async move {
                // Wrong: a write to the workflow's database outside a transactional step is not
                // made exactly once. (The blocking client, on a thread off the kit's runtime.)
                std::thread::spawn(move || {
                    let mut client = postgres::Client::connect(&url, postgres::NoTls)?;
                    client.execute(&format!("INSERT INTO {schema}.remembered (n) VALUES (1)"), &[]).map(drop)
                })
                .join()
                .expect("the write's thread")
                .map_err(|e| StepFailure::retryable(e.to_string()))
            })
            .await?;
            ctx.step("ship", None, external("ship")).await
        }
    });
    let test = CrashTest::new(workflow)
        .migration(Migration::sql("0001_remembered", "CREATE TABLE {s}.remembered (n integer NOT NULL)"))
        .compare_outputs(false) // each execution's schema has its own name, which `where` returns
        .random_schedules(0);
    let report = crash_test(&url, test);
    let found: Vec<_> = report.of_kind(FindingKind::StepRanTwice).collect();
    assert!(!found.is_empty(), "{report}");
    assert!(found.iter().all(|f| f.message.contains("table remembered holds 2 rows, 1 after")), "{report}");
}

#[test]
fn on_postgres_a_crash_test_without_a_database_is_an_invalid_argument() {
    let workflow =
        Workflow::new("nowhere", 1, |ctx: Context, _: Value| async move { ctx.step("a", None, external("a")).await });
    let error = CrashTest::new(workflow).run().unwrap_err();
    assert_eq!(error.code(), tidemark::codes::INVALID_ARGUMENT);
    assert!(error.to_string().contains(".database(url)"), "{error}");
}

// ---------------------------------------------------------------------------------------------
// Recorded journals replayed against new code, in a throwaway schema.
// ---------------------------------------------------------------------------------------------

#[test]
fn on_postgres_a_recorded_journal_replays_on_code_that_appends_and_not_on_code_that_reorders() {
    let Some(url) = server() else { return };
    let recorded = crash_test(
        &url,
        CrashTest::new(Workflow::new("order", 1, reserve_then_charge)).every_boundary(false).random_schedules(0),
    );
    recorded.assert_ok();
    let json = serde_json::to_string(&recorded.runs[0]).unwrap();
    let replay = |workflow: Workflow| {
        let _one = one_at_a_time();
        let report = ReplayCheck::on_postgres(&url).workflow(workflow).recorded_json(&json).run().unwrap();
        assert_eq!(kit_schemas(&url), Vec::<String>::new(), "the replay left its schema behind");
        report
    };
    let report = replay(Workflow::new("order", 1, appends_a_receipt));
    report.assert_ok();
    let end = report.runs[0].run.error.clone().unwrap_or_default();
    assert!(end.starts_with(tidemark::workflow::REPLAY_END) && end.contains("\"receipt\""), "{report}");
    let report = replay(Workflow::new("order", 1, reorders_the_steps));
    let found: Vec<_> = report.of_kind(FindingKind::RecordedJournalMismatch).collect();
    assert_eq!(found.len(), 1, "{report}");
    assert!(found[0].seq == Some(0) && found[0].step.as_deref() == Some("reserve"), "{report}");
    // A run id imported twice into one schema is refused, nothing replayed.
    let _one = one_at_a_time();
    let error = ReplayCheck::on_postgres(&url)
        .workflow(Workflow::new("order", 1, reserve_then_charge))
        .recorded_json(&json)
        .recorded_json(&json)
        .run()
        .unwrap_err();
    assert_eq!(error.code(), tidemark::codes::ALREADY_EXISTS, "{error}");
    assert_eq!(kit_schemas(&url), Vec::<String>::new());
}
