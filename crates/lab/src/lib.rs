//! tidemark's lab tools: what the `tidemark` binary runs that is not the product itself.
//!
//! - [`demo`]: the whole pipeline and a saga on fresh files, narrated for a person (or as JSON).
//! - [`experiment`]: every scenario of the seed documents, with `--check` against golden state.
//! - [`bench`](mod@bench): throughput and latency benchmarks (docs/benchmarks.md).
//! - [`loadtest`]: load a running server from another process and verify what it acknowledged.
//! - [`chaos`]: several servers on one data folder under seeded faults, and an independent checker.
//! - [`pipeline`]: an in-process producer and consumer on files, shared by the three above.
//! - [`stores`]: a producer or consumer store on either backend (a SQLite file or a PostgreSQL
//!   schema), for the CLI's outbox and inbox commands and the experiment.
#![warn(missing_docs)]

pub mod bench;
mod brokers;
pub mod chaos;
pub mod demo;
pub mod experiment;
pub mod loadtest;
pub mod pipeline;
pub mod progress;
pub mod stores;

use std::path::Path;

use tidemark_core::error::codes;
use tidemark_core::Error;
use tidemark_store_sqlite::{Durability, SqliteConsumer};

/// What every command shares: the durability of the files it opens and its clock.
pub struct Context {
    /// How commits reach the disk.
    pub durability: Durability,
    /// A fixed clock (ms since the epoch) instead of the system clock.
    pub fixed_now_ms: Option<i64>,
}

impl Context {
    /// The command's clock.
    pub fn now_ms(&self) -> i64 {
        self.fixed_now_ms.unwrap_or_else(tidemark_engine::now_ms)
    }
}

/// Bad input with the generic code.
pub fn invalid(message: impl Into<String>) -> Error {
    Error::invalid(codes::INVALID_ARGUMENT, message)
}

/// Open a consumer database with the reservation tables installed (the built-in domain every
/// lab tool drives).
pub fn open_consumer(path: &Path, durability: Durability) -> tidemark_core::Result<SqliteConsumer> {
    let consumer = SqliteConsumer::open_with(path, durability)?;
    tidemark_builtins::reservation::install(&consumer)?;
    Ok(consumer)
}
