//! The SQLite workflow store (`SqliteWorkflows`), in process on real files.

use serde_json::json;
use tidemark_core::workflow::{RunStatus, StartOutcome, StartRequest, WorkflowStore};
use tidemark_store_sqlite::SqliteWorkflows;

fn start_request(run_id: &str) -> StartRequest {
    StartRequest {
        run_id: run_id.into(),
        workflow: "order_saga".into(),
        version: 1,
        input: json!({"order": run_id}),
        key: None,
        start_at_ms: None,
    }
}

#[test]
fn a_started_run_can_be_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = SqliteWorkflows::open(&dir.path().join("wf.db")).unwrap();
    let out = store.start_runs(&[start_request("r1")], 1_000).unwrap();
    assert_eq!(out, [StartOutcome::Started { run_id: "r1".into() }]);
    let run = store.run("r1").unwrap().unwrap().run;
    assert_eq!(run.status, RunStatus::Pending);
}
