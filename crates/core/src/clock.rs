//! The wall clock of every tidemark process, read in one place: [`now_ms`].
//!
//! With the one exception of the crash points, this is the only place core touches the world:
//! it reads the system clock (and, in failpoints builds, a file). Everything that stamps a time
//! (advances, leases, timers, journal writes, retention) calls it, directly or through a clock
//! it was handed.
//!
//! **Clock jumps** (failpoints builds only): a process started with
//! `TIDEMARK_CLOCK_OFFSET_FILE=<path>` adds the milliseconds that file holds (an integer,
//! possibly negative; a missing, empty or unreadable file counts as 0) to the system clock,
//! re-read at most every [`OFFSET_REREAD_MS`] ms. The chaos harness steps one process's clock
//! forward or back with it, as an NTP step would, while the monotonic clocks (timeouts, sleeps)
//! go on unchanged. See docs/reliability.md, "Clock jumps".

/// The environment variable naming the clock offset file (failpoints builds only).
pub const OFFSET_FILE_ENV: &str = "TIDEMARK_CLOCK_OFFSET_FILE";
/// How often the offset file is read again, at most.
pub const OFFSET_REREAD_MS: u64 = 50;

/// Milliseconds since the Unix epoch, from the system clock (plus the failpoints offset).
pub fn now_ms() -> i64 {
    let system = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0);
    system.saturating_add(offset_ms())
}

#[cfg(not(feature = "failpoints"))]
#[inline(always)]
fn offset_ms() -> i64 {
    0
}

#[cfg(feature = "failpoints")]
fn offset_ms() -> i64 {
    use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
    use std::sync::OnceLock;
    use std::time::Instant;
    static FILE: OnceLock<Option<std::path::PathBuf>> = OnceLock::new();
    static STARTED: OnceLock<Instant> = OnceLock::new();
    static OFFSET: AtomicI64 = AtomicI64::new(0);
    // When the file was read last, in ms after STARTED, plus one (0: never).
    static READ_AT: AtomicU64 = AtomicU64::new(0);
    let Some(path) = FILE.get_or_init(|| std::env::var_os(OFFSET_FILE_ENV).map(Into::into)) else { return 0 };
    let elapsed = STARTED.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1;
    let last = READ_AT.load(Ordering::Relaxed);
    if last == 0 || elapsed.saturating_sub(last) >= OFFSET_REREAD_MS {
        let offset = std::fs::read_to_string(path).ok().and_then(|t| t.trim().parse::<i64>().ok()).unwrap_or(0);
        OFFSET.store(offset, Ordering::Relaxed);
        READ_AT.store(elapsed, Ordering::Relaxed);
    }
    OFFSET.load(Ordering::Relaxed)
}
