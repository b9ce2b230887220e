//! PostgreSQL's data folder on the fault layer (issue "Proof under faults"; docs/reliability.md,
//! "PostgreSQL on the layer"): a private server started with the shim preloaded, tidemark's
//! PostgreSQL stores on it (a writer committing business rows with their event, a relay, a drain
//! through a handler with no uniqueness of its own), then power losses, a full disk and failed
//! writes and fsyncs. Each test skips, saying why, where PostgreSQL's server programs are absent.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use postgres::{Client, NoTls};
use tidemark_core::error::codes;
use tidemark_core::flow::AdvanceRequest;
use tidemark_core::policy::RetentionPolicy;
use tidemark_core::reservation::ReservationMachine;
use tidemark_core::store::{ConsumerStore, DrainScope, HandleError, Handler, ProducerStore, Subscription};
use tidemark_core::{Envelope, Error};
use tidemark_engine::{relay_once, RelayOptions};
use tidemark_faultfs::{PowerLossReport, Writeback};
use tidemark_store_postgres::{advance_committed_in, example, ApplyTransaction, PgConsumer, PgEndpoints, PgProducer};

const PRODUCER: &str = "shop";
const CONSUMER: &str = "audit";
/// How long a phase of load runs before its fault, at most (the writer stops sooner on an error).
const LOAD_MS: u64 = 700;
/// Convergence passes of relay and drain after the last fault, at most.
const CONVERGE_PASSES_MAX: usize = 200;

/// A private PostgreSQL server whose data folder is on the fault layer.
struct Server {
    _dir: tempfile::TempDir,
    bin: PathBuf,
    data: PathBuf,
    state: PathBuf,
    shim: PathBuf,
    socket: PathBuf,
    port: u16,
    /// Run the server's programs as the `postgres` user (the tests run as root).
    as_postgres: bool,
}

/// The newest PostgreSQL server programs of the machine (Debian's layout).
fn server_programs() -> Option<PathBuf> {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
        .filter(|(_, bin): &(u32, PathBuf)| bin.join("postgres").exists() && bin.join("initdb").exists())
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin)
}

/// The shim beside this test binary (cargo builds the cdylib for the package's tests).
fn shim_library() -> PathBuf {
    let deps = std::env::current_exe().unwrap().parent().unwrap().to_path_buf();
    let shim = deps.join("libtidemark_faultfs_preload.so");
    assert!(shim.exists(), "the shim was not built beside the test: {}", shim.display());
    shim
}

impl Server {
    /// Create the cluster with `settings` added to its configuration; `None` (after printing
    /// why) where the server programs are absent.
    fn new(settings: &[&str]) -> Option<Server> {
        let Some(bin) = server_programs() else {
            println!("skipped: no PostgreSQL server programs under /usr/lib/postgresql");
            return None;
        };
        // SAFETY: geteuid has no preconditions.
        let as_postgres = unsafe { libc::geteuid() } == 0;
        let dir = tempfile::Builder::new().prefix("tidemark-pg-faults-").tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let (data, state, socket) = (root.join("data"), root.join("state"), root.join("socket"));
        std::fs::create_dir_all(&state).unwrap();
        std::fs::create_dir_all(&socket).unwrap();
        // A copy of the shim in the test's folder: the server's user reads it wherever the
        // checkout is (a library it cannot read is ignored by the loader, with only a warning).
        let shim = root.join("libtidemark_faultfs_preload.so");
        std::fs::copy(shim_library(), &shim).unwrap();
        // The server listens on no TCP address (`listen_addresses = ''`): the port only names
        // its socket file in this test's own folder, so a fixed one cannot collide.
        let port = 5499;
        let server = Server { _dir: dir, bin, data, state, shim, socket, port, as_postgres };
        if as_postgres {
            let status = Command::new("chown").args(["-R", "postgres:postgres"]).arg(&root).status().unwrap();
            assert!(status.success(), "chown the test's folder to postgres");
            std::fs::set_permissions(&root, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        }
        let initdb = server
            .program("initdb")
            .args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync", "-D"])
            .arg(&server.data)
            .output()
            .unwrap();
        assert!(initdb.status.success(), "initdb: {}", String::from_utf8_lossy(&initdb.stderr));
        let mut conf = format!(
            "port = {}\nlisten_addresses = ''\nunix_socket_directories = '{}'\nfsync = on\n",
            server.port,
            server.socket.display()
        );
        for setting in settings {
            conf.push_str(setting);
            conf.push('\n');
        }
        let conf_path = server.data.join("postgresql.conf");
        let mut all = std::fs::read_to_string(&conf_path).unwrap();
        all.push_str(&conf);
        std::fs::write(&conf_path, all).unwrap();
        Some(server)
    }

    /// One of the server's programs, as the `postgres` user when the test runs as root.
    fn program(&self, name: &str) -> Command {
        let path = self.bin.join(name);
        if self.as_postgres {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(path);
            command
        } else {
            Command::new(path)
        }
    }

    /// Start the server on the layer (it must come up, with the shim loaded).
    fn start(&self) {
        let output = self
            .program("pg_ctl")
            .env("LD_PRELOAD", &self.shim)
            .env(tidemark_faultfs::ENV, &self.state)
            .env("TIDEMARK_FAULTFS_ROOT", &self.data)
            .args(["-w", "-t", "60", "-l"])
            .arg(self.data.parent().unwrap().join("server.log"))
            .arg("-D")
            .arg(&self.data)
            .arg("start")
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "pg_ctl start: {}\n{}",
            String::from_utf8_lossy(&output.stdout),
            self.log_tail()
        );
        // The shim is loaded and tracking: the server's writes left undo logs (a library the
        // loader could not preload would leave none, and no fault would happen).
        let tracked = std::fs::read_dir(&self.state)
            .unwrap()
            .flatten()
            .any(|e| e.path().extension().is_some_and(|x| x == "undo"));
        assert!(tracked, "the server runs without the fault shim");
    }

    /// The last lines of the server's log (for failure messages).
    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.data.parent().unwrap().join("server.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// Every process of the server gone at once (SIGQUIT, no checkpoint), then what was not made
    /// durable thrown away: the power went.
    fn power_loss(&self, writeback: Writeback) -> PowerLossReport {
        self.stop_immediate();
        tidemark_faultfs::power_loss(&self.state, writeback).unwrap()
    }

    fn stop_immediate(&self) {
        let _ = self.program("pg_ctl").args(["-m", "immediate", "-w", "-D"]).arg(&self.data).arg("stop").output();
    }

    fn conn(&self) -> String {
        format!("host={} port={} user=postgres dbname=postgres connect_timeout=5", self.socket.display(), self.port)
    }

    fn client(&self) -> Client {
        Client::connect(&self.conn(), NoTls).unwrap()
    }

    /// `pg_amcheck` of every table and index (heap against indexes, parent checks).
    fn amcheck(&self) {
        let output = self
            .program("pg_amcheck")
            .args(["--install-missing", "--heapallindexed", "--parent-check", "-U", "postgres", "-h"])
            .arg(&self.socket)
            .arg("-p")
            .arg(self.port.to_string())
            .arg("postgres")
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "pg_amcheck: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop_immediate();
    }
}

/// The handler: one row per application, with no uniqueness of its own (an event applied twice
/// would show as two rows).
struct Applied;

impl Handler<ApplyTransaction> for Applied {
    fn handle(&mut self, tx: &ApplyTransaction, consumer: &str, event: &Envelope) -> Result<(), HandleError> {
        let insert = format!("INSERT INTO \"{}\".applied (consumer_id, flow_id, seq) VALUES ($1, $2, $3)", tx.schema());
        tx.execute(&insert, &[&consumer, &event.flow_id, &event.seq])
            .map_err(|e| HandleError::Failed(Error::from(e)))?;
        Ok(())
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64
}

/// An order's first advance (its flow is the order).
fn order(order_id: &str) -> AdvanceRequest {
    AdvanceRequest {
        flow_id: order_id.into(),
        expected_seq: 0,
        to_state: "reserved".into(),
        input: serde_json::json!({"quantity": 1}),
        schema_version: 1,
        traceparent: None,
    }
}

/// Commit one order: its business row and its event in one transaction.
fn place(client: &mut Client, order_id: &str) -> tidemark_core::Result<()> {
    let mut tx = client.transaction()?;
    example::insert_order(&mut tx, "p", order_id, 1)?;
    advance_committed_in(&mut tx, "p", &ReservationMachine, &order(order_id), now_ms())?;
    tx.commit()?;
    Ok(())
}

/// The producer, the consumer and their tables on a fresh server.
fn install(server: &Server) {
    let mut producer = PgProducer::init(&server.conn(), "p", PRODUCER).unwrap();
    example::install_orders(producer.client(), "p").unwrap();
    let mut consumer = PgConsumer::init(&server.conn(), "c", RetentionPolicy::default()).unwrap();
    consumer
        .client()
        .batch_execute("CREATE TABLE c.applied (consumer_id text NOT NULL, flow_id text NOT NULL, seq bigint NOT NULL)")
        .unwrap();
    producer.subscribe(&Subscription { consumer_id: CONSUMER.into(), endpoint: "c".into() }, true, 0).unwrap();
}

/// One phase of load until `stop` or the first error of each loop: a writer placing orders
/// (acknowledged ones pushed to `acked`), a relay and a drain. Returns when all three ended.
fn load(
    server: &Server,
    phase: usize,
    acked: &Arc<Mutex<Vec<String>>>,
    stop: &Arc<AtomicBool>,
) -> Vec<std::thread::JoinHandle<()>> {
    let (conn, conn2, conn3) = (server.conn(), server.conn(), server.conn());
    let (acked, stop_w, stop_r, stop_d) = (acked.clone(), stop.clone(), stop.clone(), stop.clone());
    let writer = std::thread::spawn(move || {
        let Ok(mut client) = Client::connect(&conn, NoTls) else { return };
        for i in 0.. {
            let order_id = format!("o{phase}-{i}");
            if stop_w.load(Ordering::Relaxed) || place(&mut client, &order_id).is_err() {
                return;
            }
            acked.lock().unwrap().push(order_id);
        }
    });
    let relay = std::thread::spawn(move || {
        let (Ok(mut producer), mut endpoints) = (PgProducer::open(&conn2, "p"), PgEndpoints::new(&conn2)) else {
            return;
        };
        while !stop_r.load(Ordering::Relaxed) {
            if relay_once(&mut producer, &mut endpoints, &RelayOptions::default(), now_ms(), &mut || 0.5).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    let drain = std::thread::spawn(move || {
        let Ok(mut consumer) = PgConsumer::open(&conn3, "c") else { return };
        while !stop_d.load(Ordering::Relaxed) {
            if consumer.drain(CONSUMER, &DrainScope::All, 100, &mut Applied, now_ms()).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    vec![writer, relay, drain]
}

/// Relay and drain until nothing moves; the applied rows per order.
fn converge(server: &Server) -> std::collections::BTreeMap<String, i64> {
    let mut producer = PgProducer::open(&server.conn(), "p").unwrap();
    let mut endpoints = PgEndpoints::new(&server.conn());
    let mut consumer = PgConsumer::open(&server.conn(), "c").unwrap();
    let mut quiet = 0;
    for pass in 0..CONVERGE_PASSES_MAX {
        // Ten minutes later each pass: every backoff a fault left is due.
        let now = now_ms() + pass as i64 * 600_000;
        let relayed = relay_once(&mut producer, &mut endpoints, &RelayOptions::default(), now, &mut || 0.5).unwrap();
        let drained = consumer.drain(CONSUMER, &DrainScope::All, 1_000, &mut Applied, now).unwrap();
        quiet = if relayed.attempted == 0 && drained.applied == 0 { quiet + 1 } else { 0 };
        if quiet == 3 {
            break;
        }
    }
    assert_eq!(quiet, 3, "relay and drain did not converge in {CONVERGE_PASSES_MAX} passes");
    let rows = consumer.client().query("SELECT flow_id, count(*) FROM c.applied GROUP BY flow_id", &[]).unwrap();
    rows.iter().map(|r| (r.get(0), r.get(1))).collect()
}

/// After the faults: every acknowledged order has its row, every row its event applied exactly
/// once, and no event without its row; returns how many acknowledged orders were lost.
fn check(server: &Server, acked: &[String]) -> usize {
    let orders: std::collections::BTreeSet<String> =
        example::orders(&mut server.client(), "p").unwrap().into_iter().map(|(id, _)| id).collect();
    let applied = converge(server);
    for (flow, times) in &applied {
        assert_eq!(*times, 1, "order {flow} applied {times} times");
        assert!(orders.contains(flow), "an event applied without its order row: {flow}");
    }
    for order in &orders {
        assert_eq!(applied.get(order), Some(&1), "order {order} has its row but its event was not applied once");
    }
    acked.iter().filter(|id| !orders.contains(*id)).count()
}

/// Phases of load, each ended by a power loss drawn from `writebacks`; returns (acknowledged,
/// lost) after recovery.
fn power_losses(server: &Server, writebacks: &[Writeback]) -> (usize, usize) {
    server.start();
    install(server);
    // The schemas durable before the load (with asynchronous commits they would be lost too).
    server.client().batch_execute("CHECKPOINT").unwrap();
    let acked = Arc::new(Mutex::new(Vec::new()));
    let mut unsynced = 0;
    for (phase, writeback) in writebacks.iter().enumerate() {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = load(server, phase, &acked, &stop);
        std::thread::sleep(Duration::from_millis(LOAD_MS));
        let report = server.power_loss(*writeback);
        stop.store(true, Ordering::Relaxed);
        for thread in threads {
            thread.join().unwrap();
        }
        println!("phase {phase}: {writeback:?}: {report:?}");
        unsynced += report.files_with_unsynced_writes;
        server.start();
    }
    assert!(unsynced > 0, "the power losses found nothing unsynced: the layer tracked nothing");
    let acked = acked.lock().unwrap().clone();
    let lost = check(server, &acked);
    (acked.len(), lost)
}

/// With PostgreSQL's durable defaults (`fsync`, `synchronous_commit = on`) no acknowledged order is
/// lost by any power loss: nothing written back, a prefix, reordered writes, torn sectors.
#[test]
fn power_losses_keep_every_acknowledged_commit() {
    let Some(server) = Server::new(&[]) else { return };
    let writebacks = [
        Writeback::Prefix(1),
        Writeback::Reordered { seed: 2, torn: false },
        Writeback::Reordered { seed: 3, torn: true },
        Writeback::Nothing,
    ];
    let (acked, lost) = power_losses(&server, &writebacks);
    println!("{acked} orders acknowledged, {lost} lost");
    assert!(acked > 0, "no order was acknowledged");
    assert_eq!(lost, 0, "acknowledged orders lost");
    server.amcheck();
}

/// The test's teeth: with `synchronous_commit = off` (the commit answers before its WAL is
/// flushed; the WAL writer flushes every 10 s or 64 MiB, far past the phase) the same power
/// loss loses acknowledged orders.
#[test]
fn without_synchronous_commit_a_power_loss_loses_acknowledged_commits() {
    let settings = ["synchronous_commit = off", "wal_writer_delay = 10000ms", "wal_writer_flush_after = 64MB"];
    let Some(server) = Server::new(&settings) else { return };
    let (acked, lost) = power_losses(&server, &[Writeback::Nothing]);
    println!("{acked} orders acknowledged, {lost} lost");
    assert!(acked > 0 && lost > 0, "{acked} acknowledged, {lost} lost: the layer lost nothing unsynced");
}

/// Whether `order_id`'s row is there.
fn has_order(server: &Server, order_id: &str) -> bool {
    example::orders(&mut server.client(), "p").unwrap().iter().any(|(id, _)| id == order_id)
}

/// A full disk: the order that needs a file to grow answers `storage_full`, nothing of it commits;
/// once space returns the same order commits, and everything is applied once.
#[test]
fn a_full_disk_answers_storage_full_and_changes_nothing() {
    let Some(server) = Server::new(&[]) else { return };
    server.start();
    install(&server);
    let mut client = server.client();
    let mut acked = Vec::new();
    for i in 0..20 {
        let id = format!("before-{i}");
        place(&mut client, &id).unwrap();
        acked.push(id);
    }
    std::fs::write(server.state.join(tidemark_faultfs::FULL), b"").unwrap();
    // Orders fit in pages already there until a table or index must grow.
    let mut refused = None;
    for i in 0..5_000 {
        let id = format!("full-{i}");
        match place(&mut client, &id) {
            Ok(()) => acked.push(id),
            Err(error) => {
                assert_eq!(error.code(), codes::STORAGE_FULL, "{error}");
                refused = Some(id);
                break;
            }
        }
    }
    let refused = refused.expect("no order needed the disk to grow in 5,000");
    assert!(!has_order(&server, &refused), "a refused order's row was committed");
    std::fs::remove_file(server.state.join(tidemark_faultfs::FULL)).unwrap();
    place(&mut client, &refused).unwrap();
    acked.push(refused);
    for i in 0..20 {
        let id = format!("after-{i}");
        place(&mut client, &id).unwrap();
        acked.push(id);
    }
    assert_eq!(check(&server, &acked), 0);
    server.amcheck();
}

/// A failed fsync or write of the WAL: PostgreSQL PANICs and stops (it cannot know what reached
/// the disk), and the commit in flight answers `store_unavailable`, never `store` ("rolled
/// back"): it may be committed after the restart. Retrying it with the same expected seq tells.
fn a_failed_io_stops_the_server(control: &str) {
    let Some(server) = Server::new(&[]) else { return };
    server.start();
    install(&server);
    let mut client = server.client();
    place(&mut client, "before").unwrap();
    std::fs::write(server.state.join(control), b"").unwrap();
    let error = place(&mut client, "in-flight").unwrap_err();
    assert_eq!(error.code(), codes::STORE_UNAVAILABLE, "{error}");
    // The server crashed; its own restart fails while the fault lasts. Bring it up without it.
    server.stop_immediate();
    std::fs::remove_file(server.state.join(control)).unwrap();
    server.start();
    let committed = has_order(&server, "in-flight");
    println!("{control}: the order in flight was committed: {committed}");
    let mut client = server.client();
    match place(&mut client, "in-flight") {
        Ok(()) => assert!(!committed, "placed twice"),
        Err(retry) => {
            assert!(committed, "the retry was refused although nothing was committed: {retry}");
        }
    }
    assert_eq!(check(&server, &["before".to_string(), "in-flight".to_string()]), 0);
    server.amcheck();
}

#[test]
fn a_failed_fsync_answers_store_unavailable_and_the_retry_tells_whether_it_committed() {
    a_failed_io_stops_the_server(tidemark_faultfs::EIO_FSYNC);
}

#[test]
fn a_failed_write_answers_store_unavailable_and_the_retry_tells_whether_it_committed() {
    a_failed_io_stops_the_server(tidemark_faultfs::EIO_WRITE);
}
