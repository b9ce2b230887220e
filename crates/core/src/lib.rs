//! tidemark-core: the pure heart of tidemark. Identifiers and limits, the event envelope and its
//! canonical hash, flow state machines, decoders, policies, protocol outcomes and the storage
//! traits. **Architecture invariant:** this crate performs no I/O, but for the wall clock
//! ([`clock::now_ms`]) and the crash points of failpoints builds.
#![warn(missing_docs)]

pub mod clock;
pub mod crash;
pub mod decode;
pub mod drain;
pub mod endpoint;
pub mod envelope;
pub mod error;
pub mod flow;
pub mod fuzz;
pub mod id;
pub mod json;
pub mod limits;
pub mod location;
pub mod migration;
pub mod model;
pub mod policy;
pub mod queue;
pub mod reservation;
pub mod run_events;
pub mod schedule;
pub mod store;
pub mod tenancy;
pub mod workflow;

pub use envelope::Envelope;
pub use error::{codes, Error, Result};
