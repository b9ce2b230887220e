//! Consumer routes: declare a consumer (and subscribe it to the tenant's producer), receive an
//! event into its inbox, list its records (pending, blocked, ...), skip a blocked record, and its
//! high-water marks per flow.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use tidemark_core::error::codes;
use tidemark_core::id::{validate_id, validate_reason};
use tidemark_core::limits::{ENVELOPE_BYTES_MAX, HTTP_RECEIVE_BATCH_EVENTS_MAX};
use tidemark_core::store::{
    ConsumerStore, FlowCursor, InboxEntry, InboxStatus, ProducerStore, ReceiveOutcome, Subscription,
};
use tidemark_core::tenancy::ConsumerRecord;
use tidemark_core::tenancy::Scope;
use tidemark_core::{Envelope, Error};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::{fit_page, page_size, typed, ApiError, ApiResult, ErrorBody, Json, Path, Query};
use crate::registry::Database;
use crate::AnyCaller;
use crate::{now_ms, AppState};

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list))
        .routes(routes!(declare))
        .routes(routes!(cursors))
        .routes(routes!(receive, records))
        .routes(routes!(receive_batch))
        .routes(routes!(skip))
}

/// The declared consumer, or `not_found`.
fn consumer(state: &AppState, caller: &AnyCaller, consumer_id: &str) -> Result<(ConsumerRecord, Database), Error> {
    crate::on_tenant!(&caller.tenant, tenant => {
        validate_id("consumer_id", consumer_id)?;
        let tenant_id = tenant.id.clone();
        let record = state.consumers(&tenant_id)?.into_iter().find(|c| c.consumer_id == consumer_id).ok_or_else(|| {
            Error::not_found(format!("no consumer {consumer_id:?}; declare it with PUT /v1/consumers/{{id}}"))
        })?;
        let database = state.registry.handler_database(&record.handler)?;
        Ok((record, database))
    })
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"handler": "record"}))]
pub struct DeclareBody {
    /// A registered handler (`GET /v1/registry` lists them).
    #[schema(value_type = HandlerName, example = "record")]
    pub handler: String,
    /// Subscribe it to this tenant's outboxes: the producer's and the workflow database's
    /// (default true).
    #[serde(default = "yes")]
    #[schema(default = true)]
    pub subscribe: bool,
    /// With `subscribe`: also queue every event already in the outbox (default true).
    #[serde(default = "yes")]
    #[schema(default = true)]
    pub from_start: bool,
}

/// A declared consumer.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DeclaredConsumer {
    pub tenant_id: String,
    pub consumer_id: String,
    pub handler: String,
    pub created_at_ms: i64,
}

impl From<ConsumerRecord> for DeclaredConsumer {
    fn from(c: ConsumerRecord) -> Self {
        DeclaredConsumer {
            tenant_id: c.tenant_id,
            consumer_id: c.consumer_id,
            handler: c.handler,
            created_at_ms: c.created_at_ms,
        }
    }
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Declared {
    /// `declared` (201) or `existing` (200: the same handler was declared before).
    #[schema(example = "declared")]
    pub outcome: String,
    pub consumer: DeclaredConsumer,
    /// With `subscribe`: deliveries queued for events already in the outbox.
    pub queued: Option<u64>,
}

fn yes() -> bool {
    true
}

/// A registered handler's name (documentation of `DeclareBody::handler`; the served document
/// lists the handlers this server registers).
#[derive(ToSchema)]
#[schema(pattern = "^[A-Za-z0-9_.:-]{1,100}$")]
#[allow(dead_code)]
pub struct HandlerName(String);

/// Declare a consumer with a registered handler and (by default) subscribe it to the tenant's
/// producer.
#[utoipa::path(
    put,
    path = "/v1/consumers/{consumer_id}",
    tag = "consumers",
    params(("consumer_id" = String, Path, description = "The logical consumer (its dedup identity)")),
    request_body = DeclareBody,
    responses(
        (status = 201, description = "`declared`", body = Declared),
        (status = 200, description = "`existing`", body = Declared),
        (status = 400, description = "`unknown_handler`: a handler this service does not register", body = ErrorBody),
        (status = 409, description = "`already_exists`: declared before with another handler", body = ErrorBody),
    ),
    security(("bearer" = ["admin"]))
)]
async fn declare(
    State(state): State<AppState>,
    caller: AnyCaller,
    Path(consumer_id): Path<String>,
    Json(body): Json<DeclareBody>,
) -> ApiResult {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Admin)?;
        validate_id("consumer_id", &consumer_id)?;
        let database = state.registry.handler_database(&body.handler)?;
        let tenant_id = tenant.id.clone();
        let (record, created) = state.control(|c| c.declare_consumer(&tenant_id, &consumer_id, &body.handler, now_ms()))?;
        let mut queued = None;
        if body.subscribe {
            // To both of the tenant's outboxes: the producer's and the workflow database's.
            let mut total = 0;
            for outbox in tenant.outboxes() {
                let subscription =
                    Subscription { consumer_id: consumer_id.clone(), endpoint: tenant.endpoint(database) };
                let from_start = body.from_start;
                total += outbox.call(move |p| p.store.subscribe(&subscription, from_start, now_ms())).await?;
            }
            queued = Some(total);
        }
        let status = if created { StatusCode::CREATED } else { StatusCode::OK };
        let outcome = if created { "declared" } else { "existing" };
        Ok(typed(status, Declared { outcome: outcome.into(), consumer: record.into(), queued }))
    })
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ConsumerSummary {
    pub consumer_id: String,
    pub handler: String,
    pub created_at_ms: i64,
    /// Subscribed to the tenant's producer.
    pub subscribed: bool,
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ConsumersPage {
    pub consumers: Vec<ConsumerSummary>,
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CursorsPage {
    pub cursors: Vec<FlowCursor>,
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RecordsPage {
    pub records: Vec<InboxEntry>,
    /// True when the page stopped before `limit` items at `limits.page_bytes_max` (the JSON of
    /// its items), so more may follow.
    pub truncated: bool,
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SkippedRecord {
    /// `skipped`.
    #[schema(example = "skipped")]
    pub outcome: String,
    pub record: InboxEntry,
}

/// The tenant's consumers.
#[utoipa::path(
    get,
    path = "/v1/consumers",
    tag = "consumers",
    responses((status = 200, body = ConsumersPage)),
    security(("bearer" = ["read"]))
)]
async fn list(State(state): State<AppState>, caller: AnyCaller) -> ApiResult {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Read)?;
        let tenant_id = tenant.id.clone();
        let consumers = state.consumers(&tenant_id)?;
        let subscriptions = tenant.producer.call(|p| p.store.subscriptions()).await?;
        let consumers: Vec<_> = consumers
            .into_iter()
            .map(|c| {
                let subscribed = subscriptions.iter().any(|s| s.consumer_id == c.consumer_id);
                ConsumerSummary {
                    consumer_id: c.consumer_id,
                    handler: c.handler,
                    created_at_ms: c.created_at_ms,
                    subscribed,
                }
            })
            .collect();
        Ok(typed(StatusCode::OK, ConsumersPage { consumers }))
    })
}

/// The consumer's high-water mark per flow.
#[utoipa::path(
    get,
    path = "/v1/consumers/{consumer_id}/cursors",
    tag = "consumers",
    params(("consumer_id" = String, Path, description = "The consumer")),
    responses(
        (status = 200, body = CursorsPage),
        (status = 404, description = "`not_found`: no such consumer", body = ErrorBody),
    ),
    security(("bearer" = ["read"]))
)]
async fn cursors(State(state): State<AppState>, caller: AnyCaller, Path(consumer_id): Path<String>) -> ApiResult {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Read)?;
        let (_, database) = consumer(&state, &caller, &consumer_id)?;
        let cursors = tenant.inbox_of(database)?.call(move |t| t.store.cursors(Some(&consumer_id))).await?;
        Ok(typed(StatusCode::OK, CursorsPage { cursors }))
    })
}

/// Store one envelope (the body) durably in the consumer's inbox. 200 `accepted`/`duplicate`;
/// 409 `conflict`/`expired`.
#[utoipa::path(
    post,
    path = "/v1/consumers/{consumer_id}/inbox",
    tag = "consumers",
    params(("consumer_id" = String, Path, description = "The consumer")),
    request_body(
        content = Envelope,
        description = "An envelope as a producer's outbox holds it (at most 68 KiB, and the body limit)",
        example = json!({"event_id": "evt-1", "source": "partner", "generation": "g1", "flow_id": "order-7", "seq": 1, "event_type": "note.added", "schema_version": 1, "payload": {"text": "hi"}, "created_at_ms": 1700000000000_i64})
    ),
    responses(
        (status = 200, description = "`accepted` or `duplicate`: the consumer holds the event", body = ReceiveOutcome),
        (status = 400, description = "`invalid_envelope` (not JSON, not an object, a missing, unknown or mistyped field, a bad `traceparent`), `invalid_id`, `invalid_seq`, `invalid_schema_version`, `invalid_payload`", body = ErrorBody),
        (status = 409, description = "`conflict` (same identity, other content) or `expired` (older than the retention horizon)", body = ReceiveOutcome),
        (status = 404, description = "`not_found`: no such consumer", body = ErrorBody),
    ),
    security(("bearer" = ["operate"]))
)]
async fn receive(
    State(state): State<AppState>,
    caller: AnyCaller,
    Path(consumer_id): Path<String>,
    body: Bytes,
) -> ApiResult {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Operate)?;
        let (_, database) = consumer(&state, &caller, &consumer_id)?;
        if body.len() > ENVELOPE_BYTES_MAX {
            return Err(Error::invalid(
                codes::PAYLOAD_TOO_LARGE,
                format!("an envelope is at most {ENVELOPE_BYTES_MAX} bytes"),
            )
            .into());
        }
        let envelope = Envelope::parse(&body)?;
        let outcome = tenant.inbox_of(database)?.submit((consumer_id, envelope)).await?;
        state.metrics.record_receive(&tenant.id, &outcome);
        let status = if outcome.is_custody() { StatusCode::OK } else { StatusCode::CONFLICT };
        Ok(typed::<ReceiveOutcome>(status, outcome))
    })
}

/// The body of the batch receive route: envelopes in delivery order.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"events": [{"event_id": "evt-1", "source": "partner", "generation": "g1", "flow_id": "order-7", "seq": 1, "event_type": "note.added", "schema_version": 1, "payload": {"text": "hi"}, "created_at_ms": 1700000000000_i64}]}))]
pub struct ReceiveBatchBody {
    /// 1..=1,000 envelopes (and the body limit, `limits.body_bytes_max`), each as a producer's
    /// outbox holds it.
    #[schema(min_items = 1, max_items = 1000)]
    pub events: Vec<Envelope>,
}

impl ReceiveBatchBody {
    /// 1..=1,000 envelopes (`limit_exceeded`), each valid (`Envelope::validate`, its error
    /// naming the envelope's index).
    pub fn check(&self) -> Result<(), Error> {
        if self.events.is_empty() || self.events.len() > HTTP_RECEIVE_BATCH_EVENTS_MAX {
            return Err(Error::invalid(
                codes::LIMIT_EXCEEDED,
                format!("a batch holds 1..={HTTP_RECEIVE_BATCH_EVENTS_MAX} events, got {}", self.events.len()),
            ));
        }
        for (index, envelope) in self.events.iter().enumerate() {
            envelope.validate().map_err(|e| match e {
                Error::Invalid { code, message } => Error::invalid(code, format!("events[{index}]: {message}")),
                other => other,
            })?;
        }
        Ok(())
    }
}

/// One outcome per envelope of the batch, in the same order.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReceiveBatchAnswer {
    pub outcomes: Vec<ReceiveOutcome>,
}

/// Store a batch of envelopes durably in the consumer's inbox, in one transaction: what another
/// tidemark's relay calls for an `http(s)://.../v1/consumers/{id}/inbox` endpoint. The answer
/// comes after the commit, one outcome per envelope (`accepted`, `duplicate`, `conflict`,
/// `expired`); a malformed envelope anywhere is 400 and nothing is stored.
#[utoipa::path(
    post,
    path = "/v1/consumers/{consumer_id}/inbox/batch",
    tag = "consumers",
    params(("consumer_id" = String, Path, description = "The consumer")),
    request_body = ReceiveBatchBody,
    responses(
        (status = 200, description = "Every envelope's outcome, after the inbox transaction committed", body = ReceiveBatchAnswer),
        (status = 400, description = "`invalid_envelope` (and the other envelope codes) or `limit_exceeded`: nothing stored", body = ErrorBody),
        (status = 404, description = "`not_found`: no such consumer", body = ErrorBody),
    ),
    security(("bearer" = ["operate"]))
)]
async fn receive_batch(
    State(state): State<AppState>,
    caller: AnyCaller,
    Path(consumer_id): Path<String>,
    Json(body): Json<ReceiveBatchBody>,
) -> ApiResult {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Operate)?;
        let (_, database) = consumer(&state, &caller, &consumer_id)?;
        body.check()?;
        let events = body.events;
        let outcomes = tenant
            .inbox_of(database)?
            .call(move |t| {
                let items: Vec<(&str, &Envelope)> = events.iter().map(|e| (consumer_id.as_str(), e)).collect();
                t.store.receive_batch(&items, (t.clock)())
            })
            .await?;
        for outcome in &outcomes {
            state.metrics.record_receive(&tenant.id, outcome);
        }
        Ok(typed(StatusCode::OK, ReceiveBatchAnswer { outcomes }))
    })
}

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct RecordsQuery {
    /// pending, applied, blocked or skipped. Default: every status.
    #[param(value_type = Option<InboxStatus>)]
    pub status: Option<String>,
    /// Page size, 1..=page_size_max (default 100).
    #[param(minimum = 1)]
    #[serde(default, deserialize_with = "super::query_integer")]
    pub limit: Option<usize>,
}

/// The consumer's inbox records, optionally by status.
#[utoipa::path(
    get,
    path = "/v1/consumers/{consumer_id}/inbox",
    tag = "consumers",
    params(("consumer_id" = String, Path, description = "The consumer"), RecordsQuery),
    responses(
        (status = 200, body = RecordsPage),
        (status = 404, description = "`not_found`: no such consumer", body = ErrorBody),
    ),
    security(("bearer" = ["read"]))
)]
async fn records(
    State(state): State<AppState>,
    caller: AnyCaller,
    Path(consumer_id): Path<String>,
    Query(query): Query<RecordsQuery>,
) -> ApiResult {
    let (records, truncated) = inbox_records(&state, &caller, consumer_id, query).await?;
    Ok(typed(StatusCode::OK, RecordsPage { records, truncated }))
}

/// A consumer's inbox records, by status, and whether `limits.page_bytes_max` cut the page
/// (shared with the dashboard).
pub(crate) async fn inbox_records(
    state: &AppState,
    caller: &AnyCaller,
    consumer_id: String,
    query: RecordsQuery,
) -> Result<(Vec<InboxEntry>, bool), ApiError> {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Read)?;
        let (_, database) = consumer(state, caller, &consumer_id)?;
        let status = query
            .status
            .map(|s| {
                InboxStatus::parse(&s)
                    .ok_or_else(|| Error::invalid(codes::INVALID_ARGUMENT, format!("unknown inbox status {s:?}")))
            })
            .transpose()?;
        let limit = page_size(state, query.limit)?;
        let mut records = tenant.inbox_of(database)?.call(move |t| t.store.inbox(&consumer_id, status, limit)).await?;
        let truncated = fit_page(state, &mut records);
        Ok((records, truncated))
    })
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"reason": "bad payload, compensated by hand"}))]
pub struct SkipRecordBody {
    /// Recorded with the record (1..=1000 bytes).
    #[schema(min_length = 1, max_length = 1000, pattern = "\\S")]
    pub reason: String,
}

/// Skip a blocked record (its handler never runs) so its flow goes on.
#[utoipa::path(
    post,
    path = "/v1/consumers/{consumer_id}/inbox/{event_id}/skip",
    tag = "consumers",
    params(
        ("consumer_id" = String, Path, description = "The consumer"),
        ("event_id" = String, Path, description = "The blocked record's event"),
    ),
    request_body = SkipRecordBody,
    responses(
        (status = 200, body = SkippedRecord),
        (status = 404, description = "`not_found`: no such consumer or record", body = ErrorBody),
        (status = 409, description = "`invalid_state_change`: the record is not blocked", body = ErrorBody),
    ),
    security(("bearer" = ["operate"]))
)]
async fn skip(
    State(state): State<AppState>,
    caller: AnyCaller,
    Path((consumer_id, event_id)): Path<(String, String)>,
    Json(body): Json<SkipRecordBody>,
) -> ApiResult {
    let record = skip_record(&state, &caller, consumer_id, event_id, body).await?;
    Ok(typed(StatusCode::OK, SkippedRecord { outcome: "skipped".into(), record }))
}

/// Skip a blocked inbox record (shared with the dashboard).
pub(crate) async fn skip_record(
    state: &AppState,
    caller: &AnyCaller,
    consumer_id: String,
    event_id: String,
    body: SkipRecordBody,
) -> Result<InboxEntry, ApiError> {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Operate)?;
        let (_, database) = consumer(state, caller, &consumer_id)?;
        validate_id("event_id", &event_id)?;
        validate_reason(&body.reason)?;
        Ok(tenant
            .inbox_of(database)?
            .call(move |t| t.store.skip_blocked(&consumer_id, &event_id, &body.reason, now_ms()))
            .await?)
    })
}
