//! The bodies of the server's fuzz targets (`fuzz/fuzz_targets/`, run with `cargo +nightly
//! fuzz`), and of the stable tests that run every file of their seed corpus
//! (`fuzz/corpus/<target>/`) (docs/reliability.md, "Fuzzing").
//!
//! Each takes arbitrary bytes, must never panic, and asserts its properties; bad input must be a
//! typed error of the caller (`Error::Invalid`), which the API answers with a 4xx status.

use std::sync::Arc;

use serde::de::DeserializeOwned;
use tidemark_core::error::codes;
use tidemark_core::flow::{validate_request, AdvanceRequest, MachineSet, StreamMachine};
use tidemark_core::id::validate_reason;
use tidemark_core::reservation::ReservationMachine;
use tidemark_core::{Error, Result};

use crate::api::{decode_body, flows, inbox, queues, runs, schedules, status_of, subscriptions};
use crate::config::Config;

/// Target `config`: [`Config::parse_toml`] of arbitrary text (the TOML file of `tidemark
/// serve`). A refusal is `invalid_config`; an accepted configuration is valid, and written back
/// as TOML it parses to the same configuration.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let config = match Config::parse_toml(text) {
        Ok(config) => config,
        Err(error) => {
            assert_eq!(error.code(), codes::INVALID_CONFIG, "{error:?}");
            return;
        }
    };
    config.validate().expect("a parsed configuration is valid");
    let written = toml::to_string(&config).expect("a valid configuration is TOML");
    let again = Config::parse_toml(&written).unwrap_or_else(|e| panic!("{written}\nparses again: {e}"));
    assert_eq!(again, config, "parse(write(config)) == config");
}

/// The request bodies target `bodies` decodes, by the first byte of its input (`a` the first,
/// `b` the second, ...; any byte picks one, modulo their count); the rest is the body.
pub const BODIES: [&str; 16] = [
    "advance",
    "append",
    "resolve",
    "redeliver",
    "declare_consumer",
    "receive_batch",
    "skip_record",
    "put_queue",
    "start_run",
    "reason",
    "fork",
    "skip_step",
    "send_event",
    "put_schedule",
    "subscribe",
    "feed_commit",
];

/// The time the `start_run` and `put_schedule` bodies are checked at (a fixed instant, so a
/// failure reproduces).
const NOW_MS: i64 = 1_767_225_600_000;

/// Decode `bytes` as the route does, then run `check` on the body.
fn checked<T: DeserializeOwned>(bytes: &[u8], check: impl FnOnce(T) -> Result<()>) -> Result<()> {
    check(decode_body::<T>(bytes)?)
}

/// The machines the advance bodies are checked against: the reservation machine and the event
/// stream, as `tidemark serve` registers them.
fn machines() -> MachineSet {
    let mut machines = MachineSet::new();
    machines.add(Arc::new(ReservationMachine)).expect("the reservation machine registers");
    machines.add(Arc::new(StreamMachine)).expect("the stream machine registers");
    machines
}

fn advance_checked(machines: &MachineSet, request: AdvanceRequest) -> Result<()> {
    // What `Tenant::advance` checks before it queues the request.
    validate_request(machines, &request)
}

/// Target `bodies`: a JSON request body through the same decoding ([`decode_body`]) and checks
/// the route runs before it queues anything (the body types' own `request`, `check`, `spec`,
/// ... functions, and the core checks the tenant applies). Whatever the bytes, the answer is
/// either accepted or a typed error of the caller that the API maps to a 4xx status.
pub fn bodies(data: &[u8]) {
    let Some((&selector, body)) = data.split_first() else { return };
    let route = usize::from(selector.wrapping_sub(b'a')) % BODIES.len();
    let flow_id = || "flow-1".to_string();
    let outcome = match BODIES[route] {
        "advance" => checked(body, |b: flows::AdvanceBody| {
            let machines = machines();
            advance_checked(&machines, b.request(flow_id(), &machines)?)
        }),
        "append" => checked(body, |b: flows::AppendBody| advance_checked(&machines(), b.request(flow_id())?)),
        "resolve" => checked(body, |b: flows::ResolveBody| b.check()),
        "redeliver" => checked(body, |b: flows::RedeliverBody| b.first_event().map(drop)),
        // The handler is looked up in the service's registry, after decoding.
        "declare_consumer" => checked(body, |_: inbox::DeclareBody| Ok(())),
        "receive_batch" => checked(body, |b: inbox::ReceiveBatchBody| b.check()),
        "skip_record" => checked(body, |b: inbox::SkipRecordBody| validate_reason(&b.reason)),
        "put_queue" => checked(body, |b: queues::QueueBody| b.spec("queue-1".into()).map(drop)),
        "start_run" => checked(body, |b: runs::StartBody| b.request(1, NOW_MS).map(drop)),
        // Cancel, retry and abandon: `runs::control` checks the reason.
        "reason" => checked(body, |b: runs::ReasonBody| validate_reason(&b.reason)),
        "fork" => checked(body, |b: runs::ForkBody| b.check()),
        "skip_step" => checked(body, |b: runs::SkipStepBody| b.check()),
        "send_event" => checked(body, |b: runs::EventBody| b.check()),
        // And its first tick, which the store computes when it writes the schedule.
        "put_schedule" => checked(body, |b: schedules::ScheduleBody| {
            b.spec("schedule-1".into())?.next_after(NOW_MS, NOW_MS).map(drop)
        }),
        "subscribe" => checked(body, |b: subscriptions::SubscribeBody| b.kind().map(drop)),
        "feed_commit" => checked(body, |b: subscriptions::CommitBody| b.outbox_index().map(drop)),
        other => unreachable!("body {other} has no decoder"),
    };
    if let Err(error) = outcome {
        assert!(matches!(error, Error::Invalid { .. }), "{}: bad input is a typed error, got {error:?}", BODIES[route]);
        assert!(status_of(&error).is_client_error(), "{}: {error:?} is not answered 4xx", BODIES[route]);
    }
}

/// The body of a fuzz target: arbitrary bytes in, a panic for a property that fails.
pub type FuzzBody = fn(&[u8]);

/// Every fuzz target by name (its folder under `fuzz/corpus/` and its file under
/// `fuzz/fuzz_targets/`), with its body.
pub const TARGETS: [(&str, FuzzBody); 5] = [
    ("envelope", tidemark_core::fuzz::envelope),
    ("canonical", tidemark_core::fuzz::canonical),
    ("endpoint", tidemark_core::fuzz::endpoint),
    ("config", config),
    ("bodies", bodies),
];

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    /// Every file of `fuzz/corpus/<target>/` (at least one: a corpus that went missing fails).
    fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
        let folder = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus").join(target);
        let mut files: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(&folder)
            .unwrap_or_else(|e| panic!("{}: {e}", folder.display()))
            .map(|entry| {
                let path = entry.expect("a corpus entry").path();
                let bytes = std::fs::read(&path).expect("a corpus file");
                (path, bytes)
            })
            .collect();
        files.sort();
        assert!(!files.is_empty(), "{} holds no seed", folder.display());
        files
    }

    /// CI runs the seed corpus (and every crash the fuzzer found, kept there) on the stable
    /// toolchain, through the same bodies `cargo fuzz` runs.
    #[test]
    fn every_corpus_file_passes_its_fuzz_target() {
        for (target, body) in super::TARGETS {
            for (path, bytes) in corpus(target) {
                eprintln!("{}", path.display());
                body(&bytes);
            }
        }
    }

    #[test]
    fn the_bodies_corpus_has_a_seed_for_every_body() {
        let seen: std::collections::BTreeSet<usize> = corpus("bodies")
            .iter()
            .map(|(_, bytes)| usize::from(bytes[0].wrapping_sub(b'a')) % super::BODIES.len())
            .collect();
        assert_eq!(seen.len(), super::BODIES.len(), "a seed for every body");
    }
}
