//! A disk probe for benchmarks: how many single-row commits per second this disk sustains with
//! the same pragmas tidemark uses (WAL, `synchronous` from [`Durability`]). This is the ceiling
//! of any one-transaction-per-operation design; group commit is how tidemark goes past it.

use std::path::Path;
use std::time::{Duration, Instant};

use tidemark_core::Result;

use crate::schema::{self, Durability};
use crate::SqlResult;

/// What [`single_row_commits`] measured.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct CommitProbe {
    /// Commits made.
    pub commits: u64,
    /// Wall-clock time they took, in seconds.
    pub seconds: f64,
    /// Commits per second.
    pub commits_per_s: f64,
}

/// Commit one small row per transaction into a scratch table of a fresh file at `path`, up to
/// `commits` times or until `time_max` has passed, and report the rate. `path` must not exist.
pub fn single_row_commits(
    path: &Path,
    durability: Durability,
    commits: u64,
    time_max: Duration,
) -> Result<CommitProbe> {
    if path.exists() {
        return Err(tidemark_core::Error::invalid(
            tidemark_core::error::codes::ALREADY_EXISTS,
            format!("{} already exists; the probe needs a fresh file", path.display()),
        ));
    }
    let conn = schema::open(path, true, durability)?;
    conn.execute_batch("CREATE TABLE probe (id INTEGER PRIMARY KEY, at_ns INTEGER NOT NULL)").db()?;
    let mut insert = conn.prepare("INSERT INTO probe (at_ns) VALUES (?1)").db()?;
    let start = Instant::now();
    let mut done = 0_u64;
    while done < commits {
        // Autocommit: each statement is its own transaction, fsynced with synchronous=FULL.
        insert.execute([start.elapsed().as_nanos() as i64]).db()?;
        done += 1;
        if start.elapsed() >= time_max {
            break;
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    Ok(CommitProbe { commits: done, seconds, commits_per_s: done as f64 / seconds.max(1e-9) })
}

/// What [`inbox_inserts`] measured.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct InsertProbe {
    /// Rows inserted.
    pub rows: u64,
    /// Rows per transaction (the last transaction may hold fewer).
    pub rows_per_transaction: u64,
    /// Wall-clock time they took, in seconds.
    pub seconds: f64,
    /// Rows inserted per second.
    pub rows_per_s: f64,
}

/// Insert `rows` rows shaped like the relay's inbox rows (same table, same indexes, one
/// prepared statement, `per_transaction` rows per transaction) into a fresh file at `path`:
/// the cost of one bare SQLite row write with tidemark's keys, without any protocol logic.
pub fn inbox_inserts(path: &Path, durability: Durability, rows: u64, per_transaction: u64) -> Result<InsertProbe> {
    if path.exists() {
        return Err(tidemark_core::Error::invalid(
            tidemark_core::error::codes::ALREADY_EXISTS,
            format!("{} already exists; the probe needs a fresh file", path.display()),
        ));
    }
    let per_transaction = per_transaction.max(1);
    let mut conn = schema::open(path, true, durability)?;
    let payload = r#"{"amount":1}"#;
    let hash = "0".repeat(64);
    let generation = "1".repeat(32);
    let start = Instant::now();
    let mut done = 0_u64;
    while done < rows {
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate).db()?;
        {
            let mut insert = tx
                .prepare_cached(
                    "INSERT INTO inbox (consumer_id, source, flow_id, seq, event_id, generation, event_type,
                         schema_version, payload, content_hash, created_at_ms, received_at_ms, status, status_at_ms)
                     VALUES ('c1', 'bench', ?1, 1, ?2, ?3, 'reservation.reserved', 1, ?4, ?5, 0, 0, 'pending', 0)",
                )
                .db()?;
            let end = (done + per_transaction).min(rows);
            for i in done..end {
                insert
                    .execute(rusqlite::params![format!("g-{i:08}"), format!("{i:032x}"), generation, payload, hash])
                    .db()?;
            }
            done = end;
        }
        tx.commit().db()?;
    }
    let seconds = start.elapsed().as_secs_f64();
    Ok(InsertProbe {
        rows: done,
        rows_per_transaction: per_transaction,
        seconds,
        rows_per_s: done as f64 / seconds.max(1e-9),
    })
}
