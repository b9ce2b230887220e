//! `tidemark bench --hostile`: what slow clients cost the others.
//!
//! A real `tidemark serve` runs as a child process (its own data folder, a token of the bench's
//! tenant), twice: with the limits it ships with (`limits.connections_max` 1,024,
//! `limits.header_read_timeout_ms` 10 s, no per-address limit), and with
//! `limits.connections_per_address_max` set. Against each, after a warm-up of [`WARM_UP_S`] not
//! counted, in two phases of `--hostile-seconds`:
//! - **quiet**: the measured clients alone: [`VICTIMS`] closed-loop clients, each on a keep-alive
//!   connection opened before the slow clients connect and busy from then on (counted once the
//!   phase starts), `GET /v1/runs?limit=10` of the bench's tenant, and a
//!   **probe** every [`PROBE_EVERY`]: a new connection (from an address of its own), one request, the time from
//!   its connect to its answer (a new client's wait for a slot included);
//! - **slow**: the same, while `--slow-clients` connections from `--slow-addresses` loopback
//!   addresses (127.0.0.2 upwards) send a request head one byte a second and never finish it. A
//!   connection the server closes (its header timeout) connects again at once; one answered 429
//!   (the per-address limit) connects again after [`REFUSED_PAUSE`].
//!
//! Measured per phase: the measured clients' latency (p50, p99, max), the probes' (and how many
//! got no answer within [`PROBE_TIMEOUT`]), the slow connections the server closed or refused,
//! and the server's open sockets, resident memory (sampled) and CPU time. The ratios that matter
//! are the slow phase's over the quiet one's, measured minutes apart on the same server. No
//! threshold: the check is that every measured request was answered 200 and the server stopped
//! cleanly.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tidemark_core::tenancy::{ControlStore, Scope, TokenText};
use tidemark_core::{Error, Result};
use tidemark_store_sqlite::{Durability, SqliteControl};

use super::serve::{config_toml, percentile_ms, Connection, Server, ServerCommand};
use super::workflows::pid_cpu_seconds;
use super::{failed, round1, round3};

/// The tenant the measured clients' token is bound to.
const TENANT: &str = "bench";
/// Closed-loop measured clients.
const VICTIMS: usize = 4;
/// How often a probe (a new connection and one request) is sent.
const PROBE_EVERY: Duration = Duration::from_millis(250);
/// The address probes connect from: none of the slow clients' (127.0.0.2 upwards), nor the
/// measured clients' (127.0.0.1), so that a per-address limit counts a probe alone.
const PROBE_ADDRESS: Ipv4Addr = Ipv4Addr::new(127, 255, 0, 1);
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

/// What `--hostile` measures.
#[derive(Debug, Clone)]
pub struct Params {
    /// Slow connections held open in the slow phase.
    pub slow: usize,
    /// Loopback addresses they come from.
    pub addresses: usize,
    /// Seconds of each phase.
    pub phase_s: u64,
}

/// `--quick`: a few seconds, small numbers.
pub fn quick(p: &mut Params) {
    p.slow = 40;
    p.addresses = 4;
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

/// When a phase's measured requests start being counted, and when the measured clients stop.
type PhaseTimes = Arc<std::sync::OnceLock<(Instant, Instant)>>;

/// A measured client: requests on its keep-alive connection (opened before the slow clients)
/// until the phase ends, those sent once it started counted.
async fn victim(mut connection: Connection, head: Arc<String>, times: PhaseTimes) -> Measured {
    let mut measured = Measured::default();
    while times.get().is_none_or(|(_, until)| Instant::now() < *until) {
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

/// One phase against `server`: the measured clients and the probes for `seconds`, with
/// `slow` slow clients from `addresses` addresses connected first (none in the quiet phase).
fn phase(
    runtime: &tokio::runtime::Runtime,
    server: &Server,
    head: &Arc<String>,
    slow: usize,
    addresses: usize,
    seconds: u64,
) -> Result<(Value, Measured)> {
    let server_addr: SocketAddr =
        server.addr.parse().map_err(|e| failed(format!("the server's address {:?}: {e}", server.addr)))?;
    let pid = server.pid();
    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new(SlowCounts::default());
    runtime.block_on(async {
        // The measured clients' connections first: they hold their slots as clients already
        // served do.
        // They send requests from now on (a busy server closes a connection that has nothing
        // in service for `limits.busy_header_timeout_ms`), counted once the phase starts.
        let times = PhaseTimes::default();
        let mut victims = Vec::with_capacity(VICTIMS);
        for _ in 0..VICTIMS {
            let connection = Connection::open(&server.addr)
                .await
                .map_err(|e| Error::io(format!("cannot reach the server at {}: {e}", server.addr)))?;
            victims.push(tokio::spawn(victim(connection, head.clone(), times.clone())));
        }
        let slow_tasks: Vec<_> = (0..slow)
            .map(|i| tokio::spawn(slow_client(server_addr, slow_address(i, addresses), counts.clone(), stop.clone())))
            .collect();
        if slow > 0 {
            tokio::time::sleep(SLOW_SETTLE).await;
        }
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
            "server": {
                "cpu_seconds": round3(cpu),
                "sockets_max": footprint.sockets_max,
                "rss_kib_max": footprint.rss_kib_max,
            },
        });
        Ok((out, measured))
    })
}

/// The server's configuration: the shipped limits, or `connections_per_address_max` set.
fn limits_toml(per_address_max: usize) -> String {
    if per_address_max == 0 {
        String::new()
    } else {
        format!("\n[limits]\nconnections_per_address_max = {per_address_max}\n")
    }
}

/// Both phases against a fresh server of `name` with `per_address_max` (0: off).
fn against(
    dir: &Path,
    name: &str,
    per_address_max: usize,
    durability: Durability,
    p: &Params,
    command: &ServerCommand,
) -> Result<Value> {
    let dir = dir.join(name);
    let data = dir.join("data");
    std::fs::create_dir_all(&data).map_err(|e| Error::io(format!("{}: {e}", data.display())))?;
    let config = dir.join("serve.toml");
    let toml = config_toml(&data, durability, 8, None) + &limits_toml(per_address_max);
    std::fs::write(&config, toml).map_err(|e| Error::io(format!("{}: {e}", config.display())))?;
    let token = TokenText::from_random(rand::random(), rand::random());
    SqliteControl::open(&data.join(tidemark_server::CONTROL_FILE), true, durability)?.create_token(
        &token,
        TENANT,
        Scope::Read,
        "bench --hostile",
        tidemark_engine::now_ms(),
    )?;
    let server = Server::start(command, &config, &dir.join("server.log"))?;
    let head = Arc::new(format!(
        "GET /v1/runs?limit=10 HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {}\r\n",
        server.addr,
        token.text()
    ));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::io(format!("cannot start the async runtime: {e}")))?;
    phase(&runtime, &server, &head, 0, 1, WARM_UP_S)?;
    let (quiet, quiet_measured) = phase(&runtime, &server, &head, 0, 1, p.phase_s)?;
    let (slow, slow_measured) = phase(&runtime, &server, &head, p.slow, p.addresses, p.phase_s)?;
    drop(runtime);
    let stopped = server.stop()?;
    let ratio = |slow: &[u32], quiet: &[u32], q: f64| {
        let (mut s, mut q0) = (slow.to_vec(), quiet.to_vec());
        s.sort_unstable();
        q0.sort_unstable();
        round3(percentile_ms(&s, q) / percentile_ms(&q0, q).max(1e-6))
    };
    let shipped = tidemark_server::config::LimitsConfig::default();
    let passed = quiet_measured.errors == 0
        && slow_measured.errors == 0
        && !quiet_measured.latencies_us.is_empty()
        && !slow_measured.latencies_us.is_empty()
        && stopped["exit_code"] == 0;
    Ok(json!({
        "server": name,
        "limits": {
            "connections_max": shipped.connections_max,
            "header_read_timeout_ms": shipped.header_read_timeout_ms,
            "connections_per_address_max": per_address_max,
        },
        "quiet": quiet,
        "slow": slow,
        "slow_over_quiet": {
            "measured_p50": ratio(&slow_measured.latencies_us, &quiet_measured.latencies_us, 0.50),
            "measured_p99": ratio(&slow_measured.latencies_us, &quiet_measured.latencies_us, 0.99),
            "probe_p50": ratio(&slow_measured.probe_latencies_us, &quiet_measured.probe_latencies_us, 0.50),
            "probe_p99": ratio(&slow_measured.probe_latencies_us, &quiet_measured.probe_latencies_us, 0.99),
        },
        "stop": stopped,
        "passed": passed,
    }))
}

/// Measure both servers (see the module's documentation).
pub fn run(dir: &Path, durability: Durability, p: &Params, command: &ServerCommand) -> Result<Value> {
    let shipped = against(dir, "shipped_limits", 0, durability, p, command)?;
    let per_address = against(dir, "per_address_limit", PER_ADDRESS_MAX, durability, p, command)?;
    let passed = shipped["passed"] == true && per_address["passed"] == true;
    Ok(json!({
        "bench": "hostile",
        "params": {
            "slow_clients": p.slow,
            "slow_addresses": p.addresses,
            "phase_seconds": p.phase_s,
            "measured_clients": VICTIMS,
            "probe_every_ms": PROBE_EVERY.as_millis() as u64,
            "request": "GET /v1/runs?limit=10",
        },
        "runs": [shipped, per_address],
        "check": {"passed": passed},
    }))
}
