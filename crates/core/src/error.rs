//! Typed errors with stable machine codes.
//!
//! Every error a caller can cause by giving bad input is `Invalid` and carries a code from
//! [`codes`]; the CLI maps it to exit code 2 and the HTTP layer to 400. Everything else is an
//! internal failure (exit 1 / 500). The mapping lives in one place per front end.

/// Stable error codes. They are part of the public contract: never rename one.
pub mod codes {
    /// An identifier (source, flow, consumer, event, event type, ...) is not 1..=100 ASCII
    /// characters from `A-Z a-z 0-9 _ - . :`.
    pub const INVALID_ID: &str = "invalid_id";
    /// A seq or position is out of range: a seq below 1, an `expected_seq` below 0, a workflow step
    /// position past the run's journal.
    pub const INVALID_SEQ: &str = "invalid_seq";
    /// A flow already has its last possible seq (`i64::MAX`): it cannot advance again.
    pub const SEQ_OVERFLOW: &str = "seq_overflow";
    /// A payload is larger than 64 KiB of canonical JSON, or an envelope read from outside is
    /// larger than 68 KiB.
    pub const PAYLOAD_TOO_LARGE: &str = "payload_too_large";
    /// An input or payload is not the JSON object its machine or route expects (not an object, an
    /// unknown field, a value that does not decode).
    pub const INVALID_PAYLOAD: &str = "invalid_payload";
    /// A JSON number the canonical encoding cannot keep exactly: an integer outside
    /// -2^63..=2^64-1 (2^64 would become a float), or a decimal with more digits than a double
    /// holds (`0.10000000000000000001`). Refused, never rounded (see [`crate::json`]).
    pub const INEXACT_NUMBER: &str = "inexact_number";
    /// The reservation domain's quantity is missing, not an integer or outside 1..=1,000,000.
    pub const INVALID_QUANTITY: &str = "invalid_quantity";
    /// An advance names a state its machine does not have.
    pub const UNKNOWN_STATE: &str = "unknown_state";
    /// A schema version is outside 1..=65,535, or is one the flow machine does not emit.
    pub const INVALID_SCHEMA_VERSION: &str = "invalid_schema_version";
    /// An envelope from outside is malformed: bad JSON, an unknown field, or a field out of range.
    pub const INVALID_ENVELOPE: &str = "invalid_envelope";
    /// An argument is wrong in a way no more specific code names: an empty reason, a negative
    /// retention, an unknown status word, an open transaction expected but missing.
    pub const INVALID_ARGUMENT: &str = "invalid_argument";
    /// A subscription's endpoint is not one of the kinds docs/protocol.md lists ("Endpoints"): an
    /// unknown scheme, a malformed URL, credentials in the URL, a bad subject, exchange or topic.
    pub const INVALID_ENDPOINT: &str = "invalid_endpoint";
    /// A `--store` is not a SQLite path, `sqlite:<path>` or a `postgres://` URL
    /// (`tidemark_core::location`), or is longer than its bound.
    pub const INVALID_STORE: &str = "invalid_store";
    /// A batch, page or limit is larger than its bound in [`crate::limits`].
    pub const LIMIT_EXCEEDED: &str = "limit_exceeded";
    /// A file that should exist does not, or is not initialised for the role asked of it (not a
    /// producer, consumer or workflow database); nothing is created.
    pub const NOT_INITIALIZED: &str = "not_initialized";
    /// `init` of a producer database that already belongs to another source.
    pub const ALREADY_INITIALIZED: &str = "already_initialized";
    /// Reserved for a file opened in a role it does not have; this version answers
    /// [`NOT_INITIALIZED`] for that instead and returns this code nowhere.
    pub const WRONG_ROLE: &str = "wrong_role";
    /// The file was written by a newer tidemark (a schema version above this build's); it is
    /// refused, never downgraded.
    pub const SCHEMA_TOO_NEW: &str = "schema_too_new";
    /// What the request names does not exist: a flow, consumer, record, delivery, run, subscriber,
    /// event or route.
    pub const NOT_FOUND: &str = "not_found";
    /// The thing named exists but is in a state that does not allow the change asked for (requeue
    /// an accepted delivery, skip a record that is not blocked, move a subscriber whose new
    /// database holds none of its events).
    pub const INVALID_STATE_CHANGE: &str = "invalid_state_change";
    /// The id asked for is already taken: a consumer id with state, a registration made twice, a
    /// run id a fork would create.
    pub const ALREADY_EXISTS: &str = "already_exists";
    /// Two machines served together share a state name.
    pub const STATE_COLLISION: &str = "state_collision";
    /// A consumer names a handler that is not registered.
    pub const UNKNOWN_HANDLER: &str = "unknown_handler";
    /// An advance names a machine that is not registered.
    pub const UNKNOWN_MACHINE: &str = "unknown_machine";
    /// `advance` answered `stale` inside a transaction that commits only a committed advance.
    pub const STALE: &str = "stale";
    /// `advance` answered `invalid_transition` inside such a transaction.
    pub const INVALID_TRANSITION: &str = "invalid_transition";
    /// No valid bearer token (HTTP 401).
    pub const UNAUTHENTICATED: &str = "unauthenticated";
    /// The token's scope does not allow the request (HTTP 403).
    pub const FORBIDDEN: &str = "forbidden";
    /// The token sent more requests than its rate allows (HTTP 429).
    pub const RATE_LIMITED: &str = "rate_limited";
    /// The run holds its most events no wait consumed yet
    /// ([`crate::workflow::RUN_EVENTS_HELD_MAX`]): nothing was written; send again once its
    /// waits consumed some (HTTP 429).
    pub const RUN_EVENTS_FULL: &str = "run_events_full";
    /// A configuration file or value is wrong; the message names the key.
    pub const INVALID_CONFIG: &str = "invalid_config";
    /// The server is shutting down or not ready (HTTP 503).
    pub const UNAVAILABLE: &str = "unavailable";
    /// A SQLite or other storage failure: the operation's transaction was rolled back.
    pub const STORE: &str = "store";
    /// The disk (the file system of the data folder) is full: the operation's transaction was
    /// rolled back and nothing changed. The same operation succeeds once space is freed; the
    /// service's own loops go on by themselves then (HTTP 507).
    pub const STORAGE_FULL: &str = "storage_full";
    /// The PostgreSQL server could not be reached, or the connection to it was lost or shut
    /// down (SQLSTATE class 08, `57P01`-`57P03`): the operation's transaction did not commit,
    /// or its commit's answer was lost (then it may have committed: an advance or a start
    /// retried with the same expected seq or run id tells which). The service reconnects by
    /// itself once the server is back (HTTP 503).
    pub const STORE_UNAVAILABLE: &str = "store_unavailable";
    /// A file-system, process or network failure outside SQLite (creating a folder, starting the
    /// async runtime, reaching a server).
    pub const IO: &str = "io";
    /// A broken internal invariant ([`Error::Invariant`](super::Error::Invariant)): a bug.
    pub const INVARIANT: &str = "invariant";
}

/// The one error type of tidemark's library crates.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The caller's input is wrong. Nothing was written.
    #[error("{message}")]
    Invalid {
        /// The stable machine code, one of [`codes`].
        code: &'static str,
        /// What is wrong, for a person (it names the field or the limit).
        message: String,
    },
    /// A storage or I/O failure. Propagated as is; the operation's transaction was rolled back.
    #[error("{message}")]
    Store {
        /// [`codes::STORE`], [`codes::STORAGE_FULL`] or [`codes::IO`] (or the code a remote server
        /// answered with).
        code: &'static str,
        /// What failed, for a person.
        message: String,
    },
    /// A broken internal invariant: a bug, surfaced loudly.
    #[error("invariant violated: {0}")]
    Invariant(String),
}

/// The result type of tidemark's library crates, with [`Error`] as its default error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Bad input with the stable `code` (one of [`codes`]) and a message for a person. Nothing was
    /// written.
    pub fn invalid(code: &'static str, message: impl Into<String>) -> Self {
        Error::Invalid { code, message: message.into() }
    }

    /// A storage failure (code `store`) with its message.
    pub fn store(message: impl Into<String>) -> Self {
        Error::Store { code: codes::STORE, message: message.into() }
    }

    /// An I/O failure (code `io`) with its message.
    pub fn io(message: impl Into<String>) -> Self {
        Error::Store { code: codes::IO, message: message.into() }
    }

    /// Something the caller named does not exist (code `not_found`).
    pub fn not_found(message: impl Into<String>) -> Self {
        Error::invalid(codes::NOT_FOUND, message)
    }

    /// The stable machine code of this error (one of [`codes`]): what the CLI prints, the HTTP body
    /// carries and callers match on.
    pub fn code(&self) -> &'static str {
        match self {
            Error::Invalid { code, .. } | Error::Store { code, .. } => code,
            Error::Invariant(_) => codes::INVARIANT,
        }
    }

    /// True when the caller caused the error (exit code 2, HTTP 4xx).
    pub fn is_invalid_input(&self) -> bool {
        matches!(self, Error::Invalid { .. })
    }
}

/// A SQLite failure (in tidemark's statements, or in the user's own inside a transaction
/// tidemark handed them) is a store failure, never bad input: `storage_full` when the disk is
/// full, `store` otherwise.
#[cfg(feature = "rusqlite")]
impl From<rusqlite::Error> for Error {
    fn from(error: rusqlite::Error) -> Self {
        let code = match error.sqlite_error_code() {
            Some(rusqlite::ErrorCode::DiskFull) => codes::STORAGE_FULL,
            _ => codes::STORE,
        };
        Error::Store { code, message: format!("sqlite: {error}") }
    }
}

/// A PostgreSQL failure in the user's own statements (inside a transaction tidemark handed them,
/// or one they opened for `advance_in`) is a store failure, never bad input; which one is
/// [`postgres_error_code`]'s answer.
#[cfg(feature = "postgres")]
impl From<postgres::Error> for Error {
    fn from(error: postgres::Error) -> Self {
        let (code, message) = match error.as_db_error() {
            Some(db) => (
                postgres_error_code(db.code().code(), db.severity()),
                format!("postgres: {} ({}, {})", db.message(), db.code().code(), db.severity()),
            ),
            // A closed connection, or one that failed on the network (refused, reset, timed out).
            None => {
                let lost = error.is_closed()
                    || std::iter::successors(std::error::Error::source(&error), |e| e.source())
                        .any(|e| e.is::<std::io::Error>());
                (if lost { codes::STORE_UNAVAILABLE } else { codes::STORE }, format!("postgres: {error}"))
            }
        };
        Error::Store { code, message }
    }
}

/// The code of an error the PostgreSQL server answered, from its SQLSTATE and severity:
/// - `storage_full` for `53100` (`disk_full`: the server could not extend a file; the statement's
///   transaction rolled back, nothing changed);
/// - `store_unavailable` when the session or the server ended: SQLSTATE class 08, `57P01`-`57P03`,
///   and **every error of severity `FATAL` or `PANIC`**, whatever its SQLSTATE. A `PANIC` (say a
///   failed fsync of the WAL, docs/reliability.md) can come after the commit record was written:
///   the transaction may be committed once the server has recovered, so the caller must not be
///   told "rolled back" (`store`); it retries with the same expected seq or run id, which tells.
/// - `store` otherwise (the transaction rolled back).
pub fn postgres_error_code(sqlstate: &str, severity: &str) -> &'static str {
    if sqlstate == "53100" {
        codes::STORAGE_FULL
    } else if sqlstate.starts_with("08")
        || ["57P01", "57P02", "57P03"].contains(&sqlstate)
        || ["FATAL", "PANIC"].contains(&severity)
    {
        codes::STORE_UNAVAILABLE
    } else {
        codes::STORE
    }
}

/// A PostgreSQL failure in a transactional step's own statements: retried (the step's savepoint
/// is rolled back, its journal entry records the attempt), like `From<rusqlite::Error>` for
/// `StepFailure` on SQLite. (Here rather than beside `StepFailure` in `workflow.rs`: the
/// PostgreSQL conversions of core stay together.)
#[cfg(feature = "postgres")]
impl From<postgres::Error> for crate::workflow::StepFailure {
    fn from(error: postgres::Error) -> Self {
        crate::workflow::StepFailure::retryable(Error::from(error).to_string())
    }
}

/// Assert an invariant: on failure return `Error::Invariant` from the enclosing function.
#[macro_export]
macro_rules! ensure_invariant {
    ($cond:expr, $($arg:tt)+) => {
        if !$cond {
            return Err($crate::Error::Invariant(format!($($arg)+)));
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The SQLSTATEs and severities PostgreSQL answered in the fault tests
    /// (crates/faultfs-preload/tests/postgres_faults.rs) and the connection losses.
    #[test]
    fn a_postgres_error_is_classified_by_sqlstate_and_severity() {
        let cases = [
            ("53100", "ERROR", codes::STORAGE_FULL),
            ("23505", "ERROR", codes::STORE),
            ("40001", "ERROR", codes::STORE),
            ("08006", "FATAL", codes::STORE_UNAVAILABLE),
            ("08006", "ERROR", codes::STORE_UNAVAILABLE),
            ("57P01", "FATAL", codes::STORE_UNAVAILABLE),
            ("57P03", "FATAL", codes::STORE_UNAVAILABLE),
            // A failed fsync of the WAL at commit: the server PANICs (SQLSTATE XX000 or 58030).
            ("XX000", "PANIC", codes::STORE_UNAVAILABLE),
            ("58030", "PANIC", codes::STORE_UNAVAILABLE),
            ("58030", "ERROR", codes::STORE),
            ("XX000", "FATAL", codes::STORE_UNAVAILABLE),
        ];
        for (sqlstate, severity, code) in cases {
            assert_eq!(postgres_error_code(sqlstate, severity), code, "{sqlstate} {severity}");
        }
    }
}
