//! The `orders` service of the two-services example (see `README.md` beside this file): a saga
//! that places an order, sends `shipping` a command through its outbox and waits for the reply
//! through its inbox.
//!
//! ```sh
//! cargo run -p tidemark --example two-services-orders -- \
//!     --data ./orders-data --listen 127.0.0.1:7401 --shipping http://127.0.0.1:7402
//! ```
//!
//! - `place_order` (started with `POST /v1/runs`) records the order and commits the command
//!   `shipment.requested` in one transactional step: the order row, the outbox event and the
//!   journal entry commit together, so the command is sent once whatever crashes.
//! - The relay delivers it to shipping's inbox over HTTP (the subscription `shipping` at
//!   `<shipping>/v1/consumers/orders/inbox`), and shipping answers `shipment.scheduled`.
//! - The reply arrives in the inbox of the consumer `shipping`, over HTTP (shipping's relay posts
//!   it to `/v1/consumers/shipping/inbox/batch` here) or, with `--replies-from nats://...`,
//!   from a JetStream stream this service consumes. Its handler (`RunEventHandler`) wakes the
//!   run the reply names, once: a redelivered reply is a `duplicate` in the inbox.
//! - The saga records the tracking number and completes; with no answer within
//!   [`SHIPPING_ANSWER_WAIT`] it cancels the order (a compensation) instead.
//!
//! It runs without authentication (every request is an admin of tenant `orders`): a local
//! example. Its last line on stdout, once listening, is `{"outcome": "listening", ...}`.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::json;
use tidemark::flow::{StreamMachine, APPEND_AT_ANY_SEQ};
use tidemark::prelude::*;
use tidemark::service::SourceConfig;
use tidemark::sqlite::{advance_committed_in, RunEventHandler};

mod contract;
use contract::{
    flag, ShipmentRequested, ShipmentScheduled, ORDERS_CONSUMER, SHIPMENT_REQUESTED, SHIPMENT_SCHEDULED,
    SHIPPING_CONSUMER,
};

/// How long a run waits for shipping's answer before it cancels the order.
const SHIPPING_ANSWER_WAIT: Duration = Duration::from_secs(120);

/// The input of `place_order`.
#[derive(Debug, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct PlaceOrder {
    order_id: String,
    sku: String,
    quantity: i64,
}

/// Its result.
#[derive(Debug, Serialize, Deserialize)]
struct Placed {
    order_id: String,
    tracking: String,
}

async fn place_order(ctx: Context, order: PlaceOrder) -> Result<Placed, WorkflowError> {
    // The order row and the command to shipping, in one transaction with this step's journal
    // entry. The command is an event of the flow `<order_id>` in the workflow database's outbox
    // (source `orders.workflows`), which the relay delivers to every subscriber.
    let command = ShipmentRequested {
        run_id: ctx.run_id().to_string(),
        order_id: order.order_id.clone(),
        sku: order.sku.clone(),
        quantity: order.quantity,
    };
    ctx.tx_step("request_shipment", None, move |tx: &Connection| {
        tx.execute(
            "INSERT INTO orders (order_id, sku, quantity, status) VALUES (?1, ?2, ?3, 'awaiting_shipment')",
            (&command.order_id, &command.sku, command.quantity),
        )?;
        let input = json!({"event_type": SHIPMENT_REQUESTED, "payload": &command});
        let request = AdvanceRequest::new(&command.order_id, APPEND_AT_ANY_SEQ, StreamMachine::STATE, input);
        advance_committed_in(tx, &StreamMachine, &request, tidemark::workflow::system_clock()())?;
        Ok(())
    })
    .await?;

    // Suspended (no lease held) until the reply reaches this run through the inbox.
    let Some(reply) = ctx.wait_for_event(SHIPMENT_SCHEDULED, SHIPPING_ANSWER_WAIT).await? else {
        ctx.begin_compensation().await?;
        let order_id = order.order_id.clone();
        ctx.tx_compensation("cancel_order", None, move |tx: &Connection| {
            tx.execute("UPDATE orders SET status = 'cancelled' WHERE order_id = ?1", [&order_id])?;
            Ok(())
        })
        .await?;
        return Err(WorkflowError::Compensated(format!("shipping did not answer in {SHIPPING_ANSWER_WAIT:?}")));
    };
    let reply: ShipmentScheduled = serde_json::from_value(reply)
        .map_err(|e| WorkflowError::Failed(format!("shipping's reply is not a {SHIPMENT_SCHEDULED}: {e}")))?;
    let tracking = reply.tracking.clone();
    ctx.tx_step("record_tracking", None, move |tx: &Connection| {
        tx.execute(
            "UPDATE orders SET status = 'shipped', tracking = ?2 WHERE order_id = ?1",
            (&reply.order_id, &reply.tracking),
        )?;
        Ok(())
    })
    .await?;
    Ok(Placed { order_id: order.order_id, tracking })
}

/// The service. `shipping` is shipping's base URL (`http://host:port`, the port spelled out: it is
/// also the origin its bearer token is configured for); `replies` a JetStream subject prefix and
/// stream to consume shipping's replies from, when they do not come over HTTP.
fn service(
    data: &std::path::Path,
    shipping: &str,
    token: &str,
    replies: Option<(String, String)>,
) -> Result<Service, Error> {
    let mut config = Config::default();
    // The relay's bearer token for shipping's inbox routes (here shipping runs without
    // authentication and takes any; `env:SHIPPING_TOKEN` reads a real one from the environment).
    config.relay.tokens.insert(shipping.to_string(), token.to_string());
    let mut builder = Service::builder()
        .config(config)
        .data_dir(data)
        .without_auth("orders")
        .migration(
            Database::Workflows,
            Migration::sql(
                "0001_orders",
                "CREATE TABLE orders (order_id TEXT PRIMARY KEY, sku TEXT NOT NULL, quantity INTEGER NOT NULL,
                                      status TEXT NOT NULL, tracking TEXT)",
            ),
        )
        .workflow(tidemark::workflow("place_order", 1, place_order).input_schema_of::<PlaceOrder>())
        // shipping's replies wake the run they name (payload.run_id); other event types are ignored.
        .handler_in(
            Database::Workflows,
            "shipping_replies",
            RunEventHandler::new().route(SHIPMENT_SCHEDULED, SHIPMENT_SCHEDULED),
        )
        // Fed by shipping only, never by this service's own outboxes.
        .declare_consumer_unsubscribed(SHIPPING_CONSUMER, "shipping_replies")
        // Every event of both outboxes (the commands among them) goes to shipping's inbox.
        .subscribe(SHIPPING_CONSUMER, &format!("{shipping}/v1/consumers/{ORDERS_CONSUMER}/inbox"));
    if let Some((from, stream)) = replies {
        builder = builder.source(SourceConfig {
            tenant: "orders".into(),
            consumer: SHIPPING_CONSUMER.into(),
            from,
            stream: Some(stream),
            durable: None,
            batch: 100,
            ack_wait_ms: None,
            session_timeout_ms: None,
        });
    }
    builder.build()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let data = flag("--data").map(std::path::PathBuf::from).unwrap_or_else(|| "orders-data".into());
    let listen = flag("--listen").unwrap_or_else(|| "127.0.0.1:7401".into());
    let shipping = flag("--shipping").ok_or("--shipping http://host:port (shipping's address) is required")?;
    let shipping = shipping.trim_end_matches('/').to_string();
    let token = flag("--shipping-token").unwrap_or_else(|| "dev".into());
    let replies = match (flag("--replies-from"), flag("--replies-stream")) {
        (Some(from), Some(stream)) => Some((from, stream)),
        (None, None) => None,
        _ => return Err("--replies-from nats://host:port/<prefix> goes with --replies-stream NAME".into()),
    };
    let service = service(&data, &shipping, &token, replies)?;
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    let addr = listener.local_addr()?;
    println!("{}", json!({"outcome": "listening", "service": "orders", "addr": addr.to_string()}));
    let stop = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let report = service.serve_on(listener, stop).await?;
    println!("{report}");
    Ok(())
}
