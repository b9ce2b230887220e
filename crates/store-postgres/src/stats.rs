//! What an operator sees at a glance of one store schema (`/metrics`, the dashboard): the
//! outbox's open deliveries, each consumer's open inbox records and runs by status, read with
//! plain queries on a connection of the caller's own (never a store's), as SQLite's
//! `tidemark_store_sqlite::stats` reads them.

use std::collections::BTreeMap;

use postgres::GenericClient;
use tidemark_core::store::{InboxCounts, OutboxCounts};
use tidemark_core::Result;

use crate::schema::sql;
use crate::{col, PgResult};

/// The open deliveries of the producer in `schema` at `now_ms`: the implicit pending ones
/// (above a subscriber's cursor, no exception row) and the retrying and quarantined exceptions.
pub fn outbox_counts(client: &mut impl GenericClient, schema: &str, now_ms: i64) -> Result<OutboxCounts> {
    let row = client
        .query_one(
            &sql(
                schema,
                "SELECT
                   (SELECT count(*) FROM {s}.subscriptions s
                      JOIN {s}.outbox o ON o.position > s.delivered_position AND o.position >= s.from_position
                     WHERE NOT EXISTS (SELECT 1 FROM {s}.deliveries d
                                        WHERE d.position = o.position AND d.consumer_id = s.consumer_id)),
                   (SELECT min(o.created_at_ms) FROM {s}.subscriptions s
                      JOIN {s}.outbox o ON o.position > s.delivered_position AND o.position >= s.from_position
                     WHERE NOT EXISTS (SELECT 1 FROM {s}.deliveries d
                                        WHERE d.position = o.position AND d.consumer_id = s.consumer_id)),
                   (SELECT count(*) FROM {s}.deliveries WHERE status = 'pending'),
                   (SELECT count(*) FROM {s}.deliveries WHERE status = 'pending' AND next_attempt_at_ms <= $1),
                   (SELECT min(o.created_at_ms) FROM {s}.deliveries d JOIN {s}.outbox o ON o.position = d.position
                     WHERE d.status = 'pending'),
                   (SELECT count(*) FROM {s}.deliveries WHERE status = 'quarantined'),
                   (SELECT coalesce(max(position), 0) FROM {s}.outbox)",
            ),
            &[&now_ms],
        )
        .db()?;
    Ok(OutboxCounts::from_parts(
        (col(&row, 0)?, col(&row, 1)?),
        (col(&row, 2)?, col(&row, 3)?, col(&row, 4)?),
        col(&row, 5)?,
        col(&row, 6)?,
    ))
}

/// Each consumer's pending and blocked records in `schema`'s inbox.
pub fn inbox_counts(client: &mut impl GenericClient, schema: &str) -> Result<BTreeMap<String, InboxCounts>> {
    let rows = client
        .query(
            &sql(
                schema,
                "SELECT consumer_id, count(*) FILTER (WHERE status = 'pending'), count(*) FILTER (WHERE status = 'blocked')
                   FROM {s}.inbox WHERE status IN ('pending', 'blocked') GROUP BY consumer_id",
            ),
            &[],
        )
        .db()?;
    let mut out = BTreeMap::new();
    for row in &rows {
        let (consumer, pending, blocked): (String, i64, i64) = (col(row, 0)?, col(row, 1)?, col(row, 2)?);
        out.insert(consumer, InboxCounts { pending: pending as u64, blocked: blocked as u64 });
    }
    Ok(out)
}

/// The id of the event at `(flow_id, seq)` in `schema`'s outbox, or `None`.
pub fn outbox_event_id(
    client: &mut impl GenericClient,
    schema: &str,
    flow_id: &str,
    seq: i64,
) -> Result<Option<String>> {
    let row = client
        .query_opt(&sql(schema, "SELECT event_id FROM {s}.outbox WHERE flow_id = $1 AND seq = $2"), &[&flow_id, &seq])
        .db()?;
    row.map(|r| col(&r, 0)).transpose()
}

/// Run `run_id`'s status word in `schema` and whether a worker holds its lease, or `None`.
pub fn run_status(client: &mut impl GenericClient, schema: &str, run_id: &str) -> Result<Option<(String, bool)>> {
    let row = client
        .query_opt(&sql(schema, "SELECT status, lease_owner IS NOT NULL FROM {s}.runs WHERE run_id = $1"), &[&run_id])
        .db()?;
    row.map(|r| Ok((col(&r, 0)?, col(&r, 1)?))).transpose()
}

/// Runs by status in `schema` (only statuses that have runs).
pub fn run_counts(client: &mut impl GenericClient, schema: &str) -> Result<BTreeMap<String, u64>> {
    let rows = client.query(&sql(schema, "SELECT status, count(*) FROM {s}.runs GROUP BY status"), &[]).db()?;
    let mut counts = BTreeMap::new();
    for row in &rows {
        let (status, count): (String, i64) = (col(row, 0)?, col(row, 1)?);
        counts.insert(status, count as u64);
    }
    Ok(counts)
}
