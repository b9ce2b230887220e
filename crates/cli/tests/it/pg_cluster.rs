//! A PostgreSQL cluster of a test's own, created with `initdb` (as the `postgres` user when the
//! test runs as root, which `initdb` refuses) in a temporary folder, on a port of its own, and
//! started and stopped with `pg_ctl`, so that a test may crash it (`pg_ctl stop -m immediate`)
//! without disturbing any other test. Its settings (port, loopback address, socket folder) are in
//! its `postgresql.conf`, so a `pg_ctl start` by another program (`tidemark chaos --kinds
//! db-crash`) starts it the same way.

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::{path_str, skip};

/// The folder of `initdb` and `pg_ctl`: `pg_config --bindir`, else Debian's versioned folders,
/// newest first.
fn pg_bindir() -> Option<PathBuf> {
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if dir.join("initdb").exists() && dir.join("pg_ctl").exists() {
            return Some(dir);
        }
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|bin| bin.join("initdb").exists() && bin.join("pg_ctl").exists())
        .collect();
    versions.sort();
    versions.pop()
}

/// A PostgreSQL cluster of this test's own: its folder, programs and port.
pub struct Cluster {
    dir: tempfile::TempDir,
    bin: PathBuf,
    port: u16,
    /// `initdb` and `postgres` refuse to run as root: run them as this user then.
    run_as: Option<String>,
    running: bool,
}

impl Cluster {
    /// A new cluster (not started); `None`, after saying why, when PostgreSQL's programs or
    /// (as root) the `postgres` user are missing.
    pub fn create() -> Option<Cluster> {
        let Some(bin) = pg_bindir() else {
            skip(
                "PostgreSQL's programs (initdb, pg_ctl) are not installed; a database-crash test needs its own cluster",
            );
            return None;
        };
        let dir = tempfile::tempdir().expect("temp dir");
        let root = std::fs::metadata("/proc/self").map(|m| m.uid() == 0).unwrap_or(false);
        let run_as = root.then(|| "postgres".to_string());
        if let Some(user) = &run_as {
            let id = |flag: &str| -> Option<u32> {
                let out = Command::new("id").args([flag, user]).output().ok()?;
                String::from_utf8_lossy(&out.stdout).trim().parse().ok()
            };
            let (Some(uid), Some(gid)) = (id("-u"), id("-g")) else {
                skip("running as root and there is no `postgres` user to run initdb as");
                return None;
            };
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).expect("chown the cluster folder");
        }
        let port = crate::support::unused_port();
        let cluster = Cluster { dir, bin, port, run_as, running: false };
        let data = cluster.data();
        let out = cluster
            .command("initdb", &["-D", path_str(&data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"])
            .output()
            .expect("run initdb");
        assert!(out.status.success(), "initdb failed: {}", String::from_utf8_lossy(&out.stderr));
        let settings = format!(
            "\nport = {}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\nmax_connections = 100\n",
            cluster.port,
            path_str(cluster.dir.path())
        );
        let conf = data.join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf).expect("postgresql.conf");
        text.push_str(&settings);
        std::fs::write(&conf, text).expect("postgresql.conf");
        Some(cluster)
    }

    /// Its data folder.
    pub fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn command(&self, program: &str, args: &[&str]) -> Command {
        let program = self.bin.join(program);
        let mut command = match &self.run_as {
            Some(user) => {
                let mut c = Command::new("runuser");
                c.args(["-u", user, "--"]).arg(program);
                c
            }
            None => Command::new(program),
        };
        command.args(args).stdin(Stdio::null());
        command
    }

    /// Start the server (`pg_ctl start`) and wait until it answers (bounded).
    pub fn start(&mut self) {
        let log = self.dir.path().join("server.log");
        let out = self
            .command("pg_ctl", &["-D", path_str(&self.data()), "start", "-w", "-t", "60", "-l", path_str(&log)])
            .stdout(Stdio::null())
            .output()
            .expect("run pg_ctl start");
        assert!(out.status.success(), "pg_ctl start failed: {}", String::from_utf8_lossy(&out.stderr));
        self.running = true;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if postgres::Client::connect(&self.conn(), postgres::NoTls).is_ok() {
                return;
            }
            assert!(Instant::now() < deadline, "the test cluster did not answer within 60 s");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `pg_ctl stop -m immediate`: every backend is killed, nothing is flushed or checkpointed;
    /// the next start replays the WAL (crash recovery).
    pub fn crash(&mut self) {
        let out = self.command("pg_ctl", &["-D", path_str(&self.data()), "stop", "-m", "immediate", "-w"]).output();
        let out = out.expect("run pg_ctl");
        assert!(out.status.success(), "pg_ctl stop failed: {}", String::from_utf8_lossy(&out.stderr));
        self.running = false;
    }

    /// The port it listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A connection string to its `postgres` database.
    pub fn conn(&self) -> String {
        format!("host=127.0.0.1 port={} user=postgres dbname=postgres connect_timeout=5", self.port)
    }

    /// The `--store` URL of schema `schema` in its `postgres` database.
    pub fn url(&self, schema: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres?schema={schema}&connect_timeout=5", self.port)
    }
}

impl Drop for Cluster {
    /// Stops the server however it was started (the test's `start`, or another program's
    /// `pg_ctl start`): `pg_ctl status` says whether it runs.
    fn drop(&mut self) {
        let status = self.command("pg_ctl", &["-D", path_str(&self.data()), "status"]).output();
        if self.running || status.is_ok_and(|out| out.status.success()) {
            let _ = self.command("pg_ctl", &["-D", path_str(&self.data()), "stop", "-m", "immediate", "-w"]).output();
        }
    }
}
