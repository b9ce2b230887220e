//! `tidemark demo`: the whole pipeline and the order saga on fresh SQLite files. It prints a
//! narration for a person, one line per step (what happened and why it matters), or with `--json`
//! the run's record as one JSON document. The narration is read from that record ([`narrate`]), so
//! every outcome and number it states is one this run observed.

use std::path::PathBuf;

use clap::Args;
use serde_json::{json, Value};
use tidemark_core::store::{ConsumerStore, ProducerStore};
use tidemark_core::Result;
use tidemark_engine::RelayOptions;

use crate::pipeline::Pipeline;
use crate::Context;

/// The arguments of `tidemark demo`.
#[derive(Args)]
pub struct DemoArgs {
    /// Keep the files in this folder (created if missing) instead of a temporary one.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Print the run's record as one JSON document instead of the narration.
    #[arg(long)]
    json: bool,
}

impl DemoArgs {
    /// True with `--json`: the caller prints the record as JSON rather than [`narrate`] it.
    pub fn prints_json(&self) -> bool {
        self.json
    }
}

// The labels of the outbox and inbox steps in the record (`steps[].step`): `narrate` finds each
// step's result by its label.
const STEP_RESERVE: &str = "advance order-1 new -> reserved (quantity 3, schema v1)";
const STEP_CONFIRM: &str = "advance order-1 reserved -> confirmed";
const STEP_STALE: &str = "advance order-1 with a stale expected_seq";
const STEP_SKIP: &str = "advance order-2 new -> confirmed (skipping a state)";
const STEP_SCHEMA_V2: &str = "advance order-2 new -> reserved with schema v2 (payload.units)";
const STEP_RELAY: &str = "relay: every event to audit and search (one consumer and one producer transaction per batch)";
const STEP_DRAIN_V1: &str = "drain audit with the v1-only decoders: order-2 is blocked, order-1 applies";
const STEP_DRAIN_V2: &str = "drain audit again with support_v2: the blocked record applies unchanged";
const STEP_DRAIN_SEARCH: &str = "drain search (an independent consumer applies each event once too)";
const STEP_REDELIVER: &str = "redeliver order-1 seq 1 to audit";
const STEP_FORGED: &str = "deliver order-1 seq 1 with the same id and a different amount";

/// Run the demo in a fresh folder (`--dir`, which must hold no demo files, else `already_exists`;
/// or a temporary one, removed when the demo returns) and return its record: every outbox and inbox
/// step with its result, the consumers' projections and effects, and the workflow runs with their
/// journals and payment calls. A saga run that does not finish, or a worker process that never
/// journals its first step, is an invariant error.
pub fn run(ctx: &Context, args: DemoArgs) -> Result<Value> {
    let temp = tempfile::tempdir().map_err(|e| tidemark_core::Error::io(e.to_string()))?;
    let dir = match &args.dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).map_err(|e| tidemark_core::Error::io(format!("{}: {e}", dir.display())))?;
            if ["producer.db", "consumer.db", "workflows.db"].iter().any(|f| dir.join(f).exists()) {
                return Err(tidemark_core::Error::invalid(
                    tidemark_core::codes::ALREADY_EXISTS,
                    format!("{} already holds demo files; pick an empty folder", dir.display()),
                ));
            }
            dir.clone()
        }
        None => temp.path().to_path_buf(),
    };
    let now = ctx.now_ms();
    let mut steps: Vec<Value> = Vec::new();
    let mut p = Pipeline::create(&dir, "shop", &["audit", "search"], ctx.durability, now)?;
    let mut step = |what: &str, result: Value| steps.push(json!({"step": what, "result": result}));

    let r = p.advance("order-1", 0, "reserved", Some(3), 1, now)?;
    step(STEP_RESERVE, serde_json::to_value(&r).unwrap());
    let r = p.advance("order-1", 1, "confirmed", None, 1, now)?;
    step(STEP_CONFIRM, serde_json::to_value(&r).unwrap());
    let r = p.advance("order-1", 1, "released", None, 1, now)?;
    step(STEP_STALE, serde_json::to_value(&r).unwrap());
    let r = p.advance("order-2", 0, "confirmed", Some(5), 1, now)?;
    step(STEP_SKIP, serde_json::to_value(&r).unwrap());
    let r = p.advance("order-2", 0, "reserved", Some(5), 2, now)?;
    step(STEP_SCHEMA_V2, serde_json::to_value(&r).unwrap());

    let report = p.relay_all(&RelayOptions::default(), now, 10)?;
    step(STEP_RELAY, serde_json::to_value(&report).unwrap());
    let report = p.drain("audit", 1_000, false, now)?;
    step(STEP_DRAIN_V1, serde_json::to_value(&report).unwrap());
    let report = p.drain("audit", 1_000, true, now)?;
    step(STEP_DRAIN_V2, serde_json::to_value(&report).unwrap());
    let report = p.drain("search", 1_000, true, now)?;
    step(STEP_DRAIN_SEARCH, serde_json::to_value(&report).unwrap());

    let first = p.producer.snapshot(1)?.outbox.remove(0);
    let outcome = p.consumer.receive_batch(&[("audit", &first)], now)?;
    step(STEP_REDELIVER, serde_json::to_value(&outcome).unwrap());
    let mut forged = first.clone();
    forged.payload = json!({"amount": 999});
    let outcome = p.consumer.receive_batch(&[("audit", &forged)], now)?;
    step(STEP_FORGED, serde_json::to_value(&outcome).unwrap());

    let state = p.consumer_state()?;
    let workflows = workflow_demo::run(ctx, &dir)?;
    Ok(json!({
        "outcome": "demo",
        "files": {
            "producer": p.producer_path,
            "consumer": p.consumer_path,
            "workflows": workflows["files"]["workflows"].clone(),
            "payments": workflows["files"]["payments"].clone(),
            "kept": args.dir.is_some(),
        },
        "steps": steps,
        "final": state,
        "workflows": workflows["runs"].clone(),
    }))
}

/// The narration of a demo run, read from its record (what [`run`] returned): a title, one line per
/// step saying what happened and why it matters, and where to go next. Every outcome and number
/// comes from the record; a step whose outcome is not the one the demo is built to show says so
/// instead of explaining it. Lines fit in 100 columns (a `--dir` path aside).
pub fn narrate(record: &Value) -> String {
    let mut out = vec![
        "tidemark demo: an outbox, two inboxes (audit, search) and an order saga, on fresh SQLite files".to_string(),
        String::new(),
        "The outbox and the inbox".to_string(),
    ];
    out.extend(narrate_pipeline(record));
    out.push(String::new());
    out.push("Durable workflows".to_string());
    out.extend(narrate_workflows(&record["workflows"]));
    out.push(String::new());
    out.push(match (record["files"]["kept"].as_bool(), record["files"]["producer"].as_str()) {
        (Some(true), Some(producer)) => {
            let dir = std::path::Path::new(producer).parent().map(|d| d.display().to_string()).unwrap_or_default();
            format!("The files are kept in {dir}.")
        }
        _ => "The files were in a temporary folder, now removed (demo --dir D keeps them).".to_string(),
    });
    out.push(String::new());
    out.push("Next".to_string());
    out.push("  cargo run --release -- demo --json    this run's whole record, as one JSON document".to_string());
    out.push("  cargo test --workspace --all-features every test, including real-process crash tests".to_string());
    out.push("  README.md (a short tour), docs/library.md (your own code, served), docs/protocol.md".to_string());
    let mut text = out.join("\n");
    text.push('\n');
    text
}

/// One step's line: `what: observed: why`, or, when the outcome is not the expected one,
/// `what: observed, not what the demo expects` (the explanation would not hold).
fn told(what: &str, observed: &str, expected: bool, why: &str) -> String {
    if expected {
        format!("  {what}: {observed}: {why}")
    } else {
        format!("  {what}: {observed}, not what the demo expects")
    }
}

/// The result of the outbox or inbox step labelled `label` (`Null` when the record lacks it).
fn step_result<'a>(record: &'a Value, label: &str) -> &'a Value {
    record["steps"]
        .as_array()
        .and_then(|steps| steps.iter().find(|s| s["step"] == label))
        .map_or(&Value::Null, |s| &s["result"])
}

/// A result's protocol word (`committed`, `duplicate`, `blocked`, ...).
fn word(result: &Value) -> &str {
    result["outcome"].as_str().unwrap_or("missing from the record")
}

fn count(value: &Value) -> u64 {
    value.as_u64().unwrap_or(0)
}

/// `n` and the noun for it: `1 recovery`, `2 recoveries`.
fn counted(n: impl Into<u64>, one: &str, many: &str) -> String {
    let n = n.into();
    format!("{n} {}", if n == 1 { one } else { many })
}

/// An advance's outcome with the seq it names.
fn advanced(result: &Value) -> String {
    match word(result) {
        "committed" => format!("committed (seq {})", count(&result["seq"])),
        "stale" => format!("stale (it is at seq {})", count(&result["current_seq"])),
        other => other.to_string(),
    }
}

fn narrate_pipeline(record: &Value) -> Vec<String> {
    let mut lines = Vec::new();
    let committed = |r: &Value, seq: u64| word(r) == "committed" && count(&r["seq"]) == seq;

    let r = step_result(record, STEP_RESERVE);
    lines.push(told(
        "advance order-1 to reserved",
        &advanced(r),
        committed(r, 1),
        "state and event commit in one transaction",
    ));
    let r = step_result(record, STEP_CONFIRM);
    lines.push(told(
        "advance order-1 to confirmed",
        &advanced(r),
        committed(r, 2),
        "each event takes the flow's next seq",
    ));
    let r = step_result(record, STEP_STALE);
    lines.push(told(
        "advance order-1 from seq 1 again",
        &advanced(r),
        word(r) == "stale",
        "nothing is written; re-read and decide",
    ));
    let r = step_result(record, STEP_SKIP);
    lines.push(told(
        "advance order-2 from new to confirmed",
        &advanced(r),
        word(r) == "invalid_transition",
        "the machine refused to skip a state",
    ));
    let r = step_result(record, STEP_SCHEMA_V2);
    lines.push(told(
        "advance order-2 to reserved, schema v2",
        &advanced(r),
        committed(r, 1),
        "old and new payloads coexist",
    ));

    let r = step_result(record, STEP_RELAY);
    let (attempted, accepted) = (count(&r["attempted"]), count(&r["accepted"]));
    let mut observed = format!("{accepted} of {attempted} deliveries accepted");
    for other in ["duplicate", "conflict", "expired", "failed", "quarantined"] {
        if count(&r[other]) > 0 {
            observed.push_str(&format!(", {} {other}", count(&r[other])));
        }
    }
    lines.push(told(
        "relay to audit and search",
        &observed,
        attempted > 0 && accepted == attempted,
        "custody passes once an inbox has it",
    ));

    let r = step_result(record, STEP_DRAIN_V1);
    let stuck: Vec<String> = r["stuck"]
        .as_array()
        .map(|stuck| stuck.iter().map(|s| format!("{} {}", s["flow_id"].as_str().unwrap_or("?"), word(s))).collect())
        .unwrap_or_default();
    let mut observed = format!("{} applied", count(&r["applied"]));
    if !stuck.is_empty() {
        observed.push_str(&format!(", {}", stuck.join(", ")));
    }
    lines.push(told(
        "drain audit, v1 decoders only",
        &observed,
        word(r) == "blocked" && stuck == ["order-2 blocked"],
        "only that flow waits",
    ));
    let r = step_result(record, STEP_DRAIN_V2);
    lines.push(told(
        "drain audit with the v2 decoders too",
        &format!("{} applied", count(&r["applied"])),
        word(r) == "idle" && count(&r["applied"]) > 0,
        "the blocked record applies as it was stored",
    ));
    let r = step_result(record, STEP_DRAIN_SEARCH);
    lines.push(told(
        "drain search",
        &format!("{} applied", count(&r["applied"])),
        word(r) == "idle" && count(&r["applied"]) > 0,
        "each consumer applies every event once, on its own",
    ));

    let r = &step_result(record, STEP_REDELIVER)[0];
    lines.push(told(
        "redeliver order-1 seq 1 to audit",
        word(r),
        word(r) == "duplicate",
        "recognised, not applied twice",
    ));
    let r = &step_result(record, STEP_FORGED)[0];
    lines.push(told(
        "the same event id with another amount",
        word(r),
        word(r) == "conflict",
        "never applied, never acknowledged",
    ));

    // What the handlers wrote: one effect row per applied event, so a double apply shows.
    let applies: u64 = [STEP_DRAIN_V1, STEP_DRAIN_V2, STEP_DRAIN_SEARCH]
        .iter()
        .map(|s| count(&step_result(record, s)["applied"]))
        .sum();
    let effects = record["final"]["effects"].as_array().cloned().unwrap_or_default();
    let mut per_consumer: std::collections::BTreeMap<&str, u64> = std::collections::BTreeMap::new();
    let mut keys = std::collections::BTreeSet::new();
    for effect in &effects {
        *per_consumer.entry(effect["consumer_id"].as_str().unwrap_or("?")).or_default() += 1;
        keys.insert((effect["consumer_id"].to_string(), effect["flow_id"].to_string(), effect["seq"].to_string()));
    }
    let per_consumer: Vec<String> = per_consumer.iter().map(|(c, n)| format!("{c} {n}")).collect();
    lines.push(told(
        "effects",
        &if per_consumer.is_empty() {
            format!("{} rows for {applies} applies", effects.len())
        } else {
            format!("{} rows for {applies} applies ({})", effects.len(), per_consumer.join(", "))
        },
        applies > 0 && effects.len() as u64 == applies && keys.len() == effects.len(),
        "nothing was applied twice",
    ));
    lines
}

fn narrate_workflows(workflows: &Value) -> Vec<String> {
    let mut lines = Vec::new();
    let runs = workflows["runs"].as_array().cloned().unwrap_or_default();
    let run = |id: &str| runs.iter().find(|r| r["run_id"] == id).cloned().unwrap_or(Value::Null);
    let status = |run: &Value| run["status"].as_str().unwrap_or("missing from the record").to_string();
    // The journal lines read `<seq> <name> (<kind>): <status>, attempts <n>`.
    let journal = |run: &Value| -> Vec<(String, String)> {
        run["journal"]
            .as_array()
            .map(|entries| {
                entries
                    .iter()
                    .filter_map(|e| {
                        let (head, status) = e.as_str()?.split_once(": ")?;
                        let name = head.split_whitespace().nth(1)?;
                        Some((name.to_string(), status.split(',').next()?.to_string()))
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    // The payment calls read `<op> <idempotency key> -> <outcome>`.
    let calls = |run: &Value| -> Vec<(String, String)> {
        run["payment_calls"]
            .as_array()
            .map(|calls| {
                calls
                    .iter()
                    .filter_map(|c| {
                        let (head, outcome) = c.as_str()?.split_once(" -> ")?;
                        Some((head.split_whitespace().nth(1)?.to_string(), outcome.to_string()))
                    })
                    .collect()
            })
            .unwrap_or_default()
    };

    let ok = run("order-ok");
    let charges = calls(&ok);
    let keys: std::collections::BTreeSet<&str> = charges.iter().map(|(key, _)| key.as_str()).collect();
    let charged = charges.iter().filter(|(_, outcome)| outcome == "charged").count();
    lines.push(told(
        "order-ok",
        &format!(
            "{}; {}, {}, {}",
            status(&ok),
            counted(charges.len() as u64, "payment call", "payment calls"),
            counted(keys.len() as u64, "idempotency key", "idempotency keys"),
            counted(charged as u64, "charge", "charges")
        ),
        status(&ok) == "completed" && keys.len() == 1 && charged == 1,
        "retries never charge twice",
    ));

    let declined = run("order-declined");
    let released = journal(&declined).iter().any(|(n, s)| n == "compensate:reserve_inventory" && s == "completed");
    lines.push(told(
        "order-declined",
        &status(&declined),
        status(&declined) == "compensated" && released,
        "the card was declined, so the reservation was released",
    ));

    let no_carrier = run("order-no-carrier");
    let undone: Vec<&str> = journal(&no_carrier)
        .iter()
        .filter_map(|(name, _)| match name.as_str() {
            "compensate:charge_payment" => Some("refund"),
            "compensate:reserve_inventory" => Some("release"),
            _ => None,
        })
        .collect();
    lines.push(told(
        "order-no-carrier",
        &if undone.is_empty() {
            format!("{}, nothing compensated", status(&no_carrier))
        } else {
            format!("{} ({})", status(&no_carrier), undone.join(", then "))
        },
        status(&no_carrier) == "compensated" && undone == ["refund", "release"],
        "compensations run in reverse order",
    ));

    let killed = run("order-killed");
    let at_kill: Vec<String> = killed["killed_worker"]["journal_at_kill"]
        .as_array()
        .map(|lines| lines.iter().filter_map(|l| Some(l.as_str()?.split_whitespace().nth(1)?.to_string())).collect())
        .unwrap_or_default();
    lines.push(told(
        "worker process 1 killed (SIGKILL)",
        &format!("{} journaled", if at_kill.is_empty() { "nothing".to_string() } else { at_kill.join(", ") }),
        !at_kill.is_empty(),
        "the run waits out its lease",
    ));
    let resumed = &killed["resumed"];
    let recoveries = count(&resumed["recoveries"]);
    lines.push(told(
        &format!("worker process 2, after the {} ms lease", count(&killed["killed_worker"]["lease_ms"])),
        &format!("{} ({})", status(&killed), counted(recoveries, "recovery", "recoveries")),
        status(&killed) == "completed" && recoveries > 0,
        &format!("finished {} ms after the kill", count(&resumed["ms_from_kill_to_finished"])),
    ));
    lines.push(told(
        "reserve_inventory across both processes",
        &counted(count(&resumed["reserve_effects"]), "effect", "effects"),
        resumed["reserve_inventory_executed_once"] == true,
        "replayed from the journal, not run again",
    ));

    let tables = &workflows["order_tables"];
    let stock = tables["stock"]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["sku"] == workflow_demo::SKU))
        .map(|r| count(&r["stock"]));
    let shipped: u64 = tables["reservations"]
        .as_array()
        .map(|rows| rows.iter().filter(|r| r["status"] == "shipped").map(|r| count(&r["quantity"])).sum())
        .unwrap_or(0);
    lines.push(told(
        &format!("{} stock", workflow_demo::SKU),
        &stock.map_or("missing from the record".to_string(), |n| format!("{n} of {} left", workflow_demo::STOCK)),
        stock.is_some_and(|n| n as i64 + shipped as i64 == workflow_demo::STOCK),
        "only shipped orders keep their units",
    ));
    lines
}

/// The workflow part of the demo: the order saga succeeding (through a flaky payment service),
/// compensating after a declined card and after a refused shipment (in reverse order), and a
/// `tidemark worker` process killed with SIGKILL mid-run whose run another process resumes once
/// the lease expires. It runs on the system clock (`--now-ms` does not apply: leases and
/// retries need time to pass) and every wait in it is bounded.
mod workflow_demo {
    use std::path::Path;
    use std::process::{Child, Command, Stdio};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use serde_json::{json, Value};
    use tidemark_builtins::order::tables as order_sql;
    use tidemark_builtins::order::{FakePayments, ORDER_SAGA, ORDER_SAGA_VERSION};
    use tidemark_core::workflow::{RunDetail, StartRequest, WorkflowStore};
    use tidemark_core::{Error, Result};
    use tidemark_engine::workflow::{Worker, WorkerOptions, Writer};
    use tidemark_store_sqlite::{Durability, SqliteWorkflows};

    use crate::Context;
    use tidemark_builtins::order::payments_path;
    use tidemark_builtins::workflows::{self as builtin, SLEEPY_ORDER, SLEEPY_ORDER_VERSION};

    pub(super) const SKU: &str = "widget";
    /// The SKU's stock before the first order.
    pub(super) const STOCK: i64 = 10;
    /// The killed worker's lease: the second process takes over once it has expired.
    const LEASE_MS: i64 = 500;
    /// How long the killed run's `hold` step lasts, from its start.
    const HOLD_MS: i64 = 1_500;
    /// Bounds of the polling loops (each pass sleeps `POLL`).
    const POLLS_MAX: u32 = 1_000;
    const POLL: Duration = Duration::from_millis(10);

    fn io(what: &str) -> impl Fn(std::io::Error) -> Error + '_ {
        move |e| Error::io(format!("{what}: {e}"))
    }

    fn detail(writer: &Writer<SqliteWorkflows>, run_id: &str) -> Result<RunDetail> {
        let id = run_id.to_string();
        writer
            .call_blocking(move |store, _| store.run(&id))?
            .ok_or_else(|| Error::Invariant(format!("the demo run {run_id} is gone")))
    }

    /// The journal in short: one line per step.
    fn steps(detail: &RunDetail) -> Vec<String> {
        detail
            .journal
            .iter()
            .map(|e| {
                format!("{} {} ({}): {}, attempts {}", e.seq, e.name, e.kind.as_str(), e.status.as_str(), e.attempts)
            })
            .collect()
    }

    fn summary(writer: &Writer<SqliteWorkflows>, payments: &FakePayments, run_id: &str) -> Result<Value> {
        let d = detail(writer, run_id)?;
        let calls: Vec<Value> = payments
            .calls()?
            .into_iter()
            .filter(|c| c.order_id == run_id)
            .map(|c| json!(format!("{} {} -> {}", c.op, c.idempotency_key, c.outcome)))
            .collect();
        Ok(json!({
            "run_id": run_id,
            "status": d.run.status,
            "error": d.run.error,
            "journal": steps(&d),
            "payment_calls": calls,
        }))
    }

    fn start(writer: &Writer<SqliteWorkflows>, workflow: &str, version: u32, run_id: &str, input: Value) -> Result<()> {
        let request = StartRequest::new(run_id, workflow, version, input);
        writer.call_blocking(move |store, now| store.start_runs(&[request], now))?;
        Ok(())
    }

    fn order(run_id: &str, quantity: i64, extra: Value) -> Value {
        let mut input = json!({"order_id": run_id, "sku": SKU, "quantity": quantity, "amount": 100 * quantity});
        if let (Some(input), Some(extra)) = (input.as_object_mut(), extra.as_object()) {
            input.extend(extra.clone());
        }
        input
    }

    /// `tidemark worker` as a child process (the running binary itself).
    fn worker_process(ctx: &Context, db: &Path, payments_db: &Path, worker_id: &str) -> Result<Child> {
        let exe = std::env::current_exe().map_err(io("cannot find the tidemark binary"))?;
        let durability = match ctx.durability {
            Durability::Full => "full",
            Durability::Normal => "normal",
        };
        Command::new(exe)
            .args(["--durability", durability, "worker", "--until-idle", "--poll-ms", "10", "--retry-delay-ms", "10"])
            .args(["--lease-ms", &LEASE_MS.to_string(), "--worker-id", worker_id])
            .arg("--db")
            .arg(db)
            .arg("--payments-db")
            .arg(payments_db)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(io("cannot start a worker process"))
    }

    pub fn run(ctx: &Context, dir: &Path) -> Result<Value> {
        let db = dir.join("workflows.db");
        let payments_db = payments_path(&db);
        let (path, durability) = (db.clone(), ctx.durability);
        let writer = Writer::spawn(move || SqliteWorkflows::init_with(&path, durability))?;
        writer.call_blocking(|store, _| {
            order_sql::install(store.connection())?;
            order_sql::set_stock(store.connection(), SKU, STOCK)
        })?;
        let payments = Arc::new(FakePayments::open(&payments_db)?);
        let mut runs: Vec<Value> = Vec::new();

        // 1. In process: one worker runs three orders of the saga.
        start(&writer, ORDER_SAGA, ORDER_SAGA_VERSION, "order-ok", order("order-ok", 2, json!({"flaky_attempts": 2})))?;
        start(
            &writer,
            ORDER_SAGA,
            ORDER_SAGA_VERSION,
            "order-declined",
            order("order-declined", 1, json!({"fail": "charge_payment"})),
        )?;
        start(
            &writer,
            ORDER_SAGA,
            ORDER_SAGA_VERSION,
            "order-no-carrier",
            order("order-no-carrier", 3, json!({"fail": "ship_order"})),
        )?;
        let retry = builtin::retry_policy(5, Some(10))?;
        let workflows = builtin::workflows(payments.clone(), &retry)?;
        let options = WorkerOptions { poll_interval_ms: 10, lease_ms: 5_000, ..WorkerOptions::new("demo-in-process") };
        let worker = Worker::new(writer.clone(), workflows, options)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(io("cannot start the async runtime"))?;
        let ids = ["order-ok", "order-declined", "order-no-carrier"];
        let mut rounds = 0;
        loop {
            runtime.block_on(worker.run_until_idle())?;
            rounds += 1;
            let mut finished = true;
            for id in ids {
                finished &= detail(&writer, id)?.run.status.is_terminal();
            }
            if finished {
                break;
            }
            if rounds >= POLLS_MAX {
                return Err(Error::Invariant("the demo's saga runs did not finish".into()));
            }
            std::thread::sleep(POLL);
        }
        drop(worker);
        for (id, what) in [
            ("order-ok", "order saga: reserve -> charge (the payment service is unavailable twice: retried with the same idempotency key) -> ship"),
            ("order-declined", "order saga: the card is declined; the reservation is released (compensate:reserve_inventory)"),
            ("order-no-carrier", "order saga: the carrier refuses; compensations run in reverse order: refund, then release"),
        ] {
            let mut summary = summary(&writer, &payments, id)?;
            summary["what"] = json!(what);
            runs.push(summary);
        }

        // 2. A worker process killed with SIGKILL mid-run; a second process resumes the run.
        let run_id = "order-killed";
        let hold_until_ms = tidemark_engine::now_ms() + HOLD_MS;
        start(
            &writer,
            SLEEPY_ORDER,
            SLEEPY_ORDER_VERSION,
            run_id,
            order(run_id, 1, json!({"hold_until_ms": hold_until_ms})),
        )?;
        let mut first = worker_process(ctx, &db, &payments_db, "demo-worker-1")?;
        let mut journaled = false;
        for _ in 0..POLLS_MAX {
            let d = detail(&writer, run_id)?;
            if d.journal.first().is_some_and(|e| e.status.is_settled()) {
                journaled = true;
                break;
            }
            if first.try_wait().map_err(io("worker process"))?.is_some() {
                break;
            }
            std::thread::sleep(POLL);
        }
        first.kill().map_err(io("cannot kill the worker process"))?;
        first.wait().map_err(io("worker process"))?;
        let killed_at = Instant::now();
        if !journaled {
            return Err(Error::Invariant("the first worker never journaled its first step".into()));
        }
        let at_kill = detail(&writer, run_id)?;
        let mut second_report = Value::Null;
        for _ in 0..POLLS_MAX {
            // Nothing to take over before the dead worker's lease expires.
            if let Some(expires) = detail(&writer, run_id)?.run.lease_expires_at_ms {
                let wait = expires - tidemark_engine::now_ms();
                if wait > 0 {
                    std::thread::sleep(Duration::from_millis(wait.min(LEASE_MS) as u64 + 1));
                }
            }
            let second = worker_process(ctx, &db, &payments_db, "demo-worker-2")?;
            let output = second.wait_with_output().map_err(io("worker process"))?;
            second_report = serde_json::from_slice(&output.stdout).unwrap_or(Value::Null);
            if detail(&writer, run_id)?.run.status.is_terminal() {
                break;
            }
            std::thread::sleep(POLL);
        }
        let resumed_after_ms = killed_at.elapsed().as_millis() as u64;
        let after = detail(&writer, run_id)?;
        let reserves = writer
            .call_blocking(|store, _| order_sql::effects(store.connection()))?
            .into_iter()
            .filter(|e| e.order_id == run_id && e.kind == "reserve")
            .count();
        let mut killed = summary(&writer, &payments, run_id)?;
        killed["what"] = json!("sleepy_order in `tidemark worker` processes: the first is killed (SIGKILL) while its `hold` step runs, after reserve_inventory was journaled; a second process takes the run over once the lease has expired and replays the journal");
        killed["killed_worker"] = json!({
            "journal_at_kill": steps(&at_kill),
            "lease_owner": at_kill.run.lease_owner,
            "lease_ms": LEASE_MS,
        });
        killed["resumed"] = json!({
            "by": "demo-worker-2",
            "recoveries": after.run.recoveries,
            "recovered_runs_reported": second_report["recovered"],
            "ms_from_kill_to_finished": resumed_after_ms,
            "note": format!("includes waiting out the dead worker's lease ({LEASE_MS} ms at most) and the rest of the hold step ({HOLD_MS} ms from the start)"),
            "reserve_inventory_attempts": after.journal.first().map(|e| e.attempts),
            "reserve_effects": reserves,
            "reserve_inventory_executed_once": reserves == 1,
        });
        runs.push(killed);

        let tables = writer.call_blocking(|store, _| order_sql::tables(store.connection(), 100_000))?;
        Ok(json!({
            "files": {"workflows": db, "payments": payments_db},
            "runs": {"runs": runs, "order_tables": tables},
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unexpected_outcome_is_told_as_it_is_never_explained_away() {
        // A record where the redelivery was stored again: the narration names what happened and
        // does not claim it was recognised.
        let record = json!({"steps": [{"step": STEP_REDELIVER, "result": [{"outcome": "accepted"}]}]});
        let text = narrate(&record);
        let line = text.lines().find(|l| l.contains("redeliver order-1 seq 1 to audit")).unwrap();
        assert_eq!(line, "  redeliver order-1 seq 1 to audit: accepted, not what the demo expects");
    }

    #[test]
    fn an_empty_record_narrates_without_panicking_and_explains_nothing() {
        let text = narrate(&json!({}));
        assert!(text.contains("  advance order-1 to reserved: missing from the record, not what the demo expects"));
        assert!(text.contains("  effects: 0 rows for 0 applies, not what the demo expects"), "{text}");
        assert!(text.contains("  widget stock: missing from the record, not what the demo expects"), "{text}");
    }
}
