//! Tenant isolation on every route of the HTTP API, and scopes on every route that changes
//! something. The routes are read from `/openapi.json`, so a new route is covered as soon as it
//! exists (the fixture then has to name its ids, or this test fails).
//!
//! Tenant `bravo` holds data behind every route (see `server_fixture.rs`); tenant `alpha` holds
//! nothing. Every request alpha makes with bravo's ids must answer 404 or an empty page, never
//! show bravo's data, and leave bravo's files byte for byte as they were (and bravo's own view
//! through its token unchanged).

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::server_api::write_config;
use crate::server_fixture::{example_body, populate, scope, Fixture, CONFIG, WAIT};
use crate::server_support::{served_on_both_backends, stored, token, Server};

/// True when any array anywhere in the answer has an element: the answer shows data.
fn shows_data(answer: &Value) -> bool {
    match answer {
        Value::Array(items) => !items.is_empty(),
        // One record of the tenant's (a run's result, a schedule) names itself.
        Value::Object(object)
            if ["run_id", "schedule_id"].iter().any(|k| object.get(*k).is_some_and(Value::is_string)) =>
        {
            true
        }
        Value::Object(object) => object.values().any(shows_data),
        _ => false,
    }
}

/// What `tenant` stored (its files, on PostgreSQL its schemas' rows too) once the background
/// loops have nothing left to do: two snapshots in a row, 300 ms apart, are equal (a bounded
/// poll).
fn settled_files(data: &Path, tenant: &str) -> Vec<(String, Vec<u8>)> {
    let started = Instant::now();
    let mut last = stored(data, Some(tenant));
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let now = stored(data, Some(tenant));
        if now == last {
            return now;
        }
        let changed: Vec<&String> = now.iter().zip(&last).filter(|(a, b)| a != b).map(|(a, _)| &a.0).collect();
        assert!(started.elapsed() < WAIT, "bravo's files never stopped changing: {changed:?}");
        last = now;
    }
}

/// Everything bravo reads through its own token on every read route, with its own ids.
fn view(server: &Server, token: &str, fixture: &Fixture, operations: &[(String, String, Value)]) -> Vec<Value> {
    let mut out = Vec::new();
    for (method, path, operation) in operations {
        if method == "GET" && scope(operation).is_some() {
            let concrete = fixture.concrete_path(method, path);
            let (status, answer) = server.call(method, &concrete, Some(token), None);
            assert_eq!(status, 200, "bravo reads its own {concrete}: {answer}");
            out.push(json!({"path": concrete, "answer": answer}));
        }
    }
    out
}

#[test]
fn no_request_of_one_tenant_reads_or_changes_another_tenants_data() {
    served_on_both_backends(|| {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let alpha = token(&data, "alpha", "admin");
        let bravo = token(&data, "bravo", "admin");
        let bravo_read = token(&data, "bravo", "read");
        let bravo_operate = token(&data, "bravo", "operate");
        let server = Server::start(&data, &["--config", &write_config(dir.path(), CONFIG)], &[]);
        let fixture = populate(&server, &bravo, "bravo");
        let (status, mine) = server.call("GET", "/v1/consumers", Some(&alpha), None);
        assert_eq!((status, shows_data(&mine)), (200, false), "alpha starts empty: {mine}");

        let (_, document) = server.call("GET", "/openapi.json", None, None);
        let operations = Fixture::operations(&document);
        let tenant_routes: Vec<_> = operations.iter().filter(|(_, _, op)| scope(op).is_some()).collect();
        assert!(tenant_routes.len() >= 20, "the document lists too few routes: {}", tenant_routes.len());

        let files_before = settled_files(&data, "bravo");
        let view_before = view(&server, &bravo, &fixture, &operations);
        assert!(view_before.iter().all(|v| shows_data(&v["answer"])), "bravo's reads must show data: {view_before:?}");

        // Every route, alpha's token, bravo's ids: reads first (alpha has nothing yet), then writes.
        let mut ordered = tenant_routes.clone();
        ordered.sort_by_key(|(method, _, _)| method != "GET");
        for (method, path, operation) in ordered {
            let concrete = fixture.concrete_path(method, path);
            let body = example_body(&document, operation).map(|example| fixture.body(method, path, &example));
            let (status, answer) = server.call(method, &concrete, Some(&alpha), body.as_ref());
            let what = format!("alpha {method} {concrete}: {status} {answer}");
            assert!(!answer.to_string().contains(&fixture.marker), "{what} shows bravo's data");
            assert!(status != 401 && status != 403 && status < 500, "{what}");
            if method == "GET" {
                // The registry is the service's, the same for every tenant: only its consumers are
                // the tenant's.
                let tenant_part = if path == "/v1/registry" { &answer["consumers"] } else { &answer };
                assert!(status == 404 || (status == 200 && !shows_data(tenant_part)), "{what} must be 404 or empty");
            } else if !(200..300).contains(&status) {
                // A change alpha cannot make is refused as absent, never as someone else's.
                assert_eq!((status, answer["error"]["code"].as_str()), (404, Some("not_found")), "{what}");
            }
        }

        // Ids bravo uses mean nothing to alpha: the same requests start alpha's own data.
        let bravo_start = json!({"workflow": "order_saga", "run_id": "order-ok", "input": {"order_id": format!("order-ok-{}", fixture.marker), "sku": "sku-1", "quantity": 1, "amount": 500}});
        let (status, answer) = server.call("POST", "/v1/runs", Some(&alpha), Some(&bravo_start));
        assert_eq!((status, answer["outcome"].as_str()), (201, Some("started")), "{answer}");
        let (status, answer) =
            server.call("PUT", "/v1/consumers/ledger", Some(&alpha), Some(&json!({"handler": "record"})));
        assert_eq!((status, answer["outcome"].as_str()), (201, Some("declared")), "{answer}");
        let reserve = json!({"expected_seq": 0, "to": "reserved", "quantity": 2});
        let (status, answer) = server.call("POST", "/v1/flows/res-1/advance", Some(&alpha), Some(&reserve));
        assert_eq!(
            (status, answer["outcome"].as_str(), answer["seq"].as_i64()),
            (200, Some("committed"), Some(1)),
            "{answer}"
        );

        // Scopes, on bravo's own data: read cannot operate or administer; operate cannot administer.
        for (method, path, operation) in &tenant_routes {
            let needed = scope(operation).unwrap();
            let concrete = fixture.concrete_path(method, path);
            let body = example_body(&document, operation).map(|example| fixture.body(method, path, &example));
            let refused: &[&str] = match needed.as_str() {
                "read" => &[],
                "operate" => &[&bravo_read],
                "admin" => &[&bravo_read, &bravo_operate],
                other => panic!("{method} {path}: unknown scope {other:?}"),
            };
            for token in refused {
                let (status, answer) = server.call(method, &concrete, Some(token), body.as_ref());
                assert_eq!((status, answer["error"]["code"].as_str()), (403, Some("forbidden")), "{method} {concrete}");
            }
            if needed == "read" {
                let (status, answer) = server.call(method, &concrete, Some(&bravo_read), None);
                assert_eq!(status, 200, "a read token reads {concrete}: {answer}");
            }
        }

        // Alpha's own background loops ran meanwhile (its relay delivered its events); bravo's
        // files and bravo's view are exactly as before.
        server.wait_for(WAIT, |s| {
            let (_, run) = s.call("GET", "/v1/runs/order-ok", Some(&alpha), None);
            (run["run"]["status"] == "completed").then_some(())
        });
        assert_eq!(view(&server, &bravo, &fixture, &operations), view_before, "bravo's view changed");
        let files_after = settled_files(&data, "bravo");
        let changed: Vec<&String> = files_after
            .iter()
            .zip(&files_before)
            .filter(|(after, before)| after != before)
            .map(|(after, _)| &after.0)
            .collect();
        assert_eq!(files_after.len(), files_before.len(), "bravo's files were added or removed");
        assert!(changed.is_empty(), "bravo's files changed: {changed:?}");
    });
}

/// The SQLSTATE of a statement's error, or what the statement answered.
fn sqlstate(client: &mut postgres::Client, sql: &str) -> String {
    match client.batch_execute(sql) {
        Ok(()) => "ok".into(),
        Err(error) => error.code().map_or_else(|| error.to_string(), |c| c.code().to_string()),
    }
}

/// On PostgreSQL the isolation is the database's too: each tenant's schemas belong to a role of
/// its own, which the service's connections for that tenant act as. A connection acting as
/// alpha's role reads alpha's tables, and is refused (SQLSTATE 42501, insufficient privilege)
/// on bravo's tables and on the control schema's tokens, whatever statement a bug might make.
#[test]
fn on_postgres_a_tenant_s_connection_cannot_read_another_tenant_s_schemas() {
    let Some(_postgres) = crate::workflow_cli::on_postgres() else { return };
    let _schemas = crate::server_support::DropServedSchemas;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let alpha = token(&data, "alpha", "admin");
    let bravo = token(&data, "bravo", "admin");
    let server = Server::start(&data, &[], &[]);
    for (token, flow) in [(&alpha, "a-1"), (&bravo, "b-1")] {
        let advance = json!({"expected_seq": 0, "to": "reserved", "quantity": 1});
        let (status, body) = server.call("POST", &format!("/v1/flows/{flow}/advance"), Some(token), Some(&advance));
        assert_eq!(status, 200, "{body}");
    }
    let url = crate::server_support::store_of(&data).expect("on PostgreSQL");
    let backend = tidemark_server::Postgres::from_url(&url).unwrap();
    let producer = |tenant: &str| backend.schema(tenant, tidemark_server::Database::Producer);
    let as_alpha = tidemark_store_postgres::conn_as_role(backend.conn(), &backend.role("alpha")).unwrap();
    let mut client = postgres::Client::connect(&as_alpha, postgres::NoTls).expect("connect as alpha's role");
    let role: String = client.query_one("SELECT current_user::text", &[]).unwrap().get(0);
    assert_eq!(role, backend.role("alpha"));
    let events: i64 =
        client.query_one(&format!("SELECT count(*) FROM {}.outbox", producer("alpha")), &[]).unwrap().get(0);
    assert_eq!(events, 1, "alpha reads its own outbox");
    for table in ["outbox", "flows", "meta"] {
        let read = format!("SELECT * FROM {}.{table}", producer("bravo"));
        assert_eq!(sqlstate(&mut client, &read), "42501", "{read}");
        let write = format!("DELETE FROM {}.{table}", producer("bravo"));
        assert_eq!(sqlstate(&mut client, &write), "42501", "{write}");
    }
    let tokens = format!("SELECT * FROM {}.tokens", backend.control_schema());
    assert_eq!(sqlstate(&mut client, &tokens), "42501", "{tokens}");
    // (The wall is against a statement that names the wrong schema. `SET ROLE` / `RESET ROLE`
    // are checked against the session's login role, a member of every tenant's role: tidemark
    // never sends them; docs/postgres.md, "Tenants".)
}

/// A tenant whose schemas were made before tenant roles (owned by the service's login role) is
/// handed to its role when the service opens it: its schemas, tables and trigger function change
/// owner, its data stays, and the service goes on serving it.
#[test]
fn on_postgres_schemas_made_before_tenant_roles_are_handed_to_the_tenant_s_role() {
    let Some(_postgres) = crate::workflow_cli::on_postgres() else { return };
    let _schemas = crate::server_support::DropServedSchemas;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let alpha = token(&data, "alpha", "admin");
    let url = crate::server_support::store_of(&data).expect("on PostgreSQL");
    let backend = tidemark_server::Postgres::from_url(&url).unwrap();
    let schema = backend.schema("alpha", tidemark_server::Database::Producer);
    // The producer schema as an earlier version left it: made by the login role, one event in it.
    let mut old = tidemark_store_postgres::PgProducer::init(backend.conn(), &schema, "alpha").unwrap();
    let request = tidemark_core::flow::AdvanceRequest {
        flow_id: "a-1".into(),
        expected_seq: 0,
        to_state: "reserved".into(),
        input: json!({"quantity": 1}),
        schema_version: 1,
        traceparent: None,
    };
    tidemark_core::store::ProducerStore::advance_batch(
        &mut old,
        &tidemark_core::reservation::ReservationMachine,
        &[request],
        1,
    )
    .unwrap();
    drop(old);

    let server = Server::start(&data, &[], &[]);
    let (status, flow) = server.call("GET", "/v1/flows/a-1", Some(&alpha), None);
    assert_eq!((status, flow["producer"]["last_seq"].as_i64()), (200, Some(1)), "{flow}");
    let advance = json!({"expected_seq": 1, "to": "confirmed"});
    let (status, body) = server.call("POST", "/v1/flows/a-1/advance", Some(&alpha), Some(&advance));
    assert_eq!((status, body["seq"].as_i64()), (200, Some(2)), "{body}");
    let (_, mut client) = crate::support::postgres_server().unwrap();
    let owners: Vec<String> = client
        .query(
            "SELECT DISTINCT owner FROM (
                SELECT nspowner::regrole::text AS owner FROM pg_namespace WHERE nspname = $1
                UNION ALL SELECT relowner::regrole::text FROM pg_class WHERE relnamespace = to_regnamespace($1)
                UNION ALL SELECT proowner::regrole::text FROM pg_proc WHERE pronamespace = to_regnamespace($1)) o",
            &[&schema],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(owners, vec![backend.role("alpha")], "everything in {schema} is the tenant role's");
}
