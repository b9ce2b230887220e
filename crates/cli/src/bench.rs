//! `tidemark bench`: throughput of the whole pipeline (advance, relay, apply) on real SQLite
//! files, with group commit and with one transaction per operation, on empty files and on files
//! that already hold many events, beside the disk's single-row commit ceiling.
//!
//! Rates are measured and printed, never asserted: `docs/benchmarks.md` explains each number.
//! Every run ends with an exactly-once check (effects == events x consumers, no duplicate
//! effect, every delivery accepted); a failed check makes the command exit 1.

use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Args;
use serde_json::{json, Value};
use tidemark_core::flow::{AdvanceOutcome, AdvanceRequest};
use tidemark_core::limits::{ADVANCE_BATCH_MAX, DRAIN_BATCH_EVENTS_MAX, RELAY_BATCH_EVENTS_MAX};
use tidemark_core::reservation::{ReservationMachine, STATES};
use tidemark_core::store::{ConsumerStore, DrainScope, ProducerStore};
use tidemark_core::{Error, Result};
use tidemark_engine::{relay_once, RelayOptions};
use tidemark_store_sqlite::reservation::{self, ReservationHandler};
use tidemark_store_sqlite::{probe, Durability, SqliteEndpoints, SqliteProducer};

use crate::pipeline::Pipeline;
use crate::Context;

/// Batch used to preload files quickly (the largest batch every stage allows).
const PRELOAD_BATCH: usize = 10_000;
/// Upper bound of the fsync probes' duration.
const PROBE_TIME_MAX: Duration = Duration::from_secs(5);

#[derive(Args)]
pub struct BenchArgs {
    /// Flows of each group-commit run; each flow gets --events-per-flow events.
    #[arg(long, default_value_t = 10_000)]
    flows: u64,
    /// Events per flow, 1..=3 (reserved, confirmed, released).
    #[arg(long, default_value_t = 3)]
    events_per_flow: u64,
    /// Group commit size: advance requests per producer transaction, relay limit (deliveries per
    /// consumer + producer transaction pair) and drain limit (applies per consumer transaction).
    #[arg(long, default_value_t = 5_000)]
    batch: usize,
    /// Events put in the tables before the preloaded run (0 skips it). The preload runs the same
    /// pipeline with synchronous=NORMAL and batches of 10,000; the measured run uses --durability.
    #[arg(long, default_value_t = 1_000_000)]
    preload_events: u64,
    /// Flows of the one-transaction-per-operation baseline (advance batch 1, relay limit 1, drain
    /// limit 1); 0 skips it. Rates are compared, so it may be smaller than --flows.
    #[arg(long, default_value_t = 300)]
    baseline_flows: u64,
    /// Subscribed consumers (all in the one consumer file); each applies every event.
    #[arg(long, default_value_t = 1)]
    consumers: usize,
    /// Single-row commits of the fsync probe (stops after 5 s anyway).
    #[arg(long, default_value_t = 2_000)]
    probe_commits: u64,
    /// Keep the files in this folder (created if missing; must not hold bench files). Default: a
    /// temporary folder, deleted afterwards.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// A small, fast run (for tests): 200 flows, batch 100, baseline 20 flows, preload 3,000
    /// events, 50 probe commits (those five flags are overridden).
    #[arg(long)]
    quick: bool,
}

/// How many operations share one transaction in each stage.
#[derive(Debug, Clone, Copy)]
struct Mode {
    advance_batch: usize,
    relay_limit: usize,
    drain_limit: usize,
}

impl Mode {
    fn json(&self) -> Value {
        json!({"advance_batch": self.advance_batch, "relay_limit": self.relay_limit, "drain_limit": self.drain_limit})
    }
}

/// What one pipeline run did and how long each stage took.
#[derive(Debug, Default, Clone)]
struct RunStats {
    events: u64,
    deliveries: u64,
    applied: u64,
    advance_transactions: u64,
    relay_passes: u64,
    drain_transactions: u64,
    advance: Duration,
    relay: Duration,
    drain: Duration,
    total: Duration,
    /// On-CPU and run-queue time of this thread over the run (Linux `schedstat`), when known.
    sched: Option<Sched>,
}

/// This thread's scheduler counters (Linux `/proc/thread-self/schedstat`): nanoseconds on a CPU
/// and nanoseconds runnable but waiting for one (time other processes took from us).
#[derive(Debug, Default, Clone, Copy)]
struct Sched {
    on_cpu_ns: u64,
    run_queue_ns: u64,
}

impl Sched {
    fn now() -> Option<Sched> {
        let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
        let mut fields = text.split_whitespace().map(|f| f.parse::<u64>().ok());
        Some(Sched { on_cpu_ns: fields.next()??, run_queue_ns: fields.next()?? })
    }

    fn since(self, start: Sched) -> Sched {
        Sched {
            on_cpu_ns: self.on_cpu_ns.saturating_sub(start.on_cpu_ns),
            run_queue_ns: self.run_queue_ns.saturating_sub(start.run_queue_ns),
        }
    }
}

fn rate(count: u64, elapsed: Duration) -> f64 {
    let seconds = elapsed.as_secs_f64();
    if seconds <= 0.0 {
        return 0.0;
    }
    round1(count as f64 / seconds)
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

impl RunStats {
    fn end_to_end_rate(&self) -> f64 {
        rate(self.events, self.total)
    }

    fn json(&self) -> Value {
        json!({
            "events": self.events,
            "deliveries": self.deliveries,
            "applied": self.applied,
            "transactions": {
                "advance": self.advance_transactions,
                "relay_passes": self.relay_passes,
                "drain": self.drain_transactions,
            },
            "seconds": {
                "advance": round3(self.advance.as_secs_f64()),
                "relay": round3(self.relay.as_secs_f64()),
                "drain": round3(self.drain.as_secs_f64()),
                "total": round3(self.total.as_secs_f64()),
            },
            "cpu": self.sched.map(|s| json!({
                "on_cpu_seconds": round3(s.on_cpu_ns as f64 / 1e9),
                "run_queue_wait_seconds": round3(s.run_queue_ns as f64 / 1e9),
                "end_to_end_events_per_cpu_s": rate(self.events, Duration::from_nanos(s.on_cpu_ns)),
            })),
            "rates_per_s": {
                "advance_events": rate(self.events, self.advance),
                "relay_deliveries": rate(self.deliveries, self.relay),
                "drain_applies": rate(self.applied, self.drain),
                "end_to_end_events": self.end_to_end_rate(),
            },
        })
    }
}

fn failed(message: String) -> Error {
    Error::Invariant(format!("bench: {message}"))
}

/// The `(round, flow)` advance requests of a run, in order: every flow's first event, then every
/// flow's second event, and so on.
fn request(prefix: &str, index: u64, round: u64) -> AdvanceRequest {
    AdvanceRequest {
        flow_id: format!("{prefix}-{index:08}"),
        expected_seq: round as i64,
        to_state: STATES[round as usize + 1].to_string(),
        input: if round == 0 { json!({"quantity": 1 + (index % 1_000) as i64}) } else { json!({}) },
        schema_version: 1,
    }
}

/// Run `flows x events_per_flow` events through advance, relay and drain in waves of
/// `mode.advance_batch` events: each wave is advanced, then relayed until every delivery of the
/// wave is accepted, then drained by every consumer until every event of the wave is applied.
fn run_pipeline(
    p: &mut Pipeline,
    consumer_ids: &[String],
    prefix: &str,
    flows: u64,
    events_per_flow: u64,
    mode: Mode,
    now_ms: i64,
) -> Result<RunStats> {
    let mut stats = RunStats::default();
    let options = RelayOptions { limit: mode.relay_limit, ..RelayOptions::default() };
    let mut handler = ReservationHandler::new(false);
    let total = flows * events_per_flow;
    let started = Instant::now();
    let sched_start = Sched::now();
    let mut next = 0_u64;
    while next < total {
        let wave_len = (total - next).min(mode.advance_batch as u64);
        let requests: Vec<AdvanceRequest> =
            (next..next + wave_len).map(|i| request(prefix, i % flows, i / flows)).collect();
        next += wave_len;

        let t = Instant::now();
        let outcomes = p.producer.advance_batch(&ReservationMachine, &requests, now_ms)?;
        stats.advance += t.elapsed();
        stats.advance_transactions += 1;
        if let Some(other) = outcomes.iter().find(|o| !matches!(o, AdvanceOutcome::Committed { .. })) {
            return Err(failed(format!("an advance was not committed: {other:?}")));
        }
        stats.events += wave_len;

        let due = wave_len * consumer_ids.len() as u64;
        let mut relayed = 0_u64;
        let t = Instant::now();
        while relayed < due {
            let report = relay_once(&mut p.producer, &mut p.endpoints, &options, now_ms, &mut || 0.5)?;
            stats.relay_passes += 1;
            if report.attempted == 0 || report.accepted != report.attempted {
                return Err(failed(format!("relay pass did not accept every delivery: {report:?}")));
            }
            relayed += report.attempted;
        }
        stats.relay += t.elapsed();
        stats.deliveries += relayed;

        let t = Instant::now();
        for consumer_id in consumer_ids {
            let mut applied = 0_u64;
            while applied < wave_len {
                let report = p.consumer.drain(consumer_id, &DrainScope::All, mode.drain_limit, &mut handler, now_ms)?;
                stats.drain_transactions += 1;
                if report.applied == 0 {
                    return Err(failed(format!("drain of {consumer_id} applied nothing: {report:?}")));
                }
                applied += report.applied;
            }
            stats.applied += applied;
        }
        stats.drain += t.elapsed();
    }
    stats.total = started.elapsed();
    stats.sched = Sched::now().zip(sched_start).map(|(end, start)| end.since(start));
    Ok(stats)
}

/// The exactly-once check of a pipeline's files: one effect per applied event and consumer, no
/// duplicate effect, every delivery accepted, nothing left open in the inbox.
fn verify(p: &Pipeline, expected_effects: u64) -> Result<Value> {
    let effects = reservation::effect_count(p.consumer.connection())?;
    let duplicates = reservation::duplicate_effects(p.consumer.connection())?;
    let deliveries = p.producer.delivery_counts()?;
    let not_accepted: i64 = deliveries.iter().filter(|(status, _)| status != "accepted").map(|(_, n)| n).sum();
    let passed = effects == expected_effects && duplicates.is_empty() && not_accepted == 0;
    Ok(json!({
        "passed": passed,
        "effects": effects,
        "expected_effects": expected_effects,
        "duplicate_effects": duplicates.len(),
        "deliveries_by_status": deliveries.into_iter().map(|(status, n)| (status, json!(n))).collect::<serde_json::Map<String, Value>>(),
    }))
}

fn reopen(p: Pipeline, durability: Durability) -> Result<Pipeline> {
    let Pipeline { producer_path, consumer_path, producer, consumer, endpoints } = p;
    drop((producer, consumer, endpoints));
    Ok(Pipeline {
        producer: SqliteProducer::open_with(&producer_path, durability)?,
        consumer: crate::open_consumer(&consumer_path, durability)?,
        endpoints: SqliteEndpoints::new(durability),
        producer_path,
        consumer_path,
    })
}

/// Raw `fdatasync` rate of a small file rewritten in place (no SQLite at all).
fn fdatasync_rate(path: &Path, syncs: u64) -> Result<Value> {
    let io = |e: std::io::Error| Error::io(format!("{}: {e}", path.display()));
    let mut file = std::fs::OpenOptions::new().create_new(true).write(true).open(path).map_err(io)?;
    let start = Instant::now();
    let mut done = 0_u64;
    while done < syncs && start.elapsed() < PROBE_TIME_MAX {
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        file.write_all(&done.to_le_bytes()).map_err(io)?;
        file.sync_data().map_err(io)?;
        done += 1;
    }
    let elapsed = start.elapsed();
    Ok(json!({"syncs": done, "seconds": round3(elapsed.as_secs_f64()), "per_s": rate(done, elapsed)}))
}

fn durability_word(durability: Durability) -> &'static str {
    match durability {
        Durability::Full => "full",
        Durability::Normal => "normal",
    }
}

fn check_range(name: &str, value: u64, min: u64, max: u64) -> Result<()> {
    if value < min || value > max {
        return Err(crate::invalid(format!("{name} must be {min}..={max}, got {value}")));
    }
    Ok(())
}

pub fn run(ctx: &Context, mut args: BenchArgs) -> Result<Value> {
    if args.quick {
        args.flows = 200;
        args.batch = 100;
        args.baseline_flows = 20;
        args.preload_events = 3_000;
        args.probe_commits = 50;
    }
    check_range("--flows", args.flows, 1, 10_000_000)?;
    check_range("--events-per-flow", args.events_per_flow, 1, 3)?;
    check_range(
        "--batch",
        args.batch as u64,
        1,
        ADVANCE_BATCH_MAX.min(RELAY_BATCH_EVENTS_MAX).min(DRAIN_BATCH_EVENTS_MAX) as u64,
    )?;
    check_range("--preload-events", args.preload_events, 0, 100_000_000)?;
    check_range("--baseline-flows", args.baseline_flows, 0, 1_000_000)?;
    check_range("--consumers", args.consumers as u64, 1, 16)?;
    check_range("--probe-commits", args.probe_commits, 1, 1_000_000)?;

    let temp = tempfile::tempdir().map_err(|e| Error::io(e.to_string()))?;
    let dir = match &args.dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).map_err(|e| Error::io(format!("{}: {e}", dir.display())))?;
            for name in ["empty", "baseline", "preloaded", "probe.db", "fdatasync.bin"] {
                if dir.join(name).exists() {
                    return Err(Error::invalid(
                        tidemark_core::codes::ALREADY_EXISTS,
                        format!("{} already holds bench files ({name}); pick an empty folder", dir.display()),
                    ));
                }
            }
            dir.clone()
        }
        None => temp.path().to_path_buf(),
    };
    let durability = ctx.durability;
    let now = ctx.now_ms();
    let consumer_ids: Vec<String> = (1..=args.consumers).map(|i| format!("c{i}")).collect();
    let id_refs: Vec<&str> = consumer_ids.iter().map(String::as_str).collect();
    let group = Mode { advance_batch: args.batch, relay_limit: args.batch, drain_limit: args.batch };
    let one = Mode { advance_batch: 1, relay_limit: 1, drain_limit: 1 };
    let consumers = args.consumers as u64;
    let mut all_passed = true;

    // 1. The disk: single-row commits with synchronous=FULL, and raw fdatasync.
    let commit_probe =
        probe::single_row_commits(&dir.join("probe.db"), Durability::Full, args.probe_commits, PROBE_TIME_MAX)?;
    let fdatasync = fdatasync_rate(&dir.join("fdatasync.bin"), args.probe_commits)?;

    // 2. Group commit on empty files.
    let sub = |name: &str| -> Result<PathBuf> {
        let path = dir.join(name);
        std::fs::create_dir_all(&path).map_err(|e| Error::io(format!("{}: {e}", path.display())))?;
        Ok(path)
    };
    let mut p = Pipeline::create(&sub("empty")?, "bench", &id_refs, durability, now)?;
    let empty = run_pipeline(&mut p, &consumer_ids, "g", args.flows, args.events_per_flow, group, now)?;
    let empty_check = verify(&p, empty.events * consumers)?;
    all_passed &= empty_check["passed"] == json!(true);
    drop(p);
    let empty_rate = empty.end_to_end_rate();

    // 3. One transaction per operation, on empty files.
    let baseline = if args.baseline_flows > 0 {
        let mut p = Pipeline::create(&sub("baseline")?, "bench", &id_refs, durability, now)?;
        let stats = run_pipeline(&mut p, &consumer_ids, "b", args.baseline_flows, args.events_per_flow, one, now)?;
        let check = verify(&p, stats.events * consumers)?;
        all_passed &= check["passed"] == json!(true);
        let ratio = round1(empty_rate / stats.end_to_end_rate().max(1e-9));
        Some(json!({"mode": one.json(), "run": stats.json(), "check": check, "group_commit_ratio": ratio}))
    } else {
        None
    };

    // 4. Group commit on files that already hold `preload_events` events.
    let preloaded = if args.preload_events > 0 {
        let preload_flows = args.preload_events.div_ceil(args.events_per_flow);
        let mut p = Pipeline::create(&sub("preloaded")?, "bench", &id_refs, Durability::Normal, now)?;
        let preload_mode =
            Mode { advance_batch: PRELOAD_BATCH, relay_limit: PRELOAD_BATCH, drain_limit: PRELOAD_BATCH };
        let preload = run_pipeline(&mut p, &consumer_ids, "p", preload_flows, args.events_per_flow, preload_mode, now)?;
        let mut p = reopen(p, durability)?;
        let stats = run_pipeline(&mut p, &consumer_ids, "g", args.flows, args.events_per_flow, group, now)?;
        let check = verify(&p, (preload.events + stats.events) * consumers)?;
        all_passed &= check["passed"] == json!(true);
        let ratio = round3(stats.end_to_end_rate() / empty_rate.max(1e-9));
        Some(json!({
            "preload": {
                "events": preload.events,
                "flows": preload_flows,
                "method": "the same pipeline (advance, relay, drain) with synchronous=NORMAL and batches of 10000; \
                           files then closed and reopened with the measured durability",
                "durability": "normal",
                "seconds": round3(preload.total.as_secs_f64()),
                "end_to_end_events_per_s": preload.end_to_end_rate(),
            },
            "run": stats.json(),
            "check": check,
            "ratio_to_empty": ratio,
        }))
    } else {
        None
    };

    let baseline_ratio = baseline.as_ref().map(|b| b["group_commit_ratio"].clone()).unwrap_or(Value::Null);
    let preloaded_ratio = preloaded.as_ref().map(|b| b["ratio_to_empty"].clone()).unwrap_or(Value::Null);
    let met = |value: &Value, min: f64| value.as_f64().map(|v| v >= min);
    Ok(json!({
        "outcome": "bench",
        "durability": durability_word(durability),
        "params": {
            "flows": args.flows,
            "events_per_flow": args.events_per_flow,
            "batch": args.batch,
            "preload_events": args.preload_events,
            "baseline_flows": args.baseline_flows,
            "consumers": args.consumers,
            "probe_commits": args.probe_commits,
            "quick": args.quick,
            "dir": dir,
            "files_kept": args.dir.is_some(),
            "available_parallelism": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        },
        "fsync_ceiling": {
            "sqlite_single_row_commits_per_s": round1(commit_probe.commits_per_s),
            "sqlite_single_row_commits": commit_probe.commits,
            "sqlite_durability": "full",
            "fdatasync": fdatasync,
        },
        "group_commit": {"mode": group.json(), "run": empty.json(), "check": empty_check},
        "one_per_op": baseline,
        "preloaded": preloaded,
        "summary": {
            "end_to_end_events_per_s": empty_rate,
            "one_per_op_events_per_s": baseline.as_ref().map(|b| b["run"]["rates_per_s"]["end_to_end_events"].clone()),
            "group_commit_ratio": baseline_ratio,
            "preloaded_events_per_s": preloaded.as_ref().map(|b| b["run"]["rates_per_s"]["end_to_end_events"].clone()),
            "preloaded_ratio_to_empty": preloaded_ratio,
            "sqlite_single_row_commits_per_s": round1(commit_probe.commits_per_s),
            "targets": {
                "end_to_end_events_per_s_at_least_50000": empty_rate >= 50_000.0,
                "group_commit_ratio_at_least_40": met(&baseline_ratio, 40.0),
                "preloaded_ratio_at_least_0_8": met(&preloaded_ratio, 0.8),
            },
        },
        "check": {"passed": all_passed, "what": "every run: effects == events x consumers, no duplicate effect, every delivery accepted"},
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_quick_bench_applies_every_event_exactly_once() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = Context { durability: Durability::Full, fixed_now_ms: None };
        let args = BenchArgs {
            flows: 0,
            events_per_flow: 3,
            batch: 0,
            preload_events: 0,
            baseline_flows: 0,
            consumers: 2,
            probe_commits: 0,
            dir: Some(dir.path().join("bench")),
            quick: true,
        };
        let out = run(&ctx, args).unwrap();
        assert_eq!(out["check"]["passed"], json!(true), "{out:#}");
        // 200 flows x 3 events, 2 consumers.
        let run = &out["group_commit"]["run"];
        assert_eq!(
            (run["events"].as_u64(), run["deliveries"].as_u64(), run["applied"].as_u64()),
            (Some(600), Some(1200), Some(1200))
        );
        assert_eq!(out["group_commit"]["check"]["effects"], json!(1200));
        assert_eq!(out["one_per_op"]["run"]["events"], json!(60));
        assert_eq!(out["one_per_op"]["check"]["effects"], json!(120));
        // 3,000 preloaded events plus the measured 600, for each of the 2 consumers.
        assert_eq!(out["preloaded"]["check"]["effects"], json!(7200));
        for value in [
            &out["summary"]["end_to_end_events_per_s"],
            &out["summary"]["one_per_op_events_per_s"],
            &out["summary"]["preloaded_events_per_s"],
            &out["summary"]["group_commit_ratio"],
            &out["summary"]["preloaded_ratio_to_empty"],
            &out["summary"]["sqlite_single_row_commits_per_s"],
            &run["rates_per_s"]["advance_events"],
            &run["rates_per_s"]["relay_deliveries"],
            &run["rates_per_s"]["drain_applies"],
        ] {
            assert!(value.as_f64().is_some_and(|v| v > 0.0), "not a positive number: {value} in {out:#}");
        }
    }
}
