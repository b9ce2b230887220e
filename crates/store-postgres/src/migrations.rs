//! The user's own schema migrations on PostgreSQL (their business tables, projections), as
//! SQLite's store runs them: named, kept in order, recorded in the schema's `user_migrations`
//! table, never mixed up with tidemark's own versions (`schema.rs`).
//!
//! Each migration runs once, in its own transaction together with its record, under the
//! schema's user-migration advisory lock, so processes starting together take turns and a crash
//! leaves it applied and recorded or neither. A schema that records a migration the code does not
//! list is refused with `unknown_migration` before anything runs.

use std::sync::Arc;

use postgres::{Client, Transaction};
use tidemark_core::{Error, Result};

use crate::schema::{lock, sql, LOCK_USER_MIGRATIONS};
use crate::{col, PgResult};

type Apply = Arc<dyn Fn(&mut Transaction<'_>, &str) -> Result<()> + Send + Sync>;

/// One named migration of the user's own tables in a store's schema.
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
    /// A migration that runs `sql` (one or more statements), with `{s}` replaced by the store's
    /// quoted schema name: `CREATE TABLE {s}.ledger (...)`.
    pub fn sql(name: &str, sql_text: &str) -> Migration {
        let sql_text = sql_text.to_string();
        Migration {
            name: name.to_string(),
            apply: Arc::new(move |tx, schema| tx.batch_execute(&sql(schema, &sql_text)).db()),
        }
    }

    /// A migration that runs `apply(tx, schema)` inside its transaction.
    pub fn with<F>(name: &str, apply: F) -> Migration
    where
        F: Fn(&mut Transaction<'_>, &str) -> Result<()> + Send + Sync + 'static,
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

/// Apply every migration of `migrations` that `schema` (an existing store schema) has not
/// recorded yet, in order; answers the names applied now.
pub fn apply_migrations(
    client: &mut Client,
    schema: &str,
    migrations: &[Migration],
    now_ms: i64,
) -> Result<Vec<String>> {
    validate_migrations(migrations)?;
    crate::schema::validate_schema_name(schema)?;
    if migrations.is_empty() {
        return Ok(Vec::new());
    }
    let listed: Vec<&str> = migrations.iter().map(Migration::name).collect();
    let mut applied = Vec::new();
    for (position, migration) in migrations.iter().enumerate() {
        let mut tx = client.transaction().db()?;
        lock(&mut tx, LOCK_USER_MIGRATIONS, schema)?;
        tx.batch_execute(&sql(
            schema,
            r#"CREATE TABLE IF NOT EXISTS {s}.user_migrations (
                   position      bigint PRIMARY KEY,
                   name          text COLLATE "C" NOT NULL UNIQUE,
                   applied_at_ms bigint NOT NULL
               )"#,
        ))
        .db()?;
        let rows =
            tx.query(&sql(schema, "SELECT position, name FROM {s}.user_migrations ORDER BY position"), &[]).db()?;
        let recorded = rows.iter().map(|r| Ok((col(r, 0)?, col(r, 1)?))).collect::<Result<Vec<(i64, String)>>>()?;
        tidemark_core::migration::check_recorded(&recorded, &listed)?;
        if recorded.len() > position {
            continue;
        }
        (migration.apply)(&mut tx, schema)
            .map_err(|e| Error::store(format!("user migration {:?} failed: {e}", migration.name)))?;
        tx.execute(
            &sql(schema, "INSERT INTO {s}.user_migrations (position, name, applied_at_ms) VALUES ($1, $2, $3)"),
            &[&(position as i64), &migration.name, &now_ms],
        )
        .db()?;
        tx.commit().db()?;
        applied.push(migration.name.clone());
    }
    Ok(applied)
}
