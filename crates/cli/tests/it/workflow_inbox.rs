//! Events into workflow runs through the inbox, on real files: the workflow database is also a
//! consumer database (one file), so an inbox handler ([`RunEventHandler`]) stores the run event
//! in the transaction that applies the inbox record, and the wake-up commits exactly once. The
//! command/reply pattern: a transactional step writes a command to the outbox of the same file
//! (its journal entry and the event commit together), the relay takes it to a service's inbox,
//! the service's reply comes back through its own outbox and the workflow's inbox and resumes
//! the run. Redelivered replies are inbox duplicates that wake nothing; a handler failing before
//! the commit leaves the run waiting. Every wait is a bounded loop; nothing asserts on time.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rusqlite::Connection;
use serde_json::{json, Value};
use tidemark_core::codes;
use tidemark_core::flow::{AdvanceOutcome, AdvanceRequest, Decision, FlowMachine, FlowState};
use tidemark_core::policy::RetentionPolicy;
use tidemark_core::store::{
    ConsumerStore, DrainScope, HandleError, Handler, InboxStatus, ProducerStore, ReceiveOutcome, Subscription,
};
use tidemark_core::workflow::{
    Backoff, RetryPolicy, RunDetail, RunStatus, StartOutcome, StartRequest, StepFailure, StepKind, StepStatus,
    WorkflowStore,
};
use tidemark_core::{Envelope, Error};
use tidemark_engine::workflow::tokio::runtime::{Builder, Runtime};
use tidemark_engine::workflow::{Worker, WorkerOptions, WorkerReport, WorkflowOptions, Workflows, Writer};
use tidemark_engine::{now_ms, relay_once, RelayOptions, RelayReport};
use tidemark_store_sqlite::workflow_events::RunEventHandler;
use tidemark_store_sqlite::{advance_in, Durability, SqliteConsumer, SqliteEndpoints, SqliteProducer, SqliteWorkflows};

type Store = SqliteWorkflows;

/// Rounds of `run_until_idle` (with a short pause between) before a test gives up.
const ROUNDS_MAX: usize = 1_000;
/// The consumer id of the workflows' inbox, and of the payment service's.
const WORKFLOWS: &str = "workflows";
const SERVICE: &str = "payment-service";

/// Any move is allowed; the event type is the target state and the payload is the input.
struct Messages;

impl FlowMachine for Messages {
    fn name(&self) -> &str {
        "messages"
    }

    // Used alone, not in a service: the states it moves to are whatever a request names.
    fn states(&self) -> Vec<&str> {
        vec!["new"]
    }

    fn initial(&self) -> FlowState {
        FlowState { state: "new".into(), data: json!({}) }
    }

    fn validate(&self, request: &AdvanceRequest) -> tidemark_core::Result<()> {
        if !request.input.is_object() {
            return Err(Error::invalid(codes::INVALID_PAYLOAD, "a message is a JSON object"));
        }
        Ok(())
    }

    fn decide(&self, _current: &FlowState, request: &AdvanceRequest) -> Result<Decision, String> {
        Ok(Decision {
            next: FlowState { state: request.to_state.clone(), data: json!({}) },
            event_type: request.to_state.clone(),
            payload: request.input.clone(),
        })
    }
}

fn message(flow_id: &str, expected_seq: i64, event_type: &str, payload: Value) -> AdvanceRequest {
    AdvanceRequest {
        flow_id: flow_id.into(),
        expected_seq,
        to_state: event_type.into(),
        input: payload,
        schema_version: 1,
        traceparent: None,
    }
}

fn runtime() -> Runtime {
    Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("tokio runtime")
}

fn path_str(path: &Path) -> String {
    path.to_str().expect("utf-8 path").to_string()
}

fn subscribe(producer: &mut SqliteProducer, consumer_id: &str, endpoint: &Path) {
    let subscription = Subscription { consumer_id: consumer_id.into(), endpoint: path_str(endpoint) };
    producer.subscribe(&subscription, true, now_ms()).expect("subscribe");
}

/// One relay pass of `producer` to its subscribers' files.
fn relay(producer: &mut SqliteProducer) -> RelayReport {
    let mut endpoints = SqliteEndpoints::new(Durability::Normal);
    relay_once(producer, &mut endpoints, &RelayOptions::default(), now_ms(), &mut || 0.5).expect("relay")
}

/// What a relay that crashed after the consumer's commit, before recording its verdicts, did:
/// every due delivery is in the consumer's inbox, and still pending at the producer.
fn relay_losing_the_verdicts(producer: &mut SqliteProducer) -> Vec<ReceiveOutcome> {
    let due = producer.due_deliveries(now_ms(), 100, None, None).expect("due deliveries");
    let mut outcomes = Vec::new();
    for delivery in due {
        let mut consumer = SqliteConsumer::open_with(Path::new(&delivery.endpoint), Durability::Normal).unwrap();
        outcomes.extend(consumer.receive_batch(&[(&delivery.consumer_id, &delivery.envelope)], now_ms()).unwrap());
    }
    outcomes
}

/// A failure after the handler did its work, before the apply commits (what a crash there leaves).
struct FailsBeforeCommit<H>(H);

impl<H: Handler<Connection>> Handler<Connection> for FailsBeforeCommit<H> {
    fn handle(&mut self, tx: &Connection, consumer_id: &str, event: &Envelope) -> Result<(), HandleError> {
        self.0.handle(tx, consumer_id, event)?;
        Err(HandleError::Failed(Error::store("the process died before the commit")))
    }
}

/// The workflow database, which is also a consumer database (and, for commands, a producer).
struct Env {
    dir: tempfile::TempDir,
    wf_path: PathBuf,
    writer: Writer<Store>,
    inbox: SqliteConsumer,
}

impl Env {
    fn new() -> Env {
        let dir = tempfile::tempdir().expect("tempdir");
        let wf_path = dir.path().join("workflows.db");
        let path = wf_path.clone();
        let writer = Writer::spawn(move || SqliteWorkflows::init_with(&path, Durability::Normal)).unwrap();
        drop(SqliteConsumer::init(&wf_path, RetentionPolicy::default()).expect("the same file as a consumer"));
        let inbox = SqliteConsumer::open_with(&wf_path, Durability::Normal).unwrap();
        Env { dir, wf_path, writer, inbox }
    }

    fn start(&self, run_id: &str, workflow: &str) {
        let request = StartRequest {
            run_id: run_id.into(),
            workflow: workflow.into(),
            version: 1,
            input: json!({}),
            key: None,
            start_at_ms: None,
            queue: None,
            deadline_ms: None,
        };
        let outcome = self.writer.call_blocking(move |s, now| s.start_runs(&[request], now)).unwrap().remove(0);
        assert_eq!(outcome, StartOutcome::Started { run_id: run_id.into() });
    }

    fn detail(&self, run_id: &str) -> RunDetail {
        let id = run_id.to_string();
        self.writer.call_blocking(move |s, _| s.run(&id)).unwrap().expect("the run exists")
    }

    fn drain(&mut self, handler: &mut dyn Handler<Connection>) -> tidemark_core::Result<u64> {
        self.inbox.drain(WORKFLOWS, &DrainScope::All, 100, handler, now_ms()).map(|r| r.applied)
    }

    fn inbox_statuses(&self) -> Vec<InboxStatus> {
        self.inbox.inbox(WORKFLOWS, None, 100).unwrap().into_iter().map(|e| e.status).collect()
    }
}

fn worker(env: &Env, workflows: Workflows<Store>) -> Arc<Worker<Store>> {
    let options = WorkerOptions { poll_interval_ms: 10, lease_ms: 10_000, ..WorkerOptions::new("w1") };
    Arc::new(Worker::new(env.writer.clone(), workflows, options).unwrap())
}

fn fast_options() -> WorkflowOptions {
    WorkflowOptions {
        concurrency_max: None,
        retry: RetryPolicy {
            max_attempts: 3,
            backoff: Backoff::Schedule { delays_ms: vec![20] },
            attempt_timeout_ms: 30_000,
            jitter: false,
        },
    }
}

/// Run the worker until nothing is due, again and again, until the run satisfies `done`.
fn drive(rt: &Runtime, w: &Worker<Store>, env: &Env, run_id: &str, done: impl Fn(&RunDetail) -> bool) -> WorkerReport {
    let mut total = WorkerReport::default();
    for _ in 0..ROUNDS_MAX {
        total.merge(rt.block_on(w.run_until_idle()).expect("worker"));
        if done(&env.detail(run_id)) {
            return total;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("run {run_id} did not get there in {ROUNDS_MAX} rounds: {:#?}", env.detail(run_id).run);
}

fn waiting(d: &RunDetail) -> bool {
    d.run.status == RunStatus::Waiting
}

fn terminal(d: &RunDetail) -> bool {
    d.run.status.is_terminal()
}

/// `checkout`: waits for `payment_captured` and returns its payload.
fn waiting_workflow() -> Workflows<Store> {
    let mut workflows = Workflows::new();
    workflows
        .register("checkout", 1, fast_options(), |ctx, _input| async move {
            let payment = ctx.wait_for_event("payment_captured", Duration::from_secs(3_600)).await?;
            Ok(json!({"payment": payment}))
        })
        .unwrap();
    workflows
}

#[test]
fn an_outbox_event_through_the_inbox_wakes_the_waiting_run_once() {
    let (mut env, rt) = (Env::new(), runtime());
    let payments_path = env.dir.path().join("payments.db");
    let mut payments = SqliteProducer::init(&payments_path, "payments").unwrap();
    subscribe(&mut payments, WORKFLOWS, &env.wf_path);
    let w = worker(&env, waiting_workflow());
    env.start("checkout-1", "checkout");
    drive(&rt, &w, &env, "checkout-1", waiting);
    assert_eq!(env.detail("checkout-1").run.waiting_for.as_deref(), Some("payment_captured"));

    // Another producer commits the event; the relay stores it in the workflow file's inbox.
    let payload = json!({"run_id": "checkout-1", "amount": 500});
    let outcome = payments
        .advance_batch(&Messages, &[message("pay-checkout-1", 0, "payment_captured", payload.clone())], now_ms())
        .unwrap()
        .remove(0);
    let AdvanceOutcome::Committed { event_id, .. } = outcome else { panic!("{outcome:?}") };
    // The relay crashes after the consumer's commit, before its verdict: the event is in the
    // inbox and still pending at the producer, so the next pass delivers it again: a duplicate.
    let outcomes = relay_losing_the_verdicts(&mut payments);
    assert!(matches!(outcomes.as_slice(), [ReceiveOutcome::Accepted { .. }]), "{outcomes:?}");
    let report = relay(&mut payments);
    assert_eq!((report.accepted, report.duplicate), (0, 1), "{report:?}");
    assert_eq!(relay(&mut payments).attempted, 0, "custody transferred");

    // Stored is not applied: the run has not heard of it yet.
    let d = env.detail("checkout-1");
    assert!(d.events.is_empty() && waiting(&d), "{d:?}");

    // Applying it stores the run event in the same transaction, which makes the run due.
    assert_eq!(env.drain(&mut RunEventHandler::new()).unwrap(), 1);
    assert_eq!(env.inbox_statuses(), [InboxStatus::Applied]);
    let d = env.detail("checkout-1");
    assert_eq!(d.events.len(), 1);
    assert_eq!((d.events[0].event_id.as_str(), d.events[0].name.as_str()), (event_id.as_str(), "payment_captured"));
    assert_eq!(d.events[0].payload, payload);
    assert!(d.run.wake_at_ms <= now_ms(), "the run is due at once");

    let report = drive(&rt, &w, &env, "checkout-1", terminal);
    let d = env.detail("checkout-1");
    assert_eq!(d.run.status, RunStatus::Completed, "{:?}", d.run.error);
    assert_eq!(d.run.result, Some(json!({"payment": payload})));
    assert_eq!(d.journal.len(), 1);
    assert_eq!((d.journal[0].kind, d.journal[0].status), (StepKind::Wait, StepStatus::Completed));
    assert_eq!(d.events[0].consumed_by_seq, Some(0));
    assert_eq!((report.claimed, report.completed), (1, 1), "{report:?}");

    // A late redelivery (a producer that lost its verdicts again) is a duplicate: nothing is
    // applied, the finished run is not touched.
    let outcomes = relay_losing_the_verdicts(&mut payments);
    assert!(outcomes.is_empty(), "nothing is pending any more");
    let envelope = env.inbox.inbox(WORKFLOWS, None, 10).unwrap().remove(0).envelope;
    let again = env.inbox.receive_batch(&[(WORKFLOWS, &envelope)], now_ms()).unwrap();
    assert!(matches!(again.as_slice(), [ReceiveOutcome::Duplicate { .. }]), "{again:?}");
    assert_eq!(env.drain(&mut RunEventHandler::new()).unwrap(), 0);
    let report = rt.block_on(w.run_until_idle()).unwrap();
    assert_eq!(report.claimed, 0, "{report:?}");
    let after = env.detail("checkout-1");
    assert_eq!((after.events.len(), after.run.updated_at_ms), (1, d.run.updated_at_ms));
}

/// The payment service: applies a `charge_requested` command and, in the same transaction,
/// commits its `payment_captured` reply to its own outbox (a transactional inbox and outbox).
struct PaymentService {
    calls: Arc<AtomicUsize>,
}

impl Handler<Connection> for PaymentService {
    fn handle(&mut self, tx: &Connection, _consumer_id: &str, event: &Envelope) -> Result<(), HandleError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if event.event_type != "charge_requested" {
            return Err(HandleError::Blocked(format!("unknown command {}", event.event_type)));
        }
        let run_id = event.payload["run_id"].as_str().ok_or(HandleError::Blocked("no run_id".into()))?;
        let reply = json!({
            "run_id": run_id,
            "amount": event.payload["amount"],
            "charge_id": format!("ch-{}", event.event_id),
        });
        let request = message(&format!("pay-{run_id}"), 0, "payment_captured", reply);
        match advance_in(tx, &Messages, &request, now_ms()).map_err(HandleError::Failed)? {
            AdvanceOutcome::Committed { .. } => Ok(()),
            other => Err(HandleError::Blocked(format!("the reply was not written: {other:?}"))),
        }
    }
}

#[test]
fn a_command_step_and_its_reply_through_outbox_and_inbox_resume_the_run() {
    let (mut env, rt) = (Env::new(), runtime());
    // The workflow file is also the producer of the commands.
    let mut orders = SqliteProducer::init(&env.wf_path, "orders").unwrap();
    let service_path = env.dir.path().join("service.db");
    let mut service_inbox = SqliteConsumer::init(&service_path, RetentionPolicy::default()).unwrap();
    let mut service_outbox = SqliteProducer::init(&service_path, "payments").unwrap();
    subscribe(&mut orders, SERVICE, &service_path);
    subscribe(&mut service_outbox, WORKFLOWS, &env.wf_path);

    let bodies = Arc::new(AtomicUsize::new(0));
    let mut workflows = Workflows::new();
    let counter = bodies.clone();
    workflows
        .register("checkout", 1, fast_options(), move |ctx, _input| {
            let (counter, run_id) = (counter.clone(), ctx.run_id().to_string());
            async move {
                let command: Value = ctx
                    .tx_step("request_payment", None, move |tx| {
                        let attempt = counter.fetch_add(1, Ordering::SeqCst) + 1;
                        let request = message(
                            &format!("cmd-{run_id}"),
                            0,
                            "charge_requested",
                            json!({"run_id": run_id, "amount": 500}),
                        );
                        let outcome = advance_in(tx, &Messages, &request, now_ms())
                            .map_err(|e| StepFailure::permanent(e.to_string()))?;
                        let AdvanceOutcome::Committed { event_id, seq, .. } = outcome else {
                            return Err(StepFailure::permanent(format!("the command was not written: {outcome:?}")));
                        };
                        if attempt == 1 {
                            // The body wrote the command, then failed: both roll back together.
                            return Err(StepFailure::retryable("lost the connection after writing the command"));
                        }
                        Ok(json!({"event_id": event_id, "seq": seq}))
                    })
                    .await?;
                let reply = ctx.wait_for_event("payment_captured", Duration::from_secs(3_600)).await?;
                Ok(json!({"command": command, "reply": reply}))
            }
        })
        .unwrap();
    let w = worker(&env, workflows);
    env.start("checkout-7", "checkout");
    drive(&rt, &w, &env, "checkout-7", waiting);

    // The step's journal entry and its outbox event committed together, once: the failed
    // attempt's event rolled back with it (else the retry would have been `stale`).
    let d = env.detail("checkout-7");
    assert_eq!(bodies.load(Ordering::SeqCst), 2);
    assert_eq!((d.journal[0].status, d.journal[0].attempts), (StepStatus::Completed, 2));
    let command_id = d.journal[0].output.as_ref().unwrap()["event_id"].as_str().unwrap().to_string();
    let outbox = orders.snapshot(100).unwrap().outbox;
    assert_eq!(outbox.len(), 1, "{outbox:?}");
    assert_eq!(
        (outbox[0].event_id.as_str(), outbox[0].flow_id.as_str(), outbox[0].seq),
        (command_id.as_str(), "cmd-checkout-7", 1)
    );

    // The command reaches the service twice (a lost verdict); the service applies it once and
    // its reply commits with that apply.
    let calls = Arc::new(AtomicUsize::new(0));
    let mut service = PaymentService { calls: calls.clone() };
    assert_eq!(relay_losing_the_verdicts(&mut orders).len(), 1);
    assert_eq!(relay(&mut orders).duplicate, 1);
    let drained = service_inbox.drain(SERVICE, &DrainScope::All, 100, &mut service, now_ms()).unwrap();
    assert_eq!((drained.applied, calls.load(Ordering::SeqCst)), (1, 1));
    let replies = service_outbox.snapshot(100).unwrap().outbox;
    assert_eq!(replies.len(), 1, "one reply: {replies:?}");
    let reply_id = replies[0].event_id.clone();

    // The reply comes back through the service's outbox and the workflow file's inbox, twice.
    assert_eq!(relay_losing_the_verdicts(&mut service_outbox).len(), 1);
    assert_eq!(relay(&mut service_outbox).duplicate, 1);

    // The process dies between the handler and the commit: nothing of the apply stays, the run
    // still waits and is not due.
    let error = env.drain(&mut FailsBeforeCommit(RunEventHandler::new())).unwrap_err();
    assert!(error.to_string().contains("died before the commit"), "{error}");
    assert_eq!(env.inbox_statuses(), [InboxStatus::Pending]);
    let d = env.detail("checkout-7");
    assert!(waiting(&d) && d.events.is_empty(), "{d:?}");
    let report = rt.block_on(w.run_until_idle()).unwrap();
    assert_eq!(report.claimed, 0, "the run is not due: {report:?}");

    // Applied for real: the run resumes with the reply.
    assert_eq!(env.drain(&mut RunEventHandler::new().route("payment_captured", "payment_captured")).unwrap(), 1);
    let report = drive(&rt, &w, &env, "checkout-7", terminal);
    assert_eq!(report.completed, 1, "{report:?}");
    let d = env.detail("checkout-7");
    assert_eq!(d.run.status, RunStatus::Completed, "{:?}", d.run.error);
    let result = d.run.result.clone().unwrap();
    assert_eq!(result["command"]["event_id"], json!(command_id));
    assert_eq!(result["reply"]["charge_id"], json!(format!("ch-{command_id}")));
    assert_eq!(result["reply"]["amount"], json!(500));
    assert_eq!(d.events.len(), 1);
    assert_eq!((d.events[0].event_id.as_str(), d.events[0].consumed_by_seq), (reply_id.as_str(), Some(1)));

    // Once more, after the run finished: duplicates everywhere, nothing applied or woken.
    let held = env.inbox.inbox(WORKFLOWS, None, 10).unwrap();
    assert_eq!(held.len(), 1);
    let again = env.inbox.receive_batch(&[(WORKFLOWS, &held[0].envelope)], now_ms()).unwrap();
    assert!(matches!(again.as_slice(), [ReceiveOutcome::Duplicate { .. }]), "{again:?}");
    assert_eq!(env.drain(&mut RunEventHandler::new()).unwrap(), 0);
    // Sent directly with the same id, the event is already there (not added twice).
    let (payload, id) = (held[0].envelope.payload.clone(), reply_id.clone());
    let added =
        env.writer.call_blocking(move |s, now| s.send_event("checkout-7", &id, "payment_captured", &payload, now));
    assert!(!added.unwrap());
    let report = rt.block_on(w.run_until_idle()).unwrap();
    assert_eq!(report.claimed, 0, "{report:?}");
    let after = env.detail("checkout-7");
    assert_eq!((after.run.status, after.events.len()), (RunStatus::Completed, 1));
    assert_eq!(after.run.updated_at_ms, d.run.updated_at_ms, "the finished run was not touched");
}

#[test]
fn events_a_run_cannot_take_block_their_record_and_unrouted_ones_are_ignored() {
    let (mut env, rt) = (Env::new(), runtime());
    let producer_path = env.dir.path().join("events.db");
    let mut producer = SqliteProducer::init(&producer_path, "events").unwrap();
    subscribe(&mut producer, WORKFLOWS, &env.wf_path);
    let w = worker(&env, waiting_workflow());
    env.start("done-1", "checkout");
    drive(&rt, &w, &env, "done-1", waiting);
    let id = "done-1".to_string();
    let sent =
        env.writer.call_blocking(move |s, now| s.send_event(&id, "direct-1", "payment_captured", &json!(1), now));
    assert!(sent.unwrap());
    drive(&rt, &w, &env, "done-1", terminal);

    let requests = [
        // Not for workflows once routes are given: applied, nothing else.
        message("f-ignored", 0, "newsletter_sent", json!({"run_id": "done-1"})),
        message("f-no-run", 0, "payment_captured", json!({"amount": 1})),
        message("f-unknown", 0, "payment_captured", json!({"run_id": "no-such-run"})),
        message("f-finished", 0, "payment_captured", json!({"run_id": "done-1"})),
    ];
    for outcome in producer.advance_batch(&Messages, &requests, now_ms()).unwrap() {
        assert!(matches!(outcome, AdvanceOutcome::Committed { .. }), "{outcome:?}");
    }
    assert_eq!(relay(&mut producer).accepted, 4);
    let mut handler = RunEventHandler::new().route("payment_captured", "payment_captured");
    let report = env.inbox.drain(WORKFLOWS, &DrainScope::All, 100, &mut handler, now_ms()).unwrap();
    assert_eq!(report.applied, 1, "{report:?}");
    let mut reasons: Vec<(String, String)> = env
        .inbox
        .inbox(WORKFLOWS, Some(InboxStatus::Blocked), 10)
        .unwrap()
        .into_iter()
        .map(|e| (e.envelope.flow_id, e.reason.unwrap_or_default()))
        .collect();
    reasons.sort();
    assert_eq!(reasons.len(), 3, "{reasons:?}");
    assert_eq!(reasons[0].0, "f-finished");
    assert!(reasons[0].1.contains("completed"), "{reasons:?}");
    assert_eq!(reasons[1].0, "f-no-run");
    assert!(reasons[1].1.contains("payload.run_id"), "{reasons:?}");
    assert_eq!(reasons[2].0, "f-unknown");
    assert!(reasons[2].1.contains("no-such-run"), "{reasons:?}");
    let d = env.detail("done-1");
    assert_eq!((d.run.status, d.events.len()), (RunStatus::Completed, 1), "only the direct event");
}
