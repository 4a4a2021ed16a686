#!/usr/bin/env bash
# Instructions per get on the floor's Redis paths, newcache and redis-rs, under callgrind: two
# runs per path and side that differ only in --calls; the difference of their totals over the
# difference of their calls (the fill, the connects and the warm-up cancel). Needs a running
# server: URL=redis://127.0.0.1:PORT/0. Usage: count.sh [BINARY] (default
# target/release/redis-count); PATHS and SIDES narrow it; OUT keeps the callgrind files.
set -eu
bin=${1:-target/release/redis-count}
url=${URL:?set URL=redis://host:port/db}
paths=${PATHS:-sync multi current tasks64}
sides=${SIDES:-newcache redis-rs}
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
run() { # path side calls: one callgrind run
  valgrind --tool=callgrind --callgrind-out-file="$out/cg.$1.$2.$3" "$bin" --url "$url" \
    --path "$1" --side "$2" --calls "$3" > "$out/stdout.$1.$2.$3" 2> "$out/stderr.$1.$2.$3"
}
total() { grep -m1 '^summary:' "$out/cg.$1.$2.$3" | awk '{print $2}'; }
sha() { # inclusive instructions in SHA-1's compression (portable code under valgrind)
  callgrind_annotate --inclusive=yes "$out/cg.$1.$2.$3" 2>/dev/null \
    | awk '/sha1::compress::compress/ {gsub(",", "", $1); print $1; exit}' | grep . || echo 0
}
for path in $paths; do
  lo=1280; hi=6400
  for side in $sides; do
    run "$path" "$side" "$lo"; run "$path" "$side" "$hi"
    n=$((hi - lo))
    all=$(( ($(total "$path" "$side" "$hi") - $(total "$path" "$side" "$lo")) / n ))
    rest=$(( all - ($(sha "$path" "$side" "$hi") - $(sha "$path" "$side" "$lo")) / n ))
    echo "$path $side: $all instructions per get ($rest without SHA-1's compression); $(sed 's/.*gets; //' "$out/stdout.$path.$side.$hi")"
  done
done
[ -n "${OUT:-}" ] || rm -r "$out"
