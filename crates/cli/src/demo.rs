//! `tidemark demo`: the whole pipeline on fresh SQLite files, narrated as JSON.

use std::path::PathBuf;

use clap::Args;
use serde_json::{json, Value};
use tidemark_core::store::{ConsumerStore, ProducerStore};
use tidemark_core::Result;
use tidemark_engine::RelayOptions;

use crate::pipeline::Pipeline;
use crate::Context;

#[derive(Args)]
pub struct DemoArgs {
    /// Keep the files in this folder (created if missing) instead of a temporary one.
    #[arg(long)]
    dir: Option<PathBuf>,
}

pub fn run(ctx: &Context, args: DemoArgs) -> Result<Value> {
    let temp = tempfile::tempdir().map_err(|e| tidemark_core::Error::io(e.to_string()))?;
    let dir = match &args.dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).map_err(|e| tidemark_core::Error::io(format!("{}: {e}", dir.display())))?;
            if dir.join("producer.db").exists() || dir.join("consumer.db").exists() {
                return Err(tidemark_core::Error::invalid(
                    tidemark_core::codes::ALREADY_EXISTS,
                    format!("{} already holds demo files; pick an empty folder", dir.display()),
                ));
            }
            dir.clone()
        }
        None => temp.path().to_path_buf(),
    };
    let now = ctx.now_ms();
    let mut steps: Vec<Value> = Vec::new();
    let mut p = Pipeline::create(&dir, "shop", &["audit", "search"], ctx.durability, now)?;
    let mut step = |what: &str, result: Value| steps.push(json!({"step": what, "result": result}));

    let r = p.advance("order-1", 0, "reserved", Some(3), 1, now)?;
    step("advance order-1 new -> reserved (quantity 3, schema v1)", serde_json::to_value(&r).unwrap());
    let r = p.advance("order-1", 1, "confirmed", None, 1, now)?;
    step("advance order-1 reserved -> confirmed", serde_json::to_value(&r).unwrap());
    let r = p.advance("order-1", 1, "released", None, 1, now)?;
    step("advance order-1 with a stale expected_seq", serde_json::to_value(&r).unwrap());
    let r = p.advance("order-2", 0, "confirmed", Some(5), 1, now)?;
    step("advance order-2 new -> confirmed (skipping a state)", serde_json::to_value(&r).unwrap());
    let r = p.advance("order-2", 0, "reserved", Some(5), 2, now)?;
    step("advance order-2 new -> reserved with schema v2 (payload.units)", serde_json::to_value(&r).unwrap());

    let report = p.relay_all(&RelayOptions::default(), now, 10)?;
    step(
        "relay: every event to audit and search (one consumer and one producer transaction per batch)",
        serde_json::to_value(&report).unwrap(),
    );
    let report = p.drain("audit", 1_000, false, now)?;
    step(
        "drain audit with the v1-only decoders: order-2 is blocked, order-1 applies",
        serde_json::to_value(&report).unwrap(),
    );
    let report = p.drain("audit", 1_000, true, now)?;
    step(
        "drain audit again with support_v2: the blocked record applies unchanged",
        serde_json::to_value(&report).unwrap(),
    );
    let report = p.drain("search", 1_000, true, now)?;
    step("drain search (an independent consumer applies each event once too)", serde_json::to_value(&report).unwrap());

    let first = p.producer.snapshot(1)?.outbox.remove(0);
    let outcome = p.consumer.receive_batch(&[("audit", &first)], now)?;
    step("redeliver order-1 seq 1 to audit", serde_json::to_value(&outcome).unwrap());
    let mut forged = first.clone();
    forged.payload = json!({"amount": 999});
    let outcome = p.consumer.receive_batch(&[("audit", &forged)], now)?;
    step("deliver order-1 seq 1 with the same id and a different amount", serde_json::to_value(&outcome).unwrap());

    let state = p.consumer_state()?;
    Ok(json!({
        "outcome": "demo",
        "files": {"producer": p.producer_path, "consumer": p.consumer_path, "kept": args.dir.is_some()},
        "steps": steps,
        "final": state,
    }))
}
