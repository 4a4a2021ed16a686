#!/usr/bin/env bash
# Instructions per call of each `bench near --figure hit` side under callgrind (one caller: sync
# on the main thread, async in one task), by value kind: two runs that differ only in --ops, the
# difference of their totals over the difference of their calls (a run makes 1.1 x --ops calls:
# its warm-up and one round; set-up and fill cancel out). memcached runs outside valgrind.
# Usage (from the project root): benches/results/near/counts.sh > benches/results/near/counts.md
set -eu
B=${BENCH:-target/release/bench}
lo=${LO:-10000} hi=${HI:-60000}
tmp=$(mktemp -d)
run() { # callers kind side ops
  valgrind --tool=callgrind --callgrind-out-file="$tmp/cg.$1.$2.$3.$4" "$B" near --figure hit \
    --callers "$1" --kind "$2" --only-side "$3" --rounds 1 --slices 1 --ops "$4" \
    > /dev/null 2> "$tmp/err.$1.$2.$3.$4"
  grep -m1 '^summary:' "$tmp/cg.$1.$2.$3.$4" | awk '{print $2}'
}
names=("" "get_arc" "quick_cache get (Arc<T>)" "get" "quick_cache get + rmp_serde decode")
echo "| callers | value | side | instructions per call |"
echo "|---|---|---|---|"
for callers in sync-one async-one; do
  for kind in struct string; do
    for side in 1 2 3 4; do
      a=$(run $callers $kind $side $lo) b=$(run $callers $kind $side $hi)
      echo "| $callers | $kind | ${names[$side]} | $(( (b - a) * 10 / (11 * (hi - lo)) )) |"
    done
  done
done
rm -r "$tmp"
