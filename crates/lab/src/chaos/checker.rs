//! The independent checker of a chaos run: it opens the tenant's SQLite files read-only with
//! plain `rusqlite`, or its PostgreSQL schemas with a read-only session of the plain `postgres`
//! client, and reads them with SQL of its own (never the store crates under test; the same
//! statements on both, each schema its session's `search_path`); it reads the ledger of what the
//! servers acknowledged, and lists every way the stores disagree with it or with the protocol.
//! The paths, schemas and tables it reads are the documented ones (docs/serve.md, "The data
//! folder"; docs/postgres.md, "Serving on PostgreSQL"; the schemas in
//! `crates/store-sqlite/src/schema.rs`, `crates/store-postgres/src/schema.rs` and
//! `crates/builtins`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use rusqlite::types::ValueRef;
use rusqlite::{Connection, OpenFlags};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tidemark_core::{Error, Result};

use super::{
    invalid, AUDIT_CONSUMER, POISON_EVENT_TYPE, QUEUE, QUEUE_CONCURRENCY_MAX, REMOTE_CONSUMER, SHIPPING_CONSUMER, SKU,
    STOCK, TICKS, TICK_INTERVAL_MS, TICK_QUANTITY,
};
use tidemark_builtins::workflows::BATCH_DONE;

/// Longest ledger line the checker reads (a line is under 300 bytes).
const LEDGER_LINE_BYTES_MAX: usize = 64 * 1024;
/// Most ledger entries the checker reads.
const LEDGER_ENTRIES_MAX: usize = 10_000_000;
/// Most rows the checker reads from one table (outbox events, inbox records, effects, runs).
const TABLE_ROWS_MAX: usize = 20_000_000;
/// Violations the report lists (it counts them all).
const VIOLATIONS_LISTED_MAX: usize = 50;
/// Most runs of a batch's chain the checker follows (a chain is one run per `per_run` orders).
const CHAIN_RUNS_MAX: usize = 1_000;

/// One operation a server acknowledged (2xx) to the harness: a line of the ledger.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Acknowledged {
    /// `POST /v1/flows/{flow}/advance` answered 200 `committed`, or (`stream`) `POST
    /// /v1/streams/{flow}/events` of the event such an advance commits (`reservation.<state>`,
    /// `{"amount": quantity}`), checked the same way.
    Advance {
        /// The reservation flow (or stream).
        flow_id: String,
        /// The seq the server answered.
        seq: i64,
        /// The event id the server answered.
        event_id: String,
        /// The state the flow moved to (`reserved`, `confirmed`, `released`), or the state of
        /// the event appended.
        state: String,
        /// The reservation's quantity.
        quantity: i64,
        /// An append to an event stream, not an advance.
        #[serde(default)]
        stream: bool,
        /// The process (0-based) that answered.
        process: usize,
        /// When, in ms after the workload started.
        at_ms: u64,
    },
    /// `POST /v1/runs` answered 201 `started` (or 200 `existing`) for an `order_saga`.
    Start {
        /// The run id (also the order id).
        run_id: String,
        /// The step the order's input makes fail for good (`charge_payment`, `ship_order`), if any.
        fail: Option<String>,
        /// How the run must end: `completed`, or `compensated` when a step fails.
        expect: String,
        /// The quantity the order reserves.
        quantity: i64,
        /// The queue it was started through, if any: it must have been admitted before it ended.
        #[serde(default)]
        queue: Option<String>,
        /// The process (0-based) that answered.
        process: usize,
        /// When, in ms after the workload started.
        at_ms: u64,
    },
    /// `POST /v1/runs` answered 201 `started` (or 200 `existing`) for an `order_batch`: its
    /// orders run as child `order_saga`s, at most `per_run` of them in one run of its chain (the
    /// rest continued as a new run).
    Batch {
        /// The chain's first run id.
        run_id: String,
        /// Orders per run of the chain (`None`: all of them in one run).
        per_run: Option<usize>,
        /// The orders, in the batch's order.
        orders: Vec<BatchOrder>,
        /// The waiter the chain's last run tells when the batch is done (`ctx.send`), if any.
        #[serde(default)]
        notify: Option<String>,
        /// The process (0-based) that answered.
        process: usize,
        /// When, in ms after the workload started.
        at_ms: u64,
    },
    /// `POST /v1/runs/{run}/cancel` of an acknowledged start, answered 200 `cancel_requested`
    /// (`status` 200) or not answered at all (`None`: it may have committed); a 409 (the run had
    /// ended) is not written. The run may then end `cancelled` instead of as its input says (a
    /// request: a run past its last step boundary still ends as it would), with everything it
    /// did undone.
    Cancel {
        /// The cancelled run (an `order_saga` started alone).
        run_id: String,
        /// The answer's status, if one came.
        status: Option<u16>,
        /// The process (0-based) it was sent to.
        process: usize,
        /// When, in ms after the workload started.
        at_ms: u64,
    },
    /// `POST /v1/runs` answered 201 `started` (or 200 `existing`) for an operated order: a
    /// `sleepy_order` whose charge fails (retryably) more often than its attempts allow, so that
    /// it ends `failed` with its reservation held unless an operator [`Acknowledged::Control`]s
    /// it (or a crash between a failed call and its journal write left it an attempt short, and
    /// it completed by itself).
    Operated {
        /// The run id (also the order id).
        run_id: String,
        /// The quantity the order reserves.
        quantity: i64,
        /// The process (0-based) that answered.
        process: usize,
        /// When, in ms after the workload started.
        at_ms: u64,
    },
    /// An operator control of an operated order: `retry`, `skip` (its failed charge, with an
    /// output of the operator's) or `fork` (to `new_run_id`, from its failed charge), each sent
    /// once the run had failed, or `abandon`, sent while it ran. Written when a server answered
    /// it 2xx, when a retry, skip or fork was answered 409 after a send that got no answer
    /// (only an operator takes a failed run elsewhere: that send committed), and when it may have
    /// committed (`answered` false: no send got an answer, or an abandon got 409 after one that
    /// did not).
    Control {
        /// The operated run.
        run_id: String,
        /// `retry`, `skip`, `fork` or `abandon`.
        action: String,
        /// The fork's run id.
        #[serde(default)]
        new_run_id: Option<String>,
        /// The journal position the fork starts from (0: the reservation, made again).
        #[serde(default)]
        from_step: Option<u64>,
        /// True when it is known to have committed.
        answered: bool,
        /// The process (0-based) that answered (or the last one it was sent to).
        process: usize,
        /// When, in ms after the workload started.
        at_ms: u64,
    },
    /// `POST /v1/outbox/{event}/{consumer}/resolve` with `dismiss` of a quarantined delivery,
    /// answered 200 (`answered`) or not answered at all (or 5xx: it may have committed). That
    /// consumer may then never hold the event, nor the flow's events after it (they wait behind
    /// the gap); a later redelivery may still bring them.
    Dismiss {
        /// The dismissed event.
        event_id: String,
        /// The subscriber it was dismissed for.
        consumer_id: String,
        /// True when it is known to have committed.
        answered: bool,
        /// The process (0-based) it was sent to.
        process: usize,
        /// When, in ms after the workload started.
        at_ms: u64,
    },
    /// `POST /v1/runs` answered 201 `started` (or 200 `existing`) for a `sleepy_order` that waits
    /// for a batch's `batch_done` message: approved (charged and shipped) when the batch named it
    /// and completed, unapproved (released) when no batch named it and the wait timed out.
    Waiter {
        /// The run id (also the order id); the batch that tells it is `<run id less "-w">`.
        run_id: String,
        /// The quantity the order reserves.
        quantity: i64,
        /// The process (0-based) that answered.
        process: usize,
        /// When, in ms after the workload started.
        at_ms: u64,
    },
}

/// One order of an acknowledged `order_batch`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BatchOrder {
    /// The order id (its effects' and payments' key; the child's run id is derived).
    pub order_id: String,
    /// The step the order's input makes fail for good, if any.
    pub fail: Option<String>,
    /// How its child run must end: `completed` or `compensated`.
    pub expect: String,
    /// The quantity the order reserves.
    pub quantity: i64,
}

/// Every kind of violation the checker counts. The first group are the losses and doubles the
/// harness exists to catch; the second group also holds while the system is still converging
/// (the harness waits for them to reach 0 before it checks).
pub const VIOLATION_KINDS: [&str; 15] = [
    "lost",
    "applied_twice",
    "out_of_order",
    "outbox_gap",
    "unexpected_end",
    "wrong_effects",
    "stock_mismatch",
    "unknown_effect",
    "queue_over_limit",
    // Convergence: what the relay, drains and workers finish by themselves.
    "not_applied",
    "relay_behind",
    "cursor_behind",
    "run_unfinished",
    "run_leased",
    "inbox_open",
];

/// The kinds that only say the system has not converged yet.
const CONVERGENCE_KINDS: [&str; 6] =
    ["not_applied", "relay_behind", "cursor_behind", "run_unfinished", "run_leased", "inbox_open"];

/// What the checker found.
#[derive(Debug, Default)]
pub struct CheckReport {
    /// Violations by kind (every kind of [`VIOLATION_KINDS`], 0 included).
    pub counts: BTreeMap<&'static str, u64>,
    /// The first violations, each a sentence.
    pub listed: Vec<String>,
    /// Acknowledged advances in the ledger.
    pub advances: u64,
    /// Of the advances, the appends to event streams.
    pub appends: u64,
    /// Poison events (in the outbox, acknowledged or not) that `shipping` skipped.
    pub poison_skipped: u64,
    /// Acknowledged run starts in the ledger.
    pub starts: u64,
    /// Acknowledged batch starts in the ledger.
    pub batches: u64,
    /// Acknowledged waiters (runs waiting for a batch's message) in the ledger.
    pub waiters: u64,
    /// Cancels sent to acknowledged starts (answered 200 or not answered) in the ledger.
    pub cancels: u64,
    /// The runs a cancel ended `cancelled`, everything they did undone.
    pub cancelled: u64,
    /// Acknowledged operated orders (counted in `starts` too).
    pub operated: u64,
    /// The operator controls of operated orders in the ledger (committed or maybe), by action.
    pub controls: BTreeMap<String, u64>,
    /// The outbox operator's dismissals in the ledger (committed or maybe).
    pub dismissals: u64,
    /// (Subscriber, flow) pairs whose events from a dismissed one on the subscriber need not
    /// hold ([`Acknowledged::Dismiss`]).
    pub flows_dismissed: u64,
    /// Acknowledged starts through the queue (counted in `starts` too).
    pub queued: u64,
    /// The runs the schedule's ticks started (each checked as an order of its own).
    pub ticks: u64,
    /// The most runs of the queue admitted and unfinished at once: as the journal's commit order
    /// proves it on SQLite, as the harness's samples saw it on PostgreSQL ([`QueueSamples`];
    /// `None` without samples).
    pub queue_peak: Option<u64>,
    /// On PostgreSQL, the samples behind `queue_peak`.
    pub queue_samples: Option<u64>,
    /// The waiters that ended as they must: `approved` (told by their batch), `never_told`
    /// (their batch was never started: the wait timed out) or `gave_up` (the wait timed out
    /// before their batch's message came).
    pub waiters_by_outcome: BTreeMap<&'static str, u64>,
    /// Events in the producer's outbox (acknowledged or not: an advance whose answer was lost
    /// in a crash may have committed).
    pub outbox_events: u64,
    /// The orders (the ledger's, started alone, as a batch's children or as waiters, and the
    /// schedule's ticks) by their run's final status.
    pub runs_by_status: BTreeMap<String, u64>,
    /// The ledger's batches by the final status of their chain's last run.
    pub batches_by_status: BTreeMap<String, u64>,
    /// Runs parked with a reason (allowed: an operator decides).
    pub parked: u64,
    /// Active runs late by a clock ahead, not counted unfinished ([`late_by_a_clock_ahead`]).
    pub late_by_clock_ahead: u64,
    /// Takeovers of runs whose holder's lease expired (the sum of `runs.recoveries`): evidence
    /// that the faults hit runs in flight.
    pub run_recoveries: i64,
}

impl CheckReport {
    fn violation(&mut self, kind: &'static str, text: String) {
        debug_assert!(VIOLATION_KINDS.contains(&kind), "{kind}");
        *self.counts.entry(kind).or_default() += 1;
        if self.listed.len() < VIOLATIONS_LISTED_MAX {
            self.listed.push(format!("{kind}: {text}"));
        }
    }

    /// All violations.
    pub fn total(&self) -> u64 {
        self.counts.values().sum()
    }

    /// True when only convergence kinds are left (or nothing at all).
    pub fn converged(&self) -> bool {
        CONVERGENCE_KINDS.iter().all(|kind| self.counts.get(kind).copied().unwrap_or(0) == 0)
    }

    /// The report as JSON, every message suffixed with the seed when one is given.
    pub fn to_json(&self, seed: Option<u64>) -> Value {
        let suffix = seed.map(|s| format!(" (seed {s})")).unwrap_or_default();
        let listed: Vec<String> = self.listed.iter().map(|v| format!("{v}{suffix}")).collect();
        json!({
            "passed": self.total() == 0,
            "violations": self.total(),
            "by_kind": self.counts,
            "first_violations": listed,
            "ledger": {
                "advances": self.advances,
                "appends": self.appends,
                "starts": self.starts,
                "batches": self.batches,
                "waiters": self.waiters,
                "queued": self.queued,
                "cancels": self.cancels,
                "operated": self.operated,
                "controls": self.controls,
                "dismissals": self.dismissals,
            },
            "flows_dismissed": self.flows_dismissed,
            "ticks": self.ticks,
            "poison_skipped": self.poison_skipped,
            "cancelled": self.cancelled,
            "queue_peak": self.queue_peak,
            "queue_samples": self.queue_samples,
            "waiters_by_outcome": self.waiters_by_outcome,
            "outbox_events": self.outbox_events,
            "runs_by_status": self.runs_by_status,
            "batches_by_status": self.batches_by_status,
            "runs_parked": self.parked,
            "runs_late_by_clock_ahead": self.late_by_clock_ahead,
            "run_recoveries": self.run_recoveries,
        })
    }
}

/// Where one of a tenant's databases is: a SQLite file, or a schema on a PostgreSQL server.
#[derive(Debug, Clone)]
pub enum Store {
    /// A SQLite file.
    File(PathBuf),
    /// A schema (`schema`) on the server the connection string `conn` names.
    Schema {
        /// The connection string (`host=... user=... dbname=...` or a URL without `schema`).
        conn: String,
        /// The schema.
        schema: String,
    },
}

impl Store {
    /// Open it for reading: a SQLite file read-only, a schema in a read-only session whose
    /// `search_path` is the schema (so every statement below reads the same on both).
    fn open(&self) -> Result<Db> {
        match self {
            Store::File(path) => Ok(Db::Sqlite(read_only(path)?)),
            Store::Schema { conn, schema } => {
                let mut client = postgres::Client::connect(conn, postgres::NoTls)
                    .map_err(|e| Error::io(format!("the checker cannot connect to PostgreSQL: {e}")))?;
                let found =
                    client.query_opt("SELECT 1 FROM pg_namespace WHERE nspname = $1", &[schema]).map_err(pg)?.is_some();
                if !found {
                    return Err(Error::invalid(
                        tidemark_core::error::codes::NOT_INITIALIZED,
                        format!("schema {schema} does not exist (wrong --store?)"),
                    ));
                }
                let quoted = schema.replace('"', "\"\"");
                client
                    .batch_execute(&format!("SET search_path TO \"{quoted}\"; SET default_transaction_read_only = on"))
                    .map_err(pg)?;
                Ok(Db::Postgres(Box::new(client)))
            }
        }
    }

    /// Does it exist yet (the file, or the schema)?
    fn exists(&self) -> bool {
        match self {
            Store::File(path) => path.is_file(),
            Store::Schema { .. } => self.open().is_ok(),
        }
    }

    fn name(&self) -> String {
        match self {
            Store::File(path) => path.display().to_string(),
            Store::Schema { schema, .. } => format!("schema {schema}"),
        }
    }
}

/// The tenant's databases, as docs/serve.md and docs/postgres.md name them, and the fake payment
/// service's log (a file in the tenant's folder on either backend).
pub struct TenantData {
    producer: Store,
    pub(crate) inbox: Store,
    workflows: Store,
    payments: PathBuf,
    /// On PostgreSQL: where the harness writes what it sampled of the queue during the run
    /// ([`QueueSampler`]), in the data folder.
    queue_samples: Option<PathBuf>,
}

impl TenantData {
    /// The files of `tenant` under the data folder `data`.
    pub fn new(data: &Path, tenant: &str) -> TenantData {
        let dir = data.join("tenants").join(tenant);
        TenantData {
            producer: Store::File(dir.join("producer.db")),
            inbox: Store::File(dir.join("inbox.db")),
            workflows: Store::File(dir.join("workflows.db")),
            payments: dir.join("payments.db"),
            queue_samples: None,
        }
    }

    /// The schemas of `tenant` of a service on PostgreSQL (`backend`, its store URL's prefix),
    /// with the payments log under the data folder `data`.
    pub fn on_postgres(data: &Path, tenant: &str, backend: &tidemark_server::Postgres) -> TenantData {
        use tidemark_server::Database;
        let schema =
            |database| Store::Schema { conn: backend.conn().to_string(), schema: backend.schema(tenant, database) };
        TenantData {
            producer: schema(Database::Producer),
            inbox: schema(Database::Inbox),
            workflows: schema(Database::Workflows),
            payments: data.join("tenants").join(tenant).join("payments.db"),
            queue_samples: Some(data.join(QUEUE_SAMPLES_FILE)),
        }
    }
}

/// The file, in the data folder, of a PostgreSQL run's queue samples.
const QUEUE_SAMPLES_FILE: &str = "queue_samples.json";
/// The samples over the queue's limit a samples file keeps (the first ones).
const QUEUE_SAMPLES_OVER_KEPT: usize = 10;

/// The queue's admitted, unfinished runs: what its concurrency limit counts.
const QUEUE_IN_PROGRESS_SQL: &str = "SELECT count(*) FROM runs WHERE queue = $1 AND admitted_at_ms IS NOT NULL
   AND status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating')";

/// What the harness saw of the queue on PostgreSQL, where no commit order of the journal proves
/// the limit after the fact ([`check_queue_limit`]): every statement reads one snapshot, and an
/// admission commits under the queue's lock after counting, so no snapshot may hold more
/// admitted, unfinished runs of the queue than its `concurrency_max`. The harness counts them
/// every [`QUEUE_SAMPLE_EVERY`] from the workload's start to the end of convergence (reconnecting
/// after a database crash); a sample over the limit is a violation. A sampled check: an overrun
/// shorter than the gap between samples can pass unseen.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct QueueSamples {
    /// Counts taken.
    pub samples: u64,
    /// The highest count.
    pub peak: u64,
    /// The first counts over the limit: (ms since the sampling began, count).
    pub over: Vec<(u64, u64)>,
}

/// How often the harness counts the queue's runs on PostgreSQL.
pub(crate) const QUEUE_SAMPLE_EVERY: std::time::Duration = std::time::Duration::from_millis(50);

/// Counts the queue's admitted, unfinished runs of a tenant on PostgreSQL (see [`QueueSamples`]).
pub(crate) struct QueueSampler {
    store: Store,
    file: PathBuf,
    db: Option<Db>,
    started: std::time::Instant,
    samples: QueueSamples,
}

impl TenantData {
    /// A sampler of the tenant's queue, on PostgreSQL (`None` on SQLite, whose journal proves the
    /// limit by itself).
    pub(crate) fn queue_sampler(&self) -> Option<QueueSampler> {
        let file = self.queue_samples.clone()?;
        Some(QueueSampler {
            store: self.workflows.clone(),
            file,
            db: None,
            started: std::time::Instant::now(),
            samples: QueueSamples::default(),
        })
    }
}

impl QueueSampler {
    /// Count once (a connection that failed is opened anew at the next count).
    pub(crate) fn sample(&mut self) {
        if self.db.is_none() {
            self.db = self.store.open().ok();
        }
        let Some(db) = self.db.as_mut() else { return };
        match db.int(QUEUE_IN_PROGRESS_SQL, &[QUEUE]) {
            Ok(count) => {
                let count = count.max(0) as u64;
                self.samples.samples += 1;
                self.samples.peak = self.samples.peak.max(count);
                if count > u64::from(QUEUE_CONCURRENCY_MAX) && self.samples.over.len() < QUEUE_SAMPLES_OVER_KEPT {
                    self.samples.over.push((self.started.elapsed().as_millis() as u64, count));
                }
            }
            Err(_) => self.db = None,
        }
    }

    /// Write what was counted where the checker reads it.
    pub(crate) fn finish(self) -> Result<QueueSamples> {
        let text = serde_json::to_string(&self.samples).map_err(|e| Error::io(e.to_string()))?;
        std::fs::write(&self.file, text)
            .map_err(|e| Error::io(format!("cannot write {}: {e}", self.file.display())))?;
        Ok(self.samples)
    }
}

/// The remote inbox open for reading, on either backend: the harness polls its last record to
/// time delivery after a heal.
pub(crate) struct InboxReader(Db);

impl TenantData {
    /// The tenant's inbox open for reading (`None` while it cannot be opened yet).
    pub(crate) fn inbox_reader(&self) -> Option<InboxReader> {
        self.inbox.open().ok().map(InboxReader)
    }
}

impl InboxReader {
    /// The inbox's last record (its rowid on SQLite, its identity `record` on PostgreSQL; 0 while
    /// it holds none or cannot be read).
    pub(crate) fn last_record(&mut self) -> i64 {
        let query = match self.0 {
            Db::Sqlite(_) => "SELECT coalesce(max(rowid), 0) FROM inbox",
            Db::Postgres(_) => "SELECT coalesce(max(record), 0) FROM inbox",
        };
        self.0.int(query, &[]).unwrap_or(0)
    }
}

/// A value of a row the checker reads.
#[derive(Debug, Clone)]
enum Cell {
    Null,
    Int(i64),
    Text(String),
}

/// A row the checker reads, its values by column.
struct Row(Vec<Cell>);

impl Row {
    fn cell(&self, i: usize) -> Result<&Cell> {
        self.0.get(i).ok_or_else(|| Error::store(format!("checker query: no column {i}")))
    }

    fn int(&self, i: usize) -> Result<i64> {
        match self.cell(i)? {
            Cell::Int(v) => Ok(*v),
            other => Err(Error::store(format!("checker query: column {i} is {other:?}, not an integer"))),
        }
    }

    fn opt_int(&self, i: usize) -> Result<Option<i64>> {
        match self.cell(i)? {
            Cell::Null => Ok(None),
            _ => self.int(i).map(Some),
        }
    }

    fn text(&self, i: usize) -> Result<String> {
        self.opt_text(i)?.ok_or_else(|| Error::store(format!("checker query: column {i} is NULL")))
    }

    fn opt_text(&self, i: usize) -> Result<Option<String>> {
        match self.cell(i)? {
            Cell::Text(v) => Ok(Some(v.clone())),
            Cell::Null => Ok(None),
            other => Err(Error::store(format!("checker query: column {i} is {other:?}, not text"))),
        }
    }
}

/// An open database the checker reads with the same statements on both backends (parameters
/// written `$1`, `$2`, ...; integers read as `i64`, sums cast to `BIGINT`).
enum Db {
    Sqlite(Connection),
    Postgres(Box<postgres::Client>),
}

impl Db {
    /// Rows of `query` with text parameters (bounded by [`TABLE_ROWS_MAX`]).
    fn rows(&mut self, query: &str, params: &[&str]) -> Result<Vec<Row>> {
        let mut out = Vec::new();
        let mut push = |row: Row| -> Result<()> {
            out.push(row);
            if out.len() > TABLE_ROWS_MAX {
                return Err(Error::invalid(
                    tidemark_core::error::codes::LIMIT_EXCEEDED,
                    format!("the checker reads at most {TABLE_ROWS_MAX} rows of a table"),
                ));
            }
            Ok(())
        };
        match self {
            Db::Sqlite(conn) => {
                let mut stmt = conn.prepare(query).map_err(sql)?;
                let columns = stmt.column_count();
                let mut rows = stmt.query(rusqlite::params_from_iter(params)).map_err(sql)?;
                while let Some(row) = rows.next().map_err(sql)? {
                    let mut cells = Vec::with_capacity(columns);
                    for i in 0..columns {
                        cells.push(match row.get_ref(i).map_err(sql)? {
                            ValueRef::Null => Cell::Null,
                            ValueRef::Integer(v) => Cell::Int(v),
                            ValueRef::Text(t) => Cell::Text(String::from_utf8_lossy(t).into_owned()),
                            other => return Err(Error::store(format!("checker query: unexpected value {other:?}"))),
                        });
                    }
                    push(Row(cells))?;
                }
            }
            Db::Postgres(client) => {
                let params: Vec<&(dyn postgres::types::ToSql + Sync)> =
                    params.iter().map(|p| p as &(dyn postgres::types::ToSql + Sync)).collect();
                use postgres::fallible_iterator::FallibleIterator;
                let mut rows = client.query_raw(query, params).map_err(pg)?;
                while let Some(row) = rows.next().map_err(pg)? {
                    let mut cells = Vec::with_capacity(row.len());
                    for (i, column) in row.columns().iter().enumerate() {
                        use postgres::types::Type;
                        let t = column.type_();
                        let cell = if *t == Type::INT8 {
                            row.try_get::<_, Option<i64>>(i).map_err(pg)?.map(Cell::Int)
                        } else if *t == Type::INT4 {
                            row.try_get::<_, Option<i32>>(i).map_err(pg)?.map(|v| Cell::Int(v.into()))
                        } else if *t == Type::INT2 {
                            row.try_get::<_, Option<i16>>(i).map_err(pg)?.map(|v| Cell::Int(v.into()))
                        } else if *t == Type::BOOL {
                            row.try_get::<_, Option<bool>>(i).map_err(pg)?.map(|v| Cell::Int(v.into()))
                        } else if [Type::TEXT, Type::VARCHAR, Type::NAME, Type::BPCHAR].contains(t) {
                            row.try_get::<_, Option<String>>(i).map_err(pg)?.map(Cell::Text)
                        } else {
                            return Err(Error::store(format!(
                                "checker query: column {} is of type {t}, which the checker does not read",
                                column.name()
                            )));
                        };
                        cells.push(cell.unwrap_or(Cell::Null));
                    }
                    push(Row(cells))?;
                }
            }
        }
        Ok(out)
    }

    /// The one row of `query` (`None` when it has none).
    fn row(&mut self, query: &str, params: &[&str]) -> Result<Option<Row>> {
        Ok(self.rows(query, params)?.into_iter().next())
    }

    /// The integer the one row of `query` holds in its first column.
    fn int(&mut self, query: &str, params: &[&str]) -> Result<i64> {
        self.row(query, params)?.ok_or_else(|| Error::store(format!("checker query: no row for {query}")))?.int(0)
    }
}

fn pg(e: postgres::Error) -> Error {
    Error::store(format!("checker query: {e}"))
}

fn read_only(path: &Path) -> Result<Connection> {
    if !path.is_file() {
        return Err(Error::invalid(
            tidemark_core::error::codes::NOT_INITIALIZED,
            format!("{} does not exist (wrong --out?)", path.display()),
        ));
    }
    let conn = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX)
        .map_err(|e| Error::io(format!("cannot open {} read-only: {e}", path.display())))?;
    // The servers may still be writing while the harness waits for convergence.
    conn.busy_timeout(std::time::Duration::from_secs(10)).map_err(sql)?;
    Ok(conn)
}

fn sql(e: rusqlite::Error) -> Error {
    Error::store(format!("checker query: {e}"))
}

/// Read a JSONL ledger of [`Acknowledged`] entries (bounded).
pub fn read_ledger(path: &Path) -> Result<Vec<Acknowledged>> {
    let file =
        std::fs::File::open(path).map_err(|e| invalid(format!("cannot read the ledger {}: {e}", path.display())))?;
    let mut reader = BufReader::new(file);
    let (mut line, mut entries) = (String::new(), Vec::new());
    loop {
        line.clear();
        let read = (&mut reader)
            .take(LEDGER_LINE_BYTES_MAX as u64 + 1)
            .read_line(&mut line)
            .map_err(|e| invalid(format!("cannot read the ledger: {e}")))?;
        if read == 0 {
            return Ok(entries);
        }
        if read > LEDGER_LINE_BYTES_MAX || entries.len() >= LEDGER_ENTRIES_MAX {
            return Err(invalid(format!(
                "ledger line {}: lines are at most {LEDGER_LINE_BYTES_MAX} bytes, ledgers at most {LEDGER_ENTRIES_MAX} lines",
                entries.len() + 1
            )));
        }
        let entry: Acknowledged = serde_json::from_str(line.trim_end())
            .map_err(|e| invalid(format!("ledger line {} is not a chaos ledger entry: {e}", entries.len() + 1)))?;
        entries.push(entry);
    }
}

/// Check the tenant's stores against the ledger; with `remote`, also the remote consumer's inbox
/// on the remote server's files (the relays deliver to it over HTTP through the partitioned
/// link).
pub fn check(
    data: &TenantData,
    tenant: &str,
    ledger: &[Acknowledged],
    remote: Option<&TenantData>,
) -> Result<CheckReport> {
    let mut report = CheckReport::default();
    for kind in VIOLATION_KINDS {
        report.counts.insert(kind, 0);
    }
    let mut producer = data.producer.open()?;
    let mut inbox = data.inbox.open()?;
    let mut workflows = data.workflows.open()?;
    // The remote tenant's inbox appears with the remote server's first request.
    let mut remote_inbox = match remote {
        Some(remote) if remote.inbox.exists() => Some(remote.inbox.open()?),
        Some(remote) => {
            report.violation("not_applied", format!("the remote inbox {} does not exist yet", remote.inbox.name()));
            None
        }
        None => None,
    };
    check_events(&mut report, &mut producer, &mut inbox, remote_inbox.as_mut(), tenant, ledger)?;
    let (ended, ticks) = check_runs(&mut report, &mut workflows, ledger)?;
    check_queue_limit(&mut report, &mut workflows, data.queue_samples.as_deref())?;
    // The payments file appears with the first charge: no orders, no file.
    if data.payments.is_file() {
        let orders = ledger_orders(ledger).chain(ticks.iter().map(String::as_str));
        check_payments(&mut report, &mut Db::Sqlite(read_only(&data.payments)?), orders, &ended)?;
    }
    Ok(report)
}

fn check_events(
    report: &mut CheckReport,
    producer: &mut Db,
    inbox: &mut Db,
    mut remote_inbox: Option<&mut Db>,
    tenant: &str,
    ledger: &[Acknowledged],
) -> Result<()> {
    // The outbox: (flow, seq) -> (position, event id).
    let outbox: Vec<(i64, String, i64, String)> = producer
        .rows("SELECT position, flow_id, seq, event_id FROM outbox ORDER BY position", &[])?
        .iter()
        .map(|r| Ok((r.int(0)?, r.text(1)?, r.int(2)?, r.text(3)?)))
        .collect::<Result<_>>()?;
    report.outbox_events = outbox.len() as u64;
    // The poison events ([`POISON_EVENT_TYPE`]): `shipping` must have skipped them (blocked
    // first: its handler cannot decode them), every other consumer applied them.
    let poison: HashSet<String> = producer
        .rows("SELECT event_id FROM outbox WHERE event_type = $1", &[POISON_EVENT_TYPE])?
        .iter()
        .map(|r| r.text(0))
        .collect::<Result<_>>()?;
    let by_key: HashMap<(&str, i64), (i64, &str)> =
        outbox.iter().map(|(p, f, s, e)| ((f.as_str(), *s), (*p, e.as_str()))).collect();
    for entry in ledger {
        if let Acknowledged::Advance { flow_id, seq, event_id, process, stream, .. } = entry {
            report.advances += 1;
            report.appends += u64::from(*stream);
            match by_key.get(&(flow_id.as_str(), *seq)) {
                Some((_, found)) if *found == event_id.as_str() => {}
                Some((_, found)) => report.violation(
                    "lost",
                    format!("advance {flow_id}#{seq} acknowledged by process {process} as event {event_id}; the outbox holds {found}"),
                ),
                None => report.violation(
                    "lost",
                    format!("advance {flow_id}#{seq} (event {event_id}) acknowledged by process {process} is not in the outbox"),
                ),
            }
        }
    }
    // Each flow's outbox seqs are 1..=last_seq, and flows.last_seq says the same.
    let flows: Vec<(String, i64)> = producer
        .rows("SELECT flow_id, last_seq FROM flows", &[])?
        .iter()
        .map(|r| Ok((r.text(0)?, r.int(1)?)))
        .collect::<Result<_>>()?;
    let mut seqs: HashMap<&str, Vec<i64>> = HashMap::new();
    for (_, flow, seq, _) in &outbox {
        seqs.entry(flow.as_str()).or_default().push(*seq);
    }
    for (flow, last_seq) in &flows {
        let mut held = seqs.get(flow.as_str()).cloned().unwrap_or_default();
        held.sort_unstable();
        if held != (1..=*last_seq).collect::<Vec<_>>() {
            report.violation("outbox_gap", format!("flow {flow} is at seq {last_seq}; its outbox seqs are {held:?}"));
        }
    }

    // The outbox operator's dismissals: that subscriber may never hold the event, nor its flow's
    // later events (they wait behind the gap; a later redelivery may still bring them), so from
    // the lowest seq dismissed on, the flow's events at that subscriber need not be there. Nothing
    // else is relaxed: what it holds must be the outbox's events, applied once and in order.
    let key_of: HashMap<&str, (&str, i64)> = outbox.iter().map(|(_, f, s, e)| (e.as_str(), (f.as_str(), *s))).collect();
    let mut asked: HashSet<(&str, &str)> = HashSet::new();
    let mut dismissed_from: HashMap<(&str, &str), i64> = HashMap::new();
    for entry in ledger {
        if let Acknowledged::Dismiss { event_id, consumer_id, .. } = entry {
            report.dismissals += 1;
            asked.insert((event_id.as_str(), consumer_id.as_str()));
            match key_of.get(event_id.as_str()) {
                Some((flow, seq)) => {
                    let from = dismissed_from.entry((consumer_id.as_str(), flow)).or_insert(*seq);
                    *from = (*from).min(*seq);
                }
                None => report.violation(
                    "lost",
                    format!("the operator dismissed event {event_id} for {consumer_id}: the outbox does not hold it"),
                ),
            }
        }
    }
    report.flows_dismissed = dismissed_from.len() as u64;
    let spared =
        |consumer: &str, flow: &str, seq: i64| dismissed_from.get(&(consumer, flow)).is_some_and(|from| seq >= *from);

    // Deliveries: every (event, subscriber) accepted, or dismissed by the operator.
    for r in producer.rows(
        "SELECT d.position, d.consumer_id, d.status, o.event_id FROM deliveries d JOIN outbox o ON o.position = d.position
         WHERE d.status <> 'accepted' ORDER BY d.position",
        &[],
    )? {
        let (position, consumer, status, event_id) = (r.int(0)?, r.text(1)?, r.text(2)?, r.text(3)?);
        match status.as_str() {
            "dismissed" if asked.contains(&(event_id.as_str(), consumer.as_str())) => {}
            "dismissed" => report.violation(
                "lost",
                format!("delivery of outbox position {position} (event {event_id}) to {consumer} is dismissed: no operator asked"),
            ),
            _ => report
                .violation("relay_behind", format!("delivery of outbox position {position} to {consumer} is {status}")),
        }
    }

    let mut consumers = vec![(SHIPPING_CONSUMER, false), (AUDIT_CONSUMER, false)];
    if remote_inbox.is_some() {
        consumers.push((REMOTE_CONSUMER, true));
    }
    for (consumer, on_remote) in consumers {
        let db: &mut Db = match (on_remote, remote_inbox.as_deref_mut()) {
            (true, Some(remote)) => remote,
            _ => &mut *inbox,
        };
        // The consumer's inbox: (flow, seq) -> (event id, status).
        let records: Vec<(String, i64, String, String)> = db
            .rows(
                "SELECT flow_id, seq, event_id, status FROM inbox WHERE consumer_id = $1 AND source = $2",
                &[consumer, tenant],
            )?
            .iter()
            .map(|r| Ok((r.text(0)?, r.int(1)?, r.text(2)?, r.text(3)?)))
            .collect::<Result<_>>()?;
        let records: HashMap<(&str, i64), (&str, &str)> =
            records.iter().map(|(f, s, e, st)| ((f.as_str(), *s), (e.as_str(), st.as_str()))).collect();
        for (_, flow, seq, event_id) in &outbox {
            let skips = consumer == SHIPPING_CONSUMER && poison.contains(event_id);
            let spared = spared(consumer, flow, *seq);
            match records.get(&(flow.as_str(), *seq)) {
                None if spared => {}
                None => report.violation("not_applied", format!("{consumer} has no inbox record of {flow}#{seq}")),
                Some((found, _)) if *found != event_id.as_str() => report.violation(
                    "lost",
                    format!("{consumer}'s inbox holds event {found} at {flow}#{seq}; the outbox holds {event_id}"),
                ),
                Some((_, "skipped")) if skips => report.poison_skipped += 1,
                Some((_, "applied")) if skips => report.violation(
                    "unknown_effect",
                    format!("{consumer} applied the poison event {flow}#{seq}, which its handler cannot decode"),
                ),
                Some((_, "applied")) => {}
                Some((_, _)) if spared => {}
                Some((_, status)) => {
                    report.violation("not_applied", format!("{consumer}'s record of {flow}#{seq} is {status}"))
                }
            }
        }
        let mut open = 0;
        for r in db.rows(
            "SELECT source, flow_id, seq FROM inbox WHERE consumer_id = $1 AND (status = 'pending' OR status = 'blocked')",
            &[consumer],
        )? {
            let (source, flow, seq) = (r.text(0)?, r.text(1)?, r.int(2)?);
            open += u64::from(source != tenant || !spared(consumer, &flow, seq));
        }
        if open > 0 {
            report.violation("inbox_open", format!("{consumer} has {open} pending or blocked inbox records"));
        }
        // Cursors at each flow's last seq.
        let cursors: HashMap<String, i64> = db
            .rows(
                "SELECT flow_id, high_water_seq FROM cursors WHERE consumer_id = $1 AND source = $2",
                &[consumer, tenant],
            )?
            .iter()
            .map(|r| Ok((r.text(0)?, r.int(1)?)))
            .collect::<Result<_>>()?;
        for (flow, last_seq) in &flows {
            let cursor = cursors.get(flow).copied().unwrap_or(0);
            // Behind a dismissed event, a cursor stops right before it (or later, when the
            // subscriber held it after all).
            if cursor != *last_seq && !spared(consumer, flow, cursor + 1) {
                report.violation(
                    "cursor_behind",
                    format!("{consumer}'s cursor of {flow} is at {cursor}; the flow is at {last_seq}"),
                );
            }
        }
    }

    // The reservation handler's effects: one row per applied event, in seq order per flow.
    let effects: Vec<(String, i64, String, String, i64)> = inbox
        .rows(
            "SELECT flow_id, seq, event_id, kind, quantity FROM reservation_effects
             WHERE consumer_id = $1 AND source = $2 ORDER BY effect_id",
            &[SHIPPING_CONSUMER, tenant],
        )?
        .iter()
        .map(|r| Ok((r.text(0)?, r.int(1)?, r.text(2)?, r.text(3)?, r.int(4)?)))
        .collect::<Result<_>>()?;
    let mut applied: HashMap<&str, u64> = HashMap::new();
    let mut last_applied: HashMap<&str, i64> = HashMap::new();
    for (flow, seq, event_id, _, _) in &effects {
        *applied.entry(event_id.as_str()).or_default() += 1;
        let previous = last_applied.insert(flow.as_str(), *seq).unwrap_or(0);
        if *seq != previous + 1 {
            report.violation(
                "out_of_order",
                format!("{SHIPPING_CONSUMER} applied {flow}#{seq} right after {flow}#{previous}"),
            );
        }
        if !by_key.contains_key(&(flow.as_str(), *seq)) {
            report.violation(
                "unknown_effect",
                format!("{SHIPPING_CONSUMER} applied {flow}#{seq}, which the outbox never held"),
            );
        }
    }
    for (_, flow, seq, event_id) in &outbox {
        match applied.get(event_id.as_str()).copied().unwrap_or(0) {
            0 if poison.contains(event_id) || spared(SHIPPING_CONSUMER, flow, *seq) => {}
            0 => report.violation("not_applied", format!("{SHIPPING_CONSUMER} never applied {flow}#{seq}")),
            1 => {}
            n => report.violation("applied_twice", format!("{SHIPPING_CONSUMER} applied {flow}#{seq} {n} times")),
        }
    }
    // The effect of each acknowledged advance is the state and quantity acknowledged.
    let effect_of: HashMap<&str, (&str, i64)> =
        effects.iter().map(|(_, _, e, k, q)| (e.as_str(), (k.as_str(), *q))).collect();
    for entry in ledger {
        if let Acknowledged::Advance { flow_id, seq, event_id, state, quantity, .. } = entry {
            if let Some((kind, applied_quantity)) = effect_of.get(event_id.as_str()) {
                if *kind != state.as_str() || applied_quantity != quantity {
                    report.violation(
                        "wrong_effects",
                        format!("{flow_id}#{seq} was acknowledged as {state} x{quantity}; {SHIPPING_CONSUMER} applied {kind} x{applied_quantity}"),
                    );
                }
            }
        }
    }
    Ok(())
}

/// The effects an order leaves, by how it ended: the order tables' rows in order.
fn expected_effects(status: &str) -> Option<&'static [&'static str]> {
    match status {
        "completed" => Some(&["reserve", "ship"]),
        "compensated" => Some(&["reserve", "release"]),
        _ => None,
    }
}

/// The statuses of a run that has not ended.
const ACTIVE: &str = "('pending', 'running', 'sleeping', 'waiting', 'compensating')";

/// A run as the checker reads it.
struct RunRow {
    status: String,
    error: Option<String>,
    lease_owner: Option<String>,
    result: Option<String>,
    /// The queue it was started through, and whether a claim admitted it.
    queue: Option<String>,
    admitted: bool,
    /// Active, unleased, and due later than any timer the workload sets on the true clock (so
    /// due at a time a clock ahead of the checker's set: a clock jump forward), or leased until
    /// such a time (by a process killed while its clock was ahead), or an active ancestor of
    /// such a run: late by that clock's lead, not stuck ([`late_by_a_clock_ahead`]).
    ahead: bool,
}

impl RunRow {
    fn active(&self) -> bool {
        matches!(self.status.as_str(), "pending" | "running" | "sleeping" | "waiting" | "compensating")
    }
}

/// What the ledger says an order must do, whether it was started alone (its run id is its order
/// id), as a child of a batch, or as a batch's waiter.
struct Order<'a> {
    order_id: &'a str,
    expect: &'a str,
    quantity: i64,
    /// The effects its end must leave when they are not the end's own ([`expected_effects`]):
    /// a waiter that completed unapproved released its reservation.
    effects: Option<&'static [&'static str]>,
    /// The payment calls (charged, refunded) it leaves once it ended as it must.
    payments: (i64, i64),
    /// A cancel was sent to it: it may end `cancelled` instead, with no effect left (none, or
    /// `reserve, release`) and every charge refunded.
    cancel_sent: bool,
}

impl<'a> Order<'a> {
    /// An `order_saga` that fails `fail` for good (if any), expected to end `expect`.
    fn saga(order_id: &'a str, fail: Option<&str>, expect: &'a str, quantity: i64) -> Order<'a> {
        let payments = match fail {
            None => (1, 0),
            Some("charge_payment") => (0, 0),
            Some(_) => (1, 1),
        };
        Order { order_id, expect, quantity, effects: None, payments, cancel_sent: false }
    }
}

/// The order ids of the ledger (each alone, in its batch, or a waiter): their payment calls.
fn ledger_orders(ledger: &[Acknowledged]) -> impl Iterator<Item = &str> {
    ledger.iter().flat_map(|entry| -> Vec<&str> {
        match entry {
            Acknowledged::Start { run_id, .. }
            | Acknowledged::Waiter { run_id, .. }
            | Acknowledged::Operated { run_id, .. } => vec![run_id.as_str()],
            Acknowledged::Batch { orders, .. } => orders.iter().map(|o| o.order_id.as_str()).collect(),
            Acknowledged::Advance { .. }
            | Acknowledged::Cancel { .. }
            | Acknowledged::Control { .. }
            | Acknowledged::Dismiss { .. } => Vec::new(),
        }
    })
}

/// The payment calls an order's end leaves.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Paid {
    /// Exactly so many (charged, refunded).
    Exactly(i64, i64),
    /// A cancelled order: every charge refunded (none, or one of each).
    Undone,
    /// An abandoned order: charged at most once (as every order), nothing refunded.
    NotRefunded,
}

/// The orders whose run ended as it must, with the payment calls that end leaves.
type Ended = HashMap<String, Paid>;

/// What [`check_runs`] reads once and its checks share.
struct Runs {
    runs: HashMap<String, RunRow>,
    /// Each run's children: (order id of the child's input, child run id).
    children: HashMap<String, Vec<(String, String)>>,
    /// Each order's effects in order: (kind, quantity).
    effects_of: HashMap<String, Vec<(String, i64)>>,
    /// Runs reported unfinished or leased (each counted once against the database's count).
    reported: HashSet<String>,
    /// The orders whose run ended as it must (final once it ended).
    ended: Ended,
    /// The ledger's batches that name a waiter, by the waiter's run id: the batch's run id.
    notified_by: HashMap<String, String>,
    /// The `batch_done` messages each run received (consumed), by run id.
    batch_done: HashMap<String, i64>,
    /// The `batch_done` messages each run holds unconsumed that arrived at or after the deadline
    /// of its wait for them (its wait had timed out), by run id.
    batch_done_late: HashMap<String, i64>,
}

/// Is active run `run_id` late by a clock ahead ([`RunRow::ahead`])? Counted once in
/// `report.late_by_clock_ahead` (and among the runs reported, so the database's count of
/// unfinished runs is not reported for it either). A clock jump forward delays what the jumped
/// process scheduled (a timer, a retry, a due time) by the jump: the design promises nothing
/// lost and nothing applied twice whatever the clocks say, not that timers fire on time.
fn late_by_a_clock_ahead(report: &mut CheckReport, read: &mut Runs, run_id: &str) -> bool {
    if !read.runs.get(run_id).is_some_and(|run| run.ahead) {
        return false;
    }
    if read.reported.insert(run_id.to_string()) {
        report.late_by_clock_ahead += 1;
    }
    true
}

/// Returns the orders whose run ended as it must, with the payment calls they leave, and the
/// schedule's tick runs (each an order).
fn check_runs(report: &mut CheckReport, workflows: &mut Db, ledger: &[Acknowledged]) -> Result<(Ended, Vec<String>)> {
    // The schedule before the runs: a tick fired between the two reads (the harness pauses the
    // schedule before it waits for convergence) can only add a run past what the row says.
    let schedule = TickSchedule::read(workflows)?;
    // One pass over the runs and one over the effects (`order_effects` has no index on the
    // order: a query per run would scan the table once per run).
    // One statement, so that the runs and the children are one snapshot (the servers may still
    // be writing: the checker runs while it waits for convergence).
    let (mut runs, mut children) = (HashMap::new(), HashMap::<String, Vec<(String, String)>>::new());
    // The checker's own clock, the true one.
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
    let (mut ahead, mut parent_of) = (Vec::new(), HashMap::<String, String>::new());
    // Active unleased runs not (yet) known to be ahead: (run id, wake, last written).
    let mut not_due = Vec::new();
    for r in workflows.rows(
        "SELECT run_id, status, error, lease_owner, result, parent_run_id,
                CASE WHEN parent_run_id IS NULL THEN NULL ELSE input END, queue,
                CASE WHEN admitted_at_ms IS NULL THEN 0 ELSE 1 END, wake_at_ms, updated_at_ms,
                lease_expires_at_ms FROM runs",
        &[],
    )? {
        let run_id = r.text(0)?;
        if let (Some(parent), Some(input)) = (r.opt_text(5)?, r.opt_text(6)?) {
            let order_id =
                serde_json::from_str::<Value>(&input).ok().and_then(|v| v["order_id"].as_str().map(str::to_string));
            match order_id {
                Some(order_id) => children.entry(parent).or_default().push((order_id, run_id.clone())),
                None => report.violation("unknown_effect", format!("child run {run_id} of {parent} has no order id")),
            }
        }
        let run = RunRow {
            status: r.text(1)?,
            error: r.opt_text(2)?,
            lease_owner: r.opt_text(3)?,
            result: r.opt_text(4)?,
            queue: r.opt_text(7)?,
            admitted: r.int(8)? == 1,
            ahead: false,
        };
        // Due later than any timer the workload sets on the true clock (its longest, a waiter's
        // wait, counts from a moment before this read), or not due yet and last written at a
        // time still to come (every process reads one machine's clock, so only a clock ahead
        // writes that: its wake is as far off as its lead, and a last read before it is due
        // would otherwise call it unfinished): set by a clock ahead.
        // Leased until later than any lease the workload takes can reach from the true clock
        // (its 1 s lease, a waiter's 60 s wait as the margin): leased by a clock ahead, by a
        // process killed before that clock came back (`clock-jump-kill`); no one holds it, and
        // it is taken over once that clock's lease expires.
        if r.opt_int(11)?.is_some_and(|expires| run.active() && expires > now + super::WAITER_TIMEOUT_MS as i64) {
            ahead.push(run_id.clone());
        }
        if let Some(wake) = r.opt_int(9)?.filter(|_| run.active() && run.lease_owner.is_none()) {
            let updated = r.int(10)?;
            match wake > now + super::WAITER_TIMEOUT_MS as i64 {
                true => ahead.push(run_id.clone()),
                false => not_due.push((run_id.clone(), wake, updated)),
            }
        }
        if let Some(parent) = r.opt_text(5)? {
            parent_of.insert(run_id.clone(), parent);
        }
        runs.insert(run_id, run);
    }
    // Taken after the read: a row written before it has a time at most this one.
    let read_at =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
    ahead.extend(
        not_due
            .into_iter()
            .filter(|(_, wake, updated)| *wake > read_at && *updated > read_at)
            .map(|(run_id, _, _)| run_id),
    );
    // A queue whose every slot is held by a run late by a clock ahead admits nothing until one
    // of them ends: the runs waiting for admission there are as late (the long run of clock
    // jumps of up to an hour, session 49, left 164 of them pending behind 8 such runs).
    let mut ahead_in_queue: HashMap<&str, u32> = HashMap::new();
    for run_id in &ahead {
        if let Some(queue) = runs.get(run_id).filter(|run| run.admitted).and_then(|run| run.queue.as_deref()) {
            *ahead_in_queue.entry(queue).or_default() += 1;
        }
    }
    let blocked: Vec<String> = runs
        .iter()
        .filter(|(_, run)| run.active() && !run.admitted)
        .filter(|(_, run)| {
            run.queue
                .as_deref()
                .and_then(|queue| ahead_in_queue.get(queue))
                .is_some_and(|n| *n >= QUEUE_CONCURRENCY_MAX)
        })
        .map(|(run_id, _)| run_id.clone())
        .collect();
    ahead.extend(blocked);
    // A run late by a clock ahead, and the active ancestors that wait for it.
    for run_id in ahead {
        let mut next = Some(run_id);
        while let Some(id) = next.take() {
            match runs.get_mut(&id) {
                Some(run) if run.active() && !run.ahead => {
                    run.ahead = true;
                    next = parent_of.get(&id).cloned();
                }
                _ => {}
            }
        }
    }
    let mut effects_of: HashMap<String, Vec<(String, i64)>> = HashMap::new();
    for r in workflows.rows("SELECT order_id, kind, quantity FROM order_effects ORDER BY effect_id", &[])? {
        effects_of.entry(r.text(0)?).or_default().push((r.text(1)?, r.int(2)?));
    }
    let notified_by = ledger
        .iter()
        .filter_map(|entry| match entry {
            Acknowledged::Batch { run_id, notify: Some(waiter), .. } => Some((waiter.clone(), run_id.clone())),
            _ => None,
        })
        .collect();
    let mut batch_done = HashMap::new();
    for r in workflows.rows(
        "SELECT run_id, count(*) FROM run_events WHERE name = $1 AND consumed_by_seq IS NOT NULL GROUP BY run_id",
        &[BATCH_DONE],
    )? {
        batch_done.insert(r.text(0)?, r.int(1)?);
    }
    let mut batch_done_late = HashMap::new();
    for r in workflows.rows(
        "SELECT e.run_id, count(*) FROM run_events e
         JOIN journal j ON j.run_id = e.run_id AND j.kind = 'wait' AND j.name = $1
         WHERE e.name = $1 AND e.consumed_by_seq IS NULL AND e.received_at_ms >= j.wake_at_ms
         GROUP BY e.run_id",
        &[BATCH_DONE],
    )? {
        batch_done_late.insert(r.text(0)?, r.int(1)?);
    }
    let mut read = Runs {
        runs,
        children,
        effects_of,
        reported: HashSet::new(),
        ended: HashMap::new(),
        notified_by,
        batch_done,
        batch_done_late,
    };
    let cancels: HashSet<&str> = ledger
        .iter()
        .filter_map(|entry| match entry {
            Acknowledged::Cancel { run_id, .. } => Some(run_id.as_str()),
            _ => None,
        })
        .collect();
    let controls: HashMap<&str, Control> = ledger
        .iter()
        .filter_map(|entry| match entry {
            Acknowledged::Control { run_id, action, new_run_id, from_step, answered, .. } => Some((
                run_id.as_str(),
                Control {
                    action: action.as_str(),
                    new_run_id: new_run_id.as_deref(),
                    from_step: *from_step,
                    answered: *answered,
                },
            )),
            _ => None,
        })
        .collect();
    for entry in ledger {
        match entry {
            Acknowledged::Start { run_id, fail, expect, process, quantity, queue, .. } => {
                report.starts += 1;
                let mut order = Order::saga(run_id, fail.as_deref(), expect, *quantity);
                order.cancel_sent = cancels.contains(run_id.as_str());
                if let Some(run) = read.runs.get(run_id) {
                    if let Some(queue) = queue {
                        report.queued += 1;
                        check_admission(report, run_id, run, queue);
                    }
                    check_order(report, &mut read, &order, run_id, &format!("run {run_id}"));
                } else {
                    report.violation(
                        "lost",
                        format!("run {run_id} acknowledged by process {process} is not in the database"),
                    );
                }
            }
            Acknowledged::Batch { run_id, orders, notify, process, .. } => {
                report.batches += 1;
                check_batch(report, &mut read, run_id, orders, notify.as_deref(), *process);
            }
            Acknowledged::Waiter { run_id, quantity, process, .. } => {
                report.waiters += 1;
                check_waiter(report, &mut read, run_id, *quantity, *process);
            }
            Acknowledged::Operated { run_id, quantity, process, .. } => {
                report.starts += 1;
                check_operated(report, &mut read, run_id, *quantity, controls.get(run_id.as_str()), *process);
            }
            Acknowledged::Cancel { .. } => report.cancels += 1,
            Acknowledged::Advance { .. } | Acknowledged::Control { .. } | Acknowledged::Dismiss { .. } => {}
        }
    }
    let ticks = match schedule {
        Some(schedule) => check_ticks(report, &mut read, &schedule),
        None => Vec::new(),
    };
    // Every run, not only the acknowledged ones (a start whose answer was lost may have run).
    let ahead: Vec<String> = read.runs.iter().filter(|(_, run)| run.ahead).map(|(id, _)| id.clone()).collect();
    for run_id in ahead {
        late_by_a_clock_ahead(report, &mut read, &run_id);
    }
    let unfinished = workflows
        .int(&format!("SELECT count(*) FROM runs WHERE status IN {ACTIVE} OR lease_owner IS NOT NULL"), &[])?;
    if unfinished as u64 > read.reported.len() as u64 {
        report.violation(
            "run_unfinished",
            format!(
                "{} runs that were not acknowledged are unfinished or leased",
                unfinished as u64 - read.reported.len() as u64
            ),
        );
    }
    report.run_recoveries = workflows.int("SELECT CAST(coalesce(sum(recoveries), 0) AS BIGINT) FROM runs", &[])?;
    // Stock: what is reserved or shipped (not released) was taken from it, by acknowledged runs
    // and by starts whose answer was lost alike.
    let taken = workflows.int(
        "SELECT CAST(coalesce(sum(quantity), 0) AS BIGINT) FROM order_reservations WHERE sku = $1 AND status <> 'released'",
        &[SKU],
    )?;
    let stock = match workflows.row("SELECT stock FROM order_stock WHERE sku = $1", &[SKU])? {
        Some(row) => Some(row.int(0)?),
        None => None,
    };
    if report.starts + report.batches > 0 && stock != Some(STOCK - taken) {
        report.violation("stock_mismatch", format!("{SKU}: stock {stock:?}, reservations hold {taken} of {STOCK}"));
    }
    Ok((read.ended, ticks))
}

/// The queue's concurrency limit, where the database proves an overrun: on SQLite, the journal's
/// rowids are handed out in commit order (one writer at a time; entries are inserted, never
/// renumbered, during a run), and a run of the queue was admitted and unfinished at least from
/// the commit of its first journal entry to the commit of its last (its admission commits before
/// its first step, its end with or after its last). More than [`QUEUE_CONCURRENCY_MAX`] of those
/// spans over one rowid is an overrun: at that entry's commit, more runs than the limit held a
/// slot. A stricter reading (admission and end times) would need a commit-ordered record of
/// them: `admitted_at_ms` and `finished_at_ms` are each process's clock before it waited for the
/// write lock. PostgreSQL's journal has no such order: not checked there.
fn check_queue_limit(report: &mut CheckReport, workflows: &mut Db, samples: Option<&Path>) -> Result<()> {
    if !matches!(workflows, Db::Sqlite(_)) {
        return check_queue_samples(report, samples);
    }
    // (rowid, +1 at a run's first entry, -1 at its last); a run's span is [first, last].
    let mut ends: Vec<(i64, i64)> = Vec::new();
    for r in workflows.rows(
        "SELECT min(j.rowid), max(j.rowid) FROM journal j JOIN runs r ON r.run_id = j.run_id
         WHERE r.queue = $1 GROUP BY j.run_id",
        &[QUEUE],
    )? {
        ends.push((r.int(0)?, 1));
        ends.push((r.int(1)?, -1));
    }
    // At one rowid, a span that starts there counts before one that ends there (a run whose
    // only entry is that one holds its slot at it).
    ends.sort_by_key(|(rowid, delta)| (*rowid, -*delta));
    let (mut open, mut peak, mut over_at) = (0_i64, 0_i64, None);
    for (rowid, delta) in ends {
        open += delta;
        if open > peak {
            peak = open;
            if peak > i64::from(QUEUE_CONCURRENCY_MAX) && over_at.is_none() {
                over_at = Some(rowid);
            }
        }
    }
    report.queue_peak = Some(peak as u64);
    if let Some(rowid) = over_at {
        report.violation(
            "queue_over_limit",
            format!(
                "queue {QUEUE} (concurrency_max {QUEUE_CONCURRENCY_MAX}) held {peak} admitted, unfinished runs at once \
                 (first over the limit at journal rowid {rowid})"
            ),
        );
    }
    Ok(())
}

/// On PostgreSQL: the queue's limit as the harness's samples saw it ([`QueueSamples`]; not
/// checked when the run wrote none).
fn check_queue_samples(report: &mut CheckReport, file: Option<&Path>) -> Result<()> {
    let Some(file) = file.filter(|f| f.is_file()) else { return Ok(()) };
    let text = std::fs::read_to_string(file).map_err(|e| Error::io(format!("cannot read {}: {e}", file.display())))?;
    let samples: QueueSamples = serde_json::from_str(&text).map_err(|e| {
        Error::invalid(tidemark_core::error::codes::INVALID_ARGUMENT, format!("{}: {e}", file.display()))
    })?;
    report.queue_peak = Some(samples.peak);
    report.queue_samples = Some(samples.samples);
    if let Some((at_ms, count)) = samples.over.first() {
        report.violation(
            "queue_over_limit",
            format!(
                "queue {QUEUE} (concurrency_max {QUEUE_CONCURRENCY_MAX}) held {count} admitted, unfinished runs in one \
                 snapshot, {at_ms} ms into the sampling ({} of {} samples over the limit kept)",
                samples.over.len(),
                samples.samples
            ),
        );
    }
    Ok(())
}

/// The chaos schedule's row ([`TICKS`], every [`TICK_INTERVAL_MS`], catch-up `all`).
struct TickSchedule {
    created_at_ms: i64,
    next_tick_at_ms: Option<i64>,
    ticks_started: i64,
    ticks_skipped: i64,
    paused: bool,
}

impl TickSchedule {
    /// The row, if the schedule exists.
    fn read(workflows: &mut Db) -> Result<Option<TickSchedule>> {
        let row = workflows.row(
            "SELECT created_at_ms, next_tick_at_ms, ticks_started, ticks_skipped, CASE WHEN paused THEN 1 ELSE 0 END
             FROM schedules WHERE schedule_id = $1",
            &[TICKS],
        )?;
        let Some(row) = row else { return Ok(None) };
        Ok(Some(TickSchedule {
            created_at_ms: row.int(0)?,
            next_tick_at_ms: row.opt_int(1)?,
            ticks_started: row.int(2)?,
            ticks_skipped: row.int(3)?,
            paused: row.int(4)? == 1,
        }))
    }
}

/// The schedule's ticks: every tick before its next one (`created + k * interval`, k >= 1)
/// started exactly one run `<schedule>:<tick>` whatever the faults (its catch-up policy is
/// `all`: a tick missed while every process was down starts late, never not at all), no run
/// stands for a tick that is not one, and each run is an order of its own (the input names none:
/// the run id is the order) that must complete, reserved, charged once and shipped. Returns the
/// tick runs' ids.
fn check_ticks(report: &mut CheckReport, read: &mut Runs, schedule: &TickSchedule) -> Vec<String> {
    let prefix = format!("{TICKS}:");
    let mut ticks: Vec<(i64, String)> = read
        .runs
        .keys()
        .filter_map(|id| id.strip_prefix(&prefix).map(|tick| (tick.parse().unwrap_or(i64::MIN), id.clone())))
        .collect();
    ticks.sort();
    report.ticks = ticks.len() as u64;
    let next = schedule.next_tick_at_ms.unwrap_or(i64::MAX);
    let on_grid = |tick: i64| {
        tick > schedule.created_at_ms && (tick - schedule.created_at_ms) % TICK_INTERVAL_MS == 0 && tick < next
    };
    for (tick, run_id) in &ticks {
        if !on_grid(*tick) {
            report.violation(
                "unknown_effect",
                format!(
                    "run {run_id} is no tick of schedule {TICKS} (created at {}, every {TICK_INTERVAL_MS} ms, next tick {next})",
                    schedule.created_at_ms
                ),
            );
        }
    }
    let started: HashSet<i64> = ticks.iter().map(|(tick, _)| *tick).collect();
    let mut missing = (1..)
        .map(|k| schedule.created_at_ms + k * TICK_INTERVAL_MS)
        .take_while(|tick| *tick < next)
        .filter(|tick| !started.contains(tick));
    if let Some(first) = missing.next() {
        report.violation(
            "lost",
            format!(
                "schedule {TICKS}: tick {first} (and {} more) before its next tick {next} started no run",
                missing.count()
            ),
        );
    }
    if schedule.ticks_started != ticks.len() as i64 || schedule.ticks_skipped != 0 {
        report.violation(
            if schedule.ticks_started > ticks.len() as i64 { "lost" } else { "unknown_effect" },
            format!(
                "schedule {TICKS} counts {} ticks started and {} skipped; {} runs are its ticks",
                schedule.ticks_started,
                schedule.ticks_skipped,
                ticks.len()
            ),
        );
    }
    if !schedule.paused {
        report.violation("unexpected_end", format!("schedule {TICKS} is not paused (the harness paused it)"));
    }
    for (_, run_id) in &ticks {
        let order = Order {
            order_id: run_id,
            expect: "completed",
            quantity: TICK_QUANTITY,
            effects: None,
            payments: (1, 0),
            cancel_sent: false,
        };
        check_order(report, read, &order, run_id, &format!("tick {run_id}"));
    }
    ticks.into_iter().map(|(_, id)| id).collect()
}

/// A run started through `queue`: its row names the queue, and once it has ended a claim had
/// admitted it (a run never admitted never ran; one that ended unadmitted went around its queue).
fn check_admission(report: &mut CheckReport, run_id: &str, run: &RunRow, queue: &str) {
    if run.queue.as_deref() != Some(queue) {
        report.violation(
            "unexpected_end",
            format!("run {run_id} was started through queue {queue}; its row names {:?}", run.queue),
        );
    } else if !run.active() && run.status != "cancelled" && !run.admitted {
        report.violation("unexpected_end", format!("run {run_id} ended {} without its queue admitting it", run.status));
    }
}

/// What every order's run (`run_id`, in the database) is held to whatever its end: its effects
/// (those of `order_id`) once each and of its `quantity`, no lease left on it, and an end. Returns
/// the run's status and its order's effect kinds once it ended (not once it is parked with a
/// reason: an operator decides). `label` names it in messages.
fn ended_order(
    report: &mut CheckReport,
    read: &mut Runs,
    order_id: &str,
    quantity: i64,
    run_id: &str,
    label: &str,
) -> Option<(String, Vec<String>)> {
    let run = &read.runs[run_id];
    *report.runs_by_status.entry(run.status.clone()).or_default() += 1;
    let effects: &[(String, i64)] = read.effects_of.get(order_id).map(Vec::as_slice).unwrap_or_default();
    let kinds: Vec<String> = effects.iter().map(|(k, _)| k.clone()).collect();
    for kind in ["reserve", "ship", "release"] {
        let n = kinds.iter().filter(|k| *k == kind).count();
        if n > 1 {
            report.violation("applied_twice", format!("{label}: {n} {kind} effects"));
        }
    }
    if effects.iter().any(|(_, q)| *q != quantity) {
        report.violation("wrong_effects", format!("{label} reserved {quantity}; its effects are {effects:?}"));
    }
    let (status, error, active) = (run.status.clone(), run.error.is_some(), run.active());
    if let Some(owner) = run.lease_owner.as_ref().filter(|_| !run.ahead) {
        report.violation("run_leased", format!("{label} ({status}) is still leased by {owner:?}"));
        read.reported.insert(run_id.to_string());
    }
    if active {
        if !late_by_a_clock_ahead(report, read, run_id) {
            report.violation("run_unfinished", format!("{label} is {status}"));
            read.reported.insert(run_id.to_string());
        }
        return None;
    }
    if status == "parked" && error {
        report.parked += 1;
        return None;
    }
    Some((status, kinds))
}

/// One order's run (`run_id`, in the database): as every order's ([`ended_order`]), and its end
/// the one the ledger expects, with the effects that end leaves. `label` names it in messages.
fn check_order(report: &mut CheckReport, read: &mut Runs, order: &Order, run_id: &str, label: &str) {
    let Some((status, kinds)) = ended_order(report, read, order.order_id, order.quantity, run_id, label) else {
        return;
    };
    let error = &read.runs[run_id].error;
    if order.cancel_sent && status == "cancelled" {
        report.cancelled += 1;
        // Cancelled before its reservation, or with it released.
        if kinds.is_empty() || kinds == ["reserve", "release"] {
            read.ended.insert(order.order_id.to_string(), Paid::Undone);
        } else {
            report.violation("wrong_effects", format!("{label} ended cancelled with the effects {kinds:?}"));
        }
    } else if status != order.expect {
        report.violation("unexpected_end", format!("{label} ended {status} ({error:?}); it must end {}", order.expect));
    } else if order.effects.or_else(|| expected_effects(&status)).is_some_and(|want| kinds != want) {
        report.violation("wrong_effects", format!("{label} ended {status} with the effects {kinds:?}"));
    } else {
        let (charged, refunded) = order.payments;
        read.ended.insert(order.order_id.to_string(), Paid::Exactly(charged, refunded));
    }
}

/// An operator's control of an operated order, as the ledger has it.
struct Control<'a> {
    action: &'a str,
    new_run_id: Option<&'a str>,
    from_step: Option<u64>,
    /// Known to have committed (else it may have).
    answered: bool,
}

/// An acknowledged operated order ([`Acknowledged::Operated`]): its run ends as the control it
/// was given (if any) leaves it, with the effects and payment calls of that end. Its charge
/// fails more often than its attempts allow, so with no control it fails with its reservation
/// held and nothing charged, or (a kill between a failed call and its journal write spares it an
/// attempt) completes, charged once. A retry completes it, charged once; a skip completes it
/// uncharged (a failed run made no call that charged, and a skipped step makes none); an
/// abandon ends it `cancelled` as far as it had come, nothing undone; a fork leaves it failed,
/// and the fork (same order, its journal up to the step it was forked from reused) fails or
/// completes as the operated run would have by itself when forked from the hold or the charge
/// (the reservation's entry reused), and fails on its reservation when forked from it (the
/// order's reservation row refuses a second one). A control that may not have committed allows
/// the end without it too.
fn check_operated(
    report: &mut CheckReport,
    read: &mut Runs,
    run_id: &str,
    quantity: i64,
    control: Option<&Control>,
    process: usize,
) {
    report.operated += 1;
    if let Some(control) = control {
        *report.controls.entry(control.action.to_string()).or_default() += 1;
    }
    if !read.runs.contains_key(run_id) {
        report.violation(
            "lost",
            format!("operated run {run_id} acknowledged by process {process} is not in the database"),
        );
        return;
    }
    let label = format!("operated run {run_id}");
    let fork = control.and_then(|c| c.new_run_id.map(|id| (id, c.answered)));
    // With a fork, the order's end is the fork's (the operated run stays failed).
    let ended_as = match fork {
        Some((fork_id, _)) if read.runs.contains_key(fork_id) => {
            // The order's effects are checked once, with the fork's end.
            let original = &read.runs[run_id];
            *report.runs_by_status.entry(original.status.clone()).or_default() += 1;
            if original.status != "failed" || original.lease_owner.is_some() {
                let (status, error, owner) = (&original.status, &original.error, &original.lease_owner);
                return report.violation(
                    "unexpected_end",
                    format!(
                        "{label} is {status} ({error:?}, leased by {owner:?}); forked once it failed, it must stay \
                         failed and unleased"
                    ),
                );
            }
            let fork_label = format!("fork {fork_id} of {label}");
            let Some(end) = ended_order(report, read, run_id, quantity, fork_id, &fork_label) else { return };
            (fork_label, fork_id.to_string(), end)
        }
        Some((fork_id, true)) => {
            return report.violation("lost", format!("fork {fork_id} of {label} is not in the database"));
        }
        _ => {
            let Some(end) = ended_order(report, read, run_id, quantity, run_id, &label) else { return };
            (label, run_id.to_string(), end)
        }
    };
    let (label, ended_id, (status, kinds)) = ended_as;
    let action = control.map(|c| c.action);
    let certain = control.is_some_and(|c| c.answered);
    let kinds: Vec<&str> = kinds.iter().map(String::as_str).collect();
    // A fork from the reservation (position 0) reserves the order again: the order's
    // reservation row refuses it for good, and the fork fails at once, nothing done twice.
    let forked_from_reservation = ended_id != run_id && control.and_then(|c| c.from_step) == Some(0);
    if forked_from_reservation && status == "failed" {
        let error = read.runs[&ended_id].error.as_deref().unwrap_or_default();
        if !error.contains("already has a reservation") {
            report.violation(
                "unexpected_end",
                format!("{label}, forked from its reservation, failed otherwise than on it: {error:?}"),
            );
        }
    }
    // The ends allowed: (status, effect kinds, payment calls).
    let allowed: Vec<(&str, &[&str], Paid)> = match (action, certain) {
        _ if forked_from_reservation => vec![("failed", &["reserve"], Paid::Exactly(0, 0))],
        (Some("retry"), true) => vec![("completed", &["reserve", "ship"], Paid::Exactly(1, 0))],
        (Some("skip"), true) => vec![("completed", &["reserve", "ship"], Paid::Exactly(0, 0))],
        (Some("skip"), false) => {
            vec![
                ("completed", &["reserve", "ship"], Paid::Exactly(0, 0)),
                ("failed", &["reserve"], Paid::Exactly(0, 0)),
            ]
        }
        (Some("abandon"), true) => vec![
            ("cancelled", &[], Paid::Exactly(0, 0)),
            ("cancelled", &["reserve"], Paid::NotRefunded),
            ("cancelled", &["reserve", "ship"], Paid::Exactly(1, 0)),
        ],
        (Some("abandon"), false) => vec![
            ("cancelled", &[], Paid::Exactly(0, 0)),
            ("cancelled", &["reserve"], Paid::NotRefunded),
            ("cancelled", &["reserve", "ship"], Paid::Exactly(1, 0)),
            ("failed", &["reserve"], Paid::Exactly(0, 0)),
            ("completed", &["reserve", "ship"], Paid::Exactly(1, 0)),
        ],
        // No control, a retry that may not have committed, a fork (the fork's end), or one
        // that never started (the operated run's own).
        _ => vec![
            ("failed", &["reserve"], Paid::Exactly(0, 0)),
            ("completed", &["reserve", "ship"], Paid::Exactly(1, 0)),
        ],
    };
    let fitting = allowed.iter().find(|(s, want, _)| *s == status && kinds == *want);
    match fitting {
        Some((_, _, paid)) => {
            read.ended.insert(run_id.to_string(), *paid);
        }
        None if allowed.iter().any(|(s, _, _)| *s == status) => {
            report.violation("wrong_effects", format!("{label} ended {status} with the effects {kinds:?}"));
        }
        None => {
            let error = &read.runs[&ended_id].error;
            let ends: Vec<&str> = allowed.iter().map(|(s, _, _)| *s).collect();
            let given = action.map_or("no control".to_string(), |a| {
                format!("{a} ({})", if certain { "committed" } else { "may have committed" })
            });
            report.violation(
                "unexpected_end",
                format!("{label} ended {status} ({error:?}); given {given} it must end one of {ends:?}"),
            );
        }
    }
}

/// Did run `batch`'s chain end `failed` on its `batch_done` send to `waiter` because the waiter
/// had completed (its wait timed out first: a send to an ended run fails its step, as
/// docs/workflows.md says)? The waiter itself is checked as one that gave up ([`check_waiter`]).
fn failed_sending_to_a_completed_waiter(read: &Runs, batch: &str, waiter: &str) -> bool {
    let Ok(chain) = chain(read, batch) else { return false };
    let last = &read.runs[chain.last().expect("a chain has a run")];
    let refused = format!(
        "step {BATCH_DONE} failed: cannot send to run \"{waiter}\": run \"{waiter}\" is completed; it takes no more events"
    );
    last.status == "failed"
        && last.error.as_deref() == Some(refused.as_str())
        && read.runs.get(waiter).is_some_and(|w| w.status == "completed")
}

/// An acknowledged batch: its chain of runs (each `continued` one names the next) ends
/// `completed` (or `failed` on its send to a waiter that had given up, with every order run),
/// each of its orders ran as exactly one child of the chain (checked as an order), no other
/// order did, and the chain's last run reports each order's end.
fn check_batch(
    report: &mut CheckReport,
    read: &mut Runs,
    run_id: &str,
    orders: &[BatchOrder],
    notify: Option<&str>,
    process: usize,
) {
    if !read.runs.contains_key(run_id) {
        report.violation("lost", format!("batch {run_id} acknowledged by process {process} is not in the database"));
        return;
    }
    let chain = match chain(read, run_id) {
        Ok(chain) => chain,
        Err(broken) => return report.violation("lost", format!("batch {run_id}: {broken}")),
    };
    let last_id = chain.last().expect("a chain has a run").clone();
    let last = &read.runs[&last_id];
    *report.batches_by_status.entry(last.status.clone()).or_default() += 1;
    if let Some(owner) = last.lease_owner.as_ref().filter(|_| !last.ahead) {
        report.violation("run_leased", format!("batch {run_id}'s run {last_id} is still leased by {owner:?}"));
        read.reported.insert(last_id.clone());
    }
    let (status, active, error) = (last.status.clone(), last.active(), last.error.clone());
    let finished = match status.as_str() {
        _ if active => {
            if !late_by_a_clock_ahead(report, read, &last_id) {
                report.violation("run_unfinished", format!("batch {run_id}'s run {last_id} is {status}"));
                read.reported.insert(last_id.clone());
            }
            false
        }
        "parked" if error.is_some() => {
            report.parked += 1;
            false
        }
        "completed" => true,
        // Its orders all ran before the send (the batch's last step): checked as a completed
        // batch's, without the result the failed run does not have.
        "failed" if notify.is_some_and(|waiter| failed_sending_to_a_completed_waiter(read, run_id, waiter)) => true,
        other => {
            report.violation(
                "unexpected_end",
                format!("batch {run_id} ended {other} ({error:?}) at run {last_id}; it must end completed"),
            );
            false
        }
    };
    let reported_ends = if finished { read.runs[&last_id].result.clone() } else { None };
    // The children of every run of the chain, by order id.
    let mut ran: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for id in &chain {
        for (order_id, child) in read.children.get(id).map(Vec::as_slice).unwrap_or_default() {
            ran.entry(order_id.clone()).or_default().push(child.clone());
        }
    }
    ran.values_mut().for_each(|children| children.sort());
    for order in orders {
        let label = format!("order {} of batch {run_id}", order.order_id);
        let as_order = Order::saga(&order.order_id, order.fail.as_deref(), &order.expect, order.quantity);
        match ran.get(&order.order_id).map(Vec::as_slice).unwrap_or_default() {
            [] if finished => {
                report.violation("lost", format!("{label} never ran: the batch completed without a child for it"))
            }
            [] => {}
            [child] => check_order(report, read, &as_order, child, &format!("{label} (run {child})")),
            many => report.violation("applied_twice", format!("{label} ran as {} children: {many:?}", many.len())),
        }
    }
    for order_id in ran.keys() {
        if !orders.iter().any(|o| &o.order_id == order_id) {
            report.violation("unknown_effect", format!("batch {run_id} ran order {order_id}, which it was not given"));
        }
    }
    // The chain's last run reports every order's end, in the batch's order.
    if let Some(result) = reported_ends {
        let got: Vec<(String, String)> = serde_json::from_str::<Value>(&result)
            .ok()
            .and_then(|v| v["orders"].as_array().cloned())
            .unwrap_or_default()
            .iter()
            .map(|o| {
                (o["order_id"].as_str().unwrap_or("?").to_string(), o["status"].as_str().unwrap_or("?").to_string())
            })
            .collect();
        let want: Vec<(String, String)> = orders
            .iter()
            .map(|o| {
                let status = if o.expect == "completed" { "completed" } else { "not_completed" };
                (o.order_id.clone(), status.to_string())
            })
            .collect();
        if got != want {
            report.violation(
                "unexpected_end",
                format!("batch {run_id} reports its orders' ends as {got:?}; they must be {want:?}"),
            );
        }
    }
}

/// The chain of runs that starts at `run_id` (in the database): each `continued` run names the
/// next in its result. Err: how the chain breaks.
fn chain(read: &Runs, run_id: &str) -> std::result::Result<Vec<String>, String> {
    let mut chain = vec![run_id.to_string()];
    loop {
        let last = &read.runs[chain.last().expect("a chain has a run")];
        if last.status != "continued" {
            return Ok(chain);
        }
        let next = last
            .result
            .as_deref()
            .and_then(|r| serde_json::from_str::<Value>(r).ok())
            .and_then(|v| v["continued_as"].as_str().map(str::to_string));
        match next {
            Some(next) if read.runs.contains_key(&next) && chain.len() < CHAIN_RUNS_MAX => chain.push(next),
            _ => {
                return Err(format!(
                    "run {} continued with the result {:?}, and no run (of at most {CHAIN_RUNS_MAX}) follows",
                    chain.last().expect("a chain has a run"),
                    last.result
                ))
            }
        }
    }
}

/// An acknowledged waiter (`run_id`, a `sleepy_order` waiting for `batch_done`): told by its
/// batch (`run_id` less `-w`, acknowledged or only in the database), it must complete approved,
/// charged and shipped, with the one message received; never told (no such batch), it must
/// complete unapproved with its reservation released and nothing charged. One that gave up (its
/// 60 s wait timed out before its batch's message came: the message arrived at or after the
/// wait's deadline and lies unconsumed, or the batch's send failed because the waiter had
/// completed) must end as one never told. A batch that has not completed otherwise (still
/// running, or its end reported as its own violation) says nothing yet.
fn check_waiter(report: &mut CheckReport, read: &mut Runs, run_id: &str, quantity: i64, process: usize) {
    if !read.runs.contains_key(run_id) {
        report.violation("lost", format!("waiter {run_id} acknowledged by process {process} is not in the database"));
        return;
    }
    let batch = match read.notified_by.get(run_id) {
        Some(batch) => Some(batch.clone()),
        None => run_id.strip_suffix("-w").filter(|b| read.runs.contains_key(*b)).map(str::to_string),
    };
    let messages = read.batch_done.get(run_id).copied().unwrap_or(0);
    let late = read.batch_done_late.get(run_id).copied().unwrap_or(0);
    // Told (approved), or not: its batch never started, or it gave up (its wait timed out before
    // its batch's message came: the message arrived after the wait's deadline and lies
    // unconsumed, or the batch's send failed because the waiter had completed).
    let (told, outcome) = match &batch {
        None => (false, "never_told"),
        Some(batch) if !read.runs.contains_key(batch) => return, // lost, reported with the batch
        Some(batch) if failed_sending_to_a_completed_waiter(read, batch, run_id) => (false, "gave_up"),
        Some(batch) => match chain(read, batch) {
            Ok(chain) if read.runs[chain.last().expect("a chain has a run")].status == "completed" => {
                if late == 1 && messages == 0 {
                    (false, "gave_up")
                } else {
                    (true, "approved")
                }
            }
            _ => {
                // Not completed: the waiter's own state is still checked for what holds anyway.
                let (status, active) = (read.runs[run_id].status.clone(), read.runs[run_id].active());
                if active && !late_by_a_clock_ahead(report, read, run_id) {
                    report.violation("run_unfinished", format!("waiter {run_id} of batch {batch} is {status}"));
                    read.reported.insert(run_id.to_string());
                }
                return;
            }
        },
    };
    let label = format!("waiter {run_id}");
    let order = if told {
        Order { order_id: run_id, expect: "completed", quantity, effects: None, payments: (1, 0), cancel_sent: false }
    } else {
        Order {
            order_id: run_id,
            expect: "completed",
            quantity,
            effects: Some(&["reserve", "release"]),
            payments: (0, 0),
            cancel_sent: false,
        }
    };
    check_order(report, read, &order, run_id, &label);
    if read.ended.contains_key(run_id) {
        *report.waiters_by_outcome.entry(outcome).or_default() += 1;
        if messages != i64::from(told) {
            let batch = batch.unwrap_or_default();
            report.violation(
                if messages > 1 { "applied_twice" } else { "lost" },
                format!("{label} (told: {told}, by batch {batch:?}) received {messages} batch_done messages"),
            );
        }
    }
}

/// The payment calls of `orders` (the ledger's and the ticks'): each charged and refunded at most
/// once, and as its end leaves them once it ended as it must.
fn check_payments<'a>(
    report: &mut CheckReport,
    payments: &mut Db,
    orders: impl Iterator<Item = &'a str>,
    ended: &Ended,
) -> Result<()> {
    // One pass, grouped (the log's only index is on the idempotency key).
    let mut by_order: HashMap<String, (i64, i64)> = HashMap::new();
    for r in payments.rows(
        "SELECT order_id, sum(CASE WHEN outcome = 'charged' THEN 1 ELSE 0 END),
                sum(CASE WHEN outcome = 'refunded' THEN 1 ELSE 0 END)
         FROM payment_calls GROUP BY order_id",
        &[],
    )? {
        by_order.insert(r.text(0)?, (r.int(1)?, r.int(2)?));
    }
    for order_id in orders {
        let (charged, refunded) = by_order.get(order_id).copied().unwrap_or((0, 0));
        if charged > 1 || refunded > 1 {
            report.violation(
                "applied_twice",
                format!("order {order_id}: charged {charged} times, refunded {refunded} times"),
            );
            continue;
        }
        // Only the payments of a run that ended as it must are final (the others are reported).
        let Some(paid) = ended.get(order_id).copied() else { continue };
        let right = match paid {
            Paid::Exactly(c, r) => (charged, refunded) == (c, r),
            Paid::Undone => charged == refunded,
            Paid::NotRefunded => refunded == 0,
        };
        if !right {
            let want = match paid {
                Paid::Exactly(c, r) => format!("({c}, {r})"),
                Paid::Undone => "every charge refunded".to_string(),
                Paid::NotRefunded => "nothing refunded".to_string(),
            };
            report.violation(
                "wrong_effects",
                format!("order {order_id}: charged {charged}, refunded {refunded}; its end leaves {want}"),
            );
        }
    }
    Ok(())
}
