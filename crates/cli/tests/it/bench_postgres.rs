//! `tidemark bench --store postgres://...` with tiny sizes: only the exactly-once checks and the
//! JSON's shape are checked, never a rate. Skipped (printing why) when the server of
//! `TIDEMARK_TEST_POSTGRES` does not answer. The bad-input cases need no server.

use serde_json::{json, Value};

use crate::support::run;

/// The test server as a `postgres://` URL (`TIDEMARK_TEST_POSTGRES` may be a URL or a libpq
/// `key=value` string), or `None` after printing why the test is skipped.
fn server_url() -> Option<String> {
    let conn = crate::model_check::postgres_server()?;
    if conn.starts_with("postgres://") || conn.starts_with("postgresql://") {
        return Some(conn);
    }
    let config: postgres::Config = conn.parse().expect("the test server's connection string parses");
    let host = match config.get_hosts().first() {
        Some(postgres::config::Host::Tcp(host)) => host.clone(),
        _ => "127.0.0.1".to_string(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let user = config.get_user().unwrap_or("postgres");
    let password = config.get_password().map(|p| format!(":{}", String::from_utf8_lossy(p))).unwrap_or_default();
    let dbname = config.get_dbname().unwrap_or("postgres");
    Some(format!("postgres://{user}{password}@{host}:{port}/{dbname}"))
}

/// Schemas whose name starts with `prefix` (none should be left after a run).
fn schemas_left(prefix: &str) -> Vec<String> {
    let conn = crate::model_check::postgres_server().expect("the server answered a moment ago");
    let mut client = postgres::Client::connect(&conn, postgres::NoTls).expect("connect");
    client
        .query("SELECT nspname::text FROM pg_namespace WHERE starts_with(nspname, $1)", &[&prefix])
        .expect("list schemas")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

fn passed(v: &Value) -> bool {
    v["check"]["passed"] == json!(true)
}

#[test]
fn the_workflow_bench_on_postgres_completes_every_saga_exactly_once_and_drops_its_schemas() {
    let Some(url) = server_url() else { return };
    let prefix = format!("bw{}", std::process::id());
    let store = format!("{url}?schema={prefix}");
    let r = run(&[
        "bench",
        "--workflows",
        "--store",
        &store,
        "--sagas",
        "200",
        "--in-flight",
        "50",
        "--latency-sagas",
        "5",
        "--external-latency-ms",
        "1",
        "--resume-sagas",
        "3",
        "--lease-ms",
        "300",
        "--process-sagas",
        "100",
        "--pgbench-seconds",
        "1",
    ]);
    r.assert_exit(0);
    let out = &r.json;
    assert!(passed(out), "{out:#}");
    let throughput = &out["throughput"]["runs"][0];
    assert!(passed(throughput), "{out:#}");
    assert_eq!(throughput["check"]["completed"], json!(200), "{out:#}");
    assert_eq!(throughput["check"]["reserve_effects"], json!(200));
    assert_eq!(throughput["check"]["ship_effects"], json!(200));
    assert_eq!(throughput["check"]["charged_keys"], json!(200));
    assert_eq!(throughput["check"]["orders_with_duplicate_effects"], json!(0));
    assert_eq!(out["children"]["check"]["passed"], json!(true), "{out:#}");
    assert_eq!(out["queued"]["check"]["passed"], json!(true), "{out:#}");
    assert_eq!(out["resumption"]["worker"]["recovered"], json!(3), "{out:#}");
    for processes in ["one", "two"] {
        let run = &out["worker_processes"][processes];
        assert!(passed(run), "{processes}: {out:#}");
        assert_eq!(run["check"]["completed"], json!(100), "{processes}: {out:#}");
        assert!(run["sagas_per_s"].is_number(), "{out:#}");
    }
    assert_eq!(out["worker_processes"]["two"]["workers"].as_array().map(Vec::len), Some(2), "{out:#}");
    assert!(out["worker_processes"]["two_to_one_ratio"].is_number(), "{out:#}");
    let summary = &out["summary"];
    assert!(summary["sagas_per_s"].is_number(), "{out:#}");
    assert!(summary["targets"].is_object(), "{out:#}");
    // pgbench is optional: its ceilings are numbers, or the output says why they are missing.
    let ceilings = &out["ceilings"];
    assert!(ceilings["one_client"]["commits_per_s"].is_number() || ceilings["skipped"].is_string(), "{out:#}");
    assert_eq!(out["server"]["synchronous_commit"], json!("on"), "the server's durability is used as is: {out:#}");
    assert!(!r.stdout.contains(":secret@"), "no password is printed");
    assert_eq!(schemas_left(&prefix), Vec::<String>::new(), "every schema of the run is dropped");
}

#[test]
fn the_pipeline_bench_on_postgres_applies_every_event_exactly_once() {
    let Some(url) = server_url() else { return };
    let prefix = format!("bp{}", std::process::id());
    let store = format!("{url}?schema={prefix}");
    let r = run(&[
        "bench",
        "--store",
        &store,
        "--flows",
        "100",
        "--batch",
        "50",
        "--baseline-flows",
        "5",
        "--consumers",
        "2",
        "--pgbench-seconds",
        "1",
    ]);
    r.assert_exit(0);
    let out = &r.json;
    assert!(passed(out), "{out:#}");
    for kind in ["group_commit", "pipelined"] {
        let run = &out[kind]["runs"][0];
        assert_eq!(run["events"], json!(300), "{kind}: {out:#}");
        assert_eq!(run["check"]["effects"], json!(600), "{kind}: {out:#}");
        assert_eq!(run["check"]["duplicate_effects"], json!(0), "{kind}: {out:#}");
    }
    assert_eq!(out["one_per_op"]["runs"][0]["check"]["effects"], json!(30), "{out:#}");
    assert!(out["summary"]["end_to_end_events_per_s"].is_number(), "{out:#}");
    assert_eq!(schemas_left(&prefix), Vec::<String>::new(), "every schema of the run is dropped");
}

#[test]
fn a_bench_store_of_another_scheme_or_an_unreachable_server_is_a_typed_error() {
    for args in [
        &["bench", "--workflows", "--store", "mysql://h/db"][..],
        &["bench", "--store", "mysql://h/db"],
        &["bench", "--workflows", "--store", "sqlite:/tmp/x.db"],
        &["bench", "--store", "postgres://postgres@127.0.0.1/test?schema=Not-A-Name"],
    ] {
        let r = run(args);
        assert_eq!(r.code, 2, "{args:?}: {}\n{}", r.stdout, r.stderr);
        assert_eq!(r.json["error"]["code"], json!("invalid_store"), "{args:?}: {}", r.stdout);
    }
    // Port 1 on loopback: nothing listens there. The server is asked before anything is made.
    let store = "postgres://postgres:secret@127.0.0.1:1/test?schema=bench&connect_timeout=2";
    for args in [&["bench", "--workflows", "--store", store][..], &["bench", "--store", store]] {
        let r = run(args);
        assert_eq!(r.code, 1, "{args:?}: {}\n{}", r.stdout, r.stderr);
        assert_eq!(r.json["error"]["code"], json!("io"), "{args:?}: {}", r.stdout);
        assert!(r.stdout.contains("cannot connect to PostgreSQL"), "{}", r.stdout);
        assert!(!r.stdout.contains("secret"), "the password is never printed: {}", r.stdout);
    }
}
