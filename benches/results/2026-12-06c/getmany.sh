#!/bin/sh
# The memcached get_many of 2026-12-06c: `floor --path sync-get-many` (100 keys over three
# memcached), the build before the SIMD ketama lanes (BASE_FLOOR) and after (NEW_FLOOR)
# alternated, base new new base twice. Run from the project root.
set -e
out=benches/results/2026-12-06c
i=0
for side in base new new base base new new base; do
  i=$((i + 1))
  case $side in base) bin=$BASE_FLOOR ;; new) bin=$NEW_FLOOR ;; esac
  $bin --rounds 9 --path sync-get-many \
    --json $out/getmany-$i-$side.json > $out/getmany-$i-$side.md 2> $out/getmany-$i-$side.err
done
