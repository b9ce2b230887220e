//! The loops `tidemark serve` runs for every open tenant: delivery (relay, then each consumer's
//! drain), the workflow worker, and retention. Each stops when shutdown begins: the delivery and
//! retention loops finish their current step (each step is one or a few transactions), the
//! worker stops claiming and releases the leases of the runs it holds.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tidemark_core::store::{in_batches, ConsumerStore, DrainScope, ProducerStore};
use tidemark_core::workflow::WorkflowStore;
use tidemark_core::Result;
use tidemark_engine::relay_until_idle;

use crate::backend::Backend;
use crate::tenant::Tenant;
use crate::{now_ms, AppState};

/// Relay passes per delivery round (each pass is one batch).
const RELAY_PASSES_PER_ROUND: u32 = 8;
/// Prune batches per store per retention round.
const PRUNE_BATCHES_PER_ROUND: u64 = 100;

/// Start the loops of a newly opened tenant.
pub fn start<B: Backend>(state: AppState, tenant: Arc<Tenant<B>>) {
    let handles = vec![
        ("delivery", tokio::spawn(delivery_loop(state.clone(), tenant.clone()))),
        ("worker", tokio::spawn(worker_loop(state.clone(), tenant.clone()))),
        ("retention", tokio::spawn(retention_loop(state.clone(), tenant.clone()))),
        ("schedules", tokio::spawn(schedule_loop(state.clone(), tenant.clone()))),
    ];
    {
        let mut tasks = state.tasks.lock().unwrap_or_else(|p| p.into_inner());
        for (name, handle) in handles {
            tasks.push((format!("{}/{name}", tenant.id), handle));
        }
    }
    crate::sources::start(&state, &tenant);
}

/// After shutdown began: wait (at most `grace`) for every loop to finish; report each.
pub async fn stop_all(state: &AppState, grace: Duration) -> Value {
    state.shutdown.send_replace(true);
    let tasks = std::mem::take(&mut *state.tasks.lock().unwrap_or_else(|p| p.into_inner()));
    let deadline = tokio::time::Instant::now() + grace;
    let mut report = serde_json::Map::new();
    for (name, handle) in tasks {
        let abort = handle.abort_handle();
        let outcome = match tokio::time::timeout_at(deadline, handle).await {
            Ok(Ok(value)) => value,
            Ok(Err(e)) => json!({"error": e.to_string()}),
            Err(_) => {
                abort.abort();
                json!({"error": "did not finish within shutdown.grace_ms"})
            }
        };
        report.insert(name, outcome);
    }
    Value::Object(report)
}

/// Sleep `ms`, or less if shutdown begins. Returns false once shutting down.
pub(crate) async fn pause(state: &AppState, ms: u64) -> bool {
    let mut signal = state.shutdown_signal();
    if *signal.borrow() {
        return false;
    }
    tokio::select! {
        _ = tokio::time::sleep(Duration::from_millis(ms)) => !state.is_shutting_down(),
        _ = signal.changed() => false,
    }
}

async fn delivery_loop<B: Backend>(state: AppState, tenant: Arc<Tenant<B>>) -> Value {
    let mut rounds = 0_u64;
    let mut errors = 0_u64;
    while !state.is_shutting_down() {
        rounds += 1;
        match delivery_round(&state, &tenant).await {
            Ok(busy) if busy => continue,
            Ok(_) => {}
            Err(error) => {
                errors += 1;
                state.metrics.loop_errors.get_or_create(&crate::metrics::LoopLabels::new("delivery")).inc();
                tracing::error!(tenant = %tenant.id, code = error.code(), %error, "delivery round failed");
            }
        }
        if !pause(&state, state.config.relay.interval_ms.min(state.config.consumers.drain_interval_ms)).await {
            break;
        }
    }
    json!({"rounds": rounds, "errors": errors})
}

/// One relay (a few passes) and one drain per consumer. True when something moved.
async fn delivery_round<B: Backend>(state: &AppState, tenant: &Arc<Tenant<B>>) -> Result<bool> {
    let options = state.config.relay_options();
    let mut relayed = tidemark_engine::RelayReport::default();
    for (index, outbox) in tenant.outboxes().into_iter().enumerate() {
        let mut options = options.clone();
        // File endpoints here, on the outbox's thread; each network endpoint in a lane of its own.
        let (report, network) = outbox
            .call(move |p| {
                let subscriptions = p.store.subscriptions()?;
                let network = crate::lanes::network_endpoints(&subscriptions);
                let files = crate::lanes::file_subscribers(&subscriptions);
                if files.is_empty() {
                    return Ok((tidemark_engine::RelayReport::default(), network));
                }
                options.consumers = Some(files);
                let (report, _) = relay_until_idle(
                    &mut p.store,
                    &mut p.endpoints,
                    &options,
                    RELAY_PASSES_PER_ROUND,
                    &mut now_ms,
                    &mut rand::random::<f64>,
                )?;
                Ok((report, network))
            })
            .await?;
        crate::lanes::ensure(state, tenant, index, network);
        relayed.absorb(report);
    }
    state.metrics.record_relay(&tenant.id, &relayed);
    let mut moved = relayed.attempted > 0;
    if moved {
        tracing::debug!(tenant = %tenant.id, attempted = relayed.attempted, accepted = relayed.accepted,
            duplicate = relayed.duplicate, failed = relayed.failed, "relay round");
    }
    if relayed.conflict + relayed.expired + relayed.quarantined > 0 {
        tracing::warn!(tenant = %tenant.id, conflict = relayed.conflict, expired = relayed.expired,
            quarantined = relayed.quarantined, "deliveries refused or quarantined (see GET /v1/outbox)");
    }

    let tenant_id = tenant.id.clone();
    let consumers = state.consumers(&tenant_id)?;
    for consumer in consumers {
        // A consumer whose handler this build does not register (declared by another build):
        // its events wait in the inbox, nothing is applied, and every round says so.
        let database = match state.registry.handler_database(&consumer.handler) {
            Ok(database) => database,
            Err(error) => {
                state.metrics.loop_errors.get_or_create(&crate::metrics::LoopLabels::new("delivery")).inc();
                tracing::error!(tenant = %tenant.id, consumer = %consumer.consumer_id, code = error.code(), %error,
                    "not drained");
                continue;
            }
        };
        let batch = state.config.consumers.drain_batch;
        let (consumer_id, handler) = (consumer.consumer_id.clone(), consumer.handler.clone());
        let started = std::time::Instant::now();
        let report = tenant
            .inbox_of(database)?
            .call(move |t| t.drain(&consumer_id, &handler, &DrainScope::All, batch))
            .await
            .inspect_err(|error| {
                tracing::error!(tenant = %tenant.id, consumer = %consumer.consumer_id, code = error.code(), %error,
                    "drain failed");
            })?;
        state.metrics.record_drain(&tenant.id, &consumer.consumer_id, &report, started.elapsed());
        moved |= report.applied > 0;
        if report.applied > 0 || !report.stuck.is_empty() {
            // A blocked flow stays blocked until an operator acts: every round would say so again,
            // so this is a debug line; the `inbox_blocked` gauge is what to alert on.
            tracing::debug!(tenant = %tenant.id, consumer = %consumer.consumer_id, applied = report.applied,
                stuck = report.stuck.len(), took_ms = started.elapsed().as_millis() as u64, "drain round");
        }
    }
    Ok(moved)
}

async fn worker_loop<B: Backend>(state: AppState, tenant: Arc<Tenant<B>>) -> Value {
    let mut signal = state.shutdown_signal();
    let stop = async move {
        while !*signal.borrow() {
            if signal.changed().await.is_err() {
                return;
            }
        }
    };
    let Some(worker) = &tenant.worker else {
        return json!({"workflows": 0});
    };
    tracing::debug!(tenant = %tenant.id, worker_id = %worker.options().worker_id, "workflow worker started");
    match worker.run_until(stop).await {
        Ok(report) => {
            tracing::info!(tenant = %tenant.id, claimed = report.claimed, recovered = report.recovered,
                completed = report.completed, compensated = report.compensated, failed = report.failed,
                released = report.released, lost = report.lost, "workflow worker stopped");
            serde_json::to_value(&report).unwrap_or(Value::Null)
        }
        Err(error) => {
            tracing::error!(tenant = %tenant.id, code = error.code(), %error, "the workflow worker failed");
            json!({"error": error.to_string()})
        }
    }
}

/// How often a tenant's schedule loop ticks its schedules, in ms (a tick is started at most this
/// late, plus the worker's poll).
pub const SCHEDULE_TICK_MS: u64 = 1_000;

/// Tick the tenant's schedules every [`SCHEDULE_TICK_MS`] (only when it registers workflows).
async fn schedule_loop<B: Backend>(state: AppState, tenant: Arc<Tenant<B>>) -> Value {
    if tenant.worker.is_none() {
        return json!({"workflows": 0});
    }
    let (mut rounds, mut started, mut errors) = (0_u64, 0_u64, 0_u64);
    while pause(&state, SCHEDULE_TICK_MS).await {
        rounds += 1;
        match tidemark_engine::workflow::tick_schedules(&tenant.writer, &tenant.workflows).await {
            Ok(report) => {
                started += report.started;
                if report.fired > 0 || !report.unregistered.is_empty() {
                    tracing::info!(tenant = %tenant.id, fired = report.fired, started = report.started,
                        existing = report.existing, skipped = report.skipped, conflicts = report.conflicts,
                        unregistered = ?report.unregistered, "schedules ticked");
                }
            }
            Err(error) => {
                errors += 1;
                state.metrics.loop_errors.get_or_create(&crate::metrics::LoopLabels::new("schedules")).inc();
                tracing::error!(tenant = %tenant.id, code = error.code(), %error, "schedule tick failed");
            }
        }
    }
    json!({"rounds": rounds, "started": started, "errors": errors})
}

async fn retention_loop<B: Backend>(state: AppState, tenant: Arc<Tenant<B>>) -> Value {
    let mut rounds = 0_u64;
    let mut errors = 0_u64;
    while pause(&state, state.config.retention.interval_ms).await {
        rounds += 1;
        let result = retention_round(&state, &tenant).await;
        if let Ok(report) = &result {
            tracing::debug!(tenant = %tenant.id, %report, "retention round");
        }
        if let Err(error) = result {
            errors += 1;
            state.metrics.loop_errors.get_or_create(&crate::metrics::LoopLabels::new("retention")).inc();
            tracing::error!(tenant = %tenant.id, code = error.code(), %error, "retention round failed");
        }
    }
    json!({"rounds": rounds, "errors": errors})
}

/// Prune every store in bounded batches (each batch its own short transaction).
pub async fn retention_round<B: Backend>(state: &AppState, tenant: &Arc<Tenant<B>>) -> Result<Value> {
    let r = state.config.retention.clone();
    let mut out = serde_json::Map::new();
    for (name, inbox) in [("inbox", &tenant.inbox), ("runs_inbox", &tenant.runs_inbox)] {
        let (applied_ms, batch_rows) = (r.applied_ms, r.batch_rows);
        let (report, _) = inbox
            .call(move |t| in_batches(PRUNE_BATCHES_PER_ROUND, || t.store.prune(applied_ms, batch_rows, now_ms())))
            .await?;
        out.insert(name.into(), serde_json::to_value(report).unwrap_or(Value::Null));
    }
    let (delivered_ms, batch_rows) = (r.delivered_ms, r.batch_rows);
    for (name, outbox) in ["outbox", "runs_outbox"].into_iter().zip(tenant.outboxes()) {
        let (report, _) = outbox
            .call(move |p| {
                in_batches(PRUNE_BATCHES_PER_ROUND, || p.store.prune_delivered(delivered_ms, batch_rows, now_ms()))
            })
            .await?;
        out.insert(name.into(), serde_json::to_value(report).unwrap_or(Value::Null));
    }
    let (finished_ms, batch_rows) = (r.finished_runs_ms, r.batch_rows);
    let (runs, _) = tenant
        .writer
        .call(move |store, now| in_batches(PRUNE_BATCHES_PER_ROUND, || store.purge(now - finished_ms, batch_rows, now)))
        .await?;
    out.insert("runs".into(), serde_json::to_value(runs).unwrap_or(Value::Null));
    Ok(Value::Object(out))
}
