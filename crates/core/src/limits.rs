//! Every external input has a limit. Each is a named constant with its unit in the name, and each
//! is documented in `docs/protocol.md`.

/// Identifiers (flow, consumer, source, event, event type) are 1..=100 ASCII identifier characters.
pub const ID_BYTES_MAX: usize = 100;
/// Canonical JSON encoding of one event payload.
pub const PAYLOAD_BYTES_MAX: usize = 64 * 1024;
/// One envelope as received from outside (file, stdin, HTTP), before parsing.
pub const ENVELOPE_BYTES_MAX: usize = PAYLOAD_BYTES_MAX + 4 * 1024;
/// Schema versions are 1..=this.
pub const SCHEMA_VERSION_MAX: u32 = 65_535;
/// Reservation quantity bounds (the built-in example domain).
pub const RESERVATION_QUANTITY_MIN: i64 = 1;
/// The largest reservation quantity (the built-in example domain).
pub const RESERVATION_QUANTITY_MAX: i64 = 1_000_000;
/// One advance batch (requests in one producer transaction).
pub const ADVANCE_BATCH_MAX: usize = 10_000;
/// One relay batch (deliveries in one consumer and one producer transaction).
pub const RELAY_BATCH_EVENTS_MAX: usize = 10_000;
/// One receive batch (events in one consumer transaction).
pub const RECEIVE_BATCH_EVENTS_MAX: usize = 10_000;
/// One request to the HTTP batch receive route (`POST /v1/consumers/{id}/inbox/batch`): events.
pub const HTTP_RECEIVE_BATCH_EVENTS_MAX: usize = 1_000;
/// The JSON of the envelopes an HTTP relay lane puts in one batch request, at most (an envelope
/// larger than this alone goes alone): under the server's default body limit of 256 KiB.
pub const HTTP_RECEIVE_BATCH_BYTES_MAX: usize = 240 * 1024;
/// One drain call (events applied in one consumer transaction).
pub const DRAIN_BATCH_EVENTS_MAX: usize = 10_000;
/// One prune batch (rows deleted in one transaction).
pub const PRUNE_BATCH_ROWS_MAX: usize = 10_000;
/// One listing page.
pub const PAGE_SIZE_MAX: usize = 1_000;
/// Free-text reasons given by operators.
pub const REASON_BYTES_MAX: usize = 1_000;
/// Endpoint strings (a path or a URL, docs/protocol.md "Endpoints").
pub const ENDPOINT_BYTES_MAX: usize = 4_096;
/// Relay retry policy bounds.
pub const RELAY_ATTEMPTS_MAX: u32 = 1_000;
/// The longest relay backoff delay, in ms (24 hours): `backoff_base_ms` and `backoff_max_ms` must
/// be 0..=this.
pub const RELAY_BACKOFF_MS_MAX: i64 = 24 * 60 * 60 * 1000;
/// SQLite busy timeout: how long a writer waits for the single write lock.
pub const BUSY_TIMEOUT_MS: u64 = 10_000;
