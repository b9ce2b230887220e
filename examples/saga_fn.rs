//! A saga written as a plain async function: book a trip (flight, hotel, payment); when a step
//! fails for good, undo the steps that completed, in reverse order, each as a journaled
//! compensation. No HTTP here: the service runs only its background loops, and the program
//! starts runs and reads them in process.
//!
//! ```sh
//! cargo run -p tidemark --example saga_fn
//! ```
//!
//! Two trips: `trip-1` books everything and completes; `trip-2` is declined at payment, so its
//! hotel and flight are cancelled and the run ends `compensated`. The `bookings` table (in the
//! workflow database, written by transactional steps) shows what happened exactly once.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::json;
use tidemark::prelude::*;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Trip {
    trip_id: String,
    /// The card the payment step charges; `"declined"` is refused for good.
    card: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct Booked {
    flight: i64,
    hotel: i64,
    payment: String,
}

/// Book one item in the workflow database (a transactional step: exactly once).
fn book(tx: &Connection, trip: &str, item: &str) -> Result<i64, StepFailure> {
    tx.execute("INSERT INTO bookings (trip_id, item, status) VALUES (?1, ?2, 'booked')", (trip, item))?;
    Ok(tx.last_insert_rowid())
}

/// Cancel it (a transactional compensation).
fn cancel(tx: &Connection, trip: &str, item: &str) -> Result<(), StepFailure> {
    tx.execute("UPDATE bookings SET status = 'cancelled' WHERE trip_id = ?1 AND item = ?2", (trip, item))?;
    Ok(())
}

async fn book_trip(ctx: Context, trip: Trip) -> Result<Booked, WorkflowError> {
    let (id, card) = (trip.trip_id.clone(), trip.card.clone());
    let t = id.clone();
    let flight: i64 = ctx.tx_step("book_flight", None, move |tx: &Connection| book(tx, &t, "flight")).await?;
    let t = id.clone();
    let hotel: i64 = ctx.tx_step("book_hotel", None, move |tx: &Connection| book(tx, &t, "hotel")).await?;
    // An external call (a payment provider), at least once with one idempotency key.
    let payment = ctx
        .step("charge", None, move |key| async move {
            if card == "declined" {
                Err(StepFailure::permanent("the card was declined"))
            } else {
                Ok(format!("pay_{key}"))
            }
        })
        .await;
    match payment {
        Ok(payment) => Ok(Booked { flight, hotel, payment }),
        Err(WorkflowError::StepFailed { step, message, .. }) => {
            // Undo what completed, newest first. Each compensation is journaled: a crash in the
            // middle resumes here without undoing anything twice. (Had the charge failed with
            // `out_of_attempts: true`, an attempt may have charged the card and timed out before
            // it answered: a payment that can be refunded is refunded then too, under the charge's
            // key, a refund of nothing doing nothing, as the order saga does.)
            ctx.begin_compensation().await?;
            let t = id.clone();
            ctx.tx_compensation("cancel_hotel", None, move |tx: &Connection| cancel(tx, &t, "hotel")).await?;
            let t = id.clone();
            ctx.tx_compensation("cancel_flight", None, move |tx: &Connection| cancel(tx, &t, "flight")).await?;
            Err(WorkflowError::Compensated(format!("{step} failed: {message}")))
        }
        Err(other) => Err(other),
    }
}

async fn finished(tenant: &Tenant, run_id: &str) -> tidemark::Result<RunStatus> {
    for _ in 0..1_500 {
        let status = tenant.run(run_id).await?.map(|r| r.run.status);
        if let Some(status) = status.filter(|s| s.is_terminal()) {
            return Ok(status);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(Error::invalid(tidemark::codes::UNAVAILABLE, format!("run {run_id} did not finish in 30 s")))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let data = match args.iter().position(|a| a == "--data") {
        Some(i) => std::path::PathBuf::from(args.get(i + 1).ok_or("--data needs a folder")?),
        None => std::env::temp_dir().join(format!("tidemark-saga-{}", std::process::id())),
    };
    let service = Service::builder()
        .data_dir(&data)
        .without_auth("travel")
        .migration(
            Database::Workflows,
            Migration::sql(
                "0001_bookings",
                "CREATE TABLE bookings (booking_id INTEGER PRIMARY KEY, trip_id TEXT NOT NULL, item TEXT NOT NULL,
                                        status TEXT NOT NULL, UNIQUE (trip_id, item))",
            ),
        )
        .workflow(tidemark::workflow("book_trip", 1, book_trip))
        .build()?;
    service.start().await?;
    let tenant = service.tenant("travel").await?;
    tenant
        .start(vec![
            StartRequest::new("trip-1", "book_trip", 1, json!({"trip_id": "trip-1", "card": "visa"})),
            StartRequest::new("trip-2", "book_trip", 1, json!({"trip_id": "trip-2", "card": "declined"})),
        ])
        .await?;
    let trip_1 = finished(&tenant, "trip-1").await?;
    let trip_2 = finished(&tenant, "trip-2").await?;
    let bookings: Vec<(String, String, String)> = tenant
        .writer
        .call(|store, _| {
            let mut stmt =
                store.connection().prepare("SELECT trip_id, item, status FROM bookings ORDER BY trip_id, item")?;
            let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
            Ok(rows.collect::<Result<Vec<_>, _>>()?)
        })
        .await?;
    let detail = tenant.run("trip-2").await?.ok_or("trip-2 is gone")?;
    let steps: Vec<String> = detail.journal.iter().map(|e| format!("{}:{}", e.name, e.status.as_str())).collect();
    service.shutdown().await;

    let summary = json!({
        "trip-1": trip_1.as_str(),
        "trip-2": trip_2.as_str(),
        "trip-2_steps": steps,
        "bookings": bookings,
    });
    let expected = json!({
        "trip-1": "completed",
        "trip-2": "compensated",
        "trip-2_steps": ["book_flight:completed", "book_hotel:completed", "charge:failed",
                          "cancel_hotel:completed", "cancel_flight:completed"],
        "bookings": [["trip-1", "flight", "booked"], ["trip-1", "hotel", "booked"],
                     ["trip-2", "flight", "cancelled"], ["trip-2", "hotel", "cancelled"]],
    });
    if summary != expected {
        return Err(format!("expected {expected:#}\ngot {summary:#}").into());
    }
    println!("{}", json!({"outcome": "ok", "summary": summary}));
    Ok(())
}
