//! A user's own machine, handler and workflow, defined here and not in any tidemark crate, in an
//! embedded service: driven over real HTTP, the process killed with SIGKILL mid-run, restarted
//! on the same data folder, every request retried. Nothing acknowledged is lost and nothing is
//! applied twice, which the test checks by reading the files itself (plain SQLite, not the
//! service). Then a real browser clicks through the user workflow's run page.
//!
//! The service runs in a child process: this test binary started again with `CHILD_DATA` set,
//! running only `embedded_service_child`.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tidemark::prelude::*;
use tidemark::rusqlite::{self, OpenFlags};
use tidemark::service::Config;
use tidemark::sqlite::advance_committed_in;

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

const CHILD_DATA: &str = "TIDEMARK_EMBEDDED_DATA";
const TENANT: &str = "main";
const FLOWS: usize = 20;
const RUNS: usize = 8;
/// How long a run's external `label` step takes: long enough that runs are in it when the
/// process is killed.
const LABEL_MS: u64 = 1_500;
const WAIT: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------------------------
// The user's code.
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Default, Serialize, Deserialize)]
struct Parcel {
    weight_grams: i64,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ParcelInput {
    weight_grams: Option<i64>,
}

#[derive(Debug, Serialize, Deserialize)]
struct ParcelEvent {
    weight_grams: i64,
}

/// parcel.new -> packed -> shipped.
struct ParcelMachine;

impl Machine for ParcelMachine {
    type Data = Parcel;
    type Input = ParcelInput;
    type Event = ParcelEvent;
    const NAME: &'static str = "parcel";
    const STATES: &'static [&'static str] = &["parcel.new", "packed", "shipped"];

    fn decide(
        &self,
        from: &str,
        data: &Parcel,
        to: &str,
        input: ParcelInput,
    ) -> Result<Transition<Parcel, ParcelEvent>, String> {
        let weight_grams = match (from, to) {
            ("parcel.new", "packed") => input.weight_grams.ok_or("packing needs weight_grams")?,
            ("packed", "shipped") => data.weight_grams,
            _ => return Err(format!("a parcel cannot move from {from} to {to}")),
        };
        Ok(Transition {
            data: Parcel { weight_grams },
            event_type: format!("parcel.{to}"),
            event: ParcelEvent { weight_grams },
        })
    }
}

/// Writes one `tally` row per applied event; the table has no unique constraint, so an event
/// applied twice would show as two rows.
#[derive(Clone)]
struct Tally;

impl EventHandler<Connection> for Tally {
    type Event = ParcelEvent;

    fn handle(
        &mut self,
        tx: &Connection,
        consumer_id: &str,
        envelope: &Envelope,
        event: ParcelEvent,
    ) -> Result<(), HandleError> {
        tx.execute(
            "INSERT INTO tally (consumer_id, flow_id, seq, event_type, weight_grams) VALUES (?1, ?2, ?3, ?4, ?5)",
            (consumer_id, &envelope.flow_id, envelope.seq, &envelope.event_type, event.weight_grams),
        )
        .map_err(|e| HandleError::Failed(e.into()))?;
        Ok(())
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Ship {
    order: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct Shipped {
    label: String,
}

/// The file where the external `label` step logs every call with its idempotency key (what a
/// label provider would see).
static LABEL_LOG: OnceLock<PathBuf> = OnceLock::new();

fn log_label_call(key: &str) -> std::io::Result<()> {
    let path = LABEL_LOG.get().expect("the child set the log path");
    let mut file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
    // One write per line: concurrent steps append whole lines (O_APPEND), never interleaved.
    file.write_all(format!("{key}\n").as_bytes())?;
    file.sync_all()
}

/// reserve (transactional) -> label (external, slow) -> dispatch (transactional).
async fn ship(ctx: Context, input: Ship) -> Result<Shipped, WorkflowError> {
    let order = input.order.clone();
    let _: i64 = ctx
        .tx_step("reserve", None, move |tx: &Connection| {
            tx.execute("INSERT INTO reservations (order_id) VALUES (?1)", [&order])?;
            Ok(tx.last_insert_rowid())
        })
        .await?;
    let label: String = ctx
        .step("label", None, move |key| async move {
            log_label_call(&key).map_err(|e| StepFailure::retryable(e.to_string()))?;
            tokio::time::sleep(Duration::from_millis(LABEL_MS)).await;
            Ok(format!("label-{key}"))
        })
        .await?;
    let (order, l) = (input.order.clone(), label.clone());
    ctx.tx_step("dispatch", None, move |tx: &Connection| {
        tx.execute("INSERT INTO dispatches (order_id, label) VALUES (?1, ?2)", (&order, &l))?;
        // An event committed with the step (the workflow database's outbox): the `tally`
        // consumer receives it like the producer's.
        let request = AdvanceRequest::new(&format!("d-{order}"), 0, "packed", json!({"weight_grams": 1}));
        advance_committed_in(tx, &ParcelMachine, &request, now_ms())?;
        Ok(())
    })
    .await?;
    Ok(Shipped { label })
}

fn service(data: &Path) -> tidemark::Result<Service> {
    let mut config = Config { data_dir: data.to_path_buf(), ..Config::default() };
    // A short lease, so that the restarted process recovers the killed one's runs soon.
    config.workers.lease_ms = 1_000;
    config.log.level = "warn".into();
    Service::builder()
        .config(config)
        .without_auth(TENANT)
        .flow(ParcelMachine)
        .migration(
            Database::Inbox,
            Migration::sql(
                "0001_tally",
                "CREATE TABLE tally (consumer_id TEXT NOT NULL, flow_id TEXT NOT NULL, seq INTEGER NOT NULL,
                                     event_type TEXT NOT NULL, weight_grams INTEGER NOT NULL)",
            ),
        )
        .consumer("tally", Typed(Tally))
        .migration(
            Database::Workflows,
            Migration::sql(
                "0001_shipping",
                "CREATE TABLE reservations (order_id TEXT NOT NULL);
                 CREATE TABLE dispatches (order_id TEXT NOT NULL, label TEXT NOT NULL);",
            ),
        )
        .workflow(tidemark::workflow("ship", 1, ship))
        .build()
}

/// Runs only in a child started by `Served::start`; in a normal test run it returns at once.
#[test]
fn embedded_service_child() {
    let Ok(data) = std::env::var(CHILD_DATA) else { return };
    let data = PathBuf::from(data);
    LABEL_LOG.set(data.join("label-calls.log")).expect("set once");
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async move {
        let service = service(&data).expect("the service builds");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        println!("{}", json!({"addr": listener.local_addr().unwrap().to_string()}));
        std::io::stdout().flush().unwrap();
        // Serves until the parent kills it.
        service.serve_on(listener, std::future::pending()).await.unwrap();
    });
}

// ---------------------------------------------------------------------------------------------
// The test.
// ---------------------------------------------------------------------------------------------

struct Served {
    child: Child,
    base: String,
}

impl Served {
    fn start(data: &Path) -> Served {
        let mut child = Command::new(std::env::current_exe().expect("the test binary"))
            .args(["embedded_service_child", "--exact", "--nocapture", "--test-threads", "1"])
            .env(CHILD_DATA, data)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the child");
        let stdout = child.stdout.take().expect("piped");
        let mut lines = BufReader::new(stdout).lines();
        let addr = loop {
            let line = lines.next().expect("the child printed its address").expect("readable");
            // The harness prints `test embedded_service_child ... ` before the test's own output.
            let json = line.find('{').map_or("", |at| &line[at..]);
            if let Ok(value) = serde_json::from_str::<Value>(json) {
                break value["addr"].as_str().expect("an address").to_string();
            }
        };
        // Keep draining the child's stdout so that it never blocks on a full pipe.
        std::thread::spawn(move || lines.for_each(drop));
        Served { child, base: format!("http://{addr}") }
    }

    fn kill(mut self) {
        // SIGKILL: no shutdown, no flush, leases held.
        self.child.kill().expect("kill the child");
        self.child.wait().expect("reap the child");
    }
}

impl Drop for Served {
    /// A failing test does not leave its server running (killing a reaped child is a no-op).
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn call(http: &reqwest::blocking::Client, base: &str, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let mut request = http.request(method.parse().unwrap(), format!("{base}{path}"));
    if let Some(body) = body {
        request = request.json(&body);
    }
    match request.send() {
        Ok(response) => {
            let status = response.status().as_u16();
            (status, response.json().unwrap_or(Value::Null))
        }
        Err(_) => (0, Value::Null),
    }
}

/// The requests of the workload: packs, the workflow starts, ships. Each is retried verbatim
/// after the restart.
fn requests() -> Vec<(&'static str, String, Value)> {
    let mut all = Vec::new();
    for i in 1..=FLOWS {
        all.push((
            "POST",
            format!("/v1/flows/p-{i}/advance"),
            json!({"expected_seq": 0, "to": "packed", "input": {"weight_grams": i}}),
        ));
    }
    for i in 1..=RUNS {
        all.push((
            "POST",
            "/v1/runs".to_string(),
            json!({"workflow": "ship", "run_id": format!("r-{i}"), "input": {"order": format!("o-{i}")}}),
        ));
    }
    for i in 1..=FLOWS {
        all.push(("POST", format!("/v1/flows/p-{i}/advance"), json!({"expected_seq": 1, "to": "shipped"})));
    }
    all
}

fn open_read_only(path: &Path) -> rusqlite::Connection {
    rusqlite::Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY).expect("open read-only")
}

fn rows(conn: &rusqlite::Connection, sql: &str) -> Vec<(String, i64)> {
    let mut stmt = conn.prepare(sql).unwrap();
    let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap();
    rows.collect::<Result<_, _>>().unwrap()
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < WAIT, "{what} did not happen within {WAIT:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_user_service_killed_mid_run_loses_nothing_and_applies_nothing_twice() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();

    // 1. The workload; the first process is killed once runs are inside their slow step.
    let first = Served::start(&data);
    let mut acknowledged = Vec::new();
    for (i, (method, path, body)) in requests().into_iter().enumerate() {
        let (status, answer) = call(&http, &first.base, method, &path, Some(body));
        assert!(matches!(status, 200 | 201), "{method} {path}: {status} {answer}");
        acknowledged.push(i);
    }
    wait_until("a run inside its label step", || {
        let (_, run) = call(&http, &first.base, "GET", "/v1/runs/r-1", None);
        run["journal"]
            .as_array()
            .is_some_and(|j| j.iter().any(|e| e["name"] == "reserve" && e["status"] == "completed"))
    });
    first.kill();

    // 2. Restart on the same folder and retry everything: what was acknowledged is there
    //    (its retry is `stale` or `existing`), and the service converges by itself.
    let second = Served::start(&data);
    for (i, (method, path, body)) in requests().into_iter().enumerate() {
        let (status, answer) = call(&http, &second.base, method, &path, Some(body));
        let already = matches!(answer["outcome"].as_str(), Some("stale") | Some("existing"));
        if acknowledged.contains(&i) {
            assert!(already, "an acknowledged request was lost: {method} {path}: {status} {answer}");
        }
    }
    wait_until("every run completed", || {
        (1..=RUNS).all(|i| {
            call(&http, &second.base, "GET", &format!("/v1/runs/r-{i}"), None).1["run"]["status"] == "completed"
        })
    });
    wait_until("the tally consumer applied every event", || {
        let (_, cursors) = call(&http, &second.base, "GET", "/v1/consumers/tally/cursors", None);
        let cursors = cursors["cursors"].as_array().cloned().unwrap_or_default();
        let at = |prefix: &str, seq: i64| {
            cursors
                .iter()
                .filter(|c| c["flow_id"].as_str().is_some_and(|f| f.starts_with(prefix)) && c["high_water_seq"] == seq)
                .count()
        };
        at("p-", 2) == FLOWS && at("d-", 1) == RUNS
    });

    // 3. The user's run page in a real browser (skipped, saying why, without node, its modules
    //    or Chromium; .ci/run installs them).
    let browser = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/browser");
    if Command::new("node").arg("--version").output().is_err()
        || !browser.join("node_modules/playwright-core").exists()
        || !Path::new("/usr/bin/chromium").exists()
    {
        eprintln!("SKIPPED the browser part: node, tests/browser/node_modules or /usr/bin/chromium is missing (.ci/run installs them)");
    } else {
        let output = Command::new("node")
            .arg(browser.join("user_run.mjs"))
            .args([second.base.as_str(), "ship", "r-1", "reserve,label,dispatch"])
            .arg(dir.path().join("artifacts"))
            .output()
            .expect("run node");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "the browser test failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    second.kill();

    // 4. The files, read here with plain SQLite.
    let tenant = data.join("tenants").join(TENANT);
    let producer = open_read_only(&tenant.join("producer.db"));
    let flows = rows(&producer, "SELECT flow_id || ':' || state, last_seq FROM flows ORDER BY flow_id");
    assert_eq!(flows.len(), FLOWS);
    assert!(flows.iter().all(|(f, seq)| f.ends_with(":shipped") && *seq == 2), "{flows:?}");
    let inbox = open_read_only(&tenant.join("inbox.db"));
    let tallies = rows(&inbox, "SELECT flow_id || ':' || seq, count(*) FROM tally GROUP BY flow_id, seq ORDER BY 1");
    assert_eq!(tallies.len(), 2 * FLOWS + RUNS, "every event applied (the steps' too): {tallies:?}");
    assert!(tallies.iter().all(|(_, n)| *n == 1), "an event applied twice: {tallies:?}");
    let workflows = open_read_only(&tenant.join("workflows.db"));
    for table in ["reservations", "dispatches"] {
        let per_order = rows(&workflows, &format!("SELECT order_id, count(*) FROM {table} GROUP BY order_id"));
        assert_eq!(per_order.len(), RUNS, "{table}: {per_order:?}");
        assert!(per_order.iter().all(|(_, n)| *n == 1), "a transactional step ran twice: {table} {per_order:?}");
    }
    // External calls: at least once, each run always with its one key; the killed runs called
    // twice (the proof that the kill landed mid-run).
    let log = std::fs::read_to_string(data.join("label-calls.log")).unwrap();
    let mut calls: std::collections::BTreeMap<&str, usize> = Default::default();
    for key in log.lines() {
        *calls.entry(key).or_default() += 1;
    }
    let expected: Vec<String> = (1..=RUNS).map(|i| format!("r-{i}:1:label")).collect();
    assert_eq!(calls.keys().map(|k| k.to_string()).collect::<Vec<_>>().len(), RUNS, "one key per run: {calls:?}");
    assert!(expected.iter().all(|k| calls.contains_key(k.as_str())), "{calls:?}");
    assert!(calls.values().any(|n| *n >= 2), "no run was interrupted in its external step: {calls:?}");
}
