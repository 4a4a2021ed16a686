#!/usr/bin/env bash
# The second sitting of 2026-11-30 (issues 8 and 9 landed, with their review fixes): Python peers and newcache-rs alternated
# against one memcached (-t 4, the peers' memcached.sh), mirroring 2026-11-29/sitting.sh.
# Changes vs 2026-11-30 (first sitting): step 7 (benches/memory.rs); rs-ops also runs the
# multiserver group (3 memcached of its own, get_many beside the bare-socket floor).
# Changes vs 2026-11-29: the stampede tool is now the workspace member benches/stampede
# (binary target/release/stampede); raw outputs go straight into this folder; step 6 runs
# `cargo bench --bench core` once. Criterion ran with its default times (not cut).
# Paths are this machine's; summarize.py (run in this folder) prints the tables and ratios.
set -u
export PEERS_DIR=/tmp/peers
PEERS=/work/shared/peers
PY=/tmp/peers/venv/bin/python
OUT=/work/main/benches/results/2026-11-30b
PORT=22122
bash $PEERS/memcached.sh start $PORT
cd /work/main && cargo build --release -p newcache-stampede -q && cargo bench --bench memcached --no-run -q 2>/dev/null && cargo bench --bench core --no-run -q 2>/dev/null && cargo bench --bench memory --no-run -q 2>/dev/null
RID=$(date -u +%Y%m%dT%H%M%SZ)
echo "run $RID" > $OUT/rid
ST=/work/main/target/release/stampede
COMMON="--procs 4 --threads 16 --loader-ms 50 --ttl 2"
# 1. ops, run a
cd $PEERS
echo "$(date -u +%T) 1 py-ops-a" >> $OUT/progress
$PY bench_ops.py --port $PORT --json > $OUT/py-ops-a.jsonl 2>>$OUT/err.log
echo "$(date -u +%T) 1 rs-ops-a" >> $OUT/progress
cd /work/main && MEMCACHED_SERVERS=127.0.0.1:$PORT cargo bench --bench memcached > $OUT/rs-ops-a.txt 2>&1
# 2. stampede warm
cd $PEERS
echo "$(date -u +%T) 2 py-stampede-warm" >> $OUT/progress
$PY bench_stampede.py --port $PORT $COMMON --duration 10 --json > $OUT/py-stampede-warm.jsonl 2>>$OUT/err.log
echo "$(date -u +%T) 2 rs-stampede-warm" >> $OUT/progress
$ST --servers 127.0.0.1:$PORT $COMMON --duration 10 --json --run-id $RID --plot $OUT/stampede-warm.png > $OUT/rs-stampede-warm.jsonl 2>>$OUT/err.log
# 3. stampede cold
echo "$(date -u +%T) 3 py-stampede-cold" >> $OUT/progress
$PY bench_stampede.py --port $PORT $COMMON --duration 3 --cold --json > $OUT/py-stampede-cold.jsonl 2>>$OUT/err.log
echo "$(date -u +%T) 3 rs-stampede-cold" >> $OUT/progress
$ST --servers 127.0.0.1:$PORT $COMMON --duration 3 --cold --json --run-id $RID --plot $OUT/stampede-cold.png > $OUT/rs-stampede-cold.jsonl 2>>$OUT/err.log
# 4. short cold, newcache's own modes
echo "$(date -u +%T) 4 rs-stampede-cold-short" >> $OUT/progress
$ST --servers 127.0.0.1:$PORT $COMMON --duration 1.9 --cold --json --run-id $RID --mode default --mode early --mode background > $OUT/rs-stampede-cold-short.jsonl 2>>$OUT/err.log
# 5. ops, run b
cd $PEERS
echo "$(date -u +%T) 5 py-ops-b" >> $OUT/progress
$PY bench_ops.py --port $PORT --json > $OUT/py-ops-b.jsonl 2>>$OUT/err.log
echo "$(date -u +%T) 5 rs-ops-b" >> $OUT/progress
cd /work/main && MEMCACHED_SERVERS=127.0.0.1:$PORT cargo bench --bench memcached > $OUT/rs-ops-b.txt 2>&1
bash $PEERS/memcached.sh stop $PORT
# 6. pure costs (no memcached)
echo "$(date -u +%T) 6 rs-core" >> $OUT/progress
cd /work/main && cargo bench --bench core > $OUT/rs-core.txt 2>&1
# 7. the memory backend's footprint and gets (no memcached)
echo "$(date -u +%T) 7 rs-memory" >> $OUT/progress
cd /work/main && cargo bench --bench memory > $OUT/rs-memory.txt 2>&1
echo "$(date -u +%T) finished" >> $OUT/progress
echo finished > $OUT/done
