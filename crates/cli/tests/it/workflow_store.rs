//! The SQLite workflow store (`SqliteWorkflows`), in process on real files: every method's
//! happy path and its refusals (which change nothing), lease fencing, per-type limits, per-key
//! serialization, idempotent starts across purges, transactional steps, group commit, and real
//! crashes at the workflow crash points (a child process re-running this test binary).
//!
//! Time is always an explicit `now_ms`; nothing here reads the wall clock.

use std::path::{Path, PathBuf};
use std::process::Command;

use rusqlite::Connection;
use serde_json::{json, Value};
use tidemark_core::error::codes;
use tidemark_core::workflow::{
    child_run_id, ChildLease, ClaimRequest, ClaimedRun, DetailPage, FinishStatus, JournalOp, JournalWrite, LeaseState,
    RunDetail, RunFilter, RunStatus, StartOutcome, StartRequest, StepFailure, StepKind, StepStatus, SuspendStatus,
    WorkflowStore, WorkflowVersion, WriteResult, CLAIM_BATCH_MAX, DETAIL_ATTEMPTS_MAX, RUN_STEPS_MAX,
};
use tidemark_core::Error;
use tidemark_store_sqlite::{send_event_in, SqliteWorkflows};

use crate::support;

const WF: &str = "order_saga";
const LEASE_MS: i64 = 1_000;

struct Db {
    _dir: tempfile::TempDir,
    path: PathBuf,
    store: SqliteWorkflows,
}

fn db() -> Db {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wf.db");
    let store = SqliteWorkflows::init(&path).unwrap();
    Db { _dir: dir, path, store }
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
fn claim(store: &mut SqliteWorkflows, worker: &str, now_ms: i64) -> Vec<ClaimedRun> {
    store.claim(&claim_request(worker, vec![version(WF, 1, None)], 100), now_ms).unwrap()
}

fn claim_ids(store: &mut SqliteWorkflows, worker: &str, now_ms: i64) -> Vec<String> {
    claim(store, worker, now_ms).into_iter().map(|c| c.run.run_id).collect()
}

fn start(store: &mut SqliteWorkflows, requests: &[StartRequest], now_ms: i64) {
    for outcome in store.start_runs(requests, now_ms).unwrap() {
        assert!(matches!(outcome, StartOutcome::Started { .. }), "{outcome:?}");
    }
}

/// Start one run and claim it; returns its lease token.
fn started_and_claimed(store: &mut SqliteWorkflows, run_id: &str, now_ms: i64) -> String {
    start(store, &[req(run_id)], now_ms);
    let claimed = claim(store, "w1", now_ms);
    let claimed = claimed.into_iter().find(|c| c.run.run_id == run_id).expect("claimed");
    claimed.lease_token
}

fn write(run_id: &str, token: &str, op: JournalOp<Connection>) -> JournalWrite<Connection> {
    JournalWrite { run_id: run_id.into(), lease_token: token.into(), op }
}

fn step_ok(seq: u32, name: &str, attempt: u32, output: Value) -> JournalOp<Connection> {
    JournalOp::StepAttempt {
        seq,
        name: name.into(),
        kind: StepKind::External,
        attempt,
        result: Ok(output),
        retry_at_ms: None,
    }
}

fn step_err(
    seq: u32,
    name: &str,
    attempt: u32,
    failure: StepFailure,
    retry_at_ms: Option<i64>,
) -> JournalOp<Connection> {
    JournalOp::StepAttempt {
        seq,
        name: name.into(),
        kind: StepKind::External,
        attempt,
        result: Err(failure),
        retry_at_ms,
    }
}

fn commit_one(
    store: &mut SqliteWorkflows,
    run_id: &str,
    token: &str,
    op: JournalOp<Connection>,
    now_ms: i64,
) -> WriteResult {
    let mut results = store.commit(vec![write(run_id, token, op)], now_ms).unwrap();
    assert_eq!(results.len(), 1);
    results.remove(0)
}

fn detail(store: &SqliteWorkflows, run_id: &str) -> RunDetail {
    store.run(run_id).unwrap().unwrap_or_else(|| panic!("no run {run_id}"))
}

fn code(error: Error) -> &'static str {
    assert!(error.is_invalid_input(), "{error:?} is not invalid input");
    error.code()
}

fn orders_table(store: &mut SqliteWorkflows) {
    store.connection().execute_batch("CREATE TABLE orders (id TEXT PRIMARY KEY, total INTEGER NOT NULL)").unwrap();
}

fn orders(store: &mut SqliteWorkflows) -> i64 {
    store.connection().query_row("SELECT count(*) FROM orders", [], |r| r.get(0)).unwrap()
}

fn insert_order(id: &'static str, fail_after: bool) -> tidemark_core::workflow::TxBody<Connection> {
    Box::new(move |tx: &Connection| {
        tx.execute("INSERT INTO orders (id, total) VALUES (?1, 300)", [id])
            .map_err(|e| StepFailure::retryable(e.to_string()))?;
        if fail_after {
            return Err(StepFailure::retryable("payment service said no"));
        }
        Ok(json!({"order": id}))
    })
}

fn tx_step(
    seq: u32,
    attempt: u32,
    body: tidemark_core::workflow::TxBody<Connection>,
    retry_at_ms: Option<i64>,
) -> JournalOp<Connection> {
    JournalOp::TxStep { seq, name: "save_order".into(), kind: StepKind::Transactional, attempt, body, retry_at_ms }
}

// ---------------------------------------------------------------------------------------------
// start_runs

fn start_child(parent: &str, seq: u32, input: Value, claim: Option<ChildLease>) -> JournalOp<Connection> {
    JournalOp::StartChild {
        seq,
        name: "double".into(),
        request: Box::new(StartRequest::new(&child_run_id(parent, seq), "double", 1, input)),
        wake_at_ms: 50_000,
        claim,
    }
}

#[test]
fn a_child_leased_as_it_starts_is_claimed_by_nobody_else_and_its_end_is_taken_by_the_waiting_parent() {
    let mut d = db();
    let t = started_and_claimed(&mut d.store, "p", 1_000);
    let lease = ChildLease { worker_id: "w1".into(), lease_ms: 10_000 };
    let op = start_child("p", 0, json!({"x": 21}), Some(lease.clone()));
    let results = d.store.commit(vec![write("p", &t, op)], 1_010).unwrap();
    let WriteResult::Claimed(child) = &results[0] else { panic!("{results:?}") };
    assert_eq!((child.run.run_id.as_str(), child.run.status), ("p.0", RunStatus::Pending));
    assert_eq!((child.run.lease_owner.as_deref(), child.run.lease_expires_at_ms), (Some("w1"), Some(11_010)));
    assert_eq!((child.run.input.clone(), child.run.parent_run_id.as_deref()), (json!({"x": 21}), Some("p")));
    assert!(child.journal.is_empty() && child.events.is_empty() && !child.recovered);
    assert_eq!(child.run, detail(&d.store, "p.0").run, "the claimed child is its row as stored");
    // Leased: another worker's claim (its own connection) does not take it while the lease lasts.
    let mut other = SqliteWorkflows::open(&d.path).unwrap();
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
    let results =
        d.store.commit(vec![write("p", &t, start_child("p", 1, json!({"x": 1}), Some(lease.clone())))], 2_400);
    assert_eq!(results.unwrap(), [WriteResult::TxResult(Ok(json!(null)))]);
    assert_eq!(detail(&d.store, "p.1").run.lease_owner, None);
    // A parent that went on with an end the store does not hold (here: none yet; then another
    // one) is fenced, its lease released and its later writes of the batch fenced too: it
    // replays from the store.
    let tq = started_and_claimed(&mut d.store, "q", 3_000);
    let results = d
        .store
        .commit(vec![write("q", &tq, start_child("q", 0, json!({"x": 5}), Some(lease.clone())))], 3_005)
        .unwrap();
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
    // A lease of a bad worker id or length is refused before anything is written.
    let bad = ChildLease { worker_id: "bad id".into(), lease_ms: 10_000 };
    let error = d.store.commit(vec![write("p", &t, start_child("p", 2, json!({}), Some(bad)))], 2_500).unwrap_err();
    assert_eq!(code(error), codes::INVALID_ID);
    let bad = ChildLease { worker_id: "w1".into(), lease_ms: 1 };
    let error = d.store.commit(vec![write("p", &t, start_child("p", 2, json!({}), Some(bad)))], 2_500).unwrap_err();
    assert_eq!(code(error), codes::INVALID_ARGUMENT);
    assert!(detail(&d.store, "p").journal.len() == 2 && d.store.run("p.2").unwrap().is_none());
}

fn finish_child(status: FinishStatus, result: Option<Value>, parent_lease_token: &str) -> JournalOp<Connection> {
    JournalOp::FinishChild { status, result, error: None, parent_lease_token: parent_lease_token.into() }
}

#[test]
fn a_child_ending_for_its_parent_waiting_in_memory_settles_the_parents_entry_only_under_that_lease() {
    let mut d = db();
    let lease = ChildLease { worker_id: "w1".into(), lease_ms: 10_000 };
    let t = started_and_claimed(&mut d.store, "p", 1_000);
    let results =
        d.store.commit(vec![write("p", &t, start_child("p", 0, json!({"x": 21}), Some(lease.clone())))], 1_010);
    let WriteResult::Claimed(child) = &results.unwrap()[0] else { panic!("a leased child") };
    let c = child.lease_token.clone();
    // The child has a child of its own still running: its end cancels it as any end does.
    let results = d.store.commit(vec![write("p.0", &c, start_child("p.0", 0, json!({"x": 1}), None))], 1_020);
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
    let step = JournalOp::Finish { status: FinishStatus::Completed, result: Some(json!(42)), error: None };
    assert_eq!(commit_one(&mut d.store, "p", &t, step, 2_200), WriteResult::Done);
    // A parent whose lease is gone (here: it suspended first, in an earlier batch) is told by
    // the end event and woken, as after any finish; its entry waits for it.
    let tq = started_and_claimed(&mut d.store, "q", 3_000);
    let results =
        d.store.commit(vec![write("q", &tq, start_child("q", 0, json!({"x": 5}), Some(lease.clone())))], 3_005);
    let WriteResult::Claimed(child) = &results.unwrap()[0] else { panic!("a leased child") };
    let suspend = JournalOp::Suspend {
        status: SuspendStatus::Waiting,
        wake_at_ms: 90_000,
        waiting_for: Some(tidemark_core::workflow::child_event(0)),
    };
    assert_eq!(commit_one(&mut d.store, "q", &tq, suspend, 3_010), WriteResult::Done);
    let end = finish_child(FinishStatus::Completed, Some(json!(10)), &tq);
    assert_eq!(commit_one(&mut d.store, "q.0", &child.lease_token, end, 3_100), WriteResult::Done);
    let q = detail(&d.store, "q");
    assert_eq!((q.journal[0].status, q.run.wake_at_ms), (StepStatus::Waiting, 3_100));
    assert_eq!((q.events.len(), q.events[0].payload["result"].clone()), (1, json!(10)));
    // In one batch, the parent's suspension first and then its child's end: the same.
    let tr = started_and_claimed(&mut d.store, "r", 4_000);
    let results = d.store.commit(vec![write("r", &tr, start_child("r", 0, json!({"x": 6}), Some(lease)))], 4_005);
    let WriteResult::Claimed(child) = &results.unwrap()[0] else { panic!("a leased child") };
    let suspend = JournalOp::Suspend {
        status: SuspendStatus::Waiting,
        wake_at_ms: 90_000,
        waiting_for: Some(tidemark_core::workflow::child_event(0)),
    };
    let batch = vec![
        write("r", &tr, suspend),
        write("r.0", &child.lease_token, finish_child(FinishStatus::Completed, Some(json!(12)), &tr)),
    ];
    assert_eq!(d.store.commit(batch, 4_100).unwrap(), [WriteResult::Done, WriteResult::Done]);
    let r = detail(&d.store, "r");
    assert_eq!((r.journal[0].status, r.run.wake_at_ms, r.events.len()), (StepStatus::Waiting, 4_100, 1));
}

#[test]
fn start_is_idempotent_per_run_id_and_detects_conflicts() {
    let mut d = db();
    let out = d.store.start_runs(&[req("r1"), req("r1")], 1_000).unwrap();
    assert_eq!(
        out,
        [
            StartOutcome::Started { run_id: "r1".into() },
            StartOutcome::Existing { run_id: "r1".into(), status: RunStatus::Pending },
        ]
    );
    let before = detail(&d.store, "r1");
    assert_eq!(before.run.status, RunStatus::Pending);
    assert_eq!(before.run.wake_at_ms, 1_000);
    assert_eq!(before.run.created_at_ms, 1_000);
    assert_eq!(before.run.input, json!({"order": "r1"}));

    // Another input, or another workflow, under the same id: conflict, and nothing changes.
    let other_input = StartRequest { input: json!({"order": "other"}), ..req("r1") };
    let other_workflow = StartRequest { workflow: "refund".into(), ..req("r1") };
    let out = d.store.start_runs(&[other_input, other_workflow, req("r1")], 2_000).unwrap();
    assert!(matches!(&out[0], StartOutcome::Conflict { run_id, reason } if run_id == "r1" && reason.contains("input")));
    assert!(matches!(&out[1], StartOutcome::Conflict { reason, .. } if reason.contains("order_saga")));
    assert_eq!(out[2], StartOutcome::Existing { run_id: "r1".into(), status: RunStatus::Pending });
    assert_eq!(detail(&d.store, "r1"), before);
}

#[test]
fn start_at_delays_the_first_claim() {
    let mut d = db();
    start(&mut d.store, &[StartRequest { start_at_ms: Some(5_000), ..req("later") }], 1_000);
    assert_eq!(detail(&d.store, "later").run.wake_at_ms, 5_000);
    assert!(claim_ids(&mut d.store, "w1", 4_999).is_empty());
    assert_eq!(claim_ids(&mut d.store, "w1", 5_000), ["later"]);
}

#[test]
fn bad_start_requests_are_refused_and_write_nothing() {
    let mut d = db();
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
}

// ---------------------------------------------------------------------------------------------
// claim, heartbeat, fencing

#[test]
fn claim_leases_due_runs_with_their_journal_and_unconsumed_events() {
    let mut d = db();
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
    }
    assert_ne!(claimed[0].lease_token, claimed[1].lease_token);
    let r2 = claimed.iter().find(|c| c.run.run_id == "r2").unwrap();
    assert_eq!(r2.events.len(), 1);
    assert_eq!(r2.events[0].payload, json!({"by": "ops"}));
    // Leased: nobody else gets them until the lease expires.
    assert!(claim_ids(&mut d.store, "w2", 2_500).is_empty());
    // A journal entry shows up in the next claim.
    let token = claimed[0].lease_token.clone();
    let run_id = claimed[0].run.run_id.clone();
    assert_eq!(commit_one(&mut d.store, &run_id, &token, step_ok(0, "reserve", 1, json!(1)), 2_100), WriteResult::Done);
    assert_eq!(commit_one(&mut d.store, &run_id, &token, JournalOp::Release, 2_100), WriteResult::Done);
    let again = claim(&mut d.store, "w2", 2_200);
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].journal.len(), 1);
    assert_eq!(again[0].journal[0].output, Some(json!(1)));
    assert!(!again[0].recovered, "a released lease is not a recovery");
}

#[test]
fn claim_takes_oldest_due_first_and_respects_the_limit() {
    let mut d = db();
    start(&mut d.store, &[StartRequest { start_at_ms: Some(3_000), ..req("c") }], 1_000);
    start(&mut d.store, &[StartRequest { start_at_ms: Some(2_000), ..req("b") }], 1_000);
    start(&mut d.store, &[req("a")], 1_500);
    let got = d.store.claim(&claim_request("w1", vec![version(WF, 1, None)], 2), 5_000).unwrap();
    let ids: Vec<_> = got.iter().map(|c| c.run.run_id.as_str()).collect();
    assert_eq!(ids, ["a", "b"]);
}

#[test]
fn an_expired_lease_is_recovered_and_the_old_holder_is_fenced() {
    let mut d = db();
    let old = started_and_claimed(&mut d.store, "r1", 1_000);
    // Still leased at the last millisecond.
    assert!(claim_ids(&mut d.store, "w2", 1_000 + LEASE_MS - 1).is_empty());
    let taken = claim(&mut d.store, "w2", 1_000 + LEASE_MS);
    assert_eq!(taken.len(), 1);
    assert!(taken[0].recovered);
    assert_eq!(taken[0].run.recoveries, 1);
    assert_ne!(taken[0].lease_token, old);
    let before = detail(&d.store, "r1");
    // The first worker can neither write nor heartbeat.
    assert_eq!(commit_one(&mut d.store, "r1", &old, step_ok(0, "reserve", 1, json!(1)), 2_100), WriteResult::Fenced);
    assert_eq!(d.store.heartbeat("w1", &[("r1".into(), old.clone())], LEASE_MS, 2_100).unwrap(), [LeaseState::Lost]);
    assert_eq!(detail(&d.store, "r1"), before);
    // The new holder writes.
    let new = taken[0].lease_token.clone();
    assert_eq!(commit_one(&mut d.store, "r1", &new, step_ok(0, "reserve", 1, json!(1)), 2_100), WriteResult::Done);
}

#[test]
fn an_expired_lease_nobody_took_over_still_fences_by_token_only() {
    let mut d = db();
    let token = started_and_claimed(&mut d.store, "r1", 1_000);
    // Expired, not re-claimed: the heartbeat says lost, but the token is still the fence, so the
    // write (made by the only worker that ever ran the step) is kept.
    assert_eq!(d.store.heartbeat("w1", &[("r1".into(), token.clone())], LEASE_MS, 5_000).unwrap(), [LeaseState::Lost]);
    assert_eq!(commit_one(&mut d.store, "r1", &token, step_ok(0, "reserve", 1, json!(1)), 5_000), WriteResult::Done);
}

#[test]
fn heartbeat_extends_held_leases_and_reports_cancel_requests() {
    let mut d = db();
    start(&mut d.store, &[req("r1"), req("r2")], 1_000);
    let claimed = claim(&mut d.store, "w1", 1_000);
    let leases: Vec<(String, String)> = claimed.iter().map(|c| (c.run.run_id.clone(), c.lease_token.clone())).collect();
    d.store.cancel("r2", "customer called", 1_200).unwrap();
    let states = d.store.heartbeat("w1", &leases, 5_000, 1_500).unwrap();
    let by_run: Vec<(String, LeaseState)> = leases.iter().map(|l| l.0.clone()).zip(states).collect();
    for (run_id, state) in &by_run {
        let cancel = run_id == "r2";
        assert_eq!(*state, LeaseState::Held { cancel_requested: cancel }, "{run_id}");
        assert_eq!(detail(&d.store, run_id).run.lease_expires_at_ms, Some(6_500));
    }
    // Not claimable while the extended lease runs, although the first one would have expired.
    assert!(claim_ids(&mut d.store, "w2", 3_000).is_empty());
    // Another owner, a wrong token: lost; no leases: nothing to say.
    let (run_id, token) = leases[0].clone();
    assert_eq!(d.store.heartbeat("w2", &[(run_id.clone(), token)], 5_000, 1_600).unwrap(), [LeaseState::Lost]);
    assert_eq!(d.store.heartbeat("w1", &[(run_id, "nottoken".into())], 5_000, 1_600).unwrap(), [LeaseState::Lost]);
    assert!(d.store.heartbeat("w1", &[], 5_000, 1_600).unwrap().is_empty());
}

#[test]
fn bad_claims_and_heartbeats_are_refused() {
    let mut d = db();
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
    assert_eq!(detail(&d.store, "r1"), before);
}

#[test]
fn only_registered_versions_are_claimed_and_the_rest_is_reported() {
    let mut d = db();
    start(&mut d.store, &[req("v1-run"), StartRequest { version: 2, ..req("v2-run") }], 1_000);
    start(&mut d.store, &[StartRequest { workflow: "refund".into(), ..req("refund-run") }], 1_000);
    assert_eq!(claim_ids(&mut d.store, "w1", 2_000), ["v1-run"]);
    let known = [version(WF, 1, None)];
    let unclaimable = d.store.unclaimable(&known).unwrap();
    let summary: Vec<(String, u32, u64)> = unclaimable.into_iter().map(|u| (u.workflow, u.version, u.runs)).collect();
    assert_eq!(summary, [(WF.to_string(), 2, 1), ("refund".to_string(), 1, 1)]);
    let got = d.store.claim(&claim_request("w2", vec![version(WF, 2, None), version("refund", 1, None)], 10), 2_000);
    assert_eq!(got.unwrap().len(), 2);
    assert!(d.store.unclaimable(&known).unwrap().len() == 2, "leased runs are still active runs of unknown versions");
}

#[test]
fn the_per_type_limit_counts_live_leases_across_workers_and_versions() {
    let mut d = db();
    let runs: Vec<StartRequest> = (0..5).map(|i| req(&format!("r{i}"))).collect();
    start(&mut d.store, &runs, 1_000);
    start(&mut d.store, &[StartRequest { version: 2, ..req("v2") }], 1_000);
    let limited = || vec![version(WF, 1, Some(2)), version(WF, 2, Some(2))];
    let a = d.store.claim(&claim_request("wa", limited(), 10), 2_000).unwrap();
    assert_eq!(a.len(), 2);
    assert!(d.store.claim(&claim_request("wb", limited(), 10), 2_000).unwrap().is_empty());
    // Without the limit another worker could take the rest: the limit is what held it back.
    // One run finishes: one slot frees up.
    let done = &a[0];
    let finish = JournalOp::Finish { status: FinishStatus::Completed, result: Some(json!("ok")), error: None };
    assert_eq!(commit_one(&mut d.store, &done.run.run_id, &done.lease_token, finish, 2_100), WriteResult::Done);
    assert_eq!(d.store.claim(&claim_request("wb", limited(), 10), 2_200).unwrap().len(), 1);
    // Expired leases do not count.
    let later = d.store.claim(&claim_request("wb", limited(), 10), 2_000 + 10 * LEASE_MS).unwrap();
    assert_eq!(later.len(), 2);
    // The limit given for another workflow does not apply here.
    let unlimited = d
        .store
        .claim(&claim_request("wc", vec![version(WF, 1, None), version(WF, 2, None)], 10), 2_000 + 10 * LEASE_MS);
    assert_eq!(unlimited.unwrap().len(), 3, "5 active runs, 2 of them leased");
}

#[test]
fn a_key_runs_one_run_at_a_time_oldest_first() {
    let mut d = db();
    start(&mut d.store, &[keyed("k1-a", "cust-1")], 1_000);
    start(&mut d.store, &[keyed("k1-b", "cust-1"), keyed("k2-a", "cust-2"), req("free")], 1_100);
    assert_eq!(claim_ids(&mut d.store, "w1", 2_000), ["k1-a", "free", "k2-a"]);
    // While k1-a is active, k1-b waits, even once k1-a's lease has expired: the expired run
    // itself is what another worker takes over.
    let taken = claim(&mut d.store, "w2", 2_000 + 2 * LEASE_MS);
    let ids: Vec<&str> = taken.iter().map(|c| c.run.run_id.as_str()).collect();
    assert_eq!(ids, ["k1-a", "free", "k2-a"]);
    let k1a = taken[0].lease_token.clone();
    // Sleeping is still active: k1-b still waits.
    let sleep = JournalOp::Suspend { status: SuspendStatus::Sleeping, wake_at_ms: 60_000, waiting_for: None };
    assert_eq!(commit_one(&mut d.store, "k1-a", &k1a, sleep, 4_100), WriteResult::Done);
    assert!(claim_ids(&mut d.store, "w3", 4_200).is_empty());
    // k1-a finishes (claimed again when its timer fires): k1-b's turn.
    let again = claim(&mut d.store, "w3", 60_000);
    let ids: Vec<&str> = again.iter().map(|c| c.run.run_id.as_str()).collect();
    assert_eq!(ids, ["free", "k2-a", "k1-a"], "oldest due first: the two expired leases, then the timer");
    let finish = JournalOp::Finish { status: FinishStatus::Completed, result: None, error: None };
    assert_eq!(commit_one(&mut d.store, "k1-a", &again[2].lease_token, finish, 60_001), WriteResult::Done);
    assert_eq!(claim_ids(&mut d.store, "w3", 60_002), ["k1-b"]);
}

#[test]
fn a_retried_older_run_of_a_key_waits_for_the_newer_ones_lease() {
    let mut d = db();
    start(&mut d.store, &[keyed("k-old", "k")], 1_000);
    let old = claim(&mut d.store, "w1", 1_000).remove(0).lease_token;
    let fail = JournalOp::Finish { status: FinishStatus::Failed, result: None, error: Some("boom".into()) };
    assert_eq!(commit_one(&mut d.store, "k-old", &old, fail, 1_050), WriteResult::Done);
    start(&mut d.store, &[keyed("k-new", "k")], 1_100);
    assert_eq!(claim_ids(&mut d.store, "w1", 2_000), ["k-new"]);
    let new = detail(&d.store, "k-new");
    d.store.retry("k-old", "fixed the card", 2_100).unwrap();
    // k-old is the oldest active run again, but k-new holds a live lease.
    assert!(claim_ids(&mut d.store, "w2", 2_200).is_empty());
    // k-new suspends (no lease): the older one goes first, and k-new waits for it.
    let token = claim_token_of(&d, "k-new");
    let sleep = JournalOp::Suspend { status: SuspendStatus::Sleeping, wake_at_ms: 2_300, waiting_for: None };
    assert_eq!(commit_one(&mut d.store, "k-new", &token, sleep, 2_250), WriteResult::Done);
    assert_eq!(claim_ids(&mut d.store, "w2", 2_400), ["k-old"]);
    assert!(claim_ids(&mut d.store, "w3", 2_500).is_empty());
    assert_eq!(new.run.key.as_deref(), Some("k"));
}

/// The current lease token of a run (read from the file: tokens are not part of `RunRecord`).
fn claim_token_of(d: &Db, run_id: &str) -> String {
    let conn = tidemark_store_sqlite::open_existing(&d.path).unwrap();
    conn.query_row("SELECT lease_token FROM runs WHERE run_id = ?1", [run_id], |r| r.get(0)).unwrap()
}

// ---------------------------------------------------------------------------------------------
// commit: journal writes

#[test]
fn step_attempts_retry_then_complete_with_every_attempt_recorded() {
    let mut d = db();
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    let running = JournalOp::SetStatus { status: RunStatus::Running };
    assert_eq!(commit_one(&mut d.store, "r1", &t, running, 1_001), WriteResult::Done);
    assert_eq!(detail(&d.store, "r1").run.status, RunStatus::Running);
    let fail = step_err(0, "charge", 1, StepFailure::retryable("timeout"), Some(2_000));
    assert_eq!(commit_one(&mut d.store, "r1", &t, fail, 1_010), WriteResult::Done);
    let entry = &detail(&d.store, "r1").journal[0];
    assert_eq!((entry.status, entry.attempts, entry.next_attempt_at_ms), (StepStatus::Retrying, 1, Some(2_000)));
    assert_eq!(entry.error.as_deref(), Some("timeout"));
    // The runtime suspends for the backoff, and the lease goes.
    let suspend = JournalOp::Suspend { status: SuspendStatus::Pending, wake_at_ms: 2_000, waiting_for: None };
    assert_eq!(commit_one(&mut d.store, "r1", &t, suspend, 1_011), WriteResult::Done);
    let run = detail(&d.store, "r1").run;
    assert_eq!((run.status, run.wake_at_ms, run.lease_owner), (RunStatus::Pending, 2_000, None));
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
    let attempts: Vec<(u32, bool, Option<&str>)> =
        detail.attempts.iter().map(|a| (a.attempt, a.ok, a.error.as_deref())).collect();
    assert_eq!(attempts, [(1, false, Some("timeout")), (2, true, None)]);
}

/// A detail shows the last `DETAIL_ATTEMPTS_MAX` attempts of a position; the events no wait
/// consumed come a page of `limit` at a time after the journal's last page.
#[test]
fn a_detail_page_holds_a_positions_last_attempts_and_unconsumed_events_a_page_at_a_time() {
    let mut d = db();
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
    let mut d = db();
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    let declined = step_err(0, "charge", 1, StepFailure::permanent("card declined"), Some(9_000));
    assert_eq!(commit_one(&mut d.store, "r1", &t, declined, 1_010), WriteResult::Done);
    let out_of_attempts = step_err(1, "notify", 1, StepFailure::retryable("smtp down"), None);
    assert_eq!(commit_one(&mut d.store, "r1", &t, out_of_attempts, 1_020), WriteResult::Done);
    let journal = detail(&d.store, "r1").journal;
    assert_eq!(journal[0].status, StepStatus::Failed);
    assert_eq!(journal[0].next_attempt_at_ms, None);
    assert_eq!(journal[1].status, StepStatus::Failed);
}

#[test]
fn group_commit_applies_many_runs_writes_in_one_call_and_fences_each_alone() {
    let mut d = db();
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
    // A stale token in the middle is fenced; the writes around it go on.
    writes.insert(150, write("r150", "staletoken", step_ok(0, "reserve", 1, json!("stale"))));
    let results = d.store.commit(writes, 1_100).unwrap();
    assert_eq!(results.len(), 301);
    assert_eq!(results[150], WriteResult::Fenced);
    assert_eq!(results.iter().filter(|r| **r == WriteResult::Done).count(), 300);
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
    let mut d = db();
    start(&mut d.store, &[req("r1"), req("r2")], 1_000);
    let claimed = claim(&mut d.store, "w1", 1_000);
    let (t1, t2) = (claimed[0].lease_token.clone(), claimed[1].lease_token.clone());
    assert_eq!(commit_one(&mut d.store, "r1", &t1, step_ok(0, "reserve", 1, json!(1)), 1_010), WriteResult::Done);
    let before = (detail(&d.store, "r1"), detail(&d.store, "r2"));
    let broken: Vec<JournalOp<Connection>> = vec![
        step_ok(0, "reserve", 2, json!("again")),        // a settled entry is rewritten
        step_ok(2, "ship", 1, json!(1)),                 // a gap: the next position is 1
        step_ok(1, "charge", 2, json!(1)),               // a first attempt numbered 2
        tx_step(0, 1, Box::new(|_| Ok(json!(1))), None), // another step at a settled position
        JournalOp::TimerFinished { seq: 1, event_id: None, output: json!(null) }, // no timer there
    ];
    for op in broken {
        // A good write of another run in the same batch is rolled back with it.
        let batch = vec![write("r2", &t2, step_ok(0, "reserve", 1, json!(2))), write("r1", &t1, op)];
        let err = d.store.commit(batch, 1_020).unwrap_err();
        assert!(matches!(err, Error::Invariant(_)), "{err:?}");
        assert_eq!((detail(&d.store, "r1"), detail(&d.store, "r2")), before);
    }
    // A step with a different name at an unsettled position is caught too.
    let retry = step_err(1, "charge", 1, StepFailure::retryable("x"), Some(2_000));
    assert_eq!(commit_one(&mut d.store, "r1", &t1, retry, 1_030), WriteResult::Done);
    let err = d.store.commit(vec![write("r1", &t1, step_ok(1, "refund", 2, json!(1)))], 1_040).unwrap_err();
    assert!(matches!(err, Error::Invariant(ref m) if m.contains("refund")), "{err:?}");
}

#[test]
fn bad_journal_writes_are_refused_before_anything_runs() {
    let mut d = db();
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    let before = detail(&d.store, "r1");
    let ran = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = ran.clone();
    let body: tidemark_core::workflow::TxBody<Connection> = Box::new(move |_| {
        flag.store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(json!(1))
    });
    let big = json!("x".repeat(300 * 1024));
    let cases: Vec<(JournalOp<Connection>, &str)> = vec![
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
        (
            JournalOp::Finish { status: FinishStatus::Completed, result: Some(big), error: None },
            codes::PAYLOAD_TOO_LARGE,
        ),
    ];
    for (op, expected) in cases {
        // The valid transactional step first in the batch must not even run.
        let batch = vec![write("r1", &t, tx_step(0, 1, body_clone(&ran), None)), write("r1", &t, op)];
        assert_eq!(code(d.store.commit(batch, 1_010).unwrap_err()), expected);
    }
    let batch = vec![write("r1", &t, tx_step(0, 1, body, None)), write("bad id", &t, JournalOp::Release)];
    assert_eq!(code(d.store.commit(batch, 1_010).unwrap_err()), codes::INVALID_ID);
    assert!(!ran.load(std::sync::atomic::Ordering::SeqCst));
    assert_eq!(detail(&d.store, "r1"), before);
    assert!(d.store.commit(Vec::new(), 1_010).unwrap().is_empty());
}

/// A body that only records that it ran.
fn body_clone(ran: &std::sync::Arc<std::sync::atomic::AtomicBool>) -> tidemark_core::workflow::TxBody<Connection> {
    let flag = ran.clone();
    Box::new(move |_| {
        flag.store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(json!(1))
    })
}

#[test]
fn a_transactional_step_commits_its_rows_with_its_journal_entry_or_neither() {
    let mut d = db();
    orders_table(&mut d.store);
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    // The body writes a row, then fails: the row is rolled back, the attempt is recorded.
    let result = commit_one(&mut d.store, "r1", &t, tx_step(0, 1, insert_order("o-1", true), Some(2_000)), 1_010);
    assert_eq!(result, WriteResult::TxResult(Err(StepFailure::retryable("payment service said no"))));
    assert_eq!(orders(&mut d.store), 0);
    let detail1 = detail(&d.store, "r1");
    assert_eq!((detail1.journal[0].status, detail1.journal[0].attempts), (StepStatus::Retrying, 1));
    assert_eq!(detail1.attempts.len(), 1);
    // The next attempt succeeds: the row and the journal entry are there together.
    let result = commit_one(&mut d.store, "r1", &t, tx_step(0, 2, insert_order("o-1", false), None), 2_010);
    assert_eq!(result, WriteResult::TxResult(Ok(json!({"order": "o-1"}))));
    assert_eq!(orders(&mut d.store), 1);
    let entry = &detail(&d.store, "r1").journal[0];
    assert_eq!((entry.status, entry.kind, entry.attempts), (StepStatus::Completed, StepKind::Transactional, 2));
    assert_eq!(entry.output, Some(json!({"order": "o-1"})));
    // A fenced transactional step does not run its body at all.
    let result = commit_one(&mut d.store, "r1", "stale", tx_step(1, 1, insert_order("o-2", false), None), 2_020);
    assert_eq!(result, WriteResult::Fenced);
    assert_eq!(orders(&mut d.store), 1);
}

#[test]
fn a_transactional_body_whose_output_is_too_large_fails_for_good_and_writes_nothing() {
    let mut d = db();
    orders_table(&mut d.store);
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    let body: tidemark_core::workflow::TxBody<Connection> = Box::new(|tx| {
        tx.execute("INSERT INTO orders (id, total) VALUES ('o-big', 1)", []).unwrap();
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
    let mut d = db();
    orders_table(&mut d.store);
    start(&mut d.store, &[req("r1"), req("r2")], 1_000);
    let claimed = claim(&mut d.store, "w1", 1_000);
    let before = (detail(&d.store, "r1"), detail(&d.store, "r2"));
    let (t1, t2) = (claimed[0].lease_token.clone(), claimed[1].lease_token.clone());
    let panicking: tidemark_core::workflow::TxBody<Connection> = Box::new(|tx| {
        tx.execute("INSERT INTO orders (id, total) VALUES ('o-p', 1)", []).unwrap();
        panic!("the body blew up mid-transaction");
    });
    let batch = vec![
        write("r1", &t1, tx_step(0, 1, insert_order("o-1", false), None)),
        write("r2", &t2, tx_step(0, 1, panicking, None)),
    ];
    let store = &mut d.store;
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || store.commit(batch, 1_010)));
    assert!(outcome.is_err());
    // Nothing of the batch survived, and the store still works.
    assert_eq!(orders(&mut d.store), 0);
    assert_eq!((detail(&d.store, "r1"), detail(&d.store, "r2")), before);
    let result = commit_one(&mut d.store, "r1", &t1, tx_step(0, 1, insert_order("o-1", false), None), 1_020);
    assert!(matches!(result, WriteResult::TxResult(Ok(_))));
    assert_eq!(orders(&mut d.store), 1);
}

#[test]
fn a_sleep_is_a_durable_timer() {
    let mut d = db();
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
    // A reopened store (a restart) still has it; nothing is due before the timer.
    drop(d.store);
    d.store = SqliteWorkflows::init(&d.path).unwrap();
    assert!(claim_ids(&mut d.store, "w2", 8_999).is_empty());
    let c = claim(&mut d.store, "w2", 9_000);
    assert_eq!(c[0].journal[0].status, StepStatus::Waiting);
    let fired = JournalOp::TimerFinished { seq: 0, event_id: None, output: json!(null) };
    assert_eq!(commit_one(&mut d.store, "r1", &c[0].lease_token, fired, 9_001), WriteResult::Done);
    assert_eq!(detail(&d.store, "r1").journal[0].status, StepStatus::Completed);
}

fn wait_for_approval(d: &mut Db, token: &str, now_ms: i64) {
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
    let results = d.store.commit(vec![write("r1", token, timer), write("r1", token, suspend)], now_ms).unwrap();
    assert_eq!(results, [WriteResult::Done, WriteResult::Done]);
}

#[test]
fn an_event_wakes_a_waiting_run_and_is_consumed_once() {
    let mut d = db();
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    wait_for_approval(&mut d, &t, 1_010);
    let run = detail(&d.store, "r1").run;
    assert_eq!(
        (run.status, run.wake_at_ms, run.waiting_for.as_deref()),
        (RunStatus::Waiting, 100_000, Some("approved"))
    );
    // Another event name does not wake it.
    assert!(d.store.send_event("r1", "ev-0", "other", &json!(0), 2_000).unwrap());
    assert_eq!(detail(&d.store, "r1").run.wake_at_ms, 100_000);
    assert!(d.store.send_event("r1", "ev-1", "approved", &json!({"by": "ann"}), 3_000).unwrap());
    assert_eq!(detail(&d.store, "r1").run.wake_at_ms, 3_000);
    // Sending it again is a no-op; the same id with other content is refused.
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
    // Consuming it twice is a bug.
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
    let mut d = db();
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    // The run is running (not yet waiting) when the event arrives.
    assert!(d.store.send_event("r1", "ev-1", "approved", &json!(true), 1_005).unwrap());
    wait_for_approval(&mut d, &t, 1_010);
    let run = detail(&d.store, "r1").run;
    assert_eq!((run.status, run.wake_at_ms), (RunStatus::Waiting, 1_010), "due at once, not at the deadline");
    assert_eq!(claim(&mut d.store, "w1", 1_020)[0].events.len(), 1);
}

#[test]
fn a_wait_times_out_at_its_deadline() {
    let mut d = db();
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    wait_for_approval(&mut d, &t, 1_010);
    assert!(claim_ids(&mut d.store, "w1", 99_999).is_empty());
    let c = claim(&mut d.store, "w1", 100_000);
    let timeout = JournalOp::TimerFinished { seq: 0, event_id: None, output: json!({"timed_out": true}) };
    assert_eq!(commit_one(&mut d.store, "r1", &c[0].lease_token, timeout, 100_001), WriteResult::Done);
    assert_eq!(detail(&d.store, "r1").journal[0].status, StepStatus::Completed);
}

#[test]
fn send_event_refuses_unknown_finished_runs_and_bad_input() {
    let mut d = db();
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    assert_eq!(code(d.store.send_event("nope", "e", "n", &json!(1), 1_000).unwrap_err()), codes::NOT_FOUND);
    assert_eq!(code(d.store.send_event("r1", "bad id", "n", &json!(1), 1_000).unwrap_err()), codes::INVALID_ID);
    assert_eq!(code(d.store.send_event("r1", "e", "", &json!(1), 1_000).unwrap_err()), codes::INVALID_ID);
    let big = json!("x".repeat(300 * 1024));
    assert_eq!(code(d.store.send_event("r1", "e", "n", &big, 1_000).unwrap_err()), codes::PAYLOAD_TOO_LARGE);
    let finish = JournalOp::Finish { status: FinishStatus::Completed, result: Some(json!("ok")), error: None };
    assert_eq!(commit_one(&mut d.store, "r1", &t, finish, 1_010), WriteResult::Done);
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
    let mut d = db();
    started_and_claimed(&mut d.store, "r1", 1_000);
    // All but one of the bound, written straight (a send each would be a commit each).
    d.store
        .connection()
        .execute(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
             INSERT INTO run_events (run_id, event_id, name, payload, received_at_ms)
             SELECT 'r1', 'e' || i, 'paid', '{}', 1000 + i FROM n",
            [RUN_EVENTS_HELD_MAX as i64 - 1],
        )
        .unwrap();
    assert!(d.store.send_event("r1", "last", "paid", &json!(1), 20_000).unwrap());
    let refused = d.store.send_event("r1", "over", "paid", &json!(1), 20_001).unwrap_err();
    assert_eq!(code(refused), codes::RUN_EVENTS_FULL);
    assert!(!d.store.send_event("r1", "last", "paid", &json!(1), 20_002).unwrap(), "held already: a no-op");
    let held = |d: &mut Db| -> i64 {
        d.store.connection().query_row("SELECT count(*) FROM run_events WHERE run_id = 'r1'", [], |r| r.get(0)).unwrap()
    };
    assert_eq!(held(&mut d), RUN_EVENTS_HELD_MAX as i64);
    // Another run's `ctx.send` to it: retryable, and nothing journaled (the sender waits and
    // sends again).
    let sender = started_and_claimed(&mut d.store, "r2", 20_000);
    let send = || JournalOp::Send { seq: 0, to: "r1".into(), topic: "paid".into(), payload: json!(2) };
    let answer = commit_one(&mut d.store, "r2", &sender, send(), 20_004);
    assert!(matches!(&answer, WriteResult::TxResult(Err(f)) if f.retryable && f.message.contains("r1")), "{answer:?}");
    assert!(detail(&d.store, "r2").journal.is_empty());
    assert_eq!(held(&mut d), RUN_EVENTS_HELD_MAX as i64);
    d.store.connection().execute("UPDATE run_events SET consumed_by_seq = 0 WHERE event_id = 'e1'", []).unwrap();
    assert!(d.store.send_event("r1", "over", "paid", &json!(1), 20_003).unwrap());
    assert_eq!(held(&mut d), RUN_EVENTS_HELD_MAX as i64 + 1);
    d.store.connection().execute("UPDATE run_events SET consumed_by_seq = 0 WHERE event_id = 'e2'", []).unwrap();
    let answer = commit_one(&mut d.store, "r2", &sender, send(), 20_005);
    assert!(matches!(answer, WriteResult::TxResult(Ok(_))), "{answer:?}");
    assert_eq!(detail(&d.store, "r2").journal.len(), 1);
}

#[test]
fn an_inbox_handler_can_send_an_event_inside_its_own_transaction() {
    let mut d = db();
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    wait_for_approval(&mut d, &t, 1_010);
    let conn = d.store.connection();
    assert_eq!(
        code(send_event_in(conn, "r1", "ev-1", "approved", &json!(1), 2_000).unwrap_err()),
        codes::INVALID_ARGUMENT
    );
    let tx = conn.transaction().unwrap();
    assert!(send_event_in(&tx, "r1", "ev-1", "approved", &json!(1), 2_000).unwrap());
    drop(tx); // rolled back with the handler's transaction
    assert!(detail(&d.store, "r1").events.is_empty());
    let tx = d.store.connection().transaction().unwrap();
    assert!(send_event_in(&tx, "r1", "ev-1", "approved", &json!(1), 2_000).unwrap());
    tx.commit().unwrap();
    assert_eq!(detail(&d.store, "r1").run.wake_at_ms, 2_000);
}

#[test]
fn finish_ends_the_run_releases_the_lease_and_fences_later_writes() {
    let mut d = db();
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    let finish = JournalOp::Finish { status: FinishStatus::Failed, result: None, error: Some("e".repeat(10_000)) };
    assert_eq!(commit_one(&mut d.store, "r1", &t, finish, 1_010), WriteResult::Done);
    let run = detail(&d.store, "r1").run;
    assert_eq!((run.status, run.lease_owner, run.lease_expires_at_ms), (RunStatus::Failed, None, None));
    assert_eq!(run.error.unwrap().len(), tidemark_core::workflow::ERROR_BYTES_MAX);
    assert_eq!(commit_one(&mut d.store, "r1", &t, JournalOp::Release, 1_020), WriteResult::Fenced);
    assert!(claim_ids(&mut d.store, "w1", 1_000_000).is_empty());
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
        write(
            "r1",
            &t,
            JournalOp::Finish { status: FinishStatus::Failed, result: None, error: Some("declined".into()) },
        ),
    ];
    assert!(d.store.commit(writes, 1_050).unwrap().iter().all(|r| *r == WriteResult::Done));
    t
}

#[test]
fn cancel_is_a_request_that_makes_the_run_due_and_keeps_the_lease() {
    let mut d = db();
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
    // The holder of a leased run keeps it and may go on writing (it compensates, then finishes).
    let run = d.store.cancel("held", "customer called", 1_600).unwrap();
    assert_eq!(run.lease_owner.as_deref(), Some("w1"));
    let suspend = JournalOp::Suspend { status: SuspendStatus::Pending, wake_at_ms: 90_000, waiting_for: None };
    assert_eq!(commit_one(&mut d.store, "held", &token("held"), suspend, 1_610), WriteResult::Done);
    assert_eq!(detail(&d.store, "held").run.wake_at_ms, 1_610, "a cancel request keeps a suspended run due");
}

#[test]
fn cancel_refuses_finished_unknown_runs_and_bad_reasons() {
    let mut d = db();
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
    let mut d = db();
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
    // Attempt 1 of the new budget is the position's third attempt in the history.
    let c = claim(&mut d.store, "w1", 2_000);
    let t = c[0].lease_token.clone();
    assert_eq!(commit_one(&mut d.store, "r1", &t, step_ok(1, "charge", 1, json!("paid")), 2_010), WriteResult::Done);
    let detail2 = detail(&d.store, "r1");
    assert_eq!((detail2.journal[1].status, detail2.journal[1].attempts), (StepStatus::Completed, 1));
    let history: Vec<(u32, u32, bool)> = detail2.attempts.iter().map(|a| (a.seq, a.attempt, a.ok)).collect();
    assert_eq!(history, [(0, 1, true), (1, 1, false), (1, 2, false), (1, 3, true)]);
    // Only failed or parked runs can be retried.
    let before = detail(&d.store, "r1");
    assert_eq!(code(d.store.retry("r1", "again", 2_020).unwrap_err()), codes::INVALID_STATE_CHANGE);
    let finish = JournalOp::Finish { status: FinishStatus::Completed, result: Some(json!(1)), error: None };
    assert_eq!(commit_one(&mut d.store, "r1", &t, finish, 2_030), WriteResult::Done);
    let completed = detail(&d.store, "r1");
    assert_eq!(code(d.store.retry("r1", "again", 2_040).unwrap_err()), codes::INVALID_STATE_CHANGE);
    assert_eq!(detail(&d.store, "r1"), completed);
    assert_ne!(before, completed);
    assert_eq!(code(d.store.retry("nope", "x", 2_040).unwrap_err()), codes::NOT_FOUND);
}

#[test]
fn retrying_a_parked_saga_reopens_the_compensation_that_gave_up() {
    let mut d = db();
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
        write("r1", &t, JournalOp::Finish { status: FinishStatus::Parked, result: None, error: Some("stuck".into()) }),
    ];
    assert!(d.store.commit(writes, 1_010).unwrap().iter().all(|r| *r == WriteResult::Done));
    d.store.retry("r1", "inventory is back", 2_000).unwrap();
    let statuses: Vec<StepStatus> = detail(&d.store, "r1").journal.iter().map(|e| e.status).collect();
    assert_eq!(statuses, [StepStatus::Completed, StepStatus::Failed, StepStatus::Retrying]);
}

#[test]
fn fork_starts_a_new_run_reusing_the_journal_before_a_step() {
    let mut d = db();
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    wait_for_approval(&mut d, &t, 1_010);
    d.store.send_event("r1", "ev-1", "approved", &json!(true), 1_020).unwrap();
    d.store.send_event("r1", "ev-2", "other", &json!(2), 1_020).unwrap();
    let t = claim(&mut d.store, "w1", 1_030).remove(0).lease_token;
    let writes = vec![
        write("r1", &t, JournalOp::TimerFinished { seq: 0, event_id: Some("ev-1".into()), output: json!(true) }),
        write("r1", &t, step_ok(1, "reserve", 1, json!("reserved"))),
        write("r1", &t, step_err(2, "charge", 1, StepFailure::permanent("declined"), None)),
        write(
            "r1",
            &t,
            JournalOp::Finish { status: FinishStatus::Failed, result: None, error: Some("declined".into()) },
        ),
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
    // From the journal's end: a full copy. Beyond it, an existing id, an unknown source: refused.
    assert_eq!(d.store.fork("r1", 3, "r1-fork-all", 5_000).unwrap().status, RunStatus::Pending);
    assert_eq!(detail(&d.store, "r1-fork-all").journal.len(), 3);
    assert_eq!(code(d.store.fork("r1", 4, "r1-fork-2", 5_000).unwrap_err()), codes::INVALID_SEQ);
    assert_eq!(code(d.store.fork("r1", 0, "r1-fork", 5_000).unwrap_err()), codes::ALREADY_EXISTS);
    assert_eq!(code(d.store.fork("r1", 0, "r1", 5_000).unwrap_err()), codes::ALREADY_EXISTS);
    assert_eq!(code(d.store.fork("nope", 0, "x", 5_000).unwrap_err()), codes::NOT_FOUND);
    assert_eq!(code(d.store.fork("r1", 0, "bad id", 5_000).unwrap_err()), codes::INVALID_ID);
    assert!(d.store.run("r1-fork-2").unwrap().is_none());
}

#[test]
fn skip_step_settles_a_stuck_step_with_the_operators_output_and_fences_the_holder() {
    let mut d = db();
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
    // A settled step, a missing one, a finished run: refused, nothing changes.
    let before = detail(&d.store, "r1");
    assert_eq!(code(d.store.skip_step("r1", 0, &json!(1), "x", 2_020).unwrap_err()), codes::INVALID_STATE_CHANGE);
    assert_eq!(code(d.store.skip_step("r1", 1, &json!(1), "x", 2_020).unwrap_err()), codes::INVALID_STATE_CHANGE);
    assert_eq!(code(d.store.skip_step("r1", 7, &json!(1), "x", 2_020).unwrap_err()), codes::NOT_FOUND);
    assert_eq!(code(d.store.skip_step("r1", 0, &json!(1), "", 2_020).unwrap_err()), codes::INVALID_ARGUMENT);
    let big = json!("x".repeat(300 * 1024));
    assert_eq!(code(d.store.skip_step("r1", 0, &big, "x", 2_020).unwrap_err()), codes::PAYLOAD_TOO_LARGE);
    assert_eq!(detail(&d.store, "r1"), before);
}

#[test]
fn skip_step_resumes_a_failed_run_and_a_compensating_saga_goes_on_compensating() {
    let mut d = db();
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
    let mut d = db();
    let t = started_and_claimed(&mut d.store, "r1", 1_000);
    let run = d.store.abandon("r1", "duplicate order", 2_000).unwrap();
    assert_eq!((run.status, run.lease_owner.as_deref()), (RunStatus::Cancelled, None));
    assert_eq!(run.error.as_deref(), Some("abandoned: duplicate order"));
    assert_eq!(commit_one(&mut d.store, "r1", &t, JournalOp::Release, 2_010), WriteResult::Fenced);
    let before = detail(&d.store, "r1");
    assert_eq!(code(d.store.abandon("r1", "again", 2_020).unwrap_err()), codes::INVALID_STATE_CHANGE);
    assert_eq!(detail(&d.store, "r1"), before);
    // A parked run (dead letter) can be given up on.
    let t = started_and_claimed(&mut d.store, "r2", 3_000);
    let park =
        JournalOp::Finish { status: FinishStatus::Parked, result: None, error: Some("non-deterministic".into()) };
    commit_one(&mut d.store, "r2", &t, park, 3_010);
    assert_eq!(d.store.abandon("r2", "obsolete", 3_020).unwrap().status, RunStatus::Cancelled);
    assert_eq!(code(d.store.abandon("nope", "x", 3_020).unwrap_err()), codes::NOT_FOUND);
}

// ---------------------------------------------------------------------------------------------
// Purge and receipts

fn finished_at(d: &mut Db, run_id: &str, now_ms: i64) {
    start(&mut d.store, &[req(run_id)], now_ms);
    let c = claim(&mut d.store, "w1", now_ms);
    let c = c.iter().find(|c| c.run.run_id == run_id).unwrap();
    let writes = vec![
        write(run_id, &c.lease_token, step_ok(0, "reserve", 1, json!(1))),
        write(
            run_id,
            &c.lease_token,
            JournalOp::Finish { status: FinishStatus::Completed, result: Some(json!(1)), error: None },
        ),
    ];
    d.store.commit(writes, now_ms).unwrap();
}

#[test]
fn purge_deletes_finished_runs_in_bounded_batches_and_keeps_receipts() {
    let mut d = db();
    finished_at(&mut d, "a", 1_000);
    finished_at(&mut d, "b", 2_000);
    finished_at(&mut d, "c", 3_000);
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
    // A late duplicate start is still recognised; another input under the id is a conflict.
    let out = d.store.start_runs(&[req("a"), StartRequest { input: json!(2), ..req("b") }], 20_000).unwrap();
    assert_eq!(out[0], StartOutcome::Existing { run_id: "a".into(), status: RunStatus::Completed });
    assert!(matches!(out[1], StartOutcome::Conflict { .. }));
    assert!(d.store.run("a").unwrap().is_none());
    assert_eq!(code(d.store.fork("c", 0, "a", 20_000).unwrap_err()), codes::ALREADY_EXISTS);
    assert_eq!(code(d.store.purge(2_500, 0, 10_000).unwrap_err()), codes::LIMIT_EXCEEDED);
}

#[test]
fn receipts_expire_after_the_receipt_window() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wf.db");
    let store = SqliteWorkflows::init(&path).unwrap();
    assert_eq!(store.receipt_window_ms(), tidemark_store_sqlite::RECEIPT_WINDOW_MS_DEFAULT);
    assert_eq!(
        code(SqliteWorkflows::init(&path).unwrap().with_receipt_window_ms(0).err().unwrap()),
        codes::INVALID_ARGUMENT
    );
    let mut d = Db { _dir: dir, path: path.clone(), store: store.with_receipt_window_ms(5_000).unwrap() };
    finished_at(&mut d, "a", 1_000);
    finished_at(&mut d, "b", 2_000);
    // Purged at 3_000: receipts until 6_000 and 7_000.
    assert_eq!(d.store.purge(10_000, 10, 3_000).unwrap().runs_deleted, 2);
    let receipts = |d: &mut Db| -> i64 {
        d.store.connection().query_row("SELECT count(*) FROM run_receipts", [], |r| r.get(0)).unwrap()
    };
    assert_eq!(receipts(&mut d), 2);
    assert_eq!(
        d.store.start_runs(&[req("a")], 5_999).unwrap()[0],
        StartOutcome::Existing { run_id: "a".into(), status: RunStatus::Completed }
    );
    // Expired (even before a purge deleted it): the id starts a new run.
    assert_eq!(d.store.start_runs(&[req("a")], 6_000).unwrap()[0], StartOutcome::Started { run_id: "a".into() });
    assert_eq!(receipts(&mut d), 1);
    // A purge deletes expired receipts in the same bounded way.
    let report = d.store.purge(0, 10, 7_000).unwrap();
    assert_eq!((report.runs_deleted, report.more), (0, false));
    assert_eq!(receipts(&mut d), 0);
    // A run purged after its window has passed leaves no receipt at all.
    finished_at(&mut d, "c", 8_000);
    assert_eq!(d.store.purge(10_000, 10, 20_000).unwrap().runs_deleted, 1);
    assert_eq!(receipts(&mut d), 0);
}

// ---------------------------------------------------------------------------------------------
// Listing

#[test]
fn list_runs_filters_and_pages_by_creation_time() {
    let mut d = db();
    for (i, id) in ["a", "b", "c", "d", "e"].iter().enumerate() {
        let workflow = if i % 2 == 0 { WF } else { "refund" };
        start(&mut d.store, &[StartRequest { workflow: workflow.into(), ..req(id) }], 1_000 + (i as i64 / 2) * 100);
    }
    let ids = |runs: Vec<tidemark_core::workflow::RunRecord>| runs.into_iter().map(|r| r.run_id).collect::<Vec<_>>();
    let all = ids(d.store.list_runs(&RunFilter::default(), 100).unwrap());
    assert_eq!(all, ["a", "b", "c", "d", "e"]);
    // Keyset pages of 2 walk the same order, ties on created_at broken by run id.
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
    commit_one(
        &mut d.store,
        "c",
        &t,
        JournalOp::Finish { status: FinishStatus::Failed, result: None, error: None },
        2_010,
    );
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
// Crashes at the workflow crash points. No CLI command reaches them yet, so a child process
// (this test binary, running only `crash_child`) makes one store call with `TIDEMARK_CRASH_AT`
// set and dies there; the parent then checks the file. Needs the `failpoints` feature.

const CHILD_SCENARIO: &str = "TIDEMARK_WF_CRASH_SCENARIO";
const CHILD_DB: &str = "TIDEMARK_WF_CRASH_DB";
const CHILD_TOKEN: &str = "TIDEMARK_WF_CRASH_TOKEN";

/// The store call of each crash scenario, made by the child at `now_ms` 2_000.
fn child_call(scenario: &str, store: &mut SqliteWorkflows, token: &str) {
    match scenario {
        "start" => drop(store.start_runs(&[req("r2")], 2_000).unwrap()),
        "claim" => drop(claim(store, "child", 2_000)),
        "commit" => drop(store.commit(commit_scenario_writes(token), 2_000).unwrap()),
        "operator" => drop(store.abandon("r1", "crash test", 2_000).unwrap()),
        "purge" => drop(store.purge(i64::MAX, 10, 2_000).unwrap()),
        other => panic!("unknown crash scenario {other}"),
    }
}

fn commit_scenario_writes(token: &str) -> Vec<JournalWrite<Connection>> {
    vec![
        write("r1", token, step_ok(0, "reserve", 1, json!(1))),
        write("r1", token, tx_step(1, 1, insert_order("o-1", false), None)),
    ]
}

/// Runs only inside a child started by `crash_in_child`; in a normal test run it returns at once.
#[test]
fn crash_child() {
    let Ok(scenario) = std::env::var(CHILD_SCENARIO) else { return };
    let path = PathBuf::from(std::env::var(CHILD_DB).expect("db path"));
    let token = std::env::var(CHILD_TOKEN).unwrap_or_default();
    let mut store = SqliteWorkflows::init(&path).unwrap();
    child_call(&scenario, &mut store, &token);
    panic!("crash scenario {scenario} did not reach its crash point");
}

fn crash_in_child(point: &str, scenario: &str, path: &Path, token: &str) {
    let out = Command::new(std::env::current_exe().expect("test binary"))
        .args(["workflow_store::crash_child", "--exact", "--nocapture", "--test-threads", "1"])
        .env(CHILD_SCENARIO, scenario)
        .env(CHILD_DB, path)
        .env(CHILD_TOKEN, token)
        .env("TIDEMARK_CRASH_AT", point)
        .output()
        .expect("run the child");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(tidemark_core::crash::exit_code(point)),
        "the {scenario} child did not die at {point}:\n{}\n{stderr}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(stderr.contains(&format!("crash point {point} reached")), "{stderr}");
}

fn crash_scenario(point: &str) {
    let mut d = db();
    orders_table(&mut d.store);
    match point {
        "workflow.start.before_commit" => {
            start(&mut d.store, &[req("r1")], 1_000);
            let before = detail(&d.store, "r1");
            crash_in_child(point, "start", &d.path, "");
            assert!(d.store.run("r2").unwrap().is_none(), "the interrupted start is absent");
            assert_eq!(detail(&d.store, "r1"), before);
            assert_eq!(
                d.store.start_runs(&[req("r2")], 3_000).unwrap()[0],
                StartOutcome::Started { run_id: "r2".into() }
            );
        }
        "workflow.claim.after_commit" => {
            start(&mut d.store, &[req("r1")], 1_000);
            crash_in_child(point, "claim", &d.path, "");
            // The dead worker's lease was committed: nobody takes the run before it expires,
            // then the claim is the recovery.
            let run = detail(&d.store, "r1").run;
            assert_eq!((run.lease_owner.as_deref(), run.lease_expires_at_ms), (Some("child"), Some(2_000 + LEASE_MS)));
            assert!(claim_ids(&mut d.store, "w1", 2_000 + LEASE_MS - 1).is_empty());
            let taken = claim(&mut d.store, "w1", 2_000 + LEASE_MS);
            assert!(taken[0].recovered);
            assert_eq!(taken[0].run.recoveries, 1);
        }
        "workflow.commit.before_commit" => {
            let token = started_and_claimed(&mut d.store, "r1", 1_500);
            crash_in_child(point, "commit", &d.path, &token);
            assert!(detail(&d.store, "r1").journal.is_empty());
            assert_eq!(orders(&mut d.store), 0, "the transactional step's row went with its journal entry");
            // The worker's retry of the same batch commits it, once.
            let results = d.store.commit(commit_scenario_writes(&token), 2_100).unwrap();
            assert_eq!(results[0], WriteResult::Done);
            assert!(matches!(results[1], WriteResult::TxResult(Ok(_))));
            assert_eq!(orders(&mut d.store), 1);
        }
        "workflow.commit.after_commit" => {
            let token = started_and_claimed(&mut d.store, "r1", 1_500);
            crash_in_child(point, "commit", &d.path, &token);
            let journal = detail(&d.store, "r1").journal;
            assert_eq!(journal.len(), 2);
            assert!(journal.iter().all(|e| e.status == StepStatus::Completed));
            assert_eq!(orders(&mut d.store), 1);
            // Replaying the same writes cannot apply them twice: settled entries are never
            // rewritten (the runtime replays from the journal instead).
            let err = d.store.commit(commit_scenario_writes(&token), 2_100).unwrap_err();
            assert!(matches!(err, Error::Invariant(_)), "{err:?}");
            assert_eq!(orders(&mut d.store), 1);
        }
        "workflow.operator.before_commit" => {
            let token = started_and_claimed(&mut d.store, "r1", 1_500);
            let before = detail(&d.store, "r1");
            crash_in_child(point, "operator", &d.path, "");
            assert_eq!(detail(&d.store, "r1"), before, "the interrupted abandon changed nothing");
            assert_eq!(commit_one(&mut d.store, "r1", &token, JournalOp::Release, 2_100), WriteResult::Done);
        }
        "workflow.purge.before_commit" => {
            finished_at(&mut d, "r1", 1_000);
            let before = detail(&d.store, "r1");
            crash_in_child(point, "purge", &d.path, "");
            assert_eq!(detail(&d.store, "r1"), before);
            let receipts: i64 =
                d.store.connection().query_row("SELECT count(*) FROM run_receipts", [], |r| r.get(0)).unwrap();
            assert_eq!(receipts, 0);
            assert_eq!(d.store.purge(i64::MAX, 10, 2_100).unwrap().runs_deleted, 1);
            assert!(matches!(d.store.start_runs(&[req("r1")], 2_200).unwrap()[0], StartOutcome::Existing { .. }));
        }
        other => panic!("workflow crash point {other} has no scenario in workflow_store.rs"),
    }
}

#[test]
fn every_workflow_crash_point_is_covered_here() {
    let workflow_points: Vec<&str> =
        tidemark_core::crash::CRASH_POINTS.iter().copied().filter(|p| p.starts_with("workflow.")).collect();
    assert_eq!(workflow_points, crate::crash::REACHED_BY_WORKFLOW_STORE_TESTS);
}

#[test]
fn a_crash_at_every_workflow_crash_point_leaves_a_consistent_store() {
    if !support::failpoints_enabled() {
        support::skip("workflow crash tests need --features failpoints (cargo test --workspace --all-features)");
        return;
    }
    for point in crate::crash::REACHED_BY_WORKFLOW_STORE_TESTS {
        eprintln!("workflow crash scenario: {point}");
        crash_scenario(point);
    }
}

// ---------------------------------------------------------------------------------------------
// Property: random claims, heartbeats, writes, suspends, releases and finishes by three workers
// against a model of who holds which run. After every step: a write is fenced exactly when its
// token is not the run's current one; per-type limits and per-key serialization hold; journals
// are contiguous; finished runs are never handed out again.

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
fn simulate(seed: u64) -> (u32, u32, usize) {
    use std::collections::{BTreeMap, BTreeSet};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wf.db");
    let mut store = SqliteWorkflows::init_with(&path, tidemark_store_sqlite::Durability::Normal).unwrap();
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let keys = [Some("k1"), Some("k2"), None];
    let mut now = 1_000;
    for i in 0..12 {
        let workflow = if i % 2 == 0 { "alpha" } else { "beta" };
        let key = keys[rng.below(3) as usize].map(String::from);
        let request = StartRequest { workflow: workflow.into(), key, ..req(&format!("r{i:02}")) };
        start(&mut store, &[request], now);
        now += 1;
    }
    let workflows = || vec![version("alpha", 1, Some(2)), version("beta", 1, None)];
    let workers = ["w0", "w1", "w2"];
    // The model: each run's current token, and each worker's view of what it holds.
    let mut current: BTreeMap<String, Option<String>> = BTreeMap::new();
    let mut held: BTreeMap<&str, BTreeMap<String, String>> = workers.iter().map(|w| (*w, BTreeMap::new())).collect();
    let mut finished: BTreeSet<String> = BTreeSet::new();
    let (mut fenced, mut recoveries) = (0, 0);
    for _ in 0..250 {
        now += rng.below(400) as i64;
        let worker = workers[rng.below(3) as usize];
        let action = rng.below(6);
        if action == 0 || held[worker].is_empty() {
            let limit = 1 + rng.below(3) as usize;
            let claimed = store
                .claim(
                    &ClaimRequest { worker_id: worker.into(), workflows: workflows(), limit, lease_ms: LEASE_MS },
                    now,
                )
                .unwrap();
            for c in claimed {
                assert!(!finished.contains(&c.run.run_id), "seed {seed}: a finished run was claimed");
                recoveries += u32::from(c.recovered);
                let seqs: Vec<u32> = c.journal.iter().map(|e| e.seq).collect();
                assert_eq!(seqs, (0..c.journal.len() as u32).collect::<Vec<_>>(), "seed {seed}: journal has gaps");
                current.insert(c.run.run_id.clone(), Some(c.lease_token.clone()));
                held.get_mut(worker).unwrap().insert(c.run.run_id, c.lease_token);
            }
        } else if action == 1 {
            let leases: Vec<(String, String)> = held[worker].iter().map(|(r, t)| (r.clone(), t.clone())).collect();
            let states = store.heartbeat(worker, &leases, LEASE_MS, now).unwrap();
            for ((run_id, _), state) in leases.iter().zip(states) {
                if state == LeaseState::Lost {
                    held.get_mut(worker).unwrap().remove(run_id);
                }
            }
        } else {
            let pick = rng.below(held[worker].len() as u64) as usize;
            let (run_id, token) = held[worker].iter().nth(pick).map(|(r, t)| (r.clone(), t.clone())).unwrap();
            let before = detail(&store, &run_id);
            let next = before.journal.len() as u32;
            let op = match action {
                2 => step_ok(next, &format!("step{next}"), 1, json!(next)),
                3 => JournalOp::Suspend {
                    status: SuspendStatus::Sleeping,
                    wake_at_ms: now + rng.below(2_000) as i64,
                    waiting_for: None,
                },
                4 => JournalOp::Release,
                _ => JournalOp::Finish { status: FinishStatus::Completed, result: Some(json!(run_id)), error: None },
            };
            let ends_lease = action != 2;
            let finishes = action == 5;
            let result = commit_one(&mut store, &run_id, &token, op, now);
            let expected_fenced = current[&run_id].as_deref() != Some(token.as_str());
            assert_eq!(result == WriteResult::Fenced, expected_fenced, "seed {seed}: fencing of {run_id}");
            if expected_fenced {
                fenced += 1;
                assert_eq!(detail(&store, &run_id), before, "seed {seed}: a fenced write changed {run_id}");
                held.get_mut(worker).unwrap().remove(&run_id);
            } else if ends_lease {
                current.insert(run_id.clone(), None);
                held.get_mut(worker).unwrap().remove(&run_id);
                if finishes {
                    finished.insert(run_id.clone());
                }
            }
        }
        check_claim_invariants(&path, now, seed);
    }
    (fenced, recoveries, finished.len())
}

fn check_claim_invariants(path: &Path, now: i64, seed: u64) {
    let conn = tidemark_store_sqlite::open_existing(path).unwrap();
    let active = "status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating')";
    let live_alpha: i64 = conn
        .query_row(
            &format!("SELECT count(*) FROM runs WHERE workflow = 'alpha' AND {active} AND lease_expires_at_ms > ?1"),
            [now],
            |r| r.get(0),
        )
        .unwrap();
    assert!(live_alpha <= 2, "seed {seed}: {live_alpha} live leases of alpha (limit 2)");
    let per_key: Vec<(String, i64)> = {
        let mut stmt = conn
            .prepare(&format!("SELECT key, count(*) FROM runs WHERE key IS NOT NULL AND {active} AND lease_expires_at_ms > ?1 GROUP BY key"))
            .unwrap();
        let rows = stmt.query_map([now], |r| Ok((r.get(0)?, r.get(1)?))).unwrap();
        rows.map(|r| r.unwrap()).collect()
    };
    for (key, leased) in per_key {
        assert!(leased <= 1, "seed {seed}: {leased} live leases on key {key}");
        let (oldest, holder): (String, String) = conn
            .query_row(
                &format!(
                    "SELECT (SELECT run_id FROM runs WHERE key = ?1 AND {active} ORDER BY created_at_ms, run_id LIMIT 1),
                            (SELECT run_id FROM runs WHERE key = ?1 AND {active} AND lease_expires_at_ms > ?2)"
                ),
                rusqlite::params![key, now],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        assert_eq!(holder, oldest, "seed {seed}: key {key} is held by a run that is not its oldest active one");
    }
}

#[test]
fn random_workers_never_break_fencing_limits_or_key_order() {
    let (mut fenced, mut recoveries, mut finished) = (0, 0, 0);
    for seed in 1..=6 {
        let (f, r, done) = simulate(seed);
        (fenced, recoveries, finished) = (fenced + f, recoveries + r, finished + done);
    }
    eprintln!("simulated: {fenced} fenced writes, {recoveries} recoveries, {finished} finished runs");
    assert!(
        fenced > 0 && recoveries > 0 && finished > 0,
        "the simulation must exercise fencing, recovery and finishing"
    );
}
