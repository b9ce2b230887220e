//! Endpoints that are consumer schemas: on the producer's own server (the endpoint string is the
//! schema's name), or on any server (a `postgres://user@host:port/db?schema=S` endpoint), each
//! opened once and kept.

use std::collections::HashMap;

use tidemark_core::endpoint::Endpoint;
use tidemark_core::error::codes;
use tidemark_core::store::{ConsumerStore, Endpoints, ReceiveOutcome};
use tidemark_core::{Envelope, Error, Result};

use crate::PgConsumer;

/// Consumer schemas the relay delivers to: each is opened on first use (never created) and kept
/// for the relay's next passes, reopened when the server closed its connection, and dropped
/// after a failed delivery (the next attempt connects again). A schema that cannot be opened is
/// a failed delivery attempt. A schema's name is a schema on the server [`PgEndpoints::new`]
/// names; a `postgres://` endpoint names its own server, connected to with the password given to
/// [`PgEndpoints::with_password`] (none by default).
pub struct PgEndpoints {
    conn: Option<String>,
    password: Option<String>,
    open: HashMap<String, PgConsumer>,
}

impl PgEndpoints {
    /// Schemas named by name on the server `conn` names, and `postgres://` endpoints.
    pub fn new(conn: &str) -> Self {
        PgEndpoints { conn: Some(conn.to_string()), password: None, open: HashMap::new() }
    }

    /// `postgres://` endpoints only (a producer of another backend has no server of its own).
    pub fn remote() -> Self {
        PgEndpoints { conn: None, password: None, open: HashMap::new() }
    }

    /// Connect to `postgres://` endpoints with `password` (the delivering side's: endpoints never
    /// carry one).
    pub fn with_password(mut self, password: Option<String>) -> Self {
        self.password = password;
        self
    }

    fn open_store(&self, endpoint: &str) -> Result<PgConsumer> {
        if let Ok(Endpoint::Postgres { conn, schema, .. }) = Endpoint::parse(endpoint) {
            return PgConsumer::open(&with_password(&conn, self.password.as_deref())?, &schema);
        }
        match &self.conn {
            Some(conn) => PgConsumer::open(conn, endpoint),
            None => Err(Error::invalid(
                codes::INVALID_ENDPOINT,
                format!("{} is not a postgres:// endpoint", tidemark_core::endpoint::mask(endpoint)),
            )),
        }
    }

    /// The consumer store of `endpoint`, opened on first use and kept.
    pub fn store(&mut self, endpoint: &str) -> Result<&mut PgConsumer> {
        if let Some(open) = self.open.get_mut(endpoint) {
            // The server closed its connection (a restart): a new one, or a failed attempt.
            open.reconnect_if_closed()?;
        }
        if !self.open.contains_key(endpoint) {
            let consumer = self.open_store(endpoint)?;
            self.open.insert(endpoint.to_string(), consumer);
        }
        Ok(self.open.get_mut(endpoint).expect("just inserted"))
    }
}

/// The connection string `conn` (a `postgres://` endpoint's, which never holds a password) with
/// `password` set in it.
pub fn with_password(conn: &str, password: Option<&str>) -> Result<String> {
    let mut url = url::Url::parse(conn).map_err(|e| Error::Invariant(format!("a parsed endpoint: {e}")))?;
    if let Some(password) = password {
        url.set_password(Some(password)).map_err(|()| Error::Invariant("a URL with a host".into()))?;
    }
    Ok(url.to_string())
}

impl Endpoints for PgEndpoints {
    fn deliver(&mut self, endpoint: &str, items: &[(&str, &Envelope)], now_ms: i64) -> Result<Vec<ReceiveOutcome>> {
        let delivered = self.store(endpoint)?.receive_batch(items, now_ms);
        if delivered.is_err() {
            // A broken connection is not kept; the next attempt connects again.
            self.open.remove(endpoint);
        }
        delivered
    }
}
