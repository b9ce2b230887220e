//! The stores the outbox and inbox commands (`init`, `advance`, `subscribe`, `relay`, `receive`,
//! `consume`, `apply`, `drain`, `snapshot`, `outbox ...`, `inbox ...`, `prune`,
//! `rename-consumer`) and `experiment` work on: a SQLite file or a schema on a PostgreSQL
//! server, named as the workflow commands' `--store` is (docs/cli.md, "Stores"; parsed by
//! [`location`]).
//!
//! [`Producer`] implements [`ProducerStore`] and [`Endpoints`] is the relay's endpoints, each by
//! handing the call to the backend's store, so one command body serves both backends. A consumer
//! store's handlers differ by backend (a `rusqlite::Connection` or an `ApplyTransaction`), so
//! [`Consumer`] offers the consumer calls the commands make, the built-in reservation handler
//! and its tables chosen per backend.

use std::path::Path;

use serde_json::Value;
use tidemark_builtins::reservation::{self, postgres as reservation_pg, DuplicateEffect, Effect, ProjectionRow};
use tidemark_core::error::codes;
use tidemark_core::flow::{AdvanceOutcome, AdvanceRequest, FlowMachine};
use tidemark_core::location::{PostgresLocation, StoreLocation};
use tidemark_core::policy::RetentionPolicy;
use tidemark_core::reservation::ReservationMachine;
use tidemark_core::store::{
    ConsumerSnapshot, ConsumerStore, Delivery, DeliveryAction, DeliveryEntry, DeliveryResult, DeliveryStatus,
    DrainReport, DrainScope, DueQuery, FlowCursor, FlowRecord, InboxEntry, InboxStatus, OutboxPruneReport,
    ProducerIdentity, ProducerSnapshot, PruneReport, ReceiveOutcome, RedeliverReport, RenameReport, Subscription,
};
use tidemark_core::{Envelope, Error, Result};
use tidemark_store_postgres::{PgConsumer, PgEndpoints, PgProducer};
use tidemark_store_sqlite::{SqliteConsumer, SqliteEndpoints, SqliteProducer};

use tidemark_store_sqlite::Durability;

use crate::Context;

/// The `--store` URL of `schema` on the server `conn` (a `PostgresLocation::conn`) names, with
/// its password (what a child process connects with).
pub fn schema_url(conn: &str, schema: &str) -> String {
    format!("{conn}{}schema={schema}", if conn.contains('?') { '&' } else { '?' })
}

/// Parse a `--store` (or a `--producer` / `--consumer-db`): a SQLite path or a `postgres://`
/// URL. `--durability` other than `full` on a PostgreSQL store is `invalid_argument` (the server
/// has its own durability settings).
pub fn location(ctx: &Context, db: &Path) -> Result<StoreLocation> {
    let location = match db.to_str() {
        Some(text) => StoreLocation::parse(text)?,
        None => StoreLocation::Sqlite(db.to_path_buf()),
    };
    if matches!(location, StoreLocation::Postgres(_)) && ctx.durability != Durability::Full {
        return Err(Error::invalid(
            codes::INVALID_ARGUMENT,
            "--durability applies to SQLite files only; a PostgreSQL store commits with the server's own \
             durability (fsync, synchronous_commit)",
        ));
    }
    Ok(location)
}

/// A producer store: a SQLite file or a PostgreSQL schema.
pub enum Producer {
    /// A SQLite file.
    Sqlite(SqliteProducer),
    /// A schema on a PostgreSQL server.
    Postgres(Box<PgProducer>, PostgresLocation),
}

/// Call `$call` on the backend's store, whichever it is.
macro_rules! each {
    ($value:expr, $enum:ident, |$s:ident| $call:expr) => {
        match $value {
            $enum::Sqlite($s) => $call,
            $enum::Postgres($s, _) => $call,
        }
    };
}

impl Producer {
    /// Open an existing producer (never creates one: a missing file or schema is
    /// `not_initialized`).
    pub fn open(ctx: &Context, given: &Path) -> Result<Producer> {
        Producer::open_at(location(ctx, given)?, ctx.durability)
    }

    /// [`Producer::open`] of a parsed location (`durability` applies to a SQLite file).
    pub fn open_at(location: StoreLocation, durability: Durability) -> Result<Producer> {
        match location {
            StoreLocation::Sqlite(path) => Ok(Producer::Sqlite(SqliteProducer::open_with(&path, durability)?)),
            StoreLocation::Postgres(pg) => {
                Ok(Producer::Postgres(Box::new(PgProducer::open(&pg.conn, &pg.schema)?), pg))
            }
        }
    }

    /// Create (or reopen, never reset) a producer of `source`.
    pub fn init(ctx: &Context, given: &Path, source: &str) -> Result<Producer> {
        Producer::init_at(location(ctx, given)?, source)
    }

    /// [`Producer::init`] of a parsed location.
    pub fn init_at(location: StoreLocation, source: &str) -> Result<Producer> {
        match location {
            StoreLocation::Sqlite(path) => Ok(Producer::Sqlite(SqliteProducer::init(&path, source)?)),
            StoreLocation::Postgres(pg) => {
                Ok(Producer::Postgres(Box::new(PgProducer::init(&pg.conn, &pg.schema, source)?), pg))
            }
        }
    }

    /// The relay's endpoints for this producer's subscribers: consumer files, or consumer schemas
    /// on the producer's own server.
    pub fn endpoints(&self, ctx: &Context) -> Endpoints {
        match self {
            Producer::Sqlite(_) => Endpoints::files(ctx.durability),
            Producer::Postgres(_, pg) => Endpoints::schemas(&pg.conn),
        }
    }

    /// Where a subscriber of this producer is delivered: the endpoint string stored in the
    /// subscription (a consumer file's absolute path, a consumer schema's name on the producer's
    /// server, or a `postgres://` endpoint for a consumer schema on any other server, or on any
    /// server for a SQLite producer) and the consumer store there, opened to check it.
    pub fn consumer_endpoint(&self, ctx: &Context, given: &Path) -> Result<(String, Consumer)> {
        let wrong = |why: &str| Error::invalid(codes::INVALID_ENDPOINT, why.to_string());
        match (self, location(ctx, given)?) {
            (Producer::Sqlite(_), StoreLocation::Sqlite(path)) => {
                let consumer = Consumer::open(ctx, given, false)?;
                let endpoint = std::fs::canonicalize(&path).map_err(|e| {
                    Error::invalid(codes::INVALID_ARGUMENT, format!("cannot resolve {}: {e}", path.display()))
                })?;
                Ok((endpoint.to_string_lossy().into_owned(), consumer))
            }
            (Producer::Postgres(_, producer), StoreLocation::Postgres(pg)) if pg.conn == producer.conn => {
                let consumer = Consumer::open(ctx, given, false)?;
                Ok((pg.schema, consumer))
            }
            (_, StoreLocation::Postgres(_)) => {
                // A consumer schema on another server (or any, for a SQLite producer): a
                // `postgres://` endpoint, which names no password (the delivering side has it).
                let endpoint = given.to_string_lossy().into_owned();
                let tidemark_core::endpoint::Endpoint::Postgres { schema, conn, .. } =
                    tidemark_core::endpoint::Endpoint::parse(&endpoint)?
                else {
                    return Err(wrong("a postgres:// endpoint is postgres://user@host:port/database?schema=S"));
                };
                let password = pgpassword();
                let location = PostgresLocation {
                    conn: tidemark_store_postgres::endpoint_with_password(&conn, password.as_deref())?,
                    schema,
                    masked: tidemark_core::endpoint::mask(&endpoint),
                };
                let consumer = Consumer::open_at(StoreLocation::Postgres(location), ctx.durability, false)?;
                Ok((endpoint, consumer))
            }
            (Producer::Postgres(..), StoreLocation::Sqlite(_)) => Err(wrong(
                "a PostgreSQL producer delivers to consumer schemas on its own server \
                 (--endpoint postgres://...?schema=S), not to files",
            )),
        }
    }

    /// See `SqliteProducer::subscribe_checked`.
    pub fn subscribe_checked(
        &mut self,
        subscription: &Subscription,
        from_start: bool,
        now_ms: i64,
        new_endpoint_has_received: Option<bool>,
    ) -> Result<u64> {
        each!(self, Producer, |p| p.subscribe_checked(subscription, from_start, now_ms, new_endpoint_has_received))
    }

    /// See `SqliteProducer::rotate_generation` (after a restore from a backup).
    pub fn rotate_generation(&mut self) -> Result<ProducerIdentity> {
        each!(self, Producer, |p| p.rotate_generation())
    }

    /// Rename a subscriber and its open deliveries (see `SqliteProducer::rename_subscription`).
    pub fn rename_subscription(&mut self, from: &str, to: &str) -> Result<u64> {
        each!(self, Producer, |p| p.rename_subscription(from, to))
    }

    /// Create the user's own `orders` table next to the producer's tables (the experiment's
    /// dual-write scenarios), if it is not there.
    pub fn install_orders(&mut self) -> Result<()> {
        match self {
            Producer::Sqlite(p) => tidemark_store_sqlite::example::install_orders(p.connection()),
            Producer::Postgres(p, pg) => tidemark_store_postgres::example::install_orders(p.client(), &pg.schema),
        }
    }

    /// Every order as `(order_id, quantity)`.
    pub fn orders(&mut self) -> Result<Vec<(String, i64)>> {
        match self {
            Producer::Sqlite(p) => tidemark_store_sqlite::example::orders(p.connection()),
            Producer::Postgres(p, pg) => tidemark_store_postgres::example::orders(p.client(), &pg.schema),
        }
    }

    /// WRONG on purpose (the deliberately wrong dual write of the experiment): commit a business
    /// row in a transaction of its own, with no event.
    pub fn insert_order_without_event(&mut self, order_id: &str, quantity: i64) -> Result<()> {
        match self {
            Producer::Sqlite(p) => tidemark_store_sqlite::example::insert_order(p.connection(), order_id, quantity),
            Producer::Postgres(p, pg) => {
                tidemark_store_postgres::example::insert_order(p.client(), &pg.schema, order_id, quantity)
            }
        }
    }

    /// Insert the business row `order_id` and advance `request` (a reservation flow) in one
    /// producer transaction; call `before_end` with the transaction still open, then commit it
    /// when `commit`, else roll it back. The advance's answer either way.
    pub fn advance_with_order(
        &mut self,
        order_id: &str,
        quantity: i64,
        request: &AdvanceRequest,
        commit: bool,
        before_end: &mut dyn FnMut(),
        now_ms: i64,
    ) -> Result<AdvanceOutcome> {
        match self {
            Producer::Sqlite(p) => {
                let tx = p.begin()?;
                tidemark_store_sqlite::example::insert_order(&tx, order_id, quantity)?;
                let outcome = tx.advance(&ReservationMachine, request, now_ms)?;
                before_end();
                if commit {
                    tx.commit()?;
                }
                Ok(outcome)
            }
            Producer::Postgres(p, pg) => {
                let mut tx = p.client().transaction()?;
                tidemark_store_postgres::example::insert_order(&mut tx, &pg.schema, order_id, quantity)?;
                let outcome =
                    tidemark_store_postgres::advance_in(&mut tx, &pg.schema, &ReservationMachine, request, now_ms)?;
                before_end();
                if commit {
                    tx.commit()?;
                }
                Ok(outcome)
            }
        }
    }
}

impl tidemark_core::store::ProducerStore for Producer {
    fn identity(&self) -> &ProducerIdentity {
        each!(self, Producer, |p| p.identity())
    }

    fn advance_batch(
        &mut self,
        machine: &dyn FlowMachine,
        requests: &[AdvanceRequest],
        now_ms: i64,
    ) -> Result<Vec<AdvanceOutcome>> {
        each!(self, Producer, |p| p.advance_batch(machine, requests, now_ms))
    }

    fn subscribe(&mut self, subscription: &Subscription, from_start: bool, now_ms: i64) -> Result<u64> {
        each!(self, Producer, |p| p.subscribe(subscription, from_start, now_ms))
    }

    fn subscriptions(&self) -> Result<Vec<Subscription>> {
        each!(self, Producer, |p| p.subscriptions())
    }

    fn due_deliveries(
        &mut self,
        now_ms: i64,
        limit: usize,
        event_id: Option<&str>,
        consumers: Option<&[String]>,
    ) -> Result<Vec<Delivery>> {
        each!(self, Producer, |p| p.due_deliveries(now_ms, limit, event_id, consumers))
    }

    fn pick_due(&mut self, query: &DueQuery<'_>) -> Result<Vec<Delivery>> {
        each!(self, Producer, |p| p.pick_due(query))
    }

    fn overtaking(&mut self, batch: &[Delivery], in_flight: &[(i64, String)]) -> Result<Vec<(i64, String)>> {
        each!(self, Producer, |p| p.overtaking(batch, in_flight))
    }

    fn record_deliveries(&mut self, results: &[DeliveryResult], now_ms: i64) -> Result<()> {
        each!(self, Producer, |p| p.record_deliveries(results, now_ms))
    }

    fn deliveries(&self, status: Option<DeliveryStatus>, limit: usize) -> Result<Vec<DeliveryEntry>> {
        each!(self, Producer, |p| p.deliveries(status, limit))
    }

    fn resolve_delivery(
        &mut self,
        event_id: &str,
        consumer_id: &str,
        action: DeliveryAction,
        reason: &str,
        now_ms: i64,
    ) -> Result<DeliveryEntry> {
        each!(self, Producer, |p| p.resolve_delivery(event_id, consumer_id, action, reason, now_ms))
    }

    fn redeliver(&mut self, consumer_id: &str, from_event_id: Option<&str>) -> Result<RedeliverReport> {
        each!(self, Producer, |p| p.redeliver(consumer_id, from_event_id))
    }

    fn flow(&self, flow_id: &str) -> Result<Option<FlowRecord>> {
        each!(self, Producer, |p| p.flow(flow_id))
    }

    fn prune_delivered(&mut self, retention_ms: i64, batch_rows: usize, now_ms: i64) -> Result<OutboxPruneReport> {
        each!(self, Producer, |p| p.prune_delivered(retention_ms, batch_rows, now_ms))
    }

    fn snapshot(&self, rows_max: usize) -> Result<ProducerSnapshot> {
        each!(self, Producer, |p| p.snapshot(rows_max))
    }
}

/// The relay's endpoints: consumer files for a producer file, and consumer schemas (by name on
/// a producer schema's own server, or `postgres://` endpoints on any, for either backend).
pub struct Endpoints {
    files: Option<SqliteEndpoints>,
    schemas: PgEndpoints,
}

impl Endpoints {
    /// A producer file's: consumer files, and `postgres://` endpoints.
    pub fn files(durability: Durability) -> Endpoints {
        Endpoints {
            files: Some(SqliteEndpoints::new(durability)),
            schemas: PgEndpoints::remote().with_password(pgpassword()),
        }
    }

    /// A producer schema's on the server `conn` names: its schemas, and `postgres://` endpoints.
    pub fn schemas(conn: &str) -> Endpoints {
        Endpoints { files: None, schemas: PgEndpoints::new(conn).with_password(pgpassword()) }
    }
}

/// The password of `postgres://` endpoints for the commands (`subscribe`'s check, `relay`), run
/// by the operator: the environment's `PGPASSWORD`, when set. (`tidemark serve` connects only as
/// the users and servers its `relay.postgres` lists, with their passwords.)
fn pgpassword() -> Option<String> {
    std::env::var("PGPASSWORD").ok()
}

impl tidemark_core::store::Endpoints for Endpoints {
    fn deliver(&mut self, endpoint: &str, items: &[(&str, &Envelope)], now_ms: i64) -> Result<Vec<ReceiveOutcome>> {
        let kind = tidemark_core::endpoint::kind_of(endpoint);
        match &mut self.files {
            Some(files) if !matches!(kind, Ok(tidemark_core::endpoint::EndpointKind::Postgres)) => {
                files.deliver(endpoint, items, now_ms)
            }
            _ => self.schemas.deliver(endpoint, items, now_ms),
        }
    }
}

/// A consumer store: a SQLite file or a PostgreSQL schema.
pub enum Consumer {
    /// A SQLite file.
    Sqlite(SqliteConsumer),
    /// A schema on a PostgreSQL server.
    Postgres(Box<PgConsumer>, PostgresLocation),
}

impl Consumer {
    /// Open an existing consumer (never creates one: a missing file or schema is
    /// `not_initialized`), with the reservation tables installed when `reservations` (the
    /// commands that apply or read them).
    pub fn open(ctx: &Context, given: &Path, reservations: bool) -> Result<Consumer> {
        Consumer::open_at(location(ctx, given)?, ctx.durability, reservations)
    }

    /// [`Consumer::open`] of a parsed location (`durability` applies to a SQLite file).
    pub fn open_at(location: StoreLocation, durability: Durability, reservations: bool) -> Result<Consumer> {
        match location {
            StoreLocation::Sqlite(path) => {
                let consumer = SqliteConsumer::open_with(&path, durability)?;
                if reservations {
                    reservation::install(&consumer)?;
                }
                Ok(Consumer::Sqlite(consumer))
            }
            StoreLocation::Postgres(pg) => {
                let mut consumer = PgConsumer::open(&pg.conn, &pg.schema)?;
                if reservations {
                    reservation_pg::install(&mut consumer)?;
                }
                Ok(Consumer::Postgres(Box::new(consumer), pg))
            }
        }
    }

    /// Create (or reopen, never reset) a consumer with the reservation tables.
    pub fn init(ctx: &Context, given: &Path, retention: RetentionPolicy) -> Result<Consumer> {
        Consumer::init_at(location(ctx, given)?, retention)
    }

    /// [`Consumer::init`] of a parsed location.
    pub fn init_at(location: StoreLocation, retention: RetentionPolicy) -> Result<Consumer> {
        match location {
            StoreLocation::Sqlite(path) => {
                let consumer = SqliteConsumer::init(&path, retention)?;
                reservation::install(&consumer)?;
                Ok(Consumer::Sqlite(consumer))
            }
            StoreLocation::Postgres(pg) => {
                let mut consumer = PgConsumer::init(&pg.conn, &pg.schema, retention)?;
                reservation_pg::install(&mut consumer)?;
                Ok(Consumer::Postgres(Box::new(consumer), pg))
            }
        }
    }

    /// The store's retention horizon.
    pub fn retention(&self) -> RetentionPolicy {
        each!(self, Consumer, |c| c.retention())
    }

    /// Whether `consumer_id` holds anything from `source` here.
    pub fn has_received(&self, consumer_id: &str, source: &str) -> Result<bool> {
        each!(self, Consumer, |c| c.has_received(consumer_id, source))
    }

    /// See [`ConsumerStore::receive_batch`].
    pub fn receive_batch(&mut self, items: &[(&str, &Envelope)], now_ms: i64) -> Result<Vec<ReceiveOutcome>> {
        each!(self, Consumer, |c| c.receive_batch(items, now_ms))
    }

    /// Apply with the built-in reservation handler (the v2 decoders with `support_v2`).
    pub fn drain(
        &mut self,
        consumer_id: &str,
        scope: &DrainScope,
        limit: usize,
        support_v2: bool,
        now_ms: i64,
    ) -> Result<DrainReport> {
        match self {
            Consumer::Sqlite(c) => {
                c.drain(consumer_id, scope, limit, &mut reservation::ReservationHandler::new(support_v2), now_ms)
            }
            Consumer::Postgres(c, _) => {
                c.drain(consumer_id, scope, limit, &mut reservation_pg::ReservationHandler::new(support_v2), now_ms)
            }
        }
    }

    /// See [`ConsumerStore::inbox`].
    pub fn inbox(&self, consumer_id: &str, status: Option<InboxStatus>, limit: usize) -> Result<Vec<InboxEntry>> {
        each!(self, Consumer, |c| c.inbox(consumer_id, status, limit))
    }

    /// See [`ConsumerStore::skip_blocked`].
    pub fn skip_blocked(&mut self, consumer_id: &str, event_id: &str, reason: &str, now_ms: i64) -> Result<InboxEntry> {
        each!(self, Consumer, |c| c.skip_blocked(consumer_id, event_id, reason, now_ms))
    }

    /// See [`ConsumerStore::prune`].
    pub fn prune(&mut self, applied_retention_ms: i64, batch_rows: usize, now_ms: i64) -> Result<PruneReport> {
        each!(self, Consumer, |c| c.prune(applied_retention_ms, batch_rows, now_ms))
    }

    /// See [`ConsumerStore::rename_consumer`].
    pub fn rename_consumer(&mut self, from: &str, to: &str, now_ms: i64) -> Result<RenameReport> {
        each!(self, Consumer, |c| c.rename_consumer(from, to, now_ms))
    }

    /// See [`ConsumerStore::retire_consumer`].
    pub fn retire_consumer(&mut self, from: &str, to: &str, now_ms: i64) -> Result<()> {
        each!(self, Consumer, |c| c.retire_consumer(from, to, now_ms))
    }

    /// See [`ConsumerStore::cursors`].
    pub fn cursors(&self, consumer_id: Option<&str>) -> Result<Vec<FlowCursor>> {
        each!(self, Consumer, |c| c.cursors(consumer_id))
    }

    /// The consumer's snapshot with the reservation projection and effects, read in the same
    /// read transaction.
    pub fn snapshot(&self, rows_max: usize) -> Result<Value> {
        let read = self.snapshot_with_reservations(rows_max)?;
        let mut out = to_json(&read.snapshot);
        out["reservation_projection"] = to_json(&read.projections);
        out["reservation_effects"] = to_json(&read.effects);
        Ok(out)
    }

    /// The consumer's snapshot, the reservation projection and effects, and the effects applied
    /// more than once (always none), read in one read transaction, each table capped at
    /// `rows_max` rows.
    pub fn snapshot_with_reservations(&self, rows_max: usize) -> Result<ReservationSnapshot> {
        let (snapshot, ((projections, effects), duplicates)) = match self {
            Consumer::Sqlite(c) => c.snapshot_with(rows_max, |tx| {
                Ok((reservation::read_in(tx, rows_max)?, reservation::duplicate_effects(tx)?))
            })?,
            Consumer::Postgres(c, pg) => c.snapshot_with(rows_max, |tx| {
                Ok((
                    reservation_pg::read_in(tx, &pg.schema, rows_max)?,
                    reservation_pg::duplicate_effects(tx, &pg.schema)?,
                ))
            })?,
        };
        Ok(ReservationSnapshot { snapshot, projections, effects, duplicates })
    }

    /// Fault injection (the seed's hand deletion of dedup history, which no tidemark operation
    /// does): delete `consumer_id`'s inbox record and receipt of `flow_id`/`seq` with plain SQL.
    pub fn forget_dedup_records(&mut self, consumer_id: &str, flow_id: &str, seq: i64) -> Result<usize> {
        match self {
            Consumer::Sqlite(c) => {
                tidemark_store_sqlite::example::forget_dedup_records(c.connection(), consumer_id, flow_id, seq)
            }
            Consumer::Postgres(c, pg) => tidemark_store_postgres::example::forget_dedup_records(
                c.client(),
                &pg.schema,
                consumer_id,
                flow_id,
                seq,
            ),
        }
    }
}

/// What [`Consumer::snapshot_with_reservations`] read.
pub struct ReservationSnapshot {
    /// The consumer's own tables.
    pub snapshot: ConsumerSnapshot,
    /// The reservation projection.
    pub projections: Vec<ProjectionRow>,
    /// The reservation effects, in the order they were written.
    pub effects: Vec<Effect>,
    /// Effects written more than once for one (consumer, source, flow, seq): always empty.
    pub duplicates: Vec<DuplicateEffect>,
}

fn to_json<T: serde::Serialize>(value: &T) -> Value {
    serde_json::to_value(value).expect("outputs serialise")
}
