//! The durable execution runtime: workflows, sagas and the worker that runs them, generic over
//! any [`WorkflowStore`](tidemark_core::workflow::WorkflowStore) (see `docs/workflows.md` for the model and
//! `tidemark_core::workflow` for the contract).
//!
//! - [`Workflows`]: the registry of named, versioned workflow functions.
//! - [`WorkflowContext`]: what a workflow function talks to the world through: external steps
//!   ([`WorkflowContext::step`], at least once, with a stable idempotency key), transactional
//!   steps ([`WorkflowContext::tx_step`], exactly once, in the journal's transaction), durable
//!   timers ([`WorkflowContext::sleep`]) and events ([`WorkflowContext::wait_for_event`]).
//! - [`Writer`]: the one thread that owns the store. Journal writes of every run in flight are
//!   queued and committed together (group commit, up to `COMMIT_BATCH_MAX` per transaction);
//!   claims, heartbeats, starts and reads go through the same thread, in queue order, so a read
//!   always sees every write queued before it. There is no second connection.
//! - [`Worker`]: claims due runs under a lease, runs each as a task, heartbeats the leases, and
//!   drops a run the moment its lease is lost or fenced.
//! - [`WorkerObserver`]: what a worker tells the process that runs it (claims, step attempts,
//!   finished runs, lost leases), for metrics and logs.
//! - [`Saga`]: a workflow built declaratively from steps and compensations.
//! - [`Workflow`]: one definition (name, version, options, function over the user's own
//!   `serde` types), added to [`Workflows`] or to a service.
//!
//! # Suspension
//!
//! A step that has to wait (a retry backoff, a timer, an event) returns
//! `Err(WorkflowError::Suspended(..))`. Propagate it with `?`: the run is then suspended (its lease
//! released) and resumes later from the top, replaying the journal. The error cannot be swallowed
//! by accident: the context remembers it is suspended, every further step call returns the same
//! error without running, and whatever the function finally returns, the worker suspends the run.
//! The same holds for a non-deterministic replay (the run is parked) and for a lost lease (the
//! run is dropped). The variant cannot be built outside this module.
//!
//! # Cancellation
//!
//! A cancel request (seen at claim or by a heartbeat) is observed at the next step boundary: the
//! next step that would run (not a replayed one) returns `Err(WorkflowError::Cancelled)`, and so
//! does every later one, except compensations, which still run. A saga compensates, then ends
//! `cancelled`; a plain workflow that propagates the error ends `cancelled`.

mod context;
mod handle;
mod observer;
mod registry;
mod saga;
mod schedules;
mod worker;
mod writer;

use std::fmt;
use std::sync::Arc;

pub use context::{WorkflowContext, CHILD_RECHECK_MS};
pub use handle::{RunHandle, RESULT_POLL_MS};
pub use observer::{StepAttempt, StepAttemptEnd, WorkerObserver};
pub use registry::{IntoWorkflow, Workflow, WorkflowInfo, WorkflowOptions, Workflows, REPLAY_END};
pub use saga::{Saga, SagaAction, SagaData};
pub use schedules::tick_schedules;
pub use worker::{FinishedRun, Worker, WorkerOptions, WorkerReport};
pub use writer::{Writer, WriterStats};

/// The tokio this runtime is built on, for callers that build their own runtime.
pub use tokio;

use tidemark_core::Error;

/// Milliseconds since the Unix epoch. Every time the runtime and its store see comes from one
/// clock (tests may pass their own to the [`Writer`]).
pub type Clock = Arc<dyn Fn() -> i64 + Send + Sync>;

/// The system clock.
pub fn system_clock() -> Clock {
    Arc::new(crate::now_ms)
}

/// Why a workflow function (or one of its steps) did not return a value.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkflowError {
    /// A step failed for good (not retryable, or out of attempts). A plain workflow that returns
    /// it ends `failed`.
    StepFailed {
        /// The name of the step that failed.
        step: String,
        /// The step's last error.
        message: String,
        /// The step failed at its last allowed attempt (its policy's `max_attempts`): out of
        /// attempts after retryable failures (a timeout, an unreachable service), or failed for
        /// good at that attempt. An external step's effect may then have happened without its
        /// caller seeing it, so a saga compensates the step itself too. False for a permanent
        /// failure at an earlier attempt (the service's own answer) and for what is not a
        /// retried step (a child's failure, a refused message).
        out_of_attempts: bool,
    },
    /// The workflow itself decided to fail: the run ends `failed` with this message.
    Failed(String),
    /// Cancellation was requested; the run ends `cancelled`.
    Cancelled,
    /// The run waits (retry backoff, timer, event): propagate with `?`. See the module docs.
    Suspended(Suspended),
    /// The run needs an operator: non-deterministic replay, a compensation out of attempts, an
    /// output that no longer decodes. The run ends `parked` with this message.
    Parked(String),
    /// A saga rolled back: the run ends `compensated` with this message (the failure).
    Compensated(String),
    /// The lease was lost (fenced): another worker or an operator owns the run. Nothing more is
    /// written for it.
    LeaseLost,
    /// The store failed. The run's lease is released and it is replayed later.
    Store(Error),
    /// The workflow continues as a new run ([`WorkflowContext::continue_as_new`]): return it
    /// (with `?` or as it is). The variant cannot be built outside this module.
    ContinuedAsNew(Continuation),
}

/// The marker of a continuation; only [`WorkflowContext::continue_as_new`] makes one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Continuation {
    _private: (),
}

impl Continuation {
    pub(crate) fn new() -> Self {
        Continuation { _private: () }
    }
}

/// The marker of a suspension; only the runtime makes one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Suspended {
    _private: (),
}

impl Suspended {
    pub(crate) fn new() -> Self {
        Suspended { _private: () }
    }
}

impl WorkflowError {
    /// The workflow's own failure with `message`: the run ends `failed`.
    pub fn failed(message: impl Into<String>) -> Self {
        WorkflowError::Failed(message.into())
    }

    pub(crate) fn suspended() -> Self {
        WorkflowError::Suspended(Suspended::new())
    }

    /// True for the suspension marker, which a workflow must pass on with `?` (never swallow it).
    pub fn is_suspended(&self) -> bool {
        matches!(self, WorkflowError::Suspended(_))
    }
}

impl fmt::Display for WorkflowError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WorkflowError::StepFailed { step, message, .. } => write!(f, "step {step} failed: {message}"),
            WorkflowError::Failed(message) => write!(f, "workflow failed: {message}"),
            WorkflowError::Cancelled => f.write_str("cancelled"),
            WorkflowError::Suspended(_) => f.write_str("suspended (propagate with `?`)"),
            WorkflowError::Parked(message) => write!(f, "parked: {message}"),
            WorkflowError::Compensated(message) => write!(f, "compensated after: {message}"),
            WorkflowError::LeaseLost => f.write_str("lease lost"),
            WorkflowError::Store(error) => write!(f, "store: {error}"),
            WorkflowError::ContinuedAsNew(_) => f.write_str("continued as a new run (return it)"),
        }
    }
}

impl std::error::Error for WorkflowError {}

impl From<Error> for WorkflowError {
    fn from(error: Error) -> Self {
        WorkflowError::Store(error)
    }
}
