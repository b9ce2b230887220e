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
    /// The producer's namespace: one per producer database, set at `init` and never changed. It is
    /// the `source` of every envelope this producer commits.
    pub source: String,
    /// The producer database's incarnation: random at `init`, replaced by
    /// `outbox rotate-generation` after a backup is restored, so that consumers can name a
    /// re-issued event's generation change in their conflict.
    pub generation: String,
}

/// One flow (an aggregate such as one reservation) as the producer stores it: its current state and
/// the seq of its last event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FlowRecord {
    /// The flow's identifier, unique within the producer.
    pub flow_id: String,
    /// The seq of the flow's last committed event (0 before the first). An advance must name it as
    /// its `expected_seq`, else it is `stale`.
    pub last_seq: i64,
    /// The machine's state name and its JSON data (serialised flat into this record).
    #[serde(flatten)]
    pub state: FlowState,
}

/// A subscriber of a producer: a logical consumer id and where its inbox is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Subscription {
    /// The logical consumer: a stable business responsibility (`audit`, `search`), never a process.
    /// It is the dedup identity on the consumer side.
    pub consumer_id: String,
    /// Where the consumer's inbox lives: a consumer database path today.
    pub endpoint: String,
}

/// Where one event stands with one subscriber, as operators see it (docs/protocol.md, "Delivery
/// states").
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
    /// The word stored in the `deliveries` table and shown by listings (`pending`, `accepted`,
    /// `quarantined`, `dismissed`).
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryStatus::Pending => "pending",
            DeliveryStatus::Accepted => "accepted",
            DeliveryStatus::Quarantined => "quarantined",
            DeliveryStatus::Dismissed => "dismissed",
        }
    }

    /// The status named by `value` (one of the words of [`DeliveryStatus::as_str`]), or `None` for
    /// any other word.
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
    /// The event to hand to the subscriber, exactly as committed.
    pub envelope: Envelope,
    /// The subscriber this delivery is for.
    pub consumer_id: String,
    /// Where the subscriber's inbox is (its [`Subscription::endpoint`] when the delivery was read).
    pub endpoint: String,
    /// Failed attempts so far.
    pub attempts: u32,
}

impl Delivery {
    /// The event's source and flow: what a relay pass picks round-robin by.
    pub fn flow(&self) -> (&str, &str) {
        (self.envelope.source.as_str(), self.envelope.flow_id.as_str())
    }
}

/// What the relay decided for one delivery, recorded in one producer transaction per batch.
#[derive(Debug, Clone, PartialEq)]
pub enum DeliveryVerdict {
    /// The consumer answered `accepted` or `duplicate`.
    Accepted,
    /// Try again at `next_attempt_at_ms`.
    Retry {
        /// Why the attempt failed (the consumer's conflict reason, `expired`, or the endpoint
        /// error).
        reason: String,
        /// When the delivery is due again, in ms since the Unix epoch (now plus the backoff).
        next_attempt_at_ms: i64,
    },
    /// Give up until an operator acts.
    Quarantine {
        /// Why the last attempt failed; shown to the operator with the quarantined delivery.
        reason: String,
    },
}

/// The relay's verdict on one [`Delivery`], as [`ProducerStore::record_deliveries`] records it.
#[derive(Debug, Clone, PartialEq)]
pub struct DeliveryResult {
    /// The [`Delivery::position`] this verdict is for.
    pub position: i64,
    /// The event the verdict is for; a store checks that [`DeliveryResult::position`] holds this
    /// event before it writes an exception row.
    pub event_id: String,
    /// The subscriber the verdict is for.
    pub consumer_id: String,
    /// Whether the subscriber took custody, should be tried again, or is quarantined.
    pub verdict: DeliveryVerdict,
}

/// A delivery row as listed to operators.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DeliveryEntry {
    /// The event delivered (a UUIDv7 in 32 hex characters).
    pub event_id: String,
    /// The event's flow.
    pub flow_id: String,
    /// The event's position in its flow.
    pub seq: i64,
    /// The subscriber.
    pub consumer_id: String,
    /// Where the event stands with that subscriber.
    pub status: DeliveryStatus,
    /// Failed attempts so far (0 for a delivery never tried or accepted on the first try; reset by
    /// `requeue` and `redeliver`).
    pub attempts: u32,
    /// When the relay may try again, in ms since the Unix epoch; for a delivery without an
    /// exception row, the event's `created_at_ms` (due since its commit).
    pub next_attempt_at_ms: i64,
    /// Why the last attempt failed (or the operator's note), if it did.
    pub last_error: Option<String>,
    /// When the delivery last changed, in ms since the Unix epoch; for a delivery without an
    /// exception row, the event's `created_at_ms` (the cursor keeps no time of its own).
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

/// What one batch of [`ProducerStore::prune_delivered`] deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
pub struct OutboxPruneReport {
    /// Outbox events deleted (each settled for every subscriber and older than the retention).
    pub events_deleted: u64,
    /// Deliveries those events had: one per subscriber that was due to receive the event, whether
    /// it had an exception row or was passed by the cursor.
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

/// Everything a producer database holds, for `snapshot`: each list capped at the rows asked for.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProducerSnapshot {
    /// Who the producer is.
    pub identity: ProducerIdentity,
    /// Its subscribers, by consumer id.
    pub subscriptions: Vec<Subscription>,
    /// Its flows, by flow id.
    pub flows: Vec<FlowRecord>,
    /// Its outbox events, in commit order (by position).
    pub outbox: Vec<Envelope>,
    /// One delivery per outbox event and subscriber (from the subscriber's first position on), by
    /// position and consumer id.
    pub deliveries: Vec<DeliveryEntry>,
}

/// The producer side: flows, the outbox and per-subscriber delivery records.
pub trait ProducerStore {
    /// The source and generation of this producer database.
    fn identity(&self) -> &ProducerIdentity;
    /// Called by the thread that owns the store before each round of work: a store on a network
    /// database opens a new connection here when the server closed the old one (a restart, a
    /// failover, `pg_terminate_backend`), so that a service outlives the outage instead of failing
    /// every call from then on. A failed reconnect is an `Err` (the round's calls then fail as
    /// they would have; the next round tries again). Default: nothing to do (a file cannot be
    /// disconnected).
    fn reconnect_if_closed(&mut self) -> Result<()> {
        Ok(())
    }

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
    /// Every subscriber, by consumer id.
    fn subscriptions(&self) -> Result<Vec<Subscription>>;
    /// Pending deliveries due at `now_ms`, in outbox order (position, then subscriber), at most
    /// `limit`. With `event_id`, only that event's pending or quarantined deliveries, due or not
    /// (explicit choice). With
    /// `consumers`, only deliveries to those subscribers (a relay lane serves one endpoint's
    /// subscribers, so that another endpoint's backlog never fills its window).
    fn due_deliveries(
        &mut self,
        now_ms: i64,
        limit: usize,
        event_id: Option<&str>,
        consumers: Option<&[String]>,
    ) -> Result<Vec<Delivery>>;
    /// What a relay pass hands over (docs/protocol.md, "The relay"): of the `query.window`
    /// candidates `due_deliveries` would return, those not `query.in_flight`, and of them
    /// `query.pick` chosen by [`round_robin`] across flows. The default reads the candidates'
    /// envelopes and drops what is not picked; a store may read the candidates' keys first and
    /// only the picked envelopes (SQLite does), with the same answer.
    fn pick_due(&mut self, query: &DueQuery<'_>) -> Result<Vec<Delivery>> {
        let mut candidates = self.due_deliveries(query.now_ms, query.window, None, query.consumers)?;
        leave_out(&mut candidates, query.in_flight, |d| (d.position, d.consumer_id.as_str()));
        Ok(round_robin(candidates, query.pick, Delivery::flow))
    }
    /// The deliveries of `batch` (as `due_deliveries` returned them) that would overtake an
    /// earlier event of their flow: an earlier event of the same flow whose delivery to the same
    /// subscriber is still open (pending, due or backing off, or quarantined) and not in `batch`.
    /// As (position, consumer id). A relay lane to an endpoint that keeps arrival order (a
    /// broker) holds them back, so that each flow reaches it in seq order (docs/protocol.md,
    /// "Order in a broker"). `in_flight` (position, consumer id) are deliveries handed over
    /// before `batch` whose verdicts are not recorded yet: they do not count as open either (a
    /// lane hands `batch` over only once every one of them is in the endpoint's custody).
    /// Default: none (a store that cannot tell).
    fn overtaking(&mut self, batch: &[Delivery], in_flight: &[(i64, String)]) -> Result<Vec<(i64, String)>> {
        let _ = (batch, in_flight);
        Ok(Vec::new())
    }
    /// Record the relay's verdicts in one transaction.
    fn record_deliveries(&mut self, results: &[DeliveryResult], now_ms: i64) -> Result<()>;
    /// Deliveries in outbox order (then by consumer id), only those in `status` when given, at most
    /// `limit` (1..=1,000, else `limit_exceeded`): one per event and subscriber, read from the
    /// exception row if there is one, else `accepted` at or below the cursor and `pending` above
    /// it.
    fn deliveries(&self, status: Option<DeliveryStatus>, limit: usize) -> Result<Vec<DeliveryEntry>>;
    /// An operator's decision on one delivery, recorded with `reason` (1..=1,000 bytes, else
    /// `invalid_argument`) and returned as it now stands. `Requeue` takes a quarantined or
    /// dismissed delivery back to `pending` with its attempts reset; `Dismiss` stops a pending or
    /// quarantined one. Any other status is `invalid_state_change`; an event or subscriber without
    /// that delivery is `not_found`.
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
    /// The flow `flow_id` as it stands, or `None` when it has no event yet.
    fn flow(&self, flow_id: &str) -> Result<Option<FlowRecord>>;
    /// Delete outbox events created more than `retention_ms` ago whose every delivery is
    /// settled (`accepted` or `dismissed`), with their delivery rows; at most `batch_rows`
    /// events in one transaction. Flows keep their `last_seq`, so seqs are never reused.
    fn prune_delivered(&mut self, retention_ms: i64, batch_rows: usize, now_ms: i64) -> Result<OutboxPruneReport>;
    /// Everything, read in one read transaction, each table capped at `rows_max` rows.
    fn snapshot(&self, rows_max: usize) -> Result<ProducerSnapshot>;
}

/// One relay pass's read ([`ProducerStore::pick_due`]).
#[derive(Debug, Clone, Copy)]
pub struct DueQuery<'a> {
    /// The time deliveries must be due by.
    pub now_ms: i64,
    /// The candidates considered: the `window` smallest (position, subscriber) keys,
    /// as [`ProducerStore::due_deliveries`] orders them (at most four times
    /// `RELAY_BATCH_EVENTS_MAX`, else `limit_exceeded`).
    pub window: usize,
    /// The deliveries picked among them, at most.
    pub pick: usize,
    /// Only these subscribers' deliveries (`None`: every subscriber's).
    pub consumers: Option<&'a [String]>,
    /// Deliveries handed over whose verdicts are not recorded yet (position, consumer id): left
    /// out of the candidates.
    pub in_flight: &'a [(i64, String)],
}

/// `items` without those `in_flight` names (position, consumer id), each item's own pair from
/// `key`.
pub fn leave_out<T>(items: &mut Vec<T>, in_flight: &[(i64, String)], key: impl for<'a> Fn(&'a T) -> (i64, &'a str)) {
    if in_flight.is_empty() {
        return;
    }
    let skip: std::collections::HashSet<(i64, &str)> = in_flight.iter().map(|(p, c)| (*p, c.as_str())).collect();
    items.retain(|item| !skip.contains(&key(item)));
}

/// Pick up to `limit` of `items` round-robin across flows (`flow` names an item's source and
/// flow), keeping each flow's own order: the first item of every flow in the order flows first
/// appear, then the second of each, and so on. A pure function, so fairness is testable
/// without a store.
pub fn round_robin<T>(items: Vec<T>, limit: usize, flow: impl for<'a> Fn(&'a T) -> (&'a str, &'a str)) -> Vec<T> {
    // One queue per flow, in the order flows first appear (a hash map finds a flow's queue, so
    // building is linear in the items).
    let total = items.len();
    let mut index: std::collections::HashMap<(&str, &str), usize> = std::collections::HashMap::new();
    let mut slots: Vec<usize> = Vec::with_capacity(items.len());
    for item in &items {
        let next = index.len();
        slots.push(*index.entry(flow(item)).or_insert(next));
    }
    let flows = index.len();
    drop(index);
    let mut queues: Vec<std::collections::VecDeque<T>> =
        (0..flows).map(|_| std::collections::VecDeque::new()).collect();
    for (item, slot) in items.into_iter().zip(slots) {
        queues[slot].push_back(item);
    }
    let mut picked = Vec::with_capacity(limit.min(total));
    while picked.len() < limit {
        let mut progressed = false;
        for queue in &mut queues {
            if picked.len() == limit {
                break;
            }
            if let Some(item) = queue.pop_front() {
                picked.push(item);
                progressed = true;
            }
        }
        if !progressed {
            break;
        }
    }
    picked
}

/// [`ProducerStore::overtaking`] from the open deliveries a store read: `open` holds (consumer
/// id, position, flow id, seq) of deliveries still open (pending or quarantined), at least every
/// one of the batch's subscribers below the batch's highest position for that subscriber; those
/// in `batch` or `in_flight` do not count. A delivery of `batch` overtakes when an open one of
/// its subscriber and flow outside the batch has a lower seq.
pub fn overtaking_of(
    batch: &[Delivery],
    in_flight: &[(i64, String)],
    open: impl IntoIterator<Item = (String, i64, String, i64)>,
) -> Vec<(i64, String)> {
    let in_batch: std::collections::HashSet<(i64, &str)> = batch
        .iter()
        .map(|d| (d.position, d.consumer_id.as_str()))
        .chain(in_flight.iter().map(|(position, consumer_id)| (*position, consumer_id.as_str())))
        .collect();
    let mut lowest: std::collections::HashMap<(String, String), i64> = std::collections::HashMap::new();
    for (consumer_id, position, flow_id, seq) in open {
        if in_batch.contains(&(position, consumer_id.as_str())) {
            continue;
        }
        let entry = lowest.entry((consumer_id, flow_id)).or_insert(seq);
        *entry = (*entry).min(seq);
    }
    batch
        .iter()
        .filter(|d| {
            lowest.get(&(d.consumer_id.clone(), d.envelope.flow_id.clone())).is_some_and(|&seq| seq < d.envelope.seq)
        })
        .map(|d| (d.position, d.consumer_id.clone()))
        .collect()
}

/// Outcome of receiving one event into one consumer's inbox (docs/protocol.md, "`receive`"). A
/// malformed envelope is an error instead, and nothing is stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum ReceiveOutcome {
    /// The event was new and is now stored `pending`: custody transferred.
    Accepted {
        /// The logical consumer that received it.
        consumer_id: String,
        /// The id of the event received.
        event_id: String,
    },
    /// The consumer already holds this event (as a record or a receipt) with the same id and
    /// content hash: nothing is stored again, and custody counts as transferred.
    Duplicate {
        /// The logical consumer that received it.
        consumer_id: String,
        /// The id of the event received.
        event_id: String,
    },
    /// The same (source, flow, seq) with another id or content, the same id at another
    /// position, a seq at or below the high-water mark without a record, or a retired consumer
    /// id: never stored, never acked.
    Conflict {
        /// The logical consumer that received it.
        consumer_id: String,
        /// The id of the event received.
        event_id: String,
        /// What clashed (it names a producer generation change, or the consumer id a retired one
        /// was renamed to, when that is the cause).
        reason: String,
    },
    /// The event was created before `now - horizon_ms`: its receipt may be gone, so it is refused
    /// rather than risk applying it twice.
    Expired {
        /// The logical consumer that received it.
        consumer_id: String,
        /// The id of the event received.
        event_id: String,
        /// The consumer's retention horizon, in ms.
        horizon_ms: i64,
    },
}

impl ReceiveOutcome {
    /// The protocol word of this outcome (`accepted`, `duplicate`, `conflict`, `expired`), as the
    /// JSON `outcome` tag and the CLI print it.
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

/// Outcome of applying the next event of one flow (docs/protocol.md, "`apply` and `drain`").
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum ApplyOutcome {
    /// The event at `high_water_seq + 1` was applied: the handler ran and the record is `applied`
    /// in the same transaction.
    Applied {
        /// The producer namespace the flow belongs to.
        source: String,
        /// The flow whose next event was applied.
        flow_id: String,
        /// The seq just applied (the flow's new high-water mark).
        seq: i64,
        /// The id of the applied event.
        event_id: String,
    },
    /// `missing_seq` has not been received; later seqs wait.
    Gap {
        /// The producer namespace the flow belongs to.
        source: String,
        /// The flow that waits for the missing event.
        flow_id: String,
        /// The first seq this consumer has not received.
        missing_seq: i64,
    },
    /// The handler refused the event; the stored body is unchanged.
    Blocked {
        /// The producer namespace the flow belongs to.
        source: String,
        /// The flow that is stopped at the blocked record.
        flow_id: String,
        /// The seq of the blocked record (`high_water_seq + 1`).
        seq: i64,
        /// The id of the blocked event.
        event_id: String,
        /// Why the handler refused it (for example an unknown schema version).
        reason: String,
    },
    /// Nothing of the flow is left to apply and nothing is stuck.
    Idle {
        /// The producer namespace the flow belongs to.
        source: String,
        /// The flow that has nothing left to apply.
        flow_id: String,
        /// The seq up to which this consumer has applied (or skipped) the flow's events.
        high_water_seq: i64,
    },
}

impl ApplyOutcome {
    /// The protocol word of this outcome (`applied`, `gap`, `blocked`, `idle`), as the JSON
    /// `outcome` tag and the CLI print it.
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

/// What one drain did: how many events it applied and why it stopped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DrainReport {
    /// Why the drain stopped.
    pub outcome: DrainStop,
    /// Events applied by this drain, in its one transaction.
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
    /// Every open record of the consumer, flow by flow.
    All,
    /// Only this flow, from this producer namespace.
    Flow {
        /// The producer namespace the flow belongs to.
        source: String,
        /// The flow to drain.
        flow_id: String,
    },
}

/// Where one record of a consumer's inbox stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum InboxStatus {
    /// Received and waiting to be applied (its seq is above the flow's high-water mark).
    Pending,
    /// Applied: its handler ran and committed with this status.
    Applied,
    /// Its handler refused it (with a reason); every apply or drain tries it again, and its flow
    /// waits.
    Blocked,
    /// An operator skipped it with a recorded reason; its handler never ran.
    Skipped,
}

impl InboxStatus {
    /// The word stored in the `inbox` table and shown by listings (`pending`, `applied`, `blocked`,
    /// `skipped`).
    pub fn as_str(self) -> &'static str {
        match self {
            InboxStatus::Pending => "pending",
            InboxStatus::Applied => "applied",
            InboxStatus::Blocked => "blocked",
            InboxStatus::Skipped => "skipped",
        }
    }

    /// The status named by `value` (one of the words of [`InboxStatus::as_str`]), or `None` for any
    /// other word.
    pub fn parse(value: &str) -> Option<Self> {
        [Self::Pending, Self::Applied, Self::Blocked, Self::Skipped].into_iter().find(|s| s.as_str() == value)
    }
}

/// One record of a consumer's inbox as listed to operators.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct InboxEntry {
    /// The logical consumer that holds the record.
    pub consumer_id: String,
    /// The event as received; its body never changes after receive.
    pub envelope: Envelope,
    /// The hex SHA-256 of the envelope's canonical encoding, compared on every path that finds this
    /// record.
    pub content_hash: String,
    /// Where the record stands.
    pub status: InboxStatus,
    /// Why it is blocked, or the operator's reason for skipping it; `None` otherwise.
    pub reason: Option<String>,
    /// Consumer clock at receive, in ms since the Unix epoch.
    pub received_at_ms: i64,
}

/// A consumer's position in one flow: every seq up to `high_water_seq` is applied (or skipped).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FlowCursor {
    /// The logical consumer.
    pub consumer_id: String,
    /// The producer namespace of the flow.
    pub source: String,
    /// The flow this high-water mark is for.
    pub flow_id: String,
    /// Every seq of the flow up to this one is applied or skipped; the next to apply is one more.
    /// Never pruned and never lowered.
    pub high_water_seq: i64,
}

/// A compact dedup receipt left when an applied record's body is pruned.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Receipt {
    /// The logical consumer that applied the event.
    pub consumer_id: String,
    /// The event's id: the second dedup identity, besides its position.
    pub event_id: String,
    /// The producer namespace of the flow.
    pub source: String,
    /// The flow the event belongs to.
    pub flow_id: String,
    /// The event's position in its flow.
    pub seq: i64,
    /// The hex SHA-256 of the event's canonical encoding, so a replay is still told `duplicate`
    /// from `conflict`.
    pub content_hash: String,
    /// Producer clock at the event's commit, in ms since the Unix epoch; the receipt is deleted
    /// once this is older than the retention horizon.
    pub created_at_ms: i64,
    /// The producer generation of the compacted record; `None` for a receipt compacted before
    /// schema v8, which did not keep it.
    pub generation: Option<String>,
}

/// What one batch of [`ConsumerStore::prune`] did.
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

/// What [`ConsumerStore::rename_consumer`] moved to the new consumer id, in rows (all zero when the
/// rename had already been done).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RenameReport {
    /// Inbox records moved.
    pub inbox: u64,
    /// Receipts moved.
    pub receipts: u64,
    /// Flow cursors (high-water marks) moved.
    pub cursors: u64,
    /// Rows of the registered projection tables moved.
    pub projections: u64,
}

/// Everything a consumer database holds, for `snapshot`: each list capped at the rows asked for.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConsumerSnapshot {
    /// The retention horizon, in ms: receipts older than this are deleted, and events older than
    /// this are `expired` at receive.
    pub horizon_ms: i64,
    /// Inbox records of every consumer.
    pub inbox: Vec<InboxEntry>,
    /// Receipts of every consumer.
    pub receipts: Vec<Receipt>,
    /// High-water marks of every consumer and flow.
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
    /// Apply `event` for `consumer_id` inside the apply transaction (`target`). `Ok` marks it
    /// applied; [`HandleError::Blocked`] blocks the record and its flow; [`HandleError::Failed`]
    /// rolls the whole drain back.
    fn handle(&mut self, target: &T, consumer_id: &str, event: &Envelope) -> Result<(), HandleError>;

    /// True when this handler only ever returns `Blocked` before its first write. Stores then
    /// skip the per-event savepoint that would roll a refused event's writes back. The default
    /// (false) is always safe.
    fn refuses_before_writing(&self) -> bool {
        false
    }

    /// How many events [`Handler::handle_batch`] takes at once. The default, 1, means the drain
    /// calls [`Handler::handle`] for each event. Above 1, the drain hands over up to this many
    /// applicable events at a time (never more than its own limit).
    fn batch_max(&self) -> usize {
        1
    }

    /// Apply several events at once, all or none, inside the apply transaction: for handlers
    /// that can do a batch's work in a few statements (read the state of all its flows in one,
    /// write it in one) instead of a few per event. `events` are in (source, flow, seq) order,
    /// each the next of its flow once the ones before it in the slice are applied, from many
    /// flows. `Ok` marks them all applied. [`HandleError::Blocked`] rolls back whatever the batch
    /// wrote and the drain applies the same events again one at a time through
    /// [`Handler::handle`], so that only the refusing flow stops (`handle` must agree with
    /// `handle_batch`: the same writes for the events it applies). [`HandleError::Failed`] rolls
    /// the whole drain back. Called only when [`Handler::batch_max`] is above 1; the default
    /// applies the events one after the other.
    fn handle_batch(&mut self, target: &T, consumer_id: &str, events: &[Envelope]) -> Result<(), HandleError> {
        events.iter().try_for_each(|event| self.handle(target, consumer_id, event))
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

    /// See [`Handler::batch_max`] (default 1: [`EventHandler::handle`] per event).
    fn batch_max(&self) -> usize {
        1
    }

    /// See [`Handler::handle_batch`]: the accepted events of a batch, each with its decoded
    /// payload (events of types [`EventHandler::accepts`] refuses are left out; a payload that
    /// does not decode refuses the batch, and the one-at-a-time replay blocks that event alone).
    /// The default applies them one after the other.
    fn handle_batch(
        &mut self,
        tx: &T,
        consumer_id: &str,
        events: Vec<(&Envelope, Self::Event)>,
    ) -> Result<(), HandleError> {
        events.into_iter().try_for_each(|(envelope, event)| self.handle(tx, consumer_id, envelope, event))
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
        let event = decode_payload::<H::Event>(envelope)?;
        self.0.handle(target, consumer_id, envelope, event)
    }

    fn refuses_before_writing(&self) -> bool {
        self.0.refuses_before_writing()
    }

    fn batch_max(&self) -> usize {
        self.0.batch_max()
    }

    fn handle_batch(&mut self, target: &T, consumer_id: &str, envelopes: &[Envelope]) -> Result<(), HandleError> {
        let mut events = Vec::with_capacity(envelopes.len());
        for envelope in envelopes.iter().filter(|e| self.0.accepts(&e.event_type)) {
            events.push((envelope, decode_payload::<H::Event>(envelope)?));
        }
        self.0.handle_batch(target, consumer_id, events)
    }
}

/// An event's payload as the handler's type, or the `Blocked` refusal saying why it does not
/// decode.
fn decode_payload<E: serde::de::DeserializeOwned>(envelope: &Envelope) -> Result<E, HandleError> {
    E::deserialize(&envelope.payload)
        .map_err(|e| HandleError::Blocked(format!("the payload of {} does not decode: {e}", envelope.event_type)))
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
    /// Called by the thread that owns the store before each round of work: a store on a network
    /// database opens a new connection here when the server closed the old one (a restart, a
    /// failover, `pg_terminate_backend`), so that a service outlives the outage instead of failing
    /// every call from then on. A failed reconnect is an `Err` (the round's calls then fail as
    /// they would have; the next round tries again). Default: nothing to do (a file cannot be
    /// disconnected).
    fn reconnect_if_closed(&mut self) -> Result<()> {
        Ok(())
    }

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
    /// The records of `consumer_id` in (source, flow, seq) order, only those in `status` when
    /// given, at most `limit` (1..=1,000, else `limit_exceeded`).
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
    /// High-water marks, of `consumer_id` or of every consumer with `None`, in (source, flow)
    /// order.
    fn cursors(&self, consumer_id: Option<&str>) -> Result<Vec<FlowCursor>>;
    /// Everything, read in one read transaction (the handler's tables included where the store has
    /// them), each table capped at `rows_max` rows.
    fn snapshot(&self, rows_max: usize) -> Result<ConsumerSnapshot>;
}

/// Hands batches of events to the endpoints subscriptions name (docs/protocol.md, "Endpoints").
/// Implementations open files (SQLite), connections or broker clients; an `Err` counts as a
/// failed delivery attempt for every event of the batch, never as an answer.
pub trait Endpoints {
    /// Hand `items` (the subscriber's consumer id and the envelope, in delivery order) to
    /// `endpoint`, and answer one outcome per item in the same order, each only once the
    /// endpoint has taken custody as its kind defines it (`accepted` / `duplicate`) or refused
    /// the event (`conflict` / `expired`). An error (a file that does not exist, a server that
    /// does not answer in time) is a failed attempt for every item.
    fn deliver(&mut self, endpoint: &str, items: &[(&str, &Envelope)], now_ms: i64) -> Result<Vec<ReceiveOutcome>>;
}

/// The producer's open deliveries.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct OutboxCounts {
    /// Deliveries not yet accepted (the backlog).
    pub pending: u64,
    /// Of the pending deliveries, those due now (the rest are backing off after a failure).
    pub due: u64,
    /// Deliveries quarantined after `max_attempts` failures, waiting for an operator.
    pub quarantined: u64,
    /// The oldest pending delivery's commit time (its event's `created_at_ms`).
    pub oldest_pending_ms: Option<i64>,
    /// The highest outbox position (events ever committed, as long as none was pruned above it).
    pub last_position: i64,
}

impl OutboxCounts {
    /// The counts from what a store reads: the implicit pending deliveries (above a subscriber's
    /// cursor, no exception row) with their oldest event's time, the retrying exceptions (all,
    /// due now) with theirs, the quarantined ones, and the last position.
    pub fn from_parts(
        (implicit, implicit_oldest_ms): (i64, Option<i64>),
        (retrying, retrying_due, retrying_oldest_ms): (i64, i64, Option<i64>),
        quarantined: i64,
        last_position: i64,
    ) -> OutboxCounts {
        let oldest_pending_ms = match (implicit_oldest_ms, retrying_oldest_ms) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        OutboxCounts {
            pending: (implicit + retrying) as u64,
            due: (implicit + retrying_due) as u64,
            quarantined: quarantined as u64,
            oldest_pending_ms,
            last_position,
        }
    }

    /// Add another outbox's counts (a tenant has two): the sums, and the older oldest pending.
    pub fn absorb(&mut self, other: OutboxCounts) {
        self.pending += other.pending;
        self.due += other.due;
        self.quarantined += other.quarantined;
        self.oldest_pending_ms = match (self.oldest_pending_ms, other.oldest_pending_ms) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.last_position += other.last_position;
    }
}

/// One consumer's open inbox records.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct InboxCounts {
    /// Records received and waiting to be applied.
    pub pending: u64,
    /// Records a handler refused, each stopping its flow.
    pub blocked: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[derive(serde::Deserialize)]
    struct Paid {
        amount: i64,
    }

    /// Records what it was given (the target is a Vec of amounts).
    struct Sum;
    impl EventHandler<std::cell::RefCell<Vec<i64>>> for Sum {
        type Event = Paid;
        fn accepts(&self, event_type: &str) -> bool {
            event_type == "paid"
        }
        fn handle(
            &mut self,
            tx: &std::cell::RefCell<Vec<i64>>,
            _: &str,
            _: &Envelope,
            event: Paid,
        ) -> Result<(), HandleError> {
            tx.borrow_mut().push(event.amount);
            Ok(())
        }
    }

    fn event(event_type: &str, payload: serde_json::Value) -> Envelope {
        Envelope {
            event_id: "e1".into(),
            source: "s".into(),
            generation: "g".into(),
            flow_id: "f".into(),
            seq: 1,
            event_type: event_type.into(),
            schema_version: 1,
            payload,
            created_at_ms: 1,
            traceparent: None,
        }
    }

    #[test]
    fn a_typed_handler_decodes_skips_what_it_does_not_take_and_blocks_what_does_not_decode() {
        let target = std::cell::RefCell::new(Vec::new());
        let mut handler = Typed(Sum);
        handler.handle(&target, "c", &event("paid", json!({"amount": 5}))).unwrap();
        // Not its type: applied with no effect.
        handler.handle(&target, "c", &event("refunded", json!({"whatever": true}))).unwrap();
        assert_eq!(*target.borrow(), [5]);
        // Its type, a payload of another shape: blocked with the decoder's reason, not a panic.
        match handler.handle(&target, "c", &event("paid", json!({"amount": "five"}))) {
            Err(HandleError::Blocked(reason)) => assert!(reason.contains("does not decode"), "{reason}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(*target.borrow(), [5]);
    }

    /// `Sum` taking batches: each batch it is handed, as the amounts it holds.
    struct Batches(Vec<Vec<i64>>);

    impl EventHandler<std::cell::RefCell<Vec<i64>>> for Batches {
        type Event = Paid;
        fn accepts(&self, event_type: &str) -> bool {
            event_type == "paid"
        }
        fn handle(
            &mut self,
            tx: &std::cell::RefCell<Vec<i64>>,
            c: &str,
            e: &Envelope,
            event: Paid,
        ) -> Result<(), HandleError> {
            Sum.handle(tx, c, e, event)
        }
        fn batch_max(&self) -> usize {
            3
        }
        fn handle_batch(
            &mut self,
            tx: &std::cell::RefCell<Vec<i64>>,
            _: &str,
            events: Vec<(&Envelope, Paid)>,
        ) -> Result<(), HandleError> {
            self.0.push(events.iter().map(|(_, p)| p.amount).collect());
            tx.borrow_mut().extend(events.iter().map(|(_, p)| p.amount));
            Ok(())
        }
    }

    /// A typed handler's batch holds the accepted events, decoded; one that does not decode
    /// refuses the whole batch before the handler sees it (the drain then blocks it on its own).
    #[test]
    fn a_typed_batch_holds_the_accepted_events_decoded_and_refuses_one_that_does_not_decode() {
        let target = std::cell::RefCell::new(Vec::new());
        let mut handler = Typed(Batches(Vec::new()));
        assert_eq!(Handler::<std::cell::RefCell<Vec<i64>>>::batch_max(&handler), 3);
        let batch =
            [event("paid", json!({"amount": 1})), event("refunded", json!({})), event("paid", json!({"amount": 2}))];
        handler.handle_batch(&target, "c", &batch).unwrap();
        assert_eq!(handler.0 .0, [vec![1, 2]]);
        let refused = [event("paid", json!({"amount": 3})), event("paid", json!({"amount": "three"}))];
        match handler.handle_batch(&target, "c", &refused) {
            Err(HandleError::Blocked(reason)) => assert!(reason.contains("does not decode"), "{reason}"),
            other => panic!("{other:?}"),
        }
        assert_eq!((handler.0 .0.len(), target.borrow().clone()), (1, vec![1, 2]));
    }
}
