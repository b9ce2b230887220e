//! Importing a run recorded elsewhere (its [`RunDetail`], as `GET /v1/runs/{id}` and `tidemark
//! workflow show` give it), so that new code can replay its journal on a throwaway file
//! (`tidemark::testing`). Nothing of the engine calls it; it is one transaction, like every write.

use rusqlite::{params, TransactionBehavior};
use tidemark_core::error::codes;
use tidemark_core::workflow::{RunDetail, StartRequest};
use tidemark_core::{Error, Result};

use super::rows::{self, json_text};
use super::{clip_error, SqliteWorkflows};
use crate::SqlResult;

impl SqliteWorkflows {
    /// Insert the run `detail` records (its journal, attempts and events, copied as they are) as
    /// a new run, in one transaction: unleased, due at `now_ms`, `pending` (or `compensating`
    /// when it was compensating), without its result, error, key, queue or parent, so that the
    /// next claim replays its journal. For replaying a production run against new code on a
    /// throwaway file (`tidemark::testing::ReplayCheck`); never for moving runs between live
    /// databases.
    ///
    /// Refused, nothing written: a run id that exists (`already_exists`), identifiers that are
    /// not (`invalid_id`), an input over 256 KiB (`invalid_input`), a journal whose positions
    /// are not 0, 1, 2, ... or are beyond the step limit, outputs or payloads over their limits,
    /// attempts or events of another run or of a position the journal does not hold
    /// (`invalid_argument`, `payload_too_large`).
    pub fn import_run(&mut self, detail: &RunDetail, now_ms: i64) -> Result<()> {
        detail.validate_import()?;
        let run = &detail.run;
        let request = StartRequest::new(&run.run_id, &run.workflow, run.version, run.input.clone());
        let status = detail.import_status();
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        if rows::load_run(&tx, &run.run_id)?.is_some() {
            return Err(Error::invalid(codes::ALREADY_EXISTS, format!("run {:?} already exists", run.run_id)));
        }
        tx.execute(
            "INSERT INTO runs (run_id, workflow, version, input, input_hash, status, wake_at_ms, forked_from,
                               recoveries, created_at_ms, updated_at_ms)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?7)",
            params![
                run.run_id,
                run.workflow,
                run.version,
                json_text(&run.input),
                request.input_hash(),
                status.as_str(),
                now_ms,
                run.forked_from,
                run.recoveries,
                run.created_at_ms,
            ],
        )
        .db()?;
        {
            let mut insert = tx
                .prepare(
                    "INSERT INTO journal (run_id, seq, name, kind, status, output, error, attempts, next_attempt_at_ms,
                                          wake_at_ms, event_name, reason, updated_at_ms)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
                )
                .db()?;
            for entry in &detail.journal {
                insert
                    .execute(params![
                        run.run_id,
                        entry.seq,
                        entry.name,
                        entry.kind.as_str(),
                        entry.status.as_str(),
                        entry.output.as_ref().map(json_text),
                        entry.error.as_deref().map(clip_error),
                        entry.attempts,
                        entry.next_attempt_at_ms,
                        entry.wake_at_ms,
                        entry.event_name,
                        entry.reason,
                        entry.updated_at_ms,
                    ])
                    .db()?;
            }
            let mut insert = tx
                .prepare(
                    "INSERT INTO step_attempts (run_id, seq, attempt, ok, error, finished_at_ms)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                )
                .db()?;
            for attempt in &detail.attempts {
                insert
                    .execute(params![
                        run.run_id,
                        attempt.seq,
                        attempt.attempt,
                        attempt.ok,
                        attempt.error.as_deref().map(clip_error),
                        attempt.finished_at_ms,
                    ])
                    .db()?;
            }
            let mut insert = tx
                .prepare(
                    "INSERT INTO run_events (run_id, event_id, name, payload, received_at_ms, consumed_by_seq)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                )
                .db()?;
            for event in &detail.events {
                insert
                    .execute(params![
                        run.run_id,
                        event.event_id,
                        event.name,
                        json_text(&event.payload),
                        event.received_at_ms,
                        event.consumed_by_seq,
                    ])
                    .db()?;
            }
        }
        tx.commit().db()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use tidemark_core::workflow::{RunDetail, RunStatus, WorkflowStore};

    use super::*;

    fn recorded() -> RunDetail {
        serde_json::from_value(json!({
            "run": {
                "run_id": "order-1", "workflow": "order", "version": 2, "input": {"sku": "w"}, "key": "k",
                "status": "sleeping", "result": null, "error": null, "wake_at_ms": 9_000, "waiting_for": null,
                "cancel_requested": false, "forked_from": null, "parent_run_id": "parent-1", "queue": "q",
                "priority": 1, "admitted_at_ms": 5, "lease_owner": "w-1", "lease_expires_at_ms": 8_000,
                "recoveries": 1, "created_at_ms": 1_000, "updated_at_ms": 2_000
            },
            "journal": [
                {"seq": 0, "name": "reserve", "kind": "external", "status": "completed", "output": "r",
                 "error": "timed out", "attempts": 2, "next_attempt_at_ms": null, "wake_at_ms": null,
                 "event_name": null, "reason": null, "updated_at_ms": 1_500},
                {"seq": 1, "name": "sleep", "kind": "sleep", "status": "waiting", "output": null, "error": null,
                 "attempts": 0, "next_attempt_at_ms": null, "wake_at_ms": 9_000, "event_name": null,
                 "reason": null, "updated_at_ms": 1_600}
            ],
            "attempts": [
                {"seq": 0, "attempt": 1, "ok": false, "error": "timed out", "finished_at_ms": 1_200},
                {"seq": 0, "attempt": 2, "ok": true, "error": null, "finished_at_ms": 1_500}
            ],
            "events": [
                {"event_id": "e-1", "name": "approved", "payload": {"by": "ann"}, "received_at_ms": 1_100,
                 "consumed_by_seq": null}
            ]
        }))
        .unwrap()
    }

    #[test]
    fn a_recorded_run_is_imported_as_it_was_recorded_and_due_now() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = SqliteWorkflows::init(&dir.path().join("wf.db")).unwrap();
        let detail = recorded();
        store.import_run(&detail, 3_000).unwrap();
        let imported = store.run("order-1").unwrap().unwrap();
        assert_eq!(
            (imported.journal.clone(), imported.attempts.clone()),
            (detail.journal.clone(), detail.attempts.clone())
        );
        assert_eq!(imported.events, detail.events);
        let run = &imported.run;
        assert_eq!((run.status, run.wake_at_ms, run.input.clone()), (RunStatus::Pending, 3_000, json!({"sku": "w"})));
        assert_eq!((run.lease_owner.as_deref(), run.key.as_deref(), run.parent_run_id.as_deref()), (None, None, None));
        assert_eq!((run.queue.as_deref(), run.created_at_ms, run.recoveries), (None, 1_000, 1));
        // The same run again is refused, nothing written.
        let error = store.import_run(&detail, 3_000).unwrap_err();
        assert_eq!(error.code(), codes::ALREADY_EXISTS);
    }

    #[test]
    fn a_broken_recording_is_refused_before_anything_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = SqliteWorkflows::init(&dir.path().join("wf.db")).unwrap();
        let mut gapped = recorded();
        gapped.journal.remove(0);
        assert_eq!(store.import_run(&gapped, 3_000).unwrap_err().code(), codes::INVALID_ARGUMENT);
        let mut stray = recorded();
        stray.attempts[0].seq = 7;
        assert_eq!(store.import_run(&stray, 3_000).unwrap_err().code(), codes::INVALID_ARGUMENT);
        let mut bad_id = recorded();
        bad_id.run.run_id = "not an id".into();
        assert_eq!(store.import_run(&bad_id, 3_000).unwrap_err().code(), codes::INVALID_ID);
        assert!(store.run("order-1").unwrap().is_none());
    }
}
