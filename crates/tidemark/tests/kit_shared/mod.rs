//! What the test kit's tests on SQLite (`testing_kit.rs`) and on PostgreSQL
//! (`testing_kit_postgres.rs`) share: the order, the fake payment service, and the workflows
//! that touch no database (generic over the store, so each file runs them on its own).
#![allow(dead_code)] // each test file uses its own part

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tidemark::prelude::{RunStatus, StepFailure};
use tidemark::testing::{Effects, FindingKind, Report};
use tidemark::workflow::{StepStatus, Workflow, WorkflowContext, WorkflowError, WorkflowStore};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Order {
    pub order_id: String,
    pub amount: i64,
}

/// The fake payment service: a charge per idempotency key (a repeat of a key is answered as the
/// first call was), the first call of each key fails as a timeout would, and an amount over
/// 1,000 is declined.
#[derive(Clone)]
pub struct FakePayments {
    pub effects: Effects,
}

impl FakePayments {
    pub async fn charge(&self, order: &Order, key: &str) -> Result<String, StepFailure> {
        let repeat = self.effects.record(&format!("charge {}", order.order_id), key);
        if order.amount > 1_000 {
            return Err(StepFailure::permanent("the card was declined"));
        }
        if !repeat {
            return Err(StepFailure::retryable("the payment service timed out"));
        }
        Ok(format!("ch_{key}"))
    }
}

/// An external step that answers `<name>:<key>` at once.
pub fn external(name: &'static str) -> impl FnOnce(String) -> std::future::Ready<Result<String, StepFailure>> {
    move |key| std::future::ready(Ok(format!("{name}:{key}")))
}

/// The child that e-mails about an order.
pub fn notify<S: WorkflowStore + 'static>(effects: Effects) -> Workflow<S>
where
    S::Target: 'static,
{
    Workflow::new("notify", 1, move |ctx: WorkflowContext<S>, input: Value| {
        let effects = effects.clone();
        async move {
            let order_id = input["order_id"].as_str().unwrap_or_default().to_string();
            ctx.step("email", None, move |key| async move {
                effects.record(&format!("email {order_id}"), &key);
                Ok(format!("mail_{key}"))
            })
            .await
        }
    })
}

// Code that records journals (the first) and changed code replayed against them.

pub async fn reserve_then_charge<S: WorkflowStore + 'static>(
    ctx: WorkflowContext<S>,
    _: Value,
) -> Result<String, WorkflowError>
where
    S::Target: 'static,
{
    ctx.step("reserve", None, external("reserve")).await?;
    ctx.sleep(Duration::from_secs(86_400)).await?;
    ctx.step("charge", None, external("charge")).await
}

pub async fn appends_a_receipt<S: WorkflowStore + 'static>(
    ctx: WorkflowContext<S>,
    _: Value,
) -> Result<String, WorkflowError>
where
    S::Target: 'static,
{
    ctx.step("reserve", None, external("reserve")).await?;
    ctx.sleep(Duration::from_secs(86_400)).await?;
    let charge = ctx.step("charge", None, external("charge")).await?;
    ctx.step("receipt", None, external("receipt")).await?; // new, after every recorded position
    Ok(charge)
}

pub async fn reorders_the_steps<S: WorkflowStore + 'static>(
    ctx: WorkflowContext<S>,
    _: Value,
) -> Result<String, WorkflowError>
where
    S::Target: 'static,
{
    ctx.step("charge", None, external("charge")).await?;
    ctx.sleep(Duration::from_secs(86_400)).await?;
    ctx.step("reserve", None, external("reserve")).await
}

pub async fn stops_early<S: WorkflowStore + 'static>(ctx: WorkflowContext<S>, _: Value) -> Result<String, WorkflowError>
where
    S::Target: 'static,
{
    ctx.step("reserve", None, external("reserve")).await
}

/// A deadline checked on the live clock: after a crash the recovered run reads a later time and
/// takes the other branch.
pub fn branches_on_the_live_clock<S: WorkflowStore + 'static>() -> Workflow<S>
where
    S::Target: 'static,
{
    Workflow::new("late", 1, |ctx: WorkflowContext<S>, _: Value| async move {
        ctx.step("reserve", None, external("reserve")).await?;
        let expired = ctx.live_clock_ms() > tidemark::testing::CLOCK_START_MS + 60_000;
        let next = if expired { "expire" } else { "charge" };
        ctx.step(next, None, external("next")).await?;
        ctx.step("ship", None, external("ship")).await
    })
}

/// What both stores' kit reports of the order saga that completes show: every boundary crashed
/// in turn, the run completed with its child, and a charge repeated with its key after a crash
/// before its attempt's commit (a note, not a problem).
pub fn assert_the_saga_completed_at_every_boundary(report: &Report) {
    report.assert_ok();
    // Claim, reserve, the charge's failed attempt and its suspension, ..., the child's own
    // commits, the end: every one of them was crashed in turn.
    assert!(report.boundaries >= 8, "{report}");
    assert_eq!(report.boundary_schedules, report.boundaries, "{report}");
    // The crash-free run completed with its child, an hour's sleep passing on the kit's clock.
    let statuses: Vec<(&str, RunStatus)> = report.runs.iter().map(|d| (d.run.run_id.as_str(), d.run.status)).collect();
    assert_eq!(statuses, vec![("kit-run", RunStatus::Completed), ("kit-run.4", RunStatus::Completed)], "{report}");
    let notes: Vec<_> = report.of_kind(FindingKind::RetriedWithSameKey).collect();
    assert!(notes.iter().any(|n| n.step.as_deref() == Some("charge")), "{report}");
}

/// What both stores' kit reports of the declined order show: compensated at every boundary.
pub fn assert_the_saga_compensated_at_every_boundary(report: &Report) {
    report.assert_ok();
    let run = &report.runs[0];
    assert_eq!(run.run.status, RunStatus::Compensated, "{report}");
    let steps: Vec<(&str, StepStatus)> = run.journal.iter().map(|e| (e.name.as_str(), e.status)).collect();
    assert_eq!(
        steps,
        vec![
            ("reserve", StepStatus::Completed),
            ("now", StepStatus::Completed),
            ("charge", StepStatus::Failed),
            ("release", StepStatus::Completed)
        ]
    );
}
