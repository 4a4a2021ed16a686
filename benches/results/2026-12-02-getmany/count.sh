#!/usr/bin/env bash
# Instructions per call of C (the floor's `get_many` of 100 items on the memory backend) and of
# the single `get`, under callgrind: two runs per op that differ only in --calls; the
# difference of their totals over the difference of their calls. Allocations per call are the
# harness's own count. Usage: count.sh [BINARY] (default target/release/inproc).
set -eu
bin=${1:-target/release/inproc}
out=$(mktemp -d)
total() { # op calls -> total instructions of the run
  valgrind --tool=callgrind --callgrind-out-file="$out/cg.$1.$2" "$bin" --op "$1" --calls "$2" \
    > "$out/stdout.$1.$2" 2> "$out/stderr.$1.$2"
  grep -m1 '^summary:' "$out/cg.$1.$2" | awk '{print $2}'
}
for spec in get-many:200:1200 get:2000:12000; do
  IFS=: read -r op lo hi <<< "$spec"
  a=$(total "$op" "$lo"); b=$(total "$op" "$hi")
  echo "$op: $(( (b - a) / (hi - lo) )) instructions per call; $(sed 's/.*calls, //; s/, [0-9.]* us per call//' "$out/stdout.$op.$hi")"
done
rm -r "$out"
