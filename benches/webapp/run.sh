#!/usr/bin/env bash
# The webapp bench (issue 11, section 5): wrk against the example service, on the memory backend
# (one process) and on a real memcached (two processes on different ports).
#
#   bash benches/webapp/run.sh OUT_DIR
#
# Environment: DURATION (wrk's -d, default 10s), ROUNDS (of /static and /page/1, default 3),
# ROWS (orders in the database, default 1000000),
# EXPIRY_WINDOW (seconds of the --ttl-secs 2 run, default 12: six expiries), DB (the SQLite file,
# default target/webapp/webapp-ROWS.sqlite; seeded on first use).
#
# 1. installs wrk (and memcached) from Debian's packages when missing;
# 2. builds the service and the plot tool (release);
# 3. throughput, --ttl-secs 60: `wrk -t2 -c64 -d$DURATION --latency` on /static (the ceiling),
#    /report/1 (cached, warmed first), /report/1?cache=off and /page/1. On memcached the two
#    processes are driven at the same time by one wrk each with half the threads and connections
#    (-t1 -c32): the same 64 connections in all as on the memory backend, and each process gets
#    exactly half, which one wrk over two URLs cannot do (wrk takes one URL). Requests/s are
#    summed; p50 and p99 are the worse of the two processes'. /static and /page/1 are run
#    ROUNDS times, interleaved (loopback throughput on these VMs drifts between runs): their
#    ratio is the median of the rounds' ratios;
# 4. database queries per expiry, --ttl-secs 2: /report/1 under the same load for EXPIRY_WINDOW
#    seconds; `db_queries` from /stats before and after, summed across processes, over the number
#    of expiries in the window; each process's per-second series (GET /series) is saved and
#    plotted (webapp-plot);
# 5. writes OUT_DIR/results.json, OUT_DIR/results.md, the raw wrk outputs, the series and plots.
set -euo pipefail
cd "$(dirname "$0")/../.."

out=${1:?usage: bash benches/webapp/run.sh OUT_DIR}
duration=${DURATION:-10s}
rounds=${ROUNDS:-3}
rows=${ROWS:-1000000}
window=${EXPIRY_WINDOW:-12}
if [ -d "$out" ] && [ -n "$(ls -A "$out")" ]; then
    echo "$out already holds results: give another directory" >&2
    exit 1
fi
mkdir -p "$out"

need=()
command -v wrk >/dev/null 2>&1 || need+=(wrk)
command -v memcached >/dev/null 2>&1 || need+=(memcached)
command -v curl >/dev/null 2>&1 || need+=(curl)
if ((${#need[@]})); then
    echo "== installing ${need[*]}" >&2
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

echo "== building (release)" >&2
cargo build --release --quiet -p newcache-webapp --example webapp --bin webapp-plot
target=$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
webapp=$target/release/examples/webapp
plot=$target/release/webapp-plot
db_arg=()
[ -n "${DB:-}" ] && db_arg=(--db "$DB")

{ git rev-parse HEAD; git status --porcelain; } > "$out/commit"
{ date -u; uname -srm; echo "cores: $(nproc)"; memcached -V; { wrk -v 2>&1 || true; } | head -1; rustc -V; } \
    > "$out/env.txt"

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

# start_service NAME PORT TTL [MEMCACHED_ADDR]: a service in the background, logging to
# $out/NAME.log; returns when /healthz answers 200 (seeding the database may take a while).
start_service() {
    local name=$1 port=$2 ttl=$3 servers=${4:-}
    MEMCACHED_SERVERS=$servers "$webapp" --port "$port" --ttl-secs "$ttl" --rows "$rows" \
        "${db_arg[@]}" > "$out/$name.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 1200); do
        curl -fs "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && return 0
        kill -0 "${pids[-1]}" 2>/dev/null || { cat "$out/$name.log" >&2; return 1; }
        sleep 0.1
    done
    echo "$name did not become healthy" >&2
    return 1
}

start_memcached() {
    local port=$1 user=()
    [ "$(id -u)" = 0 ] && user=(-u root)
    memcached -l 127.0.0.1 -p "$port" -U 0 -m 256 -t 2 "${user[@]}" &
    pids+=($!)
    for _ in $(seq 50); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && return 0; sleep 0.1; done
    echo "memcached did not start on $port" >&2
    return 1
}

db_queries() { # PORT...: the sum of their db_queries
    local total=0 port
    for port in "$@"; do
        total=$((total + $(curl -fs "http://127.0.0.1:$port/stats" |
            python3 -c 'import json, sys; print(json.load(sys.stdin)["db_queries"])')))
    done
    echo "$total"
}

# load BACKEND ROUTE_NAME PATH DURATION PORT...: wrk on PATH of every port at once, 64
# connections and 2 threads in all; outputs in $out/wrk-BACKEND-ROUTE_NAME-PORT.txt, and the
# database queries it caused in $out/wrk-BACKEND-ROUTE_NAME.queries.
load() {
    local backend=$1 name=$2 path=$3 dur=$4
    shift 4
    local n=$# threads connections before wrk_pids=() port
    threads=$((2 / n)); connections=$((64 / n))
    ((threads >= 1)) || threads=1
    before=$(db_queries "$@")
    for port in "$@"; do
        wrk -t"$threads" -c"$connections" -d"$dur" --latency "http://127.0.0.1:$port$path" \
            > "$out/wrk-$backend-$name-$port.txt" &
        wrk_pids+=($!)
    done
    for pid in "${wrk_pids[@]}"; do wait "$pid"; done
    echo $(($(db_queries "$@") - before)) > "$out/wrk-$backend-$name.queries"
    echo "   $backend $name: $(grep -h Requests/sec "$out/wrk-$backend-$name-"*.txt | tr -s ' ' | tr '\n' ' ')" >&2
}

throughput() { # BACKEND PORT...
    local backend=$1
    shift
    for port in "$@"; do curl -fs "http://127.0.0.1:$port/report/1" >/dev/null; done # warm
    load "$backend" static /static "$duration" "$@"
    load "$backend" report-cached /report/1 "$duration" "$@"
    load "$backend" report-uncached '/report/1?cache=off' "$duration" "$@"
    load "$backend" page /page/1 "$duration" "$@"
    local r
    for r in $(seq 2 "$rounds"); do
        load "$backend" "static-r$r" /static "$duration" "$@"
        load "$backend" "page-r$r" /page/1 "$duration" "$@"
    done
}

expiries() { # BACKEND PORT...
    local backend=$1 port
    shift
    for port in "$@"; do curl -fs "http://127.0.0.1:$port/report/1" >/dev/null; done # warm
    load "$backend" expiry /report/1 "${window}s" "$@"
    sleep 1 # the last second's sample
    for port in "$@"; do
        curl -fs "http://127.0.0.1:$port/series" > "$out/series-$backend-$port.json"
    done
    "$plot" --out "$out/plot-$backend.svg" \
        --title "webapp, $backend, ttl 2 s: /report/1 under wrk -c64" "$out/series-$backend-"*.json >&2
}

echo "== memory backend, one process" >&2
port=$(free_port)
start_service memory "$port" 60
throughput memory "$port"
stop_all
start_service memory-ttl2 "$port" 2
expiries memory "$port"
stop_all

echo "== memcached, two processes" >&2
mc=$(free_port)
start_memcached "$mc"
p1=$(free_port)
p2=$(free_port)
start_service memcached-a "$p1" 60 "127.0.0.1:$mc"
start_service memcached-b "$p2" 60 "127.0.0.1:$mc"
throughput memcached "$p1" "$p2"
stop_all
start_memcached "$mc"
start_service memcached-ttl2-a "$p1" 2 "127.0.0.1:$mc"
start_service memcached-ttl2-b "$p2" 2 "127.0.0.1:$mc"
expiries memcached "$p1" "$p2"
stop_all

python3 benches/webapp/summarize.py "$out" --window "$window" --ttl 2 --duration "$duration"
echo "results in $out" >&2
