#!/bin/sh
# Issue 50's figures of the near tier (`bench near`), one memcached 1.6 `-t 1` started by the
# tool. Run from the project root after `cargo build --release -p newcache-bench`.
# - hit: two runs of the four caller modes, both value kinds, 9 rounds of 1,000,000 calls a side.
# - rewrite: 9 rounds for each writer (a second process; a thread whose cache has no near tier;
#   a thread whose cache has one).
# - outage: memcached down 5 s between 5 s calm phases, two runs of each side.
# - counts: instructions per call of each hit side under callgrind (counts.sh).
set -e
out=benches/results/near
B=${BENCH:-target/release/bench}
for i in 1 2; do
  $B near --figure hit --json $out/hit-$i.json > $out/hit-$i.md 2> $out/hit-$i.err
done
$B near --figure outage --json $out/outage.json > $out/outage.md 2> $out/outage.err
for w in process thread thread-near; do
  $B near --figure rewrite --writer $w --json $out/rewrite-$w.json \
    > $out/rewrite-$w.md 2> $out/rewrite-$w.err
done
BENCH=$B $out/counts.sh > $out/counts.md
