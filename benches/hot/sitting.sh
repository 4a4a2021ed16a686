#!/usr/bin/env bash
# The "async for web apps" sitting (issue 10): every client at concurrency 1, 64 and 256 on a
# memcached the harness starts, ROUNDS interleaved rounds (default 3) of 5 s after 1 s of warm-up,
# on tokio's multi-thread runtime (2 workers), then on the current-thread one.
#
# Writes benches/results/<UTC date>-async/ (or $OUT): hot-<runtime>.jsonl (the JSON lines),
# table-<runtime>.txt (medians over rounds), log-<runtime>.txt (progress), commit (the commit and
# `git status` of the tree measured), env.txt. Other arguments go to both runs.
set -euo pipefail
cd "$(dirname "$0")/../.."

out=${OUT:-benches/results/$(date -u +%Y-%m-%d)-async}
if [ -d "$out" ] && [ -n "$(ls -A "$out")" ]; then
    echo "$out already holds results: set OUT=another/dir" >&2
    exit 1
fi
mkdir -p "$out"

cargo build --release --quiet -p newcache-hot
bin=${CARGO_TARGET_DIR:-target}/release/hot

{ git rev-parse HEAD; git status --porcelain; } > "$out/commit"
{ date -u; uname -srm; echo "cores: $(nproc)"; memcached -V; rustc -V; } > "$out/env.txt"

for rt in multi-thread current-thread; do
    echo "== $rt" >&2
    # stderr (progress, then the table) to the terminal and the log; stdout (JSON) to its file.
    "$bin" --runtime "$rt" --rounds "${ROUNDS:-3}" --table "$out/table-$rt.txt" "$@" \
        2>&1 > "$out/hot-$rt.jsonl" | tee "$out/log-$rt.txt" >&2
done
echo "results in $out" >&2
