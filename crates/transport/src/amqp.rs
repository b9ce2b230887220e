//! RabbitMQ (AMQP 0-9-1): publish each event to the endpoint's exchange on a channel in
//! publisher-confirm mode, `mandatory`, as a persistent message, and await the confirms in order.
//!
//! Custody: an event is `accepted` only when the broker acked its publish (for a persistent
//! message routed to durable or quorum queues, RabbitMQ confirms once every queue it was routed
//! to has it on disk, or, for a quorum queue, once a majority of its replicas has) **and** the
//! broker did not return it as unroutable. With `mandatory`, a message no queue is bound for is
//! returned (`basic.return`, `NO_ROUTE`) before its ack: that is a failed delivery with the reason
//! "unroutable", never an `accepted`. A nack, a channel the broker closed (a missing exchange is
//! channel error 404), a broken connection or an unreachable broker fail the delivery with their
//! reason, and the lane drops the transport so that its next attempt connects again.
//!
//! RabbitMQ has no per-message deduplication: a redelivery (after a timeout, a crash of the relay
//! before it recorded the verdict, or a failed batch whose first events were confirmed) is
//! published again and answered `accepted` again. The consuming side's inbox, which dedups by
//! event id and content hash for its whole retention horizon, is what keeps each event applied
//! once; `message_id` carries the event id for consumers of other kinds to dedup by.
//!
//! Routing key: `<source>.<flow_id>`, with every `.` inside the source and the flow id written as
//! `_` (so each is one word for topic bindings such as `shop_eu.*`; the envelope and the headers
//! keep the real ids). The body is the envelope's JSON (`content_type` `application/json`,
//! `delivery_mode` 2, `message_id` = the event id); headers carry `tidemark-source`,
//! `tidemark-flow`, `tidemark-generation` and `tidemark-content-hash` (long strings) and
//! `tidemark-seq` (a signed 64-bit integer).
//!
//! Connection: `amqp://host:port` on the default virtual host `/`, without TLS, with the
//! credentials [`TransportConfig::amqp_credentials`] names for `host:port` (`guest:guest` when
//! none is configured, which RabbitMQ accepts from loopback only).

use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::uri::{AMQPAuthority, AMQPQueryString, AMQPScheme, AMQPUri, AMQPUserInfo};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use tidemark_core::endpoint::EndpointKind;
use tidemark_core::error::codes;
use tidemark_core::store::ReceiveOutcome;
use tidemark_core::{Envelope, Error, Result};
use tokio::sync::OnceCell;

use crate::{Delivered, Transport, TransportConfig};

/// The longest routing key AMQP 0-9-1 carries (a short string).
const ROUTING_KEY_BYTES_MAX: usize = 255;

/// The heartbeat timeout asked of RabbitMQ, in seconds (the broker proposes 60). A connection
/// on which nothing arrived for twice this long is closed by the client (and by the broker from
/// its side), so a link that went silent (a black hole, a half-open TCP connection, a stream
/// whose frames were lost) fails within 10 s instead of 2 minutes: a consumer whose prefetch
/// window was taken by deliveries it never received connects anew, and the broker gives those
/// deliveries to it again. RabbitMQ advises 5 to 20 s; below 5 s busy hosts see false alarms.
pub(crate) const HEARTBEAT_S: u16 = 5;

/// The URI of the broker `server` (`host:port`) on the default virtual host `/`, without TLS, as
/// `user`; `invalid_endpoint` when `server` is not `host:port`. Shared by [`AmqpTransport`] and
/// the consuming side, [`crate::AmqpSource`].
pub(crate) fn broker_uri(server: &str, user: &str, password: &str, connect_timeout: Duration) -> Result<AMQPUri> {
    let (host, port) = server
        .rsplit_once(':')
        .and_then(|(host, port)| Some((host.trim_start_matches('[').trim_end_matches(']'), port.parse().ok()?)))
        .ok_or_else(|| Error::invalid(codes::INVALID_ENDPOINT, format!("{server} is not host:port")))?;
    Ok(AMQPUri {
        scheme: AMQPScheme::AMQP,
        authority: AMQPAuthority {
            userinfo: AMQPUserInfo { username: user.to_string(), password: password.to_string() },
            host: host.to_string(),
            port,
        },
        vhost: "/".to_string(),
        query: AMQPQueryString {
            connection_timeout: Some(connect_timeout.as_millis() as u64),
            heartbeat: Some(HEARTBEAT_S),
            ..Default::default()
        },
    })
}

/// A confirmed publisher to one `amqp://host:port/<exchange>` endpoint, connected on first use.
pub struct AmqpTransport {
    server: String,
    exchange: String,
    user: String,
    password: String,
    connect_timeout: Duration,
    connected: OnceCell<(Connection, Channel)>,
}

/// The routing key an event is published with.
pub fn routing_key(envelope: &Envelope) -> String {
    format!("{}.{}", envelope.source.replace('.', "_"), envelope.flow_id.replace('.', "_"))
}

impl AmqpTransport {
    /// A publisher to the exchange `exchange` of the broker `host:port`, with the credentials
    /// `config` has for it. `invalid_config` when they name an environment variable that is not
    /// set or is not `user:password`.
    pub fn new(server: &str, exchange: &str, config: &TransportConfig) -> Result<AmqpTransport> {
        let (user, password) = config.amqp_credentials(server)?;
        Ok(AmqpTransport {
            server: server.to_string(),
            exchange: exchange.to_string(),
            user,
            password,
            connect_timeout: config.connect_timeout,
            connected: OnceCell::new(),
        })
    }

    fn uri(&self) -> Result<AMQPUri> {
        broker_uri(&self.server, &self.user, &self.password, self.connect_timeout)
    }

    async fn channel(&self) -> Result<&Channel> {
        let (_, channel) = self
            .connected
            .get_or_try_init(|| async {
                let uri = self.uri()?;
                let failed = |e: &dyn std::fmt::Display| {
                    Error::io(format!("cannot connect to RabbitMQ at {} as {}: {e}", self.server, self.user))
                };
                let connecting = async {
                    let connection =
                        Connection::connect_uri(uri, ConnectionProperties::default()).await.map_err(|e| failed(&e))?;
                    let channel = connection.create_channel().await.map_err(|e| failed(&e))?;
                    channel.confirm_select(ConfirmSelectOptions::default()).await.map_err(|e| failed(&e))?;
                    Ok::<_, Error>((connection, channel))
                };
                tokio::time::timeout(self.connect_timeout, connecting)
                    .await
                    .map_err(|_| failed(&format!("no answer within {} ms", self.connect_timeout.as_millis())))?
            })
            .await?;
        Ok(channel)
    }

    fn properties(envelope: &Envelope) -> BasicProperties {
        let mut headers = FieldTable::default();
        let text = |s: &str| AMQPValue::LongString(LongString::from(s));
        headers.insert("tidemark-source".into(), text(&envelope.source));
        headers.insert("tidemark-flow".into(), text(&envelope.flow_id));
        headers.insert("tidemark-seq".into(), AMQPValue::LongLongInt(envelope.seq));
        headers.insert("tidemark-generation".into(), text(&envelope.generation));
        headers.insert("tidemark-content-hash".into(), text(&envelope.content_hash()));
        if let Some(traceparent) = &envelope.traceparent {
            headers.insert("traceparent".into(), text(traceparent));
        }
        BasicProperties::default()
            .with_message_id(ShortString::from(envelope.event_id.as_str()))
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_headers(headers)
    }

    async fn publish(&self, items: &[(String, Envelope)]) -> Result<Vec<ReceiveOutcome>> {
        let channel = self.channel().await?;
        let exchange = &self.exchange;
        // Every publish is sent before any confirm is awaited (pipelined on the one channel, in
        // order), then the confirms are read in order.
        let mut pending = Vec::with_capacity(items.len());
        for (_, envelope) in items {
            let key = routing_key(envelope);
            if key.len() > ROUTING_KEY_BYTES_MAX {
                return Err(Error::invalid(
                    codes::INVALID_ID,
                    format!("routing key {key:?} is longer than AMQP's {ROUTING_KEY_BYTES_MAX} bytes"),
                ));
            }
            let body = serde_json::to_vec(envelope).map_err(|e| Error::Invariant(e.to_string()))?;
            let confirm = channel
                .basic_publish(
                    ShortString::from(exchange.as_str()),
                    ShortString::from(key.as_str()),
                    BasicPublishOptions { mandatory: true, immediate: false },
                    &body,
                    Self::properties(envelope),
                )
                .await
                .map_err(|e| Error::io(format!("RabbitMQ publish to exchange {exchange}: {e}")))?;
            pending.push((key, confirm));
        }
        let mut outcomes = Vec::with_capacity(items.len());
        for ((consumer_id, envelope), (key, confirm)) in items.iter().zip(pending) {
            let answer = confirm.await.map_err(|e| {
                Error::io(format!("RabbitMQ publish of {} to exchange {exchange}: no confirm: {e}", envelope.event_id))
            })?;
            match answer {
                Confirmation::Ack(None) => outcomes.push(ReceiveOutcome::Accepted {
                    consumer_id: consumer_id.clone(),
                    event_id: envelope.event_id.clone(),
                }),
                // The returned message rides on whichever confirm the client resolved after the
                // return (a `multiple` ack resolves several at once): it names its own event and
                // routing key, and any return fails the whole batch.
                Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned)) => {
                    let id = returned.delivery.properties.message_id().as_ref().map(|id| id.to_string());
                    return Err(Error::io(format!(
                        "unroutable: no queue bound to exchange {exchange} for routing key {} (event {}; the \
                         broker returned it: {} {})",
                        returned.delivery.routing_key,
                        id.unwrap_or_else(|| envelope.event_id.clone()),
                        returned.reply_code,
                        returned.reply_text
                    )));
                }
                Confirmation::Nack(None) => {
                    return Err(Error::io(format!(
                        "RabbitMQ refused (nacked) the publish of {} to exchange {exchange} with routing key {key}",
                        envelope.event_id
                    )))
                }
                Confirmation::NotRequested => {
                    return Err(Error::Invariant("the AMQP channel is not in publisher-confirm mode".into()))
                }
            }
        }
        Ok(outcomes)
    }
}

impl Transport for AmqpTransport {
    fn kind(&self) -> EndpointKind {
        EndpointKind::Amqp
    }

    fn deliver<'a>(&'a self, items: &'a [(String, Envelope)]) -> Delivered<'a> {
        Box::pin(self.publish(items))
    }
}
