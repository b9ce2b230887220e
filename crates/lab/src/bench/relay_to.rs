//! `tidemark bench --relay-to http|nats|rabbitmq`: events from one `tidemark serve` (orders) to
//! another (shipping), over HTTP, through NATS JetStream or through RabbitMQ, against the raw rate
//! of the same transport in the same run.
//!
//! Two child servers, each with its own data folder and token. `--relay-events` events over
//! `--relay-flows` flows are appended to orders' outbox first (not measured); then orders
//! subscribes shipping's `ledger` consumer (`http://.../v1/consumers/ledger/inbox`;
//! `nats://<--nats>/<prefix>` with shipping consuming the stream through `[[sources]]`; or
//! `amqp://<--amqp>/<exchange>` with shipping consuming a quorum queue bound to it through
//! `[[sources]]`) from the start, and the clock runs until shipping has **applied** every event
//! (the sum of its high-water marks, polled every 20 ms over its API). That is the relay (read,
//! hand over, record), the transport, the receiving inbox's commit and its drain. The bench
//! creates the stream, or the exchanges and queues, it runs on, and deletes them afterwards.
//!
//! The raw rate, in the same invocation: this process hands the same number of fresh envelopes,
//! in batches of the relay's batch size, one batch in flight as a lane has, through the same
//! transport (`HttpTransport` to shipping's batch receive route of another consumer, answered
//! after its inbox commit; `NatsTransport` publishes with PubAcks to the stream;
//! `AmqpTransport` confirmed, persistent, mandatory publishes to an exchange of their own, bound
//! to a quorum queue of their own): the ceiling of the hop itself, without tidemark's outbox on
//! the sending side or the drain on the receiving side. Checked: every event applied once on
//! shipping (each flow's high-water mark is its last seq), nothing left pending or quarantined on
//! orders. Beside each rate, `cpu_seconds`: what the two servers, the broker and this process
//! spent on a CPU meanwhile, and `cores_busy` (their sum over the wall time; near 2.0 the
//! machine's two cores, not waiting, set the rate).
//!
//! `--black-hole` (HTTP only): after that first delivery, orders subscribes an endpoint that
//! accepts connections and never answers (a listener of this process that reads and never
//! writes), waits until its lane holds a batch in flight, then subscribes a second healthy
//! consumer (`ledger2`) from the start and measures it the same way; then moves the black hole's
//! subscription to `pull:` (its lane ends) and measures a third healthy consumer (`ledger3`)
//! alone again. The cost of the black hole is the healthy rate beside it against the mean of the
//! two rates alone, before and after it, so the phases' order is no bias.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tidemark_core::tenancy::ControlStore;
use tidemark_core::tenancy::{Scope, TokenText};
use tidemark_core::{Envelope, Error, Result};
use tidemark_store_sqlite::{Durability, SqliteControl};
use tidemark_transport::{connect, TransportConfig};

use super::serve::{Server, ServerCommand};
use super::workflows::{load_average, named_cpu_seconds, pid_cpu_seconds, process_cpu_seconds};
use super::{durability_word, failed, round1, round3};

/// What `--relay-to` measures.
#[derive(Debug, Clone)]
pub struct Params {
    /// `http`, `nats` or `rabbitmq`.
    pub kind: String,
    pub events: u64,
    pub flows: u64,
    /// The sender's `relay.batch`, and the raw run's batch size.
    pub batch: usize,
    /// `host:port` of the NATS server (JetStream on).
    pub nats: String,
    /// `host:port` of the RabbitMQ broker (as `guest`, which it accepts from loopback).
    pub amqp: String,
    /// Also measure the healthy rate beside a subscription to an endpoint that never answers.
    pub black_hole: bool,
}

/// The broker names of one run (unique per run, created by it and deleted after it).
struct Names {
    /// NATS: the subject prefix of the relay (`<prefix>.>`) and of the raw run (`<prefix>raw.>`).
    prefix: String,
    /// NATS: the stream capturing both.
    stream: String,
    /// RabbitMQ: the relay's exchange and shipping's queue bound to it; the raw run's exchange and
    /// queue.
    exchange: String,
    queue: String,
    raw_exchange: String,
    raw_queue: String,
}

impl Names {
    fn new() -> Names {
        let prefix = format!("tmkbench{}", uuid::Uuid::new_v4().simple());
        Names {
            stream: prefix.to_uppercase(),
            exchange: format!("{prefix}.orders"),
            queue: format!("{prefix}.shipping"),
            raw_exchange: format!("{prefix}.raw"),
            raw_queue: format!("{prefix}.rawq"),
            prefix,
        }
    }
}

impl Names {
    /// RabbitMQ: the relay's exchange and shipping's queue, the raw run's exchange and queue.
    fn routes(&self) -> [(String, String); 2] {
        [(self.exchange.clone(), self.queue.clone()), (self.raw_exchange.clone(), self.raw_queue.clone())]
    }
}

/// Create what the run needs on the broker: the stream (NATS), or two topic exchanges, each bound
/// (`#`) to a durable quorum queue of its own (RabbitMQ: the relay's, which shipping consumes, and
/// the raw run's, which only fills).
fn create_broker_names(runtime: &tokio::runtime::Runtime, p: &Params, names: &Names) -> Result<()> {
    match p.kind.as_str() {
        "nats" => crate::brokers::create_stream(
            runtime,
            &p.nats,
            &names.stream,
            vec![format!("{}.>", names.prefix), format!("{}raw.>", names.prefix)],
        ),
        "rabbitmq" => crate::brokers::declare_routes(runtime, &p.amqp, &names.routes()),
        _ => Ok(()),
    }
}

/// Delete what [`create_broker_names`] created (best effort: the run's answer does not depend on it).
fn delete_broker_names(runtime: &tokio::runtime::Runtime, p: &Params, names: &Names) {
    match p.kind.as_str() {
        "nats" => crate::brokers::delete_stream(runtime, &p.nats, &names.stream),
        "rabbitmq" => crate::brokers::delete_routes(runtime, &p.amqp, &names.routes()),
        _ => {}
    }
}

/// An endpoint that accepts TCP connections and never answers: each connection is read until the
/// peer closes it (the lane's attempt timeout), and nothing is ever written. Stops accepting when
/// dropped.
struct BlackHole {
    addr: std::net::SocketAddr,
    stop: Arc<std::sync::atomic::AtomicBool>,
    accepted: Arc<std::sync::atomic::AtomicU64>,
}

impl BlackHole {
    /// How often the accepting thread looks at its stop flag.
    const POLL: Duration = Duration::from_millis(10);

    fn start() -> Result<BlackHole> {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| Error::io(e.to_string()))?;
        listener.set_nonblocking(true).map_err(|e| Error::io(e.to_string()))?;
        let addr = listener.local_addr().map_err(|e| Error::io(e.to_string()))?;
        let (stop, accepted) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
        let (stopping, counting) = (stop.clone(), accepted.clone());
        std::thread::spawn(move || {
            while !stopping.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((mut stream, _)) => {
                        counting.fetch_add(1, Ordering::SeqCst);
                        std::thread::spawn(move || {
                            use std::io::Read;
                            let _ = stream.set_nonblocking(false);
                            let mut buffer = [0_u8; 64 * 1024];
                            // Until the peer closes (0) or resets (an error): never a byte back.
                            while stream.read(&mut buffer).is_ok_and(|n| n > 0) {}
                        });
                    }
                    Err(_) => std::thread::sleep(Self::POLL),
                }
            }
        });
        Ok(BlackHole { addr, stop, accepted })
    }

    fn accepted(&self) -> u64 {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for BlackHole {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
    }
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

/// The sum of `consumer`'s high-water marks on shipping, and the number of flows it has seen.
fn applied(api: &Api, consumer: &str) -> Result<(u64, u64)> {
    let page = api.call(reqwest::Method::GET, &format!("/v1/consumers/{consumer}/cursors"), None)?;
    let cursors = page["cursors"].as_array().cloned().unwrap_or_default();
    Ok((cursors.iter().filter_map(|c| c["high_water_seq"].as_u64()).sum(), cursors.len() as u64))
}

/// One measured delivery: subscribe `consumer` at `endpoint` from the start of an outbox holding
/// every event, and wait until shipping applied them all.
struct Delivery {
    seconds: f64,
    polls: u64,
    applied_seqs: u64,
    flows_seen: u64,
}

impl Delivery {
    fn measure(orders: &Api, ship: &Api, consumer: &str, endpoint: &str, p: &Params) -> Result<Delivery> {
        let t = Instant::now();
        orders.call(
            reqwest::Method::PUT,
            &format!("/v1/subscriptions/{consumer}"),
            Some(json!({"endpoint": endpoint, "from_start": true})),
        )?;
        let mut polls = 0_u64;
        loop {
            let (applied_seqs, flows_seen) = applied(ship, consumer)?;
            polls += 1;
            if applied_seqs >= p.events {
                return Ok(Delivery { seconds: t.elapsed().as_secs_f64(), polls, applied_seqs, flows_seen });
            }
            if t.elapsed() > DELIVER_WAIT {
                return Err(failed(format!(
                    "{applied_seqs} of {} events applied for {consumer} within {DELIVER_WAIT:?}",
                    p.events
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn rate(&self, p: &Params) -> f64 {
        p.events as f64 / self.seconds
    }

    fn passed(&self, p: &Params) -> bool {
        self.applied_seqs == p.events && self.flows_seen == p.flows.min(p.events)
    }

    fn json(&self, p: &Params) -> Value {
        json!({
            "events": p.events,
            "seconds": round3(self.seconds),
            "events_per_s": round1(self.rate(p)),
            "watcher_polls": self.polls,
            "applied_seqs": self.applied_seqs,
            "flows": self.flows_seen,
        })
    }
}

/// CPU seconds so far of the processes a delivery runs on: the two servers, the broker (every
/// process named `nats-server` or `beam.smp`) and this one (the raw runs, the watcher's polls).
/// Two snapshots' difference, beside the wall time, says whether the machine's two cores were
/// the limit.
#[derive(Clone, Copy)]
struct Cpu {
    orders: Option<f64>,
    shipping: Option<f64>,
    broker: Option<f64>,
    bench: Option<f64>,
}

impl Cpu {
    fn now(orders: &Server, shipping: &Server, kind: &str) -> Cpu {
        let broker = match kind {
            "nats" => named_cpu_seconds("nats-server"),
            "rabbitmq" => named_cpu_seconds("beam.smp"),
            _ => None,
        };
        Cpu {
            orders: pid_cpu_seconds(&orders.pid().to_string()),
            shipping: pid_cpu_seconds(&shipping.pid().to_string()),
            broker,
            bench: process_cpu_seconds(),
        }
    }

    /// What each used since `start`, in CPU seconds and as a share of the wall time (`total`
    /// near 2.0 means both cores were busy).
    fn since(&self, start: &Cpu, wall_seconds: f64) -> Value {
        let used = |end: Option<f64>, start: Option<f64>| end.zip(start).map(|(e, s)| round3(e - s));
        let parts = [
            ("orders", used(self.orders, start.orders)),
            ("shipping", used(self.shipping, start.shipping)),
            ("broker", used(self.broker, start.broker)),
            ("bench", used(self.bench, start.bench)),
        ];
        let total: f64 = parts.iter().filter_map(|(_, s)| *s).sum();
        let mut out: serde_json::Map<String, Value> =
            parts.iter().map(|(name, s)| (name.to_string(), json!(s))).collect();
        out.insert("total".into(), json!(round3(total)));
        out.insert("cores_busy".into(), json!(round3(total / wall_seconds.max(1e-9))));
        Value::Object(out)
    }
}

/// The lane of `consumer`'s subscription to orders' producer outbox, as `GET /v1/subscriptions` shows it.
fn lane(orders: &Api, consumer: &str) -> Result<Value> {
    let page = orders.call(reqwest::Method::GET, "/v1/subscriptions", None)?;
    let subscriptions = page["subscriptions"].as_array().cloned().unwrap_or_default();
    Ok(subscriptions
        .into_iter()
        .find(|s| s["consumer_id"] == consumer && s["outbox"] == "producer")
        .map(|s| json!({"lane": s["lane"], "pending": s["pending"], "pending_capped": s["pending_capped"]}))
        .unwrap_or(Value::Null))
}

/// The raw transport: `events` fresh envelopes in batches of `batch`, one batch in flight.
fn raw_rate(
    runtime: &tokio::runtime::Runtime,
    endpoint: &str,
    config: &TransportConfig,
    p: &Params,
    (orders, shipping): (&Server, &Server),
) -> Result<Value> {
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
    let cpu_start = Cpu::now(orders, shipping, &p.kind);
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
    let cpu = Cpu::now(orders, shipping, &p.kind).since(&cpu_start, seconds);
    if accepted != p.events {
        return Err(failed(format!("the raw run got custody of {accepted} of {} events", p.events)));
    }
    Ok(json!({"events": p.events, "seconds": round3(seconds), "events_per_s": round1(p.events as f64 / seconds),
        "cpu_seconds": cpu}))
}

pub fn run(dir: &Path, durability: Durability, p: &Params, command: &ServerCommand) -> Result<Value> {
    if p.black_hole && p.kind != "http" {
        return Err(crate::invalid("--black-hole measures delivery over HTTP: use it with --relay-to http"));
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::io(format!("cannot start the async runtime: {e}")))?;
    let names = Names::new();
    create_broker_names(&runtime, p, &names)?;
    let out = measure(dir, durability, p, command, &runtime, &names);
    delete_broker_names(&runtime, p, &names);
    out
}

fn measure(
    dir: &Path,
    durability: Durability,
    p: &Params,
    command: &ServerCommand,
    runtime: &tokio::runtime::Runtime,
    names: &Names,
) -> Result<Value> {
    let load_at_start = load_average();
    let nats_from = format!("nats://{}/{}", p.nats, names.prefix);

    // shipping: consumer `ledger` (and `raw`, for the raw HTTP run; `ledger2`, beside the black
    // hole), fed over HTTP or by a source.
    let ship_data = dir.join("shipping");
    let ship_token = token(&ship_data, "shipping", durability)?;
    let source = |from: &str, stream: &str| {
        format!(
            "[[sources]]\ntenant = \"shipping\"\nconsumer = \"ledger\"\nfrom = \"{from}\"\n{stream}batch = {}\n",
            p.batch.min(1_000)
        )
    };
    let sources = match p.kind.as_str() {
        "nats" => source(&nats_from, &format!("stream = \"{}\"\n", names.stream)),
        "rabbitmq" => source(&format!("amqp://{}/{}", p.amqp, names.queue), ""),
        _ => String::new(),
    };
    let ship_config = dir.join("shipping.toml");
    std::fs::write(&ship_config, config(&ship_data, durability, &sources)).map_err(|e| Error::io(e.to_string()))?;
    let shipping = Server::start(command, &ship_config, &dir.join("shipping.log"))?;
    let ship = Api::new(&shipping, &ship_token)?;
    let consumers: &[&str] = if p.black_hole { &["ledger", "raw", "ledger2", "ledger3"] } else { &["ledger", "raw"] };
    for consumer in consumers {
        ship.call(
            reqwest::Method::PUT,
            &format!("/v1/consumers/{consumer}"),
            Some(json!({"handler": "record", "subscribe": false})),
        )?;
    }

    // orders: the outbox, relayed with `relay.batch` = --relay-batch.
    let black_hole = if p.black_hole { Some(BlackHole::start()?) } else { None };
    let orders_data = dir.join("orders");
    let orders_token = token(&orders_data, "orders", durability)?;
    let origin = format!("http://{}", shipping.addr);
    let mut tokens = format!("\"{origin}\" = \"{ship_token}\"\n");
    if let Some(hole) = &black_hole {
        tokens.push_str(&format!("\"http://{}\" = \"no one checks it\"\n", hole.addr));
    }
    let relay = format!("[relay]\nbatch = {}\n[relay.tokens]\n{tokens}", p.batch);
    let orders_config = dir.join("orders.toml");
    std::fs::write(&orders_config, config(&orders_data, durability, &relay)).map_err(|e| Error::io(e.to_string()))?;
    let orders_server = Server::start(command, &orders_config, &dir.join("orders.log"))?;
    let orders = Api::new(&orders_server, &orders_token)?;
    preload(&orders, p.events, p.flows)?;

    let endpoint = match p.kind.as_str() {
        "http" => format!("{origin}/v1/consumers/ledger/inbox"),
        "nats" => nats_from.clone(),
        _ => format!("amqp://{}/{}", p.amqp, names.exchange),
    };
    let cpu_start = Cpu::now(&orders_server, &shipping, &p.kind);
    let alone = Delivery::measure(&orders, &ship, "ledger", &endpoint, p)?;
    let cpu_alone = Cpu::now(&orders_server, &shipping, &p.kind).since(&cpu_start, alone.seconds);

    // Beside a black hole: its lane holds a batch (and waits out the attempt timeout) while a
    // second healthy subscriber receives everything from the start.
    let mut healthy = vec!["ledger"];
    let black_hole_out = match &black_hole {
        Some(hole) => {
            let void = format!("http://{}/v1/consumers/void/inbox", hole.addr);
            orders.call(
                reqwest::Method::PUT,
                "/v1/subscriptions/void",
                Some(json!({"endpoint": void, "from_start": true})),
            )?;
            let t = Instant::now();
            while lane(&orders, "void")?["lane"]["in_flight"] != json!(true) {
                if t.elapsed() > DELIVER_WAIT {
                    return Err(failed(format!(
                        "the black hole's lane had no batch in flight within {DELIVER_WAIT:?}"
                    )));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let beside =
                Delivery::measure(&orders, &ship, "ledger2", &format!("{origin}/v1/consumers/ledger2/inbox"), p)?;
            healthy.push("ledger2");
            let hole_lane = lane(&orders, "void")?;
            // The black hole's subscription moves to the pull feed: its lane ends, and the third
            // healthy consumer is delivered alone, after it.
            orders.call(
                reqwest::Method::PUT,
                "/v1/subscriptions/void",
                Some(json!({"endpoint": "pull:", "from_start": false})),
            )?;
            let again =
                Delivery::measure(&orders, &ship, "ledger3", &format!("{origin}/v1/consumers/ledger3/inbox"), p)?;
            healthy.push("ledger3");
            let alone_mean = (alone.rate(p) + again.rate(p)) / 2.0;
            let ratio = beside.rate(p) / alone_mean;
            Some(json!({
                "healthy_alone": alone.json(p),
                "healthy_beside_the_black_hole": beside.json(p),
                "healthy_alone_again": again.json(p),
                "ratio": round3(ratio),
                "cost": round3(1.0 - ratio),
                "ratio_is": "the rate beside the black hole over the mean of the rates alone before and after it",
                "targets": {"costs_the_healthy_less_than_10_percent": 1.0 - ratio < 0.10},
                "black_hole": {"connections_accepted": hole.accepted(), "subscription": hole_lane},
                "passed": beside.passed(p) && again.passed(p),
                "what": "the same delivery to a second healthy consumer (ledger2), from the start, while the \
                         lane of a subscription to an endpoint that accepts connections and never answers holds a \
                         batch until relay.attempt_timeout_ms, then backs off and tries again",
            }))
        }
        None => None,
    };

    // Nothing pending or quarantined for the healthy subscribers (the black hole keeps its own).
    let mut nothing_left = true;
    for consumer in &healthy {
        nothing_left &= lane(&orders, consumer)?["pending"] == json!(0);
    }
    let quarantined = orders.call(reqwest::Method::GET, "/v1/outbox?status=quarantined&limit=1000", None)?;
    nothing_left &= quarantined["deliveries"]
        .as_array()
        .is_some_and(|all| all.iter().all(|d| !healthy.iter().any(|c| d["consumer_id"] == *c)));
    let passed = alone.passed(p) && nothing_left && black_hole_out.as_ref().is_none_or(|b| b["passed"] == json!(true));

    let transport_config = TransportConfig {
        http_tokens: [(origin.clone(), ship_token.clone())].into_iter().collect(),
        ..TransportConfig::default()
    };
    let raw_endpoint = match p.kind.as_str() {
        "http" => format!("{origin}/v1/consumers/raw/inbox"),
        "nats" => format!("nats://{}/{}raw", p.nats, names.prefix),
        _ => format!("amqp://{}/{}", p.amqp, names.raw_exchange),
    };
    let raw = raw_rate(runtime, &raw_endpoint, &transport_config, p, (&orders_server, &shipping))?;
    drop(black_hole);
    let orders_stop = orders_server.stop()?;
    let shipping_stop = shipping.stop()?;
    let rate = alone.rate(p);
    let raw_rate = raw["events_per_s"].as_f64().unwrap_or(0.0);
    let ratio = if raw_rate > 0.0 { rate / raw_rate } else { 0.0 };
    let mut tidemark = alone.json(p);
    tidemark["cpu_seconds"] = cpu_alone;
    tidemark["what"] = json!(
        "from the subscription (from the start) of an outbox holding every event to the receiving server's apply \
         of the last one: relay, transport, the receiving inbox's commit, its drain"
    );
    let mut out = json!({
        "outcome": "bench",
        "kind": "relay_to",
        "transport": p.kind,
        "durability": durability_word(durability),
        "params": {"events": p.events, "flows": p.flows, "batch": p.batch, "nats": p.nats, "amqp": p.amqp,
                   "black_hole": p.black_hole, "load_average_at_start": load_at_start},
        "tidemark": tidemark,
        "raw_transport": raw,
        "ratio_to_raw": round3(ratio),
        "targets": {"at_least_half_of_the_raw_transport": ratio >= 0.5},
        "stop": {"orders": orders_stop, "shipping": shipping_stop},
        "check": {
            "passed": passed,
            "applied_seqs": alone.applied_seqs,
            "flows": alone.flows_seen,
            "what": "every event applied once on the receiver (the sum of its flows' high-water marks is the \
                     number of events, over every flow), for each healthy consumer; nothing pending or \
                     quarantined for them on the sender",
        },
    });
    if let Some(black_hole) = black_hole_out {
        out["black_hole"] = black_hole;
    }
    Ok(out)
}
