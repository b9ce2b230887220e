//! The bodies of core's fuzz targets (`fuzz/fuzz_targets/`, run with `cargo +nightly fuzz`), and
//! of the stable test that runs every file of their seed corpus (`fuzz/corpus/<target>/`;
//! `tidemark-server`'s `fuzz` module, beside the server's targets), so CI exercises the corpus
//! without a nightly toolchain (docs/reliability.md, "Fuzzing").
//!
//! Each takes arbitrary bytes, must never panic, and asserts the properties of what it parses:
//! an assertion that fails is a bug the fuzzer found. Bad input must be a typed error of the
//! caller (`Error::Invalid`) with the code the parser documents.

use serde_json::Value;

use crate::endpoint::{kind_of, mask, Endpoint};
use crate::envelope::{hash_hex, validate_payload, Envelope};
use crate::error::codes;
use crate::json::check_numbers;

/// Target `envelope`: [`Envelope::parse`] of arbitrary bytes. An envelope it accepts is valid,
/// its canonical encoding parses back to the same envelope with the same content hash, and that
/// hash is the SHA-256 of the canonical bytes; anything it refuses is a typed error.
pub fn envelope(data: &[u8]) {
    let envelope = match Envelope::parse(data) {
        Ok(envelope) => envelope,
        Err(error) => {
            assert!(error.is_invalid_input(), "a malformed envelope is bad input, got {error:?}");
            return;
        }
    };
    envelope.validate().expect("a parsed envelope is valid");
    let canonical = envelope.canonical_bytes();
    let hash = envelope.content_hash();
    assert_eq!(hash, hash_hex(&canonical), "the streamed hash is the hash of the canonical bytes");
    assert_eq!(hash, envelope.content_hash(), "the hash is deterministic");
    let again = Envelope::parse(&canonical).expect("the canonical encoding of a valid envelope parses");
    assert_eq!(again, envelope, "decode(encode(x)) == x");
    assert_eq!(again.canonical_bytes(), canonical, "the canonical encoding is a fixed point");
    assert_eq!(again.content_hash(), hash, "the hash survives a round trip");
}

/// Target `canonical`: any JSON value as a payload. The canonical encoding of a value parses
/// back to the same value and is a fixed point (encoding it again gives the same bytes), its
/// numbers are always kept exactly ([`check_numbers`] accepts it), and the content hash of an
/// envelope carrying it is stable across the round trip; the payload check never panics.
pub fn canonical(data: &[u8]) {
    let Ok(value) = serde_json::from_slice::<Value>(data) else { return };
    let exact = check_numbers(data);
    if let Err(error) = &exact {
        assert_eq!(error.code(), codes::INEXACT_NUMBER, "{error:?}");
    }
    let encoded = serde_json::to_vec(&value).expect("a JSON value always serialises");
    let decoded: Value = serde_json::from_slice(&encoded).expect("the canonical encoding is JSON");
    assert_eq!(decoded, value, "decode(encode(x)) == x");
    assert_eq!(serde_json::to_vec(&decoded).expect("serialises"), encoded, "the encoding is a fixed point");
    check_numbers(&encoded).expect("the canonical encoding keeps its own numbers exactly");
    let payload = match value {
        Value::Object(_) => value,
        other => serde_json::json!({ "value": other }),
    };
    let _ = validate_payload(&payload);
    let envelope = Envelope {
        event_id: "e1".into(),
        source: "s".into(),
        generation: "g".into(),
        flow_id: "f".into(),
        seq: 1,
        event_type: "t".into(),
        schema_version: 1,
        payload,
        created_at_ms: 0,
        traceparent: None,
    };
    let bytes = envelope.canonical_bytes();
    let hash = envelope.content_hash();
    assert_eq!(hash, hash_hex(&bytes), "the streamed hash is the hash of the canonical bytes");
    let again: Envelope = serde_json::from_slice(&bytes).expect("the canonical encoding parses");
    assert_eq!(again.content_hash(), hash, "the hash is stable across decode(encode(x))");
}

/// Target `endpoint`: [`Endpoint::parse`] of arbitrary text. Refusals are `invalid_endpoint`;
/// an accepted endpoint has the kind [`kind_of`] says, parses the same again from its own
/// canonical URL (HTTP), and never keeps a password (nor a user, but for PostgreSQL); [`mask`]
/// never panics.
pub fn endpoint(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let _ = mask(text);
    let endpoint = match Endpoint::parse(text) {
        Ok(endpoint) => endpoint,
        Err(error) => {
            assert_eq!(error.code(), codes::INVALID_ENDPOINT, "{error:?}");
            return;
        }
    };
    assert_eq!(kind_of(text).expect("parses again"), endpoint.kind());
    match &endpoint {
        Endpoint::Http { url, origin, consumer_id } => {
            assert_eq!(Endpoint::parse(url).as_ref(), Ok(&endpoint), "the stored URL names the same inbox");
            crate::id::validate_id("consumer_id", consumer_id).expect("the consumer id is an id");
            assert!(!origin.contains('@'), "an origin never carries credentials: {origin}");
        }
        Endpoint::Nats { server, .. } | Endpoint::Amqp { server, .. } => {
            assert!(!server.contains('@'), "a server never carries credentials: {server}");
        }
        Endpoint::Kafka { bootstrap, .. } => {
            assert!(!bootstrap.is_empty() && bootstrap.iter().all(|s| !s.contains('@')), "{bootstrap:?}");
        }
        Endpoint::Sqlite { path } => assert!(!path.is_empty(), "a file endpoint names a file"),
        Endpoint::Pull => {}
        Endpoint::Postgres { server, user, schema, conn } => {
            assert!(!server.contains('@') && !user.contains(':'), "no password: {server} {user}");
            crate::location::validate_schema_name(schema).expect("the schema is a schema name");
            let url = url::Url::parse(conn).expect("the connection string is a URL");
            assert!(url.password().is_none(), "the connection string never carries a password: {conn}");
            assert!(url.query_pairs().all(|(k, _)| k != "schema" && k != "password"), "{conn}");
        }
    }
}
