//! # tidemark
//!
//! Reliable execution across services. A producer commits a state change and the event that
//! describes it in **one local transaction** (the transactional outbox); a relay hands each
//! event to every subscriber; each consumer stores events durably (the inbox) and applies them
//! **exactly once and in order per flow**; durable workflows and sagas run journaled steps with
//! retries, timers and compensation. Embedded SQLite (WAL, `synchronous=FULL`) is the store.
//!
//! One dependency line (`cargo add tidemark`) gives you all of it; [`prelude`] has the names a
//! service uses. The guide is `docs/library.md`; runnable services are in `examples/`.
//!
//! ## Your code, served
//!
//! ```
//! use serde::{Deserialize, Serialize};
//! use tidemark::prelude::*;
//!
//! // A flow machine over your own types: payment.new -> authorized.
//! #[derive(Default, Serialize, Deserialize)]
//! struct Payment { amount: i64 }
//! #[derive(Deserialize)]
//! struct Authorize { amount: i64 }
//! #[derive(Serialize, Deserialize)]
//! struct Authorized { amount: i64 }
//!
//! struct PaymentMachine;
//! impl Machine for PaymentMachine {
//!     type Data = Payment;
//!     type Input = Authorize;
//!     type Event = Authorized;
//!     const NAME: &'static str = "payment";
//!     const STATES: &'static [&'static str] = &["payment.new", "authorized"];
//!     fn decide(&self, from: &str, _: &Payment, to: &str, input: Authorize)
//!         -> Result<Transition<Payment, Authorized>, String> {
//!         if (from, to) != ("payment.new", "authorized") {
//!             return Err(format!("{from} -> {to} is not allowed"));
//!         }
//!         Ok(Transition {
//!             data: Payment { amount: input.amount },
//!             event_type: "payment.authorized".into(),
//!             event: Authorized { amount: input.amount },
//!         })
//!     }
//! }
//!
//! // A consumer handler over your own event type: it writes to your own table, in the same
//! // transaction that marks the event applied.
//! #[derive(Clone)]
//! struct Ledger;
//! impl EventHandler<Connection> for Ledger {
//!     type Event = Authorized;
//!     fn handle(&mut self, tx: &Connection, _: &str, envelope: &Envelope, event: Authorized)
//!         -> Result<(), HandleError> {
//!         tx.execute("INSERT INTO ledger (flow_id, amount) VALUES (?1, ?2)", (&envelope.flow_id, event.amount))
//!             .map_err(|e| HandleError::Failed(e.into()))?;
//!         Ok(())
//!     }
//! }
//!
//! // A workflow: an async function over your own input and output types.
//! #[derive(Deserialize)]
//! struct Checkout { order_id: String }
//! #[derive(Serialize)]
//! struct Receipt { charge: String }
//! async fn checkout(ctx: Context, input: Checkout) -> Result<Receipt, WorkflowError> {
//!     let charge: String = ctx.step("charge", None, move |key| async move {
//!         Ok(format!("charge for {} with idempotency key {key}", input.order_id))
//!     }).await?;
//!     Ok(Receipt { charge })
//! }
//!
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> tidemark::Result<()> {
//! # let dir = tempfile::tempdir().unwrap();
//! let service = Service::builder()
//!     .data_dir(dir.path())
//!     .without_auth("main")
//!     .flow(PaymentMachine)
//!     .migration(Database::Inbox, Migration::sql("0001_ledger",
//!         "CREATE TABLE ledger (flow_id TEXT PRIMARY KEY, amount INTEGER NOT NULL)"))
//!     .consumer("ledger", Typed(Ledger))
//!     .workflow(tidemark::workflow("checkout", 1, checkout))
//!     .build()?;
//! service.start().await?; // or `.serve("127.0.0.1:7400")`: API, dashboard, metrics, every loop
//! let tenant = service.tenant("main").await?;
//! let committed = tenant.transaction(|tx, machines| {
//!     let request = AdvanceRequest::new("pay-1", 0, "authorized", serde_json::json!({"amount": 500}));
//!     tx.advance(machines, &request)
//! }).await?;
//! assert_eq!(committed.seq, 1);
//! tenant.start(vec![StartRequest::new("order-1", "checkout", 1, serde_json::json!({"order_id": "order-1"}))]).await?;
//! # loop {
//! #     let run = tenant.run("order-1").await?.expect("started");
//! #     if run.run.status.is_terminal() { assert_eq!(run.run.status, RunStatus::Completed); break; }
//! #     tokio::time::sleep(std::time::Duration::from_millis(20)).await;
//! # }
//! # service.shutdown().await;
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

/// Milliseconds since the Unix epoch: the wall clock every tidemark loop and request reads
/// (outside a workflow; inside one, `ctx.now()` is the journaled, replay-safe clock).
pub use tidemark_core::clock::now_ms;
pub use tidemark_core::error::codes;
pub use tidemark_core::{Envelope, Error, Result};

/// `rusqlite`, at the version tidemark links (one `libsqlite3-sys` per program): use this one
/// for your own statements instead of adding another.
pub use rusqlite;
/// The `axum` of [`Service::router`] (mount it, or write routes of your own), and the `utoipa`
/// that documents routes in `/openapi.json`.
pub use tidemark_server::{axum, utoipa, utoipa_axum};

/// Flows and their state machines: [`flow::Machine`] over your own types (or the JSON-level
/// [`flow::FlowMachine`]), requests and outcomes, and [`flow::MachineSet`].
pub mod flow {
    pub use tidemark_core::flow::*;
}

/// The protocol's records and outcomes, the consumer handler traits ([`store::EventHandler`]
/// over your own event type, or [`store::Handler`]), and the storage traits every backend
/// implements.
pub mod store {
    pub use tidemark_core::policy::{RelayPolicy, RetentionPolicy};
    pub use tidemark_core::store::*;
}

/// Durable workflows and sagas: [`workflow::Workflow`] definitions, the
/// [`workflow::WorkflowContext`] a workflow talks to the world through, [`workflow::Saga`],
/// retry policies, run records, and the writer and worker that run them.
pub mod workflow {
    pub use tidemark_core::queue::{Enqueue, QueueSpec, QueueState, QueueStore, QueuedRun, RateLimit};
    pub use tidemark_core::schedule::{CatchUp, Schedule, ScheduleSpec, ScheduleStore, Timing};
    pub use tidemark_core::workflow::*;
    pub use tidemark_engine::workflow::{
        system_clock, Clock, Continuation, FinishedRun, IntoWorkflow, RunHandle as GenericRunHandle, Saga, SagaAction,
        SagaData, StepAttempt, StepAttemptEnd, Suspended, Worker, WorkerObserver, WorkerOptions, WorkerReport,
        Workflow, WorkflowContext, WorkflowError, WorkflowInfo, WorkflowOptions, Workflows, Writer, WriterStats,
        CHILD_RECHECK_MS, REPLAY_END, RESULT_POLL_MS,
    };
    /// A started run of a service on SQLite, to await its result ([`crate::service::Tenant::start_run`]).
    pub type RunHandle = GenericRunHandle<tidemark_store_sqlite::SqliteWorkflows>;
}

/// The relay: moves committed events from an outbox to every subscriber's inbox.
pub mod relay {
    pub use tidemark_engine::relay::*;
}

/// The SQLite stores (producer, consumer, workflows), opening rules (`init` creates, `open`
/// only opens), durability, your own migrations, and the transaction helpers.
pub mod sqlite {
    pub use rusqlite;
    pub use tidemark_store_sqlite::workflow_events::RunEventHandler;
    pub use tidemark_store_sqlite::{
        advance_committed_in, advance_in, apply_migrations, committed, open_connection, register_projection_table,
        send_event_in, Committed, Durability, Migration, OutboxTransaction, ProducerTransaction, SqliteConsumer,
        SqliteEndpoints, SqliteProducer, SqliteWorkflows, UNKNOWN_MIGRATION,
    };
}

/// The PostgreSQL stores (producer, consumer, workflows) on a schema of a PostgreSQL 15+ server,
/// the same contracts and outcomes as [`sqlite`]'s (docs/postgres.md). A transactional step or
/// an inbox handler gets an [`postgres::ApplyTransaction`]; [`postgres::advance_in`] commits a
/// flow's event with your business rows in one PostgreSQL transaction.
pub mod postgres {
    /// `postgres` (the blocking client), at the version tidemark links.
    pub use postgres as client;
    pub use tidemark_core::location::{PostgresLocation, StoreLocation, POSTGRES_SCHEMA_DEFAULT};
    pub use tidemark_store_postgres::*;

    /// The context of a workflow run on PostgreSQL (a transactional step gets an
    /// [`ApplyTransaction`]).
    pub type Context = tidemark_engine::workflow::WorkflowContext<PgWorkflows>;
    /// A workflow definition on PostgreSQL.
    pub type Workflow = tidemark_engine::workflow::Workflow<PgWorkflows>;
    /// A saga on PostgreSQL.
    pub type Saga = tidemark_engine::workflow::Saga<PgWorkflows>;
    /// A service on PostgreSQL (`Service::builder().postgres(url)`).
    pub type Service = tidemark_server::Service<tidemark_server::Postgres>;
    /// A tenant of a service on PostgreSQL.
    pub type Tenant = tidemark_server::Tenant<tidemark_server::Postgres>;
    /// The caller of a route of your own on a service on PostgreSQL.
    pub type Caller = tidemark_server::Caller<tidemark_server::Postgres>;
    /// A started run of a service on PostgreSQL, to await its result.
    pub type RunHandle = tidemark_engine::workflow::RunHandle<PgWorkflows>;
}

/// The service: its builder, configuration, registry, tenants, and the HTTP API's pieces for
/// routes of your own.
pub mod service {
    /// Extractors and answers for routes of your own ([`crate::ServiceBuilder::routes`]): JSON
    /// bodies, paths and queries whose rejections are JSON errors with stable codes.
    pub mod api {
        pub use tidemark_server::api::{typed, ApiError, ApiResult, ErrorBody, Json, Path, Query};
    }
    pub use tidemark_core::tenancy::Scope;
    pub use tidemark_server::api::{ApiError, ApiResult};
    pub use tidemark_server::backend::POSTGRES_PREFIX_BYTES_MAX;
    pub use tidemark_server::config::{Config, SourceConfig};
    pub use tidemark_server::registry::{Database, HandlerInfo, MachineInfo, Registry, TenantInfo};
    pub use tidemark_server::{
        AnyTenant, AppState, Backend, Caller, Postgres, Service, ServiceBuilder, Sqlite, Tenant,
    };
}

/// Identifiers (`[A-Za-z0-9_.:-]{1,100}`) and their validation.
pub mod id {
    pub use tidemark_core::id::*;
}

/// JSON from outside: the numbers the canonical encoding keeps exactly (`check_numbers`), and
/// integer fields that take `344.0` as JSON Schema's `integer` does (`integer`,
/// `optional_integer`).
pub mod json {
    pub use tidemark_core::json::*;
}

/// Every limit, with its unit in its name.
pub mod limits {
    pub use tidemark_core::limits::*;
}

/// Payload decoders per (event type, schema version), for handlers of several schemas.
pub mod decode {
    pub use tidemark_core::decode::*;
}

/// The built-in reference domain (a reservation `new -> reserved -> confirmed -> released`),
/// used by the model checks and registered by `tidemark serve`.
pub mod reservation {
    pub use tidemark_core::reservation::*;
}

pub use service::{Database, Service, ServiceBuilder};

pub mod testing;

/// The context of a workflow run on the SQLite store (a transactional step gets a
/// `&rusqlite::Connection` of the workflow database).
pub type Context = tidemark_engine::workflow::WorkflowContext<tidemark_store_sqlite::SqliteWorkflows>;

/// A workflow definition on the SQLite store.
pub type Workflow = tidemark_engine::workflow::Workflow<tidemark_store_sqlite::SqliteWorkflows>;

/// A saga on the SQLite store.
pub type Saga = tidemark_engine::workflow::Saga<tidemark_store_sqlite::SqliteWorkflows>;

/// Workflow `name` version `version` running `f`, an async function over your own input and
/// output types (see [`workflow::Workflow::new`]).
pub fn workflow<I, O, F, Fut>(name: &str, version: u32, f: F) -> Workflow
where
    I: serde::de::DeserializeOwned + Send + 'static,
    O: serde::Serialize + Send + 'static,
    F: Fn(Context, I) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = std::result::Result<O, workflow::WorkflowError>> + Send + 'static,
{
    Workflow::new(name, version, f)
}

/// The names a service uses: `use tidemark::prelude::*;`.
pub mod prelude {
    pub use crate::flow::{AdvanceOutcome, AdvanceRequest, FlowMachine, Machine, Transition};
    pub use crate::service::{Caller, Config, Database, Service, Tenant};
    pub use crate::sqlite::{Committed, Durability, Migration};
    pub use crate::store::{EventHandler, HandleError, Handler, Typed};
    pub use crate::workflow::{RetryPolicy, RunHandle, RunStatus, StartRequest, StepFailure, WorkflowError};
    pub use crate::{Context, Envelope, Error, Saga, Workflow};
    pub use rusqlite::Connection;
}

/// README's Rust snippets are compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;

/// docs/library.md's Rust snippets too.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/library.md")]
pub struct LibraryGuideDoctests;

/// And docs/testing.md's (the test kit's guide).
#[cfg(doctest)]
#[doc = include_str!("../../../docs/testing.md")]
pub struct TestingGuideDoctests;
