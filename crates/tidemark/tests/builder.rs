//! The builder refuses bad registrations at `build()` with a typed error and a stable code, and
//! writes nothing (the data folder is not even created); the public API carries a user's own
//! projection rows through `rename_consumer`.

/// A service of your own on PostgreSQL (a module of this test binary rather than a binary of
/// its own: each binary links the whole stack).
mod on_postgres;

use serde::Deserialize;
use serde_json::json;
use tidemark::prelude::*;
use tidemark::reservation::ReservationMachine;
use tidemark::sqlite::{apply_migrations, register_projection_table, SqliteConsumer};
use tidemark::store::{ConsumerStore, DrainScope, RetentionPolicy};

/// A machine whose states are given at construction (to make collisions on purpose).
struct Named(&'static str, Vec<&'static str>);

impl FlowMachine for Named {
    fn name(&self) -> &str {
        self.0
    }
    fn states(&self) -> Vec<&str> {
        self.1.clone()
    }
    fn initial(&self) -> tidemark::flow::FlowState {
        tidemark::flow::FlowState { state: self.1[0].to_string(), data: json!({}) }
    }
    fn validate(&self, _: &AdvanceRequest) -> tidemark::Result<()> {
        Ok(())
    }
    fn decide(
        &self,
        _: &tidemark::flow::FlowState,
        request: &AdvanceRequest,
    ) -> Result<tidemark::flow::Decision, String> {
        Ok(tidemark::flow::Decision {
            next: tidemark::flow::FlowState { state: request.to_state.clone(), data: json!({}) },
            event_type: "named.moved".into(),
            payload: json!({}),
        })
    }
}

async fn noop(_: Context, _: serde_json::Value) -> Result<(), WorkflowError> {
    Ok(())
}

fn code_of(builder: tidemark::ServiceBuilder, data: &std::path::Path) -> String {
    match builder.data_dir(data).build() {
        Ok(_) => panic!("the builder accepted a bad registration"),
        Err(error) => {
            assert!(error.is_invalid_input(), "a bad registration is bad input: {error:?}");
            error.code().to_string()
        }
    }
}

#[test]
fn bad_registrations_are_typed_errors_at_build_and_create_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let cases: Vec<(&str, tidemark::ServiceBuilder, &str)> = vec![
        (
            "two workflows with one name and version",
            Service::builder()
                .workflow(tidemark::workflow("checkout", 1, noop))
                .workflow(tidemark::workflow("checkout", 1, noop)),
            "already_exists",
        ),
        (
            "a queue declared twice",
            Service::builder()
                .queue(tidemark::workflow::QueueSpec::new("mail"))
                .queue(tidemark::workflow::QueueSpec::new("mail").concurrency(2)),
            "already_exists",
        ),
        (
            "a queue that could never admit a run",
            Service::builder().queue(tidemark::workflow::QueueSpec::new("mail").concurrency(0)),
            "invalid_argument",
        ),
        (
            "a per-tenant workflow clashing with a shared one",
            Service::builder()
                .workflow(tidemark::workflow("checkout", 2, noop))
                .tenant_workflows(&[("checkout", 2)], |_| Ok(vec![tidemark::workflow("checkout", 2, noop)])),
            "already_exists",
        ),
        (
            "a consumer whose handler is not registered",
            Service::builder().declare_consumer("ledger", "ledger_handler"),
            "unknown_handler",
        ),
        (
            "a machine sharing a state with the reservation machine",
            Service::builder().flow(ReservationMachine).flow(Named("hold", vec!["hold.new", "reserved"])),
            "state_collision",
        ),
        (
            "a machine sharing a state with the built-in stream",
            Service::builder().flow(Named("log", vec!["log.new", "stream"])),
            "state_collision",
        ),
        (
            "two machines with one name",
            Service::builder().flow(Named("m", vec!["a"])).flow(Named("m", vec!["b"])),
            "already_exists",
        ),
        ("a state that is not an identifier", Service::builder().flow(Named("m", vec!["a b"])), "invalid_id"),
        (
            "two handlers with one name",
            Service::builder()
                .handler("h", tidemark::store::RecordHandler)
                .handler("h", tidemark::store::RecordHandler),
            "already_exists",
        ),
        (
            "a handler on the producer database",
            Service::builder().handler_in(Database::Producer, "h", tidemark::store::RecordHandler),
            "invalid_argument",
        ),
        (
            "two migrations with one name",
            Service::builder()
                .migration(Database::Inbox, Migration::sql("0001", "SELECT 1"))
                .migration(Database::Inbox, Migration::sql("0001", "SELECT 2")),
            "already_exists",
        ),
        ("a saga without steps", Service::builder().workflow(tidemark::Saga::new("empty", 1)), "invalid_argument"),
        (
            "a consumer fed from elsewhere whose handler is not registered",
            Service::builder().declare_consumer_unsubscribed("ledger", "ledger_handler"),
            "unknown_handler",
        ),
        ("a subscription to a file", Service::builder().subscribe("audit", "/var/audit.db"), "invalid_endpoint"),
        ("a subscription to no endpoint kind", Service::builder().subscribe("audit", "ftp://h/x"), "invalid_endpoint"),
        (
            "one subscriber subscribed twice",
            Service::builder().subscribe("audit", "pull:").subscribe("audit", "nats://127.0.0.1:4222/audit"),
            "already_exists",
        ),
        (
            "a subscriber that is also a declared consumer fed by the outboxes",
            Service::builder()
                .handler("h", tidemark::store::RecordHandler)
                .declare_consumer("ledger", "h")
                .subscribe("ledger", "pull:"),
            "already_exists",
        ),
        (
            "a source that is no broker",
            Service::builder().source(tidemark::service::SourceConfig {
                tenant: "shipping".into(),
                consumer: "ledger".into(),
                from: "http://127.0.0.1:7400/v1/consumers/ledger/inbox".into(),
                stream: None,
                durable: None,
                batch: 100,
                ack_wait_ms: None,
                session_timeout_ms: None,
            }),
            "invalid_config",
        ),
    ];
    for (what, builder, code) in cases {
        assert_eq!(code_of(builder, &data), code, "{what}");
        assert!(!data.exists(), "{what}: a refused build created the data folder");
    }
    // The same registrations without the mistake build.
    let service = Service::builder()
        .data_dir(&data)
        .flow(ReservationMachine)
        .flow(Named("hold", vec!["hold.new", "held"]))
        .handler("h", tidemark::store::RecordHandler)
        .declare_consumer("ledger", "h")
        .workflow(tidemark::workflow("checkout", 1, noop))
        .workflow(tidemark::workflow("checkout", 2, noop))
        .build()
        .unwrap();
    let names: Vec<String> = service.registry().machine_infos().into_iter().map(|m| m.name).collect();
    assert_eq!(names, ["stream", "reservation", "hold"]);
    assert_eq!(service.registry().workflow_names(), [("checkout".to_string(), 1), ("checkout".to_string(), 2)]);
}

/// docs/protocol.md says a consumer's rename moves its projections: a user's own table, once
/// registered in its migration, moves in the rename's transaction.
#[test]
fn a_registered_user_projection_moves_with_its_consumer() {
    #[derive(Clone)]
    struct Ledger;
    #[derive(Deserialize)]
    struct Amount {
        amount: i64,
    }
    impl EventHandler<Connection> for Ledger {
        type Event = Amount;
        fn handle(
            &mut self,
            tx: &Connection,
            consumer_id: &str,
            _: &Envelope,
            event: Amount,
        ) -> Result<(), HandleError> {
            tx.execute("INSERT INTO ledger (consumer_id, amount) VALUES (?1, ?2)", (consumer_id, event.amount))
                .map_err(|e| HandleError::Failed(e.into()))?;
            Ok(())
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut consumer = SqliteConsumer::init(&path, RetentionPolicy::default()).unwrap();
    let migration = Migration::with("0001_ledger", |tx| {
        tx.execute_batch("CREATE TABLE ledger (consumer_id TEXT NOT NULL, amount INTEGER NOT NULL)")?;
        register_projection_table(tx, "ledger")
    });
    apply_migrations(consumer.connection(), &[migration], 1).unwrap();
    let event = Envelope {
        event_id: "e1".into(),
        source: "shop".into(),
        generation: "g1".into(),
        flow_id: "pay-1".into(),
        seq: 1,
        event_type: "paid".into(),
        schema_version: 1,
        payload: json!({"amount": 7}),
        created_at_ms: 1,
        traceparent: None,
    };
    consumer.receive_batch(&[("ledger-v1", &event)], 2).unwrap();
    let report = consumer.drain("ledger-v1", &DrainScope::All, 10, &mut Typed(Ledger), 3).unwrap();
    assert_eq!(report.applied, 1);

    let renamed = consumer.rename_consumer("ledger-v1", "ledger-v2", 4).unwrap();
    assert_eq!(renamed.projections, 1, "the user's row moved: {renamed:?}");
    let owners: Vec<String> = consumer
        .connection()
        .prepare("SELECT consumer_id FROM ledger")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(owners, ["ledger-v2"]);
    // Registering a table without a consumer_id column is refused.
    consumer.connection().execute_batch("CREATE TABLE notes (text TEXT)").unwrap();
    assert_eq!(register_projection_table(consumer.connection(), "notes").unwrap_err().code(), "invalid_argument");
}

/// A consumer declared with `declare_consumer_unsubscribed` is not fed by the tenant's own
/// outboxes; a subscription declared with `subscribe` is made once in both, and moves when the
/// service is built again with another endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_fed_from_elsewhere_is_not_subscribed_and_a_declared_subscription_is_made_once() {
    use tidemark::store::ProducerStore;
    let dir = tempfile::tempdir().unwrap();
    let build = |endpoint: &str| {
        Service::builder()
            .data_dir(dir.path())
            .without_auth("t")
            .handler("h", tidemark::store::RecordHandler)
            .declare_consumer("local", "h")
            .declare_consumer_unsubscribed("remote", "h")
            // The same id as the consumer fed from elsewhere: as in examples/two-services, where
            // shipping's inbox `orders` receives orders' commands and its subscriber `orders`
            // is orders' inbox for the replies.
            .subscribe("remote", endpoint)
            .build()
            .unwrap()
    };
    async fn subscriptions(service: &Service) -> Vec<Vec<(String, String)>> {
        let tenant = service.tenant("t").await.unwrap();
        let mut all = Vec::new();
        for outbox in tenant.outboxes() {
            let listed = outbox.call(|p| p.store.subscriptions()).await.unwrap();
            let mut listed: Vec<(String, String)> = listed.into_iter().map(|s| (s.consumer_id, s.endpoint)).collect();
            // A file endpoint's path is the tenant's own database: only its kind matters here.
            for (_, endpoint) in listed.iter_mut().filter(|(_, e)| e.ends_with(".db")) {
                *endpoint = "a file".into();
            }
            all.push(listed);
        }
        all
    }

    let service = build("pull:");
    service.start().await.unwrap();
    let expected = vec![("local".to_string(), "a file".to_string()), ("remote".to_string(), "pull:".to_string())];
    assert_eq!(subscriptions(&service).await, [expected.clone(), expected]);
    let declared: Vec<String> = service.state().consumers("t").unwrap().into_iter().map(|c| c.consumer_id).collect();
    assert_eq!(declared, ["local", "remote"], "declared, but only `local` is subscribed to its own outboxes");
    service.shutdown().await;
    drop(service);

    let http = "http://127.0.0.1:9/v1/consumers/remote/inbox";
    let service = build(http);
    service.start().await.unwrap();
    let expected = vec![("local".to_string(), "a file".to_string()), ("remote".to_string(), http.to_string())];
    assert_eq!(subscriptions(&service).await, [expected.clone(), expected], "the subscription moved");
    service.shutdown().await;
}
