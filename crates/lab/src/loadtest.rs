//! `tidemark loadtest`: load a running `tidemark serve` from this (separate) process, and
//! `tidemark loadtest verify`: check afterwards, on the server's files, that every request the
//! server accepted is in its database.
//!
//! N clients (closed loop: each sends its next request when the last one was answered) mix
//! three operations for D seconds: starting an order saga (`POST /v1/runs`), advancing a
//! reservation flow (`POST /v1/flows/{id}/advance`; each client owns its flows, so it always
//! knows the expected seq) and appending to an event stream (`POST /v1/streams/{id}/events`).
//! Every accepted answer (2xx) goes to a JSONL ledger as it arrives: a run id that was started,
//! or a (flow, seq, event id) that was committed. A connection error (the server died) is
//! counted and the client tries again after a short pause; a request whose answer never came
//! is not in the ledger (it may or may not have been committed) and its flow is abandoned.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tidemark_core::error::codes;
use tidemark_core::{Error, Result};
use tidemark_store_sqlite::stats;

/// Most clients one load test runs.
const CLIENTS_MAX: usize = 4_096;
/// Longest load test.
const DURATION_S_MAX: u64 = 24 * 3_600;
/// Longest ledger line `verify` reads (a line is a few hundred bytes).
const LEDGER_LINE_BYTES_MAX: usize = 64 * 1024;
/// Most ledger entries `verify` reads.
const LEDGER_ENTRIES_MAX: usize = 50_000_000;
/// Problems `verify` lists (it counts them all).
const PROBLEMS_LISTED_MAX: usize = 20;
/// A client's pause after a connection error before it tries again.
const RECONNECT_PAUSE: Duration = Duration::from_millis(50);
/// How long one request may take before it counts as a connection error.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// The stock every order takes from (set before the load starts; never runs out).
const LOAD_STOCK: i64 = 1_000_000_000;

/// The arguments of `tidemark loadtest` (the load) and of `tidemark loadtest verify`.
#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct LoadtestArgs {
    #[command(subcommand)]
    command: Option<LoadtestCommand>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand)]
enum LoadtestCommand {
    /// Check that every entry of a ledger is in a tenant's database (reads the files directly;
    /// the server may be running).
    Verify(VerifyArgs),
}

#[derive(Args)]
struct RunArgs {
    /// An `admin` token of the same tenant, to set the stock the orders take from
    /// (default: --token).
    #[arg(long)]
    admin_token: Option<String>,
    /// Concurrent clients.
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// Seconds of load.
    #[arg(long, default_value_t = 30)]
    duration_s: u64,
    /// Relative weights of run starts, flow advances and stream appends.
    #[arg(long, default_value = "1:2:1")]
    mix: String,
    /// Percent of the orders that are declined at the charge (the saga compensates).
    #[arg(long, default_value_t = 10)]
    decline_percent: u32,
    /// The JSONL ledger of accepted requests (created; an existing file is refused).
    #[arg(long, default_value = "tidemark-loadtest.jsonl")]
    ledger: PathBuf,
    /// Prefix of every run and flow id (default: `lt` and the start time), so that load tests
    /// against the same tenant never collide.
    #[arg(long)]
    prefix: Option<String>,
    /// Seed of the clients' choices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("stores").required(true).args(["data", "store"])))]
struct VerifyArgs {
    /// The server's data folder (a service on SQLite files).
    #[arg(long)]
    data: Option<PathBuf>,
    /// The server's PostgreSQL store, as `serve --store` was given it.
    #[arg(long)]
    store: Option<String>,
    #[arg(long)]
    tenant: String,
    #[arg(long)]
    ledger: PathBuf,
}

/// One accepted request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LedgerEntry {
    /// `POST /v1/runs` answered 201 (or 200: it already existed).
    Run {
        /// The run started.
        run_id: String,
        /// The final status the run must reach: `completed`, or `compensated` for a declined order.
        expect: String,
    },
    /// An advance or an append answered 200 `committed`.
    Event {
        /// `advance` (a reservation flow) or `append` (an event stream).
        op: String,
        /// The flow or stream the event was committed to.
        flow_id: String,
        /// The seq the server answered for the event.
        seq: i64,
        /// The event's id, as the server answered it.
        event_id: String,
    },
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    Start,
    Advance,
    Append,
}

struct Settings {
    base: String,
    token: String,
    prefix: String,
    weights: [u32; 3],
    decline_percent: u32,
    deadline: Instant,
}

/// What one client saw.
#[derive(Default)]
struct ClientReport {
    requests: u64,
    statuses: BTreeMap<u16, u64>,
    connection_errors: u64,
    /// Answers that are not what a client that owns its flows expects (a 409 `stale`, say).
    unexpected: u64,
    last_unexpected: Option<String>,
    accepted: [u64; 3],
    latencies_us: Vec<u32>,
}

/// `server` and `token` are the global `--server URL --token T` (a token of scope `operate`
/// or `admin` of the tenant to load).
pub fn run(args: LoadtestArgs, server: Option<String>, token: Option<String>) -> Result<Value> {
    match args.command {
        Some(LoadtestCommand::Verify(verify_args)) => verify(&verify_args),
        None => load(args.run, server, token),
    }
}

fn invalid(message: impl Into<String>) -> Error {
    Error::invalid(codes::INVALID_ARGUMENT, message)
}

fn parse_mix(mix: &str) -> Result<[u32; 3]> {
    let parts: Vec<&str> = mix.split(':').collect();
    let bad = || invalid(format!("--mix must be three weights starts:advances:appends (0..=1000), got {mix:?}"));
    if parts.len() != 3 {
        return Err(bad());
    }
    let mut weights = [0_u32; 3];
    for (weight, part) in weights.iter_mut().zip(parts) {
        *weight = part.trim().parse().map_err(|_| bad())?;
        if *weight > 1_000 {
            return Err(bad());
        }
    }
    if weights.iter().all(|w| *w == 0) {
        return Err(bad());
    }
    Ok(weights)
}

fn load(args: RunArgs, server: Option<String>, token: Option<String>) -> Result<Value> {
    let server = server.ok_or_else(|| invalid("--server URL is required (or use `loadtest verify`)"))?;
    let token = token.ok_or_else(|| invalid("--token is required"))?;
    if !(server.starts_with("http://") || server.starts_with("https://")) {
        return Err(invalid(format!("--server must be an http:// URL, got {server:?}")));
    }
    tidemark_core::id::validate_limit("--clients", args.clients, CLIENTS_MAX)?;
    if args.duration_s == 0 || args.duration_s > DURATION_S_MAX {
        return Err(invalid(format!("--duration-s must be 1..={DURATION_S_MAX}")));
    }
    if args.decline_percent > 100 {
        return Err(invalid("--decline-percent must be 0..=100"));
    }
    let weights = parse_mix(&args.mix)?;
    let prefix = args.prefix.unwrap_or_else(|| format!("lt{}", tidemark_engine::now_ms()));
    // The longest id built from the prefix must still be a valid id.
    tidemark_core::id::validate_id("--prefix", &format!("{prefix}-f{}-{}", CLIENTS_MAX, u64::MAX))?;
    let ledger = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&args.ledger)
        .map_err(|e| invalid(format!("cannot create the ledger {}: {e}", args.ledger.display())))?;

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::io(format!("cannot start the async runtime: {e}")))?;
    let settings = Settings {
        base: server.trim_end_matches('/').to_string(),
        token,
        prefix,
        weights,
        decline_percent: args.decline_percent,
        deadline: Instant::now(),
    };
    let admin_token = args.admin_token.unwrap_or_else(|| settings.token.clone());
    runtime.block_on(drive(settings, admin_token, args.clients, args.duration_s, args.seed, ledger, &args.ledger))
}

async fn drive(
    mut settings: Settings,
    admin_token: String,
    clients: usize,
    duration_s: u64,
    seed: u64,
    ledger: std::fs::File,
    ledger_path: &Path,
) -> Result<Value> {
    let http = reqwest::Client::builder()
        .timeout(REQUEST_TIMEOUT)
        .pool_max_idle_per_host(clients)
        .build()
        .map_err(|e| Error::io(format!("cannot build the HTTP client: {e}")))?;
    if settings.weights[0] > 0 {
        set_stock(&http, &settings, &admin_token).await?;
    }
    let (sender, receiver) = tokio::sync::mpsc::unbounded_channel::<LedgerEntry>();
    let writer = tokio::task::spawn_blocking(move || write_ledger(ledger, receiver));
    let started = Instant::now();
    settings.deadline = started + Duration::from_secs(duration_s);
    let settings = std::sync::Arc::new(settings);
    let mut tasks = Vec::with_capacity(clients);
    for index in 0..clients {
        let (http, settings, sender) = (http.clone(), settings.clone(), sender.clone());
        let rng = StdRng::seed_from_u64(seed.wrapping_mul(1_000_003).wrapping_add(index as u64));
        tasks.push(tokio::spawn(client(index, http, settings, sender, rng)));
    }
    drop(sender);
    let mut total = ClientReport::default();
    for task in tasks {
        let report = task.await.map_err(|e| Error::Invariant(format!("a load client panicked: {e}")))?;
        total.requests += report.requests;
        for (status, n) in report.statuses {
            *total.statuses.entry(status).or_default() += n;
        }
        total.connection_errors += report.connection_errors;
        total.unexpected += report.unexpected;
        if report.last_unexpected.is_some() {
            total.last_unexpected = report.last_unexpected;
        }
        for (sum, n) in total.accepted.iter_mut().zip(report.accepted) {
            *sum += n;
        }
        total.latencies_us.extend(report.latencies_us);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let written = writer.await.map_err(|e| Error::Invariant(format!("the ledger writer panicked: {e}")))??;
    Ok(summary(&total, clients, elapsed, written, ledger_path))
}

fn summary(total: &ClientReport, clients: usize, elapsed_s: f64, ledger_entries: u64, ledger: &Path) -> Value {
    let mut classes: BTreeMap<String, u64> = BTreeMap::new();
    for (status, n) in &total.statuses {
        *classes.entry(format!("{}xx", status / 100)).or_default() += n;
    }
    let statuses: BTreeMap<String, u64> = total.statuses.iter().map(|(s, n)| (s.to_string(), *n)).collect();
    let server_errors = total.statuses.iter().filter(|(s, _)| **s >= 500).map(|(_, n)| n).sum::<u64>();
    let mut latencies = total.latencies_us.clone();
    latencies.sort_unstable();
    let percentile = |p: f64| -> f64 {
        if latencies.is_empty() {
            return 0.0;
        }
        let rank = ((p * latencies.len() as f64).ceil() as usize).clamp(1, latencies.len());
        f64::from(latencies[rank - 1]) / 1_000.0
    };
    let rate = |n: u64| (n as f64 / elapsed_s.max(1e-9) * 10.0).round() / 10.0;
    let [starts, advances, appends] = total.accepted;
    json!({
        "outcome": "loaded",
        "clients": clients,
        "elapsed_s": (elapsed_s * 100.0).round() / 100.0,
        "requests": total.requests,
        "by_status_class": classes,
        "by_status": statuses,
        "server_errors": server_errors,
        "rate_limited": total.statuses.get(&429).copied().unwrap_or(0),
        "connection_errors": total.connection_errors,
        "unexpected_answers": total.unexpected,
        "last_unexpected_answer": total.last_unexpected,
        "accepted": {"starts": starts, "advances": advances, "appends": appends, "total": starts + advances + appends},
        "rate_per_s": {
            "requests": rate(total.requests),
            "accepted": rate(starts + advances + appends),
            "starts": rate(starts),
            "advances": rate(advances),
            "appends": rate(appends),
        },
        "latency_ms": {"p50": percentile(0.50), "p99": percentile(0.99), "max": percentile(1.0)},
        "ledger": ledger,
        "ledger_entries": ledger_entries,
    })
}

async fn set_stock(http: &reqwest::Client, settings: &Settings, admin_token: &str) -> Result<()> {
    let url = format!("{}/v1/stock/{}", settings.base, sku(settings));
    let response = http
        .put(url)
        .bearer_auth(admin_token)
        .json(&json!({"quantity": LOAD_STOCK}))
        .send()
        .await
        .map_err(|e| Error::io(format!("cannot reach {}: {e}", settings.base)))?;
    let status = response.status();
    if !status.is_success() {
        let body = response.text().await.unwrap_or_default();
        return Err(invalid(format!(
            "setting the stock answered {status}: {body} (orders need stock: give an admin token with --admin-token)"
        )));
    }
    Ok(())
}

fn sku(settings: &Settings) -> String {
    format!("{}-sku", settings.prefix)
}

/// Write entries as they come; flush whenever the queue is empty, so that the file is current
/// while the load runs (a test may read it to time a crash).
/// Also the ledger writer of `tidemark chaos`, whose entries are its own.
pub(crate) fn write_ledger<T: Serialize>(
    file: std::fs::File,
    mut receiver: tokio::sync::mpsc::UnboundedReceiver<T>,
) -> Result<u64> {
    let mut out = std::io::BufWriter::new(file);
    let mut written = 0_u64;
    let io = |e: std::io::Error| Error::io(format!("cannot write the ledger: {e}"));
    while let Some(entry) = receiver.blocking_recv() {
        let mut next = Some(entry);
        while let Some(entry) = next.take() {
            serde_json::to_writer(&mut out, &entry).map_err(|e| Error::io(e.to_string()))?;
            out.write_all(b"\n").map_err(io)?;
            written += 1;
            next = receiver.try_recv().ok();
        }
        out.flush().map_err(io)?;
    }
    out.flush().map_err(io)?;
    out.get_ref().sync_all().map_err(io)?;
    Ok(written)
}

/// A reservation flow this client owns: its id and the seq it last saw.
struct OwnedFlow {
    flow_id: String,
    seq: i64,
}

/// The states a reservation flow goes through, one advance each (also `tidemark chaos`'s).
pub(crate) const FLOW_STATES: [&str; 3] = ["reserved", "confirmed", "released"];

async fn client(
    index: usize,
    http: reqwest::Client,
    settings: std::sync::Arc<Settings>,
    ledger: tokio::sync::mpsc::UnboundedSender<LedgerEntry>,
    mut rng: StdRng,
) -> ClientReport {
    let mut report = ClientReport::default();
    let (mut runs, mut flows) = (0_u64, 0_u64);
    let mut flow: Option<OwnedFlow> = None;
    let stream = format!("{}-s{index}", settings.prefix);
    let weight_sum: u32 = settings.weights.iter().sum();
    while Instant::now() < settings.deadline {
        let mut pick = rng.gen_range(0..weight_sum);
        let mut op = Op::Append;
        for (candidate, weight) in [Op::Start, Op::Advance, Op::Append].into_iter().zip(settings.weights) {
            if pick < weight {
                op = candidate;
                break;
            }
            pick -= weight;
        }
        // What a 2xx answer puts in the ledger, for a start (advances and appends: the answer).
        let mut started: Option<LedgerEntry> = None;
        let (path, body) = match op {
            Op::Start => {
                runs += 1;
                let run_id = format!("{}-r{index}-{runs}", settings.prefix);
                let declined = rng.gen_range(0..100) < settings.decline_percent;
                let mut input = json!({"order_id": run_id, "sku": sku(&settings), "quantity": 1, "amount": 100});
                if declined {
                    input["fail"] = json!("charge_payment");
                }
                let expect = if declined { "compensated" } else { "completed" };
                let body = json!({"workflow": "order_saga", "run_id": run_id, "input": input});
                started = Some(LedgerEntry::Run { run_id, expect: expect.into() });
                ("/v1/runs".to_string(), body)
            }
            Op::Advance => {
                let owned = flow.get_or_insert_with(|| {
                    flows += 1;
                    OwnedFlow { flow_id: format!("{}-f{index}-{flows}", settings.prefix), seq: 0 }
                });
                let to = FLOW_STATES[owned.seq as usize];
                let body = json!({"expected_seq": owned.seq, "to": to, "quantity": 1 + (index % 5) as i64});
                (format!("/v1/flows/{}/advance", owned.flow_id), body)
            }
            Op::Append => {
                let body = json!({"event_type": "load.tick", "payload": {"client": index}});
                (format!("/v1/streams/{stream}/events"), body)
            }
        };
        let began = Instant::now();
        let answer =
            http.post(format!("{}{path}", settings.base)).bearer_auth(&settings.token).json(&body).send().await;
        let response = match answer {
            Ok(response) => response,
            Err(_) => {
                report.connection_errors += 1;
                // The answer never came: whether it committed is unknown, so the flow is given up.
                if op == Op::Advance {
                    flow = None;
                }
                tokio::time::sleep(RECONNECT_PAUSE).await;
                continue;
            }
        };
        let status = response.status().as_u16();
        let text = response.text().await;
        report.requests += 1;
        report.latencies_us.push(u32::try_from(began.elapsed().as_micros()).unwrap_or(u32::MAX));
        *report.statuses.entry(status).or_default() += 1;
        let Ok(text) = text else {
            report.connection_errors += 1;
            if op == Op::Advance {
                flow = None;
            }
            continue;
        };
        let answer: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let accepted = match op {
            _ if !(200..300).contains(&status) => None,
            Op::Start => started,
            Op::Advance => committed("advance", &answer),
            Op::Append => committed("append", &answer),
        };
        match accepted {
            Some(accepted) => {
                report.accepted[op as usize] += 1;
                if let (Op::Advance, Some(owned)) = (op, flow.as_mut()) {
                    owned.seq += 1;
                    if owned.seq as usize == FLOW_STATES.len() {
                        flow = None;
                    }
                }
                // The receiver lives until every client is done.
                let _ = ledger.send(accepted);
            }
            None if status == 429 => {}
            None => {
                report.unexpected += 1;
                report.last_unexpected =
                    Some(format!("{status} {path}: {}", text.chars().take(300).collect::<String>()));
                if op == Op::Advance {
                    flow = None;
                }
            }
        }
    }
    report
}

/// The ledger entry of a `committed` answer.
fn committed(op: &str, answer: &Value) -> Option<LedgerEntry> {
    if answer["outcome"] != "committed" {
        return None;
    }
    Some(LedgerEntry::Event {
        op: op.into(),
        flow_id: answer["flow_id"].as_str()?.to_string(),
        seq: answer["seq"].as_i64()?,
        event_id: answer["event_id"].as_str()?.to_string(),
    })
}

/// Where `verify` looks a tenant's entries up: its SQLite files, or its PostgreSQL schemas.
enum Stored {
    Sqlite { producer: rusqlite::Connection, workflows: rusqlite::Connection },
    Postgres { client: postgres::Client, producer: String, workflows: String },
}

impl Stored {
    fn open(args: &VerifyArgs) -> Result<Stored> {
        if let Some(store) = &args.store {
            let location = match tidemark_core::location::StoreLocation::parse(store)? {
                tidemark_core::location::StoreLocation::Postgres(location) => location,
                tidemark_core::location::StoreLocation::Sqlite(_) => {
                    return Err(invalid("--store takes the server's postgres:// URL; a SQLite server's is --data"))
                }
            };
            let backend = tidemark_server::Postgres::new(&location)?;
            let [producer, workflows] = [tidemark_server::Database::Producer, tidemark_server::Database::Workflows]
                .map(|database| backend.schema(&args.tenant, database));
            return Ok(Stored::Postgres {
                client: tidemark_store_postgres::connect(&location.conn)?,
                producer,
                workflows,
            });
        }
        let data = args.data.as_deref().expect("clap requires --data or --store");
        let dir = tidemark_server::tenant::dir_of(data, &args.tenant);
        let [producer_path, workflows_path] = [dir.join("producer.db"), dir.join("workflows.db")];
        for path in [&producer_path, &workflows_path] {
            if !path.is_file() {
                return Err(Error::invalid(
                    codes::NOT_INITIALIZED,
                    format!("{} does not exist (wrong --data or --tenant?)", path.display()),
                ));
            }
        }
        Ok(Stored::Sqlite {
            producer: tidemark_store_sqlite::open_existing(&producer_path)?,
            workflows: tidemark_store_sqlite::open_existing(&workflows_path)?,
        })
    }

    fn outbox_event_id(&mut self, flow_id: &str, seq: i64) -> Result<Option<String>> {
        match self {
            Stored::Sqlite { producer, .. } => stats::outbox_event_id(producer, flow_id, seq),
            Stored::Postgres { client, producer, .. } => {
                tidemark_store_postgres::stats::outbox_event_id(client, producer, flow_id, seq)
            }
        }
    }

    fn run_status(&mut self, run_id: &str) -> Result<Option<(String, bool)>> {
        match self {
            Stored::Sqlite { workflows, .. } => stats::run_status(workflows, run_id),
            Stored::Postgres { client, workflows, .. } => {
                tidemark_store_postgres::stats::run_status(client, workflows, run_id)
            }
        }
    }
}

/// Read the ledger and look every entry up in the tenant's files.
fn verify(args: &VerifyArgs) -> Result<Value> {
    tidemark_core::tenancy::validate_tenant_id(&args.tenant)?;
    let file = std::fs::File::open(&args.ledger)
        .map_err(|e| invalid(format!("cannot read the ledger {}: {e}", args.ledger.display())))?;
    let mut stored = Stored::open(args)?;

    let mut entries = 0_usize;
    let (mut events, mut runs) = (0_u64, 0_u64);
    let mut problems: Vec<String> = Vec::new();
    let mut problem_count = 0_u64;
    let mut by_status: BTreeMap<String, u64> = BTreeMap::new();
    let (mut unfinished, mut unexpected_end, mut runs_leased) = (0_u64, 0_u64, 0_u64);
    let mut problem = |text: String| {
        problem_count += 1;
        if problems.len() < PROBLEMS_LISTED_MAX {
            problems.push(text);
        }
    };
    let mut reader = BufReader::new(file);
    let mut line = String::new();
    loop {
        line.clear();
        let read = (&mut reader)
            .take(LEDGER_LINE_BYTES_MAX as u64 + 1)
            .read_line(&mut line)
            .map_err(|e| invalid(format!("cannot read the ledger: {e}")))?;
        if read == 0 {
            break;
        }
        entries += 1;
        if read > LEDGER_LINE_BYTES_MAX || entries > LEDGER_ENTRIES_MAX {
            return Err(invalid(format!(
                "ledger line {entries}: lines are at most {LEDGER_LINE_BYTES_MAX} bytes, ledgers at most {LEDGER_ENTRIES_MAX} lines"
            )));
        }
        let entry: LedgerEntry = serde_json::from_str(line.trim_end())
            .map_err(|e| invalid(format!("ledger line {entries} is not a ledger entry: {e}")))?;
        match entry {
            LedgerEntry::Event { op, flow_id, seq, event_id } => {
                events += 1;
                match stored.outbox_event_id(&flow_id, seq)? {
                    Some(found) if found == event_id => {}
                    Some(found) => problem(format!(
                        "{op} {flow_id}#{seq}: the outbox holds event {found}, the server answered {event_id}"
                    )),
                    None => problem(format!("{op} {flow_id}#{seq} (event {event_id}) is not in the outbox")),
                }
            }
            LedgerEntry::Run { run_id, expect } => {
                runs += 1;
                match stored.run_status(&run_id)? {
                    Some((status, leased)) => {
                        runs_leased += u64::from(leased);
                        let terminal =
                            tidemark_core::workflow::RunStatus::parse(&status).is_some_and(|s| s.is_terminal());
                        if !terminal {
                            unfinished += 1;
                        } else if status != expect {
                            unexpected_end += 1;
                            problem(format!("run {run_id} ended {status}, expected {expect}"));
                        }
                        *by_status.entry(status).or_default() += 1;
                    }
                    None => problem(format!("run {run_id} is not in the database")),
                }
            }
        }
    }
    let passed = problem_count == 0;
    Ok(json!({
        "outcome": if passed { "verified" } else { "lost" },
        "check": {"passed": passed},
        "entries": entries,
        "events": events,
        "runs": runs,
        "runs_by_status": by_status,
        "runs_unfinished": unfinished,
        "runs_leased": runs_leased,
        "runs_ended_unexpectedly": unexpected_end,
        "problems": problem_count,
        "first_problems": problems,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mix_is_three_bounded_weights() {
        assert_eq!(parse_mix("1:2:1").unwrap(), [1, 2, 1]);
        assert_eq!(parse_mix("0:1:0").unwrap(), [0, 1, 0]);
        for bad in ["", "1:2", "1:2:3:4", "a:1:1", "0:0:0", "1:1:1001", "-1:1:1"] {
            assert_eq!(parse_mix(bad).unwrap_err().code(), codes::INVALID_ARGUMENT, "{bad}");
        }
    }

    #[test]
    fn only_committed_answers_become_ledger_entries() {
        let answer = json!({"outcome": "committed", "flow_id": "f", "seq": 2, "event_id": "e", "state": "confirmed"});
        assert_eq!(
            committed("advance", &answer),
            Some(LedgerEntry::Event { op: "advance".into(), flow_id: "f".into(), seq: 2, event_id: "e".into() })
        );
        assert_eq!(committed("advance", &json!({"outcome": "stale", "flow_id": "f"})), None);
        let line = serde_json::to_string(&LedgerEntry::Run { run_id: "r".into(), expect: "completed".into() }).unwrap();
        assert_eq!(line, r#"{"kind":"run","run_id":"r","expect":"completed"}"#);
    }
}
