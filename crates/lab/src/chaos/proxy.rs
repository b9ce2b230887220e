//! The link a partition fails: a TCP proxy on loopback between the servers' relays and the
//! remote consumer's server (or the broker they publish to), switched at run time between passing
//! traffic, cutting it, swallowing it (a black hole) and passing requests while losing the answers
//! (one way). Every switch closes the connections that were open, so a pooled connection never
//! outlives the mode it was opened under, except a switch from passing to losing answers: the
//! connections open then stay, their requests still pass, and the first answer read on one is
//! thrown away with the connection (a long-lived broker connection publishes, the broker stores,
//! the acknowledgement never arrives; a connection opened while answers are lost loses the
//! broker's greeting and is closed at once). Plain threads and blocking sockets; every loop ends
//! when the proxy is dropped.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tidemark_core::{Error, Result};

/// How long a blocked read or accept waits before it looks at the mode and the stop flag.
const POLL: Duration = Duration::from_millis(50);

/// What the link does now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    /// Traffic passes both ways.
    Pass,
    /// Connections are closed at once.
    Cut,
    /// Connections are accepted; nothing is forwarded and nothing comes back.
    BlackHole,
    /// Requests reach the remote server; its answers are thrown away.
    LoseAnswers,
}

struct State {
    link: Mutex<(Link, u64)>,
    target: Mutex<Option<String>>,
    stop: AtomicBool,
    connections: AtomicU64,
    answers_lost: AtomicU64,
}

impl State {
    fn now(&self) -> (Link, u64) {
        *self.link.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// True while connection `epoch` may go on (no switch since it opened, not stopping).
    fn alive(&self, epoch: u64) -> bool {
        !self.stop.load(Ordering::Relaxed) && self.now().1 == epoch
    }
}

/// The proxy: its address, its link and its counters.
pub struct Proxy {
    addr: String,
    state: Arc<State>,
    accept: Option<std::thread::JoinHandle<()>>,
}

impl Proxy {
    /// A proxy on `127.0.0.1:<free port>` whose link passes traffic; connections are closed until
    /// [`Proxy::set_target`] names where they go.
    pub fn start() -> Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| Error::io(format!("proxy bind: {e}")))?;
        listener.set_nonblocking(true).map_err(|e| Error::io(format!("proxy: {e}")))?;
        let addr = listener.local_addr().map_err(|e| Error::io(format!("proxy: {e}")))?.to_string();
        let state = Arc::new(State {
            link: Mutex::new((Link::Pass, 0)),
            target: Mutex::new(None),
            stop: AtomicBool::new(false),
            connections: AtomicU64::new(0),
            answers_lost: AtomicU64::new(0),
        });
        let shared = state.clone();
        let accept = std::thread::Builder::new()
            .name("chaos-proxy".into())
            .spawn(move || {
                while !shared.stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((client, _)) => {
                            shared.connections.fetch_add(1, Ordering::Relaxed);
                            let state = shared.clone();
                            std::thread::spawn(move || serve(client, &state));
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(POLL / 5),
                        Err(_) => std::thread::sleep(POLL),
                    }
                }
            })
            .map_err(|e| Error::io(format!("proxy thread: {e}")))?;
        Ok(Proxy { addr, state, accept: Some(accept) })
    }

    /// `host:port` of the proxy.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Where connections go (`host:port`).
    pub fn set_target(&self, target: &str) {
        *self.state.target.lock().unwrap_or_else(|p| p.into_inner()) = Some(target.to_string());
    }

    /// Switch the link; every open connection is closed, except from [`Link::Pass`] to
    /// [`Link::LoseAnswers`] (the open connections lose their next answer and close then).
    pub fn set(&self, link: Link) {
        let mut now = self.state.link.lock().unwrap_or_else(|p| p.into_inner());
        let keep = now.0 == Link::Pass && link == Link::LoseAnswers;
        *now = (link, if keep { now.1 } else { now.1 + 1 });
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.state.connections.load(Ordering::Relaxed)
    }

    /// Answers of the remote server or broker thrown away (each with its connection).
    pub fn answers_lost(&self) -> u64 {
        self.state.answers_lost.load(Ordering::Relaxed)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Relaxed);
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
    }
}

/// One client connection, under the link it was accepted under, until the link switches.
fn serve(client: TcpStream, state: &State) {
    let (link, epoch) = state.now();
    let target = state.target.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let _ = client.set_nonblocking(false);
    let _ = client.set_read_timeout(Some(POLL));
    match (link, target) {
        (Link::Cut, _) | (_, None) => {}
        (Link::BlackHole, _) => {
            let mut sink = [0_u8; 16 * 1024];
            let mut client = client;
            while state.alive(epoch) {
                match client.read(&mut sink) {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e) if timed_out(&e) => {}
                    Err(_) => break,
                }
            }
        }
        (Link::Pass | Link::LoseAnswers, Some(target)) => {
            let Ok(server) = TcpStream::connect(&target) else { return };
            let _ = server.set_read_timeout(Some(POLL));
            let (Ok(client_out), Ok(server_in)) = (client.try_clone(), server.try_clone()) else { return };
            std::thread::scope(|scope| {
                scope.spawn(|| pump(client, server_in, state, epoch, false));
                pump(server, client_out, state, epoch, true);
            });
        }
    }
}

/// Copy `from` to `to` while the connection lives; then close both ways. On the `answers` side,
/// an answer read while the link loses answers is thrown away (counted) and the connection
/// closed: the rest of a byte stream cannot be passed on once a piece of it is gone.
fn pump(mut from: TcpStream, mut to: TcpStream, state: &State, epoch: u64, answers: bool) {
    let mut buffer = [0_u8; 16 * 1024];
    while state.alive(epoch) {
        match from.read(&mut buffer) {
            Ok(0) => break,
            Ok(_) if answers && state.now().0 == Link::LoseAnswers => {
                state.answers_lost.fetch_add(1, Ordering::Relaxed);
                break;
            }
            Ok(n) => {
                if to.write_all(&buffer[..n]).is_err() {
                    break;
                }
            }
            Err(e) if timed_out(&e) => {}
            Err(_) => break,
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

fn timed_out(e: &std::io::Error) -> bool {
    matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
}
