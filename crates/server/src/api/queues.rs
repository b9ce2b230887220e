//! Queues: declare one (its concurrency and rate limits hold across every worker on the
//! tenant's database) and see what is in it, each waiting run with its position
//! (docs/workflows.md, "Queues"). Runs go through one with `POST /v1/runs {"queue": {...}}`.

use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use tidemark_core::id::validate_id;
use tidemark_core::queue::{QueueSpec, QueueState, QueueStore, RateLimit, QUEUE_WAITING_SHOWN_MAX};
use tidemark_core::tenancy::Scope;
use tidemark_core::Error;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::{typed, ApiError, ApiResult, ErrorBody, Json, Path};
use crate::AnyCaller;
use crate::AppState;

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(list)).routes(routes!(put, show))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"concurrency_max": 5, "rate": {"limit": 100, "period_ms": 60000}}))]
pub struct QueueBody {
    /// At most this many admitted, unfinished runs at once across every worker (1..=1,000,000;
    /// absent: no limit).
    #[schema(minimum = 1, maximum = 1_000_000)]
    #[serde(default, deserialize_with = "tidemark_core::json::optional_integer")]
    pub concurrency_max: Option<u32>,
    /// At most `limit` (1..=1,000,000) admissions per `period_ms` (1..=31,622,400,000).
    pub rate: Option<RateLimit>,
}

impl QueueBody {
    /// The queue `name` this body declares, checked (`QueueSpec::validate`).
    pub fn spec(self, name: String) -> Result<QueueSpec, Error> {
        let spec = QueueSpec { name, concurrency_max: self.concurrency_max, rate: self.rate };
        spec.validate()?;
        Ok(spec)
    }
}

/// The tenant's queues.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct QueuesPage {
    /// By name, with their counts (no waiting list: see `GET /v1/queues/{name}`).
    pub queues: Vec<QueueState>,
}

/// Declare or change a queue. 200 with it.
#[utoipa::path(
    put,
    path = "/v1/queues/{name}",
    tag = "queues",
    params(("name" = String, Path, description = "The queue")),
    request_body = QueueBody,
    responses((status = 200, body = QueueSpec), (status = 400, description = "`invalid_argument` (a zero limit)", body = ErrorBody)),
    security(("bearer" = ["operate"]))
)]
async fn put(caller: AnyCaller, Path(name): Path<String>, Json(body): Json<QueueBody>) -> ApiResult {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Operate)?;
        let spec = body.spec(name)?;
        let spec = tenant.writer.call(move |store, now| store.put_queue(&spec, now)).await?;
        Ok(typed(StatusCode::OK, spec))
    })
}

/// Every queue with its counts.
#[utoipa::path(get, path = "/v1/queues", tag = "queues", responses((status = 200, body = QueuesPage)),
    security(("bearer" = ["read"])))]
async fn list(caller: AnyCaller) -> ApiResult {
    let queues = queues(&caller).await?;
    Ok(typed(StatusCode::OK, QueuesPage { queues }))
}

/// Every queue with its counts (shared with the dashboard).
pub(crate) async fn queues(caller: &AnyCaller) -> Result<Vec<QueueState>, ApiError> {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Read)?;
        Ok(tenant.writer.call(|store, now| store.queues(now)).await?)
    })
}

/// One queue: its limits, runs in progress, admitted in the rate period, waiting, and the next
/// 1,000 waiting runs in admission order with their positions.
#[utoipa::path(
    get,
    path = "/v1/queues/{name}",
    tag = "queues",
    params(("name" = String, Path, description = "The queue")),
    responses((status = 200, body = QueueState), (status = 404, description = "`not_found`", body = ErrorBody)),
    security(("bearer" = ["read"]))
)]
async fn show(caller: AnyCaller, Path(name): Path<String>) -> ApiResult {
    let state = queue(&caller, name).await?;
    Ok(typed(StatusCode::OK, state))
}

/// One queue with its waiting list (shared with the dashboard).
pub(crate) async fn queue(caller: &AnyCaller, name: String) -> Result<QueueState, ApiError> {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Read)?;
        validate_id("queue", &name)?;
        let id = name.clone();
        let state = tenant.writer.call(move |store, now| store.queue(&id, QUEUE_WAITING_SHOWN_MAX, now)).await?;
        Ok(state.ok_or_else(|| Error::not_found(format!("no queue {name:?}")))?)
    })
}
