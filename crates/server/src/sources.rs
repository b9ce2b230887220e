//! Broker sources: for each `[[sources]]` entry of an open tenant, a loop that pulls from the
//! broker into the declared consumer's inbox and acks (JetStream, RabbitMQ) or commits offsets
//! (Kafka) only after the inbox commit (`tidemark_transport::NatsSource`, `KafkaSource`,
//! `AmqpSource`). The consumer's drain,
//! in the delivery loop, applies what arrives, in seq order per flow, as for any relay's
//! deliveries.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tidemark_core::store::{ConsumerStore, ReceiveOutcome};
use tidemark_core::{Envelope, Error, Result};
use tidemark_transport::{Inbox, Source, SourceReport};

use crate::backend::Backend;
use crate::config::SourceConfig;
use crate::tenant::Tenant;
use crate::AppState;

/// The bound of one pull (JetStream answers at once with what the stream holds, up to the batch;
/// a Kafka or RabbitMQ pull waits this long for a first record or delivery).
const PULL_WAIT: Duration = Duration::from_millis(500);
/// The pause after a failed connect or pull, doubled after each further failure in a row up to
/// [`RETRY_PAUSE_MAX_MS`]: an inbox or broker that stays down is not asked again every half
/// second (each failed RabbitMQ pull returns its batch to the queue, and a quorum queue counts
/// those returns against its delivery limit).
const RETRY_PAUSE_MS: u64 = 500;
/// The longest pause between failed attempts.
const RETRY_PAUSE_MAX_MS: u64 = 30_000;

/// The pause after the `failures`-th failure in a row (1-based): 0.5 s, 1 s, 2 s, ... 30 s.
fn retry_pause_ms(failures: u32) -> u64 {
    let doublings = failures.saturating_sub(1).min(16);
    RETRY_PAUSE_MS.saturating_mul(1 << doublings).min(RETRY_PAUSE_MAX_MS)
}

/// Start the loops of the sources configured for `tenant`.
pub fn start<B: Backend>(state: &AppState, tenant: &Arc<Tenant<B>>) {
    for source in state.config.sources.iter().filter(|s| s.tenant == tenant.id) {
        let handle = tokio::spawn(source_loop(state.clone(), tenant.clone(), source.clone()));
        let name = format!("{}/source/{}", tenant.id, source.consumer);
        state.tasks.lock().unwrap_or_else(|p| p.into_inner()).push((name, handle));
    }
}

/// The declared consumer's inbox in its tenant (its handler's database), as a source delivers to it.
struct ConsumerInbox<B: Backend> {
    state: AppState,
    tenant: Arc<Tenant<B>>,
}

impl<B: Backend> Inbox for ConsumerInbox<B> {
    fn receive<'a>(
        &'a self,
        consumer_id: &'a str,
        events: Vec<Envelope>,
    ) -> Pin<Box<dyn Future<Output = Result<Vec<ReceiveOutcome>>> + Send + 'a>> {
        Box::pin(async move {
            let record =
                self.state.consumers(&self.tenant.id)?.into_iter().find(|c| c.consumer_id == consumer_id).ok_or_else(
                    || Error::not_found(format!("no consumer {consumer_id:?} declared in tenant {}", self.tenant.id)),
                )?;
            let database = self.state.registry.handler_database(&record.handler)?;
            let consumer_id = consumer_id.to_string();
            let outcomes = self
                .tenant
                .inbox_of(database)?
                .call(move |t| {
                    let items: Vec<(&str, &Envelope)> = events.iter().map(|e| (consumer_id.as_str(), e)).collect();
                    t.store.receive_batch(&items, (t.clock)())
                })
                .await?;
            for outcome in &outcomes {
                self.state.metrics.record_receive(&self.tenant.id, outcome);
            }
            Ok(outcomes)
        })
    }
}

async fn source_loop<B: Backend>(state: AppState, tenant: Arc<Tenant<B>>, config: SourceConfig) -> Value {
    let inbox = ConsumerInbox { state: state.clone(), tenant: tenant.clone() };
    let transport = state.config.transport_config();
    // Checked when the configuration was loaded.
    let spec = match config.spec() {
        Ok(spec) => spec,
        Err(error) => {
            tracing::error!(tenant = %tenant.id, consumer = %config.consumer, from = %config.from,
                code = error.code(), %error, "source: not started");
            return json!({"consumer": config.consumer, "from": config.from, "error": error.to_string()});
        }
    };
    let mut source: Option<Source> = None;
    let mut total = SourceReport::default();
    let mut errors = 0_u64;
    let mut failures_in_a_row = 0_u32;
    let mut pulls = 0_u64;
    let mut signal = state.shutdown_signal();
    while !state.is_shutting_down() {
        let result = match &source {
            None => Source::connect(&spec, &transport).await.map(|s| {
                source = Some(s);
                SourceReport::default()
            }),
            Some(connected) => tokio::select! {
                pulled = connected.pull(&inbox, &config.consumer, PULL_WAIT) => pulled,
                _ = signal.changed() => break,
            },
        };
        match result {
            Ok(report) => {
                failures_in_a_row = 0;
                // Nothing there: wait as the relay does when idle (a pull answers at once).
                let idle = report.fetched == 0 && source.is_some();
                pulls += u64::from(report.fetched > 0);
                if report.rejected > 0 {
                    tracing::warn!(tenant = %tenant.id, consumer = %config.consumer, from = %config.from,
                        rejected = report.rejected, reasons = ?report.reasons,
                        "source: messages rejected: terminated or rejected at the broker, or committed past (not envelopes, or \
                         refused by the inbox)");
                }
                total.absorb(report);
                if idle && !crate::background::pause(&state, state.config.relay.interval_ms).await {
                    break;
                }
            }
            Err(error) => {
                errors += 1;
                failures_in_a_row = failures_in_a_row.saturating_add(1);
                // A source that may pull again is kept (a Kafka member keeps its place in the
                // group through a broker's outage); any other is connected anew. Closing a Kafka
                // consumer waits for it to leave its group: off the async threads.
                if let Some(failed) = source.take_if(|failed| !failed.usable()) {
                    tokio::task::spawn_blocking(move || drop(failed));
                }
                tracing::error!(tenant = %tenant.id, consumer = %config.consumer, from = %config.from,
                    code = error.code(), %error,
                    "source: pull failed (nothing unacked or uncommitted is lost: the broker redelivers)");
                if !crate::background::pause(&state, retry_pause_ms(failures_in_a_row)).await {
                    break;
                }
            }
        }
    }
    if let Some(done) = source.take() {
        let _ = tokio::task::spawn_blocking(move || drop(done)).await;
    }
    json!({"consumer": config.consumer, "from": config.from, "pulls_that_fetched": pulls, "fetched": total.fetched, "accepted": total.accepted,
        "duplicate": total.duplicate, "rejected": total.rejected, "errors": errors})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_pulls_back_off_from_half_a_second_to_thirty() {
        let pauses: Vec<u64> = (1..=8).map(retry_pause_ms).collect();
        assert_eq!(pauses, [500, 1_000, 2_000, 4_000, 8_000, 16_000, 30_000, 30_000]);
        assert_eq!(retry_pause_ms(u32::MAX), RETRY_PAUSE_MAX_MS);
        assert_eq!(retry_pause_ms(0), RETRY_PAUSE_MS);
    }
}
