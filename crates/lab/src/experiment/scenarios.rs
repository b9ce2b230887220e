//! Every scenario of `docs/scenarios.md`. Each one runs in its own folder, uses explicit clock
//! values derived from `s.t0`, records its steps and ends with named assertions; the harness
//! reads the final state. Scenarios with `failpoints: true` kill real child processes at crash
//! points and need the `failpoints` cargo feature.

use serde_json::{json, Value};
use tidemark_core::flow::AdvanceOutcome;
use tidemark_core::policy::{RelayPolicy, DAY_MS};
use tidemark_core::store::{DeliveryAction, DeliveryStatus, DrainStop, InboxStatus, ReceiveOutcome};
use tidemark_core::{Envelope, Error, Result};
use tidemark_engine::RelayOptions;

use super::world::{advance_args, request, Sc, CHILD_EXIT_CODE};

/// One scenario of the experiment.
pub struct Def {
    pub name: &'static str,
    /// Which seed document it comes from (`000`, `002` or both).
    pub seed: &'static str,
    pub title: &'static str,
    /// Needs crash points (`--features failpoints`).
    pub failpoints: bool,
    /// A parameter for shared scenario functions (the crash point).
    pub param: &'static str,
    pub run: fn(&mut Sc, &'static str) -> Result<()>,
}

const CRASH_EXIT_CODE: i32 = tidemark_core::crash::CRASH_EXIT_CODE;

macro_rules! crash_def {
    ($point:literal, $seed:literal, $title:literal) => {
        Def {
            name: concat!("crash.", $point),
            seed: $seed,
            title: $title,
            failpoints: true,
            param: $point,
            run: crash_at,
        }
    };
}

/// Every scenario, in the order of `docs/scenarios.md`.
pub fn all() -> Vec<Def> {
    fn def(
        name: &'static str,
        seed: &'static str,
        title: &'static str,
        run: fn(&mut Sc, &'static str) -> Result<()>,
    ) -> Def {
        Def { name, seed, title, failpoints: false, param: "", run }
    }
    vec![
        def("producer_rollback", "002", "A producer transaction that rolls back leaves neither the business row nor the event", producer_rollback),
        def("unsafe_dual_write_loss", "000", "A deliberately wrong dual write (exit 81) loses the event; the one-transaction path loses nothing", unsafe_dual_write_loss),
        crash_def!("advance.before_commit", "000", "Producer killed before its commit: neither state nor event; the retry commits seq 1"),
        crash_def!("advance.after_commit", "000", "Producer killed after its commit: state and event both there; the retry is answered stale"),
        crash_def!("relay.after_consumer_commit", "000+002", "Relay killed after the inbox commit, before the producer records it: redelivery is a duplicate"),
        crash_def!("relay.before_producer_commit", "000", "Relay killed inside the producer transaction: the verdicts roll back, redelivery is a duplicate"),
        crash_def!("relay.after_producer_commit", "000", "Relay killed after both commits: nothing is redelivered"),
        crash_def!("receive.before_commit", "000", "Receive killed before its commit: the inbox holds nothing; the relay delivers again"),
        crash_def!("receive.after_commit", "000", "Receive killed after its commit: the relay's delivery is a duplicate"),
        crash_def!("apply.after_handler", "000+002", "Drain killed after the handler wrote its effect: effect and inbox status roll back; the retry applies once"),
        crash_def!("apply.before_commit", "000+002", "Drain killed just before its commit: nothing applied; the retry applies once"),
        crash_def!("apply.after_commit", "000", "Drain killed after its commit: applied once; the retry is idle and redelivery a duplicate"),
        crash_def!("prune.before_commit", "002", "Prune killed before its commit: bodies kept; the rerun compacts; replays stay duplicates"),
        crash_def!("prune.after_commit", "002", "Prune killed after its commit: receipts kept; replays stay duplicates"),
        crash_def!("resolve.before_commit", "000", "Operator resolve killed before its commit: the delivery stays quarantined; the rerun dismisses it"),
        crash_def!("rename.before_commit", "002", "Consumer rename killed before its commit: nothing renamed; the rerun carries the dedup state"),
        def("consumer_rollback_then_retry", "002", "A handler failure rolls back the whole apply (inbox status and effects); the retry applies once", consumer_rollback_then_retry),
        def("duplicate_delivery", "000+002", "Accepted is custody, not application; a redelivered event is a duplicate and applies once", duplicate_delivery),
        def("two_consumers_apply_once_each", "002", "Dedup is scoped by consumer: audit and search each apply the same event once", two_consumers_apply_once_each),
        def("conflict_same_id_different_content", "002", "Same event id with a different amount is a conflict (inbox and receipt); the effect stays 100", conflict_same_id_different_content),
        def("conflict_same_seq_different_id", "000", "Same (flow, seq) with a different event id, or an id reused at another seq, is a conflict", conflict_same_seq_different_id),
        def("producer_restored_from_backup", "000", "A producer restored from an old backup: redelivery is a duplicate, a re-issued seq is a conflict naming the generation change", producer_restored_from_backup),
        def("rejections_are_not_remembered", "000", "stale and invalid_transition are answers, not remembered state", rejections_are_not_remembered),
        def("bad_input_is_an_error", "000", "Out-of-range quantities, ids, versions and seqs are errors; nothing is written", bad_input_is_an_error),
        def("gap_waits_for_missing_seq", "000", "A gap stops its flow until the missing seq arrives; nothing is skipped", gap_waits_for_missing_seq),
        def("blocked_v2_then_support_v2", "000", "A v2 event is blocked with its body unchanged; with support_v2 the same record (same id and seq) applies", blocked_v2_then_support_v2),
        def("blocked_flow_stops_only_itself", "000", "A blocked flow stops only itself; other flows apply", blocked_flow_stops_only_itself),
        def("drain_stop_reasons", "000", "drain is bounded and says why it stopped: idle, limit, gap, blocked", drain_stop_reasons),
        def("six_arrival_orders", "000", "All six arrival orders of three events give the same final state", six_arrival_orders),
        def("forced_order_3_1_2", "000", "The relay forced to deliver 3, then 1, then 2: applied 1, 2, 3", forced_order_3_1_2),
        def("six_process_concurrency", "000", "Six processes race to advance one flow: one winner per seq (counts only), then concurrent relays and drains apply once", six_process_concurrency),
        def("rename_consumer", "002", "Renaming audit to audit-v2 carries the dedup state; a new id starts fresh; the old id is refused", rename_consumer),
        def("retention_prune_replay", "002", "Pruning keeps receipts and high-water marks: replays are duplicates, then expired; never a second effect", retention_prune_replay),
        def("starvation_fixed", "000+002", "A permanently conflicting flow A backs off and is quarantined while flow B is delivered", starvation_fixed),
        def("quarantine_operator_requeue_dismiss", "000", "Quarantined deliveries wait for an operator: requeue delivers, dismiss is recorded and never an ack", quarantine_operator_requeue_dismiss),
        def("snapshot_not_atomic", "000", "A snapshot reads each file in its own transaction and says so: the two are not one atomic snapshot", snapshot_not_atomic),
        def("init_never_resets", "000", "Re-running init keeps every row, the generation and the retention horizon", init_never_resets),
    ]
}

fn relay_default() -> RelayOptions {
    RelayOptions { keep_answers: true, ..RelayOptions::default() }
}

fn relay_with(max_attempts: u32, backoff_base_ms: i64, backoff_max_ms: i64, limit: usize) -> RelayOptions {
    RelayOptions {
        limit,
        event_id: None,
        policy: RelayPolicy { max_attempts, backoff_base_ms, backoff_max_ms },
        keep_answers: true,
        consumers: None,
    }
}

fn relay_event(event_id: &str) -> RelayOptions {
    RelayOptions { event_id: Some(event_id.to_string()), ..relay_default() }
}

fn is_committed(outcome: &AdvanceOutcome, seq: i64) -> bool {
    matches!(outcome, AdvanceOutcome::Committed { seq: s, .. } if *s == seq)
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// An event from a producer the consumer knew before (a re-created producer): same source and
/// position as a real one, another id and generation.
fn foreign_event(flow: &str, seq: i64, quantity: i64, t: i64) -> Envelope {
    Envelope {
        event_id: format!("old-producer-{flow}-{seq}"),
        source: "shop".into(),
        generation: "old-producer-generation".into(),
        flow_id: flow.into(),
        seq,
        event_type: "reservation.reserved".into(),
        schema_version: 1,
        payload: json!({"amount": quantity}),
        created_at_ms: t,
        traceparent: None,
    }
}

/// order-1: reserved (quantity 3), confirmed.
fn two_events(s: &mut Sc, t: i64) -> Result<()> {
    s.advance("advance order-1 new -> reserved (quantity 3)", "order-1", 0, "reserved", Some(3), 1, t)?;
    s.advance("advance order-1 reserved -> confirmed", "order-1", 1, "confirmed", None, 1, t)?;
    Ok(())
}

fn producer_rollback(s: &mut Sc, _: &'static str) -> Result<()> {
    s.pipeline(&["audit"])?;
    s.create_orders_table()?;
    let t = s.t0;
    s.business_advance(
        "one producer transaction: insert order-1, reserve its flow, then roll back",
        "order-1",
        100,
        false,
        t,
    )?;
    let orders = s.orders()?.len();
    let outbox = s.outbox()?.len();
    s.record("after the rollback", json!({"orders": orders, "outbox": outbox}));
    s.check("rollback_leaves_no_order", orders == 0, format!("{orders} orders"));
    s.check("rollback_leaves_no_event", outbox == 0, format!("{outbox} outbox events"));
    let no_deliveries = s.deliveries()?.is_empty();
    s.check("rollback_queues_no_delivery", no_deliveries, "no delivery rows");
    s.business_advance("the same transaction, committed", "order-1", 100, true, t)?;
    let orders = s.orders()?.len();
    let outbox = s.outbox()?.len();
    s.check("commit_writes_both", orders == 1 && outbox == 1, format!("{orders} orders, {outbox} events"));
    s.relay_until_idle("relay", &relay_default(), t)?;
    s.drain("drain audit", "consumer", "audit", 100, false, t)?;
    s.check_exactly_once("consumer", "audit")
}

fn unsafe_dual_write_loss(s: &mut Sc, _: &'static str) -> Result<()> {
    s.pipeline(&["audit"])?;
    s.create_orders_table()?;
    let t = s.t0;
    let producer = s.producer_arg();
    let run = s.child(
        "child: WRONG dual write: commit order-1 alone, die (exit 81) before writing its event",
        &strings(&["experiment", "--child", "unsafe-dual-write", "--child-producer", &producer]),
        None,
        t,
    )?;
    s.check("unsafe_child_exited_81", run.code == CHILD_EXIT_CODE, format!("exit code {}", run.code));
    let orders = s.orders()?;
    let outbox = s.outbox()?.len();
    s.record("after the child died (fresh reads)", json!({"orders": orders, "outbox_events": outbox}));
    s.check(
        "unsafe_business_row_committed",
        orders.iter().any(|o| o.starts_with("order-1 ")),
        format!("orders: {orders:?}"),
    );
    s.check("unsafe_event_lost", outbox == 0, format!("{outbox} outbox events for a committed order"));
    let report =
        s.relay_until_idle("relay: nothing to deliver, the consumer never learns of order-1", &relay_default(), t)?;
    s.check("consumer_never_learns", report.attempted == 0, format!("{} deliveries attempted", report.attempted));

    let run = s.child(
        "child: the tidemark way: order-2 and its event in one transaction, die (exit 81) before the commit",
        &strings(&["experiment", "--child", "safe-exit-before-commit", "--child-producer", &producer]),
        None,
        t,
    )?;
    s.check("safe_child_exited_81", run.code == CHILD_EXIT_CODE, format!("exit code {}", run.code));
    let orders = s.orders()?;
    let outbox = s.outbox()?.len();
    s.record("after the child died (fresh reads)", json!({"orders": orders, "outbox_events": outbox}));
    s.check(
        "safe_path_leaves_neither",
        !orders.iter().any(|o| o.starts_with("order-2 ")) && outbox == 0,
        format!("orders: {orders:?}, {outbox} events"),
    );
    s.business_advance("retry order-2 in one transaction, committed", "order-2", 5, true, t)?;
    s.relay_until_idle("relay", &relay_default(), t)?;
    s.drain("drain audit", "consumer", "audit", 100, false, t)?;
    let orders = s.orders()?;
    let outbox = s.outbox()?.len();
    s.check(
        "safe_path_commits_both",
        orders.iter().any(|o| o.starts_with("order-2 ")) && outbox == 1,
        format!("orders: {orders:?}, {outbox} events"),
    );
    s.check_exactly_once("consumer", "audit")
}

/// The crash scenarios: a real child process of this binary is killed at `point` (exit 73);
/// the parent then checks what is on disk with fresh reads and recovers by simply retrying.
fn crash_at(s: &mut Sc, point: &'static str) -> Result<()> {
    s.pipeline(&["audit"])?;
    let t = s.t0;
    let producer = s.producer_arg();
    let consumer = s.consumer_arg("consumer");
    let crashed = |s: &mut Sc, what: &str, args: Vec<String>, t: i64| -> Result<()> {
        let run = s.child(&format!("child with TIDEMARK_CRASH_AT={point}: {what}"), &args, Some(point), t)?;
        s.check("child_killed_at_crash_point", run.code == CRASH_EXIT_CODE, format!("exit code {}", run.code));
        s.observe("state right after the crash (fresh reads)")
    };
    let mut check_exactly_once = true;
    match point {
        "advance.before_commit" | "advance.after_commit" => {
            crashed(s, "advance order-1 -> reserved", advance_args(&producer, "order-1", 0, "reserved", Some(3)), t)?;
            let outbox = s.outbox()?.len();
            let deliveries = s.deliveries()?.len();
            if point == "advance.before_commit" {
                s.check("nothing_committed", outbox == 0 && deliveries == 0, format!("{outbox} events"));
                let retry =
                    s.advance("the caller retries the same request", "order-1", 0, "reserved", Some(3), 1, t)?;
                s.check("retry_commits_seq_1", is_committed(&retry, 1), retry.word());
            } else {
                s.check(
                    "state_and_event_committed_together",
                    outbox == 1 && deliveries == 1,
                    format!("{outbox} events"),
                );
                let retry =
                    s.advance("the caller retries the same request", "order-1", 0, "reserved", Some(3), 1, t)?;
                s.check("retry_answers_stale", retry.word() == "stale", retry.word());
            }
            s.relay_until_idle("relay", &relay_default(), t)?;
            s.drain("drain audit", "consumer", "audit", 100, false, t)?;
        }
        "relay.after_consumer_commit" | "relay.before_producer_commit" => {
            two_events(s, t)?;
            crashed(s, "relay", strings(&["relay", "--producer", &producer]), t)?;
            let inbox = s.inbox("consumer")?.len();
            let pending = s.pending_deliveries()?;
            s.check("consumer_holds_both_events", inbox == 2, format!("{inbox} inbox records"));
            s.check("producer_still_pending", pending == 2, format!("{pending} pending deliveries"));
            let report = s.drain(
                "drain audit before the producer learns (the consumer side is complete)",
                "consumer",
                "audit",
                100,
                false,
                t,
            )?;
            s.check("consumer_applies_before_ack", report.applied == 2, format!("applied {}", report.applied));
            let relay = s.relay_until_idle("relay again: redelivery", &relay_default(), t)?;
            s.check(
                "redelivery_is_duplicate",
                relay.duplicate == 2 && relay.accepted == 0,
                format!("{} duplicate, {} accepted", relay.duplicate, relay.accepted),
            );
            let report = s.drain("drain audit again", "consumer", "audit", 100, false, t)?;
            s.check("nothing_left_to_apply", report.applied == 0, format!("applied {}", report.applied));
        }
        "relay.after_producer_commit" => {
            two_events(s, t)?;
            crashed(s, "relay", strings(&["relay", "--producer", &producer]), t)?;
            let accepted = s.deliveries()?.iter().filter(|d| d.status == DeliveryStatus::Accepted).count();
            let held = s.inbox("consumer")?.len();
            s.check("both_commits_done", accepted == 2 && held == 2, format!("{accepted} accepted, {held} held"));
            let relay = s.relay_until_idle("relay again", &relay_default(), t)?;
            s.check("nothing_redelivered", relay.attempted == 0, format!("{} attempted", relay.attempted));
            s.drain("drain audit", "consumer", "audit", 100, false, t)?;
        }
        "receive.before_commit" | "receive.after_commit" => {
            two_events(s, t)?;
            let event = s.event("order-1", 1)?;
            let file = s.dir.join("event.json");
            std::fs::write(&file, serde_json::to_vec(&event).expect("envelopes serialise"))
                .map_err(|e| Error::io(format!("writing the envelope file: {e}")))?;
            let file = file.to_string_lossy().into_owned();
            crashed(
                s,
                "receive order-1/1 for audit",
                strings(&["receive", "--consumer-db", &consumer, "--consumer-id", "audit", "--file", &file]),
                t,
            )?;
            let inbox = s.inbox("consumer")?.len();
            let relay = if point == "receive.before_commit" {
                s.check("inbox_holds_nothing", inbox == 0, format!("{inbox} inbox records"));
                let relay = s.relay_until_idle("relay delivers both", &relay_default(), t)?;
                s.check("relay_delivers_both", relay.accepted == 2, format!("{} accepted", relay.accepted));
                relay
            } else {
                s.check("inbox_holds_the_event", inbox == 1, format!("{inbox} inbox records"));
                let relay = s.relay_until_idle("relay: order-1/1 is a duplicate", &relay_default(), t)?;
                s.check(
                    "redelivery_is_duplicate",
                    relay.duplicate == 1 && relay.accepted == 1,
                    format!("{} duplicate, {} accepted", relay.duplicate, relay.accepted),
                );
                relay
            };
            let _ = relay;
            s.drain("drain audit", "consumer", "audit", 100, false, t)?;
        }
        "apply.after_handler" | "apply.before_commit" | "apply.after_commit" => {
            two_events(s, t)?;
            s.relay_until_idle("relay", &relay_default(), t)?;
            crashed(s, "drain audit", strings(&["drain", "--consumer-db", &consumer, "--consumer-id", "audit"]), t)?;
            let effects = s.effects("consumer")?.len();
            let applied = s.inbox("consumer")?.iter().filter(|i| i.status == InboxStatus::Applied).count();
            let cursors = s.cursors("consumer")?.len();
            if point == "apply.after_commit" {
                s.check("applied_and_committed", effects == 2 && applied == 2, format!("{effects} effects"));
                let report = s.drain("drain audit again", "consumer", "audit", 100, false, t)?;
                s.check(
                    "retry_is_idle",
                    report.applied == 0 && report.outcome == DrainStop::Idle,
                    format!("applied {}", report.applied),
                );
                let event = s.event("order-1", 1)?;
                let outcome = s.receive("redeliver order-1/1", "consumer", "audit", &event, t)?;
                s.check("redelivery_is_duplicate", outcome.word() == "duplicate", outcome.word());
            } else {
                s.check(
                    "effects_and_status_rolled_back",
                    effects == 0 && applied == 0 && cursors == 0,
                    format!("{effects} effects, {applied} applied, {cursors} cursors"),
                );
                let report = s.drain("drain audit again", "consumer", "audit", 100, false, t)?;
                s.check("retry_applies_both", report.applied == 2, format!("applied {}", report.applied));
            }
        }
        "prune.before_commit" | "prune.after_commit" => {
            two_events(s, t)?;
            s.relay_until_idle("relay", &relay_default(), t)?;
            s.drain("drain audit", "consumer", "audit", 100, false, t)?;
            crashed(
                s,
                "prune (applied retention 0)",
                strings(&["prune", "--consumer-db", &consumer, "--applied-retention-ms", "0"]),
                t + 1_000,
            )?;
            let receipts = s.receipts("consumer")?;
            let inbox = s.inbox("consumer")?.len();
            let report = s.prune("prune again", "consumer", 0, t + 1_000)?;
            if point == "prune.before_commit" {
                s.check("bodies_kept", receipts == 0 && inbox == 2, format!("{receipts} receipts"));
                s.check("rerun_compacts", report.compacted == 2, format!("compacted {}", report.compacted));
            } else {
                s.check("receipts_kept", receipts == 2 && inbox == 0, format!("{receipts} receipts"));
                s.check("rerun_has_nothing_to_do", report.compacted == 0, format!("compacted {}", report.compacted));
            }
            for seq in [1, 2] {
                let event = s.event("order-1", seq)?;
                let outcome = s.receive(
                    &format!("replay order-1/{seq} after the prune"),
                    "consumer",
                    "audit",
                    &event,
                    t + 2_000,
                )?;
                s.check(&format!("replay_{seq}_is_duplicate"), outcome.word() == "duplicate", outcome.word());
            }
            s.drain("drain audit", "consumer", "audit", 100, false, t + 2_000)?;
        }
        "resolve.before_commit" => {
            check_exactly_once = false;
            let old = foreign_event("order-1", 1, 3, t);
            s.receive("audit already holds order-1/1 from a re-created producer", "consumer", "audit", &old, t)?;
            s.drain("drain audit", "consumer", "audit", 100, false, t)?;
            s.advance("advance order-1 -> reserved", "order-1", 0, "reserved", Some(3), 1, t)?;
            s.relay("relay with max_attempts 1: conflict, quarantined", &relay_with(1, 200, 60_000, 100), t)?;
            let event = s.event("order-1", 1)?;
            crashed(
                s,
                "outbox resolve --action dismiss",
                strings(&[
                    "outbox",
                    "resolve",
                    "--producer",
                    &producer,
                    "--event",
                    &event.event_id,
                    "--consumer-id",
                    "audit",
                    "--action",
                    "dismiss",
                    "--reason",
                    "the consumer keeps the old producer's record",
                ]),
                t,
            )?;
            let status = s.deliveries()?.first().map(|d| d.status);
            s.check("still_quarantined", status == Some(DeliveryStatus::Quarantined), format!("{status:?}"));
            let resolved = s.resolve(
                "the operator reruns the dismiss",
                &event.event_id,
                "audit",
                DeliveryAction::Dismiss,
                "the consumer keeps the old producer's record",
                t,
            )?;
            let status = resolved.as_ref().map(|d| d.status).ok();
            s.check("rerun_dismisses", status == Some(DeliveryStatus::Dismissed), format!("{status:?}"));
            let relay = s.relay_until_idle("relay: nothing due", &relay_default(), t)?;
            s.check("dismissed_is_not_redelivered", relay.attempted == 0, format!("{} attempted", relay.attempted));
            let duplicates = s.duplicate_effects("consumer")?;
            s.check("no_duplicate_effects", duplicates == 0, format!("{duplicates} duplicated effects"));
        }
        "rename.before_commit" => {
            check_exactly_once = false;
            two_events(s, t)?;
            s.relay_until_idle("relay", &relay_default(), t)?;
            s.drain("drain audit", "consumer", "audit", 100, false, t)?;
            crashed(
                s,
                "rename-consumer audit -> audit-v2 (and the producer's subscription)",
                strings(&[
                    "rename-consumer",
                    "--consumer-db",
                    &consumer,
                    "--from",
                    "audit",
                    "--to",
                    "audit-v2",
                    "--producer",
                    &producer,
                ]),
                t,
            )?;
            let cursors = s.cursors("consumer")?;
            let effects = s.effects("consumer")?;
            s.check(
                "nothing_renamed",
                cursors.iter().all(|c| c.consumer_id == "audit") && effects.iter().all(|f| f.consumer_id == "audit"),
                format!("{} cursors", cursors.len()),
            );
            let renamed = s.rename("the operator reruns the rename", "consumer", "audit", "audit-v2", true)?;
            s.check("rerun_renames", renamed.is_ok(), "consumer and producer renamed");
            let event = s.event("order-1", 1)?;
            let outcome = s.receive("replay order-1/1 to audit-v2", "consumer", "audit-v2", &event, t)?;
            s.check("replay_after_rename_is_duplicate", outcome.word() == "duplicate", outcome.word());
            s.check_exactly_once("consumer", "audit-v2")?;
        }
        other => return Err(Error::Invariant(format!("no crash scenario for {other}"))),
    }
    if check_exactly_once {
        s.check_exactly_once("consumer", "audit")?;
    }
    Ok(())
}

fn consumer_rollback_then_retry(s: &mut Sc, _: &'static str) -> Result<()> {
    s.pipeline(&["audit"])?;
    let t = s.t0;
    s.advance("advance order-1 -> reserved (quantity 100)", "order-1", 0, "reserved", Some(100), 1, t)?;
    s.advance("advance order-1 -> confirmed", "order-1", 1, "confirmed", None, 1, t)?;
    s.relay_until_idle("relay", &relay_default(), t)?;
    let result =
        s.drain_failing_on("drain audit with a handler that fails on the second event", "consumer", "audit", 100, 2, t);
    s.check("drain_reports_the_failure", result.is_err(), "the drain returned an error");
    s.observe("after the failed drain")?;
    let effects = s.effects("consumer")?.len();
    let pending = s.inbox("consumer")?.iter().filter(|i| i.status == InboxStatus::Pending).count();
    s.check("effects_rolled_back", effects == 0, format!("{effects} effects (the first event's too)"));
    s.check("inbox_back_to_pending", pending == 2, format!("{pending} pending"));
    let no_cursor = s.cursors("consumer")?.is_empty();
    s.check("no_cursor_moved", no_cursor, "no high-water mark");
    let report = s.drain("retry the drain", "consumer", "audit", 100, false, t)?;
    s.check("retry_applies_both", report.applied == 2, format!("applied {}", report.applied));
    s.check_exactly_once("consumer", "audit")
}

fn duplicate_delivery(s: &mut Sc, _: &'static str) -> Result<()> {
    s.pipeline(&["audit"])?;
    let t = s.t0;
    s.advance("advance order-1 -> reserved (quantity 3)", "order-1", 0, "reserved", Some(3), 1, t)?;
    s.relay_until_idle("relay", &relay_default(), t)?;
    s.observe("after the relay, before any drain")?;
    let effects = s.effects("consumer")?.len();
    s.check("custody_is_not_application", effects == 0, format!("{effects} effects after receive"));
    s.drain("drain audit", "consumer", "audit", 100, false, t)?;
    let event = s.event("order-1", 1)?;
    for n in 1..=2 {
        let outcome = s.receive(&format!("redeliver order-1/1 ({n})"), "consumer", "audit", &event, t)?;
        s.check(&format!("redelivery_{n}_is_duplicate"), outcome.word() == "duplicate", outcome.word());
    }
    let report = s.drain("drain audit again", "consumer", "audit", 100, false, t)?;
    s.check("nothing_applied_again", report.applied == 0, format!("applied {}", report.applied));
    s.check_exactly_once("consumer", "audit")
}

fn two_consumers_apply_once_each(s: &mut Sc, _: &'static str) -> Result<()> {
    s.pipeline(&["audit"])?;
    let t = s.t0;
    s.advance("advance order-1 -> reserved (quantity 100)", "order-1", 0, "reserved", Some(100), 1, t)?;
    s.relay_until_idle("relay to audit", &relay_default(), t)?;
    s.drain("drain audit", "consumer", "audit", 100, false, t)?;
    let queued = s.subscribe("search", "consumer", true, t)?;
    s.record("subscribe search (same consumer file) from the start", json!({"queued": queued}));
    let relay = s.relay_until_idle("relay to search", &relay_default(), t)?;
    s.check(
        "audit_history_does_not_hide_search",
        relay.accepted == 1 && relay.duplicate == 0,
        format!("{} accepted for search", relay.accepted),
    );
    s.drain("drain search", "consumer", "search", 100, false, t)?;
    let event = s.event("order-1", 1)?;
    for consumer_id in ["audit", "search"] {
        let outcome =
            s.receive(&format!("redeliver order-1/1 to {consumer_id}"), "consumer", consumer_id, &event, t)?;
        s.check(&format!("{consumer_id}_redelivery_is_duplicate"), outcome.word() == "duplicate", outcome.word());
        s.drain(&format!("drain {consumer_id} again"), "consumer", consumer_id, 100, false, t)?;
    }
    s.check_exactly_once("consumer", "audit")?;
    s.check_exactly_once("consumer", "search")
}

fn conflict_same_id_different_content(s: &mut Sc, _: &'static str) -> Result<()> {
    s.pipeline(&["audit"])?;
    let t = s.t0;
    s.advance("advance order-1 -> reserved (quantity 100)", "order-1", 0, "reserved", Some(100), 1, t)?;
    s.relay_until_idle("relay", &relay_default(), t)?;
    s.drain("drain audit", "consumer", "audit", 100, false, t)?;
    let event = s.event("order-1", 1)?;
    let mut changed = event.clone();
    changed.payload = json!({"amount": 999});
    let outcome = s.receive("deliver order-1/1 again with amount 999 (same id)", "consumer", "audit", &changed, t)?;
    s.check("changed_payload_is_conflict_in_inbox", outcome.word() == "conflict", outcome.word());
    let drained = s.drain("drain audit", "consumer", "audit", 100, false, t)?;
    s.check("nothing_applied", drained.applied == 0, format!("applied {}", drained.applied));
    let later = t + 8 * DAY_MS;
    s.prune("8 days later: prune applied bodies older than 7 days", "consumer", 7 * DAY_MS, later)?;
    let outcome =
        s.receive("deliver the amount-999 copy again (only a receipt is left)", "consumer", "audit", &changed, later)?;
    s.check("changed_payload_is_conflict_at_receipt", outcome.word() == "conflict", outcome.word());
    let outcome = s.receive("deliver the true event again", "consumer", "audit", &event, later)?;
    s.check("true_event_is_duplicate_at_receipt", outcome.word() == "duplicate", outcome.word());
    let effects = s.effects("consumer")?;
    s.check(
        "effect_stays_100",
        effects.len() == 1 && effects[0].quantity == 100,
        format!("{:?}", effects.iter().map(|e| e.quantity).collect::<Vec<_>>()),
    );
    s.check_exactly_once("consumer", "audit")
}

fn conflict_same_seq_different_id(s: &mut Sc, _: &'static str) -> Result<()> {
    s.pipeline(&["audit"])?;
    let t = s.t0;
    two_events(s, t)?;
    s.relay_until_idle("relay", &relay_default(), t)?;
    s.drain("drain audit", "consumer", "audit", 100, false, t)?;
    let first = s.event("order-1", 1)?;
    let second = s.event("order-1", 2)?;
    let mut other_id = first.clone();
    other_id.event_id = "another-event-id".into();
    let outcome = s.receive("order-1/1 with another event id (same content)", "consumer", "audit", &other_id, t)?;
    s.check("same_seq_other_id_is_conflict", outcome.word() == "conflict", outcome.word());
    let mut reused = second.clone();
    reused.event_id = first.event_id.clone();
    reused.seq = 3;
    reused.event_type = "reservation.released".into();
    let outcome = s.receive("order-1/3 carrying the id of order-1/1", "consumer", "audit", &reused, t)?;
    s.check("reused_id_is_conflict", outcome.word() == "conflict", outcome.word());
    let report = s.drain("drain audit", "consumer", "audit", 100, false, t)?;
    s.check("nothing_applied", report.applied == 0, format!("applied {}", report.applied));
    s.check_exactly_once("consumer", "audit")
}

fn producer_restored_from_backup(s: &mut Sc, _: &'static str) -> Result<()> {
    s.pipeline(&["audit"])?;
    let t = s.t0;
    s.advance("advance order-1 -> reserved (quantity 3)", "order-1", 0, "reserved", Some(3), 1, t)?;
    s.relay_until_idle("relay", &relay_default(), t)?;
    s.drain("drain audit", "consumer", "audit", 100, false, t)?;
    s.advance("advance order-1 -> confirmed (not yet relayed)", "order-1", 1, "confirmed", None, 1, t + 1_000)?;
    s.backup_producer("producer-backup.db")?;
    s.record("copy producer.db to producer-backup.db (order-1 at seq 2, its delivery pending)", Value::Null);
    s.relay_until_idle("relay", &relay_default(), t + 2_000)?;
    s.advance("advance order-1 -> released", "order-1", 2, "released", None, 1, t + 3_000)?;
    s.relay_until_idle("relay", &relay_default(), t + 3_000)?;
    s.drain("drain audit", "consumer", "audit", 100, false, t + 3_000)?;
    s.restore_producer("producer-backup.db")?;
    s.record("restore producer.db from the backup (order-1 back at seq 2)", Value::Null);
    s.rotate_generation("rotate the producer generation after the restore")?;
    let relay = s.relay_until_idle("relay: order-1/2 was pending in the backup", &relay_default(), t + 4_000)?;
    s.check(
        "redelivered_backup_event_is_duplicate",
        relay.duplicate == 1 && relay.conflict == 0,
        format!("{} duplicate, {} conflict", relay.duplicate, relay.conflict),
    );
    let reissued =
        s.advance("advance order-1 -> released again (re-issues seq 3)", "order-1", 2, "released", None, 1, t + 5_000)?;
    s.check("restored_producer_reissues_seq_3", is_committed(&reissued, 3), reissued.word());
    let relay = s.relay_until_idle("relay the re-issued order-1/3", &relay_default(), t + 5_000)?;
    let reason = relay.answers.first().and_then(|a| a.reason.clone()).unwrap_or_default();
    s.check(
        "reissued_seq_is_conflict",
        relay.conflict == 1 && relay.accepted == 0,
        format!("{} conflict", relay.conflict),
    );
    s.check(
        "conflict_names_the_generation_change",
        reason.contains("producer generation changed from") && reason.contains(" to "),
        reason,
    );
    let report = s.drain("drain audit", "consumer", "audit", 100, false, t + 5_000)?;
    s.check("nothing_applied_from_the_reissue", report.applied == 0, format!("applied {}", report.applied));
    let effects = s.effects("consumer")?.len();
    s.check("effects_once_each", effects == 3, format!("{effects} effects for 3 seqs"));
    let duplicates = s.duplicate_effects("consumer")?;
    s.check("no_duplicate_effects", duplicates == 0, format!("{duplicates} duplicated effects"));
    Ok(())
}

fn rejections_are_not_remembered(s: &mut Sc, _: &'static str) -> Result<()> {
    s.pipeline(&["audit"])?;
    let t = s.t0;
    let early = s.advance("confirm order-1 expecting seq 1 before it exists", "order-1", 1, "confirmed", None, 1, t)?;
    s.check("early_request_is_stale", early.word() == "stale", early.word());
    s.advance("advance order-1 -> reserved (quantity 3)", "order-1", 0, "reserved", Some(3), 1, t)?;
    let skip = s.advance("order-1 reserved -> released (skips confirmed)", "order-1", 1, "released", None, 1, t)?;
    s.check("skip_is_invalid_transition", skip.word() == "invalid_transition", skip.word());
    let repeat = s.advance("repeat the reserve (expected seq 0)", "order-1", 0, "reserved", Some(3), 1, t)?;
    s.check("repeat_is_stale", repeat.word() == "stale", repeat.word());
    let outbox = s.outbox()?.len();
    s.check("rejections_write_nothing", outbox == 1, format!("{outbox} events after 3 rejections"));
    let later = s.advance("the once-stale confirm, sent again", "order-1", 1, "confirmed", None, 1, t)?;
    s.check("stale_answer_not_remembered", is_committed(&later, 2), later.word());
    let released = s.advance("the once-invalid release, now in order", "order-1", 2, "released", None, 1, t)?;
    s.check("invalid_transition_not_remembered", is_committed(&released, 3), released.word());
    s.relay_until_idle("relay", &relay_default(), t)?;
    s.drain("drain audit", "consumer", "audit", 100, false, t)?;
    s.check_exactly_once("consumer", "audit")
}

fn bad_input_is_an_error(s: &mut Sc, _: &'static str) -> Result<()> {
    s.pipeline(&["audit"])?;
    let t = s.t0;
    let cases: Vec<(&str, tidemark_core::flow::AdvanceRequest, &str)> = vec![
        ("quantity 0", request("order-1", 0, "reserved", Some(0), 1), "invalid_quantity"),
        ("quantity 1,000,001", request("order-1", 0, "reserved", Some(1_000_001), 1), "invalid_quantity"),
        ("reserve without a quantity", request("order-1", 0, "reserved", None, 1), "invalid_quantity"),
        ("flow id with a space", request("order 1", 0, "reserved", Some(3), 1), "invalid_id"),
        ("flow id of 101 characters", request(&"f".repeat(101), 0, "reserved", Some(3), 1), "invalid_id"),
        ("unknown state", request("order-1", 0, "shipped", Some(3), 1), "unknown_state"),
        ("schema version 3", request("order-1", 0, "reserved", Some(3), 3), "invalid_schema_version"),
        ("expected_seq -1", request("order-1", -1, "reserved", Some(3), 1), "invalid_seq"),
    ];
    for (what, req, code) in cases {
        let result = s.try_advance(&format!("advance with {what}"), req, t)?;
        let got = result.as_ref().err().map(|e| e.code()).unwrap_or("no error");
        s.check(&format!("{}_is_{code}", what.replace([' ', ','], "_").replace("__", "_")), got == code, got);
    }
    let empty = s.outbox()?.is_empty();
    s.check("bad_input_writes_nothing", empty, "no outbox event");
    let max =
        s.advance("advance with quantity 1,000,000 (the maximum)", "order-1", 0, "reserved", Some(1_000_000), 1, t)?;
    s.check("maximum_quantity_commits", is_committed(&max, 1), max.word());
    let mut bad = s.event("order-1", 1)?;
    bad.seq = 0;
    let result = s.try_receive("receive an envelope with seq 0", "consumer", "audit", &bad, t)?;
    let got = result.as_ref().err().map(|e| e.code()).unwrap_or("no error");
    s.check("envelope_seq_0_is_invalid_seq", got == "invalid_seq", got);
    s.relay_until_idle("relay", &relay_default(), t)?;
    s.drain("drain audit", "consumer", "audit", 100, false, t)?;
    s.check_exactly_once("consumer", "audit")
}

fn gap_waits_for_missing_seq(s: &mut Sc, _: &'static str) -> Result<()> {
    s.pipeline(&["audit"])?;
    let t = s.t0;
    two_events(s, t)?;
    s.advance("advance order-1 -> released", "order-1", 2, "released", None, 1, t)?;
    for seq in [2, 3] {
        let event = s.event("order-1", seq)?;
        s.receive(&format!("order-1/{seq} arrives"), "consumer", "audit", &event, t)?;
    }
    let report = s.drain("drain audit", "consumer", "audit", 100, false, t)?;
    s.check(
        "gap_applies_nothing",
        report.outcome == DrainStop::Gap && report.applied == 0,
        format!("{:?}, applied {}", report.outcome, report.applied),
    );
    let missing = serde_json::to_value(&report.stuck).unwrap_or_default();
    s.check("gap_names_seq_1", missing.to_string().contains("\"missing_seq\":1"), missing.to_string());
    let event = s.event("order-1", 1)?;
    s.receive("order-1/1 arrives", "consumer", "audit", &event, t)?;
    let report = s.drain("drain audit", "consumer", "audit", 100, false, t)?;
    s.check(
        "all_three_apply",
        report.applied == 3 && report.outcome == DrainStop::Idle,
        format!("applied {}", report.applied),
    );
    let seqs: Vec<i64> = s.effects("consumer")?.iter().map(|e| e.seq).collect();
    s.check("applied_in_seq_order", seqs == [1, 2, 3], format!("{seqs:?}"));
    let relay = s.relay_until_idle("relay: all three already held", &relay_default(), t)?;
    s.check("relay_gets_duplicates", relay.duplicate == 3, format!("{} duplicate", relay.duplicate));
    s.check_exactly_once("consumer", "audit")
}

fn blocked_v2_then_support_v2(s: &mut Sc, _: &'static str) -> Result<()> {
    s.pipeline(&["audit"])?;
    let t = s.t0;
    s.advance("advance order-1 -> reserved (quantity 5, schema v2)", "order-1", 0, "reserved", Some(5), 2, t)?;
    s.advance("advance order-1 -> confirmed (schema v2)", "order-1", 1, "confirmed", None, 2, t)?;
    s.relay_until_idle("relay", &relay_default(), t)?;
    let report = s.drain("drain audit with the v1-only decoders", "consumer", "audit", 100, false, t)?;
    s.check(
        "v2_is_blocked",
        report.outcome == DrainStop::Blocked && report.applied == 0,
        format!("{:?}", report.outcome),
    );
    let before: Vec<Envelope> = s.inbox("consumer")?.into_iter().map(|i| i.envelope).collect();
    let blocked = s.inbox("consumer")?.iter().filter(|i| i.status == InboxStatus::Blocked).count();
    s.check("only_the_first_record_is_blocked", blocked == 1, format!("{blocked} blocked"));
    s.observe("blocked: the body is unchanged, the reason is recorded")?;
    let report = s.drain("drain audit with support_v2", "consumer", "audit", 100, true, t)?;
    s.check("support_v2_applies_both", report.applied == 2, format!("applied {}", report.applied));
    let after: Vec<Envelope> = s.inbox("consumer")?.into_iter().map(|i| i.envelope).collect();
    s.check("same_records_same_ids_and_seqs", before == after, "inbox envelopes identical before and after");
    s.check_exactly_once("consumer", "audit")
}

fn blocked_flow_stops_only_itself(s: &mut Sc, _: &'static str) -> Result<()> {
    s.pipeline(&["audit"])?;
    let t = s.t0;
    s.advance("advance A -> reserved (schema v2)", "A", 0, "reserved", Some(5), 2, t)?;
    s.advance("advance A -> confirmed (schema v1)", "A", 1, "confirmed", None, 1, t)?;
    s.advance("advance B -> reserved (quantity 7)", "B", 0, "reserved", Some(7), 1, t)?;
    s.advance("advance B -> confirmed", "B", 1, "confirmed", None, 1, t)?;
    s.relay_until_idle("relay", &relay_default(), t)?;
    let report = s.drain("drain audit (v1 only)", "consumer", "audit", 100, false, t)?;
    s.check("drain_says_blocked", report.outcome == DrainStop::Blocked, format!("{:?}", report.outcome));
    s.check("b_applies", report.applied == 2, format!("applied {}", report.applied));
    let inbox = s.inbox("consumer")?;
    let status = |flow: &str, seq: i64| {
        inbox.iter().find(|i| i.envelope.flow_id == flow && i.envelope.seq == seq).map(|i| i.status)
    };
    s.check("a1_blocked", status("A", 1) == Some(InboxStatus::Blocked), format!("{:?}", status("A", 1)));
    s.check("a2_waits_behind_it", status("A", 2) == Some(InboxStatus::Pending), format!("{:?}", status("A", 2)));
    let again = s.drain("drain audit again (v1 only)", "consumer", "audit", 100, false, t)?;
    s.check(
        "a_stays_blocked",
        again.applied == 0 && again.outcome == DrainStop::Blocked,
        format!("{:?}", again.outcome),
    );
    let duplicates = s.duplicate_effects("consumer")?;
    s.check("no_duplicate_effects", duplicates == 0, format!("{duplicates} duplicated effects"));
    Ok(())
}

fn drain_stop_reasons(s: &mut Sc, _: &'static str) -> Result<()> {
    s.pipeline(&[])?;
    let t = s.t0;
    let report = s.drain("drain an empty inbox", "consumer", "audit", 100, false, t)?;
    s.check("empty_is_idle", report.outcome == DrainStop::Idle, format!("{:?}", report.outcome));
    s.advance("advance f-limit -> reserved", "f-limit", 0, "reserved", Some(1), 1, t)?;
    s.advance("advance f-limit -> confirmed", "f-limit", 1, "confirmed", None, 1, t)?;
    s.advance("advance f-limit -> released", "f-limit", 2, "released", None, 1, t)?;
    for seq in 1..=3 {
        let event = s.event("f-limit", seq)?;
        s.receive(&format!("receive f-limit/{seq}"), "consumer", "audit", &event, t)?;
    }
    let report = s.drain("drain with limit 2", "consumer", "audit", 2, false, t)?;
    s.check(
        "limit_stops_at_2",
        report.outcome == DrainStop::Limit && report.applied == 2,
        format!("{:?} {}", report.outcome, report.applied),
    );
    let report = s.drain("drain with limit 2 again", "consumer", "audit", 2, false, t)?;
    s.check(
        "rest_is_idle",
        report.outcome == DrainStop::Idle && report.applied == 1,
        format!("{:?} {}", report.outcome, report.applied),
    );
    s.advance("advance f-gap -> reserved", "f-gap", 0, "reserved", Some(2), 1, t)?;
    s.advance("advance f-gap -> confirmed", "f-gap", 1, "confirmed", None, 1, t)?;
    let event = s.event("f-gap", 2)?;
    s.receive("receive f-gap/2 only", "consumer", "audit", &event, t)?;
    let report = s.drain("drain", "consumer", "audit", 100, false, t)?;
    s.check(
        "missing_seq_is_gap",
        report.outcome == DrainStop::Gap && report.applied == 0,
        format!("{:?}", report.outcome),
    );
    let event = s.event("f-gap", 1)?;
    s.receive("receive f-gap/1", "consumer", "audit", &event, t)?;
    let report = s.drain("drain", "consumer", "audit", 100, false, t)?;
    s.check(
        "gap_filled_applies",
        report.outcome == DrainStop::Idle && report.applied == 2,
        format!("{:?}", report.outcome),
    );
    s.advance("advance f-v2 -> reserved (schema v2)", "f-v2", 0, "reserved", Some(4), 2, t)?;
    let event = s.event("f-v2", 1)?;
    s.receive("receive f-v2/1", "consumer", "audit", &event, t)?;
    let report = s.drain("drain (v1 only)", "consumer", "audit", 100, false, t)?;
    s.check("unknown_version_is_blocked", report.outcome == DrainStop::Blocked, format!("{:?}", report.outcome));
    let duplicates = s.duplicate_effects("consumer")?;
    s.check("no_duplicate_effects", duplicates == 0, format!("{duplicates} duplicated effects"));
    Ok(())
}

fn six_arrival_orders(s: &mut Sc, _: &'static str) -> Result<()> {
    s.init_producer("shop")?;
    let t = s.t0;
    two_events(s, t)?;
    s.advance("advance order-1 -> released", "order-1", 2, "released", None, 1, t)?;
    let orders: [[i64; 3]; 6] = [[1, 2, 3], [1, 3, 2], [2, 1, 3], [2, 3, 1], [3, 1, 2], [3, 2, 1]];
    let mut finals: Vec<Value> = Vec::new();
    for order in orders {
        let name = format!("arrival-{}{}{}", order[0], order[1], order[2]);
        s.init_consumer(&name, tidemark_core::policy::RetentionPolicy::default().horizon_ms)?;
        let mut drains = Vec::new();
        for seq in order {
            let event = s.event("order-1", seq)?;
            s.quiet = true;
            let received = s.receive("", &name, "audit", &event, t);
            let report = s.drain("", &name, "audit", 100, false, t);
            s.quiet = false;
            let (received, report) = (received?, report?);
            let stuck = report.stuck.first().map(|o| serde_json::to_value(o).unwrap_or_default());
            drains.push(json!({
                "arrives": seq,
                "receive": received.word(),
                "drain": report.outcome,
                "applied": report.applied,
                "stuck": stuck,
            }));
        }
        s.record(&format!("consumer file {name}: events arrive in order {order:?}, drain after each"), json!(drains));
        finals.push(s.consumer_state(&name)?);
        s.check_exactly_once(&name, "audit")?;
    }
    let all_same = finals.windows(2).all(|w| w[0] == w[1]);
    s.check("all_six_orders_same_final_state", all_same, "six consumer files compared");
    Ok(())
}

fn forced_order_3_1_2(s: &mut Sc, _: &'static str) -> Result<()> {
    s.pipeline(&["audit"])?;
    let t = s.t0;
    two_events(s, t)?;
    s.advance("advance order-1 -> released", "order-1", 2, "released", None, 1, t)?;
    let mut outcomes = Vec::new();
    for seq in [3, 1, 2] {
        let event = s.event("order-1", seq)?;
        let relay = s.relay(&format!("relay only order-1/{seq}"), &relay_event(&event.event_id), t)?;
        s.check(&format!("seq_{seq}_accepted"), relay.accepted == 1, format!("{} accepted", relay.accepted));
        let report = s.drain("drain audit", "consumer", "audit", 100, false, t)?;
        outcomes.push((report.outcome, report.applied));
    }
    s.check(
        "applies_only_in_order",
        outcomes == [(DrainStop::Gap, 0), (DrainStop::Gap, 1), (DrainStop::Idle, 2)],
        format!("{outcomes:?}"),
    );
    let seqs: Vec<i64> = s.effects("consumer")?.iter().map(|e| e.seq).collect();
    s.check("effects_in_seq_order", seqs == [1, 2, 3], format!("{seqs:?}"));
    s.check_exactly_once("consumer", "audit")
}

fn six_process_concurrency(s: &mut Sc, _: &'static str) -> Result<()> {
    s.unordered_state = true;
    s.pipeline(&["audit"])?;
    let t = s.t0;
    let producer = s.producer_arg();
    let consumer = s.consumer_arg("consumer");
    let rounds: [(i64, &str, Option<i64>); 3] =
        [(0, "reserved", Some(3)), (1, "confirmed", None), (2, "released", None)];
    for (expected_seq, to, quantity) in rounds {
        let commands: Vec<Vec<String>> =
            (0..6).map(|_| advance_args(&producer, "order-1", expected_seq, to, quantity)).collect();
        let runs = s.children(&commands, t)?;
        let count = |word: &str| runs.iter().filter(|r| r.json["outcome"] == word).count();
        let failed = runs.iter().filter(|r| r.code != 0).count();
        let (committed, stale) = (count("committed"), count("stale"));
        s.record(
            &format!("6 processes at once: advance order-1 expecting seq {expected_seq} -> {to}"),
            json!({"committed": committed, "stale": stale, "failed": failed}),
        );
        s.check(
            &format!("one_winner_for_seq_{}", expected_seq + 1),
            committed == 1 && stale == 5 && failed == 0,
            format!("{committed} committed, {stale} stale, {failed} failed"),
        );
    }
    let commands: Vec<Vec<String>> =
        (1..=6).map(|n| advance_args(&producer, &format!("f-{n}"), 0, "reserved", Some(n))).collect();
    let runs = s.children(&commands, t)?;
    let committed = runs.iter().filter(|r| r.json["outcome"] == "committed").count();
    s.record("6 processes at once: each reserves its own flow f-1..f-6", json!({"committed": committed}));
    s.check("independent_flows_all_commit", committed == 6, format!("{committed} committed"));
    let mut commands: Vec<Vec<String>> = Vec::new();
    for _ in 0..3 {
        commands.push(strings(&["relay", "--producer", &producer, "--until-idle", "--limit", "2"]));
        commands.push(strings(&["drain", "--consumer-db", &consumer, "--consumer-id", "audit", "--limit", "2"]));
    }
    let runs = s.children(&commands, t)?;
    let failed = runs.iter().filter(|r| r.code != 0).count();
    s.record("3 relay and 3 drain processes at once (their counts depend on scheduling)", json!({"failed": failed}));
    s.check("concurrent_relays_and_drains_succeed", failed == 0, format!("{failed} failed"));
    s.quiet = true;
    let finished =
        s.relay_until_idle("", &relay_default(), t).and_then(|_| s.drain("", "consumer", "audit", 100, false, t));
    s.quiet = false;
    finished?;
    s.record("then relay until idle and drain in-process (counts not recorded)", Value::Null);
    let accepted = s.deliveries()?.iter().all(|d| d.status == DeliveryStatus::Accepted);
    s.check("every_delivery_accepted", accepted, "all deliveries accepted");
    s.check_exactly_once("consumer", "audit")
}

fn rename_consumer(s: &mut Sc, _: &'static str) -> Result<()> {
    s.pipeline(&["audit"])?;
    let t = s.t0;
    s.advance("advance order-1 -> reserved (quantity 3)", "order-1", 0, "reserved", Some(3), 1, t)?;
    s.relay_until_idle("relay", &relay_default(), t)?;
    s.drain("drain audit", "consumer", "audit", 100, false, t)?;
    let renamed =
        s.rename("rename audit -> audit-v2 in the consumer file only", "consumer", "audit", "audit-v2", false)?;
    s.check("consumer_rename_carries_state", renamed.is_ok(), "renamed");
    s.advance("advance order-1 -> confirmed", "order-1", 1, "confirmed", None, 1, t)?;
    let relay = s.relay("relay: the producer still delivers to audit", &relay_default(), t)?;
    let reason = relay.answers.first().and_then(|a| a.reason.clone()).unwrap_or_default();
    s.check("half_renamed_delivery_is_refused", relay.conflict == 1, format!("{} conflict", relay.conflict));
    s.check("refusal_names_the_new_id", reason.contains("renamed to audit-v2"), reason);
    let rerun = s.rename(
        "rerun the whole rename (consumer file and producer subscription)",
        "consumer",
        "audit",
        "audit-v2",
        true,
    )?;
    s.check("rerun_completes_the_rename", rerun.is_ok(), "consumer no-op, producer renamed");
    let relay = s.relay_until_idle("relay after the backoff", &relay_default(), t + 60_000)?;
    s.check("audit_v2_receives", relay.accepted == 1, format!("{} accepted", relay.accepted));
    s.drain("drain audit-v2", "consumer", "audit-v2", 100, false, t + 60_000)?;
    let event = s.event("order-1", 1)?;
    let outcome = s.receive("replay order-1/1 to audit-v2", "consumer", "audit-v2", &event, t + 60_000)?;
    s.check("replay_after_rename_is_duplicate", outcome.word() == "duplicate", outcome.word());
    let outcome = s.receive("deliver order-1/1 to the old id audit", "consumer", "audit", &event, t + 60_000)?;
    let named = matches!(&outcome, ReceiveOutcome::Conflict { reason, .. } if reason.contains("audit-v2"));
    s.check("old_id_refused_naming_new_id", named, outcome.word());
    for seq in [1, 2] {
        let event = s.event("order-1", seq)?;
        let outcome = s.receive(
            &format!("a new consumer id ledger receives order-1/{seq}"),
            "consumer",
            "ledger",
            &event,
            t + 60_000,
        )?;
        s.check(&format!("new_id_starts_fresh_{seq}"), outcome.word() == "accepted", outcome.word());
    }
    s.drain("drain ledger", "consumer", "ledger", 100, false, t + 60_000)?;
    let audit_left = s.effects("consumer")?.iter().filter(|e| e.consumer_id == "audit").count();
    s.check("no_state_left_under_audit", audit_left == 0, format!("{audit_left} effects under audit"));
    s.check_exactly_once("consumer", "audit-v2")?;
    s.check_exactly_once("consumer", "ledger")
}

fn retention_prune_replay(s: &mut Sc, _: &'static str) -> Result<()> {
    s.pipeline(&["audit", "search"])?;
    let t = s.t0;
    s.advance("day 0: advance order-1 -> reserved (quantity 100)", "order-1", 0, "reserved", Some(100), 1, t)?;
    s.relay_until_idle("relay", &relay_default(), t)?;
    s.drain("drain audit", "consumer", "audit", 100, false, t)?;
    s.drain("drain search", "consumer", "search", 100, false, t)?;
    let day8 = t + 8 * DAY_MS;
    let report = s.prune("day 8: prune applied bodies older than 7 days", "consumer", 7 * DAY_MS, day8)?;
    s.check("bodies_compacted_to_receipts", report.compacted == 2, format!("compacted {}", report.compacted));
    let event = s.event("order-1", 1)?;
    for consumer_id in ["audit", "search"] {
        let outcome =
            s.receive(&format!("day 8: replay order-1/1 to {consumer_id}"), "consumer", consumer_id, &event, day8)?;
        s.check(
            &format!("{consumer_id}_replay_after_prune_is_duplicate"),
            outcome.word() == "duplicate",
            outcome.word(),
        );
    }
    s.drain("drain audit", "consumer", "audit", 100, false, day8)?;
    let day31 = t + 31 * DAY_MS;
    let report = s.prune("day 31: prune again (horizon 30 days)", "consumer", 7 * DAY_MS, day31)?;
    s.check("old_receipts_deleted", report.receipts_deleted == 2, format!("deleted {}", report.receipts_deleted));
    for consumer_id in ["audit", "search"] {
        let outcome =
            s.receive(&format!("day 31: replay order-1/1 to {consumer_id}"), "consumer", consumer_id, &event, day31)?;
        s.check(&format!("{consumer_id}_old_replay_is_expired"), outcome.word() == "expired", outcome.word());
    }
    let mut young = event.clone();
    young.event_id = "claims-to-be-new".into();
    young.created_at_ms = day31;
    let outcome =
        s.receive("day 31: order-1/1 under a new id claiming to be new", "consumer", "audit", &young, day31)?;
    s.check("below_high_water_is_conflict", outcome.word() == "conflict", outcome.word());
    s.drain("drain audit", "consumer", "audit", 100, false, day31)?;
    s.drain("drain search", "consumer", "search", 100, false, day31)?;
    let cursors = s.cursors("consumer")?.len();
    s.check("high_water_marks_kept", cursors == 2, format!("{cursors} cursors"));

    // The seed's literal step: delete audit's dedup record of a young event by hand (keeping
    // its effect), then replay the event. The high-water mark still refuses it.
    s.advance("day 31: advance order-2 -> reserved (quantity 100)", "order-2", 0, "reserved", Some(100), 1, day31)?;
    s.relay_until_idle("relay", &relay_default(), day31)?;
    s.drain("drain audit", "consumer", "audit", 100, false, day31)?;
    s.drain("drain search", "consumer", "search", 100, false, day31)?;
    let deleted = s.delete_dedup_records_by_hand("consumer", "audit", "order-2", 1)?;
    s.record(
        "delete audit's inbox record (and any receipt) of order-2/1 by hand, keeping its effect (what the seed did)",
        json!({"rows_deleted": deleted}),
    );
    let event = s.event("order-2", 1)?;
    let outcome = s.receive("replay order-2/1 to audit", "consumer", "audit", &event, day31)?;
    s.check("replay_after_manual_delete_is_refused", outcome.word() == "conflict", outcome.word());
    s.drain("drain audit", "consumer", "audit", 100, false, day31)?;
    let audit_order_2 =
        s.effects("consumer")?.iter().filter(|e| e.consumer_id == "audit" && e.flow_id == "order-2").count();
    s.check("still_one_audit_effect", audit_order_2 == 1, format!("{audit_order_2} audit effects for order-2"));
    s.check_exactly_once("consumer", "audit")?;
    s.check_exactly_once("consumer", "search")
}

fn starvation_fixed(s: &mut Sc, _: &'static str) -> Result<()> {
    s.pipeline(&["audit"])?;
    let t = s.t0;
    let old = foreign_event("A", 1, 9, t);
    s.receive("audit already applied A/1 from a re-created producer", "consumer", "audit", &old, t)?;
    s.drain("drain audit", "consumer", "audit", 100, false, t)?;
    s.advance("advance A -> reserved: a permanent conflict for audit", "A", 0, "reserved", Some(3), 1, t)?;
    s.advance("advance B -> reserved", "B", 0, "reserved", Some(4), 1, t)?;
    s.advance("advance B -> confirmed", "B", 1, "confirmed", None, 1, t)?;
    s.advance("advance B -> released", "B", 2, "released", None, 1, t)?;
    let options = relay_with(3, 1_000, 4_000, 1);
    let mut passes = Vec::new();
    let mut b_done_at = None;
    let mut a_quarantined_at = None;
    s.quiet = true;
    let mut elapsed = 0;
    let mut looped: Result<()> = Ok(());
    while elapsed <= 20_000 {
        let report = match s.relay("", &options, t + elapsed) {
            Ok(report) => report,
            Err(error) => {
                looped = Err(error);
                break;
            }
        };
        for answer in &report.answers {
            let label = s.labels.known(&answer.event_id);
            let verdict = answer.verdict.as_deref().map(|v| format!(" -> {v}")).unwrap_or_default();
            passes.push(format!("+{elapsed} ms: {label} {}{verdict}", answer.answer));
            if answer.verdict.as_deref() == Some("quarantined") {
                a_quarantined_at = Some(elapsed);
            }
        }
        match s.deliveries() {
            Ok(deliveries) => {
                let b_open = deliveries.iter().any(|d| d.flow_id == "B" && d.status != DeliveryStatus::Accepted);
                if !b_open && b_done_at.is_none() {
                    b_done_at = Some(elapsed);
                }
                if deliveries.iter().all(|d| d.status != DeliveryStatus::Pending) {
                    break;
                }
            }
            Err(error) => {
                looped = Err(error);
                break;
            }
        }
        elapsed += 250;
    }
    s.quiet = false;
    looped?;
    s.record("relay passes every 250 ms, limit 1, max_attempts 3, backoff 1 s doubling", json!(passes));
    s.check(
        "b_delivered_while_a_backs_off",
        matches!((b_done_at, a_quarantined_at), (Some(b), Some(a)) if b < a),
        format!("B done at {b_done_at:?} ms, A quarantined at {a_quarantined_at:?} ms"),
    );
    let deliveries = s.deliveries()?;
    let a = deliveries.iter().find(|d| d.flow_id == "A").map(|d| d.status);
    s.check("a_quarantined_never_acked", a == Some(DeliveryStatus::Quarantined), format!("{a:?}"));
    let report = s.drain("drain audit", "consumer", "audit", 100, false, t + elapsed)?;
    s.check("b_applied", report.applied == 3, format!("applied {}", report.applied));
    let duplicates = s.duplicate_effects("consumer")?;
    s.check("no_duplicate_effects", duplicates == 0, format!("{duplicates} duplicated effects"));
    Ok(())
}

fn quarantine_operator_requeue_dismiss(s: &mut Sc, _: &'static str) -> Result<()> {
    s.init_producer("shop")?;
    let t = s.t0;
    s.subscribe("audit", "audit", true, t)?;
    s.subscribe("search", "search", true, t)?;
    s.record("subscribe audit -> audit.db and search -> search.db (neither file exists)", Value::Null);
    s.advance("advance order-1 -> reserved (quantity 3)", "order-1", 0, "reserved", Some(3), 1, t)?;
    let options = relay_with(2, 1_000, 60_000, 100);
    s.relay("relay: both endpoints unreachable", &options, t)?;
    let report = s.relay("relay after the backoff: second failure", &options, t + 2_000)?;
    s.check("quarantined_after_max_attempts", report.quarantined == 2, format!("{} quarantined", report.quarantined));
    let relay = s.relay("relay: quarantined deliveries are not due", &options, t + 10_000)?;
    s.check("quarantined_not_retried", relay.attempted == 0, format!("{} attempted", relay.attempted));
    s.init_consumer("audit", tidemark_core::policy::RetentionPolicy::default().horizon_ms)?;
    s.record("create audit.db (the audit disk is back)", Value::Null);
    let event = s.event("order-1", 1)?;
    let requeued = s.resolve(
        "operator: requeue the audit delivery",
        &event.event_id,
        "audit",
        DeliveryAction::Requeue,
        "audit.db restored",
        t + 11_000,
    )?;
    let status = requeued.as_ref().ok().map(|d| (d.status, d.attempts));
    s.check("requeue_resets_attempts", status == Some((DeliveryStatus::Pending, 0)), format!("{status:?}"));
    let dismissed = s.resolve(
        "operator: dismiss the search delivery",
        &event.event_id,
        "search",
        DeliveryAction::Dismiss,
        "search is decommissioned",
        t + 11_000,
    )?;
    let status = dismissed.as_ref().ok().map(|d| d.status);
    s.check("dismiss_is_recorded", status == Some(DeliveryStatus::Dismissed), format!("{status:?}"));
    let relay = s.relay("relay", &options, t + 12_000)?;
    s.check(
        "requeue_delivers_once",
        relay.accepted == 1 && relay.attempted == 1,
        format!("{} attempted", relay.attempted),
    );
    s.drain("drain audit", "audit", "audit", 100, false, t + 12_000)?;
    let again = s.resolve(
        "operator: requeue the (accepted) audit delivery",
        &event.event_id,
        "audit",
        DeliveryAction::Requeue,
        "by mistake",
        t + 13_000,
    )?;
    let code = again.as_ref().err().map(|e| e.code());
    s.check("accepted_cannot_be_requeued", code == Some("invalid_state_change"), format!("{code:?}"));
    let deliveries = s.deliveries()?;
    let search = deliveries.iter().find(|d| d.consumer_id == "search").map(|d| d.status);
    s.check("dismiss_is_not_an_ack", search == Some(DeliveryStatus::Dismissed), format!("{search:?}"));
    s.check_exactly_once("audit", "audit")
}

fn snapshot_not_atomic(s: &mut Sc, _: &'static str) -> Result<()> {
    s.pipeline(&["audit"])?;
    let t = s.t0;
    s.advance("advance order-1 -> reserved (quantity 3)", "order-1", 0, "reserved", Some(3), 1, t)?;
    let producer = s.producer_arg();
    let consumer = s.consumer_arg("consumer");
    s.quiet = true;
    let run = s.child("", &strings(&["snapshot", "--producer", &producer, "--consumer-db", &consumer]), None, t);
    s.quiet = false;
    let run = run?;
    s.record(
        "child: tidemark snapshot --producer --consumer-db",
        json!({"exit_code": run.code, "atomic_across_files": run.json["atomic_across_files"], "note": run.json["note"]}),
    );
    s.check("snapshot_says_not_atomic", run.json["atomic_across_files"] == false, run.json["note"].to_string());
    let before = s.deliveries()?;
    let pending_then = before.iter().filter(|d| d.status == DeliveryStatus::Pending).count();
    s.relay_until_idle("a relay commits between the two reads", &relay_default(), t)?;
    let held_now = s.inbox("consumer")?.len();
    s.record(
        "producer read before the relay, consumer read after it",
        json!({"producer_pending_deliveries": pending_then, "consumer_inbox_records": held_now}),
    );
    s.check(
        "two_reads_can_disagree",
        pending_then == 1 && held_now == 1,
        "pending in the producer's read, already held in the consumer's",
    );
    s.drain("drain audit", "consumer", "audit", 100, false, t)?;
    s.check_exactly_once("consumer", "audit")
}

fn init_never_resets(s: &mut Sc, _: &'static str) -> Result<()> {
    s.pipeline(&["audit"])?;
    let t = s.t0;
    two_events(s, t)?;
    s.relay_until_idle("relay", &relay_default(), t)?;
    s.drain("drain audit", "consumer", "audit", 100, false, t)?;
    let before = s.state()?;
    let generation = s.identity()?.generation;
    let again = s.reinit_producer("shop");
    s.record_result(
        "init the producer again (same source)",
        &again.as_ref().map(|i| i.source.clone()).map_err(Clone::clone),
    );
    s.check(
        "generation_kept",
        again.as_ref().is_ok_and(|i| i.generation == generation),
        "same generation after re-init",
    );
    let other = s.reinit_producer("other-shop");
    s.record_result(
        "init the producer with another source",
        &other.as_ref().map(|i| i.source.clone()).map_err(Clone::clone),
    );
    let code = other.as_ref().err().map(|e| e.code());
    s.check("other_source_refused", code == Some("already_initialized"), format!("{code:?}"));
    let horizon = s.reinit_consumer("consumer", DAY_MS);
    s.record_result("init the consumer again with a 1-day horizon", &horizon);
    s.check(
        "horizon_kept",
        horizon.as_ref().is_ok_and(|h| *h == tidemark_core::policy::RetentionPolicy::default().horizon_ms),
        format!("{horizon:?}"),
    );
    let after = s.state()?;
    s.check("state_unchanged", before == after, "full state identical before and after");
    s.check_exactly_once("consumer", "audit")
}

impl Sc {
    /// Receive that records a bad-input error instead of failing the scenario.
    fn try_receive(
        &mut self,
        what: &str,
        consumer: &str,
        consumer_id: &str,
        event: &Envelope,
        t: i64,
    ) -> Result<std::result::Result<ReceiveOutcome, Error>> {
        self.quiet_guarded(what, |s| s.receive("", consumer, consumer_id, event, t))
    }

    fn quiet_guarded<T: serde::Serialize>(
        &mut self,
        what: &str,
        f: impl FnOnce(&mut Sc) -> Result<T>,
    ) -> Result<std::result::Result<T, Error>> {
        let was = self.quiet;
        self.quiet = true;
        let result = f(self);
        self.quiet = was;
        self.record_result(what, &result);
        match result {
            Err(error) if !error.is_invalid_input() => Err(error),
            other => Ok(other),
        }
    }
}
