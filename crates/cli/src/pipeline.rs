//! The stores the outbox and inbox commands (`init`, `advance`, `subscribe`, `relay`, `receive`,
//! `consume`, `apply`, `drain`, `snapshot`, `outbox ...`, `inbox ...`, `prune`,
//! `rename-consumer`) work on: a SQLite file or a schema on a PostgreSQL server, named as the
//! workflow commands' `--store` is (docs/cli.md, "Stores"; parsed by
//! [`crate::workflow_cmd::location`]).
//!
//! [`Producer`] implements [`ProducerStore`] and [`Endpoints`] is the relay's endpoints, each by
//! handing the call to the backend's store, so one command body serves both backends. A consumer
//! store's handlers differ by backend (a `rusqlite::Connection` or an `ApplyTransaction`), so
//! [`Consumer`] offers the consumer calls the commands make, the built-in reservation handler
//! and its tables chosen per backend.

use std::path::Path;

use serde_json::Value;
use tidemark_builtins::reservation::{self, postgres as reservation_pg};
use tidemark_core::error::codes;
use tidemark_core::flow::{AdvanceOutcome, AdvanceRequest, FlowMachine};
use tidemark_core::location::{PostgresLocation, StoreLocation};
use tidemark_core::policy::RetentionPolicy;
use tidemark_core::store::{
    ConsumerStore, Delivery, DeliveryAction, DeliveryEntry, DeliveryResult, DeliveryStatus, DrainReport, DrainScope,
    FlowCursor, FlowRecord, InboxEntry, InboxStatus, OutboxPruneReport, ProducerIdentity, ProducerSnapshot,
    PruneReport, ReceiveOutcome, RedeliverReport, RenameReport, Subscription,
};
use tidemark_core::{Envelope, Error, Result};
use tidemark_store_postgres::{PgConsumer, PgEndpoints, PgProducer};
use tidemark_store_sqlite::{SqliteConsumer, SqliteEndpoints, SqliteProducer};

use crate::workflow_cmd::location;
use crate::Context;

/// A producer store: a SQLite file or a PostgreSQL schema.
pub(crate) enum Producer {
    Sqlite(SqliteProducer),
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
    pub(crate) fn open(ctx: &Context, given: &Path) -> Result<Producer> {
        match location(ctx, given)? {
            StoreLocation::Sqlite(path) => Ok(Producer::Sqlite(SqliteProducer::open_with(&path, ctx.durability)?)),
            StoreLocation::Postgres(pg) => {
                Ok(Producer::Postgres(Box::new(PgProducer::open(&pg.conn, &pg.schema)?), pg))
            }
        }
    }

    /// Create (or reopen, never reset) a producer of `source`.
    pub(crate) fn init(ctx: &Context, given: &Path, source: &str) -> Result<Producer> {
        match location(ctx, given)? {
            StoreLocation::Sqlite(path) => Ok(Producer::Sqlite(SqliteProducer::init(&path, source)?)),
            StoreLocation::Postgres(pg) => {
                Ok(Producer::Postgres(Box::new(PgProducer::init(&pg.conn, &pg.schema, source)?), pg))
            }
        }
    }

    /// The relay's endpoints for this producer's subscribers: consumer files, or consumer schemas
    /// on the producer's own server.
    pub(crate) fn endpoints(&self, ctx: &Context) -> Endpoints {
        match self {
            Producer::Sqlite(_) => Endpoints::Sqlite(SqliteEndpoints::new(ctx.durability)),
            Producer::Postgres(_, pg) => Endpoints::Postgres(PgEndpoints::new(&pg.conn)),
        }
    }

    /// Where a subscriber of this producer is delivered: the endpoint string stored in the
    /// subscription (a consumer file's absolute path, or a consumer schema's name on the
    /// producer's server) and the consumer store there, opened to check it (the shape a
    /// subscription of each backend has: `--endpoint` names a consumer store of the producer's
    /// backend, a PostgreSQL one on the producer's own server).
    pub(crate) fn consumer_endpoint(&self, ctx: &Context, given: &Path) -> Result<(String, Consumer)> {
        let wrong = |why: &str| Error::invalid(codes::INVALID_ENDPOINT, why.to_string());
        match (self, location(ctx, given)?) {
            (Producer::Sqlite(_), StoreLocation::Sqlite(path)) => {
                let consumer = Consumer::open(ctx, given, false)?;
                let endpoint = std::fs::canonicalize(&path)
                    .map_err(|e| crate::invalid(format!("cannot resolve {}: {e}", path.display())))?;
                Ok((endpoint.to_string_lossy().into_owned(), consumer))
            }
            (Producer::Postgres(_, producer), StoreLocation::Postgres(pg)) => {
                if pg.conn != producer.conn {
                    return Err(wrong(
                        "a PostgreSQL producer delivers to consumer schemas on its own server: give the \
                         producer's URL with the consumer's ?schema=",
                    ));
                }
                let consumer = Consumer::open(ctx, given, false)?;
                Ok((pg.schema, consumer))
            }
            (Producer::Sqlite(_), StoreLocation::Postgres(_)) => {
                Err(wrong("a SQLite producer delivers to consumer database files, not to PostgreSQL schemas"))
            }
            (Producer::Postgres(..), StoreLocation::Sqlite(_)) => Err(wrong(
                "a PostgreSQL producer delivers to consumer schemas on its own server \
                 (--endpoint postgres://...?schema=S), not to files",
            )),
        }
    }

    /// See `SqliteProducer::subscribe_checked`.
    pub(crate) fn subscribe_checked(
        &mut self,
        subscription: &Subscription,
        from_start: bool,
        now_ms: i64,
        new_endpoint_has_received: Option<bool>,
    ) -> Result<u64> {
        each!(self, Producer, |p| p.subscribe_checked(subscription, from_start, now_ms, new_endpoint_has_received))
    }

    pub(crate) fn rotate_generation(&mut self) -> Result<ProducerIdentity> {
        each!(self, Producer, |p| p.rotate_generation())
    }

    pub(crate) fn rename_subscription(&mut self, from: &str, to: &str) -> Result<u64> {
        each!(self, Producer, |p| p.rename_subscription(from, to))
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

/// The relay's endpoints: consumer files (SQLite) or consumer schemas on one server.
pub(crate) enum Endpoints {
    Sqlite(SqliteEndpoints),
    Postgres(PgEndpoints),
}

impl tidemark_core::store::Endpoints for Endpoints {
    fn deliver(&mut self, endpoint: &str, items: &[(&str, &Envelope)], now_ms: i64) -> Result<Vec<ReceiveOutcome>> {
        match self {
            Endpoints::Sqlite(e) => e.deliver(endpoint, items, now_ms),
            Endpoints::Postgres(e) => e.deliver(endpoint, items, now_ms),
        }
    }
}

/// A consumer store: a SQLite file or a PostgreSQL schema.
pub(crate) enum Consumer {
    Sqlite(SqliteConsumer),
    Postgres(Box<PgConsumer>, PostgresLocation),
}

impl Consumer {
    /// Open an existing consumer (never creates one: a missing file or schema is
    /// `not_initialized`), with the reservation tables installed when `reservations` (the
    /// commands that apply or read them).
    pub(crate) fn open(ctx: &Context, given: &Path, reservations: bool) -> Result<Consumer> {
        match location(ctx, given)? {
            StoreLocation::Sqlite(path) => {
                let consumer = SqliteConsumer::open_with(&path, ctx.durability)?;
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
    pub(crate) fn init(ctx: &Context, given: &Path, retention: RetentionPolicy) -> Result<Consumer> {
        match location(ctx, given)? {
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

    pub(crate) fn retention(&self) -> RetentionPolicy {
        each!(self, Consumer, |c| c.retention())
    }

    pub(crate) fn has_received(&self, consumer_id: &str, source: &str) -> Result<bool> {
        each!(self, Consumer, |c| c.has_received(consumer_id, source))
    }

    pub(crate) fn receive_batch(&mut self, items: &[(&str, &Envelope)], now_ms: i64) -> Result<Vec<ReceiveOutcome>> {
        each!(self, Consumer, |c| c.receive_batch(items, now_ms))
    }

    /// Apply with the built-in reservation handler (the v2 decoders with `support_v2`).
    pub(crate) fn drain(
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

    pub(crate) fn inbox(
        &self,
        consumer_id: &str,
        status: Option<InboxStatus>,
        limit: usize,
    ) -> Result<Vec<InboxEntry>> {
        each!(self, Consumer, |c| c.inbox(consumer_id, status, limit))
    }

    pub(crate) fn skip_blocked(
        &mut self,
        consumer_id: &str,
        event_id: &str,
        reason: &str,
        now_ms: i64,
    ) -> Result<InboxEntry> {
        each!(self, Consumer, |c| c.skip_blocked(consumer_id, event_id, reason, now_ms))
    }

    pub(crate) fn prune(&mut self, applied_retention_ms: i64, batch_rows: usize, now_ms: i64) -> Result<PruneReport> {
        each!(self, Consumer, |c| c.prune(applied_retention_ms, batch_rows, now_ms))
    }

    pub(crate) fn rename_consumer(&mut self, from: &str, to: &str, now_ms: i64) -> Result<RenameReport> {
        each!(self, Consumer, |c| c.rename_consumer(from, to, now_ms))
    }

    pub(crate) fn retire_consumer(&mut self, from: &str, to: &str, now_ms: i64) -> Result<()> {
        each!(self, Consumer, |c| c.retire_consumer(from, to, now_ms))
    }

    pub(crate) fn cursors(&self, consumer_id: Option<&str>) -> Result<Vec<FlowCursor>> {
        each!(self, Consumer, |c| c.cursors(consumer_id))
    }

    /// The consumer's snapshot with the reservation projection and effects, read in the same
    /// read transaction.
    pub(crate) fn snapshot(&self, rows_max: usize) -> Result<Value> {
        let (snapshot, (projections, effects)) = match self {
            Consumer::Sqlite(c) => c.snapshot_with(rows_max, |tx| reservation::read_in(tx, rows_max))?,
            Consumer::Postgres(c, pg) => {
                c.snapshot_with(rows_max, |tx| reservation_pg::read_in(tx, &pg.schema, rows_max))?
            }
        };
        let mut out = crate::to_json(&snapshot);
        out["reservation_projection"] = crate::to_json(&projections);
        out["reservation_effects"] = crate::to_json(&effects);
        Ok(out)
    }
}
