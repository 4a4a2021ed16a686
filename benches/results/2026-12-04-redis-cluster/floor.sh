#!/bin/sh
# Starts a 6-node Redis Cluster (3 masters, 3 replicas: `redis-cli --cluster create`, as the
# tests' fixture makes one) on 127.0.0.1:$BASE..$BASE+5 (default 42000; each node's bus port is
# its port + 10000, so BASE + 5 + 10000 must stay below 65536: keep BASE under 55000), runs the
# floor bench's cluster mode on it (sync Cache::get_many of 100 keys over the 3 masters beside
# F, a bare socket per master, and C, the memory backend), then stops the cluster.
#
#   benches/results/2026-12-04-redis-cluster/floor.sh [floor arguments...]
#   e.g. floor.sh --rounds 15 --json benches/results/2026-12-04-redis-cluster/floor.json
#
# REDIS_SERVER picks the server binary (default redis-server; Valkey's works too).
set -e
BASE=${BASE:-42000}
SERVER=${REDIS_SERVER:-redis-server}
DIR=$(mktemp -d /tmp/newcache-floor-cluster.XXXXXX)
PORTS=$(seq "$BASE" $((BASE + 5)))
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
  until redis-cli -p "$p" ping >/dev/null 2>&1; do sleep 0.1; done
done
redis-cli --cluster create $(for p in $PORTS; do printf '127.0.0.1:%s ' "$p"; done) \
  --cluster-replicas 1 --cluster-yes >/dev/null
for p in $PORTS; do
  until redis-cli -p "$p" cluster info | grep -q cluster_state:ok; do sleep 0.2; done
done
SEEDS=$(for p in $PORTS; do printf 'redis://127.0.0.1:%s,' "$p"; done)
cd "$(dirname "$0")/../../.."
cargo run --release -p newcache-floor --bin floor -- --redis-cluster "${SEEDS%,}" "$@"
