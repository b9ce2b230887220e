//! A store thread: one thread owns one store (one SQLite connection); requests reach it as
//! messages. Requests of the store's group-commit kind (advances for a producer, receives for a
//! consumer) that queue up while the thread is busy are committed together in one transaction;
//! any other operation is a call that runs alone, in queue order.
//!
//! An answer is sent only after the transaction that holds the request has committed, so an
//! HTTP client that got a 2xx answer can rely on the row being on disk.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::thread;

use tidemark_core::{Error, Result};
use tokio::sync::oneshot;

/// What a store commits together.
pub trait GroupCommit: Send + 'static {
    type Item: Send + 'static;
    type Answer: Send + 'static;
    /// Commit `items` in one transaction; one answer per item, in order.
    fn commit(&mut self, items: Vec<Self::Item>) -> Result<Vec<Self::Answer>>;
    /// Called before each round (a group commit and the calls that arrived with it): a store on
    /// a network database reconnects here after the server closed its connection. An error is
    /// logged; the round's operations then fail with their own errors, the next round tries
    /// again.
    fn before_round(&mut self) -> Result<()> {
        Ok(())
    }
}

type Call<S> = Box<dyn FnOnce(&mut S) + Send>;

enum Message<S: GroupCommit> {
    Item(S::Item, oneshot::Sender<Result<S::Answer>>),
    Call(Call<S>),
}

/// A handle to a store thread. Cheap to clone; the thread ends when the last handle is dropped
/// (after answering everything already queued).
pub struct Actor<S: GroupCommit> {
    sender: mpsc::Sender<Message<S>>,
}

impl<S: GroupCommit> Clone for Actor<S> {
    fn clone(&self) -> Self {
        Actor { sender: self.sender.clone() }
    }
}

fn gone() -> Error {
    Error::Invariant("a store thread stopped (a store call panicked?)".into())
}

impl<S: GroupCommit> Actor<S> {
    /// Start the thread. `batch_max` bounds the items of one transaction.
    pub fn spawn(name: String, store: S, batch_max: usize) -> Result<Actor<S>> {
        let (sender, receiver) = mpsc::channel();
        thread::Builder::new()
            .name(name)
            .spawn(move || run(store, receiver, batch_max.max(1)))
            .map_err(|e| Error::io(format!("cannot start a store thread: {e}")))?;
        Ok(Actor { sender })
    }

    /// Queue one item for the next group commit and wait for its committed answer.
    pub async fn submit(&self, item: S::Item) -> Result<S::Answer> {
        let (reply, answer) = oneshot::channel();
        self.sender.send(Message::Item(item, reply)).map_err(|_| gone())?;
        answer.await.map_err(|_| gone())?
    }

    /// Run `f` on the store thread.
    pub async fn call<R, F>(&self, f: F) -> Result<R>
    where
        R: Send + 'static,
        F: FnOnce(&mut S) -> Result<R> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let call: Call<S> = Box::new(move |store| {
            let _ = reply.send(f(store));
        });
        self.sender.send(Message::Call(call)).map_err(|_| gone())?;
        answer.await.map_err(|_| gone())?
    }
}

fn run<S: GroupCommit>(mut store: S, receiver: mpsc::Receiver<Message<S>>, batch_max: usize) {
    let mut items = Vec::new();
    let mut replies = Vec::new();
    let mut calls: Vec<Call<S>> = Vec::new();
    // Bounded per round: at most `batch_max` items and whatever calls arrived meanwhile.
    while let Ok(first) = receiver.recv() {
        let mut next = Some(first);
        while let Some(message) = next.take() {
            match message {
                Message::Item(item, reply) => {
                    items.push(item);
                    replies.push(reply);
                }
                Message::Call(call) => calls.push(call),
            }
            if items.len() < batch_max {
                next = receiver.try_recv().ok();
            }
        }
        if let Err(error) = store.before_round() {
            tracing::warn!(code = error.code(), %error, "a store could not reconnect");
        }
        if !items.is_empty() {
            let sent = items.len();
            let batch = std::mem::take(&mut items);
            // A panic rolls the transaction back (rusqlite rolls back on drop); the thread lives.
            let error = match catch_unwind(AssertUnwindSafe(|| store.commit(batch))) {
                Ok(Ok(answers)) if answers.len() == sent => {
                    for (reply, answer) in replies.drain(..).zip(answers) {
                        let _ = reply.send(Ok(answer));
                    }
                    None
                }
                Ok(Ok(answers)) => Some(Error::Invariant(format!("commit answered {} of {sent} items", answers.len()))),
                Ok(Err(error)) => Some(error),
                Err(_) => Some(Error::Invariant("the store panicked in a group commit".into())),
            };
            if let Some(error) = error {
                for reply in replies.drain(..) {
                    let _ = reply.send(Err(error.clone()));
                }
            }
        }
        for call in calls.drain(..) {
            // A panicking call drops its reply: its caller gets an error, the thread lives.
            let _ = catch_unwind(AssertUnwindSafe(|| call(&mut store)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records the size of every group commit.
    struct Batches(Vec<usize>);

    impl GroupCommit for Batches {
        type Item = u32;
        type Answer = u32;
        fn commit(&mut self, items: Vec<u32>) -> Result<Vec<u32>> {
            self.0.push(items.len());
            Ok(items.into_iter().map(|i| i * 2).collect())
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn items_queued_while_busy_commit_together_and_panics_do_not_kill_the_thread() {
        let actor = Actor::spawn("test".into(), Batches(Vec::new()), 100).unwrap();
        // Hold the thread in a call while 50 items queue up behind it.
        let (release, hold) = std::sync::mpsc::channel::<()>();
        let held = actor.clone();
        let blocker = tokio::spawn(async move {
            held.call(move |_| {
                hold.recv().ok();
                Ok(())
            })
            .await
        });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let submits: Vec<_> = (0..50)
            .map(|i| {
                tokio::spawn({
                    let actor = actor.clone();
                    async move { actor.submit(i).await }
                })
            })
            .collect();
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        release.send(()).unwrap();
        blocker.await.unwrap().unwrap();
        for (i, submit) in submits.into_iter().enumerate() {
            assert_eq!(submit.await.unwrap().unwrap(), 2 * i as u32);
        }
        let batches = actor.call(|s| Ok(s.0.clone())).await.unwrap();
        assert_eq!(batches.iter().sum::<usize>(), 50);
        assert!(batches.len() < 50, "queued items must share commits: {batches:?}");

        let panicked = actor.call(|_| -> Result<()> { panic!("boom") }).await;
        assert!(panicked.is_err());
        assert_eq!(actor.submit(4).await.unwrap(), 8, "the thread survives a panicking call");
    }
}
