//! The tidemark service: your flow machines, consumer handlers and workflows, served for every
//! tenant with the relay, the consumers' drains, the workflow worker and retention running
//! behind them, and the HTTP API, the dashboard and `/metrics` in front. Build one with
//! [`Service::builder`]; `tidemark serve` is that builder with the built-ins registered.
//!
//! Code map: `service.rs` (the builder and the service's entry points), `registry.rs` (what it
//! serves), `config.rs` (layered configuration), `auth.rs` (tokens, scopes, rate limits),
//! `tenant.rs` (a tenant's files and store threads), `actor.rs` (a store thread with group
//! commit), `background.rs` (the loops), `lanes.rs` (a relay lane per network endpoint), `sources.rs` (brokers consumed into inboxes), `api/` (HTTP routes and the error mapping),
//! `metrics.rs` (Prometheus), `dashboard/` (the HTML pages under `/ui` and their sampler).
#![warn(missing_docs)]

mod actor;
pub mod api;
mod auth;
pub mod backend;
mod background;
pub mod config;
mod dashboard;
pub mod fuzz;
pub mod lanes;
pub mod metrics;
pub mod registry;
mod service;
mod sources;
pub mod stats;
pub mod tenant;
mod trace;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use governor::DefaultKeyedRateLimiter;
use tidemark_core::{Error, Result};
use tokio::sync::watch;

pub use auth::{AnyCaller, Caller};
pub use backend::{AnyTenant, Backend, Postgres, Sqlite};
pub use config::{Config, Overrides};
pub use registry::{Database, Registrations, Registry, TenantInfo};
pub use service::{Service, ServiceBuilder};
pub use tenant::Tenant;
/// The `axum`, `utoipa` and `utoipa_axum` the service is built with (for routes of your own).
pub use {axum, utoipa, utoipa_axum};

/// The file of tokens, tenants and consumers, in the data folder.
pub const CONTROL_FILE: &str = "server.db";

/// Milliseconds since the Unix epoch, from the system clock: the clock of every request and loop.
pub fn now_ms() -> i64 {
    tidemark_engine::now_ms()
}

/// Shared by every request handler and background loop.
#[derive(Clone)]
pub struct AppState(Arc<Inner>);

/// What every request handler and background loop shares, behind [`AppState`].
pub struct Inner {
    /// The configuration the service was started with.
    pub config: Config,
    /// What the service serves.
    pub registry: Arc<Registry>,
    /// Opens a tenant on the service's backend with its registrations.
    opener: Box<dyn OpenTenant>,
    /// The control database (tokens, tenants, consumers) and the token cache read from it.
    pub control_cache: Mutex<auth::ControlCache>,
    /// Is a check of the control database a network round trip (PostgreSQL)?
    control_remote: bool,
    /// The per-token rate limiter (`auth.rate_per_second`, `auth.burst`).
    pub limiter: DefaultKeyedRateLimiter<String>,
    /// The Prometheus registry and the counters and histograms the service keeps.
    pub metrics: metrics::Metrics,
    /// The dashboard's recent samples per tenant.
    pub samples: dashboard::Samples,
    tenants: tokio::sync::Mutex<HashMap<String, AnyTenant>>,
    /// `true` once shutdown began: stop claiming, finish, release.
    shutdown: watch::Sender<bool>,
    ready: std::sync::atomic::AtomicBool,
    /// The background loops, joined at shutdown.
    tasks: Mutex<Vec<(String, tokio::task::JoinHandle<serde_json::Value>)>>,
    started_at_ms: i64,
}

impl std::ops::Deref for AppState {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

impl AppState {
    /// Open the data folder (created on first start, never reset) and its control database; the
    /// tenants of the service's backend `B` open with `registrations`.
    pub fn open<B: Backend>(
        config: Config,
        registry: Registry,
        registrations: Registrations<B>,
        backend: B,
    ) -> Result<AppState> {
        std::fs::create_dir_all(&config.data_dir)
            .map_err(|e| Error::io(format!("cannot create {}: {e}", config.data_dir.display())))?;
        let control = backend.open_control(&config)?;
        let limiter = auth::rate_limiter(config.auth.rate_per_second, config.auth.burst);
        let (shutdown, _) = watch::channel(false);
        let control_remote = control.is_remote();
        Ok(AppState(Arc::new(Inner {
            control_cache: Mutex::new(auth::ControlCache::new(control)?),
            control_remote,
            limiter,
            metrics: metrics::Metrics::new(),
            samples: dashboard::Samples::default(),
            tenants: tokio::sync::Mutex::new(HashMap::new()),
            shutdown,
            ready: std::sync::atomic::AtomicBool::new(false),
            tasks: Mutex::new(Vec::new()),
            started_at_ms: now_ms(),
            config,
            registry: Arc::new(registry),
            opener: Box::new(TenantOpener { registrations, backend: Arc::new(backend) }),
        })))
    }

    /// Run `f` with the control database.
    pub fn control<R>(&self, f: impl FnOnce(&mut dyn tidemark_core::tenancy::ControlStore) -> Result<R>) -> Result<R> {
        f(self.control_cache.lock().unwrap_or_else(|p| p.into_inner()).control())
    }

    /// The consumers declared for a tenant (from the control cache: no query unless the control
    /// database changed).
    pub fn consumers(&self, tenant_id: &str) -> Result<Vec<tidemark_core::tenancy::ConsumerRecord>> {
        let arrived = std::time::Instant::now();
        self.control_cache.lock().unwrap_or_else(|p| p.into_inner()).consumers(tenant_id, arrived)
    }

    /// The tenant, opened (and its background loops started) on first use.
    pub async fn tenant(&self, id: &str) -> Result<AnyTenant> {
        let mut tenants = self.tenants.lock().await;
        if let Some(tenant) = tenants.get(id) {
            return Ok(tenant.clone());
        }
        if *self.shutdown.borrow() {
            return Err(Error::invalid(tidemark_core::error::codes::UNAVAILABLE, "the server is shutting down"));
        }
        let (state, id_owned, observer) = (self.clone(), id.to_string(), self.metrics.observer(id));
        let tenant =
            tokio::task::spawn_blocking(move || state.opener.open(&state.config, &id_owned, now_ms, Some(observer)))
                .await
                .map_err(|e| Error::Invariant(format!("opening a tenant panicked: {e}")))??;
        self.control(|c| c.ensure_tenant(id, now_ms()))?;
        on_tenant!(&tenant, opened => {
            self.declare_registered_consumers(opened).await?;
            background::start(self.clone(), opened.clone());
            tracing::info!(tenant = id, dir = %opened.dir.display(), "tenant opened");
        });
        tenants.insert(id.to_string(), tenant.clone());
        Ok(tenant)
    }

    /// Declare (once) the consumers the registry names in this tenant, and subscribe each (unless
    /// its events come from other services only) to the tenant's outboxes (the producer's and the
    /// workflow database's) from their first event; then subscribe the registry's network
    /// endpoints to both outboxes, from their first event too (again: nothing; another endpoint
    /// than the stored one: the subscription moves there).
    async fn declare_registered_consumers<B: Backend>(&self, tenant: &Arc<Tenant<B>>) -> Result<()> {
        for consumer in &self.registry.consumers {
            let database = self.registry.handler_database(&consumer.handler)?;
            self.control(|c| c.declare_consumer(&tenant.id, &consumer.consumer_id, &consumer.handler, now_ms()))?;
            if !consumer.subscribe {
                continue;
            }
            for outbox in tenant.outboxes() {
                let subscription = tidemark_core::store::Subscription {
                    consumer_id: consumer.consumer_id.clone(),
                    endpoint: tenant.endpoint(database),
                };
                outbox
                    .call(move |p| {
                        use tidemark_core::store::ProducerStore;
                        if p.store.subscriptions()?.iter().any(|s| s.consumer_id == subscription.consumer_id) {
                            return Ok(0);
                        }
                        p.store.subscribe(&subscription, true, now_ms())
                    })
                    .await?;
            }
        }
        for subscription in &self.registry.subscriptions {
            for outbox in tenant.outboxes() {
                let subscription = subscription.clone();
                outbox
                    .call(move |p| {
                        use tidemark_core::store::ProducerStore;
                        p.store.subscribe(&subscription, true, now_ms())
                    })
                    .await?;
            }
        }
        Ok(())
    }

    /// Every tenant opened so far.
    pub async fn open_tenants(&self) -> Vec<AnyTenant> {
        self.tenants.lock().await.values().cloned().collect()
    }

    /// A receiver that turns `true` when shutdown begins (loops stop claiming, finish and release).
    pub fn shutdown_signal(&self) -> watch::Receiver<bool> {
        self.shutdown.subscribe()
    }

    /// True once shutdown has begun.
    pub fn is_shutting_down(&self) -> bool {
        *self.shutdown.borrow()
    }

    /// True when the service answers `/readyz` with ready: started and not shutting down.
    pub fn is_ready(&self) -> bool {
        self.ready.load(std::sync::atomic::Ordering::SeqCst) && !self.is_shutting_down()
    }

    /// When the service started, in ms since the Unix epoch.
    pub fn started_at_ms(&self) -> i64 {
        self.started_at_ms
    }
}

/// Opens a tenant of one backend with the service's registrations on it.
trait OpenTenant: Send + Sync {
    fn open(
        &self,
        config: &Config,
        id: &str,
        clock: fn() -> i64,
        observer: Option<Arc<dyn tidemark_engine::workflow::WorkerObserver>>,
    ) -> Result<AnyTenant>;
}

struct TenantOpener<B: Backend> {
    registrations: Registrations<B>,
    backend: Arc<B>,
}

impl<B: Backend> OpenTenant for TenantOpener<B> {
    fn open(
        &self,
        config: &Config,
        id: &str,
        clock: fn() -> i64,
        observer: Option<Arc<dyn tidemark_engine::workflow::WorkerObserver>>,
    ) -> Result<AnyTenant> {
        let tenant = Tenant::open(config, &self.registrations, self.backend.clone(), id, clock, observer)?;
        Ok(B::wrap(Arc::new(tenant)))
    }
}

/// What has to outlive the server for its logs to reach their destinations: with the `otel`
/// feature and `log.otlp_endpoint`, the span exporter, flushed when this is dropped.
pub struct LogGuard {
    #[cfg(feature = "otel")]
    otel: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Drop for LogGuard {
    fn drop(&mut self) {
        #[cfg(feature = "otel")]
        if let Some(provider) = self.otel.take() {
            // Exports the spans still batched; bounded by the exporter's timeout.
            if let Err(error) = provider.shutdown() {
                eprintln!("WARNING: OpenTelemetry export did not shut down cleanly: {error}");
            }
        }
    }
}

/// Start logging as configured (once per process): `tracing` events on stderr (JSON or text),
/// and, with the `otel` feature and `log.otlp_endpoint` set, spans exported over OTLP/HTTP.
/// Call it outside an async runtime (the exporter's HTTP client has its own thread).
pub fn init_logging(config: &Config) -> Result<LogGuard> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;

    let filter = config.log_filter().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let stderr = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let stderr: Box<dyn Layer<tracing_subscriber::Registry> + Send + Sync> =
        if config.log.format == "json" { Box::new(stderr.json()) } else { Box::new(stderr) };
    let registry = tracing_subscriber::registry().with(stderr);
    #[cfg(feature = "otel")]
    {
        let (layer, provider) = match config.otlp_endpoint()? {
            Some(endpoint) => {
                let (tracer, provider) = otel::tracer(endpoint)?;
                (Some(tracing_opentelemetry::layer().with_tracer(tracer)), Some(provider))
            }
            None => (None, None),
        };
        let _ = registry.with(layer).with(filter).try_init();
        Ok(LogGuard { otel: provider })
    }
    #[cfg(not(feature = "otel"))]
    {
        config.otlp_endpoint()?;
        let _ = registry.with(filter).try_init();
        Ok(LogGuard {})
    }
}

#[cfg(feature = "otel")]
mod otel {
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_otlp::{Protocol, WithExportConfig};
    use opentelemetry_sdk::trace::{SdkTracerProvider, Tracer};
    use tidemark_core::{Error, Result};

    /// A tracer whose spans are batched and posted to `{endpoint}/v1/traces` (OTLP, protobuf
    /// over HTTP) from the SDK's own thread.
    pub fn tracer(endpoint: &str) -> Result<(Tracer, SdkTracerProvider)> {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(format!("{endpoint}/v1/traces"))
            .build()
            .map_err(|e| Error::io(format!("cannot set up the OTLP exporter for {endpoint}: {e}")))?;
        let resource = opentelemetry_sdk::Resource::builder().with_service_name("tidemark").build();
        let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build();
        Ok((provider.tracer("tidemark"), provider))
    }
}

/// Resolves on SIGINT or SIGTERM. Installed before the server listens.
pub(crate) fn shutdown_signals() -> Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let install = |kind| signal(kind).map_err(|e| Error::io(format!("cannot install a signal handler: {e}")));
    let (mut interrupt, mut terminate) = (install(SignalKind::interrupt())?, install(SignalKind::terminate())?);
    Ok(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
    })
}
