//! Every example is built by `cargo test` (examples are test targets' siblings) and run here as
//! a real process on a fresh data folder: a broken example fails CI. Each runs its own story
//! over real HTTP (or in process) and exits non-zero when an outcome is not what it expects; its
//! last stdout line is a JSON summary checked here too. The two services of
//! `examples/two-services` run as two processes that this test drives over HTTP.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};

/// `target/<profile>/examples/<name>`, beside this test's own `deps/` folder.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let profile = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>/deps/<test>");
    profile.join("examples").join(name)
}

fn run(name: &str) -> Value {
    let path = example(name);
    assert!(path.exists(), "{} is not built: cargo test builds every example of this package", path.display());
    let dir = tempfile::tempdir().expect("a temporary folder");
    let output = Command::new(&path)
        .arg("--data")
        .arg(dir.path().join("data"))
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", path.display()));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "example {name} failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let last = stdout.lines().last().unwrap_or_default();
    let summary: Value =
        serde_json::from_str(last).unwrap_or_else(|e| panic!("{name}'s last line is not JSON ({e}): {last}"));
    assert_eq!(summary["outcome"], "ok", "{summary}");
    summary["summary"].clone()
}

#[test]
fn the_payments_service_commits_rows_and_events_together_and_settles_once() {
    let summary = run("payments");
    assert_eq!(summary["authorize_again"]["code"], "stale", "{summary}");
    assert_eq!(summary["payments_rows"], 1, "the refused retry wrote no row: {summary}");
    assert_eq!(summary["ledger"].as_array().map(Vec::len), Some(2), "one debit and one credit: {summary}");
    assert_eq!(summary["run"], "completed", "{summary}");
}

#[test]
fn the_saga_function_completes_one_trip_and_compensates_the_other() {
    let summary = run("saga_fn");
    assert_eq!((summary["trip-1"].as_str(), summary["trip-2"].as_str()), (Some("completed"), Some("compensated")));
}

#[test]
fn the_axum_app_serves_its_routes_and_tidemarks_side_by_side() {
    let summary = run("axum_mount");
    assert_eq!(summary["archived"], serde_json::json!(["first", "second"]), "{summary}");
}

// ---------------------------------------------------------------------------------------------
// examples/two-services: two processes, each its own data folder, on loopback.
// ---------------------------------------------------------------------------------------------

/// How long a step of the two-services story may take before the test gives up (a hang guard,
/// not a measurement: each step takes well under a second here).
const TWO_SERVICES_WAIT: Duration = Duration::from_secs(60);

/// One of the two services, a child process killed when this is dropped.
struct ServiceProcess {
    child: std::process::Child,
    /// Where it listens (`127.0.0.1:port`), from its first stdout line.
    base: String,
    stderr: PathBuf,
}

impl ServiceProcess {
    fn start(name: &str, args: &[String], logs: &std::path::Path) -> ServiceProcess {
        Self::try_start(name, args, logs).unwrap_or_else(|failure| panic!("{failure}"))
    }

    /// Starts the example `name`; `Err` says why it did not come to listen (with its log).
    fn try_start(name: &str, args: &[String], logs: &std::path::Path) -> Result<ServiceProcess, String> {
        let path = example(name);
        assert!(path.exists(), "{} is not built: cargo test builds every example of this package", path.display());
        let stderr = logs.join(format!("{name}.stderr"));
        let mut child = Command::new(&path)
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::fs::File::create(&stderr).expect("a log file"))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", path.display()));
        let stdout = child.stdout.take().expect("piped stdout");
        let (sender, receiver) = std::sync::mpsc::channel();
        // The first line says where it listens; the reader keeps the pipe open until the child ends.
        std::thread::spawn(move || {
            use std::io::BufRead;
            let mut lines = std::io::BufReader::new(stdout).lines();
            let _ = sender.send(lines.next().and_then(Result::ok).unwrap_or_default());
            for _ in lines {}
        });
        let line = receiver.recv_timeout(TWO_SERVICES_WAIT).unwrap_or_default();
        let mut process = ServiceProcess { child, base: String::new(), stderr };
        let listening: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
        if listening["outcome"] != "listening" {
            return Err(format!("{name} did not start: {line:?}\n{}", process.log()));
        }
        process.base = format!("http://{}", listening["addr"].as_str().expect("addr"));
        Ok(process)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    fn get(&self, path: &str) -> Value {
        let response =
            reqwest::blocking::get(format!("{}{path}", self.base)).unwrap_or_else(|e| panic!("GET {path}: {e}"));
        assert!(response.status().is_success(), "GET {path}: {}\n{}", response.status(), self.log());
        response.json().expect("a JSON answer")
    }

    fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let response = reqwest::blocking::Client::new()
            .post(format!("{}{path}", self.base))
            .json(&body)
            .send()
            .unwrap_or_else(|e| panic!("POST {path}: {e}"));
        (response.status().as_u16(), response.json().unwrap_or(Value::Null))
    }

    /// Poll `f` every 20 ms until it answers (at most [`TWO_SERVICES_WAIT`]).
    fn wait_for<T>(&self, what: &str, mut f: impl FnMut(&ServiceProcess) -> Option<T>) -> T {
        let started = std::time::Instant::now();
        loop {
            if let Some(done) = f(self) {
                return done;
            }
            assert!(started.elapsed() < TWO_SERVICES_WAIT, "{what}: not within {TWO_SERVICES_WAIT:?}\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The sum of `tidemark_endpoint_deliveries_total` with this outcome, over every endpoint.
    fn endpoint_deliveries(&self, outcome: &str) -> f64 {
        let text = reqwest::blocking::get(format!("{}/metrics", self.base)).and_then(|r| r.text()).expect("/metrics");
        text.lines()
            .filter(|l| {
                l.starts_with("tidemark_endpoint_deliveries_total{") && l.contains(&format!("outcome=\"{outcome}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

/// Prints both services' logs when the test fails (before they are killed and their folder goes).
struct LogsOnPanic<'a>([&'a ServiceProcess; 2]);

impl Drop for LogsOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for process in self.0 {
                eprintln!("--- {} ---\n{}", process.stderr.display(), process.log());
            }
        }
    }
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A free port on loopback (orders must be told shipping's address and shipping orders', so
/// orders' port is chosen before either starts).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port()
}

/// How many times the pair is started afresh when orders' port, free when chosen, was taken by
/// another socket of a test running beside this one before orders bound it.
const PORT_TRIES: usize = 5;

/// Place two orders with `orders`; each saga's command reaches `shipping` over HTTP and its
/// reply comes back (over HTTP, or through the JetStream stream `replies` = (subject prefix
/// URL, stream)); then every command and reply is handed over again, and nothing happens twice.
fn two_services_story(replies: Option<(String, String)>) {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let strings = |args: &[&str]| args.iter().map(|a| a.to_string()).collect::<Vec<_>>();
    let start_pair = |attempt: usize| {
        // Each attempt has its own data folders: a pair that did not come up leaves nothing behind.
        let data = |name: &str| dir.path().join(format!("{name}-{attempt}")).display().to_string();
        let orders_listen = format!("127.0.0.1:{}", free_port());
        let mut args = strings(&["--data", &data("shipping"), "--listen", "127.0.0.1:0"]);
        args.extend(strings(&["--orders", &format!("http://{orders_listen}")]));
        if let Some((from, _)) = &replies {
            args.extend(strings(&["--replies-to", from]));
        }
        let shipping = ServiceProcess::start("two-services-shipping", &args, dir.path());
        let mut args = strings(&["--data", &data("orders"), "--listen", &orders_listen, "--shipping", &shipping.base]);
        if let Some((from, stream)) = &replies {
            args.extend(strings(&["--replies-from", from, "--replies-stream", stream]));
        }
        ServiceProcess::try_start("two-services-orders", &args, dir.path()).map(|orders| (shipping, orders))
    };
    let mut failures = Vec::new();
    let (shipping, orders) = loop {
        match start_pair(failures.len()) {
            Ok(pair) => break pair,
            Err(failure) if failure.contains("AddrInUse") && failures.len() + 1 < PORT_TRIES => failures.push(failure),
            Err(failure) => panic!("{failure}\n(earlier tries: {failures:?})"),
        }
    };
    let _logs = LogsOnPanic([&shipping, &orders]);

    let placed = [("order-1", "widget", 2), ("order-2", "gadget", 1)];
    for (order_id, sku, quantity) in placed {
        let input = json!({"order_id": order_id, "sku": sku, "quantity": quantity});
        let (status, body) =
            orders.post("/v1/runs", json!({"workflow": "place_order", "run_id": order_id, "input": input}));
        assert_eq!(status, 201, "{body}");
    }
    // Each saga completes with the tracking number shipping gave its order.
    let runs: Vec<Value> = placed
        .iter()
        .map(|(order_id, _, _)| {
            orders.wait_for(&format!("{order_id} completes"), |o| {
                let run = o.get(&format!("/v1/runs/{order_id}"));
                assert!(
                    !["failed", "compensated", "cancelled"].contains(&run["run"]["status"].as_str().unwrap_or("")),
                    "{run:#}"
                );
                (run["run"]["status"] == "completed").then_some(run)
            })
        })
        .collect();
    let shipments = shipping.get("/shipments")["shipments"].as_array().cloned().expect("shipments");
    assert_eq!(shipments.len(), 2, "{shipments:?}");
    for ((order_id, sku, quantity), run) in placed.iter().zip(&runs) {
        let shipment = shipments.iter().find(|s| s["order_id"] == *order_id).expect("its shipment");
        assert_eq!((shipment["sku"].as_str(), shipment["quantity"].as_i64()), (Some(*sku), Some(*quantity)));
        assert_eq!(run["run"]["result"]["tracking"], shipment["tracking"], "{run:#}");
    }

    // Every command and every reply handed over again (an operator's redeliver): each inbox
    // answers `duplicate` and nothing is applied twice.
    let redelivered = |service: &ServiceProcess, subscriber: &str| {
        let (status, body) = service.post(&format!("/v1/outbox/redeliver/{subscriber}"), json!({"all": true}));
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["redelivered"], 2, "{body}");
    };
    redelivered(&orders, "shipping");
    redelivered(&shipping, "orders");
    for service in [&orders, &shipping] {
        service.wait_for("the redeliveries are answered", |s| {
            let page = s.get("/v1/outbox?status=pending");
            page["deliveries"].as_array().is_some_and(Vec::is_empty).then_some(())
        });
        assert!(service.endpoint_deliveries("duplicate") >= 2.0, "the second hand-over was a duplicate");
    }
    let shipments_after = shipping.get("/shipments")["shipments"].as_array().cloned().expect("shipments");
    assert_eq!(shipments_after, shipments, "no second shipment");
    for (order_id, _, _) in placed {
        let run = orders.get(&format!("/v1/runs/{order_id}"));
        let replies: Vec<&Value> =
            run["events"].as_array().expect("events").iter().filter(|e| e["name"] == "shipment.scheduled").collect();
        assert_eq!(replies.len(), 1, "the reply reached the run once: {run:#}");
    }
    let applied = |service: &ServiceProcess, consumer: &str| {
        service.get(&format!("/v1/consumers/{consumer}/inbox?status=applied"))["records"].as_array().map(Vec::len)
    };
    assert_eq!(applied(&shipping, "orders"), Some(2), "each command applied once");
    assert_eq!(applied(&orders, "shipping"), Some(2), "each reply applied once");
}

#[test]
fn two_services_exchange_a_command_and_its_reply_over_http_exactly_once() {
    two_services_story(None);
}

/// The JetStream stream of a test, deleted when it ends (passed or not).
struct Stream {
    name: String,
}

impl Drop for Stream {
    fn drop(&mut self) {
        let name = self.name.clone();
        let _ = with_nats(async move |js| js.delete_stream(&name).await.map(drop).map_err(|e| e.to_string()));
    }
}

/// The machine's NATS server (JetStream on).
const NATS: &str = "127.0.0.1:4222";

/// Run `f` with a JetStream context of NATS at [`NATS`], on a runtime of its own; `Err` when
/// NATS does not answer.
fn with_nats<T>(f: impl AsyncFnOnce(async_nats::jetstream::Context) -> Result<T, String>) -> Result<T, String> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    runtime.block_on(async {
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(2))
            .connect(NATS)
            .await
            .map_err(|e| e.to_string())?;
        f(async_nats::jetstream::new(client)).await
    })
}

#[test]
fn two_services_exchange_a_command_over_http_and_its_reply_through_nats_exactly_once() {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("a clock").as_nanos();
    let prefix = format!("tmkexample{}x{nanos}", std::process::id());
    let stream = Stream { name: prefix.to_uppercase() };
    let (name, subjects) = (stream.name.clone(), vec![format!("{prefix}.>")]);
    let created = with_nats(async move |js| {
        let config = async_nats::jetstream::stream::Config { name, subjects, ..Default::default() };
        js.create_stream(config).await.map(drop).map_err(|e| e.to_string())
    });
    if let Err(e) = created {
        println!("skipped: NATS (JetStream) not reachable at {NATS}: {e}");
        std::mem::forget(stream);
        return;
    }
    two_services_story(Some((format!("nats://{NATS}/{prefix}"), stream.name.clone())));
}
