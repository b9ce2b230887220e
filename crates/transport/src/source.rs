//! Consuming from a broker into a tidemark inbox: a JetStream durable pull consumer whose
//! messages are stored in the inbox and acked to the broker only after the inbox transaction
//! committed (docs/protocol.md, "Consuming from a broker"). The Kafka consumer group is
//! `kafka_source.rs` and the RabbitMQ queue consumer `amqp_source.rs`; [`Source`] is any of them,
//! and [`Inbox`] and [`SourceReport`] are shared.
//!
//! One pull: fetch up to `batch` messages (what the stream holds now: a pull does not wait for
//! more; the caller pauses when one finds nothing), parse each as
//! an envelope, store the valid ones in one inbox call, then answer the broker per message:
//! `accepted` and `duplicate` (a redelivery: the inbox already holds it) are acked; a message
//! that is not an envelope, and an envelope the inbox refuses (`conflict`, `expired`), are
//! terminated (`AckKind::Term`: the broker never redelivers it) with the reason logged by the
//! caller and counted, so a poison message never loops. When the inbox call fails, nothing is
//! acked: the broker redelivers after `ack_wait` and the inbox answers `duplicate` for what it did
//! store. Events of one flow that arrive out of order (a redelivery after a later one) wait in the
//! inbox as a `gap` until the missing seq arrives, as they do from any relay.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, AckKind};
use futures_util::StreamExt;
use serde::Serialize;
use tidemark_core::endpoint::{Endpoint, EndpointKind};
use tidemark_core::error::codes;
use tidemark_core::store::ReceiveOutcome;
use tidemark_core::{Envelope, Error, Result};

/// Where a source's events go: one consumer's inbox. `receive` answers one outcome per envelope,
/// in order, after the inbox transaction committed (`ConsumerStore::receive_batch`).
pub trait Inbox: Send + Sync {
    /// Store `events` for `consumer_id` in one transaction; one outcome per event.
    fn receive<'a>(
        &'a self,
        consumer_id: &'a str,
        events: Vec<Envelope>,
    ) -> Pin<Box<dyn Future<Output = Result<Vec<ReceiveOutcome>>> + Send + 'a>>;
}

/// A connected broker source of any kind: what `tidemark serve`'s `[[sources]]` and
/// `tidemark consume` run.
pub enum Source {
    /// A JetStream durable pull consumer (boxed: its client is large beside the Kafka member).
    Nats(Box<NatsSource>),
    /// A member of a Kafka consumer group.
    Kafka(crate::KafkaSource),
    /// A consumer of a RabbitMQ queue (boxed, as the NATS member).
    Amqp(Box<crate::AmqpSource>),
}

/// A source as an operator gives it (`[[sources]]` in `tidemark serve`'s configuration,
/// `tidemark consume`'s flags), before it is checked: the settings of every kind side by side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceSettings {
    /// `nats://host[:port]/<subject prefix>`, `kafka://host:port[,host:port...]/<topic>` or
    /// `amqp://host[:port]/<queue>`.
    pub from: String,
    /// NATS only, and required there: the JetStream stream capturing the subjects.
    pub stream: Option<String>,
    /// The durable pull consumer's name (NATS), the consumer group, `group.id` (Kafka), or the
    /// consumer tag (RabbitMQ, where the queue itself keeps what is not acked yet).
    pub durable: String,
    /// Messages per pull.
    pub batch: usize,
    /// NATS only: how long the broker waits for an ack before it redelivers, in ms (default
    /// [`NATS_ACK_WAIT_MS_DEFAULT`]).
    pub ack_wait_ms: Option<u64>,
    /// Kafka only: the group's session timeout, in ms (default
    /// [`KAFKA_SESSION_TIMEOUT_MS_DEFAULT`]).
    pub session_timeout_ms: Option<u64>,
}

/// JetStream's redelivery delay for a source that sets none, in ms.
pub const NATS_ACK_WAIT_MS_DEFAULT: u64 = 30_000;
/// A Kafka source's session timeout when it sets none, in ms (librdkafka's default).
pub const KAFKA_SESSION_TIMEOUT_MS_DEFAULT: u64 = 45_000;

/// A checked source, one kind each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceSpec {
    /// A JetStream durable pull consumer.
    Nats(NatsSourceConfig),
    /// A Kafka consumer group.
    Kafka(crate::KafkaSourceConfig),
    /// A RabbitMQ queue.
    Amqp(crate::AmqpSourceConfig),
}

/// The endpoint a source's `from` names, or `invalid_config` saying why not. An `amqp://` source's
/// path names a queue where an endpoint's names an exchange (the same name rules): the message
/// says which.
pub(crate) fn parse_from(from: &str) -> Result<Endpoint> {
    Endpoint::parse(from).map_err(|e| {
        let mut why = e.to_string();
        if from.get(..7).is_some_and(|scheme| scheme.eq_ignore_ascii_case("amqp://")) {
            why = why.replace("the exchange", "the queue");
        }
        Error::invalid(codes::INVALID_CONFIG, format!("source from {from:?}: {why}"))
    })
}

impl SourceSettings {
    /// Check the settings for the kind `from` names: `invalid_config` for a `from` that is no
    /// broker (or a broker kind not consumed from), a setting of another kind, a NATS source
    /// without `stream`, or a value out of range.
    pub fn check(self) -> Result<SourceSpec> {
        let bad = |why: String| Error::invalid(codes::INVALID_CONFIG, why);
        let kind = parse_from(&self.from)?.kind();
        match kind {
            EndpointKind::Nats => {
                if self.session_timeout_ms.is_some() {
                    return Err(bad("session_timeout_ms is a Kafka setting; a nats:// source has ack_wait_ms".into()));
                }
                let stream = self.stream.ok_or_else(|| {
                    bad("a nats:// source needs stream, the JetStream stream capturing its subjects".into())
                })?;
                let config = NatsSourceConfig {
                    from: self.from,
                    stream,
                    durable: self.durable,
                    batch: self.batch,
                    ack_wait_ms: self.ack_wait_ms.unwrap_or(NATS_ACK_WAIT_MS_DEFAULT),
                };
                config.validate()?;
                Ok(SourceSpec::Nats(config))
            }
            EndpointKind::Kafka => {
                if self.stream.is_some() || self.ack_wait_ms.is_some() {
                    return Err(bad("stream and ack_wait_ms are JetStream settings; a kafka:// source has a \
                                    consumer group (durable) and session_timeout_ms"
                        .into()));
                }
                let config = crate::KafkaSourceConfig {
                    from: self.from,
                    group: self.durable,
                    batch: self.batch,
                    session_timeout_ms: self.session_timeout_ms.unwrap_or(KAFKA_SESSION_TIMEOUT_MS_DEFAULT),
                };
                config.validate()?;
                Ok(SourceSpec::Kafka(config))
            }
            EndpointKind::Amqp => {
                if self.stream.is_some() || self.ack_wait_ms.is_some() || self.session_timeout_ms.is_some() {
                    return Err(bad(
                        "stream and ack_wait_ms are JetStream settings and session_timeout_ms a Kafka \
                                    one; an amqp:// source has a queue (in from), a consumer tag (durable) and batch"
                            .into(),
                    ));
                }
                let config = crate::AmqpSourceConfig { from: self.from, consumer_tag: self.durable, batch: self.batch };
                config.validate()?;
                Ok(SourceSpec::Amqp(config))
            }
            other => Err(bad(format!(
                "source from {:?}: {other} endpoints are not consumed from; a source is nats://, kafka:// or amqp://",
                self.from
            ))),
        }
    }
}

impl Source {
    /// Connect the source `spec` describes ([`NatsSource::connect`],
    /// [`crate::KafkaSource::connect`], [`crate::AmqpSource::connect`]), within `transport`'s
    /// connect timeout; a RabbitMQ source takes its broker's credentials from it.
    pub async fn connect(spec: &SourceSpec, transport: &crate::TransportConfig) -> Result<Source> {
        let connect_timeout = transport.connect_timeout;
        Ok(match spec {
            SourceSpec::Nats(config) => Source::Nats(Box::new(NatsSource::connect(config, connect_timeout).await?)),
            SourceSpec::Kafka(config) => Source::Kafka(crate::KafkaSource::connect(config, connect_timeout).await?),
            SourceSpec::Amqp(config) => Source::Amqp(Box::new(crate::AmqpSource::connect(config, transport).await?)),
        })
    }

    /// One pull into `inbox` for `consumer_id`, waiting at most `wait` (see [`NatsSource::pull`],
    /// [`crate::KafkaSource::pull`] and [`crate::AmqpSource::pull`]). After an `Err`, drop the
    /// source and connect anew unless [`Source::usable`] says it can pull again.
    pub async fn pull(&self, inbox: &dyn Inbox, consumer_id: &str, wait: Duration) -> Result<SourceReport> {
        match self {
            Source::Nats(source) => source.pull(inbox, consumer_id, wait).await,
            Source::Kafka(source) => source.pull(inbox, consumer_id, wait).await,
            Source::Amqp(source) => source.pull(inbox, consumer_id, wait).await,
        }
    }

    /// After a failed pull: true when this source may pull again (a Kafka member whose error
    /// took no record, [`crate::KafkaSource::usable`]); false when it must be dropped and
    /// connected anew (every NATS and RabbitMQ source after an error).
    pub fn usable(&self) -> bool {
        match self {
            Source::Kafka(source) => source.usable(),
            Source::Nats(_) | Source::Amqp(_) => false,
        }
    }

    /// True when a pull that found nothing means the broker holds nothing more for this
    /// consumer: at once for JetStream (a pull answers with what the stream holds); for Kafka,
    /// once the group assigned this member its partitions and each is committed up to its end
    /// ([`crate::KafkaSource::caught_up`]); for RabbitMQ, once the queue holds no message ready
    /// for delivery ([`crate::AmqpSource::caught_up`]).
    pub async fn caught_up(&self) -> Result<bool> {
        match self {
            Source::Nats(_) => Ok(true),
            Source::Kafka(source) => source.caught_up().await,
            Source::Amqp(source) => source.caught_up().await,
        }
    }
}

/// What one pull (or several) did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SourceReport {
    /// Messages fetched from the broker.
    pub fetched: u64,
    /// Stored in the inbox as new (and acked).
    pub accepted: u64,
    /// Already in the inbox (a broker redelivery; acked).
    pub duplicate: u64,
    /// Terminated (JetStream), rejected without requeue (RabbitMQ) or committed past (Kafka):
    /// not an envelope, or refused by the inbox (`conflict`, `expired`). Their reasons, at most
    /// 20 per report.
    pub rejected: u64,
    /// Why the last rejected messages were rejected.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub reasons: Vec<String>,
}

impl SourceReport {
    /// Add another pull's counts to this one.
    pub fn absorb(&mut self, other: SourceReport) {
        self.fetched += other.fetched;
        self.accepted += other.accepted;
        self.duplicate += other.duplicate;
        self.rejected += other.rejected;
        for reason in other.reasons {
            self.reject_reason(reason);
        }
    }

    pub(crate) fn reject_reason(&mut self, reason: String) {
        if self.reasons.len() == 20 {
            self.reasons.remove(0);
        }
        self.reasons.push(reason);
    }
}

/// Where to consume from: a JetStream stream and the durable pull consumer on it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsSourceConfig {
    /// `nats://host[:port]/<subject prefix>`: the server, and the subjects consumed
    /// (`<prefix>.>`), as a relay publishes them.
    pub from: String,
    /// The stream that captures those subjects (the operator's; never created here).
    pub stream: String,
    /// The durable consumer's name on the stream (created on first use, then reused: the broker
    /// keeps its position).
    pub durable: String,
    /// Messages per pull, and twice this is the consumer's `max_ack_pending` (1..=1,000).
    pub batch: usize,
    /// How long the broker waits for an ack before it redelivers, in ms (1,000..=3,600,000).
    pub ack_wait_ms: u64,
}

impl NatsSourceConfig {
    /// Check the configuration: `invalid_config` for anything out of range.
    pub fn validate(&self) -> Result<(String, String)> {
        let bad = |why: String| Error::invalid(codes::INVALID_CONFIG, why);
        let Endpoint::Nats { server, subject_prefix } =
            Endpoint::parse(&self.from).map_err(|e| bad(format!("source from {:?}: {e}", self.from)))?
        else {
            return Err(bad(format!("source from {:?} is not a nats:// endpoint", self.from)));
        };
        for (what, name) in [("stream", &self.stream), ("durable", &self.durable)] {
            let ok = !name.is_empty()
                && name.len() <= 100
                && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
            if !ok {
                return Err(bad(format!("source {what} {name:?} must be 1..=100 of A-Z a-z 0-9 _ -")));
            }
        }
        if !(1..=1_000).contains(&self.batch) {
            return Err(bad(format!("source batch must be 1..=1000, got {}", self.batch)));
        }
        if !(1_000..=3_600_000).contains(&self.ack_wait_ms) {
            return Err(bad(format!("source ack_wait_ms must be 1000..=3600000, got {}", self.ack_wait_ms)));
        }
        Ok((server, subject_prefix))
    }
}

/// A connected JetStream durable pull consumer.
pub struct NatsSource {
    consumer: jetstream::consumer::Consumer<pull::Config>,
    batch: usize,
}

impl NatsSource {
    /// Connect, find the stream, and create (or reuse) the durable consumer filtered on
    /// `<prefix>.>` with explicit acks.
    pub async fn connect(config: &NatsSourceConfig, connect_timeout: Duration) -> Result<NatsSource> {
        let (server, prefix) = config.validate()?;
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(connect_timeout)
            .connect(server.as_str())
            .await
            .map_err(|e| Error::io(format!("cannot connect to NATS at {server}: {e}")))?;
        let js = jetstream::new(client);
        let stream = js
            .get_stream(&config.stream)
            .await
            .map_err(|e| Error::io(format!("NATS stream {:?} at {server}: {e}", config.stream)))?;
        let consumer = stream
            .get_or_create_consumer(
                &config.durable,
                pull::Config {
                    durable_name: Some(config.durable.clone()),
                    filter_subject: format!("{prefix}.>"),
                    ack_policy: jetstream::consumer::AckPolicy::Explicit,
                    ack_wait: Duration::from_millis(config.ack_wait_ms),
                    max_ack_pending: (config.batch * 2) as i64,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| Error::io(format!("NATS consumer {:?} on {:?}: {e}", config.durable, config.stream)))?;
        Ok(NatsSource { consumer, batch: config.batch })
    }

    /// One pull into `inbox` for `consumer_id` (see the module documentation): what the stream
    /// holds now, up to the batch, the request bounded by `wait`. An error fetching, storing or acking is an `Err`; what was stored
    /// stays stored, and what was not acked is redelivered by the broker.
    pub async fn pull(&self, inbox: &dyn Inbox, consumer_id: &str, wait: Duration) -> Result<SourceReport> {
        let mut report = SourceReport::default();
        let mut messages = self
            .consumer
            .fetch()
            .max_messages(self.batch)
            .expires(wait)
            .messages()
            .await
            .map_err(|e| Error::io(format!("NATS fetch: {e}")))?;
        let mut fetched = Vec::new();
        while let Some(message) = messages.next().await {
            fetched.push(message.map_err(|e| Error::io(format!("NATS fetch: {e}")))?);
        }
        report.fetched = fetched.len() as u64;
        if fetched.is_empty() {
            return Ok(report);
        }
        let mut valid = Vec::with_capacity(fetched.len());
        let mut envelopes = Vec::with_capacity(fetched.len());
        for message in fetched {
            match Envelope::parse(&message.payload) {
                Ok(envelope) => {
                    envelopes.push(envelope);
                    valid.push(message);
                }
                Err(error) => {
                    report.rejected += 1;
                    report.reject_reason(format!("{}: not an envelope: {error}", message.subject));
                    message.ack_with(AckKind::Term).await.map_err(|e| Error::io(format!("NATS term: {e}")))?;
                }
            }
        }
        if envelopes.is_empty() {
            return Ok(report);
        }
        let outcomes = inbox.receive(consumer_id, envelopes).await?;
        if outcomes.len() != valid.len() {
            return Err(Error::Invariant(format!("{} outcomes for {} events", outcomes.len(), valid.len())));
        }
        for (message, outcome) in valid.into_iter().zip(outcomes) {
            let kind = match &outcome {
                ReceiveOutcome::Accepted { .. } => {
                    report.accepted += 1;
                    AckKind::Ack
                }
                ReceiveOutcome::Duplicate { .. } => {
                    report.duplicate += 1;
                    AckKind::Ack
                }
                ReceiveOutcome::Conflict { event_id, reason, .. } => {
                    report.rejected += 1;
                    report.reject_reason(format!("{event_id}: conflict: {reason}"));
                    AckKind::Term
                }
                ReceiveOutcome::Expired { event_id, horizon_ms, .. } => {
                    report.rejected += 1;
                    report.reject_reason(format!("{event_id}: expired: older than the horizon of {horizon_ms} ms"));
                    AckKind::Term
                }
            };
            message.ack_with(kind).await.map_err(|e| Error::io(format!("NATS ack: {e}")))?;
        }
        Ok(report)
    }
}
