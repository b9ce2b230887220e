//! `tidemark chaos`: the short CI mode (a fixed set of seeds, a few faults each, on real
//! `tidemark serve` processes; the independent checker finds nothing), the checker's teeth (an
//! acknowledged operation the files do not hold, a doubled effect row and a doubled charge are
//! each reported) and the typed errors of bad input. No assertion is about wall-clock time;
//! every wait is the command's own bounded one.

use std::path::Path;

use serde_json::{json, Value};

use crate::support::{path_str, run, Run};

/// The CI mode's seeds: each schedules SIGKILLs and SIGSTOPs on both processes.
const CI_SEEDS: [u64; 3] = [1, 2, 3];
/// A seed whose 4 faults of the kinds SIGKILL and clock jump jump a clock forward and one back.
const CLOCK_SEED: u64 = 16;
/// A seed whose 4 I/O errors are a full disk, failing fsyncs (twice) and failing writes.
const IO_ERROR_SEED: u64 = 2;
/// A seed whose 6 faults on 2 servers and 2 worker processes hit the worker processes 3 times.
const WORKERS_SEED: u64 = 5;
/// A seed whose 6 faults of every process kind on 2 servers and 2 workers include a power loss
/// (the second fault), a forward clock jump of a worker (1.4 s) and three pauses of workers (a
/// seed whose last fault is a power loss leaves the workers no graceful stop to count claims by).
const WORKERS_FAULTS_SEED: u64 = 46;
/// A seed whose 5 partitions fail the link in every way: a flap, answers lost twice, a black
/// hole, a cut.
const PARTITION_SEED: u64 = 1;
/// A seed whose 7 faults of the kinds partition and remote-kill are partitions of every mode and
/// at least one kill of the remote server.
const BROKER_SEED: u64 = 8;
/// A seed whose 4 faults of the kinds sigkill and remote-kill kill a server and the remote one.
const REMOTE_KILL_SEED: u64 = 8;

fn chaos(out: &Path, seed: u64, duration_s: u32, faults: u32) -> Run {
    run(&[
        "chaos",
        "--seed",
        &seed.to_string(),
        "--duration-s",
        &duration_s.to_string(),
        "--faults",
        &faults.to_string(),
        "--processes",
        "2",
        "--clients",
        "4",
        "--out",
        path_str(out),
    ])
}

/// A run whose faults are power losses (and, with `sigkill`, kills), on servers of the given
/// durability.
fn power_chaos(out: &Path, seed: u64, kinds: &str, durability: &str, faults: u32) -> Run {
    power_chaos_with(out, seed, kinds, durability, faults, &[])
}

/// [`power_chaos`] with more options.
fn power_chaos_with(out: &Path, seed: u64, kinds: &str, durability: &str, faults: u32, more: &[&str]) -> Run {
    let seed = seed.to_string();
    let faults = faults.to_string();
    let args = [
        "chaos",
        "--seed",
        &seed,
        "--duration-s",
        "8",
        "--faults",
        &faults,
        "--kinds",
        kinds,
        "--durability",
        durability,
        "--processes",
        "2",
        "--clients",
        "4",
        "--converge-timeout-s",
        "30",
        "--out",
        path_str(out),
    ];
    run(&[&args[..], more].concat())
}

fn check(out: &Path) -> Run {
    run(&["chaos", "check", "--out", path_str(out), "--seed", "9"])
}

fn violations(report: &Value, kind: &str) -> u64 {
    report["check"]["by_kind"][kind].as_u64().unwrap_or_else(|| panic!("no {kind} count: {report:#}"))
}

#[test]
fn chaos_ci_seeds_lose_nothing_and_apply_nothing_twice() {
    let mut kinds = std::collections::BTreeSet::new();
    for seed in CI_SEEDS {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path().join("run");
        let r = chaos(&out, seed, 8, 3);
        println!("tidemark chaos --seed {seed}: {}", r.json);
        assert_eq!(r.code, 0, "seed {seed}:\n{}\n{}", r.stdout, r.stderr);
        let report = &r.json;
        assert_eq!(report["outcome"], "passed", "seed {seed}: {report:#}");
        assert_eq!(report["check"]["passed"], true, "seed {seed}: {report:#}");
        assert_eq!(report["faults"]["injected"], 3, "seed {seed}: {report:#}");
        assert_eq!(report["operations"]["lost"], 0, "seed {seed}: {report:#}");
        assert_eq!(report["operations"]["applied_twice"], 0, "seed {seed}: {report:#}");
        assert!(report["operations"]["advances"].as_u64().unwrap() > 0, "seed {seed}: {report:#}");
        // Some of them appends to event streams.
        assert!(report["operations"]["appends"].as_u64().unwrap() > 0, "seed {seed}: {report:#}");
        assert!(report["operations"]["starts"].as_u64().unwrap() > 0, "seed {seed}: {report:#}");
        // Batches of child workflows ran too, and every one of them completed.
        assert!(report["operations"]["batches"].as_u64().unwrap() > 0, "seed {seed}: {report:#}");
        // Order sagas went through the queue.
        assert!(report["check"]["ledger"]["queued"].as_u64().unwrap() > 0, "seed {seed}: {report:#}");
        // Batches told their waiters (`ctx.send`), and the waiters went on.
        assert!(report["operations"]["waiters"].as_u64().unwrap() > 0, "seed {seed}: {report:#}");
        assert!(report["check"]["waiters_by_outcome"]["approved"].as_u64().unwrap() > 0, "seed {seed}: {report:#}");
        // The schedule ticked, each tick an order of its own.
        assert!(report["check"]["ticks"].as_u64().unwrap() > 0, "seed {seed}: {report:#}");
        assert_eq!(report["check"]["batches_by_status"]["completed"], report["operations"]["batches"]);
        // Clients cancelled some of their starts.
        assert!(report["operations"]["cancels"].as_u64().unwrap() > 0, "seed {seed}: {report:#}");
        // Operators retried, skipped, forked or abandoned the orders that failed for them.
        assert!(report["operations"]["controls"].as_u64().unwrap() > 0, "seed {seed}: {report:#}");
        let ops = &report["operations"];
        assert_eq!(
            ops["ledger_entries"].as_u64().unwrap(),
            ops["acknowledged"].as_u64().unwrap()
                + ops["cancels_unanswered"].as_u64().unwrap()
                + ops["controls_unanswered"].as_u64().unwrap(),
            "every acknowledged operation and every cancel or control that may have committed is in the ledger: {report:#}"
        );
        // The schedule is the seed's: a second derivation prints the same one.
        let schedule: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("schedule.json")).expect("schedule")).unwrap();
        let injected = report["faults"]["schedule"].as_array().unwrap();
        for (planned, done) in schedule.as_array().unwrap().iter().zip(injected) {
            assert_eq!(planned["kind"], done["kind"]);
            assert_eq!(planned["process"], done["process"]);
            kinds.insert(done["kind"].as_str().unwrap().to_string());
        }
    }
    // The seeds are chosen so that the CI mode kills and pauses.
    assert_eq!(kinds.into_iter().collect::<Vec<_>>(), ["sigkill", "sigstop"]);
}

#[test]
fn chaos_schedule_is_derived_from_the_seed_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    // Two short runs of one seed write the same schedule (the faults' due times included).
    for out in [&a, &b] {
        let r = chaos(out, 42, 1, 2);
        r.assert_exit(0);
    }
    let read = |out: &Path| std::fs::read_to_string(out.join("schedule.json")).expect("schedule");
    assert_eq!(read(&a), read(&b));
}

#[test]
fn chaos_checker_reports_a_lost_operation_a_doubled_effect_and_a_doubled_charge() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let r = chaos(&out, 7, 3, 0);
    r.assert_exit(0);
    let clean = check(&out);
    assert_eq!(clean.code, 0, "{}", clean.stdout);
    assert_eq!(clean.json["check"]["passed"], true, "{}", clean.stdout);
    let peak = clean.json["check"]["queue_peak"].as_u64().expect("a queue peak on SQLite");
    assert!((1..=8).contains(&peak), "queue runs held at most its 8 slots: {}", clean.stdout);

    // An acknowledged advance the store does not hold is lost.
    let ledger = out.join("ledger.jsonl");
    let mut text = std::fs::read_to_string(&ledger).expect("ledger");
    text.push_str(
        r#"{"kind":"advance","flow_id":"never-1","seq":1,"event_id":"0190-none","state":"reserved","quantity":1,"process":0,"at_ms":1}"#,
    );
    text.push('\n');
    text.push_str(
        r#"{"kind":"start","run_id":"never-run","fail":null,"expect":"completed","quantity":1,"process":1,"at_ms":2}"#,
    );
    text.push('\n');
    std::fs::write(&ledger, text).expect("ledger");
    let lost = check(&out);
    assert_eq!(lost.code, 1, "{}", lost.stdout);
    assert_eq!(lost.json["outcome"], "violations");
    assert_eq!(violations(&lost.json, "lost"), 2, "{}", lost.stdout);
    assert_eq!(lost.json["lost"], 2);
    let listed = lost.json["check"]["first_violations"].to_string();
    assert!(listed.contains("never-1#1") && listed.contains("never-run"), "{listed}");
    assert!(listed.contains("(seed 9)"), "each violation names the seed: {listed}");

    // A doubled effect row of the reservation consumer and a doubled charge, in the files.
    let tenant = out.join("data").join("tenants").join("chaos");
    let inbox = rusqlite::Connection::open(tenant.join("inbox.db")).expect("inbox.db");
    let doubled = inbox
        .execute(
            "INSERT INTO reservation_effects (consumer_id, source, flow_id, seq, event_id, kind, quantity)
             SELECT consumer_id, source, flow_id, seq, event_id, kind, quantity FROM reservation_effects
             ORDER BY effect_id LIMIT 1",
            [],
        )
        .expect("double an effect");
    assert_eq!(doubled, 1);
    drop(inbox);
    let payments = rusqlite::Connection::open(tenant.join("payments.db")).expect("payments.db");
    let charged = payments
        .execute(
            "INSERT INTO payment_calls (idempotency_key, op, order_id, amount, outcome)
             SELECT idempotency_key, op, order_id, amount, outcome FROM payment_calls
             WHERE outcome = 'charged' ORDER BY call_id LIMIT 1",
            [],
        )
        .expect("double a charge");
    assert_eq!(charged, 1);
    drop(payments);
    // And a run started through the queue that completed with no admission written.
    let workflows = rusqlite::Connection::open(tenant.join("workflows.db")).expect("workflows.db");
    let queued: String = workflows
        .query_row(
            "SELECT run_id FROM runs WHERE queue = 'chaos-q' AND status = 'completed' ORDER BY run_id LIMIT 1",
            [],
            |row| row.get(0),
        )
        .expect("a queued run completed");
    workflows.execute("UPDATE runs SET admitted_at_ms = NULL WHERE run_id = ?1", [&queued]).expect("unadmit a run");
    drop(workflows);
    let twice = check(&out);
    assert_eq!(twice.code, 1, "{}", twice.stdout);
    // The doubled row is also out of order (its seq repeats).
    assert_eq!(violations(&twice.json, "applied_twice"), 2, "{}", twice.stdout);
    assert!(violations(&twice.json, "out_of_order") >= 1, "{}", twice.stdout);
    assert_eq!(violations(&twice.json, "unexpected_end"), 1, "{}", twice.stdout);
    let listed = twice.json["check"]["first_violations"].to_string();
    assert!(listed.contains(&format!("run {queued} ended completed without its queue admitting it")), "{listed}");

    // A schedule's tick moved 1 ms off its grid: its own tick started no run, and the moved run
    // is no tick (nor is it an order with effects: they are the original id's).
    let workflows = rusqlite::Connection::open(tenant.join("workflows.db")).expect("workflows.db");
    let tick: String = workflows
        .query_row("SELECT run_id FROM runs WHERE run_id LIKE 'chaos-tick:%' ORDER BY run_id LIMIT 1", [], |row| {
            row.get(0)
        })
        .expect("the schedule ticked");
    let at: i64 = tick.strip_prefix("chaos-tick:").unwrap().parse().unwrap();
    workflows
        .execute_batch(&format!(
            "PRAGMA foreign_keys = OFF; UPDATE runs SET run_id = 'chaos-tick:{}' WHERE run_id = '{tick}'",
            at + 1
        ))
        .expect("move a tick");
    drop(workflows);
    let moved = check(&out);
    assert_eq!(moved.code, 1, "{}", moved.stdout);
    let listed = moved.json["check"]["first_violations"].to_string();
    assert_eq!(violations(&moved.json, "lost"), 3, "the two of the ledger and the tick: {listed}");
    assert_eq!(violations(&moved.json, "unknown_effect"), 1, "{listed}");
    assert_eq!(violations(&moved.json, "wrong_effects"), 1, "{listed}");
    assert!(listed.contains(&format!("tick {at} (and 0 more)")), "{listed}");
    assert!(listed.contains(&format!("run chaos-tick:{} is no tick", at + 1)), "{listed}");

    // Nine runs that were not queued made the queue's, each with a last journal entry after
    // every other: their spans overlap at the end, one over the queue's limit of 8.
    let workflows = rusqlite::Connection::open(tenant.join("workflows.db")).expect("workflows.db");
    let changed = workflows
        .execute_batch(
            "CREATE TEMP TABLE nine AS SELECT run_id FROM runs
               WHERE workflow = 'order_saga' AND queue IS NULL AND parent_run_id IS NULL AND status = 'completed'
               ORDER BY run_id LIMIT 9;
             UPDATE runs SET queue = 'chaos-q', admitted_at_ms = created_at_ms WHERE run_id IN (SELECT run_id FROM nine);
             INSERT INTO journal (run_id, seq, name, kind, status, attempts, updated_at_ms)
               SELECT run_id, 900, 'late', 'external', 'completed', 1, 0 FROM nine;",
        )
        .and_then(|()| workflows.query_row("SELECT count(*) FROM temp.nine", [], |row| row.get::<_, i64>(0)));
    assert_eq!(changed.expect("queue nine runs"), 9);
    drop(workflows);
    let over = check(&out);
    assert_eq!(over.code, 1, "{}", over.stdout);
    let listed = over.json["check"]["first_violations"].to_string();
    assert_eq!(violations(&over.json, "queue_over_limit"), 1, "{listed}");
    assert!(over.json["check"]["queue_peak"].as_u64().unwrap() >= 9, "{}", over.stdout);
    assert!(listed.contains("queue chaos-q (concurrency_max 8) held"), "{listed}");

    // Two completed runs made to look cancelled: one a client cancelled (the ledger says so: a
    // cancel may end it cancelled, but not with its shipment left), one no client cancelled.
    let workflows = rusqlite::Connection::open(tenant.join("workflows.db")).expect("workflows.db");
    let pick = |n: usize| -> String {
        workflows
            .query_row(
                &format!(
                    "SELECT run_id FROM runs WHERE workflow = 'order_saga' AND queue IS NULL AND parent_run_id IS NULL
                     AND status = 'completed' ORDER BY run_id DESC LIMIT 1 OFFSET {n}"
                ),
                [],
                |row| row.get(0),
            )
            .expect("a completed order")
    };
    let (told, untold) = (pick(0), pick(1));
    workflows
        .execute("UPDATE runs SET status = 'cancelled' WHERE run_id IN (?1, ?2)", [&told, &untold])
        .expect("cancel two runs");
    drop(workflows);
    let mut text = std::fs::read_to_string(&ledger).expect("ledger");
    text.push_str(&format!(r#"{{"kind":"cancel","run_id":"{told}","status":200,"process":0,"at_ms":5}}"#));
    text.push('\n');
    std::fs::write(&ledger, text).expect("ledger");
    let cancelled = check(&out);
    assert_eq!(cancelled.code, 1, "{}", cancelled.stdout);
    let listed = cancelled.json["check"]["first_violations"].to_string();
    let more = |kind: &str| violations(&cancelled.json, kind) - violations(&over.json, kind);
    assert_eq!((more("wrong_effects"), more("unexpected_end")), (1, 1), "{listed}");
    assert!(listed.contains(&format!("run {told} ended cancelled with the effects")), "{listed}");
    assert!(listed.contains(&format!("run {untold} ended cancelled")), "{listed}");
}

#[test]
fn chaos_checker_reports_a_batch_order_run_twice_a_wrong_batch_result_and_a_broken_chain() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let r = chaos(&out, 7, 3, 0);
    r.assert_exit(0);
    assert!(r.json["operations"]["batches"].as_u64().unwrap() > 0, "{}", r.stdout);
    assert_eq!(r.json["check"]["batches_by_status"]["completed"], r.json["operations"]["batches"], "{}", r.stdout);

    let tenant = out.join("data").join("tenants").join("chaos");
    let workflows = rusqlite::Connection::open(tenant.join("workflows.db")).expect("workflows.db");
    let one = |sql: &str| -> String { workflows.query_row(sql, [], |row| row.get(0)).expect(sql) };
    // A chain of two runs (a batch of more than two orders, two per run), and a one-run batch.
    let continued = one("SELECT run_id FROM runs WHERE workflow = 'order_batch' AND status = 'continued' LIMIT 1");
    let whole = one(
        "SELECT run_id FROM runs WHERE workflow = 'order_batch' AND status = 'completed' AND run_id NOT LIKE '%.c%' LIMIT 1",
    );
    // A child of the one-run batch started twice: a copy of its row under another id.
    let child = one(&format!("SELECT run_id FROM runs WHERE parent_run_id = '{whole}' LIMIT 1"));
    workflows
        .execute_batch(&format!(
            "CREATE TEMP TABLE copy AS SELECT * FROM runs WHERE run_id = '{child}';
             UPDATE copy SET run_id = run_id || '0';
             INSERT INTO runs SELECT * FROM copy;"
        ))
        .expect("copy a child");
    // The one-run batch reports its first order's end wrongly.
    let result = one(&format!("SELECT result FROM runs WHERE run_id = '{whole}'"));
    let mut ends: Value = serde_json::from_str(&result).unwrap();
    let first = &mut ends["orders"][0]["status"];
    *first = if first == "completed" { "not_completed".into() } else { "completed".into() };
    workflows
        .execute("UPDATE runs SET result = ?1 WHERE run_id = ?2", (ends.to_string(), &whole))
        .expect("rewrite a batch's result");
    // The two-run chain's first run names a continuation that does not exist.
    workflows
        .execute("UPDATE runs SET result = '{\"continued_as\": \"nowhere\"}' WHERE run_id = ?1", [&continued])
        .expect("break a chain");
    // Two waiters that their batches told: the first one's message was never received, and the
    // second one's batch is made to look never started (its run renamed, its ledger line gone),
    // so that its approval is a charge and a shipment no message allowed.
    let waiter = |n: usize| {
        one(&format!(
            "SELECT run_id FROM runs WHERE workflow = 'sleepy_order' AND run_id LIKE '%-w' AND status = 'completed' ORDER BY run_id LIMIT 1 OFFSET {n}"
        ))
    };
    let (unheard, untold) = (waiter(0), waiter(1));
    let cleared = workflows
        .execute("UPDATE run_events SET consumed_by_seq = NULL WHERE run_id = ?1 AND name = 'batch_done'", [&unheard])
        .expect("unreceive a message");
    assert_eq!(cleared, 1, "waiter {unheard} received one message");
    let untold_batch = untold.strip_suffix("-w").expect("a waiter's id is its batch's and -w").to_string();
    workflows
        .execute_batch(&format!(
            "PRAGMA foreign_keys = OFF; UPDATE runs SET run_id = run_id || 'x' WHERE run_id = '{untold_batch}'"
        ))
        .expect("rename a batch");
    drop(workflows);
    // And the ledger holds a batch and a waiter the database never saw.
    let ledger = out.join("ledger.jsonl");
    let text = std::fs::read_to_string(&ledger).expect("ledger");
    let mut text: String = text
        .lines()
        .filter(|line| !line.contains(&format!(r#""run_id":"{untold_batch}""#)))
        .map(|line| format!("{line}\n"))
        .collect();
    text.push_str(
        r#"{"kind":"batch","run_id":"never-batch","per_run":null,"orders":[{"order_id":"never-batch-o1","fail":null,"expect":"completed","quantity":1}],"process":0,"at_ms":3}"#,
    );
    text.push('\n');
    text.push_str(r#"{"kind":"waiter","run_id":"never-w","quantity":1,"process":1,"at_ms":4}"#);
    text.push('\n');
    std::fs::write(&ledger, text).expect("ledger");

    let bad = check(&out);
    assert_eq!(bad.code, 1, "{}", bad.stdout);
    let listed = bad.json["check"]["first_violations"].to_string();
    assert_eq!(violations(&bad.json, "applied_twice"), 1, "{listed}");
    assert_eq!(violations(&bad.json, "unexpected_end"), 1, "{listed}");
    assert_eq!(violations(&bad.json, "lost"), 4, "{listed}");
    assert_eq!(violations(&bad.json, "wrong_effects"), 1, "{listed}");
    assert!(listed.contains(&format!("ran as 2 children: [\\\"{child}\\\", \\\"{child}0\\\"]")), "{listed}");
    assert!(listed.contains(&format!("batch {whole} reports its orders' ends")), "{listed}");
    assert!(listed.contains(&format!("batch {continued}: run {continued} continued")), "{listed}");
    assert!(listed.contains("batch never-batch acknowledged by process 0 is not in the database"), "{listed}");
    assert!(listed.contains("waiter never-w acknowledged by process 1 is not in the database"), "{listed}");
    assert!(listed.contains(&format!("waiter {unheard} (told: true")), "{listed}");
    assert!(listed.contains(&format!("waiter {untold} ended completed with the effects")), "{listed}");

    // The unheard message stamped at its wait's deadline: the waiter gave up (the message came
    // too late) and must then have ended as one never told, which its shipment contradicts.
    let tenant = out.join("data").join("tenants").join("chaos");
    let workflows = rusqlite::Connection::open(tenant.join("workflows.db")).expect("workflows.db");
    let late = workflows
        .execute(
            "UPDATE run_events SET received_at_ms = (SELECT wake_at_ms FROM journal j
               WHERE j.run_id = run_events.run_id AND j.kind = 'wait' AND j.name = 'batch_done')
             WHERE run_id = ?1 AND name = 'batch_done'",
            [&unheard],
        )
        .expect("make a message late");
    assert_eq!(late, 1);
    drop(workflows);
    let gave_up = check(&out);
    let listed = gave_up.json["check"]["first_violations"].to_string();
    assert_eq!((violations(&gave_up.json, "lost"), violations(&gave_up.json, "wrong_effects")), (3, 2), "{listed}");
    assert!(listed.contains(&format!("waiter {unheard} ended completed with the effects")), "{listed}");
}

#[test]
fn chaos_checker_holds_operated_orders_to_their_operators_controls_and_poison_events_to_their_skips() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let r = chaos(&out, 7, 3, 0);
    r.assert_exit(0);
    assert_eq!(r.json["check"]["passed"], true, "{}", r.stdout);
    let ledger = out.join("ledger.jsonl");
    let text = std::fs::read_to_string(&ledger).expect("ledger");
    let entries: Vec<Value> = text.lines().map(|line| serde_json::from_str(line).expect("a ledger line")).collect();
    // The first control of each kind that committed.
    let control = |action: &str| -> Value {
        entries
            .iter()
            .find(|e| e["kind"] == "control" && e["action"] == action && e["answered"] == true)
            .unwrap_or_else(|| panic!("no {action} in the ledger: {}", r.stdout))
            .clone()
    };
    let (retried, skipped, abandoned, forked) =
        (control("retry"), control("skip"), control("abandon"), control("fork"));
    let id = |e: &Value| e["run_id"].as_str().unwrap().to_string();
    // As the controls left them: a retry and a skip completed, an abandon cancelled, a fork's
    // run failed (and the fork exists).
    let tenant = out.join("data").join("tenants").join("chaos");
    let workflows = rusqlite::Connection::open(tenant.join("workflows.db")).expect("workflows.db");
    let status = |run: &str| -> String {
        workflows.query_row("SELECT status FROM runs WHERE run_id = ?1", [run], |row| row.get(0)).expect(run)
    };
    assert_eq!(status(&id(&retried)), "completed");
    assert_eq!(status(&id(&skipped)), "completed");
    assert_eq!(status(&id(&abandoned)), "cancelled");
    assert_eq!(status(&id(&forked)), "failed");
    let fork = forked["new_run_id"].as_str().unwrap();
    assert!(["failed", "completed"].contains(&status(fork).as_str()), "fork {fork}: {}", status(fork));
    // A fork from the reservation (position 0) reserved the order again: refused by the order's
    // reservation row, so the fork failed at once.
    let from_reservation = entries
        .iter()
        .find(|e| e["kind"] == "control" && e["action"] == "fork" && e["answered"] == true && e["from_step"] == 0)
        .unwrap_or_else(|| panic!("no fork from the reservation in the ledger: {}", r.stdout));
    let again = from_reservation["new_run_id"].as_str().unwrap();
    let (end, error): (String, String) = workflows
        .query_row("SELECT status, error FROM runs WHERE run_id = ?1", [again], |row| Ok((row.get(0)?, row.get(1)?)))
        .expect(again);
    assert_eq!(end, "failed", "fork {again}: {error}");
    assert!(error.contains("already has a reservation"), "fork {again}: {error}");

    // The retried run made to look failed still; the abandoned one compensated (a release,
    // which an abandon never runs); the forked order reserved a second time (the fork reused its
    // journal's reservation, so a second one is the fork's step run again).
    workflows.execute("UPDATE runs SET status = 'failed' WHERE run_id = ?1", [id(&retried)]).expect("unretry a run");
    for (order, kind) in [(id(&abandoned), "release"), (id(&forked), "reserve")] {
        let added = workflows
            .execute(
                "INSERT INTO order_effects (order_id, kind, sku, quantity)
                 SELECT order_id, ?2, sku, quantity FROM order_effects WHERE order_id = ?1 AND kind = 'reserve'",
                [&order, kind],
            )
            .expect("add an effect");
        assert_eq!(added, 1, "{order} reserved once");
    }
    drop(workflows);
    // The skipped order charged after all.
    let payments = rusqlite::Connection::open(tenant.join("payments.db")).expect("payments.db");
    payments
        .execute(
            "INSERT INTO payment_calls (idempotency_key, op, order_id, amount, outcome)
             SELECT idempotency_key, op, order_id, amount, 'charged' FROM payment_calls WHERE order_id = ?1 LIMIT 1",
            [id(&skipped)],
        )
        .expect("charge a skipped order");
    drop(payments);
    // And an operated order the database never saw.
    let mut text = text;
    text.push_str(r#"{"kind":"operated","run_id":"never-op","quantity":1,"process":1,"at_ms":6}"#);
    text.push('\n');
    std::fs::write(&ledger, text).expect("ledger");

    let bad = check(&out);
    assert_eq!(bad.code, 1, "{}", bad.stdout);
    let listed = bad.json["check"]["first_violations"].to_string();
    let counts: Vec<u64> =
        ["lost", "unexpected_end", "wrong_effects", "applied_twice"].iter().map(|k| violations(&bad.json, k)).collect();
    // The doubled reservation is also an end with the wrong effects.
    assert_eq!(counts, [1, 1, 3, 1], "{listed}");
    assert!(listed.contains("operated run never-op acknowledged by process 1 is not in the database"), "{listed}");
    assert!(listed.contains(&format!("operated run {} ended failed", id(&retried))), "{listed}");
    assert!(listed.contains("given retry (committed) it must end one of [\\\"completed\\\"]"), "{listed}");
    assert!(listed.contains(&format!("operated run {} ended cancelled with the effects", id(&abandoned))), "{listed}");
    assert!(listed.contains(&format!("fork {fork} of operated run {}: 2 reserve effects", id(&forked))), "{listed}");
    assert!(
        listed.contains(&format!("order {}: charged 1, refunded 0; its end leaves (0, 0)", id(&skipped))),
        "{listed}"
    );

    // Two poison events `shipping` skipped: one made blocked again (not skipped yet: the
    // system has not converged), one made applied (its handler cannot decode one).
    assert!(bad.json["check"]["poison_skipped"].as_u64().unwrap() >= 2, "{}", bad.stdout);
    let inbox = rusqlite::Connection::open(tenant.join("inbox.db")).expect("inbox.db");
    let poison: Vec<String> = inbox
        .prepare(
            "SELECT event_id FROM inbox WHERE consumer_id = 'shipping' AND status = 'skipped'
             AND flow_id LIKE 'c7-p%' ORDER BY event_id LIMIT 2",
        )
        .unwrap()
        .query_map([], |row| row.get(0))
        .unwrap()
        .collect::<rusqlite::Result<_>>()
        .unwrap();
    assert_eq!(poison.len(), 2, "{}", bad.stdout);
    for (event_id, status) in poison.iter().zip(["blocked", "applied"]) {
        inbox
            .execute(
                "UPDATE inbox SET status = ?2 WHERE consumer_id = 'shipping' AND event_id = ?1",
                [event_id, status],
            )
            .expect("change a poison record");
    }
    drop(inbox);
    let worse = check(&out);
    let more = |kind: &str| violations(&worse.json, kind) - violations(&bad.json, kind);
    let listed = worse.json["check"]["first_violations"].to_string();
    assert_eq!((more("not_applied"), more("inbox_open"), more("unknown_effect")), (1, 1, 1), "{listed}");
    assert!(listed.contains("shipping applied the poison event"), "{listed}");
}

#[test]
fn chaos_power_losses_with_durability_full_lose_nothing_acknowledged() {
    if !crate::support::failpoints_enabled() {
        crate::support::skip("power losses need --features failpoints (the fault VFS)");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let r = power_chaos(&out, 13, "sigkill,power-loss", "full", 3);
    println!("tidemark chaos --kinds sigkill,power-loss: {}", r.json);
    r.assert_exit(0);
    let report = &r.json;
    assert_eq!(report["outcome"], "passed", "{report:#}");
    assert_eq!(report["operations"]["lost"], 0, "{report:#}");
    assert_eq!(report["operations"]["applied_twice"], 0, "{report:#}");
    assert!(report["faults"]["power_loss"].as_u64().unwrap() >= 1, "the seed schedules a power loss: {report:#}");
    assert!(report["operations"]["acknowledged"].as_u64().unwrap() > 0, "{report:#}");
    // Not asserted: that a power loss threw writes away. With durability full every commit is
    // fsynced, so unsynced writes exist only inside a transaction in flight at the kill, and
    // whether one was is chance (a clean-clone CI run saw two power losses find none to throw
    // away). The layer's teeth are the `normal` test below, where acknowledged commits are lost.
}

#[test]
fn chaos_power_losses_with_durability_normal_lose_acknowledged_operations_and_the_checker_says_so() {
    if !crate::support::failpoints_enabled() {
        crate::support::skip("power losses need --features failpoints (the fault VFS)");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let r = power_chaos(&out, 5, "power-loss", "normal", 1);
    println!("tidemark --durability normal chaos --kinds power-loss: {}", r.json);
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    let report = &r.json;
    assert_eq!(report["outcome"], "violations", "{report:#}");
    assert_eq!(report["faults"]["power_loss"], 1, "{report:#}");
    // synchronous=NORMAL fsyncs a WAL only at its checkpoints: what was acknowledged since the
    // last one was in the page cache only.
    assert!(report["operations"]["lost"].as_u64().unwrap() > 0, "{report:#}");
    assert!(violations(report, "lost") > 0, "{report:#}");
}

/// A seed whose 3 faults (of `sigkill,power-loss`) are two SIGKILLs and, last, a power loss.
const SHRINK_SEED: u64 = 8;

/// `chaos shrink` finds the fault that fails a run: with `durability = normal` (as the test above)
/// the power loss loses acknowledged operations and the SIGKILLs lose nothing, so of the seed's
/// three faults the power loss alone is left, and its `reproduce` line runs it alone
/// (`--faults-only 2`). A failing run waits out its convergence timeout (what it lost never
/// comes), hence 15 s instead of the other tests' 30.
#[test]
fn chaos_shrink_finds_the_fault_that_fails_a_run() {
    if !crate::support::failpoints_enabled() {
        crate::support::skip("power losses need --features failpoints (the fault VFS)");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("shrink");
    let r = run(&[
        "chaos",
        "shrink",
        "--seed",
        &SHRINK_SEED.to_string(),
        "--duration-s",
        "8",
        "--faults",
        "3",
        "--kinds",
        "sigkill,power-loss",
        "--durability",
        "normal",
        "--processes",
        "2",
        "--clients",
        "4",
        "--converge-timeout-s",
        "15",
        "--out",
        path_str(&out),
    ]);
    println!("tidemark chaos shrink: {}", r.json);
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    let report = &r.json;
    assert_eq!(report["outcome"], "shrunk", "{report:#}");
    assert_eq!(report["faults"], serde_json::json!([2]), "{report:#}");
    assert_eq!(report["schedule"][0]["kind"], "power_loss", "{report:#}");
    assert!(report["check"]["by_kind"]["lost"].as_u64().unwrap() > 0, "{report:#}");
    assert!(report["reproduce"].as_str().unwrap().ends_with(" --faults-only 2"), "{report:#}");
    // The whole schedule failed first; the SIGKILLs alone passed.
    let trials = report["trials"].as_array().unwrap();
    assert_eq!(trials[0]["faults"], serde_json::json!([0, 1, 2]), "{report:#}");
    assert_eq!(trials[0]["outcome"], "violations", "{report:#}");
    let kills = trials.iter().find(|t| t["faults"] == serde_json::json!([0, 1])).expect("the SIGKILLs alone were run");
    assert_eq!(kills["outcome"], "passed", "{report:#}");
    assert_eq!(report["attempts"].as_u64().unwrap() as usize, trials.len());
    assert_eq!(report["exhausted"], false, "{report:#}");
    // Each run had a folder of its own, with the faults it ran.
    for (index, trial) in trials.iter().enumerate() {
        let schedule: Value = serde_json::from_str(
            &std::fs::read_to_string(out.join(format!("run-{index}")).join("schedule.json")).unwrap(),
        )
        .unwrap();
        let indices: Vec<u64> = schedule.as_array().unwrap().iter().map(|f| f["index"].as_u64().unwrap()).collect();
        assert_eq!(serde_json::json!(indices), trial["faults"], "{report:#}");
    }
}

/// `chaos fuzz`: runs drawn from the fuzz's seed (each its own seed, kinds, processes, workers,
/// clients and faults), each replayable alone by its `reproduce` command. With `--durability
/// normal` and power losses the first run loses acknowledged operations (as documented): the
/// fuzz stops there and shrinks that run. Bad input is refused before anything runs.
#[test]
fn chaos_fuzz_runs_beyond_one_seed_stops_at_the_first_failure_and_shrinks_it() {
    if !crate::support::failpoints_enabled() {
        crate::support::skip("the fuzz's power losses need --features failpoints");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("passing");
    let args = ["--runs", "2", "--duration-s", "3", "--faults-max", "2", "--converge-timeout-s", "30"];
    let r = run(&[&["chaos", "fuzz", "--seed", "1", "--out", path_str(&out)][..], &args[..]].concat());
    println!("tidemark chaos fuzz: {}", r.json);
    r.assert_exit(0);
    let runs = r.json["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2, "{}", r.json);
    for (index, one) in runs.iter().enumerate() {
        assert_eq!(one["outcome"], "passed", "{}", r.json);
        assert!(one["reproduce"].as_str().unwrap().starts_with("tidemark chaos --seed "), "{}", r.json);
        assert!(out.join(format!("run-{index}")).join("schedule.json").is_file());
    }

    let out = dir.path().join("failing");
    let r = run(&[
        "--durability",
        "normal",
        "chaos",
        "fuzz",
        "--seed",
        "1",
        "--runs",
        "4",
        "--kinds",
        "power-loss",
        "--duration-s",
        "6",
        "--faults-max",
        "3",
        "--shrink-attempts-max",
        "4",
        "--converge-timeout-s",
        "30",
        "--out",
        path_str(&out),
    ]);
    println!("tidemark --durability normal chaos fuzz --kinds power-loss: {}", r.json);
    r.assert_exit(1);
    let report = &r.json;
    assert_eq!(report["outcome"], "violations", "{report:#}");
    let failed = report["failed"].as_u64().unwrap() as usize;
    assert_eq!(report["runs"].as_array().unwrap().len(), failed + 1, "it stops at the first failure: {report:#}");
    assert!(report["check"]["by_kind"]["lost"].as_u64().unwrap() > 0, "{report:#}");
    assert!(report["reproduce"].as_str().unwrap().contains("--kinds power-loss --durability normal"), "{report:#}");
    let shrunk = &report["shrunk"];
    assert_eq!(shrunk["outcome"], "shrunk", "{report:#}");
    let faults = shrunk["faults"].as_array().unwrap();
    let injected = report["runs"][failed]["faults"].as_u64().unwrap() as usize;
    assert!(!faults.is_empty() && faults.len() <= injected, "{report:#}");
    assert!(out.join("shrink").join("run-0").join("schedule.json").is_file());

    for bad in [
        vec!["chaos", "fuzz", "--seed", "1", "--runs", "0"],
        vec!["chaos", "fuzz", "--seed", "1", "--runs", "1001"],
        vec!["chaos", "fuzz", "--seed", "1", "--faults-max", "0"],
        vec!["chaos", "fuzz", "--seed", "1", "--kinds", "db-crash"],
        vec!["chaos", "fuzz", "--seed", "1", "--shrink-attempts-max", "201"],
    ] {
        let bad_out = dir.path().join("bad");
        let r = run(&[&bad[..], &["--out", path_str(&bad_out)][..]].concat());
        assert_eq!(r.code, 2, "{bad:?}: {}", r.stdout);
        assert_eq!(r.json["error"]["code"], "invalid_argument", "{bad:?}: {}", r.stdout);
        assert!(!bad_out.exists(), "{bad:?} created its folder");
    }

    // On PostgreSQL: each run under a schema prefix of its own.
    let Some(_postgres) = crate::workflow_cli::on_postgres() else { return };
    let _schemas = crate::server_support::DropServedSchemas;
    let out = dir.path().join("postgres");
    let store = crate::server_support::store_of(&out).expect("on PostgreSQL");
    let r = run(&[
        &["chaos", "fuzz", "--seed", "7", "--runs", "1", "--store", &store, "--out", path_str(&out)][..],
        &args[2..],
    ]
    .concat());
    println!("tidemark chaos fuzz --store: {}", r.json);
    r.assert_exit(0);
    assert!(r.json["runs"][0]["reproduce"].as_str().unwrap().ends_with("_f0'"), "{}", r.json);
}

/// The clock jumps' mechanism: a process adds the offset its file holds to the system clock.
#[test]
fn a_process_reads_its_wall_clock_offset_from_its_offset_file() {
    if !crate::support::failpoints_enabled() {
        crate::support::skip("clock jumps need --features failpoints");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let producer = dir.path().join("p.db");
    let clock = dir.path().join("clock.offset_ms");
    std::fs::write(&clock, "86400000").unwrap();
    let consumer = dir.path().join("c.db");
    let (p, c) = (path_str(&producer), path_str(&consumer));
    crate::support::ok(&["init", "--producer", p, "--source", "shop", "--consumer-db", c]);
    crate::support::ok(&["subscribe", "--producer", p, "--consumer-id", "audit", "--endpoint", c]);
    let before = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    let env = [("TIDEMARK_CLOCK_OFFSET_FILE", path_str(&clock))];
    let args =
        ["advance", "--producer", p, "--flow", "f", "--expected-seq", "0", "--to", "reserved", "--quantity", "1"];
    let r = crate::support::run_with(&args, &env, None);
    assert_eq!(r.code, 0, "{}", r.stdout);
    let after = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    let conn = rusqlite::Connection::open(&producer).unwrap();
    let stamped: i64 = conn.query_row("SELECT created_at_ms FROM outbox", [], |r| r.get(0)).unwrap();
    assert!((before + 86_400_000..=after + 86_400_000).contains(&stamped), "{before} {stamped} {after}");
    // A relay on the true clock delivers it at once: an event is not held back until the
    // relay's clock reaches the writer's.
    let relayed = crate::support::ok(&["relay", "--producer", p, "--until-idle"]);
    assert_eq!(relayed["attempted"], 1, "{relayed}");
    let accepted = crate::support::ok(&["outbox", "list", "--producer", p, "--status", "accepted"]);
    assert_eq!(accepted["deliveries"].as_array().map(Vec::len), Some(1), "{accepted}");
}

/// A seed whose 4 faults with `--kinds sigkill,clock-jump-kill --clock-jump-leases-max 3600`
/// start with a server's clock 16 minutes ahead, the server killed halfway through it (runs it
/// had leased keep leases 16 minutes long), then three SIGKILLs.
const CLOCK_KILL_SEED: u64 = 3;

/// Kills of a process while its clock is ahead (`--kinds clock-jump-kill`): the leases it wrote
/// with that clock outlive it by the lead, held by no one; nothing is lost or applied twice, and
/// the checker counts such runs late, not leased or unfinished. Its teeth: one of them leased
/// for a second only (a lease the true clock could have written, of a process gone) is
/// `run_leased`.
#[test]
fn chaos_kills_while_a_clock_is_ahead_lose_nothing_and_their_leases_are_late_not_held() {
    if !crate::support::failpoints_enabled() {
        crate::support::skip("clock jumps need --features failpoints");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let leases = ["--clock-jump-leases-max", "3600"];
    let r = power_chaos_with(&out, CLOCK_KILL_SEED, "sigkill,clock-jump-kill", "full", 4, &leases);
    println!("tidemark chaos --kinds sigkill,clock-jump-kill: {}", r.json);
    r.assert_exit(0);
    let report = &r.json;
    assert_eq!(report["outcome"], "passed", "{report:#}");
    assert_eq!(report["operations"]["lost"], 0, "{report:#}");
    assert_eq!(report["operations"]["applied_twice"], 0, "{report:#}");
    let killed_ahead = report["faults"]["schedule"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["kind"] == "clock_jump_kill" && f["jump_ms"].as_i64().unwrap() > 600_000)
        .count();
    assert!(killed_ahead >= 1, "{report:#}");
    assert!(report["check"]["runs_late_by_clock_ahead"].as_u64().unwrap() > 0, "{report:#}");
    let workflows = out.join("data").join("tenants").join("chaos").join("workflows.db");
    let conn = rusqlite::Connection::open(&workflows).unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    // Whether the killed server held a lease then depends on the moment (in the run written
    // down, 3 runs kept leases 16 minutes long); the checker's rule is shown on a run of its own.
    let leased_ahead: i64 = conn
        .query_row(
            "SELECT count(*) FROM runs WHERE lease_owner IS NOT NULL AND lease_expires_at_ms > ?1 + 600000",
            [now],
            |r| r.get(0),
        )
        .unwrap();
    println!("runs left leased by a clock ahead: {leased_ahead}");
    // A completed order put back to running, leased by a process gone: an hour ahead, it is
    // late; for a second (a lease the true clock could have written), it is `run_leased`.
    let lease = |expires_in_ms: i64| {
        conn.execute(
            "UPDATE runs SET status = 'running', finished_at_ms = NULL, lease_owner = 'gone', lease_token = 't',
               lease_expires_at_ms = ?1 + ?2
             WHERE run_id = (SELECT min(run_id) FROM runs WHERE workflow = 'order_saga' AND parent_run_id IS NULL
               AND queue IS NULL AND (status = 'completed' OR lease_owner = 'gone'))",
            [now, expires_in_ms],
        )
        .unwrap()
    };
    let late = report["check"]["runs_late_by_clock_ahead"].as_u64().unwrap();
    assert_eq!(lease(3_600_000), 1);
    let checked = check(&out);
    assert_eq!(checked.code, 0, "{}", checked.stdout);
    assert_eq!(checked.json["check"]["runs_late_by_clock_ahead"].as_u64(), Some(late + 1), "{}", checked.stdout);
    assert_eq!(lease(1_000), 1);
    let checked = check(&out);
    assert_eq!(violations(&checked.json, "run_leased"), 1, "{}", checked.stdout);
}

/// The crash points' mechanism in a running process: it exits (code 73) at the first crash
/// point it reaches whose name its crash file holds, and not at one the file does not name.
#[test]
fn a_process_stops_at_the_crash_point_its_crash_file_names() {
    if !crate::support::failpoints_enabled() {
        crate::support::skip("crash points need --features failpoints");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let producer = dir.path().join("p.db");
    let crash = dir.path().join("crash.point");
    let p = path_str(&producer);
    crate::support::ok(&["init", "--producer", p, "--source", "shop"]);
    let env = [("TIDEMARK_CRASH_FILE", path_str(&crash))];
    // Each a new flow's first event.
    let advance = |flow: &str| {
        let args =
            ["advance", "--producer", p, "--flow", flow, "--expected-seq", "0", "--to", "reserved", "--quantity", "1"];
        let r = crate::support::run_with(&args, &env, None);
        assert!(r.code != 0 || r.json["outcome"] == "committed", "{}", r.stdout);
        r
    };
    // No file, then a point this command does not reach: it goes on.
    advance("f0").assert_exit(0);
    std::fs::write(&crash, "relay.after_producer_commit").unwrap();
    advance("f1").assert_exit(0);
    // Its own point: it stops right after the commit, so the event is there and no answer came.
    std::fs::write(&crash, "advance.after_commit\n").unwrap();
    let stopped = advance("f2");
    assert_eq!(stopped.code, 73, "{}\n{}", stopped.stdout, stopped.stderr);
    assert!(stopped.stderr.contains("crash point advance.after_commit reached"), "{}", stopped.stderr);
    let conn = rusqlite::Connection::open(&producer).unwrap();
    let events: i64 = conn.query_row("SELECT count(*) FROM outbox", [], |r| r.get(0)).unwrap();
    assert_eq!(events, 3);
    // Disarmed (an empty file): the next advance answers.
    std::fs::write(&crash, "").unwrap();
    advance("f3").assert_exit(0);
}

#[test]
fn chaos_clock_jumps_forward_and_back_lose_nothing_and_apply_nothing_twice() {
    if !crate::support::failpoints_enabled() {
        crate::support::skip("clock jumps need --features failpoints");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let r = power_chaos(&out, CLOCK_SEED, "sigkill,clock-jump", "full", 4);
    println!("tidemark chaos --kinds sigkill,clock-jump: {}", r.json);
    r.assert_exit(0);
    let report = &r.json;
    assert_eq!(report["outcome"], "passed", "{report:#}");
    assert_eq!(report["operations"]["lost"], 0, "{report:#}");
    assert_eq!(report["operations"]["applied_twice"], 0, "{report:#}");
    let jumps: Vec<i64> = report["faults"]["schedule"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["kind"] == "clock_jump")
        .map(|f| f["jump_ms"].as_i64().unwrap())
        .collect();
    assert!(jumps.iter().any(|j| *j > 0) && jumps.iter().any(|j| *j < 0), "the seed jumps both ways: {jumps:?}");
}

/// Clock jumps of up to an hour (3,600 leases; seed 47: 53 and 17 minutes forward, 47 back):
/// nothing lost, nothing applied twice. What a process whose clock was ahead scheduled (a timer,
/// a retry, a due time) comes late by its lead; the checker counts such runs late, not
/// unfinished, and only those: a run due within the workload's longest timer is unfinished.
#[test]
fn chaos_clock_jumps_of_an_hour_lose_nothing_and_apply_nothing_twice() {
    if !crate::support::failpoints_enabled() {
        crate::support::skip("clock jumps need --features failpoints");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let r = run(&[
        "chaos",
        "--seed",
        "47",
        "--duration-s",
        "8",
        "--faults",
        "3",
        "--kinds",
        "clock-jump",
        "--clock-jump-leases-max",
        "3600",
        "--processes",
        "2",
        "--clients",
        "4",
        "--converge-timeout-s",
        "60",
        "--out",
        path_str(&out),
    ]);
    println!("tidemark chaos --kinds clock-jump --clock-jump-leases-max 3600: {}", r.json);
    r.assert_exit(0);
    let report = &r.json;
    assert_eq!(report["outcome"], "passed", "{report:#}");
    assert_eq!(
        (report["operations"]["lost"].as_u64(), report["operations"]["applied_twice"].as_u64()),
        (Some(0), Some(0))
    );
    let jumps: Vec<i64> =
        report["faults"]["schedule"].as_array().unwrap().iter().map(|f| f["jump_ms"].as_i64().unwrap()).collect();
    assert!(jumps.iter().any(|j| *j > 600_000) && jumps.iter().any(|j| *j < -600_000), "{jumps:?}");
    let late = report["check"]["runs_late_by_clock_ahead"].as_u64().unwrap();
    assert!(late > 0, "a jump forward delayed no run: {report:#}");

    // Two completed orders put back to sleep: one due in 30 s (a timer the true clock could have
    // set: unfinished), one due in two hours (only a clock ahead sets that: late).
    let workflows = out.join("data").join("tenants").join("chaos").join("workflows.db");
    let conn = rusqlite::Connection::open(&workflows).unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    let slept = conn
        .execute(
            "UPDATE runs SET status = 'sleeping', finished_at_ms = NULL, wake_at_ms = ?1 + CASE WHEN run_id = (SELECT min(run_id) FROM runs
               WHERE status = 'completed' AND workflow = 'order_saga' AND parent_run_id IS NULL AND queue IS NULL)
               THEN 30000 ELSE 7200000 END
             WHERE run_id IN (SELECT run_id FROM runs WHERE status = 'completed' AND workflow = 'order_saga'
               AND parent_run_id IS NULL AND queue IS NULL ORDER BY run_id LIMIT 2)",
            [now],
        )
        .unwrap();
    assert_eq!(slept, 2);
    // And one due in 30 s but last written an hour from now: only a clock an hour ahead writes
    // that, so its short timer is as late (a last read before it is due must not call it
    // unfinished).
    let ahead = conn
        .execute(
            "UPDATE runs SET status = 'sleeping', finished_at_ms = NULL, wake_at_ms = ?1 + 30000, updated_at_ms = ?1 + 3600000
             WHERE run_id = (SELECT min(run_id) FROM runs WHERE status = 'completed' AND workflow = 'order_saga'
               AND parent_run_id IS NULL AND queue IS NULL)",
            [now],
        )
        .unwrap();
    assert_eq!(ahead, 1);
    let late = late + 1;
    let checked = check(&out);
    assert_eq!(violations(&checked.json, "run_unfinished"), 1, "{}", checked.stdout);
    assert_eq!(checked.json["check"]["runs_late_by_clock_ahead"], late + 1, "{}", checked.stdout);

    // The queue's every slot (8) held by an admitted run due in two hours (with those the run
    // left held by its own clocks ahead, which it counted late), and one more of its runs
    // waiting for admission: that one waits behind them, late as they are. With one holder due
    // now (a slot about to free), it is unfinished, and so is that holder.
    let held_already: u32 = conn
        .query_row(
            "SELECT count(*) FROM runs WHERE queue IS NOT NULL AND admitted_at_ms IS NOT NULL
               AND status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating')",
            [],
            |r| r.get(0),
        )
        .unwrap();
    if held_already >= 8 {
        println!("note: the run left {held_already} queue slots held; the queue's part of this test needs fewer");
        return;
    }
    let completed_queued = |limit: u32| -> Vec<String> {
        let mut stmt = conn
            .prepare(
                "SELECT run_id FROM runs WHERE status = 'completed' AND queue IS NOT NULL AND parent_run_id IS NULL
                 ORDER BY run_id LIMIT ?1",
            )
            .unwrap();
        stmt.query_map([limit], |r| r.get(0)).unwrap().collect::<Result<_, _>>().unwrap()
    };
    let holders = completed_queued(8 - held_already);
    assert_eq!(holders.len() as u32, 8 - held_already);
    for run_id in &holders {
        conn.execute(
            "UPDATE runs SET status = 'sleeping', finished_at_ms = NULL, wake_at_ms = ?1 + 7200000 WHERE run_id = ?2",
            rusqlite::params![now, run_id],
        )
        .unwrap();
    }
    let waiting = completed_queued(1).remove(0);
    conn.execute(
        "UPDATE runs SET status = 'pending', finished_at_ms = NULL, admitted_at_ms = NULL, wake_at_ms = ?1
         WHERE run_id = ?2",
        rusqlite::params![now, waiting],
    )
    .unwrap();
    let added = holders.len() as u64;
    let checked = check(&out);
    assert_eq!(violations(&checked.json, "run_unfinished"), 1, "{}", checked.stdout);
    assert_eq!(checked.json["check"]["runs_late_by_clock_ahead"], late + 1 + added + 1, "{}", checked.stdout);
    conn.execute(
        "UPDATE runs SET wake_at_ms = ?1 - 1000, updated_at_ms = ?1 - 1000 WHERE run_id = ?2",
        rusqlite::params![now, holders[0]],
    )
    .unwrap();
    drop(conn);
    let checked = check(&out);
    assert_eq!(violations(&checked.json, "run_unfinished"), 1 + 2, "{}", checked.stdout);
    assert_eq!(checked.json["check"]["runs_late_by_clock_ahead"], late + 1 + added - 1, "{}", checked.stdout);
}

/// The disk under the servers full, then failing fsyncs, then failing writes, each for a moment
/// (the fault VFS's control files), every second time for one server's files only, while the
/// workload runs: requests answer typed errors (507
/// `storage_full`, 500 `store`), nothing acknowledged is lost, nothing applied twice, and the
/// servers go on by themselves when the disk works again.
#[test]
fn chaos_io_errors_under_load_lose_nothing_and_the_servers_go_on_by_themselves() {
    if !crate::support::failpoints_enabled() {
        crate::support::skip("I/O errors need --features failpoints");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let r = power_chaos(&out, IO_ERROR_SEED, "io-error", "full", 4);
    println!("tidemark chaos --kinds io-error: {}", r.json);
    r.assert_exit(0);
    let report = &r.json;
    assert_eq!(report["outcome"], "passed", "{report:#}");
    assert_eq!(
        (report["operations"]["lost"].as_u64(), report["operations"]["applied_twice"].as_u64()),
        (Some(0), Some(0))
    );
    let modes: std::collections::BTreeSet<&str> =
        report["faults"]["schedule"].as_array().unwrap().iter().filter_map(|f| f["io_error"].as_str()).collect();
    assert_eq!(modes, ["eio_fsync", "eio_write", "full"].into(), "{report:#}");
    // Every second fault failed one server's files only, the other server writing them meanwhile.
    let scopes: Vec<Value> =
        report["faults"]["schedule"].as_array().unwrap().iter().map(|f| f["io_error_process"].clone()).collect();
    assert_eq!(scopes, [Value::Null, json!(0), Value::Null, json!(1)], "{report:#}");
    let statuses = &report["operations"]["by_status"];
    assert!(statuses["507"].as_u64().unwrap_or(0) > 0, "no storage_full answer during the full disk: {report:#}");
    assert_eq!(report["operations"]["unexpected_answers"], 0, "a 4xx during the I/O errors: {report:#}");
}

/// A tmpfs of a test's own, unmounted when dropped.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    /// Mount a tmpfs of `size` on `dir` (created), or `None` after saying why the test is
    /// skipped: mounting needs root (and a container that allows it).
    fn mount(dir: &Path, size: &str) -> Option<Tmpfs> {
        use std::os::unix::fs::MetadataExt;
        if std::fs::metadata("/proc/self").map(|m| m.uid()).unwrap_or(1) != 0 {
            crate::support::skip("mounting a tmpfs needs root");
            return None;
        }
        std::fs::create_dir_all(dir).expect("the mount point");
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs", path_str(dir)])
            .status();
        if !status.as_ref().is_ok_and(|s| s.success()) {
            crate::support::skip(&format!("cannot mount a tmpfs on {} ({status:?})", dir.display()));
            return None;
        }
        Some(Tmpfs(dir.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// `--disk`: the servers' data folder on a small file system of its own (a tmpfs of the test's,
/// 512 MiB), and the seed's `full` I/O error ([`IO_ERROR_SEED`], its first fault) that file
/// system filled for real (a ballast file of all its free space for the fault's length), not
/// the fault VFS's control file: SQLite gets the kernel's `ENOSPC`, the servers answer 507
/// `storage_full` and write nothing meanwhile, and afterwards go on by themselves; nothing
/// acknowledged is lost. (The failing writes and fsyncs of the same seed are the fault VFS's.)
/// Found by its first runs: the workload's payment service kept its log in the data folder, so
/// the full disk failed it too and charges that ran out of attempts meanwhile compensated their
/// orders (right for a payment service down that long, not what the checker expects of it); it
/// stands for another service, so its log now stays off `--disk`.
#[test]
fn chaos_a_real_full_file_system_answers_storage_full_and_loses_nothing() {
    if !crate::support::failpoints_enabled() {
        crate::support::skip("I/O errors need --features failpoints");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let disk = dir.path().join("disk");
    let Some(_mounted) = Tmpfs::mount(&disk, "512m") else { return };
    let out = dir.path().join("run");
    let r = run(&[
        "chaos",
        "--seed",
        &IO_ERROR_SEED.to_string(),
        "--duration-s",
        "8",
        "--faults",
        "4",
        "--kinds",
        "io-error",
        "--processes",
        "2",
        "--clients",
        "4",
        "--converge-timeout-s",
        "30",
        "--disk",
        path_str(&disk),
        "--out",
        path_str(&out),
    ]);
    println!("tidemark chaos --kinds io-error --disk: {}", r.json);
    r.assert_exit(0);
    let report = &r.json;
    assert_eq!(report["outcome"], "passed", "{report:#}");
    assert_eq!(
        (report["operations"]["lost"].as_u64(), report["operations"]["applied_twice"].as_u64()),
        (Some(0), Some(0))
    );
    let full: Vec<&Value> =
        report["faults"]["schedule"].as_array().unwrap().iter().filter(|f| f["io_error"] == "full").collect();
    assert!(!full.is_empty(), "the seed has a full disk: {report:#}");
    assert!(full.iter().all(|f| f["disk_filled_bytes"].as_u64().unwrap() > 0), "{report:#}");
    assert!(report["operations"]["by_status"]["507"].as_u64().unwrap_or(0) > 0, "no storage_full answer: {report:#}");
    assert_eq!(report["operations"]["unexpected_answers"], 0, "{report:#}");
    assert!(report["reproduce"].as_str().unwrap().contains(" --disk "), "{report:#}");
    // The data folder was on the disk, the payment service's log (another service's) off it,
    // its journal files beside it; and the ballast is gone.
    let data = std::fs::read_link(out.join("data")).expect("OUT/data is a link");
    assert!(data.starts_with(std::fs::canonicalize(&disk).unwrap()), "{}", data.display());
    let payments = out.join("payments").join("payments.db");
    assert!(std::fs::metadata(&payments).unwrap().len() > 0, "{}", payments.display());
    let tenant = data.join("tenants").join("chaos");
    assert!(tenant.join("producer.db").is_file() && !tenant.join("payments.db-wal").exists());
    let left: Vec<String> = std::fs::read_dir(&disk)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("tidemark-chaos-ballast"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    // A --disk with more room than a full disk may take, and with --store, are refused.
    let refused = run(&["chaos", "--seed", "1", "--disk", "/", "--out", path_str(&dir.path().join("refused"))]);
    assert_eq!(refused.json["error"]["code"], "invalid_argument", "{}", refused.stdout);
}

/// The run of `seed`: 2 servers and 2 worker processes, 6 faults in 12 s (of `kinds`, or
/// SIGKILLs and SIGSTOPs); on PostgreSQL with `store`. It must pass: advances and starts
/// acknowledged, nothing lost or applied twice, faults on the worker processes and runs claimed
/// by them. Returns the report.
fn workers_chaos(out: &Path, seed: u64, kinds: Option<&str>, store: Option<&str>) -> Value {
    let seed = seed.to_string();
    let mut args = vec!["chaos", "--seed", &seed, "--duration-s", "12", "--faults", "6", "--workers", "2"];
    args.extend(["--processes", "2", "--clients", "4", "--out", path_str(out)]);
    if let Some(store) = store {
        args.extend(["--store", store]);
    }
    if let Some(kinds) = kinds {
        args.extend(["--kinds", kinds, "--converge-timeout-s", "60"]);
    }
    let r = run(&args);
    println!("tidemark chaos --workers 2 (store {store:?}): {}", r.json);
    r.assert_exit(0);
    let report = r.json;
    assert_eq!(report["outcome"], "passed", "{report:#}");
    assert_eq!(
        (report["operations"]["lost"].as_u64(), report["operations"]["applied_twice"].as_u64()),
        (Some(0), Some(0))
    );
    assert!(report["operations"]["advances"].as_u64().unwrap() > 0, "{report:#}");
    assert!(report["operations"]["starts"].as_u64().unwrap() > 0, "{report:#}");
    assert!(report["faults"]["on_workers"].as_u64().unwrap() > 0, "no fault hit a worker process: {report:#}");
    assert!(report["worker_claims"].as_u64().unwrap() > 0, "the worker processes ran nothing: {report:#}");
    report
}

/// `tidemark worker` processes beside the servers, on the tenant's workflow database, killed and
/// paused like the servers: the runs they held are taken over, nothing lost or applied twice.
#[test]
fn chaos_worker_processes_beside_the_servers_lose_nothing_and_apply_nothing_twice() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    workers_chaos(&out, WORKERS_SEED, None, None);
}

/// Worker processes on the servers' fault VFS and with clock files of their own: a power loss
/// of the machine kills them with the servers (what no process made durable is thrown away) and
/// they start again after it; a worker's clock jumps forward (the leases of the others look
/// expired to it, and its own look longer); nothing acknowledged is lost, nothing applied twice.
#[test]
fn chaos_worker_processes_ride_out_power_losses_and_clock_jumps_of_their_own() {
    if !crate::support::failpoints_enabled() {
        crate::support::skip("power losses and clock jumps need --features failpoints");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let report = workers_chaos(&out, WORKERS_FAULTS_SEED, Some("sigkill,sigstop,power-loss,clock-jump"), None);
    let schedule = report["faults"]["schedule"].as_array().unwrap();
    let on_worker = |kind: &str| schedule.iter().filter(|f| f["kind"] == kind && f["worker"] == true).count();
    assert!(report["faults"]["power_loss"].as_u64().unwrap() >= 1, "{report:#}");
    assert!(on_worker("clock_jump") >= 1, "the seed jumps a worker's clock: {report:#}");
}

/// The same workload and faults with the servers and worker processes on PostgreSQL (`--store`):
/// two `tidemark serve` processes and two `tidemark worker` processes share the tenant's schemas,
/// are killed and paused, and the checker, reading the schemas with SQL of its own, finds every
/// acknowledged operation once, and the queue within its limit in every sample. Then its teeth
/// on PostgreSQL: an acknowledged advance deleted from the outbox is `lost`, a doubled order
/// effect is `applied_twice`, a sample over the queue's limit is `queue_over_limit`.
#[test]
fn chaos_on_postgres_loses_nothing_and_applies_nothing_twice() {
    let Some(_postgres) = crate::workflow_cli::on_postgres() else { return };
    let _schemas = crate::server_support::DropServedSchemas;
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let store = crate::server_support::store_of(&out).expect("on PostgreSQL");
    workers_chaos(&out, WORKERS_SEED, None, Some(&store));
    // The run was on PostgreSQL: the data folder holds no tenant database, only the payments log.
    let tenant = out.join("data").join("tenants").join("chaos");
    assert!(!tenant.join("producer.db").exists() && !tenant.join("workflows.db").exists());
    assert!(tenant.join("payments.db").is_file());

    let check_on = |out: &Path| run(&["chaos", "check", "--out", path_str(out), "--store", &store]);
    let clean = check_on(&out);
    assert_eq!(clean.code, 0, "{}", clean.stdout);
    assert_eq!(clean.json["check"]["passed"], true, "{}", clean.stdout);
    // The queue's limit, as the harness's samples of the schema saw it.
    assert!(clean.json["check"]["queue_samples"].as_u64().unwrap() > 0, "{}", clean.stdout);
    let peak = clean.json["check"]["queue_peak"].as_u64().expect("a queue peak from the samples");
    assert!((1..=8).contains(&peak), "{}", clean.stdout);
    // A second run on the same prefix would mix its data with this one's: refused.
    let again = run(&["chaos", "--seed", "1", "--store", &store, "--out", path_str(&dir.path().join("again"))]);
    assert_eq!(again.json["error"]["code"], "already_exists", "{}", again.stdout);
    // Without --store the checker looks for files, finds none, and says so.
    let no_store = run(&["chaos", "check", "--out", path_str(&out)]);
    assert_eq!(no_store.json["error"]["code"], "not_initialized", "{}", no_store.stdout);

    // The checker's teeth on the schemas.
    let ledger = std::fs::read_to_string(out.join("ledger.jsonl")).expect("ledger");
    let advance: Value = ledger
        .lines()
        .map(|line| serde_json::from_str::<Value>(line).expect("a ledger line"))
        .find(|entry| entry["kind"] == "advance")
        .expect("an acknowledged advance");
    let backend = tidemark_server::Postgres::from_url(&store).expect("the store");
    let mut client = postgres::Client::connect(backend.conn(), postgres::NoTls).expect("connect");
    let producer = backend.schema("chaos", tidemark_server::Database::Producer);
    let workflows = backend.schema("chaos", tidemark_server::Database::Workflows);
    let deleted = client
        .execute(
            &format!("DELETE FROM \"{producer}\".outbox WHERE event_id = $1"),
            &[&advance["event_id"].as_str().unwrap()],
        )
        .expect("delete an outbox event");
    assert_eq!(deleted, 1);
    let doubled = client
        .execute(
            &format!(
                "INSERT INTO \"{workflows}\".order_effects (order_id, kind, sku, quantity)
                 SELECT order_id, kind, sku, quantity FROM \"{workflows}\".order_effects
                 WHERE kind = 'reserve' ORDER BY effect_id LIMIT 1"
            ),
            &[],
        )
        .expect("double an order effect");
    assert_eq!(doubled, 1);
    // And a sample over the queue's limit.
    let samples_file = out.join("data").join("queue_samples.json");
    let mut samples: Value = serde_json::from_str(&std::fs::read_to_string(&samples_file).expect("samples")).unwrap();
    samples["over"] = serde_json::json!([[1_200, 9]]);
    samples["peak"] = serde_json::json!(9);
    std::fs::write(&samples_file, samples.to_string()).unwrap();
    let broken = check_on(&out);
    assert_eq!(broken.code, 1, "{}", broken.stdout);
    assert!(violations(&broken.json, "lost") >= 1, "{}", broken.stdout);
    assert!(violations(&broken.json, "applied_twice") >= 1, "{}", broken.stdout);
    assert_eq!(violations(&broken.json, "queue_over_limit"), 1, "{}", broken.stdout);
    assert_eq!(broken.json["check"]["queue_peak"], 9, "{}", broken.stdout);
    let listed = broken.json["check"]["first_violations"].to_string();
    assert!(listed.contains(advance["flow_id"].as_str().unwrap()), "{listed}");
}

/// A seed whose 6 crash points (`--kinds crash-point`, 2 servers and 2 worker processes) stop a
/// server's relay lane before and after it records the verdicts of a batch the consumer had
/// committed, a server's drain before its commit, and a worker process twice right after a
/// journal commit; each one reached (seed 5, on both backends).
const CRASH_POINT_SEED: u64 = 5;

/// Crash points inside the running servers and workers (`--kinds crash-point`): each fault arms
/// one commit boundary in a process's crash file, the process exits there by itself (code 73)
/// at the next one it reaches under the workload, and starts again; nothing acknowledged is lost,
/// nothing applied twice. On SQLite files, then on PostgreSQL.
#[test]
fn chaos_crash_points_inside_servers_and_workers_lose_nothing_and_apply_nothing_twice() {
    if !crate::support::failpoints_enabled() {
        crate::support::skip("crash points need --features failpoints");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    fn reached(report: &Value) -> Vec<(bool, &str)> {
        let schedule = report["faults"]["schedule"].as_array().unwrap();
        assert!(schedule.iter().all(|f| f["kind"] == "crash_point"), "{report:#}");
        let reached: Vec<(bool, &str)> = schedule
            .iter()
            .filter(|f| f["crash_point"]["reached"] == true)
            .map(|f| (f["worker"] == true, f["crash_point"]["point"].as_str().unwrap()))
            .collect();
        assert_eq!(report["faults"]["crash_points_reached"].as_u64(), Some(reached.len() as u64), "{report:#}");
        reached
    }
    let sqlite = workers_chaos(&dir.path().join("sqlite"), CRASH_POINT_SEED, Some("crash-point"), None);
    let points = reached(&sqlite);
    assert!(points.len() >= 4, "{sqlite:#}");
    assert!(points.contains(&(false, "relay.after_producer_commit")), "{points:?}");
    assert!(points.iter().any(|(worker, point)| *worker && point.starts_with("workflow.")), "{points:?}");
    let Some(_postgres) = crate::workflow_cli::on_postgres() else { return };
    let _schemas = crate::server_support::DropServedSchemas;
    let out = dir.path().join("postgres");
    let store = crate::server_support::store_of(&out).expect("on PostgreSQL");
    let postgres = workers_chaos(&out, CRASH_POINT_SEED, Some("crash-point"), Some(&store));
    assert!(reached(&postgres).len() >= 4, "{postgres:#}");
}

/// A seed whose 5 faults on 2 servers and a worker process are two crashes of the database
/// server (the first 2.5 s into the workload), a pause of a server and kills of a server and of
/// the worker process.
const DB_CRASH_SEED: u64 = 7;

/// The PostgreSQL server itself crashes under the HTTP workload (`--kinds db-crash`: `pg_ctl stop
/// -m immediate` of a cluster of the test's own, started again after 0.5-3 s) between kills and
/// pauses of the servers and a worker process: requests fail while it is down and are not
/// acknowledged; afterwards the servers and the worker reconnect by themselves, and every
/// acknowledged operation is there once.
#[test]
fn chaos_database_crashes_under_load_lose_nothing_and_the_servers_reconnect_by_themselves() {
    let Some(mut cluster) = crate::pg_cluster::Cluster::create() else { return };
    cluster.start();
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let store = cluster.url("chaosdb");
    let r = run(&[
        "chaos",
        "--seed",
        &DB_CRASH_SEED.to_string(),
        "--duration-s",
        "14",
        "--faults",
        "5",
        "--kinds",
        "sigkill,sigstop,db-crash",
        "--workers",
        "1",
        "--processes",
        "2",
        "--clients",
        "4",
        "--store",
        &store,
        "--db-data",
        path_str(&cluster.data()),
        "--out",
        path_str(&out),
    ]);
    println!("tidemark chaos --kinds db-crash: {}", r.json);
    r.assert_exit(0);
    let report = &r.json;
    assert_eq!(report["outcome"], "passed", "{report:#}");
    assert_eq!(report["faults"]["db_crash"], 2, "{report:#}");
    assert_eq!(report["faults"]["injected"], 5, "{report:#}");
    assert_eq!(
        (report["operations"]["lost"].as_u64(), report["operations"]["applied_twice"].as_u64()),
        (Some(0), Some(0))
    );
    // While the database was down the servers answered 503 `store_unavailable` (a typed,
    // retryable answer), never an acknowledgement.
    assert!(report["operations"]["by_status"]["503"].as_u64().unwrap_or(0) > 0, "{report:#}");
    // Operations were acknowledged after the last crash (the servers reconnected by themselves).
    let last_back = report["faults"]["schedule"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["kind"] == "db_crash")
        .map(|f| f["back_ms"].as_u64().unwrap())
        .max()
        .unwrap();
    let ledger = std::fs::read_to_string(out.join("ledger.jsonl")).expect("ledger");
    let after = ledger
        .lines()
        .map(|line| serde_json::from_str::<Value>(line).unwrap())
        .filter(|entry| entry["at_ms"].as_u64().unwrap() > last_back)
        .count();
    assert!(after > 0, "nothing acknowledged after the database came back at {last_back} ms: {report:#}");

    // --db-data must be the data folder of the server --store names.
    let other = dir.path().join("not-a-cluster");
    std::fs::create_dir_all(&other).unwrap();
    for db_data in [other.clone(), dir.path().to_path_buf()] {
        let r = run(&[
            "chaos",
            "--seed",
            "1",
            "--kinds",
            "db-crash",
            "--store",
            &cluster.url("chaosdb2"),
            "--db-data",
            path_str(&db_data),
            "--out",
            path_str(&dir.path().join("refused")),
        ]);
        assert_eq!(r.json["error"]["code"], "invalid_argument", "{}", r.stdout);
    }
}

/// The fault shim cargo builds beside the tests.
fn fault_shim() -> std::path::PathBuf {
    let shim = std::env::current_exe().unwrap().parent().unwrap().join("libtidemark_faultfs_preload.so");
    assert!(shim.exists(), "cargo builds the fault shim beside the tests: {}", shim.display());
    shim
}

/// A run of `seed` with the database machine's faults of `kinds` (3 in 12 s; 2 servers, a worker
/// process, 4 clients) on `cluster`, its server on the fault shim, the schemas under `prefix`.
fn database_chaos(cluster: &crate::pg_cluster::Cluster, out: &Path, seed: u64, kinds: &str, prefix: &str) -> Run {
    let (shim, store_url, seed) = (fault_shim(), cluster.url(prefix), seed.to_string());
    run(&[
        "chaos",
        "--seed",
        &seed,
        "--duration-s",
        "12",
        "--faults",
        "3",
        "--kinds",
        kinds,
        "--processes",
        "2",
        "--workers",
        "1",
        "--clients",
        "4",
        "--store",
        &store_url,
        "--db-data",
        path_str(&cluster.data()),
        "--db-preload",
        path_str(&shim),
        "--out",
        path_str(out),
    ])
}

/// The database machine loses power under the HTTP workload (`--kinds power-loss` with `--store`
/// and `--db-preload`: the server of a cluster of the test's own runs on the fault layer, and each
/// power loss stops it at once, throws away what it had not made durable, a prefix or reordered
/// and torn writes, and starts it again): every acknowledged operation is there once, and the
/// servers and the worker process reconnected by themselves.
#[test]
fn chaos_database_power_losses_lose_nothing_acknowledged() {
    let Some(mut cluster) = crate::pg_cluster::Cluster::create() else { return };
    cluster.start();
    let shim = fault_shim();
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let r = database_chaos(&cluster, &out, 21, "power-loss", "chaosloss");
    println!("tidemark chaos --kinds power-loss --db-preload: {}", r.json);
    r.assert_exit(0);
    let report = &r.json;
    assert_eq!(report["outcome"], "passed", "{report:#}");
    assert_eq!(report["faults"]["power_loss"], 3, "{report:#}");
    assert_eq!(
        (report["operations"]["lost"].as_u64(), report["operations"]["applied_twice"].as_u64()),
        (Some(0), Some(0))
    );
    let losses: Vec<&Value> =
        report["faults"]["schedule"].as_array().unwrap().iter().filter(|f| f["kind"] == "power_loss").collect();
    assert!(losses.iter().all(|f| f["power_loss"]["machine"] == "database"), "{report:#}");
    let writebacks: Vec<&str> = losses.iter().map(|f| f["power_loss"]["writeback"].as_str().unwrap()).collect();
    assert!(writebacks.contains(&"prefix") && writebacks.contains(&"reordered_torn"), "{writebacks:?}");
    // The layer was under the server: its losses found writes not made durable.
    let unsynced: u64 = losses.iter().map(|f| f["power_loss"]["files_with_unsynced_writes"].as_u64().unwrap()).sum();
    assert!(unsynced > 0, "{report:#}");
    assert!(report["reproduce"].as_str().unwrap().contains("--db-preload"), "{report:#}");
    // The server runs without the layer again, and the layer's folder is gone.
    let leftover = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .flatten()
        .any(|e| e.file_name().to_string_lossy().starts_with("tidemark-chaos-db-faultfs-21-"));
    assert!(!leftover, "the fault layer's folder is left behind");

    // A database power loss needs the shim, and the shim is only for it.
    let fresh = cluster.url("chaosrefused");
    let refused = |args: &[&str]| {
        let mut all = vec!["chaos", "--seed", "1", "--store", &fresh, "--out"];
        let out = dir.path().join("refused");
        all.push(path_str(&out));
        all.extend_from_slice(args);
        let r = run(&all);
        assert_eq!(r.json["error"]["code"], "invalid_argument", "{args:?}: {}", r.stdout);
    };
    let data = cluster.data();
    refused(&["--kinds", "power-loss", "--db-data", path_str(&data)]);
    refused(&["--kinds", "db-crash", "--db-data", path_str(&data), "--db-preload", path_str(&shim)]);
    refused(&["--kinds", "power-loss", "--db-data", path_str(&data), "--db-preload", "/nonexistent/shim.so"]);
    refused(&["--kinds", "io-error", "--db-data", path_str(&data)]);
    refused(&["--kinds", "io-error"]);
}

/// A seed whose 3 I/O errors are one of each mode: the disk full, failing writes, failing
/// fsyncs.
const DB_IO_ERROR_SEED: u64 = 28;

/// I/O errors of the database machine's disk under load (`--kinds io-error` with `--store`: the
/// fault shim's `full`, `eio-write` and `eio-fsync` under the server, [`DB_IO_ERROR_SEED`]):
/// requests fail meanwhile and are not acknowledged (a failed WAL write or fsync makes
/// PostgreSQL PANIC; the harness starts it again when its own restart failed), and afterwards
/// every acknowledged operation is there once and the servers and the worker go on by themselves.
#[test]
fn chaos_database_io_errors_lose_nothing_acknowledged() {
    let Some(mut cluster) = crate::pg_cluster::Cluster::create() else { return };
    cluster.start();
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let r = database_chaos(&cluster, &out, DB_IO_ERROR_SEED, "io-error", "chaosio");
    println!("tidemark chaos --kinds io-error --db-preload: {}", r.json);
    r.assert_exit(0);
    let report = &r.json;
    assert_eq!(report["outcome"], "passed", "{report:#}");
    assert_eq!(report["faults"]["io_error"], 3, "{report:#}");
    assert_eq!(
        (report["operations"]["lost"].as_u64(), report["operations"]["applied_twice"].as_u64()),
        (Some(0), Some(0))
    );
    let errors: Vec<&Value> =
        report["faults"]["schedule"].as_array().unwrap().iter().filter(|f| f["kind"] == "io_error").collect();
    let modes: std::collections::BTreeSet<&str> = errors.iter().map(|f| f["io_error"].as_str().unwrap()).collect();
    assert_eq!(modes, ["eio_fsync", "eio_write", "full"].into(), "{report:#}");
    // Each was the database's disk (the harness says whether it had to start the server again).
    assert!(errors.iter().all(|f| f["io_error_database_restarted"].is_boolean()), "{report:#}");
    // Requests failed while the disk did, and were not acknowledged.
    let failed: u64 = report["operations"]["by_status"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(status, _)| status.starts_with('5'))
        .map(|(_, n)| n.as_u64().unwrap())
        .sum();
    assert!(failed > 0, "no request failed during the I/O errors: {report:#}");
}

/// Partitions between the servers' relays and a remote consumer's server (another `tidemark
/// serve` behind the harness's TCP proxy): after cuts, a black hole, lost answers and a flap,
/// every acknowledged event is in the remote inbox once, applied in order, and the relays caught
/// up by themselves. The remote inbox is part of the independent check (a record deleted from it
/// is reported `not_applied`).
#[test]
fn chaos_partitions_of_a_remote_consumer_lose_nothing_and_deliver_nothing_twice() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let r = run(&[
        "chaos",
        "--seed",
        &PARTITION_SEED.to_string(),
        "--duration-s",
        "12",
        "--faults",
        "5",
        "--kinds",
        "partition",
        "--processes",
        "2",
        "--clients",
        "4",
        "--out",
        path_str(&out),
    ]);
    println!("tidemark chaos --kinds partition: {}", r.json);
    r.assert_exit(0);
    let report = &r.json;
    assert_eq!(report["outcome"], "passed", "{report:#}");
    assert_eq!(
        (report["operations"]["lost"].as_u64(), report["operations"]["applied_twice"].as_u64()),
        (Some(0), Some(0))
    );
    let modes: std::collections::BTreeSet<&str> =
        report["faults"]["schedule"].as_array().unwrap().iter().filter_map(|f| f["partition"].as_str()).collect();
    assert_eq!(modes, ["black_hole", "cut", "flap", "lose_answers"].into(), "{report:#}");
    assert!(report["faults"]["link"]["answers_lost"].as_u64().unwrap() > 0, "no answer was lost: {report:#}");
    // The cuts quarantined deliveries (three attempts each), and the outbox operator requeued
    // them, redelivered from them or dismissed them: the check above holds after all three.
    let operations = &report["operations"];
    assert!(operations["quarantines_requeued"].as_u64().unwrap() > 0, "{report:#}");
    assert!(operations["quarantines_redelivered"].as_u64().unwrap() > 0, "{report:#}");
    assert!(operations["quarantines_dismissed"].as_u64().unwrap() > 0, "{report:#}");
    assert!(report["check"]["ledger"]["dismissals"].as_u64().unwrap() > 0, "{report:#}");
    assert_eq!(operations["unexpected_answers"], 0, "{report:#}");
    // Delivery resumed after the heals (measured, not bounded: the figure is in the report).
    assert!(report["partition_recovery_ms"]["observed"].as_u64().unwrap() > 0, "{report:#}");
    // A delivery still dismissed at the end (a later redelivery may have sent the event again)
    // is one the ledger holds: without the ledger's dismissals, it is reported (`lost`), and so
    // are its flow's events the remote inbox then never got.
    let producer = out.join("data").join("tenants").join("chaos").join("producer.db");
    let dismissed: i64 = rusqlite::Connection::open(&producer)
        .unwrap()
        .query_row("SELECT count(*) FROM deliveries WHERE status = 'dismissed'", [], |r| r.get(0))
        .unwrap();
    println!("deliveries still dismissed: {dismissed}");
    if dismissed > 0 {
        let ledger_path = out.join("ledger.jsonl");
        let ledger = std::fs::read_to_string(&ledger_path).unwrap();
        let without: String = ledger
            .lines()
            .filter(|line| !line.contains(r#""kind":"dismiss""#))
            .map(|line| format!("{line}\n"))
            .collect();
        assert!(without.len() < ledger.len(), "the ledger holds no dismissal");
        std::fs::write(&ledger_path, without).unwrap();
        let checked = check(&out);
        assert_eq!(checked.json["outcome"], "violations", "{}", checked.stdout);
        assert_eq!(violations(&checked.json, "lost"), dismissed as u64, "{}", checked.stdout);
        std::fs::write(&ledger_path, ledger).unwrap();
    }
    // The checker reads the remote inbox: a record taken out of it is reported (two records of
    // flows with no dismissal, whose events the remote inbox must all hold).
    let producer = rusqlite::Connection::open(&producer).unwrap();
    let dismissed_flows: std::collections::HashSet<String> = std::fs::read_to_string(out.join("ledger.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str::<Value>(line).unwrap())
        .filter(|entry| entry["kind"] == "dismiss")
        .map(|entry| {
            let event_id = entry["event_id"].as_str().unwrap().to_string();
            producer.query_row("SELECT flow_id FROM outbox WHERE event_id = ?1", [event_id], |r| r.get(0)).unwrap()
        })
        .collect();
    let inbox = out.join("remote").join("tenants").join("chaos").join("inbox.db");
    let conn = rusqlite::Connection::open(&inbox).unwrap();
    let records: Vec<(i64, String)> = conn
        .prepare("SELECT rowid, flow_id FROM inbox ORDER BY rowid")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let taken: Vec<i64> =
        records.iter().filter(|(_, flow)| !dismissed_flows.contains(flow)).map(|(rowid, _)| *rowid).take(2).collect();
    assert_eq!(taken.len(), 2);
    for rowid in taken {
        assert_eq!(conn.execute("DELETE FROM inbox WHERE rowid = ?1", [rowid]).unwrap(), 1);
    }
    drop(conn);
    let checked = check(&out);
    assert_eq!(checked.json["outcome"], "violations", "{}", checked.stdout);
    assert_eq!(violations(&checked.json, "not_applied"), 2, "{}", checked.stdout);
}

/// The machine's broker at `host:port` (from `env`, else `default`), or `None` after saying why
/// the test is skipped.
fn broker_answering(env: &str, default: &str) -> Option<String> {
    let server = std::env::var(env).unwrap_or_else(|_| default.to_string());
    let answers = std::net::ToSocketAddrs::to_socket_addrs(server.as_str())
        .ok()
        .and_then(|mut a| a.next())
        .is_some_and(|addr| std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(2)).is_ok());
    if !answers {
        crate::support::skip(&format!("no broker answers at {server} (set {env}; .ci/run starts it)"));
    }
    answers.then_some(server)
}

/// Partitions of every mode and kills of the remote server ([`BROKER_SEED`]) with the remote
/// consumer reached through `broker`: the servers' relays publish through the proxy, the remote
/// server consumes from the broker. The servers run on SQLite files, then (when PostgreSQL
/// answers) on PostgreSQL schemas, where the remote server is too (its own schemas, under the
/// prefix `<prefix>_r`).
fn broker_partitions(broker: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    broker_partitions_on(broker, &dir.path().join("files"), None);
    if let Some(_postgres) = crate::workflow_cli::on_postgres() {
        let _schemas = crate::server_support::DropServedSchemas;
        let out = dir.path().join("schemas");
        let store = crate::server_support::store_of(&out).expect("on PostgreSQL");
        broker_partitions_on(broker, &out, Some(&store));
    }
}

/// How long the clients of a broker partition run send requests (`--duration-s`).
const BROKER_WORKLOAD_MS: u64 = 14_000;

fn broker_partitions_on(broker: &str, out: &Path, store: Option<&str>) {
    let seed = BROKER_SEED.to_string();
    let store_args = store.map(|url| vec!["--store", url]).unwrap_or_default();
    let r = run(&[
        &[
            "chaos",
            "--seed",
            &seed,
            "--duration-s",
            &(BROKER_WORKLOAD_MS / 1_000).to_string(),
            "--faults",
            "7",
            "--kinds",
            "partition,remote-kill",
            "--broker",
            broker,
            "--processes",
            "2",
            "--clients",
            "4",
            "--out",
            path_str(out),
        ],
        &store_args[..],
    ]
    .concat());
    println!("tidemark chaos --kinds partition --broker {broker} (store {store:?}): {}", r.json);
    r.assert_exit(0);
    let report = &r.json;
    assert_eq!(report["outcome"], "passed", "{report:#}");
    assert_eq!(
        (report["operations"]["lost"].as_u64(), report["operations"]["applied_twice"].as_u64()),
        (Some(0), Some(0))
    );
    assert_eq!(report["faults"]["link"]["broker"]["url"], broker, "{report:#}");
    // The remote server is on the servers' backend: its inbox, which the checker read, too.
    match store {
        Some(url) => {
            let prefix = url.rsplit_once("schema=").unwrap().1;
            let remote = report["remote_store"].as_str().unwrap_or_default();
            assert!(remote.ends_with(&format!("schema={prefix}_r")), "{report:#}");
        }
        None => assert!(report["remote_store"].is_null(), "{report:#}"),
    }
    assert!(report["reproduce"].as_str().unwrap().ends_with(&format!(" --broker {broker}")), "{report:#}");
    let modes: std::collections::BTreeSet<&str> =
        report["faults"]["schedule"].as_array().unwrap().iter().filter_map(|f| f["partition"].as_str()).collect();
    assert_eq!(modes, ["black_hole", "cut", "flap", "lose_answers"].into(), "{report:#}");
    assert!(report["faults"]["remote_kill"].as_u64().unwrap() > 0, "{report:#}");
    // Faults run one after the other: on a loaded machine a partition may begin only after the
    // clients stopped (at 14 s), when little crosses the link.
    let during_the_workload =
        |mode: &str| {
            report["faults"]["schedule"].as_array().unwrap().iter().any(|f| {
                f["partition"] == mode && f["began_ms"].as_u64().is_some_and(|began| began < BROKER_WORKLOAD_MS)
            })
        };
    if broker != "kafka-mock" && !during_the_workload("lose_answers") {
        println!("note: the lose_answers partition began after the clients stopped; its losses are not required");
    }
    if broker != "kafka-mock" {
        // The proxies threw answers away (the mock Kafka broker answers late instead, at itself).
        let lost = report["faults"]["link"]["answers_lost"].as_u64().unwrap();
        assert!(lost > 0 || !during_the_workload("lose_answers"), "no answer was lost: {report:#}");
        // Every partition failed the relays' link, the source's, or both.
        let sides = &report["faults"]["link"]["sides"];
        let failed: u64 = ["relays", "source", "both"].iter().map(|side| sides[side].as_u64().unwrap()).sum();
        assert_eq!(failed, report["faults"]["partition"].as_u64().unwrap(), "{report:#}");
        assert!(report["faults"]["link"]["source"]["connections"].as_u64().unwrap() > 0, "{report:#}");
    }
    // Every outbox event reached the remote inbox through the broker (the checker read it).
    assert!(report["check"]["outbox_events"].as_u64().unwrap() > 0, "{report:#}");
    assert!(report["partition_recovery_ms"]["observed"].as_u64().unwrap() > 0, "{report:#}");
}

/// Partitions between the servers' relays and NATS JetStream (cut, black hole, lost PubAcks,
/// flap) and kills of the remote server consuming the stream into its inbox (what it had pulled
/// and not acked is delivered again after `ack_wait_ms`): nothing lost, nothing applied twice,
/// every flow in order at the remote inbox, the relays caught up by themselves.
#[test]
fn chaos_partitions_between_the_relays_and_nats_lose_nothing_and_deliver_nothing_twice() {
    if let Some(server) = broker_answering("TIDEMARK_TEST_NATS", "127.0.0.1:4222") {
        broker_partitions(&format!("nats://{server}"));
    }
}

/// The same with RabbitMQ between them (lost publisher confirms: the queue holds a second copy,
/// which the remote inbox answers `duplicate`; a killed source's unacked deliveries go back to the
/// queue).
#[test]
fn chaos_partitions_between_the_relays_and_rabbitmq_lose_nothing_and_deliver_nothing_twice() {
    if let Some(server) = broker_answering("TIDEMARK_TEST_AMQP", "127.0.0.1:5672") {
        broker_partitions(&format!("amqp://{server}"));
    }
}

/// The same with Kafka between them: rdkafka's mock cluster inside the harness process (no Kafka
/// broker runs here), failed at the broker itself (taken down for a cut, answering late for a
/// black hole or lost answers: the relay publishes again, and the remote inbox answers the
/// second copy `duplicate`); a killed source's uncommitted offsets are read again by the group.
#[test]
fn chaos_partitions_between_the_relays_and_a_mock_kafka_cluster_lose_nothing_and_deliver_nothing_twice() {
    broker_partitions("kafka-mock");
}

/// Kills of the remote consumer's server (over HTTP) among kills of the servers: batches it
/// committed before it died are sent again and answered `duplicate`; nothing lost or doubled.
#[test]
fn chaos_kills_of_the_remote_server_lose_nothing_and_deliver_nothing_twice() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let r = run(&[
        "chaos",
        "--seed",
        &REMOTE_KILL_SEED.to_string(),
        "--duration-s",
        "10",
        "--faults",
        "4",
        "--kinds",
        "sigkill,remote-kill",
        "--processes",
        "2",
        "--clients",
        "4",
        "--out",
        path_str(&out),
    ]);
    println!("tidemark chaos --kinds sigkill,remote-kill: {}", r.json);
    r.assert_exit(0);
    let report = &r.json;
    assert_eq!(report["outcome"], "passed", "{report:#}");
    assert_eq!(
        (report["operations"]["lost"].as_u64(), report["operations"]["applied_twice"].as_u64()),
        (Some(0), Some(0))
    );
    let kills = (report["faults"]["sigkill"].as_u64().unwrap(), report["faults"]["remote_kill"].as_u64().unwrap());
    assert!(kills.0 > 0 && kills.1 > 0, "{report:#}");
    assert!(report["partition_recovery_ms"]["observed"].as_u64().unwrap() > 0, "{report:#}");
}

#[test]
fn chaos_bad_input_is_a_typed_error_and_starts_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let out_str = path_str(&out);
    let cases: [&[&str]; 25] = [
        &["chaos", "--seed", "1", "--broker", "nats://127.0.0.1:4222", "--out", out_str],
        &["chaos", "--seed", "1", "--kinds", "partition", "--broker", "http://127.0.0.1:1", "--out", out_str],
        &["chaos", "--seed", "1", "--kinds", "partition", "--broker", "amqp://rabbit", "--out", out_str],
        &["chaos", "--seed", "1", "--workers", "9", "--out", out_str],
        &["chaos", "--seed", "not-a-number", "--out", out_str],
        &["chaos", "--out", out_str],
        &["chaos", "--seed", "1", "--processes", "0", "--out", out_str],
        &["chaos", "--seed", "1", "--processes", "17", "--out", out_str],
        &["chaos", "--seed", "1", "--faults", "10001", "--out", out_str],
        &["chaos", "--seed", "1", "--duration-s", "0", "--out", out_str],
        &["chaos", "--seed", "1", "--kinds", "meteor", "--out", out_str],
        &["chaos", "--seed", "1", "--store", "sqlite:x.db", "--out", out_str],
        &["chaos", "--seed", "1", "--store", "postgres://u@h/d?schema=Bad-Prefix", "--out", out_str],
        &["chaos", "--seed", "1", "--store", "postgres://u@h/d?schema=ok", "--kinds", "power-loss", "--out", out_str],
        // A prefix of 24 bytes leaves no room for the remote server's `<prefix>_r` (at most 24).
        &[
            "chaos",
            "--seed",
            "1",
            "--store",
            "postgres://u@h/d?schema=abcdefghijklmnopqrstuvwx",
            "--kinds",
            "partition",
            "--out",
            out_str,
        ],
        &["chaos", "--seed", "1", "--kinds", "db-crash", "--out", out_str],
        &["chaos", "--seed", "1", "--db-data", "/tmp", "--out", out_str],
        &["chaos", "--seed", "1", "--clock-jump-leases-max", "0", "--out", out_str],
        &["chaos", "--seed", "1", "--clock-jump-leases-max", "86401", "--out", out_str],
        &["chaos", "--seed", "1", "--faults", "3", "--faults-only", "3", "--out", out_str],
        &["chaos", "--seed", "1", "--faults", "3", "--faults-only", "1,1", "--out", out_str],
        &["chaos", "shrink", "--seed", "1", "--attempts-max", "0", "--out", out_str],
        &["chaos", "shrink", "--seed", "1"],
        &["chaos", "shrink", "--out", out_str],
        &["chaos", "--seed", "1", "--store", "postgres://u@h/d?schema=ok", "--disk", "/tmp", "--out", out_str],
    ];
    for args in cases {
        let r = run(args);
        assert_eq!(r.code, 2, "{args:?}: {}", r.stdout);
        assert_eq!(r.json["error"]["code"], "invalid_argument", "{args:?}: {}", r.stdout);
    }
    assert!(!out.exists(), "nothing was created");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("something"), "x").unwrap();
    let r = run(&["chaos", "--seed", "1", "--out", out_str]);
    assert_eq!(r.code, 2, "{}", r.stdout);
    assert_eq!(r.json["error"]["code"], "already_exists", "{}", r.stdout);
    let r = run(&["chaos", "check", "--out", path_str(&dir.path().join("nothing"))]);
    assert_eq!(r.code, 2, "{}", r.stdout);
}
