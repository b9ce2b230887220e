//! Events through the inbox into workflow runs on SQLite: [`RunEventHandler`] (see
//! `tidemark_core::run_events`) on a consumer database that is the workflow database (one
//! file).

use rusqlite::Connection;
use serde_json::Value;
pub use tidemark_core::run_events::{RunEventSend, RUN_ID_FIELD_DEFAULT};
use tidemark_core::Result;

/// How a run event is stored on SQLite: [`crate::send_event_in`].
#[derive(Debug, Clone, Copy, Default)]
pub struct SqliteRunEvents;

impl RunEventSend for SqliteRunEvents {
    type Tx = Connection;
    fn send(tx: &Connection, run_id: &str, event_id: &str, name: &str, payload: &Value, now_ms: i64) -> Result<bool> {
        crate::send_event_in(tx, run_id, event_id, name, payload, now_ms)
    }
}

/// Delivers applied inbox events to workflow runs on SQLite (see
/// [`tidemark_core::run_events::RunEventHandler`]).
pub type RunEventHandler = tidemark_core::run_events::RunEventHandler<SqliteRunEvents>;
