#!/usr/bin/env python3
"""Instructions per event of candidate consumer-inbox layouts (docs/benchmarks.md, "Session 4").

Counts SQLite's own instructions (callgrind, only inside sqlite3_step) for receiving N events,
reading them as open records and marking them applied, in several table layouts. Python's
sqlite3 module is only the driver: its SQLite is the system library, not tidemark's bundled
build, so compare layouts with each other, not with tidemark's own figures.

    python3 docs/experiments/inbox_layouts.py            # every layout, N = 5,000
    python3 docs/experiments/inbox_layouts.py v5 queue   # some layouts

Each stage is measured as the difference between two runs that stop before and after it, so
setup and Python are not counted. Needs valgrind. Deterministic: the same numbers every run.
"""

import json
import os
import random
import re
import sqlite3
import subprocess
import sys
import tempfile

N = 5_000

BODY = """consumer_id TEXT NOT NULL, source TEXT NOT NULL, flow_id TEXT NOT NULL, seq INTEGER NOT NULL CHECK (seq >= 1),
    event_id TEXT NOT NULL, generation TEXT NOT NULL, event_type TEXT NOT NULL, schema_version INTEGER NOT NULL,
    payload TEXT NOT NULL, content_hash TEXT NOT NULL, created_at_ms INTEGER NOT NULL, received_at_ms INTEGER NOT NULL"""
STATUS = """status TEXT NOT NULL CHECK ((status = 'pending' OR status = 'applied' OR status = 'blocked' OR status = 'skipped')),
    reason TEXT, status_at_ms INTEGER NOT NULL"""
OPEN_INDEX = "CREATE INDEX inbox_open ON inbox (consumer_id, source, flow_id, seq) WHERE status IN ('pending', 'blocked');"
DONE_INDEX = "CREATE INDEX inbox_done_age ON inbox (status_at_ms) WHERE status IN ('applied', 'skipped');"
KEY = "(consumer_id, source, flow_id, seq)"

# name: (what it is, schema)
LAYOUTS = {
    "v5": ("today: one WITHOUT ROWID table keyed by flow, open and done partial indexes; apply rewrites the row",
           f"CREATE TABLE inbox ({BODY}, {STATUS}, PRIMARY KEY (flow_id, source, consumer_id, seq)) WITHOUT ROWID;"
           f"CREATE UNIQUE INDEX inbox_event ON inbox (event_id, consumer_id); {OPEN_INDEX} {DONE_INDEX}"),
    "rowid": ("the same columns in a rowid table (the key a unique index); apply rewrites the row in place",
              f"CREATE TABLE inbox (record INTEGER PRIMARY KEY, {BODY}, {STATUS});"
              "CREATE UNIQUE INDEX inbox_key ON inbox (flow_id, source, consumer_id, seq);"
              f"CREATE UNIQUE INDEX inbox_event ON inbox (event_id, consumer_id); {OPEN_INDEX} {DONE_INDEX}"),
    "rowid-no-done-index": ("rowid without the done-age index (what that index costs)",
                            f"CREATE TABLE inbox (record INTEGER PRIMARY KEY, {BODY}, {STATUS});"
                            "CREATE UNIQUE INDEX inbox_key ON inbox (flow_id, source, consumer_id, seq);"
                            f"CREATE UNIQUE INDEX inbox_event ON inbox (event_id, consumer_id); {OPEN_INDEX}"),
    "narrow-status": ("status in a narrow keyed row, the body in a rowid table (apply rewrites the narrow row)",
                      "CREATE TABLE inbox (consumer_id TEXT NOT NULL, source TEXT NOT NULL, flow_id TEXT NOT NULL,"
                      f" seq INTEGER NOT NULL, event_id TEXT NOT NULL, record INTEGER NOT NULL, {STATUS},"
                      " PRIMARY KEY (flow_id, source, consumer_id, seq)) WITHOUT ROWID;"
                      "CREATE TABLE inbox_body (record INTEGER PRIMARY KEY, generation TEXT NOT NULL, event_type TEXT NOT NULL,"
                      " schema_version INTEGER NOT NULL, payload TEXT NOT NULL, content_hash TEXT NOT NULL,"
                      " created_at_ms INTEGER NOT NULL, received_at_ms INTEGER NOT NULL);"
                      f"CREATE UNIQUE INDEX inbox_event ON inbox (event_id, consumer_id); {OPEN_INDEX} {DONE_INDEX}"),
    "queue": ("immutable rowid body, open records in a narrow queue table, done records in a narrow table with a"
              " time index (apply deletes the queue row and inserts the done row)",
              f"CREATE TABLE inbox (record INTEGER PRIMARY KEY, {BODY});"
              "CREATE UNIQUE INDEX inbox_key ON inbox (flow_id, source, consumer_id, seq);"
              "CREATE UNIQUE INDEX inbox_event ON inbox (event_id, consumer_id);"
              f"CREATE TABLE inbox_open (consumer_id TEXT NOT NULL, source TEXT NOT NULL, flow_id TEXT NOT NULL,"
              f" seq INTEGER NOT NULL, record INTEGER NOT NULL, {STATUS}, PRIMARY KEY {KEY}) WITHOUT ROWID;"
              f"CREATE TABLE inbox_done (record INTEGER PRIMARY KEY, {STATUS});"
              "CREATE INDEX inbox_done_age ON inbox_done (status_at_ms);"),
    "queue-only": ("the queue alone (apply only deletes the queue row): the floor of any layout",
                   f"CREATE TABLE inbox (record INTEGER PRIMARY KEY, {BODY});"
                   "CREATE UNIQUE INDEX inbox_key ON inbox (flow_id, source, consumer_id, seq);"
                   "CREATE UNIQUE INDEX inbox_event ON inbox (event_id, consumer_id);"
                   f"CREATE TABLE inbox_open (consumer_id TEXT NOT NULL, source TEXT NOT NULL, flow_id TEXT NOT NULL,"
                   f" seq INTEGER NOT NULL, record INTEGER NOT NULL, {STATUS}, PRIMARY KEY {KEY}) WITHOUT ROWID;"),
}

BODY_COLS = "consumer_id, source, flow_id, seq, event_id, generation, event_type, schema_version, payload, content_hash, created_at_ms, received_at_ms"


def events():
    random.seed(1)
    out = []
    for i in range(N):
        flow = "g-%08d-%d" % (random.randrange(10**8), i)
        body = ("bench", "shop", flow, 1, "%020d%012x" % (i, random.randrange(2**48)), "0193a1b2c3d4e5f60718293a4b5c6d7e",
                "reservation.reserved", 1, json.dumps({"quantity": i % 1000 + 1}), "%064x" % random.randrange(2**256), 1000, 2000)
        out.append(body)
    return out


def run(layout, stage, path):
    """Create the file, then do the stages up to `stage` (1 receive, 2 read, 3 apply)."""
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.remove(path + suffix)
    c = sqlite3.connect(path, isolation_level=None)
    c.execute("PRAGMA journal_mode=WAL")
    c.execute("PRAGMA synchronous=FULL")
    c.executescript(LAYOUTS[layout][1])
    data = events()
    if stage >= 1:
        c.execute("BEGIN IMMEDIATE")
        cur = c.cursor()
        for e in data:
            if layout in ("v5", "rowid", "rowid-no-done-index"):
                cur.execute(f"INSERT INTO inbox ({BODY_COLS}, status, reason, status_at_ms) VALUES ({','.join('?' * 12)}, 'pending', NULL, 2000)", e)
            elif layout == "narrow-status":
                cur.execute("INSERT INTO inbox_body (generation, event_type, schema_version, payload, content_hash, created_at_ms, received_at_ms)"
                            " VALUES (?,?,?,?,?,?,?)", e[5:12])
                cur.execute("INSERT INTO inbox (consumer_id, source, flow_id, seq, event_id, record, status, reason, status_at_ms)"
                            " VALUES (?,?,?,?,?,?,'pending',NULL,2000)", e[0:5] + (cur.lastrowid,))
            else:
                cur.execute(f"INSERT INTO inbox ({BODY_COLS}) VALUES ({','.join('?' * 12)})", e)
                cur.execute("INSERT INTO inbox_open VALUES (?,?,?,?,?,'pending',NULL,2000)", e[0:4] + (cur.lastrowid,))
        c.execute("COMMIT")
    if stage >= 2:
        c.execute("BEGIN IMMEDIATE")
        if layout == "v5":
            got = c.execute("SELECT consumer_id, source, flow_id, seq, payload FROM inbox INDEXED BY inbox_open"
                            " WHERE consumer_id = 'bench' AND status IN ('pending', 'blocked') ORDER BY source, flow_id, seq").fetchall()
        elif layout in ("rowid", "rowid-no-done-index"):
            got = c.execute("SELECT record, payload FROM inbox INDEXED BY inbox_open"
                            " WHERE consumer_id = 'bench' AND status IN ('pending', 'blocked') ORDER BY source, flow_id, seq").fetchall()
        elif layout == "narrow-status":
            got = c.execute("SELECT i.consumer_id, i.source, i.flow_id, i.seq, b.payload FROM inbox i INDEXED BY inbox_open"
                            " JOIN inbox_body b ON b.record = i.record"
                            " WHERE i.consumer_id = 'bench' AND i.status IN ('pending', 'blocked') ORDER BY i.source, i.flow_id, i.seq").fetchall()
        else:
            got = c.execute("SELECT q.consumer_id, q.source, q.flow_id, q.seq, q.record, i.payload FROM inbox_open q"
                            " JOIN inbox i ON i.record = q.record WHERE q.consumer_id = 'bench' ORDER BY q.source, q.flow_id, q.seq").fetchall()
        assert len(got) == N, len(got)
        if stage >= 3:
            if layout in ("v5", "narrow-status"):
                c.executemany("UPDATE inbox SET status = 'applied', reason = NULL, status_at_ms = 3000 WHERE consumer_id = ?1"
                              " AND source = ?2 AND flow_id = ?3 AND seq = ?4 AND (status = 'pending' OR status = 'blocked')"
                              " AND ?5 IS NOT NULL", got)
            elif layout in ("rowid", "rowid-no-done-index"):
                c.executemany("UPDATE inbox SET status = 'applied', reason = NULL, status_at_ms = 3000 WHERE record = ?1"
                              " AND (status = 'pending' OR status = 'blocked') AND ?2 IS NOT NULL", got)
            else:
                c.executemany("DELETE FROM inbox_open WHERE consumer_id = ?1 AND source = ?2 AND flow_id = ?3 AND seq = ?4"
                              " AND ?5 IS NOT NULL AND ?6 IS NOT NULL", got)
                if layout == "queue":
                    c.executemany("INSERT INTO inbox_done VALUES (?1, 'applied', NULL, 3000)", [(g[4],) for g in got])
        c.execute("COMMIT")
    c.close()


def instructions(layout, stage, tmp):
    out = os.path.join(tmp, "callgrind.out")
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--toggle-collect=sqlite3_step",
                    sys.executable, __file__, "--stage", layout, str(stage), os.path.join(tmp, "inbox.db")],
                   check=True, capture_output=True)
    summary = subprocess.run(["callgrind_annotate", out], check=True, capture_output=True, text=True).stdout
    return int(re.search(r"([\d,]+)\s+\(100\.0%\)\s+PROGRAM TOTALS", summary).group(1).replace(",", ""))


def main():
    if sys.argv[1:2] == ["--stage"]:
        run(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    layouts = sys.argv[1:] or list(LAYOUTS)
    print(f"SQLite {sqlite3.sqlite_version}, {N} events; instructions per event inside sqlite3_step")
    print(f"{'layout':22} {'receive':>8} {'read':>8} {'apply':>8} {'total':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for layout in layouts:
            counts = [instructions(layout, stage, tmp) for stage in range(4)]
            per = [(counts[i + 1] - counts[i]) // N for i in range(3)]
            print(f"{layout:22} {per[0]:>8} {per[1]:>8} {per[2]:>8} {sum(per):>8}   {LAYOUTS[layout][0]}")


if __name__ == "__main__":
    main()
