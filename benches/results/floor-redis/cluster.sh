#!/bin/sh
# Starts a 6-node Redis Cluster (3 masters, 3 replicas: `redis-cli --cluster create`, as the
# tests' fixture makes one) on the first six loopback ports from $BASE (default 42000, below
# 55000) that are free with their bus port (the port + 10000: in Linux's ephemeral range, so an
# outgoing connection may hold one), runs the floor bench's cluster mode on it (sync
# Cache::get_many of 100 keys over the 3 masters beside F, a bare socket per master, and C,
# the memory backend), then stops the cluster.
#
#   benches/results/floor-redis/cluster.sh [bench floor arguments...]
#   e.g. cluster.sh --rounds 15 --json cluster.json
#
# REDIS_SERVER picks the server binary (default redis-server; Valkey's works too); FLOOR a
# built `bench` binary (target/release/bench) to run instead of `cargo run`. KEEP=1 starts
# the cluster and leaves it running, its ports printed, without running the bench.
set -e
BASE=${BASE:-42000}
SERVER=${REDIS_SERVER:-redis-server}
FLOOR=${FLOOR:-}
DIR=$(mktemp -d /tmp/newcache-floor-cluster.XXXXXX)
# A port is free if no socket uses it, nor its bus port.
free() { [ -z "$(ss -Htan "( sport = :$1 or sport = :$(($1 + 10000)) )")" ]; }
PORTS=
p=$BASE
while [ "$(echo $PORTS | wc -w)" -lt 6 ]; do
  [ "$p" -lt 55000 ] || { echo "no 6 free ports from $BASE below 55000" >&2; exit 1; }
  if free "$p"; then PORTS="$PORTS $p"; fi
  p=$((p + 1))
done
stop() {
  for p in $PORTS; do redis-cli -p "$p" shutdown nosave >/dev/null 2>&1 || true; done
  rm -rf "$DIR"
}
trap stop EXIT INT TERM
for p in $PORTS; do
  mkdir -p "$DIR/$p"
  (cd "$DIR/$p" && "$SERVER" --port "$p" --bind 127.0.0.1 --cluster-enabled yes \
    --cluster-config-file nodes.conf --cluster-node-timeout 2000 --repl-diskless-sync-delay 0 \
    --save '' --appendonly no --protected-mode no --loglevel warning --daemonize yes)
done
for p in $PORTS; do
  n=0
  until redis-cli -p "$p" ping >/dev/null 2>&1; do
    n=$((n + 1)); [ $n -lt 100 ] || { echo "node $p did not start" >&2; exit 1; }
    sleep 0.1
  done
done
redis-cli --cluster create $(for p in $PORTS; do printf '127.0.0.1:%s ' "$p"; done) \
  --cluster-replicas 1 --cluster-yes >/dev/null
for p in $PORTS; do
  until redis-cli -p "$p" cluster info | grep -q cluster_state:ok; do sleep 0.2; done
done
# Until every replica synced (a replica that never did may not take over; nothing here needs it,
# but the masters are then quiet).
for p in $PORTS; do
  until redis-cli -p "$p" info replication | grep -Eq 'role:master|master_link_status:up'; do
    sleep 0.2
  done
done
[ -z "$KEEP" ] || { echo "cluster on:$PORTS (KEEP set: stop it with redis-cli shutdown nosave)"; trap - EXIT INT TERM; exit 0; }
SEEDS=$(for p in $PORTS; do printf 'redis://127.0.0.1:%s,' "$p"; done)
cd "$(dirname "$0")/../../.."
if [ -n "$FLOOR" ]; then
  "$FLOOR" floor --redis-cluster "${SEEDS%,}" "$@"
else
  cargo run --release -p newcache-bench --bin bench -- floor --redis-cluster "${SEEDS%,}" "$@"
fi
