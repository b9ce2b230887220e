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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
    /// Whether a request may carry [`APPEND_AT_ANY_SEQ`] instead of the seq the caller last saw
    /// (plain event streams, where order between writers does not matter to the domain).
    fn appends_at_any_seq(&self) -> bool {
        false
    }
}

/// `expected_seq` meaning "whatever the flow's seq is": only for machines whose
/// [`FlowMachine::appends_at_any_seq`] is true. The event still gets the next seq of the flow.
pub const APPEND_AT_ANY_SEQ: i64 = -1;

/// Outcome of one advance. Rejections are answers, not remembered state.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
    let any_seq_allowed = machine.appends_at_any_seq() && request.expected_seq == APPEND_AT_ANY_SEQ;
    if request.expected_seq < 0 && !any_seq_allowed {
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
    if request.expected_seq != current_seq && request.expected_seq != APPEND_AT_ANY_SEQ {
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

/// A plain event stream: a flow with no domain states, whose every event is whatever the caller
/// says (an event type and a JSON object payload). It is what `tidemark serve`'s "enqueue an
/// event" uses. Its state is [`StreamMachine::STATE`] from the first event on; a flow another
/// machine has moved is never a stream (the other machine's state is refused here, and
/// [`StreamMachine::STATE`] is refused by machines that do not know it).
///
/// The request's `to_state` must be [`StreamMachine::STATE`]; its input is
/// `{"event_type": "<id>", "payload": {...}}`.
pub struct StreamMachine;

impl StreamMachine {
    pub const STATE: &'static str = "stream";
    const INITIAL: &'static str = "new";
}

impl FlowMachine for StreamMachine {
    fn initial(&self) -> FlowState {
        FlowState { state: Self::INITIAL.into(), data: Value::Object(Default::default()) }
    }

    fn validate(&self, request: &AdvanceRequest) -> Result<()> {
        if request.to_state != Self::STATE {
            return Err(Error::invalid(
                codes::UNKNOWN_STATE,
                format!("a stream event's to_state is {:?}, got {:?}", Self::STATE, request.to_state),
            ));
        }
        let Some(object) = request.input.as_object() else {
            return Err(Error::invalid(codes::INVALID_PAYLOAD, "input must be a JSON object"));
        };
        if let Some(key) = object.keys().find(|k| !matches!(k.as_str(), "event_type" | "payload")) {
            return Err(Error::invalid(codes::INVALID_PAYLOAD, format!("unknown input field {key:?}")));
        }
        let event_type = object.get("event_type").and_then(Value::as_str).unwrap_or_default();
        validate_id("event_type", event_type)?;
        let payload = object.get("payload").unwrap_or(&Value::Null);
        if !payload.is_object() {
            return Err(Error::invalid(codes::INVALID_PAYLOAD, "payload must be a JSON object"));
        }
        crate::envelope::validate_payload(payload)
    }

    fn decide(&self, current: &FlowState, request: &AdvanceRequest) -> std::result::Result<Decision, String> {
        if current.state != Self::INITIAL && current.state != Self::STATE {
            return Err(format!("flow {} is in state {:?}: it is not an event stream", request.flow_id, current.state));
        }
        Ok(Decision {
            next: FlowState { state: Self::STATE.into(), data: Value::Object(Default::default()) },
            event_type: request.input["event_type"].as_str().unwrap_or_default().to_string(),
            payload: request.input["payload"].clone(),
        })
    }

    fn appends_at_any_seq(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn append(expected_seq: i64, input: Value) -> AdvanceRequest {
        AdvanceRequest {
            flow_id: "s1".into(),
            expected_seq,
            to_state: StreamMachine::STATE.into(),
            input,
            schema_version: 1,
        }
    }

    #[test]
    fn streams_append_at_any_seq_and_refuse_other_machines_flows() {
        let request = append(APPEND_AT_ANY_SEQ, json!({"event_type": "note.added", "payload": {"n": 1}}));
        validate_request(&StreamMachine, &request).unwrap();
        let (seq, decision) = decide_advance(&StreamMachine, 4, &StreamMachine.initial(), &request).unwrap().unwrap();
        assert_eq!((seq, decision.event_type.as_str()), (5, "note.added"));
        assert_eq!(decision.payload, json!({"n": 1}));
        let reserved = FlowState { state: "reserved".into(), data: json!({"quantity": 1}) };
        assert!(matches!(
            decide_advance(&StreamMachine, 1, &reserved, &request).unwrap(),
            Err(AdvanceOutcome::InvalidTransition { .. })
        ));
        // Other machines do not accept "any seq".
        let reservation = AdvanceRequest { to_state: "reserved".into(), input: json!({"quantity": 1}), ..request };
        assert_eq!(
            validate_request(&crate::reservation::ReservationMachine, &reservation).unwrap_err().code(),
            codes::INVALID_SEQ
        );
    }

    #[test]
    fn stream_input_is_validated() {
        for bad in [
            json!([]),
            json!({"payload": {}}),
            json!({"event_type": "a b", "payload": {}}),
            json!({"event_type": "t", "payload": 3}),
            json!({"event_type": "t", "payload": {}, "x": 1}),
        ] {
            assert!(validate_request(&StreamMachine, &append(0, bad.clone())).is_err(), "{bad}");
        }
        let big = json!({"event_type": "t", "payload": {"s": "x".repeat(crate::limits::PAYLOAD_BYTES_MAX)}});
        assert_eq!(validate_request(&StreamMachine, &append(0, big)).unwrap_err().code(), codes::PAYLOAD_TOO_LARGE);
        assert_eq!(
            validate_request(&StreamMachine, &append(-2, json!({"event_type": "t", "payload": {}})))
                .unwrap_err()
                .code(),
            codes::INVALID_SEQ
        );
    }
}
