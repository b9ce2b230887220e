#!/bin/bash
# PostgreSQL figures of docs/benchmarks.md ("PostgreSQL (`bench --store postgres://`)"), one after
# the other in one session on one server: tidemark's workflow bench (with its pgbench ceilings and
# the one- and two-worker-process runs), DBOS's three-step workflow on the same server
# (../shared/peers/dbos_saga.py), then tidemark's pipeline bench (with its own pgbench ceilings).
# Usage: pg_side_by_side.sh TIDEMARK_BINARY [OUT_DIR] [POSTGRES_URL]; more flags of each bench in
# WF_ARGS and PIPE_ARGS (for example WF_ARGS="--sagas 5000 --process-sagas 10000").
# Needs: pgbench and psql on PATH; ${PEERS:-$HOME/.cache/tidemark-peers}/venv with dbos (see
# ../shared/peers/README.md). The bench makes fresh schemas and drops them; DBOS gets a database
# of its own (dbos_peer), dropped and made again here.
set -u
TM=$(readlink -f "$1"); OUT=${2:-/tmp/pg-side}; URL=${3:-postgres://postgres@127.0.0.1:5432/test}
mkdir -p "$OUT"
PEERS_DIR=${PEERS_DIR:-$(cd "$(dirname "$0")/../../.." && pwd)/shared/peers}
PY=${PEERS:-$HOME/.cache/tidemark-peers}/venv/bin/python
tag=$$
echo "== load"; cat /proc/loadavg
echo "== tidemark bench --workflows --store $URL?schema=pgw$tag ${WF_ARGS:-}"
"$TM" bench --workflows --store "$URL?schema=pgw$tag" ${WF_ARGS:-} > "$OUT/tm_pg_workflows.json"
echo "   exit $?"
python3 - "$OUT/tm_pg_workflows.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); s = d["summary"]; w = d.get("worker_processes") or {}
print("  sagas/s (in process, median):", s["sagas_per_s"], "each:", d["throughput"]["sagas_per_s_each"])
print("  pgbench 1 client / 8 clients:", s.get("pgbench_one_client_commits_per_s"), "/", s.get("pgbench_eight_clients_commits_per_s"))
for k in ("one", "two"):
    if k in w:
        r = w[k]; print(f"  {k} worker process(es): {r['sagas_per_s']} sagas/s, cpu {r['cpu_seconds']}")
print("  two/one:", w.get("two_to_one_ratio"), " check passed:", d["check"]["passed"])
print("  latency ms:", s.get("latency_ms"), " load:", d["params"]["load_average_at_start"], "->", d["params"]["load_average_at_end"])
PY
echo "== DBOS on PostgreSQL (dbos_saga.py 300)"
psql "$URL" -qc "drop database if exists dbos_peer" -c "create database dbos_peer" >/dev/null 2>&1
base=${URL%/*}
DBOS_PG_URL="${base/postgres:/postgresql:}/dbos_peer" $PY "$PEERS_DIR/dbos_saga.py" 300 2>/dev/null | grep -v '^$' | tee "$OUT/dbos_pg.txt"
psql "$URL" -qc "drop database if exists dbos_peer" >/dev/null 2>&1
echo "== tidemark bench --store $URL?schema=pgp$tag ${PIPE_ARGS:-}"
"$TM" bench --store "$URL?schema=pgp$tag" ${PIPE_ARGS:-} > "$OUT/tm_pg_pipeline.json"
echo "   exit $?"
python3 - "$OUT/tm_pg_pipeline.json" "$OUT/tm_pg_workflows.json" "$OUT/dbos_pg.txt" <<'PY'
import json, re, sys
d = json.load(open(sys.argv[1])); s = d["summary"]
print("  events/s one thread / three threads / one per op:", s["end_to_end_events_per_s"], "/", s["pipelined_end_to_end_events_per_s"], "/", s["one_per_op_events_per_s"])
print("  pgbench 1 client / 8 clients:", s["pgbench_one_client_commits_per_s"], "/", s["pgbench_eight_clients_commits_per_s"])
print("  best / pgbench 1 client:", s["best_to_pgbench_one_client_ratio"], " check passed:", d["check"]["passed"])
w = json.load(open(sys.argv[2]))["summary"]["sagas_per_s"]
m = re.search(r"16 threads: (\d+)", open(sys.argv[3]).read())
if m:
    print(f"  order sagas/s {w} / DBOS concurrent {m.group(1)} = {w / float(m.group(1)):.1f}x (target 20x)")
PY
echo "== load"; cat /proc/loadavg
