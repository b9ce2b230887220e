//! The fault VFS (`faultfs`) on real processes: a child process (this test binary, run again
//! as a writer on the VFS) commits rows one transaction at a time and prints each id once its
//! commit returned; it is killed with SIGKILL, the power loss throws away what was not fsynced,
//! and the file is opened again without the VFS. With `durability = full` every printed id is
//! there and the file is sound; with `normal` the same run loses printed ids, as documented (the
//! test has teeth); full disks and I/O errors answer SQLite's typed errors and change nothing.
#![cfg(feature = "failpoints")]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use rusqlite::Connection;
use tidemark_store_sqlite::faultfs::{self, power_loss, PowerLossReport, Writeback};
use tidemark_store_sqlite::{open_connection, Durability};

/// Set in the child: the file it writes and the durability, `path|full` or `path|normal`.
const CHILD_ENV: &str = "FAULTFS_TEST_WRITER";
/// Commits the child acknowledges before the parent kills it. With `normal` it makes no more
/// and waits: far fewer pages than a WAL checkpoint needs, so that none of them was fsynced.
/// With `full` it goes on committing, so that the kill lands in the middle of commits.
const ACKED: usize = 300;
/// Commits the child makes at most with `full` (it is killed long before).
const CHILD_ROWS_MAX: i64 = 1_000_000;
/// How long the child waits to be killed after its last commit (the parent kills it at once).
const CHILD_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// The entry point of the writer child (this binary run again with `FAULTFS_TEST_WRITER`); in
/// the test run itself it returns at once.
#[test]
fn child_writer() {
    let Ok(spec) = std::env::var(CHILD_ENV) else { return };
    let (path, durability) = spec.rsplit_once('|').expect("path|durability");
    let durability = if durability == "normal" { Durability::Normal } else { Durability::Full };
    let conn = open_connection(Path::new(path), true, durability).expect("open on the VFS");
    assert!(faultfs::active(), "the child runs on the fault VFS");
    conn.execute_batch("CREATE TABLE IF NOT EXISTS acked (id INTEGER PRIMARY KEY, body TEXT NOT NULL)").unwrap();
    let last = if durability == Durability::Full { CHILD_ROWS_MAX } else { ACKED as i64 };
    for id in 1..=last {
        // A body of a few hundred bytes, so that pages fill and the WAL grows.
        conn.execute("INSERT INTO acked (id, body) VALUES (?1, ?2)", rusqlite::params![id, "x".repeat(300)]).unwrap();
        println!("ack {id}");
    }
    std::thread::sleep(CHILD_WAIT);
}

/// Run the writer on the VFS until it acknowledged `ACKED` commits, then SIGKILL it.
fn write_until_killed(db: &Path, state: &Path, durability: &str) -> Vec<i64> {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_writer", "--nocapture", "--test-threads", "1"])
        .env(CHILD_ENV, format!("{}|{durability}", db.display()))
        .env(faultfs::ENV, state)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut acked = Vec::new();
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        // libtest may print its own words before the first line of the child's.
        let line = line.unwrap();
        let Some(Ok(id)) = line.split("ack ").nth(1).map(|n| n.trim().parse::<i64>()) else { continue };
        acked.push(id);
        if acked.len() == ACKED {
            break;
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(acked.len(), ACKED, "the writer stopped early");
    acked
}

/// The ids the file holds after the loss (none when even the table is gone) and whether SQLite
/// finds the file sound.
fn survivors(db: &Path) -> (Vec<i64>, String) {
    let conn = Connection::open(db).unwrap();
    let check: String = conn.query_row("PRAGMA integrity_check", [], |r| r.get(0)).unwrap();
    let has_table: bool =
        conn.query_row("SELECT count(*) > 0 FROM sqlite_master WHERE name = 'acked'", [], |r| r.get(0)).unwrap();
    if !has_table {
        return (Vec::new(), check);
    }
    let mut statement = conn.prepare("SELECT id FROM acked ORDER BY id").unwrap();
    let ids = statement.query_map([], |r| r.get(0)).unwrap().collect::<Result<Vec<i64>, _>>().unwrap();
    (ids, check)
}

fn crash_and_lose_power(durability: &str, writeback: Writeback) -> (Vec<i64>, Vec<i64>, String, PowerLossReport) {
    let dir = tempfile::tempdir().unwrap();
    let (db, state) = (dir.path().join("data").join("app.db"), dir.path().join("faultfs"));
    std::fs::create_dir_all(db.parent().unwrap()).unwrap();
    let acked = write_until_killed(&db, &state, durability);
    let report = power_loss(&state, writeback).unwrap();
    let left: Vec<_> = std::fs::read_dir(&state).unwrap().collect();
    assert!(left.is_empty(), "the power loss leaves the state folder clean: {left:?}");
    let (ids, check) = survivors(&db);
    (acked, ids, check, report)
}

#[test]
fn with_durability_full_a_power_loss_keeps_every_acknowledged_commit() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    for writeback in [Writeback::Nothing, Writeback::Prefix(1), Writeback::Prefix(2)] {
        let (acked, ids, check, report) = crash_and_lose_power("full", writeback);
        println!("full, {writeback:?}: {} acknowledged, {} rows after the loss, {report:?}", acked.len(), ids.len());
        assert_eq!(check, "ok", "{writeback:?}");
        let missing: Vec<_> = acked.iter().filter(|id| !ids.contains(id)).collect();
        assert!(missing.is_empty(), "{writeback:?}: acknowledged and lost: {missing:?} ({report:?})");
        // The commits the kill interrupted may be gone, never one in the middle.
        assert_eq!(ids, (1..=ids.len() as i64).collect::<Vec<_>>(), "{writeback:?}: {report:?}");
        assert_eq!(report.files_removed, 0, "{writeback:?}: the new file's folder was fsynced: {report:?}");
    }
}

#[test]
fn with_durability_normal_the_same_power_loss_loses_acknowledged_commits() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let (acked, ids, check, report) = crash_and_lose_power("normal", Writeback::Nothing);
    println!("normal, Nothing: {} acknowledged, {} rows after the loss, {report:?}", acked.len(), ids.len());
    assert_eq!(check, "ok");
    let lost = acked.iter().filter(|id| !ids.contains(id)).count();
    // synchronous=NORMAL fsyncs the WAL only at a checkpoint, and 300 small commits are far
    // from the first one: every acknowledged commit was only in the page cache.
    assert_eq!(lost, acked.len(), "{report:?}");
    assert!(report.writes_lost > 0, "{report:?}");
    // A writeback that kept some of the queue keeps a prefix of the commits, in order.
    let (acked, ids, check, report) = crash_and_lose_power("normal", Writeback::Prefix(7));
    println!("normal, Prefix(7): {} acknowledged, {} rows after the loss, {report:?}", acked.len(), ids.len());
    assert_eq!(check, "ok", "{report:?}");
    assert_eq!(ids, acked[..ids.len()], "a prefix of the commits survives: {report:?}");
}

#[test]
fn a_full_disk_and_io_errors_are_sqlite_errors_that_change_nothing_and_end_with_the_fault() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    // In a child of its own: the VFS is the default VFS of the process it is installed in.
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("faultfs");
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_io_errors", "--nocapture", "--test-threads", "1"])
        .env("FAULTFS_TEST_IO", dir.path())
        .env(faultfs::ENV, &state)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("io errors: checked"), "the child ran its checks:\n{stdout}");
}

/// The entry point of the I/O error child (this binary run again with `FAULTFS_TEST_IO`); in the
/// test run itself it returns at once.
#[test]
fn child_io_errors() {
    let Ok(dir) = std::env::var("FAULTFS_TEST_IO") else { return };
    let dir = Path::new(&dir);
    let state = dir.join("faultfs");
    let conn = open_connection(&dir.join("app.db"), true, Durability::Full).unwrap();
    conn.execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY, body TEXT NOT NULL)").unwrap();
    conn.execute("INSERT INTO t (id, body) VALUES (1, 'before')", []).unwrap();
    let insert =
        |id: i64| conn.execute("INSERT INTO t (id, body) VALUES (?1, ?2)", rusqlite::params![id, "y".repeat(8_000)]);
    let count = || conn.query_row("SELECT count(*) FROM t", [], |r| r.get::<_, i64>(0)).unwrap();
    for (control, expected) in [
        (faultfs::FULL, rusqlite::ErrorCode::DiskFull),
        (faultfs::EIO_WRITE, rusqlite::ErrorCode::SystemIoFailure),
        (faultfs::EIO_FSYNC, rusqlite::ErrorCode::SystemIoFailure),
    ] {
        std::fs::write(state.join(control), b"").unwrap();
        let error = insert(100).expect_err(control);
        assert_eq!(error.sqlite_error_code(), Some(expected), "{control}: {error}");
        std::fs::remove_file(state.join(control)).unwrap();
        assert_eq!(count(), 1, "{control}: the failed commit changed nothing");
    }
    // When the fault ends the same connection goes on.
    insert(2).unwrap();
    assert_eq!(count(), 2);
    let check: String = conn.query_row("PRAGMA integrity_check", [], |r| r.get(0)).unwrap();
    assert_eq!(check, "ok");
    println!("io errors: checked");
}
