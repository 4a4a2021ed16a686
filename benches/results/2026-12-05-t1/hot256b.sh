#!/usr/bin/env bash
# 256 threads alone, 24 more runs alternated (base new new base ...): is the low mode
# (~125k gets/s against ~175k) more frequent for one binary?
set -u
cd "$(dirname "$0")"
BINS=${BINS:-/work/bin}
log() { echo "== $* load $(cut -d' ' -f1-3 /proc/loadavg) $(date -u +%T)" >> log.txt; }
i=100
for k in 1 2 3 4 5 6; do
  for side in base new new base; do
    i=$((i + 1))
    log "hot threads 256 $i $side"
    "$BINS/hot-$side" --client newcache-threads --concurrency 256 --rounds 1 --duration 3 --warmup 1 \
      --table hot-$i-$side.table > hot-$i-$side.jsonl 2> hot-$i-$side.err
  done
done
log "hot256b done"
