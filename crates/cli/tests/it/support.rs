//! Shared helpers: run the real binary, parse its JSON, make fresh folders.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_tidemark");

/// True when the binary under test was built with the `failpoints` feature.
pub fn failpoints_enabled() -> bool {
    cfg!(feature = "failpoints")
}

/// Print why a test is skipped (visible with `--nocapture` and in CI logs).
pub fn skip(reason: &str) {
    eprintln!("SKIPPED: {reason}");
}

pub struct Run {
    pub code: i32,
    pub json: Value,
    pub stdout: String,
    pub stderr: String,
}

fn finish(output: Output) -> Run {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    let json = serde_json::from_str(&stdout).unwrap_or(Value::Null);
    Run { code: output.status.code().unwrap_or(-1), json, stdout, stderr }
}

/// Run `tidemark ARGS` with optional environment and stdin.
pub fn run_with(args: &[&str], env: &[(&str, &str)], stdin: Option<&[u8]>) -> Run {
    let mut command = Command::new(BIN);
    command.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    command.env_remove("TIDEMARK_CRASH_AT");
    for (key, value) in env {
        command.env(key, value);
    }
    command.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() });
    let mut child = command.spawn().expect("spawn tidemark");
    if let Some(bytes) = stdin {
        use std::io::Write;
        child.stdin.take().expect("stdin").write_all(bytes).expect("write stdin");
    }
    finish(child.wait_with_output().expect("wait for tidemark"))
}

pub fn run(args: &[&str]) -> Run {
    run_with(args, &[], None)
}

/// Run and require exit 0; return the JSON.
pub fn ok(args: &[&str]) -> Value {
    let r = run(args);
    assert_eq!(r.code, 0, "tidemark {args:?} failed:\n{}\n{}", r.stdout, r.stderr);
    r.json
}

pub fn path_str(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// A fresh folder with `producer.db` (source `shop`) and `consumer.db`, with the given
/// consumers subscribed.
pub struct Setup {
    pub dir: tempfile::TempDir,
    pub producer: PathBuf,
    pub consumer: PathBuf,
}

impl Setup {
    pub fn new(consumers: &[&str]) -> Setup {
        let dir = tempfile::tempdir().expect("tempdir");
        let producer = dir.path().join("producer.db");
        let consumer = dir.path().join("consumer.db");
        ok(&["init", "--producer", path_str(&producer), "--source", "shop", "--consumer-db", path_str(&consumer)]);
        for id in consumers {
            ok(&[
                "subscribe",
                "--producer",
                path_str(&producer),
                "--consumer-id",
                id,
                "--endpoint",
                path_str(&consumer),
            ]);
        }
        Setup { dir, producer, consumer }
    }

    pub fn p(&self) -> &str {
        path_str(&self.producer)
    }

    pub fn c(&self) -> &str {
        path_str(&self.consumer)
    }
}

/// The shared PostgreSQL test server as a `--store` URL (`TIDEMARK_TEST_POSTGRES_URL`, default
/// the local one) and a connection to it; `None`, after saying why, when it does not answer.
pub fn postgres_server() -> Option<(String, postgres::Client)> {
    let base = std::env::var("TIDEMARK_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    match postgres::Client::connect(&base, postgres::NoTls) {
        Ok(client) => Some((base, client)),
        Err(error) => {
            skip(&format!("PostgreSQL not reachable at {base}: {error}"));
            None
        }
    }
}

/// The `--store` URL of schema `schema` on the server `base` names.
pub fn with_schema(base: &str, schema: &str) -> String {
    let sep = if base.contains('?') { '&' } else { '?' };
    format!("{base}{sep}schema={schema}")
}
