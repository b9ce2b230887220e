//! The storage traits and the records they exchange. SQLite implements them today
//! (`tidemark-store-sqlite`); PostgreSQL and the in-memory model implement the same traits.
//!
//! The traits are domain-level: each method is one protocol operation with its own transaction,
//! never a row-level CRUD call. Every method that changes data either commits all of it or none.

use serde::{Deserialize, Serialize};

use crate::envelope::Envelope;
use crate::error::Result;
use crate::flow::{AdvanceOutcome, AdvanceRequest, FlowMachine, FlowState};

/// Who a producer database is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProducerIdentity {
    pub source: String,
    pub generation: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FlowRecord {
    pub flow_id: String,
    pub last_seq: i64,
    #[serde(flatten)]
    pub state: FlowState,
}

/// A subscriber of a producer: a logical consumer id and where its inbox is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Subscription {
    pub consumer_id: String,
    /// Where the consumer's inbox lives: a consumer database path today.
    pub endpoint: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, PartialOrd, Ord)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum DeliveryStatus {
    /// Not yet accepted by the consumer; due at `next_attempt_at_ms`.
    Pending,
    /// The consumer answered `accepted` or `duplicate`: custody transferred.
    Accepted,
    /// Failed `max_attempts` times; waits for an operator. Never acked.
    Quarantined,
    /// An operator stopped delivering it to this consumer, with a recorded reason.
    Dismissed,
}

impl DeliveryStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryStatus::Pending => "pending",
            DeliveryStatus::Accepted => "accepted",
            DeliveryStatus::Quarantined => "quarantined",
            DeliveryStatus::Dismissed => "dismissed",
        }
    }

    pub fn parse(value: &str) -> Option<Self> {
        [Self::Pending, Self::Accepted, Self::Quarantined, Self::Dismissed].into_iter().find(|s| s.as_str() == value)
    }
}

/// One event due for one subscriber.
#[derive(Debug, Clone, PartialEq)]
pub struct Delivery {
    /// The event's outbox position (the producer's commit order), handed back in the
    /// [`DeliveryResult`] so that recording the verdict needs no lookup by event id.
    pub position: i64,
    pub envelope: Envelope,
    pub consumer_id: String,
    pub endpoint: String,
    /// Failed attempts so far.
    pub attempts: u32,
}

/// What the relay decided for one delivery, recorded in one producer transaction per batch.
#[derive(Debug, Clone, PartialEq)]
pub enum DeliveryVerdict {
    /// The consumer answered `accepted` or `duplicate`.
    Accepted,
    /// Try again at `next_attempt_at_ms`.
    Retry { reason: String, next_attempt_at_ms: i64 },
    /// Give up until an operator acts.
    Quarantine { reason: String },
}

#[derive(Debug, Clone, PartialEq)]
pub struct DeliveryResult {
    /// The [`Delivery::position`] this verdict is for.
    pub position: i64,
    pub event_id: String,
    pub consumer_id: String,
    pub verdict: DeliveryVerdict,
}

/// A delivery row as listed to operators.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DeliveryEntry {
    pub event_id: String,
    pub flow_id: String,
    pub seq: i64,
    pub consumer_id: String,
    pub status: DeliveryStatus,
    pub attempts: u32,
    pub next_attempt_at_ms: i64,
    pub last_error: Option<String>,
    pub updated_at_ms: i64,
}

/// An operator's decision on a quarantined (or pending) delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum DeliveryAction {
    /// Deliver again now, with the attempt counter reset.
    Requeue,
    /// Stop delivering this event to this consumer. Recorded with the reason; never an ack.
    Dismiss,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
pub struct OutboxPruneReport {
    pub events_deleted: u64,
    pub deliveries_deleted: u64,
    /// True when the batch bound stopped the prune before it was done.
    pub more: bool,
}

/// What [`ProducerStore::redeliver`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
pub struct RedeliverReport {
    /// The subscriber's deliveries now pending again (every event the outbox still holds from
    /// the chosen one on, from the subscription's start on).
    pub redelivered: u64,
    /// Positions in that range whose events `prune` already deleted: they cannot be sent again.
    pub pruned: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProducerSnapshot {
    pub identity: ProducerIdentity,
    pub subscriptions: Vec<Subscription>,
    pub flows: Vec<FlowRecord>,
    pub outbox: Vec<Envelope>,
    pub deliveries: Vec<DeliveryEntry>,
}

/// The producer side: flows, the outbox and per-subscriber delivery records.
pub trait ProducerStore {
    fn identity(&self) -> &ProducerIdentity;
    /// Advance several flows in one transaction (group commit). Each request gets its own
    /// outcome; `stale` and `invalid_transition` do not abort the others. Bad input anywhere in
    /// the batch is an error and nothing is written.
    fn advance_batch(
        &mut self,
        machine: &dyn FlowMachine,
        requests: &[AdvanceRequest],
        now_ms: i64,
    ) -> Result<Vec<AdvanceOutcome>>;
    /// Add a subscriber. `from_start` also queues every event already in the outbox for it;
    /// otherwise it receives events committed from now on.
    fn subscribe(&mut self, subscription: &Subscription, from_start: bool, now_ms: i64) -> Result<u64>;
    fn subscriptions(&self) -> Result<Vec<Subscription>>;
    /// Pending deliveries due at `now_ms`, oldest first, at most `limit`. With `event_id`, only
    /// that event's pending or quarantined deliveries, due or not (explicit choice).
    fn due_deliveries(&mut self, now_ms: i64, limit: usize, event_id: Option<&str>) -> Result<Vec<Delivery>>;
    /// Record the relay's verdicts in one transaction.
    fn record_deliveries(&mut self, results: &[DeliveryResult], now_ms: i64) -> Result<()>;
    fn deliveries(&self, status: Option<DeliveryStatus>, limit: usize) -> Result<Vec<DeliveryEntry>>;
    fn resolve_delivery(
        &mut self,
        event_id: &str,
        consumer_id: &str,
        action: DeliveryAction,
        reason: &str,
        now_ms: i64,
    ) -> Result<DeliveryEntry>;
    /// Hand `consumer_id` every event the outbox still holds again, from `from_event_id` (in
    /// commit order) on, or from the oldest with `None`: its deliveries there become pending as
    /// if never attempted (accepted, quarantined and dismissed ones alike), in one transaction.
    /// For a consumer database restored from a backup: the consumer answers `duplicate` for
    /// what it still holds and accepts what it lost. `not_found` for an unknown subscriber or an
    /// event the outbox does not hold.
    fn redeliver(&mut self, consumer_id: &str, from_event_id: Option<&str>) -> Result<RedeliverReport>;
    fn flow(&self, flow_id: &str) -> Result<Option<FlowRecord>>;
    /// Delete outbox events created more than `retention_ms` ago whose every delivery is
    /// settled (`accepted` or `dismissed`), with their delivery rows; at most `batch_rows`
    /// events in one transaction. Flows keep their `last_seq`, so seqs are never reused.
    fn prune_delivered(&mut self, retention_ms: i64, batch_rows: usize, now_ms: i64) -> Result<OutboxPruneReport>;
    /// Everything, read in one read transaction, each table capped at `rows_max` rows.
    fn snapshot(&self, rows_max: usize) -> Result<ProducerSnapshot>;
}

/// Outcome of receiving one event into one consumer's inbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum ReceiveOutcome {
    Accepted { consumer_id: String, event_id: String },
    Duplicate { consumer_id: String, event_id: String },
    Conflict { consumer_id: String, event_id: String, reason: String },
    Expired { consumer_id: String, event_id: String, horizon_ms: i64 },
}

impl ReceiveOutcome {
    pub fn word(&self) -> &'static str {
        match self {
            ReceiveOutcome::Accepted { .. } => "accepted",
            ReceiveOutcome::Duplicate { .. } => "duplicate",
            ReceiveOutcome::Conflict { .. } => "conflict",
            ReceiveOutcome::Expired { .. } => "expired",
        }
    }

    /// Accepted or duplicate: the relay may mark the delivery accepted.
    pub fn is_custody(&self) -> bool {
        matches!(self, ReceiveOutcome::Accepted { .. } | ReceiveOutcome::Duplicate { .. })
    }
}

/// Outcome of applying the next event of one flow.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum ApplyOutcome {
    Applied {
        source: String,
        flow_id: String,
        seq: i64,
        event_id: String,
    },
    /// `missing_seq` has not been received; later seqs wait.
    Gap {
        source: String,
        flow_id: String,
        missing_seq: i64,
    },
    /// The handler refused the event; the stored body is unchanged.
    Blocked {
        source: String,
        flow_id: String,
        seq: i64,
        event_id: String,
        reason: String,
    },
    Idle {
        source: String,
        flow_id: String,
        high_water_seq: i64,
    },
}

impl ApplyOutcome {
    pub fn word(&self) -> &'static str {
        match self {
            ApplyOutcome::Applied { .. } => "applied",
            ApplyOutcome::Gap { .. } => "gap",
            ApplyOutcome::Blocked { .. } => "blocked",
            ApplyOutcome::Idle { .. } => "idle",
        }
    }
}

/// Why a drain stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DrainStop {
    /// Nothing more can be applied and nothing is stuck.
    Idle,
    /// The limit was reached; more may be applicable.
    Limit,
    /// Some flow waits for a missing seq (see `stuck`).
    Gap,
    /// Some flow is blocked (see `stuck`).
    Blocked,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DrainReport {
    pub outcome: DrainStop,
    pub applied: u64,
    /// Flows that could not advance: each a `gap` or `blocked` outcome.
    pub stuck: Vec<ApplyOutcome>,
    /// The last event applied by this drain, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_applied: Option<ApplyOutcome>,
}

/// Which flows a drain looks at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DrainScope {
    All,
    Flow { source: String, flow_id: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum InboxStatus {
    Pending,
    Applied,
    Blocked,
    /// An operator skipped it with a recorded reason; its handler never ran.
    Skipped,
}

impl InboxStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            InboxStatus::Pending => "pending",
            InboxStatus::Applied => "applied",
            InboxStatus::Blocked => "blocked",
            InboxStatus::Skipped => "skipped",
        }
    }

    pub fn parse(value: &str) -> Option<Self> {
        [Self::Pending, Self::Applied, Self::Blocked, Self::Skipped].into_iter().find(|s| s.as_str() == value)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct InboxEntry {
    pub consumer_id: String,
    pub envelope: Envelope,
    pub content_hash: String,
    pub status: InboxStatus,
    pub reason: Option<String>,
    pub received_at_ms: i64,
}

/// A consumer's position in one flow: every seq up to `high_water_seq` is applied (or skipped).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FlowCursor {
    pub consumer_id: String,
    pub source: String,
    pub flow_id: String,
    pub high_water_seq: i64,
}

/// A compact dedup receipt left when an applied record's body is pruned.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Receipt {
    pub consumer_id: String,
    pub event_id: String,
    pub source: String,
    pub flow_id: String,
    pub seq: i64,
    pub content_hash: String,
    pub created_at_ms: i64,
    /// The producer generation of the compacted record; `None` for a receipt compacted before
    /// schema v8, which did not keep it.
    pub generation: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
pub struct PruneReport {
    /// Applied records whose body was replaced by a compact receipt.
    pub compacted: u64,
    /// Receipts past the retention horizon, deleted.
    pub receipts_deleted: u64,
    /// True when the batch bound stopped the prune before it was done.
    pub more: bool,
}

/// The report of one bounded batch of a retention operation (prune, purge): whether more is
/// left, and how to add one batch's counts to a total.
pub trait BatchReport: Default {
    /// True when the batch bound stopped the operation before it was done.
    fn more(&self) -> bool;
    /// Add `batch`'s counts to `self` (`more` becomes `batch`'s).
    fn absorb(&mut self, batch: Self);
}

/// Run `batch` until it reports nothing more, at most `batches_max` times; the total and the
/// number of batches run. Each batch is its own short transaction, so retention never holds a
/// write lock for long.
pub fn in_batches<R: BatchReport>(batches_max: u64, mut batch: impl FnMut() -> Result<R>) -> Result<(R, u64)> {
    let mut total = R::default();
    let mut batches = 0;
    while batches < batches_max {
        batches += 1;
        let report = batch()?;
        let more = report.more();
        total.absorb(report);
        if !more {
            break;
        }
    }
    Ok((total, batches))
}

impl BatchReport for PruneReport {
    fn more(&self) -> bool {
        self.more
    }
    fn absorb(&mut self, batch: Self) {
        self.compacted += batch.compacted;
        self.receipts_deleted += batch.receipts_deleted;
        self.more = batch.more;
    }
}

impl BatchReport for OutboxPruneReport {
    fn more(&self) -> bool {
        self.more
    }
    fn absorb(&mut self, batch: Self) {
        self.events_deleted += batch.events_deleted;
        self.deliveries_deleted += batch.deliveries_deleted;
        self.more = batch.more;
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RenameReport {
    pub inbox: u64,
    pub receipts: u64,
    pub cursors: u64,
    pub projections: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConsumerSnapshot {
    pub horizon_ms: i64,
    pub inbox: Vec<InboxEntry>,
    pub receipts: Vec<Receipt>,
    pub cursors: Vec<FlowCursor>,
}

/// Why a handler did not apply an event.
#[derive(Debug)]
pub enum HandleError {
    /// A semantic refusal (unknown version, invalid payload, invalid transition): the record
    /// becomes `blocked` with this reason and its flow stops; other flows go on.
    Blocked(String),
    /// An infrastructure failure: the whole apply transaction rolls back and the error propagates.
    Failed(crate::Error),
}

/// User code that applies one event. It runs inside the transaction that also marks the record
/// applied and moves the cursor, so its writes commit exactly when the event counts as applied.
/// `T` is the store's transactional handle (`rusqlite::Connection` for SQLite).
pub trait Handler<T: ?Sized> {
    fn handle(&mut self, target: &T, consumer_id: &str, event: &Envelope) -> Result<(), HandleError>;

    /// True when this handler only ever returns `Blocked` before its first write. Stores then
    /// skip the per-event savepoint that would roll a refused event's writes back. The default
    /// (false) is always safe.
    fn refuses_before_writing(&self) -> bool {
        false
    }
}

/// A handler over the user's own event type: the payload is decoded into [`EventHandler::Event`]
/// before [`EventHandler::handle`] runs. Wrapped in [`Typed`], it is a [`Handler<T>`].
///
/// A consumer receives every event of the producers it subscribes to. Events whose type
/// [`EventHandler::accepts`] refuses are applied with no effect (the flow's order is kept and
/// nothing waits on them); an accepted event whose payload does not decode is `blocked` with the
/// decoder's reason (its flow stops until an operator skips it or a fixed handler runs), never a
/// panic.
pub trait EventHandler<T: ?Sized> {
    /// The payload type.
    type Event: serde::de::DeserializeOwned;

    /// Does this handler take events of `event_type`? Default: every type.
    fn accepts(&self, _event_type: &str) -> bool {
        true
    }

    /// Apply one event inside the apply transaction (`tx`): its writes commit exactly when the
    /// event counts as applied.
    fn handle(&mut self, tx: &T, consumer_id: &str, envelope: &Envelope, event: Self::Event)
        -> Result<(), HandleError>;

    /// See [`Handler::refuses_before_writing`] (default false, always safe).
    fn refuses_before_writing(&self) -> bool {
        false
    }
}

/// An [`EventHandler`] as a [`Handler`]: decodes each accepted event's payload, then calls it.
/// (A wrapper rather than a blanket impl, so that handlers generic over the store's transaction
/// type stay possible.)
#[derive(Debug, Clone, Copy, Default)]
pub struct Typed<H>(pub H);

impl<T: ?Sized, H: EventHandler<T>> Handler<T> for Typed<H> {
    fn handle(&mut self, target: &T, consumer_id: &str, envelope: &Envelope) -> Result<(), HandleError> {
        if !self.0.accepts(&envelope.event_type) {
            return Ok(());
        }
        let event = H::Event::deserialize(&envelope.payload).map_err(|e| {
            HandleError::Blocked(format!("the payload of {} does not decode: {e}", envelope.event_type))
        })?;
        self.0.handle(target, consumer_id, envelope, event)
    }

    fn refuses_before_writing(&self) -> bool {
        self.0.refuses_before_writing()
    }
}

/// The handler that applies every event and does nothing else: the inbox as a durable, ordered,
/// deduplicated log that readers page through.
#[derive(Debug, Clone, Copy, Default)]
pub struct RecordHandler;

impl<T: ?Sized> Handler<T> for RecordHandler {
    fn handle(&mut self, _: &T, _: &str, _: &Envelope) -> Result<(), HandleError> {
        Ok(())
    }

    fn refuses_before_writing(&self) -> bool {
        true
    }
}

/// The consumer side: inboxes, cursors, receipts, and the user's projections.
pub trait ConsumerStore {
    /// The transactional handle given to handlers.
    type Target: ?Sized;
    /// Store events durably, in one transaction. Never runs handlers or touches projections.
    /// Each item is `(consumer_id, envelope)`.
    fn receive_batch(&mut self, items: &[(&str, &Envelope)], now_ms: i64) -> Result<Vec<ReceiveOutcome>>;
    /// Apply up to `limit` events, each exactly `high_water_seq + 1` of its flow, in one
    /// transaction. A blocked flow stops only itself.
    fn drain(
        &mut self,
        consumer_id: &str,
        scope: &DrainScope,
        limit: usize,
        handler: &mut dyn Handler<Self::Target>,
        now_ms: i64,
    ) -> Result<DrainReport>;
    fn inbox(&self, consumer_id: &str, status: Option<InboxStatus>, limit: usize) -> Result<Vec<InboxEntry>>;
    /// Operator decision: skip a blocked record (the handler never runs for it) so its flow can
    /// go on. The reason is recorded on the record.
    fn skip_blocked(&mut self, consumer_id: &str, event_id: &str, reason: &str, now_ms: i64) -> Result<InboxEntry>;
    /// Replace applied bodies received more than `applied_retention_ms` ago by receipts, and
    /// delete receipts past the horizon; at most `batch_rows` rows per kind in one transaction.
    fn prune(&mut self, applied_retention_ms: i64, batch_rows: usize, now_ms: i64) -> Result<PruneReport>;
    /// Carry all dedup state and projections of `from` over to `to` (which must be unused).
    /// `from` without state in this database is `not_found` (see `retire_consumer`).
    fn rename_consumer(&mut self, from: &str, to: &str, now_ms: i64) -> Result<RenameReport>;
    /// The rename of a subscriber that holds no state in this database yet (nothing received):
    /// record only that `from` is now `to`, so that events still addressed to `from` are refused
    /// with a conflict naming `to`. `from` with state is refused (`invalid_state_change`: rename
    /// it instead, which carries the state over), `to` with state too (`already_exists`).
    /// Idempotent. Callers check first that `from` really is a subscriber (the CLI asks the
    /// producer), so that a mistyped id is not retired.
    fn retire_consumer(&mut self, from: &str, to: &str, now_ms: i64) -> Result<()>;
    fn cursors(&self, consumer_id: Option<&str>) -> Result<Vec<FlowCursor>>;
    fn snapshot(&self, rows_max: usize) -> Result<ConsumerSnapshot>;
}

/// Resolves a subscription's endpoint to the consumer store that holds that inbox.
/// Implementations open files (SQLite), connections or broker clients; an `Err` counts as a
/// failed delivery attempt, never as an answer.
pub trait Endpoints {
    type Store: ConsumerStore;
    fn store(&mut self, endpoint: &str) -> Result<&mut Self::Store>;
}
