//! NATS JetStream: publish each event with `Nats-Msg-Id` = its event id and await the stream's
//! PubAck.
//!
//! Custody: the PubAck says the stream stored the message (with the stream's own replication and
//! `sync` settings); a PubAck with `duplicate` means the stream already held a message with that
//! id within its duplicate window (`duplicate_window`, two minutes by default), and counts as
//! `duplicate`. A redelivery after the window is stored again: the consuming side's inbox, which
//! dedups by event id for its whole retention horizon, is what keeps it applied once. A subject no
//! stream captures gets no PubAck (`no responders`): a failed delivery with that reason, never an
//! `accepted`.
//!
//! Subject: `<prefix>.<source>.<flow_id>`, with every `.` inside the source and the flow id
//! written as `_` (so each is one subject token; the envelope keeps the real ids). The payload is
//! the envelope's JSON; headers carry `Tidemark-Source`, `Tidemark-Flow`, `Tidemark-Seq`,
//! `Tidemark-Generation` and `Tidemark-Content-Hash`.

use std::time::Duration;

use async_nats::jetstream;
use tidemark_core::endpoint::EndpointKind;
use tidemark_core::store::ReceiveOutcome;
use tidemark_core::{Envelope, Error, Result};
use tokio::sync::OnceCell;

use crate::{Delivered, Transport, TransportConfig};

/// A JetStream publisher for one `nats://host:port/<prefix>` endpoint, connected on first use.
pub struct NatsTransport {
    server: String,
    prefix: String,
    connect_timeout: Duration,
    context: OnceCell<jetstream::Context>,
}

/// The subject an event is published to.
pub fn subject(prefix: &str, envelope: &Envelope) -> String {
    format!("{prefix}.{}.{}", envelope.source.replace('.', "_"), envelope.flow_id.replace('.', "_"))
}

impl NatsTransport {
    /// A publisher to the server `host:port` under the subject prefix `prefix`.
    pub fn new(server: &str, prefix: &str, config: &TransportConfig) -> NatsTransport {
        NatsTransport {
            server: server.to_string(),
            prefix: prefix.to_string(),
            connect_timeout: config.connect_timeout,
            context: OnceCell::new(),
        }
    }

    async fn context(&self) -> Result<&jetstream::Context> {
        self.context
            .get_or_try_init(|| async {
                let client = async_nats::ConnectOptions::new()
                    .connection_timeout(self.connect_timeout)
                    .connect(self.server.as_str())
                    .await
                    .map_err(|e| Error::io(format!("cannot connect to NATS at {}: {e}", self.server)))?;
                Ok::<_, Error>(jetstream::new(client))
            })
            .await
    }

    async fn publish(&self, items: &[(String, Envelope)]) -> Result<Vec<ReceiveOutcome>> {
        let context = self.context().await?;
        // Every publish is sent before any PubAck is awaited (pipelined on the one connection, in
        // order), then the acks are read in order.
        let mut pending = Vec::with_capacity(items.len());
        for (_, envelope) in items {
            let payload = serde_json::to_vec(envelope).map_err(|e| Error::Invariant(e.to_string()))?;
            let mut publish = jetstream::context::Publish::build()
                .payload(bytes::Bytes::from(payload))
                .message_id(&envelope.event_id)
                .header("Tidemark-Source", envelope.source.as_str())
                .header("Tidemark-Flow", envelope.flow_id.as_str())
                .header("Tidemark-Seq", envelope.seq.to_string().as_str())
                .header("Tidemark-Generation", envelope.generation.as_str())
                .header("Tidemark-Content-Hash", envelope.content_hash().as_str());
            // The W3C trace context also as the header messaging tools read it (the body's
            // envelope carries it for the receiving inbox).
            if let Some(traceparent) = &envelope.traceparent {
                publish = publish.header("traceparent", traceparent.as_str());
            }
            let subject = subject(&self.prefix, envelope);
            let ack = context
                .send_publish(subject.clone(), publish)
                .await
                .map_err(|e| Error::io(format!("NATS publish to {subject}: {e}")))?;
            pending.push((subject, ack));
        }
        let mut outcomes = Vec::with_capacity(items.len());
        for ((consumer_id, envelope), (subject, ack)) in items.iter().zip(pending) {
            let ack = ack.await.map_err(|e| Error::io(format!("NATS publish to {subject}: no PubAck: {e}")))?;
            let (consumer_id, event_id) = (consumer_id.clone(), envelope.event_id.clone());
            outcomes.push(if ack.duplicate {
                ReceiveOutcome::Duplicate { consumer_id, event_id }
            } else {
                ReceiveOutcome::Accepted { consumer_id, event_id }
            });
        }
        Ok(outcomes)
    }
}

impl Transport for NatsTransport {
    fn kind(&self) -> EndpointKind {
        EndpointKind::Nats
    }

    fn deliver<'a>(&'a self, items: &'a [(String, Envelope)]) -> Delivered<'a> {
        Box::pin(self.publish(items))
    }
}
