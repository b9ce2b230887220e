//! Subscriptions to endpoints on other machines: subscribe a remote tidemark inbox (or, as their
//! transports land, a broker) to the tenant's outboxes, and list every subscription with its
//! endpoint kind and its relay lane's state.

use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use tidemark_core::endpoint::{mask, Endpoint, EndpointKind};
use tidemark_core::error::codes;
use tidemark_core::id::validate_id;
use tidemark_core::limits::RELAY_BATCH_EVENTS_MAX;
use tidemark_core::store::{DeliveryResult, DeliveryStatus, DeliveryVerdict, ProducerStore, Subscription};
use tidemark_core::tenancy::Scope;
use tidemark_core::Envelope;
use tidemark_core::Error;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::{fit_page, page_size, typed, ApiResult, ErrorBody, Json, Path, Query};
use crate::lanes::LaneStatus;
use crate::AnyCaller;
use crate::{now_ms, AppState};

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(list)).routes(routes!(subscribe)).routes(routes!(feed)).routes(routes!(commit))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"endpoint": "http://127.0.0.1:7401/v1/consumers/shipping/inbox", "from_start": true}))]
pub struct SubscribeBody {
    /// Where the events go: `http(s)://host[:port][/prefix]/v1/consumers/{id}/inbox` (another
    /// tidemark's inbox; its token is `relay.tokens` in this server's configuration), or a
    /// broker URL (`nats://`, `amqp://`, `kafka://`), or `pull:` for a consumer that reads
    /// `GET /v1/outbox/feed` (see docs/protocol.md, "Endpoints"). File
    /// endpoints are the tenant's own databases: declare a consumer (`PUT /v1/consumers/{id}`).
    /// The document's `pattern` (`openapi::endpoint_pattern`) is a part of what the server
    /// accepts: every endpoint it matches is accepted (the server also takes longer names, IPv6
    /// hosts, more Kafka servers).
    #[schema(min_length = 1, max_length = 4096)]
    pub endpoint: String,
    /// Also queue every event the outboxes still hold (default false: events committed from now on).
    #[serde(default)]
    pub from_start: bool,
}

impl SubscribeBody {
    /// The endpoint's kind: any endpoint [`Endpoint::parse`] accepts but a file
    /// (`invalid_endpoint`: a file endpoint is one of the tenant's own databases).
    pub fn kind(&self) -> Result<EndpointKind, Error> {
        let kind = Endpoint::parse(&self.endpoint)?.kind();
        if kind == EndpointKind::Sqlite {
            return Err(Error::invalid(
                codes::INVALID_ENDPOINT,
                "a file endpoint is one of the tenant's own databases: declare a consumer with PUT /v1/consumers/{id}",
            ));
        }
        Ok(kind)
    }
}

/// One subscription of one of the tenant's outboxes.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SubscriptionView {
    /// `producer` (the producer database's outbox) or `workflows` (the workflow database's).
    #[schema(example = "producer")]
    pub outbox: String,
    /// The subscriber's consumer id.
    pub consumer_id: String,
    /// The endpoint, with any credentials masked.
    pub endpoint: String,
    /// The endpoint's kind.
    pub kind: Option<EndpointKind>,
    /// The relay lane of a network endpoint while it runs.
    pub lane: Option<LaneStatus>,
    /// Its lag: deliveries still pending (counted among the outbox's first 1,000 pending
    /// deliveries of every subscriber; `pending_capped` says the count stopped there).
    pub pending: u64,
    /// True when `pending` stopped at the 1,000 pending deliveries read.
    pub pending_capped: bool,
    /// When its oldest pending event was committed (or last retried), in ms since the Unix epoch.
    pub oldest_pending_at_ms: Option<i64>,
}

/// Pending deliveries read per outbox for the lag of `GET /v1/subscriptions`.
const LAG_ROWS: usize = 1_000;

/// Every subscription of the tenant's outboxes, with kind, lane and lag (shared with the
/// dashboard).
pub(crate) async fn views(caller: &AnyCaller) -> Result<Vec<SubscriptionView>, Error> {
    crate::on_tenant!(&caller.tenant, tenant => {
        let mut subscriptions = Vec::new();
        for (index, outbox) in tenant.outboxes().into_iter().enumerate() {
            let (listed, pending) = outbox
                .call(|p| {
                    let listed = p.store.subscriptions()?;
                    let pending = p.store.deliveries(Some(DeliveryStatus::Pending), LAG_ROWS)?;
                    Ok((listed, pending))
                })
                .await?;
            let capped = pending.len() == LAG_ROWS;
            let lanes = tenant.lanes.lock().unwrap_or_else(|p| p.into_inner()).clone();
            for s in listed {
                let mine: Vec<_> = pending.iter().filter(|d| d.consumer_id == s.consumer_id).collect();
                subscriptions.push(SubscriptionView {
                    outbox: OUTBOX_NAMES[index].into(),
                    kind: Endpoint::parse(&s.endpoint).ok().map(|e| e.kind()),
                    endpoint: mask(&s.endpoint),
                    lane: lanes.get(&(index, s.endpoint.clone())).cloned(),
                    pending: mine.len() as u64,
                    pending_capped: capped,
                    oldest_pending_at_ms: mine.iter().map(|d| d.updated_at_ms).min(),
                    consumer_id: s.consumer_id,
                });
            }
        }
        Ok(subscriptions)
    })
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SubscriptionsPage {
    pub subscriptions: Vec<SubscriptionView>,
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Subscribed {
    /// `subscribed`.
    #[schema(example = "subscribed")]
    pub outcome: String,
    pub consumer_id: String,
    pub endpoint: String,
    pub kind: EndpointKind,
    /// Deliveries queued for events already in the outboxes (with `from_start`).
    pub queued: u64,
}

const OUTBOX_NAMES: [&str; 2] = ["producer", "workflows"];

/// One of the tenant's two outboxes: `producer` (the producer database's) or `workflows` (the
/// workflow database's). Documentation of the `outbox` of a feed and of its commit, which the
/// server reads with `outbox_index`.
#[derive(ToSchema)]
#[schema(rename_all = "lowercase")]
#[allow(dead_code)]
pub enum OutboxName {
    Producer,
    Workflows,
}

/// Subscribe `consumer_id` at a network endpoint to both of the tenant's outboxes (the producer's
/// and the workflow database's). Subscribing again with another endpoint moves the subscription.
#[utoipa::path(
    put,
    path = "/v1/subscriptions/{consumer_id}",
    tag = "flows",
    params(("consumer_id" = String, Path, description = "The subscriber (the remote side's dedup identity)")),
    request_body = SubscribeBody,
    responses(
        (status = 200, description = "`subscribed`", body = Subscribed),
        (status = 400, description = "`invalid_endpoint`: not an endpoint of a network kind (docs/protocol.md)", body = ErrorBody),
    ),
    security(("bearer" = ["admin"]))
)]
async fn subscribe(
    State(_state): State<AppState>,
    caller: AnyCaller,
    Path(consumer_id): Path<String>,
    Json(body): Json<SubscribeBody>,
) -> ApiResult {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Admin)?;
        validate_id("consumer_id", &consumer_id)?;
        let kind = body.kind()?;
        let mut queued = 0;
        for outbox in tenant.outboxes() {
            let subscription = Subscription { consumer_id: consumer_id.clone(), endpoint: body.endpoint.clone() };
            let from_start = body.from_start;
            queued += outbox.call(move |p| p.store.subscribe(&subscription, from_start, now_ms())).await?;
        }
        Ok(typed(
            StatusCode::OK,
            Subscribed { outcome: "subscribed".into(), consumer_id, endpoint: mask(&body.endpoint), kind, queued },
        ))
    })
}

/// Every subscription of the tenant's outboxes, with its endpoint's kind and, for a network
/// endpoint, its relay lane (in flight, delivered, failed, last error), and its lag.
#[utoipa::path(
    get,
    path = "/v1/subscriptions",
    tag = "flows",
    responses((status = 200, body = SubscriptionsPage)),
    security(("bearer" = ["read"]))
)]
async fn list(State(_state): State<AppState>, caller: AnyCaller) -> ApiResult {
    caller.require(Scope::Read)?;
    let subscriptions = views(&caller).await?;
    Ok(typed(StatusCode::OK, SubscriptionsPage { subscriptions }))
}

/// The outbox a feed reads: `producer` (default) or `workflows`.
fn outbox_index(name: Option<&str>) -> Result<usize, Error> {
    match name.unwrap_or("producer") {
        "producer" => Ok(0),
        "workflows" => Ok(1),
        other => Err(Error::invalid(
            codes::INVALID_ARGUMENT,
            format!("outbox must be \"producer\" or \"workflows\", got {other:?}"),
        )),
    }
}

/// `consumer_id` is a subscriber of `p`'s outbox at a `pull:` endpoint, or an error that says why not.
fn check_pull(store: &impl ProducerStore, consumer_id: &str) -> tidemark_core::Result<()> {
    let subscription = store
        .subscriptions()?
        .into_iter()
        .find(|s| s.consumer_id == consumer_id)
        .ok_or_else(|| Error::not_found(format!("no subscriber {consumer_id:?}")))?;
    if Endpoint::parse(&subscription.endpoint).map(|e| e.kind()).ok() != Some(EndpointKind::Pull) {
        return Err(Error::invalid(
            codes::INVALID_STATE_CHANGE,
            format!("{consumer_id:?} is pushed to (its endpoint is not `pull:`): the relay delivers its events"),
        ));
    }
    Ok(())
}

/// How many unacked events `after` may skip: the feed reads at most this many times `limit`.
const FEED_WINDOW_FACTOR: usize = 4;

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct FeedQuery {
    /// `producer` (default) or `workflows`: which of the tenant's outboxes.
    #[param(value_type = Option<OutboxName>)]
    pub outbox: Option<String>,
    /// Only events after this position (the last `position` already read but not yet committed);
    /// it skips at most 3 x `limit` of them.
    #[param(minimum = 0)]
    #[serde(default, deserialize_with = "super::query_integer")]
    pub after: Option<i64>,
    /// Events to read, 1..=page_size_max (default 100).
    #[param(minimum = 1)]
    #[serde(default, deserialize_with = "super::query_integer")]
    pub limit: Option<usize>,
}

/// One event of a feed, with its outbox position.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FeedEvent {
    pub position: i64,
    pub envelope: Envelope,
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FeedPage {
    /// In commit order (by position).
    pub events: Vec<FeedEvent>,
    /// The last position of this page (pass it as `after` to read on before committing), or
    /// null when the page is empty.
    pub next_after: Option<i64>,
    /// True when the page stopped before `limit` items at `limits.page_bytes_max` (the JSON of
    /// its items), so more may follow.
    pub truncated: bool,
}

/// A pull consumer's next events, in commit order: every event not yet committed by it. Read,
/// store them durably, then commit with `POST /v1/outbox/feed/{consumer_id}/commit`; what is not committed is
/// handed out again (so a crash between storing and committing gives duplicates, never losses:
/// dedup by event id on the reading side).
#[utoipa::path(
    get,
    path = "/v1/outbox/feed/{consumer_id}",
    tag = "flows",
    params(("consumer_id" = String, Path, description = "The pull consumer (subscribed with the endpoint `pull:`)"), FeedQuery),
    responses(
        (status = 200, body = FeedPage),
        (status = 404, description = "`not_found`: no such subscriber", body = ErrorBody),
        (status = 409, description = "`invalid_state_change`: the subscriber is not a pull consumer", body = ErrorBody),
    ),
    security(("bearer" = ["operate"]))
)]
async fn feed(
    State(state): State<AppState>,
    caller: AnyCaller,
    Path(consumer_id): Path<String>,
    Query(query): Query<FeedQuery>,
) -> ApiResult {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Operate)?;
        validate_id("consumer_id", &consumer_id)?;
        let index = outbox_index(query.outbox.as_deref())?;
        let limit = page_size(&state, query.limit)?;
        let after = query.after.unwrap_or(0);
        if after < 0 {
            return Err(Error::invalid(codes::INVALID_ARGUMENT, "after must be >= 0").into());
        }
        let events = tenant.outboxes()[index]
            .call(move |p| {
                check_pull(&p.store, &consumer_id)?;
                let window = (limit * FEED_WINDOW_FACTOR).min(RELAY_BATCH_EVENTS_MAX * 4);
                let mut due =
                    p.store.due_deliveries((p.clock)(), window, None, Some(std::slice::from_ref(&consumer_id)))?;
                due.sort_by_key(|d| d.position);
                Ok(due
                    .into_iter()
                    .filter(|d| d.position > after)
                    .take(limit)
                    .map(|d| FeedEvent { position: d.position, envelope: d.envelope })
                    .collect::<Vec<_>>())
            })
            .await?;
        let mut events = events;
        let truncated = fit_page(&state, &mut events);
        let next_after = events.last().map(|e| e.position);
        Ok(typed(StatusCode::OK, FeedPage { events, next_after, truncated }))
    })
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"through_position": 42}))]
pub struct CommitBody {
    /// `producer` (default) or `workflows`.
    #[schema(value_type = Option<OutboxName>)]
    pub outbox: Option<String>,
    /// Every event of the feed at or below this position is now the consumer's (stored
    /// durably on its side): its deliveries become `accepted`.
    #[schema(minimum = 0)]
    #[serde(deserialize_with = "tidemark_core::json::integer")]
    pub through_position: i64,
}

impl CommitBody {
    /// The index of the outbox it commits in (0 the producer's, 1 the workflow database's;
    /// `invalid_argument` for another name or a negative `through_position`).
    pub fn outbox_index(&self) -> Result<usize, Error> {
        let index = outbox_index(self.outbox.as_deref())?;
        if self.through_position < 0 {
            return Err(Error::invalid(codes::INVALID_ARGUMENT, "through_position must be >= 0"));
        }
        Ok(index)
    }
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Committed {
    /// `committed`.
    #[schema(example = "committed")]
    pub outcome: String,
    /// Deliveries marked accepted by this call.
    pub committed: u64,
}

/// A pull consumer takes custody of every event it read at or below `through_position`: their
/// deliveries become `accepted` in one transaction per 40,000 (the feed hands them out no more).
#[utoipa::path(
    post,
    path = "/v1/outbox/feed/{consumer_id}/commit",
    tag = "flows",
    params(("consumer_id" = String, Path, description = "The pull consumer")),
    request_body = CommitBody,
    responses(
        (status = 200, body = Committed),
        (status = 404, description = "`not_found`: no such subscriber", body = ErrorBody),
        (status = 409, description = "`invalid_state_change`: the subscriber is not a pull consumer", body = ErrorBody),
    ),
    security(("bearer" = ["operate"]))
)]
async fn commit(
    State(_state): State<AppState>,
    caller: AnyCaller,
    Path(consumer_id): Path<String>,
    Json(body): Json<CommitBody>,
) -> ApiResult {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Operate)?;
        validate_id("consumer_id", &consumer_id)?;
        let index = body.outbox_index()?;
        let through = body.through_position;
        let committed = tenant.outboxes()[index]
            .call(move |p| {
                check_pull(&p.store, &consumer_id)?;
                let mut committed = 0_u64;
                // Bounded: each round takes up to 40,000 deliveries at or below `through`.
                for _ in 0..1_000 {
                    let now = (p.clock)();
                    let due = p.store.due_deliveries(
                        now,
                        RELAY_BATCH_EVENTS_MAX * 4,
                        None,
                        Some(std::slice::from_ref(&consumer_id)),
                    )?;
                    let results: Vec<DeliveryResult> = due
                        .into_iter()
                        .filter(|d| d.position <= through)
                        .map(|d| DeliveryResult {
                            position: d.position,
                            event_id: d.envelope.event_id,
                            consumer_id: d.consumer_id,
                            verdict: DeliveryVerdict::Accepted,
                        })
                        .collect();
                    if results.is_empty() {
                        break;
                    }
                    committed += results.len() as u64;
                    p.store.record_deliveries(&results, now)?;
                }
                Ok(committed)
            })
            .await?;
        Ok(typed(StatusCode::OK, Committed { outcome: "committed".into(), committed }))
    })
}
