//! The workflow commands of the real binary (`tidemark worker`, `tidemark workflow ...`): bad
//! input exits 2 with a stable code and changes nothing on disk; idempotent start; list filters
//! and pages; retry, skip, fork, cancel, abandon, events and purge end to end with worker
//! processes; graceful shutdown on SIGTERM; the demo. Every wait is a bounded loop; no test
//! asserts on elapsed time.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::{self, ok, path_str, run, run_with};

pub(crate) const SKU: &str = "widget";
pub(crate) const STOCK: i64 = 100;
/// Worker rounds (each a `tidemark worker --until-idle` process) before a test gives up.
const ROUNDS_MAX: usize = 400;
/// Polls (10 ms apart) of a run's journal before a test gives up.
pub(crate) const POLLS_MAX: usize = 3_000;
/// The lease of test workers: a dead worker's runs are taken over soon after.
pub(crate) const LEASE_MS: &str = "200";

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis() as i64
}

pub(crate) fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

pub(crate) fn refs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// An order input for run `run_id` (order id = run id), with extra fields merged in.
pub(crate) fn order(run_id: &str, quantity: i64, extra: Value) -> String {
    let mut input = json!({"order_id": run_id, "sku": SKU, "quantity": quantity, "amount": 250 * quantity});
    input.as_object_mut().unwrap().extend(extra.as_object().expect("an object").clone());
    input.to_string()
}

pub(crate) fn is_terminal(status: &Value) -> bool {
    ["completed", "compensated", "failed", "cancelled", "parked", "continued"].contains(&status.as_str().unwrap_or(""))
}

/// A workflow store (`STOCK` units of `SKU`) and its payment log in a fresh folder: a SQLite
/// file (`wf.db`), or, inside [`on_postgres`], a fresh schema of the test server.
pub(crate) struct Wf {
    pub dir: tempfile::TempDir,
    /// The store: a file path, or a `postgres://` URL.
    pub db: PathBuf,
    pub payments: PathBuf,
    /// The PostgreSQL schema this `Wf` made (dropped with it).
    schema: Option<(String, String)>,
}

thread_local! {
    /// The PostgreSQL server `Wf::new` makes its stores on, inside [`on_postgres`] (a test runs on
    /// one thread; the same scenario code then runs on both backends).
    static POSTGRES: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// While the guard lives, every [`Wf::new`] of this thread makes its store in a fresh schema of
/// the test server (`TIDEMARK_TEST_POSTGRES_URL`, default the local one); `None`, after saying
/// why, when it does not answer.
pub(crate) fn on_postgres() -> Option<OnPostgres> {
    let (base, _) = support::postgres_server()?;
    POSTGRES.with(|pg| *pg.borrow_mut() = Some(base));
    Some(OnPostgres)
}

/// The test server's URL inside [`on_postgres`] (on this thread), else `None`.
pub(crate) fn postgres_base() -> Option<String> {
    POSTGRES.with(|pg| pg.borrow().clone())
}

/// See [`on_postgres`].
pub(crate) struct OnPostgres;

impl Drop for OnPostgres {
    fn drop(&mut self) {
        POSTGRES.with(|pg| *pg.borrow_mut() = None);
    }
}

/// Run `scenario` on a SQLite file, then again on PostgreSQL (skipped, saying why, without a
/// server): one test body, both backends.
pub(crate) fn on_both_backends(scenario: fn()) {
    scenario();
    if let Some(_postgres) = on_postgres() {
        scenario();
    }
}

static SCHEMAS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl Wf {
    pub(crate) fn new() -> Wf {
        let dir = tempfile::tempdir().expect("tempdir");
        let payments = dir.path().join("wf.payments.db");
        let (db, schema) = match POSTGRES.with(|pg| pg.borrow().clone()) {
            None => (dir.path().join("wf.db"), None),
            Some(base) => {
                let n = SCHEMAS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let schema = format!("wf_{}_{n}", std::process::id());
                (PathBuf::from(support::with_schema(&base, &schema)), Some((base, schema)))
            }
        };
        let out = ok(&["workflow", "init", "--db", path_str(&db), "--sku", SKU, "--quantity", &STOCK.to_string()]);
        assert_eq!((out["outcome"].as_str(), out["stock"]["stock"].as_i64()), (Some("initialized"), Some(STOCK)));
        if schema.is_none() {
            assert_eq!(out["payments_db"], path_str(&payments));
        }
        Wf { dir, db, payments, schema }
    }

    pub(crate) fn d(&self) -> &str {
        path_str(&self.db)
    }

    /// `tidemark workflow <sub> --db D <args>` as arguments.
    pub(crate) fn cmd(&self, sub: &str, args: &[&str]) -> Vec<String> {
        let mut all = strings(&["workflow", sub, "--db", self.d()]);
        all.extend(strings(args));
        all
    }

    pub(crate) fn wf(&self, sub: &str, args: &[&str]) -> Value {
        ok(&refs(&self.cmd(sub, args)))
    }

    pub(crate) fn start_cmd(&self, workflow: &str, run_id: &str, input: &str) -> Vec<String> {
        self.cmd("start", &["--workflow", workflow, "--run-id", run_id, "--input", input])
    }

    pub(crate) fn start(&self, workflow: &str, run_id: &str, input: &str) -> Value {
        let out = ok(&refs(&self.start_cmd(workflow, run_id, input)));
        assert_eq!(out["outcome"], "started", "{out}");
        out
    }

    pub(crate) fn show(&self, run_id: &str) -> Value {
        self.wf("show", &["--run-id", run_id])
    }

    pub(crate) fn status(&self, run_id: &str) -> String {
        self.show(run_id)["run"]["status"].as_str().expect("status").to_string()
    }

    /// `tidemark worker --until-idle` with test settings (short lease, no retry delay) and
    /// `extra` arguments.
    pub(crate) fn worker_cmd(&self, extra: &[&str]) -> Vec<String> {
        let mut args = strings(&["worker", "--db", self.d(), "--payments-db", path_str(&self.payments)]);
        args.extend(strings(&["--lease-ms", LEASE_MS, "--poll-ms", "10", "--retry-delay-ms", "0"]));
        args.extend(strings(extra));
        args
    }

    pub(crate) fn worker(&self, extra: &[&str]) -> Value {
        let mut args = self.worker_cmd(&["--until-idle", "--worker-id", "test-worker"]);
        args.extend(strings(extra));
        let out = ok(&refs(&args));
        assert_eq!(out["outcome"], "worked", "{out}");
        assert_eq!(out["errors"], 0, "the worker hit errors: {out}");
        out
    }

    /// Worker processes, one after the other (bounded), until every run is finished. Returns
    /// how many executions those workers dropped or stopped because a lease ran out under them
    /// (`lost` + `aborted`): a heartbeat that came later than the short test lease lets the run
    /// be claimed again, and its current step may then run twice (at least once, as designed).
    pub(crate) fn drive(&self, run_ids: &[&str], extra: &[&str]) -> u64 {
        let mut args = vec!["--idle-wait-ms", "300"];
        args.extend(extra);
        let mut leases_lost = 0;
        for _ in 0..ROUNDS_MAX {
            let out = self.worker(&args);
            leases_lost += out["lost"].as_u64().expect("lost") + out["aborted"].as_u64().expect("aborted");
            if run_ids.iter().all(|id| is_terminal(&self.show(id)["run"]["status"])) {
                return leases_lost;
            }
            // A dead worker's lease, a retry backoff or a timer is not over yet.
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("runs {run_ids:?} did not finish in {ROUNDS_MAX} worker rounds");
    }

    pub(crate) fn orders(&self) -> Value {
        self.wf("orders", &[])
    }

    pub(crate) fn payment_calls(&self) -> Vec<Value> {
        let out = ok(&["workflow", "payments", "--db", self.d(), "--payments-db", path_str(&self.payments)]);
        out["calls"].as_array().expect("calls").clone()
    }

    /// Effects of one order, by kind, in order.
    pub(crate) fn effects_of(&self, order_id: &str) -> Vec<String> {
        self.orders()["effects"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["order_id"] == order_id)
            .map(|e| e["kind"].as_str().unwrap().to_string())
            .collect()
    }

    /// Poll (bounded) until the run's journal has at least `steps` settled entries.
    pub(crate) fn wait_journaled(&self, run_id: &str, steps: usize, child: &mut std::process::Child) {
        for _ in 0..POLLS_MAX {
            let out = run(&refs(&self.cmd("show", &["--run-id", run_id])));
            if out.code == 0 {
                let settled = out.json["journal"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter(|e| ["completed", "failed", "skipped"].contains(&e["status"].as_str().unwrap()))
                    .count();
                if settled >= steps {
                    return;
                }
            }
            assert!(child.try_wait().expect("worker process").is_none(), "the worker process ended early");
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("run {run_id} never journaled {steps} steps");
    }

    /// The invariants of the order tables and the payment log after every run has finished:
    /// no transactional step applied twice, stock consistent, each external step called with
    /// one idempotency key (`<run>:<seq>:<step>`, the step's journal position), charged or
    /// refunded at most once.
    pub(crate) fn assert_consistent(&self) {
        let orders = self.orders();
        let mut effects: BTreeMap<(String, String), usize> = BTreeMap::new();
        for e in orders["effects"].as_array().unwrap() {
            *effects
                .entry((e["order_id"].as_str().unwrap().into(), e["kind"].as_str().unwrap().into()))
                .or_default() += 1;
        }
        assert!(effects.values().all(|n| *n == 1), "an effect was applied twice: {effects:?}");
        let mut held = 0;
        for r in orders["reservations"].as_array().unwrap() {
            let id = r["order_id"].as_str().unwrap().to_string();
            let has = |kind: &str| effects.contains_key(&(id.clone(), kind.to_string()));
            let expected = match r["status"].as_str().unwrap() {
                "reserved" => [true, false, false],
                "shipped" => [true, false, true],
                "released" => [true, true, false],
                other => panic!("unknown reservation status {other}"),
            };
            assert_eq!([has("reserve"), has("release"), has("ship")], expected, "effects of {id}: {orders}");
            if r["status"] != "released" {
                held += r["quantity"].as_i64().unwrap();
            }
        }
        let reserved: BTreeSet<&str> =
            orders["reservations"].as_array().unwrap().iter().map(|r| r["order_id"].as_str().unwrap()).collect();
        for (order_id, kind) in effects.keys() {
            assert!(reserved.contains(order_id.as_str()), "a {kind} effect of {order_id} without its reservation");
        }
        let stock = orders["stock"].as_array().unwrap().iter().find(|s| s["sku"] == SKU).unwrap()["stock"].as_i64();
        assert_eq!(stock, Some(STOCK - held), "stock is not the initial stock less what is held: {orders}");

        // Calls by (run, op): one key each, at most one success.
        let mut keys: BTreeMap<(String, String), BTreeSet<String>> = BTreeMap::new();
        let mut successes: BTreeMap<String, usize> = BTreeMap::new();
        for call in self.payment_calls() {
            let key = call["idempotency_key"].as_str().unwrap().to_string();
            let run_id = key.split(':').next().unwrap().to_string();
            keys.entry((run_id, call["op"].as_str().unwrap().into())).or_default().insert(key.clone());
            if ["charged", "refunded"].contains(&call["outcome"].as_str().unwrap()) {
                *successes.entry(key).or_default() += 1;
            }
        }
        assert!(successes.values().all(|n| *n == 1), "a payment succeeded twice under one key: {successes:?}");
        for ((run_id, op), run_keys) in &keys {
            assert_eq!(run_keys.len(), 1, "the {op} calls of run {run_id} used several keys: {run_keys:?}");
            let key = run_keys.iter().next().unwrap();
            let rest = &key[run_id.len() + 1..];
            let (seq, name) = rest.split_once(':').unwrap();
            let shown = run(&refs(&self.cmd("show", &["--run-id", run_id])));
            if shown.json["error"]["code"] == "not_found" {
                continue; // purged
            }
            let journal = shown.json["journal"].clone();
            let entry = journal.as_array().unwrap().iter().find(|e| e["seq"] == seq.parse::<i64>().unwrap());
            let entry = entry.unwrap_or_else(|| panic!("no journal entry at {seq} for key {key}: {journal}"));
            assert_eq!(entry["name"], name, "the key {key} is not its step's: {entry}");
        }
    }
}

/// The database file and its WAL, byte for byte (None when absent).
fn files(db: &Path) -> (Option<Vec<u8>>, Option<Vec<u8>>) {
    let wal = PathBuf::from(format!("{}-wal", db.display()));
    (std::fs::read(db).ok(), std::fs::read(wal).ok())
}

/// Run a command that must fail with exit 2 and `code`; return its JSON.
fn refused(args: &[String], code: &str) -> Value {
    let r = run(&refs(args));
    assert_eq!(r.code, 2, "tidemark {args:?} should exit 2:\n{}\n{}", r.stdout, r.stderr);
    assert_eq!(r.json["outcome"], "error", "{}", r.stdout);
    assert_eq!(r.json["error"]["code"], code, "tidemark {args:?}: {}", r.stdout);
    r.json
}

// ---------------------------------------------------------------------------------------------

#[test]
fn bad_input_exits_2_with_a_stable_code_and_changes_nothing() {
    let w = Wf::new();
    w.start("order_saga", "done", &order("done", 1, json!({})));
    w.start("sleepy_order", "broken", &order("broken", 1, json!({"fail": "charge_payment"})));
    w.start("sleepy_order", "waiting", &order("waiting", 1, json!({"approval": "approve"})));
    w.drive(&["done", "broken"], &[]);
    assert_eq!((w.status("done").as_str(), w.status("broken").as_str()), ("completed", "failed"));
    assert_eq!(w.status("waiting"), "waiting");
    let input_file = w.dir.path().join("input.json");
    std::fs::write(&input_file, "{\"order_id\": ").unwrap();
    let input_file = path_str(&input_file).to_string();
    let missing_file = w.dir.path().join("missing.json");
    let missing_file = path_str(&missing_file).to_string();
    let good = order("new-run", 1, json!({}));
    let cases: Vec<(Vec<String>, &str)> = vec![
        (w.start_cmd("no_such_workflow", "r9", &good), "unknown_workflow"),
        (w.start_cmd("order_saga", "r9", "{\"order_id\": "), "invalid_input"),
        (w.start_cmd("order_saga", "r9", "[1, 2]"), "invalid_input"),
        // 2^64 would be stored as a float: refused, never rounded.
        (
            w.start_cmd(
                "order_saga",
                "r9",
                r#"{"order_id": "r9", "sku": "s", "quantity": 1, "amount": 18446744073709551616}"#,
            ),
            "inexact_number",
        ),
        (
            w.cmd(
                "send-event",
                &["--run-id", "waiting", "--name", "approve", "--payload", r#"{"n": 0.10000000000000000001}"#],
            ),
            "inexact_number",
        ),
        (
            w.start_cmd(
                "order_saga",
                "r9",
                &json!({"order_id": "r9", "sku": SKU, "quantity": 0, "amount": 1}).to_string(),
            ),
            "invalid_input",
        ),
        (w.start_cmd("sleepy_order", "r9", &order("r9", 1, json!({"approval": "bad name"}))), "invalid_input"),
        (w.cmd("start", &["--workflow", "order_saga", "--run-id", "r9", "--input-file", &input_file]), "invalid_input"),
        (
            w.cmd("start", &["--workflow", "order_saga", "--run-id", "r9", "--input-file", &missing_file]),
            "invalid_argument",
        ),
        (w.cmd("start", &["--workflow", "order_saga", "--run-id", "r9"]), "invalid_argument"),
        (
            w.cmd(
                "start",
                &["--workflow", "order_saga", "--run-id", "r9", "--input", &good, "--input-file", &input_file],
            ),
            "invalid_argument",
        ),
        (w.start_cmd("order_saga", "bad id", &good), "invalid_id"),
        (w.start_cmd("order_saga", &"x".repeat(300), &good), "invalid_id"),
        (
            w.cmd("start", &["--workflow", "order_saga", "--run-id", "r9", "--input", &good, "--key", "bad key"]),
            "invalid_id",
        ),
        (
            w.cmd(
                "start",
                &[
                    "--workflow",
                    "order_saga",
                    "--run-id",
                    "r9",
                    "--input",
                    &good,
                    "--start-at-ms",
                    &i64::MAX.to_string(),
                ],
            ),
            "invalid_argument",
        ),
        (w.start_cmd("order_saga", "done", &order("done", 2, json!({}))), "run_conflict"),
        (w.start_cmd("sleepy_order", "done", &order("done", 1, json!({}))), "run_conflict"),
        (w.cmd("show", &["--run-id", "nope"]), "not_found"),
        (w.cmd("show", &["--run-id", "bad id"]), "invalid_id"),
        (w.cmd("retry", &["--run-id", "done", "--reason", "again"]), "invalid_state_change"),
        (w.cmd("retry", &["--run-id", "waiting", "--reason", "again"]), "invalid_state_change"),
        (w.cmd("retry", &["--run-id", "nope", "--reason", "again"]), "not_found"),
        (w.cmd("retry", &["--run-id", "broken", "--reason", "  "]), "invalid_argument"),
        (w.cmd("cancel", &["--run-id", "done", "--reason", "late"]), "invalid_state_change"),
        (w.cmd("cancel", &["--run-id", "nope", "--reason", "late"]), "not_found"),
        (w.cmd("abandon", &["--run-id", "done", "--reason", "late"]), "invalid_state_change"),
        (w.cmd("skip", &["--run-id", "broken", "--step", "9", "--reason", "r"]), "not_found"),
        (w.cmd("skip", &["--run-id", "broken", "--step", "0", "--reason", "r"]), "invalid_state_change"),
        (w.cmd("skip", &["--run-id", "done", "--step", "1", "--reason", "r"]), "invalid_state_change"),
        (w.cmd("skip", &["--run-id", "broken", "--step", "2", "--output", "{nope", "--reason", "r"]), "invalid_input"),
        (w.cmd("skip", &["--run-id", "broken", "--step", "99999", "--reason", "r"]), "invalid_seq"),
        (w.cmd("fork", &["--run-id", "broken", "--from-step", "9", "--new-run-id", "f1"]), "invalid_seq"),
        (w.cmd("fork", &["--run-id", "broken", "--from-step", "1", "--new-run-id", "done"]), "already_exists"),
        (w.cmd("fork", &["--run-id", "nope", "--from-step", "0", "--new-run-id", "f1"]), "not_found"),
        (w.cmd("fork", &["--run-id", "broken", "--from-step", "0", "--new-run-id", "bad id"]), "invalid_id"),
        (w.cmd("send-event", &["--run-id", "waiting", "--name", "approve", "--payload", "{nope"]), "invalid_input"),
        (w.cmd("send-event", &["--run-id", "waiting", "--name", "bad name", "--payload", "{}"]), "invalid_id"),
        (w.cmd("send-event", &["--run-id", "done", "--name", "approve", "--payload", "{}"]), "invalid_state_change"),
        (w.cmd("send-event", &["--run-id", "nope", "--name", "approve", "--payload", "{}"]), "not_found"),
        (w.cmd("list", &["--status", "sleepy"]), "invalid_argument"),
        (w.cmd("list", &["--limit", "0"]), "limit_exceeded"),
        (w.cmd("list", &["--limit", "1001"]), "limit_exceeded"),
        (w.cmd("list", &["--after", "yesterday"]), "invalid_argument"),
        (w.cmd("list", &["--workflow", "bad name"]), "invalid_id"),
        (w.cmd("purge", &["--batch-rows", "0"]), "limit_exceeded"),
        (w.cmd("purge", &["--older-than-ms=-1"]), "invalid_argument"),
        (w.cmd("seed-stock", &["--sku", SKU, "--quantity=-5"]), "invalid_argument"),
        (w.cmd("seed-stock", &["--sku", "bad sku", "--quantity", "5"]), "invalid_id"),
        (w.worker_cmd(&["--until-idle", "--lease-ms", "50"]), "invalid_argument"),
        (w.worker_cmd(&["--until-idle", "--concurrency", "0"]), "invalid_argument"),
        (w.worker_cmd(&["--until-idle", "--worker-id", "bad id"]), "invalid_id"),
        (w.worker_cmd(&["--until-idle", "--max-seconds", "5"]), "invalid_argument"),
        (w.worker_cmd(&["--max-seconds", "0"]), "invalid_argument"),
        (w.worker_cmd(&["--until-idle", "--max-attempts", "0"]), "invalid_argument"),
        (w.worker_cmd(&["--idle-wait-ms", "10"]), "invalid_argument"),
        (w.worker_cmd(&["--until-idle", "--idle-wait-ms", "3600001"]), "invalid_argument"),
    ];
    // A clean read first, so that the WAL of earlier writers is checkpointed away.
    w.wf("list", &[]);
    let before_files = files(&w.db);
    let before_list = w.wf("list", &[]);
    let before_orders = w.orders();
    let before_calls = w.payment_calls();
    for (args, code) in &cases {
        refused(args, code);
        assert_eq!(files(&w.db), before_files, "tidemark {args:?} changed the database file");
    }
    assert_eq!(w.wf("list", &[]), before_list);
    assert_eq!(w.orders(), before_orders);
    assert_eq!(w.payment_calls(), before_calls);
    assert!(run(&refs(&w.cmd("show", &["--run-id", "r9"]))).code == 2, "no run r9 was started");
}

#[test]
fn a_missing_database_is_never_created() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("absent.db");
    let d = path_str(&db);
    let commands: Vec<Vec<&str>> = vec![
        vec!["workflow", "start", "--db", d, "--workflow", "order_saga", "--run-id", "r1", "--input", "{}"],
        vec!["workflow", "list", "--db", d],
        vec!["workflow", "show", "--db", d, "--run-id", "r1"],
        vec!["workflow", "cancel", "--db", d, "--run-id", "r1", "--reason", "x"],
        vec!["workflow", "retry", "--db", d, "--run-id", "r1", "--reason", "x"],
        vec!["workflow", "abandon", "--db", d, "--run-id", "r1", "--reason", "x"],
        vec!["workflow", "fork", "--db", d, "--run-id", "r1", "--from-step", "0", "--new-run-id", "r2"],
        vec!["workflow", "skip", "--db", d, "--run-id", "r1", "--step", "0", "--reason", "x"],
        vec!["workflow", "send-event", "--db", d, "--run-id", "r1", "--name", "e", "--payload", "{}"],
        vec!["workflow", "purge", "--db", d],
        vec!["workflow", "unclaimable", "--db", d],
        vec!["workflow", "orders", "--db", d],
        vec!["workflow", "payments", "--db", d],
        vec!["workflow", "seed-stock", "--db", d, "--sku", SKU, "--quantity", "1"],
        vec!["worker", "--db", d, "--until-idle"],
    ];
    for args in commands {
        let r = run(&args);
        assert_eq!(r.code, 2, "tidemark {args:?}: {}", r.stdout);
        // `start` validates its input first: `{}` is not an order.
        let expected = if args[1] == "start" { "invalid_input" } else { "not_initialized" };
        assert_eq!(r.json["error"]["code"], expected, "tidemark {args:?}: {}", r.stdout);
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert!(left.is_empty(), "tidemark {args:?} created files: {left:?}");
    }
    let r = run(&[
        "workflow",
        "start",
        "--db",
        d,
        "--workflow",
        "order_saga",
        "--run-id",
        "r1",
        "--input",
        &order("r1", 1, json!({})),
    ]);
    assert_eq!(r.json["error"]["code"], "not_initialized", "{}", r.stdout);
    assert!(!db.exists());
    // `workflow init` creates it, and re-running it never resets anything.
    ok(&["workflow", "init", "--db", d]);
    ok(&[
        "workflow",
        "start",
        "--db",
        d,
        "--workflow",
        "order_saga",
        "--run-id",
        "r1",
        "--input",
        &order("r1", 1, json!({})),
    ]);
    ok(&["workflow", "init", "--db", d, "--sku", SKU, "--quantity", "3"]);
    assert_eq!(ok(&["workflow", "list", "--db", d])["runs"].as_array().unwrap().len(), 1);
}

/// `workflow result` follows a chain of runs continued as new to its last run, says `not_ended`
/// while the run goes on, and refuses a wait over its bound; `--timeout-ms` gives a run a
/// deadline that cancels it.
#[test]
fn result_follows_a_chain_and_timeout_ms_sets_a_deadline() {
    on_both_backends(result_follows_a_chain_and_timeout_ms_sets_a_deadline_on);
}

fn result_follows_a_chain_and_timeout_ms_sets_a_deadline_on() {
    let w = Wf::new();
    let orders: Vec<Value> =
        ["r1", "r2"].iter().map(|id| serde_json::from_str(&order(id, 1, json!({}))).unwrap()).collect();
    w.start("order_batch", "chain", &json!({"orders": orders, "per_run": 1}).to_string());
    let early = w.wf("result", &["--run-id", "chain"]);
    assert_eq!((early["outcome"].as_str(), early["done"].as_bool()), (Some("not_ended"), Some(false)), "{early}");
    w.drive(&["chain", "chain.c1"], &[]);
    let done = w.wf("result", &["--run-id", "chain", "--wait-ms", "1000"]);
    assert_eq!((done["outcome"].as_str(), done["run_id"].as_str()), (Some("ended"), Some("chain.c1")), "{done}");
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["result"]["orders"].as_array().map(Vec::len), Some(2), "{done}");
    refused(&w.cmd("result", &["--run-id", "chain", "--wait-ms", "60001"]), "invalid_argument");
    refused(&w.cmd("result", &["--run-id", "nobody"]), "not_found");

    let sleepy = order("late", 1, json!({"approval": "approve"}));
    let started =
        w.wf("start", &["--workflow", "sleepy_order", "--run-id", "late", "--input", &sleepy, "--timeout-ms", "200"]);
    assert_eq!(started["outcome"], "started");
    assert!(w.show("late")["run"]["deadline_ms"].is_i64());
    w.drive(&["late"], &[]);
    let late = w.wf("result", &["--run-id", "late"]);
    assert_eq!(late["status"], "cancelled", "{late}");
    assert!(late["error"].as_str().unwrap_or("").starts_with("deadline_passed"), "{late}");
    refused(
        &w.cmd("start", &["--workflow", "sleepy_order", "--run-id", "bad", "--input", &sleepy, "--timeout-ms", "0"]),
        "invalid_argument",
    );
    refused(&w.cmd("show", &["--run-id", "bad"]), "not_found");
}

#[test]
fn start_is_idempotent_per_run_id() {
    on_both_backends(start_is_idempotent_per_run_id_on);
}

fn start_is_idempotent_per_run_id_on() {
    let w = Wf::new();
    let input = order("o1", 2, json!({}));
    w.start("order_saga", "o1", &input);
    // The same input written differently (key order) is the same request.
    let reordered = json!({"amount": 500, "quantity": 2, "sku": SKU, "order_id": "o1"}).to_string();
    let again = w.wf("start", &["--workflow", "order_saga", "--run-id", "o1", "--input", &reordered]);
    assert_eq!((again["outcome"].as_str(), again["status"].as_str()), (Some("existing"), Some("pending")), "{again}");
    let file = w.dir.path().join("o1.json");
    std::fs::write(&file, &input).unwrap();
    let from_file = w.wf("start", &["--workflow", "order_saga", "--run-id", "o1", "--input-file", path_str(&file)]);
    assert_eq!(from_file["outcome"], "existing");
    let conflict = refused(&w.start_cmd("order_saga", "o1", &order("o1", 3, json!({}))), "run_conflict");
    assert!(conflict["error"]["message"].as_str().unwrap().contains("another input"), "{conflict}");
    w.drive(&["o1"], &[]);
    let done = ok(&refs(&w.start_cmd("order_saga", "o1", &input)));
    assert_eq!((done["outcome"].as_str(), done["status"].as_str()), (Some("existing"), Some("completed")));
    assert_eq!(w.effects_of("o1"), ["reserve", "ship"], "a second start ran nothing again");
    // Purged, the run leaves a receipt: a late duplicate start is still recognised.
    let later = (now_ms() + 10 * 86_400_000).to_string();
    let purged = ok(&["--now-ms", &later, "workflow", "purge", "--db", w.d()]);
    assert_eq!((purged["runs_deleted"].as_u64(), purged["batches"].as_u64()), (Some(1), Some(1)), "{purged}");
    refused(&w.cmd("show", &["--run-id", "o1"]), "not_found");
    let late = ok(&refs(&w.start_cmd("order_saga", "o1", &input)));
    assert_eq!((late["outcome"].as_str(), late["status"].as_str()), (Some("existing"), Some("completed")));
    refused(&w.start_cmd("order_saga", "o1", &order("o1", 3, json!({}))), "run_conflict");
    assert_eq!(w.wf("list", &[])["runs"], json!([]));
    w.assert_consistent();
}

#[test]
fn list_filters_and_pages() {
    on_both_backends(list_filters_and_pages_on);
}

fn list_filters_and_pages_on() {
    let w = Wf::new();
    for (i, (workflow, id)) in
        [("order_saga", "a"), ("sleepy_order", "b"), ("order_saga", "c"), ("sleepy_order", "d"), ("order_saga", "e")]
            .into_iter()
            .enumerate()
    {
        let at = (1_000 * (i + 1)).to_string();
        let out = ok(&[&["--now-ms", &at][..], &refs(&w.start_cmd(workflow, id, &order(id, 1, json!({}))))].concat());
        assert_eq!(out["outcome"], "started");
    }
    let ids = |out: &Value| -> Vec<String> {
        out["runs"].as_array().unwrap().iter().map(|r| r["run_id"].as_str().unwrap().to_string()).collect()
    };
    // Pages of two, following the cursor.
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    for _ in 0..10 {
        let mut args = vec!["--limit", "2"];
        if let Some(cursor) = &after {
            args.extend(["--after", cursor.as_str()]);
        }
        let page = w.wf("list", &args);
        seen.extend(ids(&page));
        match page["next_after"].as_str() {
            Some(cursor) => after = Some(cursor.to_string()),
            None => break,
        }
    }
    assert_eq!(seen, ["a", "b", "c", "d", "e"]);
    assert_eq!(ids(&w.wf("list", &["--workflow", "sleepy_order"])), ["b", "d"]);
    assert_eq!(ids(&w.wf("list", &["--created-after-ms", "1000", "--created-before-ms", "4000"])), ["b", "c"]);
    assert_eq!(ids(&w.wf("list", &["--status", "pending", "--workflow", "order_saga", "--limit", "1"])), ["a"]);
    assert_eq!(w.wf("list", &["--limit", "5"])["next_after"], "5000:e", "a full page has a cursor");
    w.drive(&["a", "b", "c", "d", "e"], &[]);
    assert_eq!(ids(&w.wf("list", &["--status", "completed"])), ["a", "b", "c", "d", "e"]);
    assert!(ids(&w.wf("list", &["--status", "pending"])).is_empty());
    w.assert_consistent();
}

#[test]
fn a_failed_run_is_retried_from_its_failed_step() {
    on_both_backends(a_failed_run_is_retried_from_its_failed_step_on);
}

fn a_failed_run_is_retried_from_its_failed_step_on() {
    let w = Wf::new();
    // The payment service is down for the first three calls; two attempts per step.
    w.start("sleepy_order", "r1", &order("r1", 2, json!({"flaky_attempts": 3})));
    w.drive(&["r1"], &["--max-attempts", "2"]);
    let failed = w.show("r1");
    assert_eq!(failed["run"]["status"], "failed", "{failed}");
    let charge = &failed["journal"][2];
    assert_eq!(
        (charge["name"].as_str(), charge["status"].as_str(), charge["attempts"].as_u64()),
        (Some("charge_payment"), Some("failed"), Some(2))
    );
    assert_eq!(w.effects_of("r1"), ["reserve"], "a plain workflow keeps its reservation for the operator");
    let retried = w.wf("retry", &["--run-id", "r1", "--reason", "payment service is back"]);
    assert_eq!((retried["outcome"].as_str(), retried["run"]["status"].as_str()), (Some("retried"), Some("pending")));
    w.drive(&["r1"], &["--max-attempts", "2"]);
    let done = w.show("r1");
    assert_eq!(done["run"]["status"], "completed", "{done}");
    // Every attempt is recorded, with its error; the journal entry's budget started over.
    let charge_attempts: Vec<bool> = done["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["seq"] == 2)
        .map(|a| a["ok"].as_bool().unwrap())
        .collect();
    assert_eq!(charge_attempts, [false, false, false, true]);
    assert!(done["journal"][2]["reason"].as_str().unwrap().contains("payment service is back"));
    let outcomes: Vec<(String, String)> = w
        .payment_calls()
        .iter()
        .map(|c| (c["idempotency_key"].as_str().unwrap().into(), c["outcome"].as_str().unwrap().into()))
        .collect();
    let key = "r1:2:charge_payment".to_string();
    assert_eq!(
        outcomes,
        [
            (key.clone(), "unavailable".into()),
            (key.clone(), "unavailable".into()),
            (key.clone(), "unavailable".into()),
            (key, "charged".into())
        ]
    );
    assert_eq!(w.effects_of("r1"), ["reserve", "ship"]);
    refused(&w.cmd("retry", &["--run-id", "r1", "--reason", "again"]), "invalid_state_change");
    w.assert_consistent();
}

#[test]
fn a_failed_step_is_skipped_with_an_operator_output() {
    on_both_backends(a_failed_step_is_skipped_with_an_operator_output_on);
}

fn a_failed_step_is_skipped_with_an_operator_output_on() {
    let w = Wf::new();
    w.start("sleepy_order", "s1", &order("s1", 1, json!({"fail": "charge_payment"})));
    w.drive(&["s1"], &[]);
    assert_eq!(w.status("s1"), "failed");
    let skipped = w.wf(
        "skip",
        &[
            "--run-id",
            "s1",
            "--step",
            "2",
            "--output",
            "{\"charge_id\": \"paid-by-phone\"}",
            "--reason",
            "paid by phone",
        ],
    );
    assert_eq!((skipped["outcome"].as_str(), skipped["run"]["status"].as_str()), (Some("skipped"), Some("pending")));
    w.drive(&["s1"], &[]);
    let done = w.show("s1");
    assert_eq!(done["run"]["status"], "completed", "{done}");
    assert_eq!(done["journal"][2]["status"], "skipped");
    assert_eq!(done["run"]["result"]["charge_payment"], json!({"charge_id": "paid-by-phone"}));
    assert_eq!(w.effects_of("s1"), ["reserve", "ship"]);
    w.assert_consistent();
}

#[test]
fn a_fork_reuses_the_journal_before_its_step() {
    on_both_backends(a_fork_reuses_the_journal_before_its_step_on);
}

fn a_fork_reuses_the_journal_before_its_step_on() {
    let w = Wf::new();
    w.start("sleepy_order", "src", &order("src", 4, json!({"flaky_attempts": 3})));
    w.drive(&["src"], &["--max-attempts", "2"]);
    assert_eq!(w.status("src"), "failed");
    let forked = w.wf("fork", &["--run-id", "src", "--from-step", "2", "--new-run-id", "copy"]);
    assert_eq!((forked["outcome"].as_str(), forked["run"]["forked_from"].as_str()), (Some("forked"), Some("src")));
    w.drive(&["copy"], &["--max-attempts", "5"]);
    let copy = w.show("copy");
    assert_eq!(copy["run"]["status"], "completed", "{copy}");
    // The reservation (step 0) was reused, not made again; the fork shipped it.
    assert_eq!(w.effects_of("src"), ["reserve", "ship"]);
    let keys: BTreeSet<String> =
        w.payment_calls().iter().map(|c| c["idempotency_key"].as_str().unwrap().to_string()).collect();
    assert_eq!(keys, BTreeSet::from(["src:2:charge_payment".to_string(), "copy:2:charge_payment".to_string()]));
    assert_eq!(w.status("src"), "failed", "the source run stays as it was");
    w.assert_consistent();
}

#[test]
fn events_wake_a_waiting_run() {
    on_both_backends(events_wake_a_waiting_run_on);
}

fn events_wake_a_waiting_run_on() {
    let w = Wf::new();
    w.start("sleepy_order", "yes", &order("yes", 1, json!({"approval": "approve"})));
    w.start("sleepy_order", "no", &order("no", 1, json!({"approval": "approve"})));
    w.worker(&[]);
    assert_eq!((w.status("yes").as_str(), w.status("no").as_str()), ("waiting", "waiting"));
    let sent = w.wf(
        "send-event",
        &["--run-id", "yes", "--name", "approve", "--event-id", "ev-1", "--payload", "{\"approved\": true}"],
    );
    assert_eq!(sent["outcome"], "sent");
    let again = w.wf(
        "send-event",
        &["--run-id", "yes", "--name", "approve", "--event-id", "ev-1", "--payload", "{\"approved\": true}"],
    );
    assert_eq!(again["outcome"], "duplicate");
    refused(
        &w.cmd("send-event", &["--run-id", "yes", "--name", "approve", "--event-id", "ev-1", "--payload", "{}"]),
        "already_exists",
    );
    w.wf("send-event", &["--run-id", "no", "--name", "approve", "--payload", "{\"approved\": false}"]);
    w.drive(&["yes", "no"], &[]);
    let yes = w.show("yes");
    assert_eq!(yes["run"]["status"], "completed");
    assert_eq!(yes["events"][0]["consumed_by_seq"], 2);
    let no = w.show("no");
    assert_eq!(
        (no["run"]["status"].as_str(), no["run"]["result"]["approved"].as_bool()),
        (Some("completed"), Some(false))
    );
    assert_eq!(w.effects_of("yes"), ["reserve", "ship"]);
    assert_eq!(w.effects_of("no"), ["reserve", "release"]);
    w.assert_consistent();
}

#[test]
fn cancel_compensates_a_saga_and_stops_a_plain_workflow() {
    on_both_backends(cancel_compensates_a_saga_and_stops_a_plain_workflow_on);
}

fn cancel_compensates_a_saga_and_stops_a_plain_workflow_on() {
    let w = Wf::new();
    // The saga sleeps a day between the charge and the shipment.
    w.start("order_saga", "saga", &order("saga", 2, json!({"ship_after_ms": 86_400_000})));
    w.start("sleepy_order", "plain", &order("plain", 1, json!({"approval": "approve"})));
    w.start("sleepy_order", "given-up", &order("given-up", 1, json!({"approval": "approve"})));
    w.worker(&[]);
    assert_eq!((w.status("saga").as_str(), w.status("plain").as_str()), ("sleeping", "waiting"));
    // Abandon: ends `cancelled` at once with the reason; nothing is compensated.
    let abandoned = w.wf("abandon", &["--run-id", "given-up", "--reason", "approver left the company"]);
    assert_eq!(
        (abandoned["outcome"].as_str(), abandoned["run"]["status"].as_str()),
        (Some("abandoned"), Some("cancelled"))
    );
    assert!(abandoned["run"]["error"].as_str().unwrap().contains("approver left the company"));
    refused(&w.cmd("abandon", &["--run-id", "given-up", "--reason", "again"]), "invalid_state_change");
    assert_eq!(w.effects_of("given-up"), ["reserve"]);
    for id in ["saga", "plain"] {
        let out = w.wf("cancel", &["--run-id", id, "--reason", "customer changed their mind"]);
        assert_eq!(
            (out["outcome"].as_str(), out["run"]["cancel_requested"].as_bool()),
            (Some("cancel_requested"), Some(true))
        );
    }
    w.drive(&["saga", "plain"], &[]);
    let saga = w.show("saga");
    assert_eq!(saga["run"]["status"], "cancelled", "{saga}");
    let names: Vec<&str> = saga["journal"].as_array().unwrap().iter().map(|e| e["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["reserve_inventory", "charge_payment", "sleep", "compensate:charge_payment", "compensate:reserve_inventory"]
    );
    assert_eq!(w.effects_of("saga"), ["reserve", "release"]);
    assert_eq!(w.status("plain"), "cancelled");
    assert_eq!(w.effects_of("plain"), ["reserve"], "a plain workflow compensates nothing");
    w.assert_consistent();
}

#[test]
fn runs_of_unknown_workflows_are_reported_unclaimable() {
    use tidemark_core::workflow::{StartRequest, WorkflowStore};
    let w = Wf::new();
    let mut store = tidemark_store_sqlite::SqliteWorkflows::open(&w.db).unwrap();
    let legacy = |workflow: &str, version| StartRequest {
        run_id: format!("{workflow}-{version}"),
        workflow: workflow.into(),
        version,
        input: json!({}),
        key: None,
        start_at_ms: None,
        queue: None,
        deadline_ms: None,
    };
    store.start_runs(&[legacy("legacy", 1), legacy("order_saga", 7)], 1_000).unwrap();
    drop(store);
    let out = w.wf("unclaimable", &[]);
    let found: Vec<(String, u64)> = out["unclaimable"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| (u["workflow"].as_str().unwrap().to_string(), u["version"].as_u64().unwrap()))
        .collect();
    assert_eq!(found, [("legacy".to_string(), 1), ("order_saga".to_string(), 7)]);
    let report = w.worker(&[]);
    assert_eq!((report["claimed"].as_u64(), report["unclaimable"].as_array().map(Vec::len)), (Some(0), Some(2)));
    assert_eq!(w.status("legacy-1"), "pending");
}

#[test]
fn purge_deletes_finished_runs_in_batches() {
    on_both_backends(purge_deletes_finished_runs_in_batches_on);
}

fn purge_deletes_finished_runs_in_batches_on() {
    let w = Wf::new();
    let ids = ["p1", "p2", "p3"];
    for id in ids {
        w.start("order_saga", id, &order(id, 1, json!({})));
    }
    w.start("sleepy_order", "active", &order("active", 1, json!({"approval": "approve"})));
    w.drive(&ids, &[]);
    let kept = w.wf("purge", &[]);
    assert_eq!(kept["runs_deleted"], 0, "runs finished just now are within the 7-day retention: {kept}");
    let later = (now_ms() + 8 * 86_400_000).to_string();
    let out = ok(&["--now-ms", &later, "workflow", "purge", "--db", w.d(), "--batch-rows", "2"]);
    assert_eq!((out["runs_deleted"].as_u64(), out["batches"].as_u64()), (Some(3), Some(2)), "{out}");
    let left: Vec<Value> = w.wf("list", &[])["runs"].as_array().unwrap().clone();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0]["run_id"], "active", "an active run is never purged");
}

#[cfg(unix)]
#[test]
fn sigterm_stops_a_worker_gracefully_and_releases_its_leases() {
    on_both_backends(sigterm_stops_a_worker_gracefully_and_releases_its_leases_on);
}

fn sigterm_stops_a_worker_gracefully_and_releases_its_leases_on() {
    let w = Wf::new();
    // Long enough for the worker to be stopped inside the step even on a loaded machine.
    w.start("sleepy_order", "h1", &order("h1", 1, json!({"hold_until_ms": now_ms() + 4_000})));
    let mut args = w.worker_cmd(&["--worker-id", "forever"]);
    args.retain(|a| a != "--until-idle");
    let mut child = std::process::Command::new(support::BIN)
        .args(&args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn the worker");
    w.wait_journaled("h1", 1, &mut child);
    let status = std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill");
    assert!(status.success());
    let output = child.wait_with_output().expect("worker output");
    assert_eq!(output.status.code(), Some(0), "{}", String::from_utf8_lossy(&output.stderr));
    let report: Value = serde_json::from_slice(&output.stdout).expect("one JSON document");
    assert_eq!((report["stopped_by"].as_str(), report["released"].as_u64()), (Some("signal"), Some(1)), "{report}");
    let run = w.show("h1")["run"].clone();
    assert_eq!((run["lease_owner"].clone(), run["status"].as_str()), (Value::Null, Some("running")), "{run}");
    // Released, not expired: the next worker takes it at once (no recovery). It holds the run
    // through the rest of the `hold` step, so it gets a lease a stalled machine cannot outlast
    // (with the suite's 200 ms lease a scheduling stall made it lose and re-take its own run).
    let mut args = w.worker_cmd(&["--until-idle", "--worker-id", "test-worker"]);
    let lease = args.iter().position(|a| a == "--lease-ms").expect("worker_cmd sets a lease") + 1;
    args[lease] = "10000".to_string();
    let report = ok(&refs(&args));
    assert_eq!((report["recovered"].as_u64(), report["completed"].as_u64()), (Some(0), Some(1)), "{report}");
    assert_eq!(w.show("h1")["run"]["recoveries"], 0);
    w.assert_consistent();
}

/// `worker --until-idle` stops gracefully on SIGTERM too (it used to have no signal handler: a
/// signal killed it and its leases had to expire).
#[test]
fn sigterm_stops_an_until_idle_worker_gracefully() {
    let w = Wf::new();
    w.start("sleepy_order", "h2", &order("h2", 1, json!({"hold_until_ms": now_ms() + 4_000})));
    let args = w.worker_cmd(&["--until-idle", "--worker-id", "until-idle"]);
    let mut child = std::process::Command::new(support::BIN)
        .args(&args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn the worker");
    w.wait_journaled("h2", 1, &mut child);
    let status = std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill");
    assert!(status.success());
    let output = child.wait_with_output().expect("worker output");
    assert_eq!(output.status.code(), Some(0), "{}", String::from_utf8_lossy(&output.stderr));
    let report: Value = serde_json::from_slice(&output.stdout).expect("one JSON document");
    assert_eq!((report["stopped_by"].as_str(), report["released"].as_u64()), (Some("signal"), Some(1)), "{report}");
    let run = w.show("h2")["run"].clone();
    assert_eq!((run["lease_owner"].clone(), run["status"].as_str()), (Value::Null, Some("running")), "{run}");
}

#[test]
fn max_seconds_bounds_a_worker() {
    let w = Wf::new();
    w.start("order_saga", "m1", &order("m1", 1, json!({})));
    let mut args = w.worker_cmd(&["--max-seconds", "1"]);
    args.retain(|a| a != "--until-idle");
    let out = ok(&refs(&args));
    assert_eq!((out["stopped_by"].as_str(), out["completed"].as_u64()), (Some("max_seconds"), Some(1)), "{out}");
    assert_eq!(out["left"]["active"], json!({}));
}

#[test]
fn the_demo_runs_the_sagas_and_resumes_a_killed_worker() {
    let out = ok(&["demo", "--json"]);
    let runs = out["workflows"]["runs"].as_array().expect("workflow runs");
    let statuses: Vec<&str> = runs.iter().map(|r| r["status"].as_str().unwrap()).collect();
    assert_eq!(statuses, ["completed", "compensated", "compensated", "completed"], "{out}");
    let no_carrier: Vec<&str> = runs[2]["journal"].as_array().unwrap().iter().map(|j| j.as_str().unwrap()).collect();
    assert!(
        no_carrier[3].contains("compensate:charge_payment") && no_carrier[4].contains("compensate:reserve_inventory")
    );
    let resumed = &runs[3]["resumed"];
    // (Whether the kill came while the step held the lease depends on the machine's speed; the
    // dedicated test in crash.rs makes sure of it.)
    assert_eq!(resumed["reserve_effects"].as_u64(), Some(1), "{resumed}");
    assert_eq!(resumed["reserve_inventory_executed_once"], true);
    // The outbox/inbox part is still there.
    assert!(out["steps"].as_array().unwrap().len() >= 10);
}

/// The line of `narration` that starts with `prefix` (after its indentation).
fn narrated<'a>(narration: &'a str, prefix: &str) -> &'a str {
    narration
        .lines()
        .find(|l| l.trim_start().starts_with(prefix))
        .unwrap_or_else(|| panic!("no line starts with {prefix:?}:\n{narration}"))
}

#[test]
fn the_demo_narrates_the_facts_of_its_own_run() {
    let dir = tempfile::tempdir().unwrap();
    let kept = dir.path().join("demo");
    let r = run(&["demo", "--dir", path_str(&kept)]);
    r.assert_exit(0);
    let text = r.stdout.as_str();
    assert_eq!(r.json, Value::Null, "the narration is not JSON:\n{text}");
    for line in text.lines().filter(|l| !l.starts_with("The files are kept in")) {
        assert!(line.chars().count() <= 100, "a line wider than 100 columns: {line:?}");
    }
    assert!(text.contains(&format!("The files are kept in {}.", kept.display())), "{text}");

    // The outbox and inbox steps name the outcomes the JSON form reports for the same steps.
    let record = ok(&["demo", "--json"]);
    let words: Vec<&str> = record["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["result"]["outcome"].as_str().or(s["result"][0]["outcome"].as_str()).unwrap_or("-"))
        .collect();
    let prefixes = [
        "advance order-1 to reserved:",
        "advance order-1 to confirmed:",
        "advance order-1 from seq 1 again:",
        "advance order-2 from new to confirmed:",
        "advance order-2 to reserved, schema v2:",
        "relay to audit and search:",
        "drain audit, v1 decoders only:",
        "drain audit with the v2 decoders too:",
        "drain search:",
        "redeliver order-1 seq 1 to audit:",
        "the same event id with another amount:",
    ];
    assert_eq!(words.len(), prefixes.len(), "{record}");
    for (prefix, word) in prefixes.iter().zip(&words) {
        let line = narrated(text, prefix);
        // The relay's JSON has counts, not a word; the drains' words are their stop reasons.
        match *word {
            "-" | "idle" => {}
            "blocked" => assert!(line.contains("order-2 blocked"), "{line}"),
            word => assert!(line.contains(&format!(": {word}")), "{line} does not say {word}"),
        }
    }

    // The numbers and statuses are those of this run, as its files (kept by --dir) hold them.
    let snapshot = ok(&[
        "snapshot",
        "--producer",
        path_str(&kept.join("producer.db")),
        "--consumer-db",
        path_str(&kept.join("consumer.db")),
    ]);
    let flows = snapshot["producer"]["flows"].as_array().unwrap();
    let last_seq = |flow: &str| flows.iter().find(|f| f["flow_id"] == flow).unwrap()["last_seq"].as_i64().unwrap();
    assert!(narrated(text, "advance order-1 to confirmed:").contains(&format!("(seq {})", last_seq("order-1"))));
    assert!(narrated(text, "advance order-2 to reserved").contains(&format!("(seq {})", last_seq("order-2"))));
    let effects = snapshot["consumer"]["reservation_effects"].as_array().unwrap().len();
    assert!(narrated(text, "effects:").starts_with(&format!("  effects: {effects} rows for {effects} applies")));

    let db = kept.join("workflows.db");
    let show = |run_id: &str| ok(&["workflow", "show", "--db", path_str(&db), "--run-id", run_id]);
    for run_id in ["order-ok", "order-declined", "order-no-carrier"] {
        let status = show(run_id)["run"]["status"].as_str().unwrap().to_string();
        assert!(narrated(text, &format!("{run_id}:")).starts_with(&format!("  {run_id}: {status}")), "{text}");
    }
    let killed = show("order-killed");
    let (status, recoveries) =
        (killed["run"]["status"].as_str().unwrap(), killed["run"]["recoveries"].as_u64().unwrap());
    let recoveries = format!("{recoveries} {}", if recoveries == 1 { "recovery" } else { "recoveries" });
    assert!(narrated(text, "worker process 2").contains(&format!(": {status} ({recoveries})")), "{text}\n{killed}");
    let calls = ok(&["workflow", "payments", "--db", path_str(&db)]);
    let ok_calls: Vec<&Value> =
        calls["calls"].as_array().unwrap().iter().filter(|c| c["order_id"] == "order-ok").collect();
    let keys: BTreeSet<&str> = ok_calls.iter().map(|c| c["idempotency_key"].as_str().unwrap()).collect();
    let said = format!(
        "; {} payment calls, {} idempotency key{}",
        ok_calls.len(),
        keys.len(),
        if keys.len() == 1 { "" } else { "s" }
    );
    assert!(narrated(text, "order-ok:").contains(&said), "{text}\n{calls}");
    let orders = ok(&["workflow", "orders", "--db", path_str(&db)]);
    let stock = &orders["stock"].as_array().unwrap().iter().find(|s| s["sku"] == "widget").unwrap()["stock"];
    assert!(narrated(text, "widget stock:").starts_with(&format!("  widget stock: {stock} of 10 left")), "{text}");

    // And the narration ends with where to go next.
    assert!(text.trim_end().ends_with("docs/protocol.md") && text.contains("docs/library.md"), "{text}");
    assert!(text.contains("cargo run --release -- demo --json") && text.contains("cargo test --workspace"));
}

/// `support::run_with` with the crash point cleared, for callers that pass an environment.
pub(crate) fn run_env(args: &[String], env: &[(&str, &str)]) -> support::Run {
    run_with(&refs(args), env, None)
}

/// `tidemark schedule`: bad schedules exit 2 with their code and write nothing; a long-running
/// `tidemark worker` ticks the database's schedules and runs what they start.
#[test]
fn schedules_are_validated_and_a_running_worker_ticks_them() {
    on_both_backends(schedules_are_validated_and_a_running_worker_ticks_them_on);
}

fn schedules_are_validated_and_a_running_worker_ticks_them_on() {
    let w = Wf::new();
    let sched = |args: &[&str]| -> Vec<String> {
        let mut all = strings(&["schedule"]);
        all.extend(strings(args));
        all.extend(strings(&["--db", w.d()]));
        all
    };
    let input = order("tick", 1, json!({}));
    for (args, code) in [
        (
            vec!["put", "--schedule-id", "s", "--workflow", "order_saga", "--cron", "61 * * * *", "--input", &input],
            "invalid_schedule",
        ),
        (
            vec!["put", "--schedule-id", "s", "--workflow", "order_saga", "--interval-ms", "10", "--input", &input],
            "invalid_schedule",
        ),
        (
            vec![
                "put",
                "--schedule-id",
                "s",
                "--workflow",
                "order_saga",
                "--interval-ms",
                "1000",
                "--timezone",
                "Nowhere/Land",
                "--input",
                &input,
            ],
            "invalid_schedule",
        ),
        (
            vec![
                "put",
                "--schedule-id",
                "s",
                "--workflow",
                "order_saga",
                "--interval-ms",
                "1000",
                "--catch-up",
                "some",
                "--input",
                &input,
            ],
            "invalid_schedule",
        ),
        (
            vec!["put", "--schedule-id", "s", "--workflow", "nope", "--interval-ms", "1000", "--input", &input],
            "unknown_workflow",
        ),
        (
            vec!["put", "--schedule-id", "s", "--workflow", "order_saga", "--interval-ms", "1000", "--input", "{}"],
            "invalid_input",
        ),
        (
            vec![
                "put",
                "--schedule-id",
                "bad id",
                "--workflow",
                "order_saga",
                "--interval-ms",
                "1000",
                "--input",
                &input,
            ],
            "invalid_id",
        ),
        (vec!["show", "--schedule-id", "s"], "not_found"),
        (vec!["delete", "--schedule-id", "s"], "not_found"),
    ] {
        refused(&sched(&args), code);
    }
    assert_eq!(ok(&refs(&sched(&["list"])))["schedules"], json!([]), "nothing was written");

    // Created ten seconds in the past: its ticks are due at once (none over 60 s late).
    let past = (now_ms() - 10_000).to_string();
    let mut put = strings(&["--now-ms", &past]);
    put.extend(sched(&[
        "put",
        "--schedule-id",
        "tick",
        "--workflow",
        "order_saga",
        "--interval-ms",
        "5000",
        "--input",
        &input,
    ]));
    ok(&refs(&put));
    let out = ok(&refs(&w.worker_cmd(&["--max-seconds", "3", "--worker-id", "ticker"])));
    assert!(out["schedules"]["runs_started"].as_u64().unwrap() >= 1, "{out}");
    assert_eq!(out["schedules"]["tick_errors"], 0, "{out}");
    let runs = w.wf("list", &[])["runs"].as_array().unwrap().clone();
    assert!(!runs.is_empty() && runs.iter().all(|r| r["run_id"].as_str().unwrap().starts_with("tick:")), "{runs:?}");
    let shown = ok(&refs(&sched(&["show", "--schedule-id", "tick"])));
    assert_eq!(shown["schedule"]["ticks_started"].as_u64(), Some(runs.len() as u64), "{shown}");
    assert_eq!(ok(&refs(&sched(&["delete", "--schedule-id", "tick"])))["outcome"], "deleted");
}

impl Drop for Wf {
    fn drop(&mut self) {
        if let Some((base, schema)) = &self.schema {
            if let Ok(mut client) = postgres::Client::connect(base, postgres::NoTls) {
                let _ = client.batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
            }
        }
    }
}
