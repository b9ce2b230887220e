//! Producer routes: advance a reservation flow, append to an event stream, read a flow with each
//! consumer's high-water mark, and the outbox (backlog, quarantine, requeue/dismiss).

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use tidemark_core::error::codes;
use tidemark_core::flow::{validate_request, AdvanceOutcome, AdvanceRequest, StreamMachine, APPEND_AT_ANY_SEQ};
use tidemark_core::id::{validate_id, validate_reason};
use tidemark_core::store::{
    ConsumerStore, DeliveryAction, DeliveryEntry, DeliveryStatus, FlowRecord, InboxEntry, ProducerStore,
};
use tidemark_core::tenancy::Scope;
use tidemark_core::Error;

use super::{answer, page_size, ApiError, ApiResult, Json, Path, Query};
use crate::auth::Caller;
use crate::tenant::{HandlerKind, TenantMachine};
use crate::{now_ms, AppState};

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/flows/{flow_id}", get(flow))
        .route("/v1/flows/{flow_id}/advance", post(advance))
        .route("/v1/streams/{flow_id}/events", post(append))
        .route("/v1/outbox", get(outbox))
        .route("/v1/outbox/{event_id}/{consumer_id}/resolve", post(resolve))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdvanceBody {
    /// The seq last seen (0 for a new flow).
    pub expected_seq: i64,
    /// reserved, confirmed or released.
    pub to: String,
    pub quantity: Option<i64>,
    #[serde(default = "one")]
    pub schema_version: u32,
}

fn one() -> u32 {
    1
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AppendBody {
    pub event_type: String,
    pub payload: Value,
    /// Optimistic concurrency: the seq last seen. Absent: append at whatever seq is next.
    pub expected_seq: Option<i64>,
}

/// 200 for `committed`; 409 with the outcome for `stale` and `invalid_transition` (answers,
/// not errors: nothing was written).
fn advanced(outcome: AdvanceOutcome) -> Response {
    let status =
        if matches!(outcome, AdvanceOutcome::Committed { .. }) { StatusCode::OK } else { StatusCode::CONFLICT };
    answer(status, serde_json::to_value(&outcome).expect("outcomes serialise"))
}

async fn submit(caller: &Caller, request: AdvanceRequest) -> ApiResult {
    // Validated here, so a bad request never reaches (or fails) a group commit.
    validate_request(&TenantMachine, &request)?;
    let outcome = caller.tenant.producer.submit(request).await?;
    Ok(advanced(outcome))
}

async fn advance(caller: Caller, Path(flow_id): Path<String>, Json(body): Json<AdvanceBody>) -> ApiResult {
    caller.require(Scope::Operate)?;
    let mut input = Map::new();
    if let Some(quantity) = body.quantity {
        input.insert("quantity".into(), json!(quantity));
    }
    if body.to == StreamMachine::STATE {
        return Err(
            Error::invalid(codes::UNKNOWN_STATE, "append to a stream with POST /v1/streams/{flow_id}/events").into()
        );
    }
    let request = AdvanceRequest {
        flow_id,
        expected_seq: body.expected_seq,
        to_state: body.to,
        input: Value::Object(input),
        schema_version: body.schema_version,
    };
    submit(&caller, request).await
}

async fn append(caller: Caller, Path(flow_id): Path<String>, Json(body): Json<AppendBody>) -> ApiResult {
    caller.require(Scope::Operate)?;
    let expected_seq = match body.expected_seq {
        Some(seq) if seq < 0 => {
            return Err(Error::invalid(codes::INVALID_SEQ, format!("expected_seq must be >= 0, got {seq}")).into())
        }
        Some(seq) => seq,
        None => APPEND_AT_ANY_SEQ,
    };
    let request = AdvanceRequest {
        flow_id,
        expected_seq,
        to_state: StreamMachine::STATE.into(),
        input: json!({"event_type": body.event_type, "payload": body.payload}),
        schema_version: 1,
    };
    submit(&caller, request).await
}

/// A flow: its producer state and seq, and each consumer's high-water mark and open records.
async fn flow(State(state): State<AppState>, caller: Caller, Path(flow_id): Path<String>) -> ApiResult {
    let view = flow_view(&state, &caller, flow_id).await?;
    Ok(answer(StatusCode::OK, serde_json::to_value(&view).expect("flows serialise")))
}

/// What `GET /v1/flows/{flow_id}` answers (shared with the dashboard).
#[derive(Debug, Serialize)]
pub(crate) struct FlowView {
    pub flow_id: String,
    pub source: String,
    pub producer: Option<FlowRecord>,
    pub consumers: Vec<ConsumerPosition>,
}

/// A consumer's position in one flow: everything up to `high_water_seq` is applied (or
/// skipped); `open` are its records above it (pending or blocked).
#[derive(Debug, Serialize)]
pub(crate) struct ConsumerPosition {
    pub consumer_id: String,
    pub handler: String,
    pub high_water_seq: i64,
    pub open: Vec<InboxEntry>,
}

pub(crate) async fn flow_view(state: &AppState, caller: &Caller, flow_id: String) -> Result<FlowView, ApiError> {
    caller.require(Scope::Read)?;
    validate_id("flow_id", &flow_id)?;
    let tenant = caller.tenant.clone();
    let id = flow_id.clone();
    let record = tenant.producer.call(move |p| p.store.flow(&id)).await?;
    let source = tenant.id.clone();
    let mut consumers = Vec::new();
    for consumer in state.control(|c| c.consumers(Some(&tenant.id)))? {
        let kind = HandlerKind::parse(&consumer.handler)?;
        let (id, cid, src) = (flow_id.clone(), consumer.consumer_id.clone(), source.clone());
        let (high_water_seq, open) = tenant
            .inbox_of(kind.inbox())
            .call(move |t| {
                let high = t
                    .store
                    .cursors(Some(&cid))?
                    .into_iter()
                    .find(|c| c.source == src && c.flow_id == id)
                    .map_or(0, |c| c.high_water_seq);
                let open: Vec<_> = t
                    .store
                    .inbox(&cid, None, tidemark_core::limits::PAGE_SIZE_MAX)?
                    .into_iter()
                    .filter(|r| r.envelope.source == src && r.envelope.flow_id == id && r.envelope.seq > high)
                    .collect();
                Ok((high, open))
            })
            .await?;
        consumers.push(ConsumerPosition {
            consumer_id: consumer.consumer_id,
            handler: consumer.handler,
            high_water_seq,
            open,
        });
    }
    if record.is_none() && consumers.iter().all(|c| c.high_water_seq == 0) {
        return Err(Error::not_found(format!("no flow {flow_id:?}")).into());
    }
    Ok(FlowView { flow_id, source, producer: record, consumers })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutboxQuery {
    /// pending (the backlog), accepted, quarantined or dismissed.
    pub status: Option<String>,
    pub limit: Option<usize>,
}

async fn outbox(State(state): State<AppState>, caller: Caller, Query(query): Query<OutboxQuery>) -> ApiResult {
    let deliveries = deliveries(&state, &caller, query).await?;
    Ok(answer(StatusCode::OK, json!({"deliveries": deliveries})))
}

/// The outbox's deliveries, by status (shared with the dashboard).
pub(crate) async fn deliveries(
    state: &AppState,
    caller: &Caller,
    query: OutboxQuery,
) -> Result<Vec<DeliveryEntry>, ApiError> {
    caller.require(Scope::Read)?;
    let status = query
        .status
        .map(|s| {
            DeliveryStatus::parse(&s)
                .ok_or_else(|| Error::invalid(codes::INVALID_ARGUMENT, format!("unknown delivery status {s:?}")))
        })
        .transpose()?;
    let limit = page_size(state, query.limit)?;
    Ok(caller.tenant.producer.call(move |p| p.store.deliveries(status, limit)).await?)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResolveBody {
    /// requeue or dismiss.
    pub action: DeliveryAction,
    pub reason: String,
}

async fn resolve(
    caller: Caller,
    Path((event_id, consumer_id)): Path<(String, String)>,
    Json(body): Json<ResolveBody>,
) -> ApiResult {
    let entry = resolve_delivery(&caller, event_id, consumer_id, body).await?;
    Ok(answer(StatusCode::OK, json!({"outcome": "resolved", "delivery": entry})))
}

/// Requeue or dismiss a delivery (shared with the dashboard).
pub(crate) async fn resolve_delivery(
    caller: &Caller,
    event_id: String,
    consumer_id: String,
    body: ResolveBody,
) -> Result<DeliveryEntry, ApiError> {
    caller.require(Scope::Operate)?;
    validate_id("event_id", &event_id)?;
    validate_id("consumer_id", &consumer_id)?;
    validate_reason(&body.reason)?;
    Ok(caller
        .tenant
        .producer
        .call(move |p| p.store.resolve_delivery(&event_id, &consumer_id, body.action, &body.reason, now_ms()))
        .await?)
}
