//! `tidemark bench`: throughput of the whole pipeline (advance, relay, apply) on real SQLite
//! files, with group commit and with one transaction per operation, on empty files and on files
//! that already hold many events, beside the disk's single-row commit ceiling.
//!
//! `tidemark bench --workflows` measures durable workflows instead (see `bench/workflows.rs`), and
//! `tidemark bench --serve` the order saga over HTTP against a `tidemark serve` child process,
//! beside the same saga in process (see `bench/serve.rs`).
//!
//! Rates are measured and printed, never asserted: `docs/benchmarks.md` explains each number.
//! Every run ends with an exactly-once check (effects == events x consumers, no duplicate
//! effect, every delivery accepted); a failed check makes the command exit 1.

use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use serde_json::{json, Value};
use tidemark_builtins::reservation::{self, ReservationHandler};
use tidemark_core::flow::{AdvanceOutcome, AdvanceRequest};
use tidemark_core::limits::{ADVANCE_BATCH_MAX, DRAIN_BATCH_EVENTS_MAX, PRUNE_BATCH_ROWS_MAX, RELAY_BATCH_EVENTS_MAX};
use tidemark_core::reservation::{ReservationMachine, STATES};
use tidemark_core::store::{ConsumerStore, DrainScope, Endpoints, Handler, ProducerStore};
use tidemark_core::{Error, Result};
use tidemark_engine::{relay_once, RelayOptions};
use tidemark_store_sqlite::{probe, Durability, SqliteEndpoints, SqliteProducer};

use crate::pipeline::Pipeline;
use crate::Context;

mod hostile;
mod pg_pipeline;
mod postgres;
mod relay_to;
mod serve;
mod split;
mod workflows;

pub use serve::ServerCommand;

/// Batch used to preload files quickly (the largest batch every stage allows).
const PRELOAD_BATCH: usize = 10_000;
/// Upper bound of the fsync probes' duration.
const PROBE_TIME_MAX: Duration = Duration::from_secs(5);

/// The arguments of `tidemark bench` (docs/benchmarks.md explains each run and number).
#[derive(Args)]
pub struct BenchArgs {
    /// Flows of each group-commit run; each flow gets --events-per-flow events.
    #[arg(long, default_value_t = 10_000)]
    flows: u64,
    /// Events per flow, 1..=3 (reserved, confirmed, released).
    #[arg(long, default_value_t = 3)]
    events_per_flow: u64,
    /// Group commit size: advance requests per producer transaction, relay limit (deliveries per
    /// consumer + producer transaction pair) and drain limit (applies per consumer transaction).
    #[arg(long, default_value_t = 5_000)]
    batch: usize,
    /// Events put in the tables before the preloaded run (0 skips it). The preload runs the same
    /// pipeline with synchronous=NORMAL and batches of 10,000, then prune compacts the older half
    /// of the inbox records to receipts; the measured run uses --durability.
    #[arg(long, default_value_t = 1_000_000)]
    preload_events: u64,
    /// Flows of the one-transaction-per-operation baseline (advance batch 1, relay limit 1, drain
    /// limit 1); 0 skips it. Rates are compared, so it may be smaller than --flows.
    #[arg(long, default_value_t = 300)]
    baseline_flows: u64,
    /// Subscribed consumers (all in the one consumer file); each applies every event.
    #[arg(long, default_value_t = 1)]
    consumers: usize,
    /// Single-row commits of the fsync probe (stops after 5 s anyway).
    #[arg(long, default_value_t = 2_000)]
    probe_commits: u64,
    /// Measure each kind of run this many times (interleaved) and report the medians.
    #[arg(long, default_value_t = 1)]
    repeat: u64,
    /// Keep the files in this folder (created if missing; must be empty). Default: a
    /// temporary folder, deleted afterwards.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// A small, fast run (for tests): 200 flows, batch 100, baseline 20 flows, preload 3,000
    /// events, 50 probe commits, 1 repeat (those six flags are overridden); with --workflows:
    /// 300 sagas, 50 in flight, 10 latency sagas, 1 ms external latency, 5 resumed runs, lease
    /// 300 ms; with --serve: 200 runs, 8 clients, 50 in flight.
    #[arg(long)]
    quick: bool,
    /// Measure durable workflows (the order saga: throughput, single-saga latency, resumption
    /// after a killed worker) instead of the outbox/inbox pipeline. Uses --repeat, --dir,
    /// --probe-commits, --quick, --durability and the flags below; the others are ignored.
    #[arg(long)]
    workflows: bool,
    /// --workflows: sagas of each throughput run (all started first, then run by one worker).
    #[arg(long, default_value_t = 20_000)]
    sagas: u64,
    /// --workflows: runs the worker has in flight at once in the throughput runs.
    #[arg(long, default_value_t = 1_000)]
    in_flight: usize,
    /// --workflows: sagas run one at a time for the latency percentiles (0 skips).
    #[arg(long, default_value_t = 200)]
    latency_sagas: u64,
    /// --workflows: simulated latency of the external step (the charge) in a second throughput
    /// run (0 skips it).
    #[arg(long, default_value_t = 20)]
    external_latency_ms: u64,
    /// --workflows: runs of the killed worker that another worker resumes (0 skips).
    #[arg(long, default_value_t = 100)]
    resume_sagas: u64,
    /// --workflows: the lease of the resumption measurement's workers.
    #[arg(long, default_value_t = 1_000)]
    lease_ms: i64,
    /// Measure on PostgreSQL instead of SQLite files: a `postgres://user@host:port/db?schema=P`
    /// URL. Every store of the run is a fresh schema `P_<run>` (one that exists is refused) and
    /// is dropped at the end; the server's durability is used as it is. Adds pgbench's
    /// single-row commit ceilings (--pgbench-seconds) and, with --workflows, the one- and
    /// two-`tidemark worker`-process runs (--process-sagas). See docs/benchmarks.md.
    #[arg(long, conflicts_with = "relay_to")]
    store: Option<String>,
    /// --store: seconds of each pgbench run (1 client, then 8 clients); 0 skips them.
    #[arg(long, default_value_t = 5)]
    pgbench_seconds: u64,
    /// --store (the pipeline): run each repeat's group-commit and pipelined runs again while
    /// another session holds a transaction open (an xmin horizon held back), and report the
    /// rates of both, what `pg_stat_activity` shows of it, and the dead row versions a `VACUUM`
    /// of the run's tables could not remove.
    #[arg(long)]
    hold_transaction: bool,
    /// --workflows --store: sagas of the runs by one and by two `tidemark worker` processes
    /// (0 skips them).
    #[arg(long, default_value_t = 20_000)]
    process_sagas: u64,
    /// --workflows: SKUs the orders are spread over (order i reserves `widget-<i mod N>`); 1,
    /// the default, is the one SKU `widget`, whose stock row every reservation locks until its
    /// transaction commits (on PostgreSQL, two workers' group commits take turns on it).
    #[arg(long, default_value_t = 1)]
    skus: u64,
    /// Measure the order saga over HTTP: a `tidemark serve` child process loaded by --clients
    /// clients of this process, then the same saga in process (the --workflows throughput run),
    /// with the ratios of the two. Uses --runs, --clients, --in-flight, --repeat, --dir, --quick
    /// and --durability; the others are ignored.
    #[arg(long, conflicts_with = "workflows")]
    serve: bool,
    /// --serve: order sagas started over HTTP (and run in process afterwards).
    #[arg(long, default_value_t = 20_000)]
    runs: u64,
    /// --serve: concurrent HTTP clients (closed loop, keep-alive connections).
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// Measure delivery from one `tidemark serve` to another over `http`, through `nats`
    /// (JetStream at --nats) or through `rabbitmq` (at --amqp), beside the raw rate of the same
    /// transport in the same run (see docs/benchmarks.md; no `kafka`: there is no Kafka broker to
    /// measure against here). Uses --relay-events, --relay-flows, --relay-batch, --black-hole,
    /// --dir, --quick and --durability.
    #[arg(long, value_parser = ["http", "nats", "rabbitmq"], conflicts_with_all = ["workflows", "serve"])]
    relay_to: Option<String>,
    /// --relay-to: events relayed.
    #[arg(long, default_value_t = 20_000)]
    relay_events: u64,
    /// --relay-to: flows they are spread over.
    #[arg(long, default_value_t = 100)]
    relay_flows: u64,
    /// --relay-to: the sender's relay batch (and the raw run's batch size).
    #[arg(long, default_value_t = 1_000)]
    relay_batch: usize,
    /// --relay-to nats: the NATS server (`host:port`, JetStream on).
    #[arg(long, default_value = "127.0.0.1:4222")]
    nats: String,
    /// --relay-to rabbitmq: the RabbitMQ broker (`host:port`, connected to as `guest`, which it
    /// accepts from loopback only); the bench declares its exchanges and quorum queues and deletes
    /// them afterwards.
    #[arg(long, default_value = "127.0.0.1:5672")]
    amqp: String,
    /// --relay-to http: then measure a second healthy subscriber beside a subscription to an
    /// endpoint that accepts connections and never answers, against the first one's rate alone.
    #[arg(long, requires = "relay_to")]
    black_hole: bool,
    /// Measure what hostile clients cost the others: a `tidemark serve` child's latency to
    /// measured clients and to new connections, quiet and then under --slow-clients connections
    /// that never finish their request head, with the shipped limits and with a per-address
    /// limit; and (shipped limits) under --flood-clients sending complete requests as fast as they
    /// are answered, with guessed tokens and with another tenant's. Uses --slow-clients,
    /// --slow-addresses, --flood-clients, --hostile-seconds, --dir, --quick and --durability.
    #[arg(long, conflicts_with_all = ["workflows", "serve", "relay_to"])]
    hostile: bool,
    /// --hostile: slow connections (0..=20,000).
    #[arg(long, default_value_t = 2_000)]
    slow_clients: usize,
    /// --hostile: the loopback addresses they (and the flood clients) come from, 127.0.0.2
    /// upwards (1..=60,000).
    #[arg(long, default_value_t = 200)]
    slow_addresses: usize,
    /// --hostile: closed-loop clients of the token-guessing and noisy-neighbor phases (1..=10,000).
    #[arg(long, default_value_t = 64)]
    flood_clients: usize,
    /// --hostile: seconds of each phase (1..=3,600).
    #[arg(long, default_value_t = 20)]
    hostile_seconds: u64,
}

/// How many operations share one transaction in each stage.
#[derive(Debug, Clone, Copy)]
struct Mode {
    advance_batch: usize,
    relay_limit: usize,
    drain_limit: usize,
}

impl Mode {
    fn json(&self) -> Value {
        json!({"advance_batch": self.advance_batch, "relay_limit": self.relay_limit, "drain_limit": self.drain_limit})
    }
}

/// What one pipeline run did and how long each stage took.
#[derive(Debug, Default, Clone)]
struct RunStats {
    events: u64,
    deliveries: u64,
    applied: u64,
    advance_transactions: u64,
    relay_passes: u64,
    drain_transactions: u64,
    advance: Duration,
    relay: Duration,
    drain: Duration,
    total: Duration,
    /// On-CPU and run-queue time of this thread over the run (Linux `schedstat`), when known.
    sched: Option<Sched>,
    /// Each thread's own counters, for runs on more than one thread (the busiest thread bounds
    /// what the run can do with a core per thread).
    threads: Vec<(&'static str, Sched)>,
}

/// This thread's scheduler counters (Linux `/proc/thread-self/schedstat`): nanoseconds on a CPU
/// and nanoseconds runnable but waiting for one (time other processes took from us).
#[derive(Debug, Default, Clone, Copy)]
struct Sched {
    on_cpu_ns: u64,
    run_queue_ns: u64,
}

impl Sched {
    fn now() -> Option<Sched> {
        let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
        let mut fields = text.split_whitespace().map(|f| f.parse::<u64>().ok());
        Some(Sched { on_cpu_ns: fields.next()??, run_queue_ns: fields.next()?? })
    }

    fn since(self, start: Sched) -> Sched {
        Sched {
            on_cpu_ns: self.on_cpu_ns.saturating_sub(start.on_cpu_ns),
            run_queue_ns: self.run_queue_ns.saturating_sub(start.run_queue_ns),
        }
    }
}

fn rate(count: u64, elapsed: Duration) -> f64 {
    let seconds = elapsed.as_secs_f64();
    if seconds <= 0.0 {
        return 0.0;
    }
    round1(count as f64 / seconds)
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

impl RunStats {
    fn end_to_end_rate(&self) -> f64 {
        rate(self.events, self.total)
    }

    fn json(&self) -> Value {
        json!({
            "events": self.events,
            "deliveries": self.deliveries,
            "applied": self.applied,
            "transactions": {
                "advance": self.advance_transactions,
                "relay_passes": self.relay_passes,
                "drain": self.drain_transactions,
            },
            "seconds": {
                "advance": round3(self.advance.as_secs_f64()),
                "relay": round3(self.relay.as_secs_f64()),
                "drain": round3(self.drain.as_secs_f64()),
                "total": round3(self.total.as_secs_f64()),
            },
            "threads_on_cpu_seconds": (!self.threads.is_empty()).then(|| {
                self.threads.iter().map(|(name, s)| (name.to_string(), json!(round3(s.on_cpu_ns as f64 / 1e9)))).collect::<serde_json::Map<_, _>>()
            }),
            "end_to_end_events_per_busiest_thread_cpu_s": self.threads.iter().map(|(_, s)| s.on_cpu_ns).max()
                .map(|ns| rate(self.events, Duration::from_nanos(ns))),
            "cpu": self.sched.map(|s| json!({
                "on_cpu_seconds": round3(s.on_cpu_ns as f64 / 1e9),
                "run_queue_wait_seconds": round3(s.run_queue_ns as f64 / 1e9),
                "end_to_end_events_per_cpu_s": rate(self.events, Duration::from_nanos(s.on_cpu_ns)),
            })),
            "rates_per_s": {
                "advance_events": rate(self.events, self.advance),
                "relay_deliveries": rate(self.deliveries, self.relay),
                "drain_applies": rate(self.applied, self.drain),
                "end_to_end_events": self.end_to_end_rate(),
            },
        })
    }
}

fn failed(message: String) -> Error {
    Error::Invariant(format!("bench: {message}"))
}

/// The `(round, flow)` advance requests of a run, in order: every flow's first event, then every
/// flow's second event, and so on.
fn request(prefix: &str, index: u64, round: u64) -> AdvanceRequest {
    AdvanceRequest {
        flow_id: format!("{prefix}-{index:08}"),
        expected_seq: round as i64,
        to_state: STATES[round as usize + 1].to_string(),
        input: if round == 0 { json!({"quantity": 1 + (index % 1_000) as i64}) } else { json!({}) },
        schema_version: 1,
        traceparent: None,
    }
}

/// Run `flows x events_per_flow` events through advance, relay and drain in waves of
/// `mode.advance_batch` events: each wave is advanced, then relayed until every delivery of the
/// wave is accepted, then drained by every consumer until every event of the wave is applied.
fn run_pipeline(
    p: &mut Pipeline,
    consumer_ids: &[String],
    prefix: &str,
    flows: u64,
    events_per_flow: u64,
    mode: Mode,
    now_ms: i64,
) -> Result<RunStats> {
    let mut handler = ReservationHandler::new(false);
    let run = Waves { consumer_ids, prefix, flows, events_per_flow, mode, now_ms };
    run_waves(&mut p.producer, &mut p.endpoints, &mut p.consumer, &mut handler, &run)
}

/// What [`run_waves`] runs.
struct Waves<'a> {
    consumer_ids: &'a [String],
    prefix: &'a str,
    flows: u64,
    events_per_flow: u64,
    mode: Mode,
    now_ms: i64,
}

/// [`run_pipeline`] on any stores: the producer, the relay's endpoints and the consumer (the
/// store the endpoints deliver to), with `handler` applying the events.
fn run_waves<P: ProducerStore, E: Endpoints, C: ConsumerStore>(
    producer: &mut P,
    endpoints: &mut E,
    consumer: &mut C,
    handler: &mut dyn Handler<C::Target>,
    run: &Waves<'_>,
) -> Result<RunStats> {
    let Waves { consumer_ids, prefix, flows, events_per_flow, mode, now_ms } = *run;
    let mut stats = RunStats::default();
    let options = RelayOptions { limit: mode.relay_limit, ..RelayOptions::default() };
    let total = flows * events_per_flow;
    let started = Instant::now();
    let sched_start = Sched::now();
    let mut next = 0_u64;
    while next < total {
        let wave_len = (total - next).min(mode.advance_batch as u64);
        let requests: Vec<AdvanceRequest> =
            (next..next + wave_len).map(|i| request(prefix, i % flows, i / flows)).collect();
        next += wave_len;

        let t = Instant::now();
        let outcomes = producer.advance_batch(&ReservationMachine, &requests, now_ms)?;
        stats.advance += t.elapsed();
        stats.advance_transactions += 1;
        if let Some(other) = outcomes.iter().find(|o| !matches!(o, AdvanceOutcome::Committed { .. })) {
            return Err(failed(format!("an advance was not committed: {other:?}")));
        }
        stats.events += wave_len;

        let due = wave_len * consumer_ids.len() as u64;
        let mut relayed = 0_u64;
        let t = Instant::now();
        while relayed < due {
            let report = relay_once(producer, endpoints, &options, now_ms, &mut || 0.5)?;
            stats.relay_passes += 1;
            if report.attempted == 0 || report.accepted != report.attempted {
                return Err(failed(format!("relay pass did not accept every delivery: {report:?}")));
            }
            relayed += report.attempted;
        }
        stats.relay += t.elapsed();
        stats.deliveries += relayed;

        let t = Instant::now();
        for consumer_id in consumer_ids {
            let mut applied = 0_u64;
            while applied < wave_len {
                let report = consumer.drain(consumer_id, &DrainScope::All, mode.drain_limit, handler, now_ms)?;
                stats.drain_transactions += 1;
                if report.applied == 0 {
                    return Err(failed(format!("drain of {consumer_id} applied nothing: {report:?}")));
                }
                applied += report.applied;
            }
            stats.applied += applied;
        }
        stats.drain += t.elapsed();
    }
    stats.total = started.elapsed();
    stats.sched = Sched::now().zip(sched_start).map(|(end, start)| end.since(start));
    Ok(stats)
}

/// Per-thread results of a pipelined run.
struct ThreadResult {
    busy: Duration,
    calls: u64,
    count: u64,
    sched: Option<Sched>,
}

fn sched_delta(start: Option<Sched>) -> Option<Sched> {
    Sched::now().zip(start).map(|(end, start)| end.since(start))
}

/// Run the same events as [`run_pipeline`], but as three threads with their own connections, as
/// three processes would run them: a producer advancing waves of `mode.advance_batch`, a relay
/// passing `mode.relay_limit` deliveries at a time, and a consumer draining `mode.drain_limit`
/// at a time. The relay and the consumer sleep 1 ms when they find nothing to do. Every loop is
/// bounded by `deadline`.
#[allow(clippy::too_many_arguments)]
fn run_pipelined(
    producer_path: &Path,
    consumer_path: &Path,
    consumer_ids: &[String],
    prefix: &str,
    flows: u64,
    events_per_flow: u64,
    mode: Mode,
    durability: Durability,
    now_ms: i64,
    deadline: Duration,
) -> Result<RunStats> {
    let sides = SqliteSides { producer_path, consumer_path, durability };
    let run = Waves { consumer_ids, prefix, flows, events_per_flow, mode, now_ms };
    run_three_threads(&sides, &run, deadline)
}

/// How the three-thread run opens each side on a connection of its own.
trait Sides: Sync {
    type P: ProducerStore;
    type C: ConsumerStore;
    type E: Endpoints;
    fn producer(&self) -> Result<Self::P>;
    fn consumer(&self) -> Result<Self::C>;
    fn endpoints(&self) -> Self::E;
    fn handler(&self) -> Box<dyn Handler<<Self::C as ConsumerStore>::Target>>;
}

/// The SQLite files of a pipelined run.
struct SqliteSides<'a> {
    producer_path: &'a Path,
    consumer_path: &'a Path,
    durability: Durability,
}

impl Sides for SqliteSides<'_> {
    type P = SqliteProducer;
    type C = tidemark_store_sqlite::SqliteConsumer;
    type E = SqliteEndpoints;

    fn producer(&self) -> Result<SqliteProducer> {
        SqliteProducer::open_with(self.producer_path, self.durability)
    }

    fn consumer(&self) -> Result<Self::C> {
        crate::open_consumer(self.consumer_path, self.durability)
    }

    fn endpoints(&self) -> SqliteEndpoints {
        SqliteEndpoints::new(self.durability)
    }

    fn handler(&self) -> Box<dyn Handler<rusqlite::Connection>> {
        Box::new(ReservationHandler::new(false))
    }
}

/// [`run_pipelined`] on any stores `sides` opens.
fn run_three_threads<S: Sides>(sides: &S, run: &Waves<'_>, deadline: Duration) -> Result<RunStats> {
    let Waves { consumer_ids, prefix, flows, events_per_flow, mode, now_ms } = *run;
    let total = flows * events_per_flow;
    let deliveries_due = total * consumer_ids.len() as u64;
    let started = Instant::now();
    // Set by a thread that fails, so that the others stop instead of waiting for the deadline.
    let failed_thread = AtomicBool::new(false);
    let stop = |what: &str| -> Option<Error> {
        if failed_thread.load(Ordering::SeqCst) {
            Some(failed(format!("pipelined {what} stopped: another thread failed")))
        } else if started.elapsed() > deadline {
            Some(failed(format!("pipelined {what} did not finish within {deadline:?}")))
        } else {
            None
        }
    };
    let flag = |result: Result<ThreadResult>| {
        if result.is_err() {
            failed_thread.store(true, Ordering::SeqCst);
        }
        result
    };
    let idle = Duration::from_millis(1);
    let (producer, relay, drain) = std::thread::scope(|scope| {
        let producer = scope.spawn(|| {
            flag((|| -> Result<ThreadResult> {
                let sched = Sched::now();
                let mut producer = sides.producer()?;
                let mut result = ThreadResult { busy: Duration::ZERO, calls: 0, count: 0, sched: None };
                let mut next = 0_u64;
                while next < total {
                    if let Some(error) = stop("producer") {
                        return Err(error);
                    }
                    let wave_len = (total - next).min(mode.advance_batch as u64);
                    let requests: Vec<AdvanceRequest> =
                        (next..next + wave_len).map(|i| request(prefix, i % flows, i / flows)).collect();
                    next += wave_len;
                    let t = Instant::now();
                    let outcomes = producer.advance_batch(&ReservationMachine, &requests, now_ms)?;
                    result.busy += t.elapsed();
                    result.calls += 1;
                    if let Some(other) = outcomes.iter().find(|o| !matches!(o, AdvanceOutcome::Committed { .. })) {
                        return Err(failed(format!("an advance was not committed: {other:?}")));
                    }
                    result.count += wave_len;
                }
                result.sched = sched_delta(sched);
                Ok(result)
            })())
        });
        let relay = scope.spawn(|| {
            flag((|| -> Result<ThreadResult> {
                let sched = Sched::now();
                let mut producer = sides.producer()?;
                let mut endpoints = sides.endpoints();
                let options = RelayOptions { limit: mode.relay_limit, ..RelayOptions::default() };
                let mut result = ThreadResult { busy: Duration::ZERO, calls: 0, count: 0, sched: None };
                while result.count < deliveries_due {
                    if let Some(error) = stop("relay") {
                        return Err(error);
                    }
                    let t = Instant::now();
                    let report = relay_once(&mut producer, &mut endpoints, &options, now_ms, &mut || 0.5)?;
                    if report.attempted == 0 {
                        std::thread::sleep(idle);
                        continue;
                    }
                    result.busy += t.elapsed();
                    result.calls += 1;
                    if report.accepted != report.attempted {
                        return Err(failed(format!("relay pass did not accept every delivery: {report:?}")));
                    }
                    result.count += report.attempted;
                }
                result.sched = sched_delta(sched);
                Ok(result)
            })())
        });
        let drain = scope.spawn(|| {
            flag((|| -> Result<ThreadResult> {
                let sched = Sched::now();
                let mut consumer = sides.consumer()?;
                let mut handler = sides.handler();
                let mut result = ThreadResult { busy: Duration::ZERO, calls: 0, count: 0, sched: None };
                let mut applied: Vec<u64> = vec![0; consumer_ids.len()];
                while result.count < deliveries_due {
                    if let Some(error) = stop("drain") {
                        return Err(error);
                    }
                    let mut progressed = false;
                    for (consumer_id, applied) in consumer_ids.iter().zip(applied.iter_mut()) {
                        if *applied == total {
                            continue;
                        }
                        let t = Instant::now();
                        let report =
                            consumer.drain(consumer_id, &DrainScope::All, mode.drain_limit, &mut *handler, now_ms)?;
                        if report.applied > 0 {
                            result.busy += t.elapsed();
                            result.calls += 1;
                            result.count += report.applied;
                            *applied += report.applied;
                            progressed = true;
                        }
                    }
                    if !progressed {
                        std::thread::sleep(idle);
                    }
                }
                result.sched = sched_delta(sched);
                Ok(result)
            })())
        });
        let join = |handle: std::thread::ScopedJoinHandle<'_, Result<ThreadResult>>| {
            handle.join().unwrap_or_else(|_| Err(failed("a pipelined thread panicked".into())))
        };
        (join(producer), join(relay), join(drain))
    });
    let (producer, relay, drain) = (producer?, relay?, drain?);
    let total_elapsed = started.elapsed();
    let sched = [producer.sched, relay.sched, drain.sched].into_iter().try_fold(Sched::default(), |sum, s| {
        s.map(|s| Sched { on_cpu_ns: sum.on_cpu_ns + s.on_cpu_ns, run_queue_ns: sum.run_queue_ns + s.run_queue_ns })
    });
    Ok(RunStats {
        events: producer.count,
        deliveries: relay.count,
        applied: drain.count,
        advance_transactions: producer.calls,
        relay_passes: relay.calls,
        drain_transactions: drain.calls,
        advance: producer.busy,
        relay: relay.busy,
        drain: drain.busy,
        total: total_elapsed,
        sched,
        threads: [("producer", producer.sched), ("relay", relay.sched), ("consumer", drain.sched)]
            .into_iter()
            .filter_map(|(name, s)| s.map(|s| (name, s)))
            .collect(),
    })
}

/// The exactly-once check of a pipeline's files: one effect per applied event and consumer, no
/// duplicate effect, every delivery accepted, nothing left open in the inbox.
fn verify(p: &Pipeline, expected_effects: u64) -> Result<Value> {
    let effects = reservation::effect_count(p.consumer.connection())?;
    let duplicates = reservation::duplicate_effects(p.consumer.connection())?;
    let deliveries = p.producer.delivery_counts()?;
    let not_accepted: i64 = deliveries.iter().filter(|(status, _)| status != "accepted").map(|(_, n)| n).sum();
    let passed = effects == expected_effects && duplicates.is_empty() && not_accepted == 0;
    Ok(json!({
        "passed": passed,
        "effects": effects,
        "expected_effects": expected_effects,
        "duplicate_effects": duplicates.len(),
        "deliveries_by_status": deliveries.into_iter().map(|(status, n)| (status, json!(n))).collect::<serde_json::Map<String, Value>>(),
    }))
}

fn reopen(p: Pipeline, durability: Durability) -> Result<Pipeline> {
    let Pipeline { producer_path, consumer_path, producer, consumer, endpoints } = p;
    drop((producer, consumer, endpoints));
    reopen_paths(&producer_path, &consumer_path, durability)
}

fn reopen_paths(producer_path: &Path, consumer_path: &Path, durability: Durability) -> Result<Pipeline> {
    Ok(Pipeline {
        producer: SqliteProducer::open_with(producer_path, durability)?,
        consumer: crate::open_consumer(consumer_path, durability)?,
        endpoints: SqliteEndpoints::new(durability),
        producer_path: producer_path.to_path_buf(),
        consumer_path: consumer_path.to_path_buf(),
    })
}

/// Raw `fdatasync` rate of a small file rewritten in place (no SQLite at all).
fn fdatasync_rate(path: &Path, syncs: u64) -> Result<Value> {
    let io = |e: std::io::Error| Error::io(format!("{}: {e}", path.display()));
    let mut file = std::fs::OpenOptions::new().create_new(true).write(true).open(path).map_err(io)?;
    let start = Instant::now();
    let mut done = 0_u64;
    while done < syncs && start.elapsed() < PROBE_TIME_MAX {
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        file.write_all(&done.to_le_bytes()).map_err(io)?;
        file.sync_data().map_err(io)?;
        done += 1;
    }
    let elapsed = start.elapsed();
    Ok(json!({"syncs": done, "seconds": round3(elapsed.as_secs_f64()), "per_s": rate(done, elapsed)}))
}

fn durability_word(durability: Durability) -> &'static str {
    match durability {
        Durability::Full => "full",
        Durability::Normal => "normal",
    }
}

fn check_range(name: &str, value: u64, min: u64, max: u64) -> Result<()> {
    if value < min || value > max {
        return Err(crate::invalid(format!("{name} must be {min}..={max}, got {value}")));
    }
    Ok(())
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => round1((sorted[n / 2 - 1] + sorted[n / 2]) / 2.0),
    }
}

/// Runs of one kind: each run's JSON, and the median end-to-end rate.
#[derive(Default)]
struct Series {
    runs: Vec<Value>,
    rates: Vec<f64>,
    /// Events per second of on-CPU time of the measuring threads, when known.
    cpu_rates: Vec<f64>,
}

impl Series {
    fn push(&mut self, stats: &RunStats, check: Value) {
        self.rates.push(stats.end_to_end_rate());
        if let Some(sched) = stats.sched {
            self.cpu_rates.push(rate(stats.events, Duration::from_nanos(sched.on_cpu_ns)));
        }
        let mut run = stats.json();
        run["check"] = check;
        self.runs.push(run);
    }

    fn median(&self) -> Option<f64> {
        (!self.rates.is_empty()).then(|| median(&self.rates))
    }

    fn json(&self, mode: Mode, what: &str) -> Value {
        json!({
            "what": what,
            "mode": mode.json(),
            "end_to_end_events_per_s_median": self.median(),
            "end_to_end_events_per_s_each": self.rates,
            "end_to_end_events_per_cpu_s_median": (!self.cpu_rates.is_empty()).then(|| median(&self.cpu_rates)),
            "runs": self.runs,
        })
    }
}

fn passed(check: &Value) -> bool {
    check["passed"] == json!(true)
}

fn run_workflows(ctx: &Context, args: &BenchArgs, dir: &Path) -> Result<Value> {
    let mut params = workflows::Params {
        sagas: args.sagas,
        in_flight: args.in_flight,
        latency_sagas: args.latency_sagas,
        external_latency_ms: args.external_latency_ms,
        resume_sagas: args.resume_sagas,
        lease_ms: args.lease_ms,
        repeat: args.repeat,
        probe_commits: args.probe_commits,
        process_sagas: args.process_sagas,
        pgbench_seconds: args.pgbench_seconds,
        skus: args.skus,
    };
    if args.quick {
        workflows::quick(&mut params);
    }
    check_range("--sagas", params.sagas, 1, 10_000_000)?;
    check_range("--in-flight", params.in_flight as u64, 1, tidemark_core::workflow::CLAIM_BATCH_MAX as u64)?;
    check_range("--latency-sagas", params.latency_sagas, 0, 1_000_000)?;
    check_range("--external-latency-ms", params.external_latency_ms, 0, 60_000)?;
    check_range("--resume-sagas", params.resume_sagas, 0, tidemark_core::workflow::CLAIM_BATCH_MAX as u64)?;
    let lease = params.lease_ms.max(0) as u64;
    check_range(
        "--lease-ms",
        lease,
        tidemark_core::workflow::LEASE_MS_MIN as u64,
        tidemark_core::workflow::LEASE_MS_MAX as u64,
    )?;
    check_range("--repeat", params.repeat, 1, 20)?;
    check_range("--probe-commits", params.probe_commits, 1, 1_000_000)?;
    check_range("--process-sagas", params.process_sagas, 0, 10_000_000)?;
    check_range("--pgbench-seconds", params.pgbench_seconds, 0, 600)?;
    check_range("--skus", params.skus, 1, 1_000_000)?;
    match store_location(args)? {
        Some(location) => postgres::run_workflows(&location, dir, &params),
        None => workflows::run(dir, ctx.durability, &params),
    }
}

/// `--store`: `None` for the SQLite files in the bench's folder, the server otherwise. Anything
/// but a `postgres://` URL is `invalid_store`, before anything is opened.
fn store_location(args: &BenchArgs) -> Result<Option<tidemark_core::location::PostgresLocation>> {
    use tidemark_core::location::StoreLocation;
    let Some(store) = &args.store else { return Ok(None) };
    match StoreLocation::parse(store)? {
        StoreLocation::Postgres(location) => Ok(Some(location)),
        StoreLocation::Sqlite(_) => Err(Error::invalid(
            tidemark_core::codes::INVALID_STORE,
            "bench --store takes a postgres:// URL; the SQLite bench makes its files in --dir",
        )),
    }
}

/// The folder of the bench's files: `--dir` (created if missing, must be empty) or `temp`.
fn bench_dir(args: &BenchArgs, temp: &Path) -> Result<PathBuf> {
    Ok(match &args.dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).map_err(|e| Error::io(format!("{}: {e}", dir.display())))?;
            let used = std::fs::read_dir(dir).map_err(|e| Error::io(format!("{}: {e}", dir.display())))?.next();
            if used.is_some() {
                return Err(Error::invalid(
                    tidemark_core::codes::ALREADY_EXISTS,
                    format!("{} is not empty; pick an empty folder", dir.display()),
                ));
            }
            dir.clone()
        }
        None => temp.to_path_buf(),
    })
}

/// `--serve`, with the server started by `command`.
pub fn run_serve(ctx: &Context, args: &BenchArgs, command: &ServerCommand) -> Result<Value> {
    let mut params = serve::Params {
        runs: args.runs,
        clients: args.clients,
        in_flight: args.in_flight,
        repeat: args.repeat,
        store: store_location(args)?,
    };
    if args.quick {
        serve::quick(&mut params);
    }
    check_range("--runs", params.runs, 1, 10_000_000)?;
    check_range("--clients", params.clients as u64, 1, 4_096)?;
    check_range("--in-flight", params.in_flight as u64, 1, tidemark_core::workflow::CLAIM_BATCH_MAX as u64)?;
    check_range("--repeat", params.repeat, 1, 20)?;
    let temp = tempfile::tempdir().map_err(|e| Error::io(e.to_string()))?;
    let dir = bench_dir(args, temp.path())?;
    let mut out = serve::run(&dir, ctx.durability, &params, command)?;
    out["params"]["files_kept"] = json!(args.dir.is_some());
    Ok(out)
}

/// `--hostile`, with the server started by `command`.
pub fn run_hostile(ctx: &Context, args: &BenchArgs, command: &ServerCommand) -> Result<Value> {
    let mut params = hostile::Params {
        slow: args.slow_clients,
        addresses: args.slow_addresses,
        flood: args.flood_clients,
        phase_s: args.hostile_seconds,
    };
    if args.quick {
        hostile::quick(&mut params);
    }
    check_range("--slow-clients", params.slow as u64, 0, 20_000)?;
    check_range("--slow-addresses", params.addresses as u64, 1, 60_000)?;
    check_range("--flood-clients", params.flood as u64, 1, 10_000)?;
    check_range("--hostile-seconds", params.phase_s, 1, 3_600)?;
    let temp = tempfile::tempdir().map_err(|e| Error::io(e.to_string()))?;
    let dir = bench_dir(args, temp.path())?;
    let mut out = hostile::run(&dir, ctx.durability, &params, command)?;
    out["params"]["files_kept"] = json!(args.dir.is_some());
    Ok(out)
}

/// `--relay-to`, with the servers started by `command`.
pub fn run_relay_to(ctx: &Context, args: &BenchArgs, command: &ServerCommand) -> Result<Value> {
    let mut params = relay_to::Params {
        kind: args.relay_to.clone().unwrap_or_default(),
        events: args.relay_events,
        flows: args.relay_flows,
        batch: args.relay_batch,
        nats: args.nats.clone(),
        amqp: args.amqp.clone(),
        black_hole: args.black_hole,
    };
    if args.quick {
        params.events = 400;
        params.flows = 20;
        params.batch = 100;
    }
    check_range("--relay-events", params.events, 1, 10_000_000)?;
    check_range("--relay-flows", params.flows, 1, 1_000_000)?;
    check_range("--relay-batch", params.batch as u64, 1, RELAY_BATCH_EVENTS_MAX as u64)?;
    let temp = tempfile::tempdir().map_err(|e| Error::io(e.to_string()))?;
    let dir = bench_dir(args, temp.path())?;
    let mut out = relay_to::run(&dir, ctx.durability, &params, command)?;
    out["params"]["files_kept"] = json!(args.dir.is_some());
    Ok(out)
}

/// Run the benchmarks asked for and return their measurements with the exactly-once check of each
/// run (`check.passed` false makes the command exit 1). An argument out of its range is
/// `invalid_argument`; a `--dir` that is not empty is `already_exists`.
pub fn run(ctx: &Context, mut args: BenchArgs) -> Result<Value> {
    if args.serve {
        return run_serve(ctx, &args, &ServerCommand::this_binary()?);
    }
    if args.hostile {
        return run_hostile(ctx, &args, &ServerCommand::this_binary()?);
    }
    if args.relay_to.is_some() {
        return run_relay_to(ctx, &args, &ServerCommand::this_binary()?);
    }
    if args.workflows {
        let temp = tempfile::tempdir().map_err(|e| Error::io(e.to_string()))?;
        let dir = bench_dir(&args, temp.path())?;
        let mut out = run_workflows(ctx, &args, &dir)?;
        out["params"]["files_kept"] = json!(args.dir.is_some());
        return Ok(out);
    }
    if args.quick {
        args.flows = 200;
        args.batch = 100;
        args.baseline_flows = 20;
        args.preload_events = 3_000;
        args.probe_commits = 50;
        args.repeat = 1;
    }
    check_range("--flows", args.flows, 1, 10_000_000)?;
    check_range("--events-per-flow", args.events_per_flow, 1, 3)?;
    let batch_max = ADVANCE_BATCH_MAX.min(RELAY_BATCH_EVENTS_MAX).min(DRAIN_BATCH_EVENTS_MAX) as u64;
    check_range("--batch", args.batch as u64, 1, batch_max)?;
    check_range("--preload-events", args.preload_events, 0, 100_000_000)?;
    check_range("--baseline-flows", args.baseline_flows, 0, 1_000_000)?;
    check_range("--consumers", args.consumers as u64, 1, 16)?;
    check_range("--probe-commits", args.probe_commits, 1, 1_000_000)?;
    check_range("--repeat", args.repeat, 1, 20)?;

    let temp = tempfile::tempdir().map_err(|e| Error::io(e.to_string()))?;
    if let Some(location) = store_location(&args)? {
        check_range("--pgbench-seconds", args.pgbench_seconds, 0, 600)?;
        let dir = bench_dir(&args, temp.path())?;
        let params = pg_pipeline::Params {
            flows: args.flows,
            events_per_flow: args.events_per_flow,
            batch: args.batch,
            baseline_flows: args.baseline_flows,
            consumers: args.consumers,
            repeat: args.repeat,
            pgbench_seconds: if args.quick { 1 } else { args.pgbench_seconds },
            hold_transaction: args.hold_transaction,
            now_ms: ctx.now_ms(),
        };
        return pg_pipeline::run(&location, &dir, &params);
    }
    let dir = bench_dir(&args, temp.path())?;
    let sub = |name: String| -> Result<PathBuf> {
        let path = dir.join(name);
        std::fs::create_dir_all(&path).map_err(|e| Error::io(format!("{}: {e}", path.display())))?;
        Ok(path)
    };
    let durability = ctx.durability;
    let now = ctx.now_ms();
    let consumer_ids: Vec<String> = (1..=args.consumers).map(|i| format!("c{i}")).collect();
    let id_refs: Vec<&str> = consumer_ids.iter().map(String::as_str).collect();
    let group = Mode { advance_batch: args.batch, relay_limit: args.batch, drain_limit: args.batch };
    let one = Mode { advance_batch: 1, relay_limit: 1, drain_limit: 1 };
    let consumers = args.consumers as u64;
    let (flows, per_flow) = (args.flows, args.events_per_flow);
    let deadline = Duration::from_secs(3_600);
    let mut all_passed = true;

    // Steps: the probes, the preload, then each repeat.
    let steps = 1 + u64::from(args.preload_events > 0) + args.repeat;
    let mut progress = crate::progress::Progress::start("bench", steps);
    // The disk: single-row commits with synchronous=FULL, and raw fdatasync.
    let commit_probe =
        probe::single_row_commits(&dir.join("probe.db"), Durability::Full, args.probe_commits, PROBE_TIME_MAX)?;
    let fdatasync = fdatasync_rate(&dir.join("fdatasync.bin"), args.probe_commits)?;
    // The CPU side: bare inserts of inbox-shaped rows, `batch` per transaction.
    let insert_rows = (flows * per_flow).min(30_000);
    let insert_probe = probe::inbox_inserts(&dir.join("inserts.db"), durability, insert_rows, args.batch as u64)?;
    progress.advance(1, "probes");

    // Preload once (fast: synchronous=NORMAL, batches of 10,000), then reopen with `durability`.
    let mut preloaded_pipeline = None;
    let mut preload_json = Value::Null;
    if args.preload_events > 0 {
        let preload_flows = args.preload_events.div_ceil(per_flow);
        let mut p = Pipeline::create(&sub("preloaded".into())?, "bench", &id_refs, Durability::Normal, now)?;
        let preload_mode =
            Mode { advance_batch: PRELOAD_BATCH, relay_limit: PRELOAD_BATCH, drain_limit: PRELOAD_BATCH };
        let preload = run_pipeline(&mut p, &consumer_ids, "p", preload_flows, per_flow, preload_mode, now)?;
        // History as a consumer with retention holds it: the older half of the records compacted
        // to receipts by `prune`, so the measured receives look receipts up too.
        let to_compact = preload.applied / 2;
        let mut compacted = 0_u64;
        while compacted < to_compact {
            let batch = ((to_compact - compacted) as usize).min(PRUNE_BATCH_ROWS_MAX);
            let report = p.consumer.prune(0, batch, now)?;
            if report.compacted == 0 {
                return Err(failed(format!("the preload's prune stopped after {compacted} of {to_compact} records")));
            }
            compacted += report.compacted;
        }
        preload_json = json!({
            "events": preload.events,
            "flows": preload_flows,
            "compacted_to_receipts": compacted,
            "method": "the same pipeline (advance, relay, drain) on the same files with synchronous=NORMAL and \
                       batches of 10000, then `prune` compacts the older half of the inbox records to receipts; \
                       the files are then closed and reopened with the measured durability",
            "durability": "normal",
            "seconds": round3(preload.total.as_secs_f64()),
            "end_to_end_events_per_s": preload.end_to_end_rate(),
        });
        preloaded_pipeline = Some((reopen(p, durability)?, preload.events));
        progress.advance(1, "preload");
    }

    // The measured runs, interleaved so that a slow moment of a shared machine hits all kinds.
    let mut sequential = Series::default();
    let mut pipelined = Series::default();
    let mut two_threads = Series::default();
    let mut baseline = Series::default();
    let mut preloaded = Series::default();
    for r in 0..args.repeat {
        let mut p = Pipeline::create(&sub(format!("empty-{r}"))?, "bench", &id_refs, durability, now)?;
        let stats = run_pipeline(&mut p, &consumer_ids, "g", flows, per_flow, group, now)?;
        let check = verify(&p, stats.events * consumers)?;
        all_passed &= passed(&check);
        sequential.push(&stats, check);
        drop(p);

        let p = Pipeline::create(&sub(format!("pipelined-{r}"))?, "bench", &id_refs, durability, now)?;
        let (producer_path, consumer_path) = (p.producer_path.clone(), p.consumer_path.clone());
        drop(p);
        let stats = run_pipelined(
            &producer_path,
            &consumer_path,
            &consumer_ids,
            "g",
            flows,
            per_flow,
            group,
            durability,
            now,
            deadline,
        )?;
        let p = reopen_paths(&producer_path, &consumer_path, durability)?;
        let check = verify(&p, stats.events * consumers)?;
        all_passed &= passed(&check);
        pipelined.push(&stats, check);
        drop(p);

        let p = Pipeline::create(&sub(format!("two-threads-{r}"))?, "bench", &id_refs, durability, now)?;
        let (producer_path, consumer_path) = (p.producer_path.clone(), p.consumer_path.clone());
        drop(p);
        let run = split::Run { flows, events_per_flow: per_flow, mode: group, durability, now_ms: now, deadline };
        let stats = split::run_two_threads(&producer_path, &consumer_path, &consumer_ids, &run)?;
        let p = reopen_paths(&producer_path, &consumer_path, durability)?;
        let check = verify(&p, stats.events * consumers)?;
        all_passed &= passed(&check);
        two_threads.push(&stats, check);
        drop(p);

        if args.baseline_flows > 0 {
            let mut p = Pipeline::create(&sub(format!("baseline-{r}"))?, "bench", &id_refs, durability, now)?;
            let stats = run_pipeline(&mut p, &consumer_ids, "b", args.baseline_flows, per_flow, one, now)?;
            let check = verify(&p, stats.events * consumers)?;
            all_passed &= passed(&check);
            baseline.push(&stats, check);
        }

        if let Some((p, preloaded_events)) = preloaded_pipeline.as_mut() {
            let stats = run_pipeline(p, &consumer_ids, &format!("g{r}"), flows, per_flow, group, now)?;
            *preloaded_events += stats.events;
            let check = verify(p, *preloaded_events * consumers)?;
            all_passed &= passed(&check);
            preloaded.push(&stats, check);
        }
        progress.advance(1, &format!("run {} of {}", r + 1, args.repeat));
    }
    progress.finish(if all_passed { "every check passed" } else { "a check failed" });

    let empty_rate = sequential.median().unwrap_or(0.0);
    let pipelined_rate = pipelined.median().unwrap_or(0.0);
    let two_threads_rate = two_threads.median().unwrap_or(0.0);
    let baseline_rate = baseline.median();
    let preloaded_rate = preloaded.median();
    let ratio = |a: f64, b: Option<f64>| b.filter(|b| *b > 0.0).map(|b| round3(a / b));
    let group_ratio = ratio(empty_rate, baseline_rate);
    let preloaded_ratio = preloaded_rate.and_then(|rate| ratio(rate, Some(empty_rate)));
    // The same ratios on on-CPU rates: steadier on a shared machine (the wall-clock rates move
    // with other processes' CPU and disk use), but blind to fsync waits.
    let cpu_median = |series: &Series| (!series.cpu_rates.is_empty()).then(|| median(&series.cpu_rates));
    let empty_cpu_rate = cpu_median(&sequential);
    let group_ratio_cpu = empty_cpu_rate.and_then(|rate| ratio(rate, cpu_median(&baseline)));
    let preloaded_ratio_cpu = cpu_median(&preloaded).and_then(|rate| ratio(rate, empty_cpu_rate));
    Ok(json!({
        "outcome": "bench",
        "durability": durability_word(durability),
        "params": {
            "flows": flows,
            "events_per_flow": per_flow,
            "batch": args.batch,
            "preload_events": args.preload_events,
            "baseline_flows": args.baseline_flows,
            "consumers": args.consumers,
            "probe_commits": args.probe_commits,
            "repeat": args.repeat,
            "quick": args.quick,
            "dir": dir,
            "files_kept": args.dir.is_some(),
            "available_parallelism": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        },
        "fsync_ceiling": {
            "sqlite_single_row_commits_per_s": round1(commit_probe.commits_per_s),
            "sqlite_single_row_commits": commit_probe.commits,
            "sqlite_durability": "full",
            "fdatasync": fdatasync,
        },
        "row_write_ceiling": {
            "what": "bare INSERTs into the real inbox table (its primary key and 3 indexes), one prepared \
                     statement, --batch rows per transaction, --durability: one of the ~17 row writes an event costs",
            "rows": insert_probe.rows,
            "rows_per_transaction": insert_probe.rows_per_transaction,
            "rows_per_s": round1(insert_probe.rows_per_s),
        },
        "group_commit": sequential.json(group, "one thread: each wave advanced, then relayed, then drained"),
        "pipelined": pipelined.json(group, "three threads (producer, relay, consumer), each with its own connections"),
        "two_threads": two_threads.json(
            group,
            "two threads, one per file, as a producer process and a consumer process: advance and relay in one (the \
             relay hands each batch to the other thread and waits for its answers), receive and drain in the other",
        ),
        "one_per_op": (args.baseline_flows > 0).then(|| baseline.json(one, "one thread, one transaction per operation")),
        "preloaded": (args.preload_events > 0).then(|| {
            let mut out = preloaded.json(group, "one thread, on the preloaded files");
            out["preload"] = preload_json.clone();
            out
        }),
        "summary": {
            "end_to_end_events_per_s": empty_rate,
            "end_to_end_events_per_cpu_s": empty_cpu_rate,
            "pipelined_end_to_end_events_per_s": pipelined_rate,
            "two_threads_end_to_end_events_per_s": two_threads_rate,
            "one_per_op_events_per_s": baseline_rate,
            "group_commit_ratio": group_ratio,
            "group_commit_ratio_on_cpu": group_ratio_cpu,
            "preloaded_events_per_s": preloaded_rate,
            "preloaded_ratio_to_empty": preloaded_ratio,
            "preloaded_ratio_to_empty_on_cpu": preloaded_ratio_cpu,
            "sqlite_single_row_commits_per_s": round1(commit_probe.commits_per_s),
            "inbox_row_inserts_per_s": round1(insert_probe.rows_per_s),
            "rates_are": "medians over --repeat runs, events per second of wall time (per_cpu_s: per second \
                          on a CPU, i.e. what an otherwise idle core would do, fsync waits excluded)",
            "targets": {
                "end_to_end_events_per_s_at_least_50000": empty_rate >= 50_000.0,
                "pipelined_end_to_end_events_per_s_at_least_50000": pipelined_rate >= 50_000.0,
                "two_threads_end_to_end_events_per_s_at_least_50000": two_threads_rate >= 50_000.0,
                "group_commit_ratio_at_least_40": group_ratio.map(|r| r >= 40.0),
                "preloaded_ratio_at_least_0_8": preloaded_ratio.map(|r| r >= 0.8),
            },
        },
        "check": {
            "passed": all_passed,
            "what": "every run: effects == events x consumers, no duplicate effect, every delivery accepted",
        },
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `/proc/<pid>/stat` read at the right fields: this process's parent, and user time that
    /// grows while it spins in user space (the PostgreSQL figures once summed system time and
    /// reaped children's time instead).
    #[test]
    fn the_proc_stat_reader_reads_the_parent_and_the_user_time() {
        let fields = workflows::stat_fields("self").unwrap();
        assert_eq!(fields[1], u64::from(std::os::unix::process::parent_id()), "{fields:?}");
        let user = || workflows::stat_fields("self").unwrap()[11];
        let start = user();
        let mut x = 1_u64;
        for _ in 0..2_000 {
            for i in 0..1_000_000_u64 {
                x = std::hint::black_box(x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(i));
            }
            if user() >= start + 5 {
                break;
            }
        }
        assert!(user() >= start + 5, "spinning in user space did not show as user time ({x})");
        assert!(workflows::process_cpu_seconds().unwrap() >= 0.05);
    }

    #[test]
    fn the_quick_bench_applies_every_event_exactly_once() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = Context { durability: Durability::Full, fixed_now_ms: None };
        let args = BenchArgs {
            flows: 0,
            events_per_flow: 3,
            batch: 0,
            preload_events: 0,
            baseline_flows: 0,
            consumers: 2,
            probe_commits: 0,
            repeat: 5,
            dir: Some(dir.path().join("bench")),
            quick: true,
            workflows: false,
            sagas: 1,
            in_flight: 1,
            latency_sagas: 0,
            external_latency_ms: 0,
            resume_sagas: 0,
            lease_ms: 1_000,
            serve: false,
            runs: 1,
            clients: 1,
            relay_to: None,
            relay_events: 1,
            relay_flows: 1,
            relay_batch: 1,
            nats: String::new(),
            amqp: String::new(),
            black_hole: false,
            hostile: false,
            slow_clients: 2_000,
            slow_addresses: 200,
            flood_clients: 64,
            hostile_seconds: 20,
            store: None,
            hold_transaction: false,
            pgbench_seconds: 0,
            process_sagas: 0,
            skus: 1,
        };
        let out = run(&ctx, args).unwrap();
        assert_eq!(out["check"]["passed"], json!(true), "{out:#}");
        let counts = |run: &Value| (run["events"].as_u64(), run["deliveries"].as_u64(), run["applied"].as_u64());
        // 200 flows x 3 events, 2 consumers, in one thread and in three threads.
        for kind in ["group_commit", "pipelined", "two_threads", "preloaded"] {
            let run = &out[kind]["runs"][0];
            assert_eq!(counts(run), (Some(600), Some(1200), Some(1200)), "{kind}: {out:#}");
            assert_eq!(run["check"]["duplicate_effects"], json!(0));
        }
        assert_eq!(out["group_commit"]["runs"][0]["check"]["effects"], json!(1200));
        assert_eq!(out["pipelined"]["runs"][0]["check"]["effects"], json!(1200));
        assert_eq!(out["two_threads"]["runs"][0]["check"]["effects"], json!(1200));
        // 20 flows x 3 events, one transaction per operation.
        assert_eq!(counts(&out["one_per_op"]["runs"][0]), (Some(60), Some(120), Some(120)));
        assert_eq!(out["one_per_op"]["runs"][0]["check"]["effects"], json!(120));
        // 3,000 preloaded events plus the measured 600, for each of the 2 consumers.
        assert_eq!(out["preloaded"]["runs"][0]["check"]["effects"], json!(7200));
        assert_eq!(out["preloaded"]["preload"]["events"], json!(3000));
        assert_eq!(out["row_write_ceiling"]["rows"], json!(600));
        let summary = &out["summary"];
        for key in [
            "end_to_end_events_per_s",
            "pipelined_end_to_end_events_per_s",
            "two_threads_end_to_end_events_per_s",
            "one_per_op_events_per_s",
            "preloaded_events_per_s",
            "group_commit_ratio",
            "preloaded_ratio_to_empty",
            "sqlite_single_row_commits_per_s",
            "inbox_row_inserts_per_s",
        ] {
            assert!(summary[key].as_f64().is_some_and(|v| v > 0.0), "{key} is not positive: {out:#}");
        }
        let rates = &out["group_commit"]["runs"][0]["rates_per_s"];
        for key in ["advance_events", "relay_deliveries", "drain_applies", "end_to_end_events"] {
            assert!(rates[key].as_f64().is_some_and(|v| v > 0.0), "{key} is not positive: {out:#}");
        }
    }

    #[test]
    fn bad_parameters_are_invalid_input() {
        let ctx = Context { durability: Durability::Full, fixed_now_ms: None };
        let args = |events_per_flow| BenchArgs {
            flows: 10,
            events_per_flow,
            batch: 10,
            preload_events: 0,
            baseline_flows: 0,
            consumers: 1,
            probe_commits: 1,
            repeat: 1,
            dir: None,
            quick: false,
            workflows: false,
            sagas: 1,
            in_flight: 1,
            latency_sagas: 0,
            external_latency_ms: 0,
            resume_sagas: 0,
            lease_ms: 1_000,
            serve: false,
            runs: 1,
            clients: 1,
            relay_to: None,
            relay_events: 1,
            relay_flows: 1,
            relay_batch: 1,
            nats: String::new(),
            amqp: String::new(),
            black_hole: false,
            hostile: false,
            slow_clients: 2_000,
            slow_addresses: 200,
            flood_clients: 64,
            hostile_seconds: 20,
            store: None,
            hold_transaction: false,
            pgbench_seconds: 0,
            process_sagas: 0,
            skus: 1,
        };
        assert!(run(&ctx, args(4)).unwrap_err().is_invalid_input());
        assert!(run(&ctx, args(0)).unwrap_err().is_invalid_input());
    }

    /// The workflow bench's parameters as the command line gives them.
    fn workflow_args(flags: &[&str]) -> BenchArgs {
        use clap::Parser;
        #[derive(Parser)]
        struct Command {
            #[command(flatten)]
            args: BenchArgs,
        }
        let argv = ["bench", "--workflows"].iter().chain(flags).copied();
        Command::try_parse_from(argv).expect("valid flags").args
    }

    #[test]
    fn the_quick_workflow_bench_completes_every_saga_exactly_once() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = Context { durability: Durability::Full, fixed_now_ms: None };
        let bench_dir = dir.path().join("wf").display().to_string();
        let out = run(&ctx, workflow_args(&["--quick", "--dir", &bench_dir])).unwrap();
        assert_eq!(out["check"]["passed"], json!(true), "{out:#}");
        let throughput = &out["throughput"]["runs"][0];
        assert_eq!(throughput["check"]["completed"], json!(300), "{out:#}");
        assert_eq!(throughput["check"]["ship_effects"], json!(300));
        assert_eq!(out["throughput_with_external_latency"]["check"]["charges"], json!(300));
        assert_eq!(out["latency"]["check"]["completed"], json!(20), "10 warm-up and 10 measured: {out:#}");
        let resumed = &out["resumption"];
        assert_eq!(resumed["check"]["completed"], json!(5), "{out:#}");
        assert_eq!(resumed["worker"]["recovered"], json!(5), "the killed worker's runs were recovered: {out:#}");
        assert_eq!(resumed["leases_held_at_kill"], json!(5));
        for key in ["sagas_per_s_median", "sagas_per_s_each"] {
            assert!(!out["throughput"][key].is_null(), "{key}: {out:#}");
        }
        for q in ["p50", "p90", "p99"] {
            assert!(out["latency"]["ms"][q].as_f64().is_some_and(|ms| ms > 0.0), "{q}: {out:#}");
        }
        assert!(throughput["writer"]["per_saga"]["journal_writes"].as_f64().is_some_and(|w| w > 0.0));
    }

    /// Where the `--serve` test's server child finds its configuration.
    const SERVE_CHILD_CONFIG: &str = "LAB_BENCH_SERVE_CHILD_CONFIG";

    /// Not a test on its own: the server child of the `--serve` test below (this test binary run
    /// again with only this test selected and `SERVE_CHILD_CONFIG` set) serves what `tidemark
    /// serve` serves until SIGTERM. Without the variable it does nothing.
    #[test]
    fn serve_child() {
        let Some(config) = std::env::var_os(SERVE_CHILD_CONFIG) else { return };
        let config = tidemark_server::Config::load(Some(Path::new(&config)), &Default::default()).unwrap();
        tidemark_builtins::serve(config).unwrap().serve_blocking().unwrap();
    }

    #[test]
    fn the_quick_serve_bench_completes_every_run_exactly_once_and_stops_its_server() {
        quick_serve_bench(&[]).unwrap();
    }

    /// The same on PostgreSQL: the served tenant and the in-process run in schemas of the test
    /// server, every one of them (and the tenant's role) dropped at the end. Skipped, saying
    /// why, without a server.
    #[test]
    fn the_quick_serve_bench_on_postgres_completes_every_run_exactly_once_and_leaves_no_schema() {
        let base = std::env::var("TIDEMARK_TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let Ok(mut client) = tidemark_store_postgres::connect(&base) else {
            println!("skipped: PostgreSQL not reachable at {base}");
            return;
        };
        let prefix = format!("labserve{}", std::process::id());
        let store = crate::stores::schema_url(&base, &prefix);
        // A schema under the service's prefix exists: refused, nothing served, nothing dropped.
        client.batch_execute(&format!("CREATE SCHEMA {prefix}_serve_0_taken")).unwrap();
        let refused = quick_serve_bench(&["--store", &store]).unwrap_err();
        assert_eq!(refused.code(), tidemark_core::codes::ALREADY_EXISTS, "{refused}");
        client.batch_execute(&format!("DROP SCHEMA {prefix}_serve_0_taken")).unwrap();
        let out = quick_serve_bench(&["--store", &store]).unwrap();
        assert!(out["serve"]["runs"][0]["postgres_cpu"]["seconds"].is_number(), "{out:#}");
        let left: i64 = client
            .query_one(
                "SELECT (SELECT count(*) FROM pg_namespace WHERE starts_with(nspname, $1)) + \
                 (SELECT count(*) FROM pg_roles WHERE starts_with(rolname, $1))",
                &[&format!("{prefix}_")],
            )
            .unwrap()
            .get(0);
        assert_eq!(left, 0, "schemas or roles left behind");
    }

    fn quick_serve_bench(extra: &[&str]) -> Result<Value> {
        use clap::Parser;
        #[derive(Parser)]
        struct Command {
            #[command(flatten)]
            args: BenchArgs,
        }
        let dir = tempfile::tempdir().unwrap();
        let bench_dir = dir.path().join("serve").display().to_string();
        let mut argv = vec!["bench", "--serve", "--quick", "--dir", &bench_dir];
        argv.extend(extra);
        let args = Command::try_parse_from(argv).unwrap().args;
        let server = ServerCommand {
            program: std::env::current_exe().unwrap(),
            args: ["bench::tests::serve_child", "--exact", "--nocapture", "--test-threads", "1"]
                .map(String::from)
                .into(),
            config_env: Some(SERVE_CHILD_CONFIG.into()),
        };
        let ctx = Context { durability: Durability::Full, fixed_now_ms: None };
        let out = run_serve(&ctx, &args, &server)?;
        assert_eq!(out["check"]["passed"], json!(true), "{out:#}");
        let served = &out["serve"]["runs"][0];
        assert_eq!(served["check"]["completed"], json!(200), "{out:#}");
        assert_eq!(served["check"]["runs"], json!(200));
        assert_eq!(served["check"]["ship_effects"], json!(200));
        assert_eq!(served["check"]["charged_keys"], json!(200));
        assert_eq!(served["starts"]["by_status"]["201"], json!(200), "{out:#}");
        assert_eq!(served["stop"]["exit_code"], json!(0), "stopped by SIGTERM, not killed: {out:#}");
        assert_eq!(served["stop"]["killed_after_wait"], json!(false));
        assert_eq!(out["in_process"]["runs"][0]["check"]["completed"], json!(200), "{out:#}");
        for key in ["end_to_end_sagas_per_s", "starts_per_s"] {
            assert!(out["summary"]["ratios_to_in_process"][key].as_f64().is_some_and(|r| r > 0.0), "{key}: {out:#}");
        }
        assert!(served["starts"]["latency_ms"]["p50"].as_f64().is_some_and(|ms| ms > 0.0), "{out:#}");
        Ok(out)
    }

    #[test]
    fn the_quick_relay_to_bench_applies_every_event_once_on_the_other_server() {
        use clap::Parser;
        #[derive(Parser)]
        struct Command {
            #[command(flatten)]
            args: BenchArgs,
        }
        let server = ServerCommand {
            program: std::env::current_exe().unwrap(),
            args: ["bench::tests::serve_child", "--exact", "--nocapture", "--test-threads", "1"]
                .map(String::from)
                .into(),
            config_env: Some(SERVE_CHILD_CONFIG.into()),
        };
        let ctx = Context { durability: Durability::Full, fixed_now_ms: None };
        let nats_up = std::net::TcpStream::connect("127.0.0.1:4222").is_ok();
        if !nats_up {
            println!("skipped the nats part: NATS not reachable at 127.0.0.1:4222");
        }
        let rabbitmq_up = std::net::TcpStream::connect("127.0.0.1:5672").is_ok();
        if !rabbitmq_up {
            println!("skipped the rabbitmq part: RabbitMQ not reachable at 127.0.0.1:5672");
        }
        let up = |kind: &&str| match *kind {
            "nats" => nats_up,
            "rabbitmq" => rabbitmq_up,
            _ => true,
        };
        for kind in ["http", "nats", "rabbitmq"].into_iter().filter(up) {
            let dir = tempfile::tempdir().unwrap();
            let bench_dir = dir.path().join("relay").display().to_string();
            let args =
                Command::try_parse_from(["bench", "--relay-to", kind, "--quick", "--dir", &bench_dir]).unwrap().args;
            let out = run_relay_to(&ctx, &args, &server).unwrap();
            assert_eq!(out["check"]["passed"], json!(true), "{out:#}");
            assert_eq!(out["check"]["applied_seqs"], json!(400), "{out:#}");
            assert_eq!(out["raw_transport"]["events"], json!(400), "{out:#}");
            assert!(out["ratio_to_raw"].as_f64().is_some_and(|r| r > 0.0), "{out:#}");
            let cpu = &out["tidemark"]["cpu_seconds"];
            assert!(cpu["orders"].as_f64().is_some() && cpu["shipping"].as_f64().is_some(), "{out:#}");
            assert_eq!(cpu["broker"].as_f64().is_some(), kind != "http", "a broker's CPU is read: {out:#}");
            assert_eq!(out["stop"]["orders"]["exit_code"], json!(0), "{out:#}");
        }
    }

    #[test]
    fn the_quick_black_hole_bench_delivers_everything_to_the_healthy_beside_an_endpoint_that_never_answers() {
        use clap::Parser;
        #[derive(Parser)]
        struct Command {
            #[command(flatten)]
            args: BenchArgs,
        }
        let server = ServerCommand {
            program: std::env::current_exe().unwrap(),
            args: ["bench::tests::serve_child", "--exact", "--nocapture", "--test-threads", "1"]
                .map(String::from)
                .into(),
            config_env: Some(SERVE_CHILD_CONFIG.into()),
        };
        let ctx = Context { durability: Durability::Full, fixed_now_ms: None };
        let dir = tempfile::tempdir().unwrap();
        let bench_dir = dir.path().join("relay").display().to_string();
        let flags = ["bench", "--relay-to", "http", "--black-hole", "--quick", "--dir", &bench_dir];
        let out = run_relay_to(&ctx, &Command::try_parse_from(flags).unwrap().args, &server).unwrap();
        assert_eq!(out["check"]["passed"], json!(true), "{out:#}");
        let black_hole = &out["black_hole"];
        assert_eq!(black_hole["healthy_beside_the_black_hole"]["applied_seqs"], json!(400), "{out:#}");
        assert_eq!(black_hole["healthy_alone_again"]["applied_seqs"], json!(400), "{out:#}");
        assert!(black_hole["black_hole"]["connections_accepted"].as_u64().is_some_and(|n| n >= 1), "{out:#}");
        let lane = &black_hole["black_hole"]["subscription"]["lane"];
        assert_eq!(lane["delivered"], json!(0), "nothing is ever delivered to a black hole: {out:#}");
        assert!(black_hole["black_hole"]["subscription"]["pending"].as_u64().is_some_and(|n| n > 0), "{out:#}");
        assert!(black_hole["ratio"].as_f64().is_some_and(|r| r > 0.0), "{out:#}");

        // Only over HTTP.
        let flags = ["bench", "--relay-to", "nats", "--black-hole", "--quick"];
        let error = run_relay_to(&ctx, &Command::try_parse_from(flags).unwrap().args, &server).unwrap_err();
        assert!(error.is_invalid_input(), "{error}");
    }

    #[test]
    fn bad_workflow_parameters_are_invalid_input() {
        let ctx = Context { durability: Durability::Full, fixed_now_ms: None };
        for flags in [&["--sagas", "0"][..], &["--in-flight", "0"], &["--lease-ms", "50"], &["--repeat", "0"]] {
            let error = run(&ctx, workflow_args(flags)).unwrap_err();
            assert!(error.is_invalid_input(), "{flags:?}: {error}");
        }
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
