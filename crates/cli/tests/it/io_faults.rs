//! A full disk and failed fsyncs under a real `tidemark serve`: the server runs on the fault VFS
//! (`TIDEMARK_FAULTFS`, failpoints builds; docs/reliability.md, "Power loss and I/O errors"),
//! and the test turns a fault on and off by creating and removing its control file. Every
//! request answers a typed error while the fault lasts and changes nothing; once it ends, the
//! same requests succeed and the relay, the drain and the workers go on by themselves: every
//! acknowledged event is applied once, in order, and the run started after the fault completes.

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
