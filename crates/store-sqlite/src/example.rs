//! SQL used by the built-in examples and the seed experiments, kept here so that no SQL lives
//! outside store crates.
//!
//! - `orders`: a user's own business table on the producer file, written in the same
//!   transaction as the outbox event (or, in the deliberately wrong dual-write, not).
//! - `forget_dedup_records`: fault injection reproducing seed 002's hand deletion of dedup
//!   history. No tidemark operation does this; the experiment shows the high-water mark still
//!   refuses the replay.

use rusqlite::{params, Connection};
use tidemark_core::Result;

use crate::SqlResult;

/// Create the `orders` table (order id, quantity) on the producer file, if it is not there.
pub fn install_orders(conn: &Connection) -> Result<()> {
    conn.execute_batch("CREATE TABLE IF NOT EXISTS orders (order_id TEXT PRIMARY KEY, quantity INTEGER NOT NULL)").db()
}

/// Insert a business row (inside whatever transaction `conn` is in).
pub fn insert_order(conn: &Connection, order_id: &str, quantity: i64) -> Result<()> {
    conn.execute("INSERT INTO orders (order_id, quantity) VALUES (?1, ?2)", params![order_id, quantity]).db()?;
    Ok(())
}

/// Every order as `(order_id, quantity)`, or nothing when the table does not exist.
pub fn orders(conn: &Connection) -> Result<Vec<(String, i64)>> {
    let exists: bool = conn
        .query_row("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'orders'", [], |r| r.get(0))
        .db()?;
    if !exists {
        return Ok(Vec::new());
    }
    let mut stmt = conn.prepare("SELECT order_id, quantity FROM orders ORDER BY order_id").db()?;
    let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).db()?;
    rows.collect::<rusqlite::Result<Vec<_>>>().db()
}

/// Fault injection: delete a consumer's inbox record and receipt of one (flow, seq) by hand.
pub fn forget_dedup_records(conn: &Connection, consumer_id: &str, flow_id: &str, seq: i64) -> Result<usize> {
    let mut deleted = 0;
    for table in ["inbox", "receipts"] {
        deleted += conn
            .execute(
                &format!("DELETE FROM {table} WHERE consumer_id = ?1 AND flow_id = ?2 AND seq = ?3"),
                params![consumer_id, flow_id, seq],
            )
            .db()?;
    }
    Ok(deleted)
}
