//! A registry of payload decoders per (event type, schema version). An event whose type or
//! version has no decoder is `blocked` at apply, with a reason; its stored body never changes.

use std::collections::BTreeMap;

type DecodeFn<E> = Box<dyn Fn(&serde_json::Value) -> Result<E, String> + Send + Sync>;

/// The decoders a consumer knows, per (event type, schema version): how a stored payload becomes
/// the handler's typed event `E`. Registering a new version (the reservation's `--support-v2`) is
/// how a blocked record becomes applicable without changing its stored body.
pub struct DecoderRegistry<E> {
    decoders: BTreeMap<(String, u32), DecodeFn<E>>,
}

impl<E> Default for DecoderRegistry<E> {
    fn default() -> Self {
        DecoderRegistry { decoders: BTreeMap::new() }
    }
}

impl<E> DecoderRegistry<E> {
    /// An empty registry: every event is blocked as an unknown event type.
    pub fn new() -> Self {
        Self::default()
    }

    /// Register `decode` for payloads of `event_type` at `schema_version`, replacing any decoder
    /// registered there before. Its `Err` is the reason the record is blocked.
    pub fn register(
        &mut self,
        event_type: &str,
        schema_version: u32,
        decode: impl Fn(&serde_json::Value) -> Result<E, String> + Send + Sync + 'static,
    ) {
        self.decoders.insert((event_type.to_string(), schema_version), Box::new(decode));
    }

    /// Decode a payload; `Err` is the blocked reason.
    pub fn decode(&self, event_type: &str, schema_version: u32, payload: &serde_json::Value) -> Result<E, String> {
        match self.decoders.get(&(event_type.to_string(), schema_version)) {
            Some(decode) => decode(payload).map_err(|e| format!("invalid payload: {e}")),
            None if self.decoders.keys().any(|(t, _)| t == event_type) => {
                Err(format!("unknown schema version {schema_version} for {event_type}"))
            }
            None => Err(format!("unknown event type {event_type}")),
        }
    }
}
