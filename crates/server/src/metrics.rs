//! Prometheus metrics (text format at `GET /metrics`; every name and its meaning is listed in
//! docs/operations.md). Counters and histograms are updated where things happen; gauges that
//! describe stored state (backlog, quarantine, open inbox records, runs by status, WAL sizes)
//! are read from every open tenant's stores at scrape time, and the SQLite busy-event count
//! from the store crate's process-wide counter.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tidemark_core::store::{DrainReport, ReceiveOutcome};
use tidemark_core::workflow::{FinishStatus, RunRecord};
use tidemark_engine::workflow::{StepAttempt, StepAttemptEnd, WorkerObserver};
use tidemark_engine::RelayReport;

use crate::stats::TenantStats;

/// The labels of a per-tenant metric.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantLabels {
    /// The tenant id.
    pub tenant: String,
}

/// The labels of a count by protocol outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// The tenant id.
    pub tenant: String,
    /// The outcome word (`accepted`, `duplicate`, `conflict`, `expired`, and for the relay also
    /// `failed` and `quarantined`).
    pub outcome: String,
}

/// The labels of a per-endpoint metric (a relay lane's).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabels {
    /// The tenant id.
    pub tenant: String,
    /// The endpoint's kind (`http`, `nats`, ...).
    pub kind: String,
    /// The endpoint, masked (it never carries credentials).
    pub endpoint: String,
}

/// The labels of a per-endpoint count by outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointOutcomeLabels {
    /// The tenant id.
    pub tenant: String,
    /// The endpoint's kind.
    pub kind: String,
    /// The endpoint, masked.
    pub endpoint: String,
    /// `accepted`, `duplicate`, `conflict`, `expired`, `failed` (quarantined ones are also
    /// counted by `tidemark_relay_deliveries_total`).
    pub outcome: String,
}

/// The labels of a per-consumer metric.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConsumerLabels {
    /// The tenant id.
    pub tenant: String,
    /// The consumer id.
    pub consumer: String,
}

/// The labels of a background loop's errors.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LoopLabels {
    /// The loop's name: `delivery` (relay and drains) or `retention`.
    pub r#loop: String,
}

impl LoopLabels {
    /// The labels of loop `name`.
    pub fn new(name: &str) -> Self {
        LoopLabels { r#loop: name.to_string() }
    }
}

/// The labels of an HTTP request count.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// The request's method (`GET`, `POST`, ...).
    pub method: String,
    /// The matched route template (`/v1/runs/{run_id}`), or `unmatched`: never the raw path, so ids
    /// do not multiply the series.
    pub route: String,
    /// The answer's HTTP status.
    pub status: u16,
}

/// The labels of a per-workflow metric.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkflowLabels {
    /// The tenant id.
    pub tenant: String,
    /// The workflow's name.
    pub workflow: String,
}

/// The labels of a per-step metric.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StepLabels {
    /// The tenant id.
    pub tenant: String,
    /// The workflow's name.
    pub workflow: String,
    /// The step's name.
    pub step: String,
}

/// The labels of a step attempt count.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StepAttemptLabels {
    /// The tenant id.
    pub tenant: String,
    /// The workflow's name.
    pub workflow: String,
    /// completed, retrying or failed.
    pub outcome: String,
}

/// The labels of a finished run's duration.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RunEndLabels {
    /// The tenant id.
    pub tenant: String,
    /// The workflow's name.
    pub workflow: String,
    /// How the run finished (`completed`, `compensated`, `failed`, `cancelled`, `parked`).
    pub status: String,
}

/// The labels of a count of runs by status.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabels {
    /// The tenant id.
    pub tenant: String,
    /// The run status.
    pub status: String,
}

/// The labels of a per-file metric.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FileLabels {
    /// The tenant id.
    pub tenant: String,
    /// The file's name within the tenant's folder.
    pub file: String,
}

/// Seconds, from 1 ms to about 9 minutes (doubling): steps and drains are milliseconds, sagas
/// with retries and timers take seconds to minutes.
fn seconds_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.001, 2.0, 20)
}

/// The workflow metrics, shared with every tenant's worker observer ([`Metrics::observer`]; the
/// families are handles to the same counters).
#[derive(Clone)]
pub struct WorkflowMetrics {
    /// `tidemark_step_seconds`: the duration of one step attempt (external: the call;
    /// transactional: its write and commit), by tenant, workflow and step.
    pub step_seconds: Family<StepLabels, Histogram, fn() -> Histogram>,
    /// `tidemark_step_attempts_total`: step attempts by outcome (completed, retrying, failed).
    pub step_attempts: Family<StepAttemptLabels, Counter>,
    /// `tidemark_step_retries_total`: step attempts that failed and were scheduled to run again.
    pub step_retries: Family<WorkflowLabels, Counter>,
    /// `tidemark_run_seconds`: a run's duration from its start to its end, by final status.
    pub run_seconds: Family<RunEndLabels, Histogram, fn() -> Histogram>,
    /// `tidemark_run_claims_total`: executions of runs claimed by this server's workers (a run
    /// resumes once per suspension).
    pub run_claims: Family<TenantLabels, Counter>,
    /// `tidemark_run_recoveries_total`: runs taken over after their previous holder's lease
    /// expired.
    pub run_recoveries: Family<TenantLabels, Counter>,
    /// `tidemark_lease_expirations_total`: leases this server's workers lost while executing a run.
    pub lease_expirations: Family<TenantLabels, Counter>,
}

fn seconds_histogram() -> Histogram {
    Histogram::new(seconds_buckets())
}

impl WorkflowMetrics {
    fn new() -> Self {
        WorkflowMetrics {
            step_seconds: Family::new_with_constructor(seconds_histogram),
            step_attempts: Family::default(),
            step_retries: Family::default(),
            run_seconds: Family::new_with_constructor(seconds_histogram),
            run_claims: Family::default(),
            run_recoveries: Family::default(),
            lease_expirations: Family::default(),
        }
    }
}

/// Every metric `tidemark serve` keeps, in one Prometheus registry (names prefixed `tidemark_`).
/// Counters and histograms live here; the gauges of stored state are read at each scrape.
pub struct Metrics {
    registry: Registry,
    /// `tidemark_relay_deliveries_total`: deliveries attempted by the relay, by tenant and outcome.
    pub relay_deliveries: Family<OutcomeLabels, Counter>,
    /// `tidemark_endpoint_deliveries_total`: deliveries to a network endpoint, by outcome.
    pub endpoint_deliveries: Family<EndpointOutcomeLabels, Counter>,
    /// `tidemark_endpoint_batch_seconds`: how long one batch to a network endpoint took (until its
    /// answers, a failure or the timeout).
    pub endpoint_batch_seconds: Family<EndpointLabels, Histogram>,
    /// `tidemark_inbox_receipts_total`: events received into an inbox over HTTP, by tenant and
    /// outcome.
    pub inbox_receipts: Family<OutcomeLabels, Counter>,
    /// `tidemark_inbox_applies_total`: events applied by a consumer's handler, by tenant and
    /// consumer.
    pub applies: Family<ConsumerLabels, Counter>,
    /// `tidemark_drain_seconds`: the duration of one drain transaction that applied something.
    pub drain_seconds: Family<TenantLabels, Histogram>,
    /// `tidemark_http_requests_total`: HTTP requests answered, by method, route and status.
    pub requests: Family<RequestLabels, Counter>,
    /// `tidemark_rate_limited_total`: requests refused by a token's rate limit (429).
    pub rate_limited: Counter,
    /// `tidemark_loop_errors_total`: background loop rounds that failed, by loop.
    pub loop_errors: Family<LoopLabels, Counter>,
    /// The workflow metrics, shared with every tenant's worker observer.
    pub workflows: WorkflowMetrics,
    /// Scrapes whose reading of a tenant's stores failed (that tenant's gauges are missing).
    pub scrape_errors: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every metric registered and at zero.
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("tidemark");
        let relay_deliveries = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "relay_deliveries",
            "Deliveries attempted by the relay, by outcome (accepted, duplicate, conflict, expired, failed, quarantined)",
            relay_deliveries.clone(),
        );
        let endpoint_deliveries = Family::<EndpointOutcomeLabels, Counter>::default();
        registry.register(
            "endpoint_deliveries",
            "Deliveries to a network endpoint by its relay lane, by outcome",
            endpoint_deliveries.clone(),
        );
        let endpoint_batch_seconds = Family::<EndpointLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.0005, 2.0, 16))
        });
        registry.register(
            "endpoint_batch_seconds",
            "Duration of one batch to a network endpoint (until its answers, a failure or the attempt timeout)",
            endpoint_batch_seconds.clone(),
        );
        let inbox_receipts = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "inbox_receipts",
            "Events received into an inbox over HTTP, by outcome",
            inbox_receipts.clone(),
        );
        let applies = Family::<ConsumerLabels, Counter>::default();
        registry.register("inbox_applies", "Inbox events applied by a consumer's handler", applies.clone());
        let drain_seconds = Family::<TenantLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.0005, 2.0, 14))
        });
        registry.register("drain_seconds", "Duration of one drain transaction", drain_seconds.clone());
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register("http_requests", "HTTP requests answered, by route and status", requests.clone());
        let rate_limited = Counter::default();
        registry.register("rate_limited", "Requests refused by a token's rate limit", rate_limited.clone());
        let loop_errors = Family::<LoopLabels, Counter>::default();
        registry.register("loop_errors", "Background loop rounds that failed", loop_errors.clone());
        let workflows = WorkflowMetrics::new();
        registry.register(
            "step_seconds",
            "Duration of one step attempt (external: the call; transactional: its write and commit)",
            workflows.step_seconds.clone(),
        );
        registry.register(
            "step_attempts",
            "Step attempts by outcome (completed, retrying, failed)",
            workflows.step_attempts.clone(),
        );
        registry.register(
            "step_retries",
            "Step attempts that failed and were scheduled to run again",
            workflows.step_retries.clone(),
        );
        registry.register(
            "run_seconds",
            "Duration of a run (a saga) from its start to its end, by final status",
            workflows.run_seconds.clone(),
        );
        registry.register(
            "run_claims",
            "Executions of runs claimed by this server's workers (a run resumes once per suspension)",
            workflows.run_claims.clone(),
        );
        registry.register(
            "run_recoveries",
            "Runs taken over after their previous holder's lease expired (it crashed or stalled)",
            workflows.run_recoveries.clone(),
        );
        registry.register(
            "lease_expirations",
            "Leases this server's workers lost while executing a run (expired and taken, or taken by an operator)",
            workflows.lease_expirations.clone(),
        );
        let scrape_errors = Counter::default();
        registry.register(
            "scrape_errors",
            "Scrapes that could not read a tenant's stores (its gauges are missing from that scrape)",
            scrape_errors.clone(),
        );
        Metrics {
            registry,
            relay_deliveries,
            endpoint_deliveries,
            endpoint_batch_seconds,
            inbox_receipts,
            applies,
            drain_seconds,
            requests,
            rate_limited,
            loop_errors,
            workflows,
            scrape_errors,
        }
    }

    /// Count one lane batch's deliveries to `endpoint` by outcome, and how long it took.
    pub fn record_lane(&self, tenant: &str, kind: &str, endpoint: &str, report: &RelayReport, took: Duration) {
        for (outcome, n) in [
            ("accepted", report.accepted),
            ("duplicate", report.duplicate),
            ("conflict", report.conflict),
            ("expired", report.expired),
            ("failed", report.failed),
        ] {
            if n > 0 {
                let labels = EndpointOutcomeLabels {
                    tenant: tenant.into(),
                    kind: kind.into(),
                    endpoint: endpoint.into(),
                    outcome: outcome.into(),
                };
                self.endpoint_deliveries.get_or_create(&labels).inc_by(n);
            }
        }
        let labels = EndpointLabels { tenant: tenant.into(), kind: kind.into(), endpoint: endpoint.into() };
        self.endpoint_batch_seconds.get_or_create(&labels).observe(took.as_secs_f64());
    }

    /// Count one relay pass's deliveries by outcome.
    pub fn record_relay(&self, tenant: &str, report: &RelayReport) {
        for (outcome, n) in [
            ("accepted", report.accepted),
            ("duplicate", report.duplicate),
            ("conflict", report.conflict),
            ("expired", report.expired),
            ("failed", report.failed),
            ("quarantined", report.quarantined),
        ] {
            if n > 0 {
                let labels = OutcomeLabels { tenant: tenant.into(), outcome: outcome.into() };
                self.relay_deliveries.get_or_create(&labels).inc_by(n);
            }
        }
    }

    /// Count one event received over HTTP by its outcome.
    pub fn record_receive(&self, tenant: &str, outcome: &ReceiveOutcome) {
        let labels = OutcomeLabels { tenant: tenant.into(), outcome: outcome.word().into() };
        self.inbox_receipts.get_or_create(&labels).inc();
    }

    /// Count one drain's applied events and time it (drains that applied nothing are not timed).
    pub fn record_drain(&self, tenant: &str, consumer: &str, report: &DrainReport, took: Duration) {
        if report.applied > 0 {
            let labels = ConsumerLabels { tenant: tenant.into(), consumer: consumer.into() };
            self.applies.get_or_create(&labels).inc_by(report.applied);
            self.drain_seconds.get_or_create(&TenantLabels { tenant: tenant.into() }).observe(took.as_secs_f64());
        }
    }

    /// The observer of one tenant's workflow worker.
    pub fn observer(&self, tenant: &str) -> Arc<dyn WorkerObserver> {
        Arc::new(TenantObserver { tenant: tenant.to_string(), metrics: self.workflows.clone() })
    }

    /// The registered metrics in the Prometheus text format, followed by the gauges read at
    /// scrape time from `stats` (one per open tenant) and the SQLite busy-event count.
    pub fn encode(&self, stats: &[TenantStats]) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode_registry(&mut out, &self.registry).expect("writing to a String");
        let scraped = scrape_registry(stats, tidemark_store_sqlite::busy_events());
        prometheus_client::encoding::text::encode_registry(&mut out, &scraped).expect("writing to a String");
        prometheus_client::encoding::text::encode_eof(&mut out).expect("writing to a String");
        out
    }
}

/// The text of `GET /metrics`: the counters, and the gauges of every open tenant read now.
/// A tenant whose stores cannot be read is left out of this scrape (and counted).
pub async fn scrape(state: &crate::AppState) -> String {
    let mut stats = Vec::new();
    for tenant in state.open_tenants().await {
        match tenant.stats().await {
            Ok(s) => stats.push(s),
            Err(error) => {
                state.metrics.scrape_errors.inc();
                tracing::warn!(tenant = %tenant.id(), code = error.code(), %error, "cannot read a tenant's counts for /metrics");
            }
        }
    }
    stats.sort_by(|a, b| a.tenant.cmp(&b.tenant));
    state.metrics.encode(&stats)
}

/// A registry of the values read at scrape time (built anew for every scrape).
fn scrape_registry(stats: &[TenantStats], busy_events: u64) -> Registry {
    let mut registry = Registry::with_prefix("tidemark");
    let outbox_pending = Family::<TenantLabels, Gauge>::default();
    let outbox_due = Family::<TenantLabels, Gauge>::default();
    let outbox_quarantined = Family::<TenantLabels, Gauge>::default();
    let outbox_oldest = Family::<TenantLabels, Gauge<f64, AtomicU64>>::default();
    let inbox_pending = Family::<ConsumerLabels, Gauge>::default();
    let inbox_blocked = Family::<ConsumerLabels, Gauge>::default();
    let runs = Family::<StatusLabels, Gauge>::default();
    let wal_bytes = Family::<FileLabels, Gauge>::default();
    let now_ms = crate::now_ms();
    let gauge = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    for s in stats {
        let tenant = TenantLabels { tenant: s.tenant.clone() };
        outbox_pending.get_or_create(&tenant).set(gauge(s.outbox.pending));
        outbox_due.get_or_create(&tenant).set(gauge(s.outbox.due));
        outbox_quarantined.get_or_create(&tenant).set(gauge(s.outbox.quarantined));
        let age_ms = s.outbox.oldest_pending_ms.map_or(0, |at| now_ms.saturating_sub(at).max(0));
        outbox_oldest.get_or_create(&tenant).set(age_ms as f64 / 1_000.0);
        for (consumer, counts) in &s.inbox {
            let labels = ConsumerLabels { tenant: s.tenant.clone(), consumer: consumer.clone() };
            inbox_pending.get_or_create(&labels).set(gauge(counts.pending));
            inbox_blocked.get_or_create(&labels).set(gauge(counts.blocked));
        }
        for (status, n) in &s.runs {
            runs.get_or_create(&StatusLabels { tenant: s.tenant.clone(), status: status.clone() }).set(gauge(*n));
        }
        for (file, bytes) in &s.wal_bytes {
            let labels = FileLabels { tenant: s.tenant.clone(), file: file.clone() };
            wal_bytes.get_or_create(&labels).set(gauge(*bytes));
        }
    }
    registry.register("outbox_pending", "Outbox deliveries not yet accepted (the backlog)", outbox_pending);
    registry.register("outbox_due", "Backlog deliveries due now (not waiting for a retry back-off)", outbox_due);
    registry.register(
        "outbox_quarantined",
        "Deliveries quarantined after max_attempts (waiting for an operator)",
        outbox_quarantined,
    );
    registry.register(
        "outbox_oldest_pending_age_seconds",
        "Age of the oldest event with a pending delivery (0 without backlog)",
        outbox_oldest,
    );
    registry.register("inbox_pending", "Inbox records received and not applied yet, per consumer", inbox_pending);
    registry.register(
        "inbox_blocked",
        "Inbox records blocked (their handler refused them; the flow waits for an operator), per consumer",
        inbox_blocked,
    );
    registry.register("runs", "Workflow runs by status", runs);
    registry.register("wal_bytes", "Size of each database file's write-ahead log", wal_bytes);
    registry.register(
        "sqlite_busy_events",
        "Times a statement of this process waited for another connection's lock",
        ConstCounter::new(busy_events),
    );
    registry
}

/// Counts and times one tenant's workflow steps and runs, and logs their ends.
struct TenantObserver {
    tenant: String,
    metrics: WorkflowMetrics,
}

impl TenantObserver {
    fn tenant(&self) -> TenantLabels {
        TenantLabels { tenant: self.tenant.clone() }
    }
}

impl WorkerObserver for TenantObserver {
    fn run_claimed(&self, run: &RunRecord, recovered: bool) {
        self.metrics.run_claims.get_or_create(&self.tenant()).inc();
        if recovered {
            self.metrics.run_recoveries.get_or_create(&self.tenant()).inc();
            tracing::info!(tenant = %self.tenant, run_id = %run.run_id, workflow = %run.workflow,
                recoveries = run.recoveries, "run recovered after an expired lease");
        } else {
            tracing::debug!(tenant = %self.tenant, run_id = %run.run_id, workflow = %run.workflow,
                status = run.status.as_str(), "run claimed");
        }
    }

    fn step_attempted(&self, attempt: &StepAttempt<'_>) {
        let m = &self.metrics;
        let (tenant, workflow) = (self.tenant.clone(), attempt.workflow.to_string());
        let labels = StepLabels { tenant: tenant.clone(), workflow: workflow.clone(), step: attempt.step.to_string() };
        m.step_seconds.get_or_create(&labels).observe(attempt.took.as_secs_f64());
        let outcome = attempt.end.as_str().to_string();
        let attempts = StepAttemptLabels { tenant: tenant.clone(), workflow: workflow.clone(), outcome };
        m.step_attempts.get_or_create(&attempts).inc();
        match attempt.end {
            StepAttemptEnd::Completed => {}
            StepAttemptEnd::Retrying => {
                m.step_retries.get_or_create(&WorkflowLabels { tenant, workflow }).inc();
                tracing::debug!(tenant = %self.tenant, run_id = attempt.run_id, workflow = attempt.workflow,
                    step = attempt.step, attempt = attempt.attempt, "step attempt failed; retrying");
            }
            StepAttemptEnd::Failed => {
                tracing::info!(tenant = %self.tenant, run_id = attempt.run_id, workflow = attempt.workflow,
                    step = attempt.step, attempt = attempt.attempt, "step failed for good");
            }
        }
    }

    fn run_finished(&self, run: &RunRecord, status: FinishStatus, run_ms: i64) {
        let status_word = status.run_status().as_str();
        let labels =
            RunEndLabels { tenant: self.tenant.clone(), workflow: run.workflow.clone(), status: status_word.into() };
        self.metrics.run_seconds.get_or_create(&labels).observe(run_ms.max(0) as f64 / 1_000.0);
        tracing::debug!(tenant = %self.tenant, run_id = %run.run_id, workflow = %run.workflow,
            status = status_word, run_ms, "run finished");
    }

    fn lease_lost(&self, run_id: &str) {
        self.metrics.lease_expirations.get_or_create(&self.tenant()).inc();
        tracing::warn!(tenant = %self.tenant, run_id, "lost the lease of a running run; dropped it");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidemark_store_sqlite::stats::{InboxCounts, OutboxCounts};

    fn value_of(text: &str, series: &str) -> Option<f64> {
        text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn scrape_time_gauges_are_encoded_per_tenant_consumer_status_and_file() {
        let mut stats = TenantStats {
            tenant: "acme".into(),
            outbox: OutboxCounts { pending: 7, due: 3, quarantined: 2, oldest_pending_ms: None, last_position: 9 },
            ..TenantStats::default()
        };
        stats.inbox.insert("ledger".into(), InboxCounts { pending: 4, blocked: 1 });
        stats.runs.insert("completed".into(), 5);
        stats.wal_bytes.insert("producer.db".into(), 4096);
        let metrics = Metrics::new();
        let text = metrics.encode(&[stats]);
        for (series, value) in [
            ("tidemark_outbox_pending{tenant=\"acme\"}", 7.0),
            ("tidemark_outbox_due{tenant=\"acme\"}", 3.0),
            ("tidemark_outbox_quarantined{tenant=\"acme\"}", 2.0),
            ("tidemark_outbox_oldest_pending_age_seconds{tenant=\"acme\"}", 0.0),
            ("tidemark_inbox_pending{tenant=\"acme\",consumer=\"ledger\"}", 4.0),
            ("tidemark_inbox_blocked{tenant=\"acme\",consumer=\"ledger\"}", 1.0),
            ("tidemark_runs{tenant=\"acme\",status=\"completed\"}", 5.0),
            ("tidemark_wal_bytes{tenant=\"acme\",file=\"producer.db\"}", 4096.0),
        ] {
            assert_eq!(value_of(&text, series), Some(value), "{series} in\n{text}");
        }
        assert!(value_of(&text, "tidemark_sqlite_busy_events_total").is_some(), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn the_observer_counts_attempts_retries_recoveries_and_run_durations() {
        let metrics = Metrics::new();
        let observer = metrics.observer("acme");
        let attempt = |end| StepAttempt {
            run_id: "r1",
            workflow: "order_saga",
            step: "charge_payment",
            attempt: 1,
            began: std::time::Instant::now(),
            took: Duration::from_millis(3),
            end,
        };
        observer.step_attempted(&attempt(StepAttemptEnd::Retrying));
        observer.step_attempted(&attempt(StepAttemptEnd::Completed));
        let run = RunRecord {
            run_id: "r1".into(),
            workflow: "order_saga".into(),
            version: 1,
            input: serde_json::Value::Null,
            key: None,
            status: tidemark_core::workflow::RunStatus::Running,
            result: None,
            error: None,
            wake_at_ms: 0,
            waiting_for: None,
            cancel_requested: false,
            forked_from: None,
            parent_run_id: None,
            queue: None,
            priority: None,
            admitted_at_ms: None,
            deadline_ms: None,
            lease_owner: None,
            lease_expires_at_ms: None,
            recoveries: 1,
            created_at_ms: 0,
            updated_at_ms: 0,
        };
        observer.run_claimed(&run, true);
        observer.run_finished(&run, FinishStatus::Compensated, 2_500);
        observer.lease_lost("r2");
        let text = metrics.encode(&[]);
        for (series, value) in [
            ("tidemark_step_attempts_total{tenant=\"acme\",workflow=\"order_saga\",outcome=\"retrying\"}", 1.0),
            ("tidemark_step_attempts_total{tenant=\"acme\",workflow=\"order_saga\",outcome=\"completed\"}", 1.0),
            ("tidemark_step_retries_total{tenant=\"acme\",workflow=\"order_saga\"}", 1.0),
            ("tidemark_step_seconds_count{tenant=\"acme\",workflow=\"order_saga\",step=\"charge_payment\"}", 2.0),
            ("tidemark_run_claims_total{tenant=\"acme\"}", 1.0),
            ("tidemark_run_recoveries_total{tenant=\"acme\"}", 1.0),
            ("tidemark_lease_expirations_total{tenant=\"acme\"}", 1.0),
            ("tidemark_run_seconds_sum{tenant=\"acme\",workflow=\"order_saga\",status=\"compensated\"}", 2.5),
            ("tidemark_run_seconds_count{tenant=\"acme\",workflow=\"order_saga\",status=\"compensated\"}", 1.0),
        ] {
            assert_eq!(value_of(&text, series), Some(value), "{series} in\n{text}");
        }
    }
}
