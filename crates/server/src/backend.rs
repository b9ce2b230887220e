//! The stores a service runs on: a [`Backend`] opens a tenant's producer, consumer and workflow
//! stores and says what a handler or a transactional step is given. [`Sqlite`] (one folder per
//! tenant, three files) is the only backend so far; the service, its tenants and its loops are
//! generic over the trait, so another backend is one implementation of it and one arm of
//! [`AnyTenant`].
//!
//! The HTTP layer is not generic (its routes are declared once, with their OpenAPI documents):
//! a request's tenant is an [`AnyTenant`], and [`on_tenant!`](crate::on_tenant) runs the same
//! code on whichever backend's tenant it is.

use std::path::PathBuf;
use std::sync::Arc;

use tidemark_core::policy::RetentionPolicy;
use tidemark_core::queue::QueueStore;
use tidemark_core::schedule::ScheduleStore;
use tidemark_core::store::{ConsumerStore, Endpoints, ProducerStore};
use tidemark_core::workflow::WorkflowStore;
use tidemark_core::Result;
use tidemark_store_sqlite::{
    apply_migrations, Migration, SqliteConsumer, SqliteEndpoints, SqliteProducer, SqliteWorkflows,
};

use crate::registry::{Database, TenantInfo};
use crate::stats::TenantStats;
use crate::tenant::Tenant;

/// What a service's tenants are stored on.
pub trait Backend: Sized + Send + Sync + 'static {
    /// What a consumer handler and a transactional step are given (the open transaction).
    type Tx: ?Sized + 'static;
    /// A producer store (flows, outbox, deliveries).
    type Producer: ProducerStore + Send + 'static;
    /// The endpoints a producer's relay delivers to on this backend (the tenant's own inboxes).
    type Endpoints: Endpoints + Send + 'static;
    /// A consumer store (inboxes and the user's projections).
    type Consumer: ConsumerStore<Target = Self::Tx> + Send + 'static;
    /// The workflow store (runs, journals, queues, schedules).
    type Workflows: WorkflowStore<Target = Self::Tx> + QueueStore + ScheduleStore + Send + 'static;
    /// A migration of the user's own tables.
    type Migration: Send + Sync + 'static;
    /// What the counts of `/metrics` and the dashboard are read through (apart from the store
    /// threads, so a scrape never waits for a group commit).
    type Stats: Send + 'static;

    /// Check a database's list of user migrations (names, order) before anything opens.
    fn validate_migrations(migrations: &[Self::Migration]) -> Result<()>;

    /// Open (creating on first use, never resetting) the producer store of `database` with
    /// producer id `source`, run `migrations` on it, and make the endpoints its relay delivers
    /// to.
    fn open_producer(
        &self,
        tenant: &TenantInfo,
        database: Database,
        source: &str,
        migrations: &[Self::Migration],
        now_ms: i64,
    ) -> Result<(Self::Producer, Self::Endpoints)>;

    /// Open (creating on first use, never resetting) the consumer store of `database` and run
    /// `migrations` on it.
    fn open_consumer(
        &self,
        tenant: &TenantInfo,
        database: Database,
        migrations: &[Self::Migration],
        now_ms: i64,
    ) -> Result<Self::Consumer>;

    /// Open the workflow store (created on first use). Runs on the workflow writer's thread.
    fn open_workflows(&self, tenant: &TenantInfo) -> Result<Self::Workflows>;

    /// The endpoint that names `database`'s inbox in a subscription of this tenant.
    fn endpoint(&self, tenant: &TenantInfo, database: Database) -> String;

    /// Open what the tenant's counts are read through (after its stores exist).
    fn open_stats(&self, tenant: &TenantInfo) -> Result<Self::Stats>;

    /// Read the tenant's counts (blocking; never on a store thread).
    fn read_stats(&self, stats: &Self::Stats, tenant: &TenantInfo, now_ms: i64) -> Result<TenantStats>;

    /// This backend's tenant, as the HTTP layer holds it.
    fn wrap(tenant: Arc<Tenant<Self>>) -> AnyTenant;

    /// The tenant, when it is this backend's.
    fn unwrap(tenant: &AnyTenant) -> Option<&Arc<Tenant<Self>>>;
}

/// An open tenant of any backend: what the HTTP layer, the control of tenants and the
/// dashboard hold. Use [`on_tenant!`](crate::on_tenant) to run code on it.
#[derive(Clone)]
pub enum AnyTenant {
    /// A tenant on SQLite files.
    Sqlite(Arc<Tenant<Sqlite>>),
}

impl AnyTenant {
    /// The tenant's id.
    pub fn id(&self) -> &str {
        crate::on_tenant!(self, tenant => &tenant.id)
    }

    /// The tenant's counts (`/metrics`, the dashboard), read apart from its store threads.
    pub async fn stats(&self) -> Result<TenantStats> {
        crate::on_tenant!(self, tenant => TenantStats::read(tenant).await)
    }
}

/// Run `$body` with `$tenant` bound to the `Arc<Tenant<B>>` inside an [`AnyTenant`], whichever
/// backend `B` it is (the body is compiled once per backend).
#[macro_export]
macro_rules! on_tenant {
    ($any:expr, $tenant:ident => $body:expr) => {
        match $any {
            $crate::backend::AnyTenant::Sqlite($tenant) => $body,
        }
    };
}

/// SQLite files: a folder per tenant, `producer.db`, `inbox.db` and `workflows.db`, each with
/// the configured durability (WAL; `synchronous=FULL` by default).
#[derive(Debug, Clone, Copy, Default)]
pub struct Sqlite;

impl Sqlite {
    fn path(tenant: &TenantInfo, database: Database) -> PathBuf {
        tenant.dir.join(database.file_name())
    }
}

impl Backend for Sqlite {
    type Tx = rusqlite::Connection;
    type Producer = SqliteProducer;
    type Endpoints = SqliteEndpoints;
    type Consumer = SqliteConsumer;
    type Workflows = SqliteWorkflows;
    type Migration = Migration;
    type Stats = crate::stats::StatsReader;

    fn validate_migrations(migrations: &[Migration]) -> Result<()> {
        tidemark_store_sqlite::validate_migrations(migrations)
    }

    fn open_producer(
        &self,
        tenant: &TenantInfo,
        database: Database,
        source: &str,
        migrations: &[Migration],
        now_ms: i64,
    ) -> Result<(SqliteProducer, SqliteEndpoints)> {
        let path = Self::path(tenant, database);
        if database == Database::Workflows {
            // The workflow tables first: a transactional step commits its event with its
            // journal entry, in this file.
            drop(SqliteWorkflows::init_with(&path, tenant.durability)?);
        }
        drop(SqliteProducer::init(&path, source)?);
        let mut store = SqliteProducer::open_with(&path, tenant.durability)?;
        apply_migrations(store.connection(), migrations, now_ms)?;
        Ok((store, SqliteEndpoints::new(tenant.durability)))
    }

    fn open_consumer(
        &self,
        tenant: &TenantInfo,
        database: Database,
        migrations: &[Migration],
        now_ms: i64,
    ) -> Result<SqliteConsumer> {
        let path = Self::path(tenant, database);
        // Creates the file on first use; never resets (the first horizon is kept).
        drop(SqliteConsumer::init(&path, RetentionPolicy::default())?);
        let store = SqliteConsumer::open_with(&path, tenant.durability)?;
        apply_migrations(store.connection(), migrations, now_ms)?;
        Ok(store)
    }

    fn open_workflows(&self, tenant: &TenantInfo) -> Result<SqliteWorkflows> {
        SqliteWorkflows::open_with(&Self::path(tenant, Database::Workflows), tenant.durability)
    }

    fn endpoint(&self, tenant: &TenantInfo, database: Database) -> String {
        Self::path(tenant, database).to_string_lossy().into_owned()
    }

    fn open_stats(&self, tenant: &TenantInfo) -> Result<crate::stats::StatsReader> {
        crate::stats::StatsReader::open(&tenant.dir)
    }

    fn read_stats(&self, stats: &crate::stats::StatsReader, tenant: &TenantInfo, now_ms: i64) -> Result<TenantStats> {
        stats.read(tenant, now_ms)
    }

    fn wrap(tenant: Arc<Tenant<Sqlite>>) -> AnyTenant {
        AnyTenant::Sqlite(tenant)
    }

    fn unwrap(tenant: &AnyTenant) -> Option<&Arc<Tenant<Sqlite>>> {
        match tenant {
            AnyTenant::Sqlite(tenant) => Some(tenant),
        }
    }
}
