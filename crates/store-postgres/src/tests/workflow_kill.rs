//! A worker process killed with SIGKILL while it holds leases on PostgreSQL: its runs stay
//! leased until the leases expire, then a worker in another process (this one) takes them over
//! and finishes them, and the transactional step the dead worker committed is not done again.
//!
//! The doomed worker is this test binary run again as a child process (only `kill_child`, which
//! does nothing in a normal test run), with the connection and schema in its environment: it
//! runs a worker whose external step never returns, and is killed once every run is leased to it
//! and past its transactional step. Every wait is bounded.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tidemark_core::workflow::{RunStatus, StartRequest, StepFailure, StepStatus, WorkflowStore};
use tidemark_engine::workflow::tokio::runtime::Builder;
use tidemark_engine::workflow::{Worker, WorkerOptions, WorkflowOptions, Workflows, Writer};

use super::support::test_db;
use crate::{ApplyTransaction, PgWorkflows};

const CHILD_CONN: &str = "TIDEMARK_PG_KILL_CONN";
const CHILD_SCHEMA: &str = "TIDEMARK_PG_KILL_SCHEMA";
const RUNS: usize = 6;
/// The doomed worker's lease: its runs are taken over this long after its last heartbeat.
const LEASE_MS: i64 = 1_500;
/// How long the test waits for the child to hold every run, and for the takeover.
const WAIT: Duration = Duration::from_secs(60);

/// `reserve` writes the user's row (transactional: once), then `ship` is an external step that
/// hangs forever in the doomed worker (`hang`) and returns at once in the rescuer.
fn workflows(hang: bool) -> Workflows<PgWorkflows> {
    let mut workflows = Workflows::new();
    workflows
        .register(
            "shipment",
            1,
            WorkflowOptions { concurrency_max: None, retry: Default::default() },
            move |ctx, _input: Value| async move {
                let run_id = ctx.run_id().to_string();
                let _: Value = ctx
                    .tx_step("reserve", None, move |tx: &ApplyTransaction| {
                        let insert = format!("INSERT INTO \"{}\".reserved (run_id) VALUES ($1)", tx.schema());
                        tx.execute(&insert, &[&run_id])?;
                        Ok(json!("reserved"))
                    })
                    .await?;
                let shipped: Value = ctx
                    .step("ship", None, move |_key| async move {
                        if hang {
                            std::future::pending::<()>().await;
                        }
                        Ok::<_, StepFailure>(json!("shipped"))
                    })
                    .await?;
                Ok(shipped)
            },
        )
        .unwrap();
    workflows
}

fn options(worker_id: &str) -> WorkerOptions {
    WorkerOptions {
        poll_interval_ms: 10,
        lease_ms: LEASE_MS,
        heartbeat_ms: Some(300),
        concurrency: 16,
        ..WorkerOptions::new(worker_id)
    }
}

/// Runs only inside the child started by the test below; in a normal test run it returns at once.
#[test]
fn kill_child() {
    let (Ok(conn), Ok(schema)) = (std::env::var(CHILD_CONN), std::env::var(CHILD_SCHEMA)) else { return };
    let writer = Writer::spawn(move || PgWorkflows::open(&conn, &schema)).expect("open the workflow store");
    let worker = Arc::new(Worker::new(writer, workflows(true), options("doomed")).expect("worker"));
    let rt = Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("tokio runtime");
    // Works until killed.
    let report = rt.block_on(worker.run_until(std::future::pending()));
    panic!("the doomed worker stopped on its own: {report:?}");
}

#[test]
fn a_worker_killed_with_sigkill_has_its_runs_taken_over_after_the_lease() {
    let db = test_db!("kill");
    let schema = db.schema("wf");
    let mut store = PgWorkflows::init(&db.conn, &schema).unwrap();
    store.client().batch_execute(&format!("CREATE TABLE \"{schema}\".reserved (run_id text PRIMARY KEY)")).unwrap();
    let requests: Vec<StartRequest> =
        (0..RUNS).map(|i| StartRequest::new(&format!("ship-{i}"), "shipment", 1, json!({}))).collect();
    store.start_runs(&requests, tidemark_engine::now_ms()).unwrap();

    // The child's sessions carry a name of their own, so that their end can be seen on the server
    // (a URL connection string keeps tidemark's default name).
    let doomed_name = format!("tidemark_doomed_{}", std::process::id());
    let child_conn =
        if db.conn.contains("://") { db.conn.clone() } else { format!("{} application_name={doomed_name}", db.conn) };
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args(["tests::workflow_kill::kill_child", "--exact", "--nocapture", "--test-threads", "1"])
        .env(CHILD_CONN, &child_conn)
        .env(CHILD_SCHEMA, &schema)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the doomed worker");
    // Wait until the child holds every run and has committed every run's transactional step.
    let mut client = db.client();
    let progress = format!(
        "SELECT (SELECT count(*) FROM \"{schema}\".runs WHERE lease_owner = 'doomed'),
                (SELECT count(*) FROM \"{schema}\".journal WHERE name = 'reserve' AND status = 'completed')"
    );
    let deadline = Instant::now() + WAIT;
    loop {
        let row = client.query_one(&progress, &[]).unwrap();
        let (leased, reserved): (i64, i64) = (row.get(0), row.get(1));
        if leased == RUNS as i64 && reserved == RUNS as i64 {
            break;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the doomed worker exited ({status}) before holding every run");
        }
        assert!(Instant::now() < deadline, "the doomed worker did not lease every run ({leased}, {reserved})");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().expect("SIGKILL the doomed worker");
    let status = child.wait().unwrap();
    assert!(!status.success(), "{status}");
    let killed_at = tidemark_engine::now_ms();
    // Its leases outlive it: still held by the dead worker until they expire.
    for run in store.list_runs(&Default::default(), 100).unwrap() {
        assert_eq!(run.lease_owner.as_deref(), Some("doomed"), "{}", run.run_id);
        assert!(run.lease_expires_at_ms.unwrap() > killed_at - LEASE_MS, "{}", run.run_id);
    }

    // A worker in this process takes the runs over once the leases expire and finishes them.
    let writer = Writer::spawn({
        let (conn, schema) = (db.conn.clone(), schema.clone());
        move || PgWorkflows::open(&conn, &schema)
    })
    .unwrap();
    let rescuer = Arc::new(Worker::new(writer, workflows(false), options("rescuer")).unwrap());
    let rt = Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let deadline = Instant::now() + WAIT;
    let mut recovered = 0;
    loop {
        let report = rt.block_on(rescuer.run_until_idle()).unwrap();
        recovered += report.recovered;
        let runs = store.list_runs(&Default::default(), 100).unwrap();
        if runs.iter().all(|r| r.status.is_terminal()) {
            break;
        }
        assert!(Instant::now() < deadline, "the runs were not taken over: {runs:#?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(recovered, RUNS as u64);
    for run in store.list_runs(&Default::default(), 100).unwrap() {
        assert_eq!(run.status, RunStatus::Completed, "{:?}", run.error);
        assert_eq!(run.recoveries, 1, "{}", run.run_id);
        assert_eq!(run.result, Some(json!("shipped")));
        let detail = store.run(&run.run_id).unwrap().unwrap();
        let reserve = &detail.journal[0];
        assert_eq!((reserve.name.as_str(), reserve.status, reserve.attempts), ("reserve", StepStatus::Completed, 1));
        assert!(detail.run.updated_at_ms >= killed_at);
    }
    let reserved: i64 = client.query_one(&format!("SELECT count(*) FROM \"{schema}\".reserved"), &[]).unwrap().get(0);
    assert_eq!(reserved, RUNS as i64, "the dead worker's committed transactional steps were not done again");
    // The dead worker's session is gone from the server (its socket closed with the process; had
    // it been inside a transaction, the server rolled that back).
    if !db.conn.contains("://") {
        let sessions = "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1";
        let deadline = Instant::now() + WAIT;
        while client.query_one(sessions, &[&doomed_name]).unwrap().get::<_, i64>(0) > 0 {
            assert!(Instant::now() < deadline, "the killed worker's session is still on the server");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
