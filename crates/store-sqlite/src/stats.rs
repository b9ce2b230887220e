//! Counts for operators (the dashboard and `/metrics`): cheap reads over the partial indexes
//! of what is open (backlog, quarantine, open inbox records, runs by status), never a scan of
//! what is settled. Each function is one read transaction on its store's connection.

use std::collections::BTreeMap;
use std::path::Path;

use rusqlite::{Connection, OptionalExtension};
pub use tidemark_core::store::{InboxCounts, OutboxCounts};
use tidemark_core::Result;

use crate::SqlResult;

/// Count the producer's open deliveries as of `now_ms`, in one read.
pub fn outbox_counts(conn: &Connection, now_ms: i64) -> Result<OutboxCounts> {
    // A subscriber's delivery is pending when its position is above the subscriber's cursor and
    // has no exception row (it is due at once), or when its exception row says `pending` (a
    // retry, due at `next_attempt_at_ms`); see schema v4.
    let (implicit, implicit_oldest): (i64, Option<i64>) = conn
        .prepare_cached(
            "SELECT count(*), min(o.created_at_ms) FROM subscriptions s
             JOIN outbox o ON o.position > s.delivered_position AND o.position >= s.from_position
             WHERE NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.position = o.position AND d.consumer_id = s.consumer_id)",
        )
        .db()?
        .query_row([], |r| Ok((r.get(0)?, r.get(1)?)))
        .db()?;
    let (retrying, retrying_due, retrying_oldest): (i64, i64, Option<i64>) = conn
        .prepare_cached(
            "SELECT count(*), coalesce(sum(d.next_attempt_at_ms <= ?1), 0), min(o.created_at_ms)
             FROM deliveries d JOIN outbox o ON o.position = d.position WHERE d.status = 'pending'",
        )
        .db()?
        .query_row([now_ms], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .db()?;
    let quarantined: i64 = conn
        .prepare_cached("SELECT count(*) FROM deliveries WHERE status = 'quarantined'")
        .db()?
        .query_row([], |r| r.get(0))
        .db()?;
    let last_position: i64 =
        conn.prepare_cached("SELECT coalesce(max(position), 0) FROM outbox").db()?.query_row([], |r| r.get(0)).db()?;
    Ok(OutboxCounts::from_parts(
        (implicit, implicit_oldest),
        (retrying, retrying_due, retrying_oldest),
        quarantined,
        last_position,
    ))
}

/// Open inbox records per consumer id (consumers with none are absent).
pub fn inbox_counts(conn: &Connection) -> Result<BTreeMap<String, InboxCounts>> {
    let mut stmt = conn
        .prepare_cached(
            "SELECT consumer_id, status, count(*) FROM inbox WHERE status IN ('pending', 'blocked')
             GROUP BY consumer_id, status",
        )
        .db()?;
    let rows =
        stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?, r.get::<_, i64>(2)?))).db()?;
    let mut out: BTreeMap<String, InboxCounts> = BTreeMap::new();
    for row in rows {
        let (consumer, status, n) = row.db()?;
        let entry = out.entry(consumer).or_default();
        if status == "pending" {
            entry.pending = n as u64;
        } else {
            entry.blocked = n as u64;
        }
    }
    Ok(out)
}

/// Runs per status (every status present in the file).
pub fn run_counts(conn: &Connection) -> Result<BTreeMap<String, u64>> {
    let mut stmt = conn.prepare_cached("SELECT status, count(*) FROM runs GROUP BY status").db()?;
    let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?))).db()?;
    let mut out = BTreeMap::new();
    for row in rows {
        let (status, n) = row.db()?;
        out.insert(status, n as u64);
    }
    Ok(out)
}

/// Runs not yet finished, per status, and the earliest time one of them is due.
pub fn active_runs(conn: &Connection) -> Result<(BTreeMap<String, u64>, Option<i64>)> {
    let mut stmt = conn
        .prepare_cached(
            "SELECT status, count(*), min(wake_at_ms) FROM runs
             WHERE status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating')
             GROUP BY status ORDER BY status",
        )
        .db()?;
    let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?, r.get::<_, i64>(2)?))).db()?;
    let mut active = BTreeMap::new();
    let mut next_wake_at_ms: Option<i64> = None;
    for row in rows {
        let (status, count, wake) = row.db()?;
        active.insert(status, count as u64);
        next_wake_at_ms = Some(next_wake_at_ms.map_or(wake, |w| w.min(wake)));
    }
    Ok((active, next_wake_at_ms))
}

/// The id of the outbox event at `(flow_id, seq)`, if the outbox holds it (audits such as
/// `tidemark loadtest verify`: an event the producer acknowledged must be here until retention
/// deletes it).
pub fn outbox_event_id(conn: &Connection, flow_id: &str, seq: i64) -> Result<Option<String>> {
    conn.prepare_cached("SELECT event_id FROM outbox WHERE flow_id = ?1 AND seq = ?2")
        .db()?
        .query_row(rusqlite::params![flow_id, seq], |r| r.get(0))
        .optional()
        .db()
}

/// A run's status and whether a worker holds (or held, until it expires) its lease, if the
/// file holds the run (audits: after a crash, the leased runs are the ones in flight).
pub fn run_status(conn: &Connection, run_id: &str) -> Result<Option<(String, bool)>> {
    conn.prepare_cached("SELECT status, lease_owner IS NOT NULL FROM runs WHERE run_id = ?1")
        .db()?
        .query_row([run_id], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()
        .db()
}

/// Bytes of a database file's write-ahead log (0 when there is none).
pub fn wal_bytes(db_path: &Path) -> u64 {
    let mut wal = db_path.as_os_str().to_owned();
    wal.push("-wal");
    std::fs::metadata(wal).map(|m| m.len()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use tidemark_core::flow::AdvanceRequest;
    use tidemark_core::reservation::ReservationMachine;
    use tidemark_core::store::{ProducerStore, Subscription};

    use super::*;
    use crate::SqliteProducer;

    #[test]
    fn outbox_counts_follow_the_deliveries() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.db");
        let mut producer = SqliteProducer::init(&path, "src").unwrap();
        producer.subscribe(&Subscription { consumer_id: "c".into(), endpoint: "nowhere".into() }, false, 1).unwrap();
        let requests: Vec<AdvanceRequest> = (0..3)
            .map(|i| AdvanceRequest {
                flow_id: format!("f{i}"),
                expected_seq: 0,
                to_state: "reserved".into(),
                input: serde_json::json!({"quantity": 1}),
                schema_version: 1,
                traceparent: None,
            })
            .collect();
        producer.advance_batch(&ReservationMachine, &requests, 100).unwrap();
        let counts = outbox_counts(producer.connection(), 1_000_000).unwrap();
        assert_eq!((counts.pending, counts.due, counts.quarantined, counts.last_position), (3, 3, 0, 3));
        assert_eq!(counts.oldest_pending_ms, Some(100));
        assert!(wal_bytes(&path) > 0);
        let event_id = outbox_event_id(producer.connection(), "f1", 1).unwrap().expect("committed");
        assert!(!event_id.is_empty());
        assert_eq!(outbox_event_id(producer.connection(), "f1", 2).unwrap(), None);
        assert_eq!(outbox_event_id(producer.connection(), "f9", 1).unwrap(), None);
    }
}
