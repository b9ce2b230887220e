//! The fault schedule of a chaos run: derived from the seed alone (a `StdRng` seeded with it),
//! so a failing seed replays the same faults, at the same offsets, on the same processes.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

/// Percent of the faults that are a SIGKILL (the rest are a SIGSTOP/SIGCONT pause).
const SIGKILL_PERCENT: u32 = 60;
/// Percent of the faults that are a power loss, when power losses are among the kinds asked
/// for beside others.
const POWER_LOSS_PERCENT: u32 = 25;
/// Percent of the faults that are a clock jump, when clock jumps are among the kinds asked for
/// beside others.
const CLOCK_JUMP_PERCENT: u32 = 25;
/// The size of a clock jump, in leases (either direction): from one lease to this many, unless
/// the run asks for larger ones (`tidemark chaos --clock-jump-leases-max`).
pub const CLOCK_JUMP_LEASES_MAX: u64 = 5;
/// The largest clock jump a run may ask for, in leases: a day at the harness's 1 s lease.
pub const CLOCK_JUMP_LEASES_LIMIT: u64 = 86_400;
/// Percent of the faults that are a partition, when partitions are among the kinds asked for
/// beside others.
const PARTITION_PERCENT: u32 = 25;
/// Shortest and longest partition, in ms.
const PARTITION_MS_RANGE: (u64, u64) = (300, 3_000);
/// Percent of the faults that are an I/O error, when I/O errors are among the kinds asked for
/// beside others.
const IO_ERROR_PERCENT: u32 = 25;
/// Shortest and longest I/O error, in ms.
const IO_ERROR_MS_RANGE: (u64, u64) = (200, 2_000);
/// Percent of the faults that are a crash of the database server, when those are among the
/// kinds asked for beside others.
const DB_CRASH_PERCENT: u32 = 25;
/// Shortest and longest time the database server stays down after a crash, in ms.
const DB_CRASH_MS_RANGE: (u64, u64) = (500, 3_000);
/// Percent of the faults that are a SIGKILL of the remote consumer's server, when those are
/// among the kinds asked for beside others (drawn instead of a signal or a partition).
const REMOTE_KILL_PERCENT: u32 = 25;
/// Percent of the SIGKILLs that are a crash point instead, when crash points are among the kinds
/// asked for beside others.
const CRASH_POINT_PERCENT: u32 = 50;
/// The crash points a crash-point fault arms, in this order: the first three are the ones a
/// worker process reaches (its runs' claims and journal commits; a worker's child starts are
/// journal commits too), the rest only a server (its HTTP starts and advances, relay lanes and
/// local consumers' drains). On a worker, the fault's point is the one at its index modulo
/// three ([`Fault::point_on`]). A run of `--kinds crash-point` (seed 2, 30 faults) reached
/// every one of them.
pub const SERVER_CRASH_POINTS: [&str; 12] = [
    "workflow.claim.after_commit",
    "workflow.commit.before_commit",
    "workflow.commit.after_commit",
    "workflow.start.before_commit",
    "advance.before_commit",
    "advance.after_commit",
    "relay.after_consumer_commit",
    "relay.before_producer_commit",
    "relay.after_producer_commit",
    "apply.after_handler",
    "apply.before_commit",
    "apply.after_commit",
];
/// How many of [`SERVER_CRASH_POINTS`] (its first ones) a worker process reaches.
const WORKER_CRASH_POINTS: usize = 3;
/// Shortest and longest pause between a SIGKILL and the restart of the process.
const RESTART_DELAY_MS_RANGE: (u64, u64) = (50, 1_500);
/// A pause lasts the worker lease plus this much (so the paused process's leases expire and its
/// runs are taken over while it is stopped).
const PAUSE_PAST_LEASE_MS_RANGE: (u64, u64) = (200, 1_500);

/// Do these kinds step a process's wall clock (`clock-jump`, `clock-jump-kill`)?
pub fn jumps_clocks(kinds: &[FaultKind]) -> bool {
    kinds.iter().any(|k| matches!(k, FaultKind::ClockJump | FaultKind::ClockJumpKill))
}

/// What a fault does to its process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// SIGKILL (a crash), then a restart on the same address after `hold_ms`.
    Sigkill,
    /// SIGSTOP, then SIGCONT after `hold_ms` (longer than the worker lease).
    Sigstop,
    /// A simulated power loss of the machine: every process is killed at once, what the files
    /// had not made durable is thrown away (`faultfs`), and every process restarts after
    /// `hold_ms`. `process` is 0 and means all of them.
    #[value(name = "power-loss")]
    PowerLoss,
    /// The process's wall clock steps by `jump_ms` (forward or back, one to five leases) for
    /// `hold_ms` (longer than the lease), then back: its leases look expired to the others, or
    /// theirs to it. Monotonic clocks are not touched. Needs a failpoints build.
    #[value(name = "clock-jump")]
    ClockJump,
    /// The network between the servers' relays and the remote consumer's server (an in-harness
    /// TCP proxy) fails for `hold_ms` as `partition` says, then heals. `process` is 0 (the
    /// link, not a process).
    Partition,
    /// The disk under every server fails for `hold_ms` as `io_error` says (the fault VFS's
    /// control files), then works again; the processes stay up. `process` is 0 (the disk). Needs
    /// a failpoints build.
    #[value(name = "io-error")]
    IoError,
    /// The PostgreSQL server of the run's `--store` stops at once (`pg_ctl stop -m immediate`:
    /// every backend killed, nothing flushed or checkpointed) and starts again after `hold_ms`
    /// (crash recovery replays its WAL); the tidemark processes stay up. `process` is 0 (the
    /// database). Needs `--store` and `--db-data`.
    #[value(name = "db-crash")]
    DbCrash,
    /// SIGKILL of the remote consumer's server (the one the relays deliver to, over HTTP or
    /// through `--broker`), then a restart on the same address after `hold_ms`; the servers stay
    /// up. `process` is 0 (the remote server).
    #[value(name = "remote-kill")]
    RemoteKill,
    /// The process exits by itself at the next commit boundary it reaches of the one named by
    /// `crash_point` (its crash file: `tidemark_core::crash`), killed there if it reaches none
    /// within a bound, then restarts after `hold_ms`: a SIGKILL at the exact moment between a
    /// commit and its answer (or before the commit), which a signal at a random moment rarely
    /// hits. Needs a failpoints build.
    #[value(name = "crash-point")]
    CrashPoint,
    /// A clock jump (as `clock-jump`) during which its process is killed with SIGKILL, halfway
    /// through the hold, and restarted with its clock still off: what it leased or scheduled
    /// with that clock stays so, its leases held by no one until they expire by it. Beside
    /// `clock-jump`, half the jumps; alone, every fault. Needs a failpoints build.
    #[value(name = "clock-jump-kill")]
    ClockJumpKill,
}

/// How an I/O error fails the disk (the fault VFS: `tidemark_store_sqlite::faultfs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IoErrorMode {
    /// Writes that grow a file fail with `SQLITE_FULL` (overwrites in place still succeed).
    Full,
    /// Every write fails (`SQLITE_IOERR_WRITE`).
    EioWrite,
    /// Every fsync fails (`SQLITE_IOERR_FSYNC`).
    EioFsync,
}

/// How a partition fails the link (the harness's TCP proxy between the relays and the remote
/// server).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PartitionMode {
    /// Connections are cut and new ones refused (reset at once).
    Cut,
    /// Connections are accepted and what is sent is swallowed: nothing comes back, the relay's
    /// attempt times out.
    BlackHole,
    /// One way: requests reach the remote server (which commits them), its answers are lost
    /// (the relay sees a failed attempt and delivers again: the remote answers `duplicate`).
    LoseAnswers,
    /// The link goes up and down every 100-400 ms.
    Flap,
}

/// One scheduled fault.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Fault {
    /// Its position in the schedule (0-based).
    pub index: usize,
    /// When it is due, in ms after the workload started. Faults run one after the other: a
    /// fault due while the previous one is still held starts when that one ends.
    pub at_ms: u64,
    /// What it does.
    pub kind: FaultKind,
    /// The process it hits (0-based).
    pub process: usize,
    /// How long the process stays down (killed), stopped or skewed, in ms.
    pub hold_ms: u64,
    /// A clock jump's step, in ms (negative: back); 0 for the other kinds.
    pub jump_ms: i64,
    /// A partition's way of failing the link; `None` for the other kinds.
    pub partition: Option<PartitionMode>,
    /// An I/O error's way of failing the disk; `None` for the other kinds.
    pub io_error: Option<IoErrorMode>,
    /// A crash point fault's point on a server (one of [`SERVER_CRASH_POINTS`]); `None` for the
    /// other kinds.
    pub crash_point: Option<&'static str>,
}

impl Fault {
    /// The crash point this fault arms on its process: [`Fault::crash_point`] on a server, the
    /// worker's point at the same index modulo three on a worker process (which reaches only
    /// its runs' claims and journal commits).
    pub fn point_on(&self, worker: bool) -> Option<&'static str> {
        let point = self.crash_point?;
        let index = SERVER_CRASH_POINTS.iter().position(|p| *p == point)?;
        Some(if worker { SERVER_CRASH_POINTS[index % WORKER_CRASH_POINTS] } else { point })
    }
}

/// The schedule of `faults` faults of the given `kinds` (at least one) on `processes` processes
/// during `duration_ms` of workload: due times spread over the middle 80% of the workload, in
/// order. With the kinds SIGKILL and SIGSTOP (the default) the schedule of a seed is the one
/// earlier builds made; power losses and clock jumps draw from the same stream after the other
/// choices (a schedule without clock jumps is the one builds before them made). A clock jump
/// steps one to `jump_leases_max` leases either way.
pub fn schedule(
    seed: u64,
    faults: usize,
    kinds: &[FaultKind],
    processes: usize,
    duration_ms: u64,
    (lease_ms, jump_leases_max): (u64, u64),
) -> Vec<Fault> {
    let has = |kind: FaultKind| kinds.contains(&kind);
    let signals = [FaultKind::Sigkill, FaultKind::Sigstop].into_iter().filter(|k| has(*k)).count();
    // Another stream than the clients' (they seed from the seed times a prime plus their index).
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed_c4a0_5eed_c4a0);
    let (from, to) = (duration_ms / 10, duration_ms - duration_ms / 10);
    let mut due: Vec<u64> = (0..faults).map(|_| rng.gen_range(from..=to.max(from))).collect();
    due.sort_unstable();
    due.into_iter()
        .enumerate()
        .map(|(index, at_ms)| {
            let drawn = if rng.gen_range(0..100) < SIGKILL_PERCENT { FaultKind::Sigkill } else { FaultKind::Sigstop };
            let mut kind = match signals {
                2 => drawn,
                1 if has(FaultKind::Sigkill) => FaultKind::Sigkill,
                1 => FaultKind::Sigstop,
                _ if has(FaultKind::PowerLoss) => FaultKind::PowerLoss,
                _ => FaultKind::ClockJump,
            };
            let mut process = rng.gen_range(0..processes);
            if signals > 0 && has(FaultKind::PowerLoss) && rng.gen_range(0..100) < POWER_LOSS_PERCENT {
                kind = FaultKind::PowerLoss;
            }
            // Without signals a fault is a power loss or a clock jump; with them, also a clock
            // jump one time in four (each draw only when clock jumps are asked for).
            if has(FaultKind::ClockJump) || has(FaultKind::ClockJumpKill) {
                let jump_instead = match signals {
                    0 => has(FaultKind::PowerLoss) && rng.gen_range(0..100) < 50,
                    _ => kind != FaultKind::PowerLoss && rng.gen_range(0..100) < CLOCK_JUMP_PERCENT,
                };
                if jump_instead {
                    kind = FaultKind::ClockJump;
                }
            }
            // With other kinds, a partition, an I/O error or a database crash one time in four
            // instead of a signal, each drawn only when asked for (so other schedules stay the
            // ones earlier builds made), and every fault when no kind before it was asked for.
            let alone = |before: &[FaultKind]| signals == 0 && !before.iter().any(|k| has(*k));
            let earlier = [
                FaultKind::PowerLoss,
                FaultKind::ClockJump,
                FaultKind::Partition,
                FaultKind::IoError,
                FaultKind::DbCrash,
            ];
            for (n, (with, percent)) in [
                (FaultKind::Partition, PARTITION_PERCENT),
                (FaultKind::IoError, IO_ERROR_PERCENT),
                (FaultKind::DbCrash, DB_CRASH_PERCENT),
            ]
            .into_iter()
            .enumerate()
            {
                if has(with) {
                    let instead = alone(&earlier[..n + 2])
                        || (matches!(kind, FaultKind::Sigkill | FaultKind::Sigstop) && rng.gen_range(0..100) < percent);
                    if instead {
                        kind = with;
                    }
                }
            }
            // A kill of the remote server, drawn instead of a signal or a partition (it needs the
            // remote server, which partitions bring), or every fault when it is the only kind.
            if has(FaultKind::RemoteKill) {
                let instead = alone(&earlier)
                    || (matches!(kind, FaultKind::Sigkill | FaultKind::Sigstop | FaultKind::Partition)
                        && rng.gen_range(0..100) < REMOTE_KILL_PERCENT);
                if instead {
                    kind = FaultKind::RemoteKill;
                }
            }
            // A kill during a clock jump: every jump when only those are asked for, else half
            // of them (drawn only when asked for).
            if kind == FaultKind::ClockJump
                && has(FaultKind::ClockJumpKill)
                && (!has(FaultKind::ClockJump) || rng.gen_range(0..100) < 50)
            {
                kind = FaultKind::ClockJumpKill;
            }
            // A crash point instead of a SIGKILL half the time, drawn only when asked for (so
            // other schedules stay the ones earlier builds made), and every fault when it is the
            // only kind.
            if has(FaultKind::CrashPoint) {
                let only = kinds.iter().all(|k| *k == FaultKind::CrashPoint);
                if only || (kind == FaultKind::Sigkill && rng.gen_range(0..100) < CRASH_POINT_PERCENT) {
                    kind = FaultKind::CrashPoint;
                }
            }
            let crash_point = (kind == FaultKind::CrashPoint)
                .then(|| SERVER_CRASH_POINTS[rng.gen_range(0..SERVER_CRASH_POINTS.len())]);
            if matches!(
                kind,
                FaultKind::PowerLoss
                    | FaultKind::Partition
                    | FaultKind::IoError
                    | FaultKind::DbCrash
                    | FaultKind::RemoteKill
            ) {
                process = 0;
            }
            let hold_ms = match kind {
                FaultKind::Sigkill | FaultKind::PowerLoss | FaultKind::RemoteKill | FaultKind::CrashPoint => {
                    rng.gen_range(RESTART_DELAY_MS_RANGE.0..=RESTART_DELAY_MS_RANGE.1)
                }
                FaultKind::Sigstop | FaultKind::ClockJump | FaultKind::ClockJumpKill => {
                    lease_ms + rng.gen_range(PAUSE_PAST_LEASE_MS_RANGE.0..=PAUSE_PAST_LEASE_MS_RANGE.1)
                }
                FaultKind::Partition => rng.gen_range(PARTITION_MS_RANGE.0..=PARTITION_MS_RANGE.1),
                FaultKind::IoError => rng.gen_range(IO_ERROR_MS_RANGE.0..=IO_ERROR_MS_RANGE.1),
                FaultKind::DbCrash => rng.gen_range(DB_CRASH_MS_RANGE.0..=DB_CRASH_MS_RANGE.1),
            };
            let io_error = (kind == FaultKind::IoError).then(|| match rng.gen_range(0..3) {
                0 => IoErrorMode::Full,
                1 => IoErrorMode::EioWrite,
                _ => IoErrorMode::EioFsync,
            });
            let partition = (kind == FaultKind::Partition).then(|| match rng.gen_range(0..4) {
                0 => PartitionMode::Cut,
                1 => PartitionMode::BlackHole,
                2 => PartitionMode::LoseAnswers,
                _ => PartitionMode::Flap,
            });
            let jump_ms = match kind {
                FaultKind::ClockJump | FaultKind::ClockJumpKill => {
                    let size = rng.gen_range(lease_ms..=lease_ms * jump_leases_max) as i64;
                    if rng.gen_range(0..2) == 0 {
                        size
                    } else {
                        -size
                    }
                }
                _ => 0,
            };
            Fault { index, at_ms, kind, process, hold_ms, jump_ms, partition, io_error, crash_point }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The harness's lease and the default clock jumps.
    const CLOCKS: (u64, u64) = (1_000, CLOCK_JUMP_LEASES_MAX);

    const SIGNALS: [FaultKind; 2] = [FaultKind::Sigkill, FaultKind::Sigstop];

    #[test]
    fn a_seed_gives_the_same_schedule_every_time_and_another_seed_another() {
        let first = schedule(7, 20, &SIGNALS, 3, 30_000, CLOCKS);
        assert_eq!(first, schedule(7, 20, &SIGNALS, 3, 30_000, CLOCKS));
        assert_ne!(first, schedule(8, 20, &SIGNALS, 3, 30_000, CLOCKS));
        assert_eq!(first.len(), 20);
        assert!(first.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
        for fault in &first {
            assert!(fault.process < 3);
            assert!((3_000..=27_000).contains(&fault.at_ms), "{fault:?}");
            if fault.kind == FaultKind::Sigstop {
                assert!(fault.hold_ms > 1_000, "a pause outlasts the lease: {fault:?}");
            }
        }
        assert!(first.iter().any(|f| f.kind == FaultKind::Sigkill));
        assert!(first.iter().any(|f| f.kind == FaultKind::Sigstop));
        assert!(first.iter().all(|f| f.kind != FaultKind::PowerLoss));
    }

    #[test]
    fn power_losses_join_the_signals_at_the_same_times_and_hit_every_process() {
        let all = [FaultKind::Sigkill, FaultKind::Sigstop, FaultKind::PowerLoss];
        let mixed = schedule(7, 40, &all, 3, 30_000, CLOCKS);
        assert_eq!(mixed, schedule(7, 40, &all, 3, 30_000, CLOCKS));
        let signals_only = schedule(7, 40, &SIGNALS, 3, 30_000, CLOCKS);
        let due = |s: &[Fault]| s.iter().map(|f| f.at_ms).collect::<Vec<_>>();
        assert_eq!(due(&mixed), due(&signals_only), "the due times do not depend on the kinds");
        assert!(mixed.iter().any(|f| f.kind == FaultKind::PowerLoss));
        assert!(mixed.iter().any(|f| f.kind != FaultKind::PowerLoss));
        assert!(mixed.iter().filter(|f| f.kind == FaultKind::PowerLoss).all(|f| f.process == 0));
        let power_only = schedule(7, 10, &[FaultKind::PowerLoss], 3, 30_000, CLOCKS);
        assert!(power_only.iter().all(|f| f.kind == FaultKind::PowerLoss && f.process == 0));
        let kills_only = schedule(7, 10, &[FaultKind::Sigkill], 3, 30_000, CLOCKS);
        assert!(kills_only.iter().all(|f| f.kind == FaultKind::Sigkill));
    }

    #[test]
    fn clock_jumps_step_one_to_five_leases_either_way_and_leave_other_schedules_alone() {
        let with_jumps = [FaultKind::Sigkill, FaultKind::Sigstop, FaultKind::ClockJump];
        let mixed = schedule(9, 60, &with_jumps, 3, 60_000, CLOCKS);
        let jumps: Vec<&Fault> = mixed.iter().filter(|f| f.kind == FaultKind::ClockJump).collect();
        assert!(!jumps.is_empty() && jumps.len() < mixed.len(), "{mixed:?}");
        assert!(jumps.iter().all(|f| (1_000..=5_000).contains(&f.jump_ms.abs()) && f.hold_ms > 1_000), "{jumps:?}");
        assert!(jumps.iter().any(|f| f.jump_ms > 0) && jumps.iter().any(|f| f.jump_ms < 0), "{jumps:?}");
        assert!(mixed.iter().filter(|f| f.kind != FaultKind::ClockJump).all(|f| f.jump_ms == 0));
        let only = schedule(9, 10, &[FaultKind::ClockJump], 3, 60_000, CLOCKS);
        assert!(only.iter().all(|f| f.kind == FaultKind::ClockJump));
        // Power-loss schedules are the ones builds before clock jumps made (seed 13 of the CI
        // test: a power loss, a kill, a power loss).
        let kinds: Vec<FaultKind> = schedule(13, 3, &[FaultKind::Sigkill, FaultKind::PowerLoss], 2, 8_000, CLOCKS)
            .iter()
            .map(|f| f.kind)
            .collect();
        assert_eq!(kinds, [FaultKind::PowerLoss, FaultKind::Sigkill, FaultKind::PowerLoss]);
    }

    #[test]
    fn crash_points_replace_half_the_sigkills_and_leave_other_schedules_alone() {
        let with = [FaultKind::Sigkill, FaultKind::Sigstop, FaultKind::CrashPoint];
        let mixed = schedule(5, 80, &with, 3, 60_000, CLOCKS);
        let points: Vec<&Fault> = mixed.iter().filter(|f| f.kind == FaultKind::CrashPoint).collect();
        let kills = mixed.iter().filter(|f| f.kind == FaultKind::Sigkill).count();
        assert!(!points.is_empty() && kills > 0, "{mixed:?}");
        assert!(points.iter().all(|f| f.crash_point.is_some() && f.hold_ms <= 1_500), "{points:?}");
        assert!(mixed.iter().filter(|f| f.kind != FaultKind::CrashPoint).all(|f| f.crash_point.is_none()));
        // Every point is drawn, and the faults come at the times the seed gives without them.
        let many = schedule(5, 400, &with, 3, 600_000, CLOCKS);
        for point in SERVER_CRASH_POINTS {
            assert!(many.iter().any(|f| f.crash_point == Some(point)), "{point} never drawn");
        }
        let signals = schedule(5, 80, &SIGNALS, 3, 60_000, CLOCKS);
        assert!(signals.iter().zip(&mixed).all(|(a, b)| a.at_ms == b.at_ms));
        let only = schedule(5, 10, &[FaultKind::CrashPoint], 3, 60_000, CLOCKS);
        assert!(only.iter().all(|f| f.kind == FaultKind::CrashPoint));
        // On a worker process the point is one of its journal's.
        let fault = points.iter().find(|f| !f.crash_point.unwrap().starts_with("workflow.")).expect("a server's point");
        assert!(SERVER_CRASH_POINTS[..WORKER_CRASH_POINTS].contains(&fault.point_on(true).unwrap()), "{fault:?}");
        assert_eq!(fault.point_on(false), fault.crash_point);
    }

    #[test]
    fn kills_during_clock_jumps_take_half_the_jumps_or_every_fault_alone() {
        let with = [FaultKind::Sigkill, FaultKind::ClockJump, FaultKind::ClockJumpKill];
        let mixed = schedule(9, 120, &with, 3, 60_000, CLOCKS);
        let killed: Vec<&Fault> = mixed.iter().filter(|f| f.kind == FaultKind::ClockJumpKill).collect();
        assert!(!killed.is_empty(), "{mixed:?}");
        assert!(mixed.iter().any(|f| f.kind == FaultKind::ClockJump), "{mixed:?}");
        assert!(killed.iter().all(|f| (1_000..=5_000).contains(&f.jump_ms.abs()) && f.hold_ms > 1_000), "{killed:?}");
        let only = schedule(9, 10, &[FaultKind::ClockJumpKill], 3, 60_000, CLOCKS);
        assert!(only.iter().all(|f| f.kind == FaultKind::ClockJumpKill && f.jump_ms != 0), "{only:?}");
        let beside_kills = schedule(9, 40, &[FaultKind::Sigkill, FaultKind::ClockJumpKill], 3, 60_000, CLOCKS);
        assert!(beside_kills.iter().any(|f| f.kind == FaultKind::ClockJumpKill), "{beside_kills:?}");
        assert!(beside_kills.iter().all(|f| f.kind != FaultKind::ClockJump), "{beside_kills:?}");
    }

    #[test]
    fn partitions_join_the_other_kinds_in_every_mode_and_leave_other_schedules_alone() {
        let with = [FaultKind::Sigkill, FaultKind::Sigstop, FaultKind::Partition];
        let mixed = schedule(11, 80, &with, 3, 60_000, CLOCKS);
        let cuts: Vec<&Fault> = mixed.iter().filter(|f| f.kind == FaultKind::Partition).collect();
        assert!(!cuts.is_empty() && cuts.len() < mixed.len(), "{mixed:?}");
        assert!(cuts.iter().all(|f| f.process == 0 && (300..=3_000).contains(&f.hold_ms)), "{cuts:?}");
        for mode in [PartitionMode::Cut, PartitionMode::BlackHole, PartitionMode::LoseAnswers, PartitionMode::Flap] {
            assert!(cuts.iter().any(|f| f.partition == Some(mode)), "no {mode:?} in {cuts:?}");
        }
        assert!(mixed.iter().filter(|f| f.kind != FaultKind::Partition).all(|f| f.partition.is_none()));
        let only = schedule(11, 10, &[FaultKind::Partition], 3, 60_000, CLOCKS);
        assert!(only.iter().all(|f| f.kind == FaultKind::Partition));
        let due = |s: &[Fault]| s.iter().map(|f| f.at_ms).collect::<Vec<_>>();
        assert_eq!(due(&mixed), due(&schedule(11, 80, &SIGNALS, 3, 60_000, CLOCKS)));
    }

    #[test]
    fn io_errors_join_the_other_kinds_in_every_mode_and_leave_other_schedules_alone() {
        let with = [FaultKind::Sigkill, FaultKind::Sigstop, FaultKind::IoError];
        let mixed = schedule(12, 80, &with, 3, 60_000, CLOCKS);
        let errors: Vec<&Fault> = mixed.iter().filter(|f| f.kind == FaultKind::IoError).collect();
        assert!(!errors.is_empty() && errors.len() < mixed.len(), "{mixed:?}");
        assert!(errors.iter().all(|f| f.process == 0 && (200..=2_000).contains(&f.hold_ms)), "{errors:?}");
        for mode in [IoErrorMode::Full, IoErrorMode::EioWrite, IoErrorMode::EioFsync] {
            assert!(errors.iter().any(|f| f.io_error == Some(mode)), "no {mode:?} in {errors:?}");
        }
        let due = |s: &[Fault]| s.iter().map(|f| f.at_ms).collect::<Vec<_>>();
        assert_eq!(due(&mixed), due(&schedule(12, 80, &SIGNALS, 3, 60_000, CLOCKS)));
        let only = schedule(12, 10, &[FaultKind::IoError], 3, 60_000, CLOCKS);
        assert!(only.iter().all(|f| f.kind == FaultKind::IoError && f.io_error.is_some()));
    }

    #[test]
    fn database_crashes_join_the_other_kinds_and_leave_other_schedules_alone() {
        let with = [FaultKind::Sigkill, FaultKind::Sigstop, FaultKind::DbCrash];
        let mixed = schedule(14, 80, &with, 3, 60_000, CLOCKS);
        let crashes: Vec<&Fault> = mixed.iter().filter(|f| f.kind == FaultKind::DbCrash).collect();
        assert!(!crashes.is_empty() && crashes.len() < mixed.len(), "{mixed:?}");
        assert!(crashes.iter().all(|f| f.process == 0 && (500..=3_000).contains(&f.hold_ms)), "{crashes:?}");
        let due = |s: &[Fault]| s.iter().map(|f| f.at_ms).collect::<Vec<_>>();
        assert_eq!(due(&mixed), due(&schedule(14, 80, &SIGNALS, 3, 60_000, CLOCKS)));
        let only = schedule(14, 10, &[FaultKind::DbCrash], 3, 60_000, CLOCKS);
        assert!(only.iter().all(|f| f.kind == FaultKind::DbCrash));
        // The schedules without database crashes are the ones earlier builds made.
        let kinds: Vec<FaultKind> = schedule(13, 3, &[FaultKind::Sigkill, FaultKind::PowerLoss], 2, 8_000, CLOCKS)
            .iter()
            .map(|f| f.kind)
            .collect();
        assert_eq!(kinds, [FaultKind::PowerLoss, FaultKind::Sigkill, FaultKind::PowerLoss]);
    }

    #[test]
    fn remote_kills_join_the_other_kinds_and_leave_other_schedules_alone() {
        let with = [FaultKind::Sigkill, FaultKind::Sigstop, FaultKind::Partition, FaultKind::RemoteKill];
        let mixed = schedule(15, 80, &with, 3, 60_000, CLOCKS);
        let kills: Vec<&Fault> = mixed.iter().filter(|f| f.kind == FaultKind::RemoteKill).collect();
        assert!(!kills.is_empty() && kills.len() < mixed.len(), "{mixed:?}");
        assert!(kills.iter().all(|f| f.process == 0 && (50..=1_500).contains(&f.hold_ms) && f.partition.is_none()));
        assert!(mixed.iter().any(|f| f.kind == FaultKind::Partition), "{mixed:?}");
        let due = |s: &[Fault]| s.iter().map(|f| f.at_ms).collect::<Vec<_>>();
        assert_eq!(due(&mixed), due(&schedule(15, 80, &SIGNALS, 3, 60_000, CLOCKS)));
        // Beside partitions alone, a kill takes a partition's place now and then.
        let two = schedule(15, 40, &[FaultKind::Partition, FaultKind::RemoteKill], 2, 60_000, CLOCKS);
        let count = |kind: FaultKind| two.iter().filter(|f| f.kind == kind).count();
        assert!(count(FaultKind::RemoteKill) > 0 && count(FaultKind::Partition) > 0, "{two:?}");
        let only = schedule(15, 10, &[FaultKind::RemoteKill], 3, 60_000, CLOCKS);
        assert!(only.iter().all(|f| f.kind == FaultKind::RemoteKill));
        // The schedule of the CI's partition seed is the one earlier builds made.
        let partitions: Vec<(Option<PartitionMode>, u64)> = schedule(1, 5, &[FaultKind::Partition], 2, 12_000, CLOCKS)
            .iter()
            .map(|f| (f.partition, f.hold_ms))
            .collect();
        assert_eq!(
            partitions,
            [
                (Some(PartitionMode::Flap), 2_115),
                (Some(PartitionMode::LoseAnswers), 1_158),
                (Some(PartitionMode::LoseAnswers), 1_678),
                (Some(PartitionMode::BlackHole), 1_298),
                (Some(PartitionMode::Cut), 572),
            ]
        );
    }

    #[test]
    fn no_faults_is_an_empty_schedule() {
        assert!(schedule(1, 0, &SIGNALS, 2, 1_000, CLOCKS).is_empty());
    }
}
