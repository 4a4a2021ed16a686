#!/bin/sh
# 2026-12-06d: issue 22's paths as they stand, in both of this VM's regimes, and the two new
# reference columns (the 64 tasks' batching ceiling, the cluster batch's R). Run from the
# project root after `cargo build --release -p newcache-floor --bins`; each run twice, alternated.
set -e
out=benches/results/2026-12-06d
F=target/release/floor
for i in 1 2; do
  # The single-connection paths, idle (the VM's idle vCPUs halt: a wake-up is most of a lone
  # round trip) and with one core kept busy (no halts: the round trip is the kernel's).
  $F --rounds 9 --memcached-threads 1 --path sync-get --path async-get-multi \
    --path async-get-current --json $out/single-idle-$i.json > $out/single-idle-$i.md 2> $out/single-idle-$i.err
  $F --rounds 9 --busy-core --memcached-threads 1 --path sync-get --path async-get-multi \
    --path async-get-current --json $out/single-busy-$i.json > $out/single-busy-$i.md 2> $out/single-busy-$i.err
  # 64 tasks beside async-memcached and the batching ceiling; the 100-key batch over 3 servers.
  $F --rounds 9 --path async-get-64 --path sync-get-many \
    --json $out/many-$i.json > $out/many-$i.md 2> $out/many-$i.err
  # The Redis Cluster batch beside F, C and R, on a fresh 3 + 3 Redis 7.0 cluster.
  env -u BASE FLOOR=$F benches/results/2026-12-04-redis-cluster/floor.sh --rounds 15 \
    --json $out/cluster-$i.json > $out/cluster-$i.md 2> $out/cluster-$i.err
done
