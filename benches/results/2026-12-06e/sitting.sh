#!/bin/sh
# 2026-12-06e: the 64-task path beside async-memcached, the batching ceiling, the minimal client
# (the facade's work + a oneshot to one of two batchers, benches/floor/src/minimal.rs) and the
# facade's work alone, each side's CPU a get, client and memcached (the .err files); then the
# single-connection paths idle and with one core busy, as 2026-12-06d ran them. Run from the
# project root after `cargo build --release -p newcache-floor --bins`.
set -e
out=benches/results/2026-12-06e
F=target/release/floor
for i in 1 2; do
  $F --rounds 9 --path async-get-64 --json $out/a64-$i.json > $out/a64-$i.md 2> $out/a64-$i.err
done
for i in 1 2; do
  $F --rounds 9 --memcached-threads 1 --path sync-get --path async-get-multi \
    --path async-get-current --json $out/single-idle-$i.json > $out/single-idle-$i.md 2> $out/single-idle-$i.err
  $F --rounds 9 --busy-core --memcached-threads 1 --path sync-get --path async-get-multi \
    --path async-get-current --json $out/single-busy-$i.json > $out/single-busy-$i.md 2> $out/single-busy-$i.err
done
