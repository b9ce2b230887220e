//! `tidemark chaos`: a mixed workload over HTTP against several real `tidemark serve` processes
//! on one data folder, with faults injected on a schedule derived from a seed (SIGKILL and
//! restart, SIGSTOP past the worker lease and SIGCONT), a ledger of every acknowledged operation,
//! a clean restart and a bounded wait for convergence, and then the independent
//! [`checker`] on the files. `tidemark chaos check` runs the checker alone on a run's folder.
//!
//! The processes share the data folder the way workers share work: every one of them relays,
//! drains and runs workflow workers on the same SQLite files, serialised by SQLite's write lock
//! and fenced by the run leases. With `--store postgres://...` they share the tenant's schemas
//! on that server instead (the data folder keeps the fake payment service's log), and the
//! checker reads the schemas. See docs/reliability.md, "Chaos harness".

pub mod checker;
mod fuzz;
mod proxy;
pub mod schedule;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;
use serde_json::{json, Value};
use tidemark_builtins::order::ORDER_SAGA;
use tidemark_builtins::workflows::{BATCH_DONE, ORDER_BATCH, SLEEPY_ORDER};
use tidemark_core::error::codes;
use tidemark_core::{Error, Result};

use checker::{Acknowledged, BatchOrder, TenantData};
use proxy::{Link, Proxy};
use schedule::{Fault, FaultKind, IoErrorMode, PartitionMode};

use crate::loadtest::{write_ledger, FLOW_STATES};
use tidemark_core::reservation::event_type_for;

/// The tenant every request acts in (`auth.mode = "none"`, `auth.dev_tenant`).
pub const TENANT: &str = "chaos";
/// The consumer declared with the `reservation` handler (projection and one effect row per event).
pub(crate) const SHIPPING_CONSUMER: &str = "shipping";
/// The consumer declared with the `record` handler (the inbox only).
pub(crate) const AUDIT_CONSUMER: &str = "audit";
/// The consumer on the remote server (its own data folder) that the servers' relays deliver to
/// over HTTP through the harness's proxy, or through a broker behind it (`--broker`), when the
/// run partitions the network.
pub(crate) const REMOTE_CONSUMER: &str = "remote";
/// The bearer token the relays send the remote server (which runs without auth, as the servers
/// do; the relay still needs one configured for the origin).
const REMOTE_TOKEN: &str = "chaos-remote";
/// The SKU every order takes from.
pub(crate) const SKU: &str = "chaos-sku";
/// Its stock, set before the workload (never runs out).
pub(crate) const STOCK: i64 = 1_000_000_000;
/// The queue a quarter of the order sagas go through (`POST /v1/runs` with `"queue"`).
pub(crate) const QUEUE: &str = "chaos-q";
/// Its concurrency limit across every process and worker.
pub(crate) const QUEUE_CONCURRENCY_MAX: u32 = 8;
/// Its rate limit, admissions per second (above the workload's queued starts: it is exercised,
/// and a backlog it built would drain only at this rate during the convergence wait).
const QUEUE_RATE_LIMIT: u32 = 500;
/// The schedule declared at setup: every [`TICK_INTERVAL_MS`] it starts a `sleepy_order` of
/// [`TICK_QUANTITY`] units whose order is its run id (`<schedule>:<tick>`), catching up every
/// missed tick; the harness pauses it before it waits for convergence.
pub(crate) const TICKS: &str = "chaos-tick";
/// Its interval (the least a schedule takes).
pub(crate) const TICK_INTERVAL_MS: i64 = 1_000;
/// The units each tick's order takes.
pub(crate) const TICK_QUANTITY: i64 = 1;
/// How long a batch's waiter waits for its `batch_done` message: far longer than a batch takes
/// under the harness's faults, short enough that a waiter whose batch was never started (its
/// start unanswered) ends within the convergence wait. Not far enough for a long run on
/// PostgreSQL on two cores, whose backlog grows until batches take longer (docs/reliability.md,
/// after run N): the checker then reports the waiters that gave up and their batches.
pub(crate) const WAITER_TIMEOUT_MS: u64 = 60_000;
/// Most sends of a start that must be answered (a batch's waiter, and its batch): with the
/// 1 s request timeout and the pause between sends, about 40 s.
const START_SENDS_MAX: usize = 40;
/// The longest pause between a start's acknowledgement and its cancel (one start alone in eight).
const CANCEL_DELAY_MS_MAX: u64 = 300;
/// The event type of a poison event: a one-event stream the `reservation` handler cannot
/// decode, so `shipping` blocks it (the `record` handler of `audit` applies it), until the
/// harness's inbox operator skips it ([`skip_poison`]).
pub(crate) const POISON_EVENT_TYPE: &str = "chaos.poison";
/// One new flow of a client in this many is a poison stream.
const POISON_ONE_IN: u32 = 12;
/// How often the inbox operator looks for blocked poison records during the workload.
const SKIP_POLL: Duration = Duration::from_millis(300);
/// The relays' attempts of one delivery (`relay.max_attempts`) in a run with a remote consumer:
/// few, so that a partition's failed deliveries are quarantined (a cut fails each attempt at
/// once) and the outbox operator must resolve them ([`requeue_quarantined`]).
const RELAY_MAX_ATTEMPTS: u32 = 3;
/// How often the outbox operator looks for quarantined deliveries during the workload.
const QUARANTINE_POLL: Duration = Duration::from_millis(300);
/// One pass of the outbox operator in this many redelivers a subscriber's events from its first
/// quarantined one on (`POST /v1/outbox/redeliver/{consumer}`: the consumer answers `duplicate`
/// for what it holds); the others requeue each quarantined delivery (`resolve`, `requeue`).
const REDELIVER_ONE_IN: u32 = 4;
/// Of the other passes over a subscriber with quarantined deliveries, one in this many dismisses
/// its first quarantined event instead of requeuing it (the first such pass after a
/// redelivery always does, so that a run with a few quarantines exercises all three decisions):
/// the operator gives the event up for that subscriber, and the ledger says so.
const DISMISS_ONE_IN: u32 = 8;
/// One start alone in this many is an operated order ([`operated_start`]), which an operator
/// task retries, skips, forks or abandons ([`Operator::operate`]).
const OPERATED_ONE_IN: u32 = 10;
/// An operated order's charge fails (retryably) this many times: more than its attempts, so its
/// run fails unless an operator steps in (a retry's fresh attempts then charge it).
const OPERATED_FLAKY_ATTEMPTS: u32 = MAX_ATTEMPTS + 2;
/// The step of `sleepy_order` an operated order fails at, and an operator retries, skips or
/// forks from.
const OPERATED_STEP: &str = "charge_payment";
/// The longest pause between an operated order's acknowledgement and its abandon (the run is
/// usually still trying its charge then).
const ABANDON_DELAY_MS_MAX: u64 = 600;
/// The controls of a client's operated orders in turn (retry 7, skip 6, fork 3, abandon 4 in
/// 20), client `i` starting at `5 i`: the first operated orders of four clients get the four.
const OPERATOR_TURNS: [&str; 20] = [
    "retry", "skip", "fork", "abandon", "retry", "skip", "retry", "abandon", "skip", "retry", "fork", "skip", "retry",
    "abandon", "skip", "abandon", "fork", "retry", "skip", "retry",
];
/// How often an operator reads an operated run while it waits for the run to fail.
const OPERATOR_POLL: Duration = Duration::from_millis(200);
/// The pause before a start is sent again.
const START_RESEND_PAUSE: Duration = Duration::from_millis(100);
/// The servers' worker lease (`workers.lease_ms`): a pause is longer than this.
const LEASE_MS: u64 = 1_000;
/// The servers' fixed step retry delay (`workers.retry_delay_ms`), so that retries after a crash
/// do not wait the default exponential backoff.
const RETRY_DELAY_MS: u64 = 50;
/// The servers' step attempts (`workers.max_attempts`): a step interrupted by a kill or a lost
/// lease is attempted again, so a few crashes must not use a step's attempts up.
const MAX_ATTEMPTS: u32 = 10;
/// Most server processes.
const PROCESSES_MAX: usize = 16;
/// Most faults in one run.
const FAULTS_MAX: usize = 10_000;
/// Longest workload.
const DURATION_S_MAX: u64 = 24 * 3_600;
/// Most concurrent clients.
const CLIENTS_MAX: usize = 256;
/// Most worker processes beside the servers.
const WORKERS_MAX: usize = 8;
/// Longest wait for convergence after the clean restart.
const CONVERGE_TIMEOUT_S_MAX: u64 = 3_600;
/// How long a server may take to print its listening line.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// Attempts to restart a server on its address (the port may still be held for a moment).
const START_ATTEMPTS_MAX: u32 = 20;
/// How long an armed crash point may take to be reached before the process is killed instead
/// (a point the process does not pass while the fault waits: a worker with no run to claim).
const CRASH_POINT_WAIT: Duration = Duration::from_secs(3);
/// How long a process killed during a clock jump stays down before it restarts (its clock still
/// off).
const CLOCK_JUMP_KILL_DOWN: Duration = Duration::from_millis(200);
/// How long a server may take to stop after SIGTERM before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// A client's request timeout: shorter than a pause, so that clients whose request went to a
/// paused process give up on it (the request may or may not commit: it is not in the ledger) and
/// go on with the other processes, instead of every closed-loop client ending up waiting for the
/// paused one (with 10 s, the whole workload stalled for the length of each pause).
const CLIENT_REQUEST_TIMEOUT: Duration = Duration::from_millis(1_000);
/// The timeout of the setup and convergence requests.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// A client's pause after a failed request.
const RETRY_PAUSE: Duration = Duration::from_millis(20);
/// How long the harness waits, after a partition heals, for the first new record in the remote
/// inbox.
const HEAL_WAIT: Duration = Duration::from_secs(10);
/// How often the harness reads the files while it waits for convergence.
const CONVERGE_POLL: Duration = Duration::from_millis(250);
/// The remote server's JetStream source's `ack_wait_ms`: what a killed remote server had fetched
/// and not acked is delivered again this soon (the default is 30 s).
const SOURCE_ACK_WAIT_MS: u64 = 2_000;
/// The longest `--broker` URL.
const BROKER_URL_MAX: usize = 256;

/// The arguments of `tidemark chaos` (a run) and `tidemark chaos check` (the checker alone).
#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct ChaosArgs {
    #[command(subcommand)]
    command: Option<ChaosCommand>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand)]
enum ChaosCommand {
    /// Run the independent checker on the folder of a run (its data and ledger).
    Check(CheckArgs),
    /// Run a seed's schedule, and when it fails, look for a smallest subset of its faults that
    /// still fails (delta debugging: runs of `--faults-only` subsets, each in a folder of its
    /// own under `--out`).
    Shrink(Box<ShrinkArgs>),
    /// Runs beyond one seed: from its own seed, each run draws its seed, a subset of the kinds
    /// of fault, the processes, worker processes, clients and faults; the fuzz stops at the first
    /// run that fails and shrinks it.
    Fuzz(Box<fuzz::FuzzArgs>),
}

#[derive(Args)]
struct ShrinkArgs {
    /// The runs a shrink makes at most, the first (the whole schedule) included (1..=200).
    #[arg(long, default_value_t = 30)]
    attempts_max: usize,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Args, Clone)]
struct RunArgs {
    /// The seed of the fault schedule and of the clients' choices (0..=2^64-1).
    #[arg(long)]
    seed: Option<u64>,
    /// Seconds of workload (1..=86400); the workload also lasts until the last fault ended.
    #[arg(long, default_value_t = 20)]
    duration_s: u64,
    /// Faults to inject (0..=10000).
    #[arg(long, default_value_t = 4)]
    faults: usize,
    /// Inject only these faults of the seed's schedule: their indices (0-based, as
    /// schedule.json numbers them), comma-separated, each below `--faults`. Each keeps its due
    /// time and what was drawn for it; the others are left out. What `chaos shrink` reports.
    #[arg(long, value_delimiter = ',')]
    faults_only: Option<Vec<usize>>,
    /// The kinds of fault to draw from, comma-separated: `sigkill`, `sigstop`, `power-loss`,
    /// `clock-jump` (power losses and clock jumps need a build with the `failpoints` feature),
    /// `partition` (a remote consumer's server behind a TCP proxy that cuts, black-holes, loses
    /// answers or flaps), `io-error` (the disk full, or failing writes or fsyncs, for a moment;
    /// a failpoints build; with `--store`, the database machine's disk, through `--db-preload`), `db-crash` (the PostgreSQL server of `--store` stopped at once and
    /// started again; needs `--db-data`), `remote-kill` (the remote consumer's server killed
    /// with SIGKILL and started again), `crash-point` (instead of half the SIGKILLs, a process
    /// stops by itself at a commit boundary drawn from the seed; a failpoints build).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "sigkill,sigstop")]
    kinds: Vec<FaultKind>,
    /// `tidemark serve` processes on the one data folder (2..=16).
    #[arg(long, default_value_t = 2)]
    processes: usize,
    /// Concurrent HTTP clients (1..=256).
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// `tidemark worker` processes on the tenant's workflow database beside the servers
    /// (0..=8), sharing their runs; the faults of a process (SIGKILL, SIGSTOP, clock jumps,
    /// crash points) hit them too, and a power loss of the machine kills them with the servers.
    #[arg(long, default_value_t = 0)]
    workers: usize,
    /// The largest clock jump of `--kinds clock-jump`, in leases of the servers' 1 s lease
    /// (1..=86400; default 5): each jump steps one lease to this many, forward or back, for the
    /// lease plus 0.2-1.5 s. Larger ones set a process's clock hours off.
    #[arg(long, default_value_t = schedule::CLOCK_JUMP_LEASES_MAX)]
    clock_jump_leases_max: u64,
    /// Seconds to wait for convergence after the clean restart (1..=3600).
    #[arg(long, default_value_t = 120)]
    converge_timeout_s: u64,
    /// The run's folder (created; must not exist or be empty): data/, ledger.jsonl,
    /// schedule.json, logs/. Default: tidemark-chaos-<seed>.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Serve on PostgreSQL: `postgres://user@host:port/db?schema=<prefix>` (the servers'
    /// `--store`; the prefix must hold no schema yet, and the run leaves its schemas for `chaos
    /// check`). Faults: sigkill, sigstop and partition (clock jumps act on the servers' clock
    /// files); with `--db-data`, also `db-crash`, and with `--db-preload` too, `power-loss` and
    /// `io-error` (the database machine's).
    #[arg(long)]
    store: Option<String>,
    /// The data folder of the PostgreSQL server `--store` names, for `--kinds db-crash`: the
    /// harness stops that server at once (`pg_ctl stop -m immediate`) and starts it again
    /// (`pg_ctl start`), as the folder's owner.
    #[arg(long)]
    db_data: Option<PathBuf>,
    /// The fault shim (`libtidemark_faultfs_preload.so`, built by `cargo build -p
    /// tidemark-faultfs-preload`), for `--kinds power-loss` or `io-error` with `--store`: the harness restarts
    /// the server of `--db-data` with it preloaded, so that its data folder is on the fault layer
    /// (docs/reliability.md, "PostgreSQL on the layer"), and a power loss is then the database
    /// machine's: the server stopped at once, what it had not made durable thrown away, the
    /// server started again; the tidemark processes stay up. An I/O error is then the database
    /// disk's (the shim's `full`, `eio-write` or `eio-fsync` for the fault's length; the server
    /// started again afterwards if it stopped). At the end of the run the server is restarted
    /// without the shim.
    #[arg(long)]
    db_preload: Option<PathBuf>,
    /// With `--kinds partition` or `remote-kill`: reach the remote consumer through this broker
    /// instead of over HTTP, `nats://host:port` (JetStream) or `amqp://host:port` (RabbitMQ, as
    /// guest). The harness creates a stream (or a topic exchange bound to a quorum queue) of the run's own;
    /// the servers' relays publish to it through the partitioned link, and the remote server
    /// consumes it into its inbox (`[[sources]]`). Deleted when the run ends. `kafka-mock`:
    /// rdkafka's mock cluster inside the harness process (one broker, a topic of 16 partitions),
    /// partitioned by the mock's own faults instead of the proxy (docs/reliability.md).
    #[arg(long)]
    broker: Option<String>,
    /// A folder on a small file system of its own (a tmpfs or a loop mount; at most 4 GiB
    /// free): the servers' data folder goes there (`OUT/data` is a link to
    /// `DIR/tidemark-chaos-<seed>-<pid>-<n>`, left there for `chaos check`), and the `full` I/O
    /// errors fill that file system for real, with a ballast file of all its free space beside
    /// the data folder for the fault's length, instead of the fault VFS's control file. Not with
    /// `--store`.
    #[arg(long)]
    disk: Option<PathBuf>,
}

#[derive(Args)]
struct CheckArgs {
    /// The folder of a chaos run.
    #[arg(long)]
    out: PathBuf,
    /// The seed to name in the violations (the run's; optional).
    #[arg(long)]
    seed: Option<u64>,
    /// The run's `--store`, when it served on PostgreSQL.
    #[arg(long)]
    store: Option<String>,
}

pub(crate) fn invalid(message: impl Into<String>) -> Error {
    Error::invalid(codes::INVALID_ARGUMENT, message)
}

fn io(what: &str) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::io(format!("{what}: {e}"))
}

/// Run `tidemark chaos` or `tidemark chaos check`. `durability` (the global `--durability`,
/// `full` or `normal`) is the servers': with `normal` a power loss loses acknowledged commits,
/// as documented, and the checker says so.
pub fn run(args: ChaosArgs, durability: &str) -> Result<Value> {
    match args.command {
        Some(ChaosCommand::Check(check_args)) => check_only(&check_args),
        Some(ChaosCommand::Shrink(shrink_args)) => shrink(*shrink_args, durability),
        Some(ChaosCommand::Fuzz(fuzz_args)) => fuzz::fuzz(*fuzz_args, durability),
        None => chaos(args.run, durability),
    }
}

/// Most runs of one shrink.
const SHRINK_ATTEMPTS_MAX: usize = 200;

/// `tidemark chaos shrink`: the seed's schedule (or its `--faults-only` part) run once; when it
/// fails, subsets of its faults are run (Zeller's ddmin: halves, then complements, then finer
/// parts) and the smallest that failed is kept, until no part of it fails alone or
/// `--attempts-max` runs were made. A run is a failure when its check did not pass (violations,
/// no convergence, an unclean stop); an error of the harness stops the shrink. Runs are not
/// exactly repeatable (the faults' times are the seed's, the processes' interleavings are not):
/// a subset that failed once is kept even if another run of it would pass, and the answer's
/// `reproduce` is the command of the smallest failing run, to run again.
fn shrink(args: ShrinkArgs, durability: &str) -> Result<Value> {
    if !(1..=SHRINK_ATTEMPTS_MAX).contains(&args.attempts_max) {
        return Err(invalid(format!("--attempts-max must be 1..={SHRINK_ATTEMPTS_MAX}, got {}", args.attempts_max)));
    }
    let base = args.run;
    let out = base.out.clone().ok_or_else(|| invalid("chaos shrink needs --out DIR (a folder per run goes in it)"))?;
    if out.read_dir().is_ok_and(|mut entries| entries.next().is_some()) {
        return Err(Error::invalid(codes::ALREADY_EXISTS, format!("--out {} is not empty", out.display())));
    }
    let store = base.store.as_deref().map(PostgresStore::parse).transpose()?;
    let mut trials: Vec<Value> = Vec::new();
    let mut smallest: Option<Value> = None;
    // Run `faults` (indices of the seed's schedule): whether it failed.
    let mut attempt = |faults: &[usize], trials: &mut Vec<Value>| -> Result<bool> {
        let index = trials.len();
        let mut args = base.clone();
        args.out = Some(out.join(format!("run-{index}")));
        args.faults_only = Some(faults.to_vec());
        // On PostgreSQL each run needs a schema prefix of its own.
        if let Some(store) = &store {
            args.store =
                Some(crate::stores::schema_url(store.backend.conn(), &format!("{}_s{index}", store.backend.prefix())));
        }
        let report = chaos(args, durability)?;
        let failed = report["check"]["passed"] == false;
        trials.push(json!({"faults": faults, "outcome": report["outcome"], "out": report["out"]}));
        if failed && smallest.as_ref().is_none_or(|s| s["faults"].as_array().map_or(0, Vec::len) > faults.len()) {
            smallest = Some(json!({
                "faults": faults, "reproduce": report["reproduce"], "check": report["check"],
                "schedule": report["faults"]["schedule"],
            }));
        }
        Ok(failed)
    };
    let all: Vec<usize> = match &base.faults_only {
        Some(only) => only.clone(),
        None => (0..base.faults).collect(),
    };
    if !attempt(&all, &mut trials)? {
        return Ok(json!({
            "outcome": "passed",
            "seed": base.seed,
            "faults": all,
            "trials": trials,
            "check": {"passed": true},
        }));
    }
    let budget = args.attempts_max - trials.len();
    let (_, exhausted) = ddmin(all, budget, |candidate| attempt(candidate, &mut trials))?;
    let smallest = smallest.ok_or_else(|| Error::Invariant("a failed run was not kept".into()))?;
    Ok(json!({
        "outcome": "shrunk",
        "seed": base.seed,
        "faults": smallest["faults"],
        "schedule": smallest["schedule"],
        "reproduce": smallest["reproduce"],
        "exhausted": exhausted,
        "attempts": trials.len(),
        "trials": trials,
        "check": smallest["check"],
    }))
}

/// Zeller's ddmin over `failing` (a set that `fails`): each part alone, then (with more than
/// two parts) everything but each part, then twice as many parts, until no part of the
/// smallest failing set found fails alone. At most `budget` calls of `fails`; answers that set
/// and whether the budget ran out first.
fn ddmin(
    failing: Vec<usize>,
    budget: usize,
    mut fails: impl FnMut(&[usize]) -> Result<bool>,
) -> Result<(Vec<usize>, bool)> {
    let mut current = failing;
    let mut parts = 2;
    let mut calls = 0;
    while current.len() >= 2 {
        let size = current.len().div_ceil(parts);
        let chunks: Vec<Vec<usize>> = current.chunks(size).map(<[usize]>::to_vec).collect();
        let complements: Vec<Vec<usize>> = (0..chunks.len())
            .map(|skip| chunks.iter().enumerate().filter(|(i, _)| *i != skip).flat_map(|(_, c)| c.clone()).collect())
            .collect();
        let mut reduced = None;
        for candidate in chunks.iter().chain(complements.iter().filter(|_| chunks.len() > 2)) {
            if calls == budget {
                return Ok((current, true));
            }
            calls += 1;
            if fails(candidate)? {
                reduced = Some(candidate.clone());
                break;
            }
        }
        match reduced {
            Some(smaller) => {
                parts = if chunks.contains(&smaller) { 2 } else { (parts - 1).max(2) };
                current = smaller;
            }
            None if parts >= current.len() => break,
            None => parts = (parts * 2).min(current.len()),
        }
    }
    Ok((current, false))
}

fn check_only(args: &CheckArgs) -> Result<Value> {
    let ledger = checker::read_ledger(&args.out.join("ledger.jsonl"))?;
    // A run that partitioned the network has the remote server's folder beside its own.
    // With --store, its schemas are under the prefix `<prefix>_r`, as the run made them.
    let store = args.store.as_deref().map(PostgresStore::parse).transpose()?;
    let remote = args.out.join("remote");
    let remote = if remote.is_dir() {
        Some(tenant_data(&remote, store.as_ref().map(PostgresStore::remote).transpose()?.as_ref()))
    } else {
        None
    };
    let data = tenant_data(&args.out.join("data"), store.as_ref());
    let report = checker::check(&data, TENANT, &ledger, remote.as_ref())?;
    let check = report.to_json(args.seed);
    Ok(json!({
        "outcome": if report.total() == 0 { "passed" } else { "violations" },
        "out": args.out,
        "lost": report.counts["lost"],
        "applied_twice": report.counts["applied_twice"],
        "check": check,
    }))
}

/// Does a run of these kinds have a remote consumer behind the proxy (it partitions the link or
/// kills the remote server)?
fn has_remote(kinds: &[FaultKind]) -> bool {
    [FaultKind::Partition, FaultKind::RemoteKill].iter().any(|k| kinds.contains(k))
}

/// The PostgreSQL server and schema prefix a run serves on (`--store`).
#[derive(Clone)]
struct PostgresStore {
    backend: tidemark_server::Postgres,
    /// The URL as given (the servers' `--store`).
    url: String,
    /// The URL with its password masked (what the report shows).
    masked: String,
}

impl PostgresStore {
    /// A `--store` URL: PostgreSQL's, with a service's schema prefix (`invalid_argument`
    /// otherwise).
    fn parse(url: &str) -> Result<PostgresStore> {
        let not_postgres = || invalid("--store takes a postgres:// URL (a run on SQLite files needs no --store)");
        let masked = match tidemark_core::location::StoreLocation::parse(url) {
            Ok(tidemark_core::location::StoreLocation::Postgres(location)) => location.masked,
            Ok(_) => return Err(not_postgres()),
            Err(e) => return Err(invalid(format!("--store: {e}"))),
        };
        let backend = tidemark_server::Postgres::from_url(url).map_err(|e| invalid(format!("--store: {e}")))?;
        Ok(PostgresStore { backend, url: url.to_string(), masked })
    }

    /// The remote consumer's server's store: the same server, the schema prefix `<prefix>_r`, so
    /// that its schemas (`<prefix>_r_chaos_<hash>_p|i|w`) are the run's too (dropped with
    /// `<prefix>_*`) and never the servers' (`invalid_argument` when the longer prefix is too long).
    fn remote(&self) -> Result<PostgresStore> {
        let url = crate::stores::schema_url(self.backend.conn(), &format!("{}_r", self.backend.prefix()));
        PostgresStore::parse(&url)
            .map_err(|e| invalid(format!("the remote server's store (the --store prefix and _r): {e}")))
    }

    /// The `--store` URL of one of the tenant's schemas (what a worker process opens).
    fn schema_url(&self, database: tidemark_server::Database) -> String {
        crate::stores::schema_url(self.backend.conn(), &self.backend.schema(TENANT, database))
    }

    /// A run starts from nothing: no schema under the prefix yet (`already_exists`).
    fn ensure_empty(&self) -> Result<()> {
        let mut client = postgres::Client::connect(self.backend.conn(), postgres::NoTls)
            .map_err(|e| Error::io(format!("cannot connect to {}: {e}", self.masked)))?;
        let prefix = format!("{}_", self.backend.prefix());
        let taken: i64 = client
            .query_one("SELECT count(*) FROM pg_namespace WHERE starts_with(nspname, $1)", &[&prefix])
            .and_then(|row| row.try_get(0))
            .map_err(|e| Error::io(format!("cannot list the schemas of {}: {e}", self.masked)))?;
        if taken > 0 {
            return Err(Error::invalid(
                codes::ALREADY_EXISTS,
                format!("{taken} schemas start with {prefix}: a chaos run starts from an unused schema prefix"),
            ));
        }
        Ok(())
    }
}

/// The PostgreSQL server a run crashes and restarts (`--kinds db-crash`, `--db-data`).
struct Database {
    data: PathBuf,
    pg_ctl: PathBuf,
    /// The data folder's owner, when the harness runs as root (PostgreSQL refuses to run as
    /// root): `pg_ctl` runs as this user through `runuser`.
    run_as: Option<String>,
    /// `pg_ctl`'s output, and the server's after a restart by the harness
    /// (`OUT/logs/postgres.log`).
    log: PathBuf,
    /// The fault layer the server runs on, with `--db-preload`.
    layer: Option<DbLayer>,
    /// The server's connection string (`--store`'s), to wait for it to answer.
    conn: String,
}

/// The fault layer under the database server (`--db-preload`): a folder of the harness's, owned
/// by the server's user, holding a copy of the shim (readable by that user wherever the original
/// is) and the layer's state folder.
struct DbLayer {
    /// `--db-preload` as given (for the report's reproduce line).
    preload: PathBuf,
    dir: PathBuf,
    shim: PathBuf,
    state: PathBuf,
}

impl Database {
    /// The data folder `data` of the server `store` names (`SHOW data_directory` must be it),
    /// the `pg_ctl` of its version, and the user to run it as; `invalid_argument` otherwise.
    fn locate(data: &Path, store: &PostgresStore, out: &Path, preload: Option<&Path>, seed: u64) -> Result<Database> {
        use std::os::unix::fs::MetadataExt;
        let version = std::fs::read_to_string(data.join("PG_VERSION")).map_err(|_| {
            invalid(format!("--db-data {} is not a PostgreSQL data folder (no PG_VERSION)", data.display()))
        })?;
        let versioned = PathBuf::from(format!("/usr/lib/postgresql/{}/bin/pg_ctl", version.trim()));
        let bindir = Command::new("pg_config")
            .arg("--bindir")
            .output()
            .ok()
            .map(|out| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("pg_ctl"));
        let pg_ctl = [Some(versioned), bindir]
            .into_iter()
            .flatten()
            .find(|path| path.is_file())
            .ok_or_else(|| invalid(format!("no pg_ctl of PostgreSQL {} found", version.trim())))?;
        let canonical = |path: &Path| std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        let mut client = postgres::Client::connect(store.backend.conn(), postgres::NoTls)
            .map_err(|e| Error::io(format!("cannot connect to {}: {e}", store.masked)))?;
        let served: String = client
            .query_one("SHOW data_directory", &[])
            .and_then(|row| row.try_get(0))
            .map_err(|e| Error::io(format!("cannot read the data folder of {}: {e}", store.masked)))?;
        if canonical(Path::new(&served)) != canonical(data) {
            return Err(invalid(format!(
                "--db-data {} is not the data folder of the server --store names ({served})",
                data.display()
            )));
        }
        let owner = std::fs::metadata(data).map_err(io("cannot read --db-data"))?;
        let root = std::fs::metadata("/proc/self").map(|m| m.uid() == 0).unwrap_or(false);
        let run_as = match root && owner.uid() != 0 {
            true => {
                let name =
                    Command::new("id").args(["-nu", &owner.uid().to_string()]).output().map_err(io("cannot run id"))?;
                Some(String::from_utf8_lossy(&name.stdout).trim().to_string())
            }
            false => None,
        };
        let log = out.join("logs").join("postgres.log");
        let layer = preload.map(|preload| DbLayer::create(preload, seed, &owner)).transpose()?;
        let conn = store.backend.conn().to_string();
        Ok(Database { data: canonical(data), pg_ctl, run_as, log, layer, conn })
    }

    fn pg_ctl(&self, args: &[&str]) -> Result<()> {
        self.pg_ctl_on(args, false)
    }

    /// `pg_ctl` with `args`; `on_layer`: with the shim preloaded and the layer's folders named.
    fn pg_ctl_on(&self, args: &[&str], on_layer: bool) -> Result<()> {
        let mut command = match &self.run_as {
            Some(user) => {
                let mut command = Command::new("runuser");
                command.args(["-u", user, "--"]).arg(&self.pg_ctl);
                command
            }
            None => Command::new(&self.pg_ctl),
        };
        if let (true, Some(layer)) = (on_layer, &self.layer) {
            command
                .env("LD_PRELOAD", &layer.shim)
                .env(tidemark_faultfs::ENV, &layer.state)
                .env("TIDEMARK_FAULTFS_ROOT", &self.data);
        }
        // pg_ctl's output and, after a start, the server's (which inherits it) go to the log,
        // opened here: the server's user need not be able to open a file in the run's folder.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(io("cannot open the database log"))?;
        let status = command
            .arg("-D")
            .arg(&self.data)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().map_err(io("cannot open the database log"))?))
            .stderr(Stdio::from(log))
            .status()
            .map_err(io("cannot run pg_ctl"))?;
        if !status.success() {
            return Err(Error::io(format!("pg_ctl {} failed (see {})", args.join(" "), self.log.display())));
        }
        Ok(())
    }

    /// Stop the server at once: every backend killed, nothing flushed.
    fn crash(&self) -> Result<()> {
        self.pg_ctl(&["stop", "-m", "immediate", "-w", "-t", "60"])
    }

    /// Start it again (crash recovery; on the layer with `--db-preload`) and wait until it
    /// accepts connections (bounded).
    ///
    /// On the layer each file the server holds open costs up to three descriptors (its own, its
    /// undo log's and the shim's reader of its old bytes), and a server started through
    /// `runuser` gets the session's soft limit of 1,024: at PostgreSQL's default of 1,000 files
    /// the shim's opens failed (`EMFILE`, answered `EIO`) in the end-of-recovery checkpoint of a
    /// long run, which then could not start. So the server keeps at most
    /// [`LAYER_FILES_PER_PROCESS`] files open there.
    fn start(&self) -> Result<()> {
        let files = format!("-c max_files_per_process={LAYER_FILES_PER_PROCESS}");
        match self.layer {
            Some(_) => self.pg_ctl_on(&["start", "-w", "-t", "60", "-o", &files], true),
            None => self.pg_ctl_on(&["start", "-w", "-t", "60"], true),
        }
    }

    /// Restart the server on the fault layer (before the run), and check that the shim is loaded:
    /// its writes leave undo logs (a library the loader cannot read is ignored with a warning).
    fn enter_layer(&self) -> Result<()> {
        let Some(layer) = &self.layer else { return Ok(()) };
        self.pg_ctl(&["stop", "-m", "fast", "-w", "-t", "60"])?;
        self.start()?;
        let tracked = std::fs::read_dir(&layer.state)
            .map_err(io("cannot read the fault layer's state folder"))?
            .flatten()
            .any(|e| e.path().extension().is_some_and(|x| x == "undo"));
        if !tracked {
            return Err(Error::io(format!(
                "the database server did not load the fault shim {} (see {})",
                layer.shim.display(),
                self.log.display()
            )));
        }
        Ok(())
    }

    /// Restart the server without the layer (after the run, also after a failed one: the server
    /// may be stopped by a fault then). The layer's folder goes with the settings ([`DbLayer`]).
    fn leave_layer(&self) {
        if self.layer.is_none() {
            return;
        }
        let _ = self.pg_ctl(&["stop", "-m", "fast", "-w", "-t", "60"]);
        if let Err(e) = self.pg_ctl(&["start", "-w", "-t", "60"]) {
            eprintln!("tidemark chaos: cannot restart the database without the fault layer: {e}");
        }
    }

    /// An I/O error of the database machine's disk for `hold`: the layer's control file of `mode`
    /// there meanwhile (every process of the server fails alike). A failed write or fsync of the
    /// WAL makes PostgreSQL PANIC, and its own restart fails while the fault lasts: afterwards
    /// the server is started again when it is down, and waited for until it answers (bounded).
    /// Answers whether the harness had to start it.
    fn io_error(&self, mode: IoErrorMode, hold: Duration) -> Result<bool> {
        let layer =
            self.layer.as_ref().ok_or_else(|| Error::Invariant("a database I/O error without the layer".into()))?;
        let control = layer.state.join(io_error_control(mode));
        std::fs::write(&control, b"").map_err(io("cannot start an I/O error"))?;
        std::thread::sleep(hold);
        std::fs::remove_file(&control).map_err(io("cannot end an I/O error"))?;
        let deadline = Instant::now() + DB_BACK_WAIT;
        while Instant::now() < deadline {
            if !self.running()? {
                self.start()?;
                return Ok(true);
            }
            // Up (or recovering by itself after a PANIC): done once it answers.
            if postgres::Client::connect(&self.conn, postgres::NoTls).is_ok() {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Err(Error::io(format!(
            "the database did not answer {} s after an I/O error (see {})",
            DB_BACK_WAIT.as_secs(),
            self.log.display()
        )))
    }

    /// Whether the server runs (`pg_ctl status`: 0 when it does, 3 when it does not).
    fn running(&self) -> Result<bool> {
        match self.pg_ctl(&["status"]) {
            Ok(()) => Ok(true),
            Err(_) => Ok(false),
        }
    }

    /// The database machine's power loss: the server stopped at once, then what its files had not
    /// made durable thrown away (the server is started again by the caller).
    fn power_loss(&self, writeback: tidemark_faultfs::Writeback) -> Result<tidemark_faultfs::PowerLossReport> {
        let layer =
            self.layer.as_ref().ok_or_else(|| Error::Invariant("a database power loss without the layer".into()))?;
        self.crash()?;
        tidemark_faultfs::power_loss(&layer.state, writeback)
            .map_err(|e| Error::io(format!("power loss in {}: {e}", layer.state.display())))
    }
}

/// Longest wait for the database server to answer after an I/O error of its disk (its crash
/// recovery included).
const DB_BACK_WAIT: Duration = Duration::from_secs(120);

/// The files a PostgreSQL server on the fault layer keeps open at most (`max_files_per_process`,
/// 1,000 by default): three descriptors each fit a limit of 1,024 ([`Database::start`]).
const LAYER_FILES_PER_PROCESS: u32 = 300;

impl DbLayer {
    /// `$TMPDIR/tidemark-chaos-db-faultfs-<seed>-<pid>`, owned by the data folder's owner.
    fn create(preload: &Path, seed: u64, owner: &std::fs::Metadata) -> Result<DbLayer> {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        if !preload.is_file() {
            return Err(invalid(format!("--db-preload {} is not a file", preload.display())));
        }
        let dir = std::env::temp_dir().join(format!("tidemark-chaos-db-faultfs-{seed}-{}", std::process::id()));
        let state = dir.join("state");
        std::fs::create_dir_all(&state).map_err(io("cannot create the fault layer's folder"))?;
        let dir = std::fs::canonicalize(&dir).map_err(io("cannot create the fault layer's folder"))?;
        let (state, shim) = (dir.join("state"), dir.join("libtidemark_faultfs_preload.so"));
        std::fs::copy(preload, &shim).map_err(io("cannot copy --db-preload"))?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))
            .map_err(io("cannot create the fault layer's folder"))?;
        for path in [&dir, &state, &shim] {
            std::os::unix::fs::chown(path, Some(owner.uid()), Some(owner.gid()))
                .map_err(io("cannot give the fault layer's folder to the database's user"))?;
        }
        Ok(DbLayer { preload: preload.to_path_buf(), dir, shim, state })
    }
}

impl Drop for DbLayer {
    /// The folder goes when the run's settings do, however the run ended.
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The tenant's stores of a run: files in `data`, or schemas on `store`'s server.
fn tenant_data(data: &Path, store: Option<&PostgresStore>) -> TenantData {
    match store {
        Some(store) => TenantData::on_postgres(data, TENANT, &store.backend),
        None => TenantData::new(data, TENANT),
    }
}

/// The validated settings of a run.
struct Settings {
    seed: u64,
    duration_ms: u64,
    faults: usize,
    /// `--faults-only`: the schedule's faults injected (all when `None`).
    faults_only: Option<BTreeSet<usize>>,
    kinds: Vec<FaultKind>,
    durability: String,
    processes: usize,
    clients: usize,
    workers: usize,
    converge_timeout: Duration,
    /// The largest clock jump, in leases.
    clock_jump_leases_max: u64,
    out: PathBuf,
    store: Option<PostgresStore>,
    /// With `--store` and a remote server: its store, the same server under the prefix
    /// `<prefix>_r` ([`PostgresStore::remote`]).
    remote_store: Option<PostgresStore>,
    database: Option<Database>,
    broker: Option<Broker>,
    /// `--disk`: the small file system the data folder is on, which a `full` fills for real.
    disk: Option<PathBuf>,
}

impl Settings {
    /// The fault VFS's state folder, when the processes' own files are on it (power losses and
    /// I/O errors of SQLite: with --store, a power loss is the database's).
    fn faultfs(&self) -> Option<PathBuf> {
        (self.store.is_none() && [FaultKind::PowerLoss, FaultKind::IoError].iter().any(|k| self.kinds.contains(k)))
            .then(|| self.out.join("faultfs"))
    }

    /// The clock offset file of the process `name` (`serve-0`, `worker-1`), when the run jumps
    /// clocks.
    fn clock_file(&self, name: &str) -> Option<PathBuf> {
        schedule::jumps_clocks(&self.kinds).then(|| self.out.join("clocks").join(format!("{name}.offset_ms")))
    }

    /// The crash file of the process `name` (`tidemark_core::crash`), when the run arms crash
    /// points.
    fn crash_file(&self, name: &str) -> Option<PathBuf> {
        self.kinds.contains(&FaultKind::CrashPoint).then(|| self.out.join("crash").join(format!("{name}.point")))
    }
}

/// The broker a partitioned remote consumer is reached through (`--broker`).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Broker {
    /// NATS JetStream at `host:port`.
    Nats(String),
    /// RabbitMQ at `host:port`.
    Amqp(String),
    /// rdkafka's mock cluster, inside the harness process (no Kafka broker runs here).
    KafkaMock,
}

/// The remote source's messages per pull (the most a source takes): one source keeps up with
/// the relays of every server (with the default 100, one inbox commit per 100 events, it fell
/// behind them).
const SOURCE_BATCH: usize = 1_000;
/// `--broker` for rdkafka's mock cluster.
const KAFKA_MOCK: &str = "kafka-mock";
/// Kafka: the partitions of the run's topic. The mock broker keeps 5 MiB of each partition's log
/// in memory and trims the oldest records past that, as retention would: the remote source
/// must never lag by more than this many times 5 MiB, or the broker drops what it has not read
/// (its log says `Offset out of range`, and the checker finds the events `not_applied`).
const KAFKA_PARTITIONS: i32 = 16;
/// Kafka: the remote source's group session timeout (the mock broker's least): a killed remote
/// server's member holds its partitions this long.
const SOURCE_SESSION_TIMEOUT_MS: u64 = 6_000;
/// Kafka: how late the mock broker answers while a black hole or lost answers last (it stores
/// each produce at once): longer than the relays' attempt timeout, so the relay gives the
/// attempt up and publishes again.
const KAFKA_LATE_ANSWER: Duration = Duration::from_millis(2 * CLIENT_REQUEST_TIMEOUT.as_millis() as u64);

impl Broker {
    /// `nats://host:port` or `amqp://host:port` (a trailing `/` allowed; no user, path or query).
    fn parse(url: &str) -> Result<Broker> {
        let refuse = |why: &str| {
            invalid(format!(
                "--broker {url:?}: {why}; give nats://host:port (JetStream), amqp://host:port (RabbitMQ) or {KAFKA_MOCK}"
            ))
        };
        if url.len() > BROKER_URL_MAX {
            return Err(refuse(&format!("longer than {BROKER_URL_MAX} bytes")));
        }
        if url == KAFKA_MOCK {
            return Ok(Broker::KafkaMock);
        }
        let (broker, rest): (fn(String) -> Broker, &str) =
            match (url.strip_prefix("nats://"), url.strip_prefix("amqp://")) {
                (Some(rest), _) => (Broker::Nats, rest),
                (_, Some(rest)) => (Broker::Amqp, rest),
                _ => return Err(refuse("not a nats:// or amqp:// URL")),
            };
        let server = rest.strip_suffix('/').unwrap_or(rest);
        let port = server.rsplit_once(':').filter(|(host, _)| !host.is_empty()).map(|(_, port)| port.parse::<u16>());
        if server.contains(['/', '@', '?', '#', ' ']) || !matches!(port, Some(Ok(p)) if p > 0) {
            return Err(refuse("the broker is host:port, nothing else"));
        }
        Ok(broker(server.to_string()))
    }

    fn scheme(&self) -> &'static str {
        match self {
            Broker::Nats(_) => "nats",
            Broker::Amqp(_) => "amqp",
            Broker::KafkaMock => "kafka",
        }
    }

    fn url(&self) -> String {
        match self {
            Broker::Nats(server) | Broker::Amqp(server) => format!("{}://{server}", self.scheme()),
            Broker::KafkaMock => KAFKA_MOCK.to_string(),
        }
    }
}

fn validate(args: RunArgs, durability: &str) -> Result<Settings> {
    let seed = args.seed.ok_or_else(|| invalid("--seed N is required (the fault schedule derives from it)"))?;
    if !(2..=PROCESSES_MAX).contains(&args.processes) {
        return Err(invalid(format!("--processes must be 2..={PROCESSES_MAX}, got {}", args.processes)));
    }
    if args.faults > FAULTS_MAX {
        return Err(invalid(format!("--faults must be 0..={FAULTS_MAX}, got {}", args.faults)));
    }
    let faults_only = match &args.faults_only {
        None => None,
        Some(indices) => {
            let set: BTreeSet<usize> = indices.iter().copied().collect();
            if set.len() != indices.len() || set.iter().any(|index| *index >= args.faults) {
                return Err(invalid(format!(
                    "--faults-only takes distinct fault indices below --faults ({}), got {indices:?}",
                    args.faults
                )));
            }
            Some(set)
        }
    };
    if !(1..=DURATION_S_MAX).contains(&args.duration_s) {
        return Err(invalid(format!("--duration-s must be 1..={DURATION_S_MAX}, got {}", args.duration_s)));
    }
    if args.workers > WORKERS_MAX {
        return Err(invalid(format!("--workers must be 0..={WORKERS_MAX}, got {}", args.workers)));
    }
    if !(1..=CLIENTS_MAX).contains(&args.clients) {
        return Err(invalid(format!("--clients must be 1..={CLIENTS_MAX}, got {}", args.clients)));
    }
    let mut kinds = args.kinds;
    kinds.sort_by_key(|k| *k as u8);
    kinds.dedup();
    if kinds.is_empty() {
        return Err(invalid("--kinds names no kind of fault"));
    }
    if kinds.contains(&FaultKind::PowerLoss) && args.store.is_none() && !cfg!(feature = "failpoints") {
        return Err(invalid(
            "--kinds power-loss needs a build with the failpoints feature (cargo build --release -p tidemark-cli --features failpoints): the servers must run on the fault VFS",
        ));
    }
    if kinds.contains(&FaultKind::IoError) && args.store.is_none() && !cfg!(feature = "failpoints") {
        return Err(invalid(
            "--kinds io-error needs a build with the failpoints feature (cargo build --release -p tidemark-cli --features failpoints): the servers must run on the fault VFS",
        ));
    }
    if schedule::jumps_clocks(&kinds) && !cfg!(feature = "failpoints") {
        return Err(invalid(
            "--kinds clock-jump and clock-jump-kill need a build with the failpoints feature (cargo build --release -p tidemark-cli --features failpoints): the servers read their clock offset from a file",
        ));
    }
    if kinds.contains(&FaultKind::CrashPoint) && !cfg!(feature = "failpoints") {
        return Err(invalid(
            "--kinds crash-point needs a build with the failpoints feature (cargo build --release -p tidemark-cli --features failpoints): the processes read the crash point to stop at from a file",
        ));
    }
    if !["full", "normal"].contains(&durability) {
        return Err(invalid(format!("--durability must be full or normal, got {durability:?}")));
    }
    let store = args.store.as_deref().map(PostgresStore::parse).transpose()?;
    if store.is_some() {
        if schedule::jumps_clocks(&kinds) {
            return Err(invalid(
                "--kinds clock-jump (and clock-jump-kill) acts on the servers' clock files; with --store postgres://... \
                 combine sigkill, sigstop, partition, remote-kill, db-crash, power-loss and io-error",
            ));
        }
        if durability != "full" {
            return Err(invalid(
                "--durability normal applies to SQLite files; PostgreSQL commits with the server's own durability",
            ));
        }
    }
    // With --store, power losses and I/O errors are the database machine's (its disk).
    let database_disk_faults =
        store.is_some() && [FaultKind::PowerLoss, FaultKind::IoError].iter().any(|k| kinds.contains(k));
    match (kinds.contains(&FaultKind::DbCrash) || database_disk_faults, &store, &args.db_data) {
        (true, Some(_), Some(_)) | (false, _, None) => {}
        (true, _, _) => {
            return Err(invalid(
                "--kinds db-crash (and power-loss or io-error with --store) act on the PostgreSQL server of --store: \
             give --store postgres://... and --db-data DIR",
            ))
        }
        (false, _, Some(_)) => {
            return Err(invalid(
                "--db-data is the database --kinds db-crash (or power-loss or io-error with --store) faults",
            ))
        }
    }
    match (database_disk_faults, &args.db_preload) {
        (true, None) => {
            return Err(invalid(
                "--kinds power-loss or io-error with --store is the database machine's: give --db-data DIR and \
                 --db-preload LIB (the fault shim, cargo build -p tidemark-faultfs-preload)",
            ))
        }
        (false, Some(_)) => {
            return Err(invalid("--db-preload is for --kinds power-loss or io-error with --store postgres://..."))
        }
        _ => {}
    }
    let broker = args.broker.as_deref().map(Broker::parse).transpose()?;
    let disk = args.disk.as_deref().map(|disk| check_disk(disk, args.store.is_some())).transpose()?;
    if broker.is_some() && ![FaultKind::Partition, FaultKind::RemoteKill].iter().any(|k| kinds.contains(k)) {
        return Err(invalid(
            "--broker is the broker the remote consumer is reached through: add partition or remote-kill to --kinds",
        ));
    }
    if !(1..=schedule::CLOCK_JUMP_LEASES_LIMIT).contains(&args.clock_jump_leases_max) {
        return Err(invalid(format!("--clock-jump-leases-max must be 1..={}", schedule::CLOCK_JUMP_LEASES_LIMIT)));
    }
    if !(1..=CONVERGE_TIMEOUT_S_MAX).contains(&args.converge_timeout_s) {
        return Err(invalid(format!("--converge-timeout-s must be 1..={CONVERGE_TIMEOUT_S_MAX}")));
    }
    let remote_store = match &store {
        Some(store) if has_remote(&kinds) => Some(store.remote()?),
        _ => None,
    };
    let out = args.out.unwrap_or_else(|| PathBuf::from(format!("tidemark-chaos-{seed}")));
    if out.exists() && std::fs::read_dir(&out).map_err(io("cannot read --out"))?.next().is_some() {
        return Err(Error::invalid(
            codes::ALREADY_EXISTS,
            format!("{} is not empty: a chaos run starts from an empty folder", out.display()),
        ));
    }
    if let Some(store) = &store {
        store.ensure_empty()?;
    }
    let database = match (&store, &args.db_data) {
        (Some(store), Some(data)) => Some(Database::locate(data, store, &out, args.db_preload.as_deref(), seed)?),
        _ => None,
    };
    Ok(Settings {
        seed,
        duration_ms: args.duration_s * 1_000,
        faults: args.faults,
        faults_only,
        kinds,
        durability: durability.to_string(),
        processes: args.processes,
        clients: args.clients,
        workers: args.workers,
        converge_timeout: Duration::from_secs(args.converge_timeout_s),
        clock_jump_leases_max: args.clock_jump_leases_max,
        out,
        store,
        remote_store,
        database,
        broker,
        disk,
    })
}

/// Longest free space of a `--disk` (a full fault writes all of it).
const DISK_FREE_MAX: u64 = 4 << 30;

/// A `--disk`: a folder, not with `--store`, on a file system with at most [`DISK_FREE_MAX`]
/// free (`invalid_argument` otherwise); canonical.
fn check_disk(disk: &Path, on_postgres: bool) -> Result<PathBuf> {
    if on_postgres {
        return Err(invalid(
            "--disk holds the servers' data folder: not with --store (whose disk full is --db-preload's)",
        ));
    }
    let disk = std::fs::canonicalize(disk)
        .ok()
        .filter(|d| d.is_dir())
        .ok_or_else(|| invalid(format!("--disk {} is not a folder", disk.display())))?;
    let free = free_bytes(&disk)?;
    if free > DISK_FREE_MAX {
        return Err(invalid(format!(
            "--disk {} has {free} bytes free: a full disk fills all of it, so give a small file system of its own \
             (at most {DISK_FREE_MAX} bytes free, e.g. mount -t tmpfs -o size=256m tmpfs DIR)",
            disk.display()
        )));
    }
    Ok(disk)
}

/// The bytes free to an unprivileged writer on the file system of `path` (`statvfs`).
fn free_bytes(path: &Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let name = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| invalid("a path with a NUL byte"))?;
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `name` is a NUL-terminated path and `stat` a statvfs the call fills.
    if unsafe { libc::statvfs(name.as_ptr(), &mut stat) } != 0 {
        return Err(Error::io(format!("statvfs {}: {}", path.display(), std::io::Error::last_os_error())));
    }
    Ok(stat.f_bavail as u64 * stat.f_frsize as u64)
}

/// Fill the file system of `disk` for `hold`: a ballast file written with zeros until `ENOSPC`
/// (in 1 MiB, then 4 KiB pieces), held, then removed. Answers the bytes it took.
fn fill_disk(disk: &Path, hold: Duration) -> Result<u64> {
    use std::io::Write;
    let ballast = disk.join(format!("tidemark-chaos-ballast-{}", std::process::id()));
    let mut file = std::fs::File::create(&ballast).map_err(io("cannot create the ballast file"))?;
    let mut taken = 0_u64;
    for piece in [1 << 20, 4 << 10] {
        let zeros = vec![0_u8; piece];
        loop {
            match file.write(&zeros) {
                Ok(0) => break,
                Ok(n) => taken += n as u64,
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
                Err(e) => {
                    let _ = std::fs::remove_file(&ballast);
                    return Err(Error::io(format!("cannot fill {}: {e}", disk.display())));
                }
            }
        }
    }
    std::thread::sleep(hold);
    drop(file);
    std::fs::remove_file(&ballast).map_err(io("cannot remove the ballast file"))?;
    Ok(taken)
}

/// Restarts the database without the fault layer when the run ends, however it ends.
struct LayerGuard<'a>(&'a Database);

impl Drop for LayerGuard<'_> {
    fn drop(&mut self) {
        self.0.leave_layer();
    }
}

/// One `tidemark serve` child process on a fixed loopback address (chosen by the OS at its
/// first start, kept across restarts so that clients find it again).
struct Serve {
    index: usize,
    exe: PathBuf,
    data: PathBuf,
    log: PathBuf,
    durability: String,
    /// The fault VFS's state folder when the run injects power losses.
    faultfs: Option<PathBuf>,
    /// The run's seed (power losses draw what reached the disk from it; read only in failpoints
    /// builds, the only ones that inject them).
    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    seed: u64,
    /// The file its wall-clock offset is read from, when the run jumps clocks.
    clock_file: Option<PathBuf>,
    /// The file it reads the crash point to stop at from, when the run arms crash points.
    crash_file: Option<PathBuf>,
    /// Its configuration file (the relay's settings and token for the remote consumer), when
    /// the run partitions the network.
    config: Option<PathBuf>,
    /// Its `--store`, when it serves on PostgreSQL.
    store: Option<String>,
    addr: String,
    process: Proc,
}

impl Serve {
    fn new(index: usize, exe: &Path, settings: &Settings) -> Serve {
        let out = &settings.out;
        Serve {
            index,
            exe: exe.to_path_buf(),
            data: out.join("data"),
            log: out.join("logs").join(format!("serve-{index}.log")),
            config: has_remote(&settings.kinds).then(|| out.join("serve.toml")),
            store: settings.store.as_ref().map(|store| store.url.clone()),
            durability: settings.durability.clone(),
            faultfs: settings.faultfs(),
            seed: settings.seed,
            clock_file: settings.clock_file(&format!("serve-{index}")),
            crash_file: settings.crash_file(&format!("serve-{index}")),
            addr: "127.0.0.1:0".into(),
            process: Proc::default(),
        }
    }

    /// The remote consumer's server: its own data folder, log and configuration (a source, when
    /// it consumes from a broker), no faults of its own.
    fn remote(exe: &Path, settings: &Settings, config: Option<PathBuf>) -> Serve {
        let out = &settings.out;
        Serve {
            index: settings.processes,
            exe: exe.to_path_buf(),
            data: out.join("remote"),
            log: out.join("logs").join("remote.log"),
            config,
            store: settings.remote_store.as_ref().map(|store| store.url.clone()),
            durability: settings.durability.clone(),
            faultfs: None,
            seed: settings.seed,
            clock_file: None,
            crash_file: None,
            addr: "127.0.0.1:0".into(),
            process: Proc::default(),
        }
    }

    fn base(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Start (or restart) the process and wait for its listening line (bounded).
    fn start(&mut self) -> Result<()> {
        let mut last_error = String::new();
        for _ in 0..START_ATTEMPTS_MAX {
            match self.try_start() {
                Ok(()) => return Ok(()),
                Err(e) => last_error = e.to_string(),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(Error::io(format!("process {} did not start on {}: {last_error}", self.index, self.addr)))
    }

    fn try_start(&mut self) -> Result<()> {
        let log =
            std::fs::OpenOptions::new().create(true).append(true).open(&self.log).map_err(io("cannot open a log"))?;
        let mut command =
            process_command(&self.exe, self.faultfs.as_deref(), self.clock_file.as_deref(), self.crash_file.as_deref());
        command.arg("serve");
        if let Some(config) = &self.config {
            command.arg("--config").arg(config);
        }
        if let Some(store) = &self.store {
            command.args(["--store", store]);
        }
        let mut child = command
            .arg("--data")
            .arg(&self.data)
            .args(["--listen", &self.addr])
            .env_remove("TIDEMARK_CRASH_AT")
            .env_remove("TIDEMARK_SERVER")
            .env_remove("TIDEMARK_TOKEN")
            .env("TIDEMARK_AUTH__MODE", "none")
            .env("TIDEMARK_AUTH__DEV_TENANT", TENANT)
            .env("TIDEMARK_LOG__LEVEL", "warn")
            .env("TIDEMARK_DURABILITY", &self.durability)
            .env("TIDEMARK_WORKERS__LEASE_MS", LEASE_MS.to_string())
            .env("TIDEMARK_WORKERS__RETRY_DELAY_MS", RETRY_DELAY_MS.to_string())
            .env("TIDEMARK_WORKERS__MAX_ATTEMPTS", MAX_ATTEMPTS.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()
            .map_err(io("cannot start tidemark serve"))?;
        let stdout = child.stdout.take().ok_or_else(|| Error::io("no stdout"))?;
        let (sender, receiver) = std::sync::mpsc::channel::<String>();
        // The first line is the listening line; the rest (the stop report) is read and dropped so
        // that the pipe never fills.
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(line)) = lines.next() {
                let _ = sender.send(line);
            }
            for _ in lines {}
        });
        let line = match receiver.recv_timeout(START_TIMEOUT) {
            Ok(line) => line,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::io("no listening line (see its log)"));
            }
        };
        let first: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
        let Some(addr) = first["addr"].as_str().filter(|_| first["outcome"] == "listening") else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(Error::io(format!("unexpected first line {line:?}")));
        };
        self.addr = addr.to_string();
        self.process = Proc { child: Some(child), stopped: false };
        Ok(())
    }

    fn sigkill(&mut self) {
        self.process.sigkill();
    }

    /// The running process's id.
    fn pid(&self) -> Option<u32> {
        self.process.child.as_ref().map(Child::id)
    }

    fn sigstop(&mut self) -> Result<()> {
        self.process.sigstop()
    }

    fn sigcont(&mut self) -> Result<()> {
        self.process.sigcont()
    }

    /// A graceful stop; returns what was wrong with it, naming the server and its log.
    fn terminate(&mut self) -> Result<Option<String>> {
        let unclean = self.process.terminate()?;
        Ok(unclean.map(|why| format!("server {}: {why} (log {})", self.index, self.log.display())))
    }
}

/// The harness's servers and workers die with it: a harness killed by a signal (or by a test's
/// timeout) leaves no `tidemark serve` behind on its ports and files. Linux sends the signal when
/// the thread that started the child ends; every child is started on the harness's main thread,
/// which lives until the run's end.
/// A command for a tidemark process of the run: it dies with the harness, and runs on the fault
/// VFS (`faultfs`, its state folder), reads its wall-clock offset from `clock_file` and the crash
/// point to stop at from `crash_file` when the run has them (their variables removed otherwise).
fn process_command(
    exe: &Path,
    faultfs: Option<&Path>,
    clock_file: Option<&Path>,
    crash_file: Option<&Path>,
) -> Command {
    let mut command = Command::new(exe);
    die_with_the_harness(&mut command);
    match faultfs {
        Some(state) => command.env(faultfs_env(), state),
        None => command.env_remove(faultfs_env()),
    };
    match clock_file {
        Some(file) => command.env(clock_env(), file),
        None => command.env_remove(clock_env()),
    };
    match crash_file {
        Some(file) => command.env(tidemark_core::crash::CRASH_FILE_ENV, file),
        None => command.env_remove(tidemark_core::crash::CRASH_FILE_ENV),
    };
    command
}

fn die_with_the_harness(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    let harness = std::process::id() as libc::pid_t;
    // SAFETY: between fork and exec the closure calls only async-signal-safe functions (prctl,
    // getppid) and allocates nothing.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The harness may have died between the fork and the prctl.
            if libc::getppid() != harness {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

/// A child process the harness signals: killed, paused, resumed, stopped gracefully.
#[derive(Default)]
struct Proc {
    child: Option<Child>,
    stopped: bool,
}

impl Proc {
    fn signal(&self, signal: &str) -> Result<()> {
        let Some(child) = &self.child else { return Ok(()) };
        let status =
            Command::new("kill").args([signal, &child.id().to_string()]).status().map_err(io("cannot run kill"))?;
        if !status.success() {
            return Err(Error::io(format!("kill {signal} {} failed", child.id())));
        }
        Ok(())
    }

    fn sigkill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.stopped = false;
    }

    /// Arm crash point `point` in the process's crash file and wait (at most
    /// [`CRASH_POINT_WAIT`]) until the process exits there; killed when it reaches none in that
    /// time. The file is emptied either way, before the process is started again. Returns the
    /// fault's record: the point, whether it was reached, the exit code.
    fn stop_at_crash_point(&mut self, crash_file: Option<&PathBuf>, point: &str) -> Result<Value> {
        let file = crash_file.ok_or_else(|| invalid("a crash point needs --kinds crash-point"))?;
        std::fs::create_dir_all(file.parent().unwrap_or(Path::new("."))).map_err(io("cannot create crash/"))?;
        std::fs::write(file, point).map_err(io("cannot arm a crash point"))?;
        let deadline = Instant::now() + CRASH_POINT_WAIT;
        let mut status = None;
        while let Some(child) = self.child.as_mut() {
            status = child.try_wait().map_err(io("cannot wait for a process"))?;
            if status.is_some() || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        std::fs::write(file, b"").map_err(io("cannot disarm a crash point"))?;
        let reached = status.and_then(|s| s.code()) == Some(tidemark_core::crash::exit_code(point));
        match status {
            Some(_) => {
                self.child = None;
                self.stopped = false;
            }
            None => self.sigkill(),
        }
        use std::os::unix::process::ExitStatusExt;
        Ok(json!({
            "point": point, "reached": reached, "exited": status.is_some(),
            "exit_code": status.and_then(|s| s.code()), "signal": status.and_then(|s| s.signal()),
        }))
    }

    fn sigstop(&mut self) -> Result<()> {
        self.signal("-STOP")?;
        self.stopped = true;
        Ok(())
    }

    fn sigcont(&mut self) -> Result<()> {
        self.signal("-CONT")?;
        self.stopped = false;
        Ok(())
    }

    /// A graceful stop (SIGCONT first if paused), bounded; killed when it takes too long.
    /// Returns what was wrong with the stop, if anything: an exit status other than 0 (a panic
    /// on the way out is 101), or no exit within [`STOP_TIMEOUT`].
    fn terminate(&mut self) -> Result<Option<String>> {
        if self.stopped {
            self.sigcont()?;
        }
        if self.signal("-TERM").is_err() {
            self.sigkill();
            return Ok(None);
        }
        let Some(mut child) = self.child.take() else { return Ok(None) };
        let began = Instant::now();
        while began.elapsed() < STOP_TIMEOUT {
            if let Some(status) = child.try_wait().map_err(io("cannot wait for a process"))? {
                return Ok((!status.success()).then(|| format!("{status} after SIGTERM")));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        Ok(Some(format!("no exit within {} s of SIGTERM (killed)", STOP_TIMEOUT.as_secs())))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.stopped {
            let _ = self.sigcont();
        }
        self.sigkill();
    }
}

/// A `tidemark worker` process on the tenant's workflow database and payment log, beside the
/// servers (`--workers`): it shares their runs under the same leases and fences.
struct WorkerProcess {
    index: usize,
    exe: PathBuf,
    data: PathBuf,
    /// The tenant's workflow schema as a `--store` URL, when the servers are on PostgreSQL.
    store: Option<String>,
    log: PathBuf,
    durability: String,
    /// The fault VFS's state folder, its clock offset file and its crash file, as the servers'.
    faultfs: Option<PathBuf>,
    clock_file: Option<PathBuf>,
    crash_file: Option<PathBuf>,
    process: Proc,
    /// When its current process was started.
    started: Option<Instant>,
}

/// How long after its start a worker process is given before the harness's SIGTERM: a signal
/// that arrives before the process has installed its handlers (in its first milliseconds, while
/// it loads) kills it by the signal's default action, which the harness would count as an
/// unclean stop. `tidemark worker` installs them before it opens its store.
const WORKER_SIGNAL_READY: Duration = Duration::from_millis(500);

impl WorkerProcess {
    /// SIGTERM (once the process had [`WORKER_SIGNAL_READY`] to install its handlers), as
    /// [`Proc::terminate`].
    fn terminate(&mut self) -> Result<Option<String>> {
        if let Some(wait) = self.started.and_then(|at| WORKER_SIGNAL_READY.checked_sub(at.elapsed())) {
            std::thread::sleep(wait);
        }
        self.process.terminate()
    }

    fn reports_path(&self) -> PathBuf {
        self.log.with_extension("reports.json")
    }

    /// Where each start's report goes (the report a graceful stop prints; a killed process
    /// prints none), appended.
    fn reports(&self) -> Result<std::fs::File> {
        std::fs::OpenOptions::new().create(true).append(true).open(self.reports_path()).map_err(io("cannot open a log"))
    }

    /// Runs claimed by this worker's processes that stopped gracefully (a killed one's claims
    /// are not counted: it printed no report).
    fn claimed(&self) -> u64 {
        let text = std::fs::read_to_string(self.reports_path()).unwrap_or_default();
        serde_json::Deserializer::from_str(&text)
            .into_iter::<Value>()
            .filter_map(|report| report.ok()?["claimed"].as_u64())
            .sum()
    }

    fn start(&mut self) -> Result<()> {
        let tenant = self.data.join("tenants").join(TENANT);
        let log =
            std::fs::OpenOptions::new().create(true).append(true).open(&self.log).map_err(io("cannot open a log"))?;
        let mut command =
            process_command(&self.exe, self.faultfs.as_deref(), self.clock_file.as_deref(), self.crash_file.as_deref());
        command.args(["--durability", &self.durability, "worker", "--db"]);
        match &self.store {
            Some(store) => command.arg(store),
            None => command.arg(tenant.join("workflows.db")),
        };
        let child = command
            .arg("--payments-db")
            .arg(tenant.join("payments.db"))
            .args(["--worker-id", &format!("chaos-worker-{}", self.index)])
            .args(["--lease-ms", &LEASE_MS.to_string(), "--poll-ms", "50"])
            .args(["--retry-delay-ms", &RETRY_DELAY_MS.to_string(), "--max-attempts", &MAX_ATTEMPTS.to_string()])
            .args(["--max-seconds", &DURATION_S_MAX.to_string()])
            .env_remove("TIDEMARK_CRASH_AT")
            .stdin(Stdio::null())
            .stdout(Stdio::from(self.reports()?))
            .stderr(Stdio::from(log))
            .spawn()
            .map_err(io("cannot start tidemark worker"))?;
        self.process = Proc { child: Some(child), stopped: false };
        self.started = Some(Instant::now());
        Ok(())
    }
}

/// The fault VFS's control file of an I/O error mode (named here also in builds without it,
/// which refuse `--kinds io-error` before any fault).
fn io_error_control(mode: IoErrorMode) -> &'static str {
    match mode {
        IoErrorMode::Full => "full",
        IoErrorMode::EioWrite => "eio-write",
        IoErrorMode::EioFsync => "eio-fsync",
    }
}

/// The fault VFS's control file of an I/O error mode for process `pid` only.
fn io_error_process_control(mode: IoErrorMode, pid: u32) -> String {
    format!("{}.{pid}", io_error_control(mode))
}

/// The fault VFS's environment variable (named here also in builds without it, so that a
/// harness run never passes one of its own on to the servers by accident).
fn faultfs_env() -> &'static str {
    "TIDEMARK_FAULTFS"
}

/// The clock offset file's environment variable (`tidemark_core::clock::OFFSET_FILE_ENV`).
fn clock_env() -> &'static str {
    tidemark_core::clock::OFFSET_FILE_ENV
}

/// Step a process's wall clock by `offset_ms` from the system clock (0: back to it), in its
/// clock offset file (`None`: the run jumps no clocks). The process reads the file again within
/// `OFFSET_REREAD_MS`.
fn set_clock_offset(clock_file: Option<&PathBuf>, offset_ms: i64) -> Result<()> {
    let file = clock_file.ok_or_else(|| invalid("a clock jump needs --kinds clock-jump"))?;
    std::fs::create_dir_all(file.parent().unwrap_or(Path::new("."))).map_err(io("cannot create clocks/"))?;
    std::fs::write(file, offset_ms.to_string()).map_err(io("cannot write a clock offset"))
}

/// A kill during a clock jump of `hold_ms`: the time from the jump to the kill (half the hold)
/// and from the restart to the end of the jump (what is left after the process was down).
fn kill_within_jump(hold_ms: u64) -> (Duration, Duration) {
    let before = Duration::from_millis(hold_ms / 2);
    (before, Duration::from_millis(hold_ms).saturating_sub(before + CLOCK_JUMP_KILL_DOWN))
}

/// Faults whose process is back and has not acknowledged an operation yet, and the recovery
/// times measured so far: the time from the restart's listening line (or the SIGCONT) to the
/// first 2xx answer of that process.
#[derive(Default)]
struct Recovery {
    waiting: BTreeMap<usize, (usize, Instant)>,
    measured_ms: Vec<f64>,
    unobserved: u64,
    /// After each healed partition, the time until the remote inbox held a new record.
    delivery_resumed_ms: Vec<f64>,
    /// Partitions after which nothing new reached the remote inbox within the harness's wait.
    delivery_not_resumed: u64,
}

impl Recovery {
    fn back(&mut self, process: usize, fault: usize) {
        if self.waiting.insert(process, (fault, Instant::now())).is_some() {
            self.unobserved += 1;
        }
    }

    /// After a heal or the remote server's restart: when delivery resumed, or that it did not
    /// within the harness's wait.
    fn delivery_resumed(&mut self, resumed: Option<f64>) {
        match resumed {
            Some(ms) => self.delivery_resumed_ms.push(ms),
            None => self.delivery_not_resumed += 1,
        }
    }

    fn acknowledged(&mut self, process: usize) {
        if let Some((_, back_at)) = self.waiting.remove(&process) {
            self.measured_ms.push(back_at.elapsed().as_secs_f64() * 1_000.0);
        }
    }
}

struct Shared {
    bases: Vec<String>,
    seed: u64,
    stop: AtomicBool,
    started: Instant,
    recovery: Mutex<Recovery>,
}

impl Shared {
    /// Milliseconds since the workload started.
    fn at_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }
}

/// What one client did.
#[derive(Default)]
struct ClientStats {
    requests: u64,
    by_status: BTreeMap<u16, u64>,
    connection_errors: u64,
    advances: u64,
    starts: u64,
    batches: u64,
    waiters: u64,
    /// Cancels answered 2xx, and those not answered (or answered 5xx: they may have committed).
    cancels: u64,
    cancels_unanswered: u64,
    /// Of the advances, the appends to event streams.
    appends: u64,
    /// Blocked poison records the inbox operator skipped (during the workload, and during the
    /// wait for convergence).
    poison_skipped: u64,
    /// Quarantined deliveries the outbox operator requeued, and its redeliveries from a
    /// subscriber's first quarantined event (during the workload and the wait for convergence).
    quarantines_requeued: u64,
    quarantines_redelivered: u64,
    /// Quarantined deliveries the outbox operator dismissed (answered 200), during the workload.
    quarantines_dismissed: u64,
    /// Operator controls known to have committed, and those that may have.
    controls: u64,
    controls_unanswered: u64,
    unexpected: u64,
    last_unexpected: Option<String>,
}

impl ClientStats {
    /// Add what another client (or an operator task) did.
    fn merge(&mut self, one: ClientStats) {
        self.requests += one.requests;
        for (status, n) in one.by_status {
            *self.by_status.entry(status).or_default() += n;
        }
        self.connection_errors += one.connection_errors;
        self.advances += one.advances;
        self.appends += one.appends;
        self.poison_skipped += one.poison_skipped;
        self.quarantines_requeued += one.quarantines_requeued;
        self.quarantines_redelivered += one.quarantines_redelivered;
        self.quarantines_dismissed += one.quarantines_dismissed;
        self.starts += one.starts;
        self.batches += one.batches;
        self.waiters += one.waiters;
        self.cancels += one.cancels;
        self.cancels_unanswered += one.cancels_unanswered;
        self.controls += one.controls;
        self.controls_unanswered += one.controls_unanswered;
        self.unexpected += one.unexpected;
        if one.last_unexpected.is_some() {
            self.last_unexpected = one.last_unexpected;
        }
    }
}

/// A reservation flow a client owns: it always knows the expected seq. One in four is an event
/// stream instead, whose appends carry the same reservation events; one in [`POISON_ONE_IN`] a
/// stream of one poison event.
struct OwnedFlow {
    flow_id: String,
    seq: i64,
    quantity: i64,
    stream: bool,
    poison: bool,
}

/// Turns a 2xx answer (and its time, ms after the start) into what it acknowledged, if it did.
type Acknowledge = Box<dyn Fn(&Value, u64) -> Option<Acknowledged> + Send>;

async fn client(
    index: usize,
    http: reqwest::Client,
    shared: Arc<Shared>,
    ledger: tokio::sync::mpsc::UnboundedSender<Acknowledged>,
    mut rng: StdRng,
) -> ClientStats {
    let mut stats = ClientStats::default();
    let (mut runs, mut flows) = (0_u64, 0_u64);
    let mut flow: Option<OwnedFlow> = None;
    let mut operators = Vec::new();
    // The client's forks so far: its first starts from the reservation.
    let mut forks = 0;
    while !shared.stop.load(Ordering::Relaxed) {
        let process = rng.gen_range(0..shared.bases.len());
        let start = rng.gen_range(0..3) == 0;
        // What a 2xx answer acknowledges, given the answer.
        let (path, body, pending): (String, Value, Acknowledge) = if start {
            runs += 1;
            let run_id = format!("c{}-r{index}-{runs}", shared.seed);
            // One start in four is a batch of 2..=4 orders run as children, half of the batches
            // of three or four two orders per run (continued as new once).
            let entry = if rng.gen_range(0..4) == 0 {
                let count = rng.gen_range(2..=4);
                let orders: Vec<(Value, BatchOrder)> =
                    (1..=count).map(|i| order(&mut rng, format!("{run_id}-o{i}"))).collect();
                let per_run = (count > 2 && rng.gen_bool(0.5)).then_some(2);
                let (inputs, orders): (Vec<Value>, Vec<BatchOrder>) = orders.into_iter().unzip();
                let mut input = json!({"orders": inputs});
                if let Some(n) = per_run {
                    input["per_run"] = json!(n);
                }
                // Half of the batches tell a waiting run when they are done (`ctx.send`): the
                // waiter is started first, and named only once its start is acknowledged. Both
                // starts are sent again until answered (the same run id: `existing` if the
                // first committed), since a waiter that no batch tells waits out its timeout.
                if rng.gen_bool(0.5) {
                    let waiter = format!("{run_id}-w");
                    let (body, entry) = waiter_start(&mut rng, waiter.clone());
                    let start = StartSender { http: &http, shared: &shared, ledger: &ledger };
                    if start.until_answered(&mut stats, process, &body, entry).await {
                        input["notify"] = json!(waiter);
                        let body = json!({"workflow": ORDER_BATCH, "run_id": run_id, "input": input});
                        let notify = Some(waiter);
                        let entry = Acknowledged::Batch { run_id, per_run, orders, notify, process, at_ms: 0 };
                        start.until_answered(&mut stats, process, &body, entry).await;
                        continue;
                    }
                }
                let body = json!({"workflow": ORDER_BATCH, "run_id": run_id, "input": input});
                (body, Acknowledged::Batch { run_id, per_run, orders, notify: None, process, at_ms: 0 })
            } else if rng.gen_range(0..OPERATED_ONE_IN) == 0 {
                operated_start(&mut rng, run_id, process)
            } else {
                let (input, order) = order(&mut rng, run_id.clone());
                let mut body = json!({"workflow": ORDER_SAGA, "run_id": run_id, "input": input});
                // One order saga in four goes through the queue, at a priority of 0..=2.
                let queue = (rng.gen_range(0..4) == 0).then(|| QUEUE.to_string());
                if queue.is_some() {
                    body["queue"] = json!({"queue": QUEUE, "priority": rng.gen_range(0..3)});
                }
                let BatchOrder { fail, expect, quantity, .. } = order;
                (body, Acknowledged::Start { run_id, fail, expect, quantity, queue, process, at_ms: 0 })
            };
            let (body, entry) = entry;
            ("/v1/runs".into(), body, Box::new(move |_: &Value, at_ms: u64| Some(with_time(entry.clone(), at_ms))))
        } else {
            let owned = flow.get_or_insert_with(|| {
                flows += 1;
                let poison = rng.gen_range(0..POISON_ONE_IN) == 0;
                let stream = poison || rng.gen_range(0..4) == 0;
                let kind = if poison {
                    "p"
                } else if stream {
                    "s"
                } else {
                    "f"
                };
                OwnedFlow {
                    flow_id: format!("c{}-{kind}{index}-{flows}", shared.seed),
                    seq: 0,
                    quantity: rng.gen_range(1..=5),
                    stream,
                    poison,
                }
            });
            let state = if owned.poison { "poison" } else { FLOW_STATES[owned.seq as usize] };
            let (flow_id, stream) = (owned.flow_id.clone(), owned.stream);
            let quantity = if owned.poison { 0 } else { owned.quantity };
            let (path, body) = if owned.poison {
                let body = json!({"event_type": POISON_EVENT_TYPE, "payload": {"note": "chaos"}, "expected_seq": 0});
                (format!("/v1/streams/{flow_id}/events"), body)
            } else if stream {
                // The event an advance to `state` commits, appended to a plain stream: half of
                // the appends name the seq they follow, the others go at whatever seq is next
                // (the answer says which; the client alone writes the stream).
                let mut body = json!({"event_type": event_type_for(state), "payload": {"amount": quantity}});
                if rng.gen_bool(0.5) {
                    body["expected_seq"] = json!(owned.seq);
                }
                (format!("/v1/streams/{flow_id}/events"), body)
            } else {
                let body = json!({"expected_seq": owned.seq, "to": state, "quantity": quantity});
                (format!("/v1/flows/{flow_id}/advance"), body)
            };
            let accept = move |answer: &Value, at_ms: u64| -> Option<Acknowledged> {
                if answer["outcome"] != "committed" || answer["flow_id"] != flow_id.as_str() {
                    return None;
                }
                Some(Acknowledged::Advance {
                    flow_id: flow_id.clone(),
                    seq: answer["seq"].as_i64()?,
                    event_id: answer["event_id"].as_str()?.to_string(),
                    state: state.into(),
                    quantity,
                    stream,
                    process,
                    at_ms,
                })
            };
            (path, body, Box::new(accept))
        };
        let Some((status, answer)) = post(&http, &shared, &mut stats, process, &path, &body, &[]).await else {
            // No answer: whether it committed is unknown, so the flow is given up.
            flow = None;
            tokio::time::sleep(RETRY_PAUSE).await;
            continue;
        };
        let acknowledged = if (200..300).contains(&status) { pending(&answer, shared.at_ms()) } else { None };
        match acknowledged {
            Some(entry) => {
                shared.recovery.lock().unwrap_or_else(|p| p.into_inner()).acknowledged(process);
                // One start alone in eight is cancelled a moment later (the run is often in its
                // first steps or asleep on its timer then).
                let cancel = match &entry {
                    Acknowledged::Start { run_id, .. } if rng.gen_range(0..8) == 0 => Some(run_id.clone()),
                    _ => None,
                };
                if let Acknowledged::Operated { run_id, .. } = &entry {
                    let operator = Operator { http: http.clone(), shared: shared.clone(), ledger: ledger.clone() };
                    let action = OPERATOR_TURNS[(index * 5 + operators.len()) % OPERATOR_TURNS.len()];
                    let rng = StdRng::seed_from_u64(rng.gen());
                    let from_reservation = action == "fork" && forks == 0;
                    forks += usize::from(action == "fork");
                    operators.push(tokio::spawn(operator.operate(run_id.clone(), action, from_reservation, rng)));
                }
                match &entry {
                    Acknowledged::Start { .. } | Acknowledged::Operated { .. } => stats.starts += 1,
                    Acknowledged::Batch { .. } => stats.batches += 1,
                    Acknowledged::Waiter { .. }
                    | Acknowledged::Cancel { .. }
                    | Acknowledged::Control { .. }
                    | Acknowledged::Dismiss { .. } => {}
                    Acknowledged::Advance { stream, .. } => {
                        stats.advances += 1;
                        stats.appends += u64::from(*stream);
                        if let Some(owned) = flow.as_mut() {
                            owned.seq += 1;
                            if owned.poison || owned.seq as usize == FLOW_STATES.len() {
                                flow = None;
                            }
                        }
                    }
                }
                // The writer lives until every client is done.
                let _ = ledger.send(entry);
                if let Some(run_id) = cancel {
                    tokio::time::sleep(Duration::from_millis(rng.gen_range(0..=CANCEL_DELAY_MS_MAX))).await;
                    let process = rng.gen_range(0..shared.bases.len());
                    let path = format!("/v1/runs/{run_id}/cancel");
                    let body = json!({"reason": "chaos: cancelled by its client"});
                    // A 2xx is acknowledged; no answer or a 5xx may have committed: both
                    // written. A 409 (the run had ended) cancels nothing, nor does another 4xx
                    // (counted as unexpected by `post`): not written.
                    let status = post(&http, &shared, &mut stats, process, &path, &body, &[409]).await.map(|(s, _)| s);
                    let write = match status {
                        Some(200..=299) => {
                            stats.cancels += 1;
                            true
                        }
                        Some(400..=499) => false,
                        _ => {
                            stats.cancels_unanswered += 1;
                            true
                        }
                    };
                    if write {
                        let _ = ledger.send(Acknowledged::Cancel { run_id, status, process, at_ms: shared.at_ms() });
                    }
                }
            }
            None => {
                // A 5xx (a busy or stopping server) may have committed; a 4xx was counted as
                // unexpected by `post`, and so is a 2xx that acknowledges nothing.
                if (200..300).contains(&status) {
                    stats.unexpected += 1;
                    let text: String = answer.to_string().chars().take(300).collect();
                    stats.last_unexpected = Some(format!("{status} {path}: {text}"));
                }
                if !start {
                    flow = None;
                }
                tokio::time::sleep(RETRY_PAUSE).await;
            }
        }
    }
    // An operator that waits for its run to fail gives up once the workload stops; one that
    // is sending its control sends it until a server answers.
    for operator in operators {
        match operator.await {
            Ok(one) => stats.merge(one),
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    }
    stats
}

/// An operator of operated orders: what one needs to read a run, send it a control and write
/// the control to the ledger.
struct Operator {
    http: reqwest::Client,
    shared: Arc<Shared>,
    ledger: tokio::sync::mpsc::UnboundedSender<Acknowledged>,
}

impl Operator {
    /// Control the operated order `run_id` as an operator would: `retry`, `skip` its charge or
    /// `fork` it (from the reservation when `from_reservation`, a client's first fork; else from
    /// its charge, the hold or the reservation, at random) once it failed, or
    /// `abandon` it a moment after its start, while
    /// it runs (the process and the moment from `rng`). Nothing is sent when the run ends
    /// otherwise first (a crash spared it an attempt and it completed) or the workload stops
    /// before it failed.
    async fn operate(
        self,
        run_id: String,
        action: &'static str,
        from_reservation: bool,
        mut rng: StdRng,
    ) -> ClientStats {
        let mut stats = ClientStats::default();
        let process = rng.gen_range(0..self.shared.bases.len());
        let reason = format!("chaos: {action} by its operator");
        let (body, new_run_id) = if action == "abandon" {
            tokio::time::sleep(Duration::from_millis(rng.gen_range(0..=ABANDON_DELAY_MS_MAX))).await;
            (json!({"reason": reason}), None)
        } else {
            let Some(step) = self.failed_step(&mut stats, process, &run_id).await else { return stats };
            match action {
                "retry" => (json!({"reason": reason}), None),
                "skip" => (json!({"step": step, "output": {"charged_by": "chaos operator"}, "reason": reason}), None),
                _ => {
                    // From the failed charge, from the hold before it (run again), or from the
                    // reservation (position 0: the fork reserves the same order again, which
                    // the order's reservation row refuses, so the fork fails at once).
                    let from = if from_reservation { 0 } else { rng.gen_range(0..=step) };
                    let fork = format!("{run_id}-k");
                    (json!({"from_step": from, "new_run_id": fork}), Some((fork, from)))
                }
            }
        };
        let path = format!("/v1/runs/{run_id}/{action}");
        // Some(true): committed; Some(false): refused; None: unknown.
        let (mut committed, mut unanswered, mut last) = (None, false, process);
        for send in 0..START_SENDS_MAX {
            last = (process + send) % self.shared.bases.len();
            match post(&self.http, &self.shared, &mut stats, last, &path, &body, &[409]).await {
                Some((status, _)) if (200..300).contains(&status) => committed = Some(true),
                // After a send that got no answer, a 409 says that send committed (only an
                // operator takes a failed run elsewhere, and this one's fork id is its own);
                // an abandon's 409 may also be a run that ended by itself meanwhile.
                Some((409, _)) if unanswered => committed = (action != "abandon").then_some(true),
                // A run already ended (an abandon's), or an unexpected 4xx (counted by `post`).
                Some((400..=499, _)) => committed = Some(false),
                _ => {
                    unanswered = true;
                    tokio::time::sleep(START_RESEND_PAUSE).await;
                    continue;
                }
            }
            break;
        }
        match committed {
            Some(false) => return stats,
            Some(true) => stats.controls += 1,
            None => stats.controls_unanswered += 1,
        }
        let answered = committed.is_some();
        let at_ms = self.shared.at_ms();
        let (new_run_id, from_step) = new_run_id.unzip();
        let entry = Acknowledged::Control {
            run_id,
            action: action.into(),
            new_run_id,
            from_step,
            answered,
            process: last,
            at_ms,
        };
        // The writer lives until every client is done, and a client until its operators are.
        let _ = self.ledger.send(entry);
        stats
    }

    /// Read run `run_id` (from `process`, then the next ones in turn) until it failed: the
    /// journal position of its failed [`OPERATED_STEP`]. `None` when it ended otherwise or the
    /// workload stopped first.
    async fn failed_step(&self, stats: &mut ClientStats, mut process: usize, run_id: &str) -> Option<u64> {
        while !self.shared.stop.load(Ordering::Relaxed) {
            let url = format!("{}/v1/runs/{run_id}", self.shared.bases[process]);
            let answer = match self.http.get(&url).send().await {
                Ok(response) if response.status().is_success() => response.json::<Value>().await.ok(),
                _ => None,
            };
            stats.requests += 1;
            let Some(detail) = answer else {
                process = (process + 1) % self.shared.bases.len();
                tokio::time::sleep(OPERATOR_POLL).await;
                continue;
            };
            match detail["run"]["status"].as_str() {
                Some("failed") => {
                    let journal = detail["journal"].as_array()?;
                    let failed = journal.iter().find(|e| e["name"] == OPERATED_STEP && e["status"] == "failed")?;
                    return failed["seq"].as_u64();
                }
                Some("pending" | "running" | "sleeping" | "waiting" | "compensating") => {
                    tokio::time::sleep(OPERATOR_POLL).await
                }
                _ => return None,
            }
        }
        None
    }
}

/// The harness as an inbox operator, until the workload stops: every [`SKIP_POLL`], one pass of
/// [`skip_poison`] through a random process.
async fn inbox_operator(http: reqwest::Client, shared: Arc<Shared>, mut rng: StdRng) -> ClientStats {
    let mut stats = ClientStats::default();
    while !shared.stop.load(Ordering::Relaxed) {
        let process = rng.gen_range(0..shared.bases.len());
        skip_poison(&http, &shared, &mut stats, process).await;
        tokio::time::sleep(SKIP_POLL).await;
    }
    stats
}

/// One pass of the inbox operator through `process`: skip every record of `shipping` that is
/// blocked and a poison event (`POST /v1/consumers/shipping/inbox/{event}/skip`; a 409, a
/// record skipped by another pass meanwhile, is expected). Records blocked for any other reason
/// are left for the checker to find.
async fn skip_poison(http: &reqwest::Client, shared: &Shared, stats: &mut ClientStats, process: usize) {
    let path = format!("/v1/consumers/{SHIPPING_CONSUMER}/inbox?status=blocked&limit=1000");
    let Some(page) = get(http, shared, stats, process, &path).await else { return };
    let body = json!({"reason": "chaos: the reservation handler cannot decode a poison event"});
    for record in page["records"].as_array().into_iter().flatten() {
        let envelope = &record["envelope"];
        let Some(event_id) = envelope["event_id"].as_str().filter(|_| envelope["event_type"] == POISON_EVENT_TYPE)
        else {
            continue;
        };
        let path = format!("/v1/consumers/{SHIPPING_CONSUMER}/inbox/{event_id}/skip");
        if let Some((200, _)) = post(http, shared, stats, process, &path, &body, &[409]).await {
            stats.poison_skipped += 1;
        }
    }
}

/// The harness as an outbox operator, until the workload stops: every [`QUARANTINE_POLL`], one
/// pass of [`requeue_quarantined`] through a random process, its dismissals written to `ledger`.
async fn outbox_operator(
    http: reqwest::Client,
    shared: Arc<Shared>,
    ledger: tokio::sync::mpsc::UnboundedSender<Acknowledged>,
    mut rng: StdRng,
) -> ClientStats {
    let mut stats = ClientStats::default();
    while !shared.stop.load(Ordering::Relaxed) {
        let process = rng.gen_range(0..shared.bases.len());
        requeue_quarantined(&http, &shared, &mut stats, process, &mut rng, Some(&ledger)).await;
        tokio::time::sleep(QUARANTINE_POLL).await;
    }
    stats
}

/// One pass of the outbox operator through `process`, over the quarantined deliveries of each
/// subscriber: the first, and then one pass in [`REDELIVER_ONE_IN`], redelivers from the subscriber's first
/// quarantined event on (`POST /v1/outbox/redeliver/{consumer}`: every event after it too,
/// most of them accepted already), the others requeue each one
/// (`POST /v1/outbox/{event}/{consumer}/resolve`, `requeue`; a 409, resolved or accepted
/// meanwhile, is expected), except that with a `ledger` (during the workload) one such pass in
/// [`DISMISS_ONE_IN`] dismisses the first one instead (`dismiss`), written to the ledger when
/// answered 200 or not answered. What else the operator did is not told to the checker: the
/// deliveries must end accepted (or dismissed as the ledger says), each event applied once and
/// in order, whatever the operator did.
async fn requeue_quarantined(
    http: &reqwest::Client,
    shared: &Shared,
    stats: &mut ClientStats,
    process: usize,
    rng: &mut StdRng,
    ledger: Option<&tokio::sync::mpsc::UnboundedSender<Acknowledged>>,
) {
    let Some(page) = get(http, shared, stats, process, "/v1/outbox?status=quarantined&limit=1000").await else {
        return;
    };
    // Each subscriber's quarantined events, in outbox order (the order of the list).
    let mut quarantined: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for delivery in page["deliveries"].as_array().into_iter().flatten() {
        if let (Some(consumer), Some(event_id)) = (delivery["consumer_id"].as_str(), delivery["event_id"].as_str()) {
            quarantined.entry(consumer.to_string()).or_default().push(event_id.to_string());
        }
    }
    for (consumer, events) in quarantined {
        // The first quarantine a task meets is redelivered, so that every run with one
        // exercises both decisions.
        if stats.quarantines_redelivered == 0 || rng.gen_range(0..REDELIVER_ONE_IN) == 0 {
            let body = json!({"from_event": events[0]});
            let path = format!("/v1/outbox/redeliver/{consumer}");
            if let Some((200, _)) = post(http, shared, stats, process, &path, &body, &[]).await {
                stats.quarantines_redelivered += 1;
            }
            continue;
        }
        let mut events = events.as_slice();
        if let Some(ledger) =
            ledger.filter(|_| stats.quarantines_dismissed == 0 || rng.gen_range(0..DISMISS_ONE_IN) == 0)
        {
            let body = json!({"action": "dismiss", "reason": "chaos: the operator gives this event up"});
            let path = format!("/v1/outbox/{}/{consumer}/resolve", events[0]);
            let answer = post(http, shared, stats, process, &path, &body, &[409]).await;
            let answered = match answer {
                Some((200, _)) => Some(true),
                None => Some(false),
                Some((status, _)) if status >= 500 => Some(false),
                Some(_) => None,
            };
            if let Some(answered) = answered {
                stats.quarantines_dismissed += u64::from(answered);
                let event_id = events[0].clone();
                let consumer_id = consumer.clone();
                let at_ms = shared.at_ms();
                let _ = ledger.send(Acknowledged::Dismiss { event_id, consumer_id, answered, process, at_ms });
            }
            events = &events[1..];
        }
        let body = json!({"action": "requeue", "reason": "chaos: the consumer is reachable again"});
        for event_id in events {
            let path = format!("/v1/outbox/{event_id}/{consumer}/resolve");
            if let Some((200, _)) = post(http, shared, stats, process, &path, &body, &[409]).await {
                stats.quarantines_requeued += 1;
            }
        }
    }
}

/// GET `path` of `process`, counting the request in `stats`: the answer's JSON (`Null` when it is
/// not JSON), or `None` when no answer came (a connection error).
async fn get(
    http: &reqwest::Client,
    shared: &Shared,
    stats: &mut ClientStats,
    process: usize,
    path: &str,
) -> Option<Value> {
    match http.get(format!("{}{path}", shared.bases[process])).send().await {
        Ok(response) => {
            stats.requests += 1;
            Some(response.json::<Value>().await.unwrap_or(Value::Null))
        }
        Err(_) => {
            stats.connection_errors += 1;
            None
        }
    }
}

/// POST `body` to `path` of `process`, counting the request in `stats`: the status and the
/// answer's JSON (`Null` when it is not JSON), or `None` when no answer came (a connection
/// error). A 4xx is counted as unexpected (the workload sends only valid requests) unless
/// `expected` lists it.
async fn post(
    http: &reqwest::Client,
    shared: &Shared,
    stats: &mut ClientStats,
    process: usize,
    path: &str,
    body: &Value,
    expected: &[u16],
) -> Option<(u16, Value)> {
    let sent = http.post(format!("{}{path}", shared.bases[process])).json(body).send().await;
    let answered = match sent {
        Ok(response) => {
            let status = response.status().as_u16();
            response.text().await.ok().map(|text| (status, text))
        }
        Err(_) => None,
    };
    let Some((status, text)) = answered else {
        stats.connection_errors += 1;
        return None;
    };
    stats.requests += 1;
    *stats.by_status.entry(status).or_default() += 1;
    if (400..500).contains(&status) && !expected.contains(&status) {
        stats.unexpected += 1;
        stats.last_unexpected = Some(format!("{status} {path}: {}", text.chars().take(300).collect::<String>()));
    }
    Some((status, serde_json::from_str(&text).unwrap_or(Value::Null)))
}

/// A start a client sends again until a server answers it.
struct StartSender<'a> {
    http: &'a reqwest::Client,
    shared: &'a Shared,
    ledger: &'a tokio::sync::mpsc::UnboundedSender<Acknowledged>,
}

impl StartSender<'_> {
    /// POST the start `body` to `/v1/runs` of `process`, then of the next processes in turn,
    /// until one answers 2xx (`entry` goes to the ledger, stamped with that process and time:
    /// true) or 4xx (false), at most [`START_SENDS_MAX`] times (false). Sent again after no
    /// answer or a 5xx, the same run id is `existing` if a first send committed.
    async fn until_answered(&self, stats: &mut ClientStats, process: usize, body: &Value, entry: Acknowledged) -> bool {
        for send in 0..START_SENDS_MAX {
            let process = (process + send) % self.shared.bases.len();
            match post(self.http, self.shared, stats, process, "/v1/runs", body, &[]).await {
                Some((status, _)) if (200..300).contains(&status) => {
                    self.shared.recovery.lock().unwrap_or_else(|p| p.into_inner()).acknowledged(process);
                    let mut entry = with_time(entry, self.shared.at_ms());
                    match &mut entry {
                        Acknowledged::Waiter { process: p, .. } => {
                            stats.waiters += 1;
                            *p = process;
                        }
                        Acknowledged::Batch { process: p, .. } => {
                            stats.batches += 1;
                            *p = process;
                        }
                        Acknowledged::Start { process: p, .. }
                        | Acknowledged::Advance { process: p, .. }
                        | Acknowledged::Cancel { process: p, .. }
                        | Acknowledged::Operated { process: p, .. }
                        | Acknowledged::Control { process: p, .. }
                        | Acknowledged::Dismiss { process: p, .. } => *p = process,
                    }
                    let _ = self.ledger.send(entry);
                    return true;
                }
                Some((status, _)) if status < 500 => return false,
                _ => tokio::time::sleep(START_RESEND_PAUSE).await,
            }
        }
        false
    }
}

fn with_time(mut entry: Acknowledged, at: u64) -> Acknowledged {
    let (Acknowledged::Start { at_ms, .. }
    | Acknowledged::Batch { at_ms, .. }
    | Acknowledged::Waiter { at_ms, .. }
    | Acknowledged::Advance { at_ms, .. }
    | Acknowledged::Cancel { at_ms, .. }
    | Acknowledged::Operated { at_ms, .. }
    | Acknowledged::Control { at_ms, .. }
    | Acknowledged::Dismiss { at_ms, .. }) = &mut entry;
    *at_ms = at;
    entry
}

/// A `sleepy_order` of the chaos SKU (1..=3 units) that waits for its batch's `batch_done`
/// message (at most [`WAITER_TIMEOUT_MS`]) before it charges and ships; without the message it
/// releases its reservation and completes unapproved.
fn waiter_start(rng: &mut StdRng, run_id: String) -> (Value, Acknowledged) {
    let quantity = rng.gen_range(1..=3_i64);
    let input = json!({
        "order_id": run_id, "sku": SKU, "quantity": quantity, "amount": 100 * quantity,
        "approval": BATCH_DONE, "approval_timeout_ms": WAITER_TIMEOUT_MS,
    });
    let body = json!({"workflow": SLEEPY_ORDER, "run_id": run_id, "input": input});
    (body, Acknowledged::Waiter { run_id, quantity, process: 0, at_ms: 0 })
}

/// An operated order: a `sleepy_order` of the chaos SKU (1..=3 units) whose charge fails
/// retryably [`OPERATED_FLAKY_ATTEMPTS`] times, more than its attempts: it fails with its
/// reservation held, for an operator to decide ([`Operator::operate`]).
fn operated_start(rng: &mut StdRng, run_id: String, process: usize) -> (Value, Acknowledged) {
    let quantity = rng.gen_range(1..=3_i64);
    let input = json!({
        "order_id": run_id, "sku": SKU, "quantity": quantity, "amount": 100 * quantity,
        "flaky_attempts": OPERATED_FLAKY_ATTEMPTS,
    });
    let body = json!({"workflow": SLEEPY_ORDER, "run_id": run_id, "input": input});
    (body, Acknowledged::Operated { run_id, quantity, process, at_ms: 0 })
}

/// An `order_saga` input of the chaos SKU with its id, 1..=3 units, and what it must do: 10% fail
/// `charge_payment` and 10% `ship_order` for good (both compensate), 15% fail one attempt, 10%
/// sleep on a durable timer of 100..=1,500 ms between the charge and the shipment.
fn order(rng: &mut StdRng, order_id: String) -> (Value, BatchOrder) {
    let quantity = rng.gen_range(1..=3_i64);
    let mut input = json!({"order_id": order_id, "sku": SKU, "quantity": quantity, "amount": 100 * quantity});
    let fail = match rng.gen_range(0..100) {
        0..=9 => Some("charge_payment"),
        10..=19 => Some("ship_order"),
        20..=34 => {
            input["flaky_attempts"] = json!(1);
            None
        }
        35..=44 => {
            input["ship_after_ms"] = json!(rng.gen_range(100..=1_500_u64));
            None
        }
        _ => None,
    };
    if let Some(step) = fail {
        input["fail"] = json!(step);
    }
    let expect = if fail.is_some() { "compensated" } else { "completed" };
    (input, BatchOrder { order_id, fail: fail.map(str::to_string), expect: expect.into(), quantity })
}

/// Declare the two consumers, set the stock, declare the queue and the schedule, through process 0
/// (blocking HTTP); with a remote consumer, subscribe it at the proxy's address.
fn setup(base: &str, remote: Option<&Remote>) -> Result<()> {
    let mut requests = vec![
        (format!("{base}/v1/consumers/{SHIPPING_CONSUMER}"), json!({"handler": "reservation"})),
        (format!("{base}/v1/consumers/{AUDIT_CONSUMER}"), json!({"handler": "record"})),
        (format!("{base}/v1/stock/{SKU}"), json!({"quantity": STOCK})),
        (
            format!("{base}/v1/queues/{QUEUE}"),
            json!({"concurrency_max": QUEUE_CONCURRENCY_MAX, "rate": {"limit": QUEUE_RATE_LIMIT, "period_ms": 1_000}}),
        ),
        (
            format!("{base}/v1/schedules/{TICKS}"),
            json!({"workflow": SLEEPY_ORDER, "interval_ms": TICK_INTERVAL_MS, "catch_up": "all",
                   "input": {"sku": SKU, "quantity": TICK_QUANTITY, "amount": 100 * TICK_QUANTITY}}),
        ),
    ];
    if let Some(remote) = remote {
        let endpoint = match &remote.route {
            Some(route) => route.endpoint(remote.proxy.addr()),
            None => format!("http://{}/v1/consumers/{REMOTE_CONSUMER}/inbox", remote.proxy.addr()),
        };
        requests.push((format!("{base}/v1/subscriptions/{REMOTE_CONSUMER}"), json!({"endpoint": endpoint})));
    }
    send_all(reqwest::Method::PUT, &requests)
}

/// Open the tenant on `server`: a tenant opens (and its loops start) with its first request.
fn open_tenant(server: &Serve) -> Result<()> {
    let http = reqwest::blocking::Client::builder()
        .timeout(REQUEST_TIMEOUT)
        .build()
        .map_err(|e| Error::io(format!("cannot build the HTTP client: {e}")))?;
    let url = format!("{}/v1/runs?limit=1", server.base());
    http.get(&url).send().map_err(|e| Error::io(format!("GET {url}: {e}")))?;
    Ok(())
}

/// Send each body to its URL with `method`, in order; any answer but 2xx is an error.
fn send_all(method: reqwest::Method, requests: &[(String, Value)]) -> Result<()> {
    let http = reqwest::blocking::Client::builder()
        .timeout(REQUEST_TIMEOUT)
        .build()
        .map_err(|e| Error::io(format!("cannot build the HTTP client: {e}")))?;
    for (url, body) in requests {
        let response = http
            .request(method.clone(), url)
            .json(body)
            .send()
            .map_err(|e| Error::io(format!("{method} {url}: {e}")))?;
        let status = response.status();
        if !status.is_success() {
            let text = response.text().unwrap_or_default();
            return Err(Error::io(format!("{method} {url} answered {status}: {text}")));
        }
    }
    Ok(())
}

/// What a run made on its broker (`--broker`): where the relays publish and the remote server
/// consumes from, deleted when the run ends.
struct BrokerRoute {
    broker: Broker,
    runtime: tokio::runtime::Runtime,
    /// NATS: the relays' subject prefix; RabbitMQ: the exchange they publish to.
    publish_to: String,
    /// NATS: the stream capturing `<prefix>.>`; RabbitMQ: the quorum queue bound to the exchange.
    consume_from: String,
    /// The broker's `host:port` (the mock cluster's bootstrap address for Kafka).
    server: String,
    /// Kafka: the mock cluster, which lives as long as the route.
    mock: Option<MockCluster<'static, DefaultProducerContext>>,
}

impl BrokerRoute {
    fn create(broker: &Broker) -> Result<BrokerRoute> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(io("cannot start the async runtime"))?;
        let prefix = format!("tmkchaos{}", uuid::Uuid::new_v4().simple());
        let mut mock = None;
        let (publish_to, consume_from, server) = match broker {
            Broker::Nats(server) => {
                let stream = prefix.to_uppercase();
                crate::brokers::create_stream(&runtime, server, &stream, vec![format!("{prefix}.>")])?;
                (prefix, stream, server.clone())
            }
            Broker::Amqp(server) => {
                let (exchange, queue) = (format!("{prefix}.relay"), format!("{prefix}.remote"));
                crate::brokers::declare_routes(&runtime, server, &[(exchange.clone(), queue.clone())])?;
                (exchange, queue, server.clone())
            }
            Broker::KafkaMock => {
                let cluster =
                    MockCluster::new(1).map_err(|e| Error::io(format!("cannot start the mock cluster: {e}")))?;
                cluster
                    .create_topic(&prefix, KAFKA_PARTITIONS, 1)
                    .map_err(|e| Error::io(format!("cannot create the topic {prefix}: {e}")))?;
                let bootstrap = cluster.bootstrap_servers();
                mock = Some(cluster);
                (prefix.clone(), prefix, bootstrap)
            }
        };
        Ok(BrokerRoute { broker: broker.clone(), runtime, publish_to, consume_from, server, mock })
    }

    /// The broker's `host:port` (the mock cluster's bootstrap address for Kafka).
    fn server(&self) -> &str {
        &self.server
    }

    /// Does the broker fail itself (the mock Kafka cluster), rather than through the proxies?
    fn fails_itself(&self) -> bool {
        self.mock.is_some()
    }

    /// The endpoint the servers subscribe the remote consumer at: the broker through `proxy`
    /// (Kafka: the mock broker itself, whose faults are its own, [`BrokerRoute::set_link`]).
    fn endpoint(&self, proxy: &str) -> String {
        let server = if self.fails_itself() { self.server() } else { proxy };
        format!("{}://{server}/{}", self.broker.scheme(), self.publish_to)
    }

    /// Kafka: fail the link at the mock broker (a clients' proxy cannot stand before a Kafka
    /// broker, whose metadata sends them to its own address): a cut takes it down (its
    /// connections closed, new ones refused); a black hole or lost answers make it answer
    /// [`KAFKA_LATE_ANSWER`] late (it stores a produce at once). `false` when the route is not
    /// Kafka (the proxy fails the link).
    fn set_link(&self, link: Link) -> bool {
        let Some(cluster) = &self.mock else { return false };
        let result = match link {
            Link::Pass => cluster.broker_up(1).and_then(|()| cluster.broker_round_trip_time(1, Duration::ZERO)),
            Link::Cut => cluster.broker_down(1),
            Link::BlackHole | Link::LoseAnswers => cluster.broker_round_trip_time(1, KAFKA_LATE_ANSWER),
        };
        if let Err(e) = result {
            eprintln!("tidemark chaos: the mock cluster refused {link:?}: {e}");
        }
        true
    }

    /// The remote server's configuration: a source from the broker at `server` (its own proxy
    /// before the broker, or the mock Kafka broker itself) into its consumer's inbox.
    fn remote_config(&self, server: &str) -> String {
        let scheme = self.broker.scheme();
        let mut config =
            format!("[[sources]]\ntenant = \"{TENANT}\"\nconsumer = \"{REMOTE_CONSUMER}\"\nbatch = {SOURCE_BATCH}\n");
        match self.broker {
            Broker::Nats(_) => config.push_str(&format!(
                "from = \"{scheme}://{server}/{}\"\nstream = \"{}\"\nack_wait_ms = {SOURCE_ACK_WAIT_MS}\n",
                self.publish_to, self.consume_from
            )),
            Broker::Amqp(_) => config.push_str(&format!("from = \"{scheme}://{server}/{}\"\n", self.consume_from)),
            Broker::KafkaMock => config.push_str(&format!(
                "from = \"{scheme}://{server}/{}\"\nsession_timeout_ms = {SOURCE_SESSION_TIMEOUT_MS}\n",
                self.consume_from
            )),
        }
        config
    }

    fn json(&self) -> Value {
        json!({
            "url": self.broker.url(),
            "server": self.server(),
            "publish_to": self.publish_to,
            "consume_from": self.consume_from,
        })
    }
}

impl Drop for BrokerRoute {
    fn drop(&mut self) {
        match &self.broker {
            Broker::Nats(server) => crate::brokers::delete_stream(&self.runtime, server, &self.consume_from),
            Broker::Amqp(server) => crate::brokers::delete_routes(
                &self.runtime,
                server,
                &[(self.publish_to.clone(), self.consume_from.clone())],
            ),
            // The mock cluster goes with the route.
            Broker::KafkaMock => {}
        }
    }
}

/// The remote consumer's server and the link to it, when the run partitions the network.
struct Remote {
    server: Serve,
    proxy: Proxy,
    /// With `--broker`: the broker's names; the proxy stands between the relays and the broker.
    route: Option<BrokerRoute>,
    /// With `--store`: the remote server's schemas, under the prefix `<prefix>_r`.
    store: Option<PostgresStore>,
    /// With `--broker nats://` or `amqp://`: the proxy between the broker and the remote server's
    /// source.
    source_proxy: Option<Proxy>,
    /// Partitions of a broker's links by the side they failed, as [`Side`] numbers them.
    sides: [u64; 3],
}

/// Which of a broker's links a partition fails: the relays' (publishing), the remote source's
/// (consuming), or both (the broker cut off from everyone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Relays = 0,
    Source = 1,
    Both = 2,
}

/// Mixes a fault's index into the seed of its side's draw (apart from the flap's rhythm).
const SIDE_MIX: u64 = 0x9e37_79b9_7f4a_7c15;

impl Remote {
    /// Start the proxy, write the servers' configuration (the relay's token for the proxy's
    /// origin, short backoffs so that delivery resumes soon after a partition heals, and
    /// [`RELAY_MAX_ATTEMPTS`] so that a partition quarantines deliveries), start the
    /// remote server behind the proxy and declare its consumer. With a broker, the proxy leads
    /// to the broker instead, and the remote server consumes from it through a second proxy
    /// (NATS, RabbitMQ) or straight (the mock Kafka broker, which fails itself).
    fn start(exe: &Path, settings: &Settings) -> Result<Remote> {
        let route = settings.broker.as_ref().map(BrokerRoute::create).transpose()?;
        let proxy = Proxy::start()?;
        let source_proxy = match &route {
            Some(route) if !route.fails_itself() => {
                let source_proxy = Proxy::start()?;
                source_proxy.set_target(route.server());
                Some(source_proxy)
            }
            _ => None,
        };
        let config = format!(
            "[relay]\nattempt_timeout_ms = {}\nbackoff_base_ms = 50\nbackoff_max_ms = 500\nmax_attempts = {RELAY_MAX_ATTEMPTS}\n\
             [relay.tokens]\n\"http://{}\" = \"{REMOTE_TOKEN}\"\n",
            CLIENT_REQUEST_TIMEOUT.as_millis(),
            proxy.addr()
        );
        std::fs::write(settings.out.join("serve.toml"), config).map_err(io("cannot write serve.toml"))?;
        let remote_config = match &route {
            Some(route) => {
                let path = settings.out.join("remote.toml");
                let server = source_proxy.as_ref().map_or(route.server(), Proxy::addr);
                std::fs::write(&path, route.remote_config(server)).map_err(io("cannot write remote.toml"))?;
                Some(path)
            }
            None => None,
        };
        let mut server = Serve::remote(exe, settings, remote_config);
        server.start()?;
        proxy.set_target(route.as_ref().map_or(&server.addr, |route| route.server()));
        let consumer = format!("{}/v1/consumers/{REMOTE_CONSUMER}", server.base());
        send_all(reqwest::Method::PUT, &[(consumer, json!({"handler": "record"}))])?;
        Ok(Remote { server, proxy, route, source_proxy, sides: [0; 3], store: settings.remote_store.clone() })
    }

    fn data(&self) -> TenantData {
        tenant_data(&self.server.data, self.store.as_ref())
    }

    /// The remote inbox, read-only (`None` while it cannot be opened).
    fn inbox(&self) -> Option<checker::InboxReader> {
        self.data().inbox_reader()
    }

    /// The last record the remote inbox holds (0 while it has none or cannot be read).
    fn last_record(inbox: Option<&mut checker::InboxReader>) -> i64 {
        inbox.map_or(0, checker::InboxReader::last_record)
    }

    /// After a heal: the time until the remote inbox holds a record it did not hold at the heal,
    /// in ms (polled every 10 ms on one read-only connection, at most [`HEAL_WAIT`]); `None` when
    /// nothing new arrived by then (nothing was waiting to be delivered, or delivery had not
    /// resumed).
    fn delivery_resumed_ms(
        &self,
        mut inbox: Option<checker::InboxReader>,
        healed: Instant,
        before: i64,
    ) -> Option<f64> {
        while healed.elapsed() < HEAL_WAIT {
            if Self::last_record(inbox.as_mut()) > before {
                return Some(healed.elapsed().as_secs_f64() * 1_000.0);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    /// Kill the remote server, start it again on its address after `hold_ms`, open its tenant
    /// (its loops, a broker source among them, start with the tenant's first request) and measure
    /// how long delivery takes to resume.
    fn kill(&mut self, hold_ms: u64) -> Result<Option<f64>> {
        self.server.sigkill();
        std::thread::sleep(Duration::from_millis(hold_ms));
        self.server.start()?;
        let mut inbox = self.inbox();
        let before = Self::last_record(inbox.as_mut());
        let restarted = Instant::now();
        open_tenant(&self.server)?;
        Ok(self.delivery_resumed_ms(inbox, restarted, before))
    }

    /// Set the link on `side`: at its proxies, or at the mock broker for Kafka (every side).
    fn set_link(&self, link: Link, side: Side) {
        if self.route.as_ref().is_some_and(|route| route.set_link(link)) {
            return;
        }
        if side != Side::Source {
            self.proxy.set(link);
        }
        if let Some(source_proxy) = self.source_proxy.as_ref().filter(|_| side != Side::Relays) {
            source_proxy.set(link);
        }
    }

    /// Fail the link as `mode` says for `hold_ms`, then heal it, and measure how long delivery
    /// takes to resume. A flap's rhythm comes from the run's seed and the fault's index.
    /// With a source proxy, the side is drawn from the seed and the index: a third each.
    fn partition(&mut self, mode: PartitionMode, hold_ms: u64, seed: u64, index: usize) -> Option<f64> {
        let side = match self.source_proxy {
            Some(_) => {
                let draw = StdRng::seed_from_u64(seed ^ (index as u64).wrapping_mul(SIDE_MIX)).gen_range(0..3);
                [Side::Relays, Side::Source, Side::Both][draw]
            }
            None => Side::Relays,
        };
        self.sides[side as usize] += 1;
        let link = match mode {
            PartitionMode::Cut | PartitionMode::Flap => Link::Cut,
            PartitionMode::BlackHole => Link::BlackHole,
            PartitionMode::LoseAnswers => Link::LoseAnswers,
        };
        let until = Instant::now() + Duration::from_millis(hold_ms);
        if mode == PartitionMode::Flap {
            let mut rng = StdRng::seed_from_u64(seed ^ (index as u64).wrapping_mul(0x2545_f491_4f6c_dd1d));
            let mut up = false;
            while let Some(left) = until.checked_duration_since(Instant::now()) {
                self.set_link(if up { Link::Pass } else { link }, side);
                up = !up;
                std::thread::sleep(Duration::from_millis(rng.gen_range(100..=400)).min(left));
            }
        } else {
            self.set_link(link, side);
            std::thread::sleep(until.saturating_duration_since(Instant::now()));
        }
        let mut inbox = self.inbox();
        let before = Self::last_record(inbox.as_mut());
        self.set_link(Link::Pass, side);
        self.delivery_resumed_ms(inbox, Instant::now(), before)
    }
}

/// Nearest-rank percentile of sorted values (0 when there are none).
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    (sorted[rank - 1] * 10.0).round() / 10.0
}

fn chaos(args: RunArgs, durability: &str) -> Result<Value> {
    let settings = validate(args, durability)?;
    let exe = std::env::current_exe().map_err(io("cannot find the tidemark binary"))?;
    std::fs::create_dir_all(settings.out.join("logs")).map_err(io("cannot create --out"))?;
    if let Some(disk) = &settings.disk {
        // A folder of this run's own (a shrink makes several runs in one process).
        static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let run = RUNS.fetch_add(1, Ordering::Relaxed);
        let data = disk.join(format!("tidemark-chaos-{}-{}-{run}", settings.seed, std::process::id()));
        std::fs::create_dir_all(&data).map_err(io("cannot create the data folder on --disk"))?;
        std::os::unix::fs::symlink(&data, settings.out.join("data")).map_err(io("cannot link OUT/data to --disk"))?;
        // The workload's payment service stands for another service, on a machine of its own:
        // its log stays off the disk that fills (a link to `OUT/payments/payments.db`, which
        // SQLite follows, its journal files beside the target).
        let tenant = data.join("tenants").join(TENANT);
        let payments = settings.out.join("payments");
        for folder in [&tenant, &payments] {
            std::fs::create_dir_all(folder).map_err(io("cannot create the tenant's folder on --disk"))?;
        }
        std::os::unix::fs::symlink(payments.join("payments.db"), tenant.join("payments.db"))
            .map_err(io("cannot link the payment log off --disk"))?;
    }
    let faults = schedule::schedule(
        settings.seed,
        settings.faults,
        &settings.kinds,
        // Worker processes are faulted too: processes `processes..` of the schedule.
        settings.processes + settings.workers,
        settings.duration_ms,
        (LEASE_MS, settings.clock_jump_leases_max),
    );
    let faults: Vec<schedule::Fault> = faults
        .into_iter()
        .filter(|fault| settings.faults_only.as_ref().is_none_or(|only| only.contains(&fault.index)))
        .collect();
    let schedule_json = serde_json::to_string_pretty(&faults).map_err(|e| Error::io(e.to_string()))?;
    std::fs::write(settings.out.join("schedule.json"), &schedule_json).map_err(io("cannot write schedule.json"))?;
    eprintln!(
        "tidemark chaos: seed {} schedule {}",
        settings.seed,
        serde_json::to_string(&faults).map_err(|e| Error::io(e.to_string()))?
    );

    // With --db-preload the database runs on the fault layer for the run, and without it after.
    let _layer = match &settings.database {
        Some(database) if database.layer.is_some() => {
            let guard = LayerGuard(database);
            database.enter_layer()?;
            Some(guard)
        }
        _ => None,
    };
    let mut remote = if has_remote(&settings.kinds) { Some(Remote::start(&exe, &settings)?) } else { None };
    let mut servers: Vec<Serve> = (0..settings.processes).map(|i| Serve::new(i, &exe, &settings)).collect();
    servers[0].start()?;
    setup(&servers[0].base(), remote.as_ref())?;
    for server in servers.iter_mut().skip(1) {
        server.start()?;
    }
    let mut workers: Vec<WorkerProcess> = (0..settings.workers)
        .map(|index| WorkerProcess {
            index,
            exe: exe.clone(),
            data: settings.out.join("data"),
            store: settings.store.as_ref().map(|store| store.schema_url(tidemark_server::Database::Workflows)),
            log: settings.out.join("logs").join(format!("worker-{index}.log")),
            durability: settings.durability.clone(),
            faultfs: settings.faultfs(),
            clock_file: settings.clock_file(&format!("worker-{index}")),
            crash_file: settings.crash_file(&format!("worker-{index}")),
            process: Proc::default(),
            started: None,
        })
        .collect();
    for worker in &mut workers {
        worker.start()?;
    }
    // On PostgreSQL, the queue's limit is sampled until convergence ends (checker::QueueSamples).
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler =
        tenant_data(&settings.out.join("data"), settings.store.as_ref()).queue_sampler().map(|mut sampler| {
            let sampling = sampling.clone();
            std::thread::spawn(move || {
                while sampling.load(Ordering::Relaxed) {
                    sampler.sample();
                    std::thread::sleep(checker::QUEUE_SAMPLE_EVERY);
                }
                sampler
            })
        });

    let ledger_path = settings.out.join("ledger.jsonl");
    let ledger = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&ledger_path)
        .map_err(io("cannot create the ledger"))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(io("cannot start the async runtime"))?;
    let http = reqwest::Client::builder()
        .timeout(CLIENT_REQUEST_TIMEOUT)
        .build()
        .map_err(|e| Error::io(format!("cannot build the HTTP client: {e}")))?;
    let shared = Arc::new(Shared {
        bases: servers.iter().map(Serve::base).collect(),
        seed: settings.seed,
        stop: AtomicBool::new(false),
        started: Instant::now(),
        recovery: Mutex::new(Recovery::default()),
    });
    let (sender, receiver) = tokio::sync::mpsc::unbounded_channel::<Acknowledged>();
    let writer = runtime.spawn_blocking(move || write_ledger(ledger, receiver));
    let mut tasks = Vec::with_capacity(settings.clients);
    for index in 0..settings.clients {
        let rng = StdRng::seed_from_u64(settings.seed.wrapping_mul(1_000_003).wrapping_add(index as u64));
        tasks.push(runtime.spawn(client(index, http.clone(), shared.clone(), sender.clone(), rng)));
    }
    let skipper_rng = StdRng::seed_from_u64(settings.seed.wrapping_mul(1_000_003).wrapping_sub(1));
    tasks.push(runtime.spawn(inbox_operator(http.clone(), shared.clone(), skipper_rng)));
    let mut requeuer_rng = StdRng::seed_from_u64(settings.seed.wrapping_mul(1_000_003).wrapping_sub(2));
    if remote.is_some() {
        tasks.push(runtime.spawn(outbox_operator(http.clone(), shared.clone(), sender.clone(), requeuer_rng.clone())));
    }
    drop(sender);

    // The faults, one after the other, on this thread.
    let mut injected: Vec<Value> = Vec::with_capacity(faults.len());
    let mut fault_error: Option<Error> = None;
    for fault in &faults {
        let due = Duration::from_millis(fault.at_ms);
        if let Some(wait) = due.checked_sub(shared.started.elapsed()) {
            std::thread::sleep(wait);
        }
        let disks = (settings.database.as_ref(), settings.disk.as_deref());
        match inject(&mut servers, &mut workers, remote.as_mut(), disks, fault, &shared) {
            Ok(done) => injected.push(done),
            Err(e) => {
                fault_error = Some(e);
                break;
            }
        }
    }
    if let Some(wait) = Duration::from_millis(settings.duration_ms).checked_sub(shared.started.elapsed()) {
        std::thread::sleep(wait);
    }
    shared.stop.store(true, Ordering::Relaxed);
    let workload_ms = shared.started.elapsed().as_millis() as u64;
    let mut stats = ClientStats::default();
    for task in tasks {
        let one = runtime.block_on(task).map_err(|e| Error::Invariant(format!("a chaos client panicked: {e}")))?;
        stats.merge(one);
    }
    let written =
        runtime.block_on(writer).map_err(|e| Error::Invariant(format!("the ledger writer panicked: {e}")))??;
    if let Some(error) = fault_error {
        return Err(error);
    }

    // A clean restart of every server (the worker processes stop for good), then a bounded
    // wait for the relay, the drains and the workers to finish by themselves.
    // A process that does not exit cleanly on SIGTERM (a panic on the way out, a hang) is a
    // finding of the run, as a violation is.
    let mut unclean_stops = Vec::new();
    // A process armed with a crash point that ended by itself otherwise (a panic's 101, a
    // signal) died of something else than the fault.
    for fault in &injected {
        let armed = &fault["crash_point"];
        if armed["exited"] == true && armed["reached"] == false {
            unclean_stops.push(format!(
                "process {} ended (exit code {}, signal {}) while armed with crash point {} (fault {})",
                fault["process"], armed["exit_code"], armed["signal"], armed["point"], fault["index"]
            ));
        }
    }
    for worker in &mut workers {
        if let Some(why) = worker.terminate()? {
            unclean_stops.push(format!("worker {}: {why} (log {})", worker.index, worker.log.display()));
        }
    }
    let worker_claims: u64 = workers.iter().map(WorkerProcess::claimed).sum();
    for server in &mut servers {
        unclean_stops.extend(server.terminate()?);
    }
    let ledger_entries = checker::read_ledger(&ledger_path)?;
    let files = tenant_data(&settings.out.join("data"), settings.store.as_ref());
    let remote_files = remote.as_ref().map(Remote::data);
    let restarted = Instant::now();
    for server in &mut servers {
        server.start()?;
    }
    for server in &servers {
        let _ = open_tenant(server);
    }
    // No tick after this one: the ticks started so far must complete for convergence.
    send_all(reqwest::Method::POST, &[(format!("{}/v1/schedules/{TICKS}/pause", servers[0].base()), json!({}))])?;
    let mut converged = false;
    while restarted.elapsed() < settings.converge_timeout {
        // The inbox operator goes on skipping what is left of the poison events, and the outbox
        // operator resolving what is quarantined.
        runtime.block_on(skip_poison(&http, &shared, &mut stats, 0));
        if remote.is_some() {
            runtime.block_on(requeue_quarantined(&http, &shared, &mut stats, 0, &mut requeuer_rng, None));
        }
        if checker::check(&files, TENANT, &ledger_entries, remote_files.as_ref())?.converged() {
            converged = true;
            break;
        }
        std::thread::sleep(CONVERGE_POLL);
    }
    let convergence_ms = restarted.elapsed().as_millis() as u64;
    sampling.store(false, Ordering::Relaxed);
    if let Some(sampler) = sampler {
        sampler.join().map_err(|_| Error::Invariant("the queue sampler panicked".into()))?.finish()?;
    }
    for server in &mut servers {
        unclean_stops.extend(server.terminate()?);
    }
    let link = remote.as_ref().map(|r| {
        let source = r.source_proxy.as_ref();
        json!({
            "connections": r.proxy.connections() + source.map_or(0, Proxy::connections),
            "answers_lost": r.proxy.answers_lost() + source.map_or(0, Proxy::answers_lost),
            "broker": r.route.as_ref().map(BrokerRoute::json),
            "source": source.map(|proxy| json!({
                "connections": proxy.connections(),
                "answers_lost": proxy.answers_lost(),
            })),
            "sides": source.map(|_| json!({"relays": r.sides[0], "source": r.sides[1], "both": r.sides[2]})),
        })
    });
    if let Some(remote) = remote.as_mut() {
        unclean_stops.extend(remote.server.terminate()?.map(|why| format!("remote {why}")));
    }
    let report = checker::check(&files, TENANT, &ledger_entries, remote_files.as_ref())?;

    let mut recovery = shared.recovery.lock().unwrap_or_else(|p| p.into_inner());
    let unobserved = recovery.unobserved + recovery.waiting.len() as u64;
    recovery.measured_ms.sort_by(f64::total_cmp);
    let mut resumed = recovery.delivery_resumed_ms.clone();
    resumed.sort_by(f64::total_cmp);
    let measured = &recovery.measured_ms;
    let by_kind = |kind: FaultKind| faults.iter().take(injected.len()).filter(|f| f.kind == kind).count();
    let kinds: Vec<String> = settings
        .kinds
        .iter()
        .filter_map(|k| clap::ValueEnum::to_possible_value(k).map(|v| v.get_name().to_string()))
        .collect();
    let writes_lost: u64 = injected.iter().filter_map(|f| f["power_loss"]["writes_lost"].as_u64()).sum();
    let writes_torn: u64 = injected.iter().filter_map(|f| f["power_loss"]["writes_torn"].as_u64()).sum();
    let passed = report.total() == 0 && converged && unclean_stops.is_empty();
    let mut check = report.to_json(Some(settings.seed));
    check["passed"] = json!(passed);
    check["converged"] = json!(converged);
    let statuses: BTreeMap<String, u64> = stats.by_status.iter().map(|(s, n)| (s.to_string(), *n)).collect();
    Ok(json!({
        "outcome": if passed { "passed" } else { "violations" },
        "seed": settings.seed,
        "reproduce": format!(
            "tidemark chaos --seed {} --duration-s {} --faults {} --kinds {} --durability {} --processes {} --clients {}{}{}",
            settings.seed, settings.duration_ms / 1_000, settings.faults, kinds.join(","), settings.durability,
            settings.processes, settings.clients,
            if settings.workers > 0 { format!(" --workers {}", settings.workers) } else { String::new() }
                + &if settings.clock_jump_leases_max != schedule::CLOCK_JUMP_LEASES_MAX {
                    format!(" --clock-jump-leases-max {}", settings.clock_jump_leases_max)
                } else {
                    String::new()
                },
            settings.store.as_ref().map(|store| format!(" --store '{}'", store.masked)).unwrap_or_default()
                + &settings.database.as_ref().map(|db| format!(" --db-data {}", db.data.display())).unwrap_or_default()
                + &settings
                    .database
                    .as_ref()
                    .and_then(|db| db.layer.as_ref())
                    .map(|layer| format!(" --db-preload {}", layer.preload.display()))
                    .unwrap_or_default()
                + &settings
                    .broker
                    .as_ref()
                    .map(|broker| format!(" --broker {}", broker.url()))
                    .unwrap_or_default()
                + &settings.disk.as_ref().map(|disk| format!(" --disk {}", disk.display())).unwrap_or_default()
                + &settings
                    .faults_only
                    .as_ref()
                    .map(|only| {
                        let indices: Vec<String> = only.iter().map(usize::to_string).collect();
                        format!(" --faults-only {}", indices.join(","))
                    })
                    .unwrap_or_default()
        ),
        "durability": settings.durability,
        "store": settings.store.as_ref().map(|store| store.masked.clone()),
        "remote_store": settings.remote_store.as_ref().map(|store| store.masked.clone()),
        "processes": settings.processes,
        "workers": settings.workers,
        "worker_claims": worker_claims,
        "clients": settings.clients,
        "workload_ms": workload_ms,
        "faults": {
            "scheduled": faults.len(),
            "injected": injected.len(),
            "sigkill": by_kind(FaultKind::Sigkill),
            "sigstop": by_kind(FaultKind::Sigstop),
            "power_loss": by_kind(FaultKind::PowerLoss),
            "clock_jump": by_kind(FaultKind::ClockJump),
            "clock_jump_kill": by_kind(FaultKind::ClockJumpKill),
            "partition": by_kind(FaultKind::Partition),
            "io_error": by_kind(FaultKind::IoError),
            "db_crash": by_kind(FaultKind::DbCrash),
            "remote_kill": by_kind(FaultKind::RemoteKill),
            "crash_point": by_kind(FaultKind::CrashPoint),
            "crash_points_reached": injected.iter().filter(|f| f["crash_point"]["reached"] == true).count(),
            "on_workers": faults.iter().take(injected.len()).filter(|f| f.process >= settings.processes).count(),
            "link": link,
            "unsynced_writes_lost": writes_lost,
            "unsynced_writes_torn": writes_torn,
            "schedule": injected,
        },
        "operations": {
            "requests": stats.requests,
            "acknowledged": stats.advances + stats.starts + stats.batches + stats.waiters + stats.cancels + stats.controls,
            "advances": stats.advances,
            "appends": stats.appends,
            "poison_skipped": stats.poison_skipped,
            "quarantines_requeued": stats.quarantines_requeued,
            "quarantines_redelivered": stats.quarantines_redelivered,
            "quarantines_dismissed": stats.quarantines_dismissed,
            "starts": stats.starts,
            "batches": stats.batches,
            "waiters": stats.waiters,
            "cancels": stats.cancels,
            "cancels_unanswered": stats.cancels_unanswered,
            "controls": stats.controls,
            "controls_unanswered": stats.controls_unanswered,
            "ledger_entries": written,
            "lost": report.counts["lost"],
            "applied_twice": report.counts["applied_twice"],
            "no_answer": stats.connection_errors,
            "by_status": statuses,
            "unexpected_answers": stats.unexpected,
            "last_unexpected_answer": stats.last_unexpected,
        },
        "recovery_ms": {
            "definition": "from a killed process's restart (its listening line) or a paused process's SIGCONT to the first operation that process acknowledges",
            "observed": measured.len(),
            "unobserved": unobserved,
            "median": percentile(measured, 0.5),
            "p99": percentile(measured, 0.99),
            "max": percentile(measured, 1.0),
        },
        "partition_recovery_ms": {
            "definition": "from a partition's heal (or the remote server's restart) to the first record the remote inbox did not hold then",
            "observed": resumed.len(),
            "unobserved": recovery.delivery_not_resumed,
            "median": percentile(&resumed, 0.5),
            "p99": percentile(&resumed, 0.99),
            "max": percentile(&resumed, 1.0),
        },
        "convergence_ms": convergence_ms,
        "unclean_stops": unclean_stops,
        "out": settings.out,
        "check": check,
    }))
}

/// Inject one fault and bring the process (or, after a power loss, every process) back;
/// returns what was done, with its times.
fn inject(
    servers: &mut [Serve],
    workers: &mut [WorkerProcess],
    remote: Option<&mut Remote>,
    (database, disk): (Option<&Database>, Option<&Path>),
    fault: &Fault,
    shared: &Shared,
) -> Result<Value> {
    let began_ms = shared.started.elapsed().as_millis() as u64;
    let mut lost = Value::Null;
    // The database's I/O error: whether the harness had to start the server again after it.
    let mut io_error_database: Option<bool> = None;
    // A full `--disk`: the bytes its ballast took.
    let mut disk_filled_bytes: Option<u64> = None;
    // An I/O error of one server's files only: that server (else the whole disk's).
    let mut io_error_process = None;
    // A crash point's record: the point, whether the process reached it, its exit code.
    let mut crash_point = Value::Null;
    // A fault on a worker process (the schedule numbers them after the servers).
    if let Some(worker) = fault.process.checked_sub(servers.len()).and_then(|i| workers.get_mut(i)) {
        match fault.kind {
            FaultKind::Sigkill => {
                worker.process.sigkill();
                std::thread::sleep(Duration::from_millis(fault.hold_ms));
                worker.start()?;
            }
            FaultKind::Sigstop => {
                worker.process.sigstop()?;
                std::thread::sleep(Duration::from_millis(fault.hold_ms));
                worker.process.sigcont()?;
            }
            FaultKind::ClockJump => {
                set_clock_offset(worker.clock_file.as_ref(), fault.jump_ms)?;
                std::thread::sleep(Duration::from_millis(fault.hold_ms));
                set_clock_offset(worker.clock_file.as_ref(), 0)?;
            }
            FaultKind::ClockJumpKill => {
                set_clock_offset(worker.clock_file.as_ref(), fault.jump_ms)?;
                let (before, after) = kill_within_jump(fault.hold_ms);
                std::thread::sleep(before);
                worker.process.sigkill();
                std::thread::sleep(CLOCK_JUMP_KILL_DOWN);
                worker.start()?;
                std::thread::sleep(after);
                set_clock_offset(worker.clock_file.as_ref(), 0)?;
            }
            FaultKind::CrashPoint => {
                let point = fault
                    .point_on(true)
                    .ok_or_else(|| Error::Invariant("a crash point fault without a point".into()))?;
                crash_point = worker.process.stop_at_crash_point(worker.crash_file.as_ref(), point)?;
                std::thread::sleep(Duration::from_millis(fault.hold_ms));
                worker.start()?;
            }
            // The machine's, the disk's, the link's or the remote's: process 0 (a server).
            FaultKind::PowerLoss
            | FaultKind::Partition
            | FaultKind::IoError
            | FaultKind::DbCrash
            | FaultKind::RemoteKill => {
                return Err(Error::Invariant(format!("a {:?} fault on a worker process", fault.kind)));
            }
        }
        let back_ms = shared.started.elapsed().as_millis() as u64;
        return Ok(json!({
            "index": fault.index, "kind": fault.kind, "process": fault.process, "worker": true,
            "due_ms": fault.at_ms, "began_ms": began_ms, "back_ms": back_ms, "hold_ms": fault.hold_ms,
            "crash_point": crash_point,
        }));
    }
    match fault.kind {
        FaultKind::Sigkill => {
            let server = &mut servers[fault.process];
            server.sigkill();
            std::thread::sleep(Duration::from_millis(fault.hold_ms));
            server.start()?;
        }
        FaultKind::Sigstop => {
            let server = &mut servers[fault.process];
            server.sigstop()?;
            std::thread::sleep(Duration::from_millis(fault.hold_ms));
            server.sigcont()?;
        }
        FaultKind::CrashPoint => {
            let point =
                fault.point_on(false).ok_or_else(|| Error::Invariant("a crash point fault without a point".into()))?;
            let server = &mut servers[fault.process];
            crash_point = server.process.stop_at_crash_point(server.crash_file.as_ref(), point)?;
            std::thread::sleep(Duration::from_millis(fault.hold_ms));
            server.start()?;
        }
        FaultKind::ClockJump => {
            let clock = servers[fault.process].clock_file.as_ref();
            set_clock_offset(clock, fault.jump_ms)?;
            std::thread::sleep(Duration::from_millis(fault.hold_ms));
            set_clock_offset(clock, 0)?;
        }
        FaultKind::ClockJumpKill => {
            let server = &mut servers[fault.process];
            set_clock_offset(server.clock_file.as_ref(), fault.jump_ms)?;
            let (before, after) = kill_within_jump(fault.hold_ms);
            std::thread::sleep(before);
            server.sigkill();
            std::thread::sleep(CLOCK_JUMP_KILL_DOWN);
            server.start()?;
            std::thread::sleep(after);
            set_clock_offset(server.clock_file.as_ref(), 0)?;
        }
        FaultKind::IoError if database.is_some_and(|db| db.layer.is_some()) => {
            // The database machine's disk: the tidemark processes stay up and reconnect.
            let database = database.expect("matched");
            let mode = fault.io_error.ok_or_else(|| Error::Invariant("an I/O error fault without a mode".into()))?;
            io_error_database = Some(database.io_error(mode, Duration::from_millis(fault.hold_ms))?);
        }
        FaultKind::IoError if disk.is_some() && fault.io_error == Some(IoErrorMode::Full) => {
            // The real file system under the data folder, for every process alike.
            disk_filled_bytes = Some(fill_disk(disk.expect("matched"), Duration::from_millis(fault.hold_ms))?);
        }
        FaultKind::IoError => {
            let state = servers[0].faultfs.as_ref().ok_or_else(|| invalid("an I/O error needs the fault VFS"))?;
            let mode = fault.io_error.ok_or_else(|| Error::Invariant("an I/O error fault without a mode".into()))?;
            // Every second I/O error fails one server's files only (its own control file), the
            // others writing the same files meanwhile: a server in turn.
            let control = if fault.index % 2 == 1 {
                let server = (fault.index / 2) % servers.len();
                let pid = servers[server].pid().ok_or_else(|| Error::Invariant(format!("server {server} is down")))?;
                io_error_process = Some(server);
                state.join(io_error_process_control(mode, pid))
            } else {
                state.join(io_error_control(mode))
            };
            std::fs::create_dir_all(state).map_err(io("cannot create the fault VFS's folder"))?;
            std::fs::write(&control, b"").map_err(io("cannot start an I/O error"))?;
            std::thread::sleep(Duration::from_millis(fault.hold_ms));
            std::fs::remove_file(&control).map_err(io("cannot end an I/O error"))?;
        }
        FaultKind::Partition | FaultKind::RemoteKill => {
            let remote = remote
                .ok_or_else(|| invalid("partitions and remote kills need the remote consumer (--kinds partition)"))?;
            let resumed = match fault.partition {
                Some(mode) if fault.kind == FaultKind::Partition => {
                    remote.partition(mode, fault.hold_ms, shared.seed, fault.index)
                }
                None if fault.kind == FaultKind::RemoteKill => remote.kill(fault.hold_ms)?,
                _ => {
                    return Err(Error::Invariant(format!(
                        "a {:?} fault with the partition mode {:?}",
                        fault.kind, fault.partition
                    )))
                }
            };
            shared.recovery.lock().unwrap_or_else(|p| p.into_inner()).delivery_resumed(resumed);
        }
        FaultKind::DbCrash => {
            let database = database.ok_or_else(|| invalid("a database crash needs --db-data"))?;
            database.crash()?;
            std::thread::sleep(Duration::from_millis(fault.hold_ms));
            database.start()?;
        }
        FaultKind::PowerLoss => match database.filter(|db| db.layer.is_some()) {
            // The database machine's: the tidemark processes stay up and reconnect.
            Some(database) => {
                let writeback = writeback(shared.seed, fault);
                lost = loss_report(database.power_loss(writeback)?, writeback);
                lost["machine"] = json!("database");
                std::thread::sleep(Duration::from_millis(fault.hold_ms));
                database.start()?;
            }
            // The machine's: every process on it (servers and workers) dies at once.
            None => {
                for server in servers.iter_mut() {
                    server.sigkill();
                }
                for worker in workers.iter_mut() {
                    worker.process.sigkill();
                }
                lost = power_loss(servers, fault)?;
                std::thread::sleep(Duration::from_millis(fault.hold_ms));
                for server in servers.iter_mut() {
                    server.start()?;
                }
                for worker in workers.iter_mut() {
                    worker.start()?;
                }
            }
        },
    }
    let mut recovery = shared.recovery.lock().unwrap_or_else(|p| p.into_inner());
    match fault.kind {
        // Every process lost its database (or its files): each one's first acknowledgement after.
        FaultKind::PowerLoss | FaultKind::DbCrash => {
            (0..servers.len()).for_each(|process| recovery.back(process, fault.index))
        }
        // The processes never stopped: nothing of theirs to recover (the relays catch up, which
        // the convergence wait and the checker see).
        FaultKind::Partition | FaultKind::IoError | FaultKind::RemoteKill => {}
        _ => recovery.back(fault.process, fault.index),
    }
    let back_ms = shared.started.elapsed().as_millis() as u64;
    Ok(json!({
        "index": fault.index, "kind": fault.kind, "process": fault.process,
        "due_ms": fault.at_ms, "began_ms": began_ms, "back_ms": back_ms, "hold_ms": fault.hold_ms,
        "jump_ms": fault.jump_ms, "partition": fault.partition, "io_error": fault.io_error,
        "io_error_process": io_error_process, "io_error_database_restarted": io_error_database,
        "disk_filled_bytes": disk_filled_bytes, "power_loss": lost, "crash_point": crash_point,
    }))
}

/// What reached the disk at a power loss, drawn from the seed and the fault's index: in each
/// file either a prefix of its unsynced writes (a disk writing its queue back in order; even
/// indexes) or any subset of them, sectors of a write on their own (a disk that reorders and tears
/// writes; odd indexes).
fn writeback(seed: u64, fault: &Fault) -> tidemark_faultfs::Writeback {
    use tidemark_faultfs::Writeback;
    let seed = seed ^ (fault.index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    if fault.index.is_multiple_of(2) {
        Writeback::Prefix(seed)
    } else {
        Writeback::Reordered { seed, torn: true }
    }
}

/// A power loss's entry in the report: what it threw away and which writeback it drew.
fn loss_report(report: tidemark_faultfs::PowerLossReport, writeback: tidemark_faultfs::Writeback) -> Value {
    let mut value = serde_json::to_value(report).unwrap_or_default();
    value["writeback"] = json!(match writeback {
        tidemark_faultfs::Writeback::Reordered { .. } => "reordered_torn",
        _ => "prefix",
    });
    value
}

/// Throw away what the (dead) servers' files had not made durable ([`writeback`]).
#[cfg(feature = "failpoints")]
fn power_loss(servers: &[Serve], fault: &Fault) -> Result<Value> {
    let state = servers[0].faultfs.as_ref().ok_or_else(|| invalid("a power loss needs the fault VFS"))?;
    let writeback = writeback(servers[0].seed, fault);
    Ok(loss_report(tidemark_store_sqlite::faultfs::power_loss(state, writeback)?, writeback))
}

#[cfg(not(feature = "failpoints"))]
fn power_loss(_servers: &[Serve], _fault: &Fault) -> Result<Value> {
    Err(invalid("power losses need a build with the failpoints feature"))
}

#[cfg(all(test, feature = "failpoints"))]
mod tests {
    use super::*;

    #[test]
    fn ddmin_finds_a_smallest_failing_set_within_its_budget() {
        // Fails when both 3 and 7 are in: ddmin ends at exactly those two.
        let mut calls = Vec::new();
        let needs_both = |set: &[usize]| set.contains(&3) && set.contains(&7);
        let (found, exhausted) = ddmin((0..10).collect(), 100, |set| {
            calls.push(set.to_vec());
            Ok(needs_both(set))
        })
        .unwrap();
        assert_eq!((found, exhausted), (vec![3, 7], false));
        assert!(calls.iter().all(|set| !set.is_empty() && set.len() < 10), "{calls:?}");
        // One culprit among 16: halves all the way down, at most two calls a level.
        let mut count = 0;
        let (found, _) = ddmin((0..16).collect(), 100, |set| {
            count += 1;
            Ok(set.contains(&11))
        })
        .unwrap();
        assert_eq!(found, vec![11]);
        assert!(count <= 2 * 4, "{count} calls");
        // A set that fails only whole stays whole; a budget stops the search where it is.
        assert_eq!(ddmin(vec![1, 2, 3], 100, |set| Ok(set.len() == 3)).unwrap(), (vec![1, 2, 3], false));
        let (found, exhausted) = ddmin((0..10).collect(), 1, |set| Ok(needs_both(set))).unwrap();
        assert_eq!((found.len(), exhausted), (10, true));
        assert!(ddmin(vec![4, 5], 10, |_| Err(Error::io("the harness failed"))).is_err());
    }

    #[test]
    fn the_io_error_control_files_are_the_fault_vfs_s() {
        use tidemark_store_sqlite::faultfs;
        assert_eq!(io_error_control(IoErrorMode::Full), faultfs::FULL);
        assert_eq!(io_error_control(IoErrorMode::EioWrite), faultfs::EIO_WRITE);
        assert_eq!(io_error_control(IoErrorMode::EioFsync), faultfs::EIO_FSYNC);
        assert_eq!(faultfs_env(), faultfs::ENV);
        assert_eq!(io_error_process_control(IoErrorMode::Full, 42), faultfs::process_control(faultfs::FULL, 42));
    }
}

#[cfg(test)]
mod broker_tests {
    use super::*;

    #[test]
    fn a_broker_is_a_scheme_and_host_port_and_nothing_else() {
        let nats = Broker::parse("nats://127.0.0.1:4222").unwrap();
        assert_eq!(nats, Broker::Nats("127.0.0.1:4222".into()));
        assert_eq!(nats.url(), "nats://127.0.0.1:4222");
        let amqp = Broker::parse("amqp://rabbit:5672/").unwrap();
        assert_eq!(amqp, Broker::Amqp("rabbit:5672".into()));
        let kafka = Broker::parse(KAFKA_MOCK).unwrap();
        assert_eq!((&kafka, kafka.url().as_str()), (&Broker::KafkaMock, KAFKA_MOCK));
        let long = format!("nats://{}:4222", "h".repeat(BROKER_URL_MAX));
        for bad in [
            "http://127.0.0.1:4222",
            "kafka://k:9092",
            "kafka-mock/",
            "nats://",
            "nats://host",
            "nats://:4222",
            "nats://host:0",
            "nats://host:99999",
            "nats://host:4222/prefix",
            "amqp://guest:guest@host:5672",
            "amqp://host:5672?x=1",
            long.as_str(),
        ] {
            let error = Broker::parse(bad).expect_err(bad);
            assert_eq!(error.code(), codes::INVALID_ARGUMENT, "{bad}");
        }
    }
}
