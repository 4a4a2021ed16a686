#!/bin/sh
# 2026-12-07c: newcache's 64 tasks (side 1) against the minimal client (side 4), each side run
# alone (`--only-side`), so that whole-process counters are that side's. Run from the project
# root after `cargo build --release -p newcache-floor --bins`.
set -e
out=benches/results/2026-12-07c
F=target/release/floor
# System calls, context switches and CPU of the process (about 620,000 gets: 3 rounds of
# 199,680 and a warm-up of 19,968).
for i in 1 2; do
  for side in 1 4; do
    perf stat -x, -e task-clock,context-switches,syscalls:sys_enter_sendto,syscalls:sys_enter_recvfrom,syscalls:sys_enter_epoll_wait,syscalls:sys_enter_futex,syscalls:sys_enter_write \
      -o $out/ps-$side-$i.csv $F --rounds 3 --path async-get-64 --only-side $side > /dev/null 2> $out/ps-$side-$i.err
  done
done
# Instructions a get (callgrind): the difference of two runs, 10,944 and 32,896 gets; also the
# facade alone (side 5) and the minimal client without its sockets (side 6).
for side in 1 4 5 6; do
  for ops in 1000 3000; do
    valgrind --tool=callgrind --callgrind-out-file=/tmp/cg-$side-$ops.out $F --rounds 1 --slices 1 \
      --ops $ops --path async-get-64 --only-side $side > /dev/null 2> $out/cg-$side-$ops.err
    callgrind_annotate --threshold=100 /tmp/cg-$side-$ops.out | grep -E '^ *[0-9,]+ \(' > $out/cg-$side-$ops.functions
  done
done
