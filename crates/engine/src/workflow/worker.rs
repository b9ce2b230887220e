//! The worker: claims due runs, runs each as a task, heartbeats their leases.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::Serialize;
use tidemark_core::error::codes;
use tidemark_core::id::validate_id;
use tidemark_core::workflow::{
    ChildLease, ClaimRequest, ClaimedRun, FinishStatus, JournalOp, JournalWrite, LeaseState, RunStatus, StartOutcome,
    StartRequest, UnclaimableRuns, WorkflowStore, CLAIM_BATCH_MAX, LEASE_MS_MAX, LEASE_MS_MIN, START_BATCH_MAX,
};
use tidemark_core::{Error, Result};
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::task::{AbortHandle, Id as TaskId, JoinError, JoinSet};
use tokio::time::Instant;

use super::context::{RunOutcome, WorkerLinks};
use super::handle::EndWaiters;
use super::observer::WorkerObserver;
use super::registry::Registered;
use super::{WorkflowContext, Workflows, Writer};

/// Options of a worker. Configuration is a struct, not a row of arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerOptions {
    /// Names the lease owner; unique among the workers of one database.
    pub worker_id: String,
    /// Runs in flight on this worker at once (the global limit).
    pub concurrency: usize,
    /// How long each claim's lease lasts, in ms (100 ms..=1 h). A killed worker's runs are taken
    /// over this long after its last heartbeat; a shorter lease recovers sooner but heartbeats more
    /// often.
    pub lease_ms: i64,
    /// How long to wait before claiming again when nothing was due (or every slot is busy).
    pub poll_interval_ms: u64,
    /// Heartbeat period; `None`: `lease_ms / 3`.
    pub heartbeat_ms: Option<u64>,
}

impl WorkerOptions {
    /// Options for worker `worker_id` with the defaults: 64 runs in flight, a 30 s lease
    /// heartbeated every 10 s, a claim poll every 200 ms.
    pub fn new(worker_id: &str) -> Self {
        WorkerOptions {
            worker_id: worker_id.to_string(),
            concurrency: 64,
            lease_ms: 30_000,
            poll_interval_ms: 200,
            heartbeat_ms: None,
        }
    }

    /// Check the options' bounds: an identifier for `worker_id`, 1..=4,096 runs in flight, a lease
    /// of 100 ms..=1 h, a poll interval of 1 ms..=1 h and a heartbeat shorter than the lease
    /// (`invalid_id` or `invalid_argument` otherwise).
    pub fn validate(&self) -> Result<()> {
        validate_id("worker_id", &self.worker_id)?;
        let bad = |m: String| Err(Error::invalid(codes::INVALID_ARGUMENT, m));
        if self.concurrency == 0 || self.concurrency > CLAIM_BATCH_MAX {
            return bad(format!("concurrency must be 1..={CLAIM_BATCH_MAX}"));
        }
        if !(LEASE_MS_MIN..=LEASE_MS_MAX).contains(&self.lease_ms) {
            return bad(format!("lease_ms must be {LEASE_MS_MIN}..={LEASE_MS_MAX}"));
        }
        if self.poll_interval_ms == 0 || self.poll_interval_ms > 3_600_000 {
            return bad("poll_interval_ms must be 1..=3600000".into());
        }
        if let Some(h) = self.heartbeat_ms {
            if h == 0 || h as i64 >= self.lease_ms {
                return bad("heartbeat_ms must be 1..lease_ms".into());
            }
        }
        Ok(())
    }

    fn heartbeat_every(&self) -> Duration {
        Duration::from_millis(self.heartbeat_ms.unwrap_or((self.lease_ms / 3).max(1) as u64))
    }
}

/// What a worker did until it stopped.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct WorkerReport {
    /// Runs claimed (each execution counts).
    pub claimed: u64,
    /// Claims that took a run over from an expired lease.
    pub recovered: u64,
    /// Runs that ended `completed`.
    pub completed: u64,
    /// Runs that ended `compensated` (a saga rolled back).
    pub compensated: u64,
    /// Runs that ended `failed`.
    pub failed: u64,
    /// Runs that ended `cancelled`.
    pub cancelled: u64,
    /// Runs that ended `parked` (dead letters for an operator).
    pub parked: u64,
    /// Runs that continued as a new run (`continued`).
    pub continued: u64,
    /// Executions that ended suspended (retry backoff, timer, wait).
    pub suspended: u64,
    /// Executions whose lease was released without a status change (store errors, shutdown).
    pub released: u64,
    /// Runs dropped because their lease was lost or a write was fenced.
    pub lost: u64,
    /// Executions stopped mid-way (shutdown, failed heartbeat).
    pub aborted: u64,
    /// Heartbeat calls made (each extends every lease in flight at once).
    pub heartbeats: u64,
    /// Errors the worker met: a claim, heartbeat or release that failed, or a run whose last
    /// write failed (that run is claimed again once its lease expires).
    pub errors: u64,
    /// The message of the last such error.
    pub last_error: Option<String>,
    /// The most runs this worker had in flight at once, children included: a child started by
    /// a run of this worker runs in its waiting parent's slot, so this may exceed the worker's
    /// `concurrency` (which bounds the slots, not the runs in them).
    pub max_in_flight: usize,
    /// Runs of workflows or versions this worker does not have (never run; left for others).
    pub unclaimable: Vec<UnclaimableRuns>,
}

impl WorkerReport {
    /// Add another report's counts to this one (the later unclaimable list wins).
    pub fn merge(&mut self, other: WorkerReport) {
        self.claimed += other.claimed;
        self.recovered += other.recovered;
        self.completed += other.completed;
        self.compensated += other.compensated;
        self.failed += other.failed;
        self.cancelled += other.cancelled;
        self.parked += other.parked;
        self.continued += other.continued;
        self.suspended += other.suspended;
        self.released += other.released;
        self.lost += other.lost;
        self.aborted += other.aborted;
        self.heartbeats += other.heartbeats;
        self.errors += other.errors;
        if other.last_error.is_some() {
            self.last_error = other.last_error;
        }
        self.max_in_flight = self.max_in_flight.max(other.max_in_flight);
        self.unclaimable = other.unclaimable;
    }

    fn record(&mut self, outcome: RunOutcome) {
        match outcome {
            RunOutcome::Finished(FinishStatus::Completed) => self.completed += 1,
            RunOutcome::Finished(FinishStatus::Compensated) => self.compensated += 1,
            RunOutcome::Finished(FinishStatus::Failed) => self.failed += 1,
            RunOutcome::Finished(FinishStatus::Cancelled) => self.cancelled += 1,
            RunOutcome::Finished(FinishStatus::Parked) => self.parked += 1,
            RunOutcome::Finished(FinishStatus::Continued) => self.continued += 1,
            RunOutcome::Suspended(_) => self.suspended += 1,
            RunOutcome::Released => self.released += 1,
            RunOutcome::Lost => self.lost += 1,
            RunOutcome::Error(message) => self.error(message),
        }
    }

    fn error(&mut self, message: String) {
        self.errors += 1;
        self.last_error = Some(message);
    }
}

/// A run this worker finished, as told to [`Worker::subscribe_finished`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinishedRun {
    /// The run that finished.
    pub run_id: String,
    /// How it finished.
    pub status: FinishStatus,
}

/// A start waiting for the writer thread, queued by [`Worker::start`].
struct LocalStart {
    requests: Vec<StartRequest>,
    reply: oneshot::Sender<Result<Vec<StartOutcome>>>,
}

/// Runs claimed on the writer thread for a loop (with the local starts), on their way to it.
type Claimed = Result<Vec<ClaimedRun>>;

/// How a running loop takes local starts. [`Worker::start`] queues them here; one writer call at
/// a time takes the whole queue when the writer thread gets to it (so every start that arrived
/// meanwhile shares its transaction, without waiting for the loop), starts them and claims due
/// runs into the loop's free slots in that one transaction, answers each starter after the
/// commit, and hands the claimed runs to the loop.
struct LocalStarts {
    queue: Mutex<StartQueue>,
    /// The loop's free slots. Claims take from it on the writer thread (the loop's own claims
    /// and the local starts' claims alike, so together they never exceed the concurrency); the
    /// loop gives a slot back when a run leaves it.
    free: Arc<AtomicUsize>,
    claimed: mpsc::UnboundedSender<Claimed>,
    /// The loop's claim, without its limit.
    claim: ClaimRequest,
}

#[derive(Default)]
struct StartQueue {
    starts: Vec<LocalStart>,
    /// A writer call that takes the queue is on its way.
    scheduled: bool,
}

impl LocalStarts {
    /// On the writer thread: start everything queued (one transaction per `START_BATCH_MAX`
    /// requests), claiming into the free slots while the loop takes runs, and answer each
    /// starter after its commit.
    fn commit<S: WorkflowStore>(&self, store: &mut S, now_ms: i64) {
        let mut starts = {
            let mut queue = lock(&self.queue);
            queue.scheduled = false;
            std::mem::take(&mut queue.starts)
        };
        while !starts.is_empty() {
            let mut count = 0;
            let split = starts
                .iter()
                .position(|start| {
                    count += start.requests.len();
                    count > START_BATCH_MAX
                })
                .unwrap_or(starts.len())
                .max(1);
            let rest = starts.split_off(split);
            let mut requests = Vec::with_capacity(count);
            let mut replies = Vec::with_capacity(starts.len());
            for start in starts {
                replies.push((start.requests.len(), start.reply));
                requests.extend(start.requests);
            }
            let free = if self.claimed.is_closed() { 0 } else { self.free.load(Ordering::SeqCst) };
            let answer = if free > 0 {
                let claim = ClaimRequest { limit: free.min(CLAIM_BATCH_MAX), ..self.claim.clone() };
                store.start_and_claim(&requests, &claim, now_ms)
            } else {
                store.start_runs(&requests, now_ms).map(|outcomes| (outcomes, Ok(Vec::new())))
            };
            match answer {
                Ok((mut outcomes, claimed)) => {
                    for (count, reply) in replies {
                        let rest = outcomes.split_off(count.min(outcomes.len()));
                        let _ = reply.send(Ok(std::mem::replace(&mut outcomes, rest)));
                    }
                    self.hand_over(store, claimed, now_ms);
                }
                Err(error) => {
                    for (_, reply) in replies {
                        let _ = reply.send(Err(error.clone()));
                    }
                }
            }
            starts = rest;
        }
    }

    /// On the writer thread: runs claimed for the loop go to it, with their slots taken; if
    /// the loop has stopped, their leases are released at once.
    fn hand_over<S: WorkflowStore>(&self, store: &mut S, claimed: Claimed, now_ms: i64) {
        if let Ok(runs) = &claimed {
            if runs.is_empty() {
                return;
            }
            self.free.fetch_sub(runs.len(), Ordering::SeqCst);
        }
        if let Err(mpsc::error::SendError(Ok(runs))) = self.claimed.send(claimed) {
            self.free.fetch_add(runs.len(), Ordering::SeqCst);
            let releases = runs
                .into_iter()
                .map(|run| JournalWrite {
                    run_id: run.run.run_id,
                    lease_token: run.lease_token,
                    op: JournalOp::Release,
                })
                .collect();
            // If this fails, the leases expire and the runs are taken over then.
            let _ = store.commit(releases, now_ms);
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// How a child's execution on this worker ended, as its parent waiting in memory learns it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ChildLeft {
    /// It ended (completed, compensated, failed or cancelled) with this end, committed: its last
    /// transaction `settled` the parent's entry with it (`JournalOp::FinishChild`; the parent
    /// writes nothing for it), or else sent the parent its end event.
    Ended { end: serde_json::Value, settled: bool },
    /// It left this worker without such an end (suspended, released, lost, parked, continued
    /// as new), or the parent's cancellation was requested meanwhile: the parent suspends and
    /// waits in the store, as for a child running anywhere else.
    Elsewhere,
}

struct ChildWaiter {
    parent: String,
    /// The parent's lease token as it waits (a child's end settles its entry only under it).
    parent_token: String,
    reply: oneshot::Sender<ChildLeft>,
}

/// What a parent's children are doing with its entries while they end: how many took the
/// parent's waiter and are writing their end (which may settle the parent's entry), and whether
/// one may have settled it while nobody heard (the parent stopped waiting before the answer).
#[derive(Default)]
struct Concluding {
    in_flight: usize,
    unheard: bool,
}

#[derive(Default)]
struct Family {
    /// Keyed by the child's run id.
    waiters: HashMap<String, ChildWaiter>,
    /// Keyed by the parent's run id.
    concluding: HashMap<String, Concluding>,
}

/// Children that runs of a running loop started and had leased to this worker in the starting
/// transaction ([`JournalOp::StartChild`] with a claim), and the parents waiting for them in
/// memory. A child takes its waiting parent's slot (the parent runs nothing until the child
/// leaves), so a parent and its child never wait for a slot of their own: no claim of the child,
/// no poll wait, and no suspension, claim and journal replay of the parent per child. A child's
/// end settles its waiting parent's entry in its own last transaction
/// ([`JournalOp::FinishChild`]), so the parent writes nothing for it. Every write stays the
/// store's: a crash anywhere leaves the runs as a suspended parent would (`docs/workflows.md`,
/// "Child workflows").
pub(crate) struct LocalChildren {
    lease: ChildLease,
    handoff: mpsc::UnboundedSender<ClaimedRun>,
    family: Mutex<Family>,
}

impl LocalChildren {
    /// Who a child is leased to when it starts.
    pub(crate) fn lease(&self) -> ChildLease {
        self.lease.clone()
    }

    /// Run `child` (leased to this worker) in its parent's slot and tell the parent (holding
    /// `parent_token`) how it left; the child back when the loop has stopped (its lease is the
    /// caller's to release).
    pub(crate) fn run(
        &self,
        parent: &str,
        parent_token: &str,
        child: ClaimedRun,
    ) -> std::result::Result<oneshot::Receiver<ChildLeft>, Box<ClaimedRun>> {
        let (reply, answer) = oneshot::channel();
        let run_id = child.run.run_id.clone();
        let waiter = ChildWaiter { parent: parent.to_string(), parent_token: parent_token.to_string(), reply };
        lock(&self.family).waiters.insert(run_id.clone(), waiter);
        match self.handoff.send(child) {
            Ok(()) => Ok(answer),
            Err(mpsc::error::SendError(child)) => {
                lock(&self.family).waiters.remove(&run_id);
                Err(Box::new(child))
            }
        }
    }

    /// Child `run_id` is about to write how its execution ended: its waiting parent, if it still
    /// waits, is told by the returned waiter (and by nobody else) once that write is answered.
    pub(crate) fn take(self: &Arc<Self>, run_id: &str) -> Option<TakenWaiter> {
        let mut family = lock(&self.family);
        let waiter = family.waiters.remove(run_id)?;
        family.concluding.entry(waiter.parent.clone()).or_default().in_flight += 1;
        Some(TakenWaiter {
            children: self.clone(),
            parent: waiter.parent,
            parent_token: waiter.parent_token,
            reply: Some(waiter.reply),
        })
    }

    /// Run `run_id` left this worker: its waiting parent (if it still waits) learns how.
    pub(crate) fn left(&self, run_id: &str, how: ChildLeft) {
        if let Some(waiter) = lock(&self.family).waiters.remove(run_id) {
            let _ = waiter.reply.send(how);
        }
    }

    /// Run `parent` is about to suspend: it stops waiting in memory for its children (they will
    /// tell it by their end events), and the answer says whether one of them may have settled
    /// one of its entries unheard (its end is being written, or was written after the parent
    /// stopped listening): the parent must then stay due, or it could sleep on an entry the
    /// store has settled. (The child's settle holds only under the lease this suspension
    /// releases, so a settle after it cannot happen.)
    pub(crate) fn may_have_settled_unheard(&self, parent: &str) -> bool {
        let mut family = lock(&self.family);
        for (_, waiter) in family.waiters.extract_if(|_, waiter| waiter.parent == parent) {
            let _ = waiter.reply.send(ChildLeft::Elsewhere);
        }
        let Some(concluding) = family.concluding.get_mut(parent) else { return false };
        let unheard = concluding.in_flight > 0 || concluding.unheard;
        concluding.unheard = false;
        if concluding.in_flight == 0 {
            family.concluding.remove(parent);
        }
        unheard
    }

    fn concluded(&self, parent: &str, unheard: bool) {
        let mut family = lock(&self.family);
        if let Some(concluding) = family.concluding.get_mut(parent) {
            concluding.in_flight = concluding.in_flight.saturating_sub(1);
            concluding.unheard |= unheard;
            if concluding.in_flight == 0 && !concluding.unheard {
                family.concluding.remove(parent);
            }
        }
    }

    /// The loop stops: every parent still waiting stops waiting in memory.
    fn abandon_all(&self) {
        for (_, waiter) in lock(&self.family).waiters.drain() {
            let _ = waiter.reply.send(ChildLeft::Elsewhere);
        }
    }

    /// Run `parent`'s cancellation was requested: it stops waiting in memory for its children.
    fn interrupt(&self, parent: &str) {
        for (_, waiter) in lock(&self.family).waiters.extract_if(|_, waiter| waiter.parent == parent) {
            let _ = waiter.reply.send(ChildLeft::Elsewhere);
        }
    }
}

/// A child's waiting parent, taken by the child's last write ([`LocalChildren::take`]). Dropped
/// untold (the execution aborted or its write failed, so whether its end committed is not
/// known), it tells the parent `Elsewhere` and counts as a settle nobody heard.
pub(crate) struct TakenWaiter {
    children: Arc<LocalChildren>,
    parent: String,
    parent_token: String,
    reply: Option<oneshot::Sender<ChildLeft>>,
}

impl TakenWaiter {
    /// The lease token the parent waits with.
    pub(crate) fn parent_token(&self) -> &str {
        &self.parent_token
    }

    /// Tell the parent how the child left, once the child's last write was answered.
    pub(crate) fn tell(mut self, how: ChildLeft) {
        let settled = matches!(how, ChildLeft::Ended { settled: true, .. });
        let heard = self.reply.take().is_some_and(|reply| reply.send(how).is_ok());
        self.children.concluded(&self.parent, settled && !heard);
    }
}

impl Drop for TakenWaiter {
    fn drop(&mut self) {
        if let Some(reply) = self.reply.take() {
            let _ = reply.send(ChildLeft::Elsewhere);
            self.children.concluded(&self.parent, true);
        }
    }
}

/// The next thing handed to this loop (runs claimed with local starts, a child its runs
/// started), or never when this loop takes none.
async fn next_handed<T>(receiver: &mut Option<mpsc::UnboundedReceiver<T>>) -> Option<T> {
    match receiver {
        Some(receiver) => receiver.recv().await,
        None => std::future::pending().await,
    }
}

struct InFlight {
    run_id: String,
    lease_token: String,
    cancel: Arc<AtomicBool>,
    /// Set by the task when the workflow function has returned and its last write (finish or
    /// suspend) is on its way: from then on that write's own fencing decides whether the lease
    /// was lost, not a heartbeat that may have seen the lease the write itself released.
    concluding: Arc<AtomicBool>,
    abort: AbortHandle,
    lost: bool,
    /// A child running in its waiting parent's slot: its end frees no slot.
    lent: bool,
}

/// Runs registered workflows: claims due runs (up to its free slots) under a lease, runs each as
/// a tokio task, heartbeats every `lease_ms / 3`, drops a run whose lease is lost or fenced,
/// stops every in-flight run when a heartbeat fails, and releases its leases on shutdown.
/// Must be driven from a tokio runtime with the time driver enabled.
pub struct Worker<S: WorkflowStore> {
    writer: Writer<S>,
    workflows: Arc<Workflows<S>>,
    options: WorkerOptions,
    /// Where the running loop takes local starts (`None` while no loop runs).
    local: Mutex<Option<Arc<LocalStarts>>>,
    /// Where the running loop takes the children its runs start (`None` while no loop runs).
    children: Mutex<Option<Arc<LocalChildren>>>,
    /// Where finished runs are reported, when someone subscribed.
    finished: Mutex<Option<mpsc::UnboundedSender<FinishedRun>>>,
    /// Told of claims, step attempts, finished runs and lost leases as they happen.
    observer: Option<Arc<dyn WorkerObserver>>,
    /// Callers awaiting a run's end ([`Worker::wait_for_end`]).
    end_waiters: EndWaiters,
    /// A run of this worker made another run due now (a child it started, the parent its end
    /// woke, its continuation, the receiver of its message): the loop claims without waiting for
    /// its next poll.
    due_now: Arc<Notify>,
}

impl<S> Worker<S>
where
    S: WorkflowStore + 'static,
    S::Target: 'static,
{
    /// A worker that runs `workflows` with `options`, writing through `writer`. Bad options are
    /// refused as [`WorkerOptions::validate`] says; an empty registry is `invalid_argument`.
    pub fn new(writer: Writer<S>, workflows: Workflows<S>, options: WorkerOptions) -> Result<Self> {
        options.validate()?;
        if workflows.is_empty() {
            return Err(Error::invalid(codes::INVALID_ARGUMENT, "a worker needs at least one registered workflow"));
        }
        Ok(Worker {
            writer,
            workflows: Arc::new(workflows),
            options,
            local: Mutex::new(None),
            children: Mutex::new(None),
            finished: Mutex::new(None),
            observer: None,
            end_waiters: EndWaiters::default(),
            due_now: Arc::new(Notify::new()),
        })
    }

    /// What makes this worker claim now instead of at its next poll, for a wake-up hint from
    /// outside (a PostgreSQL `LISTEN` beside the worker): the same "due now" nudge a run of this
    /// worker gives when it makes another run due. A hint only: an idle worker (at most half its
    /// slots busy, no backlog) claims at once; a busy one claims soon enough by itself.
    pub fn waker(&self) -> impl Fn() + Send + Sync + 'static {
        let due_now = self.due_now.clone();
        move || due_now.notify_one()
    }

    /// Tell `observer` what this worker does (see [`WorkerObserver`]).
    pub fn with_observer(mut self, observer: Arc<dyn WorkerObserver>) -> Self {
        self.observer = Some(observer);
        self
    }

    fn tell_lost(&self, run_id: &str) {
        if let Some(observer) = &self.observer {
            observer.lease_lost(run_id);
        }
    }

    /// Start runs (idempotent per run id, one transaction, like [`WorkflowStore::start_runs`]).
    /// While this worker's loop runs, due runs are claimed into its free slots in the same
    /// transaction (no poll wait) and run on this worker. Starts queued while the writer thread
    /// is busy share one transaction; each is answered after it committed. A start whose input
    /// is invalid is refused alone (nothing written), so it cannot refuse the others.
    pub async fn start(&self, requests: Vec<StartRequest>) -> Result<Vec<StartOutcome>> {
        let local = lock(&self.local).clone();
        let Some(local) = local else {
            return self.writer.call(move |store, now| store.start_runs(&requests, now)).await;
        };
        requests.iter().try_for_each(StartRequest::validate)?;
        let (reply, answer) = oneshot::channel();
        let schedule = {
            let mut queue = lock(&local.queue);
            queue.starts.push(LocalStart { requests, reply });
            !std::mem::replace(&mut queue.scheduled, true)
        };
        if schedule {
            let taker = local.clone();
            let queued = self.writer.call_ahead(move |store, now| taker.commit(store, now));
            if let Err(error) = queued {
                let mut queue = lock(&local.queue);
                queue.scheduled = false;
                for start in queue.starts.drain(..) {
                    let _ = start.reply.send(Err(error.clone()));
                }
            }
        }
        answer.await.map_err(|_| Error::Invariant("the writer thread dropped a start".into()))?
    }

    /// Report every run this worker finishes from now on (replaces an earlier subscription).
    pub fn subscribe_finished(&self) -> mpsc::UnboundedReceiver<FinishedRun> {
        let (sender, receiver) = mpsc::unbounded_channel();
        *lock(&self.finished) = Some(sender);
        receiver
    }

    pub(crate) fn end_waiters(&self) -> &EndWaiters {
        &self.end_waiters
    }

    fn tell_finished(&self, run_id: &str, outcome: &RunOutcome) {
        if let RunOutcome::Finished(status) = outcome {
            self.end_waiters.ended(run_id);
            if let Some(sender) = lock(&self.finished).as_ref() {
                let _ = sender.send(FinishedRun { run_id: run_id.to_string(), status: *status });
            }
        }
    }

    /// The writer this worker commits its journal writes through.
    pub fn writer(&self) -> &Writer<S> {
        &self.writer
    }

    /// The workflows this worker runs.
    pub fn workflows(&self) -> &Workflows<S> {
        &self.workflows
    }

    /// The options this worker was made with.
    pub fn options(&self) -> &WorkerOptions {
        &self.options
    }

    /// Runs this worker cannot execute (unknown workflow or version): it never claims them.
    pub async fn unclaimable(&self) -> Result<Vec<UnclaimableRuns>> {
        let known = self.workflows.versions();
        self.writer.call(move |store, _| store.unclaimable(&known)).await
    }

    /// Work until `shutdown` resolves; then stop the runs in flight and release their leases.
    pub async fn run_until<F: Future<Output = ()>>(&self, shutdown: F) -> Result<WorkerReport> {
        self.run_loop(false, shutdown).await
    }

    /// Work until nothing is due and nothing is in flight (runs waiting for a later time or an
    /// event are not due). For tests and one-shot CLI commands.
    pub async fn run_until_idle(&self) -> Result<WorkerReport> {
        self.run_loop(true, std::future::pending()).await
    }

    /// [`Worker::run_until_idle`], or until `shutdown` resolves: then, as in
    /// [`Worker::run_until`], stop the runs in flight and release their leases.
    pub async fn run_until_idle_or<F: Future<Output = ()>>(&self, shutdown: F) -> Result<WorkerReport> {
        self.run_loop(true, shutdown).await
    }

    async fn run_loop<F: Future<Output = ()>>(&self, idle_exit: bool, shutdown: F) -> Result<WorkerReport> {
        tokio::pin!(shutdown);
        let mut report = WorkerReport { unclaimable: self.unclaimable().await?, ..WorkerReport::default() };
        let heartbeat_every = self.options.heartbeat_every();
        let poll = Duration::from_millis(self.options.poll_interval_ms);
        let mut set: JoinSet<RunOutcome> = JoinSet::new();
        let mut in_flight: HashMap<TaskId, InFlight> = HashMap::new();
        let mut next_heartbeat = Instant::now() + heartbeat_every;
        let slots = Arc::new(AtomicUsize::new(self.options.concurrency));
        // Local starts claim for this loop (unless another loop of this worker takes them).
        let mut local = {
            let mut slot = lock(&self.local);
            match slot.as_ref() {
                Some(_) => None,
                None => {
                    let (sender, receiver) = mpsc::unbounded_channel();
                    *slot = Some(Arc::new(LocalStarts {
                        queue: Mutex::new(StartQueue::default()),
                        free: slots.clone(),
                        claimed: sender,
                        claim: self.claim_request(1),
                    }));
                    Some(receiver)
                }
            }
        };
        // Children started by this loop's runs run in it (with the local starts' loop).
        let mut children = local.as_ref().map(|_| {
            let (handoff, receiver) = mpsc::unbounded_channel();
            let lease = ChildLease { worker_id: self.options.worker_id.clone(), lease_ms: self.options.lease_ms };
            *lock(&self.children) = Some(Arc::new(LocalChildren { lease, handoff, family: Mutex::default() }));
            receiver
        });
        // Claims are batched: while the last claim filled every slot it asked for (a backlog),
        // the next one waits until a quarter of the slots are free, so that a busy worker does
        // not claim (and cut the writer's group commit) after every finished run. Without a
        // backlog, the next claim comes after the poll interval.
        let claim_at_free = (self.options.concurrency / 4).max(1);
        let mut backlog = true;
        let mut last_claim: Option<Instant> = None;
        // A run made another due now: claim at once, unless the worker is busy (a backlog, or
        // more than half its slots taken), when its own claims come soon enough.
        let mut nudged = false;
        let result = loop {
            let mut claimed = 0;
            let mut attempted = false;
            let free = slots.load(Ordering::SeqCst);
            let poll_due = match last_claim {
                Some(at) => at.elapsed() >= poll,
                None => true,
            };
            // A nudge claims at once only while at most half the slots are busy: a busy worker
            // claims often enough by itself, and a claim of its own per nudge would cost a
            // commit each.
            let busy = self.options.concurrency.saturating_sub(free);
            let quiet = busy * 2 <= self.options.concurrency;
            let wanted = poll_due
                || (nudged && !backlog && quiet)
                || (backlog && free >= claim_at_free)
                || (idle_exit && in_flight.is_empty());
            if free > 0 && wanted {
                attempted = true;
                nudged = false;
                last_claim = Some(Instant::now());
                match self.claim(free, &slots).await {
                    Ok(runs) => {
                        claimed = runs.len();
                        backlog = claimed >= free.min(CLAIM_BATCH_MAX);
                        if in_flight.is_empty() && claimed > 0 {
                            next_heartbeat = Instant::now() + heartbeat_every;
                        }
                        self.spawn_all(runs, &slots, &mut set, &mut in_flight, &mut report).await;
                    }
                    Err(error) => {
                        backlog = false;
                        report.error(format!("claim: {error}"));
                        if idle_exit {
                            break Err(error);
                        }
                    }
                }
            }
            let handed_over = local.as_ref().is_some_and(|receiver| !receiver.is_empty());
            if idle_exit && attempted && claimed == 0 && in_flight.is_empty() && !handed_over {
                break Ok(());
            }
            let free = slots.load(Ordering::SeqCst);
            let pause = if backlog && free >= claim_at_free {
                Duration::ZERO
            } else {
                poll.saturating_sub(last_claim.map_or(Duration::ZERO, |at| at.elapsed()))
            };
            tokio::select! {
                biased;
                _ = &mut shutdown => break Ok(()),
                Some(joined) = set.join_next_with_id(), if !set.is_empty() => {
                    let freed = self.joined(joined, &mut in_flight, &mut report).await;
                    slots.fetch_add(freed, Ordering::SeqCst);
                }
                _ = tokio::time::sleep_until(next_heartbeat), if !in_flight.is_empty() => {
                    self.heartbeat(&mut in_flight, &mut report).await;
                    next_heartbeat = Instant::now() + heartbeat_every;
                }
                Some(claimed) = next_handed(&mut local) => match claimed {
                    Ok(runs) => {
                        if in_flight.is_empty() {
                            next_heartbeat = Instant::now() + heartbeat_every;
                        }
                        self.spawn_all(runs, &slots, &mut set, &mut in_flight, &mut report).await;
                    }
                    Err(error) => report.error(format!("claim: {error}")),
                },
                Some(child) = next_handed(&mut children) => {
                    if in_flight.is_empty() {
                        next_heartbeat = Instant::now() + heartbeat_every;
                    }
                    self.spawn(child, true, &mut set, &mut in_flight, &mut report).await;
                    report.max_in_flight = report.max_in_flight.max(in_flight.len());
                }
                _ = self.due_now.notified(), if !nudged => nudged = true,
                _ = tokio::time::sleep(pause) => {}
            }
        };
        if let Some(mut receiver) = local {
            // No more claims for this loop: starts still queued start without one. Runs claimed
            // for it before that are stopped and released below with the others.
            *lock(&self.local) = None;
            receiver.close();
            while let Ok(claimed) = receiver.try_recv() {
                if let Ok(runs) = claimed {
                    self.spawn_all(runs, &slots, &mut set, &mut in_flight, &mut report).await;
                }
            }
        }
        let owned_children = children.is_some();
        if let Some(mut receiver) = children {
            // No more children for this loop (a parent starting one now releases it); those
            // handed over before this are stopped and released below with the others.
            receiver.close();
            while let Ok(child) = receiver.try_recv() {
                self.spawn(child, true, &mut set, &mut in_flight, &mut report).await;
            }
        }
        self.stop_all(&mut set, &mut in_flight, &mut report).await;
        if owned_children {
            // A parent still waiting (one of another loop of this worker) waits in the store.
            if let Some(children) = lock(&self.children).take() {
                children.abandon_all();
            }
        }
        match self.unclaimable().await {
            Ok(unclaimable) => report.unclaimable = unclaimable,
            Err(error) => report.error(format!("unclaimable: {error}")),
        }
        result.map(|()| report)
    }

    fn claim_request(&self, limit: usize) -> ClaimRequest {
        ClaimRequest {
            worker_id: self.options.worker_id.clone(),
            workflows: self.workflows.versions(),
            limit: limit.min(CLAIM_BATCH_MAX),
            lease_ms: self.options.lease_ms,
        }
    }

    /// Claim due runs into at most `limit` of the free `slots` (taken on the writer thread, where
    /// the local starts' claims take theirs too).
    async fn claim(&self, limit: usize, slots: &Arc<AtomicUsize>) -> Result<Vec<ClaimedRun>> {
        let mut request = self.claim_request(limit);
        let slots = slots.clone();
        self.writer
            .call(move |store, now| {
                request.limit = request.limit.min(slots.load(Ordering::SeqCst));
                if request.limit == 0 {
                    return Ok(Vec::new());
                }
                let runs = store.claim(&request, now)?;
                slots.fetch_sub(runs.len(), Ordering::SeqCst);
                Ok(runs)
            })
            .await
    }

    /// Run claimed runs; a slot whose run does not start is given back.
    async fn spawn_all(
        &self,
        runs: Vec<ClaimedRun>,
        slots: &AtomicUsize,
        set: &mut JoinSet<RunOutcome>,
        in_flight: &mut HashMap<TaskId, InFlight>,
        report: &mut WorkerReport,
    ) {
        for run in runs {
            let before = in_flight.len();
            self.spawn(run, false, set, in_flight, report).await;
            if in_flight.len() == before {
                slots.fetch_add(1, Ordering::SeqCst);
            }
        }
        report.max_in_flight = report.max_in_flight.max(in_flight.len());
    }

    /// Run a claimed run as a task (`lent`: a child in its waiting parent's slot).
    async fn spawn(
        &self,
        claimed: ClaimedRun,
        lent: bool,
        set: &mut JoinSet<RunOutcome>,
        in_flight: &mut HashMap<TaskId, InFlight>,
        report: &mut WorkerReport,
    ) {
        report.claimed += 1;
        if claimed.recovered {
            report.recovered += 1;
        }
        if let Some(observer) = &self.observer {
            observer.run_claimed(&claimed.run, claimed.recovered);
        }
        let run_id = claimed.run.run_id.clone();
        let lease_token = claimed.lease_token.clone();
        let Some(registered) = self.workflows.get(&claimed.run.workflow, claimed.run.version) else {
            // The store handed out a version we did not ask for: give it back untouched.
            let outcome = self.write_for(&run_id, &lease_token, JournalOp::Release).await;
            report.record(outcome);
            self.tell_children(&run_id, ChildLeft::Elsewhere);
            return;
        };
        let cancel = Arc::new(AtomicBool::new(claimed.run.cancel_requested));
        let concluding = Arc::new(AtomicBool::new(false));
        let observer = self.observer.clone();
        let workflows = self.workflows.clone();
        let signals = RunSignals {
            cancel: cancel.clone(),
            concluding: concluding.clone(),
            due: self.due_now.clone(),
            children: lock(&self.children).clone(),
        };
        let task = execute(self.writer.clone(), registered, claimed, signals, observer, workflows);
        let abort = set.spawn(task);
        in_flight.insert(abort.id(), InFlight { run_id, lease_token, cancel, concluding, abort, lost: false, lent });
    }

    /// Run `run_id` left this worker: a parent waiting for it in memory learns how.
    fn tell_children(&self, run_id: &str, how: ChildLeft) {
        if let Some(children) = lock(&self.children).as_ref() {
            children.left(run_id, how);
        }
    }

    /// A task ended: report it, tell whoever waits for the run, and return the slots it frees
    /// (none for a child in its parent's slot).
    async fn joined(
        &self,
        joined: std::result::Result<(TaskId, RunOutcome), JoinError>,
        in_flight: &mut HashMap<TaskId, InFlight>,
        report: &mut WorkerReport,
    ) -> usize {
        match joined {
            Ok((id, outcome)) => {
                let run = in_flight.remove(&id);
                if let Some(run) = &run {
                    self.tell_finished(&run.run_id, &outcome);
                    // A child that ended told its parent with its end (`execute`); else it waits
                    // in the store.
                    self.tell_children(&run.run_id, ChildLeft::Elsewhere);
                }
                let freed = usize::from(run.as_ref().is_some_and(|run| !run.lent));
                let counted = run.as_ref().is_some_and(|run| run.lost);
                if !(counted && outcome == RunOutcome::Lost) {
                    if let (Some(run), RunOutcome::Lost) = (&run, &outcome) {
                        self.tell_lost(&run.run_id);
                    }
                    report.record(outcome);
                }
                freed
            }
            Err(error) => {
                let Some(run) = in_flight.remove(&error.id()) else { return 0 };
                let freed = usize::from(!run.lent);
                if error.is_panic() {
                    // A panic replays into the same panic: park the run for an operator.
                    let payload = error.into_panic();
                    let message = payload
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| payload.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "non-string panic payload".into());
                    let op = JournalOp::Finish {
                        status: FinishStatus::Parked,
                        result: None,
                        error: Some(format!("the workflow panicked: {message}").chars().take(1_000).collect()),
                    };
                    let outcome = self.write_for(&run.run_id, &run.lease_token, op).await;
                    report.record(outcome);
                } else if !run.lost {
                    report.aborted += 1;
                }
                self.tell_children(&run.run_id, ChildLeft::Elsewhere);
                freed
            }
        }
    }

    async fn heartbeat(&self, in_flight: &mut HashMap<TaskId, InFlight>, report: &mut WorkerReport) {
        let ids: Vec<TaskId> = in_flight.iter().filter(|(_, r)| !r.lost).map(|(id, _)| *id).collect();
        if ids.is_empty() {
            return;
        }
        let leases: Vec<(String, String)> =
            ids.iter().map(|id| (in_flight[id].run_id.clone(), in_flight[id].lease_token.clone())).collect();
        let count = leases.len();
        let (worker_id, lease_ms) = (self.options.worker_id.clone(), self.options.lease_ms);
        // On the urgent lane: a heartbeat must not wait behind a backlog of writes, or the leases
        // it extends expire while their runs are alive.
        let answer =
            self.writer.call_urgent(move |store, now| store.heartbeat(&worker_id, &leases, lease_ms, now)).await;
        report.heartbeats += 1;
        match answer {
            Ok(states) if states.len() == count => {
                for (id, state) in ids.iter().zip(states) {
                    let run = in_flight.get_mut(id).expect("in flight");
                    match state {
                        LeaseState::Held { cancel_requested } => {
                            if cancel_requested {
                                run.cancel.store(true, Ordering::SeqCst);
                                // A parent waiting for a child in memory stops waiting to see it.
                                if let Some(children) = lock(&self.children).as_ref() {
                                    children.interrupt(&run.run_id);
                                }
                            }
                        }
                        // A task that finished (or whose last write is in flight) released its
                        // lease itself: not a loss. If that write is fenced, the task says so.
                        LeaseState::Lost if run.abort.is_finished() || run.concluding.load(Ordering::SeqCst) => {}
                        LeaseState::Lost => {
                            run.lost = true;
                            run.abort.abort();
                            report.lost += 1;
                            self.tell_lost(&run.run_id);
                        }
                    }
                }
            }
            other => {
                // The leases can no longer be extended: stop every run before they expire, so
                // no step of ours overlaps with the next owner's.
                let message = match other {
                    Ok(states) => format!("heartbeat answered {} states for {count} leases", states.len()),
                    Err(error) => format!("heartbeat: {error}"),
                };
                report.error(message);
                for run in in_flight.values_mut() {
                    run.abort.abort();
                }
            }
        }
    }

    /// Stop the runs in flight and release their leases (one batch).
    async fn stop_all(
        &self,
        set: &mut JoinSet<RunOutcome>,
        in_flight: &mut HashMap<TaskId, InFlight>,
        report: &mut WorkerReport,
    ) {
        for run in in_flight.values() {
            run.abort.abort();
        }
        while let Some(joined) = set.join_next_with_id().await {
            match joined {
                Ok((id, outcome)) => {
                    if let Some(run) = in_flight.remove(&id) {
                        self.tell_finished(&run.run_id, &outcome);
                        if outcome == RunOutcome::Lost && !run.lost {
                            self.tell_lost(&run.run_id);
                        }
                    }
                    report.record(outcome);
                }
                Err(error) if error.is_panic() => {
                    self.joined(Err(error), in_flight, report).await;
                }
                Err(_) => {}
            }
        }
        let runs: Vec<InFlight> = in_flight.drain().map(|(_, run)| run).filter(|run| !run.lost).collect();
        if runs.is_empty() {
            return;
        }
        report.aborted += runs.len() as u64;
        let writes = runs
            .iter()
            .map(|run| JournalWrite {
                run_id: run.run_id.clone(),
                lease_token: run.lease_token.clone(),
                op: JournalOp::Release,
            })
            .collect();
        for result in self.writer.write_all(writes).await {
            match result {
                Ok(_) => report.released += 1,
                Err(error) => report.error(format!("release: {error}")),
            }
        }
    }

    async fn write_for(&self, run_id: &str, lease_token: &str, op: JournalOp<S::Target>) -> RunOutcome {
        let outcome = match &op {
            JournalOp::Finish { status, .. } => RunOutcome::Finished(*status),
            JournalOp::Suspend { status, .. } => RunOutcome::Suspended(*status),
            _ => RunOutcome::Released,
        };
        let write = JournalWrite { run_id: run_id.to_string(), lease_token: lease_token.to_string(), op };
        match self.writer.write(write).await {
            Ok(tidemark_core::workflow::WriteResult::Fenced) => RunOutcome::Lost,
            Ok(_) => outcome,
            Err(error) => RunOutcome::Error(error.to_string()),
        }
    }
}

/// What an execution shares with its worker's loop: the cancel request it observes, whether it
/// is concluding (a heartbeat no longer aborts it), and the loop's "due now" nudge.
struct RunSignals {
    cancel: Arc<AtomicBool>,
    concluding: Arc<AtomicBool>,
    due: Arc<Notify>,
    /// Where the run's children run on this worker (`None`: they are claimed as any run is).
    children: Option<Arc<LocalChildren>>,
}

/// One execution of a claimed run: mark it running, call the function, write how it ended.
async fn execute<S>(
    writer: Writer<S>,
    registered: Arc<Registered<S>>,
    mut claimed: ClaimedRun,
    signals: RunSignals,
    observer: Option<Arc<dyn WorkerObserver>>,
    workflows: Arc<Workflows<S>>,
) -> RunOutcome
where
    S: WorkflowStore + 'static,
    S::Target: 'static,
{
    let RunSignals { cancel, concluding, due, children } = signals;
    let has_parent = claimed.run.parent_run_id.is_some();
    let family = children.clone().filter(|_| has_parent);
    let ctx = WorkflowContext::new(
        writer.clone(),
        &claimed,
        registered.options.retry.clone(),
        cancel,
        observer.clone(),
        workflows,
        WorkerLinks { due: due.clone(), children },
    );
    if !matches!(claimed.run.status, RunStatus::Running | RunStatus::Compensating) {
        ctx.mark_running();
    }
    let input = std::mem::take(&mut claimed.run.input);
    let result = (registered.function)(ctx.clone(), input).await;
    // No step of this run runs after this point, so a heartbeat need not abort it any more.
    concluding.store(true, Ordering::SeqCst);
    // A parent waiting for it on this worker is told by its last write, which settles the
    // parent's entry with its end when it ends, and goes on at once.
    let waiter = family.as_ref().and_then(|children| children.take(&claimed.run.run_id));
    let outcome = ctx.conclude(result, waiter.as_ref().map(TakenWaiter::parent_token)).await;
    if let Some(waiter) = waiter.filter(|_| !matches!(outcome, RunOutcome::Error(_))) {
        waiter.tell(match ctx.end_for_parent() {
            Some(end) => ChildLeft::Ended { end, settled: ctx.settled_parent() },
            None => ChildLeft::Elsewhere,
        });
    }
    // Its end woke its parent, or started its continuation: due now.
    if matches!(outcome, RunOutcome::Finished(status) if has_parent || status == FinishStatus::Continued) {
        due.notify_one();
    }
    if let (Some(observer), RunOutcome::Finished(status)) = (&observer, &outcome) {
        observer.run_finished(&claimed.run, *status, writer.now_ms().saturating_sub(claimed.run.created_at_ms));
    }
    outcome
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use tidemark_core::workflow::RunRecord;

    use super::*;

    fn children() -> (Arc<LocalChildren>, mpsc::UnboundedReceiver<ClaimedRun>) {
        let (handoff, handed) = mpsc::unbounded_channel();
        let lease = ChildLease { worker_id: "w1".into(), lease_ms: 10_000 };
        (Arc::new(LocalChildren { lease, handoff, family: Mutex::default() }), handed)
    }

    fn child(parent: &str, run_id: &str) -> ClaimedRun {
        let request = StartRequest::new(run_id, "double", 1, json!({}));
        let run = RunRecord::started_child(&request, parent, "w1", 11_000, 1_000);
        ClaimedRun {
            run,
            lease_token: format!("{run_id}-token"),
            journal: Vec::new(),
            events: Vec::new(),
            recovered: false,
        }
    }

    fn ended(settled: bool) -> ChildLeft {
        ChildLeft::Ended { end: json!({"run_id": "c", "status": "completed"}), settled }
    }

    #[test]
    fn a_parent_suspending_stays_due_when_a_child_may_have_settled_its_entry_unheard() {
        let (children, _handed) = children();
        // Heard: the parent waiting in memory goes on with the end; nothing keeps it due.
        let mut answer = children.run("p", "t", child("p", "p.0")).unwrap();
        let waiter = children.take("p.0").expect("the parent waits");
        assert_eq!(waiter.parent_token(), "t");
        waiter.tell(ended(true));
        assert_eq!(answer.try_recv(), Ok(ended(true)));
        assert!(!children.may_have_settled_unheard("p"));
        // The child's last write is in flight: a suspension now stays due (it may settle).
        let mut answer = children.run("p", "t", child("p", "p.1")).unwrap();
        let waiter = children.take("p.1").expect("the parent waits");
        assert!(children.may_have_settled_unheard("p"));
        waiter.tell(ended(true));
        assert_eq!(answer.try_recv(), Ok(ended(true)));
        // The parent stopped listening before the settle was answered: once, then forgotten.
        let answer = children.run("p", "t", child("p", "p.2")).unwrap();
        let waiter = children.take("p.2").expect("the parent waits");
        drop(answer);
        waiter.tell(ended(true));
        assert!(children.may_have_settled_unheard("p"));
        assert!(!children.may_have_settled_unheard("p"));
        // An end that came as the event settled nothing.
        let answer = children.run("p", "t", child("p", "p.3")).unwrap();
        let waiter = children.take("p.3").expect("the parent waits");
        drop(answer);
        waiter.tell(ended(false));
        assert!(!children.may_have_settled_unheard("p"));
        // A taken waiter dropped untold (the child's execution aborted during its last write, or
        // the write failed): the parent hears `Elsewhere`, and the end may have committed.
        let mut answer = children.run("p", "t", child("p", "p.4")).unwrap();
        drop(children.take("p.4").expect("the parent waits"));
        assert_eq!(answer.try_recv(), Ok(ChildLeft::Elsewhere));
        assert!(children.may_have_settled_unheard("p"));
        // Suspending stops the parent's waits for children not ending yet: they are told
        // `Elsewhere`, and no later end can take the waiter (it tells the parent by its event).
        let mut answer = children.run("p", "t", child("p", "p.5")).unwrap();
        let other = children.run("q", "u", child("q", "q.0")).unwrap();
        let other_waiter = children.take("q.0").expect("q waits");
        assert!(!children.may_have_settled_unheard("p"), "q's child is q's");
        assert_eq!(answer.try_recv(), Ok(ChildLeft::Elsewhere));
        assert!(children.take("p.5").is_none());
        assert!(children.may_have_settled_unheard("q"));
        drop((other, other_waiter));
    }
}
