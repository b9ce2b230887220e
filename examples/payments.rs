//! A payments service on tidemark: its own flow machine (`payment`), its own consumer handler
//! (`ledger`), its own workflow (`settle`), its own tables and one route of its own, in an
//! embedded service with the HTTP API, the dashboard, `/metrics` and every background loop.
//!
//! ```sh
//! cargo run -p tidemark --example payments                 # runs the story below, then exits
//! cargo run -p tidemark --example payments -- --serve      # ...then keeps serving (Ctrl-C stops)
//! ```
//!
//! The story, over real HTTP:
//! 1. `POST /payments/pay-1` (the service's own route) writes the `payments` row and authorizes
//!    the `pay-1` flow in one transaction. Sent again, the advance is `stale` and the row is not
//!    written twice: the transaction commits both or neither.
//! 2. `POST /v1/flows/pay-1/advance` captures it (the generic API serves any registered machine).
//! 3. `POST /v1/runs` starts `settle` for it: an external step charges the card with the step's
//!    idempotency key, a transactional step records the settlement in the workflow database.
//! 4. The relay and the `ledger` consumer apply the payment's events exactly once, in order:
//!    the ledger holds one debit and one credit for the capture.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tidemark::axum::{self, http::StatusCode};
use tidemark::codes;
use tidemark::prelude::*;
use tidemark::service::api::{typed, ApiResult, Json, Path};
use tidemark::service::{AppState, Scope};
use tidemark::sqlite::register_projection_table;
use tidemark::utoipa::{self, ToSchema};
use tidemark::utoipa_axum::{router::OpenApiRouter, routes};

// ---------------------------------------------------------------------------------------------
// The payment flow: payment.new -> authorized -> captured | voided.
// ---------------------------------------------------------------------------------------------

/// What a payment flow carries from state to state.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
struct PaymentData {
    amount_cents: i64,
    currency: String,
}

/// An advance's input: the amount and currency to authorize (nothing for later moves).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PaymentInput {
    amount_cents: Option<i64>,
    currency: Option<String>,
}

/// Every payment event's payload.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct PaymentEvent {
    amount_cents: i64,
    currency: String,
}

struct PaymentMachine;

impl Machine for PaymentMachine {
    type Data = PaymentData;
    type Input = PaymentInput;
    type Event = PaymentEvent;
    const NAME: &'static str = "payment";
    const STATES: &'static [&'static str] = &["payment.new", "authorized", "captured", "voided"];

    fn validate(&self, to: &str, input: &PaymentInput) -> tidemark::Result<()> {
        if to == "authorized" {
            let amount_ok = matches!(input.amount_cents, Some(1..=1_000_000_000));
            let currency_ok =
                input.currency.as_deref().is_some_and(|c| c.len() == 3 && c.chars().all(|x| x.is_ascii_uppercase()));
            if !amount_ok || !currency_ok {
                return Err(Error::invalid(
                    codes::INVALID_PAYLOAD,
                    "authorizing needs amount_cents 1..=1000000000 and a currency like \"EUR\"",
                ));
            }
        }
        Ok(())
    }

    fn decide(
        &self,
        from: &str,
        data: &PaymentData,
        to: &str,
        input: PaymentInput,
    ) -> Result<Transition<PaymentData, PaymentEvent>, String> {
        let next = match (from, to) {
            ("payment.new", "authorized") => PaymentData {
                amount_cents: input.amount_cents.unwrap_or_default(),
                currency: input.currency.unwrap_or_default(),
            },
            ("authorized", "captured") | ("authorized", "voided") => data.clone(),
            _ => return Err(format!("a payment cannot move from {from} to {to}")),
        };
        let event = PaymentEvent { amount_cents: next.amount_cents, currency: next.currency.clone() };
        Ok(Transition { data: next, event_type: format!("payment.{to}"), event })
    }
}

// ---------------------------------------------------------------------------------------------
// The ledger consumer: a captured payment is a debit of the customer and a credit of the
// merchant, written in the transaction that marks the event applied (exactly once).
// ---------------------------------------------------------------------------------------------

#[derive(Clone)]
struct Ledger;

impl EventHandler<Connection> for Ledger {
    type Event = PaymentEvent;

    fn accepts(&self, event_type: &str) -> bool {
        event_type == "payment.captured"
    }

    fn handle(
        &mut self,
        tx: &Connection,
        consumer_id: &str,
        envelope: &Envelope,
        event: PaymentEvent,
    ) -> Result<(), HandleError> {
        for (account, amount) in [("customer", -event.amount_cents), ("merchant", event.amount_cents)] {
            tx.execute(
                "INSERT INTO ledger_entries (consumer_id, payment_id, seq, account, amount_cents, currency)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                (consumer_id, &envelope.flow_id, envelope.seq, account, amount, &event.currency),
            )
            .map_err(|e| HandleError::Failed(e.into()))?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// The settlement workflow.
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct Settle {
    payment_id: String,
    amount_cents: i64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Charge {
    charge_id: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct Settled {
    charge_id: String,
    settlement_id: i64,
}

async fn settle(ctx: Context, input: Settle) -> Result<Settled, WorkflowError> {
    // External: at least once, always with the same idempotency key, which a real provider
    // uses to charge once.
    let charge: Charge =
        ctx.step("charge_card", None, move |key| async move { Ok(Charge { charge_id: format!("ch_{key}") }) }).await?;
    // Transactional: the settlement row and the journal entry commit together (exactly once).
    let (payment_id, charge_id, amount) = (input.payment_id.clone(), charge.charge_id.clone(), input.amount_cents);
    let settlement_id: i64 = ctx
        .tx_step("record_settlement", None, move |tx: &Connection| {
            tx.execute(
                "INSERT INTO settlements (payment_id, charge_id, amount_cents) VALUES (?1, ?2, ?3)",
                (&payment_id, &charge_id, amount),
            )?;
            Ok(tx.last_insert_rowid())
        })
        .await?;
    Ok(Settled { charge_id: charge.charge_id, settlement_id })
}

// ---------------------------------------------------------------------------------------------
// The service's own route: the payment row and the authorization in one transaction.
// ---------------------------------------------------------------------------------------------

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct NewPayment {
    customer: String,
    amount_cents: i64,
    currency: String,
}

/// Authorize a new payment: its `payments` row and its `authorized` event commit together.
#[utoipa::path(
    post,
    path = "/payments/{payment_id}",
    tag = "payments",
    params(("payment_id" = String, Path, description = "The payment (its flow id)")),
    request_body = NewPayment,
    responses((status = 201, description = "authorized"), (status = 409, description = "`stale`: it exists")),
    security(("bearer" = ["operate"]))
)]
async fn authorize(caller: Caller, Path(payment_id): Path<String>, Json(body): Json<NewPayment>) -> ApiResult {
    caller.require(Scope::Operate)?;
    tidemark::id::validate_id("payment_id", &payment_id)?;
    tidemark::id::validate_id("customer", &body.customer)?;
    let input = json!({"amount_cents": body.amount_cents, "currency": body.currency});
    let committed = caller
        .tenant
        .transaction(move |tx, machines| {
            tx.execute(
                "INSERT INTO payments (payment_id, customer, amount_cents) VALUES (?1, ?2, ?3)
                 ON CONFLICT (payment_id) DO NOTHING",
                (&payment_id, &body.customer, body.amount_cents),
            )?;
            // Stale (the payment exists) or invalid: an error, and the insert rolls back with it.
            tx.advance(machines, &AdvanceRequest::new(&payment_id, 0, "authorized", input))
        })
        .await?;
    Ok(typed(StatusCode::CREATED, committed))
}

fn payment_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(authorize))
}

/// The service: everything above, registered.
fn service(data: &std::path::Path) -> tidemark::Result<Service> {
    Service::builder()
        .data_dir(data)
        .without_auth("payments")
        .flow(PaymentMachine)
        .migration(
            Database::Producer,
            Migration::sql(
                "0001_payments",
                "CREATE TABLE payments (payment_id TEXT PRIMARY KEY, customer TEXT NOT NULL, amount_cents INTEGER NOT NULL)",
            ),
        )
        .migration(
            Database::Inbox,
            Migration::with("0001_ledger", |tx| {
                tx.execute_batch(
                    "CREATE TABLE ledger_entries (
                         entry_id INTEGER PRIMARY KEY, consumer_id TEXT NOT NULL, payment_id TEXT NOT NULL,
                         seq INTEGER NOT NULL, account TEXT NOT NULL, amount_cents INTEGER NOT NULL,
                         currency TEXT NOT NULL
                     )",
                )?;
                // `tidemark rename-consumer` carries these rows over with the consumer's state.
                register_projection_table(tx, "ledger_entries")
            }),
        )
        .consumer("ledger", Typed(Ledger))
        .migration(
            Database::Workflows,
            Migration::sql(
                "0001_settlements",
                "CREATE TABLE settlements (settlement_id INTEGER PRIMARY KEY, payment_id TEXT NOT NULL UNIQUE,
                                           charge_id TEXT NOT NULL, amount_cents INTEGER NOT NULL)",
            ),
        )
        .workflow(tidemark::workflow("settle", 1, settle).input_schema_of::<Settle>())
        .routes(payment_routes())
        .build()
}

/// Poll `url` until `done` says so (at most 30 s).
async fn wait_for(http: &reqwest::Client, url: &str, done: impl Fn(&Value) -> bool) -> Result<Value, String> {
    for _ in 0..1_500 {
        let body: Value =
            http.get(url).send().await.map_err(|e| e.to_string())?.json().await.map_err(|e| e.to_string())?;
        if done(&body) {
            return Ok(body);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(format!("{url} did not get there in 30 s"))
}

async fn story(base: &str, service: &Service) -> Result<Value, String> {
    let http = reqwest::Client::new();
    let post = |path: &str, body: Value| http.post(format!("{base}{path}")).json(&body).send();
    let new = json!({"customer": "alice", "amount_cents": 12_50, "currency": "EUR"});

    let first = post("/payments/pay-1", new.clone()).await.map_err(|e| e.to_string())?;
    let again = post("/payments/pay-1", new).await.map_err(|e| e.to_string())?;
    let again_status = again.status().as_u16();
    let again: Value = again.json().await.map_err(|e| e.to_string())?;
    let capture = post("/v1/flows/pay-1/advance", json!({"expected_seq": 1, "to": "captured", "machine": "payment"}))
        .await
        .map_err(|e| e.to_string())?;
    let start = post(
        "/v1/runs",
        json!({"workflow": "settle", "run_id": "settle-pay-1",
                                         "input": {"payment_id": "pay-1", "amount_cents": 1250}}),
    )
    .await
    .map_err(|e| e.to_string())?;
    let bad_start = post("/v1/runs", json!({"workflow": "settle", "run_id": "settle-bad", "input": {"payment": 1}}))
        .await
        .map_err(|e| e.to_string())?;
    let bad_start_status = bad_start.status().as_u16();
    let bad_start: Value = bad_start.json().await.map_err(|e| e.to_string())?;

    let run = wait_for(&http, &format!("{base}/v1/runs/settle-pay-1"), |r| r["run"]["status"] == "completed").await?;
    let cursors = wait_for(&http, &format!("{base}/v1/consumers/ledger/cursors"), |c| {
        c["cursors"]
            .as_array()
            .is_some_and(|all| all.iter().any(|c| c["flow_id"] == "pay-1" && c["high_water_seq"] == 2))
    })
    .await?;
    let registry: Value = http
        .get(format!("{base}/v1/registry"))
        .send()
        .await
        .map_err(|e| e.to_string())?
        .json()
        .await
        .map_err(|e| e.to_string())?;

    // The service's own tables, read in process.
    let tenant = service.tenant("payments").await.map_err(|e| e.to_string())?;
    let payments: i64 = tenant
        .producer
        .call(|p| Ok(p.store.connection().query_row("SELECT count(*) FROM payments", [], |r| r.get(0))?))
        .await
        .map_err(|e| e.to_string())?;
    let ledger: Vec<(String, i64)> = tenant
        .inbox
        .call(|t| {
            let mut stmt =
                t.store.connection().prepare("SELECT account, amount_cents FROM ledger_entries ORDER BY entry_id")?;
            let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
            Ok(rows.collect::<Result<Vec<_>, _>>()?)
        })
        .await
        .map_err(|e| e.to_string())?;
    let settlements: i64 = tenant
        .writer
        .call(|store, _| Ok(store.connection().query_row("SELECT count(*) FROM settlements", [], |r| r.get(0))?))
        .await
        .map_err(|e| e.to_string())?;

    let summary = json!({
        "authorize": first.status().as_u16(),
        "authorize_again": {"status": again_status, "code": again["error"]["code"]},
        "capture": capture.status().as_u16(),
        "start": start.status().as_u16(),
        "start_with_bad_input": {"status": bad_start_status, "code": bad_start["error"]["code"]},
        "run": run["run"]["status"],
        "output": run["run"]["result"],
        "ledger_high_water_seq": cursors["cursors"][0]["high_water_seq"],
        "payments_rows": payments,
        "ledger": ledger,
        "settlements": settlements,
        "machines": registry["machines"].as_array().map(|m| m.iter().map(|m| m["name"].clone()).collect::<Vec<_>>()),
        "settle_input_fields": registry["workflows"][0]["input_schema"]["required"],
    });
    let expected = json!({
        "authorize": 201,
        "authorize_again": {"status": 409, "code": "stale"},
        "capture": 200,
        "start": 201,
        "start_with_bad_input": {"status": 400, "code": "invalid_input"},
        "run": "completed",
        "ledger_high_water_seq": 2,
        "payments_rows": 1,
        "ledger": [["customer", -1250], ["merchant", 1250]],
        "settlements": 1,
        "machines": ["stream", "payment"],
        "settle_input_fields": ["payment_id", "amount_cents"],
    });
    for (key, want) in expected.as_object().expect("an object") {
        if &summary[key] != want {
            return Err(format!("{key}: expected {want}, got {}\n{summary:#}", summary[key]));
        }
    }
    Ok(summary)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let keep_serving = args.iter().any(|a| a == "--serve");
    let data = match args.iter().position(|a| a == "--data") {
        Some(i) => std::path::PathBuf::from(args.get(i + 1).ok_or("--data needs a folder")?),
        None => std::env::temp_dir().join(format!("tidemark-payments-{}", std::process::id())),
    };
    let service = service(&data)?;
    service.start().await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let router = service.router();
    let server = tokio::spawn(async move { axum::serve(listener, router).await });

    let summary = story(&base, &service).await;
    match &summary {
        Ok(summary) => println!("{}", json!({"outcome": "ok", "summary": summary, "dashboard": format!("{base}/ui")})),
        Err(error) => eprintln!("the payments story went wrong: {error}"),
    }
    if keep_serving && summary.is_ok() {
        eprintln!("serving on {base} (the dashboard is {base}/ui); Ctrl-C stops");
        tokio::signal::ctrl_c().await?;
    }
    server.abort();
    service.shutdown().await;
    summary.map(drop).map_err(Into::into)
}
