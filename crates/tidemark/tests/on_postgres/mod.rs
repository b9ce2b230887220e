//! A service of your own on PostgreSQL through the public API alone: `Service::builder()
//! .postgres(url)`, a user migration, a consumer handler writing in the apply transaction, a
//! workflow whose transactional step writes its own row, and `tenant.transaction` committing a
//! business row with an advance. And what the builder refuses, with stable codes, writing
//! nothing. Skipped, saying why, without a PostgreSQL server (`TIDEMARK_TEST_POSTGRES_URL`,
//! default the local one).

use serde::{Deserialize, Serialize};
use serde_json::json;
use tidemark::postgres::{ApplyTransaction, Migration, RunEventHandler};
use tidemark::prelude::{AdvanceRequest, Database, EventHandler, HandleError, RunStatus, Service, StartRequest};
use tidemark::reservation::ReservationMachine;
use tidemark::store::Typed;
use tidemark::workflow::WorkflowError;
use tidemark::Envelope;

fn server() -> Option<(String, postgres::Client)> {
    let url = std::env::var("TIDEMARK_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    match postgres::Client::connect(&url, postgres::NoTls) {
        Ok(client) => Some((url, client)),
        Err(error) => {
            println!("SKIPPED: PostgreSQL not reachable at {url}: {error}");
            None
        }
    }
}

/// Drops every schema of a service prefix when it goes.
struct Schemas(String, String);

impl Drop for Schemas {
    fn drop(&mut self) {
        // On a thread of its own: the guard may drop inside an async test.
        let (url, prefix) = (self.0.clone(), self.1.clone());
        let _ = std::thread::spawn(move || drop_schemas(&url, &prefix)).join();
    }
}

fn drop_schemas(url: &str, prefix: &str) {
    let Ok(mut client) = postgres::Client::connect(url, postgres::NoTls) else { return };
    let rows = client
        .query("SELECT nspname FROM pg_namespace WHERE starts_with(nspname, $1)", &[&format!("{prefix}_")])
        .unwrap_or_default();
    for row in rows {
        let _ = client.batch_execute(&format!("DROP SCHEMA \"{}\" CASCADE", row.get::<_, String>(0)));
    }
    // The tenants' roles (cluster-wide: they outlive their schemas unless dropped).
    let roles = client
        .query("SELECT rolname::text FROM pg_roles WHERE starts_with(rolname, $1)", &[&format!("{prefix}_")])
        .unwrap_or_default();
    for row in roles {
        let role = row.get::<_, String>(0);
        let _ = client.batch_execute(&format!("DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\""));
    }
}

#[derive(Deserialize)]
struct Reserved {
    amount: i64,
}

/// Writes each reservation into the user's `ledger` table, in the apply transaction.
#[derive(Clone)]
struct Ledger;

impl EventHandler<ApplyTransaction> for Ledger {
    type Event = Reserved;
    fn accepts(&self, event_type: &str) -> bool {
        event_type == "reservation.reserved"
    }
    fn handle(
        &mut self,
        tx: &ApplyTransaction,
        _: &str,
        envelope: &Envelope,
        event: Reserved,
    ) -> Result<(), HandleError> {
        let insert = format!(r#"INSERT INTO "{}".ledger (flow_id, amount) VALUES ($1, $2)"#, tx.schema());
        tx.execute(&insert, &[&envelope.flow_id, &event.amount]).map_err(|e| HandleError::Failed(e.into()))?;
        Ok(())
    }
}

#[derive(Deserialize)]
struct Checkout {
    order_id: String,
}

#[derive(Serialize, Deserialize)]
struct Receipt {
    row: i64,
}

async fn checkout(ctx: tidemark::postgres::Context, input: Checkout) -> Result<Receipt, WorkflowError> {
    let row: i64 = ctx
        .tx_step("record", None, move |tx: &ApplyTransaction| {
            let insert = format!(r#"INSERT INTO "{}".orders (order_id) VALUES ($1) RETURNING row_id"#, tx.schema());
            let row = tx.query_one(&insert, &[&input.order_id]).map_err(tidemark::Error::from)?;
            Ok(row.get::<_, i64>(0))
        })
        .await?;
    Ok(Receipt { row })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_of_your_own_runs_on_postgres_through_the_public_api() {
    // The blocking client of this test runs off the runtime's workers (the service's own stores
    // live on threads of their own).
    let Some(url) = tokio::task::spawn_blocking(|| server().map(|(url, _)| url)).await.unwrap() else { return };
    let prefix = format!("lib{}", std::process::id());
    let _schemas = Schemas(url.clone(), prefix.clone());
    let dir = tempfile::tempdir().unwrap();
    let store = format!("{url}?schema={prefix}");
    let service = Service::builder()
        .data_dir(dir.path())
        .without_auth("main")
        .postgres(&store)
        .flow(ReservationMachine)
        .migration(
            Database::Inbox,
            Migration::sql("0001_ledger", "CREATE TABLE {s}.ledger (flow_id text PRIMARY KEY, amount bigint NOT NULL)"),
        )
        .migration(
            Database::Workflows,
            Migration::sql(
                "0001_orders",
                "CREATE TABLE {s}.orders (row_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, order_id text UNIQUE)",
            ),
        )
        .consumer("ledger", Typed(Ledger))
        .handler_in(Database::Workflows, "wake", RunEventHandler::new())
        .workflow(tidemark::postgres::Workflow::new("checkout", 1, checkout))
        .build()
        .unwrap();
    service.start().await.unwrap();
    let tenant = service.tenant("main").await.unwrap();

    // A business row and an advance in one PostgreSQL transaction.
    let committed = tenant
        .transaction(|tx, machines| {
            let schema = tx.schema().to_string();
            tx.execute(&format!(r#"CREATE TABLE IF NOT EXISTS "{schema}".holds (flow_id text PRIMARY KEY)"#), &[])?;
            tx.execute(&format!(r#"INSERT INTO "{schema}".holds (flow_id) VALUES ('r-1')"#), &[])?;
            tx.advance(machines, &AdvanceRequest::new("r-1", 0, "reserved", json!({"quantity": 4})))
        })
        .await
        .unwrap();
    assert_eq!(committed.seq, 1);
    // An advance refused inside the transaction rolls the business row back with it.
    let refused = tenant
        .transaction(|tx, machines| {
            let schema = tx.schema().to_string();
            tx.execute(&format!(r#"INSERT INTO "{schema}".holds (flow_id) VALUES ('r-2')"#), &[])?;
            tx.advance(machines, &AdvanceRequest::new("r-1", 0, "reserved", json!({"quantity": 4})))
        })
        .await;
    assert_eq!(refused.unwrap_err().code(), "stale");

    // The run: started, awaited, its transactional step's row written once.
    let handle =
        tenant.start_run(StartRequest::new("order-1", "checkout", 1, json!({"order_id": "order-1"}))).await.unwrap();
    let receipt: Receipt = handle.result().await.unwrap();
    assert!(receipt.row >= 1);
    let run = tenant.run("order-1").await.unwrap().unwrap();
    assert_eq!(run.run.status, RunStatus::Completed);

    // The relay and the drain: the ledger row is there, in the inbox schema.
    let backend = tidemark::service::Postgres::from_url(&store).unwrap();
    let (inbox, producer) = (backend.schema("main", Database::Inbox), backend.schema("main", Database::Producer));
    let (amount, holds) = tokio::task::spawn_blocking(move || {
        let (_, mut client) = server().unwrap();
        let mut amount = None;
        for _ in 0..1_500 {
            let query = format!(r#"SELECT amount FROM "{inbox}".ledger WHERE flow_id = 'r-1'"#);
            if let Some(row) = client.query_opt(&query, &[]).unwrap() {
                amount = Some(row.get::<_, i64>(0));
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let holds: i64 = client.query_one(&format!(r#"SELECT count(*) FROM "{producer}".holds"#), &[]).unwrap().get(0);
        (amount, holds)
    })
    .await
    .unwrap();
    assert_eq!(amount, Some(4), "the ledger row is applied");
    assert_eq!(holds, 1, "the refused transaction's row rolled back");
    service.shutdown().await;
}

#[test]
fn what_the_postgres_builder_refuses_is_typed_and_writes_nothing() {
    let Some((url, mut client)) = server() else { return };
    let prefix = format!("bad{}", std::process::id());
    let _schemas = Schemas(url.clone(), prefix.clone());
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let code = |result: tidemark::Result<tidemark::postgres::Service>| match result {
        Ok(_) => panic!("built"),
        Err(error) => error.code().to_string(),
    };
    // Registrations typed for SQLite cannot move to PostgreSQL.
    let built = Service::builder()
        .data_dir(&data)
        .handler("record", tidemark::store::RecordHandler)
        .postgres(&format!("{url}?schema={prefix}"))
        .build();
    assert_eq!(code(built), "invalid_argument");
    // Not a PostgreSQL URL; a prefix too long.
    assert_eq!(code(Service::builder().data_dir(&data).postgres("sqlite:/tmp/x.db").build()), "invalid_config");
    let long = format!("{url}?schema={}", "p".repeat(25));
    assert_eq!(code(Service::builder().data_dir(&data).postgres(&long).build()), "invalid_config");
    // A server that does not answer: an io error at build.
    let unreachable = format!("postgres://postgres@127.0.0.1:1/test?schema={prefix}");
    assert_eq!(code(Service::builder().data_dir(&data).postgres(&unreachable).build()), "io");
    // A SQLite builder given a PostgreSQL store in its configuration.
    let config = tidemark::service::Config {
        data_dir: data.clone(),
        store: format!("{url}?schema={prefix}"),
        ..tidemark::service::Config::default()
    };
    let sqlite = Service::builder().config(config).build();
    assert_eq!(sqlite.err().map(|e| e.code().to_string()).as_deref(), Some("invalid_config"));
    let schemas: i64 = client
        .query_one("SELECT count(*) FROM pg_namespace WHERE starts_with(nspname, $1)", &[&format!("{prefix}_")])
        .unwrap()
        .get(0);
    assert_eq!(schemas, 0, "nothing was created on the server");
}
