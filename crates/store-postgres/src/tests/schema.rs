//! Opening, creating and migrating schemas; bad input and unreachable servers.

use std::sync::{Arc, Barrier};

use tidemark_core::error::codes;
use tidemark_core::policy::RetentionPolicy;
use tidemark_core::store::ProducerStore;

use super::support::test_db;
use crate::{PgConsumer, PgProducer, SCHEMA_VERSION};

fn schema_exists(client: &mut postgres::Client, schema: &str) -> bool {
    client.query_one("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", &[&schema]).unwrap().get(0)
}

/// `open` never creates: a missing schema, or one of another role, is `not_initialized`, and the
/// schema is still missing afterwards. `init` creates, reopens, and refuses another source.
#[test]
fn init_creates_and_open_only_opens() {
    let db = test_db!("open");
    let schema = db.schema("p");
    let mut client = db.client();
    assert_eq!(PgProducer::open(&db.conn, &schema).err().unwrap().code(), codes::NOT_INITIALIZED);
    assert_eq!(PgConsumer::open(&db.conn, &schema).err().unwrap().code(), codes::NOT_INITIALIZED);
    assert!(!schema_exists(&mut client, &schema), "open created the schema");
    // A schema that exists but holds no tidemark tables is not opened either, and left alone.
    client.batch_execute(&format!("CREATE SCHEMA \"{schema}\"")).unwrap();
    assert_eq!(PgProducer::open(&db.conn, &schema).err().unwrap().code(), codes::NOT_INITIALIZED);
    let tables: i64 =
        client.query_one("SELECT count(*) FROM pg_tables WHERE schemaname = $1", &[&schema]).unwrap().get(0);
    assert_eq!(tables, 0);

    let producer = PgProducer::init(&db.conn, &schema, "shop").unwrap();
    let identity = producer.identity().clone();
    drop(producer);
    assert_eq!(PgProducer::open(&db.conn, &schema).unwrap().identity(), &identity);
    assert_eq!(PgProducer::init(&db.conn, &schema, "shop").unwrap().identity(), &identity, "init again reopens");
    assert_eq!(PgProducer::init(&db.conn, &schema, "other").err().unwrap().code(), codes::ALREADY_INITIALIZED);
    // The producer's schema is not a consumer's until initialised as one.
    assert_eq!(PgConsumer::open(&db.conn, &schema).err().unwrap().code(), codes::NOT_INITIALIZED);
    let horizon = RetentionPolicy { horizon_ms: 5_000 };
    PgConsumer::init(&db.conn, &schema, horizon).unwrap();
    let reopened = PgConsumer::init(&db.conn, &schema, RetentionPolicy { horizon_ms: 9_000 }).unwrap();
    assert_eq!(reopened.retention(), horizon, "the horizon is set on first init and kept");
}

/// Bad names and arguments are typed errors before anything is written.
#[test]
fn bad_input_is_refused_before_anything_is_written() {
    let db = test_db!("bad");
    for bad in ["Shop", "1x", "a-b", "x;drop", "pg_x", ""] {
        assert_eq!(PgProducer::init(&db.conn, bad, "shop").err().unwrap().code(), codes::INVALID_ARGUMENT, "{bad}");
        assert_eq!(PgConsumer::open(&db.conn, bad).err().unwrap().code(), codes::INVALID_ARGUMENT, "{bad}");
    }
    let schema = db.schema("p");
    assert_eq!(PgProducer::init(&db.conn, &schema, "bad source!").err().unwrap().code(), codes::INVALID_ID);
    let no_horizon = RetentionPolicy { horizon_ms: 0 };
    assert_eq!(PgConsumer::init(&db.conn, &schema, no_horizon).err().unwrap().code(), codes::INVALID_ARGUMENT);
    assert!(!schema_exists(&mut db.client(), &schema), "a refused init created the schema");
    assert_eq!(
        PgProducer::init("host=127.0.0.1 port=notaport", &schema, "shop").err().unwrap().code(),
        codes::INVALID_ARGUMENT
    );
}

/// A server that does not answer is an `io` error (no server needed for this test).
#[test]
fn an_unreachable_server_is_an_io_error() {
    // Port 1 on the loopback: nothing listens there, the connection is refused at once.
    let error =
        PgProducer::open("host=127.0.0.1 port=1 user=postgres dbname=test connect_timeout=5", "shop").err().unwrap();
    assert_eq!(error.code(), codes::IO, "{error}");
    assert!(error.to_string().contains("cannot connect to PostgreSQL"), "{error}");
}

/// A schema written by a newer build is refused by `open` and `init` alike, and nothing is written
/// to it (the version rows and the meta table are unchanged).
#[test]
fn a_schema_newer_than_the_build_is_refused_and_nothing_is_written() {
    let db = test_db!("newer");
    let schema = db.schema("p");
    PgProducer::init(&db.conn, &schema, "shop").unwrap();
    let mut client = db.client();
    let newer = SCHEMA_VERSION + 1;
    client.execute(&format!("INSERT INTO \"{schema}\".schema_versions (version) VALUES ($1)"), &[&newer]).unwrap();
    let state = |client: &mut postgres::Client| -> (i64, i64, String) {
        let row = client
            .query_one(
                &format!(
                    "SELECT (SELECT count(*) FROM \"{schema}\".schema_versions), (SELECT count(*) FROM \"{schema}\".meta),
                            (SELECT string_agg(key || '=' || value, ',' ORDER BY key) FROM \"{schema}\".meta)"
                ),
                &[],
            )
            .unwrap();
        (row.get(0), row.get(1), row.get(2))
    };
    let before = state(&mut client);
    assert_eq!(PgProducer::open(&db.conn, &schema).err().unwrap().code(), codes::SCHEMA_TOO_NEW);
    assert_eq!(PgProducer::init(&db.conn, &schema, "shop").err().unwrap().code(), codes::SCHEMA_TOO_NEW);
    let horizon = RetentionPolicy::default();
    assert_eq!(PgConsumer::init(&db.conn, &schema, horizon).err().unwrap().code(), codes::SCHEMA_TOO_NEW);
    assert_eq!(state(&mut client), before);
}

/// Many processes starting together on an empty database (a new one, when the connection string
/// allows it): the migration runs once, under the advisory lock, and every `init` and `open`
/// succeeds with the same producer identity.
#[test]
fn many_threads_initialising_one_schema_at_once_migrate_it_once() {
    let mut db = test_db!("race");
    if let Some(empty) = db.empty_database() {
        db.conn = empty;
    }
    let schema = db.schema("p");
    const THREADS: usize = 8;
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|_| {
            let (conn, schema, barrier) = (db.conn.clone(), schema.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                PgProducer::init(&conn, &schema, "shop").map(|p| p.identity().clone())
            })
        })
        .collect();
    let identities: Vec<_> = handles.into_iter().map(|h| h.join().unwrap().unwrap()).collect();
    assert!(identities.windows(2).all(|w| w[0] == w[1]), "one identity for all: {identities:?}");
    let mut client = db.client();
    let versions: Vec<i32> = client
        .query(&format!("SELECT version FROM \"{schema}\".schema_versions ORDER BY version"), &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(versions, (1..=SCHEMA_VERSION).collect::<Vec<_>>());
    // And opens at once, while consumers are initialised in the same schema at the same moment.
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|i| {
            let (conn, schema, barrier) = (db.conn.clone(), schema.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                if i % 2 == 0 {
                    PgProducer::open(&conn, &schema).map(|_| ())
                } else {
                    PgConsumer::init(&conn, &schema, RetentionPolicy::default()).map(|_| ())
                }
            })
        })
        .collect();
    for handle in handles {
        handle.join().unwrap().unwrap();
    }
}

/// A store's connection keeps the server's durability (`synchronous_commit` and `fsync` on, as on
/// the test server: tidemark never sets them), waits for a lock at most the busy timeout, and
/// turns JIT off unless the caller turns it on.
#[test]
fn a_store_connection_keeps_the_servers_durability_and_bounds_its_lock_waits() {
    let db = test_db!("settings");
    let mut producer = PgProducer::init(&db.conn, &db.schema("p"), "shop").unwrap();
    let show = |producer: &mut PgProducer, name: &str| -> String {
        producer.client().query_one(&format!("SHOW {name}"), &[]).unwrap().get(0)
    };
    assert_eq!(show(&mut producer, "synchronous_commit"), "on");
    assert_eq!(show(&mut producer, "fsync"), "on");
    assert_eq!(show(&mut producer, "lock_timeout"), "10s");
    assert_eq!(show(&mut producer, "jit"), "off");
    // The caller's own options are kept beside them, and may turn JIT back on.
    let conn = format!("{} options='-c work_mem=7MB -c jit=on'", db.conn);
    let mut producer = PgProducer::open(&conn, producer.schema()).unwrap();
    assert_eq!(show(&mut producer, "work_mem"), "7MB");
    assert_eq!(show(&mut producer, "jit"), "on");
    assert_eq!(show(&mut producer, "lock_timeout"), "10s");
}
