//! SQL used by the seed experiments on PostgreSQL (`tidemark experiment --store postgres://...`),
//! kept here so that no SQL lives outside store crates; the same functions as
//! `tidemark_store_sqlite::example`, on a store's schema.
//!
//! - `orders`: a user's own business table in the producer's schema, written in the same
//!   transaction as the outbox event (or, in the deliberately wrong dual write, not).
//! - `forget_dedup_records`: fault injection reproducing seed 002's hand deletion of dedup
//!   history. No tidemark operation does this; the experiment shows the high-water mark still
//!   refuses the replay.

use postgres::GenericClient;
use tidemark_core::Result;

use crate::schema::validate_schema_name;
use crate::PgResult;

/// Create the `orders` table (order id, quantity) in `schema`, if it is not there.
pub fn install_orders(client: &mut impl GenericClient, schema: &str) -> Result<()> {
    validate_schema_name(schema)?;
    client
        .batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS {schema}.orders (order_id text PRIMARY KEY, quantity bigint NOT NULL)"
        ))
        .db()
}

/// Insert a business row (inside whatever transaction `client` is).
pub fn insert_order(client: &mut impl GenericClient, schema: &str, order_id: &str, quantity: i64) -> Result<()> {
    validate_schema_name(schema)?;
    client
        .execute(&format!("INSERT INTO {schema}.orders (order_id, quantity) VALUES ($1, $2)"), &[&order_id, &quantity])
        .db()?;
    Ok(())
}

/// Every order as `(order_id, quantity)`, or nothing when the table does not exist.
pub fn orders(client: &mut impl GenericClient, schema: &str) -> Result<Vec<(String, i64)>> {
    validate_schema_name(schema)?;
    let exists: bool =
        client.query_one("SELECT to_regclass($1) IS NOT NULL", &[&format!("{schema}.orders")]).db()?.get(0);
    if !exists {
        return Ok(Vec::new());
    }
    let rows = client.query(&format!("SELECT order_id, quantity FROM {schema}.orders ORDER BY order_id"), &[]).db()?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// Fault injection: delete a consumer's inbox record and receipt of one (flow, seq) by hand.
pub fn forget_dedup_records(
    client: &mut impl GenericClient,
    schema: &str,
    consumer_id: &str,
    flow_id: &str,
    seq: i64,
) -> Result<usize> {
    validate_schema_name(schema)?;
    let mut deleted = 0;
    for table in ["inbox", "receipts"] {
        deleted += client
            .execute(
                &format!("DELETE FROM {schema}.{table} WHERE consumer_id = $1 AND flow_id = $2 AND seq = $3"),
                &[&consumer_id, &flow_id, &seq],
            )
            .db()?;
    }
    Ok(deleted as usize)
}
