//! One tenant's stores and the threads that own them.
//!
//! On SQLite ([`crate::backend::Sqlite`]) a tenant is a folder:
//!
//! ```text
//! <data>/tenants/<tenant>/producer.db   flows, outbox, subscriptions, deliveries (source = tenant id)
//! <data>/tenants/<tenant>/inbox.db      the inboxes of consumers whose handlers write to the inbox database
//! <data>/tenants/<tenant>/workflows.db  runs and journals, the inboxes of handlers on the workflow database, and
//!                                       the outbox of events that transactional steps commit (source `<tenant>.workflows`)
//! ```
//!
//! Registrations may keep files of their own in the folder (the built-in order saga's fake
//! payment service keeps `payments.db`). The user's tables live in one of the three databases,
//! by the transaction that must change them ([`Database`]); their migrations run when the
//! tenant opens, before any of its threads starts.
//!
//! **Isolation invariant:** a tenant's data is only ever in its own stores, and a request is
//! served from the stores of the tenant its token is bound to. No query can mix two tenants.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tidemark_core::error::codes;
use tidemark_core::flow::{AdvanceOutcome, AdvanceRequest, MachineSet};
use tidemark_core::store::{ConsumerStore, DrainReport, DrainScope, Handler, ProducerStore, ReceiveOutcome};
use tidemark_core::workflow::{RunDetail, StartOutcome, StartRequest, WorkflowStore};
use tidemark_core::{Envelope, Error, Result};
use tidemark_engine::workflow::{RunHandle, Worker, WorkerObserver, WorkerOptions, Workflows, Writer};
use tidemark_store_sqlite::ProducerTransaction;

use crate::actor::{Actor, GroupCommit};
use crate::backend::{Backend, Sqlite};
use crate::config::Config;
use crate::registry::{Database, Registrations, TenantInfo};

/// The producer thread: advances in group commits; relay passes, transactions and reads as
/// calls.
pub struct ProducerThread<B: Backend = Sqlite> {
    /// The tenant's producer store.
    pub store: B::Producer,
    /// The consumer stores the relay delivers to.
    pub endpoints: B::Endpoints,
    /// The service's clock.
    pub clock: fn() -> i64,
    /// The service's machines (a request's state tells which one decides it).
    pub machines: Arc<MachineSet>,
}

impl<B: Backend> GroupCommit for ProducerThread<B> {
    type Item = AdvanceRequest;
    type Answer = AdvanceOutcome;

    fn commit(&mut self, items: Vec<AdvanceRequest>) -> Result<Vec<AdvanceOutcome>> {
        self.store.advance_batch(self.machines.as_ref(), &items, (self.clock)())
    }

    fn before_round(&mut self) -> Result<()> {
        self.store.reconnect_if_closed()
    }
}

/// A consumer handler as a tenant's inbox thread runs it: boxed, on the backend's transaction.
pub type BoxedHandler<B> = Box<dyn Handler<<B as Backend>::Tx> + Send>;

/// An inbox thread: receives in group commits; drains and reads as calls.
pub struct InboxThread<B: Backend = Sqlite> {
    /// The consumer store of this inbox database.
    pub store: B::Consumer,
    /// The service's clock.
    pub clock: fn() -> i64,
    /// One instance of every handler registered on this database.
    pub handlers: BTreeMap<String, BoxedHandler<B>>,
}

impl<B: Backend> InboxThread<B> {
    /// Drain `consumer_id`'s inbox with its handler `handler` (at most `limit` events, one
    /// transaction).
    pub fn drain(&mut self, consumer_id: &str, handler: &str, scope: &DrainScope, limit: usize) -> Result<DrainReport> {
        let now = (self.clock)();
        let handler = self.handlers.get_mut(handler).ok_or_else(|| {
            Error::invalid(codes::UNKNOWN_HANDLER, format!("handler {handler:?} is not registered on this database"))
        })?;
        self.store.drain(consumer_id, scope, limit, &mut crate::trace::Traced(handler.as_mut()), now)
    }
}

impl<B: Backend> GroupCommit for InboxThread<B> {
    type Item = (String, Envelope);
    type Answer = ReceiveOutcome;

    fn commit(&mut self, items: Vec<(String, Envelope)>) -> Result<Vec<ReceiveOutcome>> {
        let refs: Vec<(&str, &Envelope)> = items.iter().map(|(c, e)| (c.as_str(), e)).collect();
        self.store.receive_batch(&refs, (self.clock)())
    }

    fn before_round(&mut self) -> Result<()> {
        self.store.reconnect_if_closed()
    }
}

/// One open tenant: its store threads, its workflow writer and worker.
pub struct Tenant<B: Backend = Sqlite> {
    /// The tenant's id.
    pub id: String,
    /// Its folder (on SQLite its databases are in it; a registration may keep files of its own
    /// there on any backend).
    pub dir: PathBuf,
    /// What registrations are told about it.
    pub info: TenantInfo,
    /// The backend its stores are on.
    pub backend: Arc<B>,
    /// The thread that owns the producer database.
    pub producer: Actor<ProducerThread<B>>,
    /// The thread that owns the outbox of the workflow database: the events transactional steps
    /// commit with their journal entry (`advance_committed_in(tx, ...)`), source
    /// `<tenant>.workflows`.
    pub runs_outbox: Actor<ProducerThread<B>>,
    /// The thread that owns the consumer tables of the inbox database.
    pub inbox: Actor<InboxThread<B>>,
    /// The thread that owns the consumer tables of the workflow database.
    pub runs_inbox: Actor<InboxThread<B>>,
    /// The thread that owns the workflow tables of the workflow database (group commit of
    /// journals).
    pub writer: Writer<B::Workflows>,
    /// The tenant's workflow worker (none when the service registers no workflow).
    pub worker: Option<Arc<Worker<B::Workflows>>>,
    /// The workflows the worker runs (for checking starts before anything is written).
    pub workflows: Workflows<B::Workflows>,
    /// The service's machines (what advances are checked against before they are queued).
    pub machines: Arc<MachineSet>,
    /// What the counts of `/metrics` and the dashboard are read through.
    pub stats: std::sync::Mutex<B::Stats>,
    /// The relay lanes running for the network endpoints of its outboxes.
    pub lanes: crate::lanes::Lanes,
}

impl Tenant<Sqlite> {
    /// The databases of a tenant folder on SQLite, by name.
    pub fn files(dir: &Path) -> [(&'static str, PathBuf); 3] {
        [Database::Producer, Database::Inbox, Database::Workflows].map(|d| (d.file_name(), dir.join(d.file_name())))
    }

    /// Run `f` in one transaction of the producer database, on its thread: the user's own rows
    /// and advances commit together or not at all (see
    /// [`tidemark_store_sqlite::SqliteProducer::transaction`]). `f` gets the transaction and the
    /// service's machines.
    pub async fn transaction<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&ProducerTransaction<'_>, &MachineSet) -> Result<T> + Send + 'static,
    {
        self.producer
            .call(move |p| {
                let machines = p.machines.clone();
                let now = (p.clock)();
                p.store.transaction(now, |tx| f(tx, &machines))
            })
            .await
    }
}

impl Tenant<crate::backend::Postgres> {
    /// Run `f` in one transaction of the producer schema, on its thread: the user's own rows and
    /// advances commit together or not at all (see
    /// [`tidemark_store_postgres::PgProducer::transaction`]). `f` gets the transaction and the
    /// service's machines.
    pub async fn transaction<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut tidemark_store_postgres::ProducerTransaction<'_>, &MachineSet) -> Result<T> + Send + 'static,
    {
        self.producer
            .call(move |p| {
                let machines = p.machines.clone();
                let now = (p.clock)();
                p.store.transaction(now, |tx| f(tx, &machines))
            })
            .await
    }
}

/// The folder of tenant `id` in the data folder `data_dir`.
pub fn dir_of(data_dir: &Path, id: &str) -> PathBuf {
    data_dir.join("tenants").join(id)
}

/// The source (producer namespace) of the workflow database's outbox: `<tenant>.workflows`
/// (tenant ids have no dot, so it is never another tenant's).
pub fn workflow_source(id: &str) -> String {
    format!("{id}.workflows")
}

impl<B: Backend> Tenant<B> {
    /// Open (creating on first use, never resetting) the tenant's stores, run the registered
    /// migrations, and start its threads. `observer` is told what the tenant's workflow worker
    /// does (metrics, logs).
    pub fn open(
        config: &Config,
        registrations: &Registrations<B>,
        backend: Arc<B>,
        id: &str,
        clock: fn() -> i64,
        observer: Option<Arc<dyn WorkerObserver>>,
    ) -> Result<Tenant<B>> {
        tidemark_core::tenancy::validate_tenant_id(id)?;
        let durability = config.durability()?;
        let dir = dir_of(&config.data_dir, id);
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(format!("cannot create {}: {e}", dir.display())))?;
        let info = TenantInfo { id: id.to_string(), dir: dir.clone(), durability };
        let machines = Arc::new(registrations.machines.clone());
        let batch_max = config.limits.group_commit_max;

        let (store, endpoints) = backend.open_producer(
            &info,
            Database::Producer,
            id,
            registrations.migrations_of(Database::Producer),
            clock(),
        )?;
        let producer = Actor::spawn(
            format!("producer-{id}"),
            ProducerThread { store, endpoints, clock, machines: machines.clone() },
            batch_max,
        )?;
        let inbox_store =
            backend.open_consumer(&info, Database::Inbox, registrations.migrations_of(Database::Inbox), clock())?;
        let inbox = Actor::spawn(
            format!("inbox-{id}"),
            InboxThread { store: inbox_store, clock, handlers: registrations.handlers_of(Database::Inbox) },
            batch_max,
        )?;
        // Workflow tables, consumer tables and the user's workflow tables in one database. It is
        // a producer too, so that a transactional step can commit an event with its journal
        // entry; its relay runs beside the main producer's.
        let (store, endpoints) =
            backend.open_producer(&info, Database::Workflows, &workflow_source(id), &[], clock())?;
        let runs_outbox = Actor::spawn(
            format!("runs-outbox-{id}"),
            ProducerThread { store, endpoints, clock, machines: machines.clone() },
            batch_max,
        )?;
        let runs_store = backend.open_consumer(
            &info,
            Database::Workflows,
            registrations.migrations_of(Database::Workflows),
            clock(),
        )?;
        let runs_inbox = Actor::spawn(
            format!("runs-inbox-{id}"),
            InboxThread { store: runs_store, clock, handlers: registrations.handlers_of(Database::Workflows) },
            batch_max,
        )?;

        let workflows = registrations.workflows_for(&info)?;
        // The registered queues are declared as the writer thread opens the store (never a
        // blocking call from here: a tenant may open inside an async task).
        let queues = registrations.queues.clone();
        let (opener, opened_for) = (backend.clone(), info.clone());
        let writer = Writer::spawn(move || {
            let mut store = opener.open_workflows(&opened_for)?;
            for queue in &queues {
                tidemark_core::queue::QueueStore::put_queue(&mut store, queue, clock())?;
            }
            Ok(store)
        })?;
        let options = WorkerOptions {
            worker_id: format!("serve-{}-{id}", std::process::id()),
            concurrency: config.workers.concurrency,
            lease_ms: config.workers.lease_ms,
            poll_interval_ms: config.workers.poll_ms,
            heartbeat_ms: None,
        };
        let worker = if workflows.is_empty() {
            None
        } else {
            let mut worker = Worker::new(writer.clone(), workflows.clone(), options)?;
            if let Some(observer) = observer {
                worker = worker.with_observer(observer);
            }
            Some(Arc::new(worker))
        };
        let stats = std::sync::Mutex::new(backend.open_stats(&info)?);
        Ok(Tenant {
            id: id.to_string(),
            dir,
            info,
            backend,
            producer,
            runs_outbox,
            inbox,
            runs_inbox,
            writer,
            worker,
            workflows,
            machines,
            stats,
            lanes: Default::default(),
        })
    }

    /// The tenant's two outboxes: the producer database's, then the workflow database's. Event
    /// ids are unique across both (they are UUIDs), so an operator names a delivery by event
    /// without saying which.
    pub fn outboxes(&self) -> [&Actor<ProducerThread<B>>; 2] {
        [&self.producer, &self.runs_outbox]
    }

    /// The thread of a consumer database (`Producer` is not one: `invalid_argument`).
    pub fn inbox_of(&self, database: Database) -> Result<&Actor<InboxThread<B>>> {
        match database {
            Database::Inbox => Ok(&self.inbox),
            Database::Workflows => Ok(&self.runs_inbox),
            Database::Producer => {
                Err(Error::invalid(codes::INVALID_ARGUMENT, "the producer database holds no consumer's inbox"))
            }
        }
    }

    /// The endpoint (consumer database) a subscription of this tenant delivers to.
    pub fn endpoint(&self, database: Database) -> String {
        self.backend.endpoint(&self.info, database)
    }

    /// Advance a flow (group-committed with concurrent advances): answered after the commit.
    pub async fn advance(&self, request: AdvanceRequest) -> Result<AdvanceOutcome> {
        // Validated here, so a bad request never reaches (or fails) a group commit.
        tidemark_core::flow::validate_request(self.machines.as_ref(), &request)?;
        self.producer.submit(request).await
    }

    /// Start runs, checked against the tenant's workflows first (nothing is written for a
    /// request that could never run).
    pub async fn start(&self, requests: Vec<StartRequest>) -> Result<Vec<StartOutcome>> {
        for request in &requests {
            self.workflows.check_start(request)?;
        }
        self.worker()?.start(requests).await
    }

    /// Start one run and hand out its [`RunHandle`], to await its result
    /// (`handle.result::<O>().await`). The same checks and idempotency as [`Tenant::start`]: the
    /// same run id with the same input is the existing run's handle; with another input or
    /// workflow it is `run_conflict`.
    pub async fn start_run(&self, request: StartRequest) -> Result<RunHandle<B::Workflows>> {
        let outcome = self.start(vec![request]).await?.remove(0);
        match outcome {
            StartOutcome::Started { run_id } | StartOutcome::Existing { run_id, .. } => self.handle(&run_id),
            StartOutcome::Conflict { run_id, reason } => Err(Error::invalid(
                tidemark_core::workflow::workflow_codes::RUN_CONFLICT,
                format!("run {run_id:?}: {reason}"),
            )),
        }
    }

    /// The handle of run `run_id` (started earlier, by anyone), to await its end.
    pub fn handle(&self, run_id: &str) -> Result<RunHandle<B::Workflows>> {
        tidemark_core::id::validate_id("run_id", run_id)?;
        Ok(RunHandle::new(self.worker()?.clone(), run_id))
    }

    /// The worker, or `unknown_workflow` when the service registers no workflow.
    pub fn worker(&self) -> Result<&Arc<Worker<B::Workflows>>> {
        self.worker.as_ref().ok_or_else(|| {
            Error::invalid(
                tidemark_core::workflow::workflow_codes::UNKNOWN_WORKFLOW,
                "this service registers no workflow",
            )
        })
    }

    /// A run with its journal, attempts and events.
    pub async fn run(&self, run_id: &str) -> Result<Option<RunDetail>> {
        let run_id = run_id.to_string();
        self.writer.call(move |store, _| store.run(&run_id)).await
    }
}

#[cfg(test)]
mod tests {
    //! The start path of a tenant's worker (`POST /v1/runs`): starts queued while the writer
    //! thread is busy share one transaction, due runs are claimed into the loop's free slots in
    //! it, and the worker's concurrency holds.

    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use serde_json::{json, Value};
    use tidemark_core::workflow::{RunFilter, RunStatus, StartOutcome, StartRequest, WorkflowStore};
    use tidemark_engine::workflow::{Worker, WorkerOptions, WorkflowOptions, Workflows, Writer};
    use tidemark_store_sqlite::{Durability, SqliteWorkflows};

    fn request(run_id: &str) -> StartRequest {
        StartRequest::new(run_id, "count", 1, json!({}))
    }

    /// `count`: holds the run for a moment and records how many runs were inside at once.
    fn counting(inside: Arc<AtomicUsize>, most: Arc<AtomicUsize>) -> Workflows<SqliteWorkflows> {
        let mut workflows = Workflows::new();
        workflows
            .register("count", 1, WorkflowOptions::default(), move |_ctx, _input: Value| {
                let (inside, most) = (inside.clone(), most.clone());
                async move {
                    most.fetch_max(inside.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    Ok(json!({}))
                }
            })
            .unwrap();
        workflows
    }

    struct World {
        _dir: tempfile::TempDir,
        writer: Writer<SqliteWorkflows>,
        worker: Arc<Worker<SqliteWorkflows>>,
        most: Arc<AtomicUsize>,
        runtime: tokio::runtime::Runtime,
    }

    fn world(concurrency: usize) -> World {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("workflows.db");
        let writer = Writer::spawn(move || SqliteWorkflows::init_with(&path, Durability::Full)).unwrap();
        let (inside, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let options = WorkerOptions { concurrency, poll_interval_ms: 20, ..WorkerOptions::new("test") };
        let worker = Arc::new(Worker::new(writer.clone(), counting(inside, most.clone()), options).unwrap());
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        World { _dir: dir, writer, worker, most, runtime }
    }

    impl World {
        /// Run the worker's loop until the returned sender is dropped or sent to.
        fn run_loop(&self) -> (tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let worker = self.worker.clone();
            let handle = self.runtime.spawn(async move {
                worker
                    .run_until(async move {
                        let _ = stopped.await;
                    })
                    .await
                    .unwrap();
            });
            (stop, handle)
        }

        fn runs(&self) -> Vec<tidemark_core::workflow::RunRecord> {
            self.writer.call_blocking(|store, _| store.list_runs(&RunFilter::default(), 1_000)).unwrap()
        }

        /// Wait (bounded) until `n` runs have completed.
        fn completed(&self, n: usize) {
            for _ in 0..3_000 {
                if self.runs().iter().filter(|r| r.status == RunStatus::Completed).count() >= n {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            panic!("{n} runs did not complete: {:?}", self.runs());
        }
    }

    #[test]
    fn starts_queued_while_the_writer_is_busy_share_a_transaction_and_the_concurrency_holds() {
        let w = world(4);
        let (stop, handle) = w.run_loop();
        // Once one run was started and claimed, the loop takes local starts.
        let first = w.runtime.block_on(w.worker.start(vec![request("first")])).unwrap();
        assert_eq!(first, [StartOutcome::Started { run_id: "first".into() }]);
        w.completed(1);

        // Hold the writer thread while 100 starts queue up behind it.
        let (release, hold) = std::sync::mpsc::channel::<()>();
        let held = w.writer.call(move |_, _| {
            hold.recv().ok();
            Ok(())
        });
        let starts: Vec<_> = (0..100)
            .map(|i| {
                let worker = w.worker.clone();
                w.runtime.spawn(async move { worker.start(vec![request(&format!("run-{i:03}"))]).await })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(50));
        release.send(()).unwrap();
        w.runtime.block_on(held).unwrap();
        for (i, start) in starts.into_iter().enumerate() {
            let outcome = w.runtime.block_on(start).unwrap().unwrap();
            assert_eq!(outcome, [StartOutcome::Started { run_id: format!("run-{i:03}") }]);
        }
        w.completed(101);
        let runs = w.runs();
        let created: std::collections::BTreeSet<i64> =
            runs.iter().filter(|r| r.run_id.starts_with("run-")).map(|r| r.created_at_ms).collect();
        assert_eq!(created.len(), 1, "the queued starts were committed in one transaction: {created:?}");
        let most = w.most.load(Ordering::SeqCst);
        assert!((1..=4).contains(&most), "at most the concurrency in flight at once, saw {most}");
        let _ = stop.send(());
        w.runtime.block_on(handle).unwrap();
    }

    #[test]
    fn an_invalid_start_is_refused_alone_and_writes_nothing() {
        let w = world(8);
        let (stop, handle) = w.run_loop();
        w.runtime.block_on(w.worker.start(vec![request("first")])).unwrap();
        w.completed(1);
        let (release, hold) = std::sync::mpsc::channel::<()>();
        let held = w.writer.call(move |_, _| {
            hold.recv().ok();
            Ok(())
        });
        let ids = ["ok-1", "not an id", "ok-2"];
        let starts: Vec<_> = ids
            .iter()
            .map(|id| {
                let (worker, request) = (w.worker.clone(), request(id));
                w.runtime.spawn(async move { worker.start(vec![request]).await })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(20));
        release.send(()).unwrap();
        w.runtime.block_on(held).unwrap();
        let outcomes: Vec<_> = starts.into_iter().map(|s| w.runtime.block_on(s).unwrap()).collect();
        assert!(outcomes[1].as_ref().unwrap_err().is_invalid_input(), "{outcomes:?}");
        assert_eq!(outcomes[0].as_ref().unwrap(), &[StartOutcome::Started { run_id: "ok-1".into() }]);
        assert_eq!(outcomes[2].as_ref().unwrap(), &[StartOutcome::Started { run_id: "ok-2".into() }]);
        w.completed(3);
        assert_eq!(w.runs().len(), 3, "nothing written for the invalid start");
        let _ = stop.send(());
        w.runtime.block_on(handle).unwrap();
    }

    #[test]
    fn a_start_after_the_loop_stopped_waits_pending_for_the_next_loop() {
        let w = world(8);
        let (stop, handle) = w.run_loop();
        w.runtime.block_on(w.worker.start(vec![request("first")])).unwrap();
        w.completed(1);
        let _ = stop.send(());
        w.runtime.block_on(handle).unwrap();

        let later = w.runtime.block_on(w.worker.start(vec![request("later")])).unwrap();
        assert_eq!(later, [StartOutcome::Started { run_id: "later".into() }]);
        let run = w.runs().into_iter().find(|r| r.run_id == "later").unwrap();
        assert_eq!(run.status, RunStatus::Pending, "no loop claimed it");
        assert!(run.lease_owner.is_none());
        let report = w.runtime.block_on(w.worker.run_until_idle()).unwrap();
        assert_eq!(report.completed, 1, "{report:?}");
        w.completed(2);
    }
}
