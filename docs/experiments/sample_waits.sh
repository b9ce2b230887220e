#!/bin/bash
# Sample pg_stat_activity wait events every 100 ms while a command runs.
out=$1; shift
"$@" > /tmp/sample_cmd.json 2>/tmp/sample_cmd.err &
pid=$!
: > "$out"
while kill -0 $pid 2>/dev/null; do
  psql -h 127.0.0.1 -U postgres -d test -Atc "select coalesce(wait_event_type,'-')||':'||coalesce(wait_event,'-')||' '||state||' '||regexp_replace(left(query,70),'\s+',' ','g') from pg_stat_activity where datname='test' and pid<>pg_backend_pid() and backend_type='client backend'" >> "$out" 2>/dev/null
  sleep 0.1
done
wait $pid; echo "exit $?"
