//! tidemark-store-sqlite: the producer (outbox), consumer (inbox) and workflow stores on SQLite.
//!
//! **Architecture invariant:** this crate (and the other store crates) is the only place that
//! writes SQL. Every file is opened in WAL mode with `synchronous=FULL` and a busy timeout;
//! opening never resets data; the schema is versioned and migrated forward in one transaction.
#![warn(missing_docs)]

mod consumer;
mod control;
mod endpoints;
pub mod example;
/// Simulated power loss and injected I/O errors under SQLite (a VFS). Failpoints builds only.
#[cfg(feature = "failpoints")]
pub mod faultfs;
mod migrations;
pub mod probe;
mod producer;
mod schema;
pub mod stats;
/// Deliberately wrong dual write, for the crash test that shows the loss. Failpoints builds only.
#[cfg(feature = "failpoints")]
pub mod unsafe_dual_write;
mod workflow;
pub mod workflow_events;

pub use consumer::{register_projection_table, SqliteConsumer};
pub use control::{ConsumerRecord, SqliteControl, TokenRecord};
pub use endpoints::SqliteEndpoints;
pub use migrations::{apply_migrations, validate_migrations, Migration, UNKNOWN_MIGRATION};
pub use producer::{
    advance_committed_in, advance_in, committed, Committed, OutboxTransaction, ProducerTransaction, SqliteProducer,
};
pub use schema::{busy_events, open_connection, open_existing, open_reader, Durability, SCHEMA_VERSION};
#[cfg(feature = "failpoints")]
pub use unsafe_dual_write::unsafe_dual_write_advance;
pub use workflow::{send_event_in, SqliteWorkflows, RECEIPT_WINDOW_MS_DEFAULT};

use tidemark_core::Error;

/// Convert a rusqlite error into the library error (a store failure, never bad input; a full
/// disk is `storage_full`).
pub(crate) fn db_err(error: rusqlite::Error) -> Error {
    Error::from(error)
}

pub(crate) trait SqlResult<T> {
    fn db(self) -> Result<T, Error>;
}

impl<T> SqlResult<T> for rusqlite::Result<T> {
    fn db(self) -> Result<T, Error> {
        self.map_err(db_err)
    }
}
