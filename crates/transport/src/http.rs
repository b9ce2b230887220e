//! Another tidemark's inbox over HTTP(S): `POST {endpoint}/batch`.
//!
//! Custody: the receiving server answers `200 {"outcomes": [...]}` only after its inbox
//! transaction committed the batch, one outcome per event in order (`accepted`, `duplicate`,
//! `conflict`, `expired`); the relay records exactly those answers. Any other answer (a status
//! other than 200, a body that is not that document, a count that does not match, a connection
//! error) fails every event of the batch: it is retried, and the remote inbox answers
//! `duplicate` for what it already stored.

use serde::Deserialize;
use tidemark_core::endpoint::EndpointKind;
use tidemark_core::error::codes;
use tidemark_core::limits::{HTTP_RECEIVE_BATCH_BYTES_MAX, HTTP_RECEIVE_BATCH_EVENTS_MAX};
use tidemark_core::store::ReceiveOutcome;
use tidemark_core::{Envelope, Error, Result};

use crate::{chunk_ranges, Delivered, Transport, TransportConfig};

/// Its answer.
#[derive(Deserialize)]
struct BatchAnswer {
    outcomes: Vec<ReceiveOutcome>,
}

/// An error and its causes, innermost last (reqwest's own text says only "error sending
/// request"; the cause says why: a refused connection, an unknown certificate issuer).
fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(inner) = cause {
        let more = inner.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cause = inner.source();
    }
    text
}

/// The longest CA file read, in bytes.
pub const CA_FILE_BYTES_MAX: u64 = 1024 * 1024;

/// The root certificates of a PEM file (`relay.ca_file`): at least one, at most
/// [`CA_FILE_BYTES_MAX`] bytes; anything else is `invalid_config`, with the file named.
pub fn load_roots(path: &std::path::Path) -> Result<Vec<reqwest::Certificate>> {
    let invalid =
        |why: String| Error::invalid(codes::INVALID_CONFIG, format!("relay.ca_file {}: {why}", path.display()));
    let file = std::fs::File::open(path).map_err(|e| invalid(format!("cannot be read: {e}")))?;
    let mut pem = Vec::new();
    std::io::Read::read_to_end(&mut std::io::Read::take(file, CA_FILE_BYTES_MAX + 1), &mut pem)
        .map_err(|e| invalid(format!("cannot be read: {e}")))?;
    if pem.len() as u64 > CA_FILE_BYTES_MAX {
        return Err(invalid(format!("is larger than {CA_FILE_BYTES_MAX} bytes")));
    }
    let roots =
        reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| invalid(format!("is not PEM certificates: {e}")))?;
    if roots.is_empty() {
        return Err(invalid("holds no PEM certificate".into()));
    }
    Ok(roots)
}

/// The error body every tidemark route answers with.
#[derive(Deserialize)]
struct ErrorAnswer {
    error: ErrorDetail,
}

#[derive(Deserialize)]
struct ErrorDetail {
    code: String,
    message: String,
}

/// A tidemark inbox at an `http(s)://.../v1/consumers/{id}/inbox` endpoint, with its bearer token.
pub struct HttpTransport {
    client: reqwest::Client,
    batch_url: String,
    token: String,
}

impl HttpTransport {
    /// A client for the inbox at `url` (its `/batch` route) that authenticates with `token`.
    pub fn new(url: &str, token: String, config: &TransportConfig) -> Result<HttpTransport> {
        let mut builder = reqwest::Client::builder().connect_timeout(config.connect_timeout).pool_max_idle_per_host(2);
        if let Some(path) = &config.http_ca_file {
            for root in load_roots(path)? {
                builder = builder.add_root_certificate(root);
            }
        }
        let client = builder.build().map_err(|e| Error::io(format!("cannot build the HTTP client: {e}")))?;
        Ok(HttpTransport { client, batch_url: format!("{url}/batch"), token })
    }

    /// POST the body `{"events": [...]}` of `encoded` envelopes (each's JSON, encoded once).
    async fn post(&self, encoded: &[Vec<u8>]) -> Result<Vec<ReceiveOutcome>> {
        let mut body = Vec::with_capacity(encoded.iter().map(|e| e.len() + 1).sum::<usize>() + 12);
        body.extend_from_slice(b"{\"events\":[");
        for (i, envelope) in encoded.iter().enumerate() {
            if i > 0 {
                body.push(b',');
            }
            body.extend_from_slice(envelope);
        }
        body.extend_from_slice(b"]}");
        let response = self
            .client
            .post(&self.batch_url)
            .bearer_auth(&self.token)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body)
            .send()
            .await
            .map_err(|e| Error::io(format!("POST {}: {}", self.batch_url, with_causes(&e))))?;
        let status = response.status();
        let bytes = response.bytes().await.map_err(|e| Error::io(format!("POST {}: {e}", self.batch_url)))?;
        if status != reqwest::StatusCode::OK {
            let why = match serde_json::from_slice::<ErrorAnswer>(&bytes) {
                Ok(answer) => format!("{} {}", answer.error.code, answer.error.message),
                Err(_) => String::from_utf8_lossy(&bytes[..bytes.len().min(200)]).into_owned(),
            };
            return Err(Error::io(format!("POST {} answered {status}: {why}", self.batch_url)));
        }
        let answer: BatchAnswer = serde_json::from_slice(&bytes).map_err(|e| {
            Error::io(format!("POST {} answered 200 with a body that is not a batch answer: {e}", self.batch_url))
        })?;
        if answer.outcomes.len() != encoded.len() {
            return Err(Error::io(format!(
                "POST {} answered {} outcomes for {} events",
                self.batch_url,
                answer.outcomes.len(),
                encoded.len()
            )));
        }
        Ok(answer.outcomes)
    }
}

impl Transport for HttpTransport {
    fn kind(&self) -> EndpointKind {
        EndpointKind::Http
    }

    fn deliver<'a>(&'a self, items: &'a [(String, Envelope)]) -> Delivered<'a> {
        Box::pin(async move {
            // One request per chunk, in order, each within the receiving side's limits; a failed
            // chunk fails the whole batch (what earlier chunks stored is `duplicate` next time).
            let encoded = items
                .iter()
                .map(|(_, envelope)| serde_json::to_vec(envelope))
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| Error::Invariant(format!("an envelope did not encode: {e}")))?;
            let sizes: Vec<usize> = encoded.iter().map(|e| e.len() + 1).collect();
            let mut outcomes = Vec::with_capacity(items.len());
            for range in chunk_ranges(&sizes, HTTP_RECEIVE_BATCH_EVENTS_MAX, HTTP_RECEIVE_BATCH_BYTES_MAX) {
                outcomes.extend(self.post(&encoded[range]).await?);
            }
            Ok(outcomes)
        })
    }
}
