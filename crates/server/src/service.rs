//! [`Service`] and its builder: the user's machines, handlers and workflows, served.

use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tidemark_core::error::codes;
use tidemark_core::flow::FlowMachine;
use tidemark_core::store::Handler;
use tidemark_core::{Error, Result};
use tidemark_engine::workflow::{IntoWorkflow, Workflow};
use tidemark_store_sqlite::Durability;
use utoipa_axum::router::OpenApiRouter;

use crate::backend::{Backend, Sqlite};
use crate::registry::{
    ConsumerDeclaration, Database, HandlerEntry, Registry, RegistryParts, TenantInfo, TenantWorkflows,
};
use crate::tenant::Tenant;
use crate::{background, dashboard, AppState, Config};

/// Builds a [`Service`]: configuration, then what it serves. Nothing is opened until
/// [`ServiceBuilder::build`], which checks every registration and answers a typed error for a
/// wrong one (two machines sharing a state, two workflows with one name and version, a consumer
/// whose handler is not registered, ...), never a panic later.
#[must_use = "a builder does nothing until `build`"]
pub struct ServiceBuilder<B: Backend = Sqlite> {
    config: Config,
    backend: B,
    parts: RegistryParts<B>,
    routes: Vec<OpenApiRouter<AppState>>,
    errors: Vec<Error>,
}

/// A built service: the data folder and control database are open; tenants open on
/// [`Service::start`] (every tenant known so far) or on first use.
///
/// Run it with [`Service::serve`] (HTTP API, dashboard, `/metrics` and the background loops),
/// [`Service::run_until`] (the loops only, for a service that has its own web framework), or
/// mount [`Service::router`] in an existing `axum` app after [`Service::start`].
///
/// ```no_run
/// # async fn example() -> tidemark_core::Result<()> {
/// use tidemark_server::Service;
/// let service = Service::builder().data_dir("./data").without_auth("main").build()?;
/// service.serve("127.0.0.1:7400").await?;
/// # Ok(()) }
/// ```
pub struct Service<B: Backend = Sqlite> {
    state: AppState,
    routes: Vec<OpenApiRouter<AppState>>,
    started: Mutex<bool>,
    backend: std::marker::PhantomData<fn() -> B>,
}

impl Service {
    /// A builder with the default configuration ([`Config::default`]), on SQLite files.
    pub fn builder() -> ServiceBuilder<Sqlite> {
        ServiceBuilder {
            config: Config::default(),
            backend: Sqlite,
            parts: RegistryParts::default(),
            routes: Vec::new(),
            errors: Vec::new(),
        }
    }
}

impl<B: Backend> Service<B> {
    /// The shared state (configuration, registry, tenants) that routes and loops use.
    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// What the service serves.
    pub fn registry(&self) -> &Registry {
        &self.state.registry
    }

    /// The tenant `id`, opened (migrations run, threads and loops started) on first use.
    pub async fn tenant(&self, id: &str) -> Result<Arc<Tenant<B>>> {
        let tenant = self.state.tenant(id).await?;
        B::unwrap(&tenant)
            .cloned()
            .ok_or_else(|| Error::Invariant(format!("tenant {id:?} is not on this service's backend")))
    }

    /// Open every tenant known to the control database (so that their relay, drains, worker and
    /// retention run from now on, not from their first request) and start the dashboard's
    /// sampler. Called by [`Service::serve`] and [`Service::run_until`]; call it yourself before
    /// mounting [`Service::router`]. Idempotent.
    pub async fn start(&self) -> Result<()> {
        for id in self.state.control(|c| c.tenants())? {
            self.state.tenant(&id).await?;
        }
        let mut started = self.started.lock().unwrap_or_else(|p| p.into_inner());
        if !*started {
            dashboard::start_sampler(self.state.clone());
            *started = true;
        }
        // `/readyz` answers ready from now on (until shutdown begins).
        self.state.ready.store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    /// The HTTP API (`/v1`, health, `/metrics`, `/openapi.json`) and the dashboard (`/ui`) as an
    /// `axum::Router`, to serve or to mount (`Router::nest`) under an app of your own.
    pub fn router(&self) -> axum::Router {
        crate::api::router(self.state.clone(), self.routes.clone())
    }

    /// Stop: no new claims; the loops finish what they do and release what they hold (at most
    /// `shutdown.grace_ms`). Answers what every loop did.
    pub async fn shutdown(&self) -> Value {
        let grace = Duration::from_millis(self.state.config.shutdown.grace_ms);
        background::stop_all(&self.state, grace).await
    }

    /// Serve HTTP on `addr` and run every loop until SIGINT or SIGTERM, then shut down
    /// gracefully. Answers the shutdown report.
    pub async fn serve(self, addr: &str) -> Result<Value> {
        let resolved = tokio::net::lookup_host(addr)
            .await
            .map_err(|e| Error::io(format!("cannot listen on {addr}: {e}")))?
            .next()
            .ok_or_else(|| Error::io(format!("cannot listen on {addr}: it resolves to no address")))?;
        let listener = listen(resolved)?;
        let signals = crate::shutdown_signals()?;
        self.serve_on(listener, signals).await
    }

    /// Serve HTTP on `listener` and run every loop until `shutdown` resolves, then shut down
    /// gracefully (in-flight requests are answered first).
    pub async fn serve_on(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<Value> {
        self.start().await?;
        let app = self.router();
        let stop = self.state.clone();
        tracing::info!(addr = ?listener.local_addr().ok(), "listening");
        let limits = self.state.config.limits.clone();
        let grace = Duration::from_millis(self.state.config.shutdown.grace_ms);
        serve_connections(listener, app, &limits, grace, async move {
            shutdown.await;
            tracing::info!("shutting down: no new requests, no new claims");
            stop.shutdown.send_replace(true);
        })
        .await;
        let released = self.shutdown().await;
        Ok(json!({"outcome": "stopped", "workers": released}))
    }

    /// Run every loop (relay, drains, workers, retention) without HTTP until `shutdown`
    /// resolves, then shut down gracefully.
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) -> Result<Value> {
        self.start().await?;
        shutdown.await;
        self.state.shutdown.send_replace(true);
        let released = self.shutdown().await;
        Ok(json!({"outcome": "stopped", "workers": released}))
    }

    /// What `tidemark serve` does: logging as configured, a runtime of its own, HTTP on the
    /// configured `listen` address, one JSON line on stdout once listening
    /// (`{"outcome":"listening","addr":...}`), every loop, until SIGINT or SIGTERM. Call it
    /// outside an async runtime.
    pub fn serve_blocking(self) -> Result<Value> {
        let logs = crate::init_logging(&self.state.config)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| Error::io(format!("cannot start the async runtime: {e}")))?;
        let report = runtime.block_on(async move {
            let config = &self.state.config;
            let addr = config.listen_addr()?;
            if config.auth_disabled() {
                let message = format!(
                    "AUTHENTICATION IS DISABLED (auth.mode = \"none\"): every request is an admin of tenant {:?}. \
                     Use this for local development only.",
                    config.auth.dev_tenant
                );
                tracing::warn!("{message}");
                eprintln!("WARNING: {message}");
            }
            // Every known tenant's loops run from the start, not from its first request.
            self.start().await?;
            let signals = crate::shutdown_signals()?;
            let listener = listen(addr)?;
            let bound = listener.local_addr().map_err(|e| Error::io(e.to_string()))?;
            println!("{}", json!({"outcome": "listening", "addr": bound.to_string(), "data_dir": config.data_dir}));
            let mut report = self.serve_on(listener, signals).await?;
            report["stopped_by"] = json!("signal");
            Ok(report)
        });
        // The runtime's tasks are gone; now the last spans are exported.
        drop(runtime);
        drop(logs);
        report
    }
}

/// Accept and serve HTTP/1.1 and HTTP/2 connections on `listener` until `shutdown` resolves,
/// within the configured limits (docs/serve.md, "Limits"): at most `limits.connections_max` open
/// at once (the next waits in the listen backlog), each client given
/// `limits.header_read_timeout_ms` to send a request's head (a slow or silent one is closed) and
/// at most `limits.header_bytes_max` bytes of it (431 beyond). Then no new connections; the open
/// ones finish their requests (at most `grace`). With `limits.connections_per_address_max`, a
/// connection from an address that already has that many open is answered 429 `rate_limited`
/// and closed at once (it holds no slot: a flood from one address cannot take the others').
async fn serve_connections(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    limits: &crate::config::LimitsConfig,
    grace: Duration,
    shutdown: impl Future<Output = ()>,
) {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use hyper_util::server::conn::auto::Builder;
    use hyper_util::service::TowerToHyperService;
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_millis(limits.header_read_timeout_ms))
        .max_buf_size(limits.header_bytes_max);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(limits.header_bytes_max).unwrap_or(u32::MAX));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let permits = std::sync::Arc::new(tokio::sync::Semaphore::new(limits.connections_max));
    let per_address =
        (limits.connections_per_address_max > 0).then(|| AddressSlots::new(limits.connections_per_address_max));
    // True while an accepted connection waits for a slot: every connection then closes once it
    // has gone `busy_header_timeout_ms` without a request being served and without writing.
    let (busy, busy_seen) = tokio::sync::watch::channel(false);
    let idle_limit = Duration::from_millis(limits.header_read_timeout_ms);
    let busy_limit = Duration::from_millis(limits.busy_header_timeout_ms.min(limits.header_read_timeout_ms));
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors, or a connection reset before it was accepted: go on.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let address_slot = match &per_address {
            None => None,
            Some(slots) => match slots.take(peer.ip()) {
                Some(slot) => Some(slot),
                None => {
                    // The answer fits the socket's empty send buffer: written at once or not at all.
                    let _ = stream.try_write(&TOO_MANY_CONNECTIONS);
                    tracing::debug!(peer = %peer.ip(), "connection refused: limits.connections_per_address_max");
                    continue;
                }
            },
        };
        let permit = match permits.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                // Every slot taken: the idle ones make room (see `Activity::idle_while_busy`).
                busy.send_replace(true);
                let permit = tokio::select! {
                    () = &mut shutdown => break,
                    permit = permits.clone().acquire_owned() => permit.expect("the semaphore is never closed"),
                };
                busy.send_replace(false);
                permit
            }
        };
        let _ = stream.set_nodelay(true);
        let (io, activity) = IdleWatch::new(stream);
        let service = TowerToHyperService::new(Served { inner: app.clone(), activity: activity.clone() });
        let connection = graceful.watch(builder.serve_connection_with_upgrades(TokioIo::new(io), service).into_owned());
        let busy_seen = busy_seen.clone();
        tokio::spawn(async move {
            // A connection's end (the client went away, a timeout, a protocol error) is its own.
            tokio::select! {
                _ = connection => {}
                () = activity.idle_for(idle_limit) => {}
                () = activity.idle_while_busy(busy_seen, busy_limit) => {}
            }
            drop((permit, address_slot));
        });
    }
    drop(listener);
    if tokio::time::timeout(grace, graceful.shutdown()).await.is_err() {
        tracing::warn!(grace_ms = grace.as_millis() as u64, "connections still open after the grace period");
    }
}

/// Connections the kernel holds for the accept loop (capped by `net.core.somaxconn`): more than
/// tokio's default of 1,024, so that a new client finds room behind slow ones that hold every
/// slot and reconnect at once, instead of having its SYN dropped and sent again seconds later.
const LISTEN_BACKLOG: u32 = 4_096;

/// A listener on `addr` with [`LISTEN_BACKLOG`] (and `SO_REUSEADDR`, as tokio's `bind` sets it).
fn listen(addr: std::net::SocketAddr) -> Result<tokio::net::TcpListener> {
    let failed = |e: std::io::Error| Error::io(format!("cannot listen on {addr}: {e}"));
    let socket = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4() } else { tokio::net::TcpSocket::new_v6() }
        .map_err(failed)?;
    socket.set_reuseaddr(true).map_err(failed)?;
    socket.bind(addr).map_err(failed)?;
    socket.listen(LISTEN_BACKLOG).map_err(failed)
}

/// The answer to a connection past `limits.connections_per_address_max` (then closed).
static TOO_MANY_CONNECTIONS: std::sync::LazyLock<Vec<u8>> = std::sync::LazyLock::new(|| {
    let body = serde_json::json!({"error": {
        "code": tidemark_core::codes::RATE_LIMITED,
        "message": "too many open connections from this address (limits.connections_per_address_max)",
    }})
    .to_string();
    format!(
        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nconnection: close\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
});

/// Open connections per client address, for `limits.connections_per_address_max`.
#[derive(Clone)]
struct AddressSlots {
    max: usize,
    open: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>,
}

/// One open connection's slot of its address; given back when dropped.
struct AddressSlot {
    slots: AddressSlots,
    ip: std::net::IpAddr,
}

impl AddressSlots {
    fn new(max: usize) -> AddressSlots {
        AddressSlots { max, open: Default::default() }
    }

    /// A slot for a connection from `ip`, or `None` when it has `max` open already.
    fn take(&self, ip: std::net::IpAddr) -> Option<AddressSlot> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let count = open.entry(ip).or_insert(0);
        if *count >= self.max {
            return None;
        }
        *count += 1;
        Some(AddressSlot { slots: self.clone(), ip })
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut open = self.slots.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = open.get_mut(&self.ip) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

/// A connection's stream that notes when it last read and last wrote, so that a connection
/// waiting for a request head (a new one that sent nothing, or a kept-alive one whose last
/// response is written) is closed after the header timeout. hyper's own header timeout starts
/// only with the first byte of a head; a request being served (read, not yet answered) is never
/// idle, however long its handler waits.
struct IdleWatch {
    stream: tokio::net::TcpStream,
    activity: std::sync::Arc<Activity>,
}

/// When a connection last read and wrote, in ms after it opened, and how many of its requests
/// the service is handling.
struct Activity {
    opened: std::time::Instant,
    read_ms: std::sync::atomic::AtomicU64,
    written_ms: std::sync::atomic::AtomicU64,
    in_service: std::sync::atomic::AtomicUsize,
}

/// The application as one connection's service: it counts the connection's requests being
/// handled (from the call to the response's head), which a busy server never closes.
#[derive(Clone)]
struct Served {
    inner: axum::Router,
    activity: std::sync::Arc<Activity>,
}

/// One request of a connection being handled; counted while it lives.
struct InService(std::sync::Arc<Activity>);

impl Drop for InService {
    fn drop(&mut self) {
        self.0.in_service.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl<B> tower::Service<axum::http::Request<B>> for Served
where
    B: axum::body::HttpBody<Data = axum::body::Bytes> + Send + 'static,
    B::Error: Into<axum::BoxError>,
{
    type Response = axum::response::Response;
    type Error = std::convert::Infallible;
    type Future =
        std::pin::Pin<Box<dyn Future<Output = Result<axum::response::Response, std::convert::Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        tower::Service::<axum::http::Request<B>>::poll_ready(&mut self.inner, cx)
    }

    fn call(&mut self, request: axum::http::Request<B>) -> Self::Future {
        self.activity.in_service.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let counted = InService(self.activity.clone());
        let answer = tower::Service::call(&mut self.inner, request);
        Box::pin(async move {
            let answer = answer.await;
            drop(counted);
            answer
        })
    }
}

impl IdleWatch {
    fn new(stream: tokio::net::TcpStream) -> (IdleWatch, std::sync::Arc<Activity>) {
        let activity = std::sync::Arc::new(Activity {
            opened: std::time::Instant::now(),
            read_ms: std::sync::atomic::AtomicU64::new(0),
            written_ms: std::sync::atomic::AtomicU64::new(0),
            in_service: std::sync::atomic::AtomicUsize::new(0),
        });
        (IdleWatch { stream, activity: activity.clone() }, activity)
    }
}

impl Activity {
    fn now_ms(&self) -> u64 {
        self.opened.elapsed().as_millis() as u64
    }

    /// Resolves once the connection has waited `limit` for a request head: nothing read since
    /// its last write (or since it opened).
    async fn idle_for(&self, limit: Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        let limit_ms = limit.as_millis() as u64;
        loop {
            let (read, written) = (self.read_ms.load(Relaxed), self.written_ms.load(Relaxed));
            let waiting_since = (read <= written).then_some(written);
            let wait_ms = match waiting_since {
                Some(since) if self.now_ms().saturating_sub(since) >= limit_ms => return,
                Some(since) => limit_ms - self.now_ms().saturating_sub(since),
                None => limit_ms,
            };
            tokio::time::sleep(Duration::from_millis(wait_ms.max(1))).await;
        }
    }

    /// Resolves once the server is busy (`busy` true: a new connection waits for a slot) and
    /// this connection has gone `limit` without a request being served and without writing
    /// (since it opened, or since its last write: a client trickling a head, or a kept-alive
    /// one between requests). Never while the server is not busy.
    async fn idle_while_busy(&self, mut busy: tokio::sync::watch::Receiver<bool>, limit: Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        let limit_ms = limit.as_millis() as u64;
        loop {
            if busy.wait_for(|busy| *busy).await.is_err() {
                // The accept loop ended: the graceful shutdown closes what is left.
                return std::future::pending().await;
            }
            let quiet_ms = self.now_ms().saturating_sub(self.written_ms.load(Relaxed));
            if self.in_service.load(Relaxed) == 0 && quiet_ms >= limit_ms {
                return;
            }
            let wait_ms = if quiet_ms < limit_ms { limit_ms - quiet_ms } else { limit_ms };
            tokio::time::sleep(Duration::from_millis(wait_ms.max(1))).await;
        }
    }
}

impl tokio::io::AsyncRead for IdleWatch {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = std::pin::Pin::new(&mut self.stream).poll_read(cx, buf);
        if buf.filled().len() > before {
            // Strictly after the last write, so that a read in the same millisecond counts.
            let now =
                self.activity.now_ms().max(self.activity.written_ms.load(std::sync::atomic::Ordering::Relaxed) + 1);
            self.activity.read_ms.store(now, std::sync::atomic::Ordering::Relaxed);
        }
        polled
    }
}

impl tokio::io::AsyncWrite for IdleWatch {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let polled = std::pin::Pin::new(&mut self.stream).poll_write(cx, buf);
        if matches!(polled, std::task::Poll::Ready(Ok(n)) if n > 0) {
            let now = self.activity.now_ms().max(self.activity.read_ms.load(std::sync::atomic::Ordering::Relaxed));
            self.activity.written_ms.store(now, std::sync::atomic::Ordering::Relaxed);
        }
        polled
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

impl ServiceBuilder<Sqlite> {
    /// Serve every tenant from schemas of the PostgreSQL server `url`
    /// (`postgres://user@host:5432/db?schema=<prefix>`; docs/postgres.md, "Serving on
    /// PostgreSQL") instead of SQLite files: every process of the service built with the same
    /// URL shares the tenants, their runs and their inboxes. Handlers, workflows and migrations
    /// are then PostgreSQL's (a handler or transactional step gets a
    /// `tidemark_store_postgres::ApplyTransaction`), so call this before registering them; the
    /// configuration, machines, consumers, subscriptions, queues and routes carry over. A URL
    /// that is not PostgreSQL's, or a schema prefix that is not 1..=24 bytes of `a-z 0-9 _`
    /// starting with a letter, is `invalid_config` at build.
    pub fn postgres(self, url: &str) -> ServiceBuilder<crate::backend::Postgres> {
        let ServiceBuilder { mut config, parts, routes, mut errors, .. } = self;
        let typed =
            parts.handlers.len() + parts.workflows.len() + parts.tenant_workflows.len() + parts.migrations.len();
        if typed > 0 {
            errors.push(Error::invalid(
                codes::INVALID_ARGUMENT,
                "call .postgres(url) before registering handlers, workflows and migrations (they are typed by the \
                 backend's transaction)",
            ));
        }
        config.store = url.to_string();
        let backend = match config.postgres() {
            Ok(Some(location)) => crate::backend::Postgres::new(&location),
            Ok(None) => Err(Error::invalid(codes::INVALID_STORE, "an empty PostgreSQL URL")),
            Err(error) => Err(error),
        };
        let backend = backend.unwrap_or_else(|error| {
            errors.push(error);
            crate::backend::Postgres::unusable()
        });
        let parts = RegistryParts {
            machines: parts.machines,
            consumers: parts.consumers,
            subscriptions: parts.subscriptions,
            queues: parts.queues,
            ..RegistryParts::default()
        };
        ServiceBuilder { config, backend, parts, routes, errors }
    }
}

impl<B: Backend> ServiceBuilder<B> {
    /// Replace the whole configuration (e.g. [`Config::load`]: defaults < TOML < environment <
    /// flags). Settings made before are overwritten; make them after.
    pub fn config(mut self, config: Config) -> Self {
        self.config = config;
        self
    }

    /// The data folder (default `tidemark-data`): the control database and one folder per
    /// tenant, embedded SQLite. Created on first start, never reset.
    pub fn data_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.config.data_dir = dir.into();
        self
    }

    /// `Durability::Full` (the default: every commit fsynced) or `Durability::Normal` (survives
    /// a process crash, may lose the last commits on power loss).
    pub fn durability(mut self, durability: Durability) -> Self {
        self.config.durability = match durability {
            Durability::Full => "full".into(),
            Durability::Normal => "normal".into(),
        };
        self
    }

    /// No bearer tokens: every request is an admin of `tenant`. For local development and for
    /// a service whose own app authenticates before it calls the mounted router.
    pub fn without_auth(mut self, tenant: &str) -> Self {
        self.config.auth.mode = "none".into();
        self.config.auth.dev_tenant = tenant.to_string();
        self
    }

    /// Serve a flow machine: `POST /v1/flows/{flow}/advance` moves its flows, and its states
    /// must not be another machine's ([`tidemark_core::flow::MachineSet`]).
    pub fn flow(mut self, machine: impl FlowMachine + 'static) -> Self {
        self.parts.machines.push(Arc::new(machine));
        self
    }

    /// Register handler `name` on the inbox database ([`Database::Inbox`]): consumers declared
    /// with it (here with [`ServiceBuilder::declare_consumer`], or over the API) apply their
    /// events with a clone of `handler`, one per tenant.
    pub fn handler<H>(self, name: &str, handler: H) -> Self
    where
        H: Handler<B::Tx> + Clone + Send + 'static,
    {
        self.handler_in(Database::Inbox, name, handler)
    }

    /// [`ServiceBuilder::handler`] on another consumer database: [`Database::Workflows`] for a
    /// handler that writes to the workflow database in the apply transaction (one that wakes
    /// runs, `tidemark::sqlite::RunEventHandler`).
    pub fn handler_in<H>(mut self, database: Database, name: &str, handler: H) -> Self
    where
        H: Handler<B::Tx> + Clone + Send + 'static,
    {
        if database == Database::Producer {
            self.errors.push(Error::invalid(
                codes::INVALID_ARGUMENT,
                format!("handler {name:?}: the producer database holds no inbox; use inbox or workflows"),
            ));
            return self;
        }
        // Behind a lock so that a handler need only be `Send`: the lock is taken once per tenant.
        let handler = Mutex::new(handler);
        let make = Arc::new(move || -> crate::tenant::BoxedHandler<B> {
            Box::new(handler.lock().unwrap_or_else(|p| p.into_inner()).clone())
        });
        self.parts.handlers.push((name.to_string(), HandlerEntry { database, make }));
        self
    }

    /// A consumer `consumer_id` with its own handler (registered under the consumer's id),
    /// declared in every tenant and subscribed to the tenant's producer from its first event.
    pub fn consumer<H>(self, consumer_id: &str, handler: H) -> Self
    where
        H: Handler<B::Tx> + Clone + Send + 'static,
    {
        self.handler(consumer_id, handler).declare_consumer(consumer_id, consumer_id)
    }

    /// Declare consumer `consumer_id` with the registered handler `handler` in every tenant,
    /// subscribed to the tenant's producer from its first event. A handler that is not
    /// registered is `unknown_handler` at build.
    pub fn declare_consumer(mut self, consumer_id: &str, handler: &str) -> Self {
        self.parts.consumers.push(ConsumerDeclaration {
            consumer_id: consumer_id.to_string(),
            handler: handler.to_string(),
            subscribe: true,
        });
        self
    }

    /// Declare consumer `consumer_id` with the registered handler `handler` in every tenant, fed
    /// by other services only: never subscribed to the tenant's own outboxes (the API's
    /// `PUT /v1/consumers/{id}` with `"subscribe": false`). Its events arrive through its inbox
    /// routes (another service's relay posts to `/v1/consumers/{id}/inbox/batch`) or from a
    /// broker source ([`ServiceBuilder::source`]).
    pub fn declare_consumer_unsubscribed(mut self, consumer_id: &str, handler: &str) -> Self {
        self.parts.consumers.push(ConsumerDeclaration {
            consumer_id: consumer_id.to_string(),
            handler: handler.to_string(),
            subscribe: false,
        });
        self
    }

    /// Subscribe `consumer_id` at a network `endpoint` (another service's inbox
    /// `http(s)://host:port/v1/consumers/{id}/inbox`, `nats://`, `amqp://`, `kafka://`, or
    /// `pull:`; docs/protocol.md, "Endpoints") to both outboxes of every tenant when it opens,
    /// from their first event: the API's `PUT /v1/subscriptions/{id}` with `"from_start": true`,
    /// made by the service itself. Opening again changes nothing; another endpoint than the
    /// stored one moves the subscription there. An HTTP endpoint's token is the configuration's
    /// (`relay.tokens`). A file endpoint, or a consumer id declared or subscribed twice, is an
    /// error at build.
    pub fn subscribe(mut self, consumer_id: &str, endpoint: &str) -> Self {
        self.parts.subscriptions.push(tidemark_core::store::Subscription {
            consumer_id: consumer_id.to_string(),
            endpoint: endpoint.to_string(),
        });
        self
    }

    /// Consume a broker into a declared consumer's inbox (a `[[sources]]` entry of the
    /// configuration: a JetStream stream, a Kafka topic or a RabbitMQ queue; docs/serve.md,
    /// "Consuming from a broker"). Checked at build like the configuration's own entries. Call it
    /// after [`ServiceBuilder::config`], which replaces the sources too.
    pub fn source(mut self, source: crate::config::SourceConfig) -> Self {
        self.config.sources.push(source);
        self
    }

    /// Serve a workflow (a [`Workflow`] or a [`tidemark_engine::workflow::Saga`]): started with
    /// `POST /v1/runs`, run by every tenant's worker.
    pub fn workflow(mut self, workflow: impl IntoWorkflow<B::Workflows>) -> Self {
        self.parts.workflows.push(workflow.into_workflow());
        self
    }

    /// Declare a queue in every tenant (its concurrency and rate limits hold across every
    /// worker on the tenant's database): runs started with `StartRequest::in_queue` go through
    /// it. A queue declared twice is `already_exists` at build; a zero limit `invalid_argument`.
    pub fn queue(mut self, queue: tidemark_core::queue::QueueSpec) -> Self {
        self.parts.queues.push(queue);
        self
    }

    /// Workflows made per tenant when it opens (for a resource of their own per tenant).
    /// `declared` names every `(workflow, version)` that `make` makes, so that clashes are found
    /// at build.
    pub fn tenant_workflows<F>(mut self, declared: &[(&str, u32)], make: F) -> Self
    where
        F: Fn(&TenantInfo) -> Result<Vec<Workflow<B::Workflows>>> + Send + Sync + 'static,
    {
        let declared = declared.iter().map(|(n, v)| (n.to_string(), *v)).collect();
        self.parts.tenant_workflows.push(TenantWorkflows { declared, make: Arc::new(make) });
        self
    }

    /// A migration of the user's own tables in `database`, run (once, in order, each in its
    /// own transaction) when a tenant opens, before its threads start. Recorded apart from
    /// tidemark's own schema version (docs/library.md, "Your tables and their migrations").
    pub fn migration(mut self, database: Database, migration: B::Migration) -> Self {
        self.parts.migrations.push((database, migration));
        self
    }

    /// Routes of your own, served beside the API with its authentication: a handler takes
    /// [`crate::Caller`] (the token's tenant and scope). Documented in `/openapi.json` when
    /// declared with `utoipa`.
    pub fn routes(mut self, routes: OpenApiRouter<AppState>) -> Self {
        self.routes.push(routes);
        self
    }

    /// Check every registration and the configuration, and open the data folder.
    pub fn build(mut self) -> Result<Service<B>> {
        if let Some(error) = self.errors.drain(..).next() {
            return Err(error);
        }
        self.config.validate()?;
        self.backend.check(&self.config)?;
        let (registry, registrations) = Registry::new(self.parts)?;
        let state = AppState::open(self.config, registry, registrations, self.backend)?;
        Ok(Service { state, routes: self.routes, started: Mutex::new(false), backend: std::marker::PhantomData })
    }
}
