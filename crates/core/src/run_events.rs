//! Events through the inbox into workflow runs: an inbox handler that turns each applied event
//! into a run event inside the apply transaction, on any backend whose consumer database is its
//! workflow database ([`RunEventSend`] says how a backend stores a run event in that
//! transaction: `tidemark_store_sqlite::workflow_events::RunEventHandler`,
//! `tidemark_store_postgres::RunEventHandler`).
//!
//! The inbox record is marked applied, the cursor moves and the run event is stored (waking the
//! run if it waits for that name) in one transaction, so the wake-up commits exactly once. A
//! redelivered event is a duplicate in the inbox and never reaches the handler; even if it did,
//! sending a run event is idempotent by event id (the envelope's). A failing handler, or a crash
//! before the commit, leaves the inbox record pending and the run as it was.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::store::{HandleError, Handler};
use crate::{Envelope, Error, Result};

/// How a backend stores a run event in an apply transaction of its workflow database.
pub trait RunEventSend {
    /// The apply transaction's handle.
    type Tx: ?Sized;
    /// Store the run event `event_id` (`name`, `payload`) for `run_id` in `tx`, waking the run if
    /// it waits for `name`; false when it was there already. Bad input, an unknown or finished
    /// run, or the same id with another body is an `Invalid` error.
    fn send(tx: &Self::Tx, run_id: &str, event_id: &str, name: &str, payload: &Value, now_ms: i64) -> Result<bool>;
}

/// The payload field that names the run an event is for, unless configured otherwise.
pub const RUN_ID_FIELD_DEFAULT: &str = "run_id";

type Clock = std::sync::Arc<dyn Fn() -> i64 + Send + Sync>;

/// Delivers applied inbox events to workflow runs.
///
/// - The run is the one named by the payload's `run_id` field (see [`Self::run_id_field`]).
/// - The run event's id is the envelope's `event_id`, its payload the envelope's payload, its
///   name the envelope's `event_type`, or the name given by [`Self::route`].
/// - With routes, events of other types are not for workflows: they are applied and nothing
///   else happens. Without routes, every event goes to a run.
/// - A semantic refusal blocks the record (and its flow) for an operator: a payload without a
///   run id, an unknown run, a run that has finished, an event id already sent with another body.
///   A store failure rolls the whole apply back.
pub struct RunEventHandler<S> {
    routes: BTreeMap<String, String>,
    run_id_field: String,
    clock: Clock,
    backend: std::marker::PhantomData<fn() -> S>,
}

impl<S> Clone for RunEventHandler<S> {
    fn clone(&self) -> Self {
        RunEventHandler {
            routes: self.routes.clone(),
            run_id_field: self.run_id_field.clone(),
            clock: self.clock.clone(),
            backend: std::marker::PhantomData,
        }
    }
}

impl<S> Default for RunEventHandler<S> {
    fn default() -> Self {
        RunEventHandler {
            routes: BTreeMap::new(),
            run_id_field: RUN_ID_FIELD_DEFAULT.to_string(),
            clock: std::sync::Arc::new(system_ms),
            backend: std::marker::PhantomData,
        }
    }
}

fn system_ms() -> i64 {
    crate::clock::now_ms()
}

impl<S> RunEventHandler<S> {
    /// A handler that reads the run id from `payload.run_id` and sends every event under its event
    /// type as the run event name (add [`RunEventHandler::route`]s to rename or select types).
    pub fn new() -> Self {
        Self::default()
    }

    /// Deliver events of `event_type` under the run event name `name` (the name a workflow
    /// waits for with `wait_for_event`). Once a route is given, unrouted types are ignored.
    pub fn route(mut self, event_type: &str, name: &str) -> Self {
        self.routes.insert(event_type.to_string(), name.to_string());
        self
    }

    /// The payload field holding the run id (default [`RUN_ID_FIELD_DEFAULT`]).
    pub fn run_id_field(mut self, field: &str) -> Self {
        self.run_id_field = field.to_string();
        self
    }

    /// The clock stamping received events (default: the system clock). Use the workflow
    /// runtime's clock, so that a wake-up is due at once for its workers.
    pub fn with_clock(mut self, clock: impl Fn() -> i64 + Send + Sync + 'static) -> Self {
        self.clock = std::sync::Arc::new(clock);
        self
    }

    fn name_of<'a>(&'a self, event: &'a Envelope) -> Option<&'a str> {
        if self.routes.is_empty() {
            Some(event.event_type.as_str())
        } else {
            self.routes.get(&event.event_type).map(String::as_str)
        }
    }
}

impl<S: RunEventSend> Handler<S::Tx> for RunEventHandler<S> {
    fn handle(&mut self, tx: &S::Tx, _consumer_id: &str, event: &Envelope) -> std::result::Result<(), HandleError> {
        let Some(name) = self.name_of(event).map(str::to_string) else {
            return Ok(());
        };
        let Some(run_id) = event.payload.get(&self.run_id_field).and_then(Value::as_str) else {
            return Err(HandleError::Blocked(format!(
                "event {} ({}) has no string payload.{} naming a run",
                event.event_id, event.event_type, self.run_id_field
            )));
        };
        let now_ms = (self.clock)();
        match S::send(tx, run_id, &event.event_id, &name, &event.payload, now_ms) {
            Ok(_added) => Ok(()),
            Err(error @ Error::Invalid { .. }) => Err(HandleError::Blocked(format!(
                "event {} ({}) cannot go to run {run_id}: {error}",
                event.event_id, event.event_type
            ))),
            Err(error) => Err(HandleError::Failed(error)),
        }
    }
}
