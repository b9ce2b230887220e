//! Running the real `tidemark serve` in a child process and talking to it over real HTTP.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::{ok, path_str, BIN};

/// A `tidemark serve` child process on a loopback port chosen by the OS.
pub struct Server {
    pub child: Option<Child>,
    /// Everything the server wrote to stderr so far (read by a thread, so the pipe never fills).
    pub stderr: std::sync::Arc<std::sync::Mutex<String>>,
    pub base: String,
    pub data: PathBuf,
    pub client: reqwest::blocking::Client,
}

/// Create a token; returns its text. The data folder exists afterwards on either backend (on
/// PostgreSQL the token is in the database), so a test may write its configuration there.
pub fn token(data: &Path, tenant: &str, scope: &str) -> String {
    std::fs::create_dir_all(data).expect("create the data folder");
    let [flag, value] = control(data);
    let out = ok(&["token", "create", &flag, &value, "--tenant", tenant, "--scope", scope]);
    out["token"].as_str().expect("token text").to_string()
}

/// The flag and value that name the control store of the service of `data` to a token command:
/// `--data DATA`, or `--store URL` on PostgreSQL.
pub fn control(data: &Path) -> [String; 2] {
    match store_of(data) {
        Some(url) => ["--store".into(), url],
        None => ["--data".into(), path_str(data).into()],
    }
}

thread_local! {
    /// The PostgreSQL store of each data folder's service, inside [`served_on_both_backends`].
    static SERVED: std::cell::RefCell<std::collections::BTreeMap<PathBuf, String>> = Default::default();
}

static PREFIXES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Serve `data`'s service from the PostgreSQL store `url` (a URL [`store_of`] made, with
/// parameters of the test's own).
pub fn set_store(data: &Path, url: &str) {
    SERVED.with(|served| served.borrow_mut().insert(data.to_path_buf(), url.to_string()));
}

/// Serve `data`'s service from the same PostgreSQL store as `other`'s (two processes of one
/// service), inside [`served_on_both_backends`] or [`crate::workflow_cli::on_postgres`].
pub fn share_store(data: &Path, other: &Path) {
    let url = store_of(other).expect("on PostgreSQL");
    SERVED.with(|served| served.borrow_mut().insert(data.to_path_buf(), url));
}

/// The `--store` of the service of `data`: inside [`served_on_both_backends`]'s PostgreSQL run, a
/// schema prefix of its own on the test server (the same for every call with this folder); else
/// `None` (SQLite files in the folder).
pub fn store_of(data: &Path) -> Option<String> {
    let base = crate::workflow_cli::postgres_base()?;
    let url = SERVED.with(|served| {
        served
            .borrow_mut()
            .entry(data.to_path_buf())
            .or_insert_with(|| {
                let n = PREFIXES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                crate::support::with_schema(&base, &format!("api{}_{n}", std::process::id()))
            })
            .clone()
    });
    Some(url)
}

/// Run `scenario` against a service on SQLite files, then against one on PostgreSQL (skipped,
/// saying why, without a server): one test body, both backends. The PostgreSQL schemas the
/// scenario's services made are dropped afterwards.
pub fn served_on_both_backends(scenario: fn()) {
    scenario();
    if let Some(_postgres) = crate::workflow_cli::on_postgres() {
        let _schemas = DropServedSchemas;
        scenario();
    }
}

/// Drops the schemas and tenant roles of this thread's services on PostgreSQL when it goes (a
/// failed scenario's too).
pub struct DropServedSchemas;

impl Drop for DropServedSchemas {
    fn drop(&mut self) {
        let prefixes: Vec<String> = SERVED.with(|served| {
            std::mem::take(&mut *served.borrow_mut()).into_values().map(|url| prefix_of(&url)).collect()
        });
        let Some((_, mut client)) = crate::support::postgres_server() else { return };
        for prefix in prefixes {
            for schema in schemas_of(&mut client, &prefix, None) {
                let _ = client.batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"));
            }
            // The tenants' roles (cluster-wide: they outlive their schemas unless dropped).
            let roles = client
                .query("SELECT rolname::text FROM pg_roles WHERE starts_with(rolname, $1)", &[&format!("{prefix}_")])
                .map(|rows| rows.iter().map(|r| r.get::<_, String>(0)).collect::<Vec<_>>())
                .unwrap_or_default();
            for role in roles {
                let _ = client.batch_execute(&format!("DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\""));
            }
        }
    }
}

fn prefix_of(url: &str) -> String {
    let (_, rest) = url.rsplit_once("schema=").expect("a store URL names its prefix");
    rest.split('&').next().unwrap_or(rest).to_string()
}

/// The schemas under `prefix`: every one (the control schema included), or tenant `tenant`'s.
fn schemas_of(client: &mut postgres::Client, prefix: &str, tenant: Option<&str>) -> Vec<String> {
    let rows = client
        .query(
            "SELECT nspname FROM pg_namespace WHERE starts_with(nspname, $1) ORDER BY nspname",
            &[&format!("{prefix}_")],
        )
        .expect("list schemas");
    let wanted: Option<Vec<String>> = tenant.map(|tenant| {
        let backend = tidemark_server::Postgres::from_url(&crate::support::with_schema("postgres://x/y", prefix))
            .expect("a prefix");
        [tidemark_server::Database::Producer, tidemark_server::Database::Inbox, tidemark_server::Database::Workflows]
            .map(|database| backend.schema(tenant, database))
            .to_vec()
    });
    rows.iter()
        .map(|row| row.get::<_, String>(0))
        .filter(|schema| wanted.as_ref().is_none_or(|w| w.contains(schema)))
        .collect()
}

/// Where tenant `tenant`'s `database` of the service of `data` is, as a `--db` takes it: a file
/// of its folder, or its PostgreSQL schema.
pub fn tenant_store(data: &Path, tenant: &str, database: tidemark_server::Database) -> String {
    match store_of(data) {
        None => path_str(&data.join("tenants").join(tenant).join(database.file_name())).to_string(),
        Some(url) => {
            let backend = tidemark_server::Postgres::from_url(&url).expect("a PostgreSQL store");
            crate::support::with_schema(backend.conn(), &backend.schema(tenant, database))
        }
    }
}

/// What the service of `data` has stored, to compare before and after (tenant `tenant`'s part, or
/// every tenant's): the folder's files but the control database (and SQLite's `-shm`), and on
/// PostgreSQL every row of the tenants' schemas too, each table's rows in order.
pub fn stored(data: &Path, tenant: Option<&str>) -> Vec<(String, Vec<u8>)> {
    let dir = match tenant {
        Some(tenant) => data.join("tenants").join(tenant),
        None => data.to_path_buf(),
    };
    let mut out = files(&dir);
    if let Some(url) = store_of(data) {
        let (_, mut client) = crate::support::postgres_server().expect("the test server answers");
        let prefix = prefix_of(&url);
        for schema in schemas_of(&mut client, &prefix, tenant) {
            if schema == format!("{prefix}_control") {
                continue;
            }
            let tables = client
                .query("SELECT tablename FROM pg_tables WHERE schemaname = $1 ORDER BY tablename", &[&schema])
                .expect("list tables");
            for table in tables.iter().map(|r| r.get::<_, String>(0)) {
                let rows: Vec<String> = client
                    .query(&format!(r#"SELECT t::text FROM "{schema}"."{table}" t ORDER BY t::text COLLATE "C""#), &[])
                    .expect("read a table")
                    .iter()
                    .map(|r| r.get(0))
                    .collect();
                out.push((format!("{schema}.{table}"), rows.join("\n").into_bytes()));
            }
        }
    }
    out.sort();
    out
}

/// The files under `dir` (none when it does not exist), but the control database and SQLite's
/// `-shm` files, by path.
pub fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if !path.to_string_lossy().ends_with("-shm") && !path.to_string_lossy().contains("server.db") {
                files.push((path.to_string_lossy().into_owned(), std::fs::read(&path).unwrap()));
            }
        }
    }
    files.sort();
    files
}

impl Server {
    /// Start `tidemark serve --data DATA --listen 127.0.0.1:0 EXTRA` and wait (bounded) for its
    /// "listening" line.
    pub fn start(data: &Path, extra: &[&str], env: &[(&str, &str)]) -> Server {
        Self::start_at(data, "127.0.0.1:0", extra, env)
    }

    /// [`Server::start`] on the address `listen` (to restart a server where its peers expect it).
    pub fn start_at(data: &Path, listen: &str, extra: &[&str], env: &[(&str, &str)]) -> Server {
        let mut command = Command::new(BIN);
        command.args(["serve", "--data", path_str(data), "--listen", listen]).args(extra);
        if let Some(store) = store_of(data) {
            command.args(["--store", &store]);
        }
        command
            .env_remove("TIDEMARK_CRASH_AT")
            .env("TIDEMARK_LOG__LEVEL", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (key, value) in env {
            command.env(key, value);
        }
        let mut child = command.spawn().expect("spawn tidemark serve");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        // read_line returns when the server prints its first line or exits.
        stdout.read_line(&mut line).expect("read the listening line");
        let first: Value = match serde_json::from_str(&line) {
            Ok(value) => value,
            Err(_) => {
                let mut err = String::new();
                let _ = child.stderr.take().expect("stderr").read_to_string(&mut err);
                let _ = child.kill();
                panic!("tidemark serve did not start: {line}\n{err}");
            }
        };
        assert_eq!(first["outcome"], "listening", "{first}");
        let stderr = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let mut pipe = child.stderr.take().expect("stderr");
        let sink = stderr.clone();
        std::thread::spawn(move || {
            let mut buffer = [0_u8; 4096];
            while let Ok(n) = pipe.read(&mut buffer) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().push_str(&String::from_utf8_lossy(&buffer[..n]));
            }
        });
        // Keep draining stdout in the background so the child never blocks on a full pipe.
        std::thread::spawn(move || {
            let mut rest = String::new();
            let _ = stdout.read_to_string(&mut rest);
        });
        let base = format!("http://{}", first["addr"].as_str().expect("addr"));
        let client = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().expect("client");
        Server { child: Some(child), stderr, base, data: data.to_path_buf(), client }
    }

    /// One request; returns the status and the JSON body (Null when the body is not JSON).
    pub fn call(&self, method: &str, path: &str, token: Option<&str>, body: Option<&Value>) -> (u16, Value) {
        let method = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
        let mut request = self.client.request(method, format!("{}{}", self.base, path));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = request.send().expect("the server answers");
        let status = response.status().as_u16();
        let text = response.text().unwrap_or_default();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// A raw body (for malformed JSON and oversized bodies).
    pub fn call_raw(&self, method: &str, path: &str, token: Option<&str>, body: Vec<u8>) -> (u16, Value) {
        let method = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
        let mut request = self
            .client
            .request(method, format!("{}{}", self.base, path))
            .header("content-type", "application/json")
            .body(body);
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let response = request.send().expect("the server answers");
        let status = response.status().as_u16();
        (status, serde_json::from_str(&response.text().unwrap_or_default()).unwrap_or(Value::Null))
    }

    pub fn text(&self, path: &str) -> (u16, String) {
        let response = self.client.get(format!("{}{}", self.base, path)).send().expect("the server answers");
        (response.status().as_u16(), response.text().unwrap_or_default())
    }

    /// A GET with a bearer token, as text (a dashboard page).
    pub fn text_with(&self, path: &str, token: Option<&str>) -> (u16, String) {
        let mut request = self.client.get(format!("{}{}", self.base, path));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let response = request.send().expect("the server answers");
        (response.status().as_u16(), response.text().unwrap_or_default())
    }

    /// Poll `check` every 20 ms until it returns Some, for at most `limit`.
    pub fn wait_for<T>(&self, limit: Duration, mut check: impl FnMut(&Server) -> Option<T>) -> T {
        let started = Instant::now();
        loop {
            if let Some(value) = check(self) {
                return value;
            }
            assert!(started.elapsed() < limit, "condition not reached within {limit:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// SIGTERM, then wait (bounded) for exit; returns the exit code and the stderr.
    pub fn terminate(&mut self) -> (i32, String) {
        let mut child = self.child.take().expect("running");
        let status = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill");
        assert!(status.success());
        let started = Instant::now();
        loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                std::thread::sleep(Duration::from_millis(50));
                let err = self.stderr.lock().unwrap().clone();
                return (status.code().unwrap_or(-1), err);
            }
            if started.elapsed() > Duration::from_secs(60) {
                let _ = child.kill();
                panic!("tidemark serve did not stop within 60 s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Wait (at most `limit`) for the server to exit by itself (a crash point), and answer its
    /// exit code.
    pub fn wait_exit(&mut self, limit: Duration) -> i32 {
        let mut child = self.child.take().expect("running");
        let started = Instant::now();
        loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                return status.code().unwrap_or(-1);
            }
            if started.elapsed() > limit {
                let _ = child.kill();
                panic!("tidemark serve did not exit within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL (a crash), and reap.
    pub fn kill9(&mut self) {
        let mut child = self.child.take().expect("running");
        child.kill().expect("SIGKILL");
        let _ = child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
