//! The workflow store on PostgreSQL (`PgWorkflows`): the SQLite store's contract tests
//! (`crates/cli/tests/it/workflow_store.rs`) with the same assertions, then what only a shared
//! server can show: claims, per-type budgets, per-key serialization and wake-ups across several
//! stores (connections) racing each other.
//!
//! Time is always an explicit `now_ms`; nothing here reads the wall clock.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};

use serde_json::{json, Value};
use tidemark_core::error::codes;
use tidemark_core::queue::{Enqueue, QueueSpec, QueueStore};
use tidemark_core::workflow::{
    child_event, child_run_id, continuation_run_id, ChildLease, ClaimRequest, ClaimedRun, DetailPage, FinishStatus,
    JournalOp, JournalWrite, LeaseState, RunDetail, RunFilter, RunStatus, StartOutcome, StartRequest, StepFailure,
    StepKind, StepStatus, SuspendStatus, TxBody, WorkflowStore, WorkflowVersion, WriteResult, CLAIM_BATCH_MAX,
    DETAIL_ATTEMPTS_MAX, ERROR_BYTES_MAX, RUN_STEPS_MAX,
};
use tidemark_core::Error;

use super::support::{test_db, TestDb};
use crate::{ApplyTransaction, PgWorkflows};

const WF: &str = "order_saga";
const LEASE_MS: i64 = 1_000;

type Op = JournalOp<ApplyTransaction>;

/// The store first: fields drop in order, so its connection is closed before `db` drops the
/// schema.
struct Db {
    store: PgWorkflows,
    db: TestDb,
    schema: String,
}

impl Db {
    /// Another store (its own connection) on the same schema: another worker process.
    fn another(&self) -> PgWorkflows {
        PgWorkflows::open(&self.db.conn, &self.schema).unwrap()
    }

    /// A statement of the test's own on the schema's tables (`{s}` is the schema).
    fn scalar(&self, template: &str) -> i64 {
        let statement = crate::schema::sql(&self.schema, template);
        self.db.client().query_one(&statement, &[]).unwrap().get(0)
    }
}

fn open(db: TestDb) -> Db {
    let schema = db.schema("wf");
    let store = PgWorkflows::init(&db.conn, &schema).unwrap();
    Db { store, db, schema }
}

macro_rules! db {
    ($name:expr) => {
        open(test_db!($name))
    };
}

fn req(run_id: &str) -> StartRequest {
    StartRequest {
        run_id: run_id.into(),
        workflow: WF.into(),
        version: 1,
        input: json!({"order": run_id}),
        key: None,
        start_at_ms: None,
        queue: None,
        deadline_ms: None,
    }
}

fn keyed(run_id: &str, key: &str) -> StartRequest {
    StartRequest { key: Some(key.into()), ..req(run_id) }
}

fn version(workflow: &str, version: u32, concurrency_max: Option<u32>) -> WorkflowVersion {
    WorkflowVersion { workflow: workflow.into(), version, concurrency_max }
}

fn claim_request(worker: &str, workflows: Vec<WorkflowVersion>, limit: usize) -> ClaimRequest {
    ClaimRequest { worker_id: worker.into(), workflows, limit, lease_ms: LEASE_MS }
}

/// Claim up to 100 runs of `order_saga` v1 as `worker`.
fn claim(store: &mut PgWorkflows, worker: &str, now_ms: i64) -> Vec<ClaimedRun> {
    store.claim(&claim_request(worker, vec![version(WF, 1, None)], 100), now_ms).unwrap()
}

fn claim_ids(store: &mut PgWorkflows, worker: &str, now_ms: i64) -> Vec<String> {
    claim(store, worker, now_ms).into_iter().map(|c| c.run.run_id).collect()
}

fn start(store: &mut PgWorkflows, requests: &[StartRequest], now_ms: i64) {
    for outcome in store.start_runs(requests, now_ms).unwrap() {
        assert!(matches!(outcome, StartOutcome::Started { .. }), "{outcome:?}");
    }
}

/// Start one run and claim it; returns its lease token.
fn started_and_claimed(store: &mut PgWorkflows, run_id: &str, now_ms: i64) -> String {
    start(store, &[req(run_id)], now_ms);
    let claimed = claim(store, "w1", now_ms);
    claimed.into_iter().find(|c| c.run.run_id == run_id).expect("claimed").lease_token
}

fn write(run_id: &str, token: &str, op: Op) -> JournalWrite<ApplyTransaction> {
    JournalWrite { run_id: run_id.into(), lease_token: token.into(), op }
}

fn step_ok(seq: u32, name: &str, attempt: u32, output: Value) -> Op {
    JournalOp::StepAttempt {
        seq,
        name: name.into(),
        kind: StepKind::External,
        attempt,
        result: Ok(output),
        retry_at_ms: None,
    }
}

fn step_err(seq: u32, name: &str, attempt: u32, failure: StepFailure, retry_at_ms: Option<i64>) -> Op {
    JournalOp::StepAttempt {
        seq,
        name: name.into(),
        kind: StepKind::External,
        attempt,
        result: Err(failure),
        retry_at_ms,
    }
}

fn finish(status: FinishStatus, result: Option<Value>, error: Option<&str>) -> Op {
    JournalOp::Finish { status, result, error: error.map(String::from) }
}

fn commit_one(store: &mut PgWorkflows, run_id: &str, token: &str, op: Op, now_ms: i64) -> WriteResult {
    let mut results = store.commit(vec![write(run_id, token, op)], now_ms).unwrap();
    assert_eq!(results.len(), 1);
    results.remove(0)
}

fn detail(store: &PgWorkflows, run_id: &str) -> RunDetail {
    store.run(run_id).unwrap().unwrap_or_else(|| panic!("no run {run_id}"))
}

fn code(error: Error) -> &'static str {
    assert!(error.is_invalid_input(), "{error:?} is not invalid input");
    error.code()
}

/// The user's own table, in the workflow schema (a transactional step writes it).
fn orders_table(store: &mut PgWorkflows) {
    let schema = store.schema().to_string();
    store
        .client()
        .batch_execute(&format!("CREATE TABLE \"{schema}\".orders (id text PRIMARY KEY, total bigint NOT NULL)"))
        .unwrap();
}

fn orders(store: &mut PgWorkflows) -> i64 {
    let schema = store.schema().to_string();
    store.client().query_one(&format!("SELECT count(*) FROM \"{schema}\".orders"), &[]).unwrap().get(0)
}

fn insert_order(id: &'static str, fail_after: bool) -> TxBody<ApplyTransaction> {
    Box::new(move |tx: &ApplyTransaction| {
        let insert = format!("INSERT INTO \"{}\".orders (id, total) VALUES ($1, 300)", tx.schema());
        tx.execute(&insert, &[&id])?;
        if fail_after {
            return Err(StepFailure::retryable("payment service said no"));
        }
        Ok(json!({"order": id}))
    })
}

fn tx_step(seq: u32, attempt: u32, body: TxBody<ApplyTransaction>, retry_at_ms: Option<i64>) -> Op {
    JournalOp::TxStep { seq, name: "save_order".into(), kind: StepKind::Transactional, attempt, body, retry_at_ms }
}

/// The current lease token of a run (tokens are not part of `RunRecord`).
fn token_of(d: &Db, run_id: &str) -> String {
    let statement = crate::schema::sql(&d.schema, "SELECT lease_token FROM {s}.runs WHERE run_id = $1");
    d.db.client().query_one(&statement, &[&run_id]).unwrap().get(0)
}

// ---------------------------------------------------------------------------------------------
// start_runs

#[test]
fn start_is_idempotent_per_run_id_and_detects_conflicts() {
    let mut d = db!("wf_start");
    let out = d.store.start_runs(&[req("r1"), req("r1")], 1_000).unwrap();
    assert_eq!(
        out,
        [
            StartOutcome::Started { run_id: "r1".into() },
            StartOutcome::Existing { run_id: "r1".into(), status: RunStatus::Pending },
        ]
    );
    let before = detail(&d.store, "r1");
    assert_eq!(
        (before.run.status, before.run.wake_at_ms, before.run.created_at_ms),
        (RunStatus::Pending, 1_000, 1_000)
    );
    assert_eq!(before.run.input, json!({"order": "r1"}));
    let other_input = StartRequest { input: json!({"order": "other"}), ..req("r1") };
    let other_workflow = StartRequest { workflow: "refund".into(), ..req("r1") };
    let out = d.store.start_runs(&[other_input, other_workflow, req("r1")], 2_000).unwrap();
    assert!(matches!(&out[0], StartOutcome::Conflict { run_id, reason } if run_id == "r1" && reason.contains("input")));
    assert!(matches!(&out[1], StartOutcome::Conflict { reason, .. } if reason.contains("order_saga")));
    assert_eq!(out[2], StartOutcome::Existing { run_id: "r1".into(), status: RunStatus::Pending });
    assert_eq!(detail(&d.store, "r1"), before);
    // The same id twice in one batch with different inputs: the second is a conflict.
    let out = d.store.start_runs(&[req("r2"), StartRequest { input: json!(2), ..req("r2") }], 3_000).unwrap();
    assert!(matches!(out[1], StartOutcome::Conflict { .. }), "{out:?}");
}

#[test]
fn concurrent_starts_of_one_id_on_many_connections_start_it_once() {
    let d = db!("wf_start_race");
    const THREADS: usize = 6;
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|i| {
            let mut store = d.another();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                barrier.wait();
                // Overlapping batches in different orders: they may wait for each other's
                // inserts, never in a cycle.
                let mut ids: Vec<StartRequest> = (0..20).map(|n| req(&format!("r{n:02}"))).collect();
                if i % 2 == 1 {
                    ids.reverse();
                }
                store.start_runs(&ids, 1_000).unwrap()
            })
        })
        .collect();
    let mut started = 0;
    for handle in handles {
        for outcome in handle.join().unwrap() {
            match outcome {
                StartOutcome::Started { .. } => started += 1,
                StartOutcome::Existing { status, .. } => assert_eq!(status, RunStatus::Pending),
                other => panic!("{other:?}"),
            }
        }
    }
    assert_eq!(started, 20, "each run id started exactly once");
    assert_eq!(d.scalar("SELECT count(*) FROM {s}.runs"), 20);
}

#[test]
fn start_at_delays_the_first_claim() {
    let mut d = db!("wf_start_at");
    start(&mut d.store, &[StartRequest { start_at_ms: Some(5_000), ..req("later") }], 1_000);
    assert_eq!(detail(&d.store, "later").run.wake_at_ms, 5_000);
    assert!(claim_ids(&mut d.store, "w1", 4_999).is_empty());
    assert_eq!(claim_ids(&mut d.store, "w1", 5_000), ["later"]);
}

#[test]
fn bad_start_requests_are_refused_and_write_nothing() {
    let mut d = db!("wf_bad_start");
    let cases: Vec<(Vec<StartRequest>, &str)> = vec![
        (vec![], codes::LIMIT_EXCEEDED),
        (vec![req("ok"), req("bad id")], codes::INVALID_ID),
        (vec![StartRequest { workflow: String::new(), ..req("r") }], codes::INVALID_ID),
        (vec![StartRequest { key: Some("a/b".into()), ..req("r") }], codes::INVALID_ID),
        (vec![StartRequest { version: 0, ..req("r") }], codes::INVALID_ARGUMENT),
        (vec![StartRequest { input: json!("x".repeat(300 * 1024)), ..req("r") }], "invalid_input"),
        (vec![StartRequest { start_at_ms: Some(i64::MAX), ..req("r") }], codes::INVALID_ARGUMENT),
    ];
    for (requests, expected) in cases {
        assert_eq!(code(d.store.start_runs(&requests, 1_000).unwrap_err()), expected, "{requests:?}");
    }
    assert!(d.store.list_runs(&RunFilter::default(), 10).unwrap().is_empty());
    // Any u32 version is a version (stored as bigint).
    start(&mut d.store, &[StartRequest { version: u32::MAX, ..req("v-max") }], 1_000);
    assert_eq!(detail(&d.store, "v-max").run.version, u32::MAX);
}

// ---------------------------------------------------------------------------------------------
// claim, heartbeat, fencing

#[test]
fn claim_leases_due_runs_with_their_journal_and_unconsumed_events() {
    let mut d = db!("wf_claim");
    start(&mut d.store, &[req("r1"), req("r2")], 1_000);
    assert!(d.store.send_event("r2", "ev-1", "approved", &json!({"by": "ops"}), 1_100).unwrap());
    let claimed = claim(&mut d.store, "w1", 2_000);
    assert_eq!(claimed.len(), 2);
    for c in &claimed {
        assert_eq!(c.run.lease_owner.as_deref(), Some("w1"));
        assert_eq!(c.run.lease_expires_at_ms, Some(2_000 + LEASE_MS));
        assert_eq!(c.run.status, RunStatus::Pending, "claim leaves the status to the runtime");
        assert!(!c.recovered);
        assert!(c.journal.is_empty());
        assert_eq!(c.run, detail(&d.store, &c.run.run_id).run, "the claimed record is the stored one");
    }
    assert_ne!(claimed[0].lease_token, claimed[1].lease_token);
    let r2 = claimed.iter().find(|c| c.run.run_id == "r2").unwrap();
    assert_eq!(r2.events.len(), 1);
    assert_eq!(r2.events[0].payload, json!({"by": "ops"}));
    // Leased: nobody else gets them until the lease expires, on any connection.
    assert!(claim_ids(&mut d.another(), "w2", 2_500).is_empty());
    let token = claimed[0].lease_token.clone();
    let run_id = claimed[0].run.run_id.clone();
    assert_eq!(commit_one(&mut d.store, &run_id, &token, step_ok(0, "reserve", 1, json!(1)), 2_100), WriteResult::Done);
    assert_eq!(commit_one(&mut d.store, &run_id, &token, JournalOp::Release, 2_100), WriteResult::Done);
    let again = claim(&mut d.another(), "w2", 2_200);
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].journal.len(), 1);
    assert_eq!(again[0].journal[0].output, Some(json!(1)));
    assert!(!again[0].recovered, "a released lease is not a recovery");
}

#[test]
fn claim_takes_oldest_due_first_and_respects_the_limit() {
    let mut d = db!("wf_claim_order");
    start(&mut d.store, &[StartRequest { start_at_ms: Some(3_000), ..req("c") }], 1_000);
    start(&mut d.store, &[StartRequest { start_at_ms: Some(2_000), ..req("b") }], 1_000);
    start(&mut d.store, &[req("a")], 1_500);
    let got = d.store.claim(&claim_request("w1", vec![version(WF, 1, None)], 2), 5_000).unwrap();
    let ids: Vec<_> = got.iter().map(|c| c.run.run_id.as_str()).collect();
    assert_eq!(ids, ["a", "b"]);
}

#[test]
fn an_expired_lease_is_recovered_and_the_old_holder_is_fenced() {
    let mut d = db!("wf_recover");
    let old = started_and_claimed(&mut d.store, "r1", 1_000);
    let mut other = d.another();
    assert!(claim_ids(&mut other, "w2", 1_000 + LEASE_MS - 1).is_empty());
    let taken = claim(&mut other, "w2", 1_000 + LEASE_MS);
    assert_eq!(taken.len(), 1);
    assert!(taken[0].recovered);
    assert_eq!(taken[0].run.recoveries, 1);
    assert_ne!(taken[0].lease_token, old);
    let before = detail(&d.store, "r1");
    assert_eq!(commit_one(&mut d.store, "r1", &old, step_ok(0, "reserve", 1, json!(1)), 2_100), WriteResult::Fenced);
    assert_eq!(d.store.heartbeat("w1", &[("r1".into(), old.clone())], LEASE_MS, 2_100).unwrap(), [LeaseState::Lost]);
    assert_eq!(detail(&d.store, "r1"), before);
    let new = taken[0].lease_token.clone();
    assert_eq!(commit_one(&mut other, "r1", &new, step_ok(0, "reserve", 1, json!(1)), 2_100), WriteResult::Done);
}

#[test]
fn an_expired_lease_nobody_took_over_still_fences_by_token_only() {
    let mut d = db!("wf_expired");
    let token = started_and_claimed(&mut d.store, "r1", 1_000);
    assert_eq!(d.store.heartbeat("w1", &[("r1".into(), token.clone())], LEASE_MS, 5_000).unwrap(), [LeaseState::Lost]);
    assert_eq!(commit_one(&mut d.store, "r1", &token, step_ok(0, "reserve", 1, json!(1)), 5_000), WriteResult::Done);
}

#[test]
fn heartbeat_extends_held_leases_and_reports_cancel_requests() {
    let mut d = db!("wf_heartbeat");
    start(&mut d.store, &[req("r1"), req("r2")], 1_000);
    let claimed = claim(&mut d.store, "w1", 1_000);
    let leases: Vec<(String, String)> = claimed.iter().map(|c| (c.run.run_id.clone(), c.lease_token.clone())).collect();
    d.another().cancel("r2", "customer called", 1_200).unwrap();
    let states = d.store.heartbeat("w1", &leases, 5_000, 1_500).unwrap();
    for ((run_id, _), state) in leases.iter().zip(states) {
        assert_eq!(state, LeaseState::Held { cancel_requested: run_id == "r2" }, "{run_id}");
        assert_eq!(detail(&d.store, run_id).run.lease_expires_at_ms, Some(6_500));
    }
    assert!(claim_ids(&mut d.another(), "w2", 3_000).is_empty());
    let (run_id, token) = leases[0].clone();
    assert_eq!(d.store.heartbeat("w2", &[(run_id.clone(), token)], 5_000, 1_600).unwrap(), [LeaseState::Lost]);
    assert_eq!(d.store.heartbeat("w1", &[(run_id, "nottoken".into())], 5_000, 1_600).unwrap(), [LeaseState::Lost]);
    assert!(d.store.heartbeat("w1", &[], 5_000, 1_600).unwrap().is_empty());
    // Leases in any order, an unknown run among them: answered in the order asked.
    let mut mixed = leases.clone();
    mixed.reverse();
    mixed.insert(1, ("nobody".into(), "t".into()));
    let states = d.store.heartbeat("w1", &mixed, 5_000, 1_700).unwrap();
    assert_eq!(states[1], LeaseState::Lost);
    assert!(matches!(states[0], LeaseState::Held { cancel_requested: true }));
    assert!(matches!(states[2], LeaseState::Held { cancel_requested: false }));
}

#[test]
fn bad_claims_and_heartbeats_are_refused() {
    let mut d = db!("wf_bad_claim");
    start(&mut d.store, &[req("r1")], 1_000);
    let before = detail(&d.store, "r1");
    let good = claim_request("w1", vec![version(WF, 1, None)], 10);
    let cases = [
        (ClaimRequest { worker_id: "bad id".into(), ..good.clone() }, codes::INVALID_ID),
        (ClaimRequest { limit: 0, ..good.clone() }, codes::LIMIT_EXCEEDED),
        (ClaimRequest { limit: CLAIM_BATCH_MAX + 1, ..good.clone() }, codes::LIMIT_EXCEEDED),
        (ClaimRequest { workflows: vec![], ..good.clone() }, codes::LIMIT_EXCEEDED),
        (ClaimRequest { workflows: vec![version(WF, 0, None)], ..good.clone() }, codes::INVALID_ARGUMENT),
        (ClaimRequest { workflows: vec![version(WF, 1, Some(0))], ..good.clone() }, codes::INVALID_ARGUMENT),
        (ClaimRequest { lease_ms: 1, ..good.clone() }, codes::INVALID_ARGUMENT),
        (ClaimRequest { lease_ms: i64::MAX, ..good.clone() }, codes::INVALID_ARGUMENT),
    ];
    for (request, expected) in cases {
        assert_eq!(code(d.store.claim(&request, 1_000).unwrap_err()), expected, "{request:?}");
    }
    assert_eq!(
        code(d.store.heartbeat("w1", &[("r1".into(), "t".into())], 0, 1_000).unwrap_err()),
        codes::INVALID_ARGUMENT
    );
    assert_eq!(code(d.store.heartbeat("w 1", &[], 1_000, 1_000).unwrap_err()), codes::INVALID_ID);
    let too_many: Vec<(String, String)> = (0..=CLAIM_BATCH_MAX).map(|i| (format!("r{i}"), "t".into())).collect();
    assert_eq!(code(d.store.heartbeat("w1", &too_many, 1_000, 1_000).unwrap_err()), codes::LIMIT_EXCEEDED);
    assert_eq!(detail(&d.store, "r1"), before);
}

#[test]
fn only_registered_versions_are_claimed_and_the_rest_is_reported() {
    let mut d = db!("wf_versions");
    start(&mut d.store, &[req("v1-run"), StartRequest { version: 2, ..req("v2-run") }], 1_000);
    start(&mut d.store, &[StartRequest { workflow: "refund".into(), ..req("refund-run") }], 1_000);
    assert_eq!(claim_ids(&mut d.store, "w1", 2_000), ["v1-run"]);
    let known = [version(WF, 1, None)];
    let unclaimable = d.store.unclaimable(&known).unwrap();
    let summary: Vec<(String, u32, u64)> = unclaimable.into_iter().map(|u| (u.workflow, u.version, u.runs)).collect();
    assert_eq!(summary, [(WF.to_string(), 2, 1), ("refund".to_string(), 1, 1)]);
    let got = d.store.claim(&claim_request("w2", vec![version(WF, 2, None), version("refund", 1, None)], 10), 2_000);
    assert_eq!(got.unwrap().len(), 2);
    assert_eq!(d.store.unclaimable(&known).unwrap().len(), 2, "leased runs are still active runs of unknown versions");
}

#[test]
fn the_per_type_limit_counts_live_leases_across_workers_and_versions() {
    let mut d = db!("wf_type_limit");
    let runs: Vec<StartRequest> = (0..5).map(|i| req(&format!("r{i}"))).collect();
    start(&mut d.store, &runs, 1_000);
    start(&mut d.store, &[StartRequest { version: 2, ..req("v2") }], 1_000);
    let limited = || vec![version(WF, 1, Some(2)), version(WF, 2, Some(2))];
    let mut other = d.another();
    let a = d.store.claim(&claim_request("wa", limited(), 10), 2_000).unwrap();
    assert_eq!(a.len(), 2);
    assert!(other.claim(&claim_request("wb", limited(), 10), 2_000).unwrap().is_empty());
    let done = &a[0];
    let end = finish(FinishStatus::Completed, Some(json!("ok")), None);
    assert_eq!(commit_one(&mut d.store, &done.run.run_id, &done.lease_token, end, 2_100), WriteResult::Done);
    assert_eq!(other.claim(&claim_request("wb", limited(), 10), 2_200).unwrap().len(), 1);
    let later = other.claim(&claim_request("wb", limited(), 10), 2_000 + 10 * LEASE_MS).unwrap();
    assert_eq!(later.len(), 2);
    let unlimited = d
        .store
        .claim(&claim_request("wc", vec![version(WF, 1, None), version(WF, 2, None)], 10), 2_000 + 10 * LEASE_MS);
    assert_eq!(unlimited.unwrap().len(), 3, "5 active runs, 2 of them leased");
}

/// Many stores (connections) claim at the same moment, again and again, under a per-type limit
/// of 3: the live leases of the type never exceed 3 (the budget lock makes each claim count the
/// others' committed leases), and no run is leased twice.
#[test]
fn the_per_type_budget_holds_when_many_connections_claim_at_once() {
    let mut d = db!("wf_budget_race");
    let runs: Vec<StartRequest> = (0..60).map(|i| req(&format!("r{i:02}"))).collect();
    start(&mut d.store, &runs, 1_000);
    const THREADS: usize = 6;
    const MAX: u32 = 3;
    for round in 0..6_i64 {
        // Each round at a time when every earlier lease has expired: the whole budget is free.
        let now = 10_000 + round * 10 * LEASE_MS;
        let barrier = Arc::new(Barrier::new(THREADS));
        let handles: Vec<_> = (0..THREADS)
            .map(|i| {
                let mut store = d.another();
                let barrier = barrier.clone();
                std::thread::spawn(move || {
                    barrier.wait();
                    let request = claim_request(&format!("w{i}"), vec![version(WF, 1, Some(MAX))], 2);
                    store.claim(&request, now).unwrap().into_iter().map(|c| c.run.run_id).collect::<Vec<_>>()
                })
            })
            .collect();
        let mut claimed: Vec<String> = handles.into_iter().flat_map(|h| h.join().unwrap()).collect();
        assert_eq!(claimed.len(), MAX as usize, "round {round}: {claimed:?}");
        claimed.sort();
        claimed.dedup();
        assert_eq!(claimed.len(), MAX as usize, "round {round}: a run was claimed twice");
        let statement =
            format!("SELECT count(*) FROM {{s}}.runs WHERE lease_token IS NOT NULL AND lease_expires_at_ms > {now}");
        assert_eq!(d.scalar(&statement), i64::from(MAX));
    }
    // Without a limit, concurrent claims still never hand out one run twice (SKIP LOCKED).
    let barrier = Arc::new(Barrier::new(THREADS));
    let now = 1_000_000;
    let handles: Vec<_> = (0..THREADS)
        .map(|i| {
            let mut store = d.another();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                barrier.wait();
                let request = claim_request(&format!("u{i}"), vec![version(WF, 1, None)], 15);
                store.claim(&request, now).unwrap().into_iter().map(|c| c.run.run_id).collect::<Vec<_>>()
            })
        })
        .collect();
    let mut claimed: Vec<String> = handles.into_iter().flat_map(|h| h.join().unwrap()).collect();
    let total = claimed.len();
    claimed.sort();
    claimed.dedup();
    assert_eq!(claimed.len(), total, "a run was claimed twice");
    assert!(total > 15, "several connections claimed in parallel ({total})");
}

#[test]
fn a_key_runs_one_run_at_a_time_oldest_first() {
    let mut d = db!("wf_key");
    start(&mut d.store, &[keyed("k1-a", "cust-1")], 1_000);
    start(&mut d.store, &[keyed("k1-b", "cust-1"), keyed("k2-a", "cust-2"), req("free")], 1_100);
    assert_eq!(claim_ids(&mut d.store, "w1", 2_000), ["k1-a", "free", "k2-a"]);
    let mut w2 = d.another();
    let taken = claim(&mut w2, "w2", 2_000 + 2 * LEASE_MS);
    let ids: Vec<&str> = taken.iter().map(|c| c.run.run_id.as_str()).collect();
    assert_eq!(ids, ["k1-a", "free", "k2-a"]);
    let k1a = taken[0].lease_token.clone();
    let sleep = JournalOp::Suspend { status: SuspendStatus::Sleeping, wake_at_ms: 60_000, waiting_for: None };
    assert_eq!(commit_one(&mut w2, "k1-a", &k1a, sleep, 4_100), WriteResult::Done);
    assert!(claim_ids(&mut d.store, "w3", 4_200).is_empty());
    let again = claim(&mut d.store, "w3", 60_000);
    let ids: Vec<&str> = again.iter().map(|c| c.run.run_id.as_str()).collect();
    assert_eq!(ids, ["free", "k2-a", "k1-a"], "oldest due first: the two expired leases, then the timer");
    let end = finish(FinishStatus::Completed, None, None);
    assert_eq!(commit_one(&mut d.store, "k1-a", &again[2].lease_token, end, 60_001), WriteResult::Done);
    assert_eq!(claim_ids(&mut w2, "w3", 60_002), ["k1-b"]);
}

#[test]
fn a_retried_older_run_of_a_key_waits_for_the_newer_ones_lease() {
    let mut d = db!("wf_key_retry");
    start(&mut d.store, &[keyed("k-old", "k")], 1_000);
    let old = claim(&mut d.store, "w1", 1_000).remove(0).lease_token;
    let fail = finish(FinishStatus::Failed, None, Some("boom"));
    assert_eq!(commit_one(&mut d.store, "k-old", &old, fail, 1_050), WriteResult::Done);
    start(&mut d.store, &[keyed("k-new", "k")], 1_100);
    assert_eq!(claim_ids(&mut d.store, "w1", 2_000), ["k-new"]);
    d.store.retry("k-old", "fixed the card", 2_100).unwrap();
    assert!(claim_ids(&mut d.another(), "w2", 2_200).is_empty());
    let token = token_of(&d, "k-new");
    let sleep = JournalOp::Suspend { status: SuspendStatus::Sleeping, wake_at_ms: 2_300, waiting_for: None };
    assert_eq!(commit_one(&mut d.store, "k-new", &token, sleep, 2_250), WriteResult::Done);
    assert_eq!(claim_ids(&mut d.another(), "w2", 2_400), ["k-old"]);
    assert!(claim_ids(&mut d.another(), "w3", 2_500).is_empty());
}

/// Runs of one key started (by machines whose clocks disagree: a newer start stamped earlier
/// than the run already there) while many connections claim at the same moment: at most one run
/// of the key ever holds a live lease.
#[test]
fn one_run_per_key_holds_a_lease_when_many_connections_claim_at_once() {
    let mut d = db!("wf_key_race");
    const CLAIMERS: usize = 5;
    for round in 0..10_i64 {
        let key = format!("k{round}");
        let base = 100_000 + round * 100 * LEASE_MS;
        start(&mut d.store, &[keyed(&format!("{key}-late"), &key)], base);
        let barrier = Arc::new(Barrier::new(CLAIMERS + 1));
        let mut handles: Vec<_> = (0..CLAIMERS)
            .map(|i| {
                let mut store = d.another();
                let barrier = barrier.clone();
                std::thread::spawn(move || {
                    barrier.wait();
                    let request = claim_request(&format!("w{i}"), vec![version(WF, 1, None)], 10);
                    store.claim(&request, base + 1).unwrap().len()
                })
            })
            .collect();
        let (mut starter, skewed) = (d.another(), format!("{key}-skewed"));
        let gate = barrier.clone();
        handles.push(std::thread::spawn(move || {
            gate.wait();
            start(&mut starter, &[keyed(&skewed, &key)], base - 50);
            0
        }));
        let claimed: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
        let statement = format!(
            "SELECT count(*) FROM {{s}}.runs WHERE key = 'k{round}' AND lease_token IS NOT NULL
               AND lease_expires_at_ms > {}",
            base + 1
        );
        let leased = d.scalar(&statement);
        assert_eq!(leased as usize, claimed, "round {round}");
        assert!(leased <= 1, "round {round}: {leased} runs of one key hold a live lease");
        for run_id in [format!("k{round}-skewed"), format!("k{round}-late")] {
            d.store.abandon(&run_id, "round over", base + 3 * LEASE_MS).unwrap();
        }
    }
}

/// The interleaving the key lock exists for, made on purpose: a claim on another connection has
/// leased the key's run but not committed yet (it holds the key's lock, as a claim does), and a
/// newer start stamped earlier by a clock running late makes another run of the key look like
/// the oldest. A claim now waits for the key, then sees the committed lease and leases nothing.
#[test]
fn a_claim_waits_for_a_key_whose_lease_is_not_committed_yet() {
    let mut d = db!("wf_key_inflight");
    start(&mut d.store, &[keyed("late", "k")], 10_000);
    let mut holder = d.db.client();
    let mut tx = holder.transaction().unwrap();
    let key_lock = format!("{}/k", d.schema);
    tx.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))", &[&crate::schema::LOCK_RUN_KEY, &key_lock]).unwrap();
    let lease = crate::schema::sql(
        &d.schema,
        "UPDATE {s}.runs SET lease_owner = 'w0', lease_token = 't0', lease_expires_at_ms = 20000 WHERE run_id = 'late'",
    );
    assert_eq!(tx.execute(&lease, &[]).unwrap(), 1);
    start(&mut d.store, &[keyed("skewed", "k")], 9_000);
    let mut claimer = d.another();
    let claiming = std::thread::spawn(move || claim_ids(&mut claimer, "w1", 10_001));
    // Give the claim time to reach the key's lock (if it did not wait, it returns at once with
    // the skewed run, and the assertion below fails).
    std::thread::sleep(std::time::Duration::from_millis(300));
    tx.commit().unwrap();
    assert!(claiming.join().unwrap().is_empty(), "the key's run holds a lease committed while the claim waited");
    assert_eq!(d.scalar("SELECT count(*) FROM {s}.runs WHERE lease_token IS NOT NULL"), 1);
}

// ---------------------------------------------------------------------------------------------
// commit: journal writes

#[test]
fn step_attempts_retry_then_complete_with_every_attempt_recorded() {
    let mut d = db!("wf_attempts");
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    assert_eq!(
        commit_one(&mut d.store, "r1", &t, JournalOp::SetStatus { status: RunStatus::Running }, 1_001),
        WriteResult::Done
    );
    assert_eq!(detail(&d.store, "r1").run.status, RunStatus::Running);
    let fail = step_err(0, "charge", 1, StepFailure::retryable("timeout"), Some(2_000));
    assert_eq!(commit_one(&mut d.store, "r1", &t, fail, 1_010), WriteResult::Done);
    let entry = &detail(&d.store, "r1").journal[0];
    assert_eq!((entry.status, entry.attempts, entry.next_attempt_at_ms), (StepStatus::Retrying, 1, Some(2_000)));
    assert_eq!(entry.error.as_deref(), Some("timeout"));
    let suspend = JournalOp::Suspend { status: SuspendStatus::Pending, wake_at_ms: 2_000, waiting_for: None };
    assert_eq!(commit_one(&mut d.store, "r1", &t, suspend, 1_011), WriteResult::Done);
    let run = detail(&d.store, "r1").run;
    assert_eq!(
        (run.status, run.wake_at_ms, run.lease_owner, run.updated_at_ms),
        (RunStatus::Pending, 2_000, None, 1_011)
    );
    assert!(claim_ids(&mut d.store, "w1", 1_999).is_empty());
    let again = claim(&mut d.store, "w1", 2_000);
    assert_eq!(again[0].journal[0].status, StepStatus::Retrying);
    let t = again[0].lease_token.clone();
    assert_eq!(
        commit_one(&mut d.store, "r1", &t, step_ok(0, "charge", 2, json!({"paid": 300})), 2_010),
        WriteResult::Done
    );
    let detail = detail(&d.store, "r1");
    let entry = &detail.journal[0];
    assert_eq!((entry.status, entry.attempts, entry.error.as_deref()), (StepStatus::Completed, 2, None));
    assert_eq!(entry.output, Some(json!({"paid": 300})));
    assert_eq!(detail.run.updated_at_ms, 2_010, "a journal write touches its run");
    let attempts: Vec<(u32, bool, Option<&str>)> =
        detail.attempts.iter().map(|a| (a.attempt, a.ok, a.error.as_deref())).collect();
    assert_eq!(attempts, [(1, false, Some("timeout")), (2, true, None)]);
}

/// A detail shows the last `DETAIL_ATTEMPTS_MAX` attempts of a position; the events no wait
/// consumed come a page of `limit` at a time after the journal's last page.
#[test]
fn a_detail_page_holds_a_positions_last_attempts_and_unconsumed_events_a_page_at_a_time() {
    let mut d = db!("wf_detail_page");
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    let tries = DETAIL_ATTEMPTS_MAX + 20;
    for attempt in 1..=tries {
        let fail = step_err(0, "charge", attempt, StepFailure::retryable(format!("try {attempt}")), Some(9_000));
        assert_eq!(commit_one(&mut d.store, "r1", &t, fail, 1_000 + i64::from(attempt)), WriteResult::Done);
    }
    let ok = step_ok(0, "charge", tries + 1, json!({"paid": 1}));
    assert_eq!(commit_one(&mut d.store, "r1", &t, ok, 2_000), WriteResult::Done);
    for n in 0..5 {
        assert!(d.store.send_event("r1", &format!("e{n}"), "unasked", &json!({"n": n}), 3_000 + n).unwrap());
    }
    let whole = detail(&d.store, "r1");
    assert_eq!(whole.journal[0].attempts, tries + 1);
    let numbers: Vec<u32> = whole.attempts.iter().map(|a| a.attempt).collect();
    assert_eq!(numbers, (tries + 2 - DETAIL_ATTEMPTS_MAX..=tries + 1).collect::<Vec<_>>(), "the last 100");
    assert_eq!(whole.events.len(), 5);
    assert!(!whole.is_cut());

    // Pages of two: the journal's only position and two events, then two, then one.
    let mut page = d.store.run_page("r1", &DetailPage::first(2)).unwrap().unwrap();
    let ids = |detail: &RunDetail| detail.events.iter().map(|e| e.event_id.clone()).collect::<Vec<_>>();
    assert_eq!((page.journal.len(), ids(&page)), (1, vec!["e0".to_string(), "e1".into()]));
    assert_eq!((page.next_after_seq, page.next_events_after.as_deref()), (Some(0), Some("3001:e1")));
    let mut joined = page.clone();
    let mut pages = 1;
    while let Some(next) = DetailPage::after(&page, 2).unwrap() {
        page = d.store.run_page("r1", &next).unwrap().unwrap();
        assert!(page.journal.is_empty() && !page.events.is_empty(), "{page:?}");
        joined.append_page(page.clone()).unwrap();
        pages += 1;
    }
    assert_eq!((pages, ids(&page)), (3, vec!["e4".to_string()]));
    assert_eq!(joined, whole, "the pages join into the whole");
    // A cursor past every event: the last page, with no event.
    let past = DetailPage { after_seq: Some(0), events_after: Some((3_004, "e4".into())), limit: 2 };
    let last = d.store.run_page("r1", &past).unwrap().unwrap();
    assert!(last.events.is_empty() && !last.is_cut());
    // A cursor's event id is checked like any id.
    let bad = DetailPage { after_seq: None, events_after: Some((1, "a b".into())), limit: 2 };
    assert_eq!(code(d.store.run_page("r1", &bad).unwrap_err()), codes::INVALID_ID);
}

#[test]
fn a_permanent_failure_or_no_retry_time_fails_the_step() {
    let mut d = db!("wf_permanent");
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    let declined = step_err(0, "charge", 1, StepFailure::permanent("card declined"), Some(9_000));
    assert_eq!(commit_one(&mut d.store, "r1", &t, declined, 1_010), WriteResult::Done);
    let out_of_attempts = step_err(1, "notify", 1, StepFailure::retryable("smtp down"), None);
    assert_eq!(commit_one(&mut d.store, "r1", &t, out_of_attempts, 1_020), WriteResult::Done);
    let journal = detail(&d.store, "r1").journal;
    assert_eq!((journal[0].status, journal[0].next_attempt_at_ms), (StepStatus::Failed, None));
    assert_eq!(journal[1].status, StepStatus::Failed);
}

#[test]
fn group_commit_applies_many_runs_writes_in_one_call_and_fences_each_alone() {
    let mut d = db!("wf_group");
    let runs: Vec<StartRequest> = (0..200).map(|i| req(&format!("r{i:03}"))).collect();
    start(&mut d.store, &runs, 1_000);
    let claimed = claim(&mut d.store, "w1", 1_000);
    assert_eq!(claimed.len(), 100);
    let mut writes = Vec::new();
    for c in &claimed {
        writes.push(write(&c.run.run_id, &c.lease_token, JournalOp::SetStatus { status: RunStatus::Running }));
        writes.push(write(&c.run.run_id, &c.lease_token, step_ok(0, "reserve", 1, json!({"run": c.run.run_id}))));
        writes.push(write(&c.run.run_id, &c.lease_token, step_ok(1, "charge", 1, json!(2))));
    }
    writes.insert(150, write("r150", "staletoken", step_ok(0, "reserve", 1, json!("stale"))));
    // A write of a run released earlier in the same batch is fenced too.
    let first = &claimed[0];
    writes.push(write(&first.run.run_id, &first.lease_token, JournalOp::Release));
    writes.push(write(&first.run.run_id, &first.lease_token, step_ok(2, "ship", 1, json!(3))));
    let results = d.store.commit(writes, 1_100).unwrap();
    assert_eq!(results.len(), 303);
    assert_eq!(results[150], WriteResult::Fenced);
    assert_eq!(results[302], WriteResult::Fenced, "released in this batch: fenced");
    assert_eq!(results.iter().filter(|r| **r == WriteResult::Done).count(), 301);
    for c in &claimed {
        let detail = detail(&d.store, &c.run.run_id);
        assert_eq!(detail.run.status, RunStatus::Running);
        assert_eq!(detail.journal.len(), 2, "{}", c.run.run_id);
        assert_eq!(detail.journal[0].output, Some(json!({"run": c.run.run_id})));
    }
    assert!(detail(&d.store, "r150").journal.is_empty(), "r150 was not claimed in the first 100");
}

#[test]
fn journal_invariants_refuse_the_whole_batch() {
    let mut d = db!("wf_invariants");
    start(&mut d.store, &[req("r1"), req("r2")], 1_000);
    let claimed = claim(&mut d.store, "w1", 1_000);
    let (t1, t2) = (claimed[0].lease_token.clone(), claimed[1].lease_token.clone());
    assert_eq!(commit_one(&mut d.store, "r1", &t1, step_ok(0, "reserve", 1, json!(1)), 1_010), WriteResult::Done);
    let before = (detail(&d.store, "r1"), detail(&d.store, "r2"));
    let broken: Vec<Op> = vec![
        step_ok(0, "reserve", 2, json!("again")),
        step_ok(2, "ship", 1, json!(1)),
        step_ok(1, "charge", 2, json!(1)),
        tx_step(0, 1, Box::new(|_| Ok(json!(1))), None),
        JournalOp::TimerFinished { seq: 1, event_id: None, output: json!(null) },
    ];
    for op in broken {
        let batch = vec![write("r2", &t2, step_ok(0, "reserve", 1, json!(2))), write("r1", &t1, op)];
        let err = d.store.commit(batch, 1_020).unwrap_err();
        assert!(matches!(err, Error::Invariant(_)), "{err:?}");
        assert_eq!((detail(&d.store, "r1"), detail(&d.store, "r2")), before);
    }
    let retry = step_err(1, "charge", 1, StepFailure::retryable("x"), Some(2_000));
    assert_eq!(commit_one(&mut d.store, "r1", &t1, retry, 1_030), WriteResult::Done);
    let err = d.store.commit(vec![write("r1", &t1, step_ok(1, "refund", 2, json!(1)))], 1_040).unwrap_err();
    assert!(matches!(err, Error::Invariant(ref m) if m.contains("refund")), "{err:?}");
    // The session is usable after each refused batch (nothing left open).
    assert_eq!(commit_one(&mut d.store, "r2", &t2, step_ok(0, "reserve", 1, json!(2)), 1_050), WriteResult::Done);
}

/// A body that only records that it ran.
fn body_flag(ran: &Arc<AtomicBool>) -> TxBody<ApplyTransaction> {
    let flag = ran.clone();
    Box::new(move |_| {
        flag.store(true, Ordering::SeqCst);
        Ok(json!(1))
    })
}

#[test]
fn bad_journal_writes_are_refused_before_anything_runs() {
    let mut d = db!("wf_bad_writes");
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    let before = detail(&d.store, "r1");
    let ran = Arc::new(AtomicBool::new(false));
    let big = json!("x".repeat(300 * 1024));
    let cases: Vec<(Op, &str)> = vec![
        (JournalOp::SetStatus { status: RunStatus::Completed }, codes::INVALID_ARGUMENT),
        (JournalOp::SetStatus { status: RunStatus::Sleeping }, codes::INVALID_ARGUMENT),
        (step_ok(RUN_STEPS_MAX, "s", 1, json!(1)), codes::LIMIT_EXCEEDED),
        (step_ok(0, "bad name", 1, json!(1)), codes::INVALID_ID),
        (step_ok(0, "s", 0, json!(1)), codes::INVALID_ARGUMENT),
        (step_ok(0, "s", 1, big.clone()), codes::PAYLOAD_TOO_LARGE),
        (step_err(0, "s", 1, StepFailure::retryable("x"), Some(i64::MAX)), codes::INVALID_ARGUMENT),
        (
            JournalOp::StepAttempt {
                seq: 0,
                name: "s".into(),
                kind: StepKind::Sleep,
                attempt: 1,
                result: Ok(json!(1)),
                retry_at_ms: None,
            },
            codes::INVALID_ARGUMENT,
        ),
        (
            JournalOp::TimerStarted {
                seq: 0,
                name: "t".into(),
                kind: StepKind::Wait,
                wake_at_ms: 5_000,
                event_name: None,
            },
            codes::INVALID_ARGUMENT,
        ),
        (
            JournalOp::TimerStarted {
                seq: 0,
                name: "t".into(),
                kind: StepKind::Sleep,
                wake_at_ms: i64::MAX,
                event_name: None,
            },
            codes::INVALID_ARGUMENT,
        ),
        (JournalOp::TimerFinished { seq: 0, event_id: Some("bad id".into()), output: json!(1) }, codes::INVALID_ID),
        (
            JournalOp::Suspend { status: SuspendStatus::Waiting, wake_at_ms: 5_000, waiting_for: None },
            codes::INVALID_ARGUMENT,
        ),
        (
            JournalOp::Suspend { status: SuspendStatus::Sleeping, wake_at_ms: 5_000, waiting_for: Some("e".into()) },
            codes::INVALID_ARGUMENT,
        ),
        (finish(FinishStatus::Completed, Some(big), None), codes::PAYLOAD_TOO_LARGE),
        (
            JournalOp::StartChild {
                seq: 0,
                name: "child".into(),
                request: Box::new(StartRequest::new("not-derived", "double", 1, json!({}))),
                wake_at_ms: 5_000,
                claim: None,
            },
            codes::INVALID_ARGUMENT,
        ),
    ];
    for (op, expected) in cases {
        let batch = vec![write("r1", &t, tx_step(0, 1, body_flag(&ran), None)), write("r1", &t, op)];
        assert_eq!(code(d.store.commit(batch, 1_010).unwrap_err()), expected);
    }
    let batch = vec![write("r1", &t, tx_step(0, 1, body_flag(&ran), None)), write("bad id", &t, JournalOp::Release)];
    assert_eq!(code(d.store.commit(batch, 1_010).unwrap_err()), codes::INVALID_ID);
    assert!(!ran.load(Ordering::SeqCst));
    assert_eq!(detail(&d.store, "r1"), before);
    assert!(d.store.commit(Vec::new(), 1_010).unwrap().is_empty());
}

#[test]
fn a_transactional_step_commits_its_rows_with_its_journal_entry_or_neither() {
    let mut d = db!("wf_tx_step");
    orders_table(&mut d.store);
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    let result = commit_one(&mut d.store, "r1", &t, tx_step(0, 1, insert_order("o-1", true), Some(2_000)), 1_010);
    assert_eq!(result, WriteResult::TxResult(Err(StepFailure::retryable("payment service said no"))));
    assert_eq!(orders(&mut d.store), 0);
    let detail1 = detail(&d.store, "r1");
    assert_eq!((detail1.journal[0].status, detail1.journal[0].attempts), (StepStatus::Retrying, 1));
    assert_eq!(detail1.attempts.len(), 1);
    let result = commit_one(&mut d.store, "r1", &t, tx_step(0, 2, insert_order("o-1", false), None), 2_010);
    assert_eq!(result, WriteResult::TxResult(Ok(json!({"order": "o-1"}))));
    assert_eq!(orders(&mut d.store), 1);
    let entry = &detail(&d.store, "r1").journal[0];
    assert_eq!((entry.status, entry.kind, entry.attempts), (StepStatus::Completed, StepKind::Transactional, 2));
    assert_eq!(entry.output, Some(json!({"order": "o-1"})));
    let result = commit_one(&mut d.store, "r1", "stale", tx_step(1, 1, insert_order("o-2", false), None), 2_020);
    assert_eq!(result, WriteResult::Fenced);
    assert_eq!(orders(&mut d.store), 1);
}

/// A body whose statement fails (a duplicate key) but which returns success anyway cannot commit
/// its writes: they roll back to the savepoint and the attempt is a retryable failure; the
/// batch's other writes go on.
#[test]
fn a_body_whose_statement_failed_is_a_failed_attempt_and_the_batch_goes_on() {
    let mut d = db!("wf_tx_aborted");
    orders_table(&mut d.store);
    start(&mut d.store, &[req("r1"), req("r2")], 1_000);
    let claimed = claim(&mut d.store, "w1", 1_000);
    let (t1, t2) = (claimed[0].lease_token.clone(), claimed[1].lease_token.clone());
    let swallowing: TxBody<ApplyTransaction> = Box::new(|tx| {
        let insert = format!("INSERT INTO \"{}\".orders (id, total) VALUES ('dup', 1)", tx.schema());
        tx.execute(&insert, &[]).unwrap();
        let _ignored = tx.execute(&insert, &[]); // a unique violation, swallowed
        Ok(json!("claims success"))
    });
    let batch = vec![
        write("r1", &t1, tx_step(0, 1, swallowing, Some(5_000))),
        write("r2", &t2, tx_step(0, 1, insert_order("o-2", false), None)),
    ];
    let results = d.store.commit(batch, 1_010).unwrap();
    assert!(
        matches!(&results[0], WriteResult::TxResult(Err(f)) if f.retryable && f.message.contains("failed")),
        "{results:?}"
    );
    assert_eq!(results[1], WriteResult::TxResult(Ok(json!({"order": "o-2"}))));
    assert_eq!(orders(&mut d.store), 1, "only r2's row");
    assert_eq!(detail(&d.store, "r1").journal[0].status, StepStatus::Retrying);
}

/// Several transactional steps in one commit, with other writes between: a failing step between
/// two others rolls back only its own rows, a run with two writes keeps their order, a fenced
/// write changes nothing, and every answer is at its write's place in the batch.
#[test]
fn transactional_steps_of_one_commit_keep_their_own_savepoints_and_answers() {
    let mut d = db!("wf_tx_grouped");
    orders_table(&mut d.store);
    let ids = ["ra", "rb", "rc", "rd", "re"];
    start(&mut d.store, &ids.map(req), 1_000);
    let claimed = claim(&mut d.store, "w1", 1_000);
    let token = |id: &str| claimed.iter().find(|c| c.run.run_id == id).unwrap().lease_token.clone();
    let batch = vec![
        write("ra", &token("ra"), step_ok(0, "charge", 1, json!("charged"))),
        write("rb", &token("rb"), tx_step(0, 1, insert_order("o-b", false), None)),
        write("rd", &token("rd"), tx_step(0, 1, insert_order("o-d1", false), None)),
        write("rc", &token("rc"), tx_step(0, 1, insert_order("o-c", true), Some(5_000))),
        write("rd", &token("rd"), tx_step(1, 1, insert_order("o-d2", false), None)),
        write("re", "not-its-token", tx_step(0, 1, insert_order("o-x", false), None)),
        write("re", &token("re"), tx_step(0, 1, insert_order("o-e", false), None)),
        write("ra", &token("ra"), JournalOp::Release),
    ];
    let results = d.store.commit(batch, 1_010).unwrap();
    assert_eq!(results[0], WriteResult::Done);
    assert_eq!(results[1], WriteResult::TxResult(Ok(json!({"order": "o-b"}))));
    assert_eq!(results[2], WriteResult::TxResult(Ok(json!({"order": "o-d1"}))));
    assert!(matches!(&results[3], WriteResult::TxResult(Err(f)) if f.retryable), "{:?}", results[3]);
    assert_eq!(results[4], WriteResult::TxResult(Ok(json!({"order": "o-d2"}))));
    assert_eq!(results[5], WriteResult::Fenced);
    assert_eq!(results[6], WriteResult::TxResult(Ok(json!({"order": "o-e"}))));
    assert_eq!(results[7], WriteResult::Done);
    let schema = d.store.schema().to_string();
    let ids: Vec<String> = d
        .store
        .client()
        .query(&format!("SELECT id FROM \"{schema}\".orders ORDER BY id"), &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(ids, ["o-b", "o-d1", "o-d2", "o-e"], "the failed step's row rolled back, no other");
    let journal = |id: &str| -> Vec<(u32, StepStatus)> {
        detail(&d.store, id).journal.iter().map(|e| (e.seq, e.status)).collect()
    };
    assert_eq!(journal("ra"), [(0, StepStatus::Completed)]);
    assert_eq!(journal("rc"), [(0, StepStatus::Retrying)]);
    assert_eq!(journal("rd"), [(0, StepStatus::Completed), (1, StepStatus::Completed)]);
    assert_eq!(journal("re"), [(0, StepStatus::Completed)]);
    assert_eq!(detail(&d.store, "ra").run.lease_owner, None, "released after its step");
}

/// A body that ends the journal's transaction on the connection it was handed: the batch is
/// refused (nothing of it can be trusted to commit together) and the session is usable after.
#[test]
fn a_body_that_ends_the_transaction_refuses_the_batch() {
    let mut d = db!("wf_tx_ended");
    orders_table(&mut d.store);
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    let before = detail(&d.store, "r1");
    let rolling_back: TxBody<ApplyTransaction> = Box::new(|tx| {
        tx.batch_execute("ROLLBACK").unwrap();
        Ok(json!(1))
    });
    let err = d.store.commit(vec![write("r1", &t, tx_step(0, 1, rolling_back, None))], 1_010).unwrap_err();
    assert_eq!(err.code(), codes::STORE, "{err}");
    assert!(err.to_string().contains("ended inside the body"), "{err}");
    assert_eq!(detail(&d.store, "r1"), before);
    // The body ends it before another step of the batch: the release that travels with the
    // next step's savepoint fails, and nothing of the batch is written (a body's release waits
    // for the next round trip of the batch, and no statement of the store runs before it).
    let t2 = started_and_claimed(&mut d.store, "r2", 1_012);
    let before2 = detail(&d.store, "r2");
    let rolling_back: TxBody<ApplyTransaction> = Box::new(|tx| {
        tx.batch_execute("ROLLBACK").unwrap();
        Ok(json!(1))
    });
    let writes = vec![
        write("r1", &t, tx_step(0, 1, rolling_back, None)),
        write("r2", &t2, tx_step(0, 1, insert_order("o-2", false), None)),
    ];
    let err = d.store.commit(writes, 1_015).unwrap_err();
    assert_eq!(err.code(), codes::STORE, "{err}");
    assert!(err.to_string().contains("ended inside the body"), "{err}");
    assert_eq!((detail(&d.store, "r1"), detail(&d.store, "r2")), (before, before2));
    assert_eq!(orders(&mut d.store), 0);
    let result = commit_one(&mut d.store, "r1", &t, tx_step(0, 1, insert_order("o-1", false), None), 1_020);
    assert!(matches!(result, WriteResult::TxResult(Ok(_))));
    assert_eq!(orders(&mut d.store), 1);
}

#[test]
fn a_transactional_body_whose_output_is_too_large_fails_for_good_and_writes_nothing() {
    let mut d = db!("wf_tx_big");
    orders_table(&mut d.store);
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    let body: TxBody<ApplyTransaction> = Box::new(|tx| {
        tx.execute(&format!("INSERT INTO \"{}\".orders (id, total) VALUES ('o-big', 1)", tx.schema()), &[]).unwrap();
        Ok(json!("x".repeat(300 * 1024)))
    });
    let WriteResult::TxResult(Err(failure)) =
        commit_one(&mut d.store, "r1", &t, tx_step(0, 1, body, Some(2_000)), 1_010)
    else {
        panic!("expected a failed transactional step");
    };
    assert!(!failure.retryable);
    assert_eq!(orders(&mut d.store), 0);
    assert_eq!(detail(&d.store, "r1").journal[0].status, StepStatus::Failed);
}

#[test]
fn a_panicking_body_drops_the_transaction_and_the_whole_batch_with_it() {
    let mut d = db!("wf_tx_panic");
    orders_table(&mut d.store);
    start(&mut d.store, &[req("r1"), req("r2")], 1_000);
    let claimed = claim(&mut d.store, "w1", 1_000);
    let before = (detail(&d.store, "r1"), detail(&d.store, "r2"));
    let (t1, t2) = (claimed[0].lease_token.clone(), claimed[1].lease_token.clone());
    let panicking: TxBody<ApplyTransaction> = Box::new(|tx| {
        tx.execute(&format!("INSERT INTO \"{}\".orders (id, total) VALUES ('o-p', 1)", tx.schema()), &[]).unwrap();
        panic!("the body blew up mid-transaction");
    });
    let batch = vec![
        write("r1", &t1, tx_step(0, 1, insert_order("o-1", false), None)),
        write("r2", &t2, tx_step(0, 1, panicking, None)),
    ];
    let store = &mut d.store;
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || store.commit(batch, 1_010)));
    assert!(outcome.is_err());
    assert_eq!(orders(&mut d.store), 0);
    assert_eq!((detail(&d.store, "r1"), detail(&d.store, "r2")), before);
    // Nothing holds the runs' rows: another connection claims past their leases at once.
    assert_eq!(claim_ids(&mut d.another(), "w9", 1_000 + LEASE_MS).len(), 2);
    let t1 = token_of(&d, "r1");
    let result = commit_one(&mut d.store, "r1", &t1, tx_step(0, 1, insert_order("o-1", false), None), 1_020 + LEASE_MS);
    assert!(matches!(result, WriteResult::TxResult(Ok(_))));
    assert_eq!(orders(&mut d.store), 1);
}

#[test]
fn a_commit_hook_that_refuses_rolls_every_write_back_and_leaves_the_connection_usable() {
    let mut d = db!("wf_commit_hook");
    orders_table(&mut d.store);
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    let pid: i32 = d.store.client().query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
    let asked = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let refuse = Arc::new(AtomicBool::new(true));
    let (counter, refusing) = (asked.clone(), refuse.clone());
    d.store.set_commit_hook(Some(Box::new(move || {
        counter.fetch_add(1, Ordering::SeqCst);
        refusing.load(Ordering::SeqCst)
    })));
    let before = detail(&d.store, "r1");
    // A journal commit (the hand-begun transaction a step's body runs in), a start, an event,
    // a heartbeat and an operator change: each asks the hook, fails, and writes nothing.
    let refused = d.store.commit(vec![write("r1", &t, tx_step(0, 1, insert_order("o-1", false), None))], 1_010);
    let refused = refused.unwrap_err();
    assert_eq!((refused.code(), refused.to_string()), (codes::STORE, crate::COMMIT_REFUSED.to_string()));
    // Nothing was left open on the connection: another session sees it idle, out of any
    // transaction.
    let state = |d: &Db| -> String {
        d.db.client().query_one("SELECT state FROM pg_stat_activity WHERE pid = $1", &[&pid]).unwrap().get(0)
    };
    assert_eq!(state(&d), "idle");
    assert!(d.store.start_runs(&[req("r2")], 1_020).is_err());
    assert!(d.store.send_event("r1", "ev-1", "approved", &json!(1), 1_030).is_err());
    let lease = [("r1".to_string(), t.clone())];
    assert!(d.store.heartbeat("w1", &lease, LEASE_MS, 1_040).is_err());
    assert!(d.store.cancel("r1", "stop", 1_050).is_err());
    assert_eq!(asked.load(Ordering::SeqCst), 5);
    assert_eq!(state(&d), "idle");
    assert_eq!(orders(&mut d.store), 0);
    assert_eq!(detail(&d.store, "r1"), before);
    assert!(d.store.run("r2").unwrap().is_none());
    // The same store commits once the hook lets it.
    refuse.store(false, Ordering::SeqCst);
    let result = commit_one(&mut d.store, "r1", &t, tx_step(0, 1, insert_order("o-1", false), None), 1_060);
    assert!(matches!(result, WriteResult::TxResult(Ok(_))));
    assert_eq!(orders(&mut d.store), 1);
    d.store.set_commit_hook(None);
    start(&mut d.store, &[req("r2")], 1_070);
}

#[test]
fn a_sleep_is_a_durable_timer() {
    let mut d = db!("wf_sleep");
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    let timer = JournalOp::TimerStarted {
        seq: 0,
        name: "cool_off".into(),
        kind: StepKind::Sleep,
        wake_at_ms: 9_000,
        event_name: None,
    };
    let suspend = JournalOp::Suspend { status: SuspendStatus::Sleeping, wake_at_ms: 9_000, waiting_for: None };
    let results = d.store.commit(vec![write("r1", &t, timer), write("r1", &t, suspend)], 1_010).unwrap();
    assert_eq!(results, [WriteResult::Done, WriteResult::Done]);
    let detail1 = detail(&d.store, "r1");
    assert_eq!((detail1.run.status, detail1.run.wake_at_ms), (RunStatus::Sleeping, 9_000));
    assert_eq!((detail1.journal[0].status, detail1.journal[0].wake_at_ms), (StepStatus::Waiting, Some(9_000)));
    // A store reopened (a restart, another process) has it; nothing is due before the timer.
    let mut reopened = d.another();
    assert!(claim_ids(&mut reopened, "w2", 8_999).is_empty());
    let c = claim(&mut reopened, "w2", 9_000);
    assert_eq!(c[0].journal[0].status, StepStatus::Waiting);
    let fired = JournalOp::TimerFinished { seq: 0, event_id: None, output: json!(null) };
    assert_eq!(commit_one(&mut reopened, "r1", &c[0].lease_token, fired, 9_001), WriteResult::Done);
    assert_eq!(detail(&d.store, "r1").journal[0].status, StepStatus::Completed);
}

fn wait_for_approval(store: &mut PgWorkflows, run_id: &str, token: &str, now_ms: i64) {
    let timer = JournalOp::TimerStarted {
        seq: 0,
        name: "approval".into(),
        kind: StepKind::Wait,
        wake_at_ms: 100_000,
        event_name: Some("approved".into()),
    };
    let suspend = JournalOp::Suspend {
        status: SuspendStatus::Waiting,
        wake_at_ms: 100_000,
        waiting_for: Some("approved".into()),
    };
    let results = store.commit(vec![write(run_id, token, timer), write(run_id, token, suspend)], now_ms).unwrap();
    assert_eq!(results, [WriteResult::Done, WriteResult::Done]);
}

#[test]
fn an_event_wakes_a_waiting_run_and_is_consumed_once() {
    let mut d = db!("wf_event");
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    wait_for_approval(&mut d.store, "r1", &t, 1_010);
    let run = detail(&d.store, "r1").run;
    assert_eq!(
        (run.status, run.wake_at_ms, run.waiting_for.as_deref()),
        (RunStatus::Waiting, 100_000, Some("approved"))
    );
    assert!(d.store.send_event("r1", "ev-0", "other", &json!(0), 2_000).unwrap());
    assert_eq!(detail(&d.store, "r1").run.wake_at_ms, 100_000);
    assert!(d.store.send_event("r1", "ev-1", "approved", &json!({"by": "ann"}), 3_000).unwrap());
    assert_eq!(detail(&d.store, "r1").run.wake_at_ms, 3_000);
    assert!(!d.store.send_event("r1", "ev-1", "approved", &json!({"by": "ann"}), 3_100).unwrap());
    assert_eq!(
        code(d.store.send_event("r1", "ev-1", "approved", &json!({"by": "bob"}), 3_100).unwrap_err()),
        codes::ALREADY_EXISTS
    );
    let c = claim(&mut d.store, "w1", 3_200);
    let events: Vec<&str> = c[0].events.iter().map(|e| e.event_id.as_str()).collect();
    assert_eq!(events, ["ev-0", "ev-1"]);
    let t = c[0].lease_token.clone();
    let done = JournalOp::TimerFinished { seq: 0, event_id: Some("ev-1".into()), output: json!({"by": "ann"}) };
    assert_eq!(commit_one(&mut d.store, "r1", &t, done, 3_300), WriteResult::Done);
    let detail1 = detail(&d.store, "r1");
    assert_eq!(detail1.journal[0].output, Some(json!({"by": "ann"})));
    let consumed: Vec<(&str, Option<u32>)> =
        detail1.events.iter().map(|e| (e.event_id.as_str(), e.consumed_by_seq)).collect();
    assert_eq!(consumed, [("ev-0", None), ("ev-1", Some(0))]);
    assert_eq!(commit_one(&mut d.store, "r1", &t, JournalOp::Release, 3_400), WriteResult::Done);
    let c = claim(&mut d.store, "w1", 3_500);
    assert_eq!(c[0].events.len(), 1, "only the unconsumed event is handed out");
    let twice = JournalOp::TimerFinished { seq: 0, event_id: Some("ev-1".into()), output: json!(1) };
    assert!(matches!(
        d.store.commit(vec![write("r1", &c[0].lease_token, twice)], 3_600).unwrap_err(),
        Error::Invariant(_)
    ));
}

#[test]
fn an_event_that_arrives_before_the_run_suspends_is_not_lost() {
    let mut d = db!("wf_early_event");
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    assert!(d.another().send_event("r1", "ev-1", "approved", &json!(true), 1_005).unwrap());
    wait_for_approval(&mut d.store, "r1", &t, 1_010);
    let run = detail(&d.store, "r1").run;
    assert_eq!((run.status, run.wake_at_ms), (RunStatus::Waiting, 1_010), "due at once, not at the deadline");
    assert_eq!(claim(&mut d.store, "w1", 1_020)[0].events.len(), 1);
}

/// An event sent on one connection while the run suspends on another, at the same moment, many
/// times: whichever commits first, the run ends up due now (the suspension saw the event, or the
/// event's wake-up saw the suspended run). Never waiting for the deadline with the event there.
#[test]
fn an_event_racing_the_suspension_on_another_connection_is_never_lost() {
    let mut d = db!("wf_wake_race");
    const ROUNDS: usize = 40;
    let runs: Vec<StartRequest> = (0..ROUNDS).map(|i| req(&format!("r{i:02}"))).collect();
    start(&mut d.store, &runs, 1_000);
    let claimed = claim(&mut d.store, "w1", 1_000);
    assert_eq!(claimed.len(), ROUNDS);
    let mut sender = d.another();
    for c in claimed {
        let barrier = Arc::new(Barrier::new(2));
        let (run_id, gate) = (c.run.run_id.clone(), barrier.clone());
        let send = std::thread::spawn(move || {
            gate.wait();
            assert!(sender.send_event(&run_id, "ev", "approved", &json!(1), 1_500).unwrap());
            sender
        });
        barrier.wait();
        wait_for_approval(&mut d.store, &c.run.run_id, &c.lease_token, 1_500);
        sender = send.join().unwrap();
        let run = detail(&d.store, &c.run.run_id).run;
        assert_eq!((run.status, run.wake_at_ms), (RunStatus::Waiting, 1_500), "{}: the wake-up was lost", run.run_id);
    }
}

#[test]
fn a_wait_times_out_at_its_deadline() {
    let mut d = db!("wf_timeout");
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    wait_for_approval(&mut d.store, "r1", &t, 1_010);
    assert!(claim_ids(&mut d.store, "w1", 99_999).is_empty());
    let c = claim(&mut d.store, "w1", 100_000);
    let timeout = JournalOp::TimerFinished { seq: 0, event_id: None, output: json!({"timed_out": true}) };
    assert_eq!(commit_one(&mut d.store, "r1", &c[0].lease_token, timeout, 100_001), WriteResult::Done);
    assert_eq!(detail(&d.store, "r1").journal[0].status, StepStatus::Completed);
}

#[test]
fn send_event_refuses_unknown_finished_runs_and_bad_input() {
    let mut d = db!("wf_bad_event");
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    assert_eq!(code(d.store.send_event("nope", "e", "n", &json!(1), 1_000).unwrap_err()), codes::NOT_FOUND);
    assert_eq!(code(d.store.send_event("r1", "bad id", "n", &json!(1), 1_000).unwrap_err()), codes::INVALID_ID);
    assert_eq!(code(d.store.send_event("r1", "e", "", &json!(1), 1_000).unwrap_err()), codes::INVALID_ID);
    assert_eq!(code(d.store.send_event("r1", "e", &child_event(0), &json!(1), 1_000).unwrap_err()), codes::INVALID_ID);
    let big = json!("x".repeat(300 * 1024));
    assert_eq!(code(d.store.send_event("r1", "e", "n", &big, 1_000).unwrap_err()), codes::PAYLOAD_TOO_LARGE);
    let end = finish(FinishStatus::Completed, Some(json!("ok")), None);
    assert_eq!(commit_one(&mut d.store, "r1", &t, end, 1_010), WriteResult::Done);
    let before = detail(&d.store, "r1");
    assert_eq!(code(d.store.send_event("r1", "e", "n", &json!(1), 1_020).unwrap_err()), codes::INVALID_STATE_CHANGE);
    assert_eq!(detail(&d.store, "r1"), before);
    assert!(before.events.is_empty());
}

/// A run holds at most RUN_EVENTS_HELD_MAX events no wait consumed: the next send is
/// `limit_exceeded` and writes nothing; a send of one it holds is still the idempotent no-op;
/// once a wait consumed one, it takes one more.
#[test]
fn a_run_holds_at_most_its_bound_of_events_no_wait_consumed() {
    use tidemark_core::workflow::RUN_EVENTS_HELD_MAX;
    let mut d = db!("wf_events_held");
    started_and_claimed(&mut d.store, "r1", 1_000);
    let s = format!("\"{}\"", d.schema);
    let mut client = d.db.client();
    // All but one of the bound, written straight (a send each would be a commit each).
    client
        .batch_execute(&format!(
            "INSERT INTO {s}.run_events (run_id, event_id, name, payload, received_at_ms)
             SELECT 'r1', 'e' || g, 'paid', '{{}}', 1000 + g FROM generate_series(1, {}) g",
            RUN_EVENTS_HELD_MAX - 1
        ))
        .unwrap();
    assert!(d.store.send_event("r1", "last", "paid", &json!(1), 20_000).unwrap());
    let refused = d.store.send_event("r1", "over", "paid", &json!(1), 20_001).unwrap_err();
    assert_eq!(code(refused), codes::RUN_EVENTS_FULL);
    assert!(!d.store.send_event("r1", "last", "paid", &json!(1), 20_002).unwrap(), "held already: a no-op");
    let held = |client: &mut postgres::Client| -> i64 {
        client.query_one(&format!("SELECT count(*) FROM {s}.run_events WHERE run_id = 'r1'"), &[]).unwrap().get(0)
    };
    assert_eq!(held(&mut client), RUN_EVENTS_HELD_MAX as i64);
    // Another run's `ctx.send` to it: retryable, and nothing journaled (the sender waits and
    // sends again).
    let sender = started_and_claimed(&mut d.store, "r2", 20_000);
    let send = || JournalOp::Send { seq: 0, to: "r1".into(), topic: "paid".into(), payload: json!(2) };
    let answer = d.store.commit(vec![write("r2", &sender, send())], 20_004).unwrap().remove(0);
    assert!(matches!(&answer, WriteResult::TxResult(Err(f)) if f.retryable && f.message.contains("r1")), "{answer:?}");
    assert!(detail(&d.store, "r2").journal.is_empty());
    assert_eq!(held(&mut client), RUN_EVENTS_HELD_MAX as i64);
    client.batch_execute(&format!("UPDATE {s}.run_events SET consumed_by_seq = 0 WHERE event_id = 'e1'")).unwrap();
    assert!(d.store.send_event("r1", "over", "paid", &json!(1), 20_003).unwrap());
    assert_eq!(held(&mut client), RUN_EVENTS_HELD_MAX as i64 + 1);
    client.batch_execute(&format!("UPDATE {s}.run_events SET consumed_by_seq = 0 WHERE event_id = 'e2'")).unwrap();
    let answer = d.store.commit(vec![write("r2", &sender, send())], 20_005).unwrap().remove(0);
    assert!(matches!(answer, WriteResult::TxResult(Ok(_))), "{answer:?}");
    assert_eq!(detail(&d.store, "r2").journal.len(), 1);
}

/// An inbox handler on a consumer of the same database sends the event inside its apply
/// transaction: a refused apply leaves no event, an applied one wakes the run with it.
#[test]
fn an_inbox_handler_can_send_an_event_inside_its_apply_transaction() {
    use tidemark_core::store::{ConsumerStore, DrainScope, HandleError, Handler, ReceiveOutcome};
    struct ToRun {
        schema: String,
        refuse: bool,
    }
    impl Handler<ApplyTransaction> for ToRun {
        fn handle(
            &mut self,
            tx: &ApplyTransaction,
            _consumer: &str,
            event: &tidemark_core::Envelope,
        ) -> Result<(), HandleError> {
            // Bad input is refused before any statement (the apply transaction goes on).
            let bad = crate::send_event_in(tx, "Bad", "r1", "e", "approved", &event.payload, 2_000);
            assert_eq!(bad.unwrap_err().code(), codes::INVALID_ARGUMENT);
            let bad = crate::send_event_in(tx, &self.schema, "r1", "bad id", "approved", &event.payload, 2_000);
            assert_eq!(bad.unwrap_err().code(), codes::INVALID_ID);
            let sent = crate::send_event_in(tx, &self.schema, "r1", &event.event_id, "approved", &event.payload, 2_000)
                .map_err(HandleError::Failed)?;
            assert!(sent);
            if self.refuse {
                return Err(HandleError::Blocked("refused after sending".into()));
            }
            Ok(())
        }
    }
    let mut d = db!("wf_inbox_event");
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    wait_for_approval(&mut d.store, "r1", &t, 1_010);
    let mut consumer =
        crate::PgConsumer::init(&d.db.conn, &d.db.schema("inbox"), tidemark_core::policy::RetentionPolicy::default())
            .unwrap();
    let event = tidemark_core::Envelope {
        event_id: "e1".into(),
        source: "shop".into(),
        generation: "g1".into(),
        flow_id: "f".into(),
        seq: 1,
        event_type: "approved".into(),
        schema_version: 1,
        payload: json!({"by": "ann"}),
        created_at_ms: 1_500,
        traceparent: None,
    };
    let received = consumer.receive_batch(&[("c", &event)], 1_600).unwrap();
    assert!(matches!(received[0], ReceiveOutcome::Accepted { .. }));
    let mut refusing = ToRun { schema: d.schema.clone(), refuse: true };
    consumer.drain("c", &DrainScope::All, 10, &mut refusing, 1_700).unwrap();
    assert!(detail(&d.store, "r1").events.is_empty(), "rolled back with the refused apply");
    assert_eq!(detail(&d.store, "r1").run.wake_at_ms, 100_000);
    let mut applying = ToRun { schema: d.schema.clone(), refuse: false };
    assert_eq!(consumer.drain("c", &DrainScope::All, 10, &mut applying, 1_800).unwrap().applied, 1);
    let run = detail(&d.store, "r1");
    assert_eq!((run.events.len(), run.run.wake_at_ms), (1, 2_000));
    assert_eq!(run.events[0].payload, json!({"by": "ann"}));
}

#[test]
fn finish_ends_the_run_releases_the_lease_and_fences_later_writes() {
    let mut d = db!("wf_finish");
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    let end = JournalOp::Finish { status: FinishStatus::Failed, result: None, error: Some("é".repeat(5_000)) };
    assert_eq!(commit_one(&mut d.store, "r1", &t, end, 1_010), WriteResult::Done);
    let run = detail(&d.store, "r1").run;
    assert_eq!((run.status, run.lease_owner, run.lease_expires_at_ms), (RunStatus::Failed, None, None));
    let error = run.error.unwrap();
    assert!(error.len() <= ERROR_BYTES_MAX && error.len() > ERROR_BYTES_MAX - 2, "{}", error.len());
    assert_eq!(commit_one(&mut d.store, "r1", &t, JournalOp::Release, 1_020), WriteResult::Fenced);
    assert!(claim_ids(&mut d.store, "w1", 1_000_000).is_empty());
}

// ---------------------------------------------------------------------------------------------
// Children: started in the parent's transaction, their end reaching the parent, the cascade

fn start_child(parent: &str, seq: u32, workflow: &str, input: Value) -> Op {
    JournalOp::StartChild {
        seq,
        name: workflow.into(),
        request: Box::new(StartRequest::new(&child_run_id(parent, seq), workflow, 1, input)),
        wake_at_ms: 50_000,
        claim: None,
    }
}

/// [`start_child`] of `double`, leased to `lease`'s worker as it starts.
fn leased_child(parent: &str, seq: u32, input: Value, lease: &ChildLease) -> Op {
    JournalOp::StartChild {
        seq,
        name: "double".into(),
        request: Box::new(StartRequest::new(&child_run_id(parent, seq), "double", 1, input)),
        wake_at_ms: 50_000,
        claim: Some(lease.clone()),
    }
}

fn wait_for_child(seq: u32) -> Op {
    JournalOp::Suspend { status: SuspendStatus::Waiting, wake_at_ms: 50_000, waiting_for: Some(child_event(seq)) }
}

/// A parent `p` that started child `p.0` (`double`) and waits for it; returns the parent's token.
fn parent_waiting(d: &mut Db) -> String {
    let t = started_and_claimed(&mut d.store, "p", 1_000);
    let results = d.store.commit(
        vec![write("p", &t, start_child("p", 0, "double", json!({"x": 21}))), write("p", &t, wait_for_child(0))],
        1_010,
    );
    assert_eq!(results.unwrap(), [WriteResult::TxResult(Ok(json!(null))), WriteResult::Done]);
    t
}

fn claim_child(store: &mut PgWorkflows, now_ms: i64) -> ClaimedRun {
    let claimed = store.claim(&claim_request("wc", vec![version("double", 1, None)], 10), now_ms).unwrap();
    assert_eq!(claimed.len(), 1);
    claimed.into_iter().next().unwrap()
}

#[test]
fn a_child_is_created_with_its_parents_entry_and_its_end_wakes_the_parent() {
    let mut d = db!("wf_child");
    parent_waiting(&mut d);
    let parent = detail(&d.store, "p");
    assert_eq!(parent.journal[0].kind, StepKind::Child);
    assert_eq!(
        (parent.journal[0].status, parent.journal[0].event_name.as_deref()),
        (StepStatus::Waiting, Some("child/0"))
    );
    assert_eq!((parent.run.status, parent.run.wake_at_ms), (RunStatus::Waiting, 50_000));
    let child = detail(&d.store, "p.0").run;
    assert_eq!((child.status, child.parent_run_id.as_deref()), (RunStatus::Pending, Some("p")));
    assert_eq!(child.input, json!({"x": 21}));
    // The child ends on another worker (connection): the parent learns of it in that
    // transaction, as the event child/0, and is due now.
    let mut other = d.another();
    let c = claim_child(&mut other, 2_000);
    let end = finish(FinishStatus::Completed, Some(json!({"y": 42})), None);
    assert_eq!(commit_one(&mut other, "p.0", &c.lease_token, end, 2_100), WriteResult::Done);
    let parent = detail(&d.store, "p");
    assert_eq!(parent.run.wake_at_ms, 2_100);
    assert_eq!(parent.events.len(), 1);
    let event = &parent.events[0];
    assert_eq!((event.event_id.as_str(), event.name.as_str()), ("child/0", "child/0"));
    assert_eq!(event.payload, json!({"run_id": "p.0", "status": "completed", "result": {"y": 42}, "error": null}));
    // The parent consumes it with its child step's entry.
    let c = claim(&mut d.store, "w1", 2_200).remove(0);
    assert_eq!(c.events.len(), 1);
    let done = JournalOp::TimerFinished { seq: 0, event_id: Some("child/0".into()), output: event.payload.clone() };
    assert_eq!(commit_one(&mut d.store, "p", &c.lease_token, done, 2_300), WriteResult::Done);
    let parent = detail(&d.store, "p");
    assert_eq!((parent.journal[0].status, parent.events[0].consumed_by_seq), (StepStatus::Completed, Some(0)));
}

#[test]
fn a_childs_end_racing_its_parents_suspension_is_never_lost() {
    let mut d = db!("wf_child_race");
    const ROUNDS: usize = 25;
    let mut child_store = d.another();
    for round in 0..ROUNDS {
        let parent = format!("p{round:02}");
        let t = started_and_claimed(&mut d.store, &parent, 1_000);
        let started =
            d.store.commit(vec![write(&parent, &t, start_child(&parent, 0, "double", json!({})))], 1_010).unwrap();
        assert_eq!(started, [WriteResult::TxResult(Ok(json!(null)))]);
        let child = claim_child(&mut child_store, 1_020);
        let barrier = Arc::new(Barrier::new(2));
        let gate = barrier.clone();
        let ending = std::thread::spawn(move || {
            gate.wait();
            let end = finish(FinishStatus::Completed, Some(json!(1)), None);
            assert_eq!(
                commit_one(&mut child_store, &child.run.run_id, &child.lease_token, end, 1_500),
                WriteResult::Done
            );
            child_store
        });
        barrier.wait();
        assert_eq!(commit_one(&mut d.store, &parent, &t, wait_for_child(0), 1_500), WriteResult::Done);
        child_store = ending.join().unwrap();
        let run = detail(&d.store, &parent).run;
        assert_eq!((run.status, run.wake_at_ms), (RunStatus::Waiting, 1_500), "{parent}: the child's end was lost");
    }
}

#[test]
fn a_parents_end_cancels_its_active_children_and_a_parked_child_tells_nobody() {
    let mut d = db!("wf_cascade");
    let t = parent_waiting(&mut d);
    // A second child, parked by its worker: it waits for an operator and tells the parent nothing.
    let started = d.store.commit(vec![write("p", &t, start_child("p", 1, "double", json!({"x": 1})))], 1_020);
    assert_eq!(started.unwrap(), [WriteResult::Fenced], "the parent's lease went with its suspension");
    let t = claim(&mut d.store, "w1", 60_000).remove(0).lease_token;
    let started = d.store.commit(vec![write("p", &t, start_child("p", 1, "double", json!({"x": 1})))], 60_010);
    assert_eq!(started.unwrap(), [WriteResult::TxResult(Ok(json!(null)))]);
    let mut other = d.another();
    let both = other.claim(&claim_request("wc", vec![version("double", 1, None)], 10), 60_020).unwrap();
    assert_eq!(both.len(), 2);
    let second = both.iter().find(|c| c.run.run_id == "p.1").unwrap();
    let park = finish(FinishStatus::Parked, None, Some("non-deterministic"));
    assert_eq!(commit_one(&mut other, "p.1", &second.lease_token, park, 60_030), WriteResult::Done);
    assert!(detail(&d.store, "p").events.is_empty(), "a parked child tells its parent nothing");
    // The parent fails: its active child (p.0, leased by the other worker) gets a cancel request,
    // the parked one is left alone.
    let fail = finish(FinishStatus::Failed, None, Some("gave up"));
    assert_eq!(commit_one(&mut d.store, "p", &t, fail, 60_040), WriteResult::Done);
    let first = detail(&d.store, "p.0").run;
    assert!(first.cancel_requested);
    assert_eq!(first.error.as_deref(), Some("cancel requested: its parent run ended"));
    assert_eq!(first.lease_owner.as_deref(), Some("wc"), "a cancel request leaves the lease");
    let p0 = both.iter().find(|c| c.run.run_id == "p.0").unwrap();
    assert_eq!(
        other.heartbeat("wc", &[("p.0".into(), p0.lease_token.clone())], LEASE_MS, 60_050).unwrap(),
        [LeaseState::Held { cancel_requested: true }]
    );
    assert!(!detail(&d.store, "p.1").run.cancel_requested);
    // The cancelled child's end does not reach its finished parent.
    let end = finish(FinishStatus::Cancelled, None, Some("cancelled"));
    assert_eq!(commit_one(&mut other, "p.0", &p0.lease_token, end, 60_060), WriteResult::Done);
    assert!(detail(&d.store, "p").events.is_empty());
}

/// A parent that ends and its child that suspends, in one batch (one worker runs both): the
/// cancel the parent's end requests keeps the child due (the suspension reads the flag as the
/// batch left it, not as it was when the batch began).
#[test]
fn a_child_suspending_in_the_batch_that_ends_its_parent_stays_due() {
    let mut d = db!("wf_cascade_batch");
    let t = started_and_claimed(&mut d.store, "p", 1_000);
    let started = d.store.commit(vec![write("p", &t, start_child("p", 0, "double", json!({})))], 1_010).unwrap();
    assert_eq!(started, [WriteResult::TxResult(Ok(json!(null)))]);
    let c = claim_child(&mut d.store, 1_020);
    let sleep = JournalOp::Suspend { status: SuspendStatus::Sleeping, wake_at_ms: 90_000, waiting_for: None };
    let batch =
        vec![write("p", &t, finish(FinishStatus::Failed, None, Some("gave up"))), write("p.0", &c.lease_token, sleep)];
    assert_eq!(d.store.commit(batch, 1_030).unwrap(), [WriteResult::Done, WriteResult::Done]);
    let child = detail(&d.store, "p.0").run;
    assert!(child.cancel_requested);
    assert_eq!((child.status, child.wake_at_ms), (RunStatus::Sleeping, 1_030), "the cancel keeps it due");
}

#[test]
fn abandoning_a_parent_cancels_its_children_and_abandoning_a_child_wakes_its_parent() {
    let mut d = db!("wf_abandon_cascade");
    parent_waiting(&mut d);
    d.another().abandon("p.0", "not needed", 2_000).unwrap();
    let parent = detail(&d.store, "p");
    assert_eq!(parent.run.wake_at_ms, 2_000);
    assert_eq!(parent.events[0].payload["status"], "cancelled");
    assert_eq!(parent.events[0].payload["error"], "abandoned: not needed");
    // Another family: the parent is abandoned, its waiting child gets a cancel request.
    let tq = started_and_claimed(&mut d.store, "q", 3_000);
    let started = d.store.commit(vec![write("q", &tq, start_child("q", 0, "double", json!({})))], 3_010).unwrap();
    assert_eq!(started, [WriteResult::TxResult(Ok(json!(null)))]);
    d.another().abandon("q", "customer left", 3_100).unwrap();
    let child = detail(&d.store, "q.0").run;
    assert!(child.cancel_requested);
    assert_eq!(child.wake_at_ms, 3_010, "already due");
}

#[test]
fn a_child_id_taken_by_another_run_fails_the_step_for_good_and_an_equal_one_is_adopted() {
    let mut d = db!("wf_child_taken");
    // p.0 exists as another workflow's run: the child step fails for good, nothing is started.
    start(&mut d.store, &[StartRequest::new("p.0", "refund", 1, json!({}))], 900);
    let t = started_and_claimed(&mut d.store, "p", 1_000);
    let results = d.store.commit(vec![write("p", &t, start_child("p", 0, "double", json!({})))], 1_010).unwrap();
    assert!(
        matches!(&results[0], WriteResult::TxResult(Err(f)) if !f.retryable && f.message.contains("taken")),
        "{results:?}"
    );
    let parent = detail(&d.store, "p");
    assert_eq!((parent.journal[0].kind, parent.journal[0].status), (StepKind::Child, StepStatus::Failed));
    assert_eq!(detail(&d.store, "p.0").run.parent_run_id, None);
    // q.0 exists with the same workflow and input, and has ended: adopted, and the parent learns
    // of its end at once.
    start(&mut d.store, &[StartRequest::new("q.0", "double", 1, json!({"x": 1}))], 900);
    let c = claim_child(&mut d.store, 950);
    assert_eq!(
        commit_one(&mut d.store, "q.0", &c.lease_token, finish(FinishStatus::Completed, Some(json!(2)), None), 960),
        WriteResult::Done
    );
    let t = started_and_claimed(&mut d.store, "q", 1_000);
    let results = d.store.commit(vec![write("q", &t, start_child("q", 0, "double", json!({"x": 1})))], 1_010).unwrap();
    assert_eq!(results, [WriteResult::TxResult(Ok(json!(null)))]);
    assert_eq!(detail(&d.store, "q.0").run.parent_run_id.as_deref(), Some("q"));
    let parent = detail(&d.store, "q");
    assert_eq!(parent.events.len(), 1);
    assert_eq!(parent.events[0].payload["result"], json!(2));
}

#[test]
fn a_child_id_under_an_expired_receipt_is_started_under_a_live_one_is_answered_and_a_queued_child_is_journaled() {
    let mut d = db!("wf_child_receipt");
    // Receipts of purged runs under the ids p.0 (expired at 1,005) and q.0 (live until 9,000,
    // of another workflow), written as a purge writes them.
    d.scalar(
        "WITH r AS (INSERT INTO {s}.run_receipts (run_id, workflow, input_hash, status, finished_at_ms, expires_at_ms)
         VALUES ('p.0', 'double', 'h', 'completed', 1, 1005), ('q.0', 'refund', 'h', 'completed', 1, 9000)
         RETURNING 1) SELECT count(*) FROM r",
    );
    // p.0's is forgotten and the child started in the one statement, with its parent's entry.
    let t = started_and_claimed(&mut d.store, "p", 1_000);
    let results = d.store.commit(vec![write("p", &t, start_child("p", 0, "double", json!({"x": 1})))], 1_010).unwrap();
    assert_eq!(results, [WriteResult::TxResult(Ok(json!(null)))]);
    assert_eq!(detail(&d.store, "p.0").run.parent_run_id.as_deref(), Some("p"));
    assert_eq!(detail(&d.store, "p").journal[0].status, StepStatus::Waiting);
    assert_eq!(d.scalar("SELECT count(*) FROM {s}.run_receipts WHERE run_id = 'p.0'"), 0);
    // q.0's still stands for a run of another workflow: the child step fails for good, and
    // nothing is started.
    let t = started_and_claimed(&mut d.store, "q", 1_020);
    let results = d.store.commit(vec![write("q", &t, start_child("q", 0, "double", json!({"x": 1})))], 1_030).unwrap();
    assert!(
        matches!(&results[0], WriteResult::TxResult(Err(f)) if !f.retryable && f.message.contains("taken")),
        "{results:?}"
    );
    assert_eq!(d.scalar("SELECT count(*) FROM {s}.runs WHERE run_id = 'q.0'"), 0);
    assert_eq!(d.scalar("SELECT count(*) FROM {s}.run_receipts WHERE run_id = 'q.0'"), 1);
    assert_eq!(detail(&d.store, "q").journal[0].status, StepStatus::Failed);
    // A child that joins a queue goes the general way (the queue's checks): started, queued,
    // and its parent's entry written waiting as the one statement writes it.
    d.store.put_queue(&QueueSpec::new("kids"), 1_040).unwrap();
    let t = started_and_claimed(&mut d.store, "r", 1_050);
    let JournalOp::StartChild { mut request, seq, name, wake_at_ms, claim } =
        start_child("r", 0, "double", json!({"x": 2}))
    else {
        unreachable!()
    };
    request.queue = Some(Enqueue { queue: "kids".into(), priority: 0, dedup_id: None });
    let op = JournalOp::StartChild { seq, name, request, wake_at_ms, claim };
    let results = d.store.commit(vec![write("r", &t, op)], 1_060).unwrap();
    assert_eq!(results, [WriteResult::TxResult(Ok(json!(null)))]);
    let child = detail(&d.store, "r.0").run;
    assert_eq!((child.parent_run_id.as_deref(), child.queue.as_deref()), (Some("r"), Some("kids")));
    let parent = detail(&d.store, "r");
    assert_eq!(parent.journal.len(), 1, "{:?}", parent.journal);
    assert_eq!(
        (parent.journal[0].status, parent.journal[0].kind, parent.journal[0].wake_at_ms),
        (StepStatus::Waiting, StepKind::Child, Some(50_000))
    );
}

/// New children's starts in one batch are one statement; a start whose id is taken is answered
/// the general way when the batch writes them, and a later write of its parent sees it written.
#[test]
fn children_started_in_one_batch_answer_what_they_would_one_by_one() {
    let mut d = db!("wf_child_starts");
    // Under b.0, an ended run of the same workflow and input (adopted); under c.0, one of another
    // input (a conflict).
    start(&mut d.store, &[StartRequest::new("b.0", "double", 1, json!({"x": 2}))], 900);
    start(&mut d.store, &[StartRequest::new("c.0", "double", 1, json!({"x": 9}))], 900);
    let doubles = claim_request("w0", vec![version("double", 1, None)], 10);
    let claimed = d.store.claim(&doubles, 900).unwrap();
    let token = claimed.iter().find(|c| c.run.run_id == "b.0").unwrap().lease_token.clone();
    let end = finish(FinishStatus::Completed, Some(json!(4)), None);
    assert_eq!(commit_one(&mut d.store, "b.0", &token, end, 950), WriteResult::Done);
    let lease = ChildLease { worker_id: "w1".into(), lease_ms: 10_000 };
    let (ta, tb, tc) = (
        started_and_claimed(&mut d.store, "a", 1_000),
        started_and_claimed(&mut d.store, "b", 1_000),
        started_and_claimed(&mut d.store, "c", 1_000),
    );
    let batch = vec![
        write("a", &ta, leased_child("a", 0, json!({"x": 1}), &lease)),
        write("b", &tb, start_child("b", 0, "double", json!({"x": 2}))),
        write("c", &tc, start_child("c", 0, "double", json!({"x": 3}))),
        write("b", &tb, wait_for_child(0)),
    ];
    let results = d.store.commit(batch, 2_000).unwrap();
    assert!(matches!(&results[0], WriteResult::Claimed(child) if child.run.run_id == "a.0"), "{results:?}");
    assert_eq!(results[1..2], [WriteResult::TxResult(Ok(json!(null)))]);
    assert!(matches!(&results[2], WriteResult::TxResult(Err(f)) if !f.retryable && f.message.contains("taken")));
    assert_eq!(results[3], WriteResult::Done);
    let a0 = detail(&d.store, "a.0").run;
    assert_eq!((a0.parent_run_id.as_deref(), a0.lease_owner.as_deref()), (Some("a"), Some("w1")));
    assert_eq!(detail(&d.store, "a").journal[0].status, StepStatus::Waiting);
    // b adopted its ended child, was told at once, and its suspension saw it: due now.
    let b = detail(&d.store, "b");
    assert_eq!((b.journal[0].status, b.run.status, b.run.wake_at_ms), (StepStatus::Waiting, RunStatus::Waiting, 2_000));
    assert_eq!((b.events.len(), detail(&d.store, "b.0").run.parent_run_id.as_deref()), (1, Some("b")));
    assert_eq!(detail(&d.store, "c").journal[0].status, StepStatus::Failed);
    assert_eq!(detail(&d.store, "c.0").run.parent_run_id, None);
}

#[test]
fn a_child_leased_as_it_starts_is_claimed_by_nobody_else_and_its_end_is_taken_by_the_waiting_parent() {
    let mut d = db!("wf_child_leased");
    let t = started_and_claimed(&mut d.store, "p", 1_000);
    let lease = ChildLease { worker_id: "w1".into(), lease_ms: 10_000 };
    let op = leased_child("p", 0, json!({"x": 21}), &lease);
    let results = d.store.commit(vec![write("p", &t, op)], 1_010).unwrap();
    let WriteResult::Claimed(child) = &results[0] else { panic!("{results:?}") };
    assert_eq!((child.run.run_id.as_str(), child.run.status), ("p.0", RunStatus::Pending));
    assert_eq!((child.run.lease_owner.as_deref(), child.run.lease_expires_at_ms), (Some("w1"), Some(11_010)));
    assert_eq!((child.run.input.clone(), child.run.parent_run_id.as_deref()), (json!({"x": 21}), Some("p")));
    assert!(child.journal.is_empty() && child.events.is_empty() && !child.recovered);
    assert_eq!(child.run, detail(&d.store, "p.0").run, "the claimed child is its row as stored");
    // Leased: another worker's claim does not take it while the lease lasts.
    let mut other = d.another();
    assert!(other.claim(&claim_request("w2", vec![version("double", 1, None)], 10), 2_000).unwrap().is_empty());
    let end = JournalOp::Finish { status: FinishStatus::Completed, result: Some(json!({"y": 42})), error: None };
    assert_eq!(commit_one(&mut d.store, "p.0", &child.lease_token, end, 2_100), WriteResult::Done);
    // The parent, still holding its lease, settles its entry with the end it learned, which is
    // the end event's payload.
    let payload = json!({"run_id": "p.0", "status": "completed", "result": {"y": 42}, "error": null});
    let ended = JournalOp::ChildEnded { seq: 0, end: payload.clone() };
    assert_eq!(commit_one(&mut d.store, "p", &t, ended, 2_200), WriteResult::Done);
    let parent = detail(&d.store, "p");
    assert_eq!((parent.journal[0].status, parent.journal[0].output.clone()), (StepStatus::Completed, Some(payload)));
    assert_eq!(parent.events[0].consumed_by_seq, Some(0));
    // An adopted child (it existed already) is not leased.
    start(&mut d.store, &[StartRequest::new("p.1", "double", 1, json!({"x": 1}))], 2_300);
    let op = leased_child("p", 1, json!({"x": 1}), &lease);
    let results = d.store.commit(vec![write("p", &t, op)], 2_400).unwrap();
    assert_eq!(results, [WriteResult::TxResult(Ok(json!(null)))]);
    assert_eq!(detail(&d.store, "p.1").run.lease_owner, None);
    // A parent that went on with an end the store does not hold (here: none yet; then another
    // one) is fenced, its lease released and its later writes of the batch fenced too: it
    // replays from the store.
    let tq = started_and_claimed(&mut d.store, "q", 3_000);
    let results = d.store.commit(vec![write("q", &tq, leased_child("q", 0, json!({"x": 5}), &lease))], 3_005).unwrap();
    let WriteResult::Claimed(c) = &results[0] else { panic!("{results:?}") };
    let (c, q_end) = (c.lease_token.clone(), json!({"run_id": "q.0"}));
    let batch = vec![
        write("q", &tq, JournalOp::ChildEnded { seq: 0, end: q_end.clone() }),
        write("q", &tq, JournalOp::Finish { status: FinishStatus::Completed, result: None, error: None }),
    ];
    assert_eq!(d.store.commit(batch, 3_010).unwrap(), [WriteResult::Fenced, WriteResult::Fenced]);
    let q = detail(&d.store, "q");
    assert_eq!((q.run.lease_owner.as_deref(), q.journal[0].status), (None, StepStatus::Waiting));
    let end = JournalOp::Finish { status: FinishStatus::Failed, result: None, error: None };
    assert_eq!(commit_one(&mut d.store, "q.0", &c, end, 3_100), WriteResult::Done);
    let tq = claim(&mut d.store, "w1", 3_200).into_iter().find(|c| c.run.run_id == "q").expect("q").lease_token;
    assert_eq!(
        commit_one(&mut d.store, "q", &tq, JournalOp::ChildEnded { seq: 0, end: q_end }, 3_300),
        WriteResult::Fenced
    );
    assert!(detail(&d.store, "q").events.iter().all(|e| e.consumed_by_seq.is_none()));
}

fn finish_child(status: FinishStatus, result: Option<Value>, parent_lease_token: &str) -> Op {
    JournalOp::FinishChild { status, result, error: None, parent_lease_token: parent_lease_token.into() }
}

#[test]
fn a_child_ending_for_its_parent_waiting_in_memory_settles_the_parents_entry_only_under_that_lease() {
    let mut d = db!("wf_child_settles");
    let lease = ChildLease { worker_id: "w1".into(), lease_ms: 10_000 };
    let t = started_and_claimed(&mut d.store, "p", 1_000);
    let results = d.store.commit(vec![write("p", &t, leased_child("p", 0, json!({"x": 21}), &lease))], 1_010);
    let WriteResult::Claimed(child) = &results.unwrap()[0] else { panic!("a leased child") };
    let c = child.lease_token.clone();
    // The child has a child of its own still running: its end cancels it as any end does.
    let results = d.store.commit(vec![write("p.0", &c, start_child("p.0", 0, "double", json!({"x": 1})))], 1_020);
    assert_eq!(results.unwrap(), [WriteResult::TxResult(Ok(json!(null)))]);
    let before = detail(&d.store, "p").run;
    // Bad input is refused before anything is written.
    let parked = JournalOp::FinishChild {
        status: FinishStatus::Parked,
        result: None,
        error: Some("stuck".into()),
        parent_lease_token: t.clone(),
    };
    assert_eq!(code(d.store.commit(vec![write("p.0", &c, parked)], 1_030).unwrap_err()), codes::INVALID_ARGUMENT);
    let bad_token = finish_child(FinishStatus::Completed, None, "not a token");
    assert_eq!(code(d.store.commit(vec![write("p.0", &c, bad_token)], 1_030).unwrap_err()), codes::INVALID_ID);
    assert_eq!(detail(&d.store, "p.0").run.status, RunStatus::Pending);
    // Under the parent's lease: the entry is settled with the end, no event is sent, the parent's
    // row is as it was (it keeps its lease and goes on), and the child's own child is cancelled.
    let end = finish_child(FinishStatus::Completed, Some(json!({"y": 42})), &t);
    assert_eq!(commit_one(&mut d.store, "p.0", &c, end, 2_100), WriteResult::ParentSettled);
    let payload = json!({"run_id": "p.0", "status": "completed", "result": {"y": 42}, "error": null});
    let parent = detail(&d.store, "p");
    assert_eq!((parent.journal[0].status, parent.journal[0].output.clone()), (StepStatus::Completed, Some(payload)));
    assert!(parent.events.is_empty(), "{:?}", parent.events);
    assert_eq!(parent.run, before, "the parent's row is untouched");
    assert_eq!(detail(&d.store, "p.0").run.status, RunStatus::Completed);
    assert!(detail(&d.store, "p.0.0").run.cancel_requested);
    // Fenced by the child's own token: nothing happens twice.
    let again = finish_child(FinishStatus::Failed, None, &t);
    assert_eq!(commit_one(&mut d.store, "p.0", &c, again, 2_150), WriteResult::Fenced);
    let step = finish(FinishStatus::Completed, Some(json!(42)), None);
    assert_eq!(commit_one(&mut d.store, "p", &t, step, 2_200), WriteResult::Done);
    // A parent whose lease is gone (here: it suspended first, in an earlier batch) is told by
    // the end event and woken, as after any finish; its entry waits for it.
    let tq = started_and_claimed(&mut d.store, "q", 3_000);
    let results = d.store.commit(vec![write("q", &tq, leased_child("q", 0, json!({"x": 5}), &lease))], 3_005);
    let WriteResult::Claimed(child) = &results.unwrap()[0] else { panic!("a leased child") };
    let suspend =
        JournalOp::Suspend { status: SuspendStatus::Waiting, wake_at_ms: 90_000, waiting_for: Some(child_event(0)) };
    assert_eq!(commit_one(&mut d.store, "q", &tq, suspend, 3_010), WriteResult::Done);
    let end = finish_child(FinishStatus::Completed, Some(json!(10)), &tq);
    assert_eq!(commit_one(&mut d.store, "q.0", &child.lease_token, end, 3_100), WriteResult::Done);
    let q = detail(&d.store, "q");
    assert_eq!((q.journal[0].status, q.run.wake_at_ms), (StepStatus::Waiting, 3_100));
    assert_eq!((q.events.len(), q.events[0].payload["result"].clone()), (1, json!(10)));
    // In one batch, the parent's suspension first and then its child's end: the same.
    let tr = started_and_claimed(&mut d.store, "r", 4_000);
    let results = d.store.commit(vec![write("r", &tr, leased_child("r", 0, json!({"x": 6}), &lease))], 4_005);
    let WriteResult::Claimed(child) = &results.unwrap()[0] else { panic!("a leased child") };
    let suspend =
        JournalOp::Suspend { status: SuspendStatus::Waiting, wake_at_ms: 90_000, waiting_for: Some(child_event(0)) };
    let batch = vec![
        write("r", &tr, suspend),
        write("r.0", &child.lease_token, finish_child(FinishStatus::Completed, Some(json!(12)), &tr)),
    ];
    assert_eq!(d.store.commit(batch, 4_100).unwrap(), [WriteResult::Done, WriteResult::Done]);
    let r = detail(&d.store, "r");
    assert_eq!((r.journal[0].status, r.run.wake_at_ms, r.events.len()), (StepStatus::Waiting, 4_100, 1));
}

/// The token of the child a leased `StartChild` answered.
fn claimed_child(results: tidemark_core::Result<Vec<WriteResult>>) -> Vec<String> {
    results
        .unwrap()
        .into_iter()
        .map(|result| match result {
            WriteResult::Claimed(child) => child.lease_token,
            other => panic!("a leased child, not {other:?}"),
        })
        .collect()
}

/// Children's ends in one batch are written together (one statement for the siblings and the
/// others), but a run's end never in the same statement as its parent's: the batch answers and
/// writes what the same writes one batch each would.
#[test]
fn children_ending_in_one_batch_settle_what_they_would_one_by_one() {
    let mut d = db!("wf_child_ends");
    let lease = ChildLease { worker_id: "w1".into(), lease_ms: 10_000 };
    let end = |n: i64, parent_token: &str| finish_child(FinishStatus::Completed, Some(json!(n)), parent_token);
    // s waits in memory for two children; s.0 waits in memory for its own child s.0.0.
    let ts = started_and_claimed(&mut d.store, "s", 1_000);
    let batch = vec![
        write("s", &ts, leased_child("s", 0, json!({"x": 1}), &lease)),
        write("s", &ts, leased_child("s", 1, json!({"x": 2}), &lease)),
    ];
    let [c0, c1] = <[String; 2]>::try_from(claimed_child(d.store.commit(batch, 1_010))).unwrap();
    let [c00] = <[String; 1]>::try_from(claimed_child(
        d.store.commit(vec![write("s.0", &c0, leased_child("s.0", 0, json!({"x": 3}), &lease))], 1_020),
    ))
    .unwrap();
    // v's child ends after v suspended: told by the end event, as one by one.
    let tv = started_and_claimed(&mut d.store, "v", 1_000);
    let [cv] = <[String; 1]>::try_from(claimed_child(
        d.store.commit(vec![write("v", &tv, leased_child("v", 0, json!({"x": 4}), &lease))], 1_030),
    ))
    .unwrap();
    assert_eq!(commit_one(&mut d.store, "v", &tv, wait_for_child(0), 1_040), WriteResult::Done);

    let batch = vec![
        write("s.0.0", &c00, end(3, &c0)),
        write("s.0", &c0, end(1, &ts)),
        write("v.0", &cv, end(4, &tv)),
        write("s.1", &c1, end(2, &ts)),
    ];
    let results = d.store.commit(batch, 2_000).unwrap();
    let settled = WriteResult::ParentSettled;
    assert_eq!(results, [settled.clone(), settled.clone(), WriteResult::Done, settled.clone()]);
    let s = detail(&d.store, "s");
    let outputs: Vec<Value> = s.journal.iter().map(|e| e.output.clone().unwrap()["result"].clone()).collect();
    assert_eq!((outputs, s.events.len()), (vec![json!(1), json!(2)], 0), "{s:?}");
    assert_eq!(detail(&d.store, "s.0").journal[0].output.clone().unwrap()["result"], json!(3));
    let v = detail(&d.store, "v");
    assert_eq!((v.journal[0].status, v.run.wake_at_ms, v.events.len()), (StepStatus::Waiting, 2_000, 1));
    for run in ["s.0.0", "s.0", "s.1", "v.0"] {
        assert_eq!(detail(&d.store, run).run.status, RunStatus::Completed, "{run}");
    }

    // The other way round: a child's end after its parent's in the same batch finds the parent
    // ended (nothing settled, nobody told), and the parent's end has asked it to cancel.
    let tu = started_and_claimed(&mut d.store, "u", 3_000);
    let [cu0] = <[String; 1]>::try_from(claimed_child(
        d.store.commit(vec![write("u", &tu, leased_child("u", 0, json!({"x": 5}), &lease))], 3_010),
    ))
    .unwrap();
    let [cu00] = <[String; 1]>::try_from(claimed_child(
        d.store.commit(vec![write("u.0", &cu0, leased_child("u.0", 0, json!({"x": 6}), &lease))], 3_020),
    ))
    .unwrap();
    let batch = vec![write("u.0", &cu0, end(5, &tu)), write("u.0.0", &cu00, end(6, &cu0))];
    assert_eq!(d.store.commit(batch, 3_100).unwrap(), [settled, WriteResult::Done]);
    let (u0, u00) = (detail(&d.store, "u.0"), detail(&d.store, "u.0.0"));
    assert_eq!((u0.journal[0].status, u0.events.len()), (StepStatus::Waiting, 0), "{u0:?}");
    assert_eq!((u00.run.status, u00.run.cancel_requested), (RunStatus::Completed, true), "{u00:?}");
    assert_eq!(detail(&d.store, "u").journal[0].output.clone().unwrap()["result"], json!(5));
}

// ---------------------------------------------------------------------------------------------
// Messages: published values and messages between runs

#[test]
fn a_run_publishes_the_latest_value_of_a_key_and_sends_messages_once() {
    let mut d = db!("wf_messages");
    start(&mut d.store, &[req("sender"), req("receiver")], 1_000);
    let claimed = claim(&mut d.store, "w1", 1_000);
    let token = |id: &str| claimed.iter().find(|c| c.run.run_id == id).unwrap().lease_token.clone();
    let (ts, tr) = (token("sender"), token("receiver"));
    // The receiver waits for "ping".
    let wait = JournalOp::TimerStarted {
        seq: 0,
        name: "ping".into(),
        kind: StepKind::Wait,
        wake_at_ms: 100_000,
        event_name: Some("ping".into()),
    };
    let suspend =
        JournalOp::Suspend { status: SuspendStatus::Waiting, wake_at_ms: 100_000, waiting_for: Some("ping".into()) };
    d.store.commit(vec![write("receiver", &tr, wait), write("receiver", &tr, suspend)], 1_010).unwrap();
    let batch = vec![
        write("sender", &ts, JournalOp::Publish { seq: 0, key: "progress".into(), value: json!({"done": 1}) }),
        write("sender", &ts, JournalOp::Publish { seq: 1, key: "progress".into(), value: json!({"done": 2}) }),
        write(
            "sender",
            &ts,
            JournalOp::Send { seq: 2, to: "receiver".into(), topic: "ping".into(), payload: json!("hi") },
        ),
        write("sender", &ts, JournalOp::Send { seq: 3, to: "nobody".into(), topic: "ping".into(), payload: json!(1) }),
    ];
    let results = d.store.commit(batch, 1_020).unwrap();
    let message_id = tidemark_core::workflow::message_event_id("sender", 2);
    assert_eq!(results[0], WriteResult::Done);
    assert_eq!(results[2], WriteResult::TxResult(Ok(json!({"to": "receiver", "event_id": message_id}))));
    assert!(
        matches!(&results[3], WriteResult::TxResult(Err(f)) if !f.retryable && f.message.contains("nobody")),
        "{results:?}"
    );
    let published = d.store.published("sender", "progress").unwrap().unwrap();
    assert_eq!((published.value, published.seq, published.updated_at_ms), (json!({"done": 2}), 1, 1_020));
    assert!(d.store.published("sender", "other").unwrap().is_none());
    assert_eq!(code(d.store.published("sender", "bad key").unwrap_err()), codes::INVALID_ID);
    let sender = detail(&d.store, "sender");
    let kinds: Vec<(StepKind, StepStatus)> = sender.journal.iter().map(|e| (e.kind, e.status)).collect();
    assert_eq!(
        kinds,
        [
            (StepKind::Publish, StepStatus::Completed),
            (StepKind::Publish, StepStatus::Completed),
            (StepKind::Send, StepStatus::Completed),
            (StepKind::Send, StepStatus::Failed)
        ]
    );
    // The receiver is due at once, with the message under the store's own id, and consumes it.
    let receiver = detail(&d.store, "receiver");
    assert_eq!(receiver.run.wake_at_ms, 1_020);
    assert_eq!(
        (receiver.events[0].event_id.as_str(), &receiver.events[0].payload),
        (message_id.as_str(), &json!("hi"))
    );
    let done = JournalOp::TimerFinished { seq: 0, event_id: Some(message_id.clone()), output: json!("hi") };
    let tr = claim(&mut d.store, "w2", 1_030).into_iter().find(|c| c.run.run_id == "receiver").unwrap().lease_token;
    assert_eq!(commit_one(&mut d.store, "receiver", &tr, done, 1_040), WriteResult::Done);
    assert_eq!(detail(&d.store, "receiver").events[0].consumed_by_seq, Some(0));
    // Bad input is refused before anything runs.
    let bad = JournalOp::Send { seq: 4, to: "bad id".into(), topic: "ping".into(), payload: json!(1) };
    assert_eq!(code(d.store.commit(vec![write("sender", &ts, bad)], 1_050).unwrap_err()), codes::INVALID_ID);
    let big = JournalOp::Publish { seq: 4, key: "k".into(), value: json!("x".repeat(300 * 1024)) };
    assert_eq!(code(d.store.commit(vec![write("sender", &ts, big)], 1_050).unwrap_err()), codes::PAYLOAD_TOO_LARGE);
    // A purged run's published values go with it.
    let end = finish(FinishStatus::Completed, None, None);
    assert_eq!(commit_one(&mut d.store, "sender", &ts, end, 1_060), WriteResult::Done);
    d.store.purge(i64::MAX, 10, 2_000).unwrap();
    assert!(d.store.published("sender", "progress").unwrap().is_none());
}

/// Two runs messaging each other from two workers' commits at the same moment, again and again:
/// each commit locks its receiver with its batch, in one order, so neither waits for the other in
/// a cycle (no deadlock for the server to break) and every message arrives.
#[test]
fn two_runs_messaging_each_other_from_two_connections_never_deadlock() {
    let mut d = db!("wf_messages_race");
    start(&mut d.store, &[req("a"), req("b")], 1_000);
    let claimed = claim(&mut d.store, "w1", 1_000);
    let token = |id: &str| claimed.iter().find(|c| c.run.run_id == id).unwrap().lease_token.clone();
    let (ta, tb) = (token("a"), token("b"));
    let mut other = d.another();
    for seq in 0..15_u32 {
        let barrier = Arc::new(Barrier::new(2));
        let (gate, tb) = (barrier.clone(), tb.clone());
        let b_side = std::thread::spawn(move || {
            gate.wait();
            let send = JournalOp::Send { seq, to: "a".into(), topic: "note".into(), payload: json!(seq) };
            let result = other.commit(vec![write("b", &tb, send)], 1_100);
            (other, result)
        });
        barrier.wait();
        let send = JournalOp::Send { seq, to: "b".into(), topic: "note".into(), payload: json!(seq) };
        let mine = d.store.commit(vec![write("a", &ta, send)], 1_100).unwrap();
        let (back, theirs) = b_side.join().unwrap();
        other = back;
        assert!(matches!(mine[0], WriteResult::TxResult(Ok(_))), "{mine:?}");
        assert!(matches!(theirs.unwrap()[0], WriteResult::TxResult(Ok(_))));
    }
    assert_eq!(detail(&d.store, "a").events.len(), 15);
    assert_eq!(detail(&d.store, "b").events.len(), 15);
}

// ---------------------------------------------------------------------------------------------
// Operator controls

/// r1: step 0 completed, step 1 failed on its second attempt, and the run failed.
fn failed_run(d: &mut Db) -> String {
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    let writes = vec![
        write("r1", &t, step_ok(0, "reserve", 1, json!("reserved"))),
        write("r1", &t, step_err(1, "charge", 1, StepFailure::retryable("timeout"), Some(1_100))),
        write("r1", &t, step_err(1, "charge", 2, StepFailure::permanent("declined"), None)),
        write("r1", &t, finish(FinishStatus::Failed, None, Some("declined"))),
    ];
    assert!(d.store.commit(writes, 1_050).unwrap().iter().all(|r| *r == WriteResult::Done));
    t
}

#[test]
fn cancel_is_a_request_that_makes_the_run_due_and_keeps_the_lease() {
    let mut d = db!("wf_cancel");
    start(&mut d.store, &[req("held"), req("asleep")], 1_000);
    let claimed = claim(&mut d.store, "w1", 1_000);
    let token = |id: &str| claimed.iter().find(|c| c.run.run_id == id).unwrap().lease_token.clone();
    let sleep = JournalOp::Suspend { status: SuspendStatus::Sleeping, wake_at_ms: 50_000, waiting_for: None };
    assert_eq!(commit_one(&mut d.store, "asleep", &token("asleep"), sleep, 1_010), WriteResult::Done);
    let run = d.store.cancel("asleep", "customer called", 1_500).unwrap();
    assert!(run.cancel_requested);
    assert_eq!((run.status, run.wake_at_ms), (RunStatus::Sleeping, 1_500));
    assert_eq!(run.error.as_deref(), Some("cancel requested: customer called"));
    assert_eq!(claim_ids(&mut d.store, "w2", 1_500), ["asleep"]);
    let run = d.another().cancel("held", "customer called", 1_600).unwrap();
    assert_eq!(run.lease_owner.as_deref(), Some("w1"));
    let suspend = JournalOp::Suspend { status: SuspendStatus::Pending, wake_at_ms: 90_000, waiting_for: None };
    assert_eq!(commit_one(&mut d.store, "held", &token("held"), suspend, 1_610), WriteResult::Done);
    assert_eq!(detail(&d.store, "held").run.wake_at_ms, 1_610, "a cancel request keeps a suspended run due");
}

#[test]
fn cancel_refuses_finished_unknown_runs_and_bad_reasons() {
    let mut d = db!("wf_bad_cancel");
    failed_run(&mut d);
    let before = detail(&d.store, "r1");
    assert_eq!(code(d.store.cancel("r1", "too late", 2_000).unwrap_err()), codes::INVALID_STATE_CHANGE);
    assert_eq!(code(d.store.cancel("nope", "x", 2_000).unwrap_err()), codes::NOT_FOUND);
    assert_eq!(code(d.store.cancel("r1", " ", 2_000).unwrap_err()), codes::INVALID_ARGUMENT);
    assert_eq!(code(d.store.cancel("bad id", "x", 2_000).unwrap_err()), codes::INVALID_ID);
    assert_eq!(detail(&d.store, "r1"), before);
}

#[test]
fn retry_reopens_the_failed_step_with_a_fresh_budget_and_keeps_its_history() {
    let mut d = db!("wf_retry");
    let old = failed_run(&mut d);
    let run = d.store.retry("r1", "card replaced", 2_000).unwrap();
    assert_eq!((run.status, run.error, run.result, run.wake_at_ms), (RunStatus::Pending, None, None, 2_000));
    let detail1 = detail(&d.store, "r1");
    assert_eq!(detail1.journal[0].status, StepStatus::Completed, "settled steps before it stay");
    let entry = &detail1.journal[1];
    assert_eq!((entry.status, entry.attempts), (StepStatus::Retrying, 0));
    assert_eq!(entry.reason.as_deref(), Some("operator retry: card replaced"));
    assert_eq!(detail1.attempts.len(), 3);
    assert_eq!(commit_one(&mut d.store, "r1", &old, JournalOp::Release, 2_001), WriteResult::Fenced);
    let c = claim(&mut d.store, "w1", 2_000);
    let t = c[0].lease_token.clone();
    assert_eq!(commit_one(&mut d.store, "r1", &t, step_ok(1, "charge", 1, json!("paid")), 2_010), WriteResult::Done);
    let detail2 = detail(&d.store, "r1");
    assert_eq!((detail2.journal[1].status, detail2.journal[1].attempts), (StepStatus::Completed, 1));
    let history: Vec<(u32, u32, bool)> = detail2.attempts.iter().map(|a| (a.seq, a.attempt, a.ok)).collect();
    assert_eq!(history, [(0, 1, true), (1, 1, false), (1, 2, false), (1, 3, true)]);
    assert_eq!(code(d.store.retry("r1", "again", 2_020).unwrap_err()), codes::INVALID_STATE_CHANGE);
    let end = finish(FinishStatus::Completed, Some(json!(1)), None);
    assert_eq!(commit_one(&mut d.store, "r1", &t, end, 2_030), WriteResult::Done);
    let completed = detail(&d.store, "r1");
    assert_eq!(code(d.store.retry("r1", "again", 2_040).unwrap_err()), codes::INVALID_STATE_CHANGE);
    assert_eq!(detail(&d.store, "r1"), completed);
    assert_eq!(code(d.store.retry("nope", "x", 2_040).unwrap_err()), codes::NOT_FOUND);
}

#[test]
fn retrying_a_parked_saga_reopens_the_compensation_that_gave_up() {
    let mut d = db!("wf_retry_parked");
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    let compensate = JournalOp::StepAttempt {
        seq: 2,
        name: "compensate:reserve".into(),
        kind: StepKind::Compensation,
        attempt: 1,
        result: Err(StepFailure::retryable("inventory down")),
        retry_at_ms: None,
    };
    let writes = vec![
        write("r1", &t, step_ok(0, "reserve", 1, json!(1))),
        write("r1", &t, step_err(1, "charge", 1, StepFailure::permanent("declined"), None)),
        write("r1", &t, JournalOp::SetStatus { status: RunStatus::Compensating }),
        write("r1", &t, compensate),
        write("r1", &t, finish(FinishStatus::Parked, None, Some("stuck"))),
    ];
    assert!(d.store.commit(writes, 1_010).unwrap().iter().all(|r| *r == WriteResult::Done));
    d.store.retry("r1", "inventory is back", 2_000).unwrap();
    let statuses: Vec<StepStatus> = detail(&d.store, "r1").journal.iter().map(|e| e.status).collect();
    assert_eq!(statuses, [StepStatus::Completed, StepStatus::Failed, StepStatus::Retrying]);
}

#[test]
fn fork_starts_a_new_run_reusing_the_journal_before_a_step() {
    let mut d = db!("wf_fork");
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    wait_for_approval(&mut d.store, "r1", &t, 1_010);
    d.store.send_event("r1", "ev-1", "approved", &json!(true), 1_020).unwrap();
    d.store.send_event("r1", "ev-2", "other", &json!(2), 1_020).unwrap();
    let t = claim(&mut d.store, "w1", 1_030).remove(0).lease_token;
    let writes = vec![
        write("r1", &t, JournalOp::TimerFinished { seq: 0, event_id: Some("ev-1".into()), output: json!(true) }),
        write("r1", &t, step_ok(1, "reserve", 1, json!("reserved"))),
        write("r1", &t, step_err(2, "charge", 1, StepFailure::permanent("declined"), None)),
        write("r1", &t, finish(FinishStatus::Failed, None, Some("declined"))),
    ];
    assert!(d.store.commit(writes, 1_040).unwrap().iter().all(|r| *r == WriteResult::Done));
    let source = detail(&d.store, "r1");
    let fork = d.store.fork("r1", 2, "r1-fork", 5_000).unwrap();
    assert_eq!((fork.status, fork.forked_from.as_deref(), fork.wake_at_ms), (RunStatus::Pending, Some("r1"), 5_000));
    assert_eq!((fork.workflow.as_str(), fork.version, &fork.input), (WF, 1, &json!({"order": "r1"})));
    let forked = detail(&d.store, "r1-fork");
    assert_eq!(forked.journal, source.journal[..2].to_vec());
    assert_eq!(forked.attempts, source.attempts.iter().filter(|a| a.seq < 2).cloned().collect::<Vec<_>>());
    let events: Vec<&str> = forked.events.iter().map(|e| e.event_id.as_str()).collect();
    assert_eq!(events, ["ev-1"], "only the events its copied waits consumed");
    assert_eq!(detail(&d.store, "r1"), source, "the source is unchanged");
    assert_eq!(claim_ids(&mut d.store, "w1", 5_000), ["r1-fork"]);
    assert_eq!(d.store.fork("r1", 3, "r1-fork-all", 5_000).unwrap().status, RunStatus::Pending);
    assert_eq!(detail(&d.store, "r1-fork-all").journal.len(), 3);
    assert_eq!(code(d.store.fork("r1", 4, "r1-fork-2", 5_000).unwrap_err()), codes::INVALID_SEQ);
    assert_eq!(code(d.store.fork("r1", 0, "r1-fork", 5_000).unwrap_err()), codes::ALREADY_EXISTS);
    assert_eq!(code(d.store.fork("r1", 0, "r1", 5_000).unwrap_err()), codes::ALREADY_EXISTS);
    assert_eq!(code(d.store.fork("nope", 0, "x", 5_000).unwrap_err()), codes::NOT_FOUND);
    assert_eq!(code(d.store.fork("r1", 0, "bad id", 5_000).unwrap_err()), codes::INVALID_ID);
    assert_eq!(code(d.store.fork("r1", RUN_STEPS_MAX + 1, "x", 5_000).unwrap_err()), codes::INVALID_SEQ);
    assert!(d.store.run("r1-fork-2").unwrap().is_none());
}

#[test]
fn skip_step_settles_a_stuck_step_with_the_operators_output_and_fences_the_holder() {
    let mut d = db!("wf_skip");
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    let writes = vec![
        write("r1", &t, step_ok(0, "reserve", 1, json!(1))),
        write("r1", &t, step_err(1, "charge", 1, StepFailure::retryable("timeout"), Some(90_000))),
    ];
    d.store.commit(writes, 1_010).unwrap();
    let run = d.store.skip_step("r1", 1, &json!({"paid": "by hand"}), "paid at the till", 2_000).unwrap();
    assert_eq!((run.status, run.wake_at_ms, run.lease_owner), (RunStatus::Pending, 2_000, None));
    let entry = &detail(&d.store, "r1").journal[1];
    assert_eq!((entry.status, entry.output.clone()), (StepStatus::Skipped, Some(json!({"paid": "by hand"}))));
    assert_eq!(entry.reason.as_deref(), Some("operator skip: paid at the till"));
    assert_eq!(commit_one(&mut d.store, "r1", &t, step_ok(2, "ship", 1, json!(1)), 2_010), WriteResult::Fenced);
    let before = detail(&d.store, "r1");
    assert_eq!(code(d.store.skip_step("r1", 0, &json!(1), "x", 2_020).unwrap_err()), codes::INVALID_STATE_CHANGE);
    assert_eq!(code(d.store.skip_step("r1", 1, &json!(1), "x", 2_020).unwrap_err()), codes::INVALID_STATE_CHANGE);
    assert_eq!(code(d.store.skip_step("r1", 7, &json!(1), "x", 2_020).unwrap_err()), codes::NOT_FOUND);
    assert_eq!(code(d.store.skip_step("r1", u32::MAX, &json!(1), "x", 2_020).unwrap_err()), codes::NOT_FOUND);
    assert_eq!(code(d.store.skip_step("r1", 0, &json!(1), "", 2_020).unwrap_err()), codes::INVALID_ARGUMENT);
    let big = json!("x".repeat(300 * 1024));
    assert_eq!(code(d.store.skip_step("r1", 0, &big, "x", 2_020).unwrap_err()), codes::PAYLOAD_TOO_LARGE);
    assert_eq!(detail(&d.store, "r1"), before);
}

#[test]
fn skip_step_resumes_a_failed_run_and_a_compensating_saga_goes_on_compensating() {
    let mut d = db!("wf_skip_resume");
    failed_run(&mut d);
    let run = d.store.skip_step("r1", 1, &json!("waived"), "waived by finance", 2_000).unwrap();
    assert_eq!((run.status, run.error), (RunStatus::Pending, None));
    assert_eq!(claim_ids(&mut d.store, "w1", 2_000), ["r1"]);
    let t = started_and_claimed(&mut d.store, "r2", 3_000);
    let compensate = JournalOp::StepAttempt {
        seq: 0,
        name: "compensate:reserve".into(),
        kind: StepKind::Compensation,
        attempt: 1,
        result: Err(StepFailure::retryable("down")),
        retry_at_ms: Some(9_000),
    };
    let writes =
        vec![write("r2", &t, JournalOp::SetStatus { status: RunStatus::Compensating }), write("r2", &t, compensate)];
    d.store.commit(writes, 3_010).unwrap();
    let run = d.store.skip_step("r2", 0, &json!(null), "released by hand", 3_100).unwrap();
    assert_eq!(run.status, RunStatus::Compensating);
}

#[test]
fn abandon_ends_a_run_cancelled_with_the_reason() {
    let mut d = db!("wf_abandon");
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    let run = d.store.abandon("r1", "duplicate order", 2_000).unwrap();
    assert_eq!((run.status, run.lease_owner.as_deref()), (RunStatus::Cancelled, None));
    assert_eq!(run.error.as_deref(), Some("abandoned: duplicate order"));
    assert_eq!(commit_one(&mut d.store, "r1", &t, JournalOp::Release, 2_010), WriteResult::Fenced);
    let before = detail(&d.store, "r1");
    assert_eq!(code(d.store.abandon("r1", "again", 2_020).unwrap_err()), codes::INVALID_STATE_CHANGE);
    assert_eq!(detail(&d.store, "r1"), before);
    let t = started_and_claimed(&mut d.store, "r2", 3_000);
    commit_one(&mut d.store, "r2", &t, finish(FinishStatus::Parked, None, Some("non-deterministic")), 3_010);
    assert_eq!(d.store.abandon("r2", "obsolete", 3_020).unwrap().status, RunStatus::Cancelled);
    assert_eq!(code(d.store.abandon("nope", "x", 3_020).unwrap_err()), codes::NOT_FOUND);
}

// ---------------------------------------------------------------------------------------------
// Purge and receipts

fn finished_at(store: &mut PgWorkflows, run_id: &str, now_ms: i64) {
    start(store, &[req(run_id)], now_ms);
    let c = claim(store, "w1", now_ms);
    let c = c.iter().find(|c| c.run.run_id == run_id).unwrap();
    let writes = vec![
        write(run_id, &c.lease_token, step_ok(0, "reserve", 1, json!(1))),
        write(run_id, &c.lease_token, finish(FinishStatus::Completed, Some(json!(1)), None)),
    ];
    store.commit(writes, now_ms).unwrap();
}

#[test]
fn purge_deletes_finished_runs_in_bounded_batches_and_keeps_receipts() {
    let mut d = db!("wf_purge");
    finished_at(&mut d.store, "a", 1_000);
    finished_at(&mut d.store, "b", 2_000);
    finished_at(&mut d.store, "c", 3_000);
    start(&mut d.store, &[req("active")], 500);
    let report = d.store.purge(2_500, 1, 10_000).unwrap();
    assert_eq!((report.runs_deleted, report.journal_deleted, report.more), (1, 1, true));
    assert!(d.store.run("a").unwrap().is_none());
    assert!(d.store.run("b").unwrap().is_some());
    let report = d.store.purge(2_500, 1, 10_000).unwrap();
    assert_eq!((report.runs_deleted, report.more), (1, true));
    let report = d.store.purge(2_500, 1, 10_000).unwrap();
    assert_eq!((report.runs_deleted, report.more), (0, false));
    assert!(d.store.run("c").unwrap().is_some());
    assert!(d.store.run("active").unwrap().is_some());
    assert_eq!(d.scalar("SELECT count(*) FROM {s}.step_attempts WHERE run_id IN ('a', 'b')"), 0);
    let out = d.store.start_runs(&[req("a"), StartRequest { input: json!(2), ..req("b") }], 20_000).unwrap();
    assert_eq!(out[0], StartOutcome::Existing { run_id: "a".into(), status: RunStatus::Completed });
    assert!(matches!(out[1], StartOutcome::Conflict { .. }));
    assert!(d.store.run("a").unwrap().is_none());
    assert_eq!(code(d.store.fork("c", 0, "a", 20_000).unwrap_err()), codes::ALREADY_EXISTS);
    assert_eq!(code(d.store.purge(2_500, 0, 10_000).unwrap_err()), codes::LIMIT_EXCEEDED);
    assert_eq!(
        code(d.store.purge(2_500, tidemark_core::limits::PRUNE_BATCH_ROWS_MAX + 1, 10_000).unwrap_err()),
        codes::LIMIT_EXCEEDED
    );
}

/// Two purges on two connections at once take different runs (SKIP LOCKED) and neither waits.
#[test]
fn purges_on_two_connections_share_the_work_without_deleting_twice() {
    let mut d = db!("wf_purge_race");
    for i in 0..40 {
        finished_at(&mut d.store, &format!("r{i:02}"), 1_000 + i);
    }
    let barrier = Arc::new(Barrier::new(2));
    let handles: Vec<_> = (0..2)
        .map(|_| {
            let mut store = d.another();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                barrier.wait();
                let mut deleted = 0;
                loop {
                    let report = store.purge(i64::MAX, 7, 10_000).unwrap();
                    deleted += report.runs_deleted;
                    if !report.more {
                        return deleted;
                    }
                }
            })
        })
        .collect();
    let deleted: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert_eq!(deleted, 40);
    assert_eq!(d.scalar("SELECT count(*) FROM {s}.runs"), 0);
    assert_eq!(d.scalar("SELECT count(*) FROM {s}.run_receipts"), 40);
}

#[test]
fn receipts_expire_after_the_receipt_window() {
    let d = db!("wf_receipts");
    assert_eq!(d.store.receipt_window_ms(), crate::RECEIPT_WINDOW_MS_DEFAULT);
    assert_eq!(code(d.another().with_receipt_window_ms(0).err().unwrap()), codes::INVALID_ARGUMENT);
    let mut store = d.another().with_receipt_window_ms(5_000).unwrap();
    finished_at(&mut store, "a", 1_000);
    finished_at(&mut store, "b", 2_000);
    assert_eq!(store.purge(10_000, 10, 3_000).unwrap().runs_deleted, 2);
    assert_eq!(d.scalar("SELECT count(*) FROM {s}.run_receipts"), 2);
    assert_eq!(
        store.start_runs(&[req("a")], 5_999).unwrap()[0],
        StartOutcome::Existing { run_id: "a".into(), status: RunStatus::Completed }
    );
    assert_eq!(store.start_runs(&[req("a")], 6_000).unwrap()[0], StartOutcome::Started { run_id: "a".into() });
    assert_eq!(d.scalar("SELECT count(*) FROM {s}.run_receipts"), 1);
    let report = store.purge(0, 10, 7_000).unwrap();
    assert_eq!((report.runs_deleted, report.more), (0, false));
    assert_eq!(d.scalar("SELECT count(*) FROM {s}.run_receipts"), 0);
    finished_at(&mut store, "c", 8_000);
    assert_eq!(store.purge(10_000, 10, 20_000).unwrap().runs_deleted, 1);
    assert_eq!(d.scalar("SELECT count(*) FROM {s}.run_receipts"), 0);
}

// ---------------------------------------------------------------------------------------------
// Listing

#[test]
fn list_runs_filters_and_pages_by_creation_time() {
    let mut d = db!("wf_list");
    for (i, id) in ["a", "b", "c", "d", "e"].iter().enumerate() {
        let workflow = if i % 2 == 0 { WF } else { "refund" };
        start(&mut d.store, &[StartRequest { workflow: workflow.into(), ..req(id) }], 1_000 + (i as i64 / 2) * 100);
    }
    let ids = |runs: Vec<tidemark_core::workflow::RunRecord>| runs.into_iter().map(|r| r.run_id).collect::<Vec<_>>();
    let all = ids(d.store.list_runs(&RunFilter::default(), 100).unwrap());
    assert_eq!(all, ["a", "b", "c", "d", "e"]);
    let mut paged = Vec::new();
    let mut filter = RunFilter::default();
    for _ in 0..10 {
        let page = d.store.list_runs(&filter, 2).unwrap();
        let Some(last) = page.last() else { break };
        filter.after = Some((last.created_at_ms, last.run_id.clone()));
        paged.extend(ids(page));
    }
    assert_eq!(paged, all);
    let by_workflow = RunFilter { workflow: Some("refund".into()), ..RunFilter::default() };
    assert_eq!(ids(d.store.list_runs(&by_workflow, 100).unwrap()), ["b", "d"]);
    let window = RunFilter { created_after_ms: Some(1_000), created_before_ms: Some(1_200), ..RunFilter::default() };
    assert_eq!(ids(d.store.list_runs(&window, 100).unwrap()), ["c", "d"]);
    let t = claim(&mut d.store, "w1", 2_000).into_iter().find(|c| c.run.run_id == "c").unwrap().lease_token;
    commit_one(&mut d.store, "c", &t, finish(FinishStatus::Failed, None, None), 2_010);
    let failed = RunFilter { status: Some(RunStatus::Failed), ..RunFilter::default() };
    assert_eq!(ids(d.store.list_runs(&failed, 100).unwrap()), ["c"]);
    let both = RunFilter { status: Some(RunStatus::Pending), workflow: Some(WF.into()), ..RunFilter::default() };
    assert_eq!(ids(d.store.list_runs(&both, 100).unwrap()), ["a", "e"]);
    assert_eq!(code(d.store.list_runs(&RunFilter::default(), 0).unwrap_err()), codes::LIMIT_EXCEEDED);
    let page_max = tidemark_core::limits::PAGE_SIZE_MAX;
    assert_eq!(code(d.store.list_runs(&RunFilter::default(), page_max + 1).unwrap_err()), codes::LIMIT_EXCEEDED);
    let bad = RunFilter { workflow: Some("bad id".into()), ..RunFilter::default() };
    assert_eq!(code(d.store.list_runs(&bad, 10).unwrap_err()), codes::INVALID_ID);
    assert!(d.store.run("nope").unwrap().is_none());
    assert_eq!(code(d.store.run("bad id").unwrap_err()), codes::INVALID_ID);
}

// ---------------------------------------------------------------------------------------------
// Opening

#[test]
fn open_never_creates_and_a_producer_schema_is_a_workflow_schema_too() {
    let d = db!("wf_open");
    let missing = d.db.schema("missing");
    assert_eq!(PgWorkflows::open(&d.db.conn, &missing).err().unwrap().code(), codes::NOT_INITIALIZED);
    assert_eq!(PgWorkflows::init(&d.db.conn, "Bad-Name").err().unwrap().code(), codes::INVALID_ARGUMENT);
    // A producer's schema holds the workflow tables (one schema, like one SQLite file).
    let shared = d.db.schema("shared");
    crate::PgProducer::init(&d.db.conn, &shared, "shop").unwrap();
    let mut store = PgWorkflows::open(&d.db.conn, &shared).unwrap();
    start(&mut store, &[req("r1")], 1_000);
    assert_eq!(store.schema(), shared);
}

/// A schema of the previous version (1: producer and consumer tables, written by the last build
/// without workflows) is migrated forward by opening it as a workflow store: its rows stay, the
/// workflow tables appear, and version 2 is recorded once.
#[test]
fn a_version_1_schema_is_migrated_to_the_workflow_tables_with_its_rows_kept() {
    let d = db!("wf_migrate");
    let old = d.db.schema("v1");
    let mut client = d.db.client();
    crate::schema::migrate_to(&mut client, &old, true, 1).unwrap();
    let s = format!("\"{old}\"");
    client
        .batch_execute(&format!(
            "INSERT INTO {s}.meta (key, value) VALUES ('producer.source', 'shop'), ('producer.generation', 'g1');
             INSERT INTO {s}.flows (flow_id, state, state_data, last_seq, updated_at_ms) VALUES ('f1', 'reserved', '{{}}', 1, 5)"
        ))
        .unwrap();
    assert!(client
        .query_one("SELECT to_regclass($1)::text", &[&format!("{old}.runs")])
        .unwrap()
        .get::<_, Option<String>>(0)
        .is_none());
    let mut store = PgWorkflows::open(&d.db.conn, &old).unwrap();
    start(&mut store, &[req("r1")], 1_000);
    let versions: Vec<i32> = client
        .query(&format!("SELECT version FROM {s}.schema_versions ORDER BY version"), &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(versions, [1, 2, 3, 4, 5]);
    assert_eq!(crate::SCHEMA_VERSION, 5);
    let flows: i64 = client.query_one(&format!("SELECT count(*) FROM {s}.flows"), &[]).unwrap().get(0);
    assert_eq!(flows, 1);
    let producer = crate::PgProducer::open(&d.db.conn, &old).unwrap();
    assert_eq!(tidemark_core::store::ProducerStore::identity(&producer).source, "shop");
}

// ---------------------------------------------------------------------------------------------
// Property: random claims, heartbeats, writes, suspends, releases and finishes by three workers,
// each with its own store (connection), against a model of who holds which run. After every
// step: a write is fenced exactly when its token is not the run's current one; per-type limits
// and per-key serialization hold; journals are contiguous; finished runs are never handed out.

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        // xorshift64*: deterministic per seed, no wall clock.
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) % n
    }
}

/// What one simulation exercised: (fenced writes, recoveries, finished runs).
fn simulate(d: &Db, seed: u64) -> (u32, u32, usize) {
    use std::collections::{BTreeMap, BTreeSet};
    let mut stores: Vec<PgWorkflows> = (0..3).map(|_| d.another()).collect();
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let keys = [Some("k1"), Some("k2"), None];
    let mut now = 1_000;
    let prefix = format!("s{seed}-");
    for i in 0..12 {
        let workflow = if i % 2 == 0 { "alpha" } else { "beta" };
        let key = keys[rng.below(3) as usize].map(|k| format!("{prefix}{k}"));
        let request = StartRequest { workflow: workflow.into(), key, ..req(&format!("{prefix}r{i:02}")) };
        start(&mut stores[0], &[request], now);
        now += 1;
    }
    let workflows = || vec![version("alpha", 1, Some(2)), version("beta", 1, None)];
    let workers = ["w0", "w1", "w2"];
    let mut current: BTreeMap<String, Option<String>> = BTreeMap::new();
    let mut held: Vec<BTreeMap<String, String>> = vec![BTreeMap::new(); 3];
    let mut finished: BTreeSet<String> = BTreeSet::new();
    let (mut fenced, mut recoveries) = (0, 0);
    for _ in 0..200 {
        now += rng.below(400) as i64;
        let w = rng.below(3) as usize;
        let worker = workers[w];
        let action = rng.below(6);
        if action == 0 || held[w].is_empty() {
            let limit = 1 + rng.below(3) as usize;
            let request = ClaimRequest { worker_id: worker.into(), workflows: workflows(), limit, lease_ms: LEASE_MS };
            for c in stores[w].claim(&request, now).unwrap() {
                assert!(!finished.contains(&c.run.run_id), "seed {seed}: a finished run was claimed");
                recoveries += u32::from(c.recovered);
                let seqs: Vec<u32> = c.journal.iter().map(|e| e.seq).collect();
                assert_eq!(seqs, (0..c.journal.len() as u32).collect::<Vec<_>>(), "seed {seed}: journal has gaps");
                current.insert(c.run.run_id.clone(), Some(c.lease_token.clone()));
                held[w].insert(c.run.run_id, c.lease_token);
            }
        } else if action == 1 {
            let leases: Vec<(String, String)> = held[w].iter().map(|(r, t)| (r.clone(), t.clone())).collect();
            let states = stores[w].heartbeat(worker, &leases, LEASE_MS, now).unwrap();
            for ((run_id, _), state) in leases.iter().zip(states) {
                if state == LeaseState::Lost {
                    held[w].remove(run_id);
                }
            }
        } else {
            let pick = rng.below(held[w].len() as u64) as usize;
            let (run_id, token) = held[w].iter().nth(pick).map(|(r, t)| (r.clone(), t.clone())).unwrap();
            let before = detail(&stores[w], &run_id);
            let next = before.journal.len() as u32;
            let op = match action {
                2 => step_ok(next, &format!("step{next}"), 1, json!(next)),
                3 => JournalOp::Suspend {
                    status: SuspendStatus::Sleeping,
                    wake_at_ms: now + rng.below(2_000) as i64,
                    waiting_for: None,
                },
                4 => JournalOp::Release,
                _ => finish(FinishStatus::Completed, Some(json!(run_id)), None),
            };
            let result = commit_one(&mut stores[w], &run_id, &token, op, now);
            let expected_fenced = current[&run_id].as_deref() != Some(token.as_str());
            assert_eq!(result == WriteResult::Fenced, expected_fenced, "seed {seed}: fencing of {run_id}");
            if expected_fenced {
                fenced += 1;
                assert_eq!(detail(&stores[w], &run_id), before, "seed {seed}: a fenced write changed {run_id}");
                held[w].remove(&run_id);
            } else if action != 2 {
                current.insert(run_id.clone(), None);
                held[w].remove(&run_id);
                if action == 5 {
                    finished.insert(run_id.clone());
                }
            }
        }
        check_claim_invariants(d, &prefix, now, seed);
    }
    (fenced, recoveries, finished.len())
}

fn check_claim_invariants(d: &Db, prefix: &str, now: i64, seed: u64) {
    let mut client = d.db.client();
    let active = "status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating')";
    let q = |sql: &str| crate::schema::sql(&d.schema, sql);
    let like = format!("{prefix}%");
    let live_alpha: i64 = client
        .query_one(
            &q(&format!(
                "SELECT count(*) FROM {{s}}.runs WHERE run_id LIKE $1 AND workflow = 'alpha' AND {active}
                   AND lease_expires_at_ms > $2"
            )),
            &[&like, &now],
        )
        .unwrap()
        .get(0);
    assert!(live_alpha <= 2, "seed {seed}: {live_alpha} live leases of alpha (limit 2)");
    let per_key = client
        .query(
            &q(&format!(
                "SELECT key, count(*) FROM {{s}}.runs WHERE key LIKE $1 AND {active} AND lease_expires_at_ms > $2
                 GROUP BY key"
            )),
            &[&like, &now],
        )
        .unwrap();
    for row in per_key {
        let (key, leased): (String, i64) = (row.get(0), row.get(1));
        assert!(leased <= 1, "seed {seed}: {leased} live leases on key {key}");
        let row = client
            .query_one(
                &q(&format!(
                    "SELECT (SELECT run_id FROM {{s}}.runs WHERE key = $1 AND {active} ORDER BY created_at_ms, run_id LIMIT 1),
                            (SELECT run_id FROM {{s}}.runs WHERE key = $1 AND {active} AND lease_expires_at_ms > $2)"
                )),
                &[&key, &now],
            )
            .unwrap();
        let (oldest, holder): (String, String) = (row.get(0), row.get(1));
        assert_eq!(holder, oldest, "seed {seed}: key {key} is held by a run that is not its oldest active one");
    }
}

#[test]
fn random_workers_on_three_connections_never_break_fencing_limits_or_key_order() {
    let d = db!("wf_simulate");
    let (mut fenced, mut recoveries, mut finished) = (0, 0, 0);
    for seed in 1..=4 {
        let (f, r, done) = simulate(&d, seed);
        (fenced, recoveries, finished) = (fenced + f, recoveries + r, finished + done);
    }
    eprintln!("simulated: {fenced} fenced writes, {recoveries} recoveries, {finished} finished runs");
    assert!(
        fenced > 0 && recoveries > 0 && finished > 0,
        "the simulation must exercise fencing, recovery and finishing"
    );
}

// ---------------------------------------------------------------------------------------------
// Query plans

/// On 60,000 runs (a third finished, a third keyed, journals, receipts and schedules) after
/// `ANALYZE`, the claim, its budget count and key check, the commit's lock, the purge and the
/// receipts' expiry each read their index, never the whole table. `--nocapture` prints the plans
/// (docs/postgres.md shows them); `TIDEMARK_EXPLAIN_RUNS=1000000` makes the tables that large,
/// and `TIDEMARK_EXPLAIN_ANALYZE=1` runs each statement (`EXPLAIN (ANALYZE, BUFFERS)`, rolled
/// back) to show what it read and how long it took.
#[test]
fn workflow_queries_use_their_indexes() {
    let d = db!("wf_explain");
    let runs: i64 = std::env::var("TIDEMARK_EXPLAIN_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(60_000);
    let analyze = std::env::var_os("TIDEMARK_EXPLAIN_ANALYZE").is_some();
    let half = runs / 2;
    let mut client = d.db.client();
    let s = format!("\"{}\"", d.schema);
    client
        .batch_execute(&format!(
            "INSERT INTO {s}.runs (run_id, workflow, version, input, input_hash, key, status, wake_at_ms,
                                   created_at_ms, updated_at_ms, finished_at_ms, parent_run_id, parent_seq)
               SELECT 'r' || g, CASE WHEN g % 4 = 0 THEN 'refund' ELSE 'order_saga' END, 1, '{{}}', 'h',
                      CASE WHEN g % 3 = 0 THEN 'k' || (g % 5000) END,
                      CASE WHEN g % 3 = 1 THEN 'completed' ELSE 'pending' END, g, g, g,
                      CASE WHEN g % 3 = 1 THEN g END,
                      CASE WHEN g % 10 = 0 THEN 'r' || (g - 1) END, CASE WHEN g % 10 = 0 THEN 0 END
               FROM generate_series(1, {runs}) g;
             INSERT INTO {s}.journal (run_id, seq, name, kind, status, attempts, updated_at_ms)
               SELECT 'r' || g, s, 'step', 'external', 'completed', 1, g
               FROM generate_series(1, {runs}) g, generate_series(0, 2) s;
             INSERT INTO {s}.run_receipts (run_id, workflow, input_hash, status, finished_at_ms, expires_at_ms)
               SELECT 'old' || g, 'order_saga', 'h', 'completed', g, g + 1000 FROM generate_series(1, {runs}) g;
             INSERT INTO {s}.schedules (schedule_id, workflow, input, interval_ms, timezone, catch_up, paused,
                                        next_tick_at_ms, created_at_ms, updated_at_ms)
               SELECT 's' || g, 'report', '{{}}', 60000, 'UTC', 'one', g % 7 = 0, g * 10, 0, 0
               FROM generate_series(1, 10000) g;
             ANALYZE {s}.runs; ANALYZE {s}.journal; ANALYZE {s}.run_receipts; ANALYZE {s}.schedules;"
        ))
        .unwrap();
    let plan = |client: &mut postgres::Client, template: &str, args: &str| -> String {
        let statement = crate::schema::sql(&d.schema, template);
        client.batch_execute("DEALLOCATE ALL").unwrap();
        client.batch_execute(&format!("PREPARE p AS {statement}")).unwrap();
        let explain = if analyze { "EXPLAIN (ANALYZE, BUFFERS)" } else { "EXPLAIN" };
        let mut tx = client.transaction().unwrap();
        let rows = tx.query(&format!("{explain} EXECUTE p({args})"), &[]).unwrap();
        tx.rollback().unwrap();
        let text = rows.iter().map(|r| r.get::<_, String>(0)).collect::<Vec<_>>().join("\n");
        println!("---- {}\n{text}", template.lines().next().unwrap_or(""));
        text
    };
    let no_seq_scan = |plan: &str, table: &str| {
        assert!(!plan.contains(&format!("Seq Scan on {table}")), "a full scan of {table}:\n{plan}");
    };
    let claim = plan(&mut client, crate::workflow::CLAIM_CANDIDATES_SQL, &format!("'order_saga', 1, {half}, 64"));
    assert!(claim.contains("runs_due"), "{claim}");
    assert!(claim.contains("runs_key"), "{claim}");
    assert!(claim.contains("LockRows"), "{claim}");
    no_seq_scan(&claim, "runs");
    let count = plan(&mut client, crate::workflow::LEASED_COUNT_SQL, &format!("'order_saga', {half}"));
    assert!(count.contains("runs_leased"), "{count}");
    no_seq_scan(&count, "runs");
    let keys = plan(&mut client, crate::workflow::KEYS_STILL_FREE_SQL, &format!("ARRAY['r3', 'r6'], {half}"));
    assert!(keys.contains("runs_pkey") && keys.contains("runs_key"), "{keys}");
    no_seq_scan(&keys, "runs");
    let lock = plan(&mut client, crate::workflow::commit::LOCK_BATCH_SQL, "ARRAY['r1', 'r2'], ARRAY['r10']");
    assert!(lock.contains("runs_pkey") && lock.contains("runs_children"), "{lock}");
    no_seq_scan(&lock, "runs");
    let purge = plan(&mut client, crate::workflow::operator::PURGE_SELECT_SQL, &format!("{half}, 1000"));
    assert!(purge.contains("runs_finished"), "{purge}");
    no_seq_scan(&purge, "runs");
    let journal = plan(&mut client, "DELETE FROM {s}.journal WHERE run_id = ANY($1)", "ARRAY['r1', 'r4']");
    assert!(journal.contains("journal_pkey"), "{journal}");
    let expire = plan(&mut client, crate::workflow::operator::RECEIPTS_EXPIRED_DELETE_SQL, "5000, 1000");
    assert!(expire.contains("run_receipts_expiry"), "{expire}");
    no_seq_scan(&expire, "run_receipts");
    let due = plan(&mut client, crate::workflow::schedules::DUE_SQL, "5000, 1000");
    assert!(due.contains("schedules_due"), "{due}");
    // A run sent 2,000 events, all but 3 consumed: a page of those no wait consumed, and a
    // suspend's check for one, read only those (`run_events_unconsumed`), not the run's 2,000.
    client
        .batch_execute(&format!(
            "INSERT INTO {s}.run_events (run_id, event_id, name, payload, received_at_ms, consumed_by_seq)
               SELECT 'r' || (g % 50 + 1), 'e' || g, 'paid', '{{}}', g, CASE WHEN g % 1000 > 2 THEN 1 END
               FROM generate_series(1, 100000) g;
             ANALYZE {s}.run_events;"
        ))
        .unwrap();
    let page = plan(&mut client, crate::workflow::rows::UNCONSUMED_PAGE_SQL, "'r7', 500, 'e500', 11");
    assert!(page.contains("run_events_unconsumed"), "{page}");
    no_seq_scan(&page, "run_events");
    let held = plan(&mut client, crate::workflow::rows::EVENTS_HELD_SQL, "'r7', 10000");
    assert!(held.contains("run_events_unconsumed"), "{held}");
    no_seq_scan(&held, "run_events");
    let suspend = plan(&mut client, crate::workflow::commit::SUSPEND_SQL, "'r7', 'waiting', 9, 'paid', 5");
    assert!(suspend.contains("run_events_unconsumed"), "{suspend}");
    no_seq_scan(&suspend, "run_events");
}

/// A claim reads the journals and unconsumed events of the runs it leased with one index probe
/// per run even where the tables grew after their statistics were taken (here: never analyzed,
/// as in a new schema's first minute under load). `journal WHERE run_id = ANY($1)` was planned
/// there as a sequential scan of the whole journal, every row compared with every run id.
#[test]
fn a_claims_reads_probe_their_indexes_on_tables_without_statistics() {
    let d = db!("wf_explain_fresh");
    let mut client = d.db.client();
    let s = format!("\"{}\"", d.schema);
    client
        .batch_execute(&format!(
            "INSERT INTO {s}.runs (run_id, workflow, version, input, input_hash, status, wake_at_ms, created_at_ms,
                                   updated_at_ms)
               SELECT 'r' || g, 'order_saga', 1, '{{}}', 'h', 'pending', g, g, g FROM generate_series(1, 20000) g;
             INSERT INTO {s}.journal (run_id, seq, name, kind, status, attempts, updated_at_ms)
               SELECT 'r' || g, s, 'step', 'external', 'completed', 1, g
               FROM generate_series(1, 20000) g, generate_series(0, 4) s;
             INSERT INTO {s}.run_events (run_id, event_id, name, payload, received_at_ms)
               SELECT 'r' || g, 'e' || s, 'n', '{{}}', g FROM generate_series(1, 20000) g, generate_series(0, 1) s;"
        ))
        .unwrap();
    // A claim's worth of run ids (the worker claims up to a quarter of its 1,000 slots at once).
    let ids = (1..=250).map(|i| format!("'r{}'", i * 37)).collect::<Vec<_>>().join(", ");
    for (template, index) in [
        (crate::workflow::rows::JOURNALS_SQL, "journal_pkey"),
        (crate::workflow::rows::UNCONSUMED_EVENTS_SQL, "run_events_unconsumed"),
    ] {
        let statement = crate::schema::sql(&d.schema, template);
        let rows =
            client.query(&format!("EXPLAIN {}", statement.replace("$1", &format!("ARRAY[{ids}]"))), &[]).unwrap();
        let plan = rows.iter().map(|r| r.get::<_, String>(0)).collect::<Vec<_>>().join("\n");
        println!("---- {}\n{plan}", template.lines().next().unwrap_or(""));
        assert!(!plan.contains("Seq Scan on journal") && !plan.contains("Seq Scan on run_events"), "{plan}");
        assert!(plan.contains(index), "{plan}");
    }
    let journals = crate::workflow::rows::journals(
        &mut client,
        &mut crate::schema::Statements::new(&d.schema),
        &["r37".to_string(), "r74".to_string(), "none".to_string()],
    )
    .unwrap();
    assert_eq!(journals.len(), 2);
    assert_eq!(journals["r74"].iter().map(|e| e.seq).collect::<Vec<_>>(), [0, 1, 2, 3, 4]);
}

/// A schema of the previous version (2: workflows without deadlines or `continued`) with a run in
/// it is migrated forward on open: the run stays as it was (no deadline), and the new status and
/// column take writes.
#[test]
fn a_version_2_schema_is_migrated_with_its_runs_kept() {
    let d = db!("wf_migrate_v2");
    let old = d.db.schema("v2");
    let mut client = d.db.client();
    crate::schema::migrate_to(&mut client, &old, true, 2).unwrap();
    let s = format!("\"{old}\"");
    client
        .batch_execute(&format!(
            "INSERT INTO {s}.runs (run_id, workflow, version, input, input_hash, status, result, wake_at_ms,
                                   created_at_ms, updated_at_ms, finished_at_ms)
             VALUES ('old-1', '{WF}', 1, '{{}}', 'h', 'completed', '1', 5, 5, 5, 5)"
        ))
        .unwrap();
    let mut store = PgWorkflows::open(&d.db.conn, &old).unwrap();
    let kept = detail(&store, "old-1").run;
    assert_eq!((kept.status, kept.result, kept.deadline_ms), (RunStatus::Completed, Some(json!(1)), None));
    start(&mut store, &[StartRequest { deadline_ms: Some(9_000), ..req("new-1") }], 1_000);
    assert_eq!(detail(&store, "new-1").run.deadline_ms, Some(9_000));
    let versions: i64 =
        client.query_one(&format!("SELECT count(*) FROM {s}.schema_versions WHERE version = 3"), &[]).unwrap().get(0);
    assert_eq!(versions, 1);
}

/// `ContinueAsNew` ends the run `continued` and starts its continuation in one transaction; the
/// continuation takes the run's parent; a taken continuation id is a permanent failure that
/// changes nothing; a `Finish` into `continued` or a continuation under another id is refused.
#[test]
fn continue_as_new_ends_the_run_and_starts_its_continuation_together() {
    let mut d = db!("wf_continue");
    let store = &mut d.store;
    let token = started_and_claimed(store, "c", 1_000);
    let next = StartRequest { deadline_ms: Some(50_000), ..req(&continuation_run_id("c")) };
    let answer = commit_one(store, "c", &token, Op::ContinueAsNew { request: Box::new(next) }, 1_100);
    assert_eq!(answer, WriteResult::TxResult(Ok(json!({"continued_as": "c.c1"}))));
    let (first, second) = (detail(store, "c").run, detail(store, "c.c1").run);
    assert_eq!(first.status, RunStatus::Continued);
    assert_eq!(first.result, Some(json!({"continued_as": "c.c1"})));
    assert_eq!((second.status, second.deadline_ms), (RunStatus::Pending, Some(50_000)));

    // The id of the next continuation is taken by another run: nothing changes.
    start(store, &[StartRequest { input: json!({"other": true}), ..req("c.c2") }], 1_200);
    let claimed = claim(store, "w", 1_300);
    let token = claimed.into_iter().find(|c| c.run.run_id == "c.c1").expect("c.c1 claimed").lease_token;
    let taken = commit_one(store, "c.c1", &token, Op::ContinueAsNew { request: Box::new(req("c.c2")) }, 1_400);
    assert!(matches!(taken, WriteResult::TxResult(Err(ref f)) if !f.retryable), "{taken:?}");
    let still = detail(store, "c.c1").run;
    assert_eq!((still.status, still.lease_owner.as_deref()), (RunStatus::Pending, Some("w")));

    let refused =
        store.commit(vec![write("c.c1", &token, finish(FinishStatus::Continued, None, None))], 1_500).unwrap_err();
    assert_eq!(code(refused), codes::INVALID_ARGUMENT);
    let elsewhere = Op::ContinueAsNew { request: Box::new(req("somewhere-else")) };
    let refused = store.commit(vec![write("c.c1", &token, elsewhere)], 1_500).unwrap_err();
    assert_eq!(code(refused), codes::INVALID_ARGUMENT);
}

#[test]
fn a_store_whose_session_the_server_ended_reconnects_and_goes_on() {
    let mut d = db!("reconnect");
    start(&mut d.store, &[req("r1")], 1_000);
    // Nothing to do while the session is alive.
    d.store.reconnect_if_closed().unwrap();
    let pid: i32 = d.store.client().query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
    d.db.client().execute("SELECT pg_terminate_backend($1)", &[&pid]).unwrap();
    // The first call after the server ended the session fails (`store_unavailable`, not a
    // panic: HTTP 503)...
    let error = d.store.run("r1").unwrap_err();
    assert_eq!(error.code(), codes::STORE_UNAVAILABLE, "{error}");
    // ...and the writer's reconnect opens a new one, with fresh statement caches.
    d.store.reconnect_if_closed().unwrap();
    let pid_after: i32 = d.store.client().query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
    assert_ne!(pid, pid_after);
    assert_eq!(d.store.run("r1").unwrap().unwrap().run.status, RunStatus::Pending);
    start(&mut d.store, &[req("r2")], 2_000);
    assert_eq!(d.store.list_runs(&RunFilter::default(), 10).unwrap().len(), 2);
}
