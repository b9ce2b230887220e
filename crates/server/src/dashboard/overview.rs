//! The overview: the counts an operator looks at first (outbox backlog, quarantine, blocked
//! inbox records, parked and failed runs, runs by status, throughput) and small charts of the
//! last minutes, drawn as inline SVG on the server from the sampler's ring buffer. The live
//! part refreshes itself every few seconds through htmx (`GET /ui/live`).

use axum::extract::State;
use axum::response::IntoResponse;
use maud::{html, Markup};
use tidemark_core::tenancy::Scope;

use super::layout::{count, when};
use super::sampler::{rates, recent_rate, Sample, SAMPLE_INTERVAL_MS};
use super::{Ui, UiResult, Viewer};
use crate::stats::TenantStats;
use crate::AnyCaller;
use crate::AppState;

/// The throughput figures average the last minute.
const RATE_WINDOW_MS: i64 = 60_000;

pub async fn page_handler(state: &AppState, caller: &AnyCaller) -> UiResult<Markup> {
    crate::on_tenant!(&caller.tenant, tenant => {
        caller.require(Scope::Read)?;
        let stats = TenantStats::read(tenant).await?;
        let series = state.samples.series(&tenant.id);
        Ok(live_section(&stats, &series))
    })
}

pub async fn page(State(state): State<AppState>, Ui(caller): Ui) -> UiResult {
    let live = page_handler(&state, &caller).await?;
    let body = html! {
        h1 { "Overview" }
        (live)
    };
    Ok(super::layout::page("Overview", Some(&Viewer::from(&caller)), body).into_response())
}

/// The live section alone (htmx swaps it in place).
pub async fn live(State(state): State<AppState>, Ui(caller): Ui) -> UiResult {
    Ok(page_handler(&state, &caller).await?.into_response())
}

fn live_section(stats: &TenantStats, series: &[Sample]) -> Markup {
    let applies_rate = recent_rate(series, RATE_WINDOW_MS, |s| s.applied_total);
    let completed_rate = recent_rate(series, RATE_WINDOW_MS, |s| s.completed_runs);
    let rate = |r: Option<f64>| r.map_or_else(|| "…".to_string(), |r| format!("{r:.1}"));
    let runs_total: u64 = stats.runs.values().sum();
    html! {
        div #live hx-get="/ui/live" hx-trigger="every 5s" hx-swap="outerHTML" {
            section.tiles {
                (tile("Outbox backlog", count(stats.outbox.pending), &format!("{} due now", count(stats.outbox.due)),
                    stats.outbox.pending > 0, "/ui/quarantine"))
                (tile("Quarantined deliveries", count(stats.outbox.quarantined), "need an operator",
                    stats.outbox.quarantined > 0, "/ui/quarantine"))
                (tile("Blocked inbox records", count(stats.blocked()), "stop their flow",
                    stats.blocked() > 0, "/ui/dead-letters"))
                (tile("Parked / failed runs", count(stats.parked()), "dead letters",
                    stats.parked() > 0, "/ui/dead-letters"))
                (tile("Applies / s", rate(applies_rate), "last minute", false, "/ui/flows"))
                (tile("Runs completed / s", rate(completed_rate), "last minute", false, "/ui/runs?status=completed"))
            }
            @if let Some(oldest) = stats.outbox.oldest_pending_ms {
                p.muted { "Oldest undelivered event committed " (when(oldest)) "." }
            }
            section.charts {
                (chart("Outbox backlog", &series.iter().map(|s| s.backlog as f64).collect::<Vec<_>>(), "events"))
                (chart("Applies / s", &rates(series, |s| s.applied_total), "per second"))
                (chart("Runs completed / s", &rates(series, |s| s.completed_runs), "per second"))
                (chart("Parked runs + blocked records", &series.iter().map(|s| (s.parked + s.blocked) as f64).collect::<Vec<_>>(), "open"))
            }
            p.muted.small {
                "Charts: one sample every " (SAMPLE_INTERVAL_MS / 1000) " s, the last " (series.len()) " kept in memory; "
                "this section refreshes every 5 s."
            }
            div.columns {
                section.card {
                    h2 { "Runs by status" }
                    @if stats.runs.is_empty() {
                        p.muted { "No runs yet." }
                    } @else {
                        table {
                            thead { tr { th { "Status" } th.num { "Runs" } } }
                            tbody {
                                @for (status, n) in &stats.runs {
                                    tr {
                                        td { a href=(format!("/ui/runs?status={status}")) { (super::layout::badge(status)) } }
                                        td.num { (count(*n)) }
                                    }
                                }
                            }
                            tfoot { tr { th { "Total" } th.num { (count(runs_total)) } } }
                        }
                    }
                }
                section.card {
                    h2 { "Inbox by consumer" }
                    @if stats.inbox.is_empty() {
                        p.muted { "No open inbox records." }
                    } @else {
                        table {
                            thead { tr { th { "Consumer" } th.num { "Pending" } th.num { "Blocked" } } }
                            tbody {
                                @for (consumer, c) in &stats.inbox {
                                    tr { td { (consumer) } td.num { (count(c.pending)) } td.num { (count(c.blocked)) } }
                                }
                            }
                        }
                    }
                    h2 { "WAL size" }
                    table {
                        tbody {
                            @for (file, bytes) in &stats.wal_bytes {
                                tr { td { code { (file) } } td.num { (count(*bytes / 1024)) " KiB" } }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn tile(label: &str, value: String, note: &str, alarm: bool, href: &str) -> Markup {
    html! {
        a.tile.alarm[alarm] href=(href) {
            span.label { (label) }
            span.value { (value) }
            span.note { (note) }
        }
    }
}

/// Chart size in SVG units (scaled by CSS).
const CHART_WIDTH: f64 = 300.0;
const CHART_HEIGHT: f64 = 70.0;

/// A small line chart of `values` (oldest first), scaled to its own maximum.
pub fn chart(title: &str, values: &[f64], unit: &str) -> Markup {
    let max = values.iter().copied().fold(0.0_f64, f64::max);
    let last = values.last().copied();
    let scale_max = if max > 0.0 { max } else { 1.0 };
    let step = if values.len() > 1 { CHART_WIDTH / (values.len() - 1) as f64 } else { 0.0 };
    let points: Vec<(f64, f64)> = values
        .iter()
        .enumerate()
        .map(|(i, v)| (i as f64 * step, CHART_HEIGHT - 4.0 - (v / scale_max) * (CHART_HEIGHT - 8.0)))
        .collect();
    let line = points.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect::<Vec<_>>().join(" ");
    let area = if points.len() > 1 {
        format!("0,{CHART_HEIGHT} {line} {:.1},{CHART_HEIGHT}", points.last().map_or(0.0, |p| p.0))
    } else {
        String::new()
    };
    let number = |v: f64| if v.fract() == 0.0 { format!("{v:.0}") } else { format!("{v:.1}") };
    html! {
        figure.chart {
            figcaption {
                span { (title) }
                span.last { @if let Some(v) = last { (number(v)) " " small { (unit) } } @else { "…" } }
            }
            svg viewBox=(format!("0 0 {CHART_WIDTH} {CHART_HEIGHT}")) preserveAspectRatio="none" role="img"
                aria-label=(format!("{title}: {} samples, max {}", values.len(), number(max))) {
                title { (title) ", max " (number(max)) }
                line.grid x1="0" y1=(CHART_HEIGHT - 4.0) x2=(CHART_WIDTH) y2=(CHART_HEIGHT - 4.0) {}
                @if values.len() > 1 {
                    polygon.area points=(area) {}
                    polyline.line points=(line) {}
                } @else {
                    text x="8" y="40" { "collecting samples…" }
                }
            }
            div.scale { span { "max " (number(max)) } span { (values.len()) " samples" } }
        }
    }
}
