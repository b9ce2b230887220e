//! The `shipping` service of the two-services example (see `README.md` beside this file): it
//! receives orders' `shipment.requested` commands in its inbox and answers each with
//! `shipment.scheduled`, exactly once.
//!
//! ```sh
//! cargo run -p tidemark --example two-services-shipping -- \
//!     --data ./shipping-data --listen 127.0.0.1:7402 --orders http://127.0.0.1:7401
//! # replies through NATS JetStream instead of HTTP (the stream capturing replies.> is yours):
//! #   ... --replies-to nats://127.0.0.1:4222/replies
//! ```
//!
//! - The consumer `orders` receives the commands over HTTP (orders' relay posts them to
//!   `/v1/consumers/orders/inbox/batch` here, answered after the inbox commit).
//! - Its handler runs in the transaction that marks the command applied, in the workflow
//!   database: it writes the `shipments` row **and** commits the reply event to that database's
//!   outbox (`advance_committed_in`), so the shipment and its answer exist together or not at
//!   all, once per command: a redelivered command is a `duplicate` in the inbox, never applied
//!   again.
//! - The relay delivers the reply (subscription `orders`) to orders' inbox over HTTP, or to a
//!   JetStream subject prefix with `--replies-to nats://host:port/<prefix>`.
//! - `GET /shipments` lists the shipments (a route of this service, beside tidemark's API).
//!
//! It runs without authentication (every request is an admin of tenant `shipping`): a local
//! example. Its last line on stdout, once listening, is `{"outcome": "listening", ...}`.

use serde_json::{json, Value};
use tidemark::axum::http::StatusCode;
use tidemark::flow::{StreamMachine, APPEND_AT_ANY_SEQ};
use tidemark::prelude::*;
use tidemark::service::api::{typed, ApiResult};
use tidemark::service::{AppState, Scope};
use tidemark::sqlite::advance_committed_in;
use tidemark::utoipa;
use tidemark::utoipa_axum::{router::OpenApiRouter, routes};

mod contract;
use contract::{
    flag, ShipmentRequested, ShipmentScheduled, ORDERS_CONSUMER, SHIPMENT_REQUESTED, SHIPMENT_SCHEDULED,
    SHIPPING_CONSUMER,
};

/// Applies orders' commands: a shipment row and the reply, in the apply transaction.
#[derive(Clone)]
struct ShipmentRequests;

impl EventHandler<Connection> for ShipmentRequests {
    type Event = ShipmentRequested;

    fn accepts(&self, event_type: &str) -> bool {
        event_type == SHIPMENT_REQUESTED
    }

    fn handle(
        &mut self,
        tx: &Connection,
        consumer_id: &str,
        envelope: &Envelope,
        command: ShipmentRequested,
    ) -> Result<(), HandleError> {
        let failed = |e: Error| HandleError::Failed(e);
        let inserted = tx
            .execute(
                "INSERT INTO shipments (consumer_id, order_id, command_event_id, sku, quantity)
                 VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (order_id) DO NOTHING",
                (consumer_id, &command.order_id, &envelope.event_id, &command.sku, command.quantity),
            )
            .map_err(|e| failed(e.into()))?;
        if inserted == 0 {
            // Another command (another event id: a redelivery of the same one is a `duplicate`
            // in the inbox and never gets here) for an order that has its shipment: blocked for
            // an operator to look at, never a second parcel.
            return Err(HandleError::Blocked(format!("order {} already has a shipment", command.order_id)));
        }
        let tracking = format!("TRK-{:06}", tx.last_insert_rowid());
        tx.execute("UPDATE shipments SET tracking = ?2 WHERE order_id = ?1", (&command.order_id, &tracking))
            .map_err(|e| failed(e.into()))?;
        // The reply, in this database's outbox (source `shipping.workflows`), committed with the
        // row above and the command's `applied` mark.
        let reply = ShipmentScheduled { run_id: command.run_id, order_id: command.order_id.clone(), tracking };
        let input = json!({"event_type": SHIPMENT_SCHEDULED, "payload": reply});
        let request = AdvanceRequest::new(&command.order_id, APPEND_AT_ANY_SEQ, StreamMachine::STATE, input);
        advance_committed_in(tx, &StreamMachine, &request, tidemark::workflow::system_clock()()).map_err(failed)?;
        Ok(())
    }
}

/// Every shipment, oldest first.
#[utoipa::path(
    get,
    path = "/shipments",
    tag = "shipping",
    responses((status = 200, description = "`{\"shipments\": [{order_id, sku, quantity, tracking, command_event_id}]}`")),
    security(("bearer" = ["read"]))
)]
async fn shipments(caller: Caller) -> ApiResult {
    caller.require(Scope::Read)?;
    let rows: Vec<Value> = caller
        .tenant
        .writer
        .call(|store, _| {
            let mut stmt = store.connection().prepare(
                "SELECT order_id, sku, quantity, tracking, command_event_id FROM shipments ORDER BY shipment_id",
            )?;
            let rows = stmt.query_map([], |r| {
                Ok(json!({"order_id": r.get::<_, String>(0)?, "sku": r.get::<_, String>(1)?,
                          "quantity": r.get::<_, i64>(2)?, "tracking": r.get::<_, Option<String>>(3)?,
                          "command_event_id": r.get::<_, String>(4)?}))
            })?;
            Ok(rows.collect::<Result<Vec<_>, _>>()?)
        })
        .await?;
    Ok(typed(StatusCode::OK, json!({"shipments": rows})))
}

/// The service. `replies_to` is where the replies go: orders' inbox over HTTP
/// (`<orders>/v1/consumers/shipping/inbox`) or a `nats://` subject prefix.
fn service(data: &std::path::Path, orders: &str, token: &str, replies_to: &str) -> Result<Service, Error> {
    let mut config = Config::default();
    // The relay's bearer token for orders' inbox routes (orders runs without authentication here).
    config.relay.tokens.insert(orders.to_string(), token.to_string());
    Service::builder()
        .config(config)
        .data_dir(data)
        .without_auth("shipping")
        .migration(
            Database::Workflows,
            Migration::with("0001_shipments", |tx| {
                tx.execute_batch(
                    "CREATE TABLE shipments (
                         shipment_id INTEGER PRIMARY KEY, consumer_id TEXT NOT NULL,
                         order_id TEXT NOT NULL UNIQUE, command_event_id TEXT NOT NULL,
                         sku TEXT NOT NULL, quantity INTEGER NOT NULL, tracking TEXT
                     )",
                )?;
                tidemark::sqlite::register_projection_table(tx, "shipments")
            }),
        )
        // On the workflow database: the handler's transaction can then commit the reply to that
        // database's outbox (the producer database holds no inbox).
        .handler_in(Database::Workflows, "shipment_requests", Typed(ShipmentRequests))
        // Fed by orders only, never by this service's own outboxes (which hold the replies).
        .declare_consumer_unsubscribed(ORDERS_CONSUMER, "shipment_requests")
        .subscribe(ORDERS_CONSUMER, replies_to)
        .routes(OpenApiRouter::<AppState>::new().routes(routes!(shipments)))
        .build()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let data = flag("--data").map(std::path::PathBuf::from).unwrap_or_else(|| "shipping-data".into());
    let listen = flag("--listen").unwrap_or_else(|| "127.0.0.1:7402".into());
    let orders = flag("--orders").ok_or("--orders http://host:port (orders' address) is required")?;
    let orders = orders.trim_end_matches('/').to_string();
    let token = flag("--orders-token").unwrap_or_else(|| "dev".into());
    let replies_to = flag("--replies-to").unwrap_or_else(|| format!("{orders}/v1/consumers/{SHIPPING_CONSUMER}/inbox"));
    let service = service(&data, &orders, &token, &replies_to)?;
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    let addr = listener.local_addr()?;
    println!("{}", json!({"outcome": "listening", "service": "shipping", "addr": addr.to_string()}));
    let stop = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let report = service.serve_on(listener, stop).await?;
    println!("{report}");
    Ok(())
}
