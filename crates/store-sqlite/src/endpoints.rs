//! Endpoints that are consumer database paths, opened once per relay and kept open.

use std::collections::HashMap;
use std::path::Path;

use tidemark_core::endpoint::Endpoint;
use tidemark_core::error::codes;
use tidemark_core::store::{ConsumerStore, Endpoints, ReceiveOutcome};
use tidemark_core::{Envelope, Error, Result};

use crate::{Durability, SqliteConsumer};

/// Endpoints that are consumer database paths: each is opened on first use (never created) and kept
/// open for the relay's next passes. A path that cannot be opened is a failed delivery attempt.
#[derive(Default)]
pub struct SqliteEndpoints {
    open: HashMap<String, SqliteConsumer>,
    durability: Durability,
}

impl SqliteEndpoints {
    /// No database open yet; each will be opened with `durability`.
    pub fn new(durability: Durability) -> Self {
        SqliteEndpoints { open: HashMap::new(), durability }
    }
}

impl SqliteEndpoints {
    /// The consumer store of a file endpoint (a path or `sqlite:` URL), opened on first use and
    /// kept. Any other kind is `invalid_endpoint`: this type delivers to files only.
    pub fn store(&mut self, endpoint: &str) -> Result<&mut SqliteConsumer> {
        if !self.open.contains_key(endpoint) {
            let Endpoint::Sqlite { path } = Endpoint::parse(endpoint)? else {
                return Err(Error::invalid(
                    codes::INVALID_ENDPOINT,
                    format!(
                        "{} is a {} endpoint; this relay delivers to consumer database files only \
                         (`tidemark serve` delivers to every kind)",
                        tidemark_core::endpoint::mask(endpoint),
                        tidemark_core::endpoint::kind_of(endpoint)?
                    ),
                ));
            };
            let consumer = SqliteConsumer::open_with(Path::new(&path), self.durability)?;
            self.open.insert(endpoint.to_string(), consumer);
        }
        Ok(self.open.get_mut(endpoint).expect("just inserted"))
    }
}

impl Endpoints for SqliteEndpoints {
    fn deliver(&mut self, endpoint: &str, items: &[(&str, &Envelope)], now_ms: i64) -> Result<Vec<ReceiveOutcome>> {
        self.store(endpoint)?.receive_batch(items, now_ms)
    }
}
