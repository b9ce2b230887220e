//! The control store of a service on PostgreSQL: tenants, bearer tokens (hashed) and declared
//! consumers, in a schema of their own, shared by every process of the service (as SQLite's
//! `server.db` is shared by the processes of one machine). Token secrets are never stored: only
//! the SHA-256 of the secret (`tidemark_core::tenancy`).
//!
//! The blocking client lives on a thread of its own, so the control store can be called from
//! anywhere, an async task included (the blocking client must never run on a tokio worker).
//! Every write bumps the schema's change counter in its transaction; [`ControlStore::data_version`]
//! reads it, so a cache in another process sees a revocation at its next check. A connection the
//! server closed (a restart) is replaced before the next call.

use std::sync::mpsc;
use std::sync::Mutex;

use postgres::{Client, GenericClient, Row};
use tidemark_core::error::codes;
use tidemark_core::tenancy::{
    validate_label, validate_tenant_id, ConsumerRecord, ControlStore, Scope, TokenRecord, TokenText,
};
use tidemark_core::{Error, Result};

use crate::schema::{connect, lock, sql, validate_schema_name, LOCK_CONTROL};
use crate::{col, PgResult};

/// The control schema's tables, version 1.
const CONTROL_TABLES: &str = r#"
    CREATE TABLE IF NOT EXISTS {s}.control_meta (key text COLLATE "C" PRIMARY KEY, value text NOT NULL);
    CREATE TABLE IF NOT EXISTS {s}.tenants (
        tenant_id     text COLLATE "C" PRIMARY KEY,
        created_at_ms bigint NOT NULL
    );
    CREATE TABLE IF NOT EXISTS {s}.tokens (
        token_id      text COLLATE "C" PRIMARY KEY,
        tenant_id     text COLLATE "C" NOT NULL REFERENCES {s}.tenants (tenant_id),
        scope         text NOT NULL CHECK (scope IN ('read', 'operate', 'admin')),
        secret_hash   text NOT NULL,
        label         text NOT NULL,
        created_at_ms bigint NOT NULL,
        revoked_at_ms bigint
    );
    CREATE TABLE IF NOT EXISTS {s}.consumers (
        tenant_id     text COLLATE "C" NOT NULL REFERENCES {s}.tenants (tenant_id),
        consumer_id   text COLLATE "C" NOT NULL,
        handler       text NOT NULL,
        created_at_ms bigint NOT NULL,
        PRIMARY KEY (tenant_id, consumer_id)
    );
    CREATE TABLE IF NOT EXISTS {s}.control_changes (one boolean PRIMARY KEY CHECK (one), n bigint NOT NULL);
    INSERT INTO {s}.control_changes (one, n) VALUES (true, 0) ON CONFLICT DO NOTHING;
    INSERT INTO {s}.control_meta (key, value) VALUES ('schema_version', '1') ON CONFLICT DO NOTHING;
"#;

/// The control schema version this build writes.
const CONTROL_VERSION: i64 = 1;

type Job = Box<dyn FnOnce(&mut Client) + Send>;

/// The control store in a PostgreSQL schema (see the module docs).
pub struct PgControl {
    schema: String,
    jobs: Mutex<mpsc::Sender<Job>>,
}

impl PgControl {
    /// Connect to `conn_str` and open the control schema `schema`, creating it (and its tables)
    /// when `create`. Without `create` a missing schema is `not_initialized`; a schema of a newer
    /// version is `schema_too_new`. Nothing is written then.
    ///
    /// Connecting and every call run on the store's own thread, so this may be called from an
    /// async task too.
    pub fn open(conn_str: &str, schema: &str, create: bool) -> Result<PgControl> {
        validate_schema_name(schema)?;
        let (jobs, receiver) = mpsc::channel::<Job>();
        let (opened, answer) = mpsc::sync_channel::<Result<()>>(1);
        let (conn_str, owned_schema) = (conn_str.to_string(), schema.to_string());
        std::thread::Builder::new()
            .name(format!("control-{schema}"))
            .spawn(move || {
                let client = connect(&conn_str).and_then(|mut client| {
                    migrate(&mut client, &owned_schema, create)?;
                    Ok(client)
                });
                let mut client = match client {
                    Ok(client) => {
                        let _ = opened.send(Ok(()));
                        client
                    }
                    Err(error) => {
                        let _ = opened.send(Err(error));
                        return;
                    }
                };
                while let Ok(job) = receiver.recv() {
                    if client.is_closed() {
                        // The server closed the connection (a restart): a new one, or the job
                        // fails on the closed one and the next tries again.
                        if let Ok(reconnected) = connect(&conn_str) {
                            client = reconnected;
                        }
                    }
                    job(&mut client);
                }
            })
            .map_err(|e| Error::io(format!("cannot start the control store's thread: {e}")))?;
        answer.recv().map_err(|_| Error::Invariant("the control store's thread stopped (a panic?)".into()))??;
        Ok(PgControl { schema: schema.to_string(), jobs: Mutex::new(jobs) })
    }

    /// The schema the control tables are in.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// Run `f` with the client on the control thread and wait for its answer.
    fn call<T: Send + 'static>(&self, f: impl FnOnce(&mut Client, &str) -> Result<T> + Send + 'static) -> Result<T> {
        let (reply, answer) = mpsc::sync_channel(1);
        let schema = self.schema.clone();
        let job: Job = Box::new(move |client| {
            let _ = reply.send(f(client, &schema));
        });
        self.jobs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(job)
            .map_err(|_| Error::Invariant("the control store's thread stopped".into()))?;
        answer.recv().map_err(|_| Error::Invariant("the control store's thread stopped (a panic?)".into()))?
    }

    /// Run `f` in one transaction that holds the control lock and bumps the change counter.
    fn write<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut postgres::Transaction<'_>, &str) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        self.call(move |client, schema| {
            let mut tx = client.transaction().db()?;
            lock(&mut tx, LOCK_CONTROL, schema)?;
            let answer = f(&mut tx, schema)?;
            tx.execute(&sql(schema, "UPDATE {s}.control_changes SET n = n + 1"), &[]).db()?;
            tx.commit().db()?;
            Ok(answer)
        })
    }
}

fn migrate(client: &mut Client, schema: &str, create: bool) -> Result<()> {
    let mut tx = client.transaction().db()?;
    lock(&mut tx, LOCK_CONTROL, schema)?;
    let table = sql(schema, "{s}.control_meta");
    let found: Option<String> = col(&tx.query_one("SELECT to_regclass($1)::text", &[&table]).db()?, 0)?;
    if found.is_none() && !create {
        return Err(Error::invalid(
            codes::NOT_INITIALIZED,
            format!(
                "PostgreSQL schema {schema} holds no control tables; start `tidemark serve` or create a token first"
            ),
        ));
    }
    if found.is_some() {
        let version: Option<String> = tx
            .query_opt(&sql(schema, "SELECT value FROM {s}.control_meta WHERE key = 'schema_version'"), &[])
            .db()?
            .map(|r| col(&r, 0))
            .transpose()?;
        let version: i64 = version.and_then(|v| v.parse().ok()).unwrap_or(0);
        if version > CONTROL_VERSION {
            return Err(Error::invalid(
                codes::SCHEMA_TOO_NEW,
                format!(
                    "control schema {schema} is at version {version}, newer than this build ({CONTROL_VERSION}); \
                     upgrade tidemark"
                ),
            ));
        }
    }
    tx.batch_execute(&sql(schema, "CREATE SCHEMA IF NOT EXISTS {s}")).db()?;
    tx.batch_execute(&sql(schema, CONTROL_TABLES)).db()?;
    tx.commit().db()
}

fn ensure_tenant_in(tx: &mut impl GenericClient, schema: &str, tenant_id: &str, now_ms: i64) -> Result<bool> {
    let n = tx
        .execute(
            &sql(schema, "INSERT INTO {s}.tenants (tenant_id, created_at_ms) VALUES ($1, $2) ON CONFLICT DO NOTHING"),
            &[&tenant_id, &now_ms],
        )
        .db()?;
    Ok(n == 1)
}

const TOKEN_COLUMNS: &str = "token_id, tenant_id, scope, label, created_at_ms, revoked_at_ms, secret_hash";

fn read_token(row: &Row) -> Result<TokenRecord> {
    let scope: String = col(row, 2)?;
    Ok(TokenRecord {
        token_id: col(row, 0)?,
        tenant_id: col(row, 1)?,
        scope: Scope::parse(&scope).map_err(|_| Error::store(format!("a token row holds scope {scope:?}")))?,
        label: col(row, 3)?,
        created_at_ms: col(row, 4)?,
        revoked_at_ms: col(row, 5)?,
        secret_hash: col(row, 6)?,
    })
}

fn read_consumer(row: &Row) -> Result<ConsumerRecord> {
    Ok(ConsumerRecord {
        tenant_id: col(row, 0)?,
        consumer_id: col(row, 1)?,
        handler: col(row, 2)?,
        created_at_ms: col(row, 3)?,
    })
}

impl ControlStore for PgControl {
    fn is_remote(&self) -> bool {
        true
    }

    fn data_version(&self) -> Result<i64> {
        self.call(|client, schema| {
            col(&client.query_one(&sql(schema, "SELECT n FROM {s}.control_changes"), &[]).db()?, 0)
        })
    }

    fn ensure_tenant(&mut self, tenant_id: &str, now_ms: i64) -> Result<bool> {
        validate_tenant_id(tenant_id)?;
        let tenant_id = tenant_id.to_string();
        self.write(move |tx, schema| ensure_tenant_in(tx, schema, &tenant_id, now_ms))
    }

    fn tenants(&self) -> Result<Vec<String>> {
        self.call(|client, schema| {
            let rows = client.query(&sql(schema, "SELECT tenant_id FROM {s}.tenants ORDER BY tenant_id"), &[]).db()?;
            rows.iter().map(|r| col(r, 0)).collect()
        })
    }

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
        let record = TokenRecord {
            token_id: token.token_id.clone(),
            tenant_id: tenant_id.to_string(),
            scope,
            label: label.to_string(),
            created_at_ms: now_ms,
            revoked_at_ms: None,
            secret_hash: token.secret_hash(),
        };
        self.write(move |tx, schema| {
            ensure_tenant_in(tx, schema, &record.tenant_id, now_ms)?;
            tx.execute(
                &sql(
                    schema,
                    "INSERT INTO {s}.tokens (token_id, tenant_id, scope, secret_hash, label, created_at_ms)
                     VALUES ($1, $2, $3, $4, $5, $6)",
                ),
                &[
                    &record.token_id,
                    &record.tenant_id,
                    &record.scope.as_str(),
                    &record.secret_hash,
                    &record.label,
                    &now_ms,
                ],
            )
            .db()?;
            Ok(record)
        })
    }

    fn tokens(&self) -> Result<Vec<TokenRecord>> {
        self.call(|client, schema| {
            let query = format!("SELECT {TOKEN_COLUMNS} FROM {{s}}.tokens ORDER BY created_at_ms, token_id");
            client.query(&sql(schema, &query), &[]).db()?.iter().map(read_token).collect()
        })
    }

    fn revoke_token(&mut self, token_id: &str, now_ms: i64) -> Result<TokenRecord> {
        let token_id = token_id.to_string();
        self.write(move |tx, schema| {
            tx.execute(
                &sql(schema, "UPDATE {s}.tokens SET revoked_at_ms = $2 WHERE token_id = $1 AND revoked_at_ms IS NULL"),
                &[&token_id, &now_ms],
            )
            .db()?;
            let query = format!("SELECT {TOKEN_COLUMNS} FROM {{s}}.tokens WHERE token_id = $1");
            let row = tx.query_opt(&sql(schema, &query), &[&token_id]).db()?;
            row.as_ref().map(read_token).transpose()?.ok_or_else(|| Error::not_found(format!("no token {token_id:?}")))
        })
    }

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
        let (tenant_id, consumer_id, handler) = (tenant_id.to_string(), consumer_id.to_string(), handler.to_string());
        self.write(move |tx, schema| {
            ensure_tenant_in(tx, schema, &tenant_id, now_ms)?;
            let created = tx
                .execute(
                    &sql(
                        schema,
                        "INSERT INTO {s}.consumers (tenant_id, consumer_id, handler, created_at_ms)
                         VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
                    ),
                    &[&tenant_id, &consumer_id, &handler, &now_ms],
                )
                .db()?
                == 1;
            let row = tx
                .query_one(
                    &sql(
                        schema,
                        "SELECT tenant_id, consumer_id, handler, created_at_ms FROM {s}.consumers
                         WHERE tenant_id = $1 AND consumer_id = $2",
                    ),
                    &[&tenant_id, &consumer_id],
                )
                .db()?;
            let record = read_consumer(&row)?;
            if record.handler != handler {
                return Err(Error::invalid(
                    codes::ALREADY_EXISTS,
                    format!("consumer {consumer_id:?} exists with handler {:?}, not {handler:?}", record.handler),
                ));
            }
            Ok((record, created))
        })
    }

    fn consumers(&self, tenant_id: Option<&str>) -> Result<Vec<ConsumerRecord>> {
        let tenant_id = tenant_id.map(str::to_string);
        self.call(move |client, schema| {
            let rows = client
                .query(
                    &sql(
                        schema,
                        "SELECT tenant_id, consumer_id, handler, created_at_ms FROM {s}.consumers
                         WHERE $1::text IS NULL OR tenant_id = $1 ORDER BY tenant_id, consumer_id",
                    ),
                    &[&tenant_id],
                )
                .db()?;
            rows.iter().map(read_consumer).collect()
        })
    }
}
