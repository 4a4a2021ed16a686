#!/usr/bin/env bash
# Instructions per call of one `inproc` op under callgrind: two runs that differ only in
# --calls; the difference of their totals over the difference of their calls (set-up, fill
# and warm-up cancel out). Also the count without SHA-1's block compression
# (`sha1::compress::compress`, inclusive: valgrind offers no SHA-NI, so the portable code runs
# there, ~1,420 instructions a key, where the machine runs SHA-NI), and the harness's own
# allocation count per call. memcached runs outside valgrind (started by the caller).
#
# Usage: count.sh BINARY OP LO HI [inproc arguments...]
#   benches/tool/count.sh target/release/inproc get-many 200 1200
#   benches/tool/count.sh target/release/inproc async-get 2000 12000 --server 127.0.0.1:PORT --tasks 64
# KEEP=DIR keeps the callgrind files there (for callgrind_annotate).
set -eu
bin=$1 op=$2 lo=$3 hi=$4
shift 4
extra=("$@")
out=${KEEP:-$(mktemp -d)}
mkdir -p "$out"
run() { # calls: one callgrind run
  valgrind --tool=callgrind --callgrind-out-file="$out/cg.$op.$1" "$bin" --op "$op" --calls "$1" ${extra[@]+"${extra[@]}"} \
    > "$out/stdout.$op.$1" 2> "$out/stderr.$op.$1"
}
total() { grep -m1 '^summary:' "$out/cg.$op.$1" | awk '{print $2}'; }
sha() { # inclusive instructions in SHA-1's compression
  callgrind_annotate --inclusive=yes "$out/cg.$op.$1" 2>/dev/null \
    | awk '/sha1::compress::compress \[/ {gsub(",", "", $1); print $1; exit}' | grep . || echo 0
}
run "$lo"; run "$hi"
# The calls actually made (async-get rounds --calls down to a multiple of --tasks).
calls() { sed -n 's/^[^:]*: \([0-9]*\) calls.*/\1/p' "$out/stdout.$op.$1"; }
n=$(( $(calls "$hi") - $(calls "$lo") ))
all=$(( ($(total "$hi") - $(total "$lo")) / n ))
rest=$(( all - ($(sha "$hi") - $(sha "$lo")) / n ))
echo "$op $*: $all instructions per call ($rest without SHA-1's compression); $(sed 's/.*calls, //; s/, [0-9.]* us per call//' "$out/stdout.$op.$hi")"
[ -n "${KEEP:-}" ] || rm -r "$out"
