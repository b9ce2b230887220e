//! Awaiting a run's end: [`Worker::wait_for_end`] and the [`RunHandle`] a start hands out.
//!
//! A run that ends on this worker wakes its waiters at once (the worker tells them after the
//! run's last commit); a run that ends elsewhere (another process on the same database, an
//! operator's abandon) is seen by a read every [`RESULT_POLL_MS`]. The store is always the
//! truth: a waiter reads the run after every wake-up.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::de::DeserializeOwned;
use tidemark_core::workflow::{continuation_run_id, workflow_codes, RunRecord, RunStatus, WorkflowStore};
use tidemark_core::{Error, Result};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::Worker;

/// How often a waiter reads a run that has not ended, at most: it is woken at once when the run
/// ends on its own worker; this bounds the wait for an end written by someone else.
pub const RESULT_POLL_MS: u64 = 500;

/// Who waits for which run, woken when a run ends on this worker.
#[derive(Default)]
pub(crate) struct EndWaiters {
    waiting: Mutex<HashMap<String, Arc<Notify>>>,
}

impl EndWaiters {
    fn watch(&self, run_id: &str) -> Arc<Notify> {
        let mut waiting = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        waiting.entry(run_id.to_string()).or_default().clone()
    }

    /// Forget the watch of `run_id` when nobody else holds it.
    fn unwatch(&self, run_id: &str, notify: Arc<Notify>) {
        let mut waiting = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        drop(notify);
        if waiting.get(run_id).is_some_and(|n| Arc::strong_count(n) == 1) {
            waiting.remove(run_id);
        }
    }

    /// `run_id` ended on this worker: wake everyone who waits for it.
    pub(crate) fn ended(&self, run_id: &str) {
        let notify = self.waiting.lock().unwrap_or_else(|p| p.into_inner()).get(run_id).cloned();
        if let Some(notify) = notify {
            notify.notify_waiters();
        }
    }
}

impl<S> Worker<S>
where
    S: WorkflowStore + Send + 'static,
    S::Target: 'static,
{
    /// The run once it has ended (a terminal status: completed, compensated, failed, cancelled
    /// or parked), waiting up to `timeout` for that (`None`: as long as it takes); `Ok(None)` when
    /// the time is up first. An unknown run is `not_found`. A run that continued as a new run is
    /// followed to the end of its chain: the record returned is the last run's.
    pub async fn wait_for_end(&self, run_id: &str, timeout: Option<Duration>) -> Result<Option<RunRecord>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut run_id = run_id.to_string();
        loop {
            match self.wait_for_one_end(&run_id, deadline).await? {
                Some(run) if run.status == RunStatus::Continued => run_id = continuation_run_id(&run.run_id),
                other => return Ok(other),
            }
        }
    }

    async fn wait_for_one_end(&self, run_id: &str, deadline: Option<Instant>) -> Result<Option<RunRecord>> {
        let notify = self.end_waiters().watch(run_id);
        let answer = loop {
            // Registered before the read: an end committed after it wakes this wait.
            let woken = notify.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            let id = run_id.to_string();
            let read = self.writer().call(move |store, _| store.run(&id)).await;
            let run = match read {
                Ok(Some(detail)) => detail.run,
                Ok(None) => break Err(Error::not_found(format!("no run {run_id:?}"))),
                Err(error) => break Err(error),
            };
            if run.status.is_terminal() {
                break Ok(Some(run));
            }
            let mut pause = Duration::from_millis(RESULT_POLL_MS);
            if let Some(deadline) = deadline {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break Ok(None);
                }
                pause = pause.min(left);
            }
            let _ = tokio::time::timeout(pause, woken).await;
        };
        self.end_waiters().unwatch(run_id, notify);
        answer
    }
}

/// A started run, to await its result: what [`RunHandle::result`] returns is the workflow's
/// output, decoded into the caller's type. Cheap to clone; it holds the worker, not the run.
pub struct RunHandle<S: WorkflowStore> {
    run_id: String,
    worker: Arc<Worker<S>>,
}

impl<S: WorkflowStore> Clone for RunHandle<S> {
    fn clone(&self) -> Self {
        RunHandle { run_id: self.run_id.clone(), worker: self.worker.clone() }
    }
}

impl<S> RunHandle<S>
where
    S: WorkflowStore + Send + 'static,
    S::Target: 'static,
{
    /// The handle of run `run_id` on `worker` (the run need not exist yet: awaiting an unknown
    /// run is `not_found`).
    pub fn new(worker: Arc<Worker<S>>, run_id: &str) -> Self {
        RunHandle { run_id: run_id.to_string(), worker }
    }

    /// The run's id.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The run as it is now (`not_found` for an unknown run).
    pub async fn record(&self) -> Result<RunRecord> {
        let id = self.run_id.clone();
        let detail = self.worker.writer().call(move |store, _| store.run(&id)).await?;
        detail.map(|d| d.run).ok_or_else(|| Error::not_found(format!("no run {:?}", self.run_id)))
    }

    /// The run once it has ended, waiting up to `timeout` (`None`: as long as it takes);
    /// `Ok(None)` when the time is up first. A run that continued as new is followed to the last
    /// run of its chain (whose record this is).
    pub async fn wait(&self, timeout: Option<Duration>) -> Result<Option<RunRecord>> {
        self.worker.wait_for_end(&self.run_id, timeout).await
    }

    /// Wait for the run to end and return its output as `O`. A run that ended otherwise is
    /// `run_not_completed` (the message names its status and error; a parked run waits for an
    /// operator: await it again after a retry); an output that does not decode into `O` is
    /// `invalid_output`.
    pub async fn result<O: DeserializeOwned>(&self) -> Result<O> {
        let run = self.wait(None).await?.ok_or_else(|| Error::Invariant("an unbounded wait timed out".into()))?;
        decode_result(run)
    }

    /// [`Self::result`], waiting at most `timeout`: `result_timeout` when the run has not ended by
    /// then (it goes on; await it again).
    pub async fn result_within<O: DeserializeOwned>(&self, timeout: Duration) -> Result<O> {
        match self.wait(Some(timeout)).await? {
            Some(run) => decode_result(run),
            None => Err(Error::invalid(
                workflow_codes::RESULT_TIMEOUT,
                format!("run {:?} has not ended after {} ms", self.run_id, timeout.as_millis()),
            )),
        }
    }
}

impl<S> RunHandle<S>
where
    S: WorkflowStore + Send + 'static,
    S::Target: 'static,
{
    /// The value the run published under `key` (`ctx.set_event`), waiting up to `timeout` for it
    /// to be published (polled every [`EVENT_POLL_MS`]); `Ok(None)` when it was not by then. An
    /// unknown run is `not_found`.
    pub async fn get_event<T: DeserializeOwned>(&self, key: &str, timeout: Duration) -> Result<Option<T>> {
        let deadline = Instant::now() + timeout;
        loop {
            let (id, k) = (self.run_id.clone(), key.to_string());
            let (published, exists) = self
                .worker
                .writer()
                .call(move |store, _| {
                    let published = store.published(&id, &k)?;
                    let exists = published.is_some() || store.run(&id)?.is_some();
                    Ok((published, exists))
                })
                .await?;
            if let Some(published) = published {
                return serde_json::from_value(published.value).map(Some).map_err(|e| {
                    Error::invalid(
                        workflow_codes::INVALID_OUTPUT,
                        format!("event {key} of run {:?} does not decode into the type asked for: {e}", self.run_id),
                    )
                });
            }
            if !exists {
                return Err(Error::not_found(format!("no run {:?}", self.run_id)));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            tokio::time::sleep(left.min(Duration::from_millis(EVENT_POLL_MS))).await;
        }
    }
}

/// How often [`RunHandle::get_event`] reads a value not published yet.
pub const EVENT_POLL_MS: u64 = 50;

fn decode_result<O: DeserializeOwned>(run: RunRecord) -> Result<O> {
    if run.status != RunStatus::Completed {
        return Err(Error::invalid(
            workflow_codes::RUN_NOT_COMPLETED,
            format!(
                "run {:?} ended {}: {}",
                run.run_id,
                run.status.as_str(),
                run.error.as_deref().unwrap_or("no error recorded")
            ),
        ));
    }
    serde_json::from_value(run.result.unwrap_or(serde_json::Value::Null)).map_err(|e| {
        Error::invalid(
            workflow_codes::INVALID_OUTPUT,
            format!("the output of run {:?} does not decode into the type asked for: {e}", run.run_id),
        )
    })
}
