//! What a worker tells an observer as it happens, for the metrics and logs of the process that
//! runs it (`tidemark serve` counts and times steps and runs with it). The observer is called
//! inline, on the worker's and the runs' tasks: it must be quick and must not block.

use std::time::Duration;

use tidemark_core::workflow::{FinishStatus, RunRecord};

/// How one attempt of a step ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepAttemptEnd {
    /// The step succeeded (and its output will be journaled).
    Completed,
    /// The attempt failed and another one is scheduled (a retry).
    Retrying,
    /// The attempt failed for good (not retryable, or out of attempts).
    Failed,
}

impl StepAttemptEnd {
    /// The word for this end (`completed`, `retrying`, `failed`), as metrics label it.
    pub fn as_str(self) -> &'static str {
        match self {
            StepAttemptEnd::Completed => "completed",
            StepAttemptEnd::Retrying => "retrying",
            StepAttemptEnd::Failed => "failed",
        }
    }
}

/// One attempt of a step, as told to [`WorkerObserver::step_attempted`].
#[derive(Debug, Clone, Copy)]
pub struct StepAttempt<'a> {
    /// The run the step belongs to.
    pub run_id: &'a str,
    /// The run's workflow.
    pub workflow: &'a str,
    /// The step's name.
    pub step: &'a str,
    /// 1 for the first attempt.
    pub attempt: u32,
    /// When the attempt began (`took` before it ended).
    pub began: std::time::Instant,
    /// An external step: the call (bounded by its attempt timeout). A transactional step: its
    /// write, body and commit.
    pub took: Duration,
    /// How the attempt ended.
    pub end: StepAttemptEnd,
}

/// Receives a worker's events (see [`crate::workflow::Worker::with_observer`]). Every method
/// does nothing by default.
pub trait WorkerObserver: Send + Sync + 'static {
    /// A run was claimed for an execution. `recovered`: it was taken over after the previous
    /// holder's lease expired (that worker crashed or stalled).
    fn run_claimed(&self, run: &RunRecord, recovered: bool) {
        let _ = (run, recovered);
    }

    /// A step attempt ended (replayed steps are not attempts and are not told).
    fn step_attempted(&self, attempt: &StepAttempt<'_>) {
        let _ = attempt;
    }

    /// A run ended for good. `run_ms`: from its creation to now, across every suspension and
    /// recovery (a saga's duration). `run` is the run as claimed, without its input (`null`).
    fn run_finished(&self, run: &RunRecord, status: FinishStatus, run_ms: i64) {
        let _ = (run, status, run_ms);
    }

    /// This worker lost the lease of a run it was executing (the lease expired and another
    /// worker took the run, or an operator took it away); the execution was dropped.
    fn lease_lost(&self, run_id: &str) {
        let _ = run_id;
    }
}
