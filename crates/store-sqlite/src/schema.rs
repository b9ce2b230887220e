//! Opening files, pragmas and schema migrations.

use std::path::Path;

use rusqlite::{Connection, OpenFlags, OptionalExtension};
use tidemark_core::error::codes;
use tidemark_core::limits::BUSY_TIMEOUT_MS;
use tidemark_core::{Error, Result};

use crate::SqlResult;

/// Migrations, in order. Index i migrates from version i to i+1. Never edit a shipped entry:
/// append a new one (and a test that opens a file of the previous version).
const MIGRATIONS: &[&str] = &[
    // v1: producer tables (flows, outbox, subscriptions, deliveries) and consumer tables (inbox,
    // receipts, cursors, retired_consumers). One file may play either role or both.
    r#"
    CREATE TABLE flows (
        flow_id       TEXT PRIMARY KEY,
        state         TEXT NOT NULL,
        state_data    TEXT NOT NULL,
        last_seq      INTEGER NOT NULL CHECK (last_seq >= 1),
        updated_at_ms INTEGER NOT NULL
    ) WITHOUT ROWID;

    CREATE TABLE outbox (
        position       INTEGER PRIMARY KEY,
        event_id       TEXT NOT NULL UNIQUE,
        flow_id        TEXT NOT NULL,
        seq            INTEGER NOT NULL CHECK (seq >= 1),
        event_type     TEXT NOT NULL,
        schema_version INTEGER NOT NULL,
        payload        TEXT NOT NULL,
        content_hash   TEXT NOT NULL,
        created_at_ms  INTEGER NOT NULL,
        UNIQUE (flow_id, seq)
    );
    CREATE INDEX outbox_age ON outbox (created_at_ms);
    CREATE TRIGGER outbox_immutable BEFORE UPDATE ON outbox
    BEGIN SELECT RAISE(ABORT, 'outbox events are immutable'); END;

    CREATE TABLE subscriptions (
        consumer_id   TEXT PRIMARY KEY,
        endpoint      TEXT NOT NULL,
        created_at_ms INTEGER NOT NULL
    ) WITHOUT ROWID;

    CREATE TABLE deliveries (
        position           INTEGER NOT NULL,
        consumer_id        TEXT NOT NULL,
        status             TEXT NOT NULL CHECK (status IN ('pending', 'accepted', 'quarantined', 'dismissed')),
        attempts           INTEGER NOT NULL DEFAULT 0,
        next_attempt_at_ms INTEGER NOT NULL,
        last_error         TEXT,
        updated_at_ms      INTEGER NOT NULL,
        PRIMARY KEY (position, consumer_id)
    ) WITHOUT ROWID;
    CREATE INDEX deliveries_due ON deliveries (next_attempt_at_ms, position) WHERE status = 'pending';
    CREATE INDEX deliveries_quarantined ON deliveries (position) WHERE status = 'quarantined';

    CREATE TABLE inbox (
        consumer_id    TEXT NOT NULL,
        source         TEXT NOT NULL,
        flow_id        TEXT NOT NULL,
        seq            INTEGER NOT NULL CHECK (seq >= 1),
        event_id       TEXT NOT NULL,
        generation     TEXT NOT NULL,
        event_type     TEXT NOT NULL,
        schema_version INTEGER NOT NULL,
        payload        TEXT NOT NULL,
        content_hash   TEXT NOT NULL,
        created_at_ms  INTEGER NOT NULL,
        received_at_ms INTEGER NOT NULL,
        status         TEXT NOT NULL CHECK (status IN ('pending', 'applied', 'blocked', 'skipped')),
        reason         TEXT,
        status_at_ms   INTEGER NOT NULL,
        PRIMARY KEY (consumer_id, source, flow_id, seq)
    ) WITHOUT ROWID;
    CREATE UNIQUE INDEX inbox_event ON inbox (consumer_id, event_id);
    CREATE INDEX inbox_open ON inbox (consumer_id, source, flow_id, seq) WHERE status IN ('pending', 'blocked');
    CREATE INDEX inbox_done_age ON inbox (status_at_ms) WHERE status IN ('applied', 'skipped');

    CREATE TABLE receipts (
        consumer_id   TEXT NOT NULL,
        source        TEXT NOT NULL,
        flow_id       TEXT NOT NULL,
        seq           INTEGER NOT NULL,
        event_id      TEXT NOT NULL,
        content_hash  TEXT NOT NULL,
        created_at_ms INTEGER NOT NULL,
        PRIMARY KEY (consumer_id, source, flow_id, seq)
    ) WITHOUT ROWID;
    CREATE UNIQUE INDEX receipts_event ON receipts (consumer_id, event_id);
    CREATE INDEX receipts_age ON receipts (created_at_ms);

    CREATE TABLE cursors (
        consumer_id    TEXT NOT NULL,
        source         TEXT NOT NULL,
        flow_id        TEXT NOT NULL,
        high_water_seq INTEGER NOT NULL CHECK (high_water_seq >= 1),
        PRIMARY KEY (consumer_id, source, flow_id)
    ) WITHOUT ROWID;

    CREATE TABLE retired_consumers (
        consumer_id   TEXT PRIMARY KEY,
        renamed_to    TEXT NOT NULL,
        retired_at_ms INTEGER NOT NULL
    ) WITHOUT ROWID;
    "#,
    // v2: each outbox event keeps the producer generation it was committed under, so that a
    // producer restored from a backup (and rotated) redelivers its old events unchanged. Rows of
    // v1 files stay NULL and are read with the current generation.
    r#"
    ALTER TABLE outbox ADD COLUMN generation TEXT;
    "#,
];

/// The schema version this build writes.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// How commits reach the disk. The default is the safe one; `Normal` must be asked for
/// explicitly (`--durability normal`) and can lose the last commits on power loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// `synchronous=FULL`: every commit is fsynced before it returns.
    #[default]
    Full,
    /// `synchronous=NORMAL`: in WAL mode, commits survive a process crash but not power loss.
    Normal,
}

fn configure(conn: &Connection, durability: Durability) -> Result<()> {
    conn.busy_timeout(std::time::Duration::from_millis(BUSY_TIMEOUT_MS)).db()?;
    let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0)).db()?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(Error::store(format!("could not enable WAL mode (got {mode})")));
    }
    let sync = match durability {
        Durability::Full => "FULL",
        Durability::Normal => "NORMAL",
    };
    conn.execute_batch(&format!("PRAGMA synchronous={sync}; PRAGMA foreign_keys=ON;")).db()?;
    conn.set_prepared_statement_cache_capacity(64);
    Ok(())
}

fn schema_version(conn: &Connection) -> Result<i64> {
    let has_meta: bool = conn
        .query_row("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'meta'", [], |r| r.get(0))
        .db()?;
    if !has_meta {
        return Ok(0);
    }
    let version: Option<String> =
        conn.query_row("SELECT value FROM meta WHERE key = 'schema_version'", [], |r| r.get(0)).optional().db()?;
    Ok(version.and_then(|v| v.parse().ok()).unwrap_or(0))
}

/// Bring the schema up to [`SCHEMA_VERSION`] in one immediate transaction.
fn migrate(conn: &mut Connection) -> Result<()> {
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate).db()?;
    let current = schema_version(&tx)?;
    if current > SCHEMA_VERSION {
        return Err(Error::invalid(
            codes::SCHEMA_TOO_NEW,
            format!("database schema version {current} is newer than this build ({SCHEMA_VERSION}); upgrade tidemark"),
        ));
    }
    if current == 0 {
        tx.execute_batch("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;")
            .db()?;
    }
    for (index, sql) in MIGRATIONS.iter().enumerate().skip(current as usize) {
        tx.execute_batch(sql).db()?;
        tx.execute(
            "INSERT INTO meta (key, value) VALUES ('schema_version', ?1)
             ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            [(index + 1).to_string()],
        )
        .db()?;
    }
    tx.commit().db()
}

/// Open (and create if `create`) a tidemark file and migrate it. Opening never resets data.
pub(crate) fn open(path: &Path, create: bool, durability: Durability) -> Result<Connection> {
    let mut flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    if create {
        flags |= OpenFlags::SQLITE_OPEN_CREATE;
    } else if !path.exists() {
        return Err(Error::invalid(
            codes::NOT_INITIALIZED,
            format!("{} does not exist; run `tidemark init` first", path.display()),
        ));
    }
    let mut conn = Connection::open_with_flags(path, flags)
        .map_err(|e| Error::io(format!("cannot open {}: {e}", path.display())))?;
    configure(&conn, durability)?;
    if schema_version(&conn)? != SCHEMA_VERSION {
        migrate(&mut conn)?;
    }
    Ok(conn)
}

/// Open an existing file for reading tables directly (tests, tools). Never creates a file.
pub fn open_existing(path: &Path) -> Result<Connection> {
    open(path, false, Durability::Full)
}

pub(crate) fn meta_get(conn: &Connection, key: &str) -> Result<Option<String>> {
    conn.prepare_cached("SELECT value FROM meta WHERE key = ?1").db()?.query_row([key], |r| r.get(0)).optional().db()
}

pub(crate) fn meta_set(conn: &Connection, key: &str, value: &str) -> Result<()> {
    conn.execute(
        "INSERT INTO meta (key, value) VALUES (?1, ?2) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        [key, value],
    )
    .db()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opening_twice_keeps_data_and_version() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.db");
        let conn = open(&path, true, Durability::Full).unwrap();
        meta_set(&conn, "marker", "kept").unwrap();
        drop(conn);
        let conn = open(&path, false, Durability::Full).unwrap();
        assert_eq!(meta_get(&conn, "marker").unwrap().as_deref(), Some("kept"));
        assert_eq!(schema_version(&conn).unwrap(), SCHEMA_VERSION);
        let sync: i64 = conn.query_row("PRAGMA synchronous", [], |r| r.get(0)).unwrap();
        assert_eq!(sync, 2, "synchronous must be FULL by default");
    }

    #[test]
    fn a_newer_schema_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.db");
        let conn = open(&path, true, Durability::Full).unwrap();
        meta_set(&conn, "schema_version", "999").unwrap();
        drop(conn);
        assert_eq!(open(&path, false, Durability::Full).unwrap_err().code(), codes::SCHEMA_TOO_NEW);
    }

    #[test]
    fn a_version_1_producer_file_is_migrated_and_its_events_take_the_current_generation() {
        use tidemark_core::store::ProducerStore;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v1.db");
        {
            let conn = Connection::open(&path).unwrap();
            conn.execute_batch("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;").unwrap();
            conn.execute_batch(MIGRATIONS[0]).unwrap();
            meta_set(&conn, "schema_version", "1").unwrap();
            meta_set(&conn, "producer.source", "shop").unwrap();
            meta_set(&conn, "producer.generation", "g1").unwrap();
            conn.execute(
                "INSERT INTO outbox (event_id, flow_id, seq, event_type, schema_version, payload, content_hash, created_at_ms)
                 VALUES ('e1', 'f', 1, 'reservation.reserved', 1, '{\"amount\":3}', 'h', 0)",
                [],
            )
            .unwrap();
        }
        let producer = crate::SqliteProducer::open(&path).unwrap();
        let outbox = producer.snapshot(10).unwrap().outbox;
        assert_eq!((outbox[0].event_id.as_str(), outbox[0].generation.as_str()), ("e1", "g1"));
        drop(producer);
        let conn = open(&path, false, Durability::Full).unwrap();
        assert_eq!(schema_version(&conn).unwrap(), SCHEMA_VERSION);
    }

    #[test]
    fn a_missing_file_is_not_created() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing.db");
        assert_eq!(open(&path, false, Durability::Full).unwrap_err().code(), codes::NOT_INITIALIZED);
        assert!(!path.exists());
    }
}
