//! A consumer schema on a PostgreSQL server: the relay writes the batch into that schema's inbox
//! itself, in one inbox transaction, as it does a consumer file on its own machine.
//!
//! Custody: the consumer schema's receive transaction committed (with the server's durability:
//! `fsync` and `synchronous_commit`, which tidemark never weakens). The answers are the inbox's
//! own, exactly as for a file or another tidemark's inbox over HTTP: `accepted`, `duplicate`
//! (already held, by event id), `conflict` (same id, other content) and `expired` (past the
//! inbox's dedup horizon). No broker sits between: the inbox's dedup and order are the
//! end-to-end guarantee.
//!
//! The PostgreSQL client is blocking (the `postgres` crate runs a small runtime of its own and
//! must not run on a tokio worker), so each transport owns one thread with one connection to
//! the schema, opened on the first delivery (never creating the schema: one that is not a
//! consumer's fails the attempt with `not_initialized`) and reopened when the server closed it.
//! A delivery abandoned by the lane's timeout still finishes on that thread; the next attempt
//! queues behind it and is answered `duplicate` for what it stored.

use std::sync::mpsc;

use tidemark_core::endpoint::EndpointKind;
use tidemark_core::limits::RECEIVE_BATCH_EVENTS_MAX;
use tidemark_core::store::{ConsumerStore, ReceiveOutcome};
use tidemark_core::{Envelope, Error, Result};
use tidemark_store_postgres::PgConsumer;
use tokio::sync::oneshot;

use crate::{Delivered, Transport, TransportConfig};

type Request = (Vec<(String, Envelope)>, oneshot::Sender<Result<Vec<ReceiveOutcome>>>);

/// The relay's writer into one `postgres://user@host:port/database?schema=S` endpoint.
pub struct PostgresTransport {
    requests: std::sync::Mutex<mpsc::Sender<Request>>,
}

impl PostgresTransport {
    /// A writer into `schema` on the server the driver's connection string `conn` names, as
    /// `user` of `server` (`host:port`), with the password `config` has for them (if any).
    pub fn new(server: &str, user: &str, schema: &str, conn: &str, config: &TransportConfig) -> Result<Self> {
        let mut url = url::Url::parse(conn).map_err(|e| Error::Invariant(format!("a parsed endpoint's URL: {e}")))?;
        if let Some(password) = config.postgres_password(user, server)? {
            url.set_password(Some(&password)).map_err(|()| Error::Invariant("a URL with a host".into()))?;
        }
        if !url.query_pairs().any(|(k, _)| k == "connect_timeout") {
            let seconds = config.connect_timeout.as_secs().max(1);
            url.query_pairs_mut().append_pair("connect_timeout", &seconds.to_string());
        }
        let (conn, schema) = (url.to_string(), schema.to_string());
        let (requests, incoming) = mpsc::channel::<Request>();
        std::thread::Builder::new()
            .name(format!("pg-endpoint-{schema}"))
            .spawn(move || serve(&conn, &schema, incoming))
            .map_err(|e| Error::io(format!("cannot start the PostgreSQL endpoint's thread: {e}")))?;
        Ok(PostgresTransport { requests: std::sync::Mutex::new(requests) })
    }
}

/// The endpoint's thread: one connection, one receive transaction per chunk of a batch, until
/// the transport is dropped.
fn serve(conn: &str, schema: &str, incoming: mpsc::Receiver<Request>) {
    let mut consumer: Option<PgConsumer> = None;
    for (items, answer) in incoming {
        let delivered = (|| {
            if let Some(open) = consumer.as_mut() {
                // The server closed the connection (a restart): a new one, or a failed attempt.
                open.reconnect_if_closed()?;
            }
            if consumer.is_none() {
                consumer = Some(PgConsumer::open(conn, schema)?);
            }
            let consumer = consumer.as_mut().expect("just opened");
            let mut outcomes = Vec::with_capacity(items.len());
            for chunk in items.chunks(RECEIVE_BATCH_EVENTS_MAX) {
                let chunk: Vec<(&str, &Envelope)> = chunk.iter().map(|(c, e)| (c.as_str(), e)).collect();
                outcomes.extend(consumer.receive_batch(&chunk, tidemark_core::clock::now_ms())?);
            }
            Ok(outcomes)
        })();
        if delivered.is_err() {
            // A broken connection is not kept; the next attempt connects again.
            consumer = None;
        }
        // The lane may have given up on this attempt (its timeout): nobody to answer.
        let _ = answer.send(delivered);
    }
}

impl Transport for PostgresTransport {
    fn kind(&self) -> EndpointKind {
        EndpointKind::Postgres
    }

    fn deliver<'a>(&'a self, items: &'a [(String, Envelope)]) -> Delivered<'a> {
        Box::pin(async move {
            let (answer, answered) = oneshot::channel();
            let sent = self.requests.lock().unwrap_or_else(|p| p.into_inner()).send((items.to_vec(), answer));
            sent.map_err(|_| Error::Invariant("the PostgreSQL endpoint's thread ended".into()))?;
            answered.await.map_err(|_| Error::Invariant("the PostgreSQL endpoint's thread ended".into()))?
        })
    }
}
