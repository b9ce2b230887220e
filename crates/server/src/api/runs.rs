//! Workflow routes: start a run (the run id is the idempotency key), read a run with its journal,
//! list and filter runs a page at a time, the operator controls (cancel, retry, abandon, fork,
//! skip), send an event to a run, and the order saga's stock.

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post, put};
use axum::Router;
use serde::Deserialize;
use serde_json::{json, Value};
use tidemark_core::error::codes;
use tidemark_core::id::{validate_id, validate_reason};
use tidemark_core::tenancy::Scope;
use tidemark_core::workflow::{
    validate_json_size, workflow_codes, RunDetail, RunFilter, RunRecord, RunStatus, StartOutcome, StartRequest,
    WorkflowStore, RUN_STEPS_MAX, STEP_OUTPUT_BYTES_MAX, TIMER_MS_MAX, WORKFLOW_INPUT_BYTES_MAX,
};
use tidemark_core::Error;
use tidemark_engine::workflow::builtin;
use tidemark_store_sqlite::order as order_sql;

use super::{answer, page_size, ApiError, ApiResult, Json, Path, Query};
use crate::auth::Caller;
use crate::{now_ms, AppState};

/// Largest stock a SKU may be given.
const STOCK_MAX: i64 = 1_000_000_000_000;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/runs", post(start).get(list))
        .route("/v1/runs/{run_id}", get(show))
        .route("/v1/runs/{run_id}/cancel", post(cancel))
        .route("/v1/runs/{run_id}/retry", post(retry))
        .route("/v1/runs/{run_id}/abandon", post(abandon))
        .route("/v1/runs/{run_id}/fork", post(fork))
        .route("/v1/runs/{run_id}/skip", post(skip))
        .route("/v1/runs/{run_id}/events", post(send_event))
        .route("/v1/stock/{sku}", put(set_stock))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartBody {
    /// A built-in workflow: order_saga or sleepy_order.
    pub workflow: String,
    /// The idempotency key: the same run id with the same input answers the existing run.
    pub run_id: String,
    pub input: Value,
    /// At most one active run per key, oldest first.
    pub key: Option<String>,
    /// Do not run before this time (ms since the epoch).
    pub start_at_ms: Option<i64>,
}

/// 201 `started`, 200 `existing`, 409 `run_conflict`.
async fn start(caller: Caller, Json(body): Json<StartBody>) -> ApiResult {
    caller.require(Scope::Operate)?;
    validate_id("workflow", &body.workflow)?;
    let version = builtin::version(&body.workflow).ok_or_else(|| {
        Error::invalid(
            workflow_codes::UNKNOWN_WORKFLOW,
            format!("workflow {:?} is not built in; known: {}", body.workflow, builtin::names()),
        )
    })?;
    let request = StartRequest {
        run_id: body.run_id,
        workflow: body.workflow,
        version,
        input: body.input,
        key: body.key,
        start_at_ms: body.start_at_ms,
    };
    request.validate()?;
    builtin::validate_input(&request.workflow, &request.input)?;
    if let Some(at) = request.start_at_ms {
        if at.saturating_sub(now_ms()) > TIMER_MS_MAX {
            return Err(Error::invalid(
                codes::INVALID_ARGUMENT,
                format!("start_at_ms is more than {TIMER_MS_MAX} ms ahead"),
            )
            .into());
        }
    }
    let outcome = caller.tenant.worker.start(vec![request]).await?.remove(0);
    let status = match &outcome {
        StartOutcome::Started { .. } => StatusCode::CREATED,
        StartOutcome::Existing { .. } => StatusCode::OK,
        StartOutcome::Conflict { run_id, reason } => {
            return Err(Error::invalid(workflow_codes::RUN_CONFLICT, format!("run {run_id:?}: {reason}")).into())
        }
    };
    Ok(answer(status, serde_json::to_value(&outcome).expect("outcomes serialise")))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    pub status: Option<String>,
    pub workflow: Option<String>,
    pub created_after_ms: Option<i64>,
    pub created_before_ms: Option<i64>,
    pub limit: Option<usize>,
    /// The `next_after` of the previous page.
    pub after: Option<String>,
}

async fn list(State(state): State<AppState>, caller: Caller, Query(query): Query<ListQuery>) -> ApiResult {
    let (runs, next_after) = list_runs(&state, &caller, query).await?;
    Ok(answer(StatusCode::OK, json!({"runs": runs, "next_after": next_after})))
}

/// A page of runs and the `next_after` of the next page (shared with the dashboard).
pub(crate) async fn list_runs(
    state: &AppState,
    caller: &Caller,
    query: ListQuery,
) -> Result<(Vec<RunRecord>, Option<String>), ApiError> {
    caller.require(Scope::Read)?;
    let status = query
        .status
        .map(|s| {
            RunStatus::parse(&s).ok_or_else(|| {
                let known: Vec<&str> = RunStatus::ALL.iter().map(|s| s.as_str()).collect();
                Error::invalid(
                    codes::INVALID_ARGUMENT,
                    format!("unknown run status {s:?}; known: {}", known.join(", ")),
                )
            })
        })
        .transpose()?;
    if let Some(workflow) = &query.workflow {
        validate_id("workflow", workflow)?;
    }
    let limit = page_size(state, query.limit)?;
    let after = query.after.as_deref().map(RunFilter::parse_page).transpose()?;
    let filter = RunFilter {
        status,
        workflow: query.workflow,
        created_after_ms: query.created_after_ms,
        created_before_ms: query.created_before_ms,
        after,
    };
    let runs = caller.tenant.writer.call(move |store, _| store.list_runs(&filter, limit)).await?;
    let next_after = RunFilter::next_page(&runs, limit);
    Ok((runs, next_after))
}

async fn show(caller: Caller, Path(run_id): Path<String>) -> ApiResult {
    let detail = run_detail(&caller, run_id).await?;
    Ok(answer(StatusCode::OK, serde_json::to_value(&detail).expect("runs serialise")))
}

/// A run with its journal, attempts and events (shared with the dashboard).
pub(crate) async fn run_detail(caller: &Caller, run_id: String) -> Result<RunDetail, ApiError> {
    caller.require(Scope::Read)?;
    validate_id("run_id", &run_id)?;
    let id = run_id.clone();
    let detail = caller.tenant.writer.call(move |store, _| store.run(&id)).await?;
    Ok(detail.ok_or_else(|| Error::not_found(format!("no run {run_id:?}")))?)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReasonBody {
    pub reason: String,
}

/// The operator controls that take only a reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Control {
    Cancel,
    Retry,
    Abandon,
}

impl Control {
    /// The `outcome` word of the answer.
    pub(crate) fn outcome(self) -> &'static str {
        match self {
            Control::Cancel => "cancel_requested",
            Control::Retry => "retried",
            Control::Abandon => "abandoned",
        }
    }
}

/// The shared shape of cancel, retry and abandon (shared with the dashboard).
pub(crate) async fn control(
    caller: &Caller,
    run_id: String,
    reason: String,
    control: Control,
) -> Result<RunRecord, ApiError> {
    caller.require(Scope::Operate)?;
    validate_id("run_id", &run_id)?;
    validate_reason(&reason)?;
    let run = caller
        .tenant
        .writer
        .call(move |store, now| match control {
            Control::Cancel => store.cancel(&run_id, &reason, now),
            Control::Retry => store.retry(&run_id, &reason, now),
            Control::Abandon => store.abandon(&run_id, &reason, now),
        })
        .await?;
    Ok(run)
}

async fn controlled(caller: Caller, run_id: String, reason: String, which: Control) -> ApiResult {
    let run = control(&caller, run_id, reason, which).await?;
    Ok(answer(StatusCode::OK, json!({"outcome": which.outcome(), "run": run})))
}

async fn cancel(caller: Caller, Path(run_id): Path<String>, Json(body): Json<ReasonBody>) -> ApiResult {
    controlled(caller, run_id, body.reason, Control::Cancel).await
}

async fn retry(caller: Caller, Path(run_id): Path<String>, Json(body): Json<ReasonBody>) -> ApiResult {
    controlled(caller, run_id, body.reason, Control::Retry).await
}

async fn abandon(caller: Caller, Path(run_id): Path<String>, Json(body): Json<ReasonBody>) -> ApiResult {
    controlled(caller, run_id, body.reason, Control::Abandon).await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkBody {
    /// The new run keeps the journal entries before this step.
    pub from_step: u32,
    pub new_run_id: String,
}

async fn fork(caller: Caller, Path(run_id): Path<String>, Json(body): Json<ForkBody>) -> ApiResult {
    let run = fork_run(&caller, run_id, body).await?;
    Ok(answer(StatusCode::CREATED, json!({"outcome": "forked", "run": run})))
}

/// Fork a run (shared with the dashboard).
pub(crate) async fn fork_run(caller: &Caller, run_id: String, body: ForkBody) -> Result<RunRecord, ApiError> {
    caller.require(Scope::Operate)?;
    validate_id("run_id", &run_id)?;
    validate_id("new_run_id", &body.new_run_id)?;
    if body.from_step > RUN_STEPS_MAX {
        return Err(Error::invalid(codes::INVALID_SEQ, format!("from_step must be 0..={RUN_STEPS_MAX}")).into());
    }
    let run =
        caller.tenant.writer.call(move |store, now| store.fork(&run_id, body.from_step, &body.new_run_id, now)).await?;
    Ok(run)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SkipBody {
    /// The journal seq of the step to skip.
    pub step: u32,
    /// The output the step is recorded with (default null).
    #[serde(default)]
    pub output: Value,
    pub reason: String,
}

async fn skip(caller: Caller, Path(run_id): Path<String>, Json(body): Json<SkipBody>) -> ApiResult {
    let run = skip_step(&caller, run_id, body).await?;
    Ok(answer(StatusCode::OK, json!({"outcome": "skipped", "run": run})))
}

/// Skip a step of a run (shared with the dashboard).
pub(crate) async fn skip_step(caller: &Caller, run_id: String, body: SkipBody) -> Result<RunRecord, ApiError> {
    caller.require(Scope::Operate)?;
    validate_id("run_id", &run_id)?;
    validate_reason(&body.reason)?;
    if body.step >= RUN_STEPS_MAX {
        return Err(Error::invalid(codes::INVALID_SEQ, format!("step must be 0..{RUN_STEPS_MAX}")).into());
    }
    validate_json_size("output", &body.output, STEP_OUTPUT_BYTES_MAX, codes::PAYLOAD_TOO_LARGE)?;
    let run = caller
        .tenant
        .writer
        .call(move |store, now| store.skip_step(&run_id, body.step, &body.output, &body.reason, now))
        .await?;
    Ok(run)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventBody {
    pub name: String,
    /// Idempotency: the same event id twice is one event.
    pub event_id: String,
    #[serde(default)]
    pub payload: Value,
}

async fn send_event(caller: Caller, Path(run_id): Path<String>, Json(body): Json<EventBody>) -> ApiResult {
    caller.require(Scope::Operate)?;
    validate_id("run_id", &run_id)?;
    validate_id("event name", &body.name)?;
    validate_id("event_id", &body.event_id)?;
    validate_json_size("payload", &body.payload, WORKFLOW_INPUT_BYTES_MAX, codes::PAYLOAD_TOO_LARGE)?;
    let (rid, eid, name) = (run_id.clone(), body.event_id.clone(), body.name.clone());
    let new =
        caller.tenant.writer.call(move |store, now| store.send_event(&rid, &eid, &name, &body.payload, now)).await?;
    Ok(answer(
        StatusCode::OK,
        json!({"outcome": if new {"sent"} else {"duplicate"}, "run_id": run_id, "event_id": body.event_id, "name": body.name}),
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StockBody {
    pub quantity: i64,
}

/// The order saga's stock of one SKU (admin: it is reference data, not a run).
async fn set_stock(caller: Caller, Path(sku): Path<String>, Json(body): Json<StockBody>) -> ApiResult {
    caller.require(Scope::Admin)?;
    validate_id("sku", &sku)?;
    if !(0..=STOCK_MAX).contains(&body.quantity) {
        return Err(Error::invalid(codes::INVALID_ARGUMENT, format!("quantity must be 0..={STOCK_MAX}")).into());
    }
    let stock = caller
        .tenant
        .writer
        .call(move |store, _| {
            let conn = store.connection();
            order_sql::set_stock(conn, &sku, body.quantity)?;
            Ok(json!({"sku": sku, "stock": order_sql::stock(conn, &sku)?}))
        })
        .await?;
    Ok(answer(StatusCode::OK, json!({"outcome": "stocked", "stock": stock})))
}
