//! Consuming a Kafka topic into a tidemark inbox: a member of a consumer group whose offsets are
//! committed only after the inbox transaction committed (docs/protocol.md, "Consuming from a
//! broker").
//!
//! One pull: wait up to `wait` for the first record of the partitions this member is assigned,
//! then take what librdkafka has already fetched, up to the batch; parse each record's value as
//! an envelope; store the valid ones in one inbox call; then commit, for each partition of the
//! batch, the offset after its last record (synchronously, so the pull resolves once the group
//! coordinator stored it). `accepted` and `duplicate` (a record read again: the inbox already
//! holds it) are committed past; so are a record that is not an envelope and an envelope the
//! inbox refuses (`conflict`, `expired`): each is counted `rejected` with its reason, and a poison
//! record is never read again by this group, so it never loops. Kafka has no per-record ack: one
//! offset per partition says "everything before it is stored".
//!
//! Offsets are never committed automatically (`enable.auto.commit=false`). When the inbox call
//! fails, or the process dies between the inbox commit and the offset commit, nothing is
//! committed: the next member to own those partitions (this process after a restart, or another
//! member after a rebalance) reads from the last committed offset, and the inbox answers
//! `duplicate` for what it had stored. Because librdkafka's fetch position has moved past
//! records that were not committed, **a pull whose batch failed rewinds**: each partition of the
//! batch still assigned is sought back to the batch's first record there, and the same member
//! reads them again (answered `duplicate`). A pull dropped before it finished, or one whose
//! rewind failed, leaves the source **unusable**: every later pull is an error, and the caller
//! connects anew, so that the new member starts from the committed offsets instead of skipping
//! what was not stored. A consumer error before any record (the broker down or unreachable)
//! leaves the source usable: librdkafka reconnects by itself, and the member keeps its place in
//! the group (or, past the session timeout, rejoins by itself and reads from the committed
//! offsets).
//!
//! A group's partitions are split among its members; a rebalance moves a partition to another
//! member, which starts from the last committed offset. When partitions are revoked while a pull
//! holds records of them, the pull stores them and commits only the partitions still assigned:
//! the new owner reads the rest again (answered `duplicate` when both members store into the same
//! inbox). Every event of a flow is in one partition (the relay keys records by
//! `<source>/<flow_id>`), where Kafka keeps their order; events of a flow that arrive out of order
//! anyway (a producer that keyed differently, partitions added to the topic) wait in the inbox as
//! a `gap` until the missing seq arrives, as they do from any relay.
//!
//! A new group starts at the earliest offset (`auto.offset.reset=earliest`), so that what the
//! relay produced before the consumer first joined is consumed too.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::message::{Message, OwnedMessage};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use serde::Serialize;
use tidemark_core::endpoint::Endpoint;
use tidemark_core::error::codes;
use tidemark_core::store::ReceiveOutcome;
use tidemark_core::{Envelope, Error, Result};

use crate::kafka::RECONNECT_BACKOFF_MAX_MS;
use crate::source::{Inbox, SourceReport};

/// The longest consumer group id accepted (Kafka's own limit on names, as for topics).
const GROUP_BYTES_MAX: usize = 249;
/// Records per pull, at most.
const KAFKA_SOURCE_BATCH_MAX: usize = 1_000;
/// The session timeout's bounds, in ms (a broker also refuses a member whose timeout is outside
/// its `group.min.session.timeout.ms` .. `group.max.session.timeout.ms`, by default 6 s .. 30 min).
const SESSION_TIMEOUT_MS_RANGE: std::ops::RangeInclusive<u64> = 1_000..=1_800_000;
/// The longest librdkafka lets a member go between two polls before it leaves the group, in ms
/// (its default): a pull stores at most one batch between polls. Raised to the session timeout
/// when that is longer, as librdkafka requires.
const MAX_POLL_INTERVAL_MS: u64 = 300_000;
/// The longest heartbeat interval, in ms (librdkafka's default; a third of the session timeout
/// when that is shorter).
const HEARTBEAT_INTERVAL_MS_MAX: u64 = 3_000;
/// librdkafka refuses a `socket.connection.setup.timeout.ms` below one second.
const CONNECTION_SETUP_TIMEOUT_MS_MIN: u128 = 1_000;
/// How long a request to a broker may go unanswered before librdkafka gives it up and closes
/// the connection, in ms (its default is a minute). A connection the network black-holed, or a
/// broker that lost a request, otherwise stalls the member's fetches or its coordinator's
/// heartbeats and commits for a whole minute, far past its session timeout (found by
/// `tidemark chaos --broker kafka-mock`). A fetch waits at most `fetch.wait.max.ms` (500 ms) at
/// the broker, and a JoinGroup has its own, longer timeout, so 10 s only ever ends a request
/// that is lost.
const SOCKET_TIMEOUT_MS: u64 = 10_000;

/// Where to consume from: a Kafka topic and the consumer group reading it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaSourceConfig {
    /// `kafka://host:port[,host:port...]/<topic>`: the bootstrap servers and the topic, as a relay
    /// produces to it.
    pub from: String,
    /// The consumer group (`group.id`): its members share the topic's partitions, and the
    /// cluster keeps its committed offsets (1..=249 of A-Z a-z 0-9 `_` `-` `.` `:`).
    pub group: String,
    /// Records per pull (1..=1,000).
    pub batch: usize,
    /// How long after a member stops heartbeating (a crash, a cut network) the group gives its
    /// partitions to the other members, in ms (1,000..=1,800,000; librdkafka's default is
    /// 45,000). Kafka's counterpart of JetStream's `ack_wait`: records a dead member read but did
    /// not commit are read again once its partitions move.
    pub session_timeout_ms: u64,
}

impl KafkaSourceConfig {
    /// Check the configuration: `invalid_config` for anything out of range. Answers the bootstrap
    /// servers and the topic.
    pub fn validate(&self) -> Result<(Vec<String>, String)> {
        let bad = |why: String| Error::invalid(codes::INVALID_CONFIG, why);
        let Endpoint::Kafka { bootstrap, topic } =
            Endpoint::parse(&self.from).map_err(|e| bad(format!("source from {:?}: {e}", self.from)))?
        else {
            return Err(bad(format!("source from {:?} is not a kafka:// endpoint", self.from)));
        };
        let ok_char = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':');
        if self.group.is_empty() || self.group.len() > GROUP_BYTES_MAX || !self.group.bytes().all(ok_char) {
            return Err(bad(format!(
                "source group {:?} must be 1..={GROUP_BYTES_MAX} of A-Z a-z 0-9 _ - . :",
                self.group
            )));
        }
        if !(1..=KAFKA_SOURCE_BATCH_MAX).contains(&self.batch) {
            return Err(bad(format!("source batch must be 1..={KAFKA_SOURCE_BATCH_MAX}, got {}", self.batch)));
        }
        if !SESSION_TIMEOUT_MS_RANGE.contains(&self.session_timeout_ms) {
            return Err(bad(format!(
                "source session_timeout_ms must be {}..={}, got {}",
                SESSION_TIMEOUT_MS_RANGE.start(),
                SESSION_TIMEOUT_MS_RANGE.end(),
                self.session_timeout_ms
            )));
        }
        Ok((bootstrap, topic))
    }
}

/// What the source learns from librdkafka's rebalance callbacks (run inside its polls).
#[derive(Default)]
struct GroupContext {
    /// The member holds an assignment (an empty one counts: it joined and owns nothing); false
    /// before the first and while a rebalance has revoked it.
    assigned: AtomicBool,
}

impl ClientContext for GroupContext {}

impl ConsumerContext for GroupContext {
    fn post_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(_) => self.assigned.store(true, Ordering::SeqCst),
            Rebalance::Revoke(_) => self.assigned.store(false, Ordering::SeqCst),
            Rebalance::Error(_) => {}
        }
    }
}

/// A member of a Kafka consumer group, subscribed to one topic.
pub struct KafkaSource {
    consumer: Arc<StreamConsumer<GroupContext>>,
    topic: String,
    bootstrap: String,
    batch: usize,
    /// How long a query of the cluster (metadata, committed offsets, watermarks) may take.
    query_timeout: Duration,
    /// Set when a pull starts and cleared when it finished well: a pull that failed or was dropped
    /// leaves it set (see the module documentation).
    unusable: AtomicBool,
}

/// Run a blocking librdkafka call off the async threads.
async fn blocking<T: Send + 'static>(call: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(call).await.map_err(|e| Error::Invariant(format!("a Kafka call panicked: {e}")))?
}

impl KafkaSource {
    /// Create the group member, check that the cluster answers and knows the topic (within
    /// `connect_timeout`), and subscribe. The group's partitions are assigned during the first
    /// pulls (a group's first join takes a few seconds: the broker's
    /// `group.initial.rebalance.delay.ms`).
    pub async fn connect(config: &KafkaSourceConfig, connect_timeout: Duration) -> Result<KafkaSource> {
        let (bootstrap, topic) = config.validate()?;
        let bootstrap = bootstrap.join(",");
        let session_ms = config.session_timeout_ms;
        let consumer: StreamConsumer<GroupContext> = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("group.id", &config.group)
            .set("client.id", "tidemark-source")
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("allow.auto.create.topics", "false")
            .set("session.timeout.ms", session_ms.to_string())
            .set("heartbeat.interval.ms", HEARTBEAT_INTERVAL_MS_MAX.min(session_ms / 3).to_string())
            .set("max.poll.interval.ms", MAX_POLL_INTERVAL_MS.max(session_ms).to_string())
            .set("reconnect.backoff.max.ms", RECONNECT_BACKOFF_MAX_MS.to_string())
            .set("socket.timeout.ms", SOCKET_TIMEOUT_MS.to_string())
            .set(
                "socket.connection.setup.timeout.ms",
                connect_timeout.as_millis().max(CONNECTION_SETUP_TIMEOUT_MS_MIN).to_string(),
            )
            .create_with_context(GroupContext::default())
            .map_err(|e| Error::io(format!("cannot create a Kafka consumer for {bootstrap}: {e}")))?;
        let consumer = Arc::new(consumer);
        let (checking, name, servers) = (consumer.clone(), topic.clone(), bootstrap.clone());
        blocking(move || {
            let metadata = checking
                .fetch_metadata(Some(&name), connect_timeout)
                .map_err(|e| Error::io(format!("cannot reach Kafka at {servers}: {e}")))?;
            let why = match metadata.topics().iter().find(|t| t.name() == name) {
                Some(found) if found.error().is_none() && !found.partitions().is_empty() => return Ok(()),
                Some(found) => match found.error() {
                    Some(code) => rdkafka::error::RDKafkaErrorCode::from(code).to_string(),
                    None => "it has no partitions".to_string(),
                },
                None => "not in the cluster's metadata".to_string(),
            };
            Err(Error::io(format!(
                "Kafka at {servers} has no topic {name:?} ({why}; topics are the operator's, never created here)"
            )))
        })
        .await?;
        consumer.subscribe(&[&topic]).map_err(|e| Error::io(format!("Kafka subscribe to {topic}: {e}")))?;
        Ok(KafkaSource {
            consumer,
            topic,
            bootstrap,
            batch: config.batch,
            query_timeout: connect_timeout,
            unusable: AtomicBool::new(false),
        })
    }

    /// True while the group has this member's partitions assigned to it (maybe none, when the
    /// group has more members than the topic has partitions): false before its first assignment
    /// and during a rebalance.
    pub fn joined(&self) -> bool {
        self.consumer.context().assigned.load(Ordering::SeqCst)
    }

    /// One pull into `inbox` for `consumer_id` (see the module documentation), waiting at most
    /// `wait` for a first record. An error storing or committing a batch is an `Err`; what was
    /// stored stays stored, nothing of the batch is committed, and the batch is rewound so that
    /// the next pull reads it again; when the rewind fails too, the source is unusable from
    /// then on ([`KafkaSource::usable`] is false): connect anew. Consumer errors (a broker down,
    /// a transport failure: librdkafka reports each as an event of its own and goes on
    /// reconnecting by itself) take no record and move no position: the pull reads past them,
    /// and one that saw only errors within `wait` is an `Err`, but the source stays usable, so
    /// that a broker's outage does not cost the group a member leaving and joining again.
    pub async fn pull(&self, inbox: &dyn Inbox, consumer_id: &str, wait: Duration) -> Result<SourceReport> {
        if !self.usable() {
            return Err(Error::io(format!(
                "this Kafka consumer of {} failed or was interrupted in an earlier pull, so its position is past \
                 offsets it never committed: connect anew",
                self.topic
            )));
        }
        // Consumer errors are events of their own in the queue, one per failed connection
        // attempt while a broker is down: read past them to the first record, so that those
        // queued during an outage never stand before the records that follow it. A pull that saw
        // errors and no record fails with the last one.
        let deadline = tokio::time::Instant::now() + wait;
        let mut error = None;
        let first = loop {
            match tokio::time::timeout_at(deadline, self.consumer.recv()).await {
                Err(_nothing_within_wait) => {
                    return match error {
                        Some(error) => Err(Error::io(format!("Kafka read of {}: {error}", self.topic))),
                        None => Ok(SourceReport::default()),
                    }
                }
                Ok(Err(failed)) => error = Some(failed),
                Ok(Ok(first)) => break first.detach(),
            }
        };
        // Unusable until the batch is committed or rewound: a pull dropped in between leaves
        // the position past records it never committed.
        self.unusable.store(true, Ordering::SeqCst);
        let records = self.take_batch(first).await;
        match self.store_batch(&records, inbox, consumer_id).await {
            Ok(report) => {
                self.unusable.store(false, Ordering::SeqCst);
                Ok(report)
            }
            Err(error) => {
                if self.rewind(&records).await {
                    self.unusable.store(false, Ordering::SeqCst);
                }
                Err(error)
            }
        }
    }

    /// False once a pull was dropped after it took a record, or failed and could not rewind:
    /// its position may be past offsets it never committed.
    pub fn usable(&self) -> bool {
        !self.unusable.load(Ordering::SeqCst)
    }

    /// `first` and what librdkafka already holds after it, up to the batch.
    async fn take_batch(&self, first: OwnedMessage) -> Vec<OwnedMessage> {
        let mut records: Vec<OwnedMessage> = Vec::with_capacity(self.batch);
        records.push(first);
        // Then what librdkafka already holds (a zero timeout polls once): the batch never waits
        // for more. A consumer error ends the batch: it is an event of its own, no record is
        // behind it, and what was taken before it is stored and committed as usual.
        while records.len() < self.batch {
            match tokio::time::timeout(Duration::ZERO, self.consumer.recv()).await {
                Ok(Ok(received)) => records.push(received.detach()),
                Err(_) | Ok(Err(_)) => break,
            }
        }
        records
    }

    /// After a batch failed (its inbox call or its offset commit): set the fetch position of
    /// each of its partitions back to the batch's first record there, so that the member reads
    /// them again (the inbox answers `duplicate` for what it stored) instead of past them. A
    /// partition no longer assigned needs nothing: its next owner, this member included, starts
    /// from the committed offset. True when every partition still assigned was rewound; false
    /// leaves the source unusable.
    async fn rewind(&self, records: &[OwnedMessage]) -> bool {
        let mut firsts: std::collections::BTreeMap<i32, i64> = std::collections::BTreeMap::new();
        for record in records {
            let first = firsts.entry(record.partition()).or_insert(record.offset());
            *first = (*first).min(record.offset());
        }
        let (consumer, topic, timeout) = (self.consumer.clone(), self.topic.clone(), self.query_timeout);
        blocking(move || {
            for (partition, first) in firsts {
                if let Err(error) = consumer.seek(&topic, partition, Offset::Offset(first), timeout) {
                    let assignment = consumer.assignment().map_err(|e| Error::io(e.to_string()))?;
                    if assignment.find_partition(&topic, partition).is_some() {
                        return Err(Error::io(format!("seek of {topic}[{partition}] to {first}: {error}")));
                    }
                }
            }
            Ok(())
        })
        .await
        .is_ok()
    }

    /// Store `records` in the inbox, then commit past them.
    async fn store_batch(
        &self,
        records: &[OwnedMessage],
        inbox: &dyn Inbox,
        consumer_id: &str,
    ) -> Result<SourceReport> {
        let mut report = SourceReport { fetched: records.len() as u64, ..SourceReport::default() };

        // The offset to commit per partition: one past the last record of the batch.
        let mut next_offsets: std::collections::BTreeMap<i32, i64> = std::collections::BTreeMap::new();
        let mut envelopes = Vec::with_capacity(records.len());
        for record in records {
            let (partition, offset) = (record.partition(), record.offset());
            // Records of a partition arrive in offset order; a batch never holds one twice (a
            // rebalance, which could rewind a partition, ends the batch), but the largest wins.
            let next = next_offsets.entry(partition).or_insert(offset + 1);
            *next = (*next).max(offset + 1);
            match Envelope::parse(record.payload().unwrap_or_default()) {
                Ok(envelope) => envelopes.push(envelope),
                Err(error) => {
                    report.rejected += 1;
                    report.reject_reason(format!("{}[{partition}]@{offset}: not an envelope: {error}", self.topic));
                }
            }
        }
        if !envelopes.is_empty() {
            let stored = envelopes.len();
            let outcomes = inbox.receive(consumer_id, envelopes).await?;
            if outcomes.len() != stored {
                return Err(Error::Invariant(format!("{} outcomes for {stored} events", outcomes.len())));
            }
            for outcome in outcomes {
                match outcome {
                    ReceiveOutcome::Accepted { .. } => report.accepted += 1,
                    ReceiveOutcome::Duplicate { .. } => report.duplicate += 1,
                    ReceiveOutcome::Conflict { event_id, reason, .. } => {
                        report.rejected += 1;
                        report.reject_reason(format!("{event_id}: conflict: {reason}"));
                    }
                    ReceiveOutcome::Expired { event_id, horizon_ms, .. } => {
                        report.rejected += 1;
                        report.reject_reason(format!("{event_id}: expired: older than the horizon of {horizon_ms} ms"));
                    }
                }
            }
        }
        self.commit(next_offsets).await?;
        Ok(report)
    }

    /// Commit `next_offsets` of the partitions still assigned to this member, and wait for the
    /// group coordinator's answer. A partition revoked meanwhile is left to its new owner.
    async fn commit(&self, next_offsets: std::collections::BTreeMap<i32, i64>) -> Result<()> {
        let assignment =
            self.consumer.assignment().map_err(|e| Error::io(format!("Kafka assignment of {}: {e}", self.topic)))?;
        let mut offsets = TopicPartitionList::with_capacity(next_offsets.len());
        for (partition, next) in next_offsets {
            if assignment.find_partition(&self.topic, partition).is_some() {
                offsets
                    .add_partition_offset(&self.topic, partition, Offset::Offset(next))
                    .map_err(|e| Error::Invariant(format!("offset {next} of partition {partition}: {e}")))?;
            }
        }
        if offsets.count() == 0 {
            return Ok(());
        }
        let (consumer, topic, servers) = (self.consumer.clone(), self.topic.clone(), self.bootstrap.clone());
        // A synchronous commit returns once the coordinator answered (or librdkafka's request
        // timeout passed).
        blocking(move || {
            consumer
                .commit(&offsets, CommitMode::Sync)
                .map_err(|e| Error::io(format!("Kafka offset commit of {topic} at {servers}: {e}")))
        })
        .await
    }

    /// True when this member has joined and every partition assigned to it has nothing beyond
    /// the group's committed offset (a partition never committed counts from its earliest
    /// offset): what `tidemark consume --until-idle` waits for.
    pub async fn caught_up(&self) -> Result<bool> {
        if !self.joined() {
            return Ok(false);
        }
        let (consumer, timeout, topic) = (self.consumer.clone(), self.query_timeout, self.topic.clone());
        blocking(move || {
            let failed = |what: &str, e: rdkafka::error::KafkaError| Error::io(format!("Kafka {what} of {topic}: {e}"));
            let assignment = consumer.assignment().map_err(|e| failed("assignment", e))?;
            let committed =
                consumer.committed_offsets(assignment, timeout).map_err(|e| failed("committed offsets", e))?;
            for element in committed.elements() {
                let (low, high) = consumer
                    .fetch_watermarks(element.topic(), element.partition(), timeout)
                    .map_err(|e| failed("watermarks", e))?;
                let next = match element.offset() {
                    Offset::Offset(next) => next.max(low),
                    _ => low,
                };
                if next < high {
                    return Ok(false);
                }
            }
            Ok(true)
        })
        .await
    }
}
