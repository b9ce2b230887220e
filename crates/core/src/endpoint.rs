//! Where a subscriber's events go: an endpoint string, one kind each (docs/protocol.md,
//! "Endpoints").
//!
//! ```text
//! /path/to/consumer.db  or  sqlite:/path/to/consumer.db     a consumer database file on this machine
//! http(s)://host:port/v1/consumers/{id}/inbox               another tidemark's inbox (batch route)
//! nats://host:port/<subject prefix>                         NATS JetStream
//! amqp://host:port/<exchange>                               RabbitMQ (the default virtual host)
//! kafka://host:port[,host:port...]/<topic>                  Kafka
//! postgres://user@host:port/<database>?schema=<schema>      a consumer schema on a PostgreSQL server
//! pull:                                                     a pull consumer: nothing is pushed; it reads
//!                                                           GET /v1/outbox/feed and commits what it stored
//! ```
//!
//! Every endpoint is checked when it is subscribed ([`Endpoint::parse`]); anything else is
//! `invalid_endpoint` and nothing is written. No endpoint carries a secret: a URL with a password
//! is refused (and so is a user, but for `postgres://`, where the user is part of the address and
//! no secret), and the bearer token of an HTTP endpoint, a broker's credentials or a PostgreSQL
//! password come from the delivering side's configuration or environment, never from the
//! producer database.

use std::fmt;

use crate::error::codes;
use crate::id::validate_id;
use crate::limits::ENDPOINT_BYTES_MAX;
use crate::{Error, Result};

/// The kinds of endpoint, as their URL schemes name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum EndpointKind {
    /// A consumer database file on this machine (custody: the consumer's inbox transaction).
    Sqlite,
    /// Another tidemark's inbox over HTTP(S) (custody: the remote inbox transaction).
    Http,
    /// NATS JetStream (custody: the stream's PubAck).
    Nats,
    /// RabbitMQ (custody: the publisher confirm of a persistent, routed message).
    Amqp,
    /// Kafka (custody: an `acks=all` produce of the idempotent producer).
    Kafka,
    /// A pull consumer (custody: its commit call after it stored what it read from the feed).
    Pull,
    /// A consumer schema on a PostgreSQL server (custody: that schema's inbox transaction).
    Postgres,
}

impl EndpointKind {
    /// The kind's word (`sqlite`, `http`, `nats`, `amqp`, `kafka`, `pull`, `postgres`), as the API
    /// and metrics print it.
    pub fn as_str(self) -> &'static str {
        match self {
            EndpointKind::Sqlite => "sqlite",
            EndpointKind::Http => "http",
            EndpointKind::Nats => "nats",
            EndpointKind::Amqp => "amqp",
            EndpointKind::Kafka => "kafka",
            EndpointKind::Pull => "pull",
            EndpointKind::Postgres => "postgres",
        }
    }

    /// True when delivering hands the event to a broker rather than to a tidemark inbox: custody
    /// is then the broker's, and the consuming side's inbox gives the end-to-end guarantee.
    pub fn is_broker(self) -> bool {
        matches!(self, EndpointKind::Nats | EndpointKind::Amqp | EndpointKind::Kafka)
    }
}

impl fmt::Display for EndpointKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A parsed, checked endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// A consumer database file: the path as given (without a `sqlite:` prefix).
    Sqlite {
        /// The file's path.
        path: String,
    },
    /// A remote tidemark inbox.
    Http {
        /// The inbox URL as subscribed, `http(s)://host[:port][/prefix]/v1/consumers/{id}/inbox`.
        url: String,
        /// `scheme://host:port` (the port always spelled out): what a token is configured for.
        origin: String,
        /// The remote consumer id, from the URL's path.
        consumer_id: String,
    },
    /// A NATS JetStream subject prefix.
    Nats {
        /// `host:port` of the server (port 4222 when not given).
        server: String,
        /// The subject prefix: events are published to `<prefix>.<source>.<flow_id>`.
        subject_prefix: String,
    },
    /// A RabbitMQ exchange on the default virtual host.
    Amqp {
        /// `host:port` of the broker (port 5672 when not given).
        server: String,
        /// The exchange the relay publishes to (routing key `<source>.<flow_id>`).
        exchange: String,
    },
    /// A Kafka topic.
    Kafka {
        /// The bootstrap servers, `host:port` each.
        bootstrap: Vec<String>,
        /// The topic (key `<source>/<flow_id>`, so a flow stays in one partition).
        topic: String,
    },
    /// A pull consumer: the relay never pushes to it; it reads the outbox feed.
    Pull,
    /// A consumer schema on a PostgreSQL server, which the relay writes to as the consumer's inbox
    /// (the same transaction as a consumer file's).
    Postgres {
        /// `host:port` of the server (port 5432 when not given).
        server: String,
        /// The user the relay connects as (its password, if the server wants one, is the
        /// delivering side's: `relay.postgres_passwords`).
        user: String,
        /// The consumer's schema.
        schema: String,
        /// The driver's connection string: the endpoint without its `schema` parameter.
        conn: String,
    },
}

fn invalid(endpoint: &str, why: impl fmt::Display) -> Error {
    Error::invalid(codes::INVALID_ENDPOINT, format!("endpoint {:?}: {why}", mask(endpoint)))
}

/// The endpoint string with any user or password replaced by `***` (for error messages, logs and
/// the API); a `postgres://` URL keeps its user, which is no secret, and loses only a password.
/// Endpoints are refused when they carry a secret, so this only matters for what was refused.
pub fn mask(endpoint: &str) -> String {
    let Some(scheme_end) = endpoint.find("://") else { return endpoint.to_string() };
    let scheme = &endpoint[..scheme_end];
    let rest = &endpoint[scheme_end + 3..];
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let is_postgres = scheme.eq_ignore_ascii_case("postgres") || scheme.eq_ignore_ascii_case("postgresql");
    let masked = match rest[..authority_end].rfind('@') {
        None => endpoint.to_string(),
        Some(at) => match rest[..at].split_once(':') {
            Some((user, _)) if is_postgres => format!("{scheme}://{user}:***@{}", &rest[at + 1..]),
            None if is_postgres => endpoint.to_string(),
            _ => format!("{scheme}://***@{}", &rest[at + 1..]),
        },
    };
    if !is_postgres {
        return masked;
    }
    // A `password` parameter (refused, but named in the refusal) is masked too.
    let Some((address, query)) = masked.split_once('?') else { return masked };
    let parameters: Vec<String> = query
        .split('&')
        .map(|p| match p.split_once('=') {
            Some((key, _)) if key.eq_ignore_ascii_case("password") => format!("{key}=***"),
            _ => p.to_string(),
        })
        .collect();
    format!("{address}?{}", parameters.join("&"))
}

/// A subject token, exchange or topic name: 1..=`max` bytes of ASCII letters, digits, `_`, `-`
/// (and `.` where `dots` allows it, never leading, trailing or doubled).
fn validate_name(endpoint: &str, what: &str, value: &str, max: usize, dots: bool) -> Result<()> {
    let ok_char = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || (dots && b == b'.');
    if value.is_empty() || value.len() > max || !value.bytes().all(ok_char) {
        let allowed = if dots { "letters, digits, '_', '-' and '.'" } else { "letters, digits, '_' and '-'" };
        return Err(invalid(endpoint, format!("the {what} must be 1..={max} ASCII {allowed}, got {value:?}")));
    }
    if dots && (value.starts_with('.') || value.ends_with('.') || value.contains("..")) {
        return Err(invalid(endpoint, format!("the {what} {value:?} has an empty '.'-separated part")));
    }
    Ok(())
}

/// `host:port` from a parsed URL, with `default_port` when it names none.
fn server_of(endpoint: &str, url: &url::Url, default_port: u16) -> Result<String> {
    if !url.username().is_empty() || url.password().is_some() {
        return Err(invalid(
            endpoint,
            "it carries a user or password; endpoints are stored in the producer database in plain text, so \
             credentials come from the delivering side's configuration instead",
        ));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(invalid(endpoint, "it has a query or fragment; this kind takes neither"));
    }
    host_port(endpoint, url, default_port)
}

/// `host:port` of a parsed URL's host, with `default_port` when it names none.
fn host_port(endpoint: &str, url: &url::Url, default_port: u16) -> Result<String> {
    let host = match url.host() {
        Some(url::Host::Domain(d)) if !d.is_empty() => d.to_string(),
        Some(url::Host::Ipv4(ip)) => ip.to_string(),
        Some(url::Host::Ipv6(ip)) => format!("[{ip}]"),
        _ => return Err(invalid(endpoint, "it names no host")),
    };
    Ok(format!("{host}:{}", url.port().unwrap_or(default_port)))
}

/// The parameters a `postgres://` endpoint may carry besides `schema`: the driver's, and none of
/// them a secret (`password` is refused like a password in the URL's authority; `sslkey` names a
/// file of the delivering machine, never holds the key). Not `options`: a subscriber must not set
/// the relay's session (`-c role=...`) beyond what the configured user is.
const POSTGRES_PARAMETERS: [&str; 6] =
    ["sslmode", "sslrootcert", "sslcert", "sslkey", "connect_timeout", "application_name"];

fn parse_url(endpoint: &str) -> Result<url::Url> {
    url::Url::parse(endpoint).map_err(|e| invalid(endpoint, format!("not a URL: {e}")))
}

impl Endpoint {
    /// Check an endpoint string and say what it is. Anything but the forms in the module's
    /// documentation is `invalid_endpoint` (an unknown scheme, a malformed URL, a URL with a
    /// user or password, an HTTP path that is not a consumer's inbox, a bad subject, exchange or
    /// topic name); at most [`ENDPOINT_BYTES_MAX`] bytes.
    pub fn parse(endpoint: &str) -> Result<Endpoint> {
        if endpoint.is_empty() || endpoint.len() > ENDPOINT_BYTES_MAX {
            return Err(Error::invalid(
                codes::INVALID_ENDPOINT,
                format!("an endpoint must be 1..={ENDPOINT_BYTES_MAX} bytes, got {}", endpoint.len()),
            ));
        }
        if endpoint.chars().any(char::is_control) {
            return Err(invalid(endpoint, "it contains a control character"));
        }
        let Some(scheme_end) = endpoint.find(':').filter(|&i| {
            let scheme = &endpoint[..i];
            // A scheme is a letter then letters, digits, '+', '-', '.' (RFC 3986). Anything else
            // before the first ':' (a path like `./a:b.db`) is a plain path.
            scheme.len() > 1
                && scheme.as_bytes()[0].is_ascii_alphabetic()
                && scheme.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'-' || b == b'.')
        }) else {
            return Ok(Endpoint::Sqlite { path: endpoint.to_string() });
        };
        let scheme = endpoint[..scheme_end].to_ascii_lowercase();
        match scheme.as_str() {
            "sqlite" => {
                let path = endpoint[scheme_end + 1..].strip_prefix("//").unwrap_or(&endpoint[scheme_end + 1..]);
                if path.is_empty() {
                    return Err(invalid(endpoint, "it names no file"));
                }
                Ok(Endpoint::Sqlite { path: path.to_string() })
            }
            "http" | "https" => Self::parse_http(endpoint),
            "postgres" | "postgresql" => Self::parse_postgres(endpoint),
            "pull" => {
                if endpoint.len() > scheme_end + 1 {
                    return Err(invalid(endpoint, "a pull endpoint is exactly `pull:`"));
                }
                Ok(Endpoint::Pull)
            }
            "nats" => {
                let url = parse_url(endpoint)?;
                let server = server_of(endpoint, &url, 4222)?;
                let prefix = url.path().trim_start_matches('/');
                validate_name(endpoint, "subject prefix", prefix, 200, true)?;
                Ok(Endpoint::Nats { server, subject_prefix: prefix.to_string() })
            }
            "amqp" => {
                let url = parse_url(endpoint)?;
                let server = server_of(endpoint, &url, 5672)?;
                let exchange = url.path().trim_start_matches('/');
                validate_name(endpoint, "exchange", exchange, 255, true)?;
                Ok(Endpoint::Amqp { server, exchange: exchange.to_string() })
            }
            "kafka" => {
                // Not a URL: the authority is a comma-separated list of servers.
                let rest = &endpoint[scheme_end + 1..];
                let rest =
                    rest.strip_prefix("//").ok_or_else(|| invalid(endpoint, "expected kafka://servers/topic"))?;
                let (servers, topic) = rest
                    .split_once('/')
                    .ok_or_else(|| invalid(endpoint, "it names no topic (kafka://servers/topic)"))?;
                let mut bootstrap = Vec::new();
                for server in servers.split(',') {
                    let url = parse_url(&format!("kafka://{server}"))
                        .map_err(|_| invalid(endpoint, format!("bootstrap server {server:?} is not host:port")))?;
                    if !url.path().is_empty() {
                        return Err(invalid(endpoint, format!("bootstrap server {server:?} is not host:port")));
                    }
                    bootstrap.push(server_of(endpoint, &url, 9092)?);
                }
                validate_name(endpoint, "topic", topic, 249, true)?;
                Ok(Endpoint::Kafka { bootstrap, topic: topic.to_string() })
            }
            other => Err(invalid(
                endpoint,
                format!(
                    "unknown scheme {other:?}: expected a file path, sqlite:, http(s)://, nats://, amqp://, kafka://, \
                     postgres:// or pull:"
                ),
            )),
        }
    }

    fn parse_http(endpoint: &str) -> Result<Endpoint> {
        let url = parse_url(endpoint)?;
        let default_port = if url.scheme() == "https" { 443 } else { 80 };
        let server = server_of(endpoint, &url, default_port)?;
        let segments: Vec<&str> = url.path().trim_end_matches('/').split('/').collect();
        let n = segments.len();
        if n < 5 || segments[n - 4] != "v1" || segments[n - 3] != "consumers" || segments[n - 1] != "inbox" {
            return Err(invalid(
                endpoint,
                "an HTTP endpoint is a tidemark inbox, http(s)://host[:port][/prefix]/v1/consumers/{id}/inbox",
            ));
        }
        let consumer_id = segments[n - 2];
        validate_id("the consumer id in an HTTP endpoint", consumer_id).map_err(|e| invalid(endpoint, e))?;
        Ok(Endpoint::Http {
            url: endpoint.trim_end_matches('/').to_string(),
            origin: format!("{}://{server}", url.scheme()),
            consumer_id: consumer_id.to_string(),
        })
    }

    /// `postgres://user@host[:port]/database?schema=S[&sslmode=..&sslrootcert=..&...]`: the user is
    /// required (the address names whom the relay connects as), a password is refused (it is the
    /// delivering side's), `schema` is required and a valid schema name, and the other parameters
    /// are the driver's [`POSTGRES_PARAMETERS`], each at most once.
    fn parse_postgres(endpoint: &str) -> Result<Endpoint> {
        let mut url = parse_url(endpoint)?;
        if url.password().is_some() {
            return Err(invalid(
                endpoint,
                "it carries a password; endpoints are stored in the producer database in plain text, so the \
                 password comes from the delivering side's relay.postgres_passwords instead",
            ));
        }
        let user = url.username().to_string();
        if user.is_empty() {
            return Err(invalid(endpoint, "it names no user (postgres://user@host:port/database?schema=S)"));
        }
        validate_name(endpoint, "user", &user, 63, true)?;
        let server = host_port(endpoint, &url, 5432)?;
        if url.fragment().is_some() {
            return Err(invalid(endpoint, "it has a fragment"));
        }
        let database = url.path().trim_start_matches('/');
        validate_name(endpoint, "database", database, 63, false)?;
        let (mut schema, mut rest) = (None, Vec::new());
        for (key, value) in url.query_pairs() {
            let seen = key == "schema" && schema.replace(value.to_string()).is_some()
                || rest.iter().any(|(k, _): &(String, String)| *k == key);
            if seen {
                return Err(invalid(endpoint, format!("it names {key} twice")));
            }
            if key != "schema" {
                if !POSTGRES_PARAMETERS.contains(&key.as_ref()) {
                    return Err(invalid(
                        endpoint,
                        format!("unknown parameter {key:?}: a postgres:// endpoint takes schema and {POSTGRES_PARAMETERS:?}"),
                    ));
                }
                rest.push((key.to_string(), value.to_string()));
            }
        }
        let schema = schema.ok_or_else(|| invalid(endpoint, "it names no schema (?schema=S)"))?;
        crate::location::validate_schema_name(&schema).map_err(|e| invalid(endpoint, e))?;
        if rest.is_empty() {
            url.set_query(None);
        } else {
            url.query_pairs_mut().clear().extend_pairs(rest);
        }
        Ok(Endpoint::Postgres { server, user, schema, conn: url.to_string() })
    }

    /// The endpoint's kind.
    pub fn kind(&self) -> EndpointKind {
        match self {
            Endpoint::Sqlite { .. } => EndpointKind::Sqlite,
            Endpoint::Http { .. } => EndpointKind::Http,
            Endpoint::Nats { .. } => EndpointKind::Nats,
            Endpoint::Amqp { .. } => EndpointKind::Amqp,
            Endpoint::Kafka { .. } => EndpointKind::Kafka,
            Endpoint::Pull => EndpointKind::Pull,
            Endpoint::Postgres { .. } => EndpointKind::Postgres,
        }
    }
}

/// The kind of an endpoint string, or `invalid_endpoint`.
pub fn kind_of(endpoint: &str) -> Result<EndpointKind> {
    Endpoint::parse(endpoint).map(|e| e.kind())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(endpoint: &str) -> &'static str {
        Endpoint::parse(endpoint).expect_err(endpoint).code()
    }

    #[test]
    fn plain_paths_and_sqlite_urls_are_files() {
        for (given, path) in [
            ("/data/inbox.db", "/data/inbox.db"),
            ("inbox.db", "inbox.db"),
            ("./a:b.db", "./a:b.db"),
            ("sqlite:/data/inbox.db", "/data/inbox.db"),
            ("sqlite:///data/inbox.db", "/data/inbox.db"),
            ("sqlite:rel/inbox.db", "rel/inbox.db"),
        ] {
            assert_eq!(Endpoint::parse(given).unwrap(), Endpoint::Sqlite { path: path.into() }, "{given}");
        }
    }

    #[test]
    fn each_url_kind_is_parsed_with_its_defaults() {
        assert_eq!(
            Endpoint::parse("http://127.0.0.1:7401/v1/consumers/shipping/inbox").unwrap(),
            Endpoint::Http {
                url: "http://127.0.0.1:7401/v1/consumers/shipping/inbox".into(),
                origin: "http://127.0.0.1:7401".into(),
                consumer_id: "shipping".into()
            }
        );
        let Endpoint::Http { origin, .. } = Endpoint::parse("https://svc.example/api/v1/consumers/c/inbox/").unwrap()
        else {
            panic!()
        };
        assert_eq!(origin, "https://svc.example:443");
        assert_eq!(
            Endpoint::parse("nats://127.0.0.1/orders.events").unwrap(),
            Endpoint::Nats { server: "127.0.0.1:4222".into(), subject_prefix: "orders.events".into() }
        );
        assert_eq!(
            Endpoint::parse("amqp://localhost:5673/orders").unwrap(),
            Endpoint::Amqp { server: "localhost:5673".into(), exchange: "orders".into() }
        );
        assert_eq!(
            Endpoint::parse("kafka://k1:9093,k2/orders.v1").unwrap(),
            Endpoint::Kafka { bootstrap: vec!["k1:9093".into(), "k2:9092".into()], topic: "orders.v1".into() }
        );
        assert_eq!(kind_of("NATS://h/p").unwrap(), EndpointKind::Nats);
        assert_eq!(Endpoint::parse("pull:").unwrap(), Endpoint::Pull);
        assert_eq!(
            Endpoint::parse("postgres://app@db2/shop?schema=shipping_inbox").unwrap(),
            Endpoint::Postgres {
                server: "db2:5432".into(),
                user: "app".into(),
                schema: "shipping_inbox".into(),
                conn: "postgres://app@db2/shop".into()
            }
        );
        let Endpoint::Postgres { conn, server, .. } =
            Endpoint::parse("postgresql://app@127.0.0.1:5433/shop?sslmode=require&schema=s&connect_timeout=3").unwrap()
        else {
            panic!()
        };
        assert_eq!(
            (conn.as_str(), server.as_str()),
            ("postgresql://app@127.0.0.1:5433/shop?sslmode=require&connect_timeout=3", "127.0.0.1:5433")
        );
        assert_eq!(kind_of("POSTGRES://u@h/d?schema=s").unwrap(), EndpointKind::Postgres);
    }

    #[test]
    fn bad_endpoints_are_typed_errors() {
        for bad in [
            "",
            "ftp://host/x",
            "redis://host/x",
            "http://host/v1/runs",
            "http://host/v1/consumers/bad id/inbox",
            "http://user:secret@host/v1/consumers/c/inbox",
            "http://host/v1/consumers/c/inbox?x=1",
            "http:///v1/consumers/c/inbox",
            "nats://host",
            "nats://host/a.*",
            "nats://host/a..b",
            "nats://u:p@host/a",
            "amqp://host/",
            "kafka://host",
            "kafka://host/bad topic",
            "kafka://a:b:c/t",
            "sqlite:",
            "pull:x",
            "file\u{0}.db",
            "postgres://h/d?schema=s",
            "postgres://u:secret@h/d?schema=s",
            "postgres://u@h/d?schema=s&password=secret",
            "postgres://u@h/d",
            "postgres://u@h/?schema=s",
            "postgres://u@h/d?schema=S",
            "postgres://u@h/d?schema=pg_x",
            "postgres://u@h/d?schema=s&schema=t",
            "postgres://u@h/d?schema=s&sslmode=a&sslmode=b",
            "postgres://u@h/d?schema=s#f",
            "postgres://u@/d?schema=s",
            "postgres://u@h/d/e?schema=s",
            "postgres://u@h/d?schema=s&options=-c%20role%3Dother",
        ] {
            assert_eq!(code(bad), codes::INVALID_ENDPOINT, "{bad:?}");
        }
        assert_eq!(code(&"a".repeat(ENDPOINT_BYTES_MAX + 1)), codes::INVALID_ENDPOINT);
        for with_secret in [
            "http://user:secret@host/v1/consumers/c/inbox",
            "postgres://u:secret@h/d?schema=s",
            "postgres://u@h/d?schema=s&password=secret",
        ] {
            let message = Endpoint::parse(with_secret).unwrap_err().to_string();
            assert!(!message.contains("secret"), "{message}");
        }
    }

    #[test]
    fn mask_hides_credentials() {
        assert_eq!(mask("amqp://guest:guest@h:5672/x"), "amqp://***@h:5672/x");
        assert_eq!(mask("/a/b@c.db"), "/a/b@c.db");
        assert_eq!(mask("nats://h/a@b"), "nats://h/a@b");
        assert_eq!(mask("postgres://app:pw@h/d?schema=s"), "postgres://app:***@h/d?schema=s");
        assert_eq!(mask("postgres://app@h/d?schema=s"), "postgres://app@h/d?schema=s");
        assert_eq!(mask("postgres://app@h/d?password=pw&schema=s"), "postgres://app@h/d?password=***&schema=s");
    }
}
