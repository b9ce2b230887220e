//! Relay lanes: one asynchronous delivery loop per network endpoint of each outbox, so that an
//! endpoint that is down, slow or black-holed never delays delivery to the others
//! (docs/protocol.md, "Endpoints").
//!
//! A lane repeats: read the due deliveries of its endpoint's subscribers on the outbox's thread
//! (the engine's `plan`, restricted to those subscribers, so another endpoint's backlog never fills
//! its window), hand them to the endpoint's transport with `relay.attempt_timeout_ms` (the
//! thread is free meanwhile), and record the verdicts on the outbox's thread (`judge`, then
//! `record_deliveries`: the same backoff, jitter and quarantine as the file relay). One batch is
//! in flight per lane at a time, back to back: while it is handed over, the outbox's thread
//! records the batch before it and reads the next (leaving the one in flight out), and the next
//! is handed over once every answer of this one is custody; after any other answer the lane
//! records first and reads afresh (see `Lane`). A lane to a broker also sorts its batch by
//! outbox position and holds back a flow whose earlier event is still open (`in_flow_order`),
//! so each flow reaches the broker in seq order, failures included (docs/protocol.md, "Order in
//! a broker"). A timeout or an error fails the batch's deliveries (retried; the remote answers
//! `duplicate` for what it stored).
//! File endpoints are delivered by the delivery loop on the outbox's thread, as before.
//!
//! The delivery loop starts a lane when it sees a network subscription without one; a lane ends
//! when its endpoint has no subscriber left or shutdown begins.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};
use tidemark_core::crash;
use tidemark_core::endpoint::{mask, Endpoint, EndpointKind};
use tidemark_core::store::{Delivery, DeliveryResult, DeliveryVerdict, ProducerStore, Subscription};
use tidemark_core::{Envelope, Result};
use tidemark_engine::{answers_of, in_flow_order, judge, plan_ahead, EndpointAnswer, RelayOptions, RelayReport};
use tidemark_transport::Transport;
use utoipa::ToSchema;

use crate::backend::Backend;
use crate::tenant::{ProducerThread, Tenant};
use crate::{now_ms, AppState};

/// What an operator sees of one lane (`GET /v1/subscriptions`).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct LaneStatus {
    /// The endpoint's kind.
    pub kind: EndpointKind,
    /// A batch is being delivered right now.
    pub in_flight: bool,
    /// Batches handed over since the lane started.
    pub batches: u64,
    /// Of them, batches read while the one before was in flight and handed over straight after
    /// it (every delivery of that one reached custody).
    pub read_ahead: u64,
    /// Deliveries the endpoint answered `accepted` or `duplicate`.
    pub delivered: u64,
    /// Deliveries that failed (an error, a timeout, a `conflict` or `expired` answer).
    pub failed: u64,
    /// The last batch's error, if it failed (cleared by the next batch that does not).
    pub last_error: Option<String>,
    /// When the last batch was handed over, in ms since the Unix epoch.
    pub last_attempt_at_ms: Option<i64>,
    /// How long the last batch took, in ms.
    pub last_batch_ms: Option<u64>,
}

/// The running lanes of one tenant, by (outbox index in [`Tenant::outboxes`], endpoint).
pub type Lanes = std::sync::Mutex<BTreeMap<(usize, String), LaneStatus>>;

/// The network subscriptions of an outbox, grouped by endpoint: what lanes push to (file
/// endpoints are the file relay's, pull consumers read the feed; an endpoint that no longer
/// parses is left to the file relay, which fails it with its reason).
pub fn network_endpoints(subscriptions: &[Subscription]) -> BTreeMap<String, EndpointKind> {
    subscriptions
        .iter()
        .filter_map(|s| match Endpoint::parse(&s.endpoint).map(|e| e.kind()) {
            Ok(EndpointKind::Sqlite | EndpointKind::Pull) | Err(_) => None,
            Ok(kind) => Some((s.endpoint.clone(), kind)),
        })
        .collect()
}

/// The subscribers the file relay delivers to: file endpoints (and unparseable ones, which it
/// fails with their reason).
pub fn file_subscribers(subscriptions: &[Subscription]) -> Vec<String> {
    subscriptions
        .iter()
        .filter(|s| matches!(Endpoint::parse(&s.endpoint).map(|e| e.kind()), Ok(EndpointKind::Sqlite) | Err(_)))
        .map(|s| s.consumer_id.clone())
        .collect()
}

/// Start a lane for each of `endpoints` of outbox `outbox` that has none.
pub fn ensure<B: Backend>(
    state: &AppState,
    tenant: &Arc<Tenant<B>>,
    outbox: usize,
    endpoints: BTreeMap<String, EndpointKind>,
) {
    if state.is_shutting_down() {
        return;
    }
    let mut lanes = tenant.lanes.lock().unwrap_or_else(|p| p.into_inner());
    for (endpoint, kind) in endpoints {
        let key = (outbox, endpoint.clone());
        if lanes.contains_key(&key) {
            continue;
        }
        lanes.insert(
            key,
            LaneStatus {
                kind,
                in_flight: false,
                batches: 0,
                read_ahead: 0,
                delivered: 0,
                failed: 0,
                last_error: None,
                last_attempt_at_ms: None,
                last_batch_ms: None,
            },
        );
        let handle = tokio::spawn(lane(state.clone(), tenant.clone(), outbox, endpoint.clone()));
        let name = format!("{}/lane/{outbox}/{}", tenant.id, mask(&endpoint));
        state.tasks.lock().unwrap_or_else(|p| p.into_inner()).push((name, handle));
    }
}

fn update<B: Backend>(tenant: &Tenant<B>, outbox: usize, endpoint: &str, f: impl FnOnce(&mut LaneStatus)) {
    let mut lanes = tenant.lanes.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(status) = lanes.get_mut(&(outbox, endpoint.to_string())) {
        f(status);
    }
}

/// The due deliveries of `endpoint`'s subscribers, or `None` when it has none left, without
/// those `in_flight` (handed over, their verdicts not recorded yet: [`plan_ahead`]). With
/// `flow_order` (a broker, which keeps arrival order), without the deliveries that would overtake
/// an earlier event of their flow still open (backing off after a failed attempt, or
/// quarantined; one in flight does not count, as the batch read is handed over only once those
/// reached custody): each flow reaches the broker in seq order.
fn read_batch<B: Backend>(
    p: &mut ProducerThread<B>,
    endpoint: &str,
    options: &mut RelayOptions,
    flow_order: bool,
    in_flight: &[(i64, String)],
) -> Result<Option<Vec<Delivery>>> {
    let consumers: Vec<String> =
        p.store.subscriptions()?.into_iter().filter(|s| s.endpoint == endpoint).map(|s| s.consumer_id).collect();
    if consumers.is_empty() {
        return Ok(None);
    }
    options.consumers = Some(consumers);
    let batch = plan_ahead(&mut p.store, options, (p.clock)(), in_flight)?;
    if !flow_order || batch.is_empty() {
        return Ok(Some(batch));
    }
    let overtaking = p.store.overtaking(&batch, in_flight)?;
    Ok(Some(in_flow_order(batch, &overtaking)))
}

/// Hand `batch` to the transport (connecting first when there is none yet), within `timeout`.
/// `masked` is the endpoint as reasons name it.
async fn hand_over(
    transport: &mut Option<Arc<dyn Transport>>,
    state: &AppState,
    (endpoint, masked): (&str, &str),
    batch: &[Delivery],
    timeout: Duration,
) -> Vec<EndpointAnswer> {
    if transport.is_none() {
        match tidemark_transport::connect(endpoint, &state.config.transport_config()) {
            Ok(connected) => *transport = Some(connected),
            Err(error) => return answers_of(masked, batch.len(), Err(error)),
        }
    }
    let connected = transport.as_ref().expect("connected above");
    let items: Vec<(String, Envelope)> = batch.iter().map(|d| (d.consumer_id.clone(), d.envelope.clone())).collect();
    let delivered = tokio::time::timeout(timeout, connected.deliver(&items))
        .await
        .unwrap_or_else(|_| Err(tidemark_core::Error::io(format!("no answer within {} ms", timeout.as_millis()))));
    answers_of(masked, batch.len(), delivered)
}

/// A batch handed over and judged, its verdicts to record.
struct Judged {
    results: Vec<DeliveryResult>,
    report: RelayReport,
    /// When the answers were judged (the verdicts' time).
    now: i64,
    /// When the hand-over began.
    started: Instant,
}

impl Judged {
    /// Every delivery reached the endpoint's custody (`accepted` or `duplicate`).
    fn all_custody(&self) -> bool {
        self.report.accepted + self.report.duplicate == self.report.attempted
    }
}

/// One relay lane: the loop of the module's documentation. While a batch is handed over, the
/// outbox's thread records the verdicts of the batch before it and reads the next one (leaving
/// the batch in flight out); the next batch is handed over as soon as this one's answers are in
/// if every one of them is custody, so a lane keeps one batch in flight, back to back, and the
/// outbox's reads and fsynced verdicts run beside the transport instead of between its batches.
/// After any other answer (or a read or record that failed) the lane records the batch's
/// verdicts first and reads afresh, so the next read sees the failures and holds their flows
/// back, as without read-ahead.
struct Lane<B: Backend> {
    state: AppState,
    tenant: Arc<Tenant<B>>,
    outbox: usize,
    endpoint: String,
    masked: String,
    kind: &'static str,
    options: RelayOptions,
    flow_order: bool,
    total: RelayReport,
    errors: u64,
}

impl<B: Backend> Lane<B> {
    fn update(&self, f: impl FnOnce(&mut LaneStatus)) {
        update(&self.tenant, self.outbox, &self.endpoint, f);
    }

    /// Read the next batch on the outbox's thread, after recording `verdicts` there (in the
    /// same call: the read sees them). The record's result comes back with the read's.
    async fn record_and_read(
        &self,
        verdicts: Option<Judged>,
        in_flight: Vec<(i64, String)>,
    ) -> (Option<(Judged, Result<()>)>, Result<Option<Vec<Delivery>>>) {
        let (endpoint, mut options, flow_order) = (self.endpoint.clone(), self.options.clone(), self.flow_order);
        let read = self.tenant.outboxes()[self.outbox]
            .call(move |p| {
                let recorded = verdicts.map(|judged| {
                    let recorded = p.store.record_deliveries(&judged.results, judged.now);
                    (judged, recorded)
                });
                let failed_record = recorded.as_ref().is_some_and(|(_, r)| r.is_err());
                // Not after a failed record: those deliveries are still pending, not in flight.
                let next = if failed_record {
                    Ok(Some(Vec::new()))
                } else {
                    read_batch(p, &endpoint, &mut options, flow_order, &in_flight)
                };
                Ok((recorded, next))
            })
            .await;
        read.unwrap_or_else(|error| (None, Err(error)))
    }

    /// Record `judged`'s verdicts on the outbox's thread and account for them.
    async fn record(&mut self, judged: Judged) {
        let recorded = self.tenant.outboxes()[self.outbox]
            .call(move |p| {
                let recorded = p.store.record_deliveries(&judged.results, judged.now);
                Ok((judged, recorded))
            })
            .await;
        match recorded {
            Ok((judged, recorded)) => self.finish(judged, recorded),
            // The outbox's thread is gone (shutdown): the deliveries stay pending.
            Err(error) => self.failed("recording the verdicts", &error),
        }
    }

    /// Metrics, the lane's status and logs for a batch whose verdicts were recorded (or not).
    fn finish(&mut self, judged: Judged, recorded: Result<()>) {
        let Judged { results, report, now, started } = judged;
        let last_error = results.iter().find_map(|r| match &r.verdict {
            DeliveryVerdict::Accepted => None,
            DeliveryVerdict::Retry { reason, .. } | DeliveryVerdict::Quarantine { reason } => Some(reason.clone()),
        });
        let (tenant, masked) = (&self.tenant.id, &self.masked);
        self.state.metrics.record_relay(tenant, &report);
        self.state.metrics.record_lane(tenant, self.kind, masked, &report, started.elapsed());
        let took_ms = started.elapsed().as_millis() as u64;
        self.update(|s| {
            s.batches += 1;
            s.delivered += report.accepted + report.duplicate;
            s.failed += report.attempted - report.accepted - report.duplicate;
            s.last_error.clone_from(&last_error);
            s.last_attempt_at_ms = Some(now);
            s.last_batch_ms = Some(took_ms);
        });
        if let Some(error) = &last_error {
            tracing::warn!(tenant = %tenant, endpoint = %masked, attempted = report.attempted,
                failed = report.failed, quarantined = report.quarantined, %error, "relay lane: deliveries not accepted");
        }
        if let Err(error) = recorded {
            self.errors += 1;
            tracing::error!(tenant = %tenant, endpoint = %masked, code = error.code(), %error,
                "relay lane: recording the verdicts failed (the deliveries stay pending and are sent again)");
        }
        self.total.absorb(report);
    }

    /// Count and log an error of the lane's own (`what` failed), not an endpoint's answer.
    fn failed(&mut self, what: &str, error: &tidemark_core::Error) {
        self.errors += 1;
        tracing::error!(tenant = %self.tenant.id, endpoint = %self.masked, code = error.code(), %error,
            "relay lane: {what} failed");
    }

    async fn run(mut self) -> Value {
        let timeout = Duration::from_millis(self.state.config.relay.attempt_timeout_ms);
        let mut transport: Option<Arc<dyn Transport>> = None;
        // The batch read ahead during the last hand-over, and that hand-over's verdicts (every
        // one custody), not recorded yet.
        let mut ahead: Option<Vec<Delivery>> = None;
        let mut unrecorded: Option<Judged> = None;
        tracing::debug!(tenant = %self.tenant.id, endpoint = %self.masked, "relay lane started");
        while !self.state.is_shutting_down() {
            let batch = match ahead.take() {
                Some(batch) => {
                    self.update(|s| s.read_ahead += 1);
                    batch
                }
                None => match self.record_and_read(None, Vec::new()).await.1 {
                    Ok(Some(batch)) => batch,
                    Ok(None) => break,
                    Err(error) => {
                        self.failed("reading the due deliveries", &error);
                        if !crate::background::pause(&self.state, self.state.config.relay.interval_ms).await {
                            break;
                        }
                        continue;
                    }
                },
            };
            if batch.is_empty() {
                // (Nothing is unrecorded here: a batch read ahead is never empty.)
                if !crate::background::pause(&self.state, self.state.config.relay.interval_ms).await {
                    break;
                }
                continue;
            }
            self.update(|s| s.in_flight = true);
            let started = Instant::now();
            let in_flight: Vec<(i64, String)> = batch.iter().map(|d| (d.position, d.consumer_id.clone())).collect();
            let (answers, (recorded, next)) = tokio::join!(
                hand_over(&mut transport, &self.state, (&self.endpoint, &self.masked), &batch, timeout),
                self.record_and_read(unrecorded.take(), in_flight),
            );
            self.update(|s| s.in_flight = false);
            crash::hit("relay.after_consumer_commit");
            let now = now_ms();
            let (results, report) = judge(&batch, answers, &self.options, now, &mut rand::random::<f64>);
            if report.failed == report.attempted {
                // Nothing got through: connect again next time (a restarted server, a new token).
                transport = None;
            }
            let judged = Judged { results, report, now, started };
            let mut previous_recorded = true;
            if let Some((previous, result)) = recorded {
                previous_recorded = result.is_ok();
                self.finish(previous, result);
            }
            match next {
                Ok(Some(next)) if judged.all_custody() && previous_recorded && !next.is_empty() => {
                    ahead = Some(next);
                    unrecorded = Some(judged);
                }
                next => {
                    // A failure (or nothing ahead): record first, read afresh after it.
                    if let Err(error) = &next {
                        self.failed("reading the due deliveries", error);
                    }
                    self.record(judged).await;
                    if matches!(next, Ok(None)) {
                        break;
                    }
                }
            }
        }
        if let Some(judged) = unrecorded.take() {
            self.record(judged).await;
        }
        self.tenant.lanes.lock().unwrap_or_else(|p| p.into_inner()).remove(&(self.outbox, self.endpoint.clone()));
        let total = &self.total;
        json!({"endpoint": self.masked, "attempted": total.attempted, "accepted": total.accepted,
            "duplicate": total.duplicate, "failed": total.failed, "quarantined": total.quarantined, "errors": self.errors})
    }
}

async fn lane<B: Backend>(state: AppState, tenant: Arc<Tenant<B>>, outbox: usize, endpoint: String) -> Value {
    let options = state.config.relay_options();
    let parsed = Endpoint::parse(&endpoint).map(|e| e.kind());
    let kind = parsed.as_ref().map(|k| k.as_str()).unwrap_or("unknown");
    // A broker keeps arrival order (a stream, a queue, a partition): each flow goes in seq order.
    let flow_order = parsed.is_ok_and(|k| k.is_broker());
    let masked = mask(&endpoint);
    let lane = Lane {
        state,
        tenant,
        outbox,
        endpoint,
        masked,
        kind,
        options,
        flow_order,
        total: RelayReport::default(),
        errors: 0,
    };
    lane.run().await
}
