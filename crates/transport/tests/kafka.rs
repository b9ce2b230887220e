//! The Kafka transport and the Kafka source against rdkafka's `MockCluster` (librdkafka's
//! in-process cluster: brokers on loopback ports, idempotent producers, consumer groups with
//! committed offsets; there is no Kafka broker on this machine). Events are consumed into a real
//! SQLite inbox and drained from it.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{DefaultProducerContext, FutureProducer, FutureRecord};
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde_json::json;
use tidemark_core::error::codes;
use tidemark_core::policy::RetentionPolicy;
use tidemark_core::store::{ConsumerStore, DrainScope, DrainStop, HandleError, Handler, ReceiveOutcome};
use tidemark_core::{Envelope, Error, Result};
use tidemark_store_sqlite::SqliteConsumer;
use tidemark_transport::{
    connect, kafka_headers, kafka_key, Inbox, KafkaSource, KafkaSourceConfig, SourceReport, TransportConfig,
};

/// The bound of one pull's wait for a first record.
const PULL_WAIT: Duration = Duration::from_millis(500);
/// Pulls a test makes at most before it gives up (a group's first join takes the mock's
/// `group.initial.rebalance.delay.ms`, 3 s; a pull that finds nothing waits `PULL_WAIT`).
const PULLS_MAX: usize = 400;

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64
}

fn envelope(flow: &str, seq: i64) -> Envelope {
    Envelope {
        event_id: format!("{flow}-{seq}"),
        source: "shop.eu".into(),
        generation: "g1".into(),
        flow_id: flow.into(),
        seq,
        event_type: "parcel.noted".into(),
        schema_version: 1,
        payload: json!({"seq": seq}),
        created_at_ms: now_ms(),
        traceparent: None,
    }
}

fn cluster(brokers: i32, topic: &str, partitions: i32) -> MockCluster<'static, DefaultProducerContext> {
    let cluster = MockCluster::new(brokers).expect("a mock cluster");
    cluster.create_topic(topic, partitions, brokers).expect("create the topic");
    cluster
}

/// `flows` flows of `events` events each, interleaved across flows, each flow in seq order.
fn items(flows: usize, events: i64) -> Vec<(String, Envelope)> {
    (1..=events)
        .flat_map(|seq| (0..flows).map(move |f| ("audit".to_string(), envelope(&format!("order.{f}"), seq))))
        .collect()
}

/// Every record of `topic` (all `partitions`, from the beginning) once `expected` have arrived.
fn read_back(bootstrap: &str, topic: &str, partitions: i32, expected: usize) -> Vec<rdkafka::message::OwnedMessage> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "read-back")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut assignment = TopicPartitionList::new();
    for partition in 0..partitions {
        assignment.add_partition_offset(topic, partition, Offset::Beginning).unwrap();
    }
    consumer.assign(&assignment).unwrap();
    let mut records = Vec::new();
    for _ in 0..PULLS_MAX {
        if records.len() >= expected {
            break;
        }
        if let Some(record) = consumer.poll(Duration::from_millis(100)) {
            records.push(record.expect("a record").detach());
        }
    }
    assert_eq!(records.len(), expected, "records read back");
    // Nothing beyond them.
    assert!(consumer.poll(Duration::from_millis(500)).is_none(), "more records than expected");
    records
}

#[tokio::test]
async fn records_carry_the_flow_key_and_headers_and_each_flow_stays_in_one_partition_in_order() {
    let cluster = cluster(3, "orders", 4);
    let bootstrap = cluster.bootstrap_servers();
    let transport = connect(&format!("kafka://{bootstrap}/orders"), &TransportConfig::default()).unwrap();
    assert_eq!(transport.kind().as_str(), "kafka");
    let sent = items(12, 5);

    let outcomes = transport.deliver(&sent).await.expect("produced");
    assert_eq!(outcomes.len(), sent.len());
    for ((consumer_id, envelope), outcome) in sent.iter().zip(&outcomes) {
        let expected =
            ReceiveOutcome::Accepted { consumer_id: consumer_id.clone(), event_id: envelope.event_id.clone() };
        assert_eq!(outcome, &expected);
    }

    let records = read_back(&bootstrap, "orders", 4, sent.len());
    let by_id: BTreeMap<&str, &Envelope> = sent.iter().map(|(_, e)| (e.event_id.as_str(), e)).collect();
    let mut partition_of_flow: BTreeMap<String, i32> = BTreeMap::new();
    let mut last_seq: BTreeMap<String, i64> = BTreeMap::new();
    // Records come back in offset order per partition: that is the order a flow is consumed in.
    let mut by_partition: BTreeMap<i32, Vec<&rdkafka::message::OwnedMessage>> = BTreeMap::new();
    for record in &records {
        by_partition.entry(record.partition()).or_default().push(record);
    }
    for (partition, records) in &by_partition {
        let offsets: Vec<i64> = records.iter().map(|r| r.offset()).collect();
        assert!(offsets.windows(2).all(|w| w[0] < w[1]), "partition {partition} in offset order: {offsets:?}");
        for record in records {
            let stored: Envelope = serde_json::from_slice(record.payload().expect("a value")).unwrap();
            let original = by_id[stored.event_id.as_str()];
            assert_eq!(&&stored, &original, "the value is the envelope's JSON");
            assert_eq!(record.key(), Some(kafka_key(original).as_bytes()));
            assert_eq!(kafka_key(original), format!("shop.eu/{}", original.flow_id));
            let headers = record.headers().expect("headers");
            let got: Vec<(String, String)> = headers
                .iter()
                .map(|h| (h.key.to_string(), String::from_utf8(h.value.unwrap().to_vec()).unwrap()))
                .collect();
            let expected: Vec<(String, String)> =
                kafka_headers(original).into_iter().map(|(k, v)| (k.to_string(), v)).collect();
            assert_eq!(got, expected);
            assert_eq!(expected[0], ("tidemark-event-id".to_string(), original.event_id.clone()));
            assert_eq!(expected[3], ("tidemark-seq".to_string(), original.seq.to_string()));
            assert_eq!(expected[5], ("tidemark-content-hash".to_string(), original.content_hash()));
            let flow = original.flow_id.clone();
            let first_partition = *partition_of_flow.entry(flow.clone()).or_insert(*partition);
            assert_eq!(first_partition, *partition, "flow {flow} stays in one partition");
            let last = last_seq.insert(flow.clone(), original.seq).unwrap_or(0);
            assert_eq!(original.seq, last + 1, "flow {flow} in order");
        }
    }
    assert_eq!(last_seq.len(), 12);
    assert!(last_seq.values().all(|&seq| seq == 5), "{last_seq:?}");
    let used: BTreeSet<i32> = partition_of_flow.values().copied().collect();
    assert!(used.len() > 1, "the flows spread over the partitions: {partition_of_flow:?}");

    // Kafka has no dedup answer: a redelivery is produced (and accepted) again.
    let again = transport.deliver(&sent[..2]).await.expect("produced again");
    assert!(again.iter().all(|o| matches!(o, ReceiveOutcome::Accepted { .. })), "{again:?}");
    read_back(&bootstrap, "orders", 4, sent.len() + 2);
}

/// A consumer database file as the source's inbox. With `die_after_commit` set, a receive
/// commits and then fails, as a process killed between the inbox commit and the offset commit.
struct FileInbox {
    consumer: Mutex<SqliteConsumer>,
    die_after_commit: AtomicBool,
    /// A receive that never answers (a pull waiting on it is dropped by its caller).
    hang: AtomicBool,
}

impl FileInbox {
    fn new(dir: &tempfile::TempDir) -> FileInbox {
        let consumer = SqliteConsumer::init(&dir.path().join("inbox.db"), RetentionPolicy { horizon_ms: 86_400_000 })
            .expect("a consumer database");
        FileInbox {
            consumer: Mutex::new(consumer),
            die_after_commit: AtomicBool::new(false),
            hang: AtomicBool::new(false),
        }
    }

    fn stored(&self) -> usize {
        let consumer = self.consumer.lock().unwrap();
        [
            tidemark_core::store::InboxStatus::Pending,
            tidemark_core::store::InboxStatus::Applied,
            tidemark_core::store::InboxStatus::Blocked,
        ]
        .into_iter()
        .map(|status| consumer.inbox("audit", Some(status), 1_000).unwrap().len())
        .sum()
    }

    /// Apply everything applicable; what each event's handler saw, in apply order.
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
    ) -> Pin<Box<dyn Future<Output = Result<Vec<ReceiveOutcome>>> + Send + 'a>> {
        Box::pin(async move {
            if self.hang.load(Ordering::SeqCst) {
                return std::future::pending().await;
            }
            let items: Vec<(&str, &Envelope)> = events.iter().map(|e| (consumer_id, e)).collect();
            let outcomes = self.consumer.lock().unwrap().receive_batch(&items, now_ms())?;
            if self.die_after_commit.load(Ordering::SeqCst) {
                return Err(Error::io("the consumer died after its inbox commit, before the offset commit"));
            }
            Ok(outcomes)
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

fn source_config(bootstrap: &str, topic: &str, group: &str) -> KafkaSourceConfig {
    KafkaSourceConfig {
        from: format!("kafka://{bootstrap}/{topic}"),
        group: group.to_string(),
        batch: 7,
        session_timeout_ms: 6_000,
    }
}

/// Pull until the member has joined, found nothing and is committed up to the end of every
/// partition it owns; the reports added up.
async fn consume_until_caught_up(source: &KafkaSource, inbox: &FileInbox) -> SourceReport {
    let mut total = SourceReport::default();
    for _ in 0..PULLS_MAX {
        let report = source.pull(inbox, "audit", PULL_WAIT).await.expect("a pull");
        let idle = report.fetched == 0;
        total.absorb(report);
        if idle && source.caught_up().await.expect("the cluster answers") {
            return total;
        }
    }
    panic!("not caught up after {PULLS_MAX} pulls: {total:?}");
}

/// Each flow's applied seqs, in apply order.
fn per_flow(applied: &[(String, i64)]) -> BTreeMap<String, Vec<i64>> {
    let mut flows: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (flow, seq) in applied {
        flows.entry(flow.clone()).or_default().push(*seq);
    }
    flows
}

#[tokio::test]
async fn a_group_stores_every_event_once_and_a_member_that_died_before_its_offset_commit_is_read_again_as_duplicate() {
    let cluster = cluster(1, "orders", 3);
    let bootstrap = cluster.bootstrap_servers();
    let transport = connect(&format!("kafka://{bootstrap}/orders"), &TransportConfig::default()).unwrap();
    let sent = items(10, 4);
    transport.deliver(&sent).await.expect("produced");
    let dir = tempfile::tempdir().unwrap();
    let inbox = FileInbox::new(&dir);
    let config = source_config(&bootstrap, "orders", "ledger");

    // The first member stores a batch, then dies before it commits the offsets.
    let first = KafkaSource::connect(&config, Duration::from_secs(5)).await.expect("connected");
    inbox.die_after_commit.store(true, Ordering::SeqCst);
    let mut died = None;
    for _ in 0..PULLS_MAX {
        match first.pull(&inbox, "audit", PULL_WAIT).await {
            Ok(report) => assert_eq!(report.fetched, 0, "nothing fetched without reaching the inbox: {report:?}"),
            Err(error) => {
                died = Some(error);
                break;
            }
        }
    }
    let died = died.expect("the first member read something");
    assert!(died.to_string().contains("died after its inbox commit"), "{died}");
    let stored_before_restart = inbox.stored();
    assert!((1..=7).contains(&stored_before_restart), "one batch stored: {stored_before_restart}");
    assert!(!first.caught_up().await.unwrap(), "no offset was committed");
    assert!(first.usable(), "the failed batch was rewound");
    drop(first);

    // The restarted member reads from the last committed offset: what the first stored comes
    // again and is answered duplicate; nothing is stored or applied twice.
    inbox.die_after_commit.store(false, Ordering::SeqCst);
    let second = KafkaSource::connect(&config, Duration::from_secs(5)).await.expect("connected again");
    let total = consume_until_caught_up(&second, &inbox).await;
    assert_eq!(total.fetched, sent.len() as u64, "{total:?}");
    assert_eq!(total.duplicate, stored_before_restart as u64, "{total:?}");
    assert_eq!(total.accepted, (sent.len() - stored_before_restart) as u64, "{total:?}");
    assert_eq!(total.rejected, 0, "{total:?}");
    assert_eq!(inbox.stored(), sent.len());
    let (applied, stop) = inbox.drain();
    assert_eq!(stop, DrainStop::Idle);
    assert_eq!(applied.len(), sent.len(), "every event applied once");
    let flows = per_flow(&applied);
    assert_eq!(flows.len(), 10);
    assert!(flows.values().all(|seqs| seqs == &[1, 2, 3, 4]), "each flow once, in order: {flows:?}");
    drop(second);

    // Everything was committed: a member that joins now reads nothing again.
    let third = KafkaSource::connect(&config, Duration::from_secs(5)).await.expect("connected a third time");
    let total = consume_until_caught_up(&third, &inbox).await;
    assert_eq!(total.fetched, 0, "{total:?}");
}

/// A batch whose inbox call failed is rewound: the same member reads it again (the inbox answers
/// `duplicate` for what it had stored) and goes on, without connecting anew.
#[tokio::test]
async fn a_member_whose_batch_failed_reads_it_again_itself() {
    let cluster = cluster(1, "orders", 2);
    let bootstrap = cluster.bootstrap_servers();
    let transport = connect(&format!("kafka://{bootstrap}/orders"), &TransportConfig::default()).unwrap();
    let sent = items(5, 3);
    transport.deliver(&sent).await.expect("produced");
    let dir = tempfile::tempdir().unwrap();
    let inbox = FileInbox::new(&dir);
    let source = KafkaSource::connect(&source_config(&bootstrap, "orders", "ledger"), Duration::from_secs(5))
        .await
        .expect("connected");
    inbox.die_after_commit.store(true, Ordering::SeqCst);
    let mut failed = None;
    for _ in 0..PULLS_MAX {
        if let Err(error) = source.pull(&inbox, "audit", PULL_WAIT).await {
            failed = Some(error);
            break;
        }
    }
    let failed = failed.expect("a batch reached the inbox");
    assert!(failed.to_string().contains("died after its inbox commit"), "{failed}");
    assert!(source.usable(), "{failed}");
    let stored = inbox.stored();
    assert!(stored >= 1, "the failed batch was stored");

    inbox.die_after_commit.store(false, Ordering::SeqCst);
    let total = consume_until_caught_up(&source, &inbox).await;
    assert_eq!(total.duplicate, stored as u64, "the stored batch is read again: {total:?}");
    assert_eq!(total.accepted, (sent.len() - stored) as u64, "{total:?}");
    assert_eq!(inbox.stored(), sent.len());
    let (applied, _) = inbox.drain();
    assert_eq!(applied.len(), sent.len(), "every event applied once");
}

/// A pull dropped while its batch was in the inbox call (its caller gave up on it) can neither
/// commit nor rewind: the source refuses every later pull, and a new member reads the batch.
#[tokio::test]
async fn a_member_whose_pull_was_dropped_mid_batch_is_not_pulled_from_again() {
    let cluster = cluster(1, "orders", 1);
    let bootstrap = cluster.bootstrap_servers();
    let transport = connect(&format!("kafka://{bootstrap}/orders"), &TransportConfig::default()).unwrap();
    let sent = items(3, 2);
    transport.deliver(&sent).await.expect("produced");
    let dir = tempfile::tempdir().unwrap();
    let inbox = FileInbox::new(&dir);
    let config = source_config(&bootstrap, "orders", "ledger");
    let source = KafkaSource::connect(&config, Duration::from_secs(5)).await.expect("connected");
    inbox.hang.store(true, Ordering::SeqCst);
    let mut dropped = false;
    for _ in 0..PULLS_MAX {
        match tokio::time::timeout(PULL_WAIT * 4, source.pull(&inbox, "audit", PULL_WAIT)).await {
            Ok(report) => assert_eq!(report.expect("a pull").fetched, 0, "a batch reached the inbox"),
            Err(_gave_up) => {
                dropped = true;
                break;
            }
        }
    }
    assert!(dropped, "a batch reached the hanging inbox");
    assert!(!source.usable());
    inbox.hang.store(false, Ordering::SeqCst);
    let refused = source.pull(&inbox, "audit", PULL_WAIT).await.expect_err("not pulled from again");
    assert!(refused.to_string().contains("connect anew"), "{refused}");
    assert_eq!(inbox.stored(), 0);
    drop(source);

    let again = KafkaSource::connect(&config, Duration::from_secs(5)).await.expect("connected again");
    let total = consume_until_caught_up(&again, &inbox).await;
    assert_eq!(total.accepted, sent.len() as u64, "{total:?}");
    assert_eq!(inbox.stored(), sent.len());
}

/// A broker down and up again: the member keeps its place (a pull that meets only consumer
/// errors fails but leaves the source usable, and one whose offset commit failed is rewound),
/// the errors librdkafka queued during the outage never stand before the records that follow
/// it, and every event is stored once.
#[tokio::test]
async fn a_member_rides_out_a_broker_outage_and_reads_past_the_errors_it_queued() {
    let cluster = cluster(1, "orders", 3);
    let bootstrap = cluster.bootstrap_servers();
    let transport = connect(&format!("kafka://{bootstrap}/orders"), &TransportConfig::default()).unwrap();
    let sent = items(6, 4);
    let (before, after) = sent.split_at(12);
    transport.deliver(before).await.expect("produced");
    let dir = tempfile::tempdir().unwrap();
    let inbox = FileInbox::new(&dir);
    let source = KafkaSource::connect(&source_config(&bootstrap, "orders", "ledger"), Duration::from_secs(5))
        .await
        .expect("connected");
    let first = consume_until_caught_up(&source, &inbox).await;
    assert_eq!(first.accepted, before.len() as u64, "{first:?}");

    // The broker goes down; the member keeps pulling for a while (each pull fails or finds
    // nothing), then stops pulling while librdkafka queues its failed reconnections.
    cluster.broker_down(1).unwrap();
    let mut failed = 0;
    for _ in 0..4 {
        if let Err(error) = source.pull(&inbox, "audit", PULL_WAIT).await {
            assert!(error.to_string().contains("Kafka read of orders"), "{error}");
            failed += 1;
        }
        assert!(source.usable(), "a consumer error took no record: the member stays");
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    cluster.broker_up(1).unwrap();
    transport.deliver(after).await.expect("produced after the outage");

    // The same member reads on: everything after the outage, once (a pull or a watermark query
    // may still fail while librdkafka reconnects).
    let mut rest = SourceReport::default();
    for _ in 0..PULLS_MAX {
        let Ok(report) = source.pull(&inbox, "audit", PULL_WAIT).await else { continue };
        let idle = report.fetched == 0;
        rest.absorb(report);
        if idle && source.caught_up().await.unwrap_or(false) {
            break;
        }
    }
    // A batch whose offset commit failed while the member rejoined (the broker's restart lost
    // the group) was rewound and read again: its events are answered duplicate, by this member.
    assert!(source.usable());
    assert!(rest.fetched >= after.len() as u64, "{rest:?} ({failed} pulls failed during the outage)");
    assert!(rest.accepted <= after.len() as u64, "{rest:?}");
    assert_eq!(inbox.stored(), sent.len());
    let (applied, _) = inbox.drain();
    assert_eq!(applied.len(), sent.len(), "every event applied once");
    let flows = per_flow(&applied);
    assert!(flows.values().all(|seqs| seqs == &[1, 2, 3, 4]), "each flow once, in order: {flows:?}");
}

/// Produce raw records (key, value) to `topic`, as a producer that is not tidemark's would.
async fn produce_raw(bootstrap: &str, topic: &str, records: &[(&str, Vec<u8>)]) {
    let producer: FutureProducer = ClientConfig::new().set("bootstrap.servers", bootstrap).create().unwrap();
    for (key, value) in records {
        let record = FutureRecord::to(topic).key(*key).payload(value);
        producer.send(record, Duration::from_secs(10)).await.map_err(|(e, _)| e).expect("produced");
    }
}

#[tokio::test]
async fn a_poison_record_is_rejected_once_with_its_reason_and_never_read_again() {
    let cluster = cluster(1, "notes", 1);
    let bootstrap = cluster.bootstrap_servers();
    let good = envelope("order-1", 1);
    let mut other_content = envelope("order-1", 1);
    other_content.payload = json!({"seq": "something else"});
    let mut old = envelope("order-2", 1);
    old.event_id = "ancient".into();
    old.created_at_ms = 1;
    let json = |e: &Envelope| serde_json::to_vec(e).unwrap();
    produce_raw(
        &bootstrap,
        "notes",
        &[
            ("shop.eu/order-1", json(&good)),
            ("shop.eu/order-1", b"not an envelope".to_vec()),
            // The same event id with other content: refused by the inbox as a conflict.
            ("shop.eu/order-1", json(&other_content)),
            // Older than the inbox's horizon.
            ("shop.eu/order-2", json(&old)),
            // The same event again (a redelivery): a duplicate.
            ("shop.eu/order-1", json(&good)),
        ],
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let inbox = FileInbox::new(&dir);
    let config = source_config(&bootstrap, "notes", "poison");
    let source = KafkaSource::connect(&config, Duration::from_secs(5)).await.unwrap();
    let total = consume_until_caught_up(&source, &inbox).await;
    assert_eq!((total.fetched, total.accepted, total.duplicate, total.rejected), (5, 1, 1, 3), "{total:?}");
    assert!(total.reasons.iter().any(|r| r.contains("notes[0]@1: not an envelope")), "{:?}", total.reasons);
    assert!(total.reasons.iter().any(|r| r.contains("order-1-1: conflict")), "{:?}", total.reasons);
    assert!(total.reasons.iter().any(|r| r.contains("ancient: expired")), "{:?}", total.reasons);
    assert_eq!(inbox.stored(), 1);
    drop(source);

    // The group's offset is past them: a new member finds nothing to read, nothing loops.
    let again = KafkaSource::connect(&config, Duration::from_secs(5)).await.unwrap();
    let total = consume_until_caught_up(&again, &inbox).await;
    assert_eq!(total.fetched, 0, "{total:?}");
}

#[tokio::test]
async fn events_of_a_flow_that_arrive_out_of_order_wait_in_the_inbox_as_a_gap() {
    let cluster = cluster(1, "orders", 2);
    let bootstrap = cluster.bootstrap_servers();
    let transport = connect(&format!("kafka://{bootstrap}/orders"), &TransportConfig::default()).unwrap();
    // seq 2 and 3 reach the topic before seq 1 (a producer that sent them out of order).
    let items = |seqs: &[i64]| seqs.iter().map(|&s| ("audit".to_string(), envelope("late", s))).collect::<Vec<_>>();
    transport.deliver(&items(&[2, 3])).await.expect("produced");
    let dir = tempfile::tempdir().unwrap();
    let inbox = FileInbox::new(&dir);
    let source =
        KafkaSource::connect(&source_config(&bootstrap, "orders", "gaps"), Duration::from_secs(5)).await.unwrap();
    let total = consume_until_caught_up(&source, &inbox).await;
    assert_eq!((total.fetched, total.accepted), (2, 2), "{total:?}");
    let (applied, stop) = inbox.drain();
    assert!(applied.is_empty(), "nothing applied past the gap: {applied:?}");
    assert_eq!(stop, DrainStop::Gap);

    transport.deliver(&items(&[1])).await.expect("produced");
    let total = consume_until_caught_up(&source, &inbox).await;
    assert_eq!((total.fetched, total.accepted), (1, 1), "{total:?}");
    let (applied, stop) = inbox.drain();
    assert_eq!(applied, [("late".to_string(), 1), ("late".to_string(), 2), ("late".to_string(), 3)]);
    assert_eq!(stop, DrainStop::Idle);
}

#[tokio::test]
async fn a_broker_error_is_a_failed_delivery_with_its_reason_never_accepted() {
    let cluster = cluster(1, "orders", 1);
    let bootstrap = cluster.bootstrap_servers();
    let config = TransportConfig {
        connect_timeout: Duration::from_millis(1_000),
        message_timeout: Duration::from_millis(2_000),
        ..Default::default()
    };
    let one = vec![("audit".to_string(), envelope("order-1", 1))];

    // The broker refuses the produce request.
    let transport = connect(&format!("kafka://{bootstrap}/orders"), &config).unwrap();
    cluster.request_errors(RDKafkaApiKey::Produce, &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED]);
    let error = transport.deliver(&one).await.expect_err("refused: never accepted");
    assert_eq!(error.code(), codes::IO);
    let message = error.to_string();
    assert!(
        message.contains("authorization") && message.contains("order-1-1") && message.contains("orders"),
        "{message}"
    );
    // librdkafka remembers the refusal for the topic (later records fail as they are queued);
    // the lane connects anew after a batch that failed whole, and that producer delivers.
    let error = transport.deliver(&one).await.expect_err("still refused by this producer");
    assert!(error.to_string().contains("authorization"), "{error}");
    let fresh = connect(&format!("kafka://{bootstrap}/orders"), &config).unwrap();
    let delivered = fresh.deliver(&one).await.expect("accepted after the refusal");
    assert!(matches!(delivered[..], [ReceiveOutcome::Accepted { .. }]), "{delivered:?}");

    // A topic the cluster does not have: never created by the relay, never accepted.
    let nowhere = connect(&format!("kafka://{bootstrap}/nowhere"), &config).unwrap();
    let error = nowhere.deliver(&one).await.expect_err("no such topic");
    assert!(error.to_string().to_lowercase().contains("unknown topic"), "{error}");

    // Every broker down: the record times out with that reason.
    cluster.broker_down(1).unwrap();
    let down = connect(&format!("kafka://{bootstrap}/orders"), &config).unwrap();
    let two = vec![("audit".to_string(), envelope("order-2", 1)), ("audit".to_string(), envelope("order-2", 2))];
    let error = down.deliver(&two).await.expect_err("the broker is down");
    let message = error.to_string();
    assert!(message.contains("timed out") && message.contains("order-2-1"), "{message}");
    assert!(message.contains("1 more of the 2 records failed"), "{message}");
    cluster.broker_up(1).unwrap();

    // Nothing of the refused or timed-out records is in the topic: only the one accepted.
    let records = read_back(&bootstrap, "orders", 1, 1);
    assert_eq!(records[0].key(), Some(kafka_key(&one[0].1).as_bytes()));
}

#[tokio::test]
async fn an_unreachable_cluster_is_a_failed_delivery_and_a_source_that_cannot_connect() {
    let config = TransportConfig {
        connect_timeout: Duration::from_millis(500),
        message_timeout: Duration::from_millis(1_500),
        ..Default::default()
    };
    let transport = connect("kafka://127.0.0.1:9/orders", &config).unwrap();
    let error = transport.deliver(&[("c".to_string(), envelope("f", 1))]).await.expect_err("nobody listens");
    assert!(error.to_string().contains("timed out"), "{error}");

    let source = KafkaSource::connect(&source_config("127.0.0.1:9", "orders", "g"), Duration::from_millis(1_000)).await;
    let error = source.err().expect("nobody listens");
    assert!(error.to_string().contains("cannot reach Kafka at 127.0.0.1:9"), "{error}");

    let cluster = cluster(1, "orders", 1);
    let missing = source_config(&cluster.bootstrap_servers(), "nowhere", "g");
    let error = KafkaSource::connect(&missing, Duration::from_secs(5)).await.err().expect("no such topic");
    assert!(error.to_string().contains("no topic \"nowhere\""), "{error}");
}

#[test]
fn a_source_configuration_out_of_range_is_invalid_config() {
    let good = source_config("127.0.0.1:9092", "orders", "tidemark-shipping-ledger");
    assert_eq!(good.validate().unwrap(), (vec!["127.0.0.1:9092".to_string()], "orders".to_string()));
    let bad = |f: &dyn Fn(&mut KafkaSourceConfig)| {
        let mut config = good.clone();
        f(&mut config);
        config.validate().unwrap_err()
    };
    for error in [
        bad(&|c| c.from = "nats://127.0.0.1/orders".into()),
        bad(&|c| c.from = "kafka://127.0.0.1".into()),
        bad(&|c| c.group = String::new()),
        bad(&|c| c.group = "has space".into()),
        bad(&|c| c.group = "g".repeat(250)),
        bad(&|c| c.batch = 0),
        bad(&|c| c.batch = 1_001),
        bad(&|c| c.session_timeout_ms = 999),
        bad(&|c| c.session_timeout_ms = 1_800_001),
    ] {
        assert_eq!(error.code(), codes::INVALID_CONFIG, "{error}");
    }
}
