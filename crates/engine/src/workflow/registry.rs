//! The registry of named, versioned workflows.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use serde_json::Value;
use tidemark_core::error::codes;
use tidemark_core::id::validate_id;
use tidemark_core::workflow::{workflow_codes, RetryPolicy, StartRequest, WorkflowStore, WorkflowVersion};
use tidemark_core::{Error, Result};

use super::{WorkflowContext, WorkflowError};

pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;
pub(crate) type WorkflowFn<S> =
    Arc<dyn Fn(WorkflowContext<S>, Value) -> BoxFuture<Result<Value, WorkflowError>> + Send + Sync>;

/// Options of one registered workflow (version).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct WorkflowOptions {
    /// At most this many runs of this workflow type in flight across all workers.
    pub concurrency_max: Option<u32>,
    /// The retry policy of steps that do not pass their own.
    pub retry: RetryPolicy,
}

pub(crate) struct Registered<S: WorkflowStore> {
    pub(crate) options: WorkflowOptions,
    pub(crate) function: WorkflowFn<S>,
}

/// Named, versioned workflow functions. A worker claims only the `(name, version)` pairs
/// registered here; runs pinned to other versions are left alone and reported.
pub struct Workflows<S: WorkflowStore> {
    entries: BTreeMap<(String, u32), Arc<Registered<S>>>,
}

impl<S: WorkflowStore> Default for Workflows<S> {
    fn default() -> Self {
        Workflows { entries: BTreeMap::new() }
    }
}

impl<S> Workflows<S>
where
    S: WorkflowStore + 'static,
    S::Target: 'static,
{
    pub fn new() -> Self {
        Self::default()
    }

    /// Register `f` as `name` version `version`. The function runs again from the top after every
    /// suspension and crash: it must reach the same steps in the same order for the same input
    /// (read time, randomness and the outside world only through steps).
    pub fn register<F, Fut>(&mut self, name: &str, version: u32, options: WorkflowOptions, f: F) -> Result<()>
    where
        F: Fn(WorkflowContext<S>, Value) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Value, WorkflowError>> + Send + 'static,
    {
        let function: WorkflowFn<S> = Arc::new(move |ctx, input| Box::pin(f(ctx, input)));
        self.register_boxed(name, version, options, function)
    }

    pub(crate) fn register_boxed(
        &mut self,
        name: &str,
        version: u32,
        options: WorkflowOptions,
        function: WorkflowFn<S>,
    ) -> Result<()> {
        validate_id("workflow", name)?;
        if version == 0 {
            return Err(Error::invalid(codes::INVALID_ARGUMENT, "workflow version must be >= 1"));
        }
        options.retry.validate()?;
        if options.concurrency_max == Some(0) {
            return Err(Error::invalid(codes::INVALID_ARGUMENT, "concurrency_max must be >= 1"));
        }
        let key = (name.to_string(), version);
        if self.entries.contains_key(&key) {
            return Err(Error::invalid(
                codes::ALREADY_EXISTS,
                format!("workflow {name} v{version} is already registered"),
            ));
        }
        self.entries.insert(key, Arc::new(Registered { options, function }));
        Ok(())
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

    /// The highest registered version of `name`.
    pub fn latest_version(&self, name: &str) -> Option<u32> {
        self.entries.keys().filter(|(w, _)| w == name).map(|(_, v)| *v).max()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// A start request for `workflow` pinned to its latest registered version.
    pub fn start_request(&self, run_id: &str, workflow: &str, input: Value) -> Result<StartRequest> {
        let version = self.latest_version(workflow).ok_or_else(|| {
            Error::invalid(workflow_codes::UNKNOWN_WORKFLOW, format!("workflow {workflow:?} is not registered"))
        })?;
        let request = StartRequest {
            run_id: run_id.to_string(),
            workflow: workflow.to_string(),
            version,
            input,
            key: None,
            start_at_ms: None,
        };
        request.validate()?;
        Ok(request)
    }

    pub(crate) fn get(&self, workflow: &str, version: u32) -> Option<Arc<Registered<S>>> {
        self.entries.get(&(workflow.to_string(), version)).cloned()
    }
}
