//! Opening files, pragmas and schema migrations.

use std::path::Path;

use rusqlite::{Connection, OpenFlags, OptionalExtension};
use tidemark_core::error::codes;
use tidemark_core::limits::BUSY_TIMEOUT_MS;
use tidemark_core::{ensure_invariant, Error, Result};

use crate::SqlResult;

/// Migrations, in order. CHECK constraints spell value lists as `x = a OR x = b OR ...`, not
/// `x IN (a, b, c)`: SQLite evaluates an IN list of more than two constants through a temporary
/// b-tree built on every INSERT and UPDATE, which cost a quarter of the bench's instructions.
///
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
        status             TEXT NOT NULL CHECK ((status = 'pending' OR status = 'accepted' OR status = 'quarantined' OR status = 'dismissed')),
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
        status         TEXT NOT NULL CHECK ((status = 'pending' OR status = 'applied' OR status = 'blocked' OR status = 'skipped')),
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
    // v3: durable workflows (docs/workflows.md, crates/store-sqlite/src/workflow/). The status
    // list ('pending', 'running', 'sleeping', 'waiting', 'compensating') is written exactly like
    // this in the partial indexes and in the queries that use them (SQLite matches the terms).
    r#"
    -- One row per run: what to execute, where it stands, and who holds it.
    CREATE TABLE runs (
        -- Caller-chosen id: starting the same id again is idempotent.
        run_id              TEXT PRIMARY KEY,
        -- The registered workflow and the version the run is pinned to: a worker claims only
        -- the (workflow, version) pairs it has registered, so new code never replays old runs.
        workflow            TEXT NOT NULL,
        version             INTEGER NOT NULL CHECK (version >= 1),
        -- The input (JSON), and the hash of (workflow, input) that tells a duplicate start
        -- (`existing`) from a reuse of the id for something else (`conflict`).
        input               TEXT NOT NULL,
        input_hash          TEXT NOT NULL,
        -- Optional serialization key: at most one active run per key, oldest first.
        key                 TEXT,
        status              TEXT NOT NULL CHECK ((status = 'pending' OR status = 'running' OR status = 'sleeping' OR status = 'waiting' OR status = 'compensating' OR status = 'completed' OR status = 'compensated' OR status = 'failed' OR status = 'cancelled' OR status = 'parked')),
        -- The function's output (JSON) once completed; why it failed, was cancelled or parked.
        result              TEXT,
        error               TEXT,
        -- When the run is next due: start-at, retry backoff, timer, wait deadline; `now` after a
        -- matching event, a cancel request or an operator change. The claim filters on it.
        wake_at_ms          INTEGER NOT NULL,
        -- The event name a `waiting` run waits for: an event of that name makes it due at once.
        waiting_for         TEXT,
        -- An operator asked to cancel: the worker stops (compensating first) at the next step
        -- boundary. Heartbeats report it to the lease holder.
        cancel_requested    INTEGER NOT NULL DEFAULT 0 CHECK (cancel_requested IN (0, 1)),
        -- The run this one was forked from (audit trail of operator forks).
        forked_from         TEXT,
        -- The lease: the worker running it, the fencing token every journal write must carry
        -- (new per claim, cleared on release and by every operator change) and its expiry, after
        -- which another worker may take the run over (a recovery).
        lease_owner         TEXT,
        lease_token         TEXT,
        lease_expires_at_ms INTEGER,
        -- Takeovers after an expired lease: a health signal (crashing or stalling workers).
        recoveries          INTEGER NOT NULL DEFAULT 0 CHECK (recoveries >= 0),
        created_at_ms       INTEGER NOT NULL,
        updated_at_ms       INTEGER NOT NULL,
        -- When the run reached its terminal status; purge selects by it. Set exactly when the
        -- status is terminal.
        finished_at_ms      INTEGER,
        CHECK ((lease_owner IS NULL) = (lease_token IS NULL)
               AND (lease_token IS NULL) = (lease_expires_at_ms IS NULL)),
        CHECK (lease_token IS NULL OR (status = 'pending' OR status = 'running' OR status = 'sleeping' OR status = 'waiting' OR status = 'compensating')),
        CHECK ((finished_at_ms IS NULL) = ((status = 'pending' OR status = 'running' OR status = 'sleeping' OR status = 'waiting' OR status = 'compensating')))
    );
    -- The claim: due active runs of one (workflow, version), oldest due first.
    CREATE INDEX runs_due ON runs (workflow, version, wake_at_ms, created_at_ms, run_id)
        WHERE (status = 'pending' OR status = 'running' OR status = 'sleeping' OR status = 'waiting' OR status = 'compensating');
    -- Listing by status, by workflow, or all, in creation order (keyset pages).
    CREATE INDEX runs_status ON runs (status, created_at_ms, run_id);
    CREATE INDEX runs_workflow ON runs (workflow, created_at_ms, run_id);
    CREATE INDEX runs_created ON runs (created_at_ms, run_id);
    -- Per-key serialization: the oldest active run of a key, and whether one holds a lease.
    CREATE INDEX runs_key ON runs (key, created_at_ms, run_id)
        WHERE key IS NOT NULL AND (status = 'pending' OR status = 'running' OR status = 'sleeping' OR status = 'waiting' OR status = 'compensating');
    -- Purge: finished runs, oldest first.
    CREATE INDEX runs_finished ON runs (finished_at_ms, run_id) WHERE finished_at_ms IS NOT NULL;

    -- The journal: one entry per step position of a run. Replay returns settled entries'
    -- recorded results without running their steps again.
    CREATE TABLE journal (
        run_id             TEXT NOT NULL REFERENCES runs (run_id),
        -- The position of the call in the workflow function (0, 1, 2, ... in call order).
        seq                INTEGER NOT NULL CHECK (seq >= 0),
        -- The step name: replay compares it with the call at this position (non-determinism).
        name               TEXT NOT NULL,
        kind               TEXT NOT NULL CHECK ((kind = 'external' OR kind = 'transactional' OR kind = 'sleep' OR kind = 'wait' OR kind = 'compensation')),
        -- retrying/waiting are unsettled (the step runs or waits again); the others are settled.
        status             TEXT NOT NULL CHECK ((status = 'retrying' OR status = 'waiting' OR status = 'completed' OR status = 'failed' OR status = 'skipped')),
        -- The recorded output (JSON) or the last error.
        output             TEXT,
        error              TEXT,
        -- Attempts since the step started or an operator retried it: the retry budget.
        attempts           INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
        -- When a retrying step's next attempt is due.
        next_attempt_at_ms INTEGER,
        -- A timer's fire time or a wait's deadline.
        wake_at_ms         INTEGER,
        -- The event name a wait waits for.
        event_name         TEXT,
        -- An operator's reason (skip, retry).
        reason             TEXT,
        updated_at_ms      INTEGER NOT NULL,
        PRIMARY KEY (run_id, seq)
    );

    -- Every attempt of every step with its error: the history an operator reads (kept when an
    -- operator retry resets the journal entry's budget).
    CREATE TABLE step_attempts (
        run_id         TEXT NOT NULL REFERENCES runs (run_id),
        seq            INTEGER NOT NULL,
        -- Ordinal of the attempt at this position, over the run's whole life.
        attempt        INTEGER NOT NULL CHECK (attempt >= 1),
        ok             INTEGER NOT NULL CHECK (ok IN (0, 1)),
        error          TEXT,
        finished_at_ms INTEGER NOT NULL,
        PRIMARY KEY (run_id, seq, attempt)
    ) WITHOUT ROWID;

    -- Events sent to runs (API, CLI, inbox handlers).
    CREATE TABLE run_events (
        run_id          TEXT NOT NULL REFERENCES runs (run_id),
        -- The sender's id: sending it again is a no-op (at-least-once senders).
        event_id        TEXT NOT NULL,
        -- What a wait matches on.
        name            TEXT NOT NULL,
        payload         TEXT NOT NULL,
        received_at_ms  INTEGER NOT NULL,
        -- The wait (journal seq) that consumed it; NULL while it is still to be consumed.
        consumed_by_seq INTEGER,
        PRIMARY KEY (run_id, event_id)
    );

    -- What stays of a purged run, until expires_at_ms: a late duplicate start is still
    -- recognised (`existing` with the final status, or `conflict`), not started again.
    CREATE TABLE run_receipts (
        run_id         TEXT PRIMARY KEY,
        workflow       TEXT NOT NULL,
        input_hash     TEXT NOT NULL,
        status         TEXT NOT NULL,
        finished_at_ms INTEGER NOT NULL,
        -- finished_at_ms + the receipt window; purge deletes expired receipts.
        expires_at_ms  INTEGER NOT NULL
    ) WITHOUT ROWID;
    CREATE INDEX run_receipts_expiry ON run_receipts (expires_at_ms);
    "#,
    // v4: deliveries become a cursor per subscriber plus exception rows (docs/protocol.md,
    // "Deliveries"; producer.rs explains why the cursor cannot skip an event). A subscriber
    // receives every position from `from_position` on; every position up to
    // `delivered_position` is accepted unless `deliveries` holds a row for it, every later one
    // pending unless it holds one. Existing rows become that: the cursor stops just below the
    // subscriber's first plain pending delivery (no attempt, no error), and the rows the cursor
    // now expresses (plain accepted at or below it, plain pending above it) are deleted.
    r#"
    ALTER TABLE subscriptions ADD COLUMN from_position INTEGER NOT NULL DEFAULT 1;
    ALTER TABLE subscriptions ADD COLUMN delivered_position INTEGER NOT NULL DEFAULT 0;
    UPDATE subscriptions SET from_position = COALESCE(
        (SELECT min(d.position) FROM deliveries d WHERE d.consumer_id = subscriptions.consumer_id),
        (SELECT COALESCE(max(position), 0) + 1 FROM outbox));
    UPDATE subscriptions SET delivered_position = COALESCE(
        (SELECT min(d.position) - 1 FROM deliveries d WHERE d.consumer_id = subscriptions.consumer_id
            AND d.status = 'pending' AND d.attempts = 0 AND d.last_error IS NULL),
        max(from_position - 1, (SELECT COALESCE(max(position), 0) FROM outbox)));
    DELETE FROM deliveries WHERE attempts = 0 AND last_error IS NULL AND EXISTS (
        SELECT 1 FROM subscriptions s WHERE s.consumer_id = deliveries.consumer_id
          AND ((deliveries.status = 'accepted' AND deliveries.position <= s.delivered_position)
            OR (deliveries.status = 'pending' AND deliveries.position > s.delivered_position)));
    "#,
    // v5: the consumer tables' keys lead with the flow id (then source, consumer id, seq), and
    // the event-id indexes with the event id. Every key probe compares key fields left to right;
    // with the consumer id and source first, which are the same for nearly every row, each
    // comparison on the way down a b-tree walked two equal strings before the one that differs.
    // Flow id first cut the consumer side's instructions per event by 15-20%
    // (docs/benchmarks.md, "Session 3"). Listings keep their (source, flow, seq) order: open
    // records come from the unchanged open-record index, other listings read the consumer's
    // rows and sort them. The tables are rebuilt with their rows (SQLite cannot change a
    // primary key in place).
    r#"
    CREATE TABLE inbox_v5 (
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
        status         TEXT NOT NULL CHECK ((status = 'pending' OR status = 'applied' OR status = 'blocked' OR status = 'skipped')),
        reason         TEXT,
        status_at_ms   INTEGER NOT NULL,
        PRIMARY KEY (flow_id, source, consumer_id, seq)
    ) WITHOUT ROWID;
    INSERT INTO inbox_v5 (consumer_id, source, flow_id, seq, event_id, generation, event_type, schema_version,
        payload, content_hash, created_at_ms, received_at_ms, status, reason, status_at_ms)
      SELECT consumer_id, source, flow_id, seq, event_id, generation, event_type, schema_version,
        payload, content_hash, created_at_ms, received_at_ms, status, reason, status_at_ms FROM inbox;
    DROP TABLE inbox;
    ALTER TABLE inbox_v5 RENAME TO inbox;
    CREATE UNIQUE INDEX inbox_event ON inbox (event_id, consumer_id);
    CREATE INDEX inbox_open ON inbox (consumer_id, source, flow_id, seq) WHERE status IN ('pending', 'blocked');
    CREATE INDEX inbox_done_age ON inbox (status_at_ms) WHERE status IN ('applied', 'skipped');

    CREATE TABLE receipts_v5 (
        consumer_id   TEXT NOT NULL,
        source        TEXT NOT NULL,
        flow_id       TEXT NOT NULL,
        seq           INTEGER NOT NULL,
        event_id      TEXT NOT NULL,
        content_hash  TEXT NOT NULL,
        created_at_ms INTEGER NOT NULL,
        PRIMARY KEY (flow_id, source, consumer_id, seq)
    ) WITHOUT ROWID;
    INSERT INTO receipts_v5 (consumer_id, source, flow_id, seq, event_id, content_hash, created_at_ms)
      SELECT consumer_id, source, flow_id, seq, event_id, content_hash, created_at_ms FROM receipts;
    DROP TABLE receipts;
    ALTER TABLE receipts_v5 RENAME TO receipts;
    CREATE UNIQUE INDEX receipts_event ON receipts (event_id, consumer_id);
    CREATE INDEX receipts_age ON receipts (created_at_ms);

    CREATE TABLE cursors_v5 (
        consumer_id    TEXT NOT NULL,
        source         TEXT NOT NULL,
        flow_id        TEXT NOT NULL,
        high_water_seq INTEGER NOT NULL CHECK (high_water_seq >= 1),
        PRIMARY KEY (flow_id, source, consumer_id)
    ) WITHOUT ROWID;
    INSERT INTO cursors_v5 (consumer_id, source, flow_id, high_water_seq)
      SELECT consumer_id, source, flow_id, high_water_seq FROM cursors;
    DROP TABLE cursors;
    ALTER TABLE cursors_v5 RENAME TO cursors;
    "#,
    // v6: the inbox is a rowid table (`record`, allocated in receive order) with its key as a
    // unique constraint. In a WITHOUT ROWID table the whole record (payload, hashes, ids) sat in
    // the key's b-tree: receiving inserted it at its flow's place, and marking it applied deleted
    // and re-inserted it there. Now the record is appended, only the narrow key index takes the
    // random insert, the drain reads and updates each open record by its integer `record` (the
    // update overwrites the row in place), and the key index is left alone by status changes.
    // Consumer-side SQLite instructions per event -16% in docs/experiments/inbox_layouts.py
    // (docs/benchmarks.md, "Session 4"). Queries and listings are unchanged.
    r#"
    CREATE TABLE inbox_v6 (
        record         INTEGER PRIMARY KEY,
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
        status         TEXT NOT NULL CHECK ((status = 'pending' OR status = 'applied' OR status = 'blocked' OR status = 'skipped')),
        reason         TEXT,
        status_at_ms   INTEGER NOT NULL,
        UNIQUE (flow_id, source, consumer_id, seq)
    );
    INSERT INTO inbox_v6 (consumer_id, source, flow_id, seq, event_id, generation, event_type, schema_version,
        payload, content_hash, created_at_ms, received_at_ms, status, reason, status_at_ms)
      SELECT consumer_id, source, flow_id, seq, event_id, generation, event_type, schema_version,
        payload, content_hash, created_at_ms, received_at_ms, status, reason, status_at_ms FROM inbox
      ORDER BY received_at_ms, flow_id, source, consumer_id, seq;
    DROP TABLE inbox;
    ALTER TABLE inbox_v6 RENAME TO inbox;
    CREATE UNIQUE INDEX inbox_event ON inbox (event_id, consumer_id);
    CREATE INDEX inbox_open ON inbox (consumer_id, source, flow_id, seq) WHERE status IN ('pending', 'blocked');
    CREATE INDEX inbox_done_age ON inbox (status_at_ms) WHERE status IN ('applied', 'skipped');
    "#,
    // v7: retention walks the tables in the order they were written (the outbox by position, the
    // inbox by record) and stops at the first row younger than the cutoff, so neither table keeps
    // an age index any more. `outbox_age` cost every advance an index insert and
    // `inbox_done_age` cost every apply one (the status change moved the record into the partial
    // index): together about 6% of the pipeline's instructions (docs/benchmarks.md, "Session 5").
    r#"
    DROP INDEX outbox_age;
    DROP INDEX inbox_done_age;
    "#,
    // v8: a receipt keeps the producer generation of the record it was compacted from, so a
    // conflict found against a receipt names a generation change as one found against a record
    // does. NULL for receipts compacted before v8 (the generation was not kept; nothing to
    // compare, as before).
    r#"
    ALTER TABLE receipts ADD COLUMN generation TEXT;
    "#,
    // v9: child workflows, deterministic values, schedules, queues and messages between runs
    // (docs/workflows.md). The journal takes two
    // more kinds, `value` (ctx.now/random/uuid) and `child` (ctx.child): SQLite cannot change a
    // CHECK, so the table is rebuilt with every entry copied as it is. A run knows the parent that
    // started it and the parent's journal position, so its end reaches the parent in the child's
    // last transaction; the partial index finds a parent's children (the cancel cascade).
    r#"
    CREATE TABLE journal_v9 (
        run_id             TEXT NOT NULL REFERENCES runs (run_id),
        seq                INTEGER NOT NULL CHECK (seq >= 0),
        name               TEXT NOT NULL,
        kind               TEXT NOT NULL CHECK ((kind = 'external' OR kind = 'transactional' OR kind = 'sleep' OR kind = 'wait' OR kind = 'compensation' OR kind = 'value' OR kind = 'child' OR kind = 'publish' OR kind = 'send')),
        status             TEXT NOT NULL CHECK ((status = 'retrying' OR status = 'waiting' OR status = 'completed' OR status = 'failed' OR status = 'skipped')),
        output             TEXT,
        error              TEXT,
        attempts           INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
        next_attempt_at_ms INTEGER,
        -- A timer's fire time, a wait's deadline, or when a child step's wait is looked at again.
        wake_at_ms         INTEGER,
        -- The event name a wait waits for; `child/<seq>` for a child step (its child's end).
        event_name         TEXT,
        reason             TEXT,
        updated_at_ms      INTEGER NOT NULL,
        PRIMARY KEY (run_id, seq)
    );
    INSERT INTO journal_v9 (run_id, seq, name, kind, status, output, error, attempts, next_attempt_at_ms,
                            wake_at_ms, event_name, reason, updated_at_ms)
      SELECT run_id, seq, name, kind, status, output, error, attempts, next_attempt_at_ms,
             wake_at_ms, event_name, reason, updated_at_ms FROM journal;
    DROP TABLE journal;
    ALTER TABLE journal_v9 RENAME TO journal;
    -- The run that started this one with ctx.child, and the journal position it waits at.
    ALTER TABLE runs ADD COLUMN parent_run_id TEXT;
    ALTER TABLE runs ADD COLUMN parent_seq INTEGER CHECK (parent_seq IS NULL OR parent_seq >= 0);
    CREATE INDEX runs_children ON runs (parent_run_id, run_id) WHERE parent_run_id IS NOT NULL;
    -- Schedules (docs/workflows.md, "Schedules"): each tick an idempotent start of run
    -- `<schedule_id>:<tick ms>`; `fire` starts a tick's runs and moves next_tick_at_ms in one
    -- transaction, only if next_tick_at_ms is still what the plan was made from.
    CREATE TABLE schedules (
        schedule_id          TEXT PRIMARY KEY,
        workflow             TEXT NOT NULL,
        input                TEXT NOT NULL,
        -- Exactly one of a cron expression and an interval.
        cron                 TEXT,
        interval_ms          INTEGER CHECK (interval_ms IS NULL OR interval_ms >= 1000),
        timezone             TEXT NOT NULL,
        catch_up             TEXT NOT NULL CHECK ((catch_up = 'skip' OR catch_up = 'one' OR catch_up = 'all')),
        paused               INTEGER NOT NULL DEFAULT 0 CHECK (paused IN (0, 1)),
        -- NULL: the expression never matches again.
        next_tick_at_ms      INTEGER,
        last_started_tick_ms INTEGER,
        ticks_started        INTEGER NOT NULL DEFAULT 0,
        ticks_skipped        INTEGER NOT NULL DEFAULT 0,
        created_at_ms        INTEGER NOT NULL,
        updated_at_ms        INTEGER NOT NULL,
        CHECK ((cron IS NULL) <> (interval_ms IS NULL))
    ) WITHOUT ROWID;
    -- The ticker's read: due schedules, soonest first.
    CREATE INDEX schedules_due ON schedules (next_tick_at_ms) WHERE paused = 0 AND next_tick_at_ms IS NOT NULL;
    -- Queues (docs/workflows.md, "Queues"): a run started through one waits until a claim admits
    -- it (admitted_at_ms, set with its first lease, in the claim's transaction), only while the
    -- queue has room (concurrency_max admitted unfinished runs; rate_limit admissions per
    -- rate_period_ms), by priority (lower first), then oldest first.
    CREATE TABLE queues (
        name            TEXT PRIMARY KEY,
        concurrency_max INTEGER CHECK (concurrency_max IS NULL OR concurrency_max >= 1),
        rate_limit      INTEGER CHECK (rate_limit IS NULL OR rate_limit >= 1),
        rate_period_ms  INTEGER CHECK (rate_period_ms IS NULL OR rate_period_ms >= 1),
        created_at_ms   INTEGER NOT NULL,
        updated_at_ms   INTEGER NOT NULL,
        CHECK ((rate_limit IS NULL) = (rate_period_ms IS NULL))
    ) WITHOUT ROWID;
    ALTER TABLE runs ADD COLUMN queue TEXT;
    ALTER TABLE runs ADD COLUMN priority INTEGER;
    ALTER TABLE runs ADD COLUMN dedup_id TEXT;
    ALTER TABLE runs ADD COLUMN admitted_at_ms INTEGER;
    -- What runs published (ctx.set_event), by key: the latest value, readable from outside while
    -- the run exists (purged with it).
    CREATE TABLE run_published (
        run_id        TEXT NOT NULL REFERENCES runs (run_id),
        key           TEXT NOT NULL,
        value         TEXT NOT NULL,
        seq           INTEGER NOT NULL,
        updated_at_ms INTEGER NOT NULL,
        PRIMARY KEY (run_id, key)
    ) WITHOUT ROWID;
    -- The admission: a queue's waiting runs in admission order.
    CREATE INDEX runs_queue_waiting ON runs (queue, priority, created_at_ms, run_id)
        WHERE queue IS NOT NULL AND admitted_at_ms IS NULL
          AND (status = 'pending' OR status = 'running' OR status = 'sleeping' OR status = 'waiting' OR status = 'compensating');
    -- The rate limit: a queue's admissions, by admission time (a range from the period's start).
    CREATE INDEX runs_queue_admitted ON runs (queue, admitted_at_ms) WHERE queue IS NOT NULL AND admitted_at_ms IS NOT NULL;
    -- The concurrency limit: a queue's admitted runs not finished yet (the count reads only these,
    -- not every run the queue ever admitted).
    CREATE INDEX runs_queue_in_progress ON runs (queue)
        WHERE queue IS NOT NULL AND admitted_at_ms IS NOT NULL
          AND (status = 'pending' OR status = 'running' OR status = 'sleeping' OR status = 'waiting' OR status = 'compensating');
    -- Deduplication: one unfinished run per (queue, dedup_id).
    CREATE UNIQUE INDEX runs_queue_dedup ON runs (queue, dedup_id)
        WHERE dedup_id IS NOT NULL
          AND (status = 'pending' OR status = 'running' OR status = 'sleeping' OR status = 'waiting' OR status = 'compensating');
    "#,
    // v10: long-lived runs (docs/workflows.md, "Deadlines" and "Continue as new"). A run may have
    // a deadline, and a run that continued as a new one ends `continued`. SQLite cannot change a
    // CHECK, so `runs` is rebuilt with every row copied as it is and its indexes made again (the
    // migration runs with foreign keys off, as SQLite's documented procedure for rebuilding a
    // referenced table says, and checks them before it commits).
    r#"
    CREATE TABLE runs_v10 (
        run_id              TEXT PRIMARY KEY,
        workflow            TEXT NOT NULL,
        version             INTEGER NOT NULL CHECK (version >= 1),
        input               TEXT NOT NULL,
        input_hash          TEXT NOT NULL,
        key                 TEXT,
        status              TEXT NOT NULL CHECK ((status = 'pending' OR status = 'running' OR status = 'sleeping' OR status = 'waiting' OR status = 'compensating' OR status = 'completed' OR status = 'compensated' OR status = 'failed' OR status = 'cancelled' OR status = 'parked' OR status = 'continued')),
        result              TEXT,
        error               TEXT,
        wake_at_ms          INTEGER NOT NULL,
        waiting_for         TEXT,
        cancel_requested    INTEGER NOT NULL DEFAULT 0 CHECK (cancel_requested IN (0, 1)),
        forked_from         TEXT,
        lease_owner         TEXT,
        lease_token         TEXT,
        lease_expires_at_ms INTEGER,
        recoveries          INTEGER NOT NULL DEFAULT 0 CHECK (recoveries >= 0),
        created_at_ms       INTEGER NOT NULL,
        updated_at_ms       INTEGER NOT NULL,
        finished_at_ms      INTEGER,
        parent_run_id       TEXT,
        parent_seq          INTEGER CHECK (parent_seq IS NULL OR parent_seq >= 0),
        queue               TEXT,
        priority            INTEGER,
        dedup_id            TEXT,
        admitted_at_ms      INTEGER,
        -- When the run is cancelled if it has not ended (the worker observes it at the next step
        -- boundary, and no suspension sleeps past it).
        deadline_ms         INTEGER,
        CHECK ((lease_owner IS NULL) = (lease_token IS NULL)
               AND (lease_token IS NULL) = (lease_expires_at_ms IS NULL)),
        CHECK (lease_token IS NULL OR (status = 'pending' OR status = 'running' OR status = 'sleeping' OR status = 'waiting' OR status = 'compensating')),
        CHECK ((finished_at_ms IS NULL) = ((status = 'pending' OR status = 'running' OR status = 'sleeping' OR status = 'waiting' OR status = 'compensating')))
    );
    INSERT INTO runs_v10 (run_id, workflow, version, input, input_hash, key, status, result, error, wake_at_ms,
                          waiting_for, cancel_requested, forked_from, lease_owner, lease_token, lease_expires_at_ms,
                          recoveries, created_at_ms, updated_at_ms, finished_at_ms, parent_run_id, parent_seq,
                          queue, priority, dedup_id, admitted_at_ms)
      SELECT run_id, workflow, version, input, input_hash, key, status, result, error, wake_at_ms,
             waiting_for, cancel_requested, forked_from, lease_owner, lease_token, lease_expires_at_ms,
             recoveries, created_at_ms, updated_at_ms, finished_at_ms, parent_run_id, parent_seq,
             queue, priority, dedup_id, admitted_at_ms FROM runs;
    DROP TABLE runs;
    ALTER TABLE runs_v10 RENAME TO runs;
    CREATE INDEX runs_due ON runs (workflow, version, wake_at_ms, created_at_ms, run_id)
        WHERE (status = 'pending' OR status = 'running' OR status = 'sleeping' OR status = 'waiting' OR status = 'compensating');
    CREATE INDEX runs_status ON runs (status, created_at_ms, run_id);
    CREATE INDEX runs_workflow ON runs (workflow, created_at_ms, run_id);
    CREATE INDEX runs_created ON runs (created_at_ms, run_id);
    CREATE INDEX runs_key ON runs (key, created_at_ms, run_id)
        WHERE key IS NOT NULL AND (status = 'pending' OR status = 'running' OR status = 'sleeping' OR status = 'waiting' OR status = 'compensating');
    CREATE INDEX runs_finished ON runs (finished_at_ms, run_id) WHERE finished_at_ms IS NOT NULL;
    CREATE INDEX runs_children ON runs (parent_run_id, run_id) WHERE parent_run_id IS NOT NULL;
    CREATE INDEX runs_queue_waiting ON runs (queue, priority, created_at_ms, run_id)
        WHERE queue IS NOT NULL AND admitted_at_ms IS NULL
          AND (status = 'pending' OR status = 'running' OR status = 'sleeping' OR status = 'waiting' OR status = 'compensating');
    CREATE INDEX runs_queue_admitted ON runs (queue, admitted_at_ms) WHERE queue IS NOT NULL AND admitted_at_ms IS NOT NULL;
    CREATE INDEX runs_queue_in_progress ON runs (queue)
        WHERE queue IS NOT NULL AND admitted_at_ms IS NOT NULL
          AND (status = 'pending' OR status = 'running' OR status = 'sleeping' OR status = 'waiting' OR status = 'compensating');
    CREATE UNIQUE INDEX runs_queue_dedup ON runs (queue, dedup_id)
        WHERE dedup_id IS NOT NULL
          AND (status = 'pending' OR status = 'running' OR status = 'sleeping' OR status = 'waiting' OR status = 'compensating');
    "#,
    // v11: an event carries the W3C trace context of the request that committed it, from the
    // outbox to the inbox that applies it (NULL for events without one, and for every event
    // written before v11). Not part of the content hash.
    r#"
    ALTER TABLE outbox ADD COLUMN traceparent TEXT;
    ALTER TABLE inbox ADD COLUMN traceparent TEXT;
    "#,
    // v12: a run's events no wait consumed yet, in arrival order, without reading the ones
    // consumed (a claim's replay, a wait's check, the pages of a run's detail): a run that was
    // sent many events no longer reads them all at each of those.
    r#"
    CREATE INDEX run_events_unconsumed ON run_events (run_id, received_at_ms, event_id)
        WHERE consumed_by_seq IS NULL;
    "#,
];

/// The schema version this build writes.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// Page cache per connection, in KiB.
const PAGE_CACHE_KIB: i64 = 64 * 1024;
/// WAL pages written before a commit checkpoints them into the database (40 MiB of 4 KiB pages).
const WAL_AUTOCHECKPOINT_PAGES: i64 = 10_000;
/// Size a WAL file is truncated back to after a checkpoint that emptied it.
const WAL_SIZE_LIMIT_BYTES: i64 = 64 * 1024 * 1024;

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

/// Process-wide SQLite settings, applied once before the first connection opens.
fn configure_library() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: `sqlite3_config` is only legal before SQLite initialises; if something else in
        // the process already initialised it, the call returns SQLITE_MISUSE and changes nothing.
        // MEMSTATUS off: SQLite otherwise takes a global mutex on every allocation to keep
        // memory statistics that tidemark never reads.
        unsafe {
            let _ = rusqlite::ffi::sqlite3_config(rusqlite::ffi::SQLITE_CONFIG_MEMSTATUS, 0 as std::os::raw::c_int);
        }
        #[cfg(feature = "failpoints")]
        crate::faultfs::install_from_env();
    });
}

/// Times a statement of this process found a database locked by another connection (each
/// wait counts once, however many times it retried). Read by `/metrics`.
static BUSY_EVENTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Lock waits ("SQLITE_BUSY events") since the process started, over every connection that
/// tidemark opened.
pub fn busy_events() -> u64 {
    BUSY_EVENTS.load(std::sync::atomic::Ordering::Relaxed)
}

/// The sleeps of SQLite's own busy-timeout handler (`sqliteDefaultBusyCallback`), in ms: the
/// n-th retry sleeps `BUSY_DELAYS_MS[n]`, every later one the last entry.
const BUSY_DELAYS_MS: [u64; 12] = [1, 2, 5, 10, 15, 20, 25, 25, 25, 50, 50, 100];

/// How long the `retries`-th retry of one lock wait sleeps (0-based), or `None` once the wait
/// has slept `BUSY_TIMEOUT_MS` in total: SQLite's back-off, the last sleep cut to the bound.
fn busy_delay_ms(retries: u64) -> Option<u64> {
    let last = BUSY_DELAYS_MS.len() - 1;
    let listed = (retries as usize).min(BUSY_DELAYS_MS.len());
    let slept = BUSY_DELAYS_MS[..listed].iter().sum::<u64>()
        + retries.saturating_sub(BUSY_DELAYS_MS.len() as u64) * BUSY_DELAYS_MS[last];
    let delay = BUSY_DELAYS_MS[(retries as usize).min(last)];
    (slept < BUSY_TIMEOUT_MS).then(|| delay.min(BUSY_TIMEOUT_MS - slept))
}

/// The busy handler of every tidemark connection: counts the wait, then does what the busy
/// timeout did (SQLite's back-off, giving up once `BUSY_TIMEOUT_MS` have been slept).
/// `retries` is how often this handler already ran for the same lock wait.
fn busy_wait(retries: i32) -> bool {
    let retries = u64::try_from(retries).unwrap_or(0);
    if retries == 0 {
        BUSY_EVENTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    match busy_delay_ms(retries) {
        Some(delay) => {
            std::thread::sleep(std::time::Duration::from_millis(delay));
            true
        }
        None => false,
    }
}

/// Wait for another connection's lock (up to `BUSY_TIMEOUT_MS`), counting the waits.
pub(crate) fn set_busy_handler(conn: &Connection) -> Result<()> {
    conn.busy_handler(Some(busy_wait)).db()
}

pub(crate) fn configure(conn: &Connection, durability: Durability) -> Result<()> {
    set_busy_handler(conn)?;
    let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0)).db()?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(Error::store(format!("could not enable WAL mode (got {mode})")));
    }
    let sync = match durability {
        Durability::Full => "FULL",
        Durability::Normal => "NORMAL",
    };
    // A 64 MiB page cache per connection (SQLite's default is 2 MiB): with millions of rows the
    // indexes the hot paths probe no longer fit the default and every probe rereads pages.
    // A WAL checkpoint every WAL_AUTOCHECKPOINT_PAGES pages instead of SQLite's 1,000: a group
    // commit of a few thousand events writes more than 1,000 pages, so the default copied the WAL
    // back into the database after nearly every commit, hot pages included, each time they were
    // rewritten (8-11% of the pipeline's CPU time, docs/benchmarks.md). A WAL grown larger than
    // WAL_SIZE_LIMIT_BYTES by one big transaction is truncated back after its checkpoint.
    conn.execute_batch(&format!(
        "PRAGMA synchronous={sync}; PRAGMA foreign_keys=ON; PRAGMA cache_size=-{PAGE_CACHE_KIB};
         PRAGMA wal_autocheckpoint={WAL_AUTOCHECKPOINT_PAGES}; PRAGMA journal_size_limit={WAL_SIZE_LIMIT_BYTES};"
    ))
    .db()?;
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
    migrate_to(conn, SCHEMA_VERSION)
}

/// Bring the schema up to `target` (tests create files of older versions with it).
fn migrate_to(conn: &mut Connection, target: i64) -> Result<()> {
    // A migration may rebuild a table other tables reference (v10 rebuilds `runs`): SQLite's
    // procedure for that runs with foreign keys off (the pragma is a no-op inside a transaction)
    // and checks them before the commit.
    conn.execute_batch("PRAGMA foreign_keys=OFF").db()?;
    let migrated = migrate_without_foreign_keys(conn, target);
    let restored = conn.execute_batch("PRAGMA foreign_keys=ON").db();
    migrated.and(restored)
}

fn migrate_without_foreign_keys(conn: &mut Connection, target: i64) -> Result<()> {
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate).db()?;
    let current = schema_version(&tx)?;
    if current == 0 {
        tx.execute_batch("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;")
            .db()?;
    }
    apply_migrations(&tx, "meta", "database", MIGRATIONS, current, target)?;
    let violations: i64 = tx.query_row("SELECT count(*) FROM pragma_foreign_key_check", [], |r| r.get(0)).db()?;
    ensure_invariant!(violations == 0, "the migration to version {target} left {violations} foreign key violations");
    if current > 0 && current < target {
        tidemark_core::crash::hit("migrate.before_commit");
    }
    tx.commit().db()
}

/// Run `migrations[current..target]` in `tx`, recording each version in `meta_table`'s
/// `schema_version` key. A file newer than `migrations` is refused (`schema_too_new`), never
/// downgraded. `what` names the file kind in that error.
pub(crate) fn apply_migrations(
    tx: &rusqlite::Transaction,
    meta_table: &str,
    what: &str,
    migrations: &[&str],
    current: i64,
    target: i64,
) -> Result<()> {
    let latest = migrations.len() as i64;
    if current > latest {
        return Err(Error::invalid(
            codes::SCHEMA_TOO_NEW,
            format!("{what} schema version {current} is newer than this build ({latest}); upgrade tidemark"),
        ));
    }
    for (index, sql) in migrations.iter().enumerate().take(target as usize).skip(current as usize) {
        tx.execute_batch(sql).db()?;
        tx.execute(
            &format!(
                "INSERT INTO {meta_table} (key, value) VALUES ('schema_version', ?1)
                 ON CONFLICT (key) DO UPDATE SET value = excluded.value"
            ),
            [(index + 1).to_string()],
        )
        .db()?;
    }
    Ok(())
}

/// Open (and create if `create`) a tidemark file and migrate it. Opening never resets data.
pub(crate) fn open(path: &Path, create: bool, durability: Durability) -> Result<Connection> {
    let mut conn = connect(path, create, durability, "run `tidemark init` first")?;
    if schema_version(&conn)? != SCHEMA_VERSION {
        migrate(&mut conn)?;
    }
    Ok(conn)
}

/// A configured connection (WAL, synchronous, busy timeout, cache) to `path`, created when
/// `create`; a missing file is `not_initialized`, with `hint` saying how to create it.
pub(crate) fn connect(path: &Path, create: bool, durability: Durability, hint: &str) -> Result<Connection> {
    let mut flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    if create {
        flags |= OpenFlags::SQLITE_OPEN_CREATE;
    } else if !path.exists() {
        return Err(Error::invalid(codes::NOT_INITIALIZED, format!("{} does not exist; {hint}", path.display())));
    }
    configure_library();
    let new = create && !path.exists();
    let conn = Connection::open_with_flags(path, flags)
        .map_err(|e| Error::io(format!("cannot open {}: {e}", path.display())))?;
    configure(&conn, durability)?;
    if new {
        sync_parent(path)?;
    }
    Ok(conn)
}

/// Make a file's creation durable: fsync the folder that holds its entry (SQLite fsyncs the
/// folder of a WAL it creates, never that of a database file). Without it a power loss soon
/// after `tidemark init` could take the new file, and every commit in it, away.
fn sync_parent(path: &Path) -> Result<()> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(format!("cannot fsync the folder {}: {e}", dir.display())))?;
    #[cfg(feature = "failpoints")]
    crate::faultfs::directory_synced(dir);
    Ok(())
}

/// A connection to a file of the user's own (a fake service's log, a side database) configured
/// as tidemark configures its files: WAL, `synchronous` from `durability`, busy timeout. Created
/// when `create`; a missing file is `not_initialized` otherwise. Runs no tidemark migration.
pub fn open_connection(path: &Path, create: bool, durability: Durability) -> Result<Connection> {
    connect(path, create, durability, "create it first")
}

/// A read-only connection to an existing, current-schema file, for readers that must not wait
/// for the file's writer (a WAL reader sees the last commit and blocks no writer): the
/// server's `/metrics` and dashboard counts. Never creates, migrates or writes anything; a file
/// of another schema version is refused (its writer migrates it when it opens it).
pub fn open_reader(path: &Path) -> Result<Connection> {
    if !path.exists() {
        return Err(Error::invalid(codes::NOT_INITIALIZED, format!("{} does not exist", path.display())));
    }
    configure_library();
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags)
        .map_err(|e| Error::io(format!("cannot open {}: {e}", path.display())))?;
    set_busy_handler(&conn)?;
    let version = schema_version(&conn)?;
    if version != SCHEMA_VERSION {
        return Err(Error::store(format!(
            "{} is at schema version {version}, this build reads {SCHEMA_VERSION}",
            path.display()
        )));
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
        let checkpoint_pages: i64 = conn.query_row("PRAGMA wal_autocheckpoint", [], |r| r.get(0)).unwrap();
        assert_eq!(checkpoint_pages, WAL_AUTOCHECKPOINT_PAGES);
    }

    #[test]
    fn the_busy_handler_waits_as_long_as_the_busy_timeout() {
        // SQLite's own back-off, and the same total bound.
        assert_eq!((0..4).map(|n| busy_delay_ms(n).unwrap()).collect::<Vec<_>>(), [1, 2, 5, 10]);
        assert_eq!(busy_delay_ms(40), Some(100));
        let delays: Vec<u64> = (0..).map_while(busy_delay_ms).collect();
        assert_eq!(delays.iter().sum::<u64>(), BUSY_TIMEOUT_MS);
        assert!(delays.len() < 200, "{}", delays.len());
    }

    #[test]
    fn a_lock_wait_is_counted_once_and_then_succeeds() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.db");
        let holder = open(&path, true, Durability::Full).unwrap();
        let waiter = open(&path, false, Durability::Full).unwrap();
        holder.execute_batch("BEGIN IMMEDIATE; INSERT INTO meta (key, value) VALUES ('held', '1');").unwrap();
        let before = busy_events();
        // The second writer waits for the lock; the holder commits after a while.
        let committer = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(150));
            holder.execute_batch("COMMIT").unwrap();
        });
        meta_set(&waiter, "waited", "1").unwrap();
        committer.join().unwrap();
        // Other tests of this process may wait too, so at least one more.
        assert!(busy_events() > before, "the wait was not counted");
        assert_eq!(meta_get(&waiter, "held").unwrap().as_deref(), Some("1"));
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

    fn table_exists(conn: &Connection, name: &str) -> bool {
        conn.query_row("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1", [name], |r| r.get(0))
            .unwrap()
    }

    #[test]
    fn every_previous_version_migrates_to_the_current_one_keeping_its_data() {
        for previous in 1..SCHEMA_VERSION {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join(format!("v{previous}.db"));
            let mut conn = Connection::open(&path).unwrap();
            configure(&conn, Durability::Full).unwrap();
            migrate_to(&mut conn, previous).unwrap();
            assert_eq!(schema_version(&conn).unwrap(), previous);
            assert_eq!(table_exists(&conn, "runs"), previous >= 3);
            meta_set(&conn, "producer.source", "shop").unwrap();
            conn.execute(
            "INSERT INTO flows (flow_id, state, state_data, last_seq, updated_at_ms) VALUES ('r1', 'reserved', '{}', 1, 5)",
            [],
        )
        .unwrap();
            drop(conn);

            let conn = open(&path, false, Durability::Full).unwrap();
            assert_eq!(schema_version(&conn).unwrap(), SCHEMA_VERSION);
            assert_eq!(meta_get(&conn, "producer.source").unwrap().as_deref(), Some("shop"));
            let flow: (String, i64) = conn
                .query_row("SELECT state, last_seq FROM flows WHERE flow_id = 'r1'", [], |r| Ok((r.get(0)?, r.get(1)?)))
                .unwrap();
            assert_eq!(flow, ("reserved".to_string(), 1));
            for table in ["runs", "journal", "step_attempts", "run_events", "run_receipts"] {
                assert!(table_exists(&conn, table), "{table} missing after migration");
            }
            let runs: i64 = conn.query_row("SELECT count(*) FROM runs", [], |r| r.get(0)).unwrap();
            assert_eq!(runs, 0);
        }
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

    /// A v3 producer file kept one delivery row per event and subscriber; v4 keeps a cursor per
    /// subscriber and exception rows. Every delivery must read the same after the migration, and
    /// the relay and prune must go on from there.
    #[test]
    fn a_version_3_producer_file_migrates_its_deliveries_to_cursors_and_exceptions() {
        use tidemark_core::store::{DeliveryResult, DeliveryStatus, DeliveryVerdict, ProducerStore};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v3.db");
        {
            let mut conn = Connection::open(&path).unwrap();
            configure(&conn, Durability::Full).unwrap();
            migrate_to(&mut conn, 3).unwrap();
            meta_set(&conn, "producer.source", "shop").unwrap();
            meta_set(&conn, "producer.generation", "g1").unwrap();
            for position in 1..=6 {
                conn.execute(
                    "INSERT INTO outbox (position, event_id, flow_id, seq, event_type, schema_version, payload, content_hash,
                         created_at_ms, generation)
                     VALUES (?1, 'e' || ?1, 'f' || ?1, 1, 'reservation.reserved', 1, '{\"amount\":1}', 'h', ?1 * 10, 'g1')",
                    [position],
                )
                .unwrap();
            }
            // audit subscribed from the start, search before event 4.
            conn.execute_batch(
                "INSERT INTO subscriptions (consumer_id, endpoint, created_at_ms) VALUES ('audit', 'a.db', 0), ('search', 's.db', 35);
                 INSERT INTO deliveries (position, consumer_id, status, attempts, next_attempt_at_ms, last_error, updated_at_ms) VALUES
                   (1, 'audit', 'accepted', 0, 10, NULL, 11),
                   (2, 'audit', 'accepted', 1, 25, NULL, 26),
                   (3, 'audit', 'quarantined', 8, 30, 'conflict: x', 31),
                   (4, 'audit', 'accepted', 0, 40, NULL, 41),
                   (5, 'audit', 'pending', 0, 50, NULL, 50),
                   (6, 'audit', 'pending', 2, 999, 'failed: y', 61),
                   (4, 'search', 'dismissed', 1, 40, 'operator dismissed: z', 42),
                   (5, 'search', 'accepted', 0, 50, NULL, 51),
                   (6, 'search', 'pending', 0, 60, NULL, 60);",
            )
            .unwrap();
        }
        let mut producer = crate::SqliteProducer::open(&path).unwrap();
        let conn = open(&path, false, Durability::Full).unwrap();
        assert_eq!(schema_version(&conn).unwrap(), SCHEMA_VERSION);
        let cursors: Vec<(String, i64, i64)> = conn
            .prepare("SELECT consumer_id, from_position, delivered_position FROM subscriptions ORDER BY consumer_id")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        assert_eq!(cursors, [("audit".to_string(), 1, 4), ("search".to_string(), 4, 5)]);
        let exceptions: i64 = conn.query_row("SELECT count(*) FROM deliveries", [], |r| r.get(0)).unwrap();
        assert_eq!(exceptions, 4, "only the failed and operator-decided deliveries keep a row");

        let listed = |producer: &crate::SqliteProducer| -> Vec<(String, String, DeliveryStatus, u32, Option<String>)> {
            producer
                .deliveries(None, 100)
                .unwrap()
                .into_iter()
                .map(|d| (d.event_id, d.consumer_id, d.status, d.attempts, d.last_error))
                .collect()
        };
        let row = |e: &str, c: &str, s: DeliveryStatus, a: u32, err: Option<&str>| {
            (e.to_string(), c.to_string(), s, a, err.map(str::to_string))
        };
        use DeliveryStatus::{Accepted, Dismissed, Pending, Quarantined};
        assert_eq!(
            listed(&producer),
            [
                row("e1", "audit", Accepted, 0, None),
                row("e2", "audit", Accepted, 1, None),
                row("e3", "audit", Quarantined, 8, Some("conflict: x")),
                row("e4", "audit", Accepted, 0, None),
                row("e4", "search", Dismissed, 1, Some("operator dismissed: z")),
                row("e5", "audit", Pending, 0, None),
                row("e5", "search", Accepted, 0, None),
                row("e6", "audit", Pending, 2, Some("failed: y")),
                row("e6", "search", Pending, 0, None),
            ]
        );

        // The relay goes on from the cursors: the fresh deliveries are due, the retry is not yet.
        let due: Vec<(String, String)> = producer
            .due_deliveries(100, 10, None, None)
            .unwrap()
            .into_iter()
            .map(|d| (d.envelope.event_id, d.consumer_id))
            .collect();
        assert_eq!(due, [("e5".to_string(), "audit".to_string()), ("e6".to_string(), "search".to_string())]);
        let accepted = |position: i64, event: &str, consumer: &str| DeliveryResult {
            position,
            event_id: event.into(),
            consumer_id: consumer.into(),
            verdict: DeliveryVerdict::Accepted,
        };
        producer.record_deliveries(&[accepted(5, "e5", "audit"), accepted(6, "e6", "search")], 100).unwrap();
        let delivered: Vec<i64> = conn
            .prepare("SELECT delivered_position FROM subscriptions ORDER BY consumer_id")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        assert_eq!(delivered, [6, 6], "audit's cursor passes the retrying e6 (it has its exception row)");
        let pending: Vec<String> =
            producer.deliveries(Some(Pending), 100).unwrap().into_iter().map(|d| d.event_id).collect();
        assert_eq!(pending, ["e6"]);

        // Prune: every event settled for every subscriber goes, with one delivery per subscriber
        // that received it; e3 (quarantined) and e6 (retrying for audit) stay.
        let report = producer.prune_delivered(0, 100, 1_000).unwrap();
        assert_eq!((report.events_deleted, report.deliveries_deleted), (4, 6));
        let left: Vec<String> = producer.snapshot(100).unwrap().outbox.into_iter().map(|e| e.event_id).collect();
        assert_eq!(left, ["e3", "e6"]);
    }

    /// Schema v5 rebuilds the consumer tables with keys that lead with the flow id. A v4 file's
    /// records, receipts and cursors must come through unchanged and keep answering: a replay is
    /// `duplicate`, the same position with other content `conflict`, the next seq applies.
    #[test]
    fn a_version_4_consumer_file_is_rebuilt_in_the_current_layout_keeping_its_records() {
        use tidemark_core::policy::RetentionPolicy;
        use tidemark_core::store::{ConsumerStore, DrainScope, InboxStatus, ReceiveOutcome};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v4.db");
        let event = |seq: i64, amount: i64| tidemark_core::Envelope {
            event_id: format!("e{seq}"),
            source: "shop".into(),
            generation: "g1".into(),
            flow_id: "r1".into(),
            seq,
            event_type: "reservation.reserved".into(),
            schema_version: 1,
            payload: serde_json::json!({ "amount": amount }),
            created_at_ms: 1_000,
            traceparent: None,
        };
        {
            let mut conn = Connection::open(&path).unwrap();
            configure(&conn, Durability::Full).unwrap();
            migrate_to(&mut conn, 4).unwrap();
            meta_set(&conn, "consumer.horizon_ms", "1000000000").unwrap();
            // seq 1 applied and pruned to a receipt, seq 2 applied, seq 3 pending; cursor at 2.
            conn.execute(
                "INSERT INTO receipts (consumer_id, source, flow_id, seq, event_id, content_hash, created_at_ms)
                 VALUES ('audit', 'shop', 'r1', 1, 'e1', ?1, 1000)",
                [event(1, 1).content_hash()],
            )
            .unwrap();
            for (seq, status) in [(2, "applied"), (3, "pending")] {
                let e = event(seq, 1);
                conn.execute(
                    "INSERT INTO inbox (consumer_id, source, flow_id, seq, event_id, generation, event_type, schema_version,
                         payload, content_hash, created_at_ms, received_at_ms, status, status_at_ms)
                     VALUES ('audit', 'shop', 'r1', ?1, ?2, 'g1', 'reservation.reserved', 1, ?3, ?4, 1000, 1001, ?5, 1002)",
                    rusqlite::params![seq, e.event_id, e.payload.to_string(), e.content_hash(), status],
                )
                .unwrap();
            }
            conn.execute(
                "INSERT INTO cursors (consumer_id, source, flow_id, high_water_seq) VALUES ('audit', 'shop', 'r1', 2)",
                [],
            )
            .unwrap();
        }
        let mut consumer = crate::SqliteConsumer::init(&path, RetentionPolicy::default()).unwrap();
        let conn = consumer.connection();
        assert_eq!(schema_version(conn).unwrap(), SCHEMA_VERSION);
        let first_key_column = |table: &str| -> String {
            conn.query_row(
                &format!("SELECT name FROM pragma_index_xinfo('sqlite_autoindex_{table}_1') WHERE seqno = 0"),
                [],
                |r| r.get(0),
            )
            .unwrap()
        };
        for table in ["inbox", "receipts", "cursors"] {
            assert_eq!(first_key_column(table), "flow_id", "{table}");
        }
        // v6: the inbox's rows are numbered in receive order (the key is a unique index).
        let records: Vec<(i64, i64)> = conn
            .prepare("SELECT record, seq FROM inbox ORDER BY record")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        assert_eq!(records, [(1, 2), (2, 3)]);
        let statuses: Vec<(i64, InboxStatus)> =
            consumer.inbox("audit", None, 10).unwrap().into_iter().map(|e| (e.envelope.seq, e.status)).collect();
        assert_eq!(statuses, [(2, InboxStatus::Applied), (3, InboxStatus::Pending)]);
        assert_eq!(consumer.cursors(Some("audit")).unwrap()[0].high_water_seq, 2);

        let outcomes = consumer
            .receive_batch(&[("audit", &event(1, 1)), ("audit", &event(2, 1)), ("audit", &event(2, 9))], 2_000)
            .unwrap();
        assert!(matches!(outcomes[0], ReceiveOutcome::Duplicate { .. }), "{:?}", outcomes[0]);
        assert!(matches!(outcomes[1], ReceiveOutcome::Duplicate { .. }), "{:?}", outcomes[1]);
        assert!(matches!(outcomes[2], ReceiveOutcome::Conflict { .. }), "{:?}", outcomes[2]);
        struct Applies;
        impl tidemark_core::store::Handler<Connection> for Applies {
            fn handle(
                &mut self,
                _: &Connection,
                _: &str,
                _: &tidemark_core::Envelope,
            ) -> std::result::Result<(), tidemark_core::store::HandleError> {
                Ok(())
            }
        }
        let mut handler = Applies;
        // The migrated file applies seq 3, the next after the high-water mark.
        let report = consumer.drain("audit", &DrainScope::All, 10, &mut handler, 2_000).unwrap();
        assert_eq!(report.applied, 1);
        assert_eq!(consumer.cursors(Some("audit")).unwrap()[0].high_water_seq, 3);
    }

    #[test]
    fn a_missing_file_is_not_created() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing.db");
        assert_eq!(open(&path, false, Durability::Full).unwrap_err().code(), codes::NOT_INITIALIZED);
        assert!(!path.exists());
    }
}
