//! An in-process pipeline on SQLite files (producer, relay, consumers), shared by `demo`,
//! `experiment` and `bench`.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use tidemark_builtins::reservation::{self, ReservationHandler};
use tidemark_core::flow::{AdvanceOutcome, AdvanceRequest};
use tidemark_core::policy::RetentionPolicy;
use tidemark_core::reservation::ReservationMachine;
use tidemark_core::store::{ConsumerStore, DrainReport, DrainScope, ProducerStore, Subscription};
use tidemark_core::Result;
use tidemark_engine::{relay_until_idle, RelayOptions, RelayReport};
use tidemark_store_sqlite::{Durability, SqliteConsumer, SqliteEndpoints, SqliteProducer};

/// One producer file and one consumer file in a folder.
pub struct Pipeline {
    /// `producer.db` in the pipeline's folder.
    pub producer_path: PathBuf,
    /// `consumer.db` in the pipeline's folder (the inbox of every subscribed consumer).
    pub consumer_path: PathBuf,
    /// The producer store (source given at creation), with the reservation machine's flows.
    pub producer: SqliteProducer,
    /// The consumer store, with the reservation projection installed.
    pub consumer: SqliteConsumer,
    /// The relay's endpoints (the consumer file, opened once and kept).
    pub endpoints: SqliteEndpoints,
}

impl Pipeline {
    /// Create `producer.db` (source `source`) and `consumer.db` in `dir`, subscribing each of
    /// `consumer_ids` to the producer.
    pub fn create(
        dir: &Path,
        source: &str,
        consumer_ids: &[&str],
        durability: Durability,
        now_ms: i64,
    ) -> Result<Pipeline> {
        let producer_path = dir.join("producer.db");
        let consumer_path = dir.join("consumer.db");
        drop(SqliteProducer::init(&producer_path, source)?);
        let consumer = SqliteConsumer::init(&consumer_path, RetentionPolicy::default())?;
        reservation::install(&consumer)?;
        drop(consumer);
        let mut producer = SqliteProducer::open_with(&producer_path, durability)?;
        for id in consumer_ids {
            producer.subscribe(
                &Subscription { consumer_id: id.to_string(), endpoint: consumer_path.to_string_lossy().into_owned() },
                true,
                now_ms,
            )?;
        }
        let consumer = SqliteConsumer::open_with(&consumer_path, durability)?;
        Ok(Pipeline { producer_path, consumer_path, producer, consumer, endpoints: SqliteEndpoints::new(durability) })
    }

    /// Advance reservation flow `flow` from `expected_seq` to `to` (with `quantity` when given, and
    /// payload schema `schema_version`), in one producer transaction.
    pub fn advance(
        &mut self,
        flow: &str,
        expected_seq: i64,
        to: &str,
        quantity: Option<i64>,
        schema_version: u32,
        now_ms: i64,
    ) -> Result<AdvanceOutcome> {
        let input = match quantity {
            Some(q) => json!({"quantity": q}),
            None => json!({}),
        };
        let request = AdvanceRequest {
            flow_id: flow.into(),
            expected_seq,
            to_state: to.into(),
            input,
            schema_version,
            traceparent: None,
        };
        Ok(self.producer.advance_batch(&ReservationMachine, &[request], now_ms)?.remove(0))
    }

    /// Relay until nothing is due (bounded by `passes_max`).
    pub fn relay_all(&mut self, options: &RelayOptions, now_ms: i64, passes_max: u32) -> Result<RelayReport> {
        Ok(relay_until_idle(&mut self.producer, &mut self.endpoints, options, passes_max, &mut || now_ms, &mut || 0.5)?
            .0)
    }

    /// Drain up to `limit` events of `consumer_id` with the reservation handler (v1 decoders, and
    /// v2 with `support_v2`), in one consumer transaction.
    pub fn drain(&mut self, consumer_id: &str, limit: usize, support_v2: bool, now_ms: i64) -> Result<DrainReport> {
        let mut handler = ReservationHandler::new(support_v2);
        self.consumer.drain(consumer_id, &DrainScope::All, limit, &mut handler, now_ms)
    }

    /// Projection and effects of the consumer file, as JSON.
    pub fn consumer_state(&self) -> Result<Value> {
        let (projections, effects) = reservation::read(self.consumer.connection(), 100_000)?;
        Ok(json!({"projections": projections, "effects": effects}))
    }
}
