//! Queues on PostgreSQL (`QueueStore for PgWorkflows` and the admission claims do): declared
//! queues only, deduplication ids, admission by priority then age, the concurrency and rate limits
//! as one budget for every connection (claims racing on six connections never admit past it),
//! positions of waiting runs, and the admission query's index.

use std::sync::{Arc, Barrier};

use serde_json::json;
use tidemark_core::error::codes;
use tidemark_core::queue::{queue_codes, QueueSpec, QueueStore, QUEUE_LIMIT_MAX};
use tidemark_core::workflow::{
    ClaimRequest, FinishStatus, JournalOp, JournalWrite, RunFilter, StartOutcome, StartRequest, SuspendStatus,
    WorkflowStore, WorkflowVersion, WriteResult,
};

use super::support::test_db;
use crate::PgWorkflows;

fn queued(run_id: &str, queue: &str, priority: i32, dedup: Option<&str>) -> StartRequest {
    StartRequest::new(run_id, "hold", 1, json!({})).in_queue(queue, priority, dedup)
}

fn claim(store: &mut PgWorkflows, worker: &str, limit: usize, now_ms: i64) -> Vec<String> {
    let request = ClaimRequest {
        worker_id: worker.into(),
        workflows: vec![WorkflowVersion { workflow: "hold".into(), version: 1, concurrency_max: None }],
        limit,
        lease_ms: 1_000,
    };
    store.claim(&request, now_ms).unwrap().into_iter().map(|c| c.run.run_id).collect()
}

fn token(store: &mut PgWorkflows, run_id: &str) -> String {
    let query = format!("SELECT lease_token FROM \"{}\".runs WHERE run_id = $1", store.schema());
    store.client().query_one(&query, &[&run_id]).unwrap().get(0)
}

fn finish(store: &mut PgWorkflows, run_id: &str, now_ms: i64) {
    let token = token(store, run_id);
    let op = JournalOp::Finish { status: FinishStatus::Completed, result: None, error: None };
    let results = store.commit(vec![JournalWrite { run_id: run_id.into(), lease_token: token, op }], now_ms).unwrap();
    assert_eq!(results, [WriteResult::Done]);
}

#[test]
fn starts_through_a_queue_need_it_declared_and_a_free_dedup_id() {
    let db = test_db!("q_start");
    let mut store = PgWorkflows::init(&db.conn, &db.schema("wf")).unwrap();
    assert_eq!(store.put_queue(&QueueSpec::new("mail"), 0).unwrap(), QueueSpec::new("mail"));
    let started = store.start_runs(&[queued("first", "mail", 0, Some("welcome-42"))], 1_000).unwrap();
    assert_eq!(started, [StartOutcome::Started { run_id: "first".into() }]);
    let refused = store.start_runs(&[queued("second", "mail", 0, Some("welcome-42"))], 1_001).unwrap_err();
    assert_eq!(refused.code(), queue_codes::DEDUPLICATED, "{refused}");
    assert!(refused.to_string().contains("first"), "names the run that holds it: {refused}");
    let twice = [queued("a", "mail", 0, Some("d")), queued("b", "mail", 0, Some("d"))];
    assert_eq!(store.start_runs(&twice, 1_002).unwrap_err().code(), queue_codes::DEDUPLICATED);
    let unknown = store.start_runs(&[queued("ok", "mail", 0, None), queued("third", "nowhere", 0, None)], 1_003);
    assert_eq!(unknown.unwrap_err().code(), queue_codes::UNKNOWN_QUEUE);
    let both = StartRequest { key: Some("k".into()), ..queued("keyed", "mail", 0, None) };
    assert_eq!(store.start_runs(&[both], 1_004).unwrap_err().code(), codes::INVALID_ARGUMENT);
    assert_eq!(store.list_runs(&RunFilter::default(), 10).unwrap().len(), 1, "nothing else was written");
    // Its run ended: the id is free again; starting the same run again is `existing`.
    assert_eq!(claim(&mut store, "w", 10, 2_000), ["first"]);
    finish(&mut store, "first", 2_001);
    let again = store.start_runs(&[queued("second", "mail", 0, Some("welcome-42"))], 3_000).unwrap();
    assert_eq!(again, [StartOutcome::Started { run_id: "second".into() }]);
    assert!(matches!(
        store.start_runs(&[queued("second", "mail", 0, Some("welcome-42"))], 3_001).unwrap()[0],
        StartOutcome::Existing { .. }
    ));
    // Bad declarations are refused.
    for bad in [QueueSpec::new("mail").concurrency(0), QueueSpec::new("mail").rate(1, 0), QueueSpec::new("bad name")] {
        assert!(store.put_queue(&bad, 0).unwrap_err().is_invalid_input(), "{bad:?}");
    }
    let big = QueueSpec::new("big").concurrency(QUEUE_LIMIT_MAX).rate(QUEUE_LIMIT_MAX, 1);
    assert_eq!(store.put_queue(&big, 0).unwrap(), big, "the largest limits round-trip");
    assert_eq!(store.queue("big", 10, 0).unwrap().unwrap().spec, big);
    assert!(store.queue("nope", 10, 0).unwrap().is_none());
}

/// Two starts with one dedup id on two connections at the same moment: one run, one refusal.
#[test]
fn concurrent_starts_with_one_dedup_id_start_one_run() {
    let db = test_db!("q_dedup_race");
    let schema = db.schema("wf");
    let mut store = PgWorkflows::init(&db.conn, &schema).unwrap();
    store.put_queue(&QueueSpec::new("mail"), 0).unwrap();
    for round in 0..10 {
        let barrier = Arc::new(Barrier::new(2));
        let handles: Vec<_> = (0..2)
            .map(|i| {
                let mut other = PgWorkflows::open(&db.conn, &schema).unwrap();
                let barrier = barrier.clone();
                std::thread::spawn(move || {
                    barrier.wait();
                    let request = queued(&format!("r{round}-{i}"), "mail", 0, Some(&format!("d{round}")));
                    other.start_runs(&[request], 1_000).map(|o| o.len())
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let refused: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
        assert_eq!(refused.len(), 1, "round {round}: {results:?}");
        assert_eq!(refused[0].code(), queue_codes::DEDUPLICATED, "round {round}: {results:?}");
    }
    assert_eq!(store.list_runs(&RunFilter::default(), 100).unwrap().len(), 10);
}

#[test]
fn a_queue_admits_by_priority_then_age_within_its_limits() {
    let db = test_db!("q_admit");
    let mut store = PgWorkflows::init(&db.conn, &db.schema("wf")).unwrap();
    store.put_queue(&QueueSpec::new("single").concurrency(1), 0).unwrap();
    for (id, priority, at) in [("low", 5, 1_000), ("urgent", -1, 1_001), ("mid", 3, 1_002), ("mid-later", 3, 1_003)] {
        store.start_runs(&[queued(id, "single", priority, None)], at).unwrap();
    }
    let state = store.queue("single", 100, 2_000).unwrap().unwrap();
    let positions: Vec<(u64, &str)> = state.next.iter().map(|r| (r.position, r.run_id.as_str())).collect();
    assert_eq!(positions, [(1, "urgent"), (2, "mid"), (3, "mid-later"), (4, "low")]);
    let mut order = Vec::new();
    for step in 0..4 {
        let now = 2_000 + step * 10;
        let claimed = claim(&mut store, "w", 10, now);
        assert_eq!(claimed.len(), 1, "one at a time: {claimed:?}");
        assert!(claim(&mut store, "w2", 10, now).is_empty(), "the queue is full");
        let run = store.run(&claimed[0]).unwrap().unwrap().run;
        assert_eq!((run.queue.as_deref(), run.admitted_at_ms), (Some("single"), Some(now)));
        // An admitted run that sleeps still holds its place; its end frees it.
        let token = token(&mut store, &claimed[0]);
        let sleep = JournalOp::Suspend { status: SuspendStatus::Sleeping, wake_at_ms: now + 1, waiting_for: None };
        let write = JournalWrite { run_id: claimed[0].clone(), lease_token: token, op: sleep };
        store.commit(vec![write], now).unwrap();
        assert_eq!(store.queue("single", 0, now).unwrap().unwrap().in_progress, 1);
        assert_eq!(claim(&mut store, "w", 10, now + 1), claimed, "the admitted run comes back, nobody else");
        finish(&mut store, &claimed[0], now + 2);
        order.push(claimed[0].clone());
    }
    assert_eq!(order, ["urgent", "mid", "mid-later", "low"]);
    let state = store.queue("single", 100, 3_000).unwrap().unwrap();
    assert_eq!((state.in_progress, state.waiting), (0, 0), "{state:?}");

    // Two admissions an hour: the others wait, in order, with their positions.
    store.put_queue(&QueueSpec::new("trickle").rate(2, 3_600_000), 0).unwrap();
    for i in 0..5 {
        store.start_runs(&[queued(&format!("t{i}"), "trickle", 0, None)], 10_000 + i).unwrap();
    }
    assert_eq!(claim(&mut store, "w", 10, 20_000), ["t0", "t1"]);
    let state = store.queue("trickle", 100, 20_000).unwrap().unwrap();
    assert_eq!((state.admitted_in_period, state.waiting, state.in_progress), (2, 3, 2), "{state:?}");
    finish(&mut store, "t0", 20_001);
    finish(&mut store, "t1", 20_001);
    assert!(claim(&mut store, "w", 10, 30_000).is_empty(), "the period's admissions are spent");
    let state = store.queue("trickle", 100, 30_000).unwrap().unwrap();
    assert_eq!((state.admitted_in_period, state.waiting, state.in_progress), (2, 3, 0), "{state:?}");
    let positions: Vec<(u64, &str)> = state.next.iter().map(|r| (r.position, r.run_id.as_str())).collect();
    assert_eq!(positions, [(1, "t2"), (2, "t3"), (3, "t4")]);
    assert_eq!(claim(&mut store, "w", 10, 20_000 + 3_600_000), ["t2", "t3"], "a new period admits again");
    let all = store.queues(20_000 + 3_600_000).unwrap();
    let names: Vec<&str> = all.iter().map(|q| q.spec.name.as_str()).collect();
    assert_eq!(names, ["single", "trickle"]);
}

/// Six connections claim at the same moment from a queue with room for three: exactly three runs
/// are admitted in all, round after round (the queue's lock makes each claim count the others'
/// committed admissions).
#[test]
fn a_queues_room_is_one_budget_for_claims_racing_on_many_connections() {
    let db = test_db!("q_race");
    let schema = db.schema("wf");
    let mut store = PgWorkflows::init(&db.conn, &schema).unwrap();
    store.put_queue(&QueueSpec::new("narrow").concurrency(3), 0).unwrap();
    let requests: Vec<StartRequest> = (0..30).map(|i| queued(&format!("q{i:02}"), "narrow", 0, None)).collect();
    store.start_runs(&requests, 1_000).unwrap();
    const THREADS: usize = 6;
    for round in 0..5_i64 {
        let now = 10_000 + round * 100;
        let barrier = Arc::new(Barrier::new(THREADS));
        let handles: Vec<_> = (0..THREADS)
            .map(|i| {
                let mut other = PgWorkflows::open(&db.conn, &schema).unwrap();
                let barrier = barrier.clone();
                std::thread::spawn(move || {
                    barrier.wait();
                    claim(&mut other, &format!("w{i}"), 2, now)
                })
            })
            .collect();
        let mut claimed: Vec<String> = handles.into_iter().flat_map(|h| h.join().unwrap()).collect();
        claimed.sort();
        assert_eq!(claimed.len(), 3, "round {round}: {claimed:?}");
        claimed.dedup();
        assert_eq!(claimed.len(), 3, "round {round}: a run was claimed twice");
        let state = store.queue("narrow", 0, now).unwrap().unwrap();
        assert_eq!(state.in_progress, 3, "round {round}");
        for run_id in &claimed {
            finish(&mut store, run_id, now + 1);
        }
    }
    assert_eq!(store.queue("narrow", 0, 20_000).unwrap().unwrap().waiting, 15);
}

#[test]
fn the_admission_reads_its_indexes() {
    let db = test_db!("q_explain");
    let schema = db.schema("wf");
    PgWorkflows::init(&db.conn, &schema).unwrap();
    let mut client = db.client();
    let s = format!("\"{schema}\"");
    client
        .batch_execute(&format!(
            "INSERT INTO {s}.queues (name, concurrency_max, created_at_ms, updated_at_ms)
               SELECT 'q' || g, 10, 0, 0 FROM generate_series(0, 9) g;
             INSERT INTO {s}.runs (run_id, workflow, version, input, input_hash, status, wake_at_ms,
                                   created_at_ms, updated_at_ms, queue, priority, admitted_at_ms, finished_at_ms)
               SELECT 'r' || g, 'hold', 1, '{{}}', 'h', CASE WHEN g % 5 = 0 THEN 'completed' ELSE 'pending' END,
                      g, g, g, 'q' || (g % 10), g % 3, CASE WHEN g % 4 = 0 THEN g END,
                      CASE WHEN g % 5 = 0 THEN g END
               FROM generate_series(1, 100000) g;
             ANALYZE {s}.runs; ANALYZE {s}.queues;"
        ))
        .unwrap();
    let plan = |client: &mut postgres::Client, template: &str, args: &str| -> String {
        client.batch_execute("DEALLOCATE ALL").unwrap();
        client.batch_execute(&format!("PREPARE p AS {}", crate::schema::sql(&schema, template))).unwrap();
        let rows = client.query(&format!("EXPLAIN EXECUTE p({args})"), &[]).unwrap();
        let text = rows.iter().map(|r| r.get::<_, String>(0)).collect::<Vec<_>>().join("\n");
        println!("---- {}\n{text}", template.lines().next().unwrap_or(""));
        text
    };
    let admit =
        plan(&mut client, crate::workflow::queues::ADMISSIBLE_SQL, "'q3', 50000, ARRAY['hold'], ARRAY[1::bigint], 10");
    assert!(admit.contains("runs_queue_waiting") && !admit.contains("Seq Scan on runs"), "{admit}");
    let counted = plan(
        &mut client,
        "SELECT count(*) FROM {s}.runs WHERE queue = $1 AND admitted_at_ms IS NOT NULL
           AND status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating')",
        "'q3'",
    );
    assert!(counted.contains("runs_queue_admitted") && !counted.contains("Seq Scan on runs"), "{counted}");
}
