//! Connecting, schema names, versioned migrations and the statement cache.

use std::collections::HashMap;
use std::str::FromStr;

use postgres::{Client, GenericClient, NoTls, Statement};
use tidemark_core::error::codes;
use tidemark_core::limits::BUSY_TIMEOUT_MS;
use tidemark_core::{Error, Result};

pub use tidemark_core::location::{validate_schema_name, SCHEMA_NAME_BYTES_MAX};

use crate::{col, PgResult};

/// How long connecting may take when the connection string sets no `connect_timeout`, in ms.
pub const CONNECT_TIMEOUT_MS_DEFAULT: u64 = 10_000;

/// The `classid` of the transaction-scoped advisory locks this crate takes (the `objid` is
/// `hashtext(schema)`): migrations of one schema run once even when several processes start
/// together.
const LOCK_MIGRATE: i32 = 0x746d_0001;
/// The advisory lock of a producer's delivery bookkeeping (record, resolve, redeliver, prune,
/// subscribe): these run one at a time per producer, as SQLite's single writer runs them.
/// Advances do not take it (they serialise on the counter row instead).
pub(crate) const LOCK_DELIVERIES: i32 = 0x746d_0002;
/// The advisory lock of a consumer schema's writes (receive, drain, skip, prune, rename): one
/// writer at a time per consumer schema, as on SQLite.
pub(crate) const LOCK_CONSUMER: i32 = 0x746d_0003;
/// A workflow type's concurrency budget (`objid` is `hashtext(schema || '/' || workflow)`): a
/// claim that honours a per-type limit holds it while it counts the type's live leases and
/// leases more, so two claims never spend one budget twice. Claims only.
pub(crate) const LOCK_WORKFLOW_TYPE: i32 = 0x746d_0004;
/// A serialization key of runs (`objid` is `hashtext(schema || '/' || key)`): a claim that
/// leases a keyed run holds it while it checks, with a fresh snapshot, that no other run of the
/// key holds a live lease. Claims only, taken in key order.
pub(crate) const LOCK_RUN_KEY: i32 = 0x746d_0005;
/// The schedules of a schema (`put_schedule`'s count of schedules against `SCHEDULES_MAX`).
pub(crate) const LOCK_SCHEDULES: i32 = 0x746d_0006;
/// A queue's room (`objid` is `hashtext(schema || '/' || queue)`): a claim holds it while it
/// counts the queue's admitted runs and admits more. Claims only, queues in name order, after the
/// per-type locks.
pub(crate) const LOCK_QUEUE: i32 = 0x746d_0007;
/// The queue declarations of a schema (`put_queue`'s count of queues against `QUEUES_MAX`).
pub(crate) const LOCK_QUEUES: i32 = 0x746d_0008;
/// The user's own migrations of a schema (`migrations.rs`): processes starting together take
/// turns.
pub(crate) const LOCK_USER_MIGRATIONS: i32 = 0x746d_0009;
/// The control schema's writes (tenants, tokens, consumers; `control.rs`).
pub(crate) const LOCK_CONTROL: i32 = 0x746d_000a;
/// The creation of a tenant's role and the hand-over of its schemas (`roles.rs`).
pub(crate) const LOCK_ROLES: i32 = 0x746d_000b;

/// Migrations of one store schema, in order: index i migrates from version i to i+1. `{s}` is
/// replaced by the quoted schema name. Never edit a shipped entry: append a new one (and a test
/// that opens a schema of the previous version).
///
/// Identifier columns are `COLLATE "C"`: listings sort by them, and byte order is what SQLite and
/// the model sort by (a database's default collation may be a locale's).
const MIGRATIONS: &[&str] = &[
    // v1: the producer tables (flows, outbox, subscriptions with their cursors, deliveries as
    // exceptions, the position counter) and the consumer tables (inbox, receipts, cursors,
    // retired ids), as SQLite's schema v8 has them. One schema may play either role or both.
    r#"
    CREATE TABLE {s}.meta (
        key   text COLLATE "C" PRIMARY KEY,
        value text NOT NULL
    );

    -- The position counter: one row, locked by every advance before it reads anything and
    -- updated in the same transaction, so positions become visible in commit order.
    CREATE TABLE {s}.positions (
        only_row      boolean PRIMARY KEY DEFAULT true CHECK (only_row),
        last_position bigint NOT NULL CHECK (last_position >= 0)
    );
    INSERT INTO {s}.positions (only_row, last_position) VALUES (true, 0);

    CREATE TABLE {s}.flows (
        flow_id       text COLLATE "C" PRIMARY KEY,
        state         text NOT NULL,
        state_data    text NOT NULL,
        last_seq      bigint NOT NULL CHECK (last_seq >= 1),
        updated_at_ms bigint NOT NULL
    );

    CREATE TABLE {s}.outbox (
        position       bigint PRIMARY KEY CHECK (position >= 1),
        event_id       text COLLATE "C" NOT NULL UNIQUE,
        flow_id        text COLLATE "C" NOT NULL,
        seq            bigint NOT NULL CHECK (seq >= 1),
        event_type     text NOT NULL,
        schema_version integer NOT NULL,
        payload        text NOT NULL,
        content_hash   text NOT NULL,
        created_at_ms  bigint NOT NULL,
        generation     text NOT NULL,
        UNIQUE (flow_id, seq)
    );
    CREATE FUNCTION {s}.outbox_immutable() RETURNS trigger LANGUAGE plpgsql AS
        $$ BEGIN RAISE EXCEPTION 'outbox events are immutable'; END $$;
    CREATE TRIGGER outbox_immutable BEFORE UPDATE ON {s}.outbox
        FOR EACH ROW EXECUTE FUNCTION {s}.outbox_immutable();

    CREATE TABLE {s}.subscriptions (
        consumer_id        text COLLATE "C" PRIMARY KEY,
        endpoint           text NOT NULL,
        created_at_ms      bigint NOT NULL,
        from_position      bigint NOT NULL,
        delivered_position bigint NOT NULL
    );

    CREATE TABLE {s}.deliveries (
        position           bigint NOT NULL,
        consumer_id        text COLLATE "C" NOT NULL,
        status             text NOT NULL CHECK (status IN ('pending', 'accepted', 'quarantined', 'dismissed')),
        attempts           integer NOT NULL DEFAULT 0,
        next_attempt_at_ms bigint NOT NULL,
        last_error         text,
        updated_at_ms      bigint NOT NULL,
        PRIMARY KEY (position, consumer_id)
    );
    CREATE INDEX deliveries_due ON {s}.deliveries (next_attempt_at_ms, position) WHERE status = 'pending';
    CREATE INDEX deliveries_consumer ON {s}.deliveries (consumer_id, position);

    CREATE TABLE {s}.inbox (
        record         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        consumer_id    text COLLATE "C" NOT NULL,
        source         text COLLATE "C" NOT NULL,
        flow_id        text COLLATE "C" NOT NULL,
        seq            bigint NOT NULL CHECK (seq >= 1),
        event_id       text COLLATE "C" NOT NULL,
        generation     text NOT NULL,
        event_type     text NOT NULL,
        schema_version integer NOT NULL,
        payload        text NOT NULL,
        content_hash   text NOT NULL,
        created_at_ms  bigint NOT NULL,
        received_at_ms bigint NOT NULL,
        status         text NOT NULL CHECK (status IN ('pending', 'applied', 'blocked', 'skipped')),
        reason         text,
        status_at_ms   bigint NOT NULL,
        UNIQUE (consumer_id, source, flow_id, seq),
        UNIQUE (event_id, consumer_id)
    );
    CREATE INDEX inbox_open ON {s}.inbox (consumer_id, source, flow_id, seq) WHERE status IN ('pending', 'blocked');

    CREATE TABLE {s}.receipts (
        consumer_id   text COLLATE "C" NOT NULL,
        source        text COLLATE "C" NOT NULL,
        flow_id       text COLLATE "C" NOT NULL,
        seq           bigint NOT NULL,
        event_id      text COLLATE "C" NOT NULL,
        content_hash  text NOT NULL,
        created_at_ms bigint NOT NULL,
        generation    text,
        PRIMARY KEY (consumer_id, source, flow_id, seq),
        UNIQUE (event_id, consumer_id)
    );
    CREATE INDEX receipts_age ON {s}.receipts (created_at_ms);

    CREATE TABLE {s}.cursors (
        consumer_id    text COLLATE "C" NOT NULL,
        source         text COLLATE "C" NOT NULL,
        flow_id        text COLLATE "C" NOT NULL,
        high_water_seq bigint NOT NULL CHECK (high_water_seq >= 1),
        PRIMARY KEY (consumer_id, source, flow_id)
    );

    CREATE TABLE {s}.retired_consumers (
        consumer_id   text COLLATE "C" PRIMARY KEY,
        renamed_to    text NOT NULL,
        retired_at_ms bigint NOT NULL
    );
    "#,
    // v2: durable workflows, schedules, queues and published values (`workflow/`), the tables of
    // SQLite's v3 and v9 with the
    // same columns, checks and indexes (SQLite's `schema.rs` gives every column's reason). The
    // active statuses are written `status IN ('pending', 'running', 'sleeping', 'waiting',
    // 'compensating')` exactly like this in the partial indexes and in every query that must use
    // them (the planner proves a partial index's predicate from an identical clause). Versions
    // are `bigint` (any `u32`), positions and attempts `integer`; JSON is `text`, the canonical
    // text serde_json writes, read back as it was written (not `jsonb`, which would renormalise
    // it). Every foreign key has the index its checks and the purge's deletes need (the
    // primary keys lead with `run_id`).
    r#"
    CREATE TABLE {s}.runs (
        run_id              text COLLATE "C" PRIMARY KEY,
        workflow            text COLLATE "C" NOT NULL,
        version             bigint NOT NULL CHECK (version >= 1),
        input               text NOT NULL,
        input_hash          text NOT NULL,
        key                 text COLLATE "C",
        status              text NOT NULL CHECK (status IN ('pending', 'running', 'sleeping', 'waiting',
                                'compensating', 'completed', 'compensated', 'failed', 'cancelled', 'parked')),
        result              text,
        error               text,
        wake_at_ms          bigint NOT NULL,
        waiting_for         text COLLATE "C",
        cancel_requested    boolean NOT NULL DEFAULT false,
        forked_from         text COLLATE "C",
        lease_owner         text COLLATE "C",
        lease_token         text COLLATE "C",
        lease_expires_at_ms bigint,
        recoveries          integer NOT NULL DEFAULT 0 CHECK (recoveries >= 0),
        created_at_ms       bigint NOT NULL,
        updated_at_ms       bigint NOT NULL,
        finished_at_ms      bigint,
        -- The run that started this one with ctx.child, and the journal position it waits at.
        parent_run_id       text COLLATE "C",
        parent_seq          integer CHECK (parent_seq IS NULL OR parent_seq >= 0),
        -- The queue a run goes through (docs/workflows.md, "Queues"), its priority there (lower
        -- first), its deduplication id, and when a claim admitted it (its first lease); until
        -- then it waits in the queue.
        queue               text COLLATE "C",
        priority            integer,
        dedup_id            text COLLATE "C",
        admitted_at_ms      bigint,
        CHECK ((lease_owner IS NULL) = (lease_token IS NULL)
               AND (lease_token IS NULL) = (lease_expires_at_ms IS NULL)),
        CHECK (lease_token IS NULL OR status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating')),
        CHECK ((finished_at_ms IS NULL) = (status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating')))
    );
    -- The claim: due active runs of one (workflow, version), oldest due first.
    CREATE INDEX runs_due ON {s}.runs (workflow, version, wake_at_ms, created_at_ms, run_id)
        WHERE status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating');
    -- Listing by status, by workflow, or all, in creation order (keyset pages).
    CREATE INDEX runs_status ON {s}.runs (status, created_at_ms, run_id);
    CREATE INDEX runs_workflow ON {s}.runs (workflow, created_at_ms, run_id);
    CREATE INDEX runs_created ON {s}.runs (created_at_ms, run_id);
    -- Per-key serialization: the oldest active run of a key, and whether one holds a lease.
    CREATE INDEX runs_key ON {s}.runs (key, created_at_ms, run_id)
        WHERE key IS NOT NULL AND status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating');
    -- Purge: finished runs, oldest first.
    CREATE INDEX runs_finished ON {s}.runs (finished_at_ms, run_id) WHERE finished_at_ms IS NOT NULL;
    -- The per-type budget: the leased runs of a type, counted under the type's lock by every claim
    -- that honours a limit. (Not in SQLite's schema, whose single writer counts through runs_due:
    -- here the count must not read a type's whole backlog on every claim. It holds only leased
    -- runs, and a heartbeat, which changes only lease_expires_at_ms, stays a HOT update.)
    CREATE INDEX runs_leased ON {s}.runs (workflow) WHERE lease_token IS NOT NULL;
    -- A parent's children (the cancel cascade).
    CREATE INDEX runs_children ON {s}.runs (parent_run_id, run_id) WHERE parent_run_id IS NOT NULL;

    CREATE TABLE {s}.journal (
        run_id             text COLLATE "C" NOT NULL REFERENCES {s}.runs (run_id),
        seq                integer NOT NULL CHECK (seq >= 0),
        name               text COLLATE "C" NOT NULL,
        kind               text NOT NULL CHECK (kind IN ('external', 'transactional', 'sleep', 'wait',
                               'compensation', 'value', 'child', 'publish', 'send')),
        status             text NOT NULL CHECK (status IN ('retrying', 'waiting', 'completed', 'failed', 'skipped')),
        output             text,
        error              text,
        attempts           integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
        next_attempt_at_ms bigint,
        wake_at_ms         bigint,
        -- The event name a wait waits for; `child/<seq>` for a child step (its child's end).
        event_name         text COLLATE "C",
        reason             text,
        updated_at_ms      bigint NOT NULL,
        PRIMARY KEY (run_id, seq)
    );

    CREATE TABLE {s}.step_attempts (
        run_id         text COLLATE "C" NOT NULL REFERENCES {s}.runs (run_id),
        seq            integer NOT NULL,
        attempt        integer NOT NULL CHECK (attempt >= 1),
        ok             boolean NOT NULL,
        error          text,
        finished_at_ms bigint NOT NULL,
        PRIMARY KEY (run_id, seq, attempt)
    );

    CREATE TABLE {s}.run_events (
        run_id          text COLLATE "C" NOT NULL REFERENCES {s}.runs (run_id),
        event_id        text COLLATE "C" NOT NULL,
        name            text COLLATE "C" NOT NULL,
        payload         text NOT NULL,
        received_at_ms  bigint NOT NULL,
        consumed_by_seq integer,
        PRIMARY KEY (run_id, event_id)
    );

    -- What runs published (ctx.set_event), by key: the latest value, readable from outside while
    -- the run exists (purged with it).
    CREATE TABLE {s}.run_published (
        run_id        text COLLATE "C" NOT NULL REFERENCES {s}.runs (run_id),
        key           text COLLATE "C" NOT NULL,
        value         text NOT NULL,
        seq           integer NOT NULL,
        updated_at_ms bigint NOT NULL,
        PRIMARY KEY (run_id, key)
    );

    CREATE TABLE {s}.run_receipts (
        run_id         text COLLATE "C" PRIMARY KEY,
        workflow       text COLLATE "C" NOT NULL,
        input_hash     text NOT NULL,
        status         text NOT NULL,
        finished_at_ms bigint NOT NULL,
        expires_at_ms  bigint NOT NULL
    );
    CREATE INDEX run_receipts_expiry ON {s}.run_receipts (expires_at_ms);

    CREATE TABLE {s}.schedules (
        schedule_id          text COLLATE "C" PRIMARY KEY,
        workflow             text COLLATE "C" NOT NULL,
        input                text NOT NULL,
        cron                 text,
        interval_ms          bigint CHECK (interval_ms IS NULL OR interval_ms >= 1000),
        timezone             text NOT NULL,
        catch_up             text NOT NULL CHECK (catch_up IN ('skip', 'one', 'all')),
        paused               boolean NOT NULL DEFAULT false,
        next_tick_at_ms      bigint,
        last_started_tick_ms bigint,
        ticks_started        bigint NOT NULL DEFAULT 0,
        ticks_skipped        bigint NOT NULL DEFAULT 0,
        created_at_ms        bigint NOT NULL,
        updated_at_ms        bigint NOT NULL,
        CHECK ((cron IS NULL) <> (interval_ms IS NULL))
    );
    CREATE INDEX schedules_due ON {s}.schedules (next_tick_at_ms) WHERE NOT paused AND next_tick_at_ms IS NOT NULL;

    -- Queues: a run started through one waits until a claim admits it, only while the queue has
    -- room (concurrency_max admitted unfinished runs; rate_limit admissions per rate_period_ms),
    -- by priority (lower first), then oldest first.
    CREATE TABLE {s}.queues (
        name            text COLLATE "C" PRIMARY KEY,
        concurrency_max integer CHECK (concurrency_max IS NULL OR concurrency_max >= 1),
        rate_limit      integer CHECK (rate_limit IS NULL OR rate_limit >= 1),
        rate_period_ms  bigint CHECK (rate_period_ms IS NULL OR rate_period_ms >= 1),
        created_at_ms   bigint NOT NULL,
        updated_at_ms   bigint NOT NULL,
        CHECK ((rate_limit IS NULL) = (rate_period_ms IS NULL))
    );
    -- The admission: a queue's waiting runs in admission order.
    CREATE INDEX runs_queue_waiting ON {s}.runs (queue, priority, created_at_ms, run_id)
        WHERE queue IS NOT NULL AND admitted_at_ms IS NULL
          AND status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating');
    -- The limits: a queue's admitted runs, by admission time.
    CREATE INDEX runs_queue_admitted ON {s}.runs (queue, admitted_at_ms)
        WHERE queue IS NOT NULL AND admitted_at_ms IS NOT NULL;
    -- Deduplication: one unfinished run per (queue, dedup_id).
    CREATE UNIQUE INDEX runs_queue_dedup ON {s}.runs (queue, dedup_id)
        WHERE dedup_id IS NOT NULL AND status IN ('pending', 'running', 'sleeping', 'waiting', 'compensating');
    "#,
    // v3: long-lived runs (SQLite's v10): a run's deadline, and the status `continued` of a run
    // that continued as a new one (`ctx.continue_as_new`).
    r#"
    ALTER TABLE {s}.runs ADD COLUMN deadline_ms bigint;
    ALTER TABLE {s}.runs DROP CONSTRAINT runs_status_check;
    ALTER TABLE {s}.runs ADD CONSTRAINT runs_status_check CHECK (status IN ('pending', 'running', 'sleeping',
        'waiting', 'compensating', 'completed', 'compensated', 'failed', 'cancelled', 'parked', 'continued'));
    "#,
    // v4: an event carries the W3C trace context of the request that committed it (SQLite's
    // v11), from the outbox to the inbox that applies it; NULL without one.
    r#"
    ALTER TABLE {s}.outbox ADD COLUMN traceparent text;
    ALTER TABLE {s}.inbox ADD COLUMN traceparent text;
    "#,
    // v5: a run's events no wait consumed yet, in arrival order (SQLite's v12), without reading
    // the ones consumed: a claim's replay, a suspend's check, the pages of a run's detail.
    r#"
    CREATE INDEX run_events_unconsumed ON {s}.run_events (run_id, received_at_ms, event_id)
        WHERE consumed_by_seq IS NULL;
    "#,
];

/// The schema version this build writes.
pub const SCHEMA_VERSION: i32 = MIGRATIONS.len() as i32;

/// `template` with `{s}` replaced by the quoted (already validated) schema name.
pub(crate) fn sql(schema: &str, template: &str) -> String {
    template.replace("{s}", &format!("\"{schema}\""))
}

/// Connect to `conn_str` (a libpq-style `host=... user=...` string or a `postgresql://` URL; in a
/// URL, `sslmode` and `sslrootcert` ask for TLS, see `tls.rs`), with `lock_timeout` set to [`BUSY_TIMEOUT_MS`] for the session; nothing else of the server's
/// settings is changed (durability stays the server's: `synchronous_commit` is not touched).
/// A string that does not parse is `invalid_argument`; a server that does not answer or refuses
/// is an `io` error. Nothing is written.
pub fn connect(conn_str: &str) -> Result<Client> {
    let (conn_str, tls) = crate::tls::split(conn_str)?;
    let mut config = postgres::Config::from_str(&conn_str)
        .map_err(|e| Error::invalid(codes::INVALID_ARGUMENT, format!("invalid PostgreSQL connection string: {e}")))?;
    if config.get_application_name().is_none() {
        config.application_name("tidemark");
    }
    // A store operation waits for another transaction's lock at most as long as a SQLite store
    // waits for the write lock, then fails (a `store` error) instead of hanging: for example an
    // advance behind a caller's transaction that holds the position counter and never ends.
    // JIT compilation off (before the caller's own options, which may turn it back on): the
    // store's statements are short, and a planner misled by stale statistics compiled one for
    // 155 ms that then ran for 10 (seen with `auto_explain`; docs/postgres.md, "Connections").
    let options =
        format!("-c jit=off {} -c lock_timeout={BUSY_TIMEOUT_MS}ms", config.get_options().unwrap_or_default());
    config.options(options.trim_start());
    // An unreachable host (a black-holed address) fails after this long instead of hanging.
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(std::time::Duration::from_millis(CONNECT_TIMEOUT_MS_DEFAULT));
    }
    let connected = match tls {
        None => config.connect(NoTls),
        Some((mode, client)) => {
            config.ssl_mode(mode);
            config.connect(tokio_postgres_rustls::MakeRustlsConnect::new(client))
        }
    };
    connected.map_err(|e| {
        // The driver's own text is terse ("error connecting to server"); its cause says why.
        let cause = std::error::Error::source(&e).map(|c| format!(": {c}")).unwrap_or_default();
        Error::io(format!("cannot connect to PostgreSQL: {e}{cause}"))
    })
}

/// Bring `schema` to [`SCHEMA_VERSION`] in one transaction under the schema's migration lock,
/// creating the schema when `create`. Without `create` a missing schema, or one that holds no
/// tidemark tables, is `not_initialized` and nothing is created. A schema of a newer version is
/// `schema_too_new` and nothing is written.
pub(crate) fn migrate(client: &mut Client, schema: &str, create: bool) -> Result<()> {
    migrate_to(client, schema, create, SCHEMA_VERSION)
}

/// [`migrate`] up to `target` (tests build older versions with it).
pub(crate) fn migrate_to(client: &mut Client, schema: &str, create: bool, target: i32) -> Result<()> {
    let mut tx = client.transaction().db()?;
    tx.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))", &[&LOCK_MIGRATE, &schema]).db()?;
    let exists: bool =
        col(&tx.query_one("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", &[&schema]).db()?, 0)?;
    let versioned = exists && {
        let table = sql(schema, "{s}.schema_versions");
        let found: Option<String> = col(&tx.query_one("SELECT to_regclass($1)::text", &[&table]).db()?, 0)?;
        found.is_some()
    };
    let current: i32 = if versioned {
        col(&tx.query_one(&sql(schema, "SELECT COALESCE(max(version), 0) FROM {s}.schema_versions"), &[]).db()?, 0)?
    } else {
        0
    };
    let latest = MIGRATIONS.len() as i32;
    if current > latest {
        return Err(Error::invalid(
            codes::SCHEMA_TOO_NEW,
            format!("schema {schema} is at version {current}, newer than this build ({latest}); upgrade tidemark"),
        ));
    }
    if current == 0 && !create {
        let what = if exists { "holds no tidemark tables" } else { "does not exist" };
        return Err(Error::invalid(
            codes::NOT_INITIALIZED,
            format!("PostgreSQL schema {schema} {what}; run `tidemark init` first"),
        ));
    }
    if current >= target {
        return tx.commit().db();
    }
    if !exists {
        tx.batch_execute(&sql(schema, "CREATE SCHEMA {s}")).db()?;
    }
    if !versioned {
        tx.batch_execute(&sql(
            schema,
            "CREATE TABLE {s}.schema_versions (version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())",
        ))
        .db()?;
    }
    for (index, migration) in MIGRATIONS.iter().enumerate().take(target as usize).skip(current as usize) {
        tx.batch_execute(&sql(schema, migration)).db()?;
        let version = index as i32 + 1;
        tx.execute(&sql(schema, "INSERT INTO {s}.schema_versions (version) VALUES ($1)"), &[&version]).db()?;
    }
    tx.commit().db()
}

/// A value of the schema's `meta` table.
pub(crate) fn meta_get(client: &mut impl GenericClient, schema: &str, key: &str) -> Result<Option<String>> {
    let row = client.query_opt(&sql(schema, "SELECT value FROM {s}.meta WHERE key = $1"), &[&key]).db()?;
    row.map(|r| col(&r, 0)).transpose()
}

/// Set a value of the schema's `meta` table.
pub(crate) fn meta_set(client: &mut impl GenericClient, schema: &str, key: &str, value: &str) -> Result<()> {
    client
        .execute(
            &sql(
                schema,
                "INSERT INTO {s}.meta (key, value) VALUES ($1, $2) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            ),
            &[&key, &value],
        )
        .db()?;
    Ok(())
}

/// Take the transaction-scoped advisory lock `class` of `schema` (released at commit or rollback).
pub(crate) fn lock(client: &mut impl GenericClient, class: i32, schema: &str) -> Result<()> {
    client.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))", &[&class, &schema]).db()?;
    Ok(())
}

/// Prepared statements of one connection, by SQL template: each is parsed once per connection
/// instead of once per call (a `&str` query costs a parse round trip every time). Protocol-level
/// prepared statements outlive the transaction they were prepared in, rolled back or not.
pub(crate) struct Statements {
    schema: String,
    prepared: HashMap<&'static str, Statement>,
}

impl Statements {
    pub(crate) fn new(schema: &str) -> Self {
        Statements { schema: schema.to_string(), prepared: HashMap::new() }
    }

    /// The statement of `template` (with `{s}` the schema), prepared on `client` the first time.
    pub(crate) fn get(&mut self, client: &mut impl GenericClient, template: &'static str) -> Result<Statement> {
        if let Some(statement) = self.prepared.get(template) {
            return Ok(statement.clone());
        }
        let statement = client.prepare(&sql(&self.schema, template)).db()?;
        self.prepared.insert(template, statement.clone());
        Ok(statement)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names_are_strict_lower_case_identifiers() {
        for good in ["shop", "_t", "tenant_42", &"a".repeat(63)] {
            validate_schema_name(good).unwrap();
        }
        for bad in ["", "Shop", "1shop", "shop-1", "sh\"op", "pg_catalog", "a b", &"a".repeat(64), "é"] {
            let error = validate_schema_name(bad).unwrap_err();
            assert_eq!(error.code(), codes::INVALID_ARGUMENT, "{bad:?}");
        }
    }
}
