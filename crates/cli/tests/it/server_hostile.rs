//! Hostile clients against a real `tidemark serve` over real TCP: a client that trickles its
//! headers (or sends nothing) is closed after `limits.header_read_timeout_ms`, a request head
//! over `limits.header_bytes_max` is answered 431, and past `limits.connections_max` open
//! connections a new one waits until a slot frees (a busy server closes a connection idle for
//! `limits.busy_header_timeout_ms` to free one, never one being served), and past `limits.connections_per_address_max`
//! a connection from that address is answered 429 and closed; meanwhile other clients are served.
//! Every wait here is a bounded loop; no assertion is about how fast anything is.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::server_support::Server;

/// The longest the test waits for the server to close a connection (far above the timeout).
const CLOSE_WAIT: Duration = Duration::from_secs(30);

fn connect(server: &Server) -> TcpStream {
    let addr = server.base.trim_start_matches("http://");
    let stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    stream
}

/// Whether the server has closed `stream` (a read answers end of file or a reset), reading and
/// dropping whatever it sent first.
fn closed_by_server(stream: &mut TcpStream) -> bool {
    let mut buffer = [0_u8; 4096];
    match stream.read(&mut buffer) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => false,
        Err(_) => true,
    }
}

/// A plain request on a fresh connection answers 200.
fn healthy(server: &Server) -> bool {
    let (status, _) = server.text("/healthz");
    status == 200
}

#[test]
fn a_client_trickling_its_headers_is_closed_after_the_header_timeout_and_others_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(
        &dir.path().join("data"),
        &[],
        &[("TIDEMARK_AUTH__MODE", "none"), ("TIDEMARK_LIMITS__HEADER_READ_TIMEOUT_MS", "1000")],
    );
    let mut slow = connect(&server);
    let mut silent = connect(&server);
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n").unwrap();
    let began = Instant::now();
    let mut slow_closed = false;
    let mut silent_closed = false;
    while began.elapsed() < CLOSE_WAIT && !(slow_closed && silent_closed) {
        // One more header byte every 100 ms, never the end of the head.
        if !slow_closed {
            slow_closed = slow.write_all(b"X").is_err() || closed_by_server(&mut slow);
        }
        if !silent_closed {
            silent_closed = closed_by_server(&mut silent);
        }
        assert!(healthy(&server), "another client is served while the slow ones hang on");
    }
    assert!(slow_closed, "a client trickling its headers was not closed");
    assert!(silent_closed, "a client sending nothing was not closed");
}

#[test]
fn an_oversized_request_head_is_answered_431() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"), &[], &[("TIDEMARK_AUTH__MODE", "none")]);
    let mut stream = connect(&server);
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let huge = "a".repeat(100 * 1024);
    let request = format!("GET /healthz HTTP/1.1\r\nHost: x\r\nX-Huge: {huge}\r\n\r\n");
    // The server may close before it read all of it; what it answered is what counts.
    let _ = stream.write_all(request.as_bytes());
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    assert!(healthy(&server));
}

/// A server of two connection slots, a header timeout of a minute and the busy timeout given.
fn two_slots(data: &std::path::Path, busy_header_timeout_ms: &str) -> Server {
    Server::start(
        data,
        &[],
        &[
            ("TIDEMARK_AUTH__MODE", "none"),
            ("TIDEMARK_LIMITS__CONNECTIONS_MAX", "2"),
            ("TIDEMARK_LIMITS__HEADER_READ_TIMEOUT_MS", "60000"),
            ("TIDEMARK_LIMITS__BUSY_HEADER_TIMEOUT_MS", busy_header_timeout_ms),
        ],
    )
}

/// Everything the server sends on `stream` until it closes it (bounded by `CLOSE_WAIT`).
fn answer_of(stream: &mut TcpStream) -> String {
    stream.set_read_timeout(Some(CLOSE_WAIT)).unwrap();
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    String::from_utf8_lossy(&answer).into_owned()
}

#[test]
fn past_the_connection_limit_a_new_connection_waits_until_a_slot_frees() {
    let dir = tempfile::tempdir().unwrap();
    // A busy server's own closing of idle connections is the next test's.
    let server = two_slots(&dir.path().join("data"), "60000");
    // Two idle connections take both slots (accepted: the server reads from them).
    let mut held: Vec<TcpStream> = (0..2).map(|_| connect(&server)).collect();
    std::thread::sleep(Duration::from_millis(300));
    // A third one's request is not answered while they are open...
    let mut third = connect(&server);
    third.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut buffer = [0_u8; 1024];
    let early = third.read(&mut buffer);
    assert!(
        matches!(&early, Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)),
        "answered past the limit: {early:?}"
    );
    // ...and is, once one of them closes.
    drop(held.pop());
    let answer = answer_of(&mut third);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    drop(held);
}

#[test]
fn a_busy_server_closes_an_idle_connection_for_a_new_one_and_never_one_being_served() {
    let dir = tempfile::tempdir().unwrap();
    let server = two_slots(&dir.path().join("data"), "300");
    // A run due in an hour, whose result a long poll waits for (its request in service).
    let start = serde_json::json!({
        "workflow": "order_saga", "run_id": "later", "start_at_ms": tidemark_engine::now_ms() + 3_600_000,
        "input": {"order_id": "later", "sku": "widget", "quantity": 1, "amount": 100},
    });
    let (status, answer) = server.call("POST", "/v1/runs", None, Some(&start));
    assert_eq!(status, 201, "{answer}");
    let mut polling = connect(&server);
    polling
        .write_all(b"GET /v1/runs/later/result?wait_ms=3000 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    // An idle connection takes the other slot.
    let mut idle = connect(&server);
    std::thread::sleep(Duration::from_millis(200));
    // A new client: the busy server closes the idle connection to serve it...
    let mut third = connect(&server);
    third.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let answer = answer_of(&mut third);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    idle.set_read_timeout(Some(CLOSE_WAIT)).unwrap();
    let mut nothing = Vec::new();
    let closed = idle.read_to_end(&mut nothing);
    assert!(closed.is_ok() && nothing.is_empty(), "the idle connection was closed, sent nothing: {closed:?}");
    // ...and never the long poll, whose request was being served: it gets its answer (202, the
    // run has not ended).
    let answer = answer_of(&mut polling);
    assert!(answer.starts_with("HTTP/1.1 202"), "{answer}");
}

/// A connection from `local` (a loopback address of its own, so that the server sees another
/// client address).
fn connect_from(server: &Server, local: &str) -> TcpStream {
    let remote: std::net::SocketAddr = server.base.trim_start_matches("http://").parse().expect("an address");
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    let local: std::net::SocketAddr = format!("{local}:0").parse().unwrap();
    socket.bind(&local.into()).expect("bind a loopback address");
    socket.connect(&remote.into()).expect("connect");
    let stream: TcpStream = socket.into();
    stream.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    stream
}

/// Read every stream of `flood` without blocking until `closed` of them were closed by the
/// server (bounded by `CLOSE_WAIT`), then half a second more; what each one was sent, and whether
/// it was closed.
fn read_until_closed(flood: &mut [TcpStream], closed: usize) -> Vec<(String, bool)> {
    let mut seen: Vec<(Vec<u8>, bool)> = vec![(Vec::new(), false); flood.len()];
    let began = Instant::now();
    let mut settled_at = None;
    let mut buffer = [0_u8; 4096];
    loop {
        for (stream, (answer, done)) in flood.iter_mut().zip(seen.iter_mut()) {
            stream.set_nonblocking(true).unwrap();
            while !*done {
                match stream.read(&mut buffer) {
                    Ok(0) => *done = true,
                    Ok(n) => answer.extend_from_slice(&buffer[..n]),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(_) => *done = true,
                }
            }
        }
        let count = seen.iter().filter(|(_, done)| *done).count();
        if count >= closed && settled_at.is_none() {
            settled_at = Some(Instant::now());
        }
        let settled = settled_at.is_some_and(|at| at.elapsed() > Duration::from_millis(500));
        if settled || began.elapsed() > CLOSE_WAIT {
            return seen
                .into_iter()
                .map(|(answer, done)| (String::from_utf8_lossy(&answer).into_owned(), done))
                .collect();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A flood of connections from one address: `limits.connections_per_address_max` of them are
/// held open, every other one is answered 429 `rate_limited` and closed at once, and it takes
/// no slot: a client from another address is served meanwhile, and once the flood's connections
/// close, the address is served again.
#[test]
fn past_the_per_address_limit_a_connection_is_answered_429_and_other_addresses_are_served() {
    const FLOOD: usize = 300;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(
        &dir.path().join("data"),
        &[],
        &[
            ("TIDEMARK_AUTH__MODE", "none"),
            ("TIDEMARK_LIMITS__CONNECTIONS_MAX", "16"),
            ("TIDEMARK_LIMITS__CONNECTIONS_PER_ADDRESS_MAX", "4"),
            ("TIDEMARK_LIMITS__HEADER_READ_TIMEOUT_MS", "60000"),
        ],
    );
    let mut flood: Vec<TcpStream> = (0..FLOOD).map(|_| connect_from(&server, "127.0.0.2")).collect();
    let seen = read_until_closed(&mut flood, FLOOD - 4);
    for (answer, _) in seen.iter().filter(|(_, closed)| *closed) {
        assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
        assert!(answer.contains("\"code\":\"rate_limited\""), "{answer}");
    }
    let held: Vec<TcpStream> =
        flood.into_iter().zip(&seen).filter(|(_, (_, closed))| !closed).map(|(s, _)| s).collect();
    assert!(seen.iter().all(|(answer, closed)| *closed || answer.is_empty()), "a held connection was sent something");
    assert_eq!(held.len(), 4, "connections held open of {FLOOD} from one address");
    // Another address is served while the flood holds its four (16 slots in all).
    assert!(healthy(&server), "a client from 127.0.0.1 was not served during the flood");
    // Once they close, the address is served again (the server notices the close: bounded wait).
    drop(held);
    let began = Instant::now();
    loop {
        let mut again = connect_from(&server, "127.0.0.2");
        again.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
        again.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut answer = Vec::new();
        let _ = again.read_to_end(&mut answer);
        let answer = String::from_utf8_lossy(&answer).into_owned();
        if answer.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
        assert!(began.elapsed() < CLOSE_WAIT, "the address's slots were not given back");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A refusal is held `auth.refusal_delay_ms` before it is sent (a token guesser gets about ten
/// answers a second per connection), while other clients are served meanwhile: a wrong token's
/// 401 and an over-rate token's 429 each take at least the delay (a lower bound the server sets,
/// not a measurement), and a valid request sent after a held refusal is answered before it.
#[test]
fn refusals_are_held_for_the_refusal_delay_while_others_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let warm = crate::server_support::token(&data, "acme", "read");
    let good = crate::server_support::token(&data, "acme", "read");
    let config = crate::server_api::write_config(
        dir.path(),
        "[auth]\nrefusal_delay_ms = 2000\nrate_per_second = 1\nburst = 1\n",
    );
    let server = Server::start(&data, &["--config", &config], &[]);
    // The tenant's stores are opened by a first request (of a token of its own: each token has
    // its own bucket), so that the one measured against the held guess is a plain read.
    assert_eq!(server.call("GET", "/v1/runs", Some(&warm), None).0, 200);
    let held = |token: String| {
        let base = server.base.clone();
        std::thread::spawn(move || {
            let began = Instant::now();
            let answer = reqwest::blocking::Client::new()
                .get(format!("{base}/v1/runs"))
                .bearer_auth(token)
                .timeout(CLOSE_WAIT)
                .send()
                .expect("an answer");
            (answer.status().as_u16(), began.elapsed(), Instant::now())
        })
    };
    let guess = held("tmk_0123456789abcdef_not-a-token".into());
    std::thread::sleep(Duration::from_millis(100));
    let (status, _) = server.call("GET", "/v1/runs", Some(&good), None);
    let served_at = Instant::now();
    assert_eq!(status, 200, "a valid token is served while the guess is held");
    // The bucket (1 a second, a burst of 1) is spent by the request above: the next one, sent
    // at once, is refused.
    let over_rate = held(good);
    let (status, took, answered_at) = guess.join().unwrap();
    assert_eq!(status, 401);
    assert!(took >= Duration::from_millis(2000), "the 401 was held the refusal delay: {took:?}");
    assert!(served_at < answered_at, "the valid request was answered first");
    let (status, took, _) = over_rate.join().unwrap();
    assert_eq!(status, 429);
    assert!(took >= Duration::from_millis(2000), "the 429 was held the refusal delay: {took:?}");
}

/// `tidemark bench --hostile --quick`: three servers (the shipped limits, a per-address limit of
/// 4, the shipped per-token rate limit), the first two measured quiet and under 40 slow clients
/// from 4 addresses, the first also under 8 clients flooding it with guessed tokens (every answer
/// 401) and with another tenant's (every answer 200), the third under that neighbor's flood with
/// its rate limit (served at most its bucket and rate). Every measured request and every probe
/// is answered; the shipped limits hold all 40 slow connections, the per-address limit refuses
/// (429) those past 4 per address and so holds fewer sockets. Counts only: the latencies are the
/// benchmark's report, not asserted.
#[test]
fn the_hostile_bench_measures_both_servers_and_the_per_address_limit_refuses_the_excess() {
    let r = crate::support::run(&["bench", "--hostile", "--quick"]);
    r.assert_exit(0);
    let report = &r.json;
    assert_eq!(report["check"]["passed"], true, "{report:#}");
    let [shipped, per_address, rate_limited] = [&report["runs"][0], &report["runs"][1], &report["runs"][2]];
    assert_eq!(shipped["server"], "shipped_limits");
    assert_eq!(per_address["server"], "per_address_limit");
    assert_eq!(per_address["limits"]["connections_per_address_max"], 4);
    assert_eq!(rate_limited["server"], "shipped_rate_limit");
    let plans = [
        (shipped, &["quiet", "slow", "guessing", "neighbor"][..]),
        (per_address, &["quiet", "slow"]),
        (rate_limited, &["quiet", "neighbor"]),
    ];
    for (run, phases) in plans {
        for phase in phases {
            let measured = &run[phase]["measured_clients"];
            assert!(measured["requests"].as_u64().unwrap() > 0, "{phase}: {run:#}");
            assert_eq!(measured["errors"], 0, "{phase}: {run:#}");
            let probes = &run[phase]["probes"];
            assert!(probes["sent"].as_u64().unwrap() > 0, "{phase}: {run:#}");
            assert_eq!(probes["unanswered"], 0, "{phase}: {run:#}");
        }
        assert_eq!(run["stop"]["exit_code"], 0, "{run:#}");
    }
    assert!(per_address["guessing"].is_null(), "{per_address:#}");
    let flood = |phase: &str, status: &str| shipped[phase]["flood"]["answered_in_phase"][status].as_u64().unwrap();
    assert!(flood("guessing", "401") > 0, "{shipped:#}");
    assert_eq!((flood("guessing", "200"), flood("guessing", "other")), (0, 0), "{shipped:#}");
    assert!(flood("neighbor", "200") > 0, "{shipped:#}");
    assert_eq!((flood("neighbor", "401"), flood("neighbor", "other")), (0, 0), "{shipped:#}");
    // With the shipped rate limit (1,000 a second, a burst of 2,000) the neighbor is served at
    // most its bucket and its rate over the phase (a second more for the counts' edges), and
    // refused past it (how many 429s depends on how fast this machine lets it send); the
    // measured clients, paced under their own token's rate, are never refused (errors 0 above).
    let limited = |status: &str| rate_limited["neighbor"]["flood"]["answered_in_phase"][status].as_u64().unwrap();
    let seconds = rate_limited["neighbor"]["seconds"].as_f64().unwrap();
    assert!(limited("200") as f64 <= 2_000.0 + 1_000.0 * (seconds + 1.0), "{rate_limited:#}");
    assert_eq!((limited("401"), limited("other")), (0, 0), "{rate_limited:#}");
    let slow = |run: &serde_json::Value, field: &str| run["slow"]["slow_clients"][field].as_u64().unwrap();
    assert_eq!(slow(shipped, "refused_429_in_phase"), 0, "{shipped:#}");
    assert_eq!(slow(shipped, "open_at_least"), 40, "{shipped:#}");
    assert!(slow(per_address, "refused_429_in_phase") > 0, "{per_address:#}");
    let sockets = |run: &serde_json::Value| run["slow"]["server"]["sockets_max"].as_u64().unwrap();
    assert!(sockets(per_address) < sockets(shipped), "{report:#}");

    // Out of range: a typed error, nothing started.
    for args in
        [["--slow-clients", "20001"], ["--slow-addresses", "0"], ["--flood-clients", "0"], ["--hostile-seconds", "0"]]
    {
        let bad = crate::support::run(&["bench", "--hostile", args[0], args[1]]);
        assert_eq!(bad.code, 2, "{args:?}: {}\n{}", bad.stdout, bad.stderr);
        assert_eq!(bad.json["error"]["code"], "invalid_argument", "{args:?}: {}", bad.stdout);
    }
}
