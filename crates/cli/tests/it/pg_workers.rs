//! Many `tidemark worker` processes on one PostgreSQL database (issue "PostgreSQL"): workers
//! killed with SIGKILL at random moments from a seed, and the database itself stopped with
//! `pg_ctl stop -m immediate` in the middle of the load, then started again. Afterwards every
//! start the command line acknowledged is there and has completed, every order was reserved and
//! shipped exactly once, every order was charged once, and the stock adds up.
//!
//! The database is a private cluster this test creates ([`crate::pg_cluster::Cluster`]), on a
//! port of its own, so that stopping it disturbs no other test. Skipped, saying why, when
//! PostgreSQL's programs are not installed.
//! `TIDEMARK_PG_FAULT_SEED` replays a fault schedule (the seed is printed).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use crate::pg_cluster::Cluster;
use crate::support::{path_str, run, BIN};

/// A `tidemark worker` process of slot `slot`.
fn spawn_worker(url: &str, payments: &Path, slot: usize, generation: usize) -> Child {
    Command::new(BIN)
        .args([
            "worker",
            "--store",
            url,
            "--payments-db",
            path_str(payments),
            "--worker-id",
            &format!("w{slot}-{generation}"),
            "--concurrency",
            "8",
            "--lease-ms",
            "1500",
            "--poll-ms",
            "50",
            "--retry-delay-ms",
            "100",
            "--max-attempts",
            "50",
            "--max-seconds",
            "600",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn a worker")
}

fn order(order_id: &str, extra: Value) -> Value {
    let mut input = json!({"order_id": order_id, "sku": "sku-1", "quantity": 1, "amount": 100});
    input.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    input
}

/// `workflow start`; true when the command line acknowledged it (exit 0).
fn start(url: &str, workflow: &str, run_id: &str, input: &Value) -> bool {
    let input = input.to_string();
    let r = run(&["workflow", "start", "--store", url, "--workflow", workflow, "--run-id", run_id, "--input", &input]);
    r.code == 0
}

/// Every run's status (runs of the order saga and the batches, children included).
fn statuses(url: &str) -> Option<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    let mut after: Option<String> = None;
    loop {
        let mut args = vec!["workflow", "list", "--store", url, "--limit", "1000"];
        if let Some(after) = &after {
            args.extend(["--after", after.as_str()]);
        }
        let r = run(&args);
        if r.code != 0 {
            return None;
        }
        for run in r.json["runs"].as_array()? {
            out.insert(run["run_id"].as_str()?.to_string(), run["status"].as_str()?.to_string());
        }
        match r.json["next_after"].as_str() {
            Some(next) => after = Some(next.to_string()),
            None => return Some(out),
        }
    }
}

#[test]
fn four_workers_killed_at_random_and_a_database_crash_lose_no_acknowledged_start_and_apply_nothing_twice() {
    let Some(mut cluster) = Cluster::create() else { return };
    cluster.start();
    let url = cluster.url("shop");
    let work = tempfile::tempdir().unwrap();
    let payments = work.path().join("payments.db");
    const STOCK: i64 = 1_000_000;
    let init = run(&["workflow", "init", "--store", &url, "--sku", "sku-1", "--quantity", &STOCK.to_string()]);
    assert_eq!(init.code, 0, "{}{}", init.stdout, init.stderr);

    // Acknowledged before the faults: sagas (a few with a flaky payment service) and batches
    // whose orders run as child sagas.
    let mut acked: Vec<String> = Vec::new();
    let mut orders = 0_i64;
    for i in 0..12 {
        let id = format!("saga-{i}");
        // Some with a flaky payment service, most with a durable timer before the shipment, so
        // that runs are in flight (leased, sleeping, retrying) when the faults come.
        let extra = if i % 4 == 0 { json!({"flaky_attempts": 2}) } else { json!({"ship_after_ms": 300 * (i % 5)}) };
        assert!(start(&url, "order_saga", &id, &order(&id, extra)));
        acked.push(id);
        orders += 1;
    }
    for b in 0..8 {
        let id = format!("batch-{b}");
        let batch: Vec<Value> = (0..6).map(|o| order(&format!("{id}-o{o}"), json!({"ship_after_ms": 250}))).collect();
        assert!(start(&url, "order_batch", &id, &json!({"orders": batch})));
        acked.push(id);
        orders += 6;
    }

    let seed: u64 = std::env::var("TIDEMARK_PG_FAULT_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 % 100_000
    });
    println!("fault seed {seed} (TIDEMARK_PG_FAULT_SEED={seed} replays the schedule)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);

    let mut generation = 0;
    let mut workers: Vec<Child> = (0..4).map(|slot| spawn_worker(&url, &payments, slot, 0)).collect();
    let (mut kills, mut restarts, mut late_acked, mut late_refused) = (0, 0, 0, 0);
    let crash_at = rng.gen_range(2..6);
    // Faults while the load runs: a worker killed every 200-700 ms (and started again, as a
    // supervisor would), one database crash, and more starts, some of them while the database
    // is down (those are refused, never acknowledged).
    for round in 0..14 {
        std::thread::sleep(Duration::from_millis(rng.gen_range(200..700)));
        let slot = rng.gen_range(0..workers.len());
        let _ = workers[slot].kill();
        let _ = workers[slot].wait();
        kills += 1;
        generation += 1;
        if round == crash_at {
            // Runs that cannot have ended when the database goes down (their timer is longer
            // than the wait before the crash): claimed, reserved, sleeping or about to be.
            for k in 0..3 {
                let id = format!("pre-crash-{k}");
                assert!(start(&url, "order_saga", &id, &order(&id, json!({"ship_after_ms": 1_000}))));
                acked.push(id);
                orders += 1;
            }
            std::thread::sleep(Duration::from_millis(rng.gen_range(50..400)));
            let in_flight = statuses(&url).expect("the store answers").values().filter(|s| *s != "completed").count();
            println!("runs not completed when the database crashes: {in_flight}");
            assert!(in_flight >= 3, "{in_flight}");
            cluster.crash();
            let id = format!("late-down-{round}");
            // The database is down: this start must not be acknowledged.
            if start(&url, "order_saga", &id, &order(&id, json!({}))) {
                panic!("a start was acknowledged while the database was down");
            }
            late_refused += 1;
            std::thread::sleep(Duration::from_millis(rng.gen_range(100..1_500)));
            cluster.start();
            restarts += 1;
        }
        workers[slot] = spawn_worker(&url, &payments, slot, generation);
        // A worker that exited by itself (it should not) is started again too, and counted.
        for (other, worker) in workers.iter_mut().enumerate() {
            if let Ok(Some(status)) = worker.try_wait() {
                println!("worker slot {other} exited by itself ({status}); started again");
                generation += 1;
                *worker = spawn_worker(&url, &payments, other, generation);
            }
        }
        let id = format!("late-{round}");
        if start(&url, "order_saga", &id, &order(&id, json!({}))) {
            acked.push(id);
            orders += 1;
            late_acked += 1;
        }
    }
    println!("faults: {kills} workers killed, {restarts} database crash(es); late starts: {late_acked} acknowledged, {late_refused} refused");

    // The faults stop; the surviving workers converge by themselves (bounded).
    let deadline = Instant::now() + Duration::from_secs(240);
    let final_statuses = loop {
        if let Some(statuses) = statuses(&url) {
            if statuses.values().all(|s| s == "completed") && acked.iter().all(|id| statuses.contains_key(id)) {
                break statuses;
            }
            if Instant::now() >= deadline {
                let open: Vec<_> = statuses.iter().filter(|(_, s)| *s != "completed").collect();
                panic!("runs did not all complete within 240 s after the faults (seed {seed}): {open:?}");
            }
        }
        assert!(Instant::now() < deadline, "the store did not answer after the faults (seed {seed})");
        std::thread::sleep(Duration::from_millis(250));
    };
    for worker in &mut workers {
        let _ = Command::new("kill").args(["-TERM", &worker.id().to_string()]).status();
    }
    for worker in &mut workers {
        let _ = worker.wait();
    }

    // Every acknowledged start is there and completed (the late one refused while the database
    // was down is not there); every child saga of the batches too.
    for id in &acked {
        assert_eq!(final_statuses.get(id).map(String::as_str), Some("completed"), "{id} (seed {seed})");
    }
    assert!(final_statuses.keys().all(|id| !id.starts_with("late-down-")), "{final_statuses:?}");
    // The sagas: each top-level saga, each batch's children (`<batch>.<seq>`).
    let sagas = final_statuses.keys().filter(|id| !id.starts_with("batch-") || id.contains('.')).count() as i64;
    assert_eq!(sagas, orders, "one saga run per order (seed {seed}): {final_statuses:?}");

    // Effects: one reserve and one ship per order, nothing released; stock adds up.
    let tables = run(&["workflow", "orders", "--store", &url]);
    assert_eq!(tables.code, 0, "{}", tables.stderr);
    let mut effects: BTreeMap<(String, String), u64> = BTreeMap::new();
    for effect in tables.json["effects"].as_array().unwrap() {
        let key = (effect["order_id"].as_str().unwrap().to_string(), effect["kind"].as_str().unwrap().to_string());
        *effects.entry(key).or_default() += 1;
    }
    let twice: Vec<_> = effects.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "an effect applied more than once (seed {seed}): {twice:?}");
    let count = |kind: &str| effects.keys().filter(|(_, k)| k == kind).count() as i64;
    assert_eq!((count("reserve"), count("ship"), count("release")), (orders, orders, 0), "(seed {seed})");
    let stock = tables.json["stock"][0]["stock"].as_i64().unwrap();
    assert_eq!(stock, STOCK - orders, "(seed {seed})");

    // Payments: each order charged exactly once (a retried call answered `duplicate`).
    let calls = run(&["workflow", "payments", "--store", &url, "--payments-db", path_str(&payments)]);
    assert_eq!(calls.code, 0, "{}", calls.stderr);
    let mut charged: BTreeMap<String, u64> = BTreeMap::new();
    for call in calls.json["calls"].as_array().unwrap() {
        if call["outcome"] == "charged" {
            *charged.entry(call["order_id"].as_str().unwrap().to_string()).or_default() += 1;
        }
    }
    assert_eq!(charged.len() as i64, orders, "every order charged (seed {seed})");
    assert!(charged.values().all(|n| *n == 1), "an order charged twice (seed {seed}): {charged:?}");
    println!(
        "{} runs completed ({orders} orders) after {kills} SIGKILLs and {restarts} database crash(es)",
        final_statuses.len()
    );
}

/// A fresh schema (dropped first, if a crashed run left it) of the shared test server, as a
/// `--store` URL, and a connection to the server.
fn shared_server(schema: &str) -> Option<(String, postgres::Client)> {
    let (base, mut client) = crate::support::postgres_server()?;
    client.batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE")).unwrap();
    Some((crate::support::with_schema(&base, schema), client))
}

#[test]
fn the_workflow_commands_run_on_a_postgres_store_and_refuse_bad_stores_with_typed_errors() {
    let schema = format!("cli_{}", std::process::id());
    let Some((url, mut admin)) = shared_server(&schema) else { return };
    let dir = tempfile::tempdir().unwrap();
    let payments = dir.path().join("payments.db");
    let code = |r: &crate::support::Run| r.json["error"]["code"].as_str().unwrap_or_default().to_string();

    // Bad stores, each before anything is written.
    let r = run(&["workflow", "list", "--store", "mysql://127.0.0.1/test"]);
    assert_eq!((r.code, code(&r)), (2, "invalid_store".into()), "{}", r.stdout);
    let r = run(&["workflow", "list", "--store", "postgres://postgres@127.0.0.1:1/test?connect_timeout=2"]);
    assert_eq!((r.code, code(&r)), (1, "io".into()), "{}", r.stdout);
    assert!(r.stdout.contains("Connection refused"), "{}", r.stdout);
    let r = run(&["workflow", "list", "--store", &url]);
    assert_eq!((r.code, code(&r)), (2, "not_initialized".into()), "{}", r.stdout);
    let r = run(&["--durability", "normal", "workflow", "init", "--store", &url]);
    assert_eq!((r.code, code(&r)), (2, "invalid_argument".into()), "{}", r.stdout);
    let exists = |admin: &mut postgres::Client| -> bool {
        admin.query_one("SELECT count(*) FROM pg_namespace WHERE nspname = $1", &[&schema]).unwrap().get::<_, i64>(0)
            == 1
    };
    assert!(!exists(&mut admin), "a refused command created the schema");
    let secret = url.replace("postgres@", "postgres:hunter2@");
    let r = run(&["workflow", "list", "--store", &secret]);
    assert!(!r.stdout.contains("hunter2") && !r.stderr.contains("hunter2"), "{}{}", r.stdout, r.stderr);

    // The commands on PostgreSQL, as on a file.
    let r = run(&["workflow", "init", "--store", &url, "--sku", "sku-1", "--quantity", "10"]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert_eq!((r.json["schema"].as_str(), r.json["stock"]["stock"].as_i64()), (Some(schema.as_str()), Some(10)));
    assert!(start(&url, "order_saga", "o1", &order("o1", json!({}))));
    assert!(start(&url, "order_saga", "o2", &order("o2", json!({"fail": "ship_order"}))));
    let other = order("o1", json!({"amount": 7})).to_string();
    let r =
        run(&["workflow", "start", "--store", &url, "--workflow", "order_saga", "--run-id", "o1", "--input", &other]);
    assert_eq!(code(&r), "run_conflict", "the same run id with another input: {}", r.stdout);
    let r = run(&["worker", "--store", &url]);
    assert_eq!((r.code, code(&r)), (2, "invalid_argument".into()), "no --payments-db: {}", r.stdout);
    let r = run(&[
        "worker",
        "--store",
        &url,
        "--payments-db",
        path_str(&payments),
        "--until-idle",
        "--retry-delay-ms",
        "10",
    ]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert_eq!((r.json["completed"].as_u64(), r.json["compensated"].as_u64()), (Some(1), Some(1)), "{}", r.stdout);
    let result = |run_id: &str| run(&["workflow", "result", "--store", &url, "--run-id", run_id]).json;
    assert_eq!(result("o1")["status"], "completed");
    assert_eq!(result("o2")["status"], "compensated");
    let shown = run(&["workflow", "show", "--store", &url, "--run-id", "o1"]).json;
    let steps: Vec<&str> = shown["journal"].as_array().unwrap().iter().filter_map(|s| s["name"].as_str()).collect();
    assert!(steps.contains(&"reserve_inventory") && steps.contains(&"ship_order"), "{shown}");
    let tables = run(&["workflow", "orders", "--store", &url]).json;
    assert_eq!(tables["stock"][0]["stock"], 9, "o1 shipped one unit, o2's reservation was released: {tables}");
    let r = run(&["workflow", "cancel", "--store", &url, "--run-id", "nope", "--reason", "test"]);
    assert_eq!(code(&r), "not_found", "{}", r.stdout);
    let queue = run(&["queue", "put", "--store", &url, "--name", "q1", "--concurrency", "2"]);
    assert_eq!(queue.code, 0, "{}", queue.stdout);
    assert_eq!(run(&["queue", "list", "--store", &url]).json["queues"][0]["name"], "q1");

    // A schema written by a newer tidemark is refused, never downgraded.
    admin.execute(&format!("INSERT INTO {schema}.schema_versions (version) VALUES (1000)"), &[]).unwrap();
    let r = run(&["workflow", "list", "--store", &url]);
    assert_eq!((r.code, code(&r)), (2, "schema_too_new".into()), "{}", r.stdout);
    admin.batch_execute(&format!("DROP SCHEMA {schema} CASCADE")).unwrap();
}

/// `LISTEN/NOTIFY` as a wake-up hint: a worker that polls once an hour runs a saga started by
/// another process, and a run waiting for an event goes on when another process sends it, each
/// long before its next poll (the waits are bounded at a minute; without the hint they would
/// take an hour).
#[test]
fn a_worker_that_polls_once_an_hour_is_woken_by_starts_and_events_from_other_processes() {
    let schema = format!("wake_{}", std::process::id());
    let Some((url, mut admin)) = shared_server(&schema) else { return };
    let dir = tempfile::tempdir().unwrap();
    let payments = dir.path().join("payments.db");
    let init = run(&["workflow", "init", "--store", &url, "--sku", "sku-1", "--quantity", "10"]);
    assert_eq!(init.code, 0, "{}", init.stderr);
    let worker = Command::new(BIN)
        .args(["worker", "--store", &url, "--payments-db", path_str(&payments), "--poll-ms", "3600000"])
        .args(["--max-seconds", "300"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The worker's first claim (at its start) finds nothing; everything after is woken.
    std::thread::sleep(Duration::from_millis(500));
    let ended = |run_id: &str| {
        let r = run(&["workflow", "result", "--store", &url, "--run-id", run_id, "--wait-ms", "60000"]);
        (
            r.json["outcome"].as_str().unwrap_or_default().to_string(),
            r.json["status"].as_str().unwrap_or_default().to_string(),
        )
    };
    assert!(start(&url, "order_saga", "woken", &order("woken", json!({}))));
    assert_eq!(ended("woken"), ("ended".to_string(), "completed".to_string()));
    assert!(start(&url, "sleepy_order", "approve-me", &order("approve-me", json!({"approval": "ok"}))));
    // It runs to its wait (woken by the start), then waits for the event.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let shown = run(&["workflow", "show", "--store", &url, "--run-id", "approve-me"]).json;
        if shown["run"]["status"] == "waiting" {
            break;
        }
        assert!(Instant::now() < deadline, "the run never reached its wait: {shown}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let sent = run(&[
        "workflow",
        "send-event",
        "--store",
        &url,
        "--run-id",
        "approve-me",
        "--name",
        "ok",
        "--payload",
        r#"{"approved": true}"#,
    ]);
    assert_eq!(sent.code, 0, "{}", sent.stdout);
    assert_eq!(ended("approve-me"), ("ended".to_string(), "completed".to_string()));
    let _ = Command::new("kill").args(["-TERM", &worker.id().to_string()]).status();
    let out = worker.wait_with_output().unwrap();
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["stopped_by"], "signal", "{report}");
    admin.batch_execute(&format!("DROP SCHEMA {schema} CASCADE")).unwrap();
}
