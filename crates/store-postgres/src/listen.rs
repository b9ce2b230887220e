//! `LISTEN/NOTIFY` as a wake-up hint, never as the truth: a transaction that makes runs due
//! from outside a worker (a start, an event sent to a run) notifies the schema's channel, and a
//! [`DueRunListener`] beside a worker tells it to claim now instead of at its next poll. A lost
//! notification (the listener reconnecting, the server restarting) costs at most one poll
//! interval: polling still finds every due run.
//!
//! The payload is empty and PostgreSQL folds equal notifications of one transaction into one.
//! `NOTIFY` takes a database-wide lock while its transaction commits, so only the rare
//! transactions that make work due from outside notify; a worker's own journal commits never do
//! (runs a worker makes due itself, a child or a woken parent, it claims through its own "due
//! now" nudge).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use postgres::fallible_iterator::FallibleIterator;
use postgres::GenericClient;
use tidemark_core::{Error, Result};

use crate::schema::{connect, validate_schema_name};
use crate::PgResult;

/// How long the listener waits for a notification before it looks at its stop flag, in ms.
const LISTEN_WAIT_MS: u64 = 250;
/// How long it waits before connecting again after the connection failed, in ms.
const RECONNECT_WAIT_MS: u64 = 1_000;

/// The channel of a workflow schema: `tm_` and the schema's name, cut to PostgreSQL's 63 bytes
/// (two long names that share their first 60 bytes share a channel: a spurious wake-up, no
/// more).
pub fn wake_channel(schema: &str) -> String {
    let mut channel = format!("tm_{schema}");
    channel.truncate(63);
    channel
}

/// Notify `schema`'s channel in the caller's transaction (sent when it commits).
pub(crate) fn notify(c: &mut impl GenericClient, schema: &str) -> Result<()> {
    c.execute("SELECT pg_notify($1, '')", &[&wake_channel(schema)]).db()?;
    Ok(())
}

/// A thread with a connection of its own that `LISTEN`s on a workflow schema's channel and calls
/// `on_wake` for every notification (several at once count as one), and once after each
/// (re)connection (a notification may have been sent while it was not listening). It reconnects
/// by itself after the connection fails. Dropping it stops the thread (within a second).
pub struct DueRunListener {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl DueRunListener {
    /// Listen on `schema`'s channel of the server at `conn_str`. The first connection is made
    /// here, so a wrong server is an error now rather than silence later.
    pub fn spawn(conn_str: &str, schema: &str, on_wake: impl Fn() + Send + 'static) -> Result<DueRunListener> {
        validate_schema_name(schema)?;
        let channel = wake_channel(schema);
        let listen = format!("LISTEN \"{channel}\"");
        let mut client = connect(conn_str)?;
        client.batch_execute(&listen).db()?;
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, conn_str) = (stop.clone(), conn_str.to_string());
        let thread = std::thread::Builder::new()
            .name("tidemark-listen".into())
            .spawn(move || {
                let mut client = Some(client);
                while !flag.load(Ordering::Relaxed) {
                    let Some(c) = client.as_mut() else {
                        std::thread::sleep(Duration::from_millis(RECONNECT_WAIT_MS));
                        client = connect(&conn_str).ok().and_then(|mut c| {
                            c.batch_execute(&listen).ok()?;
                            Some(c)
                        });
                        if client.is_some() {
                            on_wake();
                        }
                        continue;
                    };
                    let (woken, failed) = {
                        let mut notifications = c.notifications();
                        let answer = notifications.timeout_iter(Duration::from_millis(LISTEN_WAIT_MS)).next();
                        // Whatever else arrived with it is the same hint.
                        while let Ok(Some(_)) = notifications.iter().next() {}
                        (matches!(answer, Ok(Some(_))), answer.is_err())
                    };
                    if woken {
                        on_wake();
                    }
                    if failed || c.is_closed() {
                        client = None;
                    }
                }
            })
            .map_err(|e| Error::io(format!("cannot start the listener thread: {e}")))?;
        Ok(DueRunListener { stop, thread: Some(thread) })
    }
}

impl Drop for DueRunListener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
