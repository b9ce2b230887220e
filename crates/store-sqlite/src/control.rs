//! The server's control database (`<data>/server.db`): tenants and bearer tokens.
//!
//! Its schema is separate from the outbox/inbox/workflow schema (its own version key in its own
//! `control_meta` table) because no other file ever holds these tables. Token secrets are never
//! stored: only the SHA-256 of the secret (see `tidemark_core::tenancy`).

use std::path::Path;

use rusqlite::{Connection, OptionalExtension, TransactionBehavior};
use tidemark_core::error::codes;
use tidemark_core::tenancy::{validate_label, validate_tenant_id, ControlStore, Scope, TokenText};
pub use tidemark_core::tenancy::{ConsumerRecord, TokenRecord};
use tidemark_core::{Error, Result};

use crate::schema::{apply_migrations, connect};
use crate::{Durability, SqlResult};

const CONTROL_MIGRATIONS: &[&str] = &[r#"
    -- A tenant owns flows, consumers and runs; its data lives in tenants/<tenant_id>/.
    CREATE TABLE tenants (
        tenant_id     TEXT PRIMARY KEY,
        created_at_ms INTEGER NOT NULL
    ) WITHOUT ROWID;

    -- secret_hash: SHA-256 of the token's secret, hex. revoked_at_ms: set once, never cleared.
    CREATE TABLE tokens (
        token_id      TEXT PRIMARY KEY,
        tenant_id     TEXT NOT NULL REFERENCES tenants (tenant_id),
        scope         TEXT NOT NULL CHECK (scope = 'read' OR scope = 'operate' OR scope = 'admin'),
        secret_hash   TEXT NOT NULL,
        label         TEXT NOT NULL,
        created_at_ms INTEGER NOT NULL,
        revoked_at_ms INTEGER
    ) WITHOUT ROWID;

    -- A tenant's consumers and the built-in handler that applies their events.
    CREATE TABLE consumers (
        tenant_id     TEXT NOT NULL REFERENCES tenants (tenant_id),
        consumer_id   TEXT NOT NULL,
        handler       TEXT NOT NULL,
        created_at_ms INTEGER NOT NULL,
        PRIMARY KEY (tenant_id, consumer_id)
    ) WITHOUT ROWID;
"#];

/// The control database of `tidemark serve` (`server.db`): tenants, bearer tokens (hashed) and
/// declared consumers. Tenants' own data is never here; it lives in each tenant's folder.
pub struct SqliteControl {
    conn: Connection,
}

impl SqliteControl {
    /// Open `path`, creating it (and its schema) when `create`.
    pub fn open(path: &Path, create: bool, durability: Durability) -> Result<SqliteControl> {
        let mut conn = connect(path, create, durability, "start `tidemark serve` or create a token first")?;
        migrate(&mut conn)?;
        Ok(SqliteControl { conn })
    }
}

impl ControlStore for SqliteControl {
    /// Changes whenever another connection commits to this file (`PRAGMA data_version`): the
    /// server reloads its token cache when it moves.
    fn data_version(&self) -> Result<i64> {
        // Asked on every request (for revocations): prepared once.
        self.conn.prepare_cached("PRAGMA data_version").db()?.query_row([], |r| r.get(0)).db()
    }

    /// Record `tenant_id` (1..=64 characters of `[a-z0-9_-]`, else `invalid_id`); true when it was
    /// new, false when it was already there.
    fn ensure_tenant(&mut self, tenant_id: &str, now_ms: i64) -> Result<bool> {
        validate_tenant_id(tenant_id)?;
        let n = self
            .conn
            .execute(
                "INSERT INTO tenants (tenant_id, created_at_ms) VALUES (?1, ?2) ON CONFLICT DO NOTHING",
                (tenant_id, now_ms),
            )
            .db()?;
        Ok(n == 1)
    }

    /// Every tenant id, in order.
    fn tenants(&self) -> Result<Vec<String>> {
        let mut stmt = self.conn.prepare_cached("SELECT tenant_id FROM tenants ORDER BY tenant_id").db()?;
        let rows = stmt.query_map([], |r| r.get(0)).db()?;
        rows.collect::<rusqlite::Result<Vec<String>>>().db()
    }

    /// Store a new token for `tenant_id` (created if new), in one transaction.
    fn create_token(
        &mut self,
        token: &TokenText,
        tenant_id: &str,
        scope: Scope,
        label: &str,
        now_ms: i64,
    ) -> Result<TokenRecord> {
        validate_tenant_id(tenant_id)?;
        validate_label(label)?;
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        tx.execute(
            "INSERT INTO tenants (tenant_id, created_at_ms) VALUES (?1, ?2) ON CONFLICT DO NOTHING",
            (tenant_id, now_ms),
        )
        .db()?;
        let record = TokenRecord {
            token_id: token.token_id.clone(),
            tenant_id: tenant_id.to_string(),
            scope,
            label: label.to_string(),
            created_at_ms: now_ms,
            revoked_at_ms: None,
            secret_hash: token.secret_hash(),
        };
        tx.execute(
            "INSERT INTO tokens (token_id, tenant_id, scope, secret_hash, label, created_at_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            (&record.token_id, tenant_id, scope.as_str(), &record.secret_hash, label, now_ms),
        )
        .db()?;
        tx.commit().db()?;
        Ok(record)
    }

    /// Every token, revoked ones included, oldest first.
    fn tokens(&self) -> Result<Vec<TokenRecord>> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT token_id, tenant_id, scope, label, created_at_ms, revoked_at_ms, secret_hash FROM tokens
                 ORDER BY created_at_ms, token_id",
            )
            .db()?;
        let rows = stmt.query_map([], read_token).db()?;
        rows.collect::<rusqlite::Result<Vec<_>>>().db()
    }

    /// Revoke a token (idempotent: revoking twice keeps the first time).
    fn revoke_token(&mut self, token_id: &str, now_ms: i64) -> Result<TokenRecord> {
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        tx.execute(
            "UPDATE tokens SET revoked_at_ms = ?2 WHERE token_id = ?1 AND revoked_at_ms IS NULL",
            (token_id, now_ms),
        )
        .db()?;
        let record = tx
            .query_row(
                "SELECT token_id, tenant_id, scope, label, created_at_ms, revoked_at_ms, secret_hash FROM tokens
                 WHERE token_id = ?1",
                [token_id],
                read_token,
            )
            .optional()
            .db()?
            .ok_or_else(|| Error::not_found(format!("no token {token_id:?}")))?;
        tx.commit().db()?;
        Ok(record)
    }

    /// Declare a consumer (idempotent with the same handler; another handler is `already_exists`).
    fn declare_consumer(
        &mut self,
        tenant_id: &str,
        consumer_id: &str,
        handler: &str,
        now_ms: i64,
    ) -> Result<(ConsumerRecord, bool)> {
        validate_tenant_id(tenant_id)?;
        tidemark_core::id::validate_id("consumer_id", consumer_id)?;
        tidemark_core::id::validate_id("handler", handler)?;
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
        tx.execute(
            "INSERT INTO tenants (tenant_id, created_at_ms) VALUES (?1, ?2) ON CONFLICT DO NOTHING",
            (tenant_id, now_ms),
        )
        .db()?;
        let created = tx
            .execute(
                "INSERT INTO consumers (tenant_id, consumer_id, handler, created_at_ms) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT DO NOTHING",
                (tenant_id, consumer_id, handler, now_ms),
            )
            .db()?
            == 1;
        let record = tx
            .query_row(
                "SELECT tenant_id, consumer_id, handler, created_at_ms FROM consumers WHERE tenant_id = ?1 AND consumer_id = ?2",
                (tenant_id, consumer_id),
                read_consumer,
            )
            .db()?;
        if record.handler != handler {
            return Err(Error::invalid(
                codes::ALREADY_EXISTS,
                format!("consumer {consumer_id:?} exists with handler {:?}, not {handler:?}", record.handler),
            ));
        }
        tx.commit().db()?;
        Ok((record, created))
    }

    /// Consumers of one tenant, or of all tenants.
    fn consumers(&self, tenant_id: Option<&str>) -> Result<Vec<ConsumerRecord>> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT tenant_id, consumer_id, handler, created_at_ms FROM consumers
                 WHERE ?1 IS NULL OR tenant_id = ?1 ORDER BY tenant_id, consumer_id",
            )
            .db()?;
        let rows = stmt.query_map([tenant_id], read_consumer).db()?;
        rows.collect::<rusqlite::Result<Vec<_>>>().db()
    }
}

fn read_consumer(row: &rusqlite::Row) -> rusqlite::Result<ConsumerRecord> {
    Ok(ConsumerRecord {
        tenant_id: row.get(0)?,
        consumer_id: row.get(1)?,
        handler: row.get(2)?,
        created_at_ms: row.get(3)?,
    })
}

fn read_token(row: &rusqlite::Row) -> rusqlite::Result<TokenRecord> {
    let scope: String = row.get(2)?;
    Ok(TokenRecord {
        token_id: row.get(0)?,
        tenant_id: row.get(1)?,
        // The CHECK constraint admits only the three words.
        scope: Scope::parse(&scope).unwrap_or(Scope::Read),
        label: row.get(3)?,
        created_at_ms: row.get(4)?,
        revoked_at_ms: row.get(5)?,
        secret_hash: row.get(6)?,
    })
}

fn migrate(conn: &mut Connection) -> Result<()> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).db()?;
    tx.execute_batch(
        "CREATE TABLE IF NOT EXISTS control_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;",
    )
    .db()?;
    let current: i64 = tx
        .query_row("SELECT value FROM control_meta WHERE key = 'schema_version'", [], |r| r.get::<_, String>(0))
        .optional()
        .db()?
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let latest = CONTROL_MIGRATIONS.len() as i64;
    apply_migrations(&tx, "control_meta", "control database", CONTROL_MIGRATIONS, current, latest)?;
    tx.commit().db()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_stored_hashed_listed_and_revoked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("server.db");
        let mut control = SqliteControl::open(&path, true, Durability::Full).unwrap();
        let token = TokenText::from_random([7; 8], [9; 32]);
        let record = control.create_token(&token, "acme", Scope::Operate, "ci", 1_000).unwrap();
        assert_eq!(record.secret_hash, token.secret_hash());
        assert_eq!(control.tenants().unwrap(), vec!["acme".to_string()]);
        let raw = std::fs::read(&path).unwrap();
        let wal = std::fs::read(dir.path().join("server.db-wal")).unwrap_or_default();
        let needle = token.secret.as_bytes();
        for bytes in [&raw, &wal] {
            assert!(!bytes.windows(needle.len()).any(|w| w == needle), "the secret must never be stored");
        }
        let revoked = control.revoke_token(&token.token_id, 2_000).unwrap();
        assert_eq!(revoked.revoked_at_ms, Some(2_000));
        assert_eq!(control.revoke_token(&token.token_id, 3_000).unwrap().revoked_at_ms, Some(2_000));
        assert_eq!(control.revoke_token("0000000000000000", 3_000).unwrap_err().code(), codes::NOT_FOUND);
        assert_eq!(
            control.create_token(&token, "Bad/Tenant", Scope::Read, "", 1).unwrap_err().code(),
            codes::INVALID_ID
        );
        drop(control);
        let reopened = SqliteControl::open(&path, false, Durability::Full).unwrap();
        assert_eq!(reopened.tokens().unwrap().len(), 1);
    }
}
