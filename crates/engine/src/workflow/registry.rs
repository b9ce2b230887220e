//! The registry of named, versioned workflows, and [`Workflow`], one definition of them.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tidemark_core::error::codes;
use tidemark_core::id::validate_id;
use tidemark_core::workflow::{workflow_codes, RetryPolicy, StartRequest, WorkflowStore, WorkflowVersion};
use tidemark_core::{Error, Result};

use super::{WorkflowContext, WorkflowError};

pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;
pub(crate) type WorkflowFn<S> =
    Arc<dyn Fn(WorkflowContext<S>, Value) -> BoxFuture<Result<Value, WorkflowError>> + Send + Sync>;
type InputCheck = Arc<dyn Fn(&Value) -> Result<()> + Send + Sync>;

/// Options of one registered workflow (version).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct WorkflowOptions {
    /// At most this many runs of this workflow type in flight across all workers.
    pub concurrency_max: Option<u32>,
    /// The retry policy of steps that do not pass their own.
    pub retry: RetryPolicy,
}

/// One workflow: a name, a version, its options and its function. Build it with
/// [`Workflow::new`] from an async function over the user's own `serde` types (or from a
/// [`Saga`](super::Saga) with [`IntoWorkflow`]), then add it to [`Workflows`] or to a service.
///
/// The function runs again from the top after every suspension and crash: it must reach the
/// same steps in the same order for the same input (read time, randomness and the outside
/// world only through steps).
///
/// ```
/// use serde::{Deserialize, Serialize};
/// use tidemark_core::workflow::WorkflowStore;
/// use tidemark_engine::workflow::{Workflow, WorkflowContext, WorkflowError};
///
/// #[derive(Deserialize)]
/// struct Greet { name: String }
/// #[derive(Serialize)]
/// struct Greeting { text: String }
///
/// async fn greet<S: WorkflowStore + 'static>(ctx: WorkflowContext<S>, input: Greet)
///     -> Result<Greeting, WorkflowError> where S::Target: 'static {
///     let text: String = ctx.step("compose", None, move |_key| async move {
///         Ok(format!("hello, {}", input.name))
///     }).await?;
///     Ok(Greeting { text })
/// }
///
/// fn definition<S: WorkflowStore + 'static>() -> Workflow<S> where S::Target: 'static {
///     Workflow::new("greet", 1, greet::<S>)
/// }
/// ```
pub struct Workflow<S: WorkflowStore> {
    name: String,
    version: u32,
    options: WorkflowOptions,
    function: WorkflowFn<S>,
    check_input: InputCheck,
    input_schema: Option<Value>,
}

impl<S: WorkflowStore> Clone for Workflow<S> {
    fn clone(&self) -> Self {
        Workflow {
            name: self.name.clone(),
            version: self.version,
            options: self.options.clone(),
            function: self.function.clone(),
            check_input: self.check_input.clone(),
            input_schema: self.input_schema.clone(),
        }
    }
}

fn decode<I: DeserializeOwned>(workflow: &str, input: &Value) -> Result<I> {
    I::deserialize(input).map_err(|e| {
        Error::invalid(workflow_codes::INVALID_INPUT, format!("the input does not fit workflow {workflow}: {e}"))
    })
}

impl<S> Workflow<S>
where
    S: WorkflowStore + 'static,
    S::Target: 'static,
{
    /// Workflow `name` version `version` running `f`. The input is decoded into `I` before a
    /// run starts (an input that does not decode is refused with `invalid_input`, nothing
    /// written); the output `O` is stored as JSON. Default options: no concurrency limit,
    /// [`RetryPolicy::default`].
    pub fn new<I, O, F, Fut>(name: &str, version: u32, f: F) -> Self
    where
        I: DeserializeOwned + Send + 'static,
        O: Serialize + Send + 'static,
        F: Fn(WorkflowContext<S>, I) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<O, WorkflowError>> + Send + 'static,
    {
        let workflow = name.to_string();
        let function: WorkflowFn<S> = Arc::new(move |ctx, input| {
            // Checked at start, so this fails only when the input type changed under a run.
            let decoded = decode::<I>(&workflow, &input);
            let run = decoded.map(|input| f(ctx, input));
            Box::pin(async move {
                let output = match run {
                    Ok(run) => run.await?,
                    Err(error) => return Err(WorkflowError::Parked(error.to_string())),
                };
                serde_json::to_value(output)
                    .map_err(|e| WorkflowError::Failed(format!("the workflow output does not serialise: {e}")))
            })
        });
        let owned = name.to_string();
        let check_input: InputCheck = Arc::new(move |input| decode::<I>(&owned, input).map(drop));
        Self::from_parts(name, version, function, check_input)
    }

    pub(crate) fn from_parts(name: &str, version: u32, function: WorkflowFn<S>, check_input: InputCheck) -> Self {
        Workflow {
            name: name.to_string(),
            version,
            options: WorkflowOptions::default(),
            function,
            check_input,
            input_schema: None,
        }
    }

    /// Replace the options.
    pub fn options(mut self, options: WorkflowOptions) -> Self {
        self.options = options;
        self
    }

    /// At most `limit` runs of this workflow in flight across all workers.
    pub fn concurrency_max(mut self, limit: u32) -> Self {
        self.options.concurrency_max = Some(limit);
        self
    }

    /// The retry policy of steps that do not pass their own.
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.options.retry = policy;
        self
    }

    /// A JSON Schema of the input, listed by the service's registry (`GET /v1/registry`).
    pub fn input_schema(mut self, schema: Value) -> Self {
        self.input_schema = Some(schema);
        self
    }

    /// The JSON Schema of `T` (the workflow's input type, deriving `schemars::JsonSchema`) as
    /// the input schema.
    pub fn input_schema_of<T: schemars::JsonSchema>(self) -> Self {
        let schema = serde_json::to_value(schemars::schema_for!(T)).unwrap_or(Value::Null);
        self.input_schema(schema)
    }

    /// A further check of the input at start, after it decoded (e.g. bounds the type cannot
    /// say). An `Err` refuses the start; use `invalid_input` as its code.
    pub fn check_input<F>(mut self, check: F) -> Self
    where
        F: Fn(&Value) -> Result<()> + Send + Sync + 'static,
    {
        let decodes = self.check_input.clone();
        self.check_input = Arc::new(move |input| {
            decodes(input)?;
            check(input)
        });
        self
    }

    /// The workflow's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The workflow's version.
    pub fn version(&self) -> u32 {
        self.version
    }

    fn validate(&self) -> Result<()> {
        validate_id("workflow", &self.name)?;
        if self.version == 0 {
            return Err(Error::invalid(codes::INVALID_ARGUMENT, "workflow version must be >= 1"));
        }
        self.options.retry.validate()?;
        if self.options.concurrency_max == Some(0) {
            return Err(Error::invalid(codes::INVALID_ARGUMENT, "concurrency_max must be >= 1"));
        }
        Ok(())
    }
}

/// What can become a [`Workflow`]: a workflow itself, or a [`Saga`](super::Saga) (whose
/// declaration is checked here).
pub trait IntoWorkflow<S: WorkflowStore> {
    /// The workflow, or why the declaration is wrong.
    fn into_workflow(self) -> Result<Workflow<S>>;
}

impl<S: WorkflowStore> IntoWorkflow<S> for Workflow<S> {
    fn into_workflow(self) -> Result<Workflow<S>> {
        Ok(self)
    }
}

pub(crate) struct Registered<S: WorkflowStore> {
    pub(crate) options: WorkflowOptions,
    pub(crate) function: WorkflowFn<S>,
    check_input: InputCheck,
    input_schema: Option<Value>,
}

/// A registered workflow version as the registry lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkflowInfo {
    /// The workflow's name.
    pub workflow: String,
    /// The version.
    pub version: u32,
    /// At most this many runs in flight across all workers.
    pub concurrency_max: Option<u32>,
    /// The JSON Schema of the input, when the definition gave one.
    pub input_schema: Option<Value>,
}

/// How a run executed by a [`Workflows::replay_only`] registry is parked when its function
/// reaches a journal position that its journal has not settled (the message goes on with the
/// position and the call, e.g. `... at position 3, where the workflow calls external step
/// "ship"`).
pub const REPLAY_END: &str = "replay reached the end of the recorded journal";

/// Named, versioned workflow functions. A worker claims only the `(name, version)` pairs
/// registered here; runs pinned to other versions are left alone and reported.
pub struct Workflows<S: WorkflowStore> {
    entries: BTreeMap<(String, u32), Arc<Registered<S>>>,
    /// Runs only replay their journals (see [`Workflows::replay_only`]).
    replay_only: bool,
}

impl<S: WorkflowStore> Default for Workflows<S> {
    fn default() -> Self {
        Workflows { entries: BTreeMap::new(), replay_only: false }
    }
}

impl<S: WorkflowStore> Clone for Workflows<S> {
    fn clone(&self) -> Self {
        Workflows { entries: self.entries.clone(), replay_only: self.replay_only }
    }
}

impl<S> Workflows<S>
where
    S: WorkflowStore + 'static,
    S::Target: 'static,
{
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add a workflow (or a saga). Two definitions with one name and version are refused
    /// (`already_exists`).
    pub fn add(&mut self, workflow: impl IntoWorkflow<S>) -> Result<()> {
        let workflow = workflow.into_workflow()?;
        workflow.validate()?;
        let key = (workflow.name.clone(), workflow.version);
        if self.entries.contains_key(&key) {
            return Err(Error::invalid(
                codes::ALREADY_EXISTS,
                format!("workflow {} v{} is already registered", key.0, key.1),
            ));
        }
        let registered = Registered {
            options: workflow.options,
            function: workflow.function,
            check_input: workflow.check_input,
            input_schema: workflow.input_schema,
        };
        self.entries.insert(key, Arc::new(registered));
        Ok(())
    }

    /// The same workflows, for checking recorded journals against this code: a run executed with
    /// this registry replays its journal as usual (a call that differs from the journal parks it
    /// as non-deterministic, so does a function that returns before its journaled steps), and at
    /// the first position the journal has not settled (none recorded, or a retry, timer, wait or
    /// child still open) it is parked with [`REPLAY_END`] instead of running anything: no step
    /// runs, no timer starts, no child starts. `tidemark::testing` replays production journals
    /// with it on a throwaway store. Never give it to a worker of a real database.
    pub fn replay_only(mut self) -> Self {
        self.replay_only = true;
        self
    }

    /// True for a [`Workflows::replay_only`] registry.
    pub fn replays_only(&self) -> bool {
        self.replay_only
    }

    /// Register `f` as `name` version `version`, with JSON input and output (see
    /// [`Workflow::new`] for typed ones).
    pub fn register<F, Fut>(&mut self, name: &str, version: u32, options: WorkflowOptions, f: F) -> Result<()>
    where
        F: Fn(WorkflowContext<S>, Value) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Value, WorkflowError>> + Send + 'static,
    {
        self.add(Workflow::new(name, version, f).options(options))
    }

    /// The registered `(workflow, version)` pairs with their limits, as claims want them.
    pub fn versions(&self) -> Vec<WorkflowVersion> {
        self.entries
            .iter()
            .map(|((workflow, version), r)| WorkflowVersion {
                workflow: workflow.clone(),
                version: *version,
                concurrency_max: r.options.concurrency_max,
            })
            .collect()
    }

    /// Every registered version, with its input schema.
    pub fn infos(&self) -> Vec<WorkflowInfo> {
        self.entries
            .iter()
            .map(|((workflow, version), r)| WorkflowInfo {
                workflow: workflow.clone(),
                version: *version,
                concurrency_max: r.options.concurrency_max,
                input_schema: r.input_schema.clone(),
            })
            .collect()
    }

    /// True when a version of `name` registered here has a per-type limit (`concurrency_max`):
    /// its runs must be claimed within that global budget, never leased at their start.
    pub(crate) fn type_limited(&self, name: &str) -> bool {
        self.entries.iter().any(|((w, _), r)| w == name && r.options.concurrency_max.is_some())
    }

    /// The highest registered version of `name`.
    pub fn latest_version(&self, name: &str) -> Option<u32> {
        self.entries.keys().filter(|(w, _)| w == name).map(|(_, v)| *v).max()
    }

    /// True when nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The registered names, comma-separated (for error messages).
    pub fn names(&self) -> String {
        let mut names: Vec<&str> = self.entries.keys().map(|(w, _)| w.as_str()).collect();
        names.dedup();
        names.join(", ")
    }

    /// A start request for `workflow` pinned to its latest registered version, with its input
    /// checked (`unknown_workflow`, `invalid_input`, or the request's own validation).
    pub fn start_request(&self, run_id: &str, workflow: &str, input: Value) -> Result<StartRequest> {
        let version = self.latest_version(workflow).ok_or_else(|| self.unknown(workflow))?;
        let request = StartRequest::new(run_id, workflow, version, input);
        self.check_start(&request)?;
        Ok(request)
    }

    /// Refuse, before anything is written, a start the registered workflow could never run:
    /// an unknown workflow or version, a request that is not valid, an input that does not
    /// decode into the workflow's input type or fails its check.
    pub fn check_start(&self, request: &StartRequest) -> Result<()> {
        request.validate()?;
        let registered = self.get(&request.workflow, request.version).ok_or_else(|| {
            if self.latest_version(&request.workflow).is_some() {
                Error::invalid(
                    workflow_codes::UNKNOWN_WORKFLOW,
                    format!("workflow {} has no version {}", request.workflow, request.version),
                )
            } else {
                self.unknown(&request.workflow)
            }
        })?;
        (registered.check_input)(&request.input)
    }

    fn unknown(&self, workflow: &str) -> Error {
        Error::invalid(
            workflow_codes::UNKNOWN_WORKFLOW,
            format!("workflow {workflow:?} is not registered; registered: {}", self.names()),
        )
    }

    pub(crate) fn get(&self, workflow: &str, version: u32) -> Option<Arc<Registered<S>>> {
        self.entries.get(&(workflow.to_string(), version)).cloned()
    }
}
