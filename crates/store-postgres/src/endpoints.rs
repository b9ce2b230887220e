//! Endpoints that are consumer schemas on one PostgreSQL server, opened once and kept.

use std::collections::HashMap;

use tidemark_core::store::{ConsumerStore, Endpoints, ReceiveOutcome};
use tidemark_core::{Envelope, Result};

use crate::PgConsumer;

/// Endpoints that are consumer schemas on one server (the endpoint string is the schema's name):
/// each is opened on first use (never created) and kept for the relay's next passes. A schema
/// that cannot be opened is a failed delivery attempt. (A `postgres://` endpoint URL, for a
/// consumer on another server, comes with the server's PostgreSQL wiring.)
pub struct PgEndpoints {
    conn: String,
    open: HashMap<String, PgConsumer>,
}

impl PgEndpoints {
    /// No schema open yet; each will be opened on the server `conn` names.
    pub fn new(conn: &str) -> Self {
        PgEndpoints { conn: conn.to_string(), open: HashMap::new() }
    }

    /// The consumer store of the schema `endpoint`, opened on first use and kept.
    pub fn store(&mut self, endpoint: &str) -> Result<&mut PgConsumer> {
        if let Some(open) = self.open.get_mut(endpoint) {
            // The server closed its connection (a restart): a new one, or a failed attempt.
            open.reconnect_if_closed()?;
        }
        if !self.open.contains_key(endpoint) {
            let consumer = PgConsumer::open(&self.conn, endpoint)?;
            self.open.insert(endpoint.to_string(), consumer);
        }
        Ok(self.open.get_mut(endpoint).expect("just inserted"))
    }
}

impl Endpoints for PgEndpoints {
    fn deliver(&mut self, endpoint: &str, items: &[(&str, &Envelope)], now_ms: i64) -> Result<Vec<ReceiveOutcome>> {
        self.store(endpoint)?.receive_batch(items, now_ms)
    }
}
