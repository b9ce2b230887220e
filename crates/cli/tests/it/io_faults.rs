//! A full disk and failed fsyncs under a real `tidemark serve`: the server runs on the fault VFS
//! (`TIDEMARK_FAULTFS`, failpoints builds; docs/reliability.md, "Power loss and I/O errors"),
//! and the test turns a fault on and off by creating and removing its control file. Every
//! request answers a typed error while the fault lasts and changes nothing; once it ends, the
//! same requests succeed and the relay, the drain and the workers go on by themselves: every
//! acknowledged event is applied once, in order, and the run started after the fault completes.
//! And the same on a real file system that fills up (a small tmpfs the test mounts, as root).

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use crate::server_support::{token, Server};
use crate::support;

const WAIT: Duration = Duration::from_secs(60);

fn advance(server: &Server, t: Option<&str>, expected_seq: i64, to: &str) -> (u16, Value) {
    let body = json!({"expected_seq": expected_seq, "to": to, "quantity": 2});
    server.call("POST", "/v1/flows/res-io/advance", t, Some(&body))
}

fn order(run: &str) -> Value {
    json!({"workflow": "order_saga", "run_id": run, "input": {"order_id": run, "sku": "sku-io", "quantity": 1, "amount": 100}})
}

/// The flow's committed seq, read over HTTP.
fn producer_seq(server: &Server, t: Option<&str>) -> i64 {
    let (status, flow) = server.call("GET", "/v1/flows/res-io", t, None);
    assert_eq!(status, 200, "{flow}");
    flow["producer"]["last_seq"].as_i64().unwrap_or_else(|| panic!("no producer seq: {flow}"))
}

#[test]
fn a_full_disk_and_failed_fsyncs_are_typed_errors_that_change_nothing_and_the_service_goes_on_after_them() {
    if !support::failpoints_enabled() {
        support::skip("I/O fault tests need --features failpoints (cargo test --workspace --all-features)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let state = dir.path().join("faultfs");
    let admin = token(&data, "acme", "admin");
    let t = Some(admin.as_str());
    let mut server = Server::start(&data, &[], &[("TIDEMARK_FAULTFS", state.to_str().unwrap())]);
    let (status, body) = server.call("PUT", "/v1/consumers/shipping", t, Some(&json!({"handler": "reservation"})));
    assert_eq!(status, 201, "{body}");
    let (status, body) = server.call("PUT", "/v1/stock/sku-io", t, Some(&json!({"quantity": 10})));
    assert_eq!(status, 200, "{body}");
    let (status, body) = advance(&server, t, 0, "reserved");
    assert_eq!((status, body["outcome"].as_str()), (200, Some("committed")), "{body}");

    // The disk is full: the advance and a start answer 507 storage_full and change nothing.
    std::fs::write(state.join("full"), b"").unwrap();
    let (status, body) = advance(&server, t, 1, "confirmed");
    assert_eq!((status, body["error"]["code"].as_str()), (507, Some("storage_full")), "{body}");
    let (status, body) = server.call("POST", "/v1/runs", t, Some(&order("order-full")));
    assert_eq!((status, body["error"]["code"].as_str()), (507, Some("storage_full")), "{body}");
    // Reads still answer while the disk is full.
    assert_eq!(producer_seq(&server, t), 1);
    let (status, body) = server.call("GET", "/v1/runs/order-full", t, None);
    assert_eq!((status, body["error"]["code"].as_str()), (404, Some("not_found")), "{body}");
    // The background loops meet the full disk too for a while.
    std::thread::sleep(Duration::from_millis(500));
    std::fs::remove_file(state.join("full")).unwrap();

    // The space is back: the same advance succeeds, with the seq the failed one did not take.
    let (status, body) = advance(&server, t, 1, "confirmed");
    assert_eq!((status, body["outcome"].as_str(), body["seq"].as_i64()), (200, Some("committed"), Some(2)), "{body}");

    // fsync fails (EIO): a store error, nothing committed; then it works again.
    std::fs::write(state.join("eio-fsync"), b"").unwrap();
    let (status, body) = advance(&server, t, 2, "released");
    assert_eq!((status, body["error"]["code"].as_str()), (500, Some("store")), "{body}");
    std::thread::sleep(Duration::from_millis(500));
    std::fs::remove_file(state.join("eio-fsync")).unwrap();
    assert_eq!(producer_seq(&server, t), 2, "the failed commit changed nothing");
    let (status, body) = advance(&server, t, 2, "released");
    assert_eq!((status, body["outcome"].as_str(), body["seq"].as_i64()), (200, Some("committed"), Some(3)), "{body}");
    let (status, body) = server.call("POST", "/v1/runs", t, Some(&order("order-after")));
    assert_eq!((status, body["outcome"].as_str()), (201, Some("started")), "{body}");

    // The relay and the drain go on by themselves: the three events are applied, and the run
    // started after the faults completes.
    server.wait_for(WAIT, |s| {
        let (_, flow) = s.call("GET", "/v1/flows/res-io", t, None);
        (flow["consumers"][0]["high_water_seq"] == 3).then_some(())
    });
    server.wait_for(WAIT, |s| {
        let (_, run) = s.call("GET", "/v1/runs/order-after", t, None);
        (run["run"]["status"] == "completed").then_some(())
    });
    let (code, _) = server.terminate();
    assert_eq!(code, 0, "a clean stop after the faults");
    assert_applied_once_in_order(&data.join("tenants").join("acme").join("inbox.db"));
}

/// Every effect row of the flow once, in seq order 1, 2, 3 (read with plain SQLite).
fn assert_applied_once_in_order(inbox: &Path) {
    let conn = rusqlite::Connection::open(inbox).unwrap();
    let mut statement =
        conn.prepare("SELECT seq FROM reservation_effects WHERE flow_id = 'res-io' ORDER BY effect_id").unwrap();
    let seqs: Vec<i64> = statement.query_map([], |r| r.get(0)).unwrap().collect::<Result<_, _>>().unwrap();
    assert_eq!(seqs, [1, 2, 3], "each event applied once, in order");
}

/// A tmpfs of `size` mounted at a new folder of `dir` for the test, unmounted when dropped;
/// `None`, after saying why, where the test cannot mount (not root, no tmpfs).
struct SmallFileSystem {
    at: std::path::PathBuf,
}

impl SmallFileSystem {
    fn mount(dir: &Path, size: &str) -> Option<SmallFileSystem> {
        let at = dir.join("small-fs");
        std::fs::create_dir(&at).unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&at)
            .output();
        match mounted {
            Ok(out) if out.status.success() => Some(SmallFileSystem { at }),
            Ok(out) => {
                support::skip(&format!(
                    "a real full file system needs to mount a tmpfs (root): {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
                None
            }
            Err(e) => {
                support::skip(&format!("a real full file system needs `mount`: {e}"));
                None
            }
        }
    }

    /// Write a filler file until the file system answers ENOSPC; its path.
    fn fill(&self) -> std::path::PathBuf {
        use std::io::Write;
        let filler = self.at.join("filler");
        let mut file = std::fs::File::create(&filler).unwrap();
        let chunk = vec![0_u8; 4096];
        for _ in 0..1_000_000 {
            if let Err(e) = file.write_all(&chunk).and_then(|_| file.flush()) {
                assert_eq!(e.raw_os_error(), Some(28), "the file system filled up: {e}"); // ENOSPC
                return filler;
            }
        }
        panic!("the small file system never filled up");
    }
}

impl Drop for SmallFileSystem {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.at).status();
    }
}

/// Append one stream event to `flow`: `Ok(seq)` when committed, `Err(code)` otherwise.
fn append(server: &Server, t: Option<&str>, flow: &str, n: usize) -> Result<i64, (u16, String)> {
    let body = json!({"event_type": "disk.noted", "payload": {"n": n}});
    let (status, answer) = server.call("POST", &format!("/v1/streams/{flow}/events"), t, Some(&body));
    match (status, answer["seq"].as_i64()) {
        (200, Some(seq)) => Ok(seq),
        _ => Err((status, answer["error"]["code"].as_str().unwrap_or_default().to_string())),
    }
}

/// The data folder on a real file system that fills up (a small tmpfs, not the fault VFS):
/// while it is full, appends answer either `committed` (SQLite reuses space its files already
/// hold) or 507 `storage_full`, never anything else; once the space is back, appends commit
/// again with the seqs the refused ones did not take, and the relay and the drain apply every
/// acknowledged event once, in order, by themselves; the files pass SQLite's integrity check.
#[test]
fn a_real_full_file_system_refuses_writes_with_storage_full_and_loses_nothing_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let Some(fs) = SmallFileSystem::mount(dir.path(), "24m") else { return };
    let data = fs.at.join("data");
    let admin = token(&data, "acme", "admin");
    let t = Some(admin.as_str());
    let mut server = Server::start(&data, &[], &[]);
    let (status, body) = server.call("PUT", "/v1/consumers/ledger", t, Some(&json!({"handler": "record"})));
    assert_eq!(status, 201, "{body}");
    let flows = ["disk-a", "disk-b", "disk-c"];
    let mut acknowledged: Vec<(&str, i64)> = Vec::new();
    for n in 0..30 {
        let flow = flows[n % flows.len()];
        acknowledged.push((flow, append(&server, t, flow, n).expect("an append before the disk fills")));
    }

    // The disk is full: appends go on until a few were refused; each answer is a commit or 507.
    let filler = fs.fill();
    let mut refused = 0;
    for n in 30..2_000 {
        let flow = flows[n % flows.len()];
        match append(&server, t, flow, n) {
            Ok(seq) => acknowledged.push((flow, seq)),
            Err((status, code)) => {
                assert_eq!((status, code.as_str()), (507, "storage_full"), "a full disk is storage_full");
                refused += 1;
                if refused == 5 {
                    break;
                }
            }
        }
    }
    assert_eq!(refused, 5, "the full file system never refused an append: the test proved nothing");
    // Reads still answer; the background loops meet the full disk for a while.
    let (status, body) = server.call("GET", "/v1/flows/disk-a", t, None);
    assert_eq!(status, 200, "{body}");
    std::thread::sleep(Duration::from_millis(500));
    std::fs::remove_file(filler).unwrap();

    // The space is back: appends commit again, each flow's seq right after its last acknowledged.
    for (n, flow) in flows.iter().enumerate() {
        let last = acknowledged.iter().filter(|(f, _)| f == flow).map(|(_, seq)| *seq).max().unwrap_or(0);
        let seq = append(&server, t, flow, 10_000 + n).expect("an append after the space is back");
        assert_eq!(seq, last + 1, "{flow}: a refused append took no seq");
        acknowledged.push((flow, seq));
    }
    let applied = server.wait_for(WAIT, |s| {
        let (_, page) = s.call("GET", "/v1/consumers/ledger/inbox?status=applied&limit=1000", t, None);
        let records = page["records"].as_array().cloned().unwrap_or_default();
        (records.len() >= acknowledged.len()).then_some(records)
    });
    let mut seen: Vec<(String, i64)> = applied
        .iter()
        .map(|r| (r["envelope"]["flow_id"].as_str().unwrap().to_string(), r["envelope"]["seq"].as_i64().unwrap()))
        .collect();
    seen.sort();
    let mut expected: Vec<(String, i64)> = acknowledged.iter().map(|(f, s)| (f.to_string(), *s)).collect();
    expected.sort();
    assert_eq!(seen, expected, "every acknowledged event applied once");
    let (code, _) = server.terminate();
    assert_eq!(code, 0, "a clean stop after the full disk");
    for file in ["producer.db", "inbox.db", "workflows.db"] {
        let path = data.join("tenants").join("acme").join(file);
        let conn = rusqlite::Connection::open_with_flags(&path, rusqlite::OpenFlags::SQLITE_OPEN_READ_WRITE).unwrap();
        let check: String = conn.query_row("PRAGMA integrity_check", [], |r| r.get(0)).unwrap();
        assert_eq!(check, "ok", "{file}");
    }
    println!("real full file system: {} appends acknowledged, {refused} refused with storage_full", acknowledged.len());
}
