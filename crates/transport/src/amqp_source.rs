//! Consuming a RabbitMQ queue into a tidemark inbox: a consumer with manual acks whose deliveries
//! are acked only after the inbox transaction committed (docs/protocol.md, "Consuming from a
//! broker").
//!
//! The queue is the operator's: [`AmqpSource::connect`] checks that it exists (a passive
//! `queue.declare`, which creates nothing) and never declares, binds or changes a queue or an
//! exchange. Its type (quorum or classic), its delivery limit, its dead-letter exchange and its
//! bindings to the exchange a relay publishes to (`amqp://host/<exchange>`, routing key
//! `<source>.<flow_id>`) are decisions a consumer must not take behind the operator's back, and a
//! declaration whose arguments differ from the existing queue's is a channel error
//! (`PRECONDITION_FAILED`) that would stop the source.
//!
//! The channel's prefetch (`basic.qos`, per consumer) is twice the batch: the broker sends at
//! most that many deliveries not yet acked, so a source holds at most two batches in memory (each
//! body at most the broker's `max_message_size`; anything over the envelope limit is rejected).
//!
//! One pull: wait up to `wait` for a first delivery, then take what the client already holds, up
//! to the batch (a pull never waits for more); parse each body as an envelope; store the valid
//! ones in one inbox call; then answer the broker per delivery: `accepted` and `duplicate` (a
//! redelivery: the inbox already holds it) are acked; a body that is not an envelope, and an
//! envelope the inbox refuses (`conflict`, `expired`), are rejected with `requeue=false`
//! (`basic.reject`: the broker drops it, or moves it to the queue's dead-letter exchange when it
//! has one) and counted `rejected` with the reason, so a poison message never loops.
//!
//! When the inbox call fails, nothing is acked: the valid deliveries are returned to the queue
//! (`basic.nack`, `requeue=true`), and a process that dies between the inbox commit and the acks
//! leaves them unacked, which the broker returns to the queue when the connection closes. Either
//! way they come back and the inbox answers `duplicate` for what it had stored. **A source whose
//! pull failed (or was dropped before it finished) is unusable**: its channel may hold deliveries
//! it never answered, which the broker would count against the prefetch until the channel
//! closes, so every later pull is an error and the caller connects anew (dropping the source
//! closes its connection, which returns them).
//!
//! RabbitMQ keeps a queue's order for one consumer, except that a returned delivery may be
//! delivered again behind later ones; events of a flow that arrive out of order wait in the inbox
//! as a `gap` until the missing seq arrives, as they do from any relay. Consumers of one queue
//! share its messages round-robin: all of them must store into one inbox.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions, QueueDeclareOptions,
};
use lapin::types::{FieldTable, ShortString};
use lapin::{Channel, Connection, ConnectionProperties, Consumer};
use serde::Serialize;
use tidemark_core::endpoint::Endpoint;
use tidemark_core::error::codes;
use tidemark_core::store::ReceiveOutcome;
use tidemark_core::{Envelope, Error, Result};

use crate::source::{Inbox, SourceReport};
use crate::TransportConfig;

/// Deliveries per pull, at most.
const AMQP_SOURCE_BATCH_MAX: usize = 1_000;
/// The prefetch (`basic.qos` count) in batches: the broker sends at most this many batches of
/// deliveries not yet acked.
const PREFETCH_BATCHES: usize = 2;
/// The longest consumer tag accepted (an AMQP short string).
const CONSUMER_TAG_BYTES_MAX: usize = 255;

/// Where to consume from: a RabbitMQ queue on the default virtual host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AmqpSourceConfig {
    /// `amqp://host[:port]/<queue>` (port 5672 when not given): the broker and the queue on its
    /// default virtual host `/` (1..=255 of A-Z a-z 0-9 `_` `-` `.`). The queue is the
    /// operator's, bound to the exchange a relay publishes to; never declared here.
    pub from: String,
    /// The consumer tag this source consumes under, as the broker's management shows it
    /// (1..=255 of A-Z a-z 0-9 `_` `-` `.` `:`).
    pub consumer_tag: String,
    /// Deliveries per pull (1..=1,000); twice this is the channel's prefetch.
    pub batch: usize,
}

impl AmqpSourceConfig {
    /// Check the configuration: `invalid_config` for anything out of range. Answers the broker
    /// (`host:port`) and the queue.
    pub fn validate(&self) -> Result<(String, String)> {
        let bad = |why: String| Error::invalid(codes::INVALID_CONFIG, why);
        let Endpoint::Amqp { server, exchange: queue } = crate::source::parse_from(&self.from)? else {
            return Err(bad(format!("source from {:?} is not an amqp:// queue", self.from)));
        };
        let ok_char = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':');
        let tag = &self.consumer_tag;
        if tag.is_empty() || tag.len() > CONSUMER_TAG_BYTES_MAX || !tag.bytes().all(ok_char) {
            return Err(bad(format!(
                "source consumer tag (durable) {tag:?} must be 1..={CONSUMER_TAG_BYTES_MAX} of A-Z a-z 0-9 _ - . :"
            )));
        }
        if !(1..=AMQP_SOURCE_BATCH_MAX).contains(&self.batch) {
            return Err(bad(format!("source batch must be 1..={AMQP_SOURCE_BATCH_MAX}, got {}", self.batch)));
        }
        Ok((server, queue))
    }

    /// The channel's prefetch: the most deliveries the broker sends before some are acked.
    pub fn prefetch(&self) -> u16 {
        // At most 2,000 for a valid batch: always a u16.
        u16::try_from(self.batch * PREFETCH_BATCHES).unwrap_or(u16::MAX)
    }
}

/// A connected consumer of one RabbitMQ queue.
pub struct AmqpSource {
    // Kept so that the connection lives as long as the source; dropping it closes the connection.
    _connection: Connection,
    channel: Channel,
    consumer: tokio::sync::Mutex<Consumer>,
    server: String,
    queue: String,
    batch: usize,
    /// How long an ack, reject or nack may take to be handed to the connection (the transport's
    /// connect timeout): past it the link is taken for dead and the pull fails.
    settle_timeout: Duration,
    /// Set when a pull starts and cleared when it finished well: a pull that failed or was dropped
    /// leaves it set (see the module documentation).
    unusable: AtomicBool,
}

impl AmqpSource {
    /// Connect to the broker with the credentials `transport` has for it
    /// ([`TransportConfig::amqp_credentials`], `guest:guest` when none), within its connect
    /// timeout: open a channel, set its prefetch, check that the queue exists (never declared
    /// here) and start consuming it with manual acks.
    pub async fn connect(config: &AmqpSourceConfig, transport: &TransportConfig) -> Result<AmqpSource> {
        let (server, queue) = config.validate()?;
        let (user, password) = transport.amqp_credentials(&server)?;
        let uri = crate::amqp::broker_uri(&server, &user, &password, transport.connect_timeout)?;
        let failed =
            |e: &dyn std::fmt::Display| Error::io(format!("cannot connect to RabbitMQ at {server} as {user}: {e}"));
        let connecting = async {
            let connection =
                Connection::connect_uri(uri, ConnectionProperties::default()).await.map_err(|e| failed(&e))?;
            let channel = connection.create_channel().await.map_err(|e| failed(&e))?;
            channel.basic_qos(config.prefetch(), BasicQosOptions { global: false }).await.map_err(|e| failed(&e))?;
            let passive = QueueDeclareOptions { passive: true, ..Default::default() };
            channel.queue_declare(ShortString::from(queue.as_str()), passive, FieldTable::default()).await.map_err(
                |e| {
                    Error::io(format!(
                        "RabbitMQ at {server} has no queue {queue:?} on the virtual host / ({e}; queues are the \
                         operator's, never declared here)"
                    ))
                },
            )?;
            let consumer = channel
                .basic_consume(
                    ShortString::from(queue.as_str()),
                    ShortString::from(config.consumer_tag.as_str()),
                    BasicConsumeOptions { no_ack: false, ..Default::default() },
                    FieldTable::default(),
                )
                .await
                .map_err(|e| Error::io(format!("RabbitMQ consume of queue {queue:?} at {server}: {e}")))?;
            Ok::<_, Error>((connection, channel, consumer))
        };
        let (connection, channel, consumer) = tokio::time::timeout(transport.connect_timeout, connecting)
            .await
            .map_err(|_| failed(&format!("no answer within {} ms", transport.connect_timeout.as_millis())))??;
        Ok(AmqpSource {
            _connection: connection,
            channel,
            consumer: tokio::sync::Mutex::new(consumer),
            server,
            queue,
            batch: config.batch,
            settle_timeout: transport.connect_timeout,
            unusable: AtomicBool::new(false),
        })
    }

    /// One pull into `inbox` for `consumer_id` (see the module documentation), waiting at most
    /// `wait` for a first delivery. An error reading, storing or acking is an `Err`; what was
    /// stored stays stored, what was not acked comes back, and the source is unusable from then
    /// on: connect anew.
    pub async fn pull(&self, inbox: &dyn Inbox, consumer_id: &str, wait: Duration) -> Result<SourceReport> {
        if self.unusable.swap(true, Ordering::SeqCst) {
            return Err(Error::io(format!(
                "this RabbitMQ consumer of queue {} failed or was interrupted in an earlier pull, so its channel may \
                 hold deliveries it never answered: connect anew",
                self.queue
            )));
        }
        let report = self.pull_once(inbox, consumer_id, wait).await?;
        self.unusable.store(false, Ordering::SeqCst);
        Ok(report)
    }

    async fn pull_once(&self, inbox: &dyn Inbox, consumer_id: &str, wait: Duration) -> Result<SourceReport> {
        let mut report = SourceReport::default();
        let deliveries = self.take(wait).await?;
        report.fetched = deliveries.len() as u64;
        let mut valid = Vec::with_capacity(deliveries.len());
        let mut envelopes = Vec::with_capacity(deliveries.len());
        for delivery in deliveries {
            match Envelope::parse(&delivery.data) {
                Ok(envelope) => {
                    envelopes.push(envelope);
                    valid.push(delivery);
                }
                Err(error) => {
                    report.rejected += 1;
                    report.reject_reason(format!("{}: not an envelope: {error}", self.name(&delivery)));
                    self.settle(&delivery, Settle::Reject).await?;
                }
            }
        }
        if envelopes.is_empty() {
            return Ok(report);
        }
        let outcomes = match inbox.receive(consumer_id, envelopes).await {
            Ok(outcomes) => outcomes,
            Err(error) => {
                // Back to the queue at once (best effort: were the channel gone, the broker
                // returns them when it closes). The inbox answers duplicate for what it stored.
                for delivery in &valid {
                    let _ = self.settle(delivery, Settle::Requeue).await;
                }
                return Err(error);
            }
        };
        if outcomes.len() != valid.len() {
            return Err(Error::Invariant(format!("{} outcomes for {} events", outcomes.len(), valid.len())));
        }
        for (delivery, outcome) in valid.iter().zip(outcomes) {
            let settle = match outcome {
                ReceiveOutcome::Accepted { .. } => {
                    report.accepted += 1;
                    Settle::Ack
                }
                ReceiveOutcome::Duplicate { .. } => {
                    report.duplicate += 1;
                    Settle::Ack
                }
                ReceiveOutcome::Conflict { event_id, reason, .. } => {
                    report.rejected += 1;
                    report.reject_reason(format!("{event_id}: conflict: {reason}"));
                    Settle::Reject
                }
                ReceiveOutcome::Expired { event_id, horizon_ms, .. } => {
                    report.rejected += 1;
                    report.reject_reason(format!("{event_id}: expired: older than the horizon of {horizon_ms} ms"));
                    Settle::Reject
                }
            };
            self.settle(delivery, settle).await?;
        }
        Ok(report)
    }

    /// Up to a batch of deliveries: the first within `wait` (none when nothing came), then what
    /// the client already holds.
    async fn take(&self, wait: Duration) -> Result<Vec<Delivery>> {
        let mut consumer = self.consumer.lock().await;
        let mut deliveries = Vec::with_capacity(self.batch);
        match tokio::time::timeout(wait, consumer.next()).await {
            Err(_nothing_within_wait) => return Ok(deliveries),
            Ok(next) => deliveries.push(self.delivered(next)?),
        }
        // A zero timeout polls once: the batch never waits for more.
        while deliveries.len() < self.batch {
            match tokio::time::timeout(Duration::ZERO, consumer.next()).await {
                Err(_none_ready) => break,
                Ok(next) => deliveries.push(self.delivered(next)?),
            }
        }
        Ok(deliveries)
    }

    fn delivered(&self, next: Option<lapin::Result<Delivery>>) -> Result<Delivery> {
        match next {
            Some(Ok(delivery)) => Ok(delivery),
            Some(Err(e)) => Err(Error::io(format!("RabbitMQ read of queue {} at {}: {e}", self.queue, self.server))),
            None => Err(Error::io(format!(
                "RabbitMQ cancelled the consumer of queue {} at {} (the queue was deleted, or the channel closed)",
                self.queue, self.server
            ))),
        }
    }

    /// How a delivery is named in a reason: the queue, the delivery tag, and the message id when
    /// the publisher set one (a tidemark relay sets the event id).
    fn name(&self, delivery: &Delivery) -> String {
        match delivery.properties.message_id() {
            Some(id) => format!("{}#{} (message {})", self.queue, delivery.delivery_tag, id.as_str()),
            None => format!("{}#{}", self.queue, delivery.delivery_tag),
        }
    }

    /// Answer `delivery`, within [`AmqpSource::settle_timeout`]: an answer lapin never hands to
    /// its connection (one that broke while the answer waited) fails the pull instead of holding
    /// the source forever (seen in the chaos harness: a partition's flap left a source that
    /// pulled nothing until its server was killed).
    async fn settle(&self, delivery: &Delivery, settle: Settle) -> Result<()> {
        let what = settle.verb();
        let answer = async {
            match settle {
                Settle::Ack => delivery.acker.ack(BasicAckOptions { multiple: false }).await,
                Settle::Reject => delivery.acker.reject(BasicRejectOptions { requeue: false }).await,
                Settle::Requeue => delivery.acker.nack(BasicNackOptions { multiple: false, requeue: true }).await,
            }
        };
        let Ok(answered) = tokio::time::timeout(self.settle_timeout, answer).await else {
            return Err(Error::io(format!(
                "RabbitMQ {what} of {}: not handed to the connection within {} ms (the broker returns the delivery \
                 to the queue when the connection closes)",
                self.name(delivery),
                self.settle_timeout.as_millis()
            )));
        };
        match answered {
            Ok(true) => Ok(()),
            // The acker is single-use, and poisoned once its channel closed.
            Ok(false) => Err(Error::io(format!(
                "RabbitMQ {what} of {}: the channel closed first (the broker returns the delivery to the queue)",
                self.name(delivery)
            ))),
            Err(e) => Err(Error::io(format!("RabbitMQ {what} of {}: {e}", self.name(delivery)))),
        }
    }

    /// True when the queue holds no message ready for delivery (a passive `queue.declare`'s
    /// message count): after a pull that found nothing, what `tidemark consume --until-idle`
    /// waits for. Messages other consumers hold unacked are not counted.
    pub async fn caught_up(&self) -> Result<bool> {
        let passive = QueueDeclareOptions { passive: true, ..Default::default() };
        let queue = self
            .channel
            .queue_declare(ShortString::from(self.queue.as_str()), passive, FieldTable::default())
            .await
            .map_err(|e| Error::io(format!("RabbitMQ queue {:?} at {}: {e}", self.queue, self.server)))?;
        Ok(queue.message_count() == 0)
    }
}

/// What a delivery is answered with.
#[derive(Clone, Copy)]
enum Settle {
    /// Stored (or already held): the broker forgets it.
    Ack,
    /// Never to be stored: dropped or dead-lettered, never redelivered.
    Reject,
    /// Not stored this time: back to the queue, delivered again.
    Requeue,
}

impl Settle {
    /// The AMQP method that answers so, as errors name it.
    fn verb(self) -> &'static str {
        match self {
            Settle::Ack => "ack",
            Settle::Reject => "reject",
            Settle::Requeue => "nack",
        }
    }
}
