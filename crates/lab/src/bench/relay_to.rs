//! `tidemark bench --relay-to http|nats`: events from one `tidemark serve` (orders) to another
//! (shipping), over HTTP or through NATS JetStream, against the raw rate of the same transport
//! in the same run.
//!
//! Two child servers, each with its own data folder and token. `--relay-events` events over
//! `--relay-flows` flows are appended to orders' outbox first (not measured); then orders
//! subscribes shipping's `ledger` consumer (`http://.../v1/consumers/ledger/inbox`, or
//! `nats://<--nats>/<prefix>` with shipping consuming the stream through `[[sources]]`) from the
//! start, and the clock runs until shipping has **applied** every event (the sum of its
//! high-water marks, polled every 20 ms over its API). That is the relay (read, hand over,
//! record), the transport, the receiving inbox's commit and its drain.
//!
//! The raw rate, in the same invocation: this process hands the same number of fresh envelopes,
//! in batches of the relay's batch size, one batch in flight as a lane has, through the same
//! transport (`HttpTransport` to shipping's batch receive route of another consumer, answered
//! after its inbox commit; `NatsTransport` publishes with PubAcks to the stream): the ceiling of
//! the hop itself, without tidemark's outbox on the sending side or the drain on the receiving
//! side. Checked: every event applied once on shipping (each flow's high-water mark is its
//! last seq), nothing left pending or quarantined on orders.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tidemark_core::tenancy::{Scope, TokenText};
use tidemark_core::{Envelope, Error, Result};
use tidemark_store_sqlite::{Durability, SqliteControl};
use tidemark_transport::{connect, TransportConfig};

use super::serve::{Server, ServerCommand};
use super::workflows::load_average;
use super::{durability_word, failed, round1, round3};

/// What `--relay-to` measures.
#[derive(Debug, Clone)]
pub struct Params {
    /// `http` or `nats`.
    pub kind: String,
    pub events: u64,
    pub flows: u64,
    /// The sender's `relay.batch`, and the raw run's batch size.
    pub batch: usize,
    /// `host:port` of the NATS server (JetStream on).
    pub nats: String,
}

/// How long the whole delivery may take.
const DELIVER_WAIT: Duration = Duration::from_secs(600);

fn config(data: &Path, durability: Durability, extra: &str) -> String {
    let data = data.display().to_string().replace('\\', "\\\\").replace('"', "\\\"");
    format!(
        "data_dir = \"{data}\"\nlisten = \"127.0.0.1:0\"\ndurability = \"{}\"\n\n\
         [auth]\nrate_per_second = 1000000\nburst = 10000000\n\n{extra}",
        durability_word(durability)
    )
}

/// A token of `tenant` in a fresh data folder's control file.
fn token(data: &Path, tenant: &str, durability: Durability) -> Result<String> {
    std::fs::create_dir_all(data).map_err(|e| Error::io(format!("{}: {e}", data.display())))?;
    let token = TokenText::from_random(rand::random(), rand::random());
    let mut control = SqliteControl::open(&data.join(tidemark_server::CONTROL_FILE), true, durability)?;
    control.create_token(&token, tenant, Scope::Admin, "bench --relay-to", tidemark_engine::now_ms())?;
    Ok(token.text().to_string())
}

struct Api {
    client: reqwest::blocking::Client,
    base: String,
    token: String,
}

impl Api {
    fn new(server: &Server, token: &str) -> Result<Api> {
        let client = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .map_err(|e| Error::io(e.to_string()))?;
        Ok(Api { client, base: format!("http://{}", server.addr), token: token.to_string() })
    }

    fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Result<Value> {
        let mut request = self.client.request(method.clone(), format!("{}{path}", self.base)).bearer_auth(&self.token);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().map_err(|e| Error::io(format!("{method} {path}: {e}")))?;
        let status = response.status();
        let body: Value = response.json().unwrap_or(Value::Null);
        if !status.is_success() {
            return Err(failed(format!("{method} {path} answered {status}: {body}")));
        }
        Ok(body)
    }
}

/// Append `events` over `flows` stream flows, from 8 threads (not measured).
fn preload(api: &Api, events: u64, flows: u64) -> Result<()> {
    let api = Arc::new(Api { client: api.client.clone(), base: api.base.clone(), token: api.token.clone() });
    let threads: Vec<_> = (0..8_u64)
        .map(|t| {
            let api = api.clone();
            std::thread::spawn(move || -> Result<()> {
                for i in (t..events).step_by(8) {
                    let flow = format!("parcel-{}", i % flows);
                    api.call(
                        reqwest::Method::POST,
                        &format!("/v1/streams/{flow}/events"),
                        Some(json!({"event_type": "parcel.noted", "payload": {"i": i}})),
                    )?;
                }
                Ok(())
            })
        })
        .collect();
    for thread in threads {
        thread.join().map_err(|_| failed("a preload thread panicked".into()))??;
    }
    Ok(())
}

/// The sum of `ledger`'s high-water marks on shipping, and the number of flows it has seen.
fn applied(api: &Api) -> Result<(u64, u64)> {
    let page = api.call(reqwest::Method::GET, "/v1/consumers/ledger/cursors", None)?;
    let cursors = page["cursors"].as_array().cloned().unwrap_or_default();
    Ok((cursors.iter().filter_map(|c| c["high_water_seq"].as_u64()).sum(), cursors.len() as u64))
}

/// The raw transport: `events` fresh envelopes in batches of `batch`, one batch in flight.
fn raw_rate(runtime: &tokio::runtime::Runtime, endpoint: &str, config: &TransportConfig, p: &Params) -> Result<Value> {
    let transport = connect(endpoint, config)?;
    let now = tidemark_engine::now_ms();
    let run = uuid::Uuid::new_v4().simple().to_string();
    let envelopes: Vec<(String, Envelope)> = (0..p.events)
        .map(|i| {
            let flow = i % p.flows;
            let seq = (i / p.flows + 1) as i64;
            let envelope = Envelope {
                event_id: format!("raw-{run}-{i}"),
                source: "rawbench".into(),
                generation: run.clone(),
                flow_id: format!("raw-{flow}"),
                seq,
                event_type: "parcel.noted".into(),
                schema_version: 1,
                payload: json!({"i": i}),
                created_at_ms: now,
                traceparent: None,
            };
            ("raw".to_string(), envelope)
        })
        .collect();
    let t = Instant::now();
    let mut accepted = 0_u64;
    runtime.block_on(async {
        for batch in envelopes.chunks(p.batch) {
            let outcomes = transport.deliver(batch).await?;
            accepted += outcomes.iter().filter(|o| o.is_custody()).count() as u64;
        }
        Ok::<(), Error>(())
    })?;
    let seconds = t.elapsed().as_secs_f64();
    if accepted != p.events {
        return Err(failed(format!("the raw run got custody of {accepted} of {} events", p.events)));
    }
    Ok(json!({"events": p.events, "seconds": round3(seconds), "events_per_s": round1(p.events as f64 / seconds)}))
}

pub fn run(dir: &Path, durability: Durability, p: &Params, command: &ServerCommand) -> Result<Value> {
    let load_at_start = load_average();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::io(format!("cannot start the async runtime: {e}")))?;
    let prefix = format!("tmkbench{}", uuid::Uuid::new_v4().simple());
    let stream = prefix.to_uppercase();
    let nats_from = format!("nats://{}/{prefix}", p.nats);
    if p.kind == "nats" {
        runtime.block_on(async {
            let client = async_nats::connect(p.nats.as_str())
                .await
                .map_err(|e| Error::io(format!("cannot connect to NATS at {}: {e}", p.nats)))?;
            async_nats::jetstream::new(client)
                .create_stream(async_nats::jetstream::stream::Config {
                    name: stream.clone(),
                    subjects: vec![format!("{prefix}.>"), format!("{prefix}raw.>")],
                    ..Default::default()
                })
                .await
                .map_err(|e| Error::io(format!("cannot create the stream {stream}: {e}")))?;
            Ok::<(), Error>(())
        })?;
    }

    // shipping: consumer `ledger` (and `raw`, for the raw HTTP run), fed by HTTP or the stream.
    let ship_data = dir.join("shipping");
    let ship_token = token(&ship_data, "shipping", durability)?;
    let sources = if p.kind == "nats" {
        format!(
            "[[sources]]\ntenant = \"shipping\"\nconsumer = \"ledger\"\nfrom = \"{nats_from}\"\nstream = \"{stream}\"\n\
             batch = {}\n",
            p.batch.min(1_000)
        )
    } else {
        String::new()
    };
    let ship_config = dir.join("shipping.toml");
    std::fs::write(&ship_config, config(&ship_data, durability, &sources)).map_err(|e| Error::io(e.to_string()))?;
    let shipping = Server::start(command, &ship_config, &dir.join("shipping.log"))?;
    let ship = Api::new(&shipping, &ship_token)?;
    for consumer in ["ledger", "raw"] {
        ship.call(
            reqwest::Method::PUT,
            &format!("/v1/consumers/{consumer}"),
            Some(json!({"handler": "record", "subscribe": false})),
        )?;
    }

    // orders: the outbox, relayed with `relay.batch` = --relay-batch.
    let orders_data = dir.join("orders");
    let orders_token = token(&orders_data, "orders", durability)?;
    let origin = format!("http://{}", shipping.addr);
    let relay = format!("[relay]\nbatch = {}\n[relay.tokens]\n\"{origin}\" = \"{ship_token}\"\n", p.batch);
    let orders_config = dir.join("orders.toml");
    std::fs::write(&orders_config, config(&orders_data, durability, &relay)).map_err(|e| Error::io(e.to_string()))?;
    let orders_server = Server::start(command, &orders_config, &dir.join("orders.log"))?;
    let orders = Api::new(&orders_server, &orders_token)?;
    preload(&orders, p.events, p.flows)?;

    let endpoint = match p.kind.as_str() {
        "http" => format!("{origin}/v1/consumers/ledger/inbox"),
        _ => nats_from.clone(),
    };
    let t = Instant::now();
    orders.call(
        reqwest::Method::PUT,
        "/v1/subscriptions/ledger",
        Some(json!({"endpoint": endpoint, "from_start": true})),
    )?;
    let mut polls = 0_u64;
    let (applied_seqs, flows_seen) = loop {
        let (seqs, flows) = applied(&ship)?;
        polls += 1;
        if seqs >= p.events {
            break (seqs, flows);
        }
        if t.elapsed() > DELIVER_WAIT {
            return Err(failed(format!("{seqs} of {} events applied within {DELIVER_WAIT:?}", p.events)));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let seconds = t.elapsed().as_secs_f64();
    let pending = orders.call(reqwest::Method::GET, "/v1/outbox?status=pending&limit=10", None)?;
    let quarantined = orders.call(reqwest::Method::GET, "/v1/outbox?status=quarantined&limit=10", None)?;
    let nothing_left = |page: &Value| page["deliveries"].as_array().is_some_and(Vec::is_empty);
    let passed = applied_seqs == p.events
        && flows_seen == p.flows.min(p.events)
        && nothing_left(&pending)
        && nothing_left(&quarantined);

    let transport_config = TransportConfig {
        http_tokens: [(origin.clone(), ship_token.clone())].into_iter().collect(),
        ..TransportConfig::default()
    };
    let raw_endpoint = match p.kind.as_str() {
        "http" => format!("{origin}/v1/consumers/raw/inbox"),
        _ => format!("nats://{}/{prefix}raw", p.nats),
    };
    let raw = raw_rate(&runtime, &raw_endpoint, &transport_config, p)?;
    let orders_stop = orders_server.stop()?;
    let shipping_stop = shipping.stop()?;
    if p.kind == "nats" {
        let _ = runtime.block_on(async {
            let client = async_nats::connect(p.nats.as_str()).await.ok()?;
            async_nats::jetstream::new(client).delete_stream(&stream).await.ok()
        });
    }
    let rate = p.events as f64 / seconds;
    let raw_rate = raw["events_per_s"].as_f64().unwrap_or(0.0);
    let ratio = if raw_rate > 0.0 { rate / raw_rate } else { 0.0 };
    Ok(json!({
        "outcome": "bench",
        "kind": "relay_to",
        "transport": p.kind,
        "durability": durability_word(durability),
        "params": {"events": p.events, "flows": p.flows, "batch": p.batch, "nats": p.nats,
                   "load_average_at_start": load_at_start},
        "tidemark": {
            "events": p.events,
            "seconds": round3(seconds),
            "events_per_s": round1(rate),
            "watcher_polls": polls,
            "what": "from the subscription (from the start) of an outbox holding every event to the receiving \
                     server's apply of the last one: relay, transport, the receiving inbox's commit, its drain",
        },
        "raw_transport": raw,
        "ratio_to_raw": round3(ratio),
        "targets": {"at_least_half_of_the_raw_transport": ratio >= 0.5},
        "stop": {"orders": orders_stop, "shipping": shipping_stop},
        "check": {
            "passed": passed,
            "applied_seqs": applied_seqs,
            "flows": flows_seen,
            "what": "every event applied once on the receiver (the sum of its flows' high-water marks is the \
                     number of events, over every flow); nothing pending or quarantined on the sender",
        },
    }))
}
