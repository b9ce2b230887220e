//! Importing a run recorded elsewhere (its [`RunDetail`], as `GET /v1/runs/{id}` and `tidemark
//! workflow show` give it), so that new code can replay its journal on a throwaway schema
//! (`tidemark::testing`), as SQLite's `SqliteWorkflows::import_run` does on a throwaway file.
//! Nothing of the engine calls it; it is one transaction, like every write.

use tidemark_core::error::codes;
use tidemark_core::workflow::{RunDetail, StartRequest};
use tidemark_core::{Error, Result};

use super::rows::json_text;
use super::{clip_error, seq_param, PgWorkflows};
use crate::PgResult;

impl PgWorkflows {
    /// Insert the run `detail` records (its journal, attempts and events, copied as they are) as
    /// a new run, in one transaction: unleased, due at `now_ms`, `pending` (or `compensating`
    /// when it was compensating), without its result, error, key, queue or parent, so that the
    /// next claim replays its journal. For replaying a production run against new code on a
    /// throwaway schema (`tidemark::testing::ReplayCheck`); never for moving runs between live
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
        let st = self.statements.get_mut();
        let (mut tx, gate) = self.apply.write_transaction()?;
        let insert = st.get(
            &mut tx,
            "INSERT INTO {s}.runs (run_id, workflow, version, input, input_hash, status, wake_at_ms, forked_from,
                                   recoveries, created_at_ms, updated_at_ms)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $7)
             ON CONFLICT (run_id) DO NOTHING",
        )?;
        let inserted = tx
            .execute(
                &insert,
                &[
                    &run.run_id,
                    &run.workflow,
                    &i64::from(run.version),
                    &json_text(&run.input),
                    &request.input_hash(),
                    &detail.import_status().as_str(),
                    &now_ms,
                    &run.forked_from,
                    &seq_param(run.recoveries),
                    &run.created_at_ms,
                ],
            )
            .db()?;
        if inserted == 0 {
            return Err(Error::invalid(codes::ALREADY_EXISTS, format!("run {:?} already exists", run.run_id)));
        }
        let insert = st.get(
            &mut tx,
            "INSERT INTO {s}.journal (run_id, seq, name, kind, status, output, error, attempts, next_attempt_at_ms,
                                      wake_at_ms, event_name, reason, updated_at_ms)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
        )?;
        for entry in &detail.journal {
            tx.execute(
                &insert,
                &[
                    &run.run_id,
                    &seq_param(entry.seq),
                    &entry.name,
                    &entry.kind.as_str(),
                    &entry.status.as_str(),
                    &entry.output.as_ref().map(json_text),
                    &entry.error.as_deref().map(clip_error),
                    &seq_param(entry.attempts),
                    &entry.next_attempt_at_ms,
                    &entry.wake_at_ms,
                    &entry.event_name,
                    &entry.reason,
                    &entry.updated_at_ms,
                ],
            )
            .db()?;
        }
        let insert = st.get(
            &mut tx,
            "INSERT INTO {s}.step_attempts (run_id, seq, attempt, ok, error, finished_at_ms)
             VALUES ($1, $2, $3, $4, $5, $6)",
        )?;
        for attempt in &detail.attempts {
            tx.execute(
                &insert,
                &[
                    &run.run_id,
                    &seq_param(attempt.seq),
                    &seq_param(attempt.attempt),
                    &attempt.ok,
                    &attempt.error.as_deref().map(clip_error),
                    &attempt.finished_at_ms,
                ],
            )
            .db()?;
        }
        let insert = st.get(
            &mut tx,
            "INSERT INTO {s}.run_events (run_id, event_id, name, payload, received_at_ms, consumed_by_seq)
             VALUES ($1, $2, $3, $4, $5, $6)",
        )?;
        for event in &detail.events {
            tx.execute(
                &insert,
                &[
                    &run.run_id,
                    &event.event_id,
                    &event.name,
                    &json_text(&event.payload),
                    &event.received_at_ms,
                    &event.consumed_by_seq.map(seq_param),
                ],
            )
            .db()?;
        }
        gate.commit(tx)
    }
}
