//! What the lab's runs create on a broker and delete after them, as an operator would: a
//! JetStream stream capturing a relay's subjects, or RabbitMQ topic exchanges each bound (`#`) to
//! a durable quorum queue of its own. tidemark itself never creates either (docs/protocol.md);
//! `bench --relay-to` and `chaos --broker` do, with names unique to their run.

use tidemark_core::{Error, Result};

/// Run `f` with a channel on the RabbitMQ broker at `server` (`host:port`, as `guest`, which
/// RabbitMQ accepts from loopback).
fn with_amqp<T>(
    runtime: &tokio::runtime::Runtime,
    server: &str,
    f: impl AsyncFnOnce(&lapin::Channel) -> std::result::Result<T, lapin::Error>,
) -> Result<T> {
    runtime.block_on(async {
        let uri = format!("amqp://guest:guest@{server}/%2f");
        let connection = lapin::Connection::connect(&uri, lapin::ConnectionProperties::default())
            .await
            .map_err(|e| Error::io(format!("cannot connect to RabbitMQ at {server}: {e}")))?;
        let channel = connection.create_channel().await.map_err(|e| Error::io(format!("RabbitMQ channel: {e}")))?;
        let out = f(&channel).await.map_err(|e| Error::io(format!("RabbitMQ at {server}: {e}")));
        let _ = connection.close(200, "done".into()).await;
        out
    })
}

/// Create the JetStream stream `name` capturing `subjects` on the NATS server at `server`
/// (the server's defaults otherwise: file storage, a duplicate window of two minutes).
pub(crate) fn create_stream(
    runtime: &tokio::runtime::Runtime,
    server: &str,
    name: &str,
    subjects: Vec<String>,
) -> Result<()> {
    runtime.block_on(async {
        let client = async_nats::connect(server)
            .await
            .map_err(|e| Error::io(format!("cannot connect to NATS at {server}: {e}")))?;
        async_nats::jetstream::new(client)
            .create_stream(async_nats::jetstream::stream::Config {
                name: name.to_string(),
                subjects,
                ..Default::default()
            })
            .await
            .map_err(|e| Error::io(format!("cannot create the stream {name}: {e}")))?;
        Ok(())
    })
}

/// Delete the stream `name` (best effort: what a run answers does not depend on it).
pub(crate) fn delete_stream(runtime: &tokio::runtime::Runtime, server: &str, name: &str) {
    let _ = runtime.block_on(async {
        let client = async_nats::connect(server).await.ok()?;
        async_nats::jetstream::new(client).delete_stream(name).await.ok()
    });
}

/// Declare each `(exchange, queue)` pair on the RabbitMQ broker at `server`: a durable topic
/// exchange, a durable quorum queue, the queue bound to the exchange with `#`.
pub(crate) fn declare_routes(
    runtime: &tokio::runtime::Runtime,
    server: &str,
    routes: &[(String, String)],
) -> Result<()> {
    with_amqp(runtime, server, async move |channel| {
        use lapin::types::{AMQPValue, FieldTable, LongString};
        for (exchange, queue) in routes {
            let durable = lapin::options::ExchangeDeclareOptions { durable: true, ..Default::default() };
            let kind = lapin::ExchangeKind::Topic;
            channel.exchange_declare(exchange.as_str().into(), kind, durable, FieldTable::default()).await?;
            let mut arguments = FieldTable::default();
            arguments.insert("x-queue-type".into(), AMQPValue::LongString(LongString::from("quorum")));
            let options = lapin::options::QueueDeclareOptions { durable: true, ..Default::default() };
            channel.queue_declare(queue.as_str().into(), options, arguments).await?;
            let bind = lapin::options::QueueBindOptions::default();
            channel
                .queue_bind(queue.as_str().into(), exchange.as_str().into(), "#".into(), bind, FieldTable::default())
                .await?;
        }
        Ok(())
    })
}

/// Delete the queues and exchanges of [`declare_routes`] (best effort).
pub(crate) fn delete_routes(runtime: &tokio::runtime::Runtime, server: &str, routes: &[(String, String)]) {
    let _ = with_amqp(runtime, server, async move |channel| {
        for (_, queue) in routes {
            channel.queue_delete(queue.as_str().into(), Default::default()).await?;
        }
        for (exchange, _) in routes {
            channel.exchange_delete(exchange.as_str().into(), Default::default()).await?;
        }
        Ok(())
    });
}
