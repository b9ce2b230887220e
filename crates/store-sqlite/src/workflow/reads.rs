//! Small named reads of a workflow database for tools that watch or check the runtime from
//! outside (`tidemark bench --workflows`), so that they need no SQL of their own.
//!
//! Each is one statement (one snapshot) and never writes. They take a connection rather than
//! the store so that they work on the store's own connection ([`SqliteWorkflows::connection`])
//! as well as on a read-only one ([`crate::open_reader`]: a WAL reader that never waits for the
//! file's writer).

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

    /// `(finished, last_finished_at_ms)`: how many runs have reached a terminal status, and when
    /// the last of them did (ms since the epoch; `None` when none has). Reads the partial index of
    /// finished runs only, so a watcher can poll it often.
    pub fn finished_runs(conn: &Connection) -> Result<(u64, Option<i64>)> {
        let (finished, last): (i64, Option<i64>) = conn
            .prepare_cached("SELECT count(*), max(finished_at_ms) FROM runs WHERE finished_at_ms IS NOT NULL")
            .db()?
            .query_row([], |r| Ok((r.get(0)?, r.get(1)?)))
            .db()?;
        Ok((finished as u64, last))
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
}
