//! Runs: the filtered, paginated list; a run's timeline (steps with their attempts, errors,
//! compensations, timers and waits, and the events it received) with the operator buttons;
//! and the dead letters (parked and failed runs, blocked inbox records). Every read and action
//! calls the JSON API's shared function, so it is checked exactly like the API.

use std::collections::BTreeMap;

use axum::extract::State;
use axum::response::IntoResponse;
use maud::{html, Markup};
use serde::Deserialize;
use serde_json::Value;
use tidemark_core::error::codes;
use tidemark_core::schedule::{tick_run_id, Timing};
use tidemark_core::tenancy::Scope;
use tidemark_core::workflow::{
    child_run_id, AttemptRecord, JournalEntry, RunDetail, RunRecord, RunStatus, StepKind, StepStatus,
};
use tidemark_core::Error;

use super::layout::{badge, done_banner, json_block, page, reason_input, when};
use super::time::parse_utc;
use super::{see_other, Form, Path, Query, Ui, UiResult, Viewer};
use crate::api::inbox::RecordsQuery;
use crate::api::runs::{self as api, Control, ForkBody, ListQuery, SkipStepBody as SkipBody};
use crate::AnyCaller;
use crate::AppState;

/// Rows per page of the runs list.
const RUNS_PAGE_ROWS: usize = 50;
/// Rows per section of the dead letters page.
const DEAD_LETTER_ROWS: usize = 100;

#[derive(Debug, Default, Deserialize)]
pub struct RunsForm {
    pub status: Option<String>,
    pub workflow: Option<String>,
    /// `datetime-local` values, read as UTC.
    pub created_after: Option<String>,
    pub created_before: Option<String>,
    pub after: Option<String>,
}

/// An empty form field is no filter.
fn given(value: &Option<String>) -> Option<String> {
    value.as_deref().map(str::trim).filter(|v| !v.is_empty()).map(str::to_string)
}

fn query_string(pairs: &[(&str, Option<String>)]) -> String {
    let mut out = String::new();
    for (key, value) in pairs {
        if let Some(value) = value {
            out.push(if out.is_empty() { '?' } else { '&' });
            out.push_str(key);
            out.push('=');
            out.push_str(&encode(value));
        }
    }
    out
}

/// Percent-encode a query value.
fn encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

pub async fn list(State(state): State<AppState>, Ui(caller): Ui, Query(form): Query<RunsForm>) -> UiResult {
    crate::on_tenant!(&caller.tenant, tenant => {
        let created_after_ms = given(&form.created_after).map(|t| parse_utc("created after", &t)).transpose()?;
        let created_before_ms = given(&form.created_before).map(|t| parse_utc("created before", &t)).transpose()?;
        let query = ListQuery {
            status: given(&form.status),
            workflow: given(&form.workflow),
            created_after_ms,
            created_before_ms,
            limit: Some(RUNS_PAGE_ROWS.min(state.config.limits.page_size_max)),
            after: given(&form.after),
        };
        let api::RunsPage { runs, next_after, .. } = api::list_runs(&state, &caller, query).await?;
        let filters = [
            ("status", given(&form.status)),
            ("workflow", given(&form.workflow)),
            ("created_after", given(&form.created_after)),
            ("created_before", given(&form.created_before)),
        ];
        let mut next = filters.to_vec();
        next.push(("after", next_after.clone()));
        let selected = given(&form.status).unwrap_or_default();
        let workflow = given(&form.workflow).unwrap_or_default();
        let mut workflow_names: Vec<String> = tenant.workflows.infos().into_iter().map(|w| w.workflow).collect();
        workflow_names.dedup();
        let body = html! {
            h1 { "Runs" }
            form.filters method="get" action="/ui/runs" {
                label { "Status "
                    select name="status" {
                        option value="" selected[selected.is_empty()] { "any" }
                        @for status in RunStatus::ALL {
                            option value=(status.as_str()) selected[selected == status.as_str()] { (status.as_str()) }
                        }
                    }
                }
                label { "Workflow "
                    input type="text" name="workflow" value=(workflow) list="workflows" placeholder="any";
                    datalist #workflows { @for name in &workflow_names { option value=(name) {} } }
                }
                label { "Created after (UTC) " input type="datetime-local" name="created_after" value=[given(&form.created_after)]; }
                label { "Created before (UTC) " input type="datetime-local" name="created_before" value=[given(&form.created_before)]; }
                button type="submit" { "Filter" }
                a.button.secondary href="/ui/runs" { "Clear" }
            }
            @if runs.is_empty() {
                p.muted { "No runs match." }
            } @else {
                section.card { (runs_table(&runs)) }
            }
            nav.pager {
                @if form.after.is_some() { a href=(format!("/ui/runs{}", query_string(&filters))) { "« First page" } }
                @if next_after.is_some() { a href=(format!("/ui/runs{}", query_string(&next))) { "Next page »" } }
            }
        };
        Ok(page("Runs", Some(&Viewer::from(&caller)), body).into_response())
    })
}

fn runs_table(runs: &[RunRecord]) -> Markup {
    html! {
        table.runs {
            thead { tr { th { "Run" } th { "Workflow" } th { "Status" } th { "Created" } th { "Updated" } th { "Error" } } }
            tbody {
                @for run in runs {
                    tr {
                        td { a href=(format!("/ui/runs/{}", run.run_id)) { code { (run.run_id) } } }
                        td { (run.workflow) " v" (run.version) }
                        td { (badge(run.status.as_str())) }
                        td { (when(run.created_at_ms)) }
                        td { (when(run.updated_at_ms)) }
                        td.error { @if let Some(error) = &run.error { (error) } }
                    }
                }
            }
        }
    }
}

#[derive(Debug, Default, Deserialize)]
pub struct DoneQuery {
    pub done: Option<String>,
}

/// A run's page: the banner of the action just done, and where its journal page starts.
#[derive(Debug, Default, Deserialize)]
pub struct RunQuery {
    pub done: Option<String>,
    pub after_seq: Option<u32>,
    pub events_after: Option<String>,
}

pub async fn show(
    State(state): State<AppState>,
    Ui(caller): Ui,
    Path(run_id): Path<String>,
    Query(q): Query<RunQuery>,
) -> UiResult {
    let query = api::DetailQuery { after_seq: q.after_seq, events_after: q.events_after, limit: None };
    let detail = api::run_detail(&state, &caller, run_id, &query).await?;
    let body = timeline(&caller, &detail, q.done.as_deref());
    Ok(page(&format!("Run {}", detail.run.run_id), Some(&Viewer::from(&caller)), body).into_response())
}

fn step_kind(kind: StepKind) -> &'static str {
    match kind {
        StepKind::External => "external step",
        StepKind::Transactional => "transactional step",
        StepKind::Sleep => "timer",
        StepKind::Wait => "wait for event",
        StepKind::Compensation => "compensation",
        StepKind::Value => "recorded value",
        StepKind::Child => "child workflow",
        StepKind::Publish => "published event",
        StepKind::Send => "message sent",
    }
}

fn step_class(entry: &JournalEntry) -> String {
    let compensation = if entry.kind == StepKind::Compensation { " compensation" } else { "" };
    format!("step {}{compensation}", entry.status.as_str())
}

fn timeline(caller: &AnyCaller, detail: &RunDetail, done: Option<&str>) -> Markup {
    let run = &detail.run;
    let mut attempts: BTreeMap<u32, Vec<&AttemptRecord>> = BTreeMap::new();
    for attempt in &detail.attempts {
        attempts.entry(attempt.seq).or_default().push(attempt);
    }
    let can_operate = caller.scope.allows(Scope::Operate);
    let base = format!("/ui/runs/{}", run.run_id);
    let open_steps: Vec<&JournalEntry> = detail.journal.iter().filter(|e| !e.status.is_settled()).collect();
    // The position after this page's last (the journal's length on its last page).
    let end_of_page = detail.journal.last().map_or(0, |entry| entry.seq + 1);
    let first_of_page = detail.journal.first().map_or(0, |entry| entry.seq);
    html! {
        (done_banner(done))
        div.run-head {
            h1 { "Run " code { (run.run_id) } }
            (badge(run.status.as_str()))
            @if run.cancel_requested { " " (badge("cancel requested")) }
        }
        section.card {
            dl.facts {
                dt { "Workflow" } dd { (run.workflow) " v" (run.version) }
                dt { "Created" } dd { (when(run.created_at_ms)) }
                dt { "Updated" } dd { (when(run.updated_at_ms)) }
                @if let Some(key) = &run.key { dt { "Key" } dd { code { (key) } } }
                @if let Some(queue) = &run.queue {
                    dt { "Queue" } dd { a href="/ui/queues" { code { (queue) } } " priority " (run.priority.unwrap_or(0))
                        @if let Some(at) = run.admitted_at_ms { ", admitted " (when(at)) } @else { ", waiting" } }
                }
                @if let Some(parent) = &run.parent_run_id { dt { "Child of" } dd { a href=(format!("/ui/runs/{parent}")) { code { (parent) } } } }
                @if let Some(deadline) = run.deadline_ms { dt { "Deadline" } dd { (when(deadline)) } }
                @if run.status == RunStatus::Continued {
                    @let next = tidemark_core::workflow::continuation_run_id(&run.run_id);
                    dt { "Continued as" } dd { a href=(format!("/ui/runs/{next}")) { code { (next) } } }
                }
                @if let Some(from) = &run.forked_from { dt { "Forked from" } dd { a href=(format!("/ui/runs/{from}")) { code { (from) } } } }
                @if let Some(waiting) = &run.waiting_for { dt { "Waiting for event" } dd { code { (waiting) } " until " (when(run.wake_at_ms)) } }
                @if matches!(run.status, RunStatus::Sleeping | RunStatus::Pending) { dt { "Wakes" } dd { (when(run.wake_at_ms)) } }
                @if let Some(owner) = &run.lease_owner {
                    dt { "Lease" } dd { (owner) @if let Some(until) = run.lease_expires_at_ms { " until " (when(until)) } }
                }
                @if run.recoveries > 0 { dt { "Recoveries" } dd { (run.recoveries) } }
                @if let Some(error) = &run.error { dt { "Error" } dd.error { (error) } }
            }
            details { summary { "Input" } (json_block(&run.input)) }
            @if let Some(result) = &run.result { details open { summary { "Result" } (json_block(result)) } }
        }
        @if can_operate {
            section.card.actions {
                h2 { "Actions" }
                div.action-row {
                    @if matches!(run.status, RunStatus::Failed | RunStatus::Parked) {
                        form method="post" action=(format!("{base}/retry")) {
                            (reason_input("retried from the dashboard"))
                            button.primary type="submit" { "Retry" }
                        }
                    }
                    @if !run.status.is_terminal() {
                        form method="post" action=(format!("{base}/cancel")) {
                            (reason_input("cancelled from the dashboard"))
                            button.danger type="submit" { "Cancel" }
                        }
                    }
                    @if !run.status.is_terminal() || run.status == RunStatus::Parked {
                        form method="post" action=(format!("{base}/abandon")) {
                            (reason_input("abandoned from the dashboard"))
                            button.danger type="submit" { "Abandon" }
                        }
                    }
                    form method="post" action=(format!("{base}/fork")) {
                        label { "from step " input type="number" name="from_step" min="0" value=(end_of_page) required; }
                        input type="text" name="new_run_id" value=(format!("{}-fork", run.run_id)) required aria-label="new run id";
                        button type="submit" { "Fork" }
                    }
                    @if !open_steps.is_empty() {
                        form method="post" action=(format!("{base}/skip")) {
                            label { "step "
                                select name="step" {
                                    @for entry in &open_steps { option value=(entry.seq) { (entry.seq) ": " (entry.name) } }
                                }
                            }
                            input type="text" name="output" placeholder="output JSON (default null)" aria-label="output";
                            (reason_input("skipped from the dashboard"))
                            button type="submit" { "Skip" }
                        }
                    }
                }
            }
        }
        section.card {
            h2 { "Timeline" }
            @if detail.journal.is_empty() {
                p.muted { "No step journaled yet." }
            }
            @if first_of_page > 0 || detail.is_cut() {
                p.pager {
                    @if detail.journal.is_empty() {
                        "More events sent to the run. "
                    } @else {
                        "Steps " (first_of_page) " to " (end_of_page.saturating_sub(1)) ". "
                    }
                    @if first_of_page > 0 { a href=(base) { "First steps" } " " }
                    @if let Some(cursor) = &detail.next_events_after {
                        a href=(format!("{base}{}", query_string(&[
                            ("after_seq", detail.next_after_seq.map(|seq| seq.to_string())),
                            ("events_after", Some(cursor.clone())),
                        ]))) { "More events" }
                    } @else if let Some(after) = detail.next_after_seq {
                        a href=(format!("{base}?after_seq={after}")) { "Next steps" }
                    }
                }
            }
            ol.timeline {
                @for entry in &detail.journal {
                    li class=(step_class(entry)) {
                        div.step-head {
                            span.seq { (entry.seq) }
                            b { (entry.name) }
                            span.kind { (step_kind(entry.kind)) }
                            (badge(entry.status.as_str()))
                            @if entry.kind == StepKind::Child {
                                @let child = child_run_id(&run.run_id, entry.seq);
                                a href=(format!("/ui/runs/{child}")) { "run " code { (child) } }
                            }
                            @if !matches!(entry.kind, StepKind::Sleep | StepKind::Wait | StepKind::Child | StepKind::Value) {
                                span.muted { (entry.attempts) " attempt" @if entry.attempts != 1 { "s" } }
                            }
                        }
                        @if let Some(error) = &entry.error { p.error { (error) } }
                        @if let Some(reason) = &entry.reason { p.reason { "Operator: " (reason) } }
                        @if let Some(at) = entry.next_attempt_at_ms { @if entry.status == StepStatus::Retrying { p.muted { "Next attempt " (when(at)) } } }
                        @if let (Some(at), false) = (entry.wake_at_ms, entry.kind == StepKind::Child) {
                            p.muted { @if entry.kind == StepKind::Wait { "Times out " } @else { "Timer: wakes " } (when(at)) }
                        }
                        @if let (Some(name), false) = (&entry.event_name, entry.kind == StepKind::Child) { p.muted { "Waits for event " code { (name) } } }
                        @if let Some(list) = attempts.get(&entry.seq) {
                            details {
                                summary { (list.len()) " recorded attempt" @if list.len() != 1 { "s" } }
                                table.attempts {
                                    @for a in list {
                                        tr {
                                            td { "#" (a.attempt) }
                                            td { @if a.ok { (badge("completed")) } @else { (badge("failed")) } }
                                            td { (when(a.finished_at_ms)) }
                                            td.error { @if let Some(e) = &a.error { (e) } }
                                        }
                                    }
                                }
                            }
                        }
                        @if let Some(output) = &entry.output { details { summary { "Output" } (json_block(output)) } }
                    }
                }
            }
        }
        @if !detail.events.is_empty() {
            section.card {
                h2 { "Events received" }
                table {
                    thead { tr { th { "Event" } th { "Name" } th { "Received" } th { "Consumed by step" } th { "Payload" } } }
                    tbody {
                        @for event in &detail.events {
                            tr {
                                td { code { (event.event_id) } }
                                td { (event.name) }
                                td { (when(event.received_at_ms)) }
                                td { @if let Some(seq) = event.consumed_by_seq { (seq) } @else { "—" } }
                                td { (json_block(&event.payload)) }
                            }
                        }
                    }
                }
            }
        }
    }
}

#[derive(Deserialize)]
pub struct ReasonForm {
    pub reason: String,
}

async fn control(caller: AnyCaller, run_id: String, reason: String, which: Control) -> UiResult {
    let run = api::control(&caller, run_id, reason, which).await?;
    Ok(see_other(&format!("/ui/runs/{}?done={}", run.run_id, which.outcome())))
}

pub async fn cancel(Ui(caller): Ui, Path(run_id): Path<String>, Form(form): Form<ReasonForm>) -> UiResult {
    control(caller, run_id, form.reason, Control::Cancel).await
}

pub async fn retry(Ui(caller): Ui, Path(run_id): Path<String>, Form(form): Form<ReasonForm>) -> UiResult {
    control(caller, run_id, form.reason, Control::Retry).await
}

pub async fn abandon(Ui(caller): Ui, Path(run_id): Path<String>, Form(form): Form<ReasonForm>) -> UiResult {
    control(caller, run_id, form.reason, Control::Abandon).await
}

#[derive(Deserialize)]
pub struct ForkForm {
    pub from_step: u32,
    pub new_run_id: String,
}

pub async fn fork(Ui(caller): Ui, Path(run_id): Path<String>, Form(form): Form<ForkForm>) -> UiResult {
    let body = ForkBody { from_step: form.from_step, new_run_id: form.new_run_id.trim().to_string() };
    let run = api::fork_run(&caller, run_id, body).await?;
    Ok(see_other(&format!("/ui/runs/{}?done=forked", run.run_id)))
}

#[derive(Deserialize)]
pub struct SkipForm {
    pub step: u32,
    #[serde(default)]
    pub output: String,
    pub reason: String,
}

pub async fn skip(Ui(caller): Ui, Path(run_id): Path<String>, Form(form): Form<SkipForm>) -> UiResult {
    let output = if form.output.trim().is_empty() {
        Value::Null
    } else {
        let output = serde_json::from_str(&form.output)
            .map_err(|e| Error::invalid(codes::INVALID_ARGUMENT, format!("output is not JSON: {e}")))?;
        tidemark_core::json::check_numbers(form.output.as_bytes())?;
        output
    };
    let body = SkipBody { step: form.step, output, reason: form.reason };
    let run = api::skip_step(&caller, run_id, body).await?;
    Ok(see_other(&format!("/ui/runs/{}?done=skipped", run.run_id)))
}

/// Parked and failed runs (retry them) and blocked inbox records (skip them).
pub async fn dead_letters(State(state): State<AppState>, Ui(caller): Ui, Query(q): Query<DoneQuery>) -> UiResult {
    crate::on_tenant!(&caller.tenant, tenant => {
        let rows = Some(DEAD_LETTER_ROWS.min(state.config.limits.page_size_max));
        let mut runs = Vec::new();
        for status in [RunStatus::Parked, RunStatus::Failed] {
            let query = ListQuery {
                status: Some(status.as_str().into()),
                workflow: None,
                created_after_ms: None,
                created_before_ms: None,
                limit: rows,
                after: None,
            };
            runs.extend(api::list_runs(&state, &caller, query).await?.runs);
        }
        let tenant_id = tenant.id.clone();
        let mut blocked = Vec::new();
        for consumer in state.consumers(&tenant_id)? {
            let query = RecordsQuery { status: Some("blocked".into()), limit: rows };
            blocked.extend(crate::api::inbox::inbox_records(&state, &caller, consumer.consumer_id, query).await?.0);
        }
        let can_operate = caller.scope.allows(Scope::Operate);
        let body = html! {
            (done_banner(q.done.as_deref()))
            h1 { "Dead letters" }
            section.card {
                h2 { "Parked and failed runs" }
                @if runs.is_empty() {
                    p.muted { "None: no run waits for an operator." }
                } @else {
                    table.runs {
                        thead { tr { th { "Run" } th { "Workflow" } th { "Status" } th { "Updated" } th { "Error" } @if can_operate { th { "Action" } } } }
                        tbody {
                            @for run in &runs {
                                tr {
                                    td { a href=(format!("/ui/runs/{}", run.run_id)) { code { (run.run_id) } } }
                                    td { (run.workflow) }
                                    td { (badge(run.status.as_str())) }
                                    td { (when(run.updated_at_ms)) }
                                    td.error { @if let Some(error) = &run.error { (error) } }
                                    @if can_operate {
                                        td {
                                            form.inline method="post" action=(format!("/ui/runs/{}/retry", run.run_id)) {
                                                (reason_input("retried from the dashboard"))
                                                button.primary type="submit" { "Retry" }
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
            section.card {
                h2 { "Blocked inbox records" }
                @if blocked.is_empty() {
                    p.muted { "None: no flow is stopped by an event its consumer cannot apply." }
                } @else {
                    (super::flows::records_table(&blocked, can_operate, None))
                }
            }
        };
        Ok(page("Dead letters", Some(&Viewer::from(&caller)), body).into_response())
    })
}

/// `/ui/schedules`: every schedule with its timing, next tick and counters; pause and resume.
pub async fn schedules(Ui(caller): Ui, Query(q): Query<DoneQuery>) -> UiResult {
    let list = crate::api::schedules::schedules(&caller).await?;
    let can_operate = caller.scope.allows(Scope::Operate);
    let body = html! {
        h1 { "Schedules" }
        (done_banner(q.done.as_deref()))
        section.card {
            p { "Each tick starts run " code { "<schedule>:<tick ms>" } " of the schedule's workflow (once: a repeated start is the same run). "
                "Ticks more than 60 s late count as missed and follow the schedule's catch-up policy." }
            @if list.is_empty() {
                p.muted { "No schedules. Create one with " code { "PUT /v1/schedules/{id}" } " or " code { "tidemark schedule put" } "." }
            } @else {
                table {
                    thead { tr { th { "Schedule" } th { "Workflow" } th { "Timing" } th { "Catch-up" } th { "Next tick" }
                        th { "Last started" } th.num { "Started" } th.num { "Skipped" } th { "State" } @if can_operate { th { } } } }
                    tbody {
                        @for s in &list {
                            tr {
                                td { code { (s.spec.schedule_id) } }
                                td { (s.spec.workflow) }
                                td { @match &s.spec.timing {
                                    Timing::Cron(cron) => { code { (cron) } " " small.muted { (s.spec.timezone) } },
                                    Timing::IntervalMs(ms) => { "every " (ms) " ms" },
                                } }
                                td { (s.spec.catch_up.as_str()) }
                                td { @if let Some(at) = s.next_tick_at_ms { (when(at)) } @else { span.muted { "never" } } }
                                td { @if let Some(at) = s.last_started_tick_ms {
                                    a href=(format!("/ui/runs/{}", tick_run_id(&s.spec.schedule_id, at))) { (when(at)) } } }
                                td.num { (s.ticks_started) }
                                td.num { (s.ticks_skipped) }
                                td { @if s.paused { (badge("paused")) } @else { (badge("active")) } }
                                @if can_operate {
                                    td {
                                        @let action = if s.paused { "resume" } else { "pause" };
                                        form.inline method="post" action=(format!("/ui/schedules/{}/{action}", s.spec.schedule_id)) {
                                            button type="submit" { (if s.paused { "Resume" } else { "Pause" }) }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    };
    Ok(page("Schedules", Some(&Viewer::from(&caller)), body).into_response())
}

/// Pause a schedule from the dashboard.
pub async fn pause_schedule(Ui(caller): Ui, Path(schedule_id): Path<String>) -> UiResult {
    crate::api::schedules::set_paused(&caller, schedule_id, true).await?;
    Ok(see_other("/ui/schedules?done=paused"))
}

/// Resume a schedule from the dashboard.
pub async fn resume_schedule(Ui(caller): Ui, Path(schedule_id): Path<String>) -> UiResult {
    crate::api::schedules::set_paused(&caller, schedule_id, false).await?;
    Ok(see_other("/ui/schedules?done=resumed"))
}

/// `/ui/queues`: each queue's limits, runs in progress, admitted in the rate period, waiting, and
/// its next waiting runs with their positions.
pub async fn queues(Ui(caller): Ui) -> UiResult {
    let list = crate::api::queues::queues(&caller).await?;
    let mut detailed = Vec::with_capacity(list.len());
    for q in list {
        detailed.push(crate::api::queues::queue(&caller, q.spec.name.clone()).await?);
    }
    let body = html! {
        h1 { "Queues" }
        section.card {
            p { "A run started through a queue waits until a claim admits it, while the queue has room (its concurrency "
                "limit counts admitted runs not finished yet, across every worker; its rate limit counts admissions in the "
                "last period), by priority (lower first), then oldest first." }
            @if detailed.is_empty() { p.muted { "No queues." } }
        }
        @for q in &detailed {
            section.card {
                h2 { code { (q.spec.name) } }
                dl.facts {
                    dt { "Concurrency" } dd { @if let Some(n) = q.spec.concurrency_max { (q.in_progress) " of " (n) } @else { (q.in_progress) " (no limit)" } }
                    dt { "Rate" } dd { @if let Some(rate) = q.spec.rate { (q.admitted_in_period) " of " (rate.limit) " per " (rate.period_ms) " ms" } @else { "no limit" } }
                    dt { "Waiting" } dd { (q.waiting) }
                }
                @if !q.next.is_empty() {
                    table {
                        thead { tr { th.num { "Position" } th { "Run" } th { "Workflow" } th.num { "Priority" } th { "Started" } } }
                        tbody {
                            @for r in q.next.iter().take(20) {
                                tr {
                                    td.num { (r.position) }
                                    td { a href=(format!("/ui/runs/{}", r.run_id)) { code { (r.run_id) } } }
                                    td { (r.workflow) }
                                    td.num { (r.priority) }
                                    td { (when(r.created_at_ms)) }
                                }
                            }
                        }
                    }
                }
            }
        }
    };
    Ok(page("Queues", Some(&Viewer::from(&caller)), body).into_response())
}
