//! The RabbitMQ transport and the RabbitMQ source against the real broker on this machine
//! (127.0.0.1:5672 as guest, or `TIDEMARK_TEST_AMQP` = `host:port`): skipped, with the reason
//! printed, when none answers. Each test declares its own exchanges and queues under unique names
//! and deletes them at the end. The source consumes into a real SQLite inbox, drained from it.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use lapin::options::{
    BasicGetOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use serde_json::json;
use tidemark_core::error::codes;
use tidemark_core::policy::RetentionPolicy;
use tidemark_core::store::{ConsumerStore, DrainScope, DrainStop, HandleError, Handler, InboxStatus, ReceiveOutcome};
use tidemark_core::{Envelope, Error};
use tidemark_store_sqlite::SqliteConsumer;
use tidemark_transport::{
    amqp_routing_key, connect, AmqpSource, AmqpSourceConfig, Inbox, SourceReport, SourceSettings, SourceSpec,
    TransportConfig,
};

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
        traceparent: None,
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

// The consuming side: `AmqpSource` reading a queue into a real SQLite inbox.

/// Pulls a test makes at most before it gives up (a pull that finds nothing waits `PULL_WAIT`).
const PULLS_MAX: usize = 200;
/// The bound of one pull's wait for a first delivery.
const PULL_WAIT: Duration = Duration::from_millis(200);

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64
}

/// An envelope of now (the inbox's horizon refuses `envelope`'s, created at 1 ms).
fn fresh(flow: &str, seq: i64) -> Envelope {
    Envelope { created_at_ms: now_ms(), ..envelope(flow, seq) }
}

/// What a receive does after its inbox commit.
#[derive(Clone, Copy, PartialEq, Eq)]
enum AfterCommit {
    /// Answers the outcomes.
    Answer,
    /// Fails, as an inbox whose caller lost the answer.
    Fail,
    /// Never answers, as a process that died between the inbox commit and the acks.
    Hang,
}

/// A consumer database file as the source's inbox.
struct FileInbox {
    consumer: std::sync::Mutex<SqliteConsumer>,
    after_commit: std::sync::Mutex<AfterCommit>,
}

impl FileInbox {
    fn new(dir: &tempfile::TempDir) -> FileInbox {
        let consumer = SqliteConsumer::init(&dir.path().join("inbox.db"), RetentionPolicy { horizon_ms: 86_400_000 })
            .expect("a consumer database");
        FileInbox {
            consumer: std::sync::Mutex::new(consumer),
            after_commit: std::sync::Mutex::new(AfterCommit::Answer),
        }
    }

    fn then(&self, after_commit: AfterCommit) {
        *self.after_commit.lock().unwrap() = after_commit;
    }

    fn stored(&self) -> usize {
        let consumer = self.consumer.lock().unwrap();
        [InboxStatus::Pending, InboxStatus::Applied, InboxStatus::Blocked]
            .into_iter()
            .map(|status| consumer.inbox("audit", Some(status), 1_000).unwrap().len())
            .sum()
    }

    /// Apply everything applicable; each event's (flow, seq) in apply order, and why it stopped.
    fn drain(&self) -> (Vec<(String, i64)>, DrainStop) {
        let mut seen = Seen::default();
        let mut consumer = self.consumer.lock().unwrap();
        for _ in 0..100 {
            let report = consumer.drain("audit", &DrainScope::All, 1_000, &mut seen, now_ms()).unwrap();
            if report.outcome != DrainStop::Limit {
                return (seen.0, report.outcome);
            }
        }
        panic!("the drain did not settle");
    }
}

impl Inbox for FileInbox {
    fn receive<'a>(
        &'a self,
        consumer_id: &'a str,
        events: Vec<Envelope>,
    ) -> Pin<Box<dyn Future<Output = tidemark_core::Result<Vec<ReceiveOutcome>>> + Send + 'a>> {
        Box::pin(async move {
            let items: Vec<(&str, &Envelope)> = events.iter().map(|e| (consumer_id, e)).collect();
            let outcomes = self.consumer.lock().unwrap().receive_batch(&items, now_ms())?;
            let after_commit = *self.after_commit.lock().unwrap();
            match after_commit {
                AfterCommit::Answer => Ok(outcomes),
                AfterCommit::Fail => Err(Error::io("the inbox answer was lost after its commit")),
                AfterCommit::Hang => std::future::pending().await,
            }
        })
    }
}

/// A handler that records the (flow, seq) of every event it applies.
#[derive(Default)]
struct Seen(Vec<(String, i64)>);

impl<T: ?Sized> Handler<T> for Seen {
    fn handle(&mut self, _: &T, _: &str, event: &Envelope) -> std::result::Result<(), HandleError> {
        self.0.push((event.flow_id.clone(), event.seq));
        Ok(())
    }
}

fn source_config(queue: &str, batch: usize) -> AmqpSourceConfig {
    AmqpSourceConfig { from: format!("amqp://{}/{queue}", server()), consumer_tag: unique("tmktest-tag-"), batch }
}

/// Pull until a pull finds nothing and the queue holds nothing ready; the reports added up.
async fn consume_until_caught_up(source: &AmqpSource, inbox: &FileInbox) -> SourceReport {
    let mut total = SourceReport::default();
    for _ in 0..PULLS_MAX {
        let report = source.pull(inbox, "audit", PULL_WAIT).await.expect("a pull");
        let idle = report.fetched == 0;
        total.absorb(report);
        if idle && source.caught_up().await.expect("the broker answers") {
            return total;
        }
    }
    panic!("not caught up after {PULLS_MAX} pulls: {total:?}");
}

/// The messages `queue` holds: ready, and not acked by a consumer.
async fn depth(channel: &Channel, queue: &str) -> (u32, u32) {
    let passive = QueueDeclareOptions { passive: true, ..Default::default() };
    let q = channel.queue_declare(queue.into(), passive, FieldTable::default()).await.unwrap();
    (q.message_count(), q.consumer_count())
}

/// Wait until `queue` has no consumer and holds `ready` messages ready (a dropped source's
/// connection closes asynchronously; the broker returns its unacked deliveries when it does).
async fn settled(channel: &Channel, queue: &str, ready: usize) {
    for _ in 0..PULLS_MAX {
        if depth(channel, queue).await == (ready as u32, 0) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("queue {queue} did not settle at {ready} ready messages: {:?}", depth(channel, queue).await);
}

/// Publish raw bodies to `queue` (through the default exchange), as a publisher that is not
/// tidemark's would.
async fn publish_raw(channel: &Channel, queue: &str, bodies: &[Vec<u8>]) {
    channel.confirm_select(Default::default()).await.ok();
    for body in bodies {
        let confirm = channel
            .basic_publish("".into(), queue.into(), Default::default(), body, lapin::BasicProperties::default())
            .await
            .unwrap();
        confirm.await.expect("confirmed");
    }
}

fn per_flow(applied: &[(String, i64)]) -> std::collections::BTreeMap<String, Vec<i64>> {
    let mut flows: std::collections::BTreeMap<String, Vec<i64>> = Default::default();
    for (flow, seq) in applied {
        flows.entry(flow.clone()).or_default().push(*seq);
    }
    flows
}

#[tokio::test]
async fn a_relayed_queue_is_stored_once_and_in_order_and_what_a_dead_consumer_did_not_ack_comes_back_duplicate() {
    let Some((_connection, channel)) = channel_or_skip().await else { return };
    let channel_for_body = channel.clone();
    let (exchange, queue) = (unique("tmktest.src.x"), unique("tmktest.src.q"));
    let (x, q) = (exchange.clone(), queue.clone());
    let body = async move {
        let (exchange, queue, channel) = (x, q, channel_for_body);
        declare_exchange(&channel, &exchange).await;
        declare_quorum_queue(&channel, &queue, &exchange).await;
        // The relay's transport publishes 8 flows of 4 events to the exchange, seq by seq.
        let transport = connect(&format!("amqp://{}/{exchange}", server()), &TransportConfig::default()).unwrap();
        let sent: Vec<(String, Envelope)> = (1..=4)
            .flat_map(|seq| (0..8).map(move |f| ("audit".to_string(), fresh(&format!("order.{f}"), seq))))
            .collect();
        transport.deliver(&sent).await.expect("published");
        let dir = tempfile::tempdir().unwrap();
        let inbox = FileInbox::new(&dir);
        let config = source_config(&queue, 7);
        assert_eq!(config.prefetch(), 14);

        // A consumer stores a batch and dies before it acks (its pull never finishes).
        let dying = AmqpSource::connect(&config, &TransportConfig::default()).await.expect("connected");
        inbox.then(AfterCommit::Hang);
        let mut stored_by_the_dead = 0;
        for _ in 0..PULLS_MAX {
            let _ = tokio::time::timeout(Duration::from_millis(500), dying.pull(&inbox, "audit", PULL_WAIT)).await;
            stored_by_the_dead = inbox.stored();
            if stored_by_the_dead > 0 {
                break;
            }
        }
        assert!((1..=7).contains(&stored_by_the_dead), "one batch stored: {stored_by_the_dead}");
        let unusable = dying.pull(&inbox, "audit", PULL_WAIT).await.expect_err("an interrupted source is not reused");
        assert!(unusable.to_string().contains("connect anew"), "{unusable}");
        // Nothing was acked: once its connection closed, the queue holds every message again.
        drop(dying);
        settled(&channel, &queue, sent.len()).await;

        // A consumer whose inbox commits and then fails returns its batch to the queue.
        inbox.then(AfterCommit::Fail);
        let failing = AmqpSource::connect(&config, &TransportConfig::default()).await.expect("connected");
        let mut failed = None;
        for _ in 0..PULLS_MAX {
            match failing.pull(&inbox, "audit", PULL_WAIT).await {
                Ok(report) => assert_eq!(report.fetched, 0, "nothing fetched without reaching the inbox: {report:?}"),
                Err(error) => {
                    failed = Some(error);
                    break;
                }
            }
        }
        let failed = failed.expect("the failing consumer read something");
        assert!(failed.to_string().contains("answer was lost"), "{failed}");
        let stored_before_restart = inbox.stored();
        assert!(stored_before_restart >= stored_by_the_dead, "{stored_before_restart}");
        drop(failing);
        settled(&channel, &queue, sent.len()).await;

        // The next consumer gets every message again: what the others stored is a duplicate.
        inbox.then(AfterCommit::Answer);
        let source = AmqpSource::connect(&config, &TransportConfig::default()).await.expect("connected again");
        let total = consume_until_caught_up(&source, &inbox).await;
        assert_eq!(total.fetched, sent.len() as u64, "{total:?}");
        assert_eq!(total.duplicate, stored_before_restart as u64, "{total:?}");
        assert_eq!(total.accepted, (sent.len() - stored_before_restart) as u64, "{total:?}");
        assert_eq!(total.rejected, 0, "{total:?}");
        assert_eq!(inbox.stored(), sent.len());
        let (applied, stop) = inbox.drain();
        assert_eq!(stop, DrainStop::Idle);
        assert_eq!(applied.len(), sent.len(), "every event applied once");
        let flows = per_flow(&applied);
        assert_eq!(flows.len(), 8);
        assert!(flows.values().all(|seqs| seqs == &[1, 2, 3, 4]), "each flow once, in order: {flows:?}");
        drop(source);

        // Everything was acked: the queue is empty, and a new consumer reads nothing.
        assert_eq!(depth(&channel, &queue).await.0, 0);
        let again = AmqpSource::connect(&config, &TransportConfig::default()).await.expect("connected");
        assert_eq!(consume_until_caught_up(&again, &inbox).await.fetched, 0);
    };
    delete_after(&channel, &[&exchange], &[&queue], body).await;
}

#[tokio::test]
async fn a_poison_message_is_rejected_once_with_its_reason_and_kept_by_the_dead_letter_exchange() {
    let Some((_connection, channel)) = channel_or_skip().await else { return };
    let channel_for_body = channel.clone();
    let (dead_letters, dead_queue, queue) = (unique("tmktest.dlx"), unique("tmktest.dlq"), unique("tmktest.src.q"));
    let (x, dq, q) = (dead_letters.clone(), dead_queue.clone(), queue.clone());
    let body = async move {
        let (dead_letters, dead_queue, queue, channel) = (x, dq, q, channel_for_body);
        declare_exchange(&channel, &dead_letters).await;
        declare_quorum_queue(&channel, &dead_queue, &dead_letters).await;
        let mut arguments = FieldTable::default();
        arguments.insert("x-queue-type".into(), AMQPValue::LongString(LongString::from("quorum")));
        arguments
            .insert("x-dead-letter-exchange".into(), AMQPValue::LongString(LongString::from(dead_letters.as_str())));
        let options = QueueDeclareOptions { durable: true, ..Default::default() };
        channel.queue_declare(queue.as_str().into(), options, arguments).await.unwrap();

        let good = fresh("order-1", 1);
        let mut other_content = good.clone();
        other_content.payload = json!({"seq": "something else"});
        let mut old = fresh("order-2", 1);
        old.event_id = format!("ancient-{}", std::process::id());
        old.created_at_ms = 1;
        let json = |e: &Envelope| serde_json::to_vec(e).unwrap();
        publish_raw(
            &channel,
            &queue,
            &[
                json(&good),
                b"not an envelope".to_vec(),
                // The same event id with other content: refused by the inbox as a conflict.
                json(&other_content),
                // Older than the inbox's horizon.
                json(&old),
                // The same event again (a publisher that sent it twice): a duplicate.
                json(&good),
            ],
        )
        .await;
        let dir = tempfile::tempdir().unwrap();
        let inbox = FileInbox::new(&dir);
        let config = source_config(&queue, 10);
        let source = AmqpSource::connect(&config, &TransportConfig::default()).await.unwrap();
        let total = consume_until_caught_up(&source, &inbox).await;
        assert_eq!((total.fetched, total.accepted, total.duplicate, total.rejected), (5, 1, 1, 3), "{total:?}");
        assert!(
            total.reasons.iter().any(|r| r.contains(&format!("{queue}#")) && r.contains("not an envelope")),
            "{:?}",
            total.reasons
        );
        assert!(
            total.reasons.iter().any(|r| r.contains(&format!("{}: conflict", good.event_id))),
            "{:?}",
            total.reasons
        );
        assert!(total.reasons.iter().any(|r| r.contains(&format!("{}: expired", old.event_id))), "{:?}", total.reasons);
        assert_eq!(inbox.stored(), 1);
        drop(source);

        // Never delivered again: the queue is empty and a new consumer finds nothing; the three
        // rejected messages are in the dead-letter queue, as they were published.
        assert_eq!(depth(&channel, &queue).await.0, 0);
        let again = AmqpSource::connect(&config, &TransportConfig::default()).await.unwrap();
        assert_eq!(consume_until_caught_up(&again, &inbox).await.fetched, 0);
        let mut dead = Vec::new();
        while let Some(got) =
            channel.basic_get(dead_queue.as_str().into(), BasicGetOptions { no_ack: true }).await.unwrap()
        {
            dead.push(got.delivery.data.clone());
        }
        assert_eq!(dead, [b"not an envelope".to_vec(), json(&other_content), json(&old)]);
    };
    delete_after(&channel, &[&dead_letters], &[&queue, &dead_queue], body).await;
}

#[tokio::test]
async fn events_of_a_flow_that_arrive_out_of_order_wait_in_the_inbox_as_a_gap() {
    let Some((_connection, channel)) = channel_or_skip().await else { return };
    let channel_for_body = channel.clone();
    let (exchange, queue) = (unique("tmktest.gap.x"), unique("tmktest.gap.q"));
    let (x, q) = (exchange.clone(), queue.clone());
    let body = async move {
        let (exchange, queue, channel) = (x, q, channel_for_body);
        declare_exchange(&channel, &exchange).await;
        declare_quorum_queue(&channel, &queue, &exchange).await;
        let transport = connect(&format!("amqp://{}/{exchange}", server()), &TransportConfig::default()).unwrap();
        let items = |seqs: &[i64]| seqs.iter().map(|&s| ("audit".to_string(), fresh("late", s))).collect::<Vec<_>>();
        transport.deliver(&items(&[2, 3])).await.expect("published");
        let dir = tempfile::tempdir().unwrap();
        let inbox = FileInbox::new(&dir);
        let source = AmqpSource::connect(&source_config(&queue, 10), &TransportConfig::default()).await.unwrap();
        let total = consume_until_caught_up(&source, &inbox).await;
        assert_eq!((total.fetched, total.accepted), (2, 2), "{total:?}");
        let (applied, stop) = inbox.drain();
        assert!(applied.is_empty(), "nothing applied past the gap: {applied:?}");
        assert_eq!(stop, DrainStop::Gap);

        transport.deliver(&items(&[1])).await.expect("published");
        let total = consume_until_caught_up(&source, &inbox).await;
        assert_eq!((total.fetched, total.accepted), (1, 1), "{total:?}");
        let (applied, stop) = inbox.drain();
        assert_eq!(applied, [("late".to_string(), 1), ("late".to_string(), 2), ("late".to_string(), 3)]);
        assert_eq!(stop, DrainStop::Idle);
    };
    delete_after(&channel, &[&exchange], &[&queue], body).await;
}

#[tokio::test]
async fn a_missing_queue_bad_credentials_or_an_unreachable_broker_is_an_io_error_before_anything_is_read() {
    let fast = TransportConfig { connect_timeout: Duration::from_millis(500), ..Default::default() };
    let error = AmqpSource::connect(
        &AmqpSourceConfig { from: "amqp://127.0.0.1:9/q".into(), consumer_tag: "t".into(), batch: 1 },
        &fast,
    )
    .await
    .err()
    .expect("nobody listens");
    assert_eq!(error.code(), codes::IO);
    assert!(error.to_string().contains("cannot connect to RabbitMQ at 127.0.0.1:9"), "{error}");
    let Some(_) = channel_or_skip().await else { return };
    let missing = source_config(&unique("tmktest.missing"), 1);
    let error = AmqpSource::connect(&missing, &TransportConfig::default()).await.err().expect("no such queue");
    assert!(error.to_string().contains("has no queue") && error.to_string().contains("never declared"), "{error}");
    let mut config = TransportConfig::default();
    config.amqp_credentials.insert(server(), "tidemark-no-such-user:pw-never-printed".into());
    let error = AmqpSource::connect(&source_config("amq.q", 1), &config).await.err().expect("refused");
    assert!(
        error.to_string().contains("tidemark-no-such-user") && !error.to_string().contains("pw-never-printed"),
        "{error}"
    );
}

#[test]
fn a_source_configuration_out_of_range_is_invalid_config() {
    let good = AmqpSourceConfig {
        from: "amqp://rabbit/shipping.orders".into(),
        consumer_tag: "tidemark-shipping-ledger".into(),
        batch: 1_000,
    };
    assert_eq!(good.validate().unwrap(), ("rabbit:5672".to_string(), "shipping.orders".to_string()));
    assert_eq!(good.prefetch(), 2_000);
    let bad = |f: &dyn Fn(&mut AmqpSourceConfig)| {
        let mut config = good.clone();
        f(&mut config);
        config.validate().unwrap_err()
    };
    for error in [
        bad(&|c| c.from = "nats://127.0.0.1/orders".into()),
        bad(&|c| c.from = "amqp://rabbit".into()),
        bad(&|c| c.from = "amqp://rabbit/".into()),
        bad(&|c| c.from = "amqp://rabbit/vhost/queue".into()),
        bad(&|c| c.from = "amqp://guest:guest@rabbit/q".into()),
        bad(&|c| c.from = "amqp://rabbit/q?heartbeat=5".into()),
        bad(&|c| c.from = format!("amqp://rabbit/{}", "q".repeat(256))),
        bad(&|c| c.consumer_tag = String::new()),
        bad(&|c| c.consumer_tag = "has space".into()),
        bad(&|c| c.consumer_tag = "t".repeat(256)),
        bad(&|c| c.batch = 0),
        bad(&|c| c.batch = 1_001),
    ] {
        assert_eq!(error.code(), codes::INVALID_CONFIG, "{error}");
    }
    let settings = |f: &dyn Fn(&mut SourceSettings)| {
        let mut s = SourceSettings {
            from: "amqp://rabbit:5673/orders".into(),
            stream: None,
            durable: "tag".into(),
            batch: 5,
            ack_wait_ms: None,
            session_timeout_ms: None,
        };
        f(&mut s);
        s.check()
    };
    assert_eq!(
        settings(&|_| {}).unwrap(),
        SourceSpec::Amqp(AmqpSourceConfig {
            from: "amqp://rabbit:5673/orders".into(),
            consumer_tag: "tag".into(),
            batch: 5
        })
    );
    for (change, named) in [
        (&(|s: &mut SourceSettings| s.stream = Some("S".into())) as &dyn Fn(&mut SourceSettings), "stream"),
        (&|s: &mut SourceSettings| s.ack_wait_ms = Some(5_000), "ack_wait_ms"),
        (&|s: &mut SourceSettings| s.session_timeout_ms = Some(6_000), "session_timeout_ms"),
        (&|s: &mut SourceSettings| s.from = "amqp://rabbit/a/b".into(), "the queue"),
    ] {
        let error = settings(change).unwrap_err();
        assert_eq!(error.code(), codes::INVALID_CONFIG, "{error}");
        assert!(error.to_string().contains(named), "{error}");
    }
}
