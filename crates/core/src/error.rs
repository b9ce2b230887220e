//! Typed errors with stable machine codes.
//!
//! Every error a caller can cause by giving bad input is `Invalid` and carries a code from
//! [`codes`]; the CLI maps it to exit code 2 and the HTTP layer to 400. Everything else is an
//! internal failure (exit 1 / 500). The mapping lives in one place per front end.

/// Stable error codes. They are part of the public contract: never rename one.
pub mod codes {
    pub const INVALID_ID: &str = "invalid_id";
    pub const INVALID_SEQ: &str = "invalid_seq";
    pub const SEQ_OVERFLOW: &str = "seq_overflow";
    pub const PAYLOAD_TOO_LARGE: &str = "payload_too_large";
    pub const INVALID_PAYLOAD: &str = "invalid_payload";
    pub const INVALID_QUANTITY: &str = "invalid_quantity";
    pub const UNKNOWN_STATE: &str = "unknown_state";
    pub const INVALID_SCHEMA_VERSION: &str = "invalid_schema_version";
    pub const INVALID_ENVELOPE: &str = "invalid_envelope";
    pub const INVALID_ARGUMENT: &str = "invalid_argument";
    pub const LIMIT_EXCEEDED: &str = "limit_exceeded";
    pub const NOT_INITIALIZED: &str = "not_initialized";
    pub const ALREADY_INITIALIZED: &str = "already_initialized";
    pub const WRONG_ROLE: &str = "wrong_role";
    pub const SCHEMA_TOO_NEW: &str = "schema_too_new";
    pub const NOT_FOUND: &str = "not_found";
    pub const INVALID_STATE_CHANGE: &str = "invalid_state_change";
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
    /// A configuration file or value is wrong; the message names the key.
    pub const INVALID_CONFIG: &str = "invalid_config";
    /// The server is shutting down or not ready (HTTP 503).
    pub const UNAVAILABLE: &str = "unavailable";
    pub const STORE: &str = "store";
    pub const IO: &str = "io";
    pub const INVARIANT: &str = "invariant";
}

/// The one error type of tidemark's library crates.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The caller's input is wrong. Nothing was written.
    #[error("{message}")]
    Invalid { code: &'static str, message: String },
    /// A storage or I/O failure. Propagated as is; the operation's transaction was rolled back.
    #[error("{message}")]
    Store { code: &'static str, message: String },
    /// A broken internal invariant: a bug, surfaced loudly.
    #[error("invariant violated: {0}")]
    Invariant(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn invalid(code: &'static str, message: impl Into<String>) -> Self {
        Error::Invalid { code, message: message.into() }
    }

    pub fn store(message: impl Into<String>) -> Self {
        Error::Store { code: codes::STORE, message: message.into() }
    }

    pub fn io(message: impl Into<String>) -> Self {
        Error::Store { code: codes::IO, message: message.into() }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Error::invalid(codes::NOT_FOUND, message)
    }

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

/// A SQLite failure in the user's own statements (inside a transaction tidemark handed them) is
/// a store failure, never bad input.
#[cfg(feature = "rusqlite")]
impl From<rusqlite::Error> for Error {
    fn from(error: rusqlite::Error) -> Self {
        Error::store(format!("sqlite: {error}"))
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
