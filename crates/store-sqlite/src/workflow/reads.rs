//! Small named reads of a workflow database for tools that watch or check the runtime from
//! outside (`tidemark bench --workflows`), so that they need no SQL of their own.
//!
//! Each is one statement (one snapshot) and never writes. They take a connection rather than
//! the store so that they work on the store's own connection ([`SqliteWorkflows::connection`])
//! as well as on a read-only one ([`crate::open_reader`]: a WAL reader that never waits for the
//! file's writer).

use std::collections::BTreeMap;

use rusqlite::Connection;
use tidemark_core::Result;

use super::SqliteWorkflows;
use crate::SqlResult;

impl SqliteWorkflows {
    /// `(recovered, completed)`: how many runs a worker has taken over from another at least
    /// once (`recoveries > 0`, a recovery after a lost or expired lease), and how many runs are
    /// `completed`, in one read.
    pub fn recovered_and_completed_runs(conn: &Connection) -> Result<(u64, u64)> {
        let (recovered, completed): (i64, i64) = conn
            .prepare_cached(
                "SELECT count(*) FILTER (WHERE recoveries > 0), count(*) FILTER (WHERE status = 'completed')
                 FROM runs",
            )
            .db()?
            .query_row([], |r| Ok((r.get(0)?, r.get(1)?)))
            .db()?;
        Ok((recovered as u64, completed as u64))
    }

    /// `(held, earliest, latest)`: how many runs hold a lease of worker `owner` (held until it
    /// expires, even if the worker is gone), and the earliest and latest expiry of those leases
    /// (ms since the epoch; `None` when it holds none).
    pub fn leases_held_by(conn: &Connection, owner: &str) -> Result<(u64, Option<i64>, Option<i64>)> {
        let (held, earliest, latest): (i64, Option<i64>, Option<i64>) = conn
            .prepare_cached(
                "SELECT count(*), min(lease_expires_at_ms), max(lease_expires_at_ms) FROM runs
                 WHERE lease_owner = ?1",
            )
            .db()?
            .query_row([owner], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .db()?;
        Ok((held as u64, earliest, latest))
    }

    /// The reference order saga's business effects (`order_effects`, see [`crate::order`]) per
    /// kind (`reserve`, `ship`, ...; kinds with none are absent). Fails if the order tables are
    /// not installed in this file.
    pub fn order_effect_counts(conn: &Connection) -> Result<BTreeMap<String, u64>> {
        let mut stmt = conn.prepare_cached("SELECT kind, count(*) FROM order_effects GROUP BY kind").db()?;
        let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?))).db()?;
        let mut out = BTreeMap::new();
        for row in rows {
            let (kind, n) = row.db()?;
            out.insert(kind, n as u64);
        }
        Ok(out)
    }

    /// How many `(order_id, kind)` pairs of the order saga have more than one effect: an effect
    /// applied twice (0 when every step ran exactly once). Fails if the order tables are not
    /// installed in this file.
    pub fn orders_with_duplicate_effects(conn: &Connection) -> Result<u64> {
        let n: i64 = conn
            .prepare_cached(
                "SELECT count(*) FROM (SELECT 1 FROM order_effects GROUP BY order_id, kind HAVING count(*) > 1)",
            )
            .db()?
            .query_row([], |r| r.get(0))
            .db()?;
        Ok(n as u64)
    }
}
