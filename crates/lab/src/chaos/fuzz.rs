//! `tidemark chaos fuzz`: runs beyond one seed's schedule. From its own seed it draws, run after
//! run, everything a run is made of (the run's seed, hence its schedule and its clients'
//! choices; a subset of the kinds of fault; the processes, worker processes, clients and the
//! number of faults), makes the run, and stops at the first one whose check fails; that run is
//! then shrunk (`chaos shrink`) to a smallest failing subset of its faults. Every run's
//! `reproduce` command replays it alone.

use std::path::PathBuf;

use clap::Args;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tidemark_core::error::codes;
use tidemark_core::{Error, Result};

use super::schedule::{self, FaultKind};
use super::{chaos, invalid, shrink, PostgresStore, RunArgs, ShrinkArgs};

/// Most runs of one fuzz.
pub(super) const FUZZ_RUNS_MAX: usize = 1_000;
/// Most faults a fuzz run may draw.
const FUZZ_FAULTS_MAX: usize = 1_000;
/// Longest workload of a fuzz run, in seconds.
const FUZZ_DURATION_S_MAX: u64 = 3_600;
/// The ranges a run's processes, worker processes and clients are drawn from.
const PROCESSES: (usize, usize) = (2, 3);
const WORKERS: (usize, usize) = (0, 2);
const CLIENTS: (usize, usize) = (2, 8);

#[derive(Args)]
pub(super) struct FuzzArgs {
    /// The seed every run's settings are drawn from (0..=2^64-1).
    #[arg(long)]
    seed: u64,
    /// Runs to make at most (1..=1000); the fuzz stops at the first that fails.
    #[arg(long, default_value_t = 10)]
    runs: usize,
    /// Seconds of workload of each run (1..=3600).
    #[arg(long, default_value_t = 10)]
    duration_s: u64,
    /// The most faults a run draws (1..=1000): each run injects 1 to this many.
    #[arg(long, default_value_t = 8)]
    faults_max: usize,
    /// The kinds each run draws a subset from (at least one each run). Default: every kind
    /// that needs no further option: `sigkill`, `sigstop`, `partition` and `remote-kill`, and
    /// in a failpoints build `crash-point`, and without `--store` also `power-loss`,
    /// `clock-jump`, `io-error` and `clock-jump-kill`. `db-crash` (it needs `--db-data`) is refused.
    #[arg(long, value_enum, value_delimiter = ',')]
    kinds: Option<Vec<FaultKind>>,
    /// The runs the shrink of a failing run makes at most (0..=200; 0: no shrink).
    #[arg(long, default_value_t = 30)]
    shrink_attempts_max: usize,
    /// Seconds each run waits for convergence after its clean restart (1..=3600).
    #[arg(long, default_value_t = 120)]
    converge_timeout_s: u64,
    /// The fuzz's folder (created; must not exist or be empty): a folder per run
    /// (`run-<i>`) and, after a failure, the shrink's (`shrink`).
    #[arg(long)]
    out: PathBuf,
    /// Serve on PostgreSQL, as `tidemark chaos --store`: run `i` uses the schema prefix
    /// `<prefix>_f<i>`, the shrink `<prefix>_f<i>_s<j>`.
    #[arg(long)]
    store: Option<String>,
}

/// The kinds a fuzz draws from by default in this build, with or without `--store`.
fn default_kinds(on_postgres: bool) -> Vec<FaultKind> {
    let mut kinds = vec![FaultKind::Sigkill, FaultKind::Sigstop, FaultKind::Partition, FaultKind::RemoteKill];
    if cfg!(feature = "failpoints") {
        kinds.push(FaultKind::CrashPoint);
        if !on_postgres {
            kinds.extend([FaultKind::PowerLoss, FaultKind::ClockJump, FaultKind::IoError, FaultKind::ClockJumpKill]);
        }
    }
    kinds
}

/// What run `index` of a fuzz is made of, drawn from the fuzz's seed alone.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Drawn {
    seed: u64,
    kinds: Vec<FaultKind>,
    processes: usize,
    workers: usize,
    clients: usize,
    faults: usize,
}

/// The runs' settings, in order: each kind of `pool` in a run with a chance of one half (one
/// drawn from the pool when none was).
fn draw(seed: u64, runs: usize, pool: &[FaultKind], faults_max: usize) -> Vec<Drawn> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0xf022_f022_f022_f022);
    (0..runs)
        .map(|_| {
            let seed = rng.gen::<u64>();
            let mut kinds: Vec<FaultKind> = pool.iter().copied().filter(|_| rng.gen_bool(0.5)).collect();
            if kinds.is_empty() {
                kinds.push(pool[rng.gen_range(0..pool.len())]);
            }
            Drawn {
                seed,
                kinds,
                processes: rng.gen_range(PROCESSES.0..=PROCESSES.1),
                workers: rng.gen_range(WORKERS.0..=WORKERS.1),
                clients: rng.gen_range(CLIENTS.0..=CLIENTS.1),
                faults: rng.gen_range(1..=faults_max),
            }
        })
        .collect()
}

/// `tidemark chaos fuzz` (the module's documentation).
pub(super) fn fuzz(args: FuzzArgs, durability: &str) -> Result<Value> {
    if !(1..=FUZZ_RUNS_MAX).contains(&args.runs) {
        return Err(invalid(format!("--runs must be 1..={FUZZ_RUNS_MAX}, got {}", args.runs)));
    }
    if !(1..=FUZZ_FAULTS_MAX).contains(&args.faults_max) {
        return Err(invalid(format!("--faults-max must be 1..={FUZZ_FAULTS_MAX}, got {}", args.faults_max)));
    }
    if !(1..=FUZZ_DURATION_S_MAX).contains(&args.duration_s) {
        return Err(invalid(format!("--duration-s must be 1..={FUZZ_DURATION_S_MAX}, got {}", args.duration_s)));
    }
    if args.shrink_attempts_max > super::SHRINK_ATTEMPTS_MAX {
        return Err(invalid(format!(
            "--shrink-attempts-max must be 0..={}, got {}",
            super::SHRINK_ATTEMPTS_MAX,
            args.shrink_attempts_max
        )));
    }
    let store = args.store.as_deref().map(PostgresStore::parse).transpose()?;
    let allowed = default_kinds(store.is_some());
    let pool = match args.kinds {
        None => allowed,
        Some(mut kinds) => {
            kinds.sort_by_key(|k| *k as u8);
            kinds.dedup();
            if let Some(refused) = kinds.iter().find(|k| !allowed.contains(k)) {
                let name = clap::ValueEnum::to_possible_value(refused).map(|v| v.get_name().to_string());
                return Err(invalid(format!(
                    "--kinds {} cannot be fuzzed here: a fuzz draws from kinds that need no further option{}",
                    name.unwrap_or_default(),
                    if cfg!(feature = "failpoints") { "" } else { " (and this build has no failpoints)" }
                )));
            }
            if kinds.is_empty() {
                return Err(invalid("--kinds names no kind of fault"));
            }
            kinds
        }
    };
    if args.out.read_dir().is_ok_and(|mut entries| entries.next().is_some()) {
        return Err(Error::invalid(codes::ALREADY_EXISTS, format!("--out {} is not empty", args.out.display())));
    }
    let run_args = |index: usize, drawn: &Drawn| RunArgs {
        seed: Some(drawn.seed),
        duration_s: args.duration_s,
        faults: drawn.faults,
        faults_only: None,
        kinds: drawn.kinds.clone(),
        processes: drawn.processes,
        clients: drawn.clients,
        workers: drawn.workers,
        clock_jump_leases_max: schedule::CLOCK_JUMP_LEASES_MAX,
        converge_timeout_s: args.converge_timeout_s,
        out: Some(args.out.join(format!("run-{index}"))),
        store: store.as_ref().map(|store| {
            crate::stores::schema_url(store.backend.conn(), &format!("{}_f{index}", store.backend.prefix()))
        }),
        db_data: None,
        db_preload: None,
        broker: None,
        disk: None,
    };
    let mut runs = Vec::new();
    for (index, drawn) in draw(args.seed, args.runs, &pool, args.faults_max).iter().enumerate() {
        let run = run_args(index, drawn);
        let report = chaos(run.clone(), durability)
            .map_err(|e| Error::io(format!("fuzz run {index} (seed {}) did not run: {e}", drawn.seed)))?;
        let failed = report["check"]["passed"] == false;
        runs.push(json!({
            "index": index,
            "seed": drawn.seed,
            "outcome": report["outcome"],
            "reproduce": report["reproduce"],
            "faults": report["faults"]["injected"],
            "acknowledged": report["operations"]["acknowledged"],
            "out": report["out"],
        }));
        if !failed {
            continue;
        }
        let shrunk = match args.shrink_attempts_max {
            0 => Value::Null,
            attempts_max => {
                // The same run again, its trials under `shrink/` (on PostgreSQL under the
                // prefix `<prefix>_f<i>_s<j>`).
                let mut again = run;
                again.out = Some(args.out.join("shrink"));
                shrink(ShrinkArgs { attempts_max, run: again }, durability)?
            }
        };
        return Ok(json!({
            "outcome": "violations",
            "seed": args.seed,
            "runs": runs,
            "failed": index,
            "reproduce": report["reproduce"],
            "check": report["check"],
            "shrunk": shrunk,
        }));
    }
    Ok(json!({"outcome": "passed", "seed": args.seed, "runs": runs, "check": {"passed": true}}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fuzz_draws_the_same_runs_from_its_seed_and_every_kind_of_its_pool() {
        let pool = default_kinds(false);
        let runs = draw(3, 200, &pool, 8);
        assert_eq!(runs, draw(3, 200, &pool, 8));
        assert_ne!(runs, draw(4, 200, &pool, 8));
        for run in &runs {
            assert!(!run.kinds.is_empty() && run.kinds.iter().all(|k| pool.contains(k)), "{run:?}");
            assert!((1..=8).contains(&run.faults), "{run:?}");
            assert!((PROCESSES.0..=PROCESSES.1).contains(&run.processes), "{run:?}");
            assert!((WORKERS.0..=WORKERS.1).contains(&run.workers), "{run:?}");
            assert!((CLIENTS.0..=CLIENTS.1).contains(&run.clients), "{run:?}");
        }
        for kind in &pool {
            assert!(runs.iter().any(|run| run.kinds.contains(kind)), "{kind:?} never drawn");
        }
        assert!(runs.iter().any(|run| run.kinds.len() == 1), "no run of one kind");
        assert!(runs.iter().any(|run| run.kinds.len() == pool.len()) || pool.len() > 6, "no run of every kind");
        // A pool of one: every run has it.
        assert!(draw(3, 20, &[FaultKind::Sigkill], 3).iter().all(|run| run.kinds == [FaultKind::Sigkill]));
        // Without failpoints nothing needs the fault VFS, and on PostgreSQL nothing needs files.
        assert!(!default_kinds(true).contains(&FaultKind::PowerLoss));
        assert!(!default_kinds(false).contains(&FaultKind::DbCrash));
    }
}
