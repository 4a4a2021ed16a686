#!/bin/sh
# The sync get with one core busy, before (FLOOR_BASE: built at d2437c4) and after (FLOOR_NEW)
# three fewer clock reads and the pool's boxed connections; alternated twice.
set -e
out=benches/results/2026-12-06e/clock
for i in 1 2; do
  for b in base new; do
    if [ $b = base ]; then F=$FLOOR_BASE; else F=$FLOOR_NEW; fi
    $F --rounds 9 --busy-core --memcached-threads 1 --path sync-get > $out/sg-$i-$b.md 2> $out/sg-$i-$b.err
  done
done
