//! Endpoints that are consumer database paths, opened once per relay and kept open.

use std::collections::HashMap;
use std::path::Path;

use tidemark_core::store::Endpoints;
use tidemark_core::Result;

use crate::{Durability, SqliteConsumer};

#[derive(Default)]
pub struct SqliteEndpoints {
    open: HashMap<String, SqliteConsumer>,
    durability: Durability,
}

impl SqliteEndpoints {
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
