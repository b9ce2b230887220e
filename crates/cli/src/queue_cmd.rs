//! `tidemark queue ...`: declare a queue on a workflow database (`put`), list them, and show one
//! with its waiting runs and their positions. Runs go through one with `tidemark workflow start
//! --queue Q [--priority P] [--dedup-id D]`.

use std::path::PathBuf;

use clap::Subcommand;
use serde_json::{json, Value};
use tidemark_core::error::codes;
use tidemark_core::id::validate_id;
use tidemark_core::queue::{QueueSpec, QueueStore, RateLimit, QUEUE_WAITING_SHOWN_MAX};
use tidemark_core::{Error, Result};

use crate::workflow_cmd::{on_store, open_db, Store};
use crate::Context;

#[derive(Subcommand)]
pub enum QueueCommand {
    /// Declare or change a queue.
    Put {
        /// The workflow store: a SQLite file or a `postgres://` URL.
        #[arg(long, visible_alias = "store")]
        db: Option<PathBuf>,
        #[arg(long)]
        name: String,
        /// At most this many admitted, unfinished runs at once, across every worker.
        #[arg(long)]
        concurrency: Option<u32>,
        /// At most this many admissions per --rate-period-ms.
        #[arg(long, requires = "rate_period_ms")]
        rate_limit: Option<u32>,
        #[arg(long, requires = "rate_limit")]
        rate_period_ms: Option<i64>,
    },
    /// Every queue with its counts.
    List {
        /// The workflow store: a SQLite file or a `postgres://` URL.
        #[arg(long, visible_alias = "store")]
        db: Option<PathBuf>,
    },
    /// One queue with its next waiting runs in admission order, with their positions.
    Show {
        /// The workflow store: a SQLite file or a `postgres://` URL.
        #[arg(long, visible_alias = "store")]
        db: Option<PathBuf>,
        #[arg(long)]
        name: String,
    },
}

/// The spec `queue put` declares.
pub(crate) fn spec_of(
    name: String,
    concurrency: Option<u32>,
    limit: Option<u32>,
    period: Option<i64>,
) -> Result<QueueSpec> {
    let rate = match (limit, period) {
        (Some(limit), Some(period_ms)) => Some(RateLimit { limit, period_ms }),
        (None, None) => None,
        _ => return Err(Error::invalid(codes::INVALID_ARGUMENT, "--rate-limit and --rate-period-ms go together")),
    };
    let spec = QueueSpec { name, concurrency_max: concurrency, rate };
    spec.validate()?;
    Ok(spec)
}

pub fn run(ctx: &Context, command: QueueCommand) -> Result<Value> {
    let now = ctx.now_ms();
    match command {
        QueueCommand::Put { db, name, concurrency, rate_limit, rate_period_ms } => {
            let spec = spec_of(name, concurrency, rate_limit, rate_period_ms)?;
            on_store!(open_db(ctx, db)?, |store| {
                Ok(json!({"outcome": "declared", "queue": store.put_queue(&spec, now)?}))
            })
        }
        QueueCommand::List { db } => {
            on_store!(open_db(ctx, db)?, |store| Ok(json!({"queues": store.queues(now)?})))
        }
        QueueCommand::Show { db, name } => {
            validate_id("queue", &name)?;
            on_store!(open_db(ctx, db)?, |store| {
                let state = store
                    .queue(&name, QUEUE_WAITING_SHOWN_MAX, now)?
                    .ok_or_else(|| Error::not_found(format!("no queue {name:?}")))?;
                Ok(json!({"queue": state}))
            })
        }
    }
}
