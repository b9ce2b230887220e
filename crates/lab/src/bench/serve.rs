//! `tidemark bench --serve`: the order saga over HTTP, against the same engine in process.
//!
//! A real `tidemark serve` runs as a child process (its own data folder, a token created for
//! the bench's tenant, `listen = 127.0.0.1:0`); this process is the load generator: `--clients`
//! closed-loop clients on keep-alive connections `POST /v1/runs` until `--runs` order sagas are
//! started, and a read-only connection to the server's workflow database watches the runs
//! finish. Measured: saga starts per second and their latency (request sent to answer
//! received), and end-to-end sagas per second (first start sent to the last run's commit of
//! its end). Then, in the same invocation, the in-process throughput run of `bench --workflows`
//! with the same number of sagas and runs in flight, so that the ratios compare the two on the
//! same machine at the same time.
//!
//! Every run is checked: every start answered `201 started` exactly once, every run
//! `completed`, one `reserve` and one `ship` effect per order and none twice, one successful
//! charge per idempotency key in the server's payment log, stock taken == runs. The child is
//! stopped with SIGTERM at the end (killed if it does not stop in time).
//!
//! With `--store postgres://...?schema=P` the served tenant lives in schemas of that server
//! (the service's prefix `P_serve_<r>`, its control schema holding the bench's token), the
//! watcher reads the tenant's workflow schema, the in-process run is `bench --workflows
//! --store`'s throughput run on schemas `P_in_process_<r>`, and every schema and tenant role the
//! bench made is dropped at the end; PostgreSQL's own CPU is reported beside the server's.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tidemark_builtins::order::tables as order_sql;
use tidemark_core::tenancy::ControlStore;
use tidemark_core::tenancy::{Scope, TokenText};
use tidemark_core::{Error, Result};
use tidemark_store_sqlite::{open_reader, stats, Durability, SqliteControl, SqliteWorkflows};

use super::workflows::{self, load_average, process_cpu_seconds};
use super::{durability_word, failed, median, round1, round3};

/// The tenant the bench's token is bound to.
const TENANT: &str = "bench";
const SKU: &str = "widget";
/// How long the child may take to say it is listening.
const LISTEN_WAIT: Duration = Duration::from_secs(120);
/// How long the child may take to stop after SIGTERM (its shutdown grace is 10 s).
const STOP_WAIT: Duration = Duration::from_secs(30);
/// Bound of the wait for every run to finish.
const FINISH_WAIT: Duration = Duration::from_secs(600);
/// How often the watcher reads the count of finished runs.
const POLL: Duration = Duration::from_millis(10);
/// How long one request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// What `--serve` measures.
#[derive(Debug, Clone)]
pub struct Params {
    pub runs: u64,
    pub clients: usize,
    pub in_flight: usize,
    pub repeat: u64,
    /// `--store`: the PostgreSQL server and schema prefix, or `None` for SQLite files.
    pub store: Option<tidemark_core::location::PostgresLocation>,
}

/// How to start the server: `tidemark serve --config FILE`, or (in tests) another program that
/// serves the same service and reads the configuration's path from an environment variable.
pub struct ServerCommand {
    /// The program to start (this binary, or a test binary).
    pub program: PathBuf,
    /// Its arguments before the configuration (`serve`, or a test's filter).
    pub args: Vec<String>,
    /// Pass the configuration file in this variable instead of `--config FILE`.
    pub config_env: Option<String>,
}

impl ServerCommand {
    /// This binary's `serve`.
    pub fn this_binary() -> Result<ServerCommand> {
        let program =
            std::env::current_exe().map_err(|e| Error::io(format!("cannot find this program's path: {e}")))?;
        Ok(ServerCommand { program, args: vec!["serve".into()], config_env: None })
    }

    fn command(&self, config: &Path) -> Command {
        let mut command = Command::new(&self.program);
        command.args(&self.args);
        match &self.config_env {
            Some(var) => command.env(var, config),
            None => command.arg("--config").arg(config),
        };
        // The configuration file decides, not this process's `TIDEMARK_*` variables.
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("TIDEMARK_") {
                command.env_remove(key);
            }
        }
        command
    }
}

/// The child server: stopped with SIGTERM by [`Server::stop`], killed if dropped before that.
pub(super) struct Server {
    child: Option<Child>,
    pub(super) addr: String,
    /// Lines of its stdout after the listening line (the stop report), once it exited.
    rest: Option<std::thread::JoinHandle<String>>,
}

impl Server {
    pub(super) fn start(command: &ServerCommand, config: &Path, log: &Path) -> Result<Server> {
        let log = std::fs::File::create(log).map_err(|e| Error::io(format!("{}: {e}", log.display())))?;
        let mut child = command
            .command(config)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .map_err(|e| Error::io(format!("cannot start {}: {e}", command.program.display())))?;
        let stdout = child.stdout.take().expect("piped");
        let (sender, receiver) = std::sync::mpsc::channel();
        let rest = std::thread::spawn(move || {
            // Until the listening line: every line (what the child said if it stops before).
            let mut reader = BufReader::new(stdout);
            let mut before = String::new();
            let mut line = String::new();
            while reader.read_line(&mut line).unwrap_or(0) > 0 {
                // (A test harness may print before it on the same line.)
                let json = line.find('{').map_or("", |at| line[at..].trim());
                let listening = serde_json::from_str::<Value>(json)
                    .ok()
                    .filter(|v| v["outcome"] == "listening")
                    .and_then(|v| v["addr"].as_str().map(str::to_string));
                if let Some(addr) = listening {
                    let _ = sender.send(addr);
                    let mut rest = String::new();
                    let _ = reader.read_to_string(&mut rest);
                    return rest;
                }
                before.push_str(&line);
                line.clear();
            }
            before
        });
        let mut server = Server { child: Some(child), addr: String::new(), rest: Some(rest) };
        match receiver.recv_timeout(LISTEN_WAIT) {
            Ok(addr) => server.addr = addr,
            Err(error) => {
                let stdout = match error {
                    std::sync::mpsc::RecvTimeoutError::Disconnected => {
                        server.rest.take().and_then(|h| h.join().ok()).unwrap_or_default()
                    }
                    std::sync::mpsc::RecvTimeoutError::Timeout => format!("nothing within {LISTEN_WAIT:?}"),
                };
                return Err(failed(format!(
                    "the server did not start listening: {} (its log: {})",
                    stdout.trim(),
                    log_path_hint(config)
                )));
            }
        }
        Ok(server)
    }

    pub(super) fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// SIGTERM, then wait (bounded); killed if it does not stop in time. Answers how it ended
    /// and its stop report.
    pub(super) fn stop(mut self) -> Result<Value> {
        let t = Instant::now();
        let Some(child) = self.child.as_mut() else { return Err(failed("the server was stopped already".into())) };
        let signalled = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
        if !signalled.as_ref().is_ok_and(|s| s.success()) {
            // Dropping `self` kills it.
            return Err(failed(format!("kill -TERM of the server failed: {signalled:?}")));
        }
        let status = loop {
            if let Some(status) = child.try_wait().map_err(|e| Error::io(e.to_string()))? {
                break Some(status);
            }
            if t.elapsed() > STOP_WAIT {
                break None;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        match status {
            Some(_) => self.child = None,
            None => {
                if let Some(mut child) = self.child.take() {
                    let _ = child.kill();
                    let _ = child.wait();
                }
            }
        }
        let report = self.rest.take().and_then(|h| h.join().ok()).unwrap_or_default();
        let report: Value = serde_json::from_str(report.trim()).unwrap_or(Value::Null);
        Ok(json!({
            "signal": "SIGTERM",
            "exit_code": status.and_then(|s| s.code()),
            "stopped_in_ms": round1(t.elapsed().as_secs_f64() * 1_000.0),
            "killed_after_wait": status.is_none(),
            "report": report,
        }))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn log_path_hint(config: &Path) -> String {
    config.with_file_name("server.log").display().to_string()
}

/// Nanoseconds on a CPU and waiting for one (runnable, not running), summed by thread name and
/// over the whole process (Linux `/proc/<pid>/task/*/schedstat`).
fn process_threads_ns(pid: u32) -> BTreeMap<String, (u64, u64)> {
    let mut out: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return out };
    for task in tasks.flatten() {
        let path = task.path();
        let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default().trim_end().to_string();
        let stat = std::fs::read_to_string(path.join("schedstat")).unwrap_or_default();
        let mut fields = stat.split_whitespace().map(|f| f.parse::<u64>().unwrap_or(0));
        let (on_cpu, waiting) = (fields.next().unwrap_or(0), fields.next().unwrap_or(0));
        for name in [comm, "(all threads)".to_string()] {
            let entry = out.entry(name).or_default();
            entry.0 += on_cpu;
            entry.1 += waiting;
        }
    }
    out
}

fn cpu_json(
    start: &BTreeMap<String, (u64, u64)>,
    end: &BTreeMap<String, (u64, u64)>,
    seconds: f64,
    runs: u64,
) -> Value {
    let mut threads = serde_json::Map::new();
    for (name, (on_cpu, waiting)) in end {
        let (on_cpu_before, waiting_before) = start.get(name).copied().unwrap_or((0, 0));
        let (used, waited) = (on_cpu.saturating_sub(on_cpu_before), waiting.saturating_sub(waiting_before));
        if used > 0 {
            threads.insert(
                name.clone(),
                json!({
                    "on_cpu_seconds": round3(used as f64 / 1e9),
                    "busy_share": round3(used as f64 / 1e9 / seconds.max(1e-9)),
                    "us_per_saga": round1(used as f64 / 1e3 / runs.max(1) as f64),
                    "waiting_for_cpu_seconds": round3(waited as f64 / 1e9),
                }),
            );
        }
    }
    Value::Object(threads)
}

pub(super) fn percentile_ms(sorted_us: &[u32], q: f64) -> f64 {
    if sorted_us.is_empty() {
        return 0.0;
    }
    let rank = ((q * sorted_us.len() as f64).ceil() as usize).clamp(1, sorted_us.len());
    round3(f64::from(sorted_us[rank - 1]) / 1_000.0)
}

/// What the clients saw.
#[derive(Default)]
struct Load {
    started: u64,
    statuses: BTreeMap<u16, u64>,
    unexpected: u64,
    last_unexpected: Option<String>,
    errors: u64,
    last_error: Option<String>,
    latencies_us: Vec<u32>,
}

impl Load {
    fn error(&mut self, run_id: &str, error: std::io::Error) {
        self.errors += 1;
        self.last_error = Some(format!("{run_id}: {error}"));
    }

    fn merge(&mut self, other: Load) {
        self.started += other.started;
        for (status, n) in other.statuses {
            *self.statuses.entry(status).or_default() += n;
        }
        self.unexpected += other.unexpected;
        self.last_unexpected = other.last_unexpected.or(self.last_unexpected.take());
        self.errors += other.errors;
        self.last_error = other.last_error.or(self.last_error.take());
        self.latencies_us.extend(other.latencies_us);
    }
}

struct Target {
    /// `host:port`.
    addr: String,
    authorization: String,
    prefix: String,
    runs: u64,
}

/// A minimal HTTP/1.1 client on one keep-alive connection: what a load generator on the same
/// two cores as the server can afford (a general-purpose client costs several times the CPU per
/// request, taken from the server it measures). Answers must carry a `Content-Length` (the
/// server's JSON answers do). `tokio::net` is enabled by the server crate this one depends on.
pub(super) struct Connection {
    stream: tokio::net::TcpStream,
    buffer: Vec<u8>,
}

fn bad_answer(message: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, message.to_string())
}

impl Connection {
    pub(super) async fn open(addr: &str) -> std::io::Result<Connection> {
        Connection::over(tokio::net::TcpStream::connect(addr).await?)
    }

    /// A connection to `addr` (`ip:port`) from the local address `from`.
    pub(super) async fn open_from(addr: &str, from: std::net::IpAddr) -> std::io::Result<Connection> {
        let to: std::net::SocketAddr =
            addr.parse().map_err(|_| bad_answer(&format!("{addr:?} is no ip:port address")))?;
        let socket = if from.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
        socket.bind(std::net::SocketAddr::new(from, 0))?;
        Connection::over(socket.connect(to).await?)
    }

    fn over(stream: tokio::net::TcpStream) -> std::io::Result<Connection> {
        stream.set_nodelay(true)?;
        Ok(Connection { stream, buffer: Vec::with_capacity(4096) })
    }

    async fn write_all(&mut self, mut bytes: &[u8]) -> std::io::Result<()> {
        while !bytes.is_empty() {
            self.stream.writable().await?;
            match self.stream.try_write(bytes) {
                Ok(n) => bytes = &bytes[n..],
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Read more of the answer into the buffer.
    async fn read_more(&mut self) -> std::io::Result<()> {
        let mut chunk = [0_u8; 4096];
        loop {
            self.stream.readable().await?;
            match self.stream.try_read(&mut chunk) {
                Ok(0) => return Err(bad_answer("the server closed the connection")),
                Ok(n) => {
                    self.buffer.extend_from_slice(&chunk[..n]);
                    return Ok(());
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Send one request (`head`: the request line and headers, each ending in CRLF) and read
    /// its answer: `(status, body)`.
    pub(super) async fn request(&mut self, head: &str, body: &[u8]) -> std::io::Result<(u16, Vec<u8>)> {
        let mut request = Vec::with_capacity(head.len() + body.len() + 32);
        request.extend_from_slice(head.as_bytes());
        request.extend_from_slice(format!("Content-Length: {}\r\n\r\n", body.len()).as_bytes());
        request.extend_from_slice(body);
        self.write_all(&request).await?;
        self.buffer.clear();
        let header_end = loop {
            if let Some(at) = self.buffer.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
            self.read_more().await?;
        };
        let head = std::str::from_utf8(&self.buffer[..header_end]).map_err(|_| bad_answer("head is not UTF-8"))?;
        let status: u16 = head.split(' ').nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| bad_answer("no status"))?;
        let length: usize = head
            .lines()
            .filter_map(|line| line.split_once(':'))
            .find(|(name, _)| name.trim().eq_ignore_ascii_case("content-length"))
            .and_then(|(_, value)| value.trim().parse().ok())
            .ok_or_else(|| bad_answer("no Content-Length"))?;
        while self.buffer.len() < header_end + length {
            self.read_more().await?;
        }
        Ok((status, self.buffer[header_end..header_end + length].to_vec()))
    }
}

fn start_body(run_id: &str) -> String {
    format!(
        r#"{{"workflow":"order_saga","run_id":"{run_id}","input":{{"order_id":"{run_id}","sku":"{SKU}","quantity":1,"amount":100}}}}"#
    )
}

/// One closed-loop client on one keep-alive connection: takes the next run index until `runs`
/// are taken. A connection error is counted and the connection opened again (the run it was
/// starting is then unknown: the check fails).
async fn client(target: Arc<Target>, next: Arc<AtomicU64>) -> Load {
    let mut load = Load::default();
    let head = format!(
        "POST /v1/runs HTTP/1.1\r\nHost: {}\r\nAuthorization: {}\r\nContent-Type: application/json\r\n",
        target.addr, target.authorization
    );
    let mut connection: Option<Connection> = None;
    loop {
        let index = next.fetch_add(1, Ordering::Relaxed);
        if index >= target.runs {
            return load;
        }
        let run_id = format!("{}-{index:08}", target.prefix);
        let body = start_body(&run_id);
        let t = Instant::now();
        if connection.is_none() {
            connection = Connection::open(&target.addr).await.map_err(|e| load.error(&run_id, e)).ok();
        }
        let Some(open) = connection.as_mut() else { continue };
        let answer = tokio::time::timeout(REQUEST_TIMEOUT, open.request(&head, body.as_bytes()))
            .await
            .unwrap_or_else(|_| Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer in time")));
        match answer {
            Ok((status, body)) => {
                load.latencies_us.push(t.elapsed().as_micros().min(u128::from(u32::MAX)) as u32);
                *load.statuses.entry(status).or_default() += 1;
                let outcome: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                if status == 201 && outcome["outcome"] == "started" && outcome["run_id"] == run_id.as_str() {
                    load.started += 1;
                } else {
                    load.unexpected += 1;
                    load.last_unexpected = Some(format!("{run_id}: {status} {}", String::from_utf8_lossy(&body)));
                }
            }
            Err(error) => {
                connection = None;
                load.error(&run_id, error);
            }
        }
    }
}

async fn set_stock(target: &Target, quantity: u64) -> Result<()> {
    let head = format!(
        "PUT /v1/stock/{SKU} HTTP/1.1\r\nHost: {}\r\nAuthorization: {}\r\nContent-Type: application/json\r\n",
        target.addr, target.authorization
    );
    let body = json!({"quantity": quantity}).to_string();
    let unreachable = |e: std::io::Error| Error::io(format!("cannot reach the server at {}: {e}", target.addr));
    let mut connection = Connection::open(&target.addr).await.map_err(unreachable)?;
    let (status, answer) = connection.request(&head, body.as_bytes()).await.map_err(unreachable)?;
    if !(200..300).contains(&status) {
        return Err(failed(format!("setting the stock answered {status}: {}", String::from_utf8_lossy(&answer))));
    }
    Ok(())
}

/// The per-token rate limit of a serving bench's server: out of the way of its clients.
pub(super) const UNLIMITED_AUTH: &str = "[auth]\nrate_per_second = 1000000\nburst = 10000000\n";

pub(super) fn config_toml(data: &Path, durability: Durability, in_flight: usize, store: Option<&str>) -> String {
    // TOML basic strings: escape backslashes and quotes.
    let quoted = |text: &str| format!("\"{}\"", text.replace('\\', "\\\\").replace('"', "\\\""));
    // On PostgreSQL the server's own durability applies (`durability` is the files').
    let storage = match store {
        Some(url) => format!("store = {}\n", quoted(url)),
        None => format!("durability = \"{}\"\n", durability_word(durability)),
    };
    format!(
        "data_dir = {}\nlisten = \"127.0.0.1:0\"\n{storage}\n{UNLIMITED_AUTH}\n\
         [workers]\nconcurrency = {in_flight}\n",
        quoted(&data.display().to_string())
    )
}

/// Where the served tenant's workflow database is: a file of its folder, or a schema.
enum Served {
    Files,
    Postgres(tidemark_server::Postgres),
}

impl Served {
    /// `(finished, last_finished_at_ms)` of the tenant's runs, on a reader kept between polls.
    fn finished_runs(&self, reader: &mut Reader) -> Result<(u64, Option<i64>)> {
        match (self, reader) {
            (Served::Files, Reader::Sqlite(conn)) => SqliteWorkflows::finished_runs(conn),
            (Served::Postgres(backend), Reader::Postgres(client)) => {
                let schema = backend.schema(TENANT, tidemark_server::Database::Workflows);
                let row = client
                    .query_one(
                        &format!(
                            "SELECT count(*), max(finished_at_ms) FROM \"{schema}\".runs WHERE finished_at_ms IS NOT NULL"
                        ),
                        &[],
                    )
                    .map_err(Error::from)?;
                Ok((row.get::<_, i64>(0) as u64, row.get(1)))
            }
            _ => Err(Error::Invariant("a reader of another backend".into())),
        }
    }

    fn reader(&self, tenant_dir: &Path) -> Result<Reader> {
        Ok(match self {
            Served::Files => Reader::Sqlite(open_reader(&tenant_dir.join("workflows.db"))?),
            Served::Postgres(backend) => Reader::Postgres(tidemark_store_postgres::connect(backend.conn())?),
        })
    }

    /// The schemas and roles under the service's prefix (`(schemas, roles)`).
    fn made(client: &mut postgres::Client, prefix: &str) -> Result<(Vec<String>, Vec<String>)> {
        let like = format!("{prefix}_");
        let mut names = |sql: &str| -> Result<Vec<String>> {
            let rows = client.query(sql, &[&like]).map_err(Error::from)?;
            Ok(rows.iter().map(|r| r.get::<_, String>(0)).collect())
        };
        Ok((
            names("SELECT nspname::text FROM pg_namespace WHERE starts_with(nspname, $1)")?,
            names("SELECT rolname::text FROM pg_roles WHERE starts_with(rolname, $1)")?,
        ))
    }

    /// `already_exists` when a schema or role under the service's prefix exists: the bench
    /// serves from fresh ones only, and drops them at the end.
    fn check_fresh(&self) -> Result<()> {
        let Served::Postgres(backend) = self else { return Ok(()) };
        let mut client = tidemark_store_postgres::connect(backend.conn())?;
        let (schemas, roles) = Self::made(&mut client, backend.prefix())?;
        if let Some(name) = schemas.first().or(roles.first()) {
            return Err(Error::invalid(
                tidemark_core::codes::ALREADY_EXISTS,
                format!("{name} exists; the bench serves from fresh schemas (pick another ?schema= prefix)"),
            ));
        }
        Ok(())
    }

    /// Drop every schema and tenant role the service made (its prefix's, fresh at the start).
    fn drop_made(&self) -> Result<()> {
        let Served::Postgres(backend) = self else { return Ok(()) };
        let mut client = tidemark_store_postgres::connect(backend.conn())?;
        let (schemas, roles) = Self::made(&mut client, backend.prefix())?;
        for schema in schemas {
            client.batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE")).map_err(Error::from)?;
        }
        for role in roles {
            client.batch_execute(&format!("DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\"")).map_err(Error::from)?;
        }
        Ok(())
    }
}

enum Reader {
    Sqlite(rusqlite::Connection),
    Postgres(postgres::Client),
}

/// The tenant's workflow tables' end state: runs by status, order effects by kind, stock left,
/// orders with an effect twice.
type WorkflowState = (BTreeMap<String, u64>, BTreeMap<String, u64>, i64, u64);

/// See [`WorkflowState`].
fn workflow_state(served: &Served, tenant_dir: &Path) -> Result<WorkflowState> {
    match served {
        Served::Files => {
            let conn = open_reader(&tenant_dir.join("workflows.db"))?;
            Ok((
                stats::run_counts(&conn)?,
                order_sql::order_effect_counts(&conn)?,
                order_sql::stock(&conn, SKU)?.unwrap_or(0),
                order_sql::orders_with_duplicate_effects(&conn)?,
            ))
        }
        Served::Postgres(backend) => {
            use tidemark_builtins::order::postgres as order_pg;
            let schema = backend.schema(TENANT, tidemark_server::Database::Workflows);
            let mut client = tidemark_store_postgres::connect(backend.conn())?;
            Ok((
                tidemark_store_postgres::stats::run_counts(&mut client, &schema)?,
                order_pg::order_effect_counts(&mut client, &schema)?,
                order_pg::stock(&mut client, &schema, SKU)?.unwrap_or(0),
                order_pg::orders_with_duplicate_effects(&mut client, &schema)?,
            ))
        }
    }
}

/// The end state of the server's files after `runs` order sagas that should all have completed,
/// the stock having been `runs` (read-only; the server has stopped).
fn check_files(served: &Served, tenant_dir: &Path, runs: u64) -> Result<Value> {
    let (counts, effects, stock_left, duplicates) = workflow_state(served, tenant_dir)?;
    let effects_of = |kind: &str| effects.get(kind).copied().unwrap_or(0);
    let other_effects: u64 =
        effects.iter().filter(|(kind, _)| !matches!(kind.as_str(), "reserve" | "ship")).map(|(_, n)| n).sum();
    let payments = rusqlite::Connection::open_with_flags(
        tenant_dir.join("payments.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|e| Error::io(format!("cannot open the payment log: {e}")))?;
    let calls = order_sql::payment_calls(&payments)?;
    let charged: Vec<&str> =
        calls.iter().filter(|c| c.outcome == "charged").map(|c| c.idempotency_key.as_str()).collect();
    let mut keys = charged.clone();
    keys.sort_unstable();
    keys.dedup();
    let other_calls = calls.iter().filter(|c| !matches!(c.outcome.as_str(), "charged" | "duplicate")).count();
    let all = counts.values().sum::<u64>();
    let completed = counts.get("completed").copied().unwrap_or(0);
    let passed = all == runs
        && completed == runs
        && effects_of("reserve") == runs
        && effects_of("ship") == runs
        && other_effects == 0
        && duplicates == 0
        && stock_left == 0
        && charged.len() as u64 == runs
        && keys.len() as u64 == runs
        && other_calls == 0;
    Ok(json!({
        "runs": all,
        "by_status": counts,
        "completed": completed,
        "reserve_effects": effects_of("reserve"),
        "ship_effects": effects_of("ship"),
        "other_effects": other_effects,
        "orders_with_duplicate_effects": duplicates,
        "stock_taken": runs as i64 - stock_left,
        "charges": charged.len(),
        "charged_keys": keys.len(),
        "other_payment_calls": other_calls,
        "passed": passed,
    }))
}

/// One run against a fresh server.
fn serve_once(dir: &Path, name: &str, durability: Durability, p: &Params, command: &ServerCommand) -> Result<Value> {
    let data = dir.join("data");
    std::fs::create_dir_all(&data).map_err(|e| Error::io(format!("{}: {e}", data.display())))?;
    let config = dir.join("serve.toml");
    // On PostgreSQL: the service's prefix `<P>_<name>`, fresh (its schemas dropped at the end).
    let store = match &p.store {
        Some(location) => {
            let prefix = format!("{}_{}", location.schema, name);
            let url = crate::stores::schema_url(&location.conn, &prefix);
            let backend = tidemark_server::Postgres::from_url(&url)?;
            let served = Served::Postgres(backend);
            served.check_fresh()?;
            Some((url, served))
        }
        None => None,
    };
    let (store_url, served) = match store {
        Some((url, served)) => (Some(url), served),
        None => (None, Served::Files),
    };
    std::fs::write(&config, config_toml(&data, durability, p.in_flight, store_url.as_deref()))
        .map_err(|e| Error::io(format!("{}: {e}", config.display())))?;
    // A token of the bench's tenant, as `tidemark token create` makes one (the request path
    // verifies it like any other).
    let token = TokenText::from_random(rand::random(), rand::random());
    {
        let mut control: Box<dyn ControlStore> = match &served {
            Served::Files => {
                Box::new(SqliteControl::open(&data.join(tidemark_server::CONTROL_FILE), true, durability)?)
            }
            Served::Postgres(backend) => {
                Box::new(tidemark_store_postgres::PgControl::open(backend.conn(), &backend.control_schema(), true)?)
            }
        };
        control.create_token(&token, TENANT, Scope::Admin, "bench --serve", tidemark_engine::now_ms())?;
    }
    let result = serve_on(dir, &data, &config, &served, &token, p, command);
    let dropped = served.drop_made();
    let result = result?;
    dropped?;
    Ok(result)
}

/// One run against the server of `config`, its tenant's stores in `served`.
fn serve_on(
    dir: &Path,
    data: &Path,
    config: &Path,
    served: &Served,
    token: &TokenText,
    p: &Params,
    command: &ServerCommand,
) -> Result<Value> {
    let server = Server::start(command, config, &dir.join("server.log"))?;
    let tenant_dir = tidemark_server::tenant::dir_of(data, TENANT);
    let target = Arc::new(Target {
        addr: server.addr.clone(),
        authorization: format!("Bearer {}", token.text()),
        prefix: "order".into(),
        runs: p.runs,
    });
    // One thread: the load generator takes at most one of the cores it shares with the server.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::io(format!("cannot start the async runtime: {e}")))?;
    runtime.block_on(set_stock(&target, p.runs))?;
    let mut reader = served.reader(&tenant_dir)?;

    let server_cpu_start = process_threads_ns(server.pid());
    let database_cpu_start = p.store.as_ref().and_then(|_| super::postgres::server_cpu_seconds());
    let own_cpu_start = process_cpu_seconds();
    let t0_ms = tidemark_engine::now_ms();
    let t0 = Instant::now();
    let next = Arc::new(AtomicU64::new(0));
    let load = runtime.block_on(async {
        let clients: Vec<_> = (0..p.clients).map(|_| tokio::spawn(client(target.clone(), next.clone()))).collect();
        let mut load = Load::default();
        for client in clients {
            load.merge(client.await.map_err(|e| failed(format!("a load client panicked: {e}")))?);
        }
        Ok::<Load, Error>(load)
    })?;
    let start_phase = t0.elapsed();
    let own_cpu_load = process_cpu_seconds().zip(own_cpu_start).map(|(end, start)| end - start);
    // Every run's end, as its commit records it.
    let mut polls = 0_u64;
    let (seen_all, last_finished_ms) = loop {
        let (finished, last) = served.finished_runs(&mut reader)?;
        polls += 1;
        if finished >= load.started {
            break (t0.elapsed(), last);
        }
        if t0.elapsed() > FINISH_WAIT {
            return Err(failed(format!("{finished} of {} runs finished within {FINISH_WAIT:?}", load.started)));
        }
        std::thread::sleep(POLL);
    };
    let server_cpu_end = process_threads_ns(server.pid());
    let database_cpu = p
        .store
        .as_ref()
        .and_then(|_| super::postgres::server_cpu_seconds())
        .zip(database_cpu_start)
        .map(|(end, start)| end - start);
    drop(reader);
    drop(runtime);
    let stopped = server.stop()?;
    let check = check_files(served, &tenant_dir, p.runs)?;

    let end_to_end_s = last_finished_ms.map_or(seen_all.as_secs_f64(), |ms| (ms - t0_ms).max(1) as f64 / 1_000.0);
    let start_s = start_phase.as_secs_f64();
    let mut latencies = load.latencies_us.clone();
    latencies.sort_unstable();
    let clean = load.started == p.runs && load.unexpected == 0 && load.errors == 0;
    // The server's own account, when it printed one (`tidemark serve` does): each run executed
    // once (claimed once, completed), no worker error.
    let worker = &stopped["report"]["workers"][format!("{TENANT}/worker")];
    let worker_agrees = worker.is_null()
        || (worker["claimed"] == json!(p.runs) && worker["completed"] == json!(p.runs) && worker["errors"] == json!(0));
    let mut check = check;
    check["every_start_answered_started_once"] = json!(clean);
    check["server_worker_claimed_and_completed_each_run_once"] = json!(worker_agrees);
    check["passed"] = json!(clean && worker_agrees && check["passed"] == json!(true));
    check["what"] = json!(
        "every POST /v1/runs answered 201 started (once per run id); every run completed; one reserve and one \
         ship effect per order, none twice; one successful charge per idempotency key in the server's payment \
         log; stock taken == runs; the server's worker claimed and completed each run once"
    );
    let window = seen_all.as_secs_f64();
    Ok(json!({
        "runs": p.runs,
        "clients": p.clients,
        "server_workers_concurrency": p.in_flight,
        "addr": target.addr,
        "starts": {
            "seconds": round3(start_s),
            "starts_per_s": round1(load.started as f64 / start_s.max(1e-9)),
            "latency_ms": {
                "p50": percentile_ms(&latencies, 0.50),
                "p90": percentile_ms(&latencies, 0.90),
                "p99": percentile_ms(&latencies, 0.99),
                "max": percentile_ms(&latencies, 1.0),
            },
            "by_status": load.statuses.iter().map(|(s, n)| (s.to_string(), json!(n))).collect::<serde_json::Map<_, _>>(),
            "unexpected_answers": load.unexpected,
            "last_unexpected_answer": load.last_unexpected,
            "connection_errors": load.errors,
            "last_connection_error": load.last_error,
            "what": "each client (one keep-alive connection; all on one thread of this process) sends its next \
                     start when the last one was answered (closed loop); latency: request sent to answer received, \
                     at the client",
        },
        "end_to_end": {
            "seconds": round3(end_to_end_s),
            "sagas_per_s": round1(load.started as f64 / end_to_end_s.max(1e-9)),
            "what": "from the first start sent to the commit of the last run's end (its finished_at_ms), \
                     watched through a read-only connection polled every 10 ms",
            "watcher_polls": polls,
        },
        "server_cpu": cpu_json(&server_cpu_start, &server_cpu_end, window, p.runs),
        "postgres_cpu": database_cpu.map(|cpu| json!({
            "seconds": round3(cpu),
            "share_of_a_core": round3(cpu / window.max(1e-9)),
            "ms_per_saga": round3(cpu * 1_000.0 / p.runs.max(1) as f64),
            "what": "every PostgreSQL server process's user + system CPU over the same window (/proc)",
        })),
        "load_generator_cpu_seconds": own_cpu_load.map(round3),
        "stop": stopped,
        "check": check,
    }))
}

pub fn run(dir: &Path, durability: Durability, p: &Params, command: &ServerCommand) -> Result<Value> {
    let load_at_start = load_average();
    let in_process_params = workflows::Params {
        sagas: p.runs,
        in_flight: p.in_flight,
        latency_sagas: 0,
        external_latency_ms: 0,
        resume_sagas: 0,
        lease_ms: 30_000,
        repeat: 1,
        probe_commits: 1,
        process_sagas: 0,
        skus: 1,
        pgbench_seconds: 0,
    };
    let files = workflows::SqlitePlace { dir: dir.to_path_buf(), durability };
    let schemas = p.store.as_ref().map(super::postgres::PgPlace::new).transpose()?;
    // Every schema of the in-process runs is dropped when this goes, however the bench ends.
    let _cleanup = schemas.clone().map(super::postgres::Cleanup);
    let database = match &p.store {
        Some(location) => Some(super::postgres::server_settings(&location.conn)?),
        None => None,
    };
    let mut serve_runs = Vec::new();
    let mut in_process_runs = Vec::new();
    let (mut e2e, mut starts, mut p50s, mut in_process) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut all_passed = true;
    // Interleaved, so that a slow moment of a shared machine hits both kinds.
    for r in 0..p.repeat {
        let run = serve_once(&dir.join(format!("serve-{r}")), &format!("serve_{r}"), durability, p, command)?;
        all_passed &= run["check"]["passed"] == json!(true);
        e2e.push(run["end_to_end"]["sagas_per_s"].as_f64().unwrap_or(0.0));
        starts.push(run["starts"]["starts_per_s"].as_f64().unwrap_or(0.0));
        p50s.push(run["starts"]["latency_ms"]["p50"].as_f64().unwrap_or(0.0));
        serve_runs.push(run);
        let name = format!("in-process-{r}");
        let run = match &schemas {
            None => workflows::throughput::<SqliteWorkflows>(&files, &name, &in_process_params, Duration::ZERO)?,
            Some(place) => workflows::throughput::<tidemark_store_postgres::PgWorkflows>(
                place,
                &name,
                &in_process_params,
                Duration::ZERO,
            )?,
        };
        all_passed &= run["check"]["passed"] == json!(true);
        in_process.push(run["sagas_per_s"].as_f64().unwrap_or(0.0));
        in_process_runs.push(run);
    }
    let (e2e_rate, start_rate, p50, engine_rate) = (median(&e2e), median(&starts), median(&p50s), median(&in_process));
    let ratio = |a: f64| (engine_rate > 0.0).then(|| round3(a / engine_rate));
    Ok(json!({
        "outcome": "bench",
        "kind": "serve",
        "durability": if p.store.is_some() { json!("the server's") } else { json!(durability_word(durability)) },
        "store": p.store.as_ref().map(|location| json!({"url": location.masked, "server": database})),
        "params": {
            "runs": p.runs,
            "clients": p.clients,
            "in_flight": p.in_flight,
            "repeat": p.repeat,
            "dir": dir,
            "server": command.program,
            "available_parallelism": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "load_average_at_start": load_at_start,
        },
        "serve": {
            "what": "a `tidemark serve` child process (token auth, workers.concurrency = --in-flight) loaded from \
                     this process over HTTP; the runs are started and run at the same time",
            "end_to_end_sagas_per_s_median": e2e_rate,
            "end_to_end_sagas_per_s_each": e2e,
            "starts_per_s_median": start_rate,
            "start_latency_p50_ms_median": p50,
            "runs": serve_runs,
        },
        "in_process": {
            "what": "the throughput run of `bench --workflows` with the same sagas and runs in flight: all started \
                     first, then run by one worker in this process (payment log in memory)",
            "sagas_per_s_median": engine_rate,
            "sagas_per_s_each": in_process,
            "runs": in_process_runs,
        },
        "summary": {
            "end_to_end_sagas_per_s": e2e_rate,
            "starts_per_s": start_rate,
            "start_latency_p50_ms": p50,
            "in_process_sagas_per_s": engine_rate,
            "ratios_to_in_process": {
                "end_to_end_sagas_per_s": ratio(e2e_rate),
                "starts_per_s": ratio(start_rate),
            },
            "targets": {
                "end_to_end_at_least_half_of_in_process": ratio(e2e_rate).map(|r| r >= 0.5),
                "start_latency_p50_under_5_ms": p50 < 5.0,
            },
        },
        "check": {
            "passed": all_passed,
            "what": "every run of both kinds: every saga completed exactly once, one effect of each kind per order, \
                     one charge per key",
        },
    }))
}

/// `--quick` numbers for tests.
pub fn quick(p: &mut Params) {
    p.runs = 200;
    p.clients = 8;
    p.in_flight = 50;
    p.repeat = 1;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_configuration_names_the_store_or_the_files_durability() {
        let files = config_toml(Path::new("/d/a\"b"), Durability::Full, 64, None);
        assert!(files.contains("data_dir = \"/d/a\\\"b\"") && files.contains("durability = \"full\""), "{files}");
        let postgres = config_toml(Path::new("/d"), Durability::Full, 64, Some("postgres://u@h/db?schema=p_serve_0"));
        assert!(
            postgres.contains("store = \"postgres://u@h/db?schema=p_serve_0\"") && !postgres.contains("durability")
        );
        let parsed = tidemark_server::Config::parse_toml(&postgres).expect("a valid configuration");
        assert_eq!(parsed.workers.concurrency, 64);
    }
}
