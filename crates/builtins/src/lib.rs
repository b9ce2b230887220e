//! The domain `tidemark serve` ships with, registered through tidemark's public API exactly as a
//! user registers theirs (this crate depends on the `tidemark` facade alone):
//!
//! - the reservation machine (`tidemark::reservation`) and its projection handler
//!   `reservation` ([`reservation`]), with its tables as a migration of the inbox database;
//! - `record` (the inbox as a durable, ordered, deduplicated log) and `workflows` (an event
//!   wakes the run its payload names) handlers;
//! - the order saga and `sleepy_order` ([`order`], [`workflows`]) with their tables as a
//!   migration of the workflow database and a fake payment service per tenant;
//! - `PUT /v1/stock/{sku}`, the order saga's stock ([`routes`]).
#![warn(missing_docs)]

use std::sync::Arc;

use tidemark::service::{Config, ServiceBuilder};
use tidemark::sqlite::RunEventHandler;
use tidemark::store::RecordHandler;
use tidemark::workflow::RetryPolicy;
use tidemark::{Database, Result, Service};

pub mod order;
pub mod reservation;
pub mod routes;
pub mod workflows;

/// How the built-ins are set up (from the configuration of `tidemark serve`).
#[derive(Debug, Clone, PartialEq)]
pub struct BuiltinOptions {
    /// The reservation handler also decodes payload schema v2 (`consumers.support_v2`).
    pub support_v2: bool,
    /// The step retry policy of the built-in workflows (`workers.max_attempts`,
    /// `workers.retry_delay_ms`).
    pub retry: RetryPolicy,
}

impl BuiltinOptions {
    /// The options a configuration sets.
    pub fn from_config(config: &Config) -> Result<BuiltinOptions> {
        Ok(BuiltinOptions {
            support_v2: config.consumers.support_v2,
            retry: workflows::retry_policy(config.workers.max_attempts, config.workers.retry_delay_ms)?,
        })
    }
}

/// The names of the built-in handlers.
pub const RESERVATION_HANDLER: &str = "reservation";
/// See [`RESERVATION_HANDLER`].
pub const RECORD_HANDLER: &str = "record";
/// See [`RESERVATION_HANDLER`].
pub const WORKFLOWS_HANDLER: &str = "workflows";

/// Register every built-in with `builder`.
pub fn register(builder: ServiceBuilder, options: &BuiltinOptions) -> ServiceBuilder {
    let retry = options.retry.clone();
    builder
        .flow(tidemark::reservation::ReservationMachine)
        .migration(Database::Inbox, reservation::migration())
        .handler(RESERVATION_HANDLER, reservation::ReservationHandler::new(options.support_v2))
        .handler(RECORD_HANDLER, RecordHandler)
        .handler_in(Database::Workflows, WORKFLOWS_HANDLER, RunEventHandler::new())
        .migration(Database::Workflows, order::tables::migration())
        .tenant_workflows(workflows::BUILTINS, move |tenant| {
            let payments = order::FakePayments::open(&tenant.dir.join("payments.db"))?;
            workflows::definitions::<tidemark::sqlite::SqliteWorkflows>(Arc::new(payments), &retry)
        })
        .routes(routes::stock())
}

/// Register every built-in with a service on PostgreSQL: the same machine, handler names,
/// workflows and route as [`register`], on PostgreSQL's tables and transactions (the fake
/// payment service still keeps its log in the tenant's local folder: it stands for another
/// company's service, not for tidemark's data).
pub fn register_postgres(
    builder: ServiceBuilder<tidemark::service::Postgres>,
    options: &BuiltinOptions,
) -> ServiceBuilder<tidemark::service::Postgres> {
    let retry = options.retry.clone();
    builder
        .flow(tidemark::reservation::ReservationMachine)
        .migration(Database::Inbox, reservation::postgres::migration())
        .handler(RESERVATION_HANDLER, reservation::postgres::ReservationHandler::new(options.support_v2))
        .handler(RECORD_HANDLER, RecordHandler)
        .handler_in(Database::Workflows, WORKFLOWS_HANDLER, tidemark::postgres::RunEventHandler::new())
        .migration(Database::Workflows, order::postgres::migration())
        .tenant_workflows(workflows::BUILTINS, move |tenant| {
            let payments = order::FakePayments::open(&tenant.dir.join("payments.db"))?;
            workflows::definitions::<tidemark::postgres::PgWorkflows>(Arc::new(payments), &retry)
        })
        .routes(routes::stock_postgres())
}

/// What `tidemark serve` runs: the built-ins on SQLite files, or on PostgreSQL when the
/// configuration's `store` names a server.
pub enum Served {
    /// On SQLite files in the data folder.
    Sqlite(Service),
    /// On schemas of a PostgreSQL server.
    Postgres(tidemark::postgres::Service),
}

impl Served {
    /// [`Service::serve_blocking`] of whichever it is.
    pub fn serve_blocking(self) -> Result<serde_json::Value> {
        match self {
            Served::Sqlite(service) => service.serve_blocking(),
            Served::Postgres(service) => service.serve_blocking(),
        }
    }
}

/// `tidemark serve`: a service with `config` and every built-in registered, on the store the
/// configuration names.
pub fn serve(config: Config) -> Result<Served> {
    let options = BuiltinOptions::from_config(&config)?;
    if config.postgres()?.is_some() {
        let url = config.store.clone();
        let builder = Service::builder().config(config).postgres(&url);
        return Ok(Served::Postgres(register_postgres(builder, &options).build()?));
    }
    Ok(Served::Sqlite(service(config)?))
}

/// A service on SQLite files with `config` and every built-in registered.
pub fn service(config: Config) -> Result<Service> {
    let options = BuiltinOptions::from_config(&config)?;
    register(Service::builder().config(config), &options).build()
}
