#!/bin/sh
# The stampede tool on the cluster of ./cluster.sh (cluster-require-full-coverage no on every
# node), mode $MODE; $KILL_AT s in, the master serving the hot key (the busiest master by
# instantaneous_ops_per_sec) is SIGKILLed; its replica takes over after the 2 s node timeout.
MODE=${MODE:-default}; KILL_AT=${KILL_AT:-6}
SEEDS=redis://127.0.0.1:41000,redis://127.0.0.1:41001,redis://127.0.0.1:41002,redis://127.0.0.1:41003,redis://127.0.0.1:41004,redis://127.0.0.1:41005
for p in 41000 41001 41002 41003 41004 41005; do
  redis-cli -p $p config set cluster-require-full-coverage no >/dev/null 2>&1
done
(
  sleep "$KILL_AT"
  best=; most=-1
  for p in 41000 41001 41002 41003 41004 41005; do
    redis-cli -p $p role 2>/dev/null | head -1 | grep -q master || continue
    ops=$(redis-cli -p $p info stats | grep instantaneous_ops_per_sec | cut -d: -f2 | tr -d '\r')
    [ "$ops" -gt "$most" ] && { most=$ops; best=$p; }
  done
  pid=$(redis-cli -p $best info server | grep process_id | cut -d: -f2 | tr -d '\r')
  kill -9 "$pid"
  echo "killed master $best (pid $pid, $most ops/s) at $(date -u +%T)" >&2
) &
target/release/stampede --redis-cluster "$SEEDS" --procs 4 --threads 16 --ttl 2 --duration 20 --mode "$MODE"
wait
