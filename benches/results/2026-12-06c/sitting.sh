#!/bin/sh
# The Redis Cluster batch of 2026-12-06c: a sync Cache::get_many of 100 keys over 3 masters
# beside its floor (F + C), the build before and after alternated, base new new base
# twice, each run on a fresh 3 + 3 Redis 7 cluster (../2026-12-04-redis-cluster/floor.sh).
# BASE_FLOOR and NEW_FLOOR name `floor` binaries built from each tree (cargo build --release -p
# newcache-floor --bin floor). Run from the project root.
set -e
out=benches/results/2026-12-06c
i=0
for side in base new new base base new new base; do
  i=$((i + 1))
  case $side in base) bin=$BASE_FLOOR ;; new) bin=$NEW_FLOOR ;; esac
  env -u BASE FLOOR=$bin benches/results/2026-12-04-redis-cluster/floor.sh --rounds 15 \
    --json $out/cluster-$i-$side.json > $out/cluster-$i-$side.md 2> $out/cluster-$i-$side.err
done
