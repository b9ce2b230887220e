//! Two `tidemark serve` processes on loopback: the `orders` service's outbox delivers to the
//! `shipping` service's inbox over HTTP (`PUT /v1/subscriptions/{id}` with an
//! `http://.../v1/consumers/{id}/inbox` endpoint). The receiving server killed with SIGKILL
//! mid-stream and restarted; an endpoint that never answers beside a healthy one; the network
//! between them cut, black-holed, flapping and losing the receiver's answers after its commit (an
//! in-test TCP proxy); bad endpoints and a missing token. The receiver's SIGKILL and the network
//! faults run with both services on SQLite files and again with both on PostgreSQL.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use crate::server_support::{served_on_both_backends, token, Server};

const FLOWS: usize = 20;
/// A relay batch much smaller than what the stream writers append per round (`FLOWS` events),
/// so that a lane nearly always reads its next batch while one is in flight: the partition tests
/// prove order and custody through failures with read-ahead at work.
const PIPELINED_BATCH: usize = 6;
const WAIT: Duration = Duration::from_secs(90);

/// `shipping`: a server with consumer `ledger` (handler `record`, not subscribed to its own
/// outboxes) and an `operate` token for the relay that delivers to it.
fn shipping(data: &Path, listen: &str) -> (Server, String) {
    let admin = token(data, "shipping", "admin");
    let operate = token(data, "shipping", "operate");
    let server = Server::start_at(data, listen, &[], &[]);
    let (status, body) = server.call(
        "PUT",
        "/v1/consumers/ledger",
        Some(&admin),
        Some(&json!({"handler": "record", "subscribe": false})),
    );
    assert!(status == 201 || status == 200, "{status} {body}");
    (server, operate)
}

/// `orders`: a server whose configuration holds the token for `shipping`'s origin (read from the
/// environment, as `env:SHIPPING_TOKEN`) and the `extra_tokens` given literally, with
/// `timeout_ms` per delivery attempt.
fn orders(
    data: &Path,
    shipping_origin: &str,
    shipping_token: &str,
    extra_tokens: &[(&str, &str)],
    timeout_ms: u64,
) -> (Server, String) {
    let admin = token(data, "orders", "admin");
    let config = data.join("orders.toml");
    let mut text = format!(
        "[relay]\nattempt_timeout_ms = {timeout_ms}\nbackoff_base_ms = 50\nbackoff_max_ms = 500\n\
         max_attempts = 1000\n[relay.tokens]\n\"{shipping_origin}\" = \"env:SHIPPING_TOKEN\"\n"
    );
    for (origin, token) in extra_tokens {
        text.push_str(&format!("\"{origin}\" = \"{token}\"\n"));
    }
    std::fs::write(&config, text).unwrap();
    let server = Server::start(data, &["--config", config.to_str().unwrap()], &[("SHIPPING_TOKEN", shipping_token)]);
    (server, admin)
}

fn append(server: &Server, token: &str, flow: &str, n: usize) {
    for i in 0..n {
        let (status, body) = server.call(
            "POST",
            &format!("/v1/streams/{flow}/events"),
            Some(token),
            Some(&json!({"event_type": "parcel.noted", "payload": {"i": i}})),
        );
        assert_eq!(status, 200, "{body}");
    }
}

/// `ledger`'s applied records on `shipping`, as (flow, seq) -> count; None while any other
/// record is pending.
fn applied(server: &Server, token: &str) -> BTreeMap<(String, i64), usize> {
    let (status, page) = server.call("GET", "/v1/consumers/ledger/inbox?limit=1000", Some(token), None);
    assert_eq!(status, 200, "{page}");
    let mut seen = BTreeMap::new();
    for record in page["records"].as_array().unwrap() {
        if record["status"] == "applied" {
            let envelope = &record["envelope"];
            let key = (envelope["flow_id"].as_str().unwrap().to_string(), envelope["seq"].as_i64().unwrap());
            *seen.entry(key).or_insert(0) += 1;
        }
    }
    seen
}

fn subscribe(server: &Server, token: &str, consumer: &str, endpoint: &str) -> (u16, Value) {
    server.call("PUT", &format!("/v1/subscriptions/{consumer}"), Some(token), Some(&json!({"endpoint": endpoint})))
}

fn lane<'a>(page: &'a Value, consumer: &str) -> Option<&'a Value> {
    page["subscriptions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["consumer_id"] == consumer && s["outbox"] == "producer")
        .map(|s| &s["lane"])
}

#[test]
fn events_cross_to_another_server_over_http_exactly_once_across_a_sigkill_of_the_receiver() {
    served_on_both_backends(|| {
        let dir = tempfile::tempdir().unwrap();
        let (ship_dir, orders_dir) = (dir.path().join("shipping"), dir.path().join("orders"));
        let (mut ship, ship_token) = shipping(&ship_dir, "127.0.0.1:0");
        let listen = ship.base.trim_start_matches("http://").to_string();
        let (orders, orders_token) = orders(&orders_dir, &ship.base, &ship_token, &[], 10_000);
        let endpoint = format!("{}/v1/consumers/ledger/inbox", ship.base);
        let (status, body) = subscribe(&orders, &orders_token, "ledger", &endpoint);
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["kind"], "http");

        // Round 1: every event arrives and is applied once.
        for f in 0..FLOWS {
            append(&orders, &orders_token, &format!("parcel-{f}"), 3);
        }
        let seen = ship.wait_for(WAIT, |s| {
            let seen = applied(s, &ship_token);
            (seen.len() == FLOWS * 3).then_some(seen)
        });
        assert!(seen.values().all(|&n| n == 1), "{seen:?}");

        // Round 2: the receiver is killed with SIGKILL while events are on their way, then
        // restarted where the sender expects it. Every event arrives once, in order per flow.
        let writer = stream_writer(&orders, &orders_token, 10, Duration::ZERO);
        ship.wait_for(WAIT, |s| (applied(s, &ship_token).len() > FLOWS * 3 + 10).then_some(()));
        ship.kill9();
        // While it is down, the lane reports what failed.
        let down = orders.wait_for(WAIT, |o| {
            let (_, page) = o.call("GET", "/v1/subscriptions", Some(&orders_token), None);
            lane(&page, "ledger").and_then(|l| l["last_error"].as_str().map(str::to_string))
        });
        assert!(down.contains("ledger/inbox/batch"), "{down}");
        writer.join().unwrap();
        let ship = Server::start_at(&ship_dir, &listen, &[], &[]);
        let total = FLOWS * 13;
        let seen = ship.wait_for(WAIT, |s| {
            let seen = applied(s, &ship_token);
            (seen.len() == total).then_some(seen)
        });
        assert!(seen.values().all(|&n| n == 1), "an event applied twice: {seen:?}");
        for f in 0..FLOWS {
            let seqs: BTreeSet<i64> =
                seen.keys().filter(|(flow, _)| flow == &format!("parcel-{f}")).map(|(_, seq)| *seq).collect();
            assert_eq!(seqs, (1..=13).collect(), "parcel-{f}");
        }
        // Each flow's high-water mark on the receiver is its last seq: applied in order, no gap.
        let (_, cursors) = ship.call("GET", "/v1/consumers/ledger/cursors", Some(&ship_token), None);
        let cursors = cursors["cursors"].as_array().unwrap();
        assert_eq!(cursors.len(), FLOWS, "{cursors:?}");
        assert!(cursors.iter().all(|c| c["high_water_seq"] == 13), "{cursors:?}");
        // The sender has nothing left to deliver, nothing quarantined.
        orders.wait_for(WAIT, |o| {
            let (_, page) = o.call("GET", "/v1/outbox?status=pending&limit=10", Some(&orders_token), None);
            page["deliveries"].as_array().is_some_and(|d| d.is_empty()).then_some(())
        });
        let (_, quarantined) = orders.call("GET", "/v1/outbox?status=quarantined&limit=10", Some(&orders_token), None);
        assert_eq!(quarantined["deliveries"].as_array().map(Vec::len), Some(0), "{quarantined}");
    });
}

/// A W3C trace context given with an advance travels with its event to another server's inbox
/// (its record shows it; the handler gets it in the envelope); a malformed one is ignored, as
/// W3C Trace Context says, and an event without one carries none.
#[test]
fn a_trace_context_travels_with_its_event_to_another_server_and_a_malformed_one_is_ignored() {
    served_on_both_backends(|| {
        const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let dir = tempfile::tempdir().unwrap();
        let (ship, ship_token) = shipping(&dir.path().join("shipping"), "127.0.0.1:0");
        let (orders, orders_token) = orders(&dir.path().join("orders"), &ship.base, &ship_token, &[], 10_000);
        let (status, body) =
            subscribe(&orders, &orders_token, "ledger", &format!("{}/v1/consumers/ledger/inbox", ship.base));
        assert_eq!(status, 200, "{body}");
        let traces = [Some(TRACEPARENT), None, Some("00-not-a-trace-context-01")];
        for (i, traceparent) in traces.iter().enumerate() {
            let mut request = orders
                .client
                .post(format!("{}/v1/streams/traced/events", orders.base))
                .bearer_auth(&orders_token)
                .json(&json!({"event_type": "parcel.noted", "payload": {"i": i}}));
            if let Some(value) = traceparent {
                request = request.header("traceparent", *value);
            }
            let response = request.send().unwrap();
            assert_eq!(response.status().as_u16(), 200, "{:?}", response.text());
        }
        let records = ship.wait_for(WAIT, |s| {
            let (_, page) = s.call("GET", "/v1/consumers/ledger/inbox?limit=10", Some(&ship_token), None);
            let records = page["records"].as_array().cloned().unwrap_or_default();
            (records.len() == 3 && records.iter().all(|r| r["status"] == "applied")).then_some(records)
        });
        let carried: BTreeMap<i64, Value> = records
            .iter()
            .map(|r| (r["envelope"]["seq"].as_i64().unwrap(), r["envelope"]["traceparent"].clone()))
            .collect();
        assert_eq!(carried[&1], json!(TRACEPARENT), "{records:?}");
        assert_eq!(carried[&2], Value::Null, "no header, no trace context: {records:?}");
        assert_eq!(carried[&3], Value::Null, "a malformed header is ignored: {records:?}");
    });
}

#[test]
fn an_endpoint_that_never_answers_does_not_hold_up_the_others_and_bad_endpoints_are_refused() {
    served_on_both_backends(|| {
        let dir = tempfile::tempdir().unwrap();
        let (ship_dir, orders_dir) = (dir.path().join("shipping"), dir.path().join("orders"));
        let (ship, ship_token) = shipping(&ship_dir, "127.0.0.1:0");
        // A black hole: the kernel completes the handshake into the backlog, nobody ever answers.
        let hole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let hole_addr = hole.local_addr().unwrap();
        // A timeout far longer than this test's waits: if the relay waited for its slowest endpoint,
        // nothing would reach `shipping` in time.
        let hole_origin = format!("http://{hole_addr}");
        let (orders, orders_token) =
            orders(&orders_dir, &ship.base, &ship_token, &[(&hole_origin, "tmk_whatever")], 600_000);

        // Bad endpoints: typed errors, nothing subscribed.
        for bad in [
            "ftp://host/x",
            "http://user:secret@127.0.0.1:9/v1/consumers/c/inbox",
            "http://127.0.0.1:9/v1/runs",
            "/etc/passwd",
            "nats://127.0.0.1:4222/a..b",
        ] {
            let (status, body) = subscribe(&orders, &orders_token, "bad", bad);
            assert_eq!((status, body["error"]["code"].as_str()), (400, Some("invalid_endpoint")), "{bad}: {body}");
            assert!(!body.to_string().contains("secret"), "{body}");
        }
        let (_, page) = orders.call("GET", "/v1/subscriptions", Some(&orders_token), None);
        assert_eq!(page["subscriptions"].as_array().map(Vec::len), Some(0), "{page}");

        // Three subscribers: the black hole, an origin without a configured token, and `shipping`.
        for (consumer, endpoint) in [
            ("hole", format!("{hole_origin}/v1/consumers/ledger/inbox")),
            ("untokened", "http://127.0.0.1:9/v1/consumers/ledger/inbox".to_string()),
            ("ledger", format!("{}/v1/consumers/ledger/inbox", ship.base)),
        ] {
            let (status, body) = subscribe(&orders, &orders_token, consumer, &endpoint);
            assert_eq!(status, 200, "{body}");
        }
        for f in 0..FLOWS {
            append(&orders, &orders_token, &format!("parcel-{f}"), 3);
        }
        let seen = ship.wait_for(WAIT, |s| {
            let seen = applied(s, &ship_token);
            (seen.len() == FLOWS * 3).then_some(seen)
        });
        assert!(seen.values().all(|&n| n == 1), "{seen:?}");
        // The black hole's batch is still in flight (it never answers); the untokened subscriber's
        // deliveries failed with the reason, and were never accepted.
        let (_, page) = orders.call("GET", "/v1/subscriptions", Some(&orders_token), None);
        let hole_lane = lane(&page, "hole").expect("the hole's subscription");
        assert_eq!(hole_lane["in_flight"], true, "{page}");
        assert_eq!(hole_lane["delivered"], 0, "{page}");
        let reason = orders.wait_for(WAIT, |o| {
            let (_, page) = o.call("GET", "/v1/subscriptions", Some(&orders_token), None);
            lane(&page, "untokened").and_then(|l| l["last_error"].as_str().map(str::to_string))
        });
        assert!(reason.contains("no bearer token"), "{reason}");
        let (_, pending) = orders.call("GET", "/v1/outbox?status=pending&limit=1000", Some(&orders_token), None);
        let pending = pending["deliveries"].as_array().unwrap();
        let by_consumer: BTreeSet<&str> = pending.iter().map(|d| d["consumer_id"].as_str().unwrap()).collect();
        assert_eq!(by_consumer, BTreeSet::from(["hole", "untokened"]), "{pending:?}");
        assert_eq!(pending.len(), 2 * FLOWS * 3, "every event still pending for both, none for `ledger`");
        // The lag each subscription shows, over the API and on the dashboard.
        let (_, page) = orders.call("GET", "/v1/subscriptions", Some(&orders_token), None);
        let view = |consumer: &str| {
            page["subscriptions"]
                .as_array()
                .unwrap()
                .iter()
                .find(|s| s["consumer_id"] == consumer && s["outbox"] == "producer")
                .cloned()
                .unwrap()
        };
        assert_eq!(
            (view("hole")["pending"].as_u64(), view("untokened")["pending"].as_u64()),
            (Some(60), Some(60)),
            "{page}"
        );
        assert_eq!(view("ledger")["pending"], 0, "{page}");
        assert!(
            view("hole")["oldest_pending_at_ms"].is_i64() && view("ledger")["oldest_pending_at_ms"].is_null(),
            "{page}"
        );
        let cookie = crate::server_dashboard::login(&orders, &orders_token);
        let html = crate::server_dashboard::page(&orders, "/ui/subscriptions", &cookie);
        for expected in [hole_origin.as_str(), "untokened", "no bearer token", "in flight", ">http<"] {
            assert!(html.contains(expected), "{expected} missing from the page: {html}");
        }
        drop(hole);
    });
}

#[test]
fn the_cli_subscribes_network_endpoints_and_its_file_relay_leaves_them_to_the_server() {
    // A producer file, then a producer schema of the PostgreSQL test server.
    crate::workflow_cli::on_both_backends(subscribe_network_endpoints);
}

fn subscribe_network_endpoints() {
    use crate::support::{ok, run, Setup};
    let stores = Setup::new(&[]);
    let p = stores.p();
    let subscribed = ok(&[
        "subscribe",
        "--producer",
        p,
        "--consumer-id",
        "remote",
        "--endpoint",
        "http://127.0.0.1:9/v1/consumers/r/inbox",
    ]);
    assert_eq!(subscribed["subscription"]["kind"], "http", "{subscribed}");
    for bad in ["ftp://h/x", "http://u:secret@h/v1/consumers/r/inbox", "kafka://h"] {
        let r = run(&["subscribe", "--producer", p, "--consumer-id", "bad", "--endpoint", bad]);
        assert_eq!((r.code, r.json["error"]["code"].as_str()), (2, Some("invalid_endpoint")), "{bad}: {}", r.stdout);
        assert!(!r.stdout.contains("secret"), "{}", r.stdout);
    }
    // A `postgres://` consumer schema: with a password, without a user, or not a consumer's.
    if let Some((base, _)) = crate::support::postgres_server() {
        let with_password = crate::support::with_schema(&base.replacen("postgres@", "postgres:secret@", 1), "x");
        let without_user = crate::support::with_schema(&base.replacen("postgres@", "", 1), "x");
        let missing = crate::support::with_schema(&base, &format!("cli_missing_{}", std::process::id()));
        for (bad, code) in
            [(with_password, "invalid_endpoint"), (without_user, "invalid_endpoint"), (missing, "not_initialized")]
        {
            let r = run(&["subscribe", "--producer", p, "--consumer-id", "bad", "--endpoint", &bad]);
            assert_eq!((r.code, r.json["error"]["code"].as_str()), (2, Some(code)), "{bad}: {}", r.stdout);
            assert!(!r.stdout.contains("secret"), "{}", r.stdout);
        }
    }
    ok(&["advance", "--producer", p, "--flow", "r1", "--expected-seq", "0", "--to", "reserved", "--quantity", "1"]);
    let relayed = ok(&["relay", "--producer", p, "--until-idle"]);
    assert_eq!(relayed["attempted"], 0, "{relayed}");
    assert_eq!(relayed["not_relayed_here"], json!(["remote"]), "{relayed}");
    let listed = ok(&["outbox", "list", "--producer", p]);
    let deliveries = listed["deliveries"].as_array().expect("deliveries");
    assert_eq!(deliveries.len(), 1, "{listed}");
    assert_eq!((deliveries[0]["status"].as_str(), deliveries[0]["attempts"].as_i64()), (Some("pending"), Some(0)));
}

/// A NATS server of this test's own (the machine's `nats-server` binary, JetStream on, its own
/// store folder and port), so that it can be killed and restarted without touching anyone else's.
struct Nats {
    child: Option<std::process::Child>,
    port: u16,
    store: std::path::PathBuf,
}

const NATS_BIN: &str = "/usr/sbin/nats-server";

impl Nats {
    /// Start it and wait (bounded) until it is this server that answers on the port: a NATS
    /// server greets a connection with `INFO`, and the child must still run (a server that
    /// could not take the port exits, and something else may answer there). Its log goes to
    /// `nats.log` beside the store folder, printed when it does not come up.
    fn start(store: &Path, port: u16) -> Nats {
        let log_path = store.with_extension("log");
        let log = std::fs::File::create(&log_path).expect("nats-server's log file");
        let child = std::process::Command::new(NATS_BIN)
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd", store.to_str().unwrap()])
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn nats-server");
        let mut nats = Nats { child: Some(child), port, store: store.to_path_buf() };
        let started = std::time::Instant::now();
        loop {
            let exited = nats.child.as_mut().and_then(|child| child.try_wait().ok().flatten());
            let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
            assert!(exited.is_none(), "nats-server on {port} exited ({exited:?}):\n{}", log());
            if greets(port) {
                return nats;
            }
            assert!(started.elapsed() < WAIT, "nats-server did not answer on {port}:\n{}", log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill9(&mut self) {
        let mut child = self.child.take().expect("running");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    fn restart(&mut self) {
        *self = Nats::start(&self.store.clone(), self.port);
    }
}

/// Whether a NATS server answers on `port` (its `INFO` greeting, within a second).
fn greets(port: u16) -> bool {
    use std::io::Read;
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else { return false };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
    let mut greeting = [0u8; 4];
    stream.read_exact(&mut greeting).is_ok() && &greeting == b"INFO"
}

impl Drop for Nats {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The service `orders` in `dir` (an admin token of its own) whose relay gives each attempt
/// `attempt_timeout_ms`, backs off 50-500 ms and never quarantines in a test's time.
fn orders_relaying(dir: &Path, attempt_timeout_ms: u64, batch: usize) -> (Server, String) {
    let admin = token(dir, "orders", "admin");
    let config = dir.join("orders.toml");
    let relay = format!(
        "[relay]\nattempt_timeout_ms = {attempt_timeout_ms}\nbatch = {batch}\nbackoff_base_ms = 50\nbackoff_max_ms = 500\nmax_attempts = 1000\n"
    );
    std::fs::write(&config, relay).unwrap();
    (Server::start(dir, &["--config", config.to_str().unwrap()], &[]), admin)
}

/// A NATS server of the test's own in `dir` with the stream `ORDERS` (subjects `orders.>`), and
/// its port; `None`, after saying why, without the `nats-server` binary.
fn nats_with_orders_stream(dir: &Path) -> Option<(Nats, u16)> {
    if !Path::new(NATS_BIN).exists() {
        println!("skipped: {NATS_BIN} is not installed (apt-get install nats-server)");
        return None;
    }
    let port = crate::support::unused_port();
    let nats = Nats::start(&dir.join("nats"), port);
    with_jetstream(port, async |js| {
        js.create_stream(async_nats::jetstream::stream::Config {
            name: "ORDERS".into(),
            subjects: vec!["orders.>".into()],
            ..Default::default()
        })
        .await
        .expect("create the stream")
    });
    Some((nats, port))
}

/// Run `f` with a JetStream context on the test's NATS server.
fn with_jetstream<T>(port: u16, f: impl AsyncFnOnce(async_nats::jetstream::Context) -> T) -> T {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let client = async_nats::connect(format!("127.0.0.1:{port}")).await.expect("connect to NATS");
        f(async_nats::jetstream::new(client)).await
    })
}

/// Every message of the stream: its `Nats-Msg-Id`s, in stream order.
fn stored_ids(port: u16, stream: &str) -> Vec<String> {
    with_jetstream(port, async |js| {
        let mut stream = js.get_stream(stream).await.expect("the stream");
        let count = stream.info().await.unwrap().state.last_sequence;
        let mut ids = Vec::new();
        for seq in 1..=count {
            let message = stream.get_raw_message(seq).await.expect("message");
            let id = message.headers.get(async_nats::header::NATS_MESSAGE_ID).expect("Nats-Msg-Id");
            ids.push(id.as_str().to_string());
        }
        ids
    })
}

#[test]
fn events_reach_nats_jetstream_once_across_a_broker_killed_and_restarted_mid_relay() {
    served_on_both_backends(|| {
        let dir = tempfile::tempdir().unwrap();
        let Some((mut nats, port)) = nats_with_orders_stream(dir.path()) else { return };
        let (orders, admin) = orders_relaying(&dir.path().join("orders"), 2000, 1000);
        let (status, body) = subscribe(&orders, &admin, "stream", &format!("nats://127.0.0.1:{port}/orders"));
        assert_eq!((status, body["kind"].as_str()), (200, Some("nats")), "{body}");
        let pending = |o: &Server| {
            let (_, page) = o.call("GET", "/v1/outbox?status=pending&limit=1000", Some(&admin), None);
            page["deliveries"].as_array().map(Vec::len).unwrap()
        };

        for f in 0..FLOWS {
            append(&orders, &admin, &format!("parcel-{f}"), 3);
        }
        orders.wait_for(WAIT, |o| (pending(o) == 0).then_some(()));
        assert_eq!(stored_ids(port, "ORDERS").len(), FLOWS * 3);

        // The broker killed with SIGKILL while events are committed, then restarted on its files.
        nats.kill9();
        for f in 0..FLOWS {
            append(&orders, &admin, &format!("parcel-{f}"), 2);
        }
        let down = orders.wait_for(WAIT, |o| {
            let (_, page) = o.call("GET", "/v1/subscriptions", Some(&admin), None);
            lane(&page, "stream").and_then(|l| l["last_error"].as_str().map(str::to_string))
        });
        assert!(down.contains(&format!("nats://127.0.0.1:{port}/orders")), "{down}");
        assert_eq!(pending(&orders), FLOWS * 2, "nothing accepted while the broker is down");
        nats.restart();
        orders.wait_for(WAIT, |o| (pending(o) == 0).then_some(()));
        let ids = stored_ids(port, "ORDERS");
        assert_eq!(ids.len(), FLOWS * 5, "every event stored once");
        assert_eq!(ids.iter().collect::<BTreeSet<_>>().len(), ids.len(), "no event stored twice");

        // Every event handed over again (an operator's redeliver): the stream answers duplicate.
        let (status, body) =
            orders.call("POST", "/v1/outbox/redeliver/stream", Some(&admin), Some(&json!({"all": true})));
        assert_eq!(status, 200, "{body}");
        orders.wait_for(WAIT, |o| (pending(o) == 0).then_some(()));
        assert_eq!(stored_ids(port, "ORDERS").len(), FLOWS * 5, "the duplicate window kept them out");
        let (_, metrics) = orders.text("/metrics");
        let duplicates: f64 = metrics
            .lines()
            .filter(|l| l.starts_with("tidemark_relay_deliveries_total") && l.contains("outcome=\"duplicate\""))
            .filter_map(|l| l.rsplit(" ").next()?.parse::<f64>().ok())
            .sum();
        // At least every redelivered event; more when a publish timed out while the broker was down
        // and reached the stream after it came back (the retry was then answered duplicate).
        assert!(duplicates as usize >= FLOWS * 5, "{metrics}");
        let endpoint = format!("endpoint=\"nats://127.0.0.1:{port}/orders\"");
        let per_endpoint = |outcome: &str| -> f64 {
            metrics
                .lines()
                .filter(|l| l.starts_with("tidemark_endpoint_deliveries_total") && l.contains(&endpoint))
                .filter(|l| l.contains(&format!("outcome=\"{outcome}\"")) && l.contains("kind=\"nats\""))
                .filter_map(|l| l.rsplit(" ").next()?.parse::<f64>().ok())
                .sum()
        };
        // Every event handed over twice in all (once, then by the redeliver), each time with custody.
        assert_eq!(per_endpoint("accepted") + per_endpoint("duplicate"), (FLOWS * 10) as f64, "{metrics}");
        assert!(per_endpoint("accepted") <= (FLOWS * 5) as f64, "{metrics}");
        assert!(per_endpoint("failed") > 0.0, "the broker was down for a while: {metrics}");
        assert!(metrics.contains("tidemark_endpoint_batch_seconds_count{"), "{metrics}");
    });
}

#[test]
fn two_services_exchange_events_through_nats_and_the_consumer_survives_a_sigkill_and_a_poison_message() {
    served_on_both_backends(|| {
        let dir = tempfile::tempdir().unwrap();
        let Some((_nats, port)) = nats_with_orders_stream(dir.path()) else { return };
        // shipping consumes the stream into its `ledger` consumer's inbox.
        let ship_dir = dir.path().join("shipping");
        let ship_admin = token(&ship_dir, "shipping", "admin");
        let ship_config = ship_dir.join("shipping.toml");
        std::fs::write(
            &ship_config,
            format!(
                "[[sources]]\ntenant = \"shipping\"\nconsumer = \"ledger\"\nfrom = \"nats://127.0.0.1:{port}/orders\"\n\
                 stream = \"ORDERS\"\nbatch = 20\nack_wait_ms = 2000\n"
            ),
        )
        .unwrap();
        let ship_args = ["--config", ship_config.to_str().unwrap()];
        let mut ship = Server::start(&ship_dir, &ship_args, &[]);
        let (status, body) = ship.call(
            "PUT",
            "/v1/consumers/ledger",
            Some(&ship_admin),
            Some(&json!({"handler": "record", "subscribe": false})),
        );
        assert_eq!(status, 201, "{body}");
        // orders relays its outbox to the stream.
        let orders_dir = dir.path().join("orders");
        let orders_admin = token(&orders_dir, "orders", "admin");
        let orders = Server::start(&orders_dir, &[], &[]);
        let (status, body) = subscribe(&orders, &orders_admin, "stream", &format!("nats://127.0.0.1:{port}/orders"));
        assert_eq!(status, 200, "{body}");

        for f in 0..FLOWS {
            append(&orders, &orders_admin, &format!("parcel-{f}"), 3);
        }
        ship.wait_for(WAIT, |s| (applied(s, &ship_admin).len() == FLOWS * 3).then_some(()));

        // A poison message on a consumed subject: terminated at the broker, never stored, never looping.
        with_jetstream(port, async |js| {
            js.publish("orders.elsewhere.poison", "not an envelope".into()).await.unwrap().await.expect("stored")
        });
        // The consumer killed with SIGKILL while events flow, then restarted.
        for f in 0..FLOWS {
            append(&orders, &orders_admin, &format!("parcel-{f}"), 2);
        }
        ship.kill9();
        for f in 0..FLOWS {
            append(&orders, &orders_admin, &format!("parcel-{f}"), 2);
        }
        // Anywhere: nothing sends to shipping's HTTP port, it pulls from the broker.
        let ship = Server::start(&ship_dir, &ship_args, &[]);
        let seen = ship.wait_for(WAIT, |s| {
            let seen = applied(s, &ship_admin);
            (seen.len() == FLOWS * 7).then_some(seen)
        });
        assert!(seen.values().all(|&n| n == 1), "an event applied twice: {seen:?}");
        let (_, cursors) = ship.call("GET", "/v1/consumers/ledger/cursors", Some(&ship_admin), None);
        let cursors = cursors["cursors"].as_array().unwrap();
        assert_eq!(cursors.len(), FLOWS, "{cursors:?}");
        assert!(cursors.iter().all(|c| c["high_water_seq"] == 7), "{cursors:?}");
        // Nothing is left unacked at the broker once the messages the killed process had stored
        // but not acked come back after ack_wait (answered duplicate, acked); the poison message was
        // terminated, never redelivered.
        let info = ship.wait_for(WAIT, |_| {
            let info = with_jetstream(port, async |js| {
                let stream = js.get_stream("ORDERS").await.unwrap();
                let mut consumer: async_nats::jetstream::consumer::PullConsumer =
                    stream.get_consumer("tidemark-shipping-ledger").await.expect("the durable consumer");
                consumer.info().await.unwrap().clone()
            });
            (info.num_ack_pending == 0 && info.num_pending == 0).then_some(info)
        });
        assert_eq!(info.ack_floor.stream_sequence, info.delivered.stream_sequence, "{info:?}");
        let (_, records) = ship.call("GET", "/v1/consumers/ledger/inbox?limit=1000", Some(&ship_admin), None);
        assert_eq!(records["records"].as_array().unwrap().len(), FLOWS * 7, "the poison message is not in the inbox");
    });
}

/// On a consumer file, then on a consumer schema of the PostgreSQL test server (skipped, saying
/// why, without one).
#[test]
fn tidemark_consume_stores_a_stream_in_an_inbox_file_once_and_terminates_what_it_cannot_store() {
    if !Path::new(NATS_BIN).exists() {
        println!("skipped: {NATS_BIN} is not installed (apt-get install nats-server)");
        return;
    }
    crate::workflow_cli::on_both_backends(consume_a_stream_into_an_inbox);
}

fn consume_a_stream_into_an_inbox() {
    use crate::support::{ok, run, Setup};
    let dir = tempfile::tempdir().unwrap();
    let port = crate::support::unused_port();
    let _nats = Nats::start(&dir.path().join("nats"), port);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    let envelope = |id: &str, seq: i64, text: &str| {
        json!({"event_id": id, "source": "shop", "generation": "g1", "flow_id": "order-1", "seq": seq,
            "event_type": "note.added", "schema_version": 1, "payload": {"text": text}, "created_at_ms": now})
    };
    with_jetstream(port, async |js| {
        js.create_stream(async_nats::jetstream::stream::Config {
            name: "NOTES".into(),
            subjects: vec!["notes.>".into()],
            ..Default::default()
        })
        .await
        .expect("create the stream");
        let messages = [
            ("m1", envelope("e1", 1, "a").to_string()),
            ("m2", envelope("e2", 2, "b").to_string()),
            ("m3", envelope("e3", 3, "c").to_string()),
            // The same event again under another message id (a redelivery past the duplicate window).
            ("m4", envelope("e2", 2, "b").to_string()),
            // The same position with other content: refused by the inbox.
            ("m5", envelope("e9", 3, "other").to_string()),
            ("m6", "not an envelope".to_string()),
        ];
        for (id, body) in messages {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(async_nats::header::NATS_MESSAGE_ID, id);
            js.publish_with_headers("notes.shop.order-1", headers, body.into()).await.unwrap().await.unwrap();
        }
    });
    // The inbox: a consumer file, or a consumer schema (with a producer beside it, unused).
    let stores = Setup::new(&[]);
    let c = stores.c();
    ok(&["init", "--consumer-db", c]);
    let from = format!("nats://127.0.0.1:{port}/notes");
    let args =
        ["consume", "--from", &from, "--stream", "NOTES", "--consumer-db", c, "--consumer-id", "audit", "--until-idle"];
    let report = ok(&args);
    assert_eq!(
        (&report["fetched"], &report["accepted"], &report["duplicate"], &report["rejected"]),
        (&json!(6), &json!(3), &json!(1), &json!(2)),
        "{report}"
    );
    // Everything was acked or terminated: a second run finds nothing.
    let again = ok(&args);
    assert_eq!(again["fetched"], 0, "{again}");
    let listed = ok(&["inbox", "list", "--consumer-db", c, "--consumer-id", "audit"]);
    assert_eq!(listed["records"].as_array().map(Vec::len), Some(3), "{listed}");
    // Bad input: a typed error, nothing consumed.
    let r =
        run(&["consume", "--from", "http://h/x", "--stream", "NOTES", "--consumer-db", c, "--consumer-id", "audit"]);
    assert_eq!((r.code, r.json["error"]["code"].as_str()), (2, Some("invalid_argument")), "{}", r.stdout);
}

#[test]
fn a_pull_consumer_reads_the_feed_in_commit_order_and_commits_what_it_stored() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("orders");
    let admin = token(&data, "orders", "admin");
    let orders = Server::start(&data, &[], &[]);
    let (status, body) = subscribe(&orders, &admin, "search", "pull:");
    assert_eq!((status, body["kind"].as_str()), (200, Some("pull")), "{body}");
    for round in 0..3 {
        for flow in ["a", "b"] {
            let (status, body) = orders.call(
                "POST",
                &format!("/v1/streams/{flow}/events"),
                Some(&admin),
                Some(&json!({"event_type": "noted", "payload": {"round": round}})),
            );
            assert_eq!(status, 200, "{body}");
        }
    }
    let feed = |query: &str| {
        let (status, page) = orders.call("GET", &format!("/v1/outbox/feed/search?{query}"), Some(&admin), None);
        assert_eq!(status, 200, "{page}");
        page
    };
    let positions = |page: &Value| -> Vec<i64> {
        page["events"].as_array().unwrap().iter().map(|e| e["position"].as_i64().unwrap()).collect()
    };
    let first = feed("limit=4");
    assert_eq!(positions(&first), [1, 2, 3, 4], "{first}");
    assert_eq!(first["events"][0]["envelope"]["flow_id"], "a");
    let ahead = feed(&format!("after={}", first["next_after"]));
    assert_eq!(positions(&ahead), [5, 6]);
    // Nothing committed yet: the feed hands the same events out again (a reader that crashed).
    assert_eq!(positions(&feed("limit=4")), [1, 2, 3, 4]);
    let commit = |through: i64| {
        let (status, body) = orders.call(
            "POST",
            "/v1/outbox/feed/search/commit",
            Some(&admin),
            Some(&json!({"through_position": through})),
        );
        assert_eq!(status, 200, "{body}");
        body["committed"].as_u64().unwrap()
    };
    assert_eq!(commit(4), 4);
    assert_eq!(positions(&feed("")), [5, 6]);
    assert_eq!(commit(4), 0, "committing again changes nothing");
    assert_eq!(commit(6), 2);
    assert!(positions(&feed("")).is_empty());
    let (_, pending) = orders.call("GET", "/v1/outbox?status=pending&limit=100", Some(&admin), None);
    assert_eq!(pending["deliveries"].as_array().map(Vec::len), Some(0), "{pending}");
    // The relay never pushes to it: no lane.
    let (_, page) = orders.call("GET", "/v1/subscriptions", Some(&admin), None);
    assert!(lane(&page, "search").is_some_and(Value::is_null), "{page}");

    // Bad input: typed errors, nothing changed.
    for (path, code) in [
        ("/v1/outbox/feed/nobody", "not_found"),
        ("/v1/outbox/feed/search?outbox=elsewhere", "invalid_argument"),
        ("/v1/outbox/feed/search?after=-1", "invalid_argument"),
        ("/v1/outbox/feed/search?limit=100000", "limit_exceeded"),
    ] {
        let (status, body) = orders.call("GET", path, Some(&admin), None);
        assert_eq!((status >= 400, body["error"]["code"].as_str()), (true, Some(code)), "{path}: {body}");
    }
    let (_, body) = subscribe(&orders, &admin, "pushed", "http://127.0.0.1:9/v1/consumers/x/inbox");
    assert_eq!(body["kind"], "http");
    let (status, body) = orders.call("GET", "/v1/outbox/feed/pushed", Some(&admin), None);
    assert_eq!((status, body["error"]["code"].as_str()), (409, Some("invalid_state_change")), "{body}");
    let (status, body) = subscribe(&orders, &admin, "bad", "pull:x");
    assert_eq!((status, body["error"]["code"].as_str()), (400, Some("invalid_endpoint")), "{body}");
}

/// The machine's RabbitMQ (`TIDEMARK_TEST_AMQP` = `host:port`, else 127.0.0.1:5672, as guest).
fn amqp_server() -> String {
    std::env::var("TIDEMARK_TEST_AMQP").unwrap_or_else(|_| "127.0.0.1:5672".to_string())
}

/// Run `f` with a channel of the test's own on the broker (a runtime of its own, on a thread of
/// its own, so that it also runs from a `Drop`); `Err` when the broker does not answer.
fn with_amqp<T: Send + 'static>(f: impl AsyncFnOnce(&lapin::Channel) -> T + Send + 'static) -> Result<T, String> {
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let uri = format!("amqp://guest:guest@{}/%2f", amqp_server());
            let connecting = async {
                let connection = lapin::Connection::connect(&uri, lapin::ConnectionProperties::default()).await?;
                let channel = connection.create_channel().await?;
                Ok::<_, lapin::Error>((connection, channel))
            };
            let (_connection, channel) = match tokio::time::timeout(Duration::from_secs(5), connecting).await {
                Ok(Ok(connected)) => connected,
                Ok(Err(e)) => return Err(e.to_string()),
                Err(_) => return Err("no answer within 5 s".to_string()),
            };
            Ok(f(&channel).await)
        })
    })
    .join()
    .expect("the AMQP thread")
}

/// This test's exchanges and queues on the shared broker, deleted when it ends (passed or not).
struct AmqpNames {
    exchanges: Vec<String>,
    queues: Vec<String>,
}

impl Drop for AmqpNames {
    fn drop(&mut self) {
        let (exchanges, queues) = (self.exchanges.clone(), self.queues.clone());
        let _ = with_amqp(async move |channel| {
            for queue in queues {
                let _ = channel.queue_delete(queue.as_str().into(), Default::default()).await;
            }
            for exchange in exchanges {
                let _ = channel.exchange_delete(exchange.as_str().into(), Default::default()).await;
            }
        });
    }
}

/// Declare the topic `exchanges` (durable) and the quorum queue `queue` bound to `bound_to` with
/// `#`; `Err` when the broker does not answer.
fn declare_quorum_queue(exchanges: &[String], queue: &str, bound_to: &str) -> Result<(), String> {
    let (exchanges, queue, bound_to) = (exchanges.to_vec(), queue.to_string(), bound_to.to_string());
    with_amqp(async move |channel| {
        use lapin::types::{AMQPValue, FieldTable, LongString};
        let durable = lapin::options::ExchangeDeclareOptions { durable: true, ..Default::default() };
        for name in &exchanges {
            let kind = lapin::ExchangeKind::Topic;
            channel.exchange_declare(name.as_str().into(), kind, durable, FieldTable::default()).await.unwrap();
        }
        let mut arguments = FieldTable::default();
        arguments.insert("x-queue-type".into(), AMQPValue::LongString(LongString::from("quorum")));
        let options = lapin::options::QueueDeclareOptions { durable: true, ..Default::default() };
        channel.queue_declare(queue.as_str().into(), options, arguments).await.unwrap();
        let bind = lapin::options::QueueBindOptions::default();
        channel
            .queue_bind(queue.as_str().into(), bound_to.as_str().into(), "#".into(), bind, FieldTable::default())
            .await
            .unwrap();
    })
}

/// Each message of `queue` (taken off it), in queue order: (message id, routing key, envelope).
fn drain_queue(queue: &str) -> Vec<(String, String, Value)> {
    let queue = queue.to_string();
    with_amqp(async move |channel| {
        let mut messages = Vec::new();
        let options = lapin::options::BasicGetOptions { no_ack: true };
        while let Some(got) = channel.basic_get(queue.as_str().into(), options).await.expect("basic.get") {
            let delivery = got.delivery;
            let id = delivery.properties.message_id().as_ref().expect("message_id").to_string();
            let envelope: Value = serde_json::from_slice(&delivery.data).expect("an envelope");
            messages.push((id, delivery.routing_key.to_string(), envelope));
        }
        messages
    })
    .expect("the broker answers")
}

#[test]
fn events_reach_a_rabbitmq_quorum_queue_once_in_order_and_an_unroutable_exchange_is_never_accepted() {
    served_on_both_backends(|| {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let tag = format!("{}x{nanos}", std::process::id());
        let (exchange, lonely, queue) =
            (format!("tmkit.orders.{tag}"), format!("tmkit.lonely.{tag}"), format!("tmkit.q.{tag}"));
        let names = AmqpNames { exchanges: vec![exchange.clone(), lonely.clone()], queues: vec![queue.clone()] };
        let declared = declare_quorum_queue(&[exchange.clone(), lonely.clone()], &queue, &exchange);
        if let Err(e) = declared {
            println!("skipped: RabbitMQ not reachable at {}: {e}", amqp_server());
            std::mem::forget(names);
            return;
        }

        let dir = tempfile::tempdir().unwrap();
        // A long attempt timeout: RabbitMQ has no dedup, so a timed-out batch would be published twice
        // (which the inbox on the consuming side absorbs, but this test counts what the queue holds).
        let (orders, admin) = orders_relaying(&dir.path().join("orders"), 60000, 1000);
        let server = amqp_server();
        for (consumer, name) in [("bus", &exchange), ("lonely", &lonely)] {
            let (status, body) = subscribe(&orders, &admin, consumer, &format!("amqp://{server}/{name}"));
            assert_eq!((status, body["kind"].as_str()), (200, Some("amqp")), "{body}");
        }
        let pending = |o: &Server, consumer: &str| {
            let (_, page) = o.call("GET", "/v1/outbox?status=pending&limit=1000", Some(&admin), None);
            page["deliveries"].as_array().unwrap().iter().filter(|d| d["consumer_id"] == consumer).count()
        };

        for f in 0..FLOWS {
            append(&orders, &admin, &format!("parcel-{f}"), 3);
        }
        orders.wait_for(WAIT, |o| (pending(o, "bus") == 0).then_some(()));

        // Each event once, on its documented routing key, each flow in order.
        let messages = drain_queue(&queue);
        assert_eq!(messages.len(), FLOWS * 3, "{messages:?}");
        let ids: BTreeSet<&String> = messages.iter().map(|(id, _, _)| id).collect();
        assert_eq!(ids.len(), messages.len(), "no event published twice");
        let mut last_seq: BTreeMap<String, i64> = BTreeMap::new();
        for (id, key, envelope) in &messages {
            assert_eq!(envelope["event_id"].as_str(), Some(id.as_str()));
            let (source, flow) = (envelope["source"].as_str().unwrap(), envelope["flow_id"].as_str().unwrap());
            assert_eq!(key, &format!("{}.{}", source.replace('.', "_"), flow.replace('.', "_")));
            let seq = envelope["seq"].as_i64().unwrap();
            let last = last_seq.insert(flow.to_string(), seq).unwrap_or(0);
            assert_eq!(seq, last + 1, "flow {flow} in order: {messages:?}");
        }
        assert!(last_seq.values().all(|&seq| seq == 3), "{last_seq:?}");

        // No queue is bound to `lonely`: its deliveries fail with the reason, and stay pending.
        let reason = orders.wait_for(WAIT, |o| {
            let (_, page) = o.call("GET", "/v1/subscriptions", Some(&admin), None);
            lane(&page, "lonely").and_then(|l| l["last_error"].as_str().map(str::to_string))
        });
        assert!(reason.contains("unroutable") && reason.contains(&lonely), "{reason}");
        let (_, page) = orders.call("GET", "/v1/subscriptions", Some(&admin), None);
        assert_eq!(lane(&page, "lonely").map(|l| l["delivered"].clone()), Some(json!(0)), "{page}");
        assert!(lane(&page, "lonely").unwrap()["failed"].as_u64().unwrap() >= 1, "{page}");
        assert_eq!(pending(&orders, "lonely"), FLOWS * 3, "never accepted");
        assert!(drain_queue(&queue).is_empty(), "nothing more reached the bound queue");
        drop(names);
    });
}

/// `queue`'s ready messages and consumers on the machine's broker.
fn queue_depth(queue: &str) -> (u32, u32) {
    let queue = queue.to_string();
    with_amqp(async move |channel| {
        let passive = lapin::options::QueueDeclareOptions { passive: true, ..Default::default() };
        let q = channel.queue_declare(queue.as_str().into(), passive, Default::default()).await.expect("the queue");
        (q.message_count(), q.consumer_count())
    })
    .expect("the broker answers")
}

/// Wait until `queue` has no consumer and `ready` messages ready: the broker returns a killed
/// consumer's unacked deliveries once it has seen its connection close.
fn wait_for_queue(queue: &str, ready: usize) {
    for _ in 0..600 {
        if queue_depth(queue) == (ready as u32, 0) {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("queue {queue} did not settle at {ready} ready messages: {:?}", queue_depth(queue));
}

#[test]
fn events_cross_rabbitmq_to_a_serve_source_and_tidemark_consume_once_across_kills_and_poison_is_rejected() {
    use crate::support::{ok, path_str, run, run_with};
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    let tag = format!("{}x{nanos}", std::process::id());
    // The relay publishes to `orders`; `shipping` consumes one queue bound to it, `tidemark
    // consume` another (each inbox a queue of its own), whose rejects go to a dead-letter queue.
    let (exchange, shipping_queue, audit_queue, dead_letters, dead_queue) = (
        format!("tmkit.src.orders.{tag}"),
        format!("tmkit.src.shipping.{tag}"),
        format!("tmkit.src.audit.{tag}"),
        format!("tmkit.src.dead.{tag}"),
        format!("tmkit.src.dlq.{tag}"),
    );
    let names = AmqpNames {
        exchanges: vec![exchange.clone(), dead_letters.clone()],
        queues: vec![shipping_queue.clone(), audit_queue.clone(), dead_queue.clone()],
    };
    let (x, sq, aq, dx, dq) =
        (exchange.clone(), shipping_queue.clone(), audit_queue.clone(), dead_letters.clone(), dead_queue.clone());
    let declared = with_amqp(async move |channel| {
        use lapin::types::{AMQPValue, FieldTable, LongString};
        let durable = lapin::options::ExchangeDeclareOptions { durable: true, ..Default::default() };
        for name in [&x, &dx] {
            let kind = lapin::ExchangeKind::Topic;
            channel.exchange_declare(name.as_str().into(), kind, durable, FieldTable::default()).await.unwrap();
        }
        let text = |s: &str| AMQPValue::LongString(LongString::from(s));
        for (queue, source, dead_lettered) in [(&sq, &x, false), (&aq, &x, true), (&dq, &dx, false)] {
            let mut arguments = FieldTable::default();
            arguments.insert("x-queue-type".into(), text("quorum"));
            if dead_lettered {
                arguments.insert("x-dead-letter-exchange".into(), text(&dx));
            }
            let options = lapin::options::QueueDeclareOptions { durable: true, ..Default::default() };
            channel.queue_declare(queue.as_str().into(), options, arguments).await.unwrap();
            let bind = lapin::options::QueueBindOptions::default();
            channel
                .queue_bind(queue.as_str().into(), source.as_str().into(), "#".into(), bind, FieldTable::default())
                .await
                .unwrap();
        }
    });
    if let Err(e) = declared {
        crate::support::skip(&format!("RabbitMQ not reachable at {}: {e}", amqp_server()));
        std::mem::forget(names);
        return;
    }
    let publish_poison = |queue: &str| {
        let queue = queue.to_string();
        with_amqp(async move |channel| {
            channel.confirm_select(Default::default()).await.unwrap();
            let body = b"not an envelope";
            let properties = lapin::BasicProperties::default().with_message_id("poison-1".into());
            let confirm = channel
                .basic_publish("".into(), queue.as_str().into(), Default::default(), body, properties)
                .await
                .unwrap();
            confirm.await.expect("confirmed");
        })
        .expect("the broker answers")
    };
    let server = amqp_server();
    let dir = tempfile::tempdir().unwrap();

    // shipping consumes its queue into its `ledger` consumer's inbox through `[[sources]]`.
    let ship_dir = dir.path().join("shipping");
    let ship_admin = token(&ship_dir, "shipping", "admin");
    let ship_config = ship_dir.join("shipping.toml");
    std::fs::write(
        &ship_config,
        format!(
            "[[sources]]\ntenant = \"shipping\"\nconsumer = \"ledger\"\nfrom = \"amqp://{server}/{shipping_queue}\"\n\
             batch = 20\n"
        ),
    )
    .unwrap();
    let ship_args = ["--config", ship_config.to_str().unwrap()];
    let mut ship = Server::start(&ship_dir, &ship_args, &[]);
    let (status, body) = ship.call(
        "PUT",
        "/v1/consumers/ledger",
        Some(&ship_admin),
        Some(&json!({"handler": "record", "subscribe": false})),
    );
    assert_eq!(status, 201, "{body}");

    // orders relays its outbox to the exchange (a long attempt timeout: RabbitMQ has no dedup).
    let orders_dir = dir.path().join("orders");
    let orders_admin = token(&orders_dir, "orders", "admin");
    let orders_config = orders_dir.join("orders.toml");
    std::fs::write(
        &orders_config,
        "[relay]\nattempt_timeout_ms = 60000\nbackoff_base_ms = 50\nbackoff_max_ms = 500\nmax_attempts = 1000\n",
    )
    .unwrap();
    let orders = Server::start(&orders_dir, &["--config", orders_config.to_str().unwrap()], &[]);
    let (status, body) = subscribe(&orders, &orders_admin, "bus", &format!("amqp://{server}/{exchange}"));
    assert_eq!((status, body["kind"].as_str()), (200, Some("amqp")), "{body}");
    // Reservation events (each flow's three in their only order), so that `tidemark drain`'s
    // handler below applies them too.
    for f in 0..FLOWS {
        append_reservation(&orders, &orders_admin, &format!("parcel-{f}"));
    }
    ship.wait_for(WAIT, |s| (applied(s, &ship_admin).len() == FLOWS * 3).then_some(()));

    // A poison message on each queue: rejected, never stored, never looping.
    publish_poison(&shipping_queue);
    publish_poison(&audit_queue);
    // The consumer killed with SIGKILL while events flow, then restarted: what it stored and did
    // not ack comes back (answered duplicate), nothing is applied twice.
    for f in 0..FLOWS {
        append_reservation(&orders, &orders_admin, &format!("before-{f}"));
    }
    ship.kill9();
    for f in 0..FLOWS {
        append_reservation(&orders, &orders_admin, &format!("after-{f}"));
    }
    let ship = Server::start(&ship_dir, &ship_args, &[]);
    let total = FLOWS * 9;
    let seen = ship.wait_for(WAIT, |s| {
        let seen = applied(s, &ship_admin);
        (seen.len() == total).then_some(seen)
    });
    assert!(seen.values().all(|&n| n == 1), "an event applied twice: {seen:?}");
    let (_, cursors) = ship.call("GET", "/v1/consumers/ledger/cursors", Some(&ship_admin), None);
    let cursors = cursors["cursors"].as_array().unwrap();
    assert_eq!(cursors.len(), FLOWS * 3, "{cursors:?}");
    assert!(cursors.iter().all(|c| c["high_water_seq"] == 3), "{cursors:?}");
    // Everything acked or rejected: nothing ready, only the restarted server's consumer.
    ship.wait_for(WAIT, |_| (queue_depth(&shipping_queue) == (0, 1)).then_some(()));
    let (_, records) = ship.call("GET", "/v1/consumers/ledger/inbox?limit=1000", Some(&ship_admin), None);
    assert_eq!(records["records"].as_array().unwrap().len(), total, "the poison message is not in the inbox");
    orders.wait_for(WAIT, |o| {
        let (_, page) = o.call("GET", "/v1/outbox?status=pending&limit=1000", Some(&orders_admin), None);
        page["deliveries"].as_array().unwrap().is_empty().then_some(())
    });

    // `tidemark consume` reads the other queue into a consumer database of its own.
    let inbox = dir.path().join("inbox.db");
    let c = path_str(&inbox);
    ok(&["init", "--consumer-db", c]);
    let from = format!("amqp://{server}/{audit_queue}");
    let args =
        ["consume", "--from", &from, "--consumer-db", c, "--consumer-id", "audit", "--batch", "25", "--until-idle"];
    let records = |status: Option<&str>| {
        let mut list = vec!["inbox", "list", "--consumer-db", c, "--consumer-id", "audit", "--limit", "1000"];
        if let Some(status) = status {
            list.extend(["--status", status]);
        }
        ok(&list)["records"].as_array().unwrap().len()
    };
    let mut stored_by_the_killed = 0;
    if crate::support::failpoints_enabled() {
        // Killed after its inbox commit, before the acks: the broker returns its deliveries, and
        // the next run answers them duplicate.
        let crashed = run_with(&args, &[("TIDEMARK_CRASH_AT", "receive.after_commit")], None);
        assert_eq!(crashed.code, 73, "{}\n{}", crashed.stdout, crashed.stderr);
        stored_by_the_killed = records(None);
        assert!((1..=25).contains(&stored_by_the_killed), "one batch stored: {stored_by_the_killed}");
        wait_for_queue(&audit_queue, total + 1);
    } else {
        crate::support::skip("the kill between inbox commit and ack needs --features failpoints");
    }
    let report = ok(&args);
    let count = |key: &str| report[key].as_u64().unwrap() as usize;
    assert_eq!(count("accepted"), total - stored_by_the_killed, "{report}");
    assert_eq!(count("duplicate"), stored_by_the_killed, "{report}");
    assert_eq!(count("rejected"), 1, "{report}");
    assert_eq!(count("fetched"), total + 1, "{report}");
    let reasons = report["reasons"].to_string();
    assert!(reasons.contains("poison-1") && reasons.contains("not an envelope"), "{report}");
    let drained = ok(&["drain", "--consumer-db", c, "--consumer-id", "audit", "--limit", "1000"]);
    assert_eq!(
        (drained["applied"].as_u64(), drained["outcome"].as_str()),
        (Some(total as u64), Some("idle")),
        "{drained}"
    );
    assert_eq!(records(Some("applied")), total);
    let cursors = ok(&["inbox", "cursors", "--consumer-db", c, "--consumer-id", "audit"]);
    let cursors = cursors["cursors"].as_array().unwrap();
    assert_eq!(cursors.len(), FLOWS * 3, "{cursors:?}");
    assert!(cursors.iter().all(|c| c["high_water_seq"] == 3), "{cursors:?}");
    // Everything acked or rejected: another run reads nothing, and the poison message is kept
    // by the dead-letter queue, never delivered to the consumer again.
    let again = ok(&args);
    assert_eq!(again["fetched"], 0, "{again}");
    wait_for_queue(&audit_queue, 0);
    assert_eq!(queue_depth(&dead_queue).0, 1, "the rejected message is dead-lettered");

    // Bad input: typed errors, nothing consumed.
    for bad in [
        vec!["--stream", "ORDERS"],
        vec!["--ack-wait-ms", "5000"],
        vec!["--session-timeout-ms", "6000"],
        vec!["--durable", "has space"],
        vec!["--batch", "1001"],
        vec!["--amqp-credentials", "env:TIDEMARK_TEST_AMQP_CREDENTIALS_THAT_ARE_NOT_SET"],
        vec!["--amqp-credentials", "no-password-separator"],
    ] {
        let mut bad_args = vec!["consume", "--from", &from, "--consumer-db", c, "--consumer-id", "audit"];
        bad_args.extend(bad.iter().copied());
        let r = run(&bad_args);
        assert_eq!((r.code, r.json["error"]["code"].as_str()), (2, Some("invalid_argument")), "{bad:?}: {}", r.stdout);
        assert!(!r.stdout.contains("no-password-separator"), "a credential is never printed: {}", r.stdout);
    }
    for bad_from in [
        format!("amqp://{server}/vhost/{audit_queue}"),
        format!("amqp://guest:guest@{server}/{audit_queue}"),
        format!("amqp://{server}/{audit_queue}?heartbeat=5"),
        format!("amqp://{server}/"),
    ] {
        let r = run(&["consume", "--from", &bad_from, "--consumer-db", c, "--consumer-id", "audit"]);
        assert_eq!(
            (r.code, r.json["error"]["code"].as_str()),
            (2, Some("invalid_argument")),
            "{bad_from}: {}",
            r.stdout
        );
    }
    let nats =
        ["consume", "--from", "nats://127.0.0.1:4222/x", "--stream", "S", "--consumer-db", c, "--consumer-id", "audit"];
    let r = run(&[&nats[..], &["--amqp-credentials", "u:p"]].concat());
    assert_eq!((r.code, r.json["error"]["code"].as_str()), (2, Some("invalid_argument")), "{}", r.stdout);
    let missing = format!("amqp://{server}/tmkit.src.missing.{tag}");
    let r = run(&["consume", "--from", &missing, "--consumer-db", c, "--consumer-id", "audit"]);
    assert_eq!(r.code, 1, "{}", r.stdout);
    assert!(r.json["error"]["message"].as_str().unwrap_or("").contains("has no queue"), "{}", r.stdout);
    let r = run(&["consume", "--from", "amqp://127.0.0.1:9/q", "--consumer-db", c, "--consumer-id", "audit"]);
    assert_eq!(r.code, 1, "{}", r.stdout);
    assert!(r.json["error"]["message"].as_str().unwrap_or("").contains("cannot connect to RabbitMQ"), "{}", r.stdout);
    assert_eq!(records(None), total, "nothing more was stored");
    drop(names);
}

/// A flow's three reservation events, in their only order, as `tidemark drain`'s reservation
/// handler applies them (anything out of order would block on an invalid transition).
fn append_reservation(server: &Server, token: &str, flow: &str) {
    for state in ["reserved", "confirmed", "released"] {
        let (status, body) = server.call(
            "POST",
            &format!("/v1/streams/{flow}/events"),
            Some(token),
            Some(&json!({"event_type": format!("reservation.{state}"), "payload": {"amount": 2}})),
        );
        assert_eq!(status, 200, "{body}");
    }
}

#[test]
fn events_cross_kafka_from_a_serve_relay_to_a_serve_source_and_tidemark_consume_once_and_in_order() {
    use crate::support::{ok, path_str, run, run_with};
    // rdkafka's in-process cluster listens on loopback ports: the serve processes and
    // `tidemark consume` reach it as they would a Kafka cluster.
    let cluster = rdkafka::mocking::MockCluster::new(1).expect("a mock cluster");
    cluster.create_topic("orders", 3, 1).expect("create the topic");
    let bootstrap = cluster.bootstrap_servers();
    let from = format!("kafka://{bootstrap}/orders");
    let dir = tempfile::tempdir().unwrap();

    // shipping consumes the topic into its `ledger` consumer's inbox through `[[sources]]`.
    let ship_dir = dir.path().join("shipping");
    let ship_admin = token(&ship_dir, "shipping", "admin");
    let ship_config = ship_dir.join("shipping.toml");
    std::fs::write(
        &ship_config,
        format!(
            "[[sources]]\ntenant = \"shipping\"\nconsumer = \"ledger\"\nfrom = \"{from}\"\nbatch = 20\n\
             session_timeout_ms = 6000\n"
        ),
    )
    .unwrap();
    let ship = Server::start(&ship_dir, &["--config", ship_config.to_str().unwrap()], &[]);
    let (status, body) = ship.call(
        "PUT",
        "/v1/consumers/ledger",
        Some(&ship_admin),
        Some(&json!({"handler": "record", "subscribe": false})),
    );
    assert_eq!(status, 201, "{body}");

    // orders relays its outbox to the topic.
    let orders_dir = dir.path().join("orders");
    let orders_admin = token(&orders_dir, "orders", "admin");
    let orders = Server::start(&orders_dir, &[], &[]);
    let (status, body) = subscribe(&orders, &orders_admin, "bus", &from);
    assert_eq!((status, body["kind"].as_str()), (200, Some("kafka")), "{body}");
    for f in 0..FLOWS {
        append_reservation(&orders, &orders_admin, &format!("parcel-{f}"));
    }
    let total = FLOWS * 3;
    orders.wait_for(WAIT, |o| {
        let (_, page) = o.call("GET", "/v1/outbox?status=pending&limit=1000", Some(&orders_admin), None);
        page["deliveries"].as_array().unwrap().is_empty().then_some(())
    });
    let (_, page) = orders.call("GET", "/v1/subscriptions", Some(&orders_admin), None);
    let lane = lane(&page, "bus").expect("a lane for the kafka endpoint");
    // At least once each (a batch that timed out would be produced again: Kafka has no dedup).
    assert_eq!(lane["kind"].as_str(), Some("kafka"), "{page}");
    assert!(lane["delivered"].as_u64().unwrap() >= total as u64, "{page}");

    // shipping applied every event once; its cursors say each flow is applied through seq 3 (the
    // record handler applies only high-water + 1).
    let seen = ship.wait_for(WAIT, |s| {
        let seen = applied(s, &ship_admin);
        (seen.len() == total).then_some(seen)
    });
    assert!(seen.values().all(|&n| n == 1), "an event applied twice: {seen:?}");
    let (_, cursors) = ship.call("GET", "/v1/consumers/ledger/cursors", Some(&ship_admin), None);
    let cursors = cursors["cursors"].as_array().unwrap();
    assert_eq!(cursors.len(), FLOWS, "{cursors:?}");
    assert!(cursors.iter().all(|c| c["high_water_seq"] == 3), "{cursors:?}");

    // `tidemark consume` reads the same topic into a consumer database of its own (its own group).
    let inbox = dir.path().join("inbox.db");
    let c = path_str(&inbox);
    ok(&["init", "--consumer-db", c]);
    let args = [
        "consume",
        "--from",
        &from,
        "--consumer-db",
        c,
        "--consumer-id",
        "audit",
        "--batch",
        "25",
        "--session-timeout-ms",
        "6000",
        "--until-idle",
    ];
    let records = |status: Option<&str>| {
        let mut list = vec!["inbox", "list", "--consumer-db", c, "--consumer-id", "audit", "--limit", "1000"];
        if let Some(status) = status {
            list.extend(["--status", status]);
        }
        ok(&list)["records"].as_array().unwrap().len()
    };
    let mut stored_by_the_killed = 0;
    if crate::support::failpoints_enabled() {
        // Killed after its inbox commit, before the offset commit: the next run reads that batch
        // again and the inbox answers duplicate.
        let crashed = run_with(&args, &[("TIDEMARK_CRASH_AT", "receive.after_commit")], None);
        assert_eq!(crashed.code, 73, "{}\n{}", crashed.stdout, crashed.stderr);
        stored_by_the_killed = records(None);
        assert!((1..=25).contains(&stored_by_the_killed), "one batch stored: {stored_by_the_killed}");
    } else {
        crate::support::skip("the kill between inbox and offset commit needs --features failpoints");
    }
    let report = ok(&args);
    let count = |key: &str| report[key].as_u64().unwrap() as usize;
    // What the killed run stored is read again and answered duplicate (so is any record the relay
    // produced twice); every other event is accepted once.
    assert_eq!(count("accepted"), total - stored_by_the_killed, "{report}");
    assert!(count("duplicate") >= stored_by_the_killed, "{report}");
    assert_eq!(count("fetched"), count("accepted") + count("duplicate"), "{report}");
    assert_eq!(count("rejected"), 0, "{report}");
    let drained = ok(&["drain", "--consumer-db", c, "--consumer-id", "audit", "--limit", "1000"]);
    assert_eq!(
        (drained["applied"].as_u64(), drained["outcome"].as_str()),
        (Some(total as u64), Some("idle")),
        "{drained}"
    );
    assert_eq!(records(Some("applied")), total);
    let cursors = ok(&["inbox", "cursors", "--consumer-db", c, "--consumer-id", "audit"]);
    let cursors = cursors["cursors"].as_array().unwrap();
    assert_eq!(cursors.len(), FLOWS, "{cursors:?}");
    assert!(cursors.iter().all(|c| c["high_water_seq"] == 3), "{cursors:?}");
    // Everything is committed: another run reads nothing.
    let again = ok(&args);
    assert_eq!(again["fetched"], 0, "{again}");

    // Bad input: typed errors, nothing consumed.
    for bad in [
        vec!["--stream", "ORDERS"],
        vec!["--ack-wait-ms", "5000"],
        vec!["--session-timeout-ms", "10"],
        vec!["--durable", "has space"],
    ] {
        let mut bad_args = vec!["consume", "--from", &from, "--consumer-db", c, "--consumer-id", "audit"];
        bad_args.extend(bad.iter().copied());
        let r = run(&bad_args);
        assert_eq!((r.code, r.json["error"]["code"].as_str()), (2, Some("invalid_argument")), "{bad:?}: {}", r.stdout);
    }
    let r = run(&["consume", "--from", "kafka://127.0.0.1:9/orders", "--consumer-db", c, "--consumer-id", "audit"]);
    assert_eq!(r.code, 1, "{}", r.stdout);
    assert!(r.json["error"]["message"].as_str().unwrap_or("").contains("cannot reach Kafka"), "{}", r.stdout);
    let r = run(&["consume", "--from", "nats://127.0.0.1:4222/x", "--consumer-db", c, "--consumer-id", "audit"]);
    assert_eq!((r.code, r.json["error"]["code"].as_str()), (2, Some("invalid_argument")), "no --stream: {}", r.stdout);
    assert_eq!(records(None), total, "nothing more was stored");
}

/// What the in-test proxy between a relay and the receiving server does with its traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Wire {
    /// Bytes pass both ways.
    Pass = 0,
    /// Requests pass, answers are thrown away and the connection closed: the receiver committed
    /// a batch the sender never hears about.
    LoseAnswers = 1,
    /// Every connection is closed at once (a cut cable, a reset).
    Cut = 2,
    /// Nothing passes and nothing is closed (a black hole): the sender's attempt times out.
    BlackHole = 3,
}

/// A TCP proxy on loopback in front of `target`, its behaviour switched at run time; it counts
/// the answers it threw away. Every loop is bounded by `stop`.
struct Proxy {
    addr: String,
    wire: std::sync::Arc<std::sync::atomic::AtomicU8>,
    lost_answers: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Proxy {
    fn start(target: &str) -> Proxy {
        use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
        use std::sync::Arc;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (wire, lost, stop) =
            (Arc::new(AtomicU8::new(0)), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(false)));
        let target = target.to_string();
        let (w, l, s) = (wire.clone(), lost.clone(), stop.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                let Ok((client, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                if w.load(Ordering::SeqCst) == Wire::Cut as u8 {
                    drop(client);
                    continue;
                }
                let Ok(server) = std::net::TcpStream::connect(&target) else { continue };
                for (from, to, answers) in
                    [(client.try_clone().unwrap(), server.try_clone().unwrap(), false), (server, client, true)]
                {
                    let (w, l, s) = (w.clone(), l.clone(), s.clone());
                    std::thread::spawn(move || pipe(from, to, answers, &w, &l, &s));
                }
            }
        });
        Proxy { addr: format!("http://{addr}"), wire, lost_answers: lost, stop }
    }

    fn set(&self, wire: Wire) {
        self.wire.store(wire as u8, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Copy `from` to `to` while the wire lets it; `answers`: this is the receiver-to-sender side.
fn pipe(
    mut from: std::net::TcpStream,
    mut to: std::net::TcpStream,
    answers: bool,
    wire: &std::sync::atomic::AtomicU8,
    lost: &std::sync::atomic::AtomicUsize,
    stop: &std::sync::atomic::AtomicBool,
) {
    use std::io::{Read, Write};
    use std::sync::atomic::Ordering;
    from.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let mut buf = [0_u8; 16 * 1024];
    let close = |a: &std::net::TcpStream, b: &std::net::TcpStream| {
        let _ = a.shutdown(std::net::Shutdown::Both);
        let _ = b.shutdown(std::net::Shutdown::Both);
    };
    while !stop.load(Ordering::SeqCst) {
        let mode = wire.load(Ordering::SeqCst);
        if mode == Wire::Cut as u8 {
            return close(&from, &to);
        }
        if mode == Wire::BlackHole as u8 {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        let n = match from.read(&mut buf) {
            Ok(0) => return close(&from, &to),
            Ok(n) => n,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => continue,
            Err(_) => return close(&from, &to),
        };
        if answers && wire.load(Ordering::SeqCst) == Wire::LoseAnswers as u8 {
            lost.fetch_add(1, Ordering::SeqCst);
            return close(&from, &to);
        }
        if to.write_all(&buf[..n]).is_err() {
            return close(&from, &to);
        }
    }
    close(&from, &to);
}

/// A thread that appends `rounds` stream events on each of `FLOWS` flows of `orders`
/// (`parcel-<f>`, `pause` between rounds).
fn stream_writer(orders: &Server, token: &str, rounds: usize, pause: Duration) -> std::thread::JoinHandle<()> {
    let (base, token) = (orders.base.clone(), token.to_string());
    std::thread::spawn(move || {
        let client = reqwest::blocking::Client::new();
        for round in 0..rounds {
            for f in 0..FLOWS {
                let response = client
                    .post(format!("{base}/v1/streams/parcel-{f}/events"))
                    .bearer_auth(&token)
                    .json(&json!({"event_type": "parcel.noted", "payload": {"round": round}}))
                    .send()
                    .expect("orders answers");
                assert_eq!(response.status().as_u16(), 200);
            }
            std::thread::sleep(pause);
        }
    })
}

/// Produce `rounds` stream events on each of `FLOWS` flows of `orders` while `proxy` flaps
/// `flaps` times through losing the answers, passing, cutting, passing, black-holing and passing
/// (`dwell` each); then append to `parcel-extra` with the answers lost until one was (or the test
/// proved nothing), heal, and wait for the writer. The number of `parcel-extra` events.
fn produce_through_a_flapping_network(
    orders: &Server,
    token: &str,
    proxy: &Proxy,
    rounds: usize,
    flaps: usize,
    dwell: Duration,
) -> usize {
    let writer = stream_writer(orders, token, rounds, Duration::from_millis(50));
    for _ in 0..flaps {
        for wire in [Wire::LoseAnswers, Wire::Pass, Wire::Cut, Wire::Pass, Wire::BlackHole, Wire::Pass] {
            proxy.set(wire);
            std::thread::sleep(dwell);
        }
    }
    // Answers must have been lost after a commit at least once, or the test proved nothing.
    let mut extra = 0;
    let lose_until_one = (0..40).any(|_| {
        proxy.set(Wire::LoseAnswers);
        append(orders, token, "parcel-extra", 1);
        extra += 1;
        std::thread::sleep(Duration::from_millis(150));
        proxy.lost_answers.load(std::sync::atomic::Ordering::SeqCst) > 0
    });
    assert!(lose_until_one, "no answer was ever lost: the proxy did not stand between the two");
    proxy.set(Wire::Pass);
    writer.join().unwrap();
    extra
}

/// Wait until `orders` has nothing pending, and check that nothing was quarantined.
/// The lane of `consumer` handed batches over straight after the one before (read while it was
/// in flight), or the test with `PIPELINED_BATCH` proved nothing about read-ahead.
fn assert_read_ahead(orders: &Server, token: &str, consumer: &str) {
    let (_, page) = orders.call("GET", "/v1/subscriptions", Some(token), None);
    let lane = lane(&page, consumer).unwrap_or_else(|| panic!("no lane for {consumer}: {page}"));
    assert!(lane["read_ahead"].as_u64().is_some_and(|n| n > 0), "no batch was read ahead: {lane}");
}

fn settled(orders: &Server, token: &str) {
    orders.wait_for(WAIT, |o| {
        let (_, page) = o.call("GET", "/v1/outbox?status=pending&limit=10", Some(token), None);
        page["deliveries"].as_array().is_some_and(|d| d.is_empty()).then_some(())
    });
    let (_, quarantined) = orders.call("GET", "/v1/outbox?status=quarantined&limit=10", Some(token), None);
    assert_eq!(quarantined["deliveries"].as_array().map(Vec::len), Some(0), "{quarantined}");
}

/// The network between the relay and the receiving server cut, black-holed, flapping, and losing
/// the receiver's answers after it committed (an in-test TCP proxy in between), while events are
/// produced: every event is applied once and in order per flow, the batches whose answers were
/// lost come back `duplicate`, and the relay catches up by itself, nothing quarantined.
#[test]
fn events_cross_a_cut_flapping_network_that_loses_answers_exactly_once_and_in_order() {
    served_on_both_backends(|| {
        let dir = tempfile::tempdir().unwrap();
        let (ship_dir, orders_dir) = (dir.path().join("shipping"), dir.path().join("orders"));
        let (ship, ship_token) = shipping(&ship_dir, "127.0.0.1:0");
        let proxy = Proxy::start(ship.base.trim_start_matches("http://"));
        // The relay's token is for the origin it sends to: the proxy's.
        let (orders, orders_token) = orders(&orders_dir, &proxy.addr, &ship_token, &[], 1_000);
        let (status, body) =
            subscribe(&orders, &orders_token, "ledger", &format!("{}/v1/consumers/ledger/inbox", proxy.addr));
        assert_eq!(status, 200, "{body}");

        let extra =
            produce_through_a_flapping_network(&orders, &orders_token, &proxy, 8, 4, Duration::from_millis(250));

        let total = FLOWS * 8 + extra;
        let seen = ship.wait_for(WAIT, |s| {
            let seen = applied(s, &ship_token);
            (seen.len() == total).then_some(seen)
        });
        assert!(seen.values().all(|&n| n == 1), "an event applied twice: {seen:?}");
        for f in 0..FLOWS {
            let seqs: BTreeSet<i64> =
                seen.keys().filter(|(flow, _)| flow == &format!("parcel-{f}")).map(|(_, seq)| *seq).collect();
            assert_eq!(seqs, (1..=8).collect(), "parcel-{f}");
        }
        settled(&orders, &orders_token);
        // The lost answers came back as duplicates: the receiver answered them, and applied nothing twice.
        let (_, page) = orders.call("GET", "/v1/subscriptions", Some(&orders_token), None);
        assert!(lane(&page, "ledger").is_some(), "{page}");
    });
}

/// Every message of the stream as (flow, seq) from its `Tidemark-Flow` and `Tidemark-Seq`
/// headers, in stream order.
fn stored_positions(port: u16, stream: &str) -> Vec<(String, i64)> {
    with_jetstream(port, async |js| {
        let mut stream = js.get_stream(stream).await.expect("the stream");
        let count = stream.info().await.unwrap().state.last_sequence;
        let mut positions = Vec::new();
        for seq in 1..=count {
            let message = stream.get_raw_message(seq).await.expect("message");
            let header = |name: &str| message.headers.get(name).expect(name).as_str().to_string();
            positions.push((header("Tidemark-Flow"), header("Tidemark-Seq").parse().expect("a seq")));
        }
        positions
    })
}

/// A partition between a relay and its broker: the network to NATS JetStream cut, black-holed,
/// flapping, and losing the broker's answers (a PubAck lost after the stream stored the message)
/// through an in-test TCP proxy, while events are produced. Every event is stored in the stream
/// exactly once (a lost PubAck's retry is answered duplicate inside the duplicate window) and
/// each flow's in seq order, and the relay catches up by itself, nothing quarantined.
#[test]
fn events_reach_nats_once_and_in_order_across_a_cut_flapping_network_that_loses_pub_acks() {
    served_on_both_backends(|| {
        let dir = tempfile::tempdir().unwrap();
        let Some((_nats, port)) = nats_with_orders_stream(dir.path()) else { return };
        let proxy = Proxy::start(&format!("127.0.0.1:{port}"));
        let through = proxy.addr.trim_start_matches("http://").to_string();
        let (orders, admin) = orders_relaying(&dir.path().join("orders"), 1000, PIPELINED_BATCH);
        let (status, body) = subscribe(&orders, &admin, "stream", &format!("nats://{through}/orders"));
        assert_eq!((status, body["kind"].as_str()), (200, Some("nats")), "{body}");

        let extra = produce_through_a_flapping_network(&orders, &admin, &proxy, 6, 3, Duration::from_millis(300));
        settled(&orders, &admin);
        assert_read_ahead(&orders, &admin, "stream");

        let total = FLOWS * 6 + extra;
        let ids = stored_ids(port, "ORDERS");
        assert_eq!(ids.len(), total, "every event stored");
        assert_eq!(ids.iter().collect::<BTreeSet<_>>().len(), total, "no event stored twice");
        let positions = stored_positions(port, "ORDERS");
        let mut flows: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for (flow, seq) in positions {
            flows.entry(flow).or_default().push(seq);
        }
        // Every seq of every flow, once, in seq order: the lane holds a flow's later events back
        // while an earlier one backs off after a failed attempt (docs/protocol.md, "Order in a
        // broker"; without it this stream held parcel-0 as 4, 5, 1, 6, 3, 2).
        for (flow, seqs) in &flows {
            let expected = if flow == "parcel-extra" { extra } else { 6 };
            assert_eq!(seqs, &(1..=expected as i64).collect::<Vec<_>>(), "{flow} in the stream, in stream order");
        }
    });
}

/// The sending relay killed at its commit boundary while batches go to NATS back to back: with
/// read-ahead the lane hands a batch over while the outbox's thread records the one before, and
/// the process dies in that record (`relay.before_producer_commit`), two batches published and
/// neither recorded. Restarted on its data, the relay hands both over again: the stream keeps
/// each event once (the duplicate window), each flow in seq order, nothing left pending.
#[test]
fn a_relay_killed_while_recording_one_batch_with_the_next_in_flight_loses_and_doubles_nothing_at_nats() {
    served_on_both_backends(|| {
        if !crate::support::failpoints_enabled() {
            crate::support::skip("the kill at relay.before_producer_commit needs --features failpoints");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let Some((_nats, port)) = nats_with_orders_stream(dir.path()) else { return };
        let orders_dir = dir.path().join("orders");
        let admin = token(&orders_dir, "orders", "admin");
        let config = orders_dir.join("orders.toml");
        std::fs::write(&config, format!("[relay]\nbatch = {PIPELINED_BATCH}\n")).unwrap();
        let args = ["--config", config.to_str().unwrap()];
        let crash = [("TIDEMARK_CRASH_AT", "relay.before_producer_commit@3")];
        let mut orders = Server::start(&orders_dir, &args, &crash);
        for f in 0..FLOWS {
            append(&orders, &admin, &format!("parcel-{f}"), 6);
        }
        // From the start: the lane finds a backlog of 20 batches.
        let endpoint = json!({"endpoint": format!("nats://127.0.0.1:{port}/orders"), "from_start": true});
        let (status, body) = orders.call("PUT", "/v1/subscriptions/stream", Some(&admin), Some(&endpoint));
        assert_eq!(status, 200, "{body}");
        assert_eq!(orders.wait_exit(WAIT), 73, "killed at the third record of a lane");
        let before = stored_ids(port, "ORDERS").len();
        assert!(before >= 3 * PIPELINED_BATCH, "three batches handed over before the kill: {before}");

        let orders = Server::start(&orders_dir, &args, &[]);
        settled(&orders, &admin);
        let ids = stored_ids(port, "ORDERS");
        assert_eq!(ids.len(), FLOWS * 6, "every event stored once (stored before the restart: {before})");
        assert_eq!(ids.iter().collect::<BTreeSet<_>>().len(), FLOWS * 6, "no event stored twice");
        let mut flows: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for (flow, seq) in stored_positions(port, "ORDERS") {
            flows.entry(flow).or_default().push(seq);
        }
        assert_eq!(flows.len(), FLOWS);
        for (flow, seqs) in &flows {
            assert_eq!(seqs, &(1..=6).collect::<Vec<_>>(), "{flow} in the stream, in stream order");
        }
        assert_read_ahead(&orders, &admin, "stream");
    });
}

/// A partition between a serving relay and RabbitMQ (the same in-test proxy: publisher
/// confirms lost after the queue took the message, cuts, black holes), while events are
/// produced: no event is lost (every flow's every seq reaches the quorum queue, first in seq
/// order) and nothing is quarantined. RabbitMQ has no per-message dedup, so a batch whose confirms were lost is
/// published again and the queue may hold an event twice (docs/protocol.md, "RabbitMQ"): the
/// copies are the same event (same id, same content), which a consuming inbox takes once.
#[test]
fn events_reach_rabbitmq_without_loss_across_a_cut_flapping_network_that_loses_confirms() {
    served_on_both_backends(|| {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let tag = format!("{}p{nanos}", std::process::id());
        let (exchange, queue) = (format!("tmkit.cut.{tag}"), format!("tmkit.cutq.{tag}"));
        let names = AmqpNames { exchanges: vec![exchange.clone()], queues: vec![queue.clone()] };
        let declared = declare_quorum_queue(std::slice::from_ref(&exchange), &queue, &exchange);
        if let Err(e) = declared {
            println!("skipped: RabbitMQ not reachable at {}: {e}", amqp_server());
            std::mem::forget(names);
            return;
        }
        let proxy = Proxy::start(&amqp_server());
        let through = proxy.addr.trim_start_matches("http://").to_string();
        let dir = tempfile::tempdir().unwrap();
        let (orders, admin) = orders_relaying(&dir.path().join("orders"), 1000, PIPELINED_BATCH);
        let (status, body) = subscribe(&orders, &admin, "bus", &format!("amqp://{through}/{exchange}"));
        assert_eq!((status, body["kind"].as_str()), (200, Some("amqp")), "{body}");

        let extra = produce_through_a_flapping_network(&orders, &admin, &proxy, 6, 3, Duration::from_millis(300));
        settled(&orders, &admin);
        assert_read_ahead(&orders, &admin, "bus");

        let messages = drain_queue(&queue);
        let mut by_id: BTreeMap<String, Value> = BTreeMap::new();
        let mut first_seen: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for (id, _, envelope) in &messages {
            match by_id.insert(id.clone(), envelope.clone()) {
                Some(first) => assert_eq!(&first, envelope, "a second copy of {id} is the same event"),
                None => first_seen
                    .entry(envelope["flow_id"].as_str().unwrap().to_string())
                    .or_default()
                    .push(envelope["seq"].as_i64().unwrap()),
            }
        }
        // Each flow's events first reached the queue in seq order (a copy comes after its first).
        for (flow, seqs) in &first_seen {
            assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{flow} first reached the queue as {seqs:?}");
        }
        let mut flows: BTreeMap<String, BTreeSet<i64>> = BTreeMap::new();
        for envelope in by_id.values() {
            let flow = envelope["flow_id"].as_str().unwrap().to_string();
            assert!(flows.entry(flow).or_default().insert(envelope["seq"].as_i64().unwrap()), "one id per seq");
        }
        assert_eq!(flows.len(), FLOWS + 1, "{flows:?}");
        for (flow, seqs) in &flows {
            let expected = if flow == "parcel-extra" { extra } else { 6 };
            assert_eq!(seqs, &(1..=expected as i64).collect::<BTreeSet<_>>(), "{flow}: no event lost");
        }
        println!(
            "rabbitmq partition: {} messages for {} events, {} answers thrown away",
            messages.len(),
            by_id.len(),
            proxy.lost_answers.load(std::sync::atomic::Ordering::SeqCst)
        );
        drop(names);
    });
}

/// Every record of `topic` (`partitions` of them) as (flow, seq) from its `tidemark-flow` and
/// `tidemark-seq` headers, partition by partition in each partition's order, once `expected`
/// records were read (or `WAIT` passed).
fn kafka_positions(bootstrap: &str, topic: &str, partitions: i32, expected: usize) -> Vec<(String, i64)> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::{Headers, Message};
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "partition-test-reader")
        .set("enable.auto.commit", "false")
        .create()
        .expect("a consumer");
    let mut assignment = rdkafka::TopicPartitionList::new();
    for partition in 0..partitions {
        assignment.add_partition_offset(topic, partition, rdkafka::Offset::Beginning).unwrap();
    }
    consumer.assign(&assignment).unwrap();
    let mut by_partition: BTreeMap<i32, Vec<(String, i64)>> = BTreeMap::new();
    let deadline = std::time::Instant::now() + WAIT;
    while by_partition.values().map(Vec::len).sum::<usize>() < expected && std::time::Instant::now() < deadline {
        let Some(message) = consumer.poll(Duration::from_millis(200)) else { continue };
        let message = message.expect("a record");
        let headers = message.headers().expect("headers");
        let header = |name: &str| {
            let found = headers.iter().find(|h| h.key == name).unwrap_or_else(|| panic!("no {name} header"));
            String::from_utf8(found.value.expect("a value").to_vec()).unwrap()
        };
        let position = (header("tidemark-flow"), header("tidemark-seq").parse().expect("a seq"));
        by_partition.entry(message.partition()).or_default().push(position);
    }
    by_partition.into_values().flatten().collect()
}

/// A partition between a serving relay and Kafka (rdkafka's in-process cluster, its one broker
/// taken down and brought back up while events are produced: connections dropped, new ones
/// refused): no event is lost, each flow's events first reach its partition in seq order, and
/// the relay catches up by itself, nothing quarantined. Kafka has no dedup across deliveries, so
/// a batch that timed out while the broker was down may be produced again (docs/protocol.md,
/// "Kafka"): a second copy comes after the first and is the same event.
#[test]
fn events_reach_kafka_without_loss_and_in_order_across_a_broker_that_goes_down_and_up() {
    served_on_both_backends(|| {
        let cluster = rdkafka::mocking::MockCluster::new(1).expect("a mock cluster");
        cluster.create_topic("orders", 3, 1).expect("create the topic");
        let bootstrap = cluster.bootstrap_servers();
        let dir = tempfile::tempdir().unwrap();
        let (orders, admin) = orders_relaying(&dir.path().join("orders"), 1000, PIPELINED_BATCH);
        let (status, body) = subscribe(&orders, &admin, "bus", &format!("kafka://{bootstrap}/orders"));
        assert_eq!((status, body["kind"].as_str()), (200, Some("kafka")), "{body}");

        // About 200 ms a round: the writer goes on through every flap.
        let rounds = 30;
        let writer = stream_writer(&orders, &admin, rounds, Duration::from_millis(50));
        for _ in 0..4 {
            std::thread::sleep(Duration::from_millis(300));
            cluster.broker_down(1).expect("broker down");
            std::thread::sleep(Duration::from_millis(1_500)); // past the produce timeout (900 ms)
            cluster.broker_up(1).expect("broker up");
        }
        writer.join().unwrap();
        settled(&orders, &admin);
        assert_read_ahead(&orders, &admin, "bus");
        let (_, page) = orders.call("GET", "/v1/subscriptions", Some(&admin), None);
        let failed = lane(&page, "bus").expect("the kafka lane")["failed"].as_u64().unwrap();
        assert!(failed > 0, "no delivery failed while the broker was down: the test proved nothing ({page})");

        let total = FLOWS * rounds;
        let positions = kafka_positions(&bootstrap, "orders", 3, total);
        let mut first_seen: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        let mut seen = BTreeSet::new();
        for (flow, seq) in &positions {
            if seen.insert((flow.clone(), *seq)) {
                first_seen.entry(flow.clone()).or_default().push(*seq);
            }
        }
        assert_eq!(first_seen.len(), FLOWS, "{first_seen:?}");
        for (flow, seqs) in &first_seen {
            // Every seq, first reached in seq order (a flow lives in one partition).
            assert_eq!(seqs, &(1..=rounds as i64).collect::<Vec<_>>(), "{flow} first reached Kafka as {seqs:?}");
        }
        println!("kafka partition: {} records for {total} events, {failed} failed deliveries", positions.len());
    });
}

/// A TLS terminator on loopback in front of `target` (plain HTTP), with a self-signed certificate
/// for `localhost`; the returned PEM is the certificate, which a relay must be told to trust.
fn tls_terminator(target: String) -> (String, String) {
    use std::sync::Arc;
    use tokio_rustls::rustls;
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let pem = certified.cert.pem();
    let cert = certified.cert.der().clone();
    let key = rustls::pki_types::PrivateKeyDer::try_from(certified.key_pair.serialize_der()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert], key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            // Ends with the test process (the thread is detached; every connection is bounded by
            // its peers closing it).
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, target) = (acceptor.clone(), target.clone());
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else { return };
                    let Ok(mut plain) = tokio::net::TcpStream::connect(&target).await else { return };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                });
            }
        });
    });
    (format!("https://localhost:{port}"), pem)
}

/// Delivery to an `https://` endpoint: a relay that trusts the receiver's certificate
/// (`relay.ca_file`) delivers every event once; one that does not refuses the connection, keeps
/// the events pending with the TLS error as the lane's reason, and accepts nothing; a CA file
/// that holds no certificate stops the server at start with `invalid_config`.
#[test]
fn events_cross_over_https_only_to_a_certificate_the_relay_trusts() {
    served_on_both_backends(|| {
        let dir = tempfile::tempdir().unwrap();
        let (ship, ship_token) = shipping(&dir.path().join("shipping"), "127.0.0.1:0");
        let (origin, pem) = tls_terminator(ship.base.trim_start_matches("http://").to_string());
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, &pem).unwrap();
        let endpoint = format!("{origin}/v1/consumers/ledger/inbox");
        let start_orders = |name: &str, ca_file: Option<&Path>| {
            let data = dir.path().join(name);
            let admin = token(&data, "orders", "admin");
            let mut text =
                "[relay]\nattempt_timeout_ms = 2000\nbackoff_base_ms = 50\nbackoff_max_ms = 300\nmax_attempts = 1000\n"
                    .to_string();
            if let Some(ca) = ca_file {
                text.push_str(&format!("ca_file = {:?}\n", ca.to_str().unwrap()));
            }
            text.push_str(&format!("[relay.tokens]\n\"{origin}\" = \"{ship_token}\"\n"));
            let config = data.join("orders.toml");
            std::fs::write(&config, text).unwrap();
            (Server::start(&data, &["--config", config.to_str().unwrap()], &[]), admin)
        };

        // Not trusted: the TLS handshake fails; the events stay pending with the reason.
        let (untrusting, untrusting_token) = start_orders("orders-untrusting", None);
        let (status, body) = subscribe(&untrusting, &untrusting_token, "ledger", &endpoint);
        assert_eq!((status, body["kind"].as_str()), (200, Some("http")), "{body}");
        append(&untrusting, &untrusting_token, "refused", 3);
        let reason = untrusting.wait_for(WAIT, |o| {
            let (_, page) = o.call("GET", "/v1/subscriptions", Some(&untrusting_token), None);
            lane(&page, "ledger").and_then(|l| l["last_error"].as_str().map(str::to_string))
        });
        assert!(reason.contains("ledger/inbox/batch") && reason.contains("certificate"), "{reason}");
        let (_, accepted) =
            untrusting.call("GET", "/v1/outbox?status=accepted&limit=10", Some(&untrusting_token), None);
        assert_eq!(accepted["deliveries"].as_array().map(Vec::len), Some(0), "{accepted}");
        drop(untrusting);

        // Trusted: every event arrives once.
        let (orders, orders_token) = start_orders("orders", Some(&ca));
        let (status, body) = subscribe(&orders, &orders_token, "ledger", &endpoint);
        assert_eq!(status, 200, "{body}");
        for f in 0..5 {
            append(&orders, &orders_token, &format!("secure-{f}"), 2);
        }
        let seen = ship.wait_for(WAIT, |s| {
            let seen = applied(s, &ship_token);
            (seen.keys().filter(|(flow, _)| flow.starts_with("secure-")).count() == 10).then_some(seen)
        });
        assert!(seen.values().all(|&n| n == 1), "{seen:?}");
        assert!(!seen.keys().any(|(flow, _)| flow == "refused"), "the untrusting relay delivered nothing: {seen:?}");

        // A CA file without a certificate: the server does not start.
        let bad = dir.path().join("bad.pem");
        std::fs::write(&bad, "not a certificate\n").unwrap();
        let config = dir.path().join("bad.toml");
        std::fs::write(&config, format!("[relay]\nca_file = {:?}\n", bad.to_str().unwrap())).unwrap();
        let checked = crate::support::run(&["config", "check", "--config", config.to_str().unwrap()]);
        assert_eq!(checked.code, 2, "{}{}", checked.stdout, checked.stderr);
        assert_eq!(checked.json["error"]["code"], "invalid_config", "{}", checked.stdout);
        assert!(checked.stdout.contains("relay.ca_file"), "{}", checked.stdout);
    });
}

/// A fresh consumer schema on the test server, initialised as a consumer (`tidemark init`), and
/// the `postgres://` endpoint that names it; the schema is dropped with the guard.
fn consumer_schema(name: &str) -> Option<(String, DropSchema)> {
    let (base, mut client) = crate::support::postgres_server()?;
    let schema = format!("endpoint_{name}_{}", std::process::id());
    client.batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE")).unwrap();
    let url = crate::support::with_schema(&base, &schema);
    crate::support::ok(&["init", "--consumer-db", &url]);
    Some((url, DropSchema(base, schema)))
}

struct DropSchema(String, String);

impl Drop for DropSchema {
    fn drop(&mut self) {
        if let Ok(mut client) = postgres::Client::connect(&self.0, postgres::NoTls) {
            let _ = client.batch_execute(&format!("DROP SCHEMA IF EXISTS {} CASCADE", self.1));
        }
    }
}

/// The consumer schema's inbox, read with `tidemark snapshot`: (flow, seq) -> copies held.
fn schema_inbox(url: &str) -> BTreeMap<(String, i64), usize> {
    let snapshot = crate::support::ok(&["snapshot", "--consumer-db", url, "--rows-max", "100000"]);
    let mut held = BTreeMap::new();
    for record in snapshot["consumer"]["inbox"].as_array().unwrap() {
        let envelope = &record["envelope"];
        let key = (envelope["flow_id"].as_str().unwrap().to_string(), envelope["seq"].as_i64().unwrap());
        *held.entry(key).or_insert(0) += 1;
    }
    held
}

/// A serving relay writes into a consumer schema on a PostgreSQL server through a `postgres://`
/// endpoint (custody: that schema's inbox transaction), on both backends of the producing
/// service, and is killed at its commit boundary: with read-ahead, the process dies recording a
/// batch the consumer schema already committed (`relay.before_producer_commit`). Restarted on
/// its data, the relay hands those events over again and the schema answers `duplicate`: every
/// event is held once, each flow's seqs complete, nothing pending or quarantined. Before that,
/// what is refused: a password in the endpoint (400 `invalid_endpoint`, nothing subscribed), a
/// user and server the relay's configuration does not list, and a schema that is not a
/// consumer's (each a failed delivery with its reason, nothing written).
#[test]
fn a_serving_relay_writes_into_a_consumer_schema_once_across_a_kill_at_its_commit_boundary() {
    served_on_both_backends(|| {
        if !crate::support::failpoints_enabled() {
            crate::support::skip("the kill at relay.before_producer_commit needs --features failpoints");
            return;
        }
        let Some((endpoint, _schema)) = consumer_schema("ledger") else { return };
        let dir = tempfile::tempdir().unwrap();
        let listed = match tidemark_core::endpoint::Endpoint::parse(&endpoint).unwrap() {
            tidemark_core::endpoint::Endpoint::Postgres { user, server, .. } => format!("{user}@{server}"),
            other => panic!("{other:?}"),
        };
        let config = dir.path().join("orders.toml");
        std::fs::write(
            &config,
            format!(
                "[relay]\nbatch = {PIPELINED_BATCH}\nbackoff_base_ms = 50\nbackoff_max_ms = 500\n\
                 [relay.postgres.\"{listed}\"]\n"
            ),
        )
        .unwrap();
        let args = ["--config", config.to_str().unwrap()];

        // Refused (a service of its own, whose failed deliveries stay pending): a password in
        // the endpoint, before anything is written.
        let refusing_dir = dir.path().join("refusing");
        let admin = token(&refusing_dir, "orders", "admin");
        let mut orders = Server::start(&refusing_dir, &args, &[]);
        let with_password = endpoint.replacen("postgres://postgres@", "postgres://postgres:secret@", 1);
        let (status, body) = subscribe(&orders, &admin, "ledger", &with_password);
        assert_eq!((status, body["error"]["code"].as_str()), (400, Some("invalid_endpoint")), "{body}");
        assert!(!body.to_string().contains("secret"), "{body}");
        // A user the configuration does not list, and a schema that is not a consumer's: the
        // lanes fail with their reasons and write nothing.
        let unlisted = endpoint.replacen("postgres://postgres@", "postgres://intruder@", 1);
        let (base, _) = crate::support::postgres_server().unwrap();
        let missing = crate::support::with_schema(&base, &format!("endpoint_missing_{}", std::process::id()));
        for (consumer, bad) in [("unlisted", &unlisted), ("missing", &missing)] {
            let (status, body) = subscribe(&orders, &admin, consumer, bad);
            assert_eq!((status, body["kind"].as_str()), (200, Some("postgres")), "{body}");
        }
        append(&orders, &admin, "probe", 1);
        for (consumer, reason) in
            [("unlisted", "not a PostgreSQL endpoint this relay writes to"), ("missing", "does not exist")]
        {
            let error = orders.wait_for(WAIT, |o| {
                let (_, page) = o.call("GET", "/v1/subscriptions", Some(&admin), None);
                lane(&page, consumer).and_then(|l| l["last_error"].as_str().map(str::to_string))
            });
            assert!(error.contains(reason), "{consumer}: {error}");
        }
        assert!(schema_inbox(&endpoint).is_empty());
        orders.terminate();

        // The kill at the third record of the lane, a backlog of 20 batches waiting.
        let orders_dir = dir.path().join("orders");
        let admin = token(&orders_dir, "orders", "admin");
        let crash = [("TIDEMARK_CRASH_AT", "relay.before_producer_commit@3")];
        let mut orders = Server::start(&orders_dir, &args, &crash);
        for f in 0..FLOWS {
            append(&orders, &admin, &format!("parcel-{f}"), 6);
        }
        let body = json!({"endpoint": endpoint, "from_start": true});
        let (status, body) = orders.call("PUT", "/v1/subscriptions/ledger", Some(&admin), Some(&body));
        assert_eq!((status, body["kind"].as_str()), (200, Some("postgres")), "{body}");
        assert_eq!(orders.wait_exit(WAIT), 73, "killed at the third record of a lane");
        let before = schema_inbox(&endpoint);
        assert!(before.len() >= 3 * PIPELINED_BATCH, "three batches committed before the kill: {before:?}");

        let orders = Server::start(&orders_dir, &args, &[]);
        settled(&orders, &admin);
        let held = schema_inbox(&endpoint);
        assert!(held.values().all(|&n| n == 1), "an event held twice: {held:?}");
        for f in 0..FLOWS {
            let seqs: BTreeSet<i64> =
                held.keys().filter(|(flow, _)| flow == &format!("parcel-{f}")).map(|(_, seq)| *seq).collect();
            assert_eq!(seqs, (1..=6).collect(), "parcel-{f}");
        }
        let (_, page) = orders.call("GET", "/v1/subscriptions", Some(&admin), None);
        let lane = lane(&page, "ledger").unwrap_or_else(|| panic!("no lane: {page}"));
        assert_eq!(lane["kind"], "postgres", "{lane}");
        assert!(lane["delivered"].as_u64().is_some_and(|n| n > 0), "{lane}");
    });
}
