//! The page frame (header, navigation, who is logged in) and small shared pieces: status
//! badges, times, JSON blocks, and the banner that says what an action did.

use maud::{html, Markup, DOCTYPE};
use serde_json::Value;

use super::assets;
use super::time::{format_utc, relative};
use super::Viewer;
use crate::now_ms;

/// A whole page.
pub fn page(title: &str, viewer: Option<&Viewer>, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · tidemark" }
                link rel="stylesheet" href=(assets::css_path());
                script src=(assets::HTMX_PATH) defer {}
            }
            body {
                header.top {
                    a.brand href="/ui" { "tidemark" }
                    nav {
                        a href="/ui" { "Overview" }
                        a href="/ui/runs" { "Runs" }
                        a href="/ui/schedules" { "Schedules" }
                        a href="/ui/queues" { "Queues" }
                        a href="/ui/flows" { "Flows" }
                        a href="/ui/quarantine" { "Quarantine" }
                        a href="/ui/subscriptions" { "Subscriptions" }
                        a href="/ui/dead-letters" { "Dead letters" }
                    }
                    @if let Some(viewer) = viewer {
                        div.who {
                            span { "tenant " b { (viewer.tenant) } " · " (viewer.scope.as_str()) }
                            form.inline method="post" action="/ui/logout" {
                                button.link type="submit" { "Log out" }
                            }
                        }
                    }
                }
                main { (body) }
            }
        }
    }
}

/// A run, delivery or record status as a coloured badge.
pub fn badge(status: &str) -> Markup {
    let tone = match status {
        "completed" | "applied" | "accepted" | "committed" => "good",
        "failed" | "parked" | "blocked" | "quarantined" => "bad",
        "compensating" | "compensated" | "cancelled" | "retrying" | "skipped" | "dismissed" => "warn",
        _ => "info",
    };
    html! { span class=(format!("badge {tone}")) { (status) } }
}

/// A time as UTC with how long ago, in a `<time>` element.
pub fn when(ms: i64) -> Markup {
    html! { time title=(format!("{ms} ms since the epoch")) { (format_utc(ms)) " " small { "(" (relative(ms, now_ms())) ")" } } }
}

/// A JSON value, pretty-printed (escaped like every other splice).
pub fn json_block(value: &Value) -> Markup {
    let text = serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string());
    html! { pre.json { (text) } }
}

/// The banner after an action redirected back (`?done=<outcome>`): only known outcomes are
/// shown, with fixed text, so a crafted link cannot put words on the page.
pub fn done_banner(done: Option<&str>) -> Markup {
    let text = match done {
        Some("cancel_requested") => "Cancel requested: the run compensates or stops at its next step.",
        Some("retried") => "Run retried: it is pending again and a worker will pick it up.",
        Some("abandoned") => "Run abandoned: it is cancelled and will not run again.",
        Some("forked") => "Run forked: this is the new run.",
        Some("skipped") => "Step skipped: the run goes on from the next step.",
        Some("requeue") => "Delivery requeued: the relay delivers it again with a fresh attempt budget.",
        Some("dismiss") => "Delivery dismissed: it will not be delivered to this consumer.",
        Some("record_skipped") => "Record skipped: the flow goes on from the next seq.",
        _ => return html! {},
    };
    html! { p.flash.good role="status" { (text) } }
}

/// A number with thousands separators.
pub fn count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A reason field (required, like the API's `reason`), prefilled.
pub fn reason_input(default: &str) -> Markup {
    html! {
        input type="text" name="reason" value=(default) required maxlength=(tidemark_core::limits::REASON_BYTES_MAX)
            aria-label="reason" title="reason (recorded with the change)";
    }
}
