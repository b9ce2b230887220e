//! The drain's walk, one algorithm for every store: which open inbox records are applied, in what
//! order, under which savepoints, and what a drain reports. A store supplies its apply transaction
//! as a [`DrainTransaction`] (its page read and its writes); [`walk`] decides.
//!
//! A drain reads the consumer's open records in (source, flow, seq) order, page by page. A record
//! is applicable when its seq is exactly one above its flow's high-water mark (counting the
//! records of the flow this drain already took); a higher seq is a `gap` and the walk jumps past
//! the rest of that flow. Applicable records go to the handler:
//! - one at a time through [`Handler::handle`] (the default, `batch_max` 1), each under a savepoint
//!   unless the handler [refuses before writing](Handler::refuses_before_writing);
//! - or, for a handler whose [`Handler::batch_max`] is above 1, up to that many at once through
//!   [`Handler::handle_batch`] under one savepoint. The batch is all or nothing: when the handler
//!   refuses it, its writes roll back and the same events are applied one at a time through
//!   `handle`, so that only the refusing flow stops (its later events in the batch stay pending)
//!   and every other event of the batch is applied, exactly as the one-at-a-time drain would.
//!
//! The applied marks and cursor moves are handed to the store as they are decided; a store may
//! defer them to the end of the transaction (PostgreSQL writes them in one statement).

use crate::store::{ApplyOutcome, DrainReport, DrainScope, DrainStop, HandleError, Handler};
use crate::{crash, ensure_invariant, Envelope, Result};

/// Rows read per page while scanning open inbox records.
pub const DRAIN_PAGE_ROWS: usize = 1_024;
/// Rows a drain may look at beyond its apply limit (gapped or blocked flows' waiting rows).
pub const DRAIN_SCAN_ROWS_EXTRA: usize = 4_096;
/// Stuck flows reported by one drain.
pub const DRAIN_STUCK_REPORTED_MAX: usize = 100;

/// One open (pending or blocked) inbox record, as a drain's page read returns it.
#[derive(Debug, Clone)]
pub struct OpenRecord {
    /// The store's row id of the record.
    pub record: i64,
    /// Its flow's high-water mark when the page was read (0: no cursor row yet).
    pub high_water_seq: i64,
    /// The event.
    pub envelope: Envelope,
}

/// A position in the consumer's open records: (source, flow, seq), exclusive.
pub type DrainPosition = (String, String, i64);

/// A store's apply transaction, as the drain walk uses it. Every call runs inside the one
/// transaction the store opened for the drain.
pub trait DrainTransaction {
    /// The handle handlers are given.
    type Target: ?Sized;
    /// The handle handlers are given.
    fn target(&self) -> &Self::Target;
    /// The open records after `after` in (source, flow, seq) order (for a flow scope, that flow's
    /// records with a seq above `after.2`), at most [`DRAIN_PAGE_ROWS`], each with its flow's
    /// high-water mark.
    fn page(&mut self, after: &DrainPosition) -> Result<Vec<OpenRecord>>;
    /// Begin the savepoint that a refused event's (or batch's) writes roll back to. Savepoints
    /// never nest.
    fn savepoint(&mut self) -> Result<()>;
    /// Keep the writes made since [`DrainTransaction::savepoint`] and end it.
    fn release_savepoint(&mut self) -> Result<()>;
    /// Undo the writes made since [`DrainTransaction::savepoint`] and end it.
    fn roll_back_to_savepoint(&mut self) -> Result<()>;
    /// Mark `record` applied.
    fn mark_applied(&mut self, record: i64) -> Result<()>;
    /// Mark `record` blocked with `reason` (nothing to write when it is already blocked for it).
    fn mark_blocked(&mut self, record: i64, reason: &str) -> Result<()>;
    /// Move a flow's high-water mark from `start_high_water` (0: no cursor row yet) to
    /// `high_water`.
    fn move_cursor(&mut self, source: &str, flow_id: &str, start_high_water: i64, high_water: i64) -> Result<()>;
}

/// The walk of one flow during a drain.
struct FlowWalk {
    source: String,
    flow_id: String,
    start_high_water: i64,
    /// The seq the flow's next applicable record must have.
    next_seq: i64,
    /// A record of this flow was refused: the rest of the flow waits.
    blocked: bool,
}

/// The drain's state between pages.
struct Walk<'h, X: DrainTransaction> {
    handler: &'h mut dyn Handler<X::Target>,
    consumer_id: &'h str,
    /// Savepoint per event in the one-at-a-time path.
    savepoints: bool,
    batch_max: usize,
    /// The flows walked since the last settle (the last one is the current flow).
    flows: Vec<FlowWalk>,
    /// Records taken and not yet handed to the handler, with their flow's index in `flows`.
    batch_records: Vec<(i64, usize)>,
    batch_events: Vec<Envelope>,
    applied: u64,
    stuck: Vec<ApplyOutcome>,
    last_applied: Option<ApplyOutcome>,
}

/// Apply up to `limit` events of `consumer_id` (the body of `ConsumerStore::drain`, inside the
/// store's transaction `tx`). See the module documentation for the rules.
pub fn walk<X: DrainTransaction>(
    tx: &mut X,
    consumer_id: &str,
    scope: &DrainScope,
    limit: usize,
    handler: &mut dyn Handler<X::Target>,
) -> Result<DrainReport> {
    let batch_max = handler.batch_max().clamp(1, limit.max(1));
    let mut walk = Walk::<X> {
        savepoints: !handler.refuses_before_writing(),
        handler,
        consumer_id,
        batch_max,
        flows: Vec::new(),
        batch_records: Vec::with_capacity(batch_max),
        batch_events: Vec::with_capacity(batch_max),
        applied: 0,
        stuck: Vec::new(),
        last_applied: None,
    };
    let mut after: DrainPosition = match scope {
        DrainScope::All => (String::new(), String::new(), 0),
        DrainScope::Flow { source, flow_id } => (source.clone(), flow_id.clone(), 0),
    };
    // Bounded: every row read counts, and a stuck flow costs one row (the scan then jumps past
    // the rest of that flow).
    let scan_rows_max = limit + DRAIN_SCAN_ROWS_EXTRA;
    let mut scanned = 0_usize;
    let mut taken = 0_usize;
    let mut hit_limit = false;
    'pages: loop {
        let page = tx.page(&after)?;
        let page_len = page.len();
        for OpenRecord { record, high_water_seq, envelope: event } in page {
            if scanned == scan_rows_max {
                hit_limit = true;
                break 'pages;
            }
            scanned += 1;
            after = (event.source.clone(), event.flow_id.clone(), event.seq);
            let same_flow = walk.flows.last().is_some_and(|w| w.source == event.source && w.flow_id == event.flow_id);
            if !same_flow {
                if walk.batch_records.is_empty() {
                    walk.settle(tx, false)?;
                }
                walk.flows.push(FlowWalk {
                    source: event.source.clone(),
                    flow_id: event.flow_id.clone(),
                    start_high_water: high_water_seq,
                    next_seq: high_water_seq + 1,
                    blocked: false,
                });
            }
            let current = walk.flows.last().expect("a flow was just pushed");
            ensure_invariant!(
                event.seq >= current.next_seq,
                "open inbox record {}/{}/{} is at or below the high-water mark {}",
                event.source,
                event.flow_id,
                event.seq,
                current.next_seq - 1
            );
            if event.seq > current.next_seq {
                // The records taken before it decide whether this flow is blocked or waits for
                // a missing seq.
                walk.flush(tx)?;
                taken = walk.applied as usize;
                let current = walk.flows.last().expect("flushing keeps the current flow");
                if !current.blocked {
                    walk.report(ApplyOutcome::Gap {
                        source: event.source.clone(),
                        flow_id: event.flow_id.clone(),
                        missing_seq: current.next_seq,
                    });
                }
                after.2 = i64::MAX;
                continue 'pages;
            }
            let flow = walk.flows.len() - 1;
            walk.flows[flow].next_seq += 1;
            walk.batch_records.push((record, flow));
            walk.batch_events.push(event);
            taken += 1;
            if walk.batch_records.len() == walk.batch_max || taken == limit {
                walk.flush(tx)?;
                // Records a refusal kept pending do not count against the limit.
                taken = walk.applied as usize;
                if taken == limit {
                    hit_limit = true;
                    break 'pages;
                }
                if walk.flows.last().expect("flushing keeps the current flow").blocked {
                    after.2 = i64::MAX;
                    continue 'pages;
                }
            }
        }
        if page_len < DRAIN_PAGE_ROWS {
            break;
        }
    }
    walk.flush(tx)?;
    walk.settle(tx, false)?;
    let outcome = if hit_limit {
        DrainStop::Limit
    } else {
        match walk.stuck.first() {
            None => DrainStop::Idle,
            Some(ApplyOutcome::Gap { .. }) => DrainStop::Gap,
            Some(_) => DrainStop::Blocked,
        }
    };
    Ok(DrainReport { outcome, applied: walk.applied, stuck: walk.stuck, last_applied: walk.last_applied })
}

impl<X: DrainTransaction> Walk<'_, X> {
    fn report(&mut self, outcome: ApplyOutcome) {
        if self.stuck.len() < DRAIN_STUCK_REPORTED_MAX {
            self.stuck.push(outcome);
        }
    }

    /// Move the cursors of the flows walked so far and forget them (the batch is empty), but for
    /// the current flow when `keep_current`.
    fn settle(&mut self, tx: &mut X, keep_current: bool) -> Result<()> {
        ensure_invariant!(self.batch_records.is_empty(), "flows settled with records still to apply");
        let current = if keep_current { self.flows.pop() } else { None };
        for flow in self.flows.drain(..) {
            let high_water = flow.next_seq - 1;
            if high_water > flow.start_high_water {
                tx.move_cursor(&flow.source, &flow.flow_id, flow.start_high_water, high_water)?;
            }
        }
        self.flows.extend(current);
        Ok(())
    }

    /// Hand the records taken to the handler: as one batch when the handler takes batches,
    /// else (or when it refuses the batch) one at a time.
    fn flush(&mut self, tx: &mut X) -> Result<()> {
        let records = std::mem::take(&mut self.batch_records);
        let events = std::mem::take(&mut self.batch_events);
        if records.is_empty() {
            return Ok(());
        }
        if self.batch_max > 1 && events.len() > 1 {
            tx.savepoint()?;
            match self.handler.handle_batch(tx.target(), self.consumer_id, &events) {
                Ok(()) => {
                    tx.release_savepoint()?;
                    for &(record, _) in &records {
                        self.applied_one(tx, record)?;
                    }
                    self.last_applied = events.last().map(applied_outcome);
                    return self.end_flush(tx, records, events);
                }
                Err(HandleError::Blocked(_)) => tx.roll_back_to_savepoint()?,
                Err(HandleError::Failed(error)) => return Err(error),
            }
        }
        for (&(record, flow), event) in records.iter().zip(&events) {
            // A flow refused earlier in this batch keeps its later records pending.
            if !self.flows[flow].blocked {
                self.apply_one(tx, record, flow, event)?;
            }
        }
        self.end_flush(tx, records, events)
    }

    /// Give the (emptied) buffers back, so that a drain allocates them once, and settle the
    /// flows before the current one.
    fn end_flush(&mut self, tx: &mut X, mut records: Vec<(i64, usize)>, mut events: Vec<Envelope>) -> Result<()> {
        records.clear();
        events.clear();
        self.batch_records = records;
        self.batch_events = events;
        self.settle(tx, true)
    }

    fn apply_one(&mut self, tx: &mut X, record: i64, flow: usize, event: &Envelope) -> Result<()> {
        if self.savepoints {
            tx.savepoint()?;
        }
        match self.handler.handle(tx.target(), self.consumer_id, event) {
            Ok(()) => {
                if self.savepoints {
                    tx.release_savepoint()?;
                }
                self.applied_one(tx, record)?;
                self.last_applied = Some(applied_outcome(event));
                Ok(())
            }
            Err(HandleError::Blocked(reason)) => {
                if self.savepoints {
                    tx.roll_back_to_savepoint()?;
                }
                tx.mark_blocked(record, &reason)?;
                let walk = &mut self.flows[flow];
                walk.blocked = true;
                walk.next_seq = event.seq;
                self.report(ApplyOutcome::Blocked {
                    source: event.source.clone(),
                    flow_id: event.flow_id.clone(),
                    seq: event.seq,
                    event_id: event.event_id.clone(),
                    reason,
                });
                Ok(())
            }
            Err(HandleError::Failed(error)) => Err(error),
        }
    }

    fn applied_one(&mut self, tx: &mut X, record: i64) -> Result<()> {
        tx.mark_applied(record)?;
        self.applied += 1;
        if self.applied == 1 {
            crash::hit("apply.after_handler");
        }
        Ok(())
    }
}

fn applied_outcome(event: &Envelope) -> ApplyOutcome {
    ApplyOutcome::Applied {
        source: event.source.clone(),
        flow_id: event.flow_id.clone(),
        seq: event.seq,
        event_id: event.event_id.clone(),
    }
}
