//! tidemark-store-postgres: the producer (outbox), consumer (inbox) and workflow stores on
//! PostgreSQL 15+.
//!
//! Each store lives in its own PostgreSQL schema (namespace), named by the caller, so tenants and
//! tests are isolated; every statement names its tables with that schema. One owned, blocking
//! [`postgres::Client`] per store object, like SQLite's owned connection: a store object lives on
//! a dedicated thread (never on a tokio worker: the blocking client runs its own small runtime
//! and panics inside another one).
//!
//! **Architecture invariant:** this crate (and the other store crates) is the only place that
//! writes SQL on tidemark's tables. PostgreSQL's durability defaults (`fsync`,
//! `synchronous_commit=on`) are never weakened; opening never resets data; the schema is
//! versioned and migrated forward in one transaction under an advisory lock.
//!
//! **Architecture invariant:** outbox positions are commit-ordered. Every advance locks the
//! producer's counter row (`positions`) before it reads anything and allocates positions from it;
//! the row lock is held until commit, so a position becomes visible only after every lower one
//! has (see `producer.rs` and docs/protocol.md, "Delivery cursors").
//!
//! **Architecture invariant:** workflow runs are shared by every process on the schema. A claim
//! leases only rows it locked with `FOR UPDATE SKIP LOCKED`; per-type limits are spent under the
//! type's advisory lock and per-key leases under the key's; every write that reads a run first
//! locks it, several runs always in `run_id` order (see `workflow/mod.rs`).
#![warn(missing_docs)]

mod apply;
mod consumer;
mod control;
mod endpoints;
pub mod example;
mod listen;
mod migrations;
mod producer;
mod roles;
mod schema;
pub mod stats;
mod tls;
mod workflow;

pub use apply::{ApplyTransaction, CommitHook, COMMIT_REFUSED, PREPARED_STATEMENTS_MAX};
pub use consumer::{register_projection_table, PgConsumer};
pub use control::PgControl;
pub use endpoints::{with_password as endpoint_with_password, PgEndpoints};
pub use listen::{wake_channel, DueRunListener};
pub use migrations::{apply_migrations, validate_migrations, Migration};
pub use producer::{advance_committed_in, advance_in, committed, Committed, PgProducer, ProducerTransaction};
pub use roles::{conn_as_role, ensure_owner_role};
pub use schema::{connect, validate_schema_name, CONNECT_TIMEOUT_MS_DEFAULT, SCHEMA_NAME_BYTES_MAX, SCHEMA_VERSION};
pub use tls::SSL_ROOT_CERT_BYTES_MAX;
pub use workflow::{send_event_in, PgWorkflows, RECEIPT_WINDOW_MS_DEFAULT};

use tidemark_core::Error;

/// How a run event is stored on PostgreSQL: [`send_event_in`] in the apply transaction's own
/// schema (a consumer whose inbox is in the workflow schema).
#[derive(Debug, Clone, Copy, Default)]
pub struct PgRunEvents;

impl tidemark_core::run_events::RunEventSend for PgRunEvents {
    type Tx = ApplyTransaction;
    fn send(
        tx: &ApplyTransaction,
        run_id: &str,
        event_id: &str,
        name: &str,
        payload: &serde_json::Value,
        now_ms: i64,
    ) -> Result<bool, Error> {
        send_event_in(tx, tx.schema(), run_id, event_id, name, payload, now_ms)
    }
}

/// Delivers applied inbox events to workflow runs on PostgreSQL (see
/// [`tidemark_core::run_events::RunEventHandler`]): register it on the workflow database.
pub type RunEventHandler = tidemark_core::run_events::RunEventHandler<PgRunEvents>;

/// Convert a PostgreSQL error into the library error (a store failure, never bad input).
pub(crate) fn db_err(error: postgres::Error) -> Error {
    Error::from(error)
}

pub(crate) trait PgResult<T> {
    fn db(self) -> Result<T, Error>;
}

impl<T> PgResult<T> for Result<T, postgres::Error> {
    fn db(self) -> Result<T, Error> {
        self.map_err(db_err)
    }
}

/// Read column `index` of `row`, a store error if its type does not match (a corrupt or foreign
/// table, never a panic).
pub(crate) fn col<'a, T: postgres::types::FromSql<'a>>(row: &'a postgres::Row, index: usize) -> Result<T, Error> {
    row.try_get(index).db()
}

/// A `u32` column stored as `integer` (schema versions, attempts).
pub(crate) fn col_u32(row: &postgres::Row, index: usize) -> Result<u32, Error> {
    let value: i32 = col(row, index)?;
    u32::try_from(value).map_err(|_| Error::store(format!("column {index} holds {value}, not a u32")))
}

#[cfg(test)]
mod tests;
