//! `--server URL --token T` (or `TIDEMARK_SERVER` / `TIDEMARK_TOKEN`): the subcommands that have
//! an HTTP route send it to a running `tidemark serve` instead of opening files.
//!
//! Arguments are validated here first (ids, reasons, JSON), so bad input exits 2 without a
//! request. The server's JSON answer is printed as it is (list and show answers get the
//! `outcome` word the file mode prints). An error answer keeps its stable code: a 4xx exits 2,
//! a 5xx or an unreachable server exits 1. Which flag goes to which route: docs/cli.md.

use std::io::Read;
use std::time::Duration;

use reqwest::blocking::Client;
use reqwest::Method;
use serde_json::{json, Map, Value};
use tidemark_core::error::codes;
use tidemark_core::id::{validate_id, validate_limit, validate_reason};
use tidemark_core::limits::PAGE_SIZE_MAX;
use tidemark_core::workflow::RunDetail;
use tidemark_core::{Error, Result};

use crate::queue_cmd::QueueCommand;
use crate::schedule_cmd::ScheduleCommand;
use crate::workflow_cmd::WorkflowCommand;
use crate::{ActionArg, Command, InboxCommand, OutboxCommand};

/// How long one request may take, connecting included.
pub const REQUEST_TIMEOUT_MS: u64 = 60_000;
/// Largest answer body read from the server: a page at the largest `limits.page_bytes_max` a
/// server takes (256 MiB), with room for its first item, which always goes.
pub const ANSWER_BYTES_MAX: u64 = 320 * 1024 * 1024;

pub struct Remote {
    base: String,
    token: Option<String>,
    client: Client,
}

fn invalid(message: impl Into<String>) -> Error {
    Error::invalid(codes::INVALID_ARGUMENT, message)
}

/// The server's stable code as the `&'static str` an [`Error`] carries. Leaked: it is made once,
/// for the one error the process prints before it exits.
fn static_code(code: &str) -> &'static str {
    Box::leak(code.to_string().into_boxed_str())
}

impl Remote {
    pub fn new(server: &str, token: Option<String>) -> Result<Remote> {
        let base = server.trim_end_matches('/').to_string();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(invalid(format!("--server must be an http:// or https:// URL, got {server:?}")));
        }
        let client = Client::builder()
            .timeout(Duration::from_millis(REQUEST_TIMEOUT_MS))
            .build()
            .map_err(|e| Error::io(format!("cannot build the HTTP client: {e}")))?;
        Ok(Remote { base, token, client })
    }

    /// One request; the answer's JSON, or its error with the server's code.
    pub fn send(&self, method: Method, path: &str, query: &[(&str, String)], body: Option<Value>) -> Result<Value> {
        let url = format!("{}{path}", self.base);
        let mut request = self.client.request(method, &url).query(query);
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        if let Some(body) = &body {
            request = request.json(body);
        }
        let response = request.send().map_err(|e| Error::io(format!("cannot reach {url}: {e}")))?;
        let status = response.status();
        let (bytes, answer) = read_answer(response, ANSWER_BYTES_MAX, status.is_success(), &url)?;
        let error = answer.as_ref().and_then(|a| a.get("error")).and_then(Value::as_object);
        match (status.as_u16(), error) {
            (200..=299, None) => Ok(answer.unwrap_or(Value::Null)),
            // 409 with an outcome (`stale`, `conflict`, ...) is an answer, like in the file mode.
            (409, None) if answer.as_ref().is_some_and(|a| a.get("outcome").is_some()) => {
                Ok(answer.unwrap_or(Value::Null))
            }
            (status_code, error) => {
                let code = error.and_then(|e| e.get("code")).and_then(Value::as_str);
                let message = error
                    .and_then(|e| e.get("message"))
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .unwrap_or_else(|| format!("HTTP {status} from {url}: {}", String::from_utf8_lossy(&bytes)));
                if (400..500).contains(&status_code) {
                    Err(Error::invalid(code.map_or(codes::INVALID_ARGUMENT, static_code), message))
                } else {
                    Err(Error::Store { code: code.map_or(codes::IO, static_code), message })
                }
            }
        }
    }
}

/// `outcome` for answers that have none (lists and reads), as the file mode prints them.
fn with_outcome(mut answer: Value, word: &str) -> Value {
    if let Some(object) = answer.as_object_mut() {
        object.entry("outcome").or_insert_with(|| json!(word));
    }
    answer
}

/// A path segment: an id, validated, so it never changes the route.
fn segment<'a>(field: &str, value: &'a str) -> Result<&'a str> {
    validate_id(field, value)?;
    Ok(value)
}

fn no_route(command: &str) -> Error {
    invalid(format!(
        "`tidemark {command}` works on files and has no server route; drop --server (and TIDEMARK_SERVER) to use it"
    ))
}

fn limit_query(query: &mut Vec<(&str, String)>, limit: usize) -> Result<()> {
    validate_limit("--limit", limit, PAGE_SIZE_MAX)?;
    query.push(("limit", limit.to_string()));
    Ok(())
}

/// Run a command against the server.
pub fn run(remote: &Remote, command: Command) -> Result<Value> {
    match command {
        Command::Advance(args) => {
            let flow = segment("flow_id", &args.flow)?;
            let mut body = Map::new();
            body.insert("expected_seq".into(), json!(args.expected_seq));
            body.insert("to".into(), json!(args.to));
            if let Some(quantity) = args.quantity {
                body.insert("quantity".into(), json!(quantity));
            }
            body.insert("schema_version".into(), json!(args.schema_version));
            remote.send(Method::POST, &format!("/v1/flows/{flow}/advance"), &[], Some(Value::Object(body)))
        }
        Command::Receive(args) => {
            let consumer = segment("consumer_id", &args.consumer_id)?;
            let envelope = crate::read_envelope(args.file.as_deref())?;
            let body = serde_json::to_value(&envelope).expect("envelopes serialise");
            remote.send(Method::POST, &format!("/v1/consumers/{consumer}/inbox"), &[], Some(body))
        }
        Command::Outbox(OutboxCommand::List { status, limit, .. }) => {
            let mut query = Vec::new();
            if let Some(status) = status {
                query.push(("status", status));
            }
            limit_query(&mut query, limit)?;
            Ok(with_outcome(remote.send(Method::GET, "/v1/outbox", &query, None)?, "listed"))
        }
        Command::Outbox(OutboxCommand::Resolve { event, consumer_id, action, reason, .. }) => {
            let (event, consumer) = (segment("event_id", &event)?, segment("consumer_id", &consumer_id)?);
            validate_reason(&reason)?;
            let action = match action {
                ActionArg::Requeue => "requeue",
                ActionArg::Dismiss => "dismiss",
            };
            let body = json!({"action": action, "reason": reason});
            remote.send(Method::POST, &format!("/v1/outbox/{event}/{consumer}/resolve"), &[], Some(body))
        }
        Command::Outbox(OutboxCommand::RotateGeneration { .. }) => Err(no_route("outbox rotate-generation")),
        Command::Outbox(OutboxCommand::Redeliver { consumer_id, from_event, all, .. }) => {
            let consumer = segment("consumer_id", &consumer_id)?;
            let body = match from_event {
                Some(event) => {
                    validate_id("event_id", &event)?;
                    json!({"from_event": event})
                }
                None if all => json!({"all": true}),
                None => return Err(invalid("outbox redeliver needs --from-event ID or --all")),
            };
            remote.send(Method::POST, &format!("/v1/outbox/redeliver/{consumer}"), &[], Some(body))
        }
        Command::Inbox(InboxCommand::List { consumer_id, status, limit, .. }) => {
            let consumer = segment("consumer_id", &consumer_id)?;
            let mut query = Vec::new();
            if let Some(status) = status {
                query.push(("status", status));
            }
            limit_query(&mut query, limit)?;
            let answer = remote.send(Method::GET, &format!("/v1/consumers/{consumer}/inbox"), &query, None)?;
            Ok(with_outcome(answer, "listed"))
        }
        Command::Inbox(InboxCommand::Skip { consumer_id, event, reason, .. }) => {
            let (consumer, event) = (segment("consumer_id", &consumer_id)?, segment("event_id", &event)?);
            validate_reason(&reason)?;
            let path = format!("/v1/consumers/{consumer}/inbox/{event}/skip");
            remote.send(Method::POST, &path, &[], Some(json!({"reason": reason})))
        }
        Command::Inbox(InboxCommand::Cursors { consumer_id, .. }) => {
            let consumer_id = consumer_id.ok_or_else(|| invalid("with --server, inbox cursors needs --consumer-id"))?;
            let consumer = segment("consumer_id", &consumer_id)?;
            let answer = remote.send(Method::GET, &format!("/v1/consumers/{consumer}/cursors"), &[], None)?;
            Ok(with_outcome(answer, "listed"))
        }
        Command::Workflow(command) => workflow(remote, command),
        Command::Schedule(command) => schedule(remote, command),
        Command::Queue(command) => queue(remote, command),
        Command::Init(_) => Err(no_route("init")),
        Command::Subscribe(_) => Err(no_route("subscribe (declare a consumer: PUT /v1/consumers/{id})")),
        Command::Relay(_) => Err(no_route("relay (the server relays by itself)")),
        Command::Apply(_) | Command::Drain(_) => Err(no_route("apply/drain (the server drains by itself)")),
        Command::Snapshot(_) => Err(no_route("snapshot")),
        Command::Prune(_) => Err(no_route("prune (the server prunes by itself)")),
        Command::RenameConsumer(_) => Err(no_route("rename-consumer")),
        Command::Demo(_) => Err(no_route("demo")),
        Command::Experiment(_) => Err(no_route("experiment")),
        Command::Bench(_) => Err(no_route("bench")),
        Command::Worker(_) => Err(no_route("worker (the server runs workers by itself)")),
        Command::Serve(_) => Err(no_route("serve")),
        Command::Loadtest(_) => Err(no_route("loadtest")),
        Command::Chaos(_) => Err(no_route("chaos")),
        Command::Config(_) => Err(no_route("config")),
        Command::Consume(_) => Err(no_route("consume")),
        Command::Token(_) => Err(no_route("token")),
        #[cfg(feature = "failpoints")]
        Command::UnsafeDualWriteAdvance(_) => Err(no_route("unsafe-dual-write-advance")),
    }
}

/// `tidemark schedule ...` against the server's `/v1/schedules` routes (the server ticks its
/// schedules itself: `tick` has no route).
fn schedule(remote: &Remote, command: ScheduleCommand) -> Result<Value> {
    match command {
        ScheduleCommand::Put {
            schedule_id,
            workflow,
            cron,
            interval_ms,
            timezone,
            catch_up,
            input,
            input_file,
            ..
        } => {
            let id = segment("schedule_id", &schedule_id)?;
            let input = crate::workflow_cmd::read_input(input.as_deref(), input_file.as_deref())?;
            let body = json!({"workflow": workflow, "input": input, "cron": cron, "interval_ms": interval_ms,
                "timezone": timezone, "catch_up": catch_up});
            let answer = remote.send(Method::PUT, &format!("/v1/schedules/{id}"), &[], Some(body))?;
            Ok(json!({"outcome": "scheduled", "schedule": answer}))
        }
        ScheduleCommand::List { .. } => remote.send(Method::GET, "/v1/schedules", &[], None),
        ScheduleCommand::Show { schedule_id, .. } => {
            let id = segment("schedule_id", &schedule_id)?;
            Ok(json!({"schedule": remote.send(Method::GET, &format!("/v1/schedules/{id}"), &[], None)?}))
        }
        ScheduleCommand::Pause { schedule_id, .. } => {
            let id = segment("schedule_id", &schedule_id)?;
            let answer = remote.send(Method::POST, &format!("/v1/schedules/{id}/pause"), &[], None)?;
            Ok(json!({"outcome": "paused", "schedule": answer}))
        }
        ScheduleCommand::Resume { schedule_id, .. } => {
            let id = segment("schedule_id", &schedule_id)?;
            let answer = remote.send(Method::POST, &format!("/v1/schedules/{id}/resume"), &[], None)?;
            Ok(json!({"outcome": "resumed", "schedule": answer}))
        }
        ScheduleCommand::Delete { schedule_id, .. } => {
            let id = segment("schedule_id", &schedule_id)?;
            remote.send(Method::DELETE, &format!("/v1/schedules/{id}"), &[], None)?;
            Ok(json!({"outcome": "deleted", "schedule_id": schedule_id}))
        }
        ScheduleCommand::Tick { .. } => Err(no_route("schedule tick (the server ticks its schedules every second)")),
    }
}

/// `tidemark queue ...` against `/v1/queues`.
fn queue(remote: &Remote, command: QueueCommand) -> Result<Value> {
    match command {
        QueueCommand::Put { name, concurrency, rate_limit, rate_period_ms, .. } => {
            let spec = crate::queue_cmd::spec_of(name, concurrency, rate_limit, rate_period_ms)?;
            let body = json!({"concurrency_max": spec.concurrency_max, "rate": spec.rate});
            let answer = remote.send(Method::PUT, &format!("/v1/queues/{}", spec.name), &[], Some(body))?;
            Ok(json!({"outcome": "declared", "queue": answer}))
        }
        QueueCommand::List { .. } => remote.send(Method::GET, "/v1/queues", &[], None),
        QueueCommand::Show { name, .. } => {
            let name = segment("queue", &name)?;
            Ok(json!({"queue": remote.send(Method::GET, &format!("/v1/queues/{name}"), &[], None)?}))
        }
    }
}

/// A run's whole detail from its pages (`next_after_seq` and `next_events_after` read on until
/// the last page): the form the file mode prints and the test kit's `ReplayCheck` replays. Each
/// page starts right after the one before (`RunDetail::append_page` checks it); the pages of
/// unconsumed events each hold at least one.
fn whole_detail(remote: &Remote, path: &str) -> Result<RunDetail> {
    let page = |query: &[(&str, String)]| -> Result<RunDetail> {
        serde_json::from_value(remote.send(Method::GET, path, query, None)?)
            .map_err(|e| Error::io(format!("the server's answer to GET {path} is not a run's detail: {e}")))
    };
    let mut detail = page(&[])?;
    while detail.is_cut() {
        let mut query = Vec::new();
        if let Some(after) = detail.next_after_seq {
            query.push(("after_seq", after.to_string()));
        }
        if let Some(cursor) = &detail.next_events_after {
            query.push(("events_after", cursor.clone()));
        }
        detail.append_page(page(&query)?)?;
    }
    Ok(detail)
}

/// An answer's body, at most `max` bytes (`io` past it: never a cut answer read as another), and
/// its JSON. A success whose body is not empty must be JSON (`io` otherwise); an error's body
/// may be anything (its text goes into the error).
fn read_answer(body: impl std::io::Read, max: u64, success: bool, url: &str) -> Result<(Vec<u8>, Option<Value>)> {
    let mut bytes = Vec::new();
    body.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io(format!("cannot read the answer of {url}: {e}")))?;
    if bytes.len() as u64 > max {
        return Err(Error::io(format!(
            "the answer of {url} passed {max} bytes: ask for smaller pages (a lower `limit`, or the server's \
             limits.page_bytes_max)"
        )));
    }
    let answer = match serde_json::from_slice(&bytes) {
        Ok(answer) => Some(answer),
        Err(e) if success && !bytes.is_empty() => {
            return Err(Error::io(format!("the answer of {url} is not JSON: {e}")));
        }
        Err(_) => None,
    };
    Ok((bytes, answer))
}

fn workflow(remote: &Remote, command: WorkflowCommand) -> Result<Value> {
    let reason_route = |run_id: &str, action: &str, reason: String| -> Result<Value> {
        let run = segment("run_id", run_id)?;
        validate_reason(&reason)?;
        remote.send(Method::POST, &format!("/v1/runs/{run}/{action}"), &[], Some(json!({"reason": reason})))
    };
    match command {
        WorkflowCommand::SeedStock { sku, quantity, .. } => {
            let sku = segment("sku", &sku)?;
            remote.send(Method::PUT, &format!("/v1/stock/{sku}"), &[], Some(json!({"quantity": quantity})))
        }
        WorkflowCommand::Start {
            workflow,
            run_id,
            input,
            input_file,
            key,
            start_at_ms,
            queue,
            priority,
            dedup_id,
            timeout_ms,
            ..
        } => {
            validate_id("run_id", &run_id)?;
            validate_id("workflow", &workflow)?;
            let input = crate::workflow_cmd::read_input(input.as_deref(), input_file.as_deref())?;
            let mut body = json!({"workflow": workflow, "run_id": run_id, "input": input});
            if let Some(key) = key {
                body["key"] = json!(key);
            }
            if let Some(at) = start_at_ms {
                body["start_at_ms"] = json!(at);
            }
            if let Some(queue) = queue {
                body["queue"] = json!({"queue": queue, "priority": priority, "dedup_id": dedup_id});
            }
            if let Some(timeout_ms) = timeout_ms {
                body["timeout_ms"] = json!(timeout_ms);
            }
            remote.send(Method::POST, "/v1/runs", &[], Some(body))
        }
        WorkflowCommand::List { status, workflow, created_after_ms, created_before_ms, limit, after, .. } => {
            let mut query = Vec::new();
            let optional = [
                ("status", status),
                ("workflow", workflow),
                ("created_after_ms", created_after_ms.map(|v| v.to_string())),
                ("created_before_ms", created_before_ms.map(|v| v.to_string())),
                ("after", after),
            ];
            query.extend(optional.into_iter().filter_map(|(k, v)| v.map(|v| (k, v))));
            limit_query(&mut query, limit)?;
            Ok(with_outcome(remote.send(Method::GET, "/v1/runs", &query, None)?, "listed"))
        }
        WorkflowCommand::Show { run_id, .. } => {
            let run = segment("run_id", &run_id)?;
            let detail = whole_detail(remote, &format!("/v1/runs/{run}"))?;
            let answer = serde_json::to_value(detail).map_err(|e| Error::io(format!("cannot print the run: {e}")))?;
            Ok(with_outcome(answer, "found"))
        }
        WorkflowCommand::Result { run_id, wait_ms, .. } => {
            let run = segment("run_id", &run_id)?;
            crate::workflow_cmd::validate_wait_ms(wait_ms)?;
            let query = [("wait_ms", wait_ms.to_string())];
            let answer = remote.send(Method::GET, &format!("/v1/runs/{run}/result"), &query, None)?;
            let outcome = if answer["done"] == json!(true) { "ended" } else { "not_ended" };
            Ok(with_outcome(answer, outcome))
        }
        WorkflowCommand::Cancel { run_id, reason, .. } => reason_route(&run_id, "cancel", reason),
        WorkflowCommand::Retry { run_id, reason, .. } => reason_route(&run_id, "retry", reason),
        WorkflowCommand::Abandon { run_id, reason, .. } => reason_route(&run_id, "abandon", reason),
        WorkflowCommand::Fork { run_id, from_step, new_run_id, .. } => {
            let run = segment("run_id", &run_id)?;
            validate_id("new_run_id", &new_run_id)?;
            let body = json!({"from_step": from_step, "new_run_id": new_run_id});
            remote.send(Method::POST, &format!("/v1/runs/{run}/fork"), &[], Some(body))
        }
        WorkflowCommand::Skip { run_id, step, output, reason, .. } => {
            let run = segment("run_id", &run_id)?;
            validate_reason(&reason)?;
            let output = match output {
                Some(text) => crate::workflow_cmd::parse_json("--output", &text)?,
                None => Value::Null,
            };
            let body = json!({"step": step, "output": output, "reason": reason});
            remote.send(Method::POST, &format!("/v1/runs/{run}/skip"), &[], Some(body))
        }
        WorkflowCommand::SendEvent { run_id, name, event_id, payload, .. } => {
            let run = segment("run_id", &run_id)?;
            validate_id("event name", &name)?;
            let event_id = event_id.unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
            validate_id("event_id", &event_id)?;
            let payload = crate::workflow_cmd::parse_json("--payload", &payload)?;
            let body = json!({"name": name, "event_id": event_id, "payload": payload});
            remote.send(Method::POST, &format!("/v1/runs/{run}/events"), &[], Some(body))
        }
        WorkflowCommand::Init { .. } => Err(no_route("workflow init (the server creates its files)")),
        WorkflowCommand::Purge { .. } => Err(no_route("workflow purge (the server purges by itself)")),
        WorkflowCommand::Unclaimable { .. } => Err(no_route("workflow unclaimable")),
        WorkflowCommand::Orders { .. } => Err(no_route("workflow orders")),
        WorkflowCommand::Payments { .. } => Err(no_route("workflow payments")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_is_read_whole_or_refused() {
        let url = "http://h/v1/x";
        let (_, answer) = read_answer(&br#"{"a": 1}"#[..], 8, true, url).unwrap();
        assert_eq!(answer, Some(json!({"a": 1})));
        // One byte past the bound: refused, not cut and read as something else.
        let error = read_answer(&br#"{"a": 12}"#[..], 8, true, url).unwrap_err();
        assert_eq!(error.code(), codes::IO, "{error}");
        // A success must be JSON; an empty one is null; an error's body may be text.
        assert_eq!(read_answer(&b"<html>"[..], 64, true, url).unwrap_err().code(), codes::IO);
        assert_eq!(read_answer(&b""[..], 64, true, url).unwrap().1, None);
        assert_eq!(read_answer(&b"Bad Gateway"[..], 64, false, url).unwrap().1, None);
    }
}
