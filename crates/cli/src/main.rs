//! The `tidemark` binary. Every command prints one JSON document on stdout. Protocol outcomes
//! (including rejections such as `stale` or `conflict`) exit 0; invalid input exits 2 with a
//! JSON error carrying a stable code; internal errors exit 1. Exit codes are mapped here only.

/// mimalloc instead of the system allocator: the workflow writer thread and the async workers
/// allocate and free small objects (journal writes, JSON values, statement parameters) on every
/// step, many of them freed on another thread than the one that allocated them; glibc malloc spent
/// ~10% of the writer thread there (`docs/benchmarks.md`, "Durable workflows"). Built with
/// `no_thp`: mimalloc does not ask for transparent huge pages, since with them every first touch
/// of a fresh or purged region made the kernel zero 2 MiB; the batch pipeline's large per-batch
/// buffers did that all the time (a quarter less system time for `tidemark bench`, about 5% of
/// its CPU; docs/benchmarks.md, "Session 5").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod queue_cmd;
mod remote;
mod schedule_cmd;
mod server_cmd;
#[cfg(feature = "failpoints")]
mod unsafe_cmd;
mod workflow_cmd;

use std::io::Read;
use std::path::{Path, PathBuf};

use clap::{Args, Parser, Subcommand, ValueEnum};
use serde_json::{json, Value};
use tidemark_core::endpoint::EndpointKind;
use tidemark_core::error::codes;
use tidemark_core::flow::AdvanceRequest;
use tidemark_core::limits::{ENVELOPE_BYTES_MAX, PRUNE_BATCH_ROWS_MAX};
use tidemark_core::location::StoreLocation;
use tidemark_core::policy::{RelayPolicy, RetentionPolicy};
use tidemark_core::reservation::ReservationMachine;
use tidemark_core::store::{
    ApplyOutcome, DeliveryAction, DeliveryStatus, DrainScope, InboxStatus, ProducerStore, Subscription,
};
use tidemark_core::{Envelope, Error};
use tidemark_engine::{relay_until_idle, RelayOptions};
use tidemark_lab::{bench, chaos, demo, experiment, loadtest, progress, Context};
use tidemark_store_sqlite::Durability;

use tidemark_lab::stores::{Consumer, Producer};

#[derive(Parser)]
#[command(name = "tidemark", version, about = "Ordered transactional outbox/inbox on embedded SQLite")]
struct Cli {
    /// `full` (default: every commit is fsynced) or `normal` (WAL without fsync per commit:
    /// survives a process crash, may lose the last commits on power loss).
    #[arg(long, global = true, value_enum, default_value_t = DurabilityArg::Full)]
    durability: DurabilityArg,
    /// Use this clock (milliseconds since the Unix epoch) instead of the system clock. For
    /// replaying scenarios and testing retention; never needed in production.
    #[arg(long, global = true)]
    now_ms: Option<i64>,
    /// Send the command to a running `tidemark serve` at this URL instead of opening files
    /// (advance, receive, outbox list/resolve, inbox list/skip/cursors, workflow
    /// seed-stock/start/list/show/cancel/retry/abandon/fork/skip/send-event; see docs/cli.md).
    /// The file flags (--producer, --consumer-db, --db) are then not needed.
    #[arg(long, global = true, env = "TIDEMARK_SERVER")]
    server: Option<String>,
    /// The bearer token for --server (from `tidemark token create`).
    #[arg(long, global = true, env = "TIDEMARK_TOKEN", hide_env_values = true)]
    token: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum DurabilityArg {
    Full,
    Normal,
}

#[derive(Subcommand)]
enum Command {
    /// Create (or reopen, never reset) a producer and/or a consumer database.
    Init(InitArgs),
    /// Move a reservation flow to its next state and commit the event to the outbox.
    Advance(AdvanceArgs),
    /// Subscribe a consumer (id + consumer database) to a producer's events.
    Subscribe(SubscribeArgs),
    /// Deliver due outbox events to their subscribers, in batches.
    Relay(RelayArgs),
    /// Store one event (JSON envelope from --file or stdin) in a consumer's inbox.
    Receive(ReceiveArgs),
    /// Consume a broker (NATS JetStream, Kafka, RabbitMQ) into a consumer's inbox, acking (or committing
    /// offsets) after each inbox commit.
    Consume(ConsumeArgs),
    /// Apply the next event (high-water + 1) of one flow.
    Apply(ApplyArgs),
    /// Apply across flows, bounded by --limit, in one transaction.
    Drain(DrainArgs),
    /// Read both files (each in one read transaction; the two are not one atomic snapshot).
    Snapshot(SnapshotArgs),
    /// Outbox deliveries: list, resolve quarantined entries, rotate the producer generation.
    #[command(subcommand)]
    Outbox(OutboxCommand),
    /// Inbox records: list, skip a blocked record, show high-water marks.
    #[command(subcommand)]
    Inbox(InboxCommand),
    /// Retention: compact applied inbox records into receipts, drop receipts past the horizon,
    /// delete settled outbox events.
    Prune(PruneArgs),
    /// Rename a consumer, carrying its dedup state and projections over.
    RenameConsumer(RenameArgs),
    /// Run the whole pipeline on fresh files and print what happened.
    Demo(demo::DemoArgs),
    /// Reproduce every scenario of docs/scenarios.md; --check compares with the expected state.
    Experiment(experiment::ExperimentArgs),
    /// Measure throughput (see docs/benchmarks.md).
    Bench(bench::BenchArgs),
    /// Run the built-in workflows (order_saga, sleepy_order) until idle, stopped or signalled.
    Worker(workflow_cmd::WorkerArgs),
    /// Durable workflow runs: start, list, show, operator controls, purge (see docs/cli.md).
    #[command(subcommand)]
    Workflow(workflow_cmd::WorkflowCommand),
    /// Schedules of the built-in workflows: put, list, show, pause, resume, delete, tick.
    #[command(subcommand)]
    Schedule(schedule_cmd::ScheduleCommand),
    /// Queues of a workflow database: put (concurrency and rate limits), list, show (positions).
    #[command(subcommand)]
    Queue(queue_cmd::QueueCommand),
    /// Run the service: HTTP API, dashboard, metrics, and every tenant's relay, consumers,
    /// workers and retention (see docs/operations.md).
    Serve(server_cmd::ServeArgs),
    /// Configuration files: `config check --config FILE` validates one and prints the result.
    #[command(subcommand)]
    Config(server_cmd::ConfigCommand),
    /// Bearer tokens of `tidemark serve`: create (prints the token once), list, revoke.
    #[command(subcommand)]
    Token(server_cmd::TokenCommand),
    /// Load a running server from this process and write a ledger of what it accepted;
    /// `loadtest verify` checks the ledger against the server's files (see docs/cli.md).
    Loadtest(loadtest::LoadtestArgs),
    /// Several `tidemark serve` processes on one data folder under seeded faults (SIGKILL,
    /// SIGSTOP), then an independent check of the files against what was acknowledged;
    /// `chaos check` runs the checker alone (see docs/reliability.md).
    Chaos(chaos::ChaosArgs),
    /// Test-only: the deliberately wrong dual write (state and event in two commits).
    #[cfg(feature = "failpoints")]
    #[command(hide = true)]
    UnsafeDualWriteAdvance(unsafe_cmd::UnsafeDualWriteArgs),
}

// Every `--producer` and `--consumer-db` below names a store: a SQLite file (`path` or
// `sqlite:path`) or a PostgreSQL schema (`postgres://user@host/db?schema=S`; docs/cli.md,
// "Producer and consumer stores"), opened by `pipeline`.
#[derive(Args)]
struct InitArgs {
    #[arg(long)]
    producer: Option<PathBuf>,
    /// The producer's namespace (required with --producer).
    #[arg(long)]
    source: Option<String>,
    #[arg(long = "consumer-db")]
    consumer_db: Option<PathBuf>,
    /// Consumer retention horizon: older events are `expired`, older receipts deleted.
    #[arg(long, default_value_t = RetentionPolicy::default().horizon_ms)]
    horizon_ms: i64,
}

#[derive(Args)]
struct AdvanceArgs {
    /// The producer database (not with --server).
    #[arg(long)]
    producer: Option<PathBuf>,
    #[arg(long)]
    flow: String,
    /// The seq you last saw for this flow (0 for a new flow).
    #[arg(long)]
    expected_seq: i64,
    /// Target state: reserved, confirmed or released.
    #[arg(long)]
    to: String,
    /// Quantity 1..=1,000,000 (required to reserve; optional later, must match).
    #[arg(long)]
    quantity: Option<i64>,
    /// Payload schema: 1 (`amount`) or 2 (`units`).
    #[arg(long, default_value_t = 1)]
    schema_version: u32,
}

#[derive(Args)]
struct SubscribeArgs {
    #[arg(long)]
    producer: PathBuf,
    #[arg(long)]
    consumer_id: String,
    /// The consumer database path (for a PostgreSQL producer, a consumer schema on its server:
    /// `postgres://...?schema=S`), or a network endpoint URL
    /// (`http(s)://.../v1/consumers/{id}/inbox`, `nats://`, `amqp://`, `kafka://`;
    /// docs/protocol.md, "Endpoints"), which `tidemark serve` delivers to.
    #[arg(long)]
    endpoint: PathBuf,
    /// Also queue every event already in the outbox.
    #[arg(long)]
    from_start: bool,
}

#[derive(Args)]
struct ConsumeArgs {
    /// `nats://host[:port]/<subject prefix>` (the subjects `<prefix>.>` are consumed),
    /// `kafka://host:port[,host:port...]/<topic>` or `amqp://host[:port]/<queue>` (a RabbitMQ
    /// queue on the default virtual host, never declared here).
    #[arg(long)]
    from: String,
    /// NATS only, and required there: the JetStream stream capturing the subjects (never
    /// created here).
    #[arg(long)]
    stream: Option<String>,
    /// The durable pull consumer's name (NATS), the consumer group (Kafka's `group.id`) or the
    /// consumer tag (RabbitMQ); default `tidemark-<consumer id>`.
    #[arg(long)]
    durable: Option<String>,
    /// RabbitMQ only: `env:NAME`, the environment variable holding `user:password` to connect
    /// as (or `user:password` itself, which other users of the machine can see in the process
    /// list); default `guest:guest`, which RabbitMQ accepts from loopback only.
    #[arg(long)]
    amqp_credentials: Option<String>,
    #[arg(long)]
    consumer_db: PathBuf,
    #[arg(long)]
    consumer_id: String,
    /// Messages per pull (1..=1,000); for NATS and RabbitMQ, twice this is the most the broker
    /// hands over unacked.
    #[arg(long, default_value_t = 100)]
    batch: usize,
    /// NATS only: how long the broker waits for an ack before redelivering, in ms (default
    /// 30,000).
    #[arg(long)]
    ack_wait_ms: Option<u64>,
    /// Kafka only: the group's session timeout, in ms (default 45,000): how long after this
    /// process stops heartbeating its partitions go to the other members of the group.
    #[arg(long)]
    session_timeout_ms: Option<u64>,
    /// Stop when a pull finds nothing more (for Kafka: once the group assigned this consumer its
    /// partitions and each is committed up to its end; for RabbitMQ: once the queue also holds
    /// no message ready); else run until SIGINT or SIGTERM.
    #[arg(long)]
    until_idle: bool,
}

#[derive(Args)]
struct RelayArgs {
    #[arg(long)]
    producer: PathBuf,
    /// Deliveries per batch (one consumer and one producer transaction).
    #[arg(long, default_value_t = 1_000)]
    limit: usize,
    /// Deliver only this event (its pending or quarantined deliveries), due or not.
    #[arg(long)]
    event: Option<String>,
    /// Repeat batches until nothing is due (bounded by --passes).
    #[arg(long)]
    until_idle: bool,
    /// Upper bound of batches with --until-idle.
    #[arg(long, default_value_t = 10_000)]
    passes: u32,
    #[arg(long, default_value_t = RelayPolicy::default().max_attempts)]
    max_attempts: u32,
    #[arg(long, default_value_t = RelayPolicy::default().backoff_base_ms)]
    backoff_base_ms: i64,
    #[arg(long, default_value_t = RelayPolicy::default().backoff_max_ms)]
    backoff_max_ms: i64,
    /// Include one answer per delivery in the output.
    #[arg(long)]
    verbose: bool,
}

#[derive(Args)]
struct ReceiveArgs {
    /// The consumer database (not with --server).
    #[arg(long = "consumer-db")]
    consumer_db: Option<PathBuf>,
    #[arg(long)]
    consumer_id: String,
    /// Envelope JSON file; stdin when absent or `-`.
    #[arg(long)]
    file: Option<PathBuf>,
}

#[derive(Args)]
struct HandlerArgs {
    /// Enable the v2 payload decoders (`payload.units`).
    #[arg(long)]
    support_v2: bool,
}

#[derive(Args)]
struct ApplyArgs {
    #[arg(long = "consumer-db")]
    consumer_db: PathBuf,
    #[arg(long)]
    consumer_id: String,
    #[arg(long)]
    source: String,
    #[arg(long)]
    flow: String,
    #[command(flatten)]
    handler: HandlerArgs,
}

#[derive(Args)]
struct DrainArgs {
    #[arg(long = "consumer-db")]
    consumer_db: PathBuf,
    #[arg(long)]
    consumer_id: String,
    #[arg(long, default_value_t = 1_000)]
    limit: usize,
    #[command(flatten)]
    handler: HandlerArgs,
}

#[derive(Args)]
struct SnapshotArgs {
    #[arg(long)]
    producer: Option<PathBuf>,
    #[arg(long = "consumer-db")]
    consumer_db: Option<PathBuf>,
    /// Rows per table at most.
    #[arg(long, default_value_t = 1_000)]
    rows_max: usize,
}

#[derive(Subcommand)]
enum OutboxCommand {
    /// List deliveries, optionally by status (pending, accepted, quarantined, dismissed).
    List {
        #[arg(long)]
        producer: Option<PathBuf>,
        #[arg(long)]
        status: Option<String>,
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Requeue or dismiss a quarantined delivery, with a reason.
    Resolve {
        #[arg(long)]
        producer: Option<PathBuf>,
        #[arg(long)]
        event: String,
        #[arg(long)]
        consumer_id: String,
        #[arg(long, value_enum)]
        action: ActionArg,
        #[arg(long)]
        reason: String,
    },
    /// Hand one subscriber every event the outbox still holds again, from one event (in commit
    /// order) or from the oldest (after restoring its consumer database from a backup).
    Redeliver {
        #[arg(long)]
        producer: Option<PathBuf>,
        #[arg(long)]
        consumer_id: String,
        /// The first event to send again (it and every later event).
        #[arg(long, required_unless_present = "all", conflicts_with = "all")]
        from_event: Option<String>,
        /// From the oldest event the outbox holds.
        #[arg(long)]
        all: bool,
    },
    /// Give the producer a new generation id (after restoring it from a backup).
    RotateGeneration {
        #[arg(long)]
        producer: PathBuf,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum ActionArg {
    Requeue,
    Dismiss,
}

#[derive(Subcommand)]
enum InboxCommand {
    /// List inbox records, optionally by status (pending, applied, blocked, skipped).
    List {
        #[arg(long = "consumer-db")]
        consumer_db: Option<PathBuf>,
        #[arg(long)]
        consumer_id: String,
        #[arg(long)]
        status: Option<String>,
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Skip a blocked record (its handler never runs) so its flow goes on. Recorded with the reason.
    Skip {
        #[arg(long = "consumer-db")]
        consumer_db: Option<PathBuf>,
        #[arg(long)]
        consumer_id: String,
        #[arg(long)]
        event: String,
        #[arg(long)]
        reason: String,
    },
    /// Per-flow high-water marks.
    Cursors {
        #[arg(long = "consumer-db")]
        consumer_db: Option<PathBuf>,
        #[arg(long)]
        consumer_id: Option<String>,
    },
}

#[derive(Args)]
struct PruneArgs {
    /// Prune this consumer database (applied bodies -> receipts; receipts past the horizon).
    #[arg(long = "consumer-db")]
    consumer_db: Option<PathBuf>,
    /// Keep full bodies of applied records this long before compacting them into receipts.
    #[arg(long, default_value_t = 7 * tidemark_core::policy::DAY_MS)]
    applied_retention_ms: i64,
    /// Prune this producer database (settled outbox events and their deliveries).
    #[arg(long)]
    producer: Option<PathBuf>,
    /// Keep outbox events this long after they were committed, even when every delivery is settled.
    #[arg(long, default_value_t = 7 * tidemark_core::policy::DAY_MS)]
    delivered_retention_ms: i64,
    /// Rows per transaction.
    #[arg(long, default_value_t = 1_000)]
    batch_rows: usize,
}

#[derive(Args)]
struct RenameArgs {
    #[arg(long = "consumer-db")]
    consumer_db: PathBuf,
    #[arg(long)]
    from: String,
    #[arg(long)]
    to: String,
    /// Also rename the producer's subscription (second step, after the consumer database).
    #[arg(long)]
    producer: Option<PathBuf>,
}

/// Shared context of one invocation.
fn invalid(message: impl Into<String>) -> Error {
    Error::invalid(codes::INVALID_ARGUMENT, message)
}

/// A file flag that is optional only because `--server` does without it.
pub fn file_arg(value: Option<PathBuf>, flag: &str) -> tidemark_core::Result<PathBuf> {
    value.ok_or_else(|| invalid(format!("{flag} is required (or give --server URL to use a running server)")))
}

fn to_json<T: serde::Serialize>(value: &T) -> Value {
    serde_json::to_value(value).expect("outputs serialise")
}

fn read_envelope(file: Option<&Path>) -> tidemark_core::Result<Envelope> {
    let mut bytes = Vec::new();
    let limit = ENVELOPE_BYTES_MAX as u64 + 1;
    match file {
        Some(path) if path != Path::new("-") => {
            let handle =
                std::fs::File::open(path).map_err(|e| invalid(format!("cannot read {}: {e}", path.display())))?;
            handle.take(limit).read_to_end(&mut bytes)
        }
        _ => std::io::stdin().take(limit).read_to_end(&mut bytes),
    }
    .map_err(|e| invalid(format!("cannot read the envelope: {e}")))?;
    Envelope::parse(&bytes)
}

fn run(cli: Cli) -> tidemark_core::Result<Value> {
    // `loadtest` always talks to a server: it takes the global --server and --token.
    let command = match cli.command {
        Command::Loadtest(args) => return loadtest::run(args, cli.server, cli.token),
        // `chaos` starts its own servers and ignores the global file and server options.
        Command::Chaos(args) => {
            let durability = match cli.durability {
                DurabilityArg::Full => "full",
                DurabilityArg::Normal => "normal",
            };
            return chaos::run(args, durability);
        }
        command => command,
    };
    if let Some(server) = &cli.server {
        let remote = remote::Remote::new(server, cli.token.clone())?;
        return remote::run(&remote, command);
    }
    let ctx = Context {
        durability: match cli.durability {
            DurabilityArg::Full => Durability::Full,
            DurabilityArg::Normal => Durability::Normal,
        },
        fixed_now_ms: cli.now_ms,
    };
    match command {
        Command::Init(args) => {
            if args.producer.is_none() && args.consumer_db.is_none() {
                return Err(invalid("give --producer PATH --source S and/or --consumer-db PATH"));
            }
            let mut out = json!({"outcome": "initialized"});
            if let Some(path) = &args.producer {
                let source = args.source.as_deref().ok_or_else(|| invalid("--producer needs --source"))?;
                tidemark_core::id::validate_id("source", source)?;
                let producer = Producer::init(&ctx, path, source)?;
                out["producer"] = to_json(producer.identity());
            }
            if let Some(path) = &args.consumer_db {
                let consumer = Consumer::init(&ctx, path, RetentionPolicy { horizon_ms: args.horizon_ms })?;
                out["consumer"] = json!({"horizon_ms": consumer.retention().horizon_ms});
            }
            Ok(out)
        }
        Command::Advance(args) => {
            let mut input = serde_json::Map::new();
            if let Some(quantity) = args.quantity {
                input.insert("quantity".into(), json!(quantity));
            }
            let request = AdvanceRequest {
                flow_id: args.flow,
                expected_seq: args.expected_seq,
                to_state: args.to,
                input: Value::Object(input),
                schema_version: args.schema_version,
                traceparent: None,
            };
            // Validate before opening so that bad input never touches the file.
            tidemark_core::flow::validate_request(&ReservationMachine, &request)?;
            let path = file_arg(args.producer, "--producer")?;
            let mut producer = Producer::open(&ctx, &path)?;
            let mut outcomes = producer.advance_batch(&ReservationMachine, &[request], ctx.now_ms())?;
            Ok(to_json(&outcomes.pop().expect("one outcome per request")))
        }
        Command::Subscribe(args) => {
            tidemark_core::id::validate_id("consumer_id", &args.consumer_id)?;
            let mut producer = Producer::open(&ctx, &args.producer)?;
            let given = args.endpoint.to_string_lossy().into_owned();
            // A consumer store (a file, or a `postgres://` schema: on the producer's own server
            // it is stored as the schema's name, elsewhere as the `postgres://` endpoint), or a
            // network endpoint.
            let store = matches!(StoreLocation::parse(&given), Ok(StoreLocation::Postgres(_)))
                || tidemark_core::endpoint::kind_of(&given)? == EndpointKind::Sqlite;
            if !store {
                let kind = tidemark_core::endpoint::kind_of(&given)?;
                // A network endpoint: nothing to open here; `tidemark serve` delivers to it.
                let subscription = Subscription { consumer_id: args.consumer_id, endpoint: given };
                let queued = producer.subscribe(&subscription, args.from_start, ctx.now_ms())?;
                let endpoint = tidemark_core::endpoint::mask(&subscription.endpoint);
                return Ok(json!({"outcome": "subscribed", "subscription": {"consumer_id": subscription.consumer_id,
                    "endpoint": endpoint, "kind": kind}, "queued": queued}));
            }
            // The endpoint must be an initialised consumer store. Whether it has received
            // anything of this subscriber decides whether an existing subscription may move there.
            let (endpoint, consumer) = producer.consumer_endpoint(&ctx, &args.endpoint)?;
            let has_received = consumer.has_received(&args.consumer_id, &producer.identity().source)?;
            drop(consumer);
            let subscription = Subscription { consumer_id: args.consumer_id, endpoint };
            let queued =
                producer.subscribe_checked(&subscription, args.from_start, ctx.now_ms(), Some(has_received))?;
            Ok(json!({"outcome": "subscribed", "subscription": subscription, "queued": queued}))
        }
        Command::Relay(args) => {
            let options = RelayOptions {
                limit: args.limit,
                event_id: args.event,
                policy: RelayPolicy {
                    max_attempts: args.max_attempts,
                    backoff_base_ms: args.backoff_base_ms,
                    backoff_max_ms: args.backoff_max_ms,
                },
                keep_answers: args.verbose,
                consumers: None,
            };
            tidemark_core::id::validate_limit("--limit", options.limit, tidemark_core::limits::RELAY_BATCH_EVENTS_MAX)?;
            options.policy.validate()?;
            if let Some(event) = &options.event_id {
                tidemark_core::id::validate_id("event_id", event)?;
            }
            let mut producer = Producer::open(&ctx, &args.producer)?;
            let mut endpoints = producer.endpoints(&ctx);
            // This command delivers to consumer stores (files, schemas on the producer's server,
            // and `postgres://` consumer schemas on any server); network endpoints are delivered
            // by `tidemark serve`'s relay lanes, so their subscribers are left alone here (never
            // failed, never quarantined by a relay that cannot reach them).
            let mut options = options;
            let subscriptions = producer.subscriptions()?;
            let network: Vec<String> = subscriptions
                .iter()
                .filter(|s| {
                    tidemark_core::endpoint::kind_of(&s.endpoint)
                        .is_ok_and(|k| !matches!(k, EndpointKind::Sqlite | EndpointKind::Postgres))
                })
                .map(|s| s.consumer_id.clone())
                .collect();
            if !network.is_empty() {
                options.consumers =
                    Some(subscriptions.into_iter().map(|s| s.consumer_id).filter(|c| !network.contains(c)).collect());
            }
            // One pass unless --until-idle; an explicit --event is always one pass.
            let passes_max = if args.until_idle && options.event_id.is_none() { args.passes.max(1) } else { 1 };
            let (total, passes) = relay_until_idle(
                &mut producer,
                &mut endpoints,
                &options,
                passes_max,
                &mut || ctx.now_ms(),
                &mut rand::random::<f64>,
            )?;
            let mut out = to_json(&total);
            out["outcome"] = json!("relayed");
            out["passes"] = json!(passes);
            if !network.is_empty() {
                out["not_relayed_here"] = json!(network);
            }
            Ok(out)
        }
        Command::Consume(args) => consume(&ctx, args),
        Command::Receive(args) => {
            tidemark_core::id::validate_id("consumer_id", &args.consumer_id)?;
            let path = file_arg(args.consumer_db, "--consumer-db")?;
            let envelope = read_envelope(args.file.as_deref())?;
            let mut consumer = Consumer::open(&ctx, &path, false)?;
            let mut outcomes = consumer.receive_batch(&[(args.consumer_id.as_str(), &envelope)], ctx.now_ms())?;
            Ok(to_json(&outcomes.pop().expect("one outcome per event")))
        }
        Command::Apply(args) => {
            tidemark_core::id::validate_id("consumer_id", &args.consumer_id)?;
            let scope = DrainScope::Flow { source: args.source.clone(), flow_id: args.flow.clone() };
            tidemark_core::id::validate_id("source", &args.source)?;
            tidemark_core::id::validate_id("flow_id", &args.flow)?;
            let mut consumer = Consumer::open(&ctx, &args.consumer_db, true)?;
            let report = consumer.drain(&args.consumer_id, &scope, 1, args.handler.support_v2, ctx.now_ms())?;
            let outcome = match (report.last_applied, report.stuck.into_iter().next()) {
                (Some(applied), _) => applied,
                (None, Some(stuck)) => stuck,
                (None, None) => {
                    let high_water_seq = consumer
                        .cursors(Some(&args.consumer_id))?
                        .into_iter()
                        .find(|c| c.source == args.source && c.flow_id == args.flow)
                        .map_or(0, |c| c.high_water_seq);
                    ApplyOutcome::Idle { source: args.source, flow_id: args.flow, high_water_seq }
                }
            };
            Ok(to_json(&outcome))
        }
        Command::Drain(args) => {
            tidemark_core::id::validate_id("consumer_id", &args.consumer_id)?;
            tidemark_core::id::validate_limit("--limit", args.limit, tidemark_core::limits::DRAIN_BATCH_EVENTS_MAX)?;
            let mut consumer = Consumer::open(&ctx, &args.consumer_db, true)?;
            // One transaction: the bar shows that it runs and for how long.
            let progress = progress::Progress::start("drain", 0);
            let report = consumer.drain(
                &args.consumer_id,
                &DrainScope::All,
                args.limit,
                args.handler.support_v2,
                ctx.now_ms(),
            )?;
            progress.finish(&format!("{} applied, {} stuck", report.applied, report.stuck.len()));
            Ok(to_json(&report))
        }
        Command::Snapshot(args) => {
            if args.producer.is_none() && args.consumer_db.is_none() {
                return Err(invalid("give --producer and/or --consumer-db"));
            }
            tidemark_core::id::validate_limit("--rows-max", args.rows_max, 100_000)?;
            let mut out = json!({
                "outcome": "snapshot",
                "atomic_across_files": false,
                "note": "each file was read in its own read transaction; the two are not one atomic snapshot",
            });
            if let Some(path) = &args.producer {
                let producer = Producer::open(&ctx, path)?;
                out["producer"] = to_json(&producer.snapshot(args.rows_max)?);
            }
            if let Some(path) = &args.consumer_db {
                // The dedup tables and the handler's tables in one read transaction.
                out["consumer"] = Consumer::open(&ctx, path, true)?.snapshot(args.rows_max)?;
            }
            Ok(out)
        }
        Command::Outbox(command) => match command {
            OutboxCommand::List { producer, status, limit } => {
                let status = status
                    .map(|s| DeliveryStatus::parse(&s).ok_or_else(|| invalid(format!("unknown delivery status {s:?}"))))
                    .transpose()?;
                tidemark_core::id::validate_limit("--limit", limit, tidemark_core::limits::PAGE_SIZE_MAX)?;
                let producer = Producer::open(&ctx, &file_arg(producer, "--producer")?)?;
                let entries = producer.deliveries(status, limit)?;
                Ok(json!({"outcome": "listed", "deliveries": entries}))
            }
            OutboxCommand::Resolve { producer, event, consumer_id, action, reason } => {
                tidemark_core::id::validate_id("event_id", &event)?;
                tidemark_core::id::validate_id("consumer_id", &consumer_id)?;
                tidemark_core::id::validate_reason(&reason)?;
                let action = match action {
                    ActionArg::Requeue => DeliveryAction::Requeue,
                    ActionArg::Dismiss => DeliveryAction::Dismiss,
                };
                let mut producer = Producer::open(&ctx, &file_arg(producer, "--producer")?)?;
                let entry = producer.resolve_delivery(&event, &consumer_id, action, &reason, ctx.now_ms())?;
                Ok(json!({"outcome": "resolved", "delivery": entry}))
            }
            OutboxCommand::Redeliver { producer, consumer_id, from_event, all: _ } => {
                tidemark_core::id::validate_id("consumer_id", &consumer_id)?;
                if let Some(event) = &from_event {
                    tidemark_core::id::validate_id("event_id", event)?;
                }
                let mut producer = Producer::open(&ctx, &file_arg(producer, "--producer")?)?;
                let report = producer.redeliver(&consumer_id, from_event.as_deref())?;
                Ok(json!({
                    "outcome": "redelivered",
                    "consumer_id": consumer_id,
                    "redelivered": report.redelivered,
                    "pruned": report.pruned,
                }))
            }
            OutboxCommand::RotateGeneration { producer } => {
                let mut producer = Producer::open(&ctx, &producer)?;
                let identity = producer.rotate_generation()?;
                Ok(json!({"outcome": "rotated", "producer": identity}))
            }
        },
        Command::Inbox(command) => match command {
            InboxCommand::List { consumer_db, consumer_id, status, limit } => {
                tidemark_core::id::validate_id("consumer_id", &consumer_id)?;
                let status = status
                    .map(|s| InboxStatus::parse(&s).ok_or_else(|| invalid(format!("unknown inbox status {s:?}"))))
                    .transpose()?;
                tidemark_core::id::validate_limit("--limit", limit, tidemark_core::limits::PAGE_SIZE_MAX)?;
                let consumer = Consumer::open(&ctx, &file_arg(consumer_db, "--consumer-db")?, false)?;
                Ok(json!({"outcome": "listed", "records": consumer.inbox(&consumer_id, status, limit)?}))
            }
            InboxCommand::Skip { consumer_db, consumer_id, event, reason } => {
                tidemark_core::id::validate_id("consumer_id", &consumer_id)?;
                tidemark_core::id::validate_id("event_id", &event)?;
                tidemark_core::id::validate_reason(&reason)?;
                let mut consumer = Consumer::open(&ctx, &file_arg(consumer_db, "--consumer-db")?, false)?;
                let entry = consumer.skip_blocked(&consumer_id, &event, &reason, ctx.now_ms())?;
                Ok(json!({"outcome": "skipped", "record": entry}))
            }
            InboxCommand::Cursors { consumer_db, consumer_id } => {
                if let Some(id) = &consumer_id {
                    tidemark_core::id::validate_id("consumer_id", id)?;
                }
                let consumer = Consumer::open(&ctx, &file_arg(consumer_db, "--consumer-db")?, false)?;
                Ok(json!({"outcome": "listed", "cursors": consumer.cursors(consumer_id.as_deref())?}))
            }
        },
        Command::Prune(args) => {
            tidemark_core::id::validate_limit("--batch-rows", args.batch_rows, PRUNE_BATCH_ROWS_MAX)?;
            if args.applied_retention_ms < 0 || args.delivered_retention_ms < 0 {
                return Err(invalid("retention periods must be >= 0"));
            }
            if args.consumer_db.is_none() && args.producer.is_none() {
                return Err(invalid("give --consumer-db and/or --producer"));
            }
            let mut out = json!({"outcome": "pruned"});
            let mut progress = progress::Progress::start("prune", 0);
            // Each loop is bounded: every batch deletes rows, so at most (rows / batch) + 1 run.
            if let Some(path) = &args.consumer_db {
                let mut consumer = Consumer::open(&ctx, path, false)?;
                let mut total = tidemark_core::store::PruneReport::default();
                let mut batches = 0_u64;
                loop {
                    batches += 1;
                    let report = consumer.prune(args.applied_retention_ms, args.batch_rows, ctx.now_ms())?;
                    total.compacted += report.compacted;
                    total.receipts_deleted += report.receipts_deleted;
                    progress.advance(
                        1,
                        &format!(
                            "consumer: {} compacted, {} receipts deleted",
                            total.compacted, total.receipts_deleted
                        ),
                    );
                    if !report.more {
                        break;
                    }
                }
                out["consumer"] = to_json(&total);
                out["consumer"]["batches"] = json!(batches);
            }
            if let Some(path) = &args.producer {
                let mut producer = Producer::open(&ctx, path)?;
                let mut total = tidemark_core::store::OutboxPruneReport::default();
                let mut batches = 0_u64;
                loop {
                    batches += 1;
                    let report =
                        producer.prune_delivered(args.delivered_retention_ms, args.batch_rows, ctx.now_ms())?;
                    total.events_deleted += report.events_deleted;
                    total.deliveries_deleted += report.deliveries_deleted;
                    progress.advance(
                        1,
                        &format!(
                            "producer: {} events, {} deliveries deleted",
                            total.events_deleted, total.deliveries_deleted
                        ),
                    );
                    if !report.more {
                        break;
                    }
                }
                out["producer"] = to_json(&total);
                out["producer"]["batches"] = json!(batches);
            }
            progress.finish("pruned");
            Ok(out)
        }
        Command::RenameConsumer(args) => {
            tidemark_core::id::validate_id("from", &args.from)?;
            tidemark_core::id::validate_id("to", &args.to)?;
            let mut consumer = Consumer::open(&ctx, &args.consumer_db, true)?;
            let mut producer = args.producer.as_ref().map(|path| Producer::open(&ctx, path)).transpose()?;
            let report = match consumer.rename_consumer(&args.from, &args.to, ctx.now_ms()) {
                // A subscriber that has not received anything holds no state in the consumer
                // file: with the producer at hand to confirm the subscription, only its
                // retirement is recorded (a mistyped id stays `not_found`).
                Err(error) if error.code() == tidemark_core::error::codes::NOT_FOUND => {
                    let subscribed = match &producer {
                        Some(producer) => producer.subscriptions()?.iter().any(|s| s.consumer_id == args.from),
                        None => false,
                    };
                    if !subscribed {
                        return Err(error);
                    }
                    consumer.retire_consumer(&args.from, &args.to, ctx.now_ms())?;
                    tidemark_core::store::RenameReport { inbox: 0, receipts: 0, cursors: 0, projections: 0 }
                }
                other => other?,
            };
            let mut out = json!({"outcome": "renamed", "from": args.from, "to": args.to, "consumer": report});
            if let Some(producer) = &mut producer {
                out["producer_deliveries_moved"] = json!(producer.rename_subscription(&args.from, &args.to)?);
            }
            Ok(out)
        }
        Command::Demo(args) => demo::run(&ctx, args),
        Command::Experiment(args) => experiment::run(&ctx, args),
        Command::Bench(args) => bench::run(&ctx, args),
        Command::Worker(args) => workflow_cmd::worker::run(&ctx, args),
        Command::Workflow(command) => workflow_cmd::run(&ctx, command),
        Command::Schedule(command) => schedule_cmd::run(&ctx, command),
        Command::Queue(command) => queue_cmd::run(&ctx, command),
        Command::Serve(args) => server_cmd::serve(&ctx, args),
        Command::Config(command) => server_cmd::config(command),
        Command::Token(command) => server_cmd::token(&ctx, command),
        Command::Loadtest(_) | Command::Chaos(_) => unreachable!("handled above"),
        #[cfg(feature = "failpoints")]
        Command::UnsafeDualWriteAdvance(args) => unsafe_cmd::run(&ctx, args),
    }
}

fn error_json(code: &str, message: &str) -> String {
    json!({"outcome": "error", "error": {"code": code, "message": message}}).to_string()
}

fn main() {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => {
            use clap::error::ErrorKind;
            if matches!(error.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = error.print();
                std::process::exit(0);
            }
            if error.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                // The help goes to stderr for a person; stdout keeps its one JSON document.
                eprintln!("{}", error.render());
                println!("{}", error_json(codes::INVALID_ARGUMENT, "a subcommand is required; see --help"));
                std::process::exit(2);
            }
            let message = error.render().to_string();
            println!("{}", error_json(codes::INVALID_ARGUMENT, message.trim()));
            std::process::exit(2);
        }
    };
    // `demo` tells a person what it did, unless `--json` asks for its record; the exit codes are
    // the same either way.
    let narrate = matches!(&cli.command, Command::Demo(args) if !args.prints_json());
    match run(cli) {
        Ok(value) => {
            if narrate {
                emit(&demo::narrate(&value));
            } else {
                emit(&format!("{}\n", serde_json::to_string_pretty(&value).expect("json")));
            }
            let failed_check = value.get("check").and_then(|c| c.get("passed")).and_then(Value::as_bool) == Some(false);
            std::process::exit(if failed_check { 1 } else { 0 });
        }
        Err(error) => {
            if narrate {
                emit(&format!("The demo stopped: {error} ({}).\n", error.code()));
            } else {
                emit(&format!("{}\n", error_json(error.code(), &error.to_string())));
            }
            std::process::exit(if error.is_invalid_input() { 2 } else { 1 });
        }
    }
}

/// Write the command's output on stdout. A reader that went away (`tidemark ... | head`) is not
/// the command's failure: the write error is ignored and the exit code stays the command's
/// (`println!` would panic there).
fn emit(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
}

/// The inbox of one consumer store, as `tidemark consume` stores into it.
struct StoreInbox(std::sync::Mutex<Consumer>);

impl tidemark_transport::Inbox for StoreInbox {
    fn receive<'a>(
        &'a self,
        consumer_id: &'a str,
        events: Vec<Envelope>,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<Output = tidemark_core::Result<Vec<tidemark_core::store::ReceiveOutcome>>>
                + Send
                + 'a,
        >,
    > {
        Box::pin(async move {
            let items: Vec<(&str, &Envelope)> = events.iter().map(|e| (consumer_id, e)).collect();
            let mut guard = self.0.lock().unwrap_or_else(|p| p.into_inner());
            let consumer: &mut Consumer = &mut guard;
            // On a thread of its own: PostgreSQL's blocking client must not run on the
            // runtime's thread (it would start a runtime inside this one).
            std::thread::scope(|scope| {
                scope
                    .spawn(|| consumer.receive_batch(&items, tidemark_engine::now_ms()))
                    .join()
                    .unwrap_or_else(|_| Err(Error::Invariant("the inbox thread panicked".into())))
            })
        })
    }
}

/// `tidemark consume`: pull from the broker into the inbox until idle or a signal.
fn consume(ctx: &Context, args: ConsumeArgs) -> tidemark_core::Result<Value> {
    tidemark_core::id::validate_id("consumer_id", &args.consumer_id)?;
    let spec = tidemark_transport::SourceSettings {
        from: args.from,
        stream: args.stream,
        durable: args.durable.unwrap_or_else(|| format!("tidemark-{}", args.consumer_id)),
        batch: args.batch,
        ack_wait_ms: args.ack_wait_ms,
        session_timeout_ms: args.session_timeout_ms,
    }
    .check()
    .map_err(|e| match e {
        Error::Invalid { message, .. } => Error::invalid(codes::INVALID_ARGUMENT, message),
        other => other,
    })?;
    let mut transport = tidemark_transport::TransportConfig {
        connect_timeout: std::time::Duration::from_secs(5),
        ..Default::default()
    };
    match (&spec, args.amqp_credentials) {
        (tidemark_transport::SourceSpec::Amqp(config), Some(credentials)) => {
            let (server, _) = config.validate()?;
            transport.amqp_credentials.insert(server.clone(), credentials);
            // Checked before anything connects; the message never holds the value.
            transport.amqp_credentials(&server).map_err(|e| {
                let key = format!("relay.amqp_credentials.\"{server}\"");
                Error::invalid(codes::INVALID_ARGUMENT, e.to_string().replace(&key, "--amqp-credentials"))
            })?;
        }
        (_, None) => {}
        (_, Some(_)) => {
            return Err(Error::invalid(codes::INVALID_ARGUMENT, "--amqp-credentials is for amqp:// sources only"))
        }
    }
    // The longest a Kafka group may take to assign this consumer its partitions (a rebalance
    // waits up to the members' poll interval for the others to rejoin): `--until-idle` gives up
    // after it rather than wait for a cluster that never assigns.
    let join_bound = std::time::Duration::from_millis(match &spec {
        tidemark_transport::SourceSpec::Kafka(config) => config.session_timeout_ms.max(300_000),
        tidemark_transport::SourceSpec::Nats(_) | tidemark_transport::SourceSpec::Amqp(_) => 0,
    });
    let inbox = StoreInbox(std::sync::Mutex::new(Consumer::open(ctx, &args.consumer_db, false)?));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::io(format!("cannot start the runtime: {e}")))?;
    runtime.block_on(async {
        let source = tidemark_transport::Source::connect(&spec, &transport).await?;
        let started = std::time::Instant::now();
        let mut total = tidemark_transport::SourceReport::default();
        let mut pulls = 0_u64;
        let stop = tokio::signal::ctrl_c();
        tokio::pin!(stop);
        loop {
            let report = tokio::select! {
                report = source.pull(&inbox, &args.consumer_id, std::time::Duration::from_millis(500)) => report?,
                _ = &mut stop => break,
            };
            pulls += 1;
            let idle = report.fetched == 0;
            total.absorb(report);
            if idle && args.until_idle {
                if source.caught_up().await? {
                    break;
                }
                if let tidemark_transport::Source::Kafka(kafka) = &source {
                    if !kafka.joined() && started.elapsed() > join_bound {
                        return Err(Error::io(format!(
                            "the Kafka group assigned this consumer no partitions within {} ms",
                            join_bound.as_millis()
                        )));
                    }
                }
                // Kafka: not yet assigned, or records still to fetch; pull again at once.
                continue;
            }
            if idle {
                // A pull answers at once: wait before the next, as the relay does when idle.
                tokio::select! {
                    _ = tokio::time::sleep(std::time::Duration::from_millis(50)) => {}
                    _ = &mut stop => break,
                }
            }
        }
        let mut out = serde_json::to_value(&total).map_err(|e| Error::Invariant(e.to_string()))?;
        out["outcome"] = json!("consumed");
        out["pulls"] = json!(pulls);
        Ok(out)
    })
}
