//! Prometheus metrics (text format at `GET /metrics`). Counters are updated where things happen;
//! gauges that describe stored state are read from the stores at scrape time.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tidemark_core::store::{DrainReport, ReceiveOutcome};
use tidemark_engine::RelayReport;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantLabels {
    pub tenant: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub tenant: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConsumerLabels {
    pub tenant: String,
    pub consumer: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LoopLabels {
    pub r#loop: String,
}

impl LoopLabels {
    pub fn new(name: &str) -> Self {
        LoopLabels { r#loop: name.to_string() }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub method: String,
    pub route: String,
    pub status: u16,
}

pub struct Metrics {
    registry: Registry,
    pub relay_deliveries: Family<OutcomeLabels, Counter>,
    pub inbox_receipts: Family<OutcomeLabels, Counter>,
    pub applies: Family<ConsumerLabels, Counter>,
    pub drain_seconds: Family<TenantLabels, Histogram>,
    pub requests: Family<RequestLabels, Counter>,
    pub rate_limited: Counter,
    pub loop_errors: Family<LoopLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("tidemark");
        let relay_deliveries = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "relay_deliveries",
            "Deliveries attempted by the relay, by outcome (accepted, duplicate, conflict, expired, failed, quarantined)",
            relay_deliveries.clone(),
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
        Metrics {
            registry,
            relay_deliveries,
            inbox_receipts,
            applies,
            drain_seconds,
            requests,
            rate_limited,
            loop_errors,
        }
    }

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

    pub fn record_receive(&self, tenant: &str, outcome: &ReceiveOutcome) {
        let labels = OutcomeLabels { tenant: tenant.into(), outcome: outcome.word().into() };
        self.inbox_receipts.get_or_create(&labels).inc();
    }

    pub fn record_drain(&self, tenant: &str, consumer: &str, report: &DrainReport, took: Duration) {
        if report.applied > 0 {
            let labels = ConsumerLabels { tenant: tenant.into(), consumer: consumer.into() };
            self.applies.get_or_create(&labels).inc_by(report.applied);
            self.drain_seconds.get_or_create(&TenantLabels { tenant: tenant.into() }).observe(took.as_secs_f64());
        }
    }

    /// The registered metrics in the Prometheus text format, followed by `extra` (gauges read at
    /// scrape time, already encoded).
    pub fn encode(&self, extra: &str) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode_registry(&mut out, &self.registry).expect("writing to a String");
        out.push_str(extra);
        prometheus_client::encoding::text::encode_eof(&mut out).expect("writing to a String");
        out
    }
}
