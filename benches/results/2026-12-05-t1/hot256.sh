#!/usr/bin/env bash
# More alternations of the sync guard at 256 (and 64) threads: run.sh's four pairs disagreed
# (new/base 1.05, 1.03, 0.75, 0.84 at 256), the machine switching regime between runs.
set -u
cd "$(dirname "$0")"
BINS=${BINS:-/work/bin}
log() { echo "== $* load $(cut -d' ' -f1-3 /proc/loadavg) $(date -u +%T)" >> log.txt; }
i=8
for side in new base base new new base base new new base base new new base base new; do
  i=$((i + 1))
  log "hot threads $i $side"
  "$BINS/hot-$side" --client newcache-threads --concurrency 64,256 --rounds 1 --duration 3 --warmup 1 \
    --table hot-$i-$side.table > hot-$i-$side.jsonl 2> hot-$i-$side.err
done
log "hot256 done"
