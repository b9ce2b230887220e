//! tidemark-engine: what runs the protocol over the stores. There are two parts:
//!
//! - [`relay`]: moves committed events from an outbox to every subscriber's inbox, over the
//!   traits of `tidemark_core::store` ([`relay_once`], [`relay_until_idle`]).
//! - [`workflow`]: the durable execution runtime (workflows, sagas, the worker and the writer
//!   that group-commits their journal), generic over `tidemark_core::workflow::WorkflowStore`.
//!
//! There is no producer or consumer driver here: a producer calls
//! `ProducerStore::advance_batch` (or `advance_in` / `OutboxTransaction` in its own transaction)
//! itself, and a consumer calls `ConsumerStore::drain` with its handler.
//!
//! **Architecture invariant:** the engine depends on `tidemark-core` alone: no backend, no SQL.
//! The relay and the workflow runtime speak only the traits, so every backend gets the same
//! behaviour.
#![warn(missing_docs)]

pub mod relay;
pub mod workflow;

pub use relay::{
    answers_of, group_by_endpoint, in_flow_order, judge, plan, plan_ahead, relay_once, relay_until_idle, round_robin,
    EndpointAnswer, RelayAnswer, RelayOptions, RelayReport,
};

/// Milliseconds since the Unix epoch, from the system clock (`tidemark_core::clock::now_ms`).
pub fn now_ms() -> i64 {
    tidemark_core::clock::now_ms()
}
