//! What an operator sees at a glance for one tenant: the outbox backlog and quarantine, each
//! consumer's open and blocked inbox records, runs by status, and WAL sizes. Read through
//! read-only connections of their own ([`StatsReader`]), not on the store threads; used by the
//! dashboard and `/metrics`.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Serialize;
use tidemark_core::Result;
use tidemark_store_sqlite::stats::{self, InboxCounts, OutboxCounts};

use crate::backend::Backend;
use crate::registry::TenantInfo;
use crate::tenant::Tenant;

/// What the dashboard and `/metrics` show of one tenant's stored state, read in one go.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TenantStats {
    /// The tenant id.
    pub tenant: String,
    /// The producer's open deliveries.
    pub outbox: OutboxCounts,
    /// Per consumer id (both inbox files).
    pub inbox: BTreeMap<String, InboxCounts>,
    /// Runs by status word (only statuses that have runs).
    pub runs: BTreeMap<String, u64>,
    /// WAL bytes per file name.
    pub wal_bytes: BTreeMap<String, u64>,
}

/// Read-only connections to a tenant's producer, inbox and workflow files. The counts are read
/// through them on a blocking thread, so a scrape never queues behind the store threads' group
/// commits, and a long group commit never delays a scrape (a WAL reader sees the last commit).
pub struct StatsReader {
    producer: rusqlite::Connection,
    inbox: rusqlite::Connection,
    workflows: rusqlite::Connection,
}

impl StatsReader {
    /// Open the readers of the files in `dir` (after the tenant's writers have created them).
    pub fn open(dir: &std::path::Path) -> Result<StatsReader> {
        use tidemark_store_sqlite::open_reader;
        let [(_, producer), (_, inbox), (_, workflows)] = Tenant::files(dir);
        Ok(StatsReader {
            producer: open_reader(&producer)?,
            inbox: open_reader(&inbox)?,
            workflows: open_reader(&workflows)?,
        })
    }

    /// The counts of the tenant `tenant`, read through these connections.
    pub fn read(&self, tenant: &TenantInfo, now_ms: i64) -> Result<TenantStats> {
        // Both outboxes: the producer's and the workflow database's.
        let mut outbox = stats::outbox_counts(&self.producer, now_ms)?;
        outbox.absorb(stats::outbox_counts(&self.workflows, now_ms)?);
        let mut inbox = stats::inbox_counts(&self.inbox)?;
        inbox.extend(stats::inbox_counts(&self.workflows)?);
        let runs = stats::run_counts(&self.workflows)?;
        let wal_bytes = Tenant::files(&tenant.dir)
            .into_iter()
            .map(|(name, path)| (name.to_string(), stats::wal_bytes(&path)))
            .collect();
        Ok(TenantStats { tenant: tenant.id.clone(), outbox, inbox, runs, wal_bytes })
    }
}

impl TenantStats {
    /// Read the tenant's counts through what its backend reads them with, on a blocking thread
    /// (never on the store threads).
    pub async fn read<B: Backend>(tenant: &Arc<Tenant<B>>) -> Result<TenantStats> {
        let tenant = Arc::clone(tenant);
        tokio::task::spawn_blocking(move || {
            let mut reader = tenant.stats.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            tenant.backend.read_stats(&mut reader, &tenant.info, crate::now_ms())
        })
        .await
        .map_err(|e| tidemark_core::Error::store(format!("the stats reader thread failed: {e}")))?
    }

    /// Runs parked for an operator (failed or dead-lettered).
    pub fn parked(&self) -> u64 {
        ["parked", "failed"].iter().filter_map(|s| self.runs.get(*s)).sum()
    }

    /// Open inbox records a handler refused, across the tenant's consumers.
    pub fn blocked(&self) -> u64 {
        self.inbox.values().map(|c| c.blocked).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Sqlite;
    use crate::config::Config;
    use crate::now_ms;

    /// The counts are read through the tenant's own read-only connections: they are answered
    /// while every store thread of the tenant is held inside a call (as during a long group
    /// commit), and they show what was committed before.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn counts_are_read_while_the_store_threads_are_busy() {
        let dir = tempfile::tempdir().unwrap();
        let config = Config { data_dir: dir.path().to_path_buf(), ..Config::default() };
        let (_, registrations) = crate::registry::Registry::new::<Sqlite>(Default::default()).unwrap();
        let tenant = Arc::new(Tenant::open(&config, &registrations, Arc::new(Sqlite), "acme", now_ms, None).unwrap());
        let before = TenantStats::read(&tenant).await.unwrap();
        assert_eq!(before.outbox.last_position, 0);

        type Hold = Arc<std::sync::Mutex<std::sync::mpsc::Receiver<()>>>;
        /// Hold `actor`'s thread inside a call until `hold` yields (or its sender is dropped).
        fn hold_thread<S: crate::actor::GroupCommit + Send + 'static>(
            actor: &crate::actor::Actor<S>,
            hold: &Hold,
            held: &std::sync::mpsc::Sender<()>,
        ) -> tokio::task::JoinHandle<Result<()>> {
            let (actor, hold, held) = (actor.clone(), Arc::clone(hold), held.clone());
            tokio::spawn(async move {
                actor
                    .call(move |_| {
                        held.send(()).unwrap();
                        let _ = hold.lock().unwrap().recv();
                        Ok(())
                    })
                    .await
            })
        }
        let (release, hold) = std::sync::mpsc::channel::<()>();
        let hold: Hold = Arc::new(std::sync::Mutex::new(hold));
        let (held_tx, held) = std::sync::mpsc::channel::<()>();
        let blockers = [
            hold_thread(&tenant.producer, &hold, &held_tx),
            hold_thread(&tenant.inbox, &hold, &held_tx),
            hold_thread(&tenant.runs_inbox, &hold, &held_tx),
        ];
        for _ in 0..3 {
            held.recv().unwrap();
        }
        // Without its own connections this read would wait for the held threads forever; the
        // guard only turns such a hang into a failure.
        let during = tokio::time::timeout(std::time::Duration::from_secs(60), TenantStats::read(&tenant))
            .await
            .expect("the counts waited for the busy store threads")
            .unwrap();
        assert_eq!(during.tenant, "acme");
        assert_eq!(during.outbox.last_position, before.outbox.last_position);
        for _ in 0..3 {
            release.send(()).unwrap();
        }
        for blocker in blockers {
            blocker.await.unwrap().unwrap();
        }
    }
}
