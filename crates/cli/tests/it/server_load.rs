//! `tidemark serve` under load from a separate process (`tidemark loadtest`): the issue's
//! acceptance test (64 clients for 30 s: no 5xx, every accepted request in the database), a
//! kill -9 of the server mid-load (nothing accepted is lost; the restarted server finishes the
//! runs that were in flight), `/metrics` after load, and the OpenTelemetry export. No assertion
//! is about wall-clock time; waits are bounded polls.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::server_support::{token, Server};
use crate::support::{path_str, run, BIN};

/// A server configuration for load: no token is throttled, leases are short so that a restarted
/// server takes the crashed one's runs over soon.
const LOAD_CONFIG: &str = "[auth]\nrate_per_second = 1000000\nburst = 10000000\n[workers]\nlease_ms = 3000\n";

struct LoadSetup {
    _dir: tempfile::TempDir,
    data: PathBuf,
    config: PathBuf,
    ledger: PathBuf,
    operate: String,
    admin: String,
}

fn setup() -> LoadSetup {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let config = dir.path().join("tidemark.toml");
    std::fs::write(&config, LOAD_CONFIG).expect("config");
    let operate = token(&data, "load", "operate");
    let admin = token(&data, "load", "admin");
    let ledger = dir.path().join("ledger.jsonl");
    LoadSetup { data, config, ledger, operate, admin, _dir: dir }
}

impl LoadSetup {
    fn start_server(&self) -> Server {
        Server::start(&self.data, &["--config", path_str(&self.config)], &[])
    }

    /// `tidemark loadtest` against `server`, as a child process.
    fn spawn_load(&self, server: &Server, clients: u32, duration_s: u32) -> Child {
        Command::new(BIN)
            .args(["loadtest", "--server", &server.base, "--token", &self.operate, "--admin-token", &self.admin])
            .args(["--clients", &clients.to_string(), "--duration-s", &duration_s.to_string()])
            .args(["--ledger", path_str(&self.ledger), "--prefix", "lt"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn tidemark loadtest")
    }

    fn verify(&self) -> Value {
        let store = match crate::server_support::store_of(&self.data) {
            Some(url) => ["--store".to_string(), url],
            None => ["--data".to_string(), path_str(&self.data).to_string()],
        };
        let r =
            run(&["loadtest", "verify", &store[0], &store[1], "--tenant", "load", "--ledger", path_str(&self.ledger)]);
        assert!(r.code == 0 || r.code == 1, "verify failed to run:\n{}\n{}", r.stdout, r.stderr);
        r.json
    }

    fn ledger_lines(&self) -> usize {
        std::fs::read_to_string(&self.ledger).map(|text| text.lines().count()).unwrap_or(0)
    }
}

/// Wait for the load to end (it ends at its deadline; bounded) and read its summary.
fn finish_load(child: Child) -> Value {
    let output = child.wait_with_output().expect("wait for the load test");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        output.status.code(),
        Some(0),
        "loadtest failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_str(&stdout).expect("the load test prints JSON")
}

/// One series' value in a Prometheus text page.
fn series(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// The sum of every series of a metric whose labels contain `labels`.
fn sum_series(text: &str, metric: &str, labels: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{metric}{{")) && l.contains(labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Poll `verify` until no run of the ledger is still in flight (bounded).
fn until_runs_end(setup: &LoadSetup) -> Value {
    let started = Instant::now();
    loop {
        let report = setup.verify();
        if report["runs_unfinished"] == 0 {
            return report;
        }
        assert!(started.elapsed() < Duration::from_secs(300), "runs did not end: {report}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn sixty_four_clients_for_thirty_seconds_get_no_5xx_and_every_accepted_request_is_stored() {
    crate::server_support::served_on_both_backends(|| {
        let setup = setup();
        let server = setup.start_server();
        let summary = finish_load(setup.spawn_load(&server, 64, 30));
        println!("tidemark loadtest: {summary:#}");
        assert_eq!(summary["server_errors"], 0, "{summary:#}");
        assert_eq!(summary["connection_errors"], 0, "{summary:#}");
        assert_eq!(summary["unexpected_answers"], 0, "{summary:#}");
        assert_eq!(summary["rate_limited"], 0, "{summary:#}");
        let accepted = &summary["accepted"];
        for op in ["starts", "advances", "appends"] {
            assert!(accepted[op].as_u64().unwrap() > 0, "no {op} accepted: {summary:#}");
        }
        assert_eq!(summary["ledger_entries"], accepted["total"], "{summary:#}");
        assert_eq!(summary["requests"], accepted["total"], "every request was accepted: {summary:#}");

        // Every accepted request is in the database: runs exist, events are in the outbox with the
        // event id the server answered.
        let report = setup.verify();
        assert_eq!(report["check"]["passed"], true, "{report:#}");
        assert_eq!(report["runs"], accepted["starts"], "{report:#}");
        assert_eq!(
            report["events"].as_u64(),
            Some(accepted["advances"].as_u64().unwrap() + accepted["appends"].as_u64().unwrap())
        );

        // The metrics saw the same load.
        let (status, text) = server.text("/metrics");
        assert_eq!(status, 200);
        let started = sum_series(&text, "tidemark_http_requests_total", "route=\"/v1/runs\",status=\"201\"");
        assert_eq!(started as u64, accepted["starts"].as_u64().unwrap(), "{text}");
        assert_eq!(sum_series(&text, "tidemark_http_requests_total", "status=\"5"), 0.0);
        assert!(sum_series(&text, "tidemark_step_seconds_count", "tenant=\"load\"") > 0.0, "{text}");
        assert!(sum_series(&text, "tidemark_runs", "tenant=\"load\"") >= started, "{text}");
        assert!(series(&text, "tidemark_outbox_pending{tenant=\"load\"}").is_some(), "{text}");
        if crate::workflow_cli::postgres_base().is_none() {
            // Files only: the write-ahead log of each SQLite file, and SQLite's busy waits.
            assert!(sum_series(&text, "tidemark_wal_bytes", "file=\"producer.db\"") > 0.0, "{text}");
            assert!(series(&text, "tidemark_sqlite_busy_events_total").is_some(), "{text}");
        }
    });
}

#[test]
fn a_server_killed_mid_load_loses_no_accepted_request_and_finishes_the_runs_in_flight() {
    crate::server_support::served_on_both_backends(|| {
        let setup = setup();
        let mut server = setup.start_server();
        let load = setup.spawn_load(&server, 64, 10);
        // Mid-load: once the server has accepted a few hundred requests.
        let started = Instant::now();
        while setup.ledger_lines() < 300 {
            assert!(started.elapsed() < Duration::from_secs(60), "the load did not get going");
            std::thread::sleep(Duration::from_millis(20));
        }
        server.kill9();
        let summary = finish_load(load);
        println!("tidemark loadtest (server killed): {summary:#}");
        assert!(summary["connection_errors"].as_u64().unwrap() > 0, "the server died under load: {summary:#}");
        assert_eq!(summary["server_errors"], 0, "{summary:#}");
        assert_eq!(summary["unexpected_answers"], 0, "{summary:#}");

        // Nothing the dead server accepted is lost; the runs it held leases on were in flight.
        let after_crash = setup.verify();
        assert_eq!(after_crash["check"]["passed"], true, "{after_crash:#}");
        assert_eq!(after_crash["entries"], summary["ledger_entries"]);
        let in_flight = after_crash["runs_leased"].as_u64().unwrap();

        // The restarted server takes those runs over when their leases expire, and every run ends
        // as its order said: completed, or compensated when the charge was declined.
        let server = setup.start_server();
        let report = until_runs_end(&setup);
        assert_eq!(report["check"]["passed"], true, "{report:#}");
        let by_status = report["runs_by_status"].as_object().unwrap();
        assert!(by_status.keys().all(|s| s == "completed" || s == "compensated"), "{report:#}");
        assert_eq!(report["runs_leased"], 0, "{report:#}");
        let (_, text) = server.text("/metrics");
        let recovered = sum_series(&text, "tidemark_run_recoveries_total", "tenant=\"load\"");
        // At least once: a run whose lease also expires on the restarted server (a stall longer than
        // `workers.lease_ms` on a loaded machine) is recovered again.
        assert!(recovered as u64 >= in_flight, "each run in flight at the crash is recovered: {in_flight}\n{text}");
        println!("runs in flight at the crash: {in_flight}; after restart: {report:#}");
    });
}

/// A stand-in OTLP/HTTP collector: answers 200 to every request and records
/// (request line, content type, body).
fn fake_collector() -> (String, std::sync::mpsc::Receiver<(String, String, Vec<u8>)>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().unwrap();
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().expect("clone"));
            let (mut request_line, mut content_type, mut length) = (String::new(), String::new(), 0_usize);
            if reader.read_line(&mut request_line).is_err() {
                continue;
            }
            loop {
                let mut header = String::new();
                if reader.read_line(&mut header).unwrap_or(0) == 0 || header == "\r\n" {
                    break;
                }
                let (name, value) = header.split_once(':').unwrap_or((&header, ""));
                match name.to_ascii_lowercase().as_str() {
                    "content-length" => length = value.trim().parse().unwrap_or(0),
                    "content-type" => content_type = value.trim().to_string(),
                    _ => {}
                }
            }
            let mut body = vec![0_u8; length.min(16 * 1024 * 1024)];
            let _ = reader.read_exact(&mut body);
            let _ = stream
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n");
            let _ = sender.send((request_line.trim().to_string(), content_type, body));
        }
    });
    (format!("http://{addr}"), receiver)
}

#[cfg(feature = "otel")]
#[test]
fn spans_are_exported_to_an_otlp_collector() {
    let (collector, received) = fake_collector();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let env = [("TIDEMARK_LOG__OTLP_ENDPOINT", collector.as_str()), ("TIDEMARK_LOG__LEVEL", "info")];
    let mut server = Server::start(&data, &[], &env);
    for _ in 0..3 {
        assert_eq!(server.text("/healthz").0, 200);
    }
    // SIGTERM: the spans still batched are exported before the process exits.
    let (code, stderr) = server.terminate();
    assert_eq!(code, 0, "{stderr}");
    let (request_line, content_type, body) =
        received.recv_timeout(Duration::from_secs(60)).expect("the collector got the spans");
    assert_eq!(request_line, "POST /v1/traces HTTP/1.1");
    assert_eq!(content_type, "application/x-protobuf");
    let text = String::from_utf8_lossy(&body);
    assert!(text.contains("tidemark"), "the service name is in the export");
    assert!(text.contains("request") && text.contains("/healthz"), "the request spans are in the export");
}

/// A request's `traceparent` makes its span a child of the caller's trace: the exported span
/// carries the caller's trace id (the 16 bytes, as OTLP's protobuf holds them).
#[cfg(feature = "otel")]
#[test]
fn a_request_span_joins_the_trace_its_traceparent_names() {
    let (collector, received) = fake_collector();
    let dir = tempfile::tempdir().unwrap();
    let env = [("TIDEMARK_LOG__OTLP_ENDPOINT", collector.as_str()), ("TIDEMARK_LOG__LEVEL", "info")];
    let mut server = Server::start(&dir.path().join("data"), &[], &env);
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let response = server
        .client
        .get(format!("{}/healthz", server.base))
        .header("traceparent", format!("00-{trace_id}-00f067aa0ba902b7-01"))
        .send()
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let (code, stderr) = server.terminate();
    assert_eq!(code, 0, "{stderr}");
    let bytes: Vec<u8> = (0..16).map(|i| u8::from_str_radix(&trace_id[2 * i..2 * i + 2], 16).unwrap()).collect();
    let mut exported = Vec::new();
    while let Ok((_, _, body)) = received.recv_timeout(Duration::from_secs(if exported.is_empty() { 60 } else { 2 })) {
        exported.extend(body);
    }
    assert!(exported.windows(16).any(|w| w == bytes.as_slice()), "the caller's trace id is in the exported spans");
}

#[cfg(not(feature = "otel"))]
#[test]
fn an_otlp_endpoint_needs_the_otel_feature() {
    let (collector, _received) = fake_collector();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tidemark.toml");
    std::fs::write(&config, format!("[log]\notlp_endpoint = {collector:?}\n")).unwrap();
    let r = run(&["config", "check", "--config", path_str(&config)]);
    assert_eq!(r.code, 2, "{}", r.stdout);
    assert_eq!(r.json["error"]["code"], "invalid_config");
    assert!(r.stdout.contains("otel"), "{}", r.stdout);
}

#[test]
fn loadtest_verify_reports_an_entry_the_database_does_not_hold() {
    let setup = setup();
    let server = setup.start_server();
    let summary = finish_load(setup.spawn_load(&server, 4, 1));
    assert!(summary["ledger_entries"].as_u64().unwrap() > 0, "{summary:#}");
    assert_eq!(setup.verify()["check"]["passed"], true);
    // An event the server never committed, and one with another event id.
    let mut ledger = std::fs::OpenOptions::new().append(true).open(&setup.ledger).unwrap();
    writeln!(ledger, r#"{{"kind":"event","op":"append","flow_id":"lt-s0","seq":999999,"event_id":"x"}}"#).unwrap();
    writeln!(ledger, r#"{{"kind":"run","run_id":"never-started","expect":"completed"}}"#).unwrap();
    drop(ledger);
    let r = run(&[
        "loadtest",
        "verify",
        "--data",
        path_str(&setup.data),
        "--tenant",
        "load",
        "--ledger",
        path_str(&setup.ledger),
    ]);
    assert_eq!(r.code, 1, "a lost entry fails the check: {}", r.stdout);
    assert_eq!(r.json["outcome"], "lost");
    assert_eq!(r.json["problems"], 2, "{}", r.stdout);
    // A ledger that is not one, and a tenant that has no files, are refused as bad input.
    std::fs::write(&setup.ledger, "not json\n").unwrap();
    let bad = run(&[
        "loadtest",
        "verify",
        "--data",
        path_str(&setup.data),
        "--tenant",
        "load",
        "--ledger",
        path_str(&setup.ledger),
    ]);
    assert_eq!((bad.code, bad.json["error"]["code"].as_str()), (2, Some("invalid_argument")), "{}", bad.stdout);
    let none = run(&[
        "loadtest",
        "verify",
        "--data",
        path_str(&setup.data),
        "--tenant",
        "nobody",
        "--ledger",
        path_str(&setup.ledger),
    ]);
    assert_eq!(none.json["error"]["code"], "not_initialized", "{}", none.stdout);
    drop(server);
}

#[test]
fn loadtest_refuses_bad_arguments_before_sending_anything() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = dir.path().join("l.jsonl");
    for (args, code) in [
        (vec!["loadtest", "--token", "t", "--ledger", path_str(&ledger)], "invalid_argument"),
        (vec!["loadtest", "--server", "http://127.0.0.1:9", "--token", "t", "--clients", "0"], "limit_exceeded"),
        (vec!["loadtest", "--server", "http://127.0.0.1:9", "--token", "t", "--mix", "1:1"], "invalid_argument"),
        (vec!["loadtest", "--server", "ftp://x", "--token", "t"], "invalid_argument"),
    ] {
        let r = run(&args);
        assert_eq!((r.code, r.json["error"]["code"].as_str()), (2, Some(code)), "{args:?}: {}", r.stdout);
    }
    assert!(!ledger.exists(), "nothing was written");
}
