//! The scenario harness: one producer store and any number of consumer stores (files in a
//! scenario's own temporary folder, or schemas of its own on a PostgreSQL server), driven
//! in-process through the library crates or through real child processes of this binary; every
//! step is recorded, and the final state is read back and normalised (event ids and generations
//! replaced by stable labels, stores by their names in the scenario; no timestamps, paths,
//! schemas or PIDs), so that one expected state holds for both backends.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{json, Map, Value};
use tidemark_builtins::reservation::{postgres as reservation_pg, Effect, ReservationHandler};
use tidemark_core::error::codes;
use tidemark_core::flow::{AdvanceOutcome, AdvanceRequest};
use tidemark_core::location::{PostgresLocation, StoreLocation};
use tidemark_core::reservation::ReservationMachine;
use tidemark_core::store::{
    ConsumerStore, DeliveryAction, DeliveryEntry, DeliveryStatus, DrainReport, DrainScope, FlowCursor, HandleError,
    Handler, InboxEntry, ProducerIdentity, ProducerStore, PruneReport, ReceiveOutcome, RenameReport, Subscription,
};
use tidemark_core::{Envelope, Error, Result};
use tidemark_engine::{relay_once, relay_until_idle, RelayOptions, RelayReport};
use tidemark_store_sqlite::Durability;

use crate::stores::{schema_url, Consumer, Endpoints, Producer, ReservationSnapshot};

/// Rows read per table when capturing a state (scenarios hold a few dozen).
const STATE_ROWS_MAX: usize = 10_000;
/// Relay passes of one `relay_until_idle` call.
const RELAY_PASSES_MAX: u32 = 100;
/// The exit code of the deliberately wrong dual write (and of its safe counterpart).
pub const CHILD_EXIT_CODE: i32 = 81;

fn to_value<T: serde::Serialize>(value: &T) -> Value {
    serde_json::to_value(value).expect("outputs serialise")
}

fn io(what: &str, error: std::io::Error) -> Error {
    Error::io(format!("{what}: {error}"))
}

pub fn error_json(error: &Error) -> Value {
    json!({"error": {"code": error.code(), "message": error.to_string()}})
}

/// True for ids tidemark generates (UUID "simple" form: 32 lowercase hex digits).
fn is_generated_id(value: &str) -> bool {
    value.len() == 32 && value.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Stable names for generated ids, and the text normaliser.
#[derive(Default)]
pub struct Labels {
    events: HashMap<String, String>,
    used: HashSet<String>,
    generations: HashMap<String, String>,
    /// Texts replaced by a label (folder paths by `<dir>`, store locations by `<name>`),
    /// longest first.
    replacements: Vec<(String, String)>,
}

impl Labels {
    /// `gen-1`, `gen-2`, ... in the order generations are first seen.
    pub fn generation(&mut self, generation: &str) -> String {
        if !is_generated_id(generation) {
            return generation.to_string();
        }
        let next = format!("gen-{}", self.generations.len() + 1);
        self.generations.entry(generation.to_string()).or_insert(next).clone()
    }

    /// `source/flow/seq` for a generated event id; a second event at the same position gets
    /// `@gen-N` (its generation) appended. Hand-made ids (forged events) keep their own name.
    pub fn event(&mut self, event_id: &str, source: &str, flow_id: &str, seq: i64, generation: &str) -> String {
        if let Some(label) = self.events.get(event_id) {
            return label.clone();
        }
        if !is_generated_id(event_id) {
            return event_id.to_string();
        }
        let base = format!("{source}/{flow_id}/{seq}");
        let mut label = base.clone();
        if self.used.contains(&label) {
            label = format!("{base}@{}", self.generation(generation));
        }
        let mut n = 2;
        while self.used.contains(&label) {
            label = format!("{base}#{n}");
            n += 1;
        }
        self.name(event_id, &label);
        label
    }

    pub fn envelope(&mut self, event: &Envelope) -> String {
        self.event(&event.event_id, &event.source, &event.flow_id, event.seq, &event.generation)
    }

    /// Give an id an explicit label.
    pub fn name(&mut self, event_id: &str, label: &str) {
        self.used.insert(label.to_string());
        self.events.insert(event_id.to_string(), label.to_string());
    }

    pub fn known(&self, event_id: &str) -> String {
        self.events.get(event_id).cloned().unwrap_or_else(|| self.text(event_id))
    }

    pub fn add_path(&mut self, path: &Path) {
        self.replace(&path.to_string_lossy(), "<dir>");
    }

    /// Show `text` (a store's location as messages name it) as `label`.
    pub fn replace(&mut self, text: &str, label: &str) {
        if !self.replacements.iter().any(|(t, _)| t == text) {
            self.replacements.push((text.to_string(), label.to_string()));
        }
        self.replacements.sort_by_key(|(t, _)| std::cmp::Reverse(t.len()));
    }

    /// Replace store locations by their names, folder paths by `<dir>` and generated ids by
    /// their labels.
    pub fn text(&self, text: &str) -> String {
        let mut text = text.to_string();
        for (from, label) in &self.replacements {
            text = text.replace(from.as_str(), label);
        }
        let mut out = String::with_capacity(text.len());
        let mut run = String::new();
        let flush = |run: &mut String, out: &mut String| {
            if run.len() == 32 {
                let label = self.events.get(run.as_str()).or_else(|| self.generations.get(run.as_str()));
                out.push_str(label.map_or("<unlabelled-id>", String::as_str));
            } else {
                out.push_str(run);
            }
            run.clear();
        };
        for ch in text.chars() {
            if ch.is_ascii_digit() || ('a'..='f').contains(&ch) {
                run.push(ch);
            } else {
                flush(&mut run, &mut out);
                out.push(ch);
            }
        }
        flush(&mut run, &mut out);
        out
    }

    /// Normalise a JSON value: texts as in [`Labels::text`]; timestamps (`*_at_ms`) and content
    /// hashes (they cover random ids) dropped.
    pub fn value(&self, value: &Value) -> Value {
        match value {
            Value::String(s) => Value::String(self.text(s)),
            Value::Array(items) => Value::Array(items.iter().map(|v| self.value(v)).collect()),
            Value::Object(map) => Value::Object(
                map.iter()
                    .filter(|(k, _)| !(k.ends_with("_at_ms") || k.as_str() == "content_hash"))
                    .map(|(k, v)| (k.clone(), self.value(v)))
                    .collect(),
            ),
            other => other.clone(),
        }
    }
}

/// One named assertion of a scenario.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Assertion {
    pub name: String,
    pub passed: bool,
    pub detail: String,
}

/// A child process's exit code and its JSON output (null when it printed none).
pub struct ChildRun {
    pub code: i32,
    pub json: Value,
}

/// Where a scenario's stores live.
#[derive(Clone)]
pub enum Place {
    /// SQLite files in the scenario's folder: `<dir>/<name>.db`.
    Files,
    /// Schemas on a PostgreSQL server: `<prefix>_<name>` (`-` in a name becomes `_`).
    Postgres {
        /// The driver's connection string (without `schema`).
        conn: String,
        /// The scenario's schema prefix.
        prefix: String,
    },
}

/// The world of one scenario.
pub struct Sc {
    pub dir: PathBuf,
    /// The scenario clock's origin; every step passes an explicit `now_ms` derived from it.
    pub t0: i64,
    /// When set, steps are not recorded (used where a count would depend on scheduling).
    pub quiet: bool,
    /// When set, every list of the state is sorted: commit and apply order depend on
    /// scheduling (concurrent processes), so the state is compared as sets.
    pub unordered_state: bool,
    durability: Durability,
    place: Place,
    producer: Option<Producer>,
    consumers: BTreeMap<String, Consumer>,
    endpoints: Endpoints,
    pub labels: Labels,
    steps: Vec<Value>,
    assertions: Vec<Assertion>,
}

pub fn request(flow: &str, expected_seq: i64, to: &str, quantity: Option<i64>, schema_version: u32) -> AdvanceRequest {
    let input = match quantity {
        Some(q) => json!({"quantity": q}),
        None => json!({}),
    };
    AdvanceRequest { flow_id: flow.into(), expected_seq, to_state: to.into(), input, schema_version, traceparent: None }
}

/// The command line of `tidemark advance`.
pub fn advance_args(producer: &str, flow: &str, expected_seq: i64, to: &str, quantity: Option<i64>) -> Vec<String> {
    let mut args: Vec<String> =
        ["advance", "--producer", producer, "--flow", flow, "--to", to].iter().map(|s| s.to_string()).collect();
    args.push("--expected-seq".into());
    args.push(expected_seq.to_string());
    if let Some(q) = quantity {
        args.push("--quantity".into());
        args.push(q.to_string());
    }
    args
}

impl Sc {
    pub fn new(dir: &Path, t0: i64, durability: Durability, place: Place) -> Sc {
        let mut labels = Labels::default();
        labels.add_path(dir);
        if let Ok(canonical) = std::fs::canonicalize(dir) {
            labels.add_path(&canonical);
        }
        let endpoints = match &place {
            Place::Files => Endpoints::files(durability),
            Place::Postgres { conn, .. } => Endpoints::schemas(conn),
        };
        Sc {
            dir: dir.to_path_buf(),
            t0,
            quiet: false,
            unordered_state: false,
            durability,
            place,
            producer: None,
            consumers: BTreeMap::new(),
            endpoints,
            labels,
            steps: Vec::new(),
            assertions: Vec::new(),
        }
    }

    // ----- recording -------------------------------------------------------------------------

    pub fn record(&mut self, what: &str, result: Value) {
        if !self.quiet {
            self.steps.push(json!({"step": what, "result": result}));
        }
    }

    pub fn record_result<T: serde::Serialize>(&mut self, what: &str, result: &Result<T>) {
        let value = match result {
            Ok(value) => to_value(value),
            Err(error) => error_json(error),
        };
        self.record(what, value);
    }

    /// Add a named assertion. Names are unique within a scenario (a repeated name gets `_2`,
    /// `_3`, ... so that the expected file can list them).
    pub fn check(&mut self, name: &str, passed: bool, detail: impl Into<String>) {
        let mut unique = name.to_string();
        let mut n = 2;
        while self.assertions.iter().any(|a| a.name == unique) {
            unique = format!("{name}_{n}");
            n += 1;
        }
        self.assertions.push(Assertion { name: unique, passed, detail: detail.into() });
    }

    /// Record the full state at this point as a step.
    pub fn observe(&mut self, what: &str) -> Result<()> {
        let state = self.state()?;
        self.record(what, state);
        Ok(())
    }

    /// Steps (normalised), final state and assertions. The final state is read first so that
    /// every event committed by a child process has its label.
    pub fn finish(mut self) -> (Value, Vec<Assertion>) {
        let final_state = match self.state() {
            Ok(state) => state,
            Err(error) => error_json(&error),
        };
        let steps: Vec<Value> = self.steps.iter().map(|s| self.labels.value(s)).collect();
        let assertions = self
            .assertions
            .iter()
            .map(|a| Assertion { name: a.name.clone(), passed: a.passed, detail: self.labels.text(&a.detail) })
            .collect();
        (json!({"steps": steps, "final": final_state}), assertions)
    }

    // ----- stores --------------------------------------------------------------------------------

    /// Where the store `name` of this scenario lives (`producer`, `consumer`, `audit`, ...); its
    /// location is shown as `<name>` in the recorded state from now on.
    fn location(&mut self, name: &str) -> StoreLocation {
        let label = format!("<{name}>");
        match &self.place {
            Place::Files => {
                let path = self.dir.join(format!("{name}.db"));
                self.labels.replace(&path.to_string_lossy(), &label);
                if let Ok(canonical) = std::fs::canonicalize(&self.dir) {
                    self.labels.replace(&canonical.join(format!("{name}.db")).to_string_lossy(), &label);
                }
                StoreLocation::Sqlite(path)
            }
            Place::Postgres { conn, prefix } => {
                let schema = format!("{prefix}_{}", name.replace('-', "_"));
                for shown in [format!("PostgreSQL schema {schema}"), format!("schema {schema}"), schema.clone()] {
                    self.labels.replace(&shown, &label);
                }
                let url = schema_url(conn, &schema);
                StoreLocation::parse(&url).unwrap_or_else(|_| {
                    StoreLocation::Postgres(PostgresLocation { conn: conn.clone(), schema, masked: url })
                })
            }
        }
    }

    /// The store `name` as a command line names it (`--producer`, `--consumer-db`): the file's
    /// path, or the server's URL with `schema=`.
    pub fn store_arg(&mut self, name: &str) -> String {
        match self.location(name) {
            StoreLocation::Sqlite(path) => path.to_string_lossy().into_owned(),
            // The URL with its password: the child processes connect with it.
            StoreLocation::Postgres(pg) => schema_url(&pg.conn, &pg.schema),
        }
    }

    pub fn producer_arg(&mut self) -> String {
        self.store_arg("producer")
    }

    pub fn consumer_arg(&mut self, name: &str) -> String {
        self.store_arg(name)
    }

    /// The endpoint a subscription to the consumer store `name` holds: the file's path, or the
    /// schema on the producer's server.
    fn endpoint(&mut self, name: &str) -> String {
        match self.location(name) {
            StoreLocation::Sqlite(path) => path.to_string_lossy().into_owned(),
            StoreLocation::Postgres(pg) => pg.schema,
        }
    }

    fn producer(&mut self) -> Result<&mut Producer> {
        self.producer.as_mut().ok_or_else(|| Error::Invariant("the scenario has no open producer".into()))
    }

    fn consumer(&mut self, name: &str) -> Result<&mut Consumer> {
        self.consumers
            .get_mut(name)
            .ok_or_else(|| Error::Invariant(format!("the scenario has no consumer store {name}")))
    }

    pub fn identity(&mut self) -> Result<ProducerIdentity> {
        Ok(self.producer()?.identity().clone())
    }

    pub fn init_producer(&mut self, source: &str) -> Result<()> {
        drop(Producer::init_at(self.location("producer"), source)?);
        self.open_producer()
    }

    fn open_producer(&mut self) -> Result<()> {
        let producer = Producer::open_at(self.location("producer"), self.durability)?;
        self.labels.generation(&producer.identity().generation);
        self.producer = Some(producer);
        Ok(())
    }

    pub fn init_consumer(&mut self, name: &str, horizon_ms: i64) -> Result<()> {
        let location = self.location(name);
        drop(Consumer::init_at(location.clone(), tidemark_core::policy::RetentionPolicy { horizon_ms })?);
        let store = Consumer::open_at(location, self.durability, true)?;
        self.consumers.insert(name.to_string(), store);
        Ok(())
    }

    /// Subscribe `consumer_id` with the consumer store `name` as its endpoint (the store need
    /// not exist yet: an unreachable endpoint is a failed delivery attempt).
    pub fn subscribe(&mut self, consumer_id: &str, name: &str, from_start: bool, t: i64) -> Result<u64> {
        let endpoint = self.endpoint(name);
        let subscription = Subscription { consumer_id: consumer_id.to_string(), endpoint };
        self.producer()?.subscribe(&subscription, from_start, t)
    }

    /// A producer `shop` and a consumer store `consumer` (30-day horizon) with these subscribers.
    pub fn pipeline(&mut self, consumer_ids: &[&str]) -> Result<()> {
        self.init_producer("shop")?;
        self.init_consumer("consumer", tidemark_core::policy::RetentionPolicy::default().horizon_ms)?;
        for id in consumer_ids {
            self.subscribe(id, "consumer", true, self.t0)?;
        }
        Ok(())
    }

    /// Re-run `init` on existing stores (it must never reset anything).
    pub fn reinit_producer(&mut self, source: &str) -> Result<ProducerIdentity> {
        Producer::init_at(self.location("producer"), source).map(|p| p.identity().clone())
    }

    pub fn reinit_consumer(&mut self, name: &str, horizon_ms: i64) -> Result<i64> {
        Consumer::init_at(self.location(name), tidemark_core::policy::RetentionPolicy { horizon_ms })
            .map(|c| c.retention().horizon_ms)
    }

    /// Close the producer and back it up as the store `backup`: a copy of its file (a
    /// consistent copy: the last connection closing checkpoints the WAL), or a `pg_dump` of its
    /// schema into the scenario's folder.
    pub fn backup_producer(&mut self, backup: &str) -> Result<()> {
        self.producer = None;
        match (self.location("producer"), self.location(backup)) {
            (StoreLocation::Sqlite(from), StoreLocation::Sqlite(to)) => {
                std::fs::copy(&from, &to).map_err(|e| io("backing up the producer", e))?;
                let wal = wal_path(&from);
                if wal.exists() {
                    std::fs::copy(&wal, wal_path(&to)).map_err(|e| io("backing up the producer WAL", e))?;
                }
            }
            (StoreLocation::Postgres(from), StoreLocation::Postgres(_)) => {
                let file = self.dir.join(format!("{backup}.dump"));
                let file = file.to_string_lossy();
                pg_tool(
                    "pg_dump",
                    &["--format=custom", "--schema", &from.schema, "--file", &file, "--dbname", &from.conn],
                )?;
            }
            _ => return Err(Error::Invariant("a scenario's stores live in one place".into())),
        }
        self.open_producer()
    }

    /// Close the producer, put the backup in its place and reopen it (on PostgreSQL: drop its
    /// schema and `pg_restore` the dump).
    pub fn restore_producer(&mut self, backup: &str) -> Result<()> {
        self.producer = None;
        match (self.location("producer"), self.location(backup)) {
            (StoreLocation::Sqlite(to), StoreLocation::Sqlite(from)) => {
                for suffix in ["-wal", "-shm"] {
                    let path = PathBuf::from(format!("{}{suffix}", to.display()));
                    if path.exists() {
                        std::fs::remove_file(&path).map_err(|e| io("removing the old WAL", e))?;
                    }
                }
                std::fs::copy(&from, &to).map_err(|e| io("restoring the producer", e))?;
                if wal_path(&from).exists() {
                    std::fs::copy(wal_path(&from), wal_path(&to)).map_err(|e| io("restoring the WAL", e))?;
                }
            }
            (StoreLocation::Postgres(to), StoreLocation::Postgres(_)) => {
                let file = self.dir.join(format!("{backup}.dump"));
                drop_schemas(&to.conn, std::slice::from_ref(&to.schema))?;
                pg_tool("pg_restore", &["--exit-on-error", "--dbname", &to.conn, &file.to_string_lossy()])?;
            }
            _ => return Err(Error::Invariant("a scenario's stores live in one place".into())),
        }
        self.open_producer()
    }

    pub fn rotate_generation(&mut self, what: &str) -> Result<ProducerIdentity> {
        let identity = self.producer()?.rotate_generation()?;
        self.labels.generation(&identity.generation);
        self.record(what, to_value(&identity));
        Ok(identity)
    }

    // ----- producer ------------------------------------------------------------------------------

    pub fn try_advance(
        &mut self,
        what: &str,
        request: AdvanceRequest,
        t: i64,
    ) -> Result<std::result::Result<AdvanceOutcome, Error>> {
        let producer = self.producer()?;
        let result = producer.advance_batch(&ReservationMachine, &[request], t).map(|mut o| o.remove(0));
        if let Ok(AdvanceOutcome::Committed { event_id, flow_id, seq, .. }) = &result {
            let identity = producer.identity().clone();
            self.labels.event(event_id, &identity.source, flow_id, *seq, &identity.generation);
        }
        self.record_result(what, &result);
        match result {
            Err(error) if !error.is_invalid_input() => Err(error),
            other => Ok(other),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn advance(
        &mut self,
        what: &str,
        flow: &str,
        expected_seq: i64,
        to: &str,
        quantity: Option<i64>,
        schema_version: u32,
        t: i64,
    ) -> Result<AdvanceOutcome> {
        self.try_advance(what, request(flow, expected_seq, to, quantity, schema_version), t)?
    }

    /// The user's own business table on the producer file (for the dual-write scenarios).
    pub fn create_orders_table(&mut self) -> Result<()> {
        self.producer()?.install_orders()
    }

    /// Write a business row and reserve its flow in one producer transaction; commit or roll it
    /// back.
    pub fn business_advance(&mut self, what: &str, order_id: &str, quantity: i64, commit: bool, t: i64) -> Result<()> {
        let producer = self.producer()?;
        let identity = producer.identity().clone();
        let request = request(order_id, 0, "reserved", Some(quantity), 1);
        let outcome = producer.advance_with_order(order_id, quantity, &request, commit, &mut || {}, t)?;
        if let AdvanceOutcome::Committed { event_id, flow_id, seq, .. } = &outcome {
            if commit {
                self.labels.event(event_id, &identity.source, flow_id, *seq, &identity.generation);
            } else {
                self.labels.name(event_id, &format!("rolled-back:{}/{flow_id}/{seq}", identity.source));
            }
        }
        self.record(what, json!({"advance": to_value(&outcome), "committed": commit}));
        Ok(())
    }

    pub fn orders(&mut self) -> Result<Vec<String>> {
        orders(self.producer()?)
    }

    pub fn relay(&mut self, what: &str, options: &RelayOptions, t: i64) -> Result<RelayReport> {
        let mut options = options.clone();
        options.keep_answers = true;
        let producer = self.producer.as_mut().ok_or_else(|| Error::Invariant("no producer".into()))?;
        let report = relay_once(producer, &mut self.endpoints, &options, t, &mut || 0.5)?;
        self.record(what, to_value(&report));
        Ok(report)
    }

    /// Relay passes at the same instant until one attempts nothing; one recorded step.
    pub fn relay_until_idle(&mut self, what: &str, options: &RelayOptions, t: i64) -> Result<RelayReport> {
        let mut options = options.clone();
        options.keep_answers = true;
        let producer = self.producer.as_mut().ok_or_else(|| Error::Invariant("no producer".into()))?;
        let (total, _) =
            relay_until_idle(producer, &mut self.endpoints, &options, RELAY_PASSES_MAX, &mut || t, &mut || 0.5)?;
        self.record(what, to_value(&total));
        Ok(total)
    }

    pub fn deliveries(&mut self) -> Result<Vec<DeliveryEntry>> {
        self.producer()?.deliveries(None, tidemark_core::limits::PAGE_SIZE_MAX)
    }

    pub fn pending_deliveries(&mut self) -> Result<usize> {
        Ok(self.producer()?.deliveries(Some(DeliveryStatus::Pending), tidemark_core::limits::PAGE_SIZE_MAX)?.len())
    }

    pub fn resolve(
        &mut self,
        what: &str,
        event_id: &str,
        consumer_id: &str,
        action: DeliveryAction,
        reason: &str,
        t: i64,
    ) -> Result<std::result::Result<DeliveryEntry, Error>> {
        let result = self.producer()?.resolve_delivery(event_id, consumer_id, action, reason, t);
        self.record_result(what, &result);
        match result {
            Err(error) if !error.is_invalid_input() => Err(error),
            other => Ok(other),
        }
    }

    /// The producer's outbox, in commit order.
    pub fn outbox(&mut self) -> Result<Vec<Envelope>> {
        let producer = self.producer()?;
        let outbox = producer.snapshot(STATE_ROWS_MAX)?.outbox;
        for event in &outbox {
            self.labels.envelope(event);
        }
        Ok(outbox)
    }

    /// The latest outbox event at `flow`/`seq`.
    pub fn event(&mut self, flow: &str, seq: i64) -> Result<Envelope> {
        self.outbox()?
            .into_iter()
            .rev()
            .find(|e| e.flow_id == flow && e.seq == seq)
            .ok_or_else(|| Error::Invariant(format!("no outbox event {flow}/{seq}")))
    }

    // ----- consumers -----------------------------------------------------------------------------

    pub fn receive(
        &mut self,
        what: &str,
        consumer: &str,
        consumer_id: &str,
        event: &Envelope,
        t: i64,
    ) -> Result<ReceiveOutcome> {
        let outcome = self.consumer(consumer)?.receive_batch(&[(consumer_id, event)], t)?.remove(0);
        self.record(what, to_value(&outcome));
        Ok(outcome)
    }

    pub fn drain(
        &mut self,
        what: &str,
        consumer: &str,
        consumer_id: &str,
        limit: usize,
        support_v2: bool,
        t: i64,
    ) -> Result<DrainReport> {
        let result = self.consumer(consumer)?.drain(consumer_id, &DrainScope::All, limit, support_v2, t);
        self.record_result(what, &result);
        result
    }

    /// Drain with the built-in handler made to fail (an infrastructure failure, not a refusal)
    /// on its `fail_on`-th event, after it has written that event's effect.
    pub fn drain_failing_on(
        &mut self,
        what: &str,
        consumer: &str,
        consumer_id: &str,
        limit: usize,
        fail_on: u32,
        t: i64,
    ) -> Result<DrainReport> {
        let scope = DrainScope::All;
        let result = match self.consumer(consumer)? {
            Consumer::Sqlite(c) => {
                let mut handler = FailOnCall { inner: ReservationHandler::new(false), fail_on, calls: 0 };
                c.drain(consumer_id, &scope, limit, &mut handler, t)
            }
            Consumer::Postgres(c, _) => {
                let mut handler =
                    FailOnCall { inner: reservation_pg::ReservationHandler::new(false), fail_on, calls: 0 };
                c.drain(consumer_id, &scope, limit, &mut handler, t)
            }
        };
        self.record_result(what, &result);
        result
    }

    pub fn prune(&mut self, what: &str, consumer: &str, applied_retention_ms: i64, t: i64) -> Result<PruneReport> {
        let report = self.consumer(consumer)?.prune(applied_retention_ms, 1_000, t)?;
        self.record(what, to_value(&report));
        Ok(report)
    }

    /// Rename on the consumer file, then (optionally) the producer's subscription.
    pub fn rename(
        &mut self,
        what: &str,
        consumer: &str,
        from: &str,
        to: &str,
        with_producer: bool,
    ) -> Result<std::result::Result<(RenameReport, Option<u64>), Error>> {
        let t0 = self.t0;
        let consumer_result = self.consumer(consumer)?.rename_consumer(from, to, t0);
        let result = match consumer_result {
            Ok(report) if with_producer => {
                self.producer()?.rename_subscription(from, to).map(|moved| (report, Some(moved)))
            }
            Ok(report) => Ok((report, None)),
            Err(error) => Err(error),
        };
        let value = match &result {
            Ok((report, moved)) => json!({"consumer": to_value(report), "producer_deliveries_moved": moved}),
            Err(error) => error_json(error),
        };
        self.record(what, value);
        match result {
            Err(error) if !error.is_invalid_input() => Err(error),
            other => Ok(other),
        }
    }

    /// Tamper on purpose, as the seed did: delete a consumer's inbox record and receipt of one
    /// event with plain SQL (no tidemark operation does this), leaving its effect in place.
    pub fn delete_dedup_records_by_hand(
        &mut self,
        consumer: &str,
        consumer_id: &str,
        flow_id: &str,
        seq: i64,
    ) -> Result<usize> {
        self.consumer(consumer)?.forget_dedup_records(consumer_id, flow_id, seq)
    }

    fn read(&mut self, consumer: &str) -> Result<ReservationSnapshot> {
        self.consumer(consumer)?.snapshot_with_reservations(STATE_ROWS_MAX)
    }

    pub fn inbox(&mut self, consumer: &str) -> Result<Vec<InboxEntry>> {
        Ok(self.read(consumer)?.snapshot.inbox)
    }

    pub fn cursors(&mut self, consumer: &str) -> Result<Vec<FlowCursor>> {
        self.consumer(consumer)?.cursors(None)
    }

    pub fn effects(&mut self, consumer: &str) -> Result<Vec<Effect>> {
        Ok(self.read(consumer)?.effects)
    }

    pub fn receipts(&mut self, consumer: &str) -> Result<usize> {
        Ok(self.read(consumer)?.snapshot.receipts.len())
    }

    pub fn duplicate_effects(&mut self, consumer: &str) -> Result<usize> {
        Ok(self.read(consumer)?.duplicates.len())
    }

    /// Assert that every outbox event of the producer was applied by `consumer_id` exactly once
    /// (the very event: same id, flow and seq), and that no effect was written twice.
    pub fn check_exactly_once(&mut self, consumer: &str, consumer_id: &str) -> Result<()> {
        let outbox = self.outbox()?;
        let effects = self.effects(consumer)?;
        let mut wrong = Vec::new();
        for event in &outbox {
            let count = effects
                .iter()
                .filter(|f| {
                    f.consumer_id == consumer_id
                        && f.event_id == event.event_id
                        && f.flow_id == event.flow_id
                        && f.seq == event.seq
                })
                .count();
            if count != 1 {
                wrong.push(format!("{} applied {count} times", self.labels.envelope(event)));
            }
        }
        let file = if consumer == "consumer" { String::new() } else { format!("_in_{consumer}") };
        self.check(
            &format!("{consumer_id}{file}_applied_every_event_exactly_once"),
            wrong.is_empty(),
            if wrong.is_empty() { format!("{} events, one effect each", outbox.len()) } else { wrong.join("; ") },
        );
        // One assertion per file: a later check of the same file tightens the earlier one.
        let duplicates = self.duplicate_effects(consumer)?;
        let name = format!("no_duplicate_effects{file}");
        match self.assertions.iter_mut().find(|a| a.name == name) {
            Some(existing) => {
                existing.passed &= duplicates == 0;
                if duplicates > 0 {
                    existing.detail = format!("{duplicates} duplicated effects");
                }
            }
            None => self.check(&name, duplicates == 0, format!("{duplicates} duplicated effects")),
        }
        Ok(())
    }

    // ----- child processes -----------------------------------------------------------------------

    fn command(&self, args: &[String], crash_at: Option<&str>, t: i64) -> Result<Command> {
        let exe = std::env::current_exe().map_err(|e| io("locating this binary", e))?;
        let mut command = Command::new(exe);
        if matches!(self.place, Place::Files) {
            let durability = if self.durability == Durability::Normal { "normal" } else { "full" };
            command.args(["--durability", durability]);
        }
        command.args(["--now-ms", &t.to_string()]).args(args);
        command.env_remove("TIDEMARK_CRASH_AT");
        if let Some(point) = crash_at {
            command.env("TIDEMARK_CRASH_AT", point);
        }
        command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        Ok(command)
    }

    /// Run this binary with `args` (and `TIDEMARK_CRASH_AT=crash_at`) and record its exit code
    /// and output.
    pub fn child(&mut self, what: &str, args: &[String], crash_at: Option<&str>, t: i64) -> Result<ChildRun> {
        let output = self.command(args, crash_at, t)?.output().map_err(|e| io("running a child process", e))?;
        let run = ChildRun {
            code: output.status.code().unwrap_or(-1),
            json: serde_json::from_slice(&output.stdout).unwrap_or(Value::Null),
        };
        let mut result = json!({"exit_code": run.code});
        if !run.json.is_null() {
            result["output"] = run.json.clone();
        }
        self.record(what, result);
        Ok(run)
    }

    /// Start all of these child processes at once, then wait for all. Not recorded: what each
    /// one answers depends on scheduling.
    pub fn children(&mut self, commands: &[Vec<String>], t: i64) -> Result<Vec<ChildRun>> {
        let mut started = Vec::with_capacity(commands.len());
        for args in commands {
            started.push(self.command(args, None, t)?.spawn().map_err(|e| io("starting a child process", e))?);
        }
        let mut runs = Vec::with_capacity(started.len());
        for child in started {
            let output = child.wait_with_output().map_err(|e| io("waiting for a child process", e))?;
            runs.push(ChildRun {
                code: output.status.code().unwrap_or(-1),
                json: serde_json::from_slice(&output.stdout).unwrap_or(Value::Null),
            });
        }
        Ok(runs)
    }

    // ----- state ---------------------------------------------------------------------------------

    /// The full normalised state of every file of the scenario.
    pub fn state(&mut self) -> Result<Value> {
        let Sc { producer, consumers, labels, .. } = self;
        let mut out = Map::new();
        if let Some(producer) = producer.as_mut() {
            out.insert("producer".into(), producer_state(producer, labels)?);
        }
        let mut files = Map::new();
        for (name, store) in consumers.iter() {
            files.insert(name.clone(), consumer_state(store, labels)?);
        }
        if !files.is_empty() {
            out.insert("consumers".into(), Value::Object(files));
        }
        let mut state = labels.value(&Value::Object(out));
        if self.unordered_state {
            sort_lists(&mut state);
        }
        Ok(state)
    }

    /// The normalised state of one consumer file.
    pub fn consumer_state(&mut self, name: &str) -> Result<Value> {
        let Sc { consumers, labels, .. } = self;
        let store = consumers.get(name).ok_or_else(|| Error::Invariant(format!("no consumer store {name}")))?;
        let state = consumer_state(store, labels)?;
        Ok(labels.value(&state))
    }
}

fn sort_lists(value: &mut Value) {
    match value {
        Value::Array(items) => {
            items.iter_mut().for_each(sort_lists);
            items.sort_by_key(|v| v.to_string());
        }
        Value::Object(map) => map.values_mut().for_each(sort_lists),
        _ => {}
    }
}

/// Run a PostgreSQL client tool (`pg_dump`, `pg_restore`); its failure is an `io` error with
/// what it printed.
fn pg_tool(tool: &str, args: &[&str]) -> Result<()> {
    let out = Command::new(tool)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| io(&format!("running {tool} (the PostgreSQL client tools)"), e))?;
    if !out.status.success() {
        return Err(Error::io(format!("{tool} failed: {}", String::from_utf8_lossy(&out.stderr).trim())));
    }
    Ok(())
}

/// Drop every schema whose name starts with `<prefix>_` (a scenario's stores, left over or done).
pub fn drop_scenario_schemas(conn: &str, prefix: &str) -> Result<()> {
    let mut client = tidemark_store_postgres::connect(conn)?;
    let schemas: Vec<String> = client
        .query(
            "SELECT nspname::text FROM pg_namespace WHERE starts_with(nspname, $1) ORDER BY 1",
            &[&format!("{prefix}_")],
        )?
        .iter()
        .map(|r| r.get(0))
        .collect();
    drop(client);
    drop_schemas(conn, &schemas)
}

/// Drop these schemas (and everything in them) when they exist.
pub fn drop_schemas(conn: &str, schemas: &[String]) -> Result<()> {
    let mut client = tidemark_store_postgres::connect(conn)?;
    for schema in schemas {
        tidemark_store_postgres::validate_schema_name(schema)?;
        client.batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))?;
    }
    Ok(())
}

fn wal_path(path: &Path) -> PathBuf {
    PathBuf::from(format!("{}-wal", path.display()))
}

fn orders(producer: &mut Producer) -> Result<Vec<String>> {
    Ok(producer.orders()?.into_iter().map(|(order_id, quantity)| format!("{order_id} quantity {quantity}")).collect())
}

fn position(source: &str, flow_id: &str, seq: i64) -> String {
    format!("{source}/{flow_id}/{seq}")
}

/// `source/flow/seq`, plus the event's label when it is not the plain position.
fn event_at(label: &str, source: &str, flow_id: &str, seq: i64) -> String {
    let at = position(source, flow_id, seq);
    if label == at {
        at
    } else {
        format!("{at} (event {label})")
    }
}

fn producer_state(producer: &mut Producer, labels: &mut Labels) -> Result<Value> {
    let snapshot = producer.snapshot(STATE_ROWS_MAX)?;
    let generation = labels.generation(&snapshot.identity.generation);
    let outbox: Vec<String> = snapshot
        .outbox
        .iter()
        .map(|e| {
            let label = labels.envelope(e);
            format!(
                "{} {} {} v{} {}",
                event_at(&label, &e.source, &e.flow_id, e.seq),
                labels.generation(&e.generation),
                e.event_type,
                e.schema_version,
                e.payload
            )
        })
        .collect();
    let source = snapshot.identity.source.clone();
    let deliveries: Vec<String> = snapshot
        .deliveries
        .iter()
        .map(|d| {
            let label = labels.known(&d.event_id);
            let mut line =
                format!("{} -> {}: {}", event_at(&label, &source, &d.flow_id, d.seq), d.consumer_id, d.status.as_str());
            if d.attempts > 0 {
                line.push_str(&format!(" (failed attempts {})", d.attempts));
            }
            if let Some(error) = &d.last_error {
                line.push_str(&format!(" last error: {error}"));
            }
            line
        })
        .collect();
    let flows: Vec<String> = snapshot
        .flows
        .iter()
        .map(|f| format!("{}: {} {} last_seq {}", f.flow_id, f.state.state, f.state.data, f.last_seq))
        .collect();
    let subscriptions: Vec<String> =
        snapshot.subscriptions.iter().map(|s| format!("{} -> {}", s.consumer_id, s.endpoint)).collect();
    let mut out = json!({
        "source": source,
        "generation": generation,
        "subscriptions": subscriptions,
        "flows": flows,
        "outbox": outbox,
        "deliveries": deliveries,
    });
    let orders = orders(producer)?;
    if !orders.is_empty() {
        out["orders"] = json!(orders);
    }
    Ok(out)
}

fn consumer_state(store: &Consumer, labels: &mut Labels) -> Result<Value> {
    let ReservationSnapshot { snapshot, projections, effects, duplicates } =
        store.snapshot_with_reservations(STATE_ROWS_MAX)?;
    let inbox: Vec<String> = snapshot
        .inbox
        .iter()
        .map(|i| {
            let e = &i.envelope;
            let label = labels.envelope(e);
            let mut line = format!(
                "{} {} {} {} v{} {}: {}",
                i.consumer_id,
                event_at(&label, &e.source, &e.flow_id, e.seq),
                labels.generation(&e.generation),
                e.event_type,
                e.schema_version,
                e.payload,
                i.status.as_str()
            );
            if let Some(reason) = &i.reason {
                line.push_str(&format!(" ({reason})"));
            }
            line
        })
        .collect();
    let receipts: Vec<String> = snapshot
        .receipts
        .iter()
        .map(|r| format!("{} {}", r.consumer_id, event_at(&labels.known(&r.event_id), &r.source, &r.flow_id, r.seq)))
        .collect();
    let cursors: Vec<String> = snapshot
        .cursors
        .iter()
        .map(|c| format!("{} {}/{} high-water {}", c.consumer_id, c.source, c.flow_id, c.high_water_seq))
        .collect();
    let projections: Vec<String> = projections
        .iter()
        .map(|p| {
            format!(
                "{} {}/{}: {} quantity {} last_seq {}",
                p.consumer_id, p.source, p.flow_id, p.state, p.quantity, p.last_seq
            )
        })
        .collect();
    let effects: Vec<String> = effects
        .iter()
        .map(|f| {
            format!(
                "{} {}: {} {}",
                f.consumer_id,
                event_at(&labels.known(&f.event_id), &f.source, &f.flow_id, f.seq),
                f.kind,
                f.quantity
            )
        })
        .collect();
    Ok(json!({
        "horizon_ms": snapshot.horizon_ms,
        "inbox": inbox,
        "receipts": receipts,
        "cursors": cursors,
        "projections": projections,
        "effects": effects,
        "duplicate_effects": to_value(&duplicates),
    }))
}

/// `tidemark experiment --child MODE --child-producer STORE`: the dual-write child processes of
/// the `unsafe_dual_write_loss` scenario. Both write a business row (`order-1`, `order-2`) and
/// die with exit code 81 before the event is committed; only the way they write differs.
///
/// `--child` is hidden but present in every build (failpoints or not), so
/// `--child unsafe-dual-write` is a deliberately wrong dual write that any `tidemark` binary can
/// run, on any producer store it is given (a SQLite file or a `postgres://` URL): it commits the
/// business row alone and never writes the event. It does not use
/// `tidemark_store_sqlite::unsafe_dual_write` (failpoints builds only, reached through the hidden
/// `unsafe-dual-write-advance` command); it needs no crash point.
pub fn run_child(mode: &str, producer: Option<&Path>, durability: Durability, now_ms: i64) -> Result<Value> {
    let path =
        producer.ok_or_else(|| Error::invalid(codes::INVALID_ARGUMENT, "--child needs --child-producer STORE"))?;
    let location = match path.to_str() {
        Some(text) => StoreLocation::parse(text)?,
        None => StoreLocation::Sqlite(path.to_path_buf()),
    };
    let mut producer = Producer::open_at(location, durability)?;
    match mode {
        "unsafe-dual-write" => {
            // WRONG on purpose: the business row commits in its own transaction, and the event
            // would be written by a second one. The process dies between the two.
            producer.insert_order_without_event("order-1", 3)?;
            std::process::exit(CHILD_EXIT_CODE);
        }
        "safe-exit-before-commit" => {
            // The tidemark way: the business row and the event in one transaction. The process
            // dies at the same point, before that transaction commits.
            let request = request("order-2", 0, "reserved", Some(5), 1);
            producer.advance_with_order(
                "order-2",
                5,
                &request,
                true,
                &mut || std::process::exit(CHILD_EXIT_CODE),
                now_ms,
            )?;
            Err(Error::Invariant("the child outlived its exit".into()))
        }
        other => Err(Error::invalid(codes::INVALID_ARGUMENT, format!("unknown child mode {other:?}"))),
    }
}

/// A handler that fails (an infrastructure failure, not a refusal) on its n-th call, after the
/// real handler has written its effect. One event per call (the default `batch_max`).
struct FailOnCall<H> {
    inner: H,
    fail_on: u32,
    calls: u32,
}

impl<T: ?Sized, H: Handler<T>> Handler<T> for FailOnCall<H> {
    fn handle(&mut self, tx: &T, consumer_id: &str, event: &Envelope) -> Result<(), HandleError> {
        self.calls += 1;
        self.inner.handle(tx, consumer_id, event)?;
        if self.calls == self.fail_on {
            return Err(HandleError::Failed(Error::store("simulated failure after the handler wrote its effect")));
        }
        Ok(())
    }
}
