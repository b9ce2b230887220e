//! Shared helpers: run the real binary, parse its JSON, make fresh folders.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_tidemark");

/// True when the binary under test was built with the `failpoints` feature.
pub fn failpoints_enabled() -> bool {
    cfg!(feature = "failpoints")
}

/// A loopback port that is free now, for a server process the test starts on a port it must
/// know first (a NATS server, a PostgreSQL cluster). Chosen below Linux's ephemeral range
/// (32,768 up), which `bind(0)` and outgoing connections take their ports from, so that no other
/// test's socket takes it between this check and the server's bind; each call of this process
/// moves on to the next port.
pub fn unused_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 20_000;
    const PORTS: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let start = std::process::id().wrapping_mul(7_919) % PORTS;
    (0..PORTS)
        .map(|_| FIRST + (start + NEXT.fetch_add(1, Ordering::Relaxed)) % PORTS)
        .map(|port| port as u16)
        .find(|port| std::net::TcpListener::bind(("127.0.0.1", *port)).is_ok())
        .expect("a free port below the ephemeral range")
}

/// Print why a test is skipped (visible with `--nocapture` and in CI logs).
pub fn skip(reason: &str) {
    eprintln!("SKIPPED: {reason}");
}

pub struct Run {
    pub code: i32,
    pub json: Value,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    /// Require exit `code`. The panic message ends with a few short lines (the exit code, the
    /// outcome and error, a report's violations by kind and its first violations) after the whole
    /// stdout and stderr: a CI log cut in the middle keeps a failure's last lines.
    pub fn assert_exit(&self, code: i32) {
        if self.code == code {
            return;
        }
        let json = &self.json;
        let check = if json["check"].is_object() { &json["check"] } else { json };
        let by_kind: serde_json::Map<String, Value> = check["by_kind"]
            .as_object()
            .map(|kinds| {
                kinds.iter().filter(|(_, n)| n.as_u64() != Some(0)).map(|(k, n)| (k.clone(), n.clone())).collect()
            })
            .unwrap_or_default();
        let first: Vec<String> = check["first_violations"]
            .as_array()
            .map(|list| list.iter().take(5).map(|v| v.to_string().chars().take(400).collect()).collect())
            .unwrap_or_default();
        panic!(
            "{}\n{}\n--- exit {} (expected {code}); outcome {}; code {}; message {}\n--- violations by kind {}\n--- first violations:\n{}",
            self.stdout,
            self.stderr,
            self.code,
            json["outcome"],
            json["code"],
            json["message"].to_string().chars().take(400).collect::<String>(),
            Value::Object(by_kind),
            first.join("\n"),
        );
    }
}

fn finish(output: Output) -> Run {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    let json = serde_json::from_str(&stdout).unwrap_or(Value::Null);
    Run { code: output.status.code().unwrap_or(-1), json, stdout, stderr }
}

/// Run `tidemark ARGS` with optional environment and stdin.
pub fn run_with(args: &[&str], env: &[(&str, &str)], stdin: Option<&[u8]>) -> Run {
    let mut command = Command::new(BIN);
    command.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    command.env_remove("TIDEMARK_CRASH_AT");
    for (key, value) in env {
        command.env(key, value);
    }
    command.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() });
    let mut child = command.spawn().expect("spawn tidemark");
    if let Some(bytes) = stdin {
        use std::io::Write;
        child.stdin.take().expect("stdin").write_all(bytes).expect("write stdin");
    }
    finish(child.wait_with_output().expect("wait for tidemark"))
}

pub fn run(args: &[&str]) -> Run {
    run_with(args, &[], None)
}

/// Run and require exit 0; return the JSON.
pub fn ok(args: &[&str]) -> Value {
    let r = run(args);
    assert_eq!(r.code, 0, "tidemark {args:?} failed:\n{}\n{}", r.stdout, r.stderr);
    r.json
}

pub fn path_str(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// A fresh folder with `producer.db` (source `shop`) and `consumer.db`, with the given
/// consumers subscribed; or, inside `workflow_cli::on_postgres()`, a fresh producer schema and a
/// fresh consumer schema of the test server (`producer` and `consumer` are then their
/// `postgres://...?schema=` URLs; the folder still holds the test's own files, such as
/// envelopes). The schemas are dropped with the `Setup`.
pub struct Setup {
    pub dir: tempfile::TempDir,
    pub producer: PathBuf,
    pub consumer: PathBuf,
    /// On PostgreSQL: the server's URL and every schema this `Setup` made.
    postgres: Option<(String, std::sync::Mutex<Vec<String>>)>,
}

static SCHEMAS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A schema name no other test process or test of this process uses (dropped first, should a
/// dead process of the same id have left it).
fn fresh_schema(base: &str, role: &str) -> String {
    let n = SCHEMAS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let schema = format!("cli_{role}_{}_{n}", std::process::id());
    let mut client = postgres::Client::connect(base, postgres::NoTls).expect("connect to the test server");
    client.batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE")).expect("drop a stale schema");
    schema
}

thread_local! {
    /// The server of [`consumer_behind_postgres_endpoint`] on this thread.
    static ENDPOINT_SERVER: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// While the guard lives, a [`Setup`] made on this thread has its consumer in a fresh schema of
/// the test server, subscribed by a `postgres://` endpoint (a consumer schema on another
/// server, as the producer sees it), whatever the producer's backend: a file, or a schema of
/// the same server (inside `on_postgres`) reached through another connection string. `None`,
/// after saying why, without a server.
pub fn consumer_behind_postgres_endpoint() -> Option<EndpointServer> {
    let (base, _) = postgres_server()?;
    ENDPOINT_SERVER.with(|server| *server.borrow_mut() = Some(base));
    Some(EndpointServer)
}

/// See [`consumer_behind_postgres_endpoint`].
pub struct EndpointServer;

impl Drop for EndpointServer {
    fn drop(&mut self) {
        ENDPOINT_SERVER.with(|server| *server.borrow_mut() = None);
    }
}

impl Setup {
    pub fn new(consumers: &[&str]) -> Setup {
        let dir = tempfile::tempdir().expect("tempdir");
        let producer_base = crate::workflow_cli::postgres_base();
        let endpoint_base = ENDPOINT_SERVER.with(|server| server.borrow().clone());
        let mut schemas = Vec::new();
        let producer = match &producer_base {
            None => dir.path().join("producer.db"),
            Some(base) => {
                schemas.push(fresh_schema(base, "p"));
                PathBuf::from(with_schema(base, &schemas[0]))
            }
        };
        let (consumer, endpoint) = match (&producer_base, &endpoint_base) {
            (None, None) => (dir.path().join("consumer.db"), None),
            (Some(base), None) => {
                schemas.push(fresh_schema(base, "c"));
                (PathBuf::from(with_schema(base, &schemas[1])), None)
            }
            (_, Some(base)) => {
                let schema = fresh_schema(base, "c");
                let store = with_schema(base, &schema);
                // Another connection string than the producer's: the producer's relay reaches
                // the schema as it would one on another server.
                let endpoint = with_schema(&format!("{base}?application_name=tidemark_endpoint"), &schema);
                schemas.push(schema);
                (PathBuf::from(store), Some(endpoint))
            }
        };
        ok(&["init", "--producer", path_str(&producer), "--source", "shop", "--consumer-db", path_str(&consumer)]);
        let endpoint = endpoint.unwrap_or_else(|| path_str(&consumer).to_string());
        for id in consumers {
            let out =
                ok(&["subscribe", "--producer", path_str(&producer), "--consumer-id", id, "--endpoint", &endpoint]);
            if endpoint_base.is_some() {
                assert_eq!(out["subscription"]["endpoint"], endpoint.as_str(), "a postgres:// endpoint: {out}");
            }
        }
        let postgres = producer_base.or(endpoint_base).map(|base| (base, std::sync::Mutex::new(schemas)));
        Setup { dir, producer, consumer, postgres }
    }

    pub fn p(&self) -> &str {
        path_str(&self.producer)
    }

    pub fn c(&self) -> &str {
        path_str(&self.consumer)
    }

    /// True when the stores are PostgreSQL schemas (the producer is; see
    /// [`consumer_behind_postgres_endpoint`] for a file beside a consumer schema).
    pub fn on_postgres(&self) -> bool {
        self.p().starts_with("postgres")
    }

    /// The consumer's schema (on PostgreSQL).
    fn consumer_schema(&self) -> String {
        match tidemark_core::location::StoreLocation::parse(self.c()).expect("a store") {
            tidemark_core::location::StoreLocation::Postgres(pg) => pg.schema,
            other => panic!("the consumer is not a PostgreSQL schema: {other:?}"),
        }
    }

    /// Another store of this setup's backend, not initialised: `<name>.db` in the folder, or a
    /// fresh schema of the same server (dropped with the `Setup`).
    pub fn another_store(&self, name: &str) -> String {
        match &self.postgres {
            None => path_str(&self.dir.path().join(format!("{name}.db"))).to_string(),
            Some((base, schemas)) => {
                let schema = fresh_schema(base, name);
                schemas.lock().unwrap().push(schema.clone());
                with_schema(base, &schema)
            }
        }
    }

    /// Whether `store` (a file of the folder, or a schema of the server) exists: a file or one of
    /// its WAL companions, or the schema.
    pub fn store_exists(&self, store: &str) -> bool {
        match tidemark_core::location::StoreLocation::parse(store).expect("a store") {
            tidemark_core::location::StoreLocation::Sqlite(path) => {
                let p = path_str(&path);
                ["", "-wal", "-shm"].iter().any(|suffix| Path::new(&format!("{p}{suffix}")).exists())
            }
            tidemark_core::location::StoreLocation::Postgres(pg) => {
                let mut client = postgres::Client::connect(&pg.conn, postgres::NoTls).expect("connect");
                client
                    .query_one("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", &[&pg.schema])
                    .expect("read the schemas")
                    .get(0)
            }
        }
    }

    /// On PostgreSQL: rename the consumer's schema away (`<schema>_away`), so that nothing can
    /// open it, or back.
    pub fn move_consumer_schema(&self, away: bool) {
        let (base, _) = self.postgres.as_ref().expect("a PostgreSQL setup");
        let schema = self.consumer_schema();
        let (from, to) =
            if away { (schema.clone(), format!("{schema}_away")) } else { (format!("{schema}_away"), schema) };
        let mut client = postgres::Client::connect(base, postgres::NoTls).expect("connect");
        client.batch_execute(&format!("ALTER SCHEMA {from} RENAME TO {to}")).expect("rename the consumer schema");
    }

    /// On PostgreSQL: back the consumer's schema up into `file` with `pg_dump` (custom format).
    pub fn dump_consumer_schema(&self, file: &Path) {
        let (base, _) = self.postgres.as_ref().expect("a PostgreSQL setup");
        let schema = self.consumer_schema();
        let out = Command::new("pg_dump")
            .args(["--format=custom", "--schema", &schema, "--file", path_str(file), "--dbname", base])
            .output()
            .expect("run pg_dump (the PostgreSQL client tools)");
        assert!(out.status.success(), "pg_dump: {}", String::from_utf8_lossy(&out.stderr));
    }

    /// On PostgreSQL: drop the consumer's schema and restore it from `file` (a
    /// [`Setup::dump_consumer_schema`]) with `pg_restore`.
    pub fn restore_consumer_schema(&self, file: &Path) {
        let (base, _) = self.postgres.as_ref().expect("a PostgreSQL setup");
        let schema = self.consumer_schema();
        let mut client = postgres::Client::connect(base, postgres::NoTls).expect("connect");
        client.batch_execute(&format!("DROP SCHEMA {schema} CASCADE")).expect("drop the consumer schema");
        let out = Command::new("pg_restore")
            .args(["--exit-on-error", "--dbname", base, path_str(file)])
            .output()
            .expect("run pg_restore (the PostgreSQL client tools)");
        assert!(out.status.success(), "pg_restore: {}", String::from_utf8_lossy(&out.stderr));
    }

    /// The (consumer, source, flow, seq) applied more than once in the consumer store, read
    /// straight from it (the file, or the schema's table).
    pub fn duplicate_effects(&self) -> Vec<tidemark_builtins::reservation::DuplicateEffect> {
        self.duplicate_effects_in(self.c())
    }

    /// [`Setup::duplicate_effects`] of another consumer store of this setup.
    pub fn duplicate_effects_in(&self, store: &str) -> Vec<tidemark_builtins::reservation::DuplicateEffect> {
        match tidemark_core::location::StoreLocation::parse(store).expect("a store") {
            tidemark_core::location::StoreLocation::Sqlite(path) => {
                let conn = tidemark_store_sqlite::open_existing(&path).expect("open consumer file");
                tidemark_builtins::reservation::duplicate_effects(&conn).expect("read effects")
            }
            tidemark_core::location::StoreLocation::Postgres(pg) => {
                let mut client = postgres::Client::connect(&pg.conn, postgres::NoTls).expect("connect");
                tidemark_builtins::reservation::postgres::duplicate_effects(&mut client, &pg.schema)
                    .expect("read effects")
            }
        }
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        if let Some((base, schemas)) = &self.postgres {
            if let Ok(mut client) = postgres::Client::connect(base, postgres::NoTls) {
                for schema in schemas.lock().unwrap().iter() {
                    let _ = client.batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
                }
            }
        }
    }
}

/// The shared PostgreSQL test server as a `--store` URL (`TIDEMARK_TEST_POSTGRES_URL`, default
/// the local one) and a connection to it; `None`, after saying why, when it does not answer.
pub fn postgres_server() -> Option<(String, postgres::Client)> {
    let base = std::env::var("TIDEMARK_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    match postgres::Client::connect(&base, postgres::NoTls) {
        Ok(client) => Some((base, client)),
        Err(error) => {
            skip(&format!("PostgreSQL not reachable at {base}: {error}"));
            None
        }
    }
}

/// The `--store` URL of schema `schema` on the server `base` names.
pub fn with_schema(base: &str, schema: &str) -> String {
    let sep = if base.contains('?') { '&' } else { '?' };
    format!("{base}{sep}schema={schema}")
}
