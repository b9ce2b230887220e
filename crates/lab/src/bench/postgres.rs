//! `tidemark bench --store postgres://...`: what only the PostgreSQL bench runs.
//!
//! - **fresh schemas**: every store of the run is a new schema named `<schema>_<run>` (the URL's
//!   `?schema=` is the prefix); one that exists already is refused (`already_exists`, nothing
//!   written), and every schema the run made is dropped at its end, also when it fails.
//! - **the ceilings**: pgbench (a child process) commits single-row INSERTs into a scratch table
//!   of its own schema with 1 client and with 8 clients (`-c 8 -j 2`); its `tps =` line is the
//!   server's commit rate on this machine. Without pgbench the ceilings (and their ratios) are
//!   skipped and the output says so.
//! - **worker processes**: the order sagas started here, then worked by one, then by two
//!   `tidemark worker --store postgres://... --payments-db F --until-idle` processes (this
//!   binary), timed from their spawn to the last one's exit, with the CPU time of the workers
//!   (this process's reaped children) and of every PostgreSQL process beside it.
//! - the PostgreSQL server's CPU time is read from `/proc`: every process named `postgres`, plus
//!   what the postmaster has reaped from backends that exited (`cutime` + `cstime`), so the
//!   connections of processes that ended are counted too. `None` when the server is not on this
//!   machine (or not readable).
//!
//! PostgreSQL's durability is the server's: nothing here sets `synchronous_commit` or `fsync`;
//! the settings are read and reported.

use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde_json::{json, Value};
use tidemark_builtins::order::FakePayments;
use tidemark_core::error::codes;
use tidemark_core::location::PostgresLocation;
use tidemark_core::{Error, Result};
use tidemark_store_postgres::{validate_schema_name, PgWorkflows};

use super::workflows::{self, load_average, process_cpu_seconds, stat_fields, Params, World, WAIT_MAX};
use super::{failed, round1, round3};

/// Where the PostgreSQL bench makes its stores: schemas `<prefix>_<name>` on one server.
#[derive(Clone)]
pub(super) struct PgPlace {
    /// The driver's connection string (the `--store` URL without `schema`).
    pub conn: String,
    prefix: String,
    made: Arc<Mutex<Vec<String>>>,
}

impl PgPlace {
    pub(super) fn new(location: &PostgresLocation) -> Result<PgPlace> {
        validate_schema_name(&location.schema).map_err(|e| Error::invalid(codes::INVALID_STORE, e.to_string()))?;
        Ok(PgPlace { conn: location.conn.clone(), prefix: location.schema.clone(), made: Default::default() })
    }

    /// The schema of the store `name`.
    pub(super) fn schema_of(&self, name: &str) -> String {
        format!("{}_{}", self.prefix, name.replace('-', "_"))
    }

    /// The schema of `name`, checked to be new (`already_exists` otherwise), remembered to be
    /// dropped at the end of the run. Nothing is created here.
    pub(super) fn fresh_schema(&self, name: &str) -> Result<String> {
        let schema = self.schema_of(name);
        validate_schema_name(&schema)?;
        let mut client = tidemark_store_postgres::connect(&self.conn)?;
        let exists = client
            .query_one("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", &[&schema])
            .map_err(Error::from)?
            .get::<_, bool>(0);
        if exists {
            return Err(Error::invalid(
                codes::ALREADY_EXISTS,
                format!("schema {schema} exists; the bench runs on fresh schemas (pick another ?schema= prefix)"),
            ));
        }
        self.made.lock().unwrap_or_else(|p| p.into_inner()).push(schema.clone());
        Ok(schema)
    }

    /// `postgres://...?schema=<the schema of name>`, for a `tidemark worker --store`.
    fn store_url(&self, name: &str) -> String {
        let separator = if self.conn.contains('?') { '&' } else { '?' };
        format!("{}{separator}schema={}", self.conn, self.schema_of(name))
    }

    /// Drop every schema the run made (what [`Cleanup`] does when dropped).
    fn drop_made(&self) -> Vec<String> {
        let made: Vec<String> = std::mem::take(&mut *self.made.lock().unwrap_or_else(|p| p.into_inner()));
        let Ok(mut client) = tidemark_store_postgres::connect(&self.conn) else { return made };
        let mut dropped = Vec::new();
        for schema in made {
            if client.batch_execute(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE")).is_ok() {
                dropped.push(schema);
            }
        }
        dropped
    }
}

/// Drops the schemas of a [`PgPlace`] when it goes (after every store of the run was closed).
pub(super) struct Cleanup(pub PgPlace);

impl Cleanup {
    /// Drop them now; the names of those dropped.
    pub(super) fn finish(self) -> Vec<String> {
        self.0.drop_made()
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        self.0.drop_made();
    }
}

/// Connect once before anything is made: an unreachable server or a refused login is an `io`
/// error here, and nothing has been written. Returns the server's durability settings.
pub(super) fn server_settings(conn: &str) -> Result<Value> {
    let mut client = tidemark_store_postgres::connect(conn)?;
    let mut settings = serde_json::Map::new();
    for name in ["server_version", "synchronous_commit", "fsync", "full_page_writes", "wal_sync_method", "commit_delay"]
    {
        let row = client
            .query_one("SELECT setting FROM pg_settings WHERE name = $1", &[&name])
            .map_err(|e| Error::io(format!("cannot read the server's settings: {e}")))?;
        settings.insert(name.to_string(), json!(row.get::<_, String>(0)));
    }
    Ok(Value::Object(settings))
}

/// CPU seconds of the PostgreSQL server so far (see the module's documentation).
pub(super) fn server_cpu_seconds() -> Option<f64> {
    let mut ticks = 0_u64;
    let mut found = false;
    for entry in std::fs::read_dir("/proc").ok()? {
        let Ok(entry) = entry else { continue };
        let name = entry.file_name();
        let Some(pid) = name.to_str().filter(|n| n.bytes().all(|b| b.is_ascii_digit())) else { continue };
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if comm.trim_end() != "postgres" {
            continue;
        }
        let Some(fields) = stat_fields(pid) else { continue };
        let (ppid, utime, stime) = (fields.get(1)?, fields.get(11)?, fields.get(12)?);
        ticks += utime + stime;
        let parent = std::fs::read_to_string(format!("/proc/{ppid}/comm")).unwrap_or_default();
        if parent.trim_end() != "postgres" {
            // The postmaster: its reaped children (backends that exited) too.
            ticks += fields.get(13)? + fields.get(14)?;
        }
        found = true;
    }
    found.then(|| ticks as f64 / 100.0)
}

/// CPU seconds of this process's reaped children (`cutime` + `cstime` of `/proc/self/stat`).
fn children_cpu_seconds() -> Option<f64> {
    let fields = stat_fields("self")?;
    Some((fields.get(13)? + fields.get(14)?) as f64 / 100.0)
}

/// pgbench's single-row INSERT commits per second at `clients` clients (`threads` threads), for
/// `seconds`, into a scratch table of `schema` (created and dropped here; the schema is the
/// run's and dropped with it). `Ok(None)` when pgbench is not installed.
fn pgbench(
    place: &PgPlace,
    schema: &str,
    dir: &Path,
    clients: u32,
    threads: u32,
    seconds: u64,
) -> Result<Option<Value>> {
    let mut client = tidemark_store_postgres::connect(&place.conn)?;
    client
        .batch_execute(&format!(
            "CREATE SCHEMA IF NOT EXISTS \"{schema}\"; CREATE TABLE IF NOT EXISTS \"{schema}\".scratch (v bigint)"
        ))
        .map_err(Error::from)?;
    let script = dir.join("pgbench-insert.sql");
    let statement = format!("INSERT INTO \"{schema}\".scratch (v) VALUES (1);\n");
    std::fs::write(&script, &statement).map_err(|e| Error::io(format!("{}: {e}", script.display())))?;
    let server_cpu = server_cpu_seconds();
    let started = Instant::now();
    let output = Command::new("pgbench")
        .args(["-n", "-f"])
        .arg(&script)
        .args(["-T", &seconds.to_string(), "-c", &clients.to_string(), "-j", &threads.to_string()])
        .arg(&place.conn)
        .stdin(Stdio::null())
        .output();
    let output = match output {
        Ok(output) => output,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(format!("cannot run pgbench: {e}"))),
    };
    let wall = started.elapsed().as_secs_f64();
    let server_cpu = server_cpu_seconds().zip(server_cpu).map(|(end, start)| end - start);
    client.batch_execute(&format!("DROP TABLE IF EXISTS \"{schema}\".scratch")).map_err(Error::from)?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let tps = stdout
        .lines()
        .find_map(|line| line.strip_prefix("tps = "))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse::<f64>().ok());
    let Some(tps) = tps.filter(|_| output.status.success()) else {
        return Err(failed(format!(
            "pgbench failed ({}): {}{}",
            output.status,
            stdout.trim(),
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    };
    let transactions = stdout
        .lines()
        .find_map(|line| line.strip_prefix("number of transactions actually processed: "))
        .and_then(|n| n.trim().parse::<u64>().ok());
    Ok(Some(json!({
        "clients": clients,
        "threads": threads,
        "seconds": seconds,
        "commits_per_s": round1(tps),
        "transactions": transactions,
        "server_cpu_seconds": server_cpu.map(round3),
        "server_cpu_share_of_wall": server_cpu.map(|c| round3(c / wall.max(1e-9))),
        "script": statement.trim(),
        "command": format!("pgbench -n -f <script> -T {seconds} -c {clients} -j {threads} <url>"),
    })))
}

/// Both pgbench ceilings (1 client, 8 clients), or why they were skipped.
pub(super) fn ceilings(place: &PgPlace, dir: &Path, seconds: u64) -> Result<Value> {
    if seconds == 0 {
        return Ok(json!({"skipped": "--pgbench-seconds 0"}));
    }
    let schema = place.fresh_schema("pgbench")?;
    let Some(one) = pgbench(place, &schema, dir, 1, 1, seconds)? else {
        println_skip("pgbench is not installed: the ceilings and their ratios are skipped");
        return Ok(json!({"skipped": "pgbench is not installed (not on PATH)"}));
    };
    let eight = pgbench(place, &schema, dir, 8, 2, seconds)?;
    Ok(json!({
        "what": "pgbench's single-row INSERT commits per second on the same server, one transaction each \
                 (the server's own durability: each commit waits for its WAL flush)",
        "one_client": one,
        "eight_clients": eight,
    }))
}

fn println_skip(message: &str) {
    eprintln!("bench: {message}");
}

/// A `tidemark worker` child, killed if dropped before it exited.
struct WorkerChild(Option<Child>);

impl Drop for WorkerChild {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The order sagas started here, then worked by `processes` `tidemark worker` processes, each
/// with `--concurrency in_flight`; timed from their spawn to the last one's exit.
fn worker_processes(place: &PgPlace, dir: &Path, p: &Params, processes: usize) -> Result<Value> {
    let name = format!("processes-{processes}");
    let payments_db = dir.join(format!("payments-{processes}.db"));
    let payments = Arc::new(FakePayments::open(&payments_db)?);
    let world = World::<PgWorkflows>::with_payments(place, &name, p.process_sagas as i64, p.skus, payments)?;
    let ids: Vec<String> = (0..p.process_sagas).map(|i| format!("order-{i:08}")).collect();
    world.start_all(&ids)?;
    let program = std::env::current_exe().map_err(|e| Error::io(format!("cannot find this program's path: {e}")))?;
    let url = place.store_url(&name);
    let args = |i: usize| -> Vec<String> {
        [
            "worker",
            "--store",
            &url,
            "--payments-db",
            &payments_db.display().to_string(),
            "--until-idle",
            "--concurrency",
            &p.in_flight.to_string(),
            "--poll-ms",
            "10",
            "--worker-id",
            &format!("bench-process-{i}"),
        ]
        .map(String::from)
        .into()
    };
    let children_cpu = children_cpu_seconds();
    let server_cpu = server_cpu_seconds();
    let started = Instant::now();
    let mut children = Vec::new();
    for i in 0..processes {
        let child = Command::new(&program)
            .args(args(i))
            .env_remove("TIDEMARK_CRASH_AT")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| Error::io(format!("cannot start {}: {e}", program.display())))?;
        children.push(WorkerChild(Some(child)));
    }
    let mut reports = Vec::new();
    let mut exits_ms = Vec::new();
    for mut child in children {
        let mut process = child.0.take().expect("spawned above");
        let (mut stdout, mut stderr) = (String::new(), String::new());
        // The report is one JSON document at the end: read it whole, then wait.
        if let Some(mut out) = process.stdout.take() {
            let _ = out.read_to_string(&mut stdout);
        }
        if let Some(mut err) = process.stderr.take() {
            let _ = err.read_to_string(&mut stderr);
        }
        let status = process.wait().map_err(|e| Error::io(format!("waiting for a worker process: {e}")))?;
        exits_ms.push(round1(started.elapsed().as_secs_f64() * 1_000.0));
        if !status.success() || started.elapsed() > WAIT_MAX {
            return Err(failed(format!("a worker process ended {status}: {}{}", stdout.trim(), stderr.trim())));
        }
        let report: Value = serde_json::from_str(&stdout).unwrap_or(Value::Null);
        reports.push(json!({
            "completed": report["completed"],
            "claimed": report["claimed"],
            "errors": report["errors"],
            "max_in_flight": report["max_in_flight"],
        }));
    }
    let seconds = started.elapsed().as_secs_f64();
    let workers_cpu = children_cpu_seconds().zip(children_cpu).map(|(end, start)| end - start);
    let server_cpu = server_cpu_seconds().zip(server_cpu).map(|(end, start)| end - start);
    let check = world.check(p.process_sagas)?;
    let per_saga_ms = |c: f64| round3(c * 1_000.0 / p.process_sagas.max(1) as f64);
    Ok(json!({
        "processes": processes,
        "sagas": p.process_sagas,
        "concurrency_per_process": p.in_flight,
        "seconds": round3(seconds),
        "sagas_per_s": round1(p.process_sagas as f64 / seconds.max(1e-9)),
        "exits_ms_after_spawn": exits_ms,
        "workers": reports,
        "cpu_seconds": {
            "worker_processes": workers_cpu.map(round3),
            "postgres": server_cpu.map(round3),
            "postgres_share_of_wall": server_cpu.map(|c| round3(c / seconds.max(1e-9))),
            "worker_ms_per_saga": workers_cpu.map(per_saga_ms),
            "postgres_ms_per_saga": server_cpu.map(per_saga_ms),
        },
        "payments_db": payments_db,
        "check": check,
        "what": "every saga started by the bench, then worked by this many `tidemark worker --store postgres://... \
                 --payments-db F --until-idle` processes sharing the schema (the fake payment service's call log \
                 in one SQLite file F, synchronous=FULL); timed from the spawn of the processes to the exit of the \
                 last (their start-up included)",
    }))
}

/// `bench --workflows --store postgres://...`.
pub fn run_workflows(location: &PostgresLocation, dir: &Path, p: &Params) -> Result<Value> {
    let place = PgPlace::new(location)?;
    let settings = server_settings(&location.conn)?;
    let cleanup = Cleanup(place.clone());
    let load = load_average();
    let ceilings = ceilings(&place, dir, p.pgbench_seconds)?;
    let (mut out, rate, mut all_passed) = workflows::run_on::<PgWorkflows>(&place, p)?;
    let mut processes = Value::Null;
    let mut process_ratio = None;
    if p.process_sagas > 0 {
        let one = worker_processes(&place, dir, p, 1)?;
        let two = worker_processes(&place, dir, p, 2)?;
        all_passed &= one["check"]["passed"] == json!(true) && two["check"]["passed"] == json!(true);
        let rate_of = |v: &Value| v["sagas_per_s"].as_f64().unwrap_or(0.0);
        process_ratio = (rate_of(&one) > 0.0).then(|| round3(rate_of(&two) / rate_of(&one)));
        processes = json!({"one": one, "two": two, "two_to_one_ratio": process_ratio});
    }
    let one_client = ceilings["one_client"]["commits_per_s"].as_f64();
    let eight_clients = ceilings["eight_clients"]["commits_per_s"].as_f64();
    out["store"] = json!(location.masked);
    out["durability"] = json!("the PostgreSQL server's own (never changed by tidemark)");
    out["server"] = settings;
    out["params"]["process_sagas"] = json!(p.process_sagas);
    out["params"]["pgbench_seconds"] = json!(p.pgbench_seconds);
    out["params"]["load_average_at_start"] = json!(load);
    out["params"]["load_average_at_end"] = json!(load_average());
    out["params"]["this_process_cpu_seconds"] = json!(process_cpu_seconds().map(round3));
    out["ceilings"] = ceilings;
    out["worker_processes"] = processes;
    let summary = &mut out["summary"];
    summary["pgbench_one_client_commits_per_s"] = json!(one_client);
    summary["pgbench_eight_clients_commits_per_s"] = json!(eight_clients);
    summary["sagas_per_pgbench_one_client_commit"] = json!(one_client.map(|c| round3(rate / c.max(1e-9))));
    summary["sagas_per_pgbench_eight_clients_commit"] = json!(eight_clients.map(|c| round3(rate / c.max(1e-9))));
    summary["two_worker_processes_to_one_ratio"] = json!(process_ratio);
    summary["targets"]["two_worker_processes_at_least_1_4x_one"] = json!(process_ratio.map(|r| r >= 1.4));
    out["check"] = json!({
        "passed": all_passed,
        "what": "every run: every saga completed, one reserve and one ship effect per order, one charge per key",
    });
    out["params"]["schemas_dropped"] = json!(cleanup.finish());
    Ok(out)
}
