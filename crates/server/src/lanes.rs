//! Relay lanes: one asynchronous delivery loop per network endpoint of each outbox, so that an
//! endpoint that is down, slow or black-holed never delays delivery to the others
//! (docs/protocol.md, "Endpoints").
//!
//! A lane repeats: read the due deliveries of its endpoint's subscribers on the outbox's thread
//! (the engine's `plan`, restricted to those subscribers, so another endpoint's backlog never fills
//! its window), hand them to the endpoint's transport with `relay.attempt_timeout_ms` (the
//! thread is free meanwhile), and record the verdicts on the outbox's thread (`judge`, then
//! `record_deliveries`: the same backoff, jitter and quarantine as the file relay). One batch is
//! in flight per lane at a time; a lane to a broker also sorts its batch by outbox position and
//! holds back a flow whose earlier event is still open (`in_flow_order`), so each flow reaches
//! the broker in seq order, failures included (docs/protocol.md, "Order in a broker"). A
//! timeout or an error fails the batch's deliveries (retried; the remote answers `duplicate` for
//! what it stored).
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
use tidemark_core::store::{Delivery, ProducerStore, Subscription};
use tidemark_core::{Envelope, Result};
use tidemark_engine::{answers_of, in_flow_order, judge, plan, EndpointAnswer, RelayOptions, RelayReport};
use tidemark_transport::Transport;
use utoipa::ToSchema;

use crate::backend::Backend;
use crate::tenant::Tenant;
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

/// The due deliveries of `endpoint`'s subscribers, or `None` when it has none left. With
/// `flow_order` (a broker, which keeps arrival order), without the deliveries that would overtake
/// an earlier event of their flow still open (backing off after a failed attempt, or
/// quarantined): each flow reaches the broker in seq order.
async fn next_batch<B: Backend>(
    tenant: &Tenant<B>,
    outbox: usize,
    endpoint: &str,
    options: &RelayOptions,
    flow_order: bool,
) -> Result<Option<Vec<Delivery>>> {
    let (endpoint, mut options) = (endpoint.to_string(), options.clone());
    tenant.outboxes()[outbox]
        .call(move |p| {
            let consumers: Vec<String> = p
                .store
                .subscriptions()?
                .into_iter()
                .filter(|s| s.endpoint == endpoint)
                .map(|s| s.consumer_id)
                .collect();
            if consumers.is_empty() {
                return Ok(None);
            }
            options.consumers = Some(consumers);
            let batch = plan(&mut p.store, &options, (p.clock)())?;
            if !flow_order || batch.is_empty() {
                return Ok(Some(batch));
            }
            let overtaking = p.store.overtaking(&batch)?;
            Ok(Some(in_flow_order(batch, &overtaking)))
        })
        .await
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

async fn lane<B: Backend>(state: AppState, tenant: Arc<Tenant<B>>, outbox: usize, endpoint: String) -> Value {
    let options = RelayOptions {
        limit: state.config.relay.batch,
        event_id: None,
        policy: state.config.relay_policy(),
        keep_answers: false,
        consumers: None,
    };
    let timeout = Duration::from_millis(state.config.relay.attempt_timeout_ms);
    let masked = mask(&endpoint);
    let parsed = Endpoint::parse(&endpoint).map(|e| e.kind());
    let kind = parsed.as_ref().map(|k| k.as_str()).unwrap_or("unknown");
    // A broker keeps arrival order (a stream, a queue, a partition): each flow goes in seq order.
    let flow_order = parsed.is_ok_and(|k| k.is_broker());
    let mut transport: Option<Arc<dyn Transport>> = None;
    let mut total = RelayReport::default();
    let mut errors = 0_u64;
    tracing::debug!(tenant = %tenant.id, endpoint = %masked, "relay lane started");
    while !state.is_shutting_down() {
        let batch = match next_batch(&tenant, outbox, &endpoint, &options, flow_order).await {
            Ok(Some(batch)) => batch,
            Ok(None) => break,
            Err(error) => {
                errors += 1;
                tracing::error!(tenant = %tenant.id, endpoint = %masked, code = error.code(), %error,
                    "relay lane: reading the due deliveries failed");
                if !crate::background::pause(&state, state.config.relay.interval_ms).await {
                    break;
                }
                continue;
            }
        };
        if batch.is_empty() {
            if !crate::background::pause(&state, state.config.relay.interval_ms).await {
                break;
            }
            continue;
        }
        update(&tenant, outbox, &endpoint, |s| s.in_flight = true);
        let started = Instant::now();
        let answers = hand_over(&mut transport, &state, (&endpoint, &masked), &batch, timeout).await;
        crash::hit("relay.after_consumer_commit");
        let now = now_ms();
        let (results, report) = judge(&batch, answers, &options, now, &mut rand::random::<f64>);
        let last_error = results.iter().find_map(|r| match &r.verdict {
            tidemark_core::store::DeliveryVerdict::Accepted => None,
            tidemark_core::store::DeliveryVerdict::Retry { reason, .. }
            | tidemark_core::store::DeliveryVerdict::Quarantine { reason } => Some(reason.clone()),
        });
        if report.failed == report.attempted {
            // Nothing got through: connect again next time (a restarted server, a new token).
            transport = None;
        }
        let recorded = tenant.outboxes()[outbox].call(move |p| p.store.record_deliveries(&results, now)).await;
        state.metrics.record_relay(&tenant.id, &report);
        state.metrics.record_lane(&tenant.id, kind, &masked, &report, started.elapsed());
        let took_ms = started.elapsed().as_millis() as u64;
        update(&tenant, outbox, &endpoint, |s| {
            s.in_flight = false;
            s.batches += 1;
            s.delivered += report.accepted + report.duplicate;
            s.failed += report.attempted - report.accepted - report.duplicate;
            s.last_error.clone_from(&last_error);
            s.last_attempt_at_ms = Some(now);
            s.last_batch_ms = Some(took_ms);
        });
        if let Some(error) = &last_error {
            tracing::warn!(tenant = %tenant.id, endpoint = %masked, attempted = report.attempted,
                failed = report.failed, quarantined = report.quarantined, %error, "relay lane: deliveries not accepted");
        }
        if let Err(error) = recorded {
            errors += 1;
            tracing::error!(tenant = %tenant.id, endpoint = %masked, code = error.code(), %error,
                "relay lane: recording the verdicts failed (the deliveries stay pending and are sent again)");
        }
        total.absorb(report);
    }
    tenant.lanes.lock().unwrap_or_else(|p| p.into_inner()).remove(&(outbox, endpoint.clone()));
    json!({"endpoint": masked, "attempted": total.attempted, "accepted": total.accepted,
        "duplicate": total.duplicate, "failed": total.failed, "quarantined": total.quarantined, "errors": errors})
}
