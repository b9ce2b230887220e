//! What `orders` and `shipping` agree on: the consumer ids each side declares, the event types
//! and their payloads. In a real system this is a small crate (or a schema file) of its own that
//! both services depend on; here both binaries include this file.

use serde::{Deserialize, Serialize};

/// shipping's consumer of orders' commands (orders subscribes it at
/// `<shipping>/v1/consumers/orders/inbox`).
pub const ORDERS_CONSUMER: &str = "orders";
/// orders' consumer of shipping's replies, the one that wakes the saga run a reply names
/// (shipping subscribes it at `<orders>/v1/consumers/shipping/inbox`, or publishes to NATS,
/// from where orders' source stores it in this consumer's inbox).
pub const SHIPPING_CONSUMER: &str = "shipping";

/// The command: ship an order. Sent by orders' `place_order` saga through its outbox.
pub const SHIPMENT_REQUESTED: &str = "shipment.requested";
/// The reply: the shipment is scheduled. Sent by shipping's handler through its outbox, in the
/// transaction that applies the command; orders' saga waits for an event of this name.
pub const SHIPMENT_SCHEDULED: &str = "shipment.scheduled";

/// The payload of [`SHIPMENT_REQUESTED`].
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShipmentRequested {
    /// The saga run waiting for the reply: the reply carries it back, and orders' inbox handler
    /// wakes that run.
    pub run_id: String,
    pub order_id: String,
    pub sku: String,
    pub quantity: i64,
}

/// The payload of [`SHIPMENT_SCHEDULED`].
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShipmentScheduled {
    /// The run of [`ShipmentRequested::run_id`].
    pub run_id: String,
    pub order_id: String,
    /// shipping's tracking number for the parcel.
    pub tracking: String,
}

/// The value of `--name VALUE` on the command line.
pub fn flag(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}
