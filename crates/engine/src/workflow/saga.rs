//! Sagas: workflows built declaratively from steps and their compensations.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Map, Value};
use tidemark_core::error::codes;
use tidemark_core::id::validate_id;
use tidemark_core::workflow::{RetryPolicy, StepFailure, WorkflowStore};
use tidemark_core::{Error, Result};

use super::registry::{BoxFuture, IntoWorkflow, WorkflowFn};
use super::{Workflow, WorkflowContext, WorkflowError, WorkflowOptions, Workflows};

/// What a saga step sees: the run's input and the outputs of the steps completed before it (by
/// step name). A compensation also sees its own step's output.
#[derive(Debug, Clone, PartialEq)]
pub struct SagaData {
    /// The run's input.
    pub input: Value,
    /// The outputs of the steps completed so far, by step name.
    pub outputs: Map<String, Value>,
}

type ExternalFn = Arc<dyn Fn(String, SagaData) -> BoxFuture<std::result::Result<Value, StepFailure>> + Send + Sync>;
type TxFn<T> = Arc<dyn Fn(&T, &SagaData) -> std::result::Result<Value, StepFailure> + Send + Sync>;
type DurationFn = Arc<dyn Fn(&SagaData) -> Duration + Send + Sync>;

/// A saga step's action or compensation: external (async, at least once, given the idempotency
/// key) or transactional (on the store's handle `T`, exactly once).
pub enum SagaAction<T: ?Sized> {
    /// An action that calls the outside world: at least once, given the idempotency key to pass on.
    External(ExternalFn),
    /// An action that writes in the journal's transaction on the store's handle: exactly once.
    Transactional(TxFn<T>),
}

impl<T: ?Sized> Clone for SagaAction<T> {
    fn clone(&self) -> Self {
        match self {
            SagaAction::External(f) => SagaAction::External(f.clone()),
            SagaAction::Transactional(f) => SagaAction::Transactional(f.clone()),
        }
    }
}

impl<T: ?Sized + 'static> SagaAction<T> {
    /// An external action: `f(idempotency_key, data)`.
    pub fn external<F, Fut>(f: F) -> Self
    where
        F: Fn(String, SagaData) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<Value, StepFailure>> + Send + 'static,
    {
        SagaAction::External(Arc::new(move |key, data| Box::pin(f(key, data))))
    }

    /// A transactional action: `f(tx, data)` inside the journal's transaction.
    pub fn tx<F>(f: F) -> Self
    where
        F: Fn(&T, &SagaData) -> std::result::Result<Value, StepFailure> + Send + Sync + 'static,
    {
        SagaAction::Transactional(Arc::new(f))
    }
}

enum Element<T: ?Sized> {
    Step { name: String, action: SagaAction<T>, compensation: Option<SagaAction<T>>, policy: Option<RetryPolicy> },
    Sleep { duration: DurationFn },
}

/// A saga: forward steps in order; when one fails for good (or cancellation is requested), the
/// run turns `compensating` and the compensations of the completed steps run in reverse order,
/// each journaled as its own step `compensate:<step>` retried with the compensation policy
/// (default `RetryPolicy::until_success(10_000)`). All compensated: the run ends `compensated`
/// (`cancelled` after a cancel request). A compensation out of attempts parks the run.
///
/// A cancel request (or a passed deadline) that stops the saga at an external step compensates
/// that step first, then the completed ones: the step may have run already, its success being
/// journaled with the run's next write, which a crash can lose. An external step's compensation
/// must therefore do nothing when its step did nothing (as Temporal advises for a compensation
/// registered before its activity).
///
/// Success: the run's result is the object of step outputs by name.
pub struct Saga<S: WorkflowStore> {
    name: String,
    version: u32,
    elements: Vec<Element<S::Target>>,
    compensation_policy: RetryPolicy,
}

/// The default attempt budget of a compensation.
pub const COMPENSATION_ATTEMPTS: u32 = 10_000;

impl<S> Saga<S>
where
    S: WorkflowStore + 'static,
    S::Target: 'static,
{
    /// An empty saga named `name` at `version` (compensations get `COMPENSATION_ATTEMPTS` attempts
    /// by default).
    pub fn new(name: &str, version: u32) -> Self {
        Saga {
            name: name.to_string(),
            version,
            elements: Vec::new(),
            compensation_policy: RetryPolicy::until_success(COMPENSATION_ATTEMPTS),
        }
    }

    /// Add a forward step with an optional compensation.
    pub fn step(
        mut self,
        name: &str,
        action: SagaAction<S::Target>,
        compensation: Option<SagaAction<S::Target>>,
    ) -> Self {
        self.elements.push(Element::Step { name: name.to_string(), action, compensation, policy: None });
        self
    }

    /// The retry policy of the step added last (default: the workflow's).
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        if let Some(Element::Step { policy: slot, .. }) = self.elements.last_mut() {
            *slot = Some(policy);
        }
        self
    }

    /// A durable timer between steps; its length may depend on the input (a zero length takes no
    /// journal position).
    pub fn sleep<F>(mut self, duration: F) -> Self
    where
        F: Fn(&SagaData) -> Duration + Send + Sync + 'static,
    {
        self.elements.push(Element::Sleep { duration: Arc::new(duration) });
        self
    }

    /// The retry policy of every compensation.
    pub fn compensation_policy(mut self, policy: RetryPolicy) -> Self {
        self.compensation_policy = policy;
        self
    }

    /// Register the saga as workflow `name` version `version`.
    pub fn register(self, workflows: &mut Workflows<S>, options: WorkflowOptions) -> Result<()> {
        workflows.add(self.into_workflow()?.options(options))
    }

    /// Check the saga's declaration (at least one step, step names identifiers and unique,
    /// policies valid).
    fn check(&self) -> Result<()> {
        self.compensation_policy.validate()?;
        let mut names = BTreeSet::new();
        for element in &self.elements {
            if let Element::Step { name, policy, .. } = element {
                validate_id("saga step", name)?;
                validate_id("saga compensation step", &compensation_name(name))?;
                if let Some(policy) = policy {
                    policy.validate()?;
                }
                if !names.insert(name.clone()) {
                    return Err(Error::invalid(codes::ALREADY_EXISTS, format!("saga step {name} is declared twice")));
                }
            }
        }
        if names.is_empty() {
            return Err(Error::invalid(codes::INVALID_ARGUMENT, "a saga needs at least one step"));
        }
        Ok(())
    }
}

/// A saga becomes a workflow with JSON input (any JSON value; its steps decode what they need)
/// and default options (set them with [`Workflow::options`]).
impl<S> IntoWorkflow<S> for Saga<S>
where
    S: WorkflowStore + 'static,
    S::Target: 'static,
{
    fn into_workflow(self) -> Result<Workflow<S>> {
        self.check()?;
        let (name, version) = (self.name.clone(), self.version);
        let saga = Arc::new(self);
        let function: WorkflowFn<S> = Arc::new(move |ctx, input| Box::pin(run_saga(saga.clone(), ctx, input)));
        Ok(Workflow::from_parts(&name, version, function, Arc::new(|_| Ok(()))))
    }
}

/// The patch point of the rule that compensates an external step that failed at its last
/// attempt (journaled as `patch:saga-compensates-out-of-attempts`, only by sagas that reach it).
const COMPENSATE_OUT_OF_ATTEMPTS: &str = "saga-compensates-out-of-attempts";

fn compensation_name(step: &str) -> String {
    format!("compensate:{step}")
}

async fn run_action<S>(
    ctx: &WorkflowContext<S>,
    name: &str,
    compensation: bool,
    policy: Option<RetryPolicy>,
    action: &SagaAction<S::Target>,
    data: &Arc<SagaData>,
) -> std::result::Result<Value, WorkflowError>
where
    S: WorkflowStore + 'static,
    S::Target: 'static,
{
    match action {
        SagaAction::External(f) => {
            let (f, data) = (f.clone(), SagaData::clone(data));
            let call = move |key: String| f(key, data);
            if compensation {
                ctx.compensation(name, policy, call).await
            } else {
                ctx.step(name, policy, call).await
            }
        }
        SagaAction::Transactional(f) => {
            // Shared, not copied: the body is dropped on the writer thread once it ran, before
            // the step's answer comes back (so the next output goes in without a copy).
            let (f, data) = (f.clone(), Arc::clone(data));
            let body = move |target: &S::Target| f(target, &data);
            if compensation {
                ctx.tx_compensation(name, policy, body).await
            } else {
                ctx.tx_step(name, policy, body).await
            }
        }
    }
}

async fn run_saga<S>(
    saga: Arc<Saga<S>>,
    ctx: WorkflowContext<S>,
    input: Value,
) -> std::result::Result<Value, WorkflowError>
where
    S: WorkflowStore + 'static,
    S::Target: 'static,
{
    let mut data = Arc::new(SagaData { input, outputs: Map::new() });
    let mut completed: Vec<usize> = Vec::new();
    let mut failure = None;
    // The external step whose outcome the saga cannot know, if any, compensated too (external
    // compensations no-op for a step that did nothing): the one a cancel stopped the saga at (it
    // may have run already: its success is journaled with the run's next write, which a crash
    // can lose), and one that failed at its last attempt (that attempt, or an earlier one, may
    // have taken effect and timed out before its answer came back).
    let mut outcome_unknown: Option<usize> = None;
    for (index, element) in saga.elements.iter().enumerate() {
        let result = match element {
            Element::Step { name, action, policy, .. } => {
                run_action(&ctx, name, false, policy.clone(), action, &data).await.map(|output| {
                    Arc::make_mut(&mut data).outputs.insert(name.clone(), output);
                    completed.push(index);
                })
            }
            Element::Sleep { duration } => {
                let duration = duration(&data);
                if duration.is_zero() {
                    Ok(())
                } else {
                    ctx.sleep(duration).await
                }
            }
        };
        match result {
            Ok(()) => {}
            Err(error @ (WorkflowError::StepFailed { .. } | WorkflowError::Cancelled)) => {
                if let Element::Step { action: SagaAction::External(_), compensation, .. } = element {
                    let unknown = match &error {
                        WorkflowError::Cancelled => true,
                        // Sagas whose journal went past this point before the rule existed
                        // replay without it.
                        WorkflowError::StepFailed { out_of_attempts: true, .. } if compensation.is_some() => {
                            ctx.patched(COMPENSATE_OUT_OF_ATTEMPTS)?
                        }
                        _ => false,
                    };
                    if unknown {
                        outcome_unknown = Some(index);
                    }
                }
                failure = Some(error);
                break;
            }
            Err(other) => return Err(other),
        }
    }
    let Some(failure) = failure else {
        let data = Arc::try_unwrap(data).unwrap_or_else(|shared| SagaData::clone(&shared));
        return Ok(Value::Object(data.outputs));
    };
    let to_compensate: Vec<(&String, &SagaAction<S::Target>)> = outcome_unknown
        .iter()
        .chain(completed.iter().rev())
        .filter_map(|i| match &saga.elements[*i] {
            Element::Step { name, compensation: Some(c), .. } => Some((name, c)),
            _ => None,
        })
        .collect();
    if !to_compensate.is_empty() {
        ctx.begin_compensation().await?;
    }
    for (name, compensation) in to_compensate {
        let step = compensation_name(name);
        match run_action(&ctx, &step, true, Some(saga.compensation_policy.clone()), compensation, &data).await {
            Ok(output) => {
                Arc::make_mut(&mut data).outputs.insert(step, output);
            }
            Err(WorkflowError::StepFailed { step, message, .. }) => {
                return Err(WorkflowError::Parked(format!(
                    "compensation {step} failed for good: {message} (after: {failure})"
                )))
            }
            Err(other) => return Err(other),
        }
    }
    match failure {
        WorkflowError::Cancelled => Err(WorkflowError::Cancelled),
        other => Err(WorkflowError::Compensated(other.to_string())),
    }
}
