//! The reference order saga's tables (stock, reservations, shipments, and an effects log with
//! no unique constraint, so a step applied twice would show as two rows) and the call log of the
//! fake payment service. The saga itself lives in [`crate::order`]; its
//! transactional steps call these functions inside the journal's transaction.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Value};
use tidemark::rusqlite::{self, params, Connection, OptionalExtension};
use tidemark::sqlite::{open_connection, Durability, Migration};
use tidemark::{Error, Result};

/// The migration that creates the order tables in the workflow database (idempotent: files made
/// before migrations were recorded already have them).
pub fn migration() -> Migration {
    Migration::with("order_tables", install)
}

/// Create the order tables (idempotent).
pub fn install(conn: &Connection) -> Result<()> {
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS order_stock (
             sku   TEXT PRIMARY KEY,
             stock INTEGER NOT NULL CHECK (stock >= 0)
         ) WITHOUT ROWID;
         CREATE TABLE IF NOT EXISTS order_reservations (
             order_id TEXT PRIMARY KEY,
             sku      TEXT NOT NULL,
             quantity INTEGER NOT NULL,
             -- An OR chain, not IN (...): SQLite evaluates a CHECK with an IN list of more than
             -- two constants through a temporary table on every row write.
             status   TEXT NOT NULL CHECK (status = 'reserved' OR status = 'released' OR status = 'shipped')
         ) WITHOUT ROWID;
         CREATE TABLE IF NOT EXISTS order_effects (
             effect_id INTEGER PRIMARY KEY,
             order_id  TEXT NOT NULL,
             kind      TEXT NOT NULL,
             sku       TEXT NOT NULL,
             quantity  INTEGER NOT NULL
         );",
    )
    .map_err(Error::from)
}

/// Are the order tables there? Cheap enough for every transactional step: once the probe is
/// prepared (the table exists), the connection's statement cache answers without running it.
pub fn is_installed(conn: &Connection) -> bool {
    conn.prepare_cached("SELECT 1 FROM order_effects LIMIT 0").is_ok()
}

/// Set `sku`'s stock to `stock` units (creating the SKU if new). The saga never invents stock: an
/// unknown SKU fails `reserve_inventory` for good.
pub fn set_stock(conn: &Connection, sku: &str, stock: i64) -> Result<()> {
    conn.execute(
        "INSERT INTO order_stock (sku, stock) VALUES (?1, ?2) ON CONFLICT (sku) DO UPDATE SET stock = excluded.stock",
        params![sku, stock],
    )?;
    Ok(())
}

/// The units of `sku` in stock, or `None` for an unknown SKU.
pub fn stock(conn: &Connection, sku: &str) -> Result<Option<i64>> {
    conn.prepare_cached("SELECT stock FROM order_stock WHERE sku = ?1")?
        .query_row([sku], |r| r.get(0))
        .optional()
        .map_err(Error::from)
}

/// What [`reserve`] found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReserveOutcome {
    /// The quantity was taken out of stock and the reservation recorded (with a `reserve` effect).
    Reserved {
        /// The SKU's stock after the reservation, in units.
        stock_left: i64,
    },
    /// The SKU is not in `order_stock`: nothing was changed.
    UnknownSku,
    /// The SKU has less stock than asked: nothing was changed.
    Insufficient {
        /// The SKU's stock, in units.
        stock: i64,
    },
    /// The order already has a reservation (in any status).
    AlreadyReserved {
        /// The reservation's status (`reserved`, `released` or `shipped`).
        status: String,
    },
}

fn effect(conn: &Connection, order_id: &str, kind: &str, sku: &str, quantity: i64) -> Result<()> {
    conn.prepare_cached("INSERT INTO order_effects (order_id, kind, sku, quantity) VALUES (?1, ?2, ?3, ?4)")?
        .execute(params![order_id, kind, sku, quantity])?;
    Ok(())
}

/// Take `quantity` of `sku` out of stock for `order_id`.
pub fn reserve(conn: &Connection, order_id: &str, sku: &str, quantity: i64) -> Result<ReserveOutcome> {
    // One read: the order's reservation (if any) and the SKU's stock (if the SKU is known).
    let (existing, stock): (Option<String>, Option<i64>) = conn
        .prepare_cached(
            "SELECT (SELECT status FROM order_reservations WHERE order_id = ?1),
                    (SELECT stock FROM order_stock WHERE sku = ?2)",
        )?
        .query_row([order_id, sku], |r| Ok((r.get(0)?, r.get(1)?)))?;
    if let Some(status) = existing {
        return Ok(ReserveOutcome::AlreadyReserved { status });
    }
    let Some(stock) = stock else { return Ok(ReserveOutcome::UnknownSku) };
    if stock < quantity {
        return Ok(ReserveOutcome::Insufficient { stock });
    }
    conn.prepare_cached("UPDATE order_stock SET stock = stock - ?2 WHERE sku = ?1")?.execute(params![sku, quantity])?;
    conn.prepare_cached(
        "INSERT INTO order_reservations (order_id, sku, quantity, status) VALUES (?1, ?2, ?3, 'reserved')",
    )?
    .execute(params![order_id, sku, quantity])?;
    effect(conn, order_id, "reserve", sku, quantity)?;
    Ok(ReserveOutcome::Reserved { stock_left: stock - quantity })
}

/// Put a `reserved` order's quantity back in stock. False when there was nothing to release
/// (no reservation, already released or shipped).
pub fn release(conn: &Connection, order_id: &str) -> Result<bool> {
    let row: Option<(String, i64)> = conn
        .prepare_cached("SELECT sku, quantity FROM order_reservations WHERE order_id = ?1 AND status = 'reserved'")?
        .query_row([order_id], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?;
    let Some((sku, quantity)) = row else { return Ok(false) };
    conn.prepare_cached("UPDATE order_stock SET stock = stock + ?2 WHERE sku = ?1")?.execute(params![sku, quantity])?;
    conn.prepare_cached("UPDATE order_reservations SET status = 'released' WHERE order_id = ?1")?
        .execute([order_id])?;
    effect(conn, order_id, "release", &sku, quantity)?;
    Ok(true)
}

/// Ship a `reserved` order. False when it is not reserved.
pub fn ship(conn: &Connection, order_id: &str) -> Result<bool> {
    let shipped = conn
        .prepare_cached("UPDATE order_reservations SET status = 'shipped' WHERE order_id = ?1 AND status = 'reserved'")?
        .execute([order_id])?;
    if shipped == 0 {
        return Ok(false);
    }
    // The effect row straight from the reservation (another table: no temporary copy).
    conn.prepare_cached(
        "INSERT INTO order_effects (order_id, kind, sku, quantity)
         SELECT order_id, 'ship', sku, quantity FROM order_reservations WHERE order_id = ?1",
    )?
    .execute([order_id])?;
    Ok(true)
}

/// One row of `order_effects`: a change a transactional step applied. The table has no unique
/// constraint, so a step applied twice would show as two rows.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct OrderEffect {
    /// The order the effect belongs to.
    pub order_id: String,
    /// What was done: `reserve`, `release` or `ship`.
    pub kind: String,
    /// The SKU concerned.
    pub sku: String,
    /// The units reserved, released or shipped.
    pub quantity: i64,
}

/// Every effect the order steps applied, in order.
pub fn effects(conn: &Connection) -> Result<Vec<OrderEffect>> {
    let mut stmt =
        conn.prepare("SELECT order_id, kind, sku, quantity FROM order_effects ORDER BY effect_id LIMIT 100000")?;
    let rows = stmt.query_map([], |r| {
        Ok(OrderEffect { order_id: r.get(0)?, kind: r.get(1)?, sku: r.get(2)?, quantity: r.get(3)? })
    })?;
    rows.collect::<rusqlite::Result<Vec<_>>>().map_err(Error::from)
}

/// The status of an order's reservation.
pub fn reservation_status(conn: &Connection, order_id: &str) -> Result<Option<String>> {
    conn.query_row("SELECT status FROM order_reservations WHERE order_id = ?1", [order_id], |r| r.get(0))
        .optional()
        .map_err(Error::from)
}

/// Open (or create) the fake payment service's own database: one row per call it receives.
pub fn open_payments(path: &Path) -> Result<Connection> {
    create_payment_calls(open_connection(path, true, Durability::Full)?)
}

/// The fake payment service's log in memory (for benchmarks that measure tidemark, not the
/// fake's disk).
pub fn open_payments_in_memory() -> Result<Connection> {
    create_payment_calls(Connection::open_in_memory()?)
}

fn create_payment_calls(conn: Connection) -> Result<Connection> {
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS payment_calls (
             call_id         INTEGER PRIMARY KEY,
             idempotency_key TEXT NOT NULL,
             op              TEXT NOT NULL,
             order_id        TEXT NOT NULL,
             amount          INTEGER NOT NULL,
             outcome         TEXT NOT NULL
         );
         CREATE INDEX IF NOT EXISTS payment_calls_key ON payment_calls (idempotency_key);
         CREATE INDEX IF NOT EXISTS payment_calls_order ON payment_calls (order_id);",
    )?;
    Ok(conn)
}

/// One call the fake payment service received (a row of `payment_calls`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PaymentCall {
    /// The idempotency key the saga passed (`{run_id}:{seq}:{step}`): every retry of one step sends
    /// the same key.
    pub idempotency_key: String,
    /// `charge` or `refund`.
    pub op: String,
    /// The order charged or refunded.
    pub order_id: String,
    /// The amount, in the order's minor currency unit (e.g. cents).
    pub amount: i64,
    /// `charged`, `refunded`, `duplicate` (an earlier call with the key succeeded), `declined`,
    /// `unavailable`.
    pub outcome: String,
}

/// Calls received with `key` so far, and whether one of them succeeded.
pub fn payment_history(conn: &Connection, key: &str) -> Result<(i64, bool)> {
    conn.prepare_cached(
        "SELECT count(*), coalesce(max(outcome IN ('charged', 'refunded')), 0) FROM payment_calls
         WHERE idempotency_key = ?1",
    )?
    .query_row([key], |r| Ok((r.get(0)?, r.get::<_, i64>(1)? != 0)))
    .map_err(Error::from)
}

/// Whether the fake payment service ever charged `order_id` (a refund of an order it never
/// charged refunds nothing).
pub fn order_charged(conn: &Connection, order_id: &str) -> Result<bool> {
    conn.prepare_cached("SELECT EXISTS (SELECT 1 FROM payment_calls WHERE order_id = ?1 AND outcome = 'charged')")?
        .query_row([order_id], |r| r.get::<_, bool>(0))
        .map_err(Error::from)
}

/// Append `call` to the fake payment service's log.
pub fn record_payment_call(conn: &Connection, call: &PaymentCall) -> Result<()> {
    conn.prepare_cached(
        "INSERT INTO payment_calls (idempotency_key, op, order_id, amount, outcome) VALUES (?1, ?2, ?3, ?4, ?5)",
    )?
    .execute(params![call.idempotency_key, call.op, call.order_id, call.amount, call.outcome])?;
    Ok(())
}

/// Every call the fake payment service received, in order.
pub fn payment_calls(conn: &Connection) -> Result<Vec<PaymentCall>> {
    let mut stmt = conn.prepare(
        "SELECT idempotency_key, op, order_id, amount, outcome FROM payment_calls ORDER BY call_id LIMIT 100000",
    )?;
    let rows = stmt.query_map([], |r| {
        Ok(PaymentCall {
            idempotency_key: r.get(0)?,
            op: r.get(1)?,
            order_id: r.get(2)?,
            amount: r.get(3)?,
            outcome: r.get(4)?,
        })
    })?;
    rows.collect::<rusqlite::Result<Vec<_>>>().map_err(Error::from)
}

/// The order tables as JSON, at most `rows_max` rows each (empty when they are not installed).
pub fn tables(conn: &Connection, rows_max: usize) -> Result<Value> {
    let installed: i64 =
        conn.query_row("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'order_stock'", [], |r| {
            r.get(0)
        })?;
    if installed == 0 {
        return Ok(json!({"stock": [], "reservations": [], "effects": []}));
    }
    let rows = |query: &str, columns: &[&str]| -> Result<Vec<Value>> {
        let mut stmt = conn.prepare(query)?;
        let rows = stmt.query_map([rows_max as i64], |r| {
            let mut row = serde_json::Map::new();
            for (i, column) in columns.iter().enumerate() {
                let value: rusqlite::types::Value = r.get(i)?;
                row.insert(
                    column.to_string(),
                    match value {
                        rusqlite::types::Value::Integer(n) => json!(n),
                        rusqlite::types::Value::Text(t) => json!(t),
                        _ => Value::Null,
                    },
                );
            }
            Ok(Value::Object(row))
        })?;
        rows.collect::<rusqlite::Result<Vec<_>>>().map_err(Error::from)
    };
    Ok(json!({
        "stock": rows("SELECT sku, stock FROM order_stock ORDER BY sku LIMIT ?1", &["sku", "stock"])?,
        "reservations": rows(
            "SELECT order_id, sku, quantity, status FROM order_reservations ORDER BY order_id LIMIT ?1",
            &["order_id", "sku", "quantity", "status"],
        )?,
        "effects": rows(
            "SELECT effect_id, order_id, kind, sku, quantity FROM order_effects ORDER BY effect_id LIMIT ?1",
            &["effect_id", "order_id", "kind", "sku", "quantity"],
        )?,
    }))
}

/// The reference order saga's business effects (`order_effects`, see [`install`]) per
/// kind (`reserve`, `ship`, ...; kinds with none are absent). Fails if the order tables are
/// not installed in this file.
pub fn order_effect_counts(conn: &Connection) -> Result<BTreeMap<String, u64>> {
    let mut stmt = conn.prepare_cached("SELECT kind, count(*) FROM order_effects GROUP BY kind")?;
    let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))?;
    let mut out = BTreeMap::new();
    for row in rows {
        let (kind, n) = row?;
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
        )?
        .query_row([], |r| r.get(0))?;
    Ok(n as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_release_ship_keep_stock_consistent() {
        let conn = Connection::open_in_memory().unwrap();
        install(&conn).unwrap();
        set_stock(&conn, "sku-1", 5).unwrap();
        assert_eq!(reserve(&conn, "o1", "sku-1", 3).unwrap(), ReserveOutcome::Reserved { stock_left: 2 });
        assert_eq!(reserve(&conn, "o2", "sku-1", 3).unwrap(), ReserveOutcome::Insufficient { stock: 2 });
        assert_eq!(reserve(&conn, "o3", "nope", 1).unwrap(), ReserveOutcome::UnknownSku);
        assert!(matches!(reserve(&conn, "o1", "sku-1", 1).unwrap(), ReserveOutcome::AlreadyReserved { .. }));
        assert!(release(&conn, "o1").unwrap());
        assert!(!release(&conn, "o1").unwrap());
        assert_eq!(stock(&conn, "sku-1").unwrap(), Some(5));
        assert_eq!(reserve(&conn, "o4", "sku-1", 1).unwrap(), ReserveOutcome::Reserved { stock_left: 4 });
        assert!(ship(&conn, "o4").unwrap());
        assert!(!ship(&conn, "o4").unwrap());
        let kinds: Vec<String> = effects(&conn).unwrap().into_iter().map(|e| e.kind).collect();
        assert_eq!(kinds, ["reserve", "release", "reserve", "ship"]);
    }

    #[test]
    fn payment_calls_are_logged_by_key() {
        let dir = tempfile::tempdir().unwrap();
        let conn = open_payments(&dir.path().join("payments.db")).unwrap();
        let call = |outcome: &str| PaymentCall {
            idempotency_key: "r:1:charge_payment".into(),
            op: "charge".into(),
            order_id: "o1".into(),
            amount: 10,
            outcome: outcome.into(),
        };
        assert_eq!(payment_history(&conn, "r:1:charge_payment").unwrap(), (0, false));
        record_payment_call(&conn, &call("unavailable")).unwrap();
        assert_eq!(payment_history(&conn, "r:1:charge_payment").unwrap(), (1, false));
        record_payment_call(&conn, &call("charged")).unwrap();
        assert_eq!(payment_history(&conn, "r:1:charge_payment").unwrap(), (2, true));
        assert_eq!(payment_calls(&conn).unwrap().len(), 2);
    }
}
