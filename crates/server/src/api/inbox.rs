//! Consumer routes: declare a consumer (and subscribe it to the tenant's producer), receive an
//! event into its inbox, list its records (pending, blocked, ...), skip a blocked record, and its
//! high-water marks per flow.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post, put};
use axum::Router;
use serde::Deserialize;
use serde_json::json;
use tidemark_core::error::codes;
use tidemark_core::id::{validate_id, validate_reason};
use tidemark_core::limits::ENVELOPE_BYTES_MAX;
use tidemark_core::store::{ConsumerStore, InboxEntry, InboxStatus, ProducerStore, ReceiveOutcome, Subscription};
use tidemark_core::tenancy::Scope;
use tidemark_core::{Envelope, Error};
use tidemark_store_sqlite::ConsumerRecord;

use super::{answer, page_size, ApiError, ApiResult, Json, Path, Query};
use crate::auth::Caller;
use crate::tenant::HandlerKind;
use crate::{now_ms, AppState};

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/consumers", get(list))
        .route("/v1/consumers/{consumer_id}", put(declare))
        .route("/v1/consumers/{consumer_id}/cursors", get(cursors))
        .route("/v1/consumers/{consumer_id}/inbox", post(receive).get(records))
        .route("/v1/consumers/{consumer_id}/inbox/{event_id}/skip", post(skip))
}

/// The declared consumer, or `not_found`.
fn consumer(state: &AppState, caller: &Caller, consumer_id: &str) -> Result<(ConsumerRecord, HandlerKind), Error> {
    validate_id("consumer_id", consumer_id)?;
    let tenant_id = caller.tenant.id.clone();
    let record = state
        .control(|c| c.consumers(Some(&tenant_id)))?
        .into_iter()
        .find(|c| c.consumer_id == consumer_id)
        .ok_or_else(|| {
        Error::not_found(format!("no consumer {consumer_id:?}; declare it with PUT /v1/consumers/{{id}}"))
    })?;
    let kind = HandlerKind::parse(&record.handler)?;
    Ok((record, kind))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeclareBody {
    /// reservation, record or workflows.
    pub handler: String,
    /// Subscribe it to this tenant's producer (default true).
    #[serde(default = "yes")]
    pub subscribe: bool,
    /// With `subscribe`: also queue every event already in the outbox (default true).
    #[serde(default = "yes")]
    pub from_start: bool,
}

fn yes() -> bool {
    true
}

async fn declare(
    State(state): State<AppState>,
    caller: Caller,
    Path(consumer_id): Path<String>,
    Json(body): Json<DeclareBody>,
) -> ApiResult {
    caller.require(Scope::Admin)?;
    validate_id("consumer_id", &consumer_id)?;
    let kind = HandlerKind::parse(&body.handler)?;
    let tenant_id = caller.tenant.id.clone();
    let (record, created) = state.control(|c| c.declare_consumer(&tenant_id, &consumer_id, kind.as_str(), now_ms()))?;
    let mut queued = None;
    if body.subscribe {
        let subscription =
            Subscription { consumer_id: consumer_id.clone(), endpoint: caller.tenant.endpoint(kind.inbox()) };
        let from_start = body.from_start;
        queued =
            Some(caller.tenant.producer.call(move |p| p.store.subscribe(&subscription, from_start, now_ms())).await?);
    }
    let status = if created { StatusCode::CREATED } else { StatusCode::OK };
    Ok(answer(
        status,
        json!({"outcome": if created {"declared"} else {"existing"}, "consumer": record, "queued": queued}),
    ))
}

async fn list(State(state): State<AppState>, caller: Caller) -> ApiResult {
    caller.require(Scope::Read)?;
    let tenant_id = caller.tenant.id.clone();
    let consumers = state.control(|c| c.consumers(Some(&tenant_id)))?;
    let subscriptions = caller.tenant.producer.call(|p| p.store.subscriptions()).await?;
    let consumers: Vec<_> = consumers
        .into_iter()
        .map(|c| {
            let subscribed = subscriptions.iter().any(|s| s.consumer_id == c.consumer_id);
            json!({"consumer_id": c.consumer_id, "handler": c.handler, "created_at_ms": c.created_at_ms, "subscribed": subscribed})
        })
        .collect();
    Ok(answer(StatusCode::OK, json!({"consumers": consumers})))
}

async fn cursors(State(state): State<AppState>, caller: Caller, Path(consumer_id): Path<String>) -> ApiResult {
    caller.require(Scope::Read)?;
    let (_, kind) = consumer(&state, &caller, &consumer_id)?;
    let cursors = caller.tenant.inbox_of(kind.inbox()).call(move |t| t.store.cursors(Some(&consumer_id))).await?;
    Ok(answer(StatusCode::OK, json!({"cursors": cursors})))
}

/// Store one envelope (the body) durably. 200 `accepted`/`duplicate`; 409 `conflict`/`expired`.
async fn receive(
    State(state): State<AppState>,
    caller: Caller,
    Path(consumer_id): Path<String>,
    body: Bytes,
) -> ApiResult {
    caller.require(Scope::Operate)?;
    let (_, kind) = consumer(&state, &caller, &consumer_id)?;
    if body.len() > ENVELOPE_BYTES_MAX {
        return Err(Error::invalid(
            codes::PAYLOAD_TOO_LARGE,
            format!("an envelope is at most {ENVELOPE_BYTES_MAX} bytes"),
        )
        .into());
    }
    let envelope = Envelope::parse(&body)?;
    let outcome = caller.tenant.inbox_of(kind.inbox()).submit((consumer_id, envelope)).await?;
    state.metrics.record_receive(&caller.tenant.id, &outcome);
    let status = if outcome.is_custody() { StatusCode::OK } else { StatusCode::CONFLICT };
    let _: &ReceiveOutcome = &outcome;
    Ok(answer(status, serde_json::to_value(&outcome).expect("outcomes serialise")))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordsQuery {
    /// pending, applied, blocked or skipped.
    pub status: Option<String>,
    pub limit: Option<usize>,
}

async fn records(
    State(state): State<AppState>,
    caller: Caller,
    Path(consumer_id): Path<String>,
    Query(query): Query<RecordsQuery>,
) -> ApiResult {
    let records = inbox_records(&state, &caller, consumer_id, query).await?;
    Ok(answer(StatusCode::OK, json!({"records": records})))
}

/// A consumer's inbox records, by status (shared with the dashboard).
pub(crate) async fn inbox_records(
    state: &AppState,
    caller: &Caller,
    consumer_id: String,
    query: RecordsQuery,
) -> Result<Vec<InboxEntry>, ApiError> {
    caller.require(Scope::Read)?;
    let (_, kind) = consumer(state, caller, &consumer_id)?;
    let status = query
        .status
        .map(|s| {
            InboxStatus::parse(&s)
                .ok_or_else(|| Error::invalid(codes::INVALID_ARGUMENT, format!("unknown inbox status {s:?}")))
        })
        .transpose()?;
    let limit = page_size(state, query.limit)?;
    Ok(caller.tenant.inbox_of(kind.inbox()).call(move |t| t.store.inbox(&consumer_id, status, limit)).await?)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SkipBody {
    pub reason: String,
}

async fn skip(
    State(state): State<AppState>,
    caller: Caller,
    Path((consumer_id, event_id)): Path<(String, String)>,
    Json(body): Json<SkipBody>,
) -> ApiResult {
    let record = skip_record(&state, &caller, consumer_id, event_id, body).await?;
    Ok(answer(StatusCode::OK, json!({"outcome": "skipped", "record": record})))
}

/// Skip a blocked inbox record (shared with the dashboard).
pub(crate) async fn skip_record(
    state: &AppState,
    caller: &Caller,
    consumer_id: String,
    event_id: String,
    body: SkipBody,
) -> Result<InboxEntry, ApiError> {
    caller.require(Scope::Operate)?;
    let (_, kind) = consumer(state, caller, &consumer_id)?;
    validate_id("event_id", &event_id)?;
    validate_reason(&body.reason)?;
    Ok(caller
        .tenant
        .inbox_of(kind.inbox())
        .call(move |t| t.store.skip_blocked(&consumer_id, &event_id, &body.reason, now_ms()))
        .await?)
}
