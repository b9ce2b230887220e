//! The built-in example domain: a reservation `new -> reserved -> confirmed -> released`.
//! No skipping, no reopening, no loops; a flow's quantity is fixed at 1..=1,000,000.
//!
//! Producer side: [`ReservationMachine`]. Consumer side: the decoder registry (v1 carries
//! `payload.amount`, v2 `payload.units`) and the pure projection step [`project`].

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::decode::DecoderRegistry;
use crate::error::{codes, Error, Result};
use crate::flow::{AdvanceRequest, Decision, FlowMachine, FlowState};
use crate::limits::{RESERVATION_QUANTITY_MAX, RESERVATION_QUANTITY_MIN};

/// The reservation's states in their only order: a flow moves one step forward at a time and
/// `released` is final.
pub const STATES: [&str; 4] = ["new", "reserved", "confirmed", "released"];

fn next_state(state: &str) -> Option<&'static str> {
    match state {
        "new" => Some("reserved"),
        "reserved" => Some("confirmed"),
        "confirmed" => Some("released"),
        _ => None,
    }
}

/// The event type a reservation emits on entering `state` (`reservation.<state>`).
pub fn event_type_for(state: &str) -> String {
    format!("reservation.{state}")
}

/// The reservation state machine (producer side).
#[derive(Debug, Clone, Copy, Default)]
pub struct ReservationMachine;

fn input_quantity(request: &AdvanceRequest) -> Result<Option<i64>> {
    match request.input.get("quantity") {
        None | Some(Value::Null) => Ok(None),
        Some(value) => {
            let quantity = value.as_i64().ok_or_else(|| {
                Error::invalid(codes::INVALID_QUANTITY, format!("quantity must be an integer, got {value}"))
            })?;
            if !(RESERVATION_QUANTITY_MIN..=RESERVATION_QUANTITY_MAX).contains(&quantity) {
                return Err(Error::invalid(
                    codes::INVALID_QUANTITY,
                    format!("quantity must be {RESERVATION_QUANTITY_MIN}..={RESERVATION_QUANTITY_MAX}, got {quantity}"),
                ));
            }
            Ok(Some(quantity))
        }
    }
}

impl FlowMachine for ReservationMachine {
    fn name(&self) -> &str {
        "reservation"
    }

    fn states(&self) -> Vec<&str> {
        STATES.to_vec()
    }

    fn initial(&self) -> FlowState {
        FlowState { state: "new".into(), data: json!({}) }
    }

    fn validate(&self, request: &AdvanceRequest) -> Result<()> {
        if !STATES.contains(&request.to_state.as_str()) {
            return Err(Error::invalid(
                codes::UNKNOWN_STATE,
                format!("unknown reservation state {:?}; states are {STATES:?}", request.to_state),
            ));
        }
        if !matches!(request.schema_version, 1 | 2) {
            return Err(Error::invalid(
                codes::INVALID_SCHEMA_VERSION,
                format!("the reservation producer emits schema 1 or 2, got {}", request.schema_version),
            ));
        }
        let Some(object) = request.input.as_object() else {
            return Err(Error::invalid(codes::INVALID_PAYLOAD, "input must be a JSON object"));
        };
        if let Some(key) = object.keys().find(|k| k.as_str() != "quantity") {
            return Err(Error::invalid(codes::INVALID_PAYLOAD, format!("unknown input field {key:?}")));
        }
        let quantity = input_quantity(request)?;
        if request.to_state == "reserved" && quantity.is_none() {
            return Err(Error::invalid(codes::INVALID_QUANTITY, "reserving needs a quantity"));
        }
        Ok(())
    }

    fn decide(&self, current: &FlowState, request: &AdvanceRequest) -> std::result::Result<Decision, String> {
        if next_state(&current.state) != Some(request.to_state.as_str()) {
            return Err(format!(
                "{} -> {} is not allowed; the only move from {} is {}",
                current.state,
                request.to_state,
                current.state,
                next_state(&current.state).unwrap_or("none (final)")
            ));
        }
        let requested = input_quantity(request).map_err(|e| e.to_string())?;
        let quantity = match (current.data.get("quantity").and_then(Value::as_i64), requested) {
            (None, Some(q)) => q,
            (Some(fixed), None) => fixed,
            (Some(fixed), Some(q)) if fixed == q => q,
            (Some(fixed), Some(q)) => return Err(format!("quantity is fixed at {fixed} for this flow, got {q}")),
            (None, None) => return Err("no quantity".into()),
        };
        let payload = match request.schema_version {
            1 => json!({ "amount": quantity }),
            _ => json!({ "units": quantity }),
        };
        Ok(Decision {
            next: FlowState { state: request.to_state.clone(), data: json!({ "quantity": quantity }) },
            event_type: event_type_for(&request.to_state),
            payload,
        })
    }
}

/// A decoded reservation event (consumer side).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReservationEvent {
    /// The state the event moves the flow to (`reserved`, `confirmed` or `released`).
    pub to_state: &'static str,
    /// The reserved quantity, fixed for the flow's life (v1 carries it as `payload.amount`, v2 as
    /// `payload.units`).
    pub quantity: i64,
}

/// One consumer's projection of one reservation flow.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservationProjection {
    /// The flow's state in this consumer's projection.
    pub state: String,
    /// The flow's quantity (1..=1,000,000), the same in every event of the flow.
    pub quantity: i64,
}

fn decode_quantity(payload: &Value, field: &str) -> std::result::Result<i64, String> {
    let object = payload.as_object().ok_or("payload is not an object")?;
    if let Some(extra) = object.keys().find(|k| k.as_str() != field) {
        return Err(format!("unexpected payload field {extra:?}"));
    }
    let value = object.get(field).ok_or_else(|| format!("payload.{field} is missing"))?;
    let quantity = value.as_i64().ok_or_else(|| format!("payload.{field} is not an integer: {value}"))?;
    if !(RESERVATION_QUANTITY_MIN..=RESERVATION_QUANTITY_MAX).contains(&quantity) {
        return Err(format!(
            "payload.{field} {quantity} is outside {RESERVATION_QUANTITY_MIN}..={RESERVATION_QUANTITY_MAX}"
        ));
    }
    Ok(quantity)
}

/// The decoder registry of the reservation consumer. v1 only by default; `support_v2` adds the
/// v2 decoders.
pub fn decoders(support_v2: bool) -> DecoderRegistry<ReservationEvent> {
    let mut registry = DecoderRegistry::new();
    for state in ["reserved", "confirmed", "released"] {
        let to_state: &'static str = STATES.iter().find(|s| **s == state).expect("known state");
        registry.register(&event_type_for(state), 1, move |payload| {
            Ok(ReservationEvent { to_state, quantity: decode_quantity(payload, "amount")? })
        });
        if support_v2 {
            registry.register(&event_type_for(state), 2, move |payload| {
                Ok(ReservationEvent { to_state, quantity: decode_quantity(payload, "units")? })
            });
        }
    }
    registry
}

/// Apply a decoded event to the current projection (None for an unseen flow). `Err` is the
/// blocked reason (invalid transition).
pub fn project(
    current: Option<&ReservationProjection>,
    event: &ReservationEvent,
) -> std::result::Result<ReservationProjection, String> {
    let (state, quantity) = match current {
        None => ("new", None),
        Some(p) => (p.state.as_str(), Some(p.quantity)),
    };
    if next_state(state) != Some(event.to_state) {
        return Err(format!("invalid transition {state} -> {}", event.to_state));
    }
    if let Some(fixed) = quantity {
        if fixed != event.quantity {
            return Err(format!("quantity changed from {fixed} to {}", event.quantity));
        }
    }
    Ok(ReservationProjection { state: event.to_state.to_string(), quantity: event.quantity })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::{decide_advance, validate_request, AdvanceOutcome};

    fn request(to: &str, input: Value, expected_seq: i64) -> AdvanceRequest {
        AdvanceRequest {
            flow_id: "r1".into(),
            expected_seq,
            to_state: to.into(),
            input,
            schema_version: 1,
            traceparent: None,
        }
    }

    #[test]
    fn the_chain_is_linear() {
        let m = ReservationMachine;
        let s0 = m.initial();
        let (seq, d) = decide_advance(&m, 0, &s0, &request("reserved", json!({"quantity": 5}), 0)).unwrap().unwrap();
        assert_eq!((seq, d.payload.clone()), (1, json!({"amount": 5})));
        let skip = decide_advance(&m, 1, &d.next, &request("released", json!({}), 1)).unwrap();
        assert!(matches!(skip, Err(AdvanceOutcome::InvalidTransition { .. })));
        let stale = decide_advance(&m, 1, &d.next, &request("confirmed", json!({}), 0)).unwrap();
        assert!(matches!(stale, Err(AdvanceOutcome::Stale { current_seq: 1, .. })));
    }

    #[test]
    fn bad_input_is_an_error_not_an_outcome() {
        let m = ReservationMachine;
        for (to, input) in [("reserved", json!({"quantity": 0})), ("reserved", json!({})), ("bogus", json!({}))] {
            assert!(validate_request(&m, &request(to, input, 0)).is_err());
        }
        assert!(validate_request(&m, &request("reserved", json!({"quantity": 1_000_000}), 0)).is_ok());
    }

    #[test]
    fn v2_is_blocked_until_enabled() {
        let payload = json!({"units": 3});
        assert!(decoders(false).decode("reservation.reserved", 2, &payload).is_err());
        let event = decoders(true).decode("reservation.reserved", 2, &payload).unwrap();
        assert_eq!(event, ReservationEvent { to_state: "reserved", quantity: 3 });
    }

    #[test]
    fn seq_overflow_is_a_clean_error() {
        let m = ReservationMachine;
        let current = FlowState { state: "reserved".into(), data: json!({"quantity": 1}) };
        let err = decide_advance(&m, i64::MAX, &current, &request("confirmed", json!({}), i64::MAX)).unwrap_err();
        assert_eq!(err.code(), codes::SEQ_OVERFLOW);
    }
}
