//! The in-memory reference model of the stores: plain `BTreeMap`s, no I/O, no SQL.
//!
//! [`ModelProducer`] implements [`ProducerStore`], [`ModelConsumer`] implements [`ConsumerStore`]
//! and [`ModelEndpoints`] implements [`Endpoints`], so the engine (`relay_once`) runs on the model
//! unchanged. The model follows the SQLite stores' semantics exactly (outcomes, dedup on both
//! identities with a hash compare on every path, gap/blocked/idle, per-flow drain stops, skip,
//! prune into receipts, horizon, rename with retired ids, delivery statuses, candidate order), and
//! it is the reference that every backend is checked against (`tests/it/model_check.rs`).
//!
//! Differences that are not semantics: event ids are deterministic (a counter, see
//! [`ModelProducer::new`]), and every write method works on a copy of the state that replaces
//! the state only on success, which is the model of "one transaction, all or nothing".
//! Ties in orderings are broken by primary key, as SQLite's indexes do.

use std::cell::RefCell;
use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use crate::decode::DecoderRegistry;
use crate::envelope::hash_hex;
use crate::error::{codes, Error, Result};
use crate::flow::{decide_advance, validate_request, AdvanceOutcome, AdvanceRequest, FlowMachine, FlowState};
use crate::id::{validate_id, validate_limit, validate_reason, validate_rename};
use crate::limits::{
    ADVANCE_BATCH_MAX, DRAIN_BATCH_EVENTS_MAX, PAGE_SIZE_MAX, PRUNE_BATCH_ROWS_MAX, RECEIVE_BATCH_EVENTS_MAX,
    RELAY_BATCH_EVENTS_MAX,
};
use crate::policy::{retention_walk_stops_at, RetentionPolicy};
use crate::reservation::{decoders, project, ReservationEvent, ReservationProjection};
use crate::store::{
    ApplyOutcome, ConsumerSnapshot, ConsumerStore, Delivery, DeliveryAction, DeliveryEntry, DeliveryResult,
    DeliveryStatus, DeliveryVerdict, DrainReport, DrainScope, DrainStop, Endpoints, FlowCursor, FlowRecord,
    HandleError, Handler, InboxEntry, InboxStatus, OutboxPruneReport, ProducerIdentity, ProducerSnapshot,
    ProducerStore, PruneReport, Receipt, ReceiveOutcome, RedeliverReport, RenameReport, Subscription,
};
use crate::{ensure_invariant, Envelope};

/// Rows a drain may look at beyond its apply limit (as in the SQLite store).
const DRAIN_SCAN_ROWS_EXTRA: usize = 4_096;
/// Stuck flows reported by one drain (as in the SQLite store).
const DRAIN_STUCK_REPORTED_MAX: usize = 100;

// ------------------------------------------------------------------------------------------
// Producer
// ------------------------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq)]
struct FlowRow {
    state: FlowState,
    last_seq: i64,
}

/// One outbox row, keyed by its position (1, 2, ... in commit order; pruned positions are gone).
/// The source comes from the identity when the event is read; the generation is the one the
/// event was committed under (kept across [`ModelProducer::rotate_generation`]), as in SQLite.
#[derive(Debug, Clone, PartialEq)]
struct OutboxRow {
    event_id: String,
    generation: String,
    flow_id: String,
    seq: i64,
    event_type: String,
    schema_version: u32,
    payload: Value,
    created_at_ms: i64,
}

#[derive(Debug, Clone, PartialEq)]
struct DeliveryRow {
    status: DeliveryStatus,
    attempts: u32,
    next_attempt_at_ms: i64,
    last_error: Option<String>,
    updated_at_ms: i64,
}

impl DeliveryRow {
    /// A delivery nothing happened to yet: pending, no attempt, no error, due since its event was
    /// committed. (SQLite keeps no row for it: its subscriber's cursor has not passed it.)
    fn fresh(created_at_ms: i64) -> DeliveryRow {
        DeliveryRow {
            status: DeliveryStatus::Pending,
            attempts: 0,
            next_attempt_at_ms: created_at_ms,
            last_error: None,
            updated_at_ms: created_at_ms,
        }
    }

    fn is_fresh(&self) -> bool {
        self.status == DeliveryStatus::Pending && self.attempts == 0 && self.last_error.is_none()
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
struct ProducerState {
    flows: BTreeMap<String, FlowRow>,
    outbox: BTreeMap<i64, OutboxRow>,
    /// The last position handed out (positions are never reused, as SQLite's INTEGER PRIMARY KEY
    /// after a delete of lower rows).
    last_position: i64,
    /// consumer_id -> endpoint.
    subscriptions: BTreeMap<String, String>,
    /// (position, consumer_id) -> delivery.
    deliveries: BTreeMap<(i64, String), DeliveryRow>,
    events_issued: u64,
}

/// The producer store in memory.
#[derive(Debug, Clone)]
pub struct ModelProducer {
    identity: ProducerIdentity,
    /// Tag that makes this producer's event ids distinct from another model producer's.
    id_tag: String,
    state: ProducerState,
}

impl ModelProducer {
    /// A producer with the namespace `source` and the incarnation `generation`. Event ids are
    /// `e<counter, 10 digits>-<16 hex of sha256(source, generation)>`: deterministic, fixed width.
    pub fn new(source: &str, generation: &str) -> Result<ModelProducer> {
        validate_id("source", source)?;
        validate_id("generation", generation)?;
        let id_tag = hash_hex(format!("{source}\n{generation}").as_bytes())[..16].to_string();
        Ok(ModelProducer {
            identity: ProducerIdentity { source: source.to_string(), generation: generation.to_string() },
            id_tag,
            state: ProducerState::default(),
        })
    }

    fn envelope(&self, row: &OutboxRow) -> Envelope {
        Envelope {
            event_id: row.event_id.clone(),
            source: self.identity.source.clone(),
            generation: row.generation.clone(),
            flow_id: row.flow_id.clone(),
            seq: row.seq,
            event_type: row.event_type.clone(),
            schema_version: row.schema_version,
            payload: row.payload.clone(),
            created_at_ms: row.created_at_ms,
            traceparent: None,
        }
    }

    fn position_of(&self, event_id: &str) -> Option<i64> {
        self.state.outbox.iter().find(|(_, row)| row.event_id == event_id).map(|(position, _)| *position)
    }

    fn entry(&self, position: i64, consumer_id: &str, row: &DeliveryRow) -> DeliveryEntry {
        let event = &self.state.outbox[&position];
        DeliveryEntry {
            event_id: event.event_id.clone(),
            flow_id: event.flow_id.clone(),
            seq: event.seq,
            consumer_id: consumer_id.to_string(),
            status: row.status,
            attempts: row.attempts,
            next_attempt_at_ms: row.next_attempt_at_ms,
            last_error: row.last_error.clone(),
            updated_at_ms: row.updated_at_ms,
        }
    }

    fn advance_one(
        &self,
        state: &mut ProducerState,
        machine: &dyn FlowMachine,
        request: &AdvanceRequest,
        now_ms: i64,
    ) -> Result<AdvanceOutcome> {
        let (current_seq, current) = match state.flows.get(&request.flow_id) {
            Some(flow) => (flow.last_seq, flow.state.clone()),
            None => (0, machine.initial()),
        };
        let (seq, decision) = match decide_advance(machine, current_seq, &current, request)? {
            Ok(decided) => decided,
            Err(rejection) => return Ok(rejection),
        };
        ensure_invariant!(seq == current_seq + 1, "allocated seq {seq} is not {current_seq} + 1");
        state.events_issued += 1;
        let event_id = format!("e{:010}-{}", state.events_issued, self.id_tag);
        state.flows.insert(request.flow_id.clone(), FlowRow { state: decision.next.clone(), last_seq: seq });
        state.last_position += 1;
        let position = state.last_position;
        state.outbox.insert(
            position,
            OutboxRow {
                event_id: event_id.clone(),
                generation: self.identity.generation.clone(),
                flow_id: request.flow_id.clone(),
                seq,
                event_type: decision.event_type,
                schema_version: request.schema_version,
                payload: decision.payload,
                created_at_ms: now_ms,
            },
        );
        for consumer_id in state.subscriptions.keys() {
            state.deliveries.insert((position, consumer_id.clone()), DeliveryRow::fresh(now_ms));
        }
        Ok(AdvanceOutcome::Committed { flow_id: request.flow_id.clone(), seq, event_id, state: decision.next.state })
    }

    /// Give this producer a new generation (what an operator does after restoring a backup).
    /// Events committed from now on carry it; events already in the outbox keep the generation
    /// they were committed under. SQLite picks a random generation; the model takes it from the
    /// caller so that runs stay deterministic (the caller must not reuse one). Event ids of
    /// later events take the new generation's tag, so a model restored from a clone of itself
    /// and rotated never hands out an event id twice.
    pub fn rotate_generation(&mut self, generation: &str) -> Result<ProducerIdentity> {
        validate_id("generation", generation)?;
        self.id_tag = hash_hex(format!("{}\n{generation}", self.identity.source).as_bytes())[..16].to_string();
        self.identity.generation = generation.to_string();
        Ok(self.identity.clone())
    }

    /// Rename a subscriber (the producer half of `rename-consumer`). Idempotent: renaming an id
    /// that is already renamed is a no-op.
    pub fn rename_subscription(&mut self, from: &str, to: &str) -> Result<u64> {
        validate_id("from", from)?;
        validate_id("to", to)?;
        let exists_to = self.state.subscriptions.contains_key(to);
        let Some(endpoint) = self.state.subscriptions.get(from).cloned() else {
            if exists_to {
                return Ok(0);
            }
            return Err(Error::not_found(format!("no subscription for consumer {from:?}")));
        };
        if exists_to {
            return Err(Error::invalid(codes::ALREADY_EXISTS, format!("a subscription for {to:?} already exists")));
        }
        let mut state = self.state.clone();
        state.subscriptions.remove(from);
        state.subscriptions.insert(to.to_string(), endpoint);
        let keys: Vec<(i64, String)> = state.deliveries.keys().filter(|(_, c)| c == from).cloned().collect();
        for key in &keys {
            let row = state.deliveries.remove(key).expect("key was just listed");
            state.deliveries.insert((key.0, to.to_string()), row);
        }
        self.state = state;
        Ok(keys.len() as u64)
    }
}

impl ProducerStore for ModelProducer {
    fn identity(&self) -> &ProducerIdentity {
        &self.identity
    }

    fn advance_batch(
        &mut self,
        machine: &dyn FlowMachine,
        requests: &[AdvanceRequest],
        now_ms: i64,
    ) -> Result<Vec<AdvanceOutcome>> {
        validate_limit("advance batch", requests.len(), ADVANCE_BATCH_MAX)?;
        for request in requests {
            validate_request(machine, request)?;
        }
        let mut state = self.state.clone();
        let mut outcomes = Vec::with_capacity(requests.len());
        for request in requests {
            outcomes.push(self.advance_one(&mut state, machine, request, now_ms)?);
        }
        self.state = state;
        Ok(outcomes)
    }

    fn subscribe(&mut self, subscription: &Subscription, from_start: bool, _now_ms: i64) -> Result<u64> {
        validate_id("consumer_id", &subscription.consumer_id)?;
        crate::endpoint::Endpoint::parse(&subscription.endpoint)?;
        let consumer_id = subscription.consumer_id.clone();
        if let Some(endpoint) = self.state.subscriptions.get_mut(&consumer_id) {
            // Same endpoint: nothing to do; another endpoint: move the subscription there.
            endpoint.clone_from(&subscription.endpoint);
            return Ok(0);
        }
        let mut state = self.state.clone();
        state.subscriptions.insert(consumer_id.clone(), subscription.endpoint.clone());
        let mut queued = 0;
        if from_start {
            let positions: Vec<(i64, i64)> = state.outbox.iter().map(|(p, row)| (*p, row.created_at_ms)).collect();
            for (position, created_at_ms) in positions {
                let key = (position, consumer_id.clone());
                ensure_invariant!(!state.deliveries.contains_key(&key), "delivery {key:?} already exists");
                state.deliveries.insert(key, DeliveryRow::fresh(created_at_ms));
                queued += 1;
            }
        }
        self.state = state;
        Ok(queued)
    }

    fn subscriptions(&self) -> Result<Vec<Subscription>> {
        Ok(self
            .state
            .subscriptions
            .iter()
            .map(|(consumer_id, endpoint)| Subscription {
                consumer_id: consumer_id.clone(),
                endpoint: endpoint.clone(),
            })
            .collect())
    }

    fn due_deliveries(
        &mut self,
        now_ms: i64,
        limit: usize,
        event_id: Option<&str>,
        consumers: Option<&[String]>,
    ) -> Result<Vec<Delivery>> {
        validate_limit("relay limit", limit, RELAY_BATCH_EVENTS_MAX * 4)?;
        let wanted = |c: &String| consumers.is_none_or(|list| list.contains(c));
        // Candidates as (position, consumer_id), in the order SQLite reads them.
        let mut picked: Vec<(i64, &String, &DeliveryRow)> = match event_id {
            Some(event_id) => {
                validate_id("event_id", event_id)?;
                let Some(position) = self.position_of(event_id) else { return Ok(Vec::new()) };
                // Keys are ordered by (position, consumer_id): this is ORDER BY consumer_id.
                self.state
                    .deliveries
                    .range((position, String::new())..)
                    .take_while(|((p, _), _)| *p == position)
                    .filter(|((_, c), row)| {
                        wanted(c) && matches!(row.status, DeliveryStatus::Pending | DeliveryStatus::Quarantined)
                    })
                    .map(|((p, c), row)| (*p, c, row))
                    .collect()
            }
            None => {
                // As the stores read them: the first `limit` due retries by (position, consumer),
                // and for each subscriber the first `limit` fresh deliveries (due since their
                // commit) by position; then the `limit` smallest (position, consumer) of those.
                let subscribed = |c: &String| self.state.subscriptions.contains_key(c) && wanted(c);
                let mut retries: Vec<(i64, &String, &DeliveryRow)> = self
                    .state
                    .deliveries
                    .iter()
                    .filter(|((_, c), row)| {
                        subscribed(c)
                            && row.status == DeliveryStatus::Pending
                            && !row.is_fresh()
                            && row.next_attempt_at_ms <= now_ms
                    })
                    .map(|((p, c), row)| (*p, c, row))
                    .collect();
                retries.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
                retries.truncate(limit);
                let mut due = retries;
                for consumer_id in self.state.subscriptions.keys().filter(|c| wanted(c)) {
                    let fresh = self
                        .state
                        .deliveries
                        .iter()
                        .filter(|((_, c), row)| c == consumer_id && row.is_fresh() && row.next_attempt_at_ms <= now_ms)
                        .map(|((p, c), row)| (*p, c, row))
                        .take(limit);
                    due.extend(fresh);
                }
                due.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
                due
            }
        };
        picked.retain(|(_, consumer_id, _)| self.state.subscriptions.contains_key(*consumer_id));
        picked.truncate(limit);
        Ok(picked
            .into_iter()
            .map(|(position, consumer_id, row)| Delivery {
                position,
                envelope: self.envelope(&self.state.outbox[&position]),
                consumer_id: consumer_id.clone(),
                endpoint: self.state.subscriptions[consumer_id].clone(),
                attempts: row.attempts,
            })
            .collect())
    }

    fn record_deliveries(&mut self, results: &[DeliveryResult], now_ms: i64) -> Result<()> {
        let mut state = self.state.clone();
        for result in results {
            let position = result.position;
            crate::ensure_invariant!(
                self.position_of(&result.event_id) == Some(position),
                "delivery result for event {} names position {position}, which holds another event",
                result.event_id
            );
            let Some(row) = state.deliveries.get_mut(&(position, result.consumer_id.clone())) else { continue };
            if !matches!(row.status, DeliveryStatus::Pending | DeliveryStatus::Quarantined) {
                continue;
            }
            // A fresh delivery accepted at once keeps its commit time (SQLite's cursor records no
            // time of its own).
            let fresh = row.is_fresh();
            match &result.verdict {
                DeliveryVerdict::Accepted if fresh => {
                    row.status = DeliveryStatus::Accepted;
                    continue;
                }
                DeliveryVerdict::Accepted => {
                    row.status = DeliveryStatus::Accepted;
                    row.last_error = None;
                }
                DeliveryVerdict::Retry { reason, next_attempt_at_ms } => {
                    row.attempts += 1;
                    row.next_attempt_at_ms = *next_attempt_at_ms;
                    row.last_error = Some(reason.clone());
                    row.status = DeliveryStatus::Pending;
                }
                DeliveryVerdict::Quarantine { reason } => {
                    row.attempts += 1;
                    row.status = DeliveryStatus::Quarantined;
                    row.last_error = Some(reason.clone());
                }
            }
            row.updated_at_ms = now_ms;
        }
        self.state = state;
        Ok(())
    }

    fn deliveries(&self, status: Option<DeliveryStatus>, limit: usize) -> Result<Vec<DeliveryEntry>> {
        validate_limit("page size", limit, PAGE_SIZE_MAX)?;
        Ok(self
            .state
            .deliveries
            .iter()
            .filter(|(_, row)| status.is_none_or(|s| row.status == s))
            .take(limit)
            .map(|((position, consumer_id), row)| self.entry(*position, consumer_id, row))
            .collect())
    }

    fn resolve_delivery(
        &mut self,
        event_id: &str,
        consumer_id: &str,
        action: DeliveryAction,
        reason: &str,
        now_ms: i64,
    ) -> Result<DeliveryEntry> {
        validate_id("event_id", event_id)?;
        validate_id("consumer_id", consumer_id)?;
        validate_reason(reason)?;
        let not_found = || Error::not_found(format!("no delivery of event {event_id} to consumer {consumer_id}"));
        let position = self.position_of(event_id).ok_or_else(not_found)?;
        let key = (position, consumer_id.to_string());
        let mut row = self.state.deliveries.get(&key).cloned().ok_or_else(not_found)?;
        let allowed = match action {
            DeliveryAction::Requeue => matches!(row.status, DeliveryStatus::Quarantined | DeliveryStatus::Dismissed),
            DeliveryAction::Dismiss => matches!(row.status, DeliveryStatus::Quarantined | DeliveryStatus::Pending),
        };
        if !allowed {
            return Err(Error::invalid(
                codes::INVALID_STATE_CHANGE,
                format!("cannot {action:?} a delivery that is {}", row.status.as_str()),
            ));
        }
        let note =
            format!("operator {}: {reason}", if action == DeliveryAction::Requeue { "requeued" } else { "dismissed" });
        match action {
            DeliveryAction::Requeue => {
                row.status = DeliveryStatus::Pending;
                row.attempts = 0;
                row.next_attempt_at_ms = now_ms;
            }
            DeliveryAction::Dismiss => row.status = DeliveryStatus::Dismissed,
        }
        row.last_error = Some(note);
        row.updated_at_ms = now_ms;
        let entry = self.entry(position, consumer_id, &row);
        self.state.deliveries.insert(key, row);
        Ok(entry)
    }

    fn flow(&self, flow_id: &str) -> Result<Option<FlowRecord>> {
        validate_id("flow_id", flow_id)?;
        Ok(self.state.flows.get(flow_id).map(|flow| FlowRecord {
            flow_id: flow_id.to_string(),
            last_seq: flow.last_seq,
            state: flow.state.clone(),
        }))
    }

    fn redeliver(&mut self, consumer_id: &str, from_event_id: Option<&str>) -> Result<RedeliverReport> {
        validate_id("consumer_id", consumer_id)?;
        if let Some(event_id) = from_event_id {
            validate_id("event_id", event_id)?;
        }
        if !self.state.subscriptions.contains_key(consumer_id) {
            return Err(Error::not_found(format!("no subscription for consumer {consumer_id:?}")));
        }
        let chosen = match from_event_id {
            Some(event_id) => Some(
                self.position_of(event_id)
                    .ok_or_else(|| Error::not_found(format!("the outbox holds no event {event_id}")))?,
            ),
            None => self.state.outbox.keys().next().copied(),
        };
        let (Some(chosen), Some(&newest)) = (chosen, self.state.outbox.keys().next_back()) else {
            return Ok(RedeliverReport::default());
        };
        let held = self.state.outbox.range(chosen..).count() as i64;
        // The subscriber has a delivery for every event from its subscription on.
        let mut redelivered = 0;
        for ((position, consumer), row) in self.state.deliveries.range_mut((chosen, String::new())..) {
            if consumer == consumer_id {
                *row = DeliveryRow::fresh(self.state.outbox[position].created_at_ms);
                redelivered += 1;
            }
        }
        Ok(RedeliverReport { redelivered, pruned: (newest - chosen + 1 - held) as u64 })
    }

    fn prune_delivered(&mut self, retention_ms: i64, batch_rows: usize, now_ms: i64) -> Result<OutboxPruneReport> {
        validate_limit("prune batch", batch_rows, PRUNE_BATCH_ROWS_MAX)?;
        if retention_ms < 0 {
            return Err(Error::invalid(codes::INVALID_ARGUMENT, "delivered retention must be >= 0"));
        }
        let cutoff = now_ms.saturating_sub(retention_ms);
        let unsettled = |state: &ProducerState, position: i64| {
            state.deliveries.iter().any(|((p, _), row)| {
                *p == position && matches!(row.status, DeliveryStatus::Pending | DeliveryStatus::Quarantined)
            })
        };
        // In position order, up to the first event written at or after the cutoff (events
        // stamped after `now_ms` are passed over).
        let mut candidates: Vec<(i64, i64)> = self
            .state
            .outbox
            .iter()
            .take_while(|(_, row)| !retention_walk_stops_at(row.created_at_ms, cutoff, now_ms))
            .filter(|(position, row)| row.created_at_ms < cutoff && !unsettled(&self.state, **position))
            .map(|(position, row)| (row.created_at_ms, *position))
            .collect();
        candidates.truncate(batch_rows);
        let mut state = self.state.clone();
        let mut deliveries_deleted = 0;
        for (_, position) in &candidates {
            let keys: Vec<(i64, String)> = state.deliveries.keys().filter(|(p, _)| p == position).cloned().collect();
            deliveries_deleted += keys.len();
            for key in keys {
                state.deliveries.remove(&key);
            }
            state.outbox.remove(position);
        }
        self.state = state;
        Ok(OutboxPruneReport {
            events_deleted: candidates.len() as u64,
            deliveries_deleted: deliveries_deleted as u64,
            more: candidates.len() == batch_rows,
        })
    }

    fn snapshot(&self, rows_max: usize) -> Result<ProducerSnapshot> {
        Ok(ProducerSnapshot {
            identity: self.identity.clone(),
            subscriptions: self.subscriptions()?,
            flows: self
                .state
                .flows
                .iter()
                .take(rows_max)
                .map(|(flow_id, flow)| FlowRecord {
                    flow_id: flow_id.clone(),
                    last_seq: flow.last_seq,
                    state: flow.state.clone(),
                })
                .collect(),
            outbox: self.state.outbox.values().take(rows_max).map(|row| self.envelope(row)).collect(),
            deliveries: self
                .state
                .deliveries
                .iter()
                .take(rows_max)
                .map(|((position, consumer_id), row)| self.entry(*position, consumer_id, row))
                .collect(),
        })
    }
}

// ------------------------------------------------------------------------------------------
// Consumer
// ------------------------------------------------------------------------------------------

/// (consumer_id, source, flow_id, seq): the primary key of inbox records and receipts.
type SeqKey = (String, String, String, i64);
/// (consumer_id, source, flow_id): the key of cursors and projections.
type FlowKey = (String, String, String);

#[derive(Debug, Clone, PartialEq)]
struct InboxRow {
    /// Receive order (SQLite's `record`): retention walks the inbox in this order.
    record: u64,
    event_id: String,
    generation: String,
    event_type: String,
    schema_version: u32,
    payload: Value,
    content_hash: String,
    created_at_ms: i64,
    received_at_ms: i64,
    status: InboxStatus,
    reason: Option<String>,
    status_at_ms: i64,
}

#[derive(Debug, Clone, PartialEq)]
struct ReceiptRow {
    event_id: String,
    content_hash: String,
    created_at_ms: i64,
    generation: String,
}

#[derive(Debug, Clone, Default, PartialEq)]
struct ConsumerState {
    inbox: BTreeMap<SeqKey, InboxRow>,
    /// The last `record` number handed out.
    last_record: u64,
    receipts: BTreeMap<SeqKey, ReceiptRow>,
    /// High-water marks, always >= 1.
    cursors: BTreeMap<FlowKey, i64>,
    /// consumer_id -> renamed_to.
    retired: BTreeMap<String, String>,
}

impl ConsumerState {
    fn high_water(&self, consumer_id: &str, source: &str, flow_id: &str) -> i64 {
        self.cursors.get(&(consumer_id.to_string(), source.to_string(), flow_id.to_string())).copied().unwrap_or(0)
    }

    /// Raise a cursor (never lowers it).
    fn set_cursor(&mut self, consumer_id: &str, source: &str, flow_id: &str, high_water_seq: i64) {
        let cursor =
            self.cursors.entry((consumer_id.to_string(), source.to_string(), flow_id.to_string())).or_insert(0);
        *cursor = (*cursor).max(high_water_seq);
    }

    fn uses(&self, consumer_id: &str) -> bool {
        self.inbox.keys().any(|k| k.0 == consumer_id)
            || self.receipts.keys().any(|k| k.0 == consumer_id)
            || self.cursors.keys().any(|k| k.0 == consumer_id)
    }
}

fn envelope_of(key: &SeqKey, row: &InboxRow) -> Envelope {
    Envelope {
        event_id: row.event_id.clone(),
        source: key.1.clone(),
        generation: row.generation.clone(),
        flow_id: key.2.clone(),
        seq: key.3,
        event_type: row.event_type.clone(),
        schema_version: row.schema_version,
        payload: row.payload.clone(),
        created_at_ms: row.created_at_ms,
        traceparent: None,
    }
}

fn inbox_entry(key: &SeqKey, row: &InboxRow) -> InboxEntry {
    InboxEntry {
        consumer_id: key.0.clone(),
        envelope: envelope_of(key, row),
        content_hash: row.content_hash.clone(),
        status: row.status,
        reason: row.reason.clone(),
        received_at_ms: row.received_at_ms,
    }
}

/// A reservation projection row (the model of the `reservation_projection` table).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModelReservationRow {
    /// The flow's state in the projection (`reserved`, `confirmed` or `released`).
    pub state: String,
    /// The flow's quantity, fixed for its life.
    pub quantity: i64,
    /// The seq of the last event applied to this row.
    pub last_seq: i64,
}

/// One effect (the model of a `reservation_effects` row), in the order effects were written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModelEffect {
    /// The logical consumer whose handler wrote the effect.
    pub consumer_id: String,
    /// The producer namespace of the event.
    pub source: String,
    /// The flow of the event.
    pub flow_id: String,
    /// The event's seq in its flow.
    pub seq: i64,
    /// The event that caused the effect; one effect per applied event, so a double apply shows up
    /// as two.
    pub event_id: String,
    /// The state the event moved the flow to (`reserved`, `confirmed`, `released`).
    pub kind: String,
    /// The flow's quantity at that event.
    pub quantity: i64,
}

/// The user projections of a model consumer: what handlers write, inside the drain.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelProjection {
    /// (consumer_id, source, flow_id) -> row.
    pub reservations: BTreeMap<(String, String, String), ModelReservationRow>,
    /// Every effect written, in apply order.
    pub effects: Vec<ModelEffect>,
}

impl ModelProjection {
    fn rename(&mut self, from: &str, to: &str) -> u64 {
        let keys: Vec<FlowKey> = self.reservations.keys().filter(|k| k.0 == from).cloned().collect();
        for key in &keys {
            let row = self.reservations.remove(key).expect("key was just listed");
            self.reservations.insert((to.to_string(), key.1.clone(), key.2.clone()), row);
        }
        let mut effects = 0;
        for effect in self.effects.iter_mut().filter(|e| e.consumer_id == from) {
            effect.consumer_id = to.to_string();
            effects += 1;
        }
        keys.len() as u64 + effects
    }
}

/// The reservation handler on the model (the model of `ReservationHandler`): decode by (event
/// type, schema version), check the transition, write the projection and one effect.
pub struct ModelReservationHandler {
    decoders: DecoderRegistry<ReservationEvent>,
}

impl ModelReservationHandler {
    /// The reservation handler with the v1 decoders, and the v2 ones too with `support_v2`.
    pub fn new(support_v2: bool) -> Self {
        ModelReservationHandler { decoders: decoders(support_v2) }
    }
}

impl Handler<RefCell<ModelProjection>> for ModelReservationHandler {
    fn handle(
        &mut self,
        target: &RefCell<ModelProjection>,
        consumer_id: &str,
        event: &Envelope,
    ) -> std::result::Result<(), HandleError> {
        let decoded = self
            .decoders
            .decode(&event.event_type, event.schema_version, &event.payload)
            .map_err(HandleError::Blocked)?;
        let mut projection = target.borrow_mut();
        let key = (consumer_id.to_string(), event.source.clone(), event.flow_id.clone());
        let current = projection
            .reservations
            .get(&key)
            .map(|row| ReservationProjection { state: row.state.clone(), quantity: row.quantity });
        let next = project(current.as_ref(), &decoded).map_err(HandleError::Blocked)?;
        projection.reservations.insert(
            key,
            ModelReservationRow { state: next.state.clone(), quantity: next.quantity, last_seq: event.seq },
        );
        projection.effects.push(ModelEffect {
            consumer_id: consumer_id.to_string(),
            source: event.source.clone(),
            flow_id: event.flow_id.clone(),
            seq: event.seq,
            event_id: event.event_id.clone(),
            kind: next.state,
            quantity: next.quantity,
        });
        Ok(())
    }
}

/// The walk of one flow during a drain (as in the SQLite store).
struct FlowWalk {
    source: String,
    flow_id: String,
    start_high_water: i64,
    next_seq: i64,
    /// Gap or blocked: the rest of this flow waits.
    stuck: bool,
}

impl FlowWalk {
    /// Move the flow's cursor to the last seq this drain applied.
    fn finish(self, state: &mut ConsumerState, consumer_id: &str) {
        if self.next_seq - 1 > self.start_high_water {
            state.set_cursor(consumer_id, &self.source, &self.flow_id, self.next_seq - 1);
        }
    }
}

/// The consumer store in memory.
#[derive(Debug, Clone)]
pub struct ModelConsumer {
    retention: RetentionPolicy,
    state: ConsumerState,
    projection: RefCell<ModelProjection>,
}

impl ModelConsumer {
    /// An empty consumer that keeps receipts for `retention.horizon_ms`; a horizon that is not
    /// positive is `invalid_argument`.
    pub fn new(retention: RetentionPolicy) -> Result<ModelConsumer> {
        if retention.horizon_ms <= 0 {
            return Err(Error::invalid(codes::INVALID_ARGUMENT, "horizon_ms must be positive"));
        }
        Ok(ModelConsumer { retention, state: ConsumerState::default(), projection: RefCell::default() })
    }

    /// The retention policy the consumer was made with.
    pub fn retention(&self) -> RetentionPolicy {
        self.retention
    }

    /// The user projections (what handlers wrote).
    pub fn projection(&self) -> std::cell::Ref<'_, ModelProjection> {
        self.projection.borrow()
    }

    /// Retired consumer ids and what they were renamed to.
    pub fn retired(&self) -> Vec<(String, String)> {
        self.state.retired.iter().map(|(from, to)| (from.clone(), to.clone())).collect()
    }

    fn receive_one(&mut self, consumer_id: &str, event: &Envelope, now_ms: i64) -> ReceiveOutcome {
        let hash = event.content_hash();
        let consumer = consumer_id.to_string();
        let event_id = event.event_id.clone();
        let conflict = |reason: String| ReceiveOutcome::Conflict {
            consumer_id: consumer.clone(),
            event_id: event_id.clone(),
            reason,
        };
        let compare = |held_id: &str, held_hash: &str, held_generation: Option<&str>, place: &str| {
            if held_id == event.event_id && held_hash == hash {
                return ReceiveOutcome::Duplicate { consumer_id: consumer.clone(), event_id: event_id.clone() };
            }
            let mut reason = if held_id != event.event_id {
                format!(
                    "{}/{}/{} is already held ({place}) as event {held_id}; got event {}",
                    event.source, event.flow_id, event.seq, event.event_id
                )
            } else {
                format!("event {} is already held ({place}) with different content", event.event_id)
            };
            if let Some(generation) = held_generation {
                if generation != event.generation {
                    reason.push_str(&format!(
                        "; producer generation changed from {generation} to {} (restored or re-created producer?)",
                        event.generation
                    ));
                }
            }
            conflict(reason)
        };
        let key: SeqKey = (consumer.clone(), event.source.clone(), event.flow_id.clone(), event.seq);
        // Every path that finds an existing record compares the content hash.
        if let Some(held) = self.state.inbox.get(&key) {
            return compare(&held.event_id, &held.content_hash, Some(&held.generation), "inbox");
        }
        if let Some(held) = self.state.receipts.get(&key) {
            return compare(&held.event_id, &held.content_hash, Some(&held.generation), "receipt");
        }
        let elsewhere = self
            .state
            .inbox
            .iter()
            .find(|(k, row)| k.0 == consumer && row.event_id == event.event_id)
            .map(|(k, _)| k)
            .or_else(|| {
                self.state
                    .receipts
                    .iter()
                    .find(|(k, row)| k.0 == consumer && row.event_id == event.event_id)
                    .map(|(k, _)| k)
            });
        if let Some((_, source, flow, seq)) = elsewhere {
            return conflict(format!(
                "event id {} is already held for {source}/{flow}/{seq}; got it for {}/{}/{}",
                event.event_id, event.source, event.flow_id, event.seq
            ));
        }
        if event.created_at_ms < now_ms.saturating_sub(self.retention.horizon_ms) {
            return ReceiveOutcome::Expired { consumer_id: consumer, event_id, horizon_ms: self.retention.horizon_ms };
        }
        let high_water_seq = self.state.high_water(&consumer, &event.source, &event.flow_id);
        if event.seq <= high_water_seq {
            return conflict(format!(
                "seq {} is at or below the high-water mark {high_water_seq} of {}/{} but no record or receipt of it remains",
                event.seq, event.source, event.flow_id
            ));
        }
        self.state.last_record += 1;
        self.state.inbox.insert(
            key,
            InboxRow {
                record: self.state.last_record,
                event_id: event.event_id.clone(),
                generation: event.generation.clone(),
                event_type: event.event_type.clone(),
                schema_version: event.schema_version,
                payload: event.payload.clone(),
                content_hash: hash,
                created_at_ms: event.created_at_ms,
                received_at_ms: now_ms,
                status: InboxStatus::Pending,
                reason: None,
                status_at_ms: now_ms,
            },
        );
        ReceiveOutcome::Accepted { consumer_id: consumer, event_id }
    }

    /// The body of `drain`; on `Err` the caller restores the state and the projection.
    fn drain_in(
        &mut self,
        consumer_id: &str,
        scope: &DrainScope,
        limit: usize,
        handler: &mut dyn Handler<RefCell<ModelProjection>>,
        now_ms: i64,
    ) -> Result<DrainReport> {
        // Open (pending or blocked) records in scope, in (source, flow_id, seq) order.
        let open: Vec<SeqKey> = self
            .state
            .inbox
            .iter()
            .filter(|(k, row)| {
                k.0 == consumer_id
                    && matches!(row.status, InboxStatus::Pending | InboxStatus::Blocked)
                    && match scope {
                        DrainScope::All => true,
                        DrainScope::Flow { source, flow_id } => &k.1 == source && &k.2 == flow_id,
                    }
            })
            .map(|(k, _)| k.clone())
            .collect();
        let scan_rows_max = limit + DRAIN_SCAN_ROWS_EXTRA;
        let mut scanned = 0_usize;
        let mut applied = 0_u64;
        let mut stuck: Vec<ApplyOutcome> = Vec::new();
        let mut last_applied = None;
        let mut hit_limit = false;
        let mut walk: Option<FlowWalk> = None;
        for key in open {
            scanned += 1;
            let (_, source, flow_id, seq) = &key;
            if walk.as_ref().is_none_or(|w| (&w.source, &w.flow_id) != (source, flow_id)) {
                if let Some(previous) = walk.take() {
                    previous.finish(&mut self.state, consumer_id);
                }
                let high_water = self.state.high_water(consumer_id, source, flow_id);
                walk = Some(FlowWalk {
                    source: source.clone(),
                    flow_id: flow_id.clone(),
                    start_high_water: high_water,
                    next_seq: high_water + 1,
                    stuck: false,
                });
            }
            let current = walk.as_mut().expect("walk was just set");
            if current.stuck {
                continue;
            }
            ensure_invariant!(
                *seq >= current.next_seq,
                "open inbox record {source}/{flow_id}/{seq} is at or below the high-water mark {}",
                current.next_seq - 1
            );
            if *seq > current.next_seq {
                current.stuck = true;
                if stuck.len() < DRAIN_STUCK_REPORTED_MAX {
                    stuck.push(ApplyOutcome::Gap {
                        source: source.clone(),
                        flow_id: flow_id.clone(),
                        missing_seq: current.next_seq,
                    });
                }
                continue;
            }
            let event = envelope_of(&key, &self.state.inbox[&key]);
            let savepoint = self.projection.borrow().clone();
            match handler.handle(&self.projection, consumer_id, &event) {
                Ok(()) => {
                    let row = self.state.inbox.get_mut(&key).expect("open record exists");
                    row.status = InboxStatus::Applied;
                    row.reason = None;
                    row.status_at_ms = now_ms;
                    current.next_seq += 1;
                    applied += 1;
                    last_applied = Some(ApplyOutcome::Applied {
                        source: source.clone(),
                        flow_id: flow_id.clone(),
                        seq: *seq,
                        event_id: event.event_id.clone(),
                    });
                    if applied as usize == limit {
                        hit_limit = true;
                        break;
                    }
                }
                Err(HandleError::Blocked(reason)) => {
                    *self.projection.borrow_mut() = savepoint;
                    let row = self.state.inbox.get_mut(&key).expect("open record exists");
                    row.status = InboxStatus::Blocked;
                    row.reason = Some(reason.clone());
                    row.status_at_ms = now_ms;
                    current.stuck = true;
                    if stuck.len() < DRAIN_STUCK_REPORTED_MAX {
                        stuck.push(ApplyOutcome::Blocked {
                            source: source.clone(),
                            flow_id: flow_id.clone(),
                            seq: *seq,
                            event_id: event.event_id.clone(),
                            reason,
                        });
                    }
                }
                Err(HandleError::Failed(error)) => return Err(error),
            }
            if scanned >= scan_rows_max {
                hit_limit = true;
                break;
            }
        }
        if let Some(last) = walk.take() {
            last.finish(&mut self.state, consumer_id);
        }
        let outcome = if hit_limit {
            DrainStop::Limit
        } else {
            match stuck.first() {
                None => DrainStop::Idle,
                Some(ApplyOutcome::Gap { .. }) => DrainStop::Gap,
                Some(_) => DrainStop::Blocked,
            }
        };
        Ok(DrainReport { outcome, applied, stuck, last_applied })
    }
}

impl ConsumerStore for ModelConsumer {
    type Target = RefCell<ModelProjection>;

    fn receive_batch(&mut self, items: &[(&str, &Envelope)], now_ms: i64) -> Result<Vec<ReceiveOutcome>> {
        validate_limit("receive batch", items.len(), RECEIVE_BATCH_EVENTS_MAX)?;
        for (consumer_id, event) in items {
            validate_id("consumer_id", consumer_id)?;
            event.validate()?;
        }
        let mut outcomes = Vec::with_capacity(items.len());
        for (consumer_id, event) in items {
            if let Some(renamed_to) = self.state.retired.get(*consumer_id) {
                outcomes.push(ReceiveOutcome::Conflict {
                    consumer_id: consumer_id.to_string(),
                    event_id: event.event_id.clone(),
                    reason: format!(
                        "consumer {consumer_id} was renamed to {renamed_to}; rename the producer's subscription too"
                    ),
                });
                continue;
            }
            outcomes.push(self.receive_one(consumer_id, event, now_ms));
        }
        Ok(outcomes)
    }

    fn drain(
        &mut self,
        consumer_id: &str,
        scope: &DrainScope,
        limit: usize,
        handler: &mut dyn Handler<RefCell<ModelProjection>>,
        now_ms: i64,
    ) -> Result<DrainReport> {
        validate_id("consumer_id", consumer_id)?;
        validate_limit("drain limit", limit, DRAIN_BATCH_EVENTS_MAX)?;
        if let DrainScope::Flow { source, flow_id } = scope {
            validate_id("source", source)?;
            validate_id("flow_id", flow_id)?;
        }
        let state = self.state.clone();
        let projection = self.projection.borrow().clone();
        let report = self.drain_in(consumer_id, scope, limit, handler, now_ms);
        if report.is_err() {
            // The whole drain is one transaction: nothing of it stays.
            self.state = state;
            *self.projection.borrow_mut() = projection;
        }
        report
    }

    fn inbox(&self, consumer_id: &str, status: Option<InboxStatus>, limit: usize) -> Result<Vec<InboxEntry>> {
        validate_id("consumer_id", consumer_id)?;
        validate_limit("page size", limit, PAGE_SIZE_MAX)?;
        Ok(self
            .state
            .inbox
            .iter()
            .filter(|(k, row)| k.0 == consumer_id && status.is_none_or(|s| row.status == s))
            .take(limit)
            .map(|(k, row)| inbox_entry(k, row))
            .collect())
    }

    fn skip_blocked(&mut self, consumer_id: &str, event_id: &str, reason: &str, now_ms: i64) -> Result<InboxEntry> {
        validate_id("consumer_id", consumer_id)?;
        validate_id("event_id", event_id)?;
        validate_reason(reason)?;
        let key = self
            .state
            .inbox
            .iter()
            .find(|(k, row)| k.0 == consumer_id && row.event_id == event_id)
            .map(|(k, _)| k.clone())
            .ok_or_else(|| Error::not_found(format!("consumer {consumer_id} holds no event {event_id}")))?;
        let status = self.state.inbox[&key].status;
        if status != InboxStatus::Blocked {
            return Err(Error::invalid(
                codes::INVALID_STATE_CHANGE,
                format!("only blocked records can be skipped; event {event_id} is {}", status.as_str()),
            ));
        }
        let (_, source, flow_id, seq) = &key;
        let high_water = self.state.high_water(consumer_id, source, flow_id);
        ensure_invariant!(high_water + 1 == *seq, "blocked seq {seq} is not high-water {high_water} + 1");
        let row = self.state.inbox.get_mut(&key).expect("record exists");
        row.status = InboxStatus::Skipped;
        row.reason = Some(format!("skipped by operator: {reason}"));
        row.status_at_ms = now_ms;
        let entry = inbox_entry(&key, row);
        self.state.set_cursor(consumer_id, source, flow_id, *seq);
        Ok(entry)
    }

    fn prune(&mut self, applied_retention_ms: i64, batch_rows: usize, now_ms: i64) -> Result<PruneReport> {
        validate_limit("prune batch", batch_rows, PRUNE_BATCH_ROWS_MAX)?;
        if applied_retention_ms < 0 {
            return Err(Error::invalid(codes::INVALID_ARGUMENT, "applied retention must be >= 0"));
        }
        let mut state = self.state.clone();
        // Applied (or skipped) bodies become compact receipts in receive order, up to the first
        // record received after the cutoff (records stamped after `now_ms` are passed over);
        // high-water marks are never pruned.
        let cutoff = now_ms.saturating_sub(applied_retention_ms);
        let mut by_record: Vec<(&SeqKey, &InboxRow)> = state.inbox.iter().collect();
        by_record.sort_by_key(|(_, row)| row.record);
        let mut done: Vec<(u64, SeqKey)> = by_record
            .into_iter()
            .take_while(|(_, row)| !retention_walk_stops_at(row.received_at_ms, cutoff.saturating_add(1), now_ms))
            .filter(|(_, row)| matches!(row.status, InboxStatus::Applied | InboxStatus::Skipped))
            .filter(|(_, row)| row.status_at_ms <= cutoff)
            .map(|(k, row)| (row.record, k.clone()))
            .collect();
        done.truncate(batch_rows);
        for (_, key) in &done {
            let row = state.inbox.remove(key).expect("listed record exists");
            let receipt = ReceiptRow {
                event_id: row.event_id,
                content_hash: row.content_hash,
                created_at_ms: row.created_at_ms,
                generation: row.generation,
            };
            ensure_invariant!(state.receipts.insert(key.clone(), receipt).is_none(), "receipt {key:?} already exists");
        }
        // Receipts past the horizon go: an event that old is rejected as expired anyway.
        let horizon_cutoff = now_ms.saturating_sub(self.retention.horizon_ms);
        let mut old: Vec<(i64, SeqKey)> = state
            .receipts
            .iter()
            .filter(|(_, receipt)| receipt.created_at_ms < horizon_cutoff)
            .map(|(k, receipt)| (receipt.created_at_ms, k.clone()))
            .collect();
        old.sort();
        old.truncate(batch_rows);
        for (_, key) in &old {
            state.receipts.remove(key);
        }
        self.state = state;
        Ok(PruneReport {
            compacted: done.len() as u64,
            receipts_deleted: old.len() as u64,
            more: done.len() == batch_rows || old.len() == batch_rows,
        })
    }

    fn rename_consumer(&mut self, from: &str, to: &str, _now_ms: i64) -> Result<RenameReport> {
        validate_rename(from, to)?;
        if !self.state.uses(from) {
            return Err(Error::not_found(format!("consumer {from:?} has no state in this database")));
        }
        if self.state.uses(to) {
            return Err(Error::invalid(
                codes::ALREADY_EXISTS,
                format!("consumer {to:?} already has state; pick an unused id"),
            ));
        }
        fn rekey<V>(map: &mut BTreeMap<SeqKey, V>, from: &str, to: &str) -> u64 {
            let keys: Vec<SeqKey> = map.keys().filter(|k| k.0 == from).cloned().collect();
            for key in &keys {
                let value = map.remove(key).expect("key was just listed");
                map.insert((to.to_string(), key.1.clone(), key.2.clone(), key.3), value);
            }
            keys.len() as u64
        }
        let mut state = self.state.clone();
        let inbox = rekey(&mut state.inbox, from, to);
        let receipts = rekey(&mut state.receipts, from, to);
        let cursor_keys: Vec<FlowKey> = state.cursors.keys().filter(|k| k.0 == from).cloned().collect();
        for key in &cursor_keys {
            let high_water = state.cursors.remove(key).expect("key was just listed");
            state.cursors.insert((to.to_string(), key.1.clone(), key.2.clone()), high_water);
        }
        state.retired.remove(to);
        state.retired.insert(from.to_string(), to.to_string());
        let projections = self.projection.borrow_mut().rename(from, to);
        self.state = state;
        Ok(RenameReport { inbox, receipts, cursors: cursor_keys.len() as u64, projections })
    }

    fn retire_consumer(&mut self, from: &str, to: &str, _now_ms: i64) -> Result<()> {
        validate_rename(from, to)?;
        if self.state.uses(from) {
            return Err(Error::invalid(
                codes::INVALID_STATE_CHANGE,
                format!("consumer {from:?} has state in this database; rename it, which carries the state over"),
            ));
        }
        if self.state.uses(to) {
            return Err(Error::invalid(
                codes::ALREADY_EXISTS,
                format!("consumer {to:?} already has state; pick an unused id"),
            ));
        }
        if let Some(other) = self.state.retired.get(from).filter(|other| other.as_str() != to) {
            return Err(Error::invalid(
                codes::INVALID_STATE_CHANGE,
                format!("consumer {from:?} was already renamed to {other:?}; finish that rename instead"),
            ));
        }
        self.state.retired.remove(to);
        self.state.retired.insert(from.to_string(), to.to_string());
        Ok(())
    }

    fn cursors(&self, consumer_id: Option<&str>) -> Result<Vec<FlowCursor>> {
        if let Some(id) = consumer_id {
            validate_id("consumer_id", id)?;
        }
        Ok(self
            .state
            .cursors
            .iter()
            .filter(|(k, _)| consumer_id.is_none_or(|id| k.0 == id))
            .take(PAGE_SIZE_MAX)
            .map(|((consumer_id, source, flow_id), high_water_seq)| FlowCursor {
                consumer_id: consumer_id.clone(),
                source: source.clone(),
                flow_id: flow_id.clone(),
                high_water_seq: *high_water_seq,
            })
            .collect())
    }

    fn snapshot(&self, rows_max: usize) -> Result<ConsumerSnapshot> {
        Ok(ConsumerSnapshot {
            horizon_ms: self.retention.horizon_ms,
            inbox: self.state.inbox.iter().take(rows_max).map(|(k, row)| inbox_entry(k, row)).collect(),
            receipts: self
                .state
                .receipts
                .iter()
                .take(rows_max)
                .map(|((consumer_id, source, flow_id, seq), receipt)| Receipt {
                    consumer_id: consumer_id.clone(),
                    event_id: receipt.event_id.clone(),
                    source: source.clone(),
                    flow_id: flow_id.clone(),
                    seq: *seq,
                    content_hash: receipt.content_hash.clone(),
                    created_at_ms: receipt.created_at_ms,
                    generation: Some(receipt.generation.clone()),
                })
                .collect(),
            cursors: self
                .state
                .cursors
                .iter()
                .take(rows_max)
                .map(|((consumer_id, source, flow_id), high_water_seq)| FlowCursor {
                    consumer_id: consumer_id.clone(),
                    source: source.clone(),
                    flow_id: flow_id.clone(),
                    high_water_seq: *high_water_seq,
                })
                .collect(),
        })
    }
}

// ------------------------------------------------------------------------------------------
// Endpoints
// ------------------------------------------------------------------------------------------

/// Model consumers by endpoint string. An unknown endpoint fails like a missing file does.
#[derive(Debug, Clone, Default)]
pub struct ModelEndpoints {
    stores: BTreeMap<String, ModelConsumer>,
}

impl ModelEndpoints {
    /// No consumer at any endpoint yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Put `consumer` at `endpoint`, replacing any consumer there.
    pub fn insert(&mut self, endpoint: &str, consumer: ModelConsumer) {
        self.stores.insert(endpoint.to_string(), consumer);
    }

    /// The consumer at `endpoint`, if one was inserted.
    pub fn get(&self, endpoint: &str) -> Option<&ModelConsumer> {
        self.stores.get(endpoint)
    }

    /// The consumer at `endpoint`, for changes, if one was inserted.
    pub fn get_mut(&mut self, endpoint: &str) -> Option<&mut ModelConsumer> {
        self.stores.get_mut(endpoint)
    }
}

impl Endpoints for ModelEndpoints {
    fn deliver(&mut self, endpoint: &str, items: &[(&str, &Envelope)], now_ms: i64) -> Result<Vec<ReceiveOutcome>> {
        let store = self.stores.get_mut(endpoint).ok_or_else(|| {
            Error::invalid(codes::NOT_INITIALIZED, format!("{endpoint} does not exist; run `tidemark init` first"))
        })?;
        store.receive_batch(items, now_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reservation::ReservationMachine;
    use serde_json::json;

    fn advance(producer: &mut ModelProducer, flow: &str, expected_seq: i64, to: &str, now_ms: i64) -> AdvanceOutcome {
        let input = if to == "reserved" { json!({"quantity": 2}) } else { json!({}) };
        let request = AdvanceRequest {
            flow_id: flow.into(),
            expected_seq,
            to_state: to.into(),
            input,
            schema_version: 1,
            traceparent: None,
        };
        producer.advance_batch(&ReservationMachine, &[request], now_ms).unwrap().remove(0)
    }

    fn words(outcomes: &[ReceiveOutcome]) -> Vec<&'static str> {
        outcomes.iter().map(ReceiveOutcome::word).collect()
    }

    #[test]
    fn out_of_order_arrival_gaps_then_applies_in_order_exactly_once() {
        let mut producer = ModelProducer::new("shop", "g1").unwrap();
        for (seq, to) in ["reserved", "confirmed", "released"].into_iter().enumerate() {
            assert_eq!(advance(&mut producer, "r1", seq as i64, to, 10).word(), "committed");
        }
        let events = producer.snapshot(10).unwrap().outbox;
        let mut consumer = ModelConsumer::new(RetentionPolicy { horizon_ms: 1_000 }).unwrap();
        let mut handler = ModelReservationHandler::new(false);
        assert_eq!(words(&consumer.receive_batch(&[("c", &events[2])], 20).unwrap()), ["accepted"]);
        let report = consumer.drain("c", &DrainScope::All, 10, &mut handler, 20).unwrap();
        assert_eq!((report.outcome, report.applied), (DrainStop::Gap, 0));
        let batch: Vec<(&str, &Envelope)> = events.iter().map(|e| ("c", e)).collect();
        assert_eq!(words(&consumer.receive_batch(&batch, 21).unwrap()), ["accepted", "accepted", "duplicate"]);
        let report = consumer.drain("c", &DrainScope::All, 10, &mut handler, 22).unwrap();
        assert_eq!((report.outcome, report.applied), (DrainStop::Idle, 3));
        let seqs: Vec<i64> = consumer.projection().effects.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, [1, 2, 3]);
        // Pruned into receipts: a copy is still a duplicate, a tampered copy a conflict.
        assert_eq!(consumer.prune(0, 100, 30).unwrap().compacted, 3);
        let mut tampered = events[0].clone();
        tampered.payload = json!({"amount": 3});
        let outcomes = consumer.receive_batch(&[("c", &events[0]), ("c", &tampered)], 31).unwrap();
        assert_eq!(words(&outcomes), ["duplicate", "conflict"]);
        // Past the horizon the receipts go; the high-water mark stays, so a fresh copy conflicts.
        assert_eq!(consumer.prune(0, 100, 2_000).unwrap().receipts_deleted, 3);
        assert_eq!(words(&consumer.receive_batch(&[("c", &events[0])], 2_000).unwrap()), ["expired"]);
        let mut fresh = events[0].clone();
        fresh.created_at_ms = 2_000;
        assert_eq!(words(&consumer.receive_batch(&[("c", &fresh)], 2_000).unwrap()), ["conflict"]);
    }

    #[test]
    fn a_failed_handler_rolls_the_whole_drain_back() {
        struct FailSecond(ModelReservationHandler, u32);
        impl Handler<RefCell<ModelProjection>> for FailSecond {
            fn handle(
                &mut self,
                target: &RefCell<ModelProjection>,
                consumer_id: &str,
                event: &Envelope,
            ) -> std::result::Result<(), HandleError> {
                self.1 += 1;
                if self.1 == 2 {
                    return Err(HandleError::Failed(Error::store("boom")));
                }
                self.0.handle(target, consumer_id, event)
            }
        }
        let mut producer = ModelProducer::new("shop", "g1").unwrap();
        advance(&mut producer, "r1", 0, "reserved", 1);
        advance(&mut producer, "r2", 0, "reserved", 1);
        let events = producer.snapshot(10).unwrap().outbox;
        let mut consumer = ModelConsumer::new(RetentionPolicy::default()).unwrap();
        consumer.receive_batch(&[("c", &events[0]), ("c", &events[1])], 2).unwrap();
        let before = consumer.snapshot(100).unwrap();
        let mut handler = FailSecond(ModelReservationHandler::new(false), 0);
        assert!(consumer.drain("c", &DrainScope::All, 10, &mut handler, 3).is_err());
        assert_eq!(consumer.snapshot(100).unwrap(), before);
        assert!(consumer.projection().effects.is_empty());
    }

    #[test]
    fn events_keep_the_generation_they_were_committed_under() {
        let mut producer = ModelProducer::new("shop", "g1").unwrap();
        advance(&mut producer, "r1", 0, "reserved", 1);
        let backup = producer.clone();
        assert_eq!(producer.rotate_generation("g2").unwrap().generation, "g2");
        advance(&mut producer, "r1", 1, "confirmed", 2);
        let outbox = producer.snapshot(10).unwrap().outbox;
        let generations: Vec<&str> = outbox.iter().map(|e| e.generation.as_str()).collect();
        assert_eq!(generations, ["g1", "g2"], "an old event is redelivered unchanged after a rotation");
        // A restored copy that re-issues (r1, 2) under another generation gets another event id.
        let mut restored = backup;
        restored.rotate_generation("g3").unwrap();
        assert_eq!(advance(&mut restored, "r1", 1, "confirmed", 3).word(), "committed");
        let reissued = restored.snapshot(10).unwrap().outbox.remove(1);
        assert_eq!((reissued.seq, reissued.generation.as_str()), (2, "g3"));
        assert_ne!(reissued.event_id, outbox[1].event_id);
        assert_eq!(restored.rotate_generation("bad id!").unwrap_err().code(), codes::INVALID_ID);
    }

    #[test]
    fn rename_retires_the_old_id() {
        let mut producer = ModelProducer::new("shop", "g1").unwrap();
        advance(&mut producer, "r1", 0, "reserved", 1);
        let event = producer.snapshot(10).unwrap().outbox.remove(0);
        let mut consumer = ModelConsumer::new(RetentionPolicy::default()).unwrap();
        consumer.receive_batch(&[("a", &event)], 2).unwrap();
        let report = consumer.rename_consumer("a", "b", 1).unwrap();
        assert_eq!((report.inbox, report.receipts, report.cursors), (1, 0, 0));
        assert_eq!(
            words(&consumer.receive_batch(&[("a", &event), ("b", &event)], 3).unwrap()),
            ["conflict", "duplicate"]
        );
        assert_eq!(consumer.rename_consumer("a", "c", 1).unwrap_err().code(), codes::NOT_FOUND);
    }
}
