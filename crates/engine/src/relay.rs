//! The relay: hands pending outbox events to every subscribed consumer, in batches.
//!
//! One relay pass = one candidate read, one consumer transaction per endpoint, one producer
//! transaction recording every verdict (group commit). A delivery is marked accepted only after
//! its consumer answered `accepted` or `duplicate`; a `conflict` or `expired` answer, or an
//! unreachable consumer, is retried with exponential backoff and jitter and, after
//! `max_attempts`, quarantined for an operator. Never acked.

use std::collections::{BTreeMap, HashSet};

use serde::Serialize;
use tidemark_core::crash;
use tidemark_core::id::validate_limit;
use tidemark_core::limits::RELAY_BATCH_EVENTS_MAX;
use tidemark_core::policy::RelayPolicy;
use tidemark_core::store::{
    Delivery, DeliveryResult, DeliveryVerdict, DueQuery, Endpoints, ProducerStore, ReceiveOutcome,
};
use tidemark_core::{Envelope, Result};

/// Candidates read per relay pass, as a multiple of the batch limit: the window in which
/// round-robin across flows happens.
const RELAY_CANDIDATE_WINDOW_FACTOR: usize = 4;

/// What one relay pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RelayReport {
    /// Deliveries attempted in this pass.
    pub attempted: u64,
    /// Deliveries the consumer answered `accepted`: new events now stored in its inbox.
    pub accepted: u64,
    /// Deliveries the consumer answered `duplicate`: it already held the event (a redelivery after
    /// a crash, or `outbox redeliver`); marked accepted, applied only once.
    pub duplicate: u64,
    /// Deliveries the consumer answered `conflict` (same identity, other content): never acked,
    /// retried with backoff and eventually quarantined.
    pub conflict: u64,
    /// Deliveries the consumer answered `expired` (older than its retention horizon): never acked,
    /// retried with backoff and eventually quarantined.
    pub expired: u64,
    /// The consumer could not be reached or failed; retried later.
    pub failed: u64,
    /// Deliveries that reached `max_attempts` in this pass.
    pub quarantined: u64,
    /// Per-delivery answers, in delivery order (only kept when asked for).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub answers: Vec<RelayAnswer>,
}

impl RelayReport {
    /// Add another pass's counts (and answers) to this one.
    pub fn absorb(&mut self, other: RelayReport) {
        self.attempted += other.attempted;
        self.accepted += other.accepted;
        self.duplicate += other.duplicate;
        self.conflict += other.conflict;
        self.expired += other.expired;
        self.failed += other.failed;
        self.quarantined += other.quarantined;
        self.answers.extend(other.answers);
    }
}

/// One delivery's answer in a relay pass, kept when [`RelayOptions::keep_answers`] is set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RelayAnswer {
    /// The event delivered.
    pub event_id: String,
    /// The event's flow.
    pub flow_id: String,
    /// The event's seq in its flow.
    pub seq: i64,
    /// The subscriber it was delivered to.
    pub consumer_id: String,
    /// The consumer's protocol word (`accepted`, `duplicate`, `conflict`, `expired`) or `failed`.
    pub answer: String,
    /// The consumer's conflict reason, or the endpoint's error, when there is one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// `retry` or `quarantined` when the delivery was not accepted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verdict: Option<String>,
}

/// Options of one relay pass. Configuration is a struct, not a row of arguments.
#[derive(Debug, Clone)]
pub struct RelayOptions {
    /// Deliveries to attempt in this pass, at most (1..=10,000, else `limit_exceeded`); the
    /// candidates read are four times as many, to pick from round-robin across flows.
    pub limit: usize,
    /// Deliver only this event (its pending or quarantined deliveries), due or not.
    pub event_id: Option<String>,
    /// How failed deliveries back off and when they are quarantined.
    pub policy: RelayPolicy,
    /// Keep each delivery's answer in [`RelayReport::answers`] (for the CLI's `--verbose` output
    /// and tests); off, only the counts are kept.
    pub keep_answers: bool,
    /// Deliver only to these subscribers (`None`: to every subscriber). A relay lane of one
    /// endpoint names that endpoint's subscribers.
    pub consumers: Option<Vec<String>>,
}

impl Default for RelayOptions {
    fn default() -> Self {
        RelayOptions {
            limit: 1_000,
            event_id: None,
            policy: RelayPolicy::default(),
            keep_answers: false,
            consumers: None,
        }
    }
}

/// Pick up to `limit` deliveries round-robin across flows, keeping each flow's own order
/// ([`tidemark_core::store::round_robin`] by source and flow).
pub fn round_robin(candidates: Vec<Delivery>, limit: usize) -> Vec<Delivery> {
    tidemark_core::store::round_robin(candidates, limit, Delivery::flow)
}

/// The first step of a relay pass: the due deliveries (to `options.consumers` when given), picked
/// round-robin across flows, at most `options.limit`. A lane of an asynchronous relay calls this
/// on the producer, delivers the batch with [`group_by_endpoint`], and records [`judge`]'s
/// verdicts; [`relay_once`] does all three in one call.
pub fn plan<P: ProducerStore>(producer: &mut P, options: &RelayOptions, now_ms: i64) -> Result<Vec<Delivery>> {
    plan_ahead(producer, options, now_ms, &[])
}

/// [`plan`] while the deliveries `in_flight` (position, consumer id) are being handed over, their
/// verdicts not recorded yet: the next batch, without them (the candidate window is widened by
/// their number, so it still holds as many others, up to what a store reads at most). A relay
/// lane reads its next batch this way during a hand-over, and hands it over only if every
/// delivery in flight reached custody.
pub fn plan_ahead<P: ProducerStore>(
    producer: &mut P,
    options: &RelayOptions,
    now_ms: i64,
    in_flight: &[(i64, String)],
) -> Result<Vec<Delivery>> {
    validate_limit("relay limit", options.limit, RELAY_BATCH_EVENTS_MAX)?;
    options.policy.validate()?;
    if let Some(event_id) = options.event_id.as_deref() {
        let mut candidates =
            producer.due_deliveries(now_ms, options.limit, Some(event_id), options.consumers.as_deref())?;
        tidemark_core::store::leave_out(&mut candidates, in_flight, |d| (d.position, d.consumer_id.as_str()));
        return Ok(round_robin(candidates, options.limit));
    }
    // (Widened by what is in flight, capped at what a store reads at most: four batches of the
    // largest size.)
    let window = (options.limit * RELAY_CANDIDATE_WINDOW_FACTOR + in_flight.len())
        .min(RELAY_BATCH_EVENTS_MAX * RELAY_CANDIDATE_WINDOW_FACTOR);
    producer.pick_due(&DueQuery {
        now_ms,
        window,
        pick: options.limit,
        consumers: options.consumers.as_deref(),
        in_flight,
    })
}

/// `batch` in outbox order (a plan picks its candidates round-robin across flows, which
/// interleaves them), without the deliveries that would overtake
/// an earlier event of their flow (`overtaking`, from [`ProducerStore::overtaking`]) and without
/// every later delivery of the same flow to the same subscriber after one held back: what a lane
/// to a broker hands over, so that each flow reaches it in seq order (docs/protocol.md, "Order
/// in a broker").
pub fn in_flow_order(mut batch: Vec<Delivery>, overtaking: &[(i64, String)]) -> Vec<Delivery> {
    batch.sort_by(|a, b| (a.position, &a.consumer_id).cmp(&(b.position, &b.consumer_id)));
    if overtaking.is_empty() {
        return batch;
    }
    let overtaking: HashSet<(i64, &str)> = overtaking.iter().map(|(p, c)| (*p, c.as_str())).collect();
    let mut held: HashSet<(String, String, String)> = HashSet::new();
    let mut kept = Vec::with_capacity(batch.len());
    for delivery in batch {
        let key = (delivery.consumer_id.clone(), delivery.envelope.source.clone(), delivery.envelope.flow_id.clone());
        if held.contains(&key) || overtaking.contains(&(delivery.position, delivery.consumer_id.as_str())) {
            held.insert(key);
        } else {
            kept.push(delivery);
        }
    }
    kept
}

/// The indexes of `batch`'s deliveries by endpoint, each list in delivery order: one hand-over
/// (one consumer transaction, one request, one publish batch) per endpoint.
pub fn group_by_endpoint(batch: &[Delivery]) -> BTreeMap<&str, Vec<usize>> {
    let mut by_endpoint: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (index, delivery) in batch.iter().enumerate() {
        by_endpoint.entry(delivery.endpoint.as_str()).or_default().push(index);
    }
    by_endpoint
}

/// One endpoint's answer to its part of a batch: one outcome per delivery, or an error (the
/// endpoint's reason) that fails every one of them.
pub type EndpointAnswer = std::result::Result<ReceiveOutcome, String>;

/// One endpoint's hand-over of `count` deliveries turned into one answer per delivery: its
/// outcomes when it gave exactly one per delivery, otherwise the reason (a wrong count, or the
/// endpoint's error) for every one of them. `endpoint` is named in the reasons as given (callers
/// pass it masked where it could carry a secret).
pub fn answers_of(endpoint: &str, count: usize, delivered: Result<Vec<ReceiveOutcome>>) -> Vec<EndpointAnswer> {
    let reason = match delivered {
        Ok(outcomes) if outcomes.len() == count => return outcomes.into_iter().map(Ok).collect(),
        Ok(outcomes) => format!("consumer endpoint {endpoint} answered {} outcomes for {count} events", outcomes.len()),
        Err(error) => format!("consumer endpoint {endpoint} failed: {error}"),
    };
    vec![Err(reason); count]
}

/// The last step of a relay pass: turn each delivery's answer into its verdict (accepted; a
/// retry with backoff and jitter; quarantined after `max_attempts`) and count them.
/// `unit_random` yields uniform numbers in [0, 1) for the jitter. Record the results with
/// [`ProducerStore::record_deliveries`].
pub fn judge(
    batch: &[Delivery],
    answers: Vec<EndpointAnswer>,
    options: &RelayOptions,
    now_ms: i64,
    unit_random: &mut dyn FnMut() -> f64,
) -> (Vec<DeliveryResult>, RelayReport) {
    let mut report = RelayReport::default();
    let mut results = Vec::with_capacity(batch.len());
    for (delivery, answer) in batch.iter().zip(answers) {
        report.attempted += 1;
        let (word, reason) = match &answer {
            Ok(outcome) => {
                match outcome {
                    ReceiveOutcome::Accepted { .. } => report.accepted += 1,
                    ReceiveOutcome::Duplicate { .. } => report.duplicate += 1,
                    ReceiveOutcome::Conflict { .. } => report.conflict += 1,
                    ReceiveOutcome::Expired { .. } => report.expired += 1,
                }
                let reason = match outcome {
                    ReceiveOutcome::Conflict { reason, .. } => Some(format!("conflict: {reason}")),
                    ReceiveOutcome::Expired { horizon_ms, .. } => {
                        Some(format!("expired: older than the consumer's horizon of {horizon_ms} ms"))
                    }
                    _ => None,
                };
                (outcome.word().to_string(), reason)
            }
            Err(message) => {
                report.failed += 1;
                ("failed".to_string(), Some(message.clone()))
            }
        };
        let verdict = match reason {
            None => DeliveryVerdict::Accepted,
            Some(reason) => {
                let failed_attempts = delivery.attempts + 1;
                if failed_attempts >= options.policy.max_attempts {
                    report.quarantined += 1;
                    DeliveryVerdict::Quarantine { reason: format!("{reason} (after {failed_attempts} attempts)") }
                } else {
                    let delay = options.policy.backoff_ms(failed_attempts, unit_random());
                    DeliveryVerdict::Retry { reason, next_attempt_at_ms: now_ms.saturating_add(delay) }
                }
            }
        };
        if options.keep_answers {
            let (reason, verdict_word) = match &verdict {
                DeliveryVerdict::Accepted => (None, None),
                DeliveryVerdict::Retry { reason, .. } => (Some(reason.clone()), Some("retry".to_string())),
                DeliveryVerdict::Quarantine { reason } => (Some(reason.clone()), Some("quarantined".to_string())),
            };
            report.answers.push(RelayAnswer {
                event_id: delivery.envelope.event_id.clone(),
                flow_id: delivery.envelope.flow_id.clone(),
                seq: delivery.envelope.seq,
                consumer_id: delivery.consumer_id.clone(),
                answer: word,
                reason,
                verdict: verdict_word,
            });
        }
        results.push(DeliveryResult {
            position: delivery.position,
            event_id: delivery.envelope.event_id.clone(),
            consumer_id: delivery.consumer_id.clone(),
            verdict,
        });
    }
    (results, report)
}

/// Run one relay pass: [`plan`], one hand-over per endpoint ([`Endpoints::deliver`], one after
/// the other), [`judge`], and one producer transaction recording every verdict (group commit).
/// `unit_random` yields uniform numbers in [0, 1) for backoff jitter.
pub fn relay_once<P: ProducerStore, E: Endpoints>(
    producer: &mut P,
    endpoints: &mut E,
    options: &RelayOptions,
    now_ms: i64,
    unit_random: &mut dyn FnMut() -> f64,
) -> Result<RelayReport> {
    let batch = plan(producer, options, now_ms)?;
    if batch.is_empty() {
        return Ok(RelayReport::default());
    }
    let mut answers: Vec<Option<EndpointAnswer>> = vec![None; batch.len()];
    for (endpoint, indexes) in group_by_endpoint(&batch) {
        let items: Vec<(&str, &Envelope)> =
            indexes.iter().map(|&i| (batch[i].consumer_id.as_str(), &batch[i].envelope)).collect();
        let delivered = answers_of(endpoint, indexes.len(), endpoints.deliver(endpoint, &items, now_ms));
        for (&i, answer) in indexes.iter().zip(delivered) {
            answers[i] = Some(answer);
        }
    }
    crash::hit("relay.after_consumer_commit");
    let answers = answers.into_iter().map(|a| a.expect("every delivery got an answer")).collect();
    let (results, report) = judge(&batch, answers, options, now_ms, unit_random);
    producer.record_deliveries(&results, now_ms)?;
    Ok(report)
}

/// Run relay passes until one attempts nothing, at most `passes_max` of them (bounded).
/// `now_ms` is read before each pass. Returns the summed report and the passes run.
pub fn relay_until_idle<P: ProducerStore, E: Endpoints>(
    producer: &mut P,
    endpoints: &mut E,
    options: &RelayOptions,
    passes_max: u32,
    now_ms: &mut dyn FnMut() -> i64,
    unit_random: &mut dyn FnMut() -> f64,
) -> Result<(RelayReport, u32)> {
    let mut total = RelayReport::default();
    let mut passes = 0;
    while passes < passes_max {
        passes += 1;
        let report = relay_once(producer, endpoints, options, now_ms(), unit_random)?;
        let done = report.attempted == 0;
        total.absorb(report);
        if done {
            break;
        }
    }
    Ok((total, passes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn delivery(flow: &str, seq: i64) -> Delivery {
        Delivery {
            position: seq,
            envelope: Envelope {
                event_id: format!("{flow}-{seq}"),
                source: "s".into(),
                generation: "g".into(),
                flow_id: flow.into(),
                seq,
                event_type: "t".into(),
                schema_version: 1,
                payload: json!({}),
                created_at_ms: 0,
                traceparent: None,
            },
            consumer_id: "c".into(),
            endpoint: "e".into(),
            attempts: 0,
        }
    }

    #[test]
    fn a_held_back_delivery_holds_back_the_rest_of_its_flow_and_only_that() {
        // Outbox positions 10 (a-2), 11 (b-1), 12 (a-3), 13 (b-2), 14 (c-4), picked out of order.
        let at = |position: i64, flow: &str, seq: i64| Delivery { position, ..delivery(flow, seq) };
        let batch = vec![at(12, "a", 3), at(11, "b", 1), at(10, "a", 2), at(13, "b", 2), at(14, "c", 4)];
        let ids = |kept: Vec<Delivery>| kept.into_iter().map(|d| d.envelope.event_id).collect::<Vec<_>>();
        assert_eq!(ids(in_flow_order(batch.clone(), &[])), ["a-2", "b-1", "a-3", "b-2", "c-4"]);
        // a-1 is open and not in the batch: a-2 would overtake it, and a-3 with it.
        let kept = in_flow_order(batch.clone(), &[(10, "c".to_string())]);
        assert_eq!(ids(kept), ["b-1", "b-2", "c-4"]);
        // Another subscriber's delivery at the same position holds nothing back here.
        assert_eq!(in_flow_order(batch.clone(), &[(10, "other".to_string())]).len(), 5);
        assert_eq!(in_flow_order(batch, &[]).len(), 5);
    }

    #[test]
    fn round_robin_interleaves_flows_and_keeps_each_flows_order() {
        let candidates = vec![delivery("a", 1), delivery("a", 2), delivery("a", 3), delivery("b", 1), delivery("c", 1)];
        let picked: Vec<String> = round_robin(candidates, 4).into_iter().map(|d| d.envelope.event_id).collect();
        assert_eq!(picked, ["a-1", "b-1", "c-1", "a-2"]);
    }
}
