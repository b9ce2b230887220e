//! One tenant's files and the threads that own them.
//!
//! ```text
//! <data>/tenants/<tenant>/producer.db   flows, outbox, subscriptions, deliveries (source = tenant id)
//! <data>/tenants/<tenant>/inbox.db      the inbox of its `reservation` and `record` consumers
//! <data>/tenants/<tenant>/workflows.db  runs and journals, and the inbox of its `workflows` consumers
//! <data>/tenants/<tenant>/payments.db   the built-in order saga's fake payment service
//! ```
//!
//! **Isolation invariant:** a tenant's data is only ever in its own folder, and a request is
//! served from the folder of the tenant its token is bound to. No query can mix two tenants.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rusqlite::Connection;
use tidemark_core::error::codes;
use tidemark_core::flow::{AdvanceOutcome, AdvanceRequest, Decision, FlowMachine, FlowState, StreamMachine};
use tidemark_core::policy::RetentionPolicy;
use tidemark_core::reservation::ReservationMachine;
use tidemark_core::store::{ConsumerStore, HandleError, Handler, ProducerStore, ReceiveOutcome};
use tidemark_core::{Envelope, Error, Result};
use tidemark_engine::workflow::builtin;
use tidemark_engine::workflow::order::{FakePayments, Payments};
use tidemark_engine::workflow::{Worker, WorkerObserver, WorkerOptions, Writer};
use tidemark_store_sqlite::reservation::ReservationHandler;
use tidemark_store_sqlite::workflow_events::RunEventHandler;
use tidemark_store_sqlite::{
    order as order_sql, reservation, Durability, SqliteConsumer, SqliteEndpoints, SqliteProducer, SqliteWorkflows,
};

use crate::actor::{Actor, GroupCommit};
use crate::config::Config;

/// The built-in handlers a consumer can be declared with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandlerKind {
    /// The reservation example domain: projection and effects in `inbox.db`.
    Reservation,
    /// Any event applies and does nothing else: the inbox as a durable, ordered, deduplicated log.
    Record,
    /// Each event becomes a run event (`run_id` in its payload), waking a run waiting for it.
    Workflows,
}

impl HandlerKind {
    pub const ALL: [HandlerKind; 3] = [HandlerKind::Reservation, HandlerKind::Record, HandlerKind::Workflows];

    pub fn as_str(self) -> &'static str {
        match self {
            HandlerKind::Reservation => "reservation",
            HandlerKind::Record => "record",
            HandlerKind::Workflows => "workflows",
        }
    }

    pub fn parse(value: &str) -> Result<HandlerKind> {
        Self::ALL.into_iter().find(|k| k.as_str() == value).ok_or_else(|| {
            Error::invalid(
                codes::INVALID_ARGUMENT,
                format!("unknown handler {value:?}; handlers are reservation, record, workflows"),
            )
        })
    }

    /// The handler that applies this kind of consumer's events.
    pub fn handler(self, support_v2: bool) -> Box<dyn Handler<Connection>> {
        match self {
            HandlerKind::Reservation => Box::new(ReservationHandler::new(support_v2)),
            HandlerKind::Record => Box::new(RecordHandler),
            HandlerKind::Workflows => Box::new(RunEventHandler::new()),
        }
    }

    /// Which inbox file holds this consumer's records.
    pub fn inbox(self) -> InboxFile {
        match self {
            HandlerKind::Reservation | HandlerKind::Record => InboxFile::Inbox,
            HandlerKind::Workflows => InboxFile::Workflows,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InboxFile {
    Inbox,
    Workflows,
}

/// The machine of the tenant's producer: reservation flows and plain event streams, told apart
/// by `to_state` (see [`StreamMachine`]). A stream flow never becomes a reservation and back.
pub struct TenantMachine;

impl FlowMachine for TenantMachine {
    fn initial(&self) -> FlowState {
        ReservationMachine.initial()
    }

    fn validate(&self, request: &AdvanceRequest) -> Result<()> {
        if request.to_state == StreamMachine::STATE {
            StreamMachine.validate(request)
        } else if request.expected_seq < 0 {
            Err(Error::invalid(codes::INVALID_SEQ, format!("expected_seq must be >= 0, got {}", request.expected_seq)))
        } else {
            ReservationMachine.validate(request)
        }
    }

    fn decide(&self, current: &FlowState, request: &AdvanceRequest) -> std::result::Result<Decision, String> {
        if request.to_state == StreamMachine::STATE {
            StreamMachine.decide(current, request)
        } else {
            ReservationMachine.decide(current, request)
        }
    }

    fn appends_at_any_seq(&self) -> bool {
        true
    }
}

/// The producer thread: advances in group commits; relay passes and reads as calls.
pub struct ProducerThread {
    pub store: SqliteProducer,
    pub endpoints: SqliteEndpoints,
    pub clock: fn() -> i64,
}

impl GroupCommit for ProducerThread {
    type Item = AdvanceRequest;
    type Answer = AdvanceOutcome;

    fn commit(&mut self, items: Vec<AdvanceRequest>) -> Result<Vec<AdvanceOutcome>> {
        self.store.advance_batch(&TenantMachine, &items, (self.clock)())
    }
}

/// An inbox thread: receives in group commits; drains and reads as calls.
pub struct InboxThread {
    pub store: SqliteConsumer,
    pub clock: fn() -> i64,
}

impl GroupCommit for InboxThread {
    type Item = (String, Envelope);
    type Answer = ReceiveOutcome;

    fn commit(&mut self, items: Vec<(String, Envelope)>) -> Result<Vec<ReceiveOutcome>> {
        let refs: Vec<(&str, &Envelope)> = items.iter().map(|(c, e)| (c.as_str(), e)).collect();
        self.store.receive_batch(&refs, (self.clock)())
    }
}

/// The `record` handler: applying an event records it, nothing else.
pub struct RecordHandler;

impl Handler<Connection> for RecordHandler {
    fn handle(
        &mut self,
        _tx: &Connection,
        _consumer_id: &str,
        _event: &Envelope,
    ) -> std::result::Result<(), HandleError> {
        Ok(())
    }

    fn refuses_before_writing(&self) -> bool {
        true
    }
}

pub struct Tenant {
    pub id: String,
    pub dir: PathBuf,
    pub producer: Actor<ProducerThread>,
    pub inbox: Actor<InboxThread>,
    pub runs_inbox: Actor<InboxThread>,
    pub writer: Writer<SqliteWorkflows>,
    pub worker: Arc<Worker<SqliteWorkflows>>,
    /// Read-only connections for the counts of `/metrics` and the dashboard.
    pub stats: std::sync::Mutex<crate::stats::StatsReader>,
}

impl Tenant {
    pub fn files(dir: &Path) -> [(&'static str, PathBuf); 4] {
        ["producer.db", "inbox.db", "workflows.db", "payments.db"].map(|name| (name, dir.join(name)))
    }

    /// Open (creating on first use, never resetting) the tenant's files and start its threads.
    /// The folder of tenant `id` in the data folder `data_dir`.
    pub fn dir_of(data_dir: &Path, id: &str) -> PathBuf {
        data_dir.join("tenants").join(id)
    }

    /// `observer` is told what the tenant's workflow worker does (metrics, logs).
    pub fn open(
        config: &Config,
        id: &str,
        clock: fn() -> i64,
        observer: Option<Arc<dyn WorkerObserver>>,
    ) -> Result<Tenant> {
        tidemark_core::tenancy::validate_tenant_id(id)?;
        let durability = config.durability()?;
        let dir = Self::dir_of(&config.data_dir, id);
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(format!("cannot create {}: {e}", dir.display())))?;
        let producer_path = dir.join("producer.db");
        if !producer_path.exists() {
            SqliteProducer::init(&producer_path, id)?;
        }
        let store = SqliteProducer::open_with(&producer_path, durability)?;
        let producer = Actor::spawn(
            format!("producer-{id}"),
            ProducerThread { store, endpoints: SqliteEndpoints::new(durability), clock },
            config.limits.group_commit_max,
        )?;

        let inbox = Actor::spawn(
            format!("inbox-{id}"),
            InboxThread { store: open_consumer(&dir.join("inbox.db"), durability, true)?, clock },
            config.limits.group_commit_max,
        )?;
        let workflows_path = dir.join("workflows.db");
        {
            // Workflow tables, consumer tables and the order saga's tables in one file.
            let mut store = SqliteWorkflows::open_with(&workflows_path, durability)?;
            order_sql::install(store.connection())?;
        }
        let runs_inbox = Actor::spawn(
            format!("runs-inbox-{id}"),
            InboxThread { store: open_consumer(&workflows_path, durability, false)?, clock },
            config.limits.group_commit_max,
        )?;

        let payments: Arc<dyn Payments> = Arc::new(FakePayments::open(&dir.join("payments.db"))?);
        let retry = builtin::retry_policy(config.workers.max_attempts, config.workers.retry_delay_ms)?;
        let workflows = builtin::workflows(payments, &retry)?;
        let path = workflows_path.clone();
        let writer = Writer::spawn(move || SqliteWorkflows::open_with(&path, durability))?;
        let options = WorkerOptions {
            worker_id: format!("serve-{}-{id}", std::process::id()),
            concurrency: config.workers.concurrency,
            lease_ms: config.workers.lease_ms,
            poll_interval_ms: config.workers.poll_ms,
            heartbeat_ms: None,
        };
        let mut worker = Worker::new(writer.clone(), workflows, options)?;
        if let Some(observer) = observer {
            worker = worker.with_observer(observer);
        }
        let worker = Arc::new(worker);
        let stats = std::sync::Mutex::new(crate::stats::StatsReader::open(&dir)?);
        Ok(Tenant { id: id.to_string(), dir, producer, inbox, runs_inbox, writer, worker, stats })
    }

    pub fn inbox_of(&self, file: InboxFile) -> &Actor<InboxThread> {
        match file {
            InboxFile::Inbox => &self.inbox,
            InboxFile::Workflows => &self.runs_inbox,
        }
    }

    /// The endpoint (consumer database path) a subscription of this tenant delivers to.
    pub fn endpoint(&self, file: InboxFile) -> String {
        let name = match file {
            InboxFile::Inbox => "inbox.db",
            InboxFile::Workflows => "workflows.db",
        };
        self.dir.join(name).to_string_lossy().into_owned()
    }
}

fn open_consumer(path: &Path, durability: Durability, reservation_tables: bool) -> Result<SqliteConsumer> {
    // Creates the file on first use; never resets (the first horizon is kept).
    drop(SqliteConsumer::init(path, RetentionPolicy::default())?);
    let consumer = SqliteConsumer::open_with(path, durability)?;
    if reservation_tables {
        reservation::install(&consumer)?;
    }
    Ok(consumer)
}
