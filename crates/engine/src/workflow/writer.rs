//! The group committer: one thread owns the store; everything else sends it messages.

use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tidemark_core::workflow::{JournalWrite, WorkflowStore, WriteResult, COMMIT_BATCH_MAX};
use tidemark_core::{Error, Result};
use tokio::sync::{mpsc, oneshot};

use super::{system_clock, Clock};

type Call<S> = Box<dyn FnOnce(&mut S, i64) + Send>;
type Answer = Result<WriteResult>;

/// Who waits for the results of queued writes, in queue order.
enum Reply {
    /// One write.
    One(oneshot::Sender<Answer>),
    /// A group of this many writes, answered together (one hand-off back, not one per write).
    Group(oneshot::Sender<Vec<Answer>>, usize),
}

enum Message<S: WorkflowStore> {
    Write(JournalWrite<S::Target>, oneshot::Sender<Answer>),
    /// Writes that go into the same batch (unless they are more than a batch holds).
    Writes(Vec<JournalWrite<S::Target>>, oneshot::Sender<Vec<Answer>>),
    Call(Call<S>),
    /// A call that runs before the journal writes queued ahead of it are committed (they are
    /// committed right after it).
    CallAhead(Call<S>),
    /// Wakes an idle thread for a call on the urgent lane (the call itself is there).
    Urgent,
}

/// Counters of the writer thread (for tests and metrics).
#[derive(Debug, Default)]
pub struct WriterStats {
    /// `commit` calls (transactions).
    pub commits: AtomicU64,
    /// Journal writes committed (or refused) in them.
    pub writes: AtomicU64,
    /// Other calls (claims, heartbeats, starts, reads).
    pub calls: AtomicU64,
    /// The largest batch committed in one transaction.
    pub largest_batch: AtomicU64,
}

struct Shared<S: WorkflowStore> {
    sender: mpsc::UnboundedSender<Message<S>>,
    /// The urgent lane: calls run before anything still queued on `sender` ([`Writer::call_urgent`]).
    urgent: mpsc::UnboundedSender<Call<S>>,
    clock: Clock,
    stats: Arc<WriterStats>,
}

/// A handle to the thread that owns the store. Cheap to clone; the thread ends (and the store
/// is dropped) when the last handle is dropped.
///
/// Journal writes ([`Writer::write`]) queued while the thread is busy are committed together in
/// one `commit` call, up to `COMMIT_BATCH_MAX` per transaction. Calls ([`Writer::call`]) run
/// between batches, in queue order; [`Writer::call_ahead`] runs before the writes queued ahead
/// of it are committed; [`Writer::call_urgent`] runs before everything still queued (the
/// heartbeats of leases, which must not wait behind a backlog of writes and calls).
pub struct Writer<S: WorkflowStore> {
    shared: Arc<Shared<S>>,
}

impl<S: WorkflowStore> Clone for Writer<S> {
    fn clone(&self) -> Self {
        Writer { shared: self.shared.clone() }
    }
}

impl<S> Writer<S>
where
    S: WorkflowStore + 'static,
    S::Target: 'static,
{
    /// Move `store` onto a new writer thread (system clock).
    pub fn new(store: S) -> Writer<S>
    where
        S: Send,
    {
        Self::spawn_with_clock(move || Ok(store), system_clock()).expect("the store is already open")
    }

    /// Open the store on a new writer thread with `factory` (the store never crosses threads),
    /// using the system clock.
    pub fn spawn<F>(factory: F) -> Result<Writer<S>>
    where
        F: FnOnce() -> Result<S> + Send + 'static,
    {
        Self::spawn_with_clock(factory, system_clock())
    }

    /// Open the store on a new writer thread with `factory`; `clock` gives `now_ms` to every
    /// store call and to the runtime.
    pub fn spawn_with_clock<F>(factory: F, clock: Clock) -> Result<Writer<S>>
    where
        F: FnOnce() -> Result<S> + Send + 'static,
    {
        let (sender, receiver) = mpsc::unbounded_channel();
        let (urgent, urgent_receiver) = mpsc::unbounded_channel();
        let (opened_tx, opened_rx) = std::sync::mpsc::channel();
        let stats = Arc::new(WriterStats::default());
        let (thread_clock, thread_stats) = (clock.clone(), stats.clone());
        std::thread::Builder::new()
            .name("tidemark-writer".into())
            .spawn(move || match factory() {
                Ok(store) => {
                    let _ = opened_tx.send(Ok(()));
                    writer_loop(store, receiver, urgent_receiver, thread_clock, thread_stats);
                }
                Err(error) => {
                    let _ = opened_tx.send(Err(error));
                }
            })
            .map_err(|e| Error::io(format!("cannot start the writer thread: {e}")))?;
        opened_rx.recv().map_err(|_| Error::Invariant("the writer thread died while opening the store".into()))??;
        Ok(Writer { shared: Arc::new(Shared { sender, urgent, clock, stats }) })
    }

    /// Now, in ms since the Unix epoch, from the writer's clock (the one every journal write is
    /// stamped with).
    pub fn now_ms(&self) -> i64 {
        (self.shared.clock)()
    }

    /// The writer's clock, to share with whatever must agree with the journal's times.
    pub fn clock(&self) -> Clock {
        self.shared.clock.clone()
    }

    /// The writer thread's counters: commits, writes, other calls and the largest batch.
    pub fn stats(&self) -> &WriterStats {
        &self.shared.stats
    }

    /// Queue one journal write now; the returned future resolves when its batch has committed.
    /// (Queued at the call, not at the first poll: writes made one after the other keep their
    /// order and may share a batch.)
    pub fn write(&self, write: JournalWrite<S::Target>) -> impl Future<Output = Result<WriteResult>> + Send + 'static {
        let (reply, answer) = oneshot::channel();
        let sent = self.shared.sender.send(Message::Write(write, reply)).is_ok();
        async move {
            if !sent {
                return Err(gone());
            }
            answer.await.map_err(|_| gone())?
        }
    }

    /// Queue several journal writes at once: they share a batch (when they fit in one), in this
    /// order. One result per write.
    pub async fn write_all(&self, writes: Vec<JournalWrite<S::Target>>) -> Vec<Result<WriteResult>> {
        self.write_together(writes).await
    }

    /// [`Writer::write_all`], queued at the call (not at the first poll). The group is answered
    /// once, when its last write has committed.
    pub fn write_together(
        &self,
        writes: Vec<JournalWrite<S::Target>>,
    ) -> impl Future<Output = Vec<Result<WriteResult>>> + Send + 'static {
        let count = writes.len();
        let (reply, answer) = oneshot::channel();
        let sent = self.shared.sender.send(Message::Writes(writes, reply)).is_ok();
        async move {
            let answers = if sent { answer.await.ok() } else { None };
            match answers {
                Some(answers) if answers.len() == count => answers,
                _ => (0..count).map(|_| Err(gone())).collect(),
            }
        }
    }

    /// Run `f(store, now_ms)` on the writer thread (claims, heartbeats, starts, reads), queued
    /// at the call.
    pub fn call<R, F>(&self, f: F) -> impl Future<Output = Result<R>> + Send + 'static
    where
        R: Send + 'static,
        F: FnOnce(&mut S, i64) -> Result<R> + Send + 'static,
    {
        let answer = self.enqueue(f);
        async move { answer?.await.map_err(|_| gone())? }
    }

    /// Queue `f(store, now_ms)` for the writer thread without waiting for it (`f` answers
    /// whoever waits for it itself), to run *ahead* of the journal writes queued before it: they
    /// are committed right after it rather than before. For work that does not depend on
    /// those writes (starting new runs), so that it does not wait for their commit. `Err` when
    /// the writer thread has stopped (`f` never runs).
    pub fn call_ahead<F>(&self, f: F) -> Result<()>
    where
        F: FnOnce(&mut S, i64) + Send + 'static,
    {
        self.shared.sender.send(Message::CallAhead(Box::new(f))).map_err(|_| gone())
    }

    /// [`Writer::call`] on the urgent lane: `f` runs as soon as the writer thread finishes what it
    /// is doing (a call, or one batch's commit), before every write and call still queued, and
    /// without committing the writes it went ahead of first. For work that depends on nothing
    /// queued and must not wait behind a backlog: the worker's lease heartbeats (a heartbeat that
    /// waited behind seconds of queued writes let leases expire and runs be taken over while their
    /// holder was alive, found on PostgreSQL under load; docs/reliability.md, run M).
    pub fn call_urgent<R, F>(&self, f: F) -> impl Future<Output = Result<R>> + Send + 'static
    where
        R: Send + 'static,
        F: FnOnce(&mut S, i64) -> Result<R> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let call: Call<S> = Box::new(move |store, now| {
            let _ = reply.send(f(store, now));
        });
        let sent = self.shared.urgent.send(call).is_ok() && self.shared.sender.send(Message::Urgent).is_ok();
        async move {
            if !sent {
                return Err(gone());
            }
            answer.await.map_err(|_| gone())?
        }
    }

    /// [`Writer::call`] from synchronous code (not from inside an async task).
    pub fn call_blocking<R, F>(&self, f: F) -> Result<R>
    where
        R: Send + 'static,
        F: FnOnce(&mut S, i64) -> Result<R> + Send + 'static,
    {
        self.enqueue(f)?.blocking_recv().map_err(|_| gone())?
    }

    fn enqueue<R, F>(&self, f: F) -> Result<oneshot::Receiver<Result<R>>>
    where
        R: Send + 'static,
        F: FnOnce(&mut S, i64) -> Result<R> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let call: Call<S> = Box::new(move |store, now| {
            let _ = reply.send(f(store, now));
        });
        self.shared.sender.send(Message::Call(call)).map_err(|_| gone())?;
        Ok(answer)
    }
}

fn gone() -> Error {
    Error::Invariant("the writer thread stopped (a store call panicked?)".into())
}

fn writer_loop<S: WorkflowStore>(
    mut store: S,
    mut receiver: mpsc::UnboundedReceiver<Message<S>>,
    mut urgent: mpsc::UnboundedReceiver<Call<S>>,
    clock: Clock,
    stats: Arc<WriterStats>,
) {
    let mut writes = Vec::new();
    let mut replies: Vec<Reply> = Vec::new();
    while let Some(first) = receiver.blocking_recv() {
        // A store whose server closed the connection opens a new one first; if that fails, this
        // round's calls fail as they would have, and the next round tries again.
        let _ = store.reconnect_if_closed();
        let mut next = Some(first);
        while let Some(message) = next.take() {
            // The urgent lane first, at every message: ahead of this one and of all queued.
            while let Ok(call) = urgent.try_recv() {
                stats.calls.fetch_add(1, Ordering::Relaxed);
                let now = clock();
                let _ = catch_unwind(AssertUnwindSafe(|| call(&mut store, now)));
            }
            match message {
                Message::Write(write, reply) => {
                    writes.push(write);
                    replies.push(Reply::One(reply));
                    if writes.len() >= COMMIT_BATCH_MAX {
                        flush(&mut store, &mut writes, &mut replies, &clock, &stats);
                    }
                }
                Message::Writes(group, reply) => {
                    if writes.len() + group.len() > COMMIT_BATCH_MAX {
                        flush(&mut store, &mut writes, &mut replies, &clock, &stats);
                    }
                    if group.len() > COMMIT_BATCH_MAX {
                        // More than a batch holds: committed in several, answered once at the end.
                        let mut answers = Vec::with_capacity(group.len());
                        let mut rest = group;
                        while !rest.is_empty() {
                            let tail = rest.split_off(COMMIT_BATCH_MAX.min(rest.len()));
                            answers.extend(commit_batch(&mut store, rest, &clock, &stats));
                            rest = tail;
                        }
                        let _ = reply.send(answers);
                    } else {
                        replies.push(Reply::Group(reply, group.len()));
                        writes.extend(group);
                        if writes.len() >= COMMIT_BATCH_MAX {
                            flush(&mut store, &mut writes, &mut replies, &clock, &stats);
                        }
                    }
                }
                Message::Call(call) => {
                    flush(&mut store, &mut writes, &mut replies, &clock, &stats);
                    stats.calls.fetch_add(1, Ordering::Relaxed);
                    let now = clock();
                    // A panicking call drops its reply: the caller gets an error, the thread lives.
                    let _ = catch_unwind(AssertUnwindSafe(|| call(&mut store, now)));
                }
                Message::CallAhead(call) => {
                    stats.calls.fetch_add(1, Ordering::Relaxed);
                    let now = clock();
                    let _ = catch_unwind(AssertUnwindSafe(|| call(&mut store, now)));
                    // The writes it went ahead of wait no longer than this call.
                    flush(&mut store, &mut writes, &mut replies, &clock, &stats);
                }
                Message::Urgent => {}
            }
            next = receiver.try_recv().ok();
        }
        flush(&mut store, &mut writes, &mut replies, &clock, &stats);
    }
}

/// Commit the queued writes and answer their replies.
fn flush<S: WorkflowStore>(
    store: &mut S,
    writes: &mut Vec<JournalWrite<S::Target>>,
    replies: &mut Vec<Reply>,
    clock: &Clock,
    stats: &WriterStats,
) {
    if writes.is_empty() {
        return;
    }
    let mut answers = commit_batch(store, std::mem::take(writes), clock, stats).into_iter();
    for reply in replies.drain(..) {
        match reply {
            Reply::One(reply) => {
                let _ = reply.send(answers.next().unwrap_or_else(|| Err(gone())));
            }
            Reply::Group(reply, count) => {
                let _ = reply.send(answers.by_ref().take(count).collect());
            }
        }
    }
}

/// One `commit` call (one transaction): one answer per write.
fn commit_batch<S: WorkflowStore>(
    store: &mut S,
    batch: Vec<JournalWrite<S::Target>>,
    clock: &Clock,
    stats: &WriterStats,
) -> Vec<Answer> {
    let count = batch.len();
    stats.commits.fetch_add(1, Ordering::Relaxed);
    stats.writes.fetch_add(count as u64, Ordering::Relaxed);
    stats.largest_batch.fetch_max(count as u64, Ordering::Relaxed);
    let now = clock();
    match catch_unwind(AssertUnwindSafe(|| store.commit(batch, now))) {
        Ok(Ok(results)) if results.len() == count => results.into_iter().map(Ok).collect(),
        Ok(Ok(results)) => {
            let error = Error::Invariant(format!("commit answered {} results for {count} writes", results.len()));
            vec![Err(error); count]
        }
        Ok(Err(error)) => vec![Err(error); count],
        Err(_) => vec![Err(Error::Invariant("the store panicked in commit".into())); count],
    }
}
