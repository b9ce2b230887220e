//! `tidemark experiment`: reproduce every scenario of `docs/scenarios.md` (the seed protocol's
//! scenarios and what it left undone), each in its own temporary folder, and with `--check`
//! compare each scenario's normalised state with the expected state committed in
//! `expected.json` and check its named assertions.
//!
//! The expected state never holds scheduling winners, PIDs, paths or timings: event ids and
//! producer generations are replaced by stable labels (`shop/order-1/1`, `gen-1`), timestamps
//! are dropped, and the concurrency scenario records counts only.

mod scenarios;
mod world;

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::Args;
use serde_json::{json, Map, Value};
use tidemark_core::error::codes;
use tidemark_core::location::StoreLocation;
use tidemark_core::{Error, Result};

use crate::Context;
use world::{drop_scenario_schemas, Assertion, Place, Sc};

/// The expected states, committed in the repository.
const EXPECTED: &str = include_str!("expected.json");
/// The scenario clock's origin when `--now-ms` is not given (2026-01-01T00:00:00Z). Every
/// scenario derives its explicit clock values from it; no wall clock is read.
const CLOCK_BASE_MS: i64 = 1_767_225_600_000;
/// The largest clock origin accepted (scenarios add up to a few months to it).
const CLOCK_BASE_MAX_MS: i64 = 1_000_000_000_000_000;
/// Differences reported per scenario.
const DIFFERENCES_MAX: usize = 20;
/// The format of `expected.json`.
const EXPECTED_FORMAT: u64 = 1;

const FAILPOINTS: bool = cfg!(feature = "failpoints");
const FAILPOINTS_HINT: &str =
    "build with the failpoints feature: cargo run --release --features failpoints -- experiment --check";

/// The arguments of `tidemark experiment`.
#[derive(Args)]
pub struct ExperimentArgs {
    /// Compare every scenario's state with the expected state and check its assertions; exit 1
    /// on any difference, failed assertion or skipped scenario.
    #[arg(long)]
    check: bool,
    /// Write the full results to this file (created or replaced; its folder must exist).
    #[arg(long)]
    output: Option<PathBuf>,
    /// Run only this scenario (repeatable); with --check only these are compared.
    #[arg(long = "scenario", value_name = "NAME")]
    scenarios: Vec<String>,
    /// Compare with this expected-state file instead of the one built into the binary.
    #[arg(long, value_name = "FILE")]
    expected: Option<PathBuf>,
    /// Write the expected-state file from this run (after an intended change of behaviour).
    #[arg(long, value_name = "FILE", hide = true)]
    write_expected: Option<PathBuf>,
    /// Run every scenario on this PostgreSQL server instead of SQLite files:
    /// `postgres://user@host/db?schema=P` gives scenario N the schemas `P_xN_<store>` (created,
    /// then dropped; leftovers of an interrupted run with those names are dropped first).
    /// Default: SQLite files in temporary folders.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
    /// Internal: run as one of the experiment's dual-write child processes.
    #[arg(long, hide = true)]
    child: Option<String>,
    #[arg(long, hide = true)]
    child_producer: Option<PathBuf>,
}

fn invalid(message: impl Into<String>) -> Error {
    Error::invalid(codes::INVALID_ARGUMENT, message)
}

/// Where the scenarios' stores live.
enum Backend {
    /// SQLite files in a temporary folder per scenario.
    Files,
    /// Schemas `<prefix>_x<N>_<store>` on a PostgreSQL server.
    Postgres { conn: String, prefix: String },
}

/// The longest store name a scenario uses (`producer-backup`), and the longest `_x<N>_` part.
const STORE_SUFFIX_MAX: &str = "_x99_producer_backup";

fn backend(ctx: &Context, store: Option<&str>) -> Result<Backend> {
    let Some(text) = store else { return Ok(Backend::Files) };
    match crate::stores::location(ctx, Path::new(text))? {
        StoreLocation::Sqlite(_) => {
            Err(invalid("--store takes a postgres:// URL; without it the experiment creates its own SQLite files"))
        }
        StoreLocation::Postgres(pg) => {
            tidemark_store_postgres::validate_schema_name(&format!("{}{STORE_SUFFIX_MAX}", pg.schema)).map_err(
                |e| {
                    Error::invalid(
                        codes::INVALID_STORE,
                        format!("the experiment's schemas are <schema>{STORE_SUFFIX_MAX} at the longest: {e}"),
                    )
                },
            )?;
            Ok(Backend::Postgres { conn: pg.conn, prefix: pg.schema })
        }
    }
}

/// What one scenario produced.
struct Outcome {
    def: scenarios::Def,
    /// `ran`, `skipped` or `error`.
    status: &'static str,
    reason: Option<String>,
    state: Value,
    assertions: Vec<Assertion>,
}

impl Outcome {
    fn failed_assertions(&self) -> Vec<&Assertion> {
        self.assertions.iter().filter(|a| !a.passed).collect()
    }

    fn to_json(&self, with_state: bool) -> Value {
        let mut out = json!({
            "name": self.def.name,
            "seed": self.def.seed,
            "title": self.def.title,
            "status": self.status,
            "assertions_passed": self.failed_assertions().is_empty(),
        });
        if let Some(reason) = &self.reason {
            out["reason"] = json!(reason);
        }
        if with_state {
            out["assertions"] = serde_json::to_value(&self.assertions).expect("assertions serialise");
            out["state"] = self.state.clone();
        } else {
            let failed: Vec<&str> = self.failed_assertions().iter().map(|a| a.name.as_str()).collect();
            out["failed_assertions"] = json!(failed);
        }
        out
    }
}

fn run_scenario(ctx: &Context, on: &Backend, index: usize, def: scenarios::Def, t0: i64) -> Outcome {
    if def.failpoints && !FAILPOINTS {
        return Outcome {
            def,
            status: "skipped",
            reason: Some(format!(
                "needs crash points, and this binary was built without the failpoints feature; {FAILPOINTS_HINT}"
            )),
            state: Value::Null,
            assertions: Vec::new(),
        };
    }
    let dir = match tempfile::tempdir() {
        Ok(dir) => dir,
        Err(error) => {
            return Outcome {
                def,
                status: "error",
                reason: Some(format!("cannot create a temporary folder: {error}")),
                state: Value::Null,
                assertions: Vec::new(),
            }
        }
    };
    let place = match on {
        Backend::Files => Place::Files,
        Backend::Postgres { conn, prefix } => {
            let prefix = format!("{prefix}_x{index}");
            if let Err(error) = drop_scenario_schemas(conn, &prefix) {
                return Outcome {
                    def,
                    status: "error",
                    reason: Some(format!("cannot drop the schemas of an earlier run: {error} ({})", error.code())),
                    state: Value::Null,
                    assertions: Vec::new(),
                };
            }
            Place::Postgres { conn: conn.clone(), prefix }
        }
    };
    let mut sc = Sc::new(dir.path(), t0, ctx.durability, place.clone());
    let result = (def.run)(&mut sc, def.param);
    let mut reason = result.as_ref().err().map(|e| sc.labels.text(&format!("{} ({})", e, e.code())));
    let (state, assertions) = sc.finish();
    if let Place::Postgres { conn, prefix } = &place {
        if let Err(error) = drop_scenario_schemas(conn, prefix) {
            reason.get_or_insert_with(|| format!("cannot drop the scenario's schemas: {error} ({})", error.code()));
        }
    }
    Outcome { def, status: if reason.is_some() { "error" } else { "ran" }, reason, state, assertions }
}

/// Differences between an expected and an actual JSON value, as `path: expected X, got Y`
/// lines (at most `DIFFERENCES_MAX`). Empty when they are equal.
pub fn compare(expected: &Value, actual: &Value) -> Vec<String> {
    let mut out = Vec::new();
    diff("", expected, actual, &mut out);
    out
}

fn short(value: &Value) -> String {
    let text = value.to_string();
    if text.len() > 300 {
        format!("{}...", &text[..text.char_indices().nth(300).map_or(text.len(), |(i, _)| i)])
    } else {
        text
    }
}

fn diff(path: &str, expected: &Value, actual: &Value, out: &mut Vec<String>) {
    if out.len() >= DIFFERENCES_MAX {
        return;
    }
    match (expected, actual) {
        (Value::Object(e), Value::Object(a)) => {
            let mut keys: Vec<&String> = e.keys().chain(a.keys()).collect();
            keys.sort();
            keys.dedup();
            for key in keys {
                let here = format!("{path}/{key}");
                match (e.get(key), a.get(key)) {
                    (Some(e), Some(a)) => diff(&here, e, a, out),
                    (Some(e), None) => out.push(format!("{here}: expected {}, missing", short(e))),
                    (None, Some(a)) => out.push(format!("{here}: not expected, got {}", short(a))),
                    (None, None) => {}
                }
                if out.len() >= DIFFERENCES_MAX {
                    return;
                }
            }
        }
        (Value::Array(e), Value::Array(a)) => {
            for index in 0..e.len().max(a.len()) {
                let here = format!("{path}/{index}");
                match (e.get(index), a.get(index)) {
                    (Some(e), Some(a)) => diff(&here, e, a, out),
                    (Some(e), None) => out.push(format!("{here}: expected {}, missing", short(e))),
                    (None, Some(a)) => out.push(format!("{here}: not expected, got {}", short(a))),
                    (None, None) => {}
                }
                if out.len() >= DIFFERENCES_MAX {
                    return;
                }
            }
        }
        _ if expected == actual => {}
        _ => out.push(format!(
            "{}: expected {}, got {}",
            if path.is_empty() { "/" } else { path },
            short(expected),
            short(actual)
        )),
    }
}

/// Check one scenario against its expected entry; `None` when it passes.
fn check_one(outcome: &Outcome, expected: Option<&Value>) -> Option<Value> {
    let mut problems: Vec<String> = Vec::new();
    let mut differences: Vec<String> = Vec::new();
    match outcome.status {
        "skipped" => problems.push(format!("skipped: {}", outcome.reason.as_deref().unwrap_or(""))),
        "error" => problems.push(format!("error: {}", outcome.reason.as_deref().unwrap_or(""))),
        _ => {}
    }
    let failed: Vec<String> = outcome.failed_assertions().iter().map(|a| format!("{}: {}", a.name, a.detail)).collect();
    if outcome.status == "ran" {
        match expected {
            None => problems.push("no expected state for this scenario in the expected file".into()),
            Some(expected) => {
                differences = compare(expected.get("state").unwrap_or(&Value::Null), &outcome.state);
                let names: Vec<&str> = outcome.assertions.iter().map(|a| a.name.as_str()).collect();
                let expected_names: Vec<&str> = expected
                    .get("assertions")
                    .and_then(Value::as_array)
                    .map(|a| a.iter().filter_map(Value::as_str).collect())
                    .unwrap_or_default();
                if names != expected_names {
                    problems.push(format!("assertions differ: expected {expected_names:?}, got {names:?}"));
                }
                if !differences.is_empty() {
                    problems.push(format!("{} state difference(s)", differences.len()));
                }
            }
        }
    }
    if !failed.is_empty() {
        problems.push(format!("{} assertion(s) failed", failed.len()));
    }
    if problems.is_empty() {
        return None;
    }
    Some(json!({
        "scenario": outcome.def.name,
        "reason": problems.join("; "),
        "failed_assertions": failed,
        "differences": differences,
    }))
}

fn check(outcomes: &[Outcome], expected: &Value, selected_all: bool) -> Value {
    let table = expected.get("scenarios").and_then(Value::as_object);
    let mut failed: Vec<Value> =
        outcomes.iter().filter_map(|o| check_one(o, table.and_then(|t| t.get(o.def.name)))).collect();
    if selected_all {
        if let Some(table) = table {
            for name in table.keys() {
                if !outcomes.iter().any(|o| o.def.name == name) {
                    failed.push(json!({
                        "scenario": name,
                        "reason": "expected in the expected file, but this binary has no such scenario",
                    }));
                }
            }
        }
    }
    let skipped = outcomes.iter().filter(|o| o.status == "skipped").count();
    let mut out = json!({"passed": failed.is_empty(), "scenarios": outcomes.len(), "failed": failed});
    if skipped > 0 {
        out["message"] = json!(format!(
            "{skipped} scenario(s) were skipped because this binary was built without the failpoints feature, so the check fails; {FAILPOINTS_HINT}"
        ));
    }
    out
}

/// The expected-state file of a run: per scenario its state and its assertion names.
fn expected_of(outcomes: &[Outcome]) -> Value {
    let mut table = Map::new();
    for outcome in outcomes.iter().filter(|o| o.status == "ran") {
        let names: Vec<&str> = outcome.assertions.iter().map(|a| a.name.as_str()).collect();
        table.insert(outcome.def.name.to_string(), json!({"assertions": names, "state": outcome.state}));
    }
    json!({
        "format": EXPECTED_FORMAT,
        "note": "Expected states of `tidemark experiment --check` (see docs/scenarios.md). Regenerate only after an intended change of behaviour, and review the diff.",
        "scenarios": table,
    })
}

fn create_file(path: &Path, flag: &str) -> Result<std::fs::File> {
    std::fs::File::create(path).map_err(|e| invalid(format!("{flag} {}: cannot create the file: {e}", path.display())))
}

fn write_json(mut file: std::fs::File, path: &Path, value: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).expect("json");
    file.write_all(text.as_bytes())
        .and_then(|_| file.write_all(b"\n"))
        .map_err(|e| Error::io(format!("writing {}: {e}", path.display())))
}

/// Run every scenario (or the hidden `--child` process of one), and with `--check` compare each
/// with its expected state and assertions; a difference, a failed assertion or a skipped scenario
/// makes `check.passed` false (exit 1).
pub fn run(ctx: &Context, args: ExperimentArgs) -> Result<Value> {
    if let Some(mode) = &args.child {
        return world::run_child(mode, args.child_producer.as_deref(), ctx.durability, ctx.now_ms());
    }
    if std::env::var_os("TIDEMARK_CRASH_AT").is_some() {
        return Err(invalid(
            "unset TIDEMARK_CRASH_AT: the experiment arms crash points only in the child processes it starts",
        ));
    }
    let on = backend(ctx, args.store.as_deref())?;
    let mut defs: Vec<(usize, scenarios::Def)> = scenarios::all().into_iter().enumerate().collect();
    let selected_all = args.scenarios.is_empty();
    if !selected_all {
        for name in &args.scenarios {
            if !defs.iter().any(|(_, d)| d.name == name) {
                let names: Vec<&str> = defs.iter().map(|(_, d)| d.name).collect();
                return Err(invalid(format!("unknown scenario {name:?}; scenarios are {}", names.join(", "))));
            }
        }
        defs.retain(|(_, d)| args.scenarios.iter().any(|n| n == d.name));
    }
    let expected: Value = match &args.expected {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| invalid(format!("--expected {}: cannot read it: {e}", path.display())))?;
            serde_json::from_str(&text).map_err(|e| invalid(format!("--expected {}: not JSON: {e}", path.display())))?
        }
        None => serde_json::from_str(EXPECTED).map_err(|e| Error::Invariant(format!("expected.json: {e}")))?,
    };
    if expected.get("format").and_then(Value::as_u64) != Some(EXPECTED_FORMAT) {
        return Err(invalid(format!("the expected-state file must have \"format\": {EXPECTED_FORMAT}")));
    }
    let t0 = ctx.fixed_now_ms.unwrap_or(CLOCK_BASE_MS);
    if !(0..=CLOCK_BASE_MAX_MS).contains(&t0) {
        return Err(invalid(format!("--now-ms for the experiment must be 0..={CLOCK_BASE_MAX_MS}")));
    }
    // Open the output files before running anything: a bad path fails fast with exit 2.
    let output = args.output.as_ref().map(|p| create_file(p, "--output").map(|f| (f, p.clone()))).transpose()?;
    let write_expected =
        args.write_expected.as_ref().map(|p| create_file(p, "--write-expected").map(|f| (f, p.clone()))).transpose()?;

    let mut progress = crate::progress::Progress::start("experiment", defs.len() as u64);
    let mut outcomes: Vec<Outcome> = Vec::with_capacity(defs.len());
    for (index, def) in defs {
        let name = def.name;
        outcomes.push(run_scenario(ctx, &on, index, def, t0));
        progress.advance(1, name);
    }
    progress.finish(&format!("{} scenarios", outcomes.len()));

    let count = |status: &str| outcomes.iter().filter(|o| o.status == status).count();
    let assertions: usize = outcomes.iter().map(|o| o.assertions.len()).sum();
    let assertions_failed: usize = outcomes.iter().map(|o| o.failed_assertions().len()).sum();
    let summary = json!({
        "scenarios": outcomes.len(),
        "ran": count("ran"),
        "skipped": count("skipped"),
        "errors": count("error"),
        "assertions": assertions,
        "assertions_failed": assertions_failed,
    });
    let backend = match on {
        Backend::Files => "sqlite",
        Backend::Postgres { .. } => "postgres",
    };
    let mut full = json!({
        "outcome": "experiment",
        "backend": backend,
        "failpoints": FAILPOINTS,
        "summary": summary,
        "scenarios": outcomes.iter().map(|o| o.to_json(true)).collect::<Vec<_>>(),
    });
    if args.check {
        full["check"] = check(&outcomes, &expected, selected_all);
    }
    if let Some((file, path)) = write_expected {
        write_json(file, &path, &expected_of(&outcomes))?;
    }
    match output {
        Some((file, path)) => {
            write_json(file, &path, &full)?;
            let mut short = json!({
                "outcome": "experiment",
                "backend": backend,
                "failpoints": FAILPOINTS,
                "output": path,
                "summary": full["summary"].clone(),
                "scenarios": outcomes.iter().map(|o| o.to_json(false)).collect::<Vec<_>>(),
            });
            if let Some(check) = full.get("check") {
                short["check"] = check.clone();
            }
            Ok(short)
        }
        None => Ok(full),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_values_have_no_differences() {
        let v = json!({"a": [1, {"b": "x"}], "c": null});
        assert!(compare(&v, &v.clone()).is_empty());
    }

    #[test]
    fn every_kind_of_difference_is_named_by_its_path() {
        let expected = json!({"final": {"effects": ["audit shop/order-1/1: reserved 3"], "horizon_ms": 1}, "gone": 1});
        let actual = json!({"final": {"effects": ["audit shop/order-1/1: reserved 3", "audit shop/order-1/1: reserved 3"], "horizon_ms": 2}, "new": true});
        let differences = compare(&expected, &actual);
        assert_eq!(
            differences,
            [
                "/final/effects/1: not expected, got \"audit shop/order-1/1: reserved 3\"",
                "/final/horizon_ms: expected 1, got 2",
                "/gone: expected 1, missing",
                "/new: not expected, got true",
            ]
        );
    }

    #[test]
    fn differences_are_bounded() {
        let expected = json!((0..100).collect::<Vec<_>>());
        let actual = json!((1..101).collect::<Vec<_>>());
        assert_eq!(compare(&expected, &actual).len(), DIFFERENCES_MAX);
    }

    #[test]
    fn the_built_in_expected_file_covers_every_scenario() {
        let expected: Value = serde_json::from_str(EXPECTED).expect("expected.json is JSON");
        assert_eq!(expected["format"], EXPECTED_FORMAT);
        let table = expected["scenarios"].as_object().expect("scenarios");
        let names: Vec<&str> = scenarios::all().iter().map(|d| d.name).collect();
        let mut sorted = names.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len(), "scenario names are unique");
        for name in &names {
            assert!(table.contains_key(*name), "expected.json has no entry for {name}");
        }
        assert_eq!(table.len(), names.len());
    }

    #[test]
    fn a_tampered_state_fails_the_check() {
        let def = || scenarios::all().into_iter().next().expect("a scenario");
        let state = json!({"final": {"effects": ["audit shop/order-1/1: reserved 100"]}});
        let outcome = Outcome {
            def: def(),
            status: "ran",
            reason: None,
            state: state.clone(),
            assertions: vec![Assertion { name: "a".into(), passed: true, detail: String::new() }],
        };
        let good = json!({"format": 1, "scenarios": {def().name: {"assertions": ["a"], "state": state}}});
        assert_eq!(check(&[outcome], &good, false)["passed"], true);
        let outcome = Outcome {
            def: def(),
            status: "ran",
            reason: None,
            state: json!({"final": {"effects": ["audit shop/order-1/1: reserved 100", "audit shop/order-1/1: reserved 100"]}}),
            assertions: vec![Assertion { name: "a".into(), passed: true, detail: String::new() }],
        };
        let result = check(&[outcome], &good, false);
        assert_eq!(result["passed"], false);
        assert_eq!(result["failed"][0]["scenario"], def().name);
        assert!(result["failed"][0]["differences"][0].as_str().unwrap().starts_with("/final/effects/1"));
    }

    #[test]
    fn a_skipped_scenario_fails_the_check_with_the_hint() {
        let outcome = Outcome {
            def: scenarios::all().into_iter().find(|d| d.failpoints).expect("a crash scenario"),
            status: "skipped",
            reason: Some("no failpoints".into()),
            state: Value::Null,
            assertions: Vec::new(),
        };
        let result = check(&[outcome], &json!({"format": 1, "scenarios": {}}), false);
        assert_eq!(result["passed"], false);
        assert!(result["message"].as_str().unwrap().contains("--features failpoints"));
    }
}
