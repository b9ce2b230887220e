//! Workflow routes: start a run (the run id is the idempotency key), read a run with its journal,
//! list and filter runs a page at a time, the operator controls (cancel, retry, abandon, fork,
//! skip), and send an event to a run.

use std::collections::HashMap;

use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tidemark_core::error::codes;
use tidemark_core::id::{validate_id, validate_reason};
use tidemark_core::tenancy::Scope;
use tidemark_core::workflow::{
    deadline_after, parse_event_cursor, validate_json_size, validate_starts, workflow_codes, DetailPage, RunDetail,
    RunFilter, RunRecord, RunStatus, StartOutcome, StartRequest, WorkflowStore, RUN_STEPS_MAX, STEP_OUTPUT_BYTES_MAX,
    WORKFLOW_INPUT_BYTES_MAX,
};
use tidemark_core::Error;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::{fit_page, json_len, page_size, typed, ApiError, ApiResult, ErrorBody, Json, Path, Query};
use crate::AnyCaller;
use crate::{now_ms, AppState};

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(start, list))
        .routes(routes!(show))
        .routes(routes!(result))
        .routes(routes!(published))
        .routes(routes!(cancel))
        .routes(routes!(retry))
        .routes(routes!(abandon))
        .routes(routes!(fork))
        .routes(routes!(skip))
        .routes(routes!(send_event))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"workflow": "order_saga", "run_id": "order-1", "input": {"order_id": "order-1", "sku": "sku-1", "quantity": 2, "amount": 500}}))]
pub struct StartBody {
    /// A registered workflow (`GET /v1/registry`); the run is pinned to its latest version.
    #[schema(value_type = WorkflowName)]
    pub workflow: String,
    /// The idempotency key: the same run id with the same input answers the existing run.
    #[schema(pattern = "^[A-Za-z0-9_.:-]{1,100}$")]
    pub run_id: String,
    /// The workflow's input (see docs/workflows.md; at most 256 KiB of JSON).
    pub input: Value,
    /// At most one active run per key, oldest first.
    #[schema(pattern = "^[A-Za-z0-9_.:-]{1,100}$")]
    pub key: Option<String>,
    /// Do not run before this time (ms since the epoch): at most the end of the UTC day 365 days
    /// after the day of the request (`tidemark_core::workflow::start_at_ms_max`), the `maximum`
    /// the document states on the day it is served.
    #[serde(default, deserialize_with = "tidemark_core::json::optional_integer")]
    pub start_at_ms: Option<i64>,
    /// Run through a declared queue (`PUT /v1/queues/{name}`), with a priority (lower first)
    /// and an optional deduplication id; not with `key`.
    pub queue: Option<tidemark_core::queue::Enqueue>,
    /// The run's deadline, this many ms after the start is received (1..=366 days): when it
    /// passes, the run is cancelled at its next step boundary (a saga compensates first) and ends
    /// `cancelled` with `deadline_passed`. Its children inherit it.
    #[schema(minimum = 1, maximum = 31_622_400_000_i64)]
    #[serde(default, deserialize_with = "tidemark_core::json::optional_integer")]
    pub timeout_ms: Option<i64>,
}

impl StartBody {
    /// The start this body asks for, of `version` of its workflow, received at `now`, checked as
    /// every store checks a start (`validate_starts`: ids, input size, `start_at_ms`, queue,
    /// deadline). Whether the workflow is registered and takes the input is the caller's check.
    pub fn request(self, version: u32, now: i64) -> Result<StartRequest, Error> {
        let request = StartRequest {
            run_id: self.run_id,
            workflow: self.workflow,
            version,
            input: self.input,
            key: self.key,
            start_at_ms: self.start_at_ms,
            queue: self.queue,
            deadline_ms: deadline_after(now, self.timeout_ms)?,
        };
        validate_starts(std::slice::from_ref(&request), now)?;
        Ok(request)
    }
}

/// A registered workflow's name (documentation of `StartBody::workflow`; the served document
/// lists the workflows this server registers).
#[derive(ToSchema)]
#[schema(pattern = "^[A-Za-z0-9_.:-]{1,100}$")]
#[allow(dead_code)]
pub struct WorkflowName(String);

/// Start a run. 201 `started`, 200 `existing` (same run id and input), 409 `run_conflict`.
#[utoipa::path(
    post,
    path = "/v1/runs",
    tag = "runs",
    request_body = StartBody,
    responses(
        (status = 201, description = "`started`", body = StartOutcome),
        (status = 200, description = "`existing`: this run id was started with the same input", body = StartOutcome),
        (status = 400, description = "`unknown_workflow`; `invalid_input`: the workflow's own check of its input refused it (a check of data the document cannot state: a workflow that registers no input schema takes any JSON here); `invalid_argument`: a `start_at_ms` after the document's `maximum` or a `timeout_ms` out of range, a `queue` with a `key`", body = ErrorBody),
        (status = 409, description = "`run_conflict`: this run id was started with another workflow or input", body = ErrorBody),
    ),
    security(("bearer" = ["operate"]))
)]
async fn start(caller: AnyCaller, Json(body): Json<StartBody>) -> ApiResult {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Operate)?;
        validate_id("workflow", &body.workflow)?;
        let workflows = &tenant.workflows;
        let version = workflows.latest_version(&body.workflow).ok_or_else(|| {
            Error::invalid(
                workflow_codes::UNKNOWN_WORKFLOW,
                format!("workflow {:?} is not registered; registered: {}", body.workflow, workflows.names()),
            )
        })?;
        let now = now_ms();
        let request = body.request(version, now)?;
        workflows.check_start(&request)?;
        let outcome = tenant.worker()?.start(vec![request]).await?.remove(0);
        let status = match &outcome {
            StartOutcome::Started { .. } => StatusCode::CREATED,
            StartOutcome::Existing { .. } => StatusCode::OK,
            StartOutcome::Conflict { run_id, reason } => {
                return Err(Error::invalid(workflow_codes::RUN_CONFLICT, format!("run {run_id:?}: {reason}")).into())
            }
        };
        Ok(typed::<StartOutcome>(status, outcome))
    })
}

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Only runs with this status.
    #[param(value_type = Option<RunStatus>)]
    pub status: Option<String>,
    /// Only runs of this workflow.
    #[param(pattern = "^[A-Za-z0-9_.:-]{1,100}$")]
    pub workflow: Option<String>,
    /// Runs created strictly after this time (ms since the epoch).
    #[serde(default, deserialize_with = "super::query_integer")]
    pub created_after_ms: Option<i64>,
    /// Runs created strictly before this time (ms since the epoch).
    #[serde(default, deserialize_with = "super::query_integer")]
    pub created_before_ms: Option<i64>,
    /// Page size, 1..=page_size_max (default 100).
    #[param(minimum = 1)]
    #[serde(default, deserialize_with = "super::query_integer")]
    pub limit: Option<usize>,
    /// The `next_after` of the previous page: `<created_at_ms>:<run_id>`
    /// (`tidemark_core::workflow::PAGE_CURSOR_PATTERN`).
    #[param(pattern = "^-?[0-9]{1,18}:[A-Za-z0-9_.:-]{1,100}$")]
    pub after: Option<String>,
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RunsPage {
    /// Oldest first.
    pub runs: Vec<RunRecord>,
    /// The `after` of the next page; null on the last page.
    pub next_after: Option<String>,
    /// True when the page stopped before `limit` items at `limits.page_bytes_max` (the JSON of
    /// its items), so more may follow.
    pub truncated: bool,
}

/// Runs, oldest first, filtered, a page at a time.
#[utoipa::path(
    get,
    path = "/v1/runs",
    tag = "runs",
    params(ListQuery),
    responses((status = 200, body = RunsPage)),
    security(("bearer" = ["read"]))
)]
async fn list(State(state): State<AppState>, caller: AnyCaller, Query(query): Query<ListQuery>) -> ApiResult {
    Ok(typed(StatusCode::OK, list_runs(&state, &caller, query).await?))
}

/// A page of runs and the `next_after` of the next page (shared with the dashboard).
pub(crate) async fn list_runs(state: &AppState, caller: &AnyCaller, query: ListQuery) -> Result<RunsPage, ApiError> {
    crate::on_tenant!(&caller.tenant, tenant => {
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
        let mut runs = tenant.writer.call(move |store, _| store.list_runs(&filter, limit)).await?;
        // A page cut at `limits.page_bytes_max` continues after its last run.
        let truncated = fit_page(state, &mut runs);
        let next_after = RunFilter::next_page(&runs, if truncated { runs.len() } else { limit });
        Ok(RunsPage { runs, next_after, truncated })
    })
}

#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct DetailQuery {
    /// Read the journal after this position (the `next_after_seq` of the page before); from
    /// the start when absent.
    #[param(minimum = 0, maximum = 9999)]
    #[serde(default, deserialize_with = "super::query_integer")]
    pub after_seq: Option<u32>,
    /// Read the events no wait consumed yet after this one (the `next_events_after` of the page
    /// before, given with its `next_after_seq`): `<received_at_ms>:<event_id>`.
    #[param(pattern = "^-?[0-9]{1,18}:[A-Za-z0-9_.:-]{1,100}$")]
    pub events_after: Option<String>,
    /// At most this many journal entries, and at most this many unconsumed events
    /// (1..=`limits.page_size_max`, default 100).
    #[param(minimum = 1, maximum = 1000)]
    #[serde(default, deserialize_with = "super::query_integer")]
    pub limit: Option<usize>,
}

/// One run with its journal, the attempts of its steps with their errors (the last 100 of each
/// position), and its events, a page of journal positions at a time: at most `limit` entries
/// after `after_seq`, cut before the position that would take the answer past
/// `limits.page_bytes_max` (an entry with its attempts and the events it consumed; the first
/// always stays), and `next_after_seq` set when positions follow. The events no wait consumed
/// yet come on the page that ends the journal, at most `limit` of them and as many as fit the
/// same bound (on a page with no entry, the first always goes); when more follow,
/// `next_events_after` is set, and the next page is read with `after_seq=<next_after_seq>`
/// (absent when null) and `events_after=<next_events_after>`.
#[utoipa::path(
    get,
    path = "/v1/runs/{run_id}",
    tag = "runs",
    params(("run_id" = String, Path, description = "The run"), DetailQuery),
    responses(
        (status = 200, body = RunDetail),
        (status = 400, description = "`limit_exceeded`: `after_seq` or `limit` out of range; `invalid_argument`, `invalid_id`: an `events_after` that is not a cursor a page gave", body = ErrorBody),
        (status = 404, description = "`not_found`: no such run", body = ErrorBody),
    ),
    security(("bearer" = ["read"]))
)]
async fn show(
    State(state): State<AppState>,
    caller: AnyCaller,
    Path(run_id): Path<String>,
    Query(query): Query<DetailQuery>,
) -> ApiResult {
    let detail = run_detail(&state, &caller, run_id, &query).await?;
    Ok(typed::<RunDetail>(StatusCode::OK, detail))
}

/// A page of a run's detail (shared with the dashboard).
pub(crate) async fn run_detail(
    state: &AppState,
    caller: &AnyCaller,
    run_id: String,
    query: &DetailQuery,
) -> Result<RunDetail, ApiError> {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Read)?;
        let limit = page_size(state, query.limit)?;
        let events_after = query.events_after.as_deref().map(parse_event_cursor).transpose()?;
        let page = DetailPage { after_seq: query.after_seq, events_after, limit };
        page.validate(&run_id)?;
        let id = run_id.clone();
        let read = page.clone();
        let detail = tenant.writer.call(move |store, _| store.run_page(&id, &read)).await?;
        let mut detail = detail.ok_or_else(|| Error::not_found(format!("no run {run_id:?}")))?;
        fit_detail(state.config.limits.page_bytes_max, &mut detail, &page);
        Ok(detail)
    })
}

/// Cut a page of a run's detail to the positions whose JSON (the entry, its attempts, the events
/// it consumed, counted after the run's record) fits in `budget` bytes; the first position always
/// stays. The events no wait consumed (only on the page that ends the journal) follow in what is
/// left of the budget; on a page with no entry, the first always stays.
fn fit_detail(budget: usize, detail: &mut RunDetail, page: &DetailPage) {
    // Each item with the comma after it.
    let mut used = json_len(&detail.run) + 1;
    let mut extra: HashMap<u32, usize> = HashMap::new();
    for attempt in &detail.attempts {
        *extra.entry(attempt.seq).or_default() += json_len(attempt) + 1;
    }
    for event in &detail.events {
        if let Some(seq) = event.consumed_by_seq {
            *extra.entry(seq).or_default() += json_len(event) + 1;
        }
    }
    let cut = detail.journal.iter().position(|entry| {
        used += json_len(entry) + 1 + extra.get(&entry.seq).copied().unwrap_or(0);
        used > budget
    });
    if let Some(cut) = cut {
        detail.keep_entries(cut.max(1));
        // The bound is spent (or the first position passed it alone): no unconsumed event goes.
        detail.keep_unconsumed(0, page);
        return;
    }
    let unconsumed = detail.events.iter().filter(|event| event.consumed_by_seq.is_none());
    let fit = unconsumed
        .map(|event| {
            used += json_len(event) + 1;
            used
        })
        .take_while(|used| *used <= budget)
        .count();
    let least = usize::from(detail.journal.is_empty());
    detail.keep_unconsumed(fit.max(least), page);
}

/// The longest `wait_ms` of `GET /v1/runs/{run_id}/result`: one minute.
pub use tidemark_core::workflow::RESULT_WAIT_MS_MAX;

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ResultQuery {
    /// How long to wait for the run to end, in ms (0..=60000; default 0: answer at once).
    #[param(minimum = 0, maximum = 60000)]
    #[serde(default, deserialize_with = "super::query_integer")]
    pub wait_ms: Option<u64>,
}

impl ResultQuery {
    /// How long the caller waits, in ms (0 when not given; `invalid_argument` past the bound).
    fn wait_ms(&self) -> Result<u64, Error> {
        let wait_ms = self.wait_ms.unwrap_or(0);
        if wait_ms > RESULT_WAIT_MS_MAX {
            return Err(Error::invalid(
                codes::INVALID_ARGUMENT,
                format!("wait_ms is {wait_ms}; at most {RESULT_WAIT_MS_MAX}"),
            ));
        }
        Ok(wait_ms)
    }
}

/// How a run ended, or that it has not yet.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RunResult {
    /// The run that ended: the one asked for, or the last run of its chain when it continued as
    /// new (`continued` runs are followed).
    pub run_id: String,
    /// True once the run (its chain's last run) has a terminal status (completed, compensated,
    /// failed, cancelled, parked).
    pub done: bool,
    pub status: RunStatus,
    /// The workflow's output, when `completed`.
    pub result: Option<Value>,
    /// Why the run failed, compensated, was cancelled or parked.
    pub error: Option<String>,
}

/// Has the run (or its chain) ended? A `continued` run goes on as its continuation.
fn ended_for_good(run: &RunRecord) -> bool {
    run.status.is_terminal() && run.status != RunStatus::Continued
}

/// Await a run's result: 200 with the output or the terminal error once the run has ended,
/// waiting up to `wait_ms` for that (a long poll); 202 with the status it has when the wait ends
/// first (ask again). A server shutting down answers at once.
#[utoipa::path(
    get,
    path = "/v1/runs/{run_id}/result",
    tag = "runs",
    params(("run_id" = String, Path, description = "The run"), ResultQuery),
    responses(
        (status = 200, description = "The run has ended", body = RunResult),
        (status = 202, description = "The run has not ended yet", body = RunResult),
        (status = 404, description = "`not_found`: no such run", body = ErrorBody),
    ),
    security(("bearer" = ["read"]))
)]
async fn result(
    State(state): State<AppState>,
    caller: AnyCaller,
    Path(run_id): Path<String>,
    Query(query): Query<ResultQuery>,
) -> ApiResult {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Read)?;
        validate_id("run_id", &run_id)?;
        let wait_ms = query.wait_ms()?;
        let worker = tenant.worker()?.clone();
        let mut shutdown = state.shutdown_signal();
        let ended = tokio::select! {
            ended = worker.wait_for_end(&run_id, Some(std::time::Duration::from_millis(wait_ms))) => ended?,
            _ = shutdown.wait_for(|down| *down) => None,
        };
        let (status, run) = match ended {
            Some(run) => (StatusCode::OK, run),
            None => {
                let id = run_id.clone();
                let detail = tenant.writer.call(move |store, _| store.run(&id)).await?;
                let run = detail.ok_or_else(|| Error::not_found(format!("no run {run_id:?}")))?.run;
                // It may have ended between the wait and this read (a run that continued as new has
                // not: its chain goes on).
                (if ended_for_good(&run) { StatusCode::OK } else { StatusCode::ACCEPTED }, run)
            }
        };
        let body = RunResult {
            done: ended_for_good(&run),
            run_id: run.run_id,
            status: run.status,
            result: run.result,
            error: run.error,
        };
        Ok(typed(status, body))
    })
}

/// Read what a run published under a key (`ctx.set_event`): 200 with the latest value, waiting up
/// to `wait_ms` (0..=60000) for it to be published; 404 `not_found` when the run is unknown or the
/// key was not published by then.
#[utoipa::path(
    get,
    path = "/v1/runs/{run_id}/events/{key}",
    tag = "runs",
    params(("run_id" = String, Path, description = "The run"), ("key" = String, Path, description = "The key"), ResultQuery),
    responses(
        (status = 200, body = tidemark_core::workflow::PublishedValue),
        (status = 404, description = "`not_found`: no such run, or nothing published under the key yet", body = ErrorBody),
    ),
    security(("bearer" = ["read"]))
)]
async fn published(
    State(state): State<AppState>,
    caller: AnyCaller,
    Path((run_id, key)): Path<(String, String)>,
    Query(query): Query<ResultQuery>,
) -> ApiResult {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Read)?;
        validate_id("run_id", &run_id)?;
        validate_id("key", &key)?;
        let wait_ms = query.wait_ms()?;
        let handle = tenant.handle(&run_id)?;
        let mut shutdown = state.shutdown_signal();
        let found: Option<Value> = tokio::select! {
            found = handle.get_event(&key, std::time::Duration::from_millis(wait_ms)) => found?,
            _ = shutdown.wait_for(|down| *down) => None,
        };
        if found.is_none() {
            return Err(Error::not_found(format!("run {run_id:?} has published nothing under {key:?}")).into());
        }
        let (id, k) = (run_id.clone(), key.clone());
        let value = tenant.writer.call(move |store, _| store.published(&id, &k)).await?;
        let value = value.ok_or_else(|| Error::not_found(format!("run {run_id:?} has published nothing under {key:?}")))?;
        Ok(typed(StatusCode::OK, value))
    })
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"reason": "customer asked"}))]
pub struct ReasonBody {
    /// Recorded in the run's history (1..=1000 bytes).
    #[schema(min_length = 1, max_length = 1000, pattern = "\\S")]
    pub reason: String,
}

/// A run after an operator control.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RunChanged {
    /// `cancel_requested`, `retried`, `abandoned`, `forked` or `skipped`.
    #[schema(example = "retried")]
    pub outcome: String,
    pub run: RunRecord,
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

/// Cancel, retry or abandon a run (shared with the dashboard).
pub(crate) async fn control(
    caller: &AnyCaller,
    run_id: String,
    reason: String,
    which: Control,
) -> Result<RunRecord, ApiError> {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Operate)?;
        validate_id("run_id", &run_id)?;
        validate_reason(&reason)?;
        Ok(tenant
            .writer
            .call(move |store, now| match which {
                Control::Cancel => store.cancel(&run_id, &reason, now),
                Control::Retry => store.retry(&run_id, &reason, now),
                Control::Abandon => store.abandon(&run_id, &reason, now),
            })
            .await?)
    })
}

async fn controlled(caller: AnyCaller, run_id: String, reason: String, which: Control) -> ApiResult {
    let run = control(&caller, run_id, reason, which).await?;
    Ok(typed(StatusCode::OK, RunChanged { outcome: which.outcome().into(), run }))
}

/// Request cancellation: a saga compensates first, then the run ends `cancelled`.
#[utoipa::path(
    post,
    path = "/v1/runs/{run_id}/cancel",
    tag = "runs",
    params(("run_id" = String, Path, description = "The run")),
    request_body = ReasonBody,
    responses(
        (status = 200, description = "`cancel_requested`", body = RunChanged),
        (status = 404, description = "`not_found`: no such run", body = ErrorBody),
        (status = 409, description = "`invalid_state_change`: the run is finished", body = ErrorBody),
    ),
    security(("bearer" = ["operate"]))
)]
async fn cancel(caller: AnyCaller, Path(run_id): Path<String>, Json(body): Json<ReasonBody>) -> ApiResult {
    controlled(caller, run_id, body.reason, Control::Cancel).await
}

/// Retry a failed or parked run from its failed step, with a fresh attempt budget.
#[utoipa::path(
    post,
    path = "/v1/runs/{run_id}/retry",
    tag = "runs",
    params(("run_id" = String, Path, description = "The run")),
    request_body = ReasonBody,
    responses(
        (status = 200, description = "`retried`", body = RunChanged),
        (status = 404, description = "`not_found`: no such run", body = ErrorBody),
        (status = 409, description = "`invalid_state_change`: the run is not failed or parked", body = ErrorBody),
    ),
    security(("bearer" = ["operate"]))
)]
async fn retry(caller: AnyCaller, Path(run_id): Path<String>, Json(body): Json<ReasonBody>) -> ApiResult {
    controlled(caller, run_id, body.reason, Control::Retry).await
}

/// Give up on an active (or parked) run: it ends `cancelled`, nothing compensated.
#[utoipa::path(
    post,
    path = "/v1/runs/{run_id}/abandon",
    tag = "runs",
    params(("run_id" = String, Path, description = "The run")),
    request_body = ReasonBody,
    responses(
        (status = 200, description = "`abandoned`", body = RunChanged),
        (status = 404, description = "`not_found`: no such run", body = ErrorBody),
        (status = 409, description = "`invalid_state_change`: the run is finished (and not parked)", body = ErrorBody),
    ),
    security(("bearer" = ["operate"]))
)]
async fn abandon(caller: AnyCaller, Path(run_id): Path<String>, Json(body): Json<ReasonBody>) -> ApiResult {
    controlled(caller, run_id, body.reason, Control::Abandon).await
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"from_step": 1, "new_run_id": "order-1-again"}))]
pub struct ForkBody {
    /// The new run keeps the journal entries before this step.
    #[schema(maximum = 10_000)]
    #[serde(deserialize_with = "tidemark_core::json::integer")]
    pub from_step: u32,
    #[schema(pattern = "^[A-Za-z0-9_.:-]{1,100}$")]
    pub new_run_id: String,
}

impl ForkBody {
    /// `new_run_id` is an id and `from_step` at most the longest journal (`invalid_seq`).
    pub fn check(&self) -> Result<(), Error> {
        validate_id("new_run_id", &self.new_run_id)?;
        if self.from_step > RUN_STEPS_MAX {
            return Err(Error::invalid(codes::INVALID_SEQ, format!("from_step must be 0..={RUN_STEPS_MAX}")));
        }
        Ok(())
    }
}

/// Start a new run as a copy of this one whose journal keeps the steps before `from_step`.
#[utoipa::path(
    post,
    path = "/v1/runs/{run_id}/fork",
    tag = "runs",
    params(("run_id" = String, Path, description = "The run")),
    request_body = ForkBody,
    responses(
        (status = 201, description = "`forked`: the new run", body = RunChanged),
        (status = 400, description = "`invalid_seq`: `from_step` is past the run's journal (a bound of the run's own data, which the document's `maximum`, the longest journal, cannot state)", body = ErrorBody),
        (status = 404, description = "`not_found`: no such run", body = ErrorBody),
        (status = 409, description = "`already_exists` (the new run id is taken) or `invalid_state_change`", body = ErrorBody),
    ),
    security(("bearer" = ["operate"]))
)]
async fn fork(caller: AnyCaller, Path(run_id): Path<String>, Json(body): Json<ForkBody>) -> ApiResult {
    let run = fork_run(&caller, run_id, body).await?;
    Ok(typed(StatusCode::CREATED, RunChanged { outcome: "forked".into(), run }))
}

/// Fork a run (shared with the dashboard).
pub(crate) async fn fork_run(caller: &AnyCaller, run_id: String, body: ForkBody) -> Result<RunRecord, ApiError> {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Operate)?;
        validate_id("run_id", &run_id)?;
        body.check()?;
        Ok(tenant.writer.call(move |store, now| store.fork(&run_id, body.from_step, &body.new_run_id, now)).await?)
    })
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"step": 3, "output": {"charged": "by hand"}, "reason": "charged by phone"}))]
pub struct SkipStepBody {
    /// The journal seq of the step to skip.
    #[schema(maximum = 9_999)]
    #[serde(deserialize_with = "tidemark_core::json::integer")]
    pub step: u32,
    /// The output the step is recorded with (default null).
    #[serde(default)]
    pub output: Value,
    #[schema(min_length = 1, max_length = 1000, pattern = "\\S")]
    pub reason: String,
}

impl SkipStepBody {
    /// The reason, `step` below the longest journal (`invalid_seq`) and the output's size
    /// (`payload_too_large`).
    pub fn check(&self) -> Result<(), Error> {
        validate_reason(&self.reason)?;
        if self.step >= RUN_STEPS_MAX {
            return Err(Error::invalid(codes::INVALID_SEQ, format!("step must be 0..{RUN_STEPS_MAX}")));
        }
        validate_json_size("output", &self.output, STEP_OUTPUT_BYTES_MAX, codes::PAYLOAD_TOO_LARGE)
    }
}

/// Mark a failed, retrying or waiting step as skipped with an operator-supplied output.
#[utoipa::path(
    post,
    path = "/v1/runs/{run_id}/skip",
    tag = "runs",
    params(("run_id" = String, Path, description = "The run")),
    request_body = SkipStepBody,
    responses(
        (status = 200, description = "`skipped`", body = RunChanged),
        (status = 404, description = "`not_found`: no such run or step", body = ErrorBody),
        (status = 409, description = "`invalid_state_change`: the step cannot be skipped", body = ErrorBody),
    ),
    security(("bearer" = ["operate"]))
)]
async fn skip(caller: AnyCaller, Path(run_id): Path<String>, Json(body): Json<SkipStepBody>) -> ApiResult {
    let run = skip_step(&caller, run_id, body).await?;
    Ok(typed(StatusCode::OK, RunChanged { outcome: "skipped".into(), run }))
}

/// Record a step as skipped with an output (shared with the dashboard).
pub(crate) async fn skip_step(caller: &AnyCaller, run_id: String, body: SkipStepBody) -> Result<RunRecord, ApiError> {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Operate)?;
        validate_id("run_id", &run_id)?;
        body.check()?;
        Ok(tenant
            .writer
            .call(move |store, now| store.skip_step(&run_id, body.step, &body.output, &body.reason, now))
            .await?)
    })
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"name": "approval", "event_id": "approval-order-1", "payload": {"approved": true}}))]
pub struct EventBody {
    /// The event name a waiting run waits for.
    #[schema(pattern = "^[A-Za-z0-9_.:-]{1,100}$")]
    pub name: String,
    /// Idempotency: the same event id twice is one event.
    #[schema(pattern = "^[A-Za-z0-9_.:-]{1,100}$")]
    pub event_id: String,
    #[serde(default)]
    pub payload: Value,
}

impl EventBody {
    /// The name and event id are ids, the payload at most 256 KiB (`payload_too_large`).
    pub fn check(&self) -> Result<(), Error> {
        validate_id("event name", &self.name)?;
        validate_id("event_id", &self.event_id)?;
        validate_json_size("payload", &self.payload, WORKFLOW_INPUT_BYTES_MAX, codes::PAYLOAD_TOO_LARGE)
    }
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EventSent {
    /// `sent`, or `duplicate` (this event id was sent before).
    #[schema(example = "sent")]
    pub outcome: String,
    pub run_id: String,
    pub event_id: String,
    pub name: String,
}

/// Send an event to a run (kept until a wait of that name consumes it).
#[utoipa::path(
    post,
    path = "/v1/runs/{run_id}/events",
    tag = "runs",
    params(("run_id" = String, Path, description = "The run")),
    request_body = EventBody,
    responses(
        (status = 200, description = "`sent` or `duplicate`", body = EventSent),
        (status = 404, description = "`not_found`: no such run", body = ErrorBody),
        (status = 409, description = "`invalid_state_change`: the run is finished", body = ErrorBody),
        (status = 429, description = "`run_events_full`: the run holds 10,000 events no wait consumed yet, the most a run holds, and nothing was written (a duplicate of one it holds is still `duplicate`); send again once its waits consumed some. Or `rate_limited`: too many requests for this token", body = ErrorBody),
    ),
    security(("bearer" = ["operate"]))
)]
async fn send_event(caller: AnyCaller, Path(run_id): Path<String>, Json(body): Json<EventBody>) -> ApiResult {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Operate)?;
        validate_id("run_id", &run_id)?;
        body.check()?;
        let (rid, eid, name) = (run_id.clone(), body.event_id.clone(), body.name.clone());
        let new =
            tenant.writer.call(move |store, now| store.send_event(&rid, &eid, &name, &body.payload, now)).await?;
        let outcome = if new { "sent" } else { "duplicate" };
        Ok(typed(StatusCode::OK, EventSent { outcome: outcome.into(), run_id, event_id: body.event_id, name: body.name }))
    })
}
