//! Hostile clients against a real `tidemark serve` over real TCP: a client that trickles its
//! headers (or sends nothing) is closed after `limits.header_read_timeout_ms`, a request head
//! over `limits.header_bytes_max` is answered 431, and past `limits.connections_max` open
//! connections a new one waits until a slot frees; meanwhile other clients are served. Every wait
//! here is a bounded loop; no assertion is about how fast anything is.

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

#[test]
fn past_the_connection_limit_a_new_connection_waits_until_a_slot_frees() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(
        &dir.path().join("data"),
        &[],
        &[
            ("TIDEMARK_AUTH__MODE", "none"),
            ("TIDEMARK_LIMITS__CONNECTIONS_MAX", "2"),
            ("TIDEMARK_LIMITS__HEADER_READ_TIMEOUT_MS", "60000"),
        ],
    );
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
    third.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut answer = Vec::new();
    let _ = third.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    drop(held);
}
