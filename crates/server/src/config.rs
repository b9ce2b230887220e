//! `tidemark serve`'s configuration: defaults, then a TOML file, then `TIDEMARK_*` environment
//! variables, then command-line flags (each layer overrides the one before). Every key is
//! documented in docs/serve.md; an unknown key or a value out of range is an
//! `invalid_config` error that names the key.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};
use tidemark_core::error::codes;
use tidemark_core::limits::{DRAIN_BATCH_EVENTS_MAX, PAGE_SIZE_MAX, PRUNE_BATCH_ROWS_MAX, RELAY_BATCH_EVENTS_MAX};
use tidemark_core::location::{PostgresLocation, StoreLocation};
use tidemark_core::policy::{RelayPolicy, DAY_MS};
use tidemark_core::tenancy::validate_tenant_id;
use tidemark_core::{Error, Result};

/// Environment variables that start with `TIDEMARK_` but are not configuration.
const ENV_NOT_CONFIG: &[&str] = &["clock_offset_file", "crash_at", "crash_file", "faultfs", "server", "token"];

/// Largest request body the server accepts at all (the configured limit is at most this).
pub const BODY_BYTES_CEILING: usize = 4 * 1024 * 1024;

/// Longest `log.level` filter.
pub const LOG_LEVEL_BYTES_MAX: usize = 1024;

/// The whole configuration of `tidemark serve`, one section per TOML table (docs/serve.md,
/// "Configuration"). Unknown keys are refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The data folder: created on first start, never reset.
    pub data_dir: PathBuf,
    /// Address to listen on (`127.0.0.1:0` picks a free port; the bound address is printed).
    pub listen: String,
    /// `full` (every commit fsynced) or `normal` (see docs/operations.md).
    pub durability: String,
    /// Where tenants' data lives: empty (the default) for SQLite files in `data_dir`, or
    /// `postgres://user@host/db?schema=<prefix>` for schemas of a PostgreSQL server shared by
    /// every process of the service (docs/postgres.md, "Serving on PostgreSQL"). `data_dir`
    /// still holds what registrations keep locally.
    pub store: String,
    /// Bearer tokens and per-token rate limits (`[auth]`).
    pub auth: AuthConfig,
    /// Request bounds (`[limits]`).
    pub limits: LimitsConfig,
    /// The per-tenant relay loop (`[relay]`).
    pub relay: RelayConfig,
    /// The per-tenant drains of declared consumers (`[consumers]`).
    pub consumers: ConsumersConfig,
    /// The per-tenant workflow workers (`[workers]`).
    pub workers: WorkersConfig,
    /// The per-tenant retention loop (`[retention]`).
    pub retention: RetentionConfig,
    /// Graceful shutdown (`[shutdown]`).
    pub shutdown: ShutdownConfig,
    /// Logs and trace export (`[log]`).
    pub log: LogConfig,
    /// Brokers consumed into declared consumers' inboxes (`[[sources]]`, one table each).
    pub sources: Vec<SourceConfig>,
}

/// `[[sources]]`: one broker consumed into one declared consumer's inbox (docs/protocol.md,
/// "Consuming from a broker"): a NATS JetStream stream, a Kafka topic or a RabbitMQ queue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// The tenant whose consumer receives.
    pub tenant: String,
    /// The declared consumer (`PUT /v1/consumers/{id}`) whose inbox the events go to; its
    /// handler's database holds that inbox, and its drain applies them.
    pub consumer: String,
    /// `nats://host[:port]/<subject prefix>` (the subjects `<prefix>.>` are consumed),
    /// `kafka://host:port[,host:port...]/<topic>` or `amqp://host[:port]/<queue>` (a queue on the
    /// default virtual host, connected to with `relay.amqp_credentials` for `host:port`).
    pub from: String,
    /// NATS only (and required there): the JetStream stream capturing the subjects (the
    /// operator's; never created by tidemark).
    #[serde(default)]
    pub stream: Option<String>,
    /// The durable pull consumer's name (NATS), the consumer group (Kafka's `group.id`) or the
    /// consumer tag (RabbitMQ); default `tidemark-<tenant>-<consumer>`.
    #[serde(default)]
    pub durable: Option<String>,
    /// Messages per pull (1..=1,000; default 100); for NATS and RabbitMQ, twice this is the
    /// most the broker hands over unacked.
    #[serde(default = "default_source_batch")]
    pub batch: usize,
    /// NATS only: how long the broker waits for an ack before redelivering, in ms
    /// (1,000..=3,600,000; default 30,000).
    #[serde(default)]
    pub ack_wait_ms: Option<u64>,
    /// Kafka only: the group's session timeout, how long after a member stops heartbeating its
    /// partitions go to the other members (which read again from the last committed offset), in
    /// ms (1,000..=1,800,000; default 45,000).
    #[serde(default)]
    pub session_timeout_ms: Option<u64>,
}

fn default_source_batch() -> usize {
    100
}

impl SourceConfig {
    /// The transport's view of this source, checked
    /// ([`tidemark_transport::SourceSettings::check`]): `invalid_config` for a `from` that is
    /// no broker this build consumes, a setting of another kind, a missing `stream` (NATS) or a
    /// value out of range.
    pub fn spec(&self) -> Result<tidemark_transport::SourceSpec> {
        tidemark_transport::SourceSettings {
            from: self.from.clone(),
            stream: self.stream.clone(),
            durable: self.durable.clone().unwrap_or_else(|| format!("tidemark-{}-{}", self.tenant, self.consumer)),
            batch: self.batch,
            ack_wait_ms: self.ack_wait_ms,
            session_timeout_ms: self.session_timeout_ms,
        }
        .check()
    }
}

/// `[auth]`: how requests are authenticated and rate-limited.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// `tokens` (bearer tokens from `tidemark token create`) or `none` (local development only:
    /// every request acts as an admin of `dev_tenant`; said loudly at start-up).
    pub mode: String,
    /// The tenant every request acts in when `mode` is `none` (a tenant id; default `dev`).
    pub dev_tenant: String,
    /// Requests per second per token (a token bucket refilled at this rate; 1..=1,000,000). More is
    /// answered 429 `rate_limited`.
    pub rate_per_second: u32,
    /// The most requests one token may make at once before the rate applies (the bucket's size).
    pub burst: u32,
    /// How long a refusal, 401 `unauthenticated` or 429 `rate_limited`, is held before it is sent,
    /// in ms (0..=10,000; default 100). A client sends its next request on that connection only
    /// after the answer, so a token guesser or a client over its rate is answered at most about
    /// ten times a second per connection instead of as fast as the server can refuse, and takes
    /// that much less of the time the server shares among connections.
    pub refusal_delay_ms: u64,
}

/// `[limits]`: bounds of what one request may ask for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Largest request body (bytes); larger bodies get 413 `payload_too_large`.
    pub body_bytes_max: usize,
    /// Largest page a list endpoint returns (`limit` above it is 400 `limit_exceeded`).
    pub page_size_max: usize,
    /// The JSON of one page's items at most, in bytes (16,384..=268,435,456; default 1 MiB): a
    /// page stops before the item that would take it past this (its first item always goes,
    /// however large), says so with `truncated: true`, and its cursor continues after its last
    /// item. So an answer held in memory for a client that reads it slowly stays this small,
    /// whatever the payloads, inputs and results in it.
    pub page_bytes_max: usize,
    /// Requests in one group commit of advances or receives.
    pub group_commit_max: usize,
    /// How long a client may take to send a request's headers, in ms (100..=600,000): a
    /// connection that trickles them (or sends nothing) is closed after it, so that slow clients
    /// cannot hold connections open.
    pub header_read_timeout_ms: u64,
    /// Largest request head (request line and headers), in bytes (8,192..=1,048,576): a larger
    /// one is answered 431 and the connection closed.
    pub header_bytes_max: usize,
    /// Open client connections at most (1..=100,000): once that many are open, a new one waits
    /// until one closes (a connection idle past `header_read_timeout_ms` closes by itself, and
    /// sooner while a new one waits: `busy_header_timeout_ms`).
    pub connections_max: usize,
    /// While every connection slot is taken and a new connection waits for one: how long a
    /// connection may go without a request being served and without writing, in ms (100..=600,000;
    /// the shorter of it and `header_read_timeout_ms` applies), before it is closed to make room.
    /// A connection whose request is being served is never closed for it. So slow clients, from
    /// however many addresses, hold a new client back about this long, not a header timeout per
    /// slow client ahead of it.
    pub busy_header_timeout_ms: u64,
    /// Open connections from one client address at most (0..=100,000; 0, the default: no bound
    /// but `connections_max`): a connection past it is answered 429 `rate_limited` and closed at
    /// once, so one address cannot take every slot. Behind a reverse proxy every client has the
    /// proxy's address: leave it 0 there and bound addresses at the proxy.
    pub connections_per_address_max: usize,
}

/// `[relay]`: how each tenant's relay hands its outbox to the subscribers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RelayConfig {
    /// How long the delivery loop pauses when a round moved nothing, in ms (the loop pauses the
    /// shorter of this and `consumers.drain_interval_ms`; 1..=3,600,000).
    pub interval_ms: u64,
    /// Deliveries per relay batch (1..=10,000).
    pub batch: usize,
    /// Failed attempts after which a delivery is quarantined (1..=1,000).
    pub max_attempts: u32,
    /// Delay before the second attempt, in ms; doubles per attempt (0..=24 h).
    pub backoff_base_ms: i64,
    /// The longest delay between attempts, in ms (0..=24 h).
    pub backoff_max_ms: i64,
    /// How long one delivery to a network endpoint (an HTTP request, a broker publish) may take
    /// before it counts as a failed attempt, in ms (1..=600,000).
    pub attempt_timeout_ms: u64,
    /// Bearer tokens of HTTP endpoints, by origin (`"http://host:port"`, the port spelled out):
    /// the token, or `env:NAME` to read it from the environment variable `NAME` when the lane
    /// connects. Tokens live here, never in the producer database.
    pub tokens: std::collections::BTreeMap<String, String>,
    /// Credentials of RabbitMQ brokers, by server (`"host:port"`, the port spelled out, as the
    /// `amqp://` endpoint names it): `user:password`, or `env:NAME` to read `user:password` from
    /// the environment variable `NAME` when the lane connects. A broker with no entry is connected
    /// to as `guest:guest`, which RabbitMQ accepts from loopback only. Like tokens, credentials
    /// live here, never in the producer database.
    pub amqp_credentials: std::collections::BTreeMap<String, String>,
    /// The PostgreSQL servers and users `postgres://` endpoints may write as, by
    /// `"user@host:port"` (the endpoint's user and server, the port spelled out): a lane writes
    /// only into a consumer schema whose user and server are listed here (the operator's
    /// consent, as a token is for an HTTP origin), with the entry's password. Like tokens,
    /// passwords live here, never in the producer database.
    pub postgres: std::collections::BTreeMap<String, PostgresEndpointConfig>,
    /// A PEM file of root certificates the relay trusts for `https://` endpoints besides the
    /// system's (a private CA, a receiver's self-signed certificate). Checked at start: it must
    /// hold at least one certificate and be at most 1 MiB.
    pub ca_file: Option<std::path::PathBuf>,
}

/// `[relay.postgres."user@host:port"]`: one PostgreSQL server and user that `postgres://`
/// endpoints may write as.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PostgresEndpointConfig {
    /// The password, or `env:NAME` to read it from the environment variable `NAME` when the lane
    /// connects; absent: none (trust, peer or certificate authentication).
    #[serde(default)]
    pub password: Option<String>,
}

/// `[consumers]`: how each tenant's declared consumers apply their inboxes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConsumersConfig {
    /// How long the delivery loop pauses when a round moved nothing, in ms (the loop pauses the
    /// shorter of this and `relay.interval_ms`; 1..=3,600,000).
    pub drain_interval_ms: u64,
    /// Events applied per drain transaction (1..=10,000).
    pub drain_batch: usize,
    /// Enable the reservation domain's v2 decoders.
    pub support_v2: bool,
}

/// `[workers]`: each tenant's workflow worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkersConfig {
    /// Runs in flight per tenant.
    pub concurrency: usize,
    /// How long a worker's lease on a run lasts, in ms (100 ms..=1 day); it heartbeats every third
    /// of it.
    pub lease_ms: i64,
    /// How often the worker claims due runs when it has nothing to do, in ms (1..=3,600,000).
    pub poll_ms: u64,
    /// Attempts per step, the first included.
    pub max_attempts: u32,
    /// A fixed delay between attempts (default: exponential, see docs/workflows.md).
    pub retry_delay_ms: Option<i64>,
}

/// `[retention]`: what each tenant's retention loop deletes or compacts, and when.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetentionConfig {
    /// How often retention runs, in ms (100 ms..=1 day).
    pub interval_ms: u64,
    /// Applied inbox bodies are compacted into receipts after this long.
    pub applied_ms: i64,
    /// Settled outbox events are deleted after this long.
    pub delivered_ms: i64,
    /// Finished runs' journals are purged after this long.
    pub finished_runs_ms: i64,
    /// Rows per retention transaction (1..=10,000), so retention never holds the write lock for
    /// long.
    pub batch_rows: usize,
}

/// `[shutdown]`: how the server stops.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShutdownConfig {
    /// How long in-flight work may take to finish after SIGTERM before it is released.
    pub grace_ms: u64,
}

/// `[log]`: logs on stderr and trace export.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// `json` or `text`, on stderr.
    pub format: String,
    /// A `tracing` filter, e.g. `info` or `tidemark_server=debug`.
    pub level: String,
    /// OpenTelemetry export: the base URL of an OTLP/HTTP collector (`http://host:4318`); spans
    /// are posted to `{otlp_endpoint}/v1/traces` as protobuf. Empty (the default): no export.
    /// Needs a build with the `otel` feature.
    pub otlp_endpoint: String,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            data_dir: PathBuf::from("tidemark-data"),
            listen: "127.0.0.1:7400".into(),
            durability: "full".into(),
            store: String::new(),
            auth: AuthConfig::default(),
            limits: LimitsConfig::default(),
            relay: RelayConfig::default(),
            consumers: ConsumersConfig::default(),
            workers: WorkersConfig::default(),
            retention: RetentionConfig::default(),
            shutdown: ShutdownConfig::default(),
            log: LogConfig::default(),
            sources: Vec::new(),
        }
    }
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            mode: "tokens".into(),
            dev_tenant: "dev".into(),
            rate_per_second: 1_000,
            burst: 2_000,
            refusal_delay_ms: 100,
        }
    }
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            body_bytes_max: 256 * 1024,
            page_size_max: PAGE_SIZE_MAX,
            page_bytes_max: 1024 * 1024,
            group_commit_max: 1_000,
            header_read_timeout_ms: 10_000,
            header_bytes_max: 64 * 1024,
            connections_max: 1_024,
            busy_header_timeout_ms: 1_000,
            connections_per_address_max: 0,
        }
    }
}

impl Default for RelayConfig {
    fn default() -> Self {
        let policy = RelayPolicy::default();
        RelayConfig {
            interval_ms: 50,
            batch: 1_000,
            max_attempts: policy.max_attempts,
            backoff_base_ms: policy.backoff_base_ms,
            backoff_max_ms: policy.backoff_max_ms,
            attempt_timeout_ms: 10_000,
            tokens: Default::default(),
            amqp_credentials: Default::default(),
            postgres: Default::default(),
            ca_file: None,
        }
    }
}

impl Default for ConsumersConfig {
    fn default() -> Self {
        ConsumersConfig { drain_interval_ms: 50, drain_batch: 1_000, support_v2: false }
    }
}

impl Default for WorkersConfig {
    fn default() -> Self {
        WorkersConfig { concurrency: 64, lease_ms: 30_000, poll_ms: 100, max_attempts: 5, retry_delay_ms: None }
    }
}

impl Default for RetentionConfig {
    fn default() -> Self {
        RetentionConfig {
            interval_ms: 60_000,
            applied_ms: 7 * DAY_MS,
            delivered_ms: 7 * DAY_MS,
            finished_runs_ms: 7 * DAY_MS,
            batch_rows: 1_000,
        }
    }
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        ShutdownConfig { grace_ms: 10_000 }
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig { format: "json".into(), level: "info".into(), otlp_endpoint: String::new() }
    }
}

/// Flags of `tidemark serve`, the last layer.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Overrides {
    /// `--data`: the data folder.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_dir: Option<PathBuf>,
    /// `--listen`: the address to listen on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<String>,
    /// `--durability`: `full` or `normal`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub durability: Option<String>,
    /// `--store`: where tenants' data lives.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub store: Option<String>,
}

fn config_error(message: impl Into<String>) -> Error {
    Error::invalid(codes::INVALID_CONFIG, message)
}

impl Config {
    /// Defaults < `file` < `TIDEMARK_*` environment < `overrides`; then [`Config::validate`].
    /// Nested keys use `__` in the environment: `TIDEMARK_AUTH__MODE=none`.
    pub fn load(file: Option<&Path>, overrides: &Overrides) -> Result<Config> {
        let mut figment = Figment::from(Serialized::defaults(Config::default()));
        if let Some(path) = file {
            if !path.is_file() {
                return Err(config_error(format!("config file {} does not exist", path.display())));
            }
            figment = figment.merge(Toml::file(path));
        }
        figment = figment
            .merge(Env::prefixed("TIDEMARK_").ignore(ENV_NOT_CONFIG).split("__"))
            .merge(Serialized::defaults(overrides));
        Self::extract(figment)
    }

    /// Defaults < the TOML `text`, then [`Config::validate`]: what [`Config::load`] makes of a
    /// file holding `text` (without the environment and flags layers). The fuzz target `config`
    /// runs it.
    pub fn parse_toml(text: &str) -> Result<Config> {
        Self::extract(Figment::from(Serialized::defaults(Config::default())).merge(Toml::string(text)))
    }

    /// The layers merged into a [`Config`], validated.
    fn extract(figment: Figment) -> Result<Config> {
        let config: Config = figment.extract().map_err(|e| {
            let e = e.into_iter().next().map(|e| e.to_string()).unwrap_or_default();
            config_error(format!("bad configuration: {e}"))
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Ranges and words; each error names its key.
    pub fn validate(&self) -> Result<()> {
        let range = |key: &str, value: i128, min: i128, max: i128| {
            if value < min || value > max {
                return Err(config_error(format!("{key} must be {min}..={max}, got {value}")));
            }
            Ok(())
        };
        if self.data_dir.as_os_str().is_empty() {
            return Err(config_error("data_dir must not be empty"));
        }
        self.listen_addr()?;
        self.durability()?;
        self.postgres()?;
        if !matches!(self.auth.mode.as_str(), "tokens" | "none") {
            return Err(config_error(format!("auth.mode must be \"tokens\" or \"none\", got {:?}", self.auth.mode)));
        }
        validate_tenant_id(&self.auth.dev_tenant).map_err(|e| config_error(format!("auth.dev_tenant: {e}")))?;
        range("auth.rate_per_second", self.auth.rate_per_second.into(), 1, 1_000_000)?;
        range("auth.burst", self.auth.burst.into(), 1, 10_000_000)?;
        range("auth.refusal_delay_ms", self.auth.refusal_delay_ms.into(), 0, 10_000)?;
        range("limits.body_bytes_max", self.limits.body_bytes_max as i128, 1024, BODY_BYTES_CEILING as i128)?;
        range("limits.header_read_timeout_ms", self.limits.header_read_timeout_ms as i128, 100, 600_000)?;
        range("limits.header_bytes_max", self.limits.header_bytes_max as i128, 8_192, 1_048_576)?;
        range("limits.connections_max", self.limits.connections_max as i128, 1, 100_000)?;
        range("limits.busy_header_timeout_ms", self.limits.busy_header_timeout_ms as i128, 100, 600_000)?;
        range("limits.connections_per_address_max", self.limits.connections_per_address_max as i128, 0, 100_000)?;
        range("limits.page_size_max", self.limits.page_size_max as i128, 1, PAGE_SIZE_MAX as i128)?;
        range("limits.page_bytes_max", self.limits.page_bytes_max as i128, 16_384, 268_435_456)?;
        range("limits.group_commit_max", self.limits.group_commit_max as i128, 1, 10_000)?;
        range("relay.interval_ms", self.relay.interval_ms.into(), 1, 3_600_000)?;
        range("relay.batch", self.relay.batch as i128, 1, RELAY_BATCH_EVENTS_MAX as i128)?;
        self.relay_policy().validate().map_err(|e| config_error(format!("relay: {e}")))?;
        range("relay.attempt_timeout_ms", self.relay.attempt_timeout_ms.into(), 1, 600_000)?;
        for (origin, token) in &self.relay.tokens {
            let parsed = tidemark_core::endpoint::Endpoint::parse(&format!("{origin}/v1/consumers/c/inbox"));
            match parsed {
                Ok(tidemark_core::endpoint::Endpoint::Http { origin: canonical, .. }) if &canonical == origin => {}
                _ => {
                    return Err(config_error(format!(
                    "relay.tokens: {origin:?} is not an origin such as \"http://host:port\" (scheme, host and port, \
                         nothing else)"
                )))
                }
            }
            if token.is_empty() || token == "env:" {
                return Err(config_error(format!("relay.tokens.{origin:?} is empty")));
            }
        }
        for (server, credentials) in &self.relay.amqp_credentials {
            match tidemark_core::endpoint::Endpoint::parse(&format!("amqp://{server}/x")) {
                Ok(tidemark_core::endpoint::Endpoint::Amqp { server: canonical, .. }) if &canonical == server => {}
                _ => {
                    return Err(config_error(format!(
                        "relay.amqp_credentials: {server:?} is not a broker such as \"host:5672\" (host and port, \
                         nothing else)"
                    )))
                }
            }
            // Never print the value: it holds a password.
            let valid = match credentials.strip_prefix("env:") {
                Some(name) => !name.is_empty(),
                None => credentials.split_once(':').is_some_and(|(user, _)| !user.is_empty()),
            };
            if !valid {
                return Err(config_error(format!(
                    "relay.amqp_credentials.{server:?} must be \"user:password\" or \"env:NAME\""
                )));
            }
        }
        for (address, entry) in &self.relay.postgres {
            let canonical = address.split_once('@').and_then(|(user, server)| {
                match tidemark_core::endpoint::Endpoint::parse(&format!("postgres://{user}@{server}/d?schema=s")) {
                    Ok(tidemark_core::endpoint::Endpoint::Postgres { user: u, server: s, .. }) => {
                        Some(format!("{u}@{s}"))
                    }
                    _ => None,
                }
            });
            if canonical.as_ref() != Some(address) {
                return Err(config_error(format!(
                    "relay.postgres: {address:?} is not a user and server such as \"app@host:5432\" (user, \
                     host and port, nothing else)"
                )));
            }
            // Never print the value: it is a password.
            if entry.password.as_deref().is_some_and(|p| p.is_empty() || p == "env:") {
                return Err(config_error(format!(
                    "relay.postgres.{address:?}.password is empty (leave it out for no password)"
                )));
            }
        }
        if let Some(path) = &self.relay.ca_file {
            tidemark_transport::http::load_roots(path)?;
        }
        range("consumers.drain_interval_ms", self.consumers.drain_interval_ms.into(), 1, 3_600_000)?;
        range("consumers.drain_batch", self.consumers.drain_batch as i128, 1, DRAIN_BATCH_EVENTS_MAX as i128)?;
        range("workers.concurrency", self.workers.concurrency as i128, 1, 10_000)?;
        range("workers.lease_ms", self.workers.lease_ms.into(), 100, DAY_MS.into())?;
        range("workers.poll_ms", self.workers.poll_ms.into(), 1, 3_600_000)?;
        range("workers.max_attempts", self.workers.max_attempts.into(), 1, 1_000)?;
        if let Some(delay) = self.workers.retry_delay_ms {
            range("workers.retry_delay_ms", delay.into(), 0, DAY_MS.into())?;
        }
        range("retention.interval_ms", self.retention.interval_ms.into(), 100, DAY_MS as i128)?;
        for (key, value) in [
            ("retention.applied_ms", self.retention.applied_ms),
            ("retention.delivered_ms", self.retention.delivered_ms),
            ("retention.finished_runs_ms", self.retention.finished_runs_ms),
        ] {
            range(key, value.into(), 0, 3_650 * DAY_MS as i128)?;
        }
        range("retention.batch_rows", self.retention.batch_rows as i128, 1, PRUNE_BATCH_ROWS_MAX as i128)?;
        range("shutdown.grace_ms", self.shutdown.grace_ms.into(), 0, 3_600_000)?;
        if !matches!(self.log.format.as_str(), "json" | "text") {
            return Err(config_error(format!("log.format must be \"json\" or \"text\", got {:?}", self.log.format)));
        }
        self.log_filter()?;
        self.otlp_endpoint()?;
        for (i, source) in self.sources.iter().enumerate() {
            validate_tenant_id(&source.tenant).map_err(|e| config_error(format!("sources[{i}].tenant: {e}")))?;
            tidemark_core::id::validate_id("consumer", &source.consumer)
                .map_err(|e| config_error(format!("sources[{i}].consumer: {e}")))?;
            source.spec().map_err(|e| config_error(format!("sources[{i}]: {e}")))?;
        }
        Ok(())
    }

    /// The `log.level` filter, parsed (`invalid_config` when it is longer than
    /// [`LOG_LEVEL_BYTES_MAX`] or not a `tracing` filter). Each comma-separated directive is
    /// trimmed first, so `info, tidemark=debug` means what it says: `tracing-subscriber` parses
    /// a directive with leading spaces against the untrimmed text (tokio-rs/tracing#2452), which
    /// misreads its target (` tidemar`) or, before a character of more than one byte, panics. A
    /// span field's value in a directive (`[request{route=/v1/runs}]=debug`) matches literally,
    /// not as a regular expression: a value compiled as one could take gigabytes (`(=pppppp....`
    /// took more than 2 GiB in the `config` fuzz target).
    pub fn log_filter(&self) -> Result<tracing_subscriber::EnvFilter> {
        let level = &self.log.level;
        if level.len() > LOG_LEVEL_BYTES_MAX {
            return Err(config_error(format!("log.level is longer than {LOG_LEVEL_BYTES_MAX} bytes")));
        }
        let directives: Vec<&str> = level.split(',').map(str::trim).filter(|d| !d.is_empty()).collect();
        tracing_subscriber::EnvFilter::builder()
            .with_regex(false)
            .parse(directives.join(","))
            .map_err(|e| config_error(format!("log.level {level:?}: {e}")))
    }

    /// The `listen` address, parsed (`invalid_config` when it is not `host:port`).
    pub fn listen_addr(&self) -> Result<SocketAddr> {
        self.listen.parse().map_err(|e| config_error(format!("listen {:?}: {e}", self.listen)))
    }

    /// The `durability` as the stores take it (`invalid_config` for a word other than `full` or
    /// `normal`).
    pub fn durability(&self) -> Result<tidemark_store_sqlite::Durability> {
        match self.durability.as_str() {
            "full" => Ok(tidemark_store_sqlite::Durability::Full),
            "normal" => Ok(tidemark_store_sqlite::Durability::Normal),
            other => Err(config_error(format!("durability must be \"full\" or \"normal\", got {other:?}"))),
        }
    }

    /// The PostgreSQL server and schema prefix of `store`, or `None` for SQLite files
    /// (`invalid_config` for a store that is neither, or for `durability = "normal"` with
    /// PostgreSQL: its durability is the server's, `synchronous_commit` is never touched).
    pub fn postgres(&self) -> Result<Option<PostgresLocation>> {
        if self.store.is_empty() {
            return Ok(None);
        }
        match StoreLocation::parse(&self.store).map_err(|e| config_error(format!("store: {e}")))? {
            StoreLocation::Postgres(location) => {
                if self.durability()? == tidemark_store_sqlite::Durability::Normal {
                    return Err(config_error(
                        "durability = \"normal\" applies to SQLite files; with a PostgreSQL store durability is the \
                         server's (fsync, synchronous_commit)",
                    ));
                }
                crate::backend::Postgres::new(&location).map_err(|e| config_error(format!("store: {e}")))?;
                Ok(Some(location))
            }
            StoreLocation::Sqlite(_) => Err(config_error(
                "store: SQLite files live in data_dir; store takes a postgres:// URL (leave it empty for SQLite)",
            )),
        }
    }

    /// How the relay's lanes connect to network endpoints, from `[relay]`.
    pub fn transport_config(&self) -> tidemark_transport::TransportConfig {
        tidemark_transport::TransportConfig {
            http_tokens: self.relay.tokens.clone(),
            amqp_credentials: self.relay.amqp_credentials.clone(),
            postgres_endpoints: self.relay.postgres.iter().map(|(k, v)| (k.clone(), v.password.clone())).collect(),
            connect_timeout: std::time::Duration::from_millis(self.relay.attempt_timeout_ms.min(5_000)),
            // A broker client gives up on a message a little before the lane does, so that the lane
            // records the broker's reason rather than its own timeout.
            message_timeout: std::time::Duration::from_millis(self.relay.attempt_timeout_ms * 9 / 10),
            http_ca_file: self.relay.ca_file.clone(),
        }
    }

    /// The relay's retry policy, from `[relay]`.
    pub fn relay_policy(&self) -> RelayPolicy {
        RelayPolicy {
            max_attempts: self.relay.max_attempts,
            backoff_base_ms: self.relay.backoff_base_ms,
            backoff_max_ms: self.relay.backoff_max_ms,
        }
    }

    /// A relay pass of `[relay]`'s batch and policy, to every subscriber (a lane names its own).
    pub fn relay_options(&self) -> tidemark_engine::RelayOptions {
        tidemark_engine::RelayOptions {
            limit: self.relay.batch,
            event_id: None,
            policy: self.relay_policy(),
            keep_answers: false,
            consumers: None,
        }
    }

    /// The OTLP/HTTP collector to export spans to, if any.
    pub fn otlp_endpoint(&self) -> Result<Option<&str>> {
        let endpoint = self.log.otlp_endpoint.trim_end_matches('/');
        if endpoint.is_empty() {
            return Ok(None);
        }
        if !cfg!(feature = "otel") {
            return Err(config_error(
                "log.otlp_endpoint is set, but this build has no OpenTelemetry export (build with --features otel)",
            ));
        }
        let rest = endpoint.strip_prefix("http://").ok_or_else(|| {
            config_error(format!("log.otlp_endpoint must be an http:// URL (a local collector), got {endpoint:?}"))
        })?;
        if rest.is_empty() || rest.len() > 2_048 || rest.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(config_error(format!("log.otlp_endpoint {endpoint:?} is not a URL")));
        }
        Ok(Some(endpoint))
    }

    /// True when `auth.mode` is `none`: no token is asked for and every request is an admin of
    /// `auth.dev_tenant`.
    pub fn auth_disabled(&self) -> bool {
        self.auth.mode == "none"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load_text(text: &str) -> Result<Config> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tidemark.toml");
        std::fs::write(&path, text).unwrap();
        Config::load(Some(&path), &Overrides::default())
    }

    #[test]
    fn defaults_are_valid_and_files_override_them() {
        Config::default().validate().unwrap();
        let config = load_text("listen = \"127.0.0.1:9000\"\n[relay]\nbatch = 10\n").unwrap();
        assert_eq!(config.listen, "127.0.0.1:9000");
        assert_eq!(config.relay.batch, 10);
        assert_eq!(config.workers, WorkersConfig::default());
    }

    /// `log.level` directives are trimmed before `tracing-subscriber` parses them: spaces after a
    /// comma used to misread the next directive's target, and before a character of more than one
    /// byte panicked (found by the `config` fuzz target; its input is a corpus seed,
    /// `fuzz/corpus/config/log-level-space-before-multibyte.toml`).
    #[test]
    fn log_level_directives_are_trimmed_and_bounded() {
        let config = load_text("[log]\nlevel = \"warn, tidemark_server=debug ,\"\n").unwrap();
        let filter = config.log_filter().unwrap().to_string();
        assert!(filter.contains("tidemark_server=debug") && filter.contains("warn"), "{filter}");
        assert!(!filter.contains(' '), "{filter}");
        let fuzzed = "[log]\nlevel = \"dti, emQ.5QQ\u{ff}==A======Q\u{ff}=====2==Q\u{ff}====999999,fo\"\n";
        let error = load_text(fuzzed).unwrap_err();
        assert_eq!(error.code(), codes::INVALID_CONFIG);
        assert!(error.to_string().contains("log.level"), "{error}");
        let error = load_text(&format!("[log]\nlevel = \"{}\"\n", "a,".repeat(LOG_LEVEL_BYTES_MAX))).unwrap_err();
        assert!(error.to_string().contains("longer than"), "{error}");
        // A field value is a literal, not a regular expression (compiled, this one took more than
        // 2 GiB: `fuzz/corpus/config/log-level-field-regex.toml`).
        let field = format!("[request{{route={}}}]=debug", "(p".repeat(200));
        let filter = load_text(&format!("[log]\nlevel = \"{field}\"\n")).unwrap().log_filter().unwrap();
        assert!(filter.to_string().contains("route"), "{filter}");
    }

    #[test]
    fn bad_keys_and_values_are_named() {
        for (text, key) in [
            ("lsten = \"x\"", "lsten"),
            ("[relay]\nbatchh = 3", "batchh"),
            ("[relay]\nbatch = 0", "relay.batch"),
            ("[auth]\nmode = \"open\"", "auth.mode"),
            ("listen = \"nowhere\"", "listen"),
            ("[workers]\nlease_ms = \"long\"", "lease_ms"),
            ("durability = \"off\"", "durability"),
            ("[log]\notlp_endpoint = \"https://collector:4318\"", "log.otlp_endpoint"),
            ("[log]\notlp_endpoint = \"http://\"", "log.otlp_endpoint"),
            ("[relay]\nattempt_timeout_ms = 0", "relay.attempt_timeout_ms"),
            ("[[sources]]\ntenant = \"t\"\nconsumer = \"c\"\nfrom = \"http://h/x\"\nstream = \"S\"", "sources[0]"),
            ("[[sources]]\ntenant = \"t\"\nconsumer = \"c\"\nfrom = \"nats://h/x\"\nstream = \"S.1\"", "sources[0]"),
            (
                "[[sources]]\ntenant = \"t\"\nconsumer = \"c\"\nfrom = \"nats://h/x\"\nstream = \"S\"\nbatch = 0",
                "sources[0]",
            ),
            ("[[sources]]\ntenant = \"t\"\nconsumer = \"c\"\nfrom = \"nats://h/x\"", "stream"),
            (
                "[[sources]]\ntenant = \"t\"\nconsumer = \"c\"\nfrom = \"nats://h/x\"\nstream = \"S\"\nsession_timeout_ms = 9000",
                "session_timeout_ms",
            ),
            ("[[sources]]\ntenant = \"t\"\nconsumer = \"c\"\nfrom = \"kafka://h:9092/t\"\nstream = \"S\"", "stream"),
            ("[[sources]]\ntenant = \"t\"\nconsumer = \"c\"\nfrom = \"kafka://h:9092/t\"\nack_wait_ms = 5000", "ack_wait_ms"),
            ("[[sources]]\ntenant = \"t\"\nconsumer = \"c\"\nfrom = \"kafka://h:9092\"", "sources[0]"),
            ("[[sources]]\ntenant = \"t\"\nconsumer = \"c\"\nfrom = \"kafka://h:9092/t\"\ndurable = \"a b\"", "group"),
            (
                "[[sources]]\ntenant = \"t\"\nconsumer = \"c\"\nfrom = \"kafka://h:9092/t\"\nsession_timeout_ms = 10",
                "session_timeout_ms",
            ),
            ("[[sources]]\ntenant = \"t\"\nconsumer = \"c\"\nfrom = \"pull:\"", "not consumed from"),
            ("[[sources]]\ntenant = \"t\"\nconsumer = \"c\"\nfrom = \"amqp://h/x\"\nstream = \"S\"", "stream"),
            ("[[sources]]\ntenant = \"t\"\nconsumer = \"c\"\nfrom = \"amqp://h/x\"\nack_wait_ms = 5000", "ack_wait_ms"),
            (
                "[[sources]]\ntenant = \"t\"\nconsumer = \"c\"\nfrom = \"amqp://h/x\"\nsession_timeout_ms = 9000",
                "session_timeout_ms",
            ),
            ("[[sources]]\ntenant = \"t\"\nconsumer = \"c\"\nfrom = \"amqp://h/vhost/q\"", "sources[0]"),
            ("[[sources]]\ntenant = \"t\"\nconsumer = \"c\"\nfrom = \"amqp://u:p@h/q\"", "sources[0]"),
            ("[[sources]]\ntenant = \"t\"\nconsumer = \"c\"\nfrom = \"amqp://h/q\"\nbatch = 1001", "batch"),
            ("[[sources]]\ntenant = \"t\"\nconsumer = \"c\"\nfrom = \"amqp://h/q\"\ndurable = \"a b\"", "consumer tag"),
            ("[relay.tokens]\n\"http://h\" = \"t\"", "relay.tokens"),
            ("[relay.tokens]\n\"http://h:80/v1\" = \"t\"", "relay.tokens"),
            ("[relay.tokens]\n\"http://h:80\" = \"\"", "relay.tokens"),
            ("[relay.amqp_credentials]\n\"h\" = \"u:p\"", "relay.amqp_credentials"),
            ("[relay.amqp_credentials]\n\"amqp://h:5672\" = \"u:p\"", "relay.amqp_credentials"),
            ("[relay.amqp_credentials]\n\"h:5672/v\" = \"u:p\"", "relay.amqp_credentials"),
            ("[relay.amqp_credentials]\n\"h:5672\" = \"secretwithoutuser\"", "relay.amqp_credentials"),
            ("[relay.amqp_credentials]\n\"h:5672\" = \"env:\"", "relay.amqp_credentials"),
            ("[relay.postgres.\"h:5432\"]", "relay.postgres"),
            ("[relay.postgres.\"app@h\"]", "relay.postgres"),
            ("[relay.postgres.\"app@h:5432/d\"]", "relay.postgres"),
            ("[relay.postgres.\"app@h:5432\"]\npassword = \"\"", "relay.postgres"),
            ("[relay.postgres.\"app@h:5432\"]\npassword = \"env:\"", "relay.postgres"),
            ("[relay.postgres.\"app@h:5432\"]\npasword = \"x\"", "pasword"),
        ] {
            let error = load_text(text).unwrap_err();
            assert_eq!(error.code(), codes::INVALID_CONFIG, "{text}");
            assert!(error.to_string().contains(key), "{text}: {error}");
        }
        assert_eq!(
            Config::load(Some(Path::new("/nonexistent/t.toml")), &Overrides::default()).unwrap_err().code(),
            codes::INVALID_CONFIG
        );
        let error = load_text("[relay.amqp_credentials]\n\"h:5672\" = \"secretwithoutuser\"").unwrap_err();
        assert!(!error.to_string().contains("secretwithoutuser"), "never the value: {error}");
    }

    #[test]
    fn sources_of_each_kind_reach_the_transport_with_their_defaults() {
        let config = load_text(
            "[[sources]]\ntenant = \"shipping\"\nconsumer = \"ledger\"\nfrom = \"nats://h/orders\"\nstream = \"ORDERS\"\n\
             [[sources]]\ntenant = \"shipping\"\nconsumer = \"ledger\"\nfrom = \"kafka://k1:9092,k2:9092/orders\"\n\
             batch = 50\n\
             [[sources]]\ntenant = \"shipping\"\nconsumer = \"ledger\"\nfrom = \"amqp://rabbit/shipping.orders\"\n",
        )
        .unwrap();
        let specs: Vec<tidemark_transport::SourceSpec> = config.sources.iter().map(|s| s.spec().unwrap()).collect();
        assert_eq!(
            specs,
            [
                tidemark_transport::SourceSpec::Nats(tidemark_transport::NatsSourceConfig {
                    from: "nats://h/orders".into(),
                    stream: "ORDERS".into(),
                    durable: "tidemark-shipping-ledger".into(),
                    batch: 100,
                    ack_wait_ms: 30_000,
                }),
                tidemark_transport::SourceSpec::Kafka(tidemark_transport::KafkaSourceConfig {
                    from: "kafka://k1:9092,k2:9092/orders".into(),
                    group: "tidemark-shipping-ledger".into(),
                    batch: 50,
                    session_timeout_ms: 45_000,
                }),
                tidemark_transport::SourceSpec::Amqp(tidemark_transport::AmqpSourceConfig {
                    from: "amqp://rabbit/shipping.orders".into(),
                    consumer_tag: "tidemark-shipping-ledger".into(),
                    batch: 100,
                }),
            ]
        );
        let transport = config.transport_config();
        assert!(transport.message_timeout < std::time::Duration::from_millis(config.relay.attempt_timeout_ms));
    }

    #[test]
    fn amqp_credentials_reach_the_transports() {
        let config =
            load_text("[relay.amqp_credentials]\n\"localhost:5672\" = \"relay:pw\"\n\"[::1]:5673\" = \"env:AMQP\"\n")
                .unwrap();
        let transport = config.transport_config();
        assert_eq!(transport.amqp_credentials("localhost:5672").unwrap(), ("relay".into(), "pw".into()));
        assert_eq!(transport.amqp_credentials.get("[::1]:5673").map(String::as_str), Some("env:AMQP"));
    }

    #[test]
    fn postgres_endpoints_reach_the_transports_and_only_listed_ones_connect() {
        let config = load_text(
            "[relay.postgres.\"app@db2:5432\"]\npassword = \"pw\"\n\
             [relay.postgres.\"relay@[::1]:5433\"]\npassword = \"env:TIDEMARK_TEST_UNSET_PW\"\n\
             [relay.postgres.\"trusted@127.0.0.1:5432\"]\n",
        )
        .unwrap();
        let transport = config.transport_config();
        assert_eq!(transport.postgres_password("app", "db2:5432").unwrap(), Some("pw".into()));
        assert_eq!(transport.postgres_password("trusted", "127.0.0.1:5432").unwrap(), None);
        let error = transport.postgres_password("relay", "[::1]:5433").unwrap_err();
        assert_eq!(error.code(), codes::INVALID_CONFIG);
        assert!(error.to_string().contains("TIDEMARK_TEST_UNSET_PW"), "{error}");
        let error = transport.postgres_password("postgres", "db2:5432").unwrap_err();
        assert_eq!(error.code(), codes::INVALID_CONFIG);
        assert!(error.to_string().contains("postgres@db2:5432"), "{error}");
    }

    #[test]
    fn the_per_address_connection_limit_is_off_by_default_and_bounded() {
        assert_eq!(load_text("").unwrap().limits.connections_per_address_max, 0);
        assert_eq!(
            load_text("[limits]\nconnections_per_address_max = 100000\n").unwrap().limits.connections_per_address_max,
            100_000
        );
        let error = load_text("[limits]\nconnections_per_address_max = 100001\n").unwrap_err();
        assert!(error.to_string().contains("limits.connections_per_address_max"), "{error}");
        assert!(load_text("[limits]\nconnections_per_address_max = -1\n").is_err());
    }

    #[test]
    fn a_refusal_is_held_a_tenth_of_a_second_by_default_and_at_most_ten() {
        assert_eq!(load_text("").unwrap().auth.refusal_delay_ms, 100);
        assert_eq!(load_text("[auth]\nrefusal_delay_ms = 0\n").unwrap().auth.refusal_delay_ms, 0);
        let error = load_text("[auth]\nrefusal_delay_ms = 10001\n").unwrap_err();
        assert_eq!(error.code(), codes::INVALID_CONFIG);
        assert!(error.to_string().contains("auth.refusal_delay_ms"), "{error}");
    }

    #[test]
    fn a_page_holds_a_mebibyte_by_default_and_its_bound_is_bounded() {
        assert_eq!(load_text("").unwrap().limits.page_bytes_max, 1024 * 1024);
        assert_eq!(load_text("[limits]\npage_bytes_max = 16384\n").unwrap().limits.page_bytes_max, 16_384);
        for bad in ["16383", "268435457"] {
            let error = load_text(&format!("[limits]\npage_bytes_max = {bad}\n")).unwrap_err();
            assert_eq!(error.code(), codes::INVALID_CONFIG);
            assert!(error.to_string().contains("limits.page_bytes_max"), "{error}");
        }
    }

    #[test]
    fn the_busy_header_timeout_is_a_second_by_default_and_bounded() {
        assert_eq!(load_text("").unwrap().limits.busy_header_timeout_ms, 1_000);
        assert_eq!(load_text("[limits]\nbusy_header_timeout_ms = 100\n").unwrap().limits.busy_header_timeout_ms, 100);
        for bad in ["99", "600001"] {
            let error = load_text(&format!("[limits]\nbusy_header_timeout_ms = {bad}\n")).unwrap_err();
            assert_eq!(error.code(), codes::INVALID_CONFIG);
            assert!(error.to_string().contains("limits.busy_header_timeout_ms"), "{error}");
        }
    }

    #[test]
    fn flags_override_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tidemark.toml");
        std::fs::write(&path, "listen = \"127.0.0.1:9000\"").unwrap();
        let overrides = Overrides { listen: Some("127.0.0.1:9001".into()), ..Overrides::default() };
        assert_eq!(Config::load(Some(&path), &overrides).unwrap().listen, "127.0.0.1:9001");
    }
}
