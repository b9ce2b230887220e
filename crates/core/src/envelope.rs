//! The event envelope: what leaves a producer's outbox and lands in a consumer's inbox.
//!
//! Identity is two-fold: `event_id`, and `(source, flow_id, seq)`. Content is compared by a
//! canonical SHA-256 hash over the whole envelope but its trace context, on every path that
//! finds an existing record.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{codes, Error, Result};
use crate::id::validate_id;
use crate::limits::{ENVELOPE_BYTES_MAX, PAYLOAD_BYTES_MAX, SCHEMA_VERSION_MAX};

/// One immutable event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Envelope {
    /// The event's own identity: a UUIDv7 (32 hex characters), unique per producer. The first of
    /// the two dedup identities.
    #[cfg_attr(feature = "openapi", schema(pattern = "^[A-Za-z0-9_.:-]{1,100}$"))]
    pub event_id: String,
    /// The producer namespace (one per producer database).
    #[cfg_attr(feature = "openapi", schema(pattern = "^[A-Za-z0-9_.:-]{1,100}$"))]
    pub source: String,
    /// The producer database incarnation; a re-created or rotated producer has a new one.
    #[cfg_attr(feature = "openapi", schema(pattern = "^[A-Za-z0-9_.:-]{1,100}$"))]
    pub generation: String,
    /// The flow (aggregate) the event belongs to; with `source` and `seq`, the second dedup
    /// identity.
    #[cfg_attr(feature = "openapi", schema(pattern = "^[A-Za-z0-9_.:-]{1,100}$"))]
    pub flow_id: String,
    /// Position in the flow: exactly previous + 1, starting at 1.
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 9_223_372_036_854_775_807_i64))]
    #[serde(deserialize_with = "crate::json::integer")]
    pub seq: i64,
    /// What happened, as the flow machine named it (e.g. `reservation.reserved`); consumers pick
    /// their decoder by it and `schema_version`.
    #[cfg_attr(feature = "openapi", schema(pattern = "^[A-Za-z0-9_.:-]{1,100}$"))]
    pub event_type: String,
    /// The version of the payload's schema (1..=65,535), so consumers can decode old and new
    /// payloads side by side.
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 65_535))]
    #[serde(deserialize_with = "crate::json::integer")]
    pub schema_version: u32,
    /// The event's data: a JSON object of at most 64 KiB in canonical encoding.
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub payload: serde_json::Value,
    /// Producer clock at commit, milliseconds since the Unix epoch.
    #[cfg_attr(feature = "openapi", schema(minimum = 0, maximum = 9_223_372_036_854_775_807_i64))]
    #[serde(deserialize_with = "crate::json::integer")]
    pub created_at_ms: i64,
    /// The W3C trace context (`traceparent`) of the request that committed the event, when it
    /// had one: a trace follows the event from its advance to its apply on another machine.
    /// Not part of the content (excluded from [`Envelope::content_hash`]): the same event sent
    /// again with another trace context is the same event. Absent from the encoding when
    /// `None`, so envelopes without one encode as they did before the field existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

/// The fields of an [`Envelope`] that are its content, in declaration order: what the canonical
/// encoding and the content hash cover (every field but the trace context).
#[derive(Serialize)]
struct Content<'a> {
    event_id: &'a str,
    source: &'a str,
    generation: &'a str,
    flow_id: &'a str,
    seq: i64,
    event_type: &'a str,
    schema_version: u32,
    payload: &'a serde_json::Value,
    created_at_ms: i64,
}

impl Envelope {
    /// Parse an envelope from external bytes (file, stdin, HTTP, a broker). Malformed input is an
    /// error, and so is a number the canonical encoding cannot keep exactly (`inexact_number`,
    /// [`crate::json::check_numbers`]).
    pub fn parse(bytes: &[u8]) -> Result<Envelope> {
        if bytes.len() > ENVELOPE_BYTES_MAX {
            return Err(Error::invalid(
                codes::PAYLOAD_TOO_LARGE,
                format!("envelope is {} bytes, limit is {ENVELOPE_BYTES_MAX}", bytes.len()),
            ));
        }
        let envelope: Envelope = crate::json::from_slice(bytes)
            .map_err(|e| Error::invalid(codes::INVALID_ENVELOPE, format!("malformed envelope: {e}")))?;
        // A payload number the canonical encoding would change is refused, never rounded.
        crate::json::check_numbers(bytes)?;
        envelope.validate()?;
        Ok(envelope)
    }

    /// Check the transport-level shape: ids, seq, version, payload size. Semantic checks
    /// (known version, valid payload, valid transition) happen at apply and become `blocked`.
    pub fn validate(&self) -> Result<()> {
        validate_id("event_id", &self.event_id)?;
        validate_id("source", &self.source)?;
        validate_id("generation", &self.generation)?;
        validate_id("flow_id", &self.flow_id)?;
        validate_id("event_type", &self.event_type)?;
        validate_seq("seq", self.seq)?;
        validate_schema_version(self.schema_version)?;
        if self.created_at_ms < 0 {
            return Err(Error::invalid(codes::INVALID_ENVELOPE, "created_at_ms must be >= 0"));
        }
        validate_payload(&self.payload)?;
        if let Some(traceparent) = &self.traceparent {
            validate_traceparent(traceparent)?;
        }
        Ok(())
    }

    /// The envelope's content: every field but the trace context.
    fn content(&self) -> Content<'_> {
        Content {
            event_id: &self.event_id,
            source: &self.source,
            generation: &self.generation,
            flow_id: &self.flow_id,
            seq: self.seq,
            event_type: &self.event_type,
            schema_version: self.schema_version,
            payload: &self.payload,
            created_at_ms: self.created_at_ms,
        }
    }

    /// The canonical encoding of the content: fields in declaration order, object keys sorted,
    /// no whitespace, the trace context left out.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        // serde_json's Value keeps object keys in a BTreeMap (the `preserve_order` feature is not
        // enabled anywhere in the workspace; `canonical_encoding_sorts_keys` guards that).
        serde_json::to_vec(&self.content()).expect("an envelope always serialises")
    }

    /// Hex SHA-256 of the canonical encoding, streamed into the hasher: the bytes of
    /// [`Envelope::canonical_bytes`] without building them.
    pub fn content_hash(&self) -> String {
        let mut hasher = Sha256::new();
        serde_json::to_writer(&mut hasher, &self.content()).expect("an envelope always serialises");
        hex(&hasher.finalize())
    }
}

/// Length of a W3C `traceparent` of version `00`: `00-<32 hex>-<16 hex>-<2 hex>`.
pub const TRACEPARENT_LEN: usize = 55;

/// The regular expression (JSON Schema's `pattern`, without look-around) of exactly the
/// `traceparent` values [`validate_traceparent`] accepts: `00-<32 hex>-<16 hex>-<2 hex>`,
/// lowercase, the trace id and the parent id not all zeros (each written as its leading zeros, a
/// non-zero digit, then any digits).
pub fn traceparent_pattern() -> String {
    let not_all_zeros = |digits: usize| {
        let forms: Vec<String> = (0..digits)
            .map(|zeros| {
                let lead = if zeros > 0 { format!("0{{{zeros}}}") } else { String::new() };
                let rest = digits - zeros - 1;
                let tail = if rest > 0 { format!("[0-9a-f]{{{rest}}}") } else { String::new() };
                format!("{lead}[1-9a-f]{tail}")
            })
            .collect();
        format!("({})", forms.join("|"))
    };
    format!("^00-{}-{}-[0-9a-f]{{2}}$", not_all_zeros(32), not_all_zeros(16))
}

/// Check a W3C trace context `traceparent` (version `00`, lowercase hex, trace id and parent id
/// not all zeros); `invalid_envelope` otherwise.
pub fn validate_traceparent(value: &str) -> Result<()> {
    if parse_traceparent(value).is_none() {
        let shown: String = value.chars().take(80).collect();
        return Err(Error::invalid(
            codes::INVALID_ENVELOPE,
            format!("traceparent must be a W3C trace context of version 00 (00-<32 hex>-<16 hex>-<2 hex>, lowercase, ids not all zeros), got {shown:?}"),
        ));
    }
    Ok(())
}

/// The trace id and parent id of a valid `traceparent` (see [`validate_traceparent`]).
pub fn parse_traceparent(value: &str) -> Option<(&str, &str)> {
    let lower_hex = |s: &str| s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    let not_zero = |s: &str| s.bytes().any(|b| b != b'0');
    if value.len() != TRACEPARENT_LEN {
        return None;
    }
    let mut parts = value.split('-');
    let (version, trace_id, parent_id, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let shaped = version == "00" && trace_id.len() == 32 && parent_id.len() == 16 && flags.len() == 2;
    let valid = shaped
        && [trace_id, parent_id, flags].iter().all(|p| lower_hex(p))
        && not_zero(trace_id)
        && not_zero(parent_id);
    valid.then_some((trace_id, parent_id))
}

/// Hex SHA-256 of `bytes` (lowercase, 64 characters).
pub fn hash_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(digest: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(2 * digest.len());
    for &byte in digest {
        out.push(HEX[usize::from(byte >> 4)] as char);
        out.push(HEX[usize::from(byte & 0x0f)] as char);
    }
    out
}

/// Check that `seq` is a valid seq (at least 1); `invalid_seq` naming `field` otherwise.
pub fn validate_seq(field: &str, seq: i64) -> Result<()> {
    if seq < 1 {
        return Err(Error::invalid(
            codes::INVALID_SEQ,
            format!("{field} must be a positive 64-bit integer, got {seq}"),
        ));
    }
    Ok(())
}

/// Check that a schema version is in 1..=65,535; `invalid_schema_version` otherwise.
pub fn validate_schema_version(version: u32) -> Result<()> {
    if version == 0 || version > SCHEMA_VERSION_MAX {
        return Err(Error::invalid(
            codes::INVALID_SCHEMA_VERSION,
            format!("schema_version must be 1..={SCHEMA_VERSION_MAX}, got {version}"),
        ));
    }
    Ok(())
}

/// Counts the bytes written to it: a value's JSON size without building the JSON (a payload's
/// canonical size here; a page's items in the server).
pub struct ByteCount(pub usize);

impl std::io::Write for ByteCount {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0 += bytes.len();
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Check that a payload is a JSON object of at most 64 KiB in canonical encoding:
/// `payload_too_large` or `invalid_payload` otherwise.
pub fn validate_payload(payload: &serde_json::Value) -> Result<()> {
    let mut count = ByteCount(0);
    let size = serde_json::to_writer(&mut count, payload).map(|()| count.0).unwrap_or(usize::MAX);
    if size > PAYLOAD_BYTES_MAX {
        return Err(Error::invalid(
            codes::PAYLOAD_TOO_LARGE,
            format!("payload is {size} bytes (canonical JSON), limit is {PAYLOAD_BYTES_MAX}"),
        ));
    }
    if !payload.is_object() {
        return Err(Error::invalid(codes::INVALID_PAYLOAD, "payload must be a JSON object"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sample() -> Envelope {
        Envelope {
            event_id: "e1".into(),
            source: "shop".into(),
            generation: "g1".into(),
            flow_id: "r1".into(),
            seq: 1,
            event_type: "reservation.reserved".into(),
            schema_version: 1,
            payload: json!({"amount": 3}),
            created_at_ms: 1,
            traceparent: None,
        }
    }

    const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn the_trace_context_travels_with_the_event_but_is_not_its_content() {
        // The hash of an envelope is the one builds before the trace context had: the SHA-256 of
        // its encoding as it was then (stored hashes stay comparable).
        let plain = sample();
        let pinned = "c010401501e52129767aef55448e2bf563cc50434a9815059809494381968666";
        assert_eq!(plain.content_hash(), pinned);
        let mut traced = sample();
        traced.traceparent = Some(TRACEPARENT.into());
        assert_eq!(traced.content_hash(), pinned, "the trace context is not content");
        assert_eq!(traced.canonical_bytes(), plain.canonical_bytes());
        // It is on the wire when there is one, and absent when there is none.
        let wire = serde_json::to_string(&traced).unwrap();
        assert!(wire.contains(TRACEPARENT), "{wire}");
        assert!(!serde_json::to_string(&plain).unwrap().contains("traceparent"));
        assert_eq!(Envelope::parse(wire.as_bytes()).unwrap(), traced);
        assert_eq!(parse_traceparent(TRACEPARENT), Some(("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")));
    }

    #[test]
    fn a_malformed_trace_context_is_an_invalid_envelope() {
        let bad = [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
            "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
        ];
        for value in bad {
            let mut e = sample();
            e.traceparent = Some(value.into());
            assert_eq!(e.validate().unwrap_err().code(), codes::INVALID_ENVELOPE, "{value:?}");
        }
    }

    #[test]
    fn canonical_encoding_sorts_keys() {
        let a = Envelope::parse(
            br#"{"payload":{"b":1,"a":2},"event_id":"e1","source":"shop","generation":"g1","flow_id":"r1","seq":1,"event_type":"t","schema_version":1,"created_at_ms":1}"#,
        )
        .unwrap();
        let b = Envelope::parse(
            br#"{"event_id":"e1","source":"shop","generation":"g1","flow_id":"r1","seq":1,"event_type":"t","schema_version":1,"payload":{"a":2,"b":1},"created_at_ms":1}"#,
        )
        .unwrap();
        assert_eq!(a.content_hash(), b.content_hash());
        // The streamed hash is the hash of exactly these bytes (stored hashes stay comparable).
        assert_eq!(a.content_hash(), hash_hex(&a.canonical_bytes()));
        assert!(String::from_utf8(a.canonical_bytes()).unwrap().contains(r#"{"a":2,"b":1}"#));
    }

    #[test]
    fn any_content_change_changes_the_hash() {
        let base = sample();
        let mut other = sample();
        other.payload = json!({"amount": 4});
        assert_ne!(base.content_hash(), other.content_hash());
    }

    #[test]
    fn malformed_envelopes_are_errors() {
        assert_eq!(Envelope::parse(b"{").unwrap_err().code(), codes::INVALID_ENVELOPE);
        let mut e = sample();
        e.seq = 0;
        assert_eq!(e.validate().unwrap_err().code(), codes::INVALID_SEQ);
        let mut e = sample();
        e.payload = json!({"x": "y".repeat(PAYLOAD_BYTES_MAX)});
        assert_eq!(e.validate().unwrap_err().code(), codes::PAYLOAD_TOO_LARGE);
        // The limit counts canonical bytes: {"x":"..."} is 8 bytes around the string.
        e.payload = json!({"x": "y".repeat(PAYLOAD_BYTES_MAX - 8)});
        assert!(e.validate().is_ok());
        e.payload = json!({"x": "y".repeat(PAYLOAD_BYTES_MAX - 7)});
        assert_eq!(e.validate().unwrap_err().code(), codes::PAYLOAD_TOO_LARGE);
        let with_extra = br#"{"event_id":"e1","source":"s","generation":"g","flow_id":"f","seq":1,"event_type":"t","schema_version":1,"payload":{},"created_at_ms":1,"extra":1}"#;
        assert_eq!(Envelope::parse(with_extra).unwrap_err().code(), codes::INVALID_ENVELOPE);
    }
}
