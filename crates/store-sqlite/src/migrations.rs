//! The user's own schema migrations (their business tables, projections), run beside
//! tidemark's and never mixed up with them: tidemark's schema is versioned by `PRAGMA
//! user_version` and its migration list (`schema.rs`); a user's migrations are named, kept in
//! order, and recorded in the file's `user_migrations` table (created by the first run).
//!
//! Each migration runs once, in its own `BEGIN IMMEDIATE` transaction together with its record,
//! so a crash leaves it applied and recorded or neither; processes starting together take turns.
//! A file that records a migration the code does not list (a newer build migrated it, or the
//! list was edited) is refused with `unknown_migration` before anything runs.

use std::sync::Arc;

use rusqlite::{Connection, TransactionBehavior};
pub use tidemark_core::migration::UNKNOWN_MIGRATION;
use tidemark_core::{Error, Result};

use crate::SqlResult;

type Apply = Arc<dyn Fn(&Connection) -> Result<()> + Send + Sync>;

/// One named migration of the user's own tables.
#[derive(Clone)]
pub struct Migration {
    name: String,
    apply: Apply,
}

impl std::fmt::Debug for Migration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Migration").field("name", &self.name).finish_non_exhaustive()
    }
}

impl Migration {
    /// A migration that runs `sql` (one or more statements).
    pub fn sql(name: &str, sql: &str) -> Migration {
        let sql = sql.to_string();
        Migration { name: name.to_string(), apply: Arc::new(move |tx| tx.execute_batch(&sql).db()) }
    }

    /// A migration that runs `apply` inside its transaction (for example to create tables and
    /// register them with [`crate::register_projection_table`]).
    pub fn with<F>(name: &str, apply: F) -> Migration
    where
        F: Fn(&Connection) -> Result<()> + Send + Sync + 'static,
    {
        Migration { name: name.to_string(), apply: Arc::new(apply) }
    }

    /// The migration's name (an identifier, unique in its list).
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// Check a list before it runs anywhere: names are identifiers and unique.
pub fn validate_migrations(migrations: &[Migration]) -> Result<()> {
    tidemark_core::migration::validate_names(migrations.iter().map(Migration::name))
}

/// Apply every migration of `migrations` that `conn`'s file has not recorded yet, in order;
/// answers the names applied now.
pub fn apply_migrations(conn: &Connection, migrations: &[Migration], now_ms: i64) -> Result<Vec<String>> {
    validate_migrations(migrations)?;
    if migrations.is_empty() {
        return Ok(Vec::new());
    }
    let listed: Vec<&str> = migrations.iter().map(Migration::name).collect();
    let mut applied = Vec::new();
    for (position, migration) in migrations.iter().enumerate() {
        // IMMEDIATE, as every store write: processes starting together take turns.
        let tx = rusqlite::Transaction::new_unchecked(conn, TransactionBehavior::Immediate).db()?;
        tx.execute_batch(
            "CREATE TABLE IF NOT EXISTS user_migrations (
                 position      INTEGER PRIMARY KEY,
                 name          TEXT NOT NULL UNIQUE,
                 applied_at_ms INTEGER NOT NULL
             )",
        )
        .db()?;
        let recorded: Vec<(i64, String)> = {
            let mut stmt = tx.prepare("SELECT position, name FROM user_migrations ORDER BY position").db()?;
            let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).db()?;
            rows.collect::<rusqlite::Result<_>>().db()?
        };
        tidemark_core::migration::check_recorded(&recorded, &listed)?;
        if recorded.len() > position {
            continue;
        }
        (migration.apply)(&tx).map_err(|e| Error::store(format!("user migration {:?} failed: {e}", migration.name)))?;
        tx.execute(
            "INSERT INTO user_migrations (position, name, applied_at_ms) VALUES (?1, ?2, ?3)",
            rusqlite::params![position as i64, migration.name, now_ms],
        )
        .db()?;
        tx.commit().db()?;
        applied.push(migration.name.clone());
    }
    Ok(applied)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidemark_core::error::codes;

    fn open(dir: &tempfile::TempDir) -> Connection {
        Connection::open(dir.path().join("app.db")).unwrap()
    }

    #[test]
    fn migrations_run_once_in_order_and_a_file_ahead_of_the_code_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let first = vec![Migration::sql("0001_accounts", "CREATE TABLE accounts (id TEXT PRIMARY KEY)")];
        let conn = open(&dir);
        assert_eq!(apply_migrations(&conn, &first, 1).unwrap(), ["0001_accounts"]);
        assert!(apply_migrations(&conn, &first, 2).unwrap().is_empty(), "applied once");
        let both = vec![
            first[0].clone(),
            Migration::with("0002_balance", |tx| tx.execute_batch("ALTER TABLE accounts ADD balance INTEGER").db()),
        ];
        assert_eq!(apply_migrations(&conn, &both, 3).unwrap(), ["0002_balance"]);
        // An older build (the first list only) is refused on this file, and so is a reordered one.
        assert_eq!(apply_migrations(&conn, &first, 4).unwrap_err().code(), UNKNOWN_MIGRATION);
        let reordered = vec![both[1].clone(), both[0].clone()];
        assert_eq!(apply_migrations(&conn, &reordered, 5).unwrap_err().code(), UNKNOWN_MIGRATION);
        // A failing migration commits nothing: neither its effect nor its record.
        let failing = vec![
            both[0].clone(),
            both[1].clone(),
            Migration::sql("0003_broken", "CREATE TABLE t (x); SELECT * FROM nowhere"),
        ];
        assert_eq!(apply_migrations(&conn, &failing, 6).unwrap_err().code(), codes::STORE);
        let tables: i64 =
            conn.query_row("SELECT count(*) FROM sqlite_master WHERE name = 't'", [], |r| r.get(0)).unwrap();
        let recorded: i64 = conn.query_row("SELECT count(*) FROM user_migrations", [], |r| r.get(0)).unwrap();
        assert_eq!((tables, recorded), (0, 2));
        let twice = vec![first[0].clone(), first[0].clone()];
        assert_eq!(validate_migrations(&twice).unwrap_err().code(), codes::ALREADY_EXISTS);
    }
}
