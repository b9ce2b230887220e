//! The order tables on PostgreSQL: the same tables, outcomes and effects log as [`super::tables`]
//! on SQLite, in the workflow store's schema. The saga's transactional steps run them through
//! the store's [`ApplyTransaction`] (inside the journal's transaction); `workflow init`,
//! `seed-stock` and the checks run them on a connection of their own.

use std::collections::BTreeMap;

use serde_json::{json, Value};
use tidemark::postgres::client::{self, GenericClient};
use tidemark::postgres::ApplyTransaction;
use tidemark::{Error, Result};

use super::tables::ReserveOutcome;

fn db(error: client::Error) -> Error {
    Error::from(error)
}

/// Create the order tables in `schema` (idempotent). The schema must exist (the workflow store
/// creates it).
pub fn install(conn: &mut impl GenericClient, schema: &str) -> Result<()> {
    conn.batch_execute(&format!(
        r#"CREATE TABLE IF NOT EXISTS "{schema}".order_stock (
               sku   text COLLATE "C" PRIMARY KEY,
               stock bigint NOT NULL CHECK (stock >= 0)
           );
           CREATE TABLE IF NOT EXISTS "{schema}".order_reservations (
               order_id text COLLATE "C" PRIMARY KEY,
               sku      text NOT NULL,
               quantity bigint NOT NULL,
               status   text NOT NULL CHECK (status IN ('reserved', 'released', 'shipped'))
           );
           CREATE TABLE IF NOT EXISTS "{schema}".order_effects (
               effect_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
               order_id  text COLLATE "C" NOT NULL,
               kind      text NOT NULL,
               sku       text NOT NULL,
               quantity  bigint NOT NULL
           );"#
    ))
    .map_err(db)
}

/// The tables as a user migration of a service's workflow database on PostgreSQL (`tidemark
/// serve --store postgres://...`).
pub fn migration() -> tidemark::postgres::Migration {
    tidemark::postgres::Migration::with("order_tables", |tx, schema| install(tx, schema))
}

/// Set `sku`'s stock to `stock` units (creating the SKU if new).
pub fn set_stock(conn: &mut impl GenericClient, schema: &str, sku: &str, stock: i64) -> Result<()> {
    conn.execute(
        &format!(
            r#"INSERT INTO "{schema}".order_stock (sku, stock) VALUES ($1, $2)
               ON CONFLICT (sku) DO UPDATE SET stock = excluded.stock"#
        ),
        &[&sku, &stock],
    )
    .map_err(db)?;
    Ok(())
}

/// The units of `sku` in stock, or `None` for an unknown SKU.
pub fn stock(conn: &mut impl GenericClient, schema: &str, sku: &str) -> Result<Option<i64>> {
    let row =
        conn.query_opt(&format!(r#"SELECT stock FROM "{schema}".order_stock WHERE sku = $1"#), &[&sku]).map_err(db)?;
    Ok(row.map(|r| r.get(0)))
}

fn effect(tx: &ApplyTransaction, order_id: &str, kind: &str, sku: &str, quantity: i64) -> Result<()> {
    let insert = tx
        .prepare_cached(&format!(
            r#"INSERT INTO "{}".order_effects (order_id, kind, sku, quantity) VALUES ($1, $2, $3, $4)"#,
            tx.schema()
        ))
        .map_err(db)?;
    tx.execute(&insert, &[&order_id, &kind, &sku, &quantity]).map_err(db)?;
    Ok(())
}

/// Take `quantity` of `sku` out of stock for `order_id` (as [`super::tables::reserve`]), in one
/// statement: an order reserved already answers its reservation's status; else the stock row is
/// updated only while it holds enough (the `UPDATE` takes the row's lock, so two workers reserving
/// the same SKU at once take turns, the second deciding on what the first left), and the
/// reservation and its effect are written from what the update returned.
pub fn reserve(tx: &ApplyTransaction, order_id: &str, sku: &str, quantity: i64) -> Result<ReserveOutcome> {
    let s = tx.schema();
    let reserve = tx
        .prepare_cached(&format!(
            r#"WITH prior AS (SELECT status FROM "{s}".order_reservations WHERE order_id = $1),
               taken AS (
                   UPDATE "{s}".order_stock SET stock = stock - $3
                   WHERE sku = $2 AND stock >= $3 AND NOT EXISTS (SELECT 1 FROM prior)
                   RETURNING stock),
               reserved AS (
                   INSERT INTO "{s}".order_reservations (order_id, sku, quantity, status)
                   SELECT $1, $2, $3, 'reserved' FROM taken),
               effect AS (
                   INSERT INTO "{s}".order_effects (order_id, kind, sku, quantity)
                   SELECT $1, 'reserve', $2, $3 FROM taken)
               SELECT (SELECT status FROM prior), (SELECT stock FROM taken),
                      (SELECT stock FROM "{s}".order_stock WHERE sku = $2)"#
        ))
        .map_err(db)?;
    let row = tx.query_one(&reserve, &[&order_id, &sku, &quantity]).map_err(db)?;
    let (prior, left, stock): (Option<String>, Option<i64>, Option<i64>) = (row.get(0), row.get(1), row.get(2));
    Ok(match (prior, left, stock) {
        (Some(status), _, _) => ReserveOutcome::AlreadyReserved { status },
        (None, Some(stock_left), _) => ReserveOutcome::Reserved { stock_left },
        (None, None, Some(stock)) => ReserveOutcome::Insufficient { stock },
        (None, None, None) => ReserveOutcome::UnknownSku,
    })
}

/// Put a `reserved` order's quantity back in stock; false when there was nothing to release.
pub fn release(tx: &ApplyTransaction, order_id: &str) -> Result<bool> {
    let s = tx.schema();
    let mark = tx
        .prepare_cached(&format!(
            r#"UPDATE "{s}".order_reservations SET status = 'released'
               WHERE order_id = $1 AND status = 'reserved' RETURNING sku, quantity"#
        ))
        .map_err(db)?;
    let Some(row) = tx.query_opt(&mark, &[&order_id]).map_err(db)? else { return Ok(false) };
    let (sku, quantity): (String, i64) = (row.get(0), row.get(1));
    let put =
        tx.prepare_cached(&format!(r#"UPDATE "{s}".order_stock SET stock = stock + $2 WHERE sku = $1"#)).map_err(db)?;
    tx.execute(&put, &[&sku, &quantity]).map_err(db)?;
    effect(tx, order_id, "release", &sku, quantity)?;
    Ok(true)
}

/// Ship a `reserved` order; false when it is not reserved.
pub fn ship(tx: &ApplyTransaction, order_id: &str) -> Result<bool> {
    let s = tx.schema();
    let ship = tx
        .prepare_cached(&format!(
            r#"WITH shipped AS (
                   UPDATE "{s}".order_reservations SET status = 'shipped'
                   WHERE order_id = $1 AND status = 'reserved' RETURNING order_id, sku, quantity)
               INSERT INTO "{s}".order_effects (order_id, kind, sku, quantity)
               SELECT order_id, 'ship', sku, quantity FROM shipped"#
        ))
        .map_err(db)?;
    Ok(tx.execute(&ship, &[&order_id]).map_err(db)? == 1)
}

/// The order tables as JSON, at most `rows_max` rows each (as [`super::tables::tables`]; empty
/// when they are not installed).
pub fn tables(conn: &mut impl GenericClient, schema: &str, rows_max: usize) -> Result<Value> {
    let installed = conn
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&format!(r#""{schema}".order_stock"#)])
        .map_err(db)?
        .get::<_, bool>(0);
    if !installed {
        return Ok(json!({"stock": [], "reservations": [], "effects": []}));
    }
    let limit = rows_max as i64;
    let stock = conn
        .query(&format!(r#"SELECT sku, stock FROM "{schema}".order_stock ORDER BY sku LIMIT $1"#), &[&limit])
        .map_err(db)?
        .iter()
        .map(|r| json!({"sku": r.get::<_, String>(0), "stock": r.get::<_, i64>(1)}))
        .collect::<Vec<_>>();
    let reservations = conn
        .query(
            &format!(
                r#"SELECT order_id, sku, quantity, status FROM "{schema}".order_reservations ORDER BY order_id LIMIT $1"#
            ),
            &[&limit],
        )
        .map_err(db)?
        .iter()
        .map(|r| {
            json!({"order_id": r.get::<_, String>(0), "sku": r.get::<_, String>(1),
                   "quantity": r.get::<_, i64>(2), "status": r.get::<_, String>(3)})
        })
        .collect::<Vec<_>>();
    let effects = conn
        .query(
            &format!(
                r#"SELECT effect_id, order_id, kind, sku, quantity FROM "{schema}".order_effects ORDER BY effect_id LIMIT $1"#
            ),
            &[&limit],
        )
        .map_err(db)?
        .iter()
        .map(|r| {
            json!({"effect_id": r.get::<_, i64>(0), "order_id": r.get::<_, String>(1), "kind": r.get::<_, String>(2),
                   "sku": r.get::<_, String>(3), "quantity": r.get::<_, i64>(4)})
        })
        .collect::<Vec<_>>();
    Ok(json!({"stock": stock, "reservations": reservations, "effects": effects}))
}

/// The order saga's effects per kind (as [`super::tables::order_effect_counts`]).
pub fn order_effect_counts(conn: &mut impl GenericClient, schema: &str) -> Result<BTreeMap<String, u64>> {
    let rows = conn
        .query(&format!(r#"SELECT kind, count(*) FROM "{schema}".order_effects GROUP BY kind"#), &[])
        .map_err(db)?;
    Ok(rows.iter().map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1) as u64)).collect())
}

/// How many `(order_id, kind)` pairs have more than one effect (as
/// [`super::tables::orders_with_duplicate_effects`]: 0 when every step ran exactly once).
pub fn orders_with_duplicate_effects(conn: &mut impl GenericClient, schema: &str) -> Result<u64> {
    let row = conn
        .query_one(
            &format!(
                r#"SELECT count(*) FROM (SELECT 1 FROM "{schema}".order_effects
                   GROUP BY order_id, kind HAVING count(*) > 1) AS twice"#
            ),
            &[],
        )
        .map_err(db)?;
    Ok(row.get::<_, i64>(0) as u64)
}
