#!/usr/bin/env bash
# Two processes of the example service over one memcached, each with a near tier, with and
# without the bus (issue 51's webapp figure):
#
#   bash benches/webapp/bus.sh OUT_DIR
#
# Two modes, each on a fresh memcached: `bus` (--bus-redis on a redis-server the script starts)
# and `near` (the near tier alone). In each:
# 1. load: both processes with --ttl-secs $TTL, each under its own `wrk -t1 -c32 -d${WINDOW}s`
#    at the same time, every connection alternating /report/1 and /page/1 (hot.lua), both
#    warmed first. Measured: requests/s per process (wrk), 5xx responses (the service's
#    `webapp_http_requests_total` in /metrics), and the database queries behind each route
#    summed over both processes (`webapp_db_queries_total`: `report` for /report/1,
#    `latest_orders` for a /page/1 render), over WINDOW / TTL expiries;
# 2. coherence: both processes restarted with --ttl-secs 60 (so that the near tier, the bus and
#    the write alone decide what is served): coherence.py renames user 42 on process 1
#    (PUT /users/42) PROBES times, each a random pause (0-2 s) after process 2 served the user
#    from its near copy, and polls process 2 (GET /users/42) until it returns the new name: the
#    time from the PUT's return to that read's.
# Then summarize_bus.py writes OUT_DIR/results.md and results.json.
#
# Environment: WINDOW (seconds of load, default 30), TTL (default 2), PROBES (default 20),
# ROWS (orders in the database, default 1000000), NEAR_MB (default 64).
set -euo pipefail
cd "$(dirname "$0")/../.."

out=${1:?usage: bash benches/webapp/bus.sh OUT_DIR}
window=${WINDOW:-30}
ttl=${TTL:-2}
probes=${PROBES:-20}
rows=${ROWS:-1000000}
near_mb=${NEAR_MB:-64}
if [ -d "$out" ] && [ -n "$(ls -A "$out")" ]; then
    echo "$out already holds results: give another directory" >&2
    exit 1
fi
mkdir -p "$out"

cargo build --release --quiet -p newcache-webapp --example webapp
target=$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
webapp=$target/release/examples/webapp
{ git rev-parse HEAD; git status --porcelain; } > "$out/commit"
{ date -u; uname -srm; echo "cores: $(nproc)"; memcached -V; redis-server --version;
  { wrk -v 2>&1 || true; } | head -1; rustc -V; } > "$out/env.txt"

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
pids=()
stop_all() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    pids=()
}
trap stop_all EXIT

wait_port() { # PORT NAME
    for _ in $(seq 50); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done
    echo "$2 did not start on $1" >&2
    return 1
}

start_memcached() { # PORT
    local user=()
    [ "$(id -u)" = 0 ] && user=(-u root)
    memcached -l 127.0.0.1 -p "$1" -U 0 -m 256 -t 2 "${user[@]}" &
    pids+=($!)
    wait_port "$1" memcached
}

start_redis() { # PORT
    redis-server --bind 127.0.0.1 --port "$1" --save '' --appendonly no --loglevel warning \
        > "$out/redis.log" 2>&1 &
    pids+=($!)
    wait_port "$1" redis-server
}

# start_service NAME PORT TTL ENV...: a service in the background, logging to $out/NAME.log;
# returns when /healthz answers 200 (the first start seeds the database).
start_service() {
    local name=$1 port=$2 ttl=$3
    shift 3
    env "$@" "$webapp" --port "$port" --ttl-secs "$ttl" --rows "$rows" > "$out/$name.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 1200); do
        curl -fs "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && return 0
        kill -0 "${pids[-1]}" 2>/dev/null || { cat "$out/$name.log" >&2; return 1; }
        sleep 0.1
    done
    echo "$name did not become healthy" >&2
    return 1
}

counters() { # PORT FILE: the service's request and query counters from /metrics
    curl -fs "http://127.0.0.1:$1/metrics" |
        grep -E '^webapp_(http_requests|db_queries)_total' > "$2" || true
}

mc=$(free_port)
rd=$(free_port)
ports=([1]=$(free_port) [2]=$(free_port))
for mode in bus near; do
    env=(MEMCACHED_SERVERS="127.0.0.1:$mc" NEAR_CACHE_MB="$near_mb" REDIS_URL= BUS_REDIS=)
    [ "$mode" = bus ] && env+=(BUS_REDIS="redis://127.0.0.1:$rd")

    echo "== $mode: load, --ttl-secs $ttl, ${window}s" >&2
    start_memcached "$mc"
    [ "$mode" = bus ] && start_redis "$rd"
    for n in 1 2; do start_service "$mode-load-$n" "${ports[$n]}" "$ttl" "${env[@]}"; done
    for port in "${ports[@]}"; do
        for path in /report/1 /page/1; do curl -fs "http://127.0.0.1:$port$path" >/dev/null; done
    done
    for n in 1 2; do counters "${ports[$n]}" "$out/$mode-counters-$n-before.txt"; done
    wrk_pids=()
    for n in 1 2; do
        wrk -t1 -c32 -d"${window}s" --latency -s benches/webapp/hot.lua \
            "http://127.0.0.1:${ports[$n]}" > "$out/$mode-wrk-$n.txt" &
        wrk_pids+=($!)
    done
    for pid in "${wrk_pids[@]}"; do wait "$pid"; done
    for n in 1 2; do
        port=${ports[$n]}
        counters "$port" "$out/$mode-counters-$n-after.txt"
        curl -fs "http://127.0.0.1:$port/stats" > "$out/$mode-load-stats-$n.json"
    done
    grep -h Requests/sec "$out/$mode-wrk-"*.txt >&2
    stop_all

    echo "== $mode: coherence, --ttl-secs 60, $probes writes" >&2
    start_memcached "$mc"
    [ "$mode" = bus ] && start_redis "$rd"
    for n in 1 2; do start_service "$mode-coherence-$n" "${ports[$n]}" 60 "${env[@]}"; done
    python3 benches/webapp/coherence.py --writer "${ports[1]}" --reader "${ports[2]}" \
        --trials "$probes" \
        --tag "$mode" "$out/$mode-coherence.tsv" >&2
    for n in 1 2; do
        curl -fs "http://127.0.0.1:${ports[$n]}/stats" > "$out/$mode-coherence-stats-$n.json"
    done
    stop_all
done

python3 benches/webapp/summarize_bus.py "$out" --window "$window" --ttl "$ttl"
echo "results in $out" >&2
