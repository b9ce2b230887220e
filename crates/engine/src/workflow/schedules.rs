//! The schedule ticker of a worker's store: [`tick_schedules`] runs one pass of
//! [`tidemark_core::schedule::tick`] on the writer thread (the due schedules read, planned and
//! fired there, each schedule's runs and next tick in one transaction), with the latest version
//! of every workflow the registry knows.

use std::collections::BTreeMap;

use tidemark_core::schedule::{tick, ScheduleStore, TickReport};
use tidemark_core::workflow::WorkflowStore;
use tidemark_core::Result;

use super::{Workflows, Writer};

/// Start the runs of every due schedule whose workflow `workflows` registers.
pub async fn tick_schedules<S>(writer: &Writer<S>, workflows: &Workflows<S>) -> Result<TickReport>
where
    S: WorkflowStore + ScheduleStore + 'static,
{
    let mut versions: BTreeMap<String, u32> = BTreeMap::new();
    for v in workflows.versions() {
        let latest = versions.entry(v.workflow).or_insert(v.version);
        *latest = (*latest).max(v.version);
    }
    writer.call(move |store, now| tick(store, &versions, now)).await
}
