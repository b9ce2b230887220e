//! `tidemark unsafe-dual-write-advance`: hidden, failpoints builds only. Advances a flow with the
//! deliberately wrong dual write (state and event in two separate commits) so that the crash
//! test can show the event it loses. Never part of the product's interface.

use std::path::PathBuf;

use clap::Args;
use serde_json::{json, Value};
use tidemark_core::flow::AdvanceRequest;
use tidemark_core::reservation::ReservationMachine;
use tidemark_core::Result;
use tidemark_store_sqlite::{unsafe_dual_write_advance, SqliteProducer};

use crate::Context;

#[derive(Args)]
pub struct UnsafeDualWriteArgs {
    #[arg(long)]
    producer: PathBuf,
    #[arg(long)]
    flow: String,
    #[arg(long)]
    expected_seq: i64,
    #[arg(long)]
    to: String,
    #[arg(long)]
    quantity: Option<i64>,
    #[arg(long, default_value_t = 1)]
    schema_version: u32,
}

pub fn run(ctx: &Context, args: UnsafeDualWriteArgs) -> Result<Value> {
    let input = match args.quantity {
        Some(quantity) => json!({ "quantity": quantity }),
        None => json!({}),
    };
    let request = AdvanceRequest {
        flow_id: args.flow,
        expected_seq: args.expected_seq,
        to_state: args.to,
        input,
        schema_version: args.schema_version,
        traceparent: None,
    };
    tidemark_core::flow::validate_request(&ReservationMachine, &request)?;
    let mut producer = SqliteProducer::open_with(&args.producer, ctx.durability)?;
    let outcome = unsafe_dual_write_advance(&mut producer, &ReservationMachine, &request, ctx.now_ms())?;
    let mut out = serde_json::to_value(&outcome).expect("outcomes serialise");
    out["warning"] = json!("deliberately wrong dual write: state and event were committed separately");
    Ok(out)
}
