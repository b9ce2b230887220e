//! Subscriptions to endpoints on other machines: subscribe a remote tidemark inbox (or, as their
//! transports land, a broker) to the tenant's outboxes, and list every subscription with its
//! endpoint kind and its relay lane's state.

use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use tidemark_core::endpoint::{mask, Endpoint, EndpointKind};
use tidemark_core::error::codes;
use tidemark_core::id::validate_id;
use tidemark_core::store::{ProducerStore, Subscription};
use tidemark_core::tenancy::Scope;
use tidemark_core::Error;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::{typed, ApiResult, ErrorBody, Json, Path};
use crate::auth::Caller;
use crate::lanes::LaneStatus;
use crate::{now_ms, AppState};

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(list)).routes(routes!(subscribe))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"endpoint": "http://127.0.0.1:7401/v1/consumers/shipping/inbox", "from_start": true}))]
pub struct SubscribeBody {
    /// Where the events go: `http(s)://host[:port][/prefix]/v1/consumers/{id}/inbox` (another
    /// tidemark's inbox; its token is `relay.tokens` in this server's configuration), or a
    /// broker URL (`nats://`, `amqp://`, `kafka://`; see docs/protocol.md, "Endpoints"). File
    /// endpoints are the tenant's own databases: declare a consumer (`PUT /v1/consumers/{id}`).
    #[schema(min_length = 1, max_length = 4096)]
    pub endpoint: String,
    /// Also queue every event the outboxes still hold (default false: events committed from now on).
    #[serde(default)]
    pub from_start: bool,
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
    caller: Caller,
    Path(consumer_id): Path<String>,
    Json(body): Json<SubscribeBody>,
) -> ApiResult {
    caller.require(Scope::Admin)?;
    validate_id("consumer_id", &consumer_id)?;
    let kind = Endpoint::parse(&body.endpoint)?.kind();
    if kind == EndpointKind::Sqlite {
        return Err(Error::invalid(
            codes::INVALID_ENDPOINT,
            "a file endpoint is one of the tenant's own databases: declare a consumer with PUT /v1/consumers/{id}",
        )
        .into());
    }
    let mut queued = 0;
    for outbox in caller.tenant.outboxes() {
        let subscription = Subscription { consumer_id: consumer_id.clone(), endpoint: body.endpoint.clone() };
        let from_start = body.from_start;
        queued += outbox.call(move |p| p.store.subscribe(&subscription, from_start, now_ms())).await?;
    }
    Ok(typed(
        StatusCode::OK,
        Subscribed { outcome: "subscribed".into(), consumer_id, endpoint: mask(&body.endpoint), kind, queued },
    ))
}

/// Every subscription of the tenant's outboxes, with its endpoint's kind and, for a network
/// endpoint, its relay lane (in flight, delivered, failed, last error).
#[utoipa::path(
    get,
    path = "/v1/subscriptions",
    tag = "flows",
    responses((status = 200, body = SubscriptionsPage)),
    security(("bearer" = ["read"]))
)]
async fn list(State(_state): State<AppState>, caller: Caller) -> ApiResult {
    caller.require(Scope::Read)?;
    let mut subscriptions = Vec::new();
    for (index, outbox) in caller.tenant.outboxes().into_iter().enumerate() {
        let listed = outbox.call(|p| p.store.subscriptions()).await?;
        let lanes = caller.tenant.lanes.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for s in listed {
            let lane = lanes.get(&(index, s.endpoint.clone())).cloned();
            subscriptions.push(SubscriptionView {
                outbox: OUTBOX_NAMES[index].into(),
                kind: Endpoint::parse(&s.endpoint).ok().map(|e| e.kind()),
                endpoint: mask(&s.endpoint),
                consumer_id: s.consumer_id,
                lane,
            });
        }
    }
    Ok(typed(StatusCode::OK, SubscriptionsPage { subscriptions }))
}
