//! Schedules on PostgreSQL (`ScheduleStore for PgWorkflows`): put, due, fire with its
//! compare-and-set on the next tick (a stale plan writes nothing, two tickers racing on two
//! connections start each tick once), pause and resume, delete, and bad input refused.

use std::collections::BTreeMap;
use std::sync::{Arc, Barrier};

use serde_json::json;
use tidemark_core::error::codes;
use tidemark_core::schedule::{
    schedule_codes, tick, CatchUp, Fired, ScheduleSpec, ScheduleStore, Timing, SCHEDULE_ID_BYTES_MAX,
};
use tidemark_core::workflow::{RunFilter, StartOutcome, WorkflowStore};

use super::support::test_db;
use crate::PgWorkflows;

fn every(id: &str, ms: i64, catch_up: CatchUp) -> ScheduleSpec {
    ScheduleSpec {
        schedule_id: id.into(),
        workflow: "report".into(),
        input: json!({"x": 1}),
        timing: Timing::IntervalMs(ms),
        timezone: "UTC".into(),
        catch_up,
    }
}

fn run_ids(store: &PgWorkflows) -> Vec<String> {
    store.list_runs(&RunFilter::default(), 1_000).unwrap().into_iter().map(|r| r.run_id).collect()
}

fn versions() -> BTreeMap<String, u32> {
    BTreeMap::from([("report".to_string(), 3)])
}

#[test]
fn a_schedule_fires_each_tick_once_and_a_stale_plan_writes_nothing() {
    let db = test_db!("sched_fire");
    let schema = db.schema("wf");
    let mut store = PgWorkflows::init(&db.conn, &schema).unwrap();
    let created = store.put_schedule(&every("beat", 10_000, CatchUp::One), 1_000_000).unwrap();
    assert_eq!((created.next_tick_at_ms, created.created_at_ms, created.paused), (Some(1_010_000), 1_000_000, false));
    assert!(store.due_schedules(1_009_999, 10).unwrap().is_empty());
    let due = store.due_schedules(1_010_000, 10).unwrap();
    assert_eq!(due, std::slice::from_ref(&created));
    // Two plans made from the same view: the first fires, the second is stale and writes nothing.
    let plan = due[0].plan(1_010_000, 3).unwrap().unwrap();
    let mut other = PgWorkflows::open(&db.conn, &schema).unwrap();
    match other.fire(&plan, 1_010_000).unwrap() {
        Fired::Fired(outcomes) => assert_eq!(outcomes, [StartOutcome::Started { run_id: "beat:1010000".into() }]),
        Fired::Stale => panic!("the first fire is not stale"),
    }
    assert_eq!(store.fire(&plan, 1_010_000).unwrap(), Fired::Stale);
    assert_eq!(run_ids(&store), ["beat:1010000"]);
    let run = store.run("beat:1010000").unwrap().unwrap().run;
    assert_eq!((run.workflow.as_str(), run.version, run.input), ("report", 3, json!({"x": 1})));
    let s = store.schedule("beat").unwrap().unwrap();
    assert_eq!((s.ticks_started, s.last_started_tick_ms, s.next_tick_at_ms), (1, Some(1_010_000), Some(1_020_000)));
    // Down for 100 s: ticks 1,020,000..=1,120,000 are due, the four before 1,060,000 missed (over
    // 60 s late); one pass starts the latest missed one and the seven on time.
    let report = tick(&mut store, &versions(), 1_120_000).unwrap();
    assert_eq!((report.fired, report.started, report.skipped), (1, 8, 3), "{report:?}");
    let s = store.schedule("beat").unwrap().unwrap();
    assert_eq!((s.ticks_started, s.ticks_skipped, s.next_tick_at_ms), (9, 3, Some(1_130_000)));
    // Paused: not due; resumed: from the next tick after now.
    assert!(store.pause_schedule("beat", true, 1_121_000).unwrap().paused);
    assert!(store.due_schedules(1_200_000, 10).unwrap().is_empty());
    assert_eq!(tick(&mut store, &versions(), 1_200_000).unwrap().fired, 0);
    let resumed = other.pause_schedule("beat", false, 1_200_000).unwrap();
    assert_eq!((resumed.paused, resumed.next_tick_at_ms), (false, Some(1_210_000)));
    // A plan made before the pause is stale after it.
    let before_pause = store.schedule("beat").unwrap().unwrap().plan(1_210_000, 3).unwrap().unwrap();
    store.pause_schedule("beat", true, 1_205_000).unwrap();
    assert_eq!(other.fire(&before_pause, 1_210_000).unwrap(), Fired::Stale);
    // Replacing keeps the counters and the creation time; an unregistered workflow stays due.
    let replaced = store
        .put_schedule(&ScheduleSpec { workflow: "nobody".into(), ..every("beat", 5_000, CatchUp::All) }, 1_300_000)
        .unwrap();
    assert_eq!((replaced.ticks_started, replaced.created_at_ms, replaced.paused), (9, 1_000_000, true));
    store.pause_schedule("beat", false, 1_300_000).unwrap();
    assert_eq!(tick(&mut store, &versions(), 1_400_000).unwrap().unregistered, ["beat"]);
    assert_eq!(store.schedules().unwrap().len(), 1);
    assert!(store.delete_schedule("beat").unwrap());
    assert!(!store.delete_schedule("beat").unwrap());
    assert!(store.schedule("beat").unwrap().is_none());
    assert_eq!(run_ids(&store).len(), 9, "the runs a schedule started stay");
}

/// Four tickers on four connections pass over the same due schedules at the same moments: every
/// tick's run is started exactly once, and the fires the others lost are `stale`.
#[test]
fn tickers_racing_on_several_connections_start_each_tick_once() {
    let db = test_db!("sched_race");
    let schema = db.schema("wf");
    let mut store = PgWorkflows::init(&db.conn, &schema).unwrap();
    for i in 0..5 {
        store.put_schedule(&every(&format!("s{i}"), 1_000, CatchUp::All), 0).unwrap();
    }
    const TICKERS: usize = 4;
    let mut reports = Vec::new();
    for pass in 1..=5_i64 {
        let barrier = Arc::new(Barrier::new(TICKERS));
        let handles: Vec<_> = (0..TICKERS)
            .map(|_| {
                let mut ticker = PgWorkflows::open(&db.conn, &schema).unwrap();
                let barrier = barrier.clone();
                std::thread::spawn(move || {
                    barrier.wait();
                    tick(&mut ticker, &versions(), pass * 1_000).unwrap()
                })
            })
            .collect();
        reports.extend(handles.into_iter().map(|h| h.join().unwrap()));
    }
    let started: u64 = reports.iter().map(|r| r.started).sum();
    let existing: u64 = reports.iter().map(|r| r.existing).sum();
    assert_eq!(started, 25, "5 schedules x 5 ticks, each started once: {reports:?}");
    assert_eq!(existing, 0, "a losing ticker writes nothing (stale), not a second start");
    assert_eq!(run_ids(&store).len(), 25);
    for s in store.schedules().unwrap() {
        assert_eq!((s.ticks_started, s.next_tick_at_ms), (5, Some(6_000)), "{}", s.spec.schedule_id);
    }
}

#[test]
fn bad_schedules_are_refused_and_write_nothing() {
    let db = test_db!("sched_bad");
    let mut store = PgWorkflows::init(&db.conn, &db.schema("wf")).unwrap();
    for (bad, expected) in [
        (
            ScheduleSpec { timing: Timing::Cron("not a cron".into()), ..every("bad", 1_000, CatchUp::One) },
            schedule_codes::INVALID_SCHEDULE,
        ),
        (
            ScheduleSpec { timing: Timing::IntervalMs(10), ..every("bad", 1_000, CatchUp::One) },
            schedule_codes::INVALID_SCHEDULE,
        ),
        (
            ScheduleSpec { timezone: "Nowhere/City".into(), ..every("bad", 1_000, CatchUp::One) },
            schedule_codes::INVALID_SCHEDULE,
        ),
        (every(&"s".repeat(SCHEDULE_ID_BYTES_MAX + 1), 1_000, CatchUp::One), schedule_codes::INVALID_SCHEDULE),
        (every("bad id", 1_000, CatchUp::One), codes::INVALID_ID),
        (ScheduleSpec { input: json!("x".repeat(300 * 1024)), ..every("big", 1_000, CatchUp::One) }, "invalid_input"),
    ] {
        let error = store.put_schedule(&bad, 0).unwrap_err();
        assert_eq!(error.code(), expected, "{error}");
    }
    assert!(store.schedules().unwrap().is_empty());
    assert_eq!(store.pause_schedule("nope", true, 0).unwrap_err().code(), codes::NOT_FOUND);
    assert_eq!(store.schedule("bad id").unwrap_err().code(), codes::INVALID_ID);
    assert_eq!(store.due_schedules(0, 0).unwrap_err().code(), codes::LIMIT_EXCEEDED);
    // A cron schedule in a time zone round-trips.
    let cron = ScheduleSpec {
        timing: Timing::Cron("0 9 * * *".into()),
        timezone: "Europe/Paris".into(),
        ..every("daily", 1_000, CatchUp::Skip)
    };
    let stored = store.put_schedule(&cron, 1_796_083_200_000).unwrap();
    assert_eq!(stored.spec, cron);
    assert_eq!(stored.next_tick_at_ms, Some(1_796_083_200_000 + 8 * 3_600_000));
}
