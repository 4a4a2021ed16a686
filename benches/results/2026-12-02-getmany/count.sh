#!/usr/bin/env bash
# Instructions per call of C (the floor's `get_many` of 100 items on the memory backend) and of
# the single `get`, under callgrind: two runs per op that differ only in --calls; the
# difference of their totals over the difference of their calls. Also without SHA-1's block
# compression (`sha1::compress::compress`, inclusive): valgrind offers no SHA-NI, so it runs
# the portable code there (~1,420 instructions a key) where the machine runs SHA-NI.
# Allocations per call are the harness's own count. Usage: count.sh [BINARY]
# (default target/release/inproc).
set -eu
bin=${1:-target/release/inproc}
out=$(mktemp -d)
run() { # op calls: one callgrind run
  valgrind --tool=callgrind --callgrind-out-file="$out/cg.$1.$2" "$bin" --op "$1" --calls "$2" \
    > "$out/stdout.$1.$2" 2> "$out/stderr.$1.$2"
}
total() { grep -m1 '^summary:' "$out/cg.$1.$2" | awk '{print $2}'; }
sha() { # inclusive instructions in SHA-1's compression
  callgrind_annotate --inclusive=yes "$out/cg.$1.$2" 2>/dev/null \
    | awk '/sha1::compress::compress \[/ {gsub(",", "", $1); print $1; exit}' | grep . || echo 0
}
for spec in get-many:200:1200 get:2000:12000; do
  IFS=: read -r op lo hi <<< "$spec"
  run "$op" "$lo"; run "$op" "$hi"
  n=$((hi - lo))
  all=$(( ($(total "$op" "$hi") - $(total "$op" "$lo")) / n ))
  rest=$(( all - ($(sha "$op" "$hi") - $(sha "$op" "$lo")) / n ))
  echo "$op: $all instructions per call ($rest without SHA-1's compression); $(sed 's/.*calls, //; s/, [0-9.]* us per call//' "$out/stdout.$op.$hi")"
done
rm -r "$out"
