#!/bin/sh
# 2026-12-07c: how far clients of 64 awaiting tasks get on this machine. Run from the project
# root after `cargo build --release -p newcache-bench -- floorbins`; nothing else running.
#
# 1. The minimal client in six shapes (batchers x lines in flight x keys a line), two passes
#    alternated, 3 rounds each (every run also measures newcache, async-memcached, the ceiling,
#    the minimal client without its sockets and the facade alone).
# 2. The README's 64-task rows: two runs of the default shapes, 9 rounds each.
# 3. The minimal client's batchers as one task or two (below).
# 4. newcache and the minimal client with glibc's malloc or jemalloc (below).
set -e
out=benches/results/2026-12-07c
F=target/release/bench floor
for i in 1 2; do
  for shape in 2x4x16 2x8x8 2x2x32 2x4x32 2x1x64 2x4x8; do
    $F --rounds 3 --path async-get-64 --minimal $shape --json $out/shape-$shape-$i.json \
      > $out/shape-$shape-$i.md 2> $out/shape-$shape-$i.err
  done
done
for i in 1 2; do
  $F --rounds 9 --path async-get-64 --json $out/final-a64-$i.json > $out/final-a64-$i.md 2> $out/final-a64-$i.err
done
# 3. The minimal client's batchers as one task or two (a writer and a reader, newcache's shape
#    of a connection), beside newcache alone: 5 rounds, three passes alternated.
for i in 1 2 3; do
  for mode in one split; do
    flag=; [ $mode = split ] && flag=--minimal-split
    $F --rounds 5 --path async-get-64 --only-side 1 --only-side 4 $flag --json $out/tasks-$mode-$i.json \
      > $out/tasks-$mode-$i.md 2> $out/tasks-$mode-$i.err
  done
done
# 4. newcache and the minimal client alone, with glibc's malloc or jemalloc 5 (Debian's
#    libjemalloc2, preloaded into the floor only: the memcached it starts drop LD_PRELOAD):
#    four passes alternated, 5 rounds.
for i in 1 2 3 4; do
  for mode in glibc je; do
    pre=; [ $mode = je ] && pre=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
    LD_PRELOAD=$pre $F --rounds 5 --path async-get-64 --only-side 1 --only-side 4 \
      > $out/alloc-$mode-$i.md 2> $out/alloc-$mode-$i.err
  done
done
