#!/bin/sh
# The 64-task path's batching ceiling in eight shapes (sockets x lines in flight x keys a line),
# each run twice, the shapes in turn; the fastest is `floor --ceiling`'s default. Run from the
# project root after `cargo build --release -p newcache-floor --bins`.
set -e
out=benches/results/2026-12-06d
for i in 1 2; do
  for shape in 1x1x64 1x2x32 1x4x16 1x8x8 1x16x4 2x1x32 2x2x16 2x4x8; do
    target/release/floor --rounds 5 --path async-get-64 --ceiling $shape \
      --json $out/ceiling-$shape-$i.json > $out/ceiling-$shape-$i.md 2> $out/ceiling-$shape-$i.err
  done
done
