//! Queues: named lanes that runs go through, with a concurrency limit across every worker on the
//! database, a rate limit (runs admitted per period), priorities and deduplication ids, in the
//! manner of DBOS queues (docs/workflows.md, "Queues").
//!
//! A run started with [`Enqueue`] waits in its queue until a claim **admits** it: the claim that
//! leases it for the first time, in the same transaction (no commit of its own), only while the
//! queue has room: fewer admitted, unfinished runs than `concurrency_max`, and fewer runs
//! admitted in the last `period_ms` than `rate_limit`. Waiting runs are admitted by priority
//! (lower first), then oldest first. An admitted run holds its place until it ends (a sleeping or
//! waiting run still counts: the limit is on runs in progress, not on leases).

use serde::{Deserialize, Serialize};

use crate::error::{codes, Error, Result};
use crate::id::validate_id;
use crate::workflow::TIMER_MS_MAX;

/// Stable error codes of queues.
pub mod queue_codes {
    /// A start names a queue that was not declared.
    pub const UNKNOWN_QUEUE: &str = "unknown_queue";
    /// A start's deduplication id is held by an unfinished run of the same queue.
    pub const DEDUPLICATED: &str = "deduplicated";
}

/// At most this many queues per workflow database.
pub const QUEUES_MAX: usize = 1_000;
/// A queue's concurrency limit and rate limit: 1..=1,000,000.
pub const QUEUE_LIMIT_MAX: u32 = 1_000_000;
/// The waiting runs `queue(name)` lists with their position, at most.
pub const QUEUE_WAITING_SHOWN_MAX: usize = 1_000;

/// How a start goes through a queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Enqueue {
    /// The declared queue.
    #[cfg_attr(feature = "openapi", schema(pattern = "^[A-Za-z0-9_.:-]{1,100}$"))]
    pub queue: String,
    /// Lower first (default 0); ties are admitted oldest first.
    #[serde(default, deserialize_with = "crate::json::integer")]
    pub priority: i32,
    /// At most one unfinished run of the queue holds a deduplication id: another start with it
    /// is refused (`deduplicated`, naming the run that holds it).
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(pattern = "^[A-Za-z0-9_.:-]{1,100}$"))]
    pub dedup_id: Option<String>,
}

impl Enqueue {
    /// Identifiers only (the queue's existence is checked by the store).
    pub fn validate(&self) -> Result<()> {
        validate_id("queue", &self.queue)?;
        if let Some(dedup) = &self.dedup_id {
            validate_id("dedup_id", dedup)?;
        }
        Ok(())
    }
}

/// A rate limit: at most `limit` runs admitted in any `period_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RateLimit {
    /// Runs per period, 1..=1,000,000.
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 1_000_000))]
    #[serde(deserialize_with = "crate::json::integer")]
    pub limit: u32,
    /// The period in ms, 1..=366 days.
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 31_622_400_000_i64))]
    #[serde(deserialize_with = "crate::json::integer")]
    pub period_ms: i64,
}

/// A queue as declared.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct QueueSpec {
    /// The queue's name (an identifier).
    pub name: String,
    /// At most this many admitted, unfinished runs at once, across every worker (`None`: no
    /// limit of its own).
    #[serde(default)]
    pub concurrency_max: Option<u32>,
    /// At most this many admissions per period (`None`: no rate limit).
    #[serde(default)]
    pub rate: Option<RateLimit>,
}

impl QueueSpec {
    /// A queue without limits (runs are still admitted by priority).
    pub fn new(name: &str) -> Self {
        QueueSpec { name: name.to_string(), concurrency_max: None, rate: None }
    }

    /// At most `limit` runs of the queue in progress at once.
    pub fn concurrency(mut self, limit: u32) -> Self {
        self.concurrency_max = Some(limit);
        self
    }

    /// At most `limit` admissions per `period_ms`.
    pub fn rate(mut self, limit: u32, period_ms: i64) -> Self {
        self.rate = Some(RateLimit { limit, period_ms });
        self
    }

    /// The name is an identifier; limits are 1..=1,000,000 (a zero limit would never admit
    /// anything: `invalid_argument`), the period 1 ms..=366 days.
    pub fn validate(&self) -> Result<()> {
        validate_id("queue", &self.name)?;
        let limit_ok = |n: u32| (1..=QUEUE_LIMIT_MAX).contains(&n);
        if let Some(n) = self.concurrency_max {
            if !limit_ok(n) {
                return Err(Error::invalid(
                    codes::INVALID_ARGUMENT,
                    format!("concurrency_max must be 1..={QUEUE_LIMIT_MAX}, got {n}"),
                ));
            }
        }
        if let Some(rate) = self.rate {
            if !limit_ok(rate.limit) || !(1..=TIMER_MS_MAX).contains(&rate.period_ms) {
                return Err(Error::invalid(
                    codes::INVALID_ARGUMENT,
                    format!(
                        "a rate limit is 1..={QUEUE_LIMIT_MAX} runs per 1..={TIMER_MS_MAX} ms, got {} per {} ms",
                        rate.limit, rate.period_ms
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// A run waiting in a queue, with its place.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct QueuedRun {
    /// 1 for the next run to be admitted.
    pub position: u64,
    /// The run.
    pub run_id: String,
    /// Its workflow.
    pub workflow: String,
    /// Its priority.
    pub priority: i32,
    /// When it was started.
    pub created_at_ms: i64,
}

/// A queue with what is in it now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct QueueState {
    /// The declaration.
    #[serde(flatten)]
    pub spec: QueueSpec,
    /// Admitted runs not finished yet (what the concurrency limit counts).
    pub in_progress: u64,
    /// Runs admitted in the rate limit's last period (0 without a rate limit).
    pub admitted_in_period: u64,
    /// Runs waiting to be admitted.
    pub waiting: u64,
    /// The first waiting runs in admission order (at most 1,000).
    pub next: Vec<QueuedRun>,
}

/// Where queues are declared (the workflow database). Implemented by the SQLite and PostgreSQL
/// workflow stores.
pub trait QueueStore {
    /// Declare or change a queue (validated). Its runs are untouched; new limits apply from the
    /// next claim.
    fn put_queue(&mut self, spec: &QueueSpec, now_ms: i64) -> Result<QueueSpec>;
    /// A queue with its in-progress and waiting counts and its next `shown` waiting runs
    /// (at most [`QUEUE_WAITING_SHOWN_MAX`]), or `None`.
    fn queue(&self, name: &str, shown: usize, now_ms: i64) -> Result<Option<QueueState>>;
    /// Every queue with its counts (no waiting list).
    fn queues(&self, now_ms: i64) -> Result<Vec<QueueState>>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_limits_and_bad_names_are_refused() {
        QueueSpec::new("emails").concurrency(5).rate(100, 60_000).validate().unwrap();
        for bad in [
            QueueSpec::new("emails").concurrency(0),
            QueueSpec::new("emails").rate(0, 1_000),
            QueueSpec::new("emails").rate(10, 0),
            QueueSpec::new("emails").concurrency(QUEUE_LIMIT_MAX + 1),
            QueueSpec::new("bad name"),
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        let enqueue = Enqueue { queue: "q".into(), priority: -3, dedup_id: Some("bad id".into()) };
        assert_eq!(enqueue.validate().unwrap_err().code(), codes::INVALID_ID);
    }
}
