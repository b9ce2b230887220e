//! Durable execution: runs, their journal, statuses, step retry policy, and the
//! [`WorkflowStore`] trait that SQLite (and later PostgreSQL and the model) implement.
//!
//! A *run* executes a registered workflow (a named, versioned async function). Every step the
//! function takes is journaled under a position `seq` (0, 1, 2, ... in call order). After a crash
//! the function runs again from the top; journaled steps return their recorded result without
//! running again. See `docs/workflows.md`.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{codes, Error, Result};
use crate::id::validate_id;

/// Stable error codes of the workflow layer (in addition to [`crate::codes`]).
pub mod workflow_codes {
    /// Starting run id X again with a different workflow or input.
    pub const RUN_CONFLICT: &str = "run_conflict";
    /// The workflow name is not registered with this worker/CLI.
    pub const UNKNOWN_WORKFLOW: &str = "unknown_workflow";
    /// The input is not valid JSON or is too large.
    pub const INVALID_INPUT: &str = "invalid_input";
    /// Awaiting a run's result: the run ended without one (failed, compensated, cancelled or
    /// parked); the message names its status and error.
    pub const RUN_NOT_COMPLETED: &str = "run_not_completed";
    /// Awaiting a run's result: its output does not decode into the type the caller asked for.
    pub const INVALID_OUTPUT: &str = "invalid_output";
    /// Awaiting a run's result: the wait ended before the run did.
    pub const RESULT_TIMEOUT: &str = "result_timeout";
    /// A run reached [`super::RUN_STEPS_MAX`] journal entries: it fails with this code rather
    /// than fill the disk (a run that needs more continues as a new run, `ctx.continue_as_new`).
    pub const JOURNAL_FULL: &str = "journal_full";
    /// A run's deadline passed: it was cancelled (a saga compensates first).
    pub const DEADLINE_PASSED: &str = "deadline_passed";
}

/// A run's input (and an event's payload), as JSON: 256 KiB. (Run ids, workflow names and step
/// names are identifiers, see [`crate::id`]; step names may also be derived,
/// `compensate:charge_payment`, still within the identifier alphabet.)
pub const WORKFLOW_INPUT_BYTES_MAX: usize = 256 * 1024;
/// Output of one step or of a run, as canonical JSON.
pub const STEP_OUTPUT_BYTES_MAX: usize = 256 * 1024;
/// Steps (journal entries) of one run. A run that needs more should continue as a new run.
pub const RUN_STEPS_MAX: u32 = 10_000;
/// Events sent to one run that no wait consumed yet, at most: a send past it (an outsider's,
/// an inbox handler's or another run's `ctx.send`) is refused, `run_events_full`, and changes
/// nothing ([`events_held_check`]); the run takes more once its waits consume some. (The
/// events a wait consumed are bounded by the journal: a wait consumes one.) The store's own
/// events, a child's end for its parent, are never refused.
pub const RUN_EVENTS_HELD_MAX: usize = 10_000;

/// `run_events_full` when run `run_id` holds `held` events no wait consumed yet, at least
/// [`RUN_EVENTS_HELD_MAX`] (a store counts at most that many).
pub fn events_held_check(run_id: &str, held: usize) -> Result<()> {
    if held < RUN_EVENTS_HELD_MAX {
        return Ok(());
    }
    Err(Error::invalid(
        codes::RUN_EVENTS_FULL,
        format!(
            "run {run_id:?} holds {RUN_EVENTS_HELD_MAX} events no wait consumed yet, the most a run holds: \
             send again once it consumed some"
        ),
    ))
}
/// Runs started in one call.
pub const START_BATCH_MAX: usize = 10_000;
/// Journal writes committed in one transaction (group commit).
pub const COMMIT_BATCH_MAX: usize = 4_096;
/// Runs claimed by one claim call.
pub const CLAIM_BATCH_MAX: usize = 4_096;
/// Error messages kept per attempt.
pub const ERROR_BYTES_MAX: usize = 4_096;
/// The shortest lease a worker may take on a run, in ms.
pub const LEASE_MS_MIN: i64 = 100;
/// The longest lease a worker may take on a run, in ms (1 hour); also the longest attempt timeout.
pub const LEASE_MS_MAX: i64 = 60 * 60 * 1000;
/// Longest timer or wait.
pub const TIMER_MS_MAX: i64 = 366 * 24 * 60 * 60 * 1000;
/// The page cursors [`RunFilter::parse_page`] accepts (`<created_at_ms>:<run_id>`), as the
/// OpenAPI document states them.
pub const PAGE_CURSOR_PATTERN: &str = "^-?[0-9]{1,18}:[A-Za-z0-9_.:-]{1,100}$";
/// A day in ms.
const DAY_MS: i64 = 24 * 60 * 60 * 1000;
/// The longest wait of one request for a run's result or published value (API `wait_ms`, CLI
/// `--wait-ms`), in ms.
pub const RESULT_WAIT_MS_MAX: u64 = 60_000;

/// The status of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    /// Ready to run (new, or a step retry is due at `wake_at_ms`).
    Pending,
    /// Claimed by a worker under a lease.
    Running,
    /// Waiting for a durable timer (`wake_at_ms`).
    Sleeping,
    /// Waiting for an external event (`waiting_for`), until `wake_at_ms` (the timeout).
    Waiting,
    /// A saga step failed; completed steps are being compensated in reverse order.
    Compensating,
    /// The workflow returned: its output is the run's `result`.
    Completed,
    /// A saga failed and every completed step was compensated.
    Compensated,
    /// A step failed for good (not a saga, or compensation is not defined).
    Failed,
    /// Cancelled: by a cancel request (a saga compensates first) or by an operator's `abandon`.
    Cancelled,
    /// Dead letter: needs an operator (a compensation that kept failing, a non-deterministic
    /// replay, an abandoned step). `error` says why.
    Parked,
    /// The workflow continued as a new run (`ctx.continue_as_new`), started in the same
    /// transaction under [`continuation_run_id`]; that run carries on (its result is the
    /// chain's).
    Continued,
}

impl RunStatus {
    /// Every status, in the order of the enum.
    pub const ALL: [RunStatus; 11] = [
        RunStatus::Pending,
        RunStatus::Running,
        RunStatus::Sleeping,
        RunStatus::Waiting,
        RunStatus::Compensating,
        RunStatus::Completed,
        RunStatus::Compensated,
        RunStatus::Failed,
        RunStatus::Cancelled,
        RunStatus::Parked,
        RunStatus::Continued,
    ];

    /// The word stored in the `runs` table and shown by listings and the API.
    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Pending => "pending",
            RunStatus::Running => "running",
            RunStatus::Sleeping => "sleeping",
            RunStatus::Waiting => "waiting",
            RunStatus::Compensating => "compensating",
            RunStatus::Completed => "completed",
            RunStatus::Compensated => "compensated",
            RunStatus::Failed => "failed",
            RunStatus::Cancelled => "cancelled",
            RunStatus::Parked => "parked",
            RunStatus::Continued => "continued",
        }
    }

    /// The status named by `value` (one of the words of [`RunStatus::as_str`]), or `None`.
    pub fn parse(value: &str) -> Option<RunStatus> {
        RunStatus::ALL.into_iter().find(|s| s.as_str() == value)
    }

    /// Finished: no worker will touch the run again unless an operator retries or forks it.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            RunStatus::Completed
                | RunStatus::Compensated
                | RunStatus::Failed
                | RunStatus::Cancelled
                | RunStatus::Parked
                | RunStatus::Continued
        )
    }

    /// Can a worker claim a run in this status (when due and not leased)?
    pub fn is_claimable(self) -> bool {
        matches!(
            self,
            RunStatus::Pending
                | RunStatus::Running
                | RunStatus::Sleeping
                | RunStatus::Waiting
                | RunStatus::Compensating
        )
    }
}

/// The status a suspended run waits in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SuspendStatus {
    /// A step retry is due at `wake_at_ms`.
    Pending,
    /// A durable timer is set; the run is due at `wake_at_ms`.
    Sleeping,
    /// The run waits for an event (`waiting_for`), or for its timeout at `wake_at_ms`.
    Waiting,
    /// A compensation retry is due at `wake_at_ms`.
    Compensating,
}

impl SuspendStatus {
    /// The run status the run is stored with while suspended.
    pub fn run_status(self) -> RunStatus {
        match self {
            SuspendStatus::Pending => RunStatus::Pending,
            SuspendStatus::Sleeping => RunStatus::Sleeping,
            SuspendStatus::Waiting => RunStatus::Waiting,
            SuspendStatus::Compensating => RunStatus::Compensating,
        }
    }
}

/// How a run finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishStatus {
    /// The workflow returned its output.
    Completed,
    /// A saga failed and every completed step was compensated.
    Compensated,
    /// A step failed for good and nothing was compensated (not a saga, or no compensation
    /// defined).
    Failed,
    /// Cancelled at a step boundary after a cancel request (a saga compensated first).
    Cancelled,
    /// Dead letter: an operator must look (a compensation out of attempts, a non-deterministic
    /// replay).
    Parked,
    /// Continued as a new run (written by [`JournalOp::ContinueAsNew`], never by `Finish`).
    Continued,
}

impl FinishStatus {
    /// The run status the run is stored with once finished.
    pub fn run_status(self) -> RunStatus {
        match self {
            FinishStatus::Completed => RunStatus::Completed,
            FinishStatus::Compensated => RunStatus::Compensated,
            FinishStatus::Failed => RunStatus::Failed,
            FinishStatus::Cancelled => RunStatus::Cancelled,
            FinishStatus::Parked => RunStatus::Parked,
            FinishStatus::Continued => RunStatus::Continued,
        }
    }
}

/// The kind of a journal entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum StepKind {
    /// Calls the outside world: at least once, with a stable idempotency key.
    External,
    /// Writes to the workflow's own database in the journal's transaction: exactly once.
    Transactional,
    /// A durable timer.
    Sleep,
    /// A wait for an external event.
    Wait,
    /// A saga compensation (external or transactional, recorded as its own step).
    Compensation,
    /// A deterministic value taken on first execution (`ctx.now()`, `ctx.random()`,
    /// `ctx.uuid()`) and replayed thereafter.
    Value,
    /// A child run started by this run (`ctx.child`), with its end once it came.
    Child,
    /// A value the run published under a key (`ctx.set_event`), readable from outside.
    Publish,
    /// A message the run sent to another run (`ctx.send`).
    Send,
}

impl StepKind {
    /// The word stored in the `journal` table and shown by `workflow show` and the API.
    pub fn as_str(self) -> &'static str {
        match self {
            StepKind::External => "external",
            StepKind::Transactional => "transactional",
            StepKind::Sleep => "sleep",
            StepKind::Wait => "wait",
            StepKind::Compensation => "compensation",
            StepKind::Value => "value",
            StepKind::Child => "child",
            StepKind::Publish => "publish",
            StepKind::Send => "send",
        }
    }

    /// Every kind.
    pub const ALL: [StepKind; 9] = [
        StepKind::External,
        StepKind::Transactional,
        StepKind::Sleep,
        StepKind::Wait,
        StepKind::Compensation,
        StepKind::Value,
        StepKind::Child,
        StepKind::Publish,
        StepKind::Send,
    ];

    /// The kind named by `value` (one of the words of [`StepKind::as_str`]), or `None`.
    pub fn parse(value: &str) -> Option<StepKind> {
        StepKind::ALL.into_iter().find(|k| k.as_str() == value)
    }
}

/// The status of a journal entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum StepStatus {
    /// At least one attempt failed; the next is due at `next_attempt_at_ms`.
    Retrying,
    /// A timer or a wait that has not fired yet (`wake_at_ms`).
    Waiting,
    /// The step returned: its output is recorded and replay returns it.
    Completed,
    /// Failed for good (non-retryable, or out of attempts). `error` says why.
    Failed,
    /// An operator skipped it; `output` is what the operator supplied.
    Skipped,
}

impl StepStatus {
    /// The word stored in the `journal` table and shown by `workflow show` and the API.
    pub fn as_str(self) -> &'static str {
        match self {
            StepStatus::Retrying => "retrying",
            StepStatus::Waiting => "waiting",
            StepStatus::Completed => "completed",
            StepStatus::Failed => "failed",
            StepStatus::Skipped => "skipped",
        }
    }

    /// The status named by `value` (one of the words of [`StepStatus::as_str`]), or `None`.
    pub fn parse(value: &str) -> Option<StepStatus> {
        [StepStatus::Retrying, StepStatus::Waiting, StepStatus::Completed, StepStatus::Failed, StepStatus::Skipped]
            .into_iter()
            .find(|s| s.as_str() == value)
    }

    /// Replay returns this entry's recorded result without running the step.
    pub fn is_settled(self) -> bool {
        matches!(self, StepStatus::Completed | StepStatus::Failed | StepStatus::Skipped)
    }
}

/// Backoff between attempts of one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Backoff {
    /// `initial_ms * multiplier^(n-1)`, capped at `max_ms`, with equal jitter.
    Exponential {
        /// The delay after the first failure, in ms.
        initial_ms: i64,
        /// What each further delay is multiplied by (1..=100).
        multiplier: f64,
        /// The longest delay, in ms.
        max_ms: i64,
    },
    /// Explicit delays; the last one repeats. The seed's schedule is
    /// `[1000, 5000, 30000, 300000, 3600000]`.
    Schedule {
        /// The delay after the first, second, ... failure, in ms.
        delays_ms: Vec<i64>,
    },
}

/// Retry policy of one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RetryPolicy {
    /// Attempts in all, the first included (default 5).
    pub max_attempts: u32,
    /// How long to wait between attempts.
    pub backoff: Backoff,
    /// Each attempt is cancelled after this long and counts as a failed attempt (default 30 s).
    pub attempt_timeout_ms: i64,
    /// Apply equal jitter (half fixed, half random) to each delay.
    pub jitter: bool,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 5,
            backoff: Backoff::Exponential { initial_ms: 1_000, multiplier: 5.0, max_ms: 3_600_000 },
            attempt_timeout_ms: 30_000,
            jitter: true,
        }
    }
}

impl RetryPolicy {
    /// The seed's schedule: 1 s, 5 s, 30 s, 5 min, 1 h between attempts, 5 attempts.
    pub fn seed_schedule() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 5,
            backoff: Backoff::Schedule { delays_ms: vec![1_000, 5_000, 30_000, 300_000, 3_600_000] },
            attempt_timeout_ms: 30_000,
            jitter: false,
        }
    }

    /// Retry forever (compensations): effectively unbounded attempts, capped delays.
    pub fn until_success(max_attempts: u32) -> RetryPolicy {
        RetryPolicy { max_attempts, ..RetryPolicy::default() }
    }

    /// Check the policy's bounds: 1..=1,000,000 attempts, an attempt timeout of 1 ms..=1 h, an
    /// exponential backoff with 0 <= `initial_ms` <= `max_ms` <= 1 year and a multiplier of
    /// 1..=100, or a schedule of 1..=1,000 delays of 0..=1 year (`invalid_argument` otherwise).
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::invalid(codes::INVALID_ARGUMENT, format!("retry policy: {m}")));
        if self.max_attempts == 0 || self.max_attempts > 1_000_000 {
            return bad("max_attempts must be 1..=1000000");
        }
        if !(1..=LEASE_MS_MAX).contains(&self.attempt_timeout_ms) {
            return bad("attempt_timeout_ms must be 1..=3600000");
        }
        match &self.backoff {
            Backoff::Exponential { initial_ms, multiplier, max_ms } => {
                if *initial_ms < 0
                    || *max_ms < *initial_ms
                    || *max_ms > TIMER_MS_MAX
                    || !(1.0..=100.0).contains(multiplier)
                {
                    return bad("exponential backoff needs 0 <= initial_ms <= max_ms <= 1 year and multiplier 1..=100");
                }
            }
            Backoff::Schedule { delays_ms } => {
                if delays_ms.is_empty()
                    || delays_ms.len() > 1_000
                    || delays_ms.iter().any(|d| !(0..=TIMER_MS_MAX).contains(d))
                {
                    return bad("a schedule needs 1..=1000 delays of 0..=1 year");
                }
            }
        }
        Ok(())
    }

    /// Delay before the attempt after the `failed_attempts`-th failure (1-based). `unit` is
    /// uniform in [0, 1).
    pub fn delay_ms(&self, failed_attempts: u32, unit: f64) -> i64 {
        let n = failed_attempts.max(1);
        let ceiling = match &self.backoff {
            Backoff::Exponential { initial_ms, multiplier, max_ms } => {
                let raw = *initial_ms as f64 * multiplier.powi((n - 1).min(60) as i32);
                if raw.is_finite() {
                    (raw as i64).min(*max_ms)
                } else {
                    *max_ms
                }
            }
            Backoff::Schedule { delays_ms } => delays_ms[((n - 1) as usize).min(delays_ms.len() - 1)],
        };
        if self.jitter {
            let half = ceiling / 2;
            half + ((ceiling - half) as f64 * unit.clamp(0.0, 1.0)) as i64
        } else {
            ceiling
        }
    }
}

/// Why a step attempt failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepFailure {
    /// What went wrong, for the journal and the operator (cut at 4 KiB).
    pub message: String,
    /// False for errors that retrying cannot fix (bad request, declined card).
    pub retryable: bool,
}

impl StepFailure {
    /// A failure worth another attempt (a timeout, an unreachable service): the step retries per
    /// its policy.
    pub fn retryable(message: impl Into<String>) -> Self {
        StepFailure { message: truncate(message.into()), retryable: true }
    }

    /// A failure no retry can fix (a declined card): the step fails for good at once, and a saga
    /// compensates.
    pub fn permanent(message: impl Into<String>) -> Self {
        StepFailure { message: truncate(message.into()), retryable: false }
    }
}

/// A store failure inside a step is worth retrying; bad input is not.
impl From<Error> for StepFailure {
    fn from(error: Error) -> Self {
        if error.is_invalid_input() {
            StepFailure::permanent(error.to_string())
        } else {
            StepFailure::retryable(error.to_string())
        }
    }
}

/// A SQLite failure in a transactional step's own statements: retried (the step's savepoint is
/// rolled back, its journal entry records the attempt).
#[cfg(feature = "rusqlite")]
impl From<rusqlite::Error> for StepFailure {
    fn from(error: rusqlite::Error) -> Self {
        StepFailure::retryable(format!("sqlite: {error}"))
    }
}

fn truncate(mut message: String) -> String {
    if message.len() > ERROR_BYTES_MAX {
        let mut end = ERROR_BYTES_MAX;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
    }
    message
}

/// A request to start a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StartRequest {
    /// The caller-chosen run id: starting the same id again is idempotent.
    pub run_id: String,
    /// The registered workflow's name.
    pub workflow: String,
    /// The workflow version the run is pinned to (the starter's registered version).
    pub version: u32,
    /// The workflow's input (JSON, at most 256 KiB); replays see the same input.
    pub input: Value,
    /// Optional serialization key: at most one active run per key.
    pub key: Option<String>,
    /// Do not run before this time (durable start-at timer).
    pub start_at_ms: Option<i64>,
    /// Run through a named queue (its concurrency and rate limits, priority, deduplication):
    /// `None` runs as soon as a worker has a slot.
    #[serde(default)]
    pub queue: Option<crate::queue::Enqueue>,
    /// The run's deadline, in ms since the Unix epoch (at most a year ahead): when it passes, the
    /// run is cancelled at its next step boundary (a saga compensates first) and ends
    /// `cancelled` with [`workflow_codes::DEADLINE_PASSED`]. Children inherit it; a continuation
    /// keeps it (the deadline spans the chain).
    #[serde(default)]
    pub deadline_ms: Option<i64>,
}

impl StartRequest {
    /// Start run `run_id` of `workflow` version `version` with `input`, now, without a key.
    pub fn new(run_id: &str, workflow: &str, version: u32, input: Value) -> Self {
        StartRequest {
            run_id: run_id.to_string(),
            workflow: workflow.to_string(),
            version,
            input,
            key: None,
            start_at_ms: None,
            queue: None,
            deadline_ms: None,
        }
    }

    /// End the run (cancelled, compensating first) if it has not ended by `deadline_ms`.
    pub fn with_deadline(mut self, deadline_ms: i64) -> Self {
        self.deadline_ms = Some(deadline_ms);
        self
    }

    /// Run through queue `queue` with `priority` (lower first) and an optional deduplication id.
    pub fn in_queue(mut self, queue: &str, priority: i32, dedup_id: Option<&str>) -> Self {
        self.queue =
            Some(crate::queue::Enqueue { queue: queue.to_string(), priority, dedup_id: dedup_id.map(str::to_string) });
        self
    }

    /// Check the request before any transaction: identifiers (`invalid_id`), a version of at least
    /// 1 (`invalid_argument`), an input of at most 256 KiB (`invalid_input`), the queue's fields.
    pub fn validate(&self) -> Result<()> {
        validate_id("run_id", &self.run_id)?;
        validate_id("workflow", &self.workflow)?;
        if let Some(key) = &self.key {
            validate_id("key", key)?;
        }
        if let Some(enqueue) = &self.queue {
            enqueue.validate()?;
            if self.key.is_some() {
                return Err(Error::invalid(
                    codes::INVALID_ARGUMENT,
                    "a run goes through a queue or is serialized by a key, not both",
                ));
            }
        }
        if self.version == 0 {
            return Err(Error::invalid(codes::INVALID_ARGUMENT, "workflow version must be >= 1"));
        }
        validate_json_size("input", &self.input, WORKFLOW_INPUT_BYTES_MAX, workflow_codes::INVALID_INPUT)?;
        if self.deadline_ms.is_some_and(|d| d < 0) {
            return Err(Error::invalid(codes::INVALID_ARGUMENT, "deadline_ms must be >= 0"));
        }
        Ok(())
    }

    /// The hash that decides whether a second start of the same run id is the same request.
    pub fn input_hash(&self) -> String {
        let canonical = serde_json::to_vec(&(&self.workflow, &self.input)).expect("json serialises");
        crate::envelope::hash_hex(&canonical)
    }
}

/// The latest `start_at_ms` a start received at `now_ms` may ask for: the last millisecond of the
/// UTC day 365 days after the day of `now_ms` (so at least 365 days ahead, less than
/// [`TIMER_MS_MAX`]). The bound moves once a day, at UTC midnight, not with every millisecond:
/// the OpenAPI document states the bound of the day it is served, and every start that day is
/// held to that bound.
pub fn start_at_ms_max(now_ms: i64) -> i64 {
    now_ms.div_euclid(DAY_MS).saturating_mul(DAY_MS).saturating_add(TIMER_MS_MAX - 1)
}

/// `at_ms` must not be further ahead of `now_ms` than the longest timer (`invalid_argument`).
pub fn validate_not_too_far(field: &str, at_ms: i64, now_ms: i64) -> Result<()> {
    if at_ms.saturating_sub(now_ms) > TIMER_MS_MAX {
        return Err(Error::invalid(codes::INVALID_ARGUMENT, format!("{field} is more than {TIMER_MS_MAX} ms ahead")));
    }
    Ok(())
}

/// The deadline `timeout_ms` after `now_ms` (a start's `timeout_ms` over HTTP, `--timeout-ms` in
/// the CLI): 1..=[`TIMER_MS_MAX`] ms, `invalid_argument` otherwise; `None` without a timeout.
pub fn deadline_after(now_ms: i64, timeout_ms: Option<i64>) -> Result<Option<i64>> {
    match timeout_ms {
        Some(t) if !(1..=TIMER_MS_MAX).contains(&t) => {
            Err(Error::invalid(codes::INVALID_ARGUMENT, format!("timeout_ms must be 1..={TIMER_MS_MAX}")))
        }
        other => Ok(other.map(|t| now_ms.saturating_add(t))),
    }
}

/// Check a batch of starts before any transaction, the same on every store: at most
/// [`START_BATCH_MAX`] requests (`limit_exceeded`), each valid ([`StartRequest::validate`]), its
/// start-at time at most [`start_at_ms_max`] and its deadline at most a year ahead of `now_ms`
/// (`invalid_argument`).
pub fn validate_starts(requests: &[StartRequest], now_ms: i64) -> Result<()> {
    crate::id::validate_limit("start batch", requests.len(), START_BATCH_MAX)?;
    for request in requests {
        request.validate()?;
        if let Some(at) = request.start_at_ms {
            let latest = start_at_ms_max(now_ms);
            if at > latest {
                return Err(Error::invalid(
                    codes::INVALID_ARGUMENT,
                    format!(
                        "start_at_ms is {at}, after {latest} (the end of the UTC day 365 days after today's): a start \
                         is due at most about a year ahead"
                    ),
                ));
            }
        }
        if let Some(at) = request.deadline_ms {
            validate_not_too_far("deadline_ms", at, now_ms)?;
        }
    }
    Ok(())
}

/// Check that `value` is at most `max` bytes of JSON; the error `code` (naming `field`) otherwise.
pub fn validate_json_size(field: &str, value: &Value, max: usize, code: &'static str) -> Result<()> {
    let size = serde_json::to_vec(value).map(|v| v.len()).unwrap_or(usize::MAX);
    if size > max {
        return Err(Error::invalid(code, format!("{field} is {size} bytes of JSON, limit is {max}")));
    }
    Ok(())
}

/// The run id of the child a run starts at journal position `seq` (`ctx.child`): derived, so a
/// replay names the same child and never starts a second one. `{parent}.{seq}` while that fits
/// an identifier (100 characters); else `child-{32 hex digits of the parent id's SHA-256}.{seq}`.
pub fn child_run_id(parent_run_id: &str, seq: u32) -> String {
    let plain = format!("{parent_run_id}.{seq}");
    if plain.len() <= crate::limits::ID_BYTES_MAX {
        return plain;
    }
    let hash = crate::envelope::hash_hex(parent_run_id.as_bytes());
    format!("child-{}.{seq}", &hash[..32])
}

/// The name (and id) of the event that tells a parent run how its child at journal position `seq`
/// ended. The `/` is outside the identifier alphabet, so no sender of events (API, CLI, inbox
/// handler) can forge one; only the store writes it, when the child ends.
pub fn child_event(seq: u32) -> String {
    format!("child/{seq}")
}

/// The run id a run continues as (`ctx.continue_as_new`): `{base}.c{n+1}` for a run
/// `{base}.c{n}`, else `{run_id}.c1` (a child's id ends in digits alone, so the two never meet);
/// past 100 characters, `cont-{32 hex digits of the base's SHA-256}.c{n+1}`. Derived, so the
/// chain of a run is known from its first id, and a handle follows it.
pub fn continuation_run_id(run_id: &str) -> String {
    let (base, n) = match run_id.rsplit_once(".c") {
        Some((base, n)) if !base.is_empty() && !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
            (base, n.parse::<u64>().unwrap_or(u64::MAX - 1))
        }
        _ => (run_id, 0),
    };
    let next = n.saturating_add(1);
    let plain = format!("{base}.c{next}");
    if plain.len() <= crate::limits::ID_BYTES_MAX {
        return plain;
    }
    let hash = crate::envelope::hash_hex(base.as_bytes());
    format!("cont-{}.c{next}", &hash[..32])
}

/// The step name of a patch marker (`ctx.patched(id)`): `patch:{id}`.
pub fn patch_step_name(patch_id: &str) -> String {
    format!("patch:{patch_id}")
}

/// Is `name` an event name [`child_event`] makes?
pub fn is_child_event(name: &str) -> bool {
    name.strip_prefix("child/").is_some_and(|seq| !seq.is_empty() && seq.bytes().all(|b| b.is_ascii_digit()))
}

/// The event id of the message run `sender` sends at journal position `seq` (`ctx.send`):
/// `msg/<seq>/<16 hex digits of the sender's SHA-256>`. The `/` keeps it apart from every id an
/// API or CLI sender can give, and the id is the same on every replay (a message is sent once).
pub fn message_event_id(sender: &str, seq: u32) -> String {
    let hash = crate::envelope::hash_hex(sender.as_bytes());
    format!("msg/{seq}/{}", &hash[..16])
}

/// Is `id` an event id the store makes itself ([`child_event`], [`message_event_id`]), outside
/// the identifier alphabet that senders are held to?
pub fn is_store_event_id(id: &str) -> bool {
    if is_child_event(id) {
        return true;
    }
    let Some(rest) = id.strip_prefix("msg/") else { return false };
    let Some((seq, hash)) = rest.split_once('/') else { return false };
    !seq.is_empty()
        && seq.bytes().all(|b| b.is_ascii_digit())
        && hash.len() == 16
        && hash.bytes().all(|b| b.is_ascii_hexdigit())
}

fn invalid_argument(message: impl Into<String>) -> Error {
    Error::invalid(codes::INVALID_ARGUMENT, message)
}

/// Where a page of a run's detail starts and how much it holds ([`WorkflowStore::run_page`],
/// `GET /v1/runs/{run_id}?after_seq=&events_after=&limit=`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DetailPage {
    /// The journal after this position (the [`RunDetail::next_after_seq`] of the page before);
    /// from the start when `None`.
    pub after_seq: Option<u32>,
    /// The events no wait consumed yet after this one, by (received_at_ms, event_id) (the
    /// [`RunDetail::next_events_after`] of the page before); from the first when `None`.
    pub events_after: Option<(i64, String)>,
    /// At most this many journal entries, and at most this many unconsumed events
    /// (1..=[`RUN_STEPS_MAX`]).
    pub limit: usize,
}

impl DetailPage {
    /// The first page of `limit` entries.
    pub fn first(limit: usize) -> DetailPage {
        DetailPage { after_seq: None, events_after: None, limit }
    }

    /// The page that follows `detail` (a page of `limit`), or `None` when `detail` is the last.
    /// `invalid_argument` when its [`RunDetail::next_events_after`] is not a cursor
    /// [`event_cursor`] wrote (a detail read from elsewhere): never the first page again.
    pub fn after(detail: &RunDetail, limit: usize) -> Result<Option<DetailPage>> {
        if !detail.is_cut() {
            return Ok(None);
        }
        let events_after = detail.next_events_after.as_deref().map(parse_event_cursor).transpose()?;
        Ok(Some(DetailPage { after_seq: detail.next_after_seq, events_after, limit }))
    }

    /// The arguments checked: a run id, a position below [`RUN_STEPS_MAX`], an event id in the
    /// cursor, and a limit of 1..=[`RUN_STEPS_MAX`].
    pub fn validate(&self, run_id: &str) -> Result<()> {
        validate_id("run_id", run_id)?;
        self.after_seq.map(validate_seq).transpose()?;
        if let Some((_, event_id)) = &self.events_after {
            validate_id("event_id of the cursor", event_id)?;
        }
        crate::id::validate_limit("journal page size", self.limit, RUN_STEPS_MAX as usize)
    }
}

/// The cursor of the unconsumed events after `event` (`<received_at_ms>:<event_id>`).
pub fn event_cursor(event: &RunEvent) -> String {
    event_cursor_at(event.received_at_ms, &event.event_id)
}

/// The cursor of the unconsumed events after the one received at `received_at_ms` as `event_id`.
fn event_cursor_at(received_at_ms: i64, event_id: &str) -> String {
    format!("{received_at_ms}:{event_id}")
}

/// Parse a cursor made by [`event_cursor`]: exactly the strings [`PAGE_CURSOR_PATTERN`] matches
/// (`invalid_argument` otherwise, or `invalid_id` for the event id).
pub fn parse_event_cursor(text: &str) -> Result<(i64, String)> {
    parse_cursor(text, "the unconsumed events of a run's detail (<received_at_ms>:<event_id>)", "event_id")
}

/// A `<ms>:<id>` cursor of the listing `what`, its id named `id_name`.
fn parse_cursor(text: &str, what: &str, id_name: &str) -> Result<(i64, String)> {
    let bad = || Error::invalid(codes::INVALID_ARGUMENT, format!("{text:?} is not a page cursor given by {what}"));
    let (ms, id) = text.split_once(':').ok_or_else(bad)?;
    // An optional `-` and 1..=18 digits (any i64 of at most 18 digits: ±31 million years of
    // ms), nothing else (`i64::from_str` would also take a `+`).
    let digits = ms.strip_prefix('-').unwrap_or(ms);
    if digits.is_empty() || digits.len() > 18 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let ms: i64 = ms.parse().map_err(|_| bad())?;
    validate_id(&format!("{id_name} of the cursor"), id)?;
    Ok((ms, id.to_string()))
}

/// The attempts of one journal position a run's detail shows: the last 100 (by attempt
/// number); the entry's `attempts` and the attempt numbers say how many there were.
pub const DETAIL_ATTEMPTS_MAX: u32 = 100;

/// Cut the entries a [`WorkflowStore::run_page`] read (at most `limit + 1`, in position order,
/// so that one past the page says entries follow) to the page's `limit`: its
/// [`RunDetail::next_after_seq`], set when entries follow.
pub fn cut_journal_page(journal: &mut Vec<JournalEntry>, limit: usize) -> Option<u32> {
    let next_after_seq = (journal.len() > limit).then(|| journal[limit - 1].seq);
    journal.truncate(limit);
    next_after_seq
}

/// A journal position within [`RUN_STEPS_MAX`] (`limit_exceeded` beyond it).
pub fn validate_seq(seq: u32) -> Result<()> {
    if seq >= RUN_STEPS_MAX {
        return Err(Error::invalid(
            codes::LIMIT_EXCEEDED,
            format!("step position {seq} is beyond the {RUN_STEPS_MAX} steps a run may take"),
        ));
    }
    Ok(())
}

/// The JSON text of `value` as stored, refused (like `validate_json_size`) when over `max` bytes.
/// Serialised once: validation and the write share the text.
pub fn json_within(field: &str, value: &Value, max: usize) -> Result<String> {
    let text = serde_json::to_string(value).expect("a JSON value always serialises");
    if text.len() > max {
        return Err(Error::invalid(
            codes::PAYLOAD_TOO_LARGE,
            format!("{field} is {} bytes of JSON, limit is {max}", text.len()),
        ));
    }
    Ok(text)
}

fn validate_step(seq: u32, name: &str, attempt: u32, retry_at_ms: Option<i64>, now_ms: i64) -> Result<()> {
    validate_seq(seq)?;
    validate_id("step name", name)?;
    if attempt == 0 {
        return Err(invalid_argument("attempt numbers start at 1"));
    }
    if let Some(at) = retry_at_ms {
        validate_not_too_far("retry_at_ms", at, now_ms)?;
    }
    Ok(())
}

/// Check one journal write before a store's commit begins, the same on every store (bad input in
/// any write refuses the whole batch before anything runs): identifiers, positions within
/// [`RUN_STEPS_MAX`] (`limit_exceeded`), times at most a year ahead, sizes within their limits
/// (`payload_too_large`), and the shape each op must have (`invalid_argument`). Returns the JSON
/// text the write stores (a step's output, a timer's output, a run's result), serialised once
/// here. `ids_checked`: the previous write of the batch had the same run id and token (checked
/// then).
pub fn validate_write<T: ?Sized>(write: &JournalWrite<T>, ids_checked: bool, now_ms: i64) -> Result<Option<String>> {
    if !ids_checked {
        validate_id("run_id", &write.run_id)?;
        validate_id("lease_token", &write.lease_token)?;
    }
    match &write.op {
        JournalOp::SetStatus { status } => {
            if !matches!(status, RunStatus::Running | RunStatus::Compensating) {
                return Err(invalid_argument(format!(
                    "SetStatus takes running or compensating, not {} (use Suspend or Finish)",
                    status.as_str()
                )));
            }
        }
        JournalOp::StepAttempt { seq, name, kind, attempt, result, retry_at_ms } => {
            validate_step(*seq, name, *attempt, *retry_at_ms, now_ms)?;
            if !matches!(kind, StepKind::External | StepKind::Compensation | StepKind::Value) {
                return Err(invalid_argument(format!("a step attempt cannot be of kind {}", kind.as_str())));
            }
            if *kind == StepKind::Value && (*attempt != 1 || result.is_err()) {
                return Err(invalid_argument("a value is recorded once, by a first successful attempt"));
            }
            if let Ok(output) = result {
                return json_within("step output", output, STEP_OUTPUT_BYTES_MAX).map(Some);
            }
        }
        JournalOp::TxStep { seq, name, kind, attempt, retry_at_ms, .. } => {
            validate_step(*seq, name, *attempt, *retry_at_ms, now_ms)?;
            if !matches!(kind, StepKind::Transactional | StepKind::Compensation) {
                return Err(invalid_argument(format!("a transactional step cannot be of kind {}", kind.as_str())));
            }
        }
        JournalOp::TimerStarted { seq, name, kind, wake_at_ms, event_name } => {
            validate_seq(*seq)?;
            validate_id("step name", name)?;
            validate_not_too_far("wake_at_ms", *wake_at_ms, now_ms)?;
            match (kind, event_name) {
                (StepKind::Sleep, None) => {}
                (StepKind::Wait, Some(event_name)) => validate_id("event name", event_name)?,
                _ => return Err(invalid_argument("a timer is a sleep without an event name or a wait with one")),
            }
        }
        JournalOp::StartChild { seq, name, request, wake_at_ms, claim } => {
            validate_seq(*seq)?;
            validate_id("step name", name)?;
            validate_not_too_far("wake_at_ms", *wake_at_ms, now_ms)?;
            request.validate()?;
            if let Some(claim) = claim {
                validate_id("worker_id", &claim.worker_id)?;
                if !(LEASE_MS_MIN..=LEASE_MS_MAX).contains(&claim.lease_ms) {
                    return Err(invalid_argument(format!("lease_ms must be {LEASE_MS_MIN}..={LEASE_MS_MAX}")));
                }
            }
            if request.run_id != child_run_id(&write.run_id, *seq) || request.start_at_ms.is_some() {
                return Err(invalid_argument(format!(
                    "the child at step {seq} of run {} is run {:?}, due at once",
                    write.run_id,
                    child_run_id(&write.run_id, *seq)
                )));
            }
        }
        JournalOp::Publish { seq, key, value } => {
            validate_seq(*seq)?;
            validate_id("event key", key)?;
            return json_within("published value", value, WORKFLOW_INPUT_BYTES_MAX).map(Some);
        }
        JournalOp::Send { seq, to, topic, payload } => {
            validate_seq(*seq)?;
            validate_id("to", to)?;
            validate_id("topic", topic)?;
            return json_within("message", payload, WORKFLOW_INPUT_BYTES_MAX).map(Some);
        }
        JournalOp::ChildEnded { seq, end } => {
            validate_seq(*seq)?;
            return json_within("child end", end, STEP_OUTPUT_BYTES_MAX).map(Some);
        }
        JournalOp::TimerFinished { seq, event_id, output } => {
            validate_seq(*seq)?;
            if let Some(event_id) = event_id.as_deref().filter(|id| !is_store_event_id(id)) {
                validate_id("event_id", event_id)?;
            }
            return json_within("step output", output, STEP_OUTPUT_BYTES_MAX).map(Some);
        }
        JournalOp::Suspend { status, wake_at_ms, waiting_for } => {
            validate_not_too_far("wake_at_ms", *wake_at_ms, now_ms)?;
            match (status, waiting_for) {
                (SuspendStatus::Waiting, Some(name)) if is_child_event(name) => {}
                (SuspendStatus::Waiting, Some(name)) => validate_id("waiting_for", name)?,
                (SuspendStatus::Waiting, None) => return Err(invalid_argument("a waiting run needs waiting_for")),
                (_, Some(_)) => return Err(invalid_argument("only a waiting run waits for an event")),
                (_, None) => {}
            }
        }
        JournalOp::ContinueAsNew { request } => {
            request.validate()?;
            if request.run_id != continuation_run_id(&write.run_id) || request.start_at_ms.is_some() {
                return Err(invalid_argument(format!(
                    "run {} continues as run {:?}, due at once",
                    write.run_id,
                    continuation_run_id(&write.run_id)
                )));
            }
            if request.queue.as_ref().is_some_and(|q| q.dedup_id.is_some()) {
                return Err(invalid_argument("a continuation carries no deduplication id"));
            }
            if let Some(at) = request.deadline_ms {
                validate_not_too_far("deadline_ms", at, now_ms)?;
            }
        }
        JournalOp::Finish { status: FinishStatus::Continued, .. } => {
            return Err(invalid_argument("a run ends continued by ContinueAsNew, not by Finish"));
        }
        JournalOp::Finish { result, .. } => {
            if let Some(result) = result {
                return json_within("run result", result, STEP_OUTPUT_BYTES_MAX).map(Some);
            }
        }
        JournalOp::FinishChild { status: FinishStatus::Parked | FinishStatus::Continued, .. } => {
            return Err(invalid_argument("a child that parks or continues ends by Finish or ContinueAsNew"));
        }
        JournalOp::FinishChild { result, parent_lease_token, .. } => {
            validate_id("parent_lease_token", parent_lease_token)?;
            if let Some(result) = result {
                return json_within("run result", result, STEP_OUTPUT_BYTES_MAX).map(Some);
            }
        }
        JournalOp::Release => {}
    }
    Ok(None)
}

/// A value a run published (`ctx.set_event`), as read from outside.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PublishedValue {
    /// The run.
    pub run_id: String,
    /// The key.
    pub key: String,
    /// The latest value published under it.
    pub value: Value,
    /// The journal position that published it.
    pub seq: u32,
    /// When, in ms since the Unix epoch.
    pub updated_at_ms: i64,
}

/// The answer to one start request.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum StartOutcome {
    /// A new run was created, due at once (or at `start_at_ms`).
    Started {
        /// The new run's id.
        run_id: String,
    },
    /// The same run id with the same workflow and input: the existing run.
    Existing {
        /// The run that already exists.
        run_id: String,
        /// Its status now.
        status: RunStatus,
    },
    /// The same run id with another workflow or input.
    Conflict {
        /// The run id asked for.
        run_id: String,
        /// What differs (workflow or input).
        reason: String,
    },
}

/// One run, as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RunRecord {
    /// The caller-chosen run id.
    pub run_id: String,
    /// The workflow the run executes.
    pub workflow: String,
    /// The workflow version the run is pinned to; only a worker that registered it claims the run.
    pub version: u32,
    /// The run's input, as given at start.
    pub input: Value,
    /// The serialization key: at most one active run per key, oldest first.
    pub key: Option<String>,
    /// Where the run stands.
    pub status: RunStatus,
    /// The workflow's output, once `completed`.
    pub result: Option<Value>,
    /// Why the run failed, was parked, cancelled or abandoned (or that a cancel was requested).
    pub error: Option<String>,
    /// When the run is next due (start-at, retry, timer, wait timeout).
    pub wake_at_ms: i64,
    /// The event name a `waiting` run waits for.
    pub waiting_for: Option<String>,
    /// An operator asked for cancellation: the run stops at its next step boundary.
    pub cancel_requested: bool,
    /// The run this one was forked from, if any.
    pub forked_from: Option<String>,
    /// The run that started this one as its child (`ctx.child`), if any; it learns how this run
    /// ended.
    pub parent_run_id: Option<String>,
    /// The queue the run goes through, if any.
    pub queue: Option<String>,
    /// Its priority in the queue (lower first).
    pub priority: Option<i32>,
    /// When its queue admitted it (its first claim), in ms since the Unix epoch; until then it
    /// waits in the queue.
    pub admitted_at_ms: Option<i64>,
    /// When the run is cancelled if it has not ended, in ms since the Unix epoch.
    pub deadline_ms: Option<i64>,
    /// The worker id that holds the lease, while one does.
    pub lease_owner: Option<String>,
    /// When the lease expires, in ms since the Unix epoch; after that another worker may claim the
    /// run (a recovery).
    pub lease_expires_at_ms: Option<i64>,
    /// Times a worker took the run over after another's lease expired.
    pub recoveries: u32,
    /// When the run was started, in ms since the Unix epoch; listings page by it.
    pub created_at_ms: i64,
    /// When the run last changed, in ms since the Unix epoch.
    pub updated_at_ms: i64,
}

/// One journal entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JournalEntry {
    /// The entry's position in the run's journal (0, 1, 2, ... in the order the workflow called its
    /// steps).
    pub seq: u32,
    /// The step's name; replay checks it against the call at this position (a different name parks
    /// the run as non-deterministic).
    pub name: String,
    /// What kind of step it is.
    pub kind: StepKind,
    /// Where the step stands.
    pub status: StepStatus,
    /// The step's recorded output (or the operator-supplied one for a skipped step); replay returns
    /// it.
    pub output: Option<Value>,
    /// The error of the last failed attempt.
    pub error: Option<String>,
    /// Attempts made so far (failed ones included).
    pub attempts: u32,
    /// When the next attempt of a `retrying` step is due, in ms since the Unix epoch.
    pub next_attempt_at_ms: Option<i64>,
    /// Timer fire time, or wait deadline.
    pub wake_at_ms: Option<i64>,
    /// The event name of a wait.
    pub event_name: Option<String>,
    /// Why an operator changed the entry (`operator retry: ...`, `operator skip: ...`).
    pub reason: Option<String>,
    /// When the entry last changed, in ms since the Unix epoch.
    pub updated_at_ms: i64,
}

/// One attempt of one step (every attempt and its error is recorded).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AttemptRecord {
    /// The journal position of the step attempted.
    pub seq: u32,
    /// Ordinal of the attempt at this position over the run's whole life: an operator `retry`
    /// restarts the journal entry's `attempts` budget, not this history.
    pub attempt: u32,
    /// Whether the attempt succeeded.
    pub ok: bool,
    /// Why the attempt failed, if it did.
    pub error: Option<String>,
    /// When the attempt finished, in ms since the Unix epoch.
    pub finished_at_ms: i64,
}

/// An event sent to a run (by API, CLI or an inbox handler).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RunEvent {
    /// The event's id, chosen by the sender: sending the same id again is idempotent.
    pub event_id: String,
    /// The event's name; a wait for that name consumes it.
    pub name: String,
    /// The event's data, returned to the workflow by the wait.
    pub payload: Value,
    /// When the store received it, in ms since the Unix epoch.
    pub received_at_ms: i64,
    /// The journal seq of the wait that consumed it.
    pub consumed_by_seq: Option<u32>,
}

/// A run with everything recorded about it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RunDetail {
    /// The run's record.
    pub run: RunRecord,
    /// Its journal, by position.
    pub journal: Vec<JournalEntry>,
    /// The attempts of its steps, by position and attempt: of each position the last
    /// [`DETAIL_ATTEMPTS_MAX`] (100).
    pub attempts: Vec<AttemptRecord>,
    /// The events sent to it, in arrival order (received_at_ms, then event_id).
    pub events: Vec<RunEvent>,
    /// Set on a page of the detail that more pages follow ([`WorkflowStore::run_page`],
    /// `GET /v1/runs/{run_id}?after_seq=`): the last position this page (or the ones before it)
    /// holds, where the next page starts after. Absent (null) on the last page, on a whole
    /// detail, and while the run's journal is empty.
    #[serde(default)]
    pub next_after_seq: Option<u32>,
    /// Set on the page that ends the journal when more events no wait consumed follow than the
    /// page holds: the cursor (`<received_at_ms>:<event_id>`) the next page's `events_after`
    /// takes, with `after_seq` = [`RunDetail::next_after_seq`]. Absent (null) otherwise.
    #[serde(default)]
    pub next_events_after: Option<String>,
}

impl RunDetail {
    /// Keep the first `keep` journal entries and what belongs to them: the attempts of their
    /// positions and the events they consumed. When that cuts entries off, the events no wait
    /// consumed go too (they belong to the page that ends the journal) and
    /// [`RunDetail::next_after_seq`] becomes the last kept position.
    pub fn keep_entries(&mut self, keep: usize) {
        if keep >= self.journal.len() {
            return;
        }
        self.journal.truncate(keep);
        let last = self.journal.last().map(|entry| entry.seq);
        let kept = |seq: u32| last.is_some_and(|last| seq <= last);
        self.attempts.retain(|attempt| kept(attempt.seq));
        self.events.retain(|event| event.consumed_by_seq.is_some_and(kept));
        self.next_after_seq = last;
        self.next_events_after = None;
    }

    /// Add the events no wait consumed yet that a [`WorkflowStore::run_page`] read for `page`
    /// (at most `page.limit + 1`, in arrival order, after `page.events_after`), cut to the
    /// page's limit: when one is cut, the cursors say where the next page starts.
    pub fn add_unconsumed(&mut self, mut unconsumed: Vec<RunEvent>, page: &DetailPage) {
        if unconsumed.len() > page.limit {
            unconsumed.truncate(page.limit);
            self.next_after_seq = self.journal.last().map(|entry| entry.seq).or(page.after_seq);
            self.next_events_after = unconsumed.last().map(event_cursor);
        }
        self.events.extend(unconsumed);
        self.sort_events();
    }

    /// The events in arrival order (received_at_ms, then event_id), as the stores read them.
    fn sort_events(&mut self) {
        self.events.sort_by(|a, b| (a.received_at_ms, &a.event_id).cmp(&(b.received_at_ms, &b.event_id)));
    }

    /// Keep the first `keep` of the page's events no wait consumed yet (this page, read for
    /// `page`, ends the journal): when that cuts events off, [`RunDetail::next_events_after`]
    /// becomes the cursor of the last kept one (or the page's own when none is kept) and
    /// [`RunDetail::next_after_seq`] the last position read.
    pub fn keep_unconsumed(&mut self, keep: usize, page: &DetailPage) {
        let mut seen = 0;
        let mut last_kept = None;
        self.events.retain(|event| {
            if event.consumed_by_seq.is_some() {
                return true;
            }
            seen += 1;
            if seen <= keep {
                last_kept = Some(event_cursor(event));
            }
            seen <= keep
        });
        if seen <= keep {
            return;
        }
        self.next_after_seq = self.journal.last().map(|entry| entry.seq).or(page.after_seq);
        self.next_events_after =
            last_kept.or_else(|| page.events_after.as_ref().map(|(ms, id)| event_cursor_at(*ms, id)));
    }

    /// Whether pages follow this one ([`RunDetail::next_after_seq`] or
    /// [`RunDetail::next_events_after`] set).
    pub fn is_cut(&self) -> bool {
        self.next_after_seq.is_some() || self.next_events_after.is_some()
    }

    /// `invalid_argument` when this is a page of the detail that more pages follow, not the
    /// whole of it.
    pub fn ensure_whole(&self) -> Result<()> {
        if !self.is_cut() {
            return Ok(());
        }
        let cut = match (self.next_after_seq, &self.next_events_after) {
            (Some(after), None) => format!("cut after position {after}"),
            (_, Some(cursor)) => format!("cut after the unconsumed event {cursor}"),
            (None, None) => unreachable!("is_cut"),
        };
        Err(Error::invalid(
            codes::INVALID_ARGUMENT,
            format!(
                "the detail of run {:?} is one page, {cut}: add the pages after it \
                 (`tidemark workflow show --server ...` reads them all)",
                self.run.run_id
            ),
        ))
    }

    /// Add the next page of the same run's detail (read with [`DetailPage::after`] this one) to
    /// this one: its journal, attempts and events follow (an event this one held unconsumed and
    /// the page holds, consumed since, is the page's), its run record (the later read) replaces
    /// this one's, and its cursors are the whole's. `invalid_argument` when `page` is of another
    /// run, its journal (when not empty) does not start right after this one's, or it is cut
    /// where this one is (a reader would ask for it again without end).
    pub fn append_page(&mut self, page: RunDetail) -> Result<()> {
        let invalid = |message: String| Error::invalid(codes::INVALID_ARGUMENT, message);
        if page.run.run_id != self.run.run_id {
            return Err(invalid(format!(
                "a page of run {:?} cannot follow one of run {:?}",
                page.run.run_id, self.run.run_id
            )));
        }
        if !self.is_cut() {
            return Err(invalid(format!("the detail of run {:?} is already whole", self.run.run_id)));
        }
        let expected = self.next_after_seq.map_or(0, |after| after + 1);
        let first = page.journal.first().map(|entry| entry.seq);
        // A page with no entry holds unconsumed events that the page before had no room for.
        if first.is_some_and(|first| first != expected) {
            return Err(invalid(format!(
                "the page of run {:?} after position {} starts at position {}",
                self.run.run_id,
                self.next_after_seq.map_or("none".to_string(), |seq| seq.to_string()),
                first.map_or("none".to_string(), |seq| seq.to_string())
            )));
        }
        // A page cut where this one was would be asked for again, without end.
        if page.is_cut()
            && (page.next_after_seq, &page.next_events_after) == (self.next_after_seq, &self.next_events_after)
        {
            return Err(invalid(format!(
                "the page of run {:?} ends where it starts (after position {}, events after {}): it moves \
                 the detail on by nothing",
                self.run.run_id,
                self.next_after_seq.map_or("none".to_string(), |seq| seq.to_string()),
                self.next_events_after.as_deref().unwrap_or("none")
            )));
        }
        let held: std::collections::HashSet<&str> = page.events.iter().map(|event| event.event_id.as_str()).collect();
        self.events.retain(|event| !held.contains(event.event_id.as_str()));
        self.run = page.run;
        self.journal.extend(page.journal);
        self.attempts.extend(page.attempts);
        self.events.extend(page.events);
        self.sort_events();
        self.next_after_seq = page.next_after_seq;
        self.next_events_after = page.next_events_after;
        Ok(())
    }

    /// Check a recorded run before a store imports it (`import_run` of either store, for the
    /// test kit's replay of production journals): its start as a start is checked, journal
    /// positions 0, 1, 2, ... below [`RUN_STEPS_MAX`], identifiers, outputs and payloads within
    /// their limits, attempts and events only of positions the journal holds.
    pub fn validate_import(&self) -> Result<()> {
        let run = &self.run;
        StartRequest::new(&run.run_id, &run.workflow, run.version, run.input.clone()).validate()?;
        self.ensure_whole()?;
        let invalid = |message: String| Error::invalid(codes::INVALID_ARGUMENT, message);
        for (position, entry) in self.journal.iter().enumerate() {
            if entry.seq as usize != position || entry.seq >= RUN_STEPS_MAX {
                return Err(invalid(format!(
                    "the journal of run {:?} must hold positions 0, 1, 2, ... in order (below {RUN_STEPS_MAX}); \
                     entry {position} is at position {}",
                    run.run_id, entry.seq
                )));
            }
            validate_id("step name", &entry.name)?;
            if let Some(output) = &entry.output {
                validate_json_size("a step output", output, STEP_OUTPUT_BYTES_MAX, codes::PAYLOAD_TOO_LARGE)?;
            }
        }
        let positions = self.journal.len();
        for attempt in &self.attempts {
            if attempt.seq as usize >= positions || attempt.attempt == 0 {
                return Err(invalid(format!(
                    "attempt {} at position {} of run {:?} is not of a journaled step (attempts count from 1)",
                    attempt.attempt, attempt.seq, run.run_id
                )));
            }
        }
        for event in &self.events {
            if !is_store_event_id(&event.event_id) {
                validate_id("event_id", &event.event_id)?;
            }
            if !is_child_event(&event.name) {
                validate_id("event name", &event.name)?;
            }
            if event.consumed_by_seq.is_some_and(|seq| seq as usize >= positions) {
                return Err(invalid(format!(
                    "event {:?} of run {:?} is consumed by a position the journal does not hold",
                    event.event_id, run.run_id
                )));
            }
            validate_json_size("an event payload", &event.payload, WORKFLOW_INPUT_BYTES_MAX, codes::PAYLOAD_TOO_LARGE)?;
        }
        Ok(())
    }

    /// The status an imported run starts in: `compensating` when it was compensating (its
    /// replay goes on compensating), else `pending` (the next claim replays its journal).
    pub fn import_status(&self) -> RunStatus {
        if self.run.status == RunStatus::Compensating {
            RunStatus::Compensating
        } else {
            RunStatus::Pending
        }
    }
}

/// A workflow a worker can run, with an optional per-type concurrency limit (across all
/// workers on the database).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkflowVersion {
    /// The workflow's name.
    pub workflow: String,
    /// The version this worker registered.
    pub version: u32,
    /// At most this many runs of the workflow in flight at once, across every worker on the
    /// database (`None`: no limit of its own).
    pub concurrency_max: Option<u32>,
}

/// What a worker asks for when it claims runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRequest {
    /// The claiming worker's id (an identifier), recorded as the lease owner.
    pub worker_id: String,
    /// The workflows and versions the worker can run; runs of others are left alone.
    pub workflows: Vec<WorkflowVersion>,
    /// At most this many runs (the worker's free slots, at most 4,096).
    pub limit: usize,
    /// How long each lease lasts, in ms (100 ms..=1 h); the worker heartbeats every third of it.
    pub lease_ms: i64,
}

impl RunRecord {
    /// The record of the child run `request` that a [`JournalOp::StartChild`] of `parent`
    /// created at `now_ms` and leased to `owner` until `expires_at_ms`, as a store reads it back
    /// (for a store that builds the claimed child without reading its row).
    pub fn started_child(
        request: &StartRequest,
        parent: &str,
        owner: &str,
        expires_at_ms: i64,
        now_ms: i64,
    ) -> RunRecord {
        RunRecord {
            run_id: request.run_id.clone(),
            workflow: request.workflow.clone(),
            version: request.version,
            input: request.input.clone(),
            key: request.key.clone(),
            status: RunStatus::Pending,
            result: None,
            error: None,
            wake_at_ms: request.start_at_ms.unwrap_or(now_ms),
            waiting_for: None,
            cancel_requested: false,
            forked_from: None,
            parent_run_id: Some(parent.to_string()),
            queue: request.queue.as_ref().map(|q| q.queue.clone()),
            priority: request.queue.as_ref().map(|q| q.priority),
            admitted_at_ms: None,
            deadline_ms: request.deadline_ms,
            lease_owner: Some(owner.to_string()),
            lease_expires_at_ms: Some(expires_at_ms),
            recoveries: 0,
            created_at_ms: now_ms,
            updated_at_ms: now_ms,
        }
    }
}

/// A run handed to a worker: its record, journal and unconsumed events, and the lease token
/// that fences every write the worker makes for it.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimedRun {
    /// The run as claimed (status and lease updated).
    pub run: RunRecord,
    /// The token every journal write for this run must carry; a write with an old token is
    /// [`WriteResult::Fenced`].
    pub lease_token: String,
    /// The run's journal so far: replay returns its settled entries without running the steps.
    pub journal: Vec<JournalEntry>,
    /// Events sent to the run that no wait has consumed yet.
    pub events: Vec<RunEvent>,
    /// True when the previous lease holder's lease had expired (a recovery).
    pub recovered: bool,
}

/// What a heartbeat learned about one lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LeaseState {
    /// Extended. `cancel_requested` tells the worker to stop at the next step boundary.
    Held {
        /// An operator asked to cancel the run.
        cancel_requested: bool,
    },
    /// Another worker holds the run, or it was finished by an operator: stop working on it.
    Lost,
}

/// The body of a transactional step: runs inside the journal's transaction on the store's
/// handle `T` (`rusqlite::Connection` for SQLite).
pub type TxBody<T> = Box<dyn FnOnce(&T) -> std::result::Result<Value, StepFailure> + Send>;

/// One write of a worker, fenced by the run's lease token. A batch of them commits in one
/// transaction (group commit); each gets its own [`WriteResult`].
pub struct JournalWrite<T: ?Sized> {
    /// The run the write is for.
    pub run_id: String,
    /// The lease token of the claim the writer holds; the store refuses the write when it no longer
    /// matches.
    pub lease_token: String,
    /// What to write.
    pub op: JournalOp<T>,
}

/// What a [`JournalWrite`] records, in the run's row and its journal.
pub enum JournalOp<T: ?Sized> {
    /// The run has started executing (`pending`/`sleeping`/... -> `running`), or is
    /// compensating.
    SetStatus {
        /// `running`, or `compensating` for a saga rolling back.
        status: RunStatus,
    },
    /// An external step (or compensation) attempt finished. On failure, `retry_at_ms` says when
    /// to try again (`None`, or a non-retryable failure: failed for good). `attempt` is the
    /// entry's recorded `attempts + 1` (1 for a new position); `seq` is the next free position
    /// or the position of this step's unsettled entry. Anything else is a broken invariant and
    /// refuses the whole batch.
    StepAttempt {
        /// The journal position of the step.
        seq: u32,
        /// The step's name (checked against an existing entry at `seq`).
        name: String,
        /// `External` or `Compensation`.
        kind: StepKind,
        /// Which attempt this was, counting from 1.
        attempt: u32,
        /// The step's output, or why it failed.
        result: std::result::Result<Value, StepFailure>,
        /// When to try again after a retryable failure, in ms since the Unix epoch; `None` when out
        /// of attempts.
        retry_at_ms: Option<i64>,
    },
    /// A transactional step attempt: `body` runs in a savepoint of the commit's transaction. On
    /// success its writes and the journal entry commit together; on failure its writes roll back
    /// and the attempt is recorded like an external one. The store checks the output's size
    /// (`STEP_OUTPUT_BYTES_MAX` of JSON): a larger one fails the step for good.
    TxStep {
        /// The journal position of the step.
        seq: u32,
        /// The step's name (checked against an existing entry at `seq`).
        name: String,
        /// `Transactional` or `Compensation`.
        kind: StepKind,
        /// Which attempt this is, counting from 1.
        attempt: u32,
        /// The step's writes, run in the commit's transaction.
        body: TxBody<T>,
        /// When to try again if the body fails with a retryable failure, in ms since the Unix
        /// epoch; `None` when this is the last attempt.
        retry_at_ms: Option<i64>,
    },
    /// Start a child run and journal the parent's wait for it (kind `Child`, `waiting`, its
    /// event name [`child_event`]`(seq)`), in one transaction: a replay finds the entry and never
    /// starts the child twice. When the child ends (completed, compensated, failed or cancelled;
    /// not parked, which waits for an operator), the store sends the parent that event with
    /// `{"run_id", "status", "result", "error"}`, in the child's last transaction. Answered
    /// [`WriteResult::TxResult`]: `Ok(null)` when the child was started (or already existed
    /// with the same workflow and input), a permanent failure (recorded as the entry's failure)
    /// when the child's run id is taken by another run. With `claim`, a child this write created
    /// is also leased to that worker in the same transaction and answered
    /// [`WriteResult::Claimed`] (no claim of its own, no poll wait): the writer runs it at once.
    StartChild {
        /// The journal position of the child step.
        seq: u32,
        /// The step's name (the child's workflow name).
        name: String,
        /// The child's start (its run id is [`child_run_id`]`(parent, seq)`), boxed: a
        /// journal write stays small.
        request: Box<StartRequest>,
        /// When the parent's wait is next looked at (a child has no deadline; the parent waits
        /// again when it passes).
        wake_at_ms: i64,
        /// Lease the child to this worker in the same transaction, when the write created it
        /// (not when it adopted a run that existed already).
        claim: Option<ChildLease>,
    },
    /// The child started at `seq` ended with `end` (its end event's payload,
    /// `{"run_id", "status", "result", "error"}`), as its parent learned on the worker they both
    /// ran on while the parent kept its lease: consume the end event ([`child_event`]`(seq)`)
    /// and settle the entry with it, as [`JournalOp::TimerFinished`] does for an event a claim
    /// found. Answered [`WriteResult::Done`]. When the event is not there, or carries anything
    /// but `end`, the parent went on with a value the store does not hold: nothing is written,
    /// the run's lease is released and the write is [`WriteResult::Fenced`] (and so are the
    /// run's later writes of the batch), so that the run replays from what the store holds.
    ChildEnded {
        /// The journal position of the child step (kind `Child`, `waiting`).
        seq: u32,
        /// The end as the parent saw it (at most 256 KiB of JSON).
        end: Value,
    },
    /// Publish `value` under `key` (kind `Publish`, step name = the key): the run's published
    /// value of that key is replaced in the same transaction (readable from outside while the
    /// run exists).
    Publish {
        /// The journal position.
        seq: u32,
        /// The key (an identifier).
        key: String,
        /// The value (at most 256 KiB of JSON).
        value: Value,
    },
    /// Send `payload` to run `to` as an event named `topic` (kind `Send`, step name = the
    /// topic), in the same transaction as the journal entry: exactly once. The event's id is
    /// [`message_event_id`]`(sender, seq)`. Answered [`WriteResult::TxResult`]: `Ok` with
    /// `{"to", "event_id"}`, or a permanent failure (recorded as the entry's) when run `to` does not
    /// exist or has ended.
    Send {
        /// The journal position.
        seq: u32,
        /// The receiving run.
        to: String,
        /// The event name the receiver waits for (`ctx.recv(topic)`).
        topic: String,
        /// The message (at most 256 KiB of JSON).
        payload: Value,
    },
    /// Journal a timer (`Sleep`) or a wait (`Wait`) that has not fired yet.
    TimerStarted {
        /// The journal position of the timer or wait.
        seq: u32,
        /// The step's name.
        name: String,
        /// `Sleep` or `Wait`.
        kind: StepKind,
        /// When the timer fires or the wait times out, in ms since the Unix epoch.
        wake_at_ms: i64,
        /// The event name a wait waits for (`None` for a timer).
        event_name: Option<String>,
    },
    /// A timer fired, or a wait ended: with the consumed event, or by timeout (`event_id` None);
    /// or a child step (`Child`) ended with its child's end event.
    TimerFinished {
        /// The journal position of the timer or wait.
        seq: u32,
        /// The event the wait consumed (marked consumed by `seq`); `None` for a timer or a timeout.
        event_id: Option<String>,
        /// The entry's recorded output (the engine records `null` for a timer,
        /// `{"event_id", "payload"}` for a consumed event and `{"timed_out": true}` for a
        /// timeout).
        output: Value,
    },
    /// Release the lease and wait in `status` until `wake_at_ms` (or an event for `waiting_for`).
    /// When an unconsumed event named `waiting_for` is already there, or a cancel was requested,
    /// the run stays due now (no lost wake-up).
    Suspend {
        /// The status to wait in.
        status: SuspendStatus,
        /// When the run is due again, in ms since the Unix epoch.
        wake_at_ms: i64,
        /// The event name that wakes a `waiting` run earlier.
        waiting_for: Option<String>,
    },
    /// Release the lease and finish the run.
    Finish {
        /// How the run ended.
        status: FinishStatus,
        /// The workflow's output (for `completed`).
        result: Option<Value>,
        /// Why the run failed, was parked or cancelled.
        error: Option<String>,
    },
    /// Finish a child run whose parent waits for it in memory on the same worker, holding the
    /// lease `parent_lease_token` (the child was leased there as it started): as
    /// [`JournalOp::Finish`] with a status its parent learns of (completed, compensated, failed
    /// or cancelled), except that while the parent still holds that lease, the child's end
    /// (`{"run_id", "status", "result", "error"}`) settles the parent's `child` entry in the same
    /// transaction instead of being sent as the end event, so the parent goes on with no
    /// [`JournalOp::ChildEnded`] of its own. Answered [`WriteResult::ParentSettled`] then, and
    /// [`WriteResult::Done`] when the parent no longer holds that lease (it was told by the end
    /// event, as after `Finish`).
    FinishChild {
        /// How the run ended (not parked, not continued).
        status: FinishStatus,
        /// The workflow's output (for `completed`).
        result: Option<Value>,
        /// Why the run failed or was cancelled.
        error: Option<String>,
        /// The parent's lease token as the parent waiting in memory holds it.
        parent_lease_token: String,
    },
    /// End the run `continued` and start its continuation `request` (run id
    /// [`continuation_run_id`]`(run)`) in the same transaction: the continuation takes over the
    /// run's parent (its end is what the parent learns), and the run's children still running
    /// are cancelled as at any end. The run's `result` records `{"continued_as": <run id>}`.
    /// Answered [`WriteResult::TxResult`]: `Ok` with that object, or a permanent failure (nothing
    /// written) when the continuation's id is taken by another run.
    ContinueAsNew {
        /// The continuation's start (its input is the new input), boxed: a journal write stays
        /// small.
        request: Box<StartRequest>,
    },
    /// Release the lease without changing the status (worker shutting down).
    Release,
}

/// The result of one journal write.
#[derive(Debug, Clone, PartialEq)]
pub enum WriteResult {
    /// The write was applied and commits with its batch.
    Done,
    /// A transactional step's result (its body's output or failure).
    TxResult(std::result::Result<Value, StepFailure>),
    /// The lease token no longer matches: another worker owns the run, or an operator changed
    /// it. Nothing was written; the worker must drop the run.
    Fenced,
    /// A [`JournalOp::StartChild`] with a `claim` started its child and leased it to the
    /// claiming worker: the child as claimed (no journal, no events), boxed.
    Claimed(Box<ClaimedRun>),
    /// A [`JournalOp::FinishChild`] finished the child and settled its parent's entry with the
    /// child's end (no end event was sent).
    ParentSettled,
}

/// Who a child is leased to in the transaction that starts it ([`JournalOp::StartChild`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildLease {
    /// The claiming worker's id (an identifier), recorded as the lease owner.
    pub worker_id: String,
    /// How long the lease lasts, in ms (100 ms..=1 h).
    pub lease_ms: i64,
}

/// A filter for listing runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunFilter {
    /// Only runs in this status.
    pub status: Option<RunStatus>,
    /// Only runs of this workflow.
    pub workflow: Option<String>,
    /// Runs created strictly after this.
    pub created_after_ms: Option<i64>,
    /// Runs created strictly before this.
    pub created_before_ms: Option<i64>,
    /// Keyset pagination: runs created after this (created_at_ms, run_id).
    pub after: Option<(i64, String)>,
}

impl RunFilter {
    /// The cursor of the page after `runs` when the page was full (`<created_at_ms>:<run_id>`).
    pub fn next_page(runs: &[RunRecord], limit: usize) -> Option<String> {
        match runs.last() {
            Some(last) if runs.len() == limit => Some(format!("{}:{}", last.created_at_ms, last.run_id)),
            _ => None,
        }
    }

    /// Parse a cursor made by [`RunFilter::next_page`]: exactly the strings
    /// [`PAGE_CURSOR_PATTERN`] matches (`invalid_argument` otherwise, or `invalid_id` for the run
    /// id).
    pub fn parse_page(text: &str) -> Result<(i64, String)> {
        parse_cursor(text, "a run listing (<created_at_ms>:<run_id>)", "run_id")
    }
}

/// What one batch of [`WorkflowStore::purge`] deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
pub struct PurgeReport {
    /// Finished runs deleted.
    pub runs_deleted: u64,
    /// Journal entries deleted with them.
    pub journal_deleted: u64,
    /// True when the batch bound stopped the purge before it was done.
    pub more: bool,
}

impl crate::store::BatchReport for PurgeReport {
    fn more(&self) -> bool {
        self.more
    }
    fn absorb(&mut self, batch: Self) {
        self.runs_deleted += batch.runs_deleted;
        self.journal_deleted += batch.journal_deleted;
        self.more = batch.more;
    }
}

/// Runs that no registered worker can execute (unknown workflow or version).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UnclaimableRuns {
    /// The workflow name the runs are pinned to.
    pub workflow: String,
    /// The version the runs are pinned to.
    pub version: u32,
    /// Active runs of that workflow and version.
    pub runs: u64,
}

/// The workflow side of a store. Every method is one transaction.
pub trait WorkflowStore {
    /// The transactional handle given to transactional steps.
    type Target: ?Sized;

    /// Called by the writer before each round of work: a store on a network database opens a
    /// new connection here when the server closed the old one (a restart, a failover, an
    /// administrator's `pg_terminate_backend`), so that a worker outlives the outage instead of
    /// failing every call from then on. A failed reconnect is an `Err` (the round's calls then
    /// fail as they would have; the next round tries again). Default: nothing to do (a file
    /// cannot be disconnected).
    fn reconnect_if_closed(&mut self) -> Result<()> {
        Ok(())
    }

    /// Start runs (idempotent per run id), in one transaction.
    fn start_runs(&mut self, requests: &[StartRequest], now_ms: i64) -> Result<Vec<StartOutcome>>;
    /// Lease up to `limit` due runs of the given workflows and versions, honouring per-type
    /// limits and per-key serialization, oldest due first.
    fn claim(&mut self, request: &ClaimRequest, now_ms: i64) -> Result<Vec<ClaimedRun>>;
    /// [`Self::start_runs`], then [`Self::claim`] (a worker starting runs it will execute). A
    /// store may do both in one transaction (one commit); this default does them one after the
    /// other, so the claim's own error comes second, after the starts committed.
    fn start_and_claim(
        &mut self,
        requests: &[StartRequest],
        claim: &ClaimRequest,
        now_ms: i64,
    ) -> Result<(Vec<StartOutcome>, Result<Vec<ClaimedRun>>)> {
        let outcomes = self.start_runs(requests, now_ms)?;
        Ok((outcomes, self.claim(claim, now_ms)))
    }
    /// Extend leases held by `worker_id`; report each as held (with cancel requests) or lost.
    fn heartbeat(
        &mut self,
        worker_id: &str,
        leases: &[(String, String)],
        lease_ms: i64,
        now_ms: i64,
    ) -> Result<Vec<LeaseState>>;
    /// Apply a batch of journal writes in one transaction (group commit). Each write is fenced
    /// by its lease token alone (a write whose token is still the run's applies even if the lease
    /// expired, as long as nobody re-claimed the run); a fenced write changes nothing and the
    /// others go on. Bad input in any write, or a write that breaks a journal invariant, refuses
    /// the whole batch.
    fn commit(&mut self, writes: Vec<JournalWrite<Self::Target>>, now_ms: i64) -> Result<Vec<WriteResult>>;
    /// Deliver an event to a run (idempotent by `event_id`); wakes the run if it waits for
    /// `name`. Returns false when the event was already there.
    fn send_event(&mut self, run_id: &str, event_id: &str, name: &str, payload: &Value, now_ms: i64) -> Result<bool>;
    /// The run with its journal, attempts and events, read in one read transaction, or `None` for
    /// an unknown run id.
    fn run(&self, run_id: &str) -> Result<Option<RunDetail>> {
        let limit = RUN_STEPS_MAX as usize;
        let Some(mut detail) = self.run_page(run_id, &DetailPage::first(limit))? else {
            return Ok(None);
        };
        // More than RUN_STEPS_MAX unconsumed events: read on (the run's record is the last read).
        while let Some(page) = DetailPage::after(&detail, limit)? {
            match self.run_page(run_id, &page)? {
                Some(next) => detail.append_page(next)?,
                None => return Ok(None),
            }
        }
        Ok(Some(detail))
    }
    /// One page of [`WorkflowStore::run`], read in one read transaction: the run's record, at most
    /// `page.limit` journal entries after position `page.after_seq` (from the start when `None`),
    /// the last [`DETAIL_ATTEMPTS_MAX`] attempts of each of their positions and the events they
    /// consumed, and, on the page that ends the journal, at most `page.limit` events no wait
    /// consumed yet after `page.events_after` ([`RunDetail::add_unconsumed`]).
    /// [`RunDetail::next_after_seq`] is set when entries follow, and with
    /// [`RunDetail::next_events_after`] when unconsumed events do. Arguments as
    /// [`DetailPage::validate`] checks them (else `limit_exceeded`, `invalid_id`); `None` for an
    /// unknown run id.
    fn run_page(&self, run_id: &str, page: &DetailPage) -> Result<Option<RunDetail>>;
    /// The value run `run_id` last published under `key` (`ctx.set_event`), or `None`.
    fn published(&self, run_id: &str, key: &str) -> Result<Option<PublishedValue>>;
    /// Runs that match `filter`, by (creation time, run id), at most `limit` (1..=1,000, else
    /// `limit_exceeded`); page on with [`RunFilter::next_page`].
    fn list_runs(&self, filter: &RunFilter, limit: usize) -> Result<Vec<RunRecord>>;
    /// Request cancellation: sets `cancel_requested` and makes the run due now. The runtime
    /// acts on it at the run's next step boundary (or at claim): a saga compensates its completed
    /// steps first, then the run ends `cancelled`. A terminal run cannot be cancelled.
    fn cancel(&mut self, run_id: &str, reason: &str, now_ms: i64) -> Result<RunRecord>;
    /// Retry a failed or parked run from its failed step (attempts start over): the last failed
    /// journal entry becomes unsettled again (a saga parked on a compensation retries that
    /// compensation); entries after it stay.
    fn retry(&mut self, run_id: &str, reason: &str, now_ms: i64) -> Result<RunRecord>;
    /// Start `new_run_id` as a copy of `run_id` whose journal keeps the entries before `from_seq`.
    fn fork(&mut self, run_id: &str, from_seq: u32, new_run_id: &str, now_ms: i64) -> Result<RunRecord>;
    /// Mark step `seq` (failed, retrying or waiting) as skipped with `output`, and make the run
    /// runnable again.
    fn skip_step(&mut self, run_id: &str, seq: u32, output: &Value, reason: &str, now_ms: i64) -> Result<RunRecord>;
    /// Give up on a run: it ends `cancelled` with the reason recorded; nothing is compensated.
    fn abandon(&mut self, run_id: &str, reason: &str, now_ms: i64) -> Result<RunRecord>;
    /// Delete runs finished before `finished_before_ms` with their journals, at most
    /// `batch_rows` runs per call; idempotency receipts stay.
    fn purge(&mut self, finished_before_ms: i64, batch_rows: usize, now_ms: i64) -> Result<PurgeReport>;
    /// Runs of workflows or versions not in `known`, which this worker leaves alone.
    fn unclaimable(&self, known: &[WorkflowVersion]) -> Result<Vec<UnclaimableRuns>>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exponential_default_maps_the_seed_schedule_shape() {
        let p = RetryPolicy { jitter: false, ..RetryPolicy::default() };
        let delays: Vec<i64> = (1..=5).map(|n| p.delay_ms(n, 0.0)).collect();
        assert_eq!(delays, [1_000, 5_000, 25_000, 125_000, 625_000]);
        assert_eq!(p.delay_ms(30, 0.0), 3_600_000);
        let seed = RetryPolicy::seed_schedule();
        let delays: Vec<i64> = (1..=7).map(|n| seed.delay_ms(n, 0.9)).collect();
        assert_eq!(delays, [1_000, 5_000, 30_000, 300_000, 3_600_000, 3_600_000, 3_600_000]);
    }

    #[test]
    fn jitter_stays_within_half_and_full() {
        let p = RetryPolicy::default();
        for unit in [0.0, 0.3, 0.99] {
            let d = p.delay_ms(2, unit);
            assert!((2_500..=5_000).contains(&d), "{d}");
        }
    }

    #[test]
    fn child_ids_are_derived_identifiers_and_child_events_cannot_be_sent() {
        assert_eq!(child_run_id("order-1", 3), "order-1.3");
        let long = "p".repeat(100);
        let derived = child_run_id(&long, 7);
        assert!(derived.starts_with("child-") && derived.ends_with(".7"), "{derived}");
        validate_id("run_id", &derived).unwrap();
        assert_ne!(child_run_id(&long, 7), child_run_id(&"q".repeat(100), 7));
        assert_eq!(child_event(4), "child/4");
        assert!(is_child_event("child/4") && !is_child_event("child/") && !is_child_event("child/x"));
        // Nobody can send an event of that name: it is not an identifier.
        assert!(validate_id("event name", &child_event(4)).is_err());
        let message = message_event_id("sender", 3);
        assert!(is_store_event_id(&message) && is_store_event_id("child/4"), "{message}");
        assert!(validate_id("event_id", &message).is_err());
        assert!(!is_store_event_id("msg/1/xyz") && !is_store_event_id("order-1"));
    }

    #[test]
    fn continuations_are_derived_identifiers_apart_from_children() {
        assert_eq!(continuation_run_id("order-1"), "order-1.c1");
        assert_eq!(continuation_run_id("order-1.c1"), "order-1.c2");
        assert_eq!(continuation_run_id("order-1.c9"), "order-1.c10");
        assert_eq!(continuation_run_id("order-1.3"), "order-1.3.c1", "a child continues under its own id");
        assert_eq!(continuation_run_id(".c"), ".c.c1");
        let long = "p".repeat(99);
        let next = continuation_run_id(&long);
        assert!(next.starts_with("cont-") && next.ends_with(".c1"), "{next}");
        validate_id("run_id", &next).unwrap();
        assert_eq!(continuation_run_id(&next), next.replace(".c1", ".c2"));
        assert_ne!(continuation_run_id(&next), child_run_id(&long, 1));
    }

    #[test]
    fn start_requests_are_validated() {
        let mut r = StartRequest {
            run_id: "order-1".into(),
            workflow: "order_saga".into(),
            version: 1,
            input: serde_json::json!({}),
            key: None,
            start_at_ms: None,
            queue: None,
            deadline_ms: None,
        };
        r.validate().unwrap();
        let queued = r.clone().in_queue("emails", 0, None);
        queued.validate().unwrap();
        let both = StartRequest { key: Some("k".into()), ..queued };
        assert_eq!(both.validate().unwrap_err().code(), codes::INVALID_ARGUMENT, "a queue and a key");
        r.run_id = "bad id".into();
        assert_eq!(r.validate().unwrap_err().code(), codes::INVALID_ID);
    }

    #[test]
    fn page_cursors_are_what_next_page_writes_and_nothing_else() {
        for (text, expected) in [
            ("1700000000000:order-1", (1_700_000_000_000, "order-1")),
            ("0:a:b", (0, "a:b")),
            ("-5:r", (-5, "r")),
            ("000000000000000007:r", (7, "r")),
            ("999999999999999999:r", (999_999_999_999_999_999, "r")),
        ] {
            assert_eq!(RunFilter::parse_page(text).unwrap(), (expected.0, expected.1.to_string()), "{text}");
        }
        for text in ["", ":", "1", ":r", "+1:r", "-:r", "1 :r", "1.0:r", "1e3:r", "1000000000000000000:r", "x:r"] {
            assert_eq!(RunFilter::parse_page(text).unwrap_err().code(), codes::INVALID_ARGUMENT, "{text:?}");
        }
        for text in ["1:bad id", "1:"] {
            assert_eq!(RunFilter::parse_page(text).unwrap_err().code(), codes::INVALID_ID, "{text:?}");
        }
    }

    #[test]
    fn detail_pages_follow_only_cursors_that_move_on() {
        let event = |id: &str, ms: i64| RunEvent {
            event_id: id.into(),
            name: "paid".into(),
            payload: serde_json::json!({}),
            received_at_ms: ms,
            consumed_by_seq: None,
        };
        let record = RunRecord::started_child(&StartRequest::new("r", "w", 1, serde_json::json!({})), "p", "w1", 9, 5);
        let page = |events: Vec<RunEvent>, next: Option<&str>| RunDetail {
            run: record.clone(),
            journal: Vec::new(),
            attempts: Vec::new(),
            events,
            next_after_seq: None,
            next_events_after: next.map(str::to_string),
        };
        let mut first = page(vec![event("e1", 7)], Some("7:e1"));
        let next = DetailPage::after(&first, 1).unwrap().unwrap();
        assert_eq!(next.events_after, Some((7, "e1".to_string())));
        // A page that leaves the cursors where they were is refused, and nothing is added.
        let again = first.append_page(page(vec![], Some("7:e1"))).unwrap_err();
        assert_eq!(again.code(), codes::INVALID_ARGUMENT, "{again}");
        assert_eq!(first.events.len(), 1);
        first.append_page(page(vec![event("e2", 8)], Some("8:e2"))).unwrap();
        first.append_page(page(vec![event("e3", 9)], None)).unwrap();
        assert_eq!(first.events.iter().map(|e| e.event_id.as_str()).collect::<Vec<_>>(), ["e1", "e2", "e3"]);
        assert_eq!(DetailPage::after(&first, 1).unwrap(), None);
        // A cursor that is not one `event_cursor` wrote is an error, never the first page again.
        let bad = page(vec![], Some("7"));
        assert_eq!(DetailPage::after(&bad, 1).unwrap_err().code(), codes::INVALID_ARGUMENT);
        // A page cut with no event kept goes on from its own cursor.
        let mut kept = page(vec![event("e4", 10)], None);
        let from = DetailPage { after_seq: None, events_after: Some((9, "e3".into())), limit: 1 };
        kept.keep_unconsumed(0, &from);
        assert_eq!(kept.next_events_after.as_deref(), Some("9:e3"));
    }

    #[test]
    fn the_latest_start_moves_once_a_day() {
        const DAY: i64 = 86_400_000;
        let midnight = 1_767_225_600_000; // 2026-01-01T00:00:00Z
        for now in [midnight, midnight + 1, midnight + DAY / 2, midnight + DAY - 1] {
            let latest = start_at_ms_max(now);
            assert_eq!(latest, midnight + 366 * DAY - 1, "{now}");
            assert!(latest - now >= 365 * DAY && latest - now < TIMER_MS_MAX, "{now}");
        }
        assert_eq!(start_at_ms_max(midnight + DAY), midnight + 367 * DAY - 1);
        assert_eq!(start_at_ms_max(i64::MAX), i64::MAX);
        start_at_ms_max(i64::MIN);
        let start = |start_at_ms| {
            let request = StartRequest {
                start_at_ms: Some(start_at_ms),
                ..StartRequest::new("r", "w", 1, serde_json::json!({}))
            };
            validate_starts(&[request], midnight + 1234)
        };
        start(midnight + 366 * DAY - 1).unwrap();
        start(i64::MIN).unwrap();
        let error = start(midnight + 366 * DAY).unwrap_err();
        assert_eq!(error.code(), codes::INVALID_ARGUMENT, "{error}");
    }

    #[test]
    fn terminal_and_claimable_partition_the_statuses() {
        for s in RunStatus::ALL {
            assert_ne!(s.is_terminal(), s.is_claimable(), "{s:?}");
            assert_eq!(RunStatus::parse(s.as_str()), Some(s));
        }
    }
}
