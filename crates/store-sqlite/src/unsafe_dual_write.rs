//! **Deliberately wrong. Test-only.** The "dual write" that the transactional outbox exists to
//! prevent: the flow's state change is committed in one transaction and its outbox event is
//! inserted in a *second* transaction. A crash between the two commits leaves a flow whose
//! state moved on while no event says so: the event is lost for every subscriber, forever.
//!
//! Compiled only with the `failpoints` feature (this module and its re-export exist in no other
//! build). In the `tidemark` binary,
//! [`unsafe_dual_write_advance`](crate::unsafe_dual_write_advance) is called only by the hidden
//! `tidemark unsafe-dual-write-advance` command of a failpoints build, so that a crash test can
//! show the loss next to the real `advance` (one transaction), which never leaves that state at
//! any of its crash points; killed at
//! [`BETWEEN_COMMITS`](crate::unsafe_dual_write::BETWEEN_COMMITS) that process exits 81.
//!
//! It is not the binary's only deliberately wrong dual write: the hidden
//! `tidemark experiment --child unsafe-dual-write` (started by the experiment's
//! `unsafe_dual_write_loss` scenario, in every build, failpoints or not) commits a business row
//! alone and exits 81 before writing its event (`crates/lab/src/experiment/world.rs`,
//! `run_child`). That path does not use this module.

use rusqlite::{params, OptionalExtension, TransactionBehavior};
use tidemark_core::crash;
use tidemark_core::flow::{decide_advance, validate_request, AdvanceOutcome, AdvanceRequest, FlowMachine, FlowState};
use tidemark_core::store::ProducerStore;
use tidemark_core::{Envelope, Error, Result};

use crate::{SqlResult, SqliteProducer};

/// The crash point between the two commits.
pub const BETWEEN_COMMITS: &str = "unsafe_dual_write.between_commits";

/// Advance one flow the WRONG way: commit the flow row, then (in a second transaction) the
/// outbox event and its deliveries. Never use this outside the crash test that shows why.
pub fn unsafe_dual_write_advance(
    producer: &mut SqliteProducer,
    machine: &dyn FlowMachine,
    request: &AdvanceRequest,
    now_ms: i64,
) -> Result<AdvanceOutcome> {
    validate_request(machine, request)?;
    let identity = producer.identity().clone();
    let conn = producer.connection();

    // Transaction 1: the state change alone.
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
    let existing: Option<(String, String, i64)> = tx
        .query_row("SELECT state, state_data, last_seq FROM flows WHERE flow_id = ?1", [&request.flow_id], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })
        .optional()
        .db()?;
    let (current_seq, current) = match existing {
        Some((state, data, seq)) => {
            let data = serde_json::from_str(&data).map_err(|e| Error::store(format!("corrupt flow state: {e}")))?;
            (seq, FlowState { state, data })
        }
        None => (0, machine.initial()),
    };
    let (seq, decision) = match decide_advance(machine, current_seq, &current, request)? {
        Ok(decided) => decided,
        Err(rejection) => return Ok(rejection),
    };
    tx.execute(
        "INSERT INTO flows (flow_id, state, state_data, last_seq, updated_at_ms) VALUES (?1, ?2, ?3, ?4, ?5)
         ON CONFLICT (flow_id) DO UPDATE SET state = excluded.state, state_data = excluded.state_data,
             last_seq = excluded.last_seq, updated_at_ms = excluded.updated_at_ms",
        params![request.flow_id, decision.next.state, decision.next.data.to_string(), seq, now_ms],
    )
    .db()?;
    tx.commit().db()?;

    // The window: a crash here loses the event.
    crash::hit(BETWEEN_COMMITS);

    // Transaction 2: the event, too late to be atomic with the state change.
    let event = Envelope {
        event_id: uuid::Uuid::now_v7().simple().to_string(),
        source: identity.source,
        generation: identity.generation,
        flow_id: request.flow_id.clone(),
        seq,
        event_type: decision.event_type,
        schema_version: request.schema_version,
        payload: decision.payload,
        created_at_ms: now_ms,
        traceparent: None,
    };
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
    // The event becomes due for every subscriber through its delivery cursor.
    let position = crate::producer::last_position(&tx)? + 1;
    tx.execute(
        "INSERT INTO outbox (position, event_id, flow_id, seq, event_type, schema_version, payload, content_hash, created_at_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        params![
            position,
            event.event_id,
            event.flow_id,
            event.seq,
            event.event_type,
            event.schema_version,
            event.payload.to_string(),
            event.content_hash(),
            event.created_at_ms
        ],
    )
    .db()?;
    tx.commit().db()?;
    Ok(AdvanceOutcome::Committed { flow_id: event.flow_id, seq, event_id: event.event_id, state: decision.next.state })
}
