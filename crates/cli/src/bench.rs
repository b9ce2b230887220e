//! `tidemark bench`: throughput measurements (filled in by the bench module).

use clap::Args;
use serde_json::Value;
use tidemark_core::Result;

use crate::Context;

#[derive(Args)]
pub struct BenchArgs {}

pub fn run(_ctx: &Context, _args: BenchArgs) -> Result<Value> {
    Err(tidemark_core::Error::invalid(tidemark_core::codes::INVALID_ARGUMENT, "bench: not built yet"))
}
