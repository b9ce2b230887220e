//! `GET /v1/registry`: what this service serves, so that a client (or the dashboard) needs no
//! knowledge of the code: machines with their states, handlers and the tenant's consumers, and
//! workflows with their versions and input schemas.

use axum::extract::State;
use axum::http::StatusCode;
use serde::Serialize;
use serde_json::Value;
use tidemark_core::tenancy::Scope;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::{typed, ApiResult};
use crate::registry::{Database, HandlerInfo, MachineInfo};
use crate::AnyCaller;
use crate::AppState;

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(registry))
}

/// A consumer of the tenant with its handler.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RegistryConsumer {
    pub consumer_id: String,
    pub handler: String,
    /// The database of its inbox; null when its handler is not registered in this build (its
    /// events wait in the inbox, undrained).
    pub database: Option<Database>,
}

/// A registered workflow version.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RegistryWorkflow {
    pub workflow: String,
    pub version: u32,
    /// At most this many runs in flight across all workers (null: no limit).
    pub concurrency_max: Option<u32>,
    /// The JSON Schema of the input, when the definition gave one.
    #[schema(value_type = Option<Object>)]
    pub input_schema: Option<Value>,
}

/// What this service serves.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RegistryView {
    /// Flow machines (`POST /v1/flows/{flow_id}/advance`); the built-in `stream` is the
    /// machine of `POST /v1/streams/{flow_id}/events`.
    pub machines: Vec<MachineInfo>,
    /// Handlers a consumer can be declared with (`PUT /v1/consumers/{id}`).
    pub handlers: Vec<HandlerInfo>,
    /// The tenant's consumers.
    pub consumers: Vec<RegistryConsumer>,
    /// Workflows (`POST /v1/runs`), every registered version.
    pub workflows: Vec<RegistryWorkflow>,
}

/// The machines, handlers, consumers and workflows this service serves.
#[utoipa::path(
    get,
    path = "/v1/registry",
    tag = "service",
    responses((status = 200, body = RegistryView)),
    security(("bearer" = ["read"]))
)]
async fn registry(State(state): State<AppState>, caller: AnyCaller) -> ApiResult {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Read)?;
        let registry = &state.registry;
        let consumers = state
            .consumers(&tenant.id)?
            .into_iter()
            .map(|c| RegistryConsumer {
                database: registry.handler_database(&c.handler).ok(),
                consumer_id: c.consumer_id,
                handler: c.handler,
            })
            .collect();
        let workflows = tenant
            .workflows
            .infos()
            .into_iter()
            .map(|w| RegistryWorkflow {
                workflow: w.workflow,
                version: w.version,
                concurrency_max: w.concurrency_max,
                input_schema: w.input_schema,
            })
            .collect();
        let view =
            RegistryView { machines: registry.machine_infos(), handlers: registry.handler_infos(), consumers, workflows };
        Ok(typed(StatusCode::OK, view))
    })
}
