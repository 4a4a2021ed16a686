#!/usr/bin/env bash
# The sitting of this folder (2026-12-02): the stampede on one Redis 7 (Debian's 7.0.15,
# allkeys-lru, no persistence), the Python peers on Redis (../shared/peers/bench_stampede.py
# --backend redis: Django's RedisCache, django-redis's HerdClient, dogpile.cache.redis, ...)
# and newcache's stampede tool (--redis), alternated: peers warm, newcache warm, peers cold,
# newcache cold. Paths are this machine's. summarize.py (../shared/peers/) prints the tables:
#   python3 /work/shared/peers/summarize.py warm.jsonl; python3 ... cold.jsonl
set -u
export PEERS_DIR=/tmp/peers
PEERS=/work/shared/peers
PY=/tmp/peers/venv/bin/python
OUT=/work/main/benches/results/2026-12-02-redis-peers
PORT=22379
bash $PEERS/redis.sh start $PORT
redis-cli -p $PORT config set maxmemory-policy allkeys-lru >/dev/null
ST=/work/main/target/release/stampede
COMMON="--procs 4 --threads 16 --loader-ms 50 --ttl 2"
: > $OUT/warm.jsonl; : > $OUT/cold.jsonl
uptime > $OUT/load.txt
cd $PEERS
$PY bench_stampede.py --backend redis --redis-port $PORT $COMMON --duration 10 --json >> $OUT/warm.jsonl 2>>$OUT/err.log
uptime >> $OUT/load.txt
$ST --redis redis://127.0.0.1:$PORT/0 $COMMON --duration 10 --json >> $OUT/warm.jsonl 2>>$OUT/err.log
uptime >> $OUT/load.txt
$PY bench_stampede.py --backend redis --redis-port $PORT $COMMON --duration 3 --cold --json >> $OUT/cold.jsonl 2>>$OUT/err.log
$ST --redis redis://127.0.0.1:$PORT/0 $COMMON --duration 3 --cold --json >> $OUT/cold.jsonl 2>>$OUT/err.log
uptime >> $OUT/load.txt
bash $PEERS/redis.sh stop $PORT
