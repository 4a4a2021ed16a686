#!/usr/bin/env bash
# The example service with a near tier over memcached against the memory backend alone, one
# process each (issue 50's webapp figure):
#
#   bash benches/webapp/near.sh OUT_DIR
#
# Both services run side by side (each idle while the other is measured); `wrk -t2 -c64
# -d$DURATION` on /report/1 and /page/1 (each warmed first), ROUNDS rounds alternating which
# service goes first; a path's ratio is the median of its rounds' near/memory requests/s.
# Environment: DURATION (default 5s), ROUNDS (default 5), ROWS (default 1000000), NEAR_MB
# (default 64).
set -euo pipefail
cd "$(dirname "$0")/../.."

out=${1:?usage: bash benches/webapp/near.sh OUT_DIR}
duration=${DURATION:-5s}
rounds=${ROUNDS:-5}
rows=${ROWS:-1000000}
near_mb=${NEAR_MB:-64}
mkdir -p "$out"

cargo build --release --quiet -p newcache-webapp --example webapp
target=$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
webapp=$target/release/examples/webapp
{ git rev-parse HEAD; git status --porcelain; } > "$out/commit"
{ date -u; uname -srm; echo "cores: $(nproc)"; memcached -V; rustc -V; } > "$out/env.txt"

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT

mc=$(free_port)
user=()
[ "$(id -u)" = 0 ] && user=(-u root)
memcached -l 127.0.0.1 -p "$mc" -U 0 -m 256 -t 2 "${user[@]}" &
pids+=($!)

start() {
    local name=$1 port=$2
    shift 2
    env "$@" "$webapp" --port "$port" --rows "$rows" > "$out/$name.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 1200); do
        curl -fs "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    echo "$name did not become healthy" >&2
    exit 1
}
memory=$(free_port)
near=$(free_port)
start memory "$memory" MEMCACHED_SERVERS= NEAR_CACHE_MB=0
start near "$near" MEMCACHED_SERVERS="127.0.0.1:$mc" NEAR_CACHE_MB="$near_mb"

rps() { # PORT PATH LABEL
    wrk -t2 -c64 -d"$duration" "http://127.0.0.1:$1$2" > "$out/$3.txt"
    awk '/Requests\/sec/ {print $2}' "$out/$3.txt"
}
for path in /report/1 /page/1; do
    for port in "$memory" "$near"; do curl -fs "http://127.0.0.1:$port$path" >/dev/null; done
done
printf 'path\tround\tmemory_rps\tnear_rps\tratio\n' > "$out/rounds.tsv"
for round in $(seq "$rounds"); do
    for path in /report/1 /page/1; do
        tag=$(echo "$path" | tr -c 'a-z0-9\n' '_')
        if ((round % 2)); then
            m=$(rps "$memory" "$path" "memory$tag-$round")
            n=$(rps "$near" "$path" "near$tag-$round")
        else
            n=$(rps "$near" "$path" "near$tag-$round")
            m=$(rps "$memory" "$path" "memory$tag-$round")
        fi
        printf '%s\t%s\t%s\t%s\t%s\n' "$path" "$round" "$m" "$n" \
            "$(python3 -c "print(f'{$n/$m:.3f}')")" >> "$out/rounds.tsv"
    done
done
curl -fs "http://127.0.0.1:$near/stats" > "$out/near-stats.json" || true
python3 - "$out/rounds.tsv" <<'PY' | tee "$out/results.md"
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
print("| path | memory req/s (median) | near over memcached req/s (median) | ratio (median of rounds) |")
print("|---|---|---|---|")
for path in ("/report/1", "/page/1"):
    r = [x for x in rows if x["path"] == path]
    med = lambda k: statistics.median(float(x[k]) for x in r)
    print(f"| {path} | {med('memory_rps'):.0f} | {med('near_rps'):.0f} | {med('ratio'):.3f} |")
PY
