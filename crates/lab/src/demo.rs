//! `tidemark demo`: the whole pipeline on fresh SQLite files, narrated as JSON.

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
}

/// Run the demo in a fresh folder (`--dir`, which must hold no demo files, else
/// `already_exists`; or a temporary one, removed when the demo returns) and return its record:
/// every outbox and inbox step with its result, the consumers' projections and effects, and the
/// workflow runs with their journals and payment calls. A saga run that does not finish, or a
/// worker process that never journals its first step, is an invariant error.
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
    step("advance order-1 new -> reserved (quantity 3, schema v1)", serde_json::to_value(&r).unwrap());
    let r = p.advance("order-1", 1, "confirmed", None, 1, now)?;
    step("advance order-1 reserved -> confirmed", serde_json::to_value(&r).unwrap());
    let r = p.advance("order-1", 1, "released", None, 1, now)?;
    step("advance order-1 with a stale expected_seq", serde_json::to_value(&r).unwrap());
    let r = p.advance("order-2", 0, "confirmed", Some(5), 1, now)?;
    step("advance order-2 new -> confirmed (skipping a state)", serde_json::to_value(&r).unwrap());
    let r = p.advance("order-2", 0, "reserved", Some(5), 2, now)?;
    step("advance order-2 new -> reserved with schema v2 (payload.units)", serde_json::to_value(&r).unwrap());

    let report = p.relay_all(&RelayOptions::default(), now, 10)?;
    step(
        "relay: every event to audit and search (one consumer and one producer transaction per batch)",
        serde_json::to_value(&report).unwrap(),
    );
    let report = p.drain("audit", 1_000, false, now)?;
    step(
        "drain audit with the v1-only decoders: order-2 is blocked, order-1 applies",
        serde_json::to_value(&report).unwrap(),
    );
    let report = p.drain("audit", 1_000, true, now)?;
    step(
        "drain audit again with support_v2: the blocked record applies unchanged",
        serde_json::to_value(&report).unwrap(),
    );
    let report = p.drain("search", 1_000, true, now)?;
    step("drain search (an independent consumer applies each event once too)", serde_json::to_value(&report).unwrap());

    let first = p.producer.snapshot(1)?.outbox.remove(0);
    let outcome = p.consumer.receive_batch(&[("audit", &first)], now)?;
    step("redeliver order-1 seq 1 to audit", serde_json::to_value(&outcome).unwrap());
    let mut forged = first.clone();
    forged.payload = json!({"amount": 999});
    let outcome = p.consumer.receive_batch(&[("audit", &forged)], now)?;
    step("deliver order-1 seq 1 with the same id and a different amount", serde_json::to_value(&outcome).unwrap());

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

    const SKU: &str = "widget";
    const STOCK: i64 = 10;
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
        let request = StartRequest {
            run_id: run_id.into(),
            workflow: workflow.into(),
            version,
            input,
            key: None,
            start_at_ms: None,
        };
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
