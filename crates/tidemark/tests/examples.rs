//! Every example is built by `cargo test` (examples are test targets' siblings) and run here as
//! a real process on a fresh data folder: a broken example fails CI. Each runs its own story
//! over real HTTP (or in process) and exits non-zero when an outcome is not what it expects; its
//! last stdout line is a JSON summary checked here too.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

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
