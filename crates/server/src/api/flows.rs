//! Producer routes: advance a reservation flow, append to an event stream, read a flow with each
//! consumer's high-water mark, and the outbox (backlog, quarantine, requeue/dismiss, redeliver).

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use tidemark_core::envelope::parse_traceparent;
use tidemark_core::error::codes;
use tidemark_core::flow::{AdvanceOutcome, AdvanceRequest, MachineSet, StreamMachine, APPEND_AT_ANY_SEQ};
use tidemark_core::id::{validate_id, validate_reason};
use tidemark_core::store::{
    ConsumerStore, DeliveryAction, DeliveryEntry, DeliveryStatus, FlowRecord, InboxEntry, InboxStatus, ProducerStore,
};
use tidemark_core::tenancy::Scope;
use tidemark_core::Error;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::{answer, page_size, typed, ApiError, ApiResult, ErrorBody, Json, Path, Query};
use crate::AnyCaller;
use crate::{now_ms, AppState};

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(flow))
        .routes(routes!(advance))
        .routes(routes!(append))
        .routes(routes!(outbox))
        .routes(routes!(resolve))
        .routes(routes!(redeliver))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"expected_seq": 0, "to": "reserved", "input": {"quantity": 3}}))]
pub struct AdvanceBody {
    /// The seq last seen (0 for a new flow).
    #[schema(minimum = 0)]
    #[serde(deserialize_with = "tidemark_core::json::integer")]
    pub expected_seq: i64,
    /// The state to move to: a state of a registered machine (`GET /v1/registry`). It tells
    /// which machine decides.
    #[schema(value_type = StateName)]
    pub to: String,
    /// The machine's input (a JSON object; default `{}`).
    #[schema(value_type = Option<Object>)]
    pub input: Option<Value>,
    /// The machine the flow belongs to. Optional (`to` tells it); when given, `to` must be one
    /// of its states.
    #[schema(value_type = Option<MachineName>)]
    pub machine: Option<String>,
    /// Shorthand for `input.quantity` (the built-in reservation machine: 1..=1,000,000,
    /// required to reserve, optional later, must match).
    #[schema(minimum = 1, maximum = 1_000_000)]
    #[serde(default, deserialize_with = "tidemark_core::json::optional_integer")]
    pub quantity: Option<i64>,
    /// Payload schema of the event (the machine says which it emits; the reservation machine
    /// 1 (`amount`) or 2 (`units`)). Default 1.
    #[serde(default = "one", deserialize_with = "tidemark_core::json::integer")]
    #[schema(default = 1, minimum = 1, maximum = 2)]
    pub schema_version: u32,
}

fn one() -> u32 {
    1
}

/// A state of a registered machine (documentation of `AdvanceBody::to`; the served document
/// lists this server's states).
#[derive(ToSchema)]
#[schema(pattern = "^[A-Za-z0-9_.:-]{1,100}$")]
#[allow(dead_code)]
pub struct StateName(String);

/// A registered machine's name (documentation of `AdvanceBody::machine`; the served document
/// lists this server's machines but the event stream's, which `POST /v1/streams/{flow_id}/events`
/// advances).
#[derive(ToSchema)]
#[schema(pattern = "^[A-Za-z0-9_.:-]{1,100}$")]
#[allow(dead_code)]
pub struct MachineName(String);

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"event_type": "note.added", "payload": {"text": "hello"}}))]
pub struct AppendBody {
    #[schema(pattern = "^[A-Za-z0-9_.:-]{1,100}$")]
    pub event_type: String,
    /// A JSON object (at most 64 KiB, see docs/api.md).
    #[schema(value_type = Object)]
    pub payload: Value,
    /// Optimistic concurrency: the seq last seen. Absent: append at whatever seq is next.
    #[schema(minimum = 0)]
    #[serde(default, deserialize_with = "tidemark_core::json::optional_integer")]
    pub expected_seq: Option<i64>,
}

/// 200 for `committed`; 409 with the outcome for `stale` and `invalid_transition` (answers,
/// not errors: nothing was written).
fn advanced(outcome: AdvanceOutcome) -> Response {
    let status =
        if matches!(outcome, AdvanceOutcome::Committed { .. }) { StatusCode::OK } else { StatusCode::CONFLICT };
    answer(status, serde_json::to_value(&outcome).expect("outcomes serialise"))
}

async fn submit(caller: &AnyCaller, request: AdvanceRequest) -> ApiResult {
    crate::on_tenant!(&caller.tenant, tenant => {
        // Validated before it is queued, so a bad request never reaches (or fails) a group commit.
        let outcome = tenant.advance(request).await?;
        Ok(advanced(outcome))
    })
}

/// The trace context the committed event carries: with the `otel` feature and spans exported,
/// the request's own span (a child of the caller's `traceparent` when it sent one); otherwise
/// the request's W3C `traceparent` header when it is a valid one (version 00). A malformed or
/// repeated header is ignored, as W3C Trace Context asks of a receiver.
fn traceparent_of(headers: &HeaderMap) -> Option<String> {
    let given = || {
        let mut values = headers.get_all("traceparent").iter();
        let value = values.next()?.to_str().ok()?.trim();
        if values.next().is_some() {
            return None;
        }
        parse_traceparent(value).map(|_| value.to_string())
    };
    crate::trace::current().or_else(given)
}

/// The advance's input: `input` (an object) with the `quantity` shorthand merged in.
fn advance_input(body: &AdvanceBody) -> Result<Value, Error> {
    let mut input = match &body.input {
        None => Map::new(),
        Some(Value::Object(object)) => object.clone(),
        Some(_) => return Err(Error::invalid(codes::INVALID_PAYLOAD, "input must be a JSON object")),
    };
    if let Some(quantity) = body.quantity {
        match input.get("quantity") {
            Some(given) if given != &json!(quantity) => {
                return Err(Error::invalid(
                    codes::INVALID_ARGUMENT,
                    "quantity and input.quantity differ; give one of them",
                ))
            }
            _ => {
                input.insert("quantity".into(), json!(quantity));
            }
        }
    }
    Ok(Value::Object(input))
}

/// Move a flow of a registered machine to its next state and commit the event to the outbox,
/// in one transaction (group-committed with concurrent requests).
#[utoipa::path(
    post,
    path = "/v1/flows/{flow_id}/advance",
    tag = "flows",
    params(
        ("flow_id" = String, Path, description = "The flow (an id: 1..=100 of A-Z a-z 0-9 _ - . :)"),
        ("traceparent" = Option<String>, Header, description = "W3C trace context (`00-<32 hex>-<16 hex>-<2 hex>`): the committed event carries it to its consumers; a malformed one is ignored, as W3C Trace Context says"),
    ),
    request_body = AdvanceBody,
    responses(
        (status = 200, description = "`committed`", body = AdvanceOutcome),
        (status = 400, description = "`unknown_machine` or `unknown_state` (a `machine` or `to` this service does not register, or a `to` of another machine than `machine`), `invalid_payload` (an `input` the machine does not take), `invalid_schema_version`, `invalid_seq`, `seq_overflow` (the flow is at the last seq), and the machine's own checks (the reservation machine's `invalid_quantity`)", body = ErrorBody),
        (status = 409, description = "`stale` or `invalid_transition`: an answer, nothing written", body = AdvanceOutcome),
    ),
    security(("bearer" = ["operate"]))
)]
async fn advance(
    caller: AnyCaller,
    headers: HeaderMap,
    Path(flow_id): Path<String>,
    Json(body): Json<AdvanceBody>,
) -> ApiResult {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Operate)?;
        let mut request = body.request(flow_id, &tenant.machines)?;
        request.traceparent = traceparent_of(&headers);
        submit(&caller, request).await
    })
}

impl AdvanceBody {
    /// The advance this body asks for, checked against `machines` (the stream's state and a
    /// `machine` that does not own `to` are refused here; [`Tenant::advance`] checks the rest
    /// with `tidemark_core::flow::validate_request`).
    ///
    /// [`Tenant::advance`]: crate::Tenant::advance
    pub fn request(self, flow_id: String, machines: &MachineSet) -> Result<AdvanceRequest, Error> {
        if self.to == StreamMachine::STATE {
            return Err(Error::invalid(
                codes::UNKNOWN_STATE,
                "append to a stream with POST /v1/streams/{flow_id}/events",
            ));
        }
        if let Some(name) = &self.machine {
            validate_id("machine", name)?;
            let machine = machines.get(name).ok_or_else(|| {
                let known: Vec<&str> = machines.machines().iter().map(|m| m.name()).collect();
                Error::invalid(codes::UNKNOWN_MACHINE, format!("no machine {name:?}; machines are {known:?}"))
            })?;
            if !machine.states().contains(&self.to.as_str()) {
                return Err(Error::invalid(
                    codes::UNKNOWN_STATE,
                    format!("{:?} is not a state of machine {name}; its states are {:?}", self.to, machine.states()),
                ));
            }
        }
        let input = advance_input(&self)?;
        Ok(AdvanceRequest {
            flow_id,
            expected_seq: self.expected_seq,
            to_state: self.to,
            input,
            schema_version: self.schema_version,
            traceparent: None,
        })
    }
}

/// Append an event to a plain event stream (a flow whose state is `stream`).
#[utoipa::path(
    post,
    path = "/v1/streams/{flow_id}/events",
    tag = "flows",
    params(
        ("flow_id" = String, Path, description = "The stream"),
        ("traceparent" = Option<String>, Header, description = "W3C trace context: the event carries it to its consumers (a malformed one is ignored)"),
    ),
    request_body = AppendBody,
    responses(
        (status = 200, description = "`committed`", body = AdvanceOutcome),
        (status = 400, description = "`invalid_seq` (a negative `expected_seq`), `invalid_payload`, `seq_overflow` (the stream is at the last seq)", body = ErrorBody),
        (status = 409, description = "`stale` (with `expected_seq`) or `invalid_transition` (the flow is a reservation)", body = AdvanceOutcome),
    ),
    security(("bearer" = ["operate"]))
)]
async fn append(
    caller: AnyCaller,
    headers: HeaderMap,
    Path(flow_id): Path<String>,
    Json(body): Json<AppendBody>,
) -> ApiResult {
    caller.require(Scope::Operate)?;
    let mut request = body.request(flow_id)?;
    request.traceparent = traceparent_of(&headers);
    submit(&caller, request).await
}

impl AppendBody {
    /// The append this body asks for: an advance of the stream machine (`expected_seq` below 0
    /// is `invalid_seq`; absent, the append goes at whatever seq is next).
    pub fn request(self, flow_id: String) -> Result<AdvanceRequest, Error> {
        let expected_seq = match self.expected_seq {
            Some(seq) if seq < 0 => {
                return Err(Error::invalid(codes::INVALID_SEQ, format!("expected_seq must be >= 0, got {seq}")))
            }
            Some(seq) => seq,
            None => APPEND_AT_ANY_SEQ,
        };
        Ok(AdvanceRequest {
            flow_id,
            expected_seq,
            to_state: StreamMachine::STATE.into(),
            input: json!({"event_type": self.event_type, "payload": self.payload}),
            schema_version: 1,
            traceparent: None,
        })
    }
}

/// A flow as one consumer sees it.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FlowConsumer {
    pub consumer_id: String,
    pub handler: String,
    /// Every seq up to this one is applied (or skipped).
    pub high_water_seq: i64,
    /// Its records of this flow above the high-water mark (pending or blocked).
    pub open: Vec<InboxEntry>,
}

/// A flow: the producer's record and each consumer's position.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FlowView {
    pub flow_id: String,
    /// The tenant's producer namespace (the tenant id).
    pub source: String,
    /// Absent (null) when the producer has no such flow but a consumer has seen it.
    pub producer: Option<FlowRecord>,
    /// The machine whose state the flow is in (null when the producer has no such flow).
    pub machine: Option<String>,
    pub consumers: Vec<FlowConsumer>,
}

/// A flow: its producer state and seq, and each consumer's high-water mark and open records.
#[utoipa::path(
    get,
    path = "/v1/flows/{flow_id}",
    tag = "flows",
    params(("flow_id" = String, Path, description = "The flow")),
    responses(
        (status = 200, body = FlowView),
        (status = 404, description = "`not_found`: neither the producer nor a consumer knows the flow", body = ErrorBody),
    ),
    security(("bearer" = ["read"]))
)]
async fn flow(State(state): State<AppState>, caller: AnyCaller, Path(flow_id): Path<String>) -> ApiResult {
    let view = flow_view(&state, &caller, flow_id).await?;
    Ok(typed(StatusCode::OK, view))
}

/// What `GET /v1/flows/{flow_id}` answers (shared with the dashboard).
pub(crate) async fn flow_view(state: &AppState, caller: &AnyCaller, flow_id: String) -> Result<FlowView, ApiError> {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Read)?;
        validate_id("flow_id", &flow_id)?;
        let tenant = tenant.clone();
        // The producer's flow, else a flow of the workflow database's outbox (the flows that
        // transactional steps advance).
        let id = flow_id.clone();
        let mut record = tenant.producer.call(move |p| p.store.flow(&id)).await?;
        let mut source = tenant.id.clone();
        if record.is_none() {
            let id = flow_id.clone();
            record = tenant.runs_outbox.call(move |p| p.store.flow(&id)).await?;
            if record.is_some() {
                source = crate::tenant::workflow_source(&tenant.id);
            }
        }
        let mut consumers = Vec::new();
        for consumer in state.consumers(&tenant.id)? {
            let database = state.registry.handler_database(&consumer.handler)?;
            let (id, cid, src) = (flow_id.clone(), consumer.consumer_id.clone(), source.clone());
            let (high_water_seq, open) = tenant
                .inbox_of(database)?
                .call(move |t| {
                    let high = t
                        .store
                        .cursors(Some(&cid))?
                        .into_iter()
                        .find(|c| c.source == src && c.flow_id == id)
                        .map_or(0, |c| c.high_water_seq);
                    // Open records are pending or blocked: read only those (not the applied history,
                    // which would crowd them out of the page).
                    let mut open = Vec::new();
                    for status in [InboxStatus::Pending, InboxStatus::Blocked] {
                        open.extend(
                            t.store
                                .inbox(&cid, Some(status), tidemark_core::limits::PAGE_SIZE_MAX)?
                                .into_iter()
                                .filter(|r| r.envelope.source == src && r.envelope.flow_id == id && r.envelope.seq > high),
                        );
                    }
                    open.sort_by_key(|r| r.envelope.seq);
                    Ok((high, open))
                })
                .await?;
            consumers.push(FlowConsumer {
                consumer_id: consumer.consumer_id,
                handler: consumer.handler,
                high_water_seq,
                open,
            });
        }
        if record.is_none() && consumers.iter().all(|c| c.high_water_seq == 0) {
            return Err(Error::not_found(format!("no flow {flow_id:?}")).into());
        }
        let machine = record.as_ref().and_then(|r| tenant.machines.owner_of(&r.state.state)).map(|m| m.name().to_string());
        Ok(FlowView { flow_id, source, producer: record, machine, consumers })
    })
}

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct OutboxQuery {
    /// pending (the backlog), accepted, quarantined or dismissed. Default: every status.
    #[param(value_type = Option<DeliveryStatus>)]
    pub status: Option<String>,
    /// Page size, 1..=page_size_max (default 100).
    #[param(minimum = 1)]
    #[serde(default, deserialize_with = "super::query_integer")]
    pub limit: Option<usize>,
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DeliveriesPage {
    pub deliveries: Vec<DeliveryEntry>,
}

/// Outbox deliveries (one per event and subscribed consumer), optionally by status.
#[utoipa::path(
    get,
    path = "/v1/outbox",
    tag = "flows",
    params(OutboxQuery),
    responses((status = 200, body = DeliveriesPage)),
    security(("bearer" = ["read"]))
)]
async fn outbox(State(state): State<AppState>, caller: AnyCaller, Query(query): Query<OutboxQuery>) -> ApiResult {
    let deliveries = deliveries(&state, &caller, query).await?;
    Ok(typed(StatusCode::OK, DeliveriesPage { deliveries }))
}

/// The outbox's deliveries, by status (shared with the dashboard).
pub(crate) async fn deliveries(
    state: &AppState,
    caller: &AnyCaller,
    query: OutboxQuery,
) -> Result<Vec<DeliveryEntry>, ApiError> {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Read)?;
        let status = query
            .status
            .map(|s| {
                DeliveryStatus::parse(&s)
                    .ok_or_else(|| Error::invalid(codes::INVALID_ARGUMENT, format!("unknown delivery status {s:?}")))
            })
            .transpose()?;
        let limit = page_size(state, query.limit)?;
        // Both outboxes (the producer's, then the workflow database's), at most `limit` in all.
        let mut all = Vec::new();
        for outbox in tenant.outboxes() {
            let left = limit - all.len();
            if left == 0 {
                break;
            }
            all.extend(outbox.call(move |p| p.store.deliveries(status, left)).await?);
        }
        Ok(all)
    })
}

/// Run `operation` on the outbox that knows the event: the producer's, else the workflow
/// database's (event ids are unique across both). The second outbox's `not_found` is the answer
/// when neither knows it.
async fn on_the_outbox_of_the_event<T, F>(caller: &AnyCaller, operation: F) -> Result<T, Error>
where
    T: Send + 'static,
    F: Fn(&mut dyn ProducerStore) -> Result<T, Error> + Clone + Send + 'static,
{
    crate::on_tenant!(&caller.tenant, tenant => {
        let [producer, runs_outbox] = tenant.outboxes();
        let first = operation.clone();
        match producer.call(move |p| first(&mut p.store)).await {
            Err(error) if error.code() == codes::NOT_FOUND => runs_outbox.call(move |p| operation(&mut p.store)).await,
            answer => answer,
        }
    })
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"action": "requeue", "reason": "consumer fixed"}))]
pub struct ResolveBody {
    /// requeue (deliver again now, attempts reset) or dismiss (stop delivering; never an ack).
    pub action: DeliveryAction,
    /// Recorded with the decision (1..=1000 bytes).
    #[schema(min_length = 1, max_length = 1000, pattern = "\\S")]
    pub reason: String,
}

impl ResolveBody {
    /// The reason is 1..=1,000 bytes with a non-blank character (`invalid_argument`).
    pub fn check(&self) -> Result<(), Error> {
        validate_reason(&self.reason)
    }
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Resolved {
    /// `resolved`.
    #[schema(example = "resolved")]
    pub outcome: String,
    pub delivery: DeliveryEntry,
}

/// Requeue or dismiss a quarantined (or pending) delivery, with a reason.
#[utoipa::path(
    post,
    path = "/v1/outbox/{event_id}/{consumer_id}/resolve",
    tag = "flows",
    params(
        ("event_id" = String, Path, description = "The event"),
        ("consumer_id" = String, Path, description = "The subscriber"),
    ),
    request_body = ResolveBody,
    responses(
        (status = 200, body = Resolved),
        (status = 404, description = "`not_found`: no such delivery", body = ErrorBody),
        (status = 409, description = "`invalid_state_change`: the delivery is already accepted or dismissed", body = ErrorBody),
    ),
    security(("bearer" = ["operate"]))
)]
async fn resolve(
    caller: AnyCaller,
    Path((event_id, consumer_id)): Path<(String, String)>,
    Json(body): Json<ResolveBody>,
) -> ApiResult {
    let entry = resolve_delivery(&caller, event_id, consumer_id, body).await?;
    Ok(typed(StatusCode::OK, Resolved { outcome: "resolved".into(), delivery: entry }))
}

/// Requeue or dismiss a delivery (shared with the dashboard).
pub(crate) async fn resolve_delivery(
    caller: &AnyCaller,
    event_id: String,
    consumer_id: String,
    body: ResolveBody,
) -> Result<DeliveryEntry, ApiError> {
    caller.require(Scope::Operate)?;
    validate_id("event_id", &event_id)?;
    validate_id("consumer_id", &consumer_id)?;
    body.check()?;
    let action = body.action;
    Ok(on_the_outbox_of_the_event(caller, move |store| {
        store.resolve_delivery(&event_id, &consumer_id, action, &body.reason, now_ms())
    })
    .await?)
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"all": true}))]
pub struct RedeliverBody {
    /// The first event to send again (it and every later event the outbox holds). Exactly one
    /// of `from_event` and `all`.
    #[schema(pattern = "^[A-Za-z0-9_.:-]{1,100}$")]
    pub from_event: Option<String>,
    /// `true`: from the oldest event the outbox holds. Exactly one of `from_event` and `all`.
    pub all: Option<bool>,
}

impl RedeliverBody {
    /// The first event to send again (`None`: from the oldest): exactly one of `from_event` (an
    /// id) and `all: true`, else `invalid_argument`.
    pub fn first_event(self) -> Result<Option<String>, Error> {
        match (self.from_event, self.all) {
            (Some(event_id), None) => {
                validate_id("event_id", &event_id)?;
                Ok(Some(event_id))
            }
            (None, Some(true)) => Ok(None),
            _ => Err(Error::invalid(
                codes::INVALID_ARGUMENT,
                "give exactly one of {\"from_event\": \"<event id>\"} and {\"all\": true}",
            )),
        }
    }
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Redelivered {
    /// `redelivered`.
    #[schema(example = "redelivered")]
    pub outcome: String,
    pub consumer_id: String,
    /// The subscriber's deliveries now pending again.
    #[schema(minimum = 0)]
    pub redelivered: u64,
    /// Positions in the range whose events were already pruned: they cannot be sent again.
    #[schema(minimum = 0)]
    pub pruned: u64,
}

/// Hand a subscriber every event the outbox still holds again, from one event on or from the
/// oldest: its deliveries there become pending as if never attempted (accepted, quarantined
/// and dismissed alike), in one transaction. For a consumer restored from a backup: it answers
/// `duplicate` for what it still holds and accepts what it lost.
#[utoipa::path(
    post,
    path = "/v1/outbox/redeliver/{consumer_id}",
    tag = "flows",
    params(("consumer_id" = String, Path, description = "The subscriber")),
    request_body = RedeliverBody,
    responses(
        (status = 200, body = Redelivered),
        (status = 404, description = "`not_found`: no such subscriber, or the outbox holds no such event", body = ErrorBody),
    ),
    security(("bearer" = ["operate"]))
)]
async fn redeliver(caller: AnyCaller, Path(consumer_id): Path<String>, Json(body): Json<RedeliverBody>) -> ApiResult {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Operate)?;
        validate_id("consumer_id", &consumer_id)?;
        let from_event = body.first_event()?;
        let id = consumer_id.clone();
        let report = match from_event {
            // From one event on: in the outbox that holds it.
            Some(event_id) => on_the_outbox_of_the_event(&caller, move |store| store.redeliver(&id, Some(&event_id))).await?,
            // Everything: both outboxes (a subscriber of either one).
            None => {
                let mut total = tidemark_core::store::RedeliverReport::default();
                let mut subscribed = false;
                for outbox in tenant.outboxes() {
                    let id = id.clone();
                    match outbox.call(move |p| p.store.redeliver(&id, None)).await {
                        Ok(report) => {
                            subscribed = true;
                            total.redelivered += report.redelivered;
                            total.pruned += report.pruned;
                        }
                        Err(error) if error.code() == codes::NOT_FOUND => {}
                        Err(error) => return Err(error.into()),
                    }
                }
                if !subscribed {
                    return Err(Error::not_found(format!("no subscriber {consumer_id:?}")).into());
                }
                total
            }
        };
        Ok(typed(
            StatusCode::OK,
            Redelivered {
                outcome: "redelivered".into(),
                consumer_id,
                redelivered: report.redelivered,
                pruned: report.pruned,
            },
        ))
    })
}
