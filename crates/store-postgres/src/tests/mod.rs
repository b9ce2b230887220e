//! Tests against a real PostgreSQL server: `TIDEMARK_TEST_POSTGRES` (default
//! `host=127.0.0.1 port=5432 user=postgres dbname=test`). A test whose server does not answer
//! prints `skipped: PostgreSQL not reachable at ...` and returns. Each test works in a schema of
//! its own and drops it at the end.

mod consumer;
mod ordering;
mod producer;
mod queues;
mod schedules;
mod schema;
mod support;
mod tls;
mod workflow;
mod workflow_kill;
mod workflow_runtime;

/// Store objects move to the thread that owns them (as SQLite's do), so they must be `Send`.
#[test]
fn store_objects_can_move_to_their_own_thread() {
    fn send<T: Send>() {}
    send::<crate::PgProducer>();
    send::<crate::PgConsumer>();
    send::<crate::PgWorkflows>();
}
