//! Flows: aggregates with a per-flow sequence, driven by a user-defined state machine.
//!
//! The engine is generic: a user implements [`FlowMachine`] for their domain (states,
//! transitions, event payloads). The reservation domain in [`crate::reservation`] is the
//! built-in example that the CLI and tests use.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{codes, Error, Result};
use crate::id::validate_id;

/// The stored state of one flow (producer side).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FlowState {
    /// The state's name, one of its machine's [`FlowMachine::states`] (with several machines served
    /// together, it also tells which machine the flow belongs to).
    pub state: String,
    /// Domain data carried by the state (e.g. the reserved quantity), as JSON.
    pub data: Value,
}

/// A request to move a flow to `to_state`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdvanceRequest {
    /// The flow to advance (an identifier); a flow without events starts in its machine's initial
    /// state.
    pub flow_id: String,
    /// The seq the caller last saw for this flow (0 for a new flow). Optimistic concurrency.
    pub expected_seq: i64,
    /// The state the caller wants the flow in; the machine decides whether the move is allowed.
    pub to_state: String,
    /// Domain input, e.g. `{"quantity": 3}`.
    pub input: Value,
    /// Schema version of the event payload to emit.
    pub schema_version: u32,
    /// The W3C trace context (`traceparent`) the committed event carries to its consumers
    /// (the API takes it from the request's `traceparent` header). Not part of the event's
    /// content hash.
    pub traceparent: Option<String>,
}

impl AdvanceRequest {
    /// A request to move `flow_id` from seq `expected_seq` to `to_state` with `input`, emitting
    /// payload schema 1.
    pub fn new(flow_id: &str, expected_seq: i64, to_state: &str, input: Value) -> Self {
        AdvanceRequest {
            flow_id: flow_id.to_string(),
            expected_seq,
            to_state: to_state.to_string(),
            input,
            schema_version: 1,
            traceparent: None,
        }
    }

    /// The same request, its event carrying the trace context `traceparent` (a W3C
    /// `traceparent` of version 00; checked with the request).
    pub fn with_traceparent(mut self, traceparent: impl Into<String>) -> Self {
        self.traceparent = Some(traceparent.into());
        self
    }
}

/// What a machine decided for a valid transition.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The flow's state and data after the transition.
    pub next: FlowState,
    /// The type of the event the transition emits (an identifier, e.g. `reservation.reserved`).
    pub event_type: String,
    /// The event's payload: a JSON object of at most 64 KiB in canonical encoding.
    pub payload: Value,
}

/// Pure domain logic of one kind of flow. Implementations must be deterministic.
///
/// For a machine with typed input, data and event payloads, implement [`Machine`] instead:
/// every `Machine` is a `FlowMachine`.
pub trait FlowMachine: Send + Sync {
    /// The machine's name (an identifier): what the registry, the API and the dashboard call it.
    fn name(&self) -> &str;
    /// Every state a flow of this machine can be in, its initial state included. Machines served
    /// together must not share a state name: a flow's state tells which machine it belongs to
    /// ([`MachineSet`]).
    fn states(&self) -> Vec<&str>;
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
    /// The state change and its event committed in one transaction; the event is in the outbox,
    /// pending for every subscriber.
    Committed {
        /// The flow that advanced.
        flow_id: String,
        /// The new event's seq: the flow's previous `last_seq` plus one.
        seq: i64,
        /// The new event's id (a UUIDv7 in 32 hex characters).
        event_id: String,
        /// The flow's state after the advance.
        state: String,
    },
    /// The request's `expected_seq` is not the flow's `last_seq`: someone else advanced it first.
    /// Nothing was written; read the flow and decide again.
    Stale {
        /// The flow asked for.
        flow_id: String,
        /// The seq the request said it last saw.
        expected_seq: i64,
        /// The flow's actual `last_seq`.
        current_seq: i64,
    },
    /// The machine does not allow moving the flow from its current state to `to_state`. Nothing was
    /// written.
    InvalidTransition {
        /// The flow asked for.
        flow_id: String,
        /// The state the flow is in (and stays in).
        current_state: String,
        /// The state the request asked for.
        to_state: String,
        /// The machine's reason for refusing.
        reason: String,
    },
}

impl AdvanceOutcome {
    /// The protocol word of this outcome (`committed`, `stale`, `invalid_transition`), as the JSON
    /// `outcome` tag and the CLI print it.
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
    if let Some(traceparent) = &request.traceparent {
        crate::envelope::validate_traceparent(traceparent)?;
    }
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
    /// The machine's name.
    pub const NAME: &'static str = "stream";
    /// The state of a stream flow from its first event on.
    pub const STATE: &'static str = "stream";
    /// The state of a stream without events (never stored: a flow row exists only after an
    /// event). Distinct from every other built-in state, so that machines served together do
    /// not collide.
    const INITIAL: &'static str = "stream.empty";
}

impl FlowMachine for StreamMachine {
    fn name(&self) -> &str {
        Self::NAME
    }

    fn states(&self) -> Vec<&str> {
        vec![Self::INITIAL, Self::STATE]
    }

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

/// A flow machine with typed data, input and event payloads: the user's own `serde` types.
/// Every `Machine` is a [`FlowMachine`]; the stored state, data and event payload stay JSON,
/// and the canonical content hash is taken over that JSON as for any other machine.
///
/// Input that does not decode into [`Machine::Input`] is bad input (`invalid_payload`, nothing
/// written); stored data that no longer decodes into [`Machine::Data`] answers
/// `invalid_transition` with the reason, never a panic.
///
/// ```
/// use serde::{Deserialize, Serialize};
/// use tidemark_core::flow::{Machine, Transition};
///
/// #[derive(Default, Serialize, Deserialize)]
/// struct Payment { amount: i64 }
/// #[derive(Deserialize)]
/// struct Authorize { amount: i64 }
/// #[derive(Serialize)]
/// struct Authorized { amount: i64 }
///
/// struct PaymentMachine;
/// impl Machine for PaymentMachine {
///     type Data = Payment;
///     type Input = Authorize;
///     type Event = Authorized;
///     const NAME: &'static str = "payment";
///     const STATES: &'static [&'static str] = &["payment.new", "authorized"];
///     fn decide(&self, from: &str, _data: &Payment, to: &str, input: Authorize)
///         -> Result<Transition<Payment, Authorized>, String> {
///         match (from, to) {
///             ("payment.new", "authorized") => Ok(Transition {
///                 data: Payment { amount: input.amount },
///                 event_type: "payment.authorized".into(),
///                 event: Authorized { amount: input.amount },
///             }),
///             _ => Err(format!("{from} -> {to} is not allowed")),
///         }
///     }
/// }
/// ```
pub trait Machine: Send + Sync + 'static {
    /// What a flow carries from one state to the next. A new flow starts with its `Default`.
    type Data: Serialize + DeserializeOwned + Default;
    /// What an advance request carries (the request's `input`).
    type Input: DeserializeOwned;
    /// The event payload a transition emits. It must serialise to a JSON object.
    type Event: Serialize;
    /// The machine's name (an identifier).
    const NAME: &'static str;
    /// Every state, the initial state first.
    const STATES: &'static [&'static str];

    /// The payload schema versions this machine emits (a request names one; default `[1]`).
    fn schema_versions(&self) -> &[u32] {
        &[1]
    }

    /// Input validation independent of the current state (bad input: nothing is written).
    fn validate(&self, _to_state: &str, _input: &Self::Input) -> Result<()> {
        Ok(())
    }

    /// Decide a transition from `from` (with the flow's `data`) to `to`. `Err(reason)` is the
    /// `invalid_transition` outcome.
    fn decide(
        &self,
        from: &str,
        data: &Self::Data,
        to: &str,
        input: Self::Input,
    ) -> std::result::Result<Transition<Self::Data, Self::Event>, String>;

    /// See [`FlowMachine::appends_at_any_seq`].
    fn appends_at_any_seq(&self) -> bool {
        false
    }
}

/// What a [`Machine`] decided: the flow's next data and the event to emit.
#[derive(Debug, Clone, PartialEq)]
pub struct Transition<D, E> {
    /// The flow's data in its next state.
    pub data: D,
    /// The event's type (an identifier, e.g. `payment.authorized`).
    pub event_type: String,
    /// The event's payload.
    pub event: E,
}

fn decode_input<M: Machine>(request: &AdvanceRequest) -> Result<M::Input> {
    M::Input::deserialize(&request.input)
        .map_err(|e| Error::invalid(codes::INVALID_PAYLOAD, format!("the input does not fit machine {}: {e}", M::NAME)))
}

impl<M: Machine> FlowMachine for M {
    fn name(&self) -> &str {
        M::NAME
    }

    fn states(&self) -> Vec<&str> {
        M::STATES.to_vec()
    }

    fn initial(&self) -> FlowState {
        let data = serde_json::to_value(M::Data::default()).unwrap_or(Value::Null);
        FlowState { state: M::STATES.first().copied().unwrap_or_default().to_string(), data }
    }

    fn validate(&self, request: &AdvanceRequest) -> Result<()> {
        if !M::STATES.contains(&request.to_state.as_str()) {
            return Err(Error::invalid(
                codes::UNKNOWN_STATE,
                format!("unknown {} state {:?}; states are {:?}", M::NAME, request.to_state, M::STATES),
            ));
        }
        if !self.schema_versions().contains(&request.schema_version) {
            return Err(Error::invalid(
                codes::INVALID_SCHEMA_VERSION,
                format!(
                    "machine {} emits schema {:?}, got {}",
                    M::NAME,
                    self.schema_versions(),
                    request.schema_version
                ),
            ));
        }
        let input = decode_input::<M>(request)?;
        Machine::validate(self, &request.to_state, &input)
    }

    fn decide(&self, current: &FlowState, request: &AdvanceRequest) -> std::result::Result<Decision, String> {
        let data = M::Data::deserialize(&current.data)
            .map_err(|e| format!("the flow's stored data does not fit machine {}: {e}", M::NAME))?;
        let input = decode_input::<M>(request).map_err(|e| e.to_string())?;
        let transition = Machine::decide(self, &current.state, &data, &request.to_state, input)?;
        let data =
            serde_json::to_value(&transition.data).map_err(|e| format!("the next data does not serialise: {e}"))?;
        let payload = serde_json::to_value(&transition.event)
            .map_err(|e| format!("the event payload does not serialise: {e}"))?;
        validate_id("event_type", &transition.event_type).map_err(|e| e.to_string())?;
        Ok(Decision {
            next: FlowState { state: request.to_state.clone(), data },
            event_type: transition.event_type,
            payload,
        })
    }

    fn appends_at_any_seq(&self) -> bool {
        Machine::appends_at_any_seq(self)
    }
}

/// Several machines served by one producer. A flow belongs to the machine whose state it is
/// in (machine states never collide: [`MachineSet::add`] refuses a machine that shares a state
/// name with another), and a flow without events to the machine of the state it is asked to
/// move to. A request to move a flow into another machine's state is `invalid_transition`.
#[derive(Clone, Default)]
pub struct MachineSet {
    machines: Vec<Arc<dyn FlowMachine>>,
    owner: BTreeMap<String, usize>,
}

/// What [`MachineSet::initial`] answers for a flow without events: no machine's state.
const NO_EVENTS_YET: &str = "";

impl MachineSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add a machine. Its name and states must be identifiers, its initial state one of its
    /// states, and neither its name nor any state may be another machine's
    /// (`already_exists`, `state_collision`).
    pub fn add(&mut self, machine: Arc<dyn FlowMachine>) -> Result<()> {
        let name = machine.name().to_string();
        validate_id("machine", &name)?;
        if self.get(&name).is_some() {
            return Err(Error::invalid(codes::ALREADY_EXISTS, format!("machine {name:?} is registered twice")));
        }
        let states: Vec<String> = machine.states().into_iter().map(str::to_string).collect();
        if states.is_empty() {
            return Err(Error::invalid(codes::INVALID_ARGUMENT, format!("machine {name:?} has no states")));
        }
        let initial = machine.initial().state;
        if !states.contains(&initial) {
            return Err(Error::invalid(
                codes::INVALID_ARGUMENT,
                format!("machine {name:?}: its initial state {initial:?} is not among its states {states:?}"),
            ));
        }
        let mut seen = BTreeSet::new();
        for state in &states {
            validate_id("state", state)?;
            if !seen.insert(state) {
                return Err(Error::invalid(
                    codes::INVALID_ARGUMENT,
                    format!("machine {name:?} lists state {state:?} twice"),
                ));
            }
            if let Some(other) = self.owner.get(state) {
                return Err(Error::invalid(
                    codes::STATE_COLLISION,
                    format!(
                        "machine {name:?} and machine {:?} both have state {state:?}: a flow's state must tell its machine",
                        self.machines[*other].name()
                    ),
                ));
            }
        }
        let index = self.machines.len();
        for state in states {
            self.owner.insert(state, index);
        }
        self.machines.push(machine);
        Ok(())
    }

    /// The machine named `name`.
    pub fn get(&self, name: &str) -> Option<&Arc<dyn FlowMachine>> {
        self.machines.iter().find(|m| m.name() == name)
    }

    /// The machine that has `state`.
    pub fn owner_of(&self, state: &str) -> Option<&Arc<dyn FlowMachine>> {
        self.owner.get(state).map(|i| &self.machines[*i])
    }

    /// The machines, in the order they were added.
    pub fn machines(&self) -> &[Arc<dyn FlowMachine>] {
        &self.machines
    }

    /// True when no machine was added.
    pub fn is_empty(&self) -> bool {
        self.machines.is_empty()
    }

    fn target(&self, request: &AdvanceRequest) -> Result<&Arc<dyn FlowMachine>> {
        self.owner_of(&request.to_state).ok_or_else(|| {
            let known: Vec<&str> = self.owner.keys().map(String::as_str).collect();
            Error::invalid(
                codes::UNKNOWN_STATE,
                format!("no machine has state {:?}; states are {known:?}", request.to_state),
            )
        })
    }
}

impl FlowMachine for MachineSet {
    fn name(&self) -> &str {
        "machines"
    }

    fn states(&self) -> Vec<&str> {
        self.owner.keys().map(String::as_str).collect()
    }

    fn initial(&self) -> FlowState {
        FlowState { state: NO_EVENTS_YET.into(), data: Value::Object(Default::default()) }
    }

    fn validate(&self, request: &AdvanceRequest) -> Result<()> {
        let machine = self.target(request)?;
        if request.expected_seq == APPEND_AT_ANY_SEQ && !machine.appends_at_any_seq() {
            return Err(Error::invalid(
                codes::INVALID_SEQ,
                format!("expected_seq must be >= 0, got {}", request.expected_seq),
            ));
        }
        machine.validate(request)
    }

    fn decide(&self, current: &FlowState, request: &AdvanceRequest) -> std::result::Result<Decision, String> {
        let target = self.target(request).map_err(|e| e.to_string())?;
        if current.state == NO_EVENTS_YET {
            return target.decide(&target.initial(), request);
        }
        let Some(owner) = self.owner_of(&current.state) else {
            return Err(format!(
                "flow {} is in state {:?}, which no registered machine has",
                request.flow_id, current.state
            ));
        };
        if !Arc::ptr_eq(owner, target) {
            return Err(format!(
                "flow {} is a {} flow (state {:?}); {:?} is a state of machine {}",
                request.flow_id,
                owner.name(),
                current.state,
                request.to_state,
                target.name()
            ));
        }
        owner.decide(current, request)
    }

    fn appends_at_any_seq(&self) -> bool {
        self.machines.iter().any(|m| m.appends_at_any_seq())
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
            traceparent: None,
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

    #[derive(Default, Serialize, Deserialize)]
    struct Count {
        n: i64,
    }
    #[derive(Deserialize)]
    struct By {
        by: i64,
    }
    #[derive(Serialize)]
    struct Added {
        n: i64,
    }

    /// counter.new -> counting (again and again).
    struct Counter;
    impl Machine for Counter {
        type Data = Count;
        type Input = By;
        type Event = Added;
        const NAME: &'static str = "counter";
        const STATES: &'static [&'static str] = &["counter.new", "counting"];
        fn validate(&self, _: &str, input: &By) -> Result<()> {
            if input.by < 1 {
                return Err(Error::invalid(codes::INVALID_PAYLOAD, "by must be >= 1"));
            }
            Ok(())
        }
        fn decide(
            &self,
            _: &str,
            data: &Count,
            _: &str,
            input: By,
        ) -> std::result::Result<Transition<Count, Added>, String> {
            let n = data.n + input.by;
            Ok(Transition { data: Count { n }, event_type: "counter.added".into(), event: Added { n } })
        }
    }

    fn count(expected_seq: i64, input: Value) -> AdvanceRequest {
        AdvanceRequest::new("c1", expected_seq, "counting", input)
    }

    #[test]
    fn a_typed_machine_decodes_its_input_and_data_and_never_panics_on_bad_json() {
        let initial = FlowMachine::initial(&Counter);
        assert_eq!(initial, FlowState { state: "counter.new".into(), data: json!({"n": 0}) });
        let (seq, decision) = decide_advance(&Counter, 0, &initial, &count(0, json!({"by": 2}))).unwrap().unwrap();
        assert_eq!((seq, decision.payload.clone(), decision.next.data.clone()), (1, json!({"n": 2}), json!({"n": 2})));
        // Input of another shape is bad input, refused before any transaction; so is one the
        // machine's own check refuses, and a state it does not have.
        for (bad, code) in [
            (count(0, json!({"by": "two"})), codes::INVALID_PAYLOAD),
            (count(0, json!([])), codes::INVALID_PAYLOAD),
            (count(0, json!({"by": 0})), codes::INVALID_PAYLOAD),
            (AdvanceRequest::new("c1", 0, "stopped", json!({"by": 1})), codes::UNKNOWN_STATE),
            (AdvanceRequest { schema_version: 2, ..count(0, json!({"by": 1})) }, codes::INVALID_SCHEMA_VERSION),
        ] {
            assert_eq!(validate_request(&Counter, &bad).unwrap_err().code(), code, "{bad:?}");
        }
        // Stored data that no longer fits the type is an answer (invalid_transition), not a panic.
        let corrupt = FlowState { state: "counting".into(), data: json!({"n": "many"}) };
        let outcome = decide_advance(&Counter, 3, &corrupt, &count(3, json!({"by": 1}))).unwrap();
        assert!(
            matches!(outcome, Err(AdvanceOutcome::InvalidTransition { ref reason, .. }) if reason.contains("stored data")),
            "{outcome:?}"
        );
    }

    #[test]
    fn a_machine_set_routes_by_state_and_keeps_each_flow_in_its_machine() {
        let mut set = MachineSet::new();
        set.add(Arc::new(StreamMachine)).unwrap();
        set.add(Arc::new(Counter)).unwrap();
        set.add(Arc::new(crate::reservation::ReservationMachine)).unwrap();
        // A flow without events goes to the machine of the state it is asked to move to.
        let none = set.initial();
        let (_, counted) = decide_advance(&set, 0, &none, &count(0, json!({"by": 1}))).unwrap().unwrap();
        assert_eq!(counted.event_type, "counter.added");
        let reserve = AdvanceRequest::new("r1", 0, "reserved", json!({"quantity": 2}));
        validate_request(&set, &reserve).unwrap();
        let (_, reserved) = decide_advance(&set, 0, &none, &reserve).unwrap().unwrap();
        assert_eq!(reserved.event_type, "reservation.reserved");
        // A flow with events stays in its machine: another machine's state is an answer.
        let into_other = AdvanceRequest::new("c1", 1, "reserved", json!({"quantity": 2}));
        match decide_advance(&set, 1, &counted.next, &into_other).unwrap() {
            Err(AdvanceOutcome::InvalidTransition { reason, .. }) => {
                assert!(reason.contains("counter flow"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        let unknown = FlowState { state: "retired".into(), data: json!({}) };
        assert!(matches!(
            decide_advance(&set, 1, &unknown, &count(1, json!({"by": 1}))).unwrap(),
            Err(AdvanceOutcome::InvalidTransition { .. })
        ));
        // Streams append at any seq; the other machines do not.
        assert_eq!(
            validate_request(&set, &AdvanceRequest::new("c1", APPEND_AT_ANY_SEQ, "counting", json!({"by": 1})))
                .unwrap_err()
                .code(),
            codes::INVALID_SEQ
        );
        assert_eq!(
            validate_request(&set, &AdvanceRequest::new("x", 0, "nowhere", json!({}))).unwrap_err().code(),
            codes::UNKNOWN_STATE
        );
        // Collisions and duplicates are refused when the set is built.
        assert_eq!(set.add(Arc::new(Counter)).unwrap_err().code(), codes::ALREADY_EXISTS);
        struct Clash;
        impl Machine for Clash {
            type Data = Count;
            type Input = By;
            type Event = Added;
            const NAME: &'static str = "clash";
            const STATES: &'static [&'static str] = &["clash.new", "counting"];
            fn decide(
                &self,
                _: &str,
                _: &Count,
                _: &str,
                _: By,
            ) -> std::result::Result<Transition<Count, Added>, String> {
                Err("never".into())
            }
        }
        assert_eq!(set.add(Arc::new(Clash)).unwrap_err().code(), codes::STATE_COLLISION);
    }
}
