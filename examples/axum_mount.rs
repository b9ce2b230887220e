//! An existing axum app that mounts tidemark's router: the app keeps its own routes and adds
//! tidemark's API, dashboard and `/metrics` beside them, and tidemark's background loops run in
//! the same process.
//!
//! ```sh
//! cargo run -p tidemark --example axum_mount
//! ```
//!
//! The app's own `POST /app/notes` appends an event to a stream through the tenant in process
//! (no HTTP hop), and `GET /app/health` is its own route. tidemark's routes are served as they
//! are (`/v1/...`, `/ui`, `/metrics`, `/openapi.json`): the dashboard's links are absolute, so
//! mount the router at the root (`Router::merge`), not under a prefix.

use std::sync::Arc;

use serde_json::{json, Value};
use tidemark::axum::{self, extract::State, routing::get, routing::post, Router};
use tidemark::flow::{StreamMachine, APPEND_AT_ANY_SEQ};
use tidemark::prelude::*;

/// The app's own state.
#[derive(Clone)]
struct App {
    notes: Arc<Tenant>,
}

async fn health() -> &'static str {
    "app ok"
}

/// Append a note to the `notes` stream: committed (with its outbox event) before the answer.
async fn add_note(State(app): State<App>, axum::Json(body): axum::Json<Value>) -> axum::Json<Value> {
    let request = AdvanceRequest {
        flow_id: "notes".into(),
        expected_seq: APPEND_AT_ANY_SEQ,
        to_state: StreamMachine::STATE.into(),
        input: json!({"event_type": "note.added", "payload": {"text": body["text"]}}),
        schema_version: 1,
        traceparent: None,
    };
    match app.notes.advance(request).await {
        Ok(outcome) => axum::Json(serde_json::to_value(outcome).unwrap_or_default()),
        Err(error) => axum::Json(json!({"error": {"code": error.code(), "message": error.to_string()}})),
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let data = match args.iter().position(|a| a == "--data") {
        Some(i) => std::path::PathBuf::from(args.get(i + 1).ok_or("--data needs a folder")?),
        None => std::env::temp_dir().join(format!("tidemark-axum-{}", std::process::id())),
    };
    let service = Service::builder()
        .data_dir(&data)
        .without_auth("app")
        .consumer("archive", tidemark::store::RecordHandler)
        .build()?;
    service.start().await?; // tenants open, loops run
    let app = App { notes: service.tenant("app").await? };
    let router = Router::new()
        .route("/app/health", get(health))
        .route("/app/notes", post(add_note))
        .with_state(app)
        .merge(service.router());

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let server = tokio::spawn(async move { axum::serve(listener, router).await });

    let http = reqwest::Client::new();
    let health = http.get(format!("{base}/app/health")).send().await?.text().await?;
    let mut seqs = Vec::new();
    for text in ["first", "second"] {
        let added: Value =
            http.post(format!("{base}/app/notes")).json(&json!({"text": text})).send().await?.json().await?;
        seqs.push(added["seq"].clone());
    }
    let ready = http.get(format!("{base}/readyz")).send().await?.status().as_u16();
    // The archive consumer receives both notes (the relay and its drain run in this process).
    let mut archived = Value::Null;
    for _ in 0..1_500 {
        archived = http.get(format!("{base}/v1/consumers/archive/inbox?status=applied")).send().await?.json().await?;
        if archived["records"].as_array().is_some_and(|r| r.len() == 2) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let texts: Vec<Value> = archived["records"]
        .as_array()
        .map(|r| r.iter().map(|r| r["envelope"]["payload"]["text"].clone()).collect())
        .unwrap_or_default();
    server.abort();
    service.shutdown().await;

    let summary = json!({"health": health, "seqs": seqs, "ready": ready, "archived": texts});
    let expected = json!({"health": "app ok", "seqs": [1, 2], "ready": 200, "archived": ["first", "second"]});
    if summary != expected {
        return Err(format!("expected {expected}, got {summary}").into());
    }
    println!("{}", json!({"outcome": "ok", "summary": summary}));
    Ok(())
}
