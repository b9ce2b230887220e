//! The stores a service runs on: a [`Backend`] opens a tenant's producer, consumer and workflow
//! stores and says what a handler or a transactional step is given. [`Sqlite`] keeps a folder
//! per tenant with three files; [`Postgres`] keeps three schemas per tenant on one server (and
//! the control tables in a schema of their own), so several service processes on several
//! machines serve the same tenants. The service, its tenants and its loops are generic over the
//! trait; another backend is one implementation of it and one arm of [`AnyTenant`].
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
use tidemark_core::tenancy::ControlStore;
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

    /// Check that the configuration names this backend's store (`invalid_config` otherwise: a
    /// SQLite builder given a PostgreSQL `store`, or the other way round).
    fn check(&self, config: &crate::Config) -> Result<()>;

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
    fn read_stats(&self, stats: &mut Self::Stats, tenant: &TenantInfo, now_ms: i64) -> Result<TenantStats>;

    /// Open (creating on first use) the service's control store: tenants, tokens, consumers.
    fn open_control(&self, config: &crate::Config) -> Result<Box<dyn ControlStore>>;

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
    /// A tenant in schemas of a PostgreSQL server.
    Postgres(Arc<Tenant<Postgres>>),
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
            $crate::backend::AnyTenant::Postgres($tenant) => $body,
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

    fn check(&self, config: &crate::Config) -> Result<()> {
        if config.postgres()?.is_some() {
            return Err(tidemark_core::Error::invalid(
                tidemark_core::error::codes::INVALID_CONFIG,
                "store names a PostgreSQL server: build the service with .postgres(url) (tidemark serve does)",
            ));
        }
        Ok(())
    }

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

    fn read_stats(
        &self,
        stats: &mut crate::stats::StatsReader,
        tenant: &TenantInfo,
        now_ms: i64,
    ) -> Result<TenantStats> {
        stats.read(tenant, now_ms)
    }

    fn open_control(&self, config: &crate::Config) -> Result<Box<dyn ControlStore>> {
        let path = config.data_dir.join(crate::CONTROL_FILE);
        Ok(Box::new(tidemark_store_sqlite::SqliteControl::open(&path, true, config.durability()?)?))
    }

    fn wrap(tenant: Arc<Tenant<Sqlite>>) -> AnyTenant {
        AnyTenant::Sqlite(tenant)
    }

    fn unwrap(tenant: &AnyTenant) -> Option<&Arc<Tenant<Sqlite>>> {
        match tenant {
            AnyTenant::Sqlite(tenant) => Some(tenant),
            AnyTenant::Postgres(_) => None,
        }
    }
}

/// Longest schema prefix of a [`Postgres`] backend, in bytes: what is left of PostgreSQL's 63
/// bytes names a tenant's schemas (see [`Postgres::schema`]).
pub const POSTGRES_PREFIX_BYTES_MAX: usize = 24;

/// Schemas of one PostgreSQL 15+ server (docs/postgres.md, "Serving on PostgreSQL"): the
/// control tables in `<prefix>_control`, and each tenant's producer, inbox and workflow
/// databases as three schemas named by [`Postgres::schema`]. Every process of the service
/// connects to the same server and shares all of it: runs are claimed with `SKIP LOCKED` and
/// leases, outboxes and inboxes take their advisory locks (docs/postgres.md). Registrations may
/// still keep files of their own in the tenant's local folder (the built-in fake payment
/// service does).
#[derive(Debug, Clone)]
pub struct Postgres {
    conn: String,
    prefix: String,
    /// Each tenant's connection string, once its role owns its schemas (made once per process:
    /// a tenant's stores open it several times).
    tenant_conns: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, String>>>,
}

impl Postgres {
    /// The schemas named from `location`'s schema (the prefix: 1..=24 bytes of `a-z`, `0-9`
    /// and `_`, starting with a letter; `invalid_store` otherwise) on its server.
    pub fn new(location: &tidemark_core::location::PostgresLocation) -> Result<Postgres> {
        let prefix = &location.schema;
        let well_formed = prefix.len() <= POSTGRES_PREFIX_BYTES_MAX
            && prefix.starts_with(|c: char| c.is_ascii_lowercase())
            && tidemark_store_postgres::validate_schema_name(prefix).is_ok();
        if !well_formed {
            return Err(tidemark_core::Error::invalid(
                tidemark_core::error::codes::INVALID_STORE,
                format!(
                    "a service's schema prefix must be 1..={POSTGRES_PREFIX_BYTES_MAX} bytes of a-z, 0-9 and _, \
                     starting with a letter; got {prefix:?}"
                ),
            ));
        }
        Ok(Postgres { conn: location.conn.clone(), prefix: prefix.clone(), tenant_conns: Default::default() })
    }

    /// The schema of tenant `tenant_id`'s `database`:
    /// `<prefix>_<tenant id, '-' as '_', cut to fit>_<12 hex of the id's SHA-256>_<p|i|w>`. The
    /// hash keeps two tenant ids apart that read alike (`a-b`, `a_b`); the readable part lets an
    /// operator find a tenant's schemas (`\dn <prefix>_<tenant>*`).
    pub fn schema(&self, tenant_id: &str, database: Database) -> String {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(tenant_id.as_bytes());
        let hash: String = digest.iter().take(6).map(|b| format!("{b:02x}")).collect();
        let letter = match database {
            Database::Producer => 'p',
            Database::Inbox => 'i',
            Database::Workflows => 'w',
        };
        let room = tidemark_store_postgres::SCHEMA_NAME_BYTES_MAX - self.prefix.len() - hash.len() - 4;
        let readable: String = tenant_id.chars().map(|c| if c == '-' { '_' } else { c }).take(room).collect();
        format!("{}_{readable}_{hash}_{letter}", self.prefix)
    }

    /// The role of tenant `tenant_id` (its schemas' common name,
    /// `<prefix>_<tenant id, cut to fit>_<12 hex>`): it owns the tenant's three schemas, and the
    /// service's connections for the tenant act as it (docs/postgres.md, "Tenants").
    pub fn role(&self, tenant_id: &str) -> String {
        let schema = self.schema(tenant_id, Database::Producer);
        schema[..schema.len() - 2].to_string()
    }

    /// The connection string of `tenant`'s stores: the service's, acting as the tenant's role,
    /// which is made first (when missing, once per process) the owner of the tenant's three
    /// schemas.
    fn tenant_conn(&self, tenant: &TenantInfo) -> Result<String> {
        let known = self.tenant_conns.lock().unwrap_or_else(|e| e.into_inner()).get(&tenant.id).cloned();
        if let Some(conn) = known {
            return Ok(conn);
        }
        let role = self.role(&tenant.id);
        let schemas = [Database::Producer, Database::Inbox, Database::Workflows].map(|d| self.schema(&tenant.id, d));
        tidemark_store_postgres::ensure_owner_role(&self.conn, &role, &schemas)?;
        let conn = tidemark_store_postgres::conn_as_role(&self.conn, &role)?;
        self.tenant_conns.lock().unwrap_or_else(|e| e.into_inner()).insert(tenant.id.clone(), conn.clone());
        Ok(conn)
    }

    /// The backend a service's `store` URL names (`postgres://user@host/db?schema=<prefix>`):
    /// `invalid_store` for a URL that is not PostgreSQL's, a bad prefix as [`Postgres::new`].
    pub fn from_url(url: &str) -> Result<Postgres> {
        match tidemark_core::location::StoreLocation::parse(url)? {
            tidemark_core::location::StoreLocation::Postgres(location) => Postgres::new(&location),
            tidemark_core::location::StoreLocation::Sqlite(_) => Err(tidemark_core::Error::invalid(
                tidemark_core::error::codes::INVALID_STORE,
                "a service's PostgreSQL store is a postgres:// URL; a SQLite service's data is its data folder",
            )),
        }
    }

    /// The driver's connection string (the URL without its `schema`).
    pub fn conn(&self) -> &str {
        &self.conn
    }

    /// A backend that never opens (a builder whose URL was refused carries the error to build).
    pub(crate) fn unusable() -> Postgres {
        Postgres { conn: String::new(), prefix: String::new(), tenant_conns: Default::default() }
    }

    /// The schema prefix: every schema of the service starts with it and `_`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The schema of the control tables: `<prefix>_control`.
    pub fn control_schema(&self) -> String {
        format!("{}_control", self.prefix)
    }
}

/// What a PostgreSQL tenant's counts are read through: a connection of its own (made on first
/// use, made again after an error), never a store's.
#[derive(Default)]
pub struct PgStatsReader {
    client: Option<postgres::Client>,
}

impl Drop for PgStatsReader {
    /// `postgres::Client`'s own drop closes the connection by blocking on a runtime of its own,
    /// which panics on a thread that drives a tokio runtime, and the tenant holding this reader
    /// is dropped on one when the service stops (`tidemark serve` on PostgreSQL exited 101 after
    /// SIGTERM, found by the chaos harness). There the client is closed on a thread of its own
    /// (not waited for: the connection's end is a `Terminate` message, and at worst the server
    /// sees the socket close with the process).
    fn drop(&mut self) {
        /// Forgets (leaks until the process ends) a client still in it when dropped: what happens
        /// here if the closing thread cannot start and the closure is dropped on this thread.
        struct Unclosed(Option<postgres::Client>);
        impl Drop for Unclosed {
            fn drop(&mut self) {
                std::mem::forget(self.0.take());
            }
        }
        let Some(client) = self.client.take() else { return };
        if tokio::runtime::Handle::try_current().is_err() {
            return drop(client);
        }
        let mut unclosed = Unclosed(Some(client));
        let closing =
            std::thread::Builder::new().name("tidemark-pg-stats-close".into()).spawn(move || drop(unclosed.0.take()));
        if let Err(e) = closing {
            tracing::warn!(error = %e, "cannot start a thread to close the stats connection; left to the process's end");
        }
    }
}

impl Backend for Postgres {
    type Tx = tidemark_store_postgres::ApplyTransaction;
    type Producer = tidemark_store_postgres::PgProducer;
    type Endpoints = tidemark_store_postgres::PgEndpoints;
    type Consumer = tidemark_store_postgres::PgConsumer;
    type Workflows = tidemark_store_postgres::PgWorkflows;
    type Migration = tidemark_store_postgres::Migration;
    type Stats = PgStatsReader;

    fn check(&self, config: &crate::Config) -> Result<()> {
        match config.postgres()? {
            Some(location) if location.conn == self.conn && location.schema == self.prefix => Ok(()),
            _ => Err(tidemark_core::Error::invalid(
                tidemark_core::error::codes::INVALID_CONFIG,
                "store must be the PostgreSQL URL the builder was given (.postgres(url) sets it; a later .config(...) \
                 replaced it)",
            )),
        }
    }

    fn validate_migrations(migrations: &[Self::Migration]) -> Result<()> {
        tidemark_store_postgres::validate_migrations(migrations)
    }

    fn open_producer(
        &self,
        tenant: &TenantInfo,
        database: Database,
        source: &str,
        migrations: &[Self::Migration],
        now_ms: i64,
    ) -> Result<(Self::Producer, Self::Endpoints)> {
        let schema = self.schema(&tenant.id, database);
        let conn = self.tenant_conn(tenant)?;
        if database == Database::Workflows {
            // The workflow tables first, as on SQLite.
            drop(tidemark_store_postgres::PgWorkflows::init(&conn, &schema)?);
        }
        let mut store = tidemark_store_postgres::PgProducer::init(&conn, &schema, source)?;
        tidemark_store_postgres::apply_migrations(store.client(), &schema, migrations, now_ms)?;
        Ok((store, tidemark_store_postgres::PgEndpoints::new(&conn)))
    }

    fn open_consumer(
        &self,
        tenant: &TenantInfo,
        database: Database,
        migrations: &[Self::Migration],
        now_ms: i64,
    ) -> Result<Self::Consumer> {
        let schema = self.schema(&tenant.id, database);
        let conn = self.tenant_conn(tenant)?;
        let mut store = tidemark_store_postgres::PgConsumer::init(&conn, &schema, RetentionPolicy::default())?;
        tidemark_store_postgres::apply_migrations(store.client(), &schema, migrations, now_ms)?;
        Ok(store)
    }

    fn open_workflows(&self, tenant: &TenantInfo) -> Result<Self::Workflows> {
        tidemark_store_postgres::PgWorkflows::init(
            &self.tenant_conn(tenant)?,
            &self.schema(&tenant.id, Database::Workflows),
        )
    }

    fn endpoint(&self, tenant: &TenantInfo, database: Database) -> String {
        // The endpoints of this backend's relay are consumer schemas on its server.
        self.schema(&tenant.id, database)
    }

    fn open_stats(&self, _tenant: &TenantInfo) -> Result<PgStatsReader> {
        Ok(PgStatsReader::default())
    }

    fn read_stats(&self, stats: &mut PgStatsReader, tenant: &TenantInfo, now_ms: i64) -> Result<TenantStats> {
        use tidemark_store_postgres::stats;
        let client = match &mut stats.client {
            Some(client) => client,
            empty => empty.insert(tidemark_store_postgres::connect(&self.conn)?),
        };
        let read = (|| {
            let (producer, inbox, workflows) = (
                self.schema(&tenant.id, Database::Producer),
                self.schema(&tenant.id, Database::Inbox),
                self.schema(&tenant.id, Database::Workflows),
            );
            let mut outbox = stats::outbox_counts(client, &producer, now_ms)?;
            outbox.absorb(stats::outbox_counts(client, &workflows, now_ms)?);
            let mut inboxes = stats::inbox_counts(client, &inbox)?;
            inboxes.extend(stats::inbox_counts(client, &workflows)?);
            let runs = stats::run_counts(client, &workflows)?;
            Ok(TenantStats { tenant: tenant.id.clone(), outbox, inbox: inboxes, runs, wal_bytes: Default::default() })
        })();
        if read.is_err() {
            // A closed connection (a restart, `pg_terminate_backend`): a new one next time.
            stats.client = None;
        }
        read
    }

    fn open_control(&self, _config: &crate::Config) -> Result<Box<dyn ControlStore>> {
        Ok(Box::new(tidemark_store_postgres::PgControl::open(&self.conn, &self.control_schema(), true)?))
    }

    fn wrap(tenant: Arc<Tenant<Postgres>>) -> AnyTenant {
        AnyTenant::Postgres(tenant)
    }

    fn unwrap(tenant: &AnyTenant) -> Option<&Arc<Tenant<Postgres>>> {
        match tenant {
            AnyTenant::Postgres(tenant) => Some(tenant),
            AnyTenant::Sqlite(_) => None,
        }
    }
}
