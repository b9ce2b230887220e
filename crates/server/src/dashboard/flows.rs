//! Flows and deliveries: a flow's producer seq and state against each consumer's high-water
//! mark (its lag, the gaps above the mark, the blocked record and why); the quarantine
//! (requeue or dismiss a delivery); and skipping a blocked inbox record. Reads and actions go
//! through the JSON API's shared functions.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use maud::{html, Markup};
use serde::Deserialize;
use tidemark_core::id::validate_id;
use tidemark_core::store::{DeliveryAction, InboxEntry, InboxStatus};
use tidemark_core::tenancy::Scope;

use super::layout::{badge, done_banner, json_block, page, reason_input, when};
use super::runs::DoneQuery;
use super::{see_other, Form, Path, Query, Ui, UiResult, Viewer};
use crate::api::flows::{self as api, FlowConsumer, OutboxQuery, ResolveBody};
use crate::api::inbox::{self as inbox_api, SkipRecordBody as SkipBody};
use crate::AppState;

/// Rows of the quarantine page.
const QUARANTINE_ROWS: usize = 100;
/// Gap ranges shown per consumer.
const GAP_RANGES_MAX: usize = 20;

#[derive(Debug, Default, Deserialize)]
pub struct LookupQuery {
    pub flow_id: Option<String>,
}

pub async fn lookup(Ui(caller): Ui, Query(q): Query<LookupQuery>) -> UiResult {
    caller.require(Scope::Read)?;
    if let Some(flow_id) = q.flow_id.as_deref().map(str::trim).filter(|f| !f.is_empty()) {
        validate_id("flow_id", flow_id)?;
        return Ok(see_other(&format!("/ui/flows/{flow_id}")));
    }
    let body = html! {
        h1 { "Flows" }
        section.card {
            p { "A flow's producer seq and state, each consumer's high-water mark, the gaps above it and "
                "why a record is blocked." }
            form.filters method="get" action="/ui/flows" {
                label { "Flow id " input type="text" name="flow_id" required autofocus placeholder="order-1"; }
                button type="submit" { "Open" }
            }
        }
    };
    Ok(page("Flows", Some(&Viewer::from(&caller)), body).into_response())
}

/// Ranges of seqs above `high_water_seq` (up to `last_seq`) that the consumer does not hold:
/// `(first, last, received_above)`; `received_above` says a later seq already arrived (a
/// gap that holds records back) rather than seqs still on their way.
fn gaps(high_water_seq: i64, open: &[InboxEntry], last_seq: i64) -> Vec<(i64, i64, bool)> {
    let mut seqs: Vec<i64> = open.iter().map(|r| r.envelope.seq).collect();
    seqs.sort_unstable();
    seqs.dedup();
    let mut out = Vec::new();
    let mut next = high_water_seq + 1;
    for seq in seqs {
        if seq > next {
            out.push((next, seq - 1, true));
        }
        next = next.max(seq + 1);
    }
    if next <= last_seq {
        out.push((next, last_seq, false));
    }
    out
}

pub async fn show(
    State(state): State<AppState>,
    Ui(caller): Ui,
    Path(flow_id): Path<String>,
    Query(q): Query<DoneQuery>,
) -> UiResult {
    let view = api::flow_view(&state, &caller, flow_id).await?;
    let last_seq = view.producer.as_ref().map_or(0, |p| p.last_seq);
    let can_operate = caller.scope.allows(Scope::Operate);
    let body = html! {
        (done_banner(q.done.as_deref()))
        h1 { "Flow " code { (view.flow_id) } }
        section.card {
            h2 { "Producer" }
            @if let Some(producer) = &view.producer {
                dl.facts {
                    dt { "Source" } dd { (view.source) }
                    dt { "Seq" } dd.big { (producer.last_seq) }
                    dt { "State" } dd { (badge(&producer.state.state)) }
                    @if let Some(machine) = &view.machine { dt { "Machine" } dd { code { (machine) } } }
                }
                details { summary { "State data" } (json_block(&producer.state.data)) }
            } @else {
                p.muted { "The producer holds no record of this flow (pruned, or it came from elsewhere)." }
            }
        }
        section.card {
            h2 { "Consumers" }
            @if view.consumers.is_empty() {
                p.muted { "No consumer is declared." }
            } @else {
                table {
                    thead { tr { th { "Consumer" } th { "Handler" } th.num { "High-water seq" } th.num { "Behind" } th { "Open records" } } }
                    tbody {
                        @for c in &view.consumers {
                            tr {
                                td { b { (c.consumer_id) } }
                                td { (c.handler) }
                                td.num { (c.high_water_seq) }
                                td.num { ((last_seq - c.high_water_seq).max(0)) }
                                td {
                                    @if c.open.is_empty() { span.muted { "none" } }
                                    @else { (c.open.len()) " (" (c.open.iter().filter(|r| r.status == InboxStatus::Blocked).count()) " blocked)" }
                                }
                            }
                        }
                    }
                }
            }
        }
        @for c in &view.consumers {
            (consumer_detail(c, last_seq, can_operate, &view.flow_id))
        }
    };
    Ok(page(&format!("Flow {}", view.flow_id), Some(&Viewer::from(&caller)), body).into_response())
}

fn consumer_detail(c: &FlowConsumer, last_seq: i64, can_operate: bool, flow_id: &str) -> Markup {
    let gaps = gaps(c.high_water_seq, &c.open, last_seq);
    let blocked: Vec<&InboxEntry> = c.open.iter().filter(|r| r.status == InboxStatus::Blocked).collect();
    if c.open.is_empty() && gaps.is_empty() {
        return html! {};
    }
    html! {
        section.card {
            h2 { "Consumer " (c.consumer_id) ": above seq " (c.high_water_seq) }
            @for record in &blocked {
                p.flash.bad { "Blocked at seq " (record.envelope.seq) " (" code { (record.envelope.event_id) } "): "
                    (record.reason.as_deref().unwrap_or("no reason recorded")) ". The flow waits until it is applied or skipped." }
            }
            @if !gaps.is_empty() {
                p { "Missing seqs: "
                    @for (i, (first, last, received_above)) in gaps.iter().take(GAP_RANGES_MAX).enumerate() {
                        @if i > 0 { ", " }
                        span class=(if *received_above { "gap held" } else { "gap" }) title=(if *received_above { "a later seq arrived: records above wait for this" } else { "not received yet (in the outbox or in flight)" }) {
                            @if first == last { (first) } @else { (first) "–" (last) }
                        }
                    }
                    @if gaps.len() > GAP_RANGES_MAX { " …" }
                }
            }
            @if !c.open.is_empty() {
                (records_table(&c.open, can_operate, Some(flow_id)))
            }
        }
    }
}

/// Inbox records with, for a blocked one, its reason and (for an operator) a skip button.
pub fn records_table(records: &[InboxEntry], can_operate: bool, flow_id: Option<&str>) -> Markup {
    html! {
        table.records {
            thead { tr { th { "Consumer" } th { "Flow" } th.num { "Seq" } th { "Event" } th { "Type" } th { "Status" } th { "Reason" } th { "Received" } @if can_operate { th { "Action" } } } }
            tbody {
                @for r in records {
                    tr {
                        td { (r.consumer_id) }
                        td { a href=(format!("/ui/flows/{}", r.envelope.flow_id)) { code { (r.envelope.flow_id) } } }
                        td.num { (r.envelope.seq) }
                        td { code { (r.envelope.event_id) } }
                        td { (r.envelope.event_type) " v" (r.envelope.schema_version) }
                        td { (badge(r.status.as_str())) }
                        td.error { @if let Some(reason) = &r.reason { (reason) } }
                        td { (when(r.received_at_ms)) }
                        @if can_operate {
                            td {
                                @if r.status == InboxStatus::Blocked {
                                    form.inline method="post" action=(format!("/ui/consumers/{}/inbox/{}/skip", r.consumer_id, r.envelope.event_id)) {
                                        @if let Some(flow) = flow_id { input type="hidden" name="flow_id" value=(flow); }
                                        (reason_input("skipped from the dashboard"))
                                        button.danger type="submit" { "Skip" }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

pub async fn quarantine(State(state): State<AppState>, Ui(caller): Ui, Query(q): Query<DoneQuery>) -> UiResult {
    let rows = Some(QUARANTINE_ROWS.min(state.config.limits.page_size_max));
    let quarantined =
        api::deliveries(&state, &caller, OutboxQuery { status: Some("quarantined".into()), limit: rows }).await?;
    let can_operate = caller.scope.allows(Scope::Operate);
    let body = html! {
        (done_banner(q.done.as_deref()))
        h1 { "Quarantine" }
        section.card {
            p { "Deliveries that failed " code { "relay.max_attempts" } " times wait here; they are never acknowledged. "
                "Requeue delivers again with a fresh attempt budget; dismiss stops delivering that event to that consumer "
                "(recorded with the reason)." }
            @if quarantined.is_empty() {
                p.muted { "Nothing is quarantined." }
            } @else {
                table {
                    thead { tr { th { "Event" } th { "Flow" } th.num { "Seq" } th { "Consumer" } th.num { "Attempts" } th { "Last error" } th { "Since" } @if can_operate { th { "Action" } } } }
                    tbody {
                        @for d in &quarantined {
                            tr {
                                td { code { (d.event_id) } }
                                td { a href=(format!("/ui/flows/{}", d.flow_id)) { code { (d.flow_id) } } }
                                td.num { (d.seq) }
                                td { (d.consumer_id) }
                                td.num { (d.attempts) }
                                td.error { @if let Some(e) = &d.last_error { (e) } }
                                td { (when(d.updated_at_ms)) }
                                @if can_operate {
                                    td {
                                        form.inline method="post" action=(format!("/ui/outbox/{}/{}/resolve", d.event_id, d.consumer_id)) {
                                            (reason_input("resolved from the dashboard"))
                                            button.primary type="submit" name="action" value="requeue" { "Requeue" }
                                            button.danger type="submit" name="action" value="dismiss" { "Dismiss" }
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
    Ok(page("Quarantine", Some(&Viewer::from(&caller)), body).into_response())
}

#[derive(Deserialize)]
pub struct ResolveForm {
    pub action: DeliveryAction,
    pub reason: String,
}

pub async fn resolve(
    Ui(caller): Ui,
    Path((event_id, consumer_id)): Path<(String, String)>,
    Form(form): Form<ResolveForm>,
) -> UiResult {
    let done = match form.action {
        DeliveryAction::Requeue => "requeue",
        DeliveryAction::Dismiss => "dismiss",
    };
    let body = ResolveBody { action: form.action, reason: form.reason };
    api::resolve_delivery(&caller, event_id, consumer_id, body).await?;
    Ok(see_other(&format!("/ui/quarantine?done={done}")))
}

#[derive(Deserialize)]
pub struct SkipRecordForm {
    pub reason: String,
    /// Back to this flow's page (else the dead letters page).
    pub flow_id: Option<String>,
}

pub async fn skip_record(
    State(state): State<AppState>,
    Ui(caller): Ui,
    Path((consumer_id, event_id)): Path<(String, String)>,
    Form(form): Form<SkipRecordForm>,
) -> UiResult<Response> {
    if let Some(flow_id) = &form.flow_id {
        validate_id("flow_id", flow_id)?;
    }
    let record =
        inbox_api::skip_record(&state, &caller, consumer_id, event_id, SkipBody { reason: form.reason }).await?;
    Ok(match form.flow_id {
        Some(_) => see_other(&format!("/ui/flows/{}?done=record_skipped", record.envelope.flow_id)),
        None => see_other("/ui/dead-letters?done=record_skipped"),
    })
}

/// Every subscription of the tenant's outboxes: where its events go (kind, masked endpoint),
/// its lag, and for a network endpoint its relay lane.
pub async fn subscriptions(Ui(caller): Ui) -> UiResult {
    let views = crate::api::subscriptions::views(&caller).await?;
    let body = html! {
        h1 { "Subscriptions" }
        section.card {
            p { "Where each outbox's events go. File endpoints are the tenant's own consumers; network endpoints "
                "(another tidemark over HTTP, NATS JetStream, RabbitMQ) each have a relay lane of their own, so a slow "
                "or unreachable one delays only itself. Pending counts are read among the first 1,000 pending deliveries." }
            @if views.is_empty() {
                p.muted { "No subscriptions." }
            } @else {
                table {
                    thead { tr { th { "Outbox" } th { "Consumer" } th { "Kind" } th { "Endpoint" } th.num { "Pending" }
                        th { "Oldest pending" } th { "Lane" } th.num { "Delivered" } th.num { "Failed" } th { "Last error" } } }
                    tbody {
                        @for v in &views {
                            tr {
                                td { (v.outbox) }
                                td { code { (v.consumer_id) } }
                                td { @if let Some(kind) = v.kind { (badge(kind.as_str())) } @else { (badge("invalid")) } }
                                td { code { (v.endpoint) } }
                                td.num { (v.pending) @if v.pending_capped { "+" } }
                                td { @if let Some(ms) = v.oldest_pending_at_ms { (when(ms)) } }
                                @if let Some(lane) = &v.lane {
                                    td { @if lane.in_flight { "in flight" } @else { "idle" }
                                        @if let Some(ms) = lane.last_batch_ms { small { " (last batch " (ms) " ms)" } } }
                                    td.num { (lane.delivered) }
                                    td.num { (lane.failed) }
                                    td.error { @if let Some(e) = &lane.last_error { (e) } }
                                } @else {
                                    td.muted { "-" } td.num { } td.num { } td { }
                                }
                            }
                        }
                    }
                }
            }
        }
    };
    Ok(page("Subscriptions", Some(&Viewer::from(&caller)), body).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidemark_core::Envelope;

    fn open(seq: i64) -> InboxEntry {
        InboxEntry {
            consumer_id: "c".into(),
            envelope: Envelope {
                event_id: format!("e{seq}"),
                source: "s".into(),
                generation: "g".into(),
                flow_id: "f".into(),
                seq,
                event_type: "t".into(),
                schema_version: 1,
                payload: serde_json::Value::Null,
                created_at_ms: 0,
                traceparent: None,
            },
            content_hash: String::new(),
            status: InboxStatus::Pending,
            reason: None,
            received_at_ms: 0,
        }
    }

    #[test]
    fn gaps_tell_held_back_from_in_flight() {
        assert_eq!(gaps(2, &[], 2), vec![]);
        assert_eq!(gaps(2, &[], 5), vec![(3, 5, false)]);
        assert_eq!(gaps(2, &[open(5), open(3), open(8)], 9), vec![(4, 4, true), (6, 7, true), (9, 9, false)]);
        assert_eq!(gaps(0, &[open(1), open(2)], 2), vec![]);
    }
}
