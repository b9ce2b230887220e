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
//! the schema (a `PgEndpoints`), opened on the first delivery (never creating the schema: one
//! that is not a consumer's fails the attempt with `not_initialized`) and reopened when the
//! server closed it.
//! A delivery abandoned by the lane's timeout still finishes on that thread; the next attempt
//! queues behind it and is answered `duplicate` for what it stored.

use std::sync::mpsc;

use tidemark_core::endpoint::EndpointKind;
use tidemark_core::limits::RECEIVE_BATCH_EVENTS_MAX;
use tidemark_core::store::{Endpoints, ReceiveOutcome};
use tidemark_core::{Envelope, Error, Result};
use tidemark_store_postgres::PgEndpoints;
use tokio::sync::oneshot;

use crate::{Delivered, Transport, TransportConfig};

type Request = (Vec<(String, Envelope)>, oneshot::Sender<Result<Vec<ReceiveOutcome>>>);

/// The relay's writer into one `postgres://user@host:port/database?schema=S` endpoint.
pub struct PostgresTransport {
    requests: std::sync::Mutex<mpsc::Sender<Request>>,
}

impl PostgresTransport {
    /// A writer into the consumer schema of the `postgres://` endpoint `endpoint`, whose `user`
    /// and `server` (`host:port`) it names, with the password `config` has for them
    /// (`invalid_config` when `config` does not list them).
    pub fn new(endpoint: &str, server: &str, user: &str, config: &TransportConfig) -> Result<Self> {
        let mut endpoints = PgEndpoints::remote().with_password(config.postgres_password(user, server)?);
        let endpoint = if endpoint.contains("connect_timeout=") {
            endpoint.to_string()
        } else {
            format!("{endpoint}&connect_timeout={}", config.connect_timeout.as_secs().max(1))
        };
        let (requests, incoming) = mpsc::channel::<Request>();
        std::thread::Builder::new()
            .name("pg-endpoint".into())
            .spawn(move || {
                // One connection, one receive transaction per chunk of a batch, until the
                // transport is dropped.
                for (items, answer) in incoming {
                    let delivered = items
                        .chunks(RECEIVE_BATCH_EVENTS_MAX)
                        .map(|chunk| {
                            let chunk: Vec<(&str, &Envelope)> = chunk.iter().map(|(c, e)| (c.as_str(), e)).collect();
                            endpoints.deliver(&endpoint, &chunk, tidemark_core::clock::now_ms())
                        })
                        .collect::<Result<Vec<_>>>()
                        .map(|chunks| chunks.concat());
                    // The lane may have given up on this attempt (its timeout): nobody to answer.
                    let _ = answer.send(delivered);
                }
            })
            .map_err(|e| Error::io(format!("cannot start the PostgreSQL endpoint's thread: {e}")))?;
        Ok(PostgresTransport { requests: std::sync::Mutex::new(requests) })
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
