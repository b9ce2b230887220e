//! The context a workflow function runs in: steps, timers, events, replay.

use std::collections::BTreeMap;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};
use tidemark_core::id::validate_id;
use tidemark_core::workflow::{
    child_event, child_run_id, continuation_run_id, patch_step_name, validate_write, workflow_codes, ClaimedRun,
    FinishStatus, JournalEntry, JournalOp, JournalWrite, RetryPolicy, RunEvent, RunRecord, RunStatus, StartRequest,
    StepFailure, StepKind, StepStatus, SuspendStatus, TxBody, WorkflowStore, WriteResult, ERROR_BYTES_MAX,
    RUN_STEPS_MAX, STEP_OUTPUT_BYTES_MAX, TIMER_MS_MAX,
};
use tidemark_core::Error;

use super::observer::{StepAttempt, StepAttemptEnd, WorkerObserver};
use super::registry::REPLAY_END;
use super::worker::{ChildLeft, LocalChildren};
use super::{Continuation, WorkflowError, Workflows, Writer};

/// The step name of [`WorkflowContext::sleep`].
pub const SLEEP_STEP: &str = "sleep";

/// How long a parent waits for a child before it looks again (a child has no deadline of its own:
/// the parent waits again), in ms: one day.
pub const CHILD_RECHECK_MS: i64 = 24 * 60 * 60 * 1000;

/// The context of one run, handed to the workflow function. Cheap to clone; every clone is the
/// same run.
///
/// Every call takes the next journal position `seq` (0, 1, 2, ... in call order). A journaled,
/// settled position returns its recorded result without running; a journaled position whose name
/// or kind differs from the call parks the run (non-determinism).
pub struct WorkflowContext<S: WorkflowStore> {
    inner: Arc<RunShared<S>>,
}

impl<S: WorkflowStore> Clone for WorkflowContext<S> {
    fn clone(&self) -> Self {
        WorkflowContext { inner: self.inner.clone() }
    }
}

struct RunShared<S: WorkflowStore> {
    writer: Writer<S>,
    run_id: String,
    workflow: String,
    lease_token: String,
    retry: RetryPolicy,
    cancel: Arc<AtomicBool>,
    /// The reason an operator gave with the cancel request, when the claim saw it.
    cancel_reason: Option<String>,
    state: Mutex<RunState<S::Target>>,
    observer: Option<Arc<dyn WorkerObserver>>,
    /// The worker's registry: children start pinned to their workflow's latest version here.
    workflows: Arc<Workflows<S>>,
    /// When the run is cancelled if it has not ended (ms since the Unix epoch).
    deadline_ms: Option<i64>,
    /// What a continuation keeps of the run: its key, and its queue with its priority.
    key: Option<String>,
    queue: Option<(String, i32)>,
    /// Told when this run makes another due now (a child started, a message sent), so that the
    /// worker claims it without waiting for its poll.
    due: Arc<tokio::sync::Notify>,
    /// Where this run's children run on its worker, leased to it as they start (`None`: they
    /// are claimed as any run is).
    children: Option<Arc<LocalChildren>>,
}

struct RunState<T: ?Sized> {
    /// Writes not sent yet (a status change to `running` or `compensating`, an external step's
    /// attempt): they go with the run's next write, in the same batch and transaction (no commit
    /// or round trip of their own), and are sent (and awaited) before an external step runs.
    pending: Vec<JournalOp<T>>,
    next_seq: u32,
    journal: BTreeMap<u32, JournalEntry>,
    /// Events delivered to the run and not consumed yet (oldest first).
    events: Vec<RunEvent>,
    status: RunStatus,
    suspension: Option<Suspension>,
    parked: Option<String>,
    lost: bool,
    store_error: Option<Error>,
    /// The run continues as this new run (`continue_as_new`): written when the function returns.
    continuation: Option<StartRequest>,
    /// A write this run asked for is bad input a store would refuse (a message to a run id that
    /// is not one, a value over its limit): nothing of it was sent, and the run fails with this
    /// (the code first) rather than have the store refuse the group commit it would share with
    /// other runs, again at every replay.
    refused: Option<String>,
    /// The run's end as its parent's end event carries it, once a finish that tells the parent
    /// was written.
    ended: Option<Value>,
    /// That finish settled the entry of the parent waiting for it in memory (no end event).
    settled_parent: bool,
}

#[derive(Debug, Clone)]
struct Suspension {
    status: SuspendStatus,
    wake_at_ms: i64,
    waiting_for: Option<String>,
}

impl<T: ?Sized> RunState<T> {
    /// Refuse further steps once the run is suspended, parked, fenced or broken.
    fn usable(&self) -> Result<(), WorkflowError> {
        if self.lost {
            return Err(WorkflowError::LeaseLost);
        }
        if let Some(message) = &self.parked {
            return Err(WorkflowError::Parked(message.clone()));
        }
        if let Some(error) = &self.store_error {
            return Err(WorkflowError::Store(error.clone()));
        }
        if let Some(message) = &self.refused {
            return Err(WorkflowError::Failed(message.clone()));
        }
        if self.suspension.is_some() {
            return Err(WorkflowError::suspended());
        }
        if self.continuation.is_some() {
            return Err(WorkflowError::ContinuedAsNew(Continuation::new()));
        }
        Ok(())
    }
}

/// How one execution of a run ended (what the worker wrote for it).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum RunOutcome {
    Finished(FinishStatus),
    Suspended(SuspendStatus),
    /// The lease was released without a status change (a store error).
    Released,
    /// Fenced: the run belongs to someone else now.
    Lost,
    /// The final write failed.
    Error(String),
}

/// What a run shares with the worker loop that runs it.
pub(crate) struct WorkerLinks {
    /// The loop's "due now" nudge (see [`RunShared::due`]).
    pub(crate) due: Arc<tokio::sync::Notify>,
    /// Where the run's children run on the same worker (see [`RunShared::children`]).
    pub(crate) children: Option<Arc<LocalChildren>>,
}

enum Slot {
    New(u32),
    Journaled(u32, JournalEntry),
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

fn duration_ms(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// A step's value as the journal keeps it, or why it cannot be kept.
fn to_output<T: Serialize>(value: &T) -> Result<Value, StepFailure> {
    let value = serde_json::to_value(value)
        .map_err(|e| StepFailure::permanent(format!("the step output does not serialise: {e}")))?;
    let size = serde_json::to_vec(&value).map(|v| v.len()).unwrap_or(usize::MAX);
    if size > STEP_OUTPUT_BYTES_MAX {
        return Err(StepFailure::permanent(format!(
            "the step output is {size} bytes of JSON, limit is {STEP_OUTPUT_BYTES_MAX}"
        )));
    }
    Ok(value)
}

impl<S> WorkflowContext<S>
where
    S: WorkflowStore + 'static,
    S::Target: 'static,
{
    pub(crate) fn new(
        writer: Writer<S>,
        claimed: &ClaimedRun,
        retry: RetryPolicy,
        cancel: Arc<AtomicBool>,
        observer: Option<Arc<dyn WorkerObserver>>,
        workflows: Arc<Workflows<S>>,
        worker: WorkerLinks,
    ) -> Self {
        let WorkerLinks { due, children } = worker;
        let mut events = claimed.events.iter().filter(|e| e.consumed_by_seq.is_none()).cloned().collect::<Vec<_>>();
        events.sort_by_key(|e| e.received_at_ms);
        let state = RunState {
            pending: Vec::new(),
            next_seq: 0,
            journal: claimed.journal.iter().map(|e| (e.seq, e.clone())).collect(),
            events,
            status: claimed.run.status,
            suspension: None,
            parked: None,
            lost: false,
            store_error: None,
            continuation: None,
            refused: None,
            ended: None,
            settled_parent: false,
        };
        let RunRecord { deadline_ms, key, queue, priority, .. } = &claimed.run;
        WorkflowContext {
            inner: Arc::new(RunShared {
                writer,
                run_id: claimed.run.run_id.clone(),
                workflow: claimed.run.workflow.clone(),
                lease_token: claimed.lease_token.clone(),
                retry,
                cancel,
                cancel_reason: claimed.run.error.clone().filter(|_| claimed.run.cancel_requested),
                state: Mutex::new(state),
                observer,
                workflows,
                deadline_ms: *deadline_ms,
                key: key.clone(),
                queue: queue.clone().map(|q| (q, priority.unwrap_or(0))),
                due,
                children,
            }),
        }
    }

    /// The run's id (caller-chosen at start).
    pub fn run_id(&self) -> &str {
        &self.inner.run_id
    }

    /// Has cancellation been requested, or has the run's deadline passed? (Steps observe it by
    /// themselves; this is for workflows that want to look.)
    pub fn cancel_requested(&self) -> bool {
        self.inner.cancel.load(Ordering::SeqCst) || self.deadline_passed()
    }

    /// The run's deadline (ms since the Unix epoch), if it was started with one.
    pub fn deadline_ms(&self) -> Option<i64> {
        self.inner.deadline_ms
    }

    fn deadline_passed(&self) -> bool {
        self.inner.deadline_ms.is_some_and(|deadline| self.now_ms() >= deadline)
    }

    /// End this run and continue as a new run of the same workflow (its latest registered
    /// version) with `input`, so that a run that loops for ever keeps a short journal: the new
    /// run's id is [`continuation_run_id`] of this one, it keeps this run's key, queue (and
    /// priority), deadline and parent, and is started in the same transaction that ends this run
    /// `continued` (nothing lost, never two). Return the error this gives (with `?` or as it is);
    /// every step called after it returns the same error without running. A handle's `result`
    /// follows the chain to its last run. An input the workflow refuses fails this run with that
    /// error's code; a cancel request (or a passed deadline) cancels it instead.
    pub fn continue_as_new<I: Serialize>(&self, input: &I) -> WorkflowError {
        if self.cancel_requested() {
            return WorkflowError::Cancelled;
        }
        let input = match serde_json::to_value(input) {
            Ok(input) => input,
            Err(e) => return WorkflowError::Failed(format!("the input to continue with does not serialise: {e}")),
        };
        let run_id = continuation_run_id(&self.inner.run_id);
        let mut request = match self.inner.workflows.start_request(&run_id, &self.inner.workflow, input) {
            Ok(request) => request,
            Err(e) => return WorkflowError::Failed(format!("{}: {}", e.code(), e)),
        };
        request.key = self.inner.key.clone();
        request.queue = self.inner.queue.as_ref().map(|(queue, priority)| tidemark_core::queue::Enqueue {
            queue: queue.clone(),
            priority: *priority,
            dedup_id: None,
        });
        request.deadline_ms = self.inner.deadline_ms;
        let mut state = self.lock();
        if let Err(error) = state.usable() {
            return error;
        }
        state.continuation = Some(request);
        WorkflowError::ContinuedAsNew(Continuation::new())
    }

    /// A patch point: `true` when this run takes the code after patch `patch_id`, `false` when
    /// its journal was written by code from before it. Roll a fix out to runs in flight without
    /// parking them:
    /// `if ctx.patched("fee-v2")? { new steps } else { old steps }`. A run that reaches the patch
    /// point on new code journals a marker (kind `value`, step name `patch:<id>`, no commit of
    /// its own) and takes the new branch, on every replay too; a run whose journal holds another
    /// step at that position (it went past the point on old code) takes the old branch, and the
    /// marker is not written. Once no run from before the patch is left, keep only the new branch
    /// and call [`Self::deprecate_patch`] in its place (runs that journaled the marker replay).
    pub fn patched(&self, patch_id: &str) -> Result<bool, WorkflowError> {
        self.patch_point(patch_id, true)
    }

    /// The patch point of a patch whose old branch is gone ([`Self::patched`]): consumes the
    /// marker when the journal has it at this position, and writes nothing otherwise.
    pub fn deprecate_patch(&self, patch_id: &str) -> Result<(), WorkflowError> {
        self.patch_point(patch_id, false).map(drop)
    }

    fn patch_point(&self, patch_id: &str, record: bool) -> Result<bool, WorkflowError> {
        let name = patch_step_name(patch_id);
        validate_id("patch id", &name).map_err(|e| WorkflowError::Failed(e.to_string()))?;
        let mut state = self.lock();
        state.usable()?;
        let seq = state.next_seq;
        match state.journal.get(&seq) {
            Some(entry) if entry.name == name && entry.kind == StepKind::Value => {
                state.next_seq += 1;
                Ok(true)
            }
            // Journaled by code from before the patch: the old branch.
            Some(_) => Ok(false),
            None if !record => Ok(true),
            None if self.inner.workflows.replays_only() => Err(replay_end(&mut state, seq, StepKind::Value, &name)),
            None => {
                if seq >= RUN_STEPS_MAX {
                    return Err(journal_full());
                }
                state.next_seq += 1;
                state.pending.push(JournalOp::StepAttempt {
                    seq,
                    name,
                    kind: StepKind::Value,
                    attempt: 1,
                    result: Ok(Value::Bool(true)),
                    retry_at_ms: None,
                });
                Ok(true)
            }
        }
    }

    /// Is the run rolling back (a saga compensating)?
    pub fn is_compensating(&self) -> bool {
        self.lock().status == RunStatus::Compensating
    }

    /// The live clock, in ms since the Unix epoch: **not journaled**, so a replay reads another
    /// time. For logs and metrics only; never branch on it or pass it to a step (use
    /// [`Self::now`], which is recorded).
    pub fn live_clock_ms(&self) -> i64 {
        self.now_ms()
    }

    fn now_ms(&self) -> i64 {
        self.inner.writer.now_ms()
    }

    /// The time, in ms since the Unix epoch, as the first execution read it: journaled (kind
    /// `value`, step name `now`) and replayed thereafter, so a branch on it takes the same way
    /// after a crash. Recorded with the run's next write (no commit of its own), and always before
    /// the next external step runs.
    pub fn now(&self) -> Result<i64, WorkflowError> {
        self.value("now", || json!(self.now_ms()))
    }

    /// A random `u64`, journaled like [`Self::now`] (step name `random`).
    pub fn random(&self) -> Result<u64, WorkflowError> {
        self.value("random", || json!(rand::random::<u64>()))
    }

    /// A random (v4) UUID in its hyphenated form, journaled like [`Self::now`] (step name `uuid`).
    pub fn uuid(&self) -> Result<String, WorkflowError> {
        self.value("uuid", || json!(uuid::Uuid::new_v4().to_string()))
    }

    /// Take the next position for a deterministic value: replay the recorded one, or make it and
    /// journal it with the run's next write.
    fn value<T: DeserializeOwned>(&self, name: &str, make: impl FnOnce() -> Value) -> Result<T, WorkflowError> {
        match self.begin(name, StepKind::Value)? {
            Slot::Journaled(seq, entry) => match entry.status {
                StepStatus::Completed | StepStatus::Skipped => self.decode(name, entry.output.unwrap_or(Value::Null)),
                other => Err(self.park(format!("value {name} at position {seq} is journaled as {}", other.as_str()))),
            },
            Slot::New(seq) => {
                let value = make();
                self.lock().pending.push(JournalOp::StepAttempt {
                    seq,
                    name: name.to_string(),
                    kind: StepKind::Value,
                    attempt: 1,
                    result: Ok(value.clone()),
                    retry_at_ms: None,
                });
                self.decode(name, value)
            }
        }
    }

    /// Run the registered workflow `workflow` (its latest version) as a child of this run, with
    /// `input`, and wait for its end durably. The child's run id is derived from this run's id and
    /// the journal position ([`child_run_id`]): the start is journaled in the same transaction as
    /// the child's creation, so a replay never starts it twice. On a worker, the child is leased
    /// to the same worker in that transaction and runs in this run's slot while this run waits
    /// for it in memory, keeping its lease; otherwise (or when the child suspends, or this run's
    /// cancellation is requested) this run is suspended (`waiting`, lease released): propagate
    /// the suspension with `?`. The child's
    /// output decodes into `O`; a child that failed, compensated or was cancelled is this step's
    /// failure ([`WorkflowError::StepFailed`], step name = the workflow's name), so a saga can
    /// compensate. A parked child keeps its parent waiting until an operator settles it. An
    /// unknown workflow or an input it refuses fails this run with that error's code, before
    /// anything is written. Cancelling this run cancels its children (docs/workflows.md, "Child
    /// workflows").
    pub async fn child<I, O>(&self, workflow: &str, input: &I) -> Result<O, WorkflowError>
    where
        I: Serialize,
        O: DeserializeOwned,
    {
        let seq = match self.begin(workflow, StepKind::Child)? {
            Slot::Journaled(seq, entry) => match entry.status {
                StepStatus::Completed | StepStatus::Skipped => {
                    return self.child_output(workflow, entry.output.unwrap_or(Value::Null))
                }
                StepStatus::Failed => return Err(self.recorded_failure(&entry, None)),
                StepStatus::Waiting => seq,
                StepStatus::Retrying => {
                    return Err(self.park(format!("child {workflow} at position {seq} is journaled as retrying")))
                }
            },
            Slot::New(seq) => {
                let input = serde_json::to_value(input).map_err(|e| {
                    WorkflowError::Failed(format!("the input of child {workflow} does not serialise: {e}"))
                })?;
                let run_id = child_run_id(&self.inner.run_id, seq);
                let request = self
                    .inner
                    .workflows
                    .start_request(&run_id, workflow, input)
                    .map(|request| StartRequest { deadline_ms: self.inner.deadline_ms, ..request })
                    .map_err(|e| WorkflowError::Failed(format!("{}: {}", e.code(), e)))?;
                let wake_at_ms = self.now_ms().saturating_add(CHILD_RECHECK_MS);
                // Leased to this worker as it starts, unless its type's global budget decides.
                let local = self.inner.children.as_ref().filter(|_| !self.inner.workflows.type_limited(workflow));
                let claim = local.map(|children| children.lease());
                let op = JournalOp::StartChild {
                    seq,
                    name: workflow.to_string(),
                    request: Box::new(request),
                    wake_at_ms,
                    claim,
                };
                match self.write(op).await? {
                    WriteResult::Claimed(child) => {
                        let local = local.expect("a child is claimed only when asked");
                        if let Some(end) = self.await_local_child(local, seq, *child).await? {
                            return self.child_output(workflow, end);
                        }
                        seq
                    }
                    WriteResult::TxResult(Ok(_)) => {
                        self.inner.due.notify_one();
                        seq
                    }
                    WriteResult::TxResult(Err(failure)) => {
                        return Err(WorkflowError::StepFailed {
                            step: workflow.to_string(),
                            message: failure.message,
                            out_of_attempts: false,
                        })
                    }
                    other => {
                        let error = Error::Invariant(format!("a child start was answered {other:?}"));
                        self.lock().store_error = Some(error.clone());
                        return Err(WorkflowError::Store(error));
                    }
                }
            }
        };
        let name = child_event(seq);
        let event = {
            let mut state = self.lock();
            let position = state.events.iter().position(|e| e.name == name);
            position.map(|i| state.events.remove(i))
        };
        match event {
            Some(event) => {
                let output = event.payload;
                self.write(JournalOp::TimerFinished { seq, event_id: Some(event.event_id), output: output.clone() })
                    .await?;
                self.child_output(workflow, output)
            }
            None => {
                Err(self.suspend(SuspendStatus::Waiting, self.now_ms().saturating_add(CHILD_RECHECK_MS), Some(name)))
            }
        }
    }

    /// Publish `value` under `key`, readable from outside while the run exists
    /// (`GET /v1/runs/{id}/events/{key}`, `RunHandle::get_event`): the latest value of a key wins.
    /// Journaled (kind `publish`, step name = the key) in the same transaction as the value:
    /// exactly once, and a replay does not publish again.
    pub async fn set_event<T: Serialize>(&self, key: &str, value: &T) -> Result<(), WorkflowError> {
        let value = serde_json::to_value(value)
            .map_err(|e| WorkflowError::Failed(format!("the value of event {key} does not serialise: {e}")))?;
        match self.begin(key, StepKind::Publish)? {
            Slot::Journaled(..) => Ok(()),
            Slot::New(seq) => {
                let op = self.checked(JournalOp::Publish { seq, key: key.to_string(), value })?;
                self.write(op).await.map(drop)
            }
        }
    }

    /// Send `payload` to run `to` as an event named `topic` (it receives it with
    /// [`Self::recv`]`(topic, ...)` or [`Self::wait_for_event`]). Journaled (kind `send`, step name =
    /// the topic) in the same transaction as the event: exactly once, whatever crashes. A run
    /// `to` that does not exist or has ended is this step's failure
    /// ([`WorkflowError::StepFailed`]). A run `to` that holds its most events no wait consumed
    /// yet ([`tidemark_core::workflow::RUN_EVENTS_HELD_MAX`]) makes this run wait (suspended,
    /// its lease released, nothing journaled) for the first delay of its workflow's retry policy
    /// and send again, until `to` takes it or ends: propagate the suspension with `?`.
    pub async fn send<T: Serialize>(&self, to: &str, topic: &str, payload: &T) -> Result<(), WorkflowError> {
        let payload = serde_json::to_value(payload)
            .map_err(|e| WorkflowError::Failed(format!("the message {topic} does not serialise: {e}")))?;
        let seq = match self.begin(topic, StepKind::Send)? {
            Slot::Journaled(_, entry) => {
                return match entry.status {
                    StepStatus::Failed => Err(self.recorded_failure(&entry, None)),
                    _ => Ok(()),
                }
            }
            Slot::New(seq) => seq,
        };
        let op = self.checked(JournalOp::Send { seq, to: to.to_string(), topic: topic.to_string(), payload })?;
        match self.write(op).await? {
            WriteResult::TxResult(Ok(_)) => {
                self.inner.due.notify_one();
                Ok(())
            }
            // The receiver holds its most events no wait consumed (`RUN_EVENTS_HELD_MAX`): the
            // store journaled nothing, and this run waits the first delay of its retry policy
            // and sends again (back-pressure, as long as the receiver is active).
            WriteResult::TxResult(Err(failure)) if failure.retryable => {
                let at = self.now_ms().saturating_add(self.inner.retry.delay_ms(1, rand::random::<f64>()));
                Err(self.suspend(SuspendStatus::Pending, at, None))
            }
            WriteResult::TxResult(Err(failure)) => Err(WorkflowError::StepFailed {
                step: topic.to_string(),
                message: failure.message,
                out_of_attempts: false,
            }),
            other => {
                let error = Error::Invariant(format!("a send was answered {other:?}"));
                self.lock().store_error = Some(error.clone());
                Err(WorkflowError::Store(error))
            }
        }
    }

    /// Receive the next message sent to this run under `topic` ([`Self::send`] from another run,
    /// or any event of that name), or `None` after `timeout`: [`Self::wait_for_event`] under the
    /// name of the exchange.
    pub async fn recv(&self, topic: &str, timeout: Duration) -> Result<Option<Value>, WorkflowError> {
        self.wait_for_event(topic, timeout).await
    }

    /// Run `child`, leased to this worker as it started at `seq`, in this run's slot, and wait
    /// for it in memory (the lease kept and heartbeated): its end as journaled when it ended
    /// here, `None` when it left this worker without an end (or this run's cancellation was
    /// requested) and this run waits in the store as for any child.
    async fn await_local_child(
        &self,
        local: &LocalChildren,
        seq: u32,
        child: ClaimedRun,
    ) -> Result<Option<Value>, WorkflowError> {
        let left = match local.run(&self.inner.run_id, &self.inner.lease_token, child) {
            Ok(left) => left.await.unwrap_or(ChildLeft::Elsewhere),
            Err(child) => {
                // The loop has stopped: the child's lease goes back (or expires) and it is
                // claimed as any run is.
                let release =
                    JournalWrite { run_id: child.run.run_id, lease_token: child.lease_token, op: JournalOp::Release };
                let _ = self.inner.writer.write(release).await;
                self.inner.due.notify_one();
                return Ok(None);
            }
        };
        // Its end, when it ended here, settled this run's entry in the child's last transaction;
        // when this run's lease had changed by then, the end came as its end event, and is
        // journaled with this run's next write (which the changed lease fences).
        match left {
            ChildLeft::Ended { end, settled } => {
                if !settled {
                    self.lock().pending.push(JournalOp::ChildEnded { seq, end: end.clone() });
                }
                Ok(Some(end))
            }
            // Cancelled while it waited (a heartbeat brings the request, not its reason): it
            // suspends due now, and its next claim, which reads the reason, ends it.
            ChildLeft::Elsewhere => Ok(None),
        }
    }

    /// The end this run's parent learns of (its end event's payload), once its last write
    /// ended it completed, compensated, failed or cancelled.
    pub(crate) fn end_for_parent(&self) -> Option<Value> {
        self.lock().ended.clone()
    }

    /// That last write settled the entry of the parent waiting for this run in memory.
    pub(crate) fn settled_parent(&self) -> bool {
        self.lock().settled_parent
    }

    /// A child's end as journaled: its output when it completed, else this step's failure.
    fn child_output<O: DeserializeOwned>(&self, workflow: &str, end: Value) -> Result<O, WorkflowError> {
        match end.get("status").and_then(Value::as_str) {
            Some("completed") => self.decode(workflow, end.get("result").cloned().unwrap_or(Value::Null)),
            // An operator's skip output is the child's output as it is.
            None => self.decode(workflow, end),
            Some(status) => {
                let run_id = end.get("run_id").and_then(Value::as_str).unwrap_or("?");
                let error = end.get("error").and_then(Value::as_str).unwrap_or("");
                Err(WorkflowError::StepFailed {
                    step: workflow.to_string(),
                    message: format!("child run {run_id} ended {status}: {error}"),
                    out_of_attempts: false,
                })
            }
        }
    }

    /// Check a write that carries what the workflow gave (a message, a published value) as every
    /// store will ([`validate_write`]); bad input fails the run (see `RunState::refused`).
    fn checked(&self, op: JournalOp<S::Target>) -> Result<JournalOp<S::Target>, WorkflowError> {
        let write = self.journal_write(op);
        match validate_write(&write, false, self.now_ms()) {
            Ok(_) => Ok(write.op),
            Err(error) => {
                let message = truncate(format!("{}: {error}", error.code()));
                self.lock().refused = Some(message.clone());
                Err(WorkflowError::Failed(message))
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, RunState<S::Target>> {
        self.inner.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// An external step: runs `f(idempotency_key)` at least once until it succeeds, fails for
    /// good or runs out of attempts. The key is `"{run_id}:{seq}:{name}"` and is the same on
    /// every attempt and after every crash: pass it on to the outside world. Each attempt is
    /// bounded by the policy's `attempt_timeout_ms`; a failed attempt suspends the run until the
    /// backoff is over (propagate the error with `?`). The attempt is journaled with the run's
    /// next write, in the same transaction (the next step, a timer, the suspension or the end of
    /// the run; before the next external step at the latest): a crash before that runs it again.
    pub async fn step<T, F, Fut>(&self, name: &str, policy: Option<RetryPolicy>, f: F) -> Result<T, WorkflowError>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = Result<T, StepFailure>>,
    {
        self.external_as(StepKind::External, name, policy, f).await
    }

    /// An external compensation (journaled as kind `compensation`): like [`Self::step`], but it
    /// still runs after cancellation was requested.
    pub async fn compensation<T, F, Fut>(
        &self,
        name: &str,
        policy: Option<RetryPolicy>,
        f: F,
    ) -> Result<T, WorkflowError>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = Result<T, StepFailure>>,
    {
        self.external_as(StepKind::Compensation, name, policy, f).await
    }

    /// A transactional step: `f` runs on the writer thread inside the journal's transaction (in
    /// a savepoint), so its writes and the journal entry commit together: exactly once. On
    /// failure its writes roll back and the attempt is recorded; a retry runs again in a later
    /// execution of the workflow (which builds the closure anew). `f` must not block for long:
    /// it holds up every other run's commit. The attempt timeout does not apply to it. A panic in
    /// `f` is a permanent failure of the step.
    pub async fn tx_step<T, F>(&self, name: &str, policy: Option<RetryPolicy>, f: F) -> Result<T, WorkflowError>
    where
        T: Serialize + DeserializeOwned + 'static,
        F: FnOnce(&S::Target) -> Result<T, StepFailure> + Send + 'static,
    {
        self.tx_as(StepKind::Transactional, name, policy, f).await
    }

    /// A transactional compensation (journaled as kind `compensation`).
    pub async fn tx_compensation<T, F>(&self, name: &str, policy: Option<RetryPolicy>, f: F) -> Result<T, WorkflowError>
    where
        T: Serialize + DeserializeOwned + 'static,
        F: FnOnce(&S::Target) -> Result<T, StepFailure> + Send + 'static,
    {
        self.tx_as(StepKind::Compensation, name, policy, f).await
    }

    /// Turn the run `compensating`: journaled with the run's next write (in the same
    /// transaction). Retries of later steps then keep the run in `compensating`.
    pub async fn begin_compensation(&self) -> Result<(), WorkflowError> {
        let mut state = self.lock();
        state.usable()?;
        if state.status != RunStatus::Compensating {
            state.status = RunStatus::Compensating;
            state.pending.push(JournalOp::SetStatus { status: RunStatus::Compensating });
        }
        Ok(())
    }

    /// The run executes (`pending`/`sleeping`/`waiting` -> `running`): journaled with the run's
    /// first write of this execution, in the same transaction.
    pub(crate) fn mark_running(&self) {
        let mut state = self.lock();
        state.status = RunStatus::Running;
        state.pending.push(JournalOp::SetStatus { status: RunStatus::Running });
    }

    fn journal_write(&self, op: JournalOp<S::Target>) -> JournalWrite<S::Target> {
        JournalWrite { run_id: self.inner.run_id.clone(), lease_token: self.inner.lease_token.clone(), op }
    }

    /// Send the pending writes and then `ops` in one batch; the answer of the first write that
    /// was fenced or failed (the rest of the batch is then fenced or failed too), else the last
    /// write's answer.
    async fn send_writes(&self, ops: Vec<JournalOp<S::Target>>) -> tidemark_core::Result<WriteResult> {
        let mut writes: Vec<JournalWrite<S::Target>> =
            std::mem::take(&mut self.lock().pending).into_iter().map(|op| self.journal_write(op)).collect();
        writes.extend(ops.into_iter().map(|op| self.journal_write(op)));
        let results = match writes.len() {
            0 => return Ok(WriteResult::Done),
            1 => vec![self.inner.writer.write(writes.pop().expect("one write")).await],
            _ => self.inner.writer.write_together(writes).await,
        };
        let mut last = Ok(WriteResult::Done);
        for result in results {
            match result {
                Ok(WriteResult::Fenced) | Err(_) => return result,
                other => last = other,
            }
        }
        last
    }

    /// Journal the pending writes now (before an external step runs, so that no commit of this
    /// run happens while it runs).
    async fn flush(&self) -> Result<(), WorkflowError> {
        if self.lock().pending.is_empty() {
            return Ok(());
        }
        self.write_ops(Vec::new()).await.map(drop)
    }

    /// A durable timer: the run suspends (`sleeping`, its lease released) and resumes after
    /// `duration`, across restarts. Propagate the suspension with `?`.
    pub async fn sleep(&self, duration: Duration) -> Result<(), WorkflowError> {
        let now = self.now_ms();
        match self.begin(SLEEP_STEP, StepKind::Sleep)? {
            Slot::Journaled(seq, entry) => match entry.status {
                StepStatus::Completed | StepStatus::Skipped => Ok(()),
                StepStatus::Failed => Err(self.recorded_failure(&entry, None)),
                StepStatus::Waiting => {
                    let wake_at = entry.wake_at_ms.unwrap_or(now);
                    if now >= wake_at {
                        self.write(JournalOp::TimerFinished { seq, event_id: None, output: Value::Null }).await?;
                        Ok(())
                    } else {
                        Err(self.suspend(SuspendStatus::Sleeping, wake_at, None))
                    }
                }
                StepStatus::Retrying => Err(self.park(format!("sleep at position {seq} is journaled as retrying"))),
            },
            Slot::New(seq) => {
                let ms = duration_ms(duration);
                if ms > TIMER_MS_MAX {
                    return Err(WorkflowError::Failed(format!("sleep of {ms} ms is longer than {TIMER_MS_MAX} ms")));
                }
                let wake_at = now.saturating_add(ms);
                self.write(JournalOp::TimerStarted {
                    seq,
                    name: SLEEP_STEP.to_string(),
                    kind: StepKind::Sleep,
                    wake_at_ms: wake_at,
                    event_name: None,
                })
                .await?;
                Err(self.suspend(SuspendStatus::Sleeping, wake_at, None))
            }
        }
    }

    /// Wait for an event named `name` sent to this run (an event sent before the wait started
    /// counts, oldest first; each event is consumed by one wait). Returns its payload, or `None`
    /// when `timeout` passes first. While waiting the run is suspended (`waiting`, its lease
    /// released): propagate the suspension with `?`. The wait is journaled under the step name
    /// `name`.
    pub async fn wait_for_event(&self, name: &str, timeout: Duration) -> Result<Option<Value>, WorkflowError> {
        let now = self.now_ms();
        let (seq, deadline) = match self.begin(name, StepKind::Wait)? {
            Slot::Journaled(seq, entry) => match entry.status {
                StepStatus::Completed | StepStatus::Skipped => {
                    return Ok(decode_wait_output(entry.output.unwrap_or(Value::Null)))
                }
                StepStatus::Failed => return Err(self.recorded_failure(&entry, None)),
                StepStatus::Waiting => (seq, entry.wake_at_ms.unwrap_or(now)),
                StepStatus::Retrying => {
                    return Err(self.park(format!("wait at position {seq} is journaled as retrying")))
                }
            },
            Slot::New(seq) => {
                let ms = duration_ms(timeout);
                if ms > TIMER_MS_MAX {
                    return Err(WorkflowError::Failed(format!("wait of {ms} ms is longer than {TIMER_MS_MAX} ms")));
                }
                let deadline = now.saturating_add(ms);
                self.write(JournalOp::TimerStarted {
                    seq,
                    name: name.to_string(),
                    kind: StepKind::Wait,
                    wake_at_ms: deadline,
                    event_name: Some(name.to_string()),
                })
                .await?;
                (seq, deadline)
            }
        };
        let event = {
            let mut state = self.lock();
            let position = state.events.iter().position(|e| e.name == name);
            position.map(|i| state.events.remove(i))
        };
        if let Some(event) = event {
            let output = json!({"event_id": event.event_id, "payload": event.payload});
            self.write(JournalOp::TimerFinished { seq, event_id: Some(event.event_id.clone()), output }).await?;
            return Ok(Some(event.payload));
        }
        if self.now_ms() >= deadline {
            self.write(JournalOp::TimerFinished { seq, event_id: None, output: json!({"timed_out": true}) }).await?;
            return Ok(None);
        }
        Err(self.suspend(SuspendStatus::Waiting, deadline, Some(name.to_string())))
    }

    async fn external_as<T, F, Fut>(
        &self,
        kind: StepKind,
        name: &str,
        policy: Option<RetryPolicy>,
        f: F,
    ) -> Result<T, WorkflowError>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = Result<T, StepFailure>>,
    {
        let policy = self.policy(policy)?;
        let (seq, attempt) = self.prepare_attempt(kind, name, &policy)?;
        let attempt = match attempt {
            Attempt::Replayed(value) => return self.decode(name, value),
            Attempt::Run(attempt) => attempt,
        };
        // A status change still to journal commits before the step runs.
        self.flush().await?;
        let key = format!("{}:{seq}:{name}", self.inner.run_id);
        let timeout_ms = policy.attempt_timeout_ms.max(1);
        let began = std::time::Instant::now();
        let result = match tokio::time::timeout(Duration::from_millis(timeout_ms as u64), f(key)).await {
            Ok(Ok(value)) => to_output(&value).map(|output| (value, output)),
            Ok(Err(failure)) => Err(failure),
            Err(_) => Err(StepFailure::retryable(format!("attempt {attempt} timed out after {timeout_ms} ms"))),
        };
        let retry_at_ms = match &result {
            Err(failure) if failure.retryable => self.retry_at(&policy, attempt),
            _ => None,
        };
        let end = match &result {
            Ok(_) => StepAttemptEnd::Completed,
            Err(_) if retry_at_ms.is_some() => StepAttemptEnd::Retrying,
            Err(_) => StepAttemptEnd::Failed,
        };
        self.tell_attempt(name, attempt, began, end);
        // Journaled with the run's next write, in the same transaction (the next step's entry, a
        // timer, the suspension or the end of the run), or before the next external step runs:
        // no round trip of its own. Until then a crash repeats this attempt, with the same key.
        let journaled = result.as_ref().map(|(_, output)| output.clone()).map_err(Clone::clone);
        self.lock().pending.push(JournalOp::StepAttempt {
            seq,
            name: name.to_string(),
            kind,
            attempt,
            result: journaled,
            retry_at_ms,
        });
        match result {
            Ok((value, _)) => Ok(value),
            Err(failure) => Err(self.after_failure(name, failure, retry_at_ms, attempt, &policy)),
        }
    }

    async fn tx_as<T, F>(
        &self,
        kind: StepKind,
        name: &str,
        policy: Option<RetryPolicy>,
        f: F,
    ) -> Result<T, WorkflowError>
    where
        T: Serialize + DeserializeOwned + 'static,
        F: FnOnce(&S::Target) -> Result<T, StepFailure> + Send + 'static,
    {
        let policy = self.policy(policy)?;
        let (seq, attempt) = self.prepare_attempt(kind, name, &policy)?;
        let attempt = match attempt {
            Attempt::Replayed(value) => return self.decode(name, value),
            Attempt::Run(attempt) => attempt,
        };
        // Decided before the body runs; the store applies it only to a retryable failure.
        let retry_at_ms = self.retry_at(&policy, attempt);
        // The body runs on the writer thread: its output is converted to JSON there once; the
        // store checks its size on the text it writes (over the limit: a permanent failure).
        let body: TxBody<S::Target> =
            Box::new(move |target: &S::Target| match catch_unwind(AssertUnwindSafe(|| f(target))) {
                Ok(Ok(value)) => serde_json::to_value(&value)
                    .map_err(|e| StepFailure::permanent(format!("the step output does not serialise: {e}"))),
                Ok(Err(failure)) => Err(failure),
                Err(_) => Err(StepFailure::permanent("the transactional step panicked")),
            });
        let began = std::time::Instant::now();
        let answer =
            self.write(JournalOp::TxStep { seq, name: name.to_string(), kind, attempt, body, retry_at_ms }).await?;
        match answer {
            WriteResult::TxResult(Ok(output)) => {
                self.tell_attempt(name, attempt, began, StepAttemptEnd::Completed);
                self.decode(name, output)
            }
            WriteResult::TxResult(Err(failure)) => {
                let retrying = failure.retryable && retry_at_ms.is_some();
                let end = if retrying { StepAttemptEnd::Retrying } else { StepAttemptEnd::Failed };
                self.tell_attempt(name, attempt, began, end);
                Err(self.after_failure(name, failure, retry_at_ms, attempt, &policy))
            }
            other => {
                let error = Error::Invariant(format!("a transactional step was answered {other:?}"));
                self.lock().store_error = Some(error.clone());
                Err(WorkflowError::Store(error))
            }
        }
    }

    fn tell_attempt(&self, step: &str, attempt: u32, began: std::time::Instant, end: StepAttemptEnd) {
        if let Some(observer) = &self.inner.observer {
            let took = began.elapsed();
            let (run_id, workflow) = (self.inner.run_id.as_str(), self.inner.workflow.as_str());
            observer.step_attempted(&StepAttempt { run_id, workflow, step, attempt, began, took, end });
        }
    }

    fn policy(&self, policy: Option<RetryPolicy>) -> Result<RetryPolicy, WorkflowError> {
        let policy = policy.unwrap_or_else(|| self.inner.retry.clone());
        policy.validate().map_err(|e| WorkflowError::Failed(e.to_string()))?;
        Ok(policy)
    }

    /// Take the next position for a step that can be retried: replay it when settled, else
    /// observe cancellation and any backoff still running, and number the attempt.
    fn prepare_attempt(
        &self,
        kind: StepKind,
        name: &str,
        policy: &RetryPolicy,
    ) -> Result<(u32, Attempt), WorkflowError> {
        match self.begin(name, kind)? {
            Slot::New(seq) => Ok((seq, Attempt::Run(1))),
            Slot::Journaled(seq, entry) => match entry.status {
                StepStatus::Completed | StepStatus::Skipped => {
                    Ok((seq, Attempt::Replayed(entry.output.unwrap_or(Value::Null))))
                }
                StepStatus::Failed => Err(self.recorded_failure(&entry, Some(policy.max_attempts))),
                StepStatus::Retrying => {
                    if let Some(at) = entry.next_attempt_at_ms {
                        if at > self.now_ms() {
                            return Err(self.suspend(SuspendStatus::Pending, at, None));
                        }
                    }
                    Ok((seq, Attempt::Run(entry.attempts + 1)))
                }
                StepStatus::Waiting => Err(self.park(format!("step {name} at position {seq} is journaled as waiting"))),
            },
        }
    }

    /// Take the next journal position for a call. This is the step boundary where cancellation
    /// is observed: with a cancel request, a call that is not a compensation and whose position
    /// is not a settled, matching entry returns `Cancelled`. The position is then consumed only
    /// when an unsettled entry of this step occupies it, so the journal stays gapless (a saga's
    /// compensations take the next free positions) and the replay after a cancel is the same.
    fn begin(&self, name: &str, kind: StepKind) -> Result<Slot, WorkflowError> {
        validate_id("step name", name).map_err(|e| WorkflowError::Failed(e.to_string()))?;
        let cancelled = kind != StepKind::Compensation && self.cancel_requested();
        let mut state = self.lock();
        state.usable()?;
        let seq = state.next_seq;
        if seq >= RUN_STEPS_MAX {
            return Err(journal_full());
        }
        let replay_only = self.inner.workflows.replays_only();
        match state.journal.get(&seq) {
            None if cancelled => Err(WorkflowError::Cancelled),
            None if replay_only => Err(replay_end(&mut state, seq, kind, name)),
            None => {
                state.next_seq += 1;
                Ok(Slot::New(seq))
            }
            Some(entry) if entry.name == name && entry.kind == kind => {
                let entry = entry.clone();
                state.next_seq += 1;
                if cancelled && !entry.status.is_settled() {
                    return Err(WorkflowError::Cancelled);
                }
                if replay_only && !entry.status.is_settled() {
                    return Err(replay_end(&mut state, seq, kind, name));
                }
                Ok(Slot::Journaled(seq, entry))
            }
            // After a cancel, the position may hold the compensation that followed it.
            Some(_) if cancelled => Err(WorkflowError::Cancelled),
            Some(entry) => {
                let message = format!(
                    "non-deterministic replay: position {seq} is journaled as {} step {:?}, the workflow now calls {} step {name:?}",
                    entry.kind.as_str(),
                    entry.name,
                    kind.as_str()
                );
                state.parked = Some(message.clone());
                Err(WorkflowError::Parked(message))
            }
        }
    }

    fn retry_at(&self, policy: &RetryPolicy, attempt: u32) -> Option<i64> {
        (attempt < policy.max_attempts)
            .then(|| self.now_ms().saturating_add(policy.delay_ms(attempt, rand::random::<f64>())))
    }

    /// What a failed attempt number `attempt` of step `name` makes of the run: a suspension
    /// until the retry is due, or the step's failure for good.
    fn after_failure(
        &self,
        name: &str,
        failure: StepFailure,
        retry_at_ms: Option<i64>,
        attempt: u32,
        policy: &RetryPolicy,
    ) -> WorkflowError {
        match retry_at_ms {
            Some(at) if failure.retryable => self.suspend(SuspendStatus::Pending, at, None),
            _ => WorkflowError::StepFailed {
                step: name.to_string(),
                message: failure.message,
                out_of_attempts: attempt >= policy.max_attempts,
            },
        }
    }

    /// The failure journaled in `entry`, as the execution that journaled it returned it:
    /// `max_attempts` is the step's policy's (none for what is not a retried step).
    fn recorded_failure(&self, entry: &JournalEntry, max_attempts: Option<u32>) -> WorkflowError {
        WorkflowError::StepFailed {
            step: entry.name.clone(),
            message: entry.error.clone().unwrap_or_default(),
            out_of_attempts: max_attempts.is_some_and(|max| entry.attempts >= max),
        }
    }

    fn decode<T: DeserializeOwned>(&self, name: &str, output: Value) -> Result<T, WorkflowError> {
        serde_json::from_value(output)
            .map_err(|e| self.park(format!("the journaled output of step {name} does not decode: {e}")))
    }

    fn park(&self, message: String) -> WorkflowError {
        let mut state = self.lock();
        state.parked.get_or_insert(message.clone());
        WorkflowError::Parked(message)
    }

    /// Remember that the run must wait; the worker writes the suspension when the function
    /// returns (the earliest wake wins if several steps wait at once).
    fn suspend(&self, status: SuspendStatus, wake_at_ms: i64, waiting_for: Option<String>) -> WorkflowError {
        // No suspension sleeps past a deadline still ahead: the run wakes then and is cancelled
        // (one that has passed no longer bounds anything: its compensations wait as they must).
        let wake_at_ms = match self.inner.deadline_ms {
            Some(deadline) if deadline > self.now_ms() => wake_at_ms.min(deadline),
            _ => wake_at_ms,
        };
        let mut state = self.lock();
        let status = match status {
            SuspendStatus::Pending if state.status == RunStatus::Compensating => SuspendStatus::Compensating,
            other => other,
        };
        let replace = match &state.suspension {
            Some(s) => wake_at_ms < s.wake_at_ms,
            None => true,
        };
        if replace {
            state.suspension = Some(Suspension { status, wake_at_ms, waiting_for });
        }
        WorkflowError::suspended()
    }

    async fn write(&self, op: JournalOp<S::Target>) -> Result<WriteResult, WorkflowError> {
        self.write_ops(vec![op]).await
    }

    /// Send the pending writes and `ops` together; a fenced or failed write stops the run.
    async fn write_ops(&self, ops: Vec<JournalOp<S::Target>>) -> Result<WriteResult, WorkflowError> {
        match self.send_writes(ops).await {
            Ok(WriteResult::Fenced) => {
                self.lock().lost = true;
                Err(WorkflowError::LeaseLost)
            }
            Ok(result) => Ok(result),
            Err(error) => {
                self.lock().store_error = Some(error.clone());
                Err(WorkflowError::Store(error))
            }
        }
    }

    /// Write what the execution ended in: a suspension, a finish, or a release. A child whose
    /// parent waits for it in memory with the lease `parent_token` ends with
    /// [`JournalOp::FinishChild`], which settles the parent's entry while that lease holds.
    pub(crate) async fn conclude(
        &self,
        result: Result<Value, WorkflowError>,
        parent_token: Option<&str>,
    ) -> RunOutcome {
        let op = {
            let state = self.lock();
            if state.lost {
                return RunOutcome::Lost;
            }
            if let Some(message) = &state.parked {
                finish(FinishStatus::Parked, None, Some(message.clone()))
            } else if let Some(s) = &state.suspension {
                JournalOp::Suspend { status: s.status, wake_at_ms: s.wake_at_ms, waiting_for: s.waiting_for.clone() }
            } else if state.store_error.is_some() {
                JournalOp::Release
            } else if let Some(message) = &state.refused {
                finish(FinishStatus::Failed, None, Some(message.clone()))
            } else if let Some(request) = &state.continuation {
                JournalOp::ContinueAsNew { request: Box::new(request.clone()) }
            } else {
                match result {
                    Ok(value) => match state.journal.range(state.next_seq..).next() {
                        Some((seq, entry)) => finish(
                            FinishStatus::Parked,
                            None,
                            Some(format!(
                                "non-deterministic replay: the workflow returned before reaching journaled step {:?} at position {seq}",
                                entry.name
                            )),
                        ),
                        None => match to_output(&value) {
                            Ok(value) => finish(FinishStatus::Completed, Some(value), None),
                            Err(failure) => finish(FinishStatus::Failed, None, Some(failure.message)),
                        },
                    },
                    Err(WorkflowError::StepFailed { step, message, .. }) => {
                        finish(FinishStatus::Failed, None, Some(format!("step {step} failed: {message}")))
                    }
                    Err(WorkflowError::Failed(message)) => finish(FinishStatus::Failed, None, Some(message)),
                    Err(WorkflowError::Cancelled) => finish(FinishStatus::Cancelled, None, Some(self.cancel_reason())),
                    // Not made by this run's context (it would have remembered the continuation).
                    Err(WorkflowError::ContinuedAsNew(_)) => finish(
                        FinishStatus::Failed,
                        None,
                        Some("the workflow returned ContinuedAsNew that continue_as_new did not make".into()),
                    ),
                    Err(WorkflowError::Parked(message)) => finish(FinishStatus::Parked, None, Some(message)),
                    Err(WorkflowError::Compensated(message)) => finish(FinishStatus::Compensated, None, Some(message)),
                    Err(WorkflowError::LeaseLost) => return RunOutcome::Lost,
                    // Not this run's suspension, or a store error of a call outside the context.
                    Err(WorkflowError::Suspended(_)) | Err(WorkflowError::Store(_)) => JournalOp::Release,
                }
            }
        };
        let op = match op {
            JournalOp::Finish { status, result, error }
                if !matches!(status, FinishStatus::Parked | FinishStatus::Continued) && parent_token.is_some() =>
            {
                let parent_lease_token = parent_token.unwrap_or_default().to_string();
                JournalOp::FinishChild { status, result, error, parent_lease_token }
            }
            // A child of this run that ended on this worker may have settled one of its entries
            // while it stopped waiting (another branch suspended it): it stays due.
            JournalOp::Suspend { status, wake_at_ms, waiting_for }
                if self.inner.children.as_ref().is_some_and(|c| c.may_have_settled_unheard(&self.inner.run_id)) =>
            {
                JournalOp::Suspend { status, wake_at_ms: wake_at_ms.min(self.now_ms()), waiting_for }
            }
            op => op,
        };
        let outcome = match &op {
            JournalOp::Finish { status, .. } | JournalOp::FinishChild { status, .. } => RunOutcome::Finished(*status),
            JournalOp::Suspend { status, .. } => RunOutcome::Suspended(*status),
            JournalOp::ContinueAsNew { .. } => RunOutcome::Finished(FinishStatus::Continued),
            _ => RunOutcome::Released,
        };
        let end = self.end_event(&op);
        match self.send_writes(vec![op]).await {
            Ok(WriteResult::Fenced) => RunOutcome::Lost,
            // The continuation's id is taken by another run: this run fails, saying so.
            Ok(WriteResult::TxResult(Err(failure))) => {
                let op = finish(FinishStatus::Failed, None, Some(failure.message));
                let end = self.end_event(&op);
                match self.send_writes(vec![op]).await {
                    Ok(WriteResult::Fenced) => RunOutcome::Lost,
                    Ok(_) => {
                        self.lock().ended = end;
                        RunOutcome::Finished(FinishStatus::Failed)
                    }
                    Err(error) => RunOutcome::Error(error.to_string()),
                }
            }
            Ok(result) => {
                let mut state = self.lock();
                state.ended = end;
                state.settled_parent = result == WriteResult::ParentSettled;
                outcome
            }
            Err(error) => RunOutcome::Error(error.to_string()),
        }
    }

    /// The end event a finish `op` sends the run's parent, as the store writes it
    /// (`{"run_id", "status", "result", "error"}`): none for a parked run (it waits for an
    /// operator) or a continued one (its continuation's end is the one the parent learns).
    fn end_event(&self, op: &JournalOp<S::Target>) -> Option<Value> {
        match op {
            JournalOp::Finish { status, result, error } | JournalOp::FinishChild { status, result, error, .. }
                if !matches!(status, FinishStatus::Parked | FinishStatus::Continued) =>
            {
                Some(json!({
                    "run_id": self.inner.run_id,
                    "status": status.run_status().as_str(),
                    "result": result,
                    "error": error,
                }))
            }
            _ => None,
        }
    }

    /// Why a cancelled run ended: the operator's reason, its parent's end, or its deadline.
    fn cancel_reason(&self) -> String {
        if let Some(reason) = &self.inner.cancel_reason {
            return reason.clone();
        }
        match self.inner.deadline_ms {
            Some(deadline) if !self.inner.cancel.load(Ordering::SeqCst) && self.now_ms() >= deadline => {
                format!("{}: the run's deadline {deadline} passed", workflow_codes::DEADLINE_PASSED)
            }
            _ => "cancel requested".into(),
        }
    }
}

enum Attempt {
    Replayed(Value),
    Run(u32),
}

fn journal_full() -> WorkflowError {
    WorkflowError::Failed(format!(
        "{}: a run takes at most {RUN_STEPS_MAX} journal entries; continue as a new run (ctx.continue_as_new)",
        workflow_codes::JOURNAL_FULL
    ))
}

/// A replay-only run ([`Workflows::replay_only`]) reached a position its journal has not
/// settled: park it there, running nothing.
fn replay_end<T: ?Sized>(state: &mut RunState<T>, seq: u32, kind: StepKind, name: &str) -> WorkflowError {
    let message = format!("{REPLAY_END} at position {seq}, where the workflow calls {} step {name:?}", kind.as_str());
    state.parked = Some(message.clone());
    WorkflowError::Parked(message)
}

fn finish<T: ?Sized>(status: FinishStatus, result: Option<Value>, error: Option<String>) -> JournalOp<T> {
    JournalOp::Finish { status, result, error: error.map(truncate) }
}

/// The payload a journaled wait returns: the event's, `None` after a timeout, or an operator's
/// skip output as is.
fn decode_wait_output(output: Value) -> Option<Value> {
    match output {
        Value::Object(mut map) if map.get("timed_out") == Some(&Value::Bool(true)) && map.len() == 1 => {
            map.clear();
            None
        }
        Value::Object(mut map) if map.len() == 2 && map.contains_key("event_id") && map.contains_key("payload") => {
            map.remove("payload")
        }
        other => Some(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_journaled_wait_decodes_to_its_payload_or_none() {
        assert_eq!(decode_wait_output(json!({"event_id": "e1", "payload": {"a": 1}})), Some(json!({"a": 1})));
        assert_eq!(decode_wait_output(json!({"event_id": "e1", "payload": null})), Some(Value::Null));
        assert_eq!(decode_wait_output(json!({"timed_out": true})), None);
        // An operator's skip output is returned as it is.
        assert_eq!(decode_wait_output(json!({"approved": true})), Some(json!({"approved": true})));
        assert_eq!(decode_wait_output(json!(3)), Some(json!(3)));
    }

    #[test]
    fn outputs_over_the_limit_are_permanent_failures() {
        assert_eq!(to_output(&json!({"a": 1})).unwrap(), json!({"a": 1}));
        let big = "x".repeat(STEP_OUTPUT_BYTES_MAX + 1);
        let failure = to_output(&big).unwrap_err();
        assert!(!failure.retryable && failure.message.contains("limit"), "{failure:?}");
        assert_eq!(truncate("é".repeat(ERROR_BYTES_MAX)).len(), ERROR_BYTES_MAX);
    }
}
