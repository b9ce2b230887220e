//! Flows: aggregates with a per-flow sequence, driven by a user-defined state machine.
//!
//! The engine is generic: a user implements [`FlowMachine`] for their domain (states,
//! transitions, event payloads). The reservation domain in [`crate::reservation`] is the
//! built-in example that the CLI and tests use.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{codes, Error, Result};
use crate::id::validate_id;

/// The stored state of one flow (producer side).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FlowState {
    pub state: String,
    /// Domain data carried by the state (e.g. the reserved quantity), as JSON.
    pub data: Value,
}

/// A request to move a flow to `to_state`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdvanceRequest {
    pub flow_id: String,
    /// The seq the caller last saw for this flow (0 for a new flow). Optimistic concurrency.
    pub expected_seq: i64,
    pub to_state: String,
    /// Domain input, e.g. `{"quantity": 3}`.
    pub input: Value,
    /// Schema version of the event payload to emit.
    pub schema_version: u32,
}

/// What a machine decided for a valid transition.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub next: FlowState,
    pub event_type: String,
    pub payload: Value,
}

/// Pure domain logic of one kind of flow. Implementations must be deterministic.
pub trait FlowMachine: Send + Sync {
    /// The state of a flow that has no events yet.
    fn initial(&self) -> FlowState;
    /// Input validation independent of the current state. Errors here are bad input
    /// (nothing is written); they are not protocol outcomes.
    fn validate(&self, request: &AdvanceRequest) -> Result<()>;
    /// Decide a transition from `current`. `Err(reason)` is the `invalid_transition` outcome.
    fn decide(&self, current: &FlowState, request: &AdvanceRequest) -> std::result::Result<Decision, String>;
}

/// Outcome of one advance. Rejections are answers, not remembered state.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum AdvanceOutcome {
    Committed { flow_id: String, seq: i64, event_id: String, state: String },
    Stale { flow_id: String, expected_seq: i64, current_seq: i64 },
    InvalidTransition { flow_id: String, current_state: String, to_state: String, reason: String },
}

impl AdvanceOutcome {
    pub fn word(&self) -> &'static str {
        match self {
            AdvanceOutcome::Committed { .. } => "committed",
            AdvanceOutcome::Stale { .. } => "stale",
            AdvanceOutcome::InvalidTransition { .. } => "invalid_transition",
        }
    }
}

/// Validation shared by every store before a request reaches a transaction.
pub fn validate_request(machine: &dyn FlowMachine, request: &AdvanceRequest) -> Result<()> {
    validate_id("flow_id", &request.flow_id)?;
    if request.expected_seq < 0 {
        return Err(Error::invalid(
            codes::INVALID_SEQ,
            format!("expected_seq must be >= 0, got {}", request.expected_seq),
        ));
    }
    crate::envelope::validate_schema_version(request.schema_version)?;
    machine.validate(request)
}

/// The pure core of `advance`: given the flow's current seq and state, answer the outcome and,
/// when committed, the new seq and decision. Stores call this inside their transaction.
pub fn decide_advance(
    machine: &dyn FlowMachine,
    current_seq: i64,
    current: &FlowState,
    request: &AdvanceRequest,
) -> Result<std::result::Result<(i64, Decision), AdvanceOutcome>> {
    if request.expected_seq != current_seq {
        return Ok(Err(AdvanceOutcome::Stale {
            flow_id: request.flow_id.clone(),
            expected_seq: request.expected_seq,
            current_seq,
        }));
    }
    let next_seq = current_seq.checked_add(1).ok_or_else(|| {
        Error::invalid(codes::SEQ_OVERFLOW, format!("flow {} has reached the last seq {}", request.flow_id, i64::MAX))
    })?;
    match machine.decide(current, request) {
        Ok(decision) => {
            crate::envelope::validate_payload(&decision.payload)?;
            Ok(Ok((next_seq, decision)))
        }
        Err(reason) => Ok(Err(AdvanceOutcome::InvalidTransition {
            flow_id: request.flow_id.clone(),
            current_state: current.state.clone(),
            to_state: request.to_state.clone(),
            reason,
        })),
    }
}
