//! The RabbitMQ transport against the real broker on this machine (127.0.0.1:5672 as guest, or
//! `TIDEMARK_TEST_AMQP` = `host:port`): skipped, with the reason printed, when none answers. Each
//! test declares its own exchanges and queues under unique names and deletes them at the end.

use std::time::Duration;

use lapin::options::{
    BasicGetOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use serde_json::json;
use tidemark_core::store::ReceiveOutcome;
use tidemark_core::Envelope;
use tidemark_transport::{amqp_routing_key, connect, TransportConfig};

fn server() -> String {
    std::env::var("TIDEMARK_TEST_AMQP").unwrap_or_else(|_| "127.0.0.1:5672".to_string())
}

/// A channel of our own to set up and inspect the broker, or `None` (skipped) when none answers.
async fn channel_or_skip() -> Option<(Connection, Channel)> {
    let uri = format!("amqp://guest:guest@{}/%2f", server());
    let connected = tokio::time::timeout(Duration::from_secs(5), async {
        let connection = Connection::connect(&uri, ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        Ok::<_, lapin::Error>((connection, channel))
    })
    .await;
    match connected {
        Ok(Ok(pair)) => Some(pair),
        Ok(Err(e)) => {
            println!("skipped: RabbitMQ not reachable at {}: {e}", server());
            None
        }
        Err(_) => {
            println!("skipped: RabbitMQ not reachable at {}: no answer within 5 s", server());
            None
        }
    }
}

fn envelope(flow: &str, seq: i64) -> Envelope {
    Envelope {
        event_id: format!("{flow}-{seq}-{}", std::process::id()),
        source: "shop.eu".into(),
        generation: "g1".into(),
        flow_id: flow.into(),
        seq,
        event_type: "parcel.noted".into(),
        schema_version: 1,
        payload: json!({"seq": seq}),
        created_at_ms: 1,
    }
}

fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    format!("{prefix}{}x{nanos}", std::process::id())
}

async fn declare_exchange(channel: &Channel, name: &str) {
    let options = ExchangeDeclareOptions { durable: true, ..Default::default() };
    channel.exchange_declare(name.into(), ExchangeKind::Topic, options, FieldTable::default()).await.unwrap();
}

/// A durable quorum queue bound to `exchange` for every routing key.
async fn declare_quorum_queue(channel: &Channel, name: &str, exchange: &str) {
    let mut arguments = FieldTable::default();
    arguments.insert("x-queue-type".into(), AMQPValue::LongString(LongString::from("quorum")));
    let options = QueueDeclareOptions { durable: true, ..Default::default() };
    channel.queue_declare(name.into(), options, arguments).await.unwrap();
    channel
        .queue_bind(name.into(), exchange.into(), "#".into(), QueueBindOptions::default(), FieldTable::default())
        .await
        .unwrap();
}

/// Run `body`, then delete `exchanges` and `queues` whether it passed or panicked (the broker is
/// shared), then pass its panic on.
async fn delete_after(
    channel: &Channel,
    exchanges: &[&str],
    queues: &[&str],
    body: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let outcome = tokio::spawn(body).await;
    for queue in queues {
        let _ = channel.queue_delete((*queue).into(), QueueDeleteOptions::default()).await;
    }
    for exchange in exchanges {
        let _ = channel.exchange_delete((*exchange).into(), ExchangeDeleteOptions::default()).await;
    }
    if let Err(error) = outcome {
        std::panic::resume_unwind(error.into_panic());
    }
}

fn header(properties: &lapin::BasicProperties, name: &str) -> Option<AMQPValue> {
    properties.headers().as_ref().and_then(|h| h.inner().get(name).cloned())
}

fn text(value: Option<AMQPValue>) -> Option<String> {
    match value {
        Some(AMQPValue::LongString(s)) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        _ => None,
    }
}

#[tokio::test]
async fn confirmed_publishes_are_routed_persistent_and_in_order_and_published_again_on_redelivery() {
    let Some((_connection, channel)) = channel_or_skip().await else { return };
    let channel_for_body = channel.clone();
    let (exchange, queue) = (unique("tmktest.x"), unique("tmktest.q"));
    let (x, q) = (exchange.clone(), queue.clone());
    let body = async move {
        let (exchange, queue, channel) = (x, q, channel_for_body);
        declare_exchange(&channel, &exchange).await;
        declare_quorum_queue(&channel, &queue, &exchange).await;

        let transport = connect(&format!("amqp://{}/{exchange}", server()), &TransportConfig::default()).unwrap();
        let items: Vec<(String, Envelope)> =
            [("order.7", 1), ("order.7", 2), ("order-8", 1), ("order.7", 3), ("order-8", 2)]
                .into_iter()
                .map(|(flow, seq)| ("audit".to_string(), envelope(flow, seq)))
                .collect();
        let first = transport.deliver(&items).await.expect("published");
        assert_eq!(first.len(), items.len());
        for ((consumer_id, sent), outcome) in items.iter().zip(&first) {
            let expected =
                ReceiveOutcome::Accepted { consumer_id: consumer_id.clone(), event_id: sent.event_id.clone() };
            assert_eq!(outcome, &expected);
        }

        // In order, on the documented routing keys, with the envelope, its id, headers and persistence.
        for (_, sent) in &items {
            let got = channel.basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true }).await.unwrap();
            let delivery = got.expect("a message for every event").delivery;
            assert_eq!(delivery.exchange.as_str(), exchange);
            assert_eq!(delivery.routing_key.as_str(), amqp_routing_key(sent));
            let stored: Envelope = serde_json::from_slice(&delivery.data).unwrap();
            assert_eq!(&stored, sent);
            let properties = &delivery.properties;
            assert_eq!(properties.message_id().as_ref().map(|s| s.to_string()), Some(sent.event_id.clone()));
            assert_eq!(properties.content_type().as_ref().map(|s| s.to_string()), Some("application/json".into()));
            assert_eq!(properties.delivery_mode(), &Some(2), "persistent");
            assert_eq!(text(header(properties, "tidemark-source")), Some(sent.source.clone()));
            assert_eq!(text(header(properties, "tidemark-flow")), Some(sent.flow_id.clone()));
            assert_eq!(header(properties, "tidemark-seq"), Some(AMQPValue::LongLongInt(sent.seq)));
            assert_eq!(text(header(properties, "tidemark-generation")), Some(sent.generation.clone()));
            assert_eq!(text(header(properties, "tidemark-content-hash")), Some(sent.content_hash()));
        }
        let rest = channel.basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true }).await.unwrap();
        assert!(rest.is_none(), "each event once");
        assert_eq!(amqp_routing_key(&items[0].1), "shop_eu.order_7");

        // No dedup on RabbitMQ: a redelivery is published (and accepted) again.
        let again = transport.deliver(&items[..2]).await.expect("published again");
        assert!(again.iter().all(|o| matches!(o, ReceiveOutcome::Accepted { .. })), "{again:?}");
        let mut ids = Vec::new();
        while let Some(got) = channel.basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true }).await.unwrap()
        {
            ids.push(got.delivery.properties.message_id().as_ref().unwrap().to_string());
        }
        assert_eq!(ids, [items[0].1.event_id.clone(), items[1].1.event_id.clone()]);
    };
    delete_after(&channel, &[&exchange], &[&queue], body).await;
}

#[tokio::test]
async fn an_unroutable_publish_is_a_failed_delivery_that_names_the_exchange_and_routing_key() {
    let Some((_connection, channel)) = channel_or_skip().await else { return };
    let channel_for_body = channel.clone();
    let (exchange, queue) = (unique("tmktest.lonely"), unique("tmktest.q"));
    let (x, q) = (exchange.clone(), queue.clone());
    let body = async move {
        let (exchange, queue, channel) = (x, q, channel_for_body);
        declare_exchange(&channel, &exchange).await;
        let transport = connect(&format!("amqp://{}/{exchange}", server()), &TransportConfig::default()).unwrap();
        let items = vec![("audit".to_string(), envelope("order.9", 1)), ("audit".to_string(), envelope("order.9", 2))];
        let error = transport.deliver(&items).await.expect_err("no queue is bound: never accepted");
        let message = error.to_string();
        assert!(message.contains("unroutable"), "{message}");
        assert!(message.contains(&exchange) && message.contains("shop_eu.order_9"), "{message}");

        // One unroutable event fails its whole batch, though the broker took the routed one (the
        // retry publishes it again: no dedup on RabbitMQ, the consuming inbox dedups); the
        // channel stays usable.
        let mut arguments = FieldTable::default();
        arguments.insert("x-queue-type".into(), AMQPValue::LongString(LongString::from("quorum")));
        let options = QueueDeclareOptions { durable: true, ..Default::default() };
        channel.queue_declare(queue.as_str().into(), options, arguments).await.unwrap();
        let bind = QueueBindOptions::default();
        channel
            .queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                "shop_eu.routed".into(),
                bind,
                FieldTable::default(),
            )
            .await
            .unwrap();
        let fresh = connect(&format!("amqp://{}/{exchange}", server()), &TransportConfig::default()).unwrap();
        let mixed = vec![("audit".to_string(), envelope("routed", 1)), ("audit".to_string(), envelope("order.9", 3))];
        let error = fresh.deliver(&mixed).await.expect_err("one event unroutable");
        assert!(error.to_string().contains("shop_eu.order_9"), "{error}");
        let only = vec![("audit".to_string(), envelope("routed", 2))];
        let routed = fresh.deliver(&only).await.expect("the channel stays usable after a return");
        assert!(matches!(routed[..], [ReceiveOutcome::Accepted { .. }]), "{routed:?}");
        let mut ids = Vec::new();
        let get = BasicGetOptions { no_ack: true };
        while let Some(got) = channel.basic_get(queue.as_str().into(), get).await.unwrap() {
            ids.push(got.delivery.properties.message_id().as_ref().unwrap().to_string());
        }
        assert_eq!(ids, [mixed[0].1.event_id.clone(), only[0].1.event_id.clone()]);
    };
    delete_after(&channel, &[&exchange], &[&queue], body).await;
}

#[tokio::test]
async fn a_missing_exchange_is_a_failed_delivery() {
    let Some(_) = channel_or_skip().await else { return };
    let transport =
        connect(&format!("amqp://{}/{}", server(), unique("tmktest.missing")), &TransportConfig::default()).unwrap();
    let items = vec![("audit".to_string(), envelope("f", 1))];
    let error = transport.deliver(&items).await.expect_err("no such exchange");
    assert!(error.to_string().contains("404") || error.to_string().contains("NOT_FOUND"), "{error}");
    // The broker closed the channel: the transport fails from then on (the lane drops it).
    assert!(transport.deliver(&items).await.is_err());
}

#[tokio::test]
async fn wrong_credentials_are_a_failed_delivery() {
    let Some(_) = channel_or_skip().await else { return };
    let mut config = TransportConfig::default();
    config.amqp_credentials.insert(server(), "tidemark-no-such-user:pw-never-printed".into());
    let transport = connect(&format!("amqp://{}/amq.topic", server()), &config).unwrap();
    let error = transport.deliver(&[("audit".to_string(), envelope("f", 1))]).await.expect_err("refused");
    let message = error.to_string();
    assert!(message.contains("cannot connect to RabbitMQ") && message.contains("tidemark-no-such-user"), "{message}");
    assert!(!message.contains("pw-never-printed"), "the password is never printed: {message}");
}

#[tokio::test]
async fn an_unreachable_broker_is_a_failed_delivery() {
    let config = TransportConfig { connect_timeout: Duration::from_millis(500), ..Default::default() };
    let transport = connect("amqp://127.0.0.1:9/x", &config).unwrap();
    let error = transport.deliver(&[("c".to_string(), envelope("f", 1))]).await.unwrap_err();
    assert!(error.to_string().contains("cannot connect to RabbitMQ at 127.0.0.1:9"), "{error}");
    assert_eq!(
        connect("amqp://127.0.0.1:9/x", &TransportConfig::default()).map(|t| t.kind().as_str()).ok(),
        Some("amqp")
    );
}
