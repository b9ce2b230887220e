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

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tidemark::id::validate_id;
use tidemark::rusqlite;
use tidemark::workflow::{Saga, SagaAction, SagaData, StepFailure, WorkflowOptions, WorkflowStore, Workflows};
use tidemark::Result;

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

impl OrderTx for rusqlite::Connection {
    fn reserve_inventory(&self, order: &OrderInput) -> std::result::Result<Value, StepFailure> {
        if order.fails("reserve_inventory") {
            return Err(StepFailure::permanent("inventory refused (requested by the input)"));
        }
        if !sql::is_installed(self) {
            sql::install(self).map_err(db_failure)?;
        }
        match sql::reserve(self, &order.order_id, &order.sku, order.quantity).map_err(db_failure)? {
            ReserveOutcome::Reserved { stock_left } => {
                Ok(json!({"reserved": order.quantity, "stock_left": stock_left}))
            }
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

    fn release_inventory(&self, order: &OrderInput) -> std::result::Result<Value, StepFailure> {
        if order.fails("release_inventory") {
            return Err(StepFailure::permanent("release refused (requested by the input)"));
        }
        let released = sql::release(self, &order.order_id).map_err(db_failure)?;
        Ok(json!({"released": released}))
    }

    fn ship_order(&self, order: &OrderInput) -> std::result::Result<Value, StepFailure> {
        if order.fails("ship_order") {
            return Err(StepFailure::permanent("carrier refused the shipment (requested by the input)"));
        }
        if !sql::ship(self, &order.order_id).map_err(db_failure)? {
            return Err(StepFailure::permanent(format!("order {} is not reserved", order.order_id)));
        }
        Ok(json!({"shipped": order.quantity}))
    }
}

/// The payment service (external: at least once, so it must honour the idempotency key).
pub trait Payments: Send + Sync + 'static {
    /// Charge the order's amount under the idempotency `key`; a retry with the same key must not
    /// charge twice.
    fn charge(&self, key: &str, order: &OrderInput) -> std::result::Result<Value, StepFailure>;
    /// Refund a charge (the compensation of `charge_payment`; `charge` is that step's output),
    /// under its own idempotency `key`.
    fn refund(&self, key: &str, order: &OrderInput, charge: &Value) -> std::result::Result<Value, StepFailure>;
}

/// A deterministic fake payment service with its own SQLite call log. For each idempotency key:
/// the first `flaky_attempts` calls fail retryably (`unavailable`); `fail: "charge_payment"`
/// declines (permanent), `fail: "refund_payment"` refuses every refund (permanent); once a call
/// with a key succeeded, later calls with that key answer the same result (`duplicate`) without
/// charging again.
pub struct FakePayments {
    conn: Mutex<rusqlite::Connection>,
}

impl FakePayments {
    /// The fake with its call log in the SQLite file at `path` (created if missing), so the log
    /// survives the process for the crash tests.
    pub fn open(path: &Path) -> Result<FakePayments> {
        Ok(FakePayments { conn: Mutex::new(sql::open_payments(path)?) })
    }

    /// A fake whose call log is in memory (gone with the process).
    pub fn in_memory() -> Result<FakePayments> {
        Ok(FakePayments { conn: Mutex::new(sql::open_payments_in_memory()?) })
    }

    /// Every call received, in order.
    pub fn calls(&self) -> Result<Vec<PaymentCall>> {
        sql::payment_calls(&self.lock())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, rusqlite::Connection> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn call(
        &self,
        key: &str,
        op: &str,
        order: &OrderInput,
        declined: bool,
        success: &str,
    ) -> std::result::Result<(), StepFailure> {
        let conn = self.lock();
        let (calls, succeeded) = sql::payment_history(&conn, key).map_err(db_failure)?;
        let outcome = if succeeded {
            "duplicate"
        } else if declined {
            "declined"
        } else if calls < i64::from(order.flaky_attempts) {
            "unavailable"
        } else {
            success
        };
        let record = PaymentCall {
            idempotency_key: key.to_string(),
            op: op.to_string(),
            order_id: order.order_id.clone(),
            amount: order.amount,
            outcome: outcome.to_string(),
        };
        sql::record_payment_call(&conn, &record).map_err(db_failure)?;
        match outcome {
            "declined" => Err(StepFailure::permanent(format!("{op} declined"))),
            "unavailable" => Err(StepFailure::retryable(format!("payment service unavailable (call {})", calls + 1))),
            _ => Ok(()),
        }
    }
}

impl Payments for FakePayments {
    fn charge(&self, key: &str, order: &OrderInput) -> std::result::Result<Value, StepFailure> {
        self.call(key, "charge", order, order.fails("charge_payment"), "charged")?;
        Ok(json!({"charge_id": format!("ch-{key}"), "amount": order.amount}))
    }

    fn refund(&self, key: &str, order: &OrderInput, charge: &Value) -> std::result::Result<Value, StepFailure> {
        self.call(key, "refund", order, order.fails("refund_payment"), "refunded")?;
        Ok(json!({"refund_id": format!("rf-{key}"), "charge_id": charge.get("charge_id"), "amount": order.amount}))
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
                async move { payments.charge(&key, &OrderInput::from_data(&data)?) }
            }),
            Some(SagaAction::external(move |key, data| {
                let payments = refund.clone();
                async move {
                    let charge = data.outputs.get("charge_payment").cloned().unwrap_or(Value::Null);
                    payments.refund(&key, &OrderInput::from_data(&data)?, &charge)
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
