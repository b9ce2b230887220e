//! Kafka: produce each event to the endpoint's topic with librdkafka's idempotent producer
//! (`enable.idempotence=true`, `acks=all`) and await every record's delivery report.
//!
//! Custody: an event is `accepted` when its record's delivery report says the partition leader
//! appended it and every in-sync replica has it (`acks=all`; with the topic's
//! `min.insync.replicas` at 2 or more, that is at least two brokers). A record the broker
//! refuses (a missing topic, an authorization error, a record too large), or one librdkafka gave
//! up on after the transport's message timeout (a broker down or unreachable), fails the whole
//! delivery with its reason, never an `accepted`. A delivery resolves only once every record of
//! it has its report.
//!
//! Kafka gives no dedup answer across deliveries: the idempotent producer keeps librdkafka's own
//! retries of one record from writing it twice or out of order, but a redelivery by the relay (a
//! batch that timed out or failed after some of its records were appended, a relay that crashed
//! before recording its verdicts, `outbox redeliver`) is a new record, answered `accepted` again.
//! The consuming side's inbox, which dedups by event id and checks the content hash for its whole
//! retention horizon, is what keeps each event applied once; the `tidemark-event-id` header lets
//! consumers of other kinds dedup too.
//!
//! Key: `<source>/<flow_id>` (neither id may contain a `/`), so every event of a flow goes to one
//! partition, where Kafka keeps the order it was appended in; the partitioner is
//! `murmur2_random`, the Java client's, so producers in other languages that key the same way
//! agree on the partition. The value is the envelope's JSON; headers carry `tidemark-event-id`,
//! `tidemark-source`, `tidemark-flow`, `tidemark-seq` (decimal), `tidemark-generation` and
//! `tidemark-content-hash` (each UTF-8 text).
//!
//! Connection: the endpoint's bootstrap servers, plaintext, no authentication. The topic is the
//! operator's: the producer never asks the cluster to create it (`allow.auto.create.topics=false`),
//! and a topic the cluster does not know after `TransportConfig::connect_timeout` fails the
//! delivery with librdkafka's "unknown topic".

use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use tidemark_core::endpoint::EndpointKind;
use tidemark_core::store::ReceiveOutcome;
use tidemark_core::{Envelope, Error, Result};

use crate::{Delivered, Transport, TransportConfig};

/// librdkafka refuses a `socket.connection.setup.timeout.ms` below one second.
const CONNECTION_SETUP_TIMEOUT_MS_MIN: u128 = 1_000;
/// The shortest message timeout handed to librdkafka: it must exceed `linger.ms`
/// ([`LINGER_MS`]), and less than this leaves no room for a round trip.
const MESSAGE_TIMEOUT_MS_MIN: u128 = 100;
/// How long librdkafka waits for more records before it sends a request (its default): a batch's
/// records are all queued at once, so they share requests anyway.
const LINGER_MS: u32 = 5;
/// The longest wait between two attempts to reconnect to a broker, in ms (librdkafka's default
/// is 10 s). librdkafka doubles the wait after each failed attempt and starts again from
/// `reconnect.backoff.ms` (100 ms) only once no attempt was made for this long, so a broker that
/// fails again and again within 10 s (a flapping network, a rolling restart) left a producer, and
/// a group member's coordinator connection, up to 10 s behind a broker that was back: a member
/// that reconnects that late has missed its session timeout and must rejoin the group (found by
/// `tidemark chaos --broker kafka-mock`). One second keeps the reconnects of one client per
/// process cheap for the broker.
pub(crate) const RECONNECT_BACKOFF_MAX_MS: u64 = 1_000;

/// An idempotent producer to one `kafka://servers/<topic>` endpoint, created on first use.
pub struct KafkaTransport {
    bootstrap: String,
    topic: String,
    connect_timeout: Duration,
    message_timeout: Duration,
    producer: std::sync::OnceLock<FutureProducer>,
}

/// The key an event's record is produced with: `<source>/<flow_id>`.
pub fn key(envelope: &Envelope) -> String {
    format!("{}/{}", envelope.source, envelope.flow_id)
}

/// The headers an event's record carries, in this order: `tidemark-event-id`,
/// `tidemark-source`, `tidemark-flow`, `tidemark-seq`, `tidemark-generation`,
/// `tidemark-content-hash`, and `traceparent` when the event has a trace context.
pub fn headers(envelope: &Envelope) -> Vec<(&'static str, String)> {
    let mut headers = vec![
        ("tidemark-event-id", envelope.event_id.clone()),
        ("tidemark-source", envelope.source.clone()),
        ("tidemark-flow", envelope.flow_id.clone()),
        ("tidemark-seq", envelope.seq.to_string()),
        ("tidemark-generation", envelope.generation.clone()),
        ("tidemark-content-hash", envelope.content_hash()),
    ];
    if let Some(traceparent) = &envelope.traceparent {
        headers.push(("traceparent", traceparent.clone()));
    }
    headers
}

impl KafkaTransport {
    /// A producer to `topic` on the cluster reached through `bootstrap` (`host:port` each).
    pub fn new(bootstrap: &[String], topic: &str, config: &TransportConfig) -> KafkaTransport {
        KafkaTransport {
            bootstrap: bootstrap.join(","),
            topic: topic.to_string(),
            connect_timeout: config.connect_timeout,
            message_timeout: config.message_timeout,
            producer: std::sync::OnceLock::new(),
        }
    }

    /// librdkafka's configuration of the producer (see the module documentation).
    fn client_config(&self) -> ClientConfig {
        let setup_ms = self.connect_timeout.as_millis().max(CONNECTION_SETUP_TIMEOUT_MS_MIN);
        let message_ms = self.message_timeout.as_millis().max(MESSAGE_TIMEOUT_MS_MIN);
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &self.bootstrap)
            .set("client.id", "tidemark-relay")
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("partitioner", "murmur2_random")
            .set("allow.auto.create.topics", "false")
            .set("linger.ms", LINGER_MS.to_string())
            .set("reconnect.backoff.max.ms", RECONNECT_BACKOFF_MAX_MS.to_string())
            .set("message.timeout.ms", message_ms.to_string())
            .set("socket.connection.setup.timeout.ms", setup_ms.to_string())
            .set("topic.metadata.propagation.max.ms", self.connect_timeout.as_millis().to_string());
        config
    }

    fn producer(&self) -> Result<&FutureProducer> {
        if let Some(producer) = self.producer.get() {
            return Ok(producer);
        }
        // Creating the client does not connect (librdkafka connects in the background), so a
        // failure here is a configuration librdkafka refuses.
        let created: FutureProducer = self
            .client_config()
            .create()
            .map_err(|e| Error::io(format!("cannot create a Kafka producer for {}: {e}", self.bootstrap)))?;
        // Two first deliveries at once are not possible (a lane has one batch in flight); if they
        // were, the second producer is dropped unused.
        Ok(self.producer.get_or_init(|| created))
    }

    async fn produce(&self, items: &[(String, Envelope)]) -> Result<Vec<ReceiveOutcome>> {
        let producer = self.producer()?;
        let topic = &self.topic;
        // Every record is queued before any delivery report is awaited (librdkafka batches them
        // into requests, in order per partition), then the reports are read in order.
        let mut pending = Vec::with_capacity(items.len());
        for (_, envelope) in items {
            let payload = serde_json::to_vec(envelope).map_err(|e| Error::Invariant(e.to_string()))?;
            let key = key(envelope);
            let mut record_headers = OwnedHeaders::new_with_capacity(6);
            for (name, value) in headers(envelope) {
                record_headers = record_headers.insert(Header { key: name, value: Some(value.as_bytes()) });
            }
            let record = FutureRecord::to(topic).key(key.as_bytes()).payload(&payload).headers(record_headers);
            let report = producer.send_result(record).map_err(|(e, _)| {
                Error::io(format!("Kafka produce of {} to topic {topic}: not queued: {e}", envelope.event_id))
            })?;
            pending.push(report);
        }
        let mut outcomes = Vec::with_capacity(items.len());
        let mut first_failure: Option<String> = None;
        let mut failed = 0_usize;
        for ((consumer_id, envelope), report) in items.iter().zip(pending) {
            // Every report is awaited, even after a failure: the delivery resolves once each
            // record is settled (each is bounded by the message timeout).
            let failure = match report.await {
                Ok(Ok(_delivered)) => None,
                // librdkafka's words name the error and its code ("Broker: Topic authorization failed").
                Ok(Err((error, _message))) => Some(error.to_string()),
                Err(_canceled) => Some("the producer was closed before it reported the delivery".to_string()),
            };
            match failure {
                None => outcomes.push(ReceiveOutcome::Accepted {
                    consumer_id: consumer_id.clone(),
                    event_id: envelope.event_id.clone(),
                }),
                Some(reason) => {
                    failed += 1;
                    first_failure.get_or_insert_with(|| {
                        format!(
                            "Kafka produce of {} to topic {topic} at {}: {reason}",
                            envelope.event_id, self.bootstrap
                        )
                    });
                }
            }
        }
        match first_failure {
            None => Ok(outcomes),
            Some(reason) => Err(Error::io(if failed > 1 {
                format!("{reason} (and {} more of the {} records failed)", failed - 1, items.len())
            } else {
                reason
            })),
        }
    }
}

impl Transport for KafkaTransport {
    fn kind(&self) -> EndpointKind {
        EndpointKind::Kafka
    }

    fn deliver<'a>(&'a self, items: &'a [(String, Envelope)]) -> Delivered<'a> {
        Box::pin(self.produce(items))
    }
}
