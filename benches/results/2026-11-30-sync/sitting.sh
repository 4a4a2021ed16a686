#!/usr/bin/env bash
# The sitting of 2026-11-30 (fourth session): issue 10's sync goal (the sync Cache with
# pipelined_sync against its pool), and issue 7/8's get_many(100) ratio after Item::value became
# Bytes. One quiet machine, nothing edited meanwhile. Run from the repository root.
set -euo pipefail
out=benches/results/2026-11-30-sync
cd "$(dirname "$0")/../../.."
git rev-parse HEAD > "$out/commit"; git status --porcelain >> "$out/commit"
step() { echo "$(date -u +%T) $*" >> "$out/progress"; }

step build
cargo build --release --quiet -p newcache-hot
cargo bench --bench memcached --no-run --quiet 2>/dev/null

# 1. Hot keys: the sync Cache (pipelined_sync on: newcache-threads; off: pool-threads, the
#    default pool of 16 as in issue 10's table), beside AsyncCache and async-memcached, at 1, 64
#    and 256 callers, 3 interleaved rounds.
step hot
./target/release/hot --client pool-threads --client newcache-threads --client async-cache \
    --client async-memcached --concurrency 1,64,256 --rounds 3 --duration 3 --pools default \
    --table "$out/hot-table.txt" > "$out/hot.jsonl" 2> "$out/hot-log.txt"
# The pool with a connection per thread, for reference.
step "hot per-task pool"
./target/release/hot --client pool-threads --client newcache-threads --concurrency 64 \
    --rounds 3 --duration 3 --pools per-task \
    --table "$out/hot-table-per-task.txt" > "$out/hot-per-task.jsonl" 2> "$out/hot-log-per-task.txt"

# 2. Issue 7/8: get_many(100), facade vs the memcache crate, two runs.
for run in a b; do
    step "memcached bench $run"
    cargo bench --bench memcached -- "get_many_100|get_hit" > "$out/rs-ops-$run.txt" 2>> "$out/err.log"
done
step done

# 3. Issue 11: the example web service under wrk (memory backend, one process; memcached, two).
step "webapp bench"
bash benches/webapp/run.sh "$out/webapp" > "$out/webapp.log" 2>&1
step "webapp done"
