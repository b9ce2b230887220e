//! A store thread: one thread owns one store (one SQLite connection); requests reach it as
//! messages. Requests of the store's group-commit kind (advances for a producer, receives for a
//! consumer) that queue up while the thread is busy are committed together in one transaction;
//! any other operation is a call that runs alone, in queue order.
//!
//! An answer is sent only after the transaction that holds the request has committed, so an
//! HTTP client that got a 2xx answer can rely on the row being on disk.

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
        if !items.is_empty() {
            let sent = items.len();
            match store.commit(std::mem::take(&mut items)) {
                Ok(answers) => {
                    debug_assert_eq!(answers.len(), sent);
                    for (reply, answer) in replies.drain(..).zip(answers) {
                        let _ = reply.send(Ok(answer));
                    }
                }
                Err(error) => {
                    for reply in replies.drain(..) {
                        let _ = reply.send(Err(error.clone()));
                    }
                }
            }
        }
        for call in calls.drain(..) {
            call(&mut store);
        }
    }
}
