//! `tidemark experiment`: the whole experiment reproduces every scenario and passes its check
//! (with the `failpoints` feature; without it the check must fail and say how to build),
//! `--output` writes the full results, a bad output path is exit 2, and a tampered expected
//! state fails the check.

use serde_json::Value;

use crate::support::{self, path_str, run};

/// The expected states built into the binary.
const EXPECTED: &str = include_str!("../../../lab/src/experiment/expected.json");

fn expected() -> Value {
    serde_json::from_str(EXPECTED).expect("expected.json is JSON")
}

#[test]
fn experiment_check_reproduces_every_scenario() {
    let dir = tempfile::tempdir().expect("tempdir");
    check_every_scenario(&dir, &[], &[path_str(dir.path())]);
}

/// The same scenarios, the same expected states and assertions, on PostgreSQL: every store a
/// schema of its own (`exp<pid>_x<N>_<store>`), dropped at the end.
#[test]
fn experiment_check_reproduces_every_scenario_on_postgres() {
    let Some((base, mut client)) = support::postgres_server() else { return };
    let prefix = format!("exp{}", std::process::id());
    let store = support::with_schema(&base, &prefix);
    let dir = tempfile::tempdir().expect("tempdir");
    check_every_scenario(&dir, &["--store", &store], &[path_str(dir.path()), &prefix]);
    let left: i64 = client
        .query_one("SELECT count(*) FROM pg_namespace WHERE starts_with(nspname, $1)", &[&prefix])
        .expect("count schemas")
        .get(0);
    assert_eq!(left, 0, "the experiment drops the schemas it created");
}

/// Run `experiment --check` with `args`; every scenario must run and pass, and the results must
/// not show any of `hidden` (temporary paths, schema names).
fn check_every_scenario(dir: &tempfile::TempDir, args: &[&str], hidden: &[&str]) {
    let output = dir.path().join("results.json");
    let mut command = vec!["experiment", "--check", "--output", path_str(&output)];
    command.extend_from_slice(args);
    let r = run(&command);
    if !support::failpoints_enabled() {
        assert_eq!(r.code, 1, "without failpoints the check must fail:\n{}", r.stdout);
        let message = r.json["check"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("--features failpoints"), "{message}");
        support::skip("experiment --check needs --features failpoints (checked that it fails and says so)");
        return;
    }
    assert_eq!(r.code, 0, "experiment --check failed:\n{}\n{}", r.stdout, r.stderr);
    let backend = if args.is_empty() { "sqlite" } else { "postgres" };
    assert_eq!(r.json["backend"], backend);
    let scenarios = expected()["scenarios"].as_object().expect("scenarios").len();
    assert_eq!(r.json["check"]["passed"], true);
    assert_eq!(r.json["check"]["scenarios"], scenarios);
    assert_eq!(r.json["summary"]["skipped"], 0);
    assert_eq!(r.json["summary"]["assertions_failed"], 0);

    let full: Value =
        serde_json::from_str(&std::fs::read_to_string(&output).expect("the output file")).expect("JSON results");
    let results = full["scenarios"].as_array().expect("scenarios");
    assert_eq!(results.len(), scenarios);
    for scenario in results {
        assert_eq!(scenario["status"], "ran", "{}", scenario["name"]);
        assert!(scenario["state"]["final"].is_object(), "{} has a final state", scenario["name"]);
        let assertions = scenario["assertions"].as_array().expect("assertions");
        assert!(!assertions.is_empty(), "{} has assertions", scenario["name"]);
        assert!(assertions.iter().all(|a| a["passed"] == true), "{}", scenario["name"]);
    }
    let text = std::fs::read_to_string(&output).expect("the output file");
    for hidden in hidden {
        assert!(!text.contains(hidden), "results hold no {hidden}");
    }
}

#[test]
fn output_writes_the_full_results_of_the_chosen_scenarios() {
    let dir = tempfile::tempdir().expect("tempdir");
    let output = dir.path().join("one.json");
    let r = run(&["experiment", "--scenario", "duplicate_delivery", "--output", path_str(&output)]);
    r.assert_exit(0);
    assert!(r.json.get("check").is_none(), "no check without --check");
    let full: Value = serde_json::from_str(&std::fs::read_to_string(&output).expect("written")).expect("JSON");
    let scenario = &full["scenarios"][0];
    assert_eq!(scenario["name"], "duplicate_delivery");
    assert_eq!(scenario["state"], expected()["scenarios"]["duplicate_delivery"]["state"]);
}

#[test]
fn a_bad_output_path_is_invalid_input() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("no-such-folder").join("results.json");
    let r = run(&["experiment", "--scenario", "duplicate_delivery", "--output", path_str(&missing)]);
    assert_eq!(r.code, 2, "{}", r.stdout);
    assert_eq!(r.json["outcome"], "error");
    assert_eq!(r.json["error"]["code"], "invalid_argument");
    assert!(!missing.exists());
}

/// `--store` takes a PostgreSQL URL whose schema leaves room for the scenarios' schema names,
/// and the server's durability: anything else is refused before a scenario runs.
#[test]
fn a_bad_store_is_refused_before_anything_runs() {
    let long = format!("postgres://postgres@127.0.0.1:5432/test?schema={}", "p".repeat(50));
    let cases: [(&[&str], &str); 4] = [
        (&["--store", "/tmp/experiment.db"], "invalid_argument"),
        (&["--store", "mysql://localhost/x"], "invalid_store"),
        (&["--store", &long], "invalid_store"),
        (&["--durability", "normal", "--store", "postgres://postgres@127.0.0.1:5432/test"], "invalid_argument"),
    ];
    for (args, code) in cases {
        let mut command = vec!["experiment", "--scenario", "duplicate_delivery"];
        if args[0] == "--durability" {
            command = [&args[..2], &command[..], &args[2..]].concat();
        } else {
            command.extend_from_slice(args);
        }
        let r = run(&command);
        assert_eq!(r.code, 2, "{args:?}: {}", r.stdout);
        assert_eq!(r.json["error"]["code"], code, "{args:?}: {}", r.stdout);
    }
}

#[test]
fn a_tampered_expected_state_fails_the_check() {
    let dir = tempfile::tempdir().expect("tempdir");
    let args = |file: &str| -> Vec<String> {
        ["experiment", "--check", "--scenario", "duplicate_delivery", "--expected", file]
            .iter()
            .map(|s| s.to_string())
            .collect()
    };
    let untouched = dir.path().join("expected.json");
    std::fs::write(&untouched, EXPECTED).expect("write");
    let a = args(path_str(&untouched));
    let r = run(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(r.code, 0, "the committed expected state passes:\n{}", r.stdout);

    // Pretend the expected state had a second effect (a double apply): the check must fail
    // and name the difference.
    let mut tampered = expected();
    let effects =
        &mut tampered["scenarios"]["duplicate_delivery"]["state"]["final"]["consumers"]["consumer"]["effects"];
    let first = effects[0].clone();
    effects.as_array_mut().expect("effects").push(first);
    let file = dir.path().join("tampered.json");
    std::fs::write(&file, serde_json::to_vec(&tampered).expect("json")).expect("write");
    let a = args(path_str(&file));
    let r = run(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(r.code, 1, "a tampered expected state must fail:\n{}", r.stdout);
    assert_eq!(r.json["check"]["passed"], false);
    let failed = &r.json["check"]["failed"][0];
    assert_eq!(failed["scenario"], "duplicate_delivery");
    let difference = failed["differences"][0].as_str().unwrap_or_default();
    assert!(difference.starts_with("/final/consumers/consumer/effects/1"), "{difference}");

    // An expected file that drops an assertion fails too.
    let mut fewer = expected();
    fewer["scenarios"]["duplicate_delivery"]["assertions"].as_array_mut().expect("names").pop();
    std::fs::write(&file, serde_json::to_vec(&fewer).expect("json")).expect("write");
    let a = args(path_str(&file));
    let r = run(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(r.code, 1, "{}", r.stdout);
    assert!(r.json["check"]["failed"][0]["reason"].as_str().unwrap_or_default().contains("assertions differ"));
}
