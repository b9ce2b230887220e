//! One tenant's files and the threads that own them.
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
//! **Isolation invariant:** a tenant's data is only ever in its own folder, and a request is
//! served from the folder of the tenant its token is bound to. No query can mix two tenants.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tidemark_core::error::codes;
use tidemark_core::flow::{AdvanceOutcome, AdvanceRequest, MachineSet};
use tidemark_core::policy::RetentionPolicy;
use tidemark_core::store::{ConsumerStore, DrainReport, DrainScope, ProducerStore, ReceiveOutcome};
use tidemark_core::workflow::{RunDetail, StartOutcome, StartRequest, WorkflowStore};
use tidemark_core::{Envelope, Error, Result};
use tidemark_engine::workflow::{Worker, WorkerObserver, WorkerOptions, Workflows, Writer};
use tidemark_store_sqlite::{
    apply_migrations, Durability, ProducerTransaction, SqliteConsumer, SqliteEndpoints, SqliteProducer, SqliteWorkflows,
};

use crate::actor::{Actor, GroupCommit};
use crate::config::Config;
use crate::registry::{BoxedHandler, Database, Registry, TenantInfo};

/// The producer thread: advances in group commits; relay passes, transactions and reads as
/// calls.
pub struct ProducerThread {
    /// The tenant's producer store.
    pub store: SqliteProducer,
    /// The consumer databases the relay delivers to.
    pub endpoints: SqliteEndpoints,
    /// The service's clock.
    pub clock: fn() -> i64,
    /// The service's machines (a request's state tells which one decides it).
    pub machines: Arc<MachineSet>,
}

impl GroupCommit for ProducerThread {
    type Item = AdvanceRequest;
    type Answer = AdvanceOutcome;

    fn commit(&mut self, items: Vec<AdvanceRequest>) -> Result<Vec<AdvanceOutcome>> {
        self.store.advance_batch(self.machines.as_ref(), &items, (self.clock)())
    }
}

/// An inbox thread: receives in group commits; drains and reads as calls.
pub struct InboxThread {
    /// The consumer store of this inbox database.
    pub store: SqliteConsumer,
    /// The service's clock.
    pub clock: fn() -> i64,
    /// One instance of every handler registered on this database.
    pub handlers: BTreeMap<String, BoxedHandler>,
}

impl InboxThread {
    /// Drain `consumer_id`'s inbox with its handler `handler` (at most `limit` events, one
    /// transaction).
    pub fn drain(&mut self, consumer_id: &str, handler: &str, scope: &DrainScope, limit: usize) -> Result<DrainReport> {
        let now = (self.clock)();
        let handler = self.handlers.get_mut(handler).ok_or_else(|| {
            Error::invalid(codes::UNKNOWN_HANDLER, format!("handler {handler:?} is not registered on this database"))
        })?;
        self.store.drain(consumer_id, scope, limit, handler.as_mut(), now)
    }
}

impl GroupCommit for InboxThread {
    type Item = (String, Envelope);
    type Answer = ReceiveOutcome;

    fn commit(&mut self, items: Vec<(String, Envelope)>) -> Result<Vec<ReceiveOutcome>> {
        let refs: Vec<(&str, &Envelope)> = items.iter().map(|(c, e)| (c.as_str(), e)).collect();
        self.store.receive_batch(&refs, (self.clock)())
    }
}

/// One open tenant: its store threads, its workflow writer and worker.
pub struct Tenant {
    /// The tenant's id.
    pub id: String,
    /// Its folder.
    pub dir: PathBuf,
    /// The thread that owns `producer.db`.
    pub producer: Actor<ProducerThread>,
    /// The thread that owns the outbox of `workflows.db`: the events transactional steps commit
    /// with their journal entry (`advance_committed_in(tx, ...)`), source `<tenant>.workflows`.
    pub runs_outbox: Actor<ProducerThread>,
    /// The thread that owns the consumer tables of `inbox.db`.
    pub inbox: Actor<InboxThread>,
    /// The thread that owns the consumer tables of `workflows.db`.
    pub runs_inbox: Actor<InboxThread>,
    /// The thread that owns the workflow tables of `workflows.db` (group commit of journals).
    pub writer: Writer<SqliteWorkflows>,
    /// The tenant's workflow worker (none when the service registers no workflow).
    pub worker: Option<Arc<Worker<SqliteWorkflows>>>,
    /// The workflows the worker runs (for checking starts before anything is written).
    pub workflows: Workflows<SqliteWorkflows>,
    /// The service's machines (what advances are checked against before they are queued).
    pub machines: Arc<MachineSet>,
    /// Read-only connections for the counts of `/metrics` and the dashboard.
    pub stats: std::sync::Mutex<crate::stats::StatsReader>,
}

impl Tenant {
    /// The databases of a tenant folder, by name.
    pub fn files(dir: &Path) -> [(&'static str, PathBuf); 3] {
        [Database::Producer, Database::Inbox, Database::Workflows].map(|d| (d.file_name(), dir.join(d.file_name())))
    }

    /// The folder of tenant `id` in the data folder `data_dir`.
    pub fn dir_of(data_dir: &Path, id: &str) -> PathBuf {
        data_dir.join("tenants").join(id)
    }

    /// Open (creating on first use, never resetting) the tenant's files, run the registered
    /// migrations, and start its threads. `observer` is told what the tenant's workflow worker
    /// does (metrics, logs).
    pub fn open(
        config: &Config,
        registry: &Registry,
        id: &str,
        clock: fn() -> i64,
        observer: Option<Arc<dyn WorkerObserver>>,
    ) -> Result<Tenant> {
        tidemark_core::tenancy::validate_tenant_id(id)?;
        let durability = config.durability()?;
        let dir = Self::dir_of(&config.data_dir, id);
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(format!("cannot create {}: {e}", dir.display())))?;
        let info = TenantInfo { id: id.to_string(), dir: dir.clone(), durability };
        let path = |database: Database| dir.join(database.file_name());

        drop(SqliteProducer::init(&path(Database::Producer), id)?);
        let mut store = SqliteProducer::open_with(&path(Database::Producer), durability)?;
        apply_migrations(store.connection(), registry.migrations_of(Database::Producer), clock())?;
        let machines = Arc::new(registry.machines().clone());
        let producer = Actor::spawn(
            format!("producer-{id}"),
            ProducerThread { store, endpoints: SqliteEndpoints::new(durability), clock, machines: machines.clone() },
            config.limits.group_commit_max,
        )?;

        let inbox_store = open_consumer(&path(Database::Inbox), durability)?;
        apply_migrations(inbox_store.connection(), registry.migrations_of(Database::Inbox), clock())?;
        let inbox = Actor::spawn(
            format!("inbox-{id}"),
            InboxThread { store: inbox_store, clock, handlers: registry.handlers_of(Database::Inbox) },
            config.limits.group_commit_max,
        )?;
        // Workflow tables, consumer tables and the user's workflow tables in one file.
        let workflows_path = path(Database::Workflows);
        drop(SqliteWorkflows::init_with(&workflows_path, durability)?);
        // The workflow database is a producer too, so that a transactional step can commit an
        // event with its journal entry; its relay runs beside the main producer's.
        drop(SqliteProducer::init(&workflows_path, &Self::workflow_source(id))?);
        let runs_outbox = Actor::spawn(
            format!("runs-outbox-{id}"),
            ProducerThread {
                store: SqliteProducer::open_with(&workflows_path, durability)?,
                endpoints: SqliteEndpoints::new(durability),
                clock,
                machines: machines.clone(),
            },
            config.limits.group_commit_max,
        )?;
        let runs_store = open_consumer(&workflows_path, durability)?;
        apply_migrations(runs_store.connection(), registry.migrations_of(Database::Workflows), clock())?;
        let runs_inbox = Actor::spawn(
            format!("runs-inbox-{id}"),
            InboxThread { store: runs_store, clock, handlers: registry.handlers_of(Database::Workflows) },
            config.limits.group_commit_max,
        )?;

        let workflows = registry.workflows_for(&info)?;
        let writer = Writer::spawn(move || SqliteWorkflows::open_with(&workflows_path, durability))?;
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
        let stats = std::sync::Mutex::new(crate::stats::StatsReader::open(&dir)?);
        Ok(Tenant {
            id: id.to_string(),
            dir,
            producer,
            runs_outbox,
            inbox,
            runs_inbox,
            writer,
            worker,
            workflows,
            machines,
            stats,
        })
    }

    /// The source (producer namespace) of the workflow database's outbox: `<tenant>.workflows`
    /// (tenant ids have no dot, so it is never another tenant's).
    pub fn workflow_source(id: &str) -> String {
        format!("{id}.workflows")
    }

    /// The tenant's two outboxes: `producer.db`'s, then `workflows.db`'s. Event ids are unique
    /// across both (they are UUIDs), so an operator names a delivery by event without saying
    /// which.
    pub fn outboxes(&self) -> [&Actor<ProducerThread>; 2] {
        [&self.producer, &self.runs_outbox]
    }

    /// The thread of a consumer database (`Producer` is not one: `invalid_argument`).
    pub fn inbox_of(&self, database: Database) -> Result<&Actor<InboxThread>> {
        match database {
            Database::Inbox => Ok(&self.inbox),
            Database::Workflows => Ok(&self.runs_inbox),
            Database::Producer => {
                Err(Error::invalid(codes::INVALID_ARGUMENT, "the producer database holds no consumer's inbox"))
            }
        }
    }

    /// The endpoint (consumer database path) a subscription of this tenant delivers to.
    pub fn endpoint(&self, database: Database) -> String {
        self.dir.join(database.file_name()).to_string_lossy().into_owned()
    }

    /// Advance a flow (group-committed with concurrent advances): answered after the commit.
    pub async fn advance(&self, request: AdvanceRequest) -> Result<AdvanceOutcome> {
        // Validated here, so a bad request never reaches (or fails) a group commit.
        tidemark_core::flow::validate_request(self.machines.as_ref(), &request)?;
        self.producer.submit(request).await
    }

    /// Run `f` in one transaction of the producer database, on its thread: the user's own rows
    /// and advances commit together or not at all (see
    /// [`SqliteProducer::transaction`]). `f` gets the transaction and the service's machines.
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

    /// Start runs, checked against the tenant's workflows first (nothing is written for a
    /// request that could never run).
    pub async fn start(&self, requests: Vec<StartRequest>) -> Result<Vec<StartOutcome>> {
        for request in &requests {
            self.workflows.check_start(request)?;
        }
        self.worker()?.start(requests).await
    }

    /// The worker, or `unknown_workflow` when the service registers no workflow.
    pub fn worker(&self) -> Result<&Arc<Worker<SqliteWorkflows>>> {
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

fn open_consumer(path: &Path, durability: Durability) -> Result<SqliteConsumer> {
    // Creates the file on first use; never resets (the first horizon is kept).
    drop(SqliteConsumer::init(path, RetentionPolicy::default())?);
    SqliteConsumer::open_with(path, durability)
}
