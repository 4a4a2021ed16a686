#!/usr/bin/env bash
# The sitting of 2026-11-30 (third session): issue 10's figures, and issue 7/8's get_many ratio,
# on one quiet machine, nothing edited meanwhile. Run from the repository root.
set -euo pipefail
out=benches/results/2026-11-30-async
cd "$(dirname "$0")/../../.."
git rev-parse HEAD > "$out/commit"; git status --porcelain >> "$out/commit"
step() { echo "$(date -u +%T) $*" >> "$out/progress"; }

step build
cargo build --release --quiet -p newcache-bench -p newcache-stampede
cargo bench --bench memcached --no-run --quiet 2>/dev/null
cargo test --release --lib --no-run --quiet 2>/dev/null

# 1. Hot keys: every client at 1, 64 and 256 callers, interleaved rounds, both runtimes.
for rt in multi-thread current-thread; do
    step "hot $rt"
    ./target/release/bench hot --runtime "$rt" --rounds 2 --duration 3 --table "$out/hot-table-$rt.txt" \
        > "$out/hot-$rt.jsonl" 2> "$out/hot-log-$rt.txt"
done

# 2. (Not run any more.) engine-measure.txt, the engine's own 1-task ratio to a bare socket and
#    its throughput, came from an ignored unit test of the engine (engine::tests::measure) that
#    has since been removed: the library's figures are made with benches/tool through the
#    public API. The file stays as the record NOTES.md quotes; git history has the test.

# 3. The stampede, async modes beside the sync default (warm, 64 workers in 4 processes).
step stampede
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
user=(); [ "$(id -u)" = 0 ] && user=(-u root)
memcached -l 127.0.0.1 -p "$port" -t 4 -U 0 "${user[@]}" & mc=$!
trap 'kill $mc 2>/dev/null || true' EXIT
sleep 0.5
./target/release/stampede --servers "127.0.0.1:$port" --procs 4 --threads 16 --loader-ms 50 --ttl 2 \
    --duration 10 --mode default --mode async --mode background --mode async-background --json \
    > "$out/stampede-warm.jsonl" 2> "$out/stampede-err.txt"
kill $mc; trap - EXIT

# 4. Issue 7/8: get_many(100), facade vs the memcache crate, two interleaved runs.
for run in a b; do
    step "memcached bench $run"
    cargo bench --bench memcached -- "get_many_100|get_hit" > "$out/rs-ops-$run.txt" 2>> "$out/err.log"
done
step done
