//! `tidemark experiment`: reproduce the seed scenarios (filled in by the experiment module).

use clap::Args;
use serde_json::Value;
use tidemark_core::Result;

use crate::Context;

#[derive(Args)]
pub struct ExperimentArgs {
    /// Compare every scenario's state with the expected state; exit 1 on a difference.
    #[arg(long)]
    check: bool,
    /// Write the full results to this file.
    #[arg(long)]
    output: Option<std::path::PathBuf>,
}

pub fn run(_ctx: &Context, _args: ExperimentArgs) -> Result<Value> {
    Err(tidemark_core::Error::invalid(tidemark_core::codes::INVALID_ARGUMENT, "experiment: not built yet"))
}
