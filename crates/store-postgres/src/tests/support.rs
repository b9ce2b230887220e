//! The test database: connection string, one schema per test (dropped at the end), and the
//! relay's endpoints on PostgreSQL (an endpoint is a consumer's schema name).

use std::sync::atomic::{AtomicU64, Ordering};

use postgres::{Client, NoTls};
use tidemark_core::flow::AdvanceRequest;

const DEFAULT_CONN: &str = "host=127.0.0.1 port=5432 user=postgres dbname=test";

/// The test server's connection string.
pub fn conn_str() -> String {
    std::env::var("TIDEMARK_TEST_POSTGRES").unwrap_or_else(|_| DEFAULT_CONN.to_string())
}

/// Schemas made for one test: each name is unique to the process and the test, and every one is
/// dropped when the `TestDb` goes (also when the test panics).
pub struct TestDb {
    pub conn: String,
    /// The connection string the test started with (where databases are created and dropped).
    base: String,
    prefix: String,
    made: std::cell::RefCell<Vec<String>>,
    databases: std::cell::RefCell<Vec<String>>,
}

static NEXT: AtomicU64 = AtomicU64::new(0);

impl TestDb {
    /// `None` (after printing why) when the server does not answer: the test then returns.
    pub fn new(test: &str) -> Option<TestDb> {
        let conn = conn_str();
        if let Err(error) = Client::connect(&conn, NoTls) {
            println!("skipped: PostgreSQL not reachable at {conn}: {error}");
            return None;
        }
        let prefix = format!("t{}_{}_{test}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        Some(TestDb { base: conn.clone(), conn, prefix, made: Default::default(), databases: Default::default() })
    }

    /// A fresh schema name for this test (nothing is created).
    pub fn schema(&self, role: &str) -> String {
        let mut name = format!("{}_{role}", self.prefix);
        name.truncate(crate::SCHEMA_NAME_BYTES_MAX);
        self.made.borrow_mut().push(name.clone());
        name
    }

    /// A new, empty database on the server, dropped with the `TestDb`, and the connection string
    /// that names it; `None` when the test's connection string is a URL (a key=value string
    /// takes a second `dbname=`, which overrides the first).
    pub fn empty_database(&self) -> Option<String> {
        if self.base.contains("://") {
            println!("note: TIDEMARK_TEST_POSTGRES is a URL; the empty-database part of this test is not run");
            return None;
        }
        let name = self.prefix.clone();
        let mut admin = Client::connect(&self.base, NoTls).expect("the server answered a moment ago");
        admin.batch_execute(&format!("CREATE DATABASE \"{name}\"")).expect("create a database");
        self.databases.borrow_mut().push(name.clone());
        Some(format!("{} dbname={name}", self.base))
    }

    /// A plain connection of the test's own.
    pub fn client(&self) -> Client {
        Client::connect(&self.conn, NoTls).expect("the server answered a moment ago")
    }
}

/// Drop `schema`; a session that still holds a lock in it after 5 s (a transaction a store left
/// open, or a store of the test not dropped yet) is terminated first, and its pids returned, so
/// that a leak fails the test instead of hanging it.
fn drop_schema(client: &mut Client, schema: &str) -> Vec<i32> {
    let drop = format!("SET lock_timeout = '5s'; DROP SCHEMA IF EXISTS \"{schema}\" CASCADE");
    if client.batch_execute(&drop).is_ok() {
        return Vec::new();
    }
    let holders: Vec<i32> = client
        .query(
            "SELECT DISTINCT l.pid, pg_terminate_backend(l.pid) FROM pg_locks l
             JOIN pg_class c ON c.oid = l.relation JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = $1 AND l.pid <> pg_backend_pid()",
            &[&schema],
        )
        .map(|rows| rows.iter().map(|row| row.get(0)).collect())
        .unwrap_or_default();
    let _ = client.batch_execute(&drop);
    holders
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let mut leaks = Vec::new();
        if let Ok(mut client) = Client::connect(&self.conn, NoTls) {
            for schema in self.made.borrow().iter() {
                let holders = drop_schema(&mut client, schema);
                if !holders.is_empty() {
                    leaks.push(format!("{schema}: sessions {holders:?}"));
                }
            }
        }
        // A database the test made goes whole (with the schemas in it).
        if let Ok(mut client) = Client::connect(&self.base, NoTls) {
            for database in self.databases.borrow().iter() {
                let _ = client.batch_execute(&format!("DROP DATABASE IF EXISTS \"{database}\" WITH (FORCE)"));
            }
        }
        if !leaks.is_empty() && !std::thread::panicking() {
            panic!("a session still held locks in the test's schemas when the test ended (a transaction left open?): {leaks:?}");
        }
    }
}

/// Skip the test (return) when the server does not answer.
macro_rules! test_db {
    ($name:expr) => {
        match $crate::tests::support::TestDb::new($name) {
            Some(db) => db,
            None => return,
        }
    };
}
pub(crate) use test_db;

/// The built-in reservation domain's first advance of `flow`.
pub fn reserve(flow: &str) -> AdvanceRequest {
    AdvanceRequest {
        flow_id: flow.into(),
        expected_seq: 0,
        to_state: "reserved".into(),
        input: serde_json::json!({"quantity": 3}),
        schema_version: 1,
        traceparent: None,
    }
}

/// The advance of `flow` from `expected_seq` to `to_state` (reservation domain).
pub fn advance(flow: &str, expected_seq: i64, to_state: &str) -> AdvanceRequest {
    AdvanceRequest { expected_seq, to_state: to_state.into(), ..reserve(flow) }
}
