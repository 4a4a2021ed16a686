#!/bin/sh
# The sync pool's reply lines read where they lie in the reader's buffer (wire::read_slots):
# the build before (BASE_FLOOR) and after (NEW_FLOOR) alternated, base new new base twice: a
# sync get with one core kept busy (the client's CPU is the ratio there) and the 100-key batch
# over three servers. Run from the project root; each FLOOR a `floor` binary
# (cargo build --release -p newcache-floor --bin floor) of its tree.
set -e
out=benches/results/2026-12-06d
i=0
for side in base new new base base new new base; do
  i=$((i + 1))
  case $side in base) bin=$BASE_FLOOR ;; new) bin=$NEW_FLOOR ;; esac
  $bin --rounds 9 --busy-core --memcached-threads 1 --path sync-get \
    --json $out/wire-get-$i-$side.json > $out/wire-get-$i-$side.md 2> $out/wire-get-$i-$side.err
  $bin --rounds 9 --path sync-get-many \
    --json $out/wire-many-$i-$side.json > $out/wire-many-$i-$side.md 2> $out/wire-many-$i-$side.err
done
