#!/bin/sh
# 2026-12-07b: the build before this sitting's changes (8f71651) and after, alternated, on the
# paths they touch: the 64 tasks (memcached -t 2), the sync get and one async task (memcached
# -t 1) idle and with one core busy, and the 100-key batch over three memcached. Run from the
# project root with both floor binaries built (`cargo build --release -p newcache-bench -- floorbins`
# at each commit, copied to $BASE and $NEW).
set -e
out=benches/results/2026-12-07b
BASE=${BASE:-/tmp/ab/base-floor}
NEW=${NEW:-/tmp/ab/new-floor}
for i in 1 2; do
  for side in base new; do
    F=$BASE; [ $side = new ] && F=$NEW
    $F --rounds 9 --path async-get-64 --json $out/a64-$side-$i.json > $out/a64-$side-$i.md 2> $out/a64-$side-$i.err
    $F --rounds 9 --busy-core --memcached-threads 1 --path sync-get --path async-get-multi \
      --json $out/busy-$side-$i.json > $out/busy-$side-$i.md 2> $out/busy-$side-$i.err
    $F --rounds 9 --path sync-get-many --json $out/many-$side-$i.json > $out/many-$side-$i.md 2> $out/many-$side-$i.err
  done
done

# Then the README's rows, on the build after (HEAD): as 2026-12-06e's sitting.sh, plus the batch.
for i in 1 2; do
  $NEW --rounds 9 --path async-get-64 --json $out/final-a64-$i.json > $out/final-a64-$i.md 2> $out/final-a64-$i.err
  $NEW --rounds 9 --memcached-threads 1 --path sync-get --path async-get-multi \
    --path async-get-current --json $out/final-single-idle-$i.json > $out/final-single-idle-$i.md 2> $out/final-single-idle-$i.err
  $NEW --rounds 9 --busy-core --memcached-threads 1 --path sync-get --path async-get-multi \
    --path async-get-current --json $out/final-single-busy-$i.json > $out/final-single-busy-$i.md 2> $out/final-single-busy-$i.err
  $NEW --rounds 9 --path sync-get-many --json $out/final-many-$i.json > $out/final-many-$i.md 2> $out/final-many-$i.err
done
