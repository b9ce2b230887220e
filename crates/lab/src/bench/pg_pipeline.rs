//! `tidemark bench --store postgres://...` (without `--workflows`): the outbox -> relay -> inbox
//! pipeline on `PgProducer`, `PgEndpoints` and `PgConsumer`, the same runs as on SQLite files
//! (one thread in waves; three threads with their own connections; one transaction per
//! operation), each on fresh schemas (a producer schema and a consumer schema per run), beside
//! pgbench's single-row commit ceilings measured in the same run.
//!
//! The handler is the built-in reservation projection on the consumer's schema
//! (`tidemark_builtins::reservation::postgres`, the handler `tidemark drain --consumer-db
//! postgres://...` runs): one projection row per flow and one effect row per applied event,
//! statements prepared once per connection. The exactly-once check is SQLite's: effects
//! == events x consumers, no duplicate effect, every delivery accepted.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use tidemark_builtins::reservation::postgres as reservation;
use tidemark_core::location::PostgresLocation;
use tidemark_core::policy::RetentionPolicy;
use tidemark_core::store::{HandleError, Handler, ProducerStore, Subscription};
use tidemark_core::{Envelope, Error, Result};
use tidemark_store_postgres::{ApplyTransaction, PgConsumer, PgEndpoints, PgProducer};

use super::postgres::{ceilings, server_cpu_seconds, server_settings, Cleanup, PgPlace};
use super::workflows::load_average;
use super::{passed, round3, run_three_threads, run_waves, Mode, RunStats, Series, Sides, Waves};

/// What the PostgreSQL pipeline bench runs.
pub(super) struct Params {
    pub flows: u64,
    pub events_per_flow: u64,
    pub batch: usize,
    pub baseline_flows: u64,
    pub consumers: usize,
    pub repeat: u64,
    pub pgbench_seconds: u64,
    /// Each run again while another session holds a transaction open (`--hold-transaction`).
    pub hold_transaction: bool,
    pub now_ms: i64,
}

/// Another session's transaction held open, as a forgotten `BEGIN` in an operator's `psql` or an
/// application's idle connection would be: it has a transaction id, so the server's xmin horizon
/// stays at its start for as long as it is open, and no dead row version made after it can be
/// removed (by `VACUUM` or by page pruning) anywhere on the server.
struct HeldTransaction {
    client: postgres::Client,
    pid: i32,
    xid: i64,
}

impl HeldTransaction {
    fn open(conn: &str) -> Result<HeldTransaction> {
        let mut client = tidemark_store_postgres::connect(conn)?;
        client.batch_execute("BEGIN").map_err(Error::from)?;
        let row = client.query_one("SELECT pg_backend_pid(), txid_current()", &[]).map_err(Error::from)?;
        Ok(HeldTransaction { pid: row.get(0), xid: row.get(1), client })
    }

    /// What an operator sees of it (`pg_stat_activity`), read from another session.
    fn seen(&self, conn: &str) -> Result<Value> {
        let mut client = tidemark_store_postgres::connect(conn)?;
        let row = client
            .query_one(
                "SELECT state, (extract(epoch FROM now() - xact_start) * 1000)::bigint,
                        age(backend_xmin)
                 FROM pg_stat_activity WHERE pid = $1",
                &[&self.pid],
            )
            .map_err(Error::from)?;
        Ok(json!({
            "pid": self.pid,
            "xid": self.xid,
            "state": row.get::<_, Option<String>>(0),
            "open_for_ms": row.get::<_, Option<i64>>(1),
            "transactions_since_its_snapshot": row.get::<_, Option<i32>>(2),
        }))
    }

    fn close(mut self) -> Result<()> {
        self.client.batch_execute("ROLLBACK").map_err(Error::from)
    }
}

/// `VACUUM` every table of the run's two schemas, then their row versions as the server counts
/// them: dead ones it could not remove (a transaction held open keeps them) and live ones.
fn vacuumed_rows(sides: &PgSides) -> Result<Value> {
    let mut client = tidemark_store_postgres::connect(&sides.conn)?;
    let tables: Vec<(String, String)> = client
        .query(
            "SELECT schemaname::text, relname::text FROM pg_stat_user_tables WHERE schemaname = ANY($1)
             ORDER BY 1, 2",
            &[&vec![sides.producer.clone(), sides.consumer.clone()]],
        )
        .map_err(Error::from)?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    for (schema, table) in &tables {
        client.batch_execute(&format!("VACUUM \"{schema}\".\"{table}\"")).map_err(Error::from)?;
    }
    // VACUUM reports its counts to the statistics at once; this session reads them fresh.
    client.batch_execute("SELECT pg_stat_clear_snapshot()").map_err(Error::from)?;
    let row = client
        .query_one(
            "SELECT coalesce(sum(n_dead_tup), 0)::bigint, coalesce(sum(n_live_tup), 0)::bigint
             FROM pg_stat_user_tables WHERE schemaname = ANY($1)",
            &[&vec![sides.producer.clone(), sides.consumer.clone()]],
        )
        .map_err(Error::from)?;
    Ok(json!({"dead_row_versions_after_vacuum": row.get::<_, i64>(0), "live_rows": row.get::<_, i64>(1)}))
}

/// A producer schema and a consumer schema of one run, with `consumer_ids` subscribed.
struct PgSides {
    conn: String,
    producer: String,
    consumer: String,
}

impl PgSides {
    fn create(place: &PgPlace, name: &str, consumer_ids: &[String], now_ms: i64) -> Result<PgSides> {
        let producer_schema = place.fresh_schema(&format!("{name}-out"))?;
        let consumer_schema = place.fresh_schema(&format!("{name}-in"))?;
        let mut consumer = PgConsumer::init(&place.conn, &consumer_schema, RetentionPolicy::default())?;
        reservation::install(&mut consumer)?;
        let mut producer = PgProducer::init(&place.conn, &producer_schema, "bench")?;
        for id in consumer_ids {
            producer.subscribe(
                &Subscription { consumer_id: id.clone(), endpoint: consumer_schema.clone() },
                true,
                now_ms,
            )?;
        }
        Ok(PgSides { conn: place.conn.clone(), producer: producer_schema, consumer: consumer_schema })
    }

    /// The exactly-once check of the run's schemas (as SQLite's `verify`).
    fn verify(&self, expected_effects: u64) -> Result<Value> {
        let producer = PgProducer::open(&self.conn, &self.producer)?;
        let deliveries = producer.delivery_counts()?;
        let mut client = tidemark_store_postgres::connect(&self.conn)?;
        let s = &self.consumer;
        let effects: i64 = client
            .query_one(&format!("SELECT count(*) FROM \"{s}\".reservation_effects"), &[])
            .map_err(Error::from)?
            .get(0);
        let duplicates: i64 = client
            .query_one(
                &format!(
                    "SELECT count(*) FROM (SELECT 1 FROM \"{s}\".reservation_effects
                     GROUP BY consumer_id, source, flow_id, seq HAVING count(*) > 1) AS twice"
                ),
                &[],
            )
            .map_err(Error::from)?
            .get(0);
        let not_accepted: i64 = deliveries.iter().filter(|(status, _)| status != "accepted").map(|(_, n)| n).sum();
        let passed = effects as u64 == expected_effects && duplicates == 0 && not_accepted == 0;
        Ok(json!({
            "passed": passed,
            "effects": effects,
            "expected_effects": expected_effects,
            "duplicate_effects": duplicates,
            "deliveries_by_status": deliveries.into_iter().map(|(status, n)| (status, json!(n))).collect::<serde_json::Map<String, Value>>(),
        }))
    }
}

impl Sides for PgSides {
    type P = PgProducer;
    type C = PgConsumer;
    type E = PgEndpoints;

    fn producer(&self) -> Result<PgProducer> {
        PgProducer::open(&self.conn, &self.producer)
    }

    fn consumer(&self) -> Result<PgConsumer> {
        PgConsumer::open(&self.conn, &self.consumer)
    }

    fn endpoints(&self) -> PgEndpoints {
        PgEndpoints::new(&self.conn)
    }

    fn handler(&self) -> Box<dyn Handler<ApplyTransaction>> {
        Box::new(reservation::ReservationHandler::new(false))
    }
}

/// The reservation handler applying one event at a time (its `handle`; the drain never hands it
/// a batch): the `event_at_a_time` run, to compare with the batches of the same run.
struct OneAtATime(reservation::ReservationHandler);

impl Handler<ApplyTransaction> for OneAtATime {
    fn handle(&mut self, tx: &ApplyTransaction, consumer_id: &str, event: &Envelope) -> Result<(), HandleError> {
        self.0.handle(tx, consumer_id, event)
    }

    fn refuses_before_writing(&self) -> bool {
        self.0.refuses_before_writing()
    }
}

/// One thread, in waves (as SQLite's `group_commit` run), on fresh schemas; the handler takes
/// batches unless `event_at_a_time`.
#[allow(clippy::too_many_arguments)]
fn one_thread(
    place: &PgPlace,
    name: &str,
    p: &Params,
    ids: &[String],
    flows: u64,
    mode: Mode,
    event_at_a_time: bool,
) -> Result<Value> {
    let sides = PgSides::create(place, name, ids, p.now_ms)?;
    let (mut producer, mut endpoints, mut consumer) = (sides.producer()?, sides.endpoints(), sides.consumer()?);
    let mut batches = reservation::ReservationHandler::new(false);
    let mut one = OneAtATime(batches.clone());
    let handler: &mut dyn Handler<ApplyTransaction> = if event_at_a_time { &mut one } else { &mut batches };
    let run =
        Waves { consumer_ids: ids, prefix: "g", flows, events_per_flow: p.events_per_flow, mode, now_ms: p.now_ms };
    let server_cpu = server_cpu_seconds();
    let stats = run_waves(&mut producer, &mut endpoints, &mut consumer, handler, &run)?;
    let server_cpu = server_cpu_seconds().zip(server_cpu).map(|(end, start)| end - start);
    drop((producer, endpoints, consumer));
    let check = sides.verify(stats.events * ids.len() as u64)?;
    let mut run = with_server_cpu(&stats, check, server_cpu);
    if p.hold_transaction {
        run["rows"] = vacuumed_rows(&sides)?;
    }
    Ok(run)
}

/// Three threads with their own connections (as SQLite's `pipelined` run), on fresh schemas.
fn three_threads(place: &PgPlace, name: &str, p: &Params, ids: &[String], mode: Mode) -> Result<Value> {
    let sides = PgSides::create(place, name, ids, p.now_ms)?;
    let run = Waves {
        consumer_ids: ids,
        prefix: "g",
        flows: p.flows,
        events_per_flow: p.events_per_flow,
        mode,
        now_ms: p.now_ms,
    };
    let server_cpu = server_cpu_seconds();
    let stats = run_three_threads(&sides, &run, Duration::from_secs(3_600))?;
    let server_cpu = server_cpu_seconds().zip(server_cpu).map(|(end, start)| end - start);
    let check = sides.verify(stats.events * ids.len() as u64)?;
    let mut run = with_server_cpu(&stats, check, server_cpu);
    if p.hold_transaction {
        run["rows"] = vacuumed_rows(&sides)?;
    }
    Ok(run)
}

/// A run's JSON (as SQLite's) with the check and the server's CPU time over the run.
fn with_server_cpu(stats: &RunStats, check: Value, server_cpu: Option<f64>) -> Value {
    let seconds = stats.total.as_secs_f64();
    let mut run = stats.json();
    run["check"] = check;
    run["server_cpu_seconds"] = json!(server_cpu.map(round3));
    run["server_cpu_share_of_wall"] = json!(server_cpu.map(|c| round3(c / seconds.max(1e-9))));
    run["server_cpu_us_per_event"] = json!(server_cpu.map(|c| round3(c * 1e6 / stats.events.max(1) as f64)));
    run
}

/// Runs of one kind on PostgreSQL: the runs' JSON and their end-to-end rates.
#[derive(Default)]
struct PgSeries {
    series: Series,
}

impl PgSeries {
    fn push(&mut self, run: Value) {
        let rate = run["rates_per_s"]["end_to_end_events"].as_f64().unwrap_or(0.0);
        self.series.rates.push(rate);
        if let Some(cpu) = run["cpu"]["end_to_end_events_per_cpu_s"].as_f64() {
            self.series.cpu_rates.push(cpu);
        }
        self.series.runs.push(run);
    }
}

/// `bench --store postgres://...`.
pub(super) fn run(location: &PostgresLocation, dir: &Path, p: &Params) -> Result<Value> {
    let place = PgPlace::new(location)?;
    let settings = server_settings(&location.conn)?;
    let cleanup = Cleanup(place.clone());
    let load = load_average();
    let ceilings = ceilings(&place, dir, p.pgbench_seconds)?;
    let ids: Vec<String> = (1..=p.consumers).map(|i| format!("c{i}")).collect();
    let group = Mode { advance_batch: p.batch, relay_limit: p.batch, drain_limit: p.batch };
    let one = Mode { advance_batch: 1, relay_limit: 1, drain_limit: 1 };
    let mut all_passed = true;
    let (mut sequential, mut pipelined, mut baseline) = (PgSeries::default(), PgSeries::default(), PgSeries::default());
    let mut event_at_a_time = PgSeries::default();
    let (mut held_sequential, mut held_pipelined) = (PgSeries::default(), PgSeries::default());
    let mut progress = crate::progress::Progress::start("bench", p.repeat);
    for r in 0..p.repeat {
        let run = one_thread(&place, &format!("g{r}"), p, &ids, p.flows, group, false)?;
        all_passed &= passed(&run["check"]);
        sequential.push(run);
        let run = one_thread(&place, &format!("e{r}"), p, &ids, p.flows, group, true)?;
        all_passed &= passed(&run["check"]);
        event_at_a_time.push(run);
        let run = three_threads(&place, &format!("p{r}"), p, &ids, group)?;
        all_passed &= passed(&run["check"]);
        pipelined.push(run);
        if p.baseline_flows > 0 {
            let run = one_thread(&place, &format!("b{r}"), p, &ids, p.baseline_flows, one, false)?;
            all_passed &= passed(&run["check"]);
            baseline.push(run);
        }
        if p.hold_transaction {
            // The same two runs again, right after, with another session's transaction open.
            let held = HeldTransaction::open(&location.conn)?;
            let mut run = one_thread(&place, &format!("hg{r}"), p, &ids, p.flows, group, false)?;
            run["held_transaction"] = held.seen(&location.conn)?;
            all_passed &= passed(&run["check"]);
            held_sequential.push(run);
            let mut run = three_threads(&place, &format!("hp{r}"), p, &ids, group)?;
            run["held_transaction"] = held.seen(&location.conn)?;
            all_passed &= passed(&run["check"]);
            held_pipelined.push(run);
            held.close()?;
        }
        progress.advance(1, &format!("run {} of {}", r + 1, p.repeat));
    }
    progress.finish(if all_passed { "every check passed" } else { "a check failed" });
    let held = p.hold_transaction.then(|| {
        let (open, closed) = (held_sequential.series.median().unwrap_or(0.0), sequential.series.median().unwrap_or(0.0));
        let (open_p, closed_p) = (held_pipelined.series.median().unwrap_or(0.0), pipelined.series.median().unwrap_or(0.0));
        json!({
            "what": "each run of the repeat again, right after it, while another session holds a transaction \
                     (BEGIN; SELECT txid_current()) open: dead row versions cannot be removed anywhere on the server",
            "group_commit": held_sequential.series.json(group, "one thread, a transaction held open by another session"),
            "pipelined": held_pipelined.series.json(group, "three threads, a transaction held open by another session"),
            "group_commit_held_to_free_ratio": (closed > 0.0).then(|| round3(open / closed)),
            "pipelined_held_to_free_ratio": (closed_p > 0.0).then(|| round3(open_p / closed_p)),
        })
    });
    let rate = sequential.series.median().unwrap_or(0.0);
    let pipelined_rate = pipelined.series.median().unwrap_or(0.0);
    let baseline_rate = baseline.series.median();
    let event_at_a_time_rate = event_at_a_time.series.median().unwrap_or(0.0);
    let best = rate.max(pipelined_rate);
    let one_client = ceilings["one_client"]["commits_per_s"].as_f64();
    let eight_clients = ceilings["eight_clients"]["commits_per_s"].as_f64();
    let ratio = |a: f64, b: Option<f64>| b.filter(|b| *b > 0.0).map(|b| round3(a / b));
    let out = json!({
        "outcome": "bench",
        "store": location.masked,
        "durability": "the PostgreSQL server's own (never changed by tidemark)",
        "server": settings,
        "params": {
            "flows": p.flows,
            "events_per_flow": p.events_per_flow,
            "batch": p.batch,
            "baseline_flows": p.baseline_flows,
            "consumers": p.consumers,
            "repeat": p.repeat,
            "pgbench_seconds": p.pgbench_seconds,
            "hold_transaction": p.hold_transaction,
            "available_parallelism": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "load_average_at_start": load,
            "load_average_at_end": load_average(),
        },
        "ceilings": ceilings,
        "group_commit": sequential.series.json(group, "one thread: each wave advanced, then relayed, then drained"),
        "event_at_a_time": event_at_a_time.series.json(group, "the group_commit run with the handler applying one event at a time (no batches)"),
        "pipelined": pipelined.series.json(group, "three threads (producer, relay, consumer), each with its own connections"),
        "one_per_op": (p.baseline_flows > 0).then(|| baseline.series.json(one, "one thread, one transaction per operation")),
        "held_transaction": held,
        "summary": {
            "end_to_end_events_per_s": rate,
            "pipelined_end_to_end_events_per_s": pipelined_rate,
            "one_per_op_events_per_s": baseline_rate,
            "group_commit_ratio": ratio(rate, baseline_rate),
            "event_at_a_time_events_per_s": event_at_a_time_rate,
            "handler_batches_ratio": ratio(rate, Some(event_at_a_time_rate)),
            "pgbench_one_client_commits_per_s": one_client,
            "pgbench_eight_clients_commits_per_s": eight_clients,
            "best_to_pgbench_one_client_ratio": ratio(best, one_client),
            "best_to_pgbench_eight_clients_ratio": ratio(best, eight_clients),
            "rates_are": "medians over --repeat runs, events per second of wall time",
            "targets": {
                "events_per_s_at_least_10x_pgbench_one_client": ratio(best, one_client).map(|r| r >= 10.0),
            },
        },
        "check": {
            "passed": all_passed,
            "what": "every run: effects == events x consumers, no duplicate effect, every delivery accepted",
        },
        "schemas_dropped": cleanup.finish(),
    });
    Ok(out)
}
