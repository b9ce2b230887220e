//! The reference saga: an order. `reserve_inventory` (transactional) -> `charge_payment`
//! (external: a payment service) -> optional durable wait (`ship_after_ms`) -> `ship_order`
//! (transactional); compensations `release_inventory` (transactional, as
//! `compensate:reserve_inventory`) and `refund_payment` (external, as
//! `compensate:charge_payment`).
//!
//! The transactional steps go through [`OrderTx`], implemented for SQLite's connection with the
//! SQL of [`tables`]; the payment service is a [`Payments`]. [`FakePayments`]
//! is a deterministic in-process fake driven by the input (`fail`, `flaky_attempts`) that logs
//! every call with its idempotency key in its own database.

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tidemark::id::validate_id;
use tidemark::postgres::ApplyTransaction;
use tidemark::rusqlite;
use tidemark::workflow::{Saga, SagaAction, SagaData, StepFailure, WorkflowOptions, WorkflowStore, Workflows};
use tidemark::Result;

pub mod postgres;
pub mod tables;

use tables::{self as sql, PaymentCall, ReserveOutcome};

/// The order saga's registered name.
pub const ORDER_SAGA: &str = "order_saga";
/// The order saga's version (runs pinned to another version are left for a worker that has it).
pub const ORDER_SAGA_VERSION: u32 = 1;

/// The order saga's input.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OrderInput {
    /// The order, an identifier; it names the reservation, the payment calls and the shipment.
    pub order_id: String,
    /// The SKU to reserve, an identifier; its stock must have been set (`workflow init --sku`).
    pub sku: String,
    /// The units to reserve (1..=1,000,000).
    pub quantity: i64,
    /// In minor units.
    pub amount: i64,
    /// Make this step fail for good: `"reserve_inventory"`, `"charge_payment"` (card declined),
    /// `"ship_order"` (carrier refused), `"refund_payment"`, `"release_inventory"`.
    #[serde(default)]
    pub fail: Option<String>,
    /// The payment service is unavailable for the first N calls of each idempotency key.
    #[serde(default)]
    pub flaky_attempts: u32,
    /// Wait this long (a durable timer) between the charge and the shipment.
    #[serde(default)]
    pub ship_after_ms: u64,
}

impl OrderInput {
    /// The order input of a saga run, validated: a run whose input does not decode or is out of
    /// range fails the step for good (a permanent [`StepFailure`]).
    pub fn from_data(data: &SagaData) -> std::result::Result<OrderInput, StepFailure> {
        let order = OrderInput::deserialize(&data.input)
            .map_err(|e| StepFailure::permanent(format!("invalid order input: {e}")))?;
        validate_id("order_id", &order.order_id).map_err(|e| StepFailure::permanent(e.to_string()))?;
        validate_id("sku", &order.sku).map_err(|e| StepFailure::permanent(e.to_string()))?;
        if !(1..=1_000_000).contains(&order.quantity) || order.amount < 0 {
            return Err(StepFailure::permanent("quantity must be 1..=1000000 and amount >= 0"));
        }
        Ok(order)
    }

    fn fails(&self, step: &str) -> bool {
        self.fail.as_deref() == Some(step)
    }
}

/// The order's transactional operations on the workflow database's handle.
pub trait OrderTx {
    /// Take the order's quantity out of stock (installing the order tables if missing). An unknown
    /// SKU, too little stock or an existing reservation is a permanent failure.
    fn reserve_inventory(&self, order: &OrderInput) -> std::result::Result<Value, StepFailure>;
    /// Put a reserved order's quantity back in stock (the compensation of `reserve_inventory`);
    /// answers `{"released": false}` when there was nothing to release.
    fn release_inventory(&self, order: &OrderInput) -> std::result::Result<Value, StepFailure>;
    /// Mark the reserved order shipped; an order that is not reserved is a permanent failure.
    fn ship_order(&self, order: &OrderInput) -> std::result::Result<Value, StepFailure>;
}

fn db_failure(error: tidemark::Error) -> StepFailure {
    StepFailure::retryable(error.to_string())
}

/// What a reservation attempt answers: its output, or the permanent failure its outcome is.
fn reserved(order: &OrderInput, outcome: ReserveOutcome) -> std::result::Result<Value, StepFailure> {
    match outcome {
        ReserveOutcome::Reserved { stock_left } => Ok(json!({"reserved": order.quantity, "stock_left": stock_left})),
        ReserveOutcome::UnknownSku => Err(StepFailure::permanent(format!("unknown sku {}", order.sku))),
        ReserveOutcome::Insufficient { stock } => Err(StepFailure::permanent(format!(
            "insufficient stock of {}: {stock} left, {} wanted",
            order.sku, order.quantity
        ))),
        ReserveOutcome::AlreadyReserved { status } => {
            Err(StepFailure::permanent(format!("order {} already has a reservation ({status})", order.order_id)))
        }
    }
}

fn refused(order: &OrderInput, step: &str, message: &str) -> std::result::Result<(), StepFailure> {
    if order.fails(step) {
        return Err(StepFailure::permanent(message));
    }
    Ok(())
}

const RESERVE_REFUSED: &str = "inventory refused (requested by the input)";
const RELEASE_REFUSED: &str = "release refused (requested by the input)";
const SHIP_REFUSED: &str = "carrier refused the shipment (requested by the input)";

fn shipped(order: &OrderInput, shipped: bool) -> std::result::Result<Value, StepFailure> {
    if !shipped {
        return Err(StepFailure::permanent(format!("order {} is not reserved", order.order_id)));
    }
    Ok(json!({"shipped": order.quantity}))
}

impl OrderTx for rusqlite::Connection {
    fn reserve_inventory(&self, order: &OrderInput) -> std::result::Result<Value, StepFailure> {
        refused(order, "reserve_inventory", RESERVE_REFUSED)?;
        if !sql::is_installed(self) {
            sql::install(self).map_err(db_failure)?;
        }
        reserved(order, sql::reserve(self, &order.order_id, &order.sku, order.quantity).map_err(db_failure)?)
    }

    fn release_inventory(&self, order: &OrderInput) -> std::result::Result<Value, StepFailure> {
        refused(order, "release_inventory", RELEASE_REFUSED)?;
        let released = sql::release(self, &order.order_id).map_err(db_failure)?;
        Ok(json!({"released": released}))
    }

    fn ship_order(&self, order: &OrderInput) -> std::result::Result<Value, StepFailure> {
        refused(order, "ship_order", SHIP_REFUSED)?;
        shipped(order, sql::ship(self, &order.order_id).map_err(db_failure)?)
    }
}

/// The same steps on PostgreSQL, in the workflow store's schema (the tables are installed by
/// `workflow init` or [`postgres::install`]; a step on a schema without them fails and is
/// retried).
impl OrderTx for ApplyTransaction {
    fn reserve_inventory(&self, order: &OrderInput) -> std::result::Result<Value, StepFailure> {
        refused(order, "reserve_inventory", RESERVE_REFUSED)?;
        reserved(order, postgres::reserve(self, &order.order_id, &order.sku, order.quantity).map_err(db_failure)?)
    }

    fn release_inventory(&self, order: &OrderInput) -> std::result::Result<Value, StepFailure> {
        refused(order, "release_inventory", RELEASE_REFUSED)?;
        let released = postgres::release(self, &order.order_id).map_err(db_failure)?;
        Ok(json!({"released": released}))
    }

    fn ship_order(&self, order: &OrderInput) -> std::result::Result<Value, StepFailure> {
        refused(order, "ship_order", SHIP_REFUSED)?;
        shipped(order, postgres::ship(self, &order.order_id).map_err(db_failure)?)
    }
}

/// The answer of a payment call, for async callers.
pub type PaymentFuture = Pin<Box<dyn Future<Output = std::result::Result<Value, StepFailure>> + Send>>;

/// The payment service (external: at least once, so it must honour the idempotency key).
pub trait Payments: Send + Sync + 'static {
    /// Charge the order's amount under the idempotency `key`; a retry with the same key must not
    /// charge twice.
    fn charge(&self, key: &str, order: &OrderInput) -> std::result::Result<Value, StepFailure>;
    /// Refund a charge (the compensation of `charge_payment`; `charge` is that step's output),
    /// under its own idempotency `key`.
    fn refund(&self, key: &str, order: &OrderInput, charge: &Value) -> std::result::Result<Value, StepFailure>;

    /// [`Payments::charge`] for async callers (the order saga). By default the same call; a
    /// service that waits (for a disk, a network) answers without holding the caller's thread.
    fn charge_async(self: Arc<Self>, key: String, order: OrderInput) -> PaymentFuture {
        Box::pin(async move { self.charge(&key, &order) })
    }

    /// [`Payments::refund`] for async callers; see [`Payments::charge_async`].
    fn refund_async(self: Arc<Self>, key: String, order: OrderInput, charge: Value) -> PaymentFuture {
        Box::pin(async move { self.refund(&key, &order, &charge) })
    }
}

/// A deterministic fake payment service with its own SQLite call log. For each idempotency key:
/// the first `flaky_attempts` calls fail retryably (`unavailable`); `fail: "charge_payment"`
/// declines (permanent), `fail: "refund_payment"` refuses every refund (permanent); once a call
/// with a key succeeded, later calls with that key answer the same result (`duplicate`) without
/// charging again.
///
/// A log in a file ([`FakePayments::open`], `synchronous=FULL`) is written by a thread of its
/// own that commits the calls which arrive while it is busy together, one transaction (one
/// fsync) for all of them, and answers each after that commit, as a payment service serving
/// many callers does; an async caller waits without holding its thread
/// ([`Payments::charge_async`]). A log in memory is written by the caller, at once.
pub struct FakePayments {
    log: PaymentLog,
}

enum PaymentLog {
    Memory(Mutex<rusqlite::Connection>),
    File(mpsc::Sender<Job>),
}

/// A call as the fake decides it: by the key's history and the order's knobs.
struct PendingCall {
    key: String,
    op: &'static str,
    order_id: String,
    amount: i64,
    declined: bool,
    flaky_attempts: u32,
    success: &'static str,
}

/// A call's outcome as recorded (`charged`, `refunded`, `duplicate`, `nothing_to_refund`), or
/// the failure it answers.
type CallAnswer = std::result::Result<&'static str, StepFailure>;

/// The outcome of a refund of an order that was never charged: it refunds nothing.
const NOTHING_TO_REFUND: &str = "nothing_to_refund";

enum Reply {
    Blocking(mpsc::SyncSender<CallAnswer>),
    Async(tokio::sync::oneshot::Sender<CallAnswer>),
}

enum Job {
    Call(PendingCall, Reply),
    Calls(mpsc::SyncSender<Result<Vec<PaymentCall>>>),
}

/// Calls one transaction of the file log holds at most.
const PAYMENT_BATCH_MAX: usize = 1_000;

impl FakePayments {
    /// The fake with its call log in the SQLite file at `path` (created if missing), so the log
    /// survives the process for the crash tests.
    pub fn open(path: &Path) -> Result<FakePayments> {
        let conn = sql::open_payments(path)?;
        let (sender, jobs) = mpsc::channel();
        std::thread::Builder::new()
            .name("fake-payments".into())
            .spawn(move || commit_payments(conn, jobs))
            .map_err(|e| tidemark::Error::io(format!("cannot start the fake payment service's thread: {e}")))?;
        Ok(FakePayments { log: PaymentLog::File(sender) })
    }

    /// A fake whose call log is in memory (gone with the process).
    pub fn in_memory() -> Result<FakePayments> {
        Ok(FakePayments { log: PaymentLog::Memory(Mutex::new(sql::open_payments_in_memory()?)) })
    }

    /// Every call received, in order.
    pub fn calls(&self) -> Result<Vec<PaymentCall>> {
        match &self.log {
            PaymentLog::Memory(conn) => sql::payment_calls(&conn.lock().unwrap_or_else(|p| p.into_inner())),
            PaymentLog::File(jobs) => {
                let (reply, answer) = mpsc::sync_channel(1);
                jobs.send(Job::Calls(reply)).map_err(|_| payments_gone_error())?;
                answer.recv().map_err(|_| payments_gone_error())?
            }
        }
    }

    fn pending(key: &str, op: &'static str, order: &OrderInput, declined: bool, success: &'static str) -> PendingCall {
        PendingCall {
            key: key.to_string(),
            op,
            order_id: order.order_id.clone(),
            amount: order.amount,
            declined,
            flaky_attempts: order.flaky_attempts,
            success,
        }
    }

    /// Make the call and wait for its answer on this thread.
    fn call(&self, call: PendingCall) -> CallAnswer {
        match &self.log {
            PaymentLog::Memory(conn) => decide_and_record(&conn.lock().unwrap_or_else(|p| p.into_inner()), &call),
            PaymentLog::File(jobs) => {
                let (reply, answer) = mpsc::sync_channel(1);
                jobs.send(Job::Call(call, Reply::Blocking(reply))).map_err(|_| payments_gone())?;
                answer.recv().map_err(|_| payments_gone())?
            }
        }
    }

    /// Make the call; its answer, without holding the caller's thread while the log commits.
    fn call_async(&self, call: PendingCall) -> impl Future<Output = CallAnswer> + Send + 'static {
        let queued = match &self.log {
            PaymentLog::Memory(conn) => Err(decide_and_record(&conn.lock().unwrap_or_else(|p| p.into_inner()), &call)),
            PaymentLog::File(jobs) => {
                let (reply, answer) = tokio::sync::oneshot::channel();
                match jobs.send(Job::Call(call, Reply::Async(reply))) {
                    Ok(()) => Ok(answer),
                    Err(_) => Err(Err(payments_gone())),
                }
            }
        };
        async move {
            match queued {
                Ok(answer) => answer.await.map_err(|_| payments_gone())?,
                Err(done) => done,
            }
        }
    }
}

/// A refund's output: what was refunded, or that the order was never charged.
fn refund_output(key: &str, order: &OrderInput, charge: &Value, outcome: &str) -> Value {
    if outcome == NOTHING_TO_REFUND {
        return json!({"refunded": false, "reason": "the order was never charged"});
    }
    json!({"refund_id": format!("rf-{key}"), "charge_id": charge.get("charge_id"), "amount": order.amount})
}

fn payments_gone() -> StepFailure {
    StepFailure::retryable("the fake payment service's log stopped")
}

fn payments_gone_error() -> tidemark::Error {
    tidemark::Error::io("the fake payment service's log stopped")
}

/// Decide a call by its key's history (in `conn`, which may be a transaction holding earlier
/// calls of the same batch) and record it.
fn decide_and_record(conn: &rusqlite::Connection, call: &PendingCall) -> CallAnswer {
    let (calls, succeeded) = sql::payment_history(conn, &call.key).map_err(db_failure)?;
    let outcome = if succeeded {
        "duplicate"
    } else if call.declined {
        "declined"
    } else if calls < i64::from(call.flaky_attempts) {
        "unavailable"
    } else if call.op == "refund" && !sql::order_charged(conn, &call.order_id).map_err(db_failure)? {
        // A refund compensating a charge that never happened (a cancel stopped the saga at its
        // charge): nothing to give back.
        NOTHING_TO_REFUND
    } else {
        call.success
    };
    let record = PaymentCall {
        idempotency_key: call.key.clone(),
        op: call.op.to_string(),
        order_id: call.order_id.clone(),
        amount: call.amount,
        outcome: outcome.to_string(),
    };
    sql::record_payment_call(conn, &record).map_err(db_failure)?;
    match outcome {
        "declined" => Err(StepFailure::permanent(format!("{} declined", call.op))),
        "unavailable" => Err(StepFailure::retryable(format!("payment service unavailable (call {})", calls + 1))),
        done => Ok(done),
    }
}

/// The file log's thread: the calls queued while it committed go into the next transaction
/// together; each is answered after that commit (a failed commit answers each with a retryable
/// failure: nothing of it was recorded).
fn commit_payments(mut conn: rusqlite::Connection, jobs: mpsc::Receiver<Job>) {
    while let Ok(first) = jobs.recv() {
        let mut calls = Vec::new();
        let mut reads = Vec::new();
        let mut next = Some(first);
        while let Some(job) = next.take() {
            match job {
                Job::Call(call, reply) => calls.push((call, reply)),
                Job::Calls(reply) => reads.push(reply),
            }
            if calls.len() < PAYMENT_BATCH_MAX {
                next = jobs.try_recv().ok();
            }
        }
        if !calls.is_empty() {
            let committed = (|| -> Result<Vec<CallAnswer>> {
                let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
                let answers = calls.iter().map(|(call, _)| decide_and_record(&tx, call)).collect();
                tx.commit()?;
                Ok(answers)
            })();
            let answers = match committed {
                Ok(answers) => answers,
                Err(error) => calls.iter().map(|_| Err(db_failure(error.clone()))).collect(),
            };
            for ((_, reply), answer) in calls.into_iter().zip(answers) {
                match reply {
                    Reply::Blocking(reply) => {
                        let _ = reply.send(answer);
                    }
                    Reply::Async(reply) => {
                        let _ = reply.send(answer);
                    }
                }
            }
        }
        for reply in reads {
            let _ = reply.send(sql::payment_calls(&conn));
        }
    }
}

impl Payments for FakePayments {
    fn charge(&self, key: &str, order: &OrderInput) -> std::result::Result<Value, StepFailure> {
        self.call(Self::pending(key, "charge", order, order.fails("charge_payment"), "charged"))?;
        Ok(json!({"charge_id": format!("ch-{key}"), "amount": order.amount}))
    }

    fn refund(&self, key: &str, order: &OrderInput, charge: &Value) -> std::result::Result<Value, StepFailure> {
        let outcome = self.call(Self::pending(key, "refund", order, order.fails("refund_payment"), "refunded"))?;
        Ok(refund_output(key, order, charge, outcome))
    }

    fn charge_async(self: Arc<Self>, key: String, order: OrderInput) -> PaymentFuture {
        let answer = self.call_async(Self::pending(&key, "charge", &order, order.fails("charge_payment"), "charged"));
        Box::pin(async move {
            answer.await?;
            Ok(json!({"charge_id": format!("ch-{key}"), "amount": order.amount}))
        })
    }

    fn refund_async(self: Arc<Self>, key: String, order: OrderInput, charge: Value) -> PaymentFuture {
        let answer = self.call_async(Self::pending(&key, "refund", &order, order.fails("refund_payment"), "refunded"));
        Box::pin(async move {
            let outcome = answer.await?;
            Ok(refund_output(&key, &order, &charge, outcome))
        })
    }
}

/// The order saga, for any store whose transactional handle implements [`OrderTx`].
pub fn order_saga<S>(payments: Arc<dyn Payments>) -> Saga<S>
where
    S: WorkflowStore + 'static,
    S::Target: OrderTx + 'static,
{
    let charge = payments.clone();
    let refund = payments;
    Saga::new(ORDER_SAGA, ORDER_SAGA_VERSION)
        .step(
            "reserve_inventory",
            SagaAction::tx(|tx: &S::Target, data: &SagaData| tx.reserve_inventory(&OrderInput::from_data(data)?)),
            Some(SagaAction::tx(|tx: &S::Target, data: &SagaData| tx.release_inventory(&OrderInput::from_data(data)?))),
        )
        .step(
            "charge_payment",
            SagaAction::external(move |key, data| {
                let payments = charge.clone();
                async move { payments.charge_async(key, OrderInput::from_data(&data)?).await }
            }),
            Some(SagaAction::external(move |key, data| {
                let payments = refund.clone();
                async move {
                    let charge = data.outputs.get("charge_payment").cloned().unwrap_or(Value::Null);
                    payments.refund_async(key, OrderInput::from_data(&data)?, charge).await
                }
            })),
        )
        .sleep(|data| {
            let ms = data.input.get("ship_after_ms").and_then(Value::as_u64).unwrap_or(0);
            Duration::from_millis(ms)
        })
        .step(
            "ship_order",
            SagaAction::tx(|tx: &S::Target, data: &SagaData| tx.ship_order(&OrderInput::from_data(data)?)),
            None,
        )
}

/// Register [`order_saga`] (version [`ORDER_SAGA_VERSION`]).
pub fn register_order_saga<S>(
    workflows: &mut Workflows<S>,
    payments: Arc<dyn Payments>,
    options: WorkflowOptions,
) -> Result<()>
where
    S: WorkflowStore + 'static,
    S::Target: OrderTx + 'static,
{
    order_saga::<S>(payments).register(workflows, options)
}

/// Where `tidemark worker --db F` keeps the fake payment service's log by default: beside the
/// workflow database, `<db stem>.payments.db`.
pub fn payments_path(db: &std::path::Path) -> std::path::PathBuf {
    db.with_extension("payments.db")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(order_id: &str, extra: Value) -> OrderInput {
        let mut input = json!({"order_id": order_id, "sku": "sku-1", "quantity": 1, "amount": 100});
        if let (Some(input), Some(extra)) = (input.as_object_mut(), extra.as_object()) {
            input.extend(extra.clone());
        }
        OrderInput::deserialize(&input).unwrap()
    }

    #[test]
    fn concurrent_calls_on_a_file_log_are_decided_as_one_after_the_other() {
        let dir = tempfile::tempdir().unwrap();
        let payments = Arc::new(FakePayments::open(&dir.path().join("payments.db")).unwrap());
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        // 100 keys, each charged twice at once (from async callers), and a flaky key.
        let charges: Vec<_> = (0..200)
            .map(|i| {
                let payments = payments.clone();
                let key = format!("key-{}", i % 100);
                runtime.spawn(async move { payments.charge_async(key.clone(), order(&key, json!({}))).await })
            })
            .collect();
        for charge in charges {
            let charged = runtime.block_on(charge).unwrap().unwrap();
            assert!(charged["charge_id"].as_str().unwrap().starts_with("ch-key-"));
        }
        let flaky = order("flaky", json!({"flaky_attempts": 2}));
        for expected_ok in [false, false, true, true] {
            assert_eq!(payments.charge("flaky", &flaky).is_ok(), expected_ok);
        }
        let declined = payments.charge("declined", &order("declined", json!({"fail": "charge_payment"})));
        assert!(declined.is_err());
        let refunded =
            runtime.block_on(payments.clone().refund_async("key-1".into(), order("key-1", json!({})), json!({})));
        assert!(refunded.is_ok());

        let calls = payments.calls().unwrap();
        let outcome_of = |key: &str| -> Vec<String> {
            calls.iter().filter(|c| c.idempotency_key == key).map(|c| c.outcome.clone()).collect()
        };
        for i in 0..100 {
            let key = format!("key-{i}");
            let outcomes = outcome_of(&key);
            let charged = outcomes.iter().filter(|o| *o == "charged").count();
            assert_eq!(charged, 1, "{key}: one charge, the other call a duplicate: {outcomes:?}");
        }
        assert_eq!(outcome_of("flaky"), ["unavailable", "unavailable", "charged", "duplicate"]);
        assert_eq!(outcome_of("declined"), ["declined"]);
        assert_eq!(calls.len(), 200 + 4 + 1 + 1);
        drop(payments);
        // Every answered call is on disk.
        let reopened = FakePayments::open(&dir.path().join("payments.db")).unwrap();
        assert_eq!(reopened.calls().unwrap(), calls);
    }
}
