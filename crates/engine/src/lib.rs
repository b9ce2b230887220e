//! tidemark-engine: what runs the protocol over the stores. There are two parts:
//!
//! - [`relay`]: moves committed events from an outbox to every subscriber's inbox, over the
//!   traits of `tidemark_core::store` ([`relay_once`], [`relay_until_idle`]).
//! - [`workflow`]: the durable execution runtime (workflows, sagas, the worker and the writer
//!   that group-commits their journal), generic over `tidemark_core::workflow::WorkflowStore`,
//!   with the reference order saga ([`workflow::order`]) and the binary's built-in workflows
//!   ([`workflow::builtin`]).
//!
//! There is no producer or consumer driver here: a producer calls
//! `ProducerStore::advance_batch` (or `advance_in` / `OutboxTransaction` in its own transaction)
//! itself, and a consumer calls `ConsumerStore::drain` with its handler.
//!
//! **Architecture invariant:** the engine contains no SQL statement. The relay speaks only the
//! traits, so every backend gets the same behaviour. The workflow runtime's core is generic too,
//! but `workflow::order` and `workflow::builtin` are SQLite-specific: the order saga's
//! transactional steps run on a `rusqlite::Connection` through `tidemark_store_sqlite::order`,
//! its fake payment service keeps its log in SQLite, and the built-in workflows are registered
//! for `tidemark_store_sqlite::SqliteWorkflows` (see ARCHITECTURE.md).

pub mod relay;
pub mod workflow;

pub use relay::{relay_once, relay_until_idle, round_robin, RelayAnswer, RelayOptions, RelayReport};

/// Milliseconds since the Unix epoch, from the system clock.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}
