//! tidemark-transport: hand outbox events to endpoints on other machines.
//!
//! A [`Transport`] delivers one batch of events to one endpoint and answers one
//! [`ReceiveOutcome`] per event, each only after the endpoint took custody as its kind defines it
//! (docs/protocol.md, "Endpoints"). [`connect`] builds the transport an endpoint string names.
//! The relay lanes of `tidemark serve` (one per endpoint, so that a slow or unreachable endpoint
//! never delays the others) call them with a per-attempt timeout; an error or a timeout is a
//! failed attempt, retried with the relay's backoff and quarantined after `max_attempts`, never
//! an `accepted`.
//!
//! Kinds built here: `http(s)://` (another tidemark's inbox), `nats://` (JetStream),
//! `amqp://` (RabbitMQ, publisher confirms), `kafka://` (librdkafka's idempotent producer,
//! `acks=all`) and `postgres://` (a consumer schema's inbox on any PostgreSQL server, written in
//! one inbox transaction). File endpoints are delivered by `tidemark_store_sqlite::SqliteEndpoints`.
//!
//! The consuming side of the brokers ([`Source`]): a JetStream durable pull consumer
//! ([`NatsSource`]), a Kafka consumer group ([`KafkaSource`]) or a RabbitMQ queue
//! ([`AmqpSource`]) read into an [`Inbox`], acking or committing offsets only after the inbox
//! transaction committed.
#![warn(missing_docs)]

mod amqp;
mod amqp_source;
pub mod http;
mod kafka;
mod kafka_source;
mod nats;
mod postgres;
mod source;

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tidemark_core::endpoint::{Endpoint, EndpointKind};
use tidemark_core::error::codes;
use tidemark_core::store::ReceiveOutcome;
use tidemark_core::{Envelope, Error, Result};

pub use amqp::{routing_key as amqp_routing_key, AmqpTransport};
pub use amqp_source::{AmqpSource, AmqpSourceConfig};
pub use http::HttpTransport;
pub use kafka::{headers as kafka_headers, key as kafka_key, KafkaTransport};
pub use kafka_source::{KafkaSource, KafkaSourceConfig};
pub use nats::{subject as nats_subject, NatsTransport};
pub use postgres::PostgresTransport;
pub use source::{
    Inbox, NatsSource, NatsSourceConfig, Source, SourceReport, SourceSettings, SourceSpec,
    KAFKA_SESSION_TIMEOUT_MS_DEFAULT, NATS_ACK_WAIT_MS_DEFAULT,
};

/// What a delivery resolves to: one outcome per event, in order, or the reason it failed.
pub type Delivered<'a> = Pin<Box<dyn Future<Output = Result<Vec<ReceiveOutcome>>> + Send + 'a>>;

/// One endpoint's connection (a client, a broker channel), kept by its relay lane.
pub trait Transport: Send + Sync {
    /// The endpoint's kind.
    fn kind(&self) -> EndpointKind;
    /// Hand `items` (the subscriber's consumer id and the envelope, in delivery order) to the
    /// endpoint. Resolves to one outcome per item once the endpoint took custody of it (or
    /// refused it), or to an error that fails every item. Dropping the future (the lane's
    /// timeout) abandons the attempt: what the endpoint did with it is learnt on the next attempt,
    /// which it answers `duplicate` for what it already holds.
    fn deliver<'a>(&'a self, items: &'a [(String, Envelope)]) -> Delivered<'a>;
}

/// How transports connect: the delivering side's configuration (`[relay]` in `tidemark serve`'s
/// configuration file). Secrets live here, never in the producer database.
#[derive(Debug, Clone)]
pub struct TransportConfig {
    /// Bearer tokens of HTTP endpoints by origin (`http://host:port`, the port always spelled
    /// out): the token itself, or `env:NAME` to read it from the environment variable `NAME`.
    pub http_tokens: BTreeMap<String, String>,
    /// Credentials of RabbitMQ brokers by server (`host:port`, as the endpoint's or source's
    /// server is spelled: the port always spelled out), for the relay's `amqp://` endpoints and
    /// for `amqp://` sources alike: `user:password`, or `env:NAME` to read `user:password` from
    /// the environment variable `NAME`. A broker with no entry is connected to as `guest:guest`
    /// (RabbitMQ's default user, which it accepts from loopback only).
    pub amqp_credentials: BTreeMap<String, String>,
    /// The PostgreSQL servers and users `postgres://` endpoints may write as, by `user@host:port`
    /// (the endpoint's user and server, the port always spelled out), each with its password: the
    /// password, `env:NAME` to read it from the environment variable `NAME`, or none (trust, peer
    /// or certificate authentication). An endpoint whose user and server are not listed is never
    /// connected to: a tenant who may subscribe must not be able to point the relay at any
    /// schema the service's machine can reach.
    pub postgres_endpoints: BTreeMap<String, Option<String>>,
    /// How long connecting may take, at most (the lane's attempt timeout bounds the whole
    /// delivery). For Kafka, also how long a topic the cluster does not know may take to
    /// appear before its records fail as "unknown topic".
    pub connect_timeout: Duration,
    /// How long a broker client may keep trying to hand one message over before it reports it
    /// failed (Kafka: librdkafka's `message.timeout.ms`, at least 100 ms). `tidemark serve` sets
    /// it a little under `relay.attempt_timeout_ms`, so that a lane records the broker's reason
    /// (a broker down, a message timed out) rather than its own timeout.
    pub message_timeout: Duration,
    /// A PEM file of root certificates trusted for `https://` endpoints besides the system's
    /// (a private CA, a self-signed receiver); read when a lane connects.
    pub http_ca_file: Option<std::path::PathBuf>,
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            http_tokens: BTreeMap::new(),
            amqp_credentials: BTreeMap::new(),
            postgres_endpoints: BTreeMap::new(),
            connect_timeout: Duration::from_secs(5),
            message_timeout: Duration::from_secs(30),
            http_ca_file: None,
        }
    }
}

impl TransportConfig {
    /// The bearer token configured for `origin`: `invalid_config` when none is, or when it names
    /// an environment variable that is not set.
    pub fn http_token(&self, origin: &str) -> Result<String> {
        let configured = self.http_tokens.get(origin).ok_or_else(|| {
            Error::invalid(
                codes::INVALID_CONFIG,
                format!("no bearer token for {origin}: set relay.tokens.\"{origin}\" (the token, or env:NAME)"),
            )
        })?;
        match configured.strip_prefix("env:") {
            Some(name) => std::env::var(name).map_err(|_| {
                Error::invalid(
                    codes::INVALID_CONFIG,
                    format!("relay.tokens.\"{origin}\" names the environment variable {name}, which is not set"),
                )
            }),
            None => Ok(configured.clone()),
        }
    }

    /// The user and password to connect to the RabbitMQ broker `server` (`host:port`) with:
    /// `guest`/`guest` when none is configured; `invalid_config` when the entry names an
    /// environment variable that is not set, or its value is not `user:password`.
    pub fn amqp_credentials(&self, server: &str) -> Result<(String, String)> {
        let Some(configured) = self.amqp_credentials.get(server) else {
            return Ok(("guest".to_string(), "guest".to_string()));
        };
        let key = format!("relay.amqp_credentials.\"{server}\"");
        let value = match configured.strip_prefix("env:") {
            Some(name) => std::env::var(name).map_err(|_| {
                Error::invalid(
                    codes::INVALID_CONFIG,
                    format!("{key} names the environment variable {name}, which is not set"),
                )
            })?,
            None => configured.clone(),
        };
        match value.split_once(':') {
            Some((user, password)) if !user.is_empty() => Ok((user.to_string(), password.to_string())),
            // Never the value itself: it holds the password.
            _ => Err(Error::invalid(codes::INVALID_CONFIG, format!("{key} is not user:password"))),
        }
    }

    /// The password to connect to the PostgreSQL server `server` (`host:port`) as `user` with
    /// (`None`: no password); `invalid_config` when the user and server are not listed in
    /// [`TransportConfig::postgres_endpoints`], or their entry names an environment variable that
    /// is not set.
    pub fn postgres_password(&self, user: &str, server: &str) -> Result<Option<String>> {
        let key = format!("{user}@{server}");
        let entry = self.postgres_endpoints.get(&key).ok_or_else(|| {
            Error::invalid(
                codes::INVALID_CONFIG,
                format!(
                    "{key} is not a PostgreSQL endpoint this relay writes to: list it as [relay.postgres.\"{key}\"] \
                     (with its password, if it needs one)"
                ),
            )
        })?;
        match entry.as_deref().map(|p| (p, p.strip_prefix("env:"))) {
            None => Ok(None),
            Some((_, Some(name))) => std::env::var(name).map(Some).map_err(|_| {
                Error::invalid(
                    codes::INVALID_CONFIG,
                    format!(
                        "relay.postgres.\"{key}\".password names the environment variable {name}, which is not set"
                    ),
                )
            }),
            Some((password, None)) => Ok(Some(password.to_string())),
        }
    }
}

/// The transport of a network endpoint. A file endpoint is `invalid_endpoint` here (files are
/// delivered on the producer's thread, by the store crate), and so is a pull consumer (it reads
/// the feed); a missing token, or AMQP credentials from an unset variable, is `invalid_config`.
/// Broker transports connect on their first delivery, not here.
pub fn connect(endpoint: &str, config: &TransportConfig) -> Result<Arc<dyn Transport>> {
    match Endpoint::parse(endpoint)? {
        Endpoint::Http { url, origin, .. } => {
            Ok(Arc::new(HttpTransport::new(&url, config.http_token(&origin)?, config)?))
        }
        Endpoint::Nats { server, subject_prefix } => Ok(Arc::new(NatsTransport::new(&server, &subject_prefix, config))),
        Endpoint::Amqp { server, exchange } => Ok(Arc::new(AmqpTransport::new(&server, &exchange, config)?)),
        Endpoint::Kafka { bootstrap, topic } => Ok(Arc::new(KafkaTransport::new(&bootstrap, &topic, config))),
        Endpoint::Postgres { server, user, .. } => {
            Ok(Arc::new(PostgresTransport::new(endpoint, &server, &user, config)?))
        }
        Endpoint::Pull => Err(Error::invalid(
            codes::INVALID_ENDPOINT,
            "a pull consumer is never pushed to: it reads GET /v1/outbox/feed",
        )),
        Endpoint::Sqlite { .. } => Err(Error::invalid(
            codes::INVALID_ENDPOINT,
            format!("{endpoint} is a consumer database file: the producer's own thread delivers to files"),
        )),
    }
}

/// Split items of the given encoded `sizes` (in bytes) into consecutive ranges of at most
/// `max_items` items and at most `max_bytes` in all (an item larger than that alone is a range of
/// its own).
pub fn chunk_ranges(sizes: &[usize], max_items: usize, max_bytes: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, &size) in sizes.iter().enumerate() {
        if i > start && (i - start == max_items || bytes + size > max_bytes) {
            out.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += size;
    }
    if start < sizes.len() {
        out.push(start..sizes.len());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_respect_both_bounds_and_keep_order() {
        let lens = |ranges: Vec<std::ops::Range<usize>>| ranges.iter().map(|r| r.len()).collect::<Vec<_>>();
        let sizes = [10; 7];
        assert_eq!(lens(chunk_ranges(&sizes, 3, usize::MAX)), [3, 3, 1]);
        assert_eq!(lens(chunk_ranges(&sizes, 100, 20)), [2, 2, 2, 1]);
        assert_eq!(
            chunk_ranges(&sizes, 2, usize::MAX).into_iter().flatten().collect::<Vec<_>>(),
            (0..7).collect::<Vec<_>>()
        );
        assert_eq!(chunk_ranges(&[1000], 10, 10).len(), 1, "an item over the byte bound is sent alone");
        assert!(chunk_ranges(&[], 10, 10).is_empty());
    }

    #[test]
    fn connect_refuses_what_it_cannot_deliver_with_typed_errors() {
        let config = TransportConfig::default();
        let code = |endpoint: &str, config: &TransportConfig| connect(endpoint, config).err().expect(endpoint).code();
        assert_eq!(code("/tmp/inbox.db", &config), codes::INVALID_ENDPOINT);
        assert_eq!(code("gopher://h/x", &config), codes::INVALID_ENDPOINT);
        assert_eq!(code("http://127.0.0.1:9/v1/consumers/c/inbox", &config), codes::INVALID_CONFIG);
        assert_eq!(code("pull:", &config), codes::INVALID_ENDPOINT);
        assert_eq!(code("kafka://h", &config), codes::INVALID_ENDPOINT, "no topic");
        let kafka = connect("kafka://127.0.0.1:9,127.0.0.1:10/orders.v1", &config).expect("kafka has a transport");
        assert_eq!(kafka.kind(), EndpointKind::Kafka);
        let mut config = TransportConfig::default();
        config.http_tokens.insert("http://127.0.0.1:9".into(), "env:TIDEMARK_TEST_TOKEN_THAT_IS_NOT_SET".into());
        assert_eq!(code("http://127.0.0.1:9/v1/consumers/c/inbox", &config), codes::INVALID_CONFIG);
        config.http_tokens.insert("http://127.0.0.1:9".into(), "tok".into());
        assert!(connect("http://127.0.0.1:9/v1/consumers/c/inbox", &config).is_ok());
        assert!(connect("amqp://127.0.0.1:9/x", &config).is_ok(), "no credentials configured: guest");
        config.amqp_credentials.insert("127.0.0.1:9".into(), "env:TIDEMARK_TEST_AMQP_THAT_IS_NOT_SET".into());
        assert_eq!(code("amqp://127.0.0.1:9/x", &config), codes::INVALID_CONFIG);
        config.amqp_credentials.insert("127.0.0.1:9".into(), "nopassword".into());
        let error = connect("amqp://127.0.0.1:9/x", &config).err().unwrap();
        assert_eq!(error.code(), codes::INVALID_CONFIG);
        assert!(!error.to_string().contains("nopassword"), "the value is never printed: {error}");
    }

    #[test]
    fn a_postgres_endpoint_connects_only_as_a_listed_user_and_server() {
        let mut config = TransportConfig::default();
        let endpoint = "postgres://app@127.0.0.1:9/shop?schema=shipping_inbox";
        let error = connect(endpoint, &config).err().expect("not listed");
        assert_eq!(error.code(), codes::INVALID_CONFIG);
        assert!(error.to_string().contains("app@127.0.0.1:9"), "{error}");
        config.postgres_endpoints.insert("app@127.0.0.1:9".into(), None);
        let transport = connect(endpoint, &config).expect("listed, no password");
        assert_eq!(transport.kind(), EndpointKind::Postgres);
        config.postgres_endpoints.insert("app@127.0.0.1:9".into(), Some("env:TIDEMARK_TEST_PG_THAT_IS_NOT_SET".into()));
        assert_eq!(connect(endpoint, &config).err().unwrap().code(), codes::INVALID_CONFIG);
        assert_eq!(
            connect("postgres://app:pw@127.0.0.1:9/shop?schema=s", &config).err().unwrap().code(),
            codes::INVALID_ENDPOINT
        );
    }

    #[test]
    fn amqp_credentials_are_configured_per_server_or_guest() {
        let mut config = TransportConfig::default();
        assert_eq!(config.amqp_credentials("h:5672").unwrap(), ("guest".into(), "guest".into()));
        config.amqp_credentials.insert("h:5672".into(), "relay:s3:cr:et".into());
        assert_eq!(config.amqp_credentials("h:5672").unwrap(), ("relay".into(), "s3:cr:et".into()));
        assert_eq!(config.amqp_credentials("h:5673").unwrap().0, "guest", "keyed by host and port");
        std::env::set_var("TIDEMARK_TEST_AMQP_CREDENTIALS_OF_THIS_TEST", "envuser:envpw");
        config.amqp_credentials.insert("h:5672".into(), "env:TIDEMARK_TEST_AMQP_CREDENTIALS_OF_THIS_TEST".into());
        assert_eq!(config.amqp_credentials("h:5672").unwrap(), ("envuser".into(), "envpw".into()));
        config.amqp_credentials.insert("h:5672".into(), ":pw".into());
        assert_eq!(config.amqp_credentials("h:5672").unwrap_err().code(), codes::INVALID_CONFIG);
    }
}
