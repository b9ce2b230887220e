//! The overview's time series: every [`SAMPLE_INTERVAL_MS`] a background task reads each open
//! tenant's [`TenantStats`] and the applies counter, and keeps the last [`SAMPLES_MAX`] samples
//! per tenant in memory (a ring buffer; lost at restart, which is fine for "the last few
//! minutes"). Rates (applies/s, runs completed/s) are differences between samples.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use serde_json::json;

use crate::metrics::ConsumerLabels;
use crate::AppState;

/// How often the sampler reads the counts.
pub const SAMPLE_INTERVAL_MS: u64 = 2_000;
/// Samples kept per tenant: 180 x 2 s = the last 6 minutes.
pub const SAMPLES_MAX: usize = 180;

/// One tenant's counts at one time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sample {
    pub at_ms: i64,
    pub backlog: u64,
    pub quarantined: u64,
    pub blocked: u64,
    /// Runs parked or failed (waiting for an operator).
    pub parked: u64,
    /// Inbox events applied since the server started (all the tenant's consumers).
    pub applied_total: u64,
    /// Runs in status `completed` (a gauge: retention purges old ones).
    pub completed_runs: u64,
}

/// The ring buffers of every tenant, keyed by tenant id (a page reads only its caller's).
#[derive(Default)]
pub struct Samples(Mutex<HashMap<String, VecDeque<Sample>>>);

impl Samples {
    pub fn push(&self, tenant: &str, sample: Sample) {
        let mut all = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let ring = all.entry(tenant.to_string()).or_insert_with(|| VecDeque::with_capacity(SAMPLES_MAX));
        if ring.len() == SAMPLES_MAX {
            ring.pop_front();
        }
        ring.push_back(sample);
        debug_assert!(ring.len() <= SAMPLES_MAX);
    }

    /// The tenant's samples, oldest first.
    pub fn series(&self, tenant: &str) -> Vec<Sample> {
        let all = self.0.lock().unwrap_or_else(|p| p.into_inner());
        all.get(tenant).map(|ring| ring.iter().copied().collect()).unwrap_or_default()
    }
}

/// Per-second rate of a counter between consecutive samples (one value per pair). A counter
/// that went down (a restart, or retention purging completed runs) counts as 0 for that step.
pub fn rates(samples: &[Sample], counter: fn(&Sample) -> u64) -> Vec<f64> {
    samples
        .windows(2)
        .map(|pair| {
            let seconds = (pair[1].at_ms - pair[0].at_ms).max(1) as f64 / 1000.0;
            counter(&pair[1]).saturating_sub(counter(&pair[0])) as f64 / seconds
        })
        .collect()
}

/// The average rate over the samples of the last `window_ms` (None with fewer than two).
pub fn recent_rate(samples: &[Sample], window_ms: i64, counter: fn(&Sample) -> u64) -> Option<f64> {
    let last = samples.last()?;
    let first = samples.iter().find(|s| s.at_ms >= last.at_ms - window_ms)?;
    if first.at_ms >= last.at_ms {
        return None;
    }
    let total: u64 = samples
        .windows(2)
        .filter(|pair| pair[0].at_ms >= first.at_ms)
        .map(|pair| counter(&pair[1]).saturating_sub(counter(&pair[0])))
        .sum();
    Some(total as f64 * 1000.0 / (last.at_ms - first.at_ms) as f64)
}

/// Read one tenant's sample.
pub async fn sample(state: &AppState, tenant: &crate::AnyTenant) -> tidemark_core::Result<Sample> {
    let stats = tenant.stats().await?;
    let consumers = state.consumers(tenant.id())?;
    let applied_total = consumers
        .iter()
        .map(|c| {
            let labels = ConsumerLabels { tenant: tenant.id().to_string(), consumer: c.consumer_id.clone() };
            state.metrics.applies.get_or_create(&labels).get()
        })
        .sum();
    Ok(Sample {
        at_ms: crate::now_ms(),
        backlog: stats.outbox.pending,
        quarantined: stats.outbox.quarantined,
        blocked: stats.blocked(),
        parked: stats.parked(),
        applied_total,
        completed_runs: stats.runs.get("completed").copied().unwrap_or(0),
    })
}

/// Start the sampler; it stops when shutdown begins and is joined with the other loops.
pub fn start(state: AppState) {
    let handle = tokio::spawn(run(state.clone()));
    state.tasks.lock().unwrap_or_else(|p| p.into_inner()).push(("dashboard/sampler".to_string(), handle));
}

async fn run(state: AppState) -> serde_json::Value {
    let mut signal = state.shutdown_signal();
    let (mut rounds, mut errors) = (0_u64, 0_u64);
    loop {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(SAMPLE_INTERVAL_MS)) => {}
            _ = signal.changed() => {}
        }
        if state.is_shutting_down() {
            break;
        }
        rounds += 1;
        for tenant in state.open_tenants().await {
            match sample(&state, &tenant).await {
                Ok(sample) => state.samples.push(tenant.id(), sample),
                Err(error) => {
                    errors += 1;
                    tracing::warn!(tenant = %tenant.id(), code = error.code(), %error, "dashboard sample failed");
                }
            }
        }
    }
    json!({"rounds": rounds, "errors": errors})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(at_ms: i64, applied_total: u64) -> Sample {
        Sample { at_ms, applied_total, ..Sample::default() }
    }

    #[test]
    fn the_ring_keeps_the_last_samples() {
        let samples = Samples::default();
        for i in 0..(SAMPLES_MAX as i64 + 5) {
            samples.push("a", at(i, 0));
        }
        let series = samples.series("a");
        assert_eq!(series.len(), SAMPLES_MAX);
        assert_eq!(series[0].at_ms, 5);
        assert!(samples.series("b").is_empty(), "tenants are kept apart");
    }

    #[test]
    fn rates_are_per_second_and_never_negative() {
        let series = [at(0, 0), at(2_000, 10), at(4_000, 4), at(6_000, 10)];
        assert_eq!(rates(&series, |s| s.applied_total), vec![5.0, 0.0, 3.0]);
        assert_eq!(recent_rate(&series, 60_000, |s| s.applied_total), Some(16.0 / 6.0));
        assert_eq!(recent_rate(&series[..1], 60_000, |s| s.applied_total), None);
    }
}
