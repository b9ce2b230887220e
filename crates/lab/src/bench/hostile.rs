//! `tidemark bench --hostile`: what slow and flooding clients cost the others.
//!
//! A real `tidemark serve` runs as a child process (its own data folder, a token of the bench's
//! tenant and one of a neighbor tenant), three times ([`PLANS`]): with the limits it ships with
//! (`limits.connections_max` 1,024, `limits.header_read_timeout_ms` 10 s, no per-address limit)
//! but the per-token rate limit out of the way (`auth.rate_per_second` 1,000,000, as every
//! serving bench, so that closed-loop measured clients are never refused); with
//! `limits.connections_per_address_max` set; and with the shipped rate limit (1,000 a second, a
//! burst of 2,000) and measured clients paced under it ([`PACE`]). Against each, after a warm-up
//! of [`WARM_UP_S`] not counted, phases of `--hostile-seconds`:
//! - **quiet**: the measured clients alone: [`VICTIMS`] clients, each on a keep-alive
//!   connection opened before the loaded phase's clients connect and busy from then on (counted
//!   once the phase starts), `GET /v1/runs?limit=10` of the bench's tenant, and a
//!   **probe** every [`PROBE_EVERY`]: a new connection (from an address of its own), one request, the time from
//!   its connect to its answer (a new client's wait for a slot included);
//! - **slow** (the first two servers): the same, while `--slow-clients` connections from
//!   `--slow-addresses` loopback addresses (127.0.0.2 upwards) send a request head one byte a
//!   second and never finish it. A connection the server closes (its header timeout) connects
//!   again at once; one answered 429 (the per-address limit) connects again after
//!   [`REFUSED_PAUSE`];
//! - **guessing** (the first server) and **neighbor** (the first and the third): the same, while
//!   `--flood-clients` closed-loop clients from `--slow-addresses` addresses (on a thread of
//!   their own) send complete requests as fast as they are answered, each on a keep-alive
//!   connection (opened again when the server closes it): with a new well-formed token of no
//!   tenant each time (a token guesser: every answer 401, held `auth.refusal_delay_ms`), or with
//!   the neighbor tenant's valid token (served every request on the first server, the worst
//!   case; answered 429 past its bucket on the third).
//!
//! Measured per phase: the measured clients' latency (p50, p99, max), the probes' (and how many
//! got no answer within [`PROBE_TIMEOUT`]), the slow connections the server closed or refused,
//! the flood's answers by status, and the server's open sockets, resident memory (sampled) and
//! CPU time. The ratios that matter are each loaded phase's over the quiet one's, measured
//! minutes apart on the same server. No threshold: the check is that every measured request was
//! answered 200 and the server stopped cleanly.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tidemark_core::tenancy::{ControlStore, Scope, TokenText};
use tidemark_core::{Error, Result};
use tidemark_store_sqlite::{Durability, SqliteControl};

use super::serve::{config_toml, percentile_ms, Connection, Server, ServerCommand, UNLIMITED_AUTH};
use super::workflows::pid_cpu_seconds;
use super::{failed, round1, round3};

/// The tenant the measured clients' token is bound to.
const TENANT: &str = "bench";
/// Closed-loop measured clients.
const VICTIMS: usize = 4;
/// How often a probe (a new connection and one request) is sent.
const PROBE_EVERY: Duration = Duration::from_millis(250);
/// The address probes connect from: none of the slow clients' (127.0.0.2 upwards), nor the
/// measured clients' ([`victims_address`]), so that a per-address limit counts a probe alone.
const PROBE_ADDRESS: Ipv4Addr = Ipv4Addr::new(127, 255, 0, 1);

/// The address the measured clients of a server's phase `index` (0: the warm-up) connect from:
/// one of their own per phase (127.0.1.1 upwards), so that a per-address limit never counts the
/// previous phase's connections, which the server may not have seen closed yet when the next
/// phase's open (a loaded machine's race: the new ones were refused 429 and closed).
fn victims_address(index: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 1, 1 + (index % 250) as u8)
}
/// How long a probe waits for its answer (connect included) before it counts as unanswered.
const PROBE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a measured request may take before it counts as an error.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a slow client waits for its connect (the listen backlog may be full).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// A slow client's pause between two bytes of its head.
const TRICKLE_EVERY: Duration = Duration::from_secs(1);
/// A slow client answered 429 connects again after this pause.
const REFUSED_PAUSE: Duration = Duration::from_secs(1);
/// How long the slow clients get to connect before the slow phase is measured.
const SLOW_SETTLE: Duration = Duration::from_secs(3);
/// How often the server's sockets and memory are sampled.
const SAMPLE_EVERY: Duration = Duration::from_millis(500);
/// Seconds of measured requests before the quiet phase, not counted (a fresh server's first
/// requests are slower: page cache, allocator, connection pools).
const WARM_UP_S: u64 = 2;
/// The per-address limit of the second server.
const PER_ADDRESS_MAX: usize = 4;
/// The tenant of the noisy neighbor's token.
const NEIGHBOR: &str = "neighbor";
/// The pause between a measured client's requests against the shipped rate limit: four clients
/// at under 200 a second each stay under their token's 1,000 a second.
const PACE: Duration = Duration::from_millis(5);

/// What `--hostile` measures.
#[derive(Debug, Clone)]
pub struct Params {
    /// Slow connections held open in the slow phase.
    pub slow: usize,
    /// Loopback addresses they (and the flood clients) come from.
    pub addresses: usize,
    /// Closed-loop clients of the guessing and neighbor phases.
    pub flood: usize,
    /// Seconds of each phase.
    pub phase_s: u64,
}

/// `--quick`: a few seconds, small numbers.
pub fn quick(p: &mut Params) {
    p.slow = 40;
    p.addresses = 4;
    p.flood = 8;
    p.phase_s = 2;
}

/// The measured side of a phase.
#[derive(Default)]
struct Measured {
    latencies_us: Vec<u32>,
    errors: u64,
    last_error: Option<String>,
    probes: u64,
    probe_latencies_us: Vec<u32>,
    probes_unanswered: u64,
}

/// What the slow clients saw, counted across their tasks.
#[derive(Default)]
struct SlowCounts {
    connected: AtomicU64,
    connect_errors: AtomicU64,
    closed_by_server: AtomicU64,
    refused_429: AtomicU64,
    open: AtomicU64,
}

/// What the flood clients were answered, counted across their tasks.
#[derive(Default)]
struct FloodCounts {
    ok_200: AtomicU64,
    unauthenticated_401: AtomicU64,
    rate_limited_429: AtomicU64,
    other: AtomicU64,
    reconnects: AtomicU64,
}

impl FloodCounts {
    /// 200s, 401s, 429s, other answers, reconnects.
    fn snapshot(&self) -> [u64; 5] {
        [&self.ok_200, &self.unauthenticated_401, &self.rate_limited_429, &self.other, &self.reconnects]
            .map(|c| c.load(Ordering::Relaxed))
    }
}

/// What loads the server besides the measured clients in a phase.
enum Load {
    Quiet,
    /// `clients` slow clients from `addresses` addresses.
    Slow {
        clients: usize,
        addresses: usize,
    },
    /// `clients` flood clients from `addresses` addresses, each request with a token of no
    /// tenant (`neighbor` None) or with this head's valid token of another tenant.
    Flood {
        clients: usize,
        addresses: usize,
        neighbor: Option<Arc<String>>,
    },
}

/// The server process's open sockets and resident memory, sampled.
#[derive(Default, Clone, Copy)]
struct Footprint {
    sockets_max: u64,
    rss_kib_max: u64,
}

fn sample_footprint(pid: u32, footprint: &mut Footprint) {
    let sockets = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|fds| {
            fds.flatten()
                .filter(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| l.to_string_lossy().starts_with("socket:")))
                .count() as u64
        })
        .unwrap_or(0);
    let rss = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:").and_then(|v| v.trim().trim_end_matches(" kB").parse().ok()))
        })
        .unwrap_or(0);
    footprint.sockets_max = footprint.sockets_max.max(sockets);
    footprint.rss_kib_max = footprint.rss_kib_max.max(rss);
}

/// The loopback address of slow client `index` (127.0.0.2 upwards, `addresses` of them).
fn slow_address(index: usize, addresses: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(127, 0, 0, 2)) + (index % addresses) as u32)
}

/// One slow client: connects from `from`, sends a request head one byte a second and never
/// finishes it; connects again when the server closes it (at once) or refuses it (after a
/// pause), until `stop`.
async fn slow_client(server: SocketAddr, from: Ipv4Addr, counts: Arc<SlowCounts>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        let connected = async {
            let socket = tokio::net::TcpSocket::new_v4()?;
            socket.bind(SocketAddr::new(from.into(), 0))?;
            tokio::time::timeout(CONNECT_TIMEOUT, socket.connect(server))
                .await
                .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"))?
        }
        .await;
        let stream = match connected {
            Ok(stream) => stream,
            Err(_) => {
                counts.connect_errors.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(REFUSED_PAUSE).await;
                continue;
            }
        };
        counts.connected.fetch_add(1, Ordering::Relaxed);
        counts.open.fetch_add(1, Ordering::Relaxed);
        let head = b"GET /v1/runs HTTP/1.1\r\nHost: bench\r\nX-Slow: ";
        let mut sent = stream.try_write(head).is_ok();
        let mut refused = false;
        while sent && !stop.load(Ordering::Relaxed) {
            tokio::time::sleep(TRICKLE_EVERY).await;
            let mut answer = [0_u8; 64];
            match stream.try_read(&mut answer) {
                Ok(0) => break,
                Ok(n) => {
                    refused = answer[..n].starts_with(b"HTTP/1.1 429");
                    break;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => break,
            }
            sent = stream.try_write(b"a").is_ok();
        }
        counts.open.fetch_sub(1, Ordering::Relaxed);
        if stop.load(Ordering::Relaxed) {
            break;
        }
        if refused {
            counts.refused_429.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(REFUSED_PAUSE).await;
        } else {
            counts.closed_by_server.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The head of every request the bench sends (`GET /v1/runs?limit=10`) with `token`.
fn request_head(server: &str, token: &TokenText) -> String {
    format!("GET /v1/runs?limit=10 HTTP/1.1\r\nHost: {server}\r\nAuthorization: Bearer {}\r\n", token.text())
}

/// One flood client: from `from`, complete requests on a keep-alive connection, each sent as soon
/// as the one before is answered, until `stop`: with `head` (a valid token), or a new well-formed
/// token of no tenant each time. Opens a new connection when the server closes its own.
async fn flood_client(
    server: String,
    from: Ipv4Addr,
    head: Option<Arc<String>>,
    counts: Arc<FloodCounts>,
    stop: Arc<AtomicBool>,
) {
    let mut connection = None;
    while !stop.load(Ordering::Relaxed) {
        let Some(open) = connection.as_mut() else {
            match tokio::time::timeout(CONNECT_TIMEOUT, Connection::open_from(&server, from.into())).await {
                Ok(Ok(opened)) => connection = Some(opened),
                _ => tokio::time::sleep(REFUSED_PAUSE).await,
            }
            continue;
        };
        let guess;
        let head = match &head {
            Some(head) => head.as_str(),
            None => {
                guess = request_head(&server, &TokenText::from_random(rand::random(), rand::random()));
                &guess
            }
        };
        let counter = match tokio::time::timeout(REQUEST_TIMEOUT, open.request(head, b"")).await {
            Ok(Ok((200, _))) => &counts.ok_200,
            Ok(Ok((401, _))) => &counts.unauthenticated_401,
            Ok(Ok((429, _))) => &counts.rate_limited_429,
            Ok(Ok(_)) => &counts.other,
            _ => {
                connection = None;
                &counts.reconnects
            }
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// When a phase's measured requests start being counted, and when the measured clients stop.
type PhaseTimes = Arc<std::sync::OnceLock<(Instant, Instant)>>;

/// A measured client: requests on its keep-alive connection (opened before the slow clients)
/// until the phase ends, those sent once it started counted.
async fn victim(mut connection: Connection, head: Arc<String>, pace: Option<Duration>, times: PhaseTimes) -> Measured {
    let mut measured = Measured::default();
    while times.get().is_none_or(|(_, until)| Instant::now() < *until) {
        if let Some(pause) = pace {
            tokio::time::sleep(pause).await;
        }
        let t = Instant::now();
        let counted = times.get().is_some_and(|(from, _)| t >= *from);
        match tokio::time::timeout(REQUEST_TIMEOUT, connection.request(&head, b"")).await {
            Ok(Ok((200, _))) if !counted => {}
            Ok(Ok((200, _))) => measured.latencies_us.push(t.elapsed().as_micros().min(u32::MAX as u128) as u32),
            Ok(Ok((status, body))) => {
                measured.errors += 1;
                measured.last_error = Some(format!("{status}: {}", String::from_utf8_lossy(&body)));
            }
            Ok(Err(e)) => {
                measured.errors += 1;
                measured.last_error = Some(e.to_string());
                return measured;
            }
            Err(_) => {
                measured.errors += 1;
                measured.last_error = Some(format!("no answer within {REQUEST_TIMEOUT:?}"));
                return measured;
            }
        }
    }
    measured
}

/// A probe: a new connection from [`PROBE_ADDRESS`] and one request; the time from its connect
/// to its answer, or `None` without an answer within [`PROBE_TIMEOUT`].
async fn probe(addr: String, head: Arc<String>) -> Option<u32> {
    let t = Instant::now();
    let answered = tokio::time::timeout(PROBE_TIMEOUT, async {
        let mut connection = Connection::open_from(&addr, PROBE_ADDRESS.into()).await?;
        connection.request(&head, b"").await
    })
    .await;
    match answered {
        Ok(Ok((200, _))) => Some(t.elapsed().as_micros().min(u32::MAX as u128) as u32),
        _ => None,
    }
}

fn latency_json(sorted_us: &mut [u32]) -> Value {
    sorted_us.sort_unstable();
    json!({
        "count": sorted_us.len(),
        "p50_ms": percentile_ms(sorted_us, 0.50),
        "p99_ms": percentile_ms(sorted_us, 0.99),
        "max_ms": percentile_ms(sorted_us, 1.0),
    })
}

/// One phase against `server`: the measured clients and the probes for `seconds`, with the
/// slow or flood clients of `load` started first.
fn phase(
    runtime: &tokio::runtime::Runtime,
    server: &Server,
    head: &Arc<String>,
    (pace, victims_from): (Option<Duration>, Ipv4Addr),
    load: &Load,
    seconds: u64,
) -> Result<(Value, Measured)> {
    let (slow, addresses) = match load {
        Load::Slow { clients, addresses } => (*clients, *addresses),
        _ => (0, 1),
    };
    let server_addr: SocketAddr =
        server.addr.parse().map_err(|e| failed(format!("the server's address {:?}: {e}", server.addr)))?;
    let pid = server.pid();
    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new(SlowCounts::default());
    let flood_counts = Arc::new(FloodCounts::default());
    // The flood clients on a thread and a runtime of their own, so that the measured clients'
    // requests never wait behind theirs in this process, only in the server.
    let flood_thread = match load {
        Load::Flood { clients, addresses, neighbor } => {
            let (clients, addresses, neighbor) = (*clients, *addresses, neighbor.clone());
            let (addr, counts, stop) = (server.addr.clone(), flood_counts.clone(), stop.clone());
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| Error::io(format!("cannot start the flood's runtime: {e}")))?;
            Some(std::thread::spawn(move || {
                runtime.block_on(async {
                    let tasks: Vec<_> = (0..clients)
                        .map(|i| {
                            let from = slow_address(i, addresses);
                            tokio::spawn(flood_client(
                                addr.clone(),
                                from,
                                neighbor.clone(),
                                counts.clone(),
                                stop.clone(),
                            ))
                        })
                        .collect();
                    for task in tasks {
                        let _ = task.await;
                    }
                })
            }))
        }
        _ => None,
    };
    let measured = runtime.block_on(async {
        // The measured clients' connections first: they hold their slots as clients already
        // served do.
        // They send requests from now on (a busy server closes a connection that has nothing
        // in service for `limits.busy_header_timeout_ms`), counted once the phase starts.
        let times = PhaseTimes::default();
        let mut victims = Vec::with_capacity(VICTIMS);
        for _ in 0..VICTIMS {
            let connection = Connection::open_from(&server.addr, victims_from.into())
                .await
                .map_err(|e| Error::io(format!("cannot reach the server at {}: {e}", server.addr)))?;
            victims.push(tokio::spawn(victim(connection, head.clone(), pace, times.clone())));
        }
        let slow_tasks: Vec<_> = (0..slow)
            .map(|i| tokio::spawn(slow_client(server_addr, slow_address(i, addresses), counts.clone(), stop.clone())))
            .collect();
        if !matches!(load, Load::Quiet) {
            tokio::time::sleep(SLOW_SETTLE).await;
        }
        let flood_before: [u64; 5] = flood_counts.snapshot();
        let mut footprint = Footprint::default();
        sample_footprint(pid, &mut footprint);
        let cpu_before = pid_cpu_seconds(&pid.to_string()).unwrap_or(0.0);
        let closed_before = counts.closed_by_server.load(Ordering::Relaxed);
        let refused_before = counts.refused_429.load(Ordering::Relaxed);
        let started = Instant::now();
        let until = started + Duration::from_secs(seconds);
        let _ = times.set((started, until));
        let mut probes = Vec::new();
        let mut open_min = u64::MAX;
        let mut next_probe = Instant::now();
        let mut next_sample = Instant::now();
        while Instant::now() < until {
            let now = Instant::now();
            if now >= next_probe {
                probes.push(tokio::spawn(probe(server.addr.clone(), head.clone())));
                next_probe += PROBE_EVERY;
            }
            if now >= next_sample {
                sample_footprint(pid, &mut footprint);
                open_min = open_min.min(counts.open.load(Ordering::Relaxed));
                next_sample += SAMPLE_EVERY;
            }
            tokio::time::sleep(next_probe.min(next_sample).saturating_duration_since(Instant::now())).await;
        }
        let mut measured = Measured::default();
        for task in victims {
            let one = task.await.map_err(|e| Error::Invariant(format!("a measured client panicked: {e}")))?;
            measured.latencies_us.extend(one.latencies_us);
            measured.errors += one.errors;
            measured.last_error = one.last_error.or(measured.last_error.take());
        }
        let wall = started.elapsed().as_secs_f64();
        let cpu = pid_cpu_seconds(&pid.to_string()).unwrap_or(0.0) - cpu_before;
        let closed = counts.closed_by_server.load(Ordering::Relaxed) - closed_before;
        let refused = counts.refused_429.load(Ordering::Relaxed) - refused_before;
        let flood_after = flood_counts.snapshot();
        let flooded: Vec<u64> = flood_after.iter().zip(flood_before).map(|(after, before)| after - before).collect();
        // The probes sent before the end are awaited (each bounded by its timeout).
        for task in probes {
            measured.probes += 1;
            match task.await.map_err(|e| Error::Invariant(format!("a probe panicked: {e}")))? {
                Some(us) => measured.probe_latencies_us.push(us),
                None => measured.probes_unanswered += 1,
            }
        }
        stop.store(true, Ordering::Relaxed);
        for task in slow_tasks {
            task.abort();
        }
        let requests = measured.latencies_us.len() as f64;
        let out = json!({
            "seconds": round3(wall),
            "measured_clients": {
                "requests": measured.latencies_us.len(),
                "requests_per_second": round1(requests / wall.max(1e-9)),
                "errors": measured.errors,
                "last_error": measured.last_error,
                "latency": latency_json(&mut measured.latencies_us.clone()),
            },
            "probes": {
                "sent": measured.probes,
                "unanswered_within_ms": PROBE_TIMEOUT.as_millis() as u64,
                "unanswered": measured.probes_unanswered,
                "connect_to_answer": latency_json(&mut measured.probe_latencies_us.clone()),
            },
            "slow_clients": {
                "clients": slow,
                "addresses": if slow > 0 { addresses } else { 0 },
                "connections_made": counts.connected.load(Ordering::Relaxed),
                "open_at_least": if slow > 0 { open_min } else { 0 },
                "closed_by_server_in_phase": closed,
                "refused_429_in_phase": refused,
                "connect_errors": counts.connect_errors.load(Ordering::Relaxed),
            },
            "flood": match load {
                Load::Flood { clients, addresses, neighbor } => json!({
                    "clients": clients,
                    "addresses": addresses,
                    "token": if neighbor.is_some() { "another tenant's" } else { "a new guess each request" },
                    "answered_in_phase": {
                        "200": flooded[0], "401": flooded[1], "429": flooded[2], "other": flooded[3],
                    },
                    "answered_per_second": round1((flooded[0] + flooded[1] + flooded[2] + flooded[3]) as f64 / wall.max(1e-9)),
                    "reconnects_in_phase": flooded[4],
                }),
                _ => Value::Null,
            },
            "server": {
                "cpu_seconds": round3(cpu),
                "sockets_max": footprint.sockets_max,
                "rss_kib_max": footprint.rss_kib_max,
            },
        });
        Ok((out, measured))
    });
    // Told to stop (or the phase failed: stop it here), the flood's clients end within a request.
    stop.store(true, Ordering::Relaxed);
    if let Some(thread) = flood_thread {
        thread.join().map_err(|_| Error::Invariant("the flood's thread panicked".into()))?;
    }
    measured
}

/// The server's configuration: the shipped limits, or `connections_per_address_max` set.
fn limits_toml(per_address_max: usize) -> String {
    if per_address_max == 0 {
        String::new()
    } else {
        format!("\n[limits]\nconnections_per_address_max = {per_address_max}\n")
    }
}

/// A loaded phase of a server's plan.
#[derive(Clone, Copy, PartialEq)]
enum Phase {
    Slow,
    Guessing,
    Neighbor,
}

/// One server the bench starts, and what it measures against it.
struct Plan {
    name: &'static str,
    /// `limits.connections_per_address_max` (0: off).
    per_address_max: usize,
    /// The shipped per-token rate limit (`auth.rate_per_second` 1,000, `auth.burst` 2,000)
    /// instead of the bench's 1,000,000 a second.
    shipped_rate_limit: bool,
    /// A pause between a measured client's requests (keeping the four under the shipped rate
    /// limit of their token), or none (closed loop).
    pace: Option<Duration>,
    /// The loaded phases after the quiet one.
    phases: &'static [Phase],
}

/// The servers: the shipped limits (the bench's rate limit out of the way) under slow clients
/// and floods, the per-address limit under slow clients, and the shipped rate limit under a
/// neighbor's flood with paced measured clients.
const PLANS: [Plan; 3] = [
    Plan {
        name: "shipped_limits",
        per_address_max: 0,
        shipped_rate_limit: false,
        pace: None,
        phases: &[Phase::Slow, Phase::Guessing, Phase::Neighbor],
    },
    Plan {
        name: "per_address_limit",
        per_address_max: PER_ADDRESS_MAX,
        shipped_rate_limit: false,
        pace: None,
        phases: &[Phase::Slow],
    },
    Plan {
        name: "shipped_rate_limit",
        per_address_max: 0,
        shipped_rate_limit: true,
        pace: Some(PACE),
        phases: &[Phase::Neighbor],
    },
];

/// The quiet phase and `plan`'s loaded phases against a fresh server.
fn against(dir: &Path, plan: &Plan, durability: Durability, p: &Params, command: &ServerCommand) -> Result<Value> {
    let name = plan.name;
    let dir = dir.join(name);
    let data = dir.join("data");
    std::fs::create_dir_all(&data).map_err(|e| Error::io(format!("{}: {e}", data.display())))?;
    let config = dir.join("serve.toml");
    let mut toml = config_toml(&data, durability, 8, None) + &limits_toml(plan.per_address_max);
    if plan.shipped_rate_limit {
        toml = toml.replace(UNLIMITED_AUTH, "");
    }
    std::fs::write(&config, toml).map_err(|e| Error::io(format!("{}: {e}", config.display())))?;
    let token = TokenText::from_random(rand::random(), rand::random());
    let neighbor_token = TokenText::from_random(rand::random(), rand::random());
    let mut control = SqliteControl::open(&data.join(tidemark_server::CONTROL_FILE), true, durability)?;
    for (token, tenant) in [(&token, TENANT), (&neighbor_token, NEIGHBOR)] {
        control.create_token(token, tenant, Scope::Read, "bench --hostile", tidemark_engine::now_ms())?;
    }
    drop(control);
    let server = Server::start(command, &config, &dir.join("server.log"))?;
    let head = Arc::new(request_head(&server.addr, &token));
    let neighbor_head = Arc::new(request_head(&server.addr, &neighbor_token));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::io(format!("cannot start the async runtime: {e}")))?;
    let loads = plan.phases.iter().map(|phase| match phase {
        Phase::Slow => ("slow", Load::Slow { clients: p.slow, addresses: p.addresses }),
        Phase::Guessing => ("guessing", Load::Flood { clients: p.flood, addresses: p.addresses, neighbor: None }),
        Phase::Neighbor => {
            let neighbor = Some(neighbor_head.clone());
            ("neighbor", Load::Flood { clients: p.flood, addresses: p.addresses, neighbor })
        }
    });
    let pace = plan.pace;
    phase(&runtime, &server, &head, (pace, victims_address(0)), &Load::Quiet, WARM_UP_S)?;
    let (quiet, quiet_measured) = phase(&runtime, &server, &head, (pace, victims_address(1)), &Load::Quiet, p.phase_s)?;
    let mut out = json!({"server": name, "quiet": quiet});
    let mut passed = quiet_measured.errors == 0 && !quiet_measured.latencies_us.is_empty();
    let ratio = |loaded: &[u32], quiet: &[u32], q: f64| {
        let (mut l, mut q0) = (loaded.to_vec(), quiet.to_vec());
        l.sort_unstable();
        q0.sort_unstable();
        round3(percentile_ms(&l, q) / percentile_ms(&q0, q).max(1e-6))
    };
    for (index, (name, load)) in loads.enumerate() {
        let from = victims_address(2 + index);
        let (report, measured) = phase(&runtime, &server, &head, (pace, from), &load, p.phase_s)?;
        passed &= measured.errors == 0 && !measured.latencies_us.is_empty();
        out[name] = report;
        out[format!("{name}_over_quiet")] = json!({
            "measured_p50": ratio(&measured.latencies_us, &quiet_measured.latencies_us, 0.50),
            "measured_p99": ratio(&measured.latencies_us, &quiet_measured.latencies_us, 0.99),
            "probe_p50": ratio(&measured.probe_latencies_us, &quiet_measured.probe_latencies_us, 0.50),
            "probe_p99": ratio(&measured.probe_latencies_us, &quiet_measured.probe_latencies_us, 0.99),
        });
    }
    drop(runtime);
    let stopped = server.stop()?;
    let shipped = tidemark_server::config::Config::default();
    out["limits"] = json!({
        "connections_max": shipped.limits.connections_max,
        "header_read_timeout_ms": shipped.limits.header_read_timeout_ms,
        "connections_per_address_max": plan.per_address_max,
        "auth_rate_per_second": if plan.shipped_rate_limit { json!(shipped.auth.rate_per_second) } else { json!(1_000_000) },
        "auth_burst": if plan.shipped_rate_limit { json!(shipped.auth.burst) } else { json!(10_000_000) },
        "auth_refusal_delay_ms": shipped.auth.refusal_delay_ms,
    });
    out["measured_clients_pause_ms"] = json!(pace.map(|d| d.as_millis() as u64));
    out["passed"] = json!(passed && stopped["exit_code"] == 0);
    out["stop"] = stopped;
    Ok(out)
}

/// Measure both servers (see the module's documentation).
pub fn run(dir: &Path, durability: Durability, p: &Params, command: &ServerCommand) -> Result<Value> {
    let runs = PLANS.iter().map(|plan| against(dir, plan, durability, p, command)).collect::<Result<Vec<_>>>()?;
    let passed = runs.iter().all(|run| run["passed"] == true);
    Ok(json!({
        "bench": "hostile",
        "params": {
            "slow_clients": p.slow,
            "slow_addresses": p.addresses,
            "flood_clients": p.flood,
            "phase_seconds": p.phase_s,
            "measured_clients": VICTIMS,
            "probe_every_ms": PROBE_EVERY.as_millis() as u64,
            "request": "GET /v1/runs?limit=10",
        },
        "runs": runs,
        "check": {"passed": passed},
    }))
}
