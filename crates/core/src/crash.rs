//! Named crash points at commit boundaries, for crash tests.
//!
//! Compiled in only with the `failpoints` cargo feature. `TIDEMARK_CRASH_AT=<name>` makes the
//! process exit with code 73 (81 for the unsafe dual-write point) the first time it reaches
//! `<name>`; `<name>@<n>` on the n-th time.
//!
//! A long-running process (a server or a worker under the chaos harness) is armed while it runs:
//! started with `TIDEMARK_CRASH_FILE=<path>`, it exits at the first crash point it reaches whose
//! name that file holds (one name; a missing, empty or unreadable file arms nothing), the file
//! read again at most every [`CRASH_FILE_REREAD_MS`] ms, as the clock offset file is
//! ([`crate::clock`]).
//! Without the feature, [`hit`] is an empty inline function.

/// Every crash point, in protocol order. Tests iterate this list; `hit` rejects unknown names.
pub const CRASH_POINTS: &[&str] = &[
    "advance.before_commit",
    "advance.after_commit",
    "relay.after_consumer_commit",
    "relay.before_producer_commit",
    "relay.after_producer_commit",
    "receive.before_commit",
    "receive.after_commit",
    "apply.after_handler",
    "apply.before_commit",
    "apply.after_commit",
    "prune.before_commit",
    "prune.after_commit",
    "resolve.before_commit",
    "redeliver.before_commit",
    "rename.before_commit",
    "rename.after_commit",
    // Opening a file of an older schema: its migrations run in one transaction.
    "migrate.before_commit",
    // Durable workflows (crates/store-sqlite/src/workflow/).
    "workflow.start.before_commit",
    "workflow.claim.after_commit",
    "workflow.commit.before_commit",
    "workflow.commit.after_commit",
    "workflow.operator.before_commit",
    "workflow.purge.before_commit",
    // Only on the deliberately wrong dual-write path (`tidemark unsafe-dual-write-advance`,
    // failpoints builds only): between its two separate commits. Exits with
    // [`UNSAFE_DUAL_WRITE_EXIT_CODE`] so a test can tell it apart from the real points.
    "unsafe_dual_write.between_commits",
];

/// The environment variable naming the crash file (failpoints builds only).
pub const CRASH_FILE_ENV: &str = "TIDEMARK_CRASH_FILE";
/// How often the crash file is read again, at most.
pub const CRASH_FILE_REREAD_MS: u64 = 50;

/// The exit code of a process killed at a crash point.
pub const CRASH_EXIT_CODE: i32 = 73;

/// The exit code of a process killed at `unsafe_dual_write.between_commits`.
pub const UNSAFE_DUAL_WRITE_EXIT_CODE: i32 = 81;

/// The exit code a process killed at crash point `name` exits with.
pub fn exit_code(name: &str) -> i32 {
    if name.starts_with("unsafe_dual_write.") {
        UNSAFE_DUAL_WRITE_EXIT_CODE
    } else {
        CRASH_EXIT_CODE
    }
}

#[cfg(feature = "failpoints")]
mod armed {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;

    pub(super) struct Armed {
        pub name: String,
        pub on_hit: u64,
        pub hits: AtomicU64,
    }

    pub(super) fn armed() -> &'static Option<Armed> {
        static ARMED: OnceLock<Option<Armed>> = OnceLock::new();
        ARMED.get_or_init(|| {
            let spec = std::env::var("TIDEMARK_CRASH_AT").ok()?;
            let (name, on_hit) = match spec.split_once('@') {
                Some((name, n)) => (name.to_string(), n.parse().unwrap_or(1)),
                None => (spec, 1),
            };
            Some(Armed { name, on_hit, hits: AtomicU64::new(0) })
        })
    }

    pub(super) fn hit(name: &str) {
        if let Some(armed) = armed() {
            if armed.name == name && armed.hits.fetch_add(1, Ordering::SeqCst) + 1 == armed.on_hit {
                exit(name);
            }
        }
        if file_armed(name) {
            exit(name);
        }
    }

    fn exit(name: &str) -> ! {
        let code = super::exit_code(name);
        eprintln!("tidemark: crash point {name} reached; exiting with code {code}");
        std::process::exit(code);
    }

    /// Does the crash file (`TIDEMARK_CRASH_FILE`) name `name`? Read again at most every
    /// `CRASH_FILE_REREAD_MS` ms; between reads the last name read stands.
    fn file_armed(name: &str) -> bool {
        use std::sync::Mutex;
        use std::time::Instant;
        static FILE: OnceLock<Option<std::path::PathBuf>> = OnceLock::new();
        // The name read last (empty: none) and when.
        static READ: Mutex<Option<(Instant, String)>> = Mutex::new(None);
        let Some(path) = FILE.get_or_init(|| std::env::var_os(super::CRASH_FILE_ENV).map(Into::into)) else {
            return false;
        };
        let mut read = READ.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let stale = read.as_ref().is_none_or(|(at, _)| at.elapsed().as_millis() as u64 >= super::CRASH_FILE_REREAD_MS);
        if stale {
            let armed = std::fs::read_to_string(path).map(|text| text.trim().to_string()).unwrap_or_default();
            *read = Some((Instant::now(), armed));
        }
        read.as_ref().is_some_and(|(_, armed)| armed == name)
    }
}

/// Reach the crash point `name`.
#[inline]
pub fn hit(name: &'static str) {
    debug_assert!(CRASH_POINTS.contains(&name), "unknown crash point {name}");
    #[cfg(feature = "failpoints")]
    armed::hit(name);
}
