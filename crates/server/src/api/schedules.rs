//! Schedules: a registered workflow started on a cron expression or a fixed interval, each tick
//! an idempotent start of run `<schedule_id>:<tick ms>` (docs/workflows.md, "Schedules"). The
//! tenant's schedule loop ticks them.

use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tidemark_core::id::validate_id;
use tidemark_core::schedule::{schedule_codes, tick_run_id, CatchUp, Schedule, ScheduleSpec, ScheduleStore, Timing};
use tidemark_core::tenancy::Scope;
use tidemark_core::workflow::{workflow_codes, StartRequest};
use tidemark_core::Error;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::{typed, ApiError, ApiResult, ErrorBody, Json, Path};
use crate::AnyCaller;
use crate::AppState;

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list))
        .routes(routes!(put, show, delete))
        .routes(routes!(pause))
        .routes(routes!(resume))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"workflow": "order_saga", "cron": "0 9 * * MON-FRI", "timezone": "Europe/Paris",
    "catch_up": "one", "input": {"order_id": "daily", "sku": "sku-1", "quantity": 1, "amount": 100}}))]
pub struct ScheduleBody {
    /// A registered workflow (`GET /v1/registry`); each tick starts its latest version.
    #[schema(value_type = super::runs::WorkflowName)]
    pub workflow: String,
    /// The input of every run (checked against the workflow now; at most 256 KiB of JSON).
    pub input: Value,
    /// A cron expression (5 fields, or 6 with seconds first, or `@hourly`-style aliases; at most
    /// 200 bytes; no empty list element). Exactly one of `cron` and `interval_ms`.
    #[schema(min_length = 1, max_length = 200)]
    pub cron: Option<String>,
    /// A fixed interval in ms, counted from the schedule's creation (1,000..=31,622,400,000).
    #[schema(minimum = 1000, maximum = 31_622_400_000_i64)]
    #[serde(default, deserialize_with = "tidemark_core::json::optional_integer")]
    pub interval_ms: Option<i64>,
    /// The IANA time zone the cron expression is read in (default `UTC`).
    pub timezone: Option<String>,
    /// Missed ticks (more than 60 s late): `skip`, `one` (default: the latest) or `all`.
    pub catch_up: Option<CatchUp>,
}

/// The tenant's schedules.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SchedulesPage {
    /// By id.
    pub schedules: Vec<Schedule>,
}

impl ScheduleBody {
    /// The schedule `schedule_id` this body creates or replaces, checked (`ScheduleSpec::validate`:
    /// exactly one of `cron` and `interval_ms`, the expression, the interval, the zone, the
    /// input's size). Whether the workflow is registered and takes the input is the caller's check.
    pub fn spec(self, schedule_id: String) -> Result<ScheduleSpec, Error> {
        let timing = match (self.cron, self.interval_ms) {
            (Some(cron), None) => Timing::Cron(cron),
            (None, Some(ms)) => Timing::IntervalMs(ms),
            _ => {
                return Err(Error::invalid(
                    schedule_codes::INVALID_SCHEDULE,
                    "a schedule takes exactly one of cron and interval_ms",
                ))
            }
        };
        let spec = ScheduleSpec {
            schedule_id,
            workflow: self.workflow,
            input: self.input,
            timing,
            timezone: self.timezone.unwrap_or_else(|| "UTC".to_string()),
            catch_up: self.catch_up.unwrap_or_default(),
        };
        spec.validate()?;
        Ok(spec)
    }
}

/// Create or replace a schedule. 200 with the schedule and its next tick.
#[utoipa::path(
    put,
    path = "/v1/schedules/{schedule_id}",
    tag = "schedules",
    params(("schedule_id" = String, Path, description = "The schedule (an identifier of at most 80 characters)")),
    request_body = ScheduleBody,
    responses(
        (status = 200, body = Schedule),
        (status = 400, description = "`invalid_schedule`, `unknown_workflow`, `invalid_input` (the workflow's own check of its input, data the document cannot state: see `POST /v1/runs`)", body = ErrorBody),
    ),
    security(("bearer" = ["operate"]))
)]
async fn put(caller: AnyCaller, Path(schedule_id): Path<String>, Json(body): Json<ScheduleBody>) -> ApiResult {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Operate)?;
        let spec = body.spec(schedule_id)?;
        // The workflow must be registered and take the input: checked as a tick's start would be.
        let workflows = &tenant.workflows;
        let version = workflows.latest_version(&spec.workflow).ok_or_else(|| {
            Error::invalid(
                workflow_codes::UNKNOWN_WORKFLOW,
                format!("workflow {:?} is not registered; registered: {}", spec.workflow, workflows.names()),
            )
        })?;
        let probe = tick_run_id(&spec.schedule_id, 0);
        workflows.check_start(&StartRequest::new(&probe, &spec.workflow, version, spec.input.clone()))?;
        let schedule = tenant.writer.call(move |store, now| store.put_schedule(&spec, now)).await?;
        Ok(typed(StatusCode::OK, schedule))
    })
}

/// Every schedule of the tenant.
#[utoipa::path(get, path = "/v1/schedules", tag = "schedules", responses((status = 200, body = SchedulesPage)),
    security(("bearer" = ["read"])))]
async fn list(caller: AnyCaller) -> ApiResult {
    let schedules = schedules(&caller).await?;
    Ok(typed(StatusCode::OK, SchedulesPage { schedules }))
}

/// Every schedule of the tenant (shared with the dashboard).
pub(crate) async fn schedules(caller: &AnyCaller) -> Result<Vec<Schedule>, ApiError> {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Read)?;
        Ok(tenant.writer.call(|store, _| store.schedules()).await?)
    })
}

/// One schedule.
#[utoipa::path(
    get,
    path = "/v1/schedules/{schedule_id}",
    tag = "schedules",
    params(("schedule_id" = String, Path, description = "The schedule")),
    responses((status = 200, body = Schedule), (status = 404, description = "`not_found`", body = ErrorBody)),
    security(("bearer" = ["read"]))
)]
async fn show(caller: AnyCaller, Path(schedule_id): Path<String>) -> ApiResult {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Read)?;
        validate_id("schedule_id", &schedule_id)?;
        let id = schedule_id.clone();
        let schedule = tenant.writer.call(move |store, _| store.schedule(&id)).await?;
        let schedule = schedule.ok_or_else(|| Error::not_found(format!("no schedule {schedule_id:?}")))?;
        Ok(typed(StatusCode::OK, schedule))
    })
}

/// What `DELETE /v1/schedules/{id}` did.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ScheduleDeleted {
    /// `deleted`.
    #[schema(example = "deleted")]
    pub outcome: String,
    pub schedule_id: String,
}

/// Delete a schedule (the runs it started stay).
#[utoipa::path(
    delete,
    path = "/v1/schedules/{schedule_id}",
    tag = "schedules",
    params(("schedule_id" = String, Path, description = "The schedule")),
    responses((status = 200, body = ScheduleDeleted), (status = 404, description = "`not_found`", body = ErrorBody)),
    security(("bearer" = ["operate"]))
)]
async fn delete(caller: AnyCaller, Path(schedule_id): Path<String>) -> ApiResult {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Operate)?;
        validate_id("schedule_id", &schedule_id)?;
        let id = schedule_id.clone();
        if !tenant.writer.call(move |store, _| store.delete_schedule(&id)).await? {
            return Err(Error::not_found(format!("no schedule {schedule_id:?}")).into());
        }
        Ok(typed(StatusCode::OK, ScheduleDeleted { outcome: "deleted".into(), schedule_id }))
    })
}

/// Pause a schedule: it does not tick until resumed.
#[utoipa::path(
    post,
    path = "/v1/schedules/{schedule_id}/pause",
    tag = "schedules",
    params(("schedule_id" = String, Path, description = "The schedule")),
    responses((status = 200, body = Schedule), (status = 404, description = "`not_found`", body = ErrorBody)),
    security(("bearer" = ["operate"]))
)]
async fn pause(caller: AnyCaller, Path(schedule_id): Path<String>) -> ApiResult {
    set_paused(&caller, schedule_id, true).await
}

/// Resume a paused schedule from its next tick after now (the ticks of the pause are not started).
#[utoipa::path(
    post,
    path = "/v1/schedules/{schedule_id}/resume",
    tag = "schedules",
    params(("schedule_id" = String, Path, description = "The schedule")),
    responses((status = 200, body = Schedule), (status = 404, description = "`not_found`", body = ErrorBody)),
    security(("bearer" = ["operate"]))
)]
async fn resume(caller: AnyCaller, Path(schedule_id): Path<String>) -> ApiResult {
    set_paused(&caller, schedule_id, false).await
}

/// Pause or resume (shared with the dashboard).
pub(crate) async fn set_paused(caller: &AnyCaller, schedule_id: String, paused: bool) -> ApiResult {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Operate)?;
        validate_id("schedule_id", &schedule_id)?;
        let schedule = tenant.writer.call(move |store, now| store.pause_schedule(&schedule_id, paused, now)).await?;
        Ok(typed(StatusCode::OK, schedule))
    })
}
