#!/usr/bin/env bash
# The sitting that produced this folder (2026-11-29, run 20261129T232608Z): Python peers and
# newcache-rs alternated against one memcached (-t 4, the peers' memcached.sh). Paths are this
# machine's; summarize.py (run in this folder) prints the ops tables and ratios.
# One sitting: Python peers and newcache-rs alternated against one memcached (peers' settings).
set -u
export PEERS_DIR=/tmp/peers
PEERS=/work/shared/peers
PY=/tmp/peers/venv/bin/python
OUT=/tmp/sit
PORT=22122
bash $PEERS/memcached.sh start $PORT
cd /work/main && cargo build --release --example stampede -q && cargo bench --bench memcached --no-run -q 2>/dev/null
RID=$(date -u +%Y%m%dT%H%M%SZ)
echo "run $RID" > $OUT/rid
cd $PEERS
$PY bench_ops.py --port $PORT --json > $OUT/py-ops-a.jsonl 2>>$OUT/err.log
cd /work/main && MEMCACHED_SERVERS=127.0.0.1:$PORT cargo bench --bench memcached > $OUT/rs-ops-a.txt 2>&1
cd $PEERS
$PY bench_stampede.py --port $PORT --procs 4 --threads 16 --loader-ms 50 --ttl 2 --duration 10 --json > $OUT/py-stampede-warm.jsonl 2>>$OUT/err.log
/work/main/target/release/examples/stampede --servers 127.0.0.1:$PORT --procs 4 --threads 16 --loader-ms 50 --ttl 2 --duration 10 --json --run-id $RID --plot $OUT/stampede-warm.png > $OUT/rs-stampede-warm.jsonl 2>>$OUT/err.log
$PY bench_stampede.py --port $PORT --procs 4 --threads 16 --loader-ms 50 --ttl 2 --duration 3 --cold --json > $OUT/py-stampede-cold.jsonl 2>>$OUT/err.log
/work/main/target/release/examples/stampede --servers 127.0.0.1:$PORT --procs 4 --threads 16 --loader-ms 50 --ttl 2 --duration 3 --cold --json --run-id $RID --plot $OUT/stampede-cold.png > $OUT/rs-stampede-cold.jsonl 2>>$OUT/err.log
/work/main/target/release/examples/stampede --servers 127.0.0.1:$PORT --procs 4 --threads 16 --loader-ms 50 --ttl 2 --duration 1.9 --cold --json --run-id $RID --mode default --mode early --mode background > $OUT/rs-stampede-cold-short.jsonl 2>>$OUT/err.log
$PY bench_ops.py --port $PORT --json > $OUT/py-ops-b.jsonl 2>>$OUT/err.log
cd /work/main && MEMCACHED_SERVERS=127.0.0.1:$PORT cargo bench --bench memcached > $OUT/rs-ops-b.txt 2>&1
bash $PEERS/memcached.sh stop $PORT
echo finished > $OUT/done
