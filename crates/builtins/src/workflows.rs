//! The workflows built into the `tidemark` binary: the reference order saga ([`crate::order`])
//! and `sleepy_order`, a plain code workflow over the same
//! order tables that can hold its lease in a slow external step, wait for an approval event and
//! sleep on a durable timer (for demos, operators and crash tests); and `order_batch`, which runs
//! each order of a batch as a child `order_saga` and stamps the batch with journaled values.

use std::sync::Arc;
use std::time::Duration;

use crate::order::{order_saga, OrderInput, OrderTx, Payments, ORDER_SAGA, ORDER_SAGA_VERSION};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tidemark::id::validate_id;
use tidemark::workflow::{
    workflow_codes, Backoff, IntoWorkflow, RetryPolicy, SagaData, StepFailure, Workflow, WorkflowContext,
    WorkflowError, WorkflowOptions, WorkflowStore, WorkflowVersion, Workflows,
};
use tidemark::{Error, Result};

/// The registered name of `sleepy_order`.
pub const SLEEPY_ORDER: &str = "sleepy_order";
/// The version of `sleepy_order`.
pub const SLEEPY_ORDER_VERSION: u32 = 1;

/// How long `sleepy_order` waits for its approval event by default (one day).
const APPROVAL_TIMEOUT_MS_DEFAULT: u64 = 24 * 60 * 60 * 1000;

/// A compensation's attempt budget (the saga's default, `tidemark_engine`'s
/// `COMPENSATION_ATTEMPTS`).
const COMPENSATION_ATTEMPTS: u32 = 10_000;

/// The registered name of `order_batch`.
pub const ORDER_BATCH: &str = "order_batch";
/// The version of `order_batch`.
pub const ORDER_BATCH_VERSION: u32 = 1;
/// The topic `order_batch` tells its `notify` run on (`ctx.send`).
pub const BATCH_DONE: &str = "batch_done";
/// The most orders one `order_batch` run takes.
pub const ORDER_BATCH_ORDERS_MAX: usize = 100;

/// The built-in workflows and their versions (what `start` pins a run to).
pub const BUILTINS: &[(&str, u32)] =
    &[(ORDER_SAGA, ORDER_SAGA_VERSION), (SLEEPY_ORDER, SLEEPY_ORDER_VERSION), (ORDER_BATCH, ORDER_BATCH_VERSION)];

/// The registered version of a built-in workflow.
pub fn version(workflow: &str) -> Option<u32> {
    BUILTINS.iter().find(|(name, _)| *name == workflow).map(|(_, v)| *v)
}

/// The built-in `(workflow, version)` pairs, as `unclaimable` wants them.
pub fn versions() -> Vec<WorkflowVersion> {
    BUILTINS
        .iter()
        .map(|(workflow, version)| WorkflowVersion {
            workflow: workflow.to_string(),
            version: *version,
            concurrency_max: None,
        })
        .collect()
}

/// `sleepy_order`'s input: an order (the order saga's fields, with `order_id` optional: the run
/// id when absent, so that a schedule, whose input is the same at every tick, places one order per
/// tick) and its extra knobs.
#[derive(Debug, Clone, Deserialize)]
struct SleepyInput {
    #[serde(flatten)]
    order: OrderInput,
    /// The `hold` step (an external call) lasts until this time (ms since the epoch): the worker
    /// holds the run's lease meanwhile. Absent or past: the step returns at once.
    #[serde(default)]
    hold_until_ms: Option<i64>,
    /// Wait for an event of this name before charging; its payload `{"approved": true}` goes on,
    /// anything else (or the timeout) releases the inventory and ends the run `completed` with
    /// `"approved": false`.
    #[serde(default)]
    approval: Option<String>,
    #[serde(default = "approval_timeout_default")]
    approval_timeout_ms: u64,
}

/// `order_batch`'s input: the orders (each an `order_saga` input, with distinct order ids); at
/// most `per_run` of them in one run, the rest continued as a new run (`ctx.continue_as_new`)
/// that carries the ends so far in `done`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchInput {
    orders: Vec<Value>,
    #[serde(default)]
    per_run: Option<usize>,
    #[serde(default)]
    done: Vec<Value>,
    /// A run told when the batch is done (`ctx.send`, topic `batch_done`, payload
    /// `{"approved": true, "orders": N}`: a `sleepy_order` waiting for approval `batch_done` goes
    /// on).
    #[serde(default)]
    notify: Option<String>,
}

fn batch_of(input: &Value) -> std::result::Result<BatchInput, String> {
    let batch: BatchInput = serde_json::from_value(input.clone()).map_err(|e| format!("invalid input: {e}"))?;
    if batch.orders.is_empty() || batch.orders.len() > ORDER_BATCH_ORDERS_MAX {
        return Err(format!("orders must hold 1..={ORDER_BATCH_ORDERS_MAX} orders, got {}", batch.orders.len()));
    }
    if batch.per_run.is_some_and(|n| n == 0 || n > ORDER_BATCH_ORDERS_MAX) {
        return Err(format!("per_run must be 1..={ORDER_BATCH_ORDERS_MAX}"));
    }
    if batch.done.len() + batch.orders.len() > ORDER_BATCH_ORDERS_MAX {
        return Err(format!("done and orders together must hold at most {ORDER_BATCH_ORDERS_MAX} orders"));
    }
    if let Some(notify) = &batch.notify {
        validate_id("notify", notify).map_err(|e| e.to_string())?;
    }
    let mut ids = std::collections::BTreeSet::new();
    for (i, order) in batch.orders.iter().enumerate() {
        validate_input(ORDER_SAGA, order).map_err(|e| format!("orders[{i}]: {e}"))?;
        let id = order_of(order).map_err(|f| f.message)?.order_id;
        if !ids.insert(id.clone()) {
            return Err(format!("orders[{i}]: order_id {id:?} appears twice"));
        }
    }
    Ok(batch)
}

fn approval_timeout_default() -> u64 {
    APPROVAL_TIMEOUT_MS_DEFAULT
}

fn invalid_input(message: impl Into<String>) -> Error {
    Error::invalid(workflow_codes::INVALID_INPUT, message)
}

fn order_of(input: &Value) -> std::result::Result<OrderInput, StepFailure> {
    OrderInput::from_data(&SagaData { input: input.clone(), outputs: Map::new() })
}

/// The order id `sleepy_order` checks an input without one against before a run id exists (any
/// valid identifier: a run id is one).
const RUN_ID_STANDIN: &str = "run-id";

/// `sleepy_order`'s input, with `run_id` as the order id when the input names none.
fn sleepy_of(input: &Value, run_id: &str) -> std::result::Result<SleepyInput, String> {
    let mut input = input.clone();
    if let Some(fields) = input.as_object_mut() {
        fields.entry("order_id").or_insert_with(|| Value::String(run_id.to_string()));
    }
    let sleepy: SleepyInput = serde_json::from_value(input.clone()).map_err(|e| format!("invalid input: {e}"))?;
    order_of(&input).map_err(|f| f.message)?;
    if let Some(name) = &sleepy.approval {
        validate_id("approval", name).map_err(|e| e.to_string())?;
    }
    if sleepy.approval_timeout_ms > tidemark::workflow::TIMER_MS_MAX as u64 {
        return Err(format!("approval_timeout_ms must be at most {}", tidemark::workflow::TIMER_MS_MAX));
    }
    if sleepy.order.ship_after_ms > tidemark::workflow::TIMER_MS_MAX as u64 {
        return Err(format!("ship_after_ms must be at most {}", tidemark::workflow::TIMER_MS_MAX));
    }
    Ok(sleepy)
}

/// Refuse, before anything is written, an input the workflow could never run.
pub fn validate_input(workflow: &str, input: &Value) -> Result<()> {
    match workflow {
        ORDER_SAGA => {
            let order = order_of(input).map_err(|f| invalid_input(f.message))?;
            if order.ship_after_ms > tidemark::workflow::TIMER_MS_MAX as u64 {
                return Err(invalid_input(format!(
                    "ship_after_ms must be at most {}",
                    tidemark::workflow::TIMER_MS_MAX
                )));
            }
            Ok(())
        }
        SLEEPY_ORDER => sleepy_of(input, RUN_ID_STANDIN).map(drop).map_err(invalid_input),
        ORDER_BATCH => batch_of(input).map(drop).map_err(invalid_input),
        other => Err(Error::invalid(
            workflow_codes::UNKNOWN_WORKFLOW,
            format!("workflow {other:?} is not built in; known: {}", names()),
        )),
    }
}

/// The names of the built-in workflows, comma-separated (for error messages and help).
pub fn names() -> String {
    BUILTINS.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
}

/// Step retry policy of the built-in workflows: `max_attempts`, and either a fixed delay between
/// attempts or the default exponential backoff (1 s x 5^(n-1), jittered).
pub fn retry_policy(max_attempts: u32, retry_delay_ms: Option<i64>) -> Result<RetryPolicy> {
    let mut policy = RetryPolicy { max_attempts, ..RetryPolicy::default() };
    if let Some(delay) = retry_delay_ms {
        policy.backoff = Backoff::Schedule { delays_ms: vec![delay] };
        policy.jitter = false;
    }
    policy.validate()?;
    Ok(policy)
}

/// The compensation policy that goes with a step policy: the saga's large attempt budget, with
/// the same backoff.
pub fn compensation_policy(step: &RetryPolicy) -> RetryPolicy {
    RetryPolicy { max_attempts: COMPENSATION_ATTEMPTS, ..step.clone() }
}

/// Register every built-in workflow with `payments` as the payment service, for any store whose
/// transactional handle runs the order steps (SQLite's connection, PostgreSQL's
/// `ApplyTransaction`).
pub fn workflows<S>(payments: Arc<dyn Payments>, retry: &RetryPolicy) -> Result<Workflows<S>>
where
    S: WorkflowStore + 'static,
    S::Target: OrderTx + 'static,
{
    let mut workflows = Workflows::new();
    for definition in definitions::<S>(payments, retry)? {
        workflows.add(definition)?;
    }
    Ok(workflows)
}

/// The built-in workflows' definitions with `payments` as the payment service: what a service
/// registers (each refuses, at start, an input it could never run: [`validate_input`]).
pub fn definitions<S>(payments: Arc<dyn Payments>, retry: &RetryPolicy) -> Result<Vec<Workflow<S>>>
where
    S: WorkflowStore + 'static,
    S::Target: OrderTx + 'static,
{
    let options = WorkflowOptions { concurrency_max: None, retry: retry.clone() };
    let saga = order_saga::<S>(payments.clone())
        .compensation_policy(compensation_policy(retry))
        .into_workflow()?
        .options(options.clone())
        .check_input(|input| validate_input(ORDER_SAGA, input));
    let sleepy = Workflow::new(SLEEPY_ORDER, SLEEPY_ORDER_VERSION, move |ctx, input: Value| {
        sleepy_order(ctx, input, payments.clone())
    })
    .options(options.clone())
    .check_input(|input| validate_input(SLEEPY_ORDER, input));
    let batch = Workflow::new(ORDER_BATCH, ORDER_BATCH_VERSION, order_batch::<S>)
        .options(options)
        .check_input(|input| validate_input(ORDER_BATCH, input));
    Ok(vec![saga, sleepy, batch])
}

/// `order_batch`: stamps the batch with journaled values (`now`, `uuid`: a replay after a crash
/// sees the same ones), then runs each order as a child `order_saga`, one after the other,
/// publishing its progress after each (`ctx.set_event("progress", {"done", "of"})`), and
/// completes with each child's end. A child that compensated is reported, not a failure of the
/// batch; cancelling the batch cancels the child in flight. With `per_run`, a run takes that
/// many orders and continues as a new run with the rest (the chain's last run completes with
/// every order's end). With `notify`, the last run sends that run a `batch_done` message.
async fn order_batch<S: WorkflowStore + 'static>(
    ctx: WorkflowContext<S>,
    input: Value,
) -> std::result::Result<Value, WorkflowError> {
    let batch = batch_of(&input).map_err(WorkflowError::Failed)?;
    let started_at_ms = ctx.now()?;
    let batch_token = ctx.uuid()?;
    let per_run = batch.per_run.unwrap_or(batch.orders.len()).min(batch.orders.len());
    let (now, rest) = batch.orders.split_at(per_run);
    let of = batch.done.len() + batch.orders.len();
    let mut orders = batch.done.clone();
    for order in now {
        let order_id = order.get("order_id").cloned().unwrap_or(Value::Null);
        let end = match ctx.child::<_, Value>(ORDER_SAGA, order).await {
            Ok(result) => json!({"order_id": order_id, "status": "completed", "result": result}),
            Err(WorkflowError::StepFailed { message, .. }) => {
                json!({"order_id": order_id, "status": "not_completed", "error": message})
            }
            Err(other) => return Err(other),
        };
        orders.push(end);
        // Readable from outside while the batch runs: GET /v1/runs/{id}/events/progress.
        ctx.set_event("progress", &json!({"done": orders.len(), "of": of})).await?;
    }
    if !rest.is_empty() {
        // The next orders in a new run, with a journal of their own.
        let next = json!({"orders": rest, "per_run": per_run, "done": orders, "notify": batch.notify});
        return Err(ctx.continue_as_new(&next));
    }
    if let Some(notify) = &batch.notify {
        // Sent once, with this journal entry, whatever crashes.
        ctx.send(notify, BATCH_DONE, &json!({"approved": true, "orders": orders.len()})).await?;
    }
    Ok(json!({"started_at_ms": started_at_ms, "batch_token": batch_token, "orders": orders}))
}

/// `sleepy_order`: `reserve_inventory` (transactional) -> `hold` (external, lasts until
/// `hold_until_ms`) -> optional wait for the `approval` event -> `charge_payment` (external)
/// -> optional durable sleep (`ship_after_ms`) -> `ship_order` (transactional). The order is
/// the run id when the input names no `order_id`.
///
/// A plain workflow, not a saga: a step that fails for good fails the run (`failed`), and its
/// reservation stays for an operator to `retry`, `skip` or `abandon`. A rejected or timed-out
/// approval releases the reservation itself and completes with `"approved": false`.
async fn sleepy_order<S>(
    ctx: WorkflowContext<S>,
    input: Value,
    payments: Arc<dyn Payments>,
) -> std::result::Result<Value, WorkflowError>
where
    S: WorkflowStore + 'static,
    S::Target: OrderTx + 'static,
{
    let sleepy = sleepy_of(&input, ctx.run_id()).map_err(WorkflowError::Failed)?;
    let order = sleepy.order.clone();

    let o = order.clone();
    let reserved: Value =
        ctx.tx_step("reserve_inventory", None, move |tx: &S::Target| tx.reserve_inventory(&o)).await?;

    let until = sleepy.hold_until_ms;
    let held: Value = ctx
        .step("hold", None, move |_key| async move {
            if let Some(until) = until {
                let left = until.saturating_sub(tidemark::now_ms());
                if left > 0 {
                    tokio::time::sleep(Duration::from_millis(left as u64)).await;
                }
            }
            Ok(json!({"held_until_ms": until}))
        })
        .await?;

    if let Some(name) = &sleepy.approval {
        let decision = ctx.wait_for_event(name, Duration::from_millis(sleepy.approval_timeout_ms)).await?;
        let approved = decision.as_ref().and_then(|p| p.get("approved")).and_then(Value::as_bool) == Some(true);
        if !approved {
            let o = order.clone();
            let released: Value =
                ctx.tx_step("release_inventory", None, move |tx: &S::Target| tx.release_inventory(&o)).await?;
            return Ok(json!({
                "approved": false,
                "timed_out": decision.is_none(),
                "reserve_inventory": reserved,
                "release_inventory": released,
            }));
        }
    }

    let (p, o) = (payments.clone(), order.clone());
    let charged: Value = ctx.step("charge_payment", None, move |key| p.clone().charge_async(key, o.clone())).await?;

    if order.ship_after_ms > 0 {
        ctx.sleep(Duration::from_millis(order.ship_after_ms)).await?;
    }

    let o = order.clone();
    let shipped: Value = ctx.tx_step("ship_order", None, move |tx: &S::Target| tx.ship_order(&o)).await?;
    Ok(json!({
        "reserve_inventory": reserved,
        "hold": held,
        "charge_payment": charged,
        "ship_order": shipped,
    }))
}
