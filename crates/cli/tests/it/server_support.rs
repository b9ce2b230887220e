//! Running the real `tidemark serve` in a child process and talking to it over real HTTP.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::{ok, path_str, BIN};

/// A `tidemark serve` child process on a loopback port chosen by the OS.
pub struct Server {
    pub child: Option<Child>,
    /// Everything the server wrote to stderr so far (read by a thread, so the pipe never fills).
    pub stderr: std::sync::Arc<std::sync::Mutex<String>>,
    pub base: String,
    pub data: PathBuf,
    pub client: reqwest::blocking::Client,
}

/// Create a token; returns its text.
pub fn token(data: &Path, tenant: &str, scope: &str) -> String {
    let out = ok(&["token", "create", "--data", path_str(data), "--tenant", tenant, "--scope", scope]);
    out["token"].as_str().expect("token text").to_string()
}

impl Server {
    /// Start `tidemark serve --data DATA --listen 127.0.0.1:0 EXTRA` and wait (bounded) for its
    /// "listening" line.
    pub fn start(data: &Path, extra: &[&str], env: &[(&str, &str)]) -> Server {
        Self::start_at(data, "127.0.0.1:0", extra, env)
    }

    /// [`Server::start`] on the address `listen` (to restart a server where its peers expect it).
    pub fn start_at(data: &Path, listen: &str, extra: &[&str], env: &[(&str, &str)]) -> Server {
        let mut command = Command::new(BIN);
        command
            .args(["serve", "--data", path_str(data), "--listen", listen])
            .args(extra)
            .env_remove("TIDEMARK_CRASH_AT")
            .env("TIDEMARK_LOG__LEVEL", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (key, value) in env {
            command.env(key, value);
        }
        let mut child = command.spawn().expect("spawn tidemark serve");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        // read_line returns when the server prints its first line or exits.
        stdout.read_line(&mut line).expect("read the listening line");
        let first: Value = match serde_json::from_str(&line) {
            Ok(value) => value,
            Err(_) => {
                let mut err = String::new();
                let _ = child.stderr.take().expect("stderr").read_to_string(&mut err);
                let _ = child.kill();
                panic!("tidemark serve did not start: {line}\n{err}");
            }
        };
        assert_eq!(first["outcome"], "listening", "{first}");
        let stderr = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let mut pipe = child.stderr.take().expect("stderr");
        let sink = stderr.clone();
        std::thread::spawn(move || {
            let mut buffer = [0_u8; 4096];
            while let Ok(n) = pipe.read(&mut buffer) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().push_str(&String::from_utf8_lossy(&buffer[..n]));
            }
        });
        // Keep draining stdout in the background so the child never blocks on a full pipe.
        std::thread::spawn(move || {
            let mut rest = String::new();
            let _ = stdout.read_to_string(&mut rest);
        });
        let base = format!("http://{}", first["addr"].as_str().expect("addr"));
        let client = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().expect("client");
        Server { child: Some(child), stderr, base, data: data.to_path_buf(), client }
    }

    /// One request; returns the status and the JSON body (Null when the body is not JSON).
    pub fn call(&self, method: &str, path: &str, token: Option<&str>, body: Option<&Value>) -> (u16, Value) {
        let method = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
        let mut request = self.client.request(method, format!("{}{}", self.base, path));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = request.send().expect("the server answers");
        let status = response.status().as_u16();
        let text = response.text().unwrap_or_default();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// A raw body (for malformed JSON and oversized bodies).
    pub fn call_raw(&self, method: &str, path: &str, token: Option<&str>, body: Vec<u8>) -> (u16, Value) {
        let method = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
        let mut request = self
            .client
            .request(method, format!("{}{}", self.base, path))
            .header("content-type", "application/json")
            .body(body);
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let response = request.send().expect("the server answers");
        let status = response.status().as_u16();
        (status, serde_json::from_str(&response.text().unwrap_or_default()).unwrap_or(Value::Null))
    }

    pub fn text(&self, path: &str) -> (u16, String) {
        let response = self.client.get(format!("{}{}", self.base, path)).send().expect("the server answers");
        (response.status().as_u16(), response.text().unwrap_or_default())
    }

    /// A GET with a bearer token, as text (a dashboard page).
    pub fn text_with(&self, path: &str, token: Option<&str>) -> (u16, String) {
        let mut request = self.client.get(format!("{}{}", self.base, path));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let response = request.send().expect("the server answers");
        (response.status().as_u16(), response.text().unwrap_or_default())
    }

    /// Poll `check` every 20 ms until it returns Some, for at most `limit`.
    pub fn wait_for<T>(&self, limit: Duration, mut check: impl FnMut(&Server) -> Option<T>) -> T {
        let started = Instant::now();
        loop {
            if let Some(value) = check(self) {
                return value;
            }
            assert!(started.elapsed() < limit, "condition not reached within {limit:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// SIGTERM, then wait (bounded) for exit; returns the exit code and the stderr.
    pub fn terminate(&mut self) -> (i32, String) {
        let mut child = self.child.take().expect("running");
        let status = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill");
        assert!(status.success());
        let started = Instant::now();
        loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                std::thread::sleep(Duration::from_millis(50));
                let err = self.stderr.lock().unwrap().clone();
                return (status.code().unwrap_or(-1), err);
            }
            if started.elapsed() > Duration::from_secs(60) {
                let _ = child.kill();
                panic!("tidemark serve did not stop within 60 s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL (a crash), and reap.
    pub fn kill9(&mut self) {
        let mut child = self.child.take().expect("running");
        child.kill().expect("SIGKILL");
        let _ = child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
