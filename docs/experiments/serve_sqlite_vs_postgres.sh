#!/usr/bin/env bash
# `tidemark serve` under `tidemark loadtest`, on SQLite files and on PostgreSQL, in one run, with
# the same configuration, clients and mix: the ratio of the two is what docs/benchmarks.md
# reports ("`tidemark serve` on PostgreSQL under load").
#
#   bash docs/experiments/serve_sqlite_vs_postgres.sh target/release/tidemark /tmp/serve-cmp \
#        'postgres://postgres@127.0.0.1:5432/test' [clients] [seconds] [mix]
#
# The PostgreSQL schemas `ltcmp_*` are dropped before and after.
set -euo pipefail
B=$(realpath "$1"); OUT=$2; PG=$3; CLIENTS=${4:-64}; SECONDS_=${5:-20}; MIX=${6:-1:2:1}
PREFIX=ltcmp
rm -rf "$OUT"; mkdir -p "$OUT"
drop() {
  psql "$PG" -qAt -c "SELECT format('DROP SCHEMA %I CASCADE;', nspname) FROM pg_namespace WHERE starts_with(nspname, '${PREFIX}_')" \
    | psql "$PG" -q >/dev/null 2>&1
}
drop
printf '[auth]\nrate_per_second = 1000000\nburst = 10000000\n' > "$OUT/lt.toml"
run() { # name, then the flags that name the store
  local name=$1; shift
  local data="$OUT/$name"
  local op ad
  op=$("$B" token create "$@" --tenant load --scope operate | python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')
  ad=$("$B" token create "$@" --tenant load --scope admin | python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')
  local serve_flags=(--data "$data")
  if [[ $1 == --store ]]; then serve_flags+=(--store "$2"); fi
  "$B" serve --config "$OUT/lt.toml" "${serve_flags[@]}" --listen 127.0.0.1:0 > "$OUT/$name.serve.out" 2> "$OUT/$name.serve.err" &
  local pid=$!
  # The server goes when this script does, whatever stops it.
  trap "kill -TERM $pid 2>/dev/null || true" EXIT
  for _ in $(seq 1 200); do grep -q listening "$OUT/$name.serve.out" 2>/dev/null && break; sleep 0.05; done
  local addr
  addr=$(head -1 "$OUT/$name.serve.out" | python3 -c 'import json,sys; print(json.load(sys.stdin)["addr"])')
  "$B" loadtest --server "http://$addr" --token "$op" --admin-token "$ad" --clients "$CLIENTS" \
    --duration-s "$SECONDS_" --mix "$MIX" --ledger "$OUT/$name.jsonl" > "$OUT/$name.load.json"
  sleep 5
  "$B" loadtest verify "$@" --tenant load --ledger "$OUT/$name.jsonl" > "$OUT/$name.verify.json" || true
  kill -TERM "$pid"; wait "$pid" || true
  echo "== $name (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
  python3 - "$OUT/$name.load.json" "$OUT/$name.verify.json" <<'PY'
import json, sys
load, verify = (json.load(open(p)) for p in sys.argv[1:3])
print("accepted/s", load["rate_per_s"]["accepted"], "starts/s", load["rate_per_s"]["starts"],
      "advances/s", load["rate_per_s"]["advances"], "appends/s", load["rate_per_s"]["appends"],
      "p50 ms", load["latency_ms"]["p50"], "p99 ms", load["latency_ms"]["p99"],
      "5xx", load["server_errors"], "| verify:", verify["outcome"], "runs unfinished", verify["runs_unfinished"])
PY
}
run sqlite --data "$OUT/sqlite"
run postgres --store "$PG?schema=$PREFIX"
drop
