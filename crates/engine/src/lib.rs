//! tidemark-engine: the drivers of the protocol over the storage traits. The producer advances
//! flows through a [`tidemark_core::flow::FlowMachine`]; the relay moves events from an outbox to
//! every subscriber's inbox; the consumer drains inboxes through a handler.
//!
//! **Architecture invariant:** the engine never writes SQL; it speaks only the traits of
//! `tidemark_core::store`, so every backend gets the same behaviour.

pub mod relay;
pub mod workflow;

pub use relay::{relay_once, relay_until_idle, round_robin, RelayAnswer, RelayOptions, RelayReport};

/// Milliseconds since the Unix epoch, from the system clock.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}
