//! What an operator sees at a glance for one tenant: the outbox backlog and quarantine, each
//! consumer's open and blocked inbox records, runs by status, and WAL sizes. Read from the
//! stores (each count on its store's thread); used by the dashboard and `/metrics`.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Serialize;
use tidemark_core::Result;
use tidemark_store_sqlite::stats::{self, InboxCounts, OutboxCounts};

use crate::now_ms;
use crate::tenant::Tenant;

#[derive(Debug, Clone, Default, Serialize)]
pub struct TenantStats {
    pub tenant: String,
    pub outbox: OutboxCounts,
    /// Per consumer id (both inbox files).
    pub inbox: BTreeMap<String, InboxCounts>,
    pub runs: BTreeMap<String, u64>,
    /// WAL bytes per file name.
    pub wal_bytes: BTreeMap<String, u64>,
}

impl TenantStats {
    pub async fn read(tenant: &Arc<Tenant>) -> Result<TenantStats> {
        let outbox = tenant.producer.call(|p| stats::outbox_counts(p.store.connection(), now_ms())).await?;
        let mut inbox = tenant.inbox.call(|t| stats::inbox_counts(t.store.connection())).await?;
        inbox.extend(tenant.runs_inbox.call(|t| stats::inbox_counts(t.store.connection())).await?);
        let runs = tenant.writer.call(|store, _| stats::run_counts(store.connection())).await?;
        let wal_bytes = Tenant::files(&tenant.dir)
            .into_iter()
            .map(|(name, path)| (name.to_string(), stats::wal_bytes(&path)))
            .collect();
        Ok(TenantStats { tenant: tenant.id.clone(), outbox, inbox, runs, wal_bytes })
    }

    /// Runs parked for an operator (failed or dead-lettered).
    pub fn parked(&self) -> u64 {
        ["parked", "failed"].iter().filter_map(|s| self.runs.get(*s)).sum()
    }

    pub fn blocked(&self) -> u64 {
        self.inbox.values().map(|c| c.blocked).sum()
    }
}
