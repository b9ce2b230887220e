//! Endpoints that are consumer database paths, opened once per relay and kept open.

use std::collections::HashMap;
use std::path::Path;

use tidemark_core::store::Endpoints;
use tidemark_core::Result;

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

impl Endpoints for SqliteEndpoints {
    type Store = SqliteConsumer;

    fn store(&mut self, endpoint: &str) -> Result<&mut SqliteConsumer> {
        if !self.open.contains_key(endpoint) {
            let consumer = SqliteConsumer::open_with(Path::new(endpoint), self.durability)?;
            self.open.insert(endpoint.to_string(), consumer);
        }
        Ok(self.open.get_mut(endpoint).expect("just inserted"))
    }
}
